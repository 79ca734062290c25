/* The graph IR: the core API of src/graph/graph.c (FX naming, users bookkeeping, insertion
 * points, erase, replace_all_uses, move, rename, copy, metadata, descriptors), the verifier on
 * hand-broken graphs, the DCE / CSE / meta re-inference passes, and the interpreter checked
 * against eager execution (values and gradients). Graphs are built by hand from op table
 * entries; expected names, orders and messages are written out literally. */
#include "testutil.h"
#include "graph/graph_internal.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- helpers ---- */

#define CALL(g, op, ...) tu_call(g, op, GARGS(__VA_ARGS__), NULL)
#define CALLN(g, name, op, ...) tu_call(g, op, GARGS(__VA_ARGS__), name)

static ag_node *out1(ag_graph *g, ag_node *a) {
    ag_node *o = ag_graph_output(g, (ag_node *[]){a}, 1);
    assert_non_null(o);
    return o;
}

/* The node names in graph order, space separated. */
static const char *order(const ag_graph *g) {
    static char buf[1024];
    size_t k = 0;
    buf[0] = 0;
    for (ag_node *n = ag_graph_first(g); n; n = ag_node_next(n))
        k += (size_t)snprintf(buf + k, sizeof buf - k, k ? " %s" : "%s", ag_node_name(n));
    return buf;
}

static void assert_user_set(const ag_node *n, int cnt, ...) {
    va_list ap;
    va_start(ap, cnt);
    assert_int_equal(ag_node_num_users(n), cnt);
    for (int i = 0; i < cnt; i++) {
        const ag_node *u = va_arg(ap, const ag_node *);
        bool found = false;
        for (int j = 0; j < cnt; j++)
            found |= ag_node_user(n, j) == u;
        if (!found)
            fail_msg("%s is not a user of %s", ag_node_name(u), ag_node_name(n));
    }
    va_end(ap);
}

static void expect_verify_error(const ag_graph *g, const char *msg) {
    int rc = ag_graph_verify(g);
    if (rc != AG_EINVAL)
        fail_msg("verify returned %d, expected an error containing '%s'", rc, msg);
    tu_assert_error_contains(msg);
}

static void expect_verify_ok(const ag_graph *g) {
    if (ag_graph_verify(g))
        fail_msg("verify: %s", ag_last_error());
}

/* x: f32[4, 3], w: f32[2, 3], b: f32[2]; t = t(w); addmm = addmm(b, x, t); output(addmm). */
typedef struct lin {
    ag_graph *g;
    ag_node *x, *w, *b, *t, *addmm, *out;
} lin;

static lin build_linear(void) {
    lin l;
    l.g = ag_graph_new();
    assert_non_null(l.g);
    l.x = tu_ph(l.g, "x", TM(AG_F32, 4, 3));
    l.w = tu_ph(l.g, "w", TM(AG_F32, 2, 3));
    l.b = tu_ph(l.g, "b", TM(AG_F32, 2));
    l.t = CALL(l.g, "t", AG_GA_N(l.w));
    l.addmm = CALL(l.g, "addmm", AG_GA_N(l.b), AG_GA_N(l.x), AG_GA_N(l.t));
    l.out = out1(l.g, l.addmm);
    return l;
}

/* ---- a user op with a side effect ---- */

static int effect_runs;

static int effect_meta(const ag_arg *a, ag_tmeta *o) {
    const ag_tensor *t = a[0].u.t;
    o[0] = tu_tmeta(ag_tensor_dtype(t), ag_tensor_ndim(t), ag_tensor_sizes(t));
    return 0;
}

static int effect_kernel(const ag_arg *a, ag_tensor **o) {
    effect_runs++;
    return ag__copy_into(o[0], a[0].u.t);
}

static const ag_opdef effect_def = {
    .schema = "test::effect(Tensor self) -> Tensor",
    .flags = AG_OP_EFFECTFUL | AG_OP_NONDIFF,
    .meta = effect_meta,
    .kernel = effect_kernel,
    .dtypes = AG_DT_ALL,
};

static const ag_op *effect_op(void) {
    static const ag_op *op;
    if (!op)
        op = ag_op_register(&effect_def);
    assert_non_null(op);
    return op;
}

/* ==== the core API ==== */

static void test_fx_names(void **st) {
    (void)st;
    ag_graph *g = ag_graph_new();
    ag_node *x = tu_ph(g, "x", TM(AG_F32, 4, 3));
    ag_node *w = tu_ph(g, "w", TM(AG_F32, 3, 3));
    ag_node *mm1 = CALL(g, "addmm", AG_GA_N(x), AG_GA_N(x), AG_GA_N(w));
    ag_node *mm2 = CALL(g, "addmm", AG_GA_N(x), AG_GA_N(x), AG_GA_N(w));
    ag_node *mm3 = CALL(g, "addmm", AG_GA_N(x), AG_GA_N(x), AG_GA_N(w));
    assert_string_equal(ag_node_name(mm1), "addmm");
    assert_string_equal(ag_node_name(mm2), "addmm_1");
    assert_string_equal(ag_node_name(mm3), "addmm_2");
    /* Overload names are dropped; names shadowing Python builtins start at _1. */
    ag_node *add = CALL(g, "add.Tensor", AG_GA_N(x), AG_GA_N(mm1));
    assert_string_equal(ag_node_name(add), "add");
    int64_t d1[] = {1};
    ag_node *s1 = CALL(g, "sum.dim_IntList", AG_GA_N(x), AG_GA_INTS(d1, 1));
    ag_node *s2 = CALL(g, "sum.dim_IntList", AG_GA_N(x), AG_GA_INTS(d1, 1));
    assert_string_equal(ag_node_name(s1), "sum_1");
    assert_string_equal(ag_node_name(s2), "sum_2");
    ag_node *sl = CALL(g, "slice.Tensor", AG_GA_N(x), AG_GA_I(0), AG_GA_I(1), AG_GA_I(3));
    assert_string_equal(ag_node_name(sl), "slice_1");
    ag_node *ab = CALL(g, "abs", AG_GA_N(x));
    assert_string_equal(ag_node_name(ab), "abs_1");
    /* Explicit names are kept; a taken one is refused. */
    ag_node *mine = CALLN(g, "my_relu", "relu", AG_GA_N(x));
    assert_string_equal(ag_node_name(mine), "my_relu");
    assert_ptr_equal(ag_graph_find(g, "my_relu"), mine);
    assert_null(ag_graph_call(g, tu_op("relu"), GARGS(AG_GA_N(x)), "addmm_1"));
    tu_assert_error_contains("a node named 'addmm_1' already exists");
    assert_null(ag_graph_placeholder(g, "x", &(ag_tmeta){0}));
    tu_assert_error_contains("'x' already exists");
    /* Constants and getitems. */
    ag_tensor *c = ag_zeros(AG_F32, 1, (int64_t[]){3});
    ag_node *c0 = ag_graph_get_attr(g, c, NULL);
    ag_node *c1 = ag_graph_get_attr(g, c, NULL);
    ag_tensor_free(c);
    assert_string_equal(ag_node_name(c0), "_tensor_constant0");
    assert_string_equal(ag_node_name(c1), "_tensor_constant1");
    ag_node *ln = CALL(g, "native_layer_norm", AG_GA_N(x), AG_GA_INTS((int64_t[]){3}, 1), AG_GA_NIL,
                       AG_GA_NIL, AG_GA_F(1e-5));
    ag_node *gi0 = ag_graph_getitem(g, ln, 0, NULL);
    ag_node *gi1 = ag_graph_getitem(g, ln, 1, NULL);
    assert_string_equal(ag_node_name(ln), "native_layer_norm");
    assert_string_equal(ag_node_name(gi0), "getitem");
    assert_string_equal(ag_node_name(gi1), "getitem_1");
    assert_null(ag_graph_getitem(g, ln, 3, NULL));
    tu_assert_error_contains("getitem: native_layer_norm has no output 3");
    assert_null(ag_graph_getitem(g, add, 0, NULL));

    /* Rename: the old name is free again, the new one found; a taken or empty one refused. */
    assert_int_equal(ag_node_rename(g, mm2, "second"), 0);
    assert_string_equal(ag_node_name(mm2), "second");
    assert_ptr_equal(ag_graph_find(g, "second"), mm2);
    assert_null(ag_graph_find(g, "addmm_1"));
    assert_int_equal(ag_node_rename(g, mm3, "second"), AG_EINVAL);
    tu_assert_error_contains("rename: a node named 'second' already exists");
    assert_int_equal(ag_node_rename(g, mm3, ""), AG_EINVAL);
    assert_string_equal(ag_node_name(mm3), "addmm_2");
    /* A later auto-named addmm continues after the highest number. */
    ag_node *mm4 = CALL(g, "addmm", AG_GA_N(x), AG_GA_N(x), AG_GA_N(w));
    assert_string_equal(ag_node_name(mm4), "addmm_3");
    out1(g, mm4);
    expect_verify_ok(g);
    ag_graph_free(g);
}

static void test_call_args_and_vals(void **st) {
    (void)st;
    lin l = build_linear();
    assert_int_equal(ag_node_kind_of(l.addmm), AG_NODE_CALL);
    assert_ptr_equal(ag_node_op(l.addmm), tu_op("addmm"));
    assert_int_equal(ag_node_nargs(l.addmm), 3); /* beta and alpha defaulted: not stored */
    assert_ptr_equal(ag_node_arg_node(l.addmm, 0), l.b);
    assert_ptr_equal(ag_node_arg_node(l.addmm, 2), l.t);
    assert_null(ag_node_arg_node(l.addmm, 3));
    assert_int_equal(ag_node_num_vals(l.addmm), 1);
    const ag_tmeta *v = ag_node_val(l.addmm, 0);
    assert_int_equal(v->dtype, AG_F32);
    assert_int_equal(v->ndim, 2);
    assert_int_equal(v->sizes[0], 4);
    assert_int_equal(v->sizes[1], 2);
    /* t is a view: transposed strides. */
    const ag_tmeta *tv = ag_node_val(l.t, 0);
    assert_int_equal(tv->sizes[0], 3);
    assert_int_equal(tv->strides[0], 1);
    assert_int_equal(tv->strides[1], 3);
    assert_int_equal(ag_node_num_vals(l.out), 0);
    assert_int_equal(ag_node_index(l.x), 0);
    assert_int_equal(ag_node_index(l.out), 5);
    assert_int_equal(ag_graph_num_nodes(l.g), 6);
    assert_ptr_equal(ag_graph_output_node(l.g), l.out);
    ag_node **phs;
    assert_int_equal(ag_graph_placeholders(l.g, &phs), 3);
    assert_ptr_equal(phs[0], l.x);
    assert_ptr_equal(phs[2], l.b);
    /* Non-default trailing args are kept. */
    ag_node *mm = CALL(l.g, "addmm", AG_GA_N(l.b), AG_GA_N(l.x), AG_GA_N(l.t), AG_GA_F(0.5));
    assert_int_equal(ag_node_nargs(mm), 4);
    assert_true(ag_node_arg(mm, 3)->u.f == 0.5);
    /* Schema and meta errors name the op. */
    assert_null(ag_graph_call(l.g, tu_op("mm"), GARGS(AG_GA_N(l.x), AG_GA_N(l.x)), NULL));
    tu_assert_error_contains("mm");
    assert_null(ag_graph_call(l.g, tu_op("relu"), GARGS(AG_GA_I(3)), NULL));
    tu_assert_error_contains("relu: argument 'self' must be Tensor");
    /* A second output node is refused. */
    assert_null(ag_graph_output(l.g, NULL, 0));
    tu_assert_error_contains("already has an output node");
    ag_graph_free(l.g);
}

static void test_users_bookkeeping(void **st) {
    (void)st;
    ag_graph *g = ag_graph_new();
    ag_node *x = tu_ph(g, "x", TM(AG_F32, 2, 2));
    ag_node *y = tu_ph(g, "y", TM(AG_F32, 2, 2));
    ag_node *a = CALL(g, "add.Tensor", AG_GA_N(x), AG_GA_N(x));
    ag_node *m = CALL(g, "mul.Tensor", AG_GA_N(a), AG_GA_N(y));
    ag_node *o = out1(g, m);
    /* One users entry per user node, counting its uses. */
    assert_user_set(x, 1, a);
    assert_int_equal(x->users[0].count, 2);
    assert_user_set(a, 1, m);
    assert_user_set(m, 1, o);
    assert_user_set(y, 1, m);

    /* set_arg moves the use. */
    assert_int_equal(ag_node_set_arg(m, 1, AG_GA_N(x)), 0);
    assert_user_set(y, 0);
    assert_user_set(x, 2, a, m);
    expect_verify_ok(g);
    /* Replacing a's uses by y: m now reads y; a has none and may go. */
    assert_int_equal(ag_node_replace_all_uses(a, y), 1);
    assert_ptr_equal(ag_node_arg_node(m, 0), y);
    assert_user_set(a, 0);
    assert_user_set(y, 1, m);
    assert_int_equal(ag_graph_erase(g, a), 0);
    assert_user_set(x, 1, m);
    assert_null(ag_graph_find(g, "add"));
    assert_string_equal(order(g), "x y mul output");
    expect_verify_ok(g);

    /* A node used twice by one user: replace counts both uses. */
    ag_graph_insert_before(g, m);
    ag_node *n2 = CALL(g, "neg", AG_GA_N(x));
    ag_node *d = CALL(g, "mul.Tensor", AG_GA_N(n2), AG_GA_N(n2));
    assert_user_set(n2, 1, d);
    assert_int_equal(n2->users[0].count, 2);
    assert_int_equal(ag_node_replace_all_uses(n2, x), 2);
    assert_user_set(n2, 0);
    assert_user_set(x, 3, m, n2, d);
    ag_graph_erase(g, d);
    ag_graph_erase(g, n2);

    /* Erase refuses a node with users and changes nothing. */
    assert_int_equal(ag_graph_erase(g, x), AG_ESTATE);
    tu_assert_error_contains("erase: x still has 1 user(s), e.g. mul");
    assert_string_equal(order(g), "x y mul output");
    /* set_arg appending (i == nargs) and out of range. */
    ag_node *s = CALL(g, "sum.dim_IntList", AG_GA_N(y), AG_GA_INTS(((int64_t[]){0}), 1));
    assert_int_equal(ag_node_nargs(s), 2);
    assert_int_equal(ag_node_set_arg(s, 2, AG_GA_B(false)), 0);
    assert_int_equal(ag_node_nargs(s), 3);
    assert_int_equal(ag_node_set_arg(s, 5, AG_GA_I(0)), AG_EINVAL);
    tu_assert_error_contains("set_arg: sum_1 has no argument 5");
    /* The output node's list counts as uses; replacing by NULL gives None. */
    assert_int_equal(ag_node_set_arg(o, 0, AG_GA_NODES(((ag_node *[]){m, s, m}), 3)), 0);
    assert_user_set(m, 1, o);
    assert_int_equal(m->users[0].count, 2);
    assert_int_equal(ag_node_replace_all_uses(s, NULL), 1);
    assert_null(ag_node_arg(o, 0)->u.nodes[1]);
    expect_verify_ok(g);
    ag_graph_free(g);
}

static void test_insertion_points_and_move(void **st) {
    (void)st;
    ag_graph *g = ag_graph_new();
    ag_node *x = tu_ph(g, "x", TM(AG_F32, 3));
    ag_node *a = CALLN(g, "a", "neg", AG_GA_N(x));
    ag_node *o = out1(g, a);
    /* Default: before the output node. */
    ag_node *b = CALLN(g, "b", "relu", AG_GA_N(a));
    assert_string_equal(order(g), "x a b output");
    /* Before a given node. */
    ag_graph_insert_before(g, a);
    CALLN(g, "c", "relu", AG_GA_N(x));
    CALLN(g, "d", "relu", AG_GA_N(x));
    assert_string_equal(order(g), "x c d a b output");
    /* After a given node: consecutive inserts keep their order. */
    ag_graph_insert_after(g, x);
    CALLN(g, "e", "relu", AG_GA_N(x));
    CALLN(g, "f", "relu", AG_GA_N(x));
    assert_string_equal(order(g), "x e f c d a b output");
    /* Placeholders always join the other placeholders. */
    tu_ph(g, "y", TM(AG_F32, 3));
    assert_string_equal(order(g), "x y e f c d a b output");
    /* Back to the default. */
    ag_graph_insert_at_end(g);
    CALLN(g, "h", "relu", AG_GA_N(x));
    assert_string_equal(order(g), "x y e f c d a b h output");
    expect_verify_ok(g);

    assert_int_equal(ag_graph_move_before(g, b, ag_graph_find(g, "c")), 0);
    assert_string_equal(order(g), "x y e f b c d a h output");
    /* b now reads a before a is defined. */
    expect_verify_error(g, "verify: %b uses %a before it is defined");
    assert_int_equal(ag_graph_move_after(g, b, a), 0);
    assert_string_equal(order(g), "x y e f c d a b h output");
    expect_verify_ok(g);
    /* An insertion point at a node that gets erased falls back to the default. */
    ag_graph_insert_before(g, ag_graph_find(g, "h"));
    assert_int_equal(ag_graph_erase(g, ag_graph_find(g, "h")), 0);
    CALLN(g, "k", "relu", AG_GA_N(x));
    assert_string_equal(order(g), "x y e f c d a b k output");
    (void)o;
    ag_graph_free(g);
}

static void test_copy(void **st) {
    (void)st;
    lin l = build_linear();
    ag_tensor *c = ag_ones(AG_F32, 1, (int64_t[]){2});
    ag_node *k = ag_graph_get_attr(l.g, c, "bias_c");
    ag_tensor_free(c);
    ag_node *ad = CALL(l.g, "add.Tensor", AG_GA_N(l.addmm), AG_GA_N(k));
    ag_node_set_arg(l.out, 0, AG_GA_NODES(((ag_node *[]){ad, NULL}), 2));
    ag_node_set_seq_nr(l.addmm, 7);
    ag_node_set_stack_trace(l.addmm, "File \"m.c\", line 3, in f");
    ag_node_set_partitioner_tag(ad, "is_backward");
    ag_node_custom_set(l.addmm, "stage", (ag_mval){.kind = AG_MV_INT, .u.i = 2});
    ag_node_meta_set(l.t, "my_key", (ag_mval){.kind = AG_MV_FLOAT, .u.f = 1.5});
    ag_desc *pd = ag_desc_plain_input(0);
    ag_node_set_desc(l.x, pd);
    ag_desc_release(pd);
    expect_verify_ok(l.g);

    ag_graph *g2 = ag_graph_copy(l.g);
    assert_non_null(g2);
    expect_verify_ok(g2);
    assert_string_equal(order(g2), "x w b t addmm bias_c add output");
    ag_node *m = ag_graph_first(g2);
    for (ag_node *n = ag_graph_first(l.g); n; n = ag_node_next(n), m = ag_node_next(m)) {
        assert_ptr_not_equal(n, m);
        assert_string_equal(ag_node_name(n), ag_node_name(m));
        assert_int_equal(ag_node_kind_of(n), ag_node_kind_of(m));
        assert_ptr_equal(ag_node_op(n), ag_node_op(m));
        assert_int_equal(ag_node_nargs(n), ag_node_nargs(m));
        for (int i = 0; i < ag_node_nargs(n); i++) {
            const ag_garg *a = ag_node_arg(n, i), *b = ag_node_arg(m, i);
            assert_int_equal(a->kind, b->kind);
            if (a->kind == AG_GA_NODE) {
                /* The copy references its own nodes, of the same names. */
                assert_ptr_equal(ag_graph_find(g2, ag_node_name(a->u.node)), b->u.node);
            }
        }
        assert_int_equal(ag_node_num_vals(n), ag_node_num_vals(m));
        for (int i = 0; i < ag_node_num_vals(n); i++)
            assert_memory_equal(ag_node_val(n, i), ag_node_val(m, i), sizeof(ag_tmeta));
        assert_int_equal(ag_node_meta_count(n), ag_node_meta_count(m));
        assert_int_equal(ag_node_custom_count(n), ag_node_custom_count(m));
        assert_int_equal(ag_node_num_users(n), ag_node_num_users(m));
    }
    assert_null(m);
    ag_node *a2 = ag_graph_find(g2, "addmm");
    assert_int_equal(ag_node_seq_nr(a2), 7);
    assert_string_equal(ag_node_stack_trace(a2), "File \"m.c\", line 3, in f");
    assert_int_equal(ag_node_custom_get(a2, "stage").u.i, 2);
    assert_string_equal(ag_node_partitioner_tag(ag_graph_find(g2, "add")), "is_backward");
    assert_true(ag_node_meta_get(ag_graph_find(g2, "t"), "my_key").u.f == 1.5);
    assert_int_equal(ag_desc_kind_of(ag_node_desc(ag_graph_find(g2, "x"))), AG_DESC_PLAIN_INPUT);
    /* Constants are shared. */
    assert_ptr_equal(ag_node_constant(ag_graph_find(g2, "bias_c")), ag_node_constant(k));
    /* The output list's None survives. */
    assert_null(ag_node_arg(ag_graph_output_node(g2), 0)->u.nodes[1]);
    /* Independent: changing the copy leaves the original alone, and names continue. */
    ag_node_set_seq_nr(a2, 9);
    ag_node_rename(g2, ag_graph_find(g2, "t"), "t_w");
    ag_node *mm2 = CALL(g2, "addmm", AG_GA_N(ag_graph_find(g2, "b")),
                        AG_GA_N(ag_graph_find(g2, "x")), AG_GA_N(ag_graph_find(g2, "t_w")));
    assert_string_equal(ag_node_name(mm2), "addmm_1");
    assert_int_equal(ag_node_seq_nr(l.addmm), 7);
    assert_non_null(ag_graph_find(l.g, "t"));
    assert_null(ag_graph_find(l.g, "addmm_1"));
    assert_int_equal(ag_graph_num_nodes(l.g), 8);
    assert_int_equal(ag_graph_num_nodes(g2), 9);
    ag_graph_free(l.g);
    expect_verify_ok(g2); /* nothing of the original is referenced */
    ag_graph_free(g2);
}

static void test_metadata(void **st) {
    (void)st;
    lin l = build_linear();
    ag_node *n = l.addmm;
    assert_int_equal(ag_node_seq_nr(n), -1);
    assert_int_equal(ag_node_set_seq_nr(n, 12), 0);
    assert_int_equal(ag_node_seq_nr(n), 12);
    ag_node_set_seq_nr(n, -1);
    assert_int_equal(ag_node_seq_nr(n), -1);
    assert_int_equal(ag_node_meta_count(n), 0);

    char trace[64];
    strcpy(trace, "File \"a.c\", line 1, in f");
    assert_null(ag_node_stack_trace(n));
    ag_node_set_stack_trace(n, trace);
    strcpy(trace, "overwritten"); /* the node keeps its own copy */
    assert_string_equal(ag_node_stack_trace(n), "File \"a.c\", line 1, in f");

    assert_null(ag_node_partitioner_tag(n));
    for (int i = 0; i < 4; i++) {
        const char *tags[] = {"is_forward", "is_backward", "must_be_in_forward",
                              "must_be_in_backward"};
        assert_int_equal(ag_node_set_partitioner_tag(n, tags[i]), 0);
        assert_string_equal(ag_node_partitioner_tag(n), tags[i]);
    }
    assert_int_equal(ag_node_set_partitioner_tag(n, "forward"), AG_EINVAL);
    tu_assert_error_contains("partitioner_tag: 'forward' is not one of");
    assert_string_equal(ag_node_partitioner_tag(n), "must_be_in_backward");

    assert_false(ag_node_is_gradient_acc(n));
    ag_node_set_gradient_acc(n, true);
    assert_true(ag_node_is_gradient_acc(n));
    ag_node_set_gradient_acc(n, false);
    assert_false(ag_node_is_gradient_acc(n));

    assert_int_equal(ag_node_recompute(n), AG_RECOMPUTE_NONE);
    ag_node_set_recompute(n, AG_MUST_RECOMPUTE);
    assert_int_equal(ag_node_recompute(n), AG_MUST_RECOMPUTE);
    assert_string_equal(ag_node_meta_get(n, "recompute").u.s, "MUST_RECOMPUTE");
    assert_int_equal(ag_node_set_recompute(n, (ag_recompute)9), AG_EINVAL);
    assert_int_equal(ag_node_recompute(n), AG_MUST_RECOMPUTE);

    /* Generic keys sit beside the typed ones, in insertion order. */
    ag_node_meta_set(n, "pass_note", (ag_mval){.kind = AG_MV_STR, .u.s = "hi"});
    ag_mval v;
    int cnt = ag_node_meta_count(n);
    assert_int_equal(cnt, 4); /* stack_trace, partitioner_tag, recompute, pass_note */
    assert_string_equal(ag_node_meta_key_at(n, 0, &v), "stack_trace");
    assert_string_equal(ag_node_meta_key_at(n, 3, &v), "pass_note");
    assert_string_equal(v.u.s, "hi");
    assert_null(ag_node_meta_key_at(n, 4, &v));
    assert_int_equal(ag_node_meta_get(n, "absent").kind, AG_MV_NONE);
    assert_int_equal(ag_node_meta_del(n, "stack_trace"), 1);
    assert_int_equal(ag_node_meta_del(n, "stack_trace"), 0);
    assert_string_equal(ag_node_meta_key_at(n, 0, NULL), "partitioner_tag");

    /* custom: insertion order, overwrite keeps the position, None refused. */
    ag_node_custom_set(n, "stage", (ag_mval){.kind = AG_MV_INT, .u.i = 1});
    ag_node_custom_set(n, "attn", (ag_mval){.kind = AG_MV_STR, .u.s = "flash"});
    ag_node_custom_set(n, "weight", (ag_mval){.kind = AG_MV_FLOAT, .u.f = 0.25});
    ag_node_custom_set(n, "stage", (ag_mval){.kind = AG_MV_INT, .u.i = 3});
    assert_int_equal(ag_node_custom_count(n), 3);
    assert_string_equal(ag_node_custom_key_at(n, 0, &v), "stage");
    assert_int_equal(v.u.i, 3);
    assert_string_equal(ag_node_custom_key_at(n, 1, &v), "attn");
    assert_string_equal(v.u.s, "flash");
    assert_string_equal(ag_node_custom_key_at(n, 2, NULL), "weight");
    assert_int_equal(ag_node_custom_set(n, "x", (ag_mval){.kind = AG_MV_NONE}), AG_EINVAL);
    tu_assert_error_contains("custom: value of 'x' is None");
    assert_int_equal(ag_node_custom_count(n), 3);
    /* custom_copy replaces the destination's map. */
    ag_node_custom_set(l.t, "old", (ag_mval){.kind = AG_MV_BOOL, .u.b = true});
    assert_int_equal(ag_node_custom_copy(l.t, n), 0);
    assert_int_equal(ag_node_custom_count(l.t), 3);
    assert_int_equal(ag_node_custom_get(l.t, "old").kind, AG_MV_NONE);
    assert_string_equal(ag_node_custom_get(l.t, "attn").u.s, "flash");
    ag_node_custom_clear(n);
    assert_int_equal(ag_node_custom_count(n), 0);
    assert_int_equal(ag_node_custom_count(l.t), 3); /* a deep copy */
    expect_verify_ok(l.g);
    ag_graph_free(l.g);
}

static void test_descs(void **st) {
    (void)st;
    lin l = build_linear();
    ag_desc *in0 = ag_desc_plain_input(0), *pw = ag_desc_param("linear.weight");
    ag_desc *o0 = ag_desc_plain_output(0);
    assert_int_equal(ag_node_set_desc(l.x, in0), 0);
    assert_int_equal(ag_node_set_desc(l.w, pw), 0);
    /* Output descriptors do not go on placeholders, nor descriptors on calls. */
    assert_int_equal(ag_node_set_desc(l.b, o0), AG_EINVAL);
    tu_assert_error_contains("set_desc: b: a placeholder takes an input descriptor");
    assert_null(ag_node_desc(l.b));
    assert_int_equal(ag_node_set_desc(l.t, in0), AG_EINVAL);
    tu_assert_error_contains("set_desc: t is not a placeholder");
    /* The output node: one per output, output descriptors only. */
    assert_false(ag_node_has_output_descs(l.out));
    assert_int_equal(ag_node_set_output_descs(l.out, (ag_desc *[]){o0, o0}, 2), AG_EINVAL);
    tu_assert_error_contains("2 descriptors for 1 outputs");
    assert_int_equal(ag_node_set_output_descs(l.out, (ag_desc *[]){in0}, 1), AG_EINVAL);
    tu_assert_error_contains("an output takes an output descriptor");
    assert_int_equal(ag_node_set_output_descs(l.addmm, (ag_desc *[]){o0}, 1), AG_EINVAL);
    assert_int_equal(ag_node_set_output_descs(l.out, (ag_desc *[]){o0}, 1), 0);
    assert_true(ag_node_has_output_descs(l.out));
    /* The nodes hold their own references. */
    ag_desc_release(in0);
    ag_desc_release(pw);
    ag_desc_release(o0);
    assert_int_equal(ag_desc_kind_of(ag_node_desc(l.x)), AG_DESC_PLAIN_INPUT);
    assert_string_equal(ag_desc_target(ag_node_desc(l.w)), "linear.weight");
    assert_int_equal(ag_desc_kind_of(ag_node_output_desc(l.out, 0)), AG_DESC_PLAIN_OUTPUT);
    assert_null(ag_node_output_desc(l.out, 1));
    /* A None entry is allowed; replacing a desc releases the old one. */
    assert_int_equal(ag_node_set_output_descs(l.out, (ag_desc *[]){NULL}, 1), 0);
    assert_null(ag_node_output_desc(l.out, 0));
    assert_true(ag_node_has_output_descs(l.out));
    ag_node_set_desc(l.x, NULL);
    assert_null(ag_node_desc(l.x));
    expect_verify_ok(l.g);
    ag_graph_free(l.g);
}

/* ==== the verifier ==== */

static void test_verify_accepts(void **st) {
    (void)st;
    lin l = build_linear();
    expect_verify_ok(l.g);
    /* Multi-output calls through getitem; constants; None outputs. */
    ag_graph *g = ag_graph_new();
    ag_node *x = tu_ph(g, "x", TM(AG_F32, 2, 4));
    ag_tensor *c = ag_ones(AG_F32, 1, (int64_t[]){4});
    ag_node *w = ag_graph_get_attr(g, c, NULL);
    ag_tensor_free(c);
    ag_node *ln = CALL(g, "native_layer_norm", AG_GA_N(x), AG_GA_INTS((int64_t[]){4}, 1),
                       AG_GA_N(w), AG_GA_NIL, AG_GA_F(1e-5));
    ag_node *g0 = ag_graph_getitem(g, ln, 0, NULL);
    ag_node *g2 = ag_graph_getitem(g, ln, 2, NULL);
    ag_node *parts[2];
    ag_node *sp = CALL(g, "split.Tensor", AG_GA_N(g0), AG_GA_I(1));
    assert_int_equal(ag_node_num_vals(sp), 2);
    parts[0] = ag_graph_getitem(g, sp, 0, NULL);
    parts[1] = ag_graph_getitem(g, sp, 1, NULL);
    ag_node *cat = CALL(g, "cat", AG_GA_NODES(parts, 2), AG_GA_I(0));
    assert_non_null(ag_graph_output(g, (ag_node *[]){cat, NULL, g2}, 3));
    expect_verify_ok(g);
    ag_graph_free(g);
    ag_graph_free(l.g);
}

static void test_verify_use_before_def(void **st) {
    (void)st;
    lin l = build_linear();
    assert_int_equal(ag_graph_move_after(l.g, l.t, l.addmm), 0);
    expect_verify_error(l.g, "verify: %addmm uses %t before it is defined");
    ag_graph_move_before(l.g, l.t, l.addmm);
    expect_verify_ok(l.g);
    /* The same through the internals: a node listed twice via a swapped link is caught by
     * order too. Here: a placeholder moved behind a call. */
    ag_graph_move_after(l.g, l.b, l.t);
    expect_verify_error(l.g, "verify: placeholder %b comes after %t");
    ag_graph_move_before(l.g, l.b, l.t);
    /* A node of another graph. */
    lin o = build_linear();
    ag_node_set_arg(l.addmm, 0, AG_GA_N(o.b));
    expect_verify_error(l.g, "verify: %addmm uses %b, which is not in the graph");
    ag_node_set_arg(l.addmm, 0, AG_GA_N(l.b));
    expect_verify_ok(l.g);
    ag_graph_free(o.g);
    ag_graph_free(l.g);
}

static void test_verify_wrong_meta(void **st) {
    (void)st;
    lin l = build_linear();
    ag_tmeta bad = TM(AG_F32, 4, 3);
    assert_int_equal(ag_node_set_val(l.addmm, 0, &bad), 0);
    expect_verify_error(l.g, "verify: %addmm: stored val f32[4, 3] but addmm infers f32[4, 2]");
    /* Same sizes, wrong strides: the message shows them. */
    bad = TM(AG_F32, 4, 2);
    bad.strides[0] = 1;
    bad.strides[1] = 4;
    ag_node_set_val(l.addmm, 0, &bad);
    expect_verify_error(l.g, "verify: %addmm: stored val f32[4, 2] (strides [1, 4], offset 0) "
                             "but addmm infers f32[4, 2] (strides [2, 1], offset 0)");
    bad = TM(AG_F64, 4, 2);
    ag_node_set_val(l.addmm, 0, &bad);
    expect_verify_error(l.g, "stored val f64[4, 2] but addmm infers f32[4, 2]");
    bad = TM(AG_F32, 4, 2);
    ag_node_set_val(l.addmm, 0, &bad);
    expect_verify_ok(l.g);
    /* A placeholder changed under its users: the user's inference now fails. */
    ag_tmeta xv = TM(AG_F32, 4, 5);
    ag_node_set_val(l.x, 0, &xv);
    expect_verify_error(l.g, "verify: %addmm: addmm");
    xv = TM(AG_F32, 4, 3);
    ag_node_set_val(l.x, 0, &xv);
    /* Arguments that do not fit the schema. */
    ag_node_set_arg(l.addmm, 1, AG_GA_I(3));
    expect_verify_error(l.g, "verify: %addmm: addmm: argument 'mat1' must be Tensor");
    ag_node_set_arg(l.addmm, 1, AG_GA_N(l.x));
    for (int i = 3; i < 6; i++)
        ag_node_set_arg(l.addmm, i, AG_GA_F(1));
    expect_verify_error(l.g, "verify: %addmm: addmm: takes 5 arguments, 6 given");
    l.addmm->nargs = 3;
    expect_verify_ok(l.g);
    /* A getitem's index and val; a constant's val. */
    ag_graph *g = ag_graph_new();
    ag_node *x = tu_ph(g, "x", TM(AG_F32, 2, 4));
    ag_node *ln = CALL(g, "native_layer_norm", AG_GA_N(x), AG_GA_INTS((int64_t[]){4}, 1), AG_GA_NIL,
                       AG_GA_NIL, AG_GA_F(1e-5));
    ag_node *gi = ag_graph_getitem(g, ln, 1, NULL);
    ag_tensor *c = ag_zeros(AG_F32, 1, (int64_t[]){4});
    ag_node *k = ag_graph_get_attr(g, c, NULL);
    ag_tensor_free(c);
    /* A multi-output call is read through getitem, never directly. */
    assert_null(ag_graph_call(g, tu_op("relu"), GARGS(AG_GA_N(ln)), NULL));
    tu_assert_error_contains("relu: argument 0 (native_layer_norm) is not a single tensor value");
    assert_non_null(ag_graph_output(g, (ag_node *[]){gi, k}, 2));
    expect_verify_ok(g);
    gi->args[1].u.i = 3;
    expect_verify_error(g, "verify: %getitem: index 3 out of range (%native_layer_norm has 3 "
                           "outputs)");
    gi->args[1].u.i = 0;
    expect_verify_error(g, "verify: %getitem: stored val f32[2, 1] but output 0 of "
                           "%native_layer_norm is f32[2, 4]");
    gi->args[1].u.i = 1;
    ag_tmeta kv = TM(AG_F32, 5);
    ag_node_set_val(k, 0, &kv);
    expect_verify_error(g,
                        "verify: %_tensor_constant0: stored val f32[5] but its constant is f32[4]");
    ag_graph_free(g);
    ag_graph_free(l.g);
}

static void test_verify_users(void **st) {
    (void)st;
    lin l = build_linear();
    /* A users entry for a node that does not use x (dangling). */
    assert_int_equal(l.x->nusers, 1);
    assert_ptr_equal(l.x->users[0].node, l.addmm);
    l.x->users[0].node = l.t;
    expect_verify_error(l.g, "verify: %x lists user %t, which does not use it");
    l.x->users[0].node = l.addmm;
    /* A use that is not registered. */
    l.x->nusers = 0;
    expect_verify_error(l.g, "verify: %addmm uses %x but is missing from its users list");
    l.x->nusers = 1;
    /* Counts. */
    l.x->users[0].count = 2;
    expect_verify_error(l.g, "verify: %x lists user %addmm 2 time(s) but it is used 1 time(s)");
    l.x->users[0].count = 1;
    /* The output node's uses too. */
    l.addmm->nusers = 0;
    expect_verify_error(l.g, "verify: %output uses %addmm but is missing from its users list");
    l.addmm->nusers = 1;
    expect_verify_ok(l.g);
    ag_graph_free(l.g);
}

/* The same checks when the user is wide (more than 16 references: the verifier tables its
 * edges instead of scanning its arguments) and for a user listed twice. */
static void test_verify_wide_users(void **st) {
    (void)st;
    ag_graph *g = ag_graph_new();
    ag_node *x = tu_ph(g, "x", TM(AG_F32, 3));
    ag_node *y = CALL(g, "relu", AG_GA_N(x));
    ag_node *z = CALL(g, "neg", AG_GA_N(x));
    ag_node *outs[20];
    for (int i = 0; i < 20; i++)
        outs[i] = i % 2 ? y : z;
    assert_non_null(ag_graph_output(g, outs, 20));
    ag_node *o = ag_graph_output_node(g);
    expect_verify_ok(g);
    assert_int_equal(y->nusers, 1);
    assert_ptr_equal(y->users[0].node, o);
    assert_int_equal(y->users[0].count, 10);
    y->users[0].count = 9;
    expect_verify_error(g, "verify: %relu lists user %output 9 time(s) but it is used 10 time(s)");
    y->users[0].count = 10;
    y->users[1] = y->users[0]; /* the node holds room for two users */
    y->nusers = 2;
    expect_verify_error(g, "verify: %relu lists user %output twice");
    y->nusers = 1;
    assert_int_equal(x->nusers, 2);
    x->users[1].node = o; /* the output node does not read x */
    expect_verify_error(g, "verify: %x lists user %output, which does not use it");
    x->users[1].node = y; /* relu listed twice */
    expect_verify_error(g, "verify: %x lists user %relu twice");
    x->users[1].node = z;
    expect_verify_ok(g);
    ag_graph_free(g);
}

static void test_verify_structure(void **st) {
    (void)st;
    /* No output node. */
    ag_graph *g = ag_graph_new();
    ag_node *x = tu_ph(g, "x", TM(AG_F32, 3));
    ag_node *r = CALL(g, "relu", AG_GA_N(x));
    expect_verify_error(g, "verify: the graph has no output node");
    /* The output not last. */
    out1(g, r);
    ag_graph_insert_at_end(g);
    ag_node *n = CALL(g, "neg", AG_GA_N(x));
    ag_graph_move_after(g, n, ag_graph_output_node(g));
    assert_string_equal(order(g), "x relu output neg");
    expect_verify_error(g, "verify: the output node %output is not last (%neg follows it)");
    ag_graph_move_before(g, n, ag_graph_output_node(g));
    expect_verify_ok(g);
    /* Two nodes of one name (through the internals). */
    char *saved = n->name;
    n->name = (char *)"relu";
    expect_verify_error(g, "verify: two nodes are named 'relu'");
    n->name = saved;
    /* The output's argument must be one list of nodes. */
    ag_node *o = ag_graph_output_node(g);
    o->args[1] = AG_GA_I(1);
    o->nargs = 2;
    expect_verify_error(g, "verify: %output: the output node takes one list of nodes");
    o->nargs = 1;
    expect_verify_ok(g);
    /* Errors are reported, never crashes, for a NULL graph. */
    assert_int_equal(ag_graph_verify(NULL), AG_EINVAL);
    ag_graph_free(g);
}

/* ==== passes ==== */

static void test_dce(void **st) {
    (void)st;
    ag_graph *g = ag_graph_new();
    ag_node *x = tu_ph(g, "x", TM(AG_F32, 2, 3));
    ag_node *y = tu_ph(g, "y", TM(AG_F32, 2, 3));
    tu_ph(g, "unused", TM(AG_F32, 1));
    ag_tensor *c = ag_ones(AG_F32, 1, (int64_t[]){3});
    ag_node *k = ag_graph_get_attr(g, c, NULL);
    ag_tensor_free(c);
    ag_node *r = CALL(g, "relu", AG_GA_N(x));
    ag_node *ng = CALL(g, "neg", AG_GA_N(r));
    CALL(g, "mul.Tensor", AG_GA_N(ng), AG_GA_N(k)); /* dead chain: mul, neg, relu, constant */
    CALL(g, "add_.Tensor", AG_GA_N(y), AG_GA_N(x)); /* in-place: kept */
    CALL(g, "exp", AG_GA_N(y));                     /* dead */
    ag_node *eff = ag_graph_call(g, effect_op(), GARGS(AG_GA_N(x)), NULL);
    assert_non_null(eff);
    assert_string_equal(ag_node_name(eff), "effect");
    ag_node *live = CALL(g, "sub.Tensor", AG_GA_N(x), AG_GA_N(y));
    out1(g, live);
    assert_string_equal(order(g), "x y unused _tensor_constant0 relu neg mul add_ exp effect sub "
                                  "output");
    assert_int_equal(ag_graph_dce(g), 5);
    assert_string_equal(order(g), "x y unused add_ effect sub output");
    expect_verify_ok(g);
    assert_int_equal(ag_graph_dce(g), 0);
    ag_graph_free(g);

    /* Multi-output: dead getitems go; the call stays while one getitem lives, and goes with
     * the last one. A call mutating an argument (batch norm's running stats) stays. */
    g = ag_graph_new();
    x = tu_ph(g, "x", TM(AG_F32, 2, 3, 2, 2));
    ag_node *rm = tu_ph(g, "running_mean", TM(AG_F32, 3));
    ag_node *rv = tu_ph(g, "running_var", TM(AG_F32, 3));
    ag_node *ln = CALL(g, "native_layer_norm", AG_GA_N(x), AG_GA_INTS((int64_t[]){2}, 1), AG_GA_NIL,
                       AG_GA_NIL, AG_GA_F(1e-5));
    ag_node *g0 = ag_graph_getitem(g, ln, 0, NULL);
    ag_graph_getitem(g, ln, 1, NULL);
    ag_graph_getitem(g, ln, 2, NULL);
    ag_node *bn = CALL(g, "native_batch_norm", AG_GA_N(x), AG_GA_NIL, AG_GA_NIL, AG_GA_N(rm),
                       AG_GA_N(rv), AG_GA_B(true), AG_GA_F(0.1), AG_GA_F(1e-5));
    ag_graph_getitem(g, bn, 0, NULL);
    ag_node *bn2 = CALL(g, "native_batch_norm", AG_GA_N(x), AG_GA_NIL, AG_GA_NIL, AG_GA_NIL,
                        AG_GA_NIL, AG_GA_B(true), AG_GA_F(0.1), AG_GA_F(1e-5));
    ag_graph_getitem(g, bn2, 0, NULL);
    ag_node *o = out1(g, g0);
    assert_int_equal(ag_graph_dce(g), 5); /* getitem_1, _2, _3, _4 and native_batch_norm_1 */
    assert_string_equal(order(g), "x running_mean running_var native_layer_norm getitem "
                                  "native_batch_norm output");
    expect_verify_ok(g);
    ag_node_set_arg(o, 0, AG_GA_NODES(((ag_node *[]){x}), 1));
    assert_int_equal(ag_graph_dce(g), 2);
    assert_string_equal(order(g), "x running_mean running_var native_batch_norm output");
    expect_verify_ok(g);
    ag_graph_free(g);
}

static void test_cse(void **st) {
    (void)st;
    ag_graph *g = ag_graph_new();
    ag_node *x = tu_ph(g, "x", TM(AG_F32, 3, 3));
    ag_node *t1 = CALL(g, "t", AG_GA_N(x));
    ag_node *t2 = CALL(g, "t", AG_GA_N(x));
    ag_node_set_seq_nr(t1, 5);
    ag_node_set_seq_nr(t2, 6);
    ag_node_custom_set(t2, "who", (ag_mval){.kind = AG_MV_STR, .u.s = "second"});
    ag_node *a1 = CALL(g, "add.Tensor", AG_GA_N(t1), AG_GA_N(x));
    ag_node *a2 = CALL(g, "add.Tensor", AG_GA_N(t2), AG_GA_N(x)); /* equal once t2 is t */
    ag_node *a3 = CALL(g, "add.Tensor", AG_GA_N(x), AG_GA_N(t1)); /* other order: different */
    ag_node *ms1 = CALL(g, "mul.Scalar", AG_GA_N(x), AG_GA_F(0.0));
    ag_node *ms2 = CALL(g, "mul.Scalar", AG_GA_N(x), AG_GA_F(-0.0)); /* bitwise different */
    ag_node *ms3 = CALL(g, "mul.Scalar", AG_GA_N(x), AG_GA_F(0.0));
    int64_t d0[] = {0}, d1[] = {1};
    ag_node *s1 = CALL(g, "sum.dim_IntList", AG_GA_N(x), AG_GA_INTS(d0, 1));
    ag_node *s2 = CALL(g, "sum.dim_IntList", AG_GA_N(x), AG_GA_INTS(d1, 1));
    ag_node *s3 = CALL(g, "sum.dim_IntList", AG_GA_N(x), AG_GA_INTS(d0, 1), AG_GA_B(true));
    ag_node *r1 = CALL(g, "rand", AG_GA_INTS(((int64_t[]){3, 3}), 2));
    ag_node *r2 = CALL(g, "rand", AG_GA_INTS(((int64_t[]){3, 3}), 2));
    ag_node *dr1 = CALL(g, "native_dropout", AG_GA_N(x), AG_GA_F(0.5), AG_GA_B(true));
    ag_node *dr2 = CALL(g, "native_dropout", AG_GA_N(x), AG_GA_F(0.5), AG_GA_B(true));
    ag_node *dg1 = ag_graph_getitem(g, dr1, 0, NULL);
    ag_node *dg2 = ag_graph_getitem(g, dr2, 0, NULL);
    ag_node *ip1 = CALL(g, "add_.Tensor", AG_GA_N(x), AG_GA_N(a1));
    ag_node *ip2 = CALL(g, "add_.Tensor", AG_GA_N(x), AG_GA_N(a1));
    ag_node *e1 = ag_graph_call(g, effect_op(), GARGS(AG_GA_N(x)), NULL);
    ag_node *e2 = ag_graph_call(g, effect_op(), GARGS(AG_GA_N(x)), NULL);
    /* Duplicate multi-output calls merge, and so do their getitems. */
    ag_node *ln1 = CALL(g, "native_layer_norm", AG_GA_N(x), AG_GA_INTS(((int64_t[]){3}), 1),
                        AG_GA_NIL, AG_GA_NIL, AG_GA_F(1e-5));
    ag_node *ln2 = CALL(g, "native_layer_norm", AG_GA_N(x), AG_GA_INTS(((int64_t[]){3}), 1),
                        AG_GA_NIL, AG_GA_NIL, AG_GA_F(1e-5));
    ag_node *lg1 = ag_graph_getitem(g, ln1, 0, NULL);
    ag_node *lg2 = ag_graph_getitem(g, ln2, 0, NULL);
    ag_node *outs[] = {a1, a2,  a3,  ms1, ms2, ms3, s1, s2,  s3, r1,
                       r2, dg1, dg2, ip1, ip2, e1,  e2, lg1, lg2};
    int nout = (int)(sizeof outs / sizeof outs[0]);
    ag_node *o = ag_graph_output(g, outs, nout);
    assert_non_null(o);
    expect_verify_ok(g);
    int before = ag_graph_num_nodes(g);
    /* Merged: t_1, add_1, mul_2, native_layer_norm_1 and its getitem. */
    assert_int_equal(ag_graph_cse(g), 5);
    assert_int_equal(ag_graph_num_nodes(g), before - 5);
    expect_verify_ok(g);
    const ag_garg *ol = ag_node_arg(o, 0);
    assert_ptr_equal(ol->u.nodes[0], a1);
    assert_ptr_equal(ol->u.nodes[1], a1);
    assert_ptr_equal(ol->u.nodes[2], a3);
    assert_ptr_equal(ol->u.nodes[3], ms1);
    assert_ptr_equal(ol->u.nodes[4], ms2);
    assert_ptr_equal(ol->u.nodes[5], ms1);
    assert_ptr_equal(ol->u.nodes[6], s1);
    assert_ptr_equal(ol->u.nodes[7], s2);
    assert_ptr_equal(ol->u.nodes[8], s3);
    assert_ptr_equal(ol->u.nodes[9], r1);
    assert_ptr_equal(ol->u.nodes[10], r2);
    assert_ptr_equal(ol->u.nodes[11], dg1);
    assert_ptr_equal(ol->u.nodes[12], dg2);
    assert_ptr_equal(ol->u.nodes[13], ip1);
    assert_ptr_equal(ol->u.nodes[14], ip2);
    assert_ptr_equal(ol->u.nodes[15], e1);
    assert_ptr_equal(ol->u.nodes[16], e2);
    assert_ptr_equal(ol->u.nodes[17], lg1);
    assert_ptr_equal(ol->u.nodes[18], lg1);
    assert_null(ag_graph_find(g, "t_1"));
    assert_null(ag_graph_find(g, "native_layer_norm_1"));
    /* The earlier node keeps its own metadata. */
    assert_int_equal(ag_node_seq_nr(t1), 5);
    assert_int_equal(ag_node_custom_count(t1), 0);
    assert_user_set(t1, 2, a1, a3);
    assert_int_equal(ag_graph_cse(g), 0);
    ag_graph_free(g);

    /* Nothing merges across a mutation: relu(x) before and after x.add_(y) differ. */
    g = ag_graph_new();
    x = tu_ph(g, "x", TM(AG_F32, 3));
    ag_node *y = tu_ph(g, "y", TM(AG_F32, 3));
    ag_node *v1 = CALL(g, "relu", AG_GA_N(x));
    ag_node *v2 = CALL(g, "relu", AG_GA_N(x));
    CALL(g, "add_.Tensor", AG_GA_N(x), AG_GA_N(y));
    ag_node *v3 = CALL(g, "relu", AG_GA_N(x));
    ag_node *v4 = CALL(g, "relu", AG_GA_N(x));
    ag_graph_output(g, (ag_node *[]){v1, v2, v3, v4}, 4);
    assert_int_equal(ag_graph_cse(g), 2);
    assert_string_equal(order(g), "x y relu add_ relu_2 output");
    ol = ag_node_arg(ag_graph_output_node(g), 0);
    assert_ptr_equal(ol->u.nodes[1], v1);
    assert_ptr_equal(ol->u.nodes[3], v3);
    expect_verify_ok(g);
    ag_graph_free(g);
}

static void test_reinfer_meta(void **st) {
    (void)st;
    ag_graph *g = ag_graph_new();
    ag_node *x = tu_ph(g, "x", TM(AG_F32, 4, 3));
    ag_node *w = tu_ph(g, "w", TM(AG_F32, 3, 2));
    ag_node *r = CALL(g, "relu", AG_GA_N(x));
    ag_node *mm = CALL(g, "mm", AG_GA_N(r), AG_GA_N(w));
    ag_node *ln = CALL(g, "native_layer_norm", AG_GA_N(mm), AG_GA_INTS(((int64_t[]){2}), 1),
                       AG_GA_NIL, AG_GA_NIL, AG_GA_F(1e-5));
    ag_node *g1 = ag_graph_getitem(g, ln, 1, NULL);
    ag_node *s = CALL(g, "sum.dim_IntList", AG_GA_N(mm), AG_GA_INTS(((int64_t[]){1}), 1));
    ag_graph_output(g, (ag_node *[]){s, g1}, 2);
    /* Shard the batch: x is now [8, 3]. */
    ag_tmeta xv = TM(AG_F32, 8, 3);
    ag_node_set_val(x, 0, &xv);
    expect_verify_error(g, "verify: %relu: stored val f32[4, 3] but relu infers f32[8, 3]");
    assert_int_equal(ag_graph_reinfer_meta(g), 0);
    expect_verify_ok(g);
    assert_int_equal(ag_node_val(r, 0)->sizes[0], 8);
    assert_int_equal(ag_node_val(mm, 0)->sizes[0], 8);
    assert_int_equal(ag_node_val(mm, 0)->sizes[1], 2);
    assert_int_equal(ag_node_val(ln, 1)->sizes[0], 8);
    assert_int_equal(ag_node_val(g1, 0)->sizes[0], 8);
    assert_int_equal(ag_node_val(g1, 0)->sizes[1], 1);
    assert_int_equal(ag_node_val(s, 0)->ndim, 1);
    assert_int_equal(ag_node_val(s, 0)->sizes[0], 8);
    /* A shape the ops reject: the error names the node, and nothing changes. */
    xv = TM(AG_F32, 8, 5);
    ag_node_set_val(x, 0, &xv);
    assert_int_equal(ag_graph_reinfer_meta(g), AG_EINVAL);
    tu_assert_error_contains("reinfer_meta: %mm: mm");
    assert_int_equal(ag_node_val(r, 0)->sizes[1], 3); /* restored */
    xv = TM(AG_F32, 8, 3);
    ag_node_set_val(x, 0, &xv);
    expect_verify_ok(g);

    /* A list op whose chunk count changes: split of a dim that grows from 2 to 6. */
    ag_graph *h = ag_graph_new();
    ag_node *y = tu_ph(h, "y", TM(AG_F32, 2));
    ag_node *sp = CALL(h, "split.Tensor", AG_GA_N(y), AG_GA_I(1));
    ag_node *p1 = ag_graph_getitem(h, sp, 1, NULL);
    out1(h, p1);
    assert_int_equal(ag_node_num_vals(sp), 2);
    ag_tmeta yv = TM(AG_F32, 6);
    ag_node_set_val(y, 0, &yv);
    assert_int_equal(ag_graph_reinfer_meta(h), 0);
    assert_int_equal(ag_node_num_vals(sp), 6);
    expect_verify_ok(h);
    /* Shrinking below an index a getitem reads fails and restores the six vals. */
    yv = TM(AG_F32, 1);
    ag_node_set_val(y, 0, &yv);
    assert_int_equal(ag_graph_reinfer_meta(h), AG_EINVAL);
    tu_assert_error_contains("reinfer_meta: %getitem reads output 1 of %split, which now has 1");
    assert_int_equal(ag_node_num_vals(sp), 6);
    assert_int_equal(ag_node_val(sp, 5)->sizes[0], 1);
    yv = TM(AG_F32, 6);
    ag_node_set_val(y, 0, &yv);
    expect_verify_ok(h);
    ag_graph_free(h);
    ag_graph_free(g);
}

/* ==== the interpreter ==== */

/* x: [4, 3]; w1: [5, 3]; b1: [5]; w2: [2, 5]; b2: [2].
 * h = relu(addmm(b1, x, t(w1))); y = addmm(b2, h, t(w2)); output (y, h). */
static ag_graph *build_mlp(void) {
    ag_graph *g = ag_graph_new();
    ag_node *x = tu_ph(g, "x", TM(AG_F32, 4, 3));
    ag_node *w1 = tu_ph(g, "w1", TM(AG_F32, 5, 3));
    ag_node *b1 = tu_ph(g, "b1", TM(AG_F32, 5));
    ag_node *w2 = tu_ph(g, "w2", TM(AG_F32, 2, 5));
    ag_node *b2 = tu_ph(g, "b2", TM(AG_F32, 2));
    ag_node *t = CALL(g, "t", AG_GA_N(w1));
    ag_node *mm = CALL(g, "addmm", AG_GA_N(b1), AG_GA_N(x), AG_GA_N(t));
    ag_node *h = CALL(g, "relu", AG_GA_N(mm));
    ag_node *t1 = CALL(g, "t", AG_GA_N(w2));
    ag_node *y = CALL(g, "addmm", AG_GA_N(b2), AG_GA_N(h), AG_GA_N(t1));
    assert_non_null(ag_graph_output(g, (ag_node *[]){y, h}, 2));
    return g;
}

/* The MLP's inputs from a fixed seed (the same values on every call); parameters require
 * grad when `grad`. */
static void mlp_inputs(ag_tensor **in, bool grad) {
    uint64_t s = 12345;
    const int64_t sz[5][2] = {{4, 3}, {5, 3}, {5, 0}, {2, 5}, {2, 0}};
    for (int i = 0; i < 5; i++) {
        in[i] = tu_rand_tensor(AG_F32, sz[i][1] ? 2 : 1, sz[i], -1, 1, tu_xorshift, &s);
        if (grad && i > 0)
            ag_tensor_set_requires_grad(in[i], true);
    }
}

static void test_run_mlp(void **st) {
    (void)st;
    ag_graph *g = build_mlp();
    expect_verify_ok(g);
    ag_scope_begin();
    ag_tensor *in[5];
    mlp_inputs(in, false);
    ag_tensor *outs[3] = {0};
    assert_int_equal(ag_graph_run(g, in, 5, outs, 3), 2);
    ag_tensor *h = ag_relu(ag_linear(in[0], in[1], in[2]));
    ag_tensor *y = ag_linear(h, in[3], in[4]);
    tu_assert_shape(outs[0], 2, (int64_t[]){4, 2});
    assert_true(tu_max_abs_diff(outs[0], y) < 1e-6);
    assert_true(tu_max_abs_diff(outs[1], h) < 1e-6);
    /* Some hidden unit is clipped by relu, so the check covers it. */
    double hv[20];
    ag_tensor_to_doubles(outs[1], hv);
    int zeros = 0;
    for (int i = 0; i < 20; i++)
        zeros += hv[i] == 0;
    assert_true(zeros > 0 && zeros < 20);
    ag_scope_end();
    ag_graph_free(g);
}

static void test_run_backward(void **st) {
    (void)st;
    ag_graph *g = build_mlp();
    ag_scope_begin();
    ag_tensor *a[5], *b[5];
    mlp_inputs(a, true);
    mlp_inputs(b, true);
    ag_tensor *outs[2];
    assert_int_equal(ag_graph_run(g, a, 5, outs, 2), 2);
    assert_true(ag_tensor_requires_grad(outs[0]));
    assert_int_equal(ag_backward(ag_sum_all(ag_mul(outs[0], outs[0])), NULL, false), 0);
    ag_tensor *y = ag_linear(ag_relu(ag_linear(b[0], b[1], b[2])), b[3], b[4]);
    assert_int_equal(ag_backward(ag_sum_all(ag_mul(y, y)), NULL, false), 0);
    for (int i = 1; i < 5; i++) {
        ag_tensor *ga = ag_tensor_grad(a[i]), *gb = ag_tensor_grad(b[i]);
        assert_non_null(ga);
        assert_non_null(gb);
        assert_true(tu_max_abs_diff(ga, gb) < 1e-5);
        assert_true(tu_max_abs_diff(gb, ag_zeros_like(gb)) > 1e-3);
    }
    assert_null(ag_tensor_grad(a[0])); /* x did not require grad */
    ag_scope_end();
    ag_graph_free(g);
}

static void test_run_multi_output_and_constants(void **st) {
    (void)st;
    ag_graph *g = ag_graph_new();
    ag_node *x = tu_ph(g, "x", TM(AG_F64, 2, 4));
    ag_tensor *wv = tu_tensor(AG_F64, 1, (int64_t[]){4}, (double[]){1, 2, 3, 4});
    ag_node *w = ag_graph_get_attr(g, wv, NULL);
    ag_node *ln = CALL(g, "native_layer_norm", AG_GA_N(x), AG_GA_INTS(((int64_t[]){4}), 1),
                       AG_GA_N(w), AG_GA_NIL, AG_GA_F(1e-5));
    ag_node *g0 = ag_graph_getitem(g, ln, 0, NULL);
    ag_node *g2 = ag_graph_getitem(g, ln, 2, NULL);
    ag_node *sp = CALL(g, "split.Tensor", AG_GA_N(g0), AG_GA_I(3), AG_GA_I(1));
    ag_node *p0 = ag_graph_getitem(g, sp, 0, NULL);
    ag_node *p1 = ag_graph_getitem(g, sp, 1, NULL);
    ag_node *cat = CALL(g, "cat", AG_GA_NODES(((ag_node *[]){p1, p0}), 2), AG_GA_I(1));
    ag_graph_output(g, (ag_node *[]){cat, NULL, g2, x}, 4);
    expect_verify_ok(g);

    ag_scope_begin();
    ag_tensor *xin = tu_tensor(AG_F64, 2, (int64_t[]){2, 4}, (double[]){1, 2, 3, 4, 0, 0, 2, 2});
    ag_tensor *outs[4];
    assert_int_equal(ag_graph_run(g, &xin, 1, outs, 4), 4);
    ag_tensor *eo, *em, *er;
    assert_int_equal(ag_native_layer_norm(xin, 1, (int64_t[]){4}, wv, NULL, 1e-5, &eo, &em, &er),
                     0);
    ag_tensor *parts[2];
    assert_int_equal(ag_split(eo, 3, 1, parts, 2), 2);
    ag_tensor *ecat = ag_cat((ag_tensor *[]){parts[1], parts[0]}, 2, 1);
    tu_assert_shape(outs[0], 2, (int64_t[]){2, 4});
    assert_true(tu_max_abs_diff(outs[0], ecat) < 1e-12);
    assert_null(outs[1]);
    assert_true(tu_max_abs_diff(outs[2], er) < 1e-12);
    assert_ptr_equal(outs[3], xin); /* an input passed through is the same tensor */
    ag_scope_end();
    ag_tensor_free(wv);
    ag_graph_free(g);
}

static void test_run_errors(void **st) {
    (void)st;
    ag_graph *g = build_mlp();
    ag_scope_begin();
    ag_tensor *in[5];
    mlp_inputs(in, false);
    ag_tensor *outs[2] = {0};
    assert_int_equal(ag_graph_run(g, in, 4, outs, 2), AG_EINVAL);
    tu_assert_error_contains("run: graph has 5 placeholders, 4 inputs given");
    ag_tensor *bad = in[1];
    in[1] = ag_zeros(AG_F32, 2, (int64_t[]){5, 4});
    assert_int_equal(ag_graph_run(g, in, 5, outs, 2), AG_EINVAL);
    tu_assert_error_contains(
        "run: input 1 (%w1) is f32[5, 4] but the placeholder expects f32[5, 3]");
    in[1] = ag_zeros(AG_F64, 2, (int64_t[]){5, 3});
    assert_int_equal(ag_graph_run(g, in, 5, outs, 2), AG_EINVAL);
    tu_assert_error_contains(
        "run: input 1 (%w1) is f64[5, 3] but the placeholder expects f32[5, 3]");
    in[1] = NULL;
    assert_int_equal(ag_graph_run(g, in, 5, outs, 2), AG_EINVAL);
    tu_assert_error_contains("run: input 1 (%w1) is NULL");
    in[1] = bad;
    assert_int_equal(ag_graph_run(g, in, 5, outs, 1), AG_EINVAL);
    tu_assert_error_contains("run: the graph has 2 outputs, room for 1 given");
    assert_null(outs[0]);
    ag_scope_end();
    ag_graph_free(g);

    /* An op failing on the data names the node. */
    g = ag_graph_new();
    ag_node *wt = tu_ph(g, "weight", TM(AG_F32, 5, 3));
    ag_node *ix = tu_ph(g, "idx", TM(AG_I64, 2));
    out1(g, CALL(g, "embedding", AG_GA_N(wt), AG_GA_N(ix)));
    ag_scope_begin();
    ag_tensor *ins[2] = {ag_zeros(AG_F32, 2, (int64_t[]){5, 3}),
                         ag_from_data(AG_I64, 1, (int64_t[]){2}, (int64_t[]){1, 7})};
    assert_int_equal(ag_graph_run(g, ins, 2, outs, 1), AG_EINVAL);
    tu_assert_error_contains("run: %embedding: embedding: index 7");
    /* No output node. */
    ag_graph *h = ag_graph_new();
    tu_ph(h, "x", TM(AG_F32, 1));
    assert_int_equal(ag_graph_run(h, ins, 1, outs, 1), AG_EINVAL);
    tu_assert_error_contains("run: the graph has no output node");
    ag_graph_free(h);
    ag_scope_end();
    ag_graph_free(g);
}

/* A live-allocation counter (allocations, not bytes) with a high-water mark. */
static struct {
    ag_allocator prev;
    _Atomic int64_t live, peak;
} lc;

static void *lc_alloc(void *ud, size_t size, size_t align) {
    (void)ud;
    void *p = lc.prev.alloc(lc.prev.ud, size, align);
    if (p) {
        int64_t now = atomic_fetch_add(&lc.live, 1) + 1, pk = atomic_load(&lc.peak);
        while (now > pk && !atomic_compare_exchange_weak(&lc.peak, &pk, now))
            ;
    }
    return p;
}

static void lc_free(void *ud, void *p) {
    (void)ud;
    if (p)
        atomic_fetch_sub(&lc.live, 1);
    lc.prev.free(lc.prev.ud, p);
}

static void test_run_frees_early(void **st) {
    (void)st;
    /* A chain of 60 negations of a [256, 256] tensor: every intermediate dies at the next
     * node, so the run holds a handful of tensors at any time, not 60. */
    enum { N = 60 };
    ag_graph *g = ag_graph_new();
    ag_node *n = tu_ph(g, "x", TM(AG_F32, 256, 256));
    ag_node *x = n;
    for (int i = 0; i < N; i++)
        n = CALL(g, "neg", AG_GA_N(n));
    ag_node *last = CALL(g, "add.Tensor", AG_GA_N(n), AG_GA_N(x));
    out1(g, last);
    ag_tensor *in = ag_ones(AG_F32, 2, (int64_t[]){256, 256});
    ag_tensor *out = NULL;
    /* Warm up the op table and scope stack before counting. */
    assert_int_equal(ag_graph_run(g, &in, 1, &out, 1), 1);
    ag_tensor_free(out);

    lc.prev = ag_get_allocator();
    atomic_store(&lc.live, 0);
    atomic_store(&lc.peak, 0);
    ag_set_allocator(&(ag_allocator){lc_alloc, lc_free, NULL});
    int rc = ag_graph_run(g, &in, 1, &out, 1);
    int64_t peak = atomic_load(&lc.peak), live = atomic_load(&lc.live);
    ag_set_allocator(&lc.prev);
    assert_int_equal(rc, 1);
    /* The run's own arrays, a few tensors (each a struct, a storage and its data), the
     * output. Holding every intermediate would take over 3 * 60. */
    if (peak > 30)
        fail_msg("peak live allocations %lld", (long long)peak);
    /* Sixty negations and x added back: 2 everywhere. */
    assert_true(ag_tensor_item_at(out, 0) == 2.0);
    assert_true(ag_tensor_item_at(out, 256 * 256 - 1) == 2.0);
    ag_tensor_free(out);
    /* What remains live is the output alone (its struct, storage and data). */
    assert_true(live <= 3);
    ag_tensor_free(in);
    ag_graph_free(g);
}

static void test_run_scopes(void **st) {
    (void)st;
    ag_graph *g = build_mlp();
    ag_tensor *in[5];
    mlp_inputs(in, false);
    /* Outside a scope the outputs are the caller's references... */
    ag_tensor *outs[2];
    assert_int_equal(ag_graph_run(g, in, 5, outs, 2), 2);
    ag_tensor_free(outs[0]);
    ag_tensor_free(outs[1]);
    /* ...inside one they belong to the scope (freeing them again would be a double free
     * that ASan reports; the scope's end releases them). */
    ag_scope_begin();
    assert_int_equal(ag_graph_run(g, in, 5, outs, 2), 2);
    assert_true(ag_tensor_numel(outs[0]) == 8);
    ag_scope_end();
    for (int i = 0; i < 5; i++)
        ag_tensor_free(in[i]);
    ag_graph_free(g);
}

static void test_run_effect_and_dead_code(void **st) {
    (void)st;
    ag_graph *g = ag_graph_new();
    ag_node *x = tu_ph(g, "x", TM(AG_F32, 3));
    ag_graph_call(g, effect_op(), GARGS(AG_GA_N(x)), NULL); /* unused, still runs */
    CALL(g, "exp", AG_GA_N(x));                             /* dead, runs harmlessly */
    ag_node *r = CALL(g, "mul.Tensor", AG_GA_N(x), AG_GA_N(x));
    out1(g, r);
    ag_scope_begin();
    ag_tensor *in = tu_tensor(AG_F32, 1, (int64_t[]){3}, (double[]){1, -2, 3});
    ag_tensor *o;
    int before = effect_runs;
    assert_int_equal(ag_graph_run(g, &in, 1, &o, 1), 1);
    assert_int_equal(effect_runs, before + 1);
    tu_assert_values(o, 1, (int64_t[]){3}, (double[]){1, 4, 9}, 0);
    ag_scope_end();
    ag_graph_free(g);
}

/* ==== allocation failures ==== */

static int passes_scenario(void *ud) {
    (void)ud;
    int rc = 0;
    ag_graph *g = ag_graph_new(), *c = NULL;
    if (!g)
        return ag_last_status();
    ag_tmeta xm = TM(AG_F32, 4, 3), wm = TM(AG_F32, 2, 3), bm = TM(AG_F32, 2);
    ag_node *x = ag_graph_placeholder(g, "x", &xm);
    ag_node *w = x ? ag_graph_placeholder(g, "w", &wm) : NULL;
    ag_node *b = w ? ag_graph_placeholder(g, "b", &bm) : NULL;
    const ag_op *t_op = ag_op_find("t"), *mm_op = ag_op_find("addmm"), *r_op = ag_op_find("relu");
    ag_node *t1 = b ? ag_graph_call(g, t_op, (ag_garg[]){AG_GA_N(w)}, 1, NULL) : NULL;
    ag_node *t2 = t1 ? ag_graph_call(g, t_op, (ag_garg[]){AG_GA_N(w)}, 1, NULL) : NULL;
    ag_node *m1 =
        t2 ? ag_graph_call(g, mm_op, (ag_garg[]){AG_GA_N(b), AG_GA_N(x), AG_GA_N(t1)}, 3, NULL)
           : NULL;
    ag_node *m2 =
        m1 ? ag_graph_call(g, mm_op, (ag_garg[]){AG_GA_N(b), AG_GA_N(x), AG_GA_N(t2)}, 3, NULL)
           : NULL;
    ag_node *dead = m2 ? ag_graph_call(g, r_op, (ag_garg[]){AG_GA_N(m1)}, 1, NULL) : NULL;
    ag_node *o = dead ? ag_graph_output(g, (ag_node *[]){m1, m2}, 2) : NULL;
    if (!o) {
        rc = ag_last_status();
        goto done;
    }
    if ((rc = ag_graph_verify(g)) < 0)
        goto done;
    if ((c = ag_graph_copy(g)) == NULL) {
        rc = ag_last_status();
        goto done;
    }
    if ((rc = ag_graph_cse(c)) < 0 || (rc = ag_graph_dce(c)) < 0)
        goto done;
    if ((rc = ag_graph_reinfer_meta(c)) < 0 || (rc = ag_graph_verify(c)) < 0)
        goto done;
    ag_tensor *in[3] = {ag_ones(AG_F32, 2, xm.sizes), ag_ones(AG_F32, 2, wm.sizes),
                        ag_ones(AG_F32, 1, bm.sizes)};
    ag_tensor *outs[2] = {0};
    if (in[0] && in[1] && in[2]) {
        rc = ag_graph_run(c, in, 3, outs, 2);
        if (rc >= 0)
            rc = (outs[0] == outs[1] && outs[0]) ? 0 : AG_EINVAL; /* CSE merged them */
    } else {
        rc = ag_last_status();
    }
    for (int i = 0; i < 3; i++)
        ag_tensor_free(in[i]);
    ag_tensor_free(outs[0]);
    ag_tensor_free(outs[1]);
done:
    ag_graph_free(c);
    ag_graph_free(g);
    return rc < 0 ? rc : 0;
}

static void test_alloc_failures(void **st) {
    (void)st;
    effect_op();
    assert_int_equal(passes_scenario(NULL), 0);
    int64_t points = tu_alloc_failure_sweep(
        passes_scenario, NULL,
        &(tu_sweep_opts){.what = "graph passes and run", .one_thread = true});
    assert_true(points > 20);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fx_names),
        cmocka_unit_test(test_call_args_and_vals),
        cmocka_unit_test(test_users_bookkeeping),
        cmocka_unit_test(test_insertion_points_and_move),
        cmocka_unit_test(test_copy),
        cmocka_unit_test(test_metadata),
        cmocka_unit_test(test_descs),
        cmocka_unit_test(test_verify_accepts),
        cmocka_unit_test(test_verify_use_before_def),
        cmocka_unit_test(test_verify_wrong_meta),
        cmocka_unit_test(test_verify_users),
        cmocka_unit_test(test_verify_wide_users),
        cmocka_unit_test(test_verify_structure),
        cmocka_unit_test(test_dce),
        cmocka_unit_test(test_cse),
        cmocka_unit_test(test_reinfer_meta),
        cmocka_unit_test(test_run_mlp),
        cmocka_unit_test(test_run_backward),
        cmocka_unit_test(test_run_multi_output_and_constants),
        cmocka_unit_test(test_run_errors),
        cmocka_unit_test(test_run_frees_early),
        cmocka_unit_test(test_run_scopes),
        cmocka_unit_test(test_run_effect_and_dead_code),
        cmocka_unit_test(test_alloc_failures),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
