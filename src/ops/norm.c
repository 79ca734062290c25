/* Normalization ops: native_layer_norm and native_batch_norm with their ATen backward ops
 * (native_layer_norm_backward, native_batch_norm_backward), and the composite layer_norm.
 *
 * Kernels work on packed (contiguous) copies of non-contiguous inputs and accumulate statistics
 * in double even for float32 data. native_batch_norm updates the running statistics in place
 * in training; its schema marks them (a!) so the dispatcher bumps their versions. */
#include "nn_util.h"
#include "family.h"
#include "shard_rules.h"
#include "fused.h"

#include <tgmath.h> /* sqrt follows the element type inside AG__FLOAT_SWITCH bodies */

/* ---- native_layer_norm ---- */

/* Rows and row length of layer norm: input (M..., N...) with normalized_shape = N.... */
static int ln_check(const char *op, const ag_tensor *x, const ag_arg *ns, const ag_tensor *w,
                    const ag_tensor *b, int64_t *M, int64_t *N) {
    char s1[128], s2[128];
    int nn = ns->n;
    int rc = check_float(op, "input", x);
    if (rc)
        return rc;
    bool ok = nn >= 1 && nn <= x->ndim;
    for (int i = 0; ok && i < nn; i++)
        ok = ns->u.ints[i] == x->sizes[x->ndim - nn + i];
    if (!ok)
        return ag__err(AG_EINVAL,
                       "%s: normalized_shape %s does not match the trailing dims of input %s", op,
                       ag__fmt_sizes(s1, sizeof s1, nn, ns->u.ints), shape_str(x, s2, sizeof s2));
    if ((rc = check_param(op, "weight", w, x->dtype, nn, ns->u.ints)) ||
        (rc = check_param(op, "bias", b, x->dtype, nn, ns->u.ints)))
        return rc;
    *M = ag__numel(x->ndim - nn, x->sizes);
    *N = ag__numel(nn, x->sizes + x->ndim - nn);
    return 0;
}

/* mean and rstd keep the leading dims of x and have size 1 in the normalized ones. */
static void ln_stat_meta(const ag_tensor *x, int nn, ag_tmeta *m) {
    int64_t sizes[AG_MAX_DIMS];
    for (int d = 0; d < x->ndim; d++)
        sizes[d] = d < x->ndim - nn ? x->sizes[d] : 1;
    ag__tmeta_contiguous(m, x->dtype, x->ndim, sizes);
}

static int ln_meta(const ag_arg *a, ag_tmeta *o) {
    ag_tensor *x = a[0].u.t;
    int64_t M, N;
    int rc = ln_check("native_layer_norm", x, &a[1], targ(&a[2]), targ(&a[3]), &M, &N);
    if (rc)
        return rc;
    ag__tmeta_contiguous(&o[0], x->dtype, x->ndim, x->sizes);
    ln_stat_meta(x, a[1].n, &o[1]);
    ln_stat_meta(x, a[1].n, &o[2]);
    return 0;
}

/* Row i of layer norm (a statement; T the element type): xi (N) -> yi, mean[i], rstd[i]. */
#define LN_FWD_ROW(T, xi, yi, w, b, mean, rstd, i, N, eps)                                         \
    do {                                                                                           \
        double s = 0, v = 0;                                                                       \
        for (int64_t j = 0; j < N; j++)                                                            \
            s += xi[j];                                                                            \
        const double mu = s / (double)N;                                                           \
        for (int64_t j = 0; j < N; j++)                                                            \
            v += (xi[j] - mu) * (xi[j] - mu);                                                      \
        const double r = 1.0 / sqrt(v / (double)N + eps);                                          \
        for (int64_t j = 0; j < N; j++) {                                                          \
            double t = (xi[j] - mu) * r;                                                           \
            if (w)                                                                                 \
                t *= w[j];                                                                         \
            if (b)                                                                                 \
                t += b[j];                                                                         \
            yi[j] = (T)t;                                                                          \
        }                                                                                          \
        mean[i] = (T)mu;                                                                           \
        rstd[i] = (T)r;                                                                            \
    } while (0)

/* x, y are (M, N) contiguous; w, b (N) or NULL; mean, rstd (M). */
static int ln_fwd(ag_dtype dt, const void *xv, const void *wv, const void *bv, void *yv,
                  void *meanv, void *rstdv, int64_t M, int64_t N, double eps) {
    const bool par = M > 1 && M * N >= AG__PAR_MIN;
    AG__FLOAT_SWITCH(dt, T, {
        const T *x = xv, *w = wv, *b = bv;
        T *y = yv, *mean = meanv, *rstd = rstdv;
        _Pragma("omp parallel for schedule(static) if (par)") for (int64_t i = 0; i < M; i++) {
            const T *xi = x + i * N;
            T *yi = y + i * N;
            LN_FWD_ROW(T, xi, yi, w, b, mean, rstd, i, N, eps);
        }
    });
    return 0;
}

int ag__fused_add_layer_norm(ag_dtype dt, const void *av, const void *bv, void *sv, const void *wv,
                             const void *biasv, void *yv, void *meanv, void *rstdv, int64_t M,
                             int64_t N, double eps) {
    const bool par = M > 1 && M * N >= AG__PAR_MIN;
    AG__FLOAT_SWITCH(dt, T, {
        const T *a = av, *b = bv, *w = wv, *bias = biasv;
        T *sum = sv, *y = yv, *mean = meanv, *rstd = rstdv;
        _Pragma("omp parallel for schedule(static) if (par)") for (int64_t i = 0; i < M; i++) {
            T *xi = sum + i * N;
            for (int64_t j = 0; j < N; j++)
                xi[j] = a[i * N + j] + b[i * N + j];
            T *yi = y + i * N;
            LN_FWD_ROW(T, xi, yi, w, bias, mean, rstd, i, N, eps);
        }
    });
    return 0;
}

static int ln_kernel(const ag_arg *a, ag_tensor **o) {
    ag_tensor *x = a[0].u.t, *w = targ(&a[2]), *b = targ(&a[3]);
    int64_t M, N;
    int rc = ln_check("native_layer_norm", x, &a[1], w, b, &M, &N);
    if (rc)
        return rc;
    ag__scratch_tensor tx, tw, tb;
    const void *px = pack(x, &tx, 1);
    const void *pw = w ? pack(w, &tw, 2) : NULL;
    const void *pb = b ? pack(b, &tb, 3) : NULL;
    if (!px || (w && !pw) || (b && !pb))
        rc = ag_last_status();
    else
        rc = ln_fwd(x->dtype, px, pw, pb, data_of(o[0]), data_of(o[1]), data_of(o[2]), M, N,
                    a[4].u.f);
    return rc;
}

/* derivatives.yaml: input, weight, bias: native_layer_norm_backward(grad, input,
 * normalized_shape, result1, result2, weight, bias, grad_input_mask). mean and rstd carry no
 * gradient (nondiff_outputs). */
static int ln_backward(ag_bwctx *c) {
    ag_tensor *g = c->grad_outputs[0];
    if (!g)
        return 0;
    AG__OP(op, "native_layer_norm_backward");
    int64_t mask[3] = {c->needs_grad[0], c->needs_grad[1], c->needs_grad[2]};
    ag_tensor *r[3] = {0};
    ag_arg args[] = {AG_A_T(g),
                     AG_A_T(c->args[0].u.t),
                     c->args[1],
                     AG_A_T(c->outputs[1]),
                     AG_A_T(c->outputs[2]),
                     AG_A_T(targ(&c->args[2])),
                     AG_A_T(targ(&c->args[3])),
                     AG_A_INTS(mask, 3)};
    int rc = ag_op_call(op, args, 8, r);
    if (rc < 0)
        return rc;
    for (int j = 0; j < 3; j++)
        if (mask[j])
            c->grad_inputs[j] = r[j];
    return 0;
}

static void ln_cost(const ag_arg *a, const ag_tmeta *o, int nouts, ag_cost *c) {
    c->flops = 8.0 * (double)ag_tensor_numel(a[0].u.t);
    c->bytes = io_bytes(a, 4, o, nouts);
}

static void ln_samples(ag_samples *s) {
    int64_t x2[] = {3, 4}, n1[] = {4}, x3[] = {2, 3, 4}, n2[] = {3, 4};
    ag_samples_add(s, "2-d, weight and bias",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, x2, -2, 2)), AG_A_INTS(n1, 1),
                              AG_A_T(ag_samples_rand(s, 1, n1, 0.5, 1.5)),
                              AG_A_T(ag_samples_rand(s, 1, n1, -1, 1)), AG_A_F(1e-5)},
                   5);
    ag_samples_add(s, "3-d over two dims, no affine",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 3, x3, -2, 2)), AG_A_INTS(n2, 2), AG_A_NONE,
                              AG_A_NONE, AG_A_F(1e-5)},
                   5);
    ag_samples_add(s, "strided input, weight only",
                   (ag_arg[]){AG_A_T(ag_samples_rand_strided(s, 3, x3, -2, 2)), AG_A_INTS(n1, 1),
                              AG_A_T(ag_samples_rand(s, 1, n1, 0.5, 1.5)), AG_A_NONE, AG_A_F(1e-3)},
                   5);
}

/* Core decomposition: mean and biased variance over the normalized dims, out = (x - mean) *
 * rsqrt(var + eps) * weight + bias; mean and rstd keep the reduced dims (size 1). */
static int native_layer_norm_decomp(const ag_arg *a, ag_tensor **o) {
    ag_tensor *x = a[0].u.t;
    int nnorm = a[1].n;
    int64_t dims[AG_MAX_DIMS];
    for (int i = 0; i < nnorm; i++)
        dims[i] = x->ndim - nnorm + i;
    ag_tensor *mean = ag_mean(x, dims, nnorm, true);
    ag_tensor *rstd = ag_rsqrt(ag_add_scalar(ag_var(x, dims, nnorm, 0.0, true), a[4].u.f));
    ag_tensor *out = ag_mul(ag_sub(x, mean), rstd);
    if (a[2].kind == AG_ARG_TENSOR && a[2].u.t)
        out = ag_mul(out, a[2].u.t);
    if (a[3].kind == AG_ARG_TENSOR && a[3].u.t)
        out = ag_add(out, a[3].u.t);
    o[0] = out;
    o[1] = mean;
    o[2] = rstd;
    return out && mean && rstd ? 0 : ag_last_status();
}

static const ag_opdef op_native_layer_norm = {
    .decomp = native_layer_norm_decomp,
    .schema = "native_layer_norm(Tensor input, SymInt[] normalized_shape, Tensor? weight, "
              "Tensor? bias, float eps) -> (Tensor, Tensor, Tensor)",
    .meta = ln_meta,
    .kernel = ln_kernel,
    .dtypes = AG_DT_FLOAT,
    .backward = ln_backward,
    .save_args = 0x7,       /* input, weight, bias */
    .save_outputs = 0x6,    /* mean, rstd */
    .nondiff_outputs = 0x6, /* mean, rstd */
    .cost = ln_cost,
    .samples = ln_samples,
    .shard = ag__shard_layer_norm,
};

/* ---- native_layer_norm_backward ---- */

static int lnb_meta(const ag_arg *a, ag_tmeta *o) {
    const char *op = "native_layer_norm_backward";
    ag_tensor *g = a[0].u.t, *x = a[1].u.t, *mean = a[3].u.t, *rstd = a[4].u.t;
    ag_tensor *w = targ(&a[5]), *b = targ(&a[6]);
    int64_t M, N;
    int rc = ln_check(op, x, &a[2], w, b, &M, &N);
    if (rc)
        return rc;
    char s1[128], s2[128];
    if (!same_sizes(g->ndim, g->sizes, x->ndim, x->sizes) || g->dtype != x->dtype)
        return ag__err(AG_EINVAL, "%s: grad_out %s does not match input %s", op,
                       ag_tensor_meta_str(g, s1, sizeof s1), ag_tensor_meta_str(x, s2, sizeof s2));
    if (ag_tensor_numel(mean) != M || ag_tensor_numel(rstd) != M || mean->dtype != x->dtype ||
        rstd->dtype != x->dtype)
        return ag__err(AG_EINVAL, "%s: mean %s and rstd %s must hold %lld %s values", op,
                       shape_str(mean, s1, sizeof s1), shape_str(rstd, s2, sizeof s2), (long long)M,
                       ag_dtype_short(x->dtype));
    if (a[7].n != 3)
        return ag__err(AG_EINVAL, "%s: output_mask needs 3 entries, got %d", op, a[7].n);
    const int64_t *mask = a[7].u.ints;
    if (mask[0])
        ag__tmeta_contiguous(&o[0], x->dtype, x->ndim, x->sizes);
    else
        meta_unused(&o[0], x->dtype);
    if (mask[1] && w)
        ag__tmeta_contiguous(&o[1], x->dtype, w->ndim, w->sizes);
    else
        meta_unused(&o[1], x->dtype);
    if (mask[2] && b)
        ag__tmeta_contiguous(&o[2], x->dtype, b->ndim, b->sizes);
    else
        meta_unused(&o[2], x->dtype);
    return 0;
}

/* g, x, gx are (M, N); mean, rstd (M); w (N) or NULL; gw, gb (N) or NULL. With
 * xhat = (x - mean) * rstd and gh = g * w, per row:
 *   gx = rstd * (gh - mean_j(gh) - xhat * mean_j(gh * xhat)),
 * and over rows gw = sum_i g * xhat, gb = sum_i g. */
static int ln_bwd_acc(ag_dtype dt, const void *gv, const void *xv, const void *meanv,
                      const void *rstdv, const void *wv, void *gxv, void *gwv, void *gbv, int64_t M,
                      int64_t N, const void *accv, void *outv) {
    const bool par = M * N >= AG__PAR_MIN;
    enum { BLK = 64 };
    AG__FLOAT_SWITCH(dt, T, {
        const T *g = gv, *x = xv, *mean = meanv, *rstd = rstdv, *w = wv;
        T *gx = gxv, *gw = gwv, *gb = gbv;
        if (gx) {
            _Pragma("omp parallel for schedule(static) if (par && M > 1)") for (int64_t i = 0;
                                                                                i < M; i++) {
                const T *gi = g + i * N, *xi = x + i * N;
                const double mu = mean[i], r = rstd[i];
                double sg = 0, sgx = 0;
                for (int64_t j = 0; j < N; j++) {
                    const double gh = w ? gi[j] * (double)w[j] : gi[j];
                    sg += gh;
                    sgx += gh * (xi[j] - mu) * r;
                }
                sg /= (double)N;
                sgx /= (double)N;
                for (int64_t j = 0; j < N; j++) {
                    const double gh = w ? gi[j] * (double)w[j] : gi[j];
                    gx[i * N + j] = (T)(r * (gh - sg - (xi[j] - mu) * r * sgx));
                }
                if (outv) {
                    const T *acc = (const T *)accv + i * N;
                    T *out = (T *)outv + i * N;
                    for (int64_t j = 0; j < N; j++)
                        out[j] = acc[j] + gx[i * N + j];
                }
            }
        }
        if (gw || gb) {
            /* Column blocks: each thread owns BLK columns and walks every row. */
            const int64_t nblk = (N + BLK - 1) / BLK;
            _Pragma("omp parallel for schedule(static) if (par && nblk > 1)") for (int64_t blk = 0;
                                                                                   blk < nblk;
                                                                                   blk++) {
                const int64_t j0 = blk * BLK, j1 = j0 + BLK < N ? j0 + BLK : N;
                double aw[BLK] = {0}, ab[BLK] = {0};
                for (int64_t i = 0; i < M; i++) {
                    const double mu = mean[i], r = rstd[i];
                    for (int64_t j = j0; j < j1; j++) {
                        aw[j - j0] += g[i * N + j] * (x[i * N + j] - mu) * r;
                        ab[j - j0] += g[i * N + j];
                    }
                }
                for (int64_t j = j0; j < j1; j++) {
                    if (gw)
                        gw[j] = (T)aw[j - j0];
                    if (gb)
                        gb[j] = (T)ab[j - j0];
                }
            }
        }
    });
    return 0;
}

static int ln_bwd(ag_dtype dt, const void *gv, const void *xv, const void *meanv, const void *rstdv,
                  const void *wv, void *gxv, void *gwv, void *gbv, int64_t M, int64_t N) {
    return ln_bwd_acc(dt, gv, xv, meanv, rstdv, wv, gxv, gwv, gbv, M, N, NULL, NULL);
}

int ag__fused_layer_norm_backward_add(ag_dtype dt, const void *g, const void *x, const void *mean,
                                      const void *rstd, const void *w, void *gx, void *gw, void *gb,
                                      int64_t M, int64_t N, const void *acc, void *out) {
    return ln_bwd_acc(dt, g, x, mean, rstd, w, gx, gw, gb, M, N, acc, out);
}

static int lnb_kernel(const ag_arg *a, ag_tensor **o) {
    ag_tensor *g = a[0].u.t, *x = a[1].u.t, *w = targ(&a[5]), *b = targ(&a[6]);
    int64_t M, N;
    int rc = ln_check("native_layer_norm_backward", x, &a[2], w, b, &M, &N);
    if (rc)
        return rc;
    const int64_t *mask = a[7].u.ints;
    ag__scratch_tensor t[5];
    const void *pg = pack(g, &t[0], 1), *px = pack(x, &t[1], 2), *pm = pack(a[3].u.t, &t[2], 3);
    const void *pr = pack(a[4].u.t, &t[3], 4), *pw = w ? pack(w, &t[4], 5) : NULL;
    if (!pg || !px || !pm || !pr || (w && !pw))
        rc = ag_last_status();
    else
        rc = ln_bwd(x->dtype, pg, px, pm, pr, pw, mask[0] ? data_of(o[0]) : NULL,
                    mask[1] && w ? data_of(o[1]) : NULL, mask[2] && b ? data_of(o[2]) : NULL, M, N);
    return rc;
}

static void lnb_cost(const ag_arg *a, const ag_tmeta *o, int nouts, ag_cost *c) {
    c->flops = 10.0 * (double)ag_tensor_numel(a[1].u.t);
    c->bytes = io_bytes(a, 7, o, nouts);
}

static const ag_opdef op_native_layer_norm_backward = {
    .schema = "native_layer_norm_backward(Tensor grad_out, Tensor input, SymInt[] "
              "normalized_shape, Tensor mean, Tensor rstd, Tensor? weight, Tensor? bias, "
              "bool[3] output_mask) -> (Tensor, Tensor, Tensor)",
    .flags = AG_OP_BACKWARD_HELPER | AG_OP_NONDIFF,
    .meta = lnb_meta,
    .kernel = lnb_kernel,
    .dtypes = AG_DT_FLOAT,
    .cost = lnb_cost,
    .shard = ag__shard_layer_norm_backward,
};

/* ---- layer_norm (composite) ---- */

static int layer_norm_decomp(const ag_arg *a, ag_tensor **outs) {
    AG__OP(op, "native_layer_norm");
    ag_tensor *r[3] = {0};
    int rc = ag_op_call(op, (ag_arg[]){a[0], a[1], a[2], a[3], a[4]}, 5, r);
    if (rc < 0)
        return rc;
    outs[0] = r[0];
    return 0;
}

static const ag_opdef op_layer_norm = {
    .schema = "layer_norm(Tensor input, SymInt[] normalized_shape, Tensor? weight=None, "
              "Tensor? bias=None, float eps=1e-05, bool cudnn_enable=True) -> Tensor",
    .flags = AG_OP_COMPOSITE,
    .meta = ln_meta,
    .dtypes = AG_DT_FLOAT,
    .decomp = layer_norm_decomp,
    .samples = ln_samples, /* the leading arguments are native_layer_norm's */
};

int ag_native_layer_norm(ag_tensor *x, int nnorm, const int64_t *normalized_shape,
                         ag_tensor *weight, ag_tensor *bias, double eps, ag_tensor **out,
                         ag_tensor **mean, ag_tensor **rstd) {
    AG__OP(op, "native_layer_norm");
    ag_arg args[] = {AG_A_T(x), AG_A_INTS(normalized_shape, nnorm), AG_A_T(weight), AG_A_T(bias),
                     AG_A_F(eps)};
    return call_outs(op, args, 5, (ag_tensor * *const[]){out, mean, rstd}, 3);
}

ag_tensor *ag_layer_norm(ag_tensor *x, int nnorm, const int64_t *normalized_shape,
                         ag_tensor *weight, ag_tensor *bias, double eps) {
    AG__OP(op, "layer_norm");
    return ag__call1(op,
                     (ag_arg[]){AG_A_T(x), AG_A_INTS(normalized_shape, nnorm), AG_A_T(weight),
                                AG_A_T(bias), AG_A_F(eps)},
                     5);
}

/* ---- native_batch_norm ---- */

/* input is (N, C, spatial...): C channels of `count` = N * prod(spatial) values each. */
static int bn_check(const char *op, const ag_tensor *x, const ag_tensor *w, const ag_tensor *b,
                    const ag_tensor *rm, const ag_tensor *rv) {
    char s[128];
    int rc = check_float(op, "input", x);
    if (rc)
        return rc;
    if (x->ndim < 2)
        return ag__err(AG_EINVAL, "%s: input must be (N, C, ...) with at least 2 dims, got %s", op,
                       shape_str(x, s, sizeof s));
    const int64_t C = x->sizes[1];
    if ((rc = check_param(op, "weight", w, x->dtype, 1, &C)) ||
        (rc = check_param(op, "bias", b, x->dtype, 1, &C)) ||
        (rc = check_param(op, "running_mean", rm, x->dtype, 1, &C)) ||
        (rc = check_param(op, "running_var", rv, x->dtype, 1, &C)))
        return rc;
    return 0;
}

static int64_t bn_count(const ag_tensor *x) {
    return x->sizes[0] * ag__numel(x->ndim - 2, x->sizes + 2);
}

static int bn_meta(const ag_arg *a, ag_tmeta *o) {
    const char *op = "native_batch_norm";
    ag_tensor *x = a[0].u.t, *rm = targ(&a[3]), *rv = targ(&a[4]);
    bool training = a[5].u.b;
    int rc = bn_check(op, x, targ(&a[1]), targ(&a[2]), rm, rv);
    if (rc)
        return rc;
    char s[128];
    if (!rm != !rv)
        return ag__err(AG_EINVAL, "%s: running_mean and running_var must be given together", op);
    if (!training && !rm)
        return ag__err(AG_EINVAL,
                       "%s: running_mean and running_var must be given in evaluation mode "
                       "(training=false)",
                       op);
    /* One value per channel has no variance; no values at all is an empty batch, which runs
     * (kernel below), as PyTorch's batch_norm does. */
    if (training && bn_count(x) == 1)
        return ag__err(AG_EINVAL,
                       "%s: Expected more than 1 value per channel when training, got input "
                       "size %s",
                       op, shape_str(x, s, sizeof s));
    ag__tmeta_contiguous(&o[0], x->dtype, x->ndim, x->sizes);
    ag__tmeta_contiguous(&o[1], x->dtype, 1, &x->sizes[1]);
    ag__tmeta_contiguous(&o[2], x->dtype, 1, &x->sizes[1]);
    return 0;
}

/* Per-channel sums of batch norm, vectorized: 8 double lanes in two accumulators, so that the
 * float32 data is read 16 values a step while the statistics stay in double (a serial double
 * sum waits on the add's latency at every element: ~1 ns each, 3 ms per pass over a 32-channel
 * 28x28 batch of 128). bn_vload widens 8 values of either float type to double. */
typedef double bn_vd __attribute__((vector_size(8 * sizeof(double))));
typedef float bn_vf __attribute__((vector_size(8 * sizeof(float))));

/* Macros rather than functions: a 64-byte vector argument or result changes the ABI on builds
 * without AVX-512 (-Wpsabi). */
#define bn_vload(p)                                                                                \
    ({                                                                                             \
        bn_vd r_;                                                                                  \
        if (sizeof(*(p)) == sizeof(float)) {                                                       \
            bn_vf f_;                                                                              \
            memcpy(&f_, (p), sizeof f_);                                                           \
            r_ = __builtin_convertvector(f_, bn_vd);                                               \
        } else {                                                                                   \
            memcpy(&r_, (p), sizeof r_);                                                           \
        }                                                                                          \
        r_;                                                                                        \
    })

#define bn_hsum(a, b, tail)                                                                        \
    ({                                                                                             \
        const bn_vd v_ = (a) + (b);                                                                \
        double s_ = 0;                                                                             \
        for (int k_ = 0; k_ < 8; k_++)                                                             \
            s_ += v_[k_];                                                                          \
        s_ + (tail);                                                                               \
    })

/* sum(x) and sum((x - mean)^2) over the N rows of S values at x, stride C * S (one channel). */
#define BN_SUMS(T)                                                                                 \
    static double bn_sum_##T(const T *x, int64_t N, int64_t rs, int64_t S) {                       \
        bn_vd a = {0}, b = {0};                                                                    \
        double t = 0;                                                                              \
        for (int64_t n = 0; n < N; n++) {                                                          \
            const T *r = x + n * rs;                                                               \
            int64_t j = 0;                                                                         \
            for (; j + 16 <= S; j += 16) {                                                         \
                a += bn_vload(r + j);                                                              \
                b += bn_vload(r + j + 8);                                                          \
            }                                                                                      \
            for (; j < S; j++)                                                                     \
                t += r[j];                                                                         \
        }                                                                                          \
        return bn_hsum(a, b, t);                                                                   \
    }                                                                                              \
    static double bn_sqdev_##T(const T *x, int64_t N, int64_t rs, int64_t S, double mean) {        \
        bn_vd a = {0}, b = {0};                                                                    \
        double t = 0;                                                                              \
        for (int64_t n = 0; n < N; n++) {                                                          \
            const T *r = x + n * rs;                                                               \
            int64_t j = 0;                                                                         \
            for (; j + 16 <= S; j += 16) {                                                         \
                const bn_vd d0 = bn_vload(r + j) - mean, d1 = bn_vload(r + j + 8) - mean;          \
                a += d0 * d0;                                                                      \
                b += d1 * d1;                                                                      \
            }                                                                                      \
            for (; j < S; j++) {                                                                   \
                const double d = r[j] - mean;                                                      \
                t += d * d;                                                                        \
            }                                                                                      \
        }                                                                                          \
        return bn_hsum(a, b, t);                                                                   \
    }                                                                                              \
    /* sum(g) into *sg and sum(g * (x - mean)) into *sgd. With r (the fused                        \
     * threshold_backward+batch_norm_backward), g stands for threshold_backward(g, r, th): 0 where \
     * r <= th (th already rounded to T). */                                                       \
    static void bn_gsums_##T(const T *g, const T *x, const T *r, double th, int64_t N, int64_t rs, \
                             int64_t S, double mean, double *sg, double *sgd) {                    \
        typedef long long bn_vl __attribute__((vector_size(8 * sizeof(long long))));               \
        bn_vd a = {0}, b = {0}, c = {0}, d = {0};                                                  \
        double t = 0, u = 0;                                                                       \
        for (int64_t n = 0; n < N; n++) {                                                          \
            const T *gr = g + n * rs, *xr = x + n * rs, *rr = r ? r + n * rs : NULL;               \
            int64_t j = 0;                                                                         \
            for (; j + 16 <= S; j += 16) {                                                         \
                bn_vd g0 = bn_vload(gr + j), g1 = bn_vload(gr + j + 8);                            \
                if (rr) {                                                                          \
                    g0 = (bn_vd)((bn_vl)g0 & ~(bn_vl)(bn_vload(rr + j) <= th));                    \
                    g1 = (bn_vd)((bn_vl)g1 & ~(bn_vl)(bn_vload(rr + j + 8) <= th));                \
                }                                                                                  \
                a += g0;                                                                           \
                b += g1;                                                                           \
                c += g0 * (bn_vload(xr + j) - mean);                                               \
                d += g1 * (bn_vload(xr + j + 8) - mean);                                           \
            }                                                                                      \
            for (; j < S; j++) {                                                                   \
                const T gj = rr && rr[j] <= th ? (T)0 : gr[j];                                     \
                t += gj;                                                                           \
                u += gj * (xr[j] - mean);                                                          \
            }                                                                                      \
        }                                                                                          \
        *sg = bn_hsum(a, b, t);                                                                    \
        *sgd = bn_hsum(c, d, u);                                                                   \
    }
BN_SUMS(float)
BN_SUMS(double)
#undef BN_SUMS
#define bn_sum(x, ...)                                                                             \
    _Generic((x), const float * : bn_sum_float, const double * : bn_sum_double)(x, __VA_ARGS__)
#define bn_sqdev(x, ...)                                                                           \
    _Generic((x), const float * : bn_sqdev_float, const double * : bn_sqdev_double)(x, __VA_ARGS__)
#define bn_gsums(g, ...)                                                                           \
    _Generic((g), const float * : bn_gsums_float, const double * : bn_gsums_double)(g, __VA_ARGS__)

/* x, y are (N, C, S) contiguous; save_mean, save_invstd (C). In training the statistics come
 * from the batch (biased variance) and the running ones are updated; in evaluation they come
 * from the running ones, and save_mean/save_invstd return them (ATen's CPU kernel returns
 * empty tensors there) so that backward needs no reference to the mutable buffers. */
/* z, when not NULL, gets relu(y) (the fused batch_norm+relu; y is then NULL when nothing else
 * reads it). */
static int bn_fwd(ag_dtype dt, const void *xv, chan w, chan b, chan rm, chan rv, void *yv, void *zv,
                  void *smv, void *siv, int64_t N, int64_t C, int64_t S, bool train,
                  double momentum, double eps) {
    const int64_t count = N * S;
    /* An empty batch in training: nothing to average, so the output is empty, save_mean and
     * save_invstd are 0 and the running statistics stay as they are (PyTorch's batch_norm
     * returns before computing or updating statistics for an input with no elements). Here,
     * not in the op's kernel, so that the fused batch_norm+relu does the same. */
    if (train && count == 0) {
        if (C > 0) {
            memset(smv, 0, (size_t)C * ag_dtype_size(dt));
            memset(siv, 0, (size_t)C * ag_dtype_size(dt));
        }
        return 0;
    }
    const bool par = C > 1 && N * C * S >= AG__PAR_MIN;
    AG__FLOAT_SWITCH(dt, T, {
        const T *x = xv;
        T *y = yv, *z = zv, *sm = smv, *si = siv;
        _Pragma("omp parallel for schedule(static) if (par)") for (int64_t c = 0; c < C; c++) {
            double mean, invstd;
            if (train) {
                mean = bn_sum(x + c * S, N, C * S, S) / (double)count;
                const double var = bn_sqdev(x + c * S, N, C * S, S, mean) / (double)count;
                invstd = 1.0 / sqrt(var + eps);
                if (rm.p) {
                    T *pm = (T *)rm.p + c * rm.stride, *pv = (T *)rv.p + c * rv.stride;
                    *pm = (T)((1 - momentum) * *pm + momentum * mean);
                    *pv = (T)((1 - momentum) * *pv +
                              momentum * var * (double)count / (double)(count - 1));
                }
            } else {
                mean = ((const T *)rm.p)[c * rm.stride];
                invstd = 1.0 / sqrt((double)((const T *)rv.p)[c * rv.stride] + eps);
            }
            sm[c] = (T)mean;
            si[c] = (T)invstd;
            const double wc = w.p ? (double)((const T *)w.p)[c * w.stride] : 1.0;
            const double bc = b.p ? (double)((const T *)b.p)[c * b.stride] : 0.0;
            /* 8 values a step in double, narrowed to T; relu (x < 0 ? 0 : x, so -0 stays)
             * on the narrowed values as a mask, since scalar selects stay branches. */
            typedef T tv __attribute__((vector_size(8 * sizeof(T))));
            for (int64_t n = 0; n < N; n++) {
                const int64_t i0 = (n * C + c) * S, i1 = i0 + S;
                int64_t j = i0;
                for (; j + 8 <= i1; j += 8) {
                    const tv v =
                        __builtin_convertvector((bn_vload(x + j) - mean) * invstd * wc + bc, tv);
                    if (y)
                        memcpy(y + j, &v, sizeof v);
                    if (z) {
                        const tv r = (tv)((__typeof__(v < 0))v & ~(v < 0));
                        memcpy(z + j, &r, sizeof r);
                    }
                }
                for (; j < i1; j++) {
                    const T v = (T)((x[j] - mean) * invstd * wc + bc);
                    if (y)
                        y[j] = v;
                    if (z)
                        z[j] = v < 0 ? (T)0 : v; /* relu's expression */
                }
            }
        }
    });
    return 0;
}

static int bn_kernel(const ag_arg *a, ag_tensor **o) {
    ag_tensor *x = a[0].u.t;
    ag__scratch_tensor tx;
    const void *px = pack(x, &tx, 1);
    if (!px)
        return ag_last_status();
    const int64_t N = x->sizes[0], C = x->sizes[1], S = ag__numel(x->ndim - 2, x->sizes + 2);
    int rc = bn_fwd(x->dtype, px, chan_of(targ(&a[1])), chan_of(targ(&a[2])), chan_of(targ(&a[3])),
                    chan_of(targ(&a[4])), data_of(o[0]), NULL, data_of(o[1]), data_of(o[2]), N, C,
                    S, a[5].u.b, a[6].u.f, a[7].u.f);
    return rc;
}

/* derivatives.yaml: input, weight, bias: native_batch_norm_backward(grad, input, weight,
 * running_mean, running_var, result1, result2, training, eps, grad_input_mask). We pass None
 * for the running stats: in training the kernel does not read them, and in evaluation our
 * save_mean/save_invstd carry them, which keeps the buffers (updated in place by every training
 * forward) out of the saved set and its version checks. save_mean/save_invstd carry no
 * gradient (nondiff_outputs). */
static int bn_backward(ag_bwctx *c) {
    ag_tensor *g = c->grad_outputs[0];
    if (!g)
        return 0;
    AG__OP(op, "native_batch_norm_backward");
    int64_t mask[3] = {c->needs_grad[0], c->needs_grad[1], c->needs_grad[2]};
    ag_tensor *r[3] = {0};
    ag_arg args[] = {AG_A_T(g),  AG_A_T(c->args[0].u.t), AG_A_T(targ(&c->args[1])), AG_A_NONE,
                     AG_A_NONE,  AG_A_T(c->outputs[1]),  AG_A_T(c->outputs[2]),     c->args[5],
                     c->args[7], AG_A_INTS(mask, 3)};
    int rc = ag_op_call(op, args, 10, r);
    if (rc < 0)
        return rc;
    for (int j = 0; j < 3; j++)
        if (mask[j])
            c->grad_inputs[j] = r[j];
    return 0;
}

static void bn_cost(const ag_arg *a, const ag_tmeta *o, int nouts, ag_cost *c) {
    c->flops = 8.0 * (double)ag_tensor_numel(a[0].u.t);
    c->bytes = io_bytes(a, 5, o, nouts);
}

static void bn_samples(ag_samples *s) {
    int64_t x2[] = {4, 3}, x4[] = {2, 3, 2, 2}, c3[] = {3};
    ag_samples_add(s, "training, 2-d, affine, running stats",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, x2, -2, 2)),
                              AG_A_T(ag_samples_rand(s, 1, c3, 0.5, 1.5)),
                              AG_A_T(ag_samples_rand(s, 1, c3, -1, 1)),
                              AG_A_T(ag_samples_rand_nograd(s, 1, c3, -0.5, 0.5)),
                              AG_A_T(ag_samples_rand_nograd(s, 1, c3, 0.5, 1.5)), AG_A_B(true),
                              AG_A_F(0.1), AG_A_F(1e-5)},
                   8);
    ag_samples_add(s, "training, 4-d strided, no affine",
                   (ag_arg[]){AG_A_T(ag_samples_rand_strided(s, 4, x4, -2, 2)), AG_A_NONE,
                              AG_A_NONE, AG_A_NONE, AG_A_NONE, AG_A_B(true), AG_A_F(0.1),
                              AG_A_F(1e-5)},
                   8);
    ag_samples_add(s, "evaluation, 4-d",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 4, x4, -2, 2)),
                              AG_A_T(ag_samples_rand(s, 1, c3, 0.5, 1.5)),
                              AG_A_T(ag_samples_rand(s, 1, c3, -1, 1)),
                              AG_A_T(ag_samples_rand_nograd(s, 1, c3, -0.5, 0.5)),
                              AG_A_T(ag_samples_rand_nograd(s, 1, c3, 0.5, 1.5)), AG_A_B(false),
                              AG_A_F(0.1), AG_A_F(1e-5)},
                   8);
}

static const ag_opdef op_native_batch_norm = {
    .schema = "native_batch_norm(Tensor input, Tensor? weight, Tensor? bias, "
              "Tensor(a!)? running_mean, Tensor(b!)? running_var, bool training, "
              "float momentum, float eps) -> (Tensor, Tensor, Tensor)",
    .functional = "_native_batch_norm_legit_functional",
    .meta = bn_meta,
    .kernel = bn_kernel,
    .dtypes = AG_DT_FLOAT,
    .backward = bn_backward,
    .save_args = 0x3,       /* input, weight */
    .save_outputs = 0x6,    /* save_mean, save_invstd */
    .nondiff_outputs = 0x6, /* save_mean, save_invstd */
    .cost = bn_cost,
    .samples = bn_samples,
};

/* ---- _native_batch_norm_legit_functional ----
 * What functionalization records for native_batch_norm: the same computation, with the updated
 * running statistics returned as outputs 3 and 4 instead of written into the buffers. */

static int bnf_meta(const ag_arg *a, ag_tmeta *o) {
    int rc = bn_meta(a, o);
    if (rc)
        return rc;
    ag_tensor *rm = targ(&a[3]), *rv = targ(&a[4]);
    if (!rm || !rv)
        return ag__err(AG_EINVAL, "_native_batch_norm_legit_functional: running_mean and "
                                  "running_var are required");
    ag__tmeta_contiguous(&o[3], rm->dtype, rm->ndim, rm->sizes);
    ag__tmeta_contiguous(&o[4], rv->dtype, rv->ndim, rv->sizes);
    return 0;
}

static int bnf_kernel(const ag_arg *a, ag_tensor **o) {
    int rc = ag__copy_into(o[3], a[3].u.t);
    if (!rc)
        rc = ag__copy_into(o[4], a[4].u.t);
    if (rc)
        return rc;
    ag_arg b[8];
    memcpy(b, a, sizeof b);
    b[3] = AG_A_T(o[3]);
    b[4] = AG_A_T(o[4]);
    return bn_kernel(b, o);
}

static void bnf_samples(ag_samples *s) {
    int64_t x2[] = {4, 3}, c3[] = {3};
    ag_samples_add(s, "training, 2-d, affine",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, x2, -2, 2)),
                              AG_A_T(ag_samples_rand(s, 1, c3, 0.5, 1.5)),
                              AG_A_T(ag_samples_rand(s, 1, c3, -1, 1)),
                              AG_A_T(ag_samples_rand_nograd(s, 1, c3, -0.5, 0.5)),
                              AG_A_T(ag_samples_rand_nograd(s, 1, c3, 0.5, 1.5)), AG_A_B(true),
                              AG_A_F(0.1), AG_A_F(1e-5)},
                   8);
}

/* Decompositions of batch norm into reductions and pointwise ops, for the sharding pass: on a
 * batch-sharded input each sum over the batch is a Partial(sum) of [C] values that one small
 * all_reduce completes (SyncBatchNorm), where the fused kernel would need the whole batch on
 * every rank. Not composite: eager calls and single-process graphs keep the kernels. Each
 * statistic is first read by an op that is not linear in it (x - mean, var + eps, the
 * backward's g - sum(g) / count), so that the pass reduces it once and every later reader
 * shares the reduced value. */

/* The statistics' dims of x (N, C, spatial...): every dim but 1; [1, C, 1, ...] in bshape. */
static int bn_dims(const ag_tensor *x, int64_t *dims, int64_t *bshape) {
    int n = 0;
    for (int d = 0; d < x->ndim; d++) {
        bshape[d] = d == 1 ? x->sizes[1] : 1;
        if (d != 1)
            dims[n++] = d;
    }
    return n;
}

/* A [C] tensor as [1, C, 1, ...] against x; NULL stays NULL. */
static ag_tensor *bn_bcast(ag_tensor *t, const ag_tensor *x, const int64_t *bshape) {
    return t ? ag_view(t, x->ndim, bshape) : NULL;
}

/* _native_batch_norm_legit_functional. Training: mean = sum(x) / count and the biased
 * var = sum((x - mean)^2) / count over every dim but 1, out = (x - mean) * rsqrt(var + eps)
 * * weight + bias, running_mean' = (1 - momentum) running_mean + momentum mean, running_var' =
 * (1 - momentum) running_var + momentum var count / (count - 1). Evaluation: the running
 * statistics normalize, and come back unchanged. An empty batch (the kernel leaves the
 * statistics as they are and returns zeros for them) has no decomposition (AG_ENOTSUP). */
static int bnf_decomp(const ag_arg *a, ag_tensor **o) {
    ag_tensor *x = a[0].u.t, *w = targ(&a[1]), *b = targ(&a[2]);
    ag_tensor *rm = a[3].u.t, *rv = a[4].u.t;
    const bool train = a[5].u.b;
    const double momentum = a[6].u.f, eps = a[7].u.f;
    int64_t dims[AG_MAX_DIMS], bshape[AG_MAX_DIMS], C = x->sizes[1];
    int nd = bn_dims(x, dims, bshape);
    const int64_t count = bn_count(x);
    if (train && count == 0)
        return ag__err(AG_ENOTSUP, "_native_batch_norm_legit_functional: no decomposition for "
                                   "an empty batch");
    ag_tensor *mean, *var = NULL;
    if (train) {
        mean = ag_div_scalar(ag_sum(x, dims, nd, true), (double)count);
    } else {
        mean = bn_bcast(rm, x, bshape);
    }
    ag_tensor *d = ag_sub(x, mean);
    if (train)
        var = ag_div_scalar(ag_sum(ag_mul(d, d), dims, nd, true), (double)count);
    ag_tensor *invstd = ag_rsqrt(ag_add_scalar(train ? var : bn_bcast(rv, x, bshape), eps));
    ag_tensor *out = ag_mul(d, invstd);
    if (w)
        out = ag_mul(out, bn_bcast(w, x, bshape));
    if (b)
        out = ag_add(out, bn_bcast(b, x, bshape));
    o[0] = out;
    o[1] = train ? ag_view(mean, 1, &C) : ag_clone(rm);
    o[2] = ag_view(invstd, 1, &C);
    if (train) {
        const double unbias = (double)count / (double)(count - 1);
        o[3] = ag_add(ag_mul_scalar(rm, 1 - momentum), ag_mul_scalar(o[1], momentum));
        o[4] = ag_add(ag_mul_scalar(rv, 1 - momentum),
                      ag_mul_scalar(ag_view(var, 1, &C), momentum * unbias));
    } else {
        o[3] = ag_clone(rm);
        o[4] = ag_clone(rv);
    }
    for (int k = 0; k < 5; k++)
        if (!o[k])
            return ag_last_status();
    return 0;
}

static const ag_opdef op_native_batch_norm_functional = {
    .schema = "_native_batch_norm_legit_functional(Tensor input, Tensor? weight, Tensor? bias, "
              "Tensor running_mean, Tensor running_var, bool training, float momentum, "
              "float eps) -> (Tensor, Tensor, Tensor, Tensor running_mean_out, "
              "Tensor running_var_out)",
    .meta = bnf_meta,
    .kernel = bnf_kernel,
    .dtypes = AG_DT_FLOAT,
    .backward = bn_backward,
    .save_args = 0x3,
    .save_outputs = 0x6,
    .nondiff_outputs = 0x1e, /* everything but the normalized output */
    .cost = bn_cost,
    .samples = bnf_samples,
    .shard = ag__shard_batch_norm,
    .decomp = bnf_decomp,
};

/* ---- native_batch_norm_backward ---- */

static int bnb_meta(const ag_arg *a, ag_tmeta *o) {
    const char *op = "native_batch_norm_backward";
    ag_tensor *g = a[0].u.t, *x = a[1].u.t, *w = targ(&a[2]);
    ag_tensor *rm = targ(&a[3]), *rv = targ(&a[4]), *sm = targ(&a[5]), *si = targ(&a[6]);
    bool train = a[7].u.b;
    int rc = bn_check(op, x, w, NULL, rm, rv);
    if (rc)
        return rc;
    char s1[128], s2[128];
    if (!same_sizes(g->ndim, g->sizes, x->ndim, x->sizes) || g->dtype != x->dtype)
        return ag__err(AG_EINVAL, "%s: grad_out %s does not match input %s", op,
                       ag_tensor_meta_str(g, s1, sizeof s1), ag_tensor_meta_str(x, s2, sizeof s2));
    const int64_t C = x->sizes[1];
    if ((rc = check_param(op, "save_mean", sm, x->dtype, 1, &C)) ||
        (rc = check_param(op, "save_invstd", si, x->dtype, 1, &C)))
        return rc;
    bool have_saved = sm && si, have_running = rm && rv;
    if (train ? !have_saved : !(have_running || have_saved))
        return ag__err(AG_EINVAL,
                       "%s: needs save_mean and save_invstd in training, and running_mean and "
                       "running_var (or save_mean and save_invstd) in evaluation",
                       op);
    if (a[9].n != 3)
        return ag__err(AG_EINVAL, "%s: output_mask needs 3 entries, got %d", op, a[9].n);
    const int64_t *mask = a[9].u.ints;
    if (mask[0])
        ag__tmeta_contiguous(&o[0], x->dtype, x->ndim, x->sizes);
    else
        meta_unused(&o[0], x->dtype);
    for (int k = 1; k < 3; k++) {
        if (mask[k])
            ag__tmeta_contiguous(&o[k], x->dtype, 1, &C);
        else
            meta_unused(&o[k], x->dtype);
    }
    return 0;
}

/* g, x, gx are (N, C, S) contiguous. Per channel, with xhat = (x - mean) * invstd:
 *   training:   gx = (g - mean(g) - xhat * mean(g * xhat)) * invstd * w
 *   evaluation: gx = g * invstd * w
 * and gw = sum(g * xhat), gb = sum(g). In evaluation the statistics are the running ones when
 * given (ATen), else save_mean/save_invstd as our forward returns them. */
/* With rlv (the fused threshold_backward+batch_norm_backward), g is threshold_backward(g, rl,
 * threshold) computed on the fly. */
static int bn_bwd(ag_dtype dt, const void *gv, const void *xv, const void *rlv, double threshold,
                  chan w, chan rm, chan rv, chan sm, chan si, void *gxv, void *gwv, void *gbv,
                  int64_t N, int64_t C, int64_t S, bool train, double eps) {
    const double count = (double)(N * S);
    const bool par = C > 1 && N * C * S >= AG__PAR_MIN;
    AG__FLOAT_SWITCH(dt, T, {
        const T *g = gv, *x = xv, *rl = rlv;
        const T th = (T)threshold;
        T *gx = gxv, *gw = gwv, *gb = gbv;
        _Pragma("omp parallel for schedule(static) if (par)") for (int64_t c = 0; c < C; c++) {
            double mean, invstd;
            if (train || !rm.p) {
                mean = ((const T *)sm.p)[c * sm.stride];
                invstd = ((const T *)si.p)[c * si.stride];
            } else {
                mean = ((const T *)rm.p)[c * rm.stride];
                invstd = 1.0 / sqrt((double)((const T *)rv.p)[c * rv.stride] + eps);
            }
            double sg, sgx;
            bn_gsums(g + c * S, x + c * S, rl ? rl + c * S : NULL, th, N, C * S, S, mean, &sg,
                     &sgx);
            sgx *= invstd;
            if (gx) {
                const double wc = w.p ? (double)((const T *)w.p)[c * w.stride] : 1.0;
                const double k1 = train ? sg / count : 0, k2 = train ? sgx / count : 0;
                typedef T tv __attribute__((vector_size(8 * sizeof(T))));
                typedef long long vl __attribute__((vector_size(8 * sizeof(long long))));
                for (int64_t n = 0; n < N; n++) {
                    const int64_t i0 = (n * C + c) * S, i1 = i0 + S;
                    int64_t i = i0;
                    for (; i + 8 <= i1; i += 8) {
                        bn_vd gi8 = bn_vload(g + i);
                        if (rl)
                            gi8 = (bn_vd)((vl)gi8 & ~(vl)(bn_vload(rl + i) <= (double)th));
                        const bn_vd xh = (bn_vload(x + i) - mean) * invstd;
                        const tv r =
                            __builtin_convertvector((gi8 - k1 - xh * k2) * invstd * wc, tv);
                        memcpy(gx + i, &r, sizeof r);
                    }
                    for (; i < i1; i++) {
                        const double xh = (x[i] - mean) * invstd;
                        const T gi = rl && rl[i] <= th ? (T)0 : g[i];
                        gx[i] = (T)((gi - k1 - xh * k2) * invstd * wc);
                    }
                }
            }
            if (gw)
                gw[c] = (T)sgx;
            if (gb)
                gb[c] = (T)sg;
        }
    });
    return 0;
}

static int bnb_kernel(const ag_arg *a, ag_tensor **o) {
    ag_tensor *g = a[0].u.t, *x = a[1].u.t;
    ag__scratch_tensor tg, tx;
    const int64_t *mask = a[9].u.ints;
    const void *pg = pack(g, &tg, 1), *px = pack(x, &tx, 2);
    int rc;
    if (!pg || !px) {
        rc = ag_last_status();
    } else {
        const int64_t N = x->sizes[0], C = x->sizes[1], S = ag__numel(x->ndim - 2, x->sizes + 2);
        rc = bn_bwd(x->dtype, pg, px, NULL, 0, chan_of(targ(&a[2])), chan_of(targ(&a[3])),
                    chan_of(targ(&a[4])), chan_of(targ(&a[5])), chan_of(targ(&a[6])),
                    mask[0] ? data_of(o[0]) : NULL, mask[1] ? data_of(o[1]) : NULL,
                    mask[2] ? data_of(o[2]) : NULL, N, C, S, a[7].u.b, a[8].u.f);
    }
    return rc;
}

static void bnb_cost(const ag_arg *a, const ag_tmeta *o, int nouts, ag_cost *c) {
    c->flops = 10.0 * (double)ag_tensor_numel(a[1].u.t);
    c->bytes = io_bytes(a, 7, o, nouts);
}

/* native_batch_norm_backward with xhat = (x - mean) * invstd, the statistics save_mean and
 * save_invstd (in evaluation the running ones when given, as the kernel): grad_weight =
 * sum(g * xhat), grad_bias = sum(g) over every dim but 1, and grad_input = (g - (sum(g) + xhat
 * * sum(g * xhat)) / count) * invstd * weight in training, g * invstd * weight in evaluation.
 * An output the mask leaves out is an empty tensor, as the meta gives it. */
static int bnb_decomp(const ag_arg *a, ag_tensor **o) {
    ag_tensor *g = a[0].u.t, *x = a[1].u.t, *w = targ(&a[2]);
    ag_tensor *rm = targ(&a[3]), *rv = targ(&a[4]), *sm = targ(&a[5]), *si = targ(&a[6]);
    const bool train = a[7].u.b;
    const double eps = a[8].u.f;
    const int64_t *mask = a[9].u.ints;
    int64_t dims[AG_MAX_DIMS], bshape[AG_MAX_DIMS], zero = 0;
    int nd = bn_dims(x, dims, bshape);
    const double count = (double)bn_count(x);
    ag_tensor *mean, *invstd;
    if (train || !rm) {
        mean = sm;
        invstd = si;
    } else {
        mean = rm;
        invstd = ag_rsqrt(ag_add_scalar(rv, eps));
    }
    ag_tensor *xhat = ag_mul(ag_sub(x, bn_bcast(mean, x, bshape)), bn_bcast(invstd, x, bshape));
    /* [1, C, 1, ...]; read first by the ops below, not linear in them. */
    ag_tensor *sg = ag_sum(g, dims, nd, true);
    ag_tensor *sgx = ag_sum(ag_mul(g, xhat), dims, nd, true);
    if (mask[0]) {
        ag_tensor *scale = bn_bcast(w ? ag_mul(invstd, w) : invstd, x, bshape);
        ag_tensor *gc = g;
        if (train)
            gc = ag_sub(g, ag_div_scalar(ag_add(sg, ag_mul(xhat, sgx)), count));
        o[0] = ag_mul(gc, scale);
    } else {
        o[0] = ag_zeros(x->dtype, 1, &zero);
    }
    const int64_t C = x->sizes[1];
    o[1] = mask[1] ? ag_view(sgx, 1, &C) : ag_zeros(x->dtype, 1, &zero);
    o[2] = mask[2] ? ag_view(sg, 1, &C) : ag_zeros(x->dtype, 1, &zero);
    for (int k = 0; k < 3; k++)
        if (!o[k])
            return ag_last_status();
    return 0;
}

static const ag_opdef op_native_batch_norm_backward = {
    .schema = "native_batch_norm_backward(Tensor grad_out, Tensor input, Tensor? weight, "
              "Tensor? running_mean, Tensor? running_var, Tensor? save_mean, "
              "Tensor? save_invstd, bool train, float eps, bool[3] output_mask) "
              "-> (Tensor, Tensor, Tensor)",
    .flags = AG_OP_BACKWARD_HELPER | AG_OP_NONDIFF,
    .meta = bnb_meta,
    .kernel = bnb_kernel,
    .dtypes = AG_DT_FLOAT,
    .cost = bnb_cost,
    .shard = ag__shard_batch_norm_backward,
    .decomp = bnb_decomp,
};

/* ---- batch norm fused with its relu (src/runtime/fuse.c) ---- */

int ag__fused_batch_norm_relu(const ag_arg *a, ag_tensor *const *o, ag_tensor *z, bool write_y) {
    int rc = ag__copy_into(o[3], a[3].u.t);
    if (!rc)
        rc = ag__copy_into(o[4], a[4].u.t);
    if (rc)
        return rc;
    ag_tensor *x = a[0].u.t;
    ag__scratch_tensor tx;
    const void *px = pack(x, &tx, 1);
    if (!px)
        return ag_last_status();
    const int64_t N = x->sizes[0], C = x->sizes[1], S = ag__numel(x->ndim - 2, x->sizes + 2);
    return bn_fwd(x->dtype, px, chan_of(targ(&a[1])), chan_of(targ(&a[2])), chan_of(o[3]),
                  chan_of(o[4]), write_y ? data_of(o[0]) : NULL, data_of(z), data_of(o[1]),
                  data_of(o[2]), N, C, S, a[5].u.b, a[6].u.f, a[7].u.f);
}

int ag__fused_threshold_batch_norm_backward(const ag_arg *t, const ag_arg *b, ag_tensor *const *o) {
    ag_tensor *x = b[1].u.t;
    ag__scratch_tensor tx;
    const void *px = pack(x, &tx, 1);
    if (!px)
        return ag_last_status();
    const int64_t *mask = b[9].u.ints;
    const int64_t N = x->sizes[0], C = x->sizes[1], S = ag__numel(x->ndim - 2, x->sizes + 2);
    return bn_bwd(x->dtype, data_of(t[0].u.t), px, data_of(t[1].u.t), t[2].u.f,
                  chan_of(targ(&b[2])), chan_of(targ(&b[3])), chan_of(targ(&b[4])),
                  chan_of(targ(&b[5])), chan_of(targ(&b[6])), mask[0] ? data_of(o[0]) : NULL,
                  mask[1] ? data_of(o[1]) : NULL, mask[2] ? data_of(o[2]) : NULL, N, C, S, b[7].u.b,
                  b[8].u.f);
}

int ag_native_batch_norm(ag_tensor *x, ag_tensor *weight, ag_tensor *bias, ag_tensor *running_mean,
                         ag_tensor *running_var, bool training, double momentum, double eps,
                         ag_tensor **out, ag_tensor **save_mean, ag_tensor **save_invstd) {
    AG__OP(op, "native_batch_norm");
    ag_arg args[] = {AG_A_T(x),           AG_A_T(weight),   AG_A_T(bias),     AG_A_T(running_mean),
                     AG_A_T(running_var), AG_A_B(training), AG_A_F(momentum), AG_A_F(eps)};
    return call_outs(op, args, 8, (ag_tensor * *const[]){out, save_mean, save_invstd}, 3);
}

const ag_opdef *const ag__ops_norm[] = {
    &op_native_batch_norm_functional,
    &op_native_layer_norm,
    &op_native_layer_norm_backward,
    &op_layer_norm,
    &op_native_batch_norm,
    &op_native_batch_norm_backward,
    NULL,
};
