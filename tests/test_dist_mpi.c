/* The collectives on a real process group: CTest runs this program under mpirun with 2 and 4
 * ranks (and once plainly, where it runs on a world of size 1 without touching MPI). Every
 * rank's data is a function of its rank, so each rank computes what every collective must give
 * from the formula alone. Also: asynchrony (collectives started, work done, waits in the other
 * order, inputs overwritten after the start), group splits, eager autograd through each
 * collective against float64 finite differences of the sum over ranks of the losses, and the
 * comm statistics. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "testutil.h"

static int R, N;       /* this rank, the world's size */
static bool completed; /* the running test reached its end */
static bool failed;    /* a test failed on this rank */

/* A test that fails on one rank leaves its peers waiting in collectives it will never start:
 * the failing rank ends the job when the next test starts (or after the last), once cmocka
 * has printed the failure (it does after the teardown). */
static int setup(void **st) {
    (void)st;
    if (failed && N > 1)
        ag_dist_abort(1, "test_dist_mpi: a test failed on this rank (see above)");
    completed = false;
    return 0;
}
static int teardown(void **st) {
    (void)st;
    failed |= !completed;
    return 0;
}

/* Element i of rank r's data: distinct across ranks and elements, exact in float32. */
static double val(int r, int64_t i) {
    return (double)((r * 7 + (int)i * 3) % 11) - 4.0 + 0.25 * (double)r;
}

static ag_tensor *rank_tensor(ag_dtype dt, int r, int ndim, const int64_t *sizes) {
    int64_t n = 1;
    for (int d = 0; d < ndim; d++)
        n *= sizes[d];
    double *v = malloc(sizeof(double) * (size_t)(n ? n : 1));
    for (int64_t i = 0; i < n; i++)
        v[i] = dt == AG_F32 || dt == AG_F64 ? val(r, i) : (double)((r * 5 + i * 3) % 13) - 6;
    ag_tensor *t = tu_tensor(dt, ndim, sizes, v);
    free(v);
    return t;
}

static double elem(ag_dtype dt, int r, int64_t i) {
    return dt == AG_F32 || dt == AG_F64 ? val(r, i) : (double)((r * 5 + i * 3) % 13) - 6;
}

static double reduce_over(const char *op, ag_dtype dt, int64_t i, int nranks, int r0, int step) {
    double acc = elem(dt, r0, i);
    for (int k = 1; k < nranks; k++) {
        double x = elem(dt, r0 + k * step, i);
        if (!strcmp(op, "max"))
            acc = x > acc ? x : acc;
        else if (!strcmp(op, "min"))
            acc = x < acc ? x : acc;
        else
            acc += x;
    }
    return !strcmp(op, "avg") ? acc / nranks : acc;
}

static const ag_dtype dtypes[] = {AG_F32, AG_F64, AG_I64};
static const char *const reduce_ops[] = {"sum", "avg", "max", "min"};

static void test_all_reduce(void **st) {
    (void)st;
    int64_t sizes[] = {3, 5};
    for (size_t d = 0; d < 3; d++)
        for (size_t k = 0; k < 4; k++) {
            if (dtypes[d] == AG_I64 && !strcmp(reduce_ops[k], "avg"))
                continue;
            ag_scope_begin();
            ag_tensor *x = rank_tensor(dtypes[d], R, 2, sizes);
            ag_tensor *y = ag_wait_tensor(ag_all_reduce(x, reduce_ops[k], "0"));
            assert_non_null(y);
            double want[15];
            for (int i = 0; i < 15; i++)
                want[i] = reduce_over(reduce_ops[k], dtypes[d], i, N, 0, 1);
            tu_assert_values(y, 2, sizes, want, 1e-6);
            /* The input is untouched. */
            for (int i = 0; i < 15; i++)
                assert_true(ag_tensor_item_at(x, i) == elem(dtypes[d], R, i));
            ag_scope_end();
        }
    /* bool: max is or, min is and. */
    ag_scope_begin();
    double bv[4] = {R == 0, 1, 0, R == N - 1};
    ag_tensor *b = tu_tensor(AG_BOOL, 1, (int64_t[]){4}, bv);
    ag_tensor *any = ag_wait_tensor(ag_all_reduce(b, "max", "0"));
    ag_tensor *all = ag_wait_tensor(ag_all_reduce(b, "min", "0"));
    tu_assert_close(any, (double[]){1, 1, 0, 1}, 0);
    tu_assert_close(all, (double[]){N == 1, 1, 0, N == 1}, 0);
    ag_scope_end();
    completed = true;
}

static void test_all_gather_and_reduce_scatter(void **st) {
    (void)st;
    for (size_t d = 0; d < 3; d++) {
        ag_scope_begin();
        ag_tensor *x = rank_tensor(dtypes[d], R, 2, (int64_t[]){2, 3});
        ag_tensor *y = ag_wait_tensor(ag_all_gather_into_tensor(x, N, "0"));
        assert_non_null(y);
        double *want = malloc(sizeof(double) * 6 * (size_t)N);
        for (int r = 0; r < N; r++)
            for (int i = 0; i < 6; i++)
                want[r * 6 + i] = elem(dtypes[d], r, i);
        tu_assert_values(y, 2, (int64_t[]){2 * N, 3}, want, 0);
        free(want);

        /* reduce_scatter of (2N, 3): rank R keeps rows 2R, 2R+1 of the reduction. */
        ag_tensor *z = rank_tensor(dtypes[d], R, 2, (int64_t[]){2 * N, 3});
        for (size_t k = 0; k < 3; k++) {
            if (dtypes[d] == AG_I64 && !strcmp(reduce_ops[k], "avg"))
                continue;
            ag_tensor *s = ag_wait_tensor(ag_reduce_scatter_tensor(z, reduce_ops[k], N, "0"));
            assert_non_null(s);
            double w[6];
            for (int i = 0; i < 6; i++)
                w[i] = reduce_over(reduce_ops[k], dtypes[d], R * 6 + i, N, 0, 1);
            tu_assert_values(s, 2, (int64_t[]){2, 3}, w, 1e-6);
        }
        ag_scope_end();
    }
    completed = true;
}

/* Rank r sends r+s+1 rows to rank s; row j of what r sends to s holds 100r + 10s + j (and
 * +0.5 in the second column). */
static void test_all_to_all(void **st) {
    (void)st;
    ag_scope_begin();
    int64_t in_splits[16], out_splits[16], rows = 0, out_rows = 0;
    for (int s = 0; s < N; s++) {
        in_splits[s] = R + s + 1;
        out_splits[s] = s + R + 1;
        rows += in_splits[s];
        out_rows += out_splits[s];
    }
    double *v = malloc(sizeof(double) * 2 * (size_t)rows);
    int64_t k = 0;
    for (int s = 0; s < N; s++)
        for (int j = 0; j < in_splits[s]; j++, k++) {
            v[2 * k] = 100 * R + 10 * s + j;
            v[2 * k + 1] = v[2 * k] + 0.5;
        }
    for (size_t d = 0; d < 3; d++) {
        ag_tensor *x = tu_tensor(dtypes[d], 2, (int64_t[]){rows, 2}, v);
        ag_tensor *y = ag_wait_tensor(ag_all_to_all_single(x, out_splits, N, in_splits, N, "0"));
        assert_non_null(y);
        double *w = malloc(sizeof(double) * 2 * (size_t)out_rows);
        int64_t m = 0;
        for (int s = 0; s < N; s++)
            for (int j = 0; j < out_splits[s]; j++, m++) {
                w[2 * m] = 100 * s + 10 * R + j;
                w[2 * m + 1] = w[2 * m] + (dtypes[d] == AG_I64 ? 0 : 0.5);
            }
        tu_assert_values(y, 2, (int64_t[]){out_rows, 2}, w, 0);
        free(w);
    }
    free(v);
    /* No split sizes: equal parts. */
    ag_tensor *e = rank_tensor(AG_F64, R, 1, (int64_t[]){2 * N});
    ag_tensor *f = ag_wait_tensor(ag_all_to_all_single(e, NULL, 0, NULL, 0, "0"));
    assert_non_null(f);
    for (int s = 0; s < N; s++)
        for (int j = 0; j < 2; j++)
            assert_true(ag_tensor_item_at(f, 2 * s + j) == val(s, 2 * R + j));
    ag_scope_end();
    completed = true;
}

static void test_broadcast(void **st) {
    (void)st;
    for (size_t d = 0; d < 3; d++) {
        ag_scope_begin();
        ag_tensor *x = rank_tensor(dtypes[d], R, 1, (int64_t[]){7});
        ag_tensor *y = ag_wait_tensor(ag_broadcast(x, N - 1, "0"));
        double w[7];
        for (int i = 0; i < 7; i++)
            w[i] = elem(dtypes[d], N - 1, i);
        tu_assert_values(y, 1, (int64_t[]){7}, w, 0);
        ag_scope_end();
    }
    completed = true;
}

/* Errors name the op, the group and the sizes; nothing starts on any rank (every rank makes
 * the same bad call, so no rank is left waiting). */
static void test_errors(void **st) {
    (void)st;
    ag_scope_begin();
    ag_tensor *x = rank_tensor(AG_F32, R, 2, (int64_t[]){4 * N, 2});
    assert_null(ag_all_gather_into_tensor(x, N + 1, "0"));
    char want[128];
    snprintf(want, sizeof want, "all_gather_into_tensor: group_size %d but group '0' has %d ranks",
             N + 1, N);
    tu_assert_error_contains(want);
    assert_null(ag_reduce_scatter_tensor(x, "sum", N + 1, "0"));
    tu_assert_error_contains("reduce_scatter_tensor");
    assert_null(ag_all_reduce(x, "sum", "no_such_group"));
    tu_assert_error_contains("no process group named 'no_such_group'");
    assert_null(ag_all_reduce(x, "prod", "0"));
    tu_assert_error_contains("unknown reduce_op 'prod'");
    assert_null(ag_broadcast(x, N, "0"));
    snprintf(want, sizeof want, "broadcast: src %d but group '0' has %d ranks", N, N);
    tu_assert_error_contains(want);
    int64_t two[] = {1, 1};
    if (N != 2) {
        ag_tensor *x2 = rank_tensor(AG_F32, R, 2, (int64_t[]){2, 2});
        assert_null(ag_all_to_all_single(x2, two, 2, two, 2, "0"));
        tu_assert_error_contains("all_to_all_single: 2 input_split_sizes but group '0' has");
    }
    ag_scope_end();
    completed = true;
}

/* Two collectives in flight at once, compute in between, waited in the opposite order; the
 * inputs are overwritten right after the start (the staging copy keeps what was sent). */
static void test_async_overlap(void **st) {
    (void)st;
    ag_scope_begin();
    int64_t sizes[] = {64, 64};
    ag_tensor *a = rank_tensor(AG_F64, R, 2, sizes);
    ag_tensor *b = rank_tensor(AG_F32, R, 1, (int64_t[]){5});
    ag_tensor *ra = ag_all_reduce(a, "sum", "0");
    ag_tensor *gb = ag_all_gather_into_tensor(b, N, "0");
    assert_non_null(ra);
    assert_non_null(gb);
    assert_non_null(ag_fill_(a, 1000.0));
    assert_non_null(ag_fill_(b, -1000.0));
    ag_tensor *c = ag_mm(ag_ones(AG_F64, 2, sizes), ag_ones(AG_F64, 2, sizes));
    ag_dist_progress();
    assert_true(ag_tensor_item_at(c, 0) == 64.0);
    ag_tensor *wb = ag_wait_tensor(gb);
    ag_tensor *wa = ag_wait_tensor(ra);
    for (int64_t i = 0; i < 64 * 64; i += 97)
        tu_assert_near(ag_tensor_item_at(wa, i), reduce_over("sum", AG_F64, i, N, 0, 1), 1e-12,
                       "all_reduce", i);
    for (int r = 0; r < N; r++)
        for (int i = 0; i < 5; i++)
            assert_true(ag_tensor_item_at(wb, r * 5 + i) == (double)(float)val(r, i));
    /* A wait on a tensor no collective writes is a copy. */
    ag_tensor *cp = ag_wait_tensor(c);
    assert_true(ag_tensor_data(cp) != ag_tensor_data(c));
    assert_true(ag_tensor_item_at(cp, 5) == 64.0);
    ag_scope_end();
    completed = true;
}

static void test_group_split(void **st) {
    (void)st;
    ag_group *world = ag_dist_world();
    assert_non_null(world);
    assert_string_equal(ag_group_name(world), "0");
    assert_int_equal(ag_group_size(world), N);
    assert_int_equal(ag_group_rank(world), R);
    ag_group *par = ag_group_split(world, R % 2, R);
    assert_non_null(par);
    ag_group *rev = ag_group_split(world, 0, -R); /* one group, ranks in reverse order */
    assert_non_null(rev);
    int n_same = (N - R % 2 + 1) / 2;
    assert_int_equal(ag_group_size(par), n_same);
    assert_int_equal(ag_group_rank(par), R / 2);
    assert_int_equal(ag_group_rank(rev), N - 1 - R);
    const char *pn = ag_group_name(par), *rn = ag_group_name(rev);
    assert_true(ag_group_find(pn) == par);
    assert_true(ag_group_find(rn) == rev);
    assert_true(strcmp(pn, rn) != 0 && strcmp(pn, "0") != 0);
    ag_scope_begin();
    ag_tensor *x = rank_tensor(AG_F64, R, 1, (int64_t[]){6});
    ag_tensor *y = ag_wait_tensor(ag_all_reduce(x, "sum", pn));
    double w[6];
    for (int i = 0; i < 6; i++)
        w[i] = reduce_over("sum", AG_F64, i, n_same, R % 2, 2);
    tu_assert_close(y, w, 1e-12);
    /* gather on the reversed group: rank order of the group, world rank N-1 first. */
    ag_tensor *g = ag_wait_tensor(ag_all_gather_into_tensor(x, N, rn));
    for (int k = 0; k < N; k++)
        assert_true(ag_tensor_item_at(g, k * 6 + 1) == val(N - 1 - k, 1));
    ag_scope_end();
    assert_int_equal(ag_group_barrier(par), 0);
    completed = true;
}

/* ---- autograd through the collectives: the loss of the program is the sum over ranks of
 * each rank's loss L_r = sum(w_r * f(x_r)), w_r seeded by rank. ---- */

typedef ag_tensor *(*coll_fn)(ag_tensor *x);
static ag_tensor *f_ar_sum(ag_tensor *x) {
    return ag_wait_tensor(ag_all_reduce(x, "sum", "0"));
}
static ag_tensor *f_ar_avg(ag_tensor *x) {
    return ag_wait_tensor(ag_all_reduce(x, "avg", "0"));
}
static ag_tensor *f_ag(ag_tensor *x) {
    return ag_wait_tensor(ag_all_gather_into_tensor(x, N, "0"));
}
static ag_tensor *f_rs_sum(ag_tensor *x) {
    return ag_wait_tensor(ag_reduce_scatter_tensor(x, "sum", N, "0"));
}
static ag_tensor *f_rs_avg(ag_tensor *x) {
    return ag_wait_tensor(ag_reduce_scatter_tensor(x, "avg", N, "0"));
}
/* Rank r sends 3 rows to the ranks of the other parity and 1 to its own: 2N rows on every
 * rank when N is even (every rank must make the same number of calls in the loops below). */
static ag_tensor *f_a2a(ag_tensor *x) {
    int64_t in[16], out[16];
    for (int s = 0; s < N; s++) {
        in[s] = (R + s) % 2 ? 3 : 1;
        out[s] = (s + R) % 2 ? 3 : 1; /* what rank s sends to R */
    }
    return ag_wait_tensor(ag_all_to_all_single(x, out, N, in, N, "0"));
}
static ag_tensor *f_bcast(ag_tensor *x) {
    return ag_wait_tensor(ag_broadcast(x, N - 1, "0"));
}

static int64_t rows_a2a(void) {
    int64_t rows = 0;
    for (int s = 0; s < N; s++)
        rows += (R + s) % 2 ? 3 : 1;
    return rows;
}

/* Sum over ranks of sum(w_r * f(x_r)). */
static double total_loss(coll_fn f, ag_tensor *x) {
    ag_tensor *y = f(x);
    ag_tensor *w = rank_tensor(AG_F64, R + 17, ag_tensor_ndim(y), ag_tensor_sizes(y));
    ag_tensor *l = ag_sum_all(ag_mul(w, y));
    ag_tensor *tot = ag_wait_tensor(ag_all_reduce(ag_detach(l), "sum", "0"));
    return ag_tensor_item(tot);
}

static void check_grad(const char *name, coll_fn f, int64_t rows) {
    ag_scope_begin();
    int64_t sizes[] = {rows, 2};
    ag_tensor *x = rank_tensor(AG_F64, R, 2, sizes);
    ag_tensor_set_requires_grad(x, true);
    ag_tensor *y = f(x);
    assert_non_null(y);
    ag_tensor *w = rank_tensor(AG_F64, R + 17, ag_tensor_ndim(y), ag_tensor_sizes(y));
    assert_int_equal(ag_backward(ag_sum_all(ag_mul(w, y)), NULL, false), 0);
    ag_tensor *g = ag_tensor_grad(x);
    assert_non_null(g);
    double eps = 1e-6;
    /* Every rank perturbs in turn (all ranks run every forward: they are collectives). */
    for (int p = 0; p < N; p++) {
        for (int64_t i = 0; i < 2 * rows; i++) {
            ag_tensor *xp = ag_clone(ag_detach(x)), *xm = ag_clone(ag_detach(x));
            if (p == R) {
                ((double *)ag_tensor_data(xp))[i] += eps;
                ((double *)ag_tensor_data(xm))[i] -= eps;
            }
            double fd = (total_loss(f, xp) - total_loss(f, xm)) / (2 * eps);
            if (p == R)
                tu_assert_near(ag_tensor_item_at(g, i), fd, 1e-6, name, i);
        }
    }
    ag_scope_end();
}

static void test_autograd_against_finite_differences(void **st) {
    (void)st;
    check_grad("all_reduce(sum)", f_ar_sum, 3);
    check_grad("all_reduce(avg)", f_ar_avg, 3);
    check_grad("all_gather_into_tensor", f_ag, 2);
    check_grad("reduce_scatter_tensor(sum)", f_rs_sum, 2 * N);
    check_grad("reduce_scatter_tensor(avg)", f_rs_avg, 2 * N);
    check_grad("broadcast", f_bcast, 3);
    if (N % 2 == 0)
        check_grad("all_to_all_single", f_a2a, rows_a2a());
    /* max is not differentiable: the backward says so. */
    ag_scope_begin();
    ag_tensor *x = rank_tensor(AG_F64, R, 1, (int64_t[]){3});
    ag_tensor_set_requires_grad(x, true);
    ag_tensor *y = ag_wait_tensor(ag_all_reduce(x, "max", "0"));
    assert_true(ag_backward(ag_sum_all(y), NULL, false) < 0);
    tu_assert_error_contains("all_reduce: the derivative for reduce_op 'max' is not implemented");
    ag_scope_end();
    completed = true;
}

static void test_comm_stats(void **st) {
    (void)st;
    ag_comm_stats_reset();
    ag_scope_begin();
    ag_tensor *x = rank_tensor(AG_F64, R, 1, (int64_t[]){1000});
    ag_tensor *y = ag_all_reduce(x, "sum", "0");
    ag_tensor *z = ag_all_gather_into_tensor(x, N, "0");
    ag_wait_tensor(y);
    ag_wait_tensor(z);
    ag_scope_end();
    ag_comm_stats s;
    ag_comm_stats_get(&s);
    assert_int_equal(s.collectives, 2);
    /* all_reduce: 2(N-1)/N of 8000 bytes; all_gather: (N-1)/N of the 8000N output. */
    double want = 2.0 * (N - 1) / N * 8000 + (double)(N - 1) / N * 8000 * N;
    assert_int_equal(s.bytes_sent, (int64_t)want);
    if (N > 1)
        assert_true(s.busy_s > 0);
    assert_true(s.wait_s >= 0 && s.wait_s <= s.busy_s + 1e-9);
    ag_comm_stats_reset();
    ag_comm_stats_get(&s);
    assert_int_equal(s.collectives, 0);
    completed = true;
}

/* A graph run by the planned executor: the all_reduce starts, independent work runs, the wait
 * completes it (in place: wait_tensor is pointwise), with and without the executor's checks. */
static void test_planned_graph(void **st) {
    (void)st;
    ag_graph *g = ag_graph_new();
    ag_node *x = tu_ph(g, "x", TM(AG_F32, 8));
    ag_node *nx = tu_call(g, "neg", GARGS(AG_GA_N(x)), "nx");
    ag_node *ar = tu_call(g, "_c10d_functional::all_reduce",
                          GARGS(AG_GA_N(nx), AG_GA_S("sum"), AG_GA_S("0")), "ar");
    ag_node *other = tu_call(g, "mul.Tensor", GARGS(AG_GA_N(x), AG_GA_N(x)), "other");
    ag_node *w = tu_call(g, "_c10d_functional::wait_tensor", GARGS(AG_GA_N(ar)), "w");
    ag_node *out = tu_call(g, "add.Tensor", GARGS(AG_GA_N(w), AG_GA_N(other)), "out");
    assert_non_null(ag_graph_output(g, &out, 1));
    assert_int_equal(ag_graph_verify(g), 0);
    for (int checking = 0; checking <= 1; checking++) {
        ag_plan_opts o = {.checking = checking};
        ag_plan *p = ag_plan_new(g, &o);
        assert_non_null(p);
        for (int run = 0; run < 2; run++) {
            ag_scope_begin();
            ag_tensor *xt = rank_tensor(AG_F32, R + run, 1, (int64_t[]){8});
            ag_tensor *y = NULL;
            int rc = ag_plan_run(p, &xt, 1, &y, 1);
            if (rc != 1)
                print_error("plan_run (checking %d, run %d): %s\n", checking, run, ag_last_error());
            assert_int_equal(rc, 1);
            double want[8];
            for (int i = 0; i < 8; i++) {
                want[i] = val(R + run, i) * val(R + run, i);
                for (int r = 0; r < N; r++)
                    want[i] -= val(r + run, i);
            }
            tu_assert_close(y, want, 1e-5);
            ag_scope_end(); /* y belongs to the scope */
        }
        ag_plan_free(p);
    }
    ag_graph_free(g);
    completed = true;
}

/* A planned run that fails after starting a collective (an index out of range on every rank,
 * between the all_reduce and its wait) completes the collective before it returns: freeing the
 * plan right after must not leave MPI writing, nor the avg's division, into the freed arena
 * (the ASan build catches it). Ranks other than 0 run late so that rank 0's all_reduce is still
 * in flight when its run fails. */
static void test_failed_run_settles(void **st) {
    (void)st;
    ag_graph *g = ag_graph_new();
    ag_node *x = tu_ph(g, "x", TM(AG_F32, 4096));
    ag_node *w = tu_ph(g, "w", TM(AG_F32, 3, 2));
    ag_node *idx = tu_ph(g, "idx", TM(AG_I64, 1));
    ag_node *ar = tu_call(g, "_c10d_functional::all_reduce",
                          GARGS(AG_GA_N(x), AG_GA_S("avg"), AG_GA_S("0")), "ar");
    ag_node *sel = tu_call(g, "index_select", GARGS(AG_GA_N(w), AG_GA_I(0), AG_GA_N(idx)), "sel");
    ag_node *wt = tu_call(g, "_c10d_functional::wait_tensor", GARGS(AG_GA_N(ar)), "wt");
    ag_node *outs[2] = {wt, sel};
    assert_non_null(ag_graph_output(g, outs, 2));
    assert_int_equal(ag_graph_verify(g), 0);
    ag_plan *p = ag_plan_new(g, NULL);
    assert_non_null(p);
    ag_scope_begin();
    ag_tensor *in[3] = {rank_tensor(AG_F32, R, 1, (int64_t[]){4096}),
                        ag_zeros(AG_F32, 2, (int64_t[]){3, 2}),
                        ag_from_data(AG_I64, 1, (int64_t[]){1}, (int64_t[]){7})};
    if (R != 0) {
        struct timespec ts = {0, 200 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    ag_tensor *y[2] = {NULL, NULL};
    assert_true(ag_plan_run(p, in, 3, y, 2) < 0);
    assert_non_null(strstr(ag_last_error(), "out of bounds"));
    ag_plan_free(p);
    /* What the arena held is someone else's now. */
    ag_tensor *fill = ag_full(AG_F32, 1, (int64_t[]){1 << 16}, 5.0);
    ag_dist_progress();
    assert_float_equal(ag_tensor_item_at(fill, 12345), 5.0, 0);
    ag_scope_end();
    ag_graph_free(g);
    completed = true;
}

int main(void) {
    if (ag_dist_init()) {
        fprintf(stderr, "ag_dist_init: %s\n", ag_last_error());
        return 1;
    }
    ag_dist_set_timeout(
        60); /* a failed assertion on one rank ends the job, not the CTest timeout */
    ag_group *w = ag_dist_world();
    R = ag_group_rank(w);
    N = ag_group_size(w);
    if (N > 16) {
        fprintf(stderr, "test_dist_mpi: at most 16 ranks\n");
        return 1;
    }
    bool launched = getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMIX_RANK");
    if (ag_dist_uses_mpi() != launched) {
        fprintf(stderr, "test_dist_mpi: uses MPI %d but launched %d\n", ag_dist_uses_mpi(),
                launched);
        return 1;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_all_reduce, setup, teardown),
        cmocka_unit_test_setup_teardown(test_all_gather_and_reduce_scatter, setup, teardown),
        cmocka_unit_test_setup_teardown(test_all_to_all, setup, teardown),
        cmocka_unit_test_setup_teardown(test_broadcast, setup, teardown),
        cmocka_unit_test_setup_teardown(test_errors, setup, teardown),
        cmocka_unit_test_setup_teardown(test_async_overlap, setup, teardown),
        cmocka_unit_test_setup_teardown(test_group_split, setup, teardown),
        cmocka_unit_test_setup_teardown(test_autograd_against_finite_differences, setup, teardown),
        cmocka_unit_test_setup_teardown(test_comm_stats, setup, teardown),
        cmocka_unit_test_setup_teardown(test_planned_graph, setup, teardown),
        cmocka_unit_test_setup_teardown(test_failed_run_settles, setup, teardown),
    };
    int nfailed = cmocka_run_group_tests(tests, NULL, NULL);
    /* A rank whose test failed ends the job, so that no peer waits for it. */
    if (nfailed && N > 1)
        ag_dist_abort(1, "test_dist_mpi: %d tests failed on this rank", nfailed);
    ag_dist_finalize();
    return nfailed;
}
