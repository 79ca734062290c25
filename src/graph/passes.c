/* Graph passes over the IR: dead-code elimination, common-subexpression elimination and meta
 * re-inference (the decomposition pass lives in its own file).
 *
 * In: a graph that verifies. Out: the same graph rewritten in place through graph.c's mutation
 * API, still verifying, and a count of what changed. Every pass reads the op table for what it
 * may touch: ops that are effectful, collective, in-place or mutate an argument (schema
 * `Tensor(a!)`) are never removed or merged (a collective that one rank dropped would leave
 * its peers waiting), and random ops are never merged (two draws are two values). A call of
 * a subgraph (invoke_subgraph) has the side effects and randomness of the calls in it. */
#include "graph_internal.h"

#include <stdio.h>

/* ---- what an op may do ---- */

/* True when the call writes one of its arguments: an in-place op, or a schema argument marked
 * Tensor(a!) that is given a node (an optional mutated argument left None mutates nothing, as
 * native_batch_norm without running stats). */
static bool mutates_args(const ag_node *n) {
    if (ag_op_def(n->op)->flags & AG_OP_INPLACE)
        return true;
    for (int i = 0; i < n->nargs && i < n->op->nargs; i++)
        if (n->op->mutates[i] && ((n->args[i].kind == AG_GA_NODE && n->args[i].u.node) ||
                                  n->args[i].kind == AG_GA_NODES || n->args[i].kind == AG_GA_TUPLE))
            return true;
    return false;
}

/* Calls that must stay even when nothing reads their result. A call of a subgraph has the
 * side effects of the calls in it. */
static bool has_side_effects(const ag_node *n) {
    if (n->kind != AG_NODE_CALL)
        return false;
    const ag_graph *sub = ag__call_subgraph(n);
    if (sub) {
        for (const ag_node *x = sub->first; x; x = x->next)
            if (has_side_effects(x))
                return true;
        return false;
    }
    return (ag_op_def(n->op)->flags & (AG_OP_EFFECTFUL | AG_OP_COLLECTIVE)) || mutates_args(n);
}

/* Whether two calls with the same arguments give the same values: not for random ops (and
 * subgraphs holding one). */
static bool draws_randomness(const ag_node *n) {
    const ag_graph *sub = ag__call_subgraph(n);
    if (sub) {
        for (const ag_node *x = sub->first; x; x = x->next)
            if (x->kind == AG_NODE_CALL && draws_randomness(x))
                return true;
        return false;
    }
    return ag_op_def(n->op)->flags & AG_OP_RANDOM;
}

/* ---- dead-code elimination ---- */

static bool removable(const ag_node *n) {
    switch (n->kind) {
    case AG_NODE_CALL:
        return !has_side_effects(n);
    case AG_NODE_GETITEM:
    case AG_NODE_GET_ATTR:
        return true;
    default: /* placeholders are the calling convention; the output node is the result */
        return false;
    }
}

bool ag__graph_has_dead_code(const ag_graph *g) {
    for (const ag_node *n = g->first; n; n = n->next)
        if (n->nusers == 0 && removable(n))
            return true;
    return false;
}

int ag_graph_dce(ag_graph *g) {
    AG__CHECK_NULL("graph_dce", g);
    int removed = 0;
    /* Walking backwards, a node's users (all later) were visited before it, so one sweep
     * removes whole dead chains. A graph that does not verify may use a node before its
     * definition: when an erased node's argument becomes dead after the sweep passed it (its
     * stamp says so), sweep again. Erasing a node without users cannot fail. */
    for (bool again = true; again;) {
        again = false;
        uint32_t stamp = ++g->stamp;
        for (ag_node *n = g->last, *prev; n; n = prev) {
            prev = n->prev;
            n->stamp = stamp;
            if (n->nusers != 0 || !removable(n))
                continue;
            ag_node *defs[64];
            int nd = 0;
            for (int i = 0; i < n->nargs; i++) {
                const ag_garg *a = &n->args[i];
                int cnt = ag__garg_nrefs(a);
                for (int k = 0; k < cnt; k++) {
                    ag_node *d = ag__garg_ref(a, k);
                    if (d && nd < 64)
                        defs[nd++] = d;
                    else if (d)
                        again = true; /* too many to follow: settle them with another sweep */
                }
            }
            int rc = ag_graph_erase(g, n);
            if (rc < 0)
                return rc;
            removed++;
            for (int i = 0; i < nd; i++)
                again |= defs[i]->stamp == stamp && defs[i]->nusers == 0 && removable(defs[i]);
        }
    }
    return removed;
}

/* ---- common-subexpression elimination ---- */

static uint64_t mix(uint64_t h, uint64_t v) {
    h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    return h;
}

static uint64_t hash_bytes(uint64_t h, const void *p, size_t n) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

static uint64_t hash_node(const ag_node *n) {
    uint64_t h = mix(1469598103934665603ull, (uint64_t)n->kind);
    h = mix(h, (uint64_t)(uintptr_t)n->op);
    h = mix(h, (uint64_t)n->nargs);
    for (int i = 0; i < n->nargs; i++) {
        const ag_garg *a = &n->args[i];
        h = mix(h, (uint64_t)a->kind);
        switch (a->kind) {
        case AG_GA_NONE:
            break;
        case AG_GA_NODE:
            h = mix(h, (uint64_t)(uintptr_t)a->u.node);
            break;
        case AG_GA_NODES:
            h = mix(h, (uint64_t)a->n);
            for (int k = 0; k < a->n; k++)
                h = mix(h, (uint64_t)(uintptr_t)a->u.nodes[k]);
            break;
        case AG_GA_INT:
            h = mix(h, (uint64_t)a->u.i);
            break;
        case AG_GA_FLOAT:
            h = hash_bytes(h, &a->u.f, sizeof a->u.f);
            break;
        case AG_GA_BOOL:
            h = mix(h, a->u.b);
            break;
        case AG_GA_INTS:
            h = mix(h, (uint64_t)a->n);
            h = hash_bytes(h, a->u.ints, sizeof(int64_t) * (size_t)a->n);
            break;
        case AG_GA_DTYPE:
            h = mix(h, (uint64_t)a->u.dt);
            break;
        case AG_GA_STR:
            h = mix(h, ag__strhash(a->u.s ? a->u.s : ""));
            break;
        case AG_GA_TUPLE:
        case AG_GA_DICT:
            h = mix(h, ag__garg_agg_hash(a));
            break;
        }
    }
    return h;
}

static bool node_equal(const ag_node *a, const ag_node *b) {
    if (a->kind != b->kind || a->op != b->op || a->nargs != b->nargs || a->nvals != b->nvals)
        return false;
    for (int i = 0; i < a->nargs; i++)
        if (!ag__garg_equal(&a->args[i], &b->args[i]))
            return false;
    /* Equal arguments give equal vals; comparing them anyway keeps a graph whose vals were
     * edited by hand from merging nodes that would then disagree. */
    for (int i = 0; i < a->nvals; i++)
        if (!ag__tmeta_equal(&a->vals[i], &b->vals[i]))
            return false;
    return true;
}

static bool cse_candidate(const ag_node *n) {
    if (n->kind == AG_NODE_GETITEM)
        return true;
    if (n->kind != AG_NODE_CALL)
        return false;
    /* Random ops draw fresh values at every call (factories such as rand included); effectful,
     * collective and mutating ops must run as often as written. */
    if (draws_randomness(n) || has_side_effects(n))
        return false;
    return !mutates_args(n);
}

/* A slot is live only in the epoch that filled it: a mutation starts a new epoch, which
 * empties the table in O(1). */
typedef struct cse_slot {
    uint64_t hash;
    ag_node *node;
    uint64_t epoch;
} cse_slot;

int ag_graph_cse(ag_graph *g) {
    AG__CHECK_NULL("graph_cse", g);
    uint64_t cap = 16;
    while (cap < (uint64_t)g->count * 2)
        cap <<= 1;
    cse_slot *tab = ag__calloc(cap, sizeof *tab);
    if (!tab)
        return AG_ENOMEM;
    uint64_t mask = cap - 1, epoch = 1;
    int replaced = 0, rc = 0;
    for (ag_node *n = g->first, *next; n; n = next) {
        next = n->next;
        /* A node that writes a tensor changes what the same expression computes after it
         * (relu(x); x.add_(y); relu(x)), through any alias too: nothing before it merges with
         * anything after it. */
        if (n->kind == AG_NODE_CALL && mutates_args(n))
            epoch++;
        if (!cse_candidate(n))
            continue;
        /* Hashed when visited: the arguments already point at the surviving earlier nodes, so
         * the users of a merged node merge in turn (getitems of a merged multi-output call). */
        uint64_t h = hash_node(n), i = h & mask;
        ag_node *same = NULL;
        for (; tab[i].epoch == epoch; i = (i + 1) & mask)
            if (tab[i].hash == h && node_equal(tab[i].node, n)) {
                same = tab[i].node;
                break;
            }
        if (!same) {
            tab[i] = (cse_slot){h, n, epoch}; /* at most count entries: never full */
            continue;
        }
        /* The earlier node stays, with its own metadata. A failure here (ENOMEM) leaves a
         * valid graph: users are rewired one by one, each completely or not at all. */
        rc = ag_node_replace_all_uses(n, same);
        if (rc >= 0)
            rc = ag_graph_erase(g, n);
        if (rc < 0)
            break;
        replaced++;
    }
    ag__free(tab);
    return rc < 0 ? rc : replaced;
}

/* ---- meta re-inference ---- */

typedef struct saved_vals {
    ag_node *node;
    ag_tmeta *storage; /* the node's vals storage before the pass */
    int nvals;
    int64_t first; /* index of its vals in the flat backup array */
} saved_vals;

/* Stores `cnt` vals on n. Growing beyond the stored count moves the vals to a new buffer but
 * keeps the old storage (sv->storage) alive, so a failure later in the pass can put it back. */
static int store_vals(ag_node *n, const saved_vals *sv, const ag_tmeta *vals, int cnt) {
    if (cnt > sv->nvals && cnt > 1 && n->vals == sv->storage) {
        ag_tmeta *v = ag__malloc(sizeof *v * (size_t)cnt);
        if (!v)
            return AG_ENOMEM;
        n->vals = v;
    }
    memcpy(n->vals, vals, sizeof *vals * (size_t)cnt);
    n->nvals = cnt;
    return 0;
}

static int reinfer_node(ag_node *n, const saved_vals *sv) {
    ag_tmeta vals[AG_MAX_OUTPUTS];
    int nvals = 0;
    if (n->kind == AG_NODE_GETITEM) {
        const ag_node *src = n->args[0].u.node;
        int64_t idx = n->args[1].u.i;
        if (idx < 0 || idx >= src->nvals)
            return ag__err(AG_EINVAL,
                           "reinfer_meta: %%%s reads output %lld of %%%s, which now "
                           "has %d output(s)",
                           n->name, (long long)idx, src->name, src->nvals);
        vals[0] = src->vals[idx];
        nvals = 1;
    } else {
        int rc = ag__infer_meta(n->op, n->args, n->nargs, vals, &nvals);
        if (rc == AG_ENOMEM)
            return rc;
        if (rc < 0) {
            char msg[512];
            snprintf(msg, sizeof msg, "%s", ag_last_error());
            return ag__err(rc, "reinfer_meta: %%%s: %s", n->name, msg);
        }
    }
    return store_vals(n, sv, vals, nvals);
}

int ag_graph_reinfer_meta(ag_graph *g) {
    AG__CHECK_NULL("graph_reinfer_meta", g);
    /* Vals are rewritten in order (each call's inference reads its arguments' new vals). A
     * backup of every val taken first restores the graph when a later node fails, so a failed
     * call changes nothing. */
    int64_t nnodes = 0, ntotal = 0;
    for (ag_node *n = g->first; n; n = n->next)
        if (n->kind == AG_NODE_CALL || n->kind == AG_NODE_GETITEM) {
            nnodes++;
            ntotal += n->nvals;
        }
    saved_vals *sv = ag__malloc(sizeof *sv * (size_t)(nnodes ? nnodes : 1));
    ag_tmeta *backup = ag__malloc(sizeof *backup * (size_t)(ntotal ? ntotal : 1));
    if (!sv || !backup) {
        ag__free(sv);
        ag__free(backup);
        return AG_ENOMEM;
    }
    int64_t k = 0, off = 0;
    for (ag_node *n = g->first; n; n = n->next)
        if (n->kind == AG_NODE_CALL || n->kind == AG_NODE_GETITEM) {
            sv[k++] = (saved_vals){n, n->vals, n->nvals, off};
            memcpy(backup + off, n->vals, sizeof *backup * (size_t)n->nvals);
            off += n->nvals;
        }

    int rc = 0;
    int64_t j = 0;
    for (; j < nnodes; j++)
        if ((rc = reinfer_node(sv[j].node, &sv[j])) < 0)
            break;
    for (int64_t i = 0; i < nnodes && i <= j; i++) {
        ag_node *n = sv[i].node;
        if (n->vals == sv[i].storage)
            continue;
        /* The node grew into a new buffer: on success the old storage goes, on failure the
         * new one. */
        if (rc < 0) {
            ag__free(n->vals);
            n->vals = sv[i].storage;
        } else if (sv[i].storage != &n->val1) {
            ag__free(sv[i].storage);
        }
    }
    if (rc < 0)
        for (int64_t i = 0; i < nnodes && i <= j; i++) {
            ag_node *n = sv[i].node;
            n->nvals = sv[i].nvals;
            memcpy(n->vals, backup + sv[i].first, sizeof *backup * (size_t)sv[i].nvals);
        }
    ag__free(sv);
    ag__free(backup);
    return rc < 0 ? rc : 0;
}
