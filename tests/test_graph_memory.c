/* The memory layout behind the graph IR and the pipeline's lookup tables, checked against plain
 * references: the pointer map (src/core/ptrmap.c) and the string map with stored hashes
 * (src/core/strmap.c) against arrays under random operations; graph nodes carved from blocks
 * and reused after erase (names, users, placeholder order); metadata entries inline and on the
 * heap, with interned keys and values; metadata strings in pools shared by graph copies that
 * outlive the graph they were copied from (run under ASan to catch a pool freed too early);
 * module stacks stored once per graph and distinct stack, in the nodes' inline entries;
 * arguments inline and on the heap; DCE in one sweep, and again when a graph uses a node
 * before its definition. */
#include "testutil.h"
#include "core/ptrmap.h"
#include "core/strmap.h"
#include "graph/graph_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CALL(g, op, ...) tu_call(g, op, GARGS(__VA_ARGS__), NULL)

static void expect_verify_ok(const ag_graph *g) {
    if (ag_graph_verify(g))
        fail_msg("verify: %s", ag_last_error());
}

/* ---- the pointer map ---- */

static void test_ptrmap_matches_array(void **st) {
    (void)st;
    enum { N = 5000 };
    static char objs[N];   /* the keys: addresses of these bytes */
    static int64_t ref[N]; /* the reference: value per key, -1 when absent */
    for (int i = 0; i < N; i++)
        ref[i] = -1;
    ag__ptrmap m = {0};
    assert_false(ag__ptrmap_has(&m, &objs[0]));
    assert_int_equal(ag__ptrmap_get(&m, &objs[0], -7), -7);
    uint64_t rs = 3;
    for (int op = 0; op < 40000; op++) {
        int k = (int)(tu_xorshift_next(&rs) % N);
        if (tu_xorshift_next(&rs) % 3) {
            int64_t v = (int64_t)(tu_xorshift_next(&rs) % 1000);
            assert_int_equal(ag__ptrmap_put(&m, &objs[k], v), 0);
            ref[k] = v;
        } else {
            assert_int_equal(ag__ptrmap_has(&m, &objs[k]), ref[k] >= 0);
            assert_int_equal(ag__ptrmap_get(&m, &objs[k], -1), ref[k]);
        }
    }
    int64_t live = 0;
    for (int i = 0; i < N; i++) {
        live += ref[i] >= 0;
        assert_int_equal(ag__ptrmap_get(&m, &objs[i], -1), ref[i]);
    }
    assert_int_equal(m.len, live);
    assert_true(m.cap >= 2 * m.len); /* at most half full */
    ag__ptrmap_free(&m);
    /* reserve: no rebuild while filling up to the reserved count */
    assert_int_equal(ag__ptrmap_reserve(&m, 1000), 0);
    const ag__ptrslot *slots = m.slots;
    for (int i = 0; i < 1000; i++)
        assert_int_equal(ag__ptrmap_put(&m, &objs[i], i), 0);
    assert_ptr_equal(m.slots, slots);
    ag__ptrmap_free(&m);
}

/* ---- the string map ---- */

static void test_strmap_matches_array(void **st) {
    (void)st;
    enum { N = 3000 };
    static char names[N][16];
    static int ref[N]; /* 1 + value, 0 when absent */
    for (int i = 0; i < N; i++) {
        snprintf(names[i], sizeof names[i], "add_%d", i); /* shared prefixes, as node names */
        ref[i] = 0;
    }
    ag__strmap m = {0};
    uint64_t rs = 11;
    char probe[16];
    for (int op = 0; op < 60000; op++) {
        int k = (int)(tu_xorshift_next(&rs) % N);
        uint64_t what = tu_xorshift_next(&rs) % 4;
        if (what == 0) {
            assert_int_equal(ag__strmap_put(&m, names[k], (void *)(intptr_t)(op + 1)), 0);
            ref[k] = op + 1;
        } else if (what == 1) {
            ag__strmap_del(&m, names[k]); /* tombstones */
            ref[k] = 0;
        } else {
            memcpy(probe, names[k], sizeof probe); /* equal text at another address */
            assert_int_equal(ag__strmap_has(&m, probe), ref[k] != 0);
            assert_int_equal((intptr_t)ag__strmap_get(&m, probe), ref[k]);
        }
    }
    int64_t live = 0;
    for (int i = 0; i < N; i++) {
        live += ref[i] != 0;
        assert_int_equal((intptr_t)ag__strmap_get(&m, names[i]), ref[i]);
    }
    assert_int_equal(m.len, live);
    assert_int_equal(ag__strmap_reserve(&m, 4 * N), 0); /* a rebuild keeps every entry */
    for (int i = 0; i < N; i++)
        assert_int_equal((intptr_t)ag__strmap_get(&m, names[i]), ref[i]);
    assert_null(ag__strmap_get(&m, "absent"));
    ag__strmap_free(&m);
}

/* ---- nodes from blocks ---- */

/* Erased nodes are reused: names stay unique, users lists and the placeholder list stay
 * right, and the graph verifies after every round. */
static void test_node_reuse(void **st) {
    (void)st;
    ag_graph *g = ag_graph_new();
    ag_node *x = tu_ph(g, "x", TM(AG_F32, 4));
    ag_node *keep = CALL(g, "relu", AG_GA_N(x));
    ag_node *o = ag_graph_output(g, (ag_node *[]){keep}, 1);
    assert_non_null(o);
    for (int round = 0; round < 50; round++) {
        ag_node *made[20];
        for (int i = 0; i < 20; i++)
            made[i] = CALL(g, i % 2 ? "neg" : "exp", AG_GA_N(i ? made[i - 1] : x));
        assert_int_equal(ag_node_num_users(x), 2);
        expect_verify_ok(g);
        for (int i = 19; i >= 0; i--)
            assert_int_equal(ag_graph_erase(g, made[i]), 0);
        assert_int_equal(ag_node_num_users(x), 1);
        assert_int_equal(ag_graph_num_nodes(g), 3);
        expect_verify_ok(g);
    }
    /* FX names: a free base name is taken again, then the base's counter continues */
    ag_node *e = CALL(g, "exp", AG_GA_N(x));
    assert_string_equal(ag_node_name(e), "exp");
    ag_node *e2 = CALL(g, "exp", AG_GA_N(x));
    assert_string_equal(ag_node_name(e2), "exp_451"); /* 9 more per round after the first */
    assert_int_equal(ag_graph_erase(g, e2), 0);
    /* placeholders added later go after the first; moving one behind a call is still found */
    ag_node *y = tu_ph(g, "y", TM(AG_F32, 4));
    ag_node *z = tu_ph(g, "z", TM(AG_F32, 4));
    ag_node **ph;
    assert_int_equal(ag_graph_placeholders(g, &ph), 3);
    assert_ptr_equal(ph[0], x);
    assert_ptr_equal(ph[1], y);
    assert_ptr_equal(ph[2], z);
    assert_int_equal(ag_graph_move_after(g, y, e), 0);
    assert_int_equal(ag_graph_placeholders(g, &ph), 3);
    assert_ptr_equal(ph[0], x);
    assert_ptr_equal(ph[1], z);
    assert_ptr_equal(ph[2], y);
    assert_int_equal(ag_graph_erase(g, z), 0);
    assert_int_equal(ag_graph_placeholders(g, &ph), 2);
    assert_ptr_equal(ph[1], y);
    ag_graph_free(g);
}

/* ---- metadata ---- */

static void test_meta_inline_and_heap(void **st) {
    (void)st;
    ag_graph *g = ag_graph_new();
    ag_node *x = tu_ph(g, "x", TM(AG_F32, 4));
    ag_node *r = CALL(g, "relu", AG_GA_N(x));
    /* well-known keys given as strings of our own (not the library's pointers) */
    char key[32], val[32];
    strcpy(key, "partitioner_tag");
    strcpy(val, "is_backward");
    assert_int_equal(ag_node_meta_set(r, key, (ag_mval){.kind = AG_MV_STR, .u.s = val}), 0);
    val[0] = 'X'; /* the node keeps its own value */
    assert_string_equal(ag_node_partitioner_tag(r), "is_backward");
    assert_int_equal(ag_node_set_seq_nr(r, 7), 0);
    assert_int_equal(ag_node_set_stack_trace(r, "File \"m.c\", line 3, in f"), 0);
    assert_int_equal(ag_node_set_recompute(r, AG_PREFER_RECOMPUTE), 0);
    /* more entries than the node holds inline */
    for (int i = 0; i < 6; i++) {
        snprintf(key, sizeof key, "k%d", i);
        snprintf(val, sizeof val, "v%d", i);
        assert_int_equal(ag_node_meta_set(r, key, (ag_mval){.kind = AG_MV_STR, .u.s = val}), 0);
    }
    assert_int_equal(ag_node_meta_count(r), 10);
    assert_int_equal(ag_node_set_gradient_acc(r, true), 0);
    assert_int_equal(ag_node_meta_del(r, "k2"), 1);
    assert_int_equal(ag_node_set_seq_nr(r, 9), 0); /* replaces in place */
    ag_mval v;
    const char *order[] = {
        "partitioner_tag", "seq_nr", "stack_trace", "recompute", "k0", "k1", "k3", "k4", "k5",
        "is_gradient_acc"};
    assert_int_equal(ag_node_meta_count(r), 10);
    for (int i = 0; i < 10; i++)
        assert_string_equal(ag_node_meta_key_at(r, i, &v), order[i]);
    assert_string_equal(ag_node_meta_get(r, "k5").u.s, "v5");
    assert_int_equal(ag_node_meta_get(r, "k2").kind, AG_MV_NONE);
    assert_int_equal(ag_node_seq_nr(r), 9);
    assert_int_equal(ag_node_recompute(r), AG_PREFER_RECOMPUTE);
    assert_true(ag_node_is_gradient_acc(r));
    strcpy(key, "stack_trace");
    assert_string_equal(ag_node_meta_get(r, key).u.s, "File \"m.c\", line 3, in f");
    ag_graph_free(g);
}

/* Copies share their strings with the graph they come from and keep them after it is freed;
 * a chain of copies (graph -> copy -> node copies in a third graph) too. */
static void test_meta_strings_outlive_source(void **st) {
    (void)st;
    ag_graph *g = ag_graph_new();
    ag_node *x = tu_ph(g, "x", TM(AG_F32, 4));
    ag_node *prev = x;
    char trace[128], ann[32];
    for (int i = 0; i < 300; i++) { /* enough text for several pool chunks */
        prev = CALL(g, "neg", AG_GA_N(prev));
        snprintf(trace, sizeof trace, "File \"model.c\", line %d, in forward%060d", i, i);
        assert_int_equal(ag_node_set_stack_trace(prev, trace), 0);
        snprintf(ann, sizeof ann, "stage%d", i % 3);
        assert_int_equal(ag_node_custom_set(prev, "pp", (ag_mval){.kind = AG_MV_STR, .u.s = ann}),
                         0);
    }
    assert_non_null(ag_graph_output(g, (ag_node *[]){prev}, 1));
    ag_graph *h = ag_graph_copy(g);
    assert_non_null(h);
    ag_graph_free(g);
    expect_verify_ok(h);
    /* node copies into a third graph, then the copy goes too */
    ag_graph *k = ag_graph_new();
    ag_node *kx = tu_ph(k, "x", TM(AG_F32, 4));
    ag_node *kn = CALL(k, "neg", AG_GA_N(kx));
    ag_node *src = ag_graph_find(h, "neg_150");
    assert_non_null(src);
    assert_int_equal(ag__node_meta_copy(kn, src), 0);
    assert_int_equal(ag_node_custom_copy(kn, src), 0);
    ag_node *src2 = ag_graph_find(h, "neg_151");
    assert_int_equal(ag__node_meta_copy_key(kx, src2, "stack_trace"), 0);
    int i = 0;
    for (ag_node *n = ag_graph_first(h); n; n = ag_node_next(n)) {
        if (ag_node_kind_of(n) != AG_NODE_CALL)
            continue;
        snprintf(trace, sizeof trace, "File \"model.c\", line %d, in forward%060d", i, i);
        assert_string_equal(ag_node_stack_trace(n), trace);
        snprintf(ann, sizeof ann, "stage%d", i % 3);
        assert_string_equal(ag_node_custom_get(n, "pp").u.s, ann);
        i++;
    }
    assert_int_equal(i, 300);
    ag_graph_free(h);
    snprintf(trace, sizeof trace, "File \"model.c\", line %d, in forward%060d", 150, 150);
    assert_string_equal(ag_node_stack_trace(kn), trace);
    assert_string_equal(ag_node_custom_get(kn, "pp").u.s, "stage0");
    snprintf(trace, sizeof trace, "File \"model.c\", line %d, in forward%060d", 151, 151);
    assert_string_equal(ag_node_stack_trace(kx), trace);
    /* copying a key the source lacks removes it */
    assert_int_equal(ag__node_meta_copy_key(kx, kn, "seq_nr"), 0);
    assert_int_equal(ag_node_seq_nr(kx), -1);
    ag_graph_free(k);
}

/* Module stacks cost a node one inline metadata entry, not a copy of the text: in GPT-2's
 * joint no node's metadata leaves its inline array, every distinct stack is stored once
 * (nodes with equal texts point at one string), there are far fewer texts than nodes, and a
 * copy of the graph points at the same strings. */
static void test_module_stacks_shared(void **st) {
    (void)st;
    ag_module *m;
    ag_tensor *in[4];
    int nin;
    assert_int_equal(ag_zoo_build("gpt2", NULL, &m, in, 4, &nin), 0);
    ag_joint *j = ag_export_joint(m, in, nin, NULL, NULL, 0, NULL);
    assert_non_null(j);
    const ag_graph *g = ag_joint_graph(j);
    enum { MAXT = 256 };
    const char *texts[MAXT];
    int ntexts = 0, with = 0, nodes = 0;
    for (ag_node *n = ag_graph_first(g); n; n = ag_node_next(n)) {
        nodes++;
        if (n->nmeta > 0 && n->meta != n->meta_inline)
            fail_msg("%s: %d metadata entries on the heap", ag_node_name(n), n->nmeta);
        for (int k = 0; k < 2; k++) {
            ag_mval v = ag_node_meta_get(n, k ? "fwd_nn_module_stack" : "nn_module_stack");
            if (v.kind != AG_MV_STR)
                continue;
            with++;
            int i = 0;
            while (i < ntexts && strcmp(texts[i], v.u.s))
                i++;
            if (i == ntexts) {
                assert_true(ntexts < MAXT);
                texts[ntexts++] = v.u.s;
            } else if (texts[i] != v.u.s) {
                fail_msg("%s: a second copy of %s", ag_node_name(n), v.u.s);
            }
        }
    }
    assert_true(with > nodes / 2);
    assert_true(ntexts > 10 && ntexts < nodes / 8);
    ag_graph *c = ag_graph_copy(g);
    assert_non_null(c);
    for (ag_node *n = ag_graph_first(g), *k = ag_graph_first(c); n;
         n = ag_node_next(n), k = ag_node_next(k)) {
        assert_ptr_equal(ag_node_meta_get(k, "nn_module_stack").u.s,
                         ag_node_meta_get(n, "nn_module_stack").u.s);
        assert_ptr_equal(ag_node_meta_get(k, "fwd_nn_module_stack").u.s,
                         ag_node_meta_get(n, "fwd_nn_module_stack").u.s);
    }
    ag_joint_free(j); /* the copy keeps the strings alive (ASan checks) */
    for (ag_node *n = ag_graph_first(c); n; n = ag_node_next(n))
        if (ag_node_nn_module_stack_len(n) > 0)
            assert_true(strlen(ag_node_meta_get(n, "nn_module_stack").u.s) > 20);
    ag_graph_free(c);
    for (int i = 0; i < nin; i++)
        ag_tensor_free(in[i]);
    ag_module_free(m);
}

/* ---- arguments ---- */

/* A call with more arguments than a node holds inline, copied and extended. */
static void test_args_inline_and_heap(void **st) {
    (void)st;
    ag_graph *g = ag_graph_new();
    ag_node *x = tu_ph(g, "x", TM(AG_F32, 2, 3, 4));
    ag_node *w = tu_ph(g, "w", TM(AG_F32, 4));
    ag_node *b = tu_ph(g, "b", TM(AG_F32, 4));
    ag_node *ln = CALL(g, "native_layer_norm", AG_GA_N(x), AG_GA_INTS(((int64_t[]){4}), 1),
                       AG_GA_N(w), AG_GA_N(b), AG_GA_F(1e-5));
    ag_node *mean = ag_graph_getitem(g, ln, 1, NULL);
    ag_node *rstd = ag_graph_getitem(g, ln, 2, NULL);
    ag_node *y = ag_graph_getitem(g, ln, 0, NULL);
    ag_node *bw = CALL(g, "native_layer_norm_backward", AG_GA_N(y), AG_GA_N(x),
                       AG_GA_INTS(((int64_t[]){4}), 1), AG_GA_N(mean), AG_GA_N(rstd), AG_GA_N(w),
                       AG_GA_N(b), AG_GA_INTS(((int64_t[]){1, 1, 1}), 3));
    assert_int_equal(ag_node_nargs(bw), 8);
    ag_node *gx = ag_graph_getitem(g, bw, 0, NULL);
    assert_non_null(ag_graph_output(g, (ag_node *[]){gx}, 1));
    expect_verify_ok(g);
    char *before = ag_graph_to_string(g, NULL);
    ag_graph *h = ag_graph_copy(g);
    assert_non_null(h);
    expect_verify_ok(h);
    char *after = ag_graph_to_string(h, NULL);
    assert_string_equal(before, after);
    ag_free(before);
    ag_free(after);
    /* a relu's single argument replaced and then a node list appended past the inline room */
    ag_node *r = CALL(g, "relu", AG_GA_N(x));
    for (int i = 1; i < 9; i++)
        assert_int_equal(ag_node_set_arg(r, i, AG_GA_I(i)), 0);
    assert_int_equal(ag_node_nargs(r), 9);
    assert_int_equal(ag_node_set_arg(r, 9, AG_GA_NODES(((ag_node *[]){w, b, w}), 3)), 0);
    assert_int_equal(ag_node_num_users(w), 3); /* ln, bw, r (twice) */
    for (int i = 1; i < 9; i++)
        assert_int_equal(ag_node_arg(r, i)->u.i, i);
    ag_graph_free(h);
    ag_graph_free(g);
}

/* ---- DCE ---- */

static void test_dce_chains(void **st) {
    (void)st;
    /* a dead chain off a live value, removed in one call */
    ag_graph *g = ag_graph_new();
    ag_node *x = tu_ph(g, "x", TM(AG_F32, 4));
    ag_node *live = CALL(g, "relu", AG_GA_N(x));
    ag_node *d = live;
    for (int i = 0; i < 10; i++)
        d = CALL(g, "neg", AG_GA_N(d));
    ag_node *cat = CALL(g, "cat", AG_GA_NODES(((ag_node *[]){d, d, x}), 3));
    (void)cat;
    assert_non_null(ag_graph_output(g, (ag_node *[]){live}, 1));
    assert_int_equal(ag_graph_dce(g), 11);
    assert_int_equal(ag_graph_num_nodes(g), 3);
    expect_verify_ok(g);
    ag_graph_free(g);
    /* a graph that uses nodes before their definitions (moved by hand): every dead node goes */
    g = ag_graph_new();
    x = tu_ph(g, "x", TM(AG_F32, 4));
    ag_node *a = CALL(g, "neg", AG_GA_N(x));
    ag_node *b = CALL(g, "exp", AG_GA_N(a));
    ag_node *c = CALL(g, "cat", AG_GA_NODES(((ag_node *[]){b, a}), 2));
    ag_node *o = ag_graph_output(g, (ag_node *[]){x}, 1);
    assert_non_null(o);
    assert_int_equal(ag_graph_move_before(g, c, a), 0); /* c, then a, b */
    assert_int_equal(ag_graph_move_before(g, b, a), 0); /* c, b, a */
    assert_int_equal(ag_graph_dce(g), 3);
    assert_int_equal(ag_graph_num_nodes(g), 2);
    ag_graph_free(g);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_ptrmap_matches_array),
        cmocka_unit_test(test_strmap_matches_array),
        cmocka_unit_test(test_node_reuse),
        cmocka_unit_test(test_meta_inline_and_heap),
        cmocka_unit_test(test_meta_strings_outlive_source),
        cmocka_unit_test(test_module_stacks_shared),
        cmocka_unit_test(test_args_inline_and_heap),
        cmocka_unit_test(test_dce_chains),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
