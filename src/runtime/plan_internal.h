/* Internal interface of the executor (plan.c, its higher-order calls in plan_calls.c) and its
 * memory planner (memplan.c), shared with the compiled runtime, the tests and the benchmarks.
 *
 * memplan: given buffers with a size and a lifetime (first and last step, inclusive), assigns
 * each an offset in one arena so that no two buffers alive at the same step overlap, and
 * reports the arena size next to the two references it is judged by: the sum of the sizes (no
 * reuse at all) and the ideal peak (the most bytes alive at any one step, a lower bound no
 * placement can beat). */
#ifndef AG_PLAN_INTERNAL_H
#define AG_PLAN_INTERNAL_H

#include "../core/internal.h"
#include "aotgrad/compile.h"
#include "fuse.h"

/* ---- memplan.c ---- */

typedef struct ag__mp_item {
    int64_t size;   /* bytes (callers round to AG_ALIGN so offsets stay aligned) */
    int start, end; /* first and last step at which the buffer is alive, inclusive */
    int64_t offset; /* out: where it lives in the arena */
} ag__mp_item;

typedef enum ag__mp_strategy {
    AG__MP_BEST = 0,       /* every strategy below; the smallest arena wins */
    AG__MP_SIZE_FIRST_FIT, /* largest first, lowest offset free for its whole lifetime */
    AG__MP_SIZE_BEST_FIT,  /* largest first, the tightest gap that fits */
    AG__MP_BREADTH,        /* busiest lifetime first (most bytes alive around it), first fit */
    AG__MP_ORDER_BEST_FIT, /* execution order, tightest gap: a free-list simulation */
} ag__mp_strategy;

/* Places the n items (offsets written into items[i].offset) and sets *arena to the bytes the
 * arena needs. Returns 0, or AG_ENOMEM (nothing changed). */
int ag__memplan(ag__mp_item *items, int n, ag__mp_strategy strategy, int64_t *arena);
/* The most bytes alive at any one step: the lower bound for any arena (AG_ENOMEM when the
 * step profile cannot be allocated). */
int64_t ag__memplan_ideal(const ag__mp_item *items, int n);
/* Whether a placement is valid: the first pair of items alive together whose ranges overlap
 * is stored in *a, *b and false returned. */
bool ag__memplan_valid(const ag__mp_item *items, int n, int *a, int *b);

/* ---- plan.c ---- */

/* What a plan decided, for reports and tests. */
typedef struct ag__plan_stats {
    int nodes;               /* graph nodes */
    int kernel_steps;        /* kernel calls per run */
    int view_steps;          /* views whose geometry is recomputed per run (views of inputs) */
    int values;              /* intermediate values computed into the arena (kernel outputs) */
    int buffers;             /* arena buffers after in-place merging */
    int inplace;             /* outputs written into a dying input's buffer */
    int output_buffers;      /* storages handed to the caller per run */
    int64_t arena_bytes;     /* the arena: ag_plan_peak_bytes */
    int64_t sum_bytes;       /* every intermediate value in its own buffer (no reuse) */
    int64_t ideal_bytes;     /* most bytes alive at one step (after in-place merging) */
    int64_t output_bytes;    /* ag_plan_output_bytes */
    int64_t pooled_storages; /* output storages the pools hold now (in use or spare) */
    int fused_groups;        /* groups of kernel calls that run as one fused kernel */
    int64_t fused_declined;  /* group runs so far that fell back to one call per node */
    int subplans;            /* plans of the subgraphs invoke_subgraph calls (one per subgraph) */
    int64_t runs;            /* runs so far */
    int64_t subplan_runs;    /* runs so far of the subgraphs' plans, all together */
    int64_t direct_outputs;  /* as a subgraph's plan: outputs its kernels wrote straight into
                              * the calling plan's buffers (the others are copied), all runs */
    int64_t subplan_direct_outputs; /* the same, over the subgraphs' plans */
    int64_t passed_outputs;         /* as a subgraph's plan: outputs that are an operand passed
                                     * through, which the caller reads itself (no copy) */
    int64_t copied_outputs;         /* as a subgraph's plan: outputs copied into the caller's
                                     * buffers (views, constants, operands passed through where
                                     * a later node may mutate), all runs */
    int64_t subplan_passed_outputs; /* the same two, over the subgraphs' plans */
    int64_t subplan_copied_outputs;
} ag__plan_stats;

void ag__plan_get_stats(const ag_plan *p, ag__plan_stats *s);

/* Test hook: moves the arena buffer of the value computed by node `name` (its first output)
 * to `offset` (when >= 0) and/or ends its lifetime at the node named `end_at` (when not NULL),
 * so tests can check that checking mode catches overlapping and freed buffers. Only before
 * the first run; the offset must keep the buffer inside the arena. */
int ag__plan_debug_move(ag_plan *p, const char *name, int64_t offset, const char *end_at);

/* ag_plan_new for a graph its caller has just built from a verified graph through the graph
 * API and knows to be well formed (ag_compile_joint's halves from ag_partition): not verified
 * again in Release builds; Debug builds verify it as ag_plan_new does. */
ag_plan *ag__plan_new_verified(const ag_graph *g, const ag_plan_opts *opts);
/* ag_compiler_plan through ag__plan_new_verified (g and out non-NULL). */
int ag__compiler_plan_verified(const ag_graph *g, void *user, ag_runnable *out);

/* The fused groups of a plan in step order: up to max of their names ("addmm+gelu", ...) and
 * first nodes' names; returns how many groups there are. */
int ag__plan_fused_groups(const ag_plan *p, const char **names, const char **first, int max);

/* ---- the plan itself: plan.c and plan_calls.c only (to everyone else ag_plan is opaque) ---- */

typedef enum pv_kind {
    PV_INPUT = 0, /* a placeholder */
    PV_CONST,     /* a get_attr constant */
    PV_BUF,       /* a kernel output owning a buffer */
    PV_ALIAS,     /* a view of another value's storage */
} pv_kind;

typedef struct pv {
    pv_kind kind;
    int node; /* defining node index */
    int root; /* the value owning the storage (itself unless ALIAS) */
    int buf;  /* buffer of the root (BUF roots only), else -1 */
    int ph;   /* INPUT: placeholder position */
    int last; /* last node reading it */
    bool dyn; /* ALIAS rooted at an input: geometry recomputed each run */
    int pass; /* invoke_subgraph output slots: 1 + the operand's value it passes through (the
               * slot is an ALIAS of it, its getitem reads the operand), else 0 */
    ag_tmeta val;
} pv;

typedef struct tpool {
    ag_tensor **t;
    int64_t n, cap;
} tpool;

typedef struct pbuf {
    int64_t size;  /* aligned bytes (arena) */
    int64_t bytes; /* exact bytes */
    int start, end;
    int64_t offset; /* arena offset; -1 for output buffers */
    bool out;
    int root;         /* the value that made it */
    ag_storage st;    /* arena buffers: points into the arena */
    tpool owners;     /* output buffers: storages (held through owner tensors) */
    ag_tensor *cur;   /* output buffers: this run's owner */
    ag_storage *into; /* output buffers of a subgraph's run: the caller's storage written */
} pbuf;

typedef enum step_kind { STEP_KERNEL = 0, STEP_VIEW } step_kind;

typedef struct pstep {
    step_kind kind;
    int node;
    const ag_op *op;
    ag_arg args[AG_MAX_ARGS];
    ag_tensor **outs; /* nouts output structs (in mem) */
    int nouts;
    int view_val; /* STEP_VIEW: the view's value */
    int *reads;   /* values of the tensor arguments (checking) */
    int nreads;
    void *mem; /* lists, int arrays and strings the args point to (in the plan's step_mem) */
    ag__fuse_group fuse; /* the first step of a fused group: its rule (fuse.f->n steps) */
    int sub;             /* invoke_subgraph: 1 + the index of its subgraph's plan; else 0 */
    int flex;            /* flex_attention(_backward): 1 + the index of its graphs; else 0 */
} pstep;

typedef struct pflex {
    ag_graph *score, *mask;       /* copies of the call's score and mask graphs (mask: NULL) */
    ag_graph *joint;              /* the backward's: a copy of its joint graph (else NULL) */
    struct ag__flex_tiles *tiles; /* plan_flex.c: the graphs' tile plans; NULL: interpreted */
    int64_t sizes[4]; /* the block mask's (KV_LEN, Q_LEN, Q_BLOCK_SIZE, KV_BLOCK_SIZE) */
} pflex;

typedef struct pout {
    int val;     /* -1: None */
    int same_as; /* an earlier output slot with the same value, or -1 */
    tpool pool;  /* tensor structs handed out for this slot */
} pout;

struct ag_plan {
    ag_plan_opts opts;
    int nnodes;
    char **names;     /* per node, into name_chars */
    char *name_chars; /* the node names, one block */
    char *step_mem;   /* the steps' mem, one block */
    size_t step_mem_used, step_mem_size;
    int *node_val; /* per node: its first value, -1 when none */
    int nvals;
    pv *vals;
    ag_tensor *tens; /* per value (unused for CONST) */
    ag_tensor **tp;  /* per value: the struct kernels see */
    int nbufs;
    pbuf *bufs;
    int nsteps;
    pstep *steps;
    int nph;
    int *ph_val;
    int nouts;
    pout *outs;
    int out_node;
    char *arena;
    int64_t arena_bytes, sum_bytes, ideal_bytes, out_bytes;
    int ninplace, nplanned, nkernel, nview, narena_bufs;
    ag_storage dummy;           /* what idle pool tensors point at */
    ag_tensor **pick;           /* per output slot: the struct chosen this run */
    int *by_end;                /* checking: arena buffers by end */
    int *live;                  /* checking: scratch */
    ag__fuse_group *fuse_at;    /* building: per node, the fused group it starts */
    int nfused;                 /* fused groups */
    int64_t fused_declined;     /* group runs that fell back to one kernel per node */
    bool coll_check;            /* the collective-order check (coll_order.c) is due */
    const ag_graph **subgraphs; /* the subgraphs invoke_subgraph calls, one plan each */
    ag_plan **subplans;
    int nsubplans;
    int64_t subgraphs_cap, subplans_cap;
    pflex *flex; /* the graphs of the flex_attention steps, one entry per step */
    int nflex;
    int64_t flex_cap;
    int64_t nruns; /* successful runs */
    int64_t ninto; /* subgraph runs: outputs computed in the caller's buffers, all runs */
    int64_t npass; /* subgraph runs: operands passed through (the caller reads the operand) */
    int64_t ncopy; /* subgraph runs: outputs copied into the caller's buffers */
    int last_mut;  /* building: the last node that may mutate a value (-1: none) */
};

/* plan.c, for plan_calls.c. */
/* The value node user reads as d (*v): an error when d has several outputs (only getitem reads
 * them) or no value. */
int ag__plan_val_of_node(const ag_plan *p, const ag_node *user, const ag_node *d, int *v);
/* A run's parts, in order: bind the inputs (checked against the placeholders), the first run's
 * collective-order check (when p->coll_check), the arena, this run's storages of the output
 * buffers not bound to a caller's (bufs[].into), the steps, and after a failed run the
 * collectives it left started. Each 0 or a negative status. */
int ag__plan_bind_inputs(ag_plan *p, ag_tensor *const *inputs, int ninputs);
int ag__plan_check_collectives(ag_plan *p);
int ag__plan_ensure_arena(ag_plan *p);
int ag__plan_acquire_out_buffers(ag_plan *p);
int ag__plan_run_steps(ag_plan *p);
void ag__plan_settle_collectives(ag_plan *p);

/* plan_calls.c: invoke_subgraph steps. */
/* Building: the plan of subgraph sub (*k: its index; one per subgraph), whether call x may
 * write a tensor it reads, the value of operand j of subgraph call x when an output passes it
 * through (j from ag__subgraph_passthrough; -1 or a call that may mutate: -1). */
int ag__plan_subplan_of(ag_plan *p, const ag_graph *sub, int *k);
bool ag__plan_may_mutate(const ag_node *x);
int ag__plan_passthrough_value(ag_plan *p, const ag_node *x, int j);
/* Running step s (s->sub): 0 or a negative status naming the node. */
int ag__plan_run_subgraph(ag_plan *p, pstep *s);
/* A run of plan p whose output k is written into dst[k] (a contiguous tensor of its val, the
 * caller's; NULL where the output is None): computed there when it is a kernel output of its
 * own, else copied. Nothing is handed out; a warm run allocates nothing. */
int ag__plan_run_into(ag_plan *p, ag_tensor *const *inputs, int ninputs, ag_tensor *const *dst,
                      int ndst);

/* plan_flex.c: flex_attention(_backward) steps. Building: a call's graphs and their tile plans
 * (p->flex); freeing an entry; running step s (s->flex): 0 or a negative status naming the
 * node. */
int ag__plan_flex_graphs_of(ag_plan *p, const ag_node *x);
void ag__plan_flex_free(pflex *f);
int64_t ag__plan_flex_bytes(const pflex *f); /* the tile plans' arenas */
int ag__plan_run_flex(ag_plan *p, pstep *s);
struct ag__flex_tile_fns;
/* Eager flex_attention's tile plans (flex_eager.c): score (and, when joint is not NULL, the
 * backward's joint) graph planned per tile shape of a call of dtype dt over L x S in QB x KB
 * tiles, score_mod buffers of metadata sb[nsb] (contiguous); NULL with the error set and its
 * status in *status. bind: a run's buffers (contiguous) and, in the backward, the buffers'
 * gradient sums (contiguous, zeroed here; NULL entries: not needed) -> the kernel's tile
 * functions; done: after the kernel (status rc), the per-thread sums added, the failed tile's
 * message. One run at a time per object. */
struct ag__flex_tiles *ag__flex_tiles_new(ag_dtype dt, int64_t L, int64_t S, int64_t QB, int64_t KB,
                                          const ag_graph *score, const ag_graph *joint,
                                          const ag_tmeta *sb, int nsb, int *status);
void ag__flex_tiles_free(struct ag__flex_tiles *st); /* NULL: no-op */
int ag__flex_tiles_bind(struct ag__flex_tiles *st, ag_tensor *const *bufs, ag_tensor *const *bgrad,
                        const struct ag__flex_tile_fns **fns);
int ag__flex_tiles_done(struct ag__flex_tiles *st, int rc);

/* ---- coll_order.c: the collective-order check of a plan's first run ---- */

/* One collective step as the plan bound it. */
typedef struct ag__coll_step {
    const ag_op *op;
    const ag_arg *args;   /* defaults filled */
    const ag_tensor *out; /* its output (dtype and sizes) */
    const char *node;     /* the node's name, for the message */
} ag__coll_step;
/* Whether plans made with opts check (checking mode, a build without NDEBUG, or the
 * environment's AG_CHECK_COLLECTIVES, which decides when set: "0" off, anything else on). */
bool ag__coll_check_wanted(const ag_plan_opts *o);
/* Every rank of each group the steps name compares its sequence of collectives on it with the
 * others' (wait_tensor steps are skipped); a difference ends the job on every rank, naming the
 * first differing collective. 0, or AG_ENOMEM before communicating. */
int ag__coll_check(const ag__coll_step *steps, int n);

/* Test hook: fn(op name, node name, ud) runs before each kernel call of every plan the
 * calling thread runs (and fn(NULL, NULL, ud) after a run's last), so a counting allocator can
 * charge allocations to kernels. NULL removes it. Per thread: other threads' plans do not call
 * it. Tests and benchmarks only. */
typedef void (*ag__plan_step_fn)(const char *op, const char *node, void *ud);
void ag__plan_set_step_hook(ag__plan_step_fn fn, void *ud);

#endif
