/* Joints that call subgraphs (invoke_subgraph, upstream test 23's form), consumed by every
 * stage after the graph layer: the inline pass (ag_graph_inline_subgraphs), the partitioner
 * (each region's joint subgraph partitioned once into partitioned_fw/bw_subgraph_*, the call
 * pairs rewritten), the planned executor (one plan per subgraph, run at each call), the
 * interpreter compiler, saved joints and the sharding pass.
 *
 * The joints are written by hand as saved-joint text: (a) upstream test 23's (a region sin(x)*1
 * called once, z - 1 after it) and (b) an MLP block (addmm, relu, addmm, its weights as
 * operands) called three times in sequence with three weight sets. References are eager
 * autograd on the same ops (a wrong partition, a wrong pairing of saved values or a plan that
 * hands out a buffer its next call overwrites gives other numbers) and the interpreter on the
 * unpartitioned joint. Tolerance: 1e-5 relative, as the compiled side may run fused kernels
 * (different summation order in float32) where eager runs one op at a time; the plain plan
 * against the interpreter of the same graphs is bit-identical in practice but not promised. */
#define AG_NO_SITES
#include "testutil.h"
#include "partition/partition_internal.h"
#include "runtime/plan_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- the joints ---- */

/* The saved-joint header for nin plain inputs (input i requires grad unless rg says it does
 * not; rg NULL: all do) and one plain output. */
static char *joint_text_rg(int nin, const bool *rg, const char *graph) {
    size_t cap = 4096 + strlen(graph) + (size_t)nin * 256;
    char *s = malloc(cap);
    assert_non_null(s);
    size_t k = 0;
    k += (size_t)snprintf(s + k, cap - k,
                          "aotgrad-joint 1\nparams_spec: []\nbuffers_spec: []\n"
                          "in_spec: TreeSpec(tuple, None, [TreeSpec(list, None, [");
    for (int i = 0; i < nin; i++)
        k += (size_t)snprintf(s + k, cap - k, "%s*", i ? ", " : "");
    k += (size_t)snprintf(s + k, cap - k,
                          "]), TreeSpec(dict, [], [])])\nout_spec: *\nneeds_autograd: True\n"
                          "input_info: %d\n",
                          nin);
    for (int i = 0; i < nin; i++)
        k += (size_t)snprintf(s + k, cap - k,
                              "  %d mutates_data=False mutates_metadata=False "
                              "requires_grad=%s\n",
                              i, !rg || rg[i] ? "True" : "False");
    k += (size_t)snprintf(s + k, cap - k,
                          "output_info: 1\n  0 alias=non_alias base_index=-1 requires_grad=True "
                          "geom=f32[]{}+0\nflat_inputs: %d\n",
                          nin);
    for (int i = 0; i < nin; i++)
        k += (size_t)snprintf(s + k, cap - k,
                              "  %d kind=primal primal=%d dup_of=-1 metadata_mutation=-1 "
                              "geom=f32[]{}+0 new_geom=f32[]{}+0\n",
                              i, i);
    k += (size_t)snprintf(s + k, cap - k, "primal_sources: %d\n", nin);
    for (int i = 0; i < nin; i++)
        k += (size_t)snprintf(s + k, cap - k, "  %d base=none flat=%d new_geom=f32[]{}+0\n", i, i);
    k +=
        (size_t)snprintf(s + k, cap - k, "metadata_mutations: 0\nintermediate_bases: 0\n%s", graph);
    assert_true(k < cap);
    return s;
}

static char *joint_text(int nin, const char *graph) {
    return joint_text_rg(nin, NULL, graph);
}

static ag_joint *load_joint(int nin, const char *graph) {
    char *s = joint_text(nin, graph);
    ag_joint *j = ag_joint_load(s, strlen(s));
    if (!j)
        print_error("load: %s\n", ag_last_error());
    free(s);
    assert_non_null(j);
    return j;
}

/* (a) upstream test 23: z = sin(x) * 1 in a region, z - 1. */
static const char *const sin_region_graph =
    "graph():\n"
    "    %primals_1 : f32[4, 3]  # PlainAOTInput(idx=0)\n"
    "    %tangents_1 : f32[4, 3]  # TangentAOTInput(output=PlainAOTOutput(idx=0))\n"
    "    %repeated_subgraph0 = get_attr(repeated_subgraph0)  # subgraph\n"
    "    %invoke_subgraph = invoke_subgraph(%repeated_subgraph0, 'fw_subgraph_0', "
    "%primals_1)  # (f32[4, 3],)\n"
    "    %getitem = getitem(%invoke_subgraph, 0)  # f32[4, 3]\n"
    "    %sub = sub.Scalar(%getitem, 1)  # f32[4, 3]\n"
    "    %repeated_subgraph1 = get_attr(repeated_subgraph1)  # subgraph\n"
    "    %invoke_subgraph_1 = invoke_subgraph(%repeated_subgraph1, 'bw_subgraph_0_0', "
    "%primals_1, %tangents_1)  # (f32[4, 3], f32[4, 3])\n"
    "    %getitem_1 = getitem(%invoke_subgraph_1, 0)  # f32[4, 3]\n"
    "    return (%sub, %getitem_1)  # [PlainAOTOutput(idx=0), "
    "GradAOTOutput(grad_of=PlainAOTInput(idx=0))]\n"
    "\n"
    "subgraph repeated_subgraph0():\n"
    "    %arg0_1 : f32[4, 3]  # None\n"
    "    %sin = sin(%arg0_1)  # f32[4, 3]\n"
    "    %mul = mul.Scalar(%sin, 1)  # f32[4, 3]\n"
    "    return (%mul,)\n"
    "\n"
    "subgraph repeated_subgraph1():\n"
    "    %arg0_1 : f32[4, 3]  # None\n"
    "    %arg1_1 : f32[4, 3]  # None\n"
    "    %sin = sin(%arg0_1)  # f32[4, 3]\n"
    "    %mul = mul.Scalar(%sin, 1)  # f32[4, 3]\n"
    "    %mul_1 = mul.Scalar(%arg1_1, 1)  # f32[4, 3]\n"
    "    %cos = cos(%arg0_1)  # f32[4, 3]\n"
    "    %mul_2 = mul.Tensor(%mul_1, %cos)  # f32[4, 3]\n"
    "    return (%mul_2, %mul)\n";

/* (b) the MLP block y = addmm(b2, relu(addmm(b1, x, w1^T)), w2^T), x [4, 3], w1 [5, 3],
 * w2 [3, 5], called three times in sequence (x, then the block's outputs) with three weight
 * sets. Inputs: x, then (w1, b1, w2, b2) per call. */
#define MLP_NIN 13
static const char *const mlp_fw_sub = "subgraph repeated_subgraph0():\n"
                                      "    %arg0_1 : f32[4, 3]  # None\n"
                                      "    %arg1_1 : f32[5, 3]  # None\n"
                                      "    %arg2_1 : f32[5]  # None\n"
                                      "    %arg3_1 : f32[3, 5]  # None\n"
                                      "    %arg4_1 : f32[3]  # None\n"
                                      "    %t = t(%arg1_1)  # f32[3, 5]{1, 3}\n"
                                      "    %addmm = addmm(%arg2_1, %arg0_1, %t)  # f32[4, 5]\n"
                                      "    %relu = relu(%addmm)  # f32[4, 5]\n"
                                      "    %t_1 = t(%arg3_1)  # f32[5, 3]{1, 5}\n"
                                      "    %addmm_1 = addmm(%arg4_1, %relu, %t_1)  # f32[4, 3]\n"
                                      "    return (%addmm_1,)\n";
static const char *const mlp_bw_sub =
    "subgraph repeated_subgraph1():\n"
    "    %arg0_1 : f32[4, 3]  # None\n"
    "    %arg1_1 : f32[5, 3]  # None\n"
    "    %arg2_1 : f32[5]  # None\n"
    "    %arg3_1 : f32[3, 5]  # None\n"
    "    %arg4_1 : f32[3]  # None\n"
    "    %arg5_1 : f32[4, 3]  # None\n"
    "    %t = t(%arg1_1)  # f32[3, 5]{1, 3}\n"
    "    %addmm = addmm(%arg2_1, %arg0_1, %t)  # f32[4, 5]\n"
    "    %relu = relu(%addmm)  # f32[4, 5]\n"
    "    %t_1 = t(%arg3_1)  # f32[5, 3]{1, 5}\n"
    "    %addmm_1 = addmm(%arg4_1, %relu, %t_1)  # f32[4, 3]\n"
    "    %mm = mm(%arg5_1, %arg3_1)  # f32[4, 5]\n"
    "    %t_2 = t(%arg5_1)  # f32[3, 4]{1, 3}\n"
    "    %mm_1 = mm(%t_2, %relu)  # f32[3, 5]\n"
    "    %sum_1 = sum.dim_IntList(%arg5_1, [0])  # f32[3]\n"
    "    %threshold_backward = threshold_backward(%mm, %relu, 0)  # f32[4, 5]\n"
    "    %mm_2 = mm(%threshold_backward, %arg1_1)  # f32[4, 3]\n"
    "    %t_3 = t(%threshold_backward)  # f32[5, 4]{1, 5}\n"
    "    %mm_3 = mm(%t_3, %arg0_1)  # f32[5, 3]\n"
    "    %sum_2 = sum.dim_IntList(%threshold_backward, [0])  # f32[5]\n"
    "    return (%mm_2, %mm_3, %sum_2, %mm_1, %sum_1, %addmm_1)\n";

/* The MLP joint's text (bw_first_op: the first operand of the first backward call, to make a
 * malformed pair; NULL for the right one). */
static char *mlp_graph(const char *bw_first_op) {
    size_t cap = 16384;
    char *s = malloc(cap);
    assert_non_null(s);
    size_t k = 0;
    static const char *const shapes[4] = {"f32[5, 3]", "f32[5]", "f32[3, 5]", "f32[3]"};
    k += (size_t)snprintf(s + k, cap - k,
                          "graph():\n    %%primals_1 : f32[4, 3]  # PlainAOTInput(idx=0)\n");
    for (int i = 1; i < MLP_NIN; i++)
        k += (size_t)snprintf(s + k, cap - k, "    %%primals_%d : %s  # PlainAOTInput(idx=%d)\n",
                              i + 1, shapes[(i - 1) % 4], i);
    k += (size_t)snprintf(s + k, cap - k,
                          "    %%tangents_1 : f32[4, 3]  # "
                          "TangentAOTInput(output=PlainAOTOutput(idx=0))\n");
    /* Forward: y_c = block(y_{c-1}, weights of call c). */
    char prev[32] = "primals_1";
    for (int c = 0; c < 3; c++) {
        k += (size_t)snprintf(s + k, cap - k,
                              "    %%fa%d = get_attr(repeated_subgraph0)  # subgraph\n"
                              "    %%fc%d = invoke_subgraph(%%fa%d, 'fw_subgraph_0', %%%s, "
                              "%%primals_%d, %%primals_%d, %%primals_%d, %%primals_%d)  "
                              "# (f32[4, 3],)\n"
                              "    %%y%d = getitem(%%fc%d, 0)  # f32[4, 3]\n",
                              c, c, c, prev, 2 + 4 * c, 3 + 4 * c, 4 + 4 * c, 5 + 4 * c, c, c);
        snprintf(prev, sizeof prev, "y%d", c);
    }
    /* Backward: call 2, 1, 0, each taking the gradient of its output. */
    char g[32] = "tangents_1";
    for (int c = 2; c >= 0; c--) {
        char in[32];
        if (c == 0)
            snprintf(in, sizeof in, "primals_1");
        else
            snprintf(in, sizeof in, "y%d", c - 1);
        const char *first = c == 2 && bw_first_op ? bw_first_op : in;
        k += (size_t)snprintf(s + k, cap - k,
                              "    %%ba%d = get_attr(repeated_subgraph1)  # subgraph\n"
                              "    %%bc%d = invoke_subgraph(%%ba%d, 'bw_subgraph_0_0', %%%s, "
                              "%%primals_%d, %%primals_%d, %%primals_%d, %%primals_%d, %%%s)  "
                              "# (f32[4, 3], f32[5, 3], f32[5], f32[3, 5], f32[3], f32[4, 3])\n",
                              c, c, c, first, 2 + 4 * c, 3 + 4 * c, 4 + 4 * c, 5 + 4 * c, g);
        static const char *const gs[5] = {"f32[4, 3]", "f32[5, 3]", "f32[5]", "f32[3, 5]",
                                          "f32[3]"};
        for (int o = 0; o < 5; o++)
            k += (size_t)snprintf(s + k, cap - k, "    %%g%d_%d = getitem(%%bc%d, %d)  # %s\n", c,
                                  o, c, o, gs[o]);
        snprintf(g, sizeof g, "g%d_0", c);
    }
    k += (size_t)snprintf(s + k, cap - k, "    return (%%y2, %%g0_0");
    for (int c = 0; c < 3; c++)
        for (int o = 1; o < 5; o++)
            k += (size_t)snprintf(s + k, cap - k, ", %%g%d_%d", c, o);
    k += (size_t)snprintf(s + k, cap - k, ")  # [PlainAOTOutput(idx=0)");
    for (int i = 0; i < MLP_NIN; i++)
        k += (size_t)snprintf(s + k, cap - k, ", GradAOTOutput(grad_of=PlainAOTInput(idx=%d))", i);
    k += (size_t)snprintf(s + k, cap - k, "]\n\n%s\n%s", mlp_fw_sub, mlp_bw_sub);
    assert_true(k < cap);
    return s;
}

static ag_joint *mlp_joint(void) {
    char *g = mlp_graph(NULL);
    ag_joint *j = load_joint(MLP_NIN, g);
    free(g);
    return j;
}

/* ---- inputs and references ---- */

typedef struct model {
    const char *name;
    int nin;
    ag_joint *j;
    ag_tensor *in[MLP_NIN];   /* leaves requiring grad */
    ag_tensor *tangent;       /* the output's gradient */
    ag_tensor *want_out;      /* eager */
    ag_tensor *want[MLP_NIN]; /* eager gradients */
} model;

static ag_tensor *rand_leaf(int ndim, const int64_t *sizes, uint64_t *st) {
    ag_tensor *t = tu_rand_tensor(AG_F32, ndim, sizes, -1, 1, tu_xorshift, st);
    assert_int_equal(ag_tensor_set_requires_grad(t, true), 0);
    return t;
}

/* The eager forward of m on its leaves (a new reference). */
static ag_tensor *eager_forward(const model *m) {
    ag_scope_begin();
    ag_tensor *y;
    if (m->nin == 1) {
        y = ag_sub_scalar(ag_mul_scalar(ag_sin(m->in[0]), 1), 1);
    } else {
        y = m->in[0];
        for (int c = 0; c < 3; c++) {
            ag_tensor *const *w = m->in + 1 + 4 * c;
            ag_tensor *h = ag_relu(ag_addmm(w[1], y, ag_t(w[0]), 1, 1));
            y = ag_addmm(w[3], h, ag_t(w[2]), 1, 1);
        }
    }
    ag_tensor_keep(y);
    ag_scope_end();
    return y;
}

static void zero_grads(model *m) {
    for (int i = 0; i < m->nin; i++)
        ag_tensor_set_grad(m->in[i], NULL);
}

static void setup_model(model *m, bool mlp) {
    memset(m, 0, sizeof *m);
    uint64_t st = 0x5eed + (mlp ? 7 : 0);
    static const int64_t x[2] = {4, 3}, w1[2] = {5, 3}, b1[1] = {5}, w2[2] = {3, 5}, b2[1] = {3};
    m->name = mlp ? "mlp3" : "sin_region";
    m->nin = mlp ? MLP_NIN : 1;
    m->j = mlp ? mlp_joint() : load_joint(1, sin_region_graph);
    m->in[0] = rand_leaf(2, x, &st);
    for (int c = 0; mlp && c < 3; c++) {
        m->in[1 + 4 * c] = rand_leaf(2, w1, &st);
        m->in[2 + 4 * c] = rand_leaf(1, b1, &st);
        m->in[3 + 4 * c] = rand_leaf(2, w2, &st);
        m->in[4 + 4 * c] = rand_leaf(1, b2, &st);
    }
    m->tangent = tu_rand_tensor(AG_F32, 2, x, -1, 1, tu_xorshift, &st);
    m->want_out = eager_forward(m);
    assert_int_equal(ag_backward(m->want_out, m->tangent, false), 0);
    for (int i = 0; i < m->nin; i++) {
        m->want[i] = ag_detach(ag_tensor_grad(m->in[i])); /* a new reference: no scope */
        assert_non_null(m->want[i]);
    }
    zero_grads(m);
}

static void teardown_model(model *m) {
    ag_joint_free(m->j);
    for (int i = 0; i < m->nin; i++) {
        ag_tensor_free(m->in[i]);
        ag_tensor_free(m->want[i]);
    }
    ag_tensor_free(m->tangent);
    ag_tensor_free(m->want_out);
}

static void assert_close_rel(const ag_tensor *want, const ag_tensor *got, const char *what) {
    assert_non_null(got);
    assert_int_equal(ag_tensor_numel(want), ag_tensor_numel(got));
    for (int64_t i = 0; i < ag_tensor_numel(want); i++) {
        double a = ag_tensor_item_at(want, i), b = ag_tensor_item_at(got, i);
        if (!(fabs(a - b) <= 1e-5 * (1 + fabs(a))))
            fail_msg("%s[%lld]: %.9g, want %.9g", what, (long long)i, b, a);
    }
}

/* Compiles m's joint with opts, runs forward and backward, checks against eager. Returns the
 * compiled callable (caller frees). */
static ag_compiled *check_compiled(model *m, const ag_compile_opts *opts, const char *what) {
    ag_compiled *c = ag_compile_joint(m->j, opts);
    if (!c)
        fail_msg("%s %s: compile: %s", m->name, what, ag_last_error());
    for (int round = 0; round < 2; round++) { /* the second call reuses every buffer */
        zero_grads(m);
        ag_tensor *out = NULL;
        assert_int_equal(ag_compiled_call(c, m->in, m->nin, &out, 1), 1);
        assert_close_rel(m->want_out, out, what);
        assert_int_equal(ag_backward(out, m->tangent, false), 0);
        for (int i = 0; i < m->nin; i++) {
            char w[96];
            snprintf(w, sizeof w, "%s %s grad %d", m->name, what, i);
            assert_close_rel(m->want[i], ag_tensor_grad(m->in[i]), w);
        }
        ag_tensor_free(out);
    }
    zero_grads(m);
    return c;
}

/* ---- the inline pass ---- */

static int count_calls(const ag_graph *g, const char *attr) {
    int k = 0;
    for (ag_node *n = ag_graph_first(g); n; n = ag_node_next(n)) {
        if (ag_node_kind_of(n) != AG_NODE_CALL || ag_node_op(n) != ag_op_invoke_subgraph())
            continue;
        const char *nm = NULL;
        ag_graph *s = ag_node_subgraph(ag_node_arg_node(n, 0));
        for (int i = 0; i < ag_graph_num_subgraphs(g); i++)
            if (ag_graph_subgraph_at(g, i, &nm) == s)
                break;
        k += !attr || (nm && !strcmp(nm, attr));
    }
    return k;
}

static int count_op(const ag_graph *g, const char *op) {
    int k = 0;
    for (ag_node *n = ag_graph_first(g); n; n = ag_node_next(n))
        k += ag_node_kind_of(n) == AG_NODE_CALL && !strcmp(ag_op_name(ag_node_op(n)), op);
    return k;
}

/* The joint's inputs for the interpreter: leaves' values and the tangent. */
static int joint_inputs(const model *m, ag_tensor **v) {
    for (int i = 0; i < m->nin; i++)
        v[i] = m->in[i];
    v[m->nin] = m->tangent;
    return m->nin + 1;
}

static void test_inline_runs_identically(void **st) {
    (void)st;
    for (int mi = 0; mi < 2; mi++) {
        model m;
        setup_model(&m, mi == 1);
        const ag_graph *g = ag_joint_graph(m.j);
        char *before = ag_graph_to_string(g, NULL);
        ag_graph *flat = ag_graph_inline_subgraphs(g);
        if (!flat)
            fail_msg("inline: %s", ag_last_error());
        assert_int_equal(ag_graph_verify(flat), 0);
        if (ag_graph_num_subgraphs(flat) != 0) {
            char *t = ag_graph_to_string(flat, NULL);
            print_error("%s\n", t);
            ag_free(t);
        }
        assert_int_equal(ag_graph_num_subgraphs(flat), 0);
        assert_int_equal(count_calls(flat, NULL), 0);
        /* One copy of the region's nodes per call: the sin region has sin, mul (forward) and
         * sin, mul, mul_1, cos, mul_2 (joint, its unread mul removed by nobody: kept). */
        char *after = ag_graph_to_string(g, NULL);
        assert_string_equal(before, after); /* g untouched */
        ag_free(before);
        ag_free(after);
        ag_tensor *v[MLP_NIN + 1];
        int nv = joint_inputs(&m, v);
        ag_tensor *o1[MLP_NIN + 1] = {0}, *o2[MLP_NIN + 1] = {0};
        ag_scope_begin();
        int n1 = ag_graph_run(g, v, nv, o1, MLP_NIN + 1);
        int n2 = ag_graph_run(flat, v, nv, o2, MLP_NIN + 1);
        assert_int_equal(n1, m.nin + 1);
        assert_int_equal(n2, n1);
        for (int i = 0; i < n1; i++)
            assert_true(tu_same_bits(o1[i], o2[i]));
        /* and the interpreter of the joint equals eager */
        assert_close_rel(m.want_out, o1[0], "interpreted joint");
        for (int i = 0; i < m.nin; i++)
            assert_close_rel(m.want[i], o1[1 + i], "interpreted joint grad");
        ag_scope_end();
        ag_graph_free(flat);
        teardown_model(&m);
    }
    assert_null(ag_graph_inline_subgraphs(NULL));

    /* A subgraph with a constant, called twice, and a constant of the same name outside. */
    const char *text = "graph():\n"
                       "    %x : f32[2]  # None\n"
                       "    %k = get_attr(k)  # subgraph\n"
                       "    %invoke_subgraph = invoke_subgraph(%k, 'c', %x)  # (f32[2],)\n"
                       "    %getitem = getitem(%invoke_subgraph, 0)  # f32[2]\n"
                       "    %invoke_subgraph_1 = invoke_subgraph(%k, 'c', %getitem)  # (f32[2],)\n"
                       "    %getitem_1 = getitem(%invoke_subgraph_1, 0)  # f32[2]\n"
                       "    %_tensor_constant0 = get_attr(_tensor_constant0)  # f32[2]\n"
                       "    %add = add.Tensor(%getitem_1, %_tensor_constant0)  # f32[2]\n"
                       "    return (%add,)\n"
                       "\n"
                       "constant _tensor_constant0 : f32[2] = [1.0, -1.0]\n"
                       "\n"
                       "subgraph k():\n"
                       "    %arg0_1 : f32[2]  # None\n"
                       "    %_tensor_constant0 = get_attr(_tensor_constant0)  # f32[2]\n"
                       "    %mul = mul.Tensor(%arg0_1, %_tensor_constant0)  # f32[2]\n"
                       "    return (%mul,)\n"
                       "\n"
                       "constant _tensor_constant0 : f32[2] = [0.5, -2.0]\n";
    ag_graph *g = ag_graph_parse(text, strlen(text));
    if (!g)
        fail_msg("parse: %s", ag_last_error());
    ag_graph *flat = ag_graph_inline_subgraphs(g);
    if (!flat)
        fail_msg("inline: %s", ag_last_error());
    assert_int_equal(ag_graph_verify(flat), 0);
    assert_int_equal(ag_graph_num_subgraphs(flat), 0);
    assert_int_equal(count_op(flat, "mul.Tensor"), 2);
    static const int64_t two[1] = {2};
    static const double xv[2] = {3, 5};
    ag_tensor *x = tu_tensor(AG_F32, 1, two, xv);
    ag_tensor *o1 = NULL, *o2 = NULL;
    assert_int_equal(ag_graph_run(g, &x, 1, &o1, 1), 1);
    assert_int_equal(ag_graph_run(flat, &x, 1, &o2, 1), 1);
    assert_true(tu_same_bits(o1, o2));
    /* by hand: 3 * 0.5 * 0.5 + 1 and 5 * -2 * -2 - 1 */
    static const double want[2] = {1.75, 19};
    tu_assert_close(o2, want, 0);
    ag_tensor_free(o1);
    ag_tensor_free(o2);
    ag_tensor_free(x);
    ag_graph_free(flat);
    ag_graph_free(g);
}

/* ---- partitioning ---- */

static void test_partition_structure(void **st) {
    (void)st;
    model m;
    setup_model(&m, true);
    const ag_graph *g = ag_joint_graph(m.j);
    char *before = ag_graph_to_string(g, NULL);
    for (int part = 0; part < 2; part++) {
        for (int b = 0; b < 2; b++) {
            ag_partition_opts po = {.partitioner =
                                        part ? AG_PARTITION_MINCUT : AG_PARTITION_DEFAULT,
                                    .memory_budget = b ? 0 : AG_MEMORY_BUDGET_ZERO};
            ag_graph *fw = NULL, *bw = NULL;
            ag_partition_stats ps;
            if (ag_partition(g, 1, &po, &fw, &bw, &ps))
                fail_msg("partition %d budget %d: %s", part, b, ag_last_error());
            assert_int_equal(ag_graph_verify(fw), 0);
            assert_int_equal(ag_graph_verify(bw), 0);
            /* One partitioned forward subgraph called three times; one backward. */
            assert_int_equal(ag_graph_num_subgraphs(fw), 1);
            assert_int_equal(ag_graph_num_subgraphs(bw), 1);
            ag_graph *rfw = ag_graph_subgraph(fw, "partitioned_fw_subgraph_0_0");
            ag_graph *rbw = ag_graph_subgraph(bw, "partitioned_bw_subgraph_0_0");
            assert_non_null(rfw);
            assert_non_null(rbw);
            assert_int_equal(count_calls(fw, "partitioned_fw_subgraph_0_0"), 3);
            assert_int_equal(count_calls(bw, "partitioned_bw_subgraph_0_0"), 3);
            assert_int_equal(count_calls(fw, NULL), 3);
            assert_int_equal(count_calls(bw, NULL), 3);
            /* The region's forward returns its output and s saved values; its backward takes
             * them and the tangent and returns the 5 grads. */
            ag_node **ph = NULL;
            assert_int_equal(ag_graph_placeholders(rfw, &ph), 5);
            int nfo = ag_node_arg(ag_graph_output_node(rfw), 0)->n, s = nfo - 1;
            assert_true(s >= 1);
            assert_int_equal(ag_graph_placeholders(rbw, &ph), s + 1);
            assert_int_equal(ag_node_arg(ag_graph_output_node(rbw), 0)->n, 5);
            /* The outer saved values: each call's s saved getitems, nothing else (the
             * backward calls take no operand). */
            assert_int_equal(ps.saved_tensors, 3 * s);
            assert_int_equal(ag_graph_placeholders(bw, &ph), 3 * s + 1);
            /* No descriptors inside the subgraphs. */
            for (ag_node *n = ag_graph_first(rfw); n; n = ag_node_next(n))
                assert_null(ag_node_desc(n));
            /* A recomputing partition saves less: budget 0 with the min-cut saves only what
             * the relu's backward cannot recompute cheaply. */
            /* What the region's backward runs: the default partitioner saves relu's output and
             * recomputes nothing; the min-cut under budget 0 saves the operands instead
             * (x, w1, b1, w2: as many tensors, fewer bytes) and runs the first addmm again. */
            int naddmm = count_op(rbw, "addmm");
            assert_int_equal(naddmm, part == 1 && b == 0 ? 1 : 0);
            ag_graph_free(fw);
            ag_graph_free(bw);
        }
    }
    char *after = ag_graph_to_string(g, NULL);
    assert_string_equal(before, after); /* the user's joint is never modified */
    ag_free(before);
    ag_free(after);
    teardown_model(&m);
}

static void test_compile_matches_eager(void **st) {
    (void)st;
    for (int mi = 0; mi < 2; mi++) {
        model m;
        setup_model(&m, mi == 1);
        for (int part = 0; part < 2; part++)
            for (int b = 0; b < 2; b++)
                for (int interp = 0; interp < 2; interp++) {
                    ag_compile_opts o = {0};
                    o.partition.partitioner = part ? AG_PARTITION_MINCUT : AG_PARTITION_DEFAULT;
                    o.partition.memory_budget = b ? 0 : AG_MEMORY_BUDGET_ZERO;
                    o.interpret = interp;
                    char what[64];
                    snprintf(what, sizeof what, "partitioner %d budget %d interpret %d", part,
                             b ? 1 : 0, interp);
                    ag_compiled_free(check_compiled(&m, &o, what));
                }
        teardown_model(&m);
    }
}

/* A pair partitioned beforehand (calling the partitioned subgraphs) compiles as given. */
static void test_prepartitioned_pair(void **st) {
    (void)st;
    model m;
    setup_model(&m, true);
    ag_graph *fw = NULL, *bw = NULL;
    ag_partition_opts po = {.partitioner = AG_PARTITION_MINCUT};
    assert_int_equal(ag_partition(ag_joint_graph(m.j), 1, &po, &fw, &bw, NULL), 0);
    ag_compile_opts o = {.fw_graph = fw, .bw_graph = bw};
    ag_compiled *c = check_compiled(&m, &o, "pre-partitioned");
    assert_int_equal(count_calls(ag_compiled_forward_graph(c), "partitioned_fw_subgraph_0_0"), 3);
    ag_compiled_free(c);
    ag_graph_free(fw);
    ag_graph_free(bw);
    teardown_model(&m);
}

/* ---- the executor ---- */

static void test_plan_once_per_subgraph(void **st) {
    (void)st;
    model m;
    setup_model(&m, true);
    ag_compiled *c = check_compiled(&m, NULL, "default");
    const ag_graph *fw = ag_compiled_forward_graph(c), *bw = ag_compiled_backward_graph(c);
    ag_plan_opts chk = {.checking = true}; /* poison and overlap checks, the subplans too */
    ag_plan *pf = ag_plan_new(fw, &chk), *pb = ag_plan_new(bw, &chk);
    assert_non_null(pf);
    assert_non_null(pb);
    ag__plan_stats s;
    ag__plan_get_stats(pf, &s);
    assert_int_equal(s.subplans, 1);
    ag__plan_get_stats(pb, &s);
    assert_int_equal(s.subplans, 1);
    /* Run the forward plan, then the backward on its saved outputs, twice; the second time
     * allocates nothing. */
    ag_tensor *fin[MLP_NIN], *fo[32] = {0}, *bo[MLP_NIN] = {0};
    for (int i = 0; i < MLP_NIN; i++)
        fin[i] = ag_detach(m.in[i]);
    ag_node **ph = NULL;
    int nbin = ag_graph_placeholders(bw, &ph);
    for (int round = 0; round < 2; round++) {
        if (round == 1)
            tu_alloc_count_begin();
        int nfo = ag_plan_run(pf, fin, MLP_NIN, fo, 32);
        assert_int_equal(nfo, nbin); /* output + saved = saved + tangent */
        ag_tensor *bin[32];
        for (int i = 1; i < nfo; i++)
            bin[i - 1] = fo[i];
        bin[nfo - 1] = m.tangent;
        assert_int_equal(ag_plan_run(pb, bin, nbin, bo, MLP_NIN), MLP_NIN);
        if (round == 1) {
            int64_t n = tu_alloc_count_end();
            assert_int_equal(n, 0);
        }
        assert_close_rel(m.want_out, fo[0], "planned forward");
        for (int i = 0; i < MLP_NIN; i++)
            assert_close_rel(m.want[i], bo[i], "planned backward");
        for (int i = 0; i < nfo; i++) {
            ag_tensor_free(fo[i]);
            fo[i] = NULL;
        }
        for (int i = 0; i < MLP_NIN; i++) {
            ag_tensor_free(bo[i]);
            bo[i] = NULL;
        }
    }
    ag__plan_get_stats(pf, &s);
    assert_int_equal(s.runs, 2);
    assert_int_equal(s.subplan_runs, 6); /* one plan, run at each of the 3 calls */
    /* The region's forward output and its saved relu are computed in the caller's buffers.*/
    assert_true(s.subplan_direct_outputs >= 2 * 6);
    /* The operands it saves (x, weights) are read by the caller where they are: no copies. */
    assert_true(s.subplan_passed_outputs >= 6);
    assert_int_equal(s.subplan_copied_outputs, 0);
    ag__plan_get_stats(pb, &s);
    assert_int_equal(s.subplan_runs, 6);
    for (int i = 0; i < MLP_NIN; i++)
        ag_tensor_free(fin[i]);
    ag_plan_free(pf);
    ag_plan_free(pb);
    ag_compiled_free(c);
    teardown_model(&m);
}

/* ---- saved joints ---- */

static void test_joint_io_roundtrip(void **st) {
    (void)st;
    ag_joint *j = mlp_joint();
    char *s1 = NULL, *s2 = NULL;
    size_t n1 = 0, n2 = 0;
    assert_int_equal(ag_joint_save(j, &s1, &n1), 0);
    assert_non_null(strstr(s1, "\nsubgraph repeated_subgraph1():\n"));
    ag_joint *j2 = ag_joint_load(s1, n1);
    assert_non_null(j2);
    assert_int_equal(ag_joint_save(j2, &s2, &n2), 0);
    assert_string_equal(s1, s2);
    uint64_t h1 = 0, h2 = 0, h3 = 0;
    assert_int_equal(ag_joint_hash(j, &h1), 0);
    assert_int_equal(ag_joint_hash(j2, &h2), 0);
    assert_true(h1 == h2);
    /* The hash covers the subgraphs: relu -> sigmoid inside the forward region only. */
    char *g = mlp_graph(NULL);
    char *p = strstr(g, "%relu = relu(%addmm)");
    assert_non_null(p);
    memcpy(p, "%relu = tanh(%addmm)", strlen("%relu = tanh(%addmm)"));
    ag_joint *j3 = load_joint(MLP_NIN, g);
    assert_int_equal(ag_joint_hash(j3, &h3), 0);
    assert_true(h3 != h1);
    free(g);
    ag_free(s1);
    ag_free(s2);
    ag_joint_free(j);
    ag_joint_free(j2);
    ag_joint_free(j3);
}

/* ---- malformed pairs ---- */

static void expect_partition_error(const char *graph, int nin, const char *msg) {
    ag_joint *j = load_joint(nin, graph);
    ag_graph *fw = NULL, *bw = NULL;
    assert_true(ag_partition(ag_joint_graph(j), 1, NULL, &fw, &bw, NULL) < 0);
    tu_assert_error_contains(msg);
    assert_null(fw);
    assert_null(bw);
    assert_null(ag_compile_joint(j, NULL));
    tu_assert_error_contains(msg);
    ag_joint_free(j);
}

static void test_malformed_pairs(void **st) {
    (void)st;
    /* The last backward call reads y0 where its forward call read y1. */
    char *g = mlp_graph("y0");
    expect_partition_error(g, MLP_NIN, "is a backward call of no forward call");
    free(g);
    /* A joint subgraph that returns only the grads (one output fewer than the pair needs). */
    char *bad = strdup(sin_region_graph);
    char *p = strstr(bad, "return (%mul_2, %mul)");
    assert_non_null(p);
    memcpy(p, "return (%mul_2,)     ", strlen("return (%mul_2,)     "));
    p = strstr(bad, "# (f32[4, 3], f32[4, 3])");
    memcpy(p, "# (f32[4, 3],)          ", strlen("# (f32[4, 3],)          "));
    expect_partition_error(bad, 1, "backward call of no forward call");
    free(bad);
}

/* ---- sharding ---- */

static void test_shard_inlines(void **st) {
    (void)st;
    model m;
    setup_model(&m, true);
    ag_mesh mesh = {.size = 1, .rank = 0};
    ag_shard_plan *plan = ag_shard_plan_new();
    assert_non_null(plan);
    ag_joint *sj = ag_shard_joint(m.j, &mesh, plan);
    if (!sj)
        fail_msg("shard: %s", ag_last_error());
    assert_int_equal(ag_graph_num_subgraphs(ag_joint_graph(sj)), 0);
    model m2 = m;
    m2.j = sj;
    ag_compiled_free(check_compiled(&m2, NULL, "sharded"));
    ag_joint_free(sj);
    /* Rank 0 of 2 with the batch sharded: the rank's joint is the inlined one with its batch
     * halved and the weights' gradients all-reduced. */
    assert_int_equal(ag_shard_plan_set_input(plan, 0, AG_P_SHARD(0)), 0);
    ag_mesh two = {.size = 2, .rank = 0};
    sj = ag_shard_joint(m.j, &two, plan);
    if (!sj)
        fail_msg("shard on 2 ranks: %s", ag_last_error());
    const ag_graph *g = ag_joint_graph(sj);
    assert_int_equal(ag_graph_num_subgraphs(g), 0);
    ag_node **ph = NULL;
    assert_true(ag_graph_placeholders(g, &ph) > 0);
    assert_int_equal(ag_node_val(ph[0], 0)->sizes[0], 2);
    int nred = count_op(g, "_c10d_functional::all_reduce");
    assert_true(nred >= 1);
    ag_joint_free(sj);
    ag_shard_plan_free(plan);
    teardown_model(&m);
}

/* ---- allocation failures ---- */

static int partition_scenario(void *ud) {
    const ag_joint *j = ud;
    ag_graph *fw = NULL, *bw = NULL;
    ag_partition_opts po = {.partitioner = AG_PARTITION_MINCUT};
    int rc = ag_partition(ag_joint_graph(j), 1, &po, &fw, &bw, NULL);
    ag_graph_free(fw);
    ag_graph_free(bw);
    if (rc)
        return rc;
    ag_graph *flat = ag_graph_inline_subgraphs(ag_joint_graph(j));
    if (!flat)
        return ag_last_status();
    ag_graph_free(flat);
    /* compiling plans each side and its region's subgraph */
    ag_compiled *c = ag_compile_joint(j, &(ag_compile_opts){.partition = po});
    if (!c)
        return ag_last_status();
    ag_compiled_free(c);
    return 0;
}

static void test_alloc_failures(void **st) {
    (void)st;
    ag_joint *j = load_joint(1, sin_region_graph);
    int64_t points = tu_alloc_failure_sweep(partition_scenario, j, NULL);
    assert_true(points > 10);
    ag_joint_free(j);
}

/* Upstream test 23's joint under the default partitioner, exactly: the forward calls the
 * region's partitioned forward, which returns sin(x) * 1 and saves x (cos(x) needs it); the
 * backward calls the partitioned backward on the saved x and the tangent. */
static const char *const sin_fw_want =
    "graph():\n"
    "    %primals_1 : f32[4, 3]  # PlainAOTInput(idx=0)\n"
    "    %partitioned_fw_subgraph_0_0 = get_attr(partitioned_fw_subgraph_0_0)  # subgraph\n"
    "    %invoke_subgraph_2 = invoke_subgraph(%partitioned_fw_subgraph_0_0, "
    "'partitioned_fw_subgraph_0_0', %primals_1)  # (f32[4, 3], f32[4, 3])\n"
    "    %getitem_2 = getitem(%invoke_subgraph_2, 0)  # f32[4, 3]\n"
    "    %getitem_3 = getitem(%invoke_subgraph_2, 1)  # f32[4, 3]\n"
    "    %sub = sub.Scalar(%getitem_2, 1)  # f32[4, 3]\n"
    "    return (%sub, %getitem_3)  # [PlainAOTOutput(idx=0), "
    "SavedForBackwardsAOTOutput(idx=0)]\n"
    "\n"
    "subgraph partitioned_fw_subgraph_0_0():\n"
    "    %arg0_1 : f32[4, 3]  # None\n"
    "    %sin = sin(%arg0_1)  # f32[4, 3]\n"
    "    %mul = mul.Scalar(%sin, 1)  # f32[4, 3]\n"
    "    return (%mul, %arg0_1)\n";
static const char *const sin_bw_want =
    "graph():\n"
    "    %getitem_3 : f32[4, 3]  # None\n"
    "    %tangents_1 : f32[4, 3]  # TangentAOTInput(output=PlainAOTOutput(idx=0))\n"
    "    %partitioned_bw_subgraph_0_0 = get_attr(partitioned_bw_subgraph_0_0)  # subgraph\n"
    "    %invoke_subgraph_3 = invoke_subgraph(%partitioned_bw_subgraph_0_0, "
    "'partitioned_bw_subgraph_0_0', %getitem_3, %tangents_1)  # (f32[4, 3],)\n"
    "    %getitem_4 = getitem(%invoke_subgraph_3, 0)  # f32[4, 3]\n"
    "    return (%getitem_4,)  # [GradAOTOutput(grad_of=PlainAOTInput(idx=0))]\n"
    "\n"
    "subgraph partitioned_bw_subgraph_0_0():\n"
    "    %arg0_1 : f32[4, 3]  # None\n"
    "    %arg1_1 : f32[4, 3]  # None\n"
    "    %mul_1 = mul.Scalar(%arg1_1, 1)  # f32[4, 3]\n"
    "    %cos = cos(%arg0_1)  # f32[4, 3]\n"
    "    %mul_2 = mul.Tensor(%mul_1, %cos)  # f32[4, 3]\n"
    "    return (%mul_2,)\n";

static void test_sin_region_exact(void **st) {
    (void)st;
    ag_joint *j = load_joint(1, sin_region_graph);
    ag_graph *fw = NULL, *bw = NULL;
    assert_int_equal(ag_partition(ag_joint_graph(j), 1, NULL, &fw, &bw, NULL), 0);
    char *a = ag_graph_to_string(fw, NULL), *b = ag_graph_to_string(bw, NULL);
    assert_string_equal(a, sin_fw_want);
    assert_string_equal(b, sin_bw_want);
    ag_free(a);
    ag_free(b);
    ag_graph_free(fw);
    ag_graph_free(bw);
    ag_joint_free(j);
}

/* ---- a region with operands that do not require grad ---- */

/* y = index_select(relu(x @ w^T) * m, 0, idx) in a region called on x1 and x2 with the same
 * w, mask m and index idx (i64); out = y(x1) + y(x2). Only x1, x2 and w require grad: the
 * region's joint subgraph returns None for m's and idx's grads, which nothing reads. */
static const char *const masked_graph =
    "graph():\n"
    "    %primals_1 : f32[4, 3]  # PlainAOTInput(idx=0)\n"
    "    %primals_2 : f32[4, 3]  # PlainAOTInput(idx=1)\n"
    "    %primals_3 : f32[5, 3]  # PlainAOTInput(idx=2)\n"
    "    %primals_4 : f32[4, 5]  # PlainAOTInput(idx=3)\n"
    "    %primals_5 : i64[4]  # PlainAOTInput(idx=4)\n"
    "    %tangents_1 : f32[4, 5]  # TangentAOTInput(output=PlainAOTOutput(idx=0))\n"
    "    %fa0 = get_attr(repeated_subgraph0)  # subgraph\n"
    "    %fc0 = invoke_subgraph(%fa0, 'fw_subgraph_0', %primals_1, %primals_3, %primals_4, "
    "%primals_5)  # (f32[4, 5],)\n"
    "    %ya = getitem(%fc0, 0)  # f32[4, 5]\n"
    "    %fa1 = get_attr(repeated_subgraph0)  # subgraph\n"
    "    %fc1 = invoke_subgraph(%fa1, 'fw_subgraph_0', %primals_2, %primals_3, %primals_4, "
    "%primals_5)  # (f32[4, 5],)\n"
    "    %yb = getitem(%fc1, 0)  # f32[4, 5]\n"
    "    %add = add.Tensor(%ya, %yb)  # f32[4, 5]\n"
    "    %ba1 = get_attr(repeated_subgraph1)  # subgraph\n"
    "    %bc1 = invoke_subgraph(%ba1, 'bw_subgraph_0_0', %primals_2, %primals_3, %primals_4, "
    "%primals_5, %tangents_1)  # (f32[4, 3], f32[5, 3], f32[0], f32[0], f32[4, 5])\n"
    "    %gb0 = getitem(%bc1, 0)  # f32[4, 3]\n"
    "    %gb1 = getitem(%bc1, 1)  # f32[5, 3]\n"
    "    %ba0 = get_attr(repeated_subgraph1)  # subgraph\n"
    "    %bc0 = invoke_subgraph(%ba0, 'bw_subgraph_0_0', %primals_1, %primals_3, %primals_4, "
    "%primals_5, %tangents_1)  # (f32[4, 3], f32[5, 3], f32[0], f32[0], f32[4, 5])\n"
    "    %ga0 = getitem(%bc0, 0)  # f32[4, 3]\n"
    "    %ga1 = getitem(%bc0, 1)  # f32[5, 3]\n"
    "    %gw = add.Tensor(%ga1, %gb1)  # f32[5, 3]\n"
    "    return (%add, %ga0, %gb0, %gw, None, None)  # [PlainAOTOutput(idx=0), "
    "GradAOTOutput(grad_of=PlainAOTInput(idx=0)), GradAOTOutput(grad_of=PlainAOTInput(idx=1)), "
    "GradAOTOutput(grad_of=PlainAOTInput(idx=2)), None, None]\n"
    "\n"
    "subgraph repeated_subgraph0():\n"
    "    %arg0_1 : f32[4, 3]  # None\n"
    "    %arg1_1 : f32[5, 3]  # None\n"
    "    %arg2_1 : f32[4, 5]  # None\n"
    "    %arg3_1 : i64[4]  # None\n"
    "    %t = t(%arg1_1)  # f32[3, 5]{1, 3}\n"
    "    %mm = mm(%arg0_1, %t)  # f32[4, 5]\n"
    "    %relu = relu(%mm)  # f32[4, 5]\n"
    "    %mul = mul.Tensor(%relu, %arg2_1)  # f32[4, 5]\n"
    "    %index_select = index_select(%mul, 0, %arg3_1)  # f32[4, 5]\n"
    "    return (%index_select,)\n"
    "\n"
    "subgraph repeated_subgraph1():\n"
    "    %arg0_1 : f32[4, 3]  # None\n"
    "    %arg1_1 : f32[5, 3]  # None\n"
    "    %arg2_1 : f32[4, 5]  # None\n"
    "    %arg3_1 : i64[4]  # None\n"
    "    %arg4_1 : f32[4, 5]  # None\n"
    "    %t = t(%arg1_1)  # f32[3, 5]{1, 3}\n"
    "    %mm = mm(%arg0_1, %t)  # f32[4, 5]\n"
    "    %relu = relu(%mm)  # f32[4, 5]\n"
    "    %mul = mul.Tensor(%relu, %arg2_1)  # f32[4, 5]\n"
    "    %index_select = index_select(%mul, 0, %arg3_1)  # f32[4, 5]\n"
    "    %new_zeros = new_zeros(%arg4_1, [4, 5])  # f32[4, 5]\n"
    "    %index_add = index_add(%new_zeros, 0, %arg3_1, %arg4_1)  # f32[4, 5]\n"
    "    %mul_1 = mul.Tensor(%index_add, %arg2_1)  # f32[4, 5]\n"
    "    %threshold_backward = threshold_backward(%mul_1, %relu, 0)  # f32[4, 5]\n"
    "    %mm_1 = mm(%threshold_backward, %arg1_1)  # f32[4, 3]\n"
    "    %t_1 = t(%threshold_backward)  # f32[5, 4]{1, 5}\n"
    "    %mm_2 = mm(%t_1, %arg0_1)  # f32[5, 3]\n"
    "    return (%mm_1, %mm_2, None, None, %index_select)\n";

#define MASKED_NIN 5

typedef struct masked {
    ag_joint *j;
    ag_tensor *in[MASKED_NIN]; /* x1, x2, w (leaves requiring grad), m, idx */
    ag_tensor *tangent, *want_out, *want[3];
} masked;

static void setup_masked(masked *m) {
    memset(m, 0, sizeof *m);
    static const bool rg[MASKED_NIN] = {true, true, true, false, false};
    char *s = joint_text_rg(MASKED_NIN, rg, masked_graph);
    m->j = ag_joint_load(s, strlen(s));
    free(s);
    if (!m->j)
        fail_msg("load: %s", ag_last_error());
    uint64_t st = 0x3a5c;
    static const int64_t x[2] = {4, 3}, w[2] = {5, 3}, y[2] = {4, 5}, four[1] = {4};
    m->in[0] = rand_leaf(2, x, &st);
    m->in[1] = rand_leaf(2, x, &st);
    m->in[2] = rand_leaf(2, w, &st);
    m->in[3] = tu_rand_tensor(AG_F32, 2, y, -1, 1, tu_xorshift, &st);
    static const double idx[4] = {2, 0, 2, 3}; /* row 2 twice, row 1 never */
    m->in[4] = tu_tensor(AG_I64, 1, four, idx);
    m->tangent = tu_rand_tensor(AG_F32, 2, y, -1, 1, tu_xorshift, &st);
    ag_scope_begin();
    ag_tensor *out = NULL;
    for (int c = 0; c < 2; c++) {
        ag_tensor *r = ag_mul(ag_relu(ag_mm(m->in[c], ag_t(m->in[2]))), m->in[3]);
        ag_tensor *yc = ag_index_select(r, 0, m->in[4]);
        out = c ? ag_add(out, yc) : yc;
    }
    m->want_out = ag_tensor_keep(out);
    ag_scope_end();
    assert_int_equal(ag_backward(m->want_out, m->tangent, false), 0);
    for (int i = 0; i < 3; i++) {
        m->want[i] = ag_detach(ag_tensor_grad(m->in[i]));
        assert_non_null(m->want[i]);
        ag_tensor_set_grad(m->in[i], NULL);
    }
}

static void teardown_masked(masked *m) {
    ag_joint_free(m->j);
    for (int i = 0; i < MASKED_NIN; i++)
        ag_tensor_free(m->in[i]);
    for (int i = 0; i < 3; i++)
        ag_tensor_free(m->want[i]);
    ag_tensor_free(m->tangent);
    ag_tensor_free(m->want_out);
}

static void test_region_with_nondifferentiable_operands(void **st) {
    (void)st;
    masked m;
    setup_masked(&m);
    const ag_graph *g = ag_joint_graph(m.j);
    assert_int_equal(ag_graph_verify(g), 0);
    /* The None outputs: a getitem of one is refused, naming it. */
    ag_graph *gc = ag_graph_copy(g);
    assert_non_null(gc);
    ag_node *bc0 = ag_graph_find(gc, "bc0");
    assert_non_null(bc0);
    assert_int_equal(ag_node_num_vals(bc0), 5);
    assert_int_equal(ag_node_val(bc0, 2)->ndim, 1);
    assert_int_equal(ag_node_val(bc0, 2)->sizes[0], 0);
    assert_null(ag_graph_getitem(gc, bc0, 2, NULL));
    tu_assert_error_contains("output 2 of %bc0 is None");
    ag_graph_free(gc);
    /* Saved and loaded back identically (the None outputs' VAL f32[0] included). */
    char *s1 = NULL, *s2 = NULL;
    size_t n1 = 0, n2 = 0;
    assert_int_equal(ag_joint_save(m.j, &s1, &n1), 0);
    assert_non_null(strstr(s1, "f32[5, 3], f32[0], f32[0], f32[4, 5])"));
    assert_non_null(strstr(s1, "return (%mm_1, %mm_2, None, None, %index_select)"));
    ag_joint *j2 = ag_joint_load(s1, n1);
    if (!j2)
        fail_msg("reload: %s", ag_last_error());
    assert_int_equal(ag_joint_save(j2, &s2, &n2), 0);
    assert_string_equal(s1, s2);
    ag_free(s1);
    ag_free(s2);
    ag_joint_free(j2);
    /* The interpreter on the joint, and on its inlined copy, equals eager. */
    ag_tensor *v[MASKED_NIN + 1], *o1[8] = {0}, *o2[8] = {0};
    for (int i = 0; i < MASKED_NIN; i++)
        v[i] = m.in[i];
    v[MASKED_NIN] = m.tangent;
    ag_graph *flat = ag_graph_inline_subgraphs(g);
    if (!flat)
        fail_msg("inline: %s", ag_last_error());
    assert_int_equal(ag_graph_verify(flat), 0);
    assert_int_equal(ag_graph_num_subgraphs(flat), 0);
    ag_scope_begin();
    assert_int_equal(ag_graph_run(g, v, MASKED_NIN + 1, o1, 8), 6);
    assert_int_equal(ag_graph_run(flat, v, MASKED_NIN + 1, o2, 8), 6);
    assert_close_rel(m.want_out, o1[0], "interpreted");
    for (int i = 0; i < 3; i++) {
        assert_close_rel(m.want[i], o1[1 + i], "interpreted grad");
        assert_true(tu_same_bits(o1[1 + i], o2[1 + i]));
    }
    assert_null(o1[4]);
    assert_null(o1[5]);
    ag_scope_end();
    ag_graph_free(flat);
    /* Partitioned: the region's backward returns None for m and idx; compiled == eager. */
    for (int part = 0; part < 2; part++)
        for (int b = 0; b < 2; b++) {
            ag_partition_opts po = {.partitioner =
                                        part ? AG_PARTITION_MINCUT : AG_PARTITION_DEFAULT,
                                    .memory_budget = b ? 0 : AG_MEMORY_BUDGET_ZERO};
            ag_graph *fw = NULL, *bw = NULL;
            if (ag_partition(g, 1, &po, &fw, &bw, NULL))
                fail_msg("partition %d budget %d: %s", part, b, ag_last_error());
            ag_graph *rbw = ag_graph_subgraph(bw, "partitioned_bw_subgraph_0_0");
            assert_non_null(rbw);
            const ag_garg *ro = ag_node_arg(ag_graph_output_node(rbw), 0);
            assert_int_equal(ro->n, 4);
            assert_non_null(ro->u.nodes[0]);
            assert_non_null(ro->u.nodes[1]);
            assert_null(ro->u.nodes[2]);
            assert_null(ro->u.nodes[3]);
            assert_int_equal(count_calls(bw, "partitioned_bw_subgraph_0_0"), 2);
            ag_graph_free(fw);
            ag_graph_free(bw);
            for (int interp = 0; interp < 2; interp++) {
                ag_compile_opts o = {.partition = po, .interpret = interp};
                ag_compiled *c = ag_compile_joint(m.j, &o);
                if (!c)
                    fail_msg("compile %d %d %d: %s", part, b, interp, ag_last_error());
                for (int round = 0; round < 2; round++) {
                    ag_tensor *out = NULL;
                    assert_int_equal(ag_compiled_call(c, m.in, MASKED_NIN, &out, 1), 1);
                    assert_close_rel(m.want_out, out, "compiled");
                    if (ag_backward(out, m.tangent, false))
                        fail_msg("backward %d %d %d: %s", part, b, interp, ag_last_error());
                    for (int i = 0; i < 3; i++) {
                        assert_close_rel(m.want[i], ag_tensor_grad(m.in[i]), "compiled grad");
                        ag_tensor_set_grad(m.in[i], NULL);
                    }
                    assert_null(ag_tensor_grad(m.in[3]));
                    ag_tensor_free(out);
                }
                ag_compiled_free(c);
            }
        }
    teardown_masked(&m);
}

/* ---- the peak-memory model ---- */

/* The sin region under the default partitioner (f32[4, 3]: 48 bytes a value), by hand. The
 * forward call returns mul (48) and passes x through as the saved value (x's storage: no
 * bytes), while its subgraph holds sin (48): 96; then sub.Scalar (48) next to mul: 96. The
 * backward starts with nothing of its own (the saved x is the input); its call returns the
 * grad (48) while its subgraph holds mul_1 and cos (96): 144. The flat joint gives the same:
 * sin and mul (96) in the forward; mul_1, cos and mul_2 (144) in the backward. Counting only
 * the call's outputs would give 96 for the backward. */
static void test_peak_counts_subgraph_intermediates(void **st) {
    (void)st;
    ag_joint *j = load_joint(1, sin_region_graph);
    ag_graph *fw = NULL, *bw = NULL;
    ag__peak pk;
    assert_int_equal(
        ag__partition_ex(ag_joint_graph(j), 1, NULL, AG__BUDGET_PEAK, &fw, &bw, NULL, &pk), 0);
    assert_int_equal(pk.fw_peak, 96);
    assert_int_equal(pk.bw_peak, 144);
    assert_int_equal(pk.peak, 144);
    ag_graph_free(fw);
    ag_graph_free(bw);
    ag_joint_free(j);
    /* Never below the flat joint's: a region's intermediates are as real as inlined ones. */
    for (int mi = 0; mi < 2; mi++) {
        model m;
        setup_model(&m, mi == 1);
        const ag_graph *g = ag_joint_graph(m.j);
        ag_graph *flat = ag_graph_inline_subgraphs(g);
        assert_non_null(flat);
        for (int part = 0; part < 2; part++) {
            ag_partition_opts po = {.partitioner =
                                        part ? AG_PARTITION_MINCUT : AG_PARTITION_DEFAULT};
            ag__peak pr, pf;
            assert_int_equal(ag__partition_ex(g, 1, &po, AG__BUDGET_PEAK, &fw, &bw, NULL, &pr), 0);
            ag_graph_free(fw);
            ag_graph_free(bw);
            assert_int_equal(ag__partition_ex(flat, 1, &po, AG__BUDGET_PEAK, &fw, &bw, NULL, &pf),
                             0);
            ag_graph_free(fw);
            ag_graph_free(bw);
            if (mi == 0 && part == 0)
                assert_int_equal(pf.peak, 144); /* the flat sin joint, by hand (above) */
            if (pr.peak < pf.peak)
                fail_msg("%s partitioner %d: region peak %lld < flat %lld", m.name, part,
                         (long long)pr.peak, (long long)pf.peak);
        }
        ag_graph_free(flat);
        teardown_model(&m);
    }
}

/* ---- operands passed through ---- */

/* A subgraph returning x * x and x itself: the planned call's readers read the operand (no
 * copy), unless a later node may mutate it (copy_ into x after the call), where the output
 * must keep x's value from before (copied). Values by hand. */
static void test_passthrough_not_copied(void **st) {
    (void)st;
    for (int mut = 0; mut < 2; mut++) {
        char text[1024];
        snprintf(text, sizeof text,
                 "graph():\n"
                 "    %%x : f32[2]  # None\n"
                 "    %%k = get_attr(k)  # subgraph\n"
                 "    %%c = invoke_subgraph(%%k, 'c', %%x)  # (f32[2], f32[2])\n"
                 "    %%g0 = getitem(%%c, 0)  # f32[2]\n"
                 "    %%g1 = getitem(%%c, 1)  # f32[2]\n"
                 "%s"
                 "    return (%%g0, %%g1)\n"
                 "\n"
                 "subgraph k():\n"
                 "    %%arg0_1 : f32[2]  # None\n"
                 "    %%mul = mul.Tensor(%%arg0_1, %%arg0_1)  # f32[2]\n"
                 "    return (%%mul, %%arg0_1)\n",
                 mut ? "    %copy_ = copy_(%x, %g0)  # f32[2]\n" : "");
        ag_graph *g = ag_graph_parse(text, strlen(text));
        if (!g)
            fail_msg("parse: %s", ag_last_error());
        ag_plan_opts chk = {.checking = true};
        ag_plan *p = ag_plan_new(g, &chk);
        if (!p)
            fail_msg("plan: %s", ag_last_error());
        static const int64_t two[1] = {2};
        static const double xv[2] = {3, -2}, sq[2] = {9, 4};
        for (int round = 0; round < 2; round++) {
            ag_tensor *x = tu_tensor(AG_F32, 1, two, xv), *o[2] = {0};
            if (round == 1)
                tu_alloc_count_begin();
            assert_int_equal(ag_plan_run(p, &x, 1, o, 2), 2);
            if (round == 1)
                assert_int_equal(tu_alloc_count_end(), 0);
            tu_assert_close(o[0], sq, 0);
            if (mut) {
                tu_assert_close(o[1], xv, 0); /* the value before copy_ */
                tu_assert_close(x, sq, 0);
            } else {
                assert_ptr_equal(o[1], x); /* x itself, as a graph returning x gives it */
            }
            ag_tensor_free(o[0]);
            ag_tensor_free(o[1]);
            ag_tensor_free(x);
        }
        ag__plan_stats s;
        ag__plan_get_stats(p, &s);
        assert_int_equal(s.subplan_runs, 2);
        assert_int_equal(s.subplan_direct_outputs, 2);
        assert_int_equal(s.subplan_passed_outputs, mut ? 0 : 2);
        assert_int_equal(s.subplan_copied_outputs, mut ? 2 : 0);
        ag_plan_free(p);
        ag_graph_free(g);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sin_region_exact),
        cmocka_unit_test(test_inline_runs_identically),
        cmocka_unit_test(test_partition_structure),
        cmocka_unit_test(test_compile_matches_eager),
        cmocka_unit_test(test_prepartitioned_pair),
        cmocka_unit_test(test_plan_once_per_subgraph),
        cmocka_unit_test(test_joint_io_roundtrip),
        cmocka_unit_test(test_malformed_pairs),
        cmocka_unit_test(test_shard_inlines),
        cmocka_unit_test(test_alloc_failures),
        cmocka_unit_test(test_region_with_nondifferentiable_operands),
        cmocka_unit_test(test_peak_counts_subgraph_intermediates),
        cmocka_unit_test(test_passthrough_not_copied),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
