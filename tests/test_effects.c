/* Effect tokens (issue 6, part 3): effectful ops threaded by with_effects through the joint
 * export, the graph IR (text, DOT, interpreter, executor, verifier), DCE and CSE, the
 * partitioners and the compiled callable, on the zoo's `effects` model, whose custom op
 * aotgrad_demo::log_value appends to a log that eager and compiled runs must fill alike.
 *
 * Expected descriptor lists are written from the spec (sections 3 and 6.3): forward tokens are
 * the first primals and the first outputs, backward tokens come after the tangents and after
 * the gradients. */
#include "testutil.h"
#include "core/internal.h" /* ag__tmeta_contiguous for the test op */

#include <math.h>
#include <stdio.h>
#include <string.h>

/* ---- helpers ---- */

/* The with_effects nodes of g in graph order, as "tag" or "tag.grad" (from their arguments),
 * space-separated. */
static char *effects_str(const ag_graph *g) {
    static char out[512];
    size_t k = 0;
    out[0] = 0;
    for (ag_node *n = ag_graph_first(g); n; n = ag_node_next(n)) {
        if (ag_node_kind_of(n) != AG_NODE_CALL || !ag_op_with_effects_target(ag_node_op(n)))
            continue;
        const ag_garg *tag = ag_node_arg(n, 3), *grad = ag_node_arg(n, 4);
        bool is_grad = grad && grad->kind == AG_GA_BOOL && grad->u.b;
        k += (size_t)snprintf(out + k, sizeof out - k, "%s%s%s", k ? " " : "", tag->u.s,
                              is_grad ? ".grad" : "");
    }
    return out;
}

static int count_op(const ag_graph *g, const ag_op *op) {
    int c = 0;
    for (ag_node *n = ag_graph_first(g); n; n = ag_node_next(n))
        c += ag_node_kind_of(n) == AG_NODE_CALL && ag_node_op(n) == op;
    return c;
}

/* The log from record `from` on as "tag[.grad]" words. */
static char *log_str(int from) {
    static char out[1024];
    size_t k = 0;
    out[0] = 0;
    for (int i = from; i < ag_zoo_log_count(); i++) {
        ag_zoo_log_record r;
        assert_int_equal(ag_zoo_log_get(i, &r), 0);
        k += (size_t)snprintf(out + k, sizeof out - k, "%s%s%s", k ? " " : "", r.tag,
                              r.grad ? ".grad" : "");
    }
    return out;
}

typedef struct model {
    ag_module *m;
    ag_tensor *in[8];
    int nin;
    ag_joint *j;
} model;

static void model_open(model *md, const char *name) {
    memset(md, 0, sizeof *md);
    assert_int_equal(ag_zoo_build(name, NULL, &md->m, md->in, 8, &md->nin), 0);
    md->j = ag_export_joint(md->m, md->in, md->nin, NULL, NULL, 0, NULL);
    if (!md->j)
        fail_msg("export %s: %s", name, ag_last_error());
}

static void model_close(model *md) {
    ag_joint_free(md->j);
    ag_module_free(md->m);
    for (int i = 0; i < md->nin; i++)
        ag_tensor_free(md->in[i]);
}

/* ---- the joint's calling convention ---- */

static void test_joint_descriptors(void **st) {
    (void)st;
    model md;
    model_open(&md, "effects");
    const ag_graph *g = ag_joint_graph(md.j);
    assert_string_equal(tu_placeholders_str(g),
                        "primals_1: ForwardTokenAOTInput(idx=0)\n"
                        "primals_2: ParamAOTInput(target='linear1.weight')\n"
                        "primals_3: ParamAOTInput(target='linear1.bias')\n"
                        "primals_4: ParamAOTInput(target='linear2.weight')\n"
                        "primals_5: ParamAOTInput(target='linear2.bias')\n"
                        "primals_6: PlainAOTInput(idx=0)\n"
                        "tangents_1: TangentAOTInput(output=PlainAOTOutput(idx=0))\n"
                        "tangents_token: BackwardTokenAOTInput(idx=0)\n");
    assert_string_equal(tu_outputs_str(g),
                        "ForwardTokenAOTOutput(idx=0), PlainAOTOutput(idx=0), "
                        "GradAOTOutput(grad_of=ParamAOTInput(target='linear1.weight')), "
                        "GradAOTOutput(grad_of=ParamAOTInput(target='linear1.bias')), "
                        "GradAOTOutput(grad_of=ParamAOTInput(target='linear2.weight')), "
                        "GradAOTOutput(grad_of=ParamAOTInput(target='linear2.bias')), None, "
                        "BackwardTokenAOTOutput(idx=0)");
    assert_int_equal(ag_joint_num_forward_tokens(md.j), 1);
    assert_int_equal(ag_joint_num_backward_tokens(md.j), 1);
    assert_int_equal(ag_joint_num_primals(md.j), 6);
    assert_int_equal(ag_joint_num_tangents(md.j), 1);
    assert_int_equal(ag_joint_num_fw_outputs(md.j), 2); /* the token and the user output */
    assert_int_equal(ag_joint_num_user_outputs(md.j), 1);
    assert_false(ag_joint_input_info(md.j, 0)->requires_grad);
    assert_true(ag_joint_input_info(md.j, 1)->requires_grad);
    /* Static inputs are the parameters, now primals 1..4 (0-based). */
    assert_int_equal(ag_joint_num_static_inputs(md.j), 4);
    for (int i = 0; i < 4; i++)
        assert_int_equal(ag_joint_static_input(md.j, i), i + 1);
    /* Tokens are empty f32 tensors. */
    const ag_tmeta *tv = ag_node_val(ag_graph_find(g, "primals_1"), 0);
    assert_int_equal(tv->dtype, AG_F32);
    assert_int_equal(tv->ndim, 1);
    assert_int_equal(tv->sizes[0], 0);
    assert_string_equal(ag_node_partitioner_tag(ag_graph_find(g, "tangents_token")), "is_backward");

    /* The effects in program order: forward h, y; backward y's gradient, then h's. */
    assert_string_equal(effects_str(g), "h y y.grad h.grad");
    /* Each takes the previous one's token: the forward chain starts at primals_1, the
     * backward chain at tangents_token, and each chain's last token is an output. */
    const char *want_token[] = {"primals_1", "getitem", "tangents_token", "getitem_4"};
    const char *want_tag[] = {"is_forward", "is_forward", "is_backward", "is_backward"};
    int k = 0;
    int64_t fw_seq[2] = {-1, -1};
    for (ag_node *n = ag_graph_first(g); n; n = ag_node_next(n)) {
        if (ag_node_kind_of(n) != AG_NODE_CALL || !ag_op_with_effects_target(ag_node_op(n)))
            continue;
        assert_true(k < 4);
        assert_string_equal(ag_node_name(ag_node_arg_node(n, 0)), want_token[k]);
        assert_string_equal(ag_node_arg(n, 1)->u.s, "aotgrad_demo::log_value");
        assert_string_equal(ag_node_partitioner_tag(n), want_tag[k]);
        assert_ptr_equal(ag_op_with_effects_target(ag_node_op(n)), ag_zoo_log_value_op());
        /* Backward effects carry their forward op's seq_nr (y's gradient first). */
        if (k < 2)
            fw_seq[k] = ag_node_seq_nr(n);
        else
            assert_int_equal(ag_node_seq_nr(n), fw_seq[3 - k]);
        k++;
    }
    assert_int_equal(k, 4);
    assert_true(fw_seq[0] >= 0 && fw_seq[1] > fw_seq[0]);
    ag_node *out = ag_graph_output_node(g);
    assert_string_equal(ag_node_name(ag_node_arg(out, 0)->u.nodes[0]), "getitem_2");
    assert_string_equal(ag_node_name(ag_node_arg(out, 0)->u.nodes[7]), "getitem_6");
    assert_int_equal(ag_graph_verify(g), 0);
    /* The calling-convention check of a processed graph knows the tokens. */
    assert_int_equal(ag_joint_set_graph(md.j, ag_graph_copy(g)), 0);
    ag_graph *bad = ag_graph_copy(ag_joint_graph(md.j));
    ag_desc *wrong = ag_desc_forward_token_input(0);
    assert_int_equal(ag_node_set_desc(ag_graph_find(bad, "tangents_token"), wrong), 0);
    ag_desc_release(wrong);
    assert_int_equal(ag_joint_set_graph(md.j, bad), AG_EINVAL);
    tu_assert_error_contains("placeholder 7 (tangents_token) is ForwardTokenAOTInput(idx=0); "
                             "the calling convention expects BackwardTokenAOTInput(idx=0)");
    model_close(&md);

    /* A model without effectful ops has no token anywhere. */
    model_open(&md, "linear");
    assert_int_equal(ag_joint_num_forward_tokens(md.j), 0);
    assert_int_equal(ag_joint_num_backward_tokens(md.j), 0);
    assert_string_equal(tu_placeholders_str(ag_joint_graph(md.j)),
                        "primals_1: ParamAOTInput(target='linear.weight')\n"
                        "primals_2: ParamAOTInput(target='linear.bias')\n"
                        "primals_3: PlainAOTInput(idx=0)\n"
                        "tangents_1: TangentAOTInput(output=PlainAOTOutput(idx=0))\n");
    assert_int_equal(ag_joint_static_input(md.j, 0), 0);
    model_close(&md);
}

/* An effect only in the backward: test::scale2(x) = 2x is pure, but its backward logs the
 * gradient it passes on (aotgrad_demo::log_value, grad=True). The forward then has no token,
 * the backward has one. */
static int scale2_meta(const ag_arg *a, ag_tmeta *o) {
    ag__tmeta_contiguous(&o[0], a[0].u.t->dtype, a[0].u.t->ndim, a[0].u.t->sizes);
    return 0;
}
static int scale2_kernel(const ag_arg *a, ag_tensor **o) {
    for (int64_t i = 0; i < ag_tensor_numel(a[0].u.t); i++)
        ((float *)ag_tensor_data(o[0]))[i] = 2 * (float)ag_tensor_item_at(a[0].u.t, i);
    return 0;
}
static int scale2_backward(ag_bwctx *c) {
    ag_tensor *g = ag_mul_scalar(c->grad_outputs[0], 2);
    c->grad_inputs[0] = ag_op_call1(ag_zoo_log_value_op(),
                                    (ag_arg[]){AG_A_T(g), AG_A_S("scale2"), AG_A_B(true)}, 3);
    return c->grad_inputs[0] ? 0 : ag_last_status();
}
static const ag_opdef scale2_def = {
    .schema = "test_effects::scale2(Tensor x) -> Tensor",
    .meta = scale2_meta,
    .kernel = scale2_kernel,
    .dtypes = 1u << AG_F32,
    .backward = scale2_backward,
};

static int bw_only_fwd(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int max) {
    (void)nin;
    (void)max;
    static const ag_op *scale2;
    if (!scale2)
        scale2 = ag_op_register(&scale2_def);
    ag_scope_begin();
    ag_tensor *y =
        ag_op_call1(scale2, (ag_arg[]){AG_A_T(ag_mul(ag_module_param(m, "w"), in[0]))}, 1);
    out[0] = y ? ag_tensor_keep(y) : NULL;
    ag_scope_end();
    return out[0] ? 1 : ag_last_status();
}

static ag_module *bw_only_module(void) {
    ag_module *m = ag_module_new("BackwardEffect", bw_only_fwd, NULL, NULL);
    assert_non_null(m);
    ag_tensor *w = tu_tensor(AG_F32, 1, (int64_t[]){3}, (double[]){1, 2, 3});
    assert_int_equal(ag_module_register_parameter(m, "w", w), 0);
    ag_tensor_free(w);
    return m;
}

static void test_backward_only_effect(void **st) {
    (void)st;
    ag_module *m = bw_only_module(), *me = bw_only_module();
    ag_tensor *x = tu_tensor(AG_F32, 1, (int64_t[]){3}, (double[]){0.5, -1, 4});
    ag_joint *j = ag_export_joint(m, &x, 1, NULL, NULL, 0, NULL);
    if (!j)
        fail_msg("export: %s", ag_last_error());
    assert_int_equal(ag_joint_num_forward_tokens(j), 0);
    assert_int_equal(ag_joint_num_backward_tokens(j), 1);
    assert_int_equal(ag_joint_num_fw_outputs(j), 1);
    assert_string_equal(tu_placeholders_str(ag_joint_graph(j)),
                        "primals_1: ParamAOTInput(target='w')\n"
                        "primals_2: PlainAOTInput(idx=0)\n"
                        "tangents_1: TangentAOTInput(output=PlainAOTOutput(idx=0))\n"
                        "tangents_token: BackwardTokenAOTInput(idx=0)\n");
    assert_string_equal(tu_outputs_str(ag_joint_graph(j)),
                        "PlainAOTOutput(idx=0), GradAOTOutput(grad_of=ParamAOTInput(target='w')), "
                        "None, BackwardTokenAOTOutput(idx=0)");
    /* Compiled: nothing logged by the forward, the gradient logged once by the backward,
     * with the eager value. */
    ag_compiled *c = ag_compile_joint(j, NULL);
    if (!c)
        fail_msg("compile: %s", ag_last_error());
    double sums[2];
    for (int run = 0; run < 2; run++) {
        ag_scope_begin();
        int from = ag_zoo_log_count();
        ag_tensor *out[1];
        int n =
            run ? ag_compiled_call_module(c, m, &x, 1, out, 1) : ag_module_call(me, &x, 1, out, 1);
        assert_int_equal(n, 1);
        assert_int_equal(ag_zoo_log_count(), from);
        assert_int_equal(ag_backward(ag_sum_all(ag_mul(out[0], out[0])), NULL, false), 0);
        assert_string_equal(log_str(from), "scale2.grad");
        ag_zoo_log_record r;
        assert_int_equal(ag_zoo_log_get(from, &r), 0);
        sums[run] = r.sum;
        ag_scope_end();
    }
    assert_true(sums[0] == sums[1]);
    /* d(sum(y^2))/dx through y = 2 w x: 2y * 2 = 8 w x, summed: 8 * (0.5 - 2 + 12). */
    assert_true(fabs(sums[0] - 8 * 10.5) < 1e-5);
    assert_true(tu_max_abs_diff(ag_tensor_grad(ag_module_param(m, "w")),
                                ag_tensor_grad(ag_module_param(me, "w"))) == 0);
    ag_compiled_free(c);
    ag_joint_free(j);
    ag_tensor_free(x);
    ag_module_free(m);
    ag_module_free(me);
}

/* ---- DCE and CSE ---- */

static void test_dce_and_cse_keep_effects(void **st) {
    (void)st;
    const ag_op *log = ag_zoo_log_value_op();
    const ag_op *we = ag_op_with_effects(log);
    assert_non_null(we);
    ag_graph *g = ag_graph_new();
    ag_node *tok = tu_ph(g, "tok", TM(AG_F32, 0));
    ag_node *x = tu_ph(g, "x", TM(AG_F32, 4));
    /* Two identical with_effects calls whose results nobody reads, two identical plain calls
     * of the effectful op (as a plain trace records them), and two identical pure calls. */
    ag_garg wa[] = {AG_GA_N(tok), AG_GA_S("aotgrad_demo::log_value"), AG_GA_N(x), AG_GA_S("a")};
    ag_node *w1 = ag_graph_call(g, we, wa, 4, NULL);
    ag_node *w2 = ag_graph_call(g, we, wa, 4, NULL);
    assert_non_null(w1);
    assert_non_null(w2);
    assert_string_equal(ag_node_name(w1), "with_effects");
    assert_string_equal(ag_node_name(w2), "with_effects_1");
    assert_int_equal(ag_node_num_vals(w1), 2);
    ag_node *g1 = ag_graph_getitem(g, w1, 1, NULL), *g2 = ag_graph_getitem(g, w2, 1, NULL);
    ag_garg la[] = {AG_GA_N(x), AG_GA_S("b")};
    ag_node *l1 = ag_graph_call(g, log, la, 2, NULL), *l2 = ag_graph_call(g, log, la, 2, NULL);
    ag_node *n1 = tu_call(g, "neg", GARGS(AG_GA_N(x)), NULL);
    ag_node *n2 = tu_call(g, "neg", GARGS(AG_GA_N(x)), NULL);
    ag_node *sum = tu_call(g, "add.Tensor", GARGS(AG_GA_N(n1), AG_GA_N(n2)), NULL);
    ag_node *s2 = tu_call(g, "add.Tensor", GARGS(AG_GA_N(g1), AG_GA_N(g2)), NULL);
    ag_node *s3 = tu_call(g, "add.Tensor", GARGS(AG_GA_N(l1), AG_GA_N(l2)), NULL);
    assert_non_null(ag_graph_output(g, (ag_node *[]){sum, s2, s3}, 3));
    /* CSE merges the pure pair only. */
    assert_int_equal(ag_graph_cse(g), 1);
    assert_non_null(ag_graph_find(g, "with_effects_1"));
    assert_int_equal(count_op(g, we), 2);
    assert_int_equal(count_op(g, log), 2);
    assert_int_equal(count_op(g, tu_op("neg")), 1);
    /* Nothing reads the effects any more: DCE drops their getitems and users, not them. */
    ag_node *out = ag_graph_output_node(g);
    assert_int_equal(ag_node_set_arg(out, 0, AG_GA_NODES(((ag_node *[]){sum}), 1)), 0);
    int removed = ag_graph_dce(g);
    assert_int_equal(removed, 4); /* s2, s3, getitem x2 */
    assert_int_equal(count_op(g, we), 2);
    assert_int_equal(count_op(g, log), 2);
    assert_int_equal(ag_graph_verify(g), 0);
    /* The interpreter runs every one of them, in order, though nothing reads them. */
    ag_tensor *in[2] = {ag_empty(AG_F32, 1, (int64_t[]){0}),
                        tu_tensor(AG_F32, 1, (int64_t[]){4}, (double[]){1, 2, 3, 4})};
    int from = ag_zoo_log_count();
    ag_tensor *res[1];
    assert_int_equal(ag_graph_run(g, in, 2, res, 1), 1);
    assert_string_equal(log_str(from), "a a b b");
    ag_zoo_log_record r;
    assert_int_equal(ag_zoo_log_get(from, &r), 0);
    assert_true(r.sum == 10 && r.numel == 4 && !r.grad);
    ag_tensor_free(res[0]);
    ag_tensor_free(in[0]);
    ag_tensor_free(in[1]);
    ag_graph_free(g);
}

/* ---- the with_effects op ---- */

static void test_with_effects_op(void **st) {
    (void)st;
    const ag_op *log = ag_zoo_log_value_op();
    const ag_op *we = ag_op_with_effects(log);
    assert_non_null(we);
    assert_ptr_equal(ag_op_with_effects(log), we); /* made once */
    assert_string_equal(ag_op_name(we), "with_effects");
    assert_null(ag_op_find("with_effects"));
    assert_ptr_equal(ag_op_with_effects_target(we), log);
    assert_null(ag_op_with_effects_target(log));
    assert_int_equal(ag_op_nargs(we), 5);
    assert_string_equal(ag_op_arg(we, 0)->name, "token");
    assert_string_equal(ag_op_arg(we, 1)->name, "op");
    assert_string_equal(ag_op_arg(we, 2)->name, "x");
    assert_true(ag_op_def(we)->flags & AG_OP_EFFECTFUL);
    /* Only effectful ops can be wrapped. */
    assert_null(ag_op_with_effects(tu_op("relu")));
    tu_assert_error_contains("with_effects: cannot wrap relu: it is not effectful");
    assert_null(ag_op_with_effects(we));
    tu_assert_error_contains("it is a with_effects op itself");

    ag_graph *g = ag_graph_new();
    ag_node *tok = tu_ph(g, "tok", TM(AG_F32, 0));
    ag_node *bad = tu_ph(g, "bad", TM(AG_F32, 2));
    ag_node *x = tu_ph(g, "x", TM(AG_F32, 4));
    /* The token must be empty. */
    ag_garg a1[] = {AG_GA_N(bad), AG_GA_S("aotgrad_demo::log_value"), AG_GA_N(x), AG_GA_S("t")};
    assert_null(ag_graph_call(g, we, a1, 4, NULL));
    tu_assert_error_contains("the token must be an empty tensor, got f32[2]");
    /* The op argument must name the wrapped op. */
    ag_garg a2[] = {AG_GA_N(tok), AG_GA_S("relu"), AG_GA_N(x), AG_GA_S("t")};
    assert_null(ag_graph_call(g, we, a2, 4, NULL));
    tu_assert_error_contains("argument 'op' is 'relu', but this with_effects op wraps "
                             "'aotgrad_demo::log_value'");
    /* The wrapped op's own checks apply to its arguments. */
    ag_node *i64 = tu_ph(g, "i", TM(AG_I64, 4));
    ag_garg a3[] = {AG_GA_N(tok), AG_GA_S("aotgrad_demo::log_value"), AG_GA_N(i64), AG_GA_S("t")};
    assert_null(ag_graph_call(g, we, a3, 4, NULL));
    tu_assert_error_contains("aotgrad_demo::log_value: x must be f32 or f64, got i64");
    /* Eager call: the kernel logs and returns (token, copy of x). */
    ag_tensor *in[2] = {ag_empty(AG_F32, 1, (int64_t[]){0}),
                        tu_tensor(AG_F64, 1, (int64_t[]){2}, (double[]){1.5, 2})};
    ag_tensor *outs[AG_MAX_OUTPUTS] = {0};
    int from = ag_zoo_log_count();
    assert_int_equal(ag_op_call(we,
                                (ag_arg[]){AG_A_T(in[0]), AG_A_S("aotgrad_demo::log_value"),
                                           AG_A_T(in[1]), AG_A_S("eager"), AG_A_B(true)},
                                5, outs),
                     2);
    assert_string_equal(log_str(from), "eager.grad");
    assert_int_equal(ag_tensor_numel(outs[0]), 0);
    tu_assert_values(outs[1], 1, (int64_t[]){2}, (double[]){1.5, 2}, 0);
    ag_tensor_free(outs[0]);
    ag_tensor_free(outs[1]);
    ag_tensor_free(in[0]);
    ag_tensor_free(in[1]);
    /* DOT names the effect. */
    ag_garg a4[] = {AG_GA_N(tok), AG_GA_S("aotgrad_demo::log_value"), AG_GA_N(x), AG_GA_S("t")};
    ag_node *w = ag_graph_call(g, we, a4, 4, NULL);
    assert_non_null(w);
    assert_non_null(ag_graph_output(g, (ag_node *[]){ag_graph_getitem(g, w, 0, NULL)}, 1));
    char *dot = ag_graph_to_dot(g, NULL);
    assert_non_null(strstr(dot, "with_effects aotgrad_demo::log_value"));
    ag_free(dot);
    ag_graph_free(g);
}

/* ---- the text format ---- */

static void test_text_round_trip(void **st) {
    (void)st;
    model md;
    model_open(&md, "effects");
    const ag_graph *g = ag_joint_graph(md.j);
    ag_print_opts po = {.seq_nr = true};
    char *text = ag_graph_to_string(g, &po);
    assert_non_null(strstr(text, "%with_effects = with_effects(%primals_1, "
                                 "'aotgrad_demo::log_value', %addmm, 'h')  # (f32[0], f32[4, 4])"));
    assert_non_null(strstr(text, "with_effects(%tangents_token, 'aotgrad_demo::log_value', "
                                 "%tangents_1, 'y', True)"));
    ag_graph *p = ag_graph_parse(text, strlen(text));
    if (!p)
        fail_msg("parse: %s", ag_last_error());
    assert_int_equal(ag_graph_verify(p), 0);
    char *again = ag_graph_to_string(p, &po);
    assert_string_equal(again, text);
    assert_string_equal(effects_str(p), "h y y.grad h.grad");
    ag_free(again);
    ag_graph_free(p);
    ag_free(text);
    model_close(&md);

    /* Arguments by name, and errors naming the line. */
    const char *named = "graph():\n"
                        "    %t : f32[0]\n"
                        "    %x : f32[3]\n"
                        "    %w = with_effects(token=%t, op='aotgrad_demo::log_value', x=%x, "
                        "tag='n')  # (f32[0], f32[3])\n"
                        "    %g = getitem(%w, 0)  # f32[0]\n"
                        "    return (%g,)\n";
    p = ag_graph_parse(named, strlen(named));
    if (!p)
        fail_msg("parse: %s", ag_last_error());
    assert_string_equal(effects_str(p), "n");
    ag_graph_free(p);
    const struct {
        const char *line, *msg;
    } bad[] = {
        {"    %w = with_effects(%t, 'nope::op', %x, 'n')",
         "line 4:27: with_effects: unknown op 'nope::op'"},
        {"    %w = with_effects(%t, 'relu', %x)",
         "line 4:27: with_effects: cannot wrap relu: it is not effectful"},
        {"    %w = with_effects(%t, %x, 'n')", "line 4:27: expected the wrapped op's name"},
        {"    %w = with_effects('aotgrad_demo::log_value', %t)", "line 4:23: expected the token"},
        {"    %w = with_effects(%t, 'aotgrad_demo::log_value', %x, 'n')  # (f32[0], f32[4])",
         "does not match the inferred"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char text2[512];
        snprintf(text2, sizeof text2,
                 "graph():\n    %%t : f32[0]\n    %%x : f32[3]\n%s\n    return (None,)\n",
                 bad[i].line);
        assert_null(ag_graph_parse(text2, strlen(text2)));
        tu_assert_error_contains(bad[i].msg);
    }
}

/* ---- FX utilities ---- */

static void test_fx_utils_skip_tokens(void **st) {
    (void)st;
    model md;
    model_open(&md, "effects");
    const ag_graph *g = ag_joint_graph(md.j);
    ag_fx_pairs *in = ag_fx_all_input_and_grad_nodes(g);
    assert_non_null(in);
    assert_int_equal(ag_fx_pairs_count(in), 6); /* 4 params, x, the tangent: no token */
    for (int i = 0; i < ag_fx_pairs_count(in); i++) {
        ag_desc_kind k = ag_desc_kind_of(ag_fx_pairs_desc(in, i));
        assert_true(k != AG_DESC_FORWARD_TOKEN_INPUT && k != AG_DESC_BACKWARD_TOKEN_INPUT);
    }
    assert_string_equal(ag_node_name(ag_fx_pairs_first(in, 0)), "primals_2");
    ag_fx_pairs_free(in);
    ag_fx_pairs *out = ag_fx_all_output_and_tangent_nodes(g);
    assert_non_null(out);
    assert_int_equal(ag_fx_pairs_count(out), 5); /* the user output and 4 grads: no token */
    assert_string_equal(ag_node_name(ag_fx_pairs_second(out, 0)), "tangents_1");
    ag_fx_pairs_free(out);
    ag_node *params[8];
    assert_int_equal(ag_fx_param_nodes(g, params, 8), 4);
    assert_string_equal(ag_node_name(params[0]), "primals_2");
    assert_string_equal(ag_node_name(params[3]), "primals_5");
    model_close(&md);
}

/* ---- partitioning ---- */

static void check_partition(const ag_joint *j, const ag_partition_opts *po) {
    ag_graph *fw, *bw;
    if (ag_partition(ag_joint_graph(j), ag_joint_num_fw_outputs(j), po, &fw, &bw, NULL))
        fail_msg("partition (budget %g): %s", po->memory_budget, ag_last_error());
    /* Forward effects in the forward, backward ones in the backward, each exactly once and in
     * program order. */
    assert_string_equal(effects_str(fw), "h y");
    assert_string_equal(effects_str(bw), "y.grad h.grad");
    ag_node **ph;
    int nph = ag_graph_placeholders(fw, &ph);
    assert_true(nph >= 1);
    assert_string_equal(ag_node_name(ph[0]), "primals_1");
    assert_int_equal(ag_desc_kind_of(ag_node_desc(ph[0])), AG_DESC_FORWARD_TOKEN_INPUT);
    ag_node *fo = ag_graph_output_node(fw);
    assert_int_equal(ag_desc_kind_of(ag_node_output_desc(fo, 0)), AG_DESC_FORWARD_TOKEN_OUTPUT);
    assert_int_equal(ag_desc_kind_of(ag_node_output_desc(fo, 1)), AG_DESC_PLAIN_OUTPUT);
    nph = ag_graph_placeholders(bw, &ph);
    assert_string_equal(ag_node_name(ph[nph - 1]), "tangents_token");
    assert_string_equal(ag_node_name(ph[nph - 2]), "tangents_1");
    ag_node *bo = ag_graph_output_node(bw);
    int nbo = ag_node_arg(bo, 0)->n;
    assert_int_equal(nbo, 6); /* 5 grads (x's None), the token */
    assert_int_equal(ag_desc_kind_of(ag_node_output_desc(bo, nbo - 1)),
                     AG_DESC_BACKWARD_TOKEN_OUTPUT);
    /* No forward placeholder of the backward is a token: the forward token stays forward. */
    for (int i = 0; i < nph; i++)
        assert_true(!ag_node_desc(ph[i]) ||
                    ag_desc_kind_of(ag_node_desc(ph[i])) != AG_DESC_FORWARD_TOKEN_INPUT);
    assert_int_equal(ag_graph_verify(fw), 0);
    assert_int_equal(ag_graph_verify(bw), 0);
    ag_graph_free(fw);
    ag_graph_free(bw);
}

static void test_partition_sides(void **st) {
    (void)st;
    model md;
    model_open(&md, "effects");
    ag_partition_opts po = {.partitioner = AG_PARTITION_DEFAULT, .memory_budget = 1};
    check_partition(md.j, &po);
    const double budgets[] = {0, 0.1, 0.5, 1};
    for (int b = 0; b < 4; b++) {
        po = (ag_partition_opts){.partitioner = AG_PARTITION_MINCUT,
                                 .memory_budget = ag_memory_budget(budgets[b])};
        check_partition(md.j, &po);
    }
    model_close(&md);
}

/* y = log_value(w, 'w') * x with x requiring grad: x's gradient needs the logged value, and
 * recomputing it from w (a parameter, free to save) and the empty forward token would cost the
 * min-cut nothing, but would run the effect twice. It is saved instead, at every budget. */
static int recompute_bait_fwd(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out,
                              int max) {
    (void)nin;
    (void)max;
    ag_scope_begin();
    ag_tensor *lw = ag_op_call1(ag_zoo_log_value_op(),
                                (ag_arg[]){AG_A_T(ag_module_param(m, "w")), AG_A_S("w")}, 2);
    ag_tensor *y = ag_mul(lw, in[0]);
    out[0] = y ? ag_tensor_keep(y) : NULL;
    ag_scope_end();
    return out[0] ? 1 : ag_last_status();
}

static void test_effect_never_recomputed(void **st) {
    (void)st;
    ag_module *m = ag_module_new("RecomputeBait", recompute_bait_fwd, NULL, NULL);
    ag_tensor *w = ag_full(AG_F32, 1, (int64_t[]){64}, 0.5);
    ag_tensor *x = ag_full(AG_F32, 1, (int64_t[]){64}, -2);
    assert_int_equal(ag_module_register_parameter(m, "w", w), 0);
    assert_int_equal(ag_tensor_set_requires_grad(x, true), 0);
    ag_joint *j = ag_export_joint(m, &x, 1, NULL, NULL, 0, NULL);
    assert_non_null(j);
    assert_string_equal(effects_str(ag_joint_graph(j)), "w w.grad");
    const double budgets[] = {0, 0.5, 1};
    for (int p = 0; p < 2; p++)
        for (int b = 0; b < 3; b++) {
            ag_partition_opts po = {.partitioner = p ? AG_PARTITION_MINCUT : AG_PARTITION_DEFAULT,
                                    .memory_budget = ag_memory_budget(budgets[b])};
            ag_graph *fw, *bw;
            if (ag_partition(ag_joint_graph(j), ag_joint_num_fw_outputs(j), &po, &fw, &bw, NULL))
                fail_msg("partition: %s", ag_last_error());
            assert_string_equal(effects_str(fw), "w");
            assert_string_equal(effects_str(bw), "w.grad");
            ag_graph_free(fw);
            ag_graph_free(bw);
            ag_compile_opts co = {.partition = po};
            ag_compiled *c = ag_compile_joint(j, &co);
            assert_non_null(c);
            ag_scope_begin();
            int from = ag_zoo_log_count();
            ag_tensor *out[1];
            assert_int_equal(ag_compiled_call_module(c, m, &x, 1, out, 1), 1);
            assert_int_equal(ag_backward(ag_sum_all(out[0]), NULL, false), 0);
            assert_string_equal(log_str(from), "w w.grad");
            ag_scope_end();
            ag_compiled_free(c);
        }
    ag_joint_free(j);
    ag_tensor_free(w);
    ag_tensor_free(x);
    ag_module_free(m);
}

/* ---- compiled against eager ---- */

typedef struct step_log {
    int nfw, nbw; /* records made by the forward call and by the backward */
    ag_zoo_log_record r[16];
    int n;
} step_log;

/* One step of m on x: forward (eager or compiled), loss = sum(out * 0.75), backward; logs. */
static void run_step(ag_module *m, ag_compiled *c, ag_tensor *x, step_log *sl) {
    ag_scope_begin();
    int from = ag_zoo_log_count();
    ag_tensor *out[4];
    int n = c ? ag_compiled_call_module(c, m, &x, 1, out, 4) : ag_module_call(m, &x, 1, out, 4);
    if (n != 1)
        fail_msg("call: %s", ag_last_error());
    sl->nfw = ag_zoo_log_count() - from;
    assert_int_equal(ag_backward(ag_sum_all(ag_mul_scalar(out[0], 0.75)), NULL, false), 0);
    sl->nbw = ag_zoo_log_count() - from - sl->nfw;
    sl->n = sl->nfw + sl->nbw;
    assert_true(sl->n <= 16);
    for (int i = 0; i < sl->n; i++)
        assert_int_equal(ag_zoo_log_get(from + i, &sl->r[i]), 0);
    ag_scope_end();
}

static void check_compiled_log(const ag_compile_opts *co, const char *what) {
    model me, mc;
    model_open(&me, "effects");
    model_open(&mc, "effects");
    ag_compiled *c = ag_compile_joint(mc.j, co);
    if (!c)
        fail_msg("%s: compile: %s", what, ag_last_error());
    for (int step = 0; step < 2; step++) {
        step_log e, k;
        run_step(me.m, NULL, me.in[0], &e);
        run_step(mc.m, c, mc.in[0], &k);
        /* Forward effects happen during the call, backward ones during the backward. */
        assert_int_equal(e.nfw, 2);
        assert_int_equal(e.nbw, 2);
        assert_int_equal(k.nfw, 2);
        assert_int_equal(k.nbw, 2);
        const char *tags[] = {"h", "y", "y", "h"};
        for (int i = 0; i < 4; i++) {
            assert_string_equal(e.r[i].tag, tags[i]);
            assert_string_equal(k.r[i].tag, tags[i]);
            assert_int_equal(e.r[i].grad, i >= 2);
            assert_int_equal(k.r[i].grad, i >= 2);
            assert_int_equal(k.r[i].numel, e.r[i].numel);
            /* Same kernels on the same values: the same sums, to the bit. */
            if (k.r[i].sum != e.r[i].sum)
                fail_msg("%s step %d: effect %d logged sum %.17g compiled, %.17g eager", what, step,
                         i, k.r[i].sum, e.r[i].sum);
        }
        assert_true(e.r[2].sum == 0.75 * 8); /* d(sum(0.75 y))/dy over y [4, 2] */
        /* The parameters' gradients agree too (then both take an SGD step alike). */
        ag_named_tensors pe, pc;
        assert_int_equal(ag_module_named_parameters(me.m, true, &pe), 0);
        assert_int_equal(ag_module_named_parameters(mc.m, true, &pc), 0);
        for (int i = 0; i < pe.n; i++) {
            assert_true(tu_max_abs_diff(ag_tensor_grad(pe.tensors[i]),
                                        ag_tensor_grad(pc.tensors[i])) <= 1e-6);
            ag_tensor_set_grad(pe.tensors[i], NULL);
            ag_tensor_set_grad(pc.tensors[i], NULL);
        }
        ag_named_tensors_free(&pe);
        ag_named_tensors_free(&pc);
    }
    ag_compiled_free(c);
    model_close(&me);
    model_close(&mc);
}

static void test_compiled_log_matches_eager(void **st) {
    (void)st;
    ag_compile_opts co = {.partition = {.partitioner = AG_PARTITION_MINCUT, .memory_budget = 1}};
    check_compiled_log(&co, "mincut plan");
    co.interpret = true;
    check_compiled_log(&co, "mincut interpreted");
    co = (ag_compile_opts){.partition = {.partitioner = AG_PARTITION_DEFAULT, .memory_budget = 1},
                           .plan = {.checking = true}};
    check_compiled_log(&co, "default checking plan");
    co = (ag_compile_opts){
        .partition = {.partitioner = AG_PARTITION_MINCUT, .memory_budget = AG_MEMORY_BUDGET_ZERO}};
    check_compiled_log(&co, "mincut budget 0");
}

/* Without autograd (nothing requires grad) the joint is the forward alone: its token in and
 * out, its effects once per call. */
static void test_inference_effects(void **st) {
    (void)st;
    model md;
    memset(&md, 0, sizeof md);
    assert_int_equal(ag_zoo_build("effects", NULL, &md.m, md.in, 8, &md.nin), 0);
    ag_named_tensors ps;
    assert_int_equal(ag_module_named_parameters(md.m, false, &ps), 0);
    for (int i = 0; i < ps.n; i++)
        assert_int_equal(ag_tensor_set_requires_grad(ps.tensors[i], false), 0);
    ag_named_tensors_free(&ps);
    md.j = ag_export_joint(md.m, md.in, md.nin, NULL, NULL, 0, NULL);
    assert_non_null(md.j);
    assert_false(ag_joint_needs_autograd(md.j));
    assert_int_equal(ag_joint_num_forward_tokens(md.j), 1);
    assert_int_equal(ag_joint_num_backward_tokens(md.j), 0);
    assert_string_equal(tu_outputs_str(ag_joint_graph(md.j)),
                        "ForwardTokenAOTOutput(idx=0), PlainAOTOutput(idx=0)");
    assert_string_equal(effects_str(ag_joint_graph(md.j)), "h y");
    ag_compiled *c = ag_compile_joint(md.j, NULL);
    assert_non_null(c);
    ag_tensor *out[2], *ref[2];
    int from = ag_zoo_log_count();
    assert_int_equal(ag_compiled_call_module(c, md.m, md.in, md.nin, out, 2), 1);
    assert_string_equal(log_str(from), "h y");
    assert_int_equal(ag_module_call(md.m, md.in, md.nin, ref, 2), 1);
    assert_true(tu_max_abs_diff(out[0], ref[0]) == 0);
    ag_tensor_free(out[0]);
    ag_tensor_free(ref[0]);
    ag_compiled_free(c);
    model_close(&md);
}

/* The joint interpreted and run by a plan: the effects of forward and backward, once each. */
static void test_joint_runs_effects_once(void **st) {
    (void)st;
    model md;
    model_open(&md, "effects");
    const ag_graph *g = ag_joint_graph(md.j);
    ag_named_tensors ps;
    assert_int_equal(ag_module_named_parameters(md.m, false, &ps), 0);
    ag_tensor *in[8];
    int k = 0;
    in[k++] = ag_empty(AG_F32, 1, (int64_t[]){0});
    for (int i = 0; i < ps.n; i++)
        in[k++] = ag_tensor_keep(ps.tensors[i]);
    in[k++] = ag_tensor_keep(md.in[0]);
    in[k++] = ag_ones(AG_F32, 2, (int64_t[]){4, 2});
    in[k++] = ag_empty(AG_F32, 1, (int64_t[]){0});
    ag_plan *p = ag_plan_new(g, NULL);
    assert_non_null(p);
    for (int mode = 0; mode < 2; mode++) {
        int from = ag_zoo_log_count();
        ag_tensor *out[16];
        int n = mode ? ag_plan_run(p, in, k, out, 16) : ag_graph_run(g, in, k, out, 16);
        assert_int_equal(n, 8);
        assert_string_equal(log_str(from), "h y y.grad h.grad");
        assert_int_equal(ag_tensor_numel(out[0]), 0); /* the tokens out */
        assert_int_equal(ag_tensor_numel(out[7]), 0);
        for (int i = 0; i < n; i++)
            ag_tensor_free(out[i]);
    }
    ag_plan_free(p);
    for (int i = 0; i < k; i++)
        ag_tensor_free(in[i]);
    ag_named_tensors_free(&ps);
    model_close(&md);
}

/* A plain trace (no export) records the effectful op as an ordinary call, kept by DCE. */
static void test_plain_trace(void **st) {
    (void)st;
    ag_module *m;
    ag_tensor *in[8];
    int nin;
    assert_int_equal(ag_zoo_build("effects", NULL, &m, in, 8, &nin), 0);
    ag_graph *g = ag_trace_module(m, in, nin, NULL);
    assert_non_null(g);
    assert_int_equal(count_op(g, ag_zoo_log_value_op()), 2);
    assert_int_equal(count_op(g, ag_op_with_effects(ag_zoo_log_value_op())), 0);
    assert_true(ag_graph_dce(g) >= 0);
    assert_int_equal(count_op(g, ag_zoo_log_value_op()), 2);
    ag_graph_free(g);
    ag_module_free(m);
    ag_tensor_free(in[0]);
}

/* The effects model's op passes gradcheck (its backward is the identity, logged). */
static void test_gradcheck(void **st) {
    (void)st;
    ag_zoo_log_value_op();
    assert_int_equal(tu_gradcheck_op("aotgrad_demo::log_value"), 1);
}

/* ---- allocation failures ---- */

/* Export, compile and one training step of the effects model, all released. */
static int oom_scenario(void *ud) {
    (void)ud;
    ag_module *m = NULL;
    ag_tensor *in[8] = {0};
    int nin = 0;
    int rc = ag_zoo_build("effects", NULL, &m, in, 8, &nin);
    ag_joint *j = rc ? NULL : ag_export_joint(m, in, nin, NULL, NULL, 0, NULL);
    ag_compiled *c = j ? ag_compile_joint(j, NULL) : NULL;
    if (!rc && !c)
        rc = ag_last_status();
    if (!rc) {
        ag_scope_begin();
        ag_tensor *out[2];
        int n = ag_compiled_call_module(c, m, in, nin, out, 2);
        ag_tensor *loss = n == 1 ? ag_sum_all(out[0]) : NULL;
        rc = n < 0 ? n : !loss ? ag_last_status() : ag_backward(loss, NULL, false);
        tu_alloc_cleanup_begin();
        ag_scope_end();
        tu_alloc_cleanup_end();
    }
    ag_compiled_free(c);
    ag_joint_free(j);
    ag_module_free(m);
    for (int i = 0; i < nin; i++)
        ag_tensor_free(in[i]);
    return rc;
}

static void test_alloc_failures(void **st) {
    (void)st;
    ag_op_with_effects(ag_zoo_log_value_op()); /* process-wide tables made once */
    ag_zoo_log_clear();
    tu_sweep_opts o = {.what = "effects export+compile+step", .one_thread = true};
    int64_t points = tu_alloc_failure_sweep(oom_scenario, NULL, &o);
    print_message("effects scenario: %lld allocation points exercised\n", (long long)points);
    assert_true(points > 100);
}

/* ---- the CLI ---- */

static void test_cli(void **st) {
    (void)st;
    if (!tu_cli_setup("/tmp/ag_test_effects_XXXXXX"))
        skip();
    assert_int_equal(tu_cli_run("check effects"), 0);
    tu_cli_has("out", "effects: side effects: 4 logged per step, eager and compiled alike");
    tu_cli_has("out", "OK");
    assert_int_equal(tu_cli_run("check effects --budget 0 --partitioner mincut"), 0);
    tu_cli_has("out", "OK");
    assert_int_equal(tu_cli_run("export effects"), 0);
    tu_cli_has("out", "%primals_1 : f32[0]  # ForwardTokenAOTInput(idx=0)");
    tu_cli_has("out", "%tangents_token : f32[0]  # BackwardTokenAOTInput(idx=0)");
    tu_cli_has("out", "BackwardTokenAOTOutput(idx=0)]");
    assert_int_equal(tu_cli_run("descriptors effects"), 0);
    tu_cli_has("out", "ParamAOTInput(target='linear1.weight')");
    /* Tokens are not differentiable: listed apart from the input/grad and output/tangent pairs. */
    tu_cli_has("out", "non-differentiable inputs and outputs (4):");
    tu_cli_has("out", "  ForwardTokenAOTInput(idx=0)    primals_1\n");
    tu_cli_has("out", "  BackwardTokenAOTOutput(idx=0)  getitem_6\n");
    tu_cli_cleanup((const char *const[]){"out", "err"}, 2);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_joint_descriptors),
        cmocka_unit_test(test_backward_only_effect),
        cmocka_unit_test(test_dce_and_cse_keep_effects),
        cmocka_unit_test(test_with_effects_op),
        cmocka_unit_test(test_text_round_trip),
        cmocka_unit_test(test_fx_utils_skip_tokens),
        cmocka_unit_test(test_partition_sides),
        cmocka_unit_test(test_effect_never_recomputed),
        cmocka_unit_test(test_compiled_log_matches_eager),
        cmocka_unit_test(test_inference_effects),
        cmocka_unit_test(test_joint_runs_effects_once),
        cmocka_unit_test(test_plain_trace),
        cmocka_unit_test(test_gradcheck),
        cmocka_unit_test(test_alloc_failures),
        cmocka_unit_test(test_cli),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
