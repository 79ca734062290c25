/* The calling convention as data (ag_layout, src/export/layout.c): every descriptor kind's
 * section, a joint's layout against its accessors for every zoo model, the partitioned halves'
 * layouts, the errors for graphs out of order, and the partitioner telling backward inputs by
 * descriptor rather than by name. */
#include "testutil.h"

#include <string.h>

/* Every kind belongs to an input section iff it is an input kind; subclass kinds take their
 * base's; None is a gradient. */
static void test_desc_sections(void **st) {
    (void)st;
    ag_desc *w = ag_desc_param("w"), *po = ag_desc_plain_output(0);
    ag_desc *t = ag_desc_tangent(po), *g = ag_desc_grad(w);
    ag_desc *sa = ag_desc_subclass_getattr_input(t, "a"),
            *sg = ag_desc_subclass_getattr_output(g, "a");
    ag_desc *m = ag_desc_input_mutation(w), *ft = ag_desc_forward_token_input(0);
    ag_desc *bt = ag_desc_backward_token_output(0), *s0 = ag_desc_saved_for_backwards(0);
    ag_desc *ps = ag_desc_philox_backward_seed();
    assert_int_equal(ag_desc_section(w), AG_SEC_IN_PRIMALS);
    assert_int_equal(ag_desc_section(t), AG_SEC_IN_TANGENTS);
    assert_int_equal(ag_desc_section(sa), AG_SEC_IN_TANGENTS);
    assert_int_equal(ag_desc_section(g), AG_SEC_OUT_GRADS);
    assert_int_equal(ag_desc_section(sg), AG_SEC_OUT_GRADS);
    assert_int_equal(ag_desc_section(NULL), AG_SEC_OUT_GRADS);
    assert_int_equal(ag_desc_section(m), AG_SEC_OUT_MUTATIONS);
    assert_int_equal(ag_desc_section(po), AG_SEC_OUT_USER);
    assert_int_equal(ag_desc_section(ft), AG_SEC_IN_FW_TOKENS);
    assert_int_equal(ag_desc_section(bt), AG_SEC_OUT_BW_TOKENS);
    assert_int_equal(ag_desc_section(s0), AG_SEC_OUT_SAVED);
    assert_int_equal(ag_desc_section(ps), AG_SEC_IN_BW_RNG);
    ag_desc *all[] = {w, po, t, g, sa, sg, m, ft, bt, s0, ps};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) {
        assert_int_equal(ag_section_is_input(ag_desc_section(all[i])), ag_desc_is_input(all[i]));
        ag_desc_release(all[i]);
    }
    for (int s = 0; s < AG_SEC_COUNT; s++)
        assert_non_null(ag_section_name((ag_section)s));
    assert_null(ag_section_name(AG_SEC_COUNT));
    assert_string_equal(ag_section_name(AG_SEC_IN_TANGENTS), "tangents");
}

/* Each placeholder and output lies in the section of its descriptor, the sections tile the
 * inputs and outputs in order, and the joint's counts are the layout's. */
static void check_tiles(const ag_graph *g, const ag_layout *L, int nsaved) {
    ag_node **ph;
    int nph = ag_graph_placeholders(g, &ph);
    assert_int_equal(nph, L->ninputs);
    int pos = 0;
    for (int s = 0; s < AG_SEC_OUT_FW_TOKENS; s++) {
        assert_int_equal(L->sec[s].start, pos);
        for (int i = 0; i < L->sec[s].count; i++) {
            const ag_desc *d = ag_node_desc(ph[pos + i]);
            if (s == AG_SEC_IN_SAVED)
                assert_true(pos + i < nsaved);
            else
                assert_int_equal(ag_desc_section(d), s);
        }
        pos += L->sec[s].count;
    }
    assert_int_equal(pos, nph);
    ag_node *o = ag_graph_output_node(g);
    pos = 0;
    for (int s = AG_SEC_OUT_FW_TOKENS; s < AG_SEC_COUNT; s++) {
        assert_int_equal(L->sec[s].start, pos);
        for (int i = 0; i < L->sec[s].count; i++)
            assert_int_equal(ag_desc_section(ag_node_output_desc(o, pos + i)), s);
        pos += L->sec[s].count;
    }
    assert_int_equal(pos, L->noutputs);
}

static void test_zoo_layouts(void **st) {
    (void)st;
    for (int z = 0; z < ag_zoo_count(); z++) {
        ag_module *m;
        ag_tensor *in[8];
        int nin;
        assert_int_equal(ag_zoo_build(ag_zoo_name(z), NULL, &m, in, 8, &nin), 0);
        ag_joint *j = ag_export_joint(m, in, nin, NULL, NULL, 0, NULL);
        assert_non_null(j);
        const ag_layout *L = ag_joint_layout(j);
        check_tiles(ag_joint_graph(j), L, 0);
        assert_int_equal(ag_joint_num_primals(j), ag_layout_count(L, AG_SEC_IN_FW_TOKENS) +
                                                      ag_layout_count(L, AG_SEC_IN_PRIMALS));
        assert_int_equal(ag_joint_num_tangents(j), ag_layout_count(L, AG_SEC_IN_TANGENTS));
        assert_int_equal(ag_joint_num_user_outputs(j), ag_layout_count(L, AG_SEC_OUT_USER));
        assert_int_equal(ag_joint_num_fw_outputs(j), ag_layout_num_fw_outputs(L));
        if (ag_joint_needs_autograd(j)) {
            /* one gradient (or None) per primal that is not a token */
            assert_int_equal(ag_layout_count(L, AG_SEC_OUT_GRADS),
                             ag_layout_count(L, AG_SEC_IN_PRIMALS));
            ag_graph *fw, *bw;
            assert_int_equal(
                ag_partition(ag_joint_graph(j), ag_joint_num_fw_outputs(j), NULL, &fw, &bw, NULL),
                0);
            ag_layout F, B;
            assert_int_equal(ag_graph_layout(fw, 0, &F), 0);
            check_tiles(fw, &F, 0);
            int nsaved = ag_layout_count(&F, AG_SEC_OUT_SAVED);
            assert_int_equal(ag_layout_num_fw_outputs(&F), ag_joint_num_fw_outputs(j));
            assert_int_equal(ag_graph_layout(bw, nsaved, &B), 0);
            check_tiles(bw, &B, nsaved);
            assert_int_equal(ag_layout_count(&B, AG_SEC_IN_SAVED), nsaved);
            assert_int_equal(ag_layout_count(&B, AG_SEC_IN_TANGENTS), ag_joint_num_tangents(j));
            ag_graph_free(fw);
            ag_graph_free(bw);
        }
        ag_joint_free(j);
        ag_module_free(m);
        for (int i = 0; i < nin; i++)
            ag_tensor_free(in[i]);
    }
}

/* Out of order, missing, or misplaced descriptors: an error naming the node, *out untouched. */
static void test_layout_errors(void **st) {
    (void)st;
    ag_module *m;
    ag_tensor *in[8];
    int nin;
    assert_int_equal(ag_zoo_build("linear", NULL, &m, in, 8, &nin), 0);
    ag_joint *j = ag_export_joint(m, in, nin, NULL, NULL, 0, NULL);
    ag_graph *g = ag_graph_copy(ag_joint_graph(j));
    ag_layout L, keep;
    memset(&keep, 0x5a, sizeof keep);
    L = keep;
    ag_node *t1 = ag_graph_find(g, "tangents_1");
    assert_int_equal(ag_graph_move_before(g, t1, ag_graph_find(g, "primals_1")), 0);
    assert_true(ag_graph_layout(g, 0, &L) < 0);
    assert_non_null(strstr(ag_last_error(), "placeholder 1 (primals_1, ParamAOTInput("
                                            "target='linear.weight')) belongs to the primals, "
                                            "which come before the tangents already seen"));
    assert_memory_equal(&L, &keep, sizeof L);
    assert_int_equal(ag_graph_move_after(g, t1, ag_graph_find(g, "primals_3")), 0);
    assert_int_equal(ag_graph_layout(g, 0, &L), 0);
    /* a placeholder without a descriptor */
    ag_tmeta sm = tu_tmeta(AG_F32, 0, NULL);
    assert_non_null(ag_graph_placeholder(g, "nameless", &sm));
    assert_true(ag_graph_layout(g, 0, &L) < 0);
    assert_non_null(strstr(ag_last_error(), "placeholder 4 (nameless) has no descriptor"));
    /* saved inputs beyond the placeholders */
    assert_true(ag_graph_layout(ag_joint_graph(j), 9, &L) < 0);
    assert_non_null(strstr(ag_last_error(), "9 saved inputs asked of a graph with 4"));
    assert_true(ag_graph_layout(NULL, 0, &L) < 0);
    ag_graph_free(g);
    ag_joint_free(j);
    ag_module_free(m);
    for (int i = 0; i < nin; i++)
        ag_tensor_free(in[i]);
}

/* The partitioner tells a tangent by its descriptor: renamed so upstream's naming rule would
 * take it for a primal, it still goes to the backward, and the halves are the same. */
static void test_partition_by_descriptor(void **st) {
    (void)st;
    ag_module *m;
    ag_tensor *in[8];
    int nin;
    assert_int_equal(ag_zoo_build("mlp", NULL, &m, in, 8, &nin), 0);
    ag_joint *j = ag_export_joint(m, in, nin, NULL, NULL, 0, NULL);
    ag_graph *g = ag_graph_copy(ag_joint_graph(j));
    assert_int_equal(ag_node_rename(g, ag_graph_find(g, "tangents_1"), "upstream_would_miss"), 0);
    ag_graph *fw, *bw, *fw2, *bw2;
    int nfw = ag_joint_num_fw_outputs(j);
    assert_int_equal(ag_partition(ag_joint_graph(j), nfw, NULL, &fw, &bw, NULL), 0);
    assert_int_equal(ag_partition(g, nfw, NULL, &fw2, &bw2, NULL), 0);
    assert_null(ag_graph_find(fw2, "upstream_would_miss"));
    assert_non_null(ag_graph_find(bw2, "upstream_would_miss"));
    assert_int_equal(ag_graph_num_nodes(fw), ag_graph_num_nodes(fw2));
    assert_int_equal(ag_graph_num_nodes(bw), ag_graph_num_nodes(bw2));
    ag_graph_free(fw);
    ag_graph_free(bw);
    ag_graph_free(fw2);
    ag_graph_free(bw2);
    ag_graph_free(g);
    ag_joint_free(j);
    ag_module_free(m);
    for (int i = 0; i < nin; i++)
        ag_tensor_free(in[i]);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_desc_sections),
        cmocka_unit_test(test_zoo_layouts),
        cmocka_unit_test(test_layout_errors),
        cmocka_unit_test(test_partition_by_descriptor),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
