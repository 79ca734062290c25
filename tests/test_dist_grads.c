/* Under mpirun (2 and 4 ranks): one training step of the sharded joint, for every strategy on
 * mlp, cnn and gpt2 (tiny), gives each parameter a local gradient that, gathered by its
 * placement (ag_shard_full), equals the single-process gradient; and ag_shard_local /
 * ag_shard_full are inverse for every placement kind (Shard on dims 0 and 1, StridedShard,
 * Partial sum and avg, Replicate).
 *
 * Tolerance: 1e-4 relative to the largest |gradient| of the parameter. The sharded step sums
 * the same float32 products in another order (per-rank partial sums, then all_reduce or
 * reduce_scatter), which differs by a few ulps of the sums (~1e-6 relative); a missing or
 * doubled reduction is off by a factor of the world size. Plus 1e-7 absolute: a gradient that
 * is zero in exact arithmetic (cnn's conv biases, cancelled by the BatchNorm after them) is
 * rounding noise (~1e-9) whose relative error means nothing. */
#define AG_NO_SITES
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

static ag_mesh mesh;

typedef struct step_ud {
    ag_module *model;
    bool gpt2;
} step_ud;

static int step_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    step_ud *u = ag_module_ud(m);
    ag_tensor *o[2] = {0};
    (void)max_out;
    ag_scope_begin();
    if (u->gpt2)
        out[0] = ag_module_call(u->model, in, nin, o, 2) == 2 ? ag_tensor_keep(o[1]) : NULL;
    else
        out[0] = ag_tensor_keep(
            ag_cross_entropy(ag_module_forward(u->model, in[0]), in[1], AG_REDUCTION_MEAN, -100));
    ag_scope_end();
    return out[0] ? 1 : ag_last_status();
}

static step_ud ud;

/* n integers in [0, hi) from a fixed LCG (the same on every rank). */
static ag_tensor *ints(int ndim, const int64_t *sizes, int64_t hi) {
    int64_t v[1024], n = 1;
    for (int i = 0; i < ndim; i++)
        n *= sizes[i];
    assert_true(n <= 1024);
    uint64_t s = 12345;
    for (int64_t i = 0; i < n; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        v[i] = (int64_t)((s >> 33) % (uint64_t)hi);
    }
    return ag_from_data(AG_I64, ndim, sizes, v);
}

/* The smallest |pre-activation| of the mlp's two ReLUs on x, in float64. A sharded step sums
 * fc1's 784 products in another order than the whole batch's GEMM (the rank's M is 2 rows, not
 * 8), which moves a pre-activation by ~1e-7; one that close to 0 can flip its ReLU and change a
 * whole row of fc1's gradient (seed 5 on an AVX-512 EPYC: 1.5e-7 at sample 5, unit 228). */
static double mlp_margin(ag_module *model, ag_tensor *x) {
    ag_tensor *w1 = ag_module_param(model, "fc1.weight"), *b1 = ag_module_param(model, "fc1.bias");
    ag_tensor *w2 = ag_module_param(model, "fc2.weight"), *b2 = ag_module_param(model, "fc2.bias");
    int64_t n = ag_tensor_size(x, 0), k = ag_tensor_size(x, 1), h = ag_tensor_size(w1, 0);
    int64_t h2 = ag_tensor_size(w2, 0);
    double margin = INFINITY, act[256];
    assert_true(h <= 256);
    for (int64_t i = 0; i < n; i++) {
        for (int64_t j = 0; j < h; j++) {
            double s = ag_tensor_item_at(b1, j);
            for (int64_t e = 0; e < k; e++)
                s += ag_tensor_item_at(x, i * k + e) * ag_tensor_item_at(w1, j * k + e);
            margin = fmin(margin, fabs(s));
            act[j] = fmax(s, 0);
        }
        for (int64_t j = 0; j < h2; j++) {
            double s = ag_tensor_item_at(b2, j);
            for (int64_t e = 0; e < h; e++)
                s += act[e] * ag_tensor_item_at(w2, j * h + e);
            margin = fmin(margin, fabs(s));
        }
    }
    return margin;
}

/* The step module (owns model) and a global batch of 8, the same on every rank. The mlp's batch
 * is drawn again (seeds 5, 6, ...) until no pre-activation is within 1e-4 of its ReLU's kink,
 * so that float32 rounding cannot flip a mask (mlp_margin). */
static ag_module *build(const char *name, ag_tensor **in) {
    ag_module *model = NULL;
    ag_tensor *zin[4];
    int nz = 0;
    assert_int_equal(ag_zoo_build(name, NULL, &model, zin, 4, &nz), 0);
    for (int i = 0; i < nz; i++)
        ag_tensor_free(zin[i]);
    ud.model = model;
    ud.gpt2 = !strcmp(name, "gpt2");
    ag_module *step = ag_module_new("TrainStep", step_forward, &ud, NULL);
    assert_non_null(step);
    assert_int_equal(ag_module_add_child(step, "model", model), 0);
    ag_manual_seed(5);
    if (ud.gpt2) {
        in[0] = ints(2, (int64_t[]){8, 16}, 256);
        in[1] = ints(2, (int64_t[]){8, 16}, 256);
    } else {
        if (!strcmp(name, "mlp")) {
            in[0] = ag_randn(AG_F32, 2, (int64_t[]){8, 784});
            for (uint64_t seed = 6; in[0] && mlp_margin(model, in[0]) < 1e-4; seed++) {
                assert_true(seed < 100);
                ag_tensor_free(in[0]);
                ag_manual_seed(seed);
                in[0] = ag_randn(AG_F32, 2, (int64_t[]){8, 784});
            }
        } else {
            in[0] = ag_randn(AG_F32, 4, (int64_t[]){8, 1, 28, 28});
        }
        in[1] = ints(1, (int64_t[]){8}, 10);
    }
    assert_non_null(in[0]);
    assert_non_null(in[1]);
    return step;
}

static double max_abs(ag_tensor *t) {
    double m = 0;
    for (int64_t i = 0; i < ag_tensor_numel(t); i++)
        m = fmax(m, fabs(ag_tensor_item_at(t, i)));
    return m;
}

static void check(const char *model, const char *strategy) {
    ag_tensor *in[2];
    /* The single-process gradients. */
    ag_module *ref = build(model, in);
    ag_joint *j = ag_export_joint(ref, in, 2, NULL, NULL, 0, NULL);
    assert_non_null(j);
    ag_compiled *c = ag_compile_joint(j, NULL);
    assert_non_null(c);
    ag_tensor *loss = NULL;
    assert_int_equal(ag_compiled_call_module(c, ref, in, 2, &loss, 1), 1);
    assert_int_equal(ag_backward(loss, NULL, false), 0);
    ag_tensor_free(loss);
    ag_compiled_free(c);
    ag_tensor_free(in[0]);
    ag_tensor_free(in[1]);

    /* This rank's step on fresh copies of the same model. */
    ag_module *full = build(model, in);
    ag_shard_plan *plan = ag_shard_plan_strategy_new(strategy, j, &mesh);
    assert_non_null(plan);
    ag_joint *sj = ag_shard_joint(j, &mesh, plan);
    if (!sj)
        fail_msg("%s %s: %s", model, strategy, ag_last_error());
    ag_shard_plan_free(plan);
    c = ag_compile_joint(sj, NULL);
    assert_non_null(c);
    ag_node **ph;
    int nph = ag_graph_placeholders(ag_joint_graph(sj), &ph);
    int nflat = ag_joint_num_flat_inputs(sj);
    assert_true(nflat <= nph && nflat <= 64);
    ag_tensor *flat[64] = {0}, *whole[64] = {0};
    ag_placement pl[64];
    for (int i = 0; i < nflat; i++) {
        const ag_desc *d = ag_node_desc(ph[i]);
        pl[i] = ag_node_placement(ph[i]);
        if (ag_desc_kind_of(d) == AG_DESC_PLAIN_INPUT) {
            flat[i] = ag_shard_local(in[ag_desc_idx(d)], pl[i], &mesh);
            assert_non_null(flat[i]);
            continue;
        }
        bool param = ag_desc_kind_of(d) == AG_DESC_PARAM;
        whole[i] = param ? ag_module_param(full, ag_desc_target(d))
                         : ag_module_buffer(full, ag_desc_target(d));
        assert_non_null(whole[i]);
        for (int t = 0; t < i && !flat[i]; t++) /* a tied parameter: one piece */
            if (whole[t] == whole[i])
                flat[i] = ag_tensor_keep(flat[t]);
        if (!flat[i]) {
            flat[i] = ag_shard_local(whole[i], pl[i], &mesh);
            assert_non_null(flat[i]);
            if (param)
                assert_int_equal(ag_tensor_set_requires_grad(flat[i], true), 0);
        }
    }
    assert_int_equal(ag_compiled_call(c, flat, nflat, &loss, 1), 1);
    assert_int_equal(ag_backward(loss, NULL, false), 0);
    ag_tensor_free(loss);
    int checked = 0;
    for (int i = 0; i < nflat; i++) {
        const ag_desc *d = ag_node_desc(ph[i]);
        bool tied = false;
        for (int t = 0; t < i; t++)
            tied |= whole[t] && whole[t] == whole[i];
        if (ag_desc_kind_of(d) != AG_DESC_PARAM || tied)
            continue;
        ag_tensor *g = ag_tensor_grad(flat[i]);
        if (!g)
            fail_msg("%s %s: %s has no gradient on rank %d", model, strategy, ag_desc_target(d),
                     mesh.rank);
        ag_tensor *gathered = ag_shard_full(g, pl[i], &mesh);
        assert_non_null(gathered);
        ag_tensor *want = ag_tensor_grad(ag_module_param(ref, ag_desc_target(d)));
        assert_non_null(want);
        assert_int_equal(ag_tensor_numel(gathered), ag_tensor_numel(want));
        double scale = fmax(max_abs(want), 1e-30), worst = 0;
        for (int64_t e = 0; e < ag_tensor_numel(want); e++)
            worst = fmax(worst, fabs(ag_tensor_item_at(gathered, e) - ag_tensor_item_at(want, e)));
        if (!(worst <= 1e-4 * scale + 1e-7)) {
            char buf[64];
            fail_msg("%s %s on %d ranks: the gradient of %s (%s) is off by %g (largest %g)", model,
                     strategy, mesh.size, ag_desc_target(d), ag_placement_str(pl[i], buf, 64),
                     worst, scale);
        }
        ag_tensor_free(gathered);
        checked++;
    }
    assert_true(checked >= 6);
    for (int i = 0; i < nflat; i++)
        ag_tensor_free(flat[i]);
    ag_tensor_free(in[0]);
    ag_tensor_free(in[1]);
    ag_compiled_free(c);
    ag_joint_free(sj);
    ag_joint_free(j);
    ag_module_free(full);
    ag_module_free(ref);
}

static void test_mlp(void **st) {
    (void)st;
    check("mlp", "dp");
    check("mlp", "fsdp");
    check("mlp", "tp");
}
static void test_cnn(void **st) {
    (void)st;
    check("cnn", "dp");
    check("cnn", "fsdp");
    check("cnn", "tp");
}
static void test_gpt2(void **st) {
    (void)st;
    check("gpt2", "dp");
    check("gpt2", "fsdp");
    check("gpt2", "tp");
}

/* full(local(x)) == x for each placement, and local pieces are the expected chunks. */
static void test_pieces_round_trip(void **st) {
    (void)st;
    int N = mesh.size, r = mesh.rank;
    int64_t rows = 3 * N * 2, cols = 2 * N;
    ag_tensor *x = ag_arange(AG_F32, 0, (double)(rows * cols), 1);
    ag_tensor *x2 = ag_reshape(x, 2, (int64_t[]){rows, cols});
    ag_placement pls[6] = {AG_P_REPLICATE,
                           AG_P_SHARD(0),
                           AG_P_SHARD(1),
                           {.kind = AG_SHARD, .dim = 0, .split_factor = 3},
                           AG_P_PARTIAL(AG_PARTIAL_SUM),
                           AG_P_PARTIAL(AG_PARTIAL_AVG)};
    for (int k = 0; k < 6; k++) {
        ag_tensor *loc = ag_shard_local(x2, pls[k], &mesh);
        assert_non_null(loc);
        if (k == 3) { /* StridedShard(0, 3): row b * 2N + r * 2 + i of block b */
            assert_int_equal(ag_tensor_size(loc, 0), 6);
            for (int b = 0; b < 3; b++)
                for (int i = 0; i < 2; i++)
                    assert_true(ag_tensor_item_at(loc, (b * 2 + i) * cols) ==
                                (double)((b * 2 * N + r * 2 + i) * cols));
        }
        ag_tensor *back = ag_shard_full(loc, pls[k], &mesh);
        assert_non_null(back);
        assert_int_equal(ag_tensor_numel(back), rows * cols);
        for (int64_t e = 0; e < rows * cols; e++)
            assert_true(ag_tensor_item_at(back, e) == (double)e);
        ag_tensor_free(back);
        ag_tensor_free(loc);
    }
    /* The result is the caller's to free also inside an open scope, whatever the path (a
     * replicated piece is a copy: it used to belong to the scope too, a double free). */
    ag_scope_begin();
    ag_tensor *in_scope = ag_shard_full(x2, AG_P_REPLICATE, &mesh);
    assert_non_null(in_scope);
    ag_tensor_free(in_scope);
    ag_scope_end();
    /* A dim that does not split evenly. */
    assert_null(ag_shard_local(x2, AG_P_SHARD(1), &(ag_mesh){.size = 3 * N, .rank = 0}));
    tu_assert_error_contains("does not split");
    ag_tensor_free(x2);
    ag_tensor_free(x);
}

int main(void) {
    ag_set_num_threads(1);
    if (ag_dist_init() || ag_mesh_world(&mesh)) {
        fprintf(stderr, "%s\n", ag_last_error());
        return 1;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_pieces_round_trip),
        cmocka_unit_test(test_mlp),
        cmocka_unit_test(test_gpt2),
        cmocka_unit_test(test_cnn),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    ag_dist_finalize();
    return rc;
}
