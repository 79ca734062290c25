/* The op table: one declaration per op, read by eager execution, autograd, tracing, the
 * partitioner's cost model, the printer and the executor.
 *
 * An op is called with a flat array of ag_arg values laid out as its schema says (ATen's
 * schema language, e.g. "addmm(Tensor self, Tensor mat1, Tensor mat2, *, Scalar beta=1,
 * Scalar alpha=1) -> Tensor"). The dispatcher (ag_op_call) checks the arguments against the
 * schema, runs the meta function to get every output's dtype, shape and strides, allocates the
 * outputs (or aliases the input for views and in-place ops), runs the kernel for the dtype, and,
 * when grad mode is on and an input requires grad, records an autograd node that will run the
 * backward rule. Users register their own ops the same way (ag_op_register). */
#ifndef AOTGRAD_OPTABLE_H
#define AOTGRAD_OPTABLE_H

#include "core.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum ag_arg_kind {
    AG_ARG_NONE = 0, /* None: an omitted optional */
    AG_ARG_TENSOR,
    AG_ARG_TENSORS, /* Tensor[] or Tensor?[] (elements may be NULL for the latter) */
    AG_ARG_INT,
    AG_ARG_FLOAT, /* float and Scalar */
    AG_ARG_BOOL,
    AG_ARG_INTS, /* int[] */
    AG_ARG_DTYPE,
    AG_ARG_STR,
} ag_arg_kind;

typedef struct ag_arg {
    ag_arg_kind kind;
    int n; /* element count for TENSORS and INTS */
    union {
        ag_tensor *t;
        ag_tensor **ts;
        int64_t i;
        double f;
        bool b;
        const int64_t *ints;
        ag_dtype dt;
        const char *s;
    } u;
} ag_arg;

/* Brace initializers for building argument arrays. */
#define AG_A_T(x) ((ag_arg){.kind = AG_ARG_TENSOR, .u.t = (x)})
#define AG_A_TS(v, cnt) ((ag_arg){.kind = AG_ARG_TENSORS, .n = (cnt), .u.ts = (v)})
#define AG_A_I(x) ((ag_arg){.kind = AG_ARG_INT, .u.i = (x)})
#define AG_A_F(x) ((ag_arg){.kind = AG_ARG_FLOAT, .u.f = (x)})
#define AG_A_B(x) ((ag_arg){.kind = AG_ARG_BOOL, .u.b = (x)})
#define AG_A_INTS(v, cnt) ((ag_arg){.kind = AG_ARG_INTS, .n = (cnt), .u.ints = (v)})
#define AG_A_DT(x) ((ag_arg){.kind = AG_ARG_DTYPE, .u.dt = (x)})
#define AG_A_S(x) ((ag_arg){.kind = AG_ARG_STR, .u.s = (x)})
#define AG_A_NONE ((ag_arg){.kind = AG_ARG_NONE})

/* Output metadata computed by a meta function. For view ops `offset` is the storage offset of
 * the view (meta functions of other ops leave it 0 and give contiguous strides). */
typedef struct ag_tmeta {
    ag_dtype dtype;
    int ndim;
    int64_t sizes[AG_MAX_DIMS];
    int64_t strides[AG_MAX_DIMS];
    int64_t offset;
} ag_tmeta;

#define AG_MAX_OUTPUTS 64
#define AG_MAX_ARGS 16

/* Op flags. */
enum {
    AG_OP_POINTWISE = 1u << 0,
    AG_OP_REDUCTION = 1u << 1,
    AG_OP_VIEW = 1u << 2,              /* output 0 aliases tensor argument 0 */
    AG_OP_INPLACE = 1u << 3,           /* output 0 is tensor argument 0, written in place */
    AG_OP_RANDOM = 1u << 4,            /* draws from the generator */
    AG_OP_COMPUTE_INTENSIVE = 1u << 5, /* matmul, conv: never recomputed by the partitioner */
    AG_OP_NONDIFF = 1u << 6,           /* no gradient flows through (comparisons, argmax, ...) */
    AG_OP_FACTORY = 1u << 7,           /* creates a tensor from no tensor input */
    AG_OP_EFFECTFUL = 1u << 8,         /* has side effects: never reordered or eliminated */
    AG_OP_BACKWARD_HELPER = 1u << 9,   /* exists to express another op's backward */
    /* Composite (ATen's CompositeImplicitAutograd): always runs its decomposition, so traces
     * and autograd see the ops it is made of (linear -> t + addmm). */
    AG_OP_COMPOSITE = 1u << 10,
    /* An in-place view op (t_, transpose_, unsqueeze_, as_strided_): it changes only tensor
     * argument 0's sizes, strides and offset, to what the meta function says (flag it
     * AG_OP_INPLACE too). */
    AG_OP_INPLACE_VIEW = 1u << 11,
    /* Writes one value to every element of its mutated argument (fill_, zero_): allowed on a
     * tensor whose elements share memory (an expanded view), as PyTorch allows fill_. Every
     * other write into such a tensor is refused by the dispatcher. */
    AG_OP_FILL = 1u << 12,
    /* A collective (_c10d_functional::*): talks to the other ranks of a process group. Never
     * removed, merged, recomputed or reordered across another collective by a pass or a
     * partitioner, except that a node tagged AG_MUST_RECOMPUTE (FSDP's gathers) is recomputed
     * in the backward as tagged. */
    AG_OP_COLLECTIVE = 1u << 13,
    /* A higher-order op whose argument 0 is a get_attr of a subgraph (invoke_subgraph; see
     * include/aotgrad/graph.h, "subgraphs"): the graph layer infers its outputs from the
     * subgraph's and runs it by running the subgraph; it has no eager kernel. */
    AG_OP_SUBGRAPH = 1u << 14,
};

/* ---- placements: how a tensor lives on a 1-D device mesh (DTensor's) ----
 * Replicate(): every rank holds the whole tensor. Shard(d): dim d is split into `world` equal
 * contiguous chunks, rank r holding chunk r. With split_factor k > 1 (DTensor's _StridedShard,
 * written "StridedShard(d, k)"), dim d is first cut into k equal blocks and each block is
 * sharded as above, rank r holding chunk r of every block, in block order: the layout of a
 * fused q/k/v weight whose heads are split across ranks. Partial(op): every rank holds a
 * tensor of the full shape and the value is their sum (AG_PARTIAL_SUM) or mean
 * (AG_PARTIAL_AVG). The zero value is Replicate(). */
typedef enum ag_placement_kind {
    AG_REPLICATE = 0,
    AG_SHARD = 1,
    AG_PARTIAL = 2,
} ag_placement_kind;
typedef enum ag_partial_op {
    AG_PARTIAL_SUM = 0,
    AG_PARTIAL_AVG = 1,
} ag_partial_op;
typedef struct ag_placement {
    ag_placement_kind kind;
    int dim;          /* AG_SHARD: the split dim (>= 0) */
    int split_factor; /* AG_SHARD: 0 or 1 for a plain Shard, k > 1 for StridedShard(dim, k) */
    ag_partial_op op; /* AG_PARTIAL */
} ag_placement;
#define AG_P_REPLICATE ((ag_placement){.kind = AG_REPLICATE})
#define AG_P_SHARD(d) ((ag_placement){.kind = AG_SHARD, .dim = (d)})
#define AG_P_PARTIAL(o) ((ag_placement){.kind = AG_PARTIAL, .op = (o)})

/* "Replicate()", "Shard(0)", "StridedShard(0, 3)", "Partial(sum)", "Partial(avg)" into buf. */
AG_API char *ag_placement_str(ag_placement p, char *buf, size_t n);
/* Parses what ag_placement_str prints; 0, or AG_EINVAL with a message. */
AG_API int ag_placement_parse(const char *s, ag_placement *out);
AG_API bool ag_placement_eq(ag_placement a, ag_placement b); /* split_factor 0 == 1 */

/* ---- sharding rules ----
 * An op's rule says, for the placements its tensor inputs have, which placements they must
 * take (want) so that running the op on each rank's local pieces gives outputs of known
 * placements (out) without communication. The sharding pass (parallel.h) calls it for each node
 * and inserts the collectives that move every input from `in` to `want`. The rule sees global
 * metadata only (no data).
 *
 * The pass presets want = in, out = Replicate() and local_args = args. A rule returns 0 after
 * setting want and out (and local_args where a non-tensor argument must change on a rank: a
 * view's or an expand's sizes, an arange's end; use the ints scratch for new int lists), or
 * AG_SHARD_NO_RULE when it has no strategy for these placements: the pass then replicates every
 * input and runs the op whole on every rank (and lists the op in its summary). A rule must not
 * ask for an uneven Shard: a dim sharded on `world` ranks has a size divisible by world (and by
 * world x split_factor: ag_shard_divisible). Rules are pure functions of the
 * context. */
#define AG_SHARD_NO_RULE 1
typedef struct ag_shard_ctx {
    const struct ag_opdef *op;
    const ag_arg *args; /* the call's arguments in schema order, defaults filled */
    int nargs;
    /* tensor inputs in schema order, Tensor[] elements each one; an omitted Tensor? (None)
     * takes its number too (as in ag_bwctx), with zeroed in_meta and placement Replicate() */
    int ntensor_inputs;
    const ag_tmeta *in_meta; /* global metadata of each tensor input */
    const ag_placement *in;  /* placement of each tensor input */
    int noutputs;
    const ag_tmeta *out_meta; /* global metadata of each output */
    int world;                /* ranks on the mesh (>= 1) */
    ag_placement *want;       /* [ntensor_inputs], preset to in */
    ag_placement *out;        /* [noutputs], preset to Replicate() */
    ag_arg *local_args;       /* [nargs], preset to args; tensor entries are ignored */
    int64_t ints[AG_MAX_ARGS][AG_MAX_DIMS]; /* scratch for local int lists */
} ag_shard_ctx;
typedef int (*ag_shard_fn)(ag_shard_ctx *c);
/* True when dim d of size n can be Shard()ed on world ranks (with split factor k). */
AG_API bool ag_shard_divisible(int64_t n, int world, int split_factor);
/* Rules usable by any op (ag_opdef.shard): elementwise with broadcasting, no Partial
 * inputs; the same allowing Partial where the op is linear in that input (add, sub, neg: all
 * inputs Partial with one op; mul, div: one Partial input times Replicate() others). */
/* The rule of op definition `def` for the call in c, as the sharding pass asks it (and any
 * other compiler may): def->shard when set, else the pointwise rule for a functional
 * AG_OP_POINTWISE op (not in-place, random or effectful), else AG_SHARD_NO_RULE. c must be
 * preset as above (want = in, out = Replicate(), local_args = args). Returns 0 with want, out
 * and local_args set, AG_SHARD_NO_RULE, or a negative AG_E* code with a message when the rule
 * failed or broke the contract (a Shard of a dim out of range or not divisible by world times
 * its split factor, in want or out); on failure want, out and local_args are as preset. */
AG_API int ag_op_shard_rule(const struct ag_opdef *def, ag_shard_ctx *c);
AG_API int ag_shard_rule_pointwise(ag_shard_ctx *c);
AG_API int ag_shard_rule_linear_pointwise(ag_shard_ctx *c);

/* Everything a backward rule sees. Saved tensors are detached aliases taken at forward time;
 * arguments and outputs not listed in the op's save masks are NULL here. grad_outputs[k] is
 * the incoming gradient of output k, or NULL when output k received none (treat as zero).
 * The rule stores a new reference (or NULL for "no gradient") in grad_inputs[j] for each
 * tensor input j with needs_grad[j] set; tensor inputs are numbered in schema order, with the
 * elements of a Tensor[] argument each taking one number. Rules are written with aotgrad's own
 * ops so that under tracing they emit backward graph nodes. */
typedef struct ag_bwctx {
    const struct ag_opdef *op;
    const ag_arg *args; /* the call's arguments (saved tensors in place of tensors) */
    int nargs;
    ag_tensor *const *outputs;  /* saved outputs, NULL where not saved */
    const ag_tmeta *input_meta; /* dtype/shape/strides of every tensor input at call time
                                 * (needs no saving: use it for shapes instead of saving) */
    int noutputs;
    ag_tensor *const *grad_outputs;
    int ntensor_inputs;
    const bool *needs_grad;
    ag_tensor **grad_inputs;
} ag_bwctx;

typedef struct ag_cost {
    double flops;
    double bytes; /* bytes read plus written */
} ag_cost;

struct ag_samples;

typedef int (*ag_meta_fn)(const ag_arg *args, ag_tmeta *outs);
/* outs are allocated (or aliased, for in-place ops) by the dispatcher from the meta. */
typedef int (*ag_kernel_fn)(const ag_arg *args, ag_tensor **outs);
typedef int (*ag_backward_fn)(ag_bwctx *ctx);
typedef void (*ag_cost_fn)(const ag_arg *args, const ag_tmeta *outs, int nouts, ag_cost *c);
/* Computes the op from other ops; stores new references in outs. */
typedef int (*ag_decomp_fn)(const ag_arg *args, ag_tensor **outs);
/* Adds gradcheck sample calls (float64 inputs) with ag_samples_add. */
typedef void (*ag_samples_fn)(struct ag_samples *s);

typedef struct ag_opdef {
    const char *schema; /* ATen schema; the op's name is what precedes '(' */
    uint32_t flags;
    ag_meta_fn meta;
    /* One kernel for all dtypes (it switches on dtype itself); NULL for views, which need none.
     * `dtypes` is a bitmask (1 << AG_F32 | ...) of the input dtypes the kernel handles. */
    ag_kernel_fn kernel;
    uint32_t dtypes;
    ag_backward_fn backward; /* NULL for non-differentiable ops */
    uint32_t save_args;      /* bit j: tensor input j is saved for backward */
    uint32_t save_outputs;   /* bit k: output k is saved for backward */
    /* bit k: output k carries no gradient (ATen's output_differentiability false: layer norm's
     * mean/rstd, batch norm's save_mean/invstd, nll_loss's total_weight, ...). Such outputs do
     * not require grad and gradcheck ignores them. Non-float outputs never carry gradients. */
    uint32_t nondiff_outputs;
    ag_cost_fn cost;       /* NULL: a default from the flags */
    ag_decomp_fn decomp;   /* optional */
    ag_samples_fn samples; /* gradcheck cases; required for differentiable ops */
    /* For ops that mutate an argument (schema `Tensor(a!)`): the name of the functional op that
     * functionalization records instead. It takes the same arguments and returns the op's own
     * outputs followed by the new value of each mutated argument in schema order; for in-place
     * ops (output 0 is self) just the new self. */
    const char *functional;
    /* Sharding rule (see ag_shard_ctx); NULL: the rule its flags give (pointwise ops shard
     * elementwise and never take Partial inputs, views and others have none: their inputs are
     * replicated). */
    ag_shard_fn shard;
} ag_opdef;

#define AG_DT_FLOAT ((1u << AG_F32) | (1u << AG_F64))
#define AG_DT_ALL ((1u << AG_F32) | (1u << AG_F64) | (1u << AG_I64) | (1u << AG_BOOL))

/* Parsed view of a schema, built once at registration. */
typedef enum ag_type {
    AG_TY_TENSOR,
    AG_TY_OPT_TENSOR,
    AG_TY_TENSOR_LIST,
    AG_TY_OPT_TENSOR_LIST,
    AG_TY_INT,
    AG_TY_OPT_INT,
    AG_TY_FLOAT,
    AG_TY_OPT_FLOAT,
    AG_TY_SCALAR,
    AG_TY_BOOL,
    AG_TY_INT_LIST,
    AG_TY_OPT_INT_LIST,
    AG_TY_DTYPE,
    AG_TY_OPT_DTYPE,
    AG_TY_STR,
    AG_TY_OPT_BOOL,
    /* "Any": any graph argument, a tuple or dict included (the higher-order ops' block_mask,
     * kernel_options and buffers, checked by their own inference); never an op's eager
     * argument. */
    AG_TY_ANY,
} ag_type;

typedef struct ag_schema_arg {
    const char *name;
    ag_type type;
    bool kwarg_only;
    bool has_default;
    ag_arg def; /* the default, when has_default */
} ag_schema_arg;

typedef struct ag_op ag_op; /* a registered op: definition plus parsed schema */

/* ---- registry ---- */
AG_API const ag_op *ag_op_find(const char *name); /* "add.Tensor"; NULL if absent */
AG_API int ag_op_count(void);
AG_API const ag_op *ag_op_at(int i); /* registration order */
AG_API const char *ag_op_name(const ag_op *op);
AG_API const ag_opdef *ag_op_def(const ag_op *op);
AG_API int ag_op_nargs(const ag_op *op);
AG_API const ag_schema_arg *ag_op_arg(const ag_op *op, int i);
AG_API int ag_op_noutputs(const ag_op *op);
/* Registers a user op (namespace::name). The definition must outlive the library's use of it.
 * Thread-safe, as are the lookups above: ops may be registered while other threads run or
 * look up ops; when threads register one name at once, one succeeds and the others fail with
 * "already exists". A registered op is never removed or changed. */
AG_API const ag_op *ag_op_register(const ag_opdef *def);
/* Comma-separated flag names ("pointwise,view") into buf. */
AG_API char *ag_op_flags_str(uint32_t flags, char *buf, size_t n);

/* ---- effects ----
 * An op flagged AG_OP_EFFECTFUL has a side effect (it logs a value, later: a collective), so it
 * must run exactly once per call and in program order. In exported graphs each such call is
 * threaded by an effect token, as upstream's with_effects higher-order op:
 *     with_effects(Tensor token, str op, <the op's own arguments>) -> Tensor[]
 * returns (new_token, <the op's outputs>...); `op` is the wrapped op's full name. A token is an
 * empty f32 tensor (f32[0]); the chain token -> with_effects -> new token orders the calls, and
 * DCE, CSE and the partitioners never remove, merge or recompute a with_effects node.
 *
 * ag_op_with_effects returns the with_effects op wrapping `op` (made on first use and kept for
 * the process, one per op even when threads ask for it at once; every one is named
 * "with_effects" and none is in the registry, so ag_op_find("with_effects") is NULL and the
 * graph parser picks one by its `op` argument).
 * NULL with a message when op is not effectful or cannot be wrapped: a view, in-place,
 * mutating or composite op, one with more than AG_MAX_ARGS - 2 arguments or AG_MAX_OUTPUTS - 1
 * outputs, or one with an argument named `token` or `op`. */
AG_API const ag_op *ag_op_with_effects(const ag_op *op);
/* The op a with_effects op wraps; NULL when op is not a with_effects op. */
AG_API const ag_op *ag_op_with_effects_target(const ag_op *op);

/* ---- calling ---- */

/* Calls `op` with `nargs` arguments in schema order (trailing defaulted ones may be omitted).
 * On success stores a new reference per output in outs and returns 0. */
AG_API int ag_op_call(const ag_op *op, const ag_arg *args, int nargs, ag_tensor **outs);
/* Single-output shortcut; NULL on failure. */
AG_API ag_tensor *ag_op_call1(const ag_op *op, const ag_arg *args, int nargs);

/* Cost estimate of a call from metadata alone. */
AG_API int ag_op_cost(const ag_op *op, const ag_arg *args, int nargs, ag_cost *c);

/* ---- gradcheck samples ---- */
typedef struct ag_samples ag_samples;
/* Adds one call; takes the references of the tensors in args (and in TENSORS arrays, which
 * are copied). `note` names the case in failure messages. */
AG_API void ag_samples_add(ag_samples *s, const char *note, const ag_arg *args, int nargs);
/* float64 tensor with values uniform in [lo, hi) from a fixed stream, requires_grad set. */
AG_API ag_tensor *ag_samples_rand(ag_samples *s, int ndim, const int64_t *sizes, double lo,
                                  double hi);
/* As above without requires_grad (index tensors use ag_from_data). */
AG_API ag_tensor *ag_samples_rand_nograd(ag_samples *s, int ndim, const int64_t *sizes, double lo,
                                         double hi);
/* A non-contiguous leaf (a transposed view of the last two dims of fresh storage) with
 * requires_grad set; ndim >= 2. */
AG_API ag_tensor *ag_samples_rand_strided(ag_samples *s, int ndim, const int64_t *sizes, double lo,
                                          double hi);

#ifdef __cplusplus
}
#endif
#endif
