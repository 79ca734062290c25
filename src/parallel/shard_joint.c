/* ag_shard_joint: one rank's joint of a sharded training step.
 *
 * In: a joint with descriptors, a mesh and a plan (placements for the parameters, buffers, user
 * inputs and user outputs). Out: a new joint whose graph is this rank's: placeholders of local
 * shapes carrying the source's descriptors in the source's order, every node carrying its
 * metadata (seq_nr, partitioner tag, annotations, stack traces, module stacks, recompute) and
 * its placement, and the collectives that move values between placements. The pass uses the
 * public API only: it copies the joint, builds the rank's graph node by node in the source's
 * order (propagate.c), merges gradient all_reduces into buckets (grad_buckets.c), sinks waits
 * (wait_sink.c), verifies, and installs the graph with ag_joint_update.
 *
 * Placements of the inputs and outputs follow the descriptors: the plan's for Param, Buffer and
 * PlainAOTInput placeholders and PlainAOTOutput outputs; a tangent takes its output's (a Partial
 * output's tangent is Replicate()), a gradient its input's, an input mutation its input's;
 * everything else (tokens, RNG seeds) is Replicate(). On a mesh of one rank everything is
 * Replicate() and the result computes what the source does. */
#include "shard_internal.h"

#include <stdio.h>

static ag_placement desc_placement(const ag__shard_pass *P, const ag_desc *d) {
    if (!d || P->W == 1)
        return AG_P_REPLICATE;
    ag_placement pl = AG_P_REPLICATE;
    switch (ag_desc_kind_of(d)) {
    case AG_DESC_PARAM:
    case AG_DESC_BUFFER:
    case AG_DESC_PLAIN_INPUT:
    case AG_DESC_PLAIN_OUTPUT:
        ag_shard_plan_get(P->plan, d, &pl);
        return pl;
    case AG_DESC_TANGENT:
        pl = desc_placement(P, ag_desc_nested(d));
        return pl.kind == AG_PARTIAL ? AG_P_REPLICATE : pl;
    case AG_DESC_INPUT_MUTATION:
    case AG_DESC_GRAD:
        return desc_placement(P, ag_desc_nested(d));
    default:
        return AG_P_REPLICATE;
    }
}

/* A placement the tensor of global metadata m can take on the mesh; else an error naming d. */
static int check_fits(const ag__shard_pass *P, const ag_desc *d, const ag_tmeta *m,
                      ag_placement pl) {
    if (pl.kind != AG_SHARD)
        return 0;
    /* A tangent, gradient or input mutation follows the input or output the plan places:
     * name that one (its shape is the same). */
    const ag_desc *root = d;
    while (ag_desc_kind_of(root) == AG_DESC_TANGENT || ag_desc_kind_of(root) == AG_DESC_GRAD ||
           ag_desc_kind_of(root) == AG_DESC_INPUT_MUTATION)
        root = ag_desc_nested(root);
    char ds[256], ps[64], ms[128];
    ag_desc_repr(root, ds, sizeof ds);
    ag__pl_str(pl, ps, sizeof ps);
    ag__meta_str(m, ms, sizeof ms);
    if (pl.dim >= m->ndim)
        return ag__err(AG_EINVAL,
                       "shard_joint: the plan places %s (%s) as %s, but it has no dim %d", ds, ms,
                       ps, pl.dim);
    if (!ag_shard_divisible(m->sizes[pl.dim], P->W, pl.split_factor)) {
        int k = pl.split_factor > 1 ? pl.split_factor : 1;
        return ag__err(AG_EINVAL,
                       "shard_joint: the plan places %s (%s) as %s on %d ranks, but dim %d (size "
                       "%lld) does not divide by %d",
                       ds, ms, ps, P->W, pl.dim, (long long)m->sizes[pl.dim], P->W * k);
    }
    return 0;
}

/* Every descriptor the plan names must be one of the joint's. */
static int check_plan(const ag__shard_pass *P) {
    ag_node *out = ag_graph_output_node(P->src);
    for (int64_t i = 0; i < P->plan->n; i++) {
        const ag_desc *d = P->plan->e[i].desc;
        bool found = false;
        if (ag_desc_is_input(d)) {
            for (ag_node *n = ag_graph_first(P->src); n && !found; n = ag_node_next(n))
                found =
                    ag_node_kind_of(n) == AG_NODE_PLACEHOLDER && ag_desc_equal(ag_node_desc(n), d);
            /* set_param names buffers too. */
            if (!found && ag_desc_kind_of(d) == AG_DESC_PARAM)
                for (ag_node *n = ag_graph_first(P->src); n && !found; n = ag_node_next(n)) {
                    const ag_desc *nd = ag_node_desc(n);
                    found = ag_node_kind_of(n) == AG_NODE_PLACEHOLDER && nd &&
                            ag_desc_kind_of(nd) == AG_DESC_BUFFER &&
                            !strcmp(ag_desc_target(nd), ag_desc_target(d));
                }
        } else if (out) {
            int nouts = ag_node_arg(out, 0)->n;
            for (int k = 0; k < nouts && !found; k++)
                found = ag_desc_equal(ag_node_output_desc(out, k), d);
        }
        if (!found) {
            char ds[256];
            ag_desc_repr(d, ds, sizeof ds);
            return ag__err(AG_EINVAL,
                           "shard_joint: the plan places %s, which the joint does not "
                           "have",
                           ds);
        }
    }
    return 0;
}

static int do_placeholder(ag__shard_pass *P, const ag_node *n) {
    const ag_desc *d = ag_node_desc(n);
    const ag_tmeta *gm = ag_node_val(n, 0);
    ag_placement pl = desc_placement(P, d);
    int rc = check_fits(P, d, gm, pl);
    if (rc)
        return rc;
    ag_tmeta lm;
    ag__local_meta(gm, pl, P->W, &lm);
    ag_node *m = ag_graph_placeholder(P->g, ag_node_name(n), &lm);
    if (!m)
        return ag_last_status() ? ag_last_status() : AG_ENOMEM;
    if ((rc = ag__copy_node_meta(m, n)) || (d && (rc = ag_node_set_desc(m, (ag_desc *)d))) ||
        (rc = ag__node_set_placement(m, pl)))
        return rc;
    ag__sval *v = &P->val[ag_node_index(n)];
    v->node = m;
    v->pl = pl;
    v->gather_on_use = P->plan->gather_params && ag_desc_is_param(d) && pl.kind == AG_SHARD;
    return 0;
}

static int do_getitem(ag__shard_pass *P, const ag_node *n) {
    ag_node *srcm = ag_node_arg_node(n, 0);
    int idx = (int)ag_node_arg(n, 1)->u.i;
    ag__sval *mv = &P->val[ag_node_index(srcm)];
    ag_node *m = ag_graph_getitem(P->g, mv->node, idx, ag_node_name(n));
    if (!m)
        return ag_last_status() ? ag_last_status() : AG_ENOMEM;
    ag_placement pl = mv->outpl ? mv->outpl[idx] : mv->pl;
    int rc;
    if ((rc = ag__copy_node_meta(m, n)) || (rc = ag__node_set_placement(m, pl)))
        return rc;
    P->val[ag_node_index(n)] = (ag__sval){.node = m, .pl = pl};
    return 0;
}

static int do_get_attr(ag__shard_pass *P, const ag_node *n) {
    ag_node *m = ag_graph_get_attr(P->g, ag_node_constant(n), ag_node_name(n));
    if (!m)
        return ag_last_status() ? ag_last_status() : AG_ENOMEM;
    int rc;
    if ((rc = ag__copy_node_meta(m, n)) || (rc = ag__node_set_placement(m, AG_P_REPLICATE)))
        return rc;
    P->val[ag_node_index(n)] = (ag__sval){.node = m, .pl = AG_P_REPLICATE};
    return 0;
}

static int record_grad_reduce(ag__shard_pass *P, ag_node *w) {
    /* Only a reduction made for the output alone moves into a bucket (one an earlier node
     * also reads must stay before that node). */
    if (!ag__node_is_op(w, AG__C10D_WAIT) || ag_node_num_users(w) != 0)
        return 0;
    ag_node *r = ag_node_arg_node(w, 0);
    if (!ag__node_is_op(r, AG__C10D_ALL_REDUCE))
        return 0;
    for (int64_t i = 0; i < P->ngr; i++)
        if (P->grs[i].wait == w)
            return 0;
    if (P->ngr == P->gr_cap && ag__grow((void **)&P->grs, &P->gr_cap, P->ngr + 1, sizeof *P->grs))
        return AG_ENOMEM;
    P->grs[P->ngr++] = (ag__grad_reduce){.reduce = r, .wait = w, .grad = ag_node_arg_node(r, 0)};
    return 0;
}

static int do_output(ag__shard_pass *P, const ag_node *n) {
    const ag_garg *a = ag_node_arg(n, 0);
    int nouts = a->kind == AG_GA_NODES ? a->n : 0;
    ag_node **outs = ag__calloc((size_t)(nouts ? nouts : 1), sizeof *outs);
    ag_desc **descs = ag__calloc((size_t)(nouts ? nouts : 1), sizeof *descs);
    int rc = outs && descs ? 0 : AG_ENOMEM;
    for (int i = 0; !rc && i < nouts; i++) {
        ag_node *s = a->u.nodes[i];
        const ag_desc *d = ag_node_has_output_descs(n) ? ag_node_output_desc(n, i) : NULL;
        descs[i] = (ag_desc *)d;
        if (!s)
            continue;
        int si = ag_node_index(s);
        ag_placement to = desc_placement(P, d);
        if ((rc = check_fits(P, d, ag_node_val(s, 0), to)))
            break;
        P->cur = s;
        ag_placement from = P->val[si].pl;
        /* A forward output moves right after it is computed (in the forward); a gradient's
         * reduction goes here, before the output node, and into a bucket below. */
        ag_node *at = P->val[si].node;
        bool fw = ag_desc_kind_of(d) != AG_DESC_GRAD && ag_node_kind_of(at) != AG_NODE_PLACEHOLDER;
        if (fw)
            ag_graph_insert_after(P->g, at);
        outs[i] = ag__redistribute(P, si, to);
        ag_graph_insert_at_end(P->g);
        if (!outs[i]) {
            char ds[256], f[64], t[64];
            ag_desc_repr(d, ds, sizeof ds);
            rc = ag__shard_err(ag_last_status() ? ag_last_status() : AG_ENOMEM,
                               "shard_joint: output %d (%s, node '%s'): moving it from %s to %s", i,
                               ds, ag_node_name(s), ag__pl_str(from, f, sizeof f),
                               ag__pl_str(to, t, sizeof t));
            break;
        }
        if (ag_desc_kind_of(d) == AG_DESC_GRAD && from.kind == AG_PARTIAL &&
            to.kind == AG_REPLICATE)
            rc = record_grad_reduce(P, outs[i]);
    }
    ag_node *o = NULL;
    if (!rc && !(o = ag_graph_output(P->g, outs, nouts)))
        rc = ag_last_status() ? ag_last_status() : AG_ENOMEM;
    if (!rc && ag_node_has_output_descs(n))
        rc = ag_node_set_output_descs(o, descs, nouts);
    if (!rc)
        rc = ag__copy_node_meta(o, n);
    ag__free(outs);
    ag__free(descs);
    return rc;
}

static ag_joint *joint_copy(const ag_joint *j) {
    char *text = NULL;
    size_t len = 0;
    if (ag_joint_save(j, &text, &len))
        return NULL;
    ag_joint *c = ag_joint_load(text, len);
    ag_free(text);
    return c;
}

static void pass_free(ag__shard_pass *P) {
    for (int i = 0; P->val && i < P->nsrc; i++)
        ag__free(P->val[i].outpl);
    ag__free(P->val);
    ag__free(P->srcn);
    ag__free(P->cache_head);
    ag__free(P->cache);
    ag__free(P->grs);
    ag_graph_free(P->g);
}

static int build(ag__shard_pass *P) {
    int rc = check_plan(P);
    if (rc)
        return rc;
    for (ag_node *n = ag_graph_first(P->src); n && !rc; n = ag_node_next(n)) {
        P->cur = n;
        switch (ag_node_kind_of(n)) {
        case AG_NODE_PLACEHOLDER:
            rc = do_placeholder(P, n);
            break;
        case AG_NODE_CALL:
            rc = ag__shard_call(P, n);
            break;
        case AG_NODE_GETITEM:
            rc = do_getitem(P, n);
            break;
        case AG_NODE_GET_ATTR:
            rc = do_get_attr(P, n);
            break;
        case AG_NODE_OUTPUT:
            rc = do_output(P, n);
            break;
        }
    }
    if (!rc)
        rc = ag_graph_reinfer_meta(P->g);
    if (!rc && P->W > 1) {
        int64_t bb = P->plan->bucket_bytes ? P->plan->bucket_bytes : AG__BUCKET_DEFAULT;
        rc = ag__grad_buckets(P->g, P->grs, (int)P->ngr, bb, P->group);
    }
    if (!rc && !P->plan->no_overlap) {
        int moved = ag__sink_waits(P->g);
        rc = moved < 0 ? moved : 0;
    }
    if (!rc && (rc = ag_graph_verify(P->g)))
        rc = ag__shard_err(rc, "shard_joint: the rank's graph does not verify");
    return rc;
}

/* One propagation of source graph src: the rank's graph in *out (caller frees), the
 * decomposition bookkeeping in dl (NULL: none). */
static int propagate(const ag_graph *src, const ag_mesh *mesh, const ag_shard_plan *plan,
                     ag__decomp_list *dl, ag_graph **out) {
    ag__shard_pass P;
    memset(&P, 0, sizeof P);
    P.mesh = mesh;
    P.group = mesh->group ? mesh->group : "0";
    P.W = mesh->size;
    P.rank = mesh->rank;
    P.plan = plan;
    P.dl = dl;
    P.src = src;
    P.nsrc = ag_graph_num_nodes(P.src);
    P.g = ag_graph_new();
    P.val = ag__calloc((size_t)P.nsrc + 1, sizeof *P.val);
    P.srcn = ag__calloc((size_t)P.nsrc + 1, sizeof *P.srcn);
    P.cache_head = ag__calloc((size_t)P.nsrc + 1, sizeof *P.cache_head);
    int rc = P.g && P.val && P.srcn && P.cache_head ? 0 : AG_ENOMEM;
    if (!rc) {
        int i = 0;
        for (ag_node *n = ag_graph_first(P.src); n; n = ag_node_next(n), i++) {
            P.srcn[i] = n;
            P.cache_head[i] = -1;
        }
        rc = build(&P);
    }
    if (!rc) {
        *out = P.g;
        P.g = NULL;
    }
    pass_free(&P);
    return rc;
}

/* The rank's graph of j, with the nodes that would gather a sharded input decomposed where
 * that moves fewer bytes (shard_decomp.c): propagate, decompose the candidates found in a
 * copy of the source graph, propagate that, judge, until the candidates settle (a round may
 * find new candidates, e.g. a batch norm's backward that gathers once its forward is
 * decomposed, or reject some, then the next round goes without them; at most 16 rounds). The
 * result never communicates more than the plain propagation. */
static int shard_graph_flat(const ag_graph *src, const ag_mesh *mesh, const ag_shard_plan *plan,
                            ag_graph **out);
static int shard_graph(const ag_joint *j, const ag_mesh *mesh, const ag_shard_plan *plan,
                       ag_graph **out) {
    const ag_graph *src = ag_joint_graph(j);
    /* Propagation knows flat graphs only: a joint calling subgraphs is sharded inlined (the
     * rank's joint then has no subgraphs). A region's joint subgraph recomputes the region's
     * forward; inlined, that copy is the forward's own nodes again, which CSE merges (else
     * the backward would compute the blocks a second time). */
    ag_graph *flat = NULL;
    if (ag_graph_num_subgraphs(src) > 0) {
        int rc = (flat = ag_graph_inline_subgraphs(src)) ? ag_graph_cse(flat) : AG_ENOMEM;
        if (rc < 0) {
            ag_graph_free(flat);
            return ag_last_status() ? ag_last_status() : rc;
        }
        src = flat;
    }
    int rc = shard_graph_flat(src, mesh, plan, out);
    ag_graph_free(flat);
    return rc;
}

static int shard_graph_flat(const ag_graph *src, const ag_mesh *mesh, const ag_shard_plan *plan,
                            ag_graph **out) {
    ag__decomp_list dl = {0};
    ag_graph *plain = NULL, *best = NULL;
    int rc = propagate(src, mesh, plan, mesh->size > 1 ? &dl : NULL, &plain);
    for (int iter = 0; !rc && dl.n > 0 && iter < 16; iter++) {
        int64_t ncand = dl.n;
        int ntried = 0;
        ag_graph *copy = ag__decomposed_copy(src, &dl, &ntried), *g = NULL;
        rc = copy ? 0 : ag_last_status() ? ag_last_status() : AG_ENOMEM;
        if (!rc && ntried == 0) { /* every candidate was rejected: the plain graph */
            ag_graph_free(copy);
            ag_graph_free(best);
            best = NULL;
            break;
        }
        if (!rc)
            rc = propagate(copy, mesh, plan, &dl, &g);
        ag_graph_free(copy);
        if (rc && rc != AG_ENOMEM) {
            /* The decomposed graph does not shard (a piece's rule refused it): what was
             * sharded before stands. */
            ag_clear_error();
            rc = 0;
            break;
        }
        if (rc)
            break;
        /* A graph with a rejected decomposition in it is not kept: the next round goes
         * without it. One that only revealed new candidates is the best so far. */
        if (ag__decomp_judge(&dl)) {
            ag_graph_free(g);
            continue;
        }
        ag_graph_free(best);
        best = g;
        if (dl.n == ncand)
            break;
    }
    if (!rc && best && ag__graph_comm_bytes(best) > ag__graph_comm_bytes(plain)) {
        ag_graph_free(best);
        best = NULL;
    }
    ag__decomp_list_free(&dl);
    if (rc) {
        ag_graph_free(plain);
        ag_graph_free(best);
        return rc;
    }
    if (best) {
        ag_graph_free(plain);
        *out = best;
    } else {
        *out = plain;
    }
    return 0;
}

ag_joint *ag_shard_joint(const ag_joint *j, const ag_mesh *mesh, const ag_shard_plan *plan) {
    AG__CHECK_NULL_RET("shard_joint", j, NULL);
    AG__CHECK_NULL_RET("shard_joint", mesh, NULL);
    AG__CHECK_NULL_RET("shard_joint", plan, NULL);
    if (mesh->size < 1 || mesh->rank < 0 || mesh->rank >= mesh->size) {
        ag__err(AG_EINVAL,
                "shard_joint: bad mesh: rank %d of %d ranks (a mesh has size >= 1 and "
                "0 <= rank < size)",
                mesh->rank, mesh->size);
        return NULL;
    }
    ag_graph *g = NULL;
    ag_joint *copy = NULL;
    int rc = shard_graph(j, mesh, plan, &g);
    if (!rc && !(copy = joint_copy(j)))
        rc = ag_last_status() ? ag_last_status() : AG_ENOMEM;
    if (!rc) {
        /* the joint owns g now, also on failure */
        if ((rc = ag_joint_update(copy, g)))
            ag__shard_err(rc, "shard_joint: the joint refused the rank's graph");
        g = NULL;
    }
    ag_graph_free(g);
    if (rc) {
        ag_joint_free(copy);
        return NULL;
    }
    return copy;
}
