/* Internal definitions shared by the library's files: the tensor and storage structs, the
 * error and allocation helpers, autorelease scopes, and the registered-op struct. Nothing here
 * is exported (the library builds with -fvisibility=hidden); cross-file helpers use the ag__
 * prefix. */
#ifndef AG_INTERNAL_H
#define AG_INTERNAL_H

#include "aotgrad.h"

#include <stdarg.h>
#include <stdatomic.h>
#include <string.h>

#define AG_ALIGN 64

/* ---- errors (error.c) ---- */
/* Sets the thread's error: "<fmt>" formatted; returns code so callers can `return ag__err(..)`. */
int ag__err(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Number of errors raised on this thread so far: a caller that runs user-visible code (a
 * backward rule, a decomposition) compares it before and after to notice failures that were
 * not propagated by a return value. */
uint64_t ag__err_count(void);
/* True when an error is set on this thread (used to keep the first message in NULL chains). */
bool ag__has_error(void);
/* Formats sizes as "[4, 3]" into buf. */
char *ag__fmt_sizes(char *buf, size_t n, int ndim, const int64_t *sizes);

/* The public API's NULL policy (core.h): a NULL handle or required pointer argument makes the
 * call fail with AG_EINVAL and "fn: p is NULL", and nothing else happens. For the top of a
 * function returning a status; AG__CHECK_NULL_RET(fn, p, ret) returns ret (NULL, false, -1)
 * instead. */
#define AG__CHECK_NULL(fn, p)                                                                      \
    do {                                                                                           \
        if (!(p))                                                                                  \
            return ag__err(AG_EINVAL, "%s: %s is NULL", fn, #p);                                   \
    } while (0)
#define AG__CHECK_NULL_RET(fn, p, ret)                                                             \
    do {                                                                                           \
        if (!(p)) {                                                                                \
            ag__err(AG_EINVAL, "%s: %s is NULL", fn, #p);                                          \
            return ret;                                                                            \
        }                                                                                          \
    } while (0)

/* ---- allocation (alloc.c) ---- */
/* NULL + AG_ENOMEM error on failure. 16-byte aligned below 256 bytes, 64 from there. */
void *ag__malloc(size_t size);
/* Tensor data: always 64-byte aligned, contents undefined. With the default allocator, blocks of
 * at least AG__DATA_CACHE_MIN bytes come from and go back to its cache (alloc.c), so data is
 * freed with ag__free_data and the size that was asked; NULL is a no-op. */
#define AG__DATA_CACHE_MIN ((size_t)64 << 10)
void *ag__malloc_data(size_t size);
void ag__free_data(void *p, size_t size);
void *ag__calloc(size_t count, size_t size);
void ag__free(void *p);
/* Grows *p (holding `used` elements of `elem` bytes) to at least `need` elements. */
int ag__grow(void **p, int64_t *cap, int64_t need, size_t elem);
char *ag__strdup(const char *s);
/* The data cache's state, for tests: bytes and blocks cached now, the most bytes cached since
 * the last ag__data_cache_set_cap, the cap, the blocks it made that are in use or cached, and
 * requests served from it (hits) or from the system (misses). */
typedef struct ag__dcache_stats {
    size_t bytes, blocks, peak_bytes, cap, tracked;
    uint64_t hits, misses;
} ag__dcache_stats;
void ag__data_cache_stats(ag__dcache_stats *out);
/* Sets the cap (freeing cached blocks down to it) and returns the previous one; for tests. */
size_t ag__data_cache_set_cap(size_t cap);

/* ---- tensors (tensor.c) ---- */
typedef struct ag_storage {
    int64_t refcount;
    void *data; /* NULL for meta storage (tracing) */
    size_t nbytes;
    uint64_t version;
} ag_storage;
/* Drops one reference; at 0 frees the data (ag__free_data with its size) and the struct.
 * NULL is a no-op. */
void ag__storage_release(ag_storage *s);
/* Completes the eager collectives still writing storage s, so that reading it gives their
 * result (an eager collective's output used before its wait_tensor, as PyTorch's
 * AsyncCollectiveTensor waits on first use). Set by src/dist when it first holds a storage for a
 * pending collective; NULL until then. core's readers of tensor data (ag_tensor_data,
 * ag_tensor_item_at, ag_tensor_to_doubles) call it; the dispatcher calls src/dist itself. */
typedef void (*ag__data_wait_fn)(const ag_storage *s);
extern _Atomic(ag__data_wait_fn) ag__data_wait_hook;

struct ag_anode;

struct ag_tensor {
    int64_t refcount;
    ag_dtype dtype;
    int ndim;
    int64_t sizes[AG_MAX_DIMS];
    int64_t strides[AG_MAX_DIMS];
    int64_t offset;
    ag_storage *storage; /* never NULL; storage->data NULL means a meta tensor */
    bool requires_grad;
    bool is_view; /* made by a view op: shares another tensor's storage */
    ag_tensor *grad;
    struct ag_anode *grad_fn;
    int output_nr;
    bool grad_donated; /* its producer gives it away: may become a leaf's .grad uncopied */
    void *trace;       /* the tracer's graph node, valid when trace_id is the active trace's */
    uint64_t trace_id;
    /* PyTorch's ._base: the root tensor a view op's output was made from (a reference, or
     * NULL for tensors that are not views; never itself a view). Set by the dispatcher. */
    ag_tensor *base;
    uint64_t trace_ver;      /* the tracer's alias generation trace was valid for (trace.c) */
    struct ag__subdata *sub; /* a tensor subclass instance's type and inner tensors, shared by
                              * its aliases (core/subclass_instance.c); NULL for plain tensors */
};

/* A new tensor with contiguous strides for `m` (m's strides/offset ignored) and fresh storage;
 * meta => no data. Caller owns. */
ag_tensor *ag__tensor_new(ag_dtype dt, int ndim, const int64_t *sizes, bool meta);
/* A new tensor over t's storage with m's sizes, strides and offset. Caller owns. */
ag_tensor *ag__tensor_alias(ag_tensor *t, const ag_tmeta *m);
ag_tensor *ag__tensor_from_meta(const ag_tmeta *m, bool meta);
void ag__tensor_retain(ag_tensor *t);
void ag__tmeta_of(const ag_tensor *t, ag_tmeta *m);
bool ag__is_meta(const ag_tensor *t);
/* Fills m's strides contiguously for its sizes (offset 0). */
void ag__tmeta_contiguous(ag_tmeta *m, ag_dtype dt, int ndim, const int64_t *sizes);
int64_t ag__numel(int ndim, const int64_t *sizes);
bool ag__tmeta_is_contiguous(const ag_tmeta *m);
/* Same dtype, sizes, strides and offset. */
bool ag__tmeta_equal(const ag_tmeta *a, const ag_tmeta *b);
/* Element pointer arithmetic. */
static inline char *ag__base(const ag_tensor *t) {
    return (char *)t->storage->data + (size_t)t->offset * ag_dtype_size(t->dtype);
}
/* Saturating int64 arithmetic for meta functions fed untrusted sizes (graph text): results
 * that would overflow become INT64_MAX / INT64_MIN, which the size checks then reject. */
static inline int64_t ag__sat_mul(int64_t a, int64_t b) {
    int64_t r;
    if (__builtin_mul_overflow(a, b, &r))
        return (a < 0) != (b < 0) ? INT64_MIN : INT64_MAX;
    return r;
}
static inline int64_t ag__sat_add(int64_t a, int64_t b) {
    int64_t r;
    if (__builtin_add_overflow(a, b, &r))
        return a < 0 ? INT64_MIN : INT64_MAX;
    return r;
}
/* The largest element count a tensor may have (2^48): anything beyond is an error. */
#define AG__MAX_NUMEL ((int64_t)1 << 48)
/* Checks every output meta of an op: sizes >= 0, element count <= AG__MAX_NUMEL. */
int ag__check_out_metas(const char *op, const ag_tmeta *m, int n);

/* Wraps a negative dim; returns -1 (and sets an error naming `op`) when out of range. dim is
 * the argument's full int64 value (a graph file's dim=4294967296 is out of range, not 0): never
 * narrow it to int before this check. A 0-d tensor takes dims -1 and 0, as in ATen. */
int ag__wrap_dim(const char *op, int64_t dim, int ndim);
/* Copies src into dst elementwise (same shape; dtype conversion allowed). No autograd. */
int ag__copy_into(ag_tensor *dst, const ag_tensor *src);
/* ag__copy_into for a dtype conversion an op asked for (_to_copy, copy_): a float element that
 * is NaN, infinite or outside an integral dst's range is refused (AG_EINVAL naming `op`, the
 * value and its position) before anything is written, instead of an undefined C cast. */
int ag__copy_convert(const char *op, ag_tensor *dst, const ag_tensor *src);

/* ---- per-thread scratch (scratch.c) ---- */
/* Kernel scratch that is kept between calls, so a step that repeats the shapes of an earlier
 * one allocates nothing. See scratch.c for the rules and for which kernel uses which slot. */
#define AG__SCRATCH_SLOTS 8
/* A 64-byte-aligned block of at least `bytes` bytes: slot `slot` (0 .. AG__SCRATCH_SLOTS-1) of
 * this thread's cache, the same block on every call until a larger size is asked (then it is
 * replaced; contents are not kept). Valid until the next call with that slot on this thread.
 * The library owns it. NULL with AG_ENOMEM set (the slot then empty) when it cannot grow.
 * OpenMP kernels take one block before their parallel region and split it per thread. */
void *ag__scratch(int slot, size_t bytes);
/* Frees this thread's scratch blocks (done at thread exit and, for the thread that calls
 * exit(), by a library destructor; tests call it to check the heap). */
void ag__scratch_release_all(void);
/* Other per-thread memory kept between calls (the autograd engine's arrays and seeds, the
 * spare custom node of autograd_graph.c) is freed with the scratch blocks at thread exit.
 * A thread about to keep some calls register with the function that frees the calling
 * thread's cache of that kind; the function is remembered process-wide (a handful of kinds
 * exist; it never fails) and runs at the exit of every thread that registered anything, so it
 * must do nothing on a thread holding no cache. This is how layers above core (the engine)
 * have their caches freed by core. ag__thread_caches_release frees this thread's now. */
void ag__thread_caches_register(void (*release)(void));
void ag__thread_caches_release(void);
/* A temporary tensor whose struct and storage struct are the caller's (on the stack) and whose
 * data is a scratch slot: never ag_tensor_free'd, valid as long as the slot. */
typedef struct ag__scratch_tensor {
    ag_tensor t;
    ag_storage s;
} ag__scratch_tensor;
/* A contiguous (dt, sizes) tensor in *tmp over slot `slot`; NULL (AG_ENOMEM) on failure. */
ag_tensor *ag__scratch_tensor_new(ag__scratch_tensor *tmp, int slot, ag_dtype dt, int ndim,
                                  const int64_t *sizes);
/* *out = src when src is NULL or contiguous, else a contiguous copy of src in *tmp over slot
 * `slot`. Returns 0 or a negative status (error set). */
int ag__scratch_contiguous(ag__scratch_tensor *tmp, int slot, const ag_tensor *src,
                           const ag_tensor **out);
/* A view for kernels in the caller's struct *v (on the stack): m's sizes, strides and offset
 * over t's storage, without a reference, autograd or trace. Never freed; valid while t is.
 * Returns v. */
ag_tensor *ag__tensor_view_tmp(ag_tensor *v, const ag_tensor *t, const ag_tmeta *m);

/* ---- scopes (tensor.c) ---- */
/* Hands a new reference to the caller: registers it with the open scope, if any. Returns t, or
 * NULL (t released, ENOMEM) when the scope cannot grow. */
ag_tensor *ag__give(ag_tensor *t);
bool ag__in_scope(void);

/* ---- grad mode, thread state, the autograd graph (core/autograd_graph.c) ---- */
typedef struct ag__tls_state {
    bool grad_disabled;
    bool tracing;       /* later stages: factory ops make meta tensors */
    bool in_grad_acc;   /* the current add is a gradient accumulation */
    int64_t bw_seq_nr;  /* seq_nr of the node whose backward is running, else -1 */
    int dispatch_depth; /* >0 while inside an op (composites, backward rules) */
    int64_t trace_seq;  /* seq_nr for the node being traced (set by the dispatcher) */
    /* Asked before an in-place op on a leaf that requires grad is refused: 1 when it gave self
     * a history (self->grad_fn set), 0 to refuse as usual, or a negative status. The joint
     * export's input-mutation wrapper sets it while it traces (upstream's maybe_to_fresh_input:
     * a mutated primal that requires grad is cloned, the clone mutated). */
    int (*leaf_inplace)(void *ud, ag_tensor *self);
    void *leaf_inplace_ud;
    /* Activation checkpointing (src/autograd/checkpoint.c). ckpt_region: nonzero while the
     * forward of an outermost checkpointed region runs under tracing (a serial, new for each
     * region: the tracer numbers the regions it sees as ac_graph_id 1, 2, ...); ckpt_serial:
     * the last serial given. ckpt_capture: set while a region's forward runs with grad mode
     * off; the dispatcher calls it with each tensor argument that requires grad (the tensors
     * the region's node must lead gradients to: its inputs and the parameters it reads). */
    int64_t ckpt_region;
    int64_t ckpt_serial;
    int (*ckpt_capture)(void *ud, ag_tensor *t);
    void *ckpt_capture_ud;
} ag__tls_state;
ag__tls_state *ag__tls(void);
/* Drops one reference to an autograd node. */
void ag__anode_release(struct ag_anode *n);
/* Dispatcher hooks: would this call record a node; is this in-place call allowed;
 * record the node for a call that ag__autograd_wanted accepted (orig_self: a copy of self
 * taken before an in-place kernel, or NULL). */
bool ag__autograd_wanted(const ag_op *op, const ag_arg *args, int nargs);
int ag__autograd_check_inplace(const ag_op *op, const ag_arg *args, int nargs);
/* dst takes src's autograd history (grad_fn and output slot; dst's old one dropped); with src
 * NULL, dst becomes a leaf again. */
void ag__tensor_set_history(ag_tensor *dst, const ag_tensor *src);
int ag__autograd_record(const ag_op *op, const ag_arg *args, int nargs, ag_tensor **outs, int nouts,
                        ag_tensor *orig_self);
/* A custom autograd node (a compiled function): its backward receives the output grads
 * (entries may be NULL) and stores new references / scope results in grad_inputs for the
 * inputs with needs[j]. It runs inside a scope, like a backward rule. */
typedef int (*ag__custom_bw_fn)(void *ud, ag_tensor *const *grad_outputs, int nout,
                                ag_tensor **grad_inputs, int nin, const bool *needs);
/* Attaches outs to a new node whose inputs are `inputs` (edges to their history); out_diff
 * (may be NULL) says which outputs carry gradients. The node owns ud (ud_free at release; also
 * called when no node is made because nothing requires grad). */
int ag__autograd_custom(const char *name, ag_tensor *const *inputs, int nin, ag_tensor **outs,
                        int nouts, const bool *out_diff, ag__custom_bw_fn fn, void *ud,
                        void (*ud_free)(void *));
/* seq_nr of the most recently created autograd node (-1 before any): what a forward node
 * traced now is tagged with, as PyTorch's _get_sequence_nr() - 1. */
int64_t ag__autograd_current_seq(void);
/* Element i (flat, row-major over the view) as double. */
double ag__get_f64(const ag_tensor *t, int64_t i);

/* ---- descriptors (desc.c) ---- */

/* The descriptors of a module's flat inputs in calling order, the one place that lays the
 * convention out: ParamAOTInput(target=params[i]) for each parameter, then
 * BufferAOTInput(target=buffers[i]) for each buffer, then PlainAOTInput(idx=k) for the user's
 * nuser inputs (args, then kwargs values). descs (nparams + nbuffers + nuser entries) receives
 * new references; on failure (AG_ENOMEM) it holds none. Names are borrowed. */
int ag__desc_module_inputs(char *const *params, int nparams, char *const *buffers, int nbuffers,
                           int nuser, ag_desc **descs);

/* ---- tensor subclasses (core/subclass_instance.c, ops/subclass_call.c) ---- */
struct ag__subdata;
void ag__subdata_retain(struct ag__subdata *s);
void ag__subdata_release(struct ag__subdata *s); /* NULL: no-op */
/* The dispatcher's path for a call with a subclass instance among its (filled) arguments:
 * the type that dispatches it (the first instance's, in schema order), or NULL. */
const ag_subclass_type *ag__subclass_dispatcher(const ag_op *op, const ag_arg *full);
/* Runs such a call: autograd records it on the outer tensors, the type's dispatch computes
 * the outputs (checked against the op's metas). Same contract as the dispatcher's raw call. */
int ag__subclass_call(const ag_subclass_type *type, const ag_op *op, const ag_arg *full,
                      const ag_tmeta *metas, int nouts, ag_tensor **outs);

/* ---- op registry (ops/optable.c) ---- */
struct ag_op {
    const ag_opdef *def;
    char *name; /* "add.Tensor" */
    int nargs;
    ag_schema_arg args[AG_MAX_ARGS];
    bool mutates[AG_MAX_ARGS]; /* Tensor(a!) */
    int noutputs;              /* -1: Tensor[] (variable, e.g. split) */
    bool out_is_list;
    char *arg_names; /* backing store for args[].name */
    int index;
};

/* Called by the dispatcher after outputs exist, when set (the tracer). One per thread: a
 * thread's trace session sees only that thread's op calls. */
typedef int (*ag__trace_hook_fn)(const ag_op *op, const ag_arg *args, int nargs, ag_tensor **outs,
                                 int nouts);
extern _Thread_local ag__trace_hook_fn ag__trace_hook;

/* A nested compile region's call (ag_nested_compile_region, and the module form of nn.h):
 * under tracing, the tracer's region hook (set while a tracing session is active; trace/
 * region_trace.c) traces it into a subgraph and records one invoke_subgraph call. `fn`/`ud` for
 * the function form, `module` for the module form (its forward runs with its parameters and
 * buffers lifted to operands after the inputs); `key` and `type` identify the region (the
 * function pointer, or the module's forward and type name). */
typedef struct ag__region {
    const char *name; /* for messages */
    const void *key;
    const char *type; /* NULL for the function form */
    int (*fn)(void *ud, ag_tensor *const *inputs, int nin, ag_tensor **outs, int max_out);
    void *ud;
    void *module;    /* the module form: its module (nn.h), else NULL */
    bool checkpoint; /* the body is checkpointed (a checkpointed module; the tracer sets it for
                      * a call inside ag_checkpoint); part of the cache key */
    ag_tensor *const *inputs;
    int nin;
} ag__region;
typedef int (*ag__region_hook_fn)(const ag__region *r, ag_tensor **outs, int max_out);
extern _Thread_local ag__region_hook_fn ag__region_hook;

/* Checks args against op's schema and fills defaults into full[] (AG_MAX_ARGS entries). */
int ag__op_check_args(const ag_op *op, const ag_arg *args, int nargs, ag_arg *full);
/* Runs op's meta function on full arguments into metas (AG_MAX_OUTPUTS entries), the entries
 * it fills zeroed first; returns what the meta function returns. */
int ag__op_run_meta(const ag_op *op, const ag_arg *full, ag_tmeta *metas);

/* An op parsed from def but not registered (ag_op_find does not see it); freed with
 * ag__op_free_detached. Used for the with_effects wrappers (ops/with_effects.c). */
ag_op *ag__op_new_detached(const ag_opdef *def);
void ag__op_free_detached(ag_op *op);
/* ops/with_effects.c: for a with_effects op, checks that its `op` argument names the op it wraps
 * (0 for every other op). */
int ag__with_effects_check(const ag_op *op, const ag_arg *full);

/* Finds a built-in op by name; aborts with a message if missing (a programming error in the
 * library's own tables, never user input). */
const ag_op *ag__op(const char *name);

/* Calls an op: a thin wrapper of ag_op_call for entry points. `outs` receives given refs. */
ag_tensor *ag__call1(const ag_op *op, const ag_arg *args, int nargs);
int ag__calln(const ag_op *op, const ag_arg *args, int nargs, ag_tensor **outs, int nouts);

/* Entry-point helper: looks the op up once and caches it. The cache is atomic because
 * threads may fill it at once (with the same pointer); acquire pairs with release so that a
 * thread reading the pointer sees the registered op behind it. */
#define AG__OP(var, name)                                                                          \
    static const ag_op *_Atomic var##_cache;                                                       \
    const ag_op *var = atomic_load_explicit(&var##_cache, memory_order_acquire);                   \
    if (!var) {                                                                                    \
        var = ag__op(name);                                                                        \
        atomic_store_explicit(&var##_cache, var, memory_order_release);                            \
    }

/* ---- meta helpers (ops/meta_util.c) ---- */
/* Broadcasts two shapes (PyTorch rules). On failure sets "<op>: shapes [..] and [..] cannot be
 * broadcast" and returns AG_EINVAL. */
int ag__broadcast(const char *op, int na, const int64_t *a, int nb, const int64_t *b, int *nout,
                  int64_t *out);
/* Result dtype of a binary op of two tensors (bool < i64 < f32 < f64). */
ag_dtype ag__promote(ag_dtype a, ag_dtype b);
/* Result dtype of tensor op float-Scalar: an integral tensor becomes f32. */
ag_dtype ag__promote_scalar(ag_dtype a, double s);
/* Reduction dims: fills `reduce[d]` for each dim to reduce (all when ndims == 0). */
int ag__reduce_dims(const char *op, int ndim, const int64_t *dims, int ndims, bool *reduce);
/* Output meta of a reduction of `in` over `reduce`. */
void ag__reduce_meta(const ag_tmeta *in, const bool *reduce, bool keepdim, ag_dtype dt,
                     ag_tmeta *out);

/* ---- random (core/rng_state.c) ---- */
/* Reserves `n` values' worth of counters from the default generator: returns the seed and the
 * starting offset and advances the generator. */
void ag__rng_reserve(int64_t n, uint64_t *seed, uint64_t *offset);
/* Uniform [0,1) doubles / floats for element i of a draw starting at (seed, offset). */
void ag__philox_uniform_f64(uint64_t seed, uint64_t offset, int64_t n, double *out);
void ag__philox_uniform_f32(uint64_t seed, uint64_t offset, int64_t n, float *out);
void ag__philox_normal_f64(uint64_t seed, uint64_t offset, int64_t n, double *out);
void ag__philox_normal_f32(uint64_t seed, uint64_t offset, int64_t n, float *out);

#endif
