/* Reductions and softmax (reduce.c): sum, mean, amax, var, logsumexp, argmax, _softmax,
 * _log_softmax and the softmax backward helpers. Values are checked against hand-computed
 * numbers or against float64 references computed here with plain loops; also dtypes of integer
 * sums, non-contiguous and expanded inputs, every loop shape of the kernels (runs, columns,
 * chunked single outputs), thread-count independence, numerical stability, error messages, and
 * direct backward checks of the trickier rules (amax ties, softmax, var, logsumexp). */
#include "testutil.h"
#include "core/internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define S(...) ((int64_t[]){__VA_ARGS__})
#define V(...) ((double[]){__VA_ARGS__})

/* ---- float64 references ---- */

/* Values of t as doubles (caller frees). */
static double *vals_of(const ag_tensor *t) {
    int64_t n = ag_tensor_numel(t);
    double *v = malloc(sizeof(double) * (size_t)(n ? n : 1));
    assert_non_null(v);
    assert_int_equal(ag_tensor_to_doubles(t, v), 0);
    return v;
}

enum { REF_SUM, REF_MEAN, REF_MAX, REF_VAR0, REF_VAR1, REF_LSE };

/* Reference reduction of t over the dims with reduce[d] set, in double; returns the outputs
 * in row-major order of the kept dims (caller frees). */
static double *ref_reduce(const ag_tensor *t, const bool *reduce, int kind, int64_t *nout_p) {
    int nd = ag_tensor_ndim(t);
    const int64_t *sz = ag_tensor_sizes(t);
    int64_t n = ag_tensor_numel(t), nout = 1, cnt = 1;
    for (int d = 0; d < nd; d++) {
        if (reduce[d])
            cnt *= sz[d];
        else
            nout *= sz[d];
    }
    double *x = vals_of(t);
    double *acc = calloc((size_t)nout, sizeof(double));
    double *acc2 = calloc((size_t)nout, sizeof(double));
    int64_t *oi = malloc(sizeof(int64_t) * (size_t)(n ? n : 1));
    for (int64_t i = 0; i < n; i++) {
        /* Output index of element i: row-major over kept dims. */
        int64_t r = i, o = 0, mul = 1;
        for (int d = nd - 1; d >= 0; d--) {
            int64_t id = r % sz[d];
            r /= sz[d];
            if (!reduce[d]) {
                o += id * mul;
                mul *= sz[d];
            }
        }
        oi[i] = o;
    }
    for (int64_t o = 0; o < nout; o++)
        acc[o] = kind == REF_MAX || kind == REF_LSE ? -INFINITY : 0;
    for (int64_t i = 0; i < n; i++) {
        if (kind == REF_MAX || kind == REF_LSE)
            acc[oi[i]] = fmax(acc[oi[i]], x[i]);
        else
            acc[oi[i]] += x[i];
    }
    for (int64_t i = 0; i < n; i++) {
        int64_t o = oi[i];
        if (kind == REF_VAR0 || kind == REF_VAR1) {
            double d = x[i] - acc[o] / (double)cnt;
            acc2[o] += d * d;
        } else if (kind == REF_LSE) {
            acc2[o] += exp(x[i] - acc[o]);
        }
    }
    for (int64_t o = 0; o < nout; o++) {
        if (kind == REF_MEAN)
            acc[o] /= (double)cnt;
        else if (kind == REF_VAR0)
            acc[o] = acc2[o] / (double)cnt;
        else if (kind == REF_VAR1)
            acc[o] = acc2[o] / (double)(cnt - 1);
        else if (kind == REF_LSE)
            acc[o] = acc[o] + log(acc2[o]);
    }
    free(x);
    free(acc2);
    free(oi);
    *nout_p = nout;
    return acc;
}

/* Asserts t (any dtype) equals ref[0..n) within tol*(1+|ref|). */
static void assert_close(const ag_tensor *t, const double *ref, int64_t n, double tol) {
    assert_non_null(t);
    assert_int_equal(ag_tensor_numel(t), n);
    tu_assert_close(t, ref, tol);
}

/* A tensor of n values from a fixed LCG in [lo, hi). */
static ag_tensor *randt(ag_dtype dt, int nd, const int64_t *sizes, double lo, double hi,
                        uint64_t seed) {
    uint64_t s = seed * 6364136223846793005ull + 1442695040888963407ull;
    return tu_rand_tensor(dt, nd, sizes, lo, hi, tu_lcg, &s);
}

static void mask_of(int nd, const int64_t *dims, int n, bool *reduce) {
    for (int d = 0; d < nd; d++)
        reduce[d] = n == 0;
    for (int i = 0; i < n; i++)
        reduce[dims[i] < 0 ? dims[i] + nd : dims[i]] = true;
}

/* ---- sum ---- */

static void test_sum_values(void **st) {
    (void)st;
    ag_scope_begin();
    for (int k = 0; k < 2; k++) {
        ag_dtype dt = k ? AG_F64 : AG_F32;
        ag_tensor *x = tu_tensor(dt, 2, S(2, 3), V(1, 2, 3, 4, 5, 6));
        ag_tensor *s0 = ag_sum(x, S(0), 1, false);
        assert_int_equal(ag_tensor_dtype(s0), dt);
        tu_assert_values(s0, 1, S(3), V(5, 7, 9), 0);
        tu_assert_values(ag_sum(x, S(1), 1, false), 1, S(2), V(6, 15), 0);
        tu_assert_values(ag_sum(x, S(-1), 1, true), 2, S(2, 1), V(6, 15), 0);
        tu_assert_values(ag_sum(x, S(0), 1, true), 2, S(1, 3), V(5, 7, 9), 0);
        tu_assert_values(ag_sum_all(x), 0, NULL, V(21), 0);
        tu_assert_values(ag_sum(x, S(1, 0), 2, false), 0, NULL, V(21), 0);
        tu_assert_values(ag_sum(x, NULL, 0, true), 2, S(1, 1), V(21), 0);
        /* 3-d, two non-adjacent dims: x[i][j][k] = 12i + 4j + k. */
        ag_tensor *y = ag_arange(dt, 0, 24, 1);
        y = ag_view(y, 3, S(2, 3, 4));
        /* sum over i and k: for j: sum_i sum_k (12i + 4j + k) = 8*(4j) + 4*12 + 2*6 */
        tu_assert_values(ag_sum(y, S(0, 2), 2, false), 1, S(3), V(60, 92, 124), 0);
        tu_assert_values(ag_sum(y, S(2, -3), 2, true), 3, S(1, 3, 1), V(60, 92, 124), 0);
        /* sum over j: 3*(12i + k) + 12 */
        tu_assert_values(ag_sum(y, S(1), 1, false), 2, S(2, 4), V(12, 15, 18, 21, 48, 51, 54, 57),
                         0);
    }
    /* A 0-d tensor reduces over dim 0 / -1 to itself. */
    ag_tensor *z = ag_scalar_tensor(AG_F32, 2.5);
    tu_assert_values(ag_sum(z, S(-1), 1, false), 0, NULL, V(2.5), 0);
    tu_assert_values(ag_sum(z, S(0), 1, true), 0, NULL, V(2.5), 0);
    /* Empty reductions give 0; empty outputs are empty. */
    ag_tensor *e = ag_zeros(AG_F32, 2, S(0, 3));
    tu_assert_values(ag_sum(e, S(0), 1, false), 1, S(3), V(0, 0, 0), 0);
    ag_tensor *e1 = ag_sum(e, S(1), 1, false);
    assert_non_null(e1);
    assert_int_equal(ag_tensor_numel(e1), 0);
    ag_scope_end();
}

static void test_sum_integer_dtypes(void **st) {
    (void)st;
    ag_scope_begin();
    /* i64 sums are exact (beyond 2^53) and stay i64. */
    ag_tensor *x = ag_empty(AG_I64, 1, S(3));
    int64_t *px = ag_tensor_data(x);
    px[0] = (1ll << 62);
    px[1] = 1;
    px[2] = 2;
    ag_tensor *s = ag_sum_all(x);
    assert_int_equal(ag_tensor_dtype(s), AG_I64);
    assert_true(*(int64_t *)ag_tensor_data(s) == (1ll << 62) + 3);
    /* bool sums count the true values as i64. */
    ag_tensor *b = tu_tensor(AG_BOOL, 2, S(2, 3), V(1, 0, 1, 1, 1, 0));
    ag_tensor *sb = ag_sum(b, S(1), 1, false);
    assert_int_equal(ag_tensor_dtype(sb), AG_I64);
    tu_assert_values(sb, 1, S(2), V(2, 2), 0);
    tu_assert_values(ag_sum(b, S(0), 1, false), 1, S(3), V(2, 1, 1), 0);
    /* dtype= converts first: i64 -> f64, f32 -> f64. */
    const ag_op *op = ag_op_find("sum.dim_IntList");
    assert_non_null(op);
    ag_tensor *i = tu_tensor(AG_I64, 1, S(4), V(1, 2, 3, 4));
    ag_tensor *sf =
        ag_op_call1(op, (ag_arg[]){AG_A_T(i), AG_A_NONE, AG_A_B(false), AG_A_DT(AG_F64)}, 4);
    assert_int_equal(ag_tensor_dtype(sf), AG_F64);
    tu_assert_values(sf, 0, NULL, V(10), 0);
    ag_tensor *f = tu_tensor(AG_F32, 1, S(2), V(0.1, 0.2));
    ag_tensor *sd =
        ag_op_call1(op, (ag_arg[]){AG_A_T(f), AG_A_NONE, AG_A_B(false), AG_A_DT(AG_F64)}, 4);
    assert_int_equal(ag_tensor_dtype(sd), AG_F64);
    assert_true(ag_tensor_item(sd) == (double)0.1f + (double)0.2f);
    /* amax of ints and bools is exact and keeps the dtype. */
    ag_tensor *am = ag_amax(x, NULL, 0, false);
    assert_int_equal(ag_tensor_dtype(am), AG_I64);
    assert_true(*(int64_t *)ag_tensor_data(am) == (1ll << 62));
    ag_tensor *bm = ag_amax(b, S(1), 1, false);
    assert_int_equal(ag_tensor_dtype(bm), AG_BOOL);
    tu_assert_values(bm, 1, S(2), V(1, 1), 0);
    ag_scope_end();
}

/* Non-contiguous inputs: transposed, sliced with a step, expanded (stride 0). */
static void test_sum_strided_inputs(void **st) {
    (void)st;
    ag_scope_begin();
    ag_tensor *x = ag_arange(AG_F64, 0, 12, 1);
    x = ag_view(x, 2, S(3, 4));
    ag_tensor *t = ag_transpose(x, 0, 1); /* (4, 3), strides (1, 4) */
    assert_false(ag_tensor_is_contiguous(t));
    /* t[i][j] = 4j + i */
    tu_assert_values(ag_sum(t, S(0), 1, false), 1, S(3), V(6, 22, 38), 0);
    tu_assert_values(ag_sum(t, S(1), 1, false), 1, S(4), V(12, 15, 18, 21), 0);
    tu_assert_values(ag_sum_all(t), 0, NULL, V(66), 0);
    tu_assert_values(ag_mean(t, S(1), 1, true), 2, S(4, 1), V(4, 5, 6, 7), 1e-15);
    tu_assert_values(ag_amax(t, S(0), 1, false), 1, S(3), V(3, 7, 11), 0);
    ag_tensor *sl = ag_slice(x, 1, 0, 4, 2); /* columns 0 and 2 */
    tu_assert_values(ag_sum(sl, S(0), 1, false), 1, S(2), V(12, 18), 0);
    tu_assert_values(ag_sum(sl, S(1), 1, false), 1, S(3), V(2, 10, 18), 0);
    ag_tensor *row = tu_tensor(AG_F32, 2, S(1, 3), V(1, 2, 3));
    ag_tensor *ex = ag_expand(row, 2, S(5, 3));
    tu_assert_values(ag_sum(ex, S(0), 1, false), 1, S(3), V(5, 10, 15), 0);
    tu_assert_values(ag_sum_all(ex), 0, NULL, V(30), 0);
    tu_assert_values(ag_var(ex, S(0), 1, 1, false), 1, S(3), V(0, 0, 0), 0);
    ag_scope_end();
}

/* Large reductions through every loop shape, against float64 references: the last dim
 * (runs), leading dims of a matrix (columns, with several row chunks), a full reduction of a
 * long vector (chunked single output), a middle dim, and a permuted 3-d view. */
static void test_sum_large_shapes(void **st) {
    (void)st;
    ag_scope_begin();
    struct {
        int nd;
        int64_t sizes[3];
        int ndims;
        int64_t dims[2];
    } cases[] = {
        {2, {300, 257}, 1, {1}},    {2, {3000, 300}, 1, {0}},     {1, {1000003}, 0, {0}},
        {3, {20, 300, 40}, 1, {1}}, {3, {20, 30, 40}, 2, {0, 2}}, {2, {5, 70001}, 1, {1}},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        for (int k = 0; k < 2; k++) {
            ag_dtype dt = k ? AG_F64 : AG_F32;
            ag_tensor *x = randt(dt, cases[c].nd, cases[c].sizes, -1, 1, 7 + c);
            bool red[3];
            mask_of(cases[c].nd, cases[c].dims, cases[c].ndims, red);
            int64_t n;
            double *ref = ref_reduce(x, red, REF_SUM, &n);
            /* double accumulation: f32 results are the f32 rounding of the exact sum */
            assert_close(ag_sum(x, cases[c].dims, cases[c].ndims, false), ref, n,
                         dt == AG_F32 ? 1e-6 : 1e-12);
            free(ref);
            ref = ref_reduce(x, red, REF_MEAN, &n);
            assert_close(ag_mean(x, cases[c].dims, cases[c].ndims, false), ref, n,
                         dt == AG_F32 ? 1e-6 : 1e-12);
            free(ref);
            ref = ref_reduce(x, red, REF_MAX, &n);
            assert_close(ag_amax(x, cases[c].dims, cases[c].ndims, false), ref, n, 0);
            free(ref);
            ref = ref_reduce(x, red, REF_VAR1, &n);
            ag_tensor *v = ag_var(x, cases[c].dims, cases[c].ndims, 1, false);
            assert_close(v, ref, n, dt == AG_F32 ? 1e-5 : 1e-10);
            free(ref);
            ref = ref_reduce(x, red, REF_LSE, &n);
            assert_close(ag_logsumexp(x, cases[c].dims, cases[c].ndims, false), ref, n,
                         dt == AG_F32 ? 1e-6 : 1e-12);
            free(ref);
        }
    }
    /* A permuted view (strides not decreasing) reduced over two dims. */
    ag_tensor *x = randt(AG_F32, 3, S(30, 40, 50), -1, 1, 99);
    ag_tensor *p = ag_permute(x, 3, S(2, 0, 1)); /* (50, 30, 40) */
    bool red[3] = {true, false, true};
    int64_t n;
    double *ref = ref_reduce(p, red, REF_SUM, &n);
    assert_close(ag_sum(p, S(0, 2), 2, false), ref, n, 1e-6);
    free(ref);
    red[0] = false;
    red[1] = true;
    red[2] = false;
    ref = ref_reduce(p, red, REF_VAR1, &n);
    assert_close(ag_var(p, S(1), 1, 1, false), ref, n, 1e-5);
    free(ref);
    ag_scope_end();
}

/* Results are bitwise identical for any thread count (fixed chunking). */
static void test_thread_count_independence(void **st) {
    (void)st;
    ag_scope_begin();
    ag_tensor *a = randt(AG_F32, 1, S(3000001), -1, 1, 3);
    ag_tensor *b = randt(AG_F32, 2, S(20000, 64), -1, 1, 4);
    int prev = ag_get_num_threads();
    ag_tensor *r1[4], *r4[4];
    for (int pass = 0; pass < 2; pass++) {
        ag_set_num_threads(pass ? 4 : 1);
        ag_tensor **r = pass ? r4 : r1;
        r[0] = ag_sum_all(a);
        r[1] = ag_sum(b, S(0), 1, false);
        r[2] = ag_var(a, NULL, 0, 1, false);
        r[3] = ag_logsumexp(b, S(0), 1, false);
    }
    ag_set_num_threads(prev);
    for (int i = 0; i < 4; i++) {
        assert_non_null(r1[i]);
        assert_int_equal(ag_tensor_numel(r1[i]), ag_tensor_numel(r4[i]));
        assert_memory_equal(ag_tensor_data(r1[i]), ag_tensor_data(r4[i]),
                            (size_t)ag_tensor_numel(r1[i]) * sizeof(float));
    }
    ag_scope_end();
}

/* ---- mean, var, amax, logsumexp ---- */

static void test_mean_values(void **st) {
    (void)st;
    ag_scope_begin();
    ag_tensor *x = tu_tensor(AG_F32, 2, S(2, 3), V(1, 2, 3, 4, 5, 9));
    tu_assert_values(ag_mean(x, S(0), 1, false), 1, S(3), V(2.5, 3.5, 6), 1e-7);
    tu_assert_values(ag_mean(x, S(1), 1, true), 2, S(2, 1), V(2, 6), 1e-7);
    tu_assert_values(ag_mean_all(x), 0, NULL, V(4), 1e-7);
    /* mean of an empty reduction is NaN */
    ag_tensor *e = ag_mean(ag_zeros(AG_F64, 2, S(0, 2)), S(0), 1, false);
    assert_non_null(e);
    assert_true(isnan(ag_tensor_item_at(e, 0)));
    /* integer input: an error, unless dtype= asks for a float result */
    ag_tensor *i = tu_tensor(AG_I64, 1, S(4), V(1, 2, 3, 5));
    assert_null(ag_mean_all(i));
    tu_assert_error_contains("mean: could not infer output dtype");
    ag_clear_error();
    ag_tensor *m = ag_op_call1(ag_op_find("mean.dim"),
                               (ag_arg[]){AG_A_T(i), AG_A_NONE, AG_A_B(false), AG_A_DT(AG_F32)}, 4);
    assert_int_equal(ag_tensor_dtype(m), AG_F32);
    tu_assert_values(m, 0, NULL, V(2.75), 0);
    ag_scope_end();
}

static void test_var_values(void **st) {
    (void)st;
    ag_scope_begin();
    for (int k = 0; k < 2; k++) {
        ag_dtype dt = k ? AG_F64 : AG_F32;
        ag_tensor *x = tu_tensor(dt, 1, S(4), V(1, 2, 3, 4));
        /* mean 2.5, squared deviations sum to 5 */
        tu_assert_values(ag_var(x, NULL, 0, 0, false), 0, NULL, V(1.25), 1e-7);
        tu_assert_values(ag_var(x, NULL, 0, 1, false), 0, NULL, V(5.0 / 3), 1e-7);
        tu_assert_values(ag_var(x, S(0), 1, 1, true), 1, S(1), V(5.0 / 3), 1e-7);
        ag_tensor *y = tu_tensor(dt, 2, S(2, 3), V(1, 2, 6, 0, 0, 3));
        /* rows: mean 3, ssd 14; mean 1, ssd 6 */
        tu_assert_values(ag_var(y, S(1), 1, 1, false), 1, S(2), V(7, 3), 1e-7);
        tu_assert_values(ag_var(y, S(-1), 1, 0, true), 2, S(2, 1), V(14.0 / 3, 2), 1e-7);
        /* columns: (1,0) (2,0) (6,3): ssd 0.5, 2, 4.5 */
        tu_assert_values(ag_var(y, S(0), 1, 1, false), 1, S(3), V(0.5, 2, 4.5), 1e-7);
        /* one element, unbiased: 0/0 = NaN; correction 0: 0 */
        ag_tensor *one = tu_tensor(dt, 1, S(1), V(3));
        assert_true(isnan(ag_tensor_item(ag_var(one, NULL, 0, 1, false))));
        assert_true(ag_tensor_item(ag_var(one, NULL, 0, 0, false)) == 0);
    }
    /* correction=None in the schema means 1 */
    ag_tensor *x = tu_tensor(AG_F64, 1, S(3), V(1, 2, 6));
    ag_tensor *v = ag_op_call1(ag_op_find("var.correction"), (ag_arg[]){AG_A_T(x)}, 1);
    tu_assert_values(v, 0, NULL, V(7), 1e-12);
    /* A large offset does not destroy precision (two-pass in double). */
    ag_tensor *big = tu_tensor(AG_F32, 1, S(4), V(1e6 + 1, 1e6 + 2, 1e6 + 3, 1e6 + 4));
    tu_assert_values(ag_var(big, NULL, 0, 0, false), 0, NULL, V(1.25), 1e-6);
    ag_scope_end();
}

static void test_amax_values(void **st) {
    (void)st;
    ag_scope_begin();
    ag_tensor *x = tu_tensor(AG_F32, 2, S(2, 3), V(1, 7, -3, 4, 4, -9));
    tu_assert_values(ag_amax(x, S(1), 1, false), 1, S(2), V(7, 4), 0);
    tu_assert_values(ag_amax(x, S(0), 1, true), 2, S(1, 3), V(4, 7, -3), 0);
    tu_assert_values(ag_amax(x, NULL, 0, false), 0, NULL, V(7), 0);
    /* the schema default dim=[] reduces every dim */
    ag_tensor *all = ag_op_call1(ag_op_find("amax"), (ag_arg[]){AG_A_T(x)}, 1);
    tu_assert_values(all, 0, NULL, V(7), 0);
    /* NaN propagates, -inf is a value */
    ag_tensor *n = tu_tensor(AG_F64, 2, S(2, 3), V(1, NAN, 3, -INFINITY, -INFINITY, -INFINITY));
    ag_tensor *r = ag_amax(n, S(1), 1, false);
    assert_true(isnan(ag_tensor_item_at(r, 0)));
    assert_true(ag_tensor_item_at(r, 1) == -INFINITY);
    /* NaN also propagates on the vector path (long rows) */
    ag_tensor *lng = ag_zeros(AG_F32, 1, S(1000));
    ((float *)ag_tensor_data(lng))[517] = NAN;
    assert_true(isnan(ag_tensor_item(ag_amax(lng, NULL, 0, false))));
    /* an empty reduced dim is an error naming the op */
    assert_null(ag_amax(ag_zeros(AG_F32, 2, S(2, 0)), S(1), 1, false));
    tu_assert_error_contains("amax(): Expected reduction dim 1 to have non-zero size.");
    ag_clear_error();
    ag_scope_end();
}

static void test_logsumexp_values(void **st) {
    (void)st;
    ag_scope_begin();
    ag_tensor *x = tu_tensor(AG_F64, 2, S(2, 2), V(0, 0, 1, 2));
    tu_assert_values(ag_logsumexp(x, S(1), 1, false), 1, S(2),
                     V(log(2.0), log(exp(1.0) + exp(2.0))), 1e-14);
    tu_assert_values(ag_logsumexp(x, S(0), 1, true), 2, S(1, 2),
                     V(log(1 + exp(1.0)), log(1 + exp(2.0))), 1e-14);
    /* stability: huge values, all -inf, +inf */
    ag_tensor *big =
        tu_tensor(AG_F32, 2, S(3, 2), V(1000, 1000, -1000, -1000, -INFINITY, -INFINITY));
    ag_tensor *r = ag_logsumexp(big, S(1), 1, false);
    tu_assert_values(ag_slice(r, 0, 0, 2, 1), 1, S(2), V(1000 + log(2.0), -1000 + log(2.0)), 1e-6);
    assert_true(ag_tensor_item_at(r, 2) == -INFINITY);
    ag_tensor *inf = tu_tensor(AG_F64, 1, S(2), V(INFINITY, 1));
    assert_true(ag_tensor_item(ag_logsumexp(inf, S(0), 1, false)) == INFINITY);
    ag_scope_end();
}

/* ---- argmax ---- */

static void test_argmax(void **st) {
    (void)st;
    ag_scope_begin();
    /* ties pick the first index, as PyTorch */
    ag_tensor *x = tu_tensor(AG_F32, 2, S(2, 4), V(1, 5, 5, 2, 7, 0, 7, 7));
    ag_tensor *a1 = ag_argmax(x, 1, false);
    assert_int_equal(ag_tensor_dtype(a1), AG_I64);
    tu_assert_values(a1, 1, S(2), V(1, 0), 0);
    tu_assert_values(ag_argmax(x, -1, true), 2, S(2, 1), V(1, 0), 0);
    tu_assert_values(ag_argmax(x, 0, false), 1, S(4), V(1, 0, 1, 1), 0);
    /* flattened: first of the three 7s */
    ag_tensor *af = ag_argmax_all(x);
    tu_assert_values(af, 0, NULL, V(4), 0);
    ag_tensor *ak =
        ag_op_call1(ag_op_find("argmax"), (ag_arg[]){AG_A_T(x), AG_A_NONE, AG_A_B(true)}, 3);
    tu_assert_values(ak, 2, S(1, 1), V(4), 0);
    /* non-contiguous: the flat index is over the logical (transposed) order */
    ag_tensor *t = ag_transpose(x, 0, 1); /* [[1,7],[5,0],[5,7],[2,7]] */
    tu_assert_values(ag_argmax_all(t), 0, NULL, V(1), 0);
    tu_assert_values(ag_argmax(t, 0, false), 1, S(2), V(1, 0), 0);
    tu_assert_values(ag_argmax(t, 1, false), 1, S(4), V(1, 0, 1, 1), 0);
    /* NaN is the maximum; i64 inputs */
    ag_tensor *n = tu_tensor(AG_F64, 1, S(4), V(1, NAN, 9, NAN));
    tu_assert_values(ag_argmax_all(n), 0, NULL, V(1), 0);
    ag_tensor *i = tu_tensor(AG_I64, 1, S(3), V(-5, 3, 3));
    tu_assert_values(ag_argmax(i, 0, false), 0, NULL, V(1), 0);
    /* no gradient: the result does not require grad */
    ag_tensor *g = tu_tensor(AG_F64, 1, S(3), V(1, 3, 2));
    ag_tensor_set_requires_grad(g, true);
    assert_false(ag_tensor_requires_grad(ag_argmax(g, 0, false)));
    /* errors */
    assert_null(ag_argmax(x, 2, false));
    tu_assert_error_contains(
        "argmax: Dimension out of range (expected to be in range of [-2, 1], but got 2)");
    ag_clear_error();
    assert_null(ag_argmax_all(ag_zeros(AG_F32, 1, S(0))));
    tu_assert_error_contains("argmax");
    ag_clear_error();
    ag_scope_end();
}

/* ---- softmax ---- */

/* Checks softmax / log_softmax of x along dim against exp(x)/sum exp(x) in double. */
static void check_softmax(ag_tensor *x, int dim, double tol) {
    int nd = ag_tensor_ndim(x);
    int d = dim < 0 ? dim + nd : dim;
    const int64_t *sz = ag_tensor_sizes(x);
    int64_t n = ag_tensor_numel(x), len = sz[d], inner = 1;
    for (int k = d + 1; k < nd; k++)
        inner *= sz[k];
    double *v = vals_of(x), *ref = malloc(sizeof(double) * (size_t)n),
           *lref = malloc(sizeof(double) * (size_t)n);
    for (int64_t o = 0; o < n / (len * inner); o++)
        for (int64_t in = 0; in < inner; in++) {
            int64_t b = o * len * inner + in;
            double m = -INFINITY, s = 0;
            for (int64_t k = 0; k < len; k++)
                m = fmax(m, v[b + k * inner]);
            for (int64_t k = 0; k < len; k++)
                s += exp(v[b + k * inner] - m);
            for (int64_t k = 0; k < len; k++) {
                ref[b + k * inner] = exp(v[b + k * inner] - m) / s;
                lref[b + k * inner] = v[b + k * inner] - m - log(s);
            }
        }
    ag_tensor *y = ag_softmax(x, dim);
    assert_int_equal(ag_tensor_dtype(y), ag_tensor_dtype(x));
    assert_true(ag_tensor_is_contiguous(y));
    assert_close(y, ref, n, tol);
    assert_close(ag_log_softmax(x, dim), lref, n, tol);
    /* rows sum to 1 */
    ag_tensor *rs = ag_sum(y, (int64_t[]){dim}, 1, false);
    int64_t nr = ag_tensor_numel(rs);
    for (int64_t r = 0; r < nr; r++)
        assert_true(fabs(ag_tensor_item_at(rs, r) - 1) < 1e-6);
    free(v);
    free(ref);
    free(lref);
}

static void test_softmax_values(void **st) {
    (void)st;
    ag_scope_begin();
    ag_tensor *x = tu_tensor(AG_F64, 2, S(2, 3), V(1, 2, 3, 0, 0, 0));
    double e = exp(1.0), s = 1 + e + e * e;
    tu_assert_values(ag_softmax(x, 1), 2, S(2, 3),
                     V(1 / s, e / s, e * e / s, 1.0 / 3, 1.0 / 3, 1.0 / 3), 1e-15);
    tu_assert_values(ag_log_softmax(x, -1), 2, S(2, 3),
                     V(-log(s), 1 - log(s), 2 - log(s), -log(3.0), -log(3.0), -log(3.0)), 1e-15);
    for (int k = 0; k < 2; k++) {
        ag_dtype dt = k ? AG_F64 : AG_F32;
        double tol = k ? 1e-13 : 1e-6;
        check_softmax(randt(dt, 2, S(7, 33), -3, 3, 11), 1, tol);
        check_softmax(randt(dt, 2, S(7, 33), -3, 3, 12), 0, tol);
        check_softmax(randt(dt, 3, S(4, 5, 6), -3, 3, 13), 1, tol);
        check_softmax(randt(dt, 2, S(300, 1000), -5, 5, 14), -1, tol); /* parallel rows */
        /* non-contiguous input */
        check_softmax(ag_transpose(randt(dt, 2, S(9, 17), -3, 3, 15), 0, 1), 1, tol);
        check_softmax(ag_transpose(randt(dt, 2, S(9, 17), -3, 3, 16), 0, 1), 0, tol);
        /* large magnitudes stay finite (the max is subtracted) */
        check_softmax(randt(dt, 2, S(3, 50), -1e4, 1e4, 17), 1, tol);
    }
    ag_tensor *big = tu_tensor(AG_F32, 1, S(3), V(1e30, 1e30, -1e30));
    tu_assert_values(ag_softmax(big, 0), 1, S(3), V(0.5, 0.5, 0), 1e-7);
    tu_assert_values(ag_log_softmax(big, 0), 1, S(3), V(-log(2.0), -log(2.0), -2e30), 1e-6);
    /* f32 special values: masked (-inf) entries get 0, a NaN poisons its row only; long rows
     * take the vectorized paths */
    ag_tensor *msk = ag_full(AG_F32, 2, S(2, 40), 1);
    float *pm = ag_tensor_data(msk);
    for (int i = 0; i < 20; i++)
        pm[2 * i] = -INFINITY; /* row 0: half masked; row 1 gets a NaN */
    pm[40 + 7] = NAN;
    ag_tensor *sm = ag_softmax(msk, 1), *lsm = ag_log_softmax(msk, 1);
    for (int i = 0; i < 40; i++) {
        assert_true(fabs(ag_tensor_item_at(sm, i) - (i % 2 ? 0.05 : 0)) < 1e-7);
        assert_true(i % 2 ? fabs(ag_tensor_item_at(lsm, i) - log(0.05)) < 1e-6
                          : ag_tensor_item_at(lsm, i) == -INFINITY);
        assert_true(isnan(ag_tensor_item_at(sm, 40 + i)));
        assert_true(isnan(ag_tensor_item_at(lsm, 40 + i)));
    }
    ag_tensor *lse = ag_logsumexp(msk, S(1), 1, false);
    assert_true(fabs(ag_tensor_item_at(lse, 0) - (1 + log(20.0))) < 1e-6);
    assert_true(isnan(ag_tensor_item_at(lse, 1)));
    /* a 0-d tensor: softmax is 1, log_softmax 0 */
    ag_tensor *z = ag_scalar_tensor(AG_F64, 5);
    tu_assert_values(ag_softmax(z, 0), 0, NULL, V(1), 0);
    tu_assert_values(ag_log_softmax(z, -1), 0, NULL, V(0), 0);
    ag_scope_end();
}

static void test_softmax_backward_data_values(void **st) {
    (void)st;
    ag_scope_begin();
    /* softmax: gi = y (g - sum(g y)); log_softmax: gi = g - exp(y) sum(g). */
    ag_tensor *g = tu_tensor(AG_F64, 2, S(2, 3), V(1, -2, 0.5, 3, 0, 1));
    ag_tensor *y = tu_tensor(AG_F64, 2, S(2, 3), V(0.2, 0.3, 0.5, 0.1, 0.6, 0.3));
    double s0 = 0.2 - 0.6 + 0.25, s1 = 0.3 + 0 + 0.3;
    tu_assert_values(ag_softmax_backward_data(g, y, 1, AG_F64), 2, S(2, 3),
                     V(0.2 * (1 - s0), 0.3 * (-2 - s0), 0.5 * (0.5 - s0), 0.1 * (3 - s1),
                       0.6 * (0 - s1), 0.3 * (1 - s1)),
                     1e-15);
    double t0 = -0.5, t1 = 4;
    tu_assert_values(ag_log_softmax_backward_data(g, y, -1, AG_F64), 2, S(2, 3),
                     V(1 - exp(0.2) * t0, -2 - exp(0.3) * t0, 0.5 - exp(0.5) * t0,
                       3 - exp(0.1) * t1, 0 - exp(0.6) * t1, 1 - exp(0.3) * t1),
                     1e-15);
    /* along dim 0, with an expanded (stride 0) grad, f32 */
    ag_tensor *gf = ag_expand(tu_tensor(AG_F32, 2, S(1, 3), V(1, 2, 3)), 2, S(2, 3));
    ag_tensor *yf = tu_tensor(AG_F32, 2, S(2, 3), V(0.25, 0.5, 0.9, 0.75, 0.5, 0.1));
    /* column c: s = g_c (y0 + y1) = g_c, so gi = y g_c - y g_c = 0 */
    tu_assert_values(ag_softmax_backward_data(gf, yf, 0, AG_F32), 2, S(2, 3), V(0, 0, 0, 0, 0, 0),
                     1e-7);
    /* log: sum over dim 0 of g is 2 g_c: gi = g_c (1 - 2 exp(y)) */
    tu_assert_values(ag_log_softmax_backward_data(gf, yf, 0, AG_F32), 2, S(2, 3),
                     V(1 - 2 * exp(0.25), 2 * (1 - 2 * exp(0.5)), 3 * (1 - 2 * exp(0.9)),
                       1 - 2 * exp(0.75), 2 * (1 - 2 * exp(0.5)), 3 * (1 - 2 * exp(0.1))),
                     1e-6);
    ag_scope_end();
}

/* ---- errors ---- */

static void test_errors(void **st) {
    (void)st;
    ag_scope_begin();
    ag_tensor *x = tu_tensor(AG_F32, 2, S(2, 3), V(1, 2, 3, 4, 5, 6));
    assert_null(ag_sum(x, S(2), 1, false));
    tu_assert_error_contains(
        "sum: Dimension out of range (expected to be in range of [-2, 1], but got 2)");
    ag_clear_error();
    assert_null(ag_mean(x, S(-3), 1, false));
    tu_assert_error_contains(
        "mean: Dimension out of range (expected to be in range of [-2, 1], but got -3)");
    ag_clear_error();
    assert_null(ag_sum(x, S(0, -2), 2, false));
    tu_assert_error_contains("sum: dim 0 appears multiple times");
    ag_clear_error();
    assert_null(ag_amax(x, S(1, 1), 2, false));
    tu_assert_error_contains("amax: dim 1 appears multiple times");
    ag_clear_error();
    assert_null(ag_var(x, S(5), 1, 1, false));
    tu_assert_error_contains(
        "var: Dimension out of range (expected to be in range of [-2, 1], but got 5)");
    ag_clear_error();
    assert_null(ag_logsumexp(x, S(7), 1, false));
    tu_assert_error_contains(
        "logsumexp: Dimension out of range (expected to be in range of [-2, 1], but got 7)");
    ag_clear_error();
    assert_null(ag_softmax(x, 2));
    tu_assert_error_contains(
        "_softmax: Dimension out of range (expected to be in range of [-2, 1], but got 2)");
    ag_clear_error();
    assert_null(ag_log_softmax(x, -3));
    tu_assert_error_contains(
        "_log_softmax: Dimension out of range (expected to be in range of [-2, 1], but got -3)");
    ag_clear_error();
    assert_null(
        ag_op_call1(ag_op_find("_softmax"), (ag_arg[]){AG_A_T(x), AG_A_I(0), AG_A_B(true)}, 3));
    tu_assert_error_contains("_softmax: half_to_float");
    ag_clear_error();
    ag_tensor *y = tu_tensor(AG_F32, 2, S(3, 2), V(1, 2, 3, 4, 5, 6));
    assert_null(ag_softmax_backward_data(x, y, 1, AG_F32));
    tu_assert_error_contains("_softmax_backward_data: grad_output [2, 3] and output [3, 2]");
    ag_clear_error();
    assert_null(ag_log_softmax_backward_data(x, x, 1, AG_F64));
    tu_assert_error_contains("_log_softmax_backward_data: input_dtype f64");
    ag_clear_error();
    /* integer inputs where only floats make sense */
    ag_tensor *i = tu_tensor(AG_I64, 1, S(2), V(1, 2));
    assert_null(ag_softmax(i, 0));
    tu_assert_error_contains("_softmax");
    ag_clear_error();
    assert_null(ag_var(i, NULL, 0, 1, false));
    tu_assert_error_contains("var");
    ag_clear_error();
    ag_scope_end();
}

/* ---- backward ---- */

static ag_tensor *grad_of(ag_tensor *out, ag_tensor *x, ag_tensor *w) {
    ag_tensor *g = NULL;
    assert_int_equal(ag_grad(&out, &w, 1, &x, 1, &g, false, false), 0);
    return g;
}

static void test_amax_backward_ties(void **st) {
    (void)st;
    ag_scope_begin();
    /* all dims: two elements share the max, each gets half */
    ag_tensor *x = tu_tensor(AG_F64, 1, S(4), V(1, 3, 3, 2));
    ag_tensor_set_requires_grad(x, true);
    ag_tensor *m = ag_amax(x, NULL, 0, false);
    assert_int_equal(ag_backward(m, NULL, false), 0);
    tu_assert_values(ag_tensor_grad(x), 1, S(4), V(0, 0.5, 0.5, 0), 0);
    /* per row with weights: row 0 ties at 3 (x2), row 1 ties at 2 (x3) */
    ag_tensor *y = tu_tensor(AG_F64, 2, S(2, 4), V(3, 1, 3, 0, 2, 2, 2, -1));
    ag_tensor_set_requires_grad(y, true);
    ag_tensor *w = tu_tensor(AG_F64, 1, S(2), V(4, 9));
    ag_tensor *gy = grad_of(ag_amax(y, S(1), 1, false), y, w);
    tu_assert_values(gy, 2, S(2, 4), V(2, 0, 2, 0, 3, 3, 3, 0), 1e-15);
    /* keepdim, over dim 0 */
    ag_tensor *w2 = tu_tensor(AG_F64, 2, S(1, 4), V(1, 2, 3, 4));
    ag_tensor *gy2 = grad_of(ag_amax(y, S(0), 1, true), y, w2);
    tu_assert_values(gy2, 2, S(2, 4), V(1, 0, 3, 4, 0, 2, 0, 0), 1e-15);
    ag_scope_end();
}

static void test_softmax_backward(void **st) {
    (void)st;
    ag_scope_begin();
    ag_tensor *x = tu_tensor(AG_F64, 2, S(2, 3), V(0.5, -1, 2, 0, 0.25, 1));
    ag_tensor_set_requires_grad(x, true);
    double w[6] = {1, -2, 3, 0.5, 0, -1};
    ag_tensor *wt = tu_tensor(AG_F64, 2, S(2, 3), w);
    ag_tensor *y = ag_softmax(x, 1);
    assert_non_null(strstr(ag_tensor_grad_fn_name(y), "_softmax"));
    ag_tensor *gx = grad_of(y, x, wt);
    ag_tensor *ly = ag_log_softmax(x, 1);
    ag_tensor *gl = grad_of(ly, x, wt);
    /* d/dx sum(w * softmax(x)) = y (w - sum(w y)); log_softmax: w - y sum(w) */
    double *yv = vals_of(y);
    double ref[6], lref[6];
    for (int r = 0; r < 2; r++) {
        double s = 0, sw = 0;
        for (int k = 0; k < 3; k++) {
            s += w[r * 3 + k] * yv[r * 3 + k];
            sw += w[r * 3 + k];
        }
        for (int k = 0; k < 3; k++) {
            ref[r * 3 + k] = yv[r * 3 + k] * (w[r * 3 + k] - s);
            lref[r * 3 + k] = w[r * 3 + k] - yv[r * 3 + k] * sw;
        }
    }
    assert_close(gx, ref, 6, 1e-14);
    assert_close(gl, lref, 6, 1e-14);
    free(yv);
    ag_scope_end();
}

/* sum/mean/var/logsumexp backward shapes and values through the rules. */
static void test_reduction_backward_values(void **st) {
    (void)st;
    ag_scope_begin();
    ag_tensor *x = tu_tensor(AG_F64, 2, S(2, 3), V(1, 2, 6, 0, 0, 3));
    ag_tensor_set_requires_grad(x, true);
    ag_tensor *w = tu_tensor(AG_F64, 1, S(2), V(2, -1));
    tu_assert_values(grad_of(ag_sum(x, S(1), 1, false), x, w), 2, S(2, 3), V(2, 2, 2, -1, -1, -1),
                     0);
    tu_assert_values(grad_of(ag_mean(x, S(-1), 1, false), x, w), 2, S(2, 3),
                     V(2.0 / 3, 2.0 / 3, 2.0 / 3, -1.0 / 3, -1.0 / 3, -1.0 / 3), 1e-15);
    ag_tensor *wk = tu_tensor(AG_F64, 2, S(1, 3), V(1, 2, 3));
    tu_assert_values(grad_of(ag_sum(x, S(0), 1, true), x, wk), 2, S(2, 3), V(1, 2, 3, 1, 2, 3), 0);
    /* var over rows (means 3 and 1), unbiased: w * 2 (x - mean) / 2 */
    tu_assert_values(grad_of(ag_var(x, S(1), 1, 1, false), x, w), 2, S(2, 3),
                     V(2 * -2, 2 * -1, 2 * 3, -1 * -1, -1 * -1, -1 * 2), 1e-14);
    /* var of all, correction 0 (mean 2, N 6): 2 (x - 2) / 6 */
    tu_assert_values(grad_of(ag_var(x, NULL, 0, 0, false), x, NULL), 2, S(2, 3),
                     V(-1.0 / 3, 0, 4.0 / 3, -2.0 / 3, -2.0 / 3, 1.0 / 3), 1e-14);
    /* logsumexp: softmax of each row times w */
    ag_tensor *gl = grad_of(ag_logsumexp(x, S(1), 1, false), x, w);
    double s0 = exp(1.0) + exp(2.0) + exp(6.0), s1 = 2 + exp(3.0);
    tu_assert_values(gl, 2, S(2, 3),
                     V(2 * exp(1.0) / s0, 2 * exp(2.0) / s0, 2 * exp(6.0) / s0, -1 / s1, -1 / s1,
                       -exp(3.0) / s1),
                     1e-14);
    ag_scope_end();
}

/* The gradcheck samples of this file's ops pass (the central table checks them too; this keeps
 * the family's own test self-contained). Includes the backward helpers' own backward rules. */
static void test_gradcheck_samples(void **st) {
    (void)st;
    static const char *const names[] = {"sum.dim_IntList",
                                        "mean.dim",
                                        "amax",
                                        "var.correction",
                                        "logsumexp",
                                        "_softmax",
                                        "_log_softmax",
                                        "_softmax_backward_data",
                                        "_log_softmax_backward_data"};
    assert_true(tu_gradcheck_ops(names, sizeof names / sizeof names[0]) >= 2);
}

/* ---- allocation failures ---- */

/* Every scratch allocation of the kernels: chunk partials (a long full sum), column partials
 * (several row chunks), dtype conversion copies, the strided-row gather scratch, argmax's
 * contiguous copy, the two-pass buffers of var and logsumexp, and backward rules. */
static int oom_scenario(void *ud) {
    (void)ud;
    int rc = 0;
    ag_scope_begin();
    ag_tensor *x = ag_arange(AG_F32, 0, 40000, 1);
    ag_tensor *v = x ? ag_view(x, 2, S(1000, 40)) : NULL;
    ag_tensor *t = v ? ag_transpose(v, 0, 1) : NULL;
    ag_tensor *i = ag_ones(AG_I64, 2, S(3, 4));
    ag_tensor *w = ag_ones(AG_F64, 2, S(3, 4));
    if (!t || !i || !w) {
        rc = ag_last_status();
        goto out;
    }
    ag_tensor_set_requires_grad(w, true);
    ag_tensor *r[] = {
        ag_sum_all(x),
        ag_sum(v, S(0), 1, false),
        ag_var(t, S(1), 1, 1, false),
        ag_logsumexp(t, S(1), 1, true),
        ag_amax(t, NULL, 0, false),
        ag_softmax(t, 0),
        ag_argmax_all(t),
        ag_op_call1(ag_op_find("mean.dim"),
                    (ag_arg[]){AG_A_T(i), AG_A_NONE, AG_A_B(false), AG_A_DT(AG_F32)}, 4),
    };
    for (size_t k = 0; k < sizeof r / sizeof r[0] && rc == 0; k++)
        if (!r[k])
            rc = ag_last_status();
    ag_tensor *loss = rc ? NULL : ag_sum_all(ag_mul(ag_softmax(w, 1), ag_amax(w, S(1), 1, true)));
    if (rc == 0)
        rc = loss ? ag_backward(loss, NULL, false) : ag_last_status();
out:
    ag_scope_end();
    return rc;
}

static void test_allocation_failures(void **st) {
    (void)st;
    /* One thread: the scratch buffers are then allocated in the same order in every run. */
    tu_sweep_opts o = {.what = "reductions", .one_thread = true};
    assert_true(tu_alloc_failure_sweep(oom_scenario, NULL, &o) >= 30);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sum_values),
        cmocka_unit_test(test_sum_integer_dtypes),
        cmocka_unit_test(test_sum_strided_inputs),
        cmocka_unit_test(test_sum_large_shapes),
        cmocka_unit_test(test_thread_count_independence),
        cmocka_unit_test(test_mean_values),
        cmocka_unit_test(test_var_values),
        cmocka_unit_test(test_amax_values),
        cmocka_unit_test(test_logsumexp_values),
        cmocka_unit_test(test_argmax),
        cmocka_unit_test(test_softmax_values),
        cmocka_unit_test(test_softmax_backward_data_values),
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_amax_backward_ties),
        cmocka_unit_test(test_softmax_backward),
        cmocka_unit_test(test_reduction_backward_values),
        cmocka_unit_test(test_gradcheck_samples),
        cmocka_unit_test(test_allocation_failures),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
