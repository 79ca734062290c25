/* ag_joint_update, the open transform path: a transform may add, drop and reshape the joint's
 * inputs and outputs as long as each carries a descriptor. Four transforms a compiler writer
 * makes, each compiled and checked against eager: a parameter sharded (half its rows, the
 * callable fed the shard), a buffer input added, an unused tangent dropped, a custom op
 * inserted between a parameter and its use. And what it refuses. The model is the zoo's
 * `linear` (Linear(3, 2) as `linear`, x [4, 3]): placeholders primals_1 (weight [2, 3]),
 * primals_2 (bias [2]), primals_3 (x), tangents_1 ([4, 2]); outputs y, grad weight, grad bias,
 * None. */
#include "testutil.h"

#include <math.h>
#include <string.h>

typedef struct fixture {
    ag_module *m;
    ag_tensor *in[8];
    int nin;
    ag_joint *j;
    ag_tensor *w, *b; /* the module's parameters (borrowed) */
} fixture;

static void setup(fixture *f, const char *model) {
    memset(f, 0, sizeof *f);
    assert_int_equal(ag_zoo_build(model, NULL, &f->m, f->in, 8, &f->nin), 0);
    f->j = ag_export_joint(f->m, f->in, f->nin, NULL, NULL, 0, NULL);
    assert_non_null(f->j);
    f->w = ag_module_param(f->m, "linear.weight");
    f->b = ag_module_param(f->m, "linear.bias");
}

static void teardown(fixture *f) {
    ag_joint_free(f->j);
    ag_module_free(f->m);
    for (int i = 0; i < f->nin; i++)
        ag_tensor_free(f->in[i]);
}

static void set_shape(ag_graph *g, const char *name, int ndim, const int64_t *sizes) {
    ag_node *n = ag_graph_find(g, name);
    assert_non_null(n);
    ag_tmeta m = tu_tmeta(AG_F32, ndim, sizes);
    assert_int_equal(ag_node_set_val(n, 0, &m), 0);
}

static void assert_close(const ag_tensor *want, const ag_tensor *got) {
    assert_int_equal(ag_tensor_numel(want), ag_tensor_numel(got));
    for (int64_t i = 0; i < ag_tensor_numel(want); i++)
        assert_true(fabs(ag_tensor_item_at(want, i) - ag_tensor_item_at(got, i)) <=
                    1e-6 * (1 + fabs(ag_tensor_item_at(want, i))));
}

/* A leaf copy of t that requires grad. */
static ag_tensor *leaf(ag_tensor *t) {
    ag_tensor *c = ag_tensor_keep(ag_contiguous(ag_detach(t)));
    ag_tensor *l = ag_tensor_keep(ag_mul_scalar(c, 1.0));
    ag_tensor_free(c);
    assert_int_equal(ag_tensor_set_requires_grad(l, true), 0);
    return l;
}

/* The weight and bias sharded by rows (the first of each two): the placeholders, the tangent
 * and everything after them take the shard's shapes; the callable is fed the shard and returns
 * the shard's part of y, and the gradients of the shard's rows. */
static void test_shard_parameter(void **st) {
    (void)st;
    fixture f;
    setup(&f, "linear");
    ag_graph *g = ag_graph_copy(ag_joint_graph(f.j));
    set_shape(g, "primals_1", 2, (int64_t[]){1, 3});
    set_shape(g, "primals_2", 1, (int64_t[]){1});
    set_shape(g, "tangents_1", 2, (int64_t[]){4, 1});
    /* A sharding transform also rewrites the shape arguments that name the sharded size: the
     * bias gradient's view to [2]. */
    int fixed = 0;
    for (ag_node *n = ag_graph_first(g); n; n = ag_node_next(n)) {
        const ag_garg *a = ag_node_kind_of(n) == AG_NODE_CALL ? ag_node_arg(n, 1) : NULL;
        if (a && !strcmp(ag_op_name(ag_node_op(n)), "view") && a->kind == AG_GA_INTS && a->n == 1 &&
            a->u.ints[0] == 2) {
            assert_int_equal(ag_node_set_arg(n, 1, AG_GA_INTS((int64_t[]){1}, 1)), 0);
            fixed++;
        }
    }
    assert_int_equal(fixed, 1);
    assert_int_equal(ag_graph_reinfer_meta(g), 0);
    assert_int_equal(ag_joint_update(f.j, g), 0);
    assert_int_equal(ag_joint_num_params(f.j), 2);
    ag_compiled *c = ag_compile_joint(f.j, NULL);
    assert_non_null(c);
    ag_scope_begin();
    ag_tensor *ws = leaf(ag_slice(f.w, 0, 0, 1, 1)), *bs = leaf(ag_slice(f.b, 0, 0, 1, 1));
    ag_tensor *y, *ye;
    assert_int_equal(ag_compiled_call(c, (ag_tensor *[]){ws, bs, f.in[0]}, 3, &y, 1), 1);
    assert_int_equal(ag_tensor_ndim(y), 2);
    assert_int_equal(ag_tensor_sizes(y)[1], 1);
    assert_int_equal(ag_module_call(f.m, f.in, f.nin, &ye, 1), 1);
    assert_close(ag_contiguous(ag_slice(ye, 1, 0, 1, 1)), y);
    ag_tensor *gs[2], *ge[2];
    assert_int_equal(ag_grad(&y, (ag_tensor *[]){ag_ones_like(y)}, 1, (ag_tensor *[]){ws, bs}, 2,
                             gs, false, false),
                     0);
    assert_int_equal(ag_grad(&ye, (ag_tensor *[]){ag_ones_like(ye)}, 1, (ag_tensor *[]){f.w, f.b},
                             2, ge, false, false),
                     0);
    assert_close(ag_contiguous(ag_slice(ge[0], 0, 0, 1, 1)), gs[0]);
    assert_close(ag_contiguous(ag_slice(ge[1], 0, 0, 1, 1)), gs[1]);
    /* The full weight is not what the callable takes now. */
    assert_true(ag_compiled_call(c, (ag_tensor *[]){f.w, f.b, f.in[0]}, 3, &y, 1) < 0);
    assert_non_null(strstr(ag_last_error(), "ParamAOTInput(target='"));
    assert_non_null(strstr(ag_last_error(), "(input 0) is f32[2, 3]; the graph was exported for "
                                            "f32[1, 3]"));
    ag_scope_end();
    ag_tensor_free(ws);
    ag_tensor_free(bs);
    ag_compiled_free(c);
    teardown(&f);
}

/* A buffer input added (BufferAOTInput('scale'), after the parameters) that scales y: the
 * callable takes it where its placeholder is, buffers_spec lists it, and it is static. */
static void test_add_buffer_input(void **st) {
    (void)st;
    fixture f;
    setup(&f, "linear");
    ag_graph *g = ag_graph_copy(ag_joint_graph(f.j));
    ag_tmeta sm = tu_tmeta(AG_F32, 0, NULL);
    /* Placeholders go after the last one: rebuild the order by moving the new one after the
     * parameters. */
    ag_node *s = ag_graph_placeholder(g, "scale", &sm);
    assert_non_null(s);
    ag_desc *d = ag_desc_buffer("scale");
    assert_int_equal(ag_node_set_desc(s, d), 0);
    ag_desc_release(d);
    assert_int_equal(ag_graph_move_after(g, s, ag_graph_find(g, "primals_2")), 0);
    ag_node *o = ag_graph_output_node(g);
    ag_node *y = ag_node_arg(o, 0)->u.nodes[0];
    ag_graph_insert_before(g, o);
    ag_node *ys = ag_graph_call(g, ag_op_find("mul.Tensor"), (ag_garg[]){AG_GA_N(y), AG_GA_N(s)}, 2,
                                "scaled");
    assert_non_null(ys);
    ag_node *nodes[4];
    memcpy(nodes, ag_node_arg(o, 0)->u.nodes, sizeof nodes);
    nodes[0] = ys;
    assert_int_equal(ag_node_set_arg(o, 0, AG_GA_NODES(nodes, 4)), 0);
    ag_graph_insert_at_end(g);
    /* a placeholder without a descriptor is refused, naming it */
    ag_graph *bad = ag_graph_copy(g);
    assert_non_null(ag_graph_placeholder(bad, "nameless", &sm));
    assert_true(ag_joint_update(f.j, bad) < 0);
    assert_non_null(strstr(ag_last_error(), "placeholder 5 (nameless) has no descriptor"));
    assert_int_equal(ag_joint_update(f.j, g), 0);
    assert_int_equal(ag_joint_num_buffers(f.j), 1);
    assert_string_equal(ag_joint_buffer_fqn(f.j, 0), "scale");
    assert_int_equal(ag_joint_num_static_inputs(f.j), 3);
    assert_int_equal(ag_joint_num_flat_inputs(f.j), 4);
    ag_compiled *c = ag_compile_joint(f.j, NULL);
    assert_non_null(c);
    ag_scope_begin();
    ag_tensor *scale = ag_full(AG_F32, 0, NULL, 3.0), *yc, *ye;
    assert_int_equal(ag_compiled_call(c, (ag_tensor *[]){f.w, f.b, scale, f.in[0]}, 4, &yc, 1), 1);
    assert_int_equal(ag_module_call(f.m, f.in, f.nin, &ye, 1), 1);
    assert_close(ag_mul_scalar(ye, 3.0), yc);
    ag_tensor *gc[2], *ge[2];
    assert_int_equal(ag_grad(&yc, (ag_tensor *[]){ag_ones_like(yc)}, 1, (ag_tensor *[]){f.w, f.b},
                             2, gc, false, false),
                     0);
    assert_int_equal(ag_grad(&ye, (ag_tensor *[]){ag_ones_like(ye)}, 1, (ag_tensor *[]){f.w, f.b},
                             2, ge, false, false),
                     0);
    /* the backward was the joint's: gradients of y, not of the scaled y */
    assert_close(ge[0], gc[0]);
    assert_close(ge[1], gc[1]);
    ag_scope_end();
    ag_compiled_free(c);
    teardown(&f);
}

/* multi_output returns (linear1(x), linear2(x)); a transform that never differentiates the
 * second output replaces its tangent by zeros and drops the placeholder: the callable's second
 * output then carries no gradient, and linear2's gradients are zero. */
static void test_drop_tangent(void **st) {
    (void)st;
    ag_module *m;
    ag_tensor *in[8];
    int nin;
    assert_int_equal(ag_zoo_build("multi_output", NULL, &m, in, 8, &nin), 0);
    ag_joint *j = ag_export_joint(m, in, nin, NULL, NULL, 0, NULL);
    assert_non_null(j);
    assert_int_equal(ag_joint_num_tangents(j), 2);
    ag_graph *g = ag_graph_copy(ag_joint_graph(j));
    ag_node *t2 = ag_graph_find(g, "tangents_2");
    assert_non_null(t2);
    ag_graph_insert_after(g, t2);
    const ag_tmeta *tm = ag_node_val(t2, 0);
    ag_node *z = ag_graph_call(g, ag_op_find("zeros"),
                               (ag_garg[]){AG_GA_INTS(tm->sizes, tm->ndim), AG_GA_DT(AG_F32)}, 2,
                               "zero_tangent");
    assert_non_null(z);
    assert_int_equal(ag_graph_move_after(g, z, ag_graph_find(g, "tangents_2")), 0);
    assert_true(ag_node_replace_all_uses(t2, z) > 0);
    assert_int_equal(ag_graph_erase(g, t2), 0);
    ag_graph_insert_at_end(g);
    assert_int_equal(ag_joint_update(j, g), 0);
    assert_int_equal(ag_joint_num_tangents(j), 1);
    ag_compiled *c = ag_compile_joint(j, NULL);
    assert_non_null(c);
    ag_scope_begin();
    ag_tensor *y[2];
    assert_int_equal(ag_compiled_call_module(c, m, in, nin, y, 2), 2);
    ag_named_tensors ps;
    assert_int_equal(ag_module_named_parameters(m, true, &ps), 0);
    ag_tensor *loss = ag_add(ag_sum_all(y[0]), ag_sum_all(y[1]));
    assert_int_equal(ag_backward(loss, NULL, false), 0);
    /* eager: only the first output's gradient */
    ag_tensor *ye[2], *ge[4];
    assert_int_equal(ag_module_call(m, in, nin, ye, 2), 2);
    assert_int_equal(
        ag_grad(&ye[0], (ag_tensor *[]){ag_ones_like(ye[0])}, 1, ps.tensors, 2, ge, false, false),
        0);
    assert_close(ge[0], ag_tensor_grad(ps.tensors[0]));
    assert_close(ge[1], ag_tensor_grad(ps.tensors[1]));
    for (int p = 2; p < 4; p++) { /* linear2: zero */
        const ag_tensor *gp = ag_tensor_grad(ps.tensors[p]);
        for (int64_t i = 0; gp && i < ag_tensor_numel(gp); i++)
            assert_true(ag_tensor_item_at(gp, i) == 0);
    }
    ag_named_tensors_free(&ps);
    ag_scope_end();
    ag_compiled_free(c);
    ag_joint_free(j);
    ag_module_free(m);
    for (int i = 0; i < nin; i++)
        ag_tensor_free(in[i]);
}

/* A custom op between the weight and its use (scale2: 2x, as a compiler inserts a gather), and
 * its backward rule applied by hand to the weight's gradient: the callable computes the model
 * with weight 2w, and the weight's gradient is 2 * dL/d(2w). */
static int scale2_meta(const ag_arg *a, ag_tmeta *o) {
    const ag_tensor *x = a[0].u.t;
    *o = tu_tmeta(ag_tensor_dtype(x), ag_tensor_ndim(x), ag_tensor_sizes(x));
    return 0;
}
static int scale2_kernel(const ag_arg *a, ag_tensor **o) {
    float *d = ag_tensor_data(o[0]);
    for (int64_t i = 0; i < ag_tensor_numel(o[0]); i++)
        d[i] = (float)(2.0 * ag_tensor_item_at(a[0].u.t, i));
    return 0;
}
static const ag_opdef scale2_def = {
    .schema = "test_update::scale2(Tensor x) -> Tensor",
    .meta = scale2_meta,
    .kernel = scale2_kernel,
    .dtypes = 1u << AG_F32,
    .flags = AG_OP_NONDIFF,
};

static void test_insert_custom_op(void **st) {
    (void)st;
    const ag_op *op = ag_op_find("test_update::scale2");
    if (!op)
        op = ag_op_register(&scale2_def);
    assert_non_null(op);
    fixture f;
    setup(&f, "linear");
    ag_graph *g = ag_graph_copy(ag_joint_graph(f.j));
    ag_node *w = ag_graph_find(g, "primals_1");
    /* the last placeholder: new nodes go after it */
    ag_graph_insert_after(g, ag_graph_find(g, "tangents_1"));
    ag_node *w2 = ag_graph_call(g, op, (ag_garg[]){AG_GA_N(w)}, 1, "gathered");
    assert_non_null(w2);
    assert_true(ag_node_replace_all_uses(w, w2) > 0);
    assert_int_equal(ag_node_set_arg(w2, 0, AG_GA_N(w)), 0); /* (it was replaced too) */
    ag_node *o = ag_graph_output_node(g);
    ag_node *nodes[4];
    memcpy(nodes, ag_node_arg(o, 0)->u.nodes, sizeof nodes);
    ag_graph_insert_before(g, o);
    nodes[1] = ag_graph_call(g, op, (ag_garg[]){AG_GA_N(nodes[1])}, 1, "grad_scattered");
    assert_non_null(nodes[1]);
    assert_int_equal(ag_node_set_arg(o, 0, AG_GA_NODES(nodes, 4)), 0);
    ag_graph_insert_at_end(g);
    assert_int_equal(ag_joint_update(f.j, g), 0);
    ag_compiled *c = ag_compile_joint(f.j, NULL);
    assert_non_null(c);
    ag_scope_begin();
    ag_tensor *yc;
    assert_int_equal(ag_compiled_call_module(c, f.m, f.in, f.nin, &yc, 1), 1);
    ag_tensor *w2e = leaf(ag_mul_scalar(f.w, 2.0));
    ag_tensor *ye = ag_linear(f.in[0], w2e, f.b);
    assert_close(ye, yc);
    ag_tensor *gc[1], *ge[1];
    assert_int_equal(ag_grad(&yc, (ag_tensor *[]){ag_ones_like(yc)}, 1, (ag_tensor *[]){f.w}, 1, gc,
                             false, false),
                     0);
    assert_int_equal(ag_grad(&ye, (ag_tensor *[]){ag_ones_like(ye)}, 1, (ag_tensor *[]){w2e}, 1, ge,
                             false, false),
                     0);
    assert_close(ag_mul_scalar(ge[0], 2.0), gc[0]);
    ag_scope_end();
    ag_tensor_free(w2e);
    ag_compiled_free(c);
    teardown(&f);
}

/* What a transform may not do: inputs out of section order, an effect token dropped, a user
 * output dropped, a mutated input whose mutation output is not its; a failed update keeps the
 * joint as it was. */
static void test_refused(void **st) {
    (void)st;
    fixture f;
    setup(&f, "linear");
    ag_graph *g = ag_graph_copy(ag_joint_graph(f.j));
    assert_int_equal(
        ag_graph_move_before(g, ag_graph_find(g, "tangents_1"), ag_graph_find(g, "primals_3")), 0);
    assert_true(ag_joint_update(f.j, g) < 0);
    assert_non_null(strstr(ag_last_error(), "placeholder 3 (primals_3, PlainAOTInput(idx=0)) "
                                            "belongs to the primals, which come before the "
                                            "tangents already seen"));
    g = ag_graph_copy(ag_joint_graph(f.j));
    ag_node *o = ag_graph_output_node(g);
    ag_node *nodes[4];
    memcpy(nodes, ag_node_arg(o, 0)->u.nodes, sizeof nodes);
    ag_desc *d[3] = {ag_desc_grad(ag_node_desc(ag_graph_find(g, "primals_1"))),
                     ag_desc_grad(ag_node_desc(ag_graph_find(g, "primals_2"))), NULL};
    assert_int_equal(ag_node_set_arg(o, 0, AG_GA_NODES(nodes + 1, 3)), 0);
    assert_int_equal(ag_node_set_output_descs(o, d, 3), 0);
    ag_desc_release(d[0]);
    ag_desc_release(d[1]);
    assert_true(ag_joint_update(f.j, g) < 0);
    assert_non_null(strstr(ag_last_error(), "returns 0 user outputs; the joint's out_spec has 1"));
    /* unchanged */
    assert_int_equal(ag_joint_num_user_outputs(f.j), 1);
    assert_int_equal(ag_joint_num_primals(f.j), 3);
    ag_compiled *c = ag_compile_joint(f.j, NULL);
    assert_non_null(c);
    ag_compiled_free(c);
    assert_true(ag_joint_update(NULL, NULL) < 0);
    teardown(&f);
    /* effect tokens stay */
    setup(&f, "effects");
    g = ag_graph_copy(ag_joint_graph(f.j));
    ag_node **ph;
    ag_graph_placeholders(g, &ph);
    ag_node *tok = ph[0];
    assert_int_equal(ag_desc_kind_of(ag_node_desc(tok)), AG_DESC_FORWARD_TOKEN_INPUT);
    ag_desc *pd = ag_desc_plain_input(7);
    assert_int_equal(ag_node_set_desc(tok, pd), 0);
    ag_desc_release(pd);
    assert_true(ag_joint_update(f.j, g) < 0);
    assert_non_null(strstr(ag_last_error(), "effect tokens"));
    teardown(&f);
}

/* Hostile transforms: every placeholder and output of the mlp and convbn joints given each of a
 * set of wrong descriptors in turn. ag_joint_update either refuses with a message or takes the
 * graph; ag_compile_joint then either refuses with a message or compiles; nothing crashes or
 * leaks (the ASan build), and a refused update leaves the joint compiling as before. */
static ag_desc *hostile_desc(int k, const ag_desc *was) {
    ag_desc *p = ag_desc_param("no.such.param"), *po = ag_desc_plain_output(7);
    ag_desc *r = NULL;
    switch (k) {
    case 0:
        r = ag_desc_retain(p);
        break;
    case 1:
        r = ag_desc_tangent(po);
        break;
    case 2:
        r = ag_desc_plain_input(9);
        break;
    case 3:
        r = ag_desc_buffer("bn.running_mean");
        break;
    case 4:
        r = ag_desc_forward_token_input(0);
        break;
    case 5:
        r = ag_desc_philox_forward_seed();
        break;
    case 6:
        r = ag_desc_retain(po);
        break;
    case 7:
        r = ag_desc_grad(p);
        break;
    case 8:
        r = ag_desc_input_mutation(p);
        break;
    case 9:
        r = ag_desc_saved_for_backwards(0);
        break;
    case 10:
        r = was ? ag_desc_grad(was) : NULL;
        break;
    default:
        break;
    }
    ag_desc_release(p);
    ag_desc_release(po);
    return r;
}

static void test_hostile_descriptors(void **st) {
    (void)st;
    const char *models[] = {"mlp", "convbn"};
    for (int mi = 0; mi < 2; mi++) {
        ag_module *m;
        ag_tensor *in[8];
        int nin;
        assert_int_equal(ag_zoo_build(models[mi], NULL, &m, in, 8, &nin), 0);
        ag_joint *j = ag_export_joint(m, in, nin, NULL, NULL, 0, NULL);
        assert_non_null(j);
        ag_node **ph;
        int nph = ag_graph_placeholders(ag_joint_graph(j), &ph);
        int nout = ag_node_arg(ag_graph_output_node(ag_joint_graph(j)), 0)->n;
        int taken = 0, refused = 0;
        for (int slot = 0; slot < nph + nout; slot++)
            for (int k = 0; k < 11; k++) {
                ag_joint *jj = ag_export_joint(m, in, nin, NULL, NULL, 0, NULL);
                ag_graph *g = ag_graph_copy(ag_joint_graph(jj));
                ag_node **gph;
                ag_graph_placeholders(g, &gph);
                ag_node *o = ag_graph_output_node(g);
                if (slot < nph) {
                    ag_desc *d = hostile_desc(k, ag_node_desc(gph[slot]));
                    if (!d || ag_node_set_desc(gph[slot], d)) {
                        ag_desc_release(d);
                        ag_graph_free(g);
                        ag_joint_free(jj);
                        continue;
                    }
                    ag_desc_release(d);
                } else {
                    int os = slot - nph;
                    ag_desc *ds[64] = {0};
                    for (int i = 0; i < nout && i < 64; i++)
                        ds[i] = ag_desc_retain(ag_node_output_desc(o, i));
                    ag_desc_release(ds[os]);
                    ds[os] = hostile_desc(k, NULL);
                    int rc = ag_node_set_output_descs(o, ds, nout);
                    for (int i = 0; i < nout && i < 64; i++)
                        ag_desc_release(ds[i]);
                    if (rc) {
                        ag_graph_free(g);
                        ag_joint_free(jj);
                        continue;
                    }
                }
                if (ag_joint_update(jj, g) < 0) {
                    assert_true(strlen(ag_last_error()) > 0);
                    refused++;
                } else {
                    taken++;
                    ag_compiled *c = ag_compile_joint(jj, NULL);
                    if (!c)
                        assert_true(strlen(ag_last_error()) > 0);
                    /* ... and a call and a backward either run or fail with a message */
                    ag_scope_begin();
                    ag_tensor *outs[16] = {0};
                    int r = c ? ag_compiled_call_module(c, m, in, nin, outs, 16) : -1;
                    if (c && r < 0)
                        assert_true(strlen(ag_last_error()) > 0);
                    ag_tensor *loss = NULL;
                    for (int q = 0; q < r; q++)
                        if (outs[q] && ag_tensor_requires_grad(outs[q]))
                            loss = loss ? ag_add(loss, ag_sum_all(outs[q])) : ag_sum_all(outs[q]);
                    if (loss && ag_backward(loss, NULL, false) < 0)
                        assert_true(strlen(ag_last_error()) > 0);
                    ag_scope_end();
                    ag_compiled_free(c);
                }
                /* the joint still compiles after a refusal, or after any update it took */
                ag_joint_free(jj);
            }
        assert_true(refused > 0);
        ag_compiled *c = ag_compile_joint(j, NULL);
        assert_non_null(c);
        ag_compiled_free(c);
        ag_joint_free(j);
        ag_module_free(m);
        for (int i = 0; i < nin; i++)
            ag_tensor_free(in[i]);
        print_message("%s: %d hostile graphs refused by the update, %d taken\n", models[mi],
                      refused, taken);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_shard_parameter), cmocka_unit_test(test_add_buffer_input),
        cmocka_unit_test(test_drop_tangent),    cmocka_unit_test(test_insert_custom_op),
        cmocka_unit_test(test_refused),         cmocka_unit_test(test_hostile_descriptors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
