/* Convolution and pooling on NCHW tensors: convolution (2-d, not transposed) with its ATen
 * backward helper convolution_backward, max_pool2d_with_indices (+ _backward), avg_pool2d
 * (+ _backward) and _adaptive_avg_pool2d (+ _backward).
 *
 * convolution runs as im2col + GEMM per image and group: the (C/G*kh*kw, OH*OW) column matrix
 * of an image group times the group's (O/G, C/G*kh*kw) weight gives its (O/G, OH*OW) output.
 * Images are spread over OpenMP threads, each with its own column buffer, while BLAS runs
 * single-threaded inside the parallel region; a batch of one leaves the threading to BLAS.
 * 1x1 convolutions with stride 1 and no padding skip im2col (the image is its own column
 * matrix); at unit stride im2col copies a "same"-width plane as one shifted piece, and with
 * AVX-512 im2col and col2im move their short rows with masked register loads and stores (col2im
 * summing a row's taps in a register). max_pool2d's 2x2 window at stride 2 has a vector path. The
 * typed loops live in conv_kernels.inc, included once per float type. Column buffers and contiguous
 * copies of strided inputs are per-thread scratch (ag__scratch; slots in src/core/scratch.c), taken
 * before the parallel regions, so repeated calls allocate nothing but their outputs.
 *
 * The backward rules call the ATen helper ops (convolution_backward with the output mask taken
 * from which inputs need a gradient, max_pool2d_with_indices_backward, ...) so traced backward
 * graphs read like PyTorch's. */
#include "../core/kernel_util.h"
#include "family.h"
#include "shard_rules.h"

#include <cblas.h>
#include <math.h>
#include <omp.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* Element [0, ...] of t as an untyped pointer, for the typed kernels. */
static inline void *dptr(const ag_tensor *t) {
    return ag__base(t);
}

static inline int64_t imin(int64_t a, int64_t b) {
    return a < b ? a : b;
}
static inline int64_t imax(int64_t a, int64_t b) {
    return a > b ? a : b;
}

/* Floor division (ATen's div_rtn) for possibly negative numerators. */
static inline int64_t div_floor(int64_t a, int64_t b) {
    int64_t q = a / b, r = a % b;
    return (r != 0 && ((r < 0) != (b < 0))) ? q - 1 : q;
}

static inline int64_t adaptive_start(int64_t o, int64_t osize, int64_t isize) {
    return (o / osize) * isize + ((o % osize) * isize) / osize;
}

static inline int64_t adaptive_end(int64_t o, int64_t osize, int64_t isize) {
    return 1 + ((o + 1) * isize - 1) / osize;
}

/* Geometry of a convolution: x (N, C, H, W), weight (O, C/groups, kh, kw), out (N, O, OH, OW). */
typedef struct conv_geom {
    int64_t N, C, H, W, O, kh, kw, OH, OW;
    int64_t sh, sw, ph, pw, dh, dw, groups;
} conv_geom;

/* Geometry of a 2-d pooling over `planes` planes of H x W. divisor 0: none. */
typedef struct pool_geom {
    int64_t planes, H, W, OH, OW;
    int64_t kh, kw, sh, sw, ph, pw, dh, dw;
    bool ceil_mode, count_include_pad;
    int64_t divisor;
} pool_geom;

static inline bool conv_is_pointwise(const conv_geom *g) {
    return g->kh == 1 && g->kw == 1 && g->sh == 1 && g->sw == 1 && g->ph == 0 && g->pw == 0;
}

/* The output positions [lo, hi) of a row whose input column ow*stride + off lies in [0, W). */
static inline void tap_range(int64_t OW, int64_t W, int64_t stride, int64_t off, int64_t *lo,
                             int64_t *hi) {
    int64_t l = off >= 0 ? 0 : (-off + stride - 1) / stride;
    int64_t h = W - 1 - off < 0 ? 0 : (W - 1 - off) / stride + 1;
    l = imin(l, OW);
    h = imin(h, OW);
    *lo = l;
    *hi = imax(h, l);
}

#define T float
#define TI int32_t
#define SUF f32
#define GEMM cblas_sgemm
#include "conv_kernels.inc"
#undef T
#undef TI
#undef SUF
#undef GEMM

#define T double
#define TI int64_t
#define SUF f64
#define GEMM cblas_dgemm
#include "conv_kernels.inc"
#undef T
#undef TI
#undef SUF
#undef GEMM

/* ---- argument helpers ---- */

/* An int list of 1 or 2 entries read as (h, w); an empty or absent list gives dflt (when dflt is
 * NULL, empty is an error). */
static int pair_arg(const char *op, const char *name, const ag_arg *a, const int64_t *dflt,
                    int64_t out[2]) {
    int n = a->kind == AG_ARG_INTS ? a->n : 0;
    /* Window arithmetic (in + 2*pad - dil*(k-1) ...) must not overflow on untrusted values. */
    for (int i = 0; i < n; i++)
        if (a->u.ints[i] > ((int64_t)1 << 31) || a->u.ints[i] < -((int64_t)1 << 31))
            return ag__err(AG_EINVAL, "%s: %s value %lld is out of range", op, name,
                           (long long)a->u.ints[i]);
    if (n == 0 && dflt) {
        out[0] = dflt[0];
        out[1] = dflt[1];
        return 0;
    }
    if (n == 1) {
        out[0] = out[1] = a->u.ints[0];
        return 0;
    }
    if (n == 2) {
        out[0] = a->u.ints[0];
        out[1] = a->u.ints[1];
        return 0;
    }
    return ag__err(AG_EINVAL, "%s: %s must have 1 or 2 elements, got %d", op, name, n);
}

/* `t` itself when contiguous (or NULL), else a contiguous copy in *tmp over scratch slot
 * `slot` (nothing to free). */
static int contiguous_of(const ag_tensor *t, ag__scratch_tensor *tmp, int slot,
                         const ag_tensor **out) {
    return ag__scratch_contiguous(tmp, slot, t, out);
}

static void drop(ag_tensor *t) {
    if (!ag__in_scope())
        ag_tensor_free(t);
}

/* ---- convolution ---- */

/* Checks input and weight and the conv arguments a[0..5] = stride, padding, dilation,
 * transposed, output_padding, groups (the same order in convolution and its backward). */
static int conv_geometry(const char *op, const ag_tensor *x, const ag_tensor *w, const ag_arg *a,
                         conv_geom *g) {
    char p[128], q[128];
    if (x->ndim != 4)
        return ag__err(AG_EINVAL, "%s: expected a 4-d input (N, C, H, W), got %s", op,
                       ag__fmt_sizes(p, sizeof p, x->ndim, x->sizes));
    if (a[3].u.b)
        return ag__err(AG_ENOTSUP, "%s: transposed convolution is not supported", op);
    if (x->dtype != w->dtype)
        return ag__err(AG_EINVAL, "%s: input (%s) and weight (%s) must have the same dtype", op,
                       ag_dtype_short(x->dtype), ag_dtype_short(w->dtype));
    int64_t stride[2] = {0, 0}, pad[2] = {0, 0}, dil[2] = {0, 0};
    int rc = pair_arg(op, "stride", &a[0], NULL, stride);
    if (!rc)
        rc = pair_arg(op, "padding", &a[1], NULL, pad);
    if (!rc)
        rc = pair_arg(op, "dilation", &a[2], NULL, dil);
    if (rc)
        return rc;
    int64_t groups = a[5].u.i;
    if (groups < 1)
        return ag__err(AG_EINVAL, "%s: groups must be positive, got %lld", op, (long long)groups);
    if (stride[0] < 1 || stride[1] < 1 || dil[0] < 1 || dil[1] < 1 || pad[0] < 0 || pad[1] < 0)
        return ag__err(AG_EINVAL,
                       "%s: expected positive stride and dilation and non-negative padding, got "
                       "stride (%lld, %lld), padding (%lld, %lld), dilation (%lld, %lld)",
                       op, (long long)stride[0], (long long)stride[1], (long long)pad[0],
                       (long long)pad[1], (long long)dil[0], (long long)dil[1]);
    int64_t C = x->sizes[1];
    if (C % groups)
        return ag__err(AG_EINVAL, "%s: input channels %lld are not divisible by groups %lld", op,
                       (long long)C, (long long)groups);
    if (w->ndim != 4 || w->sizes[1] != C / groups || w->sizes[0] % groups || w->sizes[0] < 1 ||
        w->sizes[2] < 1 || w->sizes[3] < 1)
        return ag__err(AG_EINVAL,
                       "%s: expected weight of shape (O, C/groups, kh, kw) = (O, %lld, kh, kw) "
                       "with O divisible by groups %lld, for input %s; got %s",
                       op, (long long)(C / groups), (long long)groups,
                       ag__fmt_sizes(p, sizeof p, x->ndim, x->sizes),
                       ag__fmt_sizes(q, sizeof q, w->ndim, w->sizes));
    *g = (conv_geom){.N = x->sizes[0],
                     .C = C,
                     .H = x->sizes[2],
                     .W = x->sizes[3],
                     .O = w->sizes[0],
                     .kh = w->sizes[2],
                     .kw = w->sizes[3],
                     .sh = stride[0],
                     .sw = stride[1],
                     .ph = pad[0],
                     .pw = pad[1],
                     .dh = dil[0],
                     .dw = dil[1],
                     .groups = groups};
    int64_t eh = g->dh * (g->kh - 1) + 1, ew = g->dw * (g->kw - 1) + 1;
    int64_t ih = g->H + 2 * g->ph, iw = g->W + 2 * g->pw;
    if (ih < eh || iw < ew)
        return ag__err(AG_EINVAL,
                       "%s: padded input size (%lld x %lld) is smaller than the dilated kernel "
                       "(%lld x %lld)",
                       op, (long long)ih, (long long)iw, (long long)eh, (long long)ew);
    g->OH = (ih - eh) / g->sh + 1;
    g->OW = (iw - ew) / g->sw + 1;
    return 0;
}

static int conv_meta(const ag_arg *a, ag_tmeta *o) {
    const ag_tensor *x = a[0].u.t, *w = a[1].u.t;
    const ag_tensor *b = a[2].kind == AG_ARG_TENSOR ? a[2].u.t : NULL;
    conv_geom g = {0};
    int rc = conv_geometry("convolution", x, w, &a[3], &g);
    if (rc)
        return rc;
    if (b && (b->ndim != 1 || b->sizes[0] != g.O || b->dtype != x->dtype)) {
        char p[128];
        return ag__err(AG_EINVAL,
                       "convolution: expected a bias of shape [%lld] and dtype %s, got "
                       "%s %s",
                       (long long)g.O, ag_dtype_short(x->dtype), ag_dtype_short(b->dtype),
                       ag__fmt_sizes(p, sizeof p, b->ndim, b->sizes));
    }
    ag__tmeta_contiguous(o, x->dtype, 4, (int64_t[]){g.N, g.O, g.OH, g.OW});
    return 0;
}

/* Threads for a loop over N images: all of them when there are enough images. */
static int batch_threads(int64_t N) {
    int n = omp_get_max_threads();
    return (int)(N < n ? (N < 1 ? 1 : N) : n);
}

static int64_t conv_cols_elems(const conv_geom *g) {
    return conv_is_pointwise(g) ? 0 : (g->C / g->groups) * g->kh * g->kw * g->OH * g->OW;
}

static int conv_kernel(const ag_arg *a, ag_tensor **o) {
    const ag_tensor *b = a[2].kind == AG_ARG_TENSOR ? a[2].u.t : NULL;
    conv_geom g = {0};
    int rc = conv_geometry("convolution", a[0].u.t, a[1].u.t, &a[3], &g);
    if (rc)
        return rc;
    ag_tensor *out = o[0];
    if (ag_tensor_numel(out) == 0)
        return 0;
    ag__scratch_tensor tx, tw;
    const ag_tensor *x = NULL, *w = NULL;
    rc = contiguous_of(a[0].u.t, &tx, 1, &x);
    if (!rc)
        rc = contiguous_of(a[1].u.t, &tw, 2, &w);
    int nthr = batch_threads(g.N);
    int64_t ce = conv_cols_elems(&g);
    void *scratch = NULL;
    size_t es = ag_dtype_size(out->dtype);
    if (!rc) {
        scratch = ag__scratch(0, (size_t)(ce * nthr) * es + es);
        if (!scratch)
            rc = AG_ENOMEM;
    }
    if (!rc) {
        const void *bp = b ? dptr(b) : NULL;
        int64_t bs = b ? b->strides[0] : 0;
        if (out->dtype == AG_F32)
            conv_forward_f32(dptr(x), dptr(w), bp, bs, dptr(out), scratch, ce, nthr, &g);
        else
            conv_forward_f64(dptr(x), dptr(w), bp, bs, dptr(out), scratch, ce, nthr, &g);
    }
    return rc;
}

static int conv_backward(ag_bwctx *c) {
    ag_tensor *g = c->grad_outputs[0];
    ag_tensor *w = c->args[1].u.t;
    /* bias was given iff its argument is a tensor slot (None stays AG_ARG_NONE). */
    bool has_bias = c->args[2].kind == AG_ARG_TENSOR;
    int64_t bias_sizes[1] = {w->sizes[0]};
    int64_t mask[3] = {c->needs_grad[0], c->needs_grad[1], has_bias && c->needs_grad[2]};
    AG__OP(op, "convolution_backward");
    ag_arg args[11] = {
        AG_A_T(g),  c->args[0], c->args[1],        has_bias ? AG_A_INTS(bias_sizes, 1) : AG_A_NONE,
        c->args[3], c->args[4], c->args[5],        c->args[6],
        c->args[7], c->args[8], AG_A_INTS(mask, 3)};
    ag_tensor *outs[3];
    int rc = ag__calln(op, args, 11, outs, 3);
    if (rc < 0)
        return rc;
    for (int j = 0; j < 3; j++)
        if (c->needs_grad[j] && mask[j])
            c->grad_inputs[j] = outs[j];
    return 0;
}

static void conv_cost(const ag_arg *a, const ag_tmeta *o, int n, ag_cost *c) {
    const ag_tensor *x = a[0].u.t, *w = a[1].u.t;
    double outn = (double)ag__numel(o[0].ndim, o[0].sizes);
    double k = (double)(w->sizes[1] * w->sizes[2] * w->sizes[3]);
    double es = (double)ag_dtype_size(x->dtype);
    bool bias = a[2].kind == AG_ARG_TENSOR;
    c->flops = 2.0 * outn * k + (bias ? outn : 0);
    c->bytes = ((double)ag_tensor_numel(x) + (double)ag_tensor_numel(w) + outn +
                (bias ? (double)w->sizes[0] : 0)) *
               es;
}

static void conv_samples(ag_samples *s) {
    int64_t x1[] = {2, 4, 7, 7}, w1[] = {6, 2, 3, 3}, b1[] = {6};
    int64_t x2[] = {2, 3, 4, 4}, w2[] = {5, 3, 1, 1};
    int64_t x3[] = {2, 2, 5, 6}, w3[] = {3, 2, 2, 3}, b3[] = {3};
    int64_t one[] = {1, 1}, zero[] = {0, 0}, two[] = {2, 2}, s3[] = {1, 2}, p3[] = {1, 0};
    ag_samples_add(s, "groups 2, stride 2, padding 1, dilation 2",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 4, x1, -1, 1)),
                              AG_A_T(ag_samples_rand(s, 4, w1, -1, 1)),
                              AG_A_T(ag_samples_rand(s, 1, b1, -1, 1)), AG_A_INTS(two, 2),
                              AG_A_INTS(one, 2), AG_A_INTS(two, 2), AG_A_B(false),
                              AG_A_INTS(zero, 2), AG_A_I(2)},
                   9);
    ag_samples_add(s, "1x1, no bias",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 4, x2, -1, 1)),
                              AG_A_T(ag_samples_rand(s, 4, w2, -1, 1)), AG_A_NONE,
                              AG_A_INTS(one, 2), AG_A_INTS(zero, 2), AG_A_INTS(one, 2),
                              AG_A_B(false), AG_A_INTS(zero, 2), AG_A_I(1)},
                   9);
    ag_samples_add(s, "strided input, stride (1, 2), padding (1, 0)",
                   (ag_arg[]){AG_A_T(ag_samples_rand_strided(s, 4, x3, -1, 1)),
                              AG_A_T(ag_samples_rand(s, 4, w3, -1, 1)),
                              AG_A_T(ag_samples_rand(s, 1, b3, -1, 1)), AG_A_INTS(s3, 2),
                              AG_A_INTS(p3, 2), AG_A_INTS(one, 2), AG_A_B(false),
                              AG_A_INTS(zero, 2), AG_A_I(1)},
                   9);
}

static const ag_opdef op_convolution = {
    .schema = "convolution(Tensor input, Tensor weight, Tensor? bias, int[] stride, int[] padding, "
              "int[] dilation, bool transposed, int[] output_padding, int groups) -> Tensor",
    .flags = AG_OP_COMPUTE_INTENSIVE,
    .meta = conv_meta,
    .kernel = conv_kernel,
    .dtypes = AG_DT_FLOAT,
    .backward = conv_backward,
    .save_args = 0x3,
    .cost = conv_cost,
    .samples = conv_samples,
    .shard = ag__shard_convolution,
};

ag_tensor *ag_conv2d(ag_tensor *x, ag_tensor *w, ag_tensor *b, const int64_t stride[2],
                     const int64_t padding[2], const int64_t dilation[2], int64_t groups) {
    AG__OP(op, "convolution");
    static const int64_t one[2] = {1, 1}, zero[2] = {0, 0};
    ag_arg args[9] = {AG_A_T(x),
                      AG_A_T(w),
                      AG_A_T(b),
                      AG_A_INTS(stride ? stride : one, 2),
                      AG_A_INTS(padding ? padding : zero, 2),
                      AG_A_INTS(dilation ? dilation : one, 2),
                      AG_A_B(false),
                      AG_A_INTS(zero, 2),
                      AG_A_I(groups)};
    return ag__call1(op, args, 9);
}

/* ---- convolution_backward: (grad_input, grad_weight, grad_bias) per output_mask ---- */

/* Outputs that were not asked for are 0-element tensors ([0]); the entry point gives NULL. */
static int conv_bw_meta(const ag_arg *a, ag_tmeta *o) {
    const ag_tensor *go = a[0].u.t, *x = a[1].u.t, *w = a[2].u.t;
    conv_geom g = {0};
    int rc = conv_geometry("convolution_backward", x, w, &a[4], &g);
    if (rc)
        return rc;
    char p[128], q[128];
    int64_t want[4] = {g.N, g.O, g.OH, g.OW};
    if (go->ndim != 4 || memcmp(go->sizes, want, sizeof want) || go->dtype != x->dtype)
        return ag__err(AG_EINVAL, "convolution_backward: grad_output is %s %s, expected %s %s",
                       ag_dtype_short(go->dtype), ag__fmt_sizes(p, sizeof p, go->ndim, go->sizes),
                       ag_dtype_short(x->dtype), ag__fmt_sizes(q, sizeof q, 4, want));
    if (a[3].kind == AG_ARG_INTS && (a[3].n != 1 || a[3].u.ints[0] != g.O))
        return ag__err(AG_EINVAL, "convolution_backward: bias_sizes must be [%lld], got %s",
                       (long long)g.O, ag__fmt_sizes(p, sizeof p, a[3].n, a[3].u.ints));
    if (a[10].n != 3)
        return ag__err(AG_EINVAL, "convolution_backward: output_mask must have 3 elements, got %d",
                       a[10].n);
    const int64_t *mask = a[10].u.ints;
    int64_t empty[1] = {0};
    ag__tmeta_contiguous(&o[0], x->dtype, mask[0] ? 4 : 1, mask[0] ? x->sizes : empty);
    ag__tmeta_contiguous(&o[1], x->dtype, mask[1] ? 4 : 1, mask[1] ? w->sizes : empty);
    ag__tmeta_contiguous(&o[2], x->dtype, 1, mask[2] ? &g.O : empty);
    return 0;
}

static int conv_bw_kernel(const ag_arg *a, ag_tensor **o) {
    conv_geom g = {0};
    int rc = conv_geometry("convolution_backward", a[1].u.t, a[2].u.t, &a[4], &g);
    if (rc)
        return rc;
    const int64_t *mask = a[10].u.ints;
    bool want_gx = mask[0] && ag_tensor_numel(o[0]) > 0;
    bool want_gw = mask[1] && ag_tensor_numel(o[1]) > 0;
    bool want_gb = mask[2] && ag_tensor_numel(o[2]) > 0;
    ag_dtype dt = a[1].u.t->dtype;
    size_t es = ag_dtype_size(dt);
    int64_t P = g.OH * g.OW;
    if (want_gw && g.N * P == 0)
        memset(dptr(o[1]), 0, es * (size_t)ag_tensor_numel(o[1]));
    if (want_gb && g.N * P == 0)
        memset(dptr(o[2]), 0, es * (size_t)ag_tensor_numel(o[2]));
    if (g.N * P == 0) {
        if (want_gx)
            memset(dptr(o[0]), 0, es * (size_t)ag_tensor_numel(o[0]));
        return 0;
    }
    ag__scratch_tensor tgo, tx, tw;
    const ag_tensor *go = NULL, *x = NULL, *w = NULL;
    rc = contiguous_of(a[0].u.t, &tgo, 1, &go);
    if (!rc)
        rc = contiguous_of(want_gw ? a[1].u.t : NULL, &tx, 2, &x);
    if (!rc)
        rc = contiguous_of(want_gx ? a[2].u.t : NULL, &tw, 3, &w);
    void *scratch = NULL;
    if (!rc && (want_gx || want_gw)) {
        int nthr = batch_threads(g.N);
        int64_t ce = conv_cols_elems(&g);
        int64_t ok = g.O * (g.C / g.groups) * g.kh * g.kw;
        size_t elems = (size_t)(2 * ce * nthr + (want_gw ? ok * (nthr - 1) : 0));
        scratch = ag__scratch(0, elems * es + es);
        if (!scratch)
            rc = AG_ENOMEM;
        if (!rc) {
            const void *xp = want_gw ? dptr(x) : NULL, *wp = want_gx ? dptr(w) : NULL;
            void *gx = want_gx ? dptr(o[0]) : NULL, *gw = want_gw ? dptr(o[1]) : NULL;
            if (dt == AG_F32)
                conv_backward_f32(dptr(go), xp, wp, gx, gw, scratch, ce, nthr, &g);
            else
                conv_backward_f64(dptr(go), xp, wp, gx, gw, scratch, ce, nthr, &g);
        }
    }
    if (!rc && want_gb) {
        if (dt == AG_F32)
            bias_grad_f32(dptr(go), dptr(o[2]), g.N, g.O, P);
        else
            bias_grad_f64(dptr(go), dptr(o[2]), g.N, g.O, P);
    }
    return rc;
}

static void conv_bw_cost(const ag_arg *a, const ag_tmeta *o, int n, ag_cost *c) {
    const ag_tensor *go = a[0].u.t, *x = a[1].u.t, *w = a[2].u.t;
    const int64_t *mask = a[10].u.ints;
    double gon = (double)ag_tensor_numel(go);
    double k = (double)(w->sizes[1] * w->sizes[2] * w->sizes[3]);
    double es = (double)ag_dtype_size(x->dtype);
    c->flops = (mask[0] ? 2.0 * gon * k : 0) + (mask[1] ? 2.0 * gon * k : 0) + (mask[2] ? gon : 0);
    c->bytes = gon * es;
    if (mask[0])
        c->bytes += ((double)ag_tensor_numel(w) + (double)ag_tensor_numel(x)) * es;
    if (mask[1])
        c->bytes += ((double)ag_tensor_numel(x) + (double)ag_tensor_numel(w)) * es;
    if (mask[2])
        c->bytes += (double)w->sizes[0] * es;
}

static const ag_opdef op_convolution_backward = {
    .schema = "convolution_backward(Tensor grad_output, Tensor input, Tensor weight, "
              "int[]? bias_sizes, int[] stride, int[] padding, int[] dilation, bool transposed, "
              "int[] output_padding, int groups, bool[3] output_mask) -> (Tensor, Tensor, Tensor)",
    .flags = AG_OP_BACKWARD_HELPER | AG_OP_COMPUTE_INTENSIVE | AG_OP_NONDIFF,
    .meta = conv_bw_meta,
    .kernel = conv_bw_kernel,
    .dtypes = AG_DT_FLOAT,
    .cost = conv_bw_cost,
    .shard = ag__shard_convolution_backward,
};

int ag_convolution_backward(ag_tensor *grad, ag_tensor *x, ag_tensor *w, const int64_t *bias_sizes,
                            const int64_t stride[2], const int64_t padding[2],
                            const int64_t dilation[2], int64_t groups, const bool output_mask[3],
                            ag_tensor **outs) {
    AG__CHECK_NULL("convolution_backward", grad);
    AG__CHECK_NULL("convolution_backward", x);
    AG__CHECK_NULL("convolution_backward", w);
    AG__CHECK_NULL("convolution_backward", outs);
    AG__OP(op, "convolution_backward");
    static const int64_t one[2] = {1, 1}, zero[2] = {0, 0};
    int64_t mask[3];
    for (int i = 0; i < 3; i++)
        mask[i] = output_mask ? output_mask[i] : 1;
    ag_arg args[11] = {AG_A_T(grad),
                       AG_A_T(x),
                       AG_A_T(w),
                       bias_sizes ? AG_A_INTS(bias_sizes, 1) : AG_A_NONE,
                       AG_A_INTS(stride ? stride : one, 2),
                       AG_A_INTS(padding ? padding : zero, 2),
                       AG_A_INTS(dilation ? dilation : one, 2),
                       AG_A_B(false),
                       AG_A_INTS(zero, 2),
                       AG_A_I(groups),
                       AG_A_INTS(mask, 3)};
    int rc = ag__calln(op, args, 11, outs, 3);
    if (rc < 0)
        return rc;
    for (int i = 0; i < 3; i++)
        if (!mask[i]) {
            drop(outs[i]);
            outs[i] = NULL;
        }
    return 0;
}

/* ---- pooling geometry ---- */

/* ATen's pooling_output_shape: in ceil mode the last window must start inside the input or
 * its left padding. */
static int64_t pool_out_size(int64_t in, int64_t k, int64_t pad, int64_t stride, int64_t dil,
                             bool ceil_mode) {
    int64_t o =
        div_floor(in + 2 * pad - dil * (k - 1) - 1 + (ceil_mode ? stride - 1 : 0), stride) + 1;
    if (ceil_mode && (o - 1) * stride >= in + pad)
        o--;
    return o;
}

/* Validates a pooling call on x (C, H, W) or (N, C, H, W); `dil` may be NULL (dilation 1). */
static int pool_geometry(const char *op, const ag_tensor *x, const ag_arg *kernel,
                         const ag_arg *stride, const ag_arg *pad, const ag_arg *dil, bool ceil_mode,
                         pool_geom *p) {
    char s[128];
    if ((x->ndim != 3 && x->ndim != 4) || x->sizes[x->ndim - 1] == 0 ||
        x->sizes[x->ndim - 2] == 0 || x->sizes[x->ndim - 3] == 0)
        return ag__err(AG_EINVAL,
                       "%s: expected a 3-d (C, H, W) or 4-d (N, C, H, W) input with "
                       "non-zero C, H and W, got %s",
                       op, ag__fmt_sizes(s, sizeof s, x->ndim, x->sizes));
    int64_t k[2] = {0, 0}, st[2] = {0, 0}, pd[2] = {0, 0}, dl[2] = {1, 1};
    int rc = pair_arg(op, "kernel_size", kernel, NULL, k);
    if (!rc)
        rc = pair_arg(op, "stride", stride, k, st);
    if (!rc)
        rc = pair_arg(op, "padding", pad, (int64_t[]){0, 0}, pd);
    if (!rc && dil)
        rc = pair_arg(op, "dilation", dil, dl, dl);
    if (rc)
        return rc;
    if (k[0] < 1 || k[1] < 1)
        return ag__err(AG_EINVAL,
                       "%s: kernel size should be greater than zero, but got kH: %lld, "
                       "kW: %lld",
                       op, (long long)k[0], (long long)k[1]);
    if (st[0] < 1 || st[1] < 1)
        return ag__err(AG_EINVAL,
                       "%s: stride should be greater than zero, but got sH: %lld, "
                       "sW: %lld",
                       op, (long long)st[0], (long long)st[1]);
    if (dl[0] < 1 || dl[1] < 1)
        return ag__err(AG_EINVAL,
                       "%s: dilation should be greater than zero, but got dH: %lld, "
                       "dW: %lld",
                       op, (long long)dl[0], (long long)dl[1]);
    if (pd[0] < 0 || pd[1] < 0 || pd[0] > k[0] / 2 || pd[1] > k[1] / 2)
        return ag__err(AG_EINVAL,
                       "%s: pad should be non-negative and at most half of kernel "
                       "size, but got padH = %lld, padW = %lld, kH = %lld, kW = %lld",
                       op, (long long)pd[0], (long long)pd[1], (long long)k[0], (long long)k[1]);
    int nd = x->ndim;
    int64_t C = x->sizes[nd - 3], H = x->sizes[nd - 2], W = x->sizes[nd - 1];
    int64_t OH = pool_out_size(H, k[0], pd[0], st[0], dl[0], ceil_mode);
    int64_t OW = pool_out_size(W, k[1], pd[1], st[1], dl[1], ceil_mode);
    if (OH < 1 || OW < 1)
        return ag__err(AG_EINVAL,
                       "%s: given input size (%lldx%lldx%lld), the calculated output "
                       "size (%lldx%lldx%lld) is too small",
                       op, (long long)C, (long long)H, (long long)W, (long long)C, (long long)OH,
                       (long long)OW);
    *p = (pool_geom){.planes = ag__numel(nd - 2, x->sizes),
                     .H = H,
                     .W = W,
                     .OH = OH,
                     .OW = OW,
                     .kh = k[0],
                     .kw = k[1],
                     .sh = st[0],
                     .sw = st[1],
                     .ph = pd[0],
                     .pw = pd[1],
                     .dh = dl[0],
                     .dw = dl[1],
                     .ceil_mode = ceil_mode,
                     .count_include_pad = true};
    return 0;
}

/* x's shape with the last two dims replaced by (OH, OW). */
static void pool_out_meta(const ag_tensor *x, int64_t OH, int64_t OW, ag_dtype dt, ag_tmeta *o) {
    int64_t sizes[AG_MAX_DIMS];
    memcpy(sizes, x->sizes, sizeof(int64_t) * (size_t)x->ndim);
    sizes[x->ndim - 2] = OH;
    sizes[x->ndim - 1] = OW;
    ag__tmeta_contiguous(o, dt, x->ndim, sizes);
}

/* Checks that t (a grad_output or indices) has the pooled shape of x. */
static int check_pooled(const char *op, const char *what, const ag_tensor *t, const ag_tensor *x,
                        const pool_geom *p, ag_dtype dt) {
    ag_tmeta want;
    pool_out_meta(x, p->OH, p->OW, dt, &want);
    if (t->ndim == want.ndim && !memcmp(t->sizes, want.sizes, sizeof(int64_t) * (size_t)t->ndim) &&
        t->dtype == dt)
        return 0;
    char a[128], b[128];
    return ag__err(AG_EINVAL, "%s: %s is %s %s, expected %s %s", op, what, ag_dtype_short(t->dtype),
                   ag__fmt_sizes(a, sizeof a, t->ndim, t->sizes), ag_dtype_short(dt),
                   ag__fmt_sizes(b, sizeof b, want.ndim, want.sizes));
}

static void pool_cost(const ag_arg *a, const ag_tmeta *o, int n, ag_cost *c) {
    const ag_tensor *x = a[0].u.t;
    double outn = (double)ag__numel(o[0].ndim, o[0].sizes);
    int64_t k[2] = {1, 1};
    if (a[1].kind == AG_ARG_INTS && a[1].n >= 1)
        k[0] = k[1] = a[1].u.ints[0];
    if (a[1].kind == AG_ARG_INTS && a[1].n >= 2)
        k[1] = a[1].u.ints[1];
    double es = (double)ag_dtype_size(x->dtype);
    c->flops = outn * (double)(k[0] * k[1]);
    c->bytes = ((double)ag_tensor_numel(x) + outn) * es;
    for (int i = 1; i < n; i++)
        c->bytes += (double)ag__numel(o[i].ndim, o[i].sizes) * (double)ag_dtype_size(o[i].dtype);
}

/* A valid pointer for empty int lists (memcpy of zero elements still wants one). */
static const int64_t no_ints[1] = {0};

/* ---- max_pool2d_with_indices ---- */

static int maxpool_meta(const ag_arg *a, ag_tmeta *o) {
    const ag_tensor *x = a[0].u.t;
    pool_geom p = {0};
    int rc = pool_geometry("max_pool2d_with_indices", x, &a[1], &a[2], &a[3], &a[4], a[5].u.b, &p);
    if (rc)
        return rc;
    pool_out_meta(x, p.OH, p.OW, x->dtype, &o[0]);
    pool_out_meta(x, p.OH, p.OW, AG_I64, &o[1]);
    return 0;
}

static int maxpool_kernel(const ag_arg *a, ag_tensor **o) {
    pool_geom p = {0};
    int rc = pool_geometry("max_pool2d_with_indices", a[0].u.t, &a[1], &a[2], &a[3], &a[4],
                           a[5].u.b, &p);
    ag__scratch_tensor tx;
    const ag_tensor *x = NULL;
    if (!rc)
        rc = contiguous_of(a[0].u.t, &tx, 1, &x);
    if (rc)
        return rc;
    if (x->dtype == AG_F32)
        max_pool_fwd_f32(dptr(x), dptr(o[0]), dptr(o[1]), &p);
    else
        max_pool_fwd_f64(dptr(x), dptr(o[0]), dptr(o[1]), &p);
    return 0;
}

static ag_tensor *maxpool_bw_call(ag_tensor *grad, ag_tensor *self, const ag_arg *a,
                                  ag_tensor *indices) {
    AG__OP(op, "max_pool2d_with_indices_backward");
    return ag__call1(
        op, (ag_arg[]){AG_A_T(grad), AG_A_T(self), a[1], a[2], a[3], a[4], a[5], AG_A_T(indices)},
        8);
}

static int maxpool_backward(ag_bwctx *c) {
    ag_tensor *g = c->grad_outputs[0];
    if (g)
        c->grad_inputs[0] = maxpool_bw_call(g, c->args[0].u.t, c->args, c->outputs[1]);
    return 0;
}

static void maxpool_samples(ag_samples *s) {
    int64_t x1[] = {2, 3, 6, 6}, x2[] = {1, 2, 7, 5}, x3[] = {3, 6, 5};
    int64_t k2[] = {2, 2}, k32[] = {3, 2}, s21[] = {2, 1}, p11[] = {1, 1}, d12[] = {1, 2};
    int64_t p00[] = {0, 0}, d11[] = {1, 1};
    ag_samples_add(s, "2x2, default stride",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 4, x1, -1, 1)), AG_A_INTS(k2, 2),
                              AG_A_INTS(no_ints, 0)},
                   3);
    ag_samples_add(s, "3x2, stride (2, 1), padding 1, dilation (1, 2), ceil mode",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 4, x2, -1, 1)), AG_A_INTS(k32, 2),
                              AG_A_INTS(s21, 2), AG_A_INTS(p11, 2), AG_A_INTS(d12, 2),
                              AG_A_B(true)},
                   6);
    ag_samples_add(s, "3-d strided input",
                   (ag_arg[]){AG_A_T(ag_samples_rand_strided(s, 3, x3, -1, 1)), AG_A_INTS(k2, 2),
                              AG_A_INTS(d11, 2), AG_A_INTS(p00, 2)},
                   4);
}

static const ag_opdef op_max_pool2d_with_indices = {
    .schema = "max_pool2d_with_indices(Tensor self, int[2] kernel_size, int[2] stride=[], "
              "int[2] padding=0, int[2] dilation=1, bool ceil_mode=False) -> (Tensor, Tensor)",
    .flags = 0,
    .meta = maxpool_meta,
    .kernel = maxpool_kernel,
    .dtypes = AG_DT_FLOAT,
    .backward = maxpool_backward,
    .save_args = 0x1,
    .save_outputs = 0x2,
    .cost = pool_cost,
    .samples = maxpool_samples,
    .shard = ag__shard_max_pool,
};

/* Hands t to *dst, or releases it when the caller does not want it. */
static void deliver(ag_tensor **dst, ag_tensor *t) {
    if (dst)
        *dst = t;
    else
        drop(t);
}

int ag_max_pool2d_with_indices(ag_tensor *x, const int64_t kernel[2], const int64_t stride[2],
                               const int64_t padding[2], const int64_t dilation[2], bool ceil_mode,
                               ag_tensor **out, ag_tensor **indices) {
    AG__OP(op, "max_pool2d_with_indices");
    static const int64_t one[2] = {1, 1}, zero[2] = {0, 0};
    ag_arg args[6] = {AG_A_T(x),
                      AG_A_INTS(kernel, 2),
                      stride ? AG_A_INTS(stride, 2) : AG_A_INTS(no_ints, 0),
                      AG_A_INTS(padding ? padding : zero, 2),
                      AG_A_INTS(dilation ? dilation : one, 2),
                      AG_A_B(ceil_mode)};
    ag_tensor *r[2];
    int rc = ag__calln(op, args, 6, r, 2);
    if (rc < 0) {
        deliver(out, NULL);
        deliver(indices, NULL);
        return rc;
    }
    deliver(out, r[0]);
    deliver(indices, r[1]);
    return 0;
}

ag_tensor *ag_max_pool2d(ag_tensor *x, const int64_t kernel[2], const int64_t stride[2],
                         const int64_t padding[2]) {
    ag_tensor *out;
    if (ag_max_pool2d_with_indices(x, kernel, stride, padding, NULL, false, &out, NULL) < 0)
        return NULL;
    return out;
}

/* ---- max_pool2d_with_indices_backward ---- */

static int maxpool_bw_meta(const ag_arg *a, ag_tmeta *o) {
    const char *op = "max_pool2d_with_indices_backward";
    const ag_tensor *go = a[0].u.t, *x = a[1].u.t, *ind = a[7].u.t;
    pool_geom p = {0};
    int rc = pool_geometry(op, x, &a[2], &a[3], &a[4], &a[5], a[6].u.b, &p);
    if (!rc)
        rc = check_pooled(op, "grad_output", go, x, &p, x->dtype);
    if (!rc)
        rc = check_pooled(op, "indices", ind, x, &p, AG_I64);
    if (rc)
        return rc;
    ag__tmeta_contiguous(o, x->dtype, x->ndim, x->sizes);
    return 0;
}

static int maxpool_bw_kernel(const ag_arg *a, ag_tensor **o) {
    pool_geom p = {0};
    int rc = pool_geometry("max_pool2d_with_indices_backward", a[1].u.t, &a[2], &a[3], &a[4], &a[5],
                           a[6].u.b, &p);
    ag__scratch_tensor tgo, tind;
    const ag_tensor *go = NULL, *ind = NULL;
    if (!rc)
        rc = contiguous_of(a[0].u.t, &tgo, 1, &go);
    if (!rc)
        rc = contiguous_of(a[7].u.t, &tind, 2, &ind);
    if (!rc) {
        bool ok = o[0]->dtype == AG_F32 ? max_pool_bwd_f32(dptr(go), dptr(ind), dptr(o[0]), &p)
                                        : max_pool_bwd_f64(dptr(go), dptr(ind), dptr(o[0]), &p);
        if (!ok)
            rc = ag__err(AG_EINVAL,
                         "max_pool2d_with_indices_backward: an index is outside the "
                         "%lld x %lld input plane",
                         (long long)p.H, (long long)p.W);
    }
    return rc;
}

static const ag_opdef op_max_pool2d_with_indices_backward = {
    .schema = "max_pool2d_with_indices_backward(Tensor grad_output, Tensor self, "
              "int[2] kernel_size, int[2] stride, int[2] padding, int[2] dilation, "
              "bool ceil_mode, Tensor indices) -> Tensor",
    .flags = AG_OP_BACKWARD_HELPER | AG_OP_NONDIFF,
    .meta = maxpool_bw_meta,
    .kernel = maxpool_bw_kernel,
    .dtypes = AG_DT_FLOAT,
    .shard = ag__shard_max_pool,
};

/* ---- avg_pool2d ---- */

/* args from index `first`: kernel_size, stride, padding, ceil_mode, count_include_pad,
 * divisor_override. */
static int avg_geometry(const char *op, const ag_tensor *x, const ag_arg *a, pool_geom *p) {
    int rc = pool_geometry(op, x, &a[0], &a[1], &a[2], NULL, a[3].u.b, p);
    if (rc)
        return rc;
    p->count_include_pad = a[4].u.b;
    p->divisor = a[5].kind == AG_ARG_INT ? a[5].u.i : 0;
    if (a[5].kind == AG_ARG_INT && a[5].u.i == 0)
        return ag__err(AG_EINVAL, "%s: divisor_override must be non-zero", op);
    return 0;
}

static int avgpool_meta(const ag_arg *a, ag_tmeta *o) {
    const ag_tensor *x = a[0].u.t;
    pool_geom p = {0};
    int rc = avg_geometry("avg_pool2d", x, &a[1], &p);
    if (rc)
        return rc;
    pool_out_meta(x, p.OH, p.OW, x->dtype, o);
    return 0;
}

static int avgpool_kernel(const ag_arg *a, ag_tensor **o) {
    pool_geom p = {0};
    int rc = avg_geometry("avg_pool2d", a[0].u.t, &a[1], &p);
    ag__scratch_tensor tx;
    const ag_tensor *x = NULL;
    if (!rc)
        rc = contiguous_of(a[0].u.t, &tx, 1, &x);
    if (rc)
        return rc;
    if (x->dtype == AG_F32)
        avg_pool_fwd_f32(dptr(x), dptr(o[0]), &p);
    else
        avg_pool_fwd_f64(dptr(x), dptr(o[0]), &p);
    return 0;
}

static ag_tensor *avgpool_bw_call(ag_tensor *grad, ag_tensor *self, const ag_arg *a) {
    AG__OP(op, "avg_pool2d_backward");
    return ag__call1(op, (ag_arg[]){AG_A_T(grad), AG_A_T(self), a[1], a[2], a[3], a[4], a[5], a[6]},
                     8);
}

static ag_tensor *avgpool_call(ag_tensor *x, const ag_arg *a) {
    AG__OP(op, "avg_pool2d");
    return ag__call1(op, (ag_arg[]){AG_A_T(x), a[0], a[1], a[2], a[3], a[4], a[5]}, 7);
}

static int avgpool_backward(ag_bwctx *c) {
    c->grad_inputs[0] = avgpool_bw_call(c->grad_outputs[0], c->args[0].u.t, c->args);
    return 0;
}

static void avgpool_samples(ag_samples *s) {
    int64_t x1[] = {2, 3, 6, 6}, x2[] = {1, 2, 7, 5}, x3[] = {2, 5, 6};
    int64_t k2[] = {2, 2}, k3[] = {3, 3}, k23[] = {2, 3}, s2[] = {2, 2}, s12[] = {1, 2};
    int64_t p1[] = {1, 1};
    ag_samples_add(s, "2x2, default stride",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 4, x1, -1, 1)), AG_A_INTS(k2, 2)}, 2);
    ag_samples_add(s, "3x3, stride 2, padding 1, ceil mode, count_include_pad false",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 4, x2, -1, 1)), AG_A_INTS(k3, 2),
                              AG_A_INTS(s2, 2), AG_A_INTS(p1, 2), AG_A_B(true), AG_A_B(false)},
                   6);
    ag_samples_add(s, "3-d strided input, divisor_override",
                   (ag_arg[]){AG_A_T(ag_samples_rand_strided(s, 3, x3, -1, 1)), AG_A_INTS(k23, 2),
                              AG_A_INTS(s12, 2), AG_A_INTS(p1, 2), AG_A_B(false), AG_A_B(true),
                              AG_A_I(4)},
                   7);
}

static const ag_opdef op_avg_pool2d = {
    .schema = "avg_pool2d(Tensor self, int[2] kernel_size, int[2] stride=[], int[2] padding=0, "
              "bool ceil_mode=False, bool count_include_pad=True, int? divisor_override=None) "
              "-> Tensor",
    .flags = 0,
    .meta = avgpool_meta,
    .kernel = avgpool_kernel,
    .dtypes = AG_DT_FLOAT,
    .backward = avgpool_backward,
    .save_args = 0x1,
    .cost = pool_cost,
    .samples = avgpool_samples,
};

ag_tensor *ag_avg_pool2d(ag_tensor *x, const int64_t kernel[2], const int64_t stride[2],
                         const int64_t padding[2], bool ceil_mode, bool count_include_pad) {
    AG__OP(op, "avg_pool2d");
    static const int64_t zero[2] = {0, 0};
    ag_arg args[6] = {AG_A_T(x),
                      AG_A_INTS(kernel, 2),
                      stride ? AG_A_INTS(stride, 2) : AG_A_INTS(no_ints, 0),
                      AG_A_INTS(padding ? padding : zero, 2),
                      AG_A_B(ceil_mode),
                      AG_A_B(count_include_pad)};
    return ag__call1(op, args, 6);
}

ag_tensor *ag_avg_pool2d_ex(ag_tensor *x, const int64_t kernel[2], const int64_t stride[2],
                            const int64_t padding[2], bool ceil_mode, bool count_include_pad,
                            int64_t divisor_override) {
    if (!divisor_override)
        return ag_avg_pool2d(x, kernel, stride, padding, ceil_mode, count_include_pad);
    AG__OP(op, "avg_pool2d");
    static const int64_t zero[2] = {0, 0};
    ag_arg args[7] = {AG_A_T(x),
                      AG_A_INTS(kernel, 2),
                      stride ? AG_A_INTS(stride, 2) : AG_A_INTS(no_ints, 0),
                      AG_A_INTS(padding ? padding : zero, 2),
                      AG_A_B(ceil_mode),
                      AG_A_B(count_include_pad),
                      AG_A_I(divisor_override)};
    return ag__call1(op, args, 7);
}

/* ---- avg_pool2d_backward ---- */

static int avgpool_bw_meta(const ag_arg *a, ag_tmeta *o) {
    const ag_tensor *go = a[0].u.t, *x = a[1].u.t;
    pool_geom p = {0};
    int rc = avg_geometry("avg_pool2d_backward", x, &a[2], &p);
    if (!rc)
        rc = check_pooled("avg_pool2d_backward", "grad_output", go, x, &p, x->dtype);
    if (rc)
        return rc;
    ag__tmeta_contiguous(o, x->dtype, x->ndim, x->sizes);
    return 0;
}

static int avgpool_bw_kernel(const ag_arg *a, ag_tensor **o) {
    pool_geom p = {0};
    int rc = avg_geometry("avg_pool2d_backward", a[1].u.t, &a[2], &p);
    ag__scratch_tensor tgo;
    const ag_tensor *go = NULL;
    if (!rc)
        rc = contiguous_of(a[0].u.t, &tgo, 1, &go);
    if (rc)
        return rc;
    if (o[0]->dtype == AG_F32)
        avg_pool_bwd_f32(dptr(go), dptr(o[0]), &p);
    else
        avg_pool_bwd_f64(dptr(go), dptr(o[0]), &p);
    return 0;
}

/* The backward is linear in grad_output: its own gradient is avg_pool2d of the incoming one
 * (self only gives the shape: no gradient). */
static int avgpool_bw_backward(ag_bwctx *c) {
    if (c->needs_grad[0])
        c->grad_inputs[0] = avgpool_call(c->grad_outputs[0], &c->args[2]);
    return 0;
}

static void avgpool_bw_samples(ag_samples *s) {
    int64_t x[] = {1, 2, 7, 5}, go[] = {1, 2, 4, 3};
    int64_t k3[] = {3, 3}, s2[] = {2, 2}, p1[] = {1, 1};
    ag_samples_add(s, "3x3, stride 2, padding 1",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 4, go, -1, 1)),
                              AG_A_T(ag_samples_rand_nograd(s, 4, x, -1, 1)), AG_A_INTS(k3, 2),
                              AG_A_INTS(s2, 2), AG_A_INTS(p1, 2), AG_A_B(false), AG_A_B(false),
                              AG_A_NONE},
                   8);
}

static const ag_opdef op_avg_pool2d_backward = {
    .schema = "avg_pool2d_backward(Tensor grad_output, Tensor self, int[2] kernel_size, "
              "int[2] stride, int[2] padding, bool ceil_mode, bool count_include_pad, "
              "int? divisor_override) -> Tensor",
    .flags = AG_OP_BACKWARD_HELPER,
    .meta = avgpool_bw_meta,
    .kernel = avgpool_bw_kernel,
    .dtypes = AG_DT_FLOAT,
    .backward = avgpool_bw_backward,
    .samples = avgpool_bw_samples,
};

/* ---- _adaptive_avg_pool2d ---- */

static int adaptive_geometry(const char *op, const ag_tensor *x, const ag_arg *osize,
                             pool_geom *p) {
    char s[128];
    if ((x->ndim != 3 && x->ndim != 4) || x->sizes[x->ndim - 1] == 0 ||
        x->sizes[x->ndim - 2] == 0 || x->sizes[x->ndim - 3] == 0)
        return ag__err(AG_EINVAL,
                       "%s: expected a 3-d (C, H, W) or 4-d (N, C, H, W) input with "
                       "non-zero C, H and W, got %s",
                       op, ag__fmt_sizes(s, sizeof s, x->ndim, x->sizes));
    int64_t o[2] = {0, 0};
    int rc = pair_arg(op, "output_size", osize, NULL, o);
    if (rc)
        return rc;
    if (o[0] < 0 || o[1] < 0)
        return ag__err(AG_EINVAL,
                       "%s: elements of output_size must be greater than or equal to "
                       "0, got (%lld, %lld)",
                       op, (long long)o[0], (long long)o[1]);
    int nd = x->ndim;
    *p = (pool_geom){.planes = ag__numel(nd - 2, x->sizes),
                     .H = x->sizes[nd - 2],
                     .W = x->sizes[nd - 1],
                     .OH = o[0],
                     .OW = o[1]};
    return 0;
}

static int adaptive_meta(const ag_arg *a, ag_tmeta *o) {
    pool_geom p = {0};
    int rc = adaptive_geometry("_adaptive_avg_pool2d", a[0].u.t, &a[1], &p);
    if (rc)
        return rc;
    pool_out_meta(a[0].u.t, p.OH, p.OW, a[0].u.t->dtype, o);
    return 0;
}

static int adaptive_kernel(const ag_arg *a, ag_tensor **o) {
    pool_geom p = {0};
    int rc = adaptive_geometry("_adaptive_avg_pool2d", a[0].u.t, &a[1], &p);
    ag__scratch_tensor tx;
    const ag_tensor *x = NULL;
    if (!rc)
        rc = contiguous_of(a[0].u.t, &tx, 1, &x);
    if (rc)
        return rc;
    if (x->dtype == AG_F32)
        adaptive_fwd_f32(dptr(x), dptr(o[0]), &p);
    else
        adaptive_fwd_f64(dptr(x), dptr(o[0]), &p);
    return 0;
}

static ag_tensor *adaptive_call(ag_tensor *x, int64_t oh, int64_t ow) {
    AG__OP(op, "_adaptive_avg_pool2d");
    int64_t osize[2] = {oh, ow};
    return ag__call1(op, (ag_arg[]){AG_A_T(x), AG_A_INTS(osize, 2)}, 2);
}

static ag_tensor *adaptive_bw_call(ag_tensor *grad, ag_tensor *self) {
    AG__OP(op, "_adaptive_avg_pool2d_backward");
    return ag__call1(op, (ag_arg[]){AG_A_T(grad), AG_A_T(self)}, 2);
}

static int adaptive_backward(ag_bwctx *c) {
    c->grad_inputs[0] = adaptive_bw_call(c->grad_outputs[0], c->args[0].u.t);
    return 0;
}

static void adaptive_samples(ag_samples *s) {
    int64_t x1[] = {2, 3, 7, 5}, x2[] = {3, 6, 4}, o23[] = {2, 3}, o34[] = {3, 4};
    ag_samples_add(s, "7x5 -> 2x3",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 4, x1, -1, 1)), AG_A_INTS(o23, 2)}, 2);
    ag_samples_add(s, "3-d strided, overlapping windows",
                   (ag_arg[]){AG_A_T(ag_samples_rand_strided(s, 3, x2, -1, 1)), AG_A_INTS(o34, 2)},
                   2);
}

static const ag_opdef op_adaptive_avg_pool2d = {
    .schema = "_adaptive_avg_pool2d(Tensor self, SymInt[2] output_size) -> Tensor",
    .flags = 0,
    .meta = adaptive_meta,
    .kernel = adaptive_kernel,
    .dtypes = AG_DT_FLOAT,
    .backward = adaptive_backward,
    .save_args = 0x1,
    .samples = adaptive_samples,
};

/* ATen's adaptive_avg_pool2d: a (1, 1) output is a mean over H and W (keepdim), anything else
 * is _adaptive_avg_pool2d. */
ag_tensor *ag_adaptive_avg_pool2d(ag_tensor *x, const int64_t output_size[2]) {
    if (x && output_size && output_size[0] == 1 && output_size[1] == 1 &&
        (x->ndim == 3 || x->ndim == 4)) {
        static const int64_t hw[2] = {-1, -2};
        return ag_mean(x, hw, 2, true);
    }
    AG__OP(op, "_adaptive_avg_pool2d");
    return ag__call1(op, (ag_arg[]){AG_A_T(x), AG_A_INTS(output_size, 2)}, 2);
}

/* ---- _adaptive_avg_pool2d_backward ---- */

static int adaptive_bw_meta(const ag_arg *a, ag_tmeta *o) {
    const char *op = "_adaptive_avg_pool2d_backward";
    const ag_tensor *go = a[0].u.t, *x = a[1].u.t;
    char p[128], q[128];
    if ((x->ndim != 3 && x->ndim != 4) || go->ndim != x->ndim || go->dtype != x->dtype ||
        memcmp(go->sizes, x->sizes, sizeof(int64_t) * (size_t)(x->ndim - 2)))
        return ag__err(AG_EINVAL, "%s: grad_output %s %s does not match self %s %s", op,
                       ag_dtype_short(go->dtype), ag__fmt_sizes(p, sizeof p, go->ndim, go->sizes),
                       ag_dtype_short(x->dtype), ag__fmt_sizes(q, sizeof q, x->ndim, x->sizes));
    ag__tmeta_contiguous(o, x->dtype, x->ndim, x->sizes);
    return 0;
}

static int adaptive_bw_kernel(const ag_arg *a, ag_tensor **o) {
    const ag_tensor *x = a[1].u.t;
    int nd = x->ndim;
    pool_geom p = {.planes = ag__numel(nd - 2, x->sizes),
                   .H = x->sizes[nd - 2],
                   .W = x->sizes[nd - 1],
                   .OH = a[0].u.t->sizes[nd - 2],
                   .OW = a[0].u.t->sizes[nd - 1]};
    ag__scratch_tensor tgo;
    const ag_tensor *go = NULL;
    int rc = contiguous_of(a[0].u.t, &tgo, 1, &go);
    if (rc)
        return rc;
    if (o[0]->dtype == AG_F32)
        adaptive_bwd_f32(dptr(go), dptr(o[0]), &p);
    else
        adaptive_bwd_f64(dptr(go), dptr(o[0]), &p);
    return 0;
}

/* Linear in grad_output: its gradient is the forward pooling of the incoming one. */
static int adaptive_bw_backward(ag_bwctx *c) {
    const ag_tensor *go = c->args[0].u.t;
    if (c->needs_grad[0])
        c->grad_inputs[0] =
            adaptive_call(c->grad_outputs[0], go->sizes[go->ndim - 2], go->sizes[go->ndim - 1]);
    return 0;
}

static void adaptive_bw_samples(ag_samples *s) {
    int64_t x[] = {2, 3, 7, 5}, go[] = {2, 3, 2, 3};
    ag_samples_add(s, "7x5 <- 2x3",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 4, go, -1, 1)),
                              AG_A_T(ag_samples_rand_nograd(s, 4, x, -1, 1))},
                   2);
}

static const ag_opdef op_adaptive_avg_pool2d_backward = {
    .schema = "_adaptive_avg_pool2d_backward(Tensor grad_output, Tensor self) -> Tensor",
    .flags = AG_OP_BACKWARD_HELPER,
    .meta = adaptive_bw_meta,
    .kernel = adaptive_bw_kernel,
    .dtypes = AG_DT_FLOAT,
    .backward = adaptive_bw_backward,
    .save_args = 0x1,
    .samples = adaptive_bw_samples,
};

const ag_opdef *const ag__ops_conv[] = {
    &op_convolution,
    &op_convolution_backward,
    &op_max_pool2d_with_indices,
    &op_max_pool2d_with_indices_backward,
    &op_avg_pool2d,
    &op_avg_pool2d_backward,
    &op_adaptive_avg_pool2d,
    &op_adaptive_avg_pool2d_backward,
    NULL,
};
