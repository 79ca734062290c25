/* Tests of linalg.c: mm, bmm, addmm, matmul and linear against hand-computed values and a
 * naive triple loop, transposed/sliced/expanded operand layouts, error messages, the ATen
 * structure of the composites (grad_fn names), direct backward checks, and gradcheck over the
 * ops' own samples. */
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#define SZ(...) ((int64_t[]){__VA_ARGS__})
#define VALS(...) ((double[]){__VA_ARGS__})

static uint64_t rng_state = 88172645463325252ull;

/* A tensor of the given shape with values uniform in [-1, 1). */
static ag_tensor *rand_tensor(ag_dtype dt, int ndim, const int64_t *sizes) {
    return tu_rand_tensor(dt, ndim, sizes, -1, 1, tu_xorshift, &rng_state);
}

/* out[b][i][j] = sum_k a[b][i][k] * b[b][k][j] for a (B, n, k), b (B, k, m) read element by
 * element through their views (B = 1 for 2-d operands). */
static void naive_bmm(const ag_tensor *a, const ag_tensor *b, double *out) {
    int nd = ag_tensor_ndim(a);
    int64_t B = nd == 3 ? ag_tensor_size(a, 0) : 1;
    int64_t n = ag_tensor_size(a, -2), k = ag_tensor_size(a, -1), m = ag_tensor_size(b, -1);
    for (int64_t bb = 0; bb < B; bb++)
        for (int64_t i = 0; i < n; i++)
            for (int64_t j = 0; j < m; j++) {
                double s = 0;
                for (int64_t kk = 0; kk < k; kk++)
                    s += ag_tensor_item_at(a, (bb * n + i) * k + kk) *
                         ag_tensor_item_at(b, (bb * k + kk) * m + j);
                out[(bb * n + i) * m + j] = s;
            }
}

static void test_mm_hand(void **state) {
    (void)state;
    ag_scope_begin();
    for (int d = 0; d < 2; d++) {
        ag_dtype dt = d ? AG_F64 : AG_F32;
        ag_tensor *a = tu_tensor(dt, 2, SZ(2, 3), VALS(1, 2, 3, 4, 5, 6));
        ag_tensor *b = tu_tensor(dt, 2, SZ(3, 2), VALS(7, 8, 9, 10, 11, 12));
        ag_tensor *c = ag_mm(a, b);
        tu_assert_values(c, 2, SZ(2, 2), VALS(58, 64, 139, 154), 1e-6);
        assert_true(ag_tensor_dtype(c) == dt);
        assert_true(ag_tensor_is_contiguous(c));
    }
    ag_scope_end();
}

/* Transposed, sliced and expanded views must give what a plain loop over their elements gives:
 * each layout goes down a different path (NoTrans, Trans, contiguous copy). */
static void test_mm_layouts(void **state) {
    (void)state;
    ag_scope_begin();
    for (int d = 0; d < 2; d++) {
        ag_dtype dt = d ? AG_F64 : AG_F32;
        double tol = d ? 1e-12 : 1e-5;
        ag_tensor *base_a = rand_tensor(dt, 2, SZ(5, 4)); /* a = base_a^T is (4, 5) */
        ag_tensor *base_b = rand_tensor(dt, 2, SZ(6, 5)); /* b = base_b^T is (5, 6) */
        ag_tensor *a = ag_t(base_a), *b = ag_t(base_b);
        ag_tensor *ac = ag_contiguous(a), *bc = ag_contiguous(b);
        double want[4 * 6];
        naive_bmm(ac, bc, want);
        tu_assert_close(ag_mm(a, b), want, tol);
        tu_assert_close(ag_mm(ac, b), want, tol);
        tu_assert_close(ag_mm(a, bc), want, tol);
        tu_assert_close(ag_mm(ac, bc), want, tol);

        /* Every other column: strides (16, 2) are no BLAS layout. */
        ag_tensor *wide = rand_tensor(dt, 2, SZ(4, 10));
        ag_tensor *sl = ag_slice(wide, 1, 0, 10, 2);
        double want2[4 * 6];
        naive_bmm(sl, bc, want2);
        tu_assert_close(ag_mm(sl, bc), want2, tol);

        /* An expanded row (stride 0) and a row slice with a leading-dimension gap. */
        ag_tensor *row = rand_tensor(dt, 2, SZ(1, 5));
        ag_tensor *ex = ag_expand(row, 2, SZ(4, 5));
        double want3[4 * 6];
        naive_bmm(ex, bc, want3);
        tu_assert_close(ag_mm(ex, bc), want3, tol);
        ag_tensor *big = rand_tensor(dt, 2, SZ(4, 9));
        ag_tensor *cols = ag_slice(big, 1, 2, 7, 1); /* (4, 5), strides (9, 1) */
        naive_bmm(cols, b, want3);
        tu_assert_close(ag_mm(cols, b), want3, tol);

        /* Vectors: (1, k) @ (k, 1) with odd strides on the size-1 dims. */
        ag_tensor *v = ag_unsqueeze(ag_select(base_a, 1, 2), 0); /* (1, 5), stride (?, 4) */
        ag_tensor *u = ag_unsqueeze(ag_select(base_b, 0, 1), 1); /* (5, 1) */
        double want4[1];
        naive_bmm(v, u, want4);
        tu_assert_close(ag_mm(v, u), want4, tol);
    }
    ag_scope_end();
}

static void test_mm_empty(void **state) {
    (void)state;
    ag_scope_begin();
    ag_tensor *a = ag_zeros(AG_F32, 2, SZ(3, 0)), *b = ag_zeros(AG_F32, 2, SZ(0, 2));
    tu_assert_values(ag_mm(a, b), 2, SZ(3, 2), VALS(0, 0, 0, 0, 0, 0), 0);
    ag_tensor *c = ag_mm(ag_zeros(AG_F32, 2, SZ(0, 4)), ag_ones(AG_F32, 2, SZ(4, 2)));
    assert_non_null(c);
    assert_int_equal(ag_tensor_numel(c), 0);
    ag_scope_end();
}

static void test_mm_errors(void **state) {
    (void)state;
    ag_scope_begin();
    ag_tensor *a = ag_zeros(AG_F32, 2, SZ(4, 3)), *b = ag_zeros(AG_F32, 2, SZ(2, 3));
    assert_null(ag_mm(a, b));
    tu_assert_error_contains("mm: size mismatch: [4, 3] @ [2, 3]");
    assert_null(ag_mm(a, ag_zeros(AG_F32, 1, SZ(3))));
    tu_assert_error_contains("mm: mat2 must be a 2-d tensor");
    assert_null(ag_mm(a, ag_zeros(AG_F64, 2, SZ(3, 2))));
    tu_assert_error_contains("mm: expected both operands to have the same dtype, got f32 and f64");
    assert_null(ag_mm(ag_zeros(AG_I64, 2, SZ(2, 2)), ag_zeros(AG_I64, 2, SZ(2, 2))));
    tu_assert_error_contains("mm");
    assert_null(ag_bmm(ag_zeros(AG_F32, 3, SZ(2, 3, 4)), ag_zeros(AG_F32, 3, SZ(3, 4, 5))));
    tu_assert_error_contains("bmm: batch sizes differ: [2, 3, 4] @ [3, 4, 5]");
    assert_null(ag_bmm(ag_zeros(AG_F32, 3, SZ(2, 3, 4)), ag_zeros(AG_F32, 3, SZ(2, 5, 5))));
    tu_assert_error_contains("bmm: size mismatch: [2, 3, 4] @ [2, 5, 5]");
    assert_null(ag_bmm(a, a));
    tu_assert_error_contains("bmm: self must be a 3-d tensor, got [4, 3]");
    assert_null(ag_addmm(ag_zeros(AG_F32, 1, SZ(3)), a, ag_zeros(AG_F32, 2, SZ(3, 2)), 1, 1));
    tu_assert_error_contains(
        "addmm: self of shape [3] cannot be broadcast to the product's shape [4, 2]");
    assert_null(ag_matmul(ag_scalar_tensor(AG_F32, 1), a));
    tu_assert_error_contains(
        "matmul: both arguments to matmul need to be at least 1D, but they are 0D and 2D");
    assert_null(ag_matmul(a, ag_zeros(AG_F32, 1, SZ(4))));
    tu_assert_error_contains("matmul: size mismatch: [4, 3] @ [4]");
    assert_null(ag_matmul(ag_zeros(AG_F32, 3, SZ(2, 4, 3)), ag_zeros(AG_F32, 3, SZ(3, 3, 2))));
    tu_assert_error_contains("matmul: shapes [2] and [3] cannot be broadcast");
    assert_null(ag_linear(a, ag_zeros(AG_F32, 2, SZ(5, 4)), NULL));
    tu_assert_error_contains("linear: input [4, 3] does not match weight [5, 4]");
    assert_null(ag_linear(a, ag_zeros(AG_F32, 2, SZ(5, 3)), ag_zeros(AG_F32, 1, SZ(4))));
    tu_assert_error_contains("linear: shapes [4, 5] and [4] cannot be broadcast");
    assert_null(ag_linear(a, ag_zeros(AG_F32, 2, SZ(5, 3)), ag_zeros(AG_F32, 3, SZ(2, 1, 5))));
    tu_assert_error_contains("linear: bias [2, 1, 5] does not broadcast to the output [4, 5]");
    /* NULL in a chain keeps the first message. */
    assert_null(ag_mm(ag_mm(a, b), a));
    tu_assert_error_contains("mm: size mismatch: [4, 3] @ [2, 3]");
    ag_clear_error();
    ag_scope_end();
}

static void test_bmm(void **state) {
    (void)state;
    ag_scope_begin();
    ag_tensor *a = tu_tensor(AG_F32, 3, SZ(2, 1, 2), VALS(1, 2, 3, 4));
    ag_tensor *b = tu_tensor(AG_F32, 3, SZ(2, 2, 1), VALS(5, 6, 7, 8));
    /* [1 2].[5 6] = 17, [3 4].[7 8] = 53 */
    tu_assert_values(ag_bmm(a, b), 3, SZ(2, 1, 1), VALS(17, 53), 1e-6);
    for (int d = 0; d < 2; d++) {
        ag_dtype dt = d ? AG_F64 : AG_F32;
        double tol = d ? 1e-12 : 1e-5;
        /* Transposed batch matrices, a batch-strided slice, and an expanded batch. */
        ag_tensor *x = ag_transpose(rand_tensor(dt, 3, SZ(3, 5, 4)), 1, 2); /* (3, 4, 5) */
        ag_tensor *y = rand_tensor(dt, 3, SZ(3, 5, 6));
        double want[3 * 4 * 6];
        naive_bmm(x, y, want);
        tu_assert_close(ag_bmm(x, y), want, tol);
        ag_tensor *ys = ag_slice(rand_tensor(dt, 3, SZ(6, 5, 6)), 0, 0, 6, 2);
        naive_bmm(x, ys, want);
        tu_assert_close(ag_bmm(x, ys), want, tol);
        ag_tensor *ye = ag_expand(rand_tensor(dt, 3, SZ(1, 5, 6)), 3, SZ(3, 5, 6));
        naive_bmm(x, ye, want);
        tu_assert_close(ag_bmm(x, ye), want, tol);
        /* A batch large enough for the parallel-over-batch path. */
        ag_tensor *p = rand_tensor(dt, 3, SZ(16, 3, 2)), *q = rand_tensor(dt, 3, SZ(16, 2, 3));
        double want2[16 * 9];
        naive_bmm(p, q, want2);
        tu_assert_close(ag_bmm(p, q), want2, tol);
    }
    ag_scope_end();
}

static void test_addmm(void **state) {
    (void)state;
    ag_scope_begin();
    ag_tensor *m1 = tu_tensor(AG_F64, 2, SZ(2, 2), VALS(1, 2, 3, 4));
    ag_tensor *m2 = tu_tensor(AG_F64, 2, SZ(2, 2), VALS(1, 0, 0, 1));
    ag_tensor *row = tu_tensor(AG_F64, 1, SZ(2), VALS(10, 20));
    ag_tensor *col = tu_tensor(AG_F64, 2, SZ(2, 1), VALS(10, 20));
    tu_assert_values(ag_addmm(row, m1, m2, 1, 1), 2, SZ(2, 2), VALS(11, 22, 13, 24), 1e-12);
    tu_assert_values(ag_addmm(col, m1, m2, 1, 1), 2, SZ(2, 2), VALS(11, 12, 23, 24), 1e-12);
    /* 0.5 * row + 2 * m1 */
    tu_assert_values(ag_addmm(row, m1, m2, 0.5, 2), 2, SZ(2, 2), VALS(7, 14, 11, 18), 1e-12);
    /* beta = 0 ignores self, NaN included. */
    ag_tensor *nan = ag_full(AG_F64, 2, SZ(2, 2), NAN);
    tu_assert_values(ag_addmm(nan, m1, m2, 0, 3), 2, SZ(2, 2), VALS(3, 6, 9, 12), 1e-12);
    /* 0-d self and an empty inner dimension. */
    tu_assert_values(ag_addmm(ag_scalar_tensor(AG_F64, 1), ag_zeros(AG_F64, 2, SZ(2, 0)),
                              ag_zeros(AG_F64, 2, SZ(0, 3)), 2, 1),
                     2, SZ(2, 3), VALS(2, 2, 2, 2, 2, 2), 1e-12);
    /* Transposed mat2 (as linear's t(weight)) matches the naive product plus bias. */
    ag_tensor *w = rand_tensor(AG_F32, 2, SZ(5, 3)), *x = rand_tensor(AG_F32, 2, SZ(4, 3));
    ag_tensor *b = rand_tensor(AG_F32, 1, SZ(5));
    double want[20];
    naive_bmm(x, ag_t(w), want);
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 5; j++)
            want[i * 5 + j] += ag_tensor_item_at(b, j);
    tu_assert_close(ag_addmm(b, x, ag_t(w), 1, 1), want, 1e-5);
    ag_scope_end();
}

static void test_matmul_cases(void **state) {
    (void)state;
    ag_scope_begin();
    ag_tensor *v = tu_tensor(AG_F64, 1, SZ(3), VALS(1, 2, 3));
    ag_tensor *u = tu_tensor(AG_F64, 1, SZ(3), VALS(4, 5, 6));
    ag_tensor *m = tu_tensor(AG_F64, 2, SZ(3, 2), VALS(1, 2, 3, 4, 5, 6));
    ag_tensor *mt = tu_tensor(AG_F64, 2, SZ(2, 3), VALS(1, 2, 3, 4, 5, 6));
    tu_assert_values(ag_matmul(v, u), 0, NULL, VALS(32), 1e-12);
    tu_assert_values(ag_matmul(v, m), 1, SZ(2), VALS(22, 28), 1e-12);
    tu_assert_values(ag_matmul(mt, v), 1, SZ(2), VALS(14, 32), 1e-12);
    tu_assert_values(ag_matmul(mt, m), 2, SZ(2, 2), VALS(22, 28, 49, 64), 1e-12);

    /* 3-d @ 2-d, 3-d @ 1-d, 2-d @ 3-d, 1-d @ 3-d and a broadcast batch, against loops. */
    ag_tensor *a3 = rand_tensor(AG_F64, 3, SZ(2, 4, 3));
    ag_tensor *b3 = rand_tensor(AG_F64, 3, SZ(2, 3, 5));
    ag_tensor *r;
    double want[64];
    r = ag_matmul(a3, m);
    assert_non_null(r);
    assert_int_equal(ag_tensor_ndim(r), 3);
    naive_bmm(ag_reshape(a3, 2, SZ(8, 3)), m, want);
    tu_assert_close(r, want, 1e-12);
    r = ag_matmul(a3, v);
    assert_int_equal(ag_tensor_ndim(r), 2);
    naive_bmm(ag_reshape(a3, 2, SZ(8, 3)), ag_unsqueeze(v, 1), want);
    tu_assert_close(r, want, 1e-12);
    r = ag_matmul(mt, b3); /* (2, 3) @ (2, 3, 5) -> (2, 2, 5) */
    assert_int_equal(ag_tensor_size(r, 0), 2);
    naive_bmm(ag_expand(ag_unsqueeze(mt, 0), 3, SZ(2, 2, 3)), b3, want);
    tu_assert_close(r, want, 1e-12);
    r = ag_matmul(v, b3); /* (3) @ (2, 3, 5) -> (2, 5) */
    assert_int_equal(ag_tensor_ndim(r), 2);
    assert_int_equal(ag_tensor_size(r, 0), 2);
    assert_int_equal(ag_tensor_size(r, 1), 5);
    naive_bmm(ag_expand(ag_reshape(v, 3, SZ(1, 1, 3)), 3, SZ(2, 1, 3)), b3, want);
    tu_assert_close(r, want, 1e-12);

    ag_tensor *p = rand_tensor(AG_F64, 4, SZ(2, 1, 3, 4));
    ag_tensor *q = ag_transpose(rand_tensor(AG_F64, 3, SZ(3, 2, 4)), 1, 2); /* (3, 4, 2) */
    r = ag_matmul(p, q);
    assert_non_null(r);
    assert_int_equal(ag_tensor_ndim(r), 4);
    assert_int_equal(ag_tensor_size(r, 0), 2);
    assert_int_equal(ag_tensor_size(r, 1), 3);
    for (int64_t i = 0; i < 2; i++)
        for (int64_t j = 0; j < 3; j++) {
            ag_tensor *pi = ag_select(ag_select(p, 0, i), 0, 0), *qj = ag_select(q, 0, j);
            double w2[6];
            naive_bmm(pi, qj, w2);
            tu_assert_close(ag_select(ag_select(r, 0, i), 0, j), w2, 1e-12);
        }
    /* batch @ vector broadcast: (2, 1, 3, 4) @ (4) -> (2, 1, 3). */
    ag_tensor *v4 = rand_tensor(AG_F64, 1, SZ(4));
    r = ag_matmul(p, v4);
    assert_int_equal(ag_tensor_ndim(r), 3);
    naive_bmm(ag_reshape(p, 2, SZ(6, 4)), ag_unsqueeze(v4, 1), want);
    tu_assert_close(r, want, 1e-12);
    ag_scope_end();
}

/* The composites decompose as ATen does; the last op recorded names the node. */
static void test_matmul_linear_structure(void **state) {
    (void)state;
    ag_scope_begin();
    ag_tensor *w = rand_tensor(AG_F32, 2, SZ(5, 3)), *b = rand_tensor(AG_F32, 1, SZ(5));
    ag_tensor_set_requires_grad(w, true);
    ag_tensor_set_requires_grad(b, true);
    ag_tensor *x2 = rand_tensor(AG_F32, 2, SZ(4, 3)), *x3 = rand_tensor(AG_F32, 3, SZ(2, 4, 3));
    assert_string_equal(ag_tensor_grad_fn_name(ag_linear(x2, w, b)), "addmm");
    assert_string_equal(ag_tensor_grad_fn_name(ag_linear(x2, w, NULL)), "mm");
    assert_string_equal(ag_tensor_grad_fn_name(ag_linear(x3, w, b)), "view");
    /* The view's input is the addmm. */
    ag_tensor *y3 = ag_linear(x3, w, b);
    assert_int_equal(ag_tensor_ndim(y3), 3);
    /* Non-contiguous 3-d input with bias: matmul(x, t(w)) then add. */
    ag_tensor *x3t = ag_transpose(rand_tensor(AG_F32, 3, SZ(4, 2, 3)), 0, 1);
    assert_string_equal(ag_tensor_grad_fn_name(ag_linear(x3t, w, b)), "add.Tensor");
    /* matmul 2-d @ 2-d is mm, a batch is bmm followed by a view. */
    ag_tensor *m = rand_tensor(AG_F32, 2, SZ(3, 4));
    ag_tensor_set_requires_grad(m, true);
    assert_string_equal(ag_tensor_grad_fn_name(ag_matmul(x2, m)), "mm");
    ag_tensor *bb = rand_tensor(AG_F32, 3, SZ(2, 3, 4));
    ag_tensor_set_requires_grad(bb, true);
    assert_string_equal(ag_tensor_grad_fn_name(ag_matmul(x3, bb)), "view");
    /* (1, 4, 3) @ (2, 3, 4): a batch of 1 that requires grad is squeezed and folded into one
     * mm on bb's transpose, whose result is transposed back and made contiguous (a clone);
     * without requires_grad it is expanded for bmm (then viewed). Same values either way. */
    ag_tensor *one = rand_tensor(AG_F32, 3, SZ(1, 4, 3));
    ag_tensor *plain = ag_matmul(one, bb);
    assert_string_equal(ag_tensor_grad_fn_name(plain), "view");
    ag_tensor_set_requires_grad(one, true);
    ag_tensor *folded = ag_matmul(one, bb);
    assert_string_equal(ag_tensor_grad_fn_name(folded), "clone");
    assert_int_equal(ag_tensor_ndim(folded), 3);
    assert_int_equal(ag_tensor_size(folded, 0), 2);
    assert_true(tu_max_abs_diff(plain, folded) < 1e-5);
    double want[2 * 4 * 4];
    naive_bmm(ag_expand(one, 3, SZ(2, 4, 3)), bb, want);
    for (int i = 0; i < 32; i++)
        assert_true(fabs(ag_tensor_item_at(folded, i) - want[i]) < 1e-5);
    ag_scope_end();
}

static void test_linear_values(void **state) {
    (void)state;
    ag_scope_begin();
    ag_tensor *w = tu_tensor(AG_F64, 2, SZ(2, 3), VALS(1, 0, -1, 2, 1, 0));
    ag_tensor *b = tu_tensor(AG_F64, 1, SZ(2), VALS(0.5, -0.5));
    ag_tensor *x = tu_tensor(AG_F64, 2, SZ(2, 3), VALS(1, 2, 3, 4, 5, 6));
    /* rows: [1-3, 2+2] = [-2, 4]; [4-6, 8+5] = [-2, 13] */
    tu_assert_values(ag_linear(x, w, NULL), 2, SZ(2, 2), VALS(-2, 4, -2, 13), 1e-12);
    tu_assert_values(ag_linear(x, w, b), 2, SZ(2, 2), VALS(-1.5, 3.5, -1.5, 12.5), 1e-12);
    ag_tensor *x3 = ag_reshape(x, 3, SZ(2, 1, 3));
    tu_assert_values(ag_linear(x3, w, b), 3, SZ(2, 1, 2), VALS(-1.5, 3.5, -1.5, 12.5), 1e-12);
    tu_assert_values(ag_linear(x3, w, NULL), 3, SZ(2, 1, 2), VALS(-2, 4, -2, 13), 1e-12);
    ag_tensor *x1 = tu_tensor(AG_F64, 1, SZ(3), VALS(1, 2, 3));
    tu_assert_values(ag_linear(x1, w, b), 1, SZ(2), VALS(-1.5, 3.5), 1e-12);
    tu_assert_values(ag_linear(x1, w, NULL), 1, SZ(2), VALS(-2, 4), 1e-12);
    ag_scope_end();
}

/* linear's backward: weight grad g^T x (through t, mm, t), bias grad sum_rows(g), input grad
 * g w; and the column-major-mat1 path of mm's backward. */
static void test_backward_direct(void **state) {
    (void)state;
    ag_scope_begin();
    ag_tensor *w = tu_tensor(AG_F64, 2, SZ(2, 3), VALS(1, 0, -1, 2, 1, 0));
    ag_tensor *b = tu_tensor(AG_F64, 1, SZ(2), VALS(0.5, -0.5));
    ag_tensor *x = tu_tensor(AG_F64, 2, SZ(2, 3), VALS(1, 2, 3, 4, 5, 6));
    ag_tensor *g = tu_tensor(AG_F64, 2, SZ(2, 2), VALS(1, 2, 3, 4));
    ag_tensor_set_requires_grad(w, true);
    ag_tensor_set_requires_grad(b, true);
    ag_tensor_set_requires_grad(x, true);
    ag_tensor *y = ag_linear(x, w, b);
    ag_tensor *ins[3] = {x, w, b}, *grads[3];
    assert_int_equal(ag_grad(&y, &g, 1, ins, 3, grads, false, false), 0);
    /* dx = g @ w: [1*1+2*2, 0+2*1, -1+0] = [5, 2, -1]; [3+8, 4, -3] = [11, 4, -3] */
    tu_assert_values(grads[0], 2, SZ(2, 3), VALS(5, 2, -1, 11, 4, -3), 1e-12);
    /* dw = g^T @ x: [1*1+3*4, 1*2+3*5, 1*3+3*6] = [13, 17, 21]; [2+16, 4+20, 6+24] */
    tu_assert_values(grads[1], 2, SZ(2, 3), VALS(13, 17, 21, 18, 24, 30), 1e-12);
    tu_assert_values(grads[2], 1, SZ(2), VALS(4, 6), 1e-12);
    /* ATen's mm_mat2_backward for the column-major t(w) computes t(mm(t(g), x)), so w's grad
     * (the t of that) comes out contiguous; the other product order would not. */
    assert_true(ag_tensor_is_contiguous(grads[1]));

    /* mm with a column-major mat1 takes the (mat2 @ g^T)^T path: same values. */
    ag_tensor *at = tu_tensor(AG_F64, 2, SZ(3, 2), VALS(1, 4, 2, 5, 3, 6));
    ag_tensor_set_requires_grad(at, true);
    ag_tensor *a = ag_t(at); /* (2, 3), strides (1, 2): column-major */
    ag_tensor *m2 = tu_tensor(AG_F64, 2, SZ(3, 2), VALS(1, 2, 3, 4, 5, 6));
    ag_tensor_set_requires_grad(m2, true);
    ag_tensor *z = ag_mm(a, m2);
    ag_tensor *ins2[2] = {at, m2}, *grads2[2];
    assert_int_equal(ag_grad(&z, &g, 1, ins2, 2, grads2, false, false), 0);
    /* d a = g @ m2^T = [[1*1+2*2, 3+8, 5+12], [3+8, 9+16, 15+24]] = [[5, 11, 17], [11, 25, 39]];
     * d at is its transpose. */
    tu_assert_values(grads2[0], 2, SZ(3, 2), VALS(5, 11, 11, 25, 17, 39), 1e-12);
    assert_true(ag_tensor_is_contiguous(grads2[0]));
    /* d m2 = a^T @ g, a = [[1,2,3],[4,5,6]]: [[1+12, 2+16], [2+15, 4+20], [3+18, 6+24]] */
    tu_assert_values(grads2[1], 2, SZ(3, 2), VALS(13, 18, 17, 24, 21, 30), 1e-12);

    /* addmm's alpha and beta scale the grads. */
    ag_tensor *s = tu_tensor(AG_F64, 1, SZ(2), VALS(0, 0));
    ag_tensor_set_requires_grad(s, true);
    ag_tensor *o = ag_addmm(s, ag_detach(x), ag_t(w), 0.5, 2.0);
    ag_tensor *ins3[2] = {s, w}, *grads3[2];
    assert_int_equal(ag_grad(&o, &g, 1, ins3, 2, grads3, false, false), 0);
    tu_assert_values(grads3[0], 1, SZ(2), VALS(2, 3), 1e-12);
    tu_assert_values(grads3[1], 2, SZ(2, 3), VALS(26, 34, 42, 36, 48, 60), 1e-12);
    ag_scope_end();
}

/* ---- gradcheck over the samples of this file's ops ---- */

static void test_gradcheck_samples(void **state) {
    (void)state;
    static const char *const names[] = {"mm", "bmm", "addmm", "matmul", "linear"};
    tu_gradcheck_ops(names, sizeof names / sizeof names[0]);
}

static void test_costs_and_flags(void **state) {
    (void)state;
    ag_scope_begin();
    const ag_op *mm = ag_op_find("mm");
    assert_true(ag_op_def(mm)->flags & AG_OP_COMPUTE_INTENSIVE);
    ag_tensor *a = ag_zeros(AG_F32, 2, SZ(4, 3)), *b = ag_zeros(AG_F32, 2, SZ(3, 5));
    ag_cost c;
    assert_int_equal(ag_op_cost(mm, (ag_arg[]){AG_A_T(a), AG_A_T(b)}, 2, &c), 0);
    assert_true(c.flops == 2.0 * 4 * 3 * 5);
    assert_true(c.bytes == (12 + 15 + 20) * 4.0);
    const ag_op *bmm = ag_op_find("bmm");
    ag_tensor *x = ag_zeros(AG_F64, 3, SZ(2, 4, 3)), *y = ag_zeros(AG_F64, 3, SZ(2, 3, 5));
    assert_int_equal(ag_op_cost(bmm, (ag_arg[]){AG_A_T(x), AG_A_T(y)}, 2, &c), 0);
    assert_true(c.flops == 2.0 * 2 * 4 * 3 * 5);
    ag_scope_end();
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_mm_hand),
        cmocka_unit_test(test_mm_layouts),
        cmocka_unit_test(test_mm_empty),
        cmocka_unit_test(test_mm_errors),
        cmocka_unit_test(test_bmm),
        cmocka_unit_test(test_addmm),
        cmocka_unit_test(test_matmul_cases),
        cmocka_unit_test(test_matmul_linear_structure),
        cmocka_unit_test(test_linear_values),
        cmocka_unit_test(test_backward_direct),
        cmocka_unit_test(test_gradcheck_samples),
        cmocka_unit_test(test_costs_and_flags),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
