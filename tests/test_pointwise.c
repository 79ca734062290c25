/* Tests of the pointwise family (src/ops/pointwise.c): hand-checked values of every op in f32
 * and f64, broadcasting, non-contiguous inputs, large tensors (the parallel paths), PyTorch's
 * type promotion, in-place ops (values, version bumps, errors), error messages, and direct
 * backward checks of rules whose shape is easy to get wrong (relu, gelu, where, clamp, mul_). */
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#define SZ(...) ((int64_t[]){__VA_ARGS__})
#define V(...) ((double[]){__VA_ARGS__})

static const ag_dtype float_dts[] = {AG_F32, AG_F64};

static double tol_of(ag_dtype dt) {
    return dt == AG_F32 ? 2e-6 : 1e-12;
}

static void assert_dtype(const ag_tensor *t, ag_dtype dt) {
    assert_non_null(t);
    if (ag_tensor_dtype(t) != dt) {
        print_error("dtype %s, expected %s\n", ag_dtype_short(ag_tensor_dtype(t)),
                    ag_dtype_short(dt));
        fail();
    }
}

/* Independent float64 references. */
static double ref_sigmoid(double x) {
    return 1 / (1 + exp(-x));
}
static double ref_gelu(double x) {
    return 0.5 * x * (1 + erf(x / sqrt(2.0)));
}
static double ref_gelu_tanh(double x) {
    return 0.5 * x * (1 + tanh(sqrt(2 / M_PI) * (x + 0.044715 * x * x * x)));
}
static double ref_silu(double x) {
    return x * ref_sigmoid(x);
}
/* Central difference of a reference: the backward helpers are checked against it. */
static double ref_deriv(double (*f)(double), double x) {
    const double h = 1e-5;
    return (f(x + h) - f(x - h)) / (2 * h);
}

/* ---- arithmetic ---- */

static void test_arith_values(void **st) {
    (void)st;
    for (int d = 0; d < 2; d++) {
        ag_dtype dt = float_dts[d];
        double tol = tol_of(dt);
        ag_scope_begin();
        ag_tensor *a = tu_tensor(dt, 2, SZ(2, 2), V(1, -2, 3.5, 4));
        ag_tensor *b = tu_tensor(dt, 2, SZ(2, 2), V(0.5, 2, -1, 8));
        ag_tensor *r = ag_add(a, b);
        assert_dtype(r, dt);
        tu_assert_values(r, 2, SZ(2, 2), V(1.5, 0, 2.5, 12), tol);
        tu_assert_values(ag_sub(a, b), 2, SZ(2, 2), V(0.5, -4, 4.5, -4), tol);
        tu_assert_values(ag_mul(a, b), 2, SZ(2, 2), V(0.5, -4, -3.5, 32), tol);
        tu_assert_values(ag_div(a, b), 2, SZ(2, 2), V(2, -1, -3.5, 0.5), tol);
        tu_assert_values(ag_add_alpha(a, b, 2), 2, SZ(2, 2), V(2, 2, 1.5, 20), tol);
        /* sub.Tensor with alpha, through the op table */
        ag_tensor *s3 =
            ag_op_call1(ag_op_find("sub.Tensor"), (ag_arg[]){AG_A_T(a), AG_A_T(b), AG_A_F(3)}, 3);
        tu_assert_values(s3, 2, SZ(2, 2), V(-0.5, -8, 6.5, -20), tol);
        tu_assert_values(ag_add_scalar(a, 1.5), 2, SZ(2, 2), V(2.5, -0.5, 5, 5.5), tol);
        tu_assert_values(ag_sub_scalar(a, 1), 2, SZ(2, 2), V(0, -3, 2.5, 3), tol);
        tu_assert_values(ag_mul_scalar(a, -2), 2, SZ(2, 2), V(-2, 4, -7, -8), tol);
        tu_assert_values(ag_div_scalar(a, 4), 2, SZ(2, 2), V(0.25, -0.5, 0.875, 1), tol);
        ag_tensor *as =
            ag_op_call1(ag_op_find("add.Scalar"), (ag_arg[]){AG_A_T(a), AG_A_F(1.5), AG_A_F(2)}, 3);
        tu_assert_values(as, 2, SZ(2, 2), V(4, 1, 6.5, 7), tol);
        assert_dtype(ag_mul_scalar(a, 1e-3), dt); /* a Scalar keeps the tensor's precision */
        ag_scope_end();
    }
}

static void test_pow(void **st) {
    (void)st;
    for (int d = 0; d < 2; d++) {
        ag_dtype dt = float_dts[d];
        double tol = tol_of(dt);
        ag_scope_begin();
        ag_tensor *a = tu_tensor(dt, 1, SZ(4), V(1.5, -2, 3, 0.5));
        ag_tensor *p = tu_tensor(dt, 1, SZ(4), V(1.5, 2, 3, 0.25));
        tu_assert_values(ag_pow_scalar(a, 2), 1, SZ(4), V(2.25, 4, 9, 0.25), tol);
        tu_assert_values(ag_pow_scalar(a, 3), 1, SZ(4), V(3.375, -8, 27, 0.125), tol);
        tu_assert_values(ag_pow_scalar(a, -1), 1, SZ(4), V(1 / 1.5, -0.5, 1 / 3.0, 2), tol);
        tu_assert_values(ag_pow_scalar(a, 0), 1, SZ(4), V(1, 1, 1, 1), tol);
        tu_assert_values(ag_pow_scalar(p, 0.5), 1, SZ(4), V(sqrt(1.5), sqrt(2), sqrt(3), 0.5), tol);
        tu_assert_values(ag_pow_scalar(p, -0.5), 1, SZ(4),
                         V(1 / sqrt(1.5), 1 / sqrt(2), 1 / sqrt(3), 2), tol);
        tu_assert_values(ag_pow_scalar(p, 1.5), 1, SZ(4),
                         V(1.5 * sqrt(1.5), 2 * sqrt(2), 3 * sqrt(3), 0.125), tol);
        ag_scope_end();
    }
    ag_scope_begin();
    ag_tensor *i = tu_tensor(AG_I64, 1, SZ(3), V(2, -3, 4));
    ag_tensor *r = ag_pow_scalar(i, 3);
    assert_dtype(r, AG_I64);
    tu_assert_values(r, 1, SZ(3), V(8, -27, 64), 0);
    assert_dtype(ag_pow_scalar(i, 0.5), AG_F32);
    assert_null(ag_pow_scalar(i, -1));
    tu_assert_error_contains("pow: integers to negative integer powers are not allowed");
    ag_scope_end();
}

/* ---- unary ---- */

typedef struct {
    const char *name;
    ag_tensor *(*fn)(ag_tensor *);
    double (*ref)(double);
    bool positive; /* domain x > 0 */
} unary_case;

static double ref_neg(double x) {
    return -x;
}
static double ref_rsqrt(double x) {
    return 1 / sqrt(x);
}
static double ref_relu(double x) {
    return x > 0 ? x : 0;
}
static double ref_sign(double x) {
    return x > 0 ? 1 : x < 0 ? -1 : 0;
}
static ag_tensor *gelu_none(ag_tensor *x) {
    return ag_gelu(x, "none");
}
static ag_tensor *gelu_tanh(ag_tensor *x) {
    return ag_gelu(x, "tanh");
}

static const unary_case unary_cases[] = {
    {"neg", ag_neg, ref_neg, false},
    {"exp", ag_exp, exp, false},
    {"log", ag_log, log, true},
    {"sqrt", ag_sqrt, sqrt, true},
    {"rsqrt", ag_rsqrt, ref_rsqrt, true},
    {"abs", ag_abs, fabs, false},
    {"tanh", ag_tanh, tanh, false},
    {"sigmoid", ag_sigmoid, ref_sigmoid, false},
    {"relu", ag_relu, ref_relu, false},
    {"gelu", gelu_none, ref_gelu, false},
    {"gelu tanh", gelu_tanh, ref_gelu_tanh, false},
    {"silu", ag_silu, ref_silu, false},
    {"sin", ag_sin, sin, false},
    {"cos", ag_cos, cos, false},
    {"sign", ag_sign, ref_sign, false},
};

static void check_unary(const unary_case *c, ag_tensor *x, const double *xv, int64_t n,
                        double tol) {
    ag_tensor *y = c->fn(x);
    if (!y) {
        print_error("%s: %s\n", c->name, ag_last_error());
        fail();
    }
    assert_dtype(y, ag_tensor_dtype(x));
    for (int64_t i = 0; i < n; i++) {
        double want = c->ref(xv[i]), got = ag_tensor_item_at(y, i);
        if (!(fabs(got - want) <= tol * (1 + fabs(want)))) {
            print_error("%s(%g): got %.9g, expected %.9g\n", c->name, xv[i], got, want);
            fail();
        }
    }
}

static void test_unary_values(void **st) {
    (void)st;
    const double any[] = {-2.5, -1.5, -0.3, 0.2, 0.7, 2.0};
    const double pos[] = {0.25, 1, 2.5, 9, 0.01, 4};
    for (int d = 0; d < 2; d++) {
        ag_dtype dt = float_dts[d];
        for (size_t k = 0; k < sizeof unary_cases / sizeof unary_cases[0]; k++) {
            ag_scope_begin();
            const double *xv = unary_cases[k].positive ? pos : any;
            check_unary(&unary_cases[k], tu_tensor(dt, 2, SZ(2, 3), xv), xv, 6, tol_of(dt));
            ag_scope_end();
        }
    }
}

static void test_unary_int_and_special(void **st) {
    (void)st;
    ag_scope_begin();
    ag_tensor *i = tu_tensor(AG_I64, 1, SZ(3), V(-3, 0, 5));
    ag_tensor *r = ag_neg(i);
    assert_dtype(r, AG_I64);
    tu_assert_values(r, 1, SZ(3), V(3, 0, -5), 0);
    tu_assert_values(ag_abs(i), 1, SZ(3), V(3, 0, 5), 0);
    assert_dtype(ag_relu(i), AG_I64);
    tu_assert_values(ag_relu(i), 1, SZ(3), V(0, 0, 5), 0);
    tu_assert_values(ag_sign(i), 1, SZ(3), V(-1, 0, 1), 0);
    /* floating ops make integers f32 */
    r = ag_exp(tu_tensor(AG_I64, 1, SZ(2), V(0, 1)));
    assert_dtype(r, AG_F32);
    tu_assert_values(r, 1, SZ(2), V(1, M_E), 1e-6);
    assert_dtype(ag_sigmoid(tu_tensor(AG_BOOL, 1, SZ(2), V(0, 1))), AG_F32);
    /* relu keeps NaN; 0-dim works */
    ag_tensor *nan = ag_relu(tu_tensor(AG_F32, 1, SZ(2), V(NAN, -1)));
    assert_true(isnan(ag_tensor_item_at(nan, 0)));
    assert_true(ag_tensor_item_at(nan, 1) == 0);
    r = ag_relu(ag_scalar_tensor(AG_F64, -4));
    assert_int_equal(ag_tensor_ndim(r), 0);
    assert_true(ag_tensor_item(r) == 0);
    /* errors */
    assert_null(ag_neg(tu_tensor(AG_BOOL, 1, SZ(1), V(1))));
    tu_assert_error_contains("neg: negation");
    assert_null(ag_gelu(tu_tensor(AG_I64, 1, SZ(1), V(1)), "none"));
    tu_assert_error_contains("gelu");
    assert_null(ag_gelu(tu_tensor(AG_F32, 1, SZ(1), V(1)), "fast"));
    tu_assert_error_contains("gelu: approximate must be 'none' or 'tanh', not 'fast'");
    ag_scope_end();
}

/* ---- broadcasting, strides, sizes ---- */

static void test_broadcast(void **st) {
    (void)st;
    for (int d = 0; d < 2; d++) {
        ag_dtype dt = float_dts[d];
        ag_scope_begin();
        ag_tensor *a = tu_tensor(dt, 2, SZ(2, 3), V(1, 2, 3, 4, 5, 6));
        ag_tensor *row = tu_tensor(dt, 1, SZ(3), V(10, 20, 30));
        ag_tensor *col = tu_tensor(dt, 2, SZ(2, 1), V(2, 3));
        ag_tensor *r13 = tu_tensor(dt, 2, SZ(1, 3), V(1, 2, 3));
        tu_assert_values(ag_add(a, row), 2, SZ(2, 3), V(11, 22, 33, 14, 25, 36), 0);
        tu_assert_values(ag_mul(col, r13), 2, SZ(2, 3), V(2, 4, 6, 3, 6, 9), 0);
        tu_assert_values(ag_sub(col, a), 2, SZ(2, 3), V(1, 0, -1, -1, -2, -3), 0);
        tu_assert_values(ag_mul(a, col), 2, SZ(2, 3), V(2, 4, 6, 12, 15, 18), 0);
        tu_assert_values(ag_div(row, a), 2, SZ(2, 3), V(10, 10, 10, 2.5, 4, 5), 1e-6);
        ag_tensor *two = ag_scalar_tensor(dt, 2);
        tu_assert_values(ag_mul(a, two), 2, SZ(2, 3), V(2, 4, 6, 8, 10, 12), 0);
        tu_assert_values(ag_sub(two, a), 2, SZ(2, 3), V(1, 0, -1, -2, -3, -4), 0);
        /* (2, 1, 3) with (4, 1): (2, 4, 3) */
        ag_tensor *x = tu_tensor(dt, 3, SZ(2, 1, 3), V(1, 2, 3, 4, 5, 6));
        ag_tensor *y = tu_tensor(dt, 2, SZ(4, 1), V(0, 10, 20, 30));
        ag_tensor *r = ag_add(x, y);
        double want[24];
        for (int i = 0; i < 2; i++)
            for (int j = 0; j < 4; j++)
                for (int k = 0; k < 3; k++)
                    want[(i * 4 + j) * 3 + k] = (i * 3 + k + 1) + 10 * j;
        tu_assert_values(r, 3, SZ(2, 4, 3), want, 0);
        /* empty tensors */
        r = ag_add(ag_zeros(dt, 2, SZ(0, 3)), row);
        assert_non_null(r);
        assert_int_equal(ag_tensor_numel(r), 0);
        assert_int_equal(ag_tensor_size(r, 1), 3);
        ag_scope_end();
    }
}

static void test_noncontiguous(void **st) {
    (void)st;
    for (int d = 0; d < 2; d++) {
        ag_dtype dt = float_dts[d];
        ag_scope_begin();
        /* base (3, 2) = [[1, 2], [3, 4], [5, 6]]; t = base^T = [[1, 3, 5], [2, 4, 6]] */
        ag_tensor *base = tu_tensor(dt, 2, SZ(3, 2), V(1, 2, 3, 4, 5, 6));
        ag_tensor *t = ag_transpose(base, 0, 1);
        assert_false(ag_tensor_is_contiguous(t));
        ag_tensor *ones = ag_ones(dt, 2, SZ(2, 3));
        tu_assert_values(ag_add(t, ones), 2, SZ(2, 3), V(2, 4, 6, 3, 5, 7), 0);
        tu_assert_values(ag_mul(t, t), 2, SZ(2, 3), V(1, 9, 25, 4, 16, 36), 0);
        tu_assert_values(ag_sub_scalar(t, 1), 2, SZ(2, 3), V(0, 2, 4, 1, 3, 5), 0);
        tu_assert_values(ag_neg(t), 2, SZ(2, 3), V(-1, -3, -5, -2, -4, -6), 0);
        tu_assert_values(ag_exp(t), 2, SZ(2, 3), V(exp(1), exp(3), exp(5), exp(2), exp(4), exp(6)),
                         tol_of(dt));
        tu_assert_values(ag_gt_scalar(t, 2.5), 2, SZ(2, 3), V(0, 1, 1, 0, 1, 1), 0);
        tu_assert_values(ag_where(ag_gt_scalar(t, 2.5), t, ones), 2, SZ(2, 3), V(1, 3, 5, 1, 4, 6),
                         0);
        /* a column (stride 2) broadcast against a transposed row */
        ag_tensor *col = ag_slice(base, 1, 0, 1, 1); /* (3, 1) = [1, 3, 5], stride 2 */
        tu_assert_values(ag_add(col, ag_transpose(col, 0, 1)), 2, SZ(3, 3),
                         V(2, 4, 6, 4, 6, 8, 6, 8, 10), 0);
        /* every other element: a stride-2 inner dim */
        ag_tensor *flat = tu_tensor(dt, 1, SZ(6), V(1, 2, 3, 4, 5, 6));
        ag_tensor *odd = ag_slice(flat, 0, 0, 6, 2);
        tu_assert_values(ag_mul_scalar(odd, 10), 1, SZ(3), V(10, 30, 50), 0);
        tu_assert_values(ag_clamp(odd, 2, 4), 1, SZ(3), V(2, 3, 4), 0);
        ag_scope_end();
    }
}

/* Large tensors take the parallel paths: one long row split in chunks (contiguous), many rows
 * (broadcast), strided rows (transposed). */
static void test_large(void **st) {
    (void)st;
    ag_scope_begin();
    const int64_t n = 100003;
    ag_tensor *x = ag_empty(AG_F32, 1, SZ(n)), *y = ag_empty(AG_F32, 1, SZ(n));
    float *px = ag_tensor_data(x), *py = ag_tensor_data(y);
    for (int64_t i = 0; i < n; i++) {
        px[i] = (float)((double)(i % 1000) * 0.01 - 5);
        py[i] = (float)(i % 7);
    }
    ag_tensor *s = ag_add(x, y), *g = ag_sigmoid(x), *c = ag_lt(x, y);
    const float *ps = ag_tensor_data(s), *pg = ag_tensor_data(g);
    const bool *pc = ag_tensor_data(c);
    for (int64_t i = 0; i < n; i++) {
        assert_true(ps[i] == px[i] + py[i]);
        assert_true(fabs(pg[i] - ref_sigmoid(px[i])) < 1e-6);
        assert_true(pc[i] == (px[i] < py[i]));
    }
    /* (300, 300) + (300): rows */
    ag_tensor *a = ag_reshape(ag_slice(x, 0, 0, 300 * 300, 1), 2, SZ(300, 300));
    ag_tensor *b = ag_slice(y, 0, 0, 300, 1);
    ag_tensor *r = ag_add(a, b);
    ag_tensor *rt = ag_add(ag_transpose(a, 0, 1), b); /* strided rows */
    for (int64_t i = 0; i < 300; i++)
        for (int64_t j = 0; j < 300; j++) {
            assert_true(ag_tensor_item_at(r, i * 300 + j) == (float)(px[i * 300 + j] + py[j]));
            assert_true(ag_tensor_item_at(rt, i * 300 + j) == (float)(px[j * 300 + i] + py[j]));
        }
    ag_scope_end();
}

/* f32 sqrt, exp, tanh, sigmoid, silu, gelu and the gelu/silu backward helpers run on the
 * vectorized math of src/ops/fastmath.h: compare with float64 libm over [-30, 30] (a
 * contiguous and a transposed input, so both the vector loads and the strided gathers run)
 * and at special values. */
typedef struct {
    const char *name;
    int kind; /* 0: op(x), 1: helper(ones, x) */
    ag_tensor *(*fn)(ag_tensor *);
    ag_tensor *(*bw)(ag_tensor *, ag_tensor *);
    double (*ref)(double);
} f32_case;

static double ref_exp(double x) {
    return exp(x);
}
static double ref_dgelu(double x) {
    return ref_deriv(ref_gelu, x);
}
static double ref_dgelu_tanh(double x) {
    return ref_deriv(ref_gelu_tanh, x);
}
static double ref_dsilu(double x) {
    return ref_deriv(ref_silu, x);
}
static ag_tensor *gelu_bw_none(ag_tensor *g, ag_tensor *x) {
    return ag_gelu_backward(g, x, "none");
}
static ag_tensor *gelu_bw_tanh(ag_tensor *g, ag_tensor *x) {
    return ag_gelu_backward(g, x, "tanh");
}

static void test_f32_math_accuracy(void **st) {
    (void)st;
    static const f32_case cases[] = {
        {"exp", 0, ag_exp, NULL, ref_exp},
        {"tanh", 0, ag_tanh, NULL, tanh},
        {"sigmoid", 0, ag_sigmoid, NULL, ref_sigmoid},
        {"silu", 0, ag_silu, NULL, ref_silu},
        {"gelu", 0, gelu_none, NULL, ref_gelu},
        {"gelu tanh", 0, gelu_tanh, NULL, ref_gelu_tanh},
        {"gelu_backward", 1, NULL, gelu_bw_none, ref_dgelu},
        {"gelu_backward tanh", 1, NULL, gelu_bw_tanh, ref_dgelu_tanh},
        {"silu_backward", 1, NULL, ag_silu_backward, ref_dsilu},
        {"sqrt", 0, ag_sqrt, NULL, sqrt},
        {"rsqrt", 0, ag_rsqrt, NULL, ref_rsqrt},
    };
    enum { R = 241, C = 250 };
    ag_scope_begin();
    /* x (R, C) row-major; xt is the same values as a transposed view of a (C, R) tensor */
    ag_tensor *x = ag_empty(AG_F32, 2, SZ(R, C)), *base = ag_empty(AG_F32, 2, SZ(C, R));
    float *px = ag_tensor_data(x), *pb = ag_tensor_data(base);
    for (int i = 0; i < R; i++)
        for (int j = 0; j < C; j++)
            px[i * C + j] = pb[j * R + i] = (float)(-30 + 60.0 * (i * C + j) / (R * C - 1));
    ag_tensor *xt = ag_transpose(base, 0, 1), *ones = ag_ones(AG_F32, 2, SZ(R, C));
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        const f32_case *c = &cases[k];
        bool root = c->ref == sqrt || c->ref == ref_rsqrt; /* domain x > 0 */
        for (int v = 0; v < 2; v++) {
            ag_tensor *in = v ? xt : x;
            if (root)
                in = ag_abs(in);
            ag_tensor *y = c->kind ? c->bw(ones, in) : c->fn(in);
            assert_dtype(y, AG_F32);
            for (int64_t e = 0; e < R * C; e++) {
                double xv = ag_tensor_item_at(in, e), want = c->ref(xv);
                double got = ag_tensor_item_at(y, e);
                if (!(fabs(got - want) <= 1e-6 * fabs(want) + 1e-6)) {
                    print_error("%s(%.9g): got %.9g, expected %.9g\n", c->name, xv, got, want);
                    fail();
                }
            }
        }
    }
    /* special values */
    ag_tensor *sp = tu_tensor(AG_F32, 1, SZ(7), V(NAN, INFINITY, -INFINITY, 89, -104, -87.5, 0));
    ag_tensor *e = ag_exp(sp), *t = ag_tanh(sp), *s = ag_sigmoid(sp), *g = ag_gelu(sp, "none");
    assert_true(isnan(ag_tensor_item_at(e, 0)) && isnan(ag_tensor_item_at(t, 0)));
    assert_true(isnan(ag_tensor_item_at(s, 0)) && isnan(ag_tensor_item_at(g, 0)));
    assert_true(isinf(ag_tensor_item_at(e, 1)) && ag_tensor_item_at(e, 2) == 0);
    assert_true(isinf(ag_tensor_item_at(e, 3)) && ag_tensor_item_at(e, 4) == 0);
    assert_true(fabs(ag_tensor_item_at(e, 5) / exp(-87.5) - 1) < 1e-5); /* subnormal */
    assert_true(ag_tensor_item_at(t, 1) == 1 && ag_tensor_item_at(t, 2) == -1);
    assert_true(ag_tensor_item_at(s, 1) == 1 && ag_tensor_item_at(s, 2) == 0);
    assert_true(isinf(ag_tensor_item_at(g, 1)) && ag_tensor_item_at(g, 6) == 0);
    assert_true(isnan(ag_tensor_item(ag_sqrt(tu_tensor(AG_F32, 1, SZ(1), V(-1))))));
    ag_scope_end();
}

/* ---- promotion ---- */

static void test_promotion(void **st) {
    (void)st;
    ag_scope_begin();
    ag_tensor *i = tu_tensor(AG_I64, 1, SZ(2), V(7, -7));
    ag_tensor *j = tu_tensor(AG_I64, 1, SZ(2), V(2, 2));
    ag_tensor *f = tu_tensor(AG_F32, 1, SZ(2), V(0.5, 0.25));
    ag_tensor *g = tu_tensor(AG_F64, 1, SZ(2), V(0.5, 0.25));
    ag_tensor *b = tu_tensor(AG_BOOL, 1, SZ(2), V(1, 0));
    ag_tensor *bt = tu_tensor(AG_BOOL, 1, SZ(2), V(1, 1));

    assert_dtype(ag_add(i, j), AG_I64);
    tu_assert_values(ag_add(i, j), 1, SZ(2), V(9, -5), 0);
    assert_dtype(ag_mul(i, f), AG_F32);
    tu_assert_values(ag_mul(i, f), 1, SZ(2), V(3.5, -1.75), 0);
    assert_dtype(ag_add(f, g), AG_F64);
    assert_dtype(ag_add(b, bt), AG_BOOL); /* logical or */
    tu_assert_values(ag_add(b, bt), 1, SZ(2), V(1, 1), 0);
    tu_assert_values(ag_mul(b, bt), 1, SZ(2), V(1, 0), 0); /* logical and */
    assert_dtype(ag_add(b, i), AG_I64);
    tu_assert_values(ag_add(b, i), 1, SZ(2), V(8, -7), 0);
    /* true division */
    assert_dtype(ag_div(i, j), AG_F32);
    tu_assert_values(ag_div(i, j), 1, SZ(2), V(3.5, -3.5), 0);
    assert_dtype(ag_div_scalar(i, 2), AG_F32);
    /* Scalars */
    assert_dtype(ag_add_scalar(i, 2.5), AG_F32);
    tu_assert_values(ag_add_scalar(i, 2.5), 1, SZ(2), V(9.5, -4.5), 0);
    assert_dtype(ag_mul_scalar(i, 2), AG_I64);
    assert_dtype(ag_mul_scalar(b, 2), AG_I64);
    tu_assert_values(ag_mul_scalar(b, 2), 1, SZ(2), V(2, 0), 0);
    assert_dtype(ag_add_scalar(f, 1e10), AG_F32);
    /* 0-dim tensors raise the category but not the precision */
    assert_dtype(ag_mul(f, ag_scalar_tensor(AG_F64, 2)), AG_F32);
    assert_dtype(ag_mul(ag_scalar_tensor(AG_F64, 2), f), AG_F32);
    assert_dtype(ag_mul(i, ag_scalar_tensor(AG_F64, 2)), AG_F64);
    assert_dtype(ag_mul(i, ag_scalar_tensor(AG_I64, 2)), AG_I64);
    assert_dtype(ag_add(b, ag_scalar_tensor(AG_I64, 2)), AG_I64);
    assert_dtype(ag_mul(ag_scalar_tensor(AG_F32, 2), ag_scalar_tensor(AG_F64, 2)), AG_F64);
    assert_dtype(ag_where(b, i, f), AG_F32);
    tu_assert_values(ag_where(b, i, f), 1, SZ(2), V(7, 0.25), 0);
    /* sub of bools is an error, as in PyTorch */
    assert_null(ag_sub(b, bt));
    tu_assert_error_contains("sub: subtraction, the `-` operator, with two bool tensors");
    assert_null(
        ag_op_call1(ag_op_find("add.Tensor"), (ag_arg[]){AG_A_T(i), AG_A_T(j), AG_A_F(0.5)}, 3));
    tu_assert_error_contains("add: for integral input tensors, argument alpha");
    ag_scope_end();
}

/* ---- clamp, where, masked_fill ---- */

static void test_clamp(void **st) {
    (void)st;
    for (int d = 0; d < 2; d++) {
        ag_dtype dt = float_dts[d];
        ag_scope_begin();
        ag_tensor *x = tu_tensor(dt, 1, SZ(4), V(-2, -0.5, 0.5, 2));
        ag_tensor *r = ag_clamp(x, -1, 1);
        assert_dtype(r, dt);
        tu_assert_values(r, 1, SZ(4), V(-1, -0.5, 0.5, 1), 0);
        assert_true(isnan(ag_tensor_item(ag_clamp(tu_tensor(dt, 1, SZ(1), V(NAN)), -1, 1))));
        tu_assert_values(ag_clamp(x, 0, NAN), 1, SZ(4), V(0, 0, 0.5, 2), 0);
        tu_assert_values(ag_clamp(x, NAN, 0), 1, SZ(4), V(-2, -0.5, 0, 0), 0);
        tu_assert_values(ag_clamp(x, 1, 0), 1, SZ(4), V(0, 0, 0, 0), 0); /* min > max: max */
        ag_scope_end();
    }
    ag_scope_begin();
    ag_tensor *i = tu_tensor(AG_I64, 1, SZ(3), V(-5, 3, 9));
    assert_dtype(ag_clamp(i, 0, 5), AG_I64);
    tu_assert_values(ag_clamp(i, 0, 5), 1, SZ(3), V(0, 3, 5), 0);
    assert_dtype(ag_clamp(i, 0.5, NAN), AG_F32);
    tu_assert_values(ag_clamp(i, 0.5, NAN), 1, SZ(3), V(0.5, 3, 9), 0);
    assert_null(ag_clamp(i, NAN, NAN));
    tu_assert_error_contains("clamp: at least one of 'min' or 'max' must not be None");
    ag_scope_end();
}

static void test_where_masked_fill(void **st) {
    (void)st;
    for (int d = 0; d < 2; d++) {
        ag_dtype dt = float_dts[d];
        ag_scope_begin();
        ag_tensor *c = tu_tensor(AG_BOOL, 2, SZ(2, 3), V(1, 0, 1, 0, 1, 0));
        ag_tensor *a = tu_tensor(dt, 2, SZ(2, 3), V(1, 2, 3, 4, 5, 6));
        ag_tensor *b = tu_tensor(dt, 1, SZ(3), V(-1, -2, -3));
        ag_tensor *r = ag_where(c, a, b);
        assert_dtype(r, dt);
        tu_assert_values(r, 2, SZ(2, 3), V(1, -2, 3, -1, 5, -3), 0);
        /* condition broadcast: (3,) against (2, 3) and a 0-dim other */
        ag_tensor *c3 = tu_tensor(AG_BOOL, 1, SZ(3), V(0, 1, 1));
        tu_assert_values(ag_where(c3, a, ag_scalar_tensor(dt, 0)), 2, SZ(2, 3), V(0, 2, 3, 0, 5, 6),
                         0);
        ag_tensor *m = ag_masked_fill(a, c3, -9);
        assert_dtype(m, dt);
        tu_assert_values(m, 2, SZ(2, 3), V(1, -9, -9, 4, -9, -9), 0);
        /* a (2, 1) mask broadcasts self up to (2, 3) */
        tu_assert_values(ag_masked_fill(b, tu_tensor(AG_BOOL, 2, SZ(2, 1), V(1, 0)), 7), 2,
                         SZ(2, 3), V(7, 7, 7, -1, -2, -3), 0);
        ag_scope_end();
    }
    ag_scope_begin();
    ag_tensor *i = tu_tensor(AG_I64, 1, SZ(3), V(1, 2, 3));
    tu_assert_values(ag_masked_fill(i, tu_tensor(AG_BOOL, 1, SZ(3), V(0, 1, 0)), 5.7), 1, SZ(3),
                     V(1, 5, 3), 0);
    assert_null(ag_where(i, i, i));
    tu_assert_error_contains("where: expected condition to be a bool tensor, but got i64");
    assert_null(ag_masked_fill(i, i, 0));
    tu_assert_error_contains("masked_fill: only supports boolean masks");
    ag_scope_end();
}

/* ---- comparisons ---- */

static void test_comparisons(void **st) {
    (void)st;
    for (int d = 0; d < 2; d++) {
        ag_dtype dt = float_dts[d];
        ag_scope_begin();
        ag_tensor *a = tu_tensor(dt, 1, SZ(4), V(1, 2, 3, 4));
        ag_tensor *b = tu_tensor(dt, 1, SZ(4), V(4, 2, 1, 4));
        ag_tensor_set_requires_grad(a, true);
        ag_tensor *r = ag_eq(a, b);
        assert_dtype(r, AG_BOOL);
        assert_false(ag_tensor_requires_grad(r));
        tu_assert_values(r, 1, SZ(4), V(0, 1, 0, 1), 0);
        tu_assert_values(ag_ne(a, b), 1, SZ(4), V(1, 0, 1, 0), 0);
        tu_assert_values(ag_lt(a, b), 1, SZ(4), V(1, 0, 0, 0), 0);
        tu_assert_values(ag_le(a, b), 1, SZ(4), V(1, 1, 0, 1), 0);
        tu_assert_values(ag_gt(a, b), 1, SZ(4), V(0, 0, 1, 0), 0);
        tu_assert_values(ag_ge(a, b), 1, SZ(4), V(0, 1, 1, 1), 0);
        tu_assert_values(ag_eq_scalar(a, 2), 1, SZ(4), V(0, 1, 0, 0), 0);
        tu_assert_values(ag_ne_scalar(a, 2), 1, SZ(4), V(1, 0, 1, 1), 0);
        tu_assert_values(ag_lt_scalar(a, 2), 1, SZ(4), V(1, 0, 0, 0), 0);
        tu_assert_values(ag_le_scalar(a, 2), 1, SZ(4), V(1, 1, 0, 0), 0);
        tu_assert_values(ag_gt_scalar(a, 2), 1, SZ(4), V(0, 0, 1, 1), 0);
        tu_assert_values(ag_ge_scalar(a, 2), 1, SZ(4), V(0, 1, 1, 1), 0);
        assert_dtype(ag_ge_scalar(a, 2), AG_BOOL);
        /* broadcast (2, 1) against (4) */
        ag_tensor *c = tu_tensor(dt, 2, SZ(2, 1), V(2, 3));
        tu_assert_values(ag_lt(c, a), 2, SZ(2, 4), V(0, 0, 1, 1, 0, 0, 0, 1), 0);
        ag_scope_end();
    }
    ag_scope_begin();
    /* mixed dtypes compare in the promoted dtype: 0.1f != 0.1 in f64, == 0.1f in f32 */
    ag_tensor *f = tu_tensor(AG_F32, 1, SZ(1), V(0.1));
    assert_true(ag_tensor_item(ag_eq(f, tu_tensor(AG_F64, 1, SZ(1), V(0.1)))) == 0);
    assert_true(ag_tensor_item(ag_eq_scalar(f, 0.1)) == 1);
    ag_tensor *i = tu_tensor(AG_I64, 1, SZ(3), V(2, 3, -1));
    tu_assert_values(ag_lt_scalar(i, 2.5), 1, SZ(3), V(1, 0, 1), 0);
    tu_assert_values(ag_eq(i, tu_tensor(AG_F32, 1, SZ(3), V(2, 3.5, -1))), 1, SZ(3), V(1, 0, 1), 0);
    ag_tensor *b = tu_tensor(AG_BOOL, 1, SZ(2), V(1, 0));
    tu_assert_values(ag_eq_scalar(b, 1), 1, SZ(2), V(1, 0), 0);
    tu_assert_values(ag_ne(b, tu_tensor(AG_BOOL, 1, SZ(2), V(1, 1))), 1, SZ(2), V(0, 1), 0);
    assert_null(ag_le(i, tu_tensor(AG_I64, 1, SZ(2), V(1, 2))));
    tu_assert_error_contains("le: shapes [3] and [2] cannot be broadcast");
    ag_scope_end();
}

/* ---- backward helpers ---- */

static void test_backward_helpers(void **st) {
    (void)st;
    const double xv[] = {-1.5, -0.2, 0.3, 2.0}, gv[] = {1, 2, -1, 0.5};
    for (int d = 0; d < 2; d++) {
        ag_dtype dt = float_dts[d];
        double tol = dt == AG_F32 ? 1e-5 : 1e-8; /* vs a central difference */
        ag_scope_begin();
        ag_tensor *g = tu_tensor(dt, 1, SZ(4), gv);
        ag_tensor *x = tu_tensor(dt, 1, SZ(4), xv);
        tu_assert_values(ag_threshold_backward(g, tu_tensor(dt, 1, SZ(4), V(-1, 0, 0.5, 2)), 0), 1,
                         SZ(4), V(0, 0, -1, 0.5), 0);
        tu_assert_values(ag_threshold_backward(g, x, 0.25), 1, SZ(4), V(0, 0, -1, 0.5), 0);
        ag_tensor *y = tu_tensor(dt, 1, SZ(4), V(0.5, 0.25, 0.9, 0.1));
        tu_assert_values(ag_sigmoid_backward(g, y), 1, SZ(4),
                         V(0.25, 2 * 0.75 * 0.25, -0.1 * 0.9, 0.5 * 0.9 * 0.1), tol_of(dt));
        tu_assert_values(ag_tanh_backward(g, y), 1, SZ(4),
                         V(0.75, 2 * (1 - 0.0625), -(1 - 0.81), 0.5 * 0.99), tol_of(dt));
        double want[3][4];
        for (int k = 0; k < 4; k++) {
            want[0][k] = gv[k] * ref_deriv(ref_gelu, xv[k]);
            want[1][k] = gv[k] * ref_deriv(ref_gelu_tanh, xv[k]);
            want[2][k] = gv[k] * ref_deriv(ref_silu, xv[k]);
        }
        tu_assert_values(ag_gelu_backward(g, x, "none"), 1, SZ(4), want[0], tol);
        tu_assert_values(ag_gelu_backward(g, x, "tanh"), 1, SZ(4), want[1], tol);
        tu_assert_values(ag_silu_backward(g, x), 1, SZ(4), want[2], tol);
        assert_null(ag_sigmoid_backward(g, tu_tensor(dt, 1, SZ(3), V(1, 2, 3))));
        tu_assert_error_contains("sigmoid_backward: shapes [4] and [3] cannot be broadcast");
        ag_scope_end();
    }
}

/* ---- in place ---- */

static void test_inplace_values(void **st) {
    (void)st;
    for (int d = 0; d < 2; d++) {
        ag_dtype dt = float_dts[d];
        ag_scope_begin();
        ag_tensor *x = tu_tensor(dt, 1, SZ(4), V(1, 2, 3, 4));
        uint64_t v = ag_tensor_version(x);
        ag_tensor *r = ag_add_(x, ag_ones(dt, 1, SZ(4)), 2);
        assert_ptr_equal(r, x);
        tu_assert_values(x, 1, SZ(4), V(3, 4, 5, 6), 0);
        assert_true(ag_tensor_version(x) > v);
        v = ag_tensor_version(x);
        assert_ptr_equal(ag_add_scalar_(x, 1), x);
        tu_assert_values(x, 1, SZ(4), V(4, 5, 6, 7), 0);
        assert_true(ag_tensor_version(x) > v);
        v = ag_tensor_version(x);
        ag_mul_(x, tu_tensor(dt, 1, SZ(4), V(2, 0, -1, 0.5)));
        tu_assert_values(x, 1, SZ(4), V(8, 0, -6, 3.5), 0);
        assert_true(ag_tensor_version(x) > v);
        v = ag_tensor_version(x);
        ag_mul_scalar_(x, 0.5);
        tu_assert_values(x, 1, SZ(4), V(4, 0, -3, 1.75), 0);
        assert_true(ag_tensor_version(x) > v);
        /* other of another dtype and a 0-dim other */
        ag_add_(x, tu_tensor(AG_I64, 1, SZ(4), V(1, 1, 1, 1)), 1);
        tu_assert_values(x, 1, SZ(4), V(5, 1, -2, 2.75), 0);
        ag_mul_(x, ag_scalar_tensor(AG_F64, 2));
        assert_dtype(x, dt);
        tu_assert_values(x, 1, SZ(4), V(10, 2, -4, 5.5), 0);
        v = ag_tensor_version(x);
        ag_copy_(x, tu_tensor(AG_F64, 1, SZ(4), V(0.5, 1.5, 2.5, 3.5)));
        tu_assert_values(x, 1, SZ(4), V(0.5, 1.5, 2.5, 3.5), 0);
        assert_true(ag_tensor_version(x) > v);
        v = ag_tensor_version(x);
        ag_fill_(x, 7);
        tu_assert_values(x, 1, SZ(4), V(7, 7, 7, 7), 0);
        assert_true(ag_tensor_version(x) > v);
        v = ag_tensor_version(x);
        ag_zero_(x);
        tu_assert_values(x, 1, SZ(4), V(0, 0, 0, 0), 0);
        assert_true(ag_tensor_version(x) > v);
        /* copy_ broadcasts src */
        ag_tensor *m = ag_zeros(dt, 2, SZ(2, 3));
        ag_copy_(m, tu_tensor(dt, 1, SZ(3), V(1, 2, 3)));
        tu_assert_values(m, 2, SZ(2, 3), V(1, 2, 3, 1, 2, 3), 0);
        /* into a transposed view: base (3, 2), t = base^T (2, 3) */
        ag_tensor *base = tu_tensor(dt, 2, SZ(3, 2), V(1, 2, 3, 4, 5, 6));
        ag_tensor *t = ag_transpose(base, 0, 1);
        ag_add_(t, tu_tensor(dt, 1, SZ(3), V(10, 20, 30)), 1);
        tu_assert_values(base, 2, SZ(3, 2), V(11, 12, 23, 24, 35, 36), 0);
        ag_mul_scalar_(t, 2);
        tu_assert_values(base, 2, SZ(3, 2), V(22, 24, 46, 48, 70, 72), 0);
        ag_fill_(ag_select(t, 0, 1), -1); /* the second column of base */
        tu_assert_values(base, 2, SZ(3, 2), V(22, -1, 46, -1, 70, -1), 0);
        ag_scope_end();
    }
    ag_scope_begin();
    /* integer and bool selves */
    ag_tensor *i = tu_tensor(AG_I64, 1, SZ(3), V(1, 2, 3));
    ag_add_(i, tu_tensor(AG_I64, 1, SZ(3), V(1, 1, 1)), 2);
    tu_assert_values(i, 1, SZ(3), V(3, 4, 5), 0);
    ag_copy_(i, tu_tensor(AG_F64, 1, SZ(3), V(2.7, -1.2, 0.5))); /* truncates toward zero */
    assert_dtype(i, AG_I64);
    tu_assert_values(i, 1, SZ(3), V(2, -1, 0), 0);
    ag_tensor *b = tu_tensor(AG_BOOL, 1, SZ(2), V(0, 1));
    ag_fill_(b, 1);
    tu_assert_values(b, 1, SZ(2), V(1, 1), 0);
    ag_scope_end();
}

static void test_inplace_errors(void **st) {
    (void)st;
    ag_scope_begin();
    ag_tensor *x = tu_tensor(AG_F32, 1, SZ(3), V(1, 2, 3));
    ag_tensor *i = tu_tensor(AG_I64, 1, SZ(3), V(1, 2, 3));
    uint64_t v = ag_tensor_version(x);
    assert_null(ag_add_(x, ag_ones(AG_F32, 2, SZ(2, 3)), 1));
    tu_assert_error_contains(
        "add_: output with shape [3] doesn't match the broadcast shape [2, 3]");
    assert_null(ag_add_(x, ag_ones(AG_F32, 1, SZ(2)), 1));
    tu_assert_error_contains("add_: shapes [3] and [2] cannot be broadcast");
    assert_null(ag_copy_(x, ag_ones(AG_F32, 1, SZ(4))));
    tu_assert_error_contains("copy_:");
    assert_int_equal(ag_tensor_version(x), v);
    tu_assert_values(x, 1, SZ(3), V(1, 2, 3), 0);
    assert_null(ag_add_(i, x, 1));
    tu_assert_error_contains(
        "add_: result type Float can't be cast to the desired output type Long");
    assert_null(ag_mul_scalar_(i, 0.5));
    tu_assert_error_contains(
        "mul_: result type Float can't be cast to the desired output type Long");
    assert_null(ag_add_scalar_(i, 0.5));
    tu_assert_error_contains("result type Float can't be cast to the desired output type Long");
    assert_null(ag_mul_scalar_(tu_tensor(AG_BOOL, 1, SZ(1), V(1)), 2));
    tu_assert_error_contains("result type Long can't be cast to the desired output type Bool");
    tu_assert_values(i, 1, SZ(3), V(1, 2, 3), 0);
    ag_scope_end();
}

static void test_leaf_inplace(void **st) {
    (void)st;
    ag_scope_begin();
    ag_tensor *w = tu_tensor(AG_F32, 1, SZ(2), V(1, 2));
    ag_tensor *g = tu_tensor(AG_F32, 1, SZ(2), V(0.5, 0.5));
    ag_tensor_set_requires_grad(w, true);
    uint64_t v = ag_tensor_version(w);
    assert_null(ag_add_(w, g, -1));
    tu_assert_error_contains("add_.Tensor: a leaf tensor that requires grad is being used in an "
                             "in-place operation");
    assert_null(ag_mul_scalar_(w, 2));
    tu_assert_error_contains("leaf tensor that requires grad");
    assert_null(ag_zero_(w));
    tu_assert_error_contains("zero_: a leaf tensor");
    assert_int_equal(ag_tensor_version(w), v);
    tu_assert_values(w, 1, SZ(2), V(1, 2), 0);
    /* an optimizer step under no_grad is fine */
    bool prev = ag_set_grad_enabled(false);
    assert_non_null(ag_add_(w, g, -1));
    ag_set_grad_enabled(prev);
    tu_assert_values(w, 1, SZ(2), V(0.5, 1.5), 0);
    assert_true(ag_tensor_is_leaf(w));
    ag_scope_end();
}

/* ---- backward ---- */

static void test_backward_relu_gelu(void **st) {
    (void)st;
    ag_scope_begin();
    ag_tensor *x = tu_leaf(AG_F64, 1, SZ(4), V(-1, 2, -3, 4));
    ag_tensor *y = ag_relu(x);
    assert_string_equal(ag_tensor_grad_fn_name(y), "relu");
    assert_int_equal(ag_backward(y, tu_tensor(AG_F64, 1, SZ(4), V(1, 2, 3, 4)), false), 0);
    tu_assert_values(ag_tensor_grad(x), 1, SZ(4), V(0, 2, 0, 4), 0);

    const double xv[] = {-1.5, -0.2, 0.3, 2.0};
    for (int mode = 0; mode < 2; mode++) {
        ag_tensor *z = tu_leaf(AG_F64, 1, SZ(4), xv);
        assert_int_equal(
            ag_backward(ag_gelu(z, mode ? "tanh" : "none"), ag_ones(AG_F64, 1, SZ(4)), false), 0);
        double want[4];
        for (int k = 0; k < 4; k++)
            want[k] = ref_deriv(mode ? ref_gelu_tanh : ref_gelu, xv[k]);
        tu_assert_values(ag_tensor_grad(z), 1, SZ(4), want, 1e-8);
    }
    /* clamp: gradient 1 inside [min, max], 0 outside */
    ag_tensor *c = tu_leaf(AG_F32, 1, SZ(4), V(-2, -0.5, 0.5, 2));
    assert_int_equal(ag_backward(ag_clamp(c, -1, 1), ag_ones(AG_F32, 1, SZ(4)), false), 0);
    tu_assert_values(ag_tensor_grad(c), 1, SZ(4), V(0, 1, 1, 0), 0);
    /* an f32 leaf times an i64 tensor gets an f32 gradient */
    ag_tensor *f = tu_leaf(AG_F32, 1, SZ(2), V(1, 2));
    assert_int_equal(ag_backward(ag_mul(f, tu_tensor(AG_I64, 1, SZ(2), V(3, -4))),
                                 ag_ones(AG_F32, 1, SZ(2)), false),
                     0);
    assert_dtype(ag_tensor_grad(f), AG_F32);
    tu_assert_values(ag_tensor_grad(f), 1, SZ(2), V(3, -4), 0);
    ag_scope_end();
}

static void test_backward_where(void **st) {
    (void)st;
    ag_scope_begin();
    ag_tensor *c = tu_tensor(AG_BOOL, 2, SZ(2, 3), V(1, 0, 1, 0, 0, 1));
    ag_tensor *a = tu_leaf(AG_F64, 2, SZ(2, 3), V(1, 2, 3, 4, 5, 6));
    ag_tensor *b = tu_leaf(AG_F64, 1, SZ(3), V(-1, -2, -3));
    ag_tensor *y = ag_where(c, a, b);
    ag_tensor *g = tu_tensor(AG_F64, 2, SZ(2, 3), V(1, 2, 3, 4, 5, 6));
    assert_int_equal(ag_backward(y, g, false), 0);
    tu_assert_values(ag_tensor_grad(a), 2, SZ(2, 3), V(1, 0, 3, 0, 0, 6), 0);
    tu_assert_values(ag_tensor_grad(b), 1, SZ(3), V(4, 2 + 5, 0), 0); /* summed over rows */
    /* masked_fill: no gradient where filled */
    ag_tensor *x = tu_leaf(AG_F64, 1, SZ(3), V(1, 2, 3));
    ag_tensor *m = ag_masked_fill(x, tu_tensor(AG_BOOL, 1, SZ(3), V(0, 1, 0)), 5);
    assert_int_equal(ag_backward(m, tu_tensor(AG_F64, 1, SZ(3), V(7, 8, 9)), false), 0);
    tu_assert_values(ag_tensor_grad(x), 1, SZ(3), V(7, 0, 9), 0);
    ag_scope_end();
}

static void test_backward_inplace(void **st) {
    (void)st;
    ag_scope_begin();
    /* y = 2x; y *= z: dx = 2z, dz = 2x (mul_ saves the original self) */
    ag_tensor *x = tu_leaf(AG_F64, 1, SZ(3), V(1, 2, 3));
    ag_tensor *z = tu_leaf(AG_F64, 1, SZ(3), V(-1, 0.5, 4));
    ag_tensor *y = ag_mul_scalar(x, 2);
    ag_mul_(y, z);
    assert_string_equal(ag_tensor_grad_fn_name(y), "mul_.Tensor");
    tu_assert_values(y, 1, SZ(3), V(-2, 2, 24), 0);
    ag_add_(y, z, 3); /* y + 3z: dz += 3 */
    ag_add_scalar_(y, 1);
    assert_int_equal(ag_backward(y, ag_ones(AG_F64, 1, SZ(3)), false), 0);
    tu_assert_values(ag_tensor_grad(x), 1, SZ(3), V(-2, 1, 8), 0);
    tu_assert_values(ag_tensor_grad(z), 1, SZ(3), V(2 + 3, 4 + 3, 6 + 3), 0);
    /* copy_ cuts self's history (zero gradient) and passes the gradient to src */
    ag_tensor *p = tu_leaf(AG_F64, 1, SZ(2), V(1, 2));
    ag_tensor *q = tu_leaf(AG_F64, 1, SZ(2), V(3, 4));
    ag_tensor *h = ag_mul_scalar(p, 5);
    ag_copy_(h, ag_mul(q, q));
    assert_int_equal(ag_backward(h, ag_ones(AG_F64, 1, SZ(2)), false), 0);
    tu_assert_values(ag_tensor_grad(p), 1, SZ(2), V(0, 0), 0);
    tu_assert_values(ag_tensor_grad(q), 1, SZ(2), V(6, 8), 0);
    /* modifying a saved output is detected at backward time */
    ag_tensor *w = tu_leaf(AG_F64, 1, SZ(2), V(0, 1));
    ag_tensor *e = ag_exp(w);
    ag_add_scalar_(e, 1);
    assert_int_not_equal(ag_backward(e, ag_ones(AG_F64, 1, SZ(2)), false), 0);
    tu_assert_error_contains("modified by an inplace operation");
    ag_scope_end();
}

/* ---- gradcheck of this family's samples (the table-wide test runs every op) ---- */

static void test_gradcheck_family(void **st) {
    (void)st;
    static const char *const names[] = {
        "add.Tensor",
        "sub.Tensor",
        "mul.Tensor",
        "div.Tensor",
        "add.Scalar",
        "sub.Scalar",
        "mul.Scalar",
        "div.Scalar",
        "pow.Tensor_Scalar",
        "neg",
        "exp",
        "log",
        "sqrt",
        "rsqrt",
        "abs",
        "tanh",
        "sigmoid",
        "relu",
        "gelu",
        "silu",
        "sin",
        "cos",
        "sign",
        "clamp",
        "where.self",
        "masked_fill.Scalar",
        "threshold_backward",
        "sigmoid_backward",
        "tanh_backward",
        "gelu_backward",
        "silu_backward",
        "add_.Tensor",
        "add_.Scalar",
        "mul_.Tensor",
        "mul_.Scalar",
        "copy_",
        "zero_",
        "fill_.Scalar",
    };
    tu_gradcheck_ops(names, sizeof names / sizeof names[0]);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_arith_values),
        cmocka_unit_test(test_pow),
        cmocka_unit_test(test_unary_values),
        cmocka_unit_test(test_unary_int_and_special),
        cmocka_unit_test(test_broadcast),
        cmocka_unit_test(test_noncontiguous),
        cmocka_unit_test(test_large),
        cmocka_unit_test(test_f32_math_accuracy),
        cmocka_unit_test(test_promotion),
        cmocka_unit_test(test_clamp),
        cmocka_unit_test(test_where_masked_fill),
        cmocka_unit_test(test_comparisons),
        cmocka_unit_test(test_backward_helpers),
        cmocka_unit_test(test_inplace_values),
        cmocka_unit_test(test_inplace_errors),
        cmocka_unit_test(test_leaf_inplace),
        cmocka_unit_test(test_backward_relu_gelu),
        cmocka_unit_test(test_backward_where),
        cmocka_unit_test(test_backward_inplace),
        cmocka_unit_test(test_gradcheck_family),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
