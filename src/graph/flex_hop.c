/* The higher-order ops flex_attention and flex_attention_backward as graph nodes (upstream's
 * torch.ops.higher_order.flex_attention / flex_attention_backward), made by the tracer
 * (src/trace/flex_trace.c) when ag_flex_attention runs under a trace, with upstream's
 * arguments:
 *
 *   flex_attention(Tensor query, Tensor key, Tensor value, Tensor score_mod, Any block_mask,
 *                  float scale, Any kernel_options, Any score_mod_other_buffers,
 *                  Any mask_mod_other_buffers) -> (Tensor out, Tensor logsumexp)
 *   flex_attention_backward(Tensor query, Tensor key, Tensor value, Tensor out,
 *                  Tensor logsumexp, Tensor? grad_out, Tensor? grad_logsumexp, Tensor fw_graph,
 *                  Tensor joint_graph, Any block_mask, float scale, Any kernel_options,
 *                  Any score_mod_other_buffers, Any mask_mod_other_buffers)
 *       -> Tensor[] (grad_query, grad_key, grad_value, a gradient per score_mod buffer)
 *
 * score_mod, fw_graph and joint_graph are get_attrs of subgraphs (sdpa_score0, fw_graph0,
 * joint_graph0); block_mask is the tuple of upstream's BlockMask.as_tuple(): (Q_LEN, KV_LEN,
 * kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, q_num_blocks, q_indices,
 * full_q_num_blocks, full_q_indices, Q_BLOCK_SIZE, KV_BLOCK_SIZE, the mask graph's get_attr
 * (sdpa_mask0 / mask_graph0, None without a mask_mod)); kernel_options is the dict upstream's
 * _apply_kernel_options records on CPU (ag__flex_kernel_options); the buffers are tuples of
 * tensors. Both ops are flagged AG_OP_SUBGRAPH and kept out of the registry like
 * invoke_subgraph; meta inference (ag__subgraph_infer hands them here) reads the arguments
 * (ag__flex_args_read, which names the argument and element that is wrong) and gives the
 * outputs' metadata. The interpreter runs them through ag__flex_run (below), the planned executor
 * through its tile plans (src/runtime/plan_flex.c; ag__flex_call_run when those cannot be
 * made); neither has an op kernel (refused). Text in the form before tuples (block_mask a
 * list of 9 and an int list [KV_LEN, Q_LEN, Q_BLOCK_SIZE, KV_BLOCK_SIZE], no kernel_options)
 * still parses (ag__flex_legacy_args). */
#include "graph_internal.h"

#include "../autograd/flex_internal.h"

#include <pthread.h>

static int refuse_meta(const ag_arg *args, ag_tmeta *out) {
    (void)args, (void)out;
    return ag__err(AG_ENOTSUP, "flex_attention: a higher-order op of graphs; its calls are "
                               "inferred by the graph layer");
}

static int refuse_kernel(const ag_arg *args, ag_tensor **outs) {
    (void)args, (void)outs;
    return ag__err(AG_ENOTSUP, "flex_attention: a higher-order op of graphs; the interpreter "
                               "and the planned executor run its calls");
}

static const ag_opdef fwd_def = {
    .schema = "flex_attention(Tensor query, Tensor key, Tensor value, Tensor score_mod, "
              "Any block_mask, float scale, Any kernel_options, Any score_mod_other_buffers, "
              "Any mask_mod_other_buffers) -> (Tensor, Tensor)",
    .flags = AG_OP_SUBGRAPH,
    .meta = refuse_meta,
    .kernel = refuse_kernel,
    .dtypes = AG_DT_FLOAT,
};

static const ag_opdef bwd_def = {
    .schema = "flex_attention_backward(Tensor query, Tensor key, Tensor value, Tensor out, "
              "Tensor logsumexp, Tensor? grad_out, Tensor? grad_logsumexp, Tensor fw_graph, "
              "Tensor joint_graph, Any block_mask, float scale, Any kernel_options, "
              "Any score_mod_other_buffers, Any mask_mod_other_buffers) -> Tensor[]",
    .flags = AG_OP_SUBGRAPH | AG_OP_BACKWARD_HELPER,
    .meta = refuse_meta,
    .kernel = refuse_kernel,
    .dtypes = AG_DT_FLOAT,
};

static ag_op *fwd_op, *bwd_op;
static pthread_once_t ops_once = PTHREAD_ONCE_INIT;

static void make_ops(void) {
    fwd_op = ag__op_new_detached(&fwd_def);
    bwd_op = ag__op_new_detached(&bwd_def);
}

__attribute__((destructor)) static void free_ops(void) {
    ag__op_free_detached(fwd_op);
    ag__op_free_detached(bwd_op);
    fwd_op = bwd_op = NULL;
}

const ag_op *ag__op_flex_attention(bool backward) {
    pthread_once(&ops_once, make_ops);
    const ag_op *op = backward ? bwd_op : fwd_op;
    if (!op)
        ag__err(AG_ENOMEM, "flex_attention: out of memory making the op");
    return op;
}

const ag_op *ag__op_flex_find(const char *name) {
    if (!strcmp(name, "flex_attention"))
        return ag__op_flex_attention(false);
    if (!strcmp(name, "flex_attention_backward"))
        return ag__op_flex_attention(true);
    return NULL;
}

bool ag__op_is_flex(const ag_op *op) {
    return op && (op == fwd_op || op == bwd_op);
}

/* ---- the arguments ---- */

/* upstream's _apply_kernel_options on CPU, in its insertion order; OUTPUT_LOGSUMEXP is True
 * only for return_lse (a CPU call records False otherwise, even under autograd). */
static const ag_gitem kernel_options[2][7] = {
    {{"BACKEND", {.kind = AG_MV_STR, .u.s = "AUTO"}},
     {"PRESCALE_QK", {.kind = AG_MV_BOOL, .u.b = false}},
     {"ROWS_GUARANTEED_SAFE", {.kind = AG_MV_BOOL, .u.b = false}},
     {"BLOCKS_ARE_CONTIGUOUS", {.kind = AG_MV_BOOL, .u.b = false}},
     {"WRITE_DQ", {.kind = AG_MV_BOOL, .u.b = true}},
     {"OUTPUT_LOGSUMEXP", {.kind = AG_MV_BOOL, .u.b = false}},
     {"OUTPUT_MAX", {.kind = AG_MV_BOOL, .u.b = false}}},
    {{"BACKEND", {.kind = AG_MV_STR, .u.s = "AUTO"}},
     {"PRESCALE_QK", {.kind = AG_MV_BOOL, .u.b = false}},
     {"ROWS_GUARANTEED_SAFE", {.kind = AG_MV_BOOL, .u.b = false}},
     {"BLOCKS_ARE_CONTIGUOUS", {.kind = AG_MV_BOOL, .u.b = false}},
     {"WRITE_DQ", {.kind = AG_MV_BOOL, .u.b = true}},
     {"OUTPUT_LOGSUMEXP", {.kind = AG_MV_BOOL, .u.b = true}},
     {"OUTPUT_MAX", {.kind = AG_MV_BOOL, .u.b = false}}},
};

ag_garg ag__flex_kernel_options(bool return_lse) {
    return AG_GA_DICT(kernel_options[return_lse], 7);
}

static const char *const bm_names[13] = {
    "Q_LEN",           "KV_LEN",        "kv_num_blocks", "kv_indices",        "full_kv_num_blocks",
    "full_kv_indices", "q_num_blocks",  "q_indices",     "full_q_num_blocks", "full_q_indices",
    "Q_BLOCK_SIZE",    "KV_BLOCK_SIZE", "mask_mod"};

static const ag_node *tensor_node(const ag_garg *a) {
    return a->kind == AG_GA_NODE && a->u.node && a->u.node->nvals == 1 && !a->u.node->sub
               ? a->u.node
               : NULL;
}

static bool is_subgraph_arg(const ag_garg *a) {
    return a->kind == AG_GA_NODE && a->u.node && a->u.node->sub;
}

/* Argument i, a tuple of tensors (the buffers), into fa. */
static int read_buffers(const char *opn, const ag_garg *args, int i, const ag_garg **out, int *n) {
    static const char *const what[2] = {"score_mod_other_buffers", "mask_mod_other_buffers"};
    const ag_garg *a = &args[i];
    const char *nm = what[(i == 8 || i == 13)];
    if (a->kind != AG_GA_TUPLE)
        return ag__err(AG_EINVAL, "%s: %s (argument %d) must be a tuple of tensors, not %s", opn,
                       nm, i, ag__garg_kind_name(a->kind));
    if (a->n > 64)
        return ag__err(AG_EINVAL, "%s: %s (argument %d) has %d tensors (at most 64)", opn, nm, i,
                       a->n);
    for (int k = 0; k < a->n; k++)
        if (!tensor_node(&a->u.elems[k]))
            return ag__err(AG_EINVAL, "%s: %s (argument %d) element %d is %s; a tensor expected",
                           opn, nm, i, k,
                           is_subgraph_arg(&a->u.elems[k])
                               ? "a subgraph"
                               : ag__garg_kind_name(a->u.elems[k].kind));
    *out = a->u.elems;
    *n = a->n;
    return 0;
}

int ag__flex_args_read(const ag_op *op, const ag_garg *args, int nargs, ag__flex_args *fa) {
    const bool bwd = op == bwd_op;
    const char *opn = ag_op_name(op);
    memset(fa, 0, sizeof *fa);
    fa->bwd = bwd;
    if (nargs != (bwd ? 14 : 9))
        return ag__err(AG_EINVAL, "%s: %d arguments (takes %d)", opn, nargs, bwd ? 14 : 9);
    const ag_node **t3[3] = {&fa->q, &fa->k, &fa->v};
    for (int i = 0; i < 3; i++)
        if (!(*t3[i] = tensor_node(&args[i])))
            return ag__err(AG_EINVAL, "%s: query, key and value must be tensors (argument %d)", opn,
                           i);
    const int isub = bwd ? 7 : 3, ibm = bwd ? 9 : 4;
    if (!is_subgraph_arg(&args[isub]) || (bwd && !is_subgraph_arg(&args[8])))
        return ag__err(AG_EINVAL, "%s: argument %d must be a get_attr of a subgraph", opn,
                       !is_subgraph_arg(&args[isub]) ? isub : 8);
    fa->score = args[isub].u.node;
    fa->joint = bwd ? args[8].u.node : NULL;
    if (bwd) {
        const ag_node **t4[4] = {&fa->out, &fa->lse, &fa->go, &fa->gl};
        for (int i = 0; i < 4; i++)
            if (!(*t4[i] = tensor_node(&args[3 + i])) && (i < 2 || args[3 + i].kind != AG_GA_NONE))
                return ag__err(AG_EINVAL, "%s: argument %d must be a tensor%s", opn, 3 + i,
                               i < 2 ? "" : " or None");
    }
    /* block_mask: upstream's BlockMask.as_tuple() */
    const ag_garg *bm = &args[ibm];
    if (bm->kind != AG_GA_TUPLE)
        return ag__err(AG_EINVAL, "%s: block_mask (argument %d) must be a tuple, not %s", opn, ibm,
                       ag__garg_kind_name(bm->kind));
    if (bm->n != 13)
        return ag__err(AG_EINVAL,
                       "%s: block_mask (argument %d) has %d elements; upstream's "
                       "BlockMask.as_tuple() has 13 (Q_LEN, KV_LEN, 8 tensors, Q_BLOCK_SIZE, "
                       "KV_BLOCK_SIZE, mask_mod)",
                       opn, ibm, bm->n);
    int64_t ints[4];
    for (int e = 0; e < 13; e++) {
        const ag_garg *x = &bm->u.elems[e];
        const bool is_int = e < 2 || e == 10 || e == 11, is_mask = e == 12;
        bool ok;
        if (is_int)
            ok = x->kind == AG_GA_INT && x->u.i > 0;
        else if (is_mask)
            ok = x->kind == AG_GA_NONE || is_subgraph_arg(x);
        else /* kv_num_blocks and kv_indices are required; the others may be None */
            ok = tensor_node(x) || (e >= 4 && x->kind == AG_GA_NONE);
        if (!ok)
            return ag__err(AG_EINVAL,
                           "%s: block_mask (argument %d) element %d (%s) is %s; %s "
                           "expected",
                           opn, ibm, e, bm_names[e],
                           is_subgraph_arg(x) ? "a subgraph" : ag__garg_kind_name(x->kind),
                           is_int    ? "a positive int"
                           : is_mask ? "the mask graph's get_attr or None"
                           : e >= 4  ? "a tensor or None"
                                     : "a tensor");
        if (is_int)
            ints[e < 2 ? e : e - 8] = x->u.i;
        else if (is_mask)
            fa->mask = x->kind == AG_GA_NONE ? NULL : x->u.node;
        else
            fa->parts[e - 2] = x->kind == AG_GA_NONE ? NULL : x->u.node;
    }
    /* the kernel's order: (KV_LEN, Q_LEN, Q_BLOCK_SIZE, KV_BLOCK_SIZE) */
    fa->sizes[0] = ints[1];
    fa->sizes[1] = ints[0];
    fa->sizes[2] = ints[2];
    fa->sizes[3] = ints[3];
    if (args[ibm + 1].kind != AG_GA_FLOAT)
        return ag__err(AG_EINVAL, "%s: scale (argument %d) must be a float, not %s", opn, ibm + 1,
                       ag__garg_kind_name(args[ibm + 1].kind));
    fa->scale = args[ibm + 1].u.f;
    const ag_garg *ko = &args[ibm + 2];
    if (ko->kind != AG_GA_DICT)
        return ag__err(AG_EINVAL, "%s: kernel_options (argument %d) must be a dict, not %s", opn,
                       ibm + 2, ag__garg_kind_name(ko->kind));
    for (int k = 0; k < ko->n; k++)
        if (!strcmp(ko->u.items[k].key, "OUTPUT_MAX") && ko->u.items[k].v.kind == AG_MV_BOOL &&
            ko->u.items[k].v.u.b)
            return ag__err(AG_EINVAL,
                           "%s: kernel_options (argument %d): OUTPUT_MAX=True (returning the max "
                           "scores) is not supported on CPU",
                           opn, ibm + 2);
    int rc = read_buffers(opn, args, ibm + 3, &fa->sb, &fa->nsb);
    return rc ? rc : read_buffers(opn, args, ibm + 4, &fa->mb, &fa->nmb);
}

int ag__flex_legacy_args(const ag_op *op, ag_garg *args, int *nargs, ag__flex_legacy *mem) {
    const bool bwd = op == bwd_op;
    const int ibm = bwd ? 9 : 4;
    if (!ag__op_is_flex(op) || *nargs != (bwd ? 14 : 9) || args[ibm].kind != AG_GA_NODES ||
        args[ibm].n != 9 || args[ibm + 1].kind != AG_GA_INTS || args[ibm + 1].n != 4)
        return 0;
    const ag_garg *lists[2] = {&args[ibm + 3], &args[ibm + 4]};
    ag_garg *dst[2] = {mem->sb, mem->mb};
    int cnt[2];
    for (int j = 0; j < 2; j++) {
        const ag_garg *l = lists[j];
        cnt[j] = l->kind == AG_GA_NODES ? l->n : l->kind == AG_GA_INTS && l->n == 0 ? 0 : -1;
        if (cnt[j] < 0 || cnt[j] > 64)
            return ag__err(AG_EINVAL, "%s: argument %d must list at most 64 tensors",
                           ag_op_name(op), ibm + 3 + j);
        for (int k = 0; k < cnt[j]; k++)
            dst[j][k] = l->u.nodes[k] ? AG_GA_N(l->u.nodes[k]) : AG_GA_NIL;
    }
    const int64_t *sz = args[ibm + 1].u.ints; /* (KV_LEN, Q_LEN, Q_BLOCK_SIZE, KV_BLOCK_SIZE) */
    mem->bm[0] = AG_GA_I(sz[1]);
    mem->bm[1] = AG_GA_I(sz[0]);
    for (int p = 0; p < 8; p++)
        mem->bm[2 + p] = args[ibm].u.nodes[p] ? AG_GA_N(args[ibm].u.nodes[p]) : AG_GA_NIL;
    mem->bm[10] = AG_GA_I(sz[2]);
    mem->bm[11] = AG_GA_I(sz[3]);
    mem->bm[12] = args[ibm].u.nodes[8] ? AG_GA_N(args[ibm].u.nodes[8]) : AG_GA_NIL;
    args[ibm] = AG_GA_TUPLE(mem->bm, 13);
    args[ibm + 1] = args[ibm + 2]; /* the scale */
    args[ibm + 2] = ag__flex_kernel_options(false);
    args[ibm + 3] = AG_GA_TUPLE(mem->sb, cnt[0]);
    args[ibm + 4] = AG_GA_TUPLE(mem->mb, cnt[1]);
    return 1;
}

/* ---- meta inference ---- */

int ag__flex_infer(const ag_op *op, const ag_garg *args, int nargs, ag_tmeta *vals, int *nvals) {
    const char *opn = ag_op_name(op);
    ag__flex_args fa;
    int rc = ag__flex_args_read(op, args, nargs, &fa);
    if (rc)
        return rc;
    const ag_tmeta *q = &fa.q->vals[0], *k = &fa.k->vals[0], *v = &fa.v->vals[0];
    if (q->ndim != 4 || k->ndim != 4 || v->ndim != 4 || q->dtype != k->dtype ||
        q->dtype != v->dtype || !ag_dtype_is_float(q->dtype) || q->sizes[0] != k->sizes[0] ||
        q->sizes[3] != k->sizes[3] || k->sizes[0] != v->sizes[0] || k->sizes[1] != v->sizes[1] ||
        k->sizes[2] != v->sizes[2] || k->sizes[1] < 1 || q->sizes[1] % k->sizes[1])
        return ag__err(AG_EINVAL,
                       "%s: query [B, Hq, L, E], key [B, Hkv, S, E] and value [B, Hkv, S, Ev] "
                       "of one float dtype expected",
                       opn);
    if (fa.sizes[0] != k->sizes[2] || fa.sizes[1] != q->sizes[2])
        return ag__err(AG_EINVAL,
                       "%s: the block mask is for Q_LEN=%lld, KV_LEN=%lld; query has L=%lld, key "
                       "S=%lld",
                       opn, (long long)fa.sizes[1], (long long)fa.sizes[0], (long long)q->sizes[2],
                       (long long)k->sizes[2]);
    memset(vals, 0, sizeof(ag_tmeta) * AG_MAX_OUTPUTS);
    if (!fa.bwd) {
        const int64_t o[4] = {q->sizes[0], q->sizes[1], q->sizes[2], v->sizes[3]};
        ag__tmeta_contiguous(&vals[0], q->dtype, 4, o);
        ag__tmeta_contiguous(&vals[1], q->dtype, 3, o);
        *nvals = 2;
        return 0;
    }
    if (3 + fa.nsb > AG_MAX_OUTPUTS)
        return ag__err(AG_EINVAL, "%s: %d buffers (at most %d)", opn, fa.nsb, AG_MAX_OUTPUTS - 3);
    const ag_tmeta *in[3] = {q, k, v};
    for (int i = 0; i < 3; i++)
        ag__tmeta_contiguous(&vals[i], in[i]->dtype, 4, in[i]->sizes);
    for (int i = 0; i < fa.nsb; i++) {
        const ag_tmeta *b = &fa.sb[i].u.node->vals[0];
        ag__tmeta_contiguous(&vals[3 + i], b->dtype, b->ndim, b->sizes);
    }
    *nvals = 3 + fa.nsb;
    return 0;
}

/* ---- graphs as score_mod / mask_mod ---- */

/* Graphs run per tile as upstream vmaps the 0-d function over the tile: on a copy of g whose
 * placeholders take the inputs' metadata, its calls' vals inferred again (ag_graph_run checks
 * its inputs against the placeholders). A call of ag__flex_call_run keeps such copies in a
 * tile_fn, one per distinct set of input metadata (full tiles and edge tiles: a handful), so
 * that each tile runs one without copying; ag_score_mod_graph / ag_mask_mod_graph, called
 * alone, make one per call. The kernel calls the functions serially on the calling thread
 * (run_rows and prepare_masks in flex_attention.c), and a tile_fn lives in one call only. */
#define TILE_SHAPES 8
#define TILE_MAX_IN 70

typedef struct tile_copy {
    ag_graph *g;  /* NULL: unused */
    ag_tmeta *in; /* the inputs' metadata the copy was inferred for (nin) */
} tile_copy;

typedef struct tile_fn {
    const ag_graph *g;
    bool tile; /* copies by ag__flex_tile_graph (inputs: score, b, h, q_idx, kv_idx, ...) */
    int next;  /* the entry to replace when all are used */
    tile_copy c[TILE_SHAPES];
} tile_fn;

static void tile_copy_free(tile_copy *c) {
    ag_graph_free(c->g);
    ag__free(c->in);
    c->g = NULL;
    c->in = NULL;
}

static void tile_fn_free(tile_fn *f) {
    for (int i = 0; i < TILE_SHAPES; i++)
        tile_copy_free(&f->c[i]);
}

/* A copy of g for inputs of metadata m (nin): its placeholders take them, its calls' vals
 * inferred again; NULL with the error set. */
static ag_graph *copy_for(const ag_graph *g, const ag_tmeta *m, int nin) {
    ag_graph *c = ag_graph_copy(g);
    if (!c)
        return NULL;
    int rc = 0, i = 0;
    for (ag_node *n = ag_graph_first(c); n && !rc; n = ag_node_next(n))
        if (ag_node_kind_of(n) == AG_NODE_PLACEHOLDER) {
            if (i >= nin) {
                rc = ag__err(AG_EINVAL,
                             "flex_attention: the graph function takes more than the "
                             "%d inputs given",
                             nin);
                break;
            }
            rc = ag_node_set_val(n, 0, &m[i++]);
        }
    if (!rc)
        rc = ag_graph_reinfer_meta(c);
    if (rc) {
        ag_graph_free(c);
        return NULL;
    }
    return c;
}

/* Whether node x of c varies over the tile: it depends on a placeholder whose metadata m (nin)
 * is not its 0-d val (the score, q_idx, kv_idx, the score's gradient; not b, h, the buffers).
 * Unsure (too deep): true. */
static bool tiled(const ag_node *x, ag_node *const *ph, int nph, const ag_tmeta *m, int nin,
                  int depth) {
    if (!x || depth > 64)
        return x != NULL;
    if (ag_node_kind_of(x) == AG_NODE_PLACEHOLDER) {
        for (int i = 0; i < nph && i < nin; i++)
            if (ph[i] == x)
                return !ag__tmeta_equal(ag_node_val(x, 0), &m[i]);
        return true;
    }
    for (int a = 0; a < ag_node_nargs(x); a++) {
        const ag_garg *g = ag_node_arg(x, a);
        if (g->kind == AG_GA_NODE && tiled(g->u.node, ph, nph, m, nin, depth + 1))
            return true;
        for (int k = 0; g->kind == AG_GA_NODES && k < g->n; k++)
            if (tiled(g->u.nodes[k], ph, nph, m, nin, depth + 1))
                return true;
    }
    return false;
}

/* index_put(self, indices, values, accumulate=True) of a 0-d function (values and every index
 * 0-d, one index per dimension of self: a scatter-add of one element, as a score_mod's joint
 * graph takes the gradient of buffer[h]) evaluated over a [bq, bk] tile (placeholders of
 * metadata m) must add every element's value, as upstream's vmap over the tile does. When no
 * index varies over the tile, the values are summed first (one element added); else indices
 * and values are expanded to the tile, so that the op indexes one element per tile position
 * and accumulates them all. Other calls are left alone. */
static int expand_scatters(ag_graph *c, int64_t bq, int64_t bk, const ag_tmeta *m, int nin) {
    const ag_op *ip = ag_op_find("index_put"), *ex = ag_op_find("expand");
    const ag_op *sum = ag_op_find("sum.dim_IntList");
    ag_node **phs = NULL, *ph[TILE_MAX_IN];
    int nph = ag_graph_placeholders(c, &phs); /* copied: valid until the graph changes */
    if (nph < 0)
        return nph;
    if (!ip || !ex || !sum)
        return 0;
    nph = nph < TILE_MAX_IN ? nph : TILE_MAX_IN;
    for (int i = 0; i < nph; i++)
        ph[i] = phs[i];
    int64_t tile[2] = {bq, bk};
    for (ag_node *n = ag_graph_first(c); n; n = ag_node_next(n)) {
        if (ag_node_kind_of(n) != AG_NODE_CALL || ag_node_op(n) != ip || ag_node_nargs(n) < 4 ||
            ag_node_arg(n, 3)->kind != AG_GA_BOOL || !ag_node_arg(n, 3)->u.b)
            continue;
        const ag_node *self = ag_node_arg_node(n, 0);
        const ag_garg *idx = ag_node_arg(n, 1);
        ag_node *val = ag_node_arg_node(n, 2);
        if (!self || !val || idx->kind != AG_GA_NODES || idx->n < 1 || idx->n > 8 ||
            idx->n != ag_node_val(self, 0)->ndim || ag_node_val(val, 0)->ndim != 0)
            continue;
        bool scalar = true, idx_tiled = false;
        for (int i = 0; i < idx->n && scalar; i++) {
            scalar = idx->u.nodes[i] && ag_node_val(idx->u.nodes[i], 0)->ndim == 0;
            idx_tiled |= scalar && tiled(idx->u.nodes[i], ph, nph, m, nin, 0);
        }
        if (!scalar)
            continue;
        ag_node *e[9];
        ag_graph_insert_before(c, n);
        if (!idx_tiled) { /* one element: the tile's values summed */
            ag_node *sv = ag_graph_call(c, sum, (ag_garg[]){AG_GA_N(val), AG_GA_NIL}, 2, NULL);
            int rc = sv ? ag_node_set_arg(n, 2, AG_GA_N(sv)) : ag_last_status();
            if (rc)
                return rc;
            continue;
        }
        for (int i = 0; i <= idx->n; i++) {
            ag_node *x = i < idx->n ? idx->u.nodes[i] : val;
            ag_garg a[2] = {AG_GA_N(x), AG_GA_INTS(tile, 2)};
            if (!(e[i] = ag_graph_call(c, ex, a, 2, NULL)))
                return ag_last_status();
        }
        const int ni = idx->n;
        int rc = ag_node_set_arg(n, 1, AG_GA_NODES(e, ni));
        if (!rc)
            rc = ag_node_set_arg(n, 2, AG_GA_N(e[ni]));
        if (rc)
            return rc;
    }
    ag_graph_insert_at_end(c);
    return 0;
}

ag_graph *ag__flex_tile_graph(const ag_graph *g, const ag_tmeta *m, int nin, int64_t bq,
                              int64_t bk) {
    ag_graph *c = ag_graph_copy(g);
    if (!c)
        return NULL;
    int rc = expand_scatters(c, bq, bk, m, nin), i = 0;
    for (ag_node *n = ag_graph_first(c); n && !rc; n = ag_node_next(n))
        if (ag_node_kind_of(n) == AG_NODE_PLACEHOLDER)
            rc = i < nin ? ag_node_set_val(n, 0, &m[i++])
                         : ag__err(AG_EINVAL,
                                   "flex_attention: the graph function takes more than the %d "
                                   "inputs given",
                                   nin);
    if (!rc && i != nin)
        rc = ag__err(AG_EINVAL, "flex_attention: the graph function takes %d inputs, %d given", i,
                     nin);
    if (!rc)
        rc = ag_graph_reinfer_meta(c);
    if (!rc && ag_graph_dce(c) < 0) /* a joint's forward part: its result is not an output */
        rc = ag_last_status();
    if (rc) {
        ag_graph_free(c);
        return NULL;
    }
    return c;
}

/* The copy of f's graph for inputs of metadata m (nin), made on first use. */
static const ag_graph *tile_fn_graph(tile_fn *f, const ag_tmeta *m, int nin) {
    for (int i = 0; i < TILE_SHAPES && f->c[i].g; i++) {
        bool same = true;
        for (int k = 0; k < nin && same; k++)
            same = ag__tmeta_equal(&f->c[i].in[k], &m[k]);
        if (same)
            return f->c[i].g;
    }
    ag_graph *g = f->tile && nin >= 5 && m[3].ndim == 2 && m[4].ndim == 2
                      ? ag__flex_tile_graph(f->g, m, nin, m[3].sizes[0], m[4].sizes[1])
                      : copy_for(f->g, m, nin);
    ag_tmeta *in = g ? ag__malloc(sizeof *in * (size_t)nin) : NULL;
    if (!in) {
        ag_graph_free(g);
        return NULL;
    }
    memcpy(in, m, sizeof *in * (size_t)nin);
    tile_copy *c = &f->c[f->next];
    f->next = (f->next + 1) % TILE_SHAPES;
    tile_copy_free(c);
    c->g = g;
    c->in = in;
    return g;
}

/* Runs g (or, f non-NULL, f's copy of its graph for these inputs' shapes) on tile-shaped
 * inputs. The result (output 0) belongs to the open scope, or is a new reference when none is
 * open. */
static ag_tensor *run_graph(const ag_graph *g, tile_fn *f, ag_tensor *const *lead, int nlead,
                            ag_tensor *const *bufs, int nbuf) {
    ag_tensor *in[TILE_MAX_IN];
    if (nbuf < 0 || nlead + nbuf > TILE_MAX_IN || (nbuf > 0 && !bufs)) {
        ag__err(AG_EINVAL,
                "flex_attention: bad buffer list for a graph function (%d buffers, at "
                "most 64)",
                nbuf);
        return NULL;
    }
    for (int i = 0; i < nlead; i++)
        in[i] = lead[i];
    for (int i = 0; i < nbuf; i++)
        in[nlead + i] = bufs[i];
    const int nin = nlead + nbuf;
    ag_tmeta m[TILE_MAX_IN];
    for (int i = 0; i < nin; i++) {
        if (!in[i]) {
            ag__err(AG_EINVAL, "flex_attention: input %d of the graph function is NULL", i);
            return NULL;
        }
        ag__tmeta_of(in[i], &m[i]);
    }
    ag_graph *own = NULL;
    const ag_graph *run = f ? tile_fn_graph(f, m, nin) : (own = copy_for(g, m, nin));
    ag_tensor *out[AG_MAX_OUTPUTS] = {0};
    const bool scoped = ag__in_scope();
    int n = run ? ag_graph_run(run, in, nin, out, AG_MAX_OUTPUTS) : ag_last_status();
    ag_graph_free(own);
    if (n < 0)
        return NULL;
    if (!scoped)
        for (int k = 1; k < n; k++)
            ag_tensor_free(out[k]);
    if (n < 1 || !out[0]) {
        if (!scoped && n >= 1)
            ag_tensor_free(out[0]);
        ag__err(AG_EINVAL, "flex_attention: the graph function returned %s",
                n < 1 ? "nothing" : "None");
        return NULL;
    }
    return out[0];
}

/* score_mod / mask_mod over a call's tile_fn (its ud). */
static ag_tensor *score_cached(void *ud, ag_tensor *score, ag_tensor *b, ag_tensor *h,
                               ag_tensor *q_idx, ag_tensor *kv_idx, ag_tensor *const *buffers,
                               int nbuffers) {
    ag_tensor *lead[5] = {score, b, h, q_idx, kv_idx};
    return run_graph(NULL, ud, lead, 5, buffers, nbuffers);
}

static ag_tensor *mask_cached(void *ud, ag_tensor *b, ag_tensor *h, ag_tensor *q_idx,
                              ag_tensor *kv_idx, ag_tensor *const *buffers, int nbuffers) {
    ag_tensor *lead[4] = {b, h, q_idx, kv_idx};
    return run_graph(NULL, ud, lead, 4, buffers, nbuffers);
}

ag_tensor *ag_score_mod_graph(void *graph, ag_tensor *score, ag_tensor *b, ag_tensor *h,
                              ag_tensor *q_idx, ag_tensor *kv_idx, ag_tensor *const *buffers,
                              int nbuffers) {
    AG__CHECK_NULL_RET("score_mod_graph", graph, NULL);
    ag_tensor *lead[5] = {score, b, h, q_idx, kv_idx};
    return run_graph(graph, NULL, lead, 5, buffers, nbuffers);
}

ag_tensor *ag_mask_mod_graph(void *graph, ag_tensor *b, ag_tensor *h, ag_tensor *q_idx,
                             ag_tensor *kv_idx, ag_tensor *const *buffers, int nbuffers) {
    AG__CHECK_NULL_RET("mask_mod_graph", graph, NULL);
    ag_tensor *lead[4] = {b, h, q_idx, kv_idx};
    return run_graph(graph, NULL, lead, 4, buffers, nbuffers);
}

/* ---- running the ops (the interpreter) ----
 * flex_attention runs ag_flex_attention with the score graph as its score_mod and a block mask
 * over the node's tensors with the mask graph as its mask_mod; flex_attention_backward runs the
 * joint graph per tile (above), or, when that cannot run on the tiles, the same backward as the
 * eager node's (score_mod's gradient per tile through autograd on the forward graph). */

/* The value of node x (NULL: None) read by call n; *rc gets the failure's status. */
static ag_tensor *value_of(const ag_node *n, const ag_node *x, ag__flex_value_fn val, void *ud,
                           int *rc) {
    ag_tensor *t = x && !*rc ? val(ud, n, x) : NULL;
    if (x && !t && !*rc)
        *rc = ag_last_status() < 0 ? ag_last_status() : AG_EINVAL;
    return t;
}

/* ---- flex_attention_backward through the joint graph ----
 * Upstream's flex_attention_backward runs joint_graph over the scores: per tile, the score
 * graph gives the modified scores, and the joint graph (score, b, h, q_idx, kv_idx,
 * grad_score, buffers -> grad_score, None x 4, the buffers' gradients) turns the modified
 * scores' gradient into the raw scores', its buffer gradients summed over the tile. Here the
 * kernel on raw memory (ag__flex_run_raw) calls these functions, which run the graphs' tile
 * copies through the interpreter (the planned executor runs plans of them instead). */

typedef struct joint_bwd {
    ag_dtype dt;
    tile_fn sf, mf, jf;
    ag_tensor *const *sb, *const *mb;
    int nsb, nmb;
    ag_tensor **bgrad; /* the buffers' gradients, zeroed */
} joint_bwd;

/* The tile's leading inputs (the score from S when S is not NULL, then b, h, q_idx, kv_idx)
 * into lead, the open scope's; their count or a negative status. */
static int tile_lead(ag_dtype dt, const void *S, int64_t b, int64_t h, int64_t q0, int64_t bq,
                     int64_t k0, int64_t bk, ag_tensor **lead) {
    const int64_t tile[2] = {bq, bk}, col[2] = {bq, 1}, row[2] = {1, bk};
    int n = 0;
    if (S)
        lead[n++] = ag_from_data(dt, 2, tile, S);
    lead[n++] = ag_scalar_tensor(AG_I64, (double)b);
    lead[n++] = ag_scalar_tensor(AG_I64, (double)h);
    ag_tensor *qi = ag_arange(AG_I64, (double)q0, (double)(q0 + bq), 1);
    ag_tensor *ki = ag_arange(AG_I64, (double)k0, (double)(k0 + bk), 1);
    lead[n++] = qi ? ag_view(qi, 2, col) : NULL;
    lead[n++] = ki ? ag_view(ki, 2, row) : NULL;
    for (int i = 0; i < n; i++)
        if (!lead[i])
            return ag_last_status() < 0 ? ag_last_status() : AG_ENOMEM;
    return n;
}

/* dst <- r broadcast to the tile (r: a graph's result, checked). */
static int store(ag_tensor *r, ag_dtype dt, int64_t bq, int64_t bk, void *dst, int64_t ld) {
    ag_tmeta m;
    ag__tmeta_of(r, &m);
    if (!ag__flex_fits_tile(&m, bq, bk) ||
        (dt == AG_BOOL ? m.dtype != AG_BOOL : !ag_dtype_is_float(m.dtype)))
        return ag__err(AG_EINVAL, "flex_attention: the graph function's result does not fit the "
                                  "tile");
    ag_tensor *c = ag_contiguous(r);
    if (!c)
        return ag_last_status();
    ag__flex_store_tile(c, dt, bq, bk, dst, ld);
    return 0;
}

static int jb_score(void *ud, int tid, int64_t b, int64_t h, int64_t q0, int64_t bq, int64_t k0,
                    int64_t bk, void *S) {
    joint_bwd *j = ud;
    (void)tid; /* serial */
    ag_scope_begin();
    ag_tensor *lead[5];
    int rc = tile_lead(j->dt, S, b, h, q0, bq, k0, bk, lead);
    ag_tensor *r = rc < 0 ? NULL : run_graph(NULL, &j->sf, lead, 5, j->sb, j->nsb);
    rc = r ? store(r, j->dt, bq, bk, S, bk) : ag_last_status();
    ag_scope_end();
    return rc;
}

static int jb_mask(void *ud, int tid, int64_t b, int64_t h, int64_t q0, int64_t bq, int64_t k0,
                   int64_t bk, uint8_t *dst, int64_t ld) {
    joint_bwd *j = ud;
    (void)tid; /* serial */
    ag_scope_begin();
    ag_tensor *lead[4];
    int rc = tile_lead(j->dt, NULL, b, h, q0, bq, k0, bk, lead);
    ag_tensor *r = rc < 0 ? NULL : run_graph(NULL, &j->mf, lead, 4, j->mb, j->nmb);
    rc = r ? store(r, AG_BOOL, bq, bk, dst, ld) : ag_last_status();
    ag_scope_end();
    return rc;
}

static int jb_joint(void *ud, int tid, int64_t b, int64_t h, int64_t q0, int64_t bq, int64_t k0,
                    int64_t bk, const void *S0, void *dS) {
    joint_bwd *j = ud;
    (void)tid; /* serial */
    ag_scope_begin();
    ag_tensor *in[TILE_MAX_IN], *out[AG_MAX_OUTPUTS] = {0};
    ag_tmeta m[TILE_MAX_IN];
    const int64_t tile[2] = {bq, bk};
    int rc = tile_lead(j->dt, S0, b, h, q0, bq, k0, bk, in);
    const int nin = 6 + j->nsb;
    if (rc >= 0 && !(in[5] = ag_from_data(j->dt, 2, tile, dS)))
        rc = ag_last_status() < 0 ? ag_last_status() : AG_ENOMEM;
    for (int i = 0; i < j->nsb; i++)
        in[6 + i] = j->sb[i];
    for (int i = 0; i < nin && rc >= 0; i++)
        ag__tmeta_of(in[i], &m[i]);
    const ag_graph *g = rc < 0 ? NULL : tile_fn_graph(&j->jf, m, nin);
    int n = g ? ag_graph_run(g, in, nin, out, AG_MAX_OUTPUTS) : ag_last_status();
    rc = n < 0             ? n
         : n != 5 + j->nsb ? ag__err(AG_EINVAL,
                                     "flex_attention_backward: the joint "
                                     "graph returned %d outputs, expected %d",
                                     n, 5 + j->nsb)
                           : 0;
    if (!rc && out[0])
        rc = store(out[0], j->dt, bq, bk, dS, bk);
    else if (!rc)
        memset(dS, 0, (size_t)(bq * bk) * ag_dtype_size(j->dt)); /* the score was ignored */
    for (int i = 0; i < j->nsb && !rc; i++) {
        ag_tensor *gr = out[5 + i];
        if (!gr)
            continue;
        ag_tmeta gm, bm;
        ag__tmeta_of(gr, &gm);
        ag__tmeta_of(j->bgrad[i], &bm);
        ag_tensor *c = ag__flex_reduces_to(&gm, &bm) ? ag_contiguous(gr) : NULL;
        if (!c)
            rc = ag_last_status() < 0
                     ? ag_last_status()
                     : ag__err(AG_EINVAL,
                               "flex_attention_backward: the joint graph's gradient of "
                               "buffer %d does not sum to the buffer's shape",
                               i);
        else
            ag__flex_add_reduced(j->bgrad[i], c);
    }
    ag_scope_end(); /* the tile's tensors and the graph's results */
    return rc;
}

/* Whether the joint graph has a tile copy for every tile shape of the call (else the backward
 * differentiates the score graph instead): 1 or 0; AG_ENOMEM when out of memory. */
static int joint_fits(joint_bwd *j, const ag__flex_call *c) {
    const int64_t L = ag_tensor_size(c->q, 2), S = ag_tensor_size(c->k, 2);
    const int64_t QB = c->sizes[2], KB = c->sizes[3];
    const int64_t bqs[2] = {L >= QB ? QB : 0, L % QB}, bks[2] = {S >= KB ? KB : 0, S % KB};
    ag_tmeta m[TILE_MAX_IN];
    if (6 + c->nsb > TILE_MAX_IN)
        return 0;
    for (int i = 0; i < c->nsb; i++)
        ag__tmeta_of(c->sb[i], &m[6 + i]);
    for (int a = 0; a < 2; a++)
        for (int b = 0; b < 2; b++) {
            if (!bqs[a] || !bks[b])
                continue;
            const int64_t tile[2] = {bqs[a], bks[b]}, col[2] = {bqs[a], 1}, row[2] = {1, bks[b]};
            ag__tmeta_contiguous(&m[0], j->dt, 2, tile);
            ag__tmeta_contiguous(&m[1], AG_I64, 0, NULL);
            ag__tmeta_contiguous(&m[2], AG_I64, 0, NULL);
            ag__tmeta_contiguous(&m[3], AG_I64, 2, col);
            ag__tmeta_contiguous(&m[4], AG_I64, 2, row);
            ag__tmeta_contiguous(&m[5], j->dt, 2, tile);
            uint64_t errs = ag__err_count();
            if (!tile_fn_graph(&j->jf, m, 6 + c->nsb)) {
                if (ag__err_count() == errs || ag_last_status() == AG_ENOMEM)
                    return AG_ENOMEM;
                ag_clear_error();
                return 0;
            }
        }
    return 1;
}

/* The backward through the joint graph: 1 (and outs, the open scope's) when it ran, 0 when the
 * joint graph does not run on the call's tiles, or a negative status. */
static int joint_backward(const ag__flex_call *c, ag_tensor **outs) {
    joint_bwd j = {.dt = ag_tensor_dtype(c->q),
                   .sf = {.g = c->score},
                   .mf = {.g = c->mask},
                   .jf = {.g = c->joint, .tile = true},
                   .sb = c->sb,
                   .mb = c->mb,
                   .nsb = c->nsb,
                   .nmb = c->nmb};
    const int fits = j.dt == AG_F32 || j.dt == AG_F64 ? joint_fits(&j, c) : 0;
    if (fits <= 0) {
        tile_fn_free(&j.jf);
        return fits;
    }
    ag_scope_begin();
    bool prev = ag_set_grad_enabled(false);
    ag_tensor *t[7] = {c->q, c->k, c->v, c->out, c->lse, c->go, c->gl}, *ct[7] = {0};
    int rc = 0;
    for (int i = 0; i < 7 && !rc; i++)
        if (t[i] && !(ct[i] = ag_contiguous(t[i])))
            rc = ag_last_status() < 0 ? ag_last_status() : AG_ENOMEM;
    if (!rc && !ct[5] && !(ct[5] = ag_zeros_like(c->out)))
        rc = ag_last_status() < 0 ? ag_last_status() : AG_ENOMEM;
    ag_tensor *res[AG_MAX_OUTPUTS] = {0};
    for (int i = 0; i < 3 && !rc; i++)
        if (!(res[i] = ag_empty(j.dt, 4, ag_tensor_sizes(ct[i]))))
            rc = ag_last_status() < 0 ? ag_last_status() : AG_ENOMEM;
    for (int i = 0; i < c->nsb && !rc; i++)
        if (!(res[3 + i] = ag_zeros_like(c->sb[i])))
            rc = ag_last_status() < 0 ? ag_last_status() : AG_ENOMEM;
    j.bgrad = res + 3;
    ag__flex_tile_fns fns = {&j, 1, jb_score, c->mask ? jb_mask : NULL, jb_joint};
    if (!rc) {
        ag__flex_raw r = ag__flex_raw_of(true, c->scale, ct[0], ct[1], ct[2]);
        r.out = ag_tensor_data(ct[3]);
        r.lse = ag_tensor_data(ct[4]);
        r.dout = ag_tensor_data(ct[5]);
        r.dlse = ct[6] ? ag_tensor_data(ct[6]) : NULL;
        r.dq = ag_tensor_data(res[0]);
        r.dk = ag_tensor_data(res[1]);
        r.dv = ag_tensor_data(res[2]);
        r.parts = c->parts;
        r.sizes = c->sizes;
        r.fns = &fns;
        rc = ag__flex_run_raw(&r);
    }
    const int n = 3 + c->nsb;
    for (int i = 0; i < n && !rc; i++)
        if (!ag_tensor_keep(res[i]))
            rc = AG_ENOMEM;
    ag_set_grad_enabled(prev);
    ag_scope_end();
    tile_fn_free(&j.sf);
    tile_fn_free(&j.mf);
    tile_fn_free(&j.jf);
    if (rc)
        return rc;
    for (int i = 0; i < n; i++)
        outs[i] = ag__give(res[i]);
    return 1;
}

int ag__flex_call_run(const ag__flex_call *c, ag_tensor **outs) {
    if (c->bwd && c->joint) {
        if (!c->out || !c->lse)
            return ag__err(AG_EINVAL, "flex_attention_backward: no out/logsumexp");
        int rc = joint_backward(c, outs);
        if (rc)
            return rc < 0 ? rc : 3 + c->nsb;
    }
    tile_fn sf = {.g = c->score}, mf = {.g = c->mask};
    ag_mask_mod mm = {mask_cached, &mf, c->mb, c->nmb};
    ag_block_mask *bm = ag__block_mask_from_parts(c->parts, c->sizes, c->mask ? &mm : NULL);
    if (!bm)
        return ag_last_status() < 0 ? ag_last_status() : AG_ENOMEM;
    ag_score_mod sm = {score_cached, &sf, c->sb, c->nsb};
    int rc;
    if (!c->bwd) {
        ag_flex_opts o = {.scale = c->scale};
        rc = ag_flex_attention(c->q, c->k, c->v, &sm, bm, &o, &outs[0], &outs[1]);
    } else {
        rc = c->out && c->lse ? 0 : ag__err(AG_EINVAL, "flex_attention_backward: no out/logsumexp");
        if (!rc)
            rc = ag__flex_attention_backward(c->q, c->k, c->v, c->out, c->lse, c->go, c->gl, &sm,
                                             bm, c->scale, outs);
    }
    ag_block_mask_free(bm);
    tile_fn_free(&sf);
    tile_fn_free(&mf);
    if (!c->bwd)
        return rc ? rc : 2;
    for (int i = 0; i < c->nsb && !rc; i++)
        if (!outs[3 + i] && !(outs[3 + i] = ag_zeros_like(c->sb[i])))
            rc = ag_last_status();
    return rc ? rc : 3 + c->nsb;
}

int ag__flex_run(const ag_node *n, ag__flex_value_fn val, void *ud, ag_tensor **outs) {
    ag__flex_args fa;
    int rc = ag__flex_args_read(n->op, n->args, n->nargs, &fa);
    if (rc)
        return rc;
    ag__flex_call c = {.bwd = fa.bwd};
    ag_tensor *parts[8], *sb[64], *mb[64];
    c.q = value_of(n, fa.q, val, ud, &rc), c.k = value_of(n, fa.k, val, ud, &rc);
    c.v = value_of(n, fa.v, val, ud, &rc);
    for (int p = 0; p < 8; p++)
        parts[p] = value_of(n, fa.parts[p], val, ud, &rc);
    for (int i = 0; i < fa.nsb; i++)
        sb[i] = value_of(n, fa.sb[i].u.node, val, ud, &rc);
    for (int i = 0; i < fa.nmb; i++)
        mb[i] = value_of(n, fa.mb[i].u.node, val, ud, &rc);
    if (fa.bwd) {
        c.out = value_of(n, fa.out, val, ud, &rc), c.lse = value_of(n, fa.lse, val, ud, &rc);
        c.go = value_of(n, fa.go, val, ud, &rc), c.gl = value_of(n, fa.gl, val, ud, &rc);
        c.joint = fa.joint->sub;
    }
    if (rc)
        return rc;
    c.score = fa.score->sub;
    c.mask = fa.mask ? fa.mask->sub : NULL;
    c.parts = parts, c.sizes = fa.sizes, c.scale = fa.scale;
    c.sb = sb, c.nsb = fa.nsb, c.mb = mb, c.nmb = fa.nmb;
    return ag__flex_call_run(&c, outs);
}
