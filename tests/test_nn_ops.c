/* Tests of the neural-network ops (src/ops/norm.c, src/ops/nn_ops.c): layer norm, batch norm,
 * embedding, nll_loss / cross_entropy, dropout and scaled-dot-product attention. Every expected
 * value comes from an independent float64 formula written here (or a hand-computed number),
 * never from the code under test; backward rules are checked against finite differences done
 * here, on top of the central gradcheck of the op samples. */
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- helpers ---- */

/* Deterministic values in [lo, hi) (xorshift), independent of the library's generator. */
static ag_tensor *rand_t(ag_dtype dt, int nd, const int64_t *sz, double lo, double hi,
                         uint64_t seed) {
    uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
    return tu_rand_tensor(dt, nd, sz, lo, hi, tu_xorshift, &s);
}

static ag_tensor *idx_t(int nd, const int64_t *sz, const int64_t *vals) {
    ag_tensor *t = ag_from_data(AG_I64, nd, sz, vals);
    assert_non_null(t);
    return t;
}

static double at(const ag_tensor *t, int64_t i) {
    return ag_tensor_item_at(t, i);
}

/* A function of some float64 leaves returning one tensor (scope-owned). */
typedef ag_tensor *(*fwd_fn)(ag_tensor *const *in, void *ud);

/* sum_i w_i * f(in)_i with fixed weights w (scope-local, no grad). */
static double weighted(fwd_fn f, void *ud, ag_tensor *const *in, ag_tensor *w) {
    bool prev = ag_set_grad_enabled(false);
    ag_scope_begin();
    ag_tensor *y = f(in, ud);
    assert_non_null(y);
    double acc = 0;
    for (int64_t i = 0; i < ag_tensor_numel(y); i++)
        acc += at(w, i) * at(y, i);
    ag_scope_end();
    ag_set_grad_enabled(prev);
    return acc;
}

/* Checks the gradients of sum(w * f(in)) from ag_backward against central differences. The
 * inputs must be contiguous float64 leaves. */
static void check_fd(fwd_fn f, void *ud, ag_tensor *const *in, int nin, double tol) {
    ag_scope_begin();
    for (int i = 0; i < nin; i++) {
        ag_tensor_set_grad(in[i], NULL);
        assert_int_equal(ag_tensor_set_requires_grad(in[i], true), 0);
    }
    ag_tensor *y = f(in, ud);
    assert_non_null(y);
    ag_tensor *w = rand_t(AG_F64, ag_tensor_ndim(y), ag_tensor_sizes(y), 0.5, 1.5, 77);
    assert_int_equal(ag_backward(y, w, false), 0);
    for (int i = 0; i < nin; i++) {
        ag_tensor *g = ag_tensor_grad(in[i]);
        double *p = ag_tensor_data(in[i]);
        for (int64_t e = 0; e < ag_tensor_numel(in[i]); e++) {
            const double h = 1e-6, orig = p[e];
            p[e] = orig + h;
            double fp = weighted(f, ud, in, w);
            p[e] = orig - h;
            double fm = weighted(f, ud, in, w);
            p[e] = orig;
            double num = (fp - fm) / (2 * h), ana = g ? at(g, e) : 0.0;
            char what[32];
            snprintf(what, sizeof what, "grad of input %d", i);
            tu_assert_near(ana, num, tol, what, e);
        }
    }
    ag_scope_end();
}

/* ====================================================================================== */
/* ---- layer norm ---- */

/* Reference: rows of length N, biased variance. */
static void ln_ref(const ag_tensor *x, const ag_tensor *w, const ag_tensor *b, int64_t N,
                   double eps, double *y, double *mean, double *rstd) {
    int64_t M = ag_tensor_numel(x) / N;
    for (int64_t i = 0; i < M; i++) {
        double s = 0, v = 0;
        for (int64_t j = 0; j < N; j++)
            s += at(x, i * N + j);
        double mu = s / N;
        for (int64_t j = 0; j < N; j++)
            v += (at(x, i * N + j) - mu) * (at(x, i * N + j) - mu);
        double r = 1 / sqrt(v / N + eps);
        for (int64_t j = 0; j < N; j++)
            y[i * N + j] = (at(x, i * N + j) - mu) * r * (w ? at(w, j) : 1) + (b ? at(b, j) : 0);
        mean[i] = mu;
        rstd[i] = r;
    }
}

static void test_layer_norm_values(void **st) {
    (void)st;
    ag_scope_begin();
    for (int dt = AG_F32; dt <= AG_F64; dt++) {
        const double tol = dt == AG_F32 ? 1e-5 : 1e-12;
        int64_t xs[] = {2, 3, 4}, ns[] = {4};
        ag_tensor *x = rand_t(dt, 3, xs, -2, 3, 1);
        ag_tensor *w = rand_t(dt, 1, ns, 0.5, 1.5, 2), *b = rand_t(dt, 1, ns, -1, 1, 3);
        ag_tensor *out, *mean, *rstd;
        assert_int_equal(ag_native_layer_norm(x, 1, ns, w, b, 1e-5, &out, &mean, &rstd), 0);
        double y[24], m[6], r[6];
        ln_ref(x, w, b, 4, 1e-5, y, m, r);
        tu_assert_shape(out, 3, xs);
        tu_assert_shape(mean, 3, (int64_t[]){2, 3, 1});
        tu_assert_shape(rstd, 3, (int64_t[]){2, 3, 1});
        assert_int_equal(ag_tensor_dtype(out), dt);
        tu_assert_close_named(out, y, tol, "out");
        tu_assert_close_named(mean, m, tol, "mean");
        tu_assert_close_named(rstd, r, tol, "rstd");

        /* Over the last two dims, no affine, through the composite. */
        int64_t ns2[] = {3, 4};
        ag_tensor *y2 = ag_layer_norm(x, 2, ns2, NULL, NULL, 1e-5);
        double yy[24], m2[2], r2[2];
        ln_ref(x, NULL, NULL, 12, 1e-5, yy, m2, r2);
        tu_assert_close_named(y2, yy, tol, "layer_norm 2 dims");
    }
    ag_scope_end();
}

static void test_layer_norm_noncontiguous(void **st) {
    (void)st;
    ag_scope_begin();
    int64_t bs[] = {4, 3};
    ag_tensor *base = rand_t(AG_F64, 2, bs, -2, 2, 5);
    ag_tensor *x = ag_t(base); /* (3, 4), strides (1, 3) */
    assert_false(ag_tensor_is_contiguous(x));
    ag_tensor *xc = ag_clone(x);
    int64_t ns[] = {4};
    ag_tensor *w = rand_t(AG_F64, 1, ns, 0.5, 1.5, 6);
    ag_tensor *y = ag_layer_norm(x, 1, ns, w, NULL, 1e-5);
    double ref[12], m[3], r[3];
    ln_ref(xc, w, NULL, 4, 1e-5, ref, m, r);
    tu_assert_close_named(y, ref, 1e-12, "strided layer norm");
    ag_scope_end();
}

static ag_tensor *ln_fn(ag_tensor *const *in, void *ud) {
    (void)ud;
    int64_t ns[] = {4};
    return ag_layer_norm(in[0], 1, ns, in[1], in[2], 1e-5);
}

static void test_layer_norm_backward(void **st) {
    (void)st;
    ag_scope_begin();
    int64_t xs[] = {3, 4}, ns[] = {4};
    ag_tensor *in[3] = {rand_t(AG_F64, 2, xs, -2, 2, 8), rand_t(AG_F64, 1, ns, 0.5, 1.5, 9),
                        rand_t(AG_F64, 1, ns, -1, 1, 10)};
    check_fd(ln_fn, NULL, in, 3, 1e-6);
    /* layer_norm is composite: the autograd node is native_layer_norm's. */
    ag_tensor *y = ln_fn(in, NULL);
    assert_string_equal(ag_tensor_grad_fn_name(y), "native_layer_norm");
    ag_scope_end();
}

static void test_layer_norm_errors(void **st) {
    (void)st;
    ag_scope_begin();
    int64_t xs[] = {2, 3}, bad[] = {4}, ok[] = {3}, w2[] = {2};
    ag_tensor *x = rand_t(AG_F32, 2, xs, -1, 1, 11);
    ag_clear_error();
    assert_null(ag_layer_norm(x, 1, bad, NULL, NULL, 1e-5));
    tu_assert_error_contains("native_layer_norm");
    tu_assert_error_contains("normalized_shape [4]");
    tu_assert_error_contains("[2, 3]");
    ag_clear_error();
    assert_null(ag_layer_norm(x, 1, ok, rand_t(AG_F32, 1, w2, 0, 1, 1), NULL, 1e-5));
    tu_assert_error_contains("weight has shape [2], expected [3]");
    ag_clear_error();
    assert_null(ag_layer_norm(x, 1, ok, rand_t(AG_F64, 1, ok, 0, 1, 1), NULL, 1e-5));
    tu_assert_error_contains("dtype f64");
    ag_scope_end();
}

/* ====================================================================================== */
/* ---- batch norm ---- */

/* x is (N, C, S) row-major; per channel: batch mean, biased var (training) or given stats. */
static void bn_ref(const ag_tensor *x, int64_t N, int64_t C, int64_t S, const double *mean,
                   const double *var, const ag_tensor *w, const ag_tensor *b, double eps,
                   double *y) {
    for (int64_t n = 0; n < N; n++)
        for (int64_t c = 0; c < C; c++)
            for (int64_t j = 0; j < S; j++) {
                int64_t i = (n * C + c) * S + j;
                y[i] = (at(x, i) - mean[c]) / sqrt(var[c] + eps) * (w ? at(w, c) : 1) +
                       (b ? at(b, c) : 0);
            }
}

static void batch_stats(const ag_tensor *x, int64_t N, int64_t C, int64_t S, double *mean,
                        double *var) {
    for (int64_t c = 0; c < C; c++) {
        double s = 0, v = 0;
        for (int64_t n = 0; n < N; n++)
            for (int64_t j = 0; j < S; j++)
                s += at(x, (n * C + c) * S + j);
        mean[c] = s / (N * S);
        for (int64_t n = 0; n < N; n++)
            for (int64_t j = 0; j < S; j++) {
                double d = at(x, (n * C + c) * S + j) - mean[c];
                v += d * d;
            }
        var[c] = v / (N * S);
    }
}

static void test_batch_norm_training(void **st) {
    (void)st;
    ag_scope_begin();
    for (int dt = AG_F32; dt <= AG_F64; dt++) {
        const double tol = dt == AG_F32 ? 1e-5 : 1e-12;
        int64_t xs[] = {2, 3, 2, 2}, cs[] = {3};
        ag_tensor *x = rand_t(dt, 4, xs, -2, 3, 20);
        ag_tensor *w = rand_t(dt, 1, cs, 0.5, 1.5, 21), *b = rand_t(dt, 1, cs, -1, 1, 22);
        ag_tensor *rm = tu_tensor(dt, 1, cs, (double[]){0.1, -0.2, 0.3});
        ag_tensor *rv = tu_tensor(dt, 1, cs, (double[]){1.0, 2.0, 0.5});
        uint64_t v0 = ag_tensor_version(rm);
        ag_tensor *out, *sm, *si;
        assert_int_equal(ag_native_batch_norm(x, w, b, rm, rv, true, 0.1, 1e-5, &out, &sm, &si), 0);
        double mean[3], var[3], y[24];
        batch_stats(x, 2, 3, 4, mean, var);
        bn_ref(x, 2, 3, 4, mean, var, w, b, 1e-5, y);
        tu_assert_close_named(out, y, tol, "bn out");
        tu_assert_close_named(sm, mean, tol, "save_mean");
        double invstd[3], rm_want[3], rv_want[3];
        const double rm0[] = {0.1, -0.2, 0.3}, rv0[] = {1.0, 2.0, 0.5};
        for (int c = 0; c < 3; c++) {
            invstd[c] = 1 / sqrt(var[c] + 1e-5);
            rm_want[c] = 0.9 * rm0[c] + 0.1 * mean[c];
            rv_want[c] = 0.9 * rv0[c] + 0.1 * var[c] * 8.0 / 7.0; /* unbiased: n = 8 */
        }
        tu_assert_close_named(si, invstd, tol, "save_invstd");
        tu_assert_close_named(rm, rm_want, tol, "running_mean");
        tu_assert_close_named(rv, rv_want, tol, "running_var");
        assert_true(ag_tensor_version(rm) > v0); /* (a!) bumps the version */
    }
    ag_scope_end();
}

static void test_batch_norm_eval_and_strided(void **st) {
    (void)st;
    ag_scope_begin();
    int64_t xs[] = {4, 3}, cs[] = {3};
    ag_tensor *x = rand_t(AG_F64, 2, xs, -2, 2, 30);
    const double rm0[] = {0.5, -1, 0}, rv0[] = {2, 0.25, 1};
    ag_tensor *rm = tu_tensor(AG_F64, 1, cs, rm0), *rv = tu_tensor(AG_F64, 1, cs, rv0);
    ag_tensor *w = rand_t(AG_F64, 1, cs, 0.5, 1.5, 31);
    ag_tensor *out;
    assert_int_equal(ag_native_batch_norm(x, w, NULL, rm, rv, false, 0.1, 1e-5, &out, NULL, NULL),
                     0);
    double y[12];
    bn_ref(x, 4, 3, 1, rm0, rv0, w, NULL, 1e-5, y);
    tu_assert_close_named(out, y, 1e-12, "bn eval");
    tu_assert_close_named(rm, rm0, 0, "running_mean untouched in eval");
    tu_assert_close_named(rv, rv0, 0, "running_var untouched in eval");

    /* Training on a transposed (non-contiguous) input, no running stats. */
    int64_t bs[] = {3, 5};
    ag_tensor *xt = ag_t(rand_t(AG_F64, 2, bs, -2, 2, 32)); /* (5, 3) */
    ag_tensor *xc = ag_clone(xt);
    assert_int_equal(
        ag_native_batch_norm(xt, NULL, NULL, NULL, NULL, true, 0.1, 1e-5, &out, NULL, NULL), 0);
    double mean[3], var[3], y2[15];
    batch_stats(xc, 5, 3, 1, mean, var);
    bn_ref(xc, 5, 3, 1, mean, var, NULL, NULL, 1e-5, y2);
    tu_assert_close_named(out, y2, 1e-12, "bn strided");

    /* Errors. */
    ag_clear_error();
    assert_int_not_equal(
        ag_native_batch_norm(x, NULL, NULL, NULL, NULL, false, 0.1, 1e-5, &out, NULL, NULL), 0);
    tu_assert_error_contains("native_batch_norm: running_mean and running_var must be given");
    int64_t one[] = {1, 3};
    ag_clear_error();
    assert_int_not_equal(ag_native_batch_norm(rand_t(AG_F64, 2, one, 0, 1, 1), NULL, NULL, NULL,
                                              NULL, true, 0.1, 1e-5, &out, NULL, NULL),
                         0);
    tu_assert_error_contains("more than 1 value per channel");
    int64_t c4[] = {4};
    ag_clear_error();
    assert_int_not_equal(ag_native_batch_norm(x, rand_t(AG_F64, 1, c4, 0, 1, 1), NULL, NULL, NULL,
                                              true, 0.1, 1e-5, &out, NULL, NULL),
                         0);
    tu_assert_error_contains("weight has shape [4], expected [3]");
    ag_scope_end();
}

/* Planes wide enough for the kernels' vector loops (16 values a step) plus a scalar tail: 35
 * and 784 values per image, float32 and float64, data centred far from 0 (the variance must
 * come from deviations, not from a difference of large squares). Forward and
 * native_batch_norm_backward against sums in double written here. */
static void test_batch_norm_wide(void **st) {
    (void)st;
    ag_scope_begin();
    const int64_t shapes[2][4] = {{3, 4, 5, 7}, {2, 3, 28, 28}};
    const ag_op *bwop = ag_op_find("native_batch_norm_backward");
    for (int dt = AG_F32; dt <= AG_F64; dt++)
        for (int k = 0; k < 2; k++) {
            const int64_t *xs = shapes[k], N = xs[0], C = xs[1], S = xs[2] * xs[3];
            const int64_t cs[] = {C}, M = N * C * S;
            const double tol = dt == AG_F32 ? 2e-5 : 1e-11;
            ag_tensor *x = rand_t(dt, 4, xs, 99, 101, 50 + k);
            ag_tensor *g = rand_t(dt, 4, xs, -1, 1, 52 + k);
            ag_tensor *w = rand_t(dt, 1, cs, 0.5, 1.5, 54), *b = rand_t(dt, 1, cs, -1, 1, 55);
            ag_tensor *out, *sm, *si;
            assert_int_equal(
                ag_native_batch_norm(x, w, b, NULL, NULL, true, 0.1, 1e-5, &out, &sm, &si), 0);
            double *mean = test_malloc(sizeof(double) * (size_t)C);
            double *var = test_malloc(sizeof(double) * (size_t)C);
            double *invstd = test_malloc(sizeof(double) * (size_t)C);
            double *y = test_malloc(sizeof(double) * (size_t)M);
            batch_stats(x, N, C, S, mean, var);
            bn_ref(x, N, C, S, mean, var, w, b, 1e-5, y);
            for (int64_t c = 0; c < C; c++)
                invstd[c] = 1 / sqrt(var[c] + 1e-5);
            tu_assert_close_named(out, y, tol, "bn out (wide)");
            tu_assert_close_named(sm, mean, tol * 100, "save_mean (wide)");
            tu_assert_close_named(si, invstd, tol, "save_invstd (wide)");

            /* gx = (g - mean(g) - xhat * mean(g * xhat)) * invstd * w, gw = sum(g * xhat),
             * gb = sum(g), with the saved statistics. */
            int64_t mask[3] = {1, 1, 1};
            ag_tensor *r[3];
            assert_true(ag_op_call(bwop,
                                   (ag_arg[]){AG_A_T(g), AG_A_T(x), AG_A_T(w), AG_A_NONE, AG_A_NONE,
                                              AG_A_T(sm), AG_A_T(si), AG_A_B(true), AG_A_F(1e-5),
                                              AG_A_INTS(mask, 3)},
                                   10, r) >= 0);
            double *gx = test_malloc(sizeof(double) * (size_t)M);
            double *gw = test_malloc(sizeof(double) * (size_t)C);
            double *gb = test_malloc(sizeof(double) * (size_t)C);
            for (int64_t c = 0; c < C; c++) {
                const double mu = at(sm, c), is = at(si, c);
                double sg = 0, sgx = 0;
                for (int64_t n = 0; n < N; n++)
                    for (int64_t j = 0; j < S; j++) {
                        const int64_t i = (n * C + c) * S + j;
                        sg += at(g, i);
                        sgx += at(g, i) * (at(x, i) - mu) * is;
                    }
                gw[c] = sgx;
                gb[c] = sg;
                for (int64_t n = 0; n < N; n++)
                    for (int64_t j = 0; j < S; j++) {
                        const int64_t i = (n * C + c) * S + j;
                        const double xh = (at(x, i) - mu) * is;
                        gx[i] = (at(g, i) - sg / (double)(N * S) - xh * sgx / (double)(N * S)) *
                                is * at(w, c);
                    }
            }
            tu_assert_close_named(r[0], gx, tol, "bn grad_input (wide)");
            tu_assert_close_named(r[1], gw, tol * (double)(N * S), "bn grad_weight (wide)");
            tu_assert_close_named(r[2], gb, tol * (double)(N * S), "bn grad_bias (wide)");
            test_free(mean);
            test_free(var);
            test_free(invstd);
            test_free(y);
            test_free(gx);
            test_free(gw);
            test_free(gb);
        }
    ag_scope_end();
}

typedef struct {
    bool training;
    ag_tensor *rm, *rv;
} bn_ud;

static ag_tensor *bn_fn(ag_tensor *const *in, void *ud) {
    bn_ud *u = ud;
    ag_tensor *out = NULL;
    ag_native_batch_norm(in[0], in[1], in[2], u->rm, u->rv, u->training, 0.1, 1e-5, &out, NULL,
                         NULL);
    return out;
}

static void test_batch_norm_backward(void **st) {
    (void)st;
    ag_scope_begin();
    int64_t xs[] = {3, 2, 2}, cs[] = {2};
    for (int training = 1; training >= 0; training--) {
        bn_ud u = {training, tu_tensor(AG_F64, 1, cs, (double[]){0.2, -0.1}),
                   tu_tensor(AG_F64, 1, cs, (double[]){1.5, 0.7})};
        ag_tensor *in[3] = {rand_t(AG_F64, 3, xs, -2, 2, 40), rand_t(AG_F64, 1, cs, 0.5, 1.5, 41),
                            rand_t(AG_F64, 1, cs, -1, 1, 42)};
        check_fd(bn_fn, &u, in, 3, 1e-6);
    }
    /* Two training forwards before one backward: the running stats change in between, and
     * backward must not depend on them (PyTorch allows this). */
    bn_ud u = {true, tu_tensor(AG_F64, 1, cs, (double[]){0, 0}),
               tu_tensor(AG_F64, 1, cs, (double[]){1, 1})};
    ag_tensor *x = rand_t(AG_F64, 3, xs, -2, 2, 43);
    ag_tensor_set_requires_grad(x, true);
    ag_tensor *in[3] = {x, NULL, NULL};
    ag_tensor *y1 = bn_fn(in, &u), *y2 = bn_fn(in, &u);
    assert_int_equal(ag_backward(ag_sum_all(ag_add(ag_mul(y1, y1), y2)), NULL, false), 0);
    assert_non_null(ag_tensor_grad(x));
    ag_scope_end();
}

/* ====================================================================================== */
/* ---- embedding ---- */

static void test_embedding_forward(void **st) {
    (void)st;
    ag_scope_begin();
    int64_t ws[] = {5, 3}, is[] = {2, 2};
    ag_tensor *w = rand_t(AG_F32, 2, ws, -1, 1, 50);
    ag_tensor *ix = idx_t(2, is, (int64_t[]){4, 0, 4, 2});
    ag_tensor *y = ag_embedding(w, ix);
    tu_assert_shape(y, 3, (int64_t[]){2, 2, 3});
    const int64_t rows[] = {4, 0, 4, 2};
    for (int r = 0; r < 4; r++)
        for (int j = 0; j < 3; j++)
            tu_assert_near(at(y, r * 3 + j), at(w, rows[r] * 3 + j), 0, "embedding", r * 3 + j);
    /* A transposed (non-contiguous) table and 0-d indices. */
    int64_t ts[] = {3, 5};
    ag_tensor *wt = ag_t(rand_t(AG_F64, 2, ts, -1, 1, 51)); /* (5, 3) */
    ag_tensor *y0 = ag_embedding(wt, idx_t(0, NULL, (int64_t[]){3}));
    tu_assert_shape(y0, 1, (int64_t[]){3});
    for (int j = 0; j < 3; j++)
        tu_assert_near(at(y0, j), at(wt, 3 * 3 + j), 0, "embedding strided", j);
    /* Out-of-range and negative indices. */
    ag_clear_error();
    assert_null(ag_embedding(w, idx_t(1, (int64_t[]){3}, (int64_t[]){1, 7, 2})));
    tu_assert_error_contains("embedding: index 7");
    tu_assert_error_contains("5 rows");
    ag_clear_error();
    assert_null(ag_embedding(w, idx_t(1, (int64_t[]){1}, (int64_t[]){-1})));
    tu_assert_error_contains("index -1");
    ag_clear_error();
    assert_null(ag_embedding(w, rand_t(AG_F32, 1, (int64_t[]){2}, 0, 1, 1)));
    tu_assert_error_contains("embedding: indices must be int64");
    ag_scope_end();
}

static void test_embedding_backward(void **st) {
    (void)st;
    ag_scope_begin();
    int64_t ws[] = {4, 2}, is[] = {5};
    ag_tensor *w = rand_t(AG_F64, 2, ws, -1, 1, 52);
    ag_tensor_set_requires_grad(w, true);
    ag_tensor *ix = idx_t(1, is, (int64_t[]){1, 3, 1, 1, 0});
    /* grad_out row r = (r + 1, 10 * (r + 1)). */
    double gv[10];
    for (int r = 0; r < 5; r++) {
        gv[2 * r] = r + 1;
        gv[2 * r + 1] = 10 * (r + 1);
    }
    ag_tensor *g = tu_tensor(AG_F64, 2, (int64_t[]){5, 2}, gv);
    ag_tensor *y = ag_embedding(w, ix);
    assert_string_equal(ag_tensor_grad_fn_name(y), "embedding");
    assert_int_equal(ag_backward(y, g, false), 0);
    /* row 1 gets positions 0, 2, 3 (1 + 3 + 4 = 8); row 3 position 1; row 0 position 4. */
    const double want[] = {5, 50, 8, 80, 0, 0, 2, 20};
    tu_assert_close_named(ag_tensor_grad(w), want, 0, "embedding grad");

    /* padding_idx = 1 gets no gradient; through the op with its full schema. */
    const ag_op *op = ag_op_find("embedding");
    ag_tensor_set_grad(w, NULL);
    ag_tensor *yp = ag_op_call1(op, (ag_arg[]){AG_A_T(w), AG_A_T(ix), AG_A_I(1)}, 3);
    assert_int_equal(ag_backward(yp, g, false), 0);
    const double want_pad[] = {5, 50, 0, 0, 0, 0, 2, 20};
    tu_assert_close_named(ag_tensor_grad(w), want_pad, 0, "embedding grad with padding_idx");

    /* scale_grad_by_freq divides by the count of each index (row 1 occurs 3 times). */
    const ag_op *edb = ag_op_find("embedding_dense_backward");
    ag_tensor *gf =
        ag_op_call1(edb, (ag_arg[]){AG_A_T(g), AG_A_T(ix), AG_A_I(4), AG_A_I(-1), AG_A_B(true)}, 5);
    const double want_freq[] = {5, 50, 8.0 / 3, 80.0 / 3, 0, 0, 2, 20};
    tu_assert_close_named(gf, want_freq, 1e-15, "scale_grad_by_freq");
    ag_clear_error();
    assert_null(ag_embedding_dense_backward(g, ix, 3, -1));
    tu_assert_error_contains("index 3");
    ag_scope_end();
}

/* ====================================================================================== */
/* ---- nll_loss / cross_entropy ---- */

static void test_nll_loss(void **st) {
    (void)st;
    ag_scope_begin();
    /* logp (3, 4); targets 2, -100 (ignored), 0. */
    const double lp[] = {-1.0, -2.0, -0.5, -3.0, -0.1, -0.2, -0.3, -0.4, -2.5, -1.5, -1.0, -0.7};
    ag_tensor *x = tu_tensor(AG_F64, 2, (int64_t[]){3, 4}, lp);
    ag_tensor *t = idx_t(1, (int64_t[]){3}, (int64_t[]){2, -100, 0});
    ag_tensor *none = ag_nll_loss(x, t, AG_REDUCTION_NONE, -100);
    tu_assert_close_named(none, (double[]){0.5, 0, 2.5}, 1e-15, "nll none");
    tu_assert_shape(none, 1, (int64_t[]){3});
    ag_tensor *sum = ag_nll_loss(x, t, AG_REDUCTION_SUM, -100);
    tu_assert_shape(sum, 0, NULL);
    tu_assert_near(ag_tensor_item(sum), 3.0, 1e-15, "nll sum", 0);
    /* mean divides by the 2 targets that are not ignored. */
    tu_assert_near(ag_tensor_item(ag_nll_loss(x, t, AG_REDUCTION_MEAN, -100)), 1.5, 1e-15,
                   "nll mean", 0);
    /* A class weight: (0.5 * 0.5 + 2 * 2.5) / (0.5 + 2). */
    const ag_op *op = ag_op_find("nll_loss_forward");
    ag_tensor *cw = tu_tensor(AG_F64, 1, (int64_t[]){4}, (double[]){2, 1, 0.5, 1});
    ag_tensor *r[2];
    assert_int_equal(ag_op_call(op,
                                (ag_arg[]){AG_A_T(x), AG_A_T(t), AG_A_T(cw),
                                           AG_A_I(AG_REDUCTION_MEAN), AG_A_I(-100)},
                                5, r),
                     0);
    tu_assert_near(ag_tensor_item(r[0]), (0.25 + 5.0) / 2.5, 1e-15, "weighted mean", 0);
    tu_assert_near(ag_tensor_item(r[1]), 2.5, 1e-15, "total_weight", 0);
    /* 1-d input with a 0-d target. */
    ag_tensor *x1 = tu_tensor(AG_F32, 1, (int64_t[]){3}, (double[]){-0.2, -1.1, -3});
    tu_assert_near(ag_tensor_item(ag_nll_loss(x1, idx_t(0, NULL, (int64_t[]){1}), 1, -100)), 1.1,
                   1e-6, "nll 1-d", 0);
    /* Backward: mean over 2 kept targets -> -1/2 at (0, 2) and (2, 0). */
    ag_tensor_set_requires_grad(x, true);
    assert_int_equal(ag_backward(ag_nll_loss(x, t, AG_REDUCTION_MEAN, -100), NULL, false), 0);
    double want[12] = {0};
    want[2] = -0.5;
    want[8] = -0.5;
    tu_assert_close_named(ag_tensor_grad(x), want, 1e-15, "nll grad");
    /* Errors: target out of range, wrong target shape. */
    ag_clear_error();
    assert_null(ag_nll_loss(x, idx_t(1, (int64_t[]){3}, (int64_t[]){1, 4, 0}), 1, -100));
    tu_assert_error_contains("nll_loss_forward: target 4 at position 1 is out of bounds for 4");
    ag_clear_error();
    assert_null(ag_nll_loss(x, idx_t(1, (int64_t[]){3}, (int64_t[]){1, -1, 0}), 1, -100));
    tu_assert_error_contains("target -1");
    ag_clear_error();
    assert_null(ag_nll_loss(x, idx_t(1, (int64_t[]){2}, (int64_t[]){1, 0}), 1, -100));
    tu_assert_error_contains("does not match self [3, 4]");
    ag_scope_end();
}

/* Reference cross entropy of one row with label smoothing ls. */
static double ce_row(const double *z, int C, int64_t t, double ls) {
    double m = z[0], s = 0, sumlp = 0;
    for (int c = 1; c < C; c++)
        m = z[c] > m ? z[c] : m;
    for (int c = 0; c < C; c++)
        s += exp(z[c] - m);
    double lse = m + log(s);
    for (int c = 0; c < C; c++)
        sumlp += z[c] - lse;
    return (1 - ls) * (lse - z[t]) + ls / C * (-sumlp);
}

static void test_cross_entropy(void **st) {
    (void)st;
    ag_scope_begin();
    int64_t xs[] = {4, 5};
    ag_tensor *z = rand_t(AG_F64, 2, xs, -3, 3, 60);
    double zv[20];
    ag_tensor_to_doubles(z, zv);
    const int64_t tv[] = {3, 0, -100, 4};
    ag_tensor *t = idx_t(1, (int64_t[]){4}, tv);
    double rows[4], sum = 0;
    for (int i = 0; i < 4; i++) {
        rows[i] = tv[i] == -100 ? 0 : ce_row(zv + 5 * i, 5, tv[i], 0);
        sum += rows[i];
    }
    tu_assert_close_named(ag_cross_entropy(z, t, AG_REDUCTION_NONE, -100), rows, 1e-12, "ce none");
    tu_assert_near(ag_tensor_item(ag_cross_entropy(z, t, AG_REDUCTION_SUM, -100)), sum, 1e-12,
                   "ce sum", 0);
    tu_assert_near(ag_tensor_item(ag_cross_entropy(z, t, AG_REDUCTION_MEAN, -100)), sum / 3, 1e-12,
                   "ce mean (3 kept targets)", 0);

    /* Label smoothing 0.1, mean over kept targets. */
    const ag_op *op = ag_op_find("cross_entropy_loss");
    ag_tensor *ls = ag_op_call1(
        op, (ag_arg[]){AG_A_T(z), AG_A_T(t), AG_A_NONE, AG_A_I(1), AG_A_I(-100), AG_A_F(0.1)}, 6);
    double lsum = 0;
    for (int i = 0; i < 4; i++)
        if (tv[i] != -100)
            lsum += ce_row(zv + 5 * i, 5, tv[i], 0.1);
    tu_assert_near(ag_tensor_item(ls), lsum / 3, 1e-12, "ce label smoothing", 0);

    /* Backward of the mean loss: (softmax - onehot) / 3 on kept rows, 0 on the ignored one. */
    ag_tensor_set_requires_grad(z, true);
    assert_int_equal(ag_backward(ag_cross_entropy(z, t, AG_REDUCTION_MEAN, -100), NULL, false), 0);
    double want[20];
    for (int i = 0; i < 4; i++) {
        double m = -INFINITY, s = 0;
        for (int c = 0; c < 5; c++)
            m = fmax(m, zv[5 * i + c]);
        for (int c = 0; c < 5; c++)
            s += exp(zv[5 * i + c] - m);
        for (int c = 0; c < 5; c++)
            want[5 * i + c] = tv[i] == -100 ? 0 : (exp(zv[5 * i + c] - m) / s - (c == tv[i])) / 3;
    }
    tu_assert_close_named(ag_tensor_grad(z), want, 1e-12, "ce grad");

    ag_clear_error();
    assert_null(ag_cross_entropy(z, idx_t(1, (int64_t[]){4}, (int64_t[]){0, 5, 1, 1}), 1, -100));
    tu_assert_error_contains("target 5 at position 1 is out of bounds for 5 classes");
    int64_t x3[] = {2, 3, 4};
    ag_clear_error();
    assert_null(ag_cross_entropy(rand_t(AG_F64, 3, x3, 0, 1, 1),
                                 idx_t(2, (int64_t[]){2, 4}, (int64_t[]){0, 0, 0, 0, 0, 0, 0, 0}),
                                 1, -100));
    tu_assert_error_contains("cross_entropy_loss");
    ag_scope_end();
}

/* ====================================================================================== */
/* ---- dropout ---- */

static void test_dropout(void **st) {
    (void)st;
    ag_scope_begin();
    const int64_t n = 200000;
    ag_tensor *x = ag_full(AG_F32, 1, &n, 2.0);
    ag_manual_seed(123);
    ag_tensor *y, *m;
    assert_int_equal(ag_native_dropout(x, 0.3, true, &y, &m), 0);
    assert_int_equal(ag_tensor_dtype(m), AG_BOOL);
    int64_t kept = 0;
    const bool *mb = ag_tensor_data(m);
    const float *yv = ag_tensor_data(y);
    for (int64_t i = 0; i < n; i++) {
        kept += mb[i];
        /* kept values are scaled by 1 / (1 - p), dropped ones are 0 */
        if (fabs(yv[i] - (mb[i] ? 2.0 / 0.7 : 0.0)) > 1e-5)
            fail_msg("element %lld: %g with mask %d", (long long)i, yv[i], mb[i]);
    }
    /* density 0.7 within ~7 standard deviations (sd = sqrt(0.21 / n) ~ 0.001) */
    assert_true(fabs((double)kept / n - 0.7) < 0.007);

    /* The same seed (and offset) gives the same mask; the next draw a different one. */
    ag_manual_seed(123);
    ag_tensor *y2, *m2, *m3;
    assert_int_equal(ag_native_dropout(x, 0.3, true, &y2, &m2), 0);
    assert_int_equal(memcmp(ag_tensor_data(m), ag_tensor_data(m2), (size_t)n), 0);
    uint64_t seed, off;
    ag_rng_get_state(&seed, &off);
    assert_int_equal(off, n); /* the call after the seed reserved n counters */
    assert_int_equal(ag_native_dropout(x, 0.3, true, NULL, &m3), 0);
    assert_int_not_equal(memcmp(ag_tensor_data(m), ag_tensor_data(m3), (size_t)n), 0);

    /* Evaluation is the identity with an all-true mask; p = 0 and p = 1 in training. */
    int64_t xs[] = {3, 4};
    ag_tensor *xr = rand_t(AG_F64, 2, xs, -1, 1, 70);
    double xv[12], zeros[12] = {0}, ones[12];
    ag_tensor_to_doubles(xr, xv);
    for (int i = 0; i < 12; i++)
        ones[i] = 1;
    assert_int_equal(ag_native_dropout(xr, 0.5, false, &y, &m), 0);
    tu_assert_close_named(y, xv, 0, "eval output");
    tu_assert_close_named(m, ones, 0, "eval mask");
    tu_assert_close_named(ag_dropout(xr, 0.5, false), xv, 0, "dropout eval");
    tu_assert_close_named(ag_dropout(xr, 0.0, true), xv, 0, "dropout p=0");
    assert_int_equal(ag_native_dropout(xr, 0.0, true, &y, &m), 0);
    tu_assert_close_named(y, xv, 0, "native_dropout p=0");
    assert_int_equal(ag_native_dropout(xr, 1.0, true, &y, &m), 0);
    tu_assert_close_named(y, zeros, 0, "p=1 output");
    tu_assert_close_named(m, zeros, 0, "p=1 mask");

    /* Non-contiguous input: out = x * mask * 2 elementwise. */
    ag_tensor *xt = ag_t(xr);
    assert_int_equal(ag_native_dropout(xt, 0.5, true, &y, &m), 0);
    for (int64_t i = 0; i < 12; i++)
        tu_assert_near(at(y, i), at(xt, i) * at(m, i) * 2, 1e-15, "strided dropout", i);

    /* Backward: grad = mask / (1 - p). */
    ag_tensor_set_requires_grad(xr, true);
    ag_tensor *yd = ag_dropout(xr, 0.25, true);
    assert_string_equal(ag_tensor_grad_fn_name(yd), "native_dropout");
    assert_int_equal(ag_backward(ag_sum_all(yd), NULL, false), 0);
    for (int64_t i = 0; i < 12; i++) {
        double keep = at(yd, i) != 0;
        tu_assert_near(at(ag_tensor_grad(xr), i), keep / 0.75, 1e-15, "dropout grad", i);
    }

    ag_clear_error();
    assert_null(ag_dropout(xr, 1.5, true));
    tu_assert_error_contains("dropout probability has to be between 0 and 1, but got 1.5");
    ag_scope_end();
}

/* ====================================================================================== */
/* ---- attention ---- */

/* Naive float64 attention of one (batch, head): q (L, E), k (S, E), v (S, Ev) with element
 * accessors over flat row-major views; mask (L, S) additive (NULL: none). */
static void attn_ref(const double *q, const double *k, const double *v, int64_t L, int64_t S,
                     int64_t E, int64_t Ev, double scale, bool causal, const double *mask,
                     double *out, double *lse) {
    for (int64_t i = 0; i < L; i++) {
        double s[64], m = -INFINITY, sum = 0;
        for (int64_t j = 0; j < S; j++) {
            double d = 0;
            for (int64_t e = 0; e < E; e++)
                d += q[i * E + e] * k[j * E + e];
            s[j] = d * scale + (mask ? mask[i * S + j] : 0);
            if (causal && j > i)
                s[j] = -INFINITY;
            m = fmax(m, s[j]);
        }
        for (int64_t j = 0; j < S; j++)
            sum += exp(s[j] - m);
        for (int64_t c = 0; c < Ev; c++) {
            double o = 0;
            for (int64_t j = 0; j < S; j++)
                o += exp(s[j] - m) / sum * v[j * Ev + c];
            out[i * Ev + c] = o;
        }
        lse[i] = m + log(sum);
    }
}

/* Checks flash attention of (B, H, L, E) tensors against attn_ref, per (batch, head). */
static void check_attention(ag_tensor *q, ag_tensor *k, ag_tensor *v, bool causal, double scale,
                            ag_tensor *mask, double tol) {
    const ag_op *op = ag_op_find("_scaled_dot_product_flash_attention_for_cpu");
    ag_tensor *r[2];
    ag_arg args[] = {AG_A_T(q),
                     AG_A_T(k),
                     AG_A_T(v),
                     AG_A_F(0.0),
                     AG_A_B(causal),
                     AG_A_T(mask),
                     scale > 0 ? AG_A_F(scale) : AG_A_NONE};
    assert_int_equal(ag_op_call(op, args, 7, r), 0);
    int nd = ag_tensor_ndim(q);
    int64_t L = ag_tensor_size(q, -2), S = ag_tensor_size(k, -2), E = ag_tensor_size(q, -1);
    int64_t Ev = ag_tensor_size(v, -1), nb = ag_tensor_numel(q) / (L * E);
    double sc = scale > 0 ? scale : 1 / sqrt((double)E);
    double *qd = malloc(sizeof(double) * (size_t)(nb * L * E));
    double *kd = malloc(sizeof(double) * (size_t)(nb * S * E));
    double *vd = malloc(sizeof(double) * (size_t)(nb * S * Ev));
    double md[64 * 64];
    ag_tensor_to_doubles(q, qd);
    ag_tensor_to_doubles(k, kd);
    ag_tensor_to_doubles(v, vd);
    if (mask) /* (L, S) masks only here */
        ag_tensor_to_doubles(mask, md);
    tu_assert_shape(r[1], nd - 1, ag_tensor_sizes(q));
    for (int64_t b = 0; b < nb; b++) {
        double out[64 * 64], lse[64];
        attn_ref(qd + b * L * E, kd + b * S * E, vd + b * S * Ev, L, S, E, Ev, sc, causal,
                 mask ? md : NULL, out, lse);
        for (int64_t i = 0; i < L * Ev; i++)
            tu_assert_near(at(r[0], b * L * Ev + i), out[i], tol, "attention out", b * L * Ev + i);
        for (int64_t i = 0; i < L; i++)
            tu_assert_near(at(r[1], b * L + i), lse[i], tol, "logsumexp", b * L + i);
    }
    free(qd);
    free(kd);
    free(vd);
}

static void test_attention_forward(void **st) {
    (void)st;
    ag_scope_begin();
    int64_t s4[] = {2, 3, 5, 4};
    for (int dt = AG_F32; dt <= AG_F64; dt++) {
        const double tol = dt == AG_F32 ? 2e-5 : 1e-12;
        ag_tensor *q = rand_t(dt, 4, s4, -1, 1, 80), *k = rand_t(dt, 4, s4, -1, 1, 81);
        ag_tensor *v = rand_t(dt, 4, s4, -1, 1, 82);
        check_attention(q, k, v, false, 0, NULL, tol);
        check_attention(q, k, v, true, 0, NULL, tol);
        check_attention(q, k, v, true, 0.37, NULL, tol);
    }
    /* q/k/v as (B, L, H, E).transpose(1, 2): used in place (row stride H * E). */
    int64_t blhe[] = {2, 5, 3, 4};
    ag_tensor *q = ag_transpose(rand_t(AG_F64, 4, blhe, -1, 1, 83), 1, 2);
    ag_tensor *k = ag_transpose(rand_t(AG_F64, 4, blhe, -1, 1, 84), 1, 2);
    ag_tensor *v = ag_transpose(rand_t(AG_F64, 4, blhe, -1, 1, 85), 1, 2);
    assert_false(ag_tensor_is_contiguous(q));
    check_attention(q, k, v, true, 0, NULL, 1e-12);
    /* A last-dim-strided query (packed path), L != S, Ev != E, a float mask. */
    int64_t qs[] = {2, 4, 3}, ks[] = {2, 6, 4}, vs[] = {2, 6, 2}, ms[] = {3, 6};
    ag_tensor *qt = ag_transpose(rand_t(AG_F64, 3, qs, -1, 1, 86), 1, 2); /* (2, 3, 4) */
    ag_tensor *mask = rand_t(AG_F64, 2, ms, -2, 1, 87);
    check_attention(qt, rand_t(AG_F64, 3, ks, -1, 1, 88), rand_t(AG_F64, 3, vs, -1, 1, 89), false,
                    0, mask, 1e-12);
    /* A bool mask that removes a whole row: that row's output is 0 and lse -inf. */
    int64_t q1[] = {1, 2, 2};
    ag_tensor *bm = tu_tensor(AG_BOOL, 2, (int64_t[]){2, 2}, (double[]){1, 0, 0, 0});
    const ag_op *op = ag_op_find("_scaled_dot_product_flash_attention_for_cpu");
    ag_tensor *qq = rand_t(AG_F64, 3, q1, -1, 1, 90), *vv = rand_t(AG_F64, 3, q1, -1, 1, 91);
    ag_tensor *r[2];
    assert_int_equal(ag_op_call(op,
                                (ag_arg[]){AG_A_T(qq), AG_A_T(qq), AG_A_T(vv), AG_A_F(0),
                                           AG_A_B(false), AG_A_T(bm)},
                                6, r),
                     0);
    tu_assert_near(at(r[0], 0), at(vv, 0), 1e-15, "row 0 attends to key 0 only", 0);
    tu_assert_near(at(r[0], 1), at(vv, 1), 1e-15, "row 0 attends to key 0 only", 1);
    tu_assert_near(at(r[0], 2), 0, 0, "fully masked row", 2);
    assert_true(isinf(at(r[1], 1)) && at(r[1], 1) < 0);
    /* The composite entry point returns output 0 of the flash op. */
    ag_tensor *y = ag_scaled_dot_product_attention(qq, qq, vv, true, 0);
    tu_assert_near(at(y, 0), at(vv, 0), 1e-15, "causal row 0", 0);
    ag_scope_end();
}

typedef struct {
    bool causal;
    double scale;
} attn_ud;

static ag_tensor *attn_fn(ag_tensor *const *in, void *ud) {
    attn_ud *u = ud;
    return ag_scaled_dot_product_attention(in[0], in[1], in[2], u->causal, u->scale);
}

static void test_attention_backward(void **st) {
    (void)st;
    ag_scope_begin();
    int64_t qs[] = {1, 2, 3, 2}, ks[] = {1, 2, 4, 2}, vs[] = {1, 2, 4, 3};
    attn_ud cases[] = {{true, 0}, {false, 0.6}};
    for (int c = 0; c < 2; c++) {
        ag_tensor *in[3] = {rand_t(AG_F64, 4, qs, -1, 1, 100 + c),
                            rand_t(AG_F64, 4, ks, -1, 1, 110 + c),
                            rand_t(AG_F64, 4, vs, -1, 1, 120 + c)};
        check_fd(attn_fn, &cases[c], in, 3, 1e-6);
    }
    /* grad_fn and the helper in the backward. */
    ag_tensor *q = rand_t(AG_F32, 4, qs, -1, 1, 130);
    ag_tensor_set_requires_grad(q, true);
    ag_tensor *y = ag_scaled_dot_product_attention(q, q, q, true, 0);
    assert_string_equal(ag_tensor_grad_fn_name(y), "_scaled_dot_product_flash_attention_for_cpu");
    assert_int_equal(ag_backward(ag_sum_all(y), NULL, false), 0);
    assert_non_null(ag_tensor_grad(q));
    ag_scope_end();
}

static void test_attention_errors_and_cost(void **st) {
    (void)st;
    ag_scope_begin();
    int64_t s4[] = {2, 3, 8, 4}, bad[] = {2, 3, 8, 5};
    ag_tensor *q = rand_t(AG_F32, 4, s4, -1, 1, 140);
    const ag_op *sdpa = ag_op_find("scaled_dot_product_attention");
    ag_clear_error();
    assert_null(
        ag_op_call1(sdpa, (ag_arg[]){AG_A_T(q), AG_A_T(q), AG_A_T(q), AG_A_NONE, AG_A_F(0.1)}, 5));
    tu_assert_error_contains("dropout inside attention is not supported yet");
    ag_clear_error();
    assert_null(ag_scaled_dot_product_attention(q, rand_t(AG_F32, 4, bad, 0, 1, 1), q, false, 0));
    tu_assert_error_contains("query f32[2, 3, 8, 4], key f32[2, 3, 8, 5]");
    int64_t m3[] = {3, 9};
    ag_clear_error();
    assert_null(ag_op_call1(
        sdpa, (ag_arg[]){AG_A_T(q), AG_A_T(q), AG_A_T(q), AG_A_T(rand_t(AG_F32, 2, m3, 0, 1, 1))},
        4));
    tu_assert_error_contains("attn_mask [3, 9] does not broadcast");

    /* Cost: 4 * B * H * L * L * E flops forward; compute-intensive. */
    const ag_op *flash = ag_op_find("_scaled_dot_product_flash_attention_for_cpu");
    ag_cost c;
    assert_int_equal(ag_op_cost(flash, (ag_arg[]){AG_A_T(q), AG_A_T(q), AG_A_T(q)}, 3, &c), 0);
    assert_true(fabs(c.flops - 4.0 * 2 * 3 * 8 * 8 * 4) < 1e-9);
    assert_true(ag_op_def(flash)->flags & AG_OP_COMPUTE_INTENSIVE);
    assert_true(ag_op_def(ag_op_find("native_dropout"))->flags & AG_OP_RANDOM);
    ag_scope_end();
}

/* ====================================================================================== */
/* ---- allocation failures ---- */

/* tu_alloc_failure_sweep over each scenario: a failing run must report AG_ENOMEM, and nothing
 * may leak. The final scope release may itself allocate (the autograd engine grows a stack to
 * free a node chain and falls back to recursion when it cannot); a failure there happens after
 * the scenario's result is known, so for it only the leak check applies. */
static void release_scope(void) {
    tu_alloc_cleanup_begin();
    ag_scope_end();
    tu_alloc_cleanup_end();
}

static const double oom_vals[24] = {0.3,  -1.2, 0.8, 0.1,  -0.5, 1.1,  -0.9, 0.4,
                                    0.7,  -0.3, 1.5, -1.0, 0.2,  -0.7, 0.9,  -0.1,
                                    -1.4, 0.6,  0.0, 1.3,  -0.6, 0.5,  -0.2, 1.0};

/* A float64 leaf (at most 24 elements) that requires grad. */
static ag_tensor *oom_leaf(int nd, const int64_t *sz) {
    ag_tensor *t = ag_from_data(AG_F64, nd, sz, oom_vals);
    return t && ag_tensor_set_requires_grad(t, true) == 0 ? t : NULL;
}

#define OOM_TRY(cond)                                                                              \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            rc = ag_last_status() ? ag_last_status() : -99;                                        \
            goto out;                                                                              \
        }                                                                                          \
    } while (0)

/* Layer norm and batch norm (training, running stats) of a transposed input, and backward. */
static int scenario_norms(void *ud) {
    (void)ud;
    int rc = 0;
    ag_scope_begin();
    int64_t xs[] = {4, 3}, c4[] = {4};
    ag_tensor *x = oom_leaf(2, xs), *w = oom_leaf(1, c4), *b = oom_leaf(1, c4);
    ag_tensor *rm = ag_zeros(AG_F64, 1, c4), *rv = ag_ones(AG_F64, 1, c4);
    OOM_TRY(x && w && b && rm && rv);
    ag_tensor *xt = ag_t(x), *y2 = NULL;
    ag_tensor *y1 = ag_layer_norm(xt, 1, c4, w, b, 1e-5);
    OOM_TRY(y1);
    OOM_TRY(ag_native_batch_norm(xt, w, NULL, rm, rv, true, 0.1, 1e-5, &y2, NULL, NULL) == 0);
    ag_tensor *loss = ag_add(ag_sum_all(ag_mul(y1, y1)), ag_sum_all(ag_mul(y2, y2)));
    OOM_TRY(loss);
    rc = ag_backward(loss, NULL, false);
out:
    release_scope();
    return rc;
}

/* Embedding -> cross entropy with label smoothing and an ignored target, backward, and the
 * frequency-scaled embedding backward. */
static int scenario_embedding_loss(void *ud) {
    (void)ud;
    int rc = 0;
    ag_scope_begin();
    int64_t ws[] = {6, 4}, is[] = {5};
    const int64_t ix[] = {1, 5, 1, 0, 3}, tv[] = {2, 0, -100, 3, 1};
    ag_tensor *w = oom_leaf(2, ws);
    ag_tensor *idx = ag_from_data(AG_I64, 1, is, ix), *t = ag_from_data(AG_I64, 1, is, tv);
    OOM_TRY(w && idx && t);
    const ag_op *ce = ag_op_find("cross_entropy_loss");
    ag_tensor *e = ag_embedding(w, idx);
    ag_tensor *loss = ag_op_call1(
        ce, (ag_arg[]){AG_A_T(e), AG_A_T(t), AG_A_NONE, AG_A_I(1), AG_A_I(-100), AG_A_F(0.1)}, 6);
    OOM_TRY(loss);
    OOM_TRY(ag_backward(loss, NULL, false) == 0);
    const ag_op *edb = ag_op_find("embedding_dense_backward");
    OOM_TRY(ag_op_call1(edb, (ag_arg[]){AG_A_T(e), AG_A_T(idx), AG_A_I(6), AG_A_I(1), AG_A_B(true)},
                        5));
out:
    release_scope();
    return rc;
}

/* Attention on packed (transposed) operands, then dropout, and backward. */
static int scenario_attention_dropout(void *ud) {
    (void)ud;
    int rc = 0;
    ag_scope_begin();
    int64_t s3[] = {2, 4, 3};
    ag_tensor *q = oom_leaf(3, s3), *k = oom_leaf(3, s3), *v = oom_leaf(3, s3);
    OOM_TRY(q && k && v);
    ag_tensor *y = ag_scaled_dot_product_attention(ag_transpose(q, 1, 2), ag_transpose(k, 1, 2),
                                                   ag_transpose(v, 1, 2), true, 0);
    ag_tensor *d = ag_dropout(y, 0.3, true);
    ag_tensor *loss = ag_sum_all(ag_mul(d, d));
    OOM_TRY(loss);
    rc = ag_backward(loss, NULL, false);
out:
    release_scope();
    return rc;
}

static void test_alloc_failures(void **st) {
    (void)st;
    static const struct {
        int (*fn)(void *);
        const char *what;
    } scenarios[] = {{scenario_norms, "norms"},
                     {scenario_embedding_loss, "embedding loss"},
                     {scenario_attention_dropout, "attention dropout"}};
    for (size_t i = 0; i < sizeof scenarios / sizeof scenarios[0]; i++) {
        tu_sweep_opts o = {.what = scenarios[i].what};
        assert_true(tu_alloc_failure_sweep(scenarios[i].fn, NULL, &o) >= 30);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_layer_norm_values),
        cmocka_unit_test(test_layer_norm_noncontiguous),
        cmocka_unit_test(test_layer_norm_backward),
        cmocka_unit_test(test_layer_norm_errors),
        cmocka_unit_test(test_batch_norm_training),
        cmocka_unit_test(test_batch_norm_eval_and_strided),
        cmocka_unit_test(test_batch_norm_wide),
        cmocka_unit_test(test_batch_norm_backward),
        cmocka_unit_test(test_embedding_forward),
        cmocka_unit_test(test_embedding_backward),
        cmocka_unit_test(test_nll_loss),
        cmocka_unit_test(test_cross_entropy),
        cmocka_unit_test(test_dropout),
        cmocka_unit_test(test_attention_forward),
        cmocka_unit_test(test_attention_backward),
        cmocka_unit_test(test_attention_errors_and_cost),
        cmocka_unit_test(test_alloc_failures),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
