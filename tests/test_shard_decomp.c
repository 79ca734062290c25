/* Decompose to shard, checked node by node on the training steps of the zoo's cnn, mlp and gpt2
 * (tiny) under dp and fsdp on 2 ranks, built on shapes only (no MPI; the numerics under mpirun
 * are tests/test_dist_grads.c's and tests/test_train_parallel.c's): batch norm (forward and
 * backward) and the mean nll_loss are decomposed instead of gathering their batch-sharded
 * inputs, the network runs Shard(0) from input to loss, batch norm's statistics are
 * all_reduced as [1, C, 1, 1] values, and the summary lists what was decomposed. A node whose
 * decomposition would move no fewer bytes (an nll_loss of class-sharded log-probabilities) is
 * kept whole, and one rank decomposes nothing. */
#include "testutil.h"

#include <stdlib.h>
#include <string.h>

#define AR "_c10d_functional::all_reduce"
#define AGT "_c10d_functional::all_gather_into_tensor"

/* ---- the training step: loss = cross_entropy(model(x), y), or gpt2's own loss ---- */

typedef struct step_ud {
    ag_module *model;
    bool gpt2;
} step_ud;

static int step_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    step_ud *u = ag_module_ud(m);
    (void)max_out;
    ag_tensor *o[2] = {0};
    ag_scope_begin();
    if (u->gpt2) {
        int rc = ag_module_call(u->model, in, nin, o, 2);
        out[0] = rc == 2 ? ag_tensor_keep(o[1]) : NULL;
    } else {
        ag_tensor *logits = ag_module_forward(u->model, in[0]);
        out[0] = ag_tensor_keep(ag_cross_entropy(logits, in[1], AG_REDUCTION_MEAN, -100));
    }
    ag_scope_end();
    return out[0] ? 1 : ag_last_status();
}

/* The joint of zoo model `name`'s training step on its example batch, in meta mode. */
static ag_joint *step_joint(const char *name) {
    bool gpt2 = !strcmp(name, "gpt2");
    bool prev = ag_set_meta_mode(true);
    ag_module *model = NULL;
    ag_tensor *in[4] = {0};
    int nin = 0;
    assert_int_equal(ag_zoo_build(name, NULL, &model, in, 4, &nin), 0);
    ag_tensor *y = ag_zeros(AG_I64, gpt2 ? 2 : 1, ag_tensor_sizes(in[0]));
    step_ud *u = calloc(1, sizeof *u);
    assert_non_null(u);
    *u = (step_ud){.model = model, .gpt2 = gpt2};
    ag_module *step = ag_module_new("Step", step_forward, u, free);
    assert_non_null(step);
    assert_int_equal(ag_module_add_child(step, "model", model), 0); /* step owns it */
    ag_tensor *args[2] = {in[0], y};
    ag_joint *j = ag_export_joint(step, args, 2, NULL, NULL, 0, NULL);
    if (!j)
        fail_msg("export %s step: %s", name, ag_last_error());
    ag_set_meta_mode(prev);
    for (int i = 0; i < nin; i++)
        ag_tensor_free(in[i]);
    ag_tensor_free(y);
    ag_module_free(step);
    return j;
}

static ag_joint *shard(const ag_joint *j, const char *strategy, int world, int rank) {
    ag_mesh mesh = {.size = world, .rank = rank, .group = "0"};
    ag_shard_plan *plan = ag_shard_plan_strategy_new(strategy, j, &mesh);
    assert_non_null(plan);
    ag_joint *local = ag_shard_joint(j, &mesh, plan);
    if (!local)
        fail_msg("shard %s: %s", strategy, ag_last_error());
    ag_shard_plan_free(plan);
    assert_int_equal(ag_graph_verify(ag_joint_graph(local)), 0);
    return local;
}

/* ---- reading a rank's graph ---- */

static bool is_op(const ag_node *n, const char *name) {
    return ag_node_kind_of(n) == AG_NODE_CALL && !strcmp(ag_op_name(ag_node_op(n)), name);
}

static int count_op(const ag_graph *g, const char *name) {
    int c = 0;
    for (ag_node *n = ag_graph_first(g); n; n = ag_node_next(n))
        c += is_op(n, name);
    return c;
}

static const char *meta_str(const ag_node *n, const char *key) {
    ag_mval v = ag_node_meta_get(n, key);
    return v.kind == AG_MV_STR ? v.u.s : NULL;
}

static bool is_shard0(const ag_node *n) {
    ag_placement p = ag_node_placement(n);
    return p.kind == AG_SHARD && p.dim == 0 && p.split_factor <= 1;
}

static const char *pl_str(const ag_node *n, char *buf) {
    return ag_placement_str(ag_node_placement(n), buf, 64);
}

static void assert_summary(const ag_joint *local, int ndecomposed, const char *ops) {
    ag_shard_summary s;
    assert_int_equal(ag_shard_summary_get(local, &s), 0);
    assert_int_equal(s.nfallback, 0);
    assert_int_equal(s.ndecomposed, ndecomposed);
    assert_string_equal(s.decomposed_ops, ops);
}

#define BN_OPS                                                                                     \
    "_native_batch_norm_legit_functional x2, nll_loss_forward x1, native_batch_norm_backward x2"

/* cnn (conv-bn-relu-pool twice, fc-relu-fc; batch 8) under dp on 2 ranks: nothing is gathered,
 * every activation (4-d values, and the call nodes of the convolutions, poolings, linears and
 * the loss) is Shard(0) on a batch of 4, and the only collectives besides the gradient bucket
 * are all_reduces of the batch norms' statistics ([1, C, 1, 1]: sum(x) / count and the
 * variance in the forward, sum(g) and sum(g * xhat) in the backward, per layer) and of the
 * loss's two scalars. */
static void test_cnn_dp(void **st) {
    (void)st;
    ag_joint *j = step_joint("cnn");
    for (int rank = 0; rank < 2; rank++) {
        ag_joint *local = shard(j, "dp", 2, rank);
        const ag_graph *g = ag_joint_graph(local);
        char b[64];
        assert_int_equal(count_op(g, AGT), 0);
        assert_int_equal(count_op(g, "_native_batch_norm_legit_functional"), 0);
        assert_int_equal(count_op(g, "native_batch_norm_backward"), 0);
        assert_int_equal(count_op(g, "nll_loss_forward"), 0);
        assert_summary(local, 5, BN_OPS);
        int stats[2] = {0}, scalars = 0;
        for (ag_node *n = ag_graph_first(g); n; n = ag_node_next(n)) {
            if (ag_node_kind_of(n) != AG_NODE_CALL && ag_node_kind_of(n) != AG_NODE_GETITEM)
                continue;
            const ag_tmeta *m = ag_node_val(n, 0);
            /* Nothing runs on the whole batch of 8; every activation (4-d with the batch, 4,
             * first; weights have 32 or 64 there) is a batch shard. */
            if (m->ndim == 4 && (m->sizes[0] == 4 || m->sizes[0] == 8)) {
                if (m->sizes[0] != 4 || !is_shard0(n))
                    fail_msg("node '%s' %s is not a batch shard: %s", ag_node_name(n),
                             ag_op_name(ag_node_op(n)), pl_str(n, b));
            }
            static const char *const acts[] = {
                "convolution",      "max_pool2d_with_indices", "addmm",
                "_log_softmax",     "convolution_backward",    "_log_softmax_backward_data",
                "nll_loss_backward"};
            for (size_t k = 0; k < sizeof acts / sizeof acts[0]; k++)
                if (is_op(n, acts[k]) && !is_shard0(n))
                    fail_msg("%s '%s' is %s", acts[k], ag_node_name(n), pl_str(n, b));
            if (!is_op(n, AR))
                continue;
            const ag_node *in = ag_node_arg_node(n, 0);
            const ag_tmeta *im = ag_node_val(in, 0);
            if (im->ndim == 0) {
                assert_string_equal(meta_str(in, "shard_decomposed"), "nll_loss_forward");
                scalars++;
            } else if (im->ndim == 4) {
                /* A batch norm statistic: [1, C, 1, 1], computed by the decomposition's pieces. */
                assert_true(im->sizes[0] == 1 && im->sizes[2] == 1 && im->sizes[3] == 1);
                assert_true(im->sizes[1] == 32 || im->sizes[1] == 64);
                const char *from = meta_str(in, "shard_decomposed");
                assert_non_null(from);
                bool fw = !strcmp(from, "_native_batch_norm_legit_functional");
                assert_true(fw || !strcmp(from, "native_batch_norm_backward"));
                assert_string_equal(ag_node_partitioner_tag(n), fw ? "is_forward" : "is_backward");
                stats[fw]++;
            } else {
                assert_int_equal(im->ndim, 1); /* the gradient bucket */
            }
        }
        assert_int_equal(stats[1], 4); /* two per layer in the forward */
        assert_int_equal(stats[0], 4); /* and two in the backward */
        assert_int_equal(scalars, 2);  /* the loss's sum and total weight */
        /* The batch norms' weight and bias gradients come from the reduced statistics: the
         * bucket carries every other parameter's gradient. */
        ag_shard_summary s;
        assert_int_equal(ag_shard_summary_get(local, &s), 0);
        assert_true(s.comm_bytes < s.param_bytes);
        assert_true(s.comm_bytes > s.param_bytes * 9 / 10);
        ag_joint_free(local);
    }
    ag_joint_free(j);
}

/* fsdp gathers the parameters (and only them) and decomposes the same nodes. */
static void test_cnn_fsdp(void **st) {
    (void)st;
    ag_joint *j = step_joint("cnn");
    ag_joint *local = shard(j, "fsdp", 2, 1);
    const ag_graph *g = ag_joint_graph(local);
    assert_summary(local, 5, BN_OPS);
    int gathers = 0;
    for (ag_node *n = ag_graph_first(g); n; n = ag_node_next(n)) {
        if (!is_op(n, AGT))
            continue;
        const ag_desc *d = ag_node_desc(ag_node_arg_node(n, 0));
        assert_true(d && ag_desc_is_param(d));
        gathers++;
    }
    assert_int_equal(gathers, 12);
    ag_joint_free(local);
    ag_joint_free(j);
}

/* The logits (mlp [32, 10], gpt2 [2 * 16, 256]) stay batch shards: the mean loss is
 * decomposed. gpt2's one gather is of the position embedding's gradient ([16, 64] rows
 * Shard(1) -> [64, 64] whole), which has nothing to do with the loss. */
static void test_logits_not_gathered(void **st) {
    (void)st;
    const char *models[] = {"mlp", "gpt2"};
    for (int k = 0; k < 2; k++) {
        ag_joint *j = step_joint(models[k]);
        ag_joint *local = shard(j, "dp", 2, 0);
        const ag_graph *g = ag_joint_graph(local);
        assert_summary(local, 1, "nll_loss_forward x1");
        for (ag_node *n = ag_graph_first(g); n; n = ag_node_next(n)) {
            if (is_op(n, "_log_softmax") || is_op(n, "gather"))
                assert_true(is_shard0(n));
            if (is_op(n, AGT)) {
                assert_int_equal(k, 1);
                const ag_tmeta *m = ag_node_val(n, 0);
                assert_true(m->ndim == 2 && m->sizes[0] == 64 && m->sizes[1] == 64);
            }
        }
        ag_joint_free(local);
        ag_joint_free(j);
    }
}

/* loss = nll_loss(x * w, y) with x [8, 6] Shard(1) (its classes split): whole, nll_loss would
 * gather x; decomposed, the gather of each row's target cannot read a class shard either and
 * gathers x all the same, so the node is kept whole, its input gathered. */
static int cls_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int maxo) {
    (void)nin;
    (void)maxo;
    ag_scope_begin();
    ag_tensor *h = ag_mul(in[0], ag_module_param(m, "w"));
    out[0] = ag_tensor_keep(ag_nll_loss(h, in[1], AG_REDUCTION_MEAN, -100));
    ag_scope_end();
    return out[0] ? 1 : ag_last_status();
}

static void test_kept_whole(void **st) {
    (void)st;
    ag_module *m = ag_module_new("Cls", cls_forward, NULL, NULL);
    int64_t c6 = 6;
    ag_tensor *w = ag_ones(AG_F32, 1, &c6);
    assert_int_equal(ag_module_register_parameter(m, "w", w), 0);
    ag_tensor_free(w);
    ag_tensor *x = ag_ones(AG_F32, 2, (int64_t[]){8, 6});
    ag_tensor *y = ag_zeros(AG_I64, 1, (int64_t[]){8});
    ag_joint *j = ag_export_joint(m, (ag_tensor *[]){x, y}, 2, NULL, NULL, 0, NULL);
    assert_non_null(j);
    ag_mesh mesh = {.size = 2, .rank = 0, .group = "0"};
    ag_shard_plan *plan = ag_shard_plan_new();
    assert_int_equal(ag_shard_plan_set_input(plan, 0, AG_P_SHARD(1)), 0);
    ag_joint *local = ag_shard_joint(j, &mesh, plan);
    assert_non_null(local);
    ag_shard_summary s;
    assert_int_equal(ag_shard_summary_get(local, &s), 0);
    assert_int_equal(s.ndecomposed, 0);
    assert_string_equal(s.decomposed_ops, "");
    assert_int_equal(count_op(ag_joint_graph(local), "nll_loss_forward"), 1);
    for (ag_node *n = ag_graph_first(ag_joint_graph(local)); n; n = ag_node_next(n)) {
        assert_null(meta_str(n, "shard_decomposed"));
        if (is_op(n, "nll_loss_forward")) /* its input gathered */
            assert_true(is_op(ag_node_arg_node(n, 0), "transpose.int"));
    }
    ag_joint_free(local);

    /* One rank: nothing to gather, nothing decomposed, no node tagged. */
    ag_mesh one = {.size = 1, .rank = 0, .group = "0"};
    local = ag_shard_joint(j, &one, plan);
    assert_non_null(local);
    assert_int_equal(ag_shard_summary_get(local, &s), 0);
    assert_int_equal(s.ndecomposed, 0);
    for (ag_node *n = ag_graph_first(ag_joint_graph(local)); n; n = ag_node_next(n))
        assert_null(meta_str(n, "shard_decomposed"));
    ag_joint_free(local);
    ag_shard_plan_free(plan);
    ag_joint_free(j);
    ag_tensor_free(x);
    ag_tensor_free(y);
    ag_module_free(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cnn_dp),
        cmocka_unit_test(test_cnn_fsdp),
        cmocka_unit_test(test_logits_not_gathered),
        cmocka_unit_test(test_kept_whole),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
