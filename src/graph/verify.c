/* The graph verifier (ag_graph_verify): checks that a graph is well formed before anything
 * trusts it, the interpreter and the compiled stages included.
 *
 * In: a graph built by the tracer, the parser or a pass (possibly broken by hand). Out: 0, or
 * AG_EINVAL with one message naming the first bad node and what is wrong with it
 * ("verify: %addmm uses %t before it is defined"). Checked, in graph order: the node list's
 * links; unique, registered names; placeholders first; every referenced node is in the graph
 * and defined earlier; users lists equal the references in both directions (with counts); each
 * call's arguments fit its op's schema and its stored vals equal what the op's meta function
 * infers from its arguments' vals; getitem indexes an existing output and carries its val;
 * get_attr's val is its constant's metadata; exactly one output node, last, whose argument is
 * one list of nodes; descriptors sit on placeholders (inputs) and the output node (outputs).
 * A get_attr of a subgraph names one the graph owns; each subgraph is verified after the
 * graph, its errors prefixed "verify: subgraph NAME: ". */
#include "graph_internal.h"

#include <stdio.h>

/* ---- positions ----
 * check_links walks the node list and stores each node's position in the node's index (the
 * cache ag_node_index keeps: the same values it would compute) and the node at each position
 * in a table. A referenced node d is then in the graph exactly when its index names a
 * position holding d: one read of d and one of the table, where a pointer -> position hash
 * table would miss the caches once per reference on a large graph. */

typedef struct ptab {
    const ag_node **at; /* the node at each position */
    int64_t n;
} ptab;

static int ptab_init(ptab *t, int64_t n) {
    t->at = ag__malloc(sizeof *t->at * (size_t)(n > 0 ? n : 1));
    t->n = 0;
    return t->at ? 0 : AG_ENOMEM;
}

static void ptab_free(ptab *t) {
    ag__free(t->at);
}

/* The node's position, or -1 when it is not in the graph. */
static int64_t ptab_get(const ptab *t, const ag_node *n) {
    int64_t p = n->index;
    return p >= 0 && p < t->n && t->at[p] == n ? p : -1;
}

/* ---- helpers ---- */

/* "f32[4, 3]", with strides and offset added when `full` (the sizes alone do not show the
 * difference). */
static char *tmeta_str(const ag_tmeta *m, bool full, char *buf, size_t n) {
    char sz[256], st[256];
    int nd = m->ndim >= 0 && m->ndim <= AG_MAX_DIMS ? m->ndim : 0;
    ag__fmt_sizes(sz, sizeof sz, nd, m->sizes);
    const char *dt = (unsigned)m->dtype < AG_NDTYPES ? ag_dtype_short(m->dtype) : "?";
    if (full) {
        ag__fmt_sizes(st, sizeof st, nd, m->strides);
        snprintf(buf, n, "%s%s (strides %s, offset %lld)", dt, sz, st, (long long)m->offset);
    } else {
        snprintf(buf, n, "%s%s", dt, sz);
    }
    return buf;
}

static bool same_shape(const ag_tmeta *a, const ag_tmeta *b) {
    if (a->dtype != b->dtype || a->ndim != b->ndim)
        return false;
    for (int d = 0; d < a->ndim; d++)
        if (a->sizes[d] != b->sizes[d])
            return false;
    return true;
}

/* The message for stored != expected, e.g. "stored val f32[4, 2] but addmm infers f32[4, 3]"
 * (`what` is "addmm infers"). */
static int val_mismatch(const ag_node *n, const char *what, const ag_tmeta *stored,
                        const ag_tmeta *want) {
    char a[600], b[600];
    bool full = same_shape(stored, want);
    return ag__err(AG_EINVAL, "verify: %%%s: stored val %s but %s %s", n->name,
                   tmeta_str(stored, full, a, sizeof a), what, tmeta_str(want, full, b, sizeof b));
}

/* ---- references between nodes ----
 * Both directions of the users invariant need "how many times does u reference d". A node with
 * a few arguments answers by scanning them; the wide ones (a forward graph's output node lists
 * thousands of values) would make that quadratic, so their references are listed once, by
 * referenced node: for each position, the positions of the wide users referencing it,
 * ascending, one entry per reference (a count of equal entries answers). seen[] (one int per
 * position) catches a user listed twice. */

enum { WIDE_REFS = 16 };

typedef struct refs {
    bool *wide; /* per position */
    int *seen;  /* per position: the position + 1 of the node whose users list named it last */
    int *off;   /* per position + 1: where its wide users start in by[] */
    int *by;    /* the wide users' positions, grouped by the position they reference */
} refs;

static int nrefs(const ag_node *n) {
    int c = 0;
    for (int i = 0; i < n->nargs; i++) {
        const ag_garg *a = &n->args[i];
        for (int k = 0, cnt = ag__garg_nrefs(a); k < cnt; k++)
            c += ag__garg_ref(a, k) != NULL;
    }
    return c;
}

/* How many times n's arguments reference d (by scanning them). */
static int refs_scan(const ag_node *n, const ag_node *d) {
    int c = 0;
    for (int i = 0; i < n->nargs; i++) {
        const ag_garg *a = &n->args[i];
        for (int k = 0, cnt = ag__garg_nrefs(a); k < cnt; k++)
            c += ag__garg_ref(a, k) == d;
    }
    return c;
}

/* How many times user u (at position upos) references d (at position dpos). */
static int refs_to(const refs *r, const ag_node *u, int64_t upos, const ag_node *d, int64_t dpos) {
    if (!r->wide[upos])
        return refs_scan(u, d);
    int lo = r->off[dpos], hi = r->off[dpos + 1];
    while (lo < hi) { /* the first entry >= upos */
        int mid = lo + (hi - lo) / 2;
        if (r->by[mid] < upos)
            lo = mid + 1;
        else
            hi = mid;
    }
    int c = 0;
    while (lo + c < r->off[dpos + 1] && r->by[lo + c] == upos)
        c++;
    return c;
}

static void refs_free(refs *r) {
    ag__free(r->wide);
    ag__free(r->seen);
    ag__free(r->off);
    ag__free(r->by);
}

/* Calls f(r, upos, dpos) for each reference of wide node x (at upos) to a node of the graph. */
#define FOR_WIDE_REF(t, x, body)                                                                   \
    for (int i_ = 0; i_ < (x)->nargs; i_++) {                                                      \
        const ag_garg *a_ = &(x)->args[i_];                                                        \
        int cnt_ = ag__garg_nrefs(a_);                                                             \
        for (int k_ = 0; k_ < cnt_; k_++) {                                                        \
            const ag_node *d_ = ag__garg_ref(a_, k_);                                              \
            int64_t dpos = d_ ? ptab_get(t, d_) : -1;                                              \
            if (dpos >= 0)                                                                         \
                body;                                                                              \
        }                                                                                          \
    }

/* Marks the wide nodes of the (well-linked) graph and lists their references. */
static int refs_init(refs *r, const ag_graph *g, const ptab *t) {
    size_t n = (size_t)(g->count ? g->count : 1);
    r->wide = ag__calloc(n, sizeof *r->wide);
    r->seen = ag__calloc(n, sizeof *r->seen);
    if (!r->wide || !r->seen)
        return AG_ENOMEM;
    int64_t total = 0, pos = 0;
    for (const ag_node *x = g->first; x; x = x->next, pos++) {
        int c = nrefs(x);
        if (c > WIDE_REFS) {
            r->wide[pos] = true;
            total += c;
        }
    }
    if (total == 0)
        return 0; /* no wide node: refs_to never reads the lists */
    r->off = ag__calloc(n + 1, sizeof *r->off);
    r->by = ag__malloc(sizeof *r->by * (size_t)total);
    if (!r->off || !r->by)
        return AG_ENOMEM;
    pos = 0;
    for (const ag_node *x = g->first; x; x = x->next, pos++)
        if (r->wide[pos])
            FOR_WIDE_REF(t, x, r->off[dpos + 1]++);
    for (size_t i = 0; i < n; i++)
        r->off[i + 1] += r->off[i];
    /* Filled in position order (each group ascending), off[d] moving to the group's end... */
    pos = 0;
    for (const ag_node *x = g->first; x; x = x->next, pos++)
        if (r->wide[pos])
            FOR_WIDE_REF(t, x, r->by[r->off[dpos]++] = (int)pos);
    /* ...and back to its start. */
    for (size_t i = n; i > 0; i--)
        r->off[i] = r->off[i - 1];
    r->off[0] = 0;
    return 0;
}

#undef FOR_WIDE_REF

static const char *kind_name(ag_node_kind k) {
    switch (k) {
    case AG_NODE_PLACEHOLDER:
        return "placeholder";
    case AG_NODE_CALL:
        return "call";
    case AG_NODE_GETITEM:
        return "getitem";
    case AG_NODE_GET_ATTR:
        return "get_attr";
    case AG_NODE_OUTPUT:
        return "output";
    }
    return "?";
}

/* ---- per-node checks ---- */

/* One referenced node d of user n (at position pos): in the graph, defined earlier, a value,
 * and n registered among d's users with the right count. */
static int check_ref(const ptab *t, const refs *r, const ag_node *n, int64_t pos,
                     const ag_node *d) {
    int64_t dpos = ptab_get(t, d);
    if (dpos < 0)
        return ag__err(AG_EINVAL, "verify: %%%s uses %%%s, which is not in the graph", n->name,
                       d->name ? d->name : "?");
    if (dpos >= pos)
        return ag__err(AG_EINVAL, "verify: %%%s uses %%%s before it is defined", n->name, d->name);
    if (d->kind == AG_NODE_OUTPUT)
        return ag__err(AG_EINVAL, "verify: %%%s uses the output node %%%s", n->name, d->name);
    int want = refs_to(r, n, pos, d, dpos);
    for (int i = 0; i < d->nusers; i++)
        if (d->users[i].node == n) {
            if (d->users[i].count != want)
                return ag__err(AG_EINVAL,
                               "verify: %%%s lists user %%%s %d time(s) but it is used "
                               "%d time(s)",
                               d->name, n->name, d->users[i].count, want);
            return 0;
        }
    return ag__err(AG_EINVAL, "verify: %%%s uses %%%s but is missing from its users list", n->name,
                   d->name);
}

/* Every entry of n's users list names a node of the graph that references n, once per entry. */
static int check_users(const ptab *t, const refs *r, const ag_node *n, int64_t pos) {
    for (int i = 0; i < n->nusers; i++) {
        const ag_node *u = n->users[i].node;
        int64_t upos = u ? ptab_get(t, u) : -1;
        if (upos < 0)
            return ag__err(AG_EINVAL, "verify: %%%s lists user %s, which is not in the graph",
                           n->name, u ? u->name : "NULL");
        if (r->seen[upos] == pos + 1)
            return ag__err(AG_EINVAL, "verify: %%%s lists user %%%s twice", n->name, u->name);
        r->seen[upos] = (int)pos + 1;
        if (n->users[i].count <= 0 || refs_to(r, u, upos, n, pos) == 0)
            return ag__err(AG_EINVAL, "verify: %%%s lists user %%%s, which does not use it",
                           n->name, u->name);
        /* The count itself is compared from the user's side (check_ref). */
    }
    return 0;
}

static int check_call(const ag_node *n) {
    if (!n->op)
        return ag__err(AG_EINVAL, "verify: %%%s: call without an op", n->name);
    for (int i = 0; i < n->nargs; i++) {
        const ag_garg *a = &n->args[i];
        if (a->kind == AG_GA_NODE && a->u.node && a->u.node->nvals > 1)
            return ag__err(AG_EINVAL,
                           "verify: %%%s: argument %d (%%%s) has %d outputs; read one "
                           "through getitem",
                           n->name, i, a->u.node->name, a->u.node->nvals);
        if (a->kind == AG_GA_NODES || a->kind == AG_GA_TUPLE)
            for (int k = 0; k < ag__garg_nrefs(a); k++)
                if (ag__garg_ref(a, k) && ag__garg_ref(a, k)->nvals > 1)
                    return ag__err(AG_EINVAL,
                                   "verify: %%%s: element %d of argument %d (%%%s) has "
                                   "%d outputs; read one through getitem",
                                   n->name, k, i, ag__garg_ref(a, k)->name,
                                   ag__garg_ref(a, k)->nvals);
        if (ag__garg_check(ag_op_name(n->op), a)) {
            char msg[512];
            snprintf(msg, sizeof msg, "%s", ag_last_error());
            return ag__err(AG_EINVAL, "verify: %%%s: argument %d: %s", n->name, i, msg);
        }
    }
    ag_tmeta vals[AG_MAX_OUTPUTS];
    int nvals = 0;
    int rc = ag__infer_meta(n->op, n->args, n->nargs, vals, &nvals);
    if (rc == AG_ENOMEM)
        return rc;
    if (rc < 0) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", ag_last_error());
        return ag__err(AG_EINVAL, "verify: %%%s: %s", n->name, msg);
    }
    if (nvals != n->nvals)
        return ag__err(AG_EINVAL, "verify: %%%s: stores %d val(s) but %s has %d output(s)", n->name,
                       n->nvals, ag_op_name(n->op), nvals);
    for (int i = 0; i < nvals; i++)
        if (!ag__tmeta_equal(&n->vals[i], &vals[i])) {
            char what[160];
            if (nvals == 1)
                snprintf(what, sizeof what, "%s infers", ag_op_name(n->op));
            else
                snprintf(what, sizeof what, "%s infers for output %d", ag_op_name(n->op), i);
            return val_mismatch(n, what, &n->vals[i], &vals[i]);
        }
    return 0;
}

static int check_getitem(const ag_node *n) {
    if (n->nargs != 2 || n->args[0].kind != AG_GA_NODE || !n->args[0].u.node ||
        n->args[1].kind != AG_GA_INT)
        return ag__err(AG_EINVAL, "verify: %%%s: getitem takes (node, int)", n->name);
    const ag_node *src = n->args[0].u.node;
    int64_t idx = n->args[1].u.i;
    if (src->kind != AG_NODE_CALL)
        return ag__err(AG_EINVAL,
                       "verify: %%%s: reads an output of %%%s, which is a %s, not a "
                       "call",
                       n->name, src->name, kind_name(src->kind));
    if (idx < 0 || idx >= src->nvals)
        return ag__err(AG_EINVAL, "verify: %%%s: index %lld out of range (%%%s has %d outputs)",
                       n->name, (long long)idx, src->name, src->nvals);
    if (ag__call_output_is_none(src, (int)idx))
        return ag__err(AG_EINVAL, "verify: %%%s: output %lld of %%%s is None in its subgraph",
                       n->name, (long long)idx, src->name);
    if (n->nvals != 1)
        return ag__err(AG_EINVAL, "verify: %%%s: getitem stores %d vals", n->name, n->nvals);
    if (!ag__tmeta_equal(&n->vals[0], &src->vals[idx])) {
        char what[160];
        snprintf(what, sizeof what, "output %lld of %%%s is", (long long)idx, src->name);
        return val_mismatch(n, what, &n->vals[0], &src->vals[idx]);
    }
    return 0;
}

static int check_get_attr(const ag_graph *g, const ag_node *n) {
    if (n->sub) {
        if (n->constant)
            return ag__err(AG_EINVAL, "verify: %%%s: get_attr of a subgraph holds a constant",
                           n->name);
        if (n->nargs != 0 || n->nvals != 0)
            return ag__err(AG_EINVAL,
                           "verify: %%%s: get_attr of a subgraph takes no arguments and "
                           "stores no val",
                           n->name);
        if (ag__subgraph_index(g, n->sub) < 0)
            return ag__err(AG_EINVAL, "verify: %%%s: refers to a subgraph the graph does not own",
                           n->name);
        return 0;
    }
    if (!n->constant)
        return ag__err(AG_EINVAL, "verify: %%%s: get_attr without a constant", n->name);
    if (n->nargs != 0)
        return ag__err(AG_EINVAL, "verify: %%%s: get_attr takes no arguments", n->name);
    if (n->nvals != 1)
        return ag__err(AG_EINVAL, "verify: %%%s: get_attr stores %d vals", n->name, n->nvals);
    ag_tmeta m;
    ag__tmeta_of(n->constant, &m);
    if (!ag__tmeta_equal(&n->vals[0], &m))
        return val_mismatch(n, "its constant is", &n->vals[0], &m);
    return 0;
}

static int check_output(const ag_graph *g, const ag_node *n) {
    if (n->nargs != 1 || n->args[0].kind != AG_GA_NODES)
        return ag__err(AG_EINVAL, "verify: %%%s: the output node takes one list of nodes", n->name);
    if (n->nvals != 0)
        return ag__err(AG_EINVAL, "verify: %%%s: the output node stores vals", n->name);
    const ag_garg *a = &n->args[0];
    for (int k = 0; k < a->n; k++)
        if (a->u.nodes[k] && a->u.nodes[k]->kind == AG_NODE_CALL && a->u.nodes[k]->nvals != 1)
            return ag__err(AG_EINVAL,
                           "verify: %%%s: output %d (%%%s) has %d outputs; read one "
                           "through getitem",
                           n->name, k, a->u.nodes[k]->name, a->u.nodes[k]->nvals);
    for (int k = 0; k < a->n; k++) {
        const ag_node *x = a->u.nodes[k];
        if (x && x->sub)
            return ag__err(AG_EINVAL, "verify: %%%s: output %d (%%%s) is a subgraph", n->name, k,
                           x->name);
        if (x && ag__call_subgraph(x))
            return ag__err(AG_EINVAL,
                           "verify: %%%s: output %d (%%%s) is a tuple; read it through getitem",
                           n->name, k, x->name);
    }
    if (n->has_out_descs) {
        if (n->nout_descs != a->n)
            return ag__err(AG_EINVAL, "verify: %%%s: %d output descriptors for %d outputs", n->name,
                           n->nout_descs, a->n);
        for (int k = 0; k < n->nout_descs; k++)
            if (n->out_descs[k] && !ag_desc_is_output(n->out_descs[k]))
                return ag__err(AG_EINVAL,
                               "verify: %%%s: descriptor %d is not an output "
                               "descriptor",
                               n->name, k);
    }
    if (g->output != n)
        return ag__err(AG_EINVAL, "verify: %%%s is not the graph's registered output node",
                       n->name);
    return 0;
}

static int check_node(const ag_graph *g, const ag_node *n) {
    if (n->kind != AG_NODE_PLACEHOLDER && n->desc)
        return ag__err(AG_EINVAL, "verify: %%%s: only placeholders carry a desc", n->name);
    if (n->kind != AG_NODE_OUTPUT && n->has_out_descs)
        return ag__err(AG_EINVAL,
                       "verify: %%%s: only the output node carries output "
                       "descriptors",
                       n->name);
    if (n->kind != AG_NODE_GET_ATTR && (n->constant || n->sub))
        return ag__err(AG_EINVAL, "verify: %%%s: only get_attr nodes hold a constant", n->name);
    if (n->nargs < 0 || n->nargs > AG_MAX_ARGS || n->nvals < 0 || n->nvals > AG_MAX_OUTPUTS)
        return ag__err(AG_EINVAL, "verify: %%%s: %d arguments, %d vals", n->name, n->nargs,
                       n->nvals);
    switch (n->kind) {
    case AG_NODE_PLACEHOLDER:
        if (n->nargs != 0 || n->nvals > 1)
            return ag__err(AG_EINVAL,
                           "verify: %%%s: a placeholder has no arguments and at most "
                           "one val",
                           n->name);
        if (n->desc && !ag_desc_is_input(n->desc))
            return ag__err(AG_EINVAL, "verify: %%%s: the desc is not an input descriptor", n->name);
        return 0;
    case AG_NODE_CALL:
        return check_call(n);
    case AG_NODE_GETITEM:
        return check_getitem(n);
    case AG_NODE_GET_ATTR:
        return check_get_attr(g, n);
    case AG_NODE_OUTPUT:
        return check_output(g, n);
    }
    return ag__err(AG_EINVAL, "verify: %%%s: unknown node kind %d", n->name, (int)n->kind);
}

/* ---- the walk ---- */

/* The list's links and node count; fills the position table and the nodes' index (the order
 * cache of ag_node_index, which writes it the same way for a const graph: a well-linked list
 * leaves it valid, a broken one marks it stale). */
static int links(const ag_graph *g, ptab *t) {
    const ag_node *prev = NULL;
    int64_t pos = 0;
    for (const ag_node *n = g->first; n; prev = n, n = n->next, pos++) {
        if (pos >= g->count)
            return ag__err(AG_EINVAL,
                           "verify: the node list holds more than the graph's %lld "
                           "nodes (a cycle?)",
                           (long long)g->count);
        if (n->prev != prev)
            return ag__err(AG_EINVAL, "verify: %%%s: broken back link", n->name);
        if (n->graph != g)
            return ag__err(AG_EINVAL, "verify: %%%s belongs to another graph", n->name);
        if (ptab_get(t, n) >= 0)
            return ag__err(AG_EINVAL, "verify: %%%s appears twice in the node list", n->name);
        ((ag_node *)n)->index = (int)pos;
        t->at[pos] = n;
        t->n = pos + 1;
    }
    if (prev != g->last)
        return ag__err(AG_EINVAL, "verify: the graph's last node is not the end of its list");
    if (pos != g->count)
        return ag__err(AG_EINVAL, "verify: the graph counts %lld nodes but its list holds %lld",
                       (long long)g->count, (long long)pos);
    return 0;
}

static int check_links(const ag_graph *g, ptab *t) {
    int rc = links(g, t);
    ((ag_graph *)g)->order_dirty = rc != 0;
    return rc;
}

/* The name's hash (0 for no name), its table slot prefetched: the main walk asks it NAME_AHEAD
 * nodes before it checks the name, so that the probes into a large table overlap. */
enum { NAME_AHEAD = 8 };

static uint64_t name_hash_ahead(const ag_graph *g, const ag_node *n) {
    if (!n->name || !*n->name)
        return 0;
    uint64_t h = ag__strhash(n->name);
    ag__strmap_prefetch(&g->names, h);
    return h;
}

/* h: the name's ag__strhash. */
static int check_name(const ag_graph *g, const ag_node *n, int64_t pos, uint64_t h) {
    if (!n->name || !*n->name)
        return ag__err(AG_EINVAL, "verify: node %lld has no name", (long long)pos);
    const ag_node *m = ag__strmap_get_h(&g->names, n->name, h);
    if (m != n) {
        if (m)
            return ag__err(AG_EINVAL, "verify: two nodes are named '%s'", n->name);
        return ag__err(AG_EINVAL, "verify: %%%s is missing from the graph's name table", n->name);
    }
    return 0;
}

static int verify(const ag_graph *g, ptab *t, refs *r) {
    int rc = check_links(g, t);
    if (rc || (rc = refs_init(r, g, t)))
        return rc;
    const ag_node *first_other = NULL, *output = NULL;
    uint64_t ahead[NAME_AHEAD]; /* the hashes of the names of nodes pos .. pos + NAME_AHEAD - 1 */
    for (int64_t k = 0; k < NAME_AHEAD && k < t->n; k++)
        ahead[k] = name_hash_ahead(g, t->at[k]);
    int64_t pos = 0;
    for (const ag_node *n = g->first; n; n = n->next, pos++) {
        uint64_t h = ahead[pos % NAME_AHEAD];
        if (pos + NAME_AHEAD < t->n)
            ahead[pos % NAME_AHEAD] = name_hash_ahead(g, t->at[pos + NAME_AHEAD]);
        if ((rc = check_name(g, n, pos, h)))
            return rc;
        if (output)
            return ag__err(AG_EINVAL, "verify: the output node %%%s is not last (%%%s follows it)",
                           output->name, n->name);
        if (n->kind == AG_NODE_PLACEHOLDER && first_other)
            return ag__err(AG_EINVAL,
                           "verify: placeholder %%%s comes after %%%s (placeholders "
                           "come first)",
                           n->name, first_other->name);
        if (n->kind != AG_NODE_PLACEHOLDER && !first_other)
            first_other = n;
        if (n->kind == AG_NODE_OUTPUT)
            output = n;
        for (int i = 0; i < n->nargs; i++) {
            const ag_garg *a = &n->args[i];
            if (a->kind == AG_GA_NODE && a->u.node)
                rc = check_ref(t, r, n, pos, a->u.node);
            else if (a->kind == AG_GA_NODE && n->kind != AG_NODE_OUTPUT)
                rc = ag__err(AG_EINVAL, "verify: %%%s: argument %d is a NULL node", n->name, i);
            else if (a->kind == AG_GA_NODES && a->n > 0 && !a->u.nodes)
                rc =
                    ag__err(AG_EINVAL, "verify: %%%s: argument %d is a NULL node list", n->name, i);
            else if (a->kind == AG_GA_NODES || a->kind == AG_GA_TUPLE)
                for (int k = 0, cnt = ag__garg_nrefs(a); k < cnt && rc == 0; k++)
                    if (ag__garg_ref(a, k))
                        rc = check_ref(t, r, n, pos, ag__garg_ref(a, k));
            if (rc)
                return rc;
        }
        if ((rc = check_users(t, r, n, pos)) || (rc = check_node(g, n)))
            return rc;
    }
    if (!output)
        return ag__err(AG_EINVAL, "verify: the graph has no output node");
    if (g->names.len != g->count)
        return ag__err(AG_EINVAL, "verify: the name table holds %lld names for %lld nodes",
                       (long long)g->names.len, (long long)g->count);
    return 0;
}

static int verify_one(const ag_graph *g) {
    ptab t;
    if (ptab_init(&t, g->count))
        return AG_ENOMEM;
    refs r = {0};
    int rc = verify(g, &t, &r);
    ptab_free(&t);
    refs_free(&r);
    return rc;
}

/* g's subgraphs, each a whole graph of its own (its nodes reference only its nodes: check_links
 * and check_ref see to that), then theirs; errors prefixed "verify: subgraph NAME: " per
 * level. */
static int verify_subgraphs(const ag_graph *g) {
    int rc = 0;
    for (int i = 0; i < g->nsubs && rc == 0; i++) {
        const ag__subgraph *s = &g->subs[i];
        if (s->g->parent != g)
            return ag__err(AG_EINVAL, "verify: subgraph %s: not owned by the graph", s->name);
        rc = verify_one(s->g);
        if (rc == 0)
            rc = verify_subgraphs(s->g);
        if (rc == AG_EINVAL) {
            char msg[512];
            const char *e = ag_last_error();
            snprintf(msg, sizeof msg, "%s", strncmp(e, "verify: ", 8) ? e : e + 8);
            rc = ag__err(AG_EINVAL, "verify: subgraph %s: %s", s->name, msg);
        }
    }
    return rc;
}

/* The graph, then each subgraph. */
int ag_graph_verify(const ag_graph *g) {
    AG__CHECK_NULL("graph_verify", g);
    int rc = verify_one(g);
    return rc ? rc : verify_subgraphs(g);
}
