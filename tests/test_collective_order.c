/* Collectives keep their order through partitioning and fusion. Every rank must issue the same
 * collectives in the same order (MPI matches them by order), so the partitioner may neither
 * reorder collectives across each other nor recompute one, except the FSDP parameter gathers
 * tagged AG_MUST_RECOMPUTE, which run once in the forward and once more in the backward.
 *
 * For the zoo's mlp and gpt2 (tiny config) sharded on a virtual mesh of 2 ranks by each
 * strategy (dp, fsdp, tp), partitioned by the default and the min-cut partitioners under
 * memory budgets 0 and 1, this checks:
 *   - the forward's collectives, then the backward's, are the joint's collectives in the
 *     joint's order, with the recomputed gathers of the backward as the only extra entries
 *     (the backward gathers each again before its first use there, so they come in the
 *     backward's order, not the joint's), and every joint collective is there;
 *   - a collective appears twice only when the joint tags it AG_MUST_RECOMPUTE, and the
 *     min-cut does gather fsdp's parameters again;
 *   - every collective's wait_tensor is in the same graph, after it;
 *   - rank 0 and rank 1 issue the same sequence (op, dtype, sizes, group and scalar arguments);
 *   - the planned executor's fused groups (fuse.c) never hold a collective or a wait_tensor.
 * No MPI: nothing here runs a collective. Before the fix in side_plan.c, the inputs-only saved
 * set of memory budget 0 ran tp's forward all_reduce again in the min-cut's backward. */
#include "testutil.h"

#include <stdlib.h>
#include <string.h>

#include "runtime/fuse.h"

#define PFX "_c10d_functional::"
#define WT PFX "wait_tensor"

static bool is_coll(const ag_node *n) {
    return ag_node_kind_of(n) == AG_NODE_CALL &&
           !strncmp(ag_op_name(ag_node_op(n)), PFX, strlen(PFX)) &&
           strcmp(ag_op_name(ag_node_op(n)), WT);
}

static bool is_wait(const ag_node *n) {
    return ag_node_kind_of(n) == AG_NODE_CALL && !strcmp(ag_op_name(ag_node_op(n)), WT);
}

/* The names of g's collectives (wait_tensor excluded), in graph order. */
typedef struct names {
    const char *v[512];
    int n;
} names;

static void collect(const ag_graph *g, names *out) {
    out->n = 0;
    for (ag_node *n = ag_graph_first(g); n; n = ag_node_next(n))
        if (is_coll(n)) {
            assert_true(out->n < 512);
            out->v[out->n++] = ag_node_name(n);
        }
}

static int index_of(const names *s, const char *name) {
    for (int i = 0; i < s->n; i++)
        if (!strcmp(s->v[i], name))
            return i;
    return -1;
}

/* Every collective's single user is its wait_tensor, later in the same graph. */
static void assert_waits_after(const ag_graph *g, const char *what) {
    for (ag_node *n = ag_graph_first(g); n; n = ag_node_next(n)) {
        if (!is_coll(n))
            continue;
        if (ag_node_num_users(n) != 1 || !is_wait(ag_node_user(n, 0)))
            fail_msg("%s: collective %%%s has %d users, not its wait_tensor alone", what,
                     ag_node_name(n), ag_node_num_users(n));
        bool after = false;
        for (ag_node *m = ag_node_next(n); m && !after; m = ag_node_next(m))
            after = m == ag_node_user(n, 0);
        if (!after)
            fail_msg("%s: the wait of %%%s comes before it", what, ag_node_name(n));
    }
}

/* The check of the file's header for one partitioned joint. */
static void assert_order(const ag_graph *joint, const ag_graph *fw, const ag_graph *bw,
                         const char *what) {
    names j, f, b;
    collect(joint, &j);
    collect(fw, &f);
    collect(bw, &b);
    assert_true(j.n > 0);
    assert_waits_after(fw, what);
    assert_waits_after(bw, what);
    int last = -1;
    int seen[512] = {0};
    for (int k = 0; k < f.n + b.n; k++) {
        bool in_bw = k >= f.n;
        const char *name = in_bw ? b.v[k - f.n] : f.v[k];
        int i = index_of(&j, name);
        if (i < 0)
            fail_msg("%s: %%%s is not a collective of the joint", what, name);
        ag_recompute r = ag_node_recompute(ag_graph_find(joint, name));
        if (seen[i]++) {
            /* The second time: a recomputation, which only a MUST-tagged gather may be. */
            if (!in_bw || r != AG_MUST_RECOMPUTE || index_of(&f, name) < 0)
                fail_msg("%s: %%%s appears twice (recompute policy %d)", what, name, (int)r);
            continue;
        }
        if (i < last)
            fail_msg("%s: %%%s (joint collective %d) comes after %%%s (joint collective %d)", what,
                     name, i, j.v[last], last);
        last = i;
    }
    for (int i = 0; i < j.n; i++)
        if (!seen[i])
            fail_msg("%s: joint collective %%%s is in neither graph", what, j.v[i]);
}

/* The planned executor's fused groups (fuse.c) over g's kernel calls, chained as plan.c
 * chains them (views skipped): none holds a collective or a wait_tensor. Returns the groups. */
static int assert_no_fused_collective(const ag_graph *g, const char *what) {
    ag_node *calls[4096];
    int n = 0, groups = 0;
    for (ag_node *x = ag_graph_first(g); x; x = ag_node_next(x))
        if (ag_node_kind_of(x) == AG_NODE_CALL && !(ag_op_def(ag_node_op(x))->flags & AG_OP_VIEW)) {
            assert_true(n < 4096);
            calls[n++] = x;
        }
    for (int i = 0; i + 1 < n; i++) {
        ag__fuse_group grp;
        int len = ag__fuse_match(calls + i, n - i < AG__FUSE_MAX ? n - i : AG__FUSE_MAX, &grp);
        if (len < 2)
            continue;
        groups++;
        for (int k = 0; k < len; k++)
            if (ag_op_def(ag_node_op(calls[i + k]))->flags & AG_OP_COLLECTIVE)
                fail_msg("%s: fused group %s holds %%%s", what, grp.f->name,
                         ag_node_name(calls[i + k]));
    }
    return groups;
}

/* Appends to sig one line per collective of g: op, output dtype and sizes, string and int
 * arguments: what every rank must agree on. */
static void signature(const ag_graph *g, char *sig, size_t cap) {
    size_t len = strlen(sig);
    for (ag_node *n = ag_graph_first(g); n; n = ag_node_next(n)) {
        if (!is_coll(n) && !is_wait(n))
            continue;
        const ag_tmeta *m = ag_node_val(n, 0);
        len += (size_t)snprintf(sig + len, cap - len, "%s %s[", ag_op_name(ag_node_op(n)),
                                ag_dtype_short(m->dtype));
        for (int d = 0; d < m->ndim; d++)
            len += (size_t)snprintf(sig + len, cap - len, " %lld", (long long)m->sizes[d]);
        len += (size_t)snprintf(sig + len, cap - len, " ]");
        for (int a = 1; a < ag_node_nargs(n); a++) {
            const ag_garg *ga = ag_node_arg(n, a);
            if (ga->kind == AG_GA_STR)
                len += (size_t)snprintf(sig + len, cap - len, " %s", ga->u.s);
            else if (ga->kind == AG_GA_INT)
                len += (size_t)snprintf(sig + len, cap - len, " %lld", (long long)ga->u.i);
        }
        len += (size_t)snprintf(sig + len, cap - len, "\n");
        assert_true(len < cap);
    }
}

static void check_model(const char *model, const char *strat) {
    ag_module *m = NULL;
    ag_tensor *in[4] = {0};
    int nin = 0;
    assert_int_equal(ag_zoo_build(model, NULL, &m, in, 4, &nin), 0);
    ag_joint *j = ag_export_joint(m, in, nin, NULL, NULL, 0, NULL);
    assert_non_null(j);
    ag_mesh mesh = {.size = 2, .rank = 0, .group = NULL};
    int checked = 0, fused = 0;
    enum { SIG = 1 << 16 };
    char *sigs[4] = {0}; /* per (partitioner, budget): rank 0's collectives, fw then bw */
    for (int rank = 0; rank < 2; rank++) {
        mesh.rank = rank;
        ag_shard_plan *p = ag_shard_plan_strategy_new(strat, j, &mesh);
        if (!p)
            fail_msg("%s %s: %s", model, strat, ag_last_error());
        ag_joint *sh = ag_shard_joint(j, &mesh, p);
        if (!sh)
            fail_msg("%s %s: shard_joint: %s", model, strat, ag_last_error());
        const ag_graph *g = ag_joint_graph(sh);
        int must = 0;
        for (ag_node *n = ag_graph_first(g); n; n = ag_node_next(n))
            must += is_coll(n) && ag_node_recompute(n) == AG_MUST_RECOMPUTE;
        /* fsdp tags its gathers; the others tag none. */
        assert_int_equal(must > 0, !strcmp(strat, "fsdp"));
        for (int part = 0; part < 2; part++)
            for (int budget = 0; budget <= 1; budget++) {
                ag_partition_opts o = {.partitioner =
                                           part ? AG_PARTITION_MINCUT : AG_PARTITION_DEFAULT,
                                       .memory_budget = ag_memory_budget(budget)};
                ag_graph *fw = NULL, *bw = NULL;
                char what[128];
                snprintf(what, sizeof what, "%s %s rank %d %s budget %d", model, strat, rank,
                         part ? "mincut" : "default", budget);
                if (ag_partition(g, ag_joint_num_fw_outputs(sh), &o, &fw, &bw, NULL))
                    fail_msg("%s: partition: %s", what, ag_last_error());
                assert_order(g, fw, bw, what);
                /* The min-cut gathers fsdp's parameters again in the backward. */
                if (part && must > 0) {
                    names f, b;
                    collect(fw, &f);
                    collect(bw, &b);
                    int again = 0;
                    for (int i = 0; i < b.n; i++)
                        again += index_of(&f, b.v[i]) >= 0;
                    assert_true(again > 0);
                }
                fused += assert_no_fused_collective(fw, what);
                fused += assert_no_fused_collective(bw, what);
                /* Both ranks issue the same collectives in the same order. */
                char *sig = calloc(SIG, 1);
                assert_non_null(sig);
                signature(fw, sig, SIG);
                signature(bw, sig, SIG);
                if (rank == 0) {
                    sigs[part * 2 + budget] = sig;
                } else {
                    if (strcmp(sig, sigs[part * 2 + budget]))
                        fail_msg("%s: rank 1's collectives differ from rank 0's:\n%s\nvs\n%s", what,
                                 sig, sigs[part * 2 + budget]);
                    free(sig);
                }
                ag_graph_free(fw);
                ag_graph_free(bw);
                checked++;
            }
        ag_joint_free(sh);
        ag_shard_plan_free(p);
    }
    for (int k = 0; k < 4; k++)
        free(sigs[k]);
    /* gpt2 fuses its residual adds with layer norms: the check above saw real groups. */
    if (!strcmp(model, "gpt2"))
        assert_true(fused > 0);
    assert_int_equal(checked, 8);
    ag_joint_free(j);
    ag_module_free(m);
    for (int i = 0; i < nin; i++)
        ag_tensor_free(in[i]);
}

static void test_mlp(void **st) {
    (void)st;
    check_model("mlp", "dp");
    check_model("mlp", "fsdp");
    check_model("mlp", "tp");
}

static void test_gpt2(void **st) {
    (void)st;
    check_model("gpt2", "dp");
    check_model("gpt2", "fsdp");
    check_model("gpt2", "tp");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_mlp),
        cmocka_unit_test(test_gpt2),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
