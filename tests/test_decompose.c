/* The decomposition pass: the core table turns addmm, t, softmax, log_softmax, layer norm,
 * silu and gelu(tanh) into primitive ops; the decomposed graph verifies, contains none of the
 * table's ops, keeps the replaced nodes' metadata, and computes the same values. The
 * decompositions the sharding pass uses (batch norm's forward and backward, nll_loss_forward)
 * match their kernels in float64 on several shapes and variants, and ag_graph_decompose_node
 * replaces one node, or leaves the graph as it was when there is no decomposition. */
#include "testutil.h"

#include <math.h>
#include <stdio.h>
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

/* ---- decompositions against kernels (float64) ---- */

static uint64_t rng = 11;

static ag_tensor *rnd(int ndim, const int64_t *sizes, double lo, double hi) {
    return tu_rand_tensor(AG_F64, ndim, sizes, lo, hi, tu_xorshift, &rng);
}

/* Runs op's kernel and its decomposition on the same (schema-complete) arguments and checks
 * the nout outputs agree within tol (relative to the kernel's largest magnitude); empty
 * outputs (masked out) must be empty in both. */
static void kernel_vs_decomp(const char *name, const ag_arg *args, int nargs, int nout,
                             const char *what) {
    const ag_op *op = ag_op_find(name);
    assert_non_null(op);
    const ag_opdef *def = ag_op_def(op);
    assert_non_null(def->decomp);
    assert_false(def->flags & AG_OP_COMPOSITE); /* eager calls keep the kernel */
    ag_scope_begin();
    ag_tensor *k[8] = {0}, *d[8] = {0};
    assert_int_equal(ag_op_call(op, args, nargs, k), 0);
    int rc = def->decomp(args, d);
    if (rc)
        fail_msg("%s (%s): decomposition failed: %s", name, what, ag_last_error());
    for (int i = 0; i < nout; i++) {
        assert_non_null(d[i]);
        if (ag_tensor_numel(k[i]) == 0) {
            assert_int_equal(ag_tensor_numel(d[i]), 0);
            continue;
        }
        assert_int_equal(ag_tensor_ndim(d[i]), ag_tensor_ndim(k[i]));
        for (int j = 0; j < ag_tensor_ndim(k[i]); j++)
            assert_int_equal(ag_tensor_sizes(d[i])[j], ag_tensor_sizes(k[i])[j]);
        double scale = 1;
        for (int64_t e = 0; e < ag_tensor_numel(k[i]); e++)
            scale = fmax(scale, fabs(ag_tensor_item_at(k[i], e)));
        double diff = tu_max_abs_diff(k[i], d[i]);
        if (!(diff <= 1e-12 * scale))
            fail_msg("%s (%s): output %d differs from the kernel by %g", name, what, i, diff);
    }
    ag_scope_end();
}

static void test_batch_norm_decomposition(void **st) {
    (void)st;
    const struct {
        int ndim;
        int64_t sizes[4];
        bool affine, strided;
    } cases[] = {
        {2, {6, 3}, true, false},
        {3, {4, 3, 5}, false, false},
        {4, {2, 3, 4, 5}, true, true},
        {4, {3, 2, 1, 1}, true, false},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        ag_scope_begin();
        const int64_t *sz = cases[c].sizes, C = sz[1];
        ag_tensor *x = rnd(cases[c].ndim, sz, -2, 3);
        if (cases[c].strided) { /* the same values through a transposed layout */
            int64_t tsz[4] = {sz[0], sz[1], sz[3], sz[2]};
            x = ag_transpose(rnd(4, tsz, -2, 3), 2, 3);
        }
        ag_tensor *w = cases[c].affine ? rnd(1, &C, 0.5, 1.5) : NULL;
        ag_tensor *b = cases[c].affine ? rnd(1, &C, -1, 1) : NULL;
        ag_tensor *rm = rnd(1, &C, -0.5, 0.5), *rv = rnd(1, &C, 0.5, 1.5);
        for (int train = 1; train >= 0; train--) {
            char what[96];
            snprintf(what, sizeof what, "case %zu, %s", c, train ? "training" : "evaluation");
            ag_arg fa[] = {AG_A_T(x),  AG_A_T(w),     AG_A_T(b),   AG_A_T(rm),
                           AG_A_T(rv), AG_A_B(train), AG_A_F(0.3), AG_A_F(1e-3)};
            kernel_vs_decomp("_native_batch_norm_legit_functional", fa, 8, 5, what);
            /* The backward, from the forward's statistics, for every output mask; in
             * evaluation also from the running statistics (ATen's signature). */
            ag_tensor *fo[5];
            assert_int_equal(
                ag_op_call(ag_op_find("_native_batch_norm_legit_functional"), fa, 8, fo), 0);
            ag_tensor *g = rnd(ag_tensor_ndim(x), ag_tensor_sizes(x), -1, 1);
            for (int m = 1; m < 8; m++) {
                int64_t mask[3] = {m & 1, (m >> 1) & 1, (m >> 2) & 1};
                for (int running = 0; running <= !train; running++) {
                    ag_arg ba[] = {AG_A_T(g),
                                   AG_A_T(x),
                                   AG_A_T(w),
                                   AG_A_T(running ? rm : NULL),
                                   AG_A_T(running ? rv : NULL),
                                   AG_A_T(fo[1]),
                                   AG_A_T(fo[2]),
                                   AG_A_B(train),
                                   AG_A_F(1e-3),
                                   AG_A_INTS(mask, 3)};
                    char bw[128];
                    snprintf(bw, sizeof bw, "%s, mask %d%s", what, m,
                             running ? ", running stats" : "");
                    kernel_vs_decomp("native_batch_norm_backward", ba, 10, 3, bw);
                }
            }
        }
        ag_scope_end();
    }
}

static void test_nll_loss_decomposition(void **st) {
    (void)st;
    const int64_t n5 = 5, c4 = 4;
    ag_scope_begin();
    ag_tensor *x = rnd(2, (int64_t[]){5, 4}, -4, 0);
    ag_tensor *xt = ag_transpose(rnd(2, (int64_t[]){4, 5}, -4, 0), 0, 1); /* strided */
    ag_tensor *w = rnd(1, &c4, 0.5, 2);
    ag_tensor *t_plain = ag_from_data(AG_I64, 1, &n5, (int64_t[]){3, 0, 1, 3, 2});
    ag_tensor *t_ign = ag_from_data(AG_I64, 1, &n5, (int64_t[]){3, -100, 1, -100, 0});
    ag_tensor *t_ign7 = ag_from_data(AG_I64, 1, &n5, (int64_t[]){2, 7, 7, 1, 2});
    ag_tensor *x1 = rnd(1, &c4, -4, 0), *t0 = ag_from_data(AG_I64, 0, NULL, (int64_t[]){2});
    const struct {
        ag_tensor *x, *t, *w;
        int64_t ignore;
    } cases[] =
        {
            {x, t_plain, NULL, -100}, {x, t_ign, NULL, -100}, {x, t_ign, w, -100},
            {xt, t_ign7, w, 7},       {xt, t_plain, w, 3},    {x1, t0, w, -100},
            {x1, t0, NULL, 2}, /* the only target ignored */
        };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++)
        for (int64_t red = 0; red <= 2; red++) {
            /* All targets ignored with mean is 0 / 0 in both: NaN, not comparable. */
            if (c == 6 && red == AG_REDUCTION_MEAN)
                continue;
            char what[64];
            snprintf(what, sizeof what, "case %zu, reduction %lld", c, (long long)red);
            ag_arg a[] = {AG_A_T(cases[c].x), AG_A_T(cases[c].t), AG_A_T(cases[c].w), AG_A_I(red),
                          AG_A_I(cases[c].ignore)};
            kernel_vs_decomp("nll_loss_forward", a, 5, 2, what);
        }
    /* Every target ignored, mean: NaN from both. */
    ag_tensor *k[2], *d[2];
    ag_arg a[] = {AG_A_T(x1), AG_A_T(t0), AG_A_NONE, AG_A_I(AG_REDUCTION_MEAN), AG_A_I(2)};
    assert_int_equal(ag_op_call(ag_op_find("nll_loss_forward"), a, 5, k), 0);
    assert_int_equal(ag_op_def(ag_op_find("nll_loss_forward"))->decomp(a, d), 0);
    assert_true(isnan(ag_tensor_item_at(k[0], 0)) && isnan(ag_tensor_item_at(d[0], 0)));
    assert_true(ag_tensor_item_at(d[1], 0) == 0);
    ag_scope_end();
}

/* Two nll losses and a batch norm on an empty batch, traced. */
static int losses(void *ud, ag_tensor *const *in, int n, ag_tensor **out, int max_out) {
    (void)ud;
    (void)n;
    (void)max_out;
    out[0] = ag_nll_loss(in[0], in[1], AG_REDUCTION_MEAN, -100);
    out[1] = ag_nll_loss(in[0], in[1], AG_REDUCTION_SUM, -100);
    ag_tensor *r[5] = {0};
    int64_t c3 = 3;
    ag_op_call(ag_op_find("_native_batch_norm_legit_functional"),
               (ag_arg[]){AG_A_T(in[2]), AG_A_NONE, AG_A_NONE, AG_A_T(ag_zeros(AG_F64, 1, &c3)),
                          AG_A_T(ag_ones(AG_F64, 1, &c3)), AG_A_B(true), AG_A_F(0.1), AG_A_F(1e-5)},
               8, r);
    out[2] = r[3];
    return 3;
}

static void test_decompose_node(void **st) {
    (void)st;
    ag_scope_begin();
    ag_tensor *in[3] = {rnd(2, (int64_t[]){4, 3}, -3, 0),
                        ag_from_data(AG_I64, 1, (int64_t[]){4}, (int64_t[]){2, -100, 1, 0}),
                        ag_zeros(AG_F64, 2, (int64_t[]){0, 3})};
    ag_graph *g = ag_trace(losses, NULL, in, 3, NULL, NULL, NULL);
    assert_non_null(g);
    assert_int_equal(count_op(g, "nll_loss_forward"), 2);
    ag_node *first = NULL, *bn = NULL;
    for (ag_node *n = ag_graph_first(g); n; n = ag_node_next(n)) {
        if (!first && ag_node_kind_of(n) == AG_NODE_CALL &&
            !strcmp(ag_op_name(ag_node_op(n)), "nll_loss_forward"))
            first = n;
        if (ag_node_kind_of(n) == AG_NODE_CALL &&
            !strcmp(ag_op_name(ag_node_op(n)), "_native_batch_norm_legit_functional"))
            bn = n;
    }
    assert_non_null(first);
    assert_non_null(bn);
    assert_int_equal(ag_node_set_seq_nr(first, 41), 0);
    ag_tensor *o1[3], *o2[3];
    if (ag_graph_run(g, in, 3, o1, 3) != 3)
        fail_msg("run: %s", ag_last_error());

    /* No decomposition for an empty batch: refused, the graph as it was. */
    char *before = ag_graph_to_string(g, NULL);
    assert_int_equal(ag_graph_decompose_node(g, bn, ag_op_def(ag_node_op(bn))->decomp), AG_ENOTSUP);
    tu_assert_error_contains("empty batch");
    char *after = ag_graph_to_string(g, NULL);
    assert_string_equal(before, after);
    ag_free(before);
    ag_free(after);

    /* One node only: the first loss; its pieces carry its seq_nr. */
    assert_int_equal(ag_graph_decompose_node(g, first, ag_op_def(ag_node_op(first))->decomp), 0);
    assert_int_equal(count_op(g, "nll_loss_forward"), 1);
    assert_int_equal(count_op(g, "gather"), 1);
    for (ag_node *n = ag_graph_first(g); n; n = ag_node_next(n))
        if (ag_node_kind_of(n) == AG_NODE_CALL && !strcmp(ag_op_name(ag_node_op(n)), "gather"))
            assert_int_equal(ag_node_seq_nr(n), 41);
    assert_int_equal(ag_graph_verify(g), 0);
    assert_int_equal(ag_graph_run(g, in, 3, o2, 3), 3);
    for (int k = 0; k < 3; k++)
        assert_true(tu_max_abs_diff(o1[k], o2[k]) < 1e-12);
    /* Not a call node of g. */
    assert_int_equal(
        ag_graph_decompose_node(g, ag_graph_first(g), ag_op_def(ag_node_op(bn))->decomp),
        AG_EINVAL);
    tu_assert_error_contains("graph_decompose_node");
    ag_graph_free(g);
    ag_scope_end();
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_core_decomposition),
        cmocka_unit_test(test_user_table),
        cmocka_unit_test(test_batch_norm_decomposition),
        cmocka_unit_test(test_nll_loss_decomposition),
        cmocka_unit_test(test_decompose_node),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
