/* The collective ops in a world of size 1 (no mpirun): their meta functions (shapes for any
 * group size, the errors), eager results, the graph text format round trip, what DCE, CSE and
 * the min-cut partitioner may do with them, and the communication cost model. Numerics on
 * several ranks are tests/test_dist_mpi.c's. */
#include <math.h>
#include <string.h>

#include "testutil.h"

/* ---- meta: shapes on a graph (no group needed), errors naming op and shape ---- */

static void test_meta_shapes(void **st) {
    (void)st;
    ag_graph *g = ag_graph_new();
    ag_node *x = tu_ph(g, "x", TM(AG_F32, 6, 5));
    ag_node *ar = tu_call(g, "_c10d_functional::all_reduce",
                          GARGS(AG_GA_N(x), AG_GA_S("avg"), AG_GA_S("0")), "ar");
    ag_node *agt = tu_call(g, "_c10d_functional::all_gather_into_tensor",
                           GARGS(AG_GA_N(x), AG_GA_I(4), AG_GA_S("0")), "ag");
    ag_node *rs = tu_call(g, "_c10d_functional::reduce_scatter_tensor",
                          GARGS(AG_GA_N(x), AG_GA_S("sum"), AG_GA_I(3), AG_GA_S("7")), "rs");
    int64_t outs[] = {1, 2, 4}, ins[] = {2, 2, 2};
    ag_node *a2a =
        tu_call(g, "_c10d_functional::all_to_all_single",
                GARGS(AG_GA_N(x), AG_GA_INTS(outs, 3), AG_GA_INTS(ins, 3), AG_GA_S("0")), "a2a");
    ag_node *a2e =
        tu_call(g, "_c10d_functional::all_to_all_single",
                GARGS(AG_GA_N(x), AG_GA_INTS(NULL, 0), AG_GA_INTS(NULL, 0), AG_GA_S("0")), "a2e");
    ag_node *bc = tu_call(g, "_c10d_functional::broadcast",
                          GARGS(AG_GA_N(x), AG_GA_I(3), AG_GA_S("0")), "bc");
    ag_node *w = tu_call(g, "_c10d_functional::wait_tensor", GARGS(AG_GA_N(agt)), "w");
    const ag_tmeta *m;
    m = ag_node_val(ar, 0);
    assert_int_equal(m->sizes[0], 6);
    m = ag_node_val(agt, 0);
    assert_int_equal(m->sizes[0], 24);
    assert_int_equal(m->sizes[1], 5);
    m = ag_node_val(rs, 0);
    assert_int_equal(m->sizes[0], 2);
    m = ag_node_val(a2a, 0);
    assert_int_equal(m->sizes[0], 7);
    m = ag_node_val(a2e, 0);
    assert_int_equal(m->sizes[0], 6);
    m = ag_node_val(bc, 0);
    assert_int_equal(m->sizes[0], 6);
    m = ag_node_val(w, 0);
    assert_int_equal(m->sizes[0], 24);
    assert_int_equal(m->dtype, AG_F32);
    ag_graph_free(g);
}

static void test_meta_errors(void **st) {
    (void)st;
    ag_scope_begin();
    ag_tensor *x = ag_ones(AG_F32, 2, (int64_t[]){3, 2});
    assert_null(ag_reduce_scatter_tensor(x, "sum", 2, "0"));
    tu_assert_error_contains(
        "reduce_scatter_tensor: input f32[3, 2]: dim 0 (3) is not divisible by group_size 2");
    assert_null(ag_all_gather_into_tensor(ag_ones(AG_F32, 0, NULL), 1, "0"));
    tu_assert_error_contains("all_gather_into_tensor: input must have at least one dimension");
    assert_null(ag_all_gather_into_tensor(x, 0, "0"));
    tu_assert_error_contains("all_gather_into_tensor: group_size must be positive, got 0");
    assert_null(ag_all_reduce(x, "mean", "0"));
    tu_assert_error_contains("all_reduce: unknown reduce_op 'mean' (sum, avg, max or min)");
    assert_null(ag_all_reduce(ag_ones(AG_I64, 1, (int64_t[]){2}), "avg", "0"));
    tu_assert_error_contains("all_reduce: reduce_op 'avg' needs a floating-point tensor, got i64");
    assert_null(ag_all_to_all_single(x, (int64_t[]){3}, 1, (int64_t[]){2}, 1, "0"));
    tu_assert_error_contains("all_to_all_single: input_split_sizes sum to 2 but input f32[3, 2]");
    assert_null(ag_all_to_all_single(x, (int64_t[]){-1, 4}, 2, NULL, 0, "0"));
    tu_assert_error_contains("all_to_all_single: output_split_sizes[0] is -1");
    assert_null(ag_all_to_all_single(x, NULL, 2, NULL, 0, "0"));
    tu_assert_error_contains("all_to_all_single: split size lists of 2 and 0 entries");
    assert_null(ag_broadcast(x, -1, "0"));
    tu_assert_error_contains("broadcast: src must be a rank (>= 0), got -1");
    /* Checked against the group by the kernels. */
    assert_null(ag_all_gather_into_tensor(x, 2, "0"));
    tu_assert_error_contains("all_gather_into_tensor: group_size 2 but group '0' has 1 ranks");
    assert_null(ag_all_reduce(x, "sum", "5"));
    tu_assert_error_contains("all_reduce: no process group named '5'");
    assert_null(ag_broadcast(x, 1, "0"));
    tu_assert_error_contains("broadcast: src 1 but group '0' has 1 ranks");
    ag_scope_end();
}

/* ---- eager at size 1: every collective gives its input; wait_tensor completes ---- */

static void test_eager_size1(void **st) {
    (void)st;
    assert_int_equal(ag_dist_init(), 0);
    assert_false(ag_dist_uses_mpi());
    assert_int_equal(ag_group_size(ag_dist_world()), 1);
    ag_scope_begin();
    double v[] = {1, -2, 3.5, 4, 0.25, -6};
    const ag_dtype dts[] = {AG_F32, AG_F64, AG_I64};
    for (int d = 0; d < 3; d++) {
        ag_tensor *x = tu_tensor(dts[d], 2, (int64_t[]){3, 2}, v);
        double want[6];
        for (int i = 0; i < 6; i++)
            want[i] = dts[d] == AG_I64 ? trunc(v[i]) : v[i];
        ag_tensor *r[] = {
            ag_all_reduce(x, "sum", "0"),
            ag_all_reduce(x, "max", "0"),
            ag_all_gather_into_tensor(x, 1, "0"),
            ag_reduce_scatter_tensor(x, "min", 1, "0"),
            ag_all_to_all_single(x, (int64_t[]){3}, 1, (int64_t[]){3}, 1, "0"),
            ag_all_to_all_single(x, NULL, 0, NULL, 0, "0"),
            ag_broadcast(x, 0, "0"),
        };
        for (size_t k = 0; k < sizeof r / sizeof r[0]; k++) {
            ag_tensor *y = ag_wait_tensor(r[k]);
            assert_non_null(y);
            tu_assert_values(y, 2, (int64_t[]){3, 2}, want, 0);
            assert_true(ag_tensor_data(y) != ag_tensor_data(x));
        }
    }
    ag_tensor *f = tu_tensor(AG_F64, 1, (int64_t[]){2}, v);
    tu_assert_close(ag_wait_tensor(ag_all_reduce(f, "avg", "0")), v, 0);
    /* A non-contiguous input. */
    ag_tensor *t = ag_transpose(tu_tensor(AG_F64, 2, (int64_t[]){2, 3}, v), 0, 1);
    tu_assert_close(ag_wait_tensor(ag_all_gather_into_tensor(t, 1, "0")),
                    (double[]){1, 4, -2, 0.25, 3.5, -6}, 0);
    ag_scope_end();
}

/* ---- graphs: print, parse back identically, verify ---- */

static ag_graph *all_six(void) {
    ag_graph *g = ag_graph_new();
    ag_node *x = tu_ph(g, "x", TM(AG_F32, 4, 3));
    ag_node *a = tu_call(g, "_c10d_functional::all_reduce",
                         GARGS(AG_GA_N(x), AG_GA_S("sum"), AG_GA_S("0")), "all_reduce");
    ag_node *wa = tu_call(g, "_c10d_functional::wait_tensor", GARGS(AG_GA_N(a)), "wait_tensor");
    ag_node *b = tu_call(g, "_c10d_functional::all_gather_into_tensor",
                         GARGS(AG_GA_N(wa), AG_GA_I(2), AG_GA_S("0")), "all_gather");
    ag_node *wb = tu_call(g, "_c10d_functional::wait_tensor", GARGS(AG_GA_N(b)), "wait_1");
    ag_node *c = tu_call(g, "_c10d_functional::reduce_scatter_tensor",
                         GARGS(AG_GA_N(wb), AG_GA_S("avg"), AG_GA_I(2), AG_GA_S("1")), "rs");
    ag_node *wc = tu_call(g, "_c10d_functional::wait_tensor", GARGS(AG_GA_N(c)), "wait_2");
    int64_t splits[] = {1, 3};
    ag_node *d = tu_call(
        g, "_c10d_functional::all_to_all_single",
        GARGS(AG_GA_N(wc), AG_GA_INTS(splits, 2), AG_GA_INTS(splits, 2), AG_GA_S("0")), "a2a");
    ag_node *wd = tu_call(g, "_c10d_functional::wait_tensor", GARGS(AG_GA_N(d)), "wait_3");
    ag_node *e = tu_call(g, "_c10d_functional::broadcast",
                         GARGS(AG_GA_N(wd), AG_GA_I(1), AG_GA_S("0")), "bcast");
    ag_node *we = tu_call(g, "_c10d_functional::wait_tensor", GARGS(AG_GA_N(e)), "wait_4");
    assert_non_null(ag_graph_output(g, &we, 1));
    return g;
}

static void test_print_parse_verify(void **st) {
    (void)st;
    ag_graph *g = all_six();
    assert_int_equal(ag_graph_verify(g), 0);
    char *text = ag_graph_to_string(g, NULL);
    assert_non_null(text);
    assert_non_null(strstr(text, "_c10d_functional::all_gather_into_tensor"));
    assert_non_null(strstr(text, "'avg'"));
    ag_graph *h = ag_graph_parse(text, strlen(text));
    if (!h)
        print_error("parse: %s\n%s\n", ag_last_error(), text);
    assert_non_null(h);
    assert_int_equal(ag_graph_verify(h), 0);
    char *again = ag_graph_to_string(h, NULL);
    assert_string_equal(text, again);
    ag_free(text);
    ag_free(again);
    ag_graph_free(h);
    ag_graph_free(g);
}

/* ---- passes ---- */

static int count_collectives(const ag_graph *g) {
    int n = 0;
    for (ag_node *k = ag_graph_first(g); k; k = ag_node_next(k))
        if (ag_node_kind_of(k) == AG_NODE_CALL &&
            (ag_op_def(ag_node_op(k))->flags & AG_OP_COLLECTIVE))
            n++;
    return n;
}

static void test_dce_and_cse_keep_collectives(void **st) {
    (void)st;
    ag_graph *g = ag_graph_new();
    ag_node *x = tu_ph(g, "x", TM(AG_F32, 4));
    /* Two identical all_reduces nobody reads, and one nobody waits on. */
    for (int k = 0; k < 2; k++) {
        ag_node *a = tu_call(g, "_c10d_functional::all_reduce",
                             GARGS(AG_GA_N(x), AG_GA_S("sum"), AG_GA_S("0")), NULL);
        tu_call(g, "_c10d_functional::wait_tensor", GARGS(AG_GA_N(a)), NULL);
    }
    tu_call(g, "_c10d_functional::broadcast", GARGS(AG_GA_N(x), AG_GA_I(0), AG_GA_S("0")), NULL);
    ag_node *dead = tu_call(g, "neg", GARGS(AG_GA_N(x)), "dead");
    (void)dead;
    assert_non_null(ag_graph_output(g, &x, 1));
    assert_int_equal(count_collectives(g), 5);
    assert_true(ag_graph_cse(g) >= 0);
    assert_int_equal(count_collectives(g), 5);
    assert_int_equal(ag_graph_dce(g), 1); /* only the neg */
    assert_null(ag_graph_find(g, "dead"));
    assert_int_equal(count_collectives(g), 5);
    assert_int_equal(ag_graph_verify(g), 0);
    ag_graph_free(g);
}

/* ---- the min-cut partitioner: y = sum(cos(x @ wait(all_gather(w)))) ----
 * Without a ban the min-cut would recompute the gather in the backward from the parameter w
 * (free to save); collectives are banned from recomputation unless tagged MUST (FSDP). */

static int gather_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out,
                          int max_out) {
    (void)nin;
    (void)max_out;
    ag_scope_begin();
    ag_tensor *w = ag_wait_tensor(ag_all_gather_into_tensor(ag_module_param(m, "w"), 1, "0"));
    out[0] = ag_tensor_keep(ag_sum_all(ag_cos(ag_mm(in[0], w))));
    ag_scope_end();
    return out[0] ? 1 : ag_last_status();
}

static const char *node_of_op(const ag_graph *g, const char *op, int which) {
    for (ag_node *n = ag_graph_first(g); n; n = ag_node_next(n))
        if (ag_node_kind_of(n) == AG_NODE_CALL && !strcmp(ag_op_name(ag_node_op(n)), op) &&
            which-- == 0)
            return ag_node_name(n);
    return NULL;
}

static bool computed_in(const ag_graph *g, const char *name) {
    ag_node *n = ag_graph_find(g, name);
    return n && ag_node_kind_of(n) != AG_NODE_PLACEHOLDER;
}

static void test_mincut_never_recomputes_collectives(void **st) {
    (void)st;
    ag_module *m = ag_module_new("Gather", gather_forward, NULL, NULL);
    ag_tensor *w = ag_randn(AG_F32, 2, (int64_t[]){3, 5});
    assert_int_equal(ag_module_register_parameter(m, "w", w), 0);
    ag_tensor *x = ag_randn(AG_F32, 2, (int64_t[]){4, 3});
    ag_tensor_set_requires_grad(x, true); /* x's gradient needs the gathered w */
    ag_joint *j = ag_export_joint(m, &x, 1, NULL, NULL, 0, NULL);
    if (!j)
        print_error("export: %s\n", ag_last_error());
    assert_non_null(j);
    const ag_graph *jg = ag_joint_graph(j);
    char gather[64], wait[64];
    snprintf(gather, sizeof gather, "%s",
             node_of_op(jg, "_c10d_functional::all_gather_into_tensor", 0));
    snprintf(wait, sizeof wait, "%s", node_of_op(jg, "_c10d_functional::wait_tensor", 0));
    /* The backward of the gather is a reduce_scatter, waited on. */
    assert_non_null(node_of_op(jg, "_c10d_functional::reduce_scatter_tensor", 0));
    /* Untagged and PREFER_RECOMPUTE: the gathered w is saved (through the view the backward
     * reads); MUST_RECOMPUTE: gathered again in the backward. */
    const ag_recompute policies[] = {AG_RECOMPUTE_NONE, AG_PREFER_RECOMPUTE, AG_MUST_RECOMPUTE};
    for (int k = 0; k < 3; k++) {
        ag_graph *g = ag_graph_copy(jg);
        if (policies[k] != AG_RECOMPUTE_NONE) {
            assert_int_equal(ag_node_set_recompute(ag_graph_find(g, gather), policies[k]), 0);
            assert_int_equal(ag_node_set_recompute(ag_graph_find(g, wait), policies[k]), 0);
        }
        ag_partition_opts o = {.partitioner = AG_PARTITION_MINCUT, .memory_budget = 1.0};
        ag_graph *fw, *bw;
        assert_int_equal(ag_partition(g, 1, &o, &fw, &bw, NULL), 0);
        assert_int_equal(ag_graph_verify(fw), 0);
        assert_int_equal(ag_graph_verify(bw), 0);
        assert_true(computed_in(fw, gather));
        bool must = policies[k] == AG_MUST_RECOMPUTE;
        assert_int_equal(computed_in(bw, gather), must);
        assert_int_equal(computed_in(bw, wait), must);
        ag_graph_free(fw);
        ag_graph_free(bw);
        ag_graph_free(g);
    }
    ag_joint_free(j);
    ag_tensor_free(w);
    ag_tensor_free(x);
    ag_module_free(m);
}

/* ---- the cost model ---- */

static void test_cost_model(void **st) {
    (void)st;
    ag_comm_model saved;
    ag_comm_model_get(&saved);
    assert_true(saved.latency_s > 0 && saved.bandwidth_Bps > 0);
    /* bytes one rank sends: ring formulas */
    assert_true(ag_comm_bytes("all_reduce", 1000, 4) == 1500);
    assert_true(ag_comm_bytes("_c10d_functional::all_reduce", 1000, 2) == 1000);
    assert_true(ag_comm_bytes("all_gather_into_tensor", 1000, 4) == 750);
    assert_true(ag_comm_bytes("reduce_scatter_tensor", 800, 8) == 700);
    assert_true(ag_comm_bytes("all_to_all_single", 900, 3) == 600);
    assert_true(ag_comm_bytes("broadcast", 1000, 4) == 1000);
    assert_true(ag_comm_bytes("wait_tensor", 1000, 4) == 0);
    assert_true(ag_comm_bytes("all_reduce", 1000, 1) == 0);
    assert_true(ag_comm_bytes("all_reduce_x", 1000, 4) == -1);
    assert_true(ag_comm_bytes("all_reduce", 1000, 0) == -1);
    assert_true(ag_comm_bytes(NULL, 1000, 2) == -1);
    /* time = latency x steps + bytes / bandwidth */
    ag_comm_model m = {1e-5, 1e9};
    assert_int_equal(ag_comm_model_set(&m), 0);
    tu_assert_near(ag_comm_time("all_reduce", 1e6, 4), 6 * 1e-5 + 1.5e6 / 1e9, 1e-12, "ar", 0);
    tu_assert_near(ag_comm_time("all_gather_into_tensor", 1e6, 4), 3e-5 + 0.75e6 / 1e9, 1e-12, "ag",
                   0);
    tu_assert_near(ag_comm_time("broadcast", 1e6, 5), 3e-5 + 1e6 / 1e9, 1e-12, "bc", 0);
    tu_assert_near(ag_comm_time("broadcast", 1e6, 4), 2e-5 + 1e6 / 1e9, 1e-12, "bc4", 0);
    assert_true(ag_comm_time("wait_tensor", 1e6, 4) == 0);
    assert_true(ag_comm_time("all_reduce", 1e6, 1) == 0);
    assert_true(ag_comm_time("nope", 1e6, 4) == -1);
    /* refusals leave the model as it was */
    const ag_comm_model bad[] = {{0, 1e9}, {-1e-6, 1e9}, {1e-6, 0}, {NAN, 1e9}, {1e-6, INFINITY}};
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        assert_int_equal(ag_comm_model_set(&bad[k]), AG_EINVAL);
        tu_assert_error_contains("comm_model_set: latency_s");
        ag_comm_model now;
        ag_comm_model_get(&now);
        assert_true(now.latency_s == 1e-5 && now.bandwidth_Bps == 1e9);
    }
    assert_int_equal(ag_comm_model_set(NULL), AG_EINVAL);
    assert_int_equal(ag_comm_model_set(&saved), 0);
}

/* ---- the timeout setting and the stats at size 1 ---- */

static void test_timeout_and_stats(void **st) {
    (void)st;
    double t = ag_dist_timeout();
    assert_true(t == 300);
    ag_dist_set_timeout(2.5);
    assert_true(ag_dist_timeout() == 2.5);
    ag_dist_set_timeout(0);
    assert_true(ag_dist_timeout() == 0);
    ag_dist_set_timeout(t);
    ag_comm_stats_reset();
    ag_scope_begin();
    ag_wait_tensor(ag_all_reduce(ag_ones(AG_F32, 1, (int64_t[]){10}), "sum", "0"));
    ag_scope_end();
    ag_comm_stats s;
    ag_comm_stats_get(&s);
    assert_int_equal(s.collectives, 1);
    assert_int_equal(s.bytes_sent, 0); /* one rank sends nothing */
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_meta_shapes),
        cmocka_unit_test(test_meta_errors),
        cmocka_unit_test(test_eager_size1),
        cmocka_unit_test(test_print_parse_verify),
        cmocka_unit_test(test_dce_and_cse_keep_collectives),
        cmocka_unit_test(test_mincut_never_recomputes_collectives),
        cmocka_unit_test(test_cost_model),
        cmocka_unit_test(test_timeout_and_stats),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    ag_dist_finalize();
    return rc;
}
