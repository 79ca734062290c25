/* Tensor operations. Each function is a thin entry point that builds the argument array of one
 * op-table entry (named in its comment, ATen's name) and calls it through the dispatcher, so the
 * same call runs eagerly, records autograd history and, later, traces.
 *
 * Every function returns a new reference (scope-owned inside ag_scope_begin/end), or NULL with
 * ag_last_error() set. Tensor arguments are borrowed. A NULL tensor argument makes the call
 * return NULL and keeps the earlier error message. Integer dims may be negative (from the end).
 * Binary ops broadcast as PyTorch does and promote dtypes (bool < i64 < f32 < f64; a Scalar
 * operand does not raise a float tensor's precision). */
#ifndef AOTGRAD_OPS_H
#define AOTGRAD_OPS_H

#include "core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- pointwise, binary (add.Tensor, sub.Tensor, mul.Tensor, div.Tensor, ...) ---- */
AG_API ag_tensor *ag_add(ag_tensor *a, ag_tensor *b);                     /* add.Tensor */
AG_API ag_tensor *ag_add_alpha(ag_tensor *a, ag_tensor *b, double alpha); /* a + alpha*b */
AG_API ag_tensor *ag_sub(ag_tensor *a, ag_tensor *b);                     /* sub.Tensor */
AG_API ag_tensor *ag_mul(ag_tensor *a, ag_tensor *b);                     /* mul.Tensor */
AG_API ag_tensor *ag_div(ag_tensor *a, ag_tensor *b);                     /* div.Tensor */
AG_API ag_tensor *ag_add_scalar(ag_tensor *a, double s);                  /* add.Scalar */
AG_API ag_tensor *ag_sub_scalar(ag_tensor *a, double s);                  /* sub.Scalar */
AG_API ag_tensor *ag_mul_scalar(ag_tensor *a, double s);                  /* mul.Scalar */
AG_API ag_tensor *ag_div_scalar(ag_tensor *a, double s);                  /* div.Scalar */
AG_API ag_tensor *ag_pow_scalar(ag_tensor *a, double exponent);           /* pow.Tensor_Scalar */

/* ---- pointwise, unary ---- */
AG_API ag_tensor *ag_neg(ag_tensor *a);
AG_API ag_tensor *ag_exp(ag_tensor *a);
AG_API ag_tensor *ag_log(ag_tensor *a);
AG_API ag_tensor *ag_sqrt(ag_tensor *a);
AG_API ag_tensor *ag_rsqrt(ag_tensor *a);
AG_API ag_tensor *ag_abs(ag_tensor *a);
AG_API ag_tensor *ag_tanh(ag_tensor *a);
AG_API ag_tensor *ag_sigmoid(ag_tensor *a);
AG_API ag_tensor *ag_relu(ag_tensor *a);
AG_API ag_tensor *ag_gelu(ag_tensor *a, const char *approximate); /* "none" or "tanh" */
AG_API ag_tensor *ag_silu(ag_tensor *a);
AG_API ag_tensor *ag_sin(ag_tensor *a);
AG_API ag_tensor *ag_cos(ag_tensor *a);
AG_API ag_tensor *ag_sign(ag_tensor *a);
/* NAN for an absent bound (clamp(Tensor self, Scalar? min=None, Scalar? max=None)). */
AG_API ag_tensor *ag_clamp(ag_tensor *a, double min, double max);
AG_API ag_tensor *ag_where(ag_tensor *cond, ag_tensor *a, ag_tensor *b);   /* where.self */
AG_API ag_tensor *ag_masked_fill(ag_tensor *a, ag_tensor *mask, double v); /* masked_fill.Scalar */

/* ---- comparisons (bool results, no gradient) ---- */
AG_API ag_tensor *ag_eq(ag_tensor *a, ag_tensor *b);
AG_API ag_tensor *ag_ne(ag_tensor *a, ag_tensor *b);
AG_API ag_tensor *ag_lt(ag_tensor *a, ag_tensor *b);
AG_API ag_tensor *ag_le(ag_tensor *a, ag_tensor *b);
AG_API ag_tensor *ag_gt(ag_tensor *a, ag_tensor *b);
AG_API ag_tensor *ag_ge(ag_tensor *a, ag_tensor *b);
AG_API ag_tensor *ag_eq_scalar(ag_tensor *a, double s);
AG_API ag_tensor *ag_ne_scalar(ag_tensor *a, double s);
AG_API ag_tensor *ag_lt_scalar(ag_tensor *a, double s);
AG_API ag_tensor *ag_le_scalar(ag_tensor *a, double s);
AG_API ag_tensor *ag_gt_scalar(ag_tensor *a, double s);
AG_API ag_tensor *ag_ge_scalar(ag_tensor *a, double s);

/* ---- backward helpers (ATen's names; used by backward rules, callable directly) ---- */
AG_API ag_tensor *ag_threshold_backward(ag_tensor *grad, ag_tensor *self, double threshold);
AG_API ag_tensor *ag_sigmoid_backward(ag_tensor *grad, ag_tensor *output);
AG_API ag_tensor *ag_tanh_backward(ag_tensor *grad, ag_tensor *output);
AG_API ag_tensor *ag_gelu_backward(ag_tensor *grad, ag_tensor *self, const char *approximate);
AG_API ag_tensor *ag_silu_backward(ag_tensor *grad, ag_tensor *self);

/* ---- dtype, copies ---- */
AG_API ag_tensor *ag_to_dtype(ag_tensor *a, ag_dtype dt); /* _to_copy */
AG_API ag_tensor *ag_clone(ag_tensor *a);                 /* clone (contiguous result) */
AG_API ag_tensor *ag_contiguous(ag_tensor *a);            /* a itself (new ref) if contiguous */

/* ---- views (share storage; see core.h) ---- */
AG_API ag_tensor *ag_view(ag_tensor *a, int ndim, const int64_t *sizes);    /* one size may be -1 */
AG_API ag_tensor *ag_reshape(ag_tensor *a, int ndim, const int64_t *sizes); /* view or copy */
AG_API ag_tensor *ag_permute(ag_tensor *a, int ndim, const int64_t *dims);
AG_API ag_tensor *ag_transpose(ag_tensor *a, int d0, int d1);
AG_API ag_tensor *ag_t(ag_tensor *a); /* 2-d (or fewer) transpose */
AG_API ag_tensor *ag_expand(ag_tensor *a, int ndim, const int64_t *sizes); /* -1 keeps a size */
AG_API ag_tensor *ag_slice(ag_tensor *a, int dim, int64_t start, int64_t end, int64_t step);
AG_API ag_tensor *ag_select(ag_tensor *a, int dim, int64_t index);
AG_API ag_tensor *ag_unsqueeze(ag_tensor *a, int dim);
AG_API ag_tensor *ag_squeeze(ag_tensor *a, int dim); /* squeeze.dim: no-op if size != 1 */
AG_API ag_tensor *ag_squeeze_all(ag_tensor *a);
AG_API ag_tensor *ag_as_strided(ag_tensor *a, int ndim, const int64_t *sizes,
                                const int64_t *strides, int64_t offset);
AG_API ag_tensor *ag_alias(ag_tensor *a);
/* In-place view ops (metadata mutations): self takes the view's sizes, strides and offset;
 * its data is untouched. Return self (a new reference). */
AG_API ag_tensor *ag_t_(ag_tensor *a);
AG_API ag_tensor *ag_transpose_(ag_tensor *a, int d0, int d1);
AG_API ag_tensor *ag_unsqueeze_(ag_tensor *a, int dim);
AG_API ag_tensor *ag_as_strided_(ag_tensor *a, int ndim, const int64_t *sizes,
                                 const int64_t *strides, int64_t offset); /* offset < 0: keep */
/* Backward helpers of views. */
AG_API ag_tensor *ag_slice_backward(ag_tensor *grad, int ndim, const int64_t *input_sizes, int dim,
                                    int64_t start, int64_t end, int64_t step);
AG_API ag_tensor *ag_select_backward(ag_tensor *grad, int ndim, const int64_t *input_sizes, int dim,
                                     int64_t index);

/* ---- reductions. dims == NULL (ndims 0) reduces over every dim. Over an empty dim (as in
 * PyTorch) sum gives 0, mean and var NaN, logsumexp -inf; amax and argmax refuse one (there is
 * no maximum), and argmax_all refuses a tensor with no elements. ---- */
AG_API ag_tensor *ag_sum(ag_tensor *a, const int64_t *dims, int ndims,
                         bool keepdim); /* sum.dim_IntList */
AG_API ag_tensor *ag_sum_all(ag_tensor *a);
AG_API ag_tensor *ag_mean(ag_tensor *a, const int64_t *dims, int ndims,
                          bool keepdim); /* mean.dim */
AG_API ag_tensor *ag_mean_all(ag_tensor *a);
AG_API ag_tensor *ag_amax(ag_tensor *a, const int64_t *dims, int ndims, bool keepdim);
/* var.correction: correction 1 is the unbiased estimate. */
AG_API ag_tensor *ag_var(ag_tensor *a, const int64_t *dims, int ndims, double correction,
                         bool keepdim);
AG_API ag_tensor *ag_logsumexp(ag_tensor *a, const int64_t *dims, int ndims, bool keepdim);
AG_API ag_tensor *ag_argmax(ag_tensor *a, int dim, bool keepdim); /* i64 */
AG_API ag_tensor *ag_argmax_all(ag_tensor *a);
AG_API ag_tensor *ag_softmax(ag_tensor *a, int dim);     /* _softmax */
AG_API ag_tensor *ag_log_softmax(ag_tensor *a, int dim); /* _log_softmax */
AG_API ag_tensor *ag_softmax_backward_data(ag_tensor *grad, ag_tensor *output, int dim,
                                           ag_dtype input_dtype);
AG_API ag_tensor *ag_log_softmax_backward_data(ag_tensor *grad, ag_tensor *output, int dim,
                                               ag_dtype input_dtype);

/* ---- linear algebra (cblas GEMM with transpose flags; no copies of transposed views) ---- */
AG_API ag_tensor *ag_mm(ag_tensor *a, ag_tensor *b);  /* (n,k) @ (k,m) */
AG_API ag_tensor *ag_bmm(ag_tensor *a, ag_tensor *b); /* (B,n,k) @ (B,k,m) */
/* beta*self + alpha*(mat1 @ mat2), self broadcast to (n,m) */
AG_API ag_tensor *ag_addmm(ag_tensor *self, ag_tensor *mat1, ag_tensor *mat2, double beta,
                           double alpha);
AG_API ag_tensor *ag_matmul(ag_tensor *a, ag_tensor *b); /* composite: mm/bmm with views */
/* x (*, in) @ w(out, in)^T + b(out); b may be NULL. Composite: t + addmm (or matmul). */
AG_API ag_tensor *ag_linear(ag_tensor *x, ag_tensor *w, ag_tensor *b);

/* ---- convolution and pooling (NCHW) ---- */
/* convolution(input (N,C,H,W), weight (O,C/groups,kh,kw), bias (O) or NULL, stride, padding,
 * dilation, transposed=false, output_padding, groups); 2-d only. */
AG_API ag_tensor *ag_conv2d(ag_tensor *x, ag_tensor *w, ag_tensor *b, const int64_t stride[2],
                            const int64_t padding[2], const int64_t dilation[2], int64_t groups);
/* convolution_backward: returns grad_input, grad_weight, grad_bias per output_mask (NULL where
 * not asked). */
AG_API int ag_convolution_backward(ag_tensor *grad, ag_tensor *x, ag_tensor *w,
                                   const int64_t *bias_sizes, const int64_t stride[2],
                                   const int64_t padding[2], const int64_t dilation[2],
                                   int64_t groups, const bool output_mask[3], ag_tensor **outs);
/* max_pool2d_with_indices: out and i64 indices (flat within each H*W plane). */
AG_API int ag_max_pool2d_with_indices(ag_tensor *x, const int64_t kernel[2],
                                      const int64_t stride[2], const int64_t padding[2],
                                      const int64_t dilation[2], bool ceil_mode, ag_tensor **out,
                                      ag_tensor **indices);
AG_API ag_tensor *ag_max_pool2d(ag_tensor *x, const int64_t kernel[2], const int64_t stride[2],
                                const int64_t padding[2]);
AG_API ag_tensor *ag_avg_pool2d(ag_tensor *x, const int64_t kernel[2], const int64_t stride[2],
                                const int64_t padding[2], bool ceil_mode, bool count_include_pad);
/* avg_pool2d with divisor_override (0: None, the window's count); stride NULL: the kernel. */
AG_API ag_tensor *ag_avg_pool2d_ex(ag_tensor *x, const int64_t kernel[2], const int64_t stride[2],
                                   const int64_t padding[2], bool ceil_mode, bool count_include_pad,
                                   int64_t divisor_override);
AG_API ag_tensor *ag_adaptive_avg_pool2d(ag_tensor *x, const int64_t output_size[2]);

/* ---- normalization ---- */
/* native_layer_norm over the trailing `nnorm` dims: out, mean, rstd (mean/rstd keep the
 * leading dims and have size 1 in the normalized ones). weight/bias may be NULL. */
AG_API int ag_native_layer_norm(ag_tensor *x, int nnorm, const int64_t *normalized_shape,
                                ag_tensor *weight, ag_tensor *bias, double eps, ag_tensor **out,
                                ag_tensor **mean, ag_tensor **rstd);
AG_API ag_tensor *ag_layer_norm(ag_tensor *x, int nnorm, const int64_t *normalized_shape,
                                ag_tensor *weight, ag_tensor *bias, double eps);
/* native_batch_norm on (N,C,...): out, save_mean, save_invstd. In training it updates
 * running_mean/running_var in place (momentum, unbiased variance) when they are given; one
 * value per channel is an error, and no values (a batch of 0) give an empty out, save_mean and
 * save_invstd 0 and leave the running statistics as they are. */
AG_API int ag_native_batch_norm(ag_tensor *x, ag_tensor *weight, ag_tensor *bias,
                                ag_tensor *running_mean, ag_tensor *running_var, bool training,
                                double momentum, double eps, ag_tensor **out, ag_tensor **save_mean,
                                ag_tensor **save_invstd);

/* ---- embedding, losses, dropout, attention ---- */
AG_API ag_tensor *ag_embedding(ag_tensor *weight, ag_tensor *indices); /* indices i64 */
AG_API ag_tensor *ag_embedding_dense_backward(ag_tensor *grad, ag_tensor *indices,
                                              int64_t num_weights, int64_t padding_idx);
enum { AG_REDUCTION_NONE = 0, AG_REDUCTION_MEAN = 1, AG_REDUCTION_SUM = 2 };
/* nll_loss_forward on log-probs (N,C) or (C) with i64 targets: output, total_weight. */
AG_API ag_tensor *ag_nll_loss(ag_tensor *logp, ag_tensor *target, int reduction,
                              int64_t ignore_index);
AG_API ag_tensor *ag_cross_entropy(ag_tensor *logits, ag_tensor *target, int reduction,
                                   int64_t ignore_index); /* composite: log_softmax + nll */
/* cross_entropy_loss with all of ATen's arguments (torch.nn.functional.cross_entropy): weight
 * (C) class weights or NULL (borrowed), reduction, ignore_index (-100 in PyTorch), and
 * label_smoothing in [0, 1]. With weights and label smoothing, per sample n (target y_n, C
 * classes, logp = log_softmax(logits)):
 *   l_n = (1 - ls) * (-w[y_n] logp[n, y_n]) + ls / C * (-sum_c w[c] logp[n, c]),
 * 0 for an ignored target; mean divides the sum over n by sum_n w[y_n] over the kept targets
 * (PyTorch's normalization, for both terms). A new tensor in the caller's scope, or NULL. */
AG_API ag_tensor *ag_cross_entropy_loss(ag_tensor *logits, ag_tensor *target, ag_tensor *weight,
                                        int reduction, int64_t ignore_index,
                                        double label_smoothing);
/* native_dropout(x, p, train): out and the bool keep-mask; draws from the generator. */
AG_API int ag_native_dropout(ag_tensor *x, double p, bool train, ag_tensor **out, ag_tensor **mask);
AG_API ag_tensor *ag_dropout(ag_tensor *x, double p, bool train); /* composite */
/* q,k,v (B..., L, E); causal masks j > i. scale <= 0 means 1/sqrt(E). */
AG_API ag_tensor *ag_scaled_dot_product_attention(ag_tensor *q, ag_tensor *k, ag_tensor *v,
                                                  bool is_causal, double scale);

/* ---- joining, indexing ---- */
AG_API ag_tensor *ag_cat(ag_tensor *const *ts, int n, int dim);
AG_API ag_tensor *ag_stack(ag_tensor *const *ts, int n, int dim);
/* split.Tensor: chunks of `split_size` along dim (the last may be smaller); stores up to
 * max_out new references in outs and returns the count, or a negative status. */
AG_API int ag_split(ag_tensor *a, int64_t split_size, int dim, ag_tensor **outs, int max_out);
AG_API ag_tensor *ag_index_select(ag_tensor *a, int dim, ag_tensor *index);
AG_API ag_tensor *ag_gather(ag_tensor *a, int dim, ag_tensor *index);
/* index.Tensor: advanced indexing with one optional i64/bool index tensor per leading dim
 * (NULL entries mean ':'). */
AG_API ag_tensor *ag_index(ag_tensor *a, ag_tensor *const *indices, int n);
AG_API ag_tensor *ag_index_put(ag_tensor *a, ag_tensor *const *indices, int n, ag_tensor *values,
                               bool accumulate);
AG_API ag_tensor *ag_new_empty(ag_tensor *like, int ndim, const int64_t *sizes);
AG_API ag_tensor *ag_new_zeros(ag_tensor *like, int ndim, const int64_t *sizes);
/* index_add: a copy of `a` with alpha*source added at `index` along dim. */
AG_API ag_tensor *ag_index_add(ag_tensor *a, int dim, ag_tensor *index, ag_tensor *source,
                               double alpha);
/* scatter_add: a copy of `a` with src[i][j] added at a[index[i][j]][j] (dim 0), etc. */
AG_API ag_tensor *ag_scatter_add(ag_tensor *a, int dim, ag_tensor *index, ag_tensor *src);
AG_API ag_tensor *ag_zeros_like(ag_tensor *a);
AG_API ag_tensor *ag_ones_like(ag_tensor *a);
AG_API ag_tensor *ag_full_like(ag_tensor *a, double v);

/* ---- random ---- */
AG_API ag_tensor *ag_rand(ag_dtype dt, int ndim, const int64_t *sizes);  /* U[0,1) */
AG_API ag_tensor *ag_randn(ag_dtype dt, int ndim, const int64_t *sizes); /* N(0,1) */
/* Functional draws from an explicit generator state (seed, offset: 0-dim int64 tensors); the
 * generator is neither read nor advanced. philox_rand gives U[low, high), philox_randn
 * N(mean, std^2); with the generator at (seed, offset), ag_rand / ag_randn (low 0, high 1 /
 * mean 0, std 1) and uniform_ / normal_ of a tensor of the same size give the same values,
 * bit for bit. The joint export records random ops as these (RNG functionalization). */
AG_API ag_tensor *ag_philox_rand(ag_tensor *seed, ag_tensor *offset, ag_dtype dt, int ndim,
                                 const int64_t *sizes, double low, double high);
AG_API ag_tensor *ag_philox_randn(ag_tensor *seed, ag_tensor *offset, ag_dtype dt, int ndim,
                                  const int64_t *sizes, double mean, double std);

/* ---- collectives (_c10d_functional::*; process groups in dist.h) ----
 * Each starts a collective over the process group named `group` ("0": the world) and returns
 * its output, which must go through ag_wait_tensor before anything reads it: the collective runs
 * while other work goes on, and ag_wait_tensor completes it (a new tensor, or the same buffer
 * in a planned graph). Every rank of the group must make the same calls in the same order.
 * reduce_op is "sum", "avg", "max" or "min" (avg: floating-point tensors; bool: max, min).
 * Gradients follow the convention that the program's loss is the sum over ranks of each rank's
 * loss (max and min are not differentiable). float32, float64, int64 and bool tensors. */
AG_API ag_tensor *ag_all_reduce(ag_tensor *x, const char *reduce_op, const char *group);
/* Concatenates every rank's x along dim 0, in rank order: dim 0 becomes group_size x dim 0;
 * group_size must be the group's size. */
AG_API ag_tensor *ag_all_gather_into_tensor(ag_tensor *x, int64_t group_size, const char *group);
/* Reduces x over the ranks, then rank r keeps block r of group_size equal blocks along dim 0
 * (dim 0 must be divisible by group_size, the group's size). */
AG_API ag_tensor *ag_reduce_scatter_tensor(ag_tensor *x, const char *reduce_op, int64_t group_size,
                                           const char *group);
/* Rank r sends rows [sum(in_splits[0..s)), +in_splits[s]) of x (along dim 0) to rank s and
 * receives out_splits[s] rows from each rank s, concatenated in rank order. Empty split lists
 * (nout or nin 0) mean dim 0 cut into group-size equal parts. */
AG_API ag_tensor *ag_all_to_all_single(ag_tensor *x, const int64_t *out_splits, int nout,
                                       const int64_t *in_splits, int nin, const char *group);
/* Every rank gets rank src's x (same shape on every rank). */
AG_API ag_tensor *ag_broadcast(ag_tensor *x, int64_t src, const char *group);
/* Completes the collective whose output is x and returns its value; on any other tensor, a
 * copy. */
AG_API ag_tensor *ag_wait_tensor(ag_tensor *x);

/* ---- in place (bump the storage version; return a new reference to `a`) ---- */
AG_API ag_tensor *ag_add_(ag_tensor *a, ag_tensor *b, double alpha); /* add_.Tensor */
AG_API ag_tensor *ag_add_scalar_(ag_tensor *a, double s);
AG_API ag_tensor *ag_mul_(ag_tensor *a, ag_tensor *b);
AG_API ag_tensor *ag_mul_scalar_(ag_tensor *a, double s);
AG_API ag_tensor *ag_copy_(ag_tensor *dst, ag_tensor *src);
AG_API ag_tensor *ag_zero_(ag_tensor *a);
AG_API ag_tensor *ag_fill_(ag_tensor *a, double v);
AG_API ag_tensor *ag_index_put_(ag_tensor *a, ag_tensor *const *indices, int n, ag_tensor *values,
                                bool accumulate);
/* In-place uniform/normal init used by module initializers (no autograd). */
AG_API ag_tensor *ag_uniform_(ag_tensor *a, double lo, double hi);
AG_API ag_tensor *ag_normal_(ag_tensor *a, double mean, double std);

#ifdef __cplusplus
}
#endif
#endif
