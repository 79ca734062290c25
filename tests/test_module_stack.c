/* Module stacks (nn_module_stack on traced nodes, fwd_nn_module_stack on the joint's backward
 * nodes; include/aotgrad/graph.h, "module stacks"), against stacks written by hand from the
 * models' structure and upstream's non-strict export conventions: GPT-2's joint (a block's
 * linear, nodes outside every submodule, placeholders, the output, backward nodes and
 * gradient accumulations), a model that calls one child twice, a grandchild, and a module
 * outside its tree; the stacks surviving a graph copy and the partitioner; the typed
 * accessors and setters; ag_node_meta_set's check of the text; and the text format (printed
 * only when asked, parsed back, bad stacks refused with their line and column; the CLI's
 * --module-stacks and show). */
#include "testutil.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static ag_node *find(const ag_graph *g, const char *name) {
    ag_node *n = ag_graph_find(g, name);
    if (!n)
        fail_msg("no node named %s", name);
    return n;
}

static const char *stack_text(const ag_node *n) {
    ag_mval v = ag_node_meta_get(n, "nn_module_stack");
    return v.kind == AG_MV_STR ? v.u.s : NULL;
}

static const char *fwd_text(const ag_node *n) {
    ag_mval v = ag_node_meta_get(n, "fwd_nn_module_stack");
    return v.kind == AG_MV_STR ? v.u.s : NULL;
}

static void expect_text(const char *got, const char *want, const char *what) {
    if (!want && got)
        fail_msg("%s: expected no stack, got %s", what, got);
    if (want && (!got || strcmp(got, want)))
        fail_msg("%s:\n  expected %s\n  got      %s", what, want, got ? got : "(none)");
}

/* ---- GPT-2's joint ---- */

#define ROOT "'L__self__': ('', 'GPT')"
#define BLOCK0 "'L__self__transformer.h.0': ('transformer.h.0', 'Block')"
#define ATTN0 "'L__self__transformer.h.0.attn': ('transformer.h.0.attn', 'CausalSelfAttention')"
#define C_ATTN0 "'L__self__transformer.h.0.attn.c_attn': ('transformer.h.0.attn.c_attn', 'Linear')"
#define LM_HEAD "'L__self__lm_head': ('lm_head', 'Linear')"

static ag_joint *export_gpt2(ag_module **m, ag_tensor **in, int *nin) {
    assert_int_equal(ag_zoo_build("gpt2", NULL, m, in, 4, nin), 0);
    ag_joint *j = ag_export_joint(*m, in, *nin, NULL, NULL, 0, NULL);
    if (!j)
        fail_msg("export gpt2: %s", ag_last_error());
    return j;
}

static void free_model(ag_module *m, ag_tensor **in, int nin) {
    for (int i = 0; i < nin; i++)
        ag_tensor_free(in[i]);
    ag_module_free(m);
}

static void test_gpt2_joint(void **st) {
    (void)st;
    ag_module *m;
    ag_tensor *in[4];
    int nin;
    ag_joint *j = export_gpt2(&m, in, &nin);
    const ag_graph *g = ag_joint_graph(j);
    /* the first block's attention input projection: GPT > Block > attention > Linear */
    ag_node *addmm = find(g, "addmm");
    expect_text(stack_text(addmm), "{" ROOT ", " BLOCK0 ", " ATTN0 ", " C_ATTN0 "}", "addmm");
    assert_int_equal(ag_node_nn_module_stack_len(addmm), 4);
    char *key, *path, *type;
    assert_int_equal(ag_node_nn_module_stack(addmm, 3, &key, &path, &type), 0);
    assert_string_equal(key, "L__self__transformer.h.0.attn.c_attn");
    assert_string_equal(path, "transformer.h.0.attn.c_attn");
    assert_string_equal(type, "Linear");
    ag_free(key);
    ag_free(path);
    ag_free(type);
    assert_int_equal(ag_node_nn_module_stack(addmm, 0, &key, &path, &type), 0);
    assert_string_equal(key, "L__self__");
    assert_string_equal(path, "");
    assert_string_equal(type, "GPT");
    ag_free(key);
    ag_free(path);
    ag_free(type);
    /* the attention's own ops (the split of c_attn's output) are not the Linear's */
    expect_text(stack_text(find(g, "split")), "{" ROOT ", " BLOCK0 ", " ATTN0 "}", "split");
    /* ops of the GPT's own forward: only the root */
    expect_text(stack_text(find(g, "arange")), "{" ROOT "}", "arange");
    expect_text(stack_text(find(g, "add")), "{" ROOT "}", "add (tok_emb + pos_emb)");
    /* a grandchild called directly (transformer is a ModuleDict nobody calls) */
    expect_text(stack_text(find(g, "embedding")),
                "{" ROOT ", 'L__self__transformer.wte': ('transformer.wte', 'Embedding')}",
                "embedding");
    /* placeholders and the output carry none */
    for (ag_node *n = ag_graph_first(g); n; n = ag_node_next(n))
        if (ag_node_kind_of(n) == AG_NODE_PLACEHOLDER || ag_node_kind_of(n) == AG_NODE_OUTPUT) {
            assert_int_equal(ag_node_nn_module_stack_len(n), 0);
            assert_int_equal(ag_node_fwd_nn_module_stack_len(n), 0);
        }
    /* backward nodes: no stack of their own; fwd_nn_module_stack is the stack of the first
     * forward node of their seq_nr, gradient accumulations get none */
    int with_fwd = 0, grad_acc = 0;
    for (ag_node *n = ag_graph_first(g); n; n = ag_node_next(n)) {
        const char *tag = ag_node_partitioner_tag(n);
        if (!tag || strcmp(tag, "is_backward") || ag_node_kind_of(n) == AG_NODE_PLACEHOLDER ||
            ag_node_kind_of(n) == AG_NODE_OUTPUT)
            continue;
        assert_null(stack_text(n));
        if (ag_node_is_gradient_acc(n)) {
            assert_null(fwd_text(n));
            grad_acc++;
            continue;
        }
        const ag_node *f = NULL;
        for (ag_node *k = ag_graph_first(g); k && !f; k = ag_node_next(k))
            if (ag_node_seq_nr(k) == ag_node_seq_nr(n) && ag_node_partitioner_tag(k) &&
                !strcmp(ag_node_partitioner_tag(k), "is_forward"))
                f = k;
        expect_text(fwd_text(n), f ? stack_text(f) : NULL, ag_node_name(n));
        with_fwd += fwd_text(n) != NULL;
    }
    assert_true(with_fwd > 100);
    assert_true(grad_acc > 0);
    /* lm_head's backward (written by hand) */
    expect_text(fwd_text(find(g, "mm_1")), "{" ROOT ", " LM_HEAD "}", "mm_1");
    assert_int_equal(ag_node_fwd_nn_module_stack(find(g, "mm_1"), 1, NULL, &path, NULL), 0);
    assert_string_equal(path, "lm_head");
    ag_free(path);
    ag_joint_free(j);
    free_model(m, in, nin);
}

/* A copy and the partitioned halves keep the stacks, sharing the text. */
static void test_copy_and_partition(void **st) {
    (void)st;
    ag_module *m;
    ag_tensor *in[4];
    int nin;
    ag_joint *j = export_gpt2(&m, in, &nin);
    const ag_graph *g = ag_joint_graph(j);
    ag_graph *c = ag_graph_copy(g);
    assert_non_null(c);
    assert_ptr_equal(stack_text(find(c, "addmm")), stack_text(find(g, "addmm")));
    assert_ptr_equal(fwd_text(find(c, "mm_1")), fwd_text(find(g, "mm_1")));
    ag_graph_free(c);
    ag_graph *fw = NULL, *bw = NULL;
    if (ag_partition(g, ag_joint_num_fw_outputs(j), NULL, &fw, &bw, NULL))
        fail_msg("partition: %s", ag_last_error());
    expect_text(stack_text(find(fw, "addmm")), "{" ROOT ", " BLOCK0 ", " ATTN0 ", " C_ATTN0 "}",
                "forward half's addmm");
    expect_text(fwd_text(find(bw, "mm_1")), "{" ROOT ", " LM_HEAD "}", "backward half's mm_1");
    ag_graph_free(fw);
    ag_graph_free(bw);
    ag_joint_free(j);
    free_model(m, in, nin);
}

/* ---- a model calling one child twice, a grandchild and a module outside its tree ---- */

static int inner_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out,
                         int max_out) {
    (void)nin, (void)max_out;
    out[0] = ag_tensor_keep(ag_module_forward(ag_module_child(m, "lin2"), in[0]));
    return out[0] ? 1 : ag_last_status();
}

static int twice_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out,
                         int max_out) {
    (void)nin, (void)max_out;
    ag_scope_begin();
    ag_module *lin = ag_module_child(m, "lin");
    ag_tensor *y = ag_module_forward(lin, in[0]);
    y = ag_relu(y);
    y = ag_module_forward(lin, y);
    y = ag_module_forward(ag_module_child(m, "inner"), y);
    y = ag_module_forward(ag_module_ud(m), y); /* a ReLU module registered nowhere */
    out[0] = ag_tensor_keep(y);
    ag_scope_end();
    return out[0] ? 1 : ag_last_status();
}

static void free_module(void *p) {
    ag_module_free(p);
}

static ag_module *twice_model(void) {
    ag_module *m = ag_module_new("Twice", twice_forward, ag_nn_relu(), free_module);
    ag_module *inner = ag_module_new("Inner", inner_forward, NULL, NULL);
    assert_non_null(m);
    assert_non_null(inner);
    assert_int_equal(ag_module_add_child(inner, "lin2", ag_nn_linear(3, 3, true)), 0);
    assert_int_equal(ag_module_add_child(m, "lin", ag_nn_linear(3, 3, true)), 0);
    assert_int_equal(ag_module_add_child(m, "inner", inner), 0);
    return m;
}

#define TROOT "'L__self__': ('', 'Twice')"

static void test_repeated_and_nested_calls(void **st) {
    (void)st;
    ag_module *m = twice_model();
    uint64_t seed = 5;
    ag_tensor *x = tu_rand_tensor(AG_F32, 2, (int64_t[]){4, 3}, -1, 1, tu_xorshift, &seed);
    ag_graph *g = ag_trace_module(m, &x, 1, NULL);
    if (!g)
        fail_msg("trace: %s", ag_last_error());
    const char *lin = "{" TROOT ", 'L__self__lin': ('lin', 'Linear')}";
    const char *lin1 = "{" TROOT ", 'L__self__lin@1': ('lin', 'Linear')}";
    const char *inner = "{" TROOT ", 'L__self__inner': ('inner', 'Inner'), "
                        "'L__self__inner.lin2': ('inner.lin2', 'Linear')}";
    const char *root = "{" TROOT "}";
    static const char *const ops[] = {"t", "addmm", "relu", "t", "addmm", "t", "addmm", "relu"};
    const char *want[] = {lin, lin, root, lin1, lin1, inner, inner, root};
    int k = 0;
    for (ag_node *n = ag_graph_first(g); n; n = ag_node_next(n)) {
        if (ag_node_kind_of(n) != AG_NODE_CALL)
            continue;
        assert_true(k < 8);
        assert_string_equal(ag_op_name(ag_node_op(n)), ops[k]);
        expect_text(stack_text(n), want[k], ag_node_name(n));
        k++;
    }
    assert_int_equal(k, 8);
    ag_graph_free(g);
    /* a second trace counts calls afresh */
    g = ag_trace_module(m, &x, 1, NULL);
    assert_non_null(g);
    expect_text(stack_text(find(g, "addmm")), lin, "second trace's addmm");
    expect_text(stack_text(find(g, "addmm_1")), lin1, "second trace's addmm_1");
    ag_graph_free(g);
    /* eager calls after the trace record nothing and still work */
    ag_tensor *y = NULL;
    assert_int_equal(ag_module_call(m, &x, 1, &y, 1), 1);
    ag_tensor_free(y);
    ag_tensor_free(x);
    ag_module_free(m);
}

/* ---- accessors, setters and the check of the text ---- */

static void test_accessors(void **st) {
    (void)st;
    ag_graph *g = ag_graph_new();
    ag_node *x = tu_ph(g, "x", TM(AG_F32, 4));
    ag_node *a = tu_call(g, "relu", GARGS(AG_GA_N(x)), NULL);
    ag_node *b = tu_call(g, "neg", GARGS(AG_GA_N(a)), NULL);
    assert_int_equal(ag_node_nn_module_stack_len(a), 0);
    assert_int_equal(ag_node_nn_module_stack_len(NULL), 0);
    char *key = (char *)1, *path = (char *)1, *type = (char *)1;
    assert_int_equal(ag_node_nn_module_stack(a, 0, &key, &path, &type), AG_EINVAL);
    assert_null(key); /* nothing stored on failure */
    assert_null(path);
    assert_null(type);
    tu_assert_error_contains("relu has no frame 0 (its nn_module_stack has 0)");
    ag_module_frame f[] = {{"L__self__", "", "Net"},
                           {"L__self__it's", "it's", "Odd\n\"Type\""},
                           {"L__self__b@1", "b", "Linear"}};
    assert_int_equal(ag_node_set_nn_module_stack(a, f, 3), 0);
    /* Python's repr quoting: ' inside picks double quotes, a newline is escaped */
    assert_string_equal(stack_text(a), "{'L__self__': ('', 'Net'), \"L__self__it's\": (\"it's\", "
                                       "'Odd\\n\"Type\"'), 'L__self__b@1': ('b', 'Linear')}");
    assert_int_equal(ag_node_nn_module_stack_len(a), 3);
    assert_int_equal(ag_node_nn_module_stack(a, 1, &key, &path, &type), 0);
    assert_string_equal(key, "L__self__it's");
    assert_string_equal(path, "it's");
    assert_string_equal(type, "Odd\n\"Type\"");
    ag_free(key);
    ag_free(path);
    ag_free(type);
    assert_int_equal(ag_node_nn_module_stack(a, 3, NULL, NULL, NULL), AG_EINVAL);
    assert_int_equal(ag_node_nn_module_stack(a, -1, NULL, NULL, NULL), AG_EINVAL);
    /* equal stacks share one text per graph */
    assert_int_equal(ag_node_set_nn_module_stack(b, f, 3), 0);
    assert_ptr_equal(stack_text(a), stack_text(b));
    assert_int_equal(ag_node_set_fwd_nn_module_stack(b, f, 1), 0);
    assert_string_equal(fwd_text(b), "{'L__self__': ('', 'Net')}");
    assert_int_equal(ag_node_fwd_nn_module_stack_len(b), 1);
    assert_int_equal(ag_node_fwd_nn_module_stack(b, 0, NULL, NULL, &type), 0);
    assert_string_equal(type, "Net");
    ag_free(type);
    /* refused: duplicate keys, NULL strings, too many frames; the node keeps its stack */
    ag_module_frame dup[] = {{"k", "", "A"}, {"k", "b", "B"}};
    assert_int_equal(ag_node_set_nn_module_stack(a, dup, 2), AG_EINVAL);
    tu_assert_error_contains("frames 0 and 1 have the same key 'k'");
    ag_module_frame null_path[] = {{"k", NULL, "A"}};
    assert_int_equal(ag_node_set_nn_module_stack(a, null_path, 1), AG_EINVAL);
    tu_assert_error_contains("frame 0 has a NULL path");
    assert_int_equal(ag_node_set_nn_module_stack(a, f, AG_MODULE_STACK_MAX + 1), AG_EINVAL);
    assert_int_equal(ag_node_set_nn_module_stack(a, NULL, 1), AG_EINVAL);
    assert_int_equal(ag_node_set_nn_module_stack(NULL, f, 1), AG_EINVAL);
    assert_int_equal(ag_node_nn_module_stack_len(a), 3);
    /* count 0 removes */
    assert_int_equal(ag_node_set_nn_module_stack(a, NULL, 0), 0);
    assert_null(stack_text(a));
    /* the generic setter takes exactly the printed spelling */
    ag_mval ok = {.kind = AG_MV_STR, .u.s = "{'k': ('p', 'T'), 'k@1': ('p', 'T')}"};
    assert_int_equal(ag_node_meta_set(a, "nn_module_stack", ok), 0);
    assert_int_equal(ag_node_nn_module_stack_len(a), 2);
    static const char *const bad[] = {
        "{'k':('p','T')}",                    /* other spacing */
        "{\"k\": ('p', 'T')}",                /* quotes Python would not pick */
        "{'k': ('p', 'T'), 'k': ('q', 'U')}", /* duplicate key */
        "{'k': ('p', 'T')} ",                 /* trailing text */
        "{'k': ('p', 'T'),}",                 /* trailing comma */
        "{}",                                 /* empty: remove the key instead */
        "{'k': ('p')}",                       /* not a pair */
        "'k'",
        "",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        ag_mval v = {.kind = AG_MV_STR, .u.s = bad[i]};
        if (ag_node_meta_set(a, "nn_module_stack", v) != AG_EINVAL)
            fail_msg("accepted %s", bad[i]);
        tu_assert_error_contains("is not a module stack");
        if (ag_node_meta_set(a, "fwd_nn_module_stack", v) != AG_EINVAL)
            fail_msg("accepted %s as fwd_nn_module_stack", bad[i]);
    }
    assert_int_equal(ag_node_meta_set(a, "nn_module_stack", (ag_mval){.kind = AG_MV_INT, .u.i = 1}),
                     AG_EINVAL);
    tu_assert_error_contains("nn_module_stack: expected a module stack string");
    assert_int_equal(ag_node_nn_module_stack_len(a), 2); /* unchanged */
    assert_non_null(ag_graph_output(g, (ag_node *[]){b}, 1));
    ag_graph_free(g);
}

/* ---- the text format ---- */

static void test_text(void **st) {
    (void)st;
    ag_module *m;
    ag_tensor *in[4];
    int nin;
    ag_joint *j = export_gpt2(&m, in, &nin);
    const ag_graph *g = ag_joint_graph(j);
    /* not printed unless asked: the default text is as before */
    char *plain = ag_graph_to_string(g, NULL);
    assert_null(strstr(plain, "nn_module_stack"));
    ag_print_opts o = {.module_stack = true};
    char *s = ag_graph_to_string(g, &o);
    assert_non_null(strstr(s, "    %addmm = addmm(%primals_6, %view, %t)  # f32[32, 192]  "
                              "is_forward  nn_module_stack={" ROOT ", " BLOCK0 ", " ATTN0
                              ", " C_ATTN0 "}\n"));
    assert_non_null(strstr(s, "  is_backward  fwd_nn_module_stack={" ROOT ", " LM_HEAD "}\n"));
    ag_graph *p = ag_graph_parse(s, strlen(s));
    if (!p)
        fail_msg("parse: %s", ag_last_error());
    char *s2 = ag_graph_to_string(p, &o);
    assert_string_equal(s2, s);
    /* parsed stacks are shared too */
    assert_ptr_equal(stack_text(find(p, "addmm")), stack_text(find(p, "t")));
    char *plain2 = ag_graph_to_string(p, NULL);
    assert_string_equal(plain2, plain);
    ag_free(plain);
    ag_free(plain2);
    ag_free(s);
    ag_free(s2);
    ag_graph_free(p);
    ag_joint_free(j);
    free_model(m, in, nin);
}

/* Parses a graph whose line 3, "    %r = relu(%x)  # f32[4]", ends in `items` (column 28). */
static ag_graph *parse_line(const char *items) {
    size_t n = strlen(items) + 128;
    char *text = malloc(n);
    assert_non_null(text);
    snprintf(text, n,
             "graph():\n    %%x : f32[4]  # None\n    %%r = relu(%%x)  # f32[4]%s\n"
             "    return (%%r,)\n",
             items);
    ag_graph *g = ag_graph_parse(text, strlen(text));
    free(text);
    return g;
}

static void expect_parse_error(const char *items, const char *msg) {
    ag_graph *g = parse_line(items);
    if (g)
        fail_msg("accepted '%s'", items);
    assert_int_equal(ag_last_status(), AG_EFORMAT);
    if (strcmp(ag_last_error(), msg))
        fail_msg("'%s':\n  expected %s\n  got      %s", items, msg, ag_last_error());
}

static void test_parse(void **st) {
    (void)st;
    /* any spacing Python reads, a trailing comma; printed back canonically */
    ag_graph *g = parse_line("  nn_module_stack={ 'a' :( '' ,\"T\" ) , 'a.b':('b', 'U'),}"
                             "  fwd_nn_module_stack={'z': ('z', 'Z')}");
    if (!g)
        fail_msg("parse: %s", ag_last_error());
    ag_node *r = find(g, "r");
    assert_string_equal(stack_text(r), "{'a': ('', 'T'), 'a.b': ('b', 'U')}");
    assert_string_equal(fwd_text(r), "{'z': ('z', 'Z')}");
    ag_print_opts o = {.module_stack = true};
    char *s = ag_graph_to_string(g, &o);
    assert_non_null(strstr(s, "%r = relu(%x)  # f32[4]  nn_module_stack={'a': ('', 'T'), 'a.b': "
                              "('b', 'U')}  fwd_nn_module_stack={'z': ('z', 'Z')}\n"));
    ag_free(s);
    ag_graph_free(g);
    /* {} is no stack; the quoted text is accepted through the generic item */
    g = parse_line("  nn_module_stack={}  fwd_nn_module_stack=\"{'z': ('z', 'Z')}\"");
    assert_non_null(g);
    assert_null(stack_text(find(g, "r")));
    assert_string_equal(fwd_text(find(g, "r")), "{'z': ('z', 'Z')}");
    ag_graph_free(g);
    expect_parse_error("  nn_module_stack={'a': ('', 'T'), 'a': ('b', 'U')}",
                       "line 3:46: %r: node_set_nn_module_stack: frames 0 and 1 have the same "
                       "key 'a'");
    expect_parse_error("  nn_module_stack={'a': '', 'T'}",
                       "line 3:52: expected '(' opening a frame's (path, type), got '''");
    expect_parse_error("  nn_module_stack={'a': ('', 'T')", "line 3:61: expected ',' or '}', got "
                                                            "end of line");
    expect_parse_error("  nn_module_stack={'a': ('', 1)}", "line 3:57: expected a quoted string, "
                                                           "got '1'");
    expect_parse_error("  nn_module_stack='x'",
                       "line 3:46: %r: nn_module_stack: 'x' is not a module stack {'KEY': "
                       "('PATH', 'TYPE'), ...} of 1 to 256 frames as the printer spells it: it "
                       "does not start with '{'");
    expect_parse_error("  fwd_nn_module_stack=3",
                       "line 3:50: %r: fwd_nn_module_stack: expected a module stack string "
                       "{'KEY': ('PATH', 'TYPE'), ...}, got a value of another kind");
    /* at most AG_MODULE_STACK_MAX frames */
    char *big = malloc(20 * (AG_MODULE_STACK_MAX + 2));
    assert_non_null(big);
    size_t k = (size_t)sprintf(big, "  nn_module_stack={");
    for (int i = 0; i <= AG_MODULE_STACK_MAX; i++)
        k += (size_t)sprintf(big + k, "'%d': ('', 'T'), ", i);
    big[k - 2] = '}';
    big[k - 1] = 0;
    g = parse_line(big);
    assert_null(g);
    tu_assert_error_contains("more than 256 frames in a module stack");
    free(big);
}

/* ---- the CLI ---- */

static void test_cli(void **st) {
    (void)st;
    if (!tu_cli_setup("/tmp/ag_test_modstack_XXXXXX"))
        skip();
    assert_int_equal(tu_cli_run("trace linear --module-stacks"), 0);
    tu_cli_has("out",
               "    %addmm = addmm(%primals_2, %primals_3, %t)  # f32[4, 2]  nn_module_stack="
               "{'L__self__': ('', 'LinearModel'), 'L__self__linear': ('linear', "
               "'Linear')}\n");
    assert_int_equal(tu_cli_run("export linear"), 0);
    tu_cli_lacks("out", "nn_module_stack");
    char args[512];
    snprintf(args, sizeof args, "export linear --module-stacks --seq-nr -o '%s/j.txt'",
             tu_cli_dir());
    assert_int_equal(tu_cli_run(args), 0);
    tu_cli_has("j.txt", "  is_backward  fwd_nn_module_stack={'L__self__': ('', 'LinearModel'), "
                        "'L__self__linear': ('linear', 'Linear')}\n");
    /* show prints everything the file holds, the stacks among it */
    snprintf(args, sizeof args, "show '%s/j.txt'", tu_cli_dir());
    assert_int_equal(tu_cli_run(args), 0);
    char *a = tu_cli_read("j.txt"), *b = tu_cli_read("out");
    assert_string_equal(b, a);
    free(a);
    free(b);
    static const char *const files[] = {"out", "err", "j.txt"};
    tu_cli_cleanup(files, 3);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_gpt2_joint),
        cmocka_unit_test(test_copy_and_partition),
        cmocka_unit_test(test_repeated_and_nested_calls),
        cmocka_unit_test(test_accessors),
        cmocka_unit_test(test_text),
        cmocka_unit_test(test_parse),
        cmocka_unit_test(test_cli),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
