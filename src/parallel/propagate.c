/* Placement propagation and redistribution: the heart of the sharding pass.
 *
 * In: one call node of the source joint at a time (shard_joint.c walks them in order), with its
 * inputs already on the rank's graph at known placements. The node's op gets the rule's say
 * (ag_op_shard_rule: the op's ag_opdef.shard, or the one its flags give): which placement each
 * input must take and which its outputs then have. Out: the redistributions (collectives, each
 * followed by its wait_tensor, or local slices) appended to the rank's graph, then the call on
 * the local pieces, its local shapes checked against its global shapes and placements.
 *
 * Redistribution, from -> to (parallel.h's table): Partial -> Replicate all_reduce;
 * Partial -> Shard(d) reduce_scatter_tensor on dim d moved to the front; Shard(d) -> Replicate
 * all_gather_into_tensor likewise (a StridedShard's gathered chunks reordered block-major);
 * Replicate -> Shard(d) the rank's slice (a StridedShard's: its chunk of each block,
 * concatenated); Replicate -> Partial(avg) nothing, Partial(sum) divided by the world size;
 * anything else through Replicate(). Each redistribution of a value is made once and reused by
 * every later user that wants the same placement. */
#include "shard_internal.h"

#include "../ops/shard_rules.h"

#include <stdio.h>

const char *ag__pl_str(ag_placement pl, char *buf, size_t n) {
    return ag_placement_str(pl, buf, n);
}

const char *ag__meta_str(const ag_tmeta *m, char *buf, size_t n) {
    char sz[AG_MAX_DIMS * 22 + 4];
    snprintf(buf, n, "%s%s", ag_dtype_short(m->dtype),
             ag__fmt_sizes(sz, sizeof sz, m->ndim, m->sizes));
    return buf;
}

void ag__local_meta(const ag_tmeta *gm, ag_placement pl, int W, ag_tmeta *out) {
    *out = *gm;
    out->offset = 0;
    if (pl.kind == AG_SHARD && pl.dim < gm->ndim)
        out->sizes[pl.dim] /= W;
    int64_t st = 1;
    for (int d = out->ndim - 1; d >= 0; d--) {
        out->strides[d] = st;
        st *= out->sizes[d] > 1 ? out->sizes[d] : 1;
    }
}

int ag__copy_node_meta(ag_node *dst, const ag_node *src) {
    for (int i = 0; i < ag_node_meta_count(src); i++) {
        ag_mval v;
        const char *k = ag_node_meta_key_at(src, i, &v);
        int rc = ag_node_meta_set(dst, k, v);
        if (rc)
            return rc;
    }
    return ag_node_custom_count(src) ? ag_node_custom_copy(dst, src) : 0;
}

/* ---- inserted nodes ---- */

/* The op's name without namespace and overload: "all_reduce", "slice". */
static void base_name(const char *op, char *buf, size_t n) {
    const char *s = strstr(op, "::");
    s = s ? s + 2 : op;
    size_t len = strcspn(s, ".");
    if (len >= n)
        len = n - 1;
    memcpy(buf, s, len);
    buf[len] = 0;
}

ag_node *ag__shard_insert(ag__shard_pass *P, const char *opname, const ag_garg *args, int nargs,
                          ag_placement pl) {
    const ag_op *op = ag_op_find(opname);
    if (!op) {
        ag__err(AG_ENOTSUP, "shard_joint: op %s is not in the op table", opname);
        return NULL;
    }
    char base[64], name[96];
    base_name(opname, base, sizeof base);
    snprintf(name, sizeof name, "%s", base);
    for (int k = 1; ag_graph_find(P->g, name) || ag_graph_find(P->src, name); k++)
        snprintf(name, sizeof name, "%s_%d", base, k);
    ag_node *n = ag_graph_call(P->g, op, args, nargs, name);
    if (!n)
        return NULL;
    int rc = ag__node_set_placement(n, pl);
    const char *tag = P->cur ? ag_node_partitioner_tag(P->cur) : NULL;
    if (!rc && tag)
        rc = ag_node_set_partitioner_tag(n, tag);
    if (!rc && P->cur && ag_node_seq_nr(P->cur) >= 0)
        rc = ag_node_set_seq_nr(n, ag_node_seq_nr(P->cur));
    if (!rc && (ag_op_def(op)->flags & AG_OP_COLLECTIVE) && strcmp(opname, AG__C10D_WAIT))
        rc = ag_node_meta_set(n, "group_size", (ag_mval){.kind = AG_MV_INT, .u.i = P->W});
    return rc ? NULL : n;
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

/* x with dims 0 and d swapped (d == 0: x itself), made contiguous for a collective. */
static ag_node *to_front(ag__shard_pass *P, ag_node *x, int d, ag_placement pl) {
    if (d != 0)
        x = ag__shard_insert(P, "transpose.int", (ag_garg[]){AG_GA_N(x), AG_GA_I(0), AG_GA_I(d)}, 3,
                             pl);
    if (x && !contiguous(ag_node_val(x, 0)))
        x = ag__shard_insert(P, "clone", (ag_garg[]){AG_GA_N(x)}, 1, pl);
    return x;
}

static ag_node *back_from_front(ag__shard_pass *P, ag_node *x, int d, ag_placement pl) {
    if (!x || d == 0)
        return x;
    return ag__shard_insert(P, "transpose.int", (ag_garg[]){AG_GA_N(x), AG_GA_I(0), AG_GA_I(d)}, 3,
                            pl);
}

static ag_node *wait(ag__shard_pass *P, ag_node *x, ag_placement pl) {
    return x ? ag__shard_insert(P, AG__C10D_WAIT, (ag_garg[]){AG_GA_N(x)}, 1, pl) : NULL;
}

static const char *reduce_name(ag_partial_op op) {
    return op == AG_PARTIAL_AVG ? "avg" : "sum";
}

/* Partial(op) -> Replicate(). */
static ag_node *all_reduce(ag__shard_pass *P, ag_node *x, ag_partial_op op) {
    ag_node *r = ag__shard_insert(
        P, AG__C10D_ALL_REDUCE,
        (ag_garg[]){AG_GA_N(x), AG_GA_S(reduce_name(op)), AG_GA_S(P->group)}, 3, AG_P_REPLICATE);
    return wait(P, r, AG_P_REPLICATE);
}

/* Shard(d) or StridedShard(d, k) -> Replicate(). */
static ag_node *all_gather(ag__shard_pass *P, ag_node *x, ag_placement from) {
    int d = from.dim, k = from.split_factor > 1 ? from.split_factor : 1;
    ag_node *t = to_front(P, x, d, from);
    if (!t)
        return NULL;
    ag_node *gth = ag__shard_insert(P, AG__C10D_ALL_GATHER,
                                    (ag_garg[]){AG_GA_N(t), AG_GA_I(P->W), AG_GA_S(P->group)}, 3,
                                    AG_P_REPLICATE);
    ag_node *y = wait(P, gth, AG_P_REPLICATE);
    if (y && k > 1) {
        /* Gathered rank-major [W][k][c]: reorder block-major [k][W][c]. */
        const ag_tmeta *m = ag_node_val(y, 0);
        if (m->ndim + 2 > AG_MAX_DIMS) {
            ag__err(AG_ENOTSUP, "shard_joint: a StridedShard of a %d-dim tensor", m->ndim);
            return NULL;
        }
        int64_t sz[AG_MAX_DIMS + 2], full[AG_MAX_DIMS];
        int64_t c = m->sizes[0] / ((int64_t)P->W * k);
        sz[0] = P->W;
        sz[1] = k;
        sz[2] = c;
        for (int i = 1; i < m->ndim; i++)
            sz[i + 2] = m->sizes[i];
        memcpy(full, m->sizes, sizeof(int64_t) * (size_t)m->ndim);
        y = ag__shard_insert(P, "view", (ag_garg[]){AG_GA_N(y), AG_GA_INTS(sz, m->ndim + 2)}, 2,
                             AG_P_REPLICATE);
        if (y)
            y = ag__shard_insert(P, "transpose.int",
                                 (ag_garg[]){AG_GA_N(y), AG_GA_I(0), AG_GA_I(1)}, 3,
                                 AG_P_REPLICATE);
        if (y)
            y = ag__shard_insert(P, "clone", (ag_garg[]){AG_GA_N(y)}, 1, AG_P_REPLICATE);
        if (y)
            y = ag__shard_insert(P, "view", (ag_garg[]){AG_GA_N(y), AG_GA_INTS(full, m->ndim)}, 2,
                                 AG_P_REPLICATE);
    }
    return back_from_front(P, y, d, AG_P_REPLICATE);
}

/* Partial(op) -> Shard(d) (plain). */
static ag_node *reduce_scatter(ag__shard_pass *P, ag_node *x, ag_partial_op op, ag_placement to) {
    ag_node *t = to_front(P, x, to.dim, AG_P_PARTIAL(op));
    if (!t)
        return NULL;
    ag_node *rs = ag__shard_insert(
        P, AG__C10D_REDUCE_SCATTER,
        (ag_garg[]){AG_GA_N(t), AG_GA_S(reduce_name(op)), AG_GA_I(P->W), AG_GA_S(P->group)}, 4, to);
    return back_from_front(P, wait(P, rs, to), to.dim, to);
}

static ag_node *slice(ag__shard_pass *P, ag_node *x, int d, int64_t start, int64_t end,
                      ag_placement pl) {
    return ag__shard_insert(
        P, "slice.Tensor",
        (ag_garg[]){AG_GA_N(x), AG_GA_I(d), AG_GA_I(start), AG_GA_I(end), AG_GA_I(1)}, 5, pl);
}

/* Replicate() -> Shard(d) / StridedShard(d, k): this rank's chunk (of each block). */
static ag_node *local_chunk(ag__shard_pass *P, ag_node *x, ag_placement to) {
    int d = to.dim, k = to.split_factor > 1 ? to.split_factor : 1;
    int64_t n = ag_node_val(x, 0)->sizes[d], blk = n / k, c = blk / P->W;
    if (k == 1)
        return slice(P, x, d, P->rank * c, (P->rank + 1) * c, to);
    ag_node *parts[AG_MAX_ARGS * 4];
    if (k > (int)(sizeof parts / sizeof *parts)) {
        ag__err(AG_ENOTSUP, "shard_joint: StridedShard split factor %d is above %d", k,
                (int)(sizeof parts / sizeof *parts));
        return NULL;
    }
    for (int b = 0; b < k; b++)
        if (!(parts[b] = slice(P, x, d, b * blk + P->rank * c, b * blk + (P->rank + 1) * c, to)))
            return NULL;
    return ag__shard_insert(P, "cat", (ag_garg[]){AG_GA_NODES(parts, k), AG_GA_I(d)}, 2, to);
}

/* Node x (a value of placement Replicate()) moved to `to`. */
static ag_node *from_replicate(ag__shard_pass *P, ag_node *x, ag_placement to) {
    switch (to.kind) {
    case AG_REPLICATE:
        return x;
    case AG_SHARD:
        return local_chunk(P, x, to);
    case AG_PARTIAL:
        if (to.op == AG_PARTIAL_AVG)
            return x;
        return ag__shard_insert(P, "div.Scalar", (ag_garg[]){AG_GA_N(x), AG_GA_F((double)P->W)}, 2,
                                to);
    }
    return x;
}

static ag_node *cache_get(ag__shard_pass *P, int si, ag_placement pl) {
    for (int e = P->cache_head[si]; e >= 0; e = P->cache[e].next)
        if (ag_placement_eq(P->cache[e].pl, pl))
            return P->cache[e].node;
    return NULL;
}

static int cache_put(ag__shard_pass *P, int si, ag_placement pl, ag_node *n) {
    if (P->ncache == P->cache_cap &&
        ag__grow((void **)&P->cache, &P->cache_cap, P->ncache + 1, sizeof *P->cache))
        return AG_ENOMEM;
    P->cache[P->ncache] = (ag__redist){.src = si, .next = P->cache_head[si], .pl = pl, .node = n};
    P->cache_head[si] = (int)P->ncache++;
    return 0;
}

ag_node *ag__redistribute(ag__shard_pass *P, int si, ag_placement to) {
    ag__sval *v = &P->val[si];
    if (ag_placement_eq(v->pl, to))
        return v->node;
    ag_node *hit = cache_get(P, si, to);
    if (hit)
        return hit;
    ag_placement from = v->pl;
    ag_node *y, *reduced = from.kind == AG_PARTIAL ? cache_get(P, si, AG_P_REPLICATE) : NULL;
    if (from.kind == AG_REPLICATE)
        y = from_replicate(P, v->node, to);
    else if (reduced) /* all_reduced already for an earlier user */
        y = from_replicate(P, reduced, to);
    else if (from.kind == AG_PARTIAL && to.kind == AG_SHARD && to.split_factor <= 1)
        y = reduce_scatter(P, v->node, from.op, to);
    else {
        ag_node *r = ag_placement_eq(to, AG_P_REPLICATE) ? NULL : cache_get(P, si, AG_P_REPLICATE);
        if (!r) {
            r = from.kind == AG_PARTIAL ? all_reduce(P, v->node, from.op)
                                        : all_gather(P, v->node, from);
            if (r && !ag_placement_eq(to, AG_P_REPLICATE) && cache_put(P, si, AG_P_REPLICATE, r))
                return NULL;
        }
        y = r ? from_replicate(P, r, to) : NULL;
    }
    if (!y || cache_put(P, si, to, y))
        return NULL;
    return y;
}

/* ---- one call node ---- */

static bool is_tensor_type(ag_type t) {
    return t == AG_TY_TENSOR || t == AG_TY_OPT_TENSOR;
}
static bool is_tensor_list_type(ag_type t) {
    return t == AG_TY_TENSOR_LIST || t == AG_TY_OPT_TENSOR_LIST;
}

/* A graph argument as an op argument (tensors as NULL: a rule sees metadata only). */
static ag_arg garg_to_arg(const ag_garg *a, ag_tensor **nulls) {
    switch (a->kind) {
    case AG_GA_NODE:
        return AG_A_T(NULL);
    case AG_GA_NODES:
        return AG_A_TS(nulls, a->n);
    case AG_GA_INT:
        return AG_A_I(a->u.i);
    case AG_GA_FLOAT:
        return AG_A_F(a->u.f);
    case AG_GA_BOOL:
        return AG_A_B(a->u.b);
    case AG_GA_INTS:
        return AG_A_INTS(a->u.ints, a->n);
    case AG_GA_DTYPE:
        return AG_A_DT(a->u.dt);
    case AG_GA_STR:
        return AG_A_S(a->u.s);
    case AG_GA_NONE:
    case AG_GA_TUPLE: /* refused by ag__shard_call */
    case AG_GA_DICT:
        break;
    }
    return AG_A_NONE;
}

static ag_garg arg_to_garg(const ag_arg *a) {
    switch (a->kind) {
    case AG_ARG_INT:
        return AG_GA_I(a->u.i);
    case AG_ARG_FLOAT:
        return AG_GA_F(a->u.f);
    case AG_ARG_BOOL:
        return AG_GA_B(a->u.b);
    case AG_ARG_INTS:
        return AG_GA_INTS(a->u.ints, a->n);
    case AG_ARG_DTYPE:
        return AG_GA_DT(a->u.dt);
    case AG_ARG_STR:
        return AG_GA_S(a->u.s);
    default:
        return AG_GA_NIL;
    }
}

static bool arg_same(const ag_arg *a, const ag_arg *b) {
    if (a->kind != b->kind)
        return false;
    switch (a->kind) {
    case AG_ARG_INT:
        return a->u.i == b->u.i;
    case AG_ARG_FLOAT:
        return a->u.f == b->u.f;
    case AG_ARG_BOOL:
        return a->u.b == b->u.b;
    case AG_ARG_INTS:
        return a->n == b->n &&
               (a->n == 0 || !memcmp(a->u.ints, b->u.ints, sizeof(int64_t) * (size_t)a->n));
    case AG_ARG_DTYPE:
        return a->u.dt == b->u.dt;
    case AG_ARG_STR:
        return !strcmp(a->u.s, b->u.s);
    default:
        return true;
    }
}

/* "[Shard(0), Replicate()]" of n placements. */
static const char *pls_str(const ag_placement *pl, int n, char *buf, size_t cap) {
    size_t len = (size_t)snprintf(buf, cap, "[");
    for (int i = 0; i < n && len < cap; i++) {
        char one[64];
        len += (size_t)snprintf(buf + len, cap - len, "%s%s", i ? ", " : "",
                                ag__pl_str(pl[i], one, sizeof one));
    }
    if (len < cap)
        snprintf(buf + len, cap - len, "]");
    return buf;
}

/* Materializes a gather-on-use parameter: all_gather before this first user, the gather and
 * its wait tagged to be recomputed in the backward. */
static int gather_param(ag__shard_pass *P, int si) {
    ag__sval *v = &P->val[si];
    ag_node *last = ag_graph_last(P->g);
    ag_node *y = ag__redistribute(P, si, AG_P_REPLICATE);
    if (!y)
        return ag_last_status() ? ag_last_status() : AG_ENOMEM;
    for (ag_node *n = ag_node_next(last); n; n = ag_node_next(n)) {
        int rc = ag_node_set_recompute(n, AG_MUST_RECOMPUTE);
        if (rc)
            return rc;
    }
    v->node = y;
    v->pl = AG_P_REPLICATE;
    v->gather_on_use = false;
    return 0;
}

int ag__shard_call(ag__shard_pass *P, const ag_node *n) {
    const ag_op *op = ag_node_op(n);
    const ag_opdef *def = ag_op_def(op);
    const char *opname = ag_op_name(op);
    int nargs = ag_op_nargs(op), srcn = ag_node_nargs(n);
    if (nargs > AG_MAX_ARGS)
        return ag__err(AG_ENOTSUP, "shard_joint: node '%s' (%s) has %d arguments", ag_node_name(n),
                       opname, nargs);
    for (int i = 0; i < srcn; i++) /* a higher-order op's tuple or dict (flex_attention) */
        if (ag_node_arg(n, i)->kind == AG_GA_TUPLE || ag_node_arg(n, i)->kind == AG_GA_DICT)
            return ag__err(AG_ENOTSUP,
                           "shard_joint: node '%s' (%s): argument %d is a tuple or dict; the "
                           "sharding pass has no rule for it",
                           ag_node_name(n), opname, i);
    /* Tensor inputs in schema order (list elements each one, None slots too). */
    int tin_src[AG_MAX_ARGS * 8];
    int ntin = 0;
    for (int i = 0; i < srcn; i++) {
        const ag_garg *a = ag_node_arg(n, i);
        const ag_schema_arg *sa = ag_op_arg(op, i);
        if (a->kind == AG_GA_NODE || (a->kind == AG_GA_NONE && is_tensor_type(sa->type))) {
            if (ntin == (int)(sizeof tin_src / sizeof *tin_src))
                return ag__err(AG_ENOTSUP, "shard_joint: node '%s' has too many tensor inputs",
                               ag_node_name(n));
            tin_src[ntin++] = a->kind == AG_GA_NODE ? ag_node_index(a->u.node) : -1;
        } else if (a->kind == AG_GA_NODES) {
            for (int e = 0; e < a->n; e++) {
                if (ntin == (int)(sizeof tin_src / sizeof *tin_src))
                    return ag__err(AG_ENOTSUP, "shard_joint: node '%s' has too many tensor inputs",
                                   ag_node_name(n));
                tin_src[ntin++] = a->u.nodes[e] ? ag_node_index(a->u.nodes[e]) : -1;
            }
        }
    }
    for (int j = 0; j < ntin; j++)
        if (tin_src[j] >= 0 && P->val[tin_src[j]].gather_on_use) {
            int rc = gather_param(P, tin_src[j]);
            if (rc)
                return rc;
        }
    int nout = ag_node_num_vals(n);
    if (nout > AG_MAX_OUTPUTS)
        return ag__err(AG_ENOTSUP, "shard_joint: node '%s' (%s) has %d outputs", ag_node_name(n),
                       opname, nout);
    ag_tmeta in_meta[AG_MAX_ARGS * 8], out_meta[AG_MAX_OUTPUTS];
    ag_placement in[AG_MAX_ARGS * 8], want[AG_MAX_ARGS * 8], out[AG_MAX_OUTPUTS];
    for (int j = 0; j < ntin; j++) {
        memset(&in_meta[j], 0, sizeof in_meta[j]);
        in[j] = AG_P_REPLICATE;
        if (tin_src[j] >= 0) {
            in_meta[j] = *ag_node_val(P->srcn[tin_src[j]], 0);
            in[j] = P->val[tin_src[j]].pl;
            /* A Partial value an earlier user had all_reduced is read reduced: no op then
             * carries the Partial on, to be reduced again further down. */
            if (in[j].kind == AG_PARTIAL && cache_get(P, tin_src[j], AG_P_REPLICATE))
                in[j] = AG_P_REPLICATE;
        }
        want[j] = in[j];
    }
    for (int k = 0; k < nout; k++) {
        out_meta[k] = *ag_node_val(n, k);
        out[k] = AG_P_REPLICATE;
    }
    /* The arguments in schema order, defaults filled. */
    ag_tensor *nulls[AG_MAX_ARGS * 8] = {0};
    ag_arg args[AG_MAX_ARGS];
    for (int i = 0; i < nargs; i++) {
        const ag_schema_arg *sa = ag_op_arg(op, i);
        args[i] = i < srcn          ? garg_to_arg(ag_node_arg(n, i), nulls)
                  : sa->has_default ? sa->def
                                    : AG_A_NONE;
    }
    ag_shard_ctx ctx;
    memset(&ctx, 0, sizeof ctx);
    ctx.op = def;
    ctx.args = args;
    ctx.nargs = nargs;
    ctx.ntensor_inputs = ntin;
    ctx.in_meta = in_meta;
    ctx.in = in;
    ctx.noutputs = nout;
    ctx.out_meta = out_meta;
    ctx.world = P->W;
    ctx.want = want;
    ctx.out = out;
    ag_arg local_args[AG_MAX_ARGS];
    memcpy(local_args, args, sizeof(ag_arg) * (size_t)nargs);
    ctx.local_args = local_args;
    char b1[512], b2[512], b3[128], b4[128];
    bool fallback = false;
    /* One rank: every placement is the whole tensor (shard_joint.c places everything
     * Replicate()); there is nothing to ask a rule. */
    int rc = P->W == 1 ? 0 : ag_op_shard_rule(def, &ctx);
    if (rc == AG_SHARD_NO_RULE) {
        fallback = true;
        for (int j = 0; j < ntin; j++)
            want[j] = AG_P_REPLICATE;
        for (int k = 0; k < nout; k++)
            out[k] = AG_P_REPLICATE;
        memcpy(local_args, args, sizeof(ag_arg) * (size_t)nargs);
    } else if (rc < 0) {
        return ag__shard_err(rc,
                             "shard_joint: node '%s' (%s) with inputs %s: its sharding rule failed",
                             ag_node_name(n), opname, pls_str(in, ntin, b1, sizeof b1));
    }
    /* A rule must not ask for an uneven or impossible Shard. */
    for (int j = 0; j < ntin; j++) {
        if (want[j].kind != AG_SHARD || tin_src[j] < 0)
            continue;
        if (want[j].dim >= in_meta[j].ndim ||
            !ag_shard_divisible(in_meta[j].sizes[want[j].dim], P->W, want[j].split_factor))
            return ag__err(AG_EINVAL,
                           "shard_joint: node '%s' (%s): its rule wants input %d (%s) as %s on "
                           "%d ranks, which does not divide",
                           ag_node_name(n), opname, j, ag__meta_str(&in_meta[j], b3, sizeof b3),
                           ag__pl_str(want[j], b4, sizeof b4), P->W);
    }
    /* What the redistributions below move, for the decomposition bookkeeping: a Replicate()
     * input is sliced locally, one moved before for another user is reused. */
    if (P->dl) {
        double moved = 0;
        bool gathers = false;
        for (int j = 0; j < ntin; j++) {
            if (tin_src[j] < 0 || ag_placement_eq(in[j], want[j]) || in[j].kind == AG_REPLICATE ||
                cache_get(P, tin_src[j], want[j]))
                continue;
            double b = (double)ag_dtype_size(in_meta[j].dtype);
            for (int d = 0; d < in_meta[j].ndim; d++)
                b *= (double)in_meta[j].sizes[d];
            moved += b;
            gathers |= in[j].kind == AG_SHARD;
        }
        if ((rc = ag__decomp_note(P, n, moved, gathers)))
            return rc;
    }
    /* Redistribute the inputs. */
    ag_node *local_in[AG_MAX_ARGS * 8];
    for (int j = 0; j < ntin; j++) {
        local_in[j] = NULL;
        if (tin_src[j] < 0)
            continue;
        P->cur = n;
        local_in[j] = ag__redistribute(P, tin_src[j], want[j]);
        if (!local_in[j])
            return ag__shard_err(ag_last_status() ? ag_last_status() : AG_ENOMEM,
                                 "shard_joint: node '%s' (%s): moving input %d from %s to %s",
                                 ag_node_name(n), opname, j, ag__pl_str(in[j], b3, sizeof b3),
                                 ag__pl_str(want[j], b4, sizeof b4));
    }
    /* The local call: tensors from the redistributed inputs, the rest from local_args. */
    int pass_n = srcn;
    for (int i = srcn; i < nargs; i++)
        if (!arg_same(&args[i], &local_args[i]))
            pass_n = i + 1;
    ag_garg gargs[AG_MAX_ARGS];
    int j = 0;
    for (int i = 0; i < pass_n; i++) {
        const ag_schema_arg *sa = ag_op_arg(op, i);
        const ag_garg *a = i < srcn ? ag_node_arg(n, i) : NULL;
        if (a && a->kind == AG_GA_NODE) {
            gargs[i] = AG_GA_N(local_in[j++]);
        } else if (a && a->kind == AG_GA_NODES) {
            /* local_in holds the list's elements in order: point into it. */
            gargs[i] = AG_GA_NODES(&local_in[j], a->n);
            j += a->n;
        } else if (a && a->kind == AG_GA_NONE && is_tensor_type(sa->type)) {
            gargs[i] = AG_GA_NIL;
            j++;
        } else if (is_tensor_type(sa->type) || is_tensor_list_type(sa->type)) {
            gargs[i] = AG_GA_NIL;
        } else {
            gargs[i] = arg_to_garg(&local_args[i]);
        }
    }
    ag_node *m = ag_graph_call(P->g, op, gargs, pass_n, ag_node_name(n));
    if (!m)
        return ag__shard_err(ag_last_status() ? ag_last_status() : AG_ENOMEM,
                             "shard_joint: node '%s' (%s) on local pieces %s", ag_node_name(n),
                             opname, pls_str(want, ntin, b1, sizeof b1));
    if ((rc = ag__copy_node_meta(m, n)) || (rc = ag__node_set_placement(m, out[0])))
        return rc;
    if (fallback &&
        (rc = ag_node_meta_set(m, "shard_fallback", (ag_mval){.kind = AG_MV_BOOL, .u.b = true})))
        return rc;
    /* Each output's local shape is its global shape cut by its placement. */
    for (int k = 0; k < nout; k++) {
        ag_tmeta want_local;
        if (out[k].kind == AG_SHARD &&
            (out[k].dim >= out_meta[k].ndim ||
             !ag_shard_divisible(out_meta[k].sizes[out[k].dim], P->W, out[k].split_factor)))
            return ag__err(AG_EINVAL,
                           "shard_joint: node '%s' (%s): its rule gives output %d (%s) as %s on "
                           "%d ranks, which does not divide",
                           ag_node_name(n), opname, k, ag__meta_str(&out_meta[k], b3, sizeof b3),
                           ag__pl_str(out[k], b4, sizeof b4), P->W);
        ag__local_meta(&out_meta[k], out[k], P->W, &want_local);
        const ag_tmeta *got = ag_node_val(m, k);
        bool same = got->ndim == want_local.ndim && got->dtype == want_local.dtype;
        for (int d = 0; same && d < got->ndim; d++)
            same = got->sizes[d] == want_local.sizes[d];
        if (!same) {
            char g1[128];
            return ag__err(AG_EINVAL,
                           "shard_joint: node '%s' (%s) with inputs %s gives output %d as %s on "
                           "a rank; %s of %s on %d ranks is %s",
                           ag_node_name(n), opname, pls_str(want, ntin, b1, sizeof b1), k,
                           ag__meta_str(got, g1, sizeof g1), ag__pl_str(out[k], b4, sizeof b4),
                           ag__meta_str(&out_meta[k], b3, sizeof b3), P->W,
                           ag__meta_str(&want_local, b2, sizeof b2));
        }
    }
    ag__sval *v = &P->val[ag_node_index(n)];
    v->node = m;
    v->pl = out[0];
    if (nout > 1) {
        v->outpl = ag__malloc(sizeof(ag_placement) * (size_t)nout);
        if (!v->outpl)
            return AG_ENOMEM;
        memcpy(v->outpl, out, sizeof(ag_placement) * (size_t)nout);
    }
    return 0;
}
