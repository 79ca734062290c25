/* Neural-network ops: embedding, the negative log-likelihood loss (nll_loss_forward),
 * native_dropout and CPU attention (_scaled_dot_product_flash_attention_for_cpu), each with the
 * ATen backward op its backward rule calls (embedding_dense_backward, nll_loss_backward,
 * native_dropout_backward, _scaled_dot_product_flash_attention_for_cpu_backward), plus the
 * composite front doors cross_entropy_loss, dropout and scaled_dot_product_attention, which
 * decompose into them as ATen's do. Normalization lives in norm.c.
 *
 * Data-dependent checks (embedding indices, loss targets) live in kernels, never in meta
 * functions, which see no data under tracing. Attention materializes the (L, S) score matrix of
 * one (batch, head) at a time and runs its products through cblas, one (batch, head) per
 * OpenMP thread (OpenBLAS runs single-threaded inside a parallel region). */
#include "nn_util.h"
#include "family.h"
#include "shard_rules.h"

#include <cblas.h>
#include <omp.h>
#include <stdio.h>
#include <tgmath.h> /* exp/log/sqrt follow the element type inside AG__FLOAT_SWITCH bodies */

/* ---- embedding ---- */

static int check_indices(const char *op, const ag_tensor *idx) {
    if (idx->dtype != AG_I64)
        return ag__err(AG_EINVAL, "%s: indices must be int64, got %s", op,
                       ag_dtype_short(idx->dtype));
    return 0;
}

static int emb_meta(const ag_arg *a, ag_tmeta *o) {
    const char *op = "embedding";
    ag_tensor *w = a[0].u.t, *idx = a[1].u.t;
    char s[128];
    if (w->ndim != 2)
        return ag__err(AG_EINVAL, "%s: weight must be 2-d (num_embeddings, dim), got %s", op,
                       shape_str(w, s, sizeof s));
    int rc = check_indices(op, idx);
    if (rc)
        return rc;
    if (idx->ndim + 1 > AG_MAX_DIMS)
        return ag__err(AG_EINVAL, "%s: indices %s have too many dims", op,
                       shape_str(idx, s, sizeof s));
    if (a[4].u.b)
        return ag__err(AG_ENOTSUP, "%s: sparse gradients (sparse=True) are not supported", op);
    int64_t sizes[AG_MAX_DIMS];
    memcpy(sizes, idx->sizes, sizeof(int64_t) * (size_t)idx->ndim);
    sizes[idx->ndim] = w->sizes[1];
    ag__tmeta_contiguous(&o[0], w->dtype, idx->ndim + 1, sizes);
    return 0;
}

/* Every index must lie in [0, rows); the message names the first one that does not. */
static int check_index_range(const char *op, const int64_t *ix, int64_t n, int64_t rows,
                             const char *what) {
    for (int64_t i = 0; i < n; i++)
        if (ix[i] < 0 || ix[i] >= rows)
            return ag__err(AG_EINVAL,
                           "%s: index %lld (at position %lld of indices) is out of range for %s "
                           "of %lld rows",
                           op, (long long)ix[i], (long long)i, what, (long long)rows);
    return 0;
}

static int emb_kernel(const ag_arg *a, ag_tensor **o) {
    ag_tensor *w = a[0].u.t, *idx = a[1].u.t;
    ag__scratch_tensor tidx;
    const int64_t *ix = pack(idx, &tidx, 1);
    if (!ix)
        return ag_last_status();
    const int64_t n = ag_tensor_numel(idx), V = w->sizes[0], D = w->sizes[1];
    char s[128], what[160];
    snprintf(what, sizeof what, "a weight of shape %s", shape_str(w, s, sizeof s));
    int rc = check_index_range("embedding", ix, n, V, what);
    if (rc == 0) {
        const size_t es = ag_dtype_size(w->dtype);
        const char *src = data_of(w);
        char *dst = data_of(o[0]);
        const int64_t s0 = w->strides[0], s1 = w->strides[1];
        const bool par = n > 1 && n * D >= AG__PAR_MIN;
#pragma omp parallel for schedule(static) if (par)
        for (int64_t i = 0; i < n; i++) {
            const char *row = src + (size_t)(ix[i] * s0) * es;
            char *out = dst + (size_t)(i * D) * es;
            if (s1 == 1)
                memcpy(out, row, (size_t)D * es);
            else
                for (int64_t j = 0; j < D; j++)
                    memcpy(out + (size_t)j * es, row + (size_t)(j * s1) * es, es);
        }
    }
    return rc;
}

/* derivatives.yaml: weight: embedding_backward(grad, indices, weight.size(0), padding_idx,
 * scale_grad_by_freq, sparse), which for dense gradients is embedding_dense_backward. */
static int emb_backward(ag_bwctx *c) {
    AG__OP(op, "embedding_dense_backward");
    if (!c->needs_grad[0])
        return 0;
    c->grad_inputs[0] =
        ag__call1(op,
                  (ag_arg[]){AG_A_T(c->grad_outputs[0]), AG_A_T(c->args[1].u.t),
                             AG_A_I(c->input_meta[0].sizes[0]), c->args[2], c->args[3]},
                  5);
    return c->grad_inputs[0] ? 0 : ag_last_status();
}

static void emb_cost(const ag_arg *a, const ag_tmeta *o, int nouts, ag_cost *c) {
    c->flops = 0;
    c->bytes = tensor_bytes(a[1].u.t) + 2.0 * io_bytes(a, 0, o, nouts);
}

static void emb_samples(ag_samples *s) {
    int64_t w[] = {5, 3}, i2[] = {2, 3}, i1[] = {4};
    const int64_t ix2[] = {0, 4, 2, 4, 4, 1}, ix1[] = {3, 1, 3, 0};
    ag_samples_add(s, "2-d indices with repeats",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, w, -1, 1)),
                              AG_A_T(ag_from_data(AG_I64, 2, i2, ix2))},
                   2);
    ag_samples_add(s, "strided weight",
                   (ag_arg[]){AG_A_T(ag_samples_rand_strided(s, 2, w, -1, 1)),
                              AG_A_T(ag_from_data(AG_I64, 1, i1, ix1))},
                   2);
}

static const ag_opdef op_embedding = {
    .schema = "embedding(Tensor weight, Tensor indices, SymInt padding_idx=-1, "
              "bool scale_grad_by_freq=False, bool sparse=False) -> Tensor",
    .meta = emb_meta,
    .kernel = emb_kernel,
    .dtypes = AG_DT_ALL,
    .backward = emb_backward,
    .save_args = 0x2, /* indices */
    .cost = emb_cost,
    .samples = emb_samples,
    .shard = ag__shard_embedding,
};

ag_tensor *ag_embedding(ag_tensor *weight, ag_tensor *indices) {
    AG__OP(op, "embedding");
    return ag__call1(op, (ag_arg[]){AG_A_T(weight), AG_A_T(indices)}, 2);
}

/* ---- embedding_dense_backward ---- */

static int embb_meta(const ag_arg *a, ag_tmeta *o) {
    const char *op = "embedding_dense_backward";
    ag_tensor *g = a[0].u.t, *idx = a[1].u.t;
    int64_t V = a[2].u.i;
    int rc = check_float(op, "grad_output", g);
    if (rc || (rc = check_indices(op, idx)))
        return rc;
    char s1[128], s2[128];
    if (g->ndim != idx->ndim + 1 || !same_sizes(idx->ndim, g->sizes, idx->ndim, idx->sizes))
        return ag__err(AG_EINVAL,
                       "%s: grad_output %s must have the shape of indices %s plus "
                       "one trailing dim",
                       op, shape_str(g, s1, sizeof s1), shape_str(idx, s2, sizeof s2));
    if (V < 0)
        return ag__err(AG_EINVAL, "%s: num_weights must be >= 0, got %lld", op, (long long)V);
    int64_t sizes[2] = {V, g->sizes[g->ndim - 1]};
    ag__tmeta_contiguous(&o[0], g->dtype, 2, sizes);
    return 0;
}

/* grad_weight[ix[i]] += grad[i] for every position i, skipping padding_idx; with
 * scale_grad_by_freq each contribution is divided by how often its index occurs. Threads own
 * column blocks, so repeated indices never race. */
static int embb_kernel(const ag_arg *a, ag_tensor **o) {
    ag_tensor *g = a[0].u.t, *idx = a[1].u.t;
    ag__scratch_tensor tg, tidx;
    const int64_t V = a[2].u.i, pad = a[3].u.i;
    const bool freq = a[4].u.b;
    const void *pg = pack(g, &tg, 1);
    const int64_t *ix = pg ? pack(idx, &tidx, 2) : NULL;
    int64_t *counts = NULL;
    int rc = (!pg || !ix) ? ag_last_status() : 0;
    const int64_t n = ag_tensor_numel(idx), D = g->sizes[g->ndim - 1];
    if (rc == 0)
        rc = check_index_range("embedding_dense_backward", ix, n, V, "a table");
    if (rc == 0 && freq) {
        counts = ag__scratch(3, (size_t)(V ? V : 1) * sizeof *counts);
        if (!counts) {
            rc = AG_ENOMEM;
        } else {
            memset(counts, 0, (size_t)(V ? V : 1) * sizeof *counts);
            for (int64_t i = 0; i < n; i++)
                counts[ix[i]]++;
        }
    }
    if (rc == 0) {
        enum { BLK = 256 };
        const int64_t nblk = (D + BLK - 1) / BLK;
        const bool par = nblk > 1 && n * D >= AG__PAR_MIN;
        memset(data_of(o[0]), 0, (size_t)(V * D) * ag_dtype_size(g->dtype));
        AG__FLOAT_SWITCH(g->dtype, T, {
            const T *gd = pg;
            T *gw = data_of(o[0]);
            _Pragma("omp parallel for schedule(static) if (par)") for (int64_t blk = 0; blk < nblk;
                                                                       blk++) {
                const int64_t j0 = blk * BLK, j1 = j0 + BLK < D ? j0 + BLK : D;
                for (int64_t i = 0; i < n; i++) {
                    if (ix[i] == pad)
                        continue;
                    const T sc = freq ? (T)1 / (T)counts[ix[i]] : (T)1;
                    T *dst = gw + ix[i] * D;
                    const T *src = gd + i * D;
                    for (int64_t j = j0; j < j1; j++)
                        dst[j] += src[j] * sc;
                }
            }
        });
    }
    return rc;
}

static const ag_opdef op_embedding_dense_backward = {
    .schema = "embedding_dense_backward(Tensor grad_output, Tensor indices, SymInt num_weights, "
              "SymInt padding_idx, bool scale_grad_by_freq) -> Tensor",
    .flags = AG_OP_BACKWARD_HELPER | AG_OP_NONDIFF,
    .meta = embb_meta,
    .kernel = embb_kernel,
    .dtypes = AG_DT_FLOAT,
    .shard = ag__shard_embedding_backward,
};

ag_tensor *ag_embedding_dense_backward(ag_tensor *grad, ag_tensor *indices, int64_t num_weights,
                                       int64_t padding_idx) {
    AG__OP(op, "embedding_dense_backward");
    return ag__call1(op,
                     (ag_arg[]){AG_A_T(grad), AG_A_T(indices), AG_A_I(num_weights),
                                AG_A_I(padding_idx), AG_A_B(false)},
                     5);
}

/* ====================================================================================== */
/* ---- nll_loss_forward ---- */

/* self is (N, C) or (C); target (N) or (); weight (C) or None. */
static int nll_check(const char *op, const ag_tensor *x, const ag_tensor *t, const ag_tensor *w,
                     int64_t reduction) {
    char s1[128], s2[128];
    int rc = check_float(op, "self", x);
    if (rc)
        return rc;
    if (x->ndim != 1 && x->ndim != 2)
        return ag__err(AG_EINVAL, "%s: self must be (N, C) or (C), got %s", op,
                       shape_str(x, s1, sizeof s1));
    if (t->dtype != AG_I64)
        return ag__err(AG_EINVAL, "%s: target must be int64 class indices, got %s", op,
                       ag_dtype_short(t->dtype));
    if (t->ndim != x->ndim - 1 || (x->ndim == 2 && t->sizes[0] != x->sizes[0]))
        return ag__err(AG_EINVAL,
                       "%s: target %s does not match self %s (expected (N) for "
                       "(N, C), () for (C))",
                       op, shape_str(t, s1, sizeof s1), shape_str(x, s2, sizeof s2));
    const int64_t C = x->sizes[x->ndim - 1];
    if ((rc = check_param(op, "weight", w, x->dtype, 1, &C)))
        return rc;
    if (reduction < 0 || reduction > 2)
        return ag__err(AG_EINVAL, "%s: reduction must be 0 (none), 1 (mean) or 2 (sum), got %lld",
                       op, (long long)reduction);
    return 0;
}

static int nll_meta(const ag_arg *a, ag_tmeta *o) {
    ag_tensor *x = a[0].u.t;
    int rc = nll_check("nll_loss_forward", x, a[1].u.t, targ(&a[2]), a[3].u.i);
    if (rc)
        return rc;
    if (a[3].u.i == AG_REDUCTION_NONE)
        ag__tmeta_contiguous(&o[0], x->dtype, x->ndim - 1, x->sizes);
    else
        ag__tmeta_contiguous(&o[0], x->dtype, 0, NULL);
    ag__tmeta_contiguous(&o[1], x->dtype, 0, NULL);
    return 0;
}

/* Checks one target: ignore_index, or a class in [0, C). */
static int nll_target_ok(const char *op, int64_t t, int64_t i, int64_t C, int64_t ignore) {
    if (t == ignore || (t >= 0 && t < C))
        return 0;
    return ag__err(AG_EINVAL,
                   "%s: target %lld at position %lld is out of bounds for %lld classes (valid: "
                   "0..%lld, or ignore_index %lld)",
                   op, (long long)t, (long long)i, (long long)C, (long long)(C - 1),
                   (long long)ignore);
}

/* out_i = -w[t_i] * self[i, t_i] (0 where t_i == ignore_index); mean divides the sum by the
 * total weight of the targets that are not ignored. */
static int nll_kernel(const ag_arg *a, ag_tensor **o) {
    const char *op = "nll_loss_forward";
    ag_tensor *x = a[0].u.t, *t = a[1].u.t, *w = targ(&a[2]);
    ag__scratch_tensor tt;
    const int64_t reduction = a[3].u.i, ignore = a[4].u.i;
    const int64_t *tv = pack(t, &tt, 1);
    if (!tv)
        return ag_last_status();
    const int64_t N = x->ndim == 2 ? x->sizes[0] : 1, C = x->sizes[x->ndim - 1];
    const int64_t sn = x->ndim == 2 ? x->strides[0] : 0, sc = x->strides[x->ndim - 1];
    int rc = 0;
    for (int64_t i = 0; i < N && rc == 0; i++)
        rc = nll_target_ok(op, tv[i], i, C, ignore);
    if (rc == 0) {
        chan wc = chan_of(w);
        AG__FLOAT_SWITCH(x->dtype, T, {
            const T *xd = data_of(x);
            T *out = data_of(o[0]);
            double sum = 0, total = 0;
            for (int64_t i = 0; i < N; i++) {
                double li = 0;
                if (tv[i] != ignore) {
                    const double wi = wc.p ? (double)((const T *)wc.p)[tv[i] * wc.stride] : 1.0;
                    li = -wi * xd[i * sn + tv[i] * sc];
                    total += wi;
                }
                if (reduction == AG_REDUCTION_NONE)
                    out[i] = (T)li;
                sum += li;
            }
            if (reduction == AG_REDUCTION_MEAN)
                out[0] = (T)(sum / total);
            else if (reduction == AG_REDUCTION_SUM)
                out[0] = (T)sum;
            *(T *)data_of(o[1]) = (T)total;
        });
    }
    return rc;
}

/* derivatives.yaml: self: nll_loss_backward(grad, self, target, weight, reduction,
 * ignore_index, total_weight); target and total_weight are not differentiable. */
static int nll_backward(ag_bwctx *c) {
    if (c->needs_grad[2])
        return ag__err(AG_ENOTSUP, "nll_loss_forward: the derivative for 'weight' is not "
                                   "implemented");
    ag_tensor *g = c->grad_outputs[0];
    if (!c->needs_grad[0] || !g)
        return 0;
    AG__OP(op, "nll_loss_backward");
    c->grad_inputs[0] = ag__call1(op,
                                  (ag_arg[]){AG_A_T(g), AG_A_T(c->args[0].u.t),
                                             AG_A_T(c->args[1].u.t), AG_A_T(targ(&c->args[2])),
                                             c->args[3], c->args[4], AG_A_T(c->outputs[1])},
                                  7);
    return c->grad_inputs[0] ? 0 : ag_last_status();
}

static void nll_samples(ag_samples *s) {
    int64_t x2[] = {4, 3}, n4[] = {4}, c3[] = {3};
    const int64_t t4[] = {2, 0, 1, 2}, t4i[] = {1, -100, 2, 1}, t0[] = {2};
    const struct {
        const char *note;
        int64_t reduction;
        const int64_t *target;
    } cases[] = {{"mean", AG_REDUCTION_MEAN, t4},
                 {"sum, ignore_index", AG_REDUCTION_SUM, t4i},
                 {"none, ignore_index", AG_REDUCTION_NONE, t4i}};
    for (int k = 0; k < 3; k++)
        ag_samples_add(s, cases[k].note,
                       (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, x2, -3, 0)),
                                  AG_A_T(ag_from_data(AG_I64, 1, n4, cases[k].target)), AG_A_NONE,
                                  AG_A_I(cases[k].reduction), AG_A_I(-100)},
                       5);
    ag_samples_add(s, "mean, weight, ignore_index, strided",
                   (ag_arg[]){AG_A_T(ag_samples_rand_strided(s, 2, x2, -3, 0)),
                              AG_A_T(ag_from_data(AG_I64, 1, n4, t4i)),
                              AG_A_T(ag_samples_rand_nograd(s, 1, c3, 0.5, 2)),
                              AG_A_I(AG_REDUCTION_MEAN), AG_A_I(-100)},
                   5);
    ag_samples_add(s, "1-d input",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 1, c3, -3, 0)),
                              AG_A_T(ag_from_data(AG_I64, 0, NULL, t0)), AG_A_NONE,
                              AG_A_I(AG_REDUCTION_MEAN), AG_A_I(-100)},
                   5);
}

/* Decomposition for the sharding pass (not composite: eager calls keep the kernel): per
 * sample, the target's log-probability (gather) times its class weight, 0 for ignored targets;
 * total_weight is the sum of those weights, the output their weighted sum (sum), that sum
 * over total_weight (mean), or the per-sample values (none). On a batch-sharded input each
 * sum is a Partial(sum) scalar, where the kernel would need every row of the logits. */
static int nll_decomp(const ag_arg *a, ag_tensor **o) {
    ag_tensor *x = a[0].u.t, *t = a[1].u.t, *w = targ(&a[2]);
    const int64_t reduction = a[3].u.i, ignore = a[4].u.i;
    const bool one = x->ndim == 1; /* (C) with a target () */
    if (one) {
        x = ag_unsqueeze(x, 0);
        t = ag_unsqueeze(t, 0);
    }
    ag_tensor *ignored = ag_eq_scalar(t, (double)ignore);
    ag_tensor *safe = ag_masked_fill(t, ignored, 0.0); /* a valid index where ignored */
    ag_tensor *picked = ag_squeeze(ag_gather(x, 1, ag_unsqueeze(safe, 1)), 1);
    ag_tensor *wt = w ? ag_masked_fill(ag_index_select(w, 0, safe), ignored, 0.0)
                      : ag_to_dtype(ag_ne_scalar(t, (double)ignore), x->dtype);
    ag_tensor *loss = ag_neg(ag_mul(picked, wt));
    ag_tensor *total = ag_sum_all(wt);
    if (reduction == AG_REDUCTION_NONE)
        o[0] = one ? ag_squeeze(loss, 0) : loss;
    else if (reduction == AG_REDUCTION_SUM)
        o[0] = ag_sum_all(loss);
    else
        o[0] = ag_div(ag_sum_all(loss), total);
    o[1] = total;
    return o[0] && o[1] ? 0 : ag_last_status();
}

static const ag_opdef op_nll_loss_forward = {
    .schema = "nll_loss_forward(Tensor self, Tensor target, Tensor? weight, int reduction, "
              "SymInt ignore_index) -> (Tensor output, Tensor total_weight)",
    .meta = nll_meta,
    .kernel = nll_kernel,
    .dtypes = AG_DT_FLOAT,
    .backward = nll_backward,
    .save_args = 0x7,       /* self (for its shape, as ATen), target, weight */
    .save_outputs = 0x2,    /* total_weight */
    .nondiff_outputs = 0x2, /* total_weight */
    .samples = nll_samples,
    .shard = ag__shard_nll_loss,
    .decomp = nll_decomp,
};

ag_tensor *ag_nll_loss(ag_tensor *logp, ag_tensor *target, int reduction, int64_t ignore_index) {
    AG__OP(op, "nll_loss_forward");
    return ag__call1(op,
                     (ag_arg[]){AG_A_T(logp), AG_A_T(target), AG_A_NONE, AG_A_I(reduction),
                                AG_A_I(ignore_index)},
                     5);
}

/* ---- nll_loss_backward ---- */

static int nllb_meta(const ag_arg *a, ag_tmeta *o) {
    const char *op = "nll_loss_backward";
    ag_tensor *g = a[0].u.t, *x = a[1].u.t, *tw = a[6].u.t;
    const int64_t reduction = a[4].u.i;
    int rc = nll_check(op, x, a[2].u.t, targ(&a[3]), reduction);
    if (rc)
        return rc;
    char s1[128];
    bool ok = g->dtype == x->dtype &&
              (reduction == AG_REDUCTION_NONE ? same_sizes(g->ndim, g->sizes, x->ndim - 1, x->sizes)
                                              : ag_tensor_numel(g) == 1);
    if (!ok)
        return ag__err(AG_EINVAL, "%s: grad_output %s does not fit reduction %lld", op,
                       ag_tensor_meta_str(g, s1, sizeof s1), (long long)reduction);
    if (ag_tensor_numel(tw) != 1 || tw->dtype != x->dtype)
        return ag__err(AG_EINVAL, "%s: total_weight must be a one-element %s tensor", op,
                       ag_dtype_short(x->dtype));
    ag__tmeta_contiguous(&o[0], x->dtype, x->ndim, x->sizes);
    return 0;
}

/* grad_self[i, t_i] = -w[t_i] * g_i (g_i = g for sum, g / total_weight for mean). */
static int nllb_kernel(const ag_arg *a, ag_tensor **o) {
    const char *op = "nll_loss_backward";
    ag_tensor *g = a[0].u.t, *x = a[1].u.t, *t = a[2].u.t, *w = targ(&a[3]);
    ag__scratch_tensor tt;
    const int64_t reduction = a[4].u.i, ignore = a[5].u.i;
    const int64_t *tv = pack(t, &tt, 1);
    if (!tv)
        return ag_last_status();
    const int64_t N = x->ndim == 2 ? x->sizes[0] : 1, C = x->sizes[x->ndim - 1];
    int rc = 0;
    for (int64_t i = 0; i < N && rc == 0; i++)
        rc = nll_target_ok(op, tv[i], i, C, ignore);
    if (rc == 0) {
        chan wc = chan_of(w);
        const double total = ag__get_f64(a[6].u.t, 0);
        memset(data_of(o[0]), 0, (size_t)(N * C) * ag_dtype_size(x->dtype));
        AG__FLOAT_SWITCH(x->dtype, T, {
            T *gx = data_of(o[0]);
            for (int64_t i = 0; i < N; i++) {
                if (tv[i] == ignore)
                    continue;
                double gi = ag__get_f64(g, reduction == AG_REDUCTION_NONE ? i : 0);
                if (reduction == AG_REDUCTION_MEAN)
                    gi /= total;
                const double wi = wc.p ? (double)((const T *)wc.p)[tv[i] * wc.stride] : 1.0;
                gx[i * C + tv[i]] = (T)(-wi * gi);
            }
        });
    }
    return rc;
}

static const ag_opdef op_nll_loss_backward = {
    .schema = "nll_loss_backward(Tensor grad_output, Tensor self, Tensor target, Tensor? weight, "
              "int reduction, SymInt ignore_index, Tensor total_weight) -> Tensor",
    .flags = AG_OP_BACKWARD_HELPER | AG_OP_NONDIFF,
    .meta = nllb_meta,
    .kernel = nllb_kernel,
    .dtypes = AG_DT_FLOAT,
    .shard = ag__shard_nll_loss_backward,
};

/* ---- cross_entropy_loss (composite) ---- */

static int ce_meta(const ag_arg *a, ag_tmeta *o) {
    ag_tensor *x = a[0].u.t;
    int rc = nll_check("cross_entropy_loss", x, a[1].u.t, targ(&a[2]), a[3].u.i);
    if (rc)
        return rc;
    ag__tmeta_contiguous(&o[0], x->dtype, a[3].u.i == AG_REDUCTION_NONE ? x->ndim - 1 : 0,
                         x->sizes);
    return 0;
}

/* ATen's cross_entropy_loss: log_softmax over the class dim, then nll_loss; with label
 * smoothing eps, (1 - eps) * nll + eps / C * smooth, where smooth = -sum_c(w_c * logp_c) per
 * sample (0 for ignored targets), reduced like the loss (mean divides by the total weight of
 * the kept targets, which nll_loss_forward returns as total_weight). */
static int ce_decomp(const ag_arg *a, ag_tensor **outs) {
    const char *op = "cross_entropy_loss";
    ag_tensor *x = a[0].u.t, *t = a[1].u.t, *w = targ(&a[2]);
    const int64_t reduction = a[3].u.i, ignore = a[4].u.i;
    const double ls = a[5].u.f;
    char s[128];
    if (x->ndim > 2)
        return ag__err(AG_ENOTSUP,
                       "%s: input %s: only (N, C) and (C) inputs are supported (no extra spatial "
                       "dims yet)",
                       op, shape_str(x, s, sizeof s));
    if (ag_dtype_is_float(t->dtype))
        return ag__err(AG_ENOTSUP,
                       "%s: class-probability (float) targets are not supported yet; "
                       "pass int64 class indices",
                       op);
    int rc = nll_check(op, x, t, w, reduction);
    if (rc)
        return rc;
    if (!(ls >= 0 && ls <= 1))
        return ag__err(AG_EINVAL, "%s: label_smoothing must be in [0, 1], got %g", op, ls);
    const int dim = x->ndim == 1 ? 0 : 1;
    ag_tensor *logp = ag_log_softmax(x, dim);
    if (!logp)
        return ag_last_status();
    AG__OP(nll, "nll_loss_forward");
    ag_tensor *r[2] = {0};
    rc = ag_op_call(
        nll, (ag_arg[]){AG_A_T(logp), AG_A_T(t), AG_A_T(w), AG_A_I(reduction), AG_A_I(ignore)}, 5,
        r);
    if (rc < 0)
        return rc;
    if (ls == 0) {
        outs[0] = r[0];
        return 0;
    }
    const int64_t cdim = dim, C = x->sizes[dim];
    ag_tensor *smooth = ag_neg(ag_sum(w ? ag_mul(logp, w) : logp, &cdim, 1, false));
    smooth = ag_masked_fill(smooth, ag_eq_scalar(t, (double)ignore), 0.0);
    ag_tensor *ret = smooth;
    if (reduction == AG_REDUCTION_MEAN)
        ret = ag_div(ag_sum_all(smooth), r[1]);
    else if (reduction == AG_REDUCTION_SUM)
        ret = ag_sum_all(smooth);
    ag_tensor *kept = ag_mul_scalar(r[0], 1 - ls); /* traced before the smoothing term */
    outs[0] = ag_add(kept, ag_mul_scalar(ret, ls / (double)C));
    return outs[0] ? 0 : ag_last_status();
}

static void ce_samples(ag_samples *s) {
    int64_t x2[] = {4, 3}, n4[] = {4}, c3[] = {3};
    const int64_t t4[] = {2, 0, 1, 2}, t4i[] = {1, -100, 2, 0}, t0[] = {1};
    ag_samples_add(s, "mean",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, x2, -2, 2)),
                              AG_A_T(ag_from_data(AG_I64, 1, n4, t4))},
                   2);
    ag_samples_add(s, "weight, ignore_index, label smoothing, strided",
                   (ag_arg[]){AG_A_T(ag_samples_rand_strided(s, 2, x2, -2, 2)),
                              AG_A_T(ag_from_data(AG_I64, 1, n4, t4i)),
                              AG_A_T(ag_samples_rand_nograd(s, 1, c3, 0.5, 2)),
                              AG_A_I(AG_REDUCTION_MEAN), AG_A_I(-100), AG_A_F(0.1)},
                   6);
    ag_samples_add(s, "none, label smoothing",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, x2, -2, 2)),
                              AG_A_T(ag_from_data(AG_I64, 1, n4, t4i)), AG_A_NONE,
                              AG_A_I(AG_REDUCTION_NONE), AG_A_I(-100), AG_A_F(0.2)},
                   6);
    ag_samples_add(s, "1-d, sum",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 1, c3, -2, 2)),
                              AG_A_T(ag_from_data(AG_I64, 0, NULL, t0)), AG_A_NONE,
                              AG_A_I(AG_REDUCTION_SUM)},
                   4);
}

static const ag_opdef op_cross_entropy_loss = {
    .schema = "cross_entropy_loss(Tensor self, Tensor target, Tensor? weight=None, "
              "int reduction=1, SymInt ignore_index=-100, float label_smoothing=0.0) -> Tensor",
    .flags = AG_OP_COMPOSITE,
    .meta = ce_meta,
    .dtypes = AG_DT_FLOAT,
    .decomp = ce_decomp,
    .samples = ce_samples,
};

ag_tensor *ag_cross_entropy(ag_tensor *logits, ag_tensor *target, int reduction,
                            int64_t ignore_index) {
    AG__OP(op, "cross_entropy_loss");
    return ag__call1(op,
                     (ag_arg[]){AG_A_T(logits), AG_A_T(target), AG_A_NONE, AG_A_I(reduction),
                                AG_A_I(ignore_index)},
                     5);
}

ag_tensor *ag_cross_entropy_loss(ag_tensor *logits, ag_tensor *target, ag_tensor *weight,
                                 int reduction, int64_t ignore_index, double label_smoothing) {
    AG__OP(op, "cross_entropy_loss");
    return ag__call1(op,
                     (ag_arg[]){AG_A_T(logits), AG_A_T(target), weight ? AG_A_T(weight) : AG_A_NONE,
                                AG_A_I(reduction), AG_A_I(ignore_index), AG_A_F(label_smoothing)},
                     6);
}

/* ====================================================================================== */
/* ---- native_dropout ---- */

static int dropout_check(const char *op, const ag_tensor *x, double p) {
    int rc = check_float(op, "input", x);
    if (rc)
        return rc;
    if (!(p >= 0 && p <= 1))
        return ag__err(AG_EINVAL, "%s: dropout probability has to be between 0 and 1, but got %g",
                       op, p);
    return 0;
}

static int nd_meta(const ag_arg *a, ag_tmeta *o) {
    ag_tensor *x = a[0].u.t;
    int rc = dropout_check("native_dropout", x, a[1].u.f);
    if (rc)
        return rc;
    ag__tmeta_contiguous(&o[0], x->dtype, x->ndim, x->sizes);
    ag__tmeta_contiguous(&o[1], AG_BOOL, x->ndim, x->sizes);
    return 0;
}

/* native_dropout's `bool? train`: None means training, as in ATen. */
static bool train_arg(const ag_arg *a) {
    return a->kind == AG_ARG_NONE || a->u.b;
}

/* In training, element i is kept when its uniform draw u_i >= p (probability 1 - p) and
 * scaled by 1 / (1 - p); the draw reserves numel counters of the generator whatever p is, as
 * ATen's bernoulli_ does. The uniforms are written into the output first, then replaced.
 * The output is (mask * x) * scale computed in the tensor's dtype, the order and precision of
 * the functional form the joint export records (ge(philox_rand, p), mul, mul.Scalar; see
 * src/export/rng_functionalize.c), so eager and compiled dropout agree bit for bit. */
static int nd_kernel(const ag_arg *a, ag_tensor **o) {
    ag_tensor *x = a[0].u.t, *out = o[0], *mask = o[1];
    const double p = a[1].u.f;
    const bool train = train_arg(&a[2]);
    const int64_t n = ag_tensor_numel(x);
    if (!train) {
        memset(data_of(mask), 1, (size_t)n);
        return ag__copy_into(out, x);
    }
    uint64_t seed, offset;
    ag__rng_reserve(n, &seed, &offset);
    const double scale = p < 1 ? 1.0 / (1.0 - p) : 0.0;
    ag__iter it;
    ag_tensor *ops[3] = {out, x, mask};
    ag__iter_build(&it, ops, 3);
    AG__FLOAT_SWITCH(x->dtype, T, {
        if (x->dtype == AG_F32)
            ag__philox_uniform_f32(seed, offset, n, data_of(out));
        else
            ag__philox_uniform_f64(seed, offset, n, data_of(out));
        const T sc = (T)scale;
        AG__ITER_ROWS(it, {
            T *po = (T *)it.base[0] + off[0];
            const T *px = (const T *)it.base[1] + off[1];
            bool *pm = (bool *)it.base[2] + off[2];
            const int64_t so = it.inner_stride[0], sx = it.inner_stride[1];
            const int64_t sm = it.inner_stride[2];
            for (int64_t k = 0; k < len; k++) {
                const bool keep = po[k * so] >= (T)p;
                pm[k * sm] = keep;
                po[k * so] = ((T)keep * px[k * sx]) * sc;
            }
        });
    });
    return 0;
}

static double dropout_scale(double p, bool train) {
    return !train ? 1.0 : p == 1 ? 0.0 : 1.0 / (1.0 - p);
}

/* derivatives.yaml: input: native_dropout_backward(grad, result1, train ? 1 / (1 - p) : 1). */
static int nd_backward(ag_bwctx *c) {
    ag_tensor *g = c->grad_outputs[0];
    if (!g)
        return 0;
    AG__OP(op, "native_dropout_backward");
    double scale = dropout_scale(c->args[1].u.f, train_arg(&c->args[2]));
    c->grad_inputs[0] =
        ag__call1(op, (ag_arg[]){AG_A_T(g), AG_A_T(c->outputs[1]), AG_A_F(scale)}, 3);
    return c->grad_inputs[0] ? 0 : ag_last_status();
}

static void nd_samples(ag_samples *s) {
    int64_t x[] = {4, 5};
    ag_samples_add(s, "training p=0.3",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, x, -1, 1)), AG_A_F(0.3), AG_A_B(true)},
                   3);
    ag_samples_add(
        s, "training strided p=0.5",
        (ag_arg[]){AG_A_T(ag_samples_rand_strided(s, 2, x, -1, 1)), AG_A_F(0.5), AG_A_B(true)}, 3);
    ag_samples_add(s, "evaluation",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, x, -1, 1)), AG_A_F(0.3), AG_A_B(false)},
                   3);
}

static const ag_opdef op_native_dropout = {
    .schema = "native_dropout(Tensor input, float p, bool? train) -> (Tensor, Tensor)",
    .flags = AG_OP_RANDOM,
    .meta = nd_meta,
    .kernel = nd_kernel,
    .dtypes = AG_DT_FLOAT,
    .backward = nd_backward,
    .save_outputs = 0x2, /* mask */
    .samples = nd_samples,
};

int ag_native_dropout(ag_tensor *x, double p, bool train, ag_tensor **out, ag_tensor **mask) {
    AG__OP(op, "native_dropout");
    ag_arg args[] = {AG_A_T(x), AG_A_F(p), AG_A_B(train)};
    return call_outs(op, args, 3, (ag_tensor * *const[]){out, mask}, 2);
}

/* ---- native_dropout_backward ---- */

static int ndb_meta(const ag_arg *a, ag_tmeta *o) {
    const char *op = "native_dropout_backward";
    ag_tensor *g = a[0].u.t, *m = a[1].u.t;
    int rc = check_float(op, "grad_output", g);
    if (rc)
        return rc;
    char s1[128], s2[128];
    if (m->dtype != AG_BOOL || !same_sizes(g->ndim, g->sizes, m->ndim, m->sizes))
        return ag__err(AG_EINVAL,
                       "%s: mask must be a bool tensor shaped like grad_output %s, "
                       "got %s",
                       op, shape_str(g, s1, sizeof s1), ag_tensor_meta_str(m, s2, sizeof s2));
    ag__tmeta_contiguous(&o[0], g->dtype, g->ndim, g->sizes);
    return 0;
}

/* grad_input = grad_output * mask * scale. */
static int ndb_kernel(const ag_arg *a, ag_tensor **o) {
    ag_tensor *g = a[0].u.t, *m = a[1].u.t;
    const double scale = a[2].u.f;
    ag__iter it;
    ag_tensor *ops[3] = {o[0], g, m};
    ag__iter_build(&it, ops, 3);
    AG__FLOAT_SWITCH(g->dtype, T, AG__ITER_ROWS(it, {
                         T *po = (T *)it.base[0] + off[0];
                         const T *pg = (const T *)it.base[1] + off[1];
                         const bool *pm = (const bool *)it.base[2] + off[2];
                         const int64_t so = it.inner_stride[0], sg = it.inner_stride[1];
                         const int64_t sm = it.inner_stride[2];
                         for (int64_t k = 0; k < len; k++)
                             po[k * so] = (T)(pg[k * sg] * (T)pm[k * sm] * scale);
                     }));
    return 0;
}

/* The op is linear in grad_output, so its own backward is itself. */
static int ndb_backward(ag_bwctx *c) {
    AG__OP(op, "native_dropout_backward");
    c->grad_inputs[0] = ag__call1(
        op, (ag_arg[]){AG_A_T(c->grad_outputs[0]), AG_A_T(c->args[1].u.t), c->args[2]}, 3);
    return c->grad_inputs[0] ? 0 : ag_last_status();
}

static void ndb_samples(ag_samples *s) {
    int64_t x[] = {3, 4};
    const bool m[] = {1, 0, 1, 1, 0, 0, 1, 0, 1, 1, 1, 0};
    ag_samples_add(s, "scale 2",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, x, -1, 1)),
                              AG_A_T(ag_from_data(AG_BOOL, 2, x, m)), AG_A_F(2.0)},
                   3);
    ag_samples_add(s, "strided",
                   (ag_arg[]){AG_A_T(ag_samples_rand_strided(s, 2, x, -1, 1)),
                              AG_A_T(ag_from_data(AG_BOOL, 2, x, m)), AG_A_F(1.25)},
                   3);
}

static const ag_opdef op_native_dropout_backward = {
    .schema = "native_dropout_backward(Tensor grad_output, Tensor mask, float scale) -> Tensor",
    .flags = AG_OP_POINTWISE | AG_OP_BACKWARD_HELPER,
    .meta = ndb_meta,
    .kernel = ndb_kernel,
    .dtypes = AG_DT_FLOAT,
    .backward = ndb_backward,
    .save_args = 0x2, /* mask */
    .samples = ndb_samples,
};

/* ---- dropout (composite) ---- */

static int dropout_meta(const ag_arg *a, ag_tmeta *o) {
    ag_tensor *x = a[0].u.t;
    int rc = dropout_check("dropout", x, a[1].u.f);
    if (rc)
        return rc;
    ag__tmeta_contiguous(&o[0], x->dtype, x->ndim, x->sizes);
    return 0;
}

/* As torch._decomp's dropout: native_dropout when training with p != 0, else a clone. */
static int dropout_decomp(const ag_arg *a, ag_tensor **outs) {
    ag_tensor *x = a[0].u.t;
    const double p = a[1].u.f;
    int rc = dropout_check("dropout", x, p);
    if (rc)
        return rc;
    if (a[2].u.b && p != 0) {
        AG__OP(op, "native_dropout");
        ag_tensor *r[2] = {0};
        rc = ag_op_call(op, (ag_arg[]){a[0], a[1], a[2]}, 3, r);
        if (rc < 0)
            return rc;
        outs[0] = r[0];
    } else {
        outs[0] = ag_clone(x);
    }
    return outs[0] ? 0 : ag_last_status();
}

static const ag_opdef op_dropout = {
    .schema = "dropout(Tensor input, float p, bool train) -> Tensor",
    .flags = AG_OP_COMPOSITE,
    .meta = dropout_meta,
    .dtypes = AG_DT_FLOAT,
    .decomp = dropout_decomp,
    .samples = nd_samples, /* same arguments as native_dropout */
};

ag_tensor *ag_dropout(ag_tensor *x, double p, bool train) {
    AG__OP(op, "dropout");
    return ag__call1(op, (ag_arg[]){AG_A_T(x), AG_A_F(p), AG_A_B(train)}, 3);
}

/* ====================================================================================== */
/* ---- attention: _scaled_dot_product_flash_attention_for_cpu ---- */

/* One operand of attention as GEMM sees it: a batch of (rows, cols) matrices, element
 * (b, i, j) at base[off(b) + i * ld + j]. Views whose last dim is unit-strided (the usual
 * (B, T, H, E).transpose(1, 2) of a projection) are used in place; others are packed into
 * per-thread scratch (slot given by the caller). */
typedef struct mats {
    char *base;
    int64_t ld;
    int nbd; /* batch dims */
    int64_t bsizes[AG_MAX_DIMS], bstrides[AG_MAX_DIMS];
    ag__scratch_tensor tmp;
} mats;

static int mats_init(mats *m, ag_tensor *t, int slot) {
    const int nd = t->ndim;
    const int64_t rows = t->sizes[nd - 2], cols = t->sizes[nd - 1];
    const int64_t wide = cols > 1 ? cols : 1;
    bool direct =
        (cols <= 1 || t->strides[nd - 1] == 1) && (rows <= 1 || t->strides[nd - 2] >= wide);
    const ag_tensor *src = t;
    if (!direct) {
        if (!pack(t, &m->tmp, slot))
            return ag_last_status();
        src = &m->tmp.t;
    }
    m->base = data_of(src);
    m->ld = rows <= 1 ? wide : src->strides[nd - 2];
    m->nbd = nd - 2;
    for (int d = 0; d < nd - 2; d++) {
        m->bsizes[d] = src->sizes[d];
        m->bstrides[d] = src->strides[d];
    }
    return 0;
}

/* Element offset of matrix b of the flattened batch. */
static int64_t mats_off(const mats *m, int64_t b) {
    int64_t off = 0;
    for (int d = m->nbd - 1; d >= 0; d--) {
        off += (b % m->bsizes[d]) * m->bstrides[d];
        b /= m->bsizes[d];
    }
    return off;
}

/* C (m, n) = alpha * op(A) op(B) in row-major storage. */
static void gemm(ag_dtype dt, bool ta, bool tb, int64_t m, int64_t n, int64_t k, double alpha,
                 const void *a, int64_t lda, const void *b, int64_t ldb, void *c, int64_t ldc) {
    if (m == 0 || n == 0)
        return;
    if (k == 0) {
        for (int64_t i = 0; i < m; i++)
            memset((char *)c + (size_t)(i * ldc) * ag_dtype_size(dt), 0,
                   (size_t)n * ag_dtype_size(dt));
        return;
    }
    enum CBLAS_TRANSPOSE TA = ta ? CblasTrans : CblasNoTrans, TB = tb ? CblasTrans : CblasNoTrans;
    if (dt == AG_F32)
        cblas_sgemm(CblasRowMajor, TA, TB, (int)m, (int)n, (int)k, (float)alpha, a, (int)lda, b,
                    (int)ldb, 0.0f, c, (int)ldc);
    else
        cblas_dgemm(CblasRowMajor, TA, TB, (int)m, (int)n, (int)k, alpha, a, (int)lda, b, (int)ldb,
                    0.0, c, (int)ldc);
}

/* Everything one attention call needs: sizes, the operands as matrices, the mask's broadcast
 * strides over (batch..., L, S), and per-thread scratch for score matrices. The scores are
 * scratch slot 0 and packed query, key, value and grad_output slots 1 to 4, all taken by the
 * calling thread before the parallel loop (src/core/scratch.c). */
typedef struct sdpa {
    ag_dtype dt;
    int64_t nb, L, S, E, Ev;
    double scale;
    bool causal;
    mats q, k, v, go;
    const char *mask; /* NULL: none */
    bool mask_bool;
    int nbd;
    int64_t bsizes[AG_MAX_DIMS], mstrides[AG_MAX_DIMS]; /* ndim of q entries */
    int nth;
    void *scratch;
} sdpa;

static int sdpa_check(const char *op, const ag_tensor *q, const ag_tensor *k, const ag_tensor *v,
                      const ag_tensor *mask, double dropout_p) {
    char s1[128], s2[128], s3[128];
    int rc = check_float(op, "query", q);
    if (rc)
        return rc;
    if (dropout_p != 0)
        return ag__err(AG_ENOTSUP,
                       "%s: dropout inside attention is not supported yet "
                       "(dropout_p = %g); apply dropout outside",
                       op, dropout_p);
    const int nd = q->ndim;
    bool ok =
        nd >= 2 && k->ndim == nd && v->ndim == nd && k->dtype == q->dtype && v->dtype == q->dtype;
    for (int d = 0; ok && d < nd - 2; d++)
        ok = k->sizes[d] == q->sizes[d] && v->sizes[d] == q->sizes[d];
    ok = ok && k->sizes[nd - 1] == q->sizes[nd - 1] && v->sizes[nd - 2] == k->sizes[nd - 2];
    if (!ok)
        return ag__err(AG_EINVAL,
                       "%s: query %s, key %s and value %s must be (batch..., L, E), "
                       "(batch..., S, E) and (batch..., S, Ev) of one dtype",
                       op, ag_tensor_meta_str(q, s1, sizeof s1),
                       ag_tensor_meta_str(k, s2, sizeof s2), ag_tensor_meta_str(v, s3, sizeof s3));
    if (mask) {
        int64_t full[AG_MAX_DIMS], bc[AG_MAX_DIMS];
        memcpy(full, q->sizes, sizeof(int64_t) * (size_t)nd);
        full[nd - 1] = k->sizes[nd - 2];
        int nout;
        if (mask->dtype != AG_BOOL && mask->dtype != q->dtype)
            return ag__err(AG_EINVAL, "%s: attn_mask must be bool or %s like query, got %s", op,
                           ag_dtype_short(q->dtype), ag_dtype_short(mask->dtype));
        if (mask->ndim > nd || ag__broadcast(op, mask->ndim, mask->sizes, nd, full, &nout, bc) ||
            !same_sizes(nout, bc, nd, full))
            return ag__err(AG_EINVAL,
                           "%s: attn_mask %s does not broadcast to (batch..., L, S) = "
                           "%s",
                           op, shape_str(mask, s1, sizeof s1),
                           ag__fmt_sizes(s2, sizeof s2, nd, full));
    }
    return 0;
}

static double sdpa_scale(const ag_arg *scale, int64_t E) {
    return scale->kind == AG_ARG_FLOAT ? scale->u.f : 1.0 / sqrt((double)(E > 0 ? E : 1));
}

static int sdpa_fwd_meta(const ag_arg *a, ag_tmeta *o) {
    ag_tensor *q = a[0].u.t, *k = a[1].u.t, *v = a[2].u.t;
    int rc =
        sdpa_check("_scaled_dot_product_flash_attention_for_cpu", q, k, v, targ(&a[5]), a[3].u.f);
    if (rc)
        return rc;
    int64_t sizes[AG_MAX_DIMS];
    memcpy(sizes, q->sizes, sizeof(int64_t) * (size_t)q->ndim);
    sizes[q->ndim - 1] = v->sizes[v->ndim - 1];
    ag__tmeta_contiguous(&o[0], q->dtype, q->ndim, sizes);
    ag__tmeta_contiguous(&o[1], q->dtype, q->ndim - 1, q->sizes);
    return 0;
}

/* Fills s from the operands; `go` (the incoming gradient) may be NULL. Takes `nbuf` score
 * buffers of (L, S) per thread from scratch. Nothing to release. */
static int sdpa_init(sdpa *s, ag_tensor *q, ag_tensor *k, ag_tensor *v, ag_tensor *go,
                     ag_tensor *mask, bool causal, const ag_arg *scale, int nbuf) {
    memset(s, 0, sizeof *s);
    const int nd = q->ndim;
    s->dt = q->dtype;
    s->nbd = nd - 2;
    s->nb = ag__numel(nd - 2, q->sizes);
    s->L = q->sizes[nd - 2];
    s->S = k->sizes[nd - 2];
    s->E = q->sizes[nd - 1];
    s->Ev = v->sizes[nd - 1];
    s->scale = sdpa_scale(scale, s->E);
    s->causal = causal;
    memcpy(s->bsizes, q->sizes, sizeof(int64_t) * (size_t)(nd - 2));
    if (mask) {
        s->mask = data_of(mask);
        s->mask_bool = mask->dtype == AG_BOOL;
        for (int d = 0; d < nd; d++) {
            int md = d - (nd - mask->ndim);
            s->mstrides[d] = (md < 0 || mask->sizes[md] == 1) ? 0 : mask->strides[md];
        }
    }
    int rc = mats_init(&s->q, q, 1);
    if (!rc)
        rc = mats_init(&s->k, k, 2);
    if (!rc)
        rc = mats_init(&s->v, v, 3);
    if (!rc && go)
        rc = mats_init(&s->go, go, 4);
    int maxt = omp_get_max_threads();
    s->nth = (int)(s->nb < maxt ? s->nb : maxt);
    if (s->nth < 1)
        s->nth = 1;
    if (!rc) {
        s->scratch = ag__scratch(0, (size_t)s->nth * (size_t)nbuf * (size_t)(s->L * s->S) *
                                        ag_dtype_size(s->dt));
        if (!s->scratch)
            rc = AG_ENOMEM;
    }
    return rc;
}

/* Element offset of the mask entry (b, i, 0); the row continues with stride mstrides[nd-1]. */
static int64_t sdpa_mask_off(const sdpa *s, int64_t b, int64_t i) {
    int64_t off = i * s->mstrides[s->nbd];
    for (int d = s->nbd - 1; d >= 0; d--) {
        off += (b % s->bsizes[d]) * s->mstrides[d];
        b /= s->bsizes[d];
    }
    return off;
}

/* Entries of row i that survive the causal mask (j <= i); all S without it. */
static int64_t sdpa_row_end(const sdpa *s, int64_t i) {
    return s->causal && i + 1 < s->S ? i + 1 : s->S;
}

/* Applies the attention mask to entries [0, jend) of row i of batch b's (already scaled)
 * scores: a bool mask's false becomes -inf, a float mask is added. */
#define SDPA_MASK_ROW(T, s, b, i, row, jend)                                                       \
    do {                                                                                           \
        if ((s)->mask) {                                                                           \
            const int64_t mo = sdpa_mask_off((s), (b), (i)), ms = (s)->mstrides[(s)->nbd + 1];     \
            for (int64_t j = 0; j < (jend); j++) {                                                 \
                if ((s)->mask_bool) {                                                              \
                    if (!((const bool *)(s)->mask)[mo + j * ms])                                   \
                        (row)[j] = (T)-INFINITY;                                                   \
                } else {                                                                           \
                    (row)[j] += ((const T *)(s)->mask)[mo + j * ms];                               \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    } while (0)

/* Per (batch, head): P = softmax(scale * Q K^T + mask), O = P V, lse = log sum exp of the
 * scores. A row with every score removed gets P = 0, O = 0 and lse = -inf. */
static int sdpa_fwd(sdpa *s, void *outv, void *lsev) {
    const int64_t L = s->L, S = s->S, E = s->E, Ev = s->Ev;
    const int nth = s->nth;
    AG__FLOAT_SWITCH(s->dt, T, {
        T *out = outv, *lse = lsev;
        AG__BLAS_FOR(nth > 1, "omp parallel for schedule(dynamic) num_threads(nth)", b, s->nb, {
            T *P = (T *)s->scratch + (size_t)omp_get_thread_num() * (size_t)(L * S);
            const T *qb = (const T *)s->q.base + mats_off(&s->q, b);
            const T *kb = (const T *)s->k.base + mats_off(&s->k, b);
            const T *vb = (const T *)s->v.base + mats_off(&s->v, b);
            gemm(s->dt, false, true, L, S, E, s->scale, qb, s->q.ld, kb, s->k.ld, P, S);
            for (int64_t i = 0; i < L; i++) {
                T *row = P + i * S;
                const int64_t jend = sdpa_row_end(s, i);
                SDPA_MASK_ROW(T, s, b, i, row, jend);
                for (int64_t j = jend; j < S; j++)
                    row[j] = 0;
                T mx = (T)-INFINITY;
                for (int64_t j = 0; j < jend; j++)
                    mx = row[j] > mx ? row[j] : mx;
                if (mx == (T)-INFINITY) {
                    for (int64_t j = 0; j < jend; j++)
                        row[j] = 0;
                    lse[b * L + i] = (T)-INFINITY;
                    continue;
                }
                T sum = 0;
                for (int64_t j = 0; j < jend; j++) {
                    row[j] = exp(row[j] - mx);
                    sum += row[j];
                }
                const T inv = 1 / sum;
                for (int64_t j = 0; j < jend; j++)
                    row[j] *= inv;
                lse[b * L + i] = mx + log(sum);
            }
            gemm(s->dt, false, false, L, Ev, S, 1.0, P, S, vb, s->v.ld, out + b * L * Ev, Ev);
        });
    });
    return 0;
}

static int sdpa_fwd_kernel(const ag_arg *a, ag_tensor **o) {
    sdpa s;
    int rc = sdpa_init(&s, a[0].u.t, a[1].u.t, a[2].u.t, NULL, targ(&a[5]), a[4].u.b, &a[6], 1);
    if (rc)
        return rc;
    return sdpa_fwd(&s, data_of(o[0]), data_of(o[1]));
}

/* derivatives.yaml: query, key, value: _scaled_dot_product_flash_attention_for_cpu_backward(
 * grad, query, key, value, output, logsumexp, dropout_p, is_causal, attn_mask, scale);
 * logsumexp carries no gradient (nondiff_outputs). */
static int sdpa_fwd_backward(ag_bwctx *c) {
    if (c->needs_grad[3])
        return ag__err(AG_ENOTSUP, "_scaled_dot_product_flash_attention_for_cpu: the derivative "
                                   "for 'attn_mask' is not implemented");
    ag_tensor *g = c->grad_outputs[0];
    if (!g)
        return 0;
    AG__OP(op, "_scaled_dot_product_flash_attention_for_cpu_backward");
    ag_tensor *r[3] = {0};
    ag_arg args[] = {AG_A_T(g),
                     AG_A_T(c->args[0].u.t),
                     AG_A_T(c->args[1].u.t),
                     AG_A_T(c->args[2].u.t),
                     AG_A_T(c->outputs[0]),
                     AG_A_T(c->outputs[1]),
                     c->args[3],
                     c->args[4],
                     AG_A_T(targ(&c->args[5])),
                     c->args[6]};
    int rc = ag_op_call(op, args, 10, r);
    if (rc < 0)
        return rc;
    for (int j = 0; j < 3; j++)
        if (c->needs_grad[j])
            c->grad_inputs[j] = r[j];
    return 0;
}

static void sdpa_fwd_cost(const ag_arg *a, const ag_tmeta *o, int nouts, ag_cost *c) {
    const ag_tensor *q = a[0].u.t, *k = a[1].u.t, *v = a[2].u.t;
    const int nd = q->ndim;
    const double nbL = (double)ag__numel(nd - 1, q->sizes), S = (double)k->sizes[nd - 2];
    c->flops = 2.0 * nbL * S * (double)(q->sizes[nd - 1] + v->sizes[nd - 1]);
    c->bytes = io_bytes(a, 6, o, nouts);
}

static void sdpa_samples(ag_samples *s) {
    int64_t q4[] = {1, 2, 3, 4}, q3[] = {2, 3, 4}, k3[] = {2, 5, 4}, v3[] = {2, 5, 3};
    int64_t m2[] = {3, 5};
    ag_samples_add(s, "(B, H, L, E)",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 4, q4, -1, 1)),
                              AG_A_T(ag_samples_rand(s, 4, q4, -1, 1)),
                              AG_A_T(ag_samples_rand(s, 4, q4, -1, 1))},
                   3);
    ag_samples_add(s, "causal, strided query",
                   (ag_arg[]){AG_A_T(ag_samples_rand_strided(s, 4, q4, -1, 1)),
                              AG_A_T(ag_samples_rand(s, 4, q4, -1, 1)),
                              AG_A_T(ag_samples_rand(s, 4, q4, -1, 1)), AG_A_F(0.0), AG_A_B(true)},
                   5);
    ag_samples_add(s, "L != S, float mask, scale 0.7",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 3, q3, -1, 1)),
                              AG_A_T(ag_samples_rand(s, 3, k3, -1, 1)),
                              AG_A_T(ag_samples_rand(s, 3, v3, -1, 1)), AG_A_F(0.0), AG_A_B(false),
                              AG_A_T(ag_samples_rand_nograd(s, 2, m2, -1, 1)), AG_A_F(0.7)},
                   7);
}

static const ag_opdef op_sdpa_flash_cpu = {
    .schema = "_scaled_dot_product_flash_attention_for_cpu(Tensor query, Tensor key, "
              "Tensor value, float dropout_p=0.0, bool is_causal=False, *, "
              "Tensor? attn_mask=None, float? scale=None) -> (Tensor output, Tensor logsumexp)",
    .flags = AG_OP_COMPUTE_INTENSIVE,
    .meta = sdpa_fwd_meta,
    .kernel = sdpa_fwd_kernel,
    .dtypes = AG_DT_FLOAT,
    .backward = sdpa_fwd_backward,
    .save_args = 0xf,       /* query, key, value, attn_mask */
    .save_outputs = 0x3,    /* output, logsumexp */
    .nondiff_outputs = 0x2, /* logsumexp */
    .cost = sdpa_fwd_cost,
    .samples = sdpa_samples,
    .shard = ag__shard_sdpa,
};

/* ---- _scaled_dot_product_flash_attention_for_cpu_backward ---- */

static int sdpa_bwd_meta(const ag_arg *a, ag_tmeta *o) {
    const char *op = "_scaled_dot_product_flash_attention_for_cpu_backward";
    ag_tensor *g = a[0].u.t, *q = a[1].u.t, *k = a[2].u.t, *v = a[3].u.t;
    ag_tensor *out = a[4].u.t, *lse = a[5].u.t;
    int rc = sdpa_check(op, q, k, v, targ(&a[8]), a[6].u.f);
    if (rc)
        return rc;
    const int nd = q->ndim;
    int64_t osz[AG_MAX_DIMS];
    memcpy(osz, q->sizes, sizeof(int64_t) * (size_t)nd);
    osz[nd - 1] = v->sizes[nd - 1];
    char s1[128], s2[128], s3[128], s4[128];
    if (!same_sizes(g->ndim, g->sizes, nd, osz) || !same_sizes(out->ndim, out->sizes, nd, osz) ||
        !same_sizes(lse->ndim, lse->sizes, nd - 1, q->sizes) || g->dtype != q->dtype ||
        out->dtype != q->dtype || lse->dtype != q->dtype)
        return ag__err(AG_EINVAL,
                       "%s: grad_out %s and out %s must be %s and logsumexp %s "
                       "(batch..., L), all of the query's dtype",
                       op, shape_str(g, s1, sizeof s1), shape_str(out, s2, sizeof s2),
                       ag__fmt_sizes(s4, sizeof s4, nd, osz), shape_str(lse, s3, sizeof s3));
    ag__tmeta_contiguous(&o[0], q->dtype, nd, q->sizes);
    ag__tmeta_contiguous(&o[1], q->dtype, nd, k->sizes);
    ag__tmeta_contiguous(&o[2], q->dtype, nd, v->sizes);
    return 0;
}

/* Per (batch, head), recomputing P = exp(scale * Q K^T + mask - lse):
 *   dV = P^T dO,  dP = dO V^T,  dS = P * (dP - rowsum(P * dP)),
 *   dQ = scale * dS K,  dK = scale * dS^T Q. */
static int sdpa_bwd(sdpa *s, const void *lsev, void *gqv, void *gkv, void *gvv) {
    const int64_t L = s->L, S = s->S, E = s->E, Ev = s->Ev;
    const int nth = s->nth;
    AG__FLOAT_SWITCH(s->dt, T, {
        const T *lse = lsev;
        T *gq = gqv, *gk = gkv, *gv = gvv;
        AG__BLAS_FOR(nth > 1, "omp parallel for schedule(dynamic) num_threads(nth)", b, s->nb, {
            T *P = (T *)s->scratch + (size_t)omp_get_thread_num() * 2 * (size_t)(L * S);
            T *dP = P + L * S;
            const T *qb = (const T *)s->q.base + mats_off(&s->q, b);
            const T *kb = (const T *)s->k.base + mats_off(&s->k, b);
            const T *vb = (const T *)s->v.base + mats_off(&s->v, b);
            const T *gob = (const T *)s->go.base + mats_off(&s->go, b);
            gemm(s->dt, false, true, L, S, E, s->scale, qb, s->q.ld, kb, s->k.ld, P, S);
            for (int64_t i = 0; i < L; i++) {
                T *row = P + i * S;
                const T li = lse[b * L + i];
                const int64_t jend = sdpa_row_end(s, i);
                SDPA_MASK_ROW(T, s, b, i, row, jend);
                for (int64_t j = 0; j < jend; j++)
                    row[j] = li == (T)-INFINITY ? (T)0 : exp(row[j] - li);
                for (int64_t j = jend; j < S; j++)
                    row[j] = 0;
            }
            gemm(s->dt, true, false, S, Ev, L, 1.0, P, S, gob, s->go.ld, gv + b * S * Ev, Ev);
            gemm(s->dt, false, true, L, S, Ev, 1.0, gob, s->go.ld, vb, s->v.ld, dP, S);
            for (int64_t i = 0; i < L; i++) {
                const T *p = P + i * S;
                T *dp = dP + i * S;
                T d = 0;
                for (int64_t j = 0; j < S; j++)
                    d += p[j] * dp[j];
                for (int64_t j = 0; j < S; j++)
                    dp[j] = p[j] * (dp[j] - d);
            }
            gemm(s->dt, false, false, L, E, S, s->scale, dP, S, kb, s->k.ld, gq + b * L * E, E);
            gemm(s->dt, true, false, S, E, L, s->scale, dP, S, qb, s->q.ld, gk + b * S * E, E);
        });
    });
    return 0;
}

static int sdpa_bwd_kernel(const ag_arg *a, ag_tensor **o) {
    ag__scratch_tensor tl;
    const void *pl = pack(a[5].u.t, &tl, 5); /* logsumexp */
    if (!pl)
        return ag_last_status();
    sdpa s;
    int rc = sdpa_init(&s, a[1].u.t, a[2].u.t, a[3].u.t, a[0].u.t, targ(&a[8]), a[7].u.b, &a[9], 2);
    if (rc == 0)
        rc = sdpa_bwd(&s, pl, data_of(o[0]), data_of(o[1]), data_of(o[2]));
    return rc;
}

static void sdpa_bwd_cost(const ag_arg *a, const ag_tmeta *o, int nouts, ag_cost *c) {
    const ag_tensor *q = a[1].u.t, *k = a[2].u.t, *v = a[3].u.t;
    const int nd = q->ndim;
    const double nbL = (double)ag__numel(nd - 1, q->sizes), S = (double)k->sizes[nd - 2];
    c->flops = 2.0 * nbL * S * (double)(3 * q->sizes[nd - 1] + 2 * v->sizes[nd - 1]);
    c->bytes = io_bytes(a, 9, o, nouts);
}

static const ag_opdef op_sdpa_flash_cpu_backward = {
    .schema = "_scaled_dot_product_flash_attention_for_cpu_backward(Tensor grad_out, "
              "Tensor query, Tensor key, Tensor value, Tensor out, Tensor logsumexp, "
              "float dropout_p, bool is_causal, *, Tensor? attn_mask=None, float? scale=None) "
              "-> (Tensor grad_query, Tensor grad_key, Tensor grad_value)",
    .flags = AG_OP_BACKWARD_HELPER | AG_OP_NONDIFF | AG_OP_COMPUTE_INTENSIVE,
    .meta = sdpa_bwd_meta,
    .kernel = sdpa_bwd_kernel,
    .dtypes = AG_DT_FLOAT,
    .cost = sdpa_bwd_cost,
    .shard = ag__shard_sdpa,
};

/* ---- scaled_dot_product_attention (composite) ---- */

static int sdpa_check_front(const ag_arg *a) {
    const char *op = "scaled_dot_product_attention";
    ag_tensor *mask = targ(&a[3]);
    int rc = sdpa_check(op, a[0].u.t, a[1].u.t, a[2].u.t, mask, a[4].u.f);
    if (rc)
        return rc;
    if (mask && a[5].u.b)
        return ag__err(AG_EINVAL, "%s: explicit attn_mask should not be set when is_causal=True",
                       op);
    if (a[7].u.b)
        return ag__err(AG_ENOTSUP, "%s: enable_gqa=True is not supported yet", op);
    return 0;
}

static int sdpa_meta(const ag_arg *a, ag_tmeta *o) {
    int rc = sdpa_check_front(a);
    if (rc)
        return rc;
    ag_tmeta two[2];
    rc = sdpa_fwd_meta((ag_arg[]){a[0], a[1], a[2], a[4], a[5], a[3], a[6]}, two);
    o[0] = two[0];
    return rc;
}

static int sdpa_decomp(const ag_arg *a, ag_tensor **outs) {
    int rc = sdpa_check_front(a);
    if (rc)
        return rc;
    AG__OP(op, "_scaled_dot_product_flash_attention_for_cpu");
    ag_tensor *r[2] = {0};
    rc = ag_op_call(op, (ag_arg[]){a[0], a[1], a[2], a[4], a[5], a[3], a[6]}, 7, r);
    if (rc < 0)
        return rc;
    outs[0] = r[0];
    return 0;
}

static void sdpa_front_samples(ag_samples *s) {
    int64_t q4[] = {1, 2, 3, 4}, m2[] = {3, 3};
    const bool keep[] = {1, 0, 1, 1, 1, 0, 0, 1, 1};
    ag_samples_add(s, "causal",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 4, q4, -1, 1)),
                              AG_A_T(ag_samples_rand(s, 4, q4, -1, 1)),
                              AG_A_T(ag_samples_rand(s, 4, q4, -1, 1)), AG_A_NONE, AG_A_F(0.0),
                              AG_A_B(true)},
                   6);
    ag_samples_add(s, "bool mask, scale 0.5",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 4, q4, -1, 1)),
                              AG_A_T(ag_samples_rand(s, 4, q4, -1, 1)),
                              AG_A_T(ag_samples_rand_strided(s, 4, q4, -1, 1)),
                              AG_A_T(ag_from_data(AG_BOOL, 2, m2, keep)), AG_A_F(0.0),
                              AG_A_B(false), AG_A_F(0.5)},
                   7);
}

static const ag_opdef op_sdpa = {
    .schema = "scaled_dot_product_attention(Tensor query, Tensor key, Tensor value, "
              "Tensor? attn_mask=None, float dropout_p=0.0, bool is_causal=False, *, "
              "float? scale=None, bool enable_gqa=False) -> Tensor",
    .flags = AG_OP_COMPOSITE,
    .meta = sdpa_meta,
    .dtypes = AG_DT_FLOAT,
    .decomp = sdpa_decomp,
    .samples = sdpa_front_samples,
};

ag_tensor *ag_scaled_dot_product_attention(ag_tensor *q, ag_tensor *k, ag_tensor *v, bool is_causal,
                                           double scale) {
    AG__OP(op, "scaled_dot_product_attention");
    return ag__call1(op,
                     (ag_arg[]){AG_A_T(q), AG_A_T(k), AG_A_T(v), AG_A_NONE, AG_A_F(0.0),
                                AG_A_B(is_causal), scale > 0 ? AG_A_F(scale) : AG_A_NONE},
                     7);
}

const ag_opdef *const ag__ops_nn[] = {
    &op_embedding,
    &op_embedding_dense_backward,
    &op_nll_loss_forward,
    &op_nll_loss_backward,
    &op_cross_entropy_loss,
    &op_native_dropout,
    &op_native_dropout_backward,
    &op_dropout,
    &op_sdpa_flash_cpu,
    &op_sdpa_flash_cpu_backward,
    &op_sdpa,
    NULL,
};
