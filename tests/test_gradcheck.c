/* The gradcheck table: every differentiable op in the op table runs ag_gradcheck (float64 central
 * differences against the engine's analytical gradients) on each of its declared sample calls.
 * A differentiable op without a sample makes this test fail, so coverage cannot silently drop.
 * Also checks ag_gradcheck itself rejects a wrong backward rule. */
#include "testutil.h"
#include "autograd/samples.h"
#include "core/internal.h"

#include <stdio.h>
#include <string.h>

typedef struct {
    const ag_op *op;
    ag__sample *c;
} case_ud;

/* Calls the op on the sample's arguments; the gradcheck inputs are the sample's own tensors
 * (perturbed in place by gradcheck), so the arguments can be passed as they are. */
static int call_case(void *ud, ag_tensor *const *in, int n, ag_tensor **outs, int *nouts) {
    (void)in;
    (void)n;
    case_ud *u = ud;
    ag_tensor *tmp[AG_MAX_OUTPUTS] = {0};
    ag_arg args[AG_MAX_ARGS];
    memcpy(args, u->c->args, sizeof(ag_arg) * (size_t)u->c->nargs);
    /* An in-place op is checked on a clone of self, as PyTorch checks x.clone().add_(y): the
     * sample keeps its values across evaluations and gradients reach self through clone. */
    if (ag_op_def(u->op)->flags & AG_OP_INPLACE)
        args[0].u.t = ag_clone(args[0].u.t);
    int rc = ag_op_call(u->op, args, u->c->nargs, tmp);
    if (rc < 0)
        return rc;
    int cnt = ag_op_noutputs(u->op) < 0 ? rc : ag_op_noutputs(u->op);
    uint32_t nd = ag_op_def(u->op)->nondiff_outputs;
    *nouts = 0;
    for (int k = 0; k < cnt && k < AG_GRADCHECK_MAX_OUT; k++)
        outs[(*nouts)++] = ((nd >> k) & 1) ? NULL : tmp[k];
    return 0;
}

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
        ag__sample *items;
        int n;
        assert_int_equal(ag__samples_collect(op, &items, &n), 0);
        if (n == 0) {
            print_error("%s: differentiable but has no gradcheck sample\n", ag_op_name(op));
            failures++;
            continue;
        }
        checked_ops++;
        for (int c = 0; c < n; c++) {
            case_ud u = {op, &items[c]};
            ag_tensor *inputs[64];
            int ni = 0;
            for (int a = 0; a < items[c].nargs; a++) {
                if (items[c].args[a].kind == AG_ARG_TENSOR && items[c].args[a].u.t)
                    inputs[ni++] = items[c].args[a].u.t;
                else if (items[c].args[a].kind == AG_ARG_TENSORS)
                    for (int k = 0; k < items[c].args[a].n; k++)
                        if (items[c].args[a].u.ts[k])
                            inputs[ni++] = items[c].args[a].u.ts[k];
            }
            ag_manual_seed(42);
            ag_clear_error();
            int rc = ag_gradcheck(call_case, &u, inputs, ni, NULL);
            cases++;
            if (rc) {
                print_error("%s [%s]: %s\n", ag_op_name(op), items[c].note, ag_last_error());
                failures++;
            }
        }
        ag__samples_free(items, n);
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
