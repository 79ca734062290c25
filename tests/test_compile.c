/* ag_compile_joint: the compiled callable against eager on every zoo model, for both
 * partitioners and budgets 0, 0.5 and 1; the transform path (scale every parameter gradient
 * in the joint graph, set it back, compile); runtime wrappers (buffer write-back, missing
 * output gradients, saved-input version checks, backward twice); the hooks (a partition
 * function and compilers written here, a pair partitioned ahead). */
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

static bool max_abs_is_zero(const ag_tensor *t) {
    for (int64_t i = 0; i < ag_tensor_numel(t); i++)
        if (ag_tensor_item_at(t, i) != 0)
            return false;
    return true;
}

static double rel(const ag_tensor *ref, const ag_tensor *got) {
    if (!ref || !got)
        return ref == got ? 0 : INFINITY;
    if (ag_tensor_subclass(ref) || ag_tensor_subclass(got)) { /* two_tensor: by inner tensors */
        ag_tensor *a[8], *b[8];
        int na = ag_subclass_flatten_tensors((ag_tensor *const *)&ref, 1, a, 8);
        int nb = ag_subclass_flatten_tensors((ag_tensor *const *)&got, 1, b, 8);
        if (ag_tensor_subclass(ref) != ag_tensor_subclass(got) || na != nb || na > 8)
            return INFINITY;
        double m = 0;
        for (int i = 0; i < na; i++)
            m = fmax(m, rel(a[i], b[i]));
        return m;
    }
    double m = 1;
    for (int64_t i = 0; i < ag_tensor_numel(ref); i++)
        m = fmax(m, fabs(ag_tensor_item_at(ref, i)));
    return tu_max_abs_diff(ref, got) / m;
}

/* Runs model `name` eagerly and compiled for two SGD steps; asserts outputs, grads and
 * buffers agree to tol. */
static void check_model(const char *name, const ag_compile_opts *co, double tol) {
    ag_module *me, *mc;
    ag_tensor *ie[8], *ic[8];
    int ne, nc;
    assert_int_equal(ag_zoo_build(name, NULL, &me, ie, 8, &ne), 0);
    assert_int_equal(ag_zoo_build(name, NULL, &mc, ic, 8, &nc), 0);
    ag_joint *j = ag_export_joint(mc, ic, nc, NULL, NULL, 0, NULL);
    assert_non_null(j);
    ag_compiled *c = ag_compile_joint(j, co);
    if (!c)
        print_error("%s: compile: %s\n", name, ag_last_error());
    assert_non_null(c);
    ag_optim *oe = ag_optim_sgd(me, 1e-2, 0, 0, false), *oc = ag_optim_sgd(mc, 1e-2, 0, 0, false);
    for (int step = 0; step < 2; step++) {
        ag_scope_begin();
        ag_tensor *a[16], *b[16];
        /* Both calls start from the same generator state (they draw the same numbers) and
         * leave it at the same offset. */
        uint64_t seed, offset, eager_seed, eager_offset, cseed, coffset;
        ag_rng_get_state(&seed, &offset);
        int n = ag_module_call(me, ie, ne, a, 16);
        ag_rng_get_state(&eager_seed, &eager_offset);
        ag_rng_set_state(seed, offset);
        int m = ag_compiled_call_module(c, mc, ic, nc, b, 16);
        if (m < 0)
            print_error("%s: call: %s\n", name, ag_last_error());
        assert_int_equal(m, n);
        for (int i = 0; i < ne; i++) /* inputs the model mutates (alias_views) match too */
            assert_true(rel(ie[i], ic[i]) <= tol);
        ag_rng_get_state(&cseed, &coffset);
        assert_true(cseed == eager_seed && coffset == eager_offset);
        ag_tensor *le = NULL, *lc = NULL;
        for (int k = 0; k < n; k++) {
            double d = rel(a[k], b[k]);
            if (!(d <= tol))
                print_error("%s: output %d differs by %g\n", name, k, d);
            assert_true(d <= tol);
            assert_int_equal(ag_tensor_requires_grad(a[k]), ag_tensor_requires_grad(b[k]));
            if (!ag_tensor_requires_grad(a[k]))
                continue;
            ag_tensor *x = ag_sum_all(ag_mul_scalar(a[k], 0.5 + k)),
                      *y = ag_sum_all(ag_mul_scalar(b[k], 0.5 + k));
            le = le ? ag_add(le, x) : x;
            lc = lc ? ag_add(lc, y) : y;
        }
        if (le) {
            assert_int_equal(ag_backward(le, NULL, false), 0);
            if (ag_backward(lc, NULL, false))
                print_error("%s: backward: %s\n", name, ag_last_error());
        }
        ag_named_tensors pe, pc, be, bc;
        assert_int_equal(ag_module_named_parameters(me, true, &pe), 0);
        assert_int_equal(ag_module_named_parameters(mc, true, &pc), 0);
        for (int i = 0; i < pe.n; i++) {
            double d = rel(ag_tensor_grad(pe.tensors[i]), ag_tensor_grad(pc.tensors[i]));
            if (!(d <= tol))
                print_error("%s: grad of %s differs by %g\n", name, pe.names[i], d);
            assert_true(d <= tol);
        }
        assert_int_equal(ag_module_named_buffers(me, true, &be), 0);
        assert_int_equal(ag_module_named_buffers(mc, true, &bc), 0);
        for (int i = 0; i < be.n; i++)
            assert_true(rel(be.tensors[i], bc.tensors[i]) <= tol);
        ag_named_tensors_free(&pe);
        ag_named_tensors_free(&pc);
        ag_named_tensors_free(&be);
        ag_named_tensors_free(&bc);
        assert_int_equal(ag_optim_step(oe), 0);
        assert_int_equal(ag_optim_step(oc), 0);
        ag_optim_zero_grad(oe);
        ag_optim_zero_grad(oc);
        ag_scope_end();
    }
    ag_optim_free(oe);
    ag_optim_free(oc);
    ag_compiled_free(c);
    ag_joint_free(j);
    ag_module_free(me);
    ag_module_free(mc);
    for (int i = 0; i < ne; i++)
        ag_tensor_free(ie[i]);
    for (int i = 0; i < nc; i++)
        ag_tensor_free(ic[i]);
}

static void test_zoo_against_eager(void **st) {
    (void)st;
    const double budgets[] = {0.0, 0.5, 1.0};
    for (int z = 0; z < ag_zoo_count(); z++) {
        for (int p = 0; p < 2; p++)
            for (int b = 0; b < 3; b++) {
                if (p == 0 && b != 2)
                    continue; /* the default partitioner has no budget */
                ag_compile_opts co = {
                    .partition = {.partitioner = p ? AG_PARTITION_MINCUT : AG_PARTITION_DEFAULT,
                                  .memory_budget = ag_memory_budget(budgets[b])}};
                check_model(ag_zoo_name(z), &co, 1e-5);
            }
    }
}

/* float64 to 1e-12: a small MLP in double precision. */
static int mlp64_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out,
                         int max_out) {
    (void)nin;
    (void)max_out;
    ag_scope_begin();
    ag_tensor *w1 = ag_module_param(m, "w1"), *w2 = ag_module_param(m, "w2");
    ag_tensor *h = ag_tanh(ag_mm(in[0], w1));
    ag_tensor *a = ag_mm(h, w2), *b = ag_mm(h, w2); /* in this order on every compiler */
    out[0] = ag_tensor_keep(ag_mean_all(ag_mul(a, b)));
    ag_scope_end();
    return out[0] ? 1 : ag_last_status();
}

static void test_float64_exact(void **st) {
    (void)st;
    ag_manual_seed(11);
    ag_module *m = ag_module_new("MLP64", mlp64_forward, NULL, NULL);
    ag_tensor *p1 = ag_randn(AG_F64, 2, (int64_t[]){5, 7}),
              *p2 = ag_randn(AG_F64, 2, (int64_t[]){7, 3});
    assert_int_equal(ag_module_register_parameter(m, "w1", p1), 0);
    assert_int_equal(ag_module_register_parameter(m, "w2", p2), 0);
    ag_tensor_free(p1); /* the module holds its own references */
    ag_tensor_free(p2);
    ag_tensor *x = ag_randn(AG_F64, 2, (int64_t[]){4, 5});
    ag_joint *j = ag_export_joint(m, &x, 1, NULL, NULL, 0, NULL);
    assert_non_null(j);
    for (int p = 0; p < 2; p++) {
        ag_compile_opts co = {
            .partition = {.partitioner = p ? AG_PARTITION_MINCUT : AG_PARTITION_DEFAULT,
                          .memory_budget = 0.5}};
        ag_compiled *c = ag_compile_joint(j, &co);
        assert_non_null(c);
        ag_scope_begin();
        ag_tensor *ye, *yc;
        assert_int_equal(ag_module_call(m, &x, 1, &ye, 1), 1);
        ag_tensor *w1 = ag_module_param(m, "w1"), *w2 = ag_module_param(m, "w2");
        ag_tensor *ge[2], *gc[2];
        assert_int_equal(ag_grad(&ye, NULL, 1, (ag_tensor *[]){w1, w2}, 2, ge, false, false), 0);
        assert_int_equal(ag_compiled_call_module(c, m, &x, 1, &yc, 1), 1);
        assert_int_equal(ag_grad(&yc, NULL, 1, (ag_tensor *[]){w1, w2}, 2, gc, false, false), 0);
        assert_true(rel(ye, yc) <= 1e-12);
        assert_true(rel(ge[0], gc[0]) <= 1e-12);
        assert_true(rel(ge[1], gc[1]) <= 1e-12);
        ag_scope_end();
        ag_compiled_free(c);
    }
    ag_joint_free(j);
    ag_module_free(m);
    ag_tensor_free(x);
}

/* The transform path: every parameter gradient is multiplied by 0.5 inside the joint graph. */
static void test_transform_halves_gradients(void **st) {
    (void)st;
    ag_module *m;
    ag_tensor *in[8];
    int nin;
    assert_int_equal(ag_zoo_build("linear", NULL, &m, in, 8, &nin), 0);
    ag_joint *j = ag_export_joint(m, in, nin, NULL, NULL, 0, NULL);
    assert_non_null(j);
    ag_graph *g = ag_graph_copy(ag_joint_graph(j));
    ag_fx_pairs *pg = ag_fx_param_and_grad_nodes(g);
    assert_non_null(pg);
    assert_int_equal(ag_fx_pairs_count(pg), 2);
    ag_node *out = ag_graph_output_node(g);
    for (int i = 0; i < ag_fx_pairs_count(pg); i++) {
        ag_node *grad = ag_fx_pairs_second(pg, i);
        assert_non_null(grad);
        ag_graph_insert_before(g, out);
        ag_node *half = ag_graph_call(g, ag_op_find("mul.Scalar"),
                                      (ag_garg[]){AG_GA_N(grad), AG_GA_F(0.5)}, 2, NULL);
        assert_non_null(half);
        assert_int_equal(ag_node_set_partitioner_tag(half, "is_backward"), 0);
        /* Point the output at the scaled gradient (only the output's use of grad). */
        const ag_garg *outs = ag_node_arg(out, 0);
        ag_node *nodes[16];
        memcpy(nodes, outs->u.nodes, sizeof(ag_node *) * (size_t)outs->n);
        for (int k = 0; k < outs->n; k++)
            if (nodes[k] == grad)
                nodes[k] = half;
        assert_int_equal(ag_node_set_arg(out, 0, AG_GA_NODES(nodes, outs->n)), 0);
    }
    ag_graph_insert_at_end(g);
    ag_fx_pairs_free(pg);
    assert_int_equal(ag_joint_set_graph(j, g), 0);
    ag_compiled *c = ag_compile_joint(j, NULL);
    assert_non_null(c);
    ag_scope_begin();
    ag_tensor *ye, *yc;
    assert_int_equal(ag_module_call(m, in, nin, &ye, 1), 1);
    ag_named_tensors ps;
    assert_int_equal(ag_module_named_parameters(m, true, &ps), 0);
    ag_tensor *ge[2], *gc[2];
    assert_int_equal(
        ag_grad(&ye, (ag_tensor *[]){ag_ones_like(ye)}, 1, ps.tensors, 2, ge, false, false), 0);
    assert_int_equal(ag_compiled_call_module(c, m, in, nin, &yc, 1), 1);
    assert_int_equal(
        ag_grad(&yc, (ag_tensor *[]){ag_ones_like(yc)}, 1, ps.tensors, 2, gc, false, false), 0);
    for (int i = 0; i < 2; i++)
        for (int64_t e = 0; e < ag_tensor_numel(ge[i]); e++)
            assert_true(ag_tensor_item_at(gc[i], e) == 0.5f * (float)ag_tensor_item_at(ge[i], e));
    ag_named_tensors_free(&ps);
    ag_scope_end();
    ag_compiled_free(c);
    ag_joint_free(j);
    ag_module_free(m);
    for (int i = 0; i < nin; i++)
        ag_tensor_free(in[i]);
}

/* Runtime wrappers: a missing output gradient is zero; backward twice is refused; an input saved
 * for backward and modified in place before it is an error. */
static void test_runtime_wrappers(void **st) {
    (void)st;
    ag_module *m;
    ag_tensor *in[8];
    int nin;
    assert_int_equal(ag_zoo_build("multi_output", NULL, &m, in, 8, &nin), 0);
    ag_joint *j = ag_export_joint(m, in, nin, NULL, NULL, 0, NULL);
    ag_compiled *c = ag_compile_joint(j, NULL);
    assert_non_null(c);
    ag_scope_begin();
    ag_tensor *o[2];
    assert_int_equal(ag_compiled_call_module(c, m, in, nin, o, 2), 2);
    assert_string_equal(ag_tensor_grad_fn_name(o[0]), "CompiledFunction");
    ag_tensor *loss = ag_sum_all(o[0]); /* o[1] gets no gradient: materialized as zeros */
    assert_int_equal(ag_backward(loss, NULL, true), 0);
    /* linear2 only feeds o[1], whose missing gradient became zeros: its .grad is zeros (as an
     * autograd.Function returning zero grads gives), not absent. */
    ag_tensor *g2 = ag_tensor_grad(ag_module_param(m, "linear2.weight"));
    assert_non_null(g2);
    assert_true(max_abs_is_zero(g2));
    assert_non_null(ag_tensor_grad(ag_module_param(m, "linear1.weight")));
    assert_int_equal(ag_backward(loss, NULL, false), 0);         /* retained once */
    assert_int_equal(ag_backward(loss, NULL, false), AG_ESTATE); /* then released */
    tu_assert_error_contains("second time");
    ag_scope_end();

    /* x is saved by the compiled graph (the weight gradients' mm reads it). */
    ag_scope_begin();
    assert_int_equal(ag_compiled_call_module(c, m, in, nin, o, 2), 2);
    bool prev = ag_set_grad_enabled(false);
    ag_add_scalar_(in[0], 1.0);
    ag_set_grad_enabled(prev);
    int rc = ag_backward(ag_sum_all(o[1]), NULL, false);
    assert_int_equal(rc, AG_ESTATE);
    tu_assert_error_contains("modified by an inplace operation");
    ag_scope_end();
    ag_compiled_free(c);
    ag_joint_free(j);
    ag_module_free(m);
    for (int i = 0; i < nin; i++)
        ag_tensor_free(in[i]);
}

/* ---- hooks: compilers, a partition function, a pre-partitioned pair ---- */

/* A partition function written here, unlike ours: the forward saves only the primals and the
 * backward recomputes the whole forward from them (a joint without tokens or philox inputs). */
static ag_graph *with_outputs(const ag_graph *joint, ag_node **keep, ag_desc **descs, int n,
                              ag_section drop_inputs) {
    ag_graph *g = ag_graph_copy(joint);
    ag_node **ph;
    ag_layout L;
    assert_int_equal(ag_graph_layout(joint, 0, &L), 0);
    ag_node *mapped[512];
    for (int i = 0; i < n; i++)
        mapped[i] = keep[i] ? ag_graph_find(g, ag_node_name(keep[i])) : NULL;
    assert_int_equal(ag_graph_erase(g, ag_graph_output_node(g)), 0);
    ag_node *o = ag_graph_output(g, mapped, n);
    assert_non_null(o);
    assert_int_equal(ag_node_set_output_descs(o, descs, n), 0);
    assert_true(ag_graph_dce(g) >= 0);
    int nph = ag_graph_placeholders(g, &ph);
    ag_node *drop[512];
    int nd = 0;
    for (int i = 0; i < nph; i++)
        if (ag_desc_section(ag_node_desc(ph[i])) == drop_inputs)
            drop[nd++] = ph[i];
    for (int i = 0; i < nd; i++)
        assert_int_equal(ag_graph_erase(g, drop[i]), 0);
    return g;
}

static int recompute_all(const ag_graph *joint, int nfw, void *user, ag_graph **fw, ag_graph **bw) {
    int *calls = user;
    ++*calls;
    ag_layout L;
    assert_int_equal(ag_graph_layout(joint, 0, &L), 0);
    assert_int_equal(ag_layout_num_fw_outputs(&L), nfw);
    ag_node **ph, *out = ag_graph_output_node(joint);
    assert_int_equal(ag_graph_placeholders(joint, &ph), L.ninputs);
    ag_node *keep[512];
    ag_desc *descs[512];
    int n = 0, p0 = ag_layout_start(&L, AG_SEC_IN_PRIMALS),
        np = ag_layout_count(&L, AG_SEC_IN_PRIMALS);
    for (int k = 0; k < nfw; k++) {
        keep[n] = ag_node_arg(out, 0)->u.nodes[k];
        descs[n++] = ag_desc_retain(ag_node_output_desc(out, k));
    }
    for (int i = 0; i < np; i++) {
        keep[n] = ph[p0 + i];
        descs[n++] = ag_desc_saved_for_backwards(i);
    }
    *fw = with_outputs(joint, keep, descs, n, AG_SEC_IN_TANGENTS);
    for (int k = 0; k < n; k++)
        ag_desc_release(descs[k]);
    n = 0;
    for (int k = nfw; k < L.noutputs; k++) {
        keep[n] = ag_node_arg(out, 0)->u.nodes[k];
        descs[n++] = ag_desc_retain(ag_node_output_desc(out, k));
    }
    *bw = with_outputs(joint, keep, descs, n, AG_SEC_NONE); /* primals are the saved values */
    for (int k = 0; k < n; k++)
        ag_desc_release(descs[k]);
    return 0;
}

static void test_hook_partition_function(void **st) {
    (void)st;
    int models = 0;
    for (int z = 0; z < ag_zoo_count(); z++) {
        ag_module *m;
        ag_tensor *in[8];
        int nin;
        assert_int_equal(ag_zoo_build(ag_zoo_name(z), NULL, &m, in, 8, &nin), 0);
        ag_joint *j = ag_export_joint(m, in, nin, NULL, NULL, 0, NULL);
        assert_non_null(j);
        const ag_layout *L = ag_joint_layout(j);
        bool plain = ag_joint_needs_autograd(j) && !ag_layout_count(L, AG_SEC_IN_FW_TOKENS) &&
                     !ag_layout_count(L, AG_SEC_IN_FW_RNG);
        ag_joint_free(j);
        ag_module_free(m);
        for (int i = 0; i < nin; i++)
            ag_tensor_free(in[i]);
        if (!plain)
            continue;
        int calls = 0;
        ag_compile_opts co = {.partition_fn = recompute_all, .partition_user = &calls};
        check_model(ag_zoo_name(z), &co, 1e-5);
        assert_int_equal(calls, 1);
        models++;
    }
    assert_true(models >= 8);
}

/* A forward compiler that counts the call nodes it is given and rewrites its copy of the graph:
 * the first user output doubled (a mul node before the output). A backward compiler that only
 * counts. Both run the interpreter on what they made. */
typedef struct counter {
    int calls, call_nodes;
    bool rewrite;
} counter;

static int interp_run(void *self, ag_tensor *const *in, int nin, ag_tensor **outs, int max_out) {
    return ag_graph_run(self, in, nin, outs, max_out);
}
static void graph_destroy(void *self) {
    ag_graph_free(self);
}

static int counting_compiler(const ag_graph *g, void *user, ag_runnable *out) {
    counter *k = user;
    k->calls++;
    for (ag_node *n = ag_graph_first(g); n; n = ag_node_next(n))
        k->call_nodes += ag_node_kind_of(n) == AG_NODE_CALL;
    ag_graph *h = ag_graph_copy(g);
    if (!h)
        return ag_last_status();
    if (k->rewrite) {
        ag_layout L;
        assert_int_equal(ag_graph_layout(h, 0, &L), 0);
        ag_node *o = ag_graph_output_node(h);
        const ag_garg *outs = ag_node_arg(o, 0);
        ag_node *nodes[64];
        memcpy(nodes, outs->u.nodes, sizeof(ag_node *) * (size_t)outs->n);
        int u = ag_layout_start(&L, AG_SEC_OUT_USER);
        ag_graph_insert_before(h, o);
        nodes[u] = ag_graph_call(h, ag_op_find("mul.Scalar"),
                                 (ag_garg[]){AG_GA_N(nodes[u]), AG_GA_F(2.0)}, 2, "doubled");
        assert_non_null(nodes[u]);
        assert_int_equal(ag_node_set_arg(o, 0, AG_GA_NODES(nodes, outs->n)), 0);
        ag_graph_insert_at_end(h);
    }
    *out = (ag_runnable){interp_run, graph_destroy, NULL, h};
    return 0;
}

static void test_hook_compilers(void **st) {
    (void)st;
    ag_module *m;
    ag_tensor *in[8];
    int nin;
    assert_int_equal(ag_zoo_build("mlp", NULL, &m, in, 8, &nin), 0);
    ag_joint *j = ag_export_joint(m, in, nin, NULL, NULL, 0, NULL);
    assert_non_null(j);
    counter fk = {.rewrite = true}, bk = {0};
    ag_compile_opts co = {.fw_compiler = counting_compiler,
                          .fw_compiler_user = &fk,
                          .bw_compiler = counting_compiler,
                          .bw_compiler_user = &bk};
    ag_compiled *c = ag_compile_joint(j, &co);
    assert_non_null(c);
    assert_int_equal(fk.calls, 1);
    assert_int_equal(bk.calls, 1);
    /* Each compiler saw its half: the call nodes of the graphs the callable keeps. */
    int nf = 0, nb = 0;
    for (ag_node *n = ag_graph_first(ag_compiled_forward_graph(c)); n; n = ag_node_next(n))
        nf += ag_node_kind_of(n) == AG_NODE_CALL;
    for (ag_node *n = ag_graph_first(ag_compiled_backward_graph(c)); n; n = ag_node_next(n))
        nb += ag_node_kind_of(n) == AG_NODE_CALL;
    assert_int_equal(fk.call_nodes, nf);
    assert_int_equal(bk.call_nodes, nb);
    assert_true(nf > 0 && nb > 0);
    assert_int_equal(ag_compiled_peak_bytes(c, false), -1); /* the runnable does not say */
    /* The callable ran what the compilers made: the output doubled, the gradients those of the
     * undoubled output (the backward was compiled from the joint's own). */
    ag_scope_begin();
    ag_tensor *ye, *yc;
    assert_int_equal(ag_module_call(m, in, nin, &ye, 1), 1);
    ag_named_tensors ps;
    assert_int_equal(ag_module_named_parameters(m, true, &ps), 0);
    ag_tensor *ge[8], *gc[8];
    assert_int_equal(
        ag_grad(&ye, (ag_tensor *[]){ag_ones_like(ye)}, 1, ps.tensors, ps.n, ge, false, false), 0);
    assert_int_equal(ag_compiled_call_module(c, m, in, nin, &yc, 1), 1);
    assert_int_equal(
        ag_grad(&yc, (ag_tensor *[]){ag_ones_like(yc)}, 1, ps.tensors, ps.n, gc, false, false), 0);
    for (int64_t e = 0; e < ag_tensor_numel(ye); e++)
        assert_true(ag_tensor_item_at(yc, e) == 2 * ag_tensor_item_at(ye, e) ||
                    fabs(ag_tensor_item_at(yc, e) - 2 * ag_tensor_item_at(ye, e)) <
                        1e-5 * (1 + fabs(ag_tensor_item_at(ye, e))));
    for (int i = 0; i < ps.n; i++)
        assert_true(rel(ge[i], gc[i]) < 1e-5);
    ag_named_tensors_free(&ps);
    ag_scope_end();
    ag_compiled_free(c);
    /* The built-in compilers through the hook are what the flags choose. */
    ag_compile_opts ci = {.fw_compiler = ag_compiler_interpreter, .bw_compiler = ag_compiler_plan};
    c = ag_compile_joint(j, &ci);
    assert_non_null(c);
    assert_int_equal(ag_compiled_peak_bytes(c, false), -1);
    assert_true(ag_compiled_peak_bytes(c, true) > 0);
    ag_compiled_free(c);
    ag_joint_free(j);
    ag_module_free(m);
    for (int i = 0; i < nin; i++)
        ag_tensor_free(in[i]);
    check_model("cnn", &ci, 1e-5);
}

/* A pair partitioned elsewhere (ours, at budget 0, run ahead) compiles to what partitioning in
 * ag_compile_joint gives; a pair that is not this joint's is refused with the output named. */
static void test_hook_prepartitioned(void **st) {
    (void)st;
    const char *models[] = {"mlp", "convbn", "dropout_mlp", "effects", "alias_views"};
    for (int k = 0; k < 5; k++) {
        ag_module *m;
        ag_tensor *in[8];
        int nin;
        assert_int_equal(ag_zoo_build(models[k], NULL, &m, in, 8, &nin), 0);
        ag_joint *j = ag_export_joint(m, in, nin, NULL, NULL, 0, NULL);
        assert_non_null(j);
        ag_partition_opts po = {.partitioner = AG_PARTITION_MINCUT,
                                .memory_budget = AG_MEMORY_BUDGET_ZERO};
        ag_graph *fw, *bw;
        assert_int_equal(
            ag_partition(ag_joint_graph(j), ag_joint_num_fw_outputs(j), &po, &fw, &bw, NULL), 0);
        ag_joint_free(j);
        ag_module_free(m);
        for (int i = 0; i < nin; i++)
            ag_tensor_free(in[i]);
        ag_compile_opts co = {.fw_graph = fw, .bw_graph = bw};
        check_model(models[k], &co, 1e-5);
        ag_graph_free(fw);
        ag_graph_free(bw);
    }
    /* mlp's halves for the linear model's joint */
    ag_module *m, *m2;
    ag_tensor *in[8], *in2[8];
    int nin, nin2;
    assert_int_equal(ag_zoo_build("mlp", NULL, &m, in, 8, &nin), 0);
    assert_int_equal(ag_zoo_build("multi_output", NULL, &m2, in2, 8, &nin2), 0);
    ag_joint *j = ag_export_joint(m, in, nin, NULL, NULL, 0, NULL);
    ag_joint *j2 = ag_export_joint(m2, in2, nin2, NULL, NULL, 0, NULL);
    ag_graph *fw, *bw;
    assert_int_equal(
        ag_partition(ag_joint_graph(j), ag_joint_num_fw_outputs(j), NULL, &fw, &bw, NULL), 0);
    ag_compile_opts co = {.fw_graph = fw, .bw_graph = bw};
    assert_null(ag_compile_joint(j2, &co));
    assert_non_null(strstr(ag_last_error(),
                           "forward output 1 is SavedForBackwardsAOTOutput(idx=0); the joint's is "
                           "PlainAOTOutput(idx=1)"));
    co.bw_graph = NULL;
    assert_null(ag_compile_joint(j, &co));
    assert_non_null(strstr(ag_last_error(), "needs both"));
    ag_graph_free(fw);
    ag_graph_free(bw);
    ag_joint_free(j);
    ag_joint_free(j2);
    ag_module_free(m);
    ag_module_free(m2);
    for (int i = 0; i < nin; i++)
        ag_tensor_free(in[i]);
    for (int i = 0; i < nin2; i++)
        ag_tensor_free(in2[i]);
}

/* Hooks that return nonsense are refused with a message, never run: a partition function that
 * returns no graphs, one that returns the joint for both halves, a compiler that returns no run
 * function, a compiler that fails. */
static int part_none(const ag_graph *joint, int nfw, void *user, ag_graph **fw, ag_graph **bw) {
    (void)joint, (void)nfw, (void)user;
    *fw = *bw = NULL;
    return 0;
}
static int part_joint_twice(const ag_graph *joint, int nfw, void *user, ag_graph **fw,
                            ag_graph **bw) {
    (void)nfw, (void)user;
    *fw = ag_graph_copy(joint);
    *bw = ag_graph_copy(joint);
    return 0;
}
static int compiler_no_run(const ag_graph *g, void *user, ag_runnable *out) {
    (void)g, (void)user;
    *out = (ag_runnable){0};
    return 0;
}
static int compiler_fails(const ag_graph *g, void *user, ag_runnable *out) {
    (void)g, (void)user, (void)out;
    return ag_set_error(AG_ENOTSUP, "my_backend: no kernel for this graph");
}

static void test_hook_nonsense_refused(void **st) {
    (void)st;
    ag_module *m;
    ag_tensor *in[8];
    int nin;
    assert_int_equal(ag_zoo_build("mlp", NULL, &m, in, 8, &nin), 0);
    ag_joint *j = ag_export_joint(m, in, nin, NULL, NULL, 0, NULL);
    assert_non_null(j);
    ag_compile_opts a = {.partition_fn = part_none};
    assert_null(ag_compile_joint(j, &a));
    assert_non_null(strstr(ag_last_error(), "the partition function returned no forward graph"));
    ag_compile_opts b = {.partition_fn = part_joint_twice};
    assert_null(ag_compile_joint(j, &b));
    assert_non_null(strstr(ag_last_error(), "compile: the forward graph takes 7 primals, 0 forward "
                                            "tokens and 1 backward inputs"));
    ag_compile_opts c1 = {.fw_compiler = compiler_no_run};
    assert_null(ag_compile_joint(j, &c1));
    assert_non_null(strstr(ag_last_error(), "the forward compiler returned no run function"));
    ag_compile_opts c2 = {.bw_compiler = compiler_fails};
    assert_null(ag_compile_joint(j, &c2));
    assert_non_null(strstr(ag_last_error(), "my_backend: no kernel for this graph"));
    ag_joint_free(j);
    ag_module_free(m);
    for (int i = 0; i < nin; i++)
        ag_tensor_free(in[i]);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_zoo_against_eager),
        cmocka_unit_test(test_float64_exact),
        cmocka_unit_test(test_transform_halves_gradients),
        cmocka_unit_test(test_runtime_wrappers),
        cmocka_unit_test(test_hook_partition_function),
        cmocka_unit_test(test_hook_compilers),
        cmocka_unit_test(test_hook_prepartitioned),
        cmocka_unit_test(test_hook_nonsense_refused),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
