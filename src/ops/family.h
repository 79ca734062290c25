/* The op families: each file of src/ops declares its ops (ag_opdef) and lists them in one
 * NULL-terminated array that optable.c registers at first use. Adding an op = its definition
 * and entry point in the family file, its line in that array, its tests. */
#ifndef AG_FAMILY_H
#define AG_FAMILY_H

#include "aotgrad/optable.h"

extern const ag_opdef
    *const ag__ops_pointwise[];                /* pointwise.c: arithmetic, activations, compare */
extern const ag_opdef *const ag__ops_views[];  /* views.c: view/reshape/permute/slice/..., copies */
extern const ag_opdef *const ag__ops_reduce[]; /* reduce.c: sum/mean/amax/var/softmax/... */
extern const ag_opdef *const ag__ops_linalg[]; /* linalg.c: mm/bmm/addmm/matmul/linear */
extern const ag_opdef *const ag__ops_conv[];   /* conv.c: convolution, pooling */
extern const ag_opdef
    *const ag__ops_norm[]; /* norm.c: layer_norm, batch_norm and their backward ops */
extern const ag_opdef *const ag__ops_nn[];      /* nn_ops.c: embedding, losses, dropout, sdpa */
extern const ag_opdef *const ag__ops_index[];   /* index.c: cat/stack/split/gather/index/... */
extern const ag_opdef *const ag__ops_factory[]; /* factory.c: zeros/ones/full/arange/rand/... */
extern const ag_opdef
    *const ag__ops_inplace_views[]; /* inplace_views.c: t_/transpose_/unsqueeze_/as_strided_ */
extern const ag_opdef *const ag__ops_philox[]; /* philox.c: philox_rand, philox_randn */
extern const ag_opdef
    *const ag__ops_collectives[]; /* collectives.c: _c10d_functional::all_reduce, ... */

/* philox.c: fills contiguous t from generator counters offset.. (uniform [lo, hi) or normal with
 * mean lo and std hi); eager's random ops and the functional philox ops share it. */
/* factory.c: a SymInt[] size argument has at most AG_MAX_DIMS non-negative sizes. */
int ag__sizes_check(const char *op, const ag_arg *sz);

int ag__philox_fill(ag_tensor *t, uint64_t seed, uint64_t offset, bool normal, double lo,
                    double hi);

#endif
