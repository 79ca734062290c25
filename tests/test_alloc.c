/* Allocation failure injection (Lua's EMERGENCYGCTESTS / SQLite's OOM tests): every scenario is
 * run again and again with the N-th allocation failing, for N = 1, 2, ... until a run completes
 * without reaching N (tu_alloc_failure_sweep). Each failing run must report AG_ENOMEM (no
 * crash), and once everything is released the number of live allocations must be back where it
 * started: nothing leaked. */
#include "testutil.h"

/* Forward and backward of a small two-layer network with views, broadcasting, in-place ops
 * and a reduction, all inside a scope. */
static int scenario_mlp(void *ud) {
    (void)ud;
    int rc = 0;
    ag_scope_begin();
    int64_t xs[] = {4, 3}, ws[] = {5, 3}, bs[] = {5}, w2s[] = {2, 5};
    ag_tensor *x = ag_ones(AG_F32, 2, xs);
    ag_tensor *w = ag_full(AG_F32, 2, ws, 0.1);
    ag_tensor *b = ag_zeros(AG_F32, 1, bs);
    ag_tensor *w2 = ag_full(AG_F32, 2, w2s, -0.2);
    if (!x || !w || !b || !w2) {
        rc = ag_last_status();
        goto out;
    }
    ag_tensor_set_requires_grad(w, true);
    ag_tensor_set_requires_grad(b, true);
    ag_tensor_set_requires_grad(w2, true);
    ag_tensor *h = ag_relu(ag_add(ag_mm(x, ag_t(w)), b));
    ag_tensor *o = ag_mm(h, ag_transpose(w2, 0, 1));
    ag_tensor *loss = ag_mean_all(ag_mul(o, o));
    if (!loss) {
        rc = ag_last_status();
        goto out;
    }
    rc = ag_backward(loss, NULL, false);
    if (rc == 0 && (!ag_tensor_grad(w) || !ag_tensor_grad(w2)))
        rc = -99;
out:
    ag_scope_end();
    return rc;
}

static void test_alloc_failures_mlp(void **st) {
    (void)st;
    tu_sweep_opts o = {.what = "mlp"};
    int64_t points = tu_alloc_failure_sweep(scenario_mlp, NULL, &o);
    print_message("mlp scenario: %lld allocation points exercised\n", (long long)points);
    assert_true(points >= 50);
}

/* Tensors outside scopes are owned by the caller: explicit frees, views, a composite op
 * (reshape of a transposed view copies through its own internal scope). */
static int scenario_owned(void *ud) {
    (void)ud;
    int64_t s[] = {3, 4};
    ag_tensor *a = ag_rand(AG_F64, 2, s);
    if (!a)
        return ag_last_status();
    ag_tensor *t = ag_t(a);
    ag_tensor *c = t ? ag_reshape(t, 1, (int64_t[]){12}) : NULL;
    int rc = c ? 0 : ag_last_status();
    ag_tensor_free(c);
    ag_tensor_free(t);
    ag_tensor_free(a);
    return rc;
}

static void test_alloc_failures_owned(void **st) {
    (void)st;
    tu_sweep_opts o = {.what = "owned"};
    assert_true(tu_alloc_failure_sweep(scenario_owned, NULL, &o) >= 5);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_alloc_failures_mlp),
        cmocka_unit_test(test_alloc_failures_owned),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
