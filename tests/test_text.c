/* The graph text format (src/graph/print.c, parse.c) and DOT/SVG pictures (dot.c).
 *
 * Expected texts are written by hand from docs/GRAPH_FORMAT.md, never produced by the printer.
 * Covered: one graph built through the API with every kind of node, argument and metadata,
 * printed byte for byte with and without seq_nr/stack traces; parse(print(g)) prints the same
 * and verifies; hand-written text (the format doc's example); corner cases of names, floats,
 * traces and constants; parse errors with exact line:column; allocation failures; the fuzz
 * corpus replayed (under ASan in the sanitizer build); bounds on huge, binary and endless
 * input; every zoo model's traced, exported and partitioned graphs read back under every
 * printing option, in process and through `aotgrad show`; DOT fragments and SVG through
 * Graphviz. */
#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "testutil.h"

/* ---- helpers ---- */

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

static ag_node *ph(ag_graph *g, const char *name, ag_dtype dt, int nd, const int64_t *sizes,
                   ag_desc *d) {
    ag_tmeta m = meta_of(dt, nd, sizes);
    ag_node *n = ag_graph_placeholder(g, name, &m);
    assert_non_null(n);
    if (d) {
        assert_int_equal(ag_node_set_desc(n, d), 0);
        ag_desc_release(d);
    }
    return n;
}

static ag_node *call(ag_graph *g, const char *op, const ag_garg *args, int nargs) {
    const ag_op *o = ag_op_find(op);
    assert_non_null(o);
    ag_node *n = ag_graph_call(g, o, args, nargs, NULL);
    if (!n)
        fail_msg("%s: %s", op, ag_last_error());
    return n;
}

/* Compares line by line, so a failure shows the first differing line. */
static void assert_text(const char *got, const char *want) {
    assert_non_null(got);
    if (!strcmp(got, want))
        return;
    int line = 1;
    const char *g = got, *w = want;
    for (;;) {
        const char *ge = strchr(g, '\n'), *we = strchr(w, '\n');
        size_t gl = ge ? (size_t)(ge - g) : strlen(g), wl = we ? (size_t)(we - w) : strlen(w);
        if (gl != wl || memcmp(g, w, gl) || !ge != !we)
            fail_msg("line %d differs:\n got: %.*s\nwant: %.*s\n--- full text ---\n%s", line,
                     (int)gl, g, (int)wl, w, got);
        if (!ge)
            break;
        g = ge + 1;
        w = we + 1;
        line++;
    }
    fail_msg("texts differ\n%s", got);
}

static char *print_g(const ag_graph *g, bool seq, bool traces) {
    ag_print_opts o = {.seq_nr = seq, .stack_trace = traces};
    char *s = ag_graph_to_string(g, &o);
    assert_non_null(s);
    return s;
}

/* Parses text (must succeed), verifies, prints with full options and frees. */
static char *roundtrip(const char *text) {
    ag_graph *g = ag_graph_parse(text, strlen(text));
    if (!g)
        fail_msg("parse failed: %s\n%s", ag_last_error(), text);
    if (ag_graph_verify(g))
        fail_msg("verify failed: %s", ag_last_error());
    char *s = print_g(g, true, true);
    ag_graph_free(g);
    return s;
}

static void assert_roundtrip(const char *text) {
    char *s = roundtrip(text);
    assert_text(s, text);
    ag_free(s);
}

/* Parsing must fail with exactly this message. */
static void assert_parse_error(const char *text, const char *msg) {
    ag_graph *g = ag_graph_parse(text, strlen(text));
    if (g) {
        ag_graph_free(g);
        fail_msg("parsed, expected the error: %s", msg);
    }
    assert_int_equal(ag_last_status(), AG_EFORMAT);
    if (strcmp(ag_last_error(), msg))
        fail_msg("error\n got: %s\nwant: %s", ag_last_error(), msg);
}

/* ---- the reference graph ---- */

/* Every node kind, argument kind and metadata item the format has. */
static ag_graph *build_reference(void) {
    ag_graph *g = ag_graph_new();
    assert_non_null(g);
    ag_node *w = ph(g, "primals_1", AG_F32, 2, (int64_t[]){2, 3}, ag_desc_param("linear.weight"));
    ag_node *b = ph(g, "primals_2", AG_F32, 1, (int64_t[]){2}, ag_desc_param("linear.bias"));
    ag_node *x = ph(g, "primals_3", AG_F32, 2, (int64_t[]){4, 3}, ag_desc_plain_input(0));
    ag_desc *po = ag_desc_plain_output(0);
    ag_node *tg = ph(g, "tangents_1", AG_F32, 2, (int64_t[]){4, 2}, ag_desc_tangent(po));
    assert_int_equal(ag_node_set_partitioner_tag(tg, "is_backward"), 0);

    ag_node *t = call(g, "t", (ag_garg[]){AG_GA_N(w)}, 1);
    ag_node_custom_set(t, "pp_stage", (ag_mval){.kind = AG_MV_INT, .u.i = 0});
    ag_node_custom_set(t, "name", (ag_mval){.kind = AG_MV_STR, .u.s = "x"});
    ag_node_custom_set(t, "w", (ag_mval){.kind = AG_MV_FLOAT, .u.f = 0.5});
    ag_node_set_seq_nr(t, 0);
    ag_node_set_partitioner_tag(t, "is_forward");

    ag_node *mm = call(
        g, "addmm", (ag_garg[]){AG_GA_N(b), AG_GA_N(x), AG_GA_N(t), AG_GA_I(1), AG_GA_F(0.5)}, 5);
    ag_node_set_seq_nr(mm, 1);
    ag_node_set_partitioner_tag(mm, "is_forward");
    ag_node_set_recompute(mm, AG_MUST_SAVE);
    ag_node_set_stack_trace(mm, "  File \"model.c\", line 12, in forward\n"
                                "    y = ag_linear(x, w, b);");

    ag_node *ln = call(g, "native_layer_norm",
                       (ag_garg[]){AG_GA_N(x), AG_GA_INTS(((int64_t[]){3}), 1), AG_GA_NIL,
                                   AG_GA_NIL, AG_GA_F(1e-5)},
                       5);
    ag_node *gi = ag_graph_getitem(g, ln, 0, NULL);
    assert_non_null(gi);
    ag_node *sl = call(g, "slice.Tensor",
                       (ag_garg[]){AG_GA_N(gi), AG_GA_I(1), AG_GA_I(1), AG_GA_I(3), AG_GA_I(1)}, 5);
    ag_node *ge = call(g, "gelu", (ag_garg[]){AG_GA_N(sl), AG_GA_S("tanh")}, 2);

    /* A strided f32 constant: the transpose of a [3, 2] tensor. */
    float base[6] = {0.1f, -0.0f, 2.5f, 1e-5f, 1e20f, INFINITY};
    ag_tensor *bt = ag_from_data(AG_F32, 2, (int64_t[]){3, 2}, base);
    ag_tensor *ct = ag_t(bt);
    assert_non_null(ct);
    ag_node *c0 = ag_graph_get_attr(g, ct, NULL);
    assert_non_null(c0);
    ag_tensor_free(ct);
    ag_tensor_free(bt);

    ag_node *add = call(g, "add.Tensor", (ag_garg[]){AG_GA_N(tg), AG_GA_N(ge), AG_GA_I(2)}, 3);
    ag_node_set_seq_nr(add, 1);
    ag_node_set_partitioner_tag(add, "is_backward");
    ag_node_set_gradient_acc(add, true);

    ag_node *sm = call(g, "sum.dim_IntList",
                       (ag_garg[]){AG_GA_N(tg), AG_GA_INTS(((int64_t[]){0}), 1), AG_GA_B(true)}, 3);
    ag_node_set_partitioner_tag(sm, "must_be_in_backward");
    ag_node_meta_set(sm, "note", (ag_mval){.kind = AG_MV_STR, .u.s = "it's"});

    ag_node *out = ag_graph_output(g, (ag_node *[]){mm, add, NULL, sm, c0}, 5);
    assert_non_null(out);
    ag_desc *gx = ag_desc_grad(ag_node_desc(x));
    ag_desc *gb = ag_desc_grad(ag_node_desc(b));
    ag_desc *descs[5] = {po, gx, NULL, gb, NULL};
    assert_int_equal(ag_node_set_output_descs(out, descs, 5), 0);
    ag_desc_release(po);
    ag_desc_release(gx);
    ag_desc_release(gb);
    return g;
}

static const char reference_full[] =
    "graph():\n"
    "    %primals_1 : f32[2, 3]  # ParamAOTInput(target='linear.weight')\n"
    "    %primals_2 : f32[2]  # ParamAOTInput(target='linear.bias')\n"
    "    %primals_3 : f32[4, 3]  # PlainAOTInput(idx=0)\n"
    "    %tangents_1 : f32[4, 2]  # TangentAOTInput(output=PlainAOTOutput(idx=0))  is_backward\n"
    "    %t = t(%primals_1)  # f32[3, 2]{1, 3}  {'pp_stage': 0, 'name': 'x', 'w': 0.5}  seq_nr=0  "
    "is_forward\n"
    "    %addmm = addmm(%primals_2, %primals_3, %t, beta=1, alpha=0.5)  # f32[4, 2]  seq_nr=1  "
    "is_forward  recompute=MUST_SAVE\n"
    "          File \"model.c\", line 12, in forward\n"
    "            y = ag_linear(x, w, b);\n"
    "    %native_layer_norm = native_layer_norm(%primals_3, [3], None, None, 1e-05)  "
    "# (f32[4, 3], f32[4, 1], f32[4, 1])\n"
    "    %getitem = getitem(%native_layer_norm, 0)  # f32[4, 3]\n"
    "    %slice_1 = slice.Tensor(%getitem, 1, 1, 3)  # f32[4, 2]{3, 1}+1\n"
    "    %gelu = gelu(%slice_1, approximate='tanh')  # f32[4, 2]\n"
    "    %_tensor_constant0 = get_attr(_tensor_constant0)  # f32[2, 3]{1, 2}\n"
    "    %add = add.Tensor(%tangents_1, %gelu, alpha=2)  # f32[4, 2]  seq_nr=1  is_backward  "
    "gradient_acc\n"
    "    %sum_1 = sum.dim_IntList(%tangents_1, [0], True)  # f32[1, 2]  must_be_in_backward  "
    "note=\"it's\"\n"
    "    return (%addmm, %add, None, %sum_1, %_tensor_constant0)  # [PlainAOTOutput(idx=0), "
    "GradAOTOutput(grad_of=PlainAOTInput(idx=0)), None, "
    "GradAOTOutput(grad_of=ParamAOTInput(target='linear.bias')), None]\n"
    "\n"
    "constant _tensor_constant0 : f32[2, 3]{1, 2} = [0.1, 2.5, 1e+20, -0.0, 1e-05, inf]\n";

/* The default options: no seq_nr, no stack traces. */
static const char reference_plain[] =
    "graph():\n"
    "    %primals_1 : f32[2, 3]  # ParamAOTInput(target='linear.weight')\n"
    "    %primals_2 : f32[2]  # ParamAOTInput(target='linear.bias')\n"
    "    %primals_3 : f32[4, 3]  # PlainAOTInput(idx=0)\n"
    "    %tangents_1 : f32[4, 2]  # TangentAOTInput(output=PlainAOTOutput(idx=0))  is_backward\n"
    "    %t = t(%primals_1)  # f32[3, 2]{1, 3}  {'pp_stage': 0, 'name': 'x', 'w': 0.5}  "
    "is_forward\n"
    "    %addmm = addmm(%primals_2, %primals_3, %t, beta=1, alpha=0.5)  # f32[4, 2]  "
    "is_forward  recompute=MUST_SAVE\n"
    "    %native_layer_norm = native_layer_norm(%primals_3, [3], None, None, 1e-05)  "
    "# (f32[4, 3], f32[4, 1], f32[4, 1])\n"
    "    %getitem = getitem(%native_layer_norm, 0)  # f32[4, 3]\n"
    "    %slice_1 = slice.Tensor(%getitem, 1, 1, 3)  # f32[4, 2]{3, 1}+1\n"
    "    %gelu = gelu(%slice_1, approximate='tanh')  # f32[4, 2]\n"
    "    %_tensor_constant0 = get_attr(_tensor_constant0)  # f32[2, 3]{1, 2}\n"
    "    %add = add.Tensor(%tangents_1, %gelu, alpha=2)  # f32[4, 2]  is_backward  "
    "gradient_acc\n"
    "    %sum_1 = sum.dim_IntList(%tangents_1, [0], True)  # f32[1, 2]  must_be_in_backward  "
    "note=\"it's\"\n"
    "    return (%addmm, %add, None, %sum_1, %_tensor_constant0)  # [PlainAOTOutput(idx=0), "
    "GradAOTOutput(grad_of=PlainAOTInput(idx=0)), None, "
    "GradAOTOutput(grad_of=ParamAOTInput(target='linear.bias')), None]\n"
    "\n"
    "constant _tensor_constant0 : f32[2, 3]{1, 2} = [0.1, 2.5, 1e+20, -0.0, 1e-05, inf]\n";

static void test_print_reference(void **state) {
    (void)state;
    ag_graph *g = build_reference();
    char *s = print_g(g, true, true);
    assert_text(s, reference_full);
    ag_free(s);
    s = ag_graph_to_string(g, NULL);
    assert_text(s, reference_plain);
    ag_free(s);
    /* no_custom and no_meta drop the dict and the other items. */
    ag_print_opts o = {.no_custom = true, .no_meta = true};
    s = ag_graph_to_string(g, &o);
    assert_non_null(strstr(s, "    %t = t(%primals_1)  # f32[3, 2]{1, 3}\n"));
    assert_non_null(strstr(
        s, "    %tangents_1 : f32[4, 2]  # TangentAOTInput(output=PlainAOTOutput(idx=0))\n"));
    assert_null(strstr(s, "gradient_acc"));
    ag_free(s);
    /* ag_graph_print writes the same text. */
    FILE *f = tmpfile();
    assert_non_null(f);
    assert_int_equal(ag_graph_print(g, f, NULL), 0);
    long n = ftell(f);
    assert_int_equal(n, (long)strlen(reference_plain));
    rewind(f);
    char *buf = malloc((size_t)n + 1);
    assert_int_equal(fread(buf, 1, (size_t)n, f), (size_t)n);
    buf[n] = 0;
    assert_string_equal(buf, reference_plain);
    free(buf);
    fclose(f);
    ag_graph_free(g);
}

static void test_parse_reference(void **state) {
    (void)state;
    assert_roundtrip(reference_full);
    /* The parsed graph carries what the text says. */
    ag_graph *g = ag_graph_parse(reference_full, strlen(reference_full));
    assert_non_null(g);
    assert_int_equal(ag_graph_verify(g), 0);
    ag_node *mm = ag_graph_find(g, "addmm");
    assert_int_equal(ag_node_seq_nr(mm), 1);
    assert_int_equal(ag_node_recompute(mm), AG_MUST_SAVE);
    assert_string_equal(ag_node_stack_trace(mm), "  File \"model.c\", line 12, in forward\n"
                                                 "    y = ag_linear(x, w, b);");
    assert_int_equal(ag_node_nargs(mm), 5);
    assert_int_equal(ag_node_arg(mm, 3)->kind, AG_GA_INT);
    assert_true(ag_node_arg(mm, 4)->kind == AG_GA_FLOAT && ag_node_arg(mm, 4)->u.f == 0.5);
    ag_node *t = ag_graph_find(g, "t");
    ag_mval v = ag_node_custom_get(t, "w");
    assert_true(v.kind == AG_MV_FLOAT && v.u.f == 0.5);
    v = ag_node_custom_get(t, "name");
    assert_true(v.kind == AG_MV_STR && !strcmp(v.u.s, "x"));
    assert_true(ag_node_is_gradient_acc(ag_graph_find(g, "add")));
    assert_string_equal(ag_node_partitioner_tag(ag_graph_find(g, "sum_1")), "must_be_in_backward");
    ag_tensor *c = ag_node_constant(ag_graph_find(g, "_tensor_constant0"));
    assert_int_equal(ag_tensor_strides(c)[0], 1);
    assert_int_equal(ag_tensor_strides(c)[1], 2);
    assert_true(ag_tensor_item_at(c, 0) == (double)0.1f);
    assert_true(ag_tensor_item_at(c, 3) == 0.0 && signbit(ag_tensor_item_at(c, 3)));
    assert_true(isinf(ag_tensor_item_at(c, 5)));
    ag_node *out = ag_graph_output_node(g);
    assert_true(ag_desc_is_grad(ag_node_output_desc(out, 3)));
    assert_null(ag_node_output_desc(out, 2));
    /* The text without seq_nr/traces parses too and keeps its own spelling. */
    ag_graph *g2 = ag_graph_parse(reference_plain, strlen(reference_plain));
    assert_non_null(g2);
    char *s = ag_graph_to_string(g2, NULL);
    assert_text(s, reference_plain);
    assert_int_equal(ag_node_seq_nr(ag_graph_find(g2, "addmm")), -1);
    ag_free(s);
    ag_graph_free(g2);
    ag_graph_free(g);
}

/* print(parse(print(g))) == print(g) for a graph the API built. */
static void test_roundtrip_built(void **state) {
    (void)state;
    ag_graph *g = build_reference();
    for (int k = 0; k < 4; k++) {
        char *s = print_g(g, k & 1, k & 2);
        char *s2 = roundtrip(s);
        char *s3;
        ag_graph *g2 = ag_graph_parse(s, strlen(s));
        assert_non_null(g2);
        s3 = print_g(g2, k & 1, k & 2);
        assert_text(s3, s);
        ag_free(s);
        ag_free(s2);
        ag_free(s3);
        ag_graph_free(g2);
    }
    ag_graph_free(g);
}

/* The example of docs/GRAPH_FORMAT.md, made consistent (a graph that verifies). */
static const char doc_example[] =
    "graph():\n"
    "    %primals_1 : f32[2, 3]  # ParamAOTInput(target='linear.weight')\n"
    "    %primals_2 : f32[2]  # ParamAOTInput(target='linear.bias')\n"
    "    %primals_3 : f32[4, 3]  # PlainAOTInput(idx=0)\n"
    "    %tangents_1 : f32[4, 2]  # TangentAOTInput(output=PlainAOTOutput(idx=0))  is_backward\n"
    "    %t = t(%primals_1)  # f32[3, 2]{1, 3}  {'pp_stage': 0}  seq_nr=0  is_forward\n"
    "    %addmm = addmm(%primals_2, %primals_3, %t)  # f32[4, 2]  {'pp_stage': 0}  seq_nr=1  "
    "is_forward\n"
    "          File \"model.c\", line 12, in forward\n"
    "            y = ag_linear(x, w, b);\n"
    "    %native_layer_norm = native_layer_norm(%primals_3, [3], None, None, 1e-05)  # (f32[4, 3], "
    "f32[4, 1], f32[4, 1])\n"
    "    %getitem = getitem(%native_layer_norm, 0)  # f32[4, 3]\n"
    "    %sum_1 = sum.dim_IntList(%tangents_1, [0], True)  # f32[1, 2]  seq_nr=1  is_backward\n"
    "    %t_1 = t(%tangents_1)  # f32[2, 4]{1, 2}  seq_nr=1  is_backward\n"
    "    %mm = mm(%t_1, %primals_3)  # f32[2, 3]  seq_nr=1  is_backward\n"
    "    %mm_1 = mm(%t_1, %getitem)  # f32[2, 3]  seq_nr=1  is_backward\n"
    "    %add_2 = add.Tensor(%mm, %mm_1)  # f32[2, 3]  seq_nr=1  is_backward  gradient_acc\n"
    "    %_tensor_constant0 = get_attr(_tensor_constant0)  # i64[4]\n"
    "    return (%addmm, %add_2, None, %_tensor_constant0)  # [PlainAOTOutput(idx=0), "
    "GradAOTOutput(grad_of=ParamAOTInput(target='linear.weight')), None, None]\n"
    "\n"
    "constant _tensor_constant0 : i64[4] = [2, 0, 3, 1]\n";

/* The first ``` block of docs/GRAPH_FORMAT.md (malloc'd). */
static char *doc_block(void) {
    FILE *f = fopen("docs/GRAPH_FORMAT.md", "rb");
    if (!f)
        fail_msg("docs/GRAPH_FORMAT.md not found (run the test from the repository root)");
    char *buf = calloc(1, 1 << 16);
    size_t n = fread(buf, 1, (1 << 16) - 1, f);
    fclose(f);
    buf[n] = 0;
    char *a = strstr(buf, "```\n");
    assert_non_null(a);
    a += 4;
    char *b = strstr(a, "```\n");
    assert_non_null(b);
    *b = 0;
    memmove(buf, a, strlen(a) + 1);
    return buf;
}

static void test_parse_doc_example(void **state) {
    (void)state;
    assert_roundtrip(doc_example);
    /* The example in the format's documentation is this one. */
    char *doc = doc_block();
    assert_text(doc, doc_example);
    free(doc);
    /* Hand-written liberties: comments, blank lines, other spacing, keyword arguments for
     * positional ones, VALs and descriptors left out, CRLF line ends. The canonical text is
     * what the printer makes of it. */
    const char *loose = "# a comment before the graph\r\n"
                        "\r\n"
                        "graph():\r\n"
                        "  %x : f32[4,3]\r\n"
                        "  %w:f32[2, 3]  #   ParamAOTInput( target = \"w\" )\r\n"
                        "      # an indented comment\r\n"
                        "  %y = mm(self=%x, mat2=%t)  # f32[4, 2]\r\n"
                        "  %t = t(%w)\r\n"
                        "  return (%y)\r\n";
    assert_parse_error(loose, "line 7:25: %t is used before its definition on line 8");
    const char *loose2 = "# a comment before the graph\r\n"
                         "\r\n"
                         "graph():\r\n"
                         "  %x : f32[4,3]\r\n"
                         "  %w:f32[2, 3]  #   ParamAOTInput( target = \"w\" )\r\n"
                         "      # an indented comment\r\n"
                         "  %t = t(%w)\r\n"
                         "  %y = mm(self=%x, mat2=%t, )  # f32[4, 2]\r\n"
                         "  return (%y)";
    char *s = roundtrip(loose2);
    assert_text(s, "graph():\n"
                   "    %x : f32[4, 3]  # None\n"
                   "    %w : f32[2, 3]  # ParamAOTInput(target='w')\n"
                   "    %t = t(%w)  # f32[3, 2]{1, 3}\n"
                   "    %y = mm(%x, %t)  # f32[4, 2]\n"
                   "    return (%y,)\n");
    ag_free(s);
}

/* Names, floats, strings, lists, dtypes, traces and constants at their edges. */
static void test_corner_cases(void **state) {
    (void)state;
    /* Odd names are quoted; a placeholder without a val prints None; a stack trace that
     * continuation lines cannot carry (a blank line) is a quoted item; generic metadata keys of
     * every kind; a well-known key of the wrong kind prints generically. */
    const char *odd = "graph():\n"
                      "    %'a b' : f32[2]  # None\n"
                      "    %noval : None  # PlainAOTInput(idx=1)\n"
                      "    %\"it's\" = neg(%'a b')  # f32[2]  k1=None  k2=True  k3=-7  k4=1e+300  "
                      "k5='\\n\\x00x'\n";
    assert_parse_error(odd, "line 4:80: a string may not contain a NUL character");
    const char *odd2 = "graph():\n"
                       "    %'a b' : f32[2]  # None\n"
                       "    %noval : None  # PlainAOTInput(idx=1)\n"
                       "    %\"it's\" = neg(%'a b')  # f32[2]  k1=None  k2=True  k3=-7  k4=1e+300  "
                       "k5='\\t\\udcff\\u20ac\\U0001f600\\x7f'  'odd key'=0.1  seq_nr='x'  "
                       "stack_trace='line 1\\n\\nline 3'\n"
                       "    %_1 = _to_copy(%\"it's\", dtype=torch.float64)  # f64[2]\n"
                       "    %cat = cat([%_1, %_1], -1)  # f64[4]\n"
                       "    return (%cat, %\"it's\")\n";
    char *s = roundtrip(odd2);
    assert_text(s, "graph():\n"
                   "    %'a b' : f32[2]  # None\n"
                   "    %noval : None  # PlainAOTInput(idx=1)\n"
                   "    %\"it's\" = neg(%'a b')  # f32[2]  k1=None  k2=True  k3=-7  k4=1e+300  "
                   "k5='\\t\\udcff€😀\\x7f'  'odd key'=0.1  seq_nr='x'  "
                   "stack_trace='line 1\\n\\nline 3'\n"
                   "    %_1 = _to_copy(%\"it's\", dtype=torch.float64)  # f64[2]\n"
                   "    %cat = cat([%_1, %_1], -1)  # f64[4]\n"
                   "    return (%cat, %\"it's\")\n");
    ag_free(s);
    /* A graph built with such values prints them the same way. */
    ag_graph *g = ag_graph_new();
    ag_node *x = ph(g, "x y", AG_F64, 1, (int64_t[]){3}, NULL);
    ag_node *m = call(g, "mul.Scalar", (ag_garg[]){AG_GA_N(x), AG_GA_F(0.1)}, 2);
    ag_node *m2 = call(g, "mul.Scalar", (ag_garg[]){AG_GA_N(m), AG_GA_F(-1e-300)}, 2);
    ag_node *m3 = call(g, "mul.Scalar", (ag_garg[]){AG_GA_N(m2), AG_GA_F(1.0 / 3.0)}, 2);
    ag_node *m4 = call(g, "mul.Scalar", (ag_garg[]){AG_GA_N(m3), AG_GA_F(NAN)}, 2);
    ag_node *m5 = call(g, "mul.Scalar", (ag_garg[]){AG_GA_N(m4), AG_GA_F(-INFINITY)}, 2);
    ag_node *m6 = call(g, "mul.Scalar", (ag_garg[]){AG_GA_N(m5), AG_GA_F(100.0)}, 2);
    ag_node *m7 = call(g, "mul.Scalar", (ag_garg[]){AG_GA_N(m6), AG_GA_I(3)}, 2);
    ag_node_set_stack_trace(m7, "trailing newline\n");
    ag_node_set_stack_trace(m6, "  File \"a\\b.c\", line 1, in f\n    #define X 1");
    double dv[3] = {0.1, 5e-324, -1.7976931348623157e308};
    ag_tensor *c = ag_from_data(AG_F64, 1, (int64_t[]){3}, dv);
    ag_node *k = ag_graph_get_attr(g, c, "k");
    ag_tensor_free(c);
    bool bv[2] = {true, false};
    c = ag_from_data(AG_BOOL, 1, (int64_t[]){2}, bv);
    ag_node *k2 = ag_graph_get_attr(g, c, "k2");
    ag_tensor_free(c);
    c = ag_from_data(AG_I64, 0, NULL, (int64_t[]){INT64_MIN});
    ag_node *k3 = ag_graph_get_attr(g, c, "k3");
    ag_tensor_free(c);
    ag_graph_output(g, (ag_node *[]){m7, k, k2, k3}, 4);
    s = print_g(g, true, true);
    const char *want =
        "graph():\n"
        "    %'x y' : f64[3]  # None\n"
        "    %mul = mul.Scalar(%'x y', 0.1)  # f64[3]\n"
        "    %mul_1 = mul.Scalar(%mul, -1e-300)  # f64[3]\n"
        "    %mul_2 = mul.Scalar(%mul_1, 0.3333333333333333)  # f64[3]\n"
        "    %mul_3 = mul.Scalar(%mul_2, nan)  # f64[3]\n"
        "    %mul_4 = mul.Scalar(%mul_3, -inf)  # f64[3]\n"
        "    %mul_5 = mul.Scalar(%mul_4, 1e+02)  # f64[3]\n"
        "          File \"a\\b.c\", line 1, in f\n"
        "            #define X 1\n"
        "    %mul_6 = mul.Scalar(%mul_5, 3)  # f64[3]  stack_trace='trailing newline\\n'\n"
        "    %k = get_attr(k)  # f64[3]\n"
        "    %k2 = get_attr(k2)  # b8[2]\n"
        "    %k3 = get_attr(k3)  # i64[]\n"
        "    return (%mul_6, %k, %k2, %k3)\n"
        "\n"
        "constant k : f64[3] = [0.1, 5e-324, -1.7976931348623157e+308]\n"
        "constant k2 : b8[2] = [True, False]\n"
        "constant k3 : i64[] = [-9223372036854775808]\n";
    assert_text(s, want);
    char *s2 = roundtrip(s);
    assert_text(s2, want);
    ag_free(s2);
    ag_free(s);
    ag_graph *g2 = ag_graph_parse(want, strlen(want));
    assert_non_null(g2);
    const ag_garg *a = ag_node_arg(ag_graph_find(g2, "mul_2"), 1);
    assert_true(a->kind == AG_GA_FLOAT && a->u.f == 1.0 / 3.0);
    assert_true(ag_node_arg(ag_graph_find(g2, "mul_6"), 1)->kind == AG_GA_INT);
    assert_string_equal(ag_node_stack_trace(ag_graph_find(g2, "mul_6")), "trailing newline\n");
    int64_t kv;
    memcpy(&kv, ag_tensor_data(ag_node_constant(ag_graph_find(g2, "k3"))), 8);
    assert_true(kv == INT64_MIN);
    ag_graph_free(g2);
    ag_graph_free(g);

    /* Keyword-only arguments may be given positionally; they print by name. */
    s = roundtrip("graph():\n    %a : f32[2]\n    %b = add.Tensor(%a, %a, 2)\n    return (%b,)\n");
    assert_text(s, "graph():\n"
                   "    %a : f32[2]  # None\n"
                   "    %b = add.Tensor(%a, %a, alpha=2)  # f32[2]\n"
                   "    return (%b,)\n");
    ag_free(s);
    /* A node's metadata maps are bounded. */
    char *many = malloc(40000);
    strcpy(many, "graph():\n    %a : f32[2]  # None  {");
    for (int i = 0; i < 1025; i++)
        sprintf(many + strlen(many), "%s'k%d': %d", i ? ", " : "", i, i);
    strcat(many, "}\n    return (%a,)\n");
    ag_graph *gm = ag_graph_parse(many, strlen(many));
    assert_null(gm);
    assert_non_null(strstr(ag_last_error(), ": more than 1024 custom annotations on one node"));
    free(many);

    /* An empty graph; constants defined before their use is not required. */
    assert_roundtrip("graph():\n    return ()\n");
    assert_roundtrip("graph():\n"
                     "    %c = get_attr(c)  # f32[]\n"
                     "    return (%c, None)  # None  is_forward\n"
                     "\n"
                     "constant c : f32[] = [1.5]\n");
}

/* A view constant and a constant shared by two get_attr nodes, parsed from hand-written text. */
static void test_constants(void **state) {
    (void)state;
    const char *text = "graph():\n"
                       "    %a = get_attr(shared)  # f32[2, 2]\n"
                       "    %b = get_attr(shared)  # f32[2, 2]\n"
                       "    %v = get_attr(view)  # f32[2]{2}+1\n"
                       "    return (%a, %b, %v)\n"
                       "# constants may come in any order\n"
                       "constant view : f32[2]{2}+1 = [1, 2.0]\n"
                       "constant shared : f32[2, 2] = [1, 2, 3, 4]\n";
    ag_graph *g = ag_graph_parse(text, strlen(text));
    if (!g)
        fail_msg("%s", ag_last_error());
    assert_int_equal(ag_graph_verify(g), 0);
    ag_tensor *a = ag_node_constant(ag_graph_find(g, "a"));
    assert_ptr_equal(a, ag_node_constant(ag_graph_find(g, "b")));
    tu_assert_values(a, 2, (int64_t[]){2, 2}, (double[]){1, 2, 3, 4}, 0);
    ag_tensor *v = ag_node_constant(ag_graph_find(g, "v"));
    assert_int_equal(ag_tensor_offset(v), 1);
    tu_assert_values(v, 1, (int64_t[]){2}, (double[]){1, 2}, 0);
    char *s = ag_graph_to_string(g, NULL);
    assert_text(s, "graph():\n"
                   "    %a = get_attr(a)  # f32[2, 2]\n"
                   "    %b = get_attr(b)  # f32[2, 2]\n"
                   "    %v = get_attr(v)  # f32[2]{2}+1\n"
                   "    return (%a, %b, %v)\n"
                   "\n"
                   "constant a : f32[2, 2] = [1.0, 2.0, 3.0, 4.0]\n"
                   "constant b : f32[2, 2] = [1.0, 2.0, 3.0, 4.0]\n"
                   "constant v : f32[2]{2}+1 = [1.0, 2.0]\n");
    ag_free(s);
    ag_graph_free(g);

    const char *head = "graph():\n    %a = get_attr(c)  # f32[2]\n    return (%a,)\n\n";
    char buf[512];
    snprintf(buf, sizeof buf, "%sconstant c : f32[2] = [1.0]\n", head);
    assert_parse_error(buf, "line 5:23: constant c: 1 values for the 2 elements of its VAL");
    snprintf(buf, sizeof buf, "%sconstant c : f32[2] = [1.0, 2, 3]\n", head);
    assert_parse_error(buf, "line 5:23: constant c: more values than the 2 elements of its VAL");
    snprintf(buf, sizeof buf, "%sconstant c : i64[2] = [1, 2.5]\n", head);
    assert_parse_error(buf, "line 5:27: expected an int, got a float");
    snprintf(buf, sizeof buf, "%sconstant c : f32[2] = [1, 2]\nconstant c : f32[2] = [1, 2]\n",
             head);
    assert_parse_error(buf, "line 6:1: duplicate constant c (first on line 5)");
    /* The VAL in the node line must be the constant's. */
    snprintf(buf, sizeof buf,
             "graph():\n    %%a = get_attr(c)  # f32[3]\n    return (%%a,)\n"
             "constant c : f32[2] = [1, 2]\n");
    assert_parse_error(buf, "line 2:25: %a: VAL f32[3] does not match the inferred f32[2]");
    /* Enormous shapes allocate nothing: the values must be there. */
    snprintf(buf, sizeof buf, "%sconstant c : f32[1000000000, 1000000] = [1]\n", head);
    assert_parse_error(buf, "line 5:41: constant c: 1 values for the 1000000000000000 elements "
                            "of its VAL");
    snprintf(buf, sizeof buf, "%sconstant c : f32[2]{1000000000000}+5 = [1, 2]\n", head);
    assert_parse_error(buf, "line 5:14: constant c: its strides and offset span 1000000000006 "
                            "elements for 2 values");
    snprintf(buf, sizeof buf, "%sconstant c : f32[1, 1, 1, 1, 1, 1, 1, 1, 1] = [1]\n", head);
    assert_parse_error(buf, "line 5:42: more than 8 dimensions");
    snprintf(buf, sizeof buf, "%sconstant c : f32[4503599627370497] = [1]\n", head);
    assert_parse_error(buf, "line 5:18: size 4503599627370497 out of range");
    snprintf(buf, sizeof buf, "%sconstant c : f32[134217728, 67108864] = [1]\n", head);
    assert_parse_error(buf, "line 5:14: VAL too large (more than 2^52 elements)");
}

/* Errors: exact line:column and message. */
static void test_parse_errors(void **state) {
    (void)state;
    const char *base_lines[] = {
        "graph():\n",
        "    %x : f32[4, 3]  # PlainAOTInput(idx=0)\n",
        "    %w : f32[2, 3]  # ParamAOTInput(target='w')\n",
        "    %t = t(%w)  # f32[3, 2]{1, 3}\n",
        "    %mm = mm(%x, %t)  # f32[4, 2]\n",
        "    return (%mm,)  # [PlainAOTOutput(idx=0)]\n",
    };
    char good[1024] = "";
    for (size_t i = 0; i < 6; i++)
        strcat(good, base_lines[i]);
    char *s = roundtrip(good);
    assert_text(s, good);
    ag_free(s);

    /* Each case replaces one line of the good text. */
    static const struct {
        int line; /* 1-based line replaced (0: appended) */
        const char *text;
        const char *msg;
    } cases[] = {
        {5, "    %mm = adm(%x, %t)  # f32[4, 2]\n", "line 5:11: unknown op 'adm'"},
        {5, "    %mm = mm(%x, %foo)  # f32[4, 2]\n", "line 5:18: unknown node %foo"},
        {4, "    %t = t(%mm)  # f32[3, 2]{1, 3}\n",
         "line 4:12: %mm is used before its definition on line 5"},
        {5, "    %mm = mm(%x, %t)  # f32[4, 3]\n",
         "line 5:25: %mm: VAL f32[4, 3] does not match the inferred f32[4, 2]"},
        {5, "    %mm = mm(%t, %x)  # f32[4, 2]\n",
         "line 5:5: %mm: mm: size mismatch: [3, 2] @ [4, 3]"},
        {3, "    %w : f32[2, 3]  # ParamAOTInput(target='w)\n",
         "line 3:44: bad descriptor: unterminated string literal for 'target'"},
        {3, "    %w : f32[2, 3]  # ParamAOTInput(targt='w')\n",
         "line 3:37: bad descriptor: expected 'target=': ParamAOTInput has no field 'targt'"},
        {3, "    %w : f32[2, 3]  # PlainAOTOutput(idx=0)\n",
         "line 3:23: %w: a placeholder takes an input descriptor (...AOTInput)"},
        {4, "    %x = t(%w)  # f32[3, 2]{1, 3}\n",
         "line 4:5: duplicate node name %x (first defined on line 2)"},
        {6, "    # no return\n", "line 7:1: expected 'return', got end of input"},
        {0, "garbage\n", "line 7:1: expected end of input or 'constant', got 'garbage'"},
        {0, "    %late = t(%w)\n", "line 7:5: expected end of input or 'constant', got '%'"},
        {5, "    %mm = mm(%x, %t)  # f32[4, 2]  bogus\n",
         "line 5:36: expected a metadata item, got 'bogus'"},
        {5, "    %mm = mm(%x, %t) trailing\n",
         "line 5:22: expected '#' or end of line, got 'trailing'"},
        {1, "graph()\n", "line 1:8: expected 'graph():', got end of line"},
        {2, "    %x : f32[4, 3]  # PlainAOTInput(idx=0)\n    %y : f32[2]\n", NULL},
        {5, "    %mm = mm(%x, %t, 3)  # f32[4, 2]\n", "line 5:22: mm takes 2 arguments"},
        {5, "    %mm = mm(%x, mat3=%t)  # f32[4, 2]\n", "line 5:18: mm has no argument 'mat3'"},
        {5, "    %mm = mm(self=%x, %t)  # f32[4, 2]\n",
         "line 5:23: positional argument after keyword arguments"},
        {5, "    %mm = mm(%x, self=%x)  # f32[4, 2]\n", "line 5:18: argument 'self' given twice"},
        {5, "    %mm = mm(%x, 99999999999999999999)  # f32[4, 2]\n",
         "line 5:18: integer out of range"},
        {5, "    %mm = mm(%x, %t)  # f32[4, -2]\n", "line 5:32: size -2 out of range"},
        {5, "    %mm = mm(%x, %t)  # g32[4, 2]\n",
         "line 5:25: expected a VAL (f32, f64, i64 or b8 and its sizes), got 'g32'"},
        {5, "    %mm = mm(%x, %t)  # f32[4, 2]  recompute=SOMETIMES\n",
         "line 5:46: expected MUST_SAVE, PREFER_SAVE, MUST_RECOMPUTE or PREFER_RECOMPUTE, got "
         "'SOMETIMES'"},
        {5, "    %mm = mm(%x, %t)  # f32[4, 2]  {'a': None}\n",
         "line 5:42: custom annotation 'a' may not be None"},
        {5, "    %output = mm(%x, %t)  # f32[4, 2]\n",
         "line 5:5: the name %output is reserved for the output node"},
        {6, "    return (%mm,)  # [PlainAOTOutput(idx=0), None]\n",
         "line 6:22: 2 descriptors for 1 outputs"},
        {6, "    return (%mm,)  # [PlainAOTInput(idx=0)]\n",
         "line 6:23: output 0: an output takes an output descriptor (...AOTOutput)"},
        {4, "    %t = t(%w)  # f32[3, 2]{1, 3}\n    %y : f32[2]\n",
         "line 5:5: placeholder %y after other nodes (placeholders come first)"},
        {4, "    %t = getitem(%w, 0)  # f32[3, 2]\n", "line 4:5: %t: getitem: w has no output 0"},
        {4, "    %t = get_attr(nope)  # f32[3, 2]\n",
         "line 4:19: unknown attribute 'nope' (no `constant nope` line or `subgraph nope():` "
         "block)"},
        {5, "    %mm = mm(%x, 't)  # f32[4, 2]\n", "line 5:18: unterminated string"},
        {5, "    %mm = mm(%x, '\\q\\xZZ')  # f32[4, 2]\n",
         "line 5:21: bad \\x escape: expected 2 hex digits"},
        {5, "    %mm = mm(%x, torch.half)  # f32[4, 2]\n",
         "line 5:24: expected float32, float64, int64 or bool, got 'half'"},
        {5, "    %mm = mm(%x, [1, %t])  # f32[4, 2]\n", "line 5:22: expected a number, got '%'"},
        {5, "    %mm = mm(%x, 1e)  # f32[4, 2]\n", "line 5:20: expected exponent digits, got ')'"},
        {5, "    %mm = mm(%x, %t)  # f32[4, 2]{1}\n", "line 5:25: 1 strides for 2 sizes"},
        {5, "    %mm = mm(%x, %t)  # (f32[4, 2]\n",
         "line 5:35: expected ',' or ')', got end of line"},
        {5, "\tgarbage\n", "line 5:1: expected an indented node line or 'return', got byte 0x09"},
        {6, "    %ln = native_layer_norm(%x, [3], None, None, 1e-05)\n    return (%mm, %ln)\n",
         "line 7:18: %ln has 3 outputs: return one through getitem"},
        /* An output too large for any tensor is refused by the op's size check. */
        {5, "    %mm = expand(%x, [4611686018427387904, 4, 3])\n",
         "line 5:5: %mm: expand: output 0 of shape [4611686018427387904, 4, 3] has too many "
         "elements"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        char text[2048] = "";
        for (int i = 0; i < 6; i++)
            strcat(text, cases[k].line == i + 1 ? cases[k].text : base_lines[i]);
        if (cases[k].line == 0)
            strcat(text, cases[k].text);
        if (!cases[k].msg) {
            ag_graph *g = ag_graph_parse(text, strlen(text));
            if (!g)
                fail_msg("case %zu: %s", k, ag_last_error());
            ag_graph_free(g);
            continue;
        }
        ag_graph *g = ag_graph_parse(text, strlen(text));
        if (g) {
            ag_graph_free(g);
            fail_msg("case %zu parsed; expected: %s", k, cases[k].msg);
        }
        if (strcmp(ag_last_error(), cases[k].msg))
            fail_msg("case %zu\n got: %s\nwant: %s", k, ag_last_error(), cases[k].msg);
    }
    /* Bytes the text may not hold, and input that is not even a graph. */
    char nul[] = "graph():\n    %x : f32[2]\0\n";
    assert_null(ag_graph_parse(nul, sizeof nul - 1));
    assert_string_equal(ag_last_error(), "line 2:16: unexpected NUL byte");
    assert_parse_error("", "line 1:1: expected 'graph():', got end of line");
    assert_parse_error("graph():", "line 1:9: expected 'return', got end of input");
}

/* Every allocation of a parse and a print may fail: ENOMEM, nothing leaked. */
static int parse_print_scenario(void *ud) {
    const char *text = ud;
    ag_graph *g = ag_graph_parse(text, strlen(text));
    if (!g)
        return ag_last_status();
    ag_print_opts o = {.seq_nr = true, .stack_trace = true};
    char *s = ag_graph_to_string(g, &o);
    int rc = 0;
    if (!s) {
        rc = ag_last_status();
    } else {
        char *d = ag_graph_to_dot(g, NULL);
        if (!d)
            rc = ag_last_status();
        ag_free(d);
    }
    ag_free(s);
    ag_graph_free(g);
    return rc;
}

static void test_alloc_failures(void **state) {
    (void)state;
    tu_sweep_opts o = {.what = "parse+print", .one_thread = true};
    int64_t n = tu_alloc_failure_sweep(parse_print_scenario, (void *)reference_full, &o);
    assert_true(n > 50);
}

/* Printing is linear: a 20k-node chain prints and parses back. */
static void test_large_graph(void **state) {
    (void)state;
    ag_graph *g = ag_graph_new();
    ag_node *x = ph(g, "x", AG_F32, 2, (int64_t[]){4, 4}, NULL);
    const ag_op *relu = ag_op_find("relu");
    assert_non_null(relu);
    ag_node *n = x;
    for (int i = 0; i < 20000; i++) {
        n = ag_graph_call(g, relu, (ag_garg[]){AG_GA_N(n)}, 1, NULL);
        assert_non_null(n);
        ag_node_set_seq_nr(n, i);
    }
    ag_graph_output(g, &n, 1);
    char *s = print_g(g, true, true);
    assert_non_null(strstr(s, "    %relu_19999 = relu(%relu_19998)  # f32[4, 4]  seq_nr=19999\n"));
    char *s2 = roundtrip(s);
    assert_string_equal(s, s2);
    ag_free(s);
    ag_free(s2);
    ag_graph_free(g);
}

/* The fuzz corpus parses or fails cleanly (the ASan build checks for leaks and overflows);
 * what parses is a fixed point of print/parse. */
static void test_corpus_replay(void **state) {
    (void)state;
    DIR *d = opendir("fuzz/corpus");
    if (!d)
        fail_msg("fuzz/corpus not found (run the test from the repository root)");
    int files = 0, parsed = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.')
            continue;
        char path[1024];
        snprintf(path, sizeof path, "fuzz/corpus/%s", e->d_name);
        FILE *f = fopen(path, "rb");
        assert_non_null(f);
        fseek(f, 0, SEEK_END);
        long n = ftell(f);
        rewind(f);
        char *buf = malloc((size_t)n + 1);
        assert_int_equal(fread(buf, 1, (size_t)n, f), (size_t)n);
        fclose(f);
        files++;
        ag_graph *g = ag_graph_parse(buf, (size_t)n);
        if (g) {
            parsed++;
            if (ag_graph_verify(g))
                fail_msg("%s: parsed but does not verify: %s", path, ag_last_error());
            char *s = print_g(g, true, true);
            char *s2 = roundtrip(s);
            if (strcmp(s, s2))
                fail_msg("%s: not a fixed point", path);
            ag_free(s);
            ag_free(s2);
            /* and with the module stacks (fuzz_parse prints them too) */
            ag_print_opts all = {.seq_nr = true, .stack_trace = true, .module_stack = true};
            s = ag_graph_to_string(g, &all);
            ag_graph *g2 = ag_graph_parse(s, strlen(s));
            if (!g2)
                fail_msg("%s: printed with module stacks, does not parse: %s", path,
                         ag_last_error());
            s2 = ag_graph_to_string(g2, &all);
            if (strcmp(s, s2))
                fail_msg("%s: not a fixed point with module stacks", path);
            ag_free(s);
            ag_free(s2);
            ag_graph_free(g2);
            ag_graph_free(g);
        } else if (strncmp(ag_last_error(), "line ", 5)) {
            fail_msg("%s: error without a position: %s", path, ag_last_error());
        }
        free(buf);
    }
    closedir(d);
    assert_true(files >= 8);
    assert_true(parsed >= 8);
}

/* ---- bounds on the input ---- */

/* Text that is huge, binary or endless is refused at its first offending byte, before the
 * parser copies it: a reader of /dev/zero or of an endless line stops at
 * AG_GRAPH_TEXT_MAX + 1 bytes and gets a message. The large inputs are anonymous mappings of
 * untouched pages (the parser must not read, let alone copy, what it refuses). */
static void test_parse_bounds(void **state) {
    (void)state;
    /* NUL bytes: endless zeros, and one inside a line. */
    size_t big = AG_GRAPH_TEXT_MAX + 1;
    char *zeros = mmap(NULL, big, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    assert_true(zeros != MAP_FAILED);
    assert_null(ag_graph_parse(zeros, 4096));
    assert_int_equal(ag_last_status(), AG_EFORMAT);
    assert_string_equal(ag_last_error(), "line 1:1: unexpected NUL byte");
    assert_null(ag_graph_parse(zeros, AG_GRAPH_TEXT_MAX));
    assert_string_equal(ag_last_error(), "line 1:1: unexpected NUL byte");
    const char nul[] = "graph():\n    %x : f32[2]\0  # PlainAOTInput(idx=0)\n";
    assert_null(ag_graph_parse(nul, sizeof nul - 1));
    assert_string_equal(ag_last_error(), "line 2:16: unexpected NUL byte");
    /* More than AG_GRAPH_TEXT_MAX bytes: refused by their count alone. */
    assert_null(ag_graph_parse(zeros, big));
    assert_int_equal(ag_last_status(), AG_EFORMAT);
    tu_assert_error_contains("the text is 1073741825 bytes; a graph text may have at most "
                             "1073741824");
    munmap(zeros, big);

    /* One endless line (64 MiB without a newline): a clean error at its start. */
    size_t n = (size_t)64 << 20;
    char *line = malloc(n);
    assert_non_null(line);
    memset(line, 'x', n);
    assert_null(ag_graph_parse(line, n));
    tu_assert_error_contains("line 1:1: expected");
    free(line);

    /* Lines: AG_GRAPH_TEXT_MAX_LINES of them (a trailing newline ends the last) are read;
     * one more is refused, naming the first line beyond the limit. */
    const char head[] = "graph():\n    return ()\n";           /* two lines, then blank ones */
    n = sizeof head - 1 + (size_t)AG_GRAPH_TEXT_MAX_LINES - 1; /* 2^24 + 1 newlines */
    char *nls = malloc(n);
    assert_non_null(nls);
    memcpy(nls, head, sizeof head - 1);
    memset(nls + sizeof head - 1, '\n', n - (sizeof head - 1));
    ag_graph *g = ag_graph_parse(nls, n - 1);
    if (!g)
        fail_msg("%d lines: %s", AG_GRAPH_TEXT_MAX_LINES, ag_last_error());
    ag_graph_free(g);
    assert_null(ag_graph_parse(nls, n));
    assert_int_equal(ag_last_status(), AG_EFORMAT);
    assert_string_equal(ag_last_error(), "line 16777217:1: more than 16777216 lines");
    free(nls);
}

/* ---- every zoo graph reads back ---- */

static const ag_print_opts zoo_print_opts[] = {
    {0},
    {.seq_nr = true},
    {.stack_trace = true},
    {.seq_nr = true, .stack_trace = true},
    {.no_custom = true},
    {.no_meta = true},
    {.seq_nr = true, .stack_trace = true, .no_custom = true, .no_meta = true},
    {.module_stack = true},
    {.seq_nr = true, .stack_trace = true, .module_stack = true},
    {.module_stack = true, .no_custom = true, .no_meta = true},
};

/* print(parse(print(g))) == print(g) under every printing option; what = the graph's name. */
static void assert_zoo_roundtrip(const ag_graph *g, const char *what) {
    for (size_t k = 0; k < sizeof zoo_print_opts / sizeof zoo_print_opts[0]; k++) {
        const ag_print_opts *o = &zoo_print_opts[k];
        char *s = ag_graph_to_string(g, o);
        if (!s)
            fail_msg("%s: print: %s", what, ag_last_error());
        ag_graph *g2 = ag_graph_parse(s, strlen(s));
        if (!g2)
            fail_msg("%s (print options %zu): parse: %s\n%s", what, k, ag_last_error(), s);
        if (ag_graph_verify(g2))
            fail_msg("%s (print options %zu): verify: %s", what, k, ag_last_error());
        char *s2 = ag_graph_to_string(g2, o);
        assert_text(s2, s);
        ag_free(s);
        ag_free(s2);
        ag_graph_free(g2);
    }
}

/* Every zoo model in every configuration, as `aotgrad trace`, `export` (with and without
 * --decompose core) and `partition` (both partitioners) print it: the model built in meta mode,
 * the kwargs model's last input passed as the kwarg `scale`. */
static void test_zoo_roundtrip(void **state) {
    (void)state;
    ag_decomp_table *core = ag_decomp_table_core();
    assert_non_null(core);
    int graphs = 0;
    for (int i = 0; i < ag_zoo_count(); i++) {
        const char *name = ag_zoo_name(i);
        char configs[256];
        snprintf(configs, sizeof configs, "%s", ag_zoo_configs(i));
        for (char *save = NULL, *cfg = strtok_r(configs, ", ", &save); cfg;
             cfg = strtok_r(NULL, ", ", &save)) {
            ag_module *m = NULL;
            ag_tensor *in[4] = {0};
            int nin = 0;
            bool prev = ag_set_meta_mode(true);
            int rc = ag_zoo_build(name, strcmp(cfg, "default") ? cfg : NULL, &m, in, 4, &nin);
            ag_set_meta_mode(prev);
            if (rc)
                fail_msg("%s %s: build: %s", name, cfg, ag_last_error());
            char what[128];
            /* Tracing takes plain tensors (the export flattens subclasses): two_tensor's
             * parameters are TwoTensors. */
            bool plain = true;
            for (int k = 0; k < nin; k++)
                plain = plain && !ag_tensor_subclass(in[k]);
            ag_named_tensors ps;
            assert_int_equal(ag_module_named_parameters(m, true, &ps), 0);
            for (int k = 0; k < ps.n; k++)
                plain = plain && !ag_tensor_subclass(ps.tensors[k]);
            ag_named_tensors_free(&ps);
            if (plain) {
                ag_graph *g = ag_trace_module(m, in, nin, NULL);
                if (!g)
                    fail_msg("%s %s: trace: %s", name, cfg, ag_last_error());
                snprintf(what, sizeof what, "%s %s trace", name, cfg);
                assert_zoo_roundtrip(g, what);
                ag_graph_free(g);
                graphs++;
            }
            int nkw = !strcmp(name, "kwargs") ? 1 : 0;
            const char *const kw[] = {"scale"};
            for (int dec = 0; dec < 2; dec++) {
                ag_export_opts eo = {.decompositions = dec ? core : NULL};
                ag_joint *j =
                    ag_export_joint(m, in, nin - nkw, nkw ? kw : NULL, in + nin - nkw, nkw, &eo);
                if (!j)
                    fail_msg("%s %s: export: %s", name, cfg, ag_last_error());
                snprintf(what, sizeof what, "%s %s export%s", name, cfg,
                         dec ? " --decompose core" : "");
                assert_zoo_roundtrip(ag_joint_graph(j), what);
                graphs++;
                for (int pk = 0; pk < 2 && !dec; pk++) {
                    ag_partition_opts po = {.partitioner =
                                                pk ? AG_PARTITION_MINCUT : AG_PARTITION_DEFAULT,
                                            .memory_budget = 1.0};
                    ag_graph *fw = NULL, *bw = NULL;
                    if (ag_partition(ag_joint_graph(j), ag_joint_num_fw_outputs(j), &po, &fw, &bw,
                                     NULL))
                        fail_msg("%s %s: partition: %s", name, cfg, ag_last_error());
                    snprintf(what, sizeof what, "%s %s partition %d forward", name, cfg, pk);
                    assert_zoo_roundtrip(fw, what);
                    snprintf(what, sizeof what, "%s %s partition %d backward", name, cfg, pk);
                    assert_zoo_roundtrip(bw, what);
                    ag_graph_free(fw);
                    ag_graph_free(bw);
                    graphs += 2;
                }
                ag_joint_free(j);
            }
            for (int k = 0; k < nin; k++)
                ag_tensor_free(in[k]);
            ag_module_free(m);
        }
    }
    ag_decomp_table_free(core);
    assert_true(graphs >= 6 * ag_zoo_count());
}

/* The same through the CLI, whose process has registered nothing before `show` reads the file:
 * `aotgrad show` prints back exactly what `trace` and `export` wrote (the effects model's graph
 * names the zoo's custom op, aotgrad_demo::log_value, which `show` did not know). */
static void test_cli_show_reads_exports(void **state) {
    (void)state;
    if (!tu_cli_setup("/tmp/ag_test_text_XXXXXX"))
        skip();
    const char *cmds[] = {"trace effects",
                          "export effects",
                          "export effects --decompose core",
                          "export effects --seq-nr --stack-traces",
                          "export two_tensor",
                          "export kwargs --seq-nr",
                          "export dropout_mlp --decompose core",
                          "export gpt2 --config gpt2-small --stack-traces"};
    char args[512];
    for (size_t k = 0; k < sizeof cmds / sizeof cmds[0]; k++) {
        snprintf(args, sizeof args, "%s -o '%s/g.txt'", cmds[k], tu_cli_dir());
        if (tu_cli_run(args))
            fail_msg("aotgrad %s failed:\n%s", cmds[k], tu_cli_read("err"));
        snprintf(args, sizeof args, "show '%s/g.txt'", tu_cli_dir());
        if (tu_cli_run(args))
            fail_msg("aotgrad show of `aotgrad %s` failed:\n%s", cmds[k], tu_cli_read("err"));
        char *want = tu_cli_read("g.txt"), *got = tu_cli_read("out");
        assert_text(got, want);
        free(want);
        free(got);
    }
    const char *names[] = {"g.txt", "out", "err"};
    tu_cli_cleanup(names, 3);
}

/* ---- DOT and SVG ---- */

static void test_dot(void **state) {
    (void)state;
    ag_graph *g = build_reference();
    /* A name that needs every escape. */
    ag_node *x = ag_graph_find(g, "primals_3");
    ag_node *odd =
        ag_graph_call(g, ag_op_find("neg"), (ag_garg[]){AG_GA_N(x)}, 1, "a\"b\\c{d}|<e>");
    assert_non_null(odd);
    const char *hl[] = {"addmm", "nonexistent"};
    ag_dot_opts o = {.title = "ref \"graph\"", .highlight = hl, .nhighlight = 2};
    char *d = ag_graph_to_dot(g, &o);
    assert_non_null(d);
    const char *want[] = {
        "digraph G {\n",
        "  label=\"ref \\\"graph\\\"\";\n",
        "  n0 [shape=ellipse, label=\"Param linear.weight\\n%primals_1\\nf32[2, 3]\", "
        "style=filled, "
        "fillcolor=\"#cfe2ff\"];\n",
        "  n2 [shape=ellipse, label=\"Plain 0\\n%primals_3\\nf32[4, 3]\", style=filled, "
        "fillcolor=\"#cfe2ff\"];\n",
        "  n3 [shape=ellipse, label=\"Tangent (Plain 0)\\n%tangents_1\\nf32[4, 2]\", style=filled, "
        "fillcolor=\"#ffd8a8\"];\n",
        "  n4 [shape=record, label=\"{%t|t|f32[3, 2]\\{1, 3\\}}\", style=filled, "
        "fillcolor=\"#cfe2ff\"];\n",
        "  n5 [shape=record, label=\"{%addmm|addmm|f32[4, 2]}\", style=filled, "
        "fillcolor=\"#cfe2ff\", penwidth=3, color=\"#d00000\"];\n",
        "  n7 [shape=record, label=\"{%getitem|getitem 0|f32[4, 3]}\"",
        "  n6 [shape=record, label=\"{%native_layer_norm|native_layer_norm|(f32[4, 3], f32[4, 1], "
        "f32[4, 1])}\"",
        "  n11 [shape=record, label=\"{%add|add.Tensor|f32[4, 2]}\", style=filled, "
        "fillcolor=\"#ffd8a8\"];\n",
        "  n12 [shape=record, label=\"{%sum_1|sum.dim_IntList|f32[1, 2]}\", style=filled, "
        "fillcolor=\"#ffd8a8\"];\n",
        "label=\"{%a\\\"b\\\\c\\{d\\}\\|\\<e\\>|neg|f32[4, 3]}\"",
        "shape=box, label=\"output\\n0: Plain 0\\n1: Grad (Plain 0)\\n2: None\\n3: Grad (Param "
        "linear.bias)\\n4: None\", style=filled, fillcolor=\"#e9ecef\"];\n",
        "  n0 -> n4;\n",
        "  n1 -> n5;\n  n2 -> n5;\n  n4 -> n5;\n",
        "  n3 -> n11;\n  n9 -> n11;\n",
        "legend_forward [shape=box, style=filled, fillcolor=\"#cfe2ff\", label=\"forward\"];\n",
        "legend_backward [shape=box, style=filled, fillcolor=\"#ffd8a8\", label=\"backward\"];\n",
        "legend_saved [shape=box, penwidth=3, color=\"#d00000\", label=\"saved\"];\n",
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
        if (!strstr(d, want[i]))
            fail_msg("missing fragment:\n%s\n--- dot ---\n%s", want[i], d);
    /* The output node's edges, one per distinct source. */
    assert_non_null(strstr(d, "  n5 -> n14;\n  n11 -> n14;\n  n12 -> n14;\n  n10 -> n14;\n"));
    assert_int_equal(strstr(d, "penwidth=3") - d,
                     strstr(d, "penwidth=3, color=\"#d00000\"];\n  n6") - d);
    ag_free(d);
    /* Without options: no title, no highlight in the legend. */
    d = ag_graph_to_dot(g, NULL);
    assert_null(strstr(d, "label=\"saved\""));
    assert_null(strstr(d, "labelloc"));
    ag_free(d);
    ag_graph_free(g);
}

static bool have_dot(void) {
    const char *path = getenv("PATH");
    if (!path)
        return false;
    char buf[4096];
    snprintf(buf, sizeof buf, "%s", path);
    for (char *dir = strtok(buf, ":"); dir; dir = strtok(NULL, ":")) {
        char p[4200];
        snprintf(p, sizeof p, "%s/dot", dir);
        if (access(p, X_OK) == 0)
            return true;
    }
    return false;
}

static void test_svg(void **state) {
    (void)state;
    ag_graph *g = build_reference();
    char dir[] = "/tmp/ag_svg_XXXXXX";
    assert_non_null(mkdtemp(dir));
    /* Shell metacharacters in the path are just characters: no shell runs. */
    char path[256];
    snprintf(path, sizeof path, "%s/a b;touch x$(echo y).svg", dir);
    if (have_dot()) {
        if (ag_graph_write_svg(g, path, NULL))
            fail_msg("%s", ag_last_error());
        FILE *f = fopen(path, "r");
        assert_non_null(f);
        char head[4096];
        size_t n = fread(head, 1, sizeof head - 1, f);
        head[n] = 0;
        fclose(f);
        assert_non_null(strstr(head, "<svg"));
        char stray[300];
        snprintf(stray, sizeof stray, "%s/xy.svg", dir);
        assert_int_not_equal(access(stray, F_OK), 0);
        /* dot's own failure (a directory that does not exist) is reported. */
        snprintf(path, sizeof path, "%s/no/such/dir.svg", dir);
        assert_int_equal(ag_graph_write_svg(g, path, NULL), AG_EIO);
        tu_assert_error_contains("write_svg: dot -Tsvg -o ");
        snprintf(path, sizeof path, "%s/a b;touch x$(echo y).svg", dir);
        unlink(path);
    } else {
        print_message("graphviz not installed: skipping the SVG rendering check\n");
    }
    /* Without dot on PATH: a clear message. */
    char *old = getenv("PATH") ? strdup(getenv("PATH")) : NULL;
    setenv("PATH", "/nonexistent-dir", 1);
    assert_int_equal(ag_graph_write_svg(g, path, NULL), AG_ENOTSUP);
    tu_assert_error_contains("install the Debian package graphviz");
    if (old) {
        setenv("PATH", old, 1);
        free(old);
    }
    assert_int_equal(ag_graph_write_svg(g, NULL, NULL), AG_EINVAL);
    rmdir(dir);
    ag_graph_free(g);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_print_reference),
        cmocka_unit_test(test_parse_reference),
        cmocka_unit_test(test_roundtrip_built),
        cmocka_unit_test(test_parse_doc_example),
        cmocka_unit_test(test_corner_cases),
        cmocka_unit_test(test_constants),
        cmocka_unit_test(test_parse_errors),
        cmocka_unit_test(test_alloc_failures),
        cmocka_unit_test(test_large_graph),
        cmocka_unit_test(test_corpus_replay),
        cmocka_unit_test(test_parse_bounds),
        cmocka_unit_test(test_zoo_roundtrip),
        cmocka_unit_test(test_cli_show_reads_exports),
        cmocka_unit_test(test_dot),
        cmocka_unit_test(test_svg),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
