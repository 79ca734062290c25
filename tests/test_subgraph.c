/* Subgraphs in the graph IR (src/graph/subgraph.c and the graph layer's handling of them):
 * graph attributes, get_attr of a subgraph, the higher-order op invoke_subgraph.
 *
 * Covered: a graph calling one subgraph twice (upstream test 23's repeated_subgraph0: sin,
 * then mul by 1) printed byte for byte against hand-written text, parsed back identically and
 * verified; run by the interpreter against the computation by hand in double and against the
 * same graph written flat (same bits); the docs/GRAPH_FORMAT.md example and a hand-written
 * graph with two subgraphs (fuzz/corpus/subgraph_multi.txt), parsed, printed back and run; a
 * subgraph without operands; copies (independent subgraphs); DCE and CSE (pure, in-place and
 * random subgraphs); DOT clusters and SVG; errors of the API, the verifier and the parser,
 * each with its message; allocation failures while building, copying, printing, parsing,
 * verifying, drawing, running and freeing. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "testutil.h"

static ag_tmeta meta_of(ag_dtype dt, int nd, const int64_t *sizes) {
    ag_tmeta m;
    memset(&m, 0, sizeof m);
    m.dtype = dt;
    m.ndim = nd;
    int64_t st = 1;
    for (int i = nd - 1; i >= 0; i--) {
        m.sizes[i] = sizes[i];
        m.strides[i] = st;
        st *= sizes[i] > 1 ? sizes[i] : 1;
    }
    return m;
}

static const int64_t S43[] = {4, 3};

/* The subgraph sin(a) * 1 of f32[4, 3] (NULL when out of memory). */
static ag_graph *make_sin_mul(void) {
    ag_graph *s = ag_graph_new();
    if (!s)
        return NULL;
    ag_tmeta m = meta_of(AG_F32, 2, S43);
    ag_node *a = ag_graph_placeholder(s, "arg0_1", &m);
    ag_node *sn = a ? ag_graph_call(s, ag_op_find("sin"), (ag_garg[]){AG_GA_N(a)}, 1, NULL) : NULL;
    ag_node *mu = sn ? ag_graph_call(s, ag_op_find("mul.Scalar"),
                                     (ag_garg[]){AG_GA_N(sn), AG_GA_I(1)}, 2, NULL)
                     : NULL;
    if (!mu || !ag_graph_output(s, &mu, 1)) {
        ag_graph_free(s);
        return NULL;
    }
    return s;
}

/* x -> invoke(x) -> invoke(getitem) -> sub(getitem_1, 1): NULL when out of memory. */
static ag_graph *make_outer(void) {
    ag_graph *g = ag_graph_new();
    ag_graph *s = make_sin_mul();
    if (!g || !s || ag_graph_add_subgraph(g, "repeated_subgraph0", s)) {
        ag_graph_free(s);
        ag_graph_free(g);
        return NULL;
    }
    ag_tmeta m = meta_of(AG_F32, 2, S43);
    ag_node *x = ag_graph_placeholder(g, "x", &m);
    ag_node *at = x ? ag_graph_get_attr_subgraph(g, "repeated_subgraph0", NULL) : NULL;
    ag_node *i0 = at ? ag_graph_invoke_subgraph(g, at, "subgraph_0", &x, 1, NULL) : NULL;
    ag_node *g0 = i0 ? ag_graph_getitem(g, i0, 0, NULL) : NULL;
    ag_node *i1 = g0 ? ag_graph_invoke_subgraph(g, at, "subgraph_0", &g0, 1, NULL) : NULL;
    ag_node *g1 = i1 ? ag_graph_getitem(g, i1, 0, NULL) : NULL;
    ag_node *sb = g1 ? ag_graph_call(g, ag_op_find("sub.Scalar"),
                                     (ag_garg[]){AG_GA_N(g1), AG_GA_I(1)}, 2, NULL)
                     : NULL;
    if (!sb || !ag_graph_output(g, &sb, 1)) {
        ag_graph_free(g);
        return NULL;
    }
    return g;
}

/* Written by hand from docs/GRAPH_FORMAT.md. */
static const char expected[] =
    "graph():\n"
    "    %x : f32[4, 3]  # None\n"
    "    %repeated_subgraph0 = get_attr(repeated_subgraph0)  # subgraph\n"
    "    %invoke_subgraph = invoke_subgraph(%repeated_subgraph0, 'subgraph_0', %x)  "
    "# (f32[4, 3],)\n"
    "    %getitem = getitem(%invoke_subgraph, 0)  # f32[4, 3]\n"
    "    %invoke_subgraph_1 = invoke_subgraph(%repeated_subgraph0, 'subgraph_0', %getitem)  "
    "# (f32[4, 3],)\n"
    "    %getitem_1 = getitem(%invoke_subgraph_1, 0)  # f32[4, 3]\n"
    "    %sub = sub.Scalar(%getitem_1, 1)  # f32[4, 3]\n"
    "    return (%sub,)\n"
    "\n"
    "subgraph repeated_subgraph0():\n"
    "    %arg0_1 : f32[4, 3]  # None\n"
    "    %sin = sin(%arg0_1)  # f32[4, 3]\n"
    "    %mul = mul.Scalar(%sin, 1)  # f32[4, 3]\n"
    "    return (%mul,)\n";

static void expect_null(void *p, const char *msg) {
    if (p)
        fail_msg("expected a failure with '%s'", msg);
    tu_assert_error_contains(msg);
}

static char *roundtrip(const char *text) {
    ag_graph *g = ag_graph_parse(text, strlen(text));
    if (!g)
        fail_msg("parse: %s", ag_last_error());
    if (ag_graph_verify(g))
        fail_msg("verify: %s", ag_last_error());
    char *s = ag_graph_to_string(g, NULL);
    assert_non_null(s);
    ag_graph_free(g);
    return s;
}

static void test_print_parse_verify(void **state) {
    (void)state;
    ag_graph *g = make_outer();
    assert_non_null(g);
    assert_int_equal(ag_graph_verify(g), 0);
    char *s = ag_graph_to_string(g, NULL);
    assert_string_equal(s, expected);
    char *s2 = roundtrip(s);
    assert_string_equal(s2, expected);
    ag_free(s);
    ag_free(s2);

    /* The API's view of it. */
    assert_int_equal(ag_graph_num_subgraphs(g), 1);
    const char *name = NULL;
    ag_graph *sub = ag_graph_subgraph_at(g, 0, &name);
    assert_string_equal(name, "repeated_subgraph0");
    assert_ptr_equal(ag_graph_subgraph(g, "repeated_subgraph0"), sub);
    assert_null(ag_graph_subgraph(g, "nope"));
    assert_null(ag_graph_subgraph_at(g, 1, &name));
    assert_null(name);
    ag_node *at = ag_graph_find(g, "repeated_subgraph0");
    assert_int_equal(ag_node_kind_of(at), AG_NODE_GET_ATTR);
    assert_ptr_equal(ag_node_subgraph(at), sub);
    assert_null(ag_node_constant(at));
    assert_int_equal(ag_node_num_vals(at), 0);
    ag_node *inv = ag_graph_find(g, "invoke_subgraph");
    assert_ptr_equal(ag_node_op(inv), ag_op_invoke_subgraph());
    assert_true(ag_op_def(ag_node_op(inv))->flags & AG_OP_SUBGRAPH);
    assert_null(ag_op_find("invoke_subgraph")); /* kept out of the registry */
    assert_int_equal(ag_node_num_vals(inv), 1);
    /* A second get_attr of the same attribute is named as FX names it. */
    ag_node *at2 = ag_graph_get_attr_subgraph(g, "repeated_subgraph0", NULL);
    assert_string_equal(ag_node_name(at2), "repeated_subgraph0_1");
    assert_int_equal(ag_graph_erase(g, at2), 0);
    ag_graph_free(g);
}

/* The example of docs/GRAPH_FORMAT.md's "Subgraphs" section parses, verifies, runs, and prints
 * back as written. */
static void test_doc_example(void **state) {
    (void)state;
    FILE *f = fopen("docs/GRAPH_FORMAT.md", "rb");
    if (!f)
        fail_msg("docs/GRAPH_FORMAT.md not found (run the test from the repository root)");
    char *buf = calloc(1, 1 << 16);
    size_t n = fread(buf, 1, (1 << 16) - 1, f);
    fclose(f);
    buf[n] = 0;
    char *sec = strstr(buf, "\n## Subgraphs");
    assert_non_null(sec);
    char *a = strstr(sec, "```\n");
    assert_non_null(a);
    a += 4;
    char *b = strstr(a, "```\n");
    assert_non_null(b);
    *b = 0;
    char *s = roundtrip(a);
    assert_string_equal(s, a);
    ag_free(s);
    /* It computes sin(sin(x) * 1) * 1 - 1. */
    ag_graph *g = ag_graph_parse(a, strlen(a));
    assert_non_null(g);
    double xv[12], want[12];
    for (int i = 0; i < 12; i++) {
        xv[i] = 2.0 - 0.33 * i;
        want[i] = sin(sin((double)(float)xv[i])) - 1.0;
    }
    ag_tensor *x = tu_tensor(AG_F32, 2, S43, xv), *out = NULL;
    if (ag_graph_run(g, &x, 1, &out, 1) != 1)
        fail_msg("run: %s", ag_last_error());
    tu_assert_values(out, 2, S43, want, 1e-6);
    ag_tensor_free(out);
    ag_tensor_free(x);
    ag_graph_free(g);
    free(buf);
}

/* Two subgraphs, one with two outputs, its own constant and operands of two shapes; metadata
 * and a stack trace on the outer nodes (fuzz/corpus/subgraph_multi.txt, read from there).
 * Round trip under every printing option, then a run against the computation by hand:
 * out0 = relu(x * y + c) + cos(x), out1 = x * y + c. */
static void test_multi(void **state) {
    (void)state;
    char *text = tu_read_file("fuzz/corpus/subgraph_multi.txt");
    if (!text)
        fail_msg("fuzz/corpus/subgraph_multi.txt not found (run from the repository root)");
    ag_graph *g = ag_graph_parse(text, strlen(text));
    if (!g)
        fail_msg("parse: %s", ag_last_error());
    assert_int_equal(ag_graph_verify(g), 0);
    ag_print_opts o = {.seq_nr = true, .stack_trace = true};
    char *s = ag_graph_to_string(g, &o);
    assert_string_equal(s, text);
    ag_free(s);
    assert_int_equal(ag_graph_num_subgraphs(g), 2);
    ag_mval v = ag_node_custom_get(ag_graph_find(g, "invoke_subgraph"), "call_id");
    assert_int_equal(v.kind, AG_MV_INT);
    assert_int_equal(v.u.i, 1);
    double xv[6] = {-1.0, 0.5, 2.0, -0.25, 1.5, -3.0}, yv[3] = {2.0, -1.0, 0.5};
    const double c[3] = {1.0, 2.0, 0.5};
    ag_tensor *in[2] = {tu_tensor(AG_F32, 2, (int64_t[]){2, 3}, xv),
                        tu_tensor(AG_F32, 1, (int64_t[]){3}, yv)};
    ag_tensor *out[2] = {0};
    if (ag_graph_run(g, in, 2, out, 2) != 2)
        fail_msg("run: %s", ag_last_error());
    double w0[6], w1[6];
    for (int i = 0; i < 6; i++) {
        w1[i] = xv[i] * yv[i % 3] + c[i % 3];
        w0[i] = (w1[i] > 0 ? w1[i] : 0) + cos(xv[i]);
    }
    tu_assert_values(out[0], 2, (int64_t[]){2, 3}, w0, 1e-6);
    tu_assert_values(out[1], 2, (int64_t[]){2, 3}, w1, 1e-6);
    for (int i = 0; i < 2; i++) {
        ag_tensor_free(out[i]);
        ag_tensor_free(in[i]);
    }
    ag_graph_free(g);
    free(text);
}

/* A subgraph without inputs (a constant made by a factory op) is called with no operands; a
 * call of it with one operand is refused. */
static void test_no_operands(void **state) {
    (void)state;
    const char *text = "graph():\n"
                       "    %x : f32[2]  # None\n"
                       "    %k = get_attr(k)  # subgraph\n"
                       "    %invoke_subgraph = invoke_subgraph(%k, 'c')  # (f32[2],)\n"
                       "    %getitem = getitem(%invoke_subgraph, 0)  # f32[2]\n"
                       "    %add = add.Tensor(%x, %getitem)  # f32[2]\n"
                       "    return (%add,)\n"
                       "\n"
                       "subgraph k():\n"
                       "    %_tensor_constant0 = get_attr(_tensor_constant0)  # f32[2]\n"
                       "    return (%_tensor_constant0,)\n"
                       "\n"
                       "constant _tensor_constant0 : f32[2] = [0.5, -2.0]\n";
    char *s = roundtrip(text);
    assert_string_equal(s, text);
    ag_free(s);
    ag_graph *g = ag_graph_parse(text, strlen(text));
    assert_non_null(g);
    ag_tensor *x = tu_tensor(AG_F32, 1, (int64_t[]){2}, (double[]){1.0, 3.0});
    ag_tensor *out = NULL;
    assert_int_equal(ag_graph_run(g, &x, 1, &out, 1), 1);
    tu_assert_values(out, 1, (int64_t[]){2}, (double[]){1.5, 1.0}, 0);
    ag_tensor_free(out);
    ag_node *xn = ag_graph_find(g, "x");
    expect_null(ag_graph_invoke_subgraph(g, ag_graph_find(g, "k"), "c", &xn, 1, NULL),
                "invoke_subgraph: 1 operand(s) for the 0 placeholder(s) of k");
    ag_tensor_free(x);
    ag_graph_free(g);
}

/* The interpreter runs each call of the subgraph on its operands: sin(sin(x)) - 1. */
static void test_run(void **state) {
    (void)state;
    ag_graph *g = make_outer();
    assert_non_null(g);
    double xv[12];
    for (int i = 0; i < 12; i++)
        xv[i] = -1.5 + 0.27 * i;
    ag_tensor *x = tu_tensor(AG_F32, 2, S43, xv);
    ag_tensor *out[1] = {0};
    int rc = ag_graph_run(g, &x, 1, out, 1);
    if (rc != 1)
        fail_msg("run: %s", ag_last_error());
    double want[12];
    for (int i = 0; i < 12; i++)
        want[i] = sin(sin((double)(float)xv[i])) - 1.0;
    tu_assert_values(out[0], 2, S43, want, 1e-6);

    /* The same computation written flat runs the same kernels: the same bits. */
    const char *flat_text = "graph():\n"
                            "    %x : f32[4, 3]  # None\n"
                            "    %sin = sin(%x)  # f32[4, 3]\n"
                            "    %mul = mul.Scalar(%sin, 1)  # f32[4, 3]\n"
                            "    %sin_1 = sin(%mul)  # f32[4, 3]\n"
                            "    %mul_1 = mul.Scalar(%sin_1, 1)  # f32[4, 3]\n"
                            "    %sub = sub.Scalar(%mul_1, 1)  # f32[4, 3]\n"
                            "    return (%sub,)\n";
    ag_graph *flat = ag_graph_parse(flat_text, strlen(flat_text));
    assert_non_null(flat);
    ag_tensor *fo = NULL;
    assert_int_equal(ag_graph_run(flat, &x, 1, &fo, 1), 1);
    assert_true(tu_same_bits(out[0], fo));
    ag_tensor_free(fo);
    ag_graph_free(flat);
    ag_tensor_free(out[0]);

    /* A copy runs alone once the original is gone, on its own subgraphs. */
    ag_graph *c = ag_graph_copy(g);
    assert_non_null(c);
    ag_graph *gs = ag_graph_subgraph(g, "repeated_subgraph0");
    ag_graph *cs = ag_graph_subgraph(c, "repeated_subgraph0");
    assert_non_null(cs);
    assert_ptr_not_equal(gs, cs);
    assert_ptr_equal(ag_node_subgraph(ag_graph_find(c, "repeated_subgraph0")), cs);
    char *s1 = ag_graph_to_string(g, NULL), *s2 = ag_graph_to_string(c, NULL);
    assert_string_equal(s1, s2);
    ag_free(s1);
    ag_free(s2);
    ag_graph_free(g);
    assert_int_equal(ag_graph_verify(c), 0);
    assert_int_equal(ag_graph_run(c, &x, 1, out, 1), 1);
    tu_assert_values(out[0], 2, S43, want, 1e-6);
    ag_tensor_free(out[0]);
    ag_graph_free(c);
    ag_tensor_free(x);
}

static void test_dce_cse(void **state) {
    (void)state;
    ag_graph *g = make_outer();
    assert_non_null(g);
    ag_node *x = ag_graph_find(g, "x");
    ag_node *at = ag_graph_find(g, "repeated_subgraph0");
    ag_node *g0 = ag_graph_find(g, "getitem");
    /* A third call on %getitem, the operand of the second: CSE merges it into the second, and
     * not the second into the first (different operands). */
    ag_node *i2 = ag_graph_invoke_subgraph(g, at, "subgraph_0", &g0, 1, NULL);
    assert_non_null(i2);
    ag_node *g2 = ag_graph_getitem(g, i2, 0, NULL);
    assert_non_null(g2);
    assert_int_equal(ag_graph_cse(g), 2); /* invoke_subgraph_2 and its getitem */
    assert_non_null(ag_graph_find(g, "invoke_subgraph"));
    assert_non_null(ag_graph_find(g, "invoke_subgraph_1"));
    assert_null(ag_graph_find(g, "invoke_subgraph_2"));
    assert_int_equal(ag_graph_verify(g), 0);

    /* An unused call of a pure subgraph is dead code. */
    ag_node *i3 = ag_graph_invoke_subgraph(g, at, "subgraph_0", &x, 1, "unused");
    assert_non_null(i3);
    assert_int_equal(ag_graph_dce(g), 1);
    assert_null(ag_graph_find(g, "unused"));
    /* With the output reading %x only, everything else goes, get_attr included; the subgraph
     * stays an attribute of the graph (as FX leaves the submodule) and still prints. */
    ag_node *out = ag_graph_output_node(g);
    assert_int_equal(ag_node_set_arg(out, 0, AG_GA_NODES(&x, 1)), 0);
    assert_int_equal(ag_graph_dce(g), 6);
    assert_int_equal(ag_graph_num_nodes(g), 2);
    assert_int_equal(ag_graph_num_subgraphs(g), 1);
    assert_int_equal(ag_graph_verify(g), 0);
    char *s = ag_graph_to_string(g, NULL);
    assert_non_null(strstr(s, "\nsubgraph repeated_subgraph0():\n"));
    char *s2 = roundtrip(s);
    assert_string_equal(s, s2);
    ag_free(s);
    ag_free(s2);
    ag_graph_free(g);

    /* A subgraph that writes its input in place has a side effect: its calls stay and are
     * not merged. */
    ag_graph *sub = ag_graph_new();
    ag_tmeta m = meta_of(AG_F32, 2, S43);
    ag_node *a = ag_graph_placeholder(sub, NULL, &m);
    ag_node *ad =
        ag_graph_call(sub, ag_op_find("add_.Tensor"), (ag_garg[]){AG_GA_N(a), AG_GA_N(a)}, 2, NULL);
    assert_non_null(ad);
    ag_graph_output(sub, &ad, 1);
    g = ag_graph_new();
    assert_int_equal(ag_graph_add_subgraph(g, "inplace", sub), 0);
    x = ag_graph_placeholder(g, "x", &m);
    at = ag_graph_get_attr_subgraph(g, "inplace", NULL);
    ag_node *c1 = ag_graph_invoke_subgraph(g, at, "s", &x, 1, NULL);
    ag_node *c2 = ag_graph_invoke_subgraph(g, at, "s", &x, 1, NULL);
    assert_non_null(c1);
    assert_non_null(c2);
    ag_graph_output(g, &x, 1);
    assert_int_equal(ag_graph_cse(g), 0);
    assert_int_equal(ag_graph_dce(g), 0);
    assert_int_equal(ag_graph_num_nodes(g), 5);
    ag_graph_free(g);

    /* Two calls with the same operands: merged when the subgraph is pure, not when it draws
     * random numbers (two draws are two values). */
    for (int random = 0; random < 2; random++) {
        char text[1024];
        snprintf(text, sizeof text,
                 "graph():\n"
                 "    %%x : f32[2]  # None\n"
                 "    %%r = get_attr(r)  # subgraph\n"
                 "    %%i = invoke_subgraph(%%r, 'id', %%x)  # (f32[2],)\n"
                 "    %%a = getitem(%%i, 0)  # f32[2]\n"
                 "    %%j = invoke_subgraph(%%r, 'id', %%x)  # (f32[2],)\n"
                 "    %%b = getitem(%%j, 0)  # f32[2]\n"
                 "    %%s = sub.Tensor(%%a, %%b)  # f32[2]\n"
                 "    return (%%s,)\n"
                 "\n"
                 "subgraph r():\n"
                 "    %%y : f32[2]  # None\n"
                 "    %%c = %s  # f32[2]\n"
                 "    %%add = add.Tensor(%%y, %%c)  # f32[2]\n"
                 "    return (%%add,)\n",
                 random ? "rand([2])" : "relu(%y)");
        g = ag_graph_parse(text, strlen(text));
        if (!g)
            fail_msg("parse: %s", ag_last_error());
        assert_int_equal(ag_graph_cse(g), random ? 0 : 2);
        assert_int_equal(ag_graph_verify(g), 0);
        ag_graph_free(g);
    }
}

/* DOT: a cluster per subgraph, a dashed edge from each get_attr of it into the cluster. */
static void test_dot(void **state) {
    (void)state;
    ag_graph *g = make_outer();
    assert_non_null(g);
    char *d = ag_graph_to_dot(g, NULL);
    assert_non_null(d);
    const char *want[] = {
        "  compound=true;\n",
        "  subgraph cluster_s0 {\n  label=\"subgraph repeated_subgraph0\";\n",
        "  n1 [shape=record, label=\"{%repeated_subgraph0|get_attr|subgraph repeated_subgraph0}\"",
        "  n2 [shape=record, label=\"{%invoke_subgraph|invoke_subgraph|f32[4, 3]}\"",
        "  s0n1 [shape=record, label=\"{%sin|sin|f32[4, 3]}\"",
        "  s0n0 -> s0n1;\n",
        "  s0n1 -> s0n2;\n",
        "  s0n2 -> s0n3;\n",
        "  n1 -> s0n0 [style=dashed, lhead=cluster_s0];\n",
        "  n1 -> n2;\n",
        "  n0 -> n2;\n",
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
        if (!strstr(d, want[i]))
            fail_msg("DOT lacks '%s':\n%s", want[i], d);
    ag_free(d);
    if (system("command -v dot >/dev/null 2>&1") == 0) {
        char path[] = "/tmp/ag_subgraph_XXXXXX";
        int fd = mkstemp(path);
        assert_true(fd >= 0);
        close(fd);
        if (ag_graph_write_svg(g, path, NULL))
            fail_msg("svg: %s", ag_last_error());
        char *svg = tu_read_file(path);
        assert_non_null(svg);
        assert_non_null(strstr(svg, "<title>cluster_s0</title>"));
        free(svg);
        unlink(path);
    }
    ag_graph_free(g);
}

/* ---- errors ---- */

static void test_api_errors(void **state) {
    (void)state;
    ag_graph *g = make_outer();
    assert_non_null(g);
    ag_node *at = ag_graph_find(g, "repeated_subgraph0");
    ag_node *inv = ag_graph_find(g, "invoke_subgraph");
    ag_tmeta m = meta_of(AG_F32, 2, (int64_t[]){2, 3});
    /* A placeholder added after the others, as graphs allow. */
    ag_node *y = ag_graph_placeholder(g, "y", &m);
    assert_non_null(y);

    expect_null(ag_graph_invoke_subgraph(g, at, "subgraph_0", &y, 1, NULL),
                "invoke_subgraph: operand 0 (%y) is f32[2, 3] but placeholder %arg0_1 of "
                "repeated_subgraph0 is f32[4, 3]");
    ag_node *two[2] = {y, y};
    expect_null(ag_graph_invoke_subgraph(g, at, "subgraph_0", two, 2, NULL),
                "invoke_subgraph: 2 operand(s) for the 1 placeholder(s) of repeated_subgraph0");
    expect_null(ag_graph_getitem(g, inv, 1, NULL), "getitem: invoke_subgraph has no output 1");
    expect_null(ag_graph_get_attr_subgraph(g, "nope", NULL),
                "graph_get_attr_subgraph: the graph has no subgraph 'nope'");
    expect_null(ag_graph_invoke_subgraph(g, y, "subgraph_0", &y, 1, NULL),
                "invoke_subgraph: argument 0 (%y) is not a get_attr of a subgraph");
    expect_null(ag_graph_call(g, ag_op_find("relu"), (ag_garg[]){AG_GA_N(at)}, 1, NULL),
                "relu: argument 0 (%repeated_subgraph0) is a subgraph; only invoke_subgraph takes "
                "one");
    expect_null(ag_graph_call(g, ag_op_find("relu"), (ag_garg[]){AG_GA_N(inv)}, 1, NULL),
                "relu: argument 0 (%invoke_subgraph) is a tuple; read it through getitem");
    expect_null(ag_graph_get_attr(g, ag_node_constant(at), "x2"), "graph_get_attr");

    /* A subgraph's nodes reference only its own. */
    ag_graph *sub = ag_graph_subgraph(g, "repeated_subgraph0");
    ag_node *x = ag_graph_find(g, "x");
    expect_null(ag_graph_call(sub, ag_op_find("relu"), (ag_garg[]){AG_GA_N(x)}, 1, NULL),
                "graph_call: relu: argument 0 (%x) is a node of another graph");
    ag_node *sn = ag_graph_find(sub, "sin");
    expect_null(ag_graph_call(g, ag_op_find("relu"), (ag_garg[]){AG_GA_N(sn)}, 1, NULL),
                "graph_call: relu: argument 0 (%sin) is a node of another graph");
    assert_int_equal(ag_graph_verify(sub), 0);

    /* Attribute names. */
    ag_graph *s2 = make_sin_mul();
    assert_int_equal(ag_graph_add_subgraph(g, "repeated_subgraph0", s2), AG_EINVAL);
    tu_assert_error_contains("'repeated_subgraph0': the graph has a subgraph of that name");
    assert_int_equal(ag_graph_add_subgraph(g, "1x", s2), AG_EINVAL);
    tu_assert_error_contains("the name is not an identifier");
    assert_int_equal(ag_graph_add_subgraph(g, "again", sub), AG_EINVAL);
    tu_assert_error_contains("the graph is already a subgraph");
    assert_int_equal(ag_graph_add_subgraph(sub, "cycle", g), AG_EINVAL);
    tu_assert_error_contains("'cycle': the subgraph is the graph's own ancestor");
    assert_int_equal(ag_graph_add_subgraph(g, "g", g), AG_EINVAL);
    tu_assert_error_contains("a graph cannot be its own subgraph");
    ag_graph *empty = ag_graph_new();
    assert_int_equal(ag_graph_add_subgraph(g, "empty", empty), AG_EINVAL);
    tu_assert_error_contains("the subgraph has no output node");
    ag_graph_free(empty);
    double v[1] = {1};
    ag_tensor *t = tu_tensor(AG_F32, 1, (int64_t[]){1}, v);
    assert_non_null(ag_graph_get_attr(g, t, "c0"));
    assert_int_equal(ag_graph_add_subgraph(g, "c0", s2), AG_EINVAL);
    tu_assert_error_contains("'c0': a constant of the graph has that name");
    expect_null(ag_graph_get_attr(g, t, "repeated_subgraph0"),
                "graph_get_attr: 'repeated_subgraph0' is the name of a subgraph");
    ag_tensor_free(t);
    ag_graph_free(s2); /* refused every time: still the caller's */
    ag_graph_free(g);
}

static void test_verify_errors(void **state) {
    (void)state;
    ag_graph *g = make_outer();
    assert_non_null(g);
    ag_graph *sub = ag_graph_subgraph(g, "repeated_subgraph0");
    /* The subgraph is verified with its parent. */
    ag_node *sn = ag_graph_find(sub, "sin");
    ag_tmeta good = *ag_node_val(sn, 0);
    ag_tmeta bad = meta_of(AG_F64, 2, S43);
    assert_int_equal(ag_node_set_val(sn, 0, &bad), 0);
    assert_int_equal(ag_graph_verify(g), AG_EINVAL);
    tu_assert_error_contains(
        "verify: subgraph repeated_subgraph0: %sin: stored val f64[4, 3] but sin infers "
        "f32[4, 3]");
    assert_int_equal(ag_node_set_val(sn, 0, &good), 0);
    /* A call whose operands no longer fit the subgraph's placeholders. */
    ag_node *a = ag_graph_find(sub, "arg0_1");
    ag_tmeta other = meta_of(AG_F32, 2, (int64_t[]){4, 4});
    assert_int_equal(ag_node_set_val(a, 0, &other), 0);
    assert_int_equal(ag_graph_verify(g), AG_EINVAL);
    tu_assert_error_contains("verify: %invoke_subgraph: invoke_subgraph: operand 0 (%x) is f32[4, "
                             "3] but placeholder %arg0_1 of repeated_subgraph0 is f32[4, 4]");
    ag_graph_free(g);
}

/* Parser errors: line:column and the node. */
static void expect_parse_error(const char *text, const char *msg) {
    ag_graph *g = ag_graph_parse(text, strlen(text));
    if (g) {
        ag_graph_free(g);
        fail_msg("parsed, expected '%s'", msg);
    }
    tu_assert_error_contains(msg);
}

static void test_parse_errors(void **state) {
    (void)state;
    const char *sub = "\n"
                      "subgraph s0():\n"
                      "    %a : f32[2]  # None\n"
                      "    %b = sin(%a)  # f32[2]\n"
                      "    return (%b,)\n";
    char buf[1024];
    /* operand shape mismatch */
    snprintf(buf, sizeof buf, "%s%s",
             "graph():\n"
             "    %x : f32[3]  # None\n"
             "    %s0 = get_attr(s0)  # subgraph\n"
             "    %i = invoke_subgraph(%s0, 'id', %x)  # (f32[2],)\n"
             "    %g = getitem(%i, 0)  # f32[2]\n"
             "    return (%g,)\n",
             sub);
    expect_parse_error(buf, "line 4:5: %i: invoke_subgraph: operand 0 (%x) is f32[3] but "
                            "placeholder %a of s0 is f32[2]");
    /* getitem out of range */
    snprintf(buf, sizeof buf, "%s%s",
             "graph():\n"
             "    %x : f32[2]  # None\n"
             "    %s0 = get_attr(s0)  # subgraph\n"
             "    %i = invoke_subgraph(%s0, 'id', %x)  # (f32[2],)\n"
             "    %g = getitem(%i, 1)  # f32[2]\n"
             "    return (%g,)\n",
             sub);
    expect_parse_error(buf, "line 5:5: %g: getitem: i has no output 1");
    /* unknown attribute */
    snprintf(buf, sizeof buf, "%s%s",
             "graph():\n"
             "    %x : f32[2]  # None\n"
             "    %s0 = get_attr(s1)  # subgraph\n"
             "    return (%x,)\n",
             sub);
    expect_parse_error(buf, "line 3:20: unknown attribute 's1' (no `constant s1` line or "
                            "`subgraph s1():` block)");
    /* a subgraph referencing the outer graph's nodes: each block knows only its own */
    expect_parse_error("graph():\n"
                       "    %x : f32[2]  # None\n"
                       "    return (%x,)\n"
                       "\n"
                       "subgraph s0():\n"
                       "    %b = sin(%x)  # f32[2]\n"
                       "    return (%b,)\n",
                       "line 6:14: unknown node %x");
    /* a get_attr of a subgraph has no VAL */
    snprintf(buf, sizeof buf, "%s%s",
             "graph():\n"
             "    %x : f32[2]  # None\n"
             "    %s0 = get_attr(s0)  # f32[2]\n"
             "    return (%x,)\n",
             sub);
    expect_parse_error(
        buf, "line 3:27: expected 'subgraph' (a get_attr of a subgraph has no VAL), got 'f32'");
    /* duplicate subgraphs, a block without return, a header without a name */
    snprintf(buf, sizeof buf, "graph():\n    %%x : f32[2]  # None\n    return (%%x,)\n%s%s", sub,
             sub);
    expect_parse_error(buf, "line 10:10: duplicate subgraph s0");
    expect_parse_error("graph():\n"
                       "    %x : f32[2]  # None\n"
                       "subgraph s0():\n"
                       "    %a : f32[2]  # None\n"
                       "    return (%a,)\n",
                       "line 2:24: expected 'return', got the next subgraph block");
    expect_parse_error("graph():\n"
                       "    %x : f32[2]  # None\n"
                       "    return (%x,)\n"
                       "subgraph ():\n",
                       "line 4:10: expected a subgraph name");
    /* the tuple of invoke_subgraph is read through getitem */
    snprintf(buf, sizeof buf, "%s%s",
             "graph():\n"
             "    %x : f32[2]  # None\n"
             "    %s0 = get_attr(s0)  # subgraph\n"
             "    %i = invoke_subgraph(%s0, 'id', %x)  # (f32[2],)\n"
             "    %r = relu(%i)  # f32[2]\n"
             "    return (%r,)\n",
             sub);
    expect_parse_error(buf, "line 5:5: %r: relu: argument 0 (%i) is a tuple; read it through "
                            "getitem");
}

/* ---- allocation failures ---- */

static int build_scenario(void *ud) {
    (void)ud;
    ag_graph *g = make_outer();
    if (!g)
        return ag_last_status();
    ag_graph *c = ag_graph_copy(g);
    char *s = c ? ag_graph_to_string(c, NULL) : NULL;
    ag_graph *p = s ? ag_graph_parse(s, strlen(s)) : NULL;
    int rc = p ? ag_graph_verify(p) : ag_last_status();
    char *d = rc == 0 ? ag_graph_to_dot(p, NULL) : NULL;
    if (rc == 0 && !d)
        rc = ag_last_status();
    /* The interpreter on the parsed graph: each call runs the subgraph. */
    ag_tensor *x = NULL, *out = NULL;
    if (rc == 0) {
        tu_alloc_pause();
        x = tu_tensor(AG_F32, 2, S43, (double[]){0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11});
        tu_alloc_resume();
        int r = ag_graph_run(p, &x, 1, &out, 1);
        rc = r == 1 ? 0 : r;
    }
    tu_alloc_pause();
    if (rc == 0) {
        char *s2 = ag_graph_to_string(p, NULL);
        assert_string_equal(s2, expected);
        ag_free(s2);
        assert_non_null(strstr(d, "subgraph cluster_s0"));
        for (int i = 0; i < 12; i++)
            tu_assert_near(ag_tensor_item_at(out, i), sin(sin((double)i)) - 1.0, 1e-6, "out", i);
    }
    tu_alloc_resume();
    ag_tensor_free(out);
    ag_tensor_free(x);
    ag_free(d);
    ag_free(s);
    ag_graph_free(p);
    ag_graph_free(c);
    ag_graph_free(g);
    return rc;
}

static void test_alloc_failures(void **state) {
    (void)state;
    tu_sweep_opts o = {.what = "subgraphs: build, copy, print, parse, verify, draw, run, free",
                       .one_thread = true};
    int64_t n = tu_alloc_failure_sweep(build_scenario, NULL, &o);
    assert_true(n > 50);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_print_parse_verify),
        cmocka_unit_test(test_doc_example),
        cmocka_unit_test(test_run),
        cmocka_unit_test(test_multi),
        cmocka_unit_test(test_no_operands),
        cmocka_unit_test(test_dce_cse),
        cmocka_unit_test(test_dot),
        cmocka_unit_test(test_api_errors),
        cmocka_unit_test(test_verify_errors),
        cmocka_unit_test(test_parse_errors),
        cmocka_unit_test(test_alloc_failures),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
