/* The gradcheck table: every differentiable op in the op table runs ag_gradcheck (float64 central
 * differences against the engine's analytical gradients) on each of its declared sample calls.
 * A differentiable op without a sample makes this test fail, so coverage cannot silently drop.
 * Also checks ag_gradcheck itself rejects a wrong backward rule. */
#include "testutil.h"
#include "core/internal.h"

static bool differentiable(const ag_op *op) {
    const ag_opdef *d = ag_op_def(op);
    return !(d->flags & AG_OP_NONDIFF);
}

static void test_every_differentiable_op(void **st) {
    (void)st;
    int nops = ag_op_count(), failures = 0, checked_ops = 0, cases = 0;
    for (int i = 0; i < nops; i++) {
        const ag_op *op = ag_op_at(i);
        if (!differentiable(op))
            continue;
        int n, f = tu_gradcheck_samples(op, &n);
        if (n == 0) {
            print_error("%s: differentiable but has no gradcheck sample\n", ag_op_name(op));
            failures++;
            continue;
        }
        checked_ops++;
        cases += n;
        failures += f;
    }
    print_message("gradcheck: %d ops, %d cases, %d failures\n", checked_ops, cases, failures);
    assert_int_equal(failures, 0);
    assert_true(checked_ops > 10);
}

/* A deliberately wrong rule: gradcheck must catch it. */
static int wrong_meta(const ag_arg *a, ag_tmeta *o) {
    ag__tmeta_contiguous(o, a[0].u.t->dtype, a[0].u.t->ndim, a[0].u.t->sizes);
    return 0;
}
static int wrong_kernel(const ag_arg *a, ag_tensor **o) {
    int64_t n = ag_tensor_numel(o[0]);
    for (int64_t i = 0; i < n; i++) {
        double x = ag__get_f64(a[0].u.t, i);
        ((double *)ag_tensor_data(o[0]))[i] = x * x;
    }
    return 0;
}
static int wrong_backward(ag_bwctx *c) {
    /* d(x^2)/dx is 2x; this returns x. */
    c->grad_inputs[0] = ag_mul(c->grad_outputs[0], c->args[0].u.t);
    return 0;
}
static const ag_opdef wrong_def = {
    .schema = "test::square(Tensor x) -> Tensor",
    .meta = wrong_meta,
    .kernel = wrong_kernel,
    .dtypes = 1u << AG_F64,
    .backward = wrong_backward,
    .save_args = 1,
};

static int call_wrong(void *ud, ag_tensor *const *in, int n, ag_tensor **outs, int *nouts) {
    (void)n;
    outs[0] = ag_op_call1((const ag_op *)ud, (ag_arg[]){AG_A_T(in[0])}, 1);
    *nouts = 1;
    return outs[0] ? 0 : ag_last_status();
}

static void test_gradcheck_catches_wrong_rule(void **st) {
    (void)st;
    const ag_op *op = ag_op_find("test::square");
    if (!op)
        op = ag_op_register(&wrong_def);
    assert_non_null(op);
    ag_scope_begin();
    ag_tensor *x = tu_tensor(AG_F64, 1, (int64_t[]){3}, (double[]){0.5, -1.0, 2.0});
    ag_tensor_set_requires_grad(x, true);
    assert_int_equal(ag_gradcheck(call_wrong, (void *)op, &x, 1, NULL), AG_EINVAL);
    tu_assert_error_contains("analytical");
    ag_scope_end();
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_differentiable_op),
        cmocka_unit_test(test_gradcheck_catches_wrong_rule),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
