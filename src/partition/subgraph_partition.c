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
#include "../core/ptrmap.h"
#include "partition_internal.h"

#include <stdio.h>

typedef struct call_info {
    ag_node *n;          /* the call in the working copy */
    ag_graph *sub;       /* its subgraph */
    int nops, nph, nout; /* operands, the subgraph's placeholders and outputs */
    bool bw;             /* reached from a tangent */
    int pair;            /* the other call of its pair, or -1 */
    int part;            /* bw calls: index of the partitioned pair in parts[] */
} call_info;

typedef struct part_pair {
    ag_graph *joint_sub; /* the bw joint subgraph partitioned (borrowed) */
    char fw_name[96], bw_name[96];
    int nfo, nsaved, ngrads;
    ag_partition_stats st; /* the region's partition: what one call's backward recomputes */
} part_pair;

static int num_placeholders(const ag_graph *g) {
    int k = 0;
    for (ag_node *n = ag_graph_first(g); n; n = ag_node_next(n))
        k += ag_node_kind_of(n) == AG_NODE_PLACEHOLDER;
    return k;
}

static int num_outputs(const ag_graph *g) {
    const ag_node *o = ag_graph_output_node(g);
    return o ? ag_node_arg(o, 0)->n : 0;
}

/* Removes every descriptor of g (descriptors live on the outer graph only). */
static int strip_descs(ag_graph *g) {
    for (ag_node *n = ag_graph_first(g); n; n = ag_node_next(n))
        if (ag_node_kind_of(n) == AG_NODE_PLACEHOLDER && ag_node_set_desc(n, NULL))
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
        !(ag_op_def(ag_node_op(x))->flags & AG_OP_VIEW) ||
        (ag_op_def(ag_node_op(x))->flags & AG_OP_INPLACE) || !ag_node_arg_node(x, 0) ||
        ag_node_nargs(x) > AG_MAX_ARGS)
        return false;
    for (int i = 1; i < ag_node_nargs(x); i++) {
        const ag_garg *a = ag_node_arg(x, i);
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
            src = ag_node_arg_node(x, 0);
        else if (ag_node_kind_of(x) == AG_NODE_GETITEM && is_view_call(ag_node_arg_node(x, 0)))
            src = ag_node_arg_node(x, 0); /* a piece of split: the split is a view */
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
        return ag_graph_getitem(bw, base, (int)ag_node_arg(x, 1)->u.i, NULL);
    ag_garg args[AG_MAX_ARGS];
    int na = ag_node_nargs(x);
    for (int i = 0; i < na; i++)
        args[i] = *ag_node_arg(x, i);
    args[0].u.node = base;
    return ag_graph_call(bw, ag_node_op(x), args, na, NULL);
}

/* The rewrite above on the region's partitioned pair (m forward outputs; no descriptors). */
static int save_view_bases(ag_graph *fw, ag_graph *bw, int m) {
    ag_node *fo = ag_graph_output_node(fw);
    const ag_garg *fa = ag_node_arg(fo, 0);
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
    for (ag_node *x = ag_graph_first(bw); x && !body; x = ag_node_next(x))
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
            const char *nm = ag_node_name(root);
            ag_node *p = n == 0 ? old[j] /* kept */
                                : ag_graph_placeholder(bw, ag_graph_find(bw, nm) ? NULL : nm,
                                                       ag_node_val(root, 0));
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
            if (!ag__tmeta_equal(ag_node_val(by, 0), ag_node_val(old[j], 0))) {
                rc = ag__err(AG_EINVAL,
                             "partition: the view %%%s replayed in the region's "
                             "backward differs from the saved one",
                             ag_node_name(v));
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
    const ag_garg *oa = ag_node_arg(o, 0);
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

/* The attribute name of the subgraph n's get_attr reads in g. */
static const char *attr_name(const ag_graph *g, const ag_graph *sub) {
    for (int i = 0; i < ag_graph_num_subgraphs(g); i++) {
        const char *nm;
        if (ag_graph_subgraph_at(g, i, &nm) == sub)
            return nm;
    }
    return NULL;
}

/* A getitem of call c at idx (its metadata from like, when given), at the insertion point. */
static ag_node *getitem_like(ag_graph *g, ag_node *c, int idx, const ag_node *like) {
    ag_node *x = ag_graph_getitem(g, c, idx, NULL);
    if (x && like && (ag__node_meta_copy(x, like) || ag_node_custom_copy(x, like)))
        return NULL;
    return x;
}

/* A call of attribute `attr` with operands, before pos, metadata from like. */
static ag_node *new_call(ag_graph *g, ag_node *pos, const char *attr, ag_node **ops, int nops,
                         const ag_node *like) {
    ag_graph_insert_before(g, pos);
    ag_node *a = ag_graph_get_attr_subgraph(g, attr, NULL);
    ag_node *c = a ? ag_graph_invoke_subgraph(g, a, attr, ops, nops, NULL) : NULL;
    if (c && (ag__node_meta_copy(c, like) || ag_node_custom_copy(c, like)))
        c = NULL;
    return c;
}

/* Erases call c, its getitems (which must have no users left) and its get_attr when unread. */
static int erase_call(ag_graph *g, ag_node *c) {
    int rc = 0;
    while (rc == 0 && ag_node_num_users(c) > 0)
        rc = ag_graph_erase(g, ag_node_user(c, 0));
    ag_node *a = ag_node_arg_node(c, 0);
    if (rc == 0)
        rc = ag_graph_erase(g, c);
    if (rc == 0 && ag_node_num_users(a) == 0)
        rc = ag_graph_erase(g, a);
    return rc;
}

/* Rewrites the pair (F, B) of g to call the partitioned subgraphs of pp. */
static int rewrite_pair(ag_graph *g, const call_info *F, const call_info *B, const part_pair *pp,
                        ag__ptrmap *repl) {
    int k = F->nops, m = pp->nfo, s = pp->nsaved, rc = 0;
    ag_node **fops = ag__malloc(sizeof(ag_node *) * (size_t)(k + 1));
    ag_node **bops = ag__malloc(sizeof(ag_node *) * (size_t)(s + m + 1));
    ag_node *fget[AG_MAX_OUTPUTS] = {0};
    if (!fops || !bops) {
        rc = AG_ENOMEM;
        goto done;
    }
    const ag_garg *fa = ag_node_arg(F->n, 2);
    for (int i = 0; i < k; i++)
        fops[i] = fa->u.nodes[i];
    ag_node *F2 = new_call(g, F->n, pp->fw_name, fops, k, F->n);
    if (!F2)
        goto fail;
    /* The forward call's getitems, then one per saved value. */
    for (int u = 0; u < ag_node_num_users(F->n); u++) {
        ag_node *x = ag_node_user(F->n, u);
        int i = (int)ag_node_arg(x, 1)->u.i;
        if (!(fget[i] = getitem_like(g, F2, i, x)))
            goto fail;
    }
    for (int i = 0; i < m; i++)
        if (!fget[i] && !(fget[i] = getitem_like(g, F2, i, NULL)))
            goto fail;
    for (int j = 0; j < s; j++) {
        ag_node *x = getitem_like(g, F2, m + j, NULL);
        if (!x)
            goto fail;
        bops[j] = x;
    }
    const ag_garg *ba = ag_node_arg(B->n, 2);
    for (int i = 0; i < m; i++)
        bops[s + i] = ba->u.nodes[k + i];
    ag_node *B2 = new_call(g, B->n, pp->bw_name, bops, s + m, B->n);
    if (!B2)
        goto fail;
    for (int u = 0; u < ag_node_num_users(B->n); u++) {
        ag_node *x = ag_node_user(B->n, u);
        int i = (int)ag_node_arg(x, 1)->u.i;
        ag_node *by = i < k ? getitem_like(g, B2, i, x) : fget[i - k];
        if (!by || ag_node_replace_all_uses(x, by) < 0 ||
            ag__ptrmap_put(repl, x, (int64_t)(intptr_t)by))
            goto fail;
    }
    for (int u = 0; u < ag_node_num_users(F->n); u++) {
        ag_node *x = ag_node_user(F->n, u), *by = fget[ag_node_arg(x, 1)->u.i];
        if (ag_node_replace_all_uses(x, by) < 0 || ag__ptrmap_put(repl, x, (int64_t)(intptr_t)by))
            goto fail;
    }
    ag_graph_insert_at_end(g);
    if ((rc = erase_call(g, B->n)) == 0)
        rc = erase_call(g, F->n);
    goto done;
fail:
    ag_graph_insert_at_end(g);
    rc = ag_last_status() ? ag_last_status() : AG_ENOMEM;
done:
    ag__free(fops);
    ag__free(bops);
    return rc;
}

/* Whether B's first nops(F) operands are F's, and the counts fit a region's pair. */
static bool pairs_with(const call_info *F, const call_info *B) {
    if (B->nops != F->nops + F->nout || B->nout != F->nops + F->nout)
        return false;
    const ag_garg *fa = ag_node_arg(F->n, 2), *ba = ag_node_arg(B->n, 2);
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
    ag__part P;
    bool *req_bw = NULL; /* per node of P.g */
    int rc = ag__part_init_req_bw(&P, joint, num_fwd_outputs, &req_bw);
    if (rc)
        return rc;
    ag_graph *g = ag_graph_copy(P.g); /* node i of g is node i of P.g */
    int maxcalls = 1;                 /* the tables below hold one entry per call, not per node */
    for (ag_node *n = ag_graph_first(P.g); n; n = ag_node_next(n))
        maxcalls += ag__call_subgraph(n) != NULL;
    call_info *calls = ag__calloc((size_t)maxcalls, sizeof *calls);
    part_pair *parts = ag__calloc((size_t)maxcalls, sizeof *parts);
    ag_graph **made = ag__calloc((size_t)(2 * maxcalls + 1), sizeof *made);
    int ncalls = 0, nparts = 0, nmade = 0;
    ag__ptrmap rewritten = {0}, repl = {0}; /* calls rewritten; getitem -> its replacement */
    ag_node **keep = NULL;                  /* the output node's list */
    if (!g || !calls || !parts || !made) {
        rc = ag_last_status() ? ag_last_status() : AG_ENOMEM;
        goto done;
    }
    int i = 0;
    for (ag_node *n = ag_graph_first(g); n; n = ag_node_next(n), i++) {
        const ag_graph *sub = ag__call_subgraph(n);
        if (!sub)
            continue;
        call_info *c = &calls[ncalls++];
        c->n = n;
        c->sub = (ag_graph *)sub;
        c->nops = ag_node_arg(n, 2)->n;
        c->nph = num_placeholders(sub);
        c->nout = num_outputs(sub);
        c->bw = req_bw[i];
        c->pair = c->part = -1;
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
                         ag_node_name(B->n), ag_node_arg(B->n, 1)->u.s, B->nops, B->nout);
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
                             ag_node_name(B->n), attr_name(g, B->sub));
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
        if ((rc = partition_region(B->sub, F->nops, F->nout, opts, mode, &fw, &bw, &pp->st))) {
            char msg[512];
            snprintf(msg, sizeof msg, "%s", ag_last_error());
            rc = ag__err(rc, "partition: the region '%s' called by %%%s: %s", attr_name(g, B->sub),
                         ag_node_name(B->n), msg);
            goto done;
        }
        made[nmade++] = fw;
        made[nmade++] = bw;
        pp->nsaved = num_outputs(fw) - F->nout;
        /* upstream's names: partitioned_fw_subgraph_0_0 for bw_subgraph_0_0 */
        const char *id = ag_node_arg(B->n, 1)->u.s;
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
            if (!ag_graph_subgraph(g, pp->fw_name) && !ag_graph_find(g, pp->fw_name) &&
                !ag_graph_subgraph(g, pp->bw_name) && !ag_graph_find(g, pp->bw_name))
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
    /* The output node lists every grad (thousands of values for a deep model): replacing a
     * getitem it reads would scan the whole list each time. It lets go of the getitems of the
     * calls rewritten (None meanwhile) and reads their replacements once at the end. */
    ag_node *onode = ag_graph_output_node(g);
    int nouts = ag_node_arg(onode, 0)->n;
    keep = ag__malloc(sizeof(ag_node *) * (size_t)(2 * nouts + 1));
    if (!keep) {
        rc = AG_ENOMEM;
        goto done;
    }
    ag_node **tmp = keep + nouts;
    for (int b = 0; b < ncalls; b++)
        if (calls[b].bw && ((rc = ag__ptrmap_put(&rewritten, calls[b].n, 1)) ||
                            (rc = ag__ptrmap_put(&rewritten, calls[calls[b].pair].n, 1))))
            goto done;
    for (int k = 0; k < nouts; k++) {
        ag_node *x = keep[k] = ag_node_arg(onode, 0)->u.nodes[k];
        tmp[k] = x && ag_node_kind_of(x) == AG_NODE_GETITEM &&
                         ag__ptrmap_has(&rewritten, ag_node_arg_node(x, 0))
                     ? NULL
                     : x;
    }
    if ((rc = ag_node_set_arg(onode, 0, AG_GA_NODES(tmp, nouts))))
        goto done;
    for (int b = 0; b < ncalls; b++)
        if (calls[b].bw &&
            (rc = rewrite_pair(g, &calls[calls[b].pair], &calls[b], &parts[calls[b].part], &repl)))
            goto done;
    for (int k = 0; k < nouts; k++)
        tmp[k] = keep[k] && ag__ptrmap_has(&repl, keep[k])
                     ? (ag_node *)(intptr_t)ag__ptrmap_get(&repl, keep[k], 0)
                     : keep[k];
    if ((rc = ag_node_set_arg(onode, 0, AG_GA_NODES(tmp, nouts))))
        goto done;
    /* Attributes no call reads any more (the regions' original subgraphs). */
    for (int k = ag_graph_num_subgraphs(g) - 1; k >= 0; k--) {
        ag_graph *s = ag_graph_subgraph_at(g, k, NULL);
        bool read = false;
        for (ag_node *n = ag_graph_first(g); n && !read; n = ag_node_next(n))
            read = ag_node_subgraph(n) == s;
        if (!read)
            ag__subgraph_remove(g, k);
    }
#ifndef NDEBUG
    /* The rewrite went through the graph API on a verified joint; Debug builds (the
     * sanitizer runs of the tests) check it again, Release builds do not pay a second walk of
     * the whole joint (the outer partition reads it unverified; the plans verify its forward
     * and backward). */
    if (nparts > 0 && (rc = ag_graph_verify(g)) != 0) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", ag_last_error());
        rc = ag__err(rc, "partition: the joint with its regions partitioned: %s", msg);
    }
#endif
done:
    ag__ptrmap_free(&rewritten);
    ag__ptrmap_free(&repl);
    ag__free(keep);
    for (int k = 0; k < nmade; k++)
        ag_graph_free(made[k]);
    ag__free(made);
    ag__free(calls);
    ag__free(parts);
    ag__part_free(&P);
    ag__free(req_bw);
    if (rc) {
        ag_graph_free(g);
        return rc;
    }
    if (nparts == 0) {
        ag_graph_free(g); /* nothing to rewrite: the caller partitions the joint itself */
        return 0;
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
