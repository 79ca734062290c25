/* Partitioning the regions a joint calls through invoke_subgraph (upstream's partitioning of
 * invoke_subgraph's joint subgraphs, before the outer partition; spec §9, test 23).
 *
 * In: a joint whose forward calls a region's forward subgraph
 *     invoke_subgraph(fw_subgraph, 'fw_subgraph_I', operands...)
 * and whose backward calls the region's joint subgraph
 *     invoke_subgraph(bw_subgraph, 'bw_subgraph_I_0', operands..., tangents...)
 *       -> (grad of each operand..., forward outputs...)
 * with the same operand nodes, first. Out: a copy of the joint where each distinct joint
 * subgraph is partitioned once, with the outer joint's partitioner and options, into
 *     partitioned_fw_subgraph_I_0: (operands...) -> (forward outputs..., saved...)
 *     partitioned_bw_subgraph_I_0: (saved..., tangents...) -> (grads...)
 * and every call pair rewritten to call them: the forward call also returns the saved values
 * (one getitem each), the backward call takes them before its tangents; the backward call's
 * reads of forward outputs read the forward call's. The outer partition then sees the calls as
 * opaque ops (never recomputed: invoke_subgraph is outside the recomputable set) whose saved
 * getitems become the outer saved values.
 *
 * Which call is which: a call reached from a tangent (the partitioner's required-backward
 * set) is a backward call; the others are forward calls. A forward call without a backward
 * call stays as it is (a region nothing differentiates). A backward call whose first operands
 * are not those of a forward call, or whose counts do not fit (operands = the forward's +
 * one tangent per forward output; outputs = one grad per operand + the forward outputs), is
 * refused with a message naming it. */
#include "partition_internal.h"

#include <stdio.h>

typedef struct call_info {
    ag_node *n;          /* the call in the joint */
    ag_graph *sub;       /* its subgraph */
    int nops, nph, nout; /* operands, the subgraph's placeholders and outputs */
    bool bw;             /* reached from a tangent */
    int pair;            /* the other call of its pair, or -1 */
    int part;            /* bw calls: index of the partitioned pair in parts[] */
    int rw;              /* bw calls: the pair's place in the rewrite order */
} call_info;

typedef struct part_pair {
    ag_graph *joint_sub; /* the bw joint subgraph partitioned (borrowed) */
    char fw_name[96], bw_name[96];
    int nfo, nsaved, ngrads;
    ag_partition_stats st; /* the region's partition: what one call's backward recomputes */
} part_pair;

static int num_placeholders(const ag_graph *g) {
    int k = 0;
    for (ag_node *n = ag_graph_first(g); n; n = ag__node_next(n))
        k += ag__node_kind(n) == AG_NODE_PLACEHOLDER;
    return k;
}

static int num_outputs(const ag_graph *g) {
    const ag_node *o = ag_graph_output_node(g);
    return o ? ag__node_arg(o, 0)->n : 0;
}

/* Removes every descriptor of g (descriptors live on the outer graph only). */
static int strip_descs(ag_graph *g) {
    for (ag_node *n = ag_graph_first(g); n; n = ag__node_next(n))
        if (ag__node_kind(n) == AG_NODE_PLACEHOLDER && ag_node_set_desc(n, NULL))
            return ag_last_status();
    ag_node *o = ag_graph_output_node(g);
    for (int i = 0; i < o->nout_descs; i++)
        ag_desc_release(o->out_descs[i]);
    ag__free(o->out_descs);
    o->out_descs = NULL;
    o->nout_descs = 0;
    o->has_out_descs = false;
    return 0;
}

/* ---- saved views ----
 * A saved value that is a view (t of a weight, the heads' transposes of a projection) would
 * leave the region's forward as a copy: the caller's buffer for a call's output is a tensor of
 * its own, and the subgraph's plan copies a view into it at every call. A flat graph's saved
 * view costs nothing (it stays a view of its base). So the region's forward saves the view's
 * base instead (the root of its chain of view ops, saved once whatever number of views it
 * has; an operand passed through when the root is one) and the backward replays the views on
 * it: views are metadata, the data is the same. */

enum { VIEW_CHAIN_MAX = 16 };

/* A view op call reading one tensor, its first argument (what replay_view copies). */
static bool is_view_call(const ag_node *x) {
    if (!x || ag_node_kind_of(x) != AG_NODE_CALL || ag__call_subgraph(x) ||
        !(ag_op_def(ag__node_op(x))->flags & AG_OP_VIEW) ||
        (ag_op_def(ag__node_op(x))->flags & AG_OP_INPLACE) || !ag__node_arg_node(x, 0) ||
        ag__node_nargs(x) > AG_MAX_ARGS)
        return false;
    for (int i = 1; i < ag__node_nargs(x); i++) {
        const ag_garg *a = ag__node_arg(x, i);
        if ((a->kind == AG_GA_NODE && a->u.node) || a->kind == AG_GA_NODES)
            return false;
    }
    return true;
}

/* The chain of views from x's root to x (chain[0] the first view, chain[n-1] x): n, 0 when x
 * is no view, -1 when the chain is too long to replay. *root: the base. */
static int view_chain(ag_node *x, ag_node **chain, ag_node **root) {
    ag_node *rev[VIEW_CHAIN_MAX];
    int n = 0;
    for (;;) {
        ag_node *src = NULL;
        if (is_view_call(x))
            src = ag__node_arg_node(x, 0);
        else if (ag_node_kind_of(x) == AG_NODE_GETITEM && is_view_call(ag__node_arg_node(x, 0)))
            src = ag__node_arg_node(x, 0); /* a piece of split: the split is a view */
        if (!src)
            break;
        if (n == VIEW_CHAIN_MAX)
            return -1;
        rev[n++] = x;
        x = src;
    }
    *root = x;
    for (int i = 0; i < n; i++)
        chain[i] = rev[n - 1 - i];
    return n;
}

/* bw's copy of view node x of fw (is_view_call, or a getitem of one) reading `base`, bw's
 * copy of x's argument. */
static ag_node *replay_view(ag_graph *bw, ag_node *x, ag_node *base) {
    if (ag_node_kind_of(x) == AG_NODE_GETITEM)
        return ag_graph_getitem(bw, base, (int)ag__node_arg(x, 1)->u.i, NULL);
    ag_garg args[AG_MAX_ARGS];
    int na = ag__node_nargs(x);
    for (int i = 0; i < na; i++)
        args[i] = *ag__node_arg(x, i);
    args[0].u.node = base;
    return ag_graph_call(bw, ag__node_op(x), args, na, NULL);
}

/* The rewrite above on the region's partitioned pair (m forward outputs; no descriptors). */
static int save_view_bases(ag_graph *fw, ag_graph *bw, int m) {
    ag_node *fo = ag_graph_output_node(fw);
    const ag_garg *fa = ag__node_arg(fo, 0);
    int s = fa->n - m;
    ag_node **ph = NULL;
    int nph = ag_graph_placeholders(bw, &ph);
    if (nph < 0)
        return nph;
    if (nph < s)
        return ag__err(AG_EINVAL, "partition: the region's backward takes %d values, not %d saved",
                       nph, s);
    ag_node *chain[VIEW_CHAIN_MAX];
    bool any = false;
    for (int j = 0; j < s && !any; j++) {
        ag_node *root;
        any = view_chain(fa->u.nodes[m + j], chain, &root) > 0;
    }
    if (!any)
        return 0;
    /* The new saved list: each old saved value's root, once, in order. */
    ag_node **outs = ag__malloc(sizeof(ag_node *) * (size_t)(m + s));
    ag_node **old = ag__malloc(sizeof(ag_node *) * (size_t)(s + 1));
    ag_node **newph = ag__malloc(sizeof(ag_node *) * (size_t)(s + 1));
    int rc = 0, ns = 0;
    if (!outs || !old || !newph) {
        rc = AG_ENOMEM;
        goto done;
    }
    for (int i = 0; i < m; i++)
        outs[i] = fa->u.nodes[i];
    for (int j = 0; j < s; j++)
        old[j] = ph[j]; /* ph is the graph's cache: it changes with the placeholders */
    ag_node *first_tangent = s < nph ? ph[s] : NULL, *body = NULL;
    for (ag_node *x = ag_graph_first(bw); x && !body; x = ag__node_next(x))
        if (ag_node_kind_of(x) != AG_NODE_PLACEHOLDER)
            body = x;
    for (int j = 0; j < s && rc == 0; j++) {
        ag_node *v = fa->u.nodes[m + j], *root = v;
        int n = view_chain(v, chain, &root);
        if (n < 0)
            root = v, n = 0;
        int b = 0;
        while (b < ns && outs[m + b] != root)
            b++;
        if (b == ns) { /* a new saved value: its placeholder next, before the tangents */
            const char *nm = ag__node_name(root);
            ag_node *p = n == 0 ? old[j] /* kept */
                                : ag_graph_placeholder(bw, ag_graph_find(bw, nm) ? NULL : nm,
                                                       ag__node_val(root, 0));
            if (!p || (first_tangent && (rc = ag_graph_move_before(bw, p, first_tangent))))
                goto fail;
            if (n == 0)
                old[j] = NULL;
            outs[m + ns] = root;
            newph[ns++] = p;
        }
        /* The old placeholder's readers read the base, or its views replayed on it. */
        ag_node *by = newph[b];
        if (n > 0) { /* chain[i] reads chain[i - 1] (the root for i = 0) */
            if (body)
                ag_graph_insert_before(bw, body);
            for (int i = 0; i < n && by; i++)
                by = replay_view(bw, chain[i], by);
            ag_graph_insert_at_end(bw);
            if (!by)
                goto fail;
            if (!ag__tmeta_equal(ag__node_val(by, 0), ag__node_val(old[j], 0))) {
                rc = ag__err(AG_EINVAL,
                             "partition: the view %%%s replayed in the region's "
                             "backward differs from the saved one",
                             ag__node_name(v));
                goto done;
            }
        }
        if (old[j] && ag_node_replace_all_uses(old[j], by) < 0)
            goto fail;
    }
    for (int j = 0; j < s && rc == 0; j++)
        if (old[j])
            rc = ag_graph_erase(bw, old[j]);
    if (rc == 0 && (rc = ag_graph_erase(fw, fo)) == 0 && !ag_graph_output(fw, outs, m + ns))
        goto fail;
    if (rc == 0 && (rc = ag_graph_dce(fw)) > 0)
        rc = 0;
    goto done;
fail:
    ag_graph_insert_at_end(bw);
    rc = ag_last_status() ? ag_last_status() : AG_ENOMEM;
done:
    ag__free(outs);
    ag__free(old);
    ag__free(newph);
    return rc;
}

/* Partitions joint subgraph S (k operands, m forward outputs) into *fw, *bw. */
static int partition_region(const ag_graph *S, int k, int m, const ag_partition_opts *opts,
                            ag__budget_mode mode, ag_graph **fw, ag_graph **bw,
                            ag_partition_stats *st) {
    *fw = *bw = NULL;
    ag_graph *Q = ag_graph_copy(S);
    if (!Q)
        return ag_last_status() ? ag_last_status() : AG_ENOMEM;
    int rc = 0;
    /* The partitioner's joint form: operands are primals, the rest tangents (told by their
     * descriptors), forward outputs first. */
    ag_node **ph = NULL;
    int nph = ag_graph_placeholders(Q, &ph);
    if (nph < 0)
        rc = nph;
    else if (nph != k + m)
        rc =
            ag__err(AG_EINVAL, "partition: the region's joint subgraph has %d placeholders, not %d",
                    nph, k + m);
    for (int i = 0; i < nph && rc == 0; i++) {
        ag_desc *d = NULL;
        if (i < k) {
            d = ag_desc_plain_input(i);
        } else {
            ag_desc *od = ag_desc_plain_output(i - k);
            d = od ? ag_desc_tangent(od) : NULL;
            ag_desc_release(od);
        }
        rc = d ? ag_node_set_desc(ph[i], d) : AG_ENOMEM;
        ag_desc_release(d);
    }
    ag_node *o = ag_graph_output_node(Q);
    ag_node *outs[AG_MAX_OUTPUTS];
    const ag_garg *oa = ag__node_arg(o, 0);
    for (int i = 0; i < m; i++)
        outs[i] = oa->u.nodes[k + i];
    for (int i = 0; i < k; i++)
        outs[m + i] = oa->u.nodes[i];
    if (rc == 0)
        rc = ag_graph_erase(Q, o);
    if (rc == 0 && !ag_graph_output(Q, outs, k + m))
        rc = ag_last_status() ? ag_last_status() : AG_ENOMEM;
    if (rc == 0)
        rc = ag__partition_ex(Q, m, opts, mode, fw, bw, st, NULL);
    ag_graph_free(Q);
    if (rc == 0 && num_outputs(*fw) > AG_MAX_OUTPUTS)
        rc = ag__err(AG_EINVAL,
                     "partition: the region's partitioned forward returns %d values (its %d "
                     "outputs and %d saved; an invoke_subgraph returns at most %d)",
                     num_outputs(*fw), m, num_outputs(*fw) - m, AG_MAX_OUTPUTS);
    if (rc == 0 && !(rc = strip_descs(*fw)))
        rc = strip_descs(*bw);
    if (rc == 0)
        rc = save_view_bases(*fw, *bw, m);
    if (rc) {
        ag_graph_free(*fw);
        ag_graph_free(*bw);
        *fw = *bw = NULL;
    }
    return rc;
}

/* ---- regions in regions ----
 * A region called inside another region's body is called from the outer region's joint
 * subgraph too: partitioning the outer region partitions its joint subgraph, which partitions
 * the inner one's (ag__partition_ex recurses through this file). The inner region is partitioned
 * once: while a partition of a joint with nested regions runs, each region's partition is kept
 * (this thread's memo, made by the outermost call), keyed by its backward identifier and its
 * joint subgraph's text, and a call of the same region at another level takes a copy. */

typedef struct memo_entry {
    char *id, *text;   /* the backward call's identifier, the joint subgraph printed */
    ag_graph *fw, *bw; /* the partitioned pair (owned) */
    ag_partition_stats st;
} memo_entry;

typedef struct part_memo {
    memo_entry *e;
    int64_t n, cap;
} part_memo;

static _Thread_local part_memo *memo;

static void memo_free(part_memo *m) {
    for (int64_t i = 0; m && i < m->n; i++) {
        ag__free(m->e[i].id);
        ag__free(m->e[i].text);
        ag_graph_free(m->e[i].fw);
        ag_graph_free(m->e[i].bw);
    }
    if (m)
        ag__free(m->e);
    ag__free(m);
}

/* Whether any subgraph of g has subgraphs of its own (a region in a region). */
static bool has_nested(const ag_graph *g) {
    for (int i = 0; i < ag_graph_num_subgraphs(g); i++)
        if (ag_graph_num_subgraphs(ag_graph_subgraph_at(g, i, NULL)) > 0)
            return true;
    return false;
}

static char *memo_text(const ag_graph *S) {
    static const ag_print_opts po = {.no_meta = true};
    return ag_graph_to_string(S, &po);
}

/* The memo's pair for joint subgraph S called as id: copies in *fw, *bw (1), none (0), or a
 * status. *text: S printed, for memo_put (the caller frees it). */
static int memo_get(const char *id, const ag_graph *S, char **text, ag_graph **fw, ag_graph **bw,
                    ag_partition_stats *st) {
    *text = NULL;
    if (!memo)
        return 0;
    if (!(*text = memo_text(S)))
        return ag_last_status() ? ag_last_status() : AG_ENOMEM;
    for (int64_t i = 0; i < memo->n; i++) {
        const memo_entry *e = &memo->e[i];
        if (strcmp(e->id, id) || strcmp(e->text, *text))
            continue;
        *fw = ag_graph_copy(e->fw);
        *bw = *fw ? ag_graph_copy(e->bw) : NULL;
        if (!*bw) {
            ag_graph_free(*fw);
            *fw = NULL;
            return ag_last_status() ? ag_last_status() : AG_ENOMEM;
        }
        *st = e->st;
        return 1;
    }
    return 0;
}

/* Keeps copies of the pair partitioned from the joint subgraph printed as text (taken). */
static int memo_put(const char *id, char *text, const ag_graph *fw, const ag_graph *bw,
                    const ag_partition_stats *st) {
    if (!memo || !text) {
        ag__free(text);
        return 0;
    }
    memo_entry e = {ag__strdup(id), text, ag_graph_copy(fw), ag_graph_copy(bw), *st};
    if (!e.id || !e.fw || !e.bw ||
        ag__grow((void **)&memo->e, &memo->cap, memo->n + 1, sizeof *memo->e)) {
        ag__free(e.id);
        ag__free(e.text);
        ag_graph_free(e.fw);
        ag_graph_free(e.bw);
        return ag_last_status() ? ag_last_status() : AG_ENOMEM;
    }
    memo->e[memo->n++] = e;
    return 0;
}

/* Partitions region joint subgraph S (called as id; k operands, m forward outputs), or copies
 * the memo's partition of it. */
static int partition_region_once(const char *id, const ag_graph *S, int k, int m,
                                 const ag_partition_opts *opts, ag__budget_mode mode, ag_graph **fw,
                                 ag_graph **bw, ag_partition_stats *st) {
    char *text = NULL;
    int rc = memo_get(id, S, &text, fw, bw, st);
    if (rc != 0) {
        ag__free(text);
        return rc < 0 ? rc : 0;
    }
    rc = partition_region(S, k, m, opts, mode, fw, bw, st);
    if (rc == 0 && (rc = memo_put(id, text, *fw, *bw, st)) != 0) {
        ag_graph_free(*fw);
        ag_graph_free(*bw);
        *fw = *bw = NULL;
    } else if (rc) {
        ag__free(text);
    }
    return rc;
}

/* The attribute name of the subgraph n's get_attr reads in g. */
static const char *attr_name(const ag_graph *g, const ag_graph *sub) {
    for (int i = 0; i < ag_graph_num_subgraphs(g); i++) {
        const char *nm;
        if (ag_graph_subgraph_at(g, i, &nm) == sub)
            return nm;
    }
    return NULL;
}

/* ---- the rewrite ----
 * The outer graph is built in one pass over the joint (ag__graph_copy_nodes): every node is
 * copied but the pairs' calls, their getitems and the get_attrs only they read. At a pair's
 * forward call come its new forward call and getitems (one per old getitem, then the forward
 * outputs nobody read, then one per saved value), at its backward call the new backward call
 * and one getitem per old getitem of a grad; whatever read an old getitem reads its
 * replacement. The new nodes are named as a copy of the joint rewritten pair by pair would
 * name them (what the printed graphs show): pairs in the backward calls' order, each node by
 * the graph's counters against the names in use at that point (the joint's, less the pairs
 * already rewritten, plus the new ones). name_pairs works the names out first; the nodes are
 * made afterwards in graph order, where every operand they read already stands. */

/* The new names' text, in 16 KB chunks (a name is at most 159 characters). */
typedef struct rw_chunk {
    struct rw_chunk *next;
    size_t used;
    char data[16384];
} rw_chunk;

typedef struct rw_state {
    const ag_graph *src; /* the joint as the partitioner reads it (P.g) */
    call_info *calls;
    part_pair *parts;
    char **names; /* the new nodes' names, pair by pair: forward group, backward group */
    int nnames;
    int *nm_f0, *nm_b0;      /* per pair (rewrite order): where its groups' names start */
    bool *erased;            /* per joint node: gone in the rewrite so far */
    int *role;               /* per joint node: 0 copied, -1 dropped, 1 + index of a pair's call */
    ag__strmap made;         /* the names given so far */
    rw_chunk *text;          /* their characters */
    ag_node **fget, **saved; /* per pair: AG_MAX_OUTPUTS each */
    ag__name_gen gen[2];     /* "getitem" and invoke_subgraph's call name, worked out once */
    bool gen_ok[2];
} rw_state;

static bool rw_taken_h(void *ctx, const char *name, uint64_t h) {
    const rw_state *st = ctx;
    const ag_node *x = ag__strmap_get_h(&st->src->names, name, h);
    return (x && !st->erased[ag__node_index(x)]) || ag__strmap_get_h(&st->made, name, h);
}

static bool rw_taken(void *ctx, const char *name) {
    return rw_taken_h(ctx, name, ag__strhash(name));
}

/* Keeps name nm (its ag__strhash h) as the next new node's. */
static int rw_keep(rw_state *st, const char *nm, uint64_t h) {
    size_t len = strlen(nm) + 1;
    if (!st->text || st->text->used + len > sizeof st->text->data) {
        rw_chunk *c = ag__malloc(sizeof *c);
        if (!c)
            return AG_ENOMEM;
        c->next = st->text;
        c->used = 0;
        st->text = c;
    }
    char *d = st->text->data + st->text->used;
    memcpy(d, nm, len);
    st->text->used += len;
    st->names[st->nnames++] = d;
    int rc = ag__strmap_put_new_h(&st->made, d, d, h); /* not taken: never 1 */
    return rc < 0 ? rc : 0;
}

/* The next new node's name: `candidate` itself when free and `exact` (a get_attr of a
 * subgraph takes the attribute's name), else the counters' next. */
static int rw_name(rw_state *st, ag_graph *g, const char *candidate, bool exact) {
    char buf[160];
    const char *nm = candidate;
    if (!exact || rw_taken(st, candidate)) {
        if (ag__graph_make_name(g, candidate, rw_taken, st, buf))
            return AG_ENOMEM;
        nm = buf;
    }
    return rw_keep(st, nm, ag__strhash(nm));
}

/* rw_name(candidate k of st->gen, false), the candidate worked out once (the same names). */
static int rw_name_gen(rw_state *st, ag_graph *g, int k, const char *candidate) {
    if (!st->gen_ok[k])
        return rw_name(st, g, candidate, false);
    uint64_t h;
    const char *nm = ag__graph_name_gen_next(g, &st->gen[k], rw_taken_h, st, &h);
    return rw_keep(st, nm, h);
}

/* What erasing call c did: its getitems, c, and its get_attr once nothing reads it. */
static void rw_erase_call(rw_state *st, const ag_node *c) {
    for (int u = 0; u < ag__node_num_users(c); u++)
        st->erased[ag__node_index(ag__node_user(c, u))] = true;
    st->erased[ag__node_index(c)] = true;
    const ag_node *a = ag__node_arg_node(c, 0);
    bool read = false;
    for (int u = 0; u < ag__node_num_users(a) && !read; u++)
        read = !st->erased[ag__node_index(ag__node_user(a, u))];
    if (!read)
        st->erased[ag__node_index(a)] = true;
}

static int name_pairs(rw_state *st, ag_graph *g, int ncalls, int nn) {
    int cap = 1, npairs = 0, rc = 0;
    for (int b = 0; b < ncalls; b++) {
        const call_info *B = &st->calls[b];
        if (!B->bw)
            continue;
        const part_pair *pp = &st->parts[B->part];
        cap += 4 + ag__node_num_users(st->calls[B->pair].n) + pp->nfo + pp->nsaved +
               ag__node_num_users(B->n);
        npairs++;
    }
    st->names = ag__calloc((size_t)cap, sizeof *st->names);
    st->nm_f0 = ag__malloc(sizeof(int) * (size_t)(2 * npairs + 1));
    st->erased = ag__calloc((size_t)(nn ? nn : 1), sizeof *st->erased);
    st->role = ag__malloc(sizeof(int) * (size_t)(nn ? nn : 1));
    st->fget = ag__malloc(sizeof(ag_node *) * (size_t)(2 * npairs * AG_MAX_OUTPUTS + 1));
    if (!st->names || !st->nm_f0 || !st->erased || !st->role || !st->fget ||
        ag__strmap_reserve(&st->made, cap))
        return AG_ENOMEM;
    st->nm_b0 = st->nm_f0 + npairs;
    st->saved = st->fget + npairs * AG_MAX_OUTPUTS;
    char call_base[96];
    ag__call_name_base(ag_op_invoke_subgraph(), call_base);
    for (int k = 0; k < 2; k++) {
        int r = ag__graph_name_gen_init(g, k ? call_base : "getitem", &st->gen[k]);
        if (r < 0)
            return r;
        st->gen_ok[k] = r == 0;
    }
    int p = 0;
    for (int b = 0; b < ncalls && rc == 0; b++) {
        call_info *B = &st->calls[b];
        if (!B->bw)
            continue;
        const call_info *F = &st->calls[B->pair];
        const part_pair *pp = &st->parts[B->part];
        B->rw = p;
        st->nm_f0[p] = st->nnames;
        bool got[AG_MAX_OUTPUTS] = {0};
        rc = rw_name(st, g, pp->fw_name, true);
        if (rc == 0)
            rc = rw_name_gen(st, g, 1, call_base);
        for (int u = 0; u < ag__node_num_users(F->n) && rc == 0; u++) {
            got[ag__node_arg(ag__node_user(F->n, u), 1)->u.i] = true;
            rc = rw_name_gen(st, g, 0, "getitem");
        }
        for (int i = 0; i < pp->nfo && rc == 0; i++)
            if (!got[i])
                rc = rw_name_gen(st, g, 0, "getitem");
        for (int j = 0; j < pp->nsaved && rc == 0; j++)
            rc = rw_name_gen(st, g, 0, "getitem");
        st->nm_b0[p] = st->nnames;
        if (rc == 0)
            rc = rw_name(st, g, pp->bw_name, true);
        if (rc == 0)
            rc = rw_name_gen(st, g, 1, call_base);
        for (int u = 0; u < ag__node_num_users(B->n) && rc == 0; u++)
            if (ag__node_arg(ag__node_user(B->n, u), 1)->u.i < F->nops)
                rc = rw_name_gen(st, g, 0, "getitem");
        rw_erase_call(st, B->n);
        rw_erase_call(st, F->n);
        p++;
    }
    for (int i = 0; i < nn; i++)
        st->role[i] = st->erased[i] ? -1 : 0;
    for (int c = 0; c < ncalls; c++)
        if (st->calls[c].pair >= 0)
            st->role[ag__node_index(st->calls[c].n)] = 1 + c;
    return rc;
}

/* The status of a graph API call that returned NULL. */
static int api_fail(void) {
    return ag_last_status() ? ag_last_status() : AG_ENOMEM;
}

/* A getitem of call c at idx named nm (its metadata from like, when given). */
static ag_node *rw_getitem(ag_graph *g, ag_node *c, int idx, const char *nm, const ag_node *like) {
    ag_node *x = ag_graph_getitem(g, c, idx, nm);
    if (x && like && (ag__node_meta_copy(x, like) || ag_node_custom_copy(x, like)))
        return NULL;
    return x;
}

/* A call of attribute `attr` (its get_attr named nms[0], the call nms[1]) with operands,
 * metadata from like. */
static ag_node *rw_call(ag_graph *g, const char *attr, char *const *nms, ag_node **ops, int nops,
                        const ag_node *like) {
    ag_node *a = ag_graph_get_attr_subgraph(g, attr, nms[0]);
    ag_node *c = a ? ag_graph_invoke_subgraph(g, a, attr, ops, nops, nms[1]) : NULL;
    if (c && (ag__node_meta_copy(c, like) || ag_node_custom_copy(c, like)))
        c = NULL;
    return c;
}

/* The copies of the first n operands of call c of the joint, from off, into ops. */
static int rw_operands(const ag__copy_map *map, const ag_node *c, int off, int n, ag_node **ops) {
    const ag_garg *a = ag__node_arg(c, 2);
    for (int i = 0; i < n; i++)
        if (!(ops[i] = ag__copy_map_get(map, a->u.nodes[off + i])))
            return ag__err(AG_EINVAL, "partition: %%%s reads %%%s before it is rewritten",
                           ag__node_name(c), ag__node_name(a->u.nodes[off + i]));
    return 0;
}

/* The forward call F of a pair: its new call and getitems. */
static int rw_forward(rw_state *st, ag_graph *g, const call_info *F, ag__copy_map *map) {
    const call_info *B = &st->calls[F->pair];
    const part_pair *pp = &st->parts[B->part];
    char **nm = st->names + st->nm_f0[B->rw];
    ag_node **fget = st->fget + B->rw * AG_MAX_OUTPUTS,
            **saved = st->saved + B->rw * AG_MAX_OUTPUTS;
    int k = F->nops, m = pp->nfo, s = pp->nsaved, t = 2;
    ag_node **ops = ag__malloc(sizeof(ag_node *) * (size_t)(k + 1));
    int rc = ops ? rw_operands(map, F->n, 0, k, ops) : AG_ENOMEM;
    ag_node *F2 = rc ? NULL : rw_call(g, pp->fw_name, nm, ops, k, F->n);
    ag__free(ops);
    if (rc || !F2)
        return rc ? rc : api_fail();
    memset(fget, 0, sizeof(ag_node *) * AG_MAX_OUTPUTS);
    for (int u = 0; u < ag__node_num_users(F->n); u++) {
        const ag_node *x = ag__node_user(F->n, u);
        int i = (int)ag__node_arg(x, 1)->u.i;
        if (!(fget[i] = rw_getitem(g, F2, i, nm[t++], x)))
            return api_fail();
    }
    for (int i = 0; i < m; i++)
        if (!fget[i] && !(fget[i] = rw_getitem(g, F2, i, nm[t++], NULL)))
            return api_fail();
    for (int j = 0; j < s; j++)
        if (!(saved[j] = rw_getitem(g, F2, m + j, nm[t++], NULL)))
            return api_fail();
    for (int u = 0; u < ag__node_num_users(F->n); u++) {
        const ag_node *x = ag__node_user(F->n, u);
        ag__copy_map_set(map, x, fget[ag__node_arg(x, 1)->u.i]);
    }
    return 0;
}

/* The backward call B of a pair: its new call, reading the saved values, and its grads'
 * getitems (its forward outputs are the forward call's). */
static int rw_backward(rw_state *st, ag_graph *g, const call_info *B, ag__copy_map *map) {
    const part_pair *pp = &st->parts[B->part];
    char **nm = st->names + st->nm_b0[B->rw];
    ag_node **fget = st->fget + B->rw * AG_MAX_OUTPUTS,
            **saved = st->saved + B->rw * AG_MAX_OUTPUTS;
    int k = st->calls[B->pair].nops, m = pp->nfo, s = pp->nsaved, t = 2;
    ag_node **ops = ag__malloc(sizeof(ag_node *) * (size_t)(s + m + 1));
    int rc = ops ? rw_operands(map, B->n, k, m, ops + s) : AG_ENOMEM;
    if (rc == 0)
        memcpy(ops, saved, sizeof(ag_node *) * (size_t)s);
    ag_node *B2 = rc ? NULL : rw_call(g, pp->bw_name, nm, ops, s + m, B->n);
    ag__free(ops);
    if (rc || !B2)
        return rc ? rc : api_fail();
    for (int u = 0; u < ag__node_num_users(B->n); u++) {
        const ag_node *x = ag__node_user(B->n, u);
        int i = (int)ag__node_arg(x, 1)->u.i;
        ag_node *by = i < k ? rw_getitem(g, B2, i, nm[t++], x) : fget[i - k];
        if (!by)
            return api_fail();
        ag__copy_map_set(map, x, by);
    }
    return 0;
}

static int rw_hook(void *ctx, ag_graph *g, const ag_node *n, ag__copy_map *map) {
    rw_state *st = ctx;
    int r = st->role[ag__node_index(n)];
    if (r <= 0)
        return r < 0;
    const call_info *c = &st->calls[r - 1];
    int rc = c->bw ? rw_backward(st, g, c, map) : rw_forward(st, g, c, map);
    return rc ? rc : 1;
}

static void rw_free(rw_state *st) {
    for (rw_chunk *c = st->text, *next; c; c = next) {
        next = c->next;
        ag__free(c);
    }
    ag__free(st->names);
    ag__free(st->nm_f0);
    ag__free(st->erased);
    ag__free(st->role);
    ag__free(st->fget);
    ag__strmap_free(&st->made);
}

/* Whether B's first nops(F) operands are F's, and the counts fit a region's pair. */
static bool pairs_with(const call_info *F, const call_info *B) {
    if (B->nops != F->nops + F->nout || B->nout != F->nops + F->nout)
        return false;
    const ag_garg *fa = ag__node_arg(F->n, 2), *ba = ag__node_arg(B->n, 2);
    for (int i = 0; i < F->nops; i++)
        if (fa->u.nodes[i] != ba->u.nodes[i])
            return false;
    return true;
}

int ag__partition_subgraphs(const ag_graph *joint, int num_fwd_outputs,
                            const ag_partition_opts *opts, ag__budget_mode mode, ag_graph **out,
                            ag_partition_stats *inner) {
    *out = NULL;
    *inner = (ag_partition_stats){0};
    /* The outermost partition of a joint with regions in regions keeps each region's partition
     * for the levels below (memo above). */
    part_memo *own_memo = NULL;
    if (!memo && has_nested(joint)) {
        if (!(own_memo = ag__calloc(1, sizeof *own_memo)))
            return AG_ENOMEM;
        memo = own_memo;
    }
    ag__part P;
    bool *req_bw = NULL; /* per node of P.g */
    int rc = ag__part_init_req_bw(&P, joint, num_fwd_outputs, &req_bw);
    if (rc) {
        if (own_memo) {
            memo_free(own_memo);
            memo = NULL;
        }
        return rc;
    }
    /* The outer graph: P.g's subgraphs and name counters now, its nodes after the pairing. */
    ag_graph *g = ag__graph_copy_shell(P.g);
    int maxcalls = 1; /* the tables below hold one entry per call, not per node */
    for (ag_node *n = ag_graph_first(P.g); n; n = ag__node_next(n))
        maxcalls += ag__call_subgraph(n) != NULL;
    call_info *calls = ag__calloc((size_t)maxcalls, sizeof *calls);
    part_pair *parts = ag__calloc((size_t)maxcalls, sizeof *parts);
    ag_graph **made = ag__calloc((size_t)(2 * maxcalls + 1), sizeof *made);
    int ncalls = 0, nparts = 0, nmade = 0;
    rw_state st = {.src = P.g, .calls = calls, .parts = parts};
    if (!g || !calls || !parts || !made) {
        rc = ag_last_status() ? ag_last_status() : AG_ENOMEM;
        goto done;
    }
    int i = 0;
    for (ag_node *n = ag_graph_first(P.g); n; n = ag__node_next(n), i++) {
        const ag_graph *sub = ag__call_subgraph(n);
        if (!sub)
            continue;
        call_info *c = &calls[ncalls++];
        c->n = n;
        c->sub = (ag_graph *)sub;
        c->nops = ag__node_arg(n, 2)->n;
        c->nph = num_placeholders(sub);
        c->nout = num_outputs(sub);
        c->bw = req_bw[i];
        c->pair = c->part = c->rw = -1;
    }
    /* Pair every backward call with an unpaired forward call before it. */
    for (int b = 0; b < ncalls; b++) {
        call_info *B = &calls[b];
        if (!B->bw)
            continue;
        for (int f = 0; f < b && B->pair < 0; f++)
            if (!calls[f].bw && calls[f].pair < 0 && pairs_with(&calls[f], B)) {
                B->pair = f;
                calls[f].pair = b;
            }
        if (B->pair < 0) {
            rc = ag__err(AG_EINVAL,
                         "partition: invoke_subgraph %%%s ('%s', %d operands, %d outputs) is a "
                         "backward call of no forward call: a region's backward call takes the "
                         "forward call's operands, first, then one tangent per forward output, "
                         "and returns one grad per operand, then the forward outputs",
                         ag__node_name(B->n), ag__node_arg(B->n, 1)->u.s, B->nops, B->nout);
            goto done;
        }
        /* One partition per distinct joint subgraph. */
        for (int q = 0; q < nparts && B->part < 0; q++)
            if (parts[q].joint_sub == B->sub)
                B->part = q;
        if (B->part >= 0) {
            if (parts[B->part].ngrads != calls[B->pair].nops ||
                parts[B->part].nfo != calls[B->pair].nout)
                rc = ag__err(AG_EINVAL,
                             "partition: invoke_subgraph %%%s calls '%s' for a forward call "
                             "of another shape",
                             ag__node_name(B->n), attr_name(P.g, B->sub));
            if (rc)
                goto done;
            inner->recomputed_nodes += parts[B->part].st.recomputed_nodes;
            inner->recomputed_flops += parts[B->part].st.recomputed_flops;
            continue;
        }
        const call_info *F = &calls[B->pair];
        part_pair *pp = &parts[nparts];
        pp->joint_sub = B->sub;
        pp->nfo = F->nout;
        pp->ngrads = F->nops;
        ag_graph *fw = NULL, *bw = NULL;
        if ((rc = partition_region_once(ag__node_arg(B->n, 1)->u.s, B->sub, F->nops, F->nout, opts,
                                        mode, &fw, &bw, &pp->st))) {
            char msg[512];
            snprintf(msg, sizeof msg, "%s", ag_last_error());
            rc = ag__err(rc, "partition: the region '%s' called by %%%s: %s",
                         attr_name(P.g, B->sub), ag__node_name(B->n), msg);
            goto done;
        }
        made[nmade++] = fw;
        made[nmade++] = bw;
        pp->nsaved = num_outputs(fw) - F->nout;
        /* upstream's names: partitioned_fw_subgraph_0_0 for bw_subgraph_0_0 */
        const char *id = ag__node_arg(B->n, 1)->u.s;
        const char *suffix = !strncmp(id, "bw_subgraph_", 12) ? id + 12 : NULL;
        char buf[32];
        if (!suffix || !*suffix || strlen(suffix) > 40) {
            snprintf(buf, sizeof buf, "%d_0", nparts);
            suffix = buf;
        }
        for (int t = 0;; t++) {
            char tag[16] = "";
            if (t)
                snprintf(tag, sizeof tag, "_%d", t);
            snprintf(pp->fw_name, sizeof pp->fw_name, "partitioned_fw_subgraph_%s%s", suffix, tag);
            snprintf(pp->bw_name, sizeof pp->bw_name, "partitioned_bw_subgraph_%s%s", suffix, tag);
            if (!ag_graph_subgraph(g, pp->fw_name) && !ag_graph_find(P.g, pp->fw_name) &&
                !ag_graph_subgraph(g, pp->bw_name) && !ag_graph_find(P.g, pp->bw_name))
                break;
        }
        if ((rc = ag_graph_add_subgraph(g, pp->fw_name, fw)))
            goto done;
        made[nmade - 2] = NULL; /* g owns it */
        if ((rc = ag_graph_add_subgraph(g, pp->bw_name, bw)))
            goto done;
        made[nmade - 1] = NULL;
        B->part = nparts++;
        inner->recomputed_nodes += pp->st.recomputed_nodes;
        inner->recomputed_flops += pp->st.recomputed_flops;
    }
    if (nparts == 0)
        goto done; /* nothing to rewrite: the caller partitions the joint itself */
    if ((rc = name_pairs(&st, g, ncalls, P.nn)) ||
        (rc = ag__graph_copy_nodes(g, P.g, rw_hook, &st)))
        goto done;
    /* Attributes no call reads any more (the regions' original subgraphs). */
    for (int k = ag_graph_num_subgraphs(g) - 1; k >= 0; k--) {
        ag_graph *s = ag_graph_subgraph_at(g, k, NULL);
        bool read = false;
        for (ag_node *n = ag_graph_first(g); n && !read; n = ag__node_next(n))
            read = ag__node_subgraph(n) == s;
        if (!read)
            ag__subgraph_remove(g, k);
    }
#ifndef NDEBUG
    /* The rewrite went through the graph API on a verified joint; Debug builds (the
     * sanitizer runs of the tests) check it again, Release builds do not pay a second walk of
     * the whole joint (the outer partition reads it unverified; ag_compile_joint's plans do
     * not verify the halves either, build_graph checking what the API does not). */
    if ((rc = ag_graph_verify(g)) != 0) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", ag_last_error());
        rc = ag__err(rc, "partition: the joint with its regions partitioned: %s", msg);
    }
#endif
done:
    if (own_memo) {
        memo_free(own_memo);
        memo = NULL;
    }
    rw_free(&st);
    for (int k = 0; k < nmade; k++)
        ag_graph_free(made[k]);
    ag__free(made);
    ag__free(calls);
    ag__free(parts);
    ag__part_free(&P);
    ag__free(req_bw);
    if (rc || nparts == 0) {
        ag_graph_free(g);
        return rc;
    }
    *out = g;
    return 0;
}

/* ---- the entry points ---- */

int ag__partition_ex(const ag_graph *joint, int num_fwd_outputs, const ag_partition_opts *opts,
                     ag__budget_mode mode, ag_graph **fw, ag_graph **bw, ag_partition_stats *stats,
                     ag__peak *peak) {
    if (!fw || !bw)
        return ag__err(AG_EINVAL, "partition: NULL result pointer");
    *fw = *bw = NULL;
    if (!joint || ag_graph_num_subgraphs(joint) == 0)
        return ag__partition_flat(joint, num_fwd_outputs, opts, mode, fw, bw, stats, peak, false);
    /* The regions' joint subgraphs first, each once (subgraph_partition.c), with the same
     * options; then the rewritten joint, its calls opaque. */
    ag_partition_opts o = opts ? *opts : (ag_partition_opts){0};
    double budget;
    int rc = ag__memory_budget_of(o.memory_budget, &budget);
    ag_graph *rw = NULL;
    ag_partition_stats inner = {0};
    if (rc == 0)
        rc = ag__partition_subgraphs(joint, num_fwd_outputs, opts, mode, &rw, &inner);
    if (rc == 0)
        rc = ag__partition_flat(rw ? rw : joint, num_fwd_outputs, opts, mode, fw, bw, stats, peak,
                                true); /* ag__partition_subgraphs verified the joint */
    if (rc == 0 && stats) {            /* what the regions' backwards recompute, at every call */
        stats->recomputed_nodes += inner.recomputed_nodes;
        stats->recomputed_flops += inner.recomputed_flops;
    }
    ag_graph_free(rw);
    return rc;
}

int ag_partition(const ag_graph *joint, int num_fwd_outputs, const ag_partition_opts *opts,
                 ag_graph **fw, ag_graph **bw, ag_partition_stats *stats) {
    return ag__partition_ex(joint, num_fwd_outputs, opts, AG__BUDGET_PEAK, fw, bw, stats, NULL);
}
