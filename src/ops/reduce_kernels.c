/* The CPU loops behind reduce.c's ops: reductions (sum, mean, amax, var, logsumexp), argmax,
 * softmax / log_softmax and their backward helpers. reduce.c owns the op-table entries (schemas,
 * meta, dtypes, backward rules); this file only computes, through the functions declared in
 * reduce_kernels.h.
 *
 * Reductions share one plan (rplan): the input's dims split into kept dims, in output order,
 * and reduced dims, sorted by stride and coalesced, so any strided input is read in place with
 * no copy. Float reductions accumulate in double; each output is reduced in fixed-size chunks
 * whose results are combined in a fixed order, so results never depend on the thread count.
 * Three loop shapes cover the cases:
 *   1. "runs" (run_reduce): each output walks its reduced elements as runs of the innermost
 *      reduced dim (contiguous runs vectorize); parallel over outputs, or over (output, chunk)
 *      pairs when there are few outputs (a full sum of a large tensor);
 *   2. "columns" (col_sum, sums only): when the innermost kept dim is contiguous (bias
 *      gradients: sum over dim 0 of (N, C)), whole rows are accumulated into per-column
 *      accumulators, parallel over fixed row chunks whose partials are combined in order;
 *   3. integer sums and maxima (exact int64 accumulators) walk elements with an odometer.
 *
 * Softmax-like ops and argmax work on rows along one dim (`rows`); each thread takes a block of
 * rows. Row kernels see contiguous rows only: strided rows are gathered into per-thread scratch.
 * Softmax subtracts the row max before exponentiating, and logsumexp its reduction max, so
 * large inputs stay finite. Float exp uses exp_f32, a branch-free polynomial that vectorizes.
 *
 * Temporary buffers (results in double, chunk partials, gathered rows) are per-thread scratch
 * (ag__scratch, slots 0 and 1: see src/core/scratch.c), so repeated calls allocate nothing. */
#include "reduce_kernels.h"
#include "fused.h"

#include <math.h>
#include <omp.h>

/* Elements per chunk of one output's reduction (see the file comment). */
#define RED_CHUNK 16384
/* The column path: columns per accumulator block (whole rows, so reads stream) and rows per
 * task. */
#define COL_BLOCK 2048
#define ROW_CHUNK 512
/* Independent accumulators per vector loop: enough for the compiler to vectorize without
 * reassociating, and a little pairwise summation for free. */
#define LANES 16

static int64_t min64(int64_t a, int64_t b) {
    return a < b ? a : b;
}

/* ---- the reduction plan ---- */

typedef struct rplan {
    int nk, nr;
    int64_t ks[AG_MAX_DIMS], kst[AG_MAX_DIMS]; /* kept dims (output order): sizes, strides */
    int64_t rs[AG_MAX_DIMS], rst[AG_MAX_DIMS]; /* reduced dims, largest stride first */
    int64_t nout, nred;
    ag_dtype dt;
    const char *x; /* element [0, ..., 0] of the input */
} rplan;

static void plan_build(rplan *p, const ag_tensor *x, const bool *reduce) {
    int64_t rs[AG_MAX_DIMS], rst[AG_MAX_DIMS];
    int nr = 0;
    p->nk = p->nr = 0;
    p->nout = p->nred = 1;
    for (int d = 0; d < x->ndim; d++) {
        int64_t sz = x->sizes[d], st = x->strides[d];
        if (reduce[d]) {
            p->nred *= sz;
            if (sz != 1) {
                rs[nr] = sz;
                rst[nr++] = st;
            }
            continue;
        }
        p->nout *= sz;
        if (sz == 1)
            continue;
        /* The output is contiguous over the kept dims, so neighbours merge whenever the
         * input's strides allow it, even across reduced dims between them. */
        if (p->nk > 0 && p->kst[p->nk - 1] == st * sz) {
            p->ks[p->nk - 1] *= sz;
            p->kst[p->nk - 1] = st;
        } else {
            p->ks[p->nk] = sz;
            p->kst[p->nk++] = st;
        }
    }
    /* An empty reduction has nothing to walk: without reduced dims no odometer divides by the
     * 0-sized one, and every output is the identity (sum 0, max -inf). */
    if (p->nred == 0)
        nr = 0;
    /* Reduction order is free (except for argmax, which does not use plans): walk memory in
     * order, largest stride first, so a transposed input still reduces contiguous runs. */
    for (int i = 1; i < nr; i++) {
        int64_t s = rs[i], t = rst[i];
        int j = i;
        for (; j > 0 && rst[j - 1] < t; j--) {
            rs[j] = rs[j - 1];
            rst[j] = rst[j - 1];
        }
        rs[j] = s;
        rst[j] = t;
    }
    for (int i = 0; i < nr; i++) {
        if (p->nr > 0 && p->rst[p->nr - 1] == rst[i] * rs[i]) {
            p->rs[p->nr - 1] *= rs[i];
            p->rst[p->nr - 1] = rst[i];
        } else {
            p->rs[p->nr] = rs[i];
            p->rst[p->nr++] = rst[i];
        }
    }
    p->dt = x->dtype;
    p->x = x->storage->data ? ag__base(x) : NULL;
}

/* Input offset (elements) of the first element reduced into output o. */
static int64_t kept_offset(const rplan *p, int64_t o) {
    if (p->nk <= 1)
        return p->nk ? o * p->kst[0] : 0;
    int64_t off = 0;
    for (int d = p->nk - 1; d >= 0; d--) {
        off += (o % p->ks[d]) * p->kst[d];
        o /= p->ks[d];
    }
    return off;
}

/* An odometer over n dims: `off` follows the flat index as it is incremented. */
typedef struct odo {
    int64_t idx[AG_MAX_DIMS];
    int64_t off;
} odo;

static void odo_init(odo *z, int n, const int64_t *sizes, const int64_t *strides, int64_t i) {
    z->off = 0;
    for (int d = n - 1; d >= 0; d--) {
        z->idx[d] = i % sizes[d];
        i /= sizes[d];
        z->off += z->idx[d] * strides[d];
    }
}

static inline void odo_next(odo *z, int n, const int64_t *sizes, const int64_t *strides) {
    for (int d = n - 1; d >= 0; d--) {
        z->off += strides[d];
        if (++z->idx[d] < sizes[d])
            return;
        z->off -= z->idx[d] * strides[d];
        z->idx[d] = 0;
    }
}

/* ---- vector loops over one run: n elements with stride s ---- */

typedef enum rkind {
    R_SUM,    /* sum x */
    R_MAX,    /* max x, NaN if any NaN */
    R_SUMEXP, /* sum exp(x - param) */
    R_SUMSQ,  /* sum (x - param)^2 */
} rkind;

static double r_identity(rkind k) {
    return k == R_MAX ? -INFINITY : 0.0;
}

/* NaN-propagating max: once a NaN is seen it stays. `|`, not `||`: no branch, so it vectorizes. */
#define MAXNAN(a, v) ((((v) > (a)) | ((v) != (v))) ? (v) : (a))

static double r_combine(rkind k, double a, double b) {
    return k == R_MAX ? MAXNAN(a, b) : a + b;
}

/* Sums of lane arrays, pairwise. */
static double lanes_sum(const double *l) {
    double s[LANES / 2];
    for (int j = 0; j < LANES / 2; j++)
        s[j] = l[j] + l[j + LANES / 2];
    for (int w = LANES / 4; w >= 1; w /= 2)
        for (int j = 0; j < w; j++)
            s[j] += s[j + w];
    return s[0];
}

/* exp for float without calls or branches, so loops over it vectorize (libm's expf does not,
 * and costs ~10x more). Cephes' range reduction and polynomial: within ~1 ulp of expf for
 * x <= 88.72 (overflow to inf above, as expf); below -86.9 it flushes to 0 where expf returns
 * subnormals. NaN stays NaN. */
static inline float exp_f32(float x) {
    const float hi = 88.72283f, lo = -86.9f;
    float xc = x > hi ? hi : x;
    xc = xc < lo ? lo : xc;
    /* n = round(x / ln 2) via the 1.5 * 2^23 trick; its bits hold n as an integer. */
    float big = xc * 1.44269504088896341f + 12582912.0f;
    float n = big - 12582912.0f;
    int32_t nbits;
    memcpy(&nbits, &big, sizeof nbits);
    float r = xc - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float q = 1.9875691500e-4f;
    q = q * r + 1.3981999507e-3f;
    q = q * r + 8.3334519073e-3f;
    q = q * r + 4.1665795894e-2f;
    q = q * r + 1.6666665459e-1f;
    q = q * r + 5.0000001201e-1f;
    q = q * r * r + r + 1.0f;
    /* e^x = (2 q) * 2^(n-1): n - 1 + 127 stays a normal exponent for n in [-125, 128]. */
    uint32_t sbits = ((uint32_t)nbits - 0x4B400000u + 126u) << 23; /* unsigned: NaN wraps */
    float scale;
    memcpy(&scale, &sbits, sizeof scale);
    float y = (q + q) * scale;
    y = x > hi ? INFINITY : y;
    return x < lo ? 0.0f : y;
}

static double exp_f64(double x) {
    return exp(x);
}

/* One definition per float type. The stride-1 loops are written separately so the compiler
 * vectorizes them. */
#define DEFINE_VEC(T, VT, MT, SFX, EXP)                                                            \
    static double vsum_##SFX(const T *x, int64_t n, int64_t s) {                                   \
        if (n < LANES) {                                                                           \
            double t = 0;                                                                          \
            for (int64_t i = 0; i < n; i++)                                                        \
                t += (double)x[i * s];                                                             \
            return t;                                                                              \
        }                                                                                          \
        double l[LANES] = {0};                                                                     \
        int64_t i = 0;                                                                             \
        if (s == 1)                                                                                \
            for (; i + LANES <= n; i += LANES)                                                     \
                for (int j = 0; j < LANES; j++)                                                    \
                    l[j] += (double)x[i + j];                                                      \
        else                                                                                       \
            for (; i + LANES <= n; i += LANES)                                                     \
                for (int j = 0; j < LANES; j++)                                                    \
                    l[j] += (double)x[(i + j) * s];                                                \
        for (int j = 0; i < n; i++, j++)                                                           \
            l[j] += (double)x[i * s];                                                              \
        return lanes_sum(l);                                                                       \
    }                                                                                              \
    static double vsumsq_##SFX(const T *x, int64_t n, int64_t s, double m) {                       \
        double l[LANES] = {0};                                                                     \
        int64_t i = 0;                                                                             \
        if (s == 1)                                                                                \
            for (; i + LANES <= n; i += LANES)                                                     \
                for (int j = 0; j < LANES; j++) {                                                  \
                    double d = (double)x[i + j] - m;                                               \
                    l[j] += d * d;                                                                 \
                }                                                                                  \
        for (int j = 0; i < n; i++, j = (j + 1) % LANES) {                                         \
            double d = (double)x[i * s] - m;                                                       \
            l[j] += d * d;                                                                         \
        }                                                                                          \
        return lanes_sum(l);                                                                       \
    }                                                                                              \
    /* Compilers vectorize no float max without -ffast-math, so the contiguous loop uses           \
     * 16-byte vector extensions (native on every SIMD target) and blends by hand. */              \
    static T vmax_##SFX(const T *x, int64_t n, int64_t s) {                                        \
        enum { W = 16 / sizeof(T) };                                                               \
        T m = (T)-INFINITY;                                                                        \
        int64_t i = 0;                                                                             \
        if (s == 1 && n >= 4 * W) {                                                                \
            VT acc[4];                                                                             \
            for (int k = 0; k < 4; k++)                                                            \
                for (int j = 0; j < W; j++)                                                        \
                    acc[k][j] = (T)-INFINITY;                                                      \
            for (; i + 4 * W <= n; i += 4 * W)                                                     \
                for (int k = 0; k < 4; k++) {                                                      \
                    VT v;                                                                          \
                    memcpy(&v, x + i + k * W, sizeof v);                                           \
                    MT take = (v > acc[k]) | (v != v);                                             \
                    acc[k] = (VT)(((MT)v & take) | ((MT)acc[k] & ~take));                          \
                }                                                                                  \
            for (int k = 0; k < 4; k++)                                                            \
                for (int j = 0; j < W; j++)                                                        \
                    m = MAXNAN(m, acc[k][j]);                                                      \
        }                                                                                          \
        for (; i < n; i++)                                                                         \
            m = MAXNAN(m, x[i * s]);                                                               \
        return m;                                                                                  \
    }                                                                                              \
    /* exp in the input's precision (vectorized for float), summed in double. */                   \
    static double vsumexp_##SFX(const T *x, int64_t n, int64_t s, double m) {                      \
        T buf[256];                                                                                \
        double acc = 0;                                                                            \
        const T mt = (T)m;                                                                         \
        for (int64_t i = 0; i < n; i += 256) {                                                     \
            int64_t k = min64(256, n - i);                                                         \
            if (s == 1)                                                                            \
                for (int64_t j = 0; j < k; j++)                                                    \
                    buf[j] = EXP(x[i + j] - mt);                                                   \
            else                                                                                   \
                for (int64_t j = 0; j < k; j++)                                                    \
                    buf[j] = EXP(x[(i + j) * s] - mt);                                             \
            acc += vsum_##SFX(buf, k, 1);                                                          \
        }                                                                                          \
        return acc;                                                                                \
    }                                                                                              \
    /* sum x y over contiguous x and y */                                                          \
    static double vdot_##SFX(const T *x, const T *y, int64_t n) {                                  \
        double l[LANES] = {0};                                                                     \
        int64_t i = 0;                                                                             \
        for (; i + LANES <= n; i += LANES)                                                         \
            for (int j = 0; j < LANES; j++)                                                        \
                l[j] += (double)x[i + j] * (double)y[i + j];                                       \
        for (int j = 0; i < n; i++, j++)                                                           \
            l[j] += (double)x[i] * (double)y[i];                                                   \
        return lanes_sum(l);                                                                       \
    }

/* 16-byte vectors and their comparison masks (GCC/Clang vector extensions). */
typedef float f32x4 __attribute__((vector_size(16)));
typedef int32_t i32x4 __attribute__((vector_size(16)));
typedef double f64x2 __attribute__((vector_size(16)));
typedef int64_t i64x2 __attribute__((vector_size(16)));

DEFINE_VEC(float, f32x4, i32x4, f32, exp_f32)
DEFINE_VEC(double, f64x2, i64x2, f64, exp_f64)

static double vec_reduce(rkind k, ag_dtype dt, const char *x, int64_t n, int64_t s, double m) {
    if (dt == AG_F32) {
        const float *f = (const float *)(const void *)x;
        switch (k) {
        case R_SUM:
            return vsum_f32(f, n, s);
        case R_MAX:
            return vmax_f32(f, n, s);
        case R_SUMEXP:
            return vsumexp_f32(f, n, s, m);
        case R_SUMSQ:
            return vsumsq_f32(f, n, s, m);
        }
    } else {
        const double *f = (const double *)(const void *)x;
        switch (k) {
        case R_SUM:
            return vsum_f64(f, n, s);
        case R_MAX:
            return vmax_f64(f, n, s);
        case R_SUMEXP:
            return vsumexp_f64(f, n, s, m);
        case R_SUMSQ:
            return vsumsq_f64(f, n, s, m);
        }
    }
    return 0;
}

/* ---- loop shape 1: runs ---- */

/* Reduces elements [a, b) (flat, over the reduced dims) of the output starting at `base`. */
static double walk(const rplan *p, rkind k, int64_t base, int64_t a, int64_t b, double m) {
    size_t esz = ag_dtype_size(p->dt);
    if (p->nr == 0)
        return vec_reduce(k, p->dt, p->x + (size_t)base * esz, 1, 1, m);
    int outer = p->nr - 1;
    int64_t inner = p->rs[outer], is = p->rst[outer];
    odo z;
    odo_init(&z, outer, p->rs, p->rst, a / inner);
    int64_t j = a % inner;
    double acc = r_identity(k);
    for (int64_t i = a; i < b;) {
        int64_t run = min64(inner - j, b - i);
        const char *px = p->x + (size_t)(base + z.off + j * is) * esz;
        acc = r_combine(k, acc, vec_reduce(k, p->dt, px, run, is, m));
        i += run;
        j = 0;
        odo_next(&z, outer, p->rs, p->rst);
    }
    return acc;
}

/* res[o] = the reduction k of output o, for every output; m[o] is the per-output parameter of
 * R_SUMEXP / R_SUMSQ (or NULL). float or double input. */
static int run_reduce(const rplan *p, rkind k, const double *m, double *res) {
    const int64_t nout = p->nout, nred = p->nred;
    const int64_t nch = (nred + RED_CHUNK - 1) / RED_CHUNK;
    const bool par = nout * nred >= AG__PAR_MIN;
    if (nch <= 1 || !par || nout >= 4 * omp_get_max_threads()) {
#pragma omp parallel for schedule(static) if (par && nout > 1)
        for (int64_t o = 0; o < nout; o++) {
            int64_t base = kept_offset(p, o);
            double acc = r_identity(k), mo = m ? m[o] : 0;
            for (int64_t c = 0; c < nch; c++)
                acc = r_combine(
                    k, acc, walk(p, k, base, c * RED_CHUNK, min64((c + 1) * RED_CHUNK, nred), mo));
            res[o] = acc;
        }
        return 0;
    }
    /* Few outputs, long reductions: chunks in parallel, combined in the same order as above. */
    double *part = ag__scratch(1, sizeof(double) * (size_t)(nout * nch));
    if (!part)
        return AG_ENOMEM;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < nout * nch; t++) {
        int64_t o = t / nch, c = t % nch;
        part[t] = walk(p, k, kept_offset(p, o), c * RED_CHUNK, min64((c + 1) * RED_CHUNK, nred),
                       m ? m[o] : 0);
    }
    for (int64_t o = 0; o < nout; o++) {
        double acc = r_identity(k);
        for (int64_t c = 0; c < nch; c++)
            acc = r_combine(k, acc, part[o * nch + c]);
        res[o] = acc;
    }
    return 0;
}

/* ---- loop shape 2: columns (sums whose innermost kept dim is contiguous) ---- */

static bool col_path_ok(const rplan *p) {
    return p->nk >= 1 && p->kst[p->nk - 1] == 1 && p->ks[p->nk - 1] >= 4 && p->nr >= 1 &&
           p->nred > 0;
}

/* acc[0..w) = sum over reduced rows [r0, r1) of x[row + c]; x points at the block's first
 * column. The inner loop is a contiguous, vectorizable axpy into double accumulators. */
#define DEFINE_COLSUM(T, SFX)                                                                      \
    static void colsum_##SFX(const rplan *p, const T *x, int64_t r0, int64_t r1, int64_t w,        \
                             double *acc) {                                                        \
        for (int64_t c = 0; c < w; c++)                                                            \
            acc[c] = 0;                                                                            \
        odo z;                                                                                     \
        odo_init(&z, p->nr, p->rs, p->rst, r0);                                                    \
        for (int64_t r = r0; r < r1; r++) {                                                        \
            const T *row = x + z.off;                                                              \
            for (int64_t c = 0; c < w; c++)                                                        \
                acc[c] += (double)row[c];                                                          \
            odo_next(&z, p->nr, p->rs, p->rst);                                                    \
        }                                                                                          \
    }

DEFINE_COLSUM(float, f32)
DEFINE_COLSUM(double, f64)

/* res[o] = sum of output o, for rplans that pass col_path_ok. Tasks are (outer kept index,
 * column block, row chunk); row-chunk partials are combined in order. */
static int col_sum(const rplan *p, double *res) {
    const int64_t C = p->ks[p->nk - 1], nout = p->nout, nred = p->nred;
    const int64_t nouter = nout / C;
    const int64_t ncb = (C + COL_BLOCK - 1) / COL_BLOCK;
    const int64_t nrc = (nred + ROW_CHUNK - 1) / ROW_CHUNK;
    const int64_t ntask = nouter * ncb * nrc;
    const bool par = nout * nred >= AG__PAR_MIN && ntask > 1;
    /* part[rc * nout + o] */
    double *part = nrc > 1 ? ag__scratch(1, sizeof(double) * (size_t)(nout * nrc)) : res;
    if (!part)
        return AG_ENOMEM;
    const size_t esz = ag_dtype_size(p->dt);
#pragma omp parallel for schedule(static) if (par)
    for (int64_t t = 0; t < ntask; t++) {
        int64_t rc = t % nrc, cb = (t / nrc) % ncb, ou = t / (nrc * ncb);
        int64_t c0 = cb * COL_BLOCK, w = min64(COL_BLOCK, C - c0);
        int64_t r0 = rc * ROW_CHUNK, r1 = min64(r0 + ROW_CHUNK, nred);
        const char *x = p->x + (size_t)(kept_offset(p, ou * C) + c0) * esz;
        double *dst = part + rc * nout + ou * C + c0;
        if (p->dt == AG_F32)
            colsum_f32(p, (const float *)(const void *)x, r0, r1, w, dst);
        else
            colsum_f64(p, (const double *)(const void *)x, r0, r1, w, dst);
    }
    if (nrc > 1) {
#pragma omp parallel for schedule(static) if (par)
        for (int64_t o = 0; o < nout; o++) {
            double acc = 0;
            for (int64_t rc = 0; rc < nrc; rc++)
                acc += part[rc * nout + o];
            res[o] = acc;
        }
    }
    return 0;
}

/* ---- loop shape 3: integers (i64, bool) ---- */

/* res[o] = exact sum (wrapping, as PyTorch) or max of output o. */
static void int_reduce(const rplan *p, bool is_max, int64_t *res) {
    const bool par = p->nout * p->nred >= AG__PAR_MIN && p->nout > 1;
    const bool isbool = p->dt == AG_BOOL;
#pragma omp parallel for schedule(static) if (par)
    for (int64_t o = 0; o < p->nout; o++) {
        int64_t base = kept_offset(p, o);
        int64_t acc = is_max ? INT64_MIN : 0;
        odo z;
        odo_init(&z, p->nr, p->rs, p->rst, 0);
        for (int64_t r = 0; r < p->nred; r++) {
            int64_t v = isbool ? (int64_t)((const bool *)(const void *)p->x)[base + z.off]
                               : ((const int64_t *)(const void *)p->x)[base + z.off];
            if (is_max)
                acc = v > acc ? v : acc;
            else
                acc = (int64_t)((uint64_t)acc + (uint64_t)v);
            odo_next(&z, p->nr, p->rs, p->rst);
        }
        res[o] = acc;
    }
}

/* ---- writing results ---- */

/* out[o] = res[o] / div (div 1 for plain sums); out is a fresh contiguous float tensor. */
static int store_f(ag_tensor *out, const double *res, int64_t n, double div) {
    AG__FLOAT_SWITCH(out->dtype, T, {
        T *o = (T *)ag__base(out);
        if (div == 1.0)
            for (int64_t i = 0; i < n; i++)
                o[i] = (T)res[i];
        else
            for (int64_t i = 0; i < n; i++)
                o[i] = (T)(res[i] / div);
    });
    return 0;
}

static int store_i(ag_tensor *out, const int64_t *res, int64_t n) {
    if (out->dtype == AG_BOOL) {
        bool *o = (bool *)ag__base(out);
        for (int64_t i = 0; i < n; i++)
            o[i] = res[i] != 0;
    } else {
        memcpy(ag__base(out), res, sizeof(int64_t) * (size_t)n);
    }
    return 0;
}

/* ---- the entry points (reduce_kernels.h) ---- */

int ag__reduce_sum(const ag_tensor *x, const bool *reduce, ag_tensor *out, bool mean) {
    rplan p;
    plan_build(&p, x, reduce);
    if (p.nout == 0)
        return 0;
    if (!ag_dtype_is_float(x->dtype)) {
        int64_t *res = ag__scratch(0, sizeof(int64_t) * (size_t)p.nout);
        if (!res)
            return AG_ENOMEM;
        int_reduce(&p, false, res);
        store_i(out, res, p.nout);
        return 0;
    }
    double *res = ag__scratch(0, sizeof(double) * (size_t)p.nout);
    if (!res)
        return AG_ENOMEM;
    int rc = col_path_ok(&p) ? col_sum(&p, res) : run_reduce(&p, R_SUM, NULL, res);
    if (rc == 0)
        rc = store_f(out, res, p.nout, mean ? (double)p.nred : 1.0);
    return rc;
}

int ag__reduce_amax(const ag_tensor *x, const bool *reduce, ag_tensor *out) {
    rplan p;
    plan_build(&p, x, reduce);
    if (p.nout == 0)
        return 0;
    if (!ag_dtype_is_float(x->dtype)) {
        int64_t *res = ag__scratch(0, sizeof(int64_t) * (size_t)p.nout);
        if (!res)
            return AG_ENOMEM;
        int_reduce(&p, true, res);
        store_i(out, res, p.nout);
        return 0;
    }
    double *res = ag__scratch(0, sizeof(double) * (size_t)p.nout);
    if (!res)
        return AG_ENOMEM;
    int rc = run_reduce(&p, R_MAX, NULL, res);
    if (rc == 0)
        rc = store_f(out, res, p.nout, 1.0);
    return rc;
}

/* Two passes in double: the mean, then the sum of squared deviations. */
int ag__reduce_var(const ag_tensor *x, const bool *reduce, double correction, ag_tensor *out) {
    rplan p;
    plan_build(&p, x, reduce);
    if (p.nout == 0)
        return 0;
    double *mean = ag__scratch(0, sizeof(double) * (size_t)p.nout * 2);
    if (!mean)
        return AG_ENOMEM;
    double *ssd = mean + p.nout;
    int rc = run_reduce(&p, R_SUM, NULL, mean);
    for (int64_t i = 0; rc == 0 && i < p.nout; i++)
        mean[i] /= (double)p.nred;
    if (rc == 0)
        rc = run_reduce(&p, R_SUMSQ, mean, ssd);
    /* PyTorch divides by max(N - correction, 0): 0/0 = NaN for one element, unbiased. */
    double dof = (double)p.nred - correction;
    if (rc == 0)
        rc = store_f(out, ssd, p.nout, dof > 0 ? dof : 0.0);
    return rc;
}

/* m + log(sum exp(x - m)) with m the max, taken as 0 when infinite (ATen does the same): all
 * -inf gives -inf, any +inf gives +inf, any NaN gives NaN. */
int ag__reduce_logsumexp(const ag_tensor *x, const bool *reduce, ag_tensor *out) {
    rplan p;
    plan_build(&p, x, reduce);
    if (p.nout == 0)
        return 0;
    double *m = ag__scratch(0, sizeof(double) * (size_t)p.nout * 2);
    if (!m)
        return AG_ENOMEM;
    double *s = m + p.nout;
    int rc = run_reduce(&p, R_MAX, NULL, m);
    for (int64_t i = 0; i < p.nout; i++)
        if (isinf(m[i]))
            m[i] = 0;
    if (rc == 0)
        rc = run_reduce(&p, R_SUMEXP, m, s);
    for (int64_t i = 0; i < p.nout; i++)
        s[i] = log(s[i]) + m[i];
    if (rc == 0)
        rc = store_f(out, s, p.nout, 1.0);
    return rc;
}

/* ---- rows along one dim (argmax, softmax and its backward helpers) ---- */

#define ROWS_MAX_OPS 3

/* Rows along `dim` of operands that share one shape: row r of operand k starts at
 * base[k] + off[k] (elements) and steps by step[k]. */
typedef struct rows {
    int nops, nd;
    int64_t sizes[AG_MAX_DIMS];
    int64_t st[ROWS_MAX_OPS][AG_MAX_DIMS];
    int64_t step[ROWS_MAX_OPS];
    int64_t nrows, len;
} rows;

/* ts[k] all have ts[0]'s shape; dim already wrapped (0 for 0-d tensors). The other dims are
 * coalesced where every operand allows it; rows stay in row-major order of those dims. */
static void rows_build(rows *w, ag_tensor *const *ts, int n, int dim) {
    const ag_tensor *t0 = ts[0];
    w->nops = n;
    w->nd = 0;
    w->nrows = 1;
    w->len = t0->ndim ? t0->sizes[dim] : 1;
    for (int k = 0; k < n; k++)
        w->step[k] = ts[k]->ndim ? ts[k]->strides[dim] : 0;
    for (int d = 0; d < t0->ndim; d++) {
        int64_t sz = t0->sizes[d];
        w->nrows *= d == dim ? 1 : sz;
        if (d == dim || sz == 1)
            continue;
        bool merge = w->nd > 0;
        for (int k = 0; k < n && merge; k++)
            merge = w->st[k][w->nd - 1] == ts[k]->strides[d] * sz;
        int at = merge ? w->nd - 1 : w->nd++;
        w->sizes[at] = merge ? w->sizes[at] * sz : sz;
        for (int k = 0; k < n; k++)
            w->st[k][at] = ts[k]->strides[d];
    }
    /* No rows when any dim is empty: nothing to visit, and no 0-sized dim left for rows_start
     * to divide by. */
    if (w->len == 0 || w->nrows == 0) {
        w->nrows = 0;
        w->nd = 0;
    }
}

/* Row r's offsets, and an odometer to step to the next row without divisions. */
static void rows_start(const rows *w, int64_t r, int64_t *idx, int64_t *off) {
    for (int k = 0; k < w->nops; k++)
        off[k] = 0;
    for (int d = w->nd - 1; d >= 0; d--) {
        idx[d] = r % w->sizes[d];
        r /= w->sizes[d];
        for (int k = 0; k < w->nops; k++)
            off[k] += idx[d] * w->st[k][d];
    }
}

static inline void rows_next(const rows *w, int64_t *idx, int64_t *off) {
    for (int d = w->nd - 1; d >= 0; d--) {
        for (int k = 0; k < w->nops; k++)
            off[k] += w->st[k][d];
        if (++idx[d] < w->sizes[d])
            return;
        for (int k = 0; k < w->nops; k++)
            off[k] -= idx[d] * w->st[k][d];
        idx[d] = 0;
    }
}

/* Runs `body` for every row (it sees r, off[] and len), each thread a contiguous block of
 * rows, in parallel when the work is large. */
#define ROWS_FOR(w, ...)                                                                           \
    do {                                                                                           \
        const int64_t rows_n = (w).nrows;                                                          \
        const int rows_par = rows_n > 1 && rows_n * (w).len >= AG__PAR_MIN;                        \
        _Pragma("omp parallel if (rows_par)") {                                                    \
            const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();                  \
            const int64_t r0 = rows_n * tid / nt, r1 = rows_n * (tid + 1) / nt;                    \
            int64_t off[ROWS_MAX_OPS], idx[AG_MAX_DIMS];                                           \
            rows_start(&(w), r0, idx, off);                                                        \
            const int64_t len = (w).len;                                                           \
            for (int64_t r = r0; r < r1; r++, rows_next(&(w), idx, off)) {                         \
                __VA_ARGS__                                                                        \
            }                                                                                      \
        }                                                                                          \
    } while (0)

/* A row kernel: out[0..n) from in1 (and in2) over contiguous rows. */
typedef void (*row_fn)(void *out, const void *in1, const void *in2, int64_t n, bool logp);

static void strided_copy(char *dst, int64_t ds, const char *src, int64_t ss, int64_t n,
                         size_t esz) {
    if (esz == 4)
        for (int64_t i = 0; i < n; i++)
            memcpy(dst + (size_t)(i * ds) * 4, src + (size_t)(i * ss) * 4, 4);
    else
        for (int64_t i = 0; i < n; i++)
            memcpy(dst + (size_t)(i * ds) * 8, src + (size_t)(i * ss) * 8, 8);
}

/* Runs fn on every row. Operand 0 is the output. Rows that are not contiguous in some operand
 * (softmax over a leading dim, an expanded grad) are gathered into per-thread scratch and the
 * result scattered back, so row kernels only ever see contiguous, vectorizable rows; the rows
 * of neighbouring threads' work share cache lines, so the gathers mostly hit cache. */
static int rows_apply(const rows *w, char *const *base, size_t esz, row_fn fn, bool logp) {
    const int nops = w->nops;
    if (w->nrows == 0)
        return 0;
    bool contig = true;
    for (int k = 0; k < nops; k++)
        contig &= w->step[k] == 1 || w->len <= 1;
    char *scratch = NULL;
    if (!contig) {
        scratch =
            ag__scratch(0, (size_t)omp_get_max_threads() * (size_t)nops * (size_t)w->len * esz);
        if (!scratch)
            return AG_ENOMEM;
    }
    ROWS_FOR(*w, {
        char *p[ROWS_MAX_OPS] = {NULL, NULL, NULL};
        for (int k = 0; k < nops; k++)
            p[k] = base[k] + (size_t)off[k] * esz;
        if (contig) {
            fn(p[0], p[1], p[2], len, logp);
        } else {
            char *sc = scratch + (size_t)omp_get_thread_num() * (size_t)(nops * len) * esz;
            char *q[ROWS_MAX_OPS] = {sc, NULL, NULL};
            for (int k = 1; k < nops; k++) {
                q[k] = sc + (size_t)(k * len) * esz;
                strided_copy(q[k], 1, p[k], w->step[k], len, esz);
            }
            fn(q[0], q[1], q[2], len, logp);
            strided_copy(p[0], w->step[0], q[0], 1, len, esz);
        }
    });
    return 0;
}

/* ---- argmax ---- */

/* Index of the first maximum; a NaN counts as the maximum (first NaN wins), as in PyTorch. */
#define ARGMAX_ROW(T, x, s, n, best)                                                               \
    do {                                                                                           \
        T bv = (x)[0];                                                                             \
        best = 0;                                                                                  \
        for (int64_t i = 1; i < (n); i++) {                                                        \
            T v = (x)[i * (s)];                                                                    \
            if (v > bv || (v != v && bv == bv)) {                                                  \
                bv = v;                                                                            \
                best = i;                                                                          \
            }                                                                                      \
        }                                                                                          \
    } while (0)

/* Contiguous float rows: the (vectorized) max first, then the first element equal to it. */
#define DEFINE_ARGMAX(T, SFX)                                                                      \
    static int64_t argmax_##SFX(const T *x, int64_t n, int64_t s) {                                \
        int64_t best;                                                                              \
        if (s != 1) {                                                                              \
            ARGMAX_ROW(T, x, s, n, best);                                                          \
            return best;                                                                           \
        }                                                                                          \
        const T m = vmax_##SFX(x, n, 1);                                                           \
        for (int64_t i = 0; i < n; i++)                                                            \
            if (x[i] == m || (m != m && x[i] != x[i]))                                             \
                return i;                                                                          \
        return 0;                                                                                  \
    }

DEFINE_ARGMAX(float, f32)
DEFINE_ARGMAX(double, f64)

static int64_t argmax_any(ag_dtype dt, const char *x, int64_t n, int64_t s) {
    if (dt == AG_F32)
        return argmax_f32((const float *)(const void *)x, n, s);
    if (dt == AG_F64)
        return argmax_f64((const double *)(const void *)x, n, s);
    const int64_t *xi = (const int64_t *)(const void *)x;
    int64_t best;
    ARGMAX_ROW(int64_t, xi, s, n, best);
    return best;
}

int ag__argmax(ag_tensor *x, int dim, ag_tensor *out) {
    int64_t *po = (int64_t *)(void *)ag__base(out);
    const size_t esz = ag_dtype_size(x->dtype);
    if (dim < 0) {
        /* The flattened index: read contiguous memory (a copy for strided inputs). */
        ag__scratch_tensor tmp;
        const ag_tensor *cx;
        int rc = ag__scratch_contiguous(&tmp, 0, x, &cx);
        if (rc)
            return rc;
        po[0] = argmax_any(x->dtype, ag__base(cx), ag__numel(x->ndim, x->sizes), 1);
        return 0;
    }
    rows w;
    rows_build(&w, &x, 1, dim);
    /* The output is contiguous over the other dims in order: row r's result goes to po[r]. */
    const char *px = ag__base(x);
    ROWS_FOR(w, { po[r] = argmax_any(x->dtype, px + (size_t)off[0] * esz, len, w.step[0]); });
    return 0;
}

/* ---- softmax, log_softmax and their backward ---- */

/* One contiguous row: y = softmax(x) or log_softmax(x). The max is subtracted first; exp is
 * taken in the input's precision and summed in double. A row with a NaN gives NaN, as does a
 * row of -inf (as in PyTorch). */
#define DEFINE_SOFTMAX_ROW(T, SFX, EXP)                                                            \
    static void softmax_row_##SFX(void *yv, const void *xv, const void *unused, int64_t n,         \
                                  bool logp) {                                                     \
        T *y = yv;                                                                                 \
        const T *x = xv;                                                                           \
        const T m = vmax_##SFX(x, n, 1);                                                           \
        for (int64_t i = 0; i < n; i++)                                                            \
            y[i] = EXP(x[i] - m);                                                                  \
        const double s = vsum_##SFX(y, n, 1);                                                      \
        if (logp) {                                                                                \
            const T ls = (T)log(s);                                                                \
            for (int64_t i = 0; i < n; i++)                                                        \
                y[i] = (x[i] - m) - ls;                                                            \
        } else {                                                                                   \
            const T inv = (T)(1.0 / s);                                                            \
            for (int64_t i = 0; i < n; i++)                                                        \
                y[i] *= inv;                                                                       \
        }                                                                                          \
    }

DEFINE_SOFTMAX_ROW(float, f32, exp_f32)
DEFINE_SOFTMAX_ROW(double, f64, exp_f64)

int ag__softmax(ag_tensor *x, int dim, bool logp, ag_tensor *out) {
    rows w;
    ag_tensor *ts[2] = {out, x};
    rows_build(&w, ts, 2, dim);
    char *base[2] = {ag__base(out), ag__base(x)};
    return rows_apply(&w, base, ag_dtype_size(x->dtype),
                      x->dtype == AG_F32 ? softmax_row_f32 : softmax_row_f64, logp);
}

/* One contiguous row. softmax: gi = y (g - sum(g y)); log_softmax: gi = g - exp(y) sum(g).
 * Row sums in double. */
#define DEFINE_BWDATA_ROW(T, SFX, EXP)                                                             \
    static void bwdata_row_##SFX(void *giv, const void *gv, const void *yv, int64_t n,             \
                                 bool logp) {                                                      \
        T *gi = giv;                                                                               \
        const T *g = gv, *y = yv;                                                                  \
        if (logp) {                                                                                \
            const T s = (T)vsum_##SFX(g, n, 1);                                                    \
            for (int64_t i = 0; i < n; i++)                                                        \
                gi[i] = g[i] - EXP(y[i]) * s;                                                      \
        } else {                                                                                   \
            const T s = (T)vdot_##SFX(g, y, n);                                                    \
            for (int64_t i = 0; i < n; i++)                                                        \
                gi[i] = y[i] * (g[i] - s);                                                         \
        }                                                                                          \
    }

DEFINE_BWDATA_ROW(float, f32, exp_f32)
DEFINE_BWDATA_ROW(double, f64, exp_f64)

int ag__softmax_backward(ag_tensor *g, ag_tensor *y, int dim, bool logp, ag_tensor *out) {
    rows w;
    ag_tensor *ts[3] = {out, g, y};
    rows_build(&w, ts, 3, dim);
    char *base[3] = {ag__base(out), ag__base(g), ag__base(y)};
    return rows_apply(&w, base, ag_dtype_size(out->dtype),
                      out->dtype == AG_F32 ? bwdata_row_f32 : bwdata_row_f64, logp);
}

/* ---- fused with nll_loss_backward (the executor's fusion, src/runtime/fuse.c) ---- */

/* Row i of nll_loss_backward (no weight) is zero but at the target, where it is
 * val_i = -g_i (g_i = g[i] for reduction none, g[0] else, divided by `total` for mean; 0 for an
 * ignored row); log_softmax's backward helper then gives gi = d - exp(y) sum(d), and sum(d) is
 * val_i exactly (a sum of zeros and one value). The same expressions as nllb_kernel and
 * bwdata_row, without writing or reading the dense d unless `dnll` asks for it. */
#define FUSED_CE_BWD(T, EXP)                                                                       \
    do {                                                                                           \
        const T *y = yv;                                                                           \
        T *gx = outv, *d = dnllv;                                                                  \
        _Pragma("omp parallel for schedule(static) if (par)") for (int64_t i = 0; i < N; i++) {    \
            const int64_t t = target[i];                                                           \
            T val = 0;                                                                             \
            if (t != ignore) {                                                                     \
                double gi = ag__get_f64(g, per_row ? i : 0);                                       \
                if (mean)                                                                          \
                    gi /= total;                                                                   \
                val = (T)(-1.0 * gi);                                                              \
            }                                                                                      \
            const T s = val, *yi = y + i * C;                                                      \
            T *o = gx + i * C;                                                                     \
            for (int64_t j = 0; j < C; j++)                                                        \
                o[j] = (j == t ? val : (T)0) - EXP(yi[j]) * s;                                     \
            if (d) {                                                                               \
                memset(d + i * C, 0, sizeof(T) * (size_t)C);                                       \
                if (t != ignore)                                                                   \
                    d[i * C + t] = val;                                                            \
            }                                                                                      \
        }                                                                                          \
    } while (0)

int ag__fused_nll_log_softmax_backward(const ag_tensor *g, bool per_row, bool mean, double total,
                                       const int64_t *target, int64_t ignore, ag_dtype dt,
                                       const void *yv, void *outv, void *dnllv, int64_t N,
                                       int64_t C) {
    for (int64_t i = 0; i < N; i++)
        if (target[i] != ignore && (target[i] < 0 || target[i] >= C))
            return 1; /* out of range: the ops themselves report it */
    const bool par = N > 1 && N * C >= AG__PAR_MIN;
    if (dt == AG_F32)
        FUSED_CE_BWD(float, exp_f32);
    else
        FUSED_CE_BWD(double, exp_f64);
    return 0;
}
