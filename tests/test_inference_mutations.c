/* keep_inference_input_mutations (src/export/inference_mutations.c): on the inference path,
 * data mutations of inputs become trailing copy_ nodes instead of InputMutationAOTOutput
 * outputs (shared/spec sections 2.4, 6.3, 6.4), and both executors run them in place. */
#include "export/inference_mutations.h"
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

static char *text_of(const ag_graph *g) {
    ag_print_opts po = {.no_custom = true};
    char *t = ag_graph_to_string(g, &po);
    assert_non_null(t);
    return t;
}

/* ---- a hand-built inference graph ----
 * b (a buffer, f32[3]) is updated to b + x; m (a buffer, f32[2, 3]) has its metadata changed
 * (m.t_(): its new value t(m) is an output as upstream keeps metadata mutations); x is a
 * plain input. Outputs: b's new value, m's new value, relu(x). */
typedef struct hand {
    ag_graph *g;
    ag_input_info info[3];
} hand;

static hand hand_graph(void) {
    hand h = {.g = ag_graph_new()};
    assert_non_null(h.g);
    ag_node *b = tu_ph(h.g, "primals_1", TM(AG_F32, 3));
    ag_node *m = tu_ph(h.g, "primals_2", TM(AG_F32, 2, 3));
    ag_node *x = tu_ph(h.g, "primals_3", TM(AG_F32, 3));
    ag_desc *db = ag_desc_buffer("b"), *dm = ag_desc_buffer("m"), *dx = ag_desc_plain_input(0);
    assert_int_equal(ag_node_set_desc(b, db), 0);
    assert_int_equal(ag_node_set_desc(m, dm), 0);
    assert_int_equal(ag_node_set_desc(x, dx), 0);
    ag_node *add = tu_call(h.g, "add.Tensor", (ag_garg[]){AG_GA_N(b), AG_GA_N(x)}, 2, NULL);
    ag_node *t = tu_call(h.g, "t", (ag_garg[]){AG_GA_N(m)}, 1, NULL);
    ag_node *relu = tu_call(h.g, "relu", (ag_garg[]){AG_GA_N(x)}, 1, NULL);
    ag_node *outs[3] = {add, t, relu};
    ag_node *out = ag_graph_output(h.g, outs, 3);
    assert_non_null(out);
    ag_desc *d[3] = {ag_desc_input_mutation(db), ag_desc_input_mutation(dm),
                     ag_desc_plain_output(0)};
    assert_int_equal(ag_node_set_output_descs(out, d, 3), 0);
    for (int i = 0; i < 3; i++)
        ag_desc_release(d[i]);
    ag_desc_release(db);
    ag_desc_release(dm);
    ag_desc_release(dx);
    h.info[0] = (ag_input_info){.mutates_data = true};
    h.info[1] = (ag_input_info){.mutates_metadata = true};
    h.info[2] = (ag_input_info){0};
    assert_int_equal(ag_graph_verify(h.g), 0);
    return h;
}

static void test_hand_built_graph(void **st) {
    (void)st;
    hand h = hand_graph();
    assert_int_equal(ag__keep_input_mutations_in_graph(h.g, h.info, 3), 1);
    assert_int_equal(ag_graph_verify(h.g), 0);
    char *text = text_of(h.g);
    /* b's update is a copy_ into its placeholder, last before the output, tagged
     * must_be_in_forward; the metadata mutation and the user output stay outputs. */
    assert_string_equal(text, "graph():\n"
                              "    %primals_1 : f32[3]  # BufferAOTInput(target='b')\n"
                              "    %primals_2 : f32[2, 3]  # BufferAOTInput(target='m')\n"
                              "    %primals_3 : f32[3]  # PlainAOTInput(idx=0)\n"
                              "    %add = add.Tensor(%primals_1, %primals_3)  # f32[3]\n"
                              "    %t = t(%primals_2)  # f32[3, 2]{1, 3}\n"
                              "    %relu = relu(%primals_3)  # f32[3]\n"
                              "    %copy_ = copy_(%primals_1, %add)  # f32[3]  must_be_in_forward\n"
                              "    return (%t, %relu)  # [InputMutationAOTOutput(mutated_input="
                              "BufferAOTInput(target='m')), PlainAOTOutput(idx=0)]\n");
    ag_free(text);
    /* A second pass finds nothing to move and changes nothing. */
    char *before = text_of(h.g);
    assert_int_equal(ag__keep_input_mutations_in_graph(h.g, h.info, 3), 0);
    char *after = text_of(h.g);
    assert_string_equal(before, after);
    ag_free(before);
    ag_free(after);

    /* Both executors update b in place: b + x, and the outputs are t(m), relu(x). */
    for (int run = 0; run < 2; run++) {
        ag_scope_begin();
        ag_tensor *b = tu_tensor(AG_F32, 1, (int64_t[]){3}, (double[]){1, 2, 3});
        ag_tensor *m = tu_tensor(AG_F32, 2, (int64_t[]){2, 3}, (double[]){1, 2, 3, 4, 5, 6});
        ag_tensor *x = tu_tensor(AG_F32, 1, (int64_t[]){3}, (double[]){10, -20, 30});
        void *b_data = ag_tensor_data(b);
        ag_tensor *o[2] = {NULL, NULL};
        ag_plan *p = NULL;
        if (run == 0) {
            assert_int_equal(ag_graph_run(h.g, (ag_tensor *[]){b, m, x}, 3, o, 2), 2);
        } else {
            p = ag_plan_new(h.g, &(ag_plan_opts){.checking = true});
            assert_non_null(p);
            assert_int_equal(ag_plan_run(p, (ag_tensor *[]){b, m, x}, 3, o, 2), 2);
        }
        assert_ptr_equal(ag_tensor_data(b), b_data); /* in place: the caller's storage */
        tu_assert_values(b, 1, (int64_t[]){3}, (double[]){11, -18, 33}, 0);
        tu_assert_values(o[0], 2, (int64_t[]){3, 2}, (double[]){1, 4, 2, 5, 3, 6}, 0);
        tu_assert_values(o[1], 1, (int64_t[]){3}, (double[]){10, 0, 30}, 0);
        tu_assert_values(m, 2, (int64_t[]){2, 3}, (double[]){1, 2, 3, 4, 5, 6}, 0);
        ag_plan_free(p); /* the outputs belong to the scope */
        ag_scope_end();
    }
    ag_graph_free(h.g);
}

/* An input that requires grad keeps its mutation as an output (upstream keeps in the graph
 * only mutations autograd need not see). */
static void test_requires_grad_input_stays_an_output(void **st) {
    (void)st;
    hand h = hand_graph();
    h.info[0].requires_grad = true;
    assert_int_equal(ag__keep_input_mutations_in_graph(h.g, h.info, 3), 0);
    assert_int_equal(ag_node_arg(ag_graph_output_node(h.g), 0)->n, 3);
    ag_graph_free(h.g);
}

/* Refusals name the problem and leave the graph as it was. */
static void expect_refused(ag_graph *g, const ag_input_info *info, int n, const char *msg) {
    char *before = text_of(g);
    assert_int_equal(ag__keep_input_mutations_in_graph(g, info, n), AG_EINVAL);
    tu_assert_error_contains(msg);
    char *after = text_of(g);
    assert_string_equal(before, after);
    ag_free(before);
    ag_free(after);
}

static void test_refusals(void **st) {
    (void)st;
    hand h = hand_graph();
    expect_refused(h.g, h.info, 4, "keep_input_mutations: 4 input facts for 3 placeholders");
    expect_refused(h.g, h.info, 0,
                   "keep_input_mutations: output 0 mutates %primals_1, which "
                   "has no input facts (0 given)");
    expect_refused(h.g, NULL, 3, "keep_input_mutations: info is NULL");
    ag_graph_free(h.g);

    /* A training joint: a tangent placeholder and a gradient output. */
    ag_graph *g = ag_graph_new();
    ag_node *w = tu_ph(g, "primals_1", TM(AG_F32, 3));
    ag_node *tg = tu_ph(g, "tangents_1", TM(AG_F32, 3));
    ag_desc *dw = ag_desc_param("w"), *dp = ag_desc_plain_output(0);
    ag_desc *dt = ag_desc_tangent(dp), *dg = ag_desc_grad(dw);
    assert_int_equal(ag_node_set_desc(w, dw), 0);
    assert_int_equal(ag_node_set_desc(tg, dt), 0);
    ag_node *y = tu_call(g, "relu", (ag_garg[]){AG_GA_N(w)}, 1, NULL);
    ag_node *out = ag_graph_output(g, (ag_node *[]){y, tg}, 2);
    assert_int_equal(ag_node_set_output_descs(out, (ag_desc *[]){dp, dg}, 2), 0);
    ag_input_info info[2] = {{0}, {0}};
    expect_refused(g, info, 2,
                   "keep_input_mutations: %tangents_1 is a tangent: input mutations "
                   "stay in the graph only on the inference path");
    ag_desc_release(dw);
    ag_desc_release(dp);
    ag_desc_release(dt);
    ag_desc_release(dg);
    ag_graph_free(g);

    /* A mutation output whose input no placeholder carries. */
    g = ag_graph_new();
    ag_node *x = tu_ph(g, "primals_1", TM(AG_F32, 3));
    ag_desc *dx = ag_desc_plain_input(0), *db = ag_desc_buffer("gone");
    ag_desc *dm = ag_desc_input_mutation(db);
    assert_int_equal(ag_node_set_desc(x, dx), 0);
    out = ag_graph_output(g, (ag_node *[]){x}, 1);
    assert_int_equal(ag_node_set_output_descs(out, (ag_desc *[]){dm}, 1), 0);
    ag_input_info one = {.mutates_data = true};
    expect_refused(g, &one, 1,
                   "keep_input_mutations: output 0 (InputMutationAOTOutput(mutated_input="
                   "BufferAOTInput(target='gone'))): no placeholder carries its input");
    ag_desc_release(dx);
    ag_desc_release(db);
    ag_desc_release(dm);
    ag_graph_free(g);
}

/* ---- BatchNorm in training mode with nothing requiring grad: the inference path ----
 * Exported with keep_inference_input_mutations, the running stats and the batch count are
 * copy_ nodes and the only output is the user's; running the graph updates the caller's
 * buffers in place, to what an eager call computes. */

static void no_grad_params(ag_module *m) {
    ag_named_tensors ps;
    assert_int_equal(ag_module_named_parameters(m, false, &ps), 0);
    for (int i = 0; i < ps.n; i++)
        assert_int_equal(ag_tensor_set_requires_grad(ps.tensors[i], false), 0);
    ag_named_tensors_free(&ps);
}

static void test_batchnorm_inference_keeps_mutations(void **st) {
    (void)st;
    ag_module *me, *mx;
    ag_tensor *ie[8], *ix[8];
    int ne, nx;
    assert_int_equal(ag_zoo_build("convbn", NULL, &me, ie, 8, &ne), 0);
    assert_int_equal(ag_zoo_build("convbn", NULL, &mx, ix, 8, &nx), 0);
    no_grad_params(me);
    no_grad_params(mx);
    ag_export_opts o = {.keep_inference_input_mutations = true};
    ag_joint *j = ag_export_joint(mx, ix, nx, NULL, NULL, 0, &o);
    assert_non_null(j);
    assert_false(ag_joint_needs_autograd(j));
    /* The export applied the rewrite: the graph has the mutations in it, and a second pass
     * finds none left. */
    ag_graph *g = ag_graph_copy(ag_joint_graph(j));
    assert_non_null(g);
    int np = ag_joint_num_primals(j);
    ag_input_info info[16];
    assert_true(np <= 16);
    for (int i = 0; i < np; i++)
        info[i] = *ag_joint_input_info(j, i);
    int moved = ag__keep_input_mutations_in_graph(g, info, np);
    assert_int_equal(moved, 0);
    assert_int_equal(ag__keep_input_mutations_in_graph(g, info, np), 0);
    assert_int_equal(ag_graph_verify(g), 0);

    ag_node *out = ag_graph_output_node(g);
    const ag_garg *oa = ag_node_arg(out, 0);
    assert_int_equal(oa->n, 1);
    char b[256];
    ag_desc_repr(ag_node_output_desc(out, 0), b, sizeof b);
    assert_string_equal(b, "PlainAOTOutput(idx=0)");
    /* copy_ into running_mean, running_var, num_batches_tracked, in that order, last. */
    const char *want[3] = {"BufferAOTInput(target='bn.running_mean')",
                           "BufferAOTInput(target='bn.running_var')",
                           "BufferAOTInput(target='bn.num_batches_tracked')"};
    int ncopy = 0;
    for (ag_node *n = ag_graph_first(g); n; n = ag_node_next(n)) {
        if (ag_node_kind_of(n) != AG_NODE_CALL || strcmp(ag_op_name(ag_node_op(n)), "copy_"))
            continue;
        assert_true(ncopy < 3);
        const ag_node *dst = ag_node_arg(n, 0)->u.node;
        assert_int_equal(ag_node_kind_of(dst), AG_NODE_PLACEHOLDER);
        ag_desc_repr(ag_node_desc(dst), b, sizeof b);
        assert_string_equal(b, want[ncopy]);
        assert_string_equal(ag_node_partitioner_tag(n), "must_be_in_forward");
        ncopy++;
    }
    assert_int_equal(ncopy, 3);
    for (int i = 0; i < oa->n; i++)
        assert_int_not_equal(ag_desc_kind_of(ag_node_output_desc(out, i)), AG_DESC_INPUT_MUTATION);

    /* Eager: the reference output and buffers after one call. */
    ag_scope_begin();
    ag_tensor *ye = ag_module_forward(me, ie[0]);
    assert_non_null(ye);
    const char *bufs[3] = {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"};
    ag_compiled *c = ag_compile_joint(j, NULL);
    assert_non_null(c);
    for (int run = 0; run < 3; run++) {
        /* Fresh copies of the exported module's inputs: params, buffers, x. */
        ag_named_tensors ps, bs;
        assert_int_equal(ag_module_named_parameters(mx, false, &ps), 0);
        assert_int_equal(ag_module_named_buffers(mx, false, &bs), 0);
        ag_tensor *in[8];
        int k = 0;
        for (int i = 0; i < ps.n; i++)
            in[k++] = ag_clone(ps.tensors[i]);
        for (int i = 0; i < bs.n; i++)
            in[k++] = ag_clone(bs.tensors[i]);
        in[k++] = ix[0];
        assert_int_equal(k, 8);
        ag_named_tensors_free(&ps);
        ag_named_tensors_free(&bs);
        void *rm_data = ag_tensor_data(in[4]);
        ag_tensor *y = NULL;
        ag_plan *p = NULL;
        if (run == 0) {
            assert_int_equal(ag_graph_run(g, in, 8, &y, 1), 1);
        } else if (run == 2) { /* the compiled callable: the graph's copy_, no write-back */
            assert_int_equal(ag_compiled_call(c, in, 8, &y, 1), 1);
        } else {
            p = ag_plan_new(g, &(ag_plan_opts){.checking = true});
            assert_non_null(p);
            assert_int_equal(ag_plan_run(p, in, 8, &y, 1), 1);
        }
        assert_true(tu_max_abs_diff(y, ye) < 1e-5);
        assert_ptr_equal(ag_tensor_data(in[4]), rm_data); /* updated in place */
        for (int i = 0; i < 3; i++) {
            ag_tensor *want_buf = ag_module_buffer(me, bufs[i]);
            assert_non_null(want_buf);
            double d = tu_max_abs_diff(in[4 + i], want_buf);
            if (!(d < 1e-6))
                print_error("run %d: %s differs from eager by %g\n", run, bufs[i], d);
            assert_true(d < 1e-6);
        }
        /* the exported module's own buffers are untouched (the graph got clones) */
        ag_tensor *nbt = ag_module_buffer(mx, "bn.num_batches_tracked");
        assert_int_equal((int)ag_tensor_item_at(nbt, 0), 0);
        ag_plan_free(p); /* y, like the clones, belongs to the scope */
    }
    ag_scope_end();
    ag_compiled_free(c);
    ag_graph_free(g);
    ag_joint_free(j);
    ag_module_free(me);
    ag_module_free(mx);
    for (int i = 0; i < ne; i++)
        ag_tensor_free(ie[i]);
    for (int i = 0; i < nx; i++)
        ag_tensor_free(ix[i]);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hand_built_graph),
        cmocka_unit_test(test_requires_grad_input_stays_an_output),
        cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_batchnorm_inference_keeps_mutations),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
