/* Tests of the joining and indexing ops (src/ops/index.c): cat, stack, split, index_select,
 * index_add, gather, scatter_add, index.Tensor, index_put(_), new_empty/new_zeros. Expected
 * values are worked out by hand in the comments; backward rules are checked on hand-computed
 * gradients and, for every sample the ops declare, by finite differences. */
#include "testutil.h"

#include "core/internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SZ(...) ((int64_t[]){__VA_ARGS__})
#define VALS(...) ((double[]){__VA_ARGS__})

static ag_tensor *idx1(int n, const double *v) {
    return tu_tensor(AG_I64, 1, SZ(n), v);
}

/* Calls an op that has no public entry point. */
static ag_tensor *call(const char *name, const ag_arg *args, int n) {
    const ag_op *op = ag_op_find(name);
    assert_non_null(op);
    return ag_op_call1(op, args, n);
}

static int setup(void **state) {
    (void)state;
    ag_clear_error();
    ag_scope_begin();
    return 0;
}

static int teardown(void **state) {
    (void)state;
    ag_scope_end();
    return 0;
}

/* ---- cat ---- */

static void test_cat_three_inputs_promotion(void **state) {
    (void)state;
    /* a f32 (2,2), b i64 (2,1), c f64 (2,3) given as the transpose of a (3,2) tensor. */
    ag_tensor *a = tu_tensor(AG_F32, 2, SZ(2, 2), VALS(1, 2, 3, 4));
    ag_tensor *b = tu_tensor(AG_I64, 2, SZ(2, 1), VALS(5, 6));
    ag_tensor *ct = tu_tensor(AG_F64, 2, SZ(3, 2), VALS(7, 10, 8, 11, 9, 12));
    ag_tensor *c = ag_t(ct); /* [[7, 8, 9], [10, 11, 12]] */
    assert_non_null(c);
    assert_false(ag_tensor_is_contiguous(c));
    ag_tensor *y = ag_cat((ag_tensor *[]){a, b, c}, 3, 1);
    assert_non_null(y);
    assert_int_equal(ag_tensor_dtype(y), AG_F64);
    tu_assert_values(y, 2, SZ(2, 6), VALS(1, 2, 5, 7, 8, 9, 3, 4, 6, 10, 11, 12), 0);
    /* dim -2 stacks rows; i64 + bool stays i64 */
    ag_tensor *r0 = tu_tensor(AG_I64, 2, SZ(1, 2), VALS(1, 2));
    ag_tensor *r1 = tu_tensor(AG_BOOL, 2, SZ(2, 2), VALS(1, 0, 0, 1));
    ag_tensor *z = ag_cat((ag_tensor *[]){r0, r1}, 2, -2);
    assert_int_equal(ag_tensor_dtype(z), AG_I64);
    tu_assert_values(z, 2, SZ(3, 2), VALS(1, 2, 1, 0, 0, 1), 0);
}

static void test_cat_legacy_empty_and_errors(void **state) {
    (void)state;
    ag_tensor *a = tu_tensor(AG_F32, 2, SZ(1, 2), VALS(1, 2));
    ag_tensor *e = ag_zeros(AG_F32, 1, SZ(0));
    /* A 1-d empty tensor is skipped whatever the others' shapes, as in PyTorch. */
    ag_tensor *y = ag_cat((ag_tensor *[]){e, a, a}, 3, 0);
    tu_assert_values(y, 2, SZ(2, 2), VALS(1, 2, 1, 2), 0);

    ag_tensor *b = tu_tensor(AG_F32, 2, SZ(2, 3), VALS(1, 2, 3, 4, 5, 6));
    assert_null(ag_cat((ag_tensor *[]){a, b}, 2, 0));
    tu_assert_error_contains("cat: sizes of tensors must match except in dimension 0");
    tu_assert_error_contains("[1, 2] and [2, 3]");
    assert_null(ag_cat((ag_tensor *[]){a, a}, 2, 2));
    tu_assert_error_contains(
        "cat: Dimension out of range (expected to be in range of [-2, 1], but got 2)");
    assert_null(ag_cat((ag_tensor *[]){a, ag_scalar_tensor(AG_F32, 1)}, 2, 0));
    tu_assert_error_contains("cat: zero-dimensional tensor (at position 1)");
    assert_null(ag_cat(NULL, 0, 0));
    tu_assert_error_contains("cat: expected a non-empty list");
    ag_tensor *c3 = ag_zeros(AG_F32, 3, SZ(1, 2, 1));
    assert_null(ag_cat((ag_tensor *[]){a, c3}, 2, 0));
    tu_assert_error_contains("cat: tensors must have the same number of dimensions");
}

/* ---- stack ---- */

static void test_stack(void **state) {
    (void)state;
    ag_tensor *a = tu_tensor(AG_F64, 2, SZ(2, 3), VALS(1, 2, 3, 4, 5, 6));
    ag_tensor *b = tu_tensor(AG_F32, 2, SZ(2, 3), VALS(7, 8, 9, 10, 11, 12));
    ag_tensor *y = ag_stack((ag_tensor *[]){a, b}, 2, 1);
    assert_int_equal(ag_tensor_dtype(y), AG_F64);
    /* y[i][s][j] = (a, b)[s][i][j] */
    tu_assert_values(y, 3, SZ(2, 2, 3), VALS(1, 2, 3, 7, 8, 9, 4, 5, 6, 10, 11, 12), 0);
    ag_tensor *z = ag_stack((ag_tensor *[]){a, ag_t(ag_t(b))}, 2, -1);
    tu_assert_values(z, 3, SZ(2, 3, 2), VALS(1, 7, 2, 8, 3, 9, 4, 10, 5, 11, 6, 12), 0);
    /* non-contiguous input: the transpose of a (3,2) */
    ag_tensor *bt = ag_t(tu_tensor(AG_F64, 2, SZ(3, 2), VALS(7, 10, 8, 11, 9, 12)));
    ag_tensor *w = ag_stack((ag_tensor *[]){a, bt}, 2, 0);
    tu_assert_values(w, 3, SZ(2, 2, 3), VALS(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12), 0);

    ag_tensor *c = ag_zeros(AG_F64, 2, SZ(2, 4));
    assert_null(ag_stack((ag_tensor *[]){a, c}, 2, 0));
    tu_assert_error_contains("stack: expects each tensor to be equal size, but got [2, 3] at "
                             "entry 0 and [2, 4] at entry 1");
    assert_null(ag_stack((ag_tensor *[]){a, a}, 2, 3));
    tu_assert_error_contains(
        "stack: Dimension out of range (expected to be in range of [-3, 2], but got 3)");
}

/* ---- split ---- */

static void test_split_uneven(void **state) {
    (void)state;
    ag_tensor *x = tu_tensor(AG_F32, 2, SZ(5, 2), VALS(0, 1, 2, 3, 4, 5, 6, 7, 8, 9));
    ag_tensor *o[4] = {0};
    assert_int_equal(ag_split(x, 2, 0, o, 4), 3);
    tu_assert_values(o[0], 2, SZ(2, 2), VALS(0, 1, 2, 3), 0);
    tu_assert_values(o[1], 2, SZ(2, 2), VALS(4, 5, 6, 7), 0);
    tu_assert_values(o[2], 2, SZ(1, 2), VALS(8, 9), 0);
    assert_null(o[3]);
    /* The chunks are copies here (not views as in PyTorch): writing one leaves x alone. */
    ((float *)ag_tensor_data(o[0]))[0] = 100;
    assert_true(ag_tensor_item_at(x, 0) == 0);

    /* dim -1 of a non-contiguous (2,5) view: rows of x^T */
    ag_tensor *xt = ag_t(x); /* [[0,2,4,6,8],[1,3,5,7,9]] */
    ag_tensor *p[4] = {0};
    assert_int_equal(ag_split(xt, 3, -1, p, 4), 2);
    tu_assert_values(p[0], 2, SZ(2, 3), VALS(0, 2, 4, 1, 3, 5), 0);
    tu_assert_values(p[1], 2, SZ(2, 2), VALS(6, 8, 7, 9), 0);

    /* split_size larger than the dim: one chunk, the whole tensor */
    ag_tensor *q[2] = {0};
    assert_int_equal(ag_split(x, 7, 0, q, 2), 1);
    tu_assert_values(q[0], 2, SZ(5, 2), VALS(0, 1, 2, 3, 4, 5, 6, 7, 8, 9), 0);

    /* fewer slots than chunks: the count is returned, the first max_out are stored */
    ag_tensor *r[1] = {0};
    assert_int_equal(ag_split(x, 2, 0, r, 1), 3);
    tu_assert_values(r[0], 2, SZ(2, 2), VALS(0, 1, 2, 3), 0);
}

static void test_split_errors(void **state) {
    (void)state;
    ag_tensor *o[4];
    /* more chunks than the dispatcher's output arrays hold */
    ag_tensor *big = ag_zeros(AG_F32, 1, SZ(2 * AG_MAX_OUTPUTS + 1));
    assert_true(ag_split(big, 2, 0, o, 4) < 0);
    char msg[128];
    snprintf(msg, sizeof msg, "gives %d outputs; at most %d are supported", AG_MAX_OUTPUTS + 1,
             AG_MAX_OUTPUTS);
    tu_assert_error_contains("split: splitting [");
    tu_assert_error_contains(msg);
    ag_tensor *x = ag_zeros(AG_F32, 1, SZ(10));
    assert_true(ag_split(x, 0, 0, o, 4) < 0);
    tu_assert_error_contains("split: split_size must be positive");
    assert_true(ag_split(x, 2, 1, o, 4) < 0);
    tu_assert_error_contains(
        "split: Dimension out of range (expected to be in range of [-1, 0], but got 1)");
    assert_true(ag_split(ag_scalar_tensor(AG_F32, 1), 1, 0, o, 4) < 0);
    tu_assert_error_contains("split: expected at least a 1-dimensional tensor");
}

/* ---- index_select / index_add ---- */

static void test_index_select(void **state) {
    (void)state;
    ag_tensor *x = tu_tensor(AG_F64, 2, SZ(3, 2), VALS(1, 2, 3, 4, 5, 6));
    ag_tensor *y = ag_index_select(x, 0, idx1(3, VALS(2, 0, 2)));
    tu_assert_values(y, 2, SZ(3, 2), VALS(5, 6, 1, 2, 5, 6), 0);
    /* negative dim and negative index: column -1 then column 0 */
    ag_tensor *z = ag_index_select(x, -1, idx1(2, VALS(-1, 0)));
    tu_assert_values(z, 2, SZ(3, 2), VALS(2, 1, 4, 3, 6, 5), 0);
    /* non-contiguous self: x^T is [[1,3,5],[2,4,6]] */
    ag_tensor *w = ag_index_select(ag_t(x), 1, idx1(2, VALS(1, 1)));
    tu_assert_values(w, 2, SZ(2, 2), VALS(3, 3, 4, 4), 0);
    /* a 0-d index keeps the dim (size 1) */
    ag_tensor *s = ag_index_select(x, 0, tu_tensor(AG_I64, 0, NULL, VALS(1)));
    tu_assert_values(s, 2, SZ(1, 2), VALS(3, 4), 0);
    /* i64 and bool self */
    ag_tensor *xi = tu_tensor(AG_I64, 1, SZ(3), VALS(7, 8, 9));
    tu_assert_values(ag_index_select(xi, 0, idx1(2, VALS(2, 2))), 1, SZ(2), VALS(9, 9), 0);
    ag_tensor *xb = tu_tensor(AG_BOOL, 1, SZ(3), VALS(0, 1, 0));
    tu_assert_values(ag_index_select(xb, 0, idx1(2, VALS(1, 0))), 1, SZ(2), VALS(1, 0), 0);

    assert_null(ag_index_select(x, 0, idx1(2, VALS(0, 3))));
    tu_assert_error_contains("index_select: index 3 is out of bounds for dimension 0 with size 3");
    assert_null(ag_index_select(x, 1, idx1(1, VALS(-3))));
    tu_assert_error_contains("index_select: index -3 is out of bounds for dimension 1 with size 2");
    assert_null(ag_index_select(x, 0, tu_tensor(AG_F32, 1, SZ(1), VALS(0))));
    tu_assert_error_contains("index_select: index must be an int64 tensor, got f32");
    assert_null(ag_index_select(x, 0, tu_tensor(AG_I64, 2, SZ(1, 1), VALS(0))));
    tu_assert_error_contains("index_select: index must be a 0-d or 1-d tensor, got shape [1, 1]");
}

static void test_index_add(void **state) {
    (void)state;
    ag_tensor *x = ag_ones(AG_F64, 2, SZ(3, 2));
    ag_tensor *src = tu_tensor(AG_F64, 2, SZ(3, 2), VALS(1, 2, 3, 4, 5, 6));
    /* rows 0 += 2*([1,2]+[3,4]) = [9, 13]; row 2 += 2*[5,6] = [11, 13] */
    ag_tensor *y = call(
        "index_add",
        (ag_arg[]){AG_A_T(x), AG_A_I(0), AG_A_T(idx1(3, VALS(0, 0, -1))), AG_A_T(src), AG_A_F(2.0)},
        5);
    tu_assert_values(y, 2, SZ(3, 2), VALS(9, 13, 1, 1, 11, 13), 0);
    tu_assert_values(x, 2, SZ(3, 2), VALS(1, 1, 1, 1, 1, 1), 0); /* functional */
    /* dim 1 with an i64 self, non-contiguous source */
    ag_tensor *xi = ag_zeros(AG_I64, 2, SZ(2, 3));
    ag_tensor *si = ag_t(tu_tensor(AG_I64, 2, SZ(2, 2), VALS(1, 3, 2, 4))); /* [[1,2],[3,4]] */
    ag_tensor *z = call(
        "index_add", (ag_arg[]){AG_A_T(xi), AG_A_I(1), AG_A_T(idx1(2, VALS(2, 2))), AG_A_T(si)}, 4);
    tu_assert_values(z, 2, SZ(2, 3), VALS(0, 0, 3, 0, 0, 7), 0);

    assert_null(call("index_add",
                     (ag_arg[]){AG_A_T(x), AG_A_I(0), AG_A_T(idx1(1, VALS(0))), AG_A_T(src)}, 4));
    tu_assert_error_contains("index_add: source [3, 2] must have self's shape [3, 2] except in "
                             "dimension 0");
    assert_null(call("index_add",
                     (ag_arg[]){AG_A_T(x), AG_A_I(0), AG_A_T(idx1(3, VALS(0, 3, 0))), AG_A_T(src)},
                     4));
    tu_assert_error_contains("index_add: index 3 is out of bounds for dimension 0 with size 3");
}

/* ---- gather / scatter_add ---- */

static void test_gather(void **state) {
    (void)state;
    ag_tensor *x = tu_tensor(AG_F32, 2, SZ(2, 3), VALS(1, 2, 3, 4, 5, 6));
    ag_tensor *i1 = tu_tensor(AG_I64, 2, SZ(2, 2), VALS(2, 0, 1, -1));
    /* out[i][j] = x[i][index[i][j]]: [[3, 1], [5, 6]] */
    tu_assert_values(ag_gather(x, 1, i1), 2, SZ(2, 2), VALS(3, 1, 5, 6), 0);
    /* dim 0, index smaller than self: out[0][j] = x[index[0][j]][j] = [4, 2, 6] */
    ag_tensor *i0 = tu_tensor(AG_I64, 2, SZ(1, 3), VALS(1, 0, 1));
    tu_assert_values(ag_gather(x, 0, i0), 2, SZ(1, 3), VALS(4, 2, 6), 0);
    /* non-contiguous self and index: x^T = [[1,4],[2,5],[3,6]], index^T = [[2,1],[0,-1]] */
    ag_tensor *g = ag_gather(ag_t(x), 0, ag_t(i1));
    /* out[i][j] = x^T[index^T[i][j]][j]: [[3, 5], [1, 6]] */
    tu_assert_values(g, 2, SZ(2, 2), VALS(3, 5, 1, 6), 0);
    /* 3-d, dim 1 */
    ag_tensor *x3 = ag_arange(AG_F64, 0, 12, 1);
    x3 = ag_view(x3, 3, SZ(2, 3, 2));
    ag_tensor *i3 = tu_tensor(AG_I64, 3, SZ(2, 1, 2), VALS(2, 0, 1, 1));
    /* out[a][0][c] = x3[a][i3[a][0][c]][c] = a*6 + i*2 + c */
    tu_assert_values(ag_gather(x3, 1, i3), 3, SZ(2, 1, 2), VALS(4, 1, 8, 9), 0);

    assert_null(ag_gather(x, 1, tu_tensor(AG_I64, 2, SZ(1, 1), VALS(3))));
    tu_assert_error_contains("gather: index 3 is out of bounds for dimension 1 with size 3");
    assert_null(ag_gather(x, 1, tu_tensor(AG_I64, 2, SZ(3, 1), VALS(0, 0, 0))));
    tu_assert_error_contains("gather: index [3, 1] must have as many dims as self [2, 3]");
    assert_null(ag_gather(x, 1, idx1(1, VALS(0))));
    tu_assert_error_contains("gather: index [1] must have as many dims as self [2, 3]");
}

static void test_scatter_add(void **state) {
    (void)state;
    ag_tensor *x = ag_zeros(AG_F64, 2, SZ(2, 3));
    ag_tensor *src = tu_tensor(AG_F64, 2, SZ(2, 3), VALS(1, 2, 3, 4, 5, 6));
    ag_tensor *ix = tu_tensor(AG_I64, 2, SZ(2, 3), VALS(0, 0, 2, 1, 1, -2));
    /* row 0: out[0][0] += 1 + 2, out[0][2] += 3; row 1: out[1][1] += 4 + 5 + 6 */
    ag_tensor *y =
        call("scatter_add", (ag_arg[]){AG_A_T(x), AG_A_I(1), AG_A_T(ix), AG_A_T(src)}, 4);
    tu_assert_values(y, 2, SZ(2, 3), VALS(3, 0, 3, 0, 15, 0), 0);
    /* dim 0, index (1,2) smaller than src, self of ones, non-contiguous src:
     * out[ix[0][j]][j] += src[0][j] with src = [[1,3],[2,4]] (the transpose) */
    ag_tensor *ones = ag_ones(AG_F64, 2, SZ(3, 2));
    ag_tensor *srct = ag_t(tu_tensor(AG_F64, 2, SZ(2, 2), VALS(1, 2, 3, 4)));
    ag_tensor *i0 = tu_tensor(AG_I64, 2, SZ(1, 2), VALS(2, 0));
    ag_tensor *z =
        call("scatter_add", (ag_arg[]){AG_A_T(ones), AG_A_I(0), AG_A_T(i0), AG_A_T(srct)}, 4);
    tu_assert_values(z, 2, SZ(3, 2), VALS(1, 4, 1, 1, 2, 1), 0);
    /* i64 */
    ag_tensor *xi = ag_zeros(AG_I64, 1, SZ(3));
    ag_tensor *si = tu_tensor(AG_I64, 1, SZ(4), VALS(1, 2, 3, 4));
    tu_assert_values(
        call("scatter_add",
             (ag_arg[]){AG_A_T(xi), AG_A_I(0), AG_A_T(idx1(4, VALS(1, 1, 0, 1))), AG_A_T(si)}, 4),
        1, SZ(3), VALS(3, 7, 0), 0);

    assert_null(call("scatter_add",
                     (ag_arg[]){AG_A_T(x), AG_A_I(1), AG_A_T(ix), AG_A_T(ag_to_dtype(src, AG_F32))},
                     4));
    tu_assert_error_contains("scatter_add: self (f64) and src (f32) must have the same dtype");
    assert_null(call("scatter_add", (ag_arg[]){AG_A_T(x), AG_A_I(0), AG_A_T(ix), AG_A_T(src)}, 4));
    tu_assert_error_contains("scatter_add: index 2 is out of bounds for dimension 0 with size 2");
}

/* ---- index.Tensor ---- */

static void test_index_one_tensor(void **state) {
    (void)state;
    ag_tensor *x = ag_view(ag_arange(AG_F32, 0, 12, 1), 2, SZ(3, 4)); /* x[i][j] = 4i + j */
    ag_tensor *y = ag_index(x, (ag_tensor *[]){idx1(2, VALS(2, 0))}, 1);
    tu_assert_values(y, 2, SZ(2, 4), VALS(8, 9, 10, 11, 0, 1, 2, 3), 0);
    /* [:, [3, -3]] */
    ag_tensor *z = ag_index(x, (ag_tensor *[]){NULL, idx1(2, VALS(3, -3))}, 2);
    tu_assert_values(z, 2, SZ(3, 2), VALS(3, 1, 7, 5, 11, 9), 0);
    /* a 2-d index tensor on dim 0 gives (2, 1, 4) */
    ag_tensor *w = ag_index(x, (ag_tensor *[]){tu_tensor(AG_I64, 2, SZ(2, 1), VALS(1, 2))}, 1);
    tu_assert_values(w, 3, SZ(2, 1, 4), VALS(4, 5, 6, 7, 8, 9, 10, 11), 0);
    /* non-contiguous self: x^T[j][i] = 4i + j; x^T[[1]] = [1, 5, 9] */
    tu_assert_values(ag_index(ag_t(x), (ag_tensor *[]){idx1(1, VALS(1))}, 1), 2, SZ(1, 3),
                     VALS(1, 5, 9), 0);
    /* i64 self */
    ag_tensor *xi = tu_tensor(AG_I64, 1, SZ(3), VALS(10, 20, 30));
    tu_assert_values(ag_index(xi, (ag_tensor *[]){idx1(3, VALS(2, 2, 0))}, 1), 1, SZ(3),
                     VALS(30, 30, 10), 0);
}

static void test_index_two_tensors(void **state) {
    (void)state;
    ag_tensor *x = ag_view(ag_arange(AG_F64, 0, 12, 1), 2, SZ(3, 4)); /* 4i + j */
    /* x[[0, 2], [1, 3]] = [x[0][1], x[2][3]] */
    ag_tensor *y = ag_index(x, (ag_tensor *[]){idx1(2, VALS(0, 2)), idx1(2, VALS(1, 3))}, 2);
    tu_assert_values(y, 1, SZ(2), VALS(1, 11), 0);
    /* broadcast (2,1) with (2): x[[[0],[2]], [1, 3]] = [[1, 3], [9, 11]] */
    ag_tensor *z = ag_index(
        x, (ag_tensor *[]){tu_tensor(AG_I64, 2, SZ(2, 1), VALS(0, 2)), idx1(2, VALS(1, 3))}, 2);
    tu_assert_values(z, 2, SZ(2, 2), VALS(1, 3, 9, 11), 0);
    /* non-contiguous index tensor: the transpose of [[0],[2]] is [[0, 2]] (1, 2) */
    ag_tensor *it = ag_t(tu_tensor(AG_I64, 2, SZ(2, 1), VALS(0, 2)));
    tu_assert_values(ag_index(x, (ag_tensor *[]){it, idx1(1, VALS(-1))}, 2), 2, SZ(1, 2),
                     VALS(3, 11), 0);

    ag_tensor *x3 = ag_view(ag_arange(AG_F64, 0, 24, 1), 3, SZ(2, 3, 4)); /* 12a + 4b + c */
    /* adjacent after ':' -> (2, 2): x3[:, [1], [0, 3]] = [[4, 7], [16, 19]] */
    ag_tensor *a = ag_index(x3, (ag_tensor *[]){NULL, idx1(1, VALS(1)), idx1(2, VALS(0, 3))}, 3);
    tu_assert_values(a, 2, SZ(2, 2), VALS(4, 7, 16, 19), 0);
    /* x3[:, [2, 0]] -> (2, 2, 4), trailing dim kept */
    ag_tensor *b = ag_index(x3, (ag_tensor *[]){NULL, idx1(2, VALS(2, 0))}, 2);
    tu_assert_values(b, 3, SZ(2, 2, 4),
                     VALS(8, 9, 10, 11, 0, 1, 2, 3, 20, 21, 22, 23, 12, 13, 14, 15), 0);
    /* separated by ':' -> B first: x3[[1, 0], :, [3, 2]] is (2, 3):
     * row 0 = x3[1, :, 3] = [15, 19, 23], row 1 = x3[0, :, 2] = [2, 6, 10] */
    ag_tensor *c = ag_index(x3, (ag_tensor *[]){idx1(2, VALS(1, 0)), NULL, idx1(2, VALS(3, 2))}, 3);
    tu_assert_values(c, 2, SZ(2, 3), VALS(15, 19, 23, 2, 6, 10), 0);

    assert_null(ag_index(x, (ag_tensor *[]){idx1(2, VALS(0, 1)), idx1(3, VALS(0, 1, 2))}, 2));
    tu_assert_error_contains("index: shapes [2] and [3] cannot be broadcast");
    assert_null(ag_index(x, (ag_tensor *[]){NULL, NULL, idx1(1, VALS(0))}, 3));
    tu_assert_error_contains("index: too many indices for a tensor of dimension 2");
    assert_null(ag_index(x, (ag_tensor *[]){NULL}, 1));
    tu_assert_error_contains("index: at least one index must be a tensor");
    assert_null(ag_index(x, (ag_tensor *[]){tu_tensor(AG_F32, 1, SZ(1), VALS(0))}, 1));
    tu_assert_error_contains("index: tensors used as indices must be int64 or bool tensors, got "
                             "f32 at position 0");
}

static void test_index_bool_mask(void **state) {
    (void)state;
    ag_tensor *x = tu_tensor(AG_F32, 2, SZ(2, 3), VALS(1, 2, 3, 4, 5, 6));
    ag_tensor *m = tu_tensor(AG_BOOL, 2, SZ(2, 3), VALS(1, 0, 1, 0, 1, 0));
    tu_assert_values(ag_index(x, (ag_tensor *[]){m}, 1), 1, SZ(3), VALS(1, 3, 5), 0);
    /* a 1-d mask over dim 0 keeps dim 1 */
    ag_tensor *m0 = tu_tensor(AG_BOOL, 1, SZ(2), VALS(0, 1));
    tu_assert_values(ag_index(x, (ag_tensor *[]){m0}, 1), 2, SZ(1, 3), VALS(4, 5, 6), 0);
    /* a mask over dim 1 after ':' */
    ag_tensor *m1 = tu_tensor(AG_BOOL, 1, SZ(3), VALS(1, 0, 1));
    tu_assert_values(ag_index(x, (ag_tensor *[]){NULL, m1}, 2), 2, SZ(2, 2), VALS(1, 3, 4, 6), 0);
    /* a non-contiguous mask: the transpose of [[1,0],[0,0],[0,1]] is [[1,0,0],[0,0,1]] */
    ag_tensor *mt = ag_t(tu_tensor(AG_BOOL, 2, SZ(3, 2), VALS(1, 0, 0, 0, 0, 1)));
    tu_assert_values(ag_index(x, (ag_tensor *[]){mt}, 1), 1, SZ(2), VALS(1, 6), 0);
    /* an all-false mask gives an empty result */
    ag_tensor *mf = ag_zeros(AG_BOOL, 2, SZ(2, 3));
    ag_tensor *e = ag_index(x, (ag_tensor *[]){mf}, 1);
    assert_non_null(e);
    assert_int_equal(ag_tensor_numel(e), 0);

    assert_null(ag_index(x, (ag_tensor *[]){tu_tensor(AG_BOOL, 1, SZ(3), VALS(1, 0, 1))}, 1));
    tu_assert_error_contains("index: the shape of the mask [3] at index 0 does not match the "
                             "shape of the indexed tensor [2, 3] at index 0");
    /* a meta (data-less) mask: the output shape is data-dependent, so the call must fail */
    ag_tensor *mm = ag__tensor_new(AG_BOOL, 2, SZ(2, 3), true);
    assert_null(ag_index(x, (ag_tensor *[]){mm}, 1));
    tu_assert_error_contains("data-dependent output shape");
    ag_tensor_free(mm);
}

static void test_index_negative_and_out_of_range(void **state) {
    (void)state;
    ag_tensor *x = tu_tensor(AG_F64, 1, SZ(3), VALS(10, 20, 30));
    tu_assert_values(ag_index(x, (ag_tensor *[]){idx1(3, VALS(-1, -3, 0))}, 1), 1, SZ(3),
                     VALS(30, 10, 10), 0);
    assert_null(ag_index(x, (ag_tensor *[]){idx1(2, VALS(0, 3))}, 1));
    tu_assert_error_contains("index: index 3 is out of bounds for dimension 0 with size 3");
    assert_null(ag_index(x, (ag_tensor *[]){idx1(1, VALS(-4))}, 1));
    tu_assert_error_contains("index: index -4 is out of bounds for dimension 0 with size 3");
    ag_tensor *x2 = ag_zeros(AG_F64, 2, SZ(2, 5));
    assert_null(ag_index(x2, (ag_tensor *[]){NULL, idx1(1, VALS(5))}, 2));
    tu_assert_error_contains("index: index 5 is out of bounds for dimension 1 with size 5");
    /* meta self and int indices: the shape is known, no kernel runs, nothing is checked */
    ag_tensor *xm = ag__tensor_new(AG_F32, 2, SZ(4, 5), true);
    ag_tensor *ym = ag_index(xm, (ag_tensor *[]){idx1(3, VALS(9, 9, 9))}, 1);
    assert_non_null(ym);
    assert_int_equal(ag_tensor_ndim(ym), 2);
    assert_int_equal(ag_tensor_sizes(ym)[0], 3);
    assert_int_equal(ag_tensor_sizes(ym)[1], 5);
    assert_null(ag_tensor_data(ym));
    ag_tensor_free(xm);
}

/* ---- index_put / index_put_ ---- */

static void test_index_put(void **state) {
    (void)state;
    ag_tensor *x = ag_zeros(AG_F64, 2, SZ(3, 2));
    ag_tensor *i = idx1(3, VALS(2, 0, 2));
    ag_tensor *v = tu_tensor(AG_F64, 2, SZ(3, 2), VALS(1, 2, 3, 4, 5, 6));
    /* accumulate=False, duplicate row 2: the last write ([5, 6]) wins */
    ag_tensor *y = ag_index_put(x, (ag_tensor *[]){i}, 1, v, false);
    tu_assert_values(y, 2, SZ(3, 2), VALS(3, 4, 0, 0, 5, 6), 0);
    /* accumulate=True: row 2 = [1+5, 2+6] */
    ag_tensor *z = ag_index_put(x, (ag_tensor *[]){i}, 1, v, true);
    tu_assert_values(z, 2, SZ(3, 2), VALS(3, 4, 0, 0, 6, 8), 0);
    tu_assert_values(x, 2, SZ(3, 2), VALS(0, 0, 0, 0, 0, 0), 0); /* functional */
    /* broadcast values, negative index, non-contiguous self (x^T of ones is (2,3)) */
    ag_tensor *ones = ag_t(ag_ones(AG_F64, 2, SZ(3, 2)));
    ag_tensor *w = ag_index_put(ones, (ag_tensor *[]){NULL, idx1(1, VALS(-1))}, 2,
                                tu_tensor(AG_F64, 0, NULL, VALS(7)), true);
    tu_assert_values(w, 2, SZ(2, 3), VALS(1, 1, 8, 1, 1, 8), 0);
    /* two index tensors: positions (0,2), (1,0), (1,2) */
    ag_tensor *q = ag_index_put(ag_zeros(AG_F32, 2, SZ(2, 3)),
                                (ag_tensor *[]){idx1(3, VALS(0, 1, 1)), idx1(3, VALS(2, 0, 2))}, 2,
                                tu_tensor(AG_F32, 1, SZ(3), VALS(1, 2, 3)), false);
    tu_assert_values(q, 2, SZ(2, 3), VALS(0, 0, 1, 2, 0, 3), 0);
    /* bool mask with broadcast values */
    ag_tensor *m = tu_tensor(AG_BOOL, 2, SZ(2, 3), VALS(0, 1, 0, 1, 0, 1));
    ag_tensor *r = ag_index_put(ag_zeros(AG_I64, 2, SZ(2, 3)), (ag_tensor *[]){m}, 1,
                                tu_tensor(AG_I64, 1, SZ(1), VALS(4)), false);
    tu_assert_values(r, 2, SZ(2, 3), VALS(0, 4, 0, 4, 0, 4), 0);

    assert_null(ag_index_put(x, (ag_tensor *[]){i}, 1, ag_to_dtype(v, AG_F32), false));
    tu_assert_error_contains("index_put: index put requires the source and destination dtypes to "
                             "match, got f64 for the destination and f32 for the source");
    assert_null(ag_index_put(x, (ag_tensor *[]){i}, 1, ag_zeros(AG_F64, 1, SZ(3)), false));
    tu_assert_error_contains("index_put: shape mismatch: value tensor of shape [3] cannot be "
                             "broadcast to indexing result of shape [3, 2]");
    assert_null(
        ag_index_put(x, (ag_tensor *[]){idx1(1, VALS(3))}, 1, ag_zeros(AG_F64, 1, SZ(2)), false));
    tu_assert_error_contains("index_put: index 3 is out of bounds for dimension 0 with size 3");
}

static void test_index_put_inplace(void **state) {
    (void)state;
    ag_tensor *x = ag_zeros(AG_F32, 1, SZ(4));
    uint64_t v0 = ag_tensor_version(x);
    ag_tensor *y = ag_index_put_(x, (ag_tensor *[]){idx1(2, VALS(1, -1))}, 1,
                                 tu_tensor(AG_F32, 1, SZ(2), VALS(5, 6)), false);
    assert_non_null(y);
    assert_true(ag_tensor_same_storage(x, y));
    assert_true(ag_tensor_version(x) > v0);
    tu_assert_values(x, 1, SZ(4), VALS(0, 5, 0, 6), 0);
    /* accumulate into a non-contiguous view's storage: column 1 of a (2,3) via its transpose */
    ag_tensor *base = ag_zeros(AG_F64, 2, SZ(2, 3));
    ag_tensor *bt = ag_t(base); /* (3,2) view */
    assert_non_null(ag_index_put_(bt, (ag_tensor *[]){idx1(2, VALS(1, 1))}, 1,
                                  tu_tensor(AG_F64, 1, SZ(2), VALS(1, 2)), true));
    tu_assert_values(base, 2, SZ(2, 3), VALS(0, 2, 0, 0, 4, 0), 0);
    /* values that alias self are read before the writes: x[[0, 1]] = x[[1, 0]] swaps */
    ag_tensor *s = tu_tensor(AG_F64, 1, SZ(2), VALS(1, 2));
    ag_tensor *sw = ag_index(s, (ag_tensor *[]){idx1(2, VALS(1, 0))}, 1);
    assert_non_null(ag_index_put_(s, (ag_tensor *[]){idx1(2, VALS(0, 1))}, 1, sw, false));
    tu_assert_values(s, 1, SZ(2), VALS(2, 1), 0);
    /* expanded (overlapping) self is refused */
    ag_tensor *ex = ag_expand(ag_zeros(AG_F32, 2, SZ(1, 3)), 2, SZ(2, 3));
    assert_null(
        ag_index_put_(ex, (ag_tensor *[]){idx1(1, VALS(0))}, 1, ag_zeros(AG_F32, 1, SZ(3)), false));
    tu_assert_error_contains("index_put_: unsupported operation: more than one element");
}

/* ---- new_empty / new_zeros ---- */

static void test_new_empty_zeros(void **state) {
    (void)state;
    ag_tensor *x = ag_ones(AG_F64, 1, SZ(2));
    ag_tensor *e = ag_new_empty(x, 2, SZ(2, 3));
    assert_int_equal(ag_tensor_dtype(e), AG_F64);
    tu_assert_values(e, 2, SZ(2, 3), VALS(0, 0, 0, 0, 0, 0), 0);
    assert_false(ag_tensor_same_storage(e, x));
    ag_tensor *z =
        call("new_zeros", (ag_arg[]){AG_A_T(x), AG_A_INTS(SZ(3), 1), AG_A_DT(AG_I64)}, 3);
    assert_int_equal(ag_tensor_dtype(z), AG_I64);
    tu_assert_values(z, 1, SZ(3), VALS(0, 0, 0), 0);
    ag_tensor *s = ag_new_empty(x, 0, NULL);
    assert_int_equal(ag_tensor_ndim(s), 0);
    /* no gradient flows through new_empty */
    ag_tensor *leaf = ag_tensor_keep(ag_ones(AG_F64, 1, SZ(2)));
    ag_tensor_set_requires_grad(leaf, true);
    assert_false(ag_tensor_requires_grad(ag_new_empty(leaf, 1, SZ(2))));
    ag_tensor_free(leaf);
    assert_null(ag_new_empty(x, 2, SZ(2, -1)));
    tu_assert_error_contains("new_empty: negative size -1 in dimension 1");
}

/* ---- backward ---- */

static void test_cat_backward(void **state) {
    (void)state;
    ag_tensor *a = tu_leaf(AG_F64, 2, SZ(2, 1), VALS(1, 2));
    ag_tensor *b = tu_leaf(AG_F64, 2, SZ(2, 2), VALS(3, 4, 5, 6));
    ag_tensor *c = tu_leaf(AG_F32, 2, SZ(2, 1), VALS(7, 8)); /* promoted to f64 */
    ag_tensor *y = ag_cat((ag_tensor *[]){a, b, c}, 3, -1);
    assert_non_null(strstr(ag_tensor_grad_fn_name(y), "cat"));
    ag_tensor *g = tu_tensor(AG_F64, 2, SZ(2, 4), VALS(1, 2, 3, 4, 5, 6, 7, 8));
    assert_int_equal(ag_backward(y, g, false), 0);
    tu_assert_values(ag_tensor_grad(a), 2, SZ(2, 1), VALS(1, 5), 0);
    tu_assert_values(ag_tensor_grad(b), 2, SZ(2, 2), VALS(2, 3, 6, 7), 0);
    tu_assert_values(ag_tensor_grad(c), 2, SZ(2, 1), VALS(4, 8), 0);
    assert_int_equal(ag_tensor_dtype(ag_tensor_grad(c)), AG_F32);

    /* cat keeps only its inputs' shapes: changing an input in place after the forward does not
     * invalidate the backward */
    ag_tensor *p = tu_leaf(AG_F64, 1, SZ(2), VALS(1, 2));
    ag_tensor *q = tu_tensor(AG_F64, 1, SZ(1), VALS(3));
    ag_tensor *pq = ag_cat((ag_tensor *[]){p, q}, 2, 0);
    assert_non_null(ag_index_put_(q, (ag_tensor *[]){idx1(1, VALS(0))}, 1,
                                  tu_tensor(AG_F64, 0, NULL, VALS(9)), false));
    assert_int_equal(ag_backward(pq, tu_tensor(AG_F64, 1, SZ(3), VALS(4, 5, 6)), false), 0);
    tu_assert_values(ag_tensor_grad(p), 1, SZ(2), VALS(4, 5), 0);
}

static void test_stack_backward(void **state) {
    (void)state;
    ag_tensor *a = tu_leaf(AG_F64, 1, SZ(2), VALS(1, 2));
    ag_tensor *b = tu_leaf(AG_F64, 1, SZ(2), VALS(3, 4));
    ag_tensor *y = ag_stack((ag_tensor *[]){a, b}, 2, 1); /* (2, 2): y[i][s] */
    ag_tensor *g = tu_tensor(AG_F64, 2, SZ(2, 2), VALS(1, 2, 3, 4));
    assert_int_equal(ag_backward(y, g, false), 0);
    tu_assert_values(ag_tensor_grad(a), 1, SZ(2), VALS(1, 3), 0);
    tu_assert_values(ag_tensor_grad(b), 1, SZ(2), VALS(2, 4), 0);
}

static void test_split_backward(void **state) {
    (void)state;
    ag_tensor *x = tu_leaf(AG_F64, 1, SZ(5), VALS(1, 2, 3, 4, 5));
    ag_tensor *o[3];
    assert_int_equal(ag_split(x, 2, 0, o, 3), 3);
    /* gradient into chunk 1 only: the other chunks get zeros */
    assert_int_equal(ag_backward(o[1], tu_tensor(AG_F64, 1, SZ(2), VALS(7, 8)), true), 0);
    tu_assert_values(ag_tensor_grad(x), 1, SZ(5), VALS(0, 0, 7, 8, 0), 0);
    /* chunks 0 and 2 (the short one) together through ag_grad */
    ag_tensor *gr[1] = {0};
    ag_tensor *gos[2] = {tu_tensor(AG_F64, 1, SZ(2), VALS(1, 2)),
                         tu_tensor(AG_F64, 1, SZ(1), VALS(3))};
    assert_int_equal(ag_grad((ag_tensor *[]){o[0], o[2]}, gos, 2, &x, 1, gr, false, false), 0);
    tu_assert_values(gr[0], 1, SZ(5), VALS(1, 2, 0, 0, 3), 0);
}

static void test_index_select_backward(void **state) {
    (void)state;
    ag_tensor *x = tu_leaf(AG_F64, 2, SZ(3, 2), VALS(1, 2, 3, 4, 5, 6));
    ag_tensor *y = ag_index_select(x, 0, idx1(3, VALS(1, -2, 0)));
    ag_tensor *g = tu_tensor(AG_F64, 2, SZ(3, 2), VALS(1, 2, 3, 4, 5, 6));
    assert_int_equal(ag_backward(y, g, false), 0);
    /* row 1 gets [1,2] + [3,4], row 0 gets [5,6] */
    tu_assert_values(ag_tensor_grad(x), 2, SZ(3, 2), VALS(5, 6, 4, 6, 0, 0), 0);
}

static void test_gather_backward(void **state) {
    (void)state;
    ag_tensor *x = tu_leaf(AG_F64, 2, SZ(2, 3), VALS(1, 2, 3, 4, 5, 6));
    ag_tensor *ix = tu_tensor(AG_I64, 2, SZ(2, 2), VALS(0, 0, 2, 1));
    ag_tensor *y = ag_gather(x, 1, ix);
    tu_assert_values(y, 2, SZ(2, 2), VALS(1, 1, 6, 5), 0);
    assert_int_equal(ag_backward(y, tu_tensor(AG_F64, 2, SZ(2, 2), VALS(1, 2, 3, 4)), false), 0);
    /* x[0][0] is gathered twice: 1 + 2; x[1][2] gets 3, x[1][1] gets 4 */
    tu_assert_values(ag_tensor_grad(x), 2, SZ(2, 3), VALS(3, 0, 0, 0, 4, 3), 0);
}

static void test_index_backward(void **state) {
    (void)state;
    ag_tensor *x = tu_leaf(AG_F64, 2, SZ(3, 2), VALS(1, 2, 3, 4, 5, 6));
    ag_tensor *y = ag_index(x, (ag_tensor *[]){idx1(3, VALS(2, 0, -1))}, 1);
    ag_tensor *g = tu_tensor(AG_F64, 2, SZ(3, 2), VALS(1, 2, 3, 4, 5, 6));
    assert_int_equal(ag_backward(y, g, false), 0);
    /* duplicates accumulate: row 2 = [1+5, 2+6], row 0 = [3, 4] */
    tu_assert_values(ag_tensor_grad(x), 2, SZ(3, 2), VALS(3, 4, 0, 0, 6, 8), 0);

    /* two index tensors after ':' on a 3-d input, and a bool mask */
    ag_tensor *x3 = tu_leaf(AG_F64, 3, SZ(2, 2, 2), VALS(0, 0, 0, 0, 0, 0, 0, 0));
    ag_tensor *y3 =
        ag_index(x3, (ag_tensor *[]){NULL, idx1(2, VALS(1, 1)), idx1(2, VALS(0, 1))}, 3);
    assert_int_equal(ag_backward(y3, tu_tensor(AG_F64, 2, SZ(2, 2), VALS(1, 2, 3, 4)), false), 0);
    /* grad[a][1][c] = g[a][c] */
    tu_assert_values(ag_tensor_grad(x3), 3, SZ(2, 2, 2), VALS(0, 0, 1, 2, 0, 0, 3, 4), 0);

    ag_tensor *xm = tu_leaf(AG_F64, 2, SZ(2, 2), VALS(1, 2, 3, 4));
    ag_tensor *m = tu_tensor(AG_BOOL, 2, SZ(2, 2), VALS(0, 1, 1, 0));
    ag_tensor *ym = ag_index(xm, (ag_tensor *[]){m}, 1);
    assert_int_equal(ag_backward(ym, tu_tensor(AG_F64, 1, SZ(2), VALS(5, 6)), false), 0);
    tu_assert_values(ag_tensor_grad(xm), 2, SZ(2, 2), VALS(0, 5, 6, 0), 0);
}

static void test_index_put_backward(void **state) {
    (void)state;
    ag_tensor *x = tu_leaf(AG_F64, 2, SZ(3, 2), VALS(1, 2, 3, 4, 5, 6));
    ag_tensor *v = tu_leaf(AG_F64, 1, SZ(2), VALS(10, 20)); /* broadcast to (2, 2) */
    ag_tensor *i = idx1(2, VALS(2, 0));
    ag_tensor *g = tu_tensor(AG_F64, 2, SZ(3, 2), VALS(1, 2, 3, 4, 5, 6));
    ag_tensor *y = ag_index_put(x, (ag_tensor *[]){i}, 1, v, false);
    tu_assert_values(y, 2, SZ(3, 2), VALS(10, 20, 3, 4, 10, 20), 0);
    assert_int_equal(ag_backward(y, g, false), 0);
    /* overwritten rows get no gradient; values get the sum of the rows they went to */
    tu_assert_values(ag_tensor_grad(x), 2, SZ(3, 2), VALS(0, 0, 3, 4, 0, 0), 0);
    tu_assert_values(ag_tensor_grad(v), 1, SZ(2), VALS(1 + 5, 2 + 6), 0);

    /* accumulate=True: self's gradient passes through unchanged */
    ag_tensor *x2 = tu_leaf(AG_F64, 2, SZ(3, 2), VALS(1, 2, 3, 4, 5, 6));
    ag_tensor *v2 = tu_leaf(AG_F64, 1, SZ(2), VALS(10, 20));
    ag_tensor *y2 = ag_index_put(x2, (ag_tensor *[]){i}, 1, v2, true);
    assert_int_equal(ag_backward(y2, g, false), 0);
    tu_assert_values(ag_tensor_grad(x2), 2, SZ(3, 2), VALS(1, 2, 3, 4, 5, 6), 0);
    tu_assert_values(ag_tensor_grad(v2), 1, SZ(2), VALS(6, 8), 0);

    /* in place on a plain tensor (new_empty + index_put_ as in an unpermute) */
    ag_tensor *v3 = tu_leaf(AG_F64, 2, SZ(2, 2), VALS(1, 2, 3, 4));
    ag_tensor *out = ag_new_empty(v3, 2, SZ(3, 2));
    ag_tensor *r = ag_index_put_(out, (ag_tensor *[]){idx1(2, VALS(2, 0))}, 1, v3, false);
    assert_non_null(strstr(ag_tensor_grad_fn_name(r), "index_put"));
    tu_assert_values(r, 2, SZ(3, 2), VALS(3, 4, 0, 0, 1, 2), 0);
    assert_int_equal(ag_backward(r, g, false), 0);
    tu_assert_values(ag_tensor_grad(v3), 2, SZ(2, 2), VALS(5, 6, 1, 2), 0);
}

static void test_scatter_index_add_backward(void **state) {
    (void)state;
    ag_tensor *x = tu_leaf(AG_F64, 1, SZ(3), VALS(0, 0, 0));
    ag_tensor *src = tu_leaf(AG_F64, 1, SZ(4), VALS(1, 2, 3, 4));
    /* index covers only src[0..1]: src[2..3] get zero gradient */
    ag_tensor *y =
        call("scatter_add",
             (ag_arg[]){AG_A_T(x), AG_A_I(0), AG_A_T(idx1(2, VALS(2, 0))), AG_A_T(src)}, 4);
    tu_assert_values(y, 1, SZ(3), VALS(2, 0, 1), 0);
    assert_int_equal(ag_backward(y, tu_tensor(AG_F64, 1, SZ(3), VALS(5, 6, 7)), false), 0);
    tu_assert_values(ag_tensor_grad(x), 1, SZ(3), VALS(5, 6, 7), 0);
    tu_assert_values(ag_tensor_grad(src), 1, SZ(4), VALS(7, 5, 0, 0), 0);

    ag_tensor *s2 = tu_leaf(AG_F64, 1, SZ(2), VALS(1, 2));
    ag_tensor *z = call("index_add",
                        (ag_arg[]){AG_A_T(ag_zeros(AG_F64, 1, SZ(3))), AG_A_I(0),
                                   AG_A_T(idx1(2, VALS(1, 1))), AG_A_T(s2), AG_A_F(3.0)},
                        5);
    tu_assert_values(z, 1, SZ(3), VALS(0, 9, 0), 0);
    assert_int_equal(ag_backward(z, tu_tensor(AG_F64, 1, SZ(3), VALS(5, 6, 7)), false), 0);
    tu_assert_values(ag_tensor_grad(s2), 1, SZ(2), VALS(18, 18), 0);
}

/* ---- large inputs (the OpenMP paths) against plain reference loops ---- */

static uint64_t rng_state = 88172645463325252ull;
static uint64_t next_rand(void) {
    return tu_xorshift_next(&rng_state);
}

static ag_tensor *rand_f64(int ndim, const int64_t *sizes) {
    ag_tensor *t = ag_empty(AG_F64, ndim, sizes);
    double *d = ag_tensor_data(t);
    for (int64_t i = 0; i < ag_tensor_numel(t); i++)
        d[i] = (double)(next_rand() % 1000) / 100.0;
    return t;
}

static ag_tensor *rand_index(int ndim, const int64_t *sizes, int64_t hi) {
    ag_tensor *t = ag_empty(AG_I64, ndim, sizes);
    int64_t *d = ag_tensor_data(t);
    for (int64_t i = 0; i < ag_tensor_numel(t); i++)
        d[i] = (int64_t)(next_rand() % (uint64_t)hi);
    return t;
}

static void test_large_against_reference(void **state) {
    (void)state;
    const int64_t R = 300, C = 200;
    ag_tensor *x = rand_f64(2, SZ(R, C));
    const double *xd = ag_tensor_data(x);

    /* index_select rows: out[i][j] = x[ix[i]][j] */
    ag_tensor *ix = rand_index(1, SZ(250), R);
    const int64_t *id = ag_tensor_data(ix);
    ag_tensor *sel = ag_index_select(x, 0, ix);
    assert_non_null(sel);
    const double *sd = ag_tensor_data(sel);
    for (int64_t i = 0; i < 250; i++)
        for (int64_t j = 0; j < C; j++)
            assert_true(sd[i * C + j] == xd[id[i] * C + j]);

    /* gather dim 1 on the transpose (C, R): out[i][j] = x^T[i][g[i][j]] = x[g[i][j]][i] */
    ag_tensor *g = rand_index(2, SZ(C, R), R);
    const int64_t *gd = ag_tensor_data(g);
    ag_tensor *ga = ag_gather(ag_t(x), 1, g);
    assert_non_null(ga);
    const double *gad = ag_tensor_data(ga);
    for (int64_t i = 0; i < C; i++)
        for (int64_t j = 0; j < R; j++)
            assert_true(gad[i * R + j] == xd[gd[i * R + j] * C + i]);

    /* scatter_add dim 0 into zeros (R, C) from src (R, C) with index (R, C) in [0, 7) */
    ag_tensor *si = rand_index(2, SZ(R, C), 7);
    const int64_t *sid = ag_tensor_data(si);
    ag_tensor *sc = call(
        "scatter_add",
        (ag_arg[]){AG_A_T(ag_zeros(AG_F64, 2, SZ(R, C))), AG_A_I(0), AG_A_T(si), AG_A_T(x)}, 4);
    assert_non_null(sc);
    double *ref = calloc((size_t)(R * C), sizeof *ref);
    for (int64_t i = 0; i < R; i++)
        for (int64_t j = 0; j < C; j++)
            ref[sid[i * C + j] * C + j] += xd[i * C + j];
    const double *scd = ag_tensor_data(sc);
    for (int64_t k = 0; k < R * C; k++)
        assert_true(fabs(scd[k] - ref[k]) < 1e-9);

    /* index_put accumulate=True with many duplicate rows: ref[ix[i]] += x[i] */
    ag_tensor *pi = rand_index(1, SZ(R), 11);
    const int64_t *pid = ag_tensor_data(pi);
    ag_tensor *pa = ag_index_put(ag_zeros(AG_F64, 2, SZ(11, C)), (ag_tensor *[]){pi}, 1, x, true);
    assert_non_null(pa);
    memset(ref, 0, sizeof(double) * (size_t)(R * C));
    for (int64_t i = 0; i < R; i++)
        for (int64_t j = 0; j < C; j++)
            ref[pid[i] * C + j] += xd[i * C + j];
    const double *pad = ag_tensor_data(pa);
    for (int64_t k = 0; k < 11 * C; k++)
        assert_true(fabs(pad[k] - ref[k]) < 1e-9);

    /* accumulate=False: the last i with pi[i] == r wins */
    ag_tensor *pw = ag_index_put(ag_zeros(AG_F64, 2, SZ(11, C)), (ag_tensor *[]){pi}, 1, x, false);
    const double *pwd = ag_tensor_data(pw);
    for (int64_t r = 0; r < 11; r++) {
        int64_t last = -1;
        for (int64_t i = 0; i < R; i++)
            if (pid[i] == r)
                last = i;
        for (int64_t j = 0; j < C; j++)
            assert_true(pwd[r * C + j] == (last < 0 ? 0 : xd[last * C + j]));
    }

    /* index with two index tensors broadcast to (250, 200): out[a][b] = x[ix[a]][jx[b]] */
    ag_tensor *jx = rand_index(1, SZ(C), C);
    const int64_t *jd = ag_tensor_data(jx);
    ag_tensor *ix2 = ag_view(ix, 2, SZ(250, 1));
    ag_tensor *ad = ag_index(x, (ag_tensor *[]){ix2, jx}, 2);
    assert_non_null(ad);
    const double *add = ag_tensor_data(ad);
    for (int64_t a = 0; a < 250; a++)
        for (int64_t b = 0; b < C; b++)
            assert_true(add[a * C + b] == xd[id[a] * C + jd[b]]);

    /* index_add dim 1 into ones (R, C) from src (R, 250) at columns in [0, 13) */
    ag_tensor *src = rand_f64(2, SZ(R, 250));
    const double *srd = ag_tensor_data(src);
    ag_tensor *ci = rand_index(1, SZ(250), 13);
    const int64_t *cid = ag_tensor_data(ci);
    ag_tensor *ia = call("index_add",
                         (ag_arg[]){AG_A_T(ag_ones(AG_F64, 2, SZ(R, C))), AG_A_I(1), AG_A_T(ci),
                                    AG_A_T(src), AG_A_F(0.5)},
                         5);
    assert_non_null(ia);
    for (int64_t k = 0; k < R * C; k++)
        ref[k] = 1;
    for (int64_t i = 0; i < R; i++)
        for (int64_t j = 0; j < 250; j++)
            ref[i * C + cid[j]] += 0.5 * srd[i * 250 + j];
    const double *iad = ag_tensor_data(ia);
    for (int64_t k = 0; k < R * C; k++)
        assert_true(fabs(iad[k] - ref[k]) < 1e-9);
    free(ref);

    /* cat and split of large, non-contiguous pieces round-trip */
    ag_tensor *xt = ag_t(x); /* (C, R) */
    ag_tensor *parts[4];
    assert_int_equal(ag_split(xt, 64, 0, parts, 4), 4);
    ag_tensor *back = ag_cat(parts, 4, 0);
    assert_true(tu_max_abs_diff(back, xt) == 0);
}

/* ---- meta (data-less) inputs: shapes only, no kernel ---- */

static void test_meta_inputs(void **state) {
    (void)state;
    ag_tensor *xm = ag__tensor_new(AG_F32, 2, SZ(6, 4), true);
    ag_tensor *ym = ag__tensor_new(AG_F64, 2, SZ(6, 1), true);
    ag_tensor *im = ag__tensor_new(AG_I64, 2, SZ(6, 3), true);
    ag_tensor *c = ag_cat((ag_tensor *[]){xm, ym}, 2, 1);
    assert_int_equal(ag_tensor_sizes(c)[1], 5);
    assert_int_equal(ag_tensor_dtype(c), AG_F64);
    assert_null(ag_tensor_data(c));
    ag_tensor *o[4];
    assert_int_equal(ag_split(xm, 4, 0, o, 4), 2);
    assert_int_equal(ag_tensor_sizes(o[1])[0], 2);
    assert_null(ag_tensor_data(o[1]));
    ag_tensor *g = ag_gather(xm, 1, im);
    assert_int_equal(ag_tensor_sizes(g)[1], 3);
    ag_tensor *vm = ag__tensor_new(AG_F32, 1, SZ(1), true);
    ag_tensor *p = ag_index_put(xm, (ag_tensor *[]){NULL, idx1(1, VALS(99))}, 2, vm, false);
    assert_non_null(p); /* out of range, but unchecked: no kernel runs on meta tensors */
    assert_int_equal(ag_tensor_sizes(p)[0], 6);
    ag_tensor_free(xm);
    ag_tensor_free(ym);
    ag_tensor_free(im);
    ag_tensor_free(vm);
}

/* ---- allocation failures: every op fails cleanly (ENOMEM, nothing leaked) ---- */

typedef ag_tensor *(*oom_case_fn)(ag_tensor *x, ag_tensor *i, ag_tensor *m);

static ag_tensor *oom_cat(ag_tensor *x, ag_tensor *i, ag_tensor *m) {
    return ag_cat((ag_tensor *[]){x, ag_t(x), x}, 3, 1);
}
static ag_tensor *oom_stack(ag_tensor *x, ag_tensor *i, ag_tensor *m) {
    return ag_stack((ag_tensor *[]){x, ag_t(x)}, 2, 0);
}
static ag_tensor *oom_split(ag_tensor *x, ag_tensor *i, ag_tensor *m) {
    ag_tensor *o[4];
    return ag_split(ag_t(x), 2, 1, o, 4) < 0 ? NULL : o[1];
}
static ag_tensor *oom_index_select(ag_tensor *x, ag_tensor *i, ag_tensor *m) {
    return ag_index_select(ag_t(x), 1, i);
}
static ag_tensor *oom_gather(ag_tensor *x, ag_tensor *i, ag_tensor *m) {
    return ag_gather(ag_t(x), 0, ag_view(i, 2, SZ(1, 3)));
}
static ag_tensor *oom_index(ag_tensor *x, ag_tensor *i, ag_tensor *m) {
    return ag_index(ag_t(x), (ag_tensor *[]){NULL, i}, 2);
}
static ag_tensor *oom_index_mask(ag_tensor *x, ag_tensor *i, ag_tensor *m) {
    return ag_index(x, (ag_tensor *[]){m}, 1);
}
static ag_tensor *oom_index_put(ag_tensor *x, ag_tensor *i, ag_tensor *m) {
    return ag_index_put(ag_t(x), (ag_tensor *[]){i}, 1, ag_t(x), true);
}
static ag_tensor *oom_scatter_add(ag_tensor *x, ag_tensor *i, ag_tensor *m) {
    ag_tensor *ix = ag_view(i, 2, SZ(1, 3));
    return call("scatter_add", (ag_arg[]){AG_A_T(x), AG_A_I(0), AG_A_T(ix), AG_A_T(ag_t(x))}, 4);
}
static ag_tensor *oom_index_add(ag_tensor *x, ag_tensor *i, ag_tensor *m) {
    return call("index_add", (ag_arg[]){AG_A_T(x), AG_A_I(0), AG_A_T(i), AG_A_T(ag_t(x))}, 4);
}
static ag_tensor *oom_backward(ag_tensor *x, ag_tensor *i, ag_tensor *m) {
    ag_tensor *y = ag_index(x, (ag_tensor *[]){i}, 1);
    ag_tensor *z = ag_gather(y, 1, ag_view(i, 2, SZ(3, 1)));
    ag_tensor *g[1] = {NULL}, *seed = ag_ones(AG_F64, 2, SZ(3, 1));
    if (!z || !seed || ag_grad(&z, &seed, 1, &x, 1, g, false, false))
        return NULL;
    return g[0];
}

typedef struct oom_case {
    oom_case_fn fn;
    ag_tensor *x, *i, *m;
} oom_case;

/* One case in a scope of its own; a NULL result must come with an error status. */
static int oom_run(void *ud) {
    const oom_case *c = ud;
    ag_scope_begin();
    int rc = c->fn(c->x, c->i, c->m) ? 0 : ag_last_status() ? ag_last_status() : -99;
    ag_scope_end();
    return rc;
}

static void test_allocation_failures(void **state) {
    (void)state;
    static const oom_case_fn cases[] = {
        oom_cat,        oom_stack,     oom_split,       oom_index_select, oom_gather,  oom_index,
        oom_index_mask, oom_index_put, oom_scatter_add, oom_index_add,    oom_backward};
    ag_scope_end(); /* the cases run in scopes of their own */
    /* made outside any scope: owned here */
    ag_tensor *x = tu_tensor(AG_F64, 2, SZ(3, 3), VALS(1, 2, 3, 4, 5, 6, 7, 8, 9));
    ag_tensor *i = idx1(3, VALS(2, 0, 2));
    ag_tensor *m = tu_tensor(AG_BOOL, 2, SZ(3, 3), VALS(1, 0, 1, 0, 1, 0, 0, 0, 1));
    ag_tensor_set_requires_grad(x, true);
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        char what[32];
        snprintf(what, sizeof what, "case %zu", c);
        oom_case oc = {cases[c], x, i, m};
        tu_sweep_opts o = {.what = what, .max_points = 10000};
        assert_true(tu_alloc_failure_sweep(oom_run, &oc, &o) > 0);
    }
    ag_tensor_free(x);
    ag_tensor_free(i);
    ag_tensor_free(m);
    ag_scope_begin(); /* for teardown */
}

/* ---- finite differences over every sample the family declares ---- */

static void test_gradcheck_samples(void **state) {
    (void)state;
    static const char *const names[] = {"cat",       "stack",     "split.Tensor", "index_select",
                                        "index_add", "gather",    "scatter_add",  "index.Tensor",
                                        "index_put", "index_put_"};
    tu_gradcheck_ops(names, sizeof names / sizeof names[0]);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_cat_three_inputs_promotion, setup, teardown),
        cmocka_unit_test_setup_teardown(test_cat_legacy_empty_and_errors, setup, teardown),
        cmocka_unit_test_setup_teardown(test_stack, setup, teardown),
        cmocka_unit_test_setup_teardown(test_split_uneven, setup, teardown),
        cmocka_unit_test_setup_teardown(test_split_errors, setup, teardown),
        cmocka_unit_test_setup_teardown(test_index_select, setup, teardown),
        cmocka_unit_test_setup_teardown(test_index_add, setup, teardown),
        cmocka_unit_test_setup_teardown(test_gather, setup, teardown),
        cmocka_unit_test_setup_teardown(test_scatter_add, setup, teardown),
        cmocka_unit_test_setup_teardown(test_index_one_tensor, setup, teardown),
        cmocka_unit_test_setup_teardown(test_index_two_tensors, setup, teardown),
        cmocka_unit_test_setup_teardown(test_index_bool_mask, setup, teardown),
        cmocka_unit_test_setup_teardown(test_index_negative_and_out_of_range, setup, teardown),
        cmocka_unit_test_setup_teardown(test_index_put, setup, teardown),
        cmocka_unit_test_setup_teardown(test_index_put_inplace, setup, teardown),
        cmocka_unit_test_setup_teardown(test_new_empty_zeros, setup, teardown),
        cmocka_unit_test_setup_teardown(test_cat_backward, setup, teardown),
        cmocka_unit_test_setup_teardown(test_stack_backward, setup, teardown),
        cmocka_unit_test_setup_teardown(test_split_backward, setup, teardown),
        cmocka_unit_test_setup_teardown(test_index_select_backward, setup, teardown),
        cmocka_unit_test_setup_teardown(test_gather_backward, setup, teardown),
        cmocka_unit_test_setup_teardown(test_index_backward, setup, teardown),
        cmocka_unit_test_setup_teardown(test_index_put_backward, setup, teardown),
        cmocka_unit_test_setup_teardown(test_scatter_index_add_backward, setup, teardown),
        cmocka_unit_test_setup_teardown(test_large_against_reference, setup, teardown),
        cmocka_unit_test_setup_teardown(test_meta_inputs, setup, teardown),
        cmocka_unit_test_setup_teardown(test_allocation_failures, setup, teardown),
        cmocka_unit_test_setup_teardown(test_gradcheck_samples, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
