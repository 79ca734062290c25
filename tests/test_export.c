/* Conformance: upstream's test_aot_joint_with_descriptors.py, in C (spec section 9), plus
 * numerics of every zoo model's joint graph against eager.
 *
 * Name mapping: aotgrad names nodes as FX does (op base name, _1, _2, ...; `sum` and `slice`
 * start at _1). Op spellings differ only where upstream shows prims from its decomposition
 * table (transpose, broadcast_in_dim); the core decomposition here emits ATen ops
 * (transpose.int, mul.Scalar, add.Tensor), and the tests state what they expect. */
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- helpers ---- */

static char *repr(const ag_desc *d) {
    static char buf[8][512];
    static int k;
    k = (k + 1) % 8;
    ag_desc_repr(d, buf[k], sizeof buf[k]);
    return buf[k];
}

/* Asserts the placeholders' names and descriptor reprs. */
static void expect_placeholders(const ag_graph *g, const char *const *names,
                                const char *const *descs, int n) {
    ag_node **ph;
    int cnt = ag_graph_placeholders(g, &ph);
    assert_int_equal(cnt, n);
    for (int i = 0; i < n; i++) {
        assert_string_equal(ag_node_name(ph[i]), names[i]);
        assert_string_equal(repr(ag_node_desc(ph[i])), descs[i]);
    }
}

/* Asserts the output node's arguments (node names or "None") and descriptor reprs. */
static void expect_outputs(const ag_graph *g, const char *const *names, const char *const *descs,
                           int n) {
    ag_node *out = ag_graph_output_node(g);
    assert_non_null(out);
    const ag_garg *a = ag_node_arg(out, 0);
    assert_int_equal(a->n, n);
    for (int i = 0; i < n; i++) {
        const char *nm = a->u.nodes[i] ? ag_node_name(a->u.nodes[i]) : "None";
        if (names)
            assert_string_equal(nm, names[i]);
        assert_string_equal(repr(ag_node_output_desc(out, i)), descs[i]);
    }
}

/* "name:op" for every call node in order, joined by spaces. */
static void call_sequence(const ag_graph *g, char *buf, size_t n) {
    size_t k = 0;
    buf[0] = 0;
    for (ag_node *x = ag_graph_first(g); x; x = ag_node_next(x))
        if (ag_node_kind_of(x) == AG_NODE_CALL)
            k += (size_t)snprintf(buf + k, n - k, "%s%s", k ? " " : "", ag_node_name(x));
}

/* upstream's _get_custom_metadata: (name, custom) for nodes with a non-empty custom map. */
static void custom_listing(const ag_graph *g, char *buf, size_t n) {
    size_t k = 0;
    buf[0] = 0;
    for (ag_node *x = ag_graph_first(g); x; x = ag_node_next(x)) {
        int c = ag_node_custom_count(x);
        if (!c)
            continue;
        k += (size_t)snprintf(buf + k, n - k, "%s%s{", k ? " " : "", ag_node_name(x));
        for (int i = 0; i < c; i++) {
            ag_mval v;
            const char *key = ag_node_custom_key_at(x, i, &v);
            if (v.kind == AG_MV_INT)
                k += (size_t)snprintf(buf + k, n - k, "%s%s:%lld", i ? "," : "", key,
                                      (long long)v.u.i);
            else if (v.kind == AG_MV_STR)
                k += (size_t)snprintf(buf + k, n - k, "%s%s:%s", i ? "," : "", key, v.u.s);
        }
        k += (size_t)snprintf(buf + k, n - k, "}");
    }
}

/* Asserts the whole printed graph, line by line, against a golden written from the spec
 * (shared/spec section 9 and the section 3 example). Printed without metadata (seq_nr, tags,
 * annotations, module stacks, stack traces: checked separately where a test cares), so each
 * line is a placeholder with its value and descriptor, a node with its op, arguments and
 * value, or the output with its descriptors. A mismatch names the line, both texts. */
static void expect_printed_n(const ag_graph *g, const char *const *golden, int n) {
    ag_print_opts po = {.no_meta = true, .no_custom = true};
    char *text = ag_graph_to_string(g, &po);
    assert_non_null(text);
    char *line = text;
    int i = 0;
    for (; *line && i < n; i++) {
        char *end = strchr(line, '\n');
        if (end)
            *end = 0;
        if (strcmp(line, golden[i]) != 0) {
            print_error("printed graph line %d:\n  want: %s\n  got:  %s\n", i + 1, golden[i], line);
            ag_free(text);
            fail();
        }
        line = end ? end + 1 : line + strlen(line);
    }
    if (i != n || *line) {
        print_error("printed graph: %d lines expected, the text %s at line %d:\n  %s\n", n,
                    i < n ? "ends" : "goes on", i + 1, i < n ? golden[i] : line);
        ag_free(text);
        fail();
    }
    ag_free(text);
}

/* Asserts every node's partitioner tag (spec section 5): tangent placeholders and the nodes
 * from first_bw on are "is_backward", the rest "is_forward". */
static void expect_tags(const ag_graph *g, const char *first_bw) {
    bool bw = false;
    for (ag_node *x = ag_graph_first(g); x; x = ag_node_next(x)) {
        if (ag_node_kind_of(x) == AG_NODE_OUTPUT)
            continue;
        bw |= !strcmp(ag_node_name(x), first_bw);
        bool tangent = !strncmp(ag_node_name(x), "tangents_", 9);
        const char *want = bw || tangent ? "is_backward" : "is_forward";
        const char *got = ag_node_partitioner_tag(x);
        if (!got || strcmp(got, want)) {
            print_error("%%%s: partitioner_tag %s, want %s\n", ag_node_name(x),
                        got ? got : "(none)", want);
            fail();
        }
    }
    assert_true(bw);
}

#define expect_printed(g, ...)                                                                     \
    expect_printed_n((g), (const char *[]){__VA_ARGS__},                                           \
                     (int)(sizeof((const char *[]){__VA_ARGS__}) / sizeof(const char *)))

static ag_node *find(const ag_graph *g, const char *name) {
    ag_node *n = ag_graph_find(g, name);
    if (!n)
        print_error("no node named %s\n", name);
    assert_non_null(n);
    return n;
}

static ag_joint *export_zoo(const char *name, bool core, ag_module **m_out, ag_tensor **in,
                            int *nin) {
    ag_module *m;
    assert_int_equal(ag_zoo_build(name, NULL, &m, in, 8, nin), 0);
    ag_decomp_table *t = core ? ag_decomp_table_core() : NULL;
    ag_export_opts o = {.decompositions = t};
    ag_joint *j = ag_export_joint(m, in, *nin, NULL, NULL, 0, &o);
    if (!j)
        print_error("export %s: %s\n", name, ag_last_error());
    assert_non_null(j);
    assert_int_equal(ag_graph_verify(ag_joint_graph(j)), 0);
    ag_decomp_table_free(t);
    if (m_out)
        *m_out = m;
    else
        ag_module_free(m);
    return j;
}

static void free_inputs(ag_tensor **in, int n) {
    for (int i = 0; i < n; i++)
        ag_tensor_free(in[i]);
}

/* ---- 1. simple linear ---- */

static void test_simple_linear(void **st) {
    (void)st;
    ag_tensor *in[8];
    int nin;
    ag_joint *j = export_zoo("linear", false, NULL, in, &nin);
    const ag_graph *g = ag_joint_graph(j);
    expect_placeholders(g, (const char *[]){"primals_1", "primals_2", "primals_3", "tangents_1"},
                        (const char *[]){"ParamAOTInput(target='linear.weight')",
                                         "ParamAOTInput(target='linear.bias')",
                                         "PlainAOTInput(idx=0)",
                                         "TangentAOTInput(output=PlainAOTOutput(idx=0))"},
                        4);
    /* The x placeholder does not require grad: its grad is None (4 outputs, the last None). */
    expect_outputs(g, (const char *[]){"addmm", "t_3", "view", "None"},
                   (const char *[]){"PlainAOTOutput(idx=0)",
                                    "GradAOTOutput(grad_of=ParamAOTInput(target='linear.weight'))",
                                    "GradAOTOutput(grad_of=ParamAOTInput(target='linear.bias'))",
                                    "None"},
                   4);
    char seq[1024];
    call_sequence(g, seq, sizeof seq);
    /* Upstream's order (tests 13/22): forward t, addmm; backward of addmm computes mat2's grad
     * (t, mm, t), then the bias grad is reduced to its shape (sum, view), then t's backward. */
    assert_string_equal(seq, "t addmm t_1 mm t_2 sum_1 view t_3");
    /* The whole joint without decompositions: upstream's ATen graph for decompositions=None
     * (the names of tests 13 and 22). Differences from upstream's printing: ops carry their
     * overload only where ATen's default is not meant (sum.dim_IntList), a value prints its
     * strides when not contiguous ({1, 3}), and keepdim prints as Python's True. */
    expect_printed(
        g, "graph():", "    %primals_1 : f32[2, 3]  # ParamAOTInput(target='linear.weight')",
        "    %primals_2 : f32[2]  # ParamAOTInput(target='linear.bias')",
        "    %primals_3 : f32[4, 3]  # PlainAOTInput(idx=0)",
        "    %tangents_1 : f32[4, 2]  # TangentAOTInput(output=PlainAOTOutput(idx=0))",
        "    %t = t(%primals_1)  # f32[3, 2]{1, 3}",
        "    %addmm = addmm(%primals_2, %primals_3, %t)  # f32[4, 2]",
        /* addmm's backward: mat2's grad as (grad^T @ mat1)^T, then the bias grad */
        "    %t_1 = t(%tangents_1)  # f32[2, 4]{1, 2}",
        "    %mm = mm(%t_1, %primals_3)  # f32[2, 3]", "    %t_2 = t(%mm)  # f32[3, 2]{1, 3}",
        "    %sum_1 = sum.dim_IntList(%tangents_1, [0], True)  # f32[1, 2]",
        "    %view = view(%sum_1, [2])  # f32[2]",
        "    %t_3 = t(%t_2)  # f32[2, 3]", /* t's backward: the weight's grad */
        "    return (%addmm, %t_3, %view, None)  # [PlainAOTOutput(idx=0), "
        "GradAOTOutput(grad_of=ParamAOTInput(target='linear.weight')), "
        "GradAOTOutput(grad_of=ParamAOTInput(target='linear.bias')), None]", );
    expect_tags(g, "t_1");
    assert_string_equal(ag_node_partitioner_tag(find(g, "addmm")), "is_forward");
    assert_string_equal(ag_node_partitioner_tag(find(g, "mm")), "is_backward");
    assert_string_equal(ag_node_partitioner_tag(find(g, "tangents_1")), "is_backward");
    /* Backward nodes carry their forward op's seq_nr. */
    assert_int_equal(ag_node_seq_nr(find(g, "mm")), ag_node_seq_nr(find(g, "addmm")));
    assert_int_equal(ag_node_seq_nr(find(g, "t_3")), ag_node_seq_nr(find(g, "t")));
    assert_int_equal(ag_joint_num_fw_outputs(j), 1);
    assert_true(ag_joint_needs_autograd(j));
    ag_joint_free(j);
    free_inputs(in, nin);
}

static void test_simple_linear_core_decompositions(void **st) {
    (void)st;
    ag_tensor *in[8];
    int nin;
    ag_joint *j = export_zoo("linear", true, NULL, in, &nin);
    const ag_graph *g = ag_joint_graph(j);
    int n_t = 0, n_addmm = 0, n_transpose = 0, n_mm = 0;
    for (ag_node *x = ag_graph_first(g); x; x = ag_node_next(x)) {
        if (ag_node_kind_of(x) != AG_NODE_CALL)
            continue;
        const char *op = ag_op_name(ag_node_op(x));
        n_t += !strcmp(op, "t");
        n_addmm += !strcmp(op, "addmm");
        n_transpose += !strcmp(op, "transpose.int");
        n_mm += !strcmp(op, "mm");
    }
    /* Upstream shows transpose, mm, mul, broadcast, add rather than addmm. */
    assert_int_equal(n_t, 0);
    assert_int_equal(n_addmm, 0);
    assert_int_equal(n_transpose, 4);
    assert_int_equal(n_mm, 2);
    expect_outputs(g, NULL,
                   (const char *[]){"PlainAOTOutput(idx=0)",
                                    "GradAOTOutput(grad_of=ParamAOTInput(target='linear.weight'))",
                                    "GradAOTOutput(grad_of=ParamAOTInput(target='linear.bias'))",
                                    "None"},
                   4);
    /* The spec's section 3 example, line by line. Where we differ from upstream, and why:
     * - upstream's table decomposes to prims (transpose, broadcast_in_dim, as_strided); the
     *   core table emits ATen ops (transpose.int, mul.Scalar, add.Tensor broadcasting by
     *   itself, view), so upstream's broadcast_in_dim(b, [4, 2], [1]) before the add, and the
     *   bias grad's broadcast_in_dim(sum, [1, 2], [1]) + as_strided(.., [2], [1]), are here
     *   sum with keepdim + view, and the bias grad output is %view instead of %as_strided;
     * - upstream decomposes while tracing, so the forward mm is `mm` and the backward one
     *   `mm_1`; the core table runs as a pass after the trace, when the backward's mm (from
     *   addmm's backward rule, which is not decomposed) already holds the name `mm`, so the
     *   forward's becomes `mm_1`. The other names are upstream's (transpose .. transpose_3,
     *   mul, mul_1, add). */
    expect_printed(
        g, "graph():", "    %primals_1 : f32[2, 3]  # ParamAOTInput(target='linear.weight')",
        "    %primals_2 : f32[2]  # ParamAOTInput(target='linear.bias')",
        "    %primals_3 : f32[4, 3]  # PlainAOTInput(idx=0)",
        "    %tangents_1 : f32[4, 2]  # TangentAOTInput(output=PlainAOTOutput(idx=0))",
        "    %transpose = transpose.int(%primals_1, 0, 1)  # f32[3, 2]{1, 3}", /* W^T */
        "    %mm_1 = mm(%primals_3, %transpose)  # f32[4, 2]",                 /* upstream: mm */
        "    %mul = mul.Scalar(%mm_1, 1.0)  # f32[4, 2]",     /* alpha * (x @ W^T) */
        "    %mul_1 = mul.Scalar(%primals_2, 1.0)  # f32[2]", /* beta * b */
        "    %add = add.Tensor(%mul_1, %mul)  # f32[4, 2]",   /* the forward output */
        "    %transpose_1 = transpose.int(%tangents_1, 0, 1)  # f32[2, 4]{1, 2}",
        "    %mm = mm(%transpose_1, %primals_3)  # f32[2, 3]", /* upstream: mm_1 */
        "    %transpose_2 = transpose.int(%mm, 0, 1)  # f32[3, 2]{1, 3}",
        "    %sum_1 = sum.dim_IntList(%tangents_1, [0], True)  # f32[1, 2]",
        "    %view = view(%sum_1, [2])  # f32[2]", /* upstream: as_strided */
        "    %transpose_3 = transpose.int(%transpose_2, 0, 1)  # f32[2, 3]",
        "    return (%add, %transpose_3, %view, None)  # [PlainAOTOutput(idx=0), "
        "GradAOTOutput(grad_of=ParamAOTInput(target='linear.weight')), "
        "GradAOTOutput(grad_of=ParamAOTInput(target='linear.bias')), None]", );
    expect_tags(g, "transpose_1");
    ag_joint_free(j);
    free_inputs(in, nin);
}

/* ---- 2. conv + batch norm ---- */

static void test_conv_bn(void **st) {
    (void)st;
    ag_tensor *in[8];
    int nin;
    ag_joint *j = export_zoo("convbn", false, NULL, in, &nin);
    const ag_graph *g = ag_joint_graph(j);
    const char *params[] = {"conv.weight", "conv.bias", "bn.weight", "bn.bias"};
    const char *buffers[] = {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"};
    assert_int_equal(ag_joint_num_params(j), 4);
    for (int i = 0; i < 4; i++)
        assert_string_equal(ag_joint_param_fqn(j, i), params[i]);
    assert_int_equal(ag_joint_num_buffers(j), 3);
    for (int i = 0; i < 3; i++)
        assert_string_equal(ag_joint_buffer_fqn(j, i), buffers[i]);
    expect_placeholders(
        g,
        (const char *[]){"primals_1", "primals_2", "primals_3", "primals_4", "primals_5",
                         "primals_6", "primals_7", "primals_8", "tangents_1"},
        (const char *[]){"ParamAOTInput(target='conv.weight')", "ParamAOTInput(target='conv.bias')",
                         "ParamAOTInput(target='bn.weight')", "ParamAOTInput(target='bn.bias')",
                         "BufferAOTInput(target='bn.running_mean')",
                         "BufferAOTInput(target='bn.running_var')",
                         "BufferAOTInput(target='bn.num_batches_tracked')", "PlainAOTInput(idx=0)",
                         "TangentAOTInput(output=PlainAOTOutput(idx=0))"},
        9);
    assert_int_equal(ag_node_val(find(g, "primals_7"), 0)->dtype, AG_I64);
    assert_int_equal(ag_node_val(find(g, "primals_7"), 0)->ndim, 0);
    /* 12 outputs: three input mutations first, the output, four grads, four None. */
    expect_outputs(
        g, NULL,
        (const char *[]){
            "InputMutationAOTOutput(mutated_input=BufferAOTInput(target='bn.running_mean'))",
            "InputMutationAOTOutput(mutated_input=BufferAOTInput(target='bn.running_var'))",
            "InputMutationAOTOutput(mutated_input=BufferAOTInput(target='bn.num_batches_tracked'))",
            "PlainAOTOutput(idx=0)", "GradAOTOutput(grad_of=ParamAOTInput(target='conv.weight'))",
            "GradAOTOutput(grad_of=ParamAOTInput(target='conv.bias'))",
            "GradAOTOutput(grad_of=ParamAOTInput(target='bn.weight'))",
            "GradAOTOutput(grad_of=ParamAOTInput(target='bn.bias'))", "None", "None", "None",
            "None"},
        12);
    assert_int_equal(ag_joint_num_mutated_inputs(j), 3);
    assert_int_equal(ag_joint_num_fw_outputs(j), 4);
    /* The graph is functional: no in-place op or mutating op remains. */
    for (ag_node *x = ag_graph_first(g); x; x = ag_node_next(x))
        if (ag_node_kind_of(x) == AG_NODE_CALL) {
            const char *op = ag_op_name(ag_node_op(x));
            assert_true(strcmp(op, "native_batch_norm") != 0);
            assert_false(ag_op_def(ag_node_op(x))->flags & AG_OP_INPLACE);
        }
    /* The conv's backward asks only for weight and bias grads (x needs none). */
    ag_node *cb = find(g, "convolution_backward");
    const ag_garg *mask = ag_node_arg(cb, ag_node_nargs(cb) - 1);
    assert_int_equal(mask->kind, AG_GA_INTS);
    assert_int_equal(mask->u.ints[0], 0);
    assert_int_equal(mask->u.ints[1], 1);
    assert_int_equal(mask->u.ints[2], 1);
    /* The whole joint. Upstream's test decomposes everything to prims (batch norm as var,
     * sum, div(32.0), rsqrt, the running stats as 0.1 * mean + 0.9 * running_mean and
     * 0.1 * (var * 1.032258064516129) + 0.9 * running_var, relu as le + where); without a
     * table, as here, upstream's graph holds the ATen ops below. The outputs correspond:
     * upstream add_2, add_3, add (running_mean, running_var, num_batches_tracked) are
     * getitem_3, getitem_4, add; where is relu; getitem_1, getitem_2 (conv grads) are
     * getitem_9, getitem_10; mul_15, sum_2 (bn grads) are getitem_6, getitem_7. Printing
     * differs in two places: scalars are doubles (upstream: add.Tensor(primals_7, 1)), and
     * bool lists print as ints (the output mask [False, True, True] as [0, 1, 1]). The input
     * grad of convolution_backward (getitem_8) is dead: x needs no grad. */
    expect_printed(
        g, "graph():", "    %primals_1 : f32[3, 1, 3, 3]  # ParamAOTInput(target='conv.weight')",
        "    %primals_2 : f32[3]  # ParamAOTInput(target='conv.bias')",
        "    %primals_3 : f32[3]  # ParamAOTInput(target='bn.weight')",
        "    %primals_4 : f32[3]  # ParamAOTInput(target='bn.bias')",
        "    %primals_5 : f32[3]  # BufferAOTInput(target='bn.running_mean')",
        "    %primals_6 : f32[3]  # BufferAOTInput(target='bn.running_var')",
        "    %primals_7 : i64[]  # BufferAOTInput(target='bn.num_batches_tracked')",
        "    %primals_8 : f32[2, 1, 4, 4]  # PlainAOTInput(idx=0)",
        "    %tangents_1 : f32[2, 3, 4, 4]  # TangentAOTInput(output=PlainAOTOutput(idx=0))",
        "    %convolution = convolution(%primals_8, %primals_1, %primals_2, [1, 1], [1, 1], "
        "[1, 1], False, [0, 0], 1)  # f32[2, 3, 4, 4]",
        "    %add = add.Scalar(%primals_7, 1.0)  # i64[]", /* num_batches_tracked += 1 */
        /* outputs: y, save_mean, save_invstd, new running_mean, new running_var */
        "    %_native_batch_norm_legit_functional = _native_batch_norm_legit_functional("
        "%convolution, %primals_3, %primals_4, %primals_5, %primals_6, True, 0.1, 1e-05)  "
        "# (f32[2, 3, 4, 4], f32[3], f32[3], f32[3], f32[3])",
        "    %getitem = getitem(%_native_batch_norm_legit_functional, 0)  # f32[2, 3, 4, 4]",
        "    %getitem_1 = getitem(%_native_batch_norm_legit_functional, 1)  # f32[3]",
        "    %getitem_2 = getitem(%_native_batch_norm_legit_functional, 2)  # f32[3]",
        "    %getitem_3 = getitem(%_native_batch_norm_legit_functional, 3)  # f32[3]",
        "    %getitem_4 = getitem(%_native_batch_norm_legit_functional, 4)  # f32[3]",
        "    %relu = relu(%getitem)  # f32[2, 3, 4, 4]",
        "    %threshold_backward = threshold_backward(%tangents_1, %relu, 0.0)  "
        "# f32[2, 3, 4, 4]",
        "    %native_batch_norm_backward = native_batch_norm_backward(%threshold_backward, "
        "%convolution, %primals_3, None, None, %getitem_1, %getitem_2, True, 1e-05, "
        "[1, 1, 1])  # (f32[2, 3, 4, 4], f32[3], f32[3])",
        "    %getitem_5 = getitem(%native_batch_norm_backward, 0)  # f32[2, 3, 4, 4]",
        "    %getitem_6 = getitem(%native_batch_norm_backward, 1)  # f32[3]",
        "    %getitem_7 = getitem(%native_batch_norm_backward, 2)  # f32[3]",
        "    %convolution_backward = convolution_backward(%getitem_5, %primals_8, "
        "%primals_1, [3], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [0, 1, 1])  "
        "# (f32[0], f32[3, 1, 3, 3], f32[3])",
        "    %getitem_9 = getitem(%convolution_backward, 1)  # f32[3, 1, 3, 3]",
        "    %getitem_10 = getitem(%convolution_backward, 2)  # f32[3]",
        "    return (%getitem_3, %getitem_4, %add, %relu, %getitem_9, %getitem_10, "
        "%getitem_6, %getitem_7, None, None, None, None)  # "
        "[InputMutationAOTOutput(mutated_input=BufferAOTInput(target='bn.running_mean')), "
        "InputMutationAOTOutput(mutated_input=BufferAOTInput(target='bn.running_var')), "
        "InputMutationAOTOutput(mutated_input=BufferAOTInput(target='bn.num_batches_tracked')), "
        "PlainAOTOutput(idx=0), GradAOTOutput(grad_of=ParamAOTInput(target='conv.weight')), "
        "GradAOTOutput(grad_of=ParamAOTInput(target='conv.bias')), "
        "GradAOTOutput(grad_of=ParamAOTInput(target='bn.weight')), "
        "GradAOTOutput(grad_of=ParamAOTInput(target='bn.bias')), None, None, None, None]", );
    expect_tags(g, "threshold_backward");
    ag_joint_free(j);
    free_inputs(in, nin);
}

/* ---- 3. kwargs ---- */

static void test_module_with_kwargs(void **st) {
    (void)st;
    ag_module *m;
    ag_tensor *in[8];
    int nin;
    assert_int_equal(ag_zoo_build("kwargs", NULL, &m, in, 8, &nin), 0);
    assert_int_equal(nin, 2);
    /* x positional, scale as a keyword argument. */
    const char *kw[] = {"scale"};
    ag_decomp_table *core = ag_decomp_table_core(); /* upstream's test passes a table */
    ag_export_opts o = {.decompositions = core};
    ag_joint *j = ag_export_joint(m, in, 1, kw, &in[1], 1, &o);
    ag_decomp_table_free(core);
    assert_non_null(j);
    const ag_graph *g = ag_joint_graph(j);
    expect_placeholders(
        g, (const char *[]){"primals_1", "primals_2", "primals_3", "primals_4", "tangents_1"},
        (const char *[]){"ParamAOTInput(target='linear.weight')",
                         "ParamAOTInput(target='linear.bias')", "PlainAOTInput(idx=0)",
                         "PlainAOTInput(idx=1)", "TangentAOTInput(output=PlainAOTOutput(idx=0))"},
        5);
    assert_int_equal(ag_node_val(find(g, "primals_4"), 0)->ndim, 0);
    expect_outputs(g, NULL,
                   (const char *[]){"PlainAOTOutput(idx=0)",
                                    "GradAOTOutput(grad_of=ParamAOTInput(target='linear.weight'))",
                                    "GradAOTOutput(grad_of=ParamAOTInput(target='linear.bias'))",
                                    "None", "None"},
                   5);
    char spec[512];
    ag_treespec_repr(ag_joint_in_spec(j), spec, sizeof spec);
    assert_string_equal(spec, "TreeSpec(tuple, None, [TreeSpec(list, None, [*, *, *]), "
                              "TreeSpec(dict, ['scale'], [*])])");
    /* The whole joint: test 1's linear, then `mul_2 = add * primals_4` and the backward's
     * `mul_3 = tangents_1 * primals_4` upstream. Differences from upstream as in test 1
     * (ATen ops instead of prims; the decomposition runs after the trace), and because of the
     * latter the scale's two muls, traced before the table ran, keep the names mul and mul_1
     * while addmm's decomposition takes mul_2 and mul_3 (upstream: mul, mul_1 for addmm,
     * mul_2, mul_3 for the scale). */
    expect_printed(
        g, "graph():", "    %primals_1 : f32[2, 3]  # ParamAOTInput(target='linear.weight')",
        "    %primals_2 : f32[2]  # ParamAOTInput(target='linear.bias')",
        "    %primals_3 : f32[4, 3]  # PlainAOTInput(idx=0)",
        "    %primals_4 : f32[]  # PlainAOTInput(idx=1)", /* the kwarg */
        "    %tangents_1 : f32[4, 2]  # TangentAOTInput(output=PlainAOTOutput(idx=0))",
        "    %transpose = transpose.int(%primals_1, 0, 1)  # f32[3, 2]{1, 3}",
        "    %mm_1 = mm(%primals_3, %transpose)  # f32[4, 2]",
        "    %mul_2 = mul.Scalar(%mm_1, 1.0)  # f32[4, 2]",
        "    %mul_3 = mul.Scalar(%primals_2, 1.0)  # f32[2]",
        "    %add = add.Tensor(%mul_3, %mul_2)  # f32[4, 2]",
        "    %mul = mul.Tensor(%add, %primals_4)  # f32[4, 2]",          /* upstream: mul_2 */
        "    %mul_1 = mul.Tensor(%tangents_1, %primals_4)  # f32[4, 2]", /* upstream: mul_3 */
        "    %transpose_1 = transpose.int(%mul_1, 0, 1)  # f32[2, 4]{1, 2}",
        "    %mm = mm(%transpose_1, %primals_3)  # f32[2, 3]",
        "    %transpose_2 = transpose.int(%mm, 0, 1)  # f32[3, 2]{1, 3}",
        "    %sum_1 = sum.dim_IntList(%mul_1, [0], True)  # f32[1, 2]",
        "    %view = view(%sum_1, [2])  # f32[2]",
        "    %transpose_3 = transpose.int(%transpose_2, 0, 1)  # f32[2, 3]",
        "    return (%mul, %transpose_3, %view, None, None)  # [PlainAOTOutput(idx=0), "
        "GradAOTOutput(grad_of=ParamAOTInput(target='linear.weight')), "
        "GradAOTOutput(grad_of=ParamAOTInput(target='linear.bias')), None, None]", );
    expect_tags(g, "mul_1");
    ag_joint_free(j);
    ag_module_free(m);
    free_inputs(in, nin);
}

/* ---- 4. multiple outputs ---- */

static void test_multiple_outputs(void **st) {
    (void)st;
    ag_tensor *in[8];
    int nin;
    ag_joint *j = export_zoo("multi_output", true, NULL, in, &nin); /* as upstream: a table */
    const ag_graph *g = ag_joint_graph(j);
    expect_placeholders(
        g,
        (const char *[]){"primals_1", "primals_2", "primals_3", "primals_4", "primals_5",
                         "tangents_1", "tangents_2"},
        (const char *[]){
            "ParamAOTInput(target='linear1.weight')", "ParamAOTInput(target='linear1.bias')",
            "ParamAOTInput(target='linear2.weight')", "ParamAOTInput(target='linear2.bias')",
            "PlainAOTInput(idx=0)", "TangentAOTInput(output=PlainAOTOutput(idx=0))",
            "TangentAOTInput(output=PlainAOTOutput(idx=1))"},
        7);
    expect_outputs(g, NULL,
                   (const char *[]){"PlainAOTOutput(idx=0)", "PlainAOTOutput(idx=1)",
                                    "GradAOTOutput(grad_of=ParamAOTInput(target='linear1.weight'))",
                                    "GradAOTOutput(grad_of=ParamAOTInput(target='linear1.bias'))",
                                    "GradAOTOutput(grad_of=ParamAOTInput(target='linear2.weight'))",
                                    "GradAOTOutput(grad_of=ParamAOTInput(target='linear2.bias'))",
                                    "None"},
                   7);
    /* The backward computes linear2's grads (from tangents_2) before linear1's. */
    ag_node *out = ag_graph_output_node(g);
    const ag_garg *a = ag_node_arg(out, 0);
    assert_true(ag_node_index(a->u.nodes[4]) < ag_node_index(a->u.nodes[2]));
    assert_int_equal(ag_joint_num_tangents(j), 2);
    /* The whole joint: upstream's output names add, add_1, transpose_7, as_strided_1,
     * transpose_4, as_strided; the bias grads are views here (test 1), and the forward mms,
     * decomposed after the trace, are mm_2 and mm_3 (upstream: mm, mm_1 forward, mm_2, mm_3
     * backward). */
    expect_printed(
        g, "graph():", "    %primals_1 : f32[2, 3]  # ParamAOTInput(target='linear1.weight')",
        "    %primals_2 : f32[2]  # ParamAOTInput(target='linear1.bias')",
        "    %primals_3 : f32[4, 3]  # ParamAOTInput(target='linear2.weight')",
        "    %primals_4 : f32[4]  # ParamAOTInput(target='linear2.bias')",
        "    %primals_5 : f32[4, 3]  # PlainAOTInput(idx=0)",
        "    %tangents_1 : f32[4, 2]  # TangentAOTInput(output=PlainAOTOutput(idx=0))",
        "    %tangents_2 : f32[4, 4]  # TangentAOTInput(output=PlainAOTOutput(idx=1))",
        /* linear1 */
        "    %transpose = transpose.int(%primals_1, 0, 1)  # f32[3, 2]{1, 3}",
        "    %mm_2 = mm(%primals_5, %transpose)  # f32[4, 2]",
        "    %mul = mul.Scalar(%mm_2, 1.0)  # f32[4, 2]",
        "    %mul_1 = mul.Scalar(%primals_2, 1.0)  # f32[2]",
        "    %add = add.Tensor(%mul_1, %mul)  # f32[4, 2]",
        /* linear2 */
        "    %transpose_1 = transpose.int(%primals_3, 0, 1)  # f32[3, 4]{1, 3}",
        "    %mm_3 = mm(%primals_5, %transpose_1)  # f32[4, 4]",
        "    %mul_2 = mul.Scalar(%mm_3, 1.0)  # f32[4, 4]",
        "    %mul_3 = mul.Scalar(%primals_4, 1.0)  # f32[4]",
        "    %add_1 = add.Tensor(%mul_3, %mul_2)  # f32[4, 4]",
        /* linear2's grads first, from tangents_2 */
        "    %transpose_2 = transpose.int(%tangents_2, 0, 1)  # f32[4, 4]{1, 4}",
        "    %mm = mm(%transpose_2, %primals_5)  # f32[4, 3]",
        "    %transpose_3 = transpose.int(%mm, 0, 1)  # f32[3, 4]{1, 3}",
        "    %sum_1 = sum.dim_IntList(%tangents_2, [0], True)  # f32[1, 4]",
        "    %view = view(%sum_1, [4])  # f32[4]",
        "    %transpose_4 = transpose.int(%transpose_3, 0, 1)  # f32[4, 3]",
        /* then linear1's, from tangents_1 */
        "    %transpose_5 = transpose.int(%tangents_1, 0, 1)  # f32[2, 4]{1, 2}",
        "    %mm_1 = mm(%transpose_5, %primals_5)  # f32[2, 3]",
        "    %transpose_6 = transpose.int(%mm_1, 0, 1)  # f32[3, 2]{1, 3}",
        "    %sum_2 = sum.dim_IntList(%tangents_1, [0], True)  # f32[1, 2]",
        "    %view_1 = view(%sum_2, [2])  # f32[2]",
        "    %transpose_7 = transpose.int(%transpose_6, 0, 1)  # f32[2, 3]",
        "    return (%add, %add_1, %transpose_7, %view_1, %transpose_4, %view, None)  # "
        "[PlainAOTOutput(idx=0), PlainAOTOutput(idx=1), "
        "GradAOTOutput(grad_of=ParamAOTInput(target='linear1.weight')), "
        "GradAOTOutput(grad_of=ParamAOTInput(target='linear1.bias')), "
        "GradAOTOutput(grad_of=ParamAOTInput(target='linear2.weight')), "
        "GradAOTOutput(grad_of=ParamAOTInput(target='linear2.bias')), None]", );
    expect_tags(g, "transpose_2");
    ag_joint_free(j);
    free_inputs(in, nin);
}

/* ---- 5. specs, 21. static input indices ---- */

static void test_in_out_specs_and_static_inputs(void **st) {
    (void)st;
    ag_tensor *in[8];
    int nin;
    ag_joint *j = export_zoo("linear", false, NULL, in, &nin);
    char spec[512];
    ag_treespec_repr(ag_joint_in_spec(j), spec, sizeof spec);
    assert_string_equal(spec, "TreeSpec(tuple, None, [TreeSpec(list, None, [*, *, *]), "
                              "TreeSpec(dict, [], [])])");
    ag_treespec_repr(ag_joint_out_spec(j), spec, sizeof spec);
    assert_string_equal(spec, "*");
    assert_int_equal(ag_joint_num_buffers(j), 0);
    assert_int_equal(ag_joint_num_static_inputs(j), 2);
    assert_int_equal(ag_joint_static_input(j, 0), 0);
    assert_int_equal(ag_joint_static_input(j, 1), 1);
    ag_joint_free(j);
    free_inputs(in, nin);
}

/* ---- 13/15/22. annotations ---- */

typedef struct two_linear {
    ag_module *l1, *l2;
} two_linear;

static int annotated_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out,
                             int max_out) {
    (void)nin;
    (void)max_out;
    two_linear *t = ag_module_ud(m);
    ag_scope_begin();
    ag_annotate_begin("pp_stage", (ag_mval){.kind = AG_MV_INT, .u.i = 0});
    ag_tensor *y = ag_module_forward(t->l1, in[0]);
    ag_annotate_end();
    out[0] = ag_tensor_keep(ag_sub_scalar(y, 1.0));
    ag_scope_end();
    return out[0] ? 1 : ag_last_status();
}

static ag_module *make_annotated(ag_forward_fn fwd, bool two) {
    two_linear *t = calloc(1, sizeof *t);
    ag_module *m = ag_module_new("Annotated", fwd, t, free);
    t->l1 = ag_nn_linear(3, 2, true);
    assert_int_equal(ag_module_add_child(m, "linear", t->l1), 0);
    if (two) {
        t->l2 = ag_nn_linear(3, 2, true);
        assert_int_equal(ag_module_add_child(m, "linear2", t->l2), 0);
    }
    return m;
}

static void test_preserve_annotate_simple(void **st) {
    (void)st;
    ag_manual_seed(0);
    ag_module *m = make_annotated(annotated_forward, false);
    ag_tensor *x = ag_randn(AG_F32, 2, (int64_t[]){4, 3});
    ag_joint *j = ag_export_joint(m, &x, 1, NULL, NULL, 0, NULL);
    assert_non_null(j);
    char buf[2048];
    custom_listing(ag_joint_graph(j), buf, sizeof buf);
    /* Upstream: t, addmm, t_1, mm, t_2, sum_1, view, t_3 carry {'pp_stage': 0}; sub none. */
    assert_string_equal(buf, "t{pp_stage:0} addmm{pp_stage:0} t_1{pp_stage:0} mm{pp_stage:0} "
                             "t_2{pp_stage:0} sum_1{pp_stage:0} view{pp_stage:0} t_3{pp_stage:0}");
    ag_joint_free(j);
    ag_module_free(m);
    ag_tensor_free(x);
}

static int square(void *ud) {
    ag_tensor **io = ud;
    io[1] = ag_mul(io[0], io[0]);
    return io[1] ? 0 : -1;
}

static int annotated_fn_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out,
                                int max_out) {
    (void)nin;
    (void)max_out;
    two_linear *t = ag_module_ud(m);
    ag_scope_begin();
    ag_annotate_begin("pp_stage", (ag_mval){.kind = AG_MV_INT, .u.i = 0});
    ag_tensor *y = ag_module_forward(t->l1, in[0]);
    ag_annotate_end();
    ag_tensor *io[2] = {y, NULL};
    ag_annotate_fn("pp_stage", (ag_mval){.kind = AG_MV_INT, .u.i = 1}, "f", square, io);
    out[0] = ag_tensor_keep(ag_sub_scalar(io[1], 1.0));
    ag_scope_end();
    return out[0] ? 1 : ag_last_status();
}

static void test_preserve_annotate_function(void **st) {
    (void)st;
    ag_manual_seed(0);
    ag_module *m = make_annotated(annotated_fn_forward, false);
    ag_tensor *x = ag_randn(AG_F32, 2, (int64_t[]){4, 3});
    ag_joint *j = ag_export_joint(m, &x, 1, NULL, NULL, 0, NULL);
    assert_non_null(j);
    char buf[2048];
    custom_listing(ag_joint_graph(j), buf, sizeof buf);
    /* Upstream: t, addmm (pp 0); mul, mul_1, mul_2 (pp 1); t_1, mm, t_2, sum_1, view, t_3 (pp 0).
     * Our mul.Tensor backward makes two products (grad*x, grad*x) and the engine adds them:
     * that add is a gradient accumulation and carries no annotation. */
    assert_string_equal(buf, "t{pp_stage:0} addmm{pp_stage:0} mul{pp_stage:1} mul_1{pp_stage:1} "
                             "mul_2{pp_stage:1} t_1{pp_stage:0} mm{pp_stage:0} t_2{pp_stage:0} "
                             "sum_1{pp_stage:0} view{pp_stage:0} t_3{pp_stage:0}");
    ag_joint_free(j);
    ag_module_free(m);
    ag_tensor_free(x);
}

static int grad_acc_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out,
                            int max_out) {
    (void)nin;
    (void)max_out;
    two_linear *t = ag_module_ud(m);
    ag_scope_begin();
    ag_annotate_begin("test", (ag_mval){.kind = AG_MV_INT, .u.i = 1});
    /* linear(x) - linear2(x): one module call per statement, so linear is traced first on every
     * compiler (C leaves the order of a call's arguments unspecified). */
    ag_tensor *a = ag_module_forward(t->l1, in[0]);
    ag_tensor *b = ag_module_forward(t->l2, in[0]);
    out[0] = ag_tensor_keep(ag_sub(a, b));
    ag_annotate_end();
    ag_scope_end();
    return out[0] ? 1 : ag_last_status();
}

static void test_no_annotation_on_gradient_acc_nodes(void **st) {
    (void)st;
    ag_manual_seed(0);
    ag_module *m = make_annotated(grad_acc_forward, true);
    ag_tensor *x = ag_randn(AG_F32, 2, (int64_t[]){4, 3});
    ag_tensor_set_requires_grad(x, true);
    ag_joint *j = ag_export_joint(m, &x, 1, NULL, NULL, 0, NULL);
    assert_non_null(j);
    const ag_graph *g = ag_joint_graph(j);
    int nacc = 0;
    for (ag_node *n = ag_graph_first(g); n; n = ag_node_next(n))
        if (ag_node_is_gradient_acc(n)) {
            nacc++;
            assert_string_equal(ag_op_name(ag_node_op(n)), "add.Tensor");
            assert_int_equal(ag_node_custom_count(n), 0);
        }
    assert_int_equal(nacc, 1);
    char buf[4096];
    custom_listing(g, buf, sizeof buf);
    assert_string_equal(buf, "t{test:1} addmm{test:1} t_1{test:1} addmm_1{test:1} sub{test:1} "
                             "neg{test:1} t_2{test:1} mm{test:1} t_3{test:1} mm_1{test:1} "
                             "t_4{test:1} sum_1{test:1} view{test:1} t_5{test:1} t_6{test:1} "
                             "mm_2{test:1} t_7{test:1} mm_3{test:1} t_8{test:1} sum_2{test:1} "
                             "view_1{test:1} t_9{test:1}");
    /* Traced in source order on every compiler: linear (primals_1) before linear2. */
    assert_string_equal(ag_node_name(ag_node_arg(find(g, "t"), 0)->u.node), "primals_1");
    assert_string_equal(ag_node_name(ag_node_arg(find(g, "t_1"), 0)->u.node), "primals_3");
    assert_string_equal(ag_node_name(ag_node_arg(find(g, "sub"), 0)->u.node), "addmm");
    ag_joint_free(j);
    ag_module_free(m);
    ag_tensor_free(x);
}

/* The zoo's grad_acc, linear(x) - linear2(x), traces linear first as Python would, whatever
 * order the C compiler evaluates a call's arguments in (gcc traced linear2 first). */
static void test_zoo_traces_in_source_order(void **st) {
    (void)st;
    ag_tensor *in[8];
    int nin;
    ag_joint *j = export_zoo("grad_acc", false, NULL, in, &nin);
    const ag_graph *g = ag_joint_graph(j);
    const ag_node *t = ag_node_arg(find(g, "t"), 0)->u.node;
    const ag_node *t1 = ag_node_arg(find(g, "t_1"), 0)->u.node;
    assert_string_equal(repr(ag_node_desc(t)), "ParamAOTInput(target='linear.weight')");
    assert_string_equal(repr(ag_node_desc(t1)), "ParamAOTInput(target='linear2.weight')");
    const ag_node *sub = find(g, "sub");
    assert_string_equal(ag_node_name(ag_node_arg(sub, 0)->u.node), "addmm");
    assert_string_equal(ag_node_name(ag_node_arg(sub, 1)->u.node), "addmm_1");
    ag_joint_free(j);
    free_inputs(in, nin);
}

/* ---- 19. custom op stack trace ---- */

static int foo_meta(const ag_arg *a, ag_tmeta *o) {
    const ag_tensor *x = a[0].u.t;
    ag_tmeta m;
    m.dtype = ag_tensor_dtype(x);
    m.ndim = ag_tensor_ndim(x);
    m.offset = 0;
    int64_t st = 1;
    for (int i = m.ndim - 1; i >= 0; i--) {
        m.sizes[i] = ag_tensor_sizes(x)[i];
        m.strides[i] = st;
        st *= m.sizes[i];
    }
    *o = m;
    return 0;
}
static int foo_kernel(const ag_arg *a, ag_tensor **o) {
    int64_t n = ag_tensor_numel(o[0]);
    float *d = ag_tensor_data(o[0]);
    for (int64_t i = 0; i < n; i++)
        d[i] = (float)(ag_tensor_item_at(a[0].u.t, i) + ag_tensor_item_at(a[1].u.t, i));
    return 0;
}
static int foo_backward(ag_bwctx *c) {
    for (int i = 0; i < 2; i++)
        if (c->needs_grad[i])
            c->grad_inputs[i] = c->grad_outputs[0];
    return 0;
}
static const ag_opdef foo_def = {
    .schema = "my_lib::foo(Tensor x, Tensor y) -> Tensor",
    .meta = foo_meta,
    .kernel = foo_kernel,
    .dtypes = 1u << AG_F32,
    .backward = foo_backward,
};

static int call_foo(void *ud, ag_tensor *const *in, int n, ag_tensor **out, int max_out) {
    (void)n;
    (void)max_out;
    const ag_op *op = ud;
    out[0] = ag_op_call1(op, (ag_arg[]){AG_A_T(in[0]), AG_A_T(in[1])}, 2); /* return foo(x, y) */
    return out[0] ? 1 : ag_last_status();
}

static void test_custom_op_stack_trace(void **st) {
    (void)st;
    const ag_op *op = ag_op_find("my_lib::foo");
    if (!op)
        op = ag_op_register(&foo_def);
    assert_non_null(op);
    ag_tensor *x = ag_randn(AG_F32, 2, (int64_t[]){4, 3});
    ag_tensor *y = ag_randn(AG_F32, 2, (int64_t[]){4, 3});
    ag_tensor *in[2] = {x, y};
    ag_graph *g = ag_trace(call_foo, (void *)op, in, 2, NULL, NULL, NULL);
    assert_non_null(g);
    ag_node *foo = find(g, "foo");
    const char *trace = ag_node_stack_trace(foo);
    assert_non_null(trace);
    assert_non_null(strstr(trace, "test_export.c"));
    assert_non_null(strstr(trace, "in call_foo"));
    assert_non_null(strstr(trace, "return foo(x, y)"));
    assert_null(strstr(trace, "optable.c"));
    ag_graph_free(g);
    ag_tensor_free(x);
    ag_tensor_free(y);
}

/* ---- 20. replayed views keep seq_nr and annotations ---- */

/* upstream:
 *     def _unpermute(out, input_shape, permuted_indices):
 *         out_unpermuted = out.new_empty(input_shape)
 *         out_unpermuted[permuted_indices, :] = out
 *         out = out_unpermuted[:-1]
 *         return out
 *     def forward(self, x):
 *         with fx_traceback.annotate({"pp_stage": 0}):
 *             permuted_indices = torch.tensor([2, 0, 3, 1])
 *             x = _unpermute(x, (5, 3), permuted_indices)
 *         return x.cos() */
static ag_tensor *unpermute(ag_tensor *out, int64_t rows, int64_t cols, ag_tensor *permuted) {
    ag_tensor *out_unpermuted = ag_new_empty(out, 2, (int64_t[]){rows, cols});
    ag_index_put_(out_unpermuted, &permuted, 1, out, false); /* out_unpermuted[idx, :] = out */
    out = ag_slice(out_unpermuted, 0, 0, -1, 1);             /* out = out_unpermuted[:-1] */
    return out;
}

static int unpermute_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out,
                             int max_out) {
    (void)m;
    (void)nin;
    (void)max_out;
    ag_scope_begin();
    ag_annotate_begin("pp_stage", (ag_mval){.kind = AG_MV_INT, .u.i = 0});
    ag_tensor *permuted = ag_from_data(AG_I64, 1, (int64_t[]){4}, (int64_t[]){2, 0, 3, 1});
    ag_tensor *x = unpermute(in[0], 5, 3, permuted);
    ag_annotate_end();
    out[0] = ag_tensor_keep(ag_cos(x));
    ag_scope_end();
    return out[0] ? 1 : ag_last_status();
}

static void test_preserve_annotate_replay_view(void **st) {
    (void)st;
    ag_module *m = ag_module_new("Unpermute", unpermute_forward, NULL, NULL);
    ag_tensor *x = ag_randn(AG_F32, 2, (int64_t[]){4, 3});
    ag_tensor_set_requires_grad(x, true);
    ag_joint *j = ag_export_joint(m, &x, 1, NULL, NULL, 0, NULL);
    if (!j)
        print_error("%s\n", ag_last_error());
    assert_non_null(j);
    const ag_graph *g = ag_joint_graph(j);
    ag_node *sl = NULL, *slb = NULL;
    int nsl = 0, nslb = 0;
    for (ag_node *n = ag_graph_first(g); n; n = ag_node_next(n)) {
        if (ag_node_kind_of(n) != AG_NODE_CALL)
            continue;
        if (!strcmp(ag_op_name(ag_node_op(n)), "slice.Tensor"))
            sl = n, nsl++;
        if (!strcmp(ag_op_name(ag_node_op(n)), "slice_backward"))
            slb = n, nslb++;
    }
    assert_int_equal(nsl, 1);
    assert_int_equal(nslb, 1);
    assert_true(ag_node_seq_nr(sl) >= 0);
    assert_int_equal(ag_node_seq_nr(sl), ag_node_seq_nr(slb));
    assert_non_null(strstr(ag_node_stack_trace(sl), "out = out_unpermuted[:-1]"));
    /* upstream's _get_custom_metadata: exactly these nodes carry {'pp_stage': 0}, in graph
     * order; cos and its backward (sin, neg, mul) none. The constant made by torch.tensor
     * inside the annotation is a get_attr carrying it too, and the backward (index_put's
     * backward indexes with it) has a get_attr of its own, _tensor_constant0_1, which takes
     * index_put's annotation as the backward's calls do. Names differ from upstream in one
     * place: upstream's slice is slice_2 because `out_unpermuted[permuted_indices, :] = out`
     * first records a full slice of dim 1 (slice, then slice_1 when functionalization replays
     * it) that is not in the final graph; here the assignment is index_put_ on the tensor
     * itself, so the one slice is slice_1 (FX numbers `slice` from _1, the name being
     * Python's builtin). */
    char buf[1024];
    custom_listing(g, buf, sizeof buf);
    assert_string_equal(buf, "new_empty{pp_stage:0} _tensor_constant0{pp_stage:0} "
                             "index_put{pp_stage:0} slice_1{pp_stage:0} "
                             "slice_backward{pp_stage:0} _tensor_constant0_1{pp_stage:0} "
                             "index{pp_stage:0}");
    assert_ptr_equal(find(g, "slice_1"), sl);
    /* upstream lists ('get_attr', '_tensor_constant0', ...) and ('call_function', ...) */
    const char *calls[] = {"new_empty", "index_put", "slice_backward", "index"};
    for (int i = 0; i < 4; i++)
        assert_int_equal(ag_node_kind_of(find(g, calls[i])), AG_NODE_CALL);
    ag_node *c0 = find(g, "_tensor_constant0"), *c1 = find(g, "_tensor_constant0_1");
    assert_int_equal(ag_node_kind_of(c0), AG_NODE_GET_ATTR);
    assert_int_equal(ag_node_kind_of(c1), AG_NODE_GET_ATTR);
    assert_string_equal(ag_node_partitioner_tag(c0), "is_forward");
    assert_string_equal(ag_node_partitioner_tag(c1), "is_backward");
    assert_int_equal(ag_node_seq_nr(c1), ag_node_seq_nr(find(g, "index_put")));
    assert_int_equal(ag_node_seq_nr(c1), ag_node_seq_nr(find(g, "index")));
    /* index_put reads the forward's constant, index the backward's: the same values */
    assert_ptr_equal(ag_node_arg(find(g, "index_put"), 1)->u.nodes[0], c0);
    assert_ptr_equal(ag_node_arg(find(g, "index"), 1)->u.nodes[0], c1);
    tu_assert_values(ag_node_constant(c0), 1, (int64_t[]){4}, (double[]){2, 0, 3, 1}, 0);
    tu_assert_values(ag_node_constant(c1), 1, (int64_t[]){4}, (double[]){2, 0, 3, 1}, 0);
    /* The joint runs: row i of out_unpermuted is x's row perm^-1(i), so the output's rows
     * are cos of x's rows 1, 3, 0, 2, and with a tangent of ones x's grad is -sin(x). */
    ag_scope_begin();
    ag_tensor *ones = ag_ones(AG_F32, 2, (int64_t[]){4, 3});
    ag_tensor *o[2] = {NULL, NULL};
    assert_int_equal(ag_graph_run(g, (ag_tensor *[]){x, ones}, 2, o, 2), 2);
    const int64_t from[4] = {1, 3, 0, 2};
    for (int64_t r = 0; r < 4; r++)
        for (int64_t c = 0; c < 3; c++) {
            double xv = ag_tensor_item_at(x, from[r] * 3 + c), xr = ag_tensor_item_at(x, r * 3 + c);
            assert_true(fabs(ag_tensor_item_at(o[0], r * 3 + c) - cos(xv)) < 1e-6);
            assert_true(fabs(ag_tensor_item_at(o[1], r * 3 + c) + sin(xr)) < 1e-6);
        }
    ag_scope_end();
    ag_joint_free(j);
    ag_module_free(m);
    ag_tensor_free(x);
}

/* ---- 16/17/18. annotate_fn anchors stack traces ----
 * Upstream's make_fx records a frame for a function only when it is decorated with annotate_fn
 * (its undecorated control shows none); aotgrad records every public call site, so the
 * decorated function's frame is always there and the control case does not apply. What
 * carries over: nodes made inside an annotated call name the function in their stack trace,
 * including nodes made inside composite ops (cross_entropy -> log_softmax, nll_loss) and inside
 * modules. */

typedef struct loss_io {
    ag_tensor *logits, *target, *loss;
} loss_io;

static int compute_loss(void *ud) {
    loss_io *io = ud;
    io->loss = ag_cross_entropy(io->logits, io->target, AG_REDUCTION_MEAN, -100);
    return io->loss ? 0 : -1;
}

static int loss_fn(void *ud, ag_tensor *const *in, int n, ag_tensor **out, int max_out) {
    (void)ud;
    (void)n;
    (void)max_out;
    loss_io io = {in[0], in[1], NULL};
    int rc = ag_annotate_fn("module_fqn", (ag_mval){.kind = AG_MV_STR, .u.s = "loss"},
                            "compute_loss", compute_loss, &io);
    out[0] = io.loss;
    return rc ? rc : 1;
}

static void test_annotate_fn_anchors_nested_functional_call(void **st) {
    (void)st;
    ag_tensor *x = ag_randn(AG_F32, 2, (int64_t[]){4, 8});
    ag_tensor *y = ag_from_data(AG_I64, 1, (int64_t[]){4}, (int64_t[]){1, 0, 7, 3});
    ag_tensor *in[2] = {x, y};
    ag_graph *g = ag_trace(loss_fn, NULL, in, 2, NULL, NULL, NULL);
    assert_non_null(g);
    int anchored = 0;
    for (ag_node *n = ag_graph_first(g); n; n = ag_node_next(n)) {
        if (ag_node_kind_of(n) != AG_NODE_CALL)
            continue;
        const char *op = ag_op_name(ag_node_op(n));
        if (!strcmp(op, "_log_softmax") || !strcmp(op, "nll_loss_forward")) {
            assert_non_null(strstr(ag_node_stack_trace(n), "compute_loss"));
            assert_string_equal(ag_node_custom_get(n, "module_fqn").u.s, "loss");
            anchored++;
        }
    }
    assert_int_equal(anchored, 2);
    ag_graph_free(g);
    ag_tensor_free(x);
    ag_tensor_free(y);
}

static int user_fn(void *ud) {
    ag_tensor **io = ud;
    io[2] = ag_div(ag_sum_all(ag_mul_scalar(io[0], 2.0)), io[1]);
    return io[2] ? 0 : -1;
}

static int pure_ops(void *ud, ag_tensor *const *in, int n, ag_tensor **out, int max_out) {
    (void)ud;
    (void)n;
    (void)max_out;
    ag_tensor *io[3] = {in[0], in[1], NULL};
    int rc = ag_annotate_fn("k", (ag_mval){.kind = AG_MV_INT, .u.i = 1}, "user_fn", user_fn, io);
    out[0] = io[2];
    return rc ? rc : 1;
}

static void test_annotate_fn_anchors_pure_tensor_ops(void **st) {
    (void)st;
    ag_tensor *x = ag_randn(AG_F32, 1, (int64_t[]){4});
    ag_tensor *y = ag_scalar_tensor(AG_F32, 2.0);
    ag_tensor *in[2] = {x, y};
    ag_graph *g = ag_trace(pure_ops, NULL, in, 2, NULL, NULL, NULL);
    assert_non_null(g);
    int with = 0;
    for (ag_node *n = ag_graph_first(g); n; n = ag_node_next(n))
        if (ag_node_kind_of(n) == AG_NODE_CALL && strstr(ag_node_stack_trace(n), "user_fn"))
            with++;
    assert_true(with >= 3); /* mul, sum, div */
    ag_graph_free(g);
    ag_tensor_free(x);
    ag_tensor_free(y);
}

static int inner_module_fn(void *ud) {
    void **io = ud;
    io[2] = ag_module_forward(io[0], io[1]);
    return io[2] ? 0 : -1;
}

static int nested_module(void *ud, ag_tensor *const *in, int n, ag_tensor **out, int max_out) {
    (void)n;
    (void)max_out;
    void *io[3] = {ud, in[0], NULL};
    int rc = ag_annotate_fn("k", (ag_mval){.kind = AG_MV_INT, .u.i = 2}, "inner_module_fn",
                            inner_module_fn, io);
    out[0] = io[2];
    return rc ? rc : 1;
}

static void test_annotate_fn_nested_with_module_forward(void **st) {
    (void)st;
    ag_module *lin = ag_nn_linear(4, 4, false);
    ag_tensor *x = ag_randn(AG_F32, 2, (int64_t[]){3, 4});
    ag_graph *g = ag_trace(nested_module, lin, &x, 1, NULL, NULL, NULL);
    assert_non_null(g);
    ag_node *mm = find(g, "mm");
    const char *trace = ag_node_stack_trace(mm);
    assert_non_null(trace);
    assert_non_null(strstr(trace, "inner_module_fn"));
    assert_non_null(strstr(trace, "layers.c")); /* the module's own frame, innermost */
    ag_graph_free(g);
    ag_module_free(lin);
    ag_tensor_free(x);
}

/* ---- forward-only export when nothing requires grad ---- */

static void test_inference_graph(void **st) {
    (void)st;
    ag_module *m;
    ag_tensor *in[8];
    int nin;
    assert_int_equal(ag_zoo_build("linear", NULL, &m, in, 8, &nin), 0);
    ag_named_tensors ps;
    assert_int_equal(ag_module_named_parameters(m, false, &ps), 0);
    for (int i = 0; i < ps.n; i++)
        ag_tensor_set_requires_grad(ps.tensors[i], false);
    ag_named_tensors_free(&ps);
    ag_joint *j = ag_export_joint(m, in, nin, NULL, NULL, 0, NULL);
    assert_non_null(j);
    assert_false(ag_joint_needs_autograd(j));
    assert_int_equal(ag_joint_num_tangents(j), 0);
    expect_outputs(ag_joint_graph(j), NULL, (const char *[]){"PlainAOTOutput(idx=0)"}, 1);
    ag_joint_free(j);
    ag_module_free(m);
    free_inputs(in, nin);
}

/* ---- numerics: the joint graph interpreted equals eager, on every zoo model ----
 * The graph runs on the primals derived from the flat inputs (ag_joint_primals_from_flat:
 * duplicates, view bases); its outputs are compared with eager's outputs, its input
 * mutations with eager's inputs after the call, and its gradients with eager's for the
 * tangents given (a tied weight's gradient is the sum over its slots). Joints with an
 * intermediate base are checked for the forward only here (tests/test_alias.c checks their
 * gradients through the compiled callable). */

static void check_zoo_numerics(const char *name) {
    /* Two identical builds: one runs eagerly (and mutates its buffers), one is exported. */
    ag_module *me, *mx;
    ag_tensor *ie[8], *ix[8];
    int ne, nx;
    assert_int_equal(ag_zoo_build(name, NULL, &me, ie, 8, &ne), 0);
    assert_int_equal(ag_zoo_build(name, NULL, &mx, ix, 8, &nx), 0);
    ag_joint *j = ag_export_joint(mx, ix, nx, NULL, NULL, 0, NULL);
    if (!j)
        print_error("%s: %s\n", name, ag_last_error());
    assert_non_null(j);
    const ag_graph *g = ag_joint_graph(j);
    int np = ag_joint_num_primals(j), nt = ag_joint_num_tangents(j);
    /* Effect tokens (empty tensors) come first among the primals and last among the tangents;
     * the gradients are one per primal after the forward tokens. */
    int ntf = ag_joint_num_forward_tokens(j), ntb = ag_joint_num_backward_tokens(j);
    ag_named_tensors ps, bs, eps, ebs;
    assert_int_equal(ag_module_named_parameters(mx, false, &ps), 0);
    assert_int_equal(ag_module_named_buffers(mx, false, &bs), 0);
    assert_int_equal(ag_module_named_parameters(me, false, &eps), 0);
    assert_int_equal(ag_module_named_buffers(me, false, &ebs), 0);
    ag_scope_begin();
    ag_tensor *flat[64], *eflat[64], *inputs[64], *eprim[64];
    int k = 0;
    for (int i = 0; i < ps.n; i++, k++) {
        flat[k] = ps.tensors[i];
        eflat[k] = eps.tensors[i];
    }
    for (int i = 0; i < bs.n; i++, k++) {
        flat[k] = ag_clone(bs.tensors[i]); /* the graph does not mutate them */
        eflat[k] = ebs.tensors[i];
    }
    for (int i = 0; i < nx; i++, k++) {
        flat[k] = ix[i];
        eflat[k] = ie[i];
    }
    assert_int_equal(k, ag_joint_num_flat_inputs(j));
    assert_int_equal(ag_joint_primals_from_flat(j, flat, k, inputs, 64), np);
    /* Eager forward, then grads with deterministic tangents for the outputs that have one. The
     * joint's philox inputs (a model with random ops) get the generator's state before the
     * eager call. */
    uint64_t seed, offset;
    ag_rng_get_state(&seed, &offset);
    ag_tensor *eo[16];
    int neo = ag_module_call(me, ie, ne, eo, 16);
    assert_true(neo > 0);
    assert_int_equal(ag_joint_primals_from_flat(j, eflat, k, eprim, 64), np);
    ag_tensor *tang[16], *roots[16];
    bool grads = true;
    ag_node **ph;
    int nph = ag_graph_placeholders(g, &ph);
    for (int t = 0; t < nt; t++) {
        const ag_desc *of = ag_desc_nested(ag_node_desc(ph[np + t]));
        if (ag_desc_kind_of(of) != AG_DESC_PLAIN_OUTPUT) {
            const ag_tmeta *tm = ag_node_val(ph[np + t], 0);
            grads = false;
            tang[t] = ag_full(tm->dtype, tm->ndim, tm->sizes, 0.5);
            continue;
        }
        roots[t] = eo[ag_desc_idx(of)];
        tang[t] = ag_full_like(roots[t], 0.5 + 0.25 * t);
    }
    for (int t = 0; t < nt; t++)
        inputs[np + t] = tang[t];
    for (int t = 0; t < ntb; t++)
        inputs[np + nt + t] = ag_empty(AG_F32, 1, (int64_t[]){0});
    int nrng = 0;
    ag_tensor *rng_in[4];
    for (int k2 = np + nt + ntb; k2 < nph && nrng < 4; k2++)
        assert_non_null(inputs[k2] = rng_in[nrng++] = tu_philox_input(ph[k2], seed, offset));
    assert_int_equal(nph, np + nt + ntb + nrng);
    ag_tensor *go[64];
    int ngo = ag_graph_run(g, inputs, nph, go, 64);
    for (int r = 0; r < nrng; r++)
        ag_tensor_free(rng_in[r]);
    if (ngo < 0)
        print_error("%s: run: %s\n", name, ag_last_error());
    assert_int_equal(ngo, ag_joint_num_fw_outputs(j) + (nt ? np - ntf + ntb : 0));
    int nm = ag_joint_num_mutated_inputs(j);
    for (int i = 0; i < neo; i++) {
        double d = tu_max_abs_diff(eo[i], go[ntf + nm + i]);
        if (!(d <= 1e-5)) {
            print_error("%s: output %d differs by %g\n", name, i, d);
            fail();
        }
    }
    /* Eager's mutated inputs (buffers, a view base) equal the mutation outputs. */
    int mi = 0;
    for (int p = 0; p < np; p++)
        if (ag_joint_input_info(j, p)->mutates_data || ag_joint_input_info(j, p)->mutates_metadata)
            assert_true(tu_max_abs_diff(eprim[p], go[ntf + mi++]) <= 1e-5);
    assert_int_equal(mi, nm);
    if (nt && grads) {
        ag_tensor *eg[64];
        assert_int_equal(ag_grad(roots, tang, nt, eps.tensors, eps.n, eg, false, true), 0);
        int base = ag_joint_num_fw_outputs(j) - ntf; /* grads[p - ntf] of primal p */
        for (int i = 0; i < eps.n; i++) {
            /* The joint's gradient of this tensor: the sum over the primals of its slots (a
             * tied weight has one per name, upstream's separate leaves). */
            ag_tensor *sum = NULL;
            bool seen[64] = {false};
            for (int q = 0; q < ps.n; q++) {
                int p = ag_joint_flat_input_primal(j, q);
                if (eps.tensors[q] != eps.tensors[i] || seen[p] || !go[base + p])
                    continue;
                seen[p] = true;
                sum = sum ? ag_add(sum, go[base + p]) : go[base + p];
            }
            if (!eg[i]) {
                assert_null(sum);
                continue;
            }
            assert_non_null(sum);
            double d = tu_max_abs_diff(eg[i], sum);
            double scale = 1.0;
            for (int64_t e = 0; e < ag_tensor_numel(eg[i]); e++)
                scale = fmax(scale, fabs(ag_tensor_item_at(eg[i], e)));
            if (!(d <= 1e-5 * scale)) {
                print_error("%s: grad of %s differs by %g\n", name, eps.names[i], d);
                fail();
            }
        }
    }
    for (int p = 0; p < np; p++) {
        ag_tensor_free(inputs[p]);
        ag_tensor_free(eprim[p]);
    }
    ag_scope_end();
    ag_named_tensors_free(&eps);
    ag_named_tensors_free(&ebs);
    ag_named_tensors_free(&ps);
    ag_named_tensors_free(&bs);
    ag_joint_free(j);
    ag_module_free(me);
    ag_module_free(mx);
    free_inputs(ie, ne);
    free_inputs(ix, nx);
}

static void test_zoo_numerics(void **st) {
    (void)st;
    for (int i = 0; i < ag_zoo_count(); i++)
        if (strcmp(ag_zoo_name(i), "two_tensor")) /* flattened subclasses: test_subclass.c */
            check_zoo_numerics(ag_zoo_name(i));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_simple_linear),
        cmocka_unit_test(test_simple_linear_core_decompositions),
        cmocka_unit_test(test_conv_bn),
        cmocka_unit_test(test_module_with_kwargs),
        cmocka_unit_test(test_multiple_outputs),
        cmocka_unit_test(test_in_out_specs_and_static_inputs),
        cmocka_unit_test(test_preserve_annotate_simple),
        cmocka_unit_test(test_preserve_annotate_function),
        cmocka_unit_test(test_no_annotation_on_gradient_acc_nodes),
        cmocka_unit_test(test_zoo_traces_in_source_order),
        cmocka_unit_test(test_custom_op_stack_trace),
        cmocka_unit_test(test_preserve_annotate_replay_view),
        cmocka_unit_test(test_annotate_fn_anchors_nested_functional_call),
        cmocka_unit_test(test_annotate_fn_anchors_pure_tensor_ops),
        cmocka_unit_test(test_annotate_fn_nested_with_module_forward),
        cmocka_unit_test(test_inference_graph),
        cmocka_unit_test(test_zoo_numerics),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
