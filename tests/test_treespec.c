/* Pytree specs and trees (src/export/treespec.c): PyTorch's TreeSpec repr (written out by
 * hand), leaf counts, structural equality, refcounted sharing, flatten in depth-first order
 * with dict insertion order, unflatten and its leaf-count check, argument errors, and the
 * allocation-failure sweep. */
#include "testutil.h"

#include <string.h>

/* ---- helpers ---- */

static const char *repr(const ag_treespec *s) {
    static char buf[1024];
    size_t n = ag_treespec_repr(s, buf, sizeof buf);
    assert_true(n < sizeof buf);
    assert_int_equal(strlen(buf), n);
    return buf;
}

static ag_treespec *leaf(void) {
    ag_treespec *s = ag_treespec_leaf();
    assert_non_null(s);
    return s;
}

/* A list of n leaves (the spec's own references; the children are released here). */
static ag_treespec *leaf_list(int n) {
    ag_treespec *k[8];
    assert_true(n <= 8);
    for (int i = 0; i < n; i++)
        k[i] = leaf();
    ag_treespec *s = ag_treespec_list(k, n);
    assert_non_null(s);
    for (int i = 0; i < n; i++)
        ag_treespec_release(k[i]);
    return s;
}

/* The brief's in_spec example: ([*, *, *], {'scale': *}). */
static ag_treespec *example_spec(void) {
    ag_treespec *l = leaf_list(3), *x = leaf();
    ag_treespec *d = ag_treespec_dict((const char *[]){"scale"}, (ag_treespec *[]){x}, 1);
    assert_non_null(d);
    ag_treespec *t = ag_treespec_tuple((ag_treespec *[]){l, d}, 2);
    assert_non_null(t);
    ag_treespec_release(l);
    ag_treespec_release(x);
    ag_treespec_release(d);
    return t;
}

static ag_tensor *scalar(double v) {
    ag_tensor *t = ag_scalar_tensor(AG_F32, v);
    assert_non_null(t);
    return t;
}

/* ---- specs ---- */

static void test_repr(void **st) {
    (void)st;
    ag_treespec *t = example_spec();
    assert_string_equal(repr(t), "TreeSpec(tuple, None, [TreeSpec(list, None, [*, *, *]), "
                                 "TreeSpec(dict, ['scale'], [*])])");
    assert_int_equal(ag_treespec_num_leaves(t), 4);
    assert_int_equal(ag_treespec_kind(t), AG_TREE_TUPLE);
    assert_int_equal(ag_treespec_num_children(t), 2);
    const ag_treespec *d = ag_treespec_child(t, 1);
    assert_int_equal(ag_treespec_kind(d), AG_TREE_DICT);
    assert_string_equal(ag_treespec_key(d, 0), "scale");
    assert_null(ag_treespec_key(d, 1));
    assert_null(ag_treespec_key(t, 0)); /* not a dict */
    assert_null(ag_treespec_child(t, 2));
    assert_null(ag_treespec_child(t, -1));
    assert_int_equal(ag_treespec_num_leaves(ag_treespec_child(t, 0)), 3);
    ag_treespec_release(t);

    ag_treespec *l = leaf(), *nn = ag_treespec_none();
    assert_string_equal(repr(l), "*");
    assert_string_equal(repr(nn), "TreeSpec(NoneType, None, [])");
    assert_int_equal(ag_treespec_num_leaves(l), 1);
    assert_int_equal(ag_treespec_num_leaves(nn), 0);
    ag_treespec *e = ag_treespec_tuple(NULL, 0), *ed = ag_treespec_dict(NULL, NULL, 0);
    assert_string_equal(repr(e), "TreeSpec(tuple, None, [])");
    assert_string_equal(repr(ed), "TreeSpec(dict, [], [])");
    /* None among leaves counts none; keys print with Python's quoting. */
    ag_treespec *d2 =
        ag_treespec_dict((const char *[]){"it's", "a\\b\n", "w"}, (ag_treespec *[]){nn, l, e}, 3);
    assert_non_null(d2);
    assert_string_equal(repr(d2), "TreeSpec(dict, [\"it's\", 'a\\\\b\\n', 'w'], "
                                  "[TreeSpec(NoneType, None, []), *, TreeSpec(tuple, None, [])])");
    assert_int_equal(ag_treespec_num_leaves(d2), 1);
    ag_treespec_release(d2);
    ag_treespec_release(e);
    ag_treespec_release(ed);
    ag_treespec_release(nn);
    ag_treespec_release(l);
    assert_int_equal(ag_treespec_repr(NULL, NULL, 0), 4); /* "None" */
}

static void test_repr_truncates_like_snprintf(void **st) {
    (void)st;
    ag_treespec *t = leaf_list(2);
    const char *full = "TreeSpec(list, None, [*, *])";
    assert_int_equal(ag_treespec_repr(t, NULL, 0), strlen(full));
    char buf[10];
    memset(buf, 'x', sizeof buf);
    assert_int_equal(ag_treespec_repr(t, buf, sizeof buf), strlen(full));
    assert_string_equal(buf, "TreeSpec(");
    char one[1] = {'x'};
    ag_treespec_repr(t, one, 1);
    assert_int_equal(one[0], 0);
    ag_treespec_release(t);
}

static void test_equal(void **st) {
    (void)st;
    ag_treespec *a = example_spec(), *b = example_spec();
    assert_true(a != b);
    assert_true(ag_treespec_equal(a, b));
    assert_true(ag_treespec_equal(NULL, NULL));
    assert_false(ag_treespec_equal(a, NULL));

    ag_treespec *l2 = leaf_list(2), *l3 = leaf_list(3), *x = leaf(), *nn = ag_treespec_none();
    assert_false(ag_treespec_equal(l2, l3));
    assert_false(ag_treespec_equal(x, nn));
    /* same children, tuple vs list */
    ag_treespec *tu = ag_treespec_tuple((ag_treespec *[]){x, x}, 2);
    assert_false(ag_treespec_equal(tu, l2));
    /* keys matter, and so does their order */
    ag_treespec *d1 = ag_treespec_dict((const char *[]){"a", "b"}, (ag_treespec *[]){x, nn}, 2);
    ag_treespec *d2 = ag_treespec_dict((const char *[]){"a", "c"}, (ag_treespec *[]){x, nn}, 2);
    ag_treespec *d3 = ag_treespec_dict((const char *[]){"b", "a"}, (ag_treespec *[]){nn, x}, 2);
    ag_treespec *d4 = ag_treespec_dict((const char *[]){"a", "b"}, (ag_treespec *[]){x, nn}, 2);
    assert_true(ag_treespec_equal(d1, d4));
    assert_false(ag_treespec_equal(d1, d2));
    assert_false(ag_treespec_equal(d1, d3));
    /* same leaf count and kinds, different nesting */
    ag_treespec *n1 = ag_treespec_tuple((ag_treespec *[]){l2, x}, 2);
    ag_treespec *n2 = ag_treespec_tuple((ag_treespec *[]){x, l2}, 2);
    assert_int_equal(ag_treespec_num_leaves(n1), ag_treespec_num_leaves(n2));
    assert_false(ag_treespec_equal(n1, n2));
    ag_treespec *all[] = {a, b, l2, l3, x, nn, tu, d1, d2, d3, d4, n1, n2};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        ag_treespec_release(all[i]);
}

static void test_sharing(void **st) {
    (void)st;
    /* A child shared by two containers outlives the caller's reference. */
    ag_treespec *l = leaf_list(2);
    ag_treespec *t1 = ag_treespec_tuple((ag_treespec *[]){l, l}, 2);
    ag_treespec *t2 = ag_treespec_list((ag_treespec *[]){l}, 1);
    ag_treespec_release(l);
    assert_int_equal(ag_treespec_num_leaves(t1), 4);
    ag_treespec_release(t1);
    assert_string_equal(repr(t2), "TreeSpec(list, None, [TreeSpec(list, None, [*, *])])");
    ag_treespec *r = ag_treespec_retain(t2);
    assert_ptr_equal(r, t2);
    ag_treespec_release(t2);
    assert_int_equal(ag_treespec_num_leaves(r), 2);
    ag_treespec_release(r);
    ag_treespec_release(NULL);
}

static void test_spec_errors(void **st) {
    (void)st;
    ag_treespec *x = leaf();
    assert_null(ag_treespec_dict((const char *[]){"a", "a"}, (ag_treespec *[]){x, x}, 2));
    tu_assert_error_contains("key 'a' appears twice");
    assert_int_equal(ag_last_status(), AG_EINVAL);
    assert_null(ag_treespec_dict((const char *[]){"a", NULL}, (ag_treespec *[]){x, x}, 2));
    tu_assert_error_contains("key 1 is NULL");
    ag_clear_error(); /* a NULL child keeps a pending error; with none it names the child */
    assert_null(ag_treespec_tuple((ag_treespec *[]){x, NULL}, 2));
    tu_assert_error_contains("child 1 is NULL");
    assert_null(ag_treespec_list(NULL, 3));
    tu_assert_error_contains("ag_treespec_list");
    assert_null(ag_treespec_tuple((ag_treespec *[]){x}, -1));
    tu_assert_error_contains("negative");
    /* x is untouched by the failures */
    assert_string_equal(repr(x), "*");
    ag_treespec_release(x);
}

/* ---- trees ---- */

static void test_flatten_unflatten(void **st) {
    (void)st;
    ag_tensor *a = scalar(1), *b = scalar(2), *c = scalar(3), *d = scalar(4), *e = scalar(5);
    /* ([a, b, c], {'z': d, 'a': None, 'm': (e,)}): dict values in insertion order, not sorted */
    ag_tree *l = ag_tree_list((ag_tree *[]){ag_tree_leaf(a), ag_tree_leaf(b), ag_tree_leaf(c)}, 3);
    ag_tree *inner = ag_tree_tuple((ag_tree *[]){ag_tree_leaf(e)}, 1);
    ag_tree *dict = ag_tree_dict((const char *[]){"z", "a", "m"},
                                 (ag_tree *[]){ag_tree_leaf(d), ag_tree_none(), inner}, 3);
    ag_tree *t = ag_tree_tuple((ag_tree *[]){l, dict}, 2);
    assert_non_null(t);
    /* the tree holds its own references */
    ag_tensor *mine[] = {a, b, c, d, e};
    for (int i = 0; i < 5; i++)
        ag_tensor_free(mine[i]);

    ag_tensor **leaves = NULL;
    ag_treespec *spec = NULL;
    assert_int_equal(ag_tree_flatten(t, &leaves, &spec), 5);
    double want[] = {1, 4, 5}; /* a, d, e */
    ag_tensor *expect[] = {ag_tree_tensor(ag_tree_child(l, 0)), ag_tree_tensor(ag_tree_child(l, 1)),
                           ag_tree_tensor(ag_tree_child(l, 2)),
                           ag_tree_tensor(ag_tree_child(dict, 0)),
                           ag_tree_tensor(ag_tree_child(ag_tree_child(dict, 2), 0))};
    for (int i = 0; i < 5; i++)
        assert_ptr_equal(leaves[i], expect[i]);
    assert_true(ag_tensor_item(leaves[0]) == want[0]);
    assert_true(ag_tensor_item(leaves[3]) == want[1]);
    assert_true(ag_tensor_item(leaves[4]) == want[2]);
    assert_true(ag_tensor_item(leaves[1]) == 2 && ag_tensor_item(leaves[2]) == 3);
    assert_string_equal(repr(spec),
                        "TreeSpec(tuple, None, [TreeSpec(list, None, [*, *, *]), "
                        "TreeSpec(dict, ['z', 'a', 'm'], [*, TreeSpec(NoneType, None, []), "
                        "TreeSpec(tuple, None, [*])])])");
    assert_int_equal(ag_treespec_num_leaves(spec), 5);

    /* unflatten rebuilds the same shape around the given leaves (here reversed) */
    ag_tensor *rev[5];
    for (int i = 0; i < 5; i++)
        rev[i] = leaves[4 - i];
    ag_tree *u = ag_tree_unflatten(spec, rev, 5);
    assert_non_null(u);
    assert_int_equal(ag_tree_kind_of(u), AG_TREE_TUPLE);
    ag_tree *ud = ag_tree_child(u, 1);
    assert_int_equal(ag_tree_kind_of(ud), AG_TREE_DICT);
    assert_string_equal(ag_tree_key(ud, 0), "z");
    assert_string_equal(ag_tree_key(ud, 1), "a");
    assert_string_equal(ag_tree_key(ud, 2), "m");
    assert_null(ag_tree_key(u, 0));
    assert_int_equal(ag_tree_kind_of(ag_tree_child(ud, 1)), AG_TREE_NONE);
    assert_ptr_equal(ag_tree_tensor(ag_tree_child(ag_tree_child(u, 0), 0)), rev[0]);
    assert_ptr_equal(ag_tree_tensor(ag_tree_child(ud, 0)), rev[3]);
    assert_ptr_equal(ag_tree_tensor(ag_tree_child(ag_tree_child(ud, 2), 0)), rev[4]);
    assert_null(ag_tree_tensor(ud));
    /* flatten(unflatten(spec, x)) gives spec and x back */
    ag_tensor **leaves2 = NULL;
    ag_treespec *spec2 = NULL;
    assert_int_equal(ag_tree_flatten(u, &leaves2, &spec2), 5);
    assert_true(ag_treespec_equal(spec, spec2));
    for (int i = 0; i < 5; i++)
        assert_ptr_equal(leaves2[i], rev[i]);

    /* the leaf count is checked, naming both counts */
    assert_null(ag_tree_unflatten(spec, rev, 4));
    tu_assert_error_contains("the spec has 5 leaves but 4 were given");
    assert_null(ag_tree_unflatten(spec, rev, 6));
    tu_assert_error_contains("the spec has 5 leaves but 6 were given");
    rev[2] = NULL;
    assert_null(ag_tree_unflatten(spec, rev, 5));
    tu_assert_error_contains("leaf 2 is NULL");

    ag_free(leaves2);
    ag_treespec_release(spec2);
    ag_tree_free(u); /* u's leaves are t's tensors: freeing u must leave t intact */
    assert_true(ag_tensor_item(ag_tree_tensor(ag_tree_child(l, 0))) == 1);
    ag_free(leaves);
    ag_treespec_release(spec);
    ag_tree_free(t);
}

static void test_flatten_empty_and_leaf(void **st) {
    (void)st;
    ag_tensor **leaves = NULL;
    ag_treespec *spec = NULL;
    ag_tree *nn = ag_tree_none();
    assert_int_equal(ag_tree_flatten(nn, &leaves, &spec), 0);
    assert_string_equal(repr(spec), "TreeSpec(NoneType, None, [])");
    ag_tree *back = ag_tree_unflatten(spec, NULL, 0);
    assert_non_null(back);
    assert_int_equal(ag_tree_kind_of(back), AG_TREE_NONE);
    ag_tree_free(back);
    ag_free(leaves);
    ag_treespec_release(spec);
    ag_tree_free(nn);

    ag_tensor *x = scalar(7);
    ag_tree *l = ag_tree_leaf(x);
    ag_tensor_free(x);
    assert_int_equal(ag_tree_flatten(l, &leaves, &spec), 1);
    assert_string_equal(repr(spec), "*");
    assert_true(ag_tensor_item(leaves[0]) == 7);
    ag_free(leaves);
    ag_treespec_release(spec);
    ag_tree_free(l);
    ag_tree_free(NULL);
}

static void test_tree_errors(void **st) {
    (void)st;
    assert_null(ag_tree_leaf(NULL));
    tu_assert_error_contains("ag_tree_none");
    /* A failing container frees the children it was given (ASan checks nothing leaks). */
    ag_tensor *x = scalar(1);
    assert_null(ag_tree_dict((const char *[]){"k", "k"},
                             (ag_tree *[]){ag_tree_leaf(x), ag_tree_leaf(x)}, 2));
    tu_assert_error_contains("key 'k' appears twice");
    ag_clear_error();
    assert_null(ag_tree_list((ag_tree *[]){ag_tree_leaf(x), NULL}, 2));
    tu_assert_error_contains("child 1 is NULL");
    /* a nested construction whose inner part failed reports the inner failure */
    ag_tree *bad =
        ag_tree_tuple((ag_tree *[]){ag_tree_dict((const char *[]){"k", "k"},
                                                 (ag_tree *[]){ag_tree_leaf(x), ag_tree_none()}, 2),
                                    ag_tree_leaf(x)},
                      2);
    assert_null(bad);
    tu_assert_error_contains("key 'k' appears twice");
    ag_tensor_free(x);
    assert_int_equal(ag_tree_flatten(NULL, NULL, NULL), AG_EINVAL);
    assert_null(ag_tree_unflatten(NULL, NULL, 0));
}

/* ---- allocation failures ---- */

static int oom_scenario(void *ud) {
    (void)ud;
    int rc = 0;
    ag_tensor *x;
    ag_tensor **leaves = NULL;
    ag_treespec *spec = NULL, *l = NULL, *k = NULL, *d = NULL, *t = NULL;
    ag_tree *tree = NULL, *back = NULL;
    tu_alloc_pause();
    x = ag_scalar_tensor(AG_F32, 3);
    tu_alloc_resume();
    /* specs */
    l = ag_treespec_leaf();
    k = l ? ag_treespec_list((ag_treespec *[]){l, l, l}, 3) : NULL;
    d = l ? ag_treespec_dict((const char *[]){"scale", "it's"}, (ag_treespec *[]){l, l}, 2) : NULL;
    t = k && d ? ag_treespec_tuple((ag_treespec *[]){k, d}, 2) : NULL;
    if (!t) {
        rc = ag_last_status();
        goto out;
    }
    char buf[256];
    ag_treespec_repr(t, buf, sizeof buf);
    if (strcmp(buf, "TreeSpec(tuple, None, [TreeSpec(list, None, [*, *, *]), "
                    "TreeSpec(dict, ['scale', \"it's\"], [*, *])])")) {
        rc = -99;
        goto out;
    }
    /* trees */
    tree = ag_tree_tuple(
        (ag_tree *[]){ag_tree_list((ag_tree *[]){ag_tree_leaf(x), ag_tree_none()}, 2),
                      ag_tree_dict((const char *[]){"a", "b"},
                                   (ag_tree *[]){ag_tree_leaf(x), ag_tree_leaf(x)}, 2)},
        2);
    if (!tree) {
        rc = ag_last_status();
        goto out;
    }
    int n = ag_tree_flatten(tree, &leaves, &spec);
    if (n < 0) {
        rc = n;
        goto out;
    }
    back = ag_tree_unflatten(spec, leaves, n);
    if (!back)
        rc = ag_last_status();
out:
    ag_tree_free(back);
    ag_tree_free(tree);
    ag_free(leaves);
    ag_treespec_release(spec);
    ag_treespec_release(t);
    ag_treespec_release(d);
    ag_treespec_release(k);
    ag_treespec_release(l);
    tu_alloc_pause();
    ag_tensor_free(x);
    tu_alloc_resume();
    return rc;
}

static void test_alloc_failures(void **st) {
    (void)st;
    tu_sweep_opts o = {.what = "treespec", .clean_run_frees_all = true};
    oom_scenario(NULL); /* warm up the process-wide tables the tensor factory builds */
    assert_true(tu_alloc_failure_sweep(oom_scenario, NULL, &o) >= 20);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_repr),
        cmocka_unit_test(test_repr_truncates_like_snprintf),
        cmocka_unit_test(test_equal),
        cmocka_unit_test(test_sharing),
        cmocka_unit_test(test_spec_errors),
        cmocka_unit_test(test_flatten_unflatten),
        cmocka_unit_test(test_flatten_empty_and_leaf),
        cmocka_unit_test(test_tree_errors),
        cmocka_unit_test(test_alloc_failures),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
