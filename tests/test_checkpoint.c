/* Activation checkpointing (ag_checkpoint, ag_module_set_checkpoint): eager results and
 * gradients against the same model without checkpointing (dropout included: the recomputation
 * draws the forward's masks), gradcheck through a region in float64, the exported joint's
 * recompute tags node by node, the partitioned forward saving less while the backward
 * recomputes the region, compiled against eager for both partitioners, adjacent and nested
 * regions, and errors. */
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- the model: y = sum(region(x @ w1) @ w3), region(h) = dropout(tanh(h @ w2)) * sin(h) ----
 * mode 0: plain; 1: the region checkpointed; 2: two adjacent checkpointed regions (region then
 * region2(r) = cos(r @ w4)); 3: region2 checkpointed inside the checkpointed region. */
typedef struct cfg {
    int mode;
    double p;   /* dropout; < 0: no dropout op at all */
    bool plain; /* the same arithmetic, every region called directly */
} cfg;

/* fn through ag_checkpoint, or directly for the plain reference. */
static int call(const cfg *c, ag_checkpoint_fn fn, ag_module *m, ag_tensor *x, ag_tensor **y) {
    return c->plain ? fn(m, &x, 1, y, 1) : ag_checkpoint(fn, m, &x, 1, y, 1);
}

static int region(void *ud, ag_tensor *const *in, int nin, ag_tensor **out, int max_out);

static int region2(void *ud, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)nin;
    (void)max_out;
    ag_module *m = ud;
    ag_scope_begin();
    out[0] = ag_tensor_keep(ag_cos(ag_mm(in[0], ag_module_param(m, "w4"))));
    ag_scope_end();
    return out[0] ? 1 : ag_last_status();
}

static int region(void *ud, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)nin;
    (void)max_out;
    ag_module *m = ud;
    const cfg *c = ag_module_ud(m);
    ag_scope_begin();
    ag_tensor *a = ag_tanh(ag_mm(in[0], ag_module_param(m, "w2")));
    if (c->p >= 0)
        a = ag_dropout(a, c->p, ag_module_is_training(m));
    ag_tensor *r = ag_mul(a, ag_sin(in[0]));
    ag_tensor *r2 = NULL;
    if (c->mode == 3 && r && call(c, region2, m, r, &r2) != 1)
        r = NULL;
    out[0] = ag_tensor_keep(r2 ? r2 : r);
    ag_tensor_free(r2);
    ag_scope_end();
    return out[0] ? 1 : ag_last_status();
}

static int model_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out,
                         int max_out) {
    (void)nin;
    (void)max_out;
    const cfg *c = ag_module_ud(m);
    ag_scope_begin();
    ag_tensor *h = ag_mm(in[0], ag_module_param(m, "w1"));
    ag_tensor *r = NULL, *r2 = NULL;
    if (h && call(c, region, m, h, &r) != 1)
        r = NULL;
    ag_tensor *y = r;
    if (c->mode == 2 && r) {
        if (call(c, region2, m, r, &r2) != 1)
            r2 = NULL;
        y = r2;
    }
    y = ag_sum_all(ag_mm(y, ag_module_param(m, "w3")));
    ag_tensor_free(r);
    ag_tensor_free(r2);
    return ag_module_return1(y, out);
}

static ag_module *model_new(ag_dtype dt, int mode, double p, bool plain) {
    cfg *c = calloc(1, sizeof *c);
    c->mode = mode;
    c->p = p;
    c->plain = plain;
    ag_module *m = ag_module_new("CkptModel", model_forward, c, free);
    assert_non_null(m);
    uint64_t st = 7;
    const char *names[] = {"w1", "w2", "w3", "w4"};
    const int64_t shapes[][2] = {{5, 8}, {8, 8}, {8, 3}, {8, 8}};
    for (int i = 0; i < 4; i++) {
        ag_tensor *w = tu_rand_tensor(dt, 2, shapes[i], -0.6, 0.6, tu_xorshift, &st);
        assert_int_equal(ag_module_register_parameter(m, names[i], w), 0);
        ag_tensor_free(w);
    }
    return m;
}

static ag_tensor *input_new(ag_dtype dt) {
    uint64_t st = 99;
    return tu_rand_tensor(dt, 2, (int64_t[]){4, 5}, -1, 1, tu_xorshift, &st);
}

/* One eager step from seed 5: the loss, the gradients of w1..w4 and x (new references). */
typedef struct step {
    ag_tensor *y, *g[5];
    uint64_t seed, offset; /* the generator after the backward */
} step;

static void eager_step(ag_module *m, ag_tensor *x, step *s) {
    ag_manual_seed(5);
    ag_tensor *xr = ag_detach(x);
    ag_tensor_set_requires_grad(xr, true);
    ag_scope_begin();
    ag_tensor *y;
    assert_int_equal(ag_module_call(m, &xr, 1, &y, 1), 1);
    ag_tensor *wrt[5] = {ag_module_param(m, "w1"), ag_module_param(m, "w2"),
                         ag_module_param(m, "w3"), ag_module_param(m, "w4"), xr};
    assert_int_equal(ag_grad(&y, NULL, 1, wrt, 5, s->g, false, true), 0);
    s->y = ag_tensor_keep(y);
    for (int i = 0; i < 5; i++)
        s->g[i] = ag_tensor_keep(s->g[i]);
    ag_scope_end();
    ag_tensor_free(xr);
    ag_rng_get_state(&s->seed, &s->offset);
}

static void step_free(step *s) {
    ag_tensor_free(s->y);
    for (int i = 0; i < 5; i++)
        ag_tensor_free(s->g[i]);
}

/* Bit-identical, or both absent (w4 is unused outside modes 2 and 3). */
static void assert_same(const ag_tensor *a, const ag_tensor *b, const char *what) {
    if (!a || !b) {
        if (a != b)
            fail_msg("%s: one gradient is missing", what);
        return;
    }
    double d = tu_max_abs_diff(a, b);
    if (d != 0)
        fail_msg("%s differs by %g", what, d);
}

/* ---- eager ---- */

static void test_eager_equals_plain(void **st) {
    (void)st;
    ag_tensor *x = input_new(AG_F32);
    const double ps[] = {-1, 0.3};
    for (int mode = 1; mode <= 3; mode++)
        for (int k = 0; k < 2; k++) {
            ag_module *plain = model_new(AG_F32, mode, ps[k], true);
            ag_module *ck = model_new(AG_F32, mode, ps[k], false);
            step a, b;
            eager_step(plain, x, &a);
            eager_step(ck, x, &b);
            char what[64];
            snprintf(what, sizeof what, "mode %d p %g: loss", mode, ps[k]);
            assert_same(a.y, b.y, what);
            for (int i = 0; i < 5; i++) {
                snprintf(what, sizeof what, "mode %d p %g: grad %d", mode, ps[k], i);
                assert_same(a.g[i], b.g[i], what);
            }
            /* the recomputation put the generator back where the forward left it */
            assert_true(a.seed == b.seed && a.offset == b.offset);
            step_free(&a);
            step_free(&b);
            ag_module_free(plain);
            ag_module_free(ck);
        }
    ag_tensor_free(x);
}

/* The region's output hangs off one node, and nothing inside recorded one. */
static void test_eager_node(void **st) {
    (void)st;
    ag_module *m = model_new(AG_F32, 1, 0.3, false);
    ag_tensor *x = input_new(AG_F32);
    ag_scope_begin();
    ag_tensor *h = ag_mm(x, ag_module_param(m, "w1")), *r;
    assert_int_equal(ag_checkpoint(region, m, &h, 1, &r, 1), 1);
    assert_string_equal(ag_tensor_grad_fn_name(r), "CheckpointFunctionBackward");
    assert_true(ag_tensor_requires_grad(r));
    /* With grad mode off it just runs: no node. */
    bool prev = ag_set_grad_enabled(false);
    ag_tensor *r0;
    assert_int_equal(ag_checkpoint(region, m, &h, 1, &r0, 1), 1);
    assert_null(ag_tensor_grad_fn_name(r0));
    ag_set_grad_enabled(prev);
    ag_tensor_free(r);
    ag_tensor_free(r0);
    ag_scope_end();
    ag_tensor_free(x);
    ag_module_free(m);
}

/* Every node of g is tagged MUST_RECOMPUTE with ac_graph_id ids[k] when named tagged[k], and
 * carries neither tag otherwise. */
static void check_tags(const ag_graph *g, const char *const *tagged, const int *ids, int n) {
    int seen = 0;
    for (ag_node *nd = ag_graph_first(g); nd; nd = ag_node_next(nd)) {
        int k = 0;
        while (k < n && strcmp(tagged[k], ag_node_name(nd)))
            k++;
        ag_mval id = ag_node_meta_get(nd, "ac_graph_id");
        if (k < n) {
            seen++;
            if (ag_node_recompute(nd) != AG_MUST_RECOMPUTE || id.kind != AG_MV_INT ||
                id.u.i != ids[k])
                fail_msg("%s: expected MUST_RECOMPUTE, ac_graph_id %d", tagged[k], ids[k]);
        } else if (ag_node_recompute(nd) != AG_RECOMPUTE_NONE || id.kind != AG_MV_NONE) {
            fail_msg("%s: tagged, but outside every checkpointed region", ag_node_name(nd));
        }
    }
    assert_int_equal(seen, n);
}

static ag_joint *export_model(int mode, double p, bool plain) {
    ag_module *m = model_new(AG_F32, mode, p, plain);
    ag_tensor *x = input_new(AG_F32);
    ag_joint *j = ag_export_joint(m, &x, 1, NULL, NULL, 0, NULL);
    assert_non_null(j);
    ag_tensor_free(x);
    ag_module_free(m);
    return j;
}

/* The joint of y = sum(mul(tanh(mm_1(mm, w2)), sin(mm)) @ w3), mm = x @ w1: the region's four
 * forward nodes are tagged, nothing else (not mm before it, not mm_2 after, no backward node). */
static void test_export_tags(void **st) {
    (void)st;
    ag_joint *j = export_model(1, -1, false);
    const char *region1[] = {"mm_1", "tanh", "sin", "mul"};
    check_tags(ag_joint_graph(j), region1, (int[]){1, 1, 1, 1}, 4);
    ag_joint_free(j);
    /* The plain model: no tag anywhere. */
    j = export_model(1, -1, true);
    check_tags(ag_joint_graph(j), NULL, NULL, 0);
    ag_joint_free(j);
    /* Adjacent regions: region2 = cos(mul @ w4) is the second one. */
    j = export_model(2, -1, false);
    const char *two[] = {"mm_1", "tanh", "sin", "mul", "mm_2", "cos"};
    check_tags(ag_joint_graph(j), two, (int[]){1, 1, 1, 1, 2, 2}, 6);
    ag_joint_free(j);
    /* Nested: region2 inside region belongs to the outer region. */
    j = export_model(3, -1, false);
    check_tags(ag_joint_graph(j), two, (int[]){1, 1, 1, 1, 1, 1}, 6);
    ag_joint_free(j);
}

static bool computed_in(const ag_graph *g, const char *name) {
    ag_node *n = ag_graph_find(g, name);
    return n && ag_node_kind_of(n) != AG_NODE_PLACEHOLDER;
}

static bool saved_by(const ag_graph *fw, int nf, const char *name) {
    const ag_garg *a = ag_node_arg(ag_graph_output_node(fw), 0);
    for (int k = nf; k < a->n; k++)
        if (a->u.nodes[k] && !strcmp(ag_node_name(a->u.nodes[k]), name))
            return true;
    return false;
}

/* The compiled step of m (from seed 5) against the eager one: loss and gradients within 1e-5. */
static void check_compiled(ag_module *m, ag_tensor *x, ag_compiled *c, const char *what) {
    step e;
    eager_step(m, x, &e);
    ag_manual_seed(5);
    ag_tensor *xr = ag_detach(x);
    ag_tensor_set_requires_grad(xr, true);
    ag_scope_begin();
    ag_tensor *y, *g[5];
    if (ag_compiled_call_module(c, m, &xr, 1, &y, 1) != 1)
        fail_msg("%s: compiled call: %s", what, ag_last_error());
    ag_tensor *wrt[5] = {ag_module_param(m, "w1"), ag_module_param(m, "w2"),
                         ag_module_param(m, "w3"), ag_module_param(m, "w4"), xr};
    assert_int_equal(ag_grad(&y, NULL, 1, wrt, 5, g, false, true), 0);
    assert_true(tu_max_abs_diff(y, e.y) <= 1e-5);
    for (int i = 0; i < 5; i++) {
        if (!e.g[i]) {
            assert_null(g[i]);
            continue;
        }
        double d = tu_max_abs_diff(g[i], e.g[i]);
        if (!(d <= 1e-5))
            fail_msg("%s: grad %d differs by %g", what, i, d);
    }
    ag_scope_end();
    ag_tensor_free(xr);
    step_free(&e);
}

/* Partitioned: the checkpointed forward saves fewer bytes, its backward recomputes the region
 * (tanh, sin), and the compiled step equals eager (with dropout: the recomputed philox draws
 * read the saved seed and offset, so the masks match), for both partitioners. */
static void test_partition_and_compile(void **st) {
    (void)st;
    ag_tensor *x = input_new(AG_F32);
    for (int part = 0; part < 2; part++)
        for (int k = 0; k < 2; k++) {
            double p = k ? 0.3 : -1;
            int64_t saved[2];
            for (int ck = 0; ck < 2; ck++) {
                ag_module *m = model_new(AG_F32, 1, p, !ck);
                ag_tensor *xg = ag_detach(x);
                ag_tensor_set_requires_grad(xg, true);
                ag_joint *j = ag_export_joint(m, &xg, 1, NULL, NULL, 0, NULL);
                ag_tensor_free(xg);
                assert_non_null(j);
                ag_compile_opts co = {.partition.partitioner =
                                          part ? AG_PARTITION_MINCUT : AG_PARTITION_DEFAULT};
                ag_compiled *c = ag_compile_joint(j, &co);
                assert_non_null(c);
                saved[ck] = ag_compiled_stats(c)->saved_bytes;
                const ag_graph *bw = ag_compiled_backward_graph(c);
                if (ck && p > 0) {
                    /* The mask is recomputed in the backward from the forward's seed and
                     * offset, saved by the forward: the same draw, so the same mask. */
                    const ag_graph *fw = ag_compiled_forward_graph(c);
                    assert_true(saved_by(fw, 2, "fwd_seed"));
                    assert_true(saved_by(fw, 2, "fwd_base_offset"));
                    ag_node *r = ag_graph_find(bw, "philox_rand");
                    assert_true(computed_in(bw, "philox_rand") && computed_in(bw, "ge"));
                    ag_node *seed = ag_node_arg_node(r, 1), *off = ag_node_arg_node(r, 2);
                    assert_string_equal(ag_node_name(seed), "fwd_seed");
                    assert_int_equal(ag_node_kind_of(seed), AG_NODE_PLACEHOLDER);
                    assert_string_equal(ag_node_name(ag_node_arg_node(off, 0)), "fwd_base_offset");
                    assert_int_equal(ag_node_kind_of(ag_node_arg_node(off, 0)),
                                     AG_NODE_PLACEHOLDER);
                    assert_false(computed_in(bw, "fwd_seed"));
                }
                if (ck) {
                    assert_true(computed_in(bw, "tanh"));
                    assert_true(computed_in(bw, "sin"));
                    assert_true(computed_in(bw, "mm_1"));
                } else if (!part) {
                    assert_false(computed_in(bw, "tanh"));
                }
                /* compiled against the eager model (the checkpointed one: equal to the plain
                 * one, test_eager_equals_plain) */
                char what[64];
                snprintf(what, sizeof what, "partitioner %d p %g ckpt %d", part, p, ck);
                check_compiled(m, x, c, what);
                ag_compiled_free(c);
                ag_joint_free(j);
                ag_module_free(m);
            }
            if (!(saved[1] < saved[0]))
                fail_msg("partitioner %d p %g: saved %lld bytes checkpointed, %lld plain", part, p,
                         (long long)saved[1], (long long)saved[0]);
        }
    ag_tensor_free(x);
}

/* The tags compose with the memory budget: at budgets 0.5 and 0 the min-cut still recomputes
 * the region (it may recompute more, never save the region's inside), saves no more than at
 * budget 1, and the step still equals eager, dropout included. */
static void test_memory_budget(void **st) {
    (void)st;
    ag_tensor *x = input_new(AG_F32);
    ag_module *m = model_new(AG_F32, 1, 0.3, false);
    ag_tensor *xg = ag_detach(x);
    ag_tensor_set_requires_grad(xg, true);
    ag_joint *j = ag_export_joint(m, &xg, 1, NULL, NULL, 0, NULL);
    ag_tensor_free(xg);
    assert_non_null(j);
    const double budgets[] = {1.0, 0.5, AG_MEMORY_BUDGET_ZERO};
    int64_t saved1 = 0;
    for (int b = 0; b < 3; b++) {
        ag_compile_opts co = {
            .partition = {.partitioner = AG_PARTITION_MINCUT, .memory_budget = budgets[b]}};
        ag_compiled *c = ag_compile_joint(j, &co);
        assert_non_null(c);
        const ag_graph *bw = ag_compiled_backward_graph(c);
        assert_true(computed_in(bw, "tanh") && computed_in(bw, "philox_rand"));
        int64_t sv = ag_compiled_stats(c)->saved_bytes;
        if (b == 0)
            saved1 = sv;
        assert_true(sv <= saved1);
        check_compiled(m, x, c, b == 0 ? "budget 1" : b == 1 ? "budget 0.5" : "budget 0");
        ag_compiled_free(c);
    }
    ag_joint_free(j);
    ag_module_free(m);
    ag_tensor_free(x);
}

/* Adjacent regions (upstream's cleanup_recompute_tags): the boundary value `mul`, read by the
 * second region, is saved; each region's inside is recomputed. */
static void test_adjacent_regions_partition(void **st) {
    (void)st;
    ag_joint *j = export_model(2, -1, false);
    for (int part = 0; part < 2; part++) {
        ag_partition_opts po = {.partitioner = part ? AG_PARTITION_MINCUT : AG_PARTITION_DEFAULT};
        ag_graph *fw, *bw;
        assert_int_equal(ag_partition(ag_joint_graph(j), 1, &po, &fw, &bw, NULL), 0);
        assert_true(saved_by(fw, 1, "mul"));
        assert_false(computed_in(bw, "mul"));
        assert_true(computed_in(bw, "cos"));
        assert_true(computed_in(bw, "tanh"));
        ag_graph_free(fw);
        ag_graph_free(bw);
    }
    /* the joint itself keeps its tags (the cleanup works on a copy) */
    assert_int_equal(ag_node_recompute(ag_graph_find(ag_joint_graph(j), "mul")), AG_MUST_RECOMPUTE);
    ag_joint_free(j);
}

/* ---- gradcheck in float64 ---- */

static int gc_region(void *ud, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)ud;
    (void)nin;
    (void)max_out;
    ag_scope_begin();
    ag_tensor *y = ag_mul(ag_tanh(ag_mm(in[0], in[1])), ag_sin(in[0]));
    out[0] = ag_tensor_keep(y);
    out[1] = ag_tensor_keep(ag_exp(in[1]));
    ag_scope_end();
    return out[0] && out[1] ? 2 : ag_last_status();
}

static int gc_fn(void *ud, ag_tensor *const *inputs, int n, ag_tensor **outs, int *nouts) {
    (void)ud;
    (void)n;
    ag_tensor *o[2];
    int k = ag_checkpoint(gc_region, NULL, inputs, 2, o, 2);
    if (k < 0)
        return k;
    /* gradcheck reads outputs owned by the scope it opened around the call */
    outs[0] = ag_mul(o[0], o[0]);
    outs[1] = ag_mul_scalar(o[1], 1.0);
    ag_tensor_free(o[0]);
    ag_tensor_free(o[1]);
    *nouts = 2;
    return 0;
}

static void test_gradcheck(void **st) {
    (void)st;
    uint64_t s = 3;
    ag_tensor *a = tu_rand_tensor(AG_F64, 2, (int64_t[]){3, 3}, -1, 1, tu_xorshift, &s);
    ag_tensor *b = tu_rand_tensor(AG_F64, 2, (int64_t[]){3, 3}, -1, 1, tu_xorshift, &s);
    ag_tensor_set_requires_grad(a, true);
    ag_tensor_set_requires_grad(b, true);
    assert_int_equal(ag_gradcheck(gc_fn, NULL, (ag_tensor *[]){a, b}, 2, NULL), 0);
    ag_tensor_free(a);
    ag_tensor_free(b);
}

/* ---- the module flag ---- */

static int lin_tanh_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out,
                            int max_out) {
    (void)nin;
    (void)max_out;
    ag_scope_begin();
    ag_tensor *y = ag_tanh(ag_module_forward_child(m, "fc", in[0]));
    return ag_module_return1(y, out);
}

static void test_module_checkpoint(void **st) {
    (void)st;
    ag_module *m = ag_module_new("Block", lin_tanh_forward, NULL, NULL);
    ag_manual_seed(1);
    assert_int_equal(ag_module_add_child(m, "fc", ag_nn_linear(5, 4, true)), 0);
    ag_tensor *x = input_new(AG_F32);
    ag_scope_begin();
    ag_tensor *y0 = ag_sum_all(ag_module_forward(m, x));
    ag_tensor *w = ag_module_param(m, "fc.weight"), *bias = ag_module_param(m, "fc.bias");
    ag_tensor *g0[2], *g1[2];
    assert_int_equal(ag_grad(&y0, NULL, 1, (ag_tensor *[]){w, bias}, 2, g0, false, false), 0);
    assert_false(ag_module_is_checkpointed(m));
    assert_int_equal(ag_module_set_checkpoint(m, true), 0);
    assert_true(ag_module_is_checkpointed(m));
    ag_tensor *h = ag_module_forward(m, x);
    assert_string_equal(ag_tensor_grad_fn_name(h), "CheckpointFunctionBackward");
    ag_tensor *y1 = ag_sum_all(h);
    assert_int_equal(ag_grad(&y1, NULL, 1, (ag_tensor *[]){w, bias}, 2, g1, false, false), 0);
    assert_true(tu_max_abs_diff(y0, y1) == 0);
    assert_true(tu_max_abs_diff(g0[0], g1[0]) == 0);
    assert_true(tu_max_abs_diff(g0[1], g1[1]) == 0);
    ag_scope_end();
    /* names are unchanged */
    ag_named_tensors nt;
    assert_int_equal(ag_module_named_parameters(m, true, &nt), 0);
    assert_int_equal(nt.n, 2);
    assert_string_equal(nt.names[0], "fc.weight");
    assert_string_equal(nt.names[1], "fc.bias");
    ag_named_tensors_free(&nt);
    /* a container has no forward to checkpoint */
    ag_module *seq = ag_nn_module_list();
    assert_int_equal(ag_module_set_checkpoint(seq, true), AG_EINVAL);
    tu_assert_error_contains("ModuleList");
    assert_int_equal(ag_module_set_checkpoint(NULL, true), AG_EINVAL);
    assert_false(ag_module_is_checkpointed(NULL));
    ag_module_free(seq);
    ag_module_free(m);
    ag_tensor_free(x);
}

/* ---- errors ---- */

static int failing(void *ud, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)in;
    (void)nin;
    (void)max_out;
    int *calls = ud;
    if ((*calls)++ == 0 && out[0] == NULL) {
        /* first call succeeds when ud asks for a backward failure */
    }
    return ag_set_error(AG_EINVAL, "failing: bad input on call %d", *calls);
}

static int fails_second(void *ud, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)nin;
    (void)max_out;
    int *calls = ud;
    if ((*calls)++ > 0)
        return ag_set_error(AG_EINVAL, "fails_second: call %d refused", *calls);
    ag_scope_begin();
    out[0] = ag_tensor_keep(ag_tanh(ag_mul(in[0], in[0])));
    ag_scope_end();
    return out[0] ? 1 : ag_last_status();
}

static int identity(void *ud, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)ud;
    (void)nin;
    (void)max_out;
    out[0] = ag_tensor_keep(in[0]);
    return 1;
}

static void test_errors(void **st) {
    (void)st;
    ag_tensor *x = input_new(AG_F32);
    ag_tensor_set_requires_grad(x, true);
    ag_tensor *o[2] = {x, x};
    assert_int_equal(ag_checkpoint(NULL, NULL, &x, 1, o, 1), AG_EINVAL);
    tu_assert_error_contains("checkpoint: fn is NULL");
    assert_null(o[0]);
    assert_int_equal(ag_checkpoint(identity, NULL, &x, 1, NULL, 1), AG_EINVAL);
    assert_int_equal(ag_checkpoint(identity, NULL, &x, 1, o, 0), AG_EINVAL);
    tu_assert_error_contains("max_out 0");
    ag_tensor *nul = NULL;
    ag_clear_error();
    assert_int_equal(ag_checkpoint(identity, NULL, &nul, 1, o, 1), AG_EINVAL);
    tu_assert_error_contains("input 0 is NULL");
    assert_int_equal(ag_checkpoint(identity, NULL, NULL, 1, o, 1), AG_EINVAL);
    /* fn's failure: its status and message */
    int calls = 0;
    assert_int_equal(ag_checkpoint(failing, &calls, &x, 1, o, 2), AG_EINVAL);
    tu_assert_error_contains("failing: bad input on call 1");
    assert_null(o[0]);
    assert_null(o[1]);
    /* a recomputation that fails: the backward reports it */
    calls = 0;
    ag_tensor *y;
    assert_int_equal(ag_checkpoint(fails_second, &calls, &x, 1, &y, 1), 1);
    ag_scope_begin();
    ag_tensor *l = ag_sum_all(y);
    assert_int_equal(ag_backward(l, NULL, false), AG_EINVAL);
    tu_assert_error_contains("fails_second: call 2 refused");
    ag_scope_end();
    ag_tensor_free(y);
    /* an output that is the input itself gets a history of its own, the input keeps none */
    assert_int_equal(ag_checkpoint(identity, NULL, &x, 1, &y, 1), 1);
    assert_true(y != x);
    assert_null(ag_tensor_grad_fn_name(x));
    assert_string_equal(ag_tensor_grad_fn_name(y), "CheckpointFunctionBackward");
    ag_scope_begin();
    ag_tensor *g;
    l = ag_sum_all(ag_mul(y, y));
    assert_int_equal(ag_grad(&l, NULL, 1, &x, 1, &g, false, false), 0);
    /* d/dx sum(x*x) = 2x */
    ag_tensor *two_x = ag_mul_scalar(x, 2);
    assert_true(tu_max_abs_diff(g, two_x) == 0);
    ag_scope_end();
    ag_tensor_free(y);
    /* nothing requires grad: no node, plain outputs */
    ag_tensor *c = input_new(AG_F32);
    assert_int_equal(ag_checkpoint(fails_second, &(int){0}, &c, 1, &y, 1), 1);
    assert_null(ag_tensor_grad_fn_name(y));
    assert_false(ag_tensor_requires_grad(y));
    ag_tensor_free(y);
    ag_tensor_free(c);
    ag_tensor_free(x);
}

/* ---- GPT-2 with checkpointed blocks ---- */

static ag_module *gpt2_new(bool ckpt) {
    ag_gpt2_config gc = ag_gpt2_config_tiny();
    gc.n_layer = 2;
    gc.block_size = 8;
    gc.dropout = 0.1;
    gc.loss_only = true;
    gc.checkpoint_blocks = ckpt;
    ag_manual_seed(42);
    ag_module *m = ag_nn_gpt2(&gc);
    assert_non_null(m);
    return m;
}

/* Same names, same loss and gradients bit for bit (dropout on: the blocks' masks recomputed);
 * the export tags each block as its own region (ac_graph_id 1 and 2), nothing outside. */
static void test_gpt2_blocks(void **st) {
    (void)st;
    ag_module *m[2] = {gpt2_new(false), gpt2_new(true)};
    assert_false(ag_module_is_checkpointed(ag_module_child(m[0], "transformer.h.0")));
    assert_true(ag_module_is_checkpointed(ag_module_child(m[1], "transformer.h.0")));
    assert_true(ag_module_is_checkpointed(ag_module_child(m[1], "transformer.h.1")));
    ag_named_tensors nt[2];
    for (int k = 0; k < 2; k++)
        assert_int_equal(ag_module_named_parameters(m[k], true, &nt[k]), 0);
    assert_int_equal(nt[0].n, nt[1].n);
    for (int i = 0; i < nt[0].n; i++)
        assert_string_equal(nt[0].names[i], nt[1].names[i]);
    uint64_t s = 5;
    ag_tensor *idx = tu_rand_tensor(AG_F32, 2, (int64_t[]){2, 8}, 0, 255, tu_xorshift, &s);
    ag_tensor *in[2] = {ag_to_dtype(idx, AG_I64), NULL};
    ag_tensor *tg = tu_rand_tensor(AG_F32, 2, (int64_t[]){2, 8}, 0, 255, tu_xorshift, &s);
    in[1] = ag_to_dtype(tg, AG_I64);
    ag_tensor *loss[2];
    for (int k = 0; k < 2; k++) {
        ag_manual_seed(9);
        assert_int_equal(ag_module_call(m[k], in, 2, &loss[k], 1), 1);
        assert_int_equal(ag_backward(loss[k], NULL, false), 0);
    }
    assert_true(tu_max_abs_diff(loss[0], loss[1]) == 0);
    for (int i = 0; i < nt[0].n; i++) {
        ag_tensor *g0 = ag_tensor_grad(nt[0].tensors[i]), *g1 = ag_tensor_grad(nt[1].tensors[i]);
        assert_non_null(g0);
        assert_non_null(g1);
        if (tu_max_abs_diff(g0, g1) != 0)
            fail_msg("%s: gradients differ by %g", nt[0].names[i], tu_max_abs_diff(g0, g1));
    }
    /* the export: every tagged node is a forward node of block 0 (id 1) or block 1 (id 2),
     * and both blocks have some */
    ag_joint *j = ag_export_joint(m[1], in, 2, NULL, NULL, 0, NULL);
    assert_non_null(j);
    int count[3] = {0};
    for (ag_node *n = ag_graph_first(ag_joint_graph(j)); n; n = ag_node_next(n)) {
        ag_mval id = ag_node_meta_get(n, "ac_graph_id");
        if (ag_node_recompute(n) == AG_RECOMPUTE_NONE) {
            assert_int_equal(id.kind, AG_MV_NONE);
            continue;
        }
        assert_int_equal(ag_node_recompute(n), AG_MUST_RECOMPUTE);
        assert_int_equal(id.kind, AG_MV_INT);
        assert_true(id.u.i == 1 || id.u.i == 2);
        assert_string_equal(ag_node_partitioner_tag(n), "is_forward");
        ag_mval stack = ag_node_meta_get(n, "nn_module_stack");
        assert_int_equal(stack.kind, AG_MV_STR);
        const char *block = id.u.i == 1 ? "transformer.h.0" : "transformer.h.1";
        if (!strstr(stack.u.s, block))
            fail_msg("%s (ac_graph_id %lld) is not in %s: %s", ag_node_name(n), (long long)id.u.i,
                     block, stack.u.s);
        count[id.u.i]++;
    }
    assert_true(count[1] > 10 && count[1] == count[2]);
    ag_joint_free(j);
    for (int k = 0; k < 2; k++) {
        ag_tensor_free(loss[k]);
        ag_named_tensors_free(&nt[k]);
        ag_module_free(m[k]);
        ag_tensor_free(in[k]);
    }
    ag_tensor_free(idx);
    ag_tensor_free(tg);
}

/* ---- out of memory ---- */

/* A checkpointed forward with dropout and its backward: each allocation failing in turn fails
 * the step cleanly (ENOMEM, nothing leaked, the generator and the histories put back). */
typedef struct oom_case {
    ag_module *m;
    ag_tensor *x;
} oom_case;

static int oom_step(void *ud) {
    oom_case *oc = ud;
    ag_module *m = oc->m;
    ag_tensor *x = oc->x;
    ag_scope_begin();
    ag_tensor *y = NULL, *g[4] = {0};
    int rc = ag_module_call(m, &x, 1, &y, 1);
    if (rc == 1) {
        ag_tensor *wrt[4] = {ag_module_param(m, "w1"), ag_module_param(m, "w2"),
                             ag_module_param(m, "w3"), ag_module_param(m, "w4")};
        rc = ag_grad(&y, NULL, 1, wrt, 4, g, false, true);
    }
    ag_scope_end();
    return rc < 0 ? rc : 0;
}

static void test_out_of_memory(void **st) {
    (void)st;
    for (int mode = 1; mode <= 3; mode += 2) {
        ag_module *m = model_new(AG_F32, mode, 0.3, false);
        oom_case oc = {m, input_new(AG_F32)};
        tu_sweep_opts o = {.what = mode == 1 ? "checkpoint" : "nested checkpoint",
                           .one_thread = true};
        assert_true(tu_alloc_failure_sweep(oom_step, &oc, &o) > 10);
        o.persistent = true;
        assert_true(tu_alloc_failure_sweep(oom_step, &oc, &o) > 10);
        ag_tensor_free(oc.x);
        ag_module_free(m);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_eager_equals_plain),
        cmocka_unit_test(test_eager_node),
        cmocka_unit_test(test_export_tags),
        cmocka_unit_test(test_partition_and_compile),
        cmocka_unit_test(test_memory_budget),
        cmocka_unit_test(test_adjacent_regions_partition),
        cmocka_unit_test(test_gradcheck),
        cmocka_unit_test(test_module_checkpoint),
        cmocka_unit_test(test_gpt2_blocks),
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_out_of_memory),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
