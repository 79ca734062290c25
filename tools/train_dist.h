/* One rank's share of a sharded training step, for `aotgrad train --parallel` and `aotgrad
 * bench --parallel` (train_dist.c). */
#ifndef AG_TRAIN_DIST_H
#define AG_TRAIN_DIST_H

#include "aotgrad.h"

/* The training step module, loss = cross_entropy(model(x), y), or for GPT-2 (gpt2 true) the
 * loss the model returns for (idx, targets). It owns model as its child "model" (parameter
 * names read model.conv1.weight, ...); model is freed when the step cannot be made. NULL with
 * a message on failure. */
ag_module *cli_train_step_new(ag_module *model, bool gpt2);

typedef struct dist_train dist_train;

/* Shards j (the step joint exported for the global batch; borrowed) with strategy ("dp", "fsdp",
 * "tp") for this rank of the world (ag_dist_init must have run), compiles it with co, and makes
 * this rank's pieces of step's parameters and buffers (step holds the full, initialized
 * tensors; borrowed, must outlive the result). NULL with a message (ag_last_error). */
dist_train *dist_train_new(const ag_joint *j, ag_module *step, const char *strategy,
                           const ag_compile_opts *co);
/* The same with a plan made by the caller (a strategy's, changed: ag_shard_plan_set_no_overlap,
 * ag_shard_plan_set_bucket_bytes; or the caller's own) for the world's mesh; plan is borrowed. */
dist_train *dist_train_new_plan(const ag_joint *j, ag_module *step, const ag_shard_plan *plan,
                                const ag_compile_opts *co);
void dist_train_free(dist_train *d);                         /* NULL: no-op */
const ag_joint *dist_train_joint(const dist_train *d);       /* the sharded joint, borrowed */
const ag_compiled *dist_train_compiled(const dist_train *d); /* borrowed */
const ag_mesh *dist_train_mesh(const dist_train *d);
/* The local parameter pieces (leaves requiring grad; borrowed), for the optimizer. */
int dist_train_params(const dist_train *d, ag_tensor *const **params);
/* Their FQNs in the step module, in the same order (borrowed), to name the optimizer's state. */
const char *const *dist_train_param_names(const dist_train *d);
/* One forward: this rank's pieces of the global inputs (by their placements) and the local
 * pieces go to the compiled step; *loss is a new reference on success (ag_backward on it runs
 * the sharded backward, which leaves each local piece's gradient in its .grad). Returns
 * ag_compiled_call's count (1) or a negative status. */
int dist_train_call(dist_train *d, ag_tensor *const *inputs, int nin, ag_tensor **loss);
/* clip_grad_norm_ over the whole model's gradients (ag_clip_grad_norm's rule): this rank's
 * pieces' squares summed, the sharded ones' sums gathered from every rank, the replicated ones
 * counted once; every local gradient scaled when the total exceeds max_norm. A collective.
 * *total_norm gets the norm before clipping. 0 or a negative status. */
int dist_train_clip_grad_norm(dist_train *d, double max_norm, double *total_norm);
/* Copies the full tensors, gathered from every rank, into the module's parameters and buffers.
 * A collective: every rank calls it. 0 or a negative status. */
int dist_train_gather(dist_train *d);

#endif
