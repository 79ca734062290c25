/* ag_shard_joint and the strategies, checked node by node on small models. No MPI: a mesh is
 * just numbers, and a rank's joint is built, verified, partitioned and compiled without
 * communicating (numerics across ranks are tests/test_shard_mpi.c's). The models: the zoo's mlp
 * (784-256-128-10, x [32, 784]), a four-Linear chain built here (two tp pairs, its input
 * requiring grad), and the zoo's gpt2 tiny (2 blocks, 64 wide, 4 heads). */
#include "testutil.h"

#include <string.h>

typedef struct model {
    ag_module *m;
    ag_tensor *in[4];
    int nin;
    ag_joint *j;
} model;

static void zoo(model *md, const char *name) {
    memset(md, 0, sizeof *md);
    assert_int_equal(ag_zoo_build(name, NULL, &md->m, md->in, 4, &md->nin), 0);
    md->j = ag_export_joint(md->m, md->in, md->nin, NULL, NULL, 0, NULL);
    assert_non_null(md->j);
}

static void model_free(model *md) {
    ag_joint_free(md->j);
    ag_module_free(md->m);
    for (int i = 0; i < md->nin; i++)
        ag_tensor_free(md->in[i]);
}

/* l1 -> relu -> l2 -> relu -> l3 -> relu -> l4 on x [8, 16] that requires grad. */
static int chain_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int maxo) {
    (void)nin;
    (void)maxo;
    ag_scope_begin();
    ag_tensor *h = in[0];
    const char *names[] = {"l1", "l2", "l3", "l4"};
    for (int i = 0; i < 4; i++) {
        h = ag_module_forward(ag_module_child(m, names[i]), h);
        if (i < 3)
            h = ag_relu(h);
    }
    out[0] = h ? ag_tensor_keep(h) : NULL;
    ag_scope_end();
    return h ? 1 : ag_last_status();
}

static void chain(model *md) {
    memset(md, 0, sizeof *md);
    ag_manual_seed(3);
    md->m = ag_module_new("Chain", chain_forward, NULL, NULL);
    assert_non_null(md->m);
    int64_t dims[] = {16, 32, 16, 32, 16};
    const char *names[] = {"l1", "l2", "l3", "l4"};
    for (int i = 0; i < 4; i++)
        assert_int_equal(
            ag_module_add_child(md->m, names[i], ag_nn_linear(dims[i], dims[i + 1], true)), 0);
    uint64_t st = 7;
    md->in[0] = tu_rand_tensor(AG_F32, 2, (int64_t[]){8, 16}, -1, 1, tu_xorshift, &st);
    assert_int_equal(ag_tensor_set_requires_grad(md->in[0], true), 0);
    md->nin = 1;
    md->j = ag_export_joint(md->m, md->in, 1, NULL, NULL, 0, NULL);
    assert_non_null(md->j);
}

/* ---- reading a rank's graph ---- */

static bool is_op(const ag_node *n, const char *name) {
    return ag_node_kind_of(n) == AG_NODE_CALL && !strcmp(ag_op_name(ag_node_op(n)), name);
}

static const char *tag(const ag_node *n) {
    const char *t = ag_node_partitioner_tag(n);
    return t ? t : "";
}

/* Calls of op `name` tagged `t` ("" for any). */
static int count_op(const ag_graph *g, const char *name, const char *t) {
    int c = 0;
    for (ag_node *n = ag_graph_first(g); n; n = ag_node_next(n))
        if (is_op(n, name) && (!*t || !strcmp(tag(n), t)))
            c++;
    return c;
}

#define AR "_c10d_functional::all_reduce"
#define AGT "_c10d_functional::all_gather_into_tensor"
#define RS "_c10d_functional::reduce_scatter_tensor"
#define WT "_c10d_functional::wait_tensor"

static const char *placement(const ag_node *n, char *buf) {
    ag_placement_str(ag_node_placement(n), buf, 64);
    return buf;
}

static ag_node *param_ph(const ag_graph *g, const char *fqn) {
    ag_fx_named *nm = ag_fx_named_param_nodes(g);
    assert_non_null(nm);
    ag_node *n = ag_fx_named_get(nm, fqn);
    ag_fx_named_free(nm);
    assert_non_null(n);
    return n;
}

static void assert_sizes(const ag_node *n, int ndim, const int64_t *sizes) {
    const ag_tmeta *m = ag_node_val(n, 0);
    assert_int_equal(m->ndim, ndim);
    for (int d = 0; d < ndim; d++)
        assert_int_equal(m->sizes[d], sizes[d]);
}

/* Every collective is completed by a wait_tensor, and the waits sank: each wait is followed by
 * its first user, another collective, a node of the other pass or the output node. */
static void assert_waits(const ag_graph *g, bool sunk) {
    for (ag_node *n = ag_graph_first(g); n; n = ag_node_next(n)) {
        if (ag_node_kind_of(n) != AG_NODE_CALL)
            continue;
        const char *op = ag_op_name(ag_node_op(n));
        if (strncmp(op, "_c10d_functional::", 18) || !strcmp(op, WT))
            continue;
        assert_int_equal(ag_node_num_users(n), 1);
        ag_node *w = ag_node_user(n, 0);
        assert_true(is_op(w, WT));
        if (!sunk) {
            assert_ptr_equal(ag_node_next(n), w);
            continue;
        }
        ag_node *next = ag_node_next(w);
        bool user = false;
        for (int u = 0; u < ag_node_num_users(w); u++)
            user |= ag_node_user(w, u) == next;
        const char *nop = ag_node_kind_of(next) == AG_NODE_CALL ? ag_op_name(ag_node_op(next)) : "";
        assert_true(user || ag_node_kind_of(next) == AG_NODE_OUTPUT ||
                    !strncmp(nop, "_c10d_functional::", 18) || strcmp(tag(w), tag(next)));
    }
}

/* The sharded joint keeps the source's descriptors in the source's order, and the FX utilities
 * still pair every parameter with its gradient, of the parameter's local shape. */
static void assert_descs_kept(const ag_joint *src, const ag_joint *sh) {
    const ag_graph *a = ag_joint_graph(src), *b = ag_joint_graph(sh);
    ag_node **pa, **pb;
    int na = ag_graph_placeholders(a, &pa), nb = ag_graph_placeholders(b, &pb);
    assert_int_equal(na, nb);
    for (int i = 0; i < na; i++) {
        assert_true(ag_desc_equal(ag_node_desc(pa[i]), ag_node_desc(pb[i])));
        assert_string_equal(ag_node_name(pa[i]), ag_node_name(pb[i]));
    }
    ag_node *oa = ag_graph_output_node(a), *ob = ag_graph_output_node(b);
    int no = ag_node_arg(oa, 0)->n;
    assert_int_equal(ag_node_arg(ob, 0)->n, no);
    for (int i = 0; i < no; i++)
        assert_true(ag_desc_equal(ag_node_output_desc(oa, i), ag_node_output_desc(ob, i)));
    ag_fx_pairs *pp = ag_fx_param_and_grad_nodes(b);
    assert_non_null(pp);
    assert_int_equal(ag_fx_pairs_count(pp), ag_joint_num_params(src));
    for (int i = 0; i < ag_fx_pairs_count(pp); i++) {
        ag_node *ph = ag_fx_pairs_first(pp, i), *gr = ag_fx_pairs_second(pp, i);
        assert_non_null(gr);
        const ag_tmeta *mp = ag_node_val(ph, 0), *mg = ag_node_val(gr, 0);
        assert_int_equal(mp->ndim, mg->ndim);
        for (int d = 0; d < mp->ndim; d++)
            assert_int_equal(mp->sizes[d], mg->sizes[d]);
    }
    ag_fx_pairs_free(pp);
    /* Every node carries its placement; the source's metadata came along. */
    for (ag_node *n = ag_graph_first(b); n; n = ag_node_next(n))
        if (ag_node_kind_of(n) != AG_NODE_OUTPUT)
            assert_int_equal(ag_node_meta_get(n, "placement").kind, AG_MV_STR);
    for (ag_node *n = ag_graph_first(a); n; n = ag_node_next(n)) {
        if (ag_node_kind_of(n) == AG_NODE_OUTPUT)
            continue;
        ag_node *m = ag_graph_find(b, ag_node_name(n));
        assert_non_null(m);
        assert_string_equal(tag(n), tag(m));
        assert_int_equal(ag_node_seq_nr(n), ag_node_seq_nr(m));
        assert_int_equal(ag_node_nn_module_stack_len(n), ag_node_nn_module_stack_len(m));
        const char *sa = ag_node_stack_trace(n), *sb = ag_node_stack_trace(m);
        assert_true((!sa && !sb) || (sa && sb && !strcmp(sa, sb)));
    }
}

/* The rank's joint partitions with the min-cut partitioner and compiles (nothing runs). */
static ag_compiled *compile_mincut(const ag_joint *sh) {
    ag_compile_opts o;
    memset(&o, 0, sizeof o);
    o.partition.partitioner = AG_PARTITION_MINCUT;
    o.partition.memory_budget = 1.0;
    ag_compiled *c = ag_compile_joint(sh, &o);
    if (!c)
        fail_msg("compile: %s", ag_last_error());
    return c;
}

static ag_joint *shard(const ag_joint *j, int W, int rank, const ag_shard_plan *p) {
    ag_mesh mesh = {.size = W, .rank = rank, .group = NULL};
    ag_joint *s = ag_shard_joint(j, &mesh, p);
    if (!s)
        fail_msg("shard_joint: %s", ag_last_error());
    assert_int_equal(ag_graph_verify(ag_joint_graph(s)), 0);
    return s;
}

static ag_shard_plan *strategy(const char *name, const ag_joint *j, int W) {
    ag_mesh mesh = {.size = W, .rank = 0};
    ag_shard_plan *p = ag_shard_plan_strategy_new(name, j, &mesh);
    if (!p)
        fail_msg("%s: %s", name, ag_last_error());
    assert_string_equal(ag_shard_plan_strategy(p), name);
    return p;
}

/* ---- plans ---- */

static void test_plan_api(void **st) {
    (void)st;
    ag_shard_plan *p = ag_shard_plan_new();
    assert_string_equal(ag_shard_plan_strategy(p), "custom");
    ag_desc *w = ag_desc_param("fc1.weight"), *x = ag_desc_plain_input(0),
            *y = ag_desc_plain_output(0), *b = ag_desc_buffer("bn.running_mean");
    ag_placement pl;
    assert_false(ag_shard_plan_get(p, w, &pl));
    assert_int_equal(pl.kind, AG_REPLICATE);
    assert_int_equal(ag_shard_plan_set_param(p, "fc1.weight", AG_P_SHARD(1)), 0);
    assert_true(ag_shard_plan_get(p, w, &pl));
    assert_true(ag_placement_eq(pl, AG_P_SHARD(1)));
    /* Setting again replaces. */
    assert_int_equal(ag_shard_plan_set(p, w, AG_P_SHARD(0)), 0);
    assert_true(ag_shard_plan_get(p, w, &pl));
    assert_true(ag_placement_eq(pl, AG_P_SHARD(0)));
    assert_int_equal(ag_shard_plan_set_input(p, 0, AG_P_SHARD(0)), 0);
    assert_true(ag_shard_plan_get(p, x, &pl) && ag_placement_eq(pl, AG_P_SHARD(0)));
    assert_int_equal(ag_shard_plan_set_output(p, 0, AG_P_PARTIAL(AG_PARTIAL_SUM)), 0);
    assert_true(ag_shard_plan_get(p, y, &pl) && pl.kind == AG_PARTIAL);
    /* set_param names a buffer too. */
    assert_int_equal(ag_shard_plan_set_param(p, "bn.running_mean", AG_P_SHARD(0)), 0);
    assert_true(ag_shard_plan_get(p, b, &pl) && ag_placement_eq(pl, AG_P_SHARD(0)));
    /* Refused: another kind, a Partial input, a negative dim or index. */
    ag_desc *t = ag_desc_tangent(y);
    assert_int_equal(ag_shard_plan_set(p, t, AG_P_SHARD(0)), AG_EINVAL);
    tu_assert_error_contains(
        "TangentAOTInput(output=PlainAOTOutput(idx=0)): a plan places "
        "ParamAOTInput, BufferAOTInput, PlainAOTInput and PlainAOTOutput only");
    assert_int_equal(ag_shard_plan_set(p, w, AG_P_PARTIAL(AG_PARTIAL_AVG)), AG_EINVAL);
    tu_assert_error_contains("ParamAOTInput(target='fc1.weight'): an input is placed Shard() or "
                             "Replicate(), not Partial()");
    assert_int_equal(ag_shard_plan_set_param(p, "fc2.weight", AG_P_SHARD(-1)), AG_EINVAL);
    tu_assert_error_contains("a Shard needs dim >= 0");
    assert_int_equal(ag_shard_plan_set_input(p, -1, AG_P_SHARD(0)), AG_EINVAL);
    /* The failed calls changed nothing. */
    assert_true(ag_shard_plan_get(p, w, &pl) && ag_placement_eq(pl, AG_P_SHARD(0)));
    assert_false(ag_shard_plan_get(p, t, &pl));
    assert_null(ag_shard_plan_strategy_new("zero3", NULL, NULL));
    tu_assert_error_contains("unknown strategy 'zero3' (dp, fsdp or tp)");
    ag_desc_release(w);
    ag_desc_release(x);
    ag_desc_release(y);
    ag_desc_release(b);
    ag_desc_release(t);
    ag_shard_plan_free(p);
    ag_shard_plan_free(NULL);
}

/* ---- refusals ---- */

static void test_refusals(void **st) {
    (void)st;
    model md;
    zoo(&md, "mlp");
    uint64_t h0, h1;
    assert_int_equal(ag_joint_hash(md.j, &h0), 0);
    ag_shard_plan *p = ag_shard_plan_new();
    ag_mesh bad[] = {{.size = 0, .rank = 0}, {.size = 2, .rank = 2}, {.size = 2, .rank = -1}};
    for (int i = 0; i < 3; i++) {
        assert_null(ag_shard_joint(md.j, &bad[i], p));
        tu_assert_error_contains("shard_joint: bad mesh");
        assert_null(ag_shard_plan_dp(md.j, &bad[i]));
        tu_assert_error_contains("bad mesh");
    }
    ag_mesh m4 = {.size = 4, .rank = 1};
    /* An FQN the joint does not have. */
    assert_int_equal(ag_shard_plan_set_param(p, "fc9.weight", AG_P_SHARD(0)), 0);
    assert_null(ag_shard_joint(md.j, &m4, p));
    tu_assert_error_contains("shard_joint: the plan places ParamAOTInput(target='fc9.weight'), "
                             "which the joint does not have");
    ag_shard_plan_free(p);
    /* An uneven shard: fc3.weight is [10, 128]. */
    p = ag_shard_plan_new();
    assert_int_equal(ag_shard_plan_set_param(p, "fc3.weight", AG_P_SHARD(0)), 0);
    assert_null(ag_shard_joint(md.j, &m4, p));
    tu_assert_error_contains("shard_joint: the plan places ParamAOTInput(target='fc3.weight') "
                             "(f32[10, 128]) as Shard(0) on 4 ranks, but dim 0 (size 10) does "
                             "not divide by 4");
    ag_shard_plan_free(p);
    /* A dim the tensor does not have. */
    p = ag_shard_plan_new();
    assert_int_equal(ag_shard_plan_set_param(p, "fc1.bias", AG_P_SHARD(1)), 0);
    assert_null(ag_shard_joint(md.j, &m4, p));
    tu_assert_error_contains("ParamAOTInput(target='fc1.bias') (f32[256]) as Shard(1), but it has "
                             "no dim 1");
    ag_shard_plan_free(p);
    /* An output placement that does not divide: y is [32, 10]. */
    p = ag_shard_plan_new();
    assert_int_equal(ag_shard_plan_set_output(p, 0, AG_P_SHARD(1)), 0);
    assert_null(ag_shard_joint(md.j, &m4, p));
    tu_assert_error_contains("PlainAOTOutput(idx=0) (f32[32, 10]) as Shard(1) on 4 ranks, but dim "
                             "1 (size 10) does not divide by 4");
    ag_shard_plan_free(p);
    /* Strategies that do not fit: a batch of 32 on 3 ranks; no Linear pair in `linear`. */
    ag_mesh m3 = {.size = 3, .rank = 0};
    assert_null(ag_shard_plan_dp(md.j, &m3));
    tu_assert_error_contains("shard_plan_dp: PlainAOTInput(idx=0): the batch (dim 0, size 32) does "
                             "not divide by 3 ranks");
    assert_null(ag_shard_plan_fsdp(md.j, &m3));
    tu_assert_error_contains("the batch (dim 0, size 32) does not divide by 3 ranks");
    assert_int_equal(ag_joint_hash(md.j, &h1), 0);
    assert_true(h0 == h1);
    model_free(&md);
    zoo(&md, "linear");
    assert_null(ag_shard_plan_tp(md.j, &m4));
    tu_assert_error_contains("shard_plan_tp: no Linear pair in the joint (1 Linears");
    model_free(&md);
}

/* On a mesh of one rank every placement is the whole tensor: no collective, the source's
 * shapes, and the compiled step computes what the source's does. */
static void test_world_of_one(void **st) {
    (void)st;
    model md;
    zoo(&md, "mlp");
    ag_shard_plan *p = strategy("fsdp", md.j, 1);
    ag_joint *s = shard(md.j, 1, 0, p);
    assert_descs_kept(md.j, s);
    const ag_graph *a = ag_joint_graph(md.j), *b = ag_joint_graph(s);
    assert_int_equal(ag_graph_num_nodes(a), ag_graph_num_nodes(b));
    for (ag_node *n = ag_graph_first(a); n; n = ag_node_next(n)) {
        if (ag_node_kind_of(n) == AG_NODE_OUTPUT)
            continue;
        ag_node *m = ag_graph_find(b, ag_node_name(n));
        const ag_tmeta *x = ag_node_val(n, 0);
        assert_sizes(m, x->ndim, x->sizes);
    }
    ag_shard_summary su;
    assert_int_equal(ag_shard_summary_get(s, &su), 0);
    assert_int_equal(su.ncollectives, 0);
    assert_int_equal(su.comm_bytes, 0);
    assert_int_equal(su.nfallback, 0);
    assert_int_equal(su.param_bytes, 4 * ag_module_num_parameters(md.m));
    assert_int_equal(su.optim_bytes, 8 * ag_module_num_parameters(md.m));
    ag_compiled *c0 = ag_compile_joint(md.j, NULL), *c1 = compile_mincut(s);
    assert_non_null(c0);
    ag_scope_begin();
    ag_tensor *y0, *y1;
    ag_named_tensors *nt = NULL;
    (void)nt;
    assert_int_equal(ag_compiled_call_module(c0, md.m, md.in, md.nin, &y0, 1), 1);
    assert_int_equal(ag_compiled_call_module(c1, md.m, md.in, md.nin, &y1, 1), 1);
    assert_true(tu_max_abs_diff(y0, y1) == 0);
    ag_scope_end();
    ag_compiled_free(c0);
    ag_compiled_free(c1);
    ag_joint_free(s);
    ag_shard_plan_free(p);
    model_free(&md);
}

/* ---- dp ---- */

/* The mlp on 2 ranks, data parallel: the batch is split, the parameters are whole, and the
 * logits (a Replicate() user output) are gathered right after they are computed. Their tangent
 * is then whole on every rank, so fc3.bias's gradient (its sum over the batch) is whole too;
 * the five other gradients come out Partial and are reduced in one bucket (0.9 MB < 25 MiB)
 * started right after the last of them is computed. */
static void test_dp_mlp(void **st) {
    (void)st;
    model md;
    zoo(&md, "mlp");
    ag_shard_plan *p = strategy("dp", md.j, 2);
    ag_joint *s = shard(md.j, 2, 1, p);
    const ag_graph *g = ag_joint_graph(s);
    char buf[64];
    assert_sizes(ag_graph_find(g, "primals_7"), 2, (int64_t[]){16, 784});
    assert_string_equal(placement(ag_graph_find(g, "primals_7"), buf), "Shard(0)");
    assert_sizes(param_ph(g, "fc1.weight"), 2, (int64_t[]){256, 784});
    assert_string_equal(placement(param_ph(g, "fc1.weight"), buf), "Replicate()");
    assert_sizes(ag_graph_find(g, "tangents_1"), 2, (int64_t[]){32, 10});
    assert_descs_kept(md.j, s);
    /* One all_reduce, of five gradients flattened and concatenated, in the backward. */
    assert_int_equal(count_op(g, AR, ""), 1);
    assert_int_equal(count_op(g, AR, "is_backward"), 1);
    ag_node *ar = NULL;
    for (ag_node *n = ag_graph_first(g); n; n = ag_node_next(n))
        if (is_op(n, AR))
            ar = n;
    ag_node *cat = ag_node_arg_node(ar, 0);
    assert_true(is_op(cat, "cat"));
    assert_int_equal(ag_node_arg(cat, 0)->n, 5);
    assert_sizes(cat, 1, (int64_t[]){ag_module_num_parameters(md.m) - 10});
    assert_string_equal(ag_node_arg(ar, 1)->u.s, "sum");
    assert_string_equal(ag_node_arg(ar, 2)->u.s, "0");
    /* Started right after the last gradient's producer: only its flattening and the cat lie
     * between. */
    int last = -1;
    for (int i = 0; i < 5; i++) {
        ag_node *v = ag_node_arg(cat, 0)->u.nodes[i];
        ag_node *src = ag_node_arg_node(v, 0);
        if (is_op(src, "clone"))
            src = ag_node_arg_node(src, 0);
        if (ag_node_index(src) > last)
            last = ag_node_index(src);
    }
    for (int i = last + 1; i < ag_node_index(ar); i++) {
        ag_node *n = ag_graph_first(g);
        for (int k = 0; k < i; k++)
            n = ag_node_next(n);
        assert_true(is_op(n, "view") || is_op(n, "clone") || is_op(n, "cat"));
    }
    /* Every gradient output is Replicate(), a view of the reduced bucket but fc3.bias's (the
     * last output). */
    ag_node *out = ag_graph_output_node(g);
    assert_string_equal(placement(ag_node_arg(out, 0)->u.nodes[6], buf), "Replicate()");
    assert_true(is_op(ag_node_arg(out, 0)->u.nodes[6], "view"));
    assert_true(is_op(ag_node_arg_node(ag_node_arg(out, 0)->u.nodes[6], 0), "sum.dim_IntList"));
    for (int i = 1; i <= 5; i++) {
        ag_node *gr = ag_node_arg(out, 0)->u.nodes[i];
        assert_string_equal(placement(gr, buf), "Replicate()");
        assert_true(is_op(gr, "view"));
        assert_true(is_op(ag_node_arg_node(gr, 0), "slice.Tensor"));
        assert_true(is_op(ag_node_arg_node(ag_node_arg_node(gr, 0), 0), WT));
    }
    /* The forward gathers the logits (and nothing else), right after addmm_2. */
    assert_int_equal(count_op(g, AGT, "is_forward"), 1);
    assert_int_equal(count_op(g, AGT, ""), 1);
    assert_true(is_op(ag_node_next(ag_graph_find(g, "addmm_2")), AGT));
    assert_int_equal(count_op(g, RS, ""), 0);
    assert_waits(g, true);
    ag_shard_summary su;
    assert_int_equal(ag_shard_summary_get(s, &su), 0);
    assert_int_equal(su.nfallback, 0);
    assert_int_equal(su.ncollectives, 2);
    /* Ring: all_reduce 2(n-1)/n of 4 P bytes, all_gather (n-1)/n of the 32x10 logits. */
    assert_int_equal(su.comm_bytes, 4 * (ag_module_num_parameters(md.m) - 10) + 32 * 10 * 4 / 2);
    ag_compiled_free(compile_mincut(s));
    ag_joint_free(s);
    /* Small buckets: at most 64 KiB each, in the order gradients become ready: fc3.weight
     * (5 KiB) with fc2.bias, then fc2.weight (128 KiB) alone, fc1.bias alone (fc1.weight, 784
     * KiB, would overflow it), fc1.weight alone. */
    ag_shard_plan_set_bucket_bytes(p, 64 << 10);
    s = shard(md.j, 2, 0, p);
    assert_int_equal(count_op(ag_joint_graph(s), AR, ""), 4);
    assert_int_equal(count_op(ag_joint_graph(s), "cat", ""), 1);
    ag_joint_free(s);
    /* No bucketing, no overlap: one all_reduce per gradient, each wait right after it. */
    ag_shard_plan_set_bucket_bytes(p, -1);
    ag_shard_plan_set_no_overlap(p, true);
    s = shard(md.j, 2, 0, p);
    assert_int_equal(count_op(ag_joint_graph(s), AR, ""), 5);
    assert_int_equal(count_op(ag_joint_graph(s), "cat", ""), 0);
    assert_waits(ag_joint_graph(s), false);
    ag_joint_free(s);
    ag_shard_plan_free(p);
    model_free(&md);
}

/* ---- fsdp ---- */

/* Every parameter of the mlp divides by 2 on dim 0: each placeholder is its shard, gathered
 * once before its first use in the forward (the gather and its wait tagged must-recompute), and
 * its gradient reduce_scattered back to its shard. The min-cut partitioner gathers again in the
 * backward instead of saving the whole parameters. */
static void test_fsdp_mlp(void **st) {
    (void)st;
    model md;
    zoo(&md, "mlp");
    ag_shard_plan *p = strategy("fsdp", md.j, 2);
    ag_joint *s = shard(md.j, 2, 0, p);
    const ag_graph *g = ag_joint_graph(s);
    assert_descs_kept(md.j, s);
    char buf[64];
    assert_sizes(param_ph(g, "fc1.weight"), 2, (int64_t[]){128, 784});
    assert_sizes(param_ph(g, "fc1.bias"), 1, (int64_t[]){128});
    assert_sizes(param_ph(g, "fc3.weight"), 2, (int64_t[]){5, 128});
    assert_string_equal(placement(param_ph(g, "fc3.weight"), buf), "Shard(0)");
    assert_sizes(ag_graph_find(g, "primals_7"), 2, (int64_t[]){16, 784});
    /* Seven gathers, all in the forward: the six parameters and the logits (a Replicate()
     * user output). */
    assert_int_equal(count_op(g, AGT, "is_forward"), 7);
    assert_int_equal(count_op(g, AGT, ""), 7);
    ag_fx_named *nm = ag_fx_named_param_nodes(g);
    for (int i = 0; i < ag_fx_named_count(nm); i++) {
        ag_node *ph = ag_fx_named_node(nm, i);
        /* The parameter's one user is its gather, before the first forward use. */
        ag_node *gth = NULL;
        for (int u = 0; u < ag_node_num_users(ph); u++)
            if (is_op(ag_node_user(ph, u), AGT))
                gth = ag_node_user(ph, u);
        assert_non_null(gth);
        assert_int_equal(ag_node_num_users(ph), 1);
        assert_int_equal(ag_node_recompute(gth), AG_MUST_RECOMPUTE);
        assert_int_equal(ag_node_recompute(ag_node_user(gth, 0)), AG_MUST_RECOMPUTE);
        assert_int_equal(ag_node_arg(gth, 1)->u.i, 2);
    }
    ag_fx_named_free(nm);
    /* Five gradients reduce_scattered, no all_reduce; fc3.bias's comes whole (the logits'
     * tangent is whole) and is sliced. */
    assert_int_equal(count_op(g, RS, "is_backward"), 5);
    ag_node *gb = ag_node_arg(ag_graph_output_node(g), 0)->u.nodes[6];
    assert_true(is_op(gb, "slice.Tensor"));
    assert_int_equal(ag_node_arg(gb, 2)->u.i, 0);
    assert_int_equal(ag_node_arg(gb, 3)->u.i, 5);
    assert_int_equal(count_op(g, AR, ""), 0);
    ag_node *out = ag_graph_output_node(g);
    for (int i = 1; i <= 6; i++)
        assert_string_equal(placement(ag_node_arg(out, 0)->u.nodes[i], buf), "Shard(0)");
    assert_waits(g, true);
    ag_shard_summary su;
    assert_int_equal(ag_shard_summary_get(s, &su), 0);
    assert_int_equal(su.param_bytes, 4 * ag_module_num_parameters(md.m) / 2);
    /* Min-cut: the backward gathers the parameters again. */
    ag_compiled *c = compile_mincut(s);
    assert_true(count_op(ag_compiled_backward_graph(c), AGT, "") >= 2);
    assert_int_equal(count_op(ag_compiled_forward_graph(c), AGT, ""), 7);
    ag_compiled_free(c);
    ag_joint_free(s);
    ag_shard_plan_free(p);
    model_free(&md);
}

/* ---- tp ---- */

/* Tensor parallel mlp: fc1 column-parallel, fc2 row-parallel, fc3 whole. One all_reduce in the
 * forward (fc2's partial sums) and none in the backward: the pair's input (x) takes no
 * gradient, so no partial input gradient needs summing. */
static void test_tp_mlp(void **st) {
    (void)st;
    model md;
    zoo(&md, "mlp");
    ag_shard_plan *p = strategy("tp", md.j, 2);
    ag_placement pl;
    ag_desc *d = ag_desc_param("fc1.weight");
    assert_true(ag_shard_plan_get(p, d, &pl) && ag_placement_eq(pl, AG_P_SHARD(0)));
    ag_desc_release(d);
    d = ag_desc_param("fc1.bias");
    assert_true(ag_shard_plan_get(p, d, &pl) && ag_placement_eq(pl, AG_P_SHARD(0)));
    ag_desc_release(d);
    d = ag_desc_param("fc2.weight");
    assert_true(ag_shard_plan_get(p, d, &pl) && ag_placement_eq(pl, AG_P_SHARD(1)));
    ag_desc_release(d);
    d = ag_desc_param("fc3.weight");
    assert_false(ag_shard_plan_get(p, d, &pl));
    ag_desc_release(d);
    ag_joint *s = shard(md.j, 2, 1, p);
    const ag_graph *g = ag_joint_graph(s);
    assert_descs_kept(md.j, s);
    assert_sizes(param_ph(g, "fc1.weight"), 2, (int64_t[]){128, 784});
    assert_sizes(param_ph(g, "fc2.weight"), 2, (int64_t[]){128, 128});
    assert_sizes(param_ph(g, "fc2.bias"), 1, (int64_t[]){128});
    assert_sizes(ag_graph_find(g, "relu"), 2, (int64_t[]){32, 128});
    assert_int_equal(count_op(g, AR, "is_forward"), 1);
    assert_int_equal(count_op(g, AR, "is_backward"), 0);
    assert_int_equal(count_op(g, AGT, ""), 0);
    assert_int_equal(count_op(g, RS, ""), 0);
    assert_waits(g, true);
    ag_compiled_free(compile_mincut(s));
    ag_joint_free(s);
    ag_shard_plan_free(p);
    model_free(&md);
}

/* Two pairs (l1, l2) and (l3, l4), the input requiring grad: per pair one all_reduce in the
 * forward and one in the backward (the partial gradient of its input). */
static void test_tp_two_pairs(void **st) {
    (void)st;
    model md;
    chain(&md);
    ag_shard_plan *p = strategy("tp", md.j, 2);
    ag_joint *s = shard(md.j, 2, 0, p);
    const ag_graph *g = ag_joint_graph(s);
    assert_descs_kept(md.j, s);
    assert_sizes(param_ph(g, "l3.weight"), 2, (int64_t[]){16, 16});
    assert_sizes(param_ph(g, "l4.weight"), 2, (int64_t[]){16, 16});
    assert_int_equal(count_op(g, AR, "is_forward"), 2);
    assert_int_equal(count_op(g, AR, "is_backward"), 2);
    assert_int_equal(count_op(g, AGT, ""), 0);
    ag_shard_summary su;
    assert_int_equal(ag_shard_summary_get(s, &su), 0);
    assert_int_equal(su.nfallback, 0);
    ag_compiled_free(compile_mincut(s));
    ag_joint_free(s);
    ag_shard_plan_free(p);
    model_free(&md);
}

/* gpt2 tiny (2 blocks, 4 heads of 16): in each block the attention (c_attn column-parallel as
 * StridedShard(0, 3), c_proj row-parallel) and the MLP (c_fc, c_proj) are pairs; each rank
 * runs 2 of the 4 heads. Two all_reduces per block in the forward, two in the backward. */
static void test_tp_gpt2(void **st) {
    (void)st;
    model md;
    zoo(&md, "gpt2");
    ag_shard_plan *p = strategy("tp", md.j, 2);
    ag_placement pl;
    ag_desc *d = ag_desc_param("transformer.h.0.attn.c_attn.weight");
    assert_true(ag_shard_plan_get(p, d, &pl));
    char buf[64];
    assert_string_equal(ag_placement_str(pl, buf, sizeof buf), "StridedShard(0, 3)");
    ag_desc_release(d);
    d = ag_desc_param("lm_head.weight");
    assert_false(ag_shard_plan_get(p, d, &pl));
    ag_desc_release(d);
    ag_joint *s = shard(md.j, 2, 1, p);
    const ag_graph *g = ag_joint_graph(s);
    assert_descs_kept(md.j, s);
    assert_sizes(param_ph(g, "transformer.h.1.attn.c_attn.weight"), 2, (int64_t[]){96, 64});
    assert_sizes(param_ph(g, "transformer.h.1.mlp.c_proj.weight"), 2, (int64_t[]){64, 128});
    /* Heads split: the attention runs on [2, 2, 16, 16] per rank. */
    for (ag_node *n = ag_graph_first(g); n; n = ag_node_next(n))
        if (is_op(n, "_scaled_dot_product_flash_attention_for_cpu"))
            assert_sizes(ag_node_arg_node(n, 0), 4, (int64_t[]){2, 2, 16, 16});
    assert_int_equal(count_op(g, AR, "is_forward"), 4);
    assert_int_equal(count_op(g, AR, "is_backward"), 4);
    assert_int_equal(count_op(g, AGT, ""), 0);
    ag_shard_summary su;
    assert_int_equal(ag_shard_summary_get(s, &su), 0);
    if (su.nfallback)
        fail_msg("fallbacks: %s", su.fallback_ops);
    ag_compiled_free(compile_mincut(s));
    ag_joint_free(s);
    ag_shard_plan_free(p);
    model_free(&md);
}

/* ---- a plan no strategy makes ---- */

/* fc1.weight split by its input features (Shard(1)), fc2.weight whole, the input whole, the
 * output split by the batch, on rank 1 of 2: x is sliced locally to the rank's half of its
 * features (columns 392..784), fc1's partial sums are reduced, and the output is the rank's
 * half of the batch. */
static void test_custom_plan(void **st) {
    (void)st;
    model md;
    zoo(&md, "mlp");
    ag_shard_plan *p = ag_shard_plan_new();
    assert_int_equal(ag_shard_plan_set_param(p, "fc1.weight", AG_P_SHARD(1)), 0);
    assert_int_equal(ag_shard_plan_set_param(p, "fc2.weight", AG_P_REPLICATE), 0);
    assert_int_equal(ag_shard_plan_set_input(p, 0, AG_P_REPLICATE), 0);
    assert_int_equal(ag_shard_plan_set_output(p, 0, AG_P_SHARD(0)), 0);
    ag_joint *s = shard(md.j, 2, 1, p);
    const ag_graph *g = ag_joint_graph(s);
    assert_descs_kept(md.j, s);
    char buf[64];
    assert_sizes(param_ph(g, "fc1.weight"), 2, (int64_t[]){256, 392});
    assert_string_equal(placement(param_ph(g, "fc1.weight"), buf), "Shard(1)");
    assert_sizes(ag_graph_find(g, "primals_7"), 2, (int64_t[]){32, 784});
    assert_sizes(ag_graph_find(g, "tangents_1"), 2, (int64_t[]){16, 10});
    /* The rank's columns of x. */
    int slices = 0;
    ag_node *x = ag_graph_find(g, "primals_7");
    for (int u = 0; u < ag_node_num_users(x); u++) {
        ag_node *n = ag_node_user(x, u);
        if (!is_op(n, "slice.Tensor") || ag_node_arg(n, 1)->u.i != 1)
            continue;
        slices++;
        assert_string_equal(tag(n), "is_forward");
        assert_int_equal(ag_node_arg(n, 2)->u.i, 392);
        assert_int_equal(ag_node_arg(n, 3)->u.i, 784);
    }
    assert_int_equal(slices, 1);
    assert_true(count_op(g, AR, "is_forward") >= 1);
    ag_node *out = ag_graph_output_node(g);
    assert_string_equal(placement(ag_node_arg(out, 0)->u.nodes[0], buf), "Shard(0)");
    assert_sizes(ag_node_arg(out, 0)->u.nodes[0], 2, (int64_t[]){16, 10});
    assert_string_equal(placement(ag_node_arg(out, 0)->u.nodes[1], buf), "Shard(1)");
    assert_sizes(ag_node_arg(out, 0)->u.nodes[1], 2, (int64_t[]){256, 392});
    assert_waits(g, true);
    ag_compiled_free(compile_mincut(s));
    ag_joint_free(s);
    ag_shard_plan_free(p);
    model_free(&md);
}

/* A rank's joint saves and loads back to the same text (collectives print and parse), and the
 * mesh of the world needs ag_dist_init. */
static void test_save_load_and_world(void **st) {
    (void)st;
    model md;
    zoo(&md, "mlp");
    ag_shard_plan *p = strategy("fsdp", md.j, 2);
    ag_joint *s = shard(md.j, 2, 0, p);
    char *t1, *t2;
    size_t n1, n2;
    assert_int_equal(ag_joint_save(s, &t1, &n1), 0);
    ag_joint *l = ag_joint_load(t1, n1);
    if (!l)
        fail_msg("load: %s", ag_last_error());
    assert_int_equal(ag_joint_save(l, &t2, &n2), 0);
    assert_string_equal(t1, t2);
    ag_free(t1);
    ag_free(t2);
    ag_joint_free(l);
    ag_joint_free(s);
    ag_shard_plan_free(p);
    model_free(&md);
    ag_mesh m;
    if (!ag_dist_is_initialized()) {
        assert_int_equal(ag_mesh_world(&m), AG_ESTATE);
        tu_assert_error_contains("mesh_world: the world is not initialized");
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_plan_api),     cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_world_of_one), cmocka_unit_test(test_dp_mlp),
        cmocka_unit_test(test_fsdp_mlp),     cmocka_unit_test(test_tp_mlp),
        cmocka_unit_test(test_tp_two_pairs), cmocka_unit_test(test_tp_gpt2),
        cmocka_unit_test(test_custom_plan),  cmocka_unit_test(test_save_load_and_world),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
