/* A mutated input that requires grad (issue 13, "faithful where we differ"): as upstream, the
 * export clones it before the forward mutates it (maybe_to_fresh_input), its new value is an
 * InputMutationAOTOutput that takes the first tangent, and the backward gives the gradient of
 * the input's original value; the compiled callable returns the new value from its autograd
 * node and writes it back with an autograd-visible copy_, so a loss computed from the mutated
 * tensor after the call backpropagates through the compiled backward. Checked against eager
 * with both partitioners and the interpreter; a leaf that requires grad is refused at call
 * time as eager refuses the in-place op. */
#include "testutil.h"

#include <stdio.h>
#include <string.h>

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

/* x.mul_(2); return x * x */
static int mul_fwd(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)m, (void)nin, (void)max_out;
    ag_scope_begin();
    ag_tensor *y = ag_mul_scalar_(in[0], 2.0) ? ag_mul(in[0], in[0]) : NULL;
    return give(&y, 1, out);
}

/* y = x + w; x.add_(1); return y * x: the forward reads x before and after the mutation */
static int add_fwd(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)nin, (void)max_out;
    ag_scope_begin();
    ag_tensor *y = ag_add(in[0], ag_module_param(m, "w"));
    ag_tensor *r = ag_add_scalar_(in[0], 1.0) ? ag_mul(y, in[0]) : NULL;
    return give(&r, 1, out);
}

/* The same mutation hidden from autograd (grad mode off around it): y = x + w. */
static int nograd_fwd(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)nin, (void)max_out;
    ag_scope_begin();
    ag_tensor *y = ag_add(in[0], ag_module_param(m, "w"));
    bool prev = ag_set_grad_enabled(false);
    ag_tensor *r = ag_add_scalar_(in[0], 1.0);
    ag_set_grad_enabled(prev);
    return give(r ? &y : &r, 1, out);
}

/* w.mul_(2) on the module's own parameter; return x * w */
static int param_fwd(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)nin, (void)max_out;
    ag_scope_begin();
    ag_tensor *w = ag_module_param(m, "w");
    ag_tensor *y = ag_mul_scalar_(w, 2.0) ? ag_mul(in[0], w) : NULL;
    return give(&y, 1, out);
}

/* x[0].mul_(2); return x * 3: a mutation through a view */
static int view_fwd(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)m, (void)nin, (void)max_out;
    ag_scope_begin();
    ag_tensor *v = ag_select(in[0], 0, 0);
    ag_tensor *y = v && ag_mul_scalar_(v, 2.0) ? ag_mul_scalar(in[0], 3.0) : NULL;
    return give(&y, 1, out);
}

static ag_module *module(const char *type, ag_forward_fn fwd, bool with_w) {
    ag_module *m = ag_module_new(type, fwd, NULL, NULL);
    assert_non_null(m);
    if (with_w) {
        ag_tensor *w = tu_tensor(AG_F32, 1, (int64_t[]){3}, (double[]){0.5, -1.5, 2.0});
        assert_int_equal(ag_module_register_parameter(m, "w", w), 0);
        ag_tensor_free(w);
    }
    return m;
}

static ag_tensor *a_leaf(void) {
    return tu_leaf(AG_F32, 1, (int64_t[]){3}, (double[]){1.0, -2.0, 3.0});
}

static ag_joint *export_or_fail(ag_module *m, ag_tensor *x) {
    ag_joint *j = ag_export_joint(m, &x, 1, NULL, NULL, 0, NULL);
    if (!j)
        fail_msg("export: %s", ag_last_error());
    return j;
}

/* The printed joint: the clone, the mutation's tangent first, the original input's gradient. */
static void test_export_whole_tensor(void **st) {
    (void)st;
    ag_module *m = module("MulInPlace", mul_fwd, false);
    ag_tensor *x = a_leaf();
    ag_joint *j = export_or_fail(m, x);
    const ag_graph *g = ag_joint_graph(j);
    tu_expect_placeholder_descs(
        g,
        (const char *[]){"PlainAOTInput(idx=0)",
                         "TangentAOTInput(output=InputMutationAOTOutput(mutated_input="
                         "PlainAOTInput(idx=0)))",
                         "TangentAOTInput(output=PlainAOTOutput(idx=0))"},
        3);
    tu_expect_output_descs(
        g,
        (const char *[]){"InputMutationAOTOutput(mutated_input=PlainAOTInput(idx=0))",
                         "PlainAOTOutput(idx=0)", "GradAOTOutput(grad_of=PlainAOTInput(idx=0))"},
        3);
    assert_true(ag_joint_needs_autograd(j));
    assert_int_equal(ag_joint_num_tangents(j), 2);
    assert_int_equal(ag_joint_num_mutated_inputs(j), 1);
    assert_true(ag_joint_input_info(j, 0)->mutates_data);
    assert_true(ag_joint_input_info(j, 0)->requires_grad);
    ag_print_opts po = {0};
    char *text = ag_graph_to_string(g, &po);
    assert_non_null(text);
    /* upstream's joint for the same function, up to op spellings (mul.Scalar for mul(x, 2)) */
    const char *want =
        "graph():\n"
        "    %primals_1 : f32[3]  # PlainAOTInput(idx=0)  is_forward\n"
        "    %tangents_1 : f32[3]  # TangentAOTInput(output=InputMutationAOTOutput(mutated_input="
        "PlainAOTInput(idx=0)))  is_backward\n"
        "    %tangents_2 : f32[3]  # TangentAOTInput(output=PlainAOTOutput(idx=0))  is_backward\n"
        "    %clone = clone(%primals_1)  # f32[3]  is_forward\n"
        "    %mul = mul.Scalar(%clone, 2.0)  # f32[3]  is_forward\n"
        "    %mul_1 = mul.Tensor(%mul, %mul)  # f32[3]  is_forward\n"
        "    %mul_2 = mul.Tensor(%tangents_2, %mul)  # f32[3]  is_backward\n"
        "    %mul_3 = mul.Tensor(%tangents_2, %mul)  # f32[3]  is_backward\n"
        "    %add = add.Tensor(%tangents_1, %mul_2)  # f32[3]  is_backward  gradient_acc\n"
        "    %add_1 = add.Tensor(%add, %mul_3)  # f32[3]  is_backward  gradient_acc\n"
        "    %mul_4 = mul.Scalar(%add_1, 2.0)  # f32[3]  is_backward\n"
        "    return (%mul, %mul_1, %mul_4)  # [InputMutationAOTOutput(mutated_input="
        "PlainAOTInput(idx=0)), PlainAOTOutput(idx=0), GradAOTOutput(grad_of="
        "PlainAOTInput(idx=0))]\n";
    if (strcmp(text, want))
        fail_msg("printed joint:\n%s\nexpected:\n%s", text, want);
    ag_free(text);
    /* The export left the example input as it was: a leaf. */
    assert_null(ag_tensor_grad_fn_name(x));
    tu_assert_close(x, (double[]){1.0, -2.0, 3.0}, 0);
    ag_joint_free(j);
    ag_tensor_free(x);
    ag_module_free(m);
}

/* x = a * 1 (not a leaf); fwd mutates x and returns y; loss = sum(y * c) + sum(x * 3) with x
 * after the call. Runs eagerly (c NULL) or through c; returns y, x and a.grad (kept). */
static void run_case(ag_module *m, ag_compiled *c, ag_tensor **y, ag_tensor **x_after,
                     ag_tensor **a_grad) {
    ag_tensor *a = a_leaf();
    ag_scope_begin();
    ag_tensor *x = ag_mul_scalar(a, 1.0);
    ag_tensor *out[1] = {NULL};
    int n = c ? ag_compiled_call_module(c, m, &x, 1, out, 1) : ag_module_call(m, &x, 1, out, 1);
    if (n != 1)
        fail_msg("%s call: %s", c ? "compiled" : "eager", ag_last_error());
    assert_true(ag_tensor_requires_grad(x));
    assert_non_null(ag_tensor_grad_fn_name(x)); /* the mutation is x's history now */
    ag_tensor *wy = tu_tensor(AG_F32, 1, (int64_t[]){3}, (double[]){0.25, 1.0, -0.75});
    ag_tensor *loss = ag_add(ag_sum_all(ag_mul(out[0], wy)), ag_sum_all(ag_mul_scalar(x, 3.0)));
    assert_non_null(loss);
    assert_int_equal(ag_backward(loss, NULL, false), 0);
    *y = ag_tensor_keep(ag_detach(out[0]));
    *x_after = ag_tensor_keep(ag_detach(x));
    *a_grad = ag_tensor_keep(ag_tensor_grad(a));
    ag_scope_end();
    ag_tensor_free(a);
}

static void expect_same(const char *what, const ag_tensor *want, const ag_tensor *got) {
    assert_non_null(want);
    assert_non_null(got);
    double d = tu_max_abs_diff(want, got);
    if (!(d <= 1e-5))
        fail_msg("%s differs from eager by %g", what, d);
}

static void check_against_eager(const char *type, ag_forward_fn fwd, bool with_w) {
    ag_module *m = module(type, fwd, with_w);
    ag_tensor *ye, *xe, *ge;
    run_case(m, NULL, &ye, &xe, &ge);
    ag_tensor *x = a_leaf();
    ag_joint *j = export_or_fail(m, x);
    ag_tensor_free(x);
    for (int mode = 0; mode < 3; mode++) {
        ag_compile_opts co = {
            .partition = {.partitioner = mode == 1 ? AG_PARTITION_MINCUT : AG_PARTITION_DEFAULT,
                          .memory_budget = 1.0},
            .interpret = mode == 2};
        ag_compiled *c = ag_compile_joint(j, &co);
        if (!c)
            fail_msg("compile: %s", ag_last_error());
        ag_tensor *yc, *xc, *gc;
        run_case(m, c, &yc, &xc, &gc);
        expect_same("y", ye, yc);
        expect_same("x after the call", xe, xc);
        expect_same("a.grad", ge, gc);
        ag_tensor_free(yc);
        ag_tensor_free(xc);
        ag_tensor_free(gc);
        ag_compiled_free(c);
    }
    ag_tensor_free(ye);
    ag_tensor_free(xe);
    ag_tensor_free(ge);
    ag_joint_free(j);
    ag_module_free(m);
}

static void test_compiled_whole_tensor(void **st) {
    (void)st;
    check_against_eager("MulInPlace", mul_fwd, false);
}

static void test_compiled_read_before_and_after(void **st) {
    (void)st;
    /* The clone comes before every read of x, the one before the mutation included (the
     * export's second pass): x + w reads the clone, so x's gradient has both terms. */
    ag_module *m = module("AddInPlace", add_fwd, true);
    ag_tensor *x = a_leaf();
    ag_joint *j = export_or_fail(m, x);
    ag_node *n = ag_graph_first(ag_joint_graph(j));
    while (n && ag_node_kind_of(n) == AG_NODE_PLACEHOLDER)
        n = ag_node_next(n);
    assert_non_null(n);
    assert_string_equal(ag_node_name(n), "clone");
    tu_expect_output_descs(
        ag_joint_graph(j),
        (const char *[]){"InputMutationAOTOutput(mutated_input=PlainAOTInput(idx=0))",
                         "PlainAOTOutput(idx=0)",
                         "GradAOTOutput(grad_of=ParamAOTInput(target='w'))",
                         "GradAOTOutput(grad_of=PlainAOTInput(idx=0))"},
        4);
    ag_node *gx = ag_node_arg(ag_graph_output_node(ag_joint_graph(j)), 0)->u.nodes[3];
    assert_string_equal(ag_node_name(gx), "add_3"); /* tangents_1 + two products */
    ag_joint_free(j);
    ag_tensor_free(x);
    ag_module_free(m);
    check_against_eager("AddInPlace", add_fwd, true);
}

/* Hand-checked values for the mul_ model (a = [1, -2, 3]): x = 2a, y = 4a^2; loss = sum(y c) +
 * sum(3 x) with c = [0.25, 1, -0.75]: a.grad = 8 a c + 6. */
static void test_values(void **st) {
    (void)st;
    ag_module *m = module("MulInPlace", mul_fwd, false);
    ag_tensor *x = a_leaf();
    ag_joint *j = export_or_fail(m, x);
    ag_compiled *c = ag_compile_joint(j, NULL);
    assert_non_null(c);
    ag_tensor *y, *xa, *g;
    run_case(m, c, &y, &xa, &g);
    tu_assert_close(y, (double[]){4, 16, 36}, 1e-5);
    tu_assert_close(xa, (double[]){2, -4, 6}, 1e-5);
    tu_assert_close(g, (double[]){8 * 0.25 + 6, -16 + 6, -18 + 6}, 1e-5);
    ag_tensor_free(y);
    ag_tensor_free(xa);
    ag_tensor_free(g);
    ag_compiled_free(c);
    ag_joint_free(j);
    ag_tensor_free(x);
    ag_module_free(m);
}

/* Eager refuses the in-place op on a leaf that requires grad; so does the call, before it runs
 * (the leaf unchanged, no output). With grad mode off both mutate it. */
static void test_leaf_refused(void **st) {
    (void)st;
    ag_module *m = module("MulInPlace", mul_fwd, false);
    ag_tensor *x = a_leaf();
    ag_joint *j = export_or_fail(m, x);
    ag_compiled *c = ag_compile_joint(j, NULL);
    assert_non_null(c);
    ag_tensor *out[1] = {NULL};
    assert_true(ag_module_call(m, &x, 1, out, 1) < 0);
    tu_assert_error_contains("a leaf tensor that requires grad is being used in an in-place "
                             "operation");
    assert_true(ag_compiled_call(c, &x, 1, out, 1) < 0);
    tu_assert_error_contains("PlainAOTInput(idx=0) (input 0) is a leaf tensor that requires grad");
    tu_assert_error_contains("a leaf tensor that requires grad is being used in an in-place "
                             "operation");
    assert_null(out[0]);
    tu_assert_close(x, (double[]){1.0, -2.0, 3.0}, 0);
    assert_null(ag_tensor_grad_fn_name(x));
    bool prev = ag_set_grad_enabled(false);
    ag_scope_begin();
    assert_int_equal(ag_compiled_call(c, &x, 1, out, 1), 1);
    tu_assert_close(out[0], (double[]){4, 16, 36}, 1e-5);
    tu_assert_close(x, (double[]){2, -4, 6}, 1e-5);
    ag_scope_end();
    ag_set_grad_enabled(prev);
    assert_null(ag_tensor_grad_fn_name(x));
    ag_compiled_free(c);
    ag_joint_free(j);
    ag_tensor_free(x);
    ag_module_free(m);
}

/* A mutation under grad mode off is hidden from autograd: no tangent, written back without
 * history, and x's gradient is only through y. */
static void test_hidden_mutation(void **st) {
    (void)st;
    ag_module *m = module("NoGradInPlace", nograd_fwd, true);
    ag_tensor *x = a_leaf();
    ag_joint *j = export_or_fail(m, x);
    const ag_graph *g = ag_joint_graph(j);
    tu_expect_placeholder_descs(g,
                                (const char *[]){"ParamAOTInput(target='w')",
                                                 "PlainAOTInput(idx=0)",
                                                 "TangentAOTInput(output=PlainAOTOutput(idx=0))"},
                                3);
    tu_expect_output_descs(
        g,
        (const char *[]){"InputMutationAOTOutput(mutated_input=PlainAOTInput(idx=0))",
                         "PlainAOTOutput(idx=0)",
                         "GradAOTOutput(grad_of=ParamAOTInput(target='w'))",
                         "GradAOTOutput(grad_of=PlainAOTInput(idx=0))"},
        4);
    ag_joint_free(j);
    ag_tensor_free(x);
    ag_module_free(m);
}

/* A saved joint with a mutation's tangent loads back the same (text and convention). */
static void test_joint_round_trip(void **st) {
    (void)st;
    ag_module *m = module("AddInPlace", add_fwd, true);
    ag_tensor *x = a_leaf();
    ag_joint *j = export_or_fail(m, x);
    char *s = NULL, *s2 = NULL;
    size_t n = 0, n2 = 0;
    if (ag_joint_save(j, &s, &n))
        fail_msg("save: %s", ag_last_error());
    ag_joint *k = ag_joint_load(s, n);
    if (!k)
        fail_msg("load: %s", ag_last_error());
    assert_int_equal(ag_joint_save(k, &s2, &n2), 0);
    assert_int_equal(n, n2);
    assert_string_equal(s, s2);
    assert_int_equal(ag_joint_num_tangents(k), 2);
    assert_true(ag_joint_input_info(k, 1)->mutates_data);
    assert_true(ag_joint_input_info(k, 1)->requires_grad);
    uint64_t h1 = 0, h2 = 0;
    assert_int_equal(ag_joint_hash(j, &h1), 0);
    assert_int_equal(ag_joint_hash(k, &h2), 0);
    assert_true(h1 == h2);
    /* The loaded joint compiles to the same callable. */
    ag_compiled *c1 = ag_compile_joint(j, NULL), *c2 = ag_compile_joint(k, NULL);
    assert_non_null(c1);
    assert_non_null(c2);
    ag_tensor *y1, *x1, *g1, *y2, *x2, *g2;
    run_case(m, c1, &y1, &x1, &g1);
    run_case(m, c2, &y2, &x2, &g2);
    expect_same("y", y1, y2);
    expect_same("x", x1, x2);
    expect_same("a.grad", g1, g2);
    ag_tensor_free(y1), ag_tensor_free(x1), ag_tensor_free(g1);
    ag_tensor_free(y2), ag_tensor_free(x2), ag_tensor_free(g2);
    ag_compiled_free(c1);
    ag_compiled_free(c2);
    ag_free(s);
    ag_free(s2);
    ag_joint_free(k);
    ag_joint_free(j);
    ag_tensor_free(x);
    ag_module_free(m);
}

/* A parameter mutated in place: the joint has its mutation and tangent; the export leaves the
 * parameter as it was (a leaf, unchanged), and the call refuses, as eager does, while the
 * parameter is a leaf that requires grad. */
static void test_parameter_mutated(void **st) {
    (void)st;
    ag_module *m = module("ParamInPlace", param_fwd, true);
    ag_tensor *x = tu_tensor(AG_F32, 1, (int64_t[]){3}, (double[]){1.0, 2.0, 3.0});
    ag_joint *j = export_or_fail(m, x);
    tu_expect_placeholder_descs(
        ag_joint_graph(j),
        (const char *[]){"ParamAOTInput(target='w')", "PlainAOTInput(idx=0)",
                         "TangentAOTInput(output=InputMutationAOTOutput(mutated_input="
                         "ParamAOTInput(target='w')))",
                         "TangentAOTInput(output=PlainAOTOutput(idx=0))"},
        4);
    tu_expect_output_descs(
        ag_joint_graph(j),
        (const char *[]){"InputMutationAOTOutput(mutated_input=ParamAOTInput(target='w'))",
                         "PlainAOTOutput(idx=0)",
                         "GradAOTOutput(grad_of=ParamAOTInput(target='w'))", "None"},
        4);
    ag_tensor *w = ag_module_param(m, "w");
    assert_null(ag_tensor_grad_fn_name(w));
    tu_assert_close(w, (double[]){0.5, -1.5, 2.0}, 0);
    ag_compiled *c = ag_compile_joint(j, NULL);
    assert_non_null(c);
    ag_tensor *out[1] = {NULL};
    assert_true(ag_compiled_call_module(c, m, &x, 1, out, 1) < 0);
    tu_assert_error_contains("is a leaf tensor that requires grad");
    tu_assert_close(w, (double[]){0.5, -1.5, 2.0}, 0);
    ag_compiled_free(c);
    ag_joint_free(j);
    ag_tensor_free(x);
    ag_module_free(m);
}

/* A mutation through a view of an input that requires grad: our eager engine does not support
 * in-place ops on views taking part in autograd (no CopySlices yet), and the export says so in
 * eager's words instead of tracing something else. */
/* x[0].mul_(2) on a grad-requiring input: eager records CopySlices on x, and the export and
 * the compiled callable (both partitioners, the interpreter) match it. */
static void test_view_mutation(void **st) {
    (void)st;
    ag_module *m = module("ViewInPlace", view_fwd, false);
    ag_tensor *y, *x, *g;
    run_case(m, NULL, &y, &x, &g);
    /* x after = [2 a0, a1, a2], y = 3 x; loss = sum(y * [0.25, 1, -0.75]) + sum(3 x) */
    tu_assert_close(x, (double[]){2.0, -2.0, 3.0}, 1e-6);
    tu_assert_close(y, (double[]){6.0, -6.0, 9.0}, 1e-6);
    tu_assert_close(g, (double[]){7.5, 6.0, 0.75}, 1e-6);
    ag_tensor_free(y);
    ag_tensor_free(x);
    ag_tensor_free(g);
    ag_module_free(m);
    check_against_eager("ViewInPlace", view_fwd, false);
}

/* Allocation failures anywhere in export, compile, call (the autograd-visible write-back) and
 * backward of the model that reads its input before and after mutating it (two passes): each
 * reports AG_ENOMEM and leaks nothing, and the tls hook never outlives the export. */
typedef struct oom_case {
    ag_module *m;
    ag_tensor *x;
} oom_case;

static int oom_scenario(void *ud) {
    oom_case *o = ud;
    ag_joint *j = ag_export_joint(o->m, &o->x, 1, NULL, NULL, 0, NULL);
    if (!j)
        return ag_last_status();
    ag_compiled *c = ag_compile_joint(j, NULL);
    int rc = c ? 0 : ag_last_status();
    ag_scope_begin();
    ag_tensor *x = rc ? NULL : ag_mul_scalar(o->x, 1.0), *out[1] = {NULL};
    if (!rc && !x)
        rc = ag_last_status();
    if (!rc && ag_compiled_call_module(c, o->m, &x, 1, out, 1) < 0)
        rc = ag_last_status();
    ag_tensor *l = rc ? NULL : ag_add(ag_sum_all(out[0]), ag_sum_all(x));
    if (!rc && (!l || ag_backward(l, NULL, false)))
        rc = ag_last_status();
    tu_alloc_cleanup_begin();
    ag_tensor_set_grad(o->x, NULL);
    ag_tensor_set_grad(ag_module_param(o->m, "w"), NULL);
    ag_scope_end();
    ag_compiled_free(c);
    ag_joint_free(j);
    tu_alloc_cleanup_end();
    return rc;
}

static void test_allocation_failures(void **st) {
    (void)st;
    oom_case o = {module("AddInPlace", add_fwd, true), a_leaf()};
    tu_sweep_opts so = {.what = "export, compile, call, backward AddInPlace", .one_thread = true};
    int64_t n = tu_alloc_failure_sweep(oom_scenario, &o, &so);
    assert_true(n > 300);
    /* The eager engine refuses an in-place op on a leaf again: no hook was left behind. */
    ag_tensor *out[1] = {NULL};
    assert_true(ag_module_call(o.m, &o.x, 1, out, 1) < 0);
    tu_assert_error_contains("a leaf tensor that requires grad is being used in an in-place");
    ag_tensor_free(o.x);
    ag_module_free(o.m);
}

/* The caller's input is itself a view (row 0 of b = a * 1, a [2, 3]): eager's in-place op
 * gives b a CopySlices history, and so does the compiled call's write-back. b after the call,
 * the output and a.grad (through b's later use too) match eager. */
static void run_view_input(ag_module *m, ag_compiled *c, ag_tensor **y, ag_tensor **b_after,
                           ag_tensor **a_grad) {
    ag_tensor *a = tu_leaf(AG_F32, 2, (int64_t[]){2, 3}, (double[]){1, -2, 3, 0.5, 4, -1});
    ag_scope_begin();
    ag_tensor *b = ag_mul_scalar(a, 1.0), *x = ag_select(b, 0, 0);
    ag_tensor *out[1] = {NULL};
    int n = c ? ag_compiled_call_module(c, m, &x, 1, out, 1) : ag_module_call(m, &x, 1, out, 1);
    if (n != 1)
        fail_msg("%s call: %s", c ? "compiled" : "eager", ag_last_error());
    assert_string_equal(ag_tensor_grad_fn_name(b), "CopySlices");
    ag_tensor *wy = tu_tensor(AG_F32, 1, (int64_t[]){3}, (double[]){0.25, 1.0, -0.75});
    ag_tensor *loss = ag_add(ag_sum_all(ag_mul(out[0], wy)), ag_sum_all(ag_mul_scalar(b, 3.0)));
    assert_int_equal(ag_backward(loss, NULL, false), 0);
    *y = ag_tensor_keep(ag_detach(out[0]));
    *b_after = ag_tensor_keep(ag_detach(b));
    *a_grad = ag_tensor_keep(ag_tensor_grad(a));
    ag_scope_end();
    ag_tensor_free(a);
}

static void test_view_input(void **st) {
    (void)st;
    ag_module *m = module("MulInPlace", mul_fwd, false);
    ag_tensor *ye, *be, *ge;
    run_view_input(m, NULL, &ye, &be, &ge);
    /* by hand: x = [1, -2, 3] -> [2, -4, 6]; y = x*x; dL/da row 0 = 2 * (2 * x_new * wy + 3),
     * row 1 = 3 */
    tu_assert_close(ye, (double[]){4, 16, 36}, 1e-6);
    tu_assert_close(ge,
                    (double[]){2 * (2 * 2 * 0.25 + 3), 2 * (2 * -4 * 1.0 + 3),
                               2 * (2 * 6 * -0.75 + 3), 3, 3, 3},
                    1e-5);
    ag_tensor *x = a_leaf();
    ag_joint *j = export_or_fail(m, x);
    ag_tensor_free(x);
    for (int mode = 0; mode < 2; mode++) {
        ag_compile_opts co = {.interpret = mode == 1};
        ag_compiled *c = ag_compile_joint(j, &co);
        assert_non_null(c);
        ag_tensor *yc, *bc, *gc;
        run_view_input(m, c, &yc, &bc, &gc);
        expect_same("y", ye, yc);
        expect_same("b after the call", be, bc);
        expect_same("a.grad", ge, gc);
        ag_tensor_free(yc);
        ag_tensor_free(bc);
        ag_tensor_free(gc);
        ag_compiled_free(c);
    }
    ag_tensor_free(ye);
    ag_tensor_free(be);
    ag_tensor_free(ge);
    ag_joint_free(j);
    ag_module_free(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_export_whole_tensor),
        cmocka_unit_test(test_compiled_whole_tensor),
        cmocka_unit_test(test_compiled_read_before_and_after),
        cmocka_unit_test(test_values),
        cmocka_unit_test(test_leaf_refused),
        cmocka_unit_test(test_hidden_mutation),
        cmocka_unit_test(test_joint_round_trip),
        cmocka_unit_test(test_parameter_mutated),
        cmocka_unit_test(test_view_mutation),
        cmocka_unit_test(test_view_input),
        cmocka_unit_test(test_allocation_failures),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
