/* Sharding a joint graph for SPMD training on a 1-D device mesh.
 *
 * The pass is an ordinary user of the open transform path: it reads the joint's descriptors
 * (and pairs parameters with gradients, outputs with tangents through the FX utilities), builds
 * one rank's graph through the public graph API, and hands it to ag_joint_update on a copy of
 * the joint. The result is a joint like any other: it prints, saves, partitions and compiles
 * as usual, and its compiled callable takes this rank's local pieces of the parameters and
 * inputs.
 *
 *   ag_mesh mesh;  ag_mesh_world(&mesh);                 // after ag_dist_init()
 *   ag_shard_plan *plan = ag_shard_plan_fsdp(joint, &mesh);
 *   ag_joint *local = ag_shard_joint(joint, &mesh, plan);
 *   ag_compiled *c = ag_compile_joint(local, NULL);
 *
 * Placements (optable.h) are given by the plan to the parameters, buffers and user inputs
 * (the Param/Buffer/PlainAOTInput placeholders) and the user outputs (PlainAOTOutput; default
 * Replicate()); a tangent takes its output's placement, a gradient its input's, an input
 * mutation its input's. Propagation then walks the graph in order and asks each node's op for
 * its rule (ag_opdef.shard); where an input's placement differs from what the rule wants, the
 * pass inserts the redistribution, each collective followed by its wait_tensor:
 *   Partial -> Replicate   all_reduce
 *   Partial -> Shard(d)    reduce_scatter_tensor (d moved to the front and back when d != 0)
 *   Shard(d) -> Replicate  all_gather_into_tensor (likewise)
 *   Replicate -> Shard(d)  a local slice (no communication)
 *   Replicate -> Partial   avg: nothing; sum: divided by the world size
 *   Shard(a) -> Shard(b)   all_gather, then a local slice
 * Every node of the result carries its placement as node meta "placement" (its first output's,
 * for a multi-output call: its getitems carry their own), and every node whose inputs were
 * replicated because its op had no rule carries meta "shard_fallback" = true.
 *
 * Decompose to shard: a node whose rule (or the fallback) would all_gather a sharded input and
 * whose op has a decomposition (ag_opdef.decomp, not composite) is replaced, in a copy of the
 * source graph, by its decomposition, and propagation runs again over the pieces; it stays
 * decomposed when its pieces move fewer bytes than it did whole. Batch norm on a batch-sharded
 * input so costs two all_reduces of [C] values in the forward and two in the backward
 * (SyncBatchNorm) instead of gathering the activation, a mean nll_loss scalar all_reduces
 * instead of gathering the logits. The pieces carry node meta "shard_decomposed" (the original
 * op's name) and "shard_decomposed_node" (the original node's). A Partial value that was
 * all_reduced for one user is read reduced by every later user.
 *
 * After propagation, two passes shape the communication: gradient all_reduces are merged into
 * buckets (flattened, concatenated, reduced once, split back) of at most the plan's bucket
 * size, each started as soon as its last gradient is computed; and every wait_tensor moves down
 * to just before the first use of its result, so communication overlaps the computation in
 * between. A collective node tagged AG_MUST_RECOMPUTE (as the fsdp strategy tags its parameter
 * gathers) is recomputed in the backward by the min-cut partitioner instead of saved.
 *
 * A rank's graph differs from another's only in the constants of local slices (which chunk
 * is its own). Thread-safety: as for any joint; ag_shard_joint does not communicate. */
#ifndef AOTGRAD_PARALLEL_H
#define AOTGRAD_PARALLEL_H

#include "export.h"
#include "optable.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A 1-D device mesh: `size` ranks of the group named `group` (the collectives' group_name; "0"
 * is the world), seen from rank `rank`. A mesh may describe a world that does not run (to print
 * what rank 3 of 64 would run): ag_shard_joint needs no process group. */
typedef struct ag_mesh {
    int size;
    int rank;
    const char *group; /* borrowed; NULL means "0" */
} ag_mesh;
/* The world's mesh (ag_dist_init must have run). */
AG_API int ag_mesh_world(ag_mesh *out);

/* ---- plans ---- */
typedef struct ag_shard_plan ag_shard_plan;
AG_API ag_shard_plan *ag_shard_plan_new(void);    /* empty: everything Replicate() */
AG_API void ag_shard_plan_free(ag_shard_plan *p); /* NULL is a no-op */
/* The placement of the input or user output that d describes: ParamAOTInput, BufferAOTInput,
 * PlainAOTInput or PlainAOTOutput (d is copied). AG_EINVAL for another kind. */
AG_API int ag_shard_plan_set(ag_shard_plan *p, const ag_desc *d, ag_placement pl);
AG_API int ag_shard_plan_set_param(ag_shard_plan *p, const char *fqn,
                                   ag_placement pl);                            /* or buffer */
AG_API int ag_shard_plan_set_input(ag_shard_plan *p, int idx, ag_placement pl); /* PlainAOTInput */
AG_API int ag_shard_plan_set_output(ag_shard_plan *p, int idx,
                                    ag_placement pl); /* PlainAOTOutput */
/* The plan's placement for d (Replicate() when it sets none); false when it sets none. */
AG_API bool ag_shard_plan_get(const ag_shard_plan *p, const ag_desc *d, ag_placement *out);
/* Gradient buckets: at most `bytes` per merged all_reduce (0: the default, 25 MiB as DDP's;
 * negative: no bucketing, one collective per gradient). */
AG_API void ag_shard_plan_set_bucket_bytes(ag_shard_plan *p, int64_t bytes);
/* Keep waits where they were inserted (no overlap; for comparison). Default false. */
AG_API void ag_shard_plan_set_no_overlap(ag_shard_plan *p, bool no_overlap);
/* Gather-on-use (ZeRO-3, what fsdp sets): each Shard()ed parameter is all_gathered whole just
 * before its first user, every user reads the gathered value, and the gather and its wait are
 * tagged AG_MUST_RECOMPUTE so the min-cut partitioner gathers again in the backward instead of
 * saving the whole parameter. Off (the default): a parameter's shard meets each op's rule like
 * any other input. */
AG_API void ag_shard_plan_set_gather_params(ag_shard_plan *p, bool gather);
/* "dp", "fsdp", "tp" or "custom": what made the plan (printed by the summary). */
AG_API const char *ag_shard_plan_strategy(const ag_shard_plan *p);

/* ---- strategies: plans made from a joint's descriptors ----
 * dp: parameters and buffers Replicate(), user inputs Shard(0) (the batch), user outputs
 *   Replicate(); gradients come out Partial and are all_reduced in buckets.
 * fsdp: parameters Shard(0) (Replicate() when dim 0 does not divide by the world size), inputs
 *   Shard(0); each parameter is all_gathered before its first use in the forward, the gather is
 *   tagged to be recomputed in the backward (reshard after forward), gradients are
 *   reduce_scattered to Shard(0); the optimizer state follows the parameters' shards.
 * tp: Megatron tensor parallelism: Linear pairs whose first output reaches the second's input
 *   through elementwise ops and attention only are column-parallel (weight Shard(0), bias
 *   Shard(0)) then row-parallel (weight Shard(1), bias Replicate()); a fused q/k/v projection
 *   (its output split in three along the features) is StridedShard(0, 3) so each rank gets its
 *   heads of q, k and v; everything else, and the inputs, Replicate().
 * NULL with a message when the joint or mesh does not fit (tp: no Linear pair found). */
AG_API ag_shard_plan *ag_shard_plan_dp(const ag_joint *j, const ag_mesh *mesh);
AG_API ag_shard_plan *ag_shard_plan_fsdp(const ag_joint *j, const ag_mesh *mesh);
AG_API ag_shard_plan *ag_shard_plan_tp(const ag_joint *j, const ag_mesh *mesh);
/* By name: "dp", "fsdp" or "tp". */
AG_API ag_shard_plan *ag_shard_plan_strategy_new(const char *name, const ag_joint *j,
                                                 const ag_mesh *mesh);

/* ---- the pass ----
 * One rank's joint (caller frees), or NULL with a message naming the node, op and placements
 * that could not be sharded. j is not modified. */
AG_API ag_joint *ag_shard_joint(const ag_joint *j, const ag_mesh *mesh, const ag_shard_plan *plan);

/* What one rank's sharded joint holds and moves, read from its graph. */
typedef struct ag_shard_summary {
    int64_t param_bytes; /* this rank's parameter (and buffer) pieces */
    int64_t optim_bytes; /* AdamW's two moments for them */
    /* Bytes this rank sends per step (ag_comm_bytes of each collective) and the collectives it
     * starts (wait_tensor not counted); a collective tagged AG_MUST_RECOMPUTE (fsdp's parameter
     * gathers) counts twice, as the min-cut partitioner runs it in the forward and again in the
     * backward. */
    int64_t comm_bytes;
    int ncollectives;
    int nfallback;          /* nodes whose inputs were replicated for want of a rule */
    char fallback_ops[256]; /* their ops, "op xN, op2 xM" (truncated with "...") */
    /* Nodes the pass decomposed into ops that shard, because whole they would all_gather a
     * sharded input (node meta "shard_decomposed" on their pieces), and their ops, as above. */
    int ndecomposed;
    char decomposed_ops[256];
} ag_shard_summary;
AG_API int ag_shard_summary_get(const ag_joint *sharded, ag_shard_summary *out);

/* ---- helpers for rules and strategies ---- */
/* The placement a node carries (meta "placement"; output i of a multi-output call through its
 * getitem); Replicate() when it carries none. */
AG_API ag_placement ag_node_placement(const ag_node *n);
/* Rule helpers for ops (ag_shard_divisible, ag_shard_rule_pointwise, ...) are in optable.h. */

/* ---- local pieces of full tensors (DTensor's distribute_tensor / full_tensor) ----
 * ag_shard_local: this rank's piece of `full` under placement pl on the mesh, a new contiguous
 * tensor (caller frees; no autograd history): Shard(d) chunk mesh->rank of dim d,
 * StridedShard(d, k) that chunk of each of the k blocks concatenated in block order,
 * Replicate() and Partial(avg) a copy, Partial(sum) a copy on rank 0 and zeros elsewhere.
 * Reads no other rank. AG_EINVAL when dim d does not split evenly (ag_shard_divisible).
 * ag_shard_full: the inverse, the full tensor from this rank's piece `local` (caller frees, also
 * when called inside an open scope):
 * a collective on the mesh's group when it has more than one rank (every rank calls it for the
 * same tensors in the same order; all_gather_into_tensor for Shard, all_reduce for Partial,
 * through the eager _c10d_functional ops), a copy otherwise. NULL with a message on failure. */
AG_API ag_tensor *ag_shard_local(ag_tensor *full, ag_placement pl, const ag_mesh *mesh);
AG_API ag_tensor *ag_shard_full(ag_tensor *local, ag_placement pl, const ag_mesh *mesh);

#ifdef __cplusplus
}
#endif
#endif
