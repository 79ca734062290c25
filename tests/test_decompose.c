/* The decomposition pass: the core table turns addmm, t, softmax, log_softmax, layer norm,
 * silu and gelu(tanh) into primitive ops; the decomposed graph verifies, contains none of the
 * table's ops, keeps the replaced nodes' metadata, and computes the same values. */
#include "testutil.h"

#include <math.h>
#include <string.h>

/* y = log_softmax(gelu_tanh(layer_norm(linear(x))) + silu(x2)) and softmax of the same. */
static int model(void *ud, ag_tensor *const *in, int n, ag_tensor **out, int max_out) {
    (void)ud;
    (void)n;
    (void)max_out;
    ag_tensor *x = in[0], *w = in[1], *b = in[2], *lw = in[3], *lb = in[4];
    ag_annotate_begin("stage", (ag_mval){.kind = AG_MV_INT, .u.i = 7});
    ag_tensor *h = ag_linear(x, w, b); /* t + addmm */
    ag_annotate_end();
    h = ag_layer_norm(h, 1, (int64_t[]){4}, lw, lb, 1e-5);
    ag_tensor *g = ag_gelu(h, "tanh"); /* traced before silu on every compiler */
    h = ag_add(g, ag_silu(h));
    out[0] = ag_log_softmax(h, 1);
    out[1] = ag_softmax(h, -1);
    out[2] = ag_gelu(h, "none"); /* stays whole: no erf in the table */
    return 3;
}

static int count_op(const ag_graph *g, const char *name) {
    int c = 0;
    for (ag_node *n = ag_graph_first(g); n; n = ag_node_next(n))
        if (ag_node_kind_of(n) == AG_NODE_CALL && !strcmp(ag_op_name(ag_node_op(n)), name))
            c++;
    return c;
}

static void test_core_decomposition(void **st) {
    (void)st;
    ag_manual_seed(3);
    ag_scope_begin();
    ag_tensor *in[5] = {
        ag_randn(AG_F64, 2, (int64_t[]){5, 3}), ag_randn(AG_F64, 2, (int64_t[]){4, 3}),
        ag_randn(AG_F64, 1, (int64_t[]){4}),    ag_randn(AG_F64, 1, (int64_t[]){4}),
        ag_randn(AG_F64, 1, (int64_t[]){4}),
    };
    ag_graph *g = ag_trace(model, NULL, in, 5, NULL, NULL, NULL);
    assert_non_null(g);
    assert_int_equal(ag_graph_verify(g), 0);
    assert_int_equal(count_op(g, "addmm"), 1);
    assert_int_equal(count_op(g, "native_layer_norm"), 1);
    assert_int_equal(count_op(g, "gelu"), 2);

    ag_graph *d = ag_graph_copy(g);
    ag_decomp_table *core = ag_decomp_table_core();
    int replaced = ag_graph_decompose(d, core);
    /* t, addmm, native_layer_norm, gelu(tanh), silu, _log_softmax, _softmax */
    assert_int_equal(replaced, 7);
    assert_int_equal(ag_graph_dce(d) >= 0, 1);
    assert_int_equal(ag_graph_verify(d), 0);
    const char *gone[] = {"t", "addmm", "native_layer_norm", "silu", "_softmax", "_log_softmax"};
    for (size_t i = 0; i < sizeof gone / sizeof gone[0]; i++)
        assert_int_equal(count_op(d, gone[i]), 0);
    assert_int_equal(count_op(d, "gelu"), 1); /* the 'none' one */
    assert_true(count_op(d, "mm") == 1 && count_op(d, "transpose.int") == 1);
    /* The nodes that replaced the annotated linear keep its annotation. */
    ag_node *mm = NULL;
    for (ag_node *n = ag_graph_first(d); n; n = ag_node_next(n))
        if (ag_node_kind_of(n) == AG_NODE_CALL && !strcmp(ag_op_name(ag_node_op(n)), "mm"))
            mm = n;
    assert_non_null(mm);
    ag_mval v = ag_node_custom_get(mm, "stage");
    assert_int_equal(v.kind, AG_MV_INT);
    assert_int_equal(v.u.i, 7);

    /* Same values through the interpreter. */
    ag_tensor *o1[3], *o2[3];
    assert_int_equal(ag_graph_run(g, in, 5, o1, 3), 3);
    assert_int_equal(ag_graph_run(d, in, 5, o2, 3), 3);
    for (int k = 0; k < 3; k++)
        assert_true(tu_max_abs_diff(o1[k], o2[k]) < 1e-12);
    ag_decomp_table_free(core);
    ag_graph_free(d);
    ag_graph_free(g);
    ag_scope_end();
}

/* A user table: replace relu by max(x, 0) written as where(x > 0, x, 0). */
static int relu_as_where(const ag_arg *a, ag_tensor **o) {
    ag_tensor *x = a[0].u.t;
    ag_tensor *pos = ag_gt_scalar(x, 0.0); /* traced before zeros_like on every compiler */
    o[0] = ag_where(pos, x, ag_zeros_like(x));
    return o[0] ? 0 : ag_last_status();
}

static int relu_model(void *ud, ag_tensor *const *in, int n, ag_tensor **out, int max_out) {
    (void)ud;
    (void)n;
    (void)max_out;
    out[0] = ag_relu(ag_relu(in[0]));
    return 1;
}

static void test_user_table(void **st) {
    (void)st;
    ag_scope_begin();
    ag_tensor *x = tu_tensor(AG_F32, 1, (int64_t[]){4}, (double[]){-1, 2, -3, 4});
    ag_graph *g = ag_trace(relu_model, NULL, &x, 1, NULL, NULL, NULL);
    assert_non_null(g);
    ag_decomp_table *t = ag_decomp_table_new();
    assert_int_equal(ag_decomp_table_add(t, ag_op_find("relu"), relu_as_where), 0);
    assert_int_equal(ag_graph_decompose(g, t), 2);
    assert_int_equal(count_op(g, "relu"), 0);
    assert_int_equal(count_op(g, "where.self"), 2);
    assert_int_equal(ag_graph_verify(g), 0);
    ag_tensor *out;
    assert_int_equal(ag_graph_run(g, &x, 1, &out, 1), 1);
    tu_assert_values(out, 1, (int64_t[]){4}, (double[]){0, 2, 0, 4}, 0);
    ag_decomp_table_free(t);
    ag_graph_free(g);
    ag_scope_end();
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_core_decomposition),
        cmocka_unit_test(test_user_table),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
