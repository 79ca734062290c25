/* Core objects: tensors, storage sharing of views, scopes, errors, factories, the RNG, the op
 * registry and schema parser. */
#include "testutil.h"
#include "core/internal.h"

#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void test_dtypes(void **st) {
    (void)st;
    assert_string_equal(ag_dtype_short(AG_F32), "f32");
    assert_string_equal(ag_dtype_short(AG_BOOL), "b8");
    assert_int_equal(ag_dtype_size(AG_I64), 8);
    assert_true(ag_dtype_is_float(AG_F64));
    assert_false(ag_dtype_is_float(AG_I64));
}

static void test_factories(void **st) {
    (void)st;
    ag_scope_begin();
    int64_t s[] = {2, 3};
    ag_tensor *z = ag_zeros(AG_F32, 2, s);
    tu_assert_values(z, 2, s, (double[]){0, 0, 0, 0, 0, 0}, 0);
    ag_tensor *f = ag_full(AG_I64, 2, s, 7);
    assert_int_equal(ag_tensor_dtype(f), AG_I64);
    tu_assert_values(f, 2, s, (double[]){7, 7, 7, 7, 7, 7}, 0);
    ag_tensor *a = ag_arange(AG_I64, 2, 11, 3);
    tu_assert_values(a, 1, (int64_t[]){3}, (double[]){2, 5, 8}, 0);
    ag_tensor *af = ag_arange(AG_F64, 0, 1, 0.25);
    tu_assert_values(af, 1, (int64_t[]){4}, (double[]){0, 0.25, 0.5, 0.75}, 0);
    assert_null(ag_arange(AG_F32, 0, 5, -1));
    tu_assert_error_contains("arange");
    ag_tensor *sc = ag_scalar_tensor(AG_F64, 2.5);
    assert_int_equal(ag_tensor_ndim(sc), 0);
    assert_true(ag_tensor_item(sc) == 2.5);
    ag_tensor *d = ag_from_data(AG_F32, 2, s, (float[]){1, 2, 3, 4, 5, 6});
    tu_assert_values(d, 2, s, (double[]){1, 2, 3, 4, 5, 6}, 0);
    assert_null(ag_zeros(AG_F32, 2, (int64_t[]){2, -1}));
    tu_assert_error_contains("negative size");
    ag_scope_end();
}

static void test_views_share_storage(void **st) {
    (void)st;
    ag_scope_begin();
    int64_t s[] = {2, 3};
    ag_tensor *x = tu_tensor(AG_F32, 2, s, (double[]){0, 1, 2, 3, 4, 5});
    ag_tensor *t = ag_t(x);
    assert_true(ag_tensor_same_storage(x, t));
    assert_false(ag_tensor_is_contiguous(t));
    tu_assert_values(t, 2, (int64_t[]){3, 2}, (double[]){0, 3, 1, 4, 2, 5}, 0);
    assert_int_equal(ag_tensor_strides(t)[0], 1);
    assert_int_equal(ag_tensor_strides(t)[1], 3);

    ag_tensor *v = ag_view(x, 1, (int64_t[]){-1});
    assert_true(ag_tensor_same_storage(x, v));
    tu_assert_values(v, 1, (int64_t[]){6}, (double[]){0, 1, 2, 3, 4, 5}, 0);

    /* A transposed tensor cannot be viewed flat: view fails with the PyTorch hint, reshape
     * copies. */
    assert_null(ag_view(t, 1, (int64_t[]){6}));
    tu_assert_error_contains("use reshape instead");
    ag_tensor *r = ag_reshape(t, 1, (int64_t[]){6});
    assert_false(ag_tensor_same_storage(x, r));
    tu_assert_values(r, 1, (int64_t[]){6}, (double[]){0, 3, 1, 4, 2, 5}, 0);

    ag_tensor *sl = ag_slice(x, 1, 1, 3, 1);
    assert_int_equal(ag_tensor_offset(sl), 1);
    tu_assert_values(sl, 2, (int64_t[]){2, 2}, (double[]){1, 2, 4, 5}, 0);
    ag_tensor *sl2 = ag_slice(x, 1, 0, 100, 2);
    tu_assert_values(sl2, 2, (int64_t[]){2, 2}, (double[]){0, 2, 3, 5}, 0);
    ag_tensor *se = ag_select(x, 0, -1);
    tu_assert_values(se, 1, (int64_t[]){3}, (double[]){3, 4, 5}, 0);
    assert_null(ag_select(x, 0, 2));
    tu_assert_error_contains("select: index 2 out of range");

    ag_tensor *u = ag_unsqueeze(x, 1);
    assert_int_equal(ag_tensor_ndim(u), 3);
    assert_int_equal(ag_tensor_sizes(u)[1], 1);
    ag_tensor *sq = ag_squeeze(u, 1);
    tu_assert_values(sq, 2, s, (double[]){0, 1, 2, 3, 4, 5}, 0);
    ag_tensor *e = ag_expand(ag_unsqueeze(se, 0), 2, (int64_t[]){2, -1});
    assert_int_equal(ag_tensor_strides(e)[0], 0);
    tu_assert_values(e, 2, s, (double[]){3, 4, 5, 3, 4, 5}, 0);
    assert_null(ag_expand(x, 2, (int64_t[]){4, 3}));
    tu_assert_error_contains("expand");

    ag_tensor *p = ag_permute(ag_view(x, 3, (int64_t[]){1, 2, 3}), 3, (int64_t[]){2, 0, 1});
    tu_assert_values(p, 3, (int64_t[]){3, 1, 2}, (double[]){0, 3, 1, 4, 2, 5}, 0);
    ag_tensor *as = ag_as_strided(x, 2, (int64_t[]){2, 2}, (int64_t[]){1, 1}, 0);
    tu_assert_values(as, 2, (int64_t[]){2, 2}, (double[]){0, 1, 1, 2}, 0);
    assert_null(ag_as_strided(x, 1, (int64_t[]){10}, (int64_t[]){1}, 0));
    tu_assert_error_contains("as_strided");

    /* Copies. */
    ag_tensor *c = ag_contiguous(t);
    assert_true(ag_tensor_is_contiguous(c));
    tu_assert_values(c, 2, (int64_t[]){3, 2}, (double[]){0, 3, 1, 4, 2, 5}, 0);
    assert_ptr_equal(ag_contiguous(x), x);
    ag_tensor *i = ag_to_dtype(t, AG_I64);
    assert_int_equal(ag_tensor_dtype(i), AG_I64);
    tu_assert_values(i, 2, (int64_t[]){3, 2}, (double[]){0, 3, 1, 4, 2, 5}, 0);
    ag_scope_end();
}

static void test_scope_and_refcounts(void **st) {
    (void)st;
    int64_t s[] = {4};
    /* Outside a scope, the caller owns results. */
    ag_tensor *a = ag_ones(AG_F32, 1, s);
    ag_tensor *kept;
    ag_scope_begin();
    ag_tensor *v = ag_view(a, 2, (int64_t[]){2, 2});
    kept = ag_tensor_keep(ag_t(v));
    ag_scope_begin();
    (void)ag_zeros(AG_F32, 1, s);
    ag_scope_end();
    ag_scope_end();
    /* The kept transpose still works after its scope closed and its base was released. */
    ag_tensor_free(a);
    assert_int_equal(ag_tensor_numel(kept), 4);
    assert_true(ag_tensor_item_at(kept, 3) == 1.0);
    ag_tensor_free(kept);
    ag_tensor_free(NULL); /* harmless */
}

static void test_null_chain_keeps_first_error(void **st) {
    (void)st;
    ag_scope_begin();
    ag_clear_error();
    ag_tensor *x = ag_zeros(AG_F32, 2, (int64_t[]){2, 3});
    ag_tensor *bad = ag_view(x, 1, (int64_t[]){7});
    assert_null(bad);
    char first[256];
    snprintf(first, sizeof first, "%s", ag_last_error());
    assert_non_null(strstr(first, "view: shape [7] is invalid for input of size 6"));
    assert_null(ag_t(ag_transpose(bad, 0, 1)));
    assert_string_equal(ag_last_error(), first);
    ag_clear_error();
    assert_null(ag_t(NULL));
    tu_assert_error_contains("argument 'self' is NULL");
    ag_scope_end();
}

static void test_rng_determinism_across_threads(void **st) {
    (void)st;
    int64_t n = 200003; /* above the parallel threshold, odd size */
    double *ref = malloc(sizeof(double) * (size_t)n);
    for (int threads = 1; threads <= 4; threads *= 2) {
        omp_set_num_threads(threads);
        ag_manual_seed(1234);
        ag_tensor *u = ag_rand(AG_F64, 1, &n);
        ag_tensor *g = ag_randn(AG_F32, 1, &n);
        const double *pu = ag_tensor_data(u);
        if (threads == 1) {
            memcpy(ref, pu, sizeof(double) * (size_t)n);
            /* Sanity: uniform in [0,1) with mean near 0.5; normal with std near 1. */
            double mean = 0, var = 0;
            for (int64_t i = 0; i < n; i++) {
                assert_true(pu[i] >= 0 && pu[i] < 1);
                mean += pu[i];
            }
            mean /= (double)n;
            assert_true(fabs(mean - 0.5) < 0.01);
            const float *pg = ag_tensor_data(g);
            for (int64_t i = 0; i < n; i++)
                var += (double)pg[i] * pg[i];
            assert_true(fabs(var / (double)n - 1.0) < 0.02);
        } else {
            assert_memory_equal(ref, pu, sizeof(double) * (size_t)n);
        }
        ag_tensor_free(u);
        ag_tensor_free(g);
    }
    /* The offset advances: a second draw differs; restoring the state repeats it. */
    ag_manual_seed(7);
    uint64_t seed, off;
    ag_rng_get_state(&seed, &off);
    ag_tensor *a = ag_rand(AG_F32, 1, (int64_t[]){8});
    ag_tensor *b = ag_rand(AG_F32, 1, (int64_t[]){8});
    ag_rng_set_state(seed, off);
    ag_tensor *c = ag_rand(AG_F32, 1, (int64_t[]){8});
    assert_true(tu_max_abs_diff(a, c) == 0);
    assert_true(tu_max_abs_diff(a, b) > 0);
    ag_tensor_free(a);
    ag_tensor_free(b);
    ag_tensor_free(c);
    free(ref);
    omp_set_num_threads(2);
}

static void test_registry_and_schema(void **st) {
    (void)st;
    const ag_op *add = ag_op_find("add.Tensor");
    assert_non_null(add);
    assert_string_equal(ag_op_name(add), "add.Tensor");
    assert_int_equal(ag_op_nargs(add), 3);
    const ag_schema_arg *alpha = ag_op_arg(add, 2);
    assert_string_equal(alpha->name, "alpha");
    assert_true(alpha->kwarg_only);
    assert_true(alpha->has_default);
    assert_true(alpha->def.kind == AG_ARG_FLOAT && alpha->def.u.f == 1.0);
    const ag_op *sl = ag_op_find("slice.Tensor");
    assert_int_equal(ag_op_arg(sl, 2)->type, AG_TY_OPT_INT);
    assert_int_equal(ag_op_arg(sl, 2)->def.kind, AG_ARG_NONE);
    assert_null(ag_op_find("no_such_op"));
    /* Every registered schema parsed, and names are unique. */
    int n = ag_op_count();
    assert_true(n > 20);
    for (int i = 0; i < n; i++)
        for (int j = i + 1; j < n; j++)
            assert_string_not_equal(ag_op_name(ag_op_at(i)), ag_op_name(ag_op_at(j)));
    /* User ops must be namespaced and cannot shadow built-ins. */
    static const ag_opdef bad = {
        .schema = "foo(Tensor x) -> Tensor", .meta = (ag_meta_fn)1, .kernel = (ag_kernel_fn)1};
    assert_null(ag_op_register(&bad));
    tu_assert_error_contains("namespace::name");
    /* Calling with wrong argument kinds names the op and argument. */
    ag_tensor *x = ag_zeros(AG_F32, 1, (int64_t[]){2});
    ag_tensor *out[4];
    assert_true(ag_op_call(add, (ag_arg[]){AG_A_T(x), AG_A_I(3)}, 2, out) < 0);
    tu_assert_error_contains("add.Tensor: argument 'other' must be Tensor");
    assert_true(ag_op_call(add, (ag_arg[]){AG_A_T(x)}, 1, out) < 0);
    tu_assert_error_contains("missing argument 'other'");
    ag_tensor_free(x);
}

static void test_cost(void **st) {
    (void)st;
    ag_tensor *x = ag_zeros(AG_F32, 2, (int64_t[]){4, 8});
    ag_cost c;
    assert_int_equal(ag_op_cost(ag_op_find("add.Tensor"), (ag_arg[]){AG_A_T(x), AG_A_T(x)}, 2, &c),
                     0);
    assert_true(c.flops == 32);
    assert_true(c.bytes == 3 * 32 * 4);
    assert_int_equal(ag_op_cost(ag_op_find("t"), (ag_arg[]){AG_A_T(x)}, 1, &c), 0);
    assert_true(c.flops == 0 && c.bytes == 0);
    ag_tensor_free(x);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_dtypes),
        cmocka_unit_test(test_factories),
        cmocka_unit_test(test_views_share_storage),
        cmocka_unit_test(test_scope_and_refcounts),
        cmocka_unit_test(test_null_chain_keeps_first_error),
        cmocka_unit_test(test_rng_determinism_across_threads),
        cmocka_unit_test(test_registry_and_schema),
        cmocka_unit_test(test_cost),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
