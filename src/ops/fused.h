/* Fused kernels: what a chain of ops computes, in one pass, for the executor's fusion
 * (src/runtime/fuse.c). Each is bit-identical to running the ops of its chain one after the
 * other (the same expressions in the same order, over the same row partition where a
 * reduction is involved), and works on contiguous data. They return 0, a negative status, or
 * 1 when the case is not one they handle (the executor then runs the ops one by one). */
#ifndef AG_FUSED_H
#define AG_FUSED_H

#include "../core/kernel_util.h"

/* add.Tensor then native_layer_norm over the last dim: sum = a + b (all (M, N)), then y, mean
 * and rstd of layer norm of sum with weight w and bias b (N, or NULL). norm.c. */
int ag__fused_add_layer_norm(ag_dtype dt, const void *a, const void *b, void *sum, const void *w,
                             const void *bias, void *y, void *mean, void *rstd, int64_t M,
                             int64_t N, double eps);

/* native_layer_norm_backward then add.Tensor of its input gradient to acc: gx, gw, gb as the op
 * computes them (gx may not be NULL), and out = acc + gx (all (M, N)). norm.c. */
int ag__fused_layer_norm_backward_add(ag_dtype dt, const void *g, const void *x, const void *mean,
                                      const void *rstd, const void *w, void *gx, void *gw, void *gb,
                                      int64_t M, int64_t N, const void *acc, void *out);

/* _native_batch_norm_legit_functional (its bound arguments a[0..7] and outputs o[0..4], x of
 * any layout) then relu of its output into z (contiguous, x's size): z = relu(y) with y as the op
 * computes it, y written to o[0] only when write_y. norm.c. */
int ag__fused_batch_norm_relu(const ag_arg *a, ag_tensor *const *o, ag_tensor *z, bool write_y);

/* threshold_backward(grad, self, threshold) (arguments t[0..2]; grad and self contiguous, of
 * the input's size and dtype) then native_batch_norm_backward of its result (arguments b[0..9],
 * b[0] standing for the thresholded gradient, which is not written; outputs o[0..2]). norm.c. */
int ag__fused_threshold_batch_norm_backward(const ag_arg *t, const ag_arg *b, ag_tensor *const *o);

/* nll_loss_backward (no class weights) then _log_softmax_backward_data over the classes of the
 * (N, C) log-probabilities y: out = d - exp(y) sum_row(d), d being nll_loss_backward's dense
 * gradient, written to dnll only when that is not NULL. g is the loss gradient (per row when
 * per_row, reduction none; else one value, divided by total for mean). reduce_kernels.c. */
int ag__fused_nll_log_softmax_backward(const ag_tensor *g, bool per_row, bool mean, double total,
                                       const int64_t *target, int64_t ignore, ag_dtype dt,
                                       const void *y, void *out, void *dnll, int64_t N, int64_t C);

/* addmm then gelu: out = beta * self + alpha * mat1 @ mat2 (self broadcast to (n, m), as the
 * addmm kernel does), then y = gelu(out) (approximate "tanh" when tanh), f32 only, out and y
 * contiguous (n, m). linalg.c. */
int ag__fused_addmm_gelu(ag_tensor *self, ag_tensor *mat1, ag_tensor *mat2, double beta,
                         double alpha, ag_tensor *out, ag_tensor *y, bool tanh);

#endif
