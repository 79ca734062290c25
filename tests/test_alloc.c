/* Allocation failure injection (Lua's EMERGENCYGCTESTS / SQLite's OOM tests): every scenario is
 * run again and again with the N-th allocation failing, for N = 1, 2, ... until a run completes
 * without reaching N. Each failing run must report an error (no crash), and once everything is
 * released the number of live allocations must be back where it started: nothing leaked. */
#include "testutil.h"

#include <stdlib.h>
#include <string.h>

static int64_t live, count, fail_at;
static bool failed;

static void *counting_alloc(void *ud, size_t size, size_t align) {
    (void)ud;
    count++;
    if (fail_at && count == fail_at) {
        failed = true;
        return NULL;
    }
    size_t rounded = (size + align - 1) / align * align;
    void *p = aligned_alloc(align, rounded ? rounded : align);
    if (p)
        live++;
    return p;
}

static void counting_free(void *ud, void *p) {
    (void)ud;
    if (p)
        live--;
    free(p);
}

typedef int (*scenario_fn)(void);

/* Runs `fn` with the N-th allocation failing for every N; returns the number of runs. */
static int64_t run_with_failures(scenario_fn fn) {
    ag_allocator a = {counting_alloc, counting_free, NULL};
    ag_set_allocator(&a);
    /* One clean run first: the op registry and other process-wide tables are built on first use
     * and kept; they are not leaks. */
    fail_at = 0;
    assert_int_equal(fn(), 0);
    int64_t base = live;
    int64_t n;
    for (n = 1;; n++) {
        count = 0;
        fail_at = n;
        failed = false;
        ag_clear_error();
        int rc = fn();
        if (failed) {
            if (rc == 0) {
                print_error("allocation %lld failed but the scenario reported success\n", (long long)n);
                fail();
            }
            assert_int_equal(ag_last_status(), AG_ENOMEM);
        } else {
            assert_int_equal(rc, 0);
        }
        if (live != base) {
            print_error("allocation %lld failed: %lld allocations leaked\n", (long long)n,
                        (long long)(live - base));
            fail();
        }
        if (!failed)
            break;
    }
    fail_at = 0;
    ag_set_allocator(NULL);
    return n;
}

/* Forward and backward of a small two-layer network with views, broadcasting, in-place ops
 * and a reduction, all inside a scope. */
static int scenario_mlp(void) {
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
    int64_t runs = run_with_failures(scenario_mlp);
    print_message("mlp scenario: %lld allocation points exercised\n", (long long)runs - 1);
    assert_true(runs > 50);
}

/* Tensors outside scopes are owned by the caller: explicit frees, views, a composite op
 * (reshape of a transposed view copies through its own internal scope). */
static int scenario_owned(void) {
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
    assert_true(run_with_failures(scenario_owned) > 5);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_alloc_failures_mlp),
        cmocka_unit_test(test_alloc_failures_owned),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
