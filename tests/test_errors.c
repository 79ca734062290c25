/* User mistakes give clear messages naming the op and the offending shapes or dtypes, and
 * never crash. One case per family, through the public entry points and modules. */
#include "testutil.h"

#include <string.h>

static void expect(ag_tensor *r, const char *needle) {
    assert_null(r);
    tu_assert_error_contains(needle);
    ag_clear_error();
}

static void test_shape_messages(void **st) {
    (void)st;
    ag_scope_begin();
    ag_tensor *a = ag_zeros(AG_F32, 2, (int64_t[]){4, 3});
    ag_tensor *b = ag_zeros(AG_F32, 2, (int64_t[]){2, 3});
    expect(ag_mm(a, b), "mm: size mismatch: [4, 3] @ [2, 3]");
    expect(ag_add(a, ag_zeros(AG_F32, 1, (int64_t[]){4})), "[4, 3] and [4] cannot be broadcast");
    expect(ag_bmm(ag_zeros(AG_F32, 3, (int64_t[]){2, 4, 3}),
                  ag_zeros(AG_F32, 3, (int64_t[]){3, 3, 5})),
           "bmm");
    expect(ag_sum(a, (int64_t[]){2}, 1, false),
           "Dimension out of range (expected to be in range of [-2, 1], but got 2)");
    expect(ag_view(a, 1, (int64_t[]){5}), "view: shape [5] is invalid for input of size 12");
    expect(ag_cat((ag_tensor *[]){a, ag_zeros(AG_F32, 2, (int64_t[]){4, 2})}, 2, 0), "cat");
    ag_tensor *x = ag_zeros(AG_F32, 4, (int64_t[]){2, 3, 8, 8});
    ag_tensor *w = ag_zeros(AG_F32, 4, (int64_t[]){4, 2, 3, 3}); /* expects 3 input channels */
    expect(ag_conv2d(x, w, NULL, (int64_t[]){1, 1}, (int64_t[]){0, 0}, (int64_t[]){1, 1}, 1),
           "convolution");
    expect(ag_layer_norm(a, 1, (int64_t[]){4}, NULL, NULL, 1e-5), "layer_norm");
    ag_scope_end();
}

static void test_data_dependent_messages(void **st) {
    (void)st;
    ag_scope_begin();
    ag_tensor *logits = ag_zeros(AG_F32, 2, (int64_t[]){2, 3});
    ag_tensor *bad_t = ag_from_data(AG_I64, 1, (int64_t[]){2}, (int64_t[]){1, 7});
    expect(ag_cross_entropy(logits, bad_t, AG_REDUCTION_MEAN, -100), "7");
    ag_tensor *emb = ag_zeros(AG_F32, 2, (int64_t[]){5, 3});
    expect(ag_embedding(emb, bad_t), "embedding: index 7");
    expect(ag_index_select(emb, 0, bad_t), "index_select");
    ag_scope_end();
}

static void test_dtype_messages(void **st) {
    (void)st;
    ag_scope_begin();
    ag_tensor *f = ag_zeros(AG_F32, 2, (int64_t[]){2, 2});
    ag_tensor *i = ag_zeros(AG_I64, 2, (int64_t[]){2, 2});
    /* Embedding and losses need integer indices; gradients need floating point. */
    expect(ag_embedding(f, f), "embedding");
    expect(ag_add_(i, f, 1.0), "can't be cast");
    assert_int_equal(ag_tensor_set_requires_grad(i, true), AG_EINVAL);
    tu_assert_error_contains("only floating point tensors");
    ag_scope_end();
}

static void test_module_messages(void **st) {
    (void)st;
    ag_scope_begin();
    ag_module *lin = ag_nn_linear(3, 2, true);
    ag_tensor *x = ag_zeros(AG_F32, 2, (int64_t[]){4, 5});
    expect(ag_module_forward(lin, x), "[4, 5]");
    ag_module *list = ag_nn_module_list();
    expect(ag_module_forward(list, x), "ModuleList");
    ag_module_free(list);
    ag_module_free(lin);
    ag_scope_end();
}

/* A write into a tensor whose elements share memory (an expanded view, an overlapping
 * as_strided) is refused, as PyTorch refuses it, and leaves the data and version untouched.
 * fill_ and zero_ write one value everywhere and are allowed (as in PyTorch), and so are
 * in-place view ops, which write no data. */
static void expect_overlap_refused(ag_tensor *r, const char *op, ag_tensor *base, uint64_t v) {
    assert_null(r);
    assert_int_equal(ag_last_status(), AG_EINVAL);
    tu_assert_error_contains(op);
    tu_assert_error_contains("more than one element of the written-to tensor");
    tu_assert_error_contains("clone");
    ag_clear_error();
    tu_assert_close(base, (double[]){1, 2, 3}, 0);
    assert_int_equal(ag_tensor_version(base), v);
}

static void test_write_into_overlapping_tensor(void **st) {
    (void)st;
    ag_scope_begin();
    ag_tensor *base = tu_tensor(AG_F32, 2, (int64_t[]){1, 3}, (double[]){1, 2, 3});
    ag_tensor *e = ag_expand(base, 2, (int64_t[]){4, 3});
    ag_tensor *ones = ag_ones(AG_F32, 2, (int64_t[]){4, 3});
    uint64_t v = ag_tensor_version(base);
    expect_overlap_refused(ag_add_(e, ones, 1.0), "add_", base, v);
    expect_overlap_refused(ag_add_scalar_(e, 1.0), "add_", base, v);
    expect_overlap_refused(ag_mul_(e, ones), "mul_", base, v);
    expect_overlap_refused(ag_mul_scalar_(e, 2.0), "mul_", base, v);
    expect_overlap_refused(ag_copy_(e, ones), "copy_", base, v);
    expect_overlap_refused(ag_uniform_(e, 0, 1), "uniform_", base, v);
    expect_overlap_refused(ag_normal_(e, 0, 1), "normal_", base, v);
    ag_tensor *idx = tu_tensor(AG_I64, 1, (int64_t[]){1}, (double[]){0});
    expect_overlap_refused(
        ag_index_put_(e, (ag_tensor *[]){idx}, 1, ag_zeros(AG_F32, 1, (int64_t[]){3}), false),
        "index_put_", base, v);
    /* The message names the sizes and strides. */
    assert_null(ag_add_scalar_(e, 1.0));
    tu_assert_error_contains("sizes [4, 3], strides [0, 1]");
    ag_clear_error();

    /* Overlap without a zero stride: sizes [2, 2], strides [1, 1] reach element 1 twice. */
    ag_tensor *flat = tu_tensor(AG_F32, 1, (int64_t[]){3}, (double[]){1, 2, 3});
    ag_tensor *ov = ag_as_strided(flat, 2, (int64_t[]){2, 2}, (int64_t[]){1, 1}, 0);
    expect_overlap_refused(ag_add_scalar_(ov, 1.0), "add_", flat, ag_tensor_version(flat));
    /* A strided view whose elements are distinct is written as usual (sizes [2, 2], strides
     * [1, 2]: elements 0, 2, 1, 3 of a 4-vector, and a transposed matrix). */
    ag_tensor *four = tu_tensor(AG_F32, 1, (int64_t[]){4}, (double[]){1, 2, 3, 4});
    assert_non_null(
        ag_add_scalar_(ag_as_strided(four, 2, (int64_t[]){2, 2}, (int64_t[]){1, 2}, 0), 1.0));
    tu_assert_close(four, (double[]){2, 3, 4, 5}, 0);
    ag_tensor *m = tu_tensor(AG_F32, 2, (int64_t[]){2, 3}, (double[]){1, 2, 3, 4, 5, 6});
    assert_non_null(ag_mul_scalar_(ag_t(m), 2.0));
    tu_assert_close(m, (double[]){2, 4, 6, 8, 10, 12}, 0);

    /* fill_ and zero_ may write an expanded view; so may in-place view ops. */
    assert_non_null(ag_fill_(e, 7.0));
    tu_assert_close(base, (double[]){7, 7, 7}, 0);
    assert_non_null(ag_zero_(e));
    tu_assert_close(base, (double[]){0, 0, 0}, 0);
    assert_non_null(ag_t_(e));
    tu_assert_shape(e, 2, (int64_t[]){3, 4});
    assert_int_equal(ag_last_status(), 0);
    ag_scope_end();
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_shape_messages),
        cmocka_unit_test(test_data_dependent_messages),
        cmocka_unit_test(test_dtype_messages),
        cmocka_unit_test(test_module_messages),
        cmocka_unit_test(test_write_into_overlapping_tensor),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
