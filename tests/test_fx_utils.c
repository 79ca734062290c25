/* The FX utilities (src/export/fx_utils.c) on joint graphs: upstream's tests 6-9
 * (test_fx_utils_simple_linear, _conv_bn_module, _multiple_outputs, _node_consistency) on
 * hand-built joint-shaped graphs that mirror what upstream exports for the same modules, the
 * same checks on real exports of the zoo models, the filters (non-differentiable inputs and
 * outputs skipped, duplicates overwritten in place), every error case with its message, the
 * allocation-failure sweep, and the CLI commands built on them (aotgrad export, aotgrad
 * descriptors). Expected nodes, names and counts are written out by hand. */
#include "testutil.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- building joint-shaped graphs ---- */

/* Checks a descriptor constructor's result. */
static ag_desc *D(ag_desc *d) {
    if (!d)
        fail_msg("descriptor: %s", ag_last_error());
    return d;
}

/* A placeholder carrying desc (the reference passed in is consumed). */
static ag_node *ph(ag_graph *g, const char *name, ag_desc *desc, ag_tmeta m) {
    ag_node *n = ag_graph_placeholder(g, name, &m);
    assert_non_null(n);
    if (desc) {
        assert_int_equal(ag_node_set_desc(n, desc), 0);
        ag_desc_release(desc);
    }
    return n;
}

/* A one-input call; the body of these graphs only has to give each output a node of its own. */
static ag_node *call1(ag_graph *g, const char *op, ag_node *a, const char *name) {
    ag_node *n = ag_graph_call(g, ag_op_find(op), (ag_garg[]){AG_GA_N(a)}, 1, name);
    if (!n)
        fail_msg("%s: %s", op, ag_last_error());
    return n;
}

static ag_node *call2(ag_graph *g, const char *op, ag_node *a, ag_node *b, const char *name) {
    ag_node *n = ag_graph_call(g, ag_op_find(op), (ag_garg[]){AG_GA_N(a), AG_GA_N(b)}, 2, name);
    if (!n)
        fail_msg("%s: %s", op, ag_last_error());
    return n;
}

/* The output node with its descriptors (the references passed in are consumed). */
static ag_node *output(ag_graph *g, ag_node *const *outs, ag_desc **descs, int n) {
    ag_node *o = ag_graph_output(g, outs, n);
    assert_non_null(o);
    assert_int_equal(ag_node_set_output_descs(o, descs, n), 0);
    for (int i = 0; i < n; i++)
        ag_desc_release(descs[i]);
    return o;
}

static ag_desc *param(const char *fqn) {
    return D(ag_desc_param(fqn));
}
static ag_desc *buffer(const char *fqn) {
    return D(ag_desc_buffer(fqn));
}
static ag_desc *plain_in(int i) {
    return D(ag_desc_plain_input(i));
}
static ag_desc *plain_out(int i) {
    return D(ag_desc_plain_output(i));
}

/* GradAOTOutput(grad_of=<in>), consuming in. */
static ag_desc *grad_of(ag_desc *in) {
    ag_desc *d = D(ag_desc_grad(in));
    ag_desc_release(in);
    return d;
}
static ag_desc *tangent_of(ag_desc *out) {
    ag_desc *d = D(ag_desc_tangent(out));
    ag_desc_release(out);
    return d;
}
static ag_desc *mutation_of(ag_desc *in) {
    ag_desc *d = D(ag_desc_input_mutation(in));
    ag_desc_release(in);
    return d;
}

/* The Linear(3, 2) joint of upstream's test 1:
 *   primals_1 W [2,3] Param(linear.weight), primals_2 b [2] Param(linear.bias),
 *   primals_3 x [4,3] Plain(0), tangents_1 [4,2] Tangent(Plain(0));
 *   outputs [addmm Plain(0), mm_1 Grad(W), sum_1 Grad(b), None]. */
static ag_graph *linear_joint(void) {
    ag_graph *g = ag_graph_new();
    assert_non_null(g);
    ag_node *w = ph(g, "primals_1", param("linear.weight"), TM(AG_F32, 2, 3));
    ag_node *b = ph(g, "primals_2", param("linear.bias"), TM(AG_F32, 2));
    ag_node *x = ph(g, "primals_3", plain_in(0), TM(AG_F32, 4, 3));
    ag_node *tg = ph(g, "tangents_1", tangent_of(plain_out(0)), TM(AG_F32, 4, 2));
    ag_node *t = call1(g, "t", w, "t");
    ag_node *fw = ag_graph_call(g, ag_op_find("addmm"),
                                (ag_garg[]){AG_GA_N(b), AG_GA_N(x), AG_GA_N(t)}, 3, "addmm");
    assert_non_null(fw);
    ag_node *t1 = call1(g, "t", tg, "t_1");
    ag_node *gw = call2(g, "mm", t1, x, "mm");
    int64_t dim0[] = {0};
    ag_node *gb = ag_graph_call(g, ag_op_find("sum.dim_IntList"),
                                (ag_garg[]){AG_GA_N(tg), AG_GA_INTS(dim0, 1)}, 2, "sum_1");
    assert_non_null(gb);
    output(g, (ag_node *[]){fw, gw, gb, NULL},
           (ag_desc *[]){plain_out(0), grad_of(param("linear.weight")),
                         grad_of(param("linear.bias")), NULL},
           4);
    assert_int_equal(ag_graph_verify(g), 0);
    return g;
}

/* The ConvBN joint of upstream's test 2 (train mode): 4 params, 3 buffers, x, one tangent;
 * outputs: 3 InputMutation (running_mean, running_var, num_batches_tracked), Plain(0), 4 grads,
 * then None for the 3 buffers and x. The body is a stand-in (neg of each input). */
static const char *const convbn_params[] = {"conv.weight", "conv.bias", "bn.weight", "bn.bias"};
static const char *const convbn_buffers[] = {"bn.running_mean", "bn.running_var",
                                             "bn.num_batches_tracked"};

static ag_graph *convbn_joint(void) {
    ag_graph *g = ag_graph_new();
    assert_non_null(g);
    ag_node *p[4], *bf[3];
    p[0] = ph(g, "primals_1", param("conv.weight"), TM(AG_F32, 3, 1, 3, 3));
    p[1] = ph(g, "primals_2", param("conv.bias"), TM(AG_F32, 3));
    p[2] = ph(g, "primals_3", param("bn.weight"), TM(AG_F32, 3));
    p[3] = ph(g, "primals_4", param("bn.bias"), TM(AG_F32, 3));
    bf[0] = ph(g, "primals_5", buffer("bn.running_mean"), TM(AG_F32, 3));
    bf[1] = ph(g, "primals_6", buffer("bn.running_var"), TM(AG_F32, 3));
    bf[2] = ph(g, "primals_7", buffer("bn.num_batches_tracked"), TM0(AG_I64));
    ag_node *x = ph(g, "primals_8", plain_in(0), TM(AG_F32, 2, 1, 4, 4));
    ph(g, "tangents_1", tangent_of(plain_out(0)), TM(AG_F32, 2, 3, 4, 4));
    ag_node *outs[12];
    ag_desc *descs[12];
    for (int i = 0; i < 3; i++) {
        char name[16];
        snprintf(name, sizeof name, "add_%d", i + 1);
        outs[i] = call1(g, "neg", bf[i], name);
        descs[i] = mutation_of(buffer(convbn_buffers[i]));
    }
    outs[3] = call1(g, "relu", x, "where");
    descs[3] = plain_out(0);
    for (int i = 0; i < 4; i++) {
        char name[16];
        snprintf(name, sizeof name, "getitem_%d", i + 1);
        outs[4 + i] = call1(g, "neg", p[i], name);
        descs[4 + i] = grad_of(param(convbn_params[i]));
    }
    for (int i = 8; i < 12; i++) {
        outs[i] = NULL;
        descs[i] = NULL;
    }
    output(g, outs, descs, 12);
    assert_int_equal(ag_graph_verify(g), 0);
    return g;
}

/* The multiple-outputs joint of upstream's test 4: linear1 = Linear(3, 2), linear2 =
 * Linear(3, 4); outputs [add Plain(0), add_1 Plain(1), grads of linear1 W, b, linear2 W, b,
 * None]. The tangents come in output order; the grads are given in upstream's order. */
static const char *const multi_params[] = {"linear1.weight", "linear1.bias", "linear2.weight",
                                           "linear2.bias"};

static ag_graph *multi_joint(void) {
    ag_graph *g = ag_graph_new();
    assert_non_null(g);
    ag_node *p[4];
    p[0] = ph(g, "primals_1", param("linear1.weight"), TM(AG_F32, 2, 3));
    p[1] = ph(g, "primals_2", param("linear1.bias"), TM(AG_F32, 2));
    p[2] = ph(g, "primals_3", param("linear2.weight"), TM(AG_F32, 4, 3));
    p[3] = ph(g, "primals_4", param("linear2.bias"), TM(AG_F32, 4));
    ag_node *x = ph(g, "primals_5", plain_in(0), TM(AG_F32, 4, 3));
    ph(g, "tangents_1", tangent_of(plain_out(0)), TM(AG_F32, 4, 2));
    ph(g, "tangents_2", tangent_of(plain_out(1)), TM(AG_F32, 4, 4));
    ag_node *o1 = call1(g, "neg", x, "add");
    ag_node *o2 = call1(g, "relu", x, "add_1");
    ag_node *gw1 = call1(g, "neg", p[0], "transpose_7");
    ag_node *gb1 = call1(g, "neg", p[1], "as_strided_1");
    ag_node *gw2 = call1(g, "neg", p[2], "transpose_4");
    ag_node *gb2 = call1(g, "neg", p[3], "as_strided");
    output(g, (ag_node *[]){o1, o2, gw1, gb1, gw2, gb2, NULL},
           (ag_desc *[]){plain_out(0), plain_out(1), grad_of(param("linear1.weight")),
                         grad_of(param("linear1.bias")), grad_of(param("linear2.weight")),
                         grad_of(param("linear2.bias")), NULL},
           7);
    assert_int_equal(ag_graph_verify(g), 0);
    return g;
}

/* ---- checks shared by the hand-built graphs and the real exports ---- */

static const char *rep(const ag_desc *d) {
    static char buf[256];
    ag_desc_repr(d, buf, sizeof buf);
    return buf;
}

static ag_fx_pairs *must(ag_fx_pairs *p) {
    if (!p)
        fail_msg("fx utility failed: %s", ag_last_error());
    return p;
}

static ag_fx_named *must_named(ag_fx_named *n) {
    if (!n)
        fail_msg("fx utility failed: %s", ag_last_error());
    return n;
}

static int count_kind(const ag_fx_pairs *p, ag_desc_kind k) {
    int c = 0;
    for (int i = 0; i < ag_fx_pairs_count(p); i++)
        c += ag_desc_kind_of(ag_fx_pairs_desc(p, i)) == k;
    return c;
}

/* Upstream's test 9: get_param_nodes has the named params' nodes in the same order; every
 * param pair's node is named[desc.target]; all_input_and_grad's Param entries match. */
static void check_node_consistency(const ag_graph *g) {
    ag_fx_named *named = must_named(ag_fx_named_param_nodes(g));
    int n = ag_fx_named_count(named);
    ag_node *nodes[64];
    assert_int_equal(ag_fx_param_nodes(g, nodes, 64), n);
    for (int i = 0; i < n; i++)
        assert_ptr_equal(nodes[i], ag_fx_named_node(named, i));
    ag_fx_pairs *pg = must(ag_fx_param_and_grad_nodes(g));
    assert_int_equal(ag_fx_pairs_count(pg), n);
    for (int i = 0; i < n; i++) {
        const ag_desc *d = ag_fx_pairs_desc(pg, i);
        assert_int_equal(ag_desc_kind_of(d), AG_DESC_PARAM);
        assert_ptr_equal(ag_fx_pairs_first(pg, i), ag_fx_named_get(named, ag_desc_target(d)));
        assert_ptr_equal(ag_node_desc(ag_fx_pairs_first(pg, i)), d);
    }
    ag_fx_pairs *all = must(ag_fx_all_input_and_grad_nodes(g));
    int params = 0;
    for (int i = 0; i < ag_fx_pairs_count(all); i++) {
        const ag_desc *d = ag_fx_pairs_desc(all, i);
        if (ag_desc_kind_of(d) != AG_DESC_PARAM)
            continue;
        params++;
        assert_ptr_equal(ag_fx_pairs_first(all, i), ag_fx_named_get(named, ag_desc_target(d)));
        int j = ag_fx_pairs_find(pg, d);
        assert_true(j >= 0);
        assert_ptr_equal(ag_fx_pairs_second(all, i), ag_fx_pairs_second(pg, j));
    }
    assert_int_equal(params, n);
    ag_fx_pairs_free(all);
    ag_fx_pairs_free(pg);
    ag_fx_named_free(named);
}

/* Upstream's test 6 on a Linear joint (hand-built or exported). */
static void check_linear(const ag_graph *g) {
    ag_fx_named *named = must_named(ag_fx_named_param_nodes(g));
    assert_int_equal(ag_fx_named_count(named), 2);
    assert_string_equal(ag_fx_named_name(named, 0), "linear.weight");
    assert_string_equal(ag_fx_named_name(named, 1), "linear.bias");
    assert_non_null(ag_fx_named_get(named, "linear.weight"));
    assert_non_null(ag_fx_named_get(named, "linear.bias"));
    assert_null(ag_fx_named_get(named, "linear"));
    assert_int_equal(ag_fx_param_nodes(g, NULL, 0), 2);
    ag_fx_named *bufs = must_named(ag_fx_named_buffer_nodes(g));
    assert_int_equal(ag_fx_named_count(bufs), 0);
    assert_int_equal(ag_fx_buffer_nodes(g, NULL, 0), 0);

    ag_fx_pairs *all = must(ag_fx_all_input_and_grad_nodes(g));
    assert_int_equal(ag_fx_pairs_count(all), 4);
    /* graph order: W, b, x, the tangent */
    const char *want[] = {"ParamAOTInput(target='linear.weight')",
                          "ParamAOTInput(target='linear.bias')", "PlainAOTInput(idx=0)",
                          "TangentAOTInput(output=PlainAOTOutput(idx=0))"};
    for (int i = 0; i < 4; i++)
        assert_string_equal(rep(ag_fx_pairs_desc(all, i)), want[i]);
    assert_null(ag_fx_pairs_second(all, 2)); /* x needs no grad */
    assert_null(ag_fx_pairs_second(all, 3)); /* nothing differentiates a tangent here */

    ag_fx_pairs *pg = must(ag_fx_param_and_grad_nodes(g));
    assert_int_equal(ag_fx_pairs_count(pg), 2);
    ag_node *out = ag_graph_output_node(g);
    const ag_garg *outs = ag_node_arg(out, 0);
    for (int i = 0; i < 2; i++) {
        assert_ptr_equal(ag_fx_pairs_first(pg, i), ag_fx_named_node(named, i));
        assert_non_null(ag_fx_pairs_second(pg, i));
        /* the grad is the output described as GradAOTOutput of that param */
        ag_desc *gd = grad_of(param(ag_fx_named_name(named, i)));
        bool found = false;
        for (int k = 0; k < outs->n; k++)
            if (ag_desc_equal(ag_node_output_desc(out, k), gd)) {
                assert_ptr_equal(ag_fx_pairs_second(pg, i), outs->u.nodes[k]);
                found = true;
            }
        assert_true(found);
        ag_desc_release(gd);
    }
    ag_fx_pairs *pin = must(ag_fx_plain_input_and_grad_nodes(g));
    assert_int_equal(ag_fx_pairs_count(pin), 1);
    assert_string_equal(rep(ag_fx_pairs_desc(pin, 0)), "PlainAOTInput(idx=0)");
    assert_null(ag_fx_pairs_second(pin, 0));

    ag_fx_pairs *ot = must(ag_fx_all_output_and_tangent_nodes(g));
    assert_int_equal(ag_fx_pairs_count(ot), 3); /* the plain output and the two grads */
    assert_string_equal(rep(ag_fx_pairs_desc(ot, 0)), "PlainAOTOutput(idx=0)");
    assert_int_equal(count_kind(ot, AG_DESC_GRAD), 2);
    ag_fx_pairs *po = must(ag_fx_plain_output_and_tangent_nodes(g));
    assert_int_equal(ag_fx_pairs_count(po), 1);
    ag_node *tg = ag_fx_pairs_second(po, 0);
    assert_non_null(tg);
    assert_int_equal(ag_node_kind_of(tg), AG_NODE_PLACEHOLDER);
    assert_string_equal(ag_node_name(tg), "tangents_1");
    assert_ptr_equal(ag_fx_pairs_first(po, 0), outs->u.nodes[0]);
    /* a grad output has no tangent */
    assert_null(ag_fx_pairs_second(ot, 1));
    assert_null(ag_fx_pairs_second(ot, 2));

    ag_fx_pairs_free(po);
    ag_fx_pairs_free(ot);
    ag_fx_pairs_free(pin);
    ag_fx_pairs_free(pg);
    ag_fx_pairs_free(all);
    ag_fx_named_free(bufs);
    ag_fx_named_free(named);
    check_node_consistency(g);
}

/* Upstream's test 7 on a ConvBN joint. */
static void check_convbn(const ag_graph *g) {
    ag_fx_named *named = must_named(ag_fx_named_param_nodes(g));
    assert_int_equal(ag_fx_named_count(named), 4);
    for (int i = 0; i < 4; i++) {
        assert_string_equal(ag_fx_named_name(named, i), convbn_params[i]);
        assert_non_null(ag_fx_named_get(named, convbn_params[i]));
    }
    ag_fx_named *bufs = must_named(ag_fx_named_buffer_nodes(g));
    assert_int_equal(ag_fx_named_count(bufs), 3);
    for (int i = 0; i < 3; i++)
        assert_string_equal(ag_fx_named_name(bufs, i), convbn_buffers[i]);
    ag_node *bn[8];
    assert_int_equal(ag_fx_buffer_nodes(g, bn, 8), 3);
    for (int i = 0; i < 3; i++)
        assert_ptr_equal(bn[i], ag_fx_named_node(bufs, i));

    ag_fx_pairs *all = must(ag_fx_all_input_and_grad_nodes(g));
    assert_int_equal(ag_fx_pairs_count(all), 9); /* 4 params + 3 buffers + x + tangent */
    assert_int_equal(count_kind(all, AG_DESC_PARAM), 4);
    assert_int_equal(count_kind(all, AG_DESC_BUFFER), 3);
    assert_int_equal(count_kind(all, AG_DESC_PLAIN_INPUT), 1);
    assert_int_equal(count_kind(all, AG_DESC_TANGENT), 1);
    for (int i = 0; i < ag_fx_pairs_count(all); i++) {
        const ag_desc *d = ag_fx_pairs_desc(all, i);
        assert_non_null(ag_fx_pairs_first(all, i));
        if (ag_desc_kind_of(d) == AG_DESC_BUFFER) {
            assert_ptr_equal(ag_fx_pairs_first(all, i), ag_fx_named_get(bufs, ag_desc_target(d)));
            assert_null(ag_fx_pairs_second(all, i)); /* buffers get no grad */
        }
        if (ag_desc_kind_of(d) == AG_DESC_PARAM)
            assert_non_null(ag_fx_pairs_second(all, i));
    }

    /* outputs: 3 input mutations, the plain output, 4 grads (the Nones drop out) */
    ag_fx_pairs *ot = must(ag_fx_all_output_and_tangent_nodes(g));
    assert_int_equal(ag_fx_pairs_count(ot), 8);
    for (int i = 0; i < 3; i++) {
        char want[128];
        snprintf(want, sizeof want,
                 "InputMutationAOTOutput(mutated_input=BufferAOTInput(target='%s'))",
                 convbn_buffers[i]);
        assert_string_equal(rep(ag_fx_pairs_desc(ot, i)), want);
        assert_null(ag_fx_pairs_second(ot, i)); /* buffers do not require grad: no tangent */
    }
    assert_string_equal(rep(ag_fx_pairs_desc(ot, 3)), "PlainAOTOutput(idx=0)");
    assert_non_null(ag_fx_pairs_second(ot, 3));
    assert_int_equal(count_kind(ot, AG_DESC_GRAD), 4);

    ag_fx_pairs_free(ot);
    ag_fx_pairs_free(all);
    ag_fx_named_free(bufs);
    ag_fx_named_free(named);
    check_node_consistency(g);
}

/* Upstream's test 8 on the two-Linear joint. */
static void check_multi(const ag_graph *g) {
    ag_fx_pairs *ot = must(ag_fx_all_output_and_tangent_nodes(g));
    assert_int_equal(ag_fx_pairs_count(ot), 6);
    ag_fx_pairs *po = must(ag_fx_plain_output_and_tangent_nodes(g));
    assert_int_equal(ag_fx_pairs_count(po), 2);
    for (int i = 0; i < 2; i++) {
        const ag_desc *d = ag_fx_pairs_desc(po, i);
        assert_int_equal(ag_desc_kind_of(d), AG_DESC_PLAIN_OUTPUT);
        assert_int_equal(ag_desc_idx(d), i);
        ag_node *tg = ag_fx_pairs_second(po, i);
        assert_non_null(tg);
        /* each output is paired with the tangent that describes it, not by position */
        const ag_desc *td = ag_node_desc(tg);
        assert_int_equal(ag_desc_kind_of(td), AG_DESC_TANGENT);
        assert_true(ag_desc_equal(ag_desc_nested(td), d));
        /* the tangent has the output's shape ([4, 2] then [4, 4]) */
        assert_int_equal(ag_node_val(tg, 0)->sizes[1], i == 0 ? 2 : 4);
    }
    ag_fx_pairs *pg = must(ag_fx_param_and_grad_nodes(g));
    assert_int_equal(ag_fx_pairs_count(pg), 4);
    for (int i = 0; i < 4; i++) {
        assert_string_equal(ag_desc_target(ag_fx_pairs_desc(pg, i)), multi_params[i]);
        ag_node *gr = ag_fx_pairs_second(pg, i);
        assert_non_null(gr);
        /* the grad has its param's shape */
        const ag_tmeta *pm = ag_node_val(ag_fx_pairs_first(pg, i), 0), *gm = ag_node_val(gr, 0);
        assert_int_equal(pm->ndim, gm->ndim);
        assert_memory_equal(pm->sizes, gm->sizes, sizeof(int64_t) * (size_t)pm->ndim);
    }
    ag_fx_pairs_free(pg);
    ag_fx_pairs_free(po);
    ag_fx_pairs_free(ot);
    check_node_consistency(g);
}

/* ---- hand-built graphs ---- */

static void test_linear(void **st) {
    (void)st;
    ag_graph *g = linear_joint();
    check_linear(g);
    /* the exact pairs of the hand-built graph */
    ag_fx_pairs *pg = must(ag_fx_param_and_grad_nodes(g));
    assert_string_equal(ag_node_name(ag_fx_pairs_first(pg, 0)), "primals_1");
    assert_string_equal(ag_node_name(ag_fx_pairs_second(pg, 0)), "mm");
    assert_string_equal(ag_node_name(ag_fx_pairs_first(pg, 1)), "primals_2");
    assert_string_equal(ag_node_name(ag_fx_pairs_second(pg, 1)), "sum_1");
    /* lookups by a structurally equal descriptor built elsewhere */
    ag_desc *b = param("linear.bias"), *w = param("linear.weight"), *z = param("linear.zzz");
    assert_int_equal(ag_fx_pairs_find(pg, b), 1);
    assert_int_equal(ag_fx_pairs_find(pg, w), 0);
    assert_int_equal(ag_fx_pairs_find(pg, z), -1);
    assert_int_equal(ag_fx_pairs_find(pg, NULL), -1);
    assert_null(ag_fx_pairs_desc(pg, 2));
    assert_null(ag_fx_pairs_first(pg, 2));
    assert_null(ag_fx_pairs_second(pg, -1));
    ag_desc_release(b);
    ag_desc_release(w);
    ag_desc_release(z);
    ag_fx_pairs_free(pg);
    ag_fx_pairs *ot = must(ag_fx_all_output_and_tangent_nodes(g));
    assert_string_equal(ag_node_name(ag_fx_pairs_first(ot, 0)), "addmm");
    assert_string_equal(ag_node_name(ag_fx_pairs_first(ot, 1)), "mm");
    assert_string_equal(ag_node_name(ag_fx_pairs_first(ot, 2)), "sum_1");
    ag_fx_pairs_free(ot);
    ag_graph_free(g);
}

static void test_convbn(void **st) {
    (void)st;
    ag_graph *g = convbn_joint();
    check_convbn(g);
    ag_graph_free(g);
}

static void test_multiple_outputs(void **st) {
    (void)st;
    ag_graph *g = multi_joint();
    check_multi(g);
    ag_fx_pairs *pg = must(ag_fx_param_and_grad_nodes(g));
    const char *grads[] = {"transpose_7", "as_strided_1", "transpose_4", "as_strided"};
    for (int i = 0; i < 4; i++)
        assert_string_equal(ag_node_name(ag_fx_pairs_second(pg, i)), grads[i]);
    ag_fx_pairs_free(pg);
    ag_graph_free(g);
}

static void test_node_consistency(void **st) {
    (void)st;
    ag_graph *gs[] = {linear_joint(), convbn_joint(), multi_joint()};
    for (int i = 0; i < 3; i++) {
        check_node_consistency(gs[i]);
        ag_graph_free(gs[i]);
    }
}

/* Non-differentiable inputs (tokens, philox, dummy, subclass sizes) are skipped; view and
 * synthetic bases are kept; non-differentiable outputs (tokens, dummies, saved values) are not
 * paired; a grad of a tangent is recorded like any other. */
static void test_filters(void **st) {
    (void)st;
    ag_graph *g = ag_graph_new();
    ag_node *w = ph(g, "primals_1", param("w"), TM(AG_F32, 3));
    ph(g, "primals_2", D(ag_desc_forward_token_input(0)), TM0(AG_F32));
    ph(g, "primals_3", D(ag_desc_philox_forward_seed()), TM0(AG_I64));
    ph(g, "primals_4", D(ag_desc_dummy_input(0)), TM0(AG_F32));
    ag_desc *p0 = plain_in(0);
    ph(g, "primals_5", D(ag_desc_subclass_size_input(p0, 0)), TM0(AG_I64));
    ag_node *vb = ph(g, "primals_6", D(ag_desc_view_base(p0)), TM(AG_F32, 3));
    ag_desc_release(p0);
    ag_node *tg = ph(g, "tangents_1", tangent_of(plain_out(0)), TM(AG_F32, 3));
    ph(g, "tangents_token", D(ag_desc_backward_token_input(0)), TM0(AG_F32));
    ag_node *o = call1(g, "neg", w, "neg");
    ag_node *gw = call1(g, "neg", o, "neg_1");
    ag_node *gv = call1(g, "relu", vb, "relu");
    ag_node *gt = call1(g, "relu", tg, "relu_1");
    ag_desc *pi = plain_in(0), *vbd = D(ag_desc_view_base(pi));
    ag_desc_release(pi);
    output(g, (ag_node *[]){o, gw, gv, gt, o, o},
           (ag_desc *[]){plain_out(0), grad_of(param("w")), grad_of(vbd),
                         grad_of(tangent_of(plain_out(0))), D(ag_desc_forward_token_output(0)),
                         D(ag_desc_dummy_output(0))},
           6);
    ag_fx_pairs *all = must(ag_fx_all_input_and_grad_nodes(g));
    assert_int_equal(ag_fx_pairs_count(all), 3);
    assert_string_equal(rep(ag_fx_pairs_desc(all, 0)), "ParamAOTInput(target='w')");
    assert_string_equal(rep(ag_fx_pairs_desc(all, 1)),
                        "ViewBaseAOTInput(base_of=PlainAOTInput(idx=0))");
    assert_string_equal(rep(ag_fx_pairs_desc(all, 2)),
                        "TangentAOTInput(output=PlainAOTOutput(idx=0))");
    assert_ptr_equal(ag_fx_pairs_second(all, 0), gw);
    assert_ptr_equal(ag_fx_pairs_second(all, 1), gv);
    assert_ptr_equal(ag_fx_pairs_second(all, 2), gt);
    ag_fx_pairs *ot = must(ag_fx_all_output_and_tangent_nodes(g));
    assert_int_equal(ag_fx_pairs_count(ot), 4); /* Plain + 3 grads; token and dummy dropped */
    assert_ptr_equal(ag_fx_pairs_second(ot, 0), tg);
    ag_fx_pairs *pin = must(ag_fx_plain_input_and_grad_nodes(g));
    assert_int_equal(ag_fx_pairs_count(pin), 0); /* the plain input only appears as a base */
    ag_fx_pairs_free(pin);
    ag_fx_pairs_free(ot);
    ag_fx_pairs_free(all);
    ag_graph_free(g);
}

/* The same FQN twice: the later placeholder wins and keeps the first one's position, as
 * assigning to a Python dict does. */
static void test_duplicate_fqn(void **st) {
    (void)st;
    ag_graph *g = ag_graph_new();
    ph(g, "primals_1", param("a"), TM(AG_F32, 2));
    ag_node *b = ph(g, "primals_2", param("b"), TM(AG_F32, 2));
    ag_node *a2 = ph(g, "primals_3", param("a"), TM(AG_F32, 2));
    ag_node *b1 = ph(g, "primals_4", buffer("b"), TM(AG_F32, 2)); /* a buffer: another map */
    output(g, (ag_node *[]){a2}, (ag_desc *[]){plain_out(0)}, 1);
    ag_fx_named *n = must_named(ag_fx_named_param_nodes(g));
    assert_int_equal(ag_fx_named_count(n), 2);
    assert_string_equal(ag_fx_named_name(n, 0), "a");
    assert_ptr_equal(ag_fx_named_node(n, 0), a2);
    assert_string_equal(ag_fx_named_name(n, 1), "b");
    assert_ptr_equal(ag_fx_named_node(n, 1), b);
    assert_null(ag_fx_named_name(n, 2));
    assert_null(ag_fx_named_node(n, -1));
    ag_fx_named_free(n);
    ag_node *nodes[1] = {NULL};
    assert_int_equal(ag_fx_param_nodes(g, nodes, 1), 2); /* the count, one stored */
    assert_ptr_equal(nodes[0], a2);
    n = must_named(ag_fx_named_buffer_nodes(g));
    assert_int_equal(ag_fx_named_count(n), 1);
    assert_ptr_equal(ag_fx_named_get(n, "b"), b1);
    ag_fx_named_free(n);
    ag_fx_pairs *all = must(ag_fx_all_input_and_grad_nodes(g));
    assert_int_equal(ag_fx_pairs_count(all), 3);
    assert_ptr_equal(ag_fx_pairs_first(all, 0), a2);
    ag_fx_pairs_free(all);
    ag_graph_free(g);
}

/* ---- errors ---- */

/* Every utility fails on g with AG status `code` and a message containing `needle`. */
static void assert_all_fail(const ag_graph *g, bool inputs, bool outputs, bool named, int code,
                            const char *needle) {
    if (inputs) {
        assert_null(ag_fx_all_input_and_grad_nodes(g));
        assert_int_equal(ag_last_status(), code);
        tu_assert_error_contains("ag_fx_all_input_and_grad_nodes: ");
        tu_assert_error_contains(needle);
        assert_null(ag_fx_param_and_grad_nodes(g));
        tu_assert_error_contains("ag_fx_param_and_grad_nodes: ");
        tu_assert_error_contains(needle);
        assert_null(ag_fx_plain_input_and_grad_nodes(g));
        tu_assert_error_contains(needle);
    }
    if (outputs) {
        assert_null(ag_fx_all_output_and_tangent_nodes(g));
        assert_int_equal(ag_last_status(), code);
        tu_assert_error_contains("ag_fx_all_output_and_tangent_nodes: ");
        tu_assert_error_contains(needle);
        assert_null(ag_fx_plain_output_and_tangent_nodes(g));
        tu_assert_error_contains(needle);
    }
    if (named) {
        assert_null(ag_fx_named_param_nodes(g));
        assert_int_equal(ag_last_status(), code);
        tu_assert_error_contains(needle);
        assert_null(ag_fx_named_buffer_nodes(g));
        tu_assert_error_contains(needle);
        assert_int_equal(ag_fx_param_nodes(g, NULL, 0), code);
        assert_int_equal(ag_fx_buffer_nodes(g, NULL, 0), code);
    }
}

static void test_error_subclass_input(void **st) {
    (void)st;
    ag_graph *g = ag_graph_new();
    ag_desc *w = param("w");
    ph(g, "primals_1", D(ag_desc_subclass_getattr_input(w, "a")), TM(AG_F32, 2));
    ag_desc_release(w);
    ag_node *x = ph(g, "primals_2", plain_in(0), TM(AG_F32, 2));
    output(g, (ag_node *[]){x}, (ag_desc *[]){plain_out(0)}, 1);
    /* upstream's messages */
    assert_all_fail(g, true, true, true, AG_ENOTSUP,
                    "Subclasses are currently not supported by this function, but a desugared "
                    "subclass input was found at primals_1 (SubclassGetAttrAOTInput(base="
                    "ParamAOTInput(target='w'), attr='a')).  The problem is that there may not "
                    "necessarily be a 1-1 correspondence between ");
    assert_all_fail(g, true, true, false, AG_ENOTSUP,
                    "a 1-1 correspondence between primals/tangents/outputs/grads when subclasses "
                    "are involved");
    assert_all_fail(g, false, false, true, AG_ENOTSUP,
                    "a 1-1 correspondence between a FQN and a plain tensor when subclasses are "
                    "involved");
    assert_all_fail(g, true, true, true, AG_ENOTSUP, "please file an issue");
    ag_graph_free(g);
}

static void test_error_subclass_output(void **st) {
    (void)st;
    ag_graph *g = ag_graph_new();
    ag_node *w = ph(g, "primals_1", param("w"), TM(AG_F32, 2));
    ag_node *o = call1(g, "neg", w, "neg");
    ag_desc *gd = grad_of(param("w"));
    output(g, (ag_node *[]){o, o},
           (ag_desc *[]){plain_out(0), D(ag_desc_subclass_getattr_output(gd, "b"))}, 2);
    ag_desc_release(gd);
    assert_all_fail(g, true, true, false, AG_ENOTSUP,
                    "a desugared subclass input was found at neg (SubclassGetAttrAOTOutput("
                    "base=GradAOTOutput(grad_of=ParamAOTInput(target='w')), attr='b'))");
    assert_all_fail(g, true, true, false, AG_ENOTSUP, "please file an issue");
    /* the named utilities do not look at outputs */
    ag_fx_named *n = must_named(ag_fx_named_param_nodes(g));
    assert_int_equal(ag_fx_named_count(n), 1);
    ag_fx_named_free(n);
    ag_graph_free(g);
}

static void test_error_missing_desc(void **st) {
    (void)st;
    ag_graph *g = ag_graph_new();
    ag_node *w = ph(g, "primals_1", param("w"), TM(AG_F32, 2));
    ph(g, "primals_2", NULL, TM(AG_F32, 2));
    output(g, (ag_node *[]){w}, (ag_desc *[]){plain_out(0)}, 1);
    assert_all_fail(g, true, true, true, AG_EINVAL, "placeholder primals_2 has no descriptor");
    ag_graph_free(g);

    /* an output node without descriptors */
    g = ag_graph_new();
    w = ph(g, "primals_1", param("w"), TM(AG_F32, 2));
    assert_non_null(ag_graph_output(g, (ag_node *[]){w}, 1));
    assert_all_fail(g, true, true, false, AG_EINVAL, "the output node output has no descriptors");
    ag_fx_named *n = must_named(ag_fx_named_param_nodes(g));
    assert_int_equal(ag_fx_named_count(n), 1);
    ag_fx_named_free(n);
    ag_graph_free(g);

    assert_all_fail(NULL, true, true, true, AG_EINVAL, "g is NULL");
}

static void test_error_grad_of_unknown_input(void **st) {
    (void)st;
    ag_graph *g = ag_graph_new();
    ag_node *w = ph(g, "primals_1", param("w"), TM(AG_F32, 2));
    ag_node *o = call1(g, "neg", w, "neg");
    output(g, (ag_node *[]){o, o}, (ag_desc *[]){plain_out(0), grad_of(param("v"))}, 2);
    assert_all_fail(g, true, false, false, AG_EINVAL,
                    "output 1 (neg) is GradAOTOutput(grad_of=ParamAOTInput(target='v')), but no "
                    "differentiable placeholder has the descriptor ParamAOTInput(target='v')");
    /* the output side does not look grads up */
    ag_fx_pairs *ot = must(ag_fx_all_output_and_tangent_nodes(g));
    assert_int_equal(ag_fx_pairs_count(ot), 2);
    ag_fx_pairs_free(ot);
    ag_graph_free(g);
}

static void test_error_duplicate_grad(void **st) {
    (void)st;
    ag_graph *g = ag_graph_new();
    ag_node *w = ph(g, "primals_1", param("w"), TM(AG_F32, 2));
    ag_node *a = call1(g, "neg", w, "neg");
    ag_node *b = call1(g, "relu", w, "relu");
    output(g, (ag_node *[]){a, b}, (ag_desc *[]){grad_of(param("w")), grad_of(param("w"))}, 2);
    assert_all_fail(g, true, false, false, AG_EINVAL,
                    "ParamAOTInput(target='w') has two gradients: neg and output 1 (relu)");
    ag_graph_free(g);
}

static void test_error_tangents(void **st) {
    (void)st;
    /* a tangent of an output the graph does not have */
    ag_graph *g = ag_graph_new();
    ag_node *x = ph(g, "primals_1", plain_in(0), TM(AG_F32, 2));
    ph(g, "tangents_1", tangent_of(plain_out(1)), TM(AG_F32, 2));
    output(g, (ag_node *[]){x}, (ag_desc *[]){plain_out(0)}, 1);
    assert_all_fail(g, false, true, false, AG_EINVAL,
                    "placeholder tangents_1 is the tangent of PlainAOTOutput(idx=1), but no output "
                    "has that descriptor");
    ag_graph_free(g);

    /* two tangents for one output */
    g = ag_graph_new();
    x = ph(g, "primals_1", plain_in(0), TM(AG_F32, 2));
    ph(g, "tangents_1", tangent_of(plain_out(0)), TM(AG_F32, 2));
    ph(g, "tangents_2", tangent_of(plain_out(0)), TM(AG_F32, 2));
    output(g, (ag_node *[]){x}, (ag_desc *[]){plain_out(0)}, 1);
    assert_all_fail(g, false, true, false, AG_EINVAL,
                    "PlainAOTOutput(idx=0) has two tangents: placeholders tangents_1 and "
                    "tangents_2");
    /* the input side does not pair tangents */
    ag_fx_pairs *all = must(ag_fx_all_input_and_grad_nodes(g));
    assert_int_equal(ag_fx_pairs_count(all), 2); /* x and one tangent key (equal descs) */
    ag_fx_pairs_free(all);
    ag_graph_free(g);
}

/* The output list edited after the descriptors were set: pairing by position would be wrong. */
static void test_error_output_desc_mismatch(void **st) {
    (void)st;
    ag_graph *g = linear_joint();
    ag_node *out = ag_graph_output_node(g);
    const ag_garg *a = ag_node_arg(out, 0);
    ag_node *three[3] = {a->u.nodes[0], a->u.nodes[1], a->u.nodes[2]};
    assert_int_equal(ag_node_set_arg(out, 0, AG_GA_NODES(three, 3)), 0);
    assert_all_fail(g, true, true, false, AG_EINVAL,
                    "the output node output has 3 outputs but 4 descriptors");
    ag_graph_free(g);
}

static void test_param_nodes_args(void **st) {
    (void)st;
    ag_graph *g = linear_joint();
    assert_int_equal(ag_fx_param_nodes(g, NULL, 2), AG_EINVAL);
    ag_node *n[2];
    assert_int_equal(ag_fx_param_nodes(g, n, -1), AG_EINVAL);
    assert_int_equal(ag_fx_param_nodes(g, n, 2), 2);
    assert_string_equal(ag_node_name(n[0]), "primals_1");
    assert_string_equal(ag_node_name(n[1]), "primals_2");
    ag_fx_pairs_free(NULL);
    ag_fx_named_free(NULL);
    assert_int_equal(ag_fx_pairs_count(NULL), 0);
    assert_int_equal(ag_fx_named_count(NULL), 0);
    assert_null(ag_fx_named_get(NULL, "x"));
    ag_graph_free(g);
}

/* ---- real exports of the zoo models ---- */

static ag_joint *export_zoo(const char *name) {
    ag_module *m = NULL;
    ag_tensor *in[4] = {0};
    int nin = 0;
    if (ag_zoo_build(name, NULL, &m, in, 4, &nin))
        fail_msg("zoo %s: %s", name, ag_last_error());
    ag_joint *j = ag_export_joint(m, in, nin, NULL, NULL, 0, NULL);
    if (!j)
        fail_msg("export %s: %s", name, ag_last_error());
    for (int i = 0; i < nin; i++)
        ag_tensor_free(in[i]);
    ag_module_free(m);
    return j;
}

static void test_export_linear(void **st) {
    (void)st;
    ag_joint *j = export_zoo("linear");
    check_linear(ag_joint_graph(j));
    ag_joint_free(j);
}

static void test_export_convbn(void **st) {
    (void)st;
    ag_joint *j = export_zoo("convbn");
    check_convbn(ag_joint_graph(j));
    ag_joint_free(j);
}

static void test_export_multi_output(void **st) {
    (void)st;
    ag_joint *j = export_zoo("multi_output");
    check_multi(ag_joint_graph(j));
    ag_joint_free(j);
}

/* ---- allocation failures ---- */

static int oom_scenario(void *ud) {
    const ag_graph *g = ud;
    ag_fx_pairs *p[5] = {
        ag_fx_all_input_and_grad_nodes(g),       ag_fx_all_output_and_tangent_nodes(g),
        ag_fx_param_and_grad_nodes(g),           ag_fx_plain_input_and_grad_nodes(g),
        ag_fx_plain_output_and_tangent_nodes(g),
    };
    ag_fx_named *n[2] = {ag_fx_named_param_nodes(g), ag_fx_named_buffer_nodes(g)};
    ag_node *nodes[8];
    int rc = 0;
    for (int i = 0; i < 5; i++)
        if (!p[i])
            rc = AG_ENOMEM;
    for (int i = 0; i < 2; i++)
        if (!n[i])
            rc = AG_ENOMEM;
    if (ag_fx_param_nodes(g, nodes, 8) < 0 || ag_fx_buffer_nodes(g, nodes, 8) < 0)
        rc = AG_ENOMEM;
    /* a clean run must give the real counts */
    if (!rc && (ag_fx_pairs_count(p[0]) != 9 || ag_fx_pairs_count(p[1]) != 8 ||
                ag_fx_named_count(n[1]) != 3))
        rc = -99;
    if (rc == AG_ENOMEM && ag_last_status() != AG_ENOMEM)
        rc = -98; /* a failure that reported something else */
    for (int i = 0; i < 5; i++)
        ag_fx_pairs_free(p[i]);
    for (int i = 0; i < 2; i++)
        ag_fx_named_free(n[i]);
    return rc;
}

static void test_alloc_failures(void **st) {
    (void)st;
    ag_graph *g = convbn_joint();
    tu_sweep_opts o = {.what = "fx utilities", .clean_run_frees_all = true};
    assert_true(tu_alloc_failure_sweep(oom_scenario, g, &o) >= 20);
    ag_graph_free(g);
}

/* ---- the CLI: aotgrad export / descriptors ---- */

#define HAS(name, needle) tu_cli_has(name, needle)
#define LACKS(name, needle) tu_cli_lacks(name, needle)

static void test_cli(void **state) {
    (void)state;
    if (!tu_cli_setup("/tmp/ag_test_fx_XXXXXX"))
        skip();
    char args[512];

    /* descriptors: the specs, then the two tables with aligned columns */
    assert_int_equal(tu_cli_run("descriptors linear"), 0);
    HAS("out", "params_spec: ['linear.weight', 'linear.bias']\n"
               "buffers_spec: []\n"
               "in_spec: TreeSpec(tuple, None, [TreeSpec(list, None, [*, *, *]), "
               "TreeSpec(dict, [], [])])\n"
               "out_spec: *\n\n"
               "differentiable inputs -> grads (4):\n"
               "  input                                          placeholder  grad\n"
               "  ParamAOTInput(target='linear.weight')          primals_1    ");
    HAS("out", "  PlainAOTInput(idx=0)                           primals_3    None\n"
               "  TangentAOTInput(output=PlainAOTOutput(idx=0))  tangents_1   None\n\n"
               "differentiable outputs -> tangents (3):\n");
    HAS("out", "  PlainAOTOutput(idx=0)                                         ");
    HAS("out", "tangents_1\n  GradAOTOutput(grad_of=ParamAOTInput(target='linear.weight'))  ");
    assert_int_equal(tu_cli_run("descriptors kwargs"), 0);
    HAS("out", "TreeSpec(dict, ['scale'], [*])");
    HAS("out", "  PlainAOTInput(idx=1)  ");
    assert_int_equal(tu_cli_run("descriptors convbn"), 0);
    HAS("out", "buffers_spec: ['bn.running_mean', 'bn.running_var', 'bn.num_batches_tracked']");
    HAS("out", "differentiable inputs -> grads (9):");
    HAS("out", "differentiable outputs -> tangents (8):");
    assert_int_equal(tu_cli_run("descriptors multi_output"), 0);
    HAS("out", "out_spec: TreeSpec(tuple, None, [*, *])");

    /* export prints the joint graph; show parses it back to the same text */
    snprintf(args, sizeof args, "export convbn --seq-nr --stack-traces -o '%s/convbn.txt'",
             tu_cli_dir());
    assert_int_equal(tu_cli_run(args), 0);
    HAS("convbn.txt", "%tangents_1 : f32[2, 3, 4, 4]  # TangentAOTInput(output=PlainAOTOutput("
                      "idx=0))");
    HAS("convbn.txt", "InputMutationAOTOutput(mutated_input=BufferAOTInput(target='bn.running_"
                      "mean'))");
    HAS("convbn.txt", "is_backward");
    snprintf(args, sizeof args, "show '%s/convbn.txt'", tu_cli_dir());
    assert_int_equal(tu_cli_run(args), 0);
    char *a = tu_cli_read("convbn.txt"), *b = tu_cli_read("out");
    assert_string_equal(b, a);
    free(a);
    free(b);
    assert_int_equal(tu_cli_run("export linear"), 0);
    HAS("out", "addmm(");
    assert_int_equal(tu_cli_run("export linear --decompose core"), 0);
    LACKS("out", "addmm(");
    HAS("out", "mm(%primals_3, ");
    assert_int_equal(tu_cli_run("export linear --format dot"), 0);
    HAS("out", "digraph");
    /* gpt2-small exports without its weights */
    assert_int_equal(tu_cli_run("export gpt2 --config gpt2-small"), 0);
    HAS("out", "%primals_1 : f32[50257, 768]  # ParamAOTInput(target='transformer.wte.weight')");

    /* usage errors: exit 2; work errors: exit 1 */
    assert_int_equal(tu_cli_run("export resnet"), 2);
    HAS("err", "unknown model 'resnet'");
    assert_int_equal(tu_cli_run("descriptors gpt2 --config gpt2-medium"), 2);
    HAS("err", "tiny, gpt2-small, gpt2-xl");
    assert_int_equal(tu_cli_run("export linear --decompose all"), 2);
    HAS("err", "--decompose needs 'core'");
    assert_int_equal(tu_cli_run("export linear --format svg"), 2);
    HAS("err", "needs -o");
    assert_int_equal(tu_cli_run("descriptors linear --format dot"), 2);
    HAS("err", "unknown option '--format'");
    assert_int_equal(tu_cli_run("descriptors"), 2);
    HAS("err", "missing MODEL");
    snprintf(args, sizeof args, "export linear -o '%s/no/such/dir'", tu_cli_dir());
    assert_int_equal(tu_cli_run(args), 1);
    HAS("err", "aotgrad export: writing ");
    HAS("err", "/no/such/dir: No such file or directory");

    const char *files[] = {"out", "err", "convbn.txt"};
    tu_cli_cleanup(files, 3);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_linear),
        cmocka_unit_test(test_convbn),
        cmocka_unit_test(test_multiple_outputs),
        cmocka_unit_test(test_node_consistency),
        cmocka_unit_test(test_filters),
        cmocka_unit_test(test_duplicate_fqn),
        cmocka_unit_test(test_error_subclass_input),
        cmocka_unit_test(test_error_subclass_output),
        cmocka_unit_test(test_error_missing_desc),
        cmocka_unit_test(test_error_grad_of_unknown_input),
        cmocka_unit_test(test_error_duplicate_grad),
        cmocka_unit_test(test_error_tangents),
        cmocka_unit_test(test_error_output_desc_mismatch),
        cmocka_unit_test(test_param_nodes_args),
        cmocka_unit_test(test_export_linear),
        cmocka_unit_test(test_export_convbn),
        cmocka_unit_test(test_export_multi_output),
        cmocka_unit_test(test_alloc_failures),
        cmocka_unit_test(test_cli),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
