/* Sharding rules shared by the op families (shard_rules.c) and the entry the sharding pass
 * calls for a node (ag_op_shard_rule, declared in optable.h). The public half of the contract
 * (ag_placement, ag_shard_ctx, ag_opdef.shard, the pointwise rules) is in
 * include/aotgrad/optable.h. */
#ifndef AG_SHARD_RULES_H
#define AG_SHARD_RULES_H

#include "aotgrad/optable.h"

/* ag_op_shard_rule, the entry the sharding pass calls, is public: optable.h. */

/* ---- helpers for rules (shard_rules.c) ---- */

/* Whether c's op is named `name` ("add.Tensor", or "add" for any overload). */
bool ag__shard_op_is(const ag_shard_ctx *c, const char *name);
/* Bytes of tensor input i (the cost unit of the rules' choices). */
double ag__shard_in_bytes(const ag_shard_ctx *c, int i);
/* What moving tensor input i from c->in[i] to p costs, in bytes moved: 0 when equal or when
 * the input is Replicate() (a local slice), else the input's bytes. */
double ag__shard_move_cost(const ag_shard_ctx *c, int i, ag_placement p);
/* Whether p is valid for metadata m on c->world ranks: Replicate, Partial, or a Shard of a dim
 * in range whose size divides by world x split factor. */
bool ag__shard_fits(const ag_shard_ctx *c, const ag_tmeta *m, ag_placement p);
/* A Shard placement with split factor k on dim d (k <= 1: a plain Shard). */
ag_placement ag__shard_p(int d, int k);
/* The split factor of p as an int >= 1. */
int ag__shard_sf(ag_placement p);

/* ---- the ops' rules (shard_ops.c), set as ag_opdef.shard in the family files ---- */
int ag__shard_identity(ag_shard_ctx *c);
int ag__shard_transpose(ag_shard_ctx *c);
int ag__shard_permute(ag_shard_ctx *c);
int ag__shard_unsqueeze(ag_shard_ctx *c);
int ag__shard_squeeze(ag_shard_ctx *c);
int ag__shard_slice(ag_shard_ctx *c);
int ag__shard_expand(ag_shard_ctx *c);
int ag__shard_view(ag_shard_ctx *c);
int ag__shard_sum(ag_shard_ctx *c);
int ag__shard_softmax(ag_shard_ctx *c);
int ag__shard_softmax_backward(ag_shard_ctx *c);
int ag__shard_mm(ag_shard_ctx *c);
int ag__shard_addmm(ag_shard_ctx *c);
int ag__shard_layer_norm(ag_shard_ctx *c);
int ag__shard_layer_norm_backward(ag_shard_ctx *c);
int ag__shard_batch_norm(ag_shard_ctx *c);
int ag__shard_batch_norm_backward(ag_shard_ctx *c);
int ag__shard_embedding(ag_shard_ctx *c);
int ag__shard_embedding_backward(ag_shard_ctx *c);
int ag__shard_gather(ag_shard_ctx *c);
int ag__shard_index_select(ag_shard_ctx *c);
int ag__shard_nll_loss(ag_shard_ctx *c);
int ag__shard_nll_loss_backward(ag_shard_ctx *c);
int ag__shard_sdpa(ag_shard_ctx *c);
int ag__shard_convolution(ag_shard_ctx *c);
int ag__shard_convolution_backward(ag_shard_ctx *c);
int ag__shard_max_pool(ag_shard_ctx *c);
int ag__shard_split(ag_shard_ctx *c);
int ag__shard_cat(ag_shard_ctx *c);
int ag__shard_factory(ag_shard_ctx *c);

#endif
