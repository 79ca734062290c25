/* Decompose to shard: the nodes whose rule (or the fallback) would all_gather a sharded input,
 * and whose op has a decomposition, are replaced by their decompositions before propagation,
 * as DTensor does for ops without a sharding strategy of their own. Batch norm on a
 * batch-sharded input becomes sums over the batch (each a Partial(sum) of [C] values, one small
 * all_reduce: SyncBatchNorm) and pointwise ops, where the fused op would gather the whole
 * activation; a mean nll_loss becomes a gather of each row's target and two scalar sums.
 *
 * In: what one propagation saw (ag__decomp_note, called by propagate.c for every call node):
 * the bytes each node's input redistributions moved. Out: the candidates (ag__decomp_list),
 * a copy of the source graph with the accepted ones decomposed (ag__decomposed_copy), and the
 * judgement after the next propagation (ag__decomp_judge): a decomposed node whose pieces did
 * not move fewer bytes than it did whole is kept whole from then on. shard_joint.c iterates
 * until nothing changes. The pieces carry node meta "shard_decomposed" (the original op's
 * name) and "shard_decomposed_node" (the original node's name), which the rank's graph keeps
 * and the summary counts. */
#include "shard_internal.h"

#include <stdio.h>

#define META_OP "shard_decomposed"
#define META_NODE "shard_decomposed_node"

static ag__decomp_cand *find(ag__decomp_list *dl, const char *name) {
    for (int64_t i = 0; i < dl->n; i++)
        if (!strcmp(dl->c[i].name, name))
            return &dl->c[i];
    return NULL;
}

int ag__decomp_note(ag__shard_pass *P, const ag_node *n, double moved, bool gathers) {
    ag__decomp_list *dl = P->dl;
    ag_mval piece = ag_node_meta_get(n, META_NODE);
    if (piece.kind == AG_MV_STR) {
        ag__decomp_cand *c = find(dl, piece.u.s);
        if (c)
            c->after += moved;
        return 0;
    }
    const ag_opdef *def = ag_op_def(ag_node_op(n));
    if (!gathers || !def->decomp || (def->flags & AG_OP_COMPOSITE) || find(dl, ag_node_name(n)))
        return 0;
    if (dl->n == dl->cap && ag__grow((void **)&dl->c, &dl->cap, dl->n + 1, sizeof *dl->c))
        return AG_ENOMEM;
    char *name = ag__strdup(ag_node_name(n));
    if (!name)
        return AG_ENOMEM;
    dl->c[dl->n++] = (ag__decomp_cand){.name = name, .op = ag_node_op(n), .before = moved};
    return 0;
}

void ag__decomp_list_free(ag__decomp_list *dl) {
    for (int64_t i = 0; dl && i < dl->n; i++)
        ag__free(dl->c[i].name);
    if (dl)
        ag__free(dl->c);
}

/* Decomposes node n (of candidate c) in g, its pieces tagged. */
static int decompose_one(ag_graph *g, ag_node *n, ag__decomp_cand *c) {
    const char *op = ag_op_name(c->op);
    int rc = ag_node_meta_set(n, META_OP, (ag_mval){.kind = AG_MV_STR, .u.s = op});
    if (!rc)
        rc = ag_node_meta_set(n, META_NODE, (ag_mval){.kind = AG_MV_STR, .u.s = c->name});
    if (!rc)
        rc = ag_graph_decompose_node(g, n, ag_op_def(c->op)->decomp);
    if (rc == AG_ENOTSUP) {
        /* No decomposition for these arguments (batch norm on an empty batch): it stays. */
        ag_clear_error();
        c->rejected = true;
        ag_node_meta_del(n, META_OP);
        ag_node_meta_del(n, META_NODE);
        return 0;
    }
    if (rc)
        return ag__shard_err(rc, "shard_joint: decomposing node '%s' (%s)", c->name, op);
    c->tried = true;
    return 0;
}

ag_graph *ag__decomposed_copy(const ag_graph *src, ag__decomp_list *dl, int *ntried) {
    *ntried = 0;
    ag_graph *g = ag_graph_copy(src);
    if (!g)
        return NULL;
    int rc = 0;
    for (int64_t i = 0; i < dl->n && !rc; i++) {
        ag__decomp_cand *c = &dl->c[i];
        c->tried = false;
        c->after = 0;
        if (c->rejected)
            continue;
        ag_node *n = ag_graph_find(g, c->name);
        if (!n) {
            c->rejected = true;
            continue;
        }
        rc = decompose_one(g, n, c);
        *ntried += c->tried;
    }
    /* A masked-out output of a backward op is an unused piece. */
    if (!rc && *ntried) {
        int removed = ag_graph_dce(g);
        rc = removed < 0 ? removed : 0;
    }
    if (rc) {
        ag_graph_free(g);
        return NULL;
    }
    return g;
}

bool ag__decomp_judge(ag__decomp_list *dl) {
    bool changed = false;
    for (int64_t i = 0; i < dl->n; i++) {
        ag__decomp_cand *c = &dl->c[i];
        if (c->tried && c->after >= c->before) {
            c->rejected = true;
            changed = true;
        }
    }
    return changed;
}
