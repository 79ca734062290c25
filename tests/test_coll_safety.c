/* Eager collectives used carelessly, under mpirun (CTest runs it on 2 ranks; run plainly it is a
 * world of size 1 where every collective completes at once):
 *   - an output freed before its wait_tensor: the pending collective keeps the output's memory
 *     until it completes, so tensors allocated and filled meanwhile keep their values, and
 *     nothing leaks (the ASan build checks both);
 *   - an output read before its wait_tensor (by an op, through a view, in place, by another
 *     collective, by ag_tensor_item_at or ag_tensor_data): the read waits for the result, as
 *     PyTorch's AsyncCollectiveTensor does on first use.
 * Rank 0 starts its collectives at once; the other ranks join them late (a sleep), so rank 0's
 * results are still on their way when it reads them or frees them. */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "testutil.h"

static int R, N;
static bool completed, failed;

static int setup(void **st) {
    (void)st;
    if (failed && N > 1)
        ag_dist_abort(1, "test_coll_safety: a test failed on this rank (see above)");
    completed = false;
    return 0;
}
static int teardown(void **st) {
    (void)st;
    failed |= !completed;
    return 0;
}

/* Ranks other than 0 join late. */
static void late(void) {
    if (R != 0) {
        struct timespec ts = {0, 150 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
}

/* x[i] = (r + 1) * (i + 1): the sum over ranks is S(N) * (i + 1) with S(N) = N(N+1)/2. */
static ag_tensor *rank_tensor(int64_t n) {
    ag_tensor *t = ag_empty(AG_F32, 1, (int64_t[]){n});
    float *d = ag_tensor_data(t);
    for (int64_t i = 0; i < n; i++)
        d[i] = (float)((R + 1) * (i + 1));
    return t;
}

static double sum_at(int64_t i) {
    return (double)N * (N + 1) / 2 * (double)(i + 1);
}

static void assert_sum(ag_tensor *t, int64_t n, double scale, const char *what) {
    for (int64_t i = 0; i < n; i += 7)
        tu_assert_near(ag_tensor_item_at(t, i), scale * sum_at(i), 1e-3, what, i);
}

/* Read by an op before the wait: the add sees the reduced values. */
static void test_op_reads_pending_output(void **st) {
    (void)st;
    const int64_t n = 4096;
    ag_scope_begin();
    late();
    ag_tensor *y = ag_all_reduce(rank_tensor(n), "sum", "0");
    assert_non_null(y);
    ag_tensor *z = ag_add_scalar(y, 1.0);
    for (int64_t i = 0; i < n; i += 7)
        tu_assert_near(ag_tensor_item_at(z, i), sum_at(i) + 1, 1e-3, "add before wait", i);
    /* The wait after the automatic one returns the same values. */
    assert_sum(ag_wait_tensor(y), n, 1.0, "wait after use");
    ag_scope_end();
    completed = true;
}

/* Through a view (another data pointer, the same storage), in place, and as the input of
 * another collective; avg divides exactly once. */
static void test_views_inplace_and_chains(void **st) {
    (void)st;
    const int64_t n = 1024;
    ag_scope_begin();
    late();
    ag_tensor *a = ag_all_reduce(rank_tensor(n), "avg", "0");
    ag_tensor *b = ag_all_reduce(rank_tensor(n), "sum", "0");
    ag_tensor *c = ag_all_reduce(rank_tensor(n), "sum", "0");
    assert_non_null(a);
    assert_non_null(b);
    assert_non_null(c);
    /* a: the second half, through a slice, doubled. */
    ag_tensor *half = ag_mul_scalar(ag_slice(a, 0, n / 2, n, 1), 2.0);
    for (int64_t i = 0; i < n / 2; i += 5)
        tu_assert_near(ag_tensor_item_at(half, i), 2.0 * sum_at(n / 2 + i) / N, 1e-3,
                       "slice of avg", i);
    /* b: mutated in place before any wait. */
    assert_non_null(ag_add_scalar_(b, 0.5));
    for (int64_t i = 0; i < n; i += 5)
        tu_assert_near(ag_tensor_item_at(b, i), sum_at(i) + 0.5, 1e-3, "in place", i);
    /* c: reduced again (its staging copy must read the first result). */
    ag_tensor *cc = ag_wait_tensor(ag_all_reduce(c, "sum", "0"));
    assert_sum(cc, n, (double)N, "chained all_reduce");
    /* The waits now are no-ops on completed values: avg still divided once. */
    assert_sum(ag_wait_tensor(a), n, 1.0 / N, "avg waited late");
    ag_scope_end();
    completed = true;
}

/* Read through core's accessors: item_at and the data pointer. */
static void test_item_and_data_wait(void **st) {
    (void)st;
    const int64_t n = 512;
    ag_scope_begin();
    late();
    ag_tensor *y = ag_all_reduce(rank_tensor(n), "sum", "0");
    tu_assert_near(ag_tensor_item_at(y, n - 1), sum_at(n - 1), 1e-3, "item_at", n - 1);
    late();
    ag_tensor *g = ag_all_gather_into_tensor(rank_tensor(n), N, "0");
    const float *d = ag_tensor_data(g);
    for (int r = 0; r < N; r++)
        for (int64_t i = 0; i < n; i += 11)
            tu_assert_near(d[r * n + i], (double)(r + 1) * (double)(i + 1), 0, "data", i);
    ag_scope_end();
    completed = true;
}

/* The output freed before its wait: tensors allocated and filled while the collective is in
 * flight (the allocator's cache would hand them the freed output's memory) keep their values
 * through its completion. avg: the completion also divides the output in place. Last: it
 * completes the orphaned collectives with ag_dist_finalize. */
static void test_freed_output(void **st) {
    (void)st;
    const int64_t n = 8192;
    late();
    for (int k = 0; k < 4; k++) {
        ag_tensor *x = rank_tensor(n);
        ag_tensor *y = ag_all_reduce(x, k % 2 ? "avg" : "sum", "0");
        assert_non_null(y);
        ag_tensor_free(x);
        ag_tensor_free(y); /* no wait */
    }
    ag_tensor *fill[8];
    for (int k = 0; k < 8; k++) {
        fill[k] = ag_empty(AG_F32, 1, (int64_t[]){n});
        float *d = ag_tensor_data(fill[k]);
        for (int64_t i = 0; i < n; i++)
            d[i] = (float)(k * 10 + 3);
    }
    /* Scoped: the scope ends before the wait. */
    ag_scope_begin();
    assert_non_null(ag_all_reduce(rank_tensor(n), "avg", "0"));
    ag_scope_end();
    ag_tensor *more = ag_full(AG_F32, 1, (int64_t[]){n}, -7.0);
    ag_dist_progress();
    assert_int_equal(ag_dist_finalize(), 0);
    for (int k = 0; k < 8; k++) {
        const float *d = ag_tensor_data(fill[k]);
        for (int64_t i = 0; i < n; i++)
            if (d[i] != (float)(k * 10 + 3))
                fail_msg("tensor %d element %lld is %g, not %d: a freed collective output's "
                         "memory was reused while MPI still wrote it",
                         k, (long long)i, (double)d[i], k * 10 + 3);
        ag_tensor_free(fill[k]);
    }
    for (int64_t i = 0; i < n; i += 13)
        assert_true(ag_tensor_item_at(more, i) == -7.0);
    ag_tensor_free(more);
    completed = true;
}

int main(void) {
    if (ag_dist_init()) {
        fprintf(stderr, "ag_dist_init: %s\n", ag_last_error());
        return 1;
    }
    ag_dist_set_timeout(60);
    R = ag_group_rank(ag_dist_world());
    N = ag_group_size(ag_dist_world());
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_op_reads_pending_output, setup, teardown),
        cmocka_unit_test_setup_teardown(test_views_inplace_and_chains, setup, teardown),
        cmocka_unit_test_setup_teardown(test_item_and_data_wait, setup, teardown),
        cmocka_unit_test_setup_teardown(test_freed_output, setup, teardown),
    };
    int nfailed = cmocka_run_group_tests(tests, NULL, NULL);
    if (nfailed && N > 1 && ag_dist_is_initialized())
        ag_dist_abort(1, "test_coll_safety: %d tests failed on this rank", nfailed);
    ag_dist_finalize();
    return nfailed;
}
