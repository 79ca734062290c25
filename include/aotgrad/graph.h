/* The graph IR: an ordered list of nodes, as torch.fx.Graph.
 *
 * Node kinds: placeholder (a graph input), call (an op of the op table, or getitem reading one
 * output of a multi-output call), get_attr (a constant tensor owned by the graph, or one of
 * the graph's subgraphs: see "subgraphs" below) and output
 * (exactly one, last, listing the graph's outputs). Arguments are values (ag_garg): node
 * references, ints, floats, bools, int lists, None, dtypes, strings, lists of nodes, tuples
 * mixing nodes and scalars, and dicts of scalars. Every node keeps the list of its users (a
 * node referenced inside a list or tuple included), kept correct by every mutation.
 *
 * Metadata. `val` is structural (dtype, shape, strides, storage offset of each output). The
 * rest lives in a per-node key/value store, so a new key needs no new struct field: `desc`
 * (placeholders: one descriptor; the output node: one per output, or None), `stack_trace`,
 * `custom` (user annotations: string keys to int/float/string values), `seq_nr`,
 * `partitioner_tag`, `is_gradient_acc`, `recompute`, `nn_module_stack` and
 * `fwd_nn_module_stack` (see "module stacks" below), and any key a pass adds.
 *
 * Names are unique and made as FX makes them: the op's base name (`addmm`, `add` for
 * add.Tensor), then `addmm_1`, `addmm_2`, ...; a name that shadows a Python builtin (`sum`,
 * `slice`, `abs`, ...) starts at `_1`.
 *
 * Ownership: the graph owns its nodes, their arguments and metadata, its constants and its
 * subgraphs. Node pointers stay valid until the node is erased or the graph freed. Strings
 * passed in are copied.
 *
 * Threads: a graph is used by one thread at a time. Copies (ag_graph_copy, the partitioner's
 * graphs) share metadata strings and descriptors by atomic counts, so they may live in other
 * threads, but they also share the constant tensors of get_attr nodes, whose counts are not
 * atomic: a graph with constants and its copies are used by one thread at a time. */
#ifndef AOTGRAD_GRAPH_H
#define AOTGRAD_GRAPH_H

#include <stdio.h>

#include "core.h"
#include "flex_attention.h"
#include "optable.h"
#include "desc.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ag_graph ag_graph;
typedef struct ag_node ag_node;

typedef enum ag_node_kind {
    AG_NODE_PLACEHOLDER = 0,
    AG_NODE_CALL,
    AG_NODE_GETITEM,
    AG_NODE_GET_ATTR,
    AG_NODE_OUTPUT,
} ag_node_kind;

/* A scalar value: of a metadata entry (below), of a dict argument's item. */
typedef enum ag_mval_kind {
    AG_MV_NONE = 0,
    AG_MV_INT,
    AG_MV_FLOAT,
    AG_MV_BOOL,
    AG_MV_STR,
} ag_mval_kind;

typedef struct ag_mval {
    ag_mval_kind kind;
    union {
        int64_t i;
        double f;
        bool b;
        const char *s; /* owned by the node when read back */
    } u;
} ag_mval;

typedef enum ag_garg_kind {
    AG_GA_NONE = 0,
    AG_GA_NODE,
    AG_GA_NODES, /* elements may be NULL (None), as Tensor?[] */
    AG_GA_INT,
    AG_GA_FLOAT,
    AG_GA_BOOL,
    AG_GA_INTS,
    AG_GA_DTYPE,
    AG_GA_STR,
    /* A Python tuple mixing kinds, as upstream's higher-order ops take (flex_attention's
     * block_mask: `(288, 288, %a, ..., 128, 128, %sdpa_mask0)`): n elements, each of kind
     * NONE, NODE (a value or a subgraph's get_attr; never NULL: None is a NONE element),
     * INT, FLOAT or BOOL. Printed `(1, %a, None)`, `(%a,)`, `()`. */
    AG_GA_TUPLE,
    /* A Python dict of n items with string keys (distinct, non-empty) and scalar values
     * (ag_mval: None, int, float, bool, str), in insertion order: flex_attention's
     * kernel_options, `{'PRESCALE_QK': False, 'BACKEND': 'AUTO'}`. */
    AG_GA_DICT,
} ag_garg_kind;

/* A dict argument's item. */
typedef struct ag_gitem {
    const char *key;
    ag_mval v;
} ag_gitem;

/* A node argument. Pointers inside (lists, tuple elements, dict items and their strings) are
 * borrowed when passed in (the graph copies them, deeply) and owned by the graph when read
 * back (valid until the argument is set again or the node erased). */
typedef struct ag_garg {
    ag_garg_kind kind;
    int n; /* NODES, INTS, TUPLE, DICT */
    union {
        ag_node *node;
        ag_node **nodes;
        int64_t i;
        double f;
        bool b;
        const int64_t *ints;
        ag_dtype dt;
        const char *s;
        const struct ag_garg *elems; /* TUPLE */
        const ag_gitem *items;       /* DICT */
    } u;
} ag_garg;

#define AG_GA_N(x) ((ag_garg){.kind = AG_GA_NODE, .u.node = (x)})
#define AG_GA_I(x) ((ag_garg){.kind = AG_GA_INT, .u.i = (x)})
#define AG_GA_F(x) ((ag_garg){.kind = AG_GA_FLOAT, .u.f = (x)})
#define AG_GA_B(x) ((ag_garg){.kind = AG_GA_BOOL, .u.b = (x)})
#define AG_GA_INTS(v, cnt) ((ag_garg){.kind = AG_GA_INTS, .n = (cnt), .u.ints = (v)})
#define AG_GA_NODES(v, cnt) ((ag_garg){.kind = AG_GA_NODES, .n = (cnt), .u.nodes = (v)})
#define AG_GA_DT(x) ((ag_garg){.kind = AG_GA_DTYPE, .u.dt = (x)})
#define AG_GA_S(x) ((ag_garg){.kind = AG_GA_STR, .u.s = (x)})
#define AG_GA_NIL ((ag_garg){.kind = AG_GA_NONE})
#define AG_GA_TUPLE(v, cnt) ((ag_garg){.kind = AG_GA_TUPLE, .n = (cnt), .u.elems = (v)})
#define AG_GA_DICT(v, cnt) ((ag_garg){.kind = AG_GA_DICT, .n = (cnt), .u.items = (v)})

/* The node references an argument holds, for walking them whatever its kind: NODE holds one
 * (NULL when it is None), NODES one per element (NULL: None), TUPLE one per element (NULL for
 * an element that is not a node), other kinds none. a is borrowed; NULL holds none. */
AG_API int ag_garg_num_refs(const ag_garg *a);
/* Reference k (0 <= k < ag_garg_num_refs(a)), NULL for None or a non-node tuple element (or
 * k out of range, or a NULL). Borrowed: the node belongs to its graph. */
AG_API ag_node *ag_garg_ref(const ag_garg *a, int k);

/* ---- graphs ---- */
AG_API ag_graph *ag_graph_new(void);
AG_API void ag_graph_free(ag_graph *g); /* NULL is a no-op */
/* A deep copy (nodes, metadata, constants shared by reference, subgraphs copied). */
AG_API ag_graph *ag_graph_copy(const ag_graph *g);
AG_API int ag_graph_num_nodes(const ag_graph *g);
AG_API ag_node *ag_graph_first(const ag_graph *g);
AG_API ag_node *ag_graph_last(const ag_graph *g);
AG_API ag_node *ag_node_next(const ag_node *n);
AG_API ag_node *ag_node_prev(const ag_node *n);
AG_API ag_node *ag_graph_output_node(const ag_graph *g); /* NULL until created */
AG_API ag_node *ag_graph_find(const ag_graph *g, const char *name);
/* Placeholders in order (borrowed array valid until the next mutation). */
AG_API int ag_graph_placeholders(const ag_graph *g, ag_node ***out);

/* ---- creating nodes ----
 * New nodes go at the insertion point: by default before the output node (or at the end when
 * there is none); ag_graph_insert_before/after move it. A name of NULL means "make one". */
AG_API void ag_graph_insert_before(ag_graph *g, ag_node *n);
AG_API void ag_graph_insert_after(ag_graph *g, ag_node *n);
AG_API void ag_graph_insert_at_end(ag_graph *g);

/* Placeholders always go after the last existing placeholder. val may be NULL: a placeholder
 * without a val yet (set it with ag_node_set_val before verifying or running the graph). */
AG_API ag_node *ag_graph_placeholder(ag_graph *g, const char *name, const ag_tmeta *val);
/* A call of `op` with `nargs` args in schema order (omitted trailing args take their
 * defaults); its val is inferred by the op's meta function from the argument nodes' vals.
 * Fails (NULL) on schema mismatch or a meta error, naming the op. */
AG_API ag_node *ag_graph_call(ag_graph *g, const ag_op *op, const ag_garg *args, int nargs,
                              const char *name);
/* getitem(src, idx) for a multi-output call. */
AG_API ag_node *ag_graph_getitem(ag_graph *g, ag_node *src, int idx, const char *name);
/* A constant; the graph takes a reference to value. name NULL gives _tensor_constantN. */
AG_API ag_node *ag_graph_get_attr(ag_graph *g, ag_tensor *value, const char *name);
/* A get_attr of the graph's subgraph named attr (see "subgraphs" below); it has no val and no
 * constant. name NULL gives the node attr's name (made unique as FX makes names). */
AG_API ag_node *ag_graph_get_attr_subgraph(ag_graph *g, const char *attr, const char *name);
/* The output node (one per graph): outs[i] may be NULL (None). */
AG_API ag_node *ag_graph_output(ag_graph *g, ag_node *const *outs, int n);

/* ---- changing the graph ---- */
/* Replaces every use of `n` by `by` (NULL: None where allowed), inside lists and tuples too;
 * returns the number of uses. */
AG_API int ag_node_replace_all_uses(ag_node *n, ag_node *by);
/* Sets argument i (nodes' users lists are updated; a is copied deeply). i == nargs appends.
 * A malformed tuple or dict (see ag_garg_kind) is refused (AG_EINVAL) and nothing changes. */
AG_API int ag_node_set_arg(ag_node *n, int i, ag_garg a);
/* Removes n; refused (AG_ESTATE) while it has users. */
AG_API int ag_graph_erase(ag_graph *g, ag_node *n);
/* Moves n just before / after `pos`. */
AG_API int ag_graph_move_before(ag_graph *g, ag_node *n, ag_node *pos);
AG_API int ag_graph_move_after(ag_graph *g, ag_node *n, ag_node *pos);
/* Renames n (the name must be unused). */
AG_API int ag_node_rename(ag_graph *g, ag_node *n, const char *name);

/* ---- reading nodes ---- */
AG_API ag_node_kind ag_node_kind_of(const ag_node *n);
AG_API const char *ag_node_name(const ag_node *n);
AG_API const ag_op *ag_node_op(const ag_node *n); /* CALL only */
AG_API int ag_node_nargs(const ag_node *n);
AG_API const ag_garg *ag_node_arg(const ag_node *n, int i);
AG_API ag_node *ag_node_arg_node(const ag_node *n, int i); /* NULL unless a node arg */
AG_API int ag_node_num_users(const ag_node *n);
AG_API ag_node *ag_node_user(const ag_node *n, int i);
/* Output metadata: one for placeholders, get_attr, getitem and single-output calls; one per
 * output for multi-output calls; none for the output node. */
AG_API int ag_node_num_vals(const ag_node *n);
AG_API const ag_tmeta *ag_node_val(const ag_node *n, int i);
AG_API int ag_node_set_val(ag_node *n, int i, const ag_tmeta *m);
AG_API ag_tensor *ag_node_constant(const ag_node *n); /* GET_ATTR: borrowed */
/* GET_ATTR of a subgraph: the subgraph (borrowed, owned by n's graph); NULL otherwise. */
AG_API ag_graph *ag_node_subgraph(const ag_node *n);
AG_API int ag_node_index(const ag_node *n); /* position in the graph, 0-based */

/* ---- subgraphs ----
 * A graph owns named subgraphs, its graph attributes (FX: submodules of the GraphModule, such
 * as `repeated_subgraph0`). A get_attr node of one (ag_graph_get_attr_subgraph) is argument 0
 * of the higher-order op
 *     invoke_subgraph(Tensor subgraph, str identifier, Tensor[] operands) -> Tensor[]
 * (upstream's torch.ops.higher_order.invoke_subgraph), which runs the subgraph on the operands
 * and returns its outputs as a tuple read by getitem. The op is flagged AG_OP_SUBGRAPH: meta
 * inference (infer.c) gives it the subgraph's output vals after checking the operands' count,
 * dtypes and sizes against the subgraph's placeholders; the interpreter runs the subgraph; it
 * has no eager kernel. A subgraph may return None (a region's joint subgraph returns None for
 * the grad of an operand that needs none, e.g. a mask or an integer index): the call's val at
 * that index is a contiguous f32[0] placeholder value, a getitem of it is refused (by
 * ag_graph_getitem and verify), and the executors leave it empty. DCE removes an unused
 * invoke_subgraph unless a call in its subgraph has side effects, and a get_attr without users, but
 * the subgraph stays an attribute of the graph (as FX's dead-code elimination leaves submodules);
 * CSE merges two calls only with the same get_attr node, identifier and operands, and never when
 * the subgraph holds a random op. A subgraph is a whole graph (placeholders, output node), verified
 * with its parent; it may own subgraphs itself (a region in a region: nested subgraphs, at most
 * 16 levels below the outermost graph, verified, printed, copied and inlined recursively), and its
 * nodes may reference only its own nodes. Nested compile regions (autograd.h,
 * ag_nested_compile_region) make them. Attribute names are unique among the graph's subgraphs and
 * constants
 * ([A-Za-z_][A-Za-z0-9_]*). */
/* Adds sub as the attribute `name`: on success g owns sub (freed with g; a copy of g copies
 * it); on failure the caller keeps it. Refused (AG_EINVAL): a name in use or not an
 * identifier, sub == g, sub already a subgraph, sub an ancestor of g (a cycle), nesting deeper
 * than 16 levels, sub without an output node. */
AG_API int ag_graph_add_subgraph(ag_graph *g, const char *name, ag_graph *sub);
/* The subgraph named name (borrowed), or NULL. */
AG_API ag_graph *ag_graph_subgraph(const ag_graph *g, const char *name);
AG_API int ag_graph_num_subgraphs(const ag_graph *g);
/* Subgraph i in the order added (borrowed); *name (may be NULL) receives its name, borrowed. */
AG_API ag_graph *ag_graph_subgraph_at(const ag_graph *g, int i, const char **name);
/* A flat copy of g (a new graph, the caller frees it): each invoke_subgraph call is replaced by
 * a copy of its subgraph's nodes (vals and metadata kept; a name already taken in g is made
 * anew from the op's, as FX makes names), each getitem of the call by the node the subgraph
 * returns at that index, and subgraph attributes no longer read are dropped. The copy runs
 * bit-identically to g. NULL on failure (g a subgraph itself, a getitem of a None output,
 * out of memory); g is never changed. */
AG_API ag_graph *ag_graph_inline_subgraphs(const ag_graph *g);
/* The invoke_subgraph op (made on first use, kept for the process; not in the registry). */
AG_API const ag_op *ag_op_invoke_subgraph(void);
/* A call invoke_subgraph(attr, identifier, operands) (attr: a get_attr of a subgraph of g);
 * read its outputs with ag_graph_getitem. NULL with a message when the operands do not fit. */
AG_API ag_node *ag_graph_invoke_subgraph(ag_graph *g, ag_node *attr, const char *identifier,
                                         ag_node *const *operands, int noperands, const char *name);

/* ---- metadata ---- (ag_mval: above, with the arguments) */
/* Generic keys. get returns kind AG_MV_NONE when absent. */
AG_API int ag_node_meta_set(ag_node *n, const char *key, ag_mval v);
AG_API ag_mval ag_node_meta_get(const ag_node *n, const char *key);
AG_API int ag_node_meta_del(ag_node *n, const char *key);
AG_API int ag_node_meta_count(const ag_node *n);
AG_API const char *ag_node_meta_key_at(const ag_node *n, int i, ag_mval *v);

/* The well-known keys, typed. */
AG_API int64_t ag_node_seq_nr(const ag_node *n); /* -1 when absent */
AG_API int ag_node_set_seq_nr(ag_node *n, int64_t seq_nr);
AG_API const char *ag_node_stack_trace(const ag_node *n); /* NULL when absent */
AG_API int ag_node_set_stack_trace(ag_node *n, const char *trace);
/* "is_forward", "is_backward", "must_be_in_forward", "must_be_in_backward" or NULL. */
AG_API const char *ag_node_partitioner_tag(const ag_node *n);
AG_API int ag_node_set_partitioner_tag(ag_node *n, const char *tag);
AG_API bool ag_node_is_gradient_acc(const ag_node *n);
AG_API int ag_node_set_gradient_acc(ag_node *n, bool v);

typedef enum ag_recompute {
    AG_RECOMPUTE_NONE = 0,
    AG_MUST_SAVE,
    AG_PREFER_SAVE,
    AG_MUST_RECOMPUTE,
    AG_PREFER_RECOMPUTE,
} ag_recompute;
AG_API ag_recompute ag_node_recompute(const ag_node *n);
AG_API int ag_node_set_recompute(ag_node *n, ag_recompute r);

/* custom: the annotation map (torch.fx.traceback.annotate), string keys in insertion order. */
AG_API int ag_node_custom_set(ag_node *n, const char *key, ag_mval v);
AG_API ag_mval ag_node_custom_get(const ag_node *n, const char *key);
AG_API int ag_node_custom_count(const ag_node *n);
AG_API const char *ag_node_custom_key_at(const ag_node *n, int i, ag_mval *v);
AG_API void ag_node_custom_clear(ag_node *n);
/* Copies src's custom map onto dst (replacing dst's). */
AG_API int ag_node_custom_copy(ag_node *dst, const ag_node *src);

/* ---- module stacks ----
 * nn_module_stack: the module calls a node was traced under, outermost first, as upstream's
 * node.meta["nn_module_stack"] from non-strict export. Each frame is (key, path, type): path is
 * the module's fully qualified name below the outermost module called (the traced module for
 * ag_trace_module and the joint export): '' for that module itself, "transformer.h.0.attn"
 * for a block's attention; type is its type name (ag_module_type: "Linear", "Block"); key is
 * "L__self__" + path, with "@N" appended for the N-th repeated call (N >= 1) of the same path
 * in one trace, so keys are unique. The tracer records it on every call and getitem node made
 * while a module's forward runs (ag_module_call); placeholders, the output node, get_attr
 * constants and nodes traced outside every module call have none, and a module that is not
 * the outermost one or inside it adds no frame (nor do frames nested deeper than
 * AG_MODULE_STACK_MAX). fwd_nn_module_stack: on the joint's backward nodes, the
 * nn_module_stack of the forward node with the same seq_nr (gradient accumulations get none),
 * as upstream's copy_fwd_metadata_to_bw_nodes. upstream's source_fn_stack is not recorded
 * (non-strict export does not record it either).
 *
 * A stack is stored as one string, the Python repr of upstream's dict,
 * "{'L__self__': ('', 'GPT'), 'L__self__lm_head': ('lm_head', 'Linear')}" (ag_node_meta_get
 * reads it), kept once per graph and distinct stack and shared by the nodes and the graph's
 * copies. ag_node_meta_set accepts for these keys only such a string (in exactly this
 * spelling, with distinct keys, 1 to AG_MODULE_STACK_MAX frames). */
#define AG_MODULE_STACK_MAX 256
typedef struct ag_module_frame {
    const char *key, *path, *type;
} ag_module_frame;
/* The number of frames (0 when the node has none). */
AG_API int ag_node_nn_module_stack_len(const ag_node *n);
/* Frame i (0: the outermost). Each of key, path and type that is not NULL receives a new
 * string, the caller's to release with ag_free. Fails (AG_EINVAL when the node has no frame i,
 * or AG_ENOMEM) with NULL in each of them. */
AG_API int ag_node_nn_module_stack(const ag_node *n, int i, char **key, char **path, char **type);
/* Sets the stack from count frames (strings copied; keys distinct); count 0 removes it. */
AG_API int ag_node_set_nn_module_stack(ag_node *n, const ag_module_frame *frames, int count);
/* The same for fwd_nn_module_stack. */
AG_API int ag_node_fwd_nn_module_stack_len(const ag_node *n);
AG_API int ag_node_fwd_nn_module_stack(const ag_node *n, int i, char **key, char **path,
                                       char **type);
AG_API int ag_node_set_fwd_nn_module_stack(ag_node *n, const ag_module_frame *frames, int count);

/* desc: a placeholder's descriptor (the node takes a reference), and the output node's list
 * (one per output, NULL for None). */
AG_API int ag_node_set_desc(ag_node *n, ag_desc *d);
AG_API ag_desc *ag_node_desc(const ag_node *n); /* borrowed; NULL when absent */
AG_API int ag_node_set_output_descs(ag_node *out, ag_desc *const *descs, int n);
AG_API ag_desc *ag_node_output_desc(const ag_node *out, int i); /* borrowed */
AG_API bool ag_node_has_output_descs(const ag_node *out);

/* ---- verification ---- */
/* Checks: every argument node is defined earlier in the graph; users lists match the
 * arguments; arguments match the op schema; each call's vals equal what the op's meta function
 * infers from its arguments' vals; exactly one output node, last; unique names; getitem reads
 * an existing output; placeholders come first; then each subgraph the same way. On failure
 * AG_EINVAL with a message naming the node and what is wrong. */
AG_API int ag_graph_verify(const ag_graph *g);

/* ---- passes ---- */
/* Dead-code elimination: removes call/getitem/get_attr nodes without users, except effectful
 * ops (AG_OP_EFFECTFUL), in-place ops and ops that mutate an argument. Returns the number of
 * nodes removed, or a negative status. */
AG_API int ag_graph_dce(ag_graph *g);
/* Common-subexpression elimination: a call identical to an earlier one (same op, same
 * arguments) is replaced by it; random, effectful and mutating ops are never merged. Returns
 * the number of nodes replaced. */
AG_API int ag_graph_cse(ag_graph *g);
/* Recomputes every call's vals with its op's meta function (after a pass changed shapes). */
AG_API int ag_graph_reinfer_meta(ag_graph *g);

/* A decomposition table: op -> function computing it from other ops (ag_decomp_fn, the same
 * signature as an op definition's decomp). */
typedef struct ag_decomp_table ag_decomp_table;
AG_API ag_decomp_table *ag_decomp_table_new(void);
AG_API void ag_decomp_table_free(ag_decomp_table *t);
AG_API int ag_decomp_table_add(ag_decomp_table *t, const ag_op *op, ag_decomp_fn fn);
/* Every op of the table that declares a decomposition (addmm -> mm + add, gelu -> formula,
 * ...): the "core" table. */
AG_API ag_decomp_table *ag_decomp_table_core(void);
/* Replaces each call to an op in the table by the nodes its decomposition emits (traced in
 * place, repeated until no node of the table remains), in g and in each of its subgraphs.
 * Returns the number replaced. */
AG_API int ag_graph_decompose(ag_graph *g, const ag_decomp_table *t);
/* Replaces call node n of g by the nodes fn (a decomposition, e.g. its op's ag_opdef.decomp)
 * emits when traced in place, once (what fn emits is not decomposed further); the new nodes
 * take n's metadata (seq_nr, tags, annotations, meta items) and n's users read them. n is
 * freed on success. 0, or a negative status with the graph unchanged: AG_ENOTSUP when fn has
 * no decomposition for this call's arguments, AG_EINVAL when n is not a call node of g. */
AG_API int ag_graph_decompose_node(ag_graph *g, ag_node *n, ag_decomp_fn fn);

/* ---- interpreter ---- */
/* Runs the graph on real tensors: inputs[i] feeds the i-th placeholder; each call node runs
 * through the dispatcher (so autograd records when inputs require grad). Stores the outputs
 * (new references; NULL for None) and returns their count, or a negative status naming the
 * node that failed. */
AG_API int ag_graph_run(const ag_graph *g, ag_tensor *const *inputs, int ninputs, ag_tensor **outs,
                        int max_out);

/* ---- flex_attention's functions as graphs ---- */
/* ag_score_mod_fn / ag_mask_mod_fn whose ud is a graph of ag_trace_score_mod's or
 * ag_trace_mask_mod's shape (trace.h; const ag_graph *): runs it with ag_graph_run on the tile's
 * tensors and the buffers, so a traced function runs in ag_flex_attention (and
 * ag_create_block_mask) where the C function ran; its ops broadcast over the tile as the function's
 * did. Returns the graph's first output (owned by the open scope, as the contract asks), or NULL
 * with the interpreter's message. */
AG_API ag_tensor *ag_score_mod_graph(void *graph, ag_tensor *score, ag_tensor *b, ag_tensor *h,
                                     ag_tensor *q_idx, ag_tensor *kv_idx, ag_tensor *const *buffers,
                                     int nbuffers);
AG_API ag_tensor *ag_mask_mod_graph(void *graph, ag_tensor *b, ag_tensor *h, ag_tensor *q_idx,
                                    ag_tensor *kv_idx, ag_tensor *const *buffers, int nbuffers);

/* ---- text format ---- */
/* Zero-initialized, or NULL (the same): custom annotations and metadata printed; seq_nr, stack
 * traces and module stacks left out. */
typedef struct ag_print_opts {
    bool seq_nr;       /* print seq_nr=N */
    bool stack_trace;  /* print stack traces */
    bool no_custom;    /* omit custom annotations */
    bool no_meta;      /* omit every other metadata key */
    bool module_stack; /* print nn_module_stack and fwd_nn_module_stack */
} ag_print_opts;
/* The graph as text (see docs/GRAPH_FORMAT.md). Returns a string to release with ag_free. */
AG_API char *ag_graph_to_string(const ag_graph *g, const ag_print_opts *opts);
AG_API int ag_graph_print(const ag_graph *g, FILE *f, const ag_print_opts *opts);
/* Parses text written by ag_graph_to_string (or by hand). On failure NULL with a message
 * "line L:C: expected ...". The parsed graph verifies. The text may hold at most
 * AG_GRAPH_TEXT_MAX bytes and AG_GRAPH_TEXT_MAX_LINES lines and no NUL byte; these are checked
 * first, so a reader of an endless stream can stop at AG_GRAPH_TEXT_MAX + 1 bytes. */
#define AG_GRAPH_TEXT_MAX ((size_t)1 << 30)
#define AG_GRAPH_TEXT_MAX_LINES (1 << 24)
AG_API ag_graph *ag_graph_parse(const char *text, size_t len);

/* ---- pictures ---- */
/* Zero-initialized, or NULL (the same): no title, nothing highlighted. */
typedef struct ag_dot_opts {
    const char *title;
    /* Names of nodes to draw with a thick red border (e.g. the values saved for backward). */
    const char *const *highlight;
    int nhighlight;
} ag_dot_opts;
/* Graphviz DOT text (release with ag_free). Forward and backward nodes are coloured apart
 * (partitioner_tag), placeholders and outputs are labelled by descriptor kind. */
AG_API char *ag_graph_to_dot(const ag_graph *g, const ag_dot_opts *opts);
/* Renders through Graphviz's `dot` program to SVG at path. */
AG_API int ag_graph_write_svg(const ag_graph *g, const char *path, const ag_dot_opts *opts);

#ifdef __cplusplus
}
#endif
#endif
