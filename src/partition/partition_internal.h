/* Internal interface of the partitioners (src/partition): the classified joint graph shared by
 * subgraph_partition.c (the regions a joint calls, partitioned first; the entry points),
 * partition.c (classification, materialization of the forward and backward graphs, the default
 * partition), side_plan.c (what each side runs for a saved set, the
 * backward reordering, the peak-memory model: side_plan.h), mincut.c (the min-cut
 * rematerialization partition: bans, weights, the flow network, the memory budget) and
 * knapsack.c (the knapsack solvers), plus what the tests, the CLI, bench_maxflow and
 * bench_knapsack reach in.
 * The files use each other in a line: subgraph_partition.c -> partition.c -> mincut.c ->
 * side_plan.c, knapsack.c.
 *
 * Every per-node array is indexed by the node's position in the partitioner's private copy of
 * the joint graph (ag__part.g, dead code removed), so node i is P->info[i].node. */
#ifndef AG_PARTITION_INTERNAL_H
#define AG_PARTITION_INTERNAL_H

#include "../core/internal.h"
#include "../graph/graph_internal.h"
#include "aotgrad/compile.h"

/* What the partitioners know about one joint node. */
typedef struct ag__pinfo {
    ag_node *node;
    ag_node_kind kind;
    uint32_t opflags;  /* the op table's flags (calls only) */
    bool primal;       /* a placeholder the forward takes (by its descriptor's section) */
    bool tangent;      /* a placeholder the backward takes: tangents, backward tokens and philox */
    bool static_input; /* a primal that is a parameter or buffer (by descriptor) */
    bool must_fw, must_bw; /* partitioner_tag must_be_in_forward / must_be_in_backward */
    bool req_fw;           /* needed to compute the forward outputs from the primals */
    bool req_bw;           /* tangents, must_be_in_backward, their users, backward outputs */
    bool tuple;            /* a multi-output call: its getitems carry the values */
    bool effectful;        /* kept by DCE although unused */
    bool recomputable;     /* in the recomputable op set (mincut.c documents it) */
    bool fusible;          /* recomputable or random */
    bool random, compute_intensive, view, is_cat;
    ag_recompute policy;
    int fw_order;       /* rank among req_fw nodes; -1 otherwise */
    int64_t dist;       /* dist_from_bw */
    int64_t bytes;      /* numel * itemsize (a tuple: the sum over its outputs, less those
                         * that pass an operand through) */
    int64_t sub_extra;  /* invoke_subgraph: its subgraph's intermediates' peak while it runs */
    int pass;           /* a getitem of an operand a subgraph call passes through: 1 + the
                         * operand's index (it shares the operand's storage), else 0 */
    double flops;       /* the op table's cost (ag_op_cost) of a call */
    int root;           /* storage root for the peak model: a view's base, else itself */
    bool external;      /* the root is a graph input or constant (costs no activation) */
    int *args, nargs;   /* distinct argument nodes (indices) */
    int *users, nusers; /* distinct users (indices), the output node included */
} ag__pinfo;

/* The classified joint graph. */
typedef struct ag__part {
    ag_graph *g; /* private copy of the joint (dead code removed, recompute tags cleaned), or
                  * the joint itself when those change nothing (g_borrowed: never written) */
    bool g_borrowed;
    int nn; /* nodes in g, the output node last */
    ag__pinfo *info;
    int out; /* index of the output node */
    int num_fwd_outputs;
    int nouts; /* outputs of the joint */
    int *outs; /* their node indices, -1 for None */
    int *primals, nprimals;
    int *tangents, ntangents;
    int nreq_bw;
    bool has_recompute_tags; /* some node is MUST/PREFER_RECOMPUTE */
    double meta_budget;      /* a node's float meta "memory_budget", or -1 */
    int *pool;               /* the nodes' args and users lists */
} ag__part;

/* Copies and classifies `joint` (spec 7.2 step 2, dist_from_bw of step 3). On failure a
 * negative status with a message; *P is then empty (ag__part_free is still safe). */
int ag__part_init(ag__part *P, const ag_graph *joint, int num_fwd_outputs);
/* The same for a joint the caller has just verified (ag_graph_verify): not verified again. */
int ag__part_init_ex(ag__part *P, const ag_graph *joint, int num_fwd_outputs, bool verified);
void ag__part_free(ag__part *P);
/* Only what the regions' pairing reads (subgraph_partition.c): P->g, nn, num_fwd_outputs and
 * nouts as ag__part_init fills them (P->info stays NULL), and in *req_bw (ag__malloc'd, one
 * per node of P->g) each node's req_bw as ag__part_init would set it. */
int ag__part_init_req_bw(ag__part *P, const ag_graph *joint, int num_fwd_outputs, bool **req_bw);

/* Nodes that make up a side's body (what is neither an input nor the output node). */
static inline bool ag__is_body_kind(ag_node_kind k) {
    return k == AG_NODE_CALL || k == AG_NODE_GETITEM || k == AG_NODE_GET_ATTR;
}

/* qsort comparator of ints, ascending. */
static inline int ag__cmp_int(const void *a, const void *b) {
    int x = *(const int *)a, y = *(const int *)b;
    return (x > y) - (x < y);
}

/* What each side runs for a saved set: the saved values the backward actually reads (graph
 * order), the forward's body (joint order) and the backward's body in the order the autograd
 * engine would run it (recomputed forward nodes just before their first backward user). Made
 * and scored by side_plan.c (side_plan.h). */
typedef struct ag__plan {
    int *saved, nsaved;
    int *fw, nfw;
    int *bw, nbw;
} ag__plan;

/* A plan's peak-memory model (ag__plan_peak in side_plan.h says how it is counted). */
typedef struct ag__peak {
    int64_t fw_peak;        /* highest live bytes during the forward */
    int64_t fw_end;         /* live at the forward's end (its outputs) */
    int64_t bw_peak;        /* highest live bytes during the backward */
    int64_t saved;          /* bytes of the saved values' storage */
    int64_t peak;           /* max(fw_peak, bw_peak): the step's peak activation memory */
    double recompute_flops; /* op-table flops of the forward nodes the backward recomputes */
    int recomputed_nodes;
} ag__peak;

/* Materializes a plan as the forward and backward graphs (new graphs, caller frees). */
int ag__plan_graphs(const ag__part *P, const ag__plan *pl, ag_graph **fw, ag_graph **bw);

/* Saved set of upstream's default_partition (every forward value the backward reads; a tuple's
 * getitems). Returns a new ag__malloc'd array of joint indices in *saved. */
int ag__default_saved(const ag__part *P, int **saved, int *nsaved);

/* ---- min-cut (mincut.c) ---- */

typedef struct ag__mincut_opts {
    bool ban_if_used_far_apart;
    bool ban_if_long_fusible_chains;
    bool ban_if_materialized_backward;
    bool ban_if_not_in_allowlist;
    bool ban_if_reduction;
} ag__mincut_opts;

/* The op classes of the min-cut (mincut.c documents the recomputable set). */
void ag__op_classes(const ag_op *op, bool *recomputable, bool *random, bool *compute_intensive,
                    bool *view, bool *is_cat);

/* upstream's config defaults: every ban on. */
ag__mincut_opts ag__mincut_default_opts(void);

/* The flow network of solve_min_cut: vertex 0 is the source, 1 the sink, node i has
 * i_in = 2 + 2i and i_out = 3 + 2i. Infinite capacities are `inf`, a finite value larger than
 * the sum of every finite capacity (so a cut through one is never minimal when a finite cut
 * exists, and all arithmetic on integer-valued doubles stays exact). */
typedef struct ag__flow_net {
    int nverts, nedges, source, sink;
    int *from, *to;
    double *cap;
    double inf;
} ag__flow_net;
void ag__flow_net_free(ag__flow_net *net);
/* Builds the network; banned (P->nn entries, may be NULL) receives the banned nodes.
 * dont_ban (P->nn entries, may be NULL) lists nodes the knapsack allowed to recompute. */
int ag__mincut_network(const ag__part *P, const ag__mincut_opts *o, const bool *dont_ban,
                       ag__flow_net *net, bool *banned);
/* Maximum flow: the flow value and each edge's flow (net->nedges entries). The partitioner
 * uses Dinic; igraph_maxflow is the reference of the tests and bench_maxflow, outside the
 * library (tests/maxflow_igraph.h). */
int ag__maxflow_dinic(const ag__flow_net *net, double *value, double *flow);
/* solve_min_cut: the saved nodes (graph order, new array) and the banned set. */
int ag__solve_min_cut(const ag__part *P, const ag__mincut_opts *o, const bool *dont_ban,
                      int **saved, int *nsaved, bool *banned);

/* How choose_saved_values_set picks among cuts for a budget strictly inside (0, 1). */
typedef enum ag__budget_mode {
    /* The default: the candidate cuts (the aggressive passes and the knapsack at a fixed grid
     * of memory limits) are scored by the peak model and the fastest one whose peak fits the
     * budget is taken, so the step's peak never rises as the budget falls. */
    AG__BUDGET_PEAK = 0,
    /* Upstream's choice: the knapsack over saved bytes at exactly the budget. */
    AG__BUDGET_RAW,
} ag__budget_mode;

/* choose_saved_values_set (spec 7.2) for memory_budget in [0, 1]; a new array in *saved. */
int ag__choose_saved(const ag__part *P, double budget, ag_knapsack solver, ag__budget_mode mode,
                     int **saved, int *nsaved);

/* The budget ag_partition_opts.memory_budget asks for (compile.h): +0 is the default 1, -0
 * (AG_MEMORY_BUDGET_ZERO) is 0, (0, 1] itself; anything else AG_EINVAL with a message. */
int ag__memory_budget_of(double field, double *budget);

/* partition.c: partitions a joint whose subgraph calls (if any) are opaque ops (what
 * ag__partition_ex does after partitioning the regions); verified: the caller has just
 * verified joint (it is not verified again). */
int ag__partition_flat(const ag_graph *joint, int num_fwd_outputs, const ag_partition_opts *opts,
                       ag__budget_mode mode, ag_graph **fw, ag_graph **bw,
                       ag_partition_stats *stats, ag__peak *peak, bool verified);
/* subgraph_partition.c: partitions each region's joint subgraph of joint once (opts, mode as
 * the outer partition) and gives *out, a copy of joint whose call pairs use them; *out NULL
 * when joint has no backward call of a region. *inner: the nodes and FLOPs the regions'
 * backwards recompute, summed over the backward calls. */
int ag__partition_subgraphs(const ag_graph *joint, int num_fwd_outputs,
                            const ag_partition_opts *opts, ag__budget_mode mode, ag_graph **out,
                            ag_partition_stats *inner);
/* subgraph_partition.c: ag_partition with the budget mode exposed (tests and the CLI compare
 * the two): the regions first, then the joint. peak may be NULL. */
int ag__partition_ex(const ag_graph *joint, int num_fwd_outputs, const ag_partition_opts *opts,
                     ag__budget_mode mode, ag_graph **fw, ag_graph **bw, ag_partition_stats *stats,
                     ag__peak *peak);

/* ---- knapsack (knapsack.c) ----
 * 0/1 knapsack: maximize the runtime of the saved items subject to their memory <= max_memory.
 * save[i] receives true for saved items (false: allowed to recompute), *total_runtime the
 * saved runtime. Returns 0 or a negative status. */
int ag__knapsack(ag_knapsack solver, const double *memory, const double *runtime, int n,
                 double max_memory, bool *save, double *total_runtime);
/* bench_knapsack's hook: when set (on this thread), ag__knapsack hands it every problem before
 * solving it (the arrays are the caller's, valid during the call only). NULL unsets it. */
typedef void (*ag__knapsack_hook_fn)(void *ctx, const double *memory, const double *runtime, int n,
                                     double max_memory);
void ag__knapsack_set_hook(ag__knapsack_hook_fn fn, void *ctx);

#endif
