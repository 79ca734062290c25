/* Views and aliasing through the whole pipeline (issue 6, part 2): duplicate inputs, inputs
 * that alias each other while one is mutated (ViewBaseAOTInput / SyntheticBaseAOTInput),
 * outputs aliasing inputs or intermediates (IntermediateBaseAOTOutput), metadata mutations
 * (InputMutationAOTOutput, MetadataMutationAOTOutput) and the in-place view ops behind them.
 *
 * Each case asserts the exact placeholder and output descriptor lists upstream produces for
 * the same function (spec sections 3, 6.1-6.3), then runs the compiled callable against eager
 * on identical inputs: outputs, gradients, the caller's tensors after the call, and storage
 * sharing of outputs that alias inputs or each other. */
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

/* ---- helpers ---- */

/* The node feeding output i. */
static ag_node *output_node(const ag_graph *g, int i) {
    return ag_node_arg(ag_graph_output_node(g), 0)->u.nodes[i];
}

static ag_joint *export_or_fail(ag_module *m, ag_tensor **in, int nin) {
    ag_joint *j = ag_export_joint(m, in, nin, NULL, NULL, 0, NULL);
    if (!j)
        fail_msg("export: %s", ag_last_error());
    return j;
}

static ag_compiled *compile_or_fail(const ag_joint *j, bool mincut, double budget) {
    ag_compile_opts co = {
        .partition = {.partitioner = mincut ? AG_PARTITION_MINCUT : AG_PARTITION_DEFAULT,
                      .memory_budget = ag_memory_budget(budget)}};
    ag_compiled *c = ag_compile_joint(j, &co);
    if (!c)
        fail_msg("compile: %s", ag_last_error());
    return c;
}

static void expect_same(const char *what, const ag_tensor *want, const ag_tensor *got) {
    if (!want || !got) {
        if (want != got)
            fail_msg("%s: one of the tensors is missing", what);
        return;
    }
    assert_int_equal(ag_tensor_ndim(got), ag_tensor_ndim(want));
    for (int d = 0; d < ag_tensor_ndim(want); d++)
        assert_int_equal(ag_tensor_sizes(got)[d], ag_tensor_sizes(want)[d]);
    double diff = tu_max_abs_diff(want, got);
    if (!(diff <= 1e-6))
        fail_msg("%s differs by %g", what, diff);
}

static void expect_geometry(const ag_tensor *t, int ndim, const int64_t *sizes,
                            const int64_t *strides, int64_t offset) {
    assert_int_equal(ag_tensor_ndim(t), ndim);
    for (int d = 0; d < ndim; d++) {
        assert_int_equal(ag_tensor_sizes(t)[d], sizes[d]);
        assert_int_equal(ag_tensor_strides(t)[d], strides[d]);
    }
    assert_int_equal(ag_tensor_offset(t), offset);
}

/* A module running fwd, with a parameter w of shape wsizes (none when wdim < 0) drawn after
 * seeding the generator with `seed`, so that two builds are identical. */
static ag_module *module(const char *type, ag_forward_fn fwd, int wdim, const int64_t *wsizes,
                         uint64_t seed) {
    ag_manual_seed(seed);
    ag_module *m = ag_module_new(type, fwd, NULL, NULL);
    assert_non_null(m);
    if (wdim >= 0) {
        ag_tensor *w = ag_randn(AG_F32, wdim, wsizes);
        assert_int_equal(ag_module_register_parameter(m, "w", w), 0);
        ag_tensor_free(w);
    }
    return m;
}

/* Ends the forward's scope handing res[0..n) to the caller. */
static int give(ag_tensor *const *res, int n, ag_tensor **out) {
    int rc = n;
    for (int i = 0; i < n; i++)
        if (!res[i])
            rc = ag_last_status() < 0 ? ag_last_status() : AG_EINVAL;
    for (int i = 0; i < n && rc >= 0; i++)
        out[i] = ag_tensor_keep(res[i]);
    ag_scope_end();
    return rc;
}

static ag_tensor *W(ag_module *m) {
    return ag_module_param(m, "w");
}

static ag_tensor *seq(int ndim, const int64_t *sizes) { /* 1, 2, 3, ... */
    int64_t n = 1;
    for (int d = 0; d < ndim; d++)
        n *= sizes[d];
    double v[64];
    for (int64_t i = 0; i < n; i++)
        v[i] = (double)(i + 1);
    return tu_tensor(AG_F32, ndim, sizes, v);
}

/* loss = sum_k sum(out_k * (0.5 + 0.25 k)) over outputs that require grad; NULL if none. */
static ag_tensor *loss_of(ag_tensor *const *out, int n) {
    ag_tensor *l = NULL;
    for (int k = 0; k < n; k++) {
        if (!ag_tensor_requires_grad(out[k]))
            continue;
        ag_tensor *x = ag_sum_all(ag_mul_scalar(out[k], 0.5 + 0.25 * k));
        l = l ? ag_add(l, x) : x;
    }
    return l;
}

/* ---- duplicate inputs ---- */

/* (x, y) -> x * y + w */
static int dup_fwd(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)nin, (void)max_out;
    ag_scope_begin();
    ag_tensor *y = ag_add(ag_mul(in[0], in[1]), W(m));
    return give(&y, 1, out);
}

/* The same tensor passed twice and not mutated: upstream's strategy 1 keeps both slots as
 * separate leaves, each with its placeholder and gradient; the callable sums them into the
 * one tensor's .grad, and also works for two distinct tensors. */
static void test_duplicate_input_not_mutated(void **st) {
    (void)st;
    ag_module *mx = module("Dup", dup_fwd, 1, (int64_t[]){3}, 1);
    ag_module *me = module("Dup", dup_fwd, 1, (int64_t[]){3}, 1);
    ag_tensor *x = tu_leaf(AG_F32, 1, (int64_t[]){3}, (double[]){1, -2, 3});
    ag_tensor *xe = tu_leaf(AG_F32, 1, (int64_t[]){3}, (double[]){1, -2, 3});
    ag_joint *j = export_or_fail(mx, (ag_tensor *[]){x, x}, 2);
    const ag_graph *g = ag_joint_graph(j);
    tu_expect_placeholder_descs(g,
                                (const char *[]){"ParamAOTInput(target='w')",
                                                 "PlainAOTInput(idx=0)", "PlainAOTInput(idx=1)",
                                                 "TangentAOTInput(output=PlainAOTOutput(idx=0))"},
                                4);
    tu_expect_output_descs(g,
                           (const char *[]){"PlainAOTOutput(idx=0)",
                                            "GradAOTOutput(grad_of=ParamAOTInput(target='w'))",
                                            "GradAOTOutput(grad_of=PlainAOTInput(idx=0))",
                                            "GradAOTOutput(grad_of=PlainAOTInput(idx=1))"},
                           4);
    assert_int_equal(ag_joint_num_flat_inputs(j), 3);
    assert_int_equal(ag_joint_flat_input_primal(j, 2), 2);
    /* Compiled with x twice, against eager x * x + w: x.grad = 2 x c. */
    ag_compiled *c = compile_or_fail(j, true, 1.0);
    ag_scope_begin();
    ag_tensor *oc[1], *oe[1];
    assert_int_equal(ag_compiled_call_module(c, mx, (ag_tensor *[]){x, x}, 2, oc, 1), 1);
    assert_int_equal(ag_module_call(me, (ag_tensor *[]){xe, xe}, 2, oe, 1), 1);
    expect_same("output", oe[0], oc[0]);
    assert_int_equal(ag_backward(loss_of(oe, 1), NULL, false), 0);
    assert_int_equal(ag_backward(loss_of(oc, 1), NULL, false), 0);
    expect_same("x.grad", ag_tensor_grad(xe), ag_tensor_grad(x));
    tu_assert_close(ag_tensor_grad(x), (double[]){1, -2, 3}, 1e-6); /* 2 * x * 0.5 */
    expect_same("w.grad", ag_tensor_grad(W(me)), ag_tensor_grad(W(mx)));
    /* Two distinct tensors: the graph never assumed they were one. */
    ag_tensor *z = tu_tensor(AG_F32, 1, (int64_t[]){3}, (double[]){2, 2, 2});
    assert_int_equal(ag_compiled_call_module(c, mx, (ag_tensor *[]){x, z}, 2, oc, 1), 1);
    assert_int_equal(ag_module_call(me, (ag_tensor *[]){xe, z}, 2, oe, 1), 1);
    expect_same("output (distinct inputs)", oe[0], oc[0]);
    ag_scope_end();
    ag_compiled_free(c);
    ag_joint_free(j);
    ag_tensor_free(x);
    ag_tensor_free(xe);
    ag_module_free(mx);
    ag_module_free(me);
}

/* (x, y) -> y.mul_(2); x + y */
static int dup_mut_fwd(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)m, (void)nin, (void)max_out;
    ag_scope_begin();
    ag_mul_scalar_(in[1], 2.0);
    ag_tensor *y = ag_add(in[0], in[1]);
    return give(&y, 1, out);
}

/* The same tensor passed twice and mutated: strategy 2 removes the repeated slot (one
 * placeholder, the first occurrence's descriptor); the callable drops the repeated argument
 * after checking it is the same tensor. */
static void test_duplicate_input_mutated(void **st) {
    (void)st;
    ag_module *m = module("DupMut", dup_mut_fwd, -1, NULL, 2);
    ag_tensor *x = seq(1, (int64_t[]){3});
    ag_joint *j = export_or_fail(m, (ag_tensor *[]){x, x}, 2);
    const ag_graph *g = ag_joint_graph(j);
    tu_expect_placeholder_descs(g, (const char *[]){"PlainAOTInput(idx=0)"}, 1);
    tu_expect_output_descs(
        g,
        (const char *[]){"InputMutationAOTOutput(mutated_input=PlainAOTInput(idx=0))",
                         "PlainAOTOutput(idx=0)"},
        2);
    assert_false(ag_joint_needs_autograd(j));
    assert_int_equal(ag_joint_num_flat_inputs(j), 2);
    assert_int_equal(ag_joint_num_primals(j), 1);
    assert_int_equal(ag_joint_flat_input_primal(j, 0), 0);
    assert_int_equal(ag_joint_flat_input_primal(j, 1), 0);
    assert_true(ag_joint_input_info(j, 0)->mutates_data);
    /* Eager: y.mul_(2) doubles x (the same tensor), then x + y = 4 x. */
    ag_compiled *c = compile_or_fail(j, true, 1.0);
    ag_scope_begin();
    ag_tensor *o[1];
    assert_int_equal(ag_compiled_call(c, (ag_tensor *[]){x, x}, 2, o, 1), 1);
    tu_assert_close(o[0], (double[]){4, 8, 12}, 1e-6);
    tu_assert_close(x, (double[]){2, 4, 6}, 1e-6);
    /* Distinct tensors cannot be called: the graph has one input for both. */
    ag_tensor *z = seq(1, (int64_t[]){3});
    assert_true(ag_compiled_call(c, (ag_tensor *[]){x, z}, 2, o, 1) < 0);
    tu_assert_error_contains("compiled: PlainAOTInput(idx=1) (input 1) must be the same tensor as "
                             "PlainAOTInput(idx=0) (input 0)");
    ag_tensor *p[1];
    assert_true(ag_joint_primals_from_flat(j, (ag_tensor *[]){x, z}, 2, p, 1) < 0);
    tu_assert_error_contains("input 1 must be the same tensor as input 0");
    tu_assert_close(x, (double[]){2, 4, 6}, 1e-6); /* a failed call changes nothing */
    ag_scope_end();
    ag_compiled_free(c);
    ag_joint_free(j);
    ag_tensor_free(x);
    ag_module_free(m);
}

/* GPT-2's lm_head.weight is transformer.wte.weight: upstream's functional_call shows the
 * forward a separate leaf for the second name (not mutated: strategy 1), so the joint has a
 * placeholder for each, both used, each with its own gradient (summed at run time). */
static void test_gpt2_tied_weights(void **st) {
    (void)st;
    ag_module *m;
    ag_tensor *in[4];
    int nin;
    bool prev = ag_set_meta_mode(true);
    assert_int_equal(ag_zoo_build("gpt2", NULL, &m, in, 4, &nin), 0);
    ag_set_meta_mode(prev);
    ag_joint *j = export_or_fail(m, in, nin);
    const ag_graph *g = ag_joint_graph(j);
    assert_int_equal(ag_joint_num_primals(j), ag_joint_num_flat_inputs(j));
    ag_node **ph;
    int nph = ag_graph_placeholders(g, &ph);
    ag_node *wte = NULL, *lm = NULL;
    for (int i = 0; i < nph; i++) {
        if (!strcmp(tu_desc_repr(ag_node_desc(ph[i])),
                    "ParamAOTInput(target='transformer.wte.weight')"))
            wte = ph[i];
        if (!strcmp(tu_desc_repr(ag_node_desc(ph[i])), "ParamAOTInput(target='lm_head.weight')"))
            lm = ph[i];
    }
    assert_non_null(wte);
    assert_non_null(lm);
    assert_true(ag_node_num_users(wte) > 0); /* the embedding */
    assert_true(ag_node_num_users(lm) > 0);  /* the head's matmul */
    /* Both gradients are computed (upstream has no None for a tied weight). */
    ag_node *out = ag_graph_output_node(g);
    int found = 0;
    for (int i = 0; i < ag_node_arg(out, 0)->n; i++) {
        const char *d = tu_desc_repr(ag_node_output_desc(out, i));
        if (!strcmp(d, "GradAOTOutput(grad_of=ParamAOTInput(target='lm_head.weight'))") ||
            !strcmp(d, "GradAOTOutput(grad_of=ParamAOTInput(target='transformer.wte.weight'))")) {
            assert_non_null(output_node(g, i));
            found++;
        }
    }
    assert_int_equal(found, 2);
    ag_joint_free(j);
    for (int i = 0; i < nin; i++)
        ag_tensor_free(in[i]);
    ag_module_free(m);
}

/* ---- inputs that alias each other, one mutated ---- */

/* The zoo's alias_views: a [3, 4], b = a[1]; b.mul_(2); y = (a + 1) * w;
 * returns (y[0], y.t(), b). */
static void test_view_base_zoo(void **st) {
    (void)st;
    ag_module *mx, *me;
    ag_tensor *ix[4], *ie[4];
    int nx, ne;
    assert_int_equal(ag_zoo_build("alias_views", NULL, &mx, ix, 4, &nx), 0);
    assert_int_equal(ag_zoo_build("alias_views", NULL, &me, ie, 4, &ne), 0);
    assert_ptr_equal(ag_tensor_base(ix[1]), ix[0]);
    ag_tensor *a0 = ag_clone(ix[0]);
    ag_joint *j = export_or_fail(mx, ix, nx);
    /* The export changes nothing: a is as it was. */
    expect_same("a after the export", a0, ix[0]);
    const ag_graph *g = ag_joint_graph(j);
    tu_expect_placeholder_descs(
        g,
        (const char *[]){
            "ViewBaseAOTInput(base_of=PlainAOTInput(idx=1))", "ParamAOTInput(target='w')",
            "TangentAOTInput(output=IntermediateBaseAOTOutput(base_of=PlainAOTOutput(idx=0)))"},
        3);
    tu_expect_output_descs(
        g,
        (const char *[]){
            "InputMutationAOTOutput(mutated_input=ViewBaseAOTInput(base_of=PlainAOTInput(idx=1)))",
            "PlainAOTOutput(idx=0)", "PlainAOTOutput(idx=1)", "PlainAOTOutput(idx=2)",
            "IntermediateBaseAOTOutput(base_of=PlainAOTOutput(idx=0))", "None",
            "GradAOTOutput(grad_of=ParamAOTInput(target='w'))"},
        7);
    /* The mutation is scattered into the base. */
    assert_string_equal(ag_op_name(ag_node_op(output_node(g, 0))), "as_strided_scatter");
    assert_int_equal(ag_joint_num_fw_outputs(j), 5);
    assert_int_equal(ag_joint_num_intermediate_bases(j), 1);
    assert_int_equal(ag_joint_num_metadata_mutations(j), 0);
    assert_int_equal(ag_joint_num_tangents(j), 1);
    assert_int_equal(ag_joint_output_info(j, 0)->alias,
                     AG_OUT_ALIAS_OF_INTERMEDIATE_SAVE_AS_OUTPUT);
    assert_int_equal(ag_joint_output_info(j, 1)->alias, AG_OUT_ALIAS_OF_INTERMEDIATE);
    assert_int_equal(ag_joint_output_info(j, 1)->base_index, 0);
    assert_int_equal(ag_joint_output_info(j, 2)->alias, AG_OUT_ALIAS_OF_INPUT);
    assert_int_equal(ag_joint_output_info(j, 2)->base_index, 0);
    assert_true(ag_joint_input_info(j, 0)->mutates_data);
    assert_int_equal(ag_joint_flat_input_primal(j, 0), 1); /* w */
    assert_int_equal(ag_joint_flat_input_primal(j, 1), 0); /* a: the base */
    assert_int_equal(ag_joint_flat_input_primal(j, 2), 0); /* b: regenerated from it */
    assert_int_equal(ag_joint_num_static_inputs(j), 1);
    assert_int_equal(ag_joint_static_input(j, 0), 1);

    for (int cfg = 0; cfg < 3; cfg++) {
        ag_compiled *c = compile_or_fail(j, cfg > 0, cfg == 2 ? 0.0 : 1.0);
        for (int step = 0; step < 2; step++) {
            ag_scope_begin();
            ag_tensor *oc[3], *oe[3];
            assert_int_equal(ag_compiled_call_module(c, mx, ix, nx, oc, 3), 3);
            assert_int_equal(ag_module_call(me, ie, ne, oe, 3), 3);
            for (int k = 0; k < 3; k++) {
                expect_same("output", oe[k], oc[k]);
                assert_int_equal(ag_tensor_requires_grad(oc[k]), ag_tensor_requires_grad(oe[k]));
            }
            /* The callers' tensors after the call: b's doubling reached a. */
            expect_same("a after the call", ie[0], ix[0]);
            expect_same("b after the call", ie[1], ix[1]);
            /* b is returned as a view of the caller's a; y[0] and y.t() share one base. */
            assert_true(ag_tensor_same_storage(oc[2], ix[0]));
            assert_true(ag_tensor_same_storage(oc[0], oc[1]));
            assert_false(ag_tensor_same_storage(oc[0], ix[0]));
            expect_geometry(oc[1], 2, (int64_t[]){4, 3}, (int64_t[]){1, 4},
                            ag_tensor_offset(oc[0]));
            /* Gradients through the two aliasing outputs reach w through the base. */
            assert_int_equal(ag_backward(loss_of(oe, 3), NULL, false), 0);
            assert_int_equal(ag_backward(loss_of(oc, 3), NULL, false), 0);
            expect_same("w.grad", ag_tensor_grad(W(me)), ag_tensor_grad(W(mx)));
            ag_tensor_set_grad(W(me), NULL);
            ag_tensor_set_grad(W(mx), NULL);
            /* Writing to one output is seen by the other, as in eager. */
            bool prev = ag_set_grad_enabled(false);
            assert_non_null(ag_fill_(oc[0], 7.0));
            ag_set_grad_enabled(prev);
            for (int r = 0; r < 4; r++)
                assert_true(ag_tensor_item_at(oc[1], r * 3) == 7.0);
            ag_scope_end();
        }
        ag_compiled_free(c);
    }
    /* The callable checks that b is still the view of a that the graph regenerates. */
    ag_compiled *c = compile_or_fail(j, true, 1.0);
    ag_scope_begin();
    ag_tensor *o[3];
    ag_tensor *not_view = ag_clone(ix[1]);
    assert_true(ag_compiled_call_module(c, mx, (ag_tensor *[]){ix[0], not_view}, 2, o, 3) < 0);
    tu_assert_error_contains("PlainAOTInput(idx=1) (input 2) was a view at export");
    ag_tensor *other_row = ag_select(ix[0], 0, 2);
    assert_true(ag_compiled_call_module(c, mx, (ag_tensor *[]){ix[0], other_row}, 2, o, 3) < 0);
    tu_assert_error_contains("PlainAOTInput(idx=1) (input 2) is not the view of its base");
    ag_scope_end();
    ag_compiled_free(c);
    ag_joint_free(j);
    ag_tensor_free(a0);
    for (int i = 0; i < nx; i++)
        ag_tensor_free(ix[i]);
    for (int i = 0; i < ne; i++)
        ag_tensor_free(ie[i]);
    ag_module_free(mx);
    ag_module_free(me);
}

/* (a, b) -> a.mul_(2); a + b, optionally * w */
static int synth_fwd(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)nin, (void)max_out;
    ag_scope_begin();
    ag_mul_scalar_(in[0], 2.0);
    ag_tensor *y = ag_add(in[0], in[1]);
    if (W(m))
        y = ag_mul(y, W(m));
    return give(&y, 1, out);
}

/* Overlapping slices of x [6], detached: they share memory but have no ._base. */
static void detached_slices(ag_tensor **x, ag_tensor **a, ag_tensor **b) {
    *x = seq(1, (int64_t[]){6});
    ag_scope_begin();
    *a = ag_tensor_keep(ag_detach(ag_slice(*x, 0, 0, 4, 1)));
    *b = ag_tensor_keep(ag_detach(ag_slice(*x, 0, 2, 6, 1)));
    ag_scope_end();
    assert_null(ag_tensor_base(*a));
}

/* No common base and no autograd: a synthetic base over the whole storage. */
static void test_synthetic_base(void **st) {
    (void)st;
    ag_module *m = module("Synth", synth_fwd, -1, NULL, 3);
    ag_tensor *x, *a, *b;
    detached_slices(&x, &a, &b);
    ag_joint *j = export_or_fail(m, (ag_tensor *[]){a, b}, 2);
    const ag_graph *g = ag_joint_graph(j);
    tu_expect_placeholder_descs(
        g, (const char *[]){"SyntheticBaseAOTInput(base_of=PlainAOTInput(idx=0))"}, 1);
    tu_expect_output_descs(
        g,
        (const char *[]){"InputMutationAOTOutput(mutated_input=SyntheticBaseAOTInput("
                         "base_of=PlainAOTInput(idx=0)))",
                         "PlainAOTOutput(idx=0)"},
        2);
    ag_node **ph;
    ag_graph_placeholders(g, &ph);
    assert_int_equal(ag_node_val(ph[0], 0)->ndim, 1);
    assert_int_equal(ag_node_val(ph[0], 0)->sizes[0], 6); /* the whole storage */
    tu_assert_close(x, (double[]){1, 2, 3, 4, 5, 6}, 0);  /* untouched by the export */
    /* Eager: x = [2, 4, 6, 8, 5, 6]; a + b = [2, 4, 6, 8] + [6, 8, 5, 6]. */
    ag_compiled *c = compile_or_fail(j, true, 1.0);
    ag_scope_begin();
    ag_tensor *o[1];
    assert_int_equal(ag_compiled_call(c, (ag_tensor *[]){a, b}, 2, o, 1), 1);
    tu_assert_close(o[0], (double[]){8, 12, 11, 14}, 1e-6);
    tu_assert_close(x, (double[]){2, 4, 6, 8, 5, 6}, 1e-6);
    tu_assert_close(b, (double[]){6, 8, 5, 6}, 1e-6);
    ag_scope_end();
    ag_compiled_free(c);
    ag_joint_free(j);
    ag_tensor_free(x);
    ag_tensor_free(a);
    ag_tensor_free(b);
    ag_module_free(m);

    /* With autograd upstream refuses inputs that share memory without being views of one
     * base. */
    m = module("Synth", synth_fwd, 1, (int64_t[]){4}, 3);
    detached_slices(&x, &a, &b);
    assert_null(ag_export_joint(m, (ag_tensor *[]){a, b}, 2, NULL, NULL, 0, NULL));
    tu_assert_error_contains("aot_autograd() does not yet handle non-differentiable view input "
                             "mutations.");
    ag_tensor_free(x);
    ag_tensor_free(a);
    ag_tensor_free(b);
    ag_module_free(m);
}

/* Views that share memory but see no mutation stay separate primals. */
static int sum_fwd(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)m, (void)nin, (void)max_out;
    ag_scope_begin();
    ag_tensor *y = ag_add(in[0], in[1]);
    return give(&y, 1, out);
}

static void test_aliased_inputs_not_mutated(void **st) {
    (void)st;
    ag_module *m = module("Sum", sum_fwd, -1, NULL, 4);
    ag_tensor *x = seq(2, (int64_t[]){2, 3});
    ag_scope_begin();
    ag_tensor *a = ag_tensor_keep(ag_select(x, 0, 0)), *b = ag_tensor_keep(ag_select(x, 0, 1));
    ag_tensor *c0 = ag_tensor_keep(ag_slice(x, 1, 0, 2, 1)),
              *c1 = ag_tensor_keep(ag_slice(x, 1, 1, 3, 1));
    ag_scope_end();
    ag_joint *j = export_or_fail(m, (ag_tensor *[]){a, b}, 2);
    tu_expect_placeholder_descs(
        ag_joint_graph(j), (const char *[]){"PlainAOTInput(idx=0)", "PlainAOTInput(idx=1)"}, 2);
    ag_joint_free(j);
    /* Columns 0..1 and 1..2 overlap, but neither is mutated: no base either. */
    j = export_or_fail(m, (ag_tensor *[]){c0, c1}, 2);
    tu_expect_placeholder_descs(
        ag_joint_graph(j), (const char *[]){"PlainAOTInput(idx=0)", "PlainAOTInput(idx=1)"}, 2);
    ag_joint_free(j);
    ag_tensor_free(a);
    ag_tensor_free(b);
    ag_tensor_free(c0);
    ag_tensor_free(c1);
    ag_tensor_free(x);
    ag_module_free(m);
}

/* ---- metadata mutations ---- */

/* x -> x.t_(); x * 2 */
static int t_fwd(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)m, (void)nin, (void)max_out;
    ag_scope_begin();
    ag_t_(in[0]);
    ag_tensor *y = ag_mul_scalar(in[0], 2.0);
    return give(&y, 1, out);
}

/* A metadata mutation of an input: InputMutationAOTOutput holding the input's new view, and
 * the callable applies the new geometry to the caller's tensor (as_strided_). */
static void test_metadata_mutation(void **st) {
    (void)st;
    ag_module *m = module("T_", t_fwd, -1, NULL, 5);
    ag_tensor *x = seq(2, (int64_t[]){2, 3});
    ag_tensor *xe = seq(2, (int64_t[]){2, 3});
    const void *data = ag_tensor_data(x);
    ag_joint *j = export_or_fail(m, &x, 1);
    expect_geometry(x, 2, (int64_t[]){2, 3}, (int64_t[]){3, 1}, 0); /* the export changes nothing */
    const ag_graph *g = ag_joint_graph(j);
    tu_expect_placeholder_descs(g, (const char *[]){"PlainAOTInput(idx=0)"}, 1);
    tu_expect_output_descs(
        g,
        (const char *[]){"InputMutationAOTOutput(mutated_input=PlainAOTInput(idx=0))",
                         "PlainAOTOutput(idx=0)"},
        2);
    assert_string_equal(ag_op_name(ag_node_op(output_node(g, 0))), "t");
    assert_true(ag_joint_input_info(j, 0)->mutates_metadata);
    assert_false(ag_joint_input_info(j, 0)->mutates_data);
    ag_compiled *c = compile_or_fail(j, true, 1.0);
    ag_scope_begin();
    ag_tensor *oc[1], *oe[1];
    assert_int_equal(ag_compiled_call(c, &x, 1, oc, 1), 1);
    assert_int_equal(ag_module_call(m, &xe, 1, oe, 1), 1);
    expect_same("output", oe[0], oc[0]);
    expect_geometry(x, 2, (int64_t[]){3, 2}, (int64_t[]){1, 3}, 0);
    expect_geometry(xe, 2, (int64_t[]){3, 2}, (int64_t[]){1, 3}, 0);
    assert_ptr_equal(ag_tensor_data(x), data); /* the data stayed where it was */
    expect_same("x after the call", xe, x);
    ag_scope_end();
    ag_compiled_free(c);
    ag_joint_free(j);
    ag_tensor_free(x);
    ag_tensor_free(xe);
    ag_module_free(m);
}

/* (a, b) -> a.mul_(2); b.t_(); b + 1 */
static int mm_fwd(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)m, (void)nin, (void)max_out;
    ag_scope_begin();
    ag_mul_scalar_(in[0], 2.0);
    ag_t_(in[1]);
    ag_tensor *y = ag_add_scalar(in[1], 1.0);
    return give(&y, 1, out);
}

/* A metadata mutation of an input merged into a base: MetadataMutationAOTOutput(0) after the
 * user outputs, applied to the caller's tensor at run time. */
static void test_metadata_mutation_of_merged_input(void **st) {
    (void)st;
    ag_module *m = module("MetaMut", mm_fwd, -1, NULL, 6);
    ag_tensor *x[2], *a[2], *b[2];
    for (int k = 0; k < 2; k++) {
        x[k] = seq(2, (int64_t[]){2, 3});
        ag_scope_begin();
        a[k] = ag_tensor_keep(ag_slice(x[k], 0, 0, 1, 1)); /* row 0 */
        b[k] = ag_tensor_keep(ag_slice(x[k], 1, 1, 3, 1)); /* columns 1..2 */
        ag_scope_end();
    }
    ag_joint *j = export_or_fail(m, (ag_tensor *[]){a[0], b[0]}, 2);
    const ag_graph *g = ag_joint_graph(j);
    tu_expect_placeholder_descs(
        g, (const char *[]){"ViewBaseAOTInput(base_of=PlainAOTInput(idx=0))"}, 1);
    tu_expect_output_descs(
        g,
        (const char *[]){
            "InputMutationAOTOutput(mutated_input=ViewBaseAOTInput(base_of=PlainAOTInput(idx=0)))",
            "PlainAOTOutput(idx=0)", "MetadataMutationAOTOutput(idx=0)"},
        3);
    assert_int_equal(ag_joint_num_metadata_mutations(j), 1);
    assert_int_equal(ag_joint_num_fw_outputs(j), 3);
    expect_geometry(b[0], 2, (int64_t[]){2, 2}, (int64_t[]){3, 1}, 1);
    /* Eager: x = [[2, 4, 6], [4, 5, 6]]; b.t_() = [[4, 5], [6, 6]]; b + 1. */
    ag_compiled *c = compile_or_fail(j, true, 1.0);
    ag_scope_begin();
    ag_tensor *oc[1], *oe[1];
    assert_int_equal(ag_compiled_call(c, (ag_tensor *[]){a[0], b[0]}, 2, oc, 1), 1);
    assert_int_equal(ag_module_call(m, (ag_tensor *[]){a[1], b[1]}, 2, oe, 1), 1);
    tu_assert_values(oe[0], 2, (int64_t[]){2, 2}, (double[]){5, 6, 7, 7}, 1e-6);
    expect_same("output", oe[0], oc[0]);
    tu_assert_close(x[0], (double[]){2, 4, 6, 4, 5, 6}, 1e-6);
    expect_geometry(b[0], 2, (int64_t[]){2, 2}, (int64_t[]){1, 3}, 1);
    expect_geometry(b[1], 2, (int64_t[]){2, 2}, (int64_t[]){1, 3}, 1);
    expect_same("b after the call", b[1], b[0]);
    ag_scope_end();
    ag_compiled_free(c);
    ag_joint_free(j);
    for (int k = 0; k < 2; k++) {
        ag_tensor_free(x[k]);
        ag_tensor_free(a[k]);
        ag_tensor_free(b[k]);
    }
    ag_module_free(m);
}

/* The in-place view ops in eager: metadata only, data shared, autograd as the view op. */
static void test_inplace_view_ops(void **st) {
    (void)st;
    ag_scope_begin();
    ag_tensor *x = seq(2, (int64_t[]){2, 3});
    const void *data = ag_tensor_data(x);
    uint64_t v = ag_tensor_version(x);
    assert_ptr_equal(ag_t_(x), x);
    expect_geometry(x, 2, (int64_t[]){3, 2}, (int64_t[]){1, 3}, 0);
    assert_ptr_equal(ag_tensor_data(x), data);
    assert_true(ag_tensor_version(x) > v);
    ag_transpose_(x, 0, 1);
    expect_geometry(x, 2, (int64_t[]){2, 3}, (int64_t[]){3, 1}, 0);
    ag_unsqueeze_(x, 0);
    expect_geometry(x, 3, (int64_t[]){1, 2, 3}, (int64_t[]){6, 3, 1}, 0);
    ag_as_strided_(x, 1, (int64_t[]){2}, (int64_t[]){2}, 1);
    expect_geometry(x, 1, (int64_t[]){2}, (int64_t[]){2}, 1);
    tu_assert_close(x, (double[]){2, 4}, 0);
    /* A leaf that requires grad cannot change in place; a non-leaf records the view's
     * backward. */
    ag_tensor *w = tu_leaf(AG_F32, 2, (int64_t[]){2, 3}, (double[]){1, 2, 3, 4, 5, 6});
    assert_null(ag_t_(w));
    tu_assert_error_contains("t_: a leaf tensor that requires grad");
    ag_tensor *h = ag_mul_scalar(w, 1.0);
    ag_unsqueeze_(ag_t_(h), 1);
    expect_geometry(h, 3, (int64_t[]){3, 1, 2}, (int64_t[]){1, 6, 3}, 0);
    ag_tensor *c = seq(3, (int64_t[]){3, 1, 2});
    assert_int_equal(ag_backward(ag_sum_all(ag_mul(h, c)), NULL, false), 0);
    /* d/dw sum(w.t().unsqueeze(1) * c) = c.squeeze(1).t() */
    tu_assert_close(ag_tensor_grad(w), (double[]){1, 3, 5, 2, 4, 6}, 0);
    ag_tensor *h2 = ag_mul_scalar(w, 1.0);
    assert_null(ag_as_strided_(h2, 1, (int64_t[]){2}, (int64_t[]){1}, 0));
    tu_assert_error_contains("as_strided_: in-place as_strided of a tensor that requires grad");
    ag_scope_end(); /* the scope owns every tensor made here */
}

/* ---- outputs aliasing inputs and intermediates ---- */

/* x [2, 3] -> (x, x.t(), x * w) */
static int out_in_fwd(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)nin, (void)max_out;
    ag_scope_begin();
    ag_tensor *xt = ag_t(in[0]); /* one traced call per statement: C's order is unspecified */
    ag_tensor *xw = ag_mul(in[0], W(m));
    ag_tensor *y[3] = {in[0], xt, xw};
    return give(y, 3, out);
}

/* An output that is an input comes back as the caller's tensor; a view of an input as a view
 * of the caller's tensor (its storage); neither gets a tangent. With x requiring grad,
 * gradients through both reach x. */
static void test_outputs_alias_inputs(void **st) {
    (void)st;
    for (int rg = 0; rg < 2; rg++) {
        ag_module *mx = module("OutIn", out_in_fwd, 1, (int64_t[]){3}, 7);
        ag_module *me = module("OutIn", out_in_fwd, 1, (int64_t[]){3}, 7);
        ag_tensor *x = seq(2, (int64_t[]){2, 3}), *xe = seq(2, (int64_t[]){2, 3});
        if (rg) {
            ag_tensor_set_requires_grad(x, true);
            ag_tensor_set_requires_grad(xe, true);
        }
        ag_joint *j = export_or_fail(mx, &x, 1);
        const ag_graph *g = ag_joint_graph(j);
        tu_expect_placeholder_descs(
            g,
            (const char *[]){"ParamAOTInput(target='w')", "PlainAOTInput(idx=0)",
                             "TangentAOTInput(output=PlainAOTOutput(idx=2))"},
            3);
        tu_expect_output_descs(
            g,
            (const char *[]){"PlainAOTOutput(idx=0)", "PlainAOTOutput(idx=1)",
                             "PlainAOTOutput(idx=2)",
                             "GradAOTOutput(grad_of=ParamAOTInput(target='w'))",
                             rg ? "GradAOTOutput(grad_of=PlainAOTInput(idx=0))" : "None"},
            5);
        assert_int_equal(ag_joint_output_info(j, 0)->alias, AG_OUT_IS_INPUT);
        assert_int_equal(ag_joint_output_info(j, 0)->base_index, 1);
        assert_int_equal(ag_joint_output_info(j, 1)->alias, AG_OUT_ALIAS_OF_INPUT);
        assert_int_equal(ag_joint_output_info(j, 1)->base_index, 1);
        assert_int_equal(ag_joint_output_info(j, 2)->alias, AG_OUT_NON_ALIAS);
        ag_compiled *c = compile_or_fail(j, true, 1.0);
        ag_scope_begin();
        ag_tensor *oc[3], *oe[3];
        assert_int_equal(ag_compiled_call_module(c, mx, &x, 1, oc, 3), 3);
        assert_int_equal(ag_module_call(me, &xe, 1, oe, 3), 3);
        assert_ptr_equal(oc[0], x);
        assert_true(ag_tensor_same_storage(oc[1], x));
        expect_geometry(oc[1], 2, (int64_t[]){3, 2}, (int64_t[]){1, 3}, 0);
        for (int k = 0; k < 3; k++) {
            expect_same("output", oe[k], oc[k]);
            assert_int_equal(ag_tensor_requires_grad(oc[k]), ag_tensor_requires_grad(oe[k]));
        }
        assert_int_equal(ag_backward(loss_of(oe, 3), NULL, false), 0);
        assert_int_equal(ag_backward(loss_of(oc, 3), NULL, false), 0);
        expect_same("w.grad", ag_tensor_grad(W(me)), ag_tensor_grad(W(mx)));
        if (rg) { /* 0.5 (x itself) + 0.75 (through x.t()) + 1.0 * w */
            expect_same("x.grad", ag_tensor_grad(xe), ag_tensor_grad(x));
            const float *w = ag_tensor_data(W(mx));
            for (int e = 0; e < 6; e++)
                assert_true(fabs(ag_tensor_item_at(ag_tensor_grad(x), e) - (1.25 + w[e % 3])) <
                            1e-6);
        }
        ag_scope_end();
        ag_compiled_free(c);
        ag_joint_free(j);
        ag_tensor_free(x);
        ag_tensor_free(xe);
        ag_module_free(mx);
        ag_module_free(me);
    }
}

/* x [2, 3]: y = x * w; returns what `mode` says. */
static int g_mode;
static int inter_fwd(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)nin, (void)max_out;
    ag_scope_begin();
    ag_tensor *y = ag_mul(in[0], W(m));
    if (g_mode == 0) {
        ag_tensor *y0 = ag_select(y, 0, 0), *y1 = ag_select(y, 0, 1); /* two views of y */
        ag_tensor *r[2] = {y0, y1};
        return give(r, 2, out);
    }
    if (g_mode == 1) {
        ag_tensor *r = ag_t(y); /* the only view of y */
        return give(&r, 1, out);
    }
    ag_tensor *r[2] = {y, ag_t(y)}; /* y and a view of it */
    return give(r, 2, out);
}

static void run_inter(int mode, int nout, const char *const *ph, int nph, const char *const *outs,
                      int nouts, const ag_output_alias *kinds) {
    g_mode = mode;
    ag_module *mx = module("Inter", inter_fwd, 1, (int64_t[]){3}, 8);
    ag_module *me = module("Inter", inter_fwd, 1, (int64_t[]){3}, 8);
    ag_tensor *x = seq(2, (int64_t[]){2, 3});
    ag_joint *j = export_or_fail(mx, &x, 1);
    const ag_graph *g = ag_joint_graph(j);
    tu_expect_placeholder_descs(g, ph, nph);
    tu_expect_output_descs(g, outs, nouts);
    for (int k = 0; k < nout; k++)
        assert_int_equal(ag_joint_output_info(j, k)->alias, kinds[k]);
    for (int cfg = 0; cfg < 2; cfg++) {
        ag_compiled *c = compile_or_fail(j, cfg == 1, cfg == 1 ? 0.0 : 1.0);
        ag_scope_begin();
        ag_tensor *oc[2], *oe[2];
        assert_int_equal(ag_compiled_call_module(c, mx, &x, 1, oc, 2), nout);
        assert_int_equal(ag_module_call(me, &x, 1, oe, 2), nout);
        for (int k = 0; k < nout; k++)
            expect_same("output", oe[k], oc[k]);
        if (nout == 2)
            assert_true(ag_tensor_same_storage(oc[0], oc[1]));
        assert_int_equal(ag_backward(loss_of(oe, nout), NULL, false), 0);
        assert_int_equal(ag_backward(loss_of(oc, nout), NULL, false), 0);
        expect_same("w.grad", ag_tensor_grad(W(me)), ag_tensor_grad(W(mx)));
        ag_tensor_set_grad(W(me), NULL);
        ag_tensor_set_grad(W(mx), NULL);
        ag_scope_end();
        ag_compiled_free(c);
    }
    ag_joint_free(j);
    ag_tensor_free(x);
    ag_module_free(mx);
    ag_module_free(me);
}

/* Two outputs viewing one intermediate: its base becomes a forward output after the user
 * outputs, with the only tangent; the views get none. */
static void test_two_views_of_intermediate(void **st) {
    (void)st;
    run_inter(
        0, 2,
        (const char *[]){
            "ParamAOTInput(target='w')", "PlainAOTInput(idx=0)",
            "TangentAOTInput(output=IntermediateBaseAOTOutput(base_of=PlainAOTOutput(idx=0)))"},
        3,
        (const char *[]){"PlainAOTOutput(idx=0)", "PlainAOTOutput(idx=1)",
                         "IntermediateBaseAOTOutput(base_of=PlainAOTOutput(idx=0))",
                         "GradAOTOutput(grad_of=ParamAOTInput(target='w'))", "None"},
        5,
        (const ag_output_alias[]){AG_OUT_ALIAS_OF_INTERMEDIATE_SAVE_AS_OUTPUT,
                                  AG_OUT_ALIAS_OF_INTERMEDIATE});
}

/* One output viewing an intermediate: unsafe_view_alias, a plain output with its tangent. */
static void test_one_view_of_intermediate(void **st) {
    (void)st;
    run_inter(1, 1,
              (const char *[]){"ParamAOTInput(target='w')", "PlainAOTInput(idx=0)",
                               "TangentAOTInput(output=PlainAOTOutput(idx=0))"},
              3,
              (const char *[]){"PlainAOTOutput(idx=0)",
                               "GradAOTOutput(grad_of=ParamAOTInput(target='w'))", "None"},
              3, (const ag_output_alias[]){AG_OUT_UNSAFE_VIEW_ALIAS});
}

/* An output viewing another output: regenerated from it, no extra output, no tangent. */
static void test_view_of_another_output(void **st) {
    (void)st;
    run_inter(2, 2,
              (const char *[]){"ParamAOTInput(target='w')", "PlainAOTInput(idx=0)",
                               "TangentAOTInput(output=PlainAOTOutput(idx=0))"},
              3,
              (const char *[]){"PlainAOTOutput(idx=0)", "PlainAOTOutput(idx=1)",
                               "GradAOTOutput(grad_of=ParamAOTInput(target='w'))", "None"},
              4,
              (const ag_output_alias[]){AG_OUT_NON_ALIAS,
                                        AG_OUT_ALIAS_OF_INTERMEDIATE_BASE_IS_USER_OUTPUT});
}

/* ---- functionalization through views ---- */

/* x [2, 3] -> x[0].mul_(2); (x + 1, y) with y = x + 1 and y[1].mul_(3) */
static int view_mut_fwd(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)m, (void)nin, (void)max_out;
    ag_scope_begin();
    ag_mul_scalar_(ag_select(in[0], 0, 0), 2.0); /* through a view of the input */
    ag_tensor *y = ag_add_scalar(in[0], 1.0);
    ag_mul_scalar_(ag_select(y, 0, 1), 3.0); /* through a view of an intermediate */
    ag_tensor *r[2] = {ag_add_scalar(in[0], 1.0), y};
    return give(r, 2, out);
}

/* A mutation through a view updates its base, and later reads of the base see it. */
static void test_mutation_through_views(void **st) {
    (void)st;
    ag_module *m = module("ViewMut", view_mut_fwd, -1, NULL, 9);
    ag_tensor *x = seq(2, (int64_t[]){2, 3}), *xe = seq(2, (int64_t[]){2, 3});
    ag_joint *j = export_or_fail(m, &x, 1);
    const ag_graph *g = ag_joint_graph(j);
    tu_expect_placeholder_descs(g, (const char *[]){"PlainAOTInput(idx=0)"}, 1);
    tu_expect_output_descs(
        g,
        (const char *[]){"InputMutationAOTOutput(mutated_input=PlainAOTInput(idx=0))",
                         "PlainAOTOutput(idx=0)", "PlainAOTOutput(idx=1)"},
        3);
    assert_string_equal(ag_op_name(ag_node_op(output_node(g, 0))), "as_strided_scatter");
    assert_string_equal(ag_op_name(ag_node_op(output_node(g, 2))), "as_strided_scatter");
    ag_compiled *c = compile_or_fail(j, true, 1.0);
    ag_scope_begin();
    ag_tensor *oc[2], *oe[2];
    assert_int_equal(ag_compiled_call(c, &x, 1, oc, 2), 2);
    assert_int_equal(ag_module_call(m, &xe, 1, oe, 2), 2);
    /* x = [[2, 4, 6], [4, 5, 6]]; y = x + 1 with row 1 tripled */
    tu_assert_close(oe[0], (double[]){3, 5, 7, 5, 6, 7}, 1e-6);
    tu_assert_close(oe[1], (double[]){3, 5, 7, 15, 18, 21}, 1e-6);
    for (int k = 0; k < 2; k++)
        expect_same("output", oe[k], oc[k]);
    expect_same("x after the call", xe, x);
    ag_scope_end();
    ag_compiled_free(c);
    ag_joint_free(j);
    ag_tensor_free(x);
    ag_tensor_free(xe);
    ag_module_free(m);
}

/* ---- allocation failures ---- */

typedef struct oom_case {
    ag_module *m;
    ag_tensor **in;
    int nin;
    bool compile;
} oom_case;

/* Export alias_views (dedupe/base planning, two kinds of extra outputs), and optionally
 * compile and run it with a backward: every allocation failure is reported, nothing leaks. */
static int oom_scenario(void *ud) {
    oom_case *c = ud;
    ag_joint *j = ag_export_joint(c->m, c->in, c->nin, NULL, NULL, 0, NULL);
    if (!j)
        return ag_last_status();
    int rc = 0;
    ag_compiled *cc = NULL;
    if (c->compile) {
        ag_compile_opts co = {
            .partition = {.partitioner = AG_PARTITION_DEFAULT, .memory_budget = 1}};
        cc = ag_compile_joint(j, &co);
        rc = cc ? 0 : ag_last_status();
        /* the callers' tensors are cloned so that every run sees the same values; the scope
         * owns everything made here */
        ag_scope_begin();
        ag_tensor *a = rc ? NULL : ag_clone(c->in[0]);
        ag_tensor *b = a ? ag_select(a, 0, 1) : NULL;
        if (!rc && !b)
            rc = ag_last_status();
        ag_tensor *o[3] = {0};
        if (!rc && ag_compiled_call_module(cc, c->m, (ag_tensor *[]){a, b}, 2, o, 3) < 0)
            rc = ag_last_status();
        ag_tensor *l = rc ? NULL : ag_add(ag_sum_all(o[0]), ag_sum_all(o[1]));
        if (!rc && (!l || ag_backward(l, NULL, false)))
            rc = ag_last_status();
        tu_alloc_cleanup_begin();
        ag_tensor_set_grad(W(c->m), NULL);
        ag_scope_end();
        tu_alloc_cleanup_end();
    }
    tu_alloc_cleanup_begin();
    ag_compiled_free(cc);
    ag_joint_free(j);
    tu_alloc_cleanup_end();
    return rc;
}

static void test_allocation_failures(void **st) {
    (void)st;
    ag_module *m;
    ag_tensor *in[4];
    int nin;
    assert_int_equal(ag_zoo_build("alias_views", NULL, &m, in, 4, &nin), 0);
    oom_case c = {m, in, nin, false};
    tu_sweep_opts so = {.what = "export alias_views", .one_thread = true};
    int64_t n1 = tu_alloc_failure_sweep(oom_scenario, &c, &so);
    c.compile = true;
    so.what = "export, compile, call alias_views";
    int64_t n2 = tu_alloc_failure_sweep(oom_scenario, &c, &so);
    print_message("allocation points: export %lld, export + compile + call %lld\n", (long long)n1,
                  (long long)n2);
    /* The sweeps reach many allocation points (fewer since graph nodes come from blocks and
     * well-known metadata is interned: 281 -> 198 for the export). */
    assert_true(n1 > 150);
    assert_true(n2 > n1 + 200);
    for (int i = 0; i < nin; i++)
        ag_tensor_free(in[i]);
    ag_module_free(m);
}

/* ---- FX utilities and the CLI ---- */

static void test_fx_utils_alias_views(void **st) {
    (void)st;
    ag_module *m;
    ag_tensor *in[4];
    int nin;
    assert_int_equal(ag_zoo_build("alias_views", NULL, &m, in, 4, &nin), 0);
    ag_joint *j = export_or_fail(m, in, nin);
    const ag_graph *g = ag_joint_graph(j);
    ag_fx_pairs *ig = ag_fx_all_input_and_grad_nodes(g);
    assert_non_null(ig);
    assert_int_equal(ag_fx_pairs_count(ig), 3);
    assert_string_equal(tu_desc_repr(ag_fx_pairs_desc(ig, 0)),
                        "ViewBaseAOTInput(base_of=PlainAOTInput(idx=1))");
    assert_string_equal(ag_node_name(ag_fx_pairs_first(ig, 0)), "primals_1");
    assert_null(ag_fx_pairs_second(ig, 0));     /* a does not require grad */
    assert_non_null(ag_fx_pairs_second(ig, 1)); /* w */
    ag_fx_pairs *ot = ag_fx_all_output_and_tangent_nodes(g);
    assert_non_null(ot);
    ag_desc *ib = ag_desc_parse("IntermediateBaseAOTOutput(base_of=PlainAOTOutput(idx=0))", NULL);
    int k = ag_fx_pairs_find(ot, ib);
    assert_true(k >= 0);
    assert_string_equal(ag_node_name(ag_fx_pairs_second(ot, k)), "tangents_1");
    ag_desc *mut = ag_desc_parse(
        "InputMutationAOTOutput(mutated_input=ViewBaseAOTInput(base_of=PlainAOTInput(idx=1)))",
        NULL);
    k = ag_fx_pairs_find(ot, mut);
    assert_true(k >= 0);
    assert_null(ag_fx_pairs_second(ot, k));
    ag_desc_release(ib);
    ag_desc_release(mut);
    ag_fx_pairs_free(ig);
    ag_fx_pairs_free(ot);
    ag_joint_free(j);
    for (int i = 0; i < nin; i++)
        ag_tensor_free(in[i]);
    ag_module_free(m);
}

static void test_cli(void **st) {
    (void)st;
    if (!tu_cli_setup("/tmp/ag_test_alias_XXXXXX"))
        skip();
    assert_int_equal(tu_cli_run("export alias_views"), 0);
    tu_cli_has("out", "%primals_1 : f32[3, 4]  # ViewBaseAOTInput(base_of=PlainAOTInput(idx=1))");
    tu_cli_has("out", "IntermediateBaseAOTOutput(base_of=PlainAOTOutput(idx=0))");
    tu_cli_has("out", "as_strided_scatter(%primals_1, %mul, [4], [1], 4)");
    assert_int_equal(tu_cli_run("descriptors alias_views"), 0);
    tu_cli_has("out", "TangentAOTInput(output=IntermediateBaseAOTOutput(base_of=PlainAOTOutput(idx="
                      "0)))  tangents_1");
    tu_cli_has("out", "in_spec: TreeSpec(tuple, None, [TreeSpec(list, None, [*, *, *]), "
                      "TreeSpec(dict, [], [])])");
    assert_int_equal(tu_cli_run("check alias_views"), 0);
    tu_cli_has("out", "inputs 0 (tolerance 1e-05): OK");
    assert_int_equal(tu_cli_run("check alias_views --budget 0"), 0);
    tu_cli_has("out", "OK");
    tu_cli_cleanup((const char *[]){"out", "err"}, 2);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_duplicate_input_not_mutated),
        cmocka_unit_test(test_duplicate_input_mutated),
        cmocka_unit_test(test_gpt2_tied_weights),
        cmocka_unit_test(test_view_base_zoo),
        cmocka_unit_test(test_synthetic_base),
        cmocka_unit_test(test_aliased_inputs_not_mutated),
        cmocka_unit_test(test_metadata_mutation),
        cmocka_unit_test(test_metadata_mutation_of_merged_input),
        cmocka_unit_test(test_inplace_view_ops),
        cmocka_unit_test(test_outputs_alias_inputs),
        cmocka_unit_test(test_two_views_of_intermediate),
        cmocka_unit_test(test_one_view_of_intermediate),
        cmocka_unit_test(test_view_of_another_output),
        cmocka_unit_test(test_mutation_through_views),
        cmocka_unit_test(test_allocation_failures),
        cmocka_unit_test(test_fx_utils_alias_views),
        cmocka_unit_test(test_cli),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
