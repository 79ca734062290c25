/* Nested compile regions (ag_nested_compile_region, ag_module_set_compile_region;
 * torch.compiler.nested_compile_region): upstream's test 23 (test_annotate_invoke_subgraph_simple)
 * ported exactly, the exported joint run by the interpreter against the same model without
 * regions, tracing once per key (a region called three times; two input shapes), eager results
 * and gradients, the inference trace, refusals, and an allocation-failure sweep. */
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static ag_tensor *rnd(int ndim, const int64_t *sizes, uint64_t seed) {
    uint64_t state = seed * 0x9E3779B97F4A7C15ull + 1;
    return tu_rand_tensor(AG_F32, ndim, sizes, -1, 1, tu_xorshift, &state);
}

static ag_mval str(const char *s) {
    return (ag_mval){.kind = AG_MV_STR, .u.s = s};
}

/* upstream's fx_traceback._get_ordered_seq_nr_groups: the nodes with a seq_nr grouped by it,
 * groups in ascending seq_nr, names sorted within a group: "[[a, b], [c]]". */
static int cmp_str(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

static void seq_groups(const ag_graph *g, char *buf, size_t n) {
    const char *names[256];
    int64_t seqs[256];
    int cnt = 0;
    for (ag_node *x = ag_graph_first(g); x && cnt < 256; x = ag_node_next(x))
        if (ag_node_seq_nr(x) >= 0) {
            names[cnt] = ag_node_name(x);
            seqs[cnt++] = ag_node_seq_nr(x);
        }
    size_t k = (size_t)snprintf(buf, n, "[");
    int64_t last = -1;
    bool first_group = true;
    for (;;) {
        int64_t next = INT64_MAX;
        for (int i = 0; i < cnt; i++)
            if (seqs[i] > last && seqs[i] < next)
                next = seqs[i];
        if (next == INT64_MAX)
            break;
        const char *grp[256];
        int gn = 0;
        for (int i = 0; i < cnt; i++)
            if (seqs[i] == next)
                grp[gn++] = names[i];
        qsort(grp, (size_t)gn, sizeof *grp, cmp_str);
        k += (size_t)snprintf(buf + k, n - k, "%s[", first_group ? "" : ", ");
        for (int i = 0; i < gn; i++)
            k += (size_t)snprintf(buf + k, n - k, "%s%s", i ? ", " : "", grp[i]);
        k += (size_t)snprintf(buf + k, n - k, "]");
        first_group = false;
        last = next;
    }
    snprintf(buf + k, n - k, "]");
}

static const char *kind_name(ag_node_kind k) {
    switch (k) {
    case AG_NODE_PLACEHOLDER:
        return "placeholder";
    case AG_NODE_GET_ATTR:
        return "get_attr";
    case AG_NODE_OUTPUT:
        return "output";
    default:
        return "call_function"; /* calls and getitems (FX's operator.getitem) */
    }
}

/* One node's entry as upstream's _get_custom_metadata prints it. */
static size_t custom_entry(const ag_node *x, char *buf, size_t n) {
    size_t k =
        (size_t)snprintf(buf, n, "('%s', '%s', {", kind_name(ag_node_kind_of(x)), ag_node_name(x));
    for (int i = 0; i < ag_node_custom_count(x); i++) {
        ag_mval v;
        const char *key = ag_node_custom_key_at(x, i, &v);
        if (v.kind == AG_MV_INT)
            k += (size_t)snprintf(buf + k, n - k, "%s'%s': %lld", i ? ", " : "", key,
                                  (long long)v.u.i);
        else if (v.kind == AG_MV_STR)
            k += (size_t)snprintf(buf + k, n - k, "%s'%s': '%s'", i ? ", " : "", key, v.u.s);
    }
    return k + (size_t)snprintf(buf + k, n - k, "})");
}

/* upstream's fx_traceback._get_custom_metadata: one line per node with custom metadata; a
 * get_attr of a subgraph is followed by a line listing the subgraph's nodes the same way. */
static void custom_metadata(const ag_graph *g, char *buf, size_t n) {
    size_t k = 0;
    buf[0] = 0;
    for (ag_node *x = ag_graph_first(g); x; x = ag_node_next(x)) {
        if (!ag_node_custom_count(x))
            continue;
        k += (size_t)snprintf(buf + k, n - k, "%s", k ? "\n" : "");
        k += custom_entry(x, buf + k, n - k);
        const ag_graph *sub = ag_node_subgraph(x);
        if (!sub)
            continue;
        k += (size_t)snprintf(buf + k, n - k, "\n[");
        bool first = true;
        for (ag_node *y = ag_graph_first(sub); y; y = ag_node_next(y)) {
            if (!ag_node_custom_count(y))
                continue;
            k += (size_t)snprintf(buf + k, n - k, "%s", first ? "" : ", ");
            k += custom_entry(y, buf + k, n - k);
            first = false;
        }
        k += (size_t)snprintf(buf + k, n - k, "]");
    }
}

/* The graph printed without metadata (values and descriptors kept). */
static void expect_text(const ag_graph *g, const char *want) {
    ag_print_opts po = {.no_meta = true, .no_custom = true};
    char *text = ag_graph_to_string(g, &po);
    assert_non_null(text);
    if (strcmp(text, want))
        print_error("printed:\n%s\nwant:\n%s\n", text, want);
    assert_string_equal(text, want);
    ag_free(text);
}

/* ---- upstream test 23's model ---- */

static int bar_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)m;
    (void)nin;
    (void)max_out;
    ag_scope_begin();
    ag_annotate_begin("mod_name", str("bar"));
    ag_tensor *y = ag_sin(in[0]);
    out[0] = ag_tensor_keep(ag_mul_scalar(y, 1.0));
    ag_annotate_end();
    ag_scope_end();
    return out[0] ? 1 : ag_last_status();
}

static int mymod_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out,
                         int max_out) {
    (void)nin;
    (void)max_out;
    ag_module *bar = ag_module_child(m, "bar");
    ag_scope_begin();
    ag_annotate_begin("mod_name", str("my_mod"));
    ag_tensor *z = ag_module_forward(bar, in[0]);
    ag_annotate_end();
    out[0] = ag_tensor_keep(ag_sub_scalar(z, 1.0));
    ag_scope_end();
    return out[0] ? 1 : ag_last_status();
}

static ag_module *mymod_new(bool region) {
    ag_module *m = ag_module_new("MyMod", mymod_forward, NULL, NULL);
    ag_module *bar = ag_module_new("Bar", bar_forward, NULL, NULL);
    assert_int_equal(ag_module_add_child(m, "bar", bar), 0);
    assert_int_equal(ag_module_set_compile_region(bar, region), 0);
    return m;
}

/* Upstream test 23 (shared/spec section 9). Differences from upstream's text, all of our
 * format and not of the graph: values print as `# f32[4, 3]` after the node, a call of one
 * tuple output prints its VAL as `(f32[4, 3],)`, the scalar 1 prints as 1.0 and mul/sub carry
 * their overload (mul.Scalar: upstream's aten.mul.Tensor with a Python number), and the joint's
 * inputs are its placeholders rather than the flattened (primals, tangents) lists. The
 * backward invoke_subgraph_1's custom map lists mod_name before call_id where upstream's lists
 * call_id first (the same dict: upstream sets call_id when the node is made and copies the
 * forward's annotations later; we copy the forward node's map, which has that order).
 * call_id is upstream's per-call id of a region call (1, 2, ... in the trace), shared by the
 * call's forward and backward invoke_subgraph so that passes can pair them. */
static void test_upstream_23(void **st) {
    (void)st;
    ag_manual_seed(0);
    ag_module *m = mymod_new(true);
    ag_tensor *x = ag_randn(AG_F32, 2, (int64_t[]){4, 3});
    assert_int_equal(ag_tensor_set_requires_grad(x, true), 0);
    ag_joint *j = ag_export_joint(m, &x, 1, NULL, NULL, 0, NULL);
    if (!j)
        print_error("%s\n", ag_last_error());
    assert_non_null(j);
    const ag_graph *g = ag_joint_graph(j);
    assert_int_equal(ag_graph_verify(g), 0);
    char buf[4096];
    seq_groups(g, buf, sizeof buf);
    assert_string_equal(buf, "[[getitem, getitem_1, invoke_subgraph, invoke_subgraph_1], [sub]]");
    seq_groups(ag_graph_subgraph(g, "repeated_subgraph0"), buf, sizeof buf);
    assert_string_equal(buf, "[[sin], [mul]]");
    /* The joint subgraph is traced on its own: its seq_nrs pair sin with its backward (cos,
     * mul_2) and mul with its backward (mul_1), unrelated to the outer graph's. */
    seq_groups(ag_graph_subgraph(g, "repeated_subgraph1"), buf, sizeof buf);
    assert_string_equal(buf, "[[cos, mul_2, sin], [mul, mul_1]]");
    expect_text(g, "graph():\n"
                   "    %primals_1 : f32[4, 3]  # PlainAOTInput(idx=0)\n"
                   "    %tangents_1 : f32[4, 3]  # TangentAOTInput(output=PlainAOTOutput(idx=0))\n"
                   "    %repeated_subgraph0 = get_attr(repeated_subgraph0)  # subgraph\n"
                   "    %invoke_subgraph = invoke_subgraph(%repeated_subgraph0, 'fw_subgraph_0', "
                   "%primals_1)  # (f32[4, 3],)\n"
                   "    %getitem = getitem(%invoke_subgraph, 0)  # f32[4, 3]\n"
                   "    %sub = sub.Scalar(%getitem, 1.0)  # f32[4, 3]\n"
                   "    %repeated_subgraph1 = get_attr(repeated_subgraph1)  # subgraph\n"
                   "    %invoke_subgraph_1 = invoke_subgraph(%repeated_subgraph1, "
                   "'bw_subgraph_0_0', %primals_1, %tangents_1)  # (f32[4, 3], f32[4, 3])\n"
                   "    %getitem_1 = getitem(%invoke_subgraph_1, 0)  # f32[4, 3]\n"
                   "    return (%sub, %getitem_1)  # [PlainAOTOutput(idx=0), "
                   "GradAOTOutput(grad_of=PlainAOTInput(idx=0))]\n"
                   "\n"
                   "subgraph repeated_subgraph0():\n"
                   "    %arg0_1 : f32[4, 3]  # None\n"
                   "    %sin = sin(%arg0_1)  # f32[4, 3]\n"
                   "    %mul = mul.Scalar(%sin, 1.0)  # f32[4, 3]\n"
                   "    return (%mul,)\n"
                   "\n"
                   "subgraph repeated_subgraph1():\n"
                   "    %arg0_1 : f32[4, 3]  # None\n"
                   "    %arg1_1 : f32[4, 3]  # None\n"
                   "    %sin = sin(%arg0_1)  # f32[4, 3]\n"
                   "    %mul = mul.Scalar(%sin, 1.0)  # f32[4, 3]\n"
                   "    %mul_1 = mul.Scalar(%arg1_1, 1.0)  # f32[4, 3]\n"
                   "    %cos = cos(%arg0_1)  # f32[4, 3]\n"
                   "    %mul_2 = mul.Tensor(%mul_1, %cos)  # f32[4, 3]\n"
                   "    return (%mul_2, %mul)\n");
    custom_metadata(g, buf, sizeof buf);
    assert_string_equal(
        buf, "('get_attr', 'repeated_subgraph0', {'mod_name': 'my_mod'})\n"
             "[('placeholder', 'arg0_1', {'mod_name': 'my_mod'}), ('call_function', 'sin', "
             "{'mod_name': 'bar'}), ('call_function', 'mul', {'mod_name': 'bar'}), ('output', "
             "'output', {'mod_name': 'my_mod'})]\n"
             "('call_function', 'invoke_subgraph', {'mod_name': 'my_mod', 'call_id': 1})\n"
             "('call_function', 'getitem', {'mod_name': 'my_mod'})\n"
             "('get_attr', 'repeated_subgraph1', {'mod_name': 'my_mod'})\n"
             "[('placeholder', 'arg0_1', {'mod_name': 'my_mod'}), ('placeholder', 'arg1_1', "
             "{'mod_name': 'my_mod'}), ('call_function', 'sin', {'mod_name': 'bar'}), "
             "('call_function', 'mul', {'mod_name': 'bar'}), ('call_function', 'mul_1', "
             "{'mod_name': 'bar'}), ('call_function', 'cos', {'mod_name': 'bar'}), "
             "('call_function', 'mul_2', {'mod_name': 'bar'}), ('output', 'output', "
             "{'mod_name': 'my_mod'})]\n"
             "('call_function', 'invoke_subgraph_1', {'mod_name': 'my_mod', 'call_id': 1})\n"
             "('call_function', 'getitem_1', {'mod_name': 'my_mod'})");
    /* Stack traces, as upstream's: the outer call and its backward point at the module call
     * (`z = self.bar(x)`), the subgraphs' nodes at their own lines (`y = x.sin()`; the whole
     * stack, the caller's frames above, as upstream's node.meta["stack_trace"]). */
    const char *st_fw = ag_node_stack_trace(ag_graph_find(g, "invoke_subgraph"));
    const char *st_bw = ag_node_stack_trace(ag_graph_find(g, "invoke_subgraph_1"));
    const char *st_sin =
        ag_node_stack_trace(ag_graph_find(ag_graph_subgraph(g, "repeated_subgraph0"), "sin"));
    const char *st_cos =
        ag_node_stack_trace(ag_graph_find(ag_graph_subgraph(g, "repeated_subgraph1"), "cos"));
    assert_non_null(st_fw);
    assert_non_null(st_bw);
    assert_non_null(st_sin);
    assert_non_null(st_cos);
    assert_non_null(strstr(st_fw, "ag_tensor *z = ag_module_forward(bar, in[0]);"));
    assert_string_equal(st_bw, st_fw);
    assert_non_null(strstr(st_sin, "ag_tensor *y = ag_sin(in[0]);"));
    assert_non_null(strstr(st_cos, "ag_tensor *y = ag_sin(in[0]);"));
    /* The whole text (metadata included) parses back and prints identically. */
    char *full = ag_graph_to_string(g, NULL);
    assert_non_null(full);
    ag_graph *back = ag_graph_parse(full, strlen(full));
    if (!back)
        print_error("%s\n", ag_last_error());
    assert_non_null(back);
    char *again = ag_graph_to_string(back, NULL);
    assert_string_equal(again, full);
    ag_free(again);
    ag_free(full);
    ag_graph_free(back);
    ag_joint_free(j);
    ag_module_free(m);
    ag_tensor_free(x);
}

/* ---- a deeper model: blocks of one type, each y = tanh(lin(x)) * x + x ---- */

static int block_calls; /* block forwards run (eager or traced) */

static int block_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out,
                         int max_out) {
    (void)nin;
    (void)max_out;
    block_calls++;
    ag_scope_begin();
    ag_tensor *h = ag_module_forward(ag_module_child(m, "lin"), in[0]);
    out[0] = ag_tensor_keep(ag_add(ag_mul(ag_tanh(h), in[0]), in[0]));
    ag_scope_end();
    return out[0] ? 1 : ag_last_status();
}

static int stack_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out,
                         int max_out) {
    (void)nin;
    (void)max_out;
    ag_scope_begin();
    ag_tensor *h = in[0];
    for (int i = 0; i < ag_module_num_children(m) && h; i++)
        h = ag_module_forward(ag_module_child_at(m, i, NULL), h);
    out[0] = h ? ag_tensor_keep(ag_mul_scalar(h, 0.5)) : NULL;
    ag_scope_end();
    return out[0] ? 1 : ag_last_status();
}

/* A block with more activations: y = sin(tanh(lin(x)) * x) * x + x. */
static int deep_block_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out,
                              int max_out) {
    (void)nin;
    (void)max_out;
    block_calls++;
    ag_scope_begin();
    ag_tensor *h = ag_module_forward(ag_module_child(m, "lin"), in[0]);
    ag_tensor *p = ag_sin(ag_mul(ag_tanh(h), in[0]));
    out[0] = ag_tensor_keep(ag_add(ag_mul(p, in[0]), in[0]));
    ag_scope_end();
    return out[0] ? 1 : ag_last_status();
}

static ag_module *stack_of(int nblocks, bool region, ag_forward_fn block) {
    ag_manual_seed(7);
    ag_module *m = ag_module_new("Stack", stack_forward, NULL, NULL);
    for (int i = 0; i < nblocks; i++) {
        ag_module *b = ag_module_new("Block", block, NULL, NULL);
        assert_int_equal(ag_module_add_child(b, "lin", ag_nn_linear(3, 3, true)), 0);
        char name[16];
        snprintf(name, sizeof name, "b%d", i);
        assert_int_equal(ag_module_add_child(m, name, b), 0);
        assert_int_equal(ag_module_set_compile_region(b, region), 0);
        assert_true(ag_module_is_compile_region(b) == region);
    }
    return m;
}

static ag_module *stack_new(int nblocks, bool region) {
    return stack_of(nblocks, region, block_forward);
}

static int count_calls(const ag_graph *g, const char *ident) {
    int n = 0;
    for (ag_node *x = ag_graph_first(g); x; x = ag_node_next(x))
        if (ag_node_kind_of(x) == AG_NODE_CALL && ag_node_op(x) == ag_op_invoke_subgraph() &&
            !strcmp(ag_node_arg(x, 1)->u.s, ident))
            n++;
    return n;
}

/* Runs the joint's graph on the module's parameters, x and tangent t. */
static int run_joint(const ag_joint *j, ag_module *m, ag_tensor *x, ag_tensor *t, ag_tensor **outs,
                     int max_out) {
    ag_named_tensors ps = {0};
    assert_int_equal(ag_module_named_parameters(m, true, &ps), 0);
    ag_tensor *in[32];
    int n = 0;
    for (int i = 0; i < ps.n; i++)
        in[n++] = ps.tensors[i];
    in[n++] = x;
    in[n++] = t;
    assert_int_equal(n, ag_joint_num_primals(j) + ag_joint_num_tangents(j));
    int rc = ag_graph_run(ag_joint_graph(j), in, n, outs, max_out);
    ag_named_tensors_free(&ps);
    return rc;
}

/* The joint with three blocks as regions: one forward subgraph and one joint subgraph, each
 * traced once (the block's forward runs twice in all), three calls of each; run by the
 * interpreter it equals the flat joint of the same model (same parameters) on random inputs,
 * and so does it compiled. */
static void test_three_calls_trace_once(void **st) {
    (void)st;
    ag_module *flat = stack_new(3, false), *reg = stack_new(3, true);
    ag_tensor *x = rnd(2, (int64_t[]){4, 3}, 11);
    ag_tensor *t = rnd(2, (int64_t[]){4, 3}, 12);
    assert_int_equal(ag_tensor_set_requires_grad(x, true), 0);
    block_calls = 0;
    ag_joint *jf = ag_export_joint(flat, &x, 1, NULL, NULL, 0, NULL);
    assert_non_null(jf);
    assert_int_equal(block_calls, 3);
    block_calls = 0;
    ag_joint *jr = ag_export_joint(reg, &x, 1, NULL, NULL, 0, NULL);
    if (!jr)
        print_error("%s\n", ag_last_error());
    assert_non_null(jr);
    assert_int_equal(block_calls, 2); /* the forward subgraph, then the joint subgraph */
    const ag_graph *g = ag_joint_graph(jr);
    assert_int_equal(ag_graph_verify(g), 0);
    assert_int_equal(ag_graph_num_subgraphs(g), 2);
    assert_non_null(ag_graph_subgraph(g, "repeated_subgraph0"));
    assert_non_null(ag_graph_subgraph(g, "repeated_subgraph1"));
    assert_int_equal(count_calls(g, "fw_subgraph_0"), 3);
    assert_int_equal(count_calls(g, "bw_subgraph_0_0"), 3);
    /* The joint subgraph: x, lin.weight, lin.bias, then the tangent; it returns the three
     * operands' gradients, then the block's output. */
    const ag_graph *bw = ag_graph_subgraph(g, "repeated_subgraph1");
    ag_node **ph;
    assert_int_equal(ag_graph_placeholders(bw, &ph), 4);
    assert_int_equal(ag_node_arg(ag_graph_output_node(bw), 0)->n, 4);
    /* each call's call_id is shared by its forward and backward invoke_subgraph */
    int64_t fw_ids = 0, bw_ids = 0;
    for (ag_node *n = ag_graph_first(g); n; n = ag_node_next(n))
        if (ag_node_kind_of(n) == AG_NODE_CALL && ag_node_op(n) == ag_op_invoke_subgraph()) {
            ag_mval v = ag_node_custom_get(n, "call_id");
            assert_int_equal(v.kind, AG_MV_INT);
            bool fw = !strcmp(ag_node_arg(n, 1)->u.s, "fw_subgraph_0");
            *(fw ? &fw_ids : &bw_ids) += v.u.i;
        }
    assert_int_equal(fw_ids, 1 + 2 + 3);
    assert_int_equal(bw_ids, 1 + 2 + 3);
    ag_tensor *of[8] = {0}, *orr[8] = {0};
    int nf = run_joint(jf, flat, x, t, of, 8);
    int nr = run_joint(jr, reg, x, t, orr, 8);
    assert_int_equal(nf, 8); /* output, then the grads of 6 parameters and x */
    assert_int_equal(nr, nf);
    for (int i = 0; i < nf; i++) {
        assert_non_null(of[i]);
        assert_non_null(orr[i]);
        assert_true(tu_max_abs_diff(of[i], orr[i]) < 1e-5);
        ag_tensor_free(of[i]);
        ag_tensor_free(orr[i]);
    }
    /* Compiled (both partitioners, budgets 0 and 1), the region joint trains as the flat one:
     * the same output and gradients of x and of every parameter. */
    for (int k = 0; k < 4; k++) {
        ag_compile_opts co = {0};
        co.partition.partitioner = k % 2 ? AG_PARTITION_MINCUT : AG_PARTITION_DEFAULT;
        co.partition.memory_budget = k / 2 ? 1.0 : AG_MEMORY_BUDGET_ZERO;
        ag_compiled *cf = ag_compile_joint(jf, &co), *cr = ag_compile_joint(jr, &co);
        if (!cr)
            print_error("%s\n", ag_last_error());
        assert_non_null(cf);
        assert_non_null(cr);
        ag_tensor *yf = NULL, *yr = NULL, *gxf = NULL;
        assert_int_equal(ag_compiled_call_module(cf, flat, &x, 1, &yf, 1), 1);
        assert_int_equal(ag_backward(yf, t, false), 0);
        gxf = ag_tensor_grad(x);
        assert_non_null(gxf);
        ag_tensor_keep(gxf);
        assert_int_equal(ag_tensor_set_grad(x, NULL), 0);
        assert_int_equal(ag_compiled_call_module(cr, reg, &x, 1, &yr, 1), 1);
        assert_int_equal(ag_backward(yr, t, false), 0);
        assert_true(tu_max_abs_diff(yf, yr) < 1e-5);
        assert_true(tu_max_abs_diff(gxf, ag_tensor_grad(x)) < 1e-5);
        ag_named_tensors pf, pr;
        assert_int_equal(ag_module_named_parameters(flat, true, &pf), 0);
        assert_int_equal(ag_module_named_parameters(reg, true, &pr), 0);
        assert_int_equal(pf.n, 6);
        assert_int_equal(pr.n, pf.n);
        for (int i = 0; i < pf.n; i++) {
            assert_string_equal(pf.names[i], pr.names[i]);
            assert_non_null(ag_tensor_grad(pr.tensors[i]));
            assert_true(tu_max_abs_diff(ag_tensor_grad(pf.tensors[i]),
                                        ag_tensor_grad(pr.tensors[i])) < 1e-5);
            assert_int_equal(ag_tensor_set_grad(pf.tensors[i], NULL), 0);
            assert_int_equal(ag_tensor_set_grad(pr.tensors[i], NULL), 0);
        }
        ag_named_tensors_free(&pf);
        ag_named_tensors_free(&pr);
        assert_int_equal(ag_tensor_set_grad(x, NULL), 0);
        ag_tensor_free(gxf);
        ag_tensor_free(yf);
        ag_tensor_free(yr);
        ag_compiled_free(cf);
        ag_compiled_free(cr);
    }
    ag_joint_free(jf);
    ag_joint_free(jr);
    ag_module_free(flat);
    ag_module_free(reg);
    ag_tensor_free(x);
    ag_tensor_free(t);
}

/* Eager, a region is just its forward: the same output and gradients, bit for bit. */
static void test_eager(void **st) {
    (void)st;
    ag_module *flat = stack_new(2, false), *reg = stack_new(2, true);
    ag_tensor *x = rnd(2, (int64_t[]){4, 3}, 5);
    assert_int_equal(ag_tensor_set_requires_grad(x, true), 0);
    ag_tensor *yf = ag_module_forward(flat, x);
    assert_non_null(yf);
    ag_tensor *lf = ag_sum_all(yf);
    assert_int_equal(ag_backward(lf, NULL, false), 0);
    ag_tensor *gxf = ag_tensor_keep(ag_tensor_grad(x));
    assert_int_equal(ag_tensor_set_grad(x, NULL), 0);
    ag_tensor *yr = ag_module_forward(reg, x);
    assert_non_null(yr);
    assert_true(tu_same_bits(yf, yr));
    ag_tensor *lr = ag_sum_all(yr);
    assert_int_equal(ag_backward(lr, NULL, false), 0);
    assert_true(tu_same_bits(gxf, ag_tensor_grad(x)));
    ag_named_tensors pf = {0}, pr = {0};
    assert_int_equal(ag_module_named_parameters(flat, true, &pf), 0);
    assert_int_equal(ag_module_named_parameters(reg, true, &pr), 0);
    for (int i = 0; i < pf.n; i++)
        assert_true(tu_same_bits(ag_tensor_grad(pf.tensors[i]), ag_tensor_grad(pr.tensors[i])));
    ag_named_tensors_free(&pf);
    ag_named_tensors_free(&pr);
    ag_tensor_free(gxf);
    ag_tensor_free(lf);
    ag_tensor_free(lr);
    ag_tensor_free(yf);
    ag_tensor_free(yr);
    ag_module_free(flat);
    ag_module_free(reg);
    ag_tensor_free(x);
}

/* ---- the function form ---- */

static int fn_calls;

static int twice_sin(void *ud, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)ud;
    (void)nin;
    (void)max_out;
    fn_calls++;
    ag_scope_begin();
    out[0] = ag_tensor_keep(ag_mul(ag_sin(in[0]), in[1]));
    ag_scope_end();
    return out[0] ? 1 : ag_last_status();
}

/* f(x, w) = region(x, w) + region(x2, w2) + region(x, w) with x2, w2 of another shape. */
static int two_shapes_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out,
                              int max_out) {
    (void)m;
    (void)nin;
    (void)max_out;
    ag_scope_begin();
    ag_tensor *a[1] = {0}, *b[1] = {0}, *c[1] = {0};
    ag_tensor *x2 = ag_sum(in[0], (int64_t[]){0}, 1, false); /* (3,) */
    ag_tensor *w2 = ag_sum(in[1], (int64_t[]){0}, 1, false);
    int rc = ag_nested_compile_region(twice_sin, NULL, in, 2, a, 1);
    if (rc == 1)
        rc = ag_nested_compile_region(twice_sin, NULL, (ag_tensor *[]){x2, w2}, 2, b, 1);
    if (rc == 1)
        rc = ag_nested_compile_region(twice_sin, NULL, in, 2, c, 1);
    if (rc == 1)
        out[0] = ag_tensor_keep(ag_add(ag_add(a[0], b[0]), c[0]));
    ag_scope_end();
    ag_tensor *mine[3] = {a[0], b[0], c[0]}; /* the regions' new references */
    for (int i = 0; i < 3; i++)
        ag_tensor_free(mine[i]);
    return rc == 1 && out[0] ? 1 : ag_last_status();
}

static void test_two_shapes_trace_twice(void **st) {
    (void)st;
    ag_module *m = ag_module_new("TwoShapes", two_shapes_forward, NULL, NULL);
    ag_tensor *x = rnd(2, (int64_t[]){4, 3}, 21);
    ag_tensor *w = rnd(2, (int64_t[]){4, 3}, 22);
    ag_tensor *t = rnd(2, (int64_t[]){4, 3}, 23);
    assert_int_equal(ag_tensor_set_requires_grad(x, true), 0);
    ag_tensor *in[2] = {x, w};
    /* eager: three calls */
    fn_calls = 0;
    ag_tensor *ye = NULL;
    assert_int_equal(ag_module_call(m, in, 2, &ye, 1), 1);
    assert_int_equal(fn_calls, 3);
    fn_calls = 0;
    ag_joint *j = ag_export_joint(m, in, 2, NULL, NULL, 0, NULL);
    if (!j)
        print_error("%s\n", ag_last_error());
    assert_non_null(j);
    /* two keys: each traced forward and joint (w does not require grad: its gradient is a None
     * output of the joint) */
    assert_int_equal(fn_calls, 4);
    const ag_graph *g = ag_joint_graph(j);
    assert_int_equal(ag_graph_verify(g), 0);
    assert_int_equal(ag_graph_num_subgraphs(g), 4);
    assert_int_equal(count_calls(g, "fw_subgraph_0"), 2);
    assert_int_equal(count_calls(g, "fw_subgraph_1"), 1);
    assert_int_equal(count_calls(g, "bw_subgraph_0_0"), 2);
    assert_int_equal(count_calls(g, "bw_subgraph_1_0"), 1);
    const ag_graph *bw0 = ag_graph_subgraph(g, "repeated_subgraph1");
    const ag_garg *outs = ag_node_arg(ag_graph_output_node(bw0), 0);
    assert_int_equal(outs->n, 3);
    assert_non_null(outs->u.nodes[0]);
    assert_null(outs->u.nodes[1]); /* w's gradient */
    /* a None output prints, parses back and prints the same (its element of the call's tuple
     * VAL is f32[0], read by no getitem) */
    char *text = ag_graph_to_string(g, NULL);
    assert_non_null(strstr(text, "'bw_subgraph_0_0', %primals_1, %primals_2, %tangents_1)  # "
                                 "(f32[4, 3], f32[0], f32[4, 3])"));
    ag_graph *back = ag_graph_parse(text, strlen(text));
    if (!back)
        print_error("%s\n", ag_last_error());
    assert_non_null(back);
    char *again = ag_graph_to_string(back, NULL);
    assert_string_equal(again, text);
    ag_free(again);
    ag_free(text);
    ag_graph_free(back);
    /* the interpreter's output and x's gradient against eager */
    ag_tensor *r[4] = {0};
    int n = ag_graph_run(g, (ag_tensor *[]){x, w, t}, 3, r, 4);
    assert_int_equal(n, 3);
    assert_true(tu_max_abs_diff(r[0], ye) < 1e-6);
    assert_int_equal(ag_backward(ye, t, false), 0);
    assert_true(tu_max_abs_diff(r[1], ag_tensor_grad(x)) < 1e-5);
    assert_null(r[2]);
    for (int i = 0; i < n; i++)
        ag_tensor_free(r[i]);
    ag_tensor_free(ye);
    ag_joint_free(j);
    ag_module_free(m);
    ag_tensor_free(x);
    ag_tensor_free(w);
    ag_tensor_free(t);
}

/* The inference trace records the forward calls only. */
static void test_inference_trace(void **st) {
    (void)st;
    ag_module *m = stack_new(3, true);
    ag_tensor *x = rnd(2, (int64_t[]){4, 3}, 31);
    /* x requiring grad as the blocks' outputs do: one key for the three calls */
    assert_int_equal(ag_tensor_set_requires_grad(x, true), 0);
    block_calls = 0;
    ag_graph *g = ag_trace_module(m, &x, 1, NULL);
    if (!g)
        print_error("%s\n", ag_last_error());
    assert_non_null(g);
    assert_int_equal(block_calls, 1);
    assert_int_equal(ag_graph_verify(g), 0);
    assert_int_equal(ag_graph_num_subgraphs(g), 1);
    assert_int_equal(count_calls(g, "fw_subgraph_0"), 3);
    ag_named_tensors ps = {0};
    assert_int_equal(ag_module_named_parameters(m, true, &ps), 0);
    ag_tensor *in[8];
    for (int i = 0; i < ps.n; i++)
        in[i] = ps.tensors[i];
    in[ps.n] = x;
    ag_tensor *r = NULL;
    assert_int_equal(ag_graph_run(g, in, ps.n + 1, &r, 1), 1);
    ag_tensor *ye = ag_module_forward(m, x);
    assert_true(tu_max_abs_diff(r, ye) < 1e-6);
    ag_tensor_free(r);
    ag_tensor_free(ye);
    ag_named_tensors_free(&ps);
    ag_graph_free(g);
    ag_module_free(m);
    ag_tensor_free(x);
}

/* A region called inside a region is a call of its own subgraph, an attribute of the outer
 * region's subgraph (tests/test_nested_regions_2level.c has the rest). */
static int outer_region(void *ud, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)ud;
    (void)nin;
    (void)max_out;
    ag_tensor *h[1] = {0};
    int rc = ag_nested_compile_region(twice_sin, NULL, in, 2, h, 1);
    if (rc != 1)
        return rc;
    ag_scope_begin();
    out[0] = ag_tensor_keep(ag_cos(h[0]));
    ag_scope_end();
    ag_tensor_free(h[0]);
    return out[0] ? 1 : ag_last_status();
}

static int nested_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out,
                          int max_out) {
    (void)m;
    (void)nin;
    return ag_nested_compile_region(outer_region, NULL, in, 2, out, max_out);
}

static void test_region_in_region(void **st) {
    (void)st;
    ag_module *m = ag_module_new("Nested", nested_forward, NULL, NULL);
    ag_tensor *x = rnd(2, (int64_t[]){4, 3}, 51), *w = rnd(2, (int64_t[]){4, 3}, 52);
    ag_graph *g = ag_trace_module(m, (ag_tensor *[]){x, w}, 2, NULL);
    assert_non_null(g);
    assert_int_equal(ag_graph_num_subgraphs(g), 1);
    assert_int_equal(count_calls(g, "fw_subgraph_0"), 1);
    expect_text(ag_graph_subgraph(g, "repeated_subgraph0"),
                "graph():\n"
                "    %arg0_1 : f32[4, 3]  # None\n"
                "    %arg1_1 : f32[4, 3]  # None\n"
                "    %repeated_subgraph0 = get_attr(repeated_subgraph0)  # subgraph\n"
                "    %invoke_subgraph = invoke_subgraph(%repeated_subgraph0, 'fw_subgraph_1', "
                "%arg0_1, %arg1_1)  # (f32[4, 3],)\n"
                "    %getitem = getitem(%invoke_subgraph, 0)  # f32[4, 3]\n"
                "    %cos = cos(%getitem)  # f32[4, 3]\n"
                "    return (%cos,)\n"
                "\n"
                "subgraph repeated_subgraph0():\n"
                "    %arg0_1 : f32[4, 3]  # None\n"
                "    %arg1_1 : f32[4, 3]  # None\n"
                "    %sin = sin(%arg0_1)  # f32[4, 3]\n"
                "    %mul = mul.Tensor(%sin, %arg1_1)  # f32[4, 3]\n"
                "    return (%mul,)\n");
    ag_graph_free(g);
    ag_module_free(m);
    ag_tensor_free(x);
    ag_tensor_free(w);
}

/* A trace that is not the joint export but differentiates itself (ag_grad inside the traced
 * function): the region's joint is traced when its backward first runs, and the gradient the
 * graph computes equals eager's. */
static int grad_of_region(void *ud, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)ud;
    (void)nin;
    (void)max_out;
    ag_tensor *y[1] = {0};
    int rc = ag_nested_compile_region(twice_sin, NULL, in, 2, y, 1);
    if (rc != 1)
        return rc;
    ag_scope_begin();
    ag_tensor *l = ag_sum_all(y[0]), *g = NULL;
    rc = l ? ag_grad(&l, NULL, 1, in, 1, &g, false, false) : ag_last_status();
    out[0] = rc == 0 ? ag_tensor_keep(ag_mul_scalar(g, 1.0)) : NULL; /* g: the scope's */
    ag_scope_end();
    ag_tensor_free(y[0]);
    return out[0] ? 1 : (rc < 0 ? rc : ag_last_status());
}

/* ag_trace's functions return results of its scope (not references of their own). */
static int grad_of_region_traced(void *ud, ag_tensor *const *in, int nin, ag_tensor **out,
                                 int max_out) {
    ag_tensor *kept = NULL;
    int rc = grad_of_region(ud, in, nin, &kept, max_out);
    if (rc != 1)
        return rc;
    out[0] = ag_mul_scalar(kept, 1.0);
    ag_tensor_free(kept);
    return out[0] ? 1 : ag_last_status();
}

static void test_backward_in_trace(void **st) {
    (void)st;
    ag_tensor *x = rnd(2, (int64_t[]){4, 3}, 61), *w = rnd(2, (int64_t[]){4, 3}, 62);
    assert_int_equal(ag_tensor_set_requires_grad(x, true), 0);
    fn_calls = 0;
    ag_graph *g = ag_trace(grad_of_region_traced, NULL, (ag_tensor *[]){x, w}, 2, NULL, NULL, NULL);
    if (!g)
        print_error("%s\n", ag_last_error());
    assert_non_null(g);
    assert_int_equal(fn_calls, 2); /* the forward, then (in the backward) the joint */
    assert_int_equal(ag_graph_verify(g), 0);
    assert_int_equal(ag_graph_num_subgraphs(g), 2);
    assert_int_equal(count_calls(g, "fw_subgraph_0"), 1);
    assert_int_equal(count_calls(g, "bw_subgraph_0_0"), 1);
    ag_tensor *r = NULL;
    assert_int_equal(ag_graph_run(g, (ag_tensor *[]){x, w}, 2, &r, 1), 1);
    ag_tensor *e = NULL;
    assert_int_equal(grad_of_region(NULL, (ag_tensor *[]){x, w}, 2, &e, 1), 1);
    assert_true(tu_max_abs_diff(r, e) < 1e-6);
    ag_tensor_free(r);
    ag_tensor_free(e);
    ag_graph_free(g);
    ag_tensor_free(x);
    ag_tensor_free(w);
}

/* The module form of the above: a Linear region whose joint is traced in the backward (the
 * call keeps no parameter names; they are built then, after a parameter was added). The traced
 * gradient of x equals eager's without regions (d sum(x W^T + b) / dx = ones W). */
static ag_tensor *extra_param;

static int grad_of_module_region(void *ud, ag_tensor *const *in, int nin, ag_tensor **out,
                                 int max_out) {
    (void)nin;
    (void)max_out;
    ag_tensor *y[1] = {0};
    int rc = ag_module_call(ud, in, 1, y, 1);
    if (rc != 1)
        return rc < 0 ? rc : ag_last_status();
    /* a parameter added after the call is no operand: the joint traced below ignores it */
    if ((rc = ag_module_register_parameter(ud, "extra", extra_param)))
        return rc;
    ag_tensor *l = ag_sum_all(y[0]), *g = NULL;
    rc = l ? ag_grad(&l, NULL, 1, (ag_tensor **)in, 1, &g, false, false) : ag_last_status();
    out[0] = rc == 0 ? ag_mul_scalar(g, 1.0) : NULL;
    return out[0] ? 1 : (rc < 0 ? rc : ag_last_status());
}

static void test_module_backward_in_trace(void **st) {
    (void)st;
    ag_manual_seed(63);
    ag_module *lin = ag_nn_linear(3, 2, true);
    assert_non_null(lin);
    assert_int_equal(ag_module_set_compile_region(lin, true), 0);
    ag_tensor *x = rnd(2, (int64_t[]){4, 3}, 64);
    assert_int_equal(ag_tensor_set_requires_grad(x, true), 0);
    extra_param = ag_zeros(AG_F32, 1, (int64_t[]){2});
    assert_non_null(extra_param);
    ag_graph *g = ag_trace(grad_of_module_region, lin, (ag_tensor *[]){x}, 1, NULL, NULL, NULL);
    if (!g)
        print_error("%s\n", ag_last_error());
    assert_non_null(g);
    assert_int_equal(ag_graph_verify(g), 0);
    assert_int_equal(ag_graph_num_subgraphs(g), 2);
    assert_int_equal(count_calls(g, "fw_subgraph_0"), 1);
    assert_int_equal(count_calls(g, "bw_subgraph_0_0"), 1);
    ag_tensor *r = NULL;
    assert_int_equal(ag_graph_run(g, (ag_tensor *[]){x}, 1, &r, 1), 1);
    ag_named_tensors ps;
    assert_int_equal(ag_module_named_parameters(lin, true, &ps), 0);
    assert_string_equal(ps.names[0], "weight");
    const float *w = ag_tensor_data(ps.tensors[0]); /* [2, 3] */
    const float *rv = ag_tensor_data(r);
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 3; j++)
            assert_true(fabsf(rv[i * 3 + j] - (w[j] + w[3 + j])) < 1e-6f);
    ag_named_tensors_free(&ps);
    ag_tensor_free(r);
    ag_graph_free(g);
    ag_tensor_free(x);
    ag_tensor_free(extra_param);
    ag_module_free(lin);
}

/* ---- GPT-2 with its blocks as regions ---- */

/* The zoo's tiny GPT-2 (2 blocks) with nested_blocks: one forward and one joint subgraph for
 * the two blocks, and the joint run by the interpreter equals the flat one's (same weights,
 * same tokens and tangent). */
static void test_gpt2_blocks(void **st) {
    (void)st;
    ag_module *mf = NULL, *mr = NULL;
    ag_tensor *in_f[2], *in_r[2];
    int nf = 0, nr = 0;
    assert_int_equal(ag_zoo_build("gpt2", NULL, &mf, in_f, 2, &nf), 0);
    ag_zoo_opts zo = {.nested_blocks = true};
    assert_int_equal(ag_zoo_build_opts("gpt2", NULL, &zo, &mr, in_r, 2, &nr), 0);
    assert_true(ag_module_is_compile_region(ag_module_child(mr, "transformer.h.1")));
    assert_false(ag_module_is_compile_region(ag_module_child(mf, "transformer.h.1")));
    ag_joint *jf = ag_export_joint(mf, in_f, 1, NULL, NULL, 0, NULL);
    ag_joint *jr = ag_export_joint(mr, in_r, 1, NULL, NULL, 0, NULL);
    if (!jr)
        print_error("%s\n", ag_last_error());
    assert_non_null(jf);
    assert_non_null(jr);
    const ag_graph *g = ag_joint_graph(jr);
    assert_int_equal(ag_graph_verify(g), 0);
    assert_int_equal(ag_graph_num_subgraphs(g), 2);
    assert_int_equal(count_calls(g, "fw_subgraph_0"), 2);
    assert_int_equal(count_calls(g, "bw_subgraph_0_0"), 2);
    /* the same calling convention (the tied lm_head.weight is a primal of its own, as the
     * export lists named_parameters without removing duplicates) */
    assert_int_equal(ag_joint_num_primals(jr), ag_joint_num_primals(jf));
    assert_int_equal(ag_joint_num_tangents(jr), 1);
    ag_named_tensors pf = {0}, pr = {0};
    assert_int_equal(ag_module_named_parameters(mf, false, &pf), 0);
    assert_int_equal(ag_module_named_parameters(mr, false, &pr), 0);
    assert_int_equal(pf.n + 1, ag_joint_num_primals(jf));
    const ag_tmeta *lm = ag_node_val(ag_node_arg(ag_graph_output_node(g), 0)->u.nodes[0], 0);
    ag_tensor *t = rnd(lm->ndim, lm->sizes, 3);
    ag_tensor *af[64], *ar[64];
    for (int i = 0; i < pf.n; i++) {
        af[i] = pf.tensors[i];
        ar[i] = pr.tensors[i];
    }
    af[pf.n] = in_f[0];
    ar[pf.n] = in_r[0];
    af[pf.n + 1] = ar[pf.n + 1] = t;
    ag_tensor *of[64] = {0}, *orr[64] = {0};
    int kf = ag_graph_run(ag_joint_graph(jf), af, pf.n + 2, of, 64);
    int kr = ag_graph_run(g, ar, pf.n + 2, orr, 64);
    assert_int_equal(kf, pf.n + 2);
    assert_int_equal(kr, kf);
    for (int i = 0; i < kf; i++) {
        if (!of[i]) { /* idx's gradient */
            assert_null(orr[i]);
            continue;
        }
        assert_true(tu_max_abs_diff(of[i], orr[i]) < 1e-4);
        ag_tensor_free(of[i]);
        ag_tensor_free(orr[i]);
    }
    /* The block's partitioned forward saves no view (the transposed weights, the heads'
     * transposes, the reshapes): a saved view would be copied into the caller's buffer at every
     * call; its base is saved instead (a weight: the operand itself) and the backward replays
     * the view on it. */
    ag_graph *pfw = NULL, *pbw = NULL;
    assert_int_equal(ag_partition(g, ag_joint_num_fw_outputs(jr), NULL, &pfw, &pbw, NULL), 0);
    const ag_graph *rfw = ag_graph_subgraph(pfw, "partitioned_fw_subgraph_0_0");
    const ag_graph *rbw = ag_graph_subgraph(pbw, "partitioned_bw_subgraph_0_0");
    assert_non_null(rfw);
    assert_non_null(rbw);
    const ag_garg *ro = ag_node_arg(ag_graph_output_node(rfw), 0);
    ag_node **rph = NULL;
    assert_int_equal(ag_graph_placeholders(rbw, &rph), ro->n); /* saved..., the tangent */
    int saved_weights = 0;
    for (int i = 1; i < ro->n; i++) {
        ag_node *x = ro->u.nodes[i];
        if (ag_node_kind_of(x) == AG_NODE_GETITEM)
            x = ag_node_arg_node(x, 0);
        assert_false(ag_node_kind_of(x) == AG_NODE_CALL &&
                     (ag_op_def(ag_node_op(x))->flags & AG_OP_VIEW));
        saved_weights += ag_node_kind_of(x) == AG_NODE_PLACEHOLDER && ag_node_val(x, 0)->ndim == 2;
    }
    assert_int_equal(saved_weights, 4); /* c_attn, attn.c_proj, c_fc, mlp.c_proj, for their t */
    ag_graph_free(pfw);
    ag_graph_free(pbw);
    /* Compiled with the default options, the region joint's step is the flat one's. */
    ag_compiled *cf = ag_compile_joint(jf, NULL), *cr = ag_compile_joint(jr, NULL);
    assert_non_null(cf);
    assert_non_null(cr);
    ag_tensor *yf = NULL, *yr = NULL;
    assert_int_equal(ag_compiled_call_module(cf, mf, in_f, 1, &yf, 1), 1);
    assert_int_equal(ag_backward(yf, t, false), 0);
    assert_int_equal(ag_compiled_call_module(cr, mr, in_r, 1, &yr, 1), 1);
    assert_int_equal(ag_backward(yr, t, false), 0);
    assert_true(tu_max_abs_diff(yf, yr) < 1e-5);
    for (int i = 0; i < pf.n; i++) {
        assert_non_null(ag_tensor_grad(pr.tensors[i]));
        assert_true(tu_max_abs_diff(ag_tensor_grad(pf.tensors[i]), ag_tensor_grad(pr.tensors[i])) <
                    1e-5);
    }
    ag_tensor_free(yf);
    ag_tensor_free(yr);
    ag_compiled_free(cf);
    ag_compiled_free(cr);
    ag_named_tensors_free(&pf);
    ag_named_tensors_free(&pr);
    ag_tensor_free(t);
    ag_joint_free(jf);
    ag_joint_free(jr);
    ag_tensor_free(in_f[0]);
    ag_tensor_free(in_r[0]);
    ag_module_free(mf);
    ag_module_free(mr);
    /* the option is gpt2's */
    ag_module *m = NULL;
    ag_tensor *in[2];
    int n = 0;
    assert_int_equal(ag_zoo_build_opts("mlp", NULL, &zo, &m, in, 2, &n), AG_EINVAL);
    tu_assert_error_contains("only gpt2");
}

/* ---- checkpointed regions ---- */

/* The forward nodes of g tagged MUST_RECOMPUTE; each has ac_graph_id 1..max_id (seen[id] set). */
static int count_recompute(const ag_graph *g, int max_id, bool *seen) {
    int n = 0;
    for (ag_node *x = ag_graph_first(g); x; x = ag_node_next(x)) {
        if (ag_node_recompute(x) != AG_MUST_RECOMPUTE)
            continue;
        ag_mval id = ag_node_meta_get(x, "ac_graph_id");
        assert_int_equal(id.kind, AG_MV_INT);
        assert_true(id.u.i >= 1 && id.u.i <= max_id);
        seen[id.u.i] = true;
        n++;
    }
    return n;
}

static int count_op(const ag_graph *g, const ag_op *op) {
    int n = 0;
    for (ag_node *x = ag_graph_first(g); x; x = ag_node_next(x))
        n += ag_node_kind_of(x) == AG_NODE_CALL && ag_node_op(x) == op;
    return n;
}

/* The region's partition of j (default options): how many values its forward subgraph saves,
 * how many of them are its operands, and how many tanh its backward subgraph computes. */
static void region_partition(const ag_joint *j, int *saved, int *saved_ops, int *bw_tanh,
                             ag_partition_stats *ps) {
    ag_graph *pfw = NULL, *pbw = NULL;
    assert_int_equal(
        ag_partition(ag_joint_graph(j), ag_joint_num_fw_outputs(j), NULL, &pfw, &pbw, ps), 0);
    const ag_graph *rfw = ag_graph_subgraph(pfw, "partitioned_fw_subgraph_0_0");
    const ag_graph *rbw = ag_graph_subgraph(pbw, "partitioned_bw_subgraph_0_0");
    assert_non_null(rfw);
    assert_non_null(rbw);
    const ag_garg *ro = ag_node_arg(ag_graph_output_node(rfw), 0);
    *saved = ro->n - 1; /* the block's output, then the saved values */
    *saved_ops = 0;
    for (int i = 1; i < ro->n; i++)
        *saved_ops += ag_node_kind_of(ro->u.nodes[i]) == AG_NODE_PLACEHOLDER;
    *bw_tanh = count_op(rbw, ag_op_find("tanh"));
    ag_graph_free(pfw);
    ag_graph_free(pbw);
}

/* Three blocks, each checkpointed and a compile region (upstream's nested_compile_region around
 * a checkpointed function): eager it is checkpointing (output and gradients equal the flat
 * model's); exported the block is traced once (forward and joint subgraphs) with its forward
 * nodes tagged MUST_RECOMPUTE, ac_graph_id 1, in both subgraphs and nothing tagged outside;
 * its partition (once) saves only the block's operands, fewer values than the region without
 * checkpointing, and its backward subgraph recomputes tanh; compiled with either partitioner
 * its output and every gradient equal the flat un-checkpointed model's (within 1e-5). */
static void test_checkpointed_region(void **st) {
    (void)st;
    ag_module *flat = stack_of(3, false, deep_block_forward),
              *reg = stack_of(3, true, deep_block_forward),
              *ck = stack_of(3, true, deep_block_forward);
    for (int i = 0; i < 3; i++) {
        ag_module *b = ag_module_child_at(ck, i, NULL);
        assert_int_equal(ag_module_set_checkpoint(b, true), 0);
        assert_true(ag_module_is_compile_region(b) && ag_module_is_checkpointed(b));
    }
    ag_tensor *x = rnd(2, (int64_t[]){4, 3}, 21);
    ag_tensor *t = rnd(2, (int64_t[]){4, 3}, 22);
    assert_int_equal(ag_tensor_set_requires_grad(x, true), 0);
    ag_named_tensors pf, pc;
    assert_int_equal(ag_module_named_parameters(flat, true, &pf), 0);
    assert_int_equal(ag_module_named_parameters(ck, true, &pc), 0);
    assert_int_equal(pf.n, 6);
    assert_int_equal(pc.n, pf.n);

    /* eager: checkpointing (the backward reruns each block: 3 more forwards) */
    ag_tensor *yf = ag_module_forward(flat, x);
    assert_non_null(yf);
    assert_int_equal(ag_backward(yf, t, false), 0);
    ag_tensor *gxf = ag_tensor_keep(ag_tensor_grad(x));
    assert_int_equal(ag_tensor_set_grad(x, NULL), 0);
    block_calls = 0;
    ag_tensor *yc = ag_module_forward(ck, x);
    assert_non_null(yc);
    assert_int_equal(block_calls, 3);
    assert_int_equal(ag_backward(yc, t, false), 0);
    assert_int_equal(block_calls, 6);
    assert_true(tu_max_abs_diff(yf, yc) == 0);
    assert_true(tu_max_abs_diff(gxf, ag_tensor_grad(x)) == 0);
    for (int i = 0; i < pf.n; i++) {
        assert_true(tu_max_abs_diff(ag_tensor_grad(pf.tensors[i]), ag_tensor_grad(pc.tensors[i])) ==
                    0);
        assert_int_equal(ag_tensor_set_grad(pf.tensors[i], NULL), 0);
        assert_int_equal(ag_tensor_set_grad(pc.tensors[i], NULL), 0);
    }
    assert_int_equal(ag_tensor_set_grad(x, NULL), 0);
    ag_tensor_free(yf);
    ag_tensor_free(yc);
    ag_tensor_free(gxf);

    /* exported */
    ag_joint *jf = ag_export_joint(flat, &x, 1, NULL, NULL, 0, NULL);
    ag_joint *jr = ag_export_joint(reg, &x, 1, NULL, NULL, 0, NULL);
    block_calls = 0;
    ag_joint *jc = ag_export_joint(ck, &x, 1, NULL, NULL, 0, NULL);
    if (!jc)
        print_error("%s\n", ag_last_error());
    assert_non_null(jf);
    assert_non_null(jr);
    assert_non_null(jc);
    assert_int_equal(block_calls, 2); /* the forward subgraph, then the joint subgraph */
    const ag_graph *g = ag_joint_graph(jc);
    assert_int_equal(ag_graph_verify(g), 0);
    assert_int_equal(ag_graph_num_subgraphs(g), 2);
    assert_int_equal(count_calls(g, "fw_subgraph_0"), 3);
    assert_int_equal(count_calls(g, "bw_subgraph_0_0"), 3);
    bool seen[3] = {0};
    assert_int_equal(count_recompute(g, 2, seen), 0);
    const ag_graph *fw = ag_graph_subgraph(g, "repeated_subgraph0");
    const ag_graph *joint = ag_graph_subgraph(g, "repeated_subgraph1");
    int nfw = count_recompute(fw, 1, seen), njoint = count_recompute(joint, 1, seen);
    assert_true(seen[1] && !seen[2]);
    assert_true(nfw >= 5);         /* t, addmm, tanh, mul, sin, mul, add */
    assert_int_equal(njoint, nfw); /* the joint's forward part, none of its backward */
    for (ag_node *n = ag_graph_first(joint); n; n = ag_node_next(n))
        if (ag_node_recompute(n) == AG_MUST_RECOMPUTE)
            assert_true(ag_node_partitioner_tag(n) == NULL ||
                        strcmp(ag_node_partitioner_tag(n), "is_backward"));
    bool none[3] = {0};
    assert_int_equal(
        count_recompute(ag_graph_subgraph(ag_joint_graph(jr), "repeated_subgraph1"), 2, none), 0);

    /* the region's partition: checkpointing saves the operands only and recomputes */
    int sr, sr_ops, tr, sc, sc_ops, tc;
    ag_partition_stats str, stc;
    region_partition(jr, &sr, &sr_ops, &tr, &str);
    region_partition(jc, &sc, &sc_ops, &tc, &stc);
    print_message("region saves %d values (%d operands), checkpointed region %d (%d operands)\n",
                  sr, sr_ops, sc, sc_ops);
    assert_true(sc < sr);
    assert_int_equal(sc, sc_ops);
    assert_int_equal(sr, 5); /* x, lin.weight (for its t), tanh, the mul, sin */
    assert_int_equal(sc, 3); /* x, lin.weight, lin.bias */
    assert_int_equal(tr, 0);
    assert_true(tc >= 1);
    /* the stats count what the regions' backwards recompute, at each of the 3 calls: the
     * checkpointed region's tanh and more on top of what the plain region recomputes (the
     * outer graphs are alike: without the regions' share the two would be equal) */
    print_message("recomputed: region %d nodes %g FLOPs, checkpointed %d nodes %g FLOPs\n",
                  str.recomputed_nodes, str.recomputed_flops, stc.recomputed_nodes,
                  stc.recomputed_flops);
    assert_true(stc.recomputed_nodes >= 3 * tc + str.recomputed_nodes);
    /* at least tanh of [4, 3] more, 3 times */
    assert_true(stc.recomputed_flops >= str.recomputed_flops + 3 * 4 * 3);

    /* compiled: the flat un-checkpointed model's output and gradients */
    for (int k = 0; k < 2; k++) {
        ag_compile_opts co = {0};
        co.partition.partitioner = k ? AG_PARTITION_MINCUT : AG_PARTITION_DEFAULT;
        ag_compiled *cf = ag_compile_joint(jf, &co), *cc = ag_compile_joint(jc, &co);
        if (!cc)
            print_error("%s\n", ag_last_error());
        assert_non_null(cf);
        assert_non_null(cc);
        yf = yc = NULL;
        assert_int_equal(ag_compiled_call_module(cf, flat, &x, 1, &yf, 1), 1);
        assert_int_equal(ag_backward(yf, t, false), 0);
        gxf = ag_tensor_keep(ag_tensor_grad(x));
        assert_int_equal(ag_tensor_set_grad(x, NULL), 0);
        assert_int_equal(ag_compiled_call_module(cc, ck, &x, 1, &yc, 1), 1);
        assert_int_equal(ag_backward(yc, t, false), 0);
        assert_true(tu_max_abs_diff(yf, yc) < 1e-5);
        assert_true(tu_max_abs_diff(gxf, ag_tensor_grad(x)) < 1e-5);
        for (int i = 0; i < pf.n; i++) {
            assert_non_null(ag_tensor_grad(pc.tensors[i]));
            assert_true(tu_max_abs_diff(ag_tensor_grad(pf.tensors[i]),
                                        ag_tensor_grad(pc.tensors[i])) < 1e-5);
            assert_int_equal(ag_tensor_set_grad(pf.tensors[i], NULL), 0);
            assert_int_equal(ag_tensor_set_grad(pc.tensors[i], NULL), 0);
        }
        assert_int_equal(ag_tensor_set_grad(x, NULL), 0);
        ag_tensor_free(gxf);
        ag_tensor_free(yf);
        ag_tensor_free(yc);
        ag_compiled_free(cf);
        ag_compiled_free(cc);
    }
    /* a region and a checkpointed region of one type are two subgraphs */
    ag_module_set_checkpoint(ag_module_child_at(ck, 1, NULL), false);
    ag_joint *jm = ag_export_joint(ck, &x, 1, NULL, NULL, 0, NULL);
    assert_non_null(jm);
    assert_int_equal(ag_graph_num_subgraphs(ag_joint_graph(jm)), 4);
    ag_joint_free(jm);
    ag_named_tensors_free(&pf);
    ag_named_tensors_free(&pc);
    ag_joint_free(jf);
    ag_joint_free(jr);
    ag_joint_free(jc);
    ag_module_free(flat);
    ag_module_free(reg);
    ag_module_free(ck);
    ag_tensor_free(x);
    ag_tensor_free(t);
}

/* ag_checkpoint called twice inside a function region: each checkpoint's nodes are their own
 * region in the subgraphs (ac_graph_id 1 and 2, counted in each subgraph), and the joint
 * compiled equals the one without checkpoints. */
static int ck_sin(void *ud, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)ud;
    (void)nin;
    (void)max_out;
    out[0] = ag_tensor_keep(ag_sin(ag_mul(in[0], in[1])));
    return out[0] ? 1 : ag_last_status();
}

static bool fn_checkpointed;

static int two_checkpoints(void *ud, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)ud;
    (void)nin;
    (void)max_out;
    ag_scope_begin();
    ag_tensor *a = NULL, *b = NULL;
    ag_tensor *in2[2] = {in[0], in[1]};
    if (fn_checkpointed) {
        if (ag_checkpoint(ck_sin, NULL, in2, 2, &a, 1) == 1) {
            in2[0] = a;
            if (ag_checkpoint(ck_sin, NULL, in2, 2, &b, 1) != 1)
                b = NULL;
        }
    } else if (ck_sin(NULL, in2, 2, &a, 1) == 1) {
        in2[0] = a;
        if (ck_sin(NULL, in2, 2, &b, 1) != 1)
            b = NULL;
    }
    out[0] = b ? ag_tensor_keep(ag_tanh(b)) : NULL;
    ag_tensor_free(a);
    ag_tensor_free(b);
    ag_scope_end();
    return out[0] ? 1 : ag_last_status();
}

static int fn_region_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out,
                             int max_out) {
    (void)nin;
    (void)max_out;
    ag_tensor *w = ag_module_param(m, "w"), *y[2] = {0};
    int rc =
        ag_nested_compile_region(two_checkpoints, NULL, (ag_tensor *[]){in[0], w}, 2, &y[0], 1);
    if (rc == 1)
        rc = ag_nested_compile_region(two_checkpoints, NULL, (ag_tensor *[]){y[0], w}, 2, &y[1], 1);
    out[0] = rc == 1 ? y[1] : NULL; /* the region's new reference */
    ag_tensor_free(y[0]);
    if (rc != 1)
        ag_tensor_free(y[1]);
    return rc == 1 ? 1 : ag_last_status();
}

static void test_checkpoint_in_function_region(void **st) {
    (void)st;
    ag_manual_seed(3);
    ag_module *m = ag_module_new("FnRegion", fn_region_forward, NULL, NULL);
    assert_int_equal(
        ag_module_add_tensor(m, "w", true, AG_F32, 2, (int64_t[]){4, 3}, AG_INIT_NORMAL, 0, 1), 0);
    ag_tensor *x = rnd(2, (int64_t[]){4, 3}, 31);
    ag_tensor *t = rnd(2, (int64_t[]){4, 3}, 32);
    assert_int_equal(ag_tensor_set_requires_grad(x, true), 0);
    fn_checkpointed = false;
    ag_joint *jp = ag_export_joint(m, &x, 1, NULL, NULL, 0, NULL);
    fn_checkpointed = true;
    ag_joint *jc = ag_export_joint(m, &x, 1, NULL, NULL, 0, NULL);
    if (!jc)
        print_error("%s\n", ag_last_error());
    assert_non_null(jp);
    assert_non_null(jc);
    const ag_graph *g = ag_joint_graph(jc);
    assert_int_equal(ag_graph_verify(g), 0);
    assert_int_equal(ag_graph_num_subgraphs(g), 2);
    assert_int_equal(count_calls(g, "fw_subgraph_0"), 2);
    bool seen[4] = {0};
    assert_int_equal(count_recompute(g, 3, seen), 0);
    for (int s = 0; s < 2; s++) {
        memset(seen, 0, sizeof seen);
        const ag_graph *sub = ag_graph_subgraph(g, s ? "repeated_subgraph1" : "repeated_subgraph0");
        assert_int_equal(count_recompute(sub, 3, seen), 4); /* mul, sin; mul, sin */
        assert_true(seen[1] && seen[2] && !seen[3]);
        /* the first checkpoint's sin is 1, the second's 2; tanh (outside both) untagged */
        int64_t last = 0;
        for (ag_node *n = ag_graph_first(sub); n; n = ag_node_next(n)) {
            if (ag_node_kind_of(n) == AG_NODE_CALL && ag_node_op(n) == ag_op_find("tanh") &&
                (!ag_node_partitioner_tag(n) || strcmp(ag_node_partitioner_tag(n), "is_backward")))
                assert_int_equal(ag_node_recompute(n), AG_RECOMPUTE_NONE);
            if (ag_node_recompute(n) == AG_MUST_RECOMPUTE) {
                int64_t id = ag_node_meta_get(n, "ac_graph_id").u.i;
                assert_true(id >= last);
                last = id;
            }
        }
    }
    ag_compiled *cp = ag_compile_joint(jp, NULL), *cc = ag_compile_joint(jc, NULL);
    if (!cc)
        print_error("%s\n", ag_last_error());
    assert_non_null(cp);
    assert_non_null(cc);
    ag_tensor *yp = NULL, *yc = NULL;
    ag_tensor *w = ag_module_param(m, "w");
    assert_int_equal(ag_compiled_call_module(cp, m, &x, 1, &yp, 1), 1);
    assert_int_equal(ag_backward(yp, t, false), 0);
    ag_tensor *gx = ag_tensor_keep(ag_tensor_grad(x)), *gw = ag_tensor_keep(ag_tensor_grad(w));
    assert_int_equal(ag_tensor_set_grad(x, NULL), 0);
    assert_int_equal(ag_tensor_set_grad(w, NULL), 0);
    assert_int_equal(ag_compiled_call_module(cc, m, &x, 1, &yc, 1), 1);
    assert_int_equal(ag_backward(yc, t, false), 0);
    assert_true(tu_max_abs_diff(yp, yc) < 1e-6);
    assert_true(tu_max_abs_diff(gx, ag_tensor_grad(x)) < 1e-6);
    assert_true(tu_max_abs_diff(gw, ag_tensor_grad(w)) < 1e-6);
    ag_tensor_free(gx);
    ag_tensor_free(gw);
    ag_tensor_free(yp);
    ag_tensor_free(yc);
    ag_compiled_free(cp);
    ag_compiled_free(cc);
    ag_joint_free(jp);
    ag_joint_free(jc);
    ag_tensor_free(x);
    ag_tensor_free(t);
    ag_module_free(m);
}

/* The other nesting, checkpoint(region): fn_region_forward's two region calls inside one
 * ag_checkpoint. The region is checkpointed too: both subgraphs' forward nodes tagged
 * (ac_graph_id 1), its partition saves its operands only (the plain region's saves more);
 * eager and compiled with either partitioner (min-cut also under memory budgets) it equals
 * the model without the checkpoint (within 1e-6). */
static int checkpointed_regions(void *ud, ag_tensor *const *in, int nin, ag_tensor **out,
                                int max_out) {
    return fn_region_forward(ud, in, nin, out, max_out);
}

static int ckpt_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    return ag_checkpoint(checkpointed_regions, m, in, nin, out, max_out);
}

static ag_module *fn_region_module(ag_forward_fn forward) {
    ag_manual_seed(3);
    ag_module *m = ag_module_new("FnRegion", forward, NULL, NULL);
    assert_int_equal(
        ag_module_add_tensor(m, "w", true, AG_F32, 2, (int64_t[]){4, 3}, AG_INIT_NORMAL, 0, 1), 0);
    return m;
}

static void test_region_in_checkpoint(void **st) {
    (void)st;
    fn_checkpointed = false;
    ag_module *mp = fn_region_module(fn_region_forward), *mc = fn_region_module(ckpt_forward);
    ag_tensor *wp = ag_module_param(mp, "w"), *wc = ag_module_param(mc, "w");
    assert_true(tu_max_abs_diff(wp, wc) == 0);
    ag_tensor *x = rnd(2, (int64_t[]){4, 3}, 41);
    ag_tensor *t = rnd(2, (int64_t[]){4, 3}, 42);
    assert_int_equal(ag_tensor_set_requires_grad(x, true), 0);
    ag_joint *jp = ag_export_joint(mp, &x, 1, NULL, NULL, 0, NULL);
    ag_joint *jc = ag_export_joint(mc, &x, 1, NULL, NULL, 0, NULL);
    if (!jc)
        print_error("%s\n", ag_last_error());
    assert_non_null(jp);
    assert_non_null(jc);
    const ag_graph *g = ag_joint_graph(jc);
    assert_int_equal(ag_graph_verify(g), 0);
    assert_int_equal(ag_graph_num_subgraphs(g), 2);
    bool seen[3] = {0};
    for (int s = 0; s < 2; s++) {
        const ag_graph *sub = ag_graph_subgraph(g, s ? "repeated_subgraph1" : "repeated_subgraph0");
        assert_int_equal(count_recompute(sub, 1, seen), 5); /* mul, sin, mul, sin, tanh */
    }
    int sp, sp_ops, tp, sc, sc_ops, tc;
    region_partition(jp, &sp, &sp_ops, &tp, NULL);
    region_partition(jc, &sc, &sc_ops, &tc, NULL);
    assert_int_equal(sc, 2); /* its two operands */
    assert_int_equal(sc_ops, 2);
    assert_true(sp > sc);
    assert_true(tc >= 1); /* the backward recomputes the tanh */
    assert_int_equal(tp, 0);
    /* eager, then compiled */
    for (int k = 0; k < 5; k++) { /* eager; default; min-cut at budgets 1, 0 and 0.5 */
        ag_compile_opts co = {0};
        co.partition.partitioner = k >= 2 ? AG_PARTITION_MINCUT : AG_PARTITION_DEFAULT;
        co.partition.memory_budget = k == 3 ? AG_MEMORY_BUDGET_ZERO : k == 4 ? 0.5 : 1.0;
        ag_compiled *cp = k ? ag_compile_joint(jp, &co) : NULL;
        ag_compiled *cc = k ? ag_compile_joint(jc, &co) : NULL;
        ag_tensor *yp = NULL, *yc = NULL;
        if (k) {
            assert_non_null(cp);
            assert_non_null(cc);
            assert_int_equal(ag_compiled_call_module(cp, mp, &x, 1, &yp, 1), 1);
        } else {
            assert_non_null(yp = ag_module_forward(mp, x));
        }
        assert_int_equal(ag_backward(yp, t, false), 0);
        ag_tensor *gx = ag_tensor_keep(ag_tensor_grad(x));
        assert_int_equal(ag_tensor_set_grad(x, NULL), 0);
        if (k)
            assert_int_equal(ag_compiled_call_module(cc, mc, &x, 1, &yc, 1), 1);
        else
            assert_non_null(yc = ag_module_forward(mc, x));
        assert_int_equal(ag_backward(yc, t, false), 0);
        assert_true(tu_max_abs_diff(yp, yc) < 1e-6);
        assert_true(tu_max_abs_diff(gx, ag_tensor_grad(x)) < 1e-6);
        assert_true(tu_max_abs_diff(ag_tensor_grad(wp), ag_tensor_grad(wc)) < 1e-6);
        assert_int_equal(ag_tensor_set_grad(x, NULL), 0);
        assert_int_equal(ag_tensor_set_grad(wp, NULL), 0);
        assert_int_equal(ag_tensor_set_grad(wc, NULL), 0);
        ag_tensor_free(gx);
        ag_tensor_free(yp);
        ag_tensor_free(yc);
        ag_compiled_free(cp);
        ag_compiled_free(cc);
    }
    ag_joint_free(jp);
    ag_joint_free(jc);
    ag_tensor_free(x);
    ag_tensor_free(t);
    ag_module_free(mp);
    ag_module_free(mc);
}

/* The tiny GPT-2 with its blocks both checkpointed and compile regions (ag_gpt2_config's
 * checkpoint_blocks and compile_region_blocks): one block traced once, its joint subgraph's
 * forward nodes tagged, its partition saving fewer values than the plain regions'; compiled,
 * the flat un-checkpointed model's logits and gradients (within 1e-5). (Dropout in regions:
 * test_region_random.c.) */
static ag_module *gpt2_with(bool regions, bool ckpt) {
    ag_gpt2_config cfg = ag_gpt2_config_tiny();
    cfg.compile_region_blocks = regions;
    cfg.checkpoint_blocks = ckpt;
    ag_manual_seed(5);
    ag_module *m = ag_nn_gpt2(&cfg);
    assert_non_null(m);
    return m;
}

static void test_gpt2_checkpointed_regions(void **st) {
    (void)st;
    ag_module *mf = gpt2_with(false, false), *mr = gpt2_with(true, false),
              *mc = gpt2_with(true, true);
    ag_module *h1 = ag_module_child(mc, "transformer.h.1");
    assert_true(ag_module_is_compile_region(h1) && ag_module_is_checkpointed(h1));
    ag_tensor *idx = ag_zeros(AG_I64, 2, (int64_t[]){2, 16});
    int64_t *d = ag_tensor_data(idx);
    for (int i = 0; i < 32; i++)
        d[i] = (i * 37 + 11) % 256;
    ag_joint *jf = ag_export_joint(mf, &idx, 1, NULL, NULL, 0, NULL);
    ag_joint *jr = ag_export_joint(mr, &idx, 1, NULL, NULL, 0, NULL);
    ag_joint *jc = ag_export_joint(mc, &idx, 1, NULL, NULL, 0, NULL);
    if (!jc)
        print_error("%s\n", ag_last_error());
    assert_non_null(jf);
    assert_non_null(jr);
    assert_non_null(jc);
    const ag_graph *g = ag_joint_graph(jc);
    assert_int_equal(ag_graph_num_subgraphs(g), 2);
    assert_int_equal(count_calls(g, "bw_subgraph_0_0"), 2);
    bool seen[3] = {0};
    assert_true(count_recompute(ag_graph_subgraph(g, "repeated_subgraph1"), 1, seen) > 10);
    int sr, sr_ops, tr, sc, sc_ops, tc;
    region_partition(jr, &sr, &sr_ops, &tr, NULL);
    region_partition(jc, &sc, &sc_ops, &tc, NULL);
    print_message("gpt2 block saves %d values, checkpointed %d (%d operands)\n", sr, sc, sc_ops);
    assert_true(sc < sr);
    assert_int_equal(sc, sc_ops); /* operands only */
    ag_compiled *cf = ag_compile_joint(jf, NULL), *cc = ag_compile_joint(jc, NULL);
    assert_non_null(cf);
    assert_non_null(cc);
    ag_tensor *yf = NULL, *yc = NULL;
    assert_int_equal(ag_compiled_call_module(cf, mf, &idx, 1, &yf, 1), 1);
    ag_tensor *t = rnd(ag_tensor_ndim(yf), ag_tensor_sizes(yf), 6);
    assert_int_equal(ag_backward(yf, t, false), 0);
    assert_int_equal(ag_compiled_call_module(cc, mc, &idx, 1, &yc, 1), 1);
    assert_int_equal(ag_backward(yc, t, false), 0);
    assert_true(tu_max_abs_diff(yf, yc) < 1e-5);
    ag_named_tensors pf, pc;
    assert_int_equal(ag_module_named_parameters(mf, true, &pf), 0);
    assert_int_equal(ag_module_named_parameters(mc, true, &pc), 0);
    assert_int_equal(pf.n, pc.n);
    for (int i = 0; i < pf.n; i++) {
        assert_string_equal(pf.names[i], pc.names[i]);
        assert_non_null(ag_tensor_grad(pc.tensors[i]));
        assert_true(tu_max_abs_diff(ag_tensor_grad(pf.tensors[i]), ag_tensor_grad(pc.tensors[i])) <
                    1e-5);
    }
    ag_named_tensors_free(&pf);
    ag_named_tensors_free(&pc);
    ag_tensor_free(yf);
    ag_tensor_free(yc);
    ag_tensor_free(t);
    ag_compiled_free(cf);
    ag_compiled_free(cc);
    ag_joint_free(jf);
    ag_joint_free(jr);
    ag_joint_free(jc);
    ag_tensor_free(idx);
    ag_module_free(mf);
    ag_module_free(mr);
    ag_module_free(mc);
}

/* The same model sharded (fsdp, rank 0 of 2: the sharding pass inlines the regions and merges
 * their joint subgraphs' forward copies): checkpointed blocks as regions save and recompute
 * exactly what plain checkpointed blocks do. The inlined copies of each call get their own
 * ac_graph_id and the call's partitioner tag; with one id for all calls, two blocks in a row
 * were one checkpointed region and the block boundary was recomputed (131 nodes against 117),
 * and the joint subgraph's backward nodes, untagged, were counted as recomputed. */
static void test_gpt2_checkpointed_regions_sharded(void **st) {
    (void)st;
    ag_module *mp = gpt2_with(false, true), *mc = gpt2_with(true, true);
    ag_tensor *idx = ag_zeros(AG_I64, 2, (int64_t[]){4, 16});
    int64_t *d = ag_tensor_data(idx);
    for (int i = 0; i < 64; i++)
        d[i] = (i * 37 + 11) % 256;
    ag_partition_stats s[2];
    ag_graph *bws[2];
    ag_mesh mesh = {.size = 2, .rank = 0};
    for (int k = 0; k < 2; k++) {
        ag_joint *j = ag_export_joint(k ? mc : mp, &idx, 1, NULL, NULL, 0, NULL);
        assert_non_null(j);
        ag_shard_plan *plan = ag_shard_plan_fsdp(j, &mesh);
        assert_non_null(plan);
        ag_joint *sj = ag_shard_joint(j, &mesh, plan);
        assert_non_null(sj);
        assert_int_equal(ag_graph_num_subgraphs(ag_joint_graph(sj)), 0);
        ag_graph *fw = NULL;
        ag_partition_opts po = {.partitioner = AG_PARTITION_MINCUT};
        assert_int_equal(
            ag_partition(ag_joint_graph(sj), ag_joint_num_fw_outputs(sj), &po, &fw, &bws[k], &s[k]),
            0);
        ag_graph_free(fw);
        ag_joint_free(sj);
        ag_shard_plan_free(plan);
        ag_joint_free(j);
    }
    print_message("sharded: checkpointed blocks recompute %d nodes (%.3g FLOPs), as regions %d "
                  "(%.3g)\n",
                  s[0].recomputed_nodes, s[0].recomputed_flops, s[1].recomputed_nodes,
                  s[1].recomputed_flops);
    assert_true(s[0].recomputed_nodes > 0);
    assert_int_equal(s[1].recomputed_nodes, s[0].recomputed_nodes);
    assert_true(s[1].recomputed_flops == s[0].recomputed_flops);
    assert_int_equal(s[1].saved_tensors, s[0].saved_tensors);
    assert_int_equal(s[1].saved_bytes, s[0].saved_bytes);
    assert_int_equal(ag_graph_num_nodes(bws[1]), ag_graph_num_nodes(bws[0]));
    ag_graph_free(bws[0]);
    ag_graph_free(bws[1]);
    ag_tensor_free(idx);
    ag_module_free(mp);
    ag_module_free(mc);
}

/* ---- refusals ---- */

typedef struct bad {
    int kind;
    ag_tensor *captured; /* kind 0: read without passing it */
} bad;

static int bad_region(void *ud, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)nin;
    (void)max_out;
    bad *b = ud;
    ag_scope_begin();
    ag_tensor *y = NULL;
    switch (b->kind) {
    case 0:
        y = ag_tensor_keep(ag_mul(in[0], b->captured));
        break;
    case 1:
        if (ag_mul_scalar_(in[0], 2.0))
            y = ag_tensor_keep(ag_sin(in[0]));
        break;
    case 2:
        y = ag_tensor_keep(ag_mul(in[0], ag_rand(AG_F32, 2, (int64_t[]){4, 3})));
        break;
    case 3:
        y = ag_tensor_keep(ag_view(in[0], 1, (int64_t[]){12}));
        break;
    }
    ag_scope_end();
    out[0] = y;
    return y ? 1 : ag_last_status();
}

typedef struct bad_mod {
    bad b;
} bad_mod;

static int bad_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)nin;
    (void)max_out;
    bad *b = ag_module_ud(m);
    b->captured = ag_module_param(m, "w");
    ag_tensor *h[1];
    ag_scope_begin();
    ag_tensor *x = ag_mul_scalar(in[0], 1.0); /* not a leaf: in-place on it is allowed eagerly */
    int rc = ag_nested_compile_region(bad_region, b, &x, 1, h, 1);
    if (rc == 1)
        out[0] = ag_tensor_keep(ag_sum_all(h[0]));
    ag_scope_end();
    if (rc == 1)
        ag_tensor_free(h[0]);
    return rc == 1 ? 1 : rc;
}

static void test_refusals(void **st) {
    (void)st;
    const char *want[] = {"pass it as an input", "mutates", "random op",
                          "output 0 aliases operand 0"};
    for (int kind = 0; kind < 4; kind++) {
        bad *b = calloc(1, sizeof *b);
        b->kind = kind;
        ag_module *m = ag_module_new("Bad", bad_forward, b, free);
        assert_int_equal(
            ag_module_add_tensor(m, "w", true, AG_F32, 2, (int64_t[]){4, 3}, AG_INIT_ONES, 0, 0),
            0);
        ag_tensor *x = rnd(2, (int64_t[]){4, 3}, 41);
        assert_int_equal(ag_tensor_set_requires_grad(x, true), 0);
        /* eager, each runs (a region is just its function) */
        ag_tensor *ye = NULL;
        assert_int_equal(ag_module_call(m, &x, 1, &ye, 1), 1);
        ag_tensor_free(ye);
        ag_joint *j = ag_export_joint(m, &x, 1, NULL, NULL, 0, NULL);
        if (kind == 2) { /* the joint export functionalizes the draw (test_region_random.c) */
            assert_non_null(j);
            ag_joint_free(j);
        } else {
            assert_null(j);
            tu_assert_error_contains("nested_compile_region function");
            tu_assert_error_contains(want[kind]);
        }
        if (kind == 1)
            tu_assert_error_contains("in place");
        /* a trace without RNG functionalization cannot give a region's calls their own draws */
        ag_graph *g = ag_trace_module(m, &x, 1, NULL);
        assert_null(g);
        tu_assert_error_contains(want[kind]);
        ag_module_free(m);
        ag_tensor_free(x);
    }
    /* bad arguments */
    ag_tensor *o[1];
    ag_tensor *x = rnd(1, (int64_t[]){3}, 1);
    assert_int_equal(ag_nested_compile_region(NULL, NULL, &x, 1, o, 1), AG_EINVAL);
    assert_int_equal(ag_nested_compile_region(twice_sin, NULL, &x, 1, NULL, 1), AG_EINVAL);
    assert_int_equal(ag_nested_compile_region(twice_sin, NULL, &x, 1, o, 0), AG_EINVAL);
    ag_clear_error(); /* a NULL input with an error pending is that error's (a failed op's) */
    assert_int_equal(ag_nested_compile_region(twice_sin, NULL, (ag_tensor *[]){NULL}, 1, o, 1),
                     AG_EINVAL);
    tu_assert_error_contains("input 0 is NULL");
    ag_module *c = ag_module_new("Container", NULL, NULL, NULL);
    assert_int_equal(ag_module_set_compile_region(c, true), AG_EINVAL);
    tu_assert_error_contains("cannot be a compile region");
    assert_int_equal(ag_module_set_compile_region(NULL, true), AG_EINVAL);
    assert_false(ag_module_is_compile_region(NULL));
    ag_module_free(c);
    ag_tensor_free(x);
}

/* ---- allocation failures ---- */

static int oom_export(void *ud) {
    ag_module *m = ud;
    ag_tensor *x = ag_randn(AG_F32, 2, (int64_t[]){4, 3});
    if (!x)
        return ag_last_status();
    int rc = ag_tensor_set_requires_grad(x, true);
    ag_joint *j = rc ? NULL : ag_export_joint(m, &x, 1, NULL, NULL, 0, NULL);
    rc = j ? 0 : ag_last_status();
    ag_joint_free(j);
    ag_tensor_free(x);
    return rc;
}

/* Partitioning a joint whose region saves views (each block's t of its weight): the region's
 * partition, its saved views turned into their bases, the calls rewritten. */
static int oom_partition(void *ud) {
    const ag_joint *j = ud;
    ag_graph *fw = NULL, *bw = NULL;
    int rc = ag_partition(ag_joint_graph(j), ag_joint_num_fw_outputs(j), NULL, &fw, &bw, NULL);
    ag_graph_free(fw);
    ag_graph_free(bw);
    return rc;
}

static void test_out_of_memory(void **st) {
    (void)st;
    ag_module *m = mymod_new(true);
    tu_sweep_opts o = {.what = "nested region export", .one_thread = true};
    assert_true(tu_alloc_failure_sweep(oom_export, m, &o) > 10);
    o.persistent = true;
    assert_true(tu_alloc_failure_sweep(oom_export, m, &o) > 10);
    ag_module_free(m);
    /* three calls of one region with parameters: the cache hit path and the backward calls */
    m = stack_new(3, true);
    o = (tu_sweep_opts){.what = "three region calls", .one_thread = true};
    assert_true(tu_alloc_failure_sweep(oom_export, m, &o) > 10);
    ag_tensor *x = rnd(2, (int64_t[]){4, 3}, 11);
    assert_int_equal(ag_tensor_set_requires_grad(x, true), 0);
    ag_joint *j = ag_export_joint(m, &x, 1, NULL, NULL, 0, NULL);
    assert_non_null(j);
    o = (tu_sweep_opts){.what = "partition of three region calls", .one_thread = true};
    assert_true(tu_alloc_failure_sweep(oom_partition, j, &o) > 10);
    o.persistent = true;
    assert_true(tu_alloc_failure_sweep(oom_partition, j, &o) > 10);
    ag_joint_free(j);
    ag_module_free(m);
    /* checkpointed regions: the checkpoint state set around the region's body, the key */
    m = stack_of(3, true, deep_block_forward);
    for (int i = 0; i < 3; i++)
        assert_int_equal(ag_module_set_checkpoint(ag_module_child_at(m, i, NULL), true), 0);
    o = (tu_sweep_opts){.what = "three checkpointed region calls", .one_thread = true};
    assert_true(tu_alloc_failure_sweep(oom_export, m, &o) > 10);
    ag_module *plain = stack_new(3, true); /* no checkpoint state left behind by the failures */
    j = ag_export_joint(plain, &x, 1, NULL, NULL, 0, NULL);
    assert_non_null(j);
    bool seen[2] = {0};
    assert_int_equal(
        count_recompute(ag_graph_subgraph(ag_joint_graph(j), "repeated_subgraph1"), 1, seen), 0);
    ag_joint_free(j);
    ag_module_free(plain);
    j = ag_export_joint(m, &x, 1, NULL, NULL, 0, NULL);
    assert_non_null(j);
    o = (tu_sweep_opts){.what = "partition of checkpointed regions", .one_thread = true};
    assert_true(tu_alloc_failure_sweep(oom_partition, j, &o) > 10);
    ag_joint_free(j);
    ag_tensor_free(x);
    ag_module_free(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_upstream_23),
        cmocka_unit_test(test_three_calls_trace_once),
        cmocka_unit_test(test_eager),
        cmocka_unit_test(test_two_shapes_trace_twice),
        cmocka_unit_test(test_inference_trace),
        cmocka_unit_test(test_region_in_region),
        cmocka_unit_test(test_backward_in_trace),
        cmocka_unit_test(test_module_backward_in_trace),
        cmocka_unit_test(test_gpt2_blocks),
        cmocka_unit_test(test_checkpointed_region),
        cmocka_unit_test(test_checkpoint_in_function_region),
        cmocka_unit_test(test_region_in_checkpoint),
        cmocka_unit_test(test_gpt2_checkpointed_regions),
        cmocka_unit_test(test_gpt2_checkpointed_regions_sharded),
        cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_out_of_memory),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
