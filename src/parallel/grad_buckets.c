/* Gradient buckets: the all_reduces that bring gradients from Partial() to Replicate() at the
 * GradAOTOutput outputs, merged so that few large collectives replace many small ones (DDP's
 * buckets).
 *
 * In: the rank's graph after propagation, and the gradient all_reduces the pass inserted at
 * the output node (each right before it, with its wait). Out: gradients grouped in the order
 * they become ready (their producers' positions), at most the plan's bucket bytes per group (a
 * gradient larger than that is a group alone), one dtype and reduce op per group. Each group
 * of two or more becomes, right after its last gradient is computed: a flat view (a contiguous
 * copy first where the gradient is strided) of each, one cat, one all_reduce and its wait; and,
 * just before the output node, a slice per gradient viewed back to its shape. A group of one
 * keeps its all_reduce, moved up to right after its gradient. The waits then sink
 * (wait_sink.c), so the reductions run while the rest of the backward computes. */
#include "shard_internal.h"

#include <stdio.h>
#include <stdlib.h>

static ag_node *insert(ag_graph *g, const char *opname, const ag_garg *args, int nargs,
                       const char *tag, int world) {
    const ag_op *op = ag_op_find(opname);
    if (!op) {
        ag__err(AG_ENOTSUP, "shard_joint: op %s is not in the op table", opname);
        return NULL;
    }
    ag_node *n = ag_graph_call(g, op, args, nargs, NULL);
    if (!n)
        return NULL;
    int rc = ag__node_set_placement(n, AG_P_REPLICATE);
    if (!rc && tag)
        rc = ag_node_set_partitioner_tag(n, tag);
    if (!rc && (ag_op_def(op)->flags & AG_OP_COLLECTIVE) && strcmp(opname, AG__C10D_WAIT))
        rc = ag_node_meta_set(n, "group_size", (ag_mval){.kind = AG_MV_INT, .u.i = world});
    return rc ? NULL : n;
}

static int64_t numel(const ag_tmeta *m) {
    int64_t n = 1;
    for (int d = 0; d < m->ndim; d++)
        n *= m->sizes[d];
    return n;
}

static bool contiguous(const ag_tmeta *m) {
    int64_t st = 1;
    for (int d = m->ndim - 1; d >= 0; d--) {
        if (m->sizes[d] != 1 && m->strides[d] != st)
            return false;
        st *= m->sizes[d];
    }
    return true;
}

static int by_ready(const void *a, const void *b) {
    const ag__grad_reduce *x = a, *y = b;
    int i = ag_node_index(x->grad), j = ag_node_index(y->grad);
    return (i > j) - (i < j);
}

/* Where a bucket's collective starts: right after its last gradient (after the placeholders
 * when that is one). */
static ag_node *anchor_after(ag_graph *g, ag_node *grad) {
    if (ag_node_kind_of(grad) != AG_NODE_PLACEHOLDER)
        return grad;
    ag_node **ph;
    int n = ag_graph_placeholders(g, &ph);
    return ph[n - 1];
}

static int one_bucket(ag_graph *g, ag__grad_reduce *b, int n, const char *group) {
    ag_node *last = anchor_after(g, b[n - 1].grad);
    const char *op = ag_node_arg(b[0].reduce, 1)->u.s;
    int world = (int)ag_node_meta_get(b[0].reduce, "group_size").u.i;
    if (n == 1) {
        int rc = ag_graph_move_after(g, b[0].reduce, last);
        return rc ? rc : ag_graph_move_after(g, b[0].wait, b[0].reduce);
    }
    ag_node **flat = ag__calloc((size_t)n, sizeof *flat);
    if (!flat)
        return AG_ENOMEM;
    /* The tag of the reductions replaced (they are erased below). */
    char like[32];
    const char *t0 = ag_node_partitioner_tag(b[0].reduce);
    snprintf(like, sizeof like, "%s", t0 ? t0 : "is_backward");
    int rc = 0;
    ag_graph_insert_after(g, last);
    for (int i = 0; i < n && !rc; i++) {
        ag_node *x = b[i].grad;
        const ag_tmeta *m = ag_node_val(x, 0);
        int64_t ne = numel(m);
        if (!contiguous(m) && !(x = insert(g, "clone", (ag_garg[]){AG_GA_N(x)}, 1, like, world)))
            rc = AG_ENOMEM;
        if (!rc && !(flat[i] = insert(g, "view", (ag_garg[]){AG_GA_N(x), AG_GA_INTS(&ne, 1)}, 2,
                                      like, world)))
            rc = AG_ENOMEM;
    }
    ag_node *cat = NULL, *red = NULL, *w = NULL;
    if (!rc &&
        !(cat = insert(g, "cat", (ag_garg[]){AG_GA_NODES(flat, n), AG_GA_I(0)}, 2, like, world)))
        rc = AG_ENOMEM;
    if (!rc &&
        !(red = insert(g, AG__C10D_ALL_REDUCE,
                       (ag_garg[]){AG_GA_N(cat), AG_GA_S(op), AG_GA_S(group)}, 3, like, world)))
        rc = AG_ENOMEM;
    if (!rc && !(w = insert(g, AG__C10D_WAIT, (ag_garg[]){AG_GA_N(red)}, 1, like, world)))
        rc = AG_ENOMEM;
    ag_graph_insert_at_end(g);
    int64_t off = 0;
    for (int i = 0; i < n && !rc; i++) {
        const ag_tmeta *m = ag_node_val(b[i].grad, 0);
        int64_t ne = numel(m);
        ag_node *s =
            insert(g, "slice.Tensor",
                   (ag_garg[]){AG_GA_N(w), AG_GA_I(0), AG_GA_I(off), AG_GA_I(off + ne), AG_GA_I(1)},
                   5, like, world);
        ag_node *v = s ? insert(g, "view", (ag_garg[]){AG_GA_N(s), AG_GA_INTS(m->sizes, m->ndim)},
                                2, like, world)
                       : NULL;
        if (!v) {
            rc = AG_ENOMEM;
            break;
        }
        off += ne;
        ag_node_replace_all_uses(b[i].wait, v);
    }
    for (int i = 0; i < n && !rc; i++)
        if ((rc = ag_graph_erase(g, b[i].wait)) || (rc = ag_graph_erase(g, b[i].reduce)))
            break;
    ag__free(flat);
    return rc && ag_last_status() ? ag_last_status() : rc;
}

int ag__grad_buckets(ag_graph *g, ag__grad_reduce *rs, int n, int64_t bucket_bytes,
                     const char *group) {
    if (n == 0)
        return 0;
    qsort(rs, (size_t)n, sizeof *rs, by_ready);
    int start = 0;
    while (start < n) {
        const ag_tmeta *m0 = ag_node_val(rs[start].grad, 0);
        const char *op0 = ag_node_arg(rs[start].reduce, 1)->u.s;
        int64_t bytes = numel(m0) * (int64_t)ag_dtype_size(m0->dtype);
        int end = start + 1;
        while (bucket_bytes >= 0 && end < n) {
            const ag_tmeta *m = ag_node_val(rs[end].grad, 0);
            int64_t b = numel(m) * (int64_t)ag_dtype_size(m->dtype);
            if (m->dtype != m0->dtype || strcmp(ag_node_arg(rs[end].reduce, 1)->u.s, op0) ||
                bytes + b > bucket_bytes)
                break;
            bytes += b;
            end++;
        }
        int rc = one_bucket(g, rs + start, end - start, group);
        if (rc)
            return rc;
        start = end;
    }
    return 0;
}
