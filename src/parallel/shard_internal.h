/* What the sharding pass's files share: the plan's struct, the names of the collective ops, and
 * the two communication passes that run on a rank's graph after propagation. */
#ifndef AG_SHARD_INTERNAL_H
#define AG_SHARD_INTERNAL_H

#include "../core/internal.h"

typedef struct ag__plan_entry {
    ag_desc *desc; /* owned */
    ag_placement pl;
} ag__plan_entry;

struct ag_shard_plan {
    ag__plan_entry *e;
    int64_t n, cap;
    int64_t bucket_bytes; /* 0: the default; < 0: no bucketing */
    bool no_overlap;
    bool gather_params;
    char strategy[16];
};

#define AG__BUCKET_DEFAULT ((int64_t)25 << 20)

/* The collectives' op names. */
#define AG__C10D_ALL_REDUCE "_c10d_functional::all_reduce"
#define AG__C10D_ALL_GATHER "_c10d_functional::all_gather_into_tensor"
#define AG__C10D_REDUCE_SCATTER "_c10d_functional::reduce_scatter_tensor"
#define AG__C10D_WAIT "_c10d_functional::wait_tensor"

/* ag__err(code, "<fmt>: <the last error's message>"): wraps a callee's message. */
int ag__shard_err(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Sets what made the plan ("dp", "fsdp", "tp"). */
void ag__shard_plan_set_strategy(ag_shard_plan *p, const char *name);

/* True for a call node of a collective op (wait_tensor included). */
bool ag__node_is_collective(const ag_node *n);
/* True for a call node of op `name`. */
bool ag__node_is_op(const ag_node *n, const char *name);
/* Sets node meta "placement" to pl's text. */
int ag__node_set_placement(ag_node *n, ag_placement pl);

/* One gradient all_reduce the pass inserted at the output node: the all_reduce, its wait and
 * the gradient it reduces; bucketed by ag__grad_buckets. */
typedef struct ag__grad_reduce {
    ag_node *reduce, *wait, *grad;
} ag__grad_reduce;
/* Merges the gradient all_reduces rs[0..n) into buckets of at most bucket_bytes (< 0: one per
 * gradient) in the order their gradients become ready; each bucket's all_reduce goes right
 * after its last gradient, its wait right after it, its splits just before the output node.
 * group/world: the mesh's. */
int ag__grad_buckets(ag_graph *g, ag__grad_reduce *rs, int n, int64_t bucket_bytes,
                     const char *group);
/* Moves every wait_tensor down to just before its first user, never past another collective.
 * Returns the number moved. */
int ag__sink_waits(ag_graph *g);

/* ---- the pass's state (shard_joint.c builds it, propagate.c walks the nodes) ---- */

/* A source value's local counterpart on the rank's graph and its placement. */
typedef struct ag__sval {
    ag_node *node;
    ag_placement pl;
    bool gather_on_use;  /* a Shard()ed parameter of a gather-on-use plan, not gathered yet */
    ag_placement *outpl; /* a multi-output call's output placements (owned) */
} ag__sval;

/* A redistribution already made: source value `src` at placement pl is node. */
typedef struct ag__redist {
    int src, next;
    ag_placement pl;
    ag_node *node;
} ag__redist;

/* A source node the pass decomposes (its op's ag_opdef.decomp) because its rule, or the
 * fallback, would all_gather a sharded input: found by one propagation, judged by the next
 * (decomposed, its pieces must move fewer bytes than it did whole). shard_joint.c iterates. */
typedef struct ag__decomp_cand {
    char *name; /* the source node's (owned) */
    const ag_op *op;
    double before; /* bytes its inputs' redistributions moved, whole */
    double after;  /* bytes its pieces' redistributions moved, decomposed */
    bool tried;    /* decomposed in the latest propagation */
    bool rejected; /* no decomposition for its arguments, or it did not move fewer bytes */
} ag__decomp_cand;

typedef struct ag__decomp_list {
    ag__decomp_cand *c;
    int64_t n, cap;
} ag__decomp_list;

typedef struct ag__shard_pass {
    const ag_mesh *mesh;
    const char *group;
    int W, rank;
    const ag_shard_plan *plan;
    const ag_graph *src;
    ag_graph *g;
    int nsrc;
    ag_node **srcn;  /* [nsrc]: the source nodes by index */
    ag__sval *val;   /* [nsrc], by source node index */
    int *cache_head; /* [nsrc]: first ag__redist of the value, -1 when none */
    ag__redist *cache;
    int64_t ncache, cache_cap;
    const ag_node *cur; /* the source node whose tag and seq_nr inserted nodes take */
    ag__grad_reduce *grs;
    int64_t ngr, gr_cap;
    ag__decomp_list *dl; /* NULL: no decomposition bookkeeping (one rank) */
} ag__shard_pass;

/* propagate.c */
/* The local node holding source value si at placement `to` (made once, then reused), with
 * the collectives and slices that move it there appended to the rank's graph. */
ag_node *ag__redistribute(ag__shard_pass *P, int si, ag_placement to);
/* Appends the rank's version of source call node n (its inputs redistributed as its op's rule
 * wants, or replicated when it has none). */
int ag__shard_call(ag__shard_pass *P, const ag_node *n);
/* A node for an inserted op (name made unique in both graphs), tagged as P->cur, its placement
 * recorded. */
ag_node *ag__shard_insert(ag__shard_pass *P, const char *op, const ag_garg *args, int nargs,
                          ag_placement pl);
/* "Shard(0)" for pl; "f32[4, 3]" for a tmeta. */
const char *ag__pl_str(ag_placement pl, char *buf, size_t n);
const char *ag__meta_str(const ag_tmeta *m, char *buf, size_t n);
/* The local metadata of a tensor of global metadata gm under pl on W ranks (contiguous). */
void ag__local_meta(const ag_tmeta *gm, ag_placement pl, int W, ag_tmeta *out);
/* Records what source call node n's redistributions move (`moved` bytes, global sizes;
 * `gathers`: an input leaves a Shard()) in P->dl: a piece of a decomposed node adds to its
 * node's `after`; a node of an op with a decomposition that gathers becomes a candidate. */
int ag__decomp_note(ag__shard_pass *P, const ag_node *n, double moved, bool gathers);
/* shard_decomp.c: a copy of src with the candidates not rejected decomposed (*ntried of
 * them; their `after` reset); NULL with a message on failure. ag__decomp_judge rejects the
 * tried ones whose pieces did not move fewer bytes; true when it rejected any. */
ag_graph *ag__decomposed_copy(const ag_graph *src, ag__decomp_list *dl, int *ntried);
bool ag__decomp_judge(ag__decomp_list *dl);
void ag__decomp_list_free(ag__decomp_list *dl);
/* Bytes a rank sends per step in graph g's collectives (ag_shard_summary_get's comm_bytes). */
int64_t ag__graph_comm_bytes(const ag_graph *g);

/* Copies every metadata item (and the custom map) of src onto dst. */
int ag__copy_node_meta(ag_node *dst, const ag_node *src);

#endif
