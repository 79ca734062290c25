/* Strategies: plans made from a joint's descriptors and graph (parallel.h describes each).
 *
 * In: a joint and a mesh. Out: a plan (caller frees) for ag_shard_joint, or NULL with a message
 * when the joint does not fit the mesh.
 *   dp    user inputs Shard(0) (the batch), everything else Replicate().
 *   fsdp  dp's inputs, parameters Shard(0) where dim 0 divides, gathered on use.
 *   tp    Megatron pairs found on the graph: a Linear is a parameter read through t by addmm's
 *         mat2 (mm's for a Linear without bias); a pair is two Linears where the first's output
 *         reaches the second's input through forward elementwise ops, views, dropout and
 *         attention only. The first is column-parallel (weight and bias Shard(0); a fused q/k/v
 *         projection, whose output is split in three along its last dim on the way, takes
 *         StridedShard(0, 3) so every rank keeps its heads of q, k and v), the second
 *         row-parallel (weight Shard(1), bias Replicate()). */
#include "shard_internal.h"

#include <stdio.h>

static int check_mesh(const char *fn, const ag_joint *j, const ag_mesh *mesh) {
    AG__CHECK_NULL(fn, j);
    AG__CHECK_NULL(fn, mesh);
    if (mesh->size < 1 || mesh->rank < 0 || mesh->rank >= mesh->size)
        return ag__err(AG_EINVAL, "%s: bad mesh: rank %d of %d ranks", fn, mesh->rank, mesh->size);
    return 0;
}

/* User inputs Shard(0): the batch is split across the ranks. */
static int shard_batch(const char *fn, ag_shard_plan *p, const ag_joint *j, int W) {
    for (ag_node *n = ag_graph_first(ag_joint_graph(j)); n; n = ag_node_next(n)) {
        const ag_desc *d = ag_node_desc(n);
        if (ag_node_kind_of(n) != AG_NODE_PLACEHOLDER || !d ||
            ag_desc_kind_of(d) != AG_DESC_PLAIN_INPUT)
            continue;
        const ag_tmeta *m = ag_node_val(n, 0);
        if (m->ndim == 0)
            continue; /* a scalar input stays whole */
        if (!ag_shard_divisible(m->sizes[0], W, 0)) {
            char ds[128];
            ag_desc_repr(d, ds, sizeof ds);
            return ag__err(AG_EINVAL,
                           "%s: %s: the batch (dim 0, size %lld) does not divide by %d ranks", fn,
                           ds, (long long)m->sizes[0], W);
        }
        int rc = ag_shard_plan_set(p, d, AG_P_SHARD(0));
        if (rc)
            return rc;
    }
    return 0;
}

ag_shard_plan *ag_shard_plan_dp(const ag_joint *j, const ag_mesh *mesh) {
    if (check_mesh("shard_plan_dp", j, mesh))
        return NULL;
    ag_shard_plan *p = ag_shard_plan_new();
    if (!p)
        return NULL;
    ag__shard_plan_set_strategy(p, "dp");
    if (shard_batch("shard_plan_dp", p, j, mesh->size)) {
        ag_shard_plan_free(p);
        return NULL;
    }
    return p;
}

ag_shard_plan *ag_shard_plan_fsdp(const ag_joint *j, const ag_mesh *mesh) {
    if (check_mesh("shard_plan_fsdp", j, mesh))
        return NULL;
    ag_shard_plan *p = ag_shard_plan_new();
    if (!p)
        return NULL;
    ag__shard_plan_set_strategy(p, "fsdp");
    ag_shard_plan_set_gather_params(p, true);
    int rc = shard_batch("shard_plan_fsdp", p, j, mesh->size);
    for (ag_node *n = ag_graph_first(ag_joint_graph(j)); n && !rc; n = ag_node_next(n)) {
        const ag_desc *d = ag_node_desc(n);
        if (ag_node_kind_of(n) != AG_NODE_PLACEHOLDER || !d || ag_desc_kind_of(d) != AG_DESC_PARAM)
            continue;
        const ag_tmeta *m = ag_node_val(n, 0);
        if (m->ndim >= 1 && ag_shard_divisible(m->sizes[0], mesh->size, 0))
            rc = ag_shard_plan_set(p, d, AG_P_SHARD(0));
    }
    if (rc) {
        ag_shard_plan_free(p);
        return NULL;
    }
    return p;
}

/* ---- tp ---- */

typedef struct linear {
    ag_node *out, *in, *weight, *bias; /* bias NULL when none */
    bool used;
} linear;

static ag_node *param_of(ag_node *n) {
    return n && ag_node_kind_of(n) == AG_NODE_PLACEHOLDER && ag_desc_is_param(ag_node_desc(n))
               ? n
               : NULL;
}

static bool forward(const ag_node *n) {
    const char *tag = ag_node_partitioner_tag(n);
    return tag && !strcmp(tag, "is_forward");
}

/* n as a Linear: addmm(bias, x, t(W)) or mm(x, t(W)) with W (and bias) parameters. */
static bool as_linear(ag_node *n, linear *L) {
    if (ag_node_kind_of(n) != AG_NODE_CALL || !forward(n))
        return false;
    bool addmm = ag__node_is_op(n, "addmm"), mm = ag__node_is_op(n, "mm");
    if (!addmm && !mm)
        return false;
    ag_node *t = ag_node_arg_node(n, addmm ? 2 : 1);
    if (!ag__node_is_op(t, "t") || !param_of(ag_node_arg_node(t, 0)))
        return false;
    L->out = n;
    L->in = ag_node_arg_node(n, addmm ? 1 : 0);
    L->weight = ag_node_arg_node(t, 0);
    L->bias = addmm ? param_of(ag_node_arg_node(n, 0)) : NULL;
    if (addmm && !L->bias)
        return false;
    L->used = false;
    return true;
}

static bool passes_through(const ag_node *n) {
    if (ag_node_kind_of(n) == AG_NODE_GETITEM)
        return true;
    if (ag_node_kind_of(n) != AG_NODE_CALL || !forward(n))
        return false;
    const ag_opdef *def = ag_op_def(ag_node_op(n));
    const char *name = ag_op_name(ag_node_op(n));
    if (def->flags & (AG_OP_POINTWISE | AG_OP_VIEW))
        return true;
    static const char *const ok[] = {"clone",    "contiguous",     "split.Tensor", "bmm",
                                     "_softmax", "native_dropout", "_to_copy"};
    for (size_t i = 0; i < sizeof ok / sizeof *ok; i++)
        if (!strcmp(name, ok[i]))
            return true;
    return strstr(name, "scaled_dot_product") != NULL;
}

/* A split of the value in three along its last dim (q, k, v). */
static bool splits_in_three(const ag_node *n) {
    if (!ag__node_is_op(n, "split.Tensor") || ag_node_num_vals(n) != 3)
        return false;
    const ag_tmeta *m = ag_node_val(ag_node_arg_node(n, 0), 0);
    const ag_garg *dim = ag_node_nargs(n) > 2 ? ag_node_arg(n, 2) : NULL;
    int64_t d = dim && dim->kind == AG_GA_INT ? dim->u.i : 0;
    return d == m->ndim - 1 || d == -1;
}

/* The first unused Linear whose input the output of L1 reaches (breadth first), or -1; *qkv
 * says whether the way went through a split in three. */
static int find_partner(const ag_graph *g, linear *ls, int nl, int l1, int *stamp, int gen,
                        ag_node **queue, bool *qkv) {
    int head = 0, tail = 0;
    queue[tail++] = ls[l1].out;
    stamp[ag_node_index(ls[l1].out)] = gen;
    *qkv = false;
    (void)g;
    while (head < tail) {
        ag_node *v = queue[head++];
        for (int u = 0; u < ag_node_num_users(v); u++) {
            ag_node *w = ag_node_user(v, u);
            for (int k = 0; k < nl; k++)
                if (k != l1 && !ls[k].used && ls[k].out == w && ls[k].in == v)
                    return k;
            if (stamp[ag_node_index(w)] == gen || !passes_through(w))
                continue;
            if (splits_in_three(w))
                *qkv = true;
            stamp[ag_node_index(w)] = gen;
            queue[tail++] = w;
        }
    }
    return -1;
}

static int set_node(ag_shard_plan *p, ag_node *ph, ag_placement pl) {
    return ph ? ag_shard_plan_set(p, ag_node_desc(ph), pl) : 0;
}

ag_shard_plan *ag_shard_plan_tp(const ag_joint *j, const ag_mesh *mesh) {
    if (check_mesh("shard_plan_tp", j, mesh))
        return NULL;
    const ag_graph *g = ag_joint_graph(j);
    int nn = ag_graph_num_nodes(g), W = mesh->size;
    linear *ls = ag__calloc((size_t)nn + 1, sizeof *ls);
    int *stamp = ag__calloc((size_t)nn + 1, sizeof *stamp);
    ag_node **queue = ag__calloc((size_t)nn + 1, sizeof *queue);
    ag_shard_plan *p = ag_shard_plan_new();
    int rc = ls && stamp && queue && p ? 0 : AG_ENOMEM, nl = 0, npairs = 0;
    for (ag_node *n = ag_graph_first(g); n && !rc; n = ag_node_next(n))
        if (as_linear(n, &ls[nl]))
            nl++;
    for (int a = 0; a < nl && !rc; a++) {
        if (ls[a].used)
            continue;
        bool qkv;
        int b = find_partner(g, ls, nl, a, stamp, a + 1, queue, &qkv);
        if (b < 0)
            continue;
        const ag_tmeta *w1 = ag_node_val(ls[a].weight, 0), *w2 = ag_node_val(ls[b].weight, 0);
        ag_placement col = AG_P_SHARD(0);
        if (qkv)
            col.split_factor = 3;
        if (!ag_shard_divisible(w1->sizes[0], W, col.split_factor) ||
            !ag_shard_divisible(w2->sizes[1], W, 0))
            continue;
        ls[a].used = ls[b].used = true;
        npairs++;
        rc = set_node(p, ls[a].weight, col);
        if (!rc)
            rc = set_node(p, ls[a].bias, col);
        if (!rc)
            rc = set_node(p, ls[b].weight, AG_P_SHARD(1));
    }
    if (!rc && npairs == 0)
        rc = ag__err(AG_EINVAL,
                     "shard_plan_tp: no Linear pair in the joint (%d Linears: a pair is a Linear "
                     "whose output reaches another's input through elementwise ops, views and "
                     "attention only, with out features divisible by %d ranks)",
                     nl, W);
    ag__free(ls);
    ag__free(stamp);
    ag__free(queue);
    if (rc) {
        ag_shard_plan_free(p);
        return NULL;
    }
    ag__shard_plan_set_strategy(p, "tp");
    return p;
}

ag_shard_plan *ag_shard_plan_strategy_new(const char *name, const ag_joint *j,
                                          const ag_mesh *mesh) {
    AG__CHECK_NULL_RET("shard_plan_strategy_new", name, NULL);
    if (!strcmp(name, "dp"))
        return ag_shard_plan_dp(j, mesh);
    if (!strcmp(name, "fsdp"))
        return ag_shard_plan_fsdp(j, mesh);
    if (!strcmp(name, "tp"))
        return ag_shard_plan_tp(j, mesh);
    ag__err(AG_EINVAL, "shard_plan_strategy_new: unknown strategy '%s' (dp, fsdp or tp)", name);
    return NULL;
}
