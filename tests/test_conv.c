/* Tests of conv.c: convolution and convolution_backward against a direct loop written here
 * (stride, padding, dilation, groups, strided inputs), max_pool2d_with_indices values and
 * indices (hand-checked) and its backward scatter, avg_pool2d (hand and loop), adaptive pooling,
 * error messages, the backward structure (grad_fn names, output masks), and gradcheck over the
 * ops' own samples. */
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#define SZ(...) ((int64_t[]){__VA_ARGS__})
#define VALS(...) ((double[]){__VA_ARGS__})

static uint64_t rng_state = 0x2545F4914F6CDD1Dull;

/* A tensor of the given shape with values uniform in [-1, 1). */
static ag_tensor *rand_tensor(ag_dtype dt, int ndim, const int64_t *sizes) {
    return tu_rand_tensor(dt, ndim, sizes, -1, 1, tu_xorshift, &rng_state);
}

/* ---- a direct convolution, its input/weight/bias adjoints, read through the views ---- */

typedef struct geom {
    int64_t N, C, H, W, O, kh, kw, s[2], p[2], d[2], G, OH, OW;
} geom;

static geom geom_of(const ag_tensor *x, const ag_tensor *w, const int64_t s[2], const int64_t p[2],
                    const int64_t d[2], int64_t G) {
    geom g = {.N = ag_tensor_size(x, 0),
              .C = ag_tensor_size(x, 1),
              .H = ag_tensor_size(x, 2),
              .W = ag_tensor_size(x, 3),
              .O = ag_tensor_size(w, 0),
              .kh = ag_tensor_size(w, 2),
              .kw = ag_tensor_size(w, 3),
              .s = {s[0], s[1]},
              .p = {p[0], p[1]},
              .d = {d[0], d[1]},
              .G = G};
    g.OH = (g.H + 2 * g.p[0] - g.d[0] * (g.kh - 1) - 1) / g.s[0] + 1;
    g.OW = (g.W + 2 * g.p[1] - g.d[1] * (g.kw - 1) - 1) / g.s[1] + 1;
    return g;
}

/* Visits every (output, input, weight) triple of the convolution. */
#define FOR_TAPS(g, BODY)                                                                          \
    for (int64_t n = 0; n < (g).N; n++)                                                            \
        for (int64_t o = 0; o < (g).O; o++)                                                        \
            for (int64_t oh = 0; oh < (g).OH; oh++)                                                \
                for (int64_t ow = 0; ow < (g).OW; ow++)                                            \
                    for (int64_t ci = 0; ci < (g).C / (g).G; ci++)                                 \
                        for (int64_t ki = 0; ki < (g).kh; ki++)                                    \
                            for (int64_t kj = 0; kj < (g).kw; kj++) {                              \
                                int64_t c = o / ((g).O / (g).G) * ((g).C / (g).G) + ci;            \
                                int64_t ih = oh * (g).s[0] - (g).p[0] + ki * (g).d[0];             \
                                int64_t iw = ow * (g).s[1] - (g).p[1] + kj * (g).d[1];             \
                                if (ih < 0 || ih >= (g).H || iw < 0 || iw >= (g).W)                \
                                    continue;                                                      \
                                int64_t xi = ((n * (g).C + c) * (g).H + ih) * (g).W + iw;          \
                                int64_t wi =                                                       \
                                    ((o * ((g).C / (g).G) + ci) * (g).kh + ki) * (g).kw + kj;      \
                                int64_t yi = ((n * (g).O + o) * (g).OH + oh) * (g).OW + ow;        \
                                BODY                                                               \
                            }

static double *naive_conv(const ag_tensor *x, const ag_tensor *w, const ag_tensor *b,
                          const geom *g) {
    int64_t ny = g->N * g->O * g->OH * g->OW;
    double *y = test_calloc((size_t)ny, sizeof(double));
    for (int64_t i = 0; i < ny; i++)
        y[i] = b ? ag_tensor_item_at(b, (i / (g->OH * g->OW)) % g->O) : 0;
    FOR_TAPS(*g, { y[yi] += ag_tensor_item_at(x, xi) * ag_tensor_item_at(w, wi); });
    return y;
}

static void test_conv_forward(void **state) {
    (void)state;
    ag_scope_begin();
    for (int d = 0; d < 2; d++) {
        ag_dtype dt = d ? AG_F64 : AG_F32;
        double tol = d ? 1e-12 : 1e-5;
        /* stride 2, padding 1, dilation 2, groups 2, with bias */
        ag_tensor *x = rand_tensor(dt, 4, SZ(3, 4, 9, 8));
        ag_tensor *w = rand_tensor(dt, 4, SZ(6, 2, 3, 3));
        ag_tensor *b = rand_tensor(dt, 1, SZ(6));
        int64_t s[2] = {2, 2}, p[2] = {1, 1}, dl[2] = {2, 2};
        geom g = geom_of(x, w, s, p, dl, 2);
        ag_tensor *y = ag_conv2d(x, w, b, s, p, dl, 2);
        assert_non_null(y);
        assert_int_equal(ag_tensor_size(y, 2), g.OH);
        assert_int_equal(ag_tensor_size(y, 3), g.OW);
        assert_int_equal(g.OH, 4);
        assert_int_equal(g.OW, 3);
        double *want = naive_conv(x, w, b, &g);
        tu_assert_close(y, want, tol);
        test_free(want);

        /* Non-contiguous input, weight and bias; asymmetric stride and padding; no dilation. */
        ag_tensor *xt = ag_transpose(rand_tensor(dt, 4, SZ(2, 3, 7, 6)), 2, 3); /* (2,3,6,7) */
        ag_tensor *wt = ag_permute(rand_tensor(dt, 4, SZ(3, 5, 2, 2)), 4, SZ(1, 0, 2, 3));
        ag_tensor *bt = ag_slice(rand_tensor(dt, 1, SZ(10)), 0, 0, 10, 2);
        int64_t s2[2] = {1, 2}, p2[2] = {0, 1}, d2[2] = {1, 1};
        geom g2 = geom_of(xt, wt, s2, p2, d2, 1);
        want = naive_conv(xt, wt, bt, &g2);
        tu_assert_close(ag_conv2d(xt, wt, bt, s2, p2, d2, 1), want, tol);
        test_free(want);

        /* 1x1 (the no-im2col path), no bias; and a batch of one (BLAS threads itself). */
        ag_tensor *x1 = rand_tensor(dt, 4, SZ(3, 4, 5, 5)),
                  *w1 = rand_tensor(dt, 4, SZ(6, 4, 1, 1));
        int64_t one[2] = {1, 1}, zero[2] = {0, 0};
        geom g3 = geom_of(x1, w1, one, zero, one, 1);
        want = naive_conv(x1, w1, NULL, &g3);
        tu_assert_close(ag_conv2d(x1, w1, NULL, NULL, NULL, NULL, 1), want, tol);
        test_free(want);
        ag_tensor *xb = rand_tensor(dt, 4, SZ(1, 2, 6, 6)),
                  *wb = rand_tensor(dt, 4, SZ(3, 2, 3, 3));
        geom g4 = geom_of(xb, wb, one, one, one, 1);
        want = naive_conv(xb, wb, NULL, &g4);
        tu_assert_close(ag_conv2d(xb, wb, NULL, one, one, one, 1), want, tol);
        test_free(want);
    }
    /* A hand-checked case: 3x3 ones kernel over 1..9 with padding 1 sums each neighbourhood. */
    ag_tensor *x = tu_tensor(AG_F32, 4, SZ(1, 1, 3, 3), VALS(1, 2, 3, 4, 5, 6, 7, 8, 9));
    ag_tensor *w = ag_ones(AG_F32, 4, SZ(1, 1, 3, 3));
    tu_assert_values(ag_conv2d(x, w, NULL, NULL, (int64_t[]){1, 1}, NULL, 1), 4, SZ(1, 1, 3, 3),
                     VALS(12, 21, 16, 27, 45, 33, 24, 39, 28), 1e-6);
    ag_scope_end();
}

static void check_conv_backward(ag_dtype dt, const ag_tensor *x, const ag_tensor *w,
                                const int64_t s[2], const int64_t p[2], const int64_t d[2],
                                int64_t G) {
    double tol = dt == AG_F64 ? 1e-12 : 1e-4;
    geom g = geom_of(x, w, s, p, d, G);
    ag_tensor *go = rand_tensor(dt, 4, SZ(g.N, g.O, g.OH, g.OW));
    int64_t nx = g.N * g.C * g.H * g.W, nw = g.O * (g.C / G) * g.kh * g.kw;
    double *gx = test_calloc((size_t)nx, sizeof(double));
    double *gw = test_calloc((size_t)nw, sizeof(double));
    double *gb = test_calloc((size_t)g.O, sizeof(double));
    FOR_TAPS(g, {
        double gy = ag_tensor_item_at(go, yi);
        gx[xi] += gy * ag_tensor_item_at(w, wi);
        gw[wi] += gy * ag_tensor_item_at(x, xi);
    });
    for (int64_t i = 0; i < ag_tensor_numel(go); i++)
        gb[(i / (g.OH * g.OW)) % g.O] += ag_tensor_item_at(go, i);
    ag_tensor *outs[3];
    bool all[3] = {true, true, true};
    assert_int_equal(
        ag_convolution_backward(go, (ag_tensor *)x, (ag_tensor *)w, SZ(g.O), s, p, d, G, all, outs),
        0);
    assert_int_equal(ag_tensor_ndim(outs[0]), 4);
    tu_assert_close(outs[0], gx, tol);
    tu_assert_close(outs[1], gw, tol);
    tu_assert_close(outs[2], gb, tol);
    /* Only the weight and bias grads, as when the input needs none. */
    bool wb[3] = {false, true, true};
    assert_int_equal(
        ag_convolution_backward(go, (ag_tensor *)x, (ag_tensor *)w, SZ(g.O), s, p, d, G, wb, outs),
        0);
    assert_null(outs[0]);
    tu_assert_close(outs[1], gw, tol);
    tu_assert_close(outs[2], gb, tol);
    bool xo[3] = {true, false, false};
    assert_int_equal(
        ag_convolution_backward(go, (ag_tensor *)x, (ag_tensor *)w, NULL, s, p, d, G, xo, outs), 0);
    tu_assert_close(outs[0], gx, tol);
    assert_null(outs[1]);
    assert_null(outs[2]);
    test_free(gx);
    test_free(gw);
    test_free(gb);
}

static void test_conv_backward_op(void **state) {
    (void)state;
    ag_scope_begin();
    for (int d = 0; d < 2; d++) {
        ag_dtype dt = d ? AG_F64 : AG_F32;
        check_conv_backward(dt, rand_tensor(dt, 4, SZ(3, 4, 9, 8)),
                            rand_tensor(dt, 4, SZ(6, 2, 3, 3)), SZ(2, 2), SZ(1, 1), SZ(2, 2), 2);
        check_conv_backward(dt, ag_transpose(rand_tensor(dt, 4, SZ(2, 3, 7, 6)), 2, 3),
                            rand_tensor(dt, 4, SZ(5, 3, 2, 3)), SZ(1, 2), SZ(1, 0), SZ(1, 1), 1);
        check_conv_backward(dt, rand_tensor(dt, 4, SZ(4, 4, 5, 5)),
                            rand_tensor(dt, 4, SZ(6, 4, 1, 1)), SZ(1, 1), SZ(0, 0), SZ(1, 1), 1);
        check_conv_backward(dt, rand_tensor(dt, 4, SZ(1, 2, 6, 6)),
                            rand_tensor(dt, 4, SZ(4, 1, 3, 3)), SZ(1, 1), SZ(1, 1), SZ(1, 1), 2);
        /* Unit width stride (col2im's register path): the cnn's 3x3 "same" layer; a wide row
         * (20 > 16 lanes) with dilation 2 and more padding than the taps reach. */
        check_conv_backward(dt, rand_tensor(dt, 4, SZ(2, 3, 14, 14)),
                            rand_tensor(dt, 4, SZ(4, 3, 3, 3)), SZ(1, 1), SZ(1, 1), SZ(1, 1), 1);
        check_conv_backward(dt, rand_tensor(dt, 4, SZ(2, 2, 7, 20)),
                            rand_tensor(dt, 4, SZ(3, 2, 2, 3)), SZ(2, 1), SZ(1, 3), SZ(2, 2), 1);
        /* Output rows as wide as the input's at unit stride (im2col's one-piece copy): with
         * width dilation, and with height padding beyond the kernel (rows wholly outside). */
        check_conv_backward(dt, rand_tensor(dt, 4, SZ(2, 2, 6, 9)),
                            rand_tensor(dt, 4, SZ(3, 2, 3, 3)), SZ(1, 1), SZ(1, 2), SZ(1, 2), 1);
        check_conv_backward(dt, rand_tensor(dt, 4, SZ(2, 2, 4, 5)),
                            rand_tensor(dt, 4, SZ(2, 2, 2, 3)), SZ(1, 1), SZ(3, 1), SZ(1, 1), 1);
    }
    ag_scope_end();
}

/* The autograd node is "convolution" and its rule asks convolution_backward only for what is
 * needed: with an input that needs no grad, the weight and bias still get theirs. */
static void test_conv_autograd(void **state) {
    (void)state;
    ag_scope_begin();
    ag_tensor *x = rand_tensor(AG_F64, 4, SZ(2, 1, 5, 5));
    ag_tensor *w = rand_tensor(AG_F64, 4, SZ(3, 1, 3, 3)), *b = rand_tensor(AG_F64, 1, SZ(3));
    ag_tensor_set_requires_grad(w, true);
    ag_tensor_set_requires_grad(b, true);
    int64_t one[2] = {1, 1};
    ag_tensor *y = ag_conv2d(x, w, b, one, one, one, 1);
    assert_string_equal(ag_tensor_grad_fn_name(y), "convolution");
    ag_tensor *g = ag_ones_like(y);
    ag_tensor *ins[2] = {w, b}, *grads[2];
    assert_int_equal(ag_grad(&y, &g, 1, ins, 2, grads, false, false), 0);
    /* bias grad: every output position counts once: N*OH*OW = 50 */
    tu_assert_values(grads[1], 1, SZ(3), VALS(50, 50, 50), 1e-12);
    ag_tensor *outs[3];
    assert_int_equal(ag_convolution_backward(g, x, w, SZ(3), one, one, one, 1,
                                             (bool[]){false, true, false}, outs),
                     0);
    assert_true(tu_max_abs_diff(grads[0], outs[1]) < 1e-12);
    /* Without a bias, the input grad alone. */
    ag_tensor_set_requires_grad(x, true);
    ag_tensor *y2 = ag_conv2d(x, ag_detach(w), NULL, one, one, one, 1);
    ag_tensor *g2 = ag_ones_like(y2), *gx;
    assert_int_equal(ag_grad(&y2, &g2, 1, &x, 1, &gx, false, false), 0);
    assert_int_equal(ag_convolution_backward(g2, x, w, NULL, one, one, one, 1,
                                             (bool[]){true, false, false}, outs),
                     0);
    assert_true(tu_max_abs_diff(gx, outs[0]) < 1e-12);
    ag_scope_end();
}

static void test_conv_errors(void **state) {
    (void)state;
    ag_scope_begin();
    ag_tensor *x = ag_zeros(AG_F32, 4, SZ(2, 4, 5, 5));
    assert_null(ag_conv2d(x, ag_zeros(AG_F32, 4, SZ(6, 3, 3, 3)), NULL, NULL, NULL, NULL, 2));
    tu_assert_error_contains("convolution: expected weight of shape (O, C/groups, kh, kw) = "
                             "(O, 2, kh, kw) with O divisible by groups 2, for input "
                             "[2, 4, 5, 5]; got [6, 3, 3, 3]");
    assert_null(ag_conv2d(x, ag_zeros(AG_F32, 4, SZ(5, 2, 3, 3)), NULL, NULL, NULL, NULL, 2));
    tu_assert_error_contains("convolution: expected weight of shape");
    assert_null(ag_conv2d(x, ag_zeros(AG_F32, 4, SZ(6, 4, 3, 3)), NULL, NULL, NULL, NULL, 3));
    tu_assert_error_contains("convolution: input channels 4 are not divisible by groups 3");
    assert_null(ag_conv2d(ag_zeros(AG_F32, 3, SZ(4, 5, 5)), ag_zeros(AG_F32, 4, SZ(6, 4, 3, 3)),
                          NULL, NULL, NULL, NULL, 1));
    tu_assert_error_contains("convolution: expected a 4-d input (N, C, H, W), got [4, 5, 5]");
    assert_null(ag_conv2d(x, ag_zeros(AG_F32, 4, SZ(6, 4, 7, 3)), NULL, NULL, NULL, NULL, 1));
    tu_assert_error_contains("convolution: padded input size (5 x 5) is smaller than the dilated "
                             "kernel (7 x 3)");
    assert_null(ag_conv2d(x, ag_zeros(AG_F32, 4, SZ(6, 4, 3, 3)), ag_zeros(AG_F32, 1, SZ(5)), NULL,
                          NULL, NULL, 1));
    tu_assert_error_contains("convolution: expected a bias of shape [6]");
    assert_null(ag_conv2d(x, ag_zeros(AG_F64, 4, SZ(6, 4, 3, 3)), NULL, NULL, NULL, NULL, 1));
    tu_assert_error_contains("convolution: input (f32) and weight (f64) must have the same dtype");
    assert_null(ag_conv2d(x, ag_zeros(AG_F32, 4, SZ(6, 4, 3, 3)), NULL, SZ(0, 1), NULL, NULL, 1));
    tu_assert_error_contains("convolution: expected positive stride");
    /* transposed=true through the op table. */
    const ag_op *op = ag_op_find("convolution");
    ag_tensor *out[1];
    int64_t one[2] = {1, 1}, zero[2] = {0, 0};
    ag_arg args[9] = {AG_A_T(x),          AG_A_T(ag_zeros(AG_F32, 4, SZ(4, 2, 3, 3))),
                      AG_A_NONE,          AG_A_INTS(one, 2),
                      AG_A_INTS(zero, 2), AG_A_INTS(one, 2),
                      AG_A_B(true),       AG_A_INTS(zero, 2),
                      AG_A_I(1)};
    assert_true(ag_op_call(op, args, 9, out) < 0);
    tu_assert_error_contains("convolution: transposed convolution is not supported");
    ag_tensor *outs[3];
    assert_true(ag_convolution_backward(ag_zeros(AG_F32, 4, SZ(2, 6, 4, 4)), x,
                                        ag_zeros(AG_F32, 4, SZ(6, 4, 3, 3)), NULL, NULL, NULL, NULL,
                                        1, NULL, outs) < 0);
    tu_assert_error_contains("convolution_backward: grad_output is f32 [2, 6, 4, 4], expected f32 "
                             "[2, 6, 3, 3]");
    assert_null(outs[0]);
    ag_clear_error();
    ag_scope_end();
}

/* ---- pooling ---- */

static void test_max_pool(void **state) {
    (void)state;
    ag_scope_begin();
    ag_tensor *x =
        tu_tensor(AG_F32, 4, SZ(1, 1, 4, 4), VALS(1, 2, 5, 3, 4, 0, 1, 2, 7, 8, 3, 1, 0, 9, 2, 6));
    ag_tensor *out, *ind;
    assert_int_equal(ag_max_pool2d_with_indices(x, SZ(2, 2), NULL, NULL, NULL, false, &out, &ind),
                     0);
    tu_assert_values(out, 4, SZ(1, 1, 2, 2), VALS(4, 5, 9, 6), 0);
    assert_true(ag_tensor_dtype(ind) == AG_I64);
    tu_assert_values(ind, 4, SZ(1, 1, 2, 2), VALS(4, 2, 13, 15), 0);
    /* 3x3, stride 1, padding 1: each window's max and its flat index in the plane. */
    assert_int_equal(
        ag_max_pool2d_with_indices(x, SZ(3, 3), SZ(1, 1), SZ(1, 1), NULL, false, &out, &ind), 0);
    tu_assert_values(out, 4, SZ(1, 1, 4, 4), VALS(4, 5, 5, 5, 8, 8, 8, 5, 9, 9, 9, 6, 9, 9, 9, 6),
                     0);
    tu_assert_values(ind, 4, SZ(1, 1, 4, 4),
                     VALS(4, 2, 2, 2, 9, 9, 9, 2, 13, 13, 13, 15, 13, 13, 13, 15), 0);
    /* dilation 2 over a 2x2 kernel picks corners of 3x3 windows; ceil mode adds a partial one. */
    assert_int_equal(
        ag_max_pool2d_with_indices(x, SZ(2, 2), SZ(2, 2), SZ(0, 0), SZ(2, 2), true, &out, &ind), 0);
    /* window (0,0): x[0,0]=1, x[0,2]=5, x[2,0]=7, x[2,2]=3 -> 7 at 8; (0,1) starts at col 2:
     * x[0,2]=5, x[2,2]=3 -> 5 at 2; (1,0) rows 2: x[2,0]=7, x[2,2]=3 -> 7 at 8; (1,1): 3 at 10 */
    tu_assert_values(out, 4, SZ(1, 1, 2, 2), VALS(7, 5, 7, 3), 0);
    tu_assert_values(ind, 4, SZ(1, 1, 2, 2), VALS(8, 2, 8, 10), 0);
    /* Against a direct window loop: a wide row (more than 64 output columns), padding,
     * dilation, ceil mode, a strided input. */
    {
        ag_tensor *xw = ag_transpose(rand_tensor(AG_F32, 4, SZ(2, 3, 150, 5)), 2, 3);
        int64_t k[2] = {3, 2}, st[2] = {2, 1}, pd[2] = {1, 1}, dl[2] = {2, 1};
        assert_int_equal(ag_max_pool2d_with_indices(xw, k, st, pd, dl, true, &out, &ind), 0);
        const int64_t H = 5, W = 150;
        int64_t OH = ag_tensor_size(out, 2), OW = ag_tensor_size(out, 3);
        assert_int_equal(OH, 2); /* ceil((5 + 2 - 4 - 1) / 2) + 1 = 2 */
        assert_int_equal(OW, 151);
        for (int64_t pl = 0; pl < 6; pl++)
            for (int64_t oh = 0; oh < OH; oh++)
                for (int64_t ow = 0; ow < OW; ow++) {
                    double best = -INFINITY;
                    int64_t bi = -1;
                    for (int64_t ki = 0; ki < 3; ki++)
                        for (int64_t kj = 0; kj < 2; kj++) {
                            int64_t h = oh * 2 - 1 + ki * 2, w = ow - 1 + kj;
                            if (h < 0 || h >= H || w < 0 || w >= W)
                                continue;
                            double v = ag_tensor_item_at(xw, (pl * H + h) * W + w);
                            if (bi < 0 || v > best) {
                                best = v;
                                bi = h * W + w;
                            }
                        }
                    int64_t o = (pl * OH + oh) * OW + ow;
                    assert_true(ag_tensor_item_at(out, o) == best);
                    assert_int_equal((int64_t)ag_tensor_item_at(ind, o), bi);
                }
    }
    /* NaN wins its window. */
    ag_tensor *xn = tu_tensor(AG_F64, 3, SZ(1, 2, 2), VALS(1, NAN, 3, 2));
    ag_tensor *mn = ag_max_pool2d(xn, SZ(2, 2), NULL, NULL);
    assert_true(isnan(ag_tensor_item_at(mn, 0)));

    /* Backward: the grad goes to the argmax, summed where windows share it. */
    ag_tensor *xg = ag_to_dtype(x, AG_F64);
    ag_tensor_set_requires_grad(xg, true);
    assert_int_equal(
        ag_max_pool2d_with_indices(xg, SZ(3, 3), SZ(1, 1), SZ(1, 1), NULL, false, &out, &ind), 0);
    assert_string_equal(ag_tensor_grad_fn_name(out), "max_pool2d_with_indices");
    ag_tensor *g = ag_ones_like(out), *gx;
    assert_int_equal(ag_grad(&out, &g, 1, &xg, 1, &gx, false, false), 0);
    /* index 2 (value 5) wins 4 windows, 4 (4) 1, 9 (8) 3, 13 (9) 6, 15 (6) 2 */
    tu_assert_values(gx, 4, SZ(1, 1, 4, 4), VALS(0, 0, 4, 0, 1, 0, 0, 0, 0, 3, 0, 0, 0, 6, 0, 2),
                     0);
    /* Bad indices are caught. */
    const ag_op *bw = ag_op_find("max_pool2d_with_indices_backward");
    int64_t k[2] = {3, 3}, s1[2] = {1, 1}, p1[2] = {1, 1}, d1[2] = {1, 1};
    ag_tensor *bad = ag_full(AG_I64, 4, SZ(1, 1, 4, 4), 16);
    ag_tensor *r[1];
    assert_true(
        ag_op_call(bw,
                   (ag_arg[]){AG_A_T(g), AG_A_T(xg), AG_A_INTS(k, 2), AG_A_INTS(s1, 2),
                              AG_A_INTS(p1, 2), AG_A_INTS(d1, 2), AG_A_B(false), AG_A_T(bad)},
                   8, r) < 0);
    tu_assert_error_contains("max_pool2d_with_indices_backward: an index is outside");
    ag_clear_error();
    ag_scope_end();
}

/* The 2x2, stride 2 window (MaxPool2d(2)) against a sequential window loop written here with
 * ATen's rule (a tap replaces the running maximum when greater or NaN, so the first maximum and
 * the last NaN win): ties from a few distinct values, NaNs (two in some windows), windows of
 * -inf only, odd plane sizes whose last row and column are left out, rows of 1, 3, 5, 7, 14
 * and 20 outputs (whole runs of 8, an overlapping last run, short rows read past their end
 * except the plane's last, tiles), float32 and float64. */
static void test_max_pool_2x2(void **state) {
    (void)state;
    ag_scope_begin();
    const int64_t shapes[][4] = {{2, 3, 28, 28}, {1, 2, 5, 7},   {1, 1, 4, 40},
                                 {2, 1, 3, 2},   {1, 2, 14, 14}, {2, 1, 9, 11}};
    for (int dt = AG_F32; dt <= AG_F64; dt++)
        for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++) {
            const int64_t *xs = shapes[k], H = xs[2], W = xs[3], planes = xs[0] * xs[1];
            const int64_t M = planes * H * W;
            double *v = test_malloc(sizeof(double) * (size_t)M);
            uint64_t st = 0x9E3779B97F4A7C15ull + (uint64_t)k;
            for (int64_t i = 0; i < M; i++) {
                const uint64_t r = tu_xorshift_next(&st) % 16;
                v[i] = r == 0 ? NAN : r == 1 ? -INFINITY : (double)(r % 3);
            }
            v[0] = v[1] = v[W] = v[W + 1] = -INFINITY; /* the first window is all -inf */
            ag_tensor *x = tu_tensor(dt, 4, xs, v), *out, *ind;
            assert_int_equal(ag_max_pool2d_with_indices(x, SZ(2, 2), SZ(2, 2), SZ(0, 0), NULL,
                                                        false, &out, &ind),
                             0);
            const int64_t OH = H / 2, OW = W / 2;
            assert_int_equal(ag_tensor_size(out, 2), OH);
            assert_int_equal(ag_tensor_size(out, 3), OW);
            for (int64_t pl = 0; pl < planes; pl++)
                for (int64_t oh = 0; oh < OH; oh++)
                    for (int64_t ow = 0; ow < OW; ow++) {
                        double best = -INFINITY;
                        int64_t bi = 2 * oh * W + 2 * ow;
                        for (int64_t ki = 0; ki < 2; ki++)
                            for (int64_t kj = 0; kj < 2; kj++) {
                                const int64_t j = (2 * oh + ki) * W + 2 * ow + kj;
                                const double e = v[pl * H * W + j];
                                if (e > best || isnan(e)) {
                                    best = e;
                                    bi = j;
                                }
                            }
                        const int64_t o = (pl * OH + oh) * OW + ow;
                        const double got = ag_tensor_item_at(out, o);
                        if (isnan(best))
                            assert_true(isnan(got));
                        else
                            assert_true(got == best);
                        assert_int_equal((int64_t)ag_tensor_item_at(ind, o), bi);
                    }
            test_free(v);
        }
    ag_scope_end();
}

/* avg_pool2d per ATen's CPU loop, written out directly. */
static double *naive_avg(const ag_tensor *x, int64_t kh, int64_t kw, int64_t sh, int64_t sw,
                         int64_t ph, int64_t pw, int64_t OH, int64_t OW, bool cip, int64_t div) {
    int nd = ag_tensor_ndim(x);
    int64_t H = ag_tensor_size(x, -2), W = ag_tensor_size(x, -1);
    int64_t planes = ag_tensor_numel(x) / (H * W);
    double *y = test_calloc((size_t)(planes * OH * OW), sizeof(double));
    (void)nd;
    for (int64_t pl = 0; pl < planes; pl++)
        for (int64_t oh = 0; oh < OH; oh++)
            for (int64_t ow = 0; ow < OW; ow++) {
                int64_t h0 = oh * sh - ph, w0 = ow * sw - pw;
                int64_t h1 = h0 + kh < H + ph ? h0 + kh : H + ph;
                int64_t w1 = w0 + kw < W + pw ? w0 + kw : W + pw;
                double padded = (double)((h1 - h0) * (w1 - w0)), s = 0, cnt = 0;
                for (int64_t h = h0; h < h1; h++)
                    for (int64_t w = w0; w < w1; w++)
                        if (h >= 0 && h < H && w >= 0 && w < W) {
                            s += ag_tensor_item_at(x, (pl * H + h) * W + w);
                            cnt++;
                        }
                double dv = div ? (double)div : cip ? padded : cnt;
                y[(pl * OH + oh) * OW + ow] = cnt ? s / dv : 0;
            }
    return y;
}

static void test_avg_pool(void **state) {
    (void)state;
    ag_scope_begin();
    ag_tensor *x =
        tu_tensor(AG_F32, 4, SZ(1, 1, 4, 4), VALS(1, 2, 5, 3, 4, 0, 1, 2, 7, 8, 3, 1, 0, 9, 2, 6));
    tu_assert_values(ag_avg_pool2d(x, SZ(2, 2), NULL, NULL, false, true), 4, SZ(1, 1, 2, 2),
                     VALS(7.0 / 4, 11.0 / 4, 24.0 / 4, 12.0 / 4), 1e-6);
    /* padding 1, 2x2 kernel, stride 2: corners see one pixel; with padding counted /4. */
    tu_assert_values(ag_avg_pool2d(x, SZ(2, 2), SZ(2, 2), SZ(1, 1), false, true), 4, SZ(1, 1, 3, 3),
                     VALS(0.25, 7.0 / 4, 0.75, 11.0 / 4, 12.0 / 4, 3.0 / 4, 0, 11.0 / 4, 1.5),
                     1e-6);
    tu_assert_values(ag_avg_pool2d(x, SZ(2, 2), SZ(2, 2), SZ(1, 1), false, false), 4,
                     SZ(1, 1, 3, 3), VALS(1, 3.5, 3, 5.5, 3, 1.5, 0, 5.5, 6), 1e-6);
    /* ceil mode, 3-d input, strided input, divisor_override, against the loop. */
    ag_tensor *xs = ag_transpose(rand_tensor(AG_F64, 3, SZ(3, 6, 7)), 1, 2); /* (3, 7, 6) */
    /* ceil: H 7, k 3, s 2, p 1 -> floor((7+2-3+1)/2)+1 = 4; W 6 -> floor((6+2-3+1)/2)+1 = 4,
     * and (4-1)*2 = 6 >= 6+1? no -> 4. */
    ag_tensor *y = ag_avg_pool2d(xs, SZ(3, 3), SZ(2, 2), SZ(1, 1), true, false);
    assert_int_equal(ag_tensor_size(y, 1), 4);
    assert_int_equal(ag_tensor_size(y, 2), 4);
    double *want = naive_avg(ag_contiguous(xs), 3, 3, 2, 2, 1, 1, 4, 4, false, 0);
    tu_assert_close(y, want, 1e-12);
    test_free(want);
    const ag_op *op = ag_op_find("avg_pool2d");
    ag_tensor *out[1];
    assert_int_equal(
        ag_op_call(op,
                   (ag_arg[]){AG_A_T(xs), AG_A_INTS(SZ(2, 3), 2), AG_A_INTS(SZ(1, 2), 2),
                              AG_A_INTS(SZ(1, 1), 2), AG_A_B(false), AG_A_B(true), AG_A_I(5)},
                   7, out),
        0);
    want = naive_avg(ag_contiguous(xs), 2, 3, 1, 2, 1, 1, 8, 3, true, 5);
    tu_assert_values(out[0], 3, SZ(3, 8, 3), want, 1e-12);
    test_free(want);
    /* Backward of the hand case: each pixel gets 1/4 from its one window. */
    ag_tensor *xg = ag_to_dtype(x, AG_F64);
    ag_tensor_set_requires_grad(xg, true);
    ag_tensor *yg = ag_avg_pool2d(xg, SZ(2, 2), NULL, NULL, false, true);
    assert_string_equal(ag_tensor_grad_fn_name(yg), "avg_pool2d");
    ag_tensor *g = tu_tensor(AG_F64, 4, SZ(1, 1, 2, 2), VALS(4, 8, 12, 16)), *gx;
    assert_int_equal(ag_grad(&yg, &g, 1, &xg, 1, &gx, false, false), 0);
    tu_assert_values(gx, 4, SZ(1, 1, 4, 4), VALS(1, 1, 2, 2, 1, 1, 2, 2, 3, 3, 4, 4, 3, 3, 4, 4),
                     1e-12);
    ag_scope_end();
}

static void test_adaptive_pool(void **state) {
    (void)state;
    ag_scope_begin();
    ag_tensor *x =
        tu_tensor(AG_F64, 3, SZ(1, 3, 5), VALS(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    /* 3x5 -> 2x2: rows [0,2) and [1,3); cols [0,3) and [2,5). */
    tu_assert_values(ag_adaptive_avg_pool2d(x, SZ(2, 2)), 3, SZ(1, 2, 2),
                     VALS((1 + 2 + 3 + 6 + 7 + 8) / 6.0, (3 + 4 + 5 + 8 + 9 + 10) / 6.0,
                          (6 + 7 + 8 + 11 + 12 + 13) / 6.0, (8 + 9 + 10 + 13 + 14 + 15) / 6.0),
                     1e-12);
    /* Against floor/ceil window bounds on a strided 4-d input, 7x5 -> 3x4. */
    ag_tensor *xs = ag_transpose(rand_tensor(AG_F64, 4, SZ(2, 3, 5, 7)), 2, 3);
    ag_tensor *y = ag_adaptive_avg_pool2d(xs, SZ(3, 4));
    assert_non_null(y);
    double want[2 * 3 * 3 * 4];
    for (int64_t pl = 0; pl < 6; pl++)
        for (int64_t oh = 0; oh < 3; oh++)
            for (int64_t ow = 0; ow < 4; ow++) {
                int64_t h0 = (int64_t)floor(oh * 7.0 / 3), h1 = (int64_t)ceil((oh + 1) * 7.0 / 3);
                int64_t w0 = (int64_t)floor(ow * 5.0 / 4), w1 = (int64_t)ceil((ow + 1) * 5.0 / 4);
                double s = 0;
                for (int64_t h = h0; h < h1; h++)
                    for (int64_t w = w0; w < w1; w++)
                        s += ag_tensor_item_at(xs, (pl * 7 + h) * 5 + w);
                want[(pl * 3 + oh) * 4 + ow] = s / (double)((h1 - h0) * (w1 - w0));
            }
    tu_assert_values(y, 4, SZ(2, 3, 3, 4), want, 1e-12);
    ag_tensor_set_requires_grad(x, true);
    ag_tensor *yg = ag_adaptive_avg_pool2d(x, SZ(2, 2));
    assert_string_equal(ag_tensor_grad_fn_name(yg), "_adaptive_avg_pool2d");
    ag_tensor *g = ag_ones_like(yg), *gx;
    assert_int_equal(ag_grad(&yg, &g, 1, &x, 1, &gx, false, false), 0);
    /* pixel weight = (number of windows covering it) / 6 */
    tu_assert_values(gx, 3, SZ(1, 3, 5),
                     VALS(1 / 6.0, 1 / 6.0, 2 / 6.0, 1 / 6.0, 1 / 6.0, 2 / 6.0, 2 / 6.0, 4 / 6.0,
                          2 / 6.0, 2 / 6.0, 1 / 6.0, 1 / 6.0, 2 / 6.0, 1 / 6.0, 1 / 6.0),
                     1e-12);
    /* (1, 1) is ATen's mean over H and W. */
    ag_tensor *m = ag_adaptive_avg_pool2d(x, SZ(1, 1));
    tu_assert_values(m, 3, SZ(1, 1, 1), VALS(8), 1e-12);
    assert_string_equal(ag_tensor_grad_fn_name(m), "mean.dim");
    ag_scope_end();
}

static void test_pool_errors(void **state) {
    (void)state;
    ag_scope_begin();
    ag_tensor *x = ag_zeros(AG_F32, 4, SZ(1, 1, 4, 4)), *o, *i;
    assert_true(ag_max_pool2d_with_indices(x, SZ(2, 2), NULL, SZ(2, 2), NULL, false, &o, &i) < 0);
    assert_null(o);
    assert_null(i);
    tu_assert_error_contains("max_pool2d_with_indices: pad should be non-negative and at most "
                             "half of kernel size, but got padH = 2, padW = 2, kH = 2, kW = 2");
    assert_null(ag_max_pool2d(x, SZ(5, 5), NULL, NULL));
    tu_assert_error_contains("max_pool2d_with_indices: given input size (1x4x4), the calculated "
                             "output size (1x0x0) is too small");
    assert_null(ag_max_pool2d(ag_zeros(AG_F32, 2, SZ(4, 4)), SZ(2, 2), NULL, NULL));
    tu_assert_error_contains("max_pool2d_with_indices: expected a 3-d (C, H, W) or 4-d");
    assert_null(ag_avg_pool2d(x, SZ(0, 2), NULL, NULL, false, true));
    tu_assert_error_contains("avg_pool2d: kernel size should be greater than zero");
    assert_null(ag_avg_pool2d(x, SZ(2, 2), SZ(0, 1), NULL, false, true));
    tu_assert_error_contains("avg_pool2d: stride should be greater than zero");
    assert_null(ag_adaptive_avg_pool2d(x, SZ(-1, 2)));
    tu_assert_error_contains("_adaptive_avg_pool2d: elements of output_size must be greater");
    ag_clear_error();
    ag_scope_end();
}

/* ---- gradcheck over the samples of this file's ops ---- */

static void test_gradcheck_samples(void **state) {
    (void)state;
    static const char *const names[] = {"convolution",          "max_pool2d_with_indices",
                                        "avg_pool2d",           "avg_pool2d_backward",
                                        "_adaptive_avg_pool2d", "_adaptive_avg_pool2d_backward"};
    tu_gradcheck_ops(names, sizeof names / sizeof names[0]);
}

static void test_conv_cost(void **state) {
    (void)state;
    ag_scope_begin();
    const ag_op *op = ag_op_find("convolution");
    assert_true(ag_op_def(op)->flags & AG_OP_COMPUTE_INTENSIVE);
    assert_true(ag_op_def(ag_op_find("convolution_backward"))->flags & AG_OP_BACKWARD_HELPER);
    ag_tensor *x = ag_zeros(AG_F32, 4, SZ(2, 4, 8, 8)), *w = ag_zeros(AG_F32, 4, SZ(6, 2, 3, 3));
    int64_t one[2] = {1, 1}, zero[2] = {0, 0};
    ag_cost c;
    assert_int_equal(ag_op_cost(op,
                                (ag_arg[]){AG_A_T(x), AG_A_T(w), AG_A_NONE, AG_A_INTS(one, 2),
                                           AG_A_INTS(zero, 2), AG_A_INTS(one, 2), AG_A_B(false),
                                           AG_A_INTS(zero, 2), AG_A_I(2)},
                                9, &c),
                     0);
    /* 2 * N * O * OH * OW * (C/groups) * kh * kw */
    assert_true(c.flops == 2.0 * 2 * 6 * 6 * 6 * 2 * 3 * 3);
    ag_scope_end();
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_conv_forward),  cmocka_unit_test(test_conv_backward_op),
        cmocka_unit_test(test_conv_autograd), cmocka_unit_test(test_conv_errors),
        cmocka_unit_test(test_max_pool),      cmocka_unit_test(test_max_pool_2x2),
        cmocka_unit_test(test_avg_pool),      cmocka_unit_test(test_adaptive_pool),
        cmocka_unit_test(test_pool_errors),   cmocka_unit_test(test_gradcheck_samples),
        cmocka_unit_test(test_conv_cost),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
