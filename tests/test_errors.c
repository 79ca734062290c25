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
    expect(ag_bmm(ag_zeros(AG_F32, 3, (int64_t[]){2, 4, 3}), ag_zeros(AG_F32, 3, (int64_t[]){3, 3, 5})),
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

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_shape_messages),
        cmocka_unit_test(test_data_dependent_messages),
        cmocka_unit_test(test_dtype_messages),
        cmocka_unit_test(test_module_messages),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
