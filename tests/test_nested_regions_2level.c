/* Nested compile regions two levels deep (a region called inside another region's body): the
 * inner region's subgraphs are attributes of the outer region's subgraphs and its calls
 * invoke_subgraph nodes there, as upstream's nested invoke_subgraph. Checked: the exact structure
 * of a small case at every graph level, the text round trip, the exported joint against eager,
 * the same model without region markers, the interpreter and finite differences in float64,
 * tracing once per key across levels, partitioning, inlining, random ops and checkpoints inside
 * the inner region, the refusals, and allocation-failure sweeps. */
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static ag_tensor *rnd(ag_dtype dt, int ndim, const int64_t *sizes, uint64_t seed) {
    uint64_t state = seed * 0x9E3779B97F4A7C15ull + 1;
    return tu_rand_tensor(dt, ndim, sizes, -1, 1, tu_xorshift, &state);
}

/* ---- the model ----
 * inner(a, w) = sin(a) * w                       (a region)
 * outer(x, w) = inner(tanh(x), w) + x            (a region calling inner)
 * model(x, w) = inner(outer(outer(x, w), w), w) * 0.5
 * so inner is called from two calls of outer and once directly. */

static bool use_regions = true;
static int inner_calls, outer_calls; /* bodies run (eager, or traced) */

static bool inner_dropout;      /* inner's body draws: dropout(sin(a) * w, 0.5) */
static bool outer_checkpointed; /* outer's body runs under ag_checkpoint */
static bool inner_mutates;      /* inner's body adds 1 to its input in place (refused traced) */

static int inner_fn(void *ud, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)ud, (void)nin, (void)max_out;
    inner_calls++;
    ag_scope_begin();
    if (inner_mutates && !ag_add_scalar_(in[0], 1.0)) {
        ag_scope_end();
        return ag_last_status();
    }
    ag_tensor *y = ag_mul(ag_sin(in[0]), in[1]);
    if (inner_dropout)
        y = ag_dropout(y, 0.5, true);
    out[0] = ag_tensor_keep(y);
    ag_scope_end();
    return out[0] ? 1 : ag_last_status();
}

static int call(ag_region_fn fn, ag_tensor *a, ag_tensor *w, ag_tensor **out) {
    ag_tensor *in[2] = {a, w};
    return use_regions ? ag_nested_compile_region(fn, NULL, in, 2, out, 1)
                       : fn(NULL, in, 2, out, 1);
}

static int outer_body(void *ud, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)ud, (void)nin, (void)max_out;
    ag_scope_begin();
    ag_tensor *h = NULL;
    int rc = call(inner_fn, ag_tanh(in[0]), in[1], &h);
    out[0] = rc == 1 ? ag_tensor_keep(ag_add(h, in[0])) : NULL;
    ag_tensor_free(h);
    ag_scope_end();
    return out[0] ? 1 : rc < 0 ? rc : ag_last_status();
}

static int outer_fn(void *ud, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    outer_calls++;
    if (outer_checkpointed)
        return ag_checkpoint(outer_body, ud, in, nin, out, max_out);
    return outer_body(ud, in, nin, out, max_out);
}

static int model_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out,
                         int max_out) {
    (void)m, (void)nin, (void)max_out;
    ag_tensor *y1 = NULL, *y2 = NULL, *y3 = NULL;
    int rc = call(outer_fn, in[0], in[1], &y1);
    if (rc == 1)
        rc = call(outer_fn, y1, in[1], &y2);
    if (rc == 1)
        rc = call(inner_fn, y2, in[1], &y3);
    ag_scope_begin();
    out[0] = rc == 1 ? ag_tensor_keep(ag_mul_scalar(y3, 0.5)) : NULL;
    ag_scope_end();
    ag_tensor_free(y1);
    ag_tensor_free(y2);
    ag_tensor_free(y3);
    return out[0] ? 1 : rc < 0 ? rc : ag_last_status();
}

static ag_joint *export_model(ag_module *m, ag_tensor *x, ag_tensor *w, bool regions) {
    use_regions = regions;
    ag_tensor *in[2] = {x, w};
    ag_joint *j = ag_export_joint(m, in, 2, NULL, NULL, 0, NULL);
    use_regions = true;
    if (!j)
        print_error("export: %s\n", ag_last_error());
    return j;
}

/* ---- helpers ---- */

static int count_calls(const ag_graph *g, const char *ident) {
    int n = 0;
    for (ag_node *x = ag_graph_first(g); x; x = ag_node_next(x))
        if (ag_node_kind_of(x) == AG_NODE_CALL && ag_node_op(x) == ag_op_invoke_subgraph() &&
            !strcmp(ag_node_arg(x, 1)->u.s, ident))
            n++;
    return n;
}

static int count_op(const ag_graph *g, const char *op) {
    int n = 0;
    for (ag_node *x = ag_graph_first(g); x; x = ag_node_next(x))
        if (ag_node_kind_of(x) == AG_NODE_CALL && !strcmp(ag_op_name(ag_node_op(x)), op))
            n++;
    return n;
}

/* The subgraph the first call `ident` of g runs. */
static const ag_graph *callee(const ag_graph *g, const char *ident) {
    for (ag_node *x = ag_graph_first(g); x; x = ag_node_next(x))
        if (ag_node_kind_of(x) == AG_NODE_CALL && ag_node_op(x) == ag_op_invoke_subgraph() &&
            !strcmp(ag_node_arg(x, 1)->u.s, ident))
            return ag_node_subgraph(ag_node_arg_node(x, 0));
    return NULL;
}

static char *text_of(const ag_graph *g) {
    ag_print_opts po = {.no_meta = true, .no_custom = true};
    char *t = ag_graph_to_string(g, &po);
    assert_non_null(t);
    return t;
}

static void expect_text(const ag_graph *g, const char *want) {
    char *text = text_of(g);
    if (strcmp(text, want))
        print_error("printed:\n%s\nwant:\n%s\n", text, want);
    assert_string_equal(text, want);
    ag_free(text);
}

static void expect_same_text(const ag_graph *a, const ag_graph *b) {
    assert_non_null(a);
    assert_non_null(b);
    char *ta = text_of(a), *tb = text_of(b);
    assert_string_equal(ta, tb);
    ag_free(ta);
    ag_free(tb);
}

/* Prints g with all its metadata, parses it back, verifies and prints it again: identical. */
static void expect_roundtrip(const ag_graph *g) {
    ag_print_opts po = {.seq_nr = true, .stack_trace = true};
    char *full = ag_graph_to_string(g, &po);
    assert_non_null(full);
    ag_graph *back = ag_graph_parse(full, strlen(full));
    if (!back)
        print_error("parse: %s\n", ag_last_error());
    assert_non_null(back);
    assert_int_equal(ag_graph_verify(back), 0);
    char *again = ag_graph_to_string(back, &po);
    assert_string_equal(again, full);
    ag_free(again);
    ag_free(full);
    ag_graph_free(back);
}

typedef struct inputs {
    ag_tensor *x, *w, *t; /* x, w require grad; t: the output's tangent */
} inputs;

static inputs make_inputs(ag_dtype dt) {
    inputs in = {rnd(dt, 2, (int64_t[]){4, 3}, 1), rnd(dt, 2, (int64_t[]){4, 3}, 2),
                 rnd(dt, 2, (int64_t[]){4, 3}, 3)};
    assert_int_equal(ag_tensor_set_requires_grad(in.x, true), 0);
    assert_int_equal(ag_tensor_set_requires_grad(in.w, true), 0);
    return in;
}

static void free_inputs(inputs *in) {
    ag_tensor_free(in->x);
    ag_tensor_free(in->w);
    ag_tensor_free(in->t);
}

/* r[0] the output, r[1], r[2] the gradients of x and w after backward from t (new refs). */
static void take_grads(inputs *in, ag_tensor *y, ag_tensor **r) {
    assert_int_equal(ag_backward(y, in->t, false), 0);
    r[0] = y;
    r[1] = ag_tensor_keep(ag_tensor_grad(in->x));
    r[2] = ag_tensor_keep(ag_tensor_grad(in->w));
    assert_non_null(r[1]);
    assert_non_null(r[2]);
    assert_int_equal(ag_tensor_set_grad(in->x, NULL), 0);
    assert_int_equal(ag_tensor_set_grad(in->w, NULL), 0);
}

static void run_eager(ag_module *m, inputs *in, bool regions, ag_tensor **r) {
    use_regions = regions;
    ag_tensor *y = NULL;
    assert_int_equal(model_forward(m, (ag_tensor *[]){in->x, in->w}, 2, &y, 1), 1);
    use_regions = true;
    take_grads(in, y, r);
}

static void run_compiled(const ag_joint *j, const ag_compile_opts *co, inputs *in, ag_tensor **r) {
    ag_compiled *c = ag_compile_joint(j, co);
    if (!c)
        print_error("compile: %s\n", ag_last_error());
    assert_non_null(c);
    ag_tensor *y = NULL;
    assert_int_equal(ag_compiled_call(c, (ag_tensor *[]){in->x, in->w}, 2, &y, 1), 1);
    take_grads(in, y, r);
    ag_compiled_free(c);
}

/* The joint's graph run by the interpreter: the output and both gradients. */
static void run_joint_graph(const ag_graph *g, inputs *in, ag_tensor **r) {
    assert_int_equal(ag_graph_run(g, (ag_tensor *[]){in->x, in->w, in->t}, 3, r, 3), 3);
}

static double max_diff3(ag_tensor **a, ag_tensor **b) {
    double d = 0;
    for (int i = 0; i < 3; i++) {
        double e = tu_max_abs_diff(a[i], b[i]);
        d = e > d ? e : d;
    }
    return d;
}

static void free3(ag_tensor **r) {
    for (int i = 0; i < 3; i++)
        ag_tensor_free(r[i]);
}

static ag_module *model_new(void) {
    return ag_module_new("Model", model_forward, NULL, NULL);
}

/* The trace of the model (read by hand: outer's subgraph holds inner's as its own attribute;
 * inner's direct call has a copy of it in the graph). */
#define TRACE_TEXT                                                                                 \
    "graph():\n"                                                                                   \
    "    %primals_1 : f32[4, 3]  # PlainAOTInput(idx=0)\n"                                         \
    "    %primals_2 : f32[4, 3]  # PlainAOTInput(idx=1)\n"                                         \
    "    %repeated_subgraph0 = get_attr(repeated_subgraph0)  # subgraph\n"                         \
    "    %invoke_subgraph = invoke_subgraph(%repeated_subgraph0, 'fw_subgraph_0', %primals_1, "    \
    "%primals_2)  # (f32[4, 3],)\n"                                                                \
    "    %getitem = getitem(%invoke_subgraph, 0)  # f32[4, 3]\n"                                   \
    "    %repeated_subgraph0_1 = get_attr(repeated_subgraph0)  # subgraph\n"                       \
    "    %invoke_subgraph_1 = invoke_subgraph(%repeated_subgraph0_1, 'fw_subgraph_0', %getitem, "  \
    "%primals_2)  # (f32[4, 3],)\n"                                                                \
    "    %getitem_1 = getitem(%invoke_subgraph_1, 0)  # f32[4, 3]\n"                               \
    "    %repeated_subgraph1 = get_attr(repeated_subgraph1)  # subgraph\n"                         \
    "    %invoke_subgraph_2 = invoke_subgraph(%repeated_subgraph1, 'fw_subgraph_1', %getitem_1, "  \
    "%primals_2)  # (f32[4, 3],)\n"                                                                \
    "    %getitem_2 = getitem(%invoke_subgraph_2, 0)  # f32[4, 3]\n"                               \
    "    %mul = mul.Scalar(%getitem_2, 0.5)  # f32[4, 3]\n"                                        \
    "    return (%mul,)  # [PlainAOTOutput(idx=0)]\n"                                              \
    "\n"                                                                                           \
    "subgraph repeated_subgraph0():\n"                                                             \
    "    %arg0_1 : f32[4, 3]  # None\n"                                                            \
    "    %arg1_1 : f32[4, 3]  # None\n"                                                            \
    "    %tanh = tanh(%arg0_1)  # f32[4, 3]\n"                                                     \
    "    %repeated_subgraph0 = get_attr(repeated_subgraph0)  # subgraph\n"                         \
    "    %invoke_subgraph = invoke_subgraph(%repeated_subgraph0, 'fw_subgraph_1', %tanh, "         \
    "%arg1_1)  # (f32[4, 3],)\n"                                                                   \
    "    %getitem = getitem(%invoke_subgraph, 0)  # f32[4, 3]\n"                                   \
    "    %add = add.Tensor(%getitem, %arg0_1)  # f32[4, 3]\n"                                      \
    "    return (%add,)\n"                                                                         \
    "\n"                                                                                           \
    "    subgraph repeated_subgraph0():\n"                                                         \
    "        %arg0_1 : f32[4, 3]  # None\n"                                                        \
    "        %arg1_1 : f32[4, 3]  # None\n"                                                        \
    "        %sin = sin(%arg0_1)  # f32[4, 3]\n"                                                   \
    "        %mul = mul.Tensor(%sin, %arg1_1)  # f32[4, 3]\n"                                      \
    "        return (%mul,)\n"                                                                     \
    "\n"                                                                                           \
    "subgraph repeated_subgraph1():\n"                                                             \
    "    %arg0_1 : f32[4, 3]  # None\n"                                                            \
    "    %arg1_1 : f32[4, 3]  # None\n"                                                            \
    "    %sin = sin(%arg0_1)  # f32[4, 3]\n"                                                       \
    "    %mul = mul.Tensor(%sin, %arg1_1)  # f32[4, 3]\n"                                          \
    "    return (%mul,)\n"

/* Outer's joint subgraph: outer's forward with inner's forward call, then inner's backward
 * call (the seed: the tangent; the operands: tanh and w) and tanh's backward; it returns the
 * gradients of x and w, then the output. */
#define OUTER_JOINT_TEXT                                                                           \
    "graph():\n"                                                                                   \
    "    %arg0_1 : f32[4, 3]  # None\n"                                                            \
    "    %arg1_1 : f32[4, 3]  # None\n"                                                            \
    "    %arg2_1 : f32[4, 3]  # None\n"                                                            \
    "    %tanh = tanh(%arg0_1)  # f32[4, 3]\n"                                                     \
    "    %repeated_subgraph0 = get_attr(repeated_subgraph0)  # subgraph\n"                         \
    "    %invoke_subgraph = invoke_subgraph(%repeated_subgraph0, 'fw_subgraph_1', %tanh, "         \
    "%arg1_1)  # (f32[4, 3],)\n"                                                                   \
    "    %getitem = getitem(%invoke_subgraph, 0)  # f32[4, 3]\n"                                   \
    "    %add = add.Tensor(%getitem, %arg0_1)  # f32[4, 3]\n"                                      \
    "    %repeated_subgraph1 = get_attr(repeated_subgraph1)  # subgraph\n"                         \
    "    %invoke_subgraph_1 = invoke_subgraph(%repeated_subgraph1, 'bw_subgraph_1_0', %tanh, "     \
    "%arg1_1, %arg2_1)  # (f32[4, 3], f32[4, 3], f32[4, 3])\n"                                     \
    "    %getitem_1 = getitem(%invoke_subgraph_1, 0)  # f32[4, 3]\n"                               \
    "    %getitem_2 = getitem(%invoke_subgraph_1, 1)  # f32[4, 3]\n"                               \
    "    %tanh_backward = tanh_backward(%getitem_1, %tanh)  # f32[4, 3]\n"                         \
    "    %add_1 = add.Tensor(%arg2_1, %tanh_backward)  # f32[4, 3]\n"                              \
    "    return (%add_1, %getitem_2, %add)\n"                                                      \
    "\n"                                                                                           \
    "subgraph repeated_subgraph0():\n"                                                             \
    "    %arg0_1 : f32[4, 3]  # None\n"                                                            \
    "    %arg1_1 : f32[4, 3]  # None\n"                                                            \
    "    %sin = sin(%arg0_1)  # f32[4, 3]\n"                                                       \
    "    %mul = mul.Tensor(%sin, %arg1_1)  # f32[4, 3]\n"                                          \
    "    return (%mul,)\n"                                                                         \
    "\n"                                                                                           \
    "subgraph repeated_subgraph1():\n"                                                             \
    "    %arg0_1 : f32[4, 3]  # None\n"                                                            \
    "    %arg1_1 : f32[4, 3]  # None\n"                                                            \
    "    %arg2_1 : f32[4, 3]  # None\n"                                                            \
    "    %sin = sin(%arg0_1)  # f32[4, 3]\n"                                                       \
    "    %mul = mul.Tensor(%sin, %arg1_1)  # f32[4, 3]\n"                                          \
    "    %mul_1 = mul.Tensor(%arg2_1, %arg1_1)  # f32[4, 3]\n"                                     \
    "    %mul_2 = mul.Tensor(%arg2_1, %sin)  # f32[4, 3]\n"                                        \
    "    %cos = cos(%arg0_1)  # f32[4, 3]\n"                                                       \
    "    %mul_3 = mul.Tensor(%mul_1, %cos)  # f32[4, 3]\n"                                         \
    "    return (%mul_3, %mul_2, %mul)\n"

/* ---- structure ---- */

/* A trace (no joint) of the model: inner traced once, into a subgraph of outer's subgraph, and
 * again copied into the graph for its direct call; outer traced once, called twice. */
static void test_trace_structure(void **st) {
    (void)st;
    ag_module *m = model_new();
    ag_tensor *x = rnd(AG_F32, 2, (int64_t[]){4, 3}, 1), *w = rnd(AG_F32, 2, (int64_t[]){4, 3}, 2);
    inner_calls = outer_calls = 0;
    ag_graph *g = ag_trace_module(m, (ag_tensor *[]){x, w}, 2, NULL);
    if (!g)
        print_error("trace: %s\n", ag_last_error());
    assert_non_null(g);
    assert_int_equal(inner_calls, 1);
    assert_int_equal(outer_calls, 1);
    assert_int_equal(ag_graph_verify(g), 0);
    expect_text(g, TRACE_TEXT);
    expect_roundtrip(g);
    /* docs/GRAPH_FORMAT.md's nested example is outer's block of this text */
    char *doc = tu_read_file("docs/GRAPH_FORMAT.md");
    if (!doc)
        fail_msg("docs/GRAPH_FORMAT.md not found (run the test from the repository root)");
    char *sec = strstr(doc, "**Nested subgraphs**");
    char *a = sec ? strstr(sec, "  ```\n") : NULL;
    char *b = a ? strstr(a + 6, "  ```\n") : NULL;
    assert_non_null(b);
    char block[2048];
    size_t k = 0;
    for (char *l = a + 6; l < b && k + 200 < sizeof block;) { /* the lines less 2 spaces */
        char *e = strchr(l, '\n');
        size_t len = (size_t)(e - l) + 1;
        size_t cut = len > 2 && l[0] == ' ' && l[1] == ' ' ? 2 : 0;
        memcpy(block + k, l + cut, len - cut);
        k += len - cut;
        l = e + 1;
    }
    block[k] = 0;
    char *text = text_of(g);
    assert_non_null(strstr(text, block));
    ag_free(text);
    free(doc);
    ag_graph_free(g);
    ag_module_free(m);
    ag_tensor_free(x);
    ag_tensor_free(w);
}

/* The exported joint: node ops and counts at every level and the call nesting. */
static void test_joint_structure(void **st) {
    (void)st;
    ag_module *m = model_new();
    inputs in = make_inputs(AG_F32);
    inner_calls = outer_calls = 0;
    ag_joint *j = export_model(m, in.x, in.w, true);
    assert_non_null(j);
    /* each body ran twice: its forward subgraph, then its joint subgraph (inner's joint traced
     * once, inside outer's joint; its direct call and outer's forward reuse the traces) */
    assert_int_equal(inner_calls, 2);
    assert_int_equal(outer_calls, 2);
    const ag_graph *g = ag_joint_graph(j);
    assert_int_equal(ag_graph_verify(g), 0);
    /* the outer graph: outer's forward and joint, inner's forward and joint (its direct call) */
    assert_int_equal(ag_graph_num_subgraphs(g), 4);
    assert_int_equal(count_calls(g, "fw_subgraph_0"), 2);
    assert_int_equal(count_calls(g, "bw_subgraph_0_0"), 2);
    assert_int_equal(count_calls(g, "fw_subgraph_1"), 1);
    assert_int_equal(count_calls(g, "bw_subgraph_1_0"), 1);
    assert_int_equal(count_op(g, "sin") + count_op(g, "tanh") + count_op(g, "cos"), 0);
    /* outer's forward: tanh, a call of inner's forward (its own attribute), add */
    const ag_graph *ofw = callee(g, "fw_subgraph_0"), *obw = callee(g, "bw_subgraph_0_0");
    assert_non_null(ofw);
    assert_non_null(obw);
    assert_int_equal(ag_graph_num_subgraphs(ofw), 1);
    assert_int_equal(count_calls(ofw, "fw_subgraph_1"), 1);
    assert_int_equal(count_calls(ofw, "bw_subgraph_1_0"), 0);
    assert_int_equal(count_op(ofw, "tanh"), 1);
    assert_int_equal(count_op(ofw, "add.Tensor"), 1);
    assert_int_equal(count_op(ofw, "sin"), 0);
    /* outer's joint: its forward again, then inner's backward call and tanh's backward */
    assert_int_equal(ag_graph_num_subgraphs(obw), 2);
    assert_int_equal(count_calls(obw, "fw_subgraph_1"), 1);
    assert_int_equal(count_calls(obw, "bw_subgraph_1_0"), 1);
    assert_int_equal(count_op(obw, "tanh"), 1);
    assert_int_equal(count_op(obw, "tanh_backward"), 1);
    assert_int_equal(count_op(obw, "sin") + count_op(obw, "cos"), 0);
    /* inner's subgraphs: flat, and the same wherever they are called from */
    const ag_graph *ifw = callee(ofw, "fw_subgraph_1"), *ibw = callee(obw, "bw_subgraph_1_0");
    assert_int_equal(ag_graph_num_subgraphs(ifw), 0);
    assert_int_equal(ag_graph_num_subgraphs(ibw), 0);
    assert_int_equal(count_op(ifw, "sin"), 1);
    assert_int_equal(count_op(ifw, "mul.Tensor"), 1);
    assert_int_equal(count_op(ibw, "cos"), 1);
    expect_same_text(ifw, callee(obw, "fw_subgraph_1"));
    expect_same_text(ifw, callee(g, "fw_subgraph_1"));
    expect_same_text(ibw, callee(g, "bw_subgraph_1_0"));
    expect_text(obw, OUTER_JOINT_TEXT);
    expect_roundtrip(g);
    ag_joint_free(j);
    ag_module_free(m);
    free_inputs(&in);
}

/* ---- numbers ---- */

/* The joint with nested regions against eager and against the same model with no region
 * markers (exported flat), compiled by both partitioners at budgets 0 and 1 on the planned
 * executor and interpreted, and the unpartitioned joint run by the interpreter: the output and
 * both gradients bit-identical (float32) in every case. */
static void test_matches_eager_and_flat(void **st) {
    (void)st;
    ag_module *m = model_new();
    inputs in = make_inputs(AG_F32);
    ag_tensor *eager[3], *eager_flat[3], *r[3], *f[3];
    run_eager(m, &in, true, eager);
    run_eager(m, &in, false, eager_flat);
    assert_true(max_diff3(eager, eager_flat) == 0); /* eager, a region is its function */
    ag_joint *jr = export_model(m, in.x, in.w, true), *jf = export_model(m, in.x, in.w, false);
    assert_non_null(jr);
    assert_non_null(jf);
    assert_int_equal(ag_graph_num_subgraphs(ag_joint_graph(jf)), 0);
    run_joint_graph(ag_joint_graph(jr), &in, r);
    run_joint_graph(ag_joint_graph(jf), &in, f);
    /* the same kernels on the same values, in float32: bit-identical to each other and eager */
    assert_true(max_diff3(r, f) == 0);
    assert_true(max_diff3(r, eager) == 0);
    free3(r);
    free3(f);
    for (int k = 0; k < 8; k++) {
        ag_compile_opts co = {0};
        co.partition.partitioner = k % 2 ? AG_PARTITION_MINCUT : AG_PARTITION_DEFAULT;
        co.partition.memory_budget = (k / 2) % 2 ? 1.0 : AG_MEMORY_BUDGET_ZERO;
        co.interpret = k >= 4;
        run_compiled(jr, &co, &in, r);
        run_compiled(jf, &co, &in, f);
        double d_flat = max_diff3(r, f), d_eager = max_diff3(r, eager);
        if (k == 0 || d_flat != 0 || d_eager > 1e-6)
            print_message("config %d: compiled nested vs flat %g, vs eager %g\n", k, d_flat,
                          d_eager);
        assert_true(d_flat == 0);
        assert_true(d_eager == 0);
        free3(r);
        free3(f);
    }
    free3(eager);
    free3(eager_flat);
    ag_joint_free(jr);
    ag_joint_free(jf);
    ag_module_free(m);
    free_inputs(&in);
}

/* In float64 the compiled callable's gradients (through both regions' partitioned backward
 * subgraphs) agree with central finite differences. */
static int gc_fn(void *ud, ag_tensor *const *xs, int n, ag_tensor **outs, int *nouts) {
    ag_tensor *y = NULL;
    int rc = ag_compiled_call(ud, xs, n, &y, 1);
    if (rc != 1)
        return rc < 0 ? rc : AG_EINVAL;
    outs[0] = y; /* the scope's (gradcheck's), as ops' results are */
    *nouts = 1;
    return 0;
}

static void test_gradcheck_f64(void **st) {
    (void)st;
    ag_module *m = model_new();
    inputs in = make_inputs(AG_F64);
    ag_joint *j = export_model(m, in.x, in.w, true);
    assert_non_null(j);
    for (int k = 0; k < 2; k++) {
        ag_compile_opts co = {0};
        co.partition.partitioner = k ? AG_PARTITION_MINCUT : AG_PARTITION_DEFAULT;
        ag_compiled *c = ag_compile_joint(j, &co);
        assert_non_null(c);
        int rc = ag_gradcheck(gc_fn, c, (ag_tensor *[]){in.x, in.w}, 2, NULL);
        if (rc)
            print_error("gradcheck: %s\n", ag_last_error());
        assert_int_equal(rc, 0);
        ag_compiled_free(c);
    }
    ag_joint_free(j);
    ag_module_free(m);
    free_inputs(&in);
}

/* ---- partitioning, inlining, pictures ---- */

/* The partition: outer's partitioned forward calls inner's partitioned forward (its own
 * attribute), outer's partitioned backward inner's partitioned backward; inner's pair is the
 * same at both levels. */
static void test_partition_nests(void **st) {
    (void)st;
    ag_module *m = model_new();
    inputs in = make_inputs(AG_F32);
    ag_joint *j = export_model(m, in.x, in.w, true);
    assert_non_null(j);
    for (int k = 0; k < 2; k++) {
        ag_partition_opts po = {.partitioner = k ? AG_PARTITION_MINCUT : AG_PARTITION_DEFAULT};
        ag_graph *fw = NULL, *bw = NULL;
        assert_int_equal(
            ag_partition(ag_joint_graph(j), ag_joint_num_fw_outputs(j), &po, &fw, &bw, NULL), 0);
        assert_int_equal(ag_graph_verify(fw), 0);
        assert_int_equal(ag_graph_verify(bw), 0);
        assert_int_equal(count_calls(fw, "partitioned_fw_subgraph_0_0"), 2);
        assert_int_equal(count_calls(fw, "partitioned_fw_subgraph_1_0"), 1);
        assert_int_equal(count_calls(bw, "partitioned_bw_subgraph_0_0"), 2);
        assert_int_equal(count_calls(bw, "partitioned_bw_subgraph_1_0"), 1);
        const ag_graph *ofw = callee(fw, "partitioned_fw_subgraph_0_0");
        const ag_graph *obw = callee(bw, "partitioned_bw_subgraph_0_0");
        assert_int_equal(count_calls(ofw, "partitioned_fw_subgraph_1_0"), 1);
        assert_int_equal(count_calls(obw, "partitioned_bw_subgraph_1_0"), 1);
        assert_int_equal(count_op(obw, "sin") + count_op(obw, "cos"), 0);
        expect_same_text(callee(ofw, "partitioned_fw_subgraph_1_0"),
                         callee(fw, "partitioned_fw_subgraph_1_0"));
        expect_same_text(callee(obw, "partitioned_bw_subgraph_1_0"),
                         callee(bw, "partitioned_bw_subgraph_1_0"));
        expect_roundtrip(fw);
        expect_roundtrip(bw);
        ag_graph_free(fw);
        ag_graph_free(bw);
    }
    ag_joint_free(j);
    ag_module_free(m);
    free_inputs(&in);
}

static bool any_call_anywhere(const ag_graph *g) {
    for (ag_node *x = ag_graph_first(g); x; x = ag_node_next(x))
        if (ag_node_kind_of(x) == AG_NODE_CALL && ag_node_op(x) == ag_op_invoke_subgraph())
            return true;
    for (int i = 0; i < ag_graph_num_subgraphs(g); i++)
        if (any_call_anywhere(ag_graph_subgraph_at(g, i, NULL)))
            return true;
    return false;
}

/* Inlining is recursive: no subgraph and no call left, the same values; the DOT picture nests
 * inner's clusters in outer's. */
static void test_inline_and_dot(void **st) {
    (void)st;
    ag_module *m = model_new();
    inputs in = make_inputs(AG_F32);
    ag_joint *j = export_model(m, in.x, in.w, true);
    assert_non_null(j);
    ag_graph *flat = ag_graph_inline_subgraphs(ag_joint_graph(j));
    if (!flat)
        print_error("inline: %s\n", ag_last_error());
    assert_non_null(flat);
    assert_int_equal(ag_graph_verify(flat), 0);
    assert_int_equal(ag_graph_num_subgraphs(flat), 0);
    assert_false(any_call_anywhere(flat));
    /* inner's forward: its 3 calls and the 2 in outer's joint's rerun; its joint: 3 calls */
    assert_int_equal(count_op(flat, "sin"), 8);
    assert_int_equal(count_op(flat, "tanh_backward"), 2);
    ag_tensor *a[3], *b[3];
    run_joint_graph(ag_joint_graph(j), &in, a);
    run_joint_graph(flat, &in, b);
    assert_true(max_diff3(a, b) == 0);
    free3(a);
    free3(b);
    ag_graph_free(flat);
    char *dot = ag_graph_to_dot(ag_joint_graph(j), NULL);
    assert_non_null(dot);
    /* outer's forward is cluster s0, inner's forward inside it s0s0, with its dashed edge */
    assert_non_null(strstr(dot, "subgraph cluster_s0s0 {"));
    assert_non_null(strstr(dot, "subgraph cluster_s1s1 {"));
    assert_non_null(strstr(dot, "-> s0s0n0 [style=dashed, lhead=cluster_s0s0];"));
    assert_true(strstr(dot, "subgraph cluster_s0s0 {") < strstr(dot, "subgraph cluster_s1 {"));
    ag_free(dot);
    ag_joint_free(j);
    ag_module_free(m);
    free_inputs(&in);
}

/* ---- random ops and checkpoints in the inner region ---- */

/* inner draws (dropout): its subgraphs take the seed and their call's offset; outer's take them
 * too and pass inner's call its own offset, so every call of inner draws what eager's draws. The
 * compiled step is bit-identical to eager and to the flat model's. */
static void test_random_inner(void **st) {
    (void)st;
    inner_dropout = true;
    ag_module *m = model_new();
    inputs in = make_inputs(AG_F32);
    ag_joint *jr = export_model(m, in.x, in.w, true), *jf = export_model(m, in.x, in.w, false);
    assert_non_null(jr);
    assert_non_null(jf);
    const ag_graph *g = ag_joint_graph(jr);
    const ag_graph *ofw = callee(g, "fw_subgraph_0"), *ifw = callee(ofw, "fw_subgraph_1");
    assert_non_null(ag_graph_find(ofw, "philox_seed"));
    assert_non_null(ag_graph_find(ofw, "philox_base_offset"));
    assert_non_null(ag_graph_find(ifw, "philox_seed"));
    assert_int_equal(count_op(ifw, "philox_rand"), 1);
    assert_int_equal(count_op(ofw, "philox_rand"), 0);
    /* inner's call in outer passes outer's seed and offset + 0 (outer draws nothing itself) */
    const ag_node *call = NULL;
    for (ag_node *x = ag_graph_first(ofw); x && !call; x = ag_node_next(x))
        if (ag_node_kind_of(x) == AG_NODE_CALL && ag_node_op(x) == ag_op_invoke_subgraph())
            call = x;
    assert_non_null(call);
    const ag_garg *ops = ag_node_arg(call, 2);
    assert_int_equal(ops->n, 4);
    assert_string_equal(ag_node_name(ops->u.nodes[2]), "philox_seed");
    assert_string_equal(ag_op_name(ag_node_op(ops->u.nodes[3])), "add.Scalar");
    expect_roundtrip(g);
    for (int k = 0; k < 2; k++) {
        ag_compile_opts co = {0};
        co.partition.partitioner = k ? AG_PARTITION_MINCUT : AG_PARTITION_DEFAULT;
        ag_tensor *e[3], *r[3], *f[3];
        ag_manual_seed(5);
        run_eager(m, &in, true, e);
        ag_manual_seed(5);
        run_compiled(jr, &co, &in, r);
        ag_manual_seed(5);
        run_compiled(jf, &co, &in, f);
        assert_true(max_diff3(r, e) == 0);
        assert_true(max_diff3(r, f) == 0);
        /* the last call's mask dropped some of the output's elements, not all */
        int zeros = 0;
        for (int i = 0; i < 12; i++)
            zeros += ag_tensor_item_at(r[0], i) == 0;
        assert_true(zeros > 0 && zeros < 12);
        free3(e);
        free3(r);
        free3(f);
    }
    ag_joint_free(jr);
    ag_joint_free(jf);
    /* A trace that does not functionalize random ops refuses the draw, naming inner. */
    char want[96];
    snprintf(want, sizeof want, "nested_compile_region function %p", (void *)(uintptr_t)inner_fn);
    ag_graph *tg = ag_trace_module(m, (ag_tensor *[]){in.x, in.w}, 2, NULL);
    assert_null(tg);
    tu_assert_error_contains(want);
    tu_assert_error_contains("is a random op");
    inner_dropout = false;
    ag_module_free(m);
    free_inputs(&in);
}

/* outer's body checkpointed (ag_checkpoint around it): inner, called under the checkpoint, is
 * traced checkpointed; the gradients equal eager's and the flat model's. */
static void test_checkpointed_outer(void **st) {
    (void)st;
    outer_checkpointed = true;
    ag_module *m = model_new();
    inputs in = make_inputs(AG_F32);
    ag_joint *jr = export_model(m, in.x, in.w, true), *jf = export_model(m, in.x, in.w, false);
    assert_non_null(jr);
    assert_non_null(jf);
    const ag_graph *ofw = callee(ag_joint_graph(jr), "fw_subgraph_0");
    const ag_graph *ifw = callee(ofw, "fw_subgraph_1");
    assert_non_null(ifw);
    assert_int_equal(ag_node_recompute(ag_graph_find(ifw, "sin")), AG_MUST_RECOMPUTE);
    ag_tensor *e[3], *r[3], *f[3];
    run_eager(m, &in, true, e);
    for (int k = 0; k < 2; k++) {
        ag_compile_opts co = {0};
        co.partition.partitioner = k ? AG_PARTITION_MINCUT : AG_PARTITION_DEFAULT;
        run_compiled(jr, &co, &in, r);
        run_compiled(jf, &co, &in, f);
        assert_true(max_diff3(r, e) < 1e-6);
        assert_true(max_diff3(r, f) < 1e-6);
        free3(r);
        free3(f);
    }
    free3(e);
    outer_checkpointed = false;
    ag_joint_free(jr);
    ag_joint_free(jf);
    ag_module_free(m);
    free_inputs(&in);
}

/* Both: inner draws and outer is checkpointed (upstream's test_ac_rng, a level deeper): inner,
 * called under the checkpoint, is traced checkpointed, and its partition recomputes its mask in
 * its backward from the seed and offset its call passed, the forward's: the step stays
 * bit-identical to eager. */
static void test_random_in_checkpointed_outer(void **st) {
    (void)st;
    inner_dropout = outer_checkpointed = true;
    ag_module *m = model_new();
    inputs in = make_inputs(AG_F32);
    ag_joint *jr = export_model(m, in.x, in.w, true);
    assert_non_null(jr);
    for (int k = 0; k < 2; k++) {
        ag_compile_opts co = {0};
        co.partition.partitioner = k ? AG_PARTITION_MINCUT : AG_PARTITION_DEFAULT;
        ag_tensor *e[3], *r[3];
        ag_manual_seed(11);
        run_eager(m, &in, true, e);
        ag_manual_seed(11);
        run_compiled(jr, &co, &in, r);
        assert_true(max_diff3(r, e) == 0);
        free3(e);
        free3(r);
    }
    inner_dropout = outer_checkpointed = false;
    ag_joint_free(jr);
    ag_module_free(m);
    free_inputs(&in);
}

/* ---- the module form ----
 * Two blocks (each y = tanh(lin(x)) * x + x, its Linear a region of its own inside the block's
 * region), as GPT-2's blocks with a nested region would be: the same subgraphs for both blocks,
 * their parameters operands. */

static int mblock_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out,
                          int max_out) {
    (void)nin, (void)max_out;
    ag_scope_begin();
    ag_tensor *h = ag_module_forward(ag_module_child(m, "lin"), in[0]);
    out[0] = ag_tensor_keep(ag_add(ag_mul(ag_tanh(h), in[0]), in[0]));
    ag_scope_end();
    return out[0] ? 1 : ag_last_status();
}

static int mstack_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out,
                          int max_out) {
    (void)nin, (void)max_out;
    ag_scope_begin();
    ag_tensor *h = in[0];
    for (int i = 0; i < ag_module_num_children(m) && h; i++)
        h = ag_module_forward(ag_module_child_at(m, i, NULL), h);
    out[0] = h ? ag_tensor_keep(ag_mul_scalar(h, 0.5)) : NULL;
    ag_scope_end();
    return out[0] ? 1 : ag_last_status();
}

static ag_module *mstack_new(bool regions) {
    ag_manual_seed(7);
    ag_module *m = ag_module_new("Stack", mstack_forward, NULL, NULL);
    for (int i = 0; i < 2; i++) {
        ag_module *b = ag_module_new("Block", mblock_forward, NULL, NULL);
        ag_module *lin = ag_nn_linear(3, 3, true);
        assert_int_equal(ag_module_add_child(b, "lin", lin), 0);
        assert_int_equal(ag_module_set_compile_region(lin, regions), 0);
        assert_int_equal(ag_module_set_compile_region(b, regions), 0);
        char name[8];
        snprintf(name, sizeof name, "b%d", i);
        assert_int_equal(ag_module_add_child(m, name, b), 0);
    }
    return m;
}

static void test_module_form(void **st) {
    (void)st;
    ag_module *mr = mstack_new(true), *mf = mstack_new(false);
    ag_tensor *x = rnd(AG_F32, 2, (int64_t[]){4, 3}, 21),
              *t = rnd(AG_F32, 2, (int64_t[]){4, 3}, 22);
    assert_int_equal(ag_tensor_set_requires_grad(x, true), 0);
    ag_named_tensors before = {0};
    assert_int_equal(ag_module_named_parameters(mr, true, &before), 0);
    ag_joint *jr = ag_export_joint(mr, &x, 1, NULL, NULL, 0, NULL);
    if (!jr)
        print_error("export: %s\n", ag_last_error());
    assert_non_null(jr);
    ag_joint *jf = ag_export_joint(mf, &x, 1, NULL, NULL, 0, NULL);
    assert_non_null(jf);
    const ag_graph *g = ag_joint_graph(jr);
    assert_int_equal(ag_graph_verify(g), 0);
    assert_int_equal(count_calls(g, "fw_subgraph_0"), 2);
    assert_int_equal(count_calls(g, "bw_subgraph_0_0"), 2);
    assert_int_equal(count_calls(g, "fw_subgraph_1"), 0);
    const ag_graph *bfw = callee(g, "fw_subgraph_0"), *bbw = callee(g, "bw_subgraph_0_0");
    assert_int_equal(count_calls(bfw, "fw_subgraph_1"), 1);
    assert_int_equal(count_calls(bbw, "bw_subgraph_1_0"), 1);
    assert_int_equal(count_op(callee(bfw, "fw_subgraph_1"), "addmm"), 1);
    expect_roundtrip(g);
    /* the modules hold their own parameters again */
    ag_named_tensors ps = {0};
    assert_int_equal(ag_module_named_parameters(mr, true, &ps), 0);
    assert_int_equal(ps.n, 4);
    assert_int_equal(before.n, 4);
    for (int i = 0; i < ps.n; i++)
        assert_ptr_equal(ps.tensors[i], before.tensors[i]);
    ag_named_tensors_free(&ps);
    ag_named_tensors_free(&before);
    /* sharded (fsdp, rank 0 of 2), the nested joint is inlined level by level: the rank's
     * graph has what the flat model's has */
    ag_mesh mesh = {.size = 2, .rank = 0};
    int nodes[2], ops[2][3];
    for (int k = 0; k < 2; k++) {
        const ag_joint *j = k ? jr : jf;
        ag_shard_plan *plan = ag_shard_plan_fsdp(j, &mesh);
        assert_non_null(plan);
        ag_joint *sj = ag_shard_joint(j, &mesh, plan);
        if (!sj)
            print_error("shard: %s\n", ag_last_error());
        assert_non_null(sj);
        const ag_graph *sg = ag_joint_graph(sj);
        assert_int_equal(ag_graph_num_subgraphs(sg), 0);
        assert_int_equal(ag_graph_verify(sg), 0);
        nodes[k] = ag_graph_num_nodes(sg);
        ops[k][0] = count_op(sg, "addmm");
        ops[k][1] = count_op(sg, "tanh");
        ops[k][2] = count_op(sg, "_c10d_functional::all_gather_into_tensor");
        ag_joint_free(sj);
        ag_shard_plan_free(plan);
    }
    print_message("sharded: flat %d nodes (%d addmm, %d tanh, %d all_gather), nested %d (%d, %d, "
                  "%d)\n",
                  nodes[0], ops[0][0], ops[0][1], ops[0][2], nodes[1], ops[1][0], ops[1][1],
                  ops[1][2]);
    /* the same graph size and ops (the joint subgraphs' reruns of the forward are merged or
     * dropped once inlined), the same collectives */
    assert_int_equal(nodes[1], nodes[0]);
    for (int i = 0; i < 3; i++) {
        assert_true(ops[0][i] > 0);
        assert_int_equal(ops[1][i], ops[0][i]);
    }
    for (int k = 0; k < 2; k++) {
        ag_compile_opts co = {0};
        co.partition.partitioner = k ? AG_PARTITION_MINCUT : AG_PARTITION_DEFAULT;
        ag_compiled *cr = ag_compile_joint(jr, &co), *cf = ag_compile_joint(jf, &co);
        if (!cr)
            print_error("compile: %s\n", ag_last_error());
        assert_non_null(cr);
        assert_non_null(cf);
        ag_tensor *yr = NULL, *yf = NULL;
        assert_int_equal(ag_compiled_call_module(cr, mr, &x, 1, &yr, 1), 1);
        assert_int_equal(ag_backward(yr, t, false), 0);
        ag_tensor *gxr = ag_tensor_keep(ag_tensor_grad(x));
        assert_int_equal(ag_tensor_set_grad(x, NULL), 0);
        assert_int_equal(ag_compiled_call_module(cf, mf, &x, 1, &yf, 1), 1);
        assert_int_equal(ag_backward(yf, t, false), 0);
        assert_true(tu_max_abs_diff(yr, yf) == 0);
        assert_true(tu_max_abs_diff(gxr, ag_tensor_grad(x)) == 0);
        assert_int_equal(ag_tensor_set_grad(x, NULL), 0);
        ag_named_tensors pr = {0}, pf = {0};
        assert_int_equal(ag_module_named_parameters(mr, true, &pr), 0);
        assert_int_equal(ag_module_named_parameters(mf, true, &pf), 0);
        for (int i = 0; i < pr.n; i++) {
            assert_true(
                tu_max_abs_diff(ag_tensor_grad(pr.tensors[i]), ag_tensor_grad(pf.tensors[i])) == 0);
            assert_int_equal(ag_tensor_set_grad(pr.tensors[i], NULL), 0);
            assert_int_equal(ag_tensor_set_grad(pf.tensors[i], NULL), 0);
        }
        ag_named_tensors_free(&pr);
        ag_named_tensors_free(&pf);
        ag_tensor_free(gxr);
        ag_tensor_free(yr);
        ag_tensor_free(yf);
        ag_compiled_free(cr);
        ag_compiled_free(cf);
    }
    ag_joint_free(jr);
    ag_joint_free(jf);
    ag_module_free(mr);
    ag_module_free(mf);
    ag_tensor_free(x);
    ag_tensor_free(t);
}

/* ---- other orders and depths ---- */

/* inner called directly before outer: outer's subgraphs get copies of the inner subgraphs
 * traced for the graph; a third level (top calls deep, deep calls outer, outer calls inner); in
 * both, inner and outer are traced once (forward, joint) and the compiled step equals the flat
 * model's. */
static int order;
static int deep_fn(void *ud, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)ud, (void)nin, (void)max_out;
    ag_tensor *h = NULL;
    int rc = call(outer_fn, in[0], in[1], &h);
    ag_scope_begin();
    out[0] = rc == 1 ? ag_tensor_keep(ag_mul(h, h)) : NULL;
    ag_scope_end();
    ag_tensor_free(h);
    return out[0] ? 1 : rc < 0 ? rc : ag_last_status();
}

static int other_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out,
                         int max_out) {
    (void)m, (void)nin, (void)max_out;
    ag_tensor *y1 = NULL, *y2 = NULL;
    int rc = call(inner_fn, in[0], in[1], &y1); /* inner first */
    if (rc == 1)
        rc = call(order ? deep_fn : outer_fn, y1, in[1], &y2);
    ag_scope_begin();
    out[0] = rc == 1 ? ag_tensor_keep(ag_sum_all(y2)) : NULL;
    ag_scope_end();
    ag_tensor_free(y1);
    ag_tensor_free(y2);
    return out[0] ? 1 : rc < 0 ? rc : ag_last_status();
}

static void test_other_orders(void **st) {
    (void)st;
    ag_module *m = ag_module_new("Other", other_forward, NULL, NULL);
    inputs in = make_inputs(AG_F32);
    ag_tensor_free(in.t);
    in.t = ag_ones(AG_F32, 0, NULL);
    for (order = 0; order < 2; order++) {
        inner_calls = outer_calls = 0;
        ag_joint *jr = export_model(m, in.x, in.w, true);
        assert_non_null(jr);
        assert_int_equal(inner_calls, 2);
        assert_int_equal(outer_calls, 2);
        ag_joint *jf = export_model(m, in.x, in.w, false);
        assert_non_null(jf);
        const ag_graph *g = ag_joint_graph(jr);
        assert_int_equal(ag_graph_verify(g), 0);
        /* numbered as first traced: inner 0, then outer 1 (or deep 1, outer 2) */
        const ag_graph *ofw = callee(g, "fw_subgraph_1");
        assert_non_null(ofw);
        if (order) { /* deep -> outer -> inner */
            assert_int_equal(count_calls(ofw, "fw_subgraph_2"), 1);
            ofw = callee(ofw, "fw_subgraph_2");
            assert_non_null(ofw);
            assert_int_equal(count_calls(callee(g, "bw_subgraph_1_0"), "bw_subgraph_2_0"), 1);
            assert_int_equal(count_calls(callee(callee(g, "bw_subgraph_1_0"), "bw_subgraph_2_0"),
                                         "bw_subgraph_0_0"),
                             1);
        }
        expect_same_text(callee(ofw, "fw_subgraph_0"), callee(g, "fw_subgraph_0"));
        expect_roundtrip(g);
        /* the saved joint keeps the nesting */
        char *text = NULL;
        size_t len = 0;
        assert_int_equal(ag_joint_save(jr, &text, &len), 0);
        ag_joint *back = ag_joint_load(text, len);
        if (!back)
            print_error("load: %s\n", ag_last_error());
        assert_non_null(back);
        expect_same_text(ag_joint_graph(back), g);
        ag_joint_free(back);
        ag_free(text);
        ag_tensor *r[3], *f[3];
        run_compiled(jr, NULL, &in, r);
        run_compiled(jf, NULL, &in, f);
        assert_true(max_diff3(r, f) == 0);
        free3(r);
        free3(f);
        ag_joint_free(jr);
        ag_joint_free(jf);
    }
    ag_module_free(m);
    free_inputs(&in);
}

/* A trace that is not the joint export but differentiates itself (ag_grad in the traced
 * function): outer's joint, and inner's inside it, are traced when the backward first runs;
 * the graph's gradient equals eager's. */
static int grad_fn(void *ud, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)ud, (void)nin, (void)max_out;
    ag_tensor *y = NULL;
    int rc = call(outer_fn, in[0], in[1], &y);
    if (rc != 1)
        return rc;
    ag_scope_begin();
    ag_tensor *l = ag_sum_all(y), *g[2] = {0};
    rc = l ? ag_grad(&l, NULL, 1, in, 2, g, false, false) : ag_last_status();
    out[0] = rc == 0 ? ag_tensor_keep(ag_add(g[0], g[1])) : NULL;
    ag_scope_end();
    ag_tensor_free(y);
    return out[0] ? 1 : rc < 0 ? rc : ag_last_status();
}

/* ag_trace's functions return their outputs owned by its scope */
static int grad_fn_traced(void *ud, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    ag_tensor *kept = NULL;
    int rc = grad_fn(ud, in, nin, &kept, max_out);
    if (rc != 1)
        return rc;
    out[0] = ag_mul_scalar(kept, 1.0);
    ag_tensor_free(kept);
    return out[0] ? 1 : ag_last_status();
}

static void test_backward_in_trace(void **st) {
    (void)st;
    inputs in = make_inputs(AG_F32);
    ag_tensor *want = NULL;
    assert_int_equal(grad_fn(NULL, (ag_tensor *[]){in.x, in.w}, 2, &want, 1), 1);
    inner_calls = outer_calls = 0;
    ag_graph *g = ag_trace(grad_fn_traced, NULL, (ag_tensor *[]){in.x, in.w}, 2, NULL, NULL, NULL);
    if (!g)
        print_error("trace: %s\n", ag_last_error());
    assert_non_null(g);
    assert_int_equal(inner_calls, 2);
    assert_int_equal(outer_calls, 2);
    assert_int_equal(ag_graph_verify(g), 0);
    assert_int_equal(count_calls(g, "bw_subgraph_0_0"), 1);
    assert_int_equal(count_calls(callee(g, "bw_subgraph_0_0"), "bw_subgraph_1_0"), 1);
    ag_tensor *got = NULL;
    assert_int_equal(ag_graph_run(g, (ag_tensor *[]){in.x, in.w}, 2, &got, 1), 1);
    assert_true(tu_max_abs_diff(got, want) < 1e-6);
    ag_tensor_free(got);
    ag_tensor_free(want);
    ag_graph_free(g);
    free_inputs(&in);
}

/* ---- the text by hand ----
 * A nested subgraph with a constant of its own, named as its parent's: each block reads its
 * own. out = x * [3, -1] + [1, 2]. */
static const char *nested_consts =
    "graph():\n"
    "    %x : f32[2]  # None\n"
    "    %a = get_attr(a)  # subgraph\n"
    "    %invoke_subgraph = invoke_subgraph(%a, 'fw_subgraph_0', %x)  # (f32[2],)\n"
    "    %getitem = getitem(%invoke_subgraph, 0)  # f32[2]\n"
    "    return (%getitem,)\n"
    "\n"
    "subgraph a():\n"
    "    %y : f32[2]  # None\n"
    "    %b = get_attr(b)  # subgraph\n"
    "    %invoke_subgraph = invoke_subgraph(%b, 'fw_subgraph_1', %y)  # (f32[2],)\n"
    "    %getitem = getitem(%invoke_subgraph, 0)  # f32[2]\n"
    "    %_tensor_constant0 = get_attr(_tensor_constant0)  # f32[2]\n"
    "    %add = add.Tensor(%getitem, %_tensor_constant0)  # f32[2]\n"
    "    return (%add,)\n"
    "\n"
    "constant _tensor_constant0 : f32[2] = [1.0, 2.0]\n"
    "\n"
    "    subgraph b():\n"
    "        %z : f32[2]  # None\n"
    "        %_tensor_constant0 = get_attr(_tensor_constant0)  # f32[2]\n"
    "        %mul = mul.Tensor(%z, %_tensor_constant0)  # f32[2]\n"
    "        return (%mul,)\n"
    "\n"
    "    constant _tensor_constant0 : f32[2] = [3.0, -1.0]\n";

static void test_text_nested_constants(void **st) {
    (void)st;
    ag_graph *g = ag_graph_parse(nested_consts, strlen(nested_consts));
    if (!g)
        print_error("parse: %s\n", ag_last_error());
    assert_non_null(g);
    assert_int_equal(ag_graph_verify(g), 0);
    char *t = ag_graph_to_string(g, NULL);
    assert_string_equal(t, nested_consts);
    ag_free(t);
    double xv[2] = {0.5, 4.0}, want[2] = {0.5 * 3 + 1, 4.0 * -1 + 2};
    ag_tensor *x = tu_tensor(AG_F32, 1, (int64_t[]){2}, xv), *out = NULL;
    assert_int_equal(ag_graph_run(g, &x, 1, &out, 1), 1);
    tu_assert_values(out, 1, (int64_t[]){2}, want, 0);
    ag_tensor_free(out);
    ag_tensor_free(x);
    ag_graph_free(g);
    /* an error in the nested block: its line and column in the whole text */
    char *bad = strdup(nested_consts);
    char *at = strstr(bad, "mul.Tensor(%z, %_tensor_constant0)");
    assert_non_null(at);
    memcpy(at + 15, "%nope)             ", 19); /* as long as what it replaces, no NUL */
    assert_null(ag_graph_parse(bad, strlen(bad)));
    tu_assert_error_contains("line 22:31: unknown node %nope");
    free(bad);
}

/* ---- refusals ---- */

static int self_depth;
static int self_region(void *ud, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    if (++self_depth > 40) { /* eager ends the recursion; a trace never gets this deep */
        self_depth--;
        out[0] = ag_tensor_keep(in[0]);
        return 1;
    }
    int rc = ag_nested_compile_region(self_region, ud, in, nin, out, max_out);
    self_depth--;
    return rc;
}

static int self_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)m;
    return ag_nested_compile_region(self_region, NULL, in, nin, out, max_out);
}

static void test_refusals(void **st) {
    (void)st;
    /* inner mutating its operand, refused inside outer's body with inner's name */
    {
        ag_module *mm = model_new();
        inputs in = make_inputs(AG_F32);
        inner_mutates = true;
        char want[96];
        snprintf(want, sizeof want,
                 "nested_compile_region function %p: ", (void *)(uintptr_t)inner_fn);
        use_regions = true;
        assert_null(ag_export_joint(mm, (ag_tensor *[]){in.x, in.w}, 2, NULL, NULL, 0, NULL));
        tu_assert_error_contains(want);
        tu_assert_error_contains("mutates");
        inner_mutates = false;
        /* the same model then exports (nothing of the failed trace left behind) */
        ag_joint *j = export_model(mm, in.x, in.w, true);
        assert_non_null(j);
        ag_joint_free(j);
        ag_module_free(mm);
        free_inputs(&in);
    }
    /* a region calling itself */
    ag_module *m = ag_module_new("Self", self_forward, NULL, NULL);
    ag_tensor *x = rnd(AG_F32, 1, (int64_t[]){3}, 9);
    self_depth = 0;
    assert_null(ag_trace_module(m, &x, 1, NULL));
    tu_assert_error_contains("regions nested more than 16 deep");
    assert_int_equal(self_depth, 0);
    ag_module_free(m);
    ag_tensor_free(x);
    /* the text: a nested block line not indented, subgraphs nested too deep */
    const char *bad = "graph():\n"
                      "    %x : f32[2]  # None\n"
                      "    return (%x,)\n"
                      "\n"
                      "subgraph a():\n"
                      "    %y : f32[2]  # None\n"
                      "    return (%y,)\n"
                      "\n"
                      "    subgraph b():\n"
                      "    %z : f32[2]  # None\n"
                      "  return (%z,)\n";
    assert_null(ag_graph_parse(bad, strlen(bad)));
    tu_assert_error_contains("line 11:1: expected a line of a nested subgraph block");
    const char *no_return = "graph():\n"
                            "    return ()\n"
                            "\n"
                            "subgraph a():\n"
                            "    %x : f32[2]  # None\n"
                            "\n"
                            "    subgraph b():\n"
                            "        return ()\n";
    assert_null(ag_graph_parse(no_return, strlen(no_return)));
    tu_assert_error_contains("line 6:1: expected 'return', got the next subgraph block");
    /* 16 levels of subgraphs parse; 17 do not */
    for (int levels = 16; levels <= 17; levels++) {
        char deep[8192];
        size_t k = (size_t)snprintf(deep, sizeof deep, "graph():\n    return ()\n");
        for (int d = 0; d < levels; d++) {
            char ind[80] = "";
            for (int i = 0; i < d; i++)
                strcat(ind, "    ");
            k += (size_t)snprintf(deep + k, sizeof deep - k,
                                  "\n%ssubgraph s%d():\n%s    return ()\n", ind, d, ind);
        }
        ag_graph *dg = ag_graph_parse(deep, k);
        if (levels == 16) {
            if (!dg)
                print_error("parse: %s\n", ag_last_error());
            assert_non_null(dg);
            char *back = ag_graph_to_string(dg, NULL);
            assert_string_equal(back, deep);
            ag_free(back);
            /* the graph API refuses a 17th level */
            ag_graph *lowest = dg;
            for (int d = 0; d < 16; d++)
                lowest = ag_graph_subgraph_at(lowest, 0, NULL);
            ag_graph *leaf = ag_graph_parse("graph():\n    return ()\n", 23);
            assert_non_null(leaf);
            assert_int_equal(ag_graph_add_subgraph(lowest, "s16", leaf), AG_EINVAL);
            tu_assert_error_contains("'s16': subgraphs would nest too deeply");
            ag_graph_free(leaf);
            ag_graph_free(dg);
        } else {
            assert_null(dg);
            tu_assert_error_contains("subgraphs nested more than 16 deep");
        }
    }
    /* the graph API: cycles */
    const char *two = "graph():\n"
                      "    %x : f32[2]  # None\n"
                      "    return (%x,)\n"
                      "\n"
                      "subgraph a():\n"
                      "    %y : f32[2]  # None\n"
                      "    return (%y,)\n"
                      "\n"
                      "    subgraph b():\n"
                      "        %z : f32[2]  # None\n"
                      "        return (%z,)\n";
    ag_graph *g = ag_graph_parse(two, strlen(two));
    if (!g)
        print_error("parse: %s\n", ag_last_error());
    assert_non_null(g);
    ag_graph *a = ag_graph_subgraph(g, "a"), *b = ag_graph_subgraph(a, "b");
    assert_non_null(b);
    assert_int_equal(ag_graph_add_subgraph(b, "up", g), AG_EINVAL);
    tu_assert_error_contains("graph_add_subgraph: 'up': the subgraph is the graph's own ancestor");
    char *t = ag_graph_to_string(g, NULL);
    assert_string_equal(t, two);
    ag_free(t);
    ag_graph_free(g);
}

/* ---- allocation failures ---- */

static int oom_export(void *ud) {
    ag_module *m = ud;
    ag_tensor *x = ag_randn(AG_F32, 2, (int64_t[]){4, 3}),
              *w = ag_randn(AG_F32, 2, (int64_t[]){4, 3});
    int rc = x && w ? ag_tensor_set_requires_grad(x, true) : ag_last_status();
    if (rc == 0)
        rc = ag_tensor_set_requires_grad(w, true);
    ag_joint *j = rc ? NULL : ag_export_joint(m, (ag_tensor *[]){x, w}, 2, NULL, NULL, 0, NULL);
    if (!rc && !j)
        rc = ag_last_status();
    ag_joint_free(j);
    ag_tensor_free(x);
    ag_tensor_free(w);
    return rc;
}

static int oom_partition(void *ud) {
    const ag_joint *j = ud;
    ag_graph *fw = NULL, *bw = NULL;
    int rc = ag_partition(ag_joint_graph(j), ag_joint_num_fw_outputs(j), NULL, &fw, &bw, NULL);
    ag_graph_free(fw);
    ag_graph_free(bw);
    return rc;
}

static int oom_text(void *ud) {
    const char *text = ud;
    ag_graph *g = ag_graph_parse(text, strlen(text));
    char *again = g ? ag_graph_to_string(g, NULL) : NULL;
    ag_graph *flat = again ? ag_graph_inline_subgraphs(g) : NULL;
    int rc = flat ? 0 : ag_last_status();
    ag_graph_free(flat);
    ag_free(again);
    ag_graph_free(g);
    return rc;
}

static void test_out_of_memory(void **st) {
    (void)st;
    ag_module *m = model_new();
    tu_sweep_opts o = {.what = "nested regions export", .one_thread = true};
    assert_true(tu_alloc_failure_sweep(oom_export, m, &o) > 10);
    o.persistent = true;
    assert_true(tu_alloc_failure_sweep(oom_export, m, &o) > 10);
    inputs in = make_inputs(AG_F32);
    ag_joint *j = export_model(m, in.x, in.w, true);
    assert_non_null(j);
    o = (tu_sweep_opts){.what = "partition of nested regions", .one_thread = true};
    assert_true(tu_alloc_failure_sweep(oom_partition, j, &o) > 10);
    o.persistent = true;
    assert_true(tu_alloc_failure_sweep(oom_partition, j, &o) > 10);
    char *text = ag_graph_to_string(ag_joint_graph(j), NULL);
    assert_non_null(text);
    o = (tu_sweep_opts){.what = "parse, print and inline nested regions", .one_thread = true};
    assert_true(tu_alloc_failure_sweep(oom_text, text, &o) > 10);
    ag_free(text);
    ag_joint_free(j);
    free_inputs(&in);
    ag_module_free(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_trace_structure),
        cmocka_unit_test(test_joint_structure),
        cmocka_unit_test(test_matches_eager_and_flat),
        cmocka_unit_test(test_gradcheck_f64),
        cmocka_unit_test(test_partition_nests),
        cmocka_unit_test(test_inline_and_dot),
        cmocka_unit_test(test_random_inner),
        cmocka_unit_test(test_checkpointed_outer),
        cmocka_unit_test(test_random_in_checkpointed_outer),
        cmocka_unit_test(test_module_form),
        cmocka_unit_test(test_other_orders),
        cmocka_unit_test(test_backward_in_trace),
        cmocka_unit_test(test_text_nested_constants),
        cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_out_of_memory),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
