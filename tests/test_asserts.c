/* The debug-build assertions on internal invariants (docs/ARCHITECTURE.md, "Asserts"). Each
 * test breaks one invariant behind the library's back, as a bug would, inside a forked child,
 * and checks that the child stops on the assert that guards it: killed by SIGABRT, its stderr
 * naming the asserted expression. In a build with NDEBUG (Release) the asserts are compiled
 * out, so the same corruptions run through; the tests check that instead, for the corruptions
 * that stay memory-safe without the check (the other two are built in debug builds only, such
 * as the ASan build of scripts/test.sh). */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/ptrmap.h"
#include "core/strmap.h"
#include "graph/graph_internal.h"
#include "runtime/plan_internal.h"
#include "testutil.h"

#ifdef NDEBUG
enum { ASSERTS_ON = 0 };
#else
enum { ASSERTS_ON = 1 };
#endif

/* How a child ended: the signal that killed it (0: it exited, with `code`) and its stderr. */
typedef struct outcome {
    int sig, code;
    char err[4096];
} outcome;

/* Runs fn(ud) in a child process whose stderr is captured; the child exits 0 when fn returns. */
static outcome run_child(void (*fn)(void *), void *ud) {
    outcome o = {0};
    int fd[2];
    assert_int_equal(pipe(fd), 0);
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        close(fd[0]);
        dup2(fd[1], 2);
        fn(ud);
        _exit(0);
    }
    close(fd[1]);
    size_t len = 0;
    ssize_t r;
    while ((r = read(fd[0], o.err + len, sizeof o.err - 1 - len)) > 0)
        len += (size_t)r;
    close(fd[0]);
    o.err[len] = 0;
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    if (WIFSIGNALED(status))
        o.sig = WTERMSIG(status);
    else
        o.code = WEXITSTATUS(status);
    return o;
}

/* In a debug build: the child was stopped by the assert that `where` names, as glibc reports
 * it ("function: Assertion `expression"). With NDEBUG: the child ran to its end. */
static void expect_assert(const outcome *o, const char *where) {
    if (ASSERTS_ON) {
        if (o->sig != SIGABRT || !strstr(o->err, where))
            print_error("wanted SIGABRT on '%s'; got signal %d, exit %d, stderr:\n%s\n", where,
                        o->sig, o->code, o->err);
        assert_int_equal(o->sig, SIGABRT);
        assert_non_null(strstr(o->err, where));
    } else {
        if (o->sig != 0 || o->code != 0)
            print_error("asserts compiled out, yet signal %d, exit %d, stderr:\n%s\n", o->sig,
                        o->code, o->err);
        assert_int_equal(o->sig, 0);
        assert_int_equal(o->code, 0);
    }
}

/* ---- the graph: users against uses, the node list ---- */

/* x -> y = relu(x) -> output(y) */
typedef struct small_graph {
    ag_graph *g;
    ag_node *x, *y, *out;
} small_graph;

static small_graph small_graph_new(void) {
    small_graph s = {.g = ag_graph_new()};
    assert_non_null(s.g);
    s.x = tu_ph(s.g, "x", TM(AG_F32, 4));
    s.y = tu_call(s.g, "relu", GARGS(AG_GA_N(s.x)), NULL);
    s.out = ag_graph_output(s.g, &s.y, 1);
    assert_non_null(s.out);
    return s;
}

static void erase_with_wrong_use_count(void *ud) {
    small_graph *s = ud;
    ag_graph_erase(s->g, s->out);
    s->x->users[0].count = 2; /* y reads x once, but x's list says twice */
    if (ag_graph_erase(s->g, s->y) != 0)
        _exit(3);
    ag_graph_free(s->g); /* the stale entry of x's list is never followed */
}

static void test_graph_use_count(void **state) {
    (void)state;
    small_graph s = small_graph_new();
    assert_int_equal(s.x->users[0].count, 1); /* what the corruption changes */
    outcome o = run_child(erase_with_wrong_use_count, &s);
    expect_assert(&o, "ag_graph_erase: Assertion `uses_match(n, false)'");
    ag_graph_free(s.g);
}

#ifndef NDEBUG
static void erase_from_broken_list(void *ud) {
    small_graph *s = ud;
    s->y->prev = NULL; /* y no longer points back at x */
    ag_graph_erase(s->g, s->out);
    ag_graph_erase(s->g, s->y);
}

static void test_graph_node_list(void **state) {
    (void)state;
    small_graph s = small_graph_new();
    assert_ptr_equal(s.y->prev, s.x);
    outcome o = run_child(erase_from_broken_list, &s);
    expect_assert(&o, "unlink_node: Assertion `n->prev ? n->prev->next == n : g->first == n'");
    ag_graph_free(s.g);
}
#endif

/* ---- the hash maps ---- */

static void strmap_with_wrong_count(void *ud) {
    (void)ud;
    ag__strmap m = {0};
    if (ag__strmap_put(&m, "a", (void *)1) || ag__strmap_put(&m, "b", (void *)2))
        _exit(3);
    m.len = 5;                       /* the count no longer follows the table */
    if (ag__strmap_reserve(&m, 100)) /* a rebuild counts the keys again */
        _exit(3);
    if (m.len != 2 || ag__strmap_get(&m, "b") != (void *)2)
        _exit(4);
    ag__strmap_free(&m);
}

static void test_strmap_count(void **state) {
    (void)state;
    outcome o = run_child(strmap_with_wrong_count, NULL);
    expect_assert(&o, "rehash: Assertion `m->len == old.len'");
}

static void ptrmap_null_key(void *ud) {
    (void)ud;
    ag__ptrmap m = {0};
    int x = 0;
    if (ag__ptrmap_put(&m, &x, 7) || ag__ptrmap_put(&m, NULL, 1))
        _exit(3);
    if (ag__ptrmap_get(&m, &x, 0) != 7)
        _exit(4);
    ag__ptrmap_free(&m);
}

static void test_ptrmap_null_key(void **state) {
    (void)state;
    outcome o = run_child(ptrmap_null_key, NULL);
    expect_assert(&o, "ag__ptrmap_put: Assertion `key'");
}

static void ptrmap_wrong_count(void *ud) {
    (void)ud;
    ag__ptrmap m = {0};
    int keys[3];
    for (int i = 0; i < 3; i++)
        if (ag__ptrmap_put(&m, &keys[i], i))
            _exit(3);
    m.len = 1; /* the table holds three keys */
    if (ag__ptrmap_reserve(&m, 1000))
        _exit(3);
    ag__ptrmap_free(&m);
}

static void test_ptrmap_count(void **state) {
    (void)state;
    outcome o = run_child(ptrmap_wrong_count, NULL);
    expect_assert(&o, "rehash: Assertion `live == m->len'");
}

/* ---- the memory planner ---- */

#ifndef NDEBUG
static void memplan_reversed_lifetime(void *ud) {
    (void)ud;
    /* A buffer that dies before it is made: the step profile would write past its end. */
    ag__mp_item it[] = {{64, 0, 1, 0}, {64, 3, 1, 0}};
    int64_t arena;
    ag__memplan(it, 2, AG__MP_BEST, &arena);
}

static void test_memplan_lifetime(void **state) {
    (void)state;
    outcome o = run_child(memplan_reversed_lifetime, NULL);
    expect_assert(&o,
                  "live_profile: Assertion `items[i].start >= 0 && items[i].start <= items[i].end");
}
#endif

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_graph_use_count), cmocka_unit_test(test_strmap_count),
        cmocka_unit_test(test_ptrmap_null_key), cmocka_unit_test(test_ptrmap_count),
#ifndef NDEBUG /* without their asserts these two corruptions are not memory-safe to run */
        cmocka_unit_test(test_graph_node_list), cmocka_unit_test(test_memplan_lifetime),
#endif
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
