/* The multi-rank determinism guard of the executor: at the first run of a plan that holds
 * collectives, the ranks of each group its collectives name compare their sequences of
 * collectives on it, and the job ends naming the first one that differs (src/dist/seq_check.c
 * does the exchange). Every rank must issue the same collectives in the same order; a rank
 * whose graph differs (a bug in a pass, a graph loaded from another file, a rank-dependent
 * branch) would otherwise hang in a collective its peers never start, or pair its all_reduce
 * with a peer's all_gather.
 *
 * A collective is compared by op, group, dtype, element count (not for all_to_all_single, whose
 * counts are each rank's own) and its string and integer arguments (reduce_op, group_size,
 * src); wait_tensor is no communication and is skipped. Groups are checked in the order of
 * their names, which every rank shares. On when the plan is made in checking mode, in builds
 * without NDEBUG, or with AG_CHECK_COLLECTIVES set (AG_CHECK_COLLECTIVES=0 turns it off). */
#include "plan_internal.h"

#include "../dist/pending.h"

#include <stdio.h>
#include <stdlib.h>

bool ag__coll_check_wanted(const ag_plan_opts *o) {
    const char *e = getenv("AG_CHECK_COLLECTIVES");
    if (e && *e)
        return strcmp(e, "0") != 0;
#ifndef NDEBUG
    (void)o;
    return true;
#else
    return o && o->checking;
#endif
}

static uint64_t fnv(uint64_t h, const void *p, size_t n) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) {
        h ^= b[i];
        h *= 0x100000001b3ull;
    }
    return h;
}

/* The group a collective names (its group_name argument); NULL for wait_tensor. */
static const char *group_of(const ag__coll_step *s) {
    int n = ag_op_nargs(s->op);
    for (int i = 0; i < n; i++)
        if (!strcmp(ag_op_arg(s->op, i)->name, "group_name") && s->args[i].kind == AG_ARG_STR)
            return s->args[i].u.s;
    return NULL;
}

/* The hash and description of one collective. */
static uint64_t describe(const ag__coll_step *s, char *d, size_t cap) {
    const char *name = ag_op_name(s->op), *c = strstr(name, "::");
    const char *shortname = c ? c + 2 : name;
    int n = ag_op_nargs(s->op);
    bool own_counts = false; /* split sizes: counts differ by rank */
    for (int i = 0; i < n; i++)
        own_counts |= s->args[i].kind == AG_ARG_INTS;
    uint64_t h = fnv(0xcbf29ce484222325ull, name, strlen(name) + 1);
    h = fnv(h, &s->out->dtype, sizeof s->out->dtype);
    size_t len = 0;
    if (own_counts) {
        len += (size_t)snprintf(d, cap, "%s(%s", shortname, ag_dtype_short(s->out->dtype));
    } else {
        int64_t numel = ag_tensor_numel(s->out);
        h = fnv(h, &numel, sizeof numel);
        len += (size_t)snprintf(d, cap, "%s(%s, %lld elements", shortname,
                                ag_dtype_short(s->out->dtype), (long long)numel);
    }
    for (int i = 0; i < n && len < cap; i++) {
        const ag_arg *a = &s->args[i];
        if (a->kind == AG_ARG_STR && a->u.s) {
            h = fnv(h, a->u.s, strlen(a->u.s) + 1);
            len += (size_t)snprintf(d + len, cap - len, ", %s '%s'", ag_op_arg(s->op, i)->name,
                                    a->u.s);
        } else if (a->kind == AG_ARG_INT) {
            h = fnv(h, &a->u.i, sizeof a->u.i);
            len += (size_t)snprintf(d + len, cap - len, ", %s %lld", ag_op_arg(s->op, i)->name,
                                    (long long)a->u.i);
        }
    }
    if (len < cap)
        snprintf(d + len, cap - len, ") at %%%s", s->node);
    return h ? h : 1;
}

static int by_name(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

int ag__coll_check(const ag__coll_step *steps, int n) {
    enum { DESC = 160 };
    const char **groups = ag__malloc(sizeof(char *) * (size_t)(n ? n : 1));
    uint64_t *hashes = ag__malloc(sizeof(uint64_t) * (size_t)(n ? n : 1));
    char *descs = ag__malloc((size_t)DESC * (size_t)(n ? n : 1));
    const char **dp = ag__malloc(sizeof(char *) * (size_t)(n ? n : 1));
    int rc = 0;
    if (!groups || !hashes || !descs || !dp) {
        rc = AG_ENOMEM;
        goto done;
    }
    /* The distinct groups, in name order. */
    int ng = 0;
    for (int i = 0; i < n; i++) {
        const char *g = group_of(&steps[i]);
        bool seen = !g;
        for (int k = 0; k < ng && !seen; k++)
            seen = !strcmp(groups[k], g);
        if (!seen)
            groups[ng++] = g;
    }
    qsort(groups, (size_t)ng, sizeof *groups, by_name);
    for (int k = 0; k < ng && !rc; k++) {
        ag_group *g = ag_group_find(groups[k]);
        if (!g) /* no such group here: the collective's kernel will say so */
            continue;
        int64_t m = 0;
        for (int i = 0; i < n; i++) {
            const char *gi = group_of(&steps[i]);
            if (!gi || strcmp(gi, groups[k]))
                continue;
            hashes[m] = describe(&steps[i], descs + (size_t)m * DESC, DESC);
            dp[m] = descs + (size_t)m * DESC;
            m++;
        }
        rc = ag__dist_check_sequence("plan: collective check", g, hashes, dp, m);
    }
done:
    ag__free(groups);
    ag__free(hashes);
    ag__free(descs);
    ag__free(dp);
    return rc;
}
