/* Tuple and dict arguments of graph nodes (AG_GA_TUPLE, AG_GA_DICT; include/aotgrad/graph.h)
 * and flex_attention's calls recorded with upstream's argument schema (src/graph/flex_hop.c):
 * the exact printed form of a small traced flex call (block_mask as BlockMask.as_tuple(),
 * kernel_options as upstream's _apply_kernel_options records them on CPU, the buffers as
 * tuples), its parse round trip, the text form before tuples read into the same graph (and a
 * saved joint of that form loading into the same joint), the numerics against eager, the verifier's
 * and the parser's messages for malformed tuples and dicts (naming the op, the argument and the
 * element), and the aggregate kinds through every mutation: copy, replace-all-uses, DCE keeping a
 * node used only inside a tuple, CSE merging equal tuples and dicts only, DOT edges. */
#include "testutil.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* score + bias[h]: a score_mod with a buffer (2 heads). */
static ag_tensor *head_bias(void *ud, ag_tensor *score, ag_tensor *b, ag_tensor *h, ag_tensor *qi,
                            ag_tensor *ki, ag_tensor *const *bufs, int nbuf) {
    (void)ud, (void)b, (void)qi, (void)ki, (void)nbuf;
    return ag_add(score, ag_index(bufs[0], &h, 1));
}

/* causal with the key sequence 4 longer (cross attention, Q_LEN 8, KV_LEN 12). */
static ag_tensor *shifted_causal(void *ud, ag_tensor *b, ag_tensor *h, ag_tensor *qi, ag_tensor *ki,
                                 ag_tensor *const *bufs, int nbuf) {
    (void)ud, (void)b, (void)h, (void)bufs, (void)nbuf;
    return ag_ge(ag_add_scalar(qi, 4), ki);
}

typedef struct fx {
    ag_block_mask *bm;
    ag_tensor *bias;
} fx;

/* flex_attention(q, k, v) with head_bias and a block mask of 4 x 2 blocks (Q_BLOCK_SIZE 4,
 * KV_BLOCK_SIZE 2) over 8 queries and 12 keys; logsumexp returned too (return_lse). */
static int small_flex(void *ud, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)nin, (void)max_out;
    fx *f = ud;
    ag_score_mod sm = {head_bias, NULL, &f->bias, 1};
    return ag_flex_attention(in[0], in[1], in[2], &sm, f->bm, NULL, &out[0], &out[1]) ? -1 : 2;
}

typedef struct world {
    fx f;
    ag_tensor *x[3];
    ag_graph *g;
    char *txt;
} world;

static void world_make(world *w) {
    ag_mask_mod mm = {shifted_causal, NULL, NULL, 0};
    w->f.bm = ag_create_block_mask(&mm, 1, 1, 8, 12, 4, 2);
    assert_non_null(w->f.bm);
    w->f.bias = tu_tensor(AG_F64, 1, (int64_t[]){2}, (double[]){0.25, -0.5});
    const int64_t L[3] = {8, 12, 12}, E[3] = {4, 4, 3};
    for (int i = 0; i < 3; i++)
        w->x[i] = ag_randn(AG_F64, 4, (int64_t[]){1, 2, L[i], E[i]});
    w->g = ag_trace(small_flex, &w->f, w->x, 3, NULL, NULL, NULL);
    if (!w->g)
        fail_msg("trace: %s", ag_last_error());
    assert_int_equal(ag_graph_verify(w->g), 0);
    w->txt = ag_graph_to_string(w->g, NULL);
    assert_non_null(w->txt);
}

static void world_free(world *w) {
    ag_free(w->txt);
    ag_graph_free(w->g);
    for (int i = 0; i < 3; i++)
        ag_tensor_free(w->x[i]);
    ag_tensor_free(w->f.bias);
    ag_block_mask_free(w->f.bm);
}

/* Runs g on w's inputs and compares with eager flex_attention (the C score_mod and mask_mod). */
static void check_numerics(const world *w, const ag_graph *g) {
    ag_tensor *run[2] = {0}, *eo = NULL, *el = NULL;
    if (ag_graph_run(g, w->x, 3, run, 2) != 2)
        fail_msg("run: %s", ag_last_error());
    ag_score_mod sm = {head_bias, NULL, (ag_tensor **)&w->f.bias, 1};
    assert_int_equal(ag_flex_attention(w->x[0], w->x[1], w->x[2], &sm, w->f.bm, NULL, &eo, &el), 0);
    assert_true(tu_max_abs_diff(run[0], eo) < 1e-12);
    assert_true(tu_max_abs_diff(run[1], el) < 1e-12);
    ag_tensor_free(run[0]);
    ag_tensor_free(run[1]);
    ag_tensor_free(eo);
    ag_tensor_free(el);
}

#define CONSTS                                                                                     \
    "%_tensor_constant0, %_tensor_constant1, %_tensor_constant2, %_tensor_constant3, "             \
    "%_tensor_constant4, %_tensor_constant5, %_tensor_constant6, %_tensor_constant7"
#define KERNEL_OPTIONS(lse)                                                                        \
    "{'BACKEND': 'AUTO', 'PRESCALE_QK': False, 'ROWS_GUARANTEED_SAFE': False, "                    \
    "'BLOCKS_ARE_CONTIGUOUS': False, 'WRITE_DQ': True, 'OUTPUT_LOGSUMEXP': " lse                   \
    ", 'OUTPUT_MAX': False}"

/* The call as upstream's FX graph prints it (torch.ops.higher_order.flex_attention(q, k, v,
 * sdpa_score0, block_mask.as_tuple(), scale, kernel_options, score_mod_other_buffers,
 * mask_mod_other_buffers)): (Q_LEN, KV_LEN, ..., Q_BLOCK_SIZE, KV_BLOCK_SIZE, mask graph);
 * the scale 1/sqrt(4); return_lse was asked, so OUTPUT_LOGSUMEXP is True; a one-element tuple
 * prints with its comma. Upstream's inductor tests expect this shape of their joints, e.g.
 * `flex_attention_backward(..., fw_graph0, joint_graph0, (768, 768, primals_1, ..., primals_8,
 * 128, 128, mask_graph0), 0.125, {'BACKEND': 'AUTO', 'PRESCALE_QK': False,
 * 'ROWS_GUARANTEED_SAFE': False, 'BLOCKS_ARE_CONTIGUOUS': False, 'WRITE_DQ': True,
 * 'OUTPUT_LOGSUMEXP': True, 'OUTPUT_MAX': False}, (), ())` (a CUDA run: OUTPUT_LOGSUMEXP True
 * there; a CPU call without return_lse records False). */
static const char *const flex_line =
    "    %flex_attention = flex_attention(%arg0, %arg1, %arg2, %sdpa_score0, (8, 12, " CONSTS
    ", 4, 2, %sdpa_mask0), 0.5, " KERNEL_OPTIONS("True") ", (%_tensor_constant8,), ())  # "
                                                         "(f64[1, 2, 8, 3], f64[1, 2, 8])\n";

static void test_printed_form(void **state) {
    (void)state;
    world w;
    world_make(&w);
    if (!strstr(w.txt, flex_line))
        fail_msg("the flex line differs:\n%s", w.txt);
    const ag_node *n = ag_graph_find(w.g, "flex_attention");
    assert_int_equal(ag_node_nargs(n), 9);
    const ag_garg *bm = ag_node_arg(n, 4), *ko = ag_node_arg(n, 6);
    assert_int_equal(bm->kind, AG_GA_TUPLE);
    assert_int_equal(bm->n, 13);
    assert_int_equal(ag_garg_num_refs(bm), 13);
    assert_null(ag_garg_ref(bm, 0)); /* Q_LEN, an int */
    assert_int_equal(bm->u.elems[1].u.i, 12);
    assert_ptr_equal(ag_garg_ref(bm, 2), ag_graph_find(w.g, "_tensor_constant0"));
    assert_ptr_equal(ag_garg_ref(bm, 12), ag_graph_find(w.g, "sdpa_mask0"));
    assert_null(ag_garg_ref(bm, 13));
    assert_int_equal(ko->kind, AG_GA_DICT);
    assert_int_equal(ko->n, 7);
    assert_string_equal(ko->u.items[0].key, "BACKEND");
    assert_string_equal(ko->u.items[0].v.u.s, "AUTO");
    assert_int_equal(ag_garg_num_refs(ko), 0);
    /* a node read only inside a tuple has the call as its user */
    assert_int_equal(ag_node_num_users(ag_graph_find(w.g, "_tensor_constant0")), 1);
    assert_ptr_equal(ag_node_user(ag_graph_find(w.g, "_tensor_constant0"), 0), n);
    assert_ptr_equal(ag_node_user(ag_graph_find(w.g, "_tensor_constant8"), 0), n);
    /* DOT draws the tuple's references as edges */
    char *dot = ag_graph_to_dot(w.g, NULL), edge[64];
    snprintf(edge, sizeof edge, "n%d -> n%d;",
             ag_node_index(ag_graph_find(w.g, "_tensor_constant7")), ag_node_index(n));
    assert_non_null(strstr(dot, edge));
    ag_free(dot);
    world_free(&w);
}

static void test_round_trip_and_numerics(void **state) {
    (void)state;
    world w;
    world_make(&w);
    check_numerics(&w, w.g);
    ag_graph *back = ag_graph_parse(w.txt, strlen(w.txt));
    if (!back)
        fail_msg("parse: %s", ag_last_error());
    assert_int_equal(ag_graph_verify(back), 0);
    char *t2 = ag_graph_to_string(back, NULL);
    assert_string_equal(w.txt, t2);
    check_numerics(&w, back);
    ag_free(t2);
    ag_graph_free(back);
    world_free(&w);
}

/* Replaces the first occurrence of `from` in s (which must hold it) by `to`: a new string. */
static char *replace(const char *s, const char *from, const char *to) {
    const char *at = strstr(s, from);
    if (!at)
        fail_msg("'%s' not in the text", from);
    size_t n = strlen(s) - strlen(from) + strlen(to) + 1;
    char *r = malloc(n);
    snprintf(r, n, "%.*s%s%s", (int)(at - s), s, to, at + strlen(from));
    return r;
}

/* Text written before tuples (block_mask a list of 9, [KV_LEN, Q_LEN, Q_BLOCK_SIZE,
 * KV_BLOCK_SIZE], the buffers lists, no kernel_options) reads into upstream's form, with the
 * default kernel_options (OUTPUT_LOGSUMEXP False); a saved joint of the old form too. */
static void test_legacy_text(void **state) {
    (void)state;
    world w;
    world_make(&w);
    char *old =
        replace(w.txt,
                "(8, 12, " CONSTS
                ", 4, 2, %sdpa_mask0), 0.5, " KERNEL_OPTIONS("True") ", (%_tensor_constant8,), ())",
                "[" CONSTS ", %sdpa_mask0], [12, 8, 4, 2], 0.5, [%_tensor_constant8], [])");
    char *want = replace(w.txt, "'OUTPUT_LOGSUMEXP': True", "'OUTPUT_LOGSUMEXP': False");
    ag_graph *g = ag_graph_parse(old, strlen(old));
    if (!g)
        fail_msg("parse: %s", ag_last_error());
    char *t = ag_graph_to_string(g, NULL);
    assert_string_equal(t, want);
    check_numerics(&w, g);
    ag_free(t);
    ag_graph_free(g);
    free(want);
    free(old);
    world_free(&w);
    /* the fuzzer's seed of a joint in the old form, and the same joint in the new form */
    char *seed[2];
    for (int i = 0; i < 2; i++) {
        char path[512];
        snprintf(path, sizeof path, "%s/fuzz/corpus/%s", AG_SOURCE_DIR,
                 i ? "flex_attention_joint.txt" : "flex_attention_legacy.txt");
        FILE *f = fopen(path, "rb");
        assert_non_null(f);
        seed[i] = calloc(1, 1 << 16);
        size_t n = fread(seed[i], 1, (1 << 16) - 1, f);
        fclose(f);
        assert_true(n > 0 && n < (1 << 16) - 1);
    }
    ag_graph *jo = ag_graph_parse(seed[0], strlen(seed[0]));
    ag_graph *jn = ag_graph_parse(seed[1], strlen(seed[1]));
    if (!jo || !jn)
        fail_msg("parse: %s", ag_last_error());
    char *to = ag_graph_to_string(jo, NULL), *tn = ag_graph_to_string(jn, NULL);
    assert_string_equal(to, tn);
    assert_non_null(strstr(tn, "flex_attention_backward(%primals_1, %primals_2, %primals_3, "
                               "%getitem, %getitem_1, %tangents_1, None, %fw_graph0, "
                               "%joint_graph0, (5, 5, %_tensor_constant0_1, "));
    ag_free(to);
    ag_free(tn);
    ag_graph_free(jo);
    ag_graph_free(jn);
    free(seed[0]);
    free(seed[1]);
}

/* ag_node_set_arg(flex, i, a), then the verifier's message must contain `want`; the argument is
 * put back (and the graph verifies again). */
static void expect_verify(ag_graph *g, int i, ag_garg a, const char *want) {
    ag_node *n = ag_graph_find(g, "flex_attention");
    ag_garg keep = *ag_node_arg(n, i);
    /* keep's arrays belong to the node until the argument is replaced: copy them first */
    ag_garg elems[13];
    if (keep.kind == AG_GA_TUPLE) {
        assert_true(keep.n <= 13);
        memcpy(elems, keep.u.elems, sizeof *elems * (size_t)keep.n);
        keep.u.elems = elems;
    }
    ag_gitem items[7];
    if (keep.kind == AG_GA_DICT) {
        assert_int_equal(keep.n, 7);
        memcpy(items, keep.u.items, sizeof items);
        keep.u.items = items;
    }
    ag_graph *c = ag_graph_copy(g); /* the dict's strings: from a copy that lives on */
    if (keep.kind == AG_GA_DICT)
        keep.u.items = ag_node_arg(ag_graph_find(c, "flex_attention"), i)->u.items;
    assert_int_equal(ag_node_set_arg(n, i, a), 0);
    assert_int_equal(ag_graph_verify(g), AG_EINVAL);
    if (!strstr(ag_last_error(), want))
        fail_msg("verify said '%s', expected '%s'", ag_last_error(), want);
    assert_int_equal(ag_node_set_arg(n, i, keep), 0);
    assert_int_equal(ag_graph_verify(g), 0);
    ag_graph_free(c);
}

static void test_verify_messages(void **state) {
    (void)state;
    world w;
    world_make(&w);
    const ag_garg *bm = ag_node_arg(ag_graph_find(w.g, "flex_attention"), 4);
    ag_garg e[13];
    memcpy(e, bm->u.elems, sizeof e);
    expect_verify(w.g, 4, AG_GA_TUPLE(e, 12),
                  "verify: %flex_attention: flex_attention: block_mask (argument 4) has 12 "
                  "elements; upstream's BlockMask.as_tuple() has 13");
    ag_garg e3 = e[3];
    e[3] = AG_GA_I(7);
    expect_verify(w.g, 4, AG_GA_TUPLE(e, 13),
                  "flex_attention: block_mask (argument 4) element 3 (kv_indices) is an int; a "
                  "tensor expected");
    e[3] = e3;
    ag_garg e0 = e[0];
    e[0] = e[2];
    expect_verify(w.g, 4, AG_GA_TUPLE(e, 13),
                  "block_mask (argument 4) element 0 (Q_LEN) is a node; a positive int expected");
    e[0] = e0;
    ag_garg e12 = e[12];
    e[12] = e[2];
    expect_verify(w.g, 4, AG_GA_TUPLE(e, 13),
                  "element 12 (mask_mod) is a node; the mask graph's get_attr or None expected");
    e[12] = e12;
    expect_verify(w.g, 6, AG_GA_TUPLE(e, 2),
                  "flex_attention: kernel_options (argument 6) must be a dict, not a tuple");
    ag_garg one_int = AG_GA_I(3);
    expect_verify(w.g, 7, AG_GA_TUPLE(&one_int, 1),
                  "flex_attention: score_mod_other_buffers (argument 7) element 0 is an int; a "
                  "tensor expected");
    ag_gitem om = {"OUTPUT_MAX", {.kind = AG_MV_BOOL, .u.b = true}};
    expect_verify(w.g, 6, AG_GA_DICT(&om, 1), "OUTPUT_MAX=True");
    /* the query's length no longer the block mask's Q_LEN */
    e[0] = AG_GA_I(16);
    expect_verify(w.g, 4, AG_GA_TUPLE(e, 13),
                  "flex_attention: the block mask is for Q_LEN=16, KV_LEN=12; query has L=8");
    world_free(&w);
}

/* A malformed tuple or dict is refused when set (the graph unchanged), an op that takes none
 * refuses one, and the parser names the line and column. */
static void test_malformed_refused(void **state) {
    (void)state;
    world w;
    world_make(&w);
    ag_node *n = ag_graph_find(w.g, "flex_attention");
    ag_node *x = ag_graph_find(w.g, "arg0");
    ag_node *list[1] = {x};
    ag_garg bad[2] = {AG_GA_I(1), AG_GA_NODES(list, 1)};
    assert_int_equal(ag_node_set_arg(n, 4, AG_GA_TUPLE(bad, 2)), AG_EINVAL);
    assert_string_equal(ag_last_error(), "set_arg: tuple element 1 is a node list (elements are "
                                         "None, nodes, ints, floats or bools)");
    bad[1] = AG_GA_N(NULL);
    assert_int_equal(ag_node_set_arg(n, 4, AG_GA_TUPLE(bad, 2)), AG_EINVAL);
    assert_non_null(strstr(ag_last_error(), "tuple element 1 is a NULL node"));
    ag_gitem twice[2] = {{"A", {.kind = AG_MV_INT, .u.i = 1}}, {"A", {.kind = AG_MV_NONE}}};
    assert_int_equal(ag_node_set_arg(n, 6, AG_GA_DICT(twice, 2)), AG_EINVAL);
    assert_string_equal(ag_last_error(), "set_arg: dict key 'A' given twice");
    char *t = ag_graph_to_string(w.g, NULL);
    assert_string_equal(t, w.txt); /* nothing changed */
    ag_free(t);
    assert_int_equal(ag_node_num_users(x), 1);
    /* an ordinary op takes no tuple */
    ag_garg tup = AG_GA_TUPLE(bad, 1), args[2] = {AG_GA_N(x), tup};
    int nn = ag_graph_num_nodes(w.g);
    assert_null(ag_graph_call(w.g, ag_op_find("add.Tensor"), args, 2, NULL));
    assert_string_equal(ag_last_error(), "add.Tensor: argument 1 is a tuple; it takes none");
    assert_int_equal(ag_graph_num_nodes(w.g), nn);
    /* the parser */
    const struct {
        const char *from, *to, *want;
    } cases[] = {
        {"(%_tensor_constant8,)", "([1],)",
         "expected a tuple element (None, a node, an int, a float or a bool)"},
        {"'PRESCALE_QK'", "'BACKEND'", "dict key 'BACKEND' given twice"},
        {"'PRESCALE_QK': False", "'PRESCALE_QK' False", "expected ':'"},
        {"4, 2, %sdpa_mask0)", "4, %sdpa_mask0)", "block_mask (argument 4) has 12 elements"},
        {"(%_tensor_constant8,)", "(%_tensor_constant8 %arg0,)", "expected ',' or ')'"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *bad_txt = replace(w.txt, cases[i].from, cases[i].to);
        ag_graph *g = ag_graph_parse(bad_txt, strlen(bad_txt));
        if (g || strncmp(ag_last_error(), "line ", 5) || !strstr(ag_last_error(), cases[i].want))
            fail_msg("case %zu: %s", i, g ? "parsed" : ag_last_error());
        free(bad_txt);
    }
    world_free(&w);
}

/* The aggregate kinds through the graph's mutations. */
static void test_mutations(void **state) {
    (void)state;
    world w;
    world_make(&w);
    /* a copy references its own nodes inside the tuples */
    ag_graph *c = ag_graph_copy(w.g);
    char *t = ag_graph_to_string(c, NULL);
    assert_string_equal(t, w.txt);
    ag_free(t);
    const ag_garg *cbm = ag_node_arg(ag_graph_find(c, "flex_attention"), 4);
    assert_ptr_equal(ag_garg_ref(cbm, 3), ag_graph_find(c, "_tensor_constant1"));
    assert_ptr_not_equal(ag_garg_ref(cbm, 3), ag_graph_find(w.g, "_tensor_constant1"));
    assert_int_equal(ag_graph_verify(c), 0);
    ag_graph_free(c); /* the original does not read the copy's nodes */
    assert_int_equal(ag_graph_verify(w.g), 0);
    check_numerics(&w, w.g);

    /* replace-all-uses inside a tuple: a new constant with kv_indices' values */
    ag_node *flex = ag_graph_find(w.g, "flex_attention");
    ag_node *old = ag_graph_find(w.g, "_tensor_constant1");
    ag_graph_insert_before(w.g, flex);
    ag_node *fresh = ag_graph_get_attr(w.g, ag_node_constant(old), "kv_indices_copy");
    assert_non_null(fresh);
    assert_int_equal(ag_node_replace_all_uses(old, fresh), 1);
    assert_int_equal(ag_node_num_users(old), 0);
    assert_ptr_equal(ag_garg_ref(ag_node_arg(flex, 4), 3), fresh);
    assert_ptr_equal(ag_node_user(fresh, 0), flex);
    assert_int_equal(ag_graph_verify(w.g), 0);
    /* DCE removes the old constant and keeps the new one, used only inside the tuple */
    assert_int_equal(ag_graph_dce(w.g), 1);
    assert_null(ag_graph_find(w.g, "_tensor_constant1"));
    assert_non_null(ag_graph_find(w.g, "kv_indices_copy"));
    assert_non_null(ag_graph_find(w.g, "_tensor_constant8")); /* in the buffers' tuple */
    assert_int_equal(ag_graph_verify(w.g), 0);
    check_numerics(&w, w.g);
    /* replaced by None: full_q_num_blocks (element 8) may be None */
    ag_node *fq = ag_graph_find(w.g, "_tensor_constant6");
    assert_int_equal(ag_node_replace_all_uses(fq, NULL), 1);
    assert_int_equal(ag_node_arg(flex, 4)->u.elems[8].kind, AG_GA_NONE);
    assert_int_equal(ag_graph_verify(w.g), 0);
    t = ag_graph_to_string(w.g, NULL);
    assert_non_null(strstr(t, "%_tensor_constant5, None, %_tensor_constant7, 4, 2, %sdpa_mask0)"));
    ag_free(t);
    world_free(&w);
}

/* CSE merges a second call only when its tuples and dict are equal. */
static void test_cse(void **state) {
    (void)state;
    for (int differ = 0; differ < 3; differ++) {
        world w;
        world_make(&w);
        ag_node *flex = ag_graph_find(w.g, "flex_attention");
        ag_garg args[9];
        memcpy(args, ag_node_arg(flex, 0), sizeof args);
        ag_gitem ko[7];
        ag_garg bm[13];
        if (differ == 1) { /* kernel_options: OUTPUT_LOGSUMEXP False */
            memcpy(ko, args[6].u.items, sizeof ko);
            ko[5].v.u.b = false;
            args[6] = AG_GA_DICT(ko, 7);
        } else if (differ == 2) { /* block_mask: without the mask graph */
            memcpy(bm, args[4].u.elems, sizeof bm);
            bm[12] = AG_GA_NIL;
            args[4] = AG_GA_TUPLE(bm, 13);
        }
        ag_graph_insert_before(w.g, ag_graph_output_node(w.g));
        ag_node *dup = ag_graph_call(w.g, ag_node_op(flex), args, 9, NULL);
        assert_non_null(dup);
        ag_node *gi = ag_graph_getitem(w.g, dup, 0, NULL);
        ag_node *outs[3] = {ag_graph_find(w.g, "getitem"), ag_graph_find(w.g, "getitem_1"), gi};
        ag_node *o = ag_graph_output_node(w.g);
        ag_node_replace_all_uses(o, NULL);
        assert_int_equal(ag_graph_erase(w.g, o), 0);
        assert_non_null(ag_graph_output(w.g, outs, 3));
        assert_int_equal(ag_graph_verify(w.g), 0);
        int merged = ag_graph_cse(w.g);
        assert_int_equal(merged, differ ? 0 : 2); /* the call and its getitem */
        assert_int_equal(ag_graph_find(w.g, "flex_attention_1") == NULL, differ == 0);
        world_free(&w);
    }
}

/* A saved joint (docs/JOINT_FORMAT.md) holds the graph's text: one saved before tuples (its
 * flex lines in the old form) loads into the same joint, which saves to today's text and hashes
 * the same. */
static int causal_module_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out,
                                 int max_out) {
    (void)nin, (void)max_out;
    ag_scope_begin();
    ag_tensor *o = NULL;
    if (ag_flex_attention(in[0], in[1], in[2], NULL, ag_module_ud(m), NULL, &o, NULL)) {
        ag_scope_end();
        return ag_last_status();
    }
    return ag_module_return1(o, out);
}

static ag_tensor *causal(void *ud, ag_tensor *b, ag_tensor *h, ag_tensor *qi, ag_tensor *ki,
                         ag_tensor *const *bufs, int nbuf) {
    (void)ud, (void)b, (void)h, (void)bufs, (void)nbuf;
    return ag_ge(qi, ki);
}

#define CONSTS_1                                                                                   \
    "%_tensor_constant0_1, %_tensor_constant1_1, %_tensor_constant2_1, %_tensor_constant3_1, "     \
    "%_tensor_constant4_1, %_tensor_constant5_1, %_tensor_constant6_1, %_tensor_constant7_1"

static void test_saved_joint_of_the_old_form(void **state) {
    (void)state;
    ag_mask_mod mm = {causal, NULL, NULL, 0};
    ag_block_mask *bm = ag_create_block_mask(&mm, 1, 1, 8, 8, 4, 4);
    ag_module *m = ag_module_new("Causal", causal_module_forward, bm, NULL);
    ag_tensor *x[3];
    for (int i = 0; i < 3; i++) {
        x[i] = ag_randn(AG_F32, 4, (int64_t[]){1, 2, 8, 4});
        ag_tensor_set_requires_grad(x[i], true);
    }
    ag_joint *j = ag_export_joint(m, x, 3, NULL, NULL, 0, NULL);
    if (!j)
        fail_msg("export: %s", ag_last_error());
    char *saved = NULL, *old1, *old;
    assert_int_equal(ag_joint_save(j, &saved, NULL), 0);
    old1 = replace(
        saved, "(8, 8, " CONSTS ", 4, 4, %sdpa_mask0), 0.5, " KERNEL_OPTIONS("False") ", (), ())",
        "[" CONSTS ", %sdpa_mask0], [8, 8, 4, 4], 0.5, [], [])");
    old = replace(
        old1, "(8, 8, " CONSTS_1 ", 4, 4, %mask_graph0), 0.5, " KERNEL_OPTIONS("False") ", (), ())",
        "[" CONSTS_1 ", %mask_graph0], [8, 8, 4, 4], 0.5, [], [])");
    assert_null(strstr(old, "'BACKEND'"));
    ag_joint *back = ag_joint_load(old, strlen(old));
    if (!back)
        fail_msg("load: %s", ag_last_error());
    char *again = NULL;
    assert_int_equal(ag_joint_save(back, &again, NULL), 0);
    assert_string_equal(again, saved);
    uint64_t h1 = 0, h2 = 1;
    assert_int_equal(ag_joint_hash(j, &h1), 0);
    assert_int_equal(ag_joint_hash(back, &h2), 0);
    assert_true(h1 == h2);
    ag_free(again);
    free(old);
    free(old1);
    ag_free(saved);
    ag_joint_free(back);
    ag_joint_free(j);
    ag_module_free(m);
    for (int i = 0; i < 3; i++)
        ag_tensor_free(x[i]);
    ag_block_mask_free(bm);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_printed_form),
        cmocka_unit_test(test_round_trip_and_numerics),
        cmocka_unit_test(test_legacy_text),
        cmocka_unit_test(test_verify_messages),
        cmocka_unit_test(test_malformed_refused),
        cmocka_unit_test(test_mutations),
        cmocka_unit_test(test_cse),
        cmocka_unit_test(test_saved_joint_of_the_old_form),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
