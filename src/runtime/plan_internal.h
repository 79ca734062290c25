/* Internal interface of the executor (plan.c) and its memory planner (memplan.c), shared with
 * the compiled runtime, the tests and the benchmarks.
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

/* The fused groups of a plan in step order: up to max of their names ("addmm+gelu", ...) and
 * first nodes' names; returns how many groups there are. */
int ag__plan_fused_groups(const ag_plan *p, const char **names, const char **first, int max);

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
