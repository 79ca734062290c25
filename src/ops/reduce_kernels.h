/* The CPU loops behind the reduction and softmax ops (reduce_kernels.c), called by the kernels
 * in reduce.c once arguments are checked. `reduce[d]` marks the dims to reduce; `out` is the
 * fresh contiguous output the dispatcher allocated from the op's meta (dtype and shape already
 * right); inputs may have any strides. Each returns 0 or a negative status (AG_ENOMEM with the
 * message set), leaking nothing. */
#ifndef AG_REDUCE_KERNELS_H
#define AG_REDUCE_KERNELS_H

#include "../core/kernel_util.h"

/* Sum, or mean when `mean`, of x over the reduced dims. x is float and out has x's dtype, or x
 * is i64/bool and out is i64 (exact, wrapping integer sums). */
int ag__reduce_sum(const ag_tensor *x, const bool *reduce, ag_tensor *out, bool mean);
/* Max (NaN if any NaN) of a float, i64 or bool x; out has x's dtype. Reduced dims non-empty. */
int ag__reduce_amax(const ag_tensor *x, const bool *reduce, ag_tensor *out);
/* Variance with divisor max(N - correction, 0), float x. */
int ag__reduce_var(const ag_tensor *x, const bool *reduce, double correction, ag_tensor *out);
/* log(sum(exp(x))) computed as max + log(sum(exp(x - max))), float x. */
int ag__reduce_logsumexp(const ag_tensor *x, const bool *reduce, ag_tensor *out);
/* i64 index of the first maximum along dim (wrapped, >= 0), a NaN counting as the maximum;
 * dim < 0: of the flattened tensor (out has one element). x is f32, f64 or i64. */
int ag__argmax(ag_tensor *x, int dim, ag_tensor *out);
/* softmax (or log_softmax when logp) of float x along dim (wrapped; 0 for 0-d tensors). */
int ag__softmax(ag_tensor *x, int dim, bool logp, ag_tensor *out);
/* The backward helpers: out = y (g - sum(g y)), or with logp g - exp(y) sum(g), sums along dim.
 * g, y and out have one shape and one float dtype. */
int ag__softmax_backward(ag_tensor *g, ag_tensor *y, int dim, bool logp, ag_tensor *out);

#endif
