/* The eager autograd engine: accumulation, broadcasting reduction, execution order by seq_nr,
 * retain_graph, version checks on saved tensors, grad mode, ag_grad. */
#include "testutil.h"
#include "core/internal.h"

#include <string.h>

static void test_chain_rule_values(void **st) {
    (void)st;
    ag_scope_begin();
    /* y = sum(x * w + b), x [2,3], w [3] broadcast, b scalar-like [1]. */
    ag_tensor *x = tu_tensor(AG_F64, 2, (int64_t[]){2, 3}, (double[]){1, 2, 3, 4, 5, 6});
    ag_tensor *w = tu_tensor(AG_F64, 1, (int64_t[]){3}, (double[]){0.5, -1, 2});
    ag_tensor *b = tu_tensor(AG_F64, 1, (int64_t[]){1}, (double[]){3});
    ag_tensor_set_requires_grad(x, true);
    ag_tensor_set_requires_grad(w, true);
    ag_tensor_set_requires_grad(b, true);
    ag_tensor *y = ag_sum_all(ag_add(ag_mul(x, w), b));
    /* b broadcasts over all six elements: 4.5 + 9 + 6 * 3 */
    assert_true(ag_tensor_item(y) == (0.5 - 2 + 6) + (2 - 5 + 12) + 6 * 3);
    assert_int_equal(ag_backward(y, NULL, false), 0);
    /* dx = w broadcast; dw = column sums of x; db = number of elements. */
    tu_assert_values(ag_tensor_grad(x), 2, (int64_t[]){2, 3}, (double[]){0.5, -1, 2, 0.5, -1, 2},
                     0);
    tu_assert_values(ag_tensor_grad(w), 1, (int64_t[]){3}, (double[]){5, 7, 9}, 0);
    tu_assert_values(ag_tensor_grad(b), 1, (int64_t[]){1}, (double[]){6}, 0);
    ag_scope_end();
}

static void test_reuse_accumulates(void **st) {
    (void)st;
    ag_scope_begin();
    ag_tensor *x = tu_tensor(AG_F64, 1, (int64_t[]){3}, (double[]){1, -2, 3});
    ag_tensor_set_requires_grad(x, true);
    /* y = sum(x*x + x): dy/dx = 2x + 1 */
    ag_tensor *y = ag_sum_all(ag_add(ag_mul(x, x), x));
    assert_int_equal(ag_backward(y, NULL, true), 0);
    tu_assert_values(ag_tensor_grad(x), 1, (int64_t[]){3}, (double[]){3, -3, 7}, 0);
    /* A second backward (graph retained) accumulates into .grad. */
    assert_int_equal(ag_backward(y, NULL, false), 0);
    tu_assert_values(ag_tensor_grad(x), 1, (int64_t[]){3}, (double[]){6, -6, 14}, 0);
    /* A third fails: the saved tensors were freed. */
    assert_int_equal(ag_backward(y, NULL, false), AG_ESTATE);
    tu_assert_error_contains("backward through the graph a second time");
    ag_scope_end();
}

static void test_inplace_on_saved_tensor_is_detected(void **st) {
    (void)st;
    ag_scope_begin();
    ag_tensor *x = tu_tensor(AG_F32, 1, (int64_t[]){2}, (double[]){1, 2});
    ag_tensor_set_requires_grad(x, true);
    ag_tensor *a = ag_mul_scalar(x, 2.0);
    ag_tensor *b = ag_mul(a, a); /* saves a */
    assert_non_null(ag_add_scalar_(a, 1.0));
    assert_int_equal(ag_backward(ag_sum_all(b), NULL, false), AG_ESTATE);
    tu_assert_error_contains("modified by an inplace operation");
    tu_assert_error_contains("is at version 1; expected version 0");
    ag_scope_end();
}

static void test_inplace_history_rebase(void **st) {
    (void)st;
    ag_scope_begin();
    ag_tensor *x = tu_tensor(AG_F64, 1, (int64_t[]){2}, (double[]){1, 2});
    ag_tensor_set_requires_grad(x, true);
    ag_tensor *a = ag_mul_scalar(x, 3.0);
    assert_non_null(ag_mul_scalar_(a, 2.0)); /* a = 6x, history rebased onto mul_ */
    assert_int_equal(ag_backward(ag_sum_all(a), NULL, false), 0);
    tu_assert_values(ag_tensor_grad(x), 1, (int64_t[]){2}, (double[]){6, 6}, 0);
    /* In-place on a leaf that requires grad is refused while grad mode is on. */
    assert_null(ag_add_scalar_(x, 1.0));
    tu_assert_error_contains("leaf tensor that requires grad");
    bool prev = ag_set_grad_enabled(false);
    assert_non_null(ag_add_scalar_(x, 1.0));
    ag_set_grad_enabled(prev);
    assert_true(ag_tensor_item_at(x, 0) == 2.0);
    ag_scope_end();
}

static void test_no_grad_mode(void **st) {
    (void)st;
    ag_scope_begin();
    ag_tensor *x = tu_tensor(AG_F32, 1, (int64_t[]){2}, (double[]){1, 2});
    ag_tensor_set_requires_grad(x, true);
    bool prev = ag_set_grad_enabled(false);
    assert_true(prev);
    ag_tensor *y = ag_mul(x, x);
    assert_false(ag_tensor_requires_grad(y));
    assert_int_equal(ag_tensor_seq_nr(y), -1);
    ag_set_grad_enabled(true);
    ag_tensor *z = ag_mul(x, x);
    assert_true(ag_tensor_requires_grad(z));
    assert_string_equal(ag_tensor_grad_fn_name(z), "mul.Tensor");
    assert_int_equal(ag_backward(z, NULL, false), AG_EINVAL);
    tu_assert_error_contains("only for outputs with one element");
    assert_int_equal(ag_backward(y, NULL, false), AG_EINVAL);
    tu_assert_error_contains("does not require grad");
    /* Integer tensors cannot require grad. */
    ag_tensor *i = ag_zeros(AG_I64, 1, (int64_t[]){2});
    assert_int_equal(ag_tensor_set_requires_grad(i, true), AG_EINVAL);
    ag_scope_end();
}

/* An identity op whose backward logs an id, to observe the engine's execution order. */
static int order_log[16], order_n;
static int id_meta(const ag_arg *a, ag_tmeta *o) {
    ag__tmeta_contiguous(o, a[0].u.t->dtype, a[0].u.t->ndim, a[0].u.t->sizes);
    return 0;
}
static int id_kernel(const ag_arg *a, ag_tensor **o) {
    return ag__copy_into(o[0], a[0].u.t);
}
static int id_backward(ag_bwctx *c) {
    order_log[order_n++] = (int)c->args[1].u.i;
    c->grad_inputs[0] = c->grad_outputs[0];
    return 0;
}
static const ag_opdef id_def = {
    .schema = "test::logged_identity(Tensor x, int id) -> Tensor",
    .meta = id_meta,
    .kernel = id_kernel,
    .dtypes = AG_DT_FLOAT,
    .backward = id_backward,
};

static ag_tensor *logged(ag_tensor *x, int id) {
    const ag_op *op = ag_op_find("test::logged_identity");
    if (!op)
        op = ag_op_register(&id_def);
    return ag_op_call1(op, (ag_arg[]){AG_A_T(x), AG_A_I(id)}, 2);
}

static void test_order_highest_seq_nr_first(void **st) {
    (void)st;
    ag_scope_begin();
    ag_tensor *x = tu_tensor(AG_F64, 1, (int64_t[]){2}, (double[]){1, 2});
    ag_tensor_set_requires_grad(x, true);
    ag_tensor *a = logged(x, 1);
    ag_tensor *b = logged(x, 2);
    assert_true(ag_tensor_seq_nr(b) > ag_tensor_seq_nr(a));
    ag_tensor *c = logged(ag_add(a, b), 3);
    order_n = 0;
    assert_int_equal(ag_backward(ag_sum_all(c), NULL, false), 0);
    /* c's node first; then, both branches ready, the later one (b, higher seq_nr) first. */
    assert_int_equal(order_n, 3);
    assert_int_equal(order_log[0], 3);
    assert_int_equal(order_log[1], 2);
    assert_int_equal(order_log[2], 1);
    tu_assert_values(ag_tensor_grad(x), 1, (int64_t[]){2}, (double[]){2, 2}, 0);
    ag_scope_end();
}

static void test_grad_function(void **st) {
    (void)st;
    ag_scope_begin();
    ag_tensor *x = tu_tensor(AG_F64, 1, (int64_t[]){2}, (double[]){1, 2});
    ag_tensor *u = tu_tensor(AG_F64, 1, (int64_t[]){2}, (double[]){5, 5});
    ag_tensor_set_requires_grad(x, true);
    ag_tensor_set_requires_grad(u, true);
    ag_tensor *h = ag_mul_scalar(x, 3.0);    /* non-leaf */
    ag_tensor *y = ag_sum_all(ag_mul(h, h)); /* dy/dh = 2h = 6x, dy/dx = 18x */
    ag_tensor *ins[3] = {x, h, u}, *gr[3];
    assert_int_equal(ag_grad(&y, NULL, 1, ins, 3, gr, true, false), AG_EINVAL);
    tu_assert_error_contains("not have been used");
    assert_int_equal(ag_grad(&y, NULL, 1, ins, 3, gr, false, true), 0);
    tu_assert_values(gr[0], 1, (int64_t[]){2}, (double[]){18, 36}, 1e-12);
    tu_assert_values(gr[1], 1, (int64_t[]){2}, (double[]){6, 12}, 1e-12);
    assert_null(gr[2]);
    /* ag_grad leaves .grad untouched. */
    assert_null(ag_tensor_grad(x));
    ag_scope_end();
}

static void test_explicit_grad_output(void **st) {
    (void)st;
    ag_scope_begin();
    ag_tensor *x = tu_tensor(AG_F64, 2, (int64_t[]){2, 2}, (double[]){1, 2, 3, 4});
    ag_tensor_set_requires_grad(x, true);
    ag_tensor *y = ag_mul_scalar(x, 2.0);
    ag_tensor *g = tu_tensor(AG_F64, 2, (int64_t[]){2, 2}, (double[]){1, 0, -1, 0.5});
    assert_int_equal(ag_backward(y, g, false), 0);
    tu_assert_values(ag_tensor_grad(x), 2, (int64_t[]){2, 2}, (double[]){2, 0, -2, 1}, 0);
    ag_tensor *bad = ag_zeros(AG_F64, 1, (int64_t[]){4});
    ag_tensor *y2 = ag_mul_scalar(x, 2.0);
    assert_int_equal(ag_backward(y2, bad, false), AG_EINVAL);
    tu_assert_error_contains(
        "backward: Mismatch in shape: grad_output[0] has a shape of [4] and output[0] has a "
        "shape of [2, 2]");
    ag_scope_end();
}

/* A gradient of another dtype than its output (an integer or bool one above all) is refused,
 * as torch.autograd refuses it, and the refused call changes nothing: no .grad, and the graph
 * can still be run with a proper gradient. */
static void test_grad_output_dtype_and_shape(void **st) {
    (void)st;
    ag_scope_begin();
    ag_tensor *x = tu_tensor(AG_F32, 1, (int64_t[]){3}, (double[]){1, 2, 3});
    ag_tensor_set_requires_grad(x, true);
    ag_tensor *y = ag_mul(x, x); /* saves x */
    ag_tensor *gi = tu_tensor(AG_I64, 1, (int64_t[]){3}, (double[]){1, 1, 1});
    assert_int_equal(ag_backward(y, gi, false), AG_EINVAL);
    tu_assert_error_contains("backward: Mismatch in dtype: grad_output[0] has a dtype of int64 "
                             "and output[0] has a dtype of float32");
    tu_assert_error_contains("only floating point");
    ag_tensor *gb = ag_ones(AG_BOOL, 1, (int64_t[]){3});
    assert_int_equal(ag_backward(y, gb, false), AG_EINVAL);
    tu_assert_error_contains("grad_output[0] has a dtype of bool");
    ag_tensor *g64 = ag_ones(AG_F64, 1, (int64_t[]){3});
    assert_int_equal(ag_backward(y, g64, false), AG_EINVAL);
    tu_assert_error_contains("grad_output[0] has a dtype of float64 and output[0] has a dtype of "
                             "float32");
    assert_null(ag_tensor_grad(x));

    /* ag_grad: the second output's gradient is the bad one, then a wrong shape. */
    ag_tensor *z = ag_mul_scalar(x, 3.0);
    ag_tensor *outs[2] = {y, z}, *gr[1] = {x};
    ag_tensor *gf = ag_ones(AG_F32, 1, (int64_t[]){3});
    assert_int_equal(ag_grad(outs, (ag_tensor *[]){gf, gi}, 2, &x, 1, gr, true, false), AG_EINVAL);
    tu_assert_error_contains("grad: Mismatch in dtype: grad_output[1] has a dtype of int64 and "
                             "output[1] has a dtype of float32");
    assert_null(gr[0]);
    ag_tensor *g2 = ag_ones(AG_F32, 2, (int64_t[]){3, 1});
    assert_int_equal(ag_grad(outs, (ag_tensor *[]){gf, g2}, 2, &x, 1, gr, true, false), AG_EINVAL);
    tu_assert_error_contains("grad: Mismatch in shape: grad_output[1] has a shape of [3, 1] and "
                             "output[1] has a shape of [3]");
    ag_clear_error();

    /* Nothing was freed or accumulated by the refused calls. */
    assert_int_equal(ag_grad(outs, (ag_tensor *[]){gf, gf}, 2, &x, 1, gr, true, false), 0);
    tu_assert_values(gr[0], 1, (int64_t[]){3}, (double[]){2 + 3, 4 + 3, 6 + 3}, 0);
    assert_int_equal(ag_backward(y, gf, false), 0);
    tu_assert_values(ag_tensor_grad(x), 1, (int64_t[]){3}, (double[]){2, 4, 6}, 0);
    ag_scope_end();
}

/* set_grad refuses what PyTorch's .grad setter refuses: another dtype, another size, the
 * tensor itself; a refused call keeps the old gradient. */
static void test_set_grad_checks(void **st) {
    (void)st;
    ag_scope_begin();
    ag_tensor *p = ag_zeros(AG_F32, 2, (int64_t[]){2, 3});
    ag_tensor_set_requires_grad(p, true);
    ag_tensor *good = ag_ones(AG_F32, 2, (int64_t[]){2, 3});
    assert_int_equal(ag_tensor_set_grad(p, good), 0);
    assert_ptr_equal(ag_tensor_grad(p), good);

    assert_int_equal(ag_tensor_set_grad(p, ag_ones(AG_F64, 2, (int64_t[]){2, 3})), AG_EINVAL);
    tu_assert_error_contains("tensor_set_grad: assigned grad has data of a different type "
                             "(float64 for a tensor of float32)");
    assert_int_equal(ag_tensor_set_grad(p, ag_ones(AG_I64, 2, (int64_t[]){2, 3})), AG_EINVAL);
    tu_assert_error_contains("assigned grad has data of a different type");
    assert_int_equal(ag_tensor_set_grad(p, ag_ones(AG_F32, 2, (int64_t[]){3, 2})), AG_EINVAL);
    tu_assert_error_contains("tensor_set_grad: assigned grad has data of a different size "
                             "([3, 2] for a tensor of size [2, 3])");
    assert_int_equal(ag_tensor_set_grad(p, ag_ones(AG_F32, 1, (int64_t[]){6})), AG_EINVAL);
    tu_assert_error_contains("different size");
    assert_int_equal(ag_tensor_set_grad(p, p), AG_EINVAL);
    tu_assert_error_contains("own grad");
    assert_ptr_equal(ag_tensor_grad(p), good);

    /* A refused gradient never reaches the optimizer: backward accumulates into the old one. */
    ag_tensor *loss = ag_sum_all(ag_mul_scalar(p, 2.0));
    assert_int_equal(ag_backward(loss, NULL, false), 0);
    tu_assert_values(ag_tensor_grad(p), 2, (int64_t[]){2, 3}, (double[]){3, 3, 3, 3, 3, 3}, 0);
    assert_int_equal(ag_tensor_set_grad(p, NULL), 0);
    assert_null(ag_tensor_grad(p));
    ag_scope_end();
}

static void test_views_backward(void **st) {
    (void)st;
    ag_scope_begin();
    ag_tensor *x = tu_tensor(AG_F64, 2, (int64_t[]){2, 3}, (double[]){1, 2, 3, 4, 5, 6});
    ag_tensor_set_requires_grad(x, true);
    /* y = sum(t(x)[1:3] * [[1,2],[3,4]]) touches x[0,1],x[1,1],x[0,2],x[1,2]. */
    ag_tensor *w = tu_tensor(AG_F64, 2, (int64_t[]){2, 2}, (double[]){1, 2, 3, 4});
    ag_tensor *y = ag_sum_all(ag_mul(ag_slice(ag_t(x), 0, 1, 3, 1), w));
    assert_int_equal(ag_backward(y, NULL, false), 0);
    tu_assert_values(ag_tensor_grad(x), 2, (int64_t[]){2, 3}, (double[]){0, 1, 3, 0, 2, 4}, 0);
    ag_scope_end();
}

/* ---- in-place ops on views (CopySlices) ---- */

/* b = a * 1; then case 0: b[1].mul_(2); 1: b.t()[0].add_(x); 2: b[1:3][0].mul_(3); returns
 * (b * b).sum() (scope-owned), and b and the mutated view. */
static ag_tensor *cs_run(int kind, ag_tensor *a, ag_tensor *x, ag_tensor **bp, ag_tensor **vp) {
    ag_tensor *b = ag_mul_scalar(a, 1.0), *v = NULL, *r = NULL;
    if (kind == 0)
        r = ag_mul_scalar_(v = ag_select(b, 0, 1), 2.0);
    else if (kind == 1)
        r = ag_add_(v = ag_select(ag_t(b), 0, 0), x, 1.0);
    else
        r = ag_mul_scalar_(v = ag_select(ag_slice(b, 0, 1, 3, 1), 0, 0), 3.0);
    if (!r)
        fail_msg("in-place op on a view: %s", ag_last_error());
    *bp = b;
    *vp = v;
    return ag_sum_all(ag_mul(b, b));
}

/* Central finite differences of cs_run's loss with respect to t's elements (grad mode off). */
static void cs_fd(int kind, ag_tensor *a, ag_tensor *x, ag_tensor *t, double *out) {
    bool prev = ag_set_grad_enabled(false);
    double *d = ag_tensor_data(t);
    for (int64_t i = 0; i < ag_tensor_numel(t); i++) {
        double f[2], keep = d[i], eps = 1e-6;
        for (int s = 0; s < 2; s++) {
            d[i] = keep + (s ? -eps : eps);
            ag_tensor_bump_version(t);
            ag_scope_begin();
            ag_tensor *b, *v;
            f[s] = ag_tensor_item(cs_run(kind, a, x, &b, &v));
            ag_scope_end();
        }
        d[i] = keep;
        ag_tensor_bump_version(t);
        out[i] = (f[0] - f[1]) / (2 * eps);
    }
    ag_set_grad_enabled(prev);
}

static void test_inplace_on_view_gradients(void **st) {
    (void)st;
    double av[12];
    for (int i = 0; i < 12; i++)
        av[i] = 0.3 * i - 1.7 + 0.05 * i * i;
    for (int kind = 0; kind < 3; kind++) {
        ag_tensor *a = tu_leaf(AG_F64, 2, (int64_t[]){3, 4}, av);
        ag_tensor *x = tu_leaf(AG_F64, 1, (int64_t[]){3}, (double[]){0.5, -1.25, 2.0});
        ag_scope_begin();
        ag_tensor *b, *v;
        ag_tensor *loss = cs_run(kind, a, x, &b, &v);
        assert_string_equal(ag_tensor_grad_fn_name(b), "CopySlices");
        assert_string_equal(ag_tensor_grad_fn_name(v), "as_strided");
        assert_int_equal(ag_backward(loss, NULL, false), 0);
        ag_scope_end();
        double want[12];
        cs_fd(kind, a, x, a, want);
        tu_assert_close_named(ag_tensor_grad(a), want, 1e-6, "a.grad");
        if (kind == 1) {
            cs_fd(kind, a, x, x, want);
            tu_assert_close_named(ag_tensor_grad(x), want, 1e-6, "x.grad");
        } else {
            assert_null(ag_tensor_grad(x));
        }
        ag_tensor_free(a);
        ag_tensor_free(x);
    }
}

/* As PyTorch: a view of a leaf that requires grad may not be mutated in place (and the call
 * has no effect); with grad mode off it may. */
static void test_inplace_on_view_of_leaf_refused(void **st) {
    (void)st;
    ag_tensor *a = tu_leaf(AG_F64, 2, (int64_t[]){2, 2}, (double[]){1, 2, 3, 4});
    ag_scope_begin();
    ag_tensor *v = ag_select(a, 0, 1);
    uint64_t ver = ag_tensor_version(a);
    assert_null(ag_mul_scalar_(v, 2.0));
    tu_assert_error_contains("mul_.Scalar: a view of a leaf tensor that requires grad is being "
                             "used in an in-place operation");
    assert_int_equal(ag_tensor_version(a), ver);
    tu_assert_close(a, (double[]){1, 2, 3, 4}, 0);
    bool prev = ag_set_grad_enabled(false);
    assert_non_null(ag_mul_scalar_(v, 2.0));
    ag_set_grad_enabled(prev);
    tu_assert_close(a, (double[]){1, 2, 6, 8}, 0);
    ag_scope_end();
    ag_tensor_free(a);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_chain_rule_values),
        cmocka_unit_test(test_reuse_accumulates),
        cmocka_unit_test(test_inplace_on_saved_tensor_is_detected),
        cmocka_unit_test(test_inplace_history_rebase),
        cmocka_unit_test(test_no_grad_mode),
        cmocka_unit_test(test_order_highest_seq_nr_first),
        cmocka_unit_test(test_grad_function),
        cmocka_unit_test(test_explicit_grad_output),
        cmocka_unit_test(test_grad_output_dtype_and_shape),
        cmocka_unit_test(test_set_grad_checks),
        cmocka_unit_test(test_views_backward),
        cmocka_unit_test(test_inplace_on_view_gradients),
        cmocka_unit_test(test_inplace_on_view_of_leaf_refused),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
