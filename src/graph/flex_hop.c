/* The higher-order ops flex_attention and flex_attention_backward as graph nodes (upstream's
 * torch.ops.higher_order.flex_attention / flex_attention_backward), made by the tracer
 * (src/trace/flex_trace.c) when ag_flex_attention runs under a trace:
 *
 *   flex_attention(Tensor query, Tensor key, Tensor value, Tensor score_mod,
 *                  Tensor?[] block_mask, int[] block_mask_sizes, float scale,
 *                  Tensor[] score_mod_other_buffers, Tensor[] mask_mod_other_buffers)
 *       -> (Tensor out, Tensor logsumexp)
 *   flex_attention_backward(Tensor query, Tensor key, Tensor value, Tensor out,
 *                  Tensor logsumexp, Tensor? grad_out, Tensor? grad_logsumexp, Tensor fw_graph,
 *                  Tensor joint_graph, Tensor?[] block_mask, int[] block_mask_sizes,
 *                  float scale, Tensor[] score_mod_other_buffers,
 *                  Tensor[] mask_mod_other_buffers)
 *       -> Tensor[] (grad_query, grad_key, grad_value, a gradient per score_mod buffer)
 *
 * score_mod, fw_graph and joint_graph are get_attrs of subgraphs (sdpa_score0, fw_graph0,
 * joint_graph0); block_mask is upstream's tuple without its ints: kv_num_blocks, kv_indices,
 * full_kv_num_blocks, full_kv_indices, q_num_blocks, q_indices, full_q_num_blocks,
 * full_q_indices, then the mask graph's get_attr (sdpa_mask0 / mask_graph0, None without a
 * mask_mod); block_mask_sizes is (KV_LEN, Q_LEN, Q_BLOCK_SIZE, KV_BLOCK_SIZE). Both ops are
 * flagged AG_OP_SUBGRAPH and kept out of the registry like invoke_subgraph; meta inference
 * (ag__subgraph_infer hands them here) checks the tensors and gives the outputs' metadata.
 * The interpreter runs them through ag__flex_run (below), the planned executor (plan.c)
 * through ag__flex_call_run on its bound tensors; neither has an op kernel (refused). */
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
              "Tensor?[] block_mask, int[] block_mask_sizes, float scale, "
              "Tensor[] score_mod_other_buffers, Tensor[] mask_mod_other_buffers) "
              "-> (Tensor, Tensor)",
    .flags = AG_OP_SUBGRAPH,
    .meta = refuse_meta,
    .kernel = refuse_kernel,
    .dtypes = AG_DT_FLOAT,
};

static const ag_opdef bwd_def = {
    .schema = "flex_attention_backward(Tensor query, Tensor key, Tensor value, Tensor out, "
              "Tensor logsumexp, Tensor? grad_out, Tensor? grad_logsumexp, Tensor fw_graph, "
              "Tensor joint_graph, Tensor?[] block_mask, int[] block_mask_sizes, float scale, "
              "Tensor[] score_mod_other_buffers, Tensor[] mask_mod_other_buffers) -> Tensor[]",
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

/* ---- meta inference ---- */

static const ag_tmeta *tensor_arg(const ag_garg *a) {
    return a->kind == AG_GA_NODE && a->u.node && a->u.node->nvals == 1 && !a->u.node->sub
               ? &a->u.node->vals[0]
               : NULL;
}

static bool is_subgraph_arg(const ag_garg *a) {
    return a->kind == AG_GA_NODE && a->u.node && a->u.node->sub;
}

int ag__flex_infer(const ag_op *op, const ag_garg *args, int nargs, ag_tmeta *vals, int *nvals) {
    const bool bwd = op == bwd_op;
    const char *opn = ag_op_name(op);
    if (nargs != (bwd ? 14 : 9))
        return ag__err(AG_EINVAL, "%s: %d arguments (takes %d)", opn, nargs, bwd ? 14 : 9);
    const ag_tmeta *q = tensor_arg(&args[0]), *k = tensor_arg(&args[1]), *v = tensor_arg(&args[2]);
    if (!q || !k || !v)
        return ag__err(AG_EINVAL, "%s: query, key and value must be tensors", opn);
    if (q->ndim != 4 || k->ndim != 4 || v->ndim != 4 || q->dtype != k->dtype ||
        q->dtype != v->dtype || !ag_dtype_is_float(q->dtype) || q->sizes[0] != k->sizes[0] ||
        q->sizes[3] != k->sizes[3] || k->sizes[0] != v->sizes[0] || k->sizes[1] != v->sizes[1] ||
        k->sizes[2] != v->sizes[2] || k->sizes[1] < 1 || q->sizes[1] % k->sizes[1])
        return ag__err(AG_EINVAL,
                       "%s: query [B, Hq, L, E], key [B, Hkv, S, E] and value [B, Hkv, S, Ev] "
                       "of one float dtype expected",
                       opn);
    const int isub = bwd ? 7 : 3, ibm = bwd ? 9 : 4, ibuf = bwd ? 12 : 7;
    if (!is_subgraph_arg(&args[isub]) || (bwd && !is_subgraph_arg(&args[8])))
        return ag__err(AG_EINVAL, "%s: argument %d must be a get_attr of a subgraph", opn,
                       !is_subgraph_arg(&args[isub]) ? isub : 8);
    if (args[ibm].kind != AG_GA_NODES || args[ibm].n != 9 || args[ibm + 1].kind != AG_GA_INTS ||
        args[ibm + 1].n != 4)
        return ag__err(AG_EINVAL,
                       "%s: block_mask must list 8 tensors and the mask graph, block_mask_sizes 4 "
                       "ints",
                       opn);
    const int64_t *bs = args[ibm + 1].u.ints;
    if (bs[0] != k->sizes[2] || bs[1] != q->sizes[2])
        return ag__err(AG_EINVAL, "%s: the block mask is for KV_LEN=%lld, Q_LEN=%lld", opn,
                       (long long)bs[0], (long long)bs[1]);
    if (args[ibuf].kind != AG_GA_NODES || args[ibuf + 1].kind != AG_GA_NODES)
        return ag__err(AG_EINVAL, "%s: the buffers must be tensor lists", opn);
    memset(vals, 0, sizeof(ag_tmeta) * AG_MAX_OUTPUTS);
    if (!bwd) {
        const int64_t o[4] = {q->sizes[0], q->sizes[1], q->sizes[2], v->sizes[3]};
        ag__tmeta_contiguous(&vals[0], q->dtype, 4, o);
        ag__tmeta_contiguous(&vals[1], q->dtype, 3, o);
        *nvals = 2;
        return 0;
    }
    const int nbuf = args[ibuf].n;
    if (3 + nbuf > AG_MAX_OUTPUTS)
        return ag__err(AG_EINVAL, "%s: %d buffers (at most %d)", opn, nbuf, AG_MAX_OUTPUTS - 3);
    const ag_tmeta *in[3] = {q, k, v};
    for (int i = 0; i < 3; i++)
        ag__tmeta_contiguous(&vals[i], in[i]->dtype, 4, in[i]->sizes);
    for (int i = 0; i < nbuf; i++) {
        const ag_node *b = args[ibuf].u.nodes[i];
        if (!b || b->nvals != 1)
            return ag__err(AG_EINVAL, "%s: score_mod buffer %d is not a tensor", opn, i);
        ag__tmeta_contiguous(&vals[3 + i], b->vals[0].dtype, b->vals[0].ndim, b->vals[0].sizes);
    }
    *nvals = 3 + nbuf;
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
    int next; /* the entry to replace when all are used */
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

/* index_put(self, indices, values, accumulate=True) of a 0-d function (values and every index
 * 0-d, one index per dimension of self: a scatter-add of one element, as a score_mod's joint
 * graph takes the gradient of buffer[h]) evaluated over a [bq, bk] tile must add every
 * element's value, as upstream's vmap over the tile does: its indices and values are
 * expanded to the tile, so that the op indexes one element per tile position and accumulates
 * them all. Other calls are left alone. */
static int expand_scatters(ag_graph *c, int64_t bq, int64_t bk) {
    const ag_op *ip = ag_op_find("index_put"), *ex = ag_op_find("expand");
    if (!ip || !ex)
        return 0;
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
        bool scalar = true;
        for (int i = 0; i < idx->n && scalar; i++)
            scalar = idx->u.nodes[i] && ag_node_val(idx->u.nodes[i], 0)->ndim == 0;
        if (!scalar)
            continue;
        ag_node *e[9];
        ag_graph_insert_before(c, n);
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
    int rc = expand_scatters(c, bq, bk), i = 0;
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
    ag_graph *g = copy_for(f->g, m, nin);
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
 * same backward as the eager node's (score_mod's gradient per tile through autograd on the
 * forward graph, fw_graph: the joint graph, a 0-d function, is not run on tiles). */

static ag_tensor *arg_tensor(const ag_node *n, int i, ag__flex_value_fn val, void *ud) {
    const ag_garg *a = &n->args[i];
    if (a->kind != AG_GA_NODE || !a->u.node)
        return NULL;
    return val(ud, n, a->u.node);
}

static int arg_list(const ag_node *n, int i, ag__flex_value_fn val, void *ud, ag_tensor **out,
                    const ag_graph **sub) {
    const ag_garg *a = &n->args[i];
    for (int k = 0; k < a->n; k++) {
        const ag_node *x = a->u.nodes[k];
        out[k] = NULL;
        if (x && x->sub && sub)
            *sub = x->sub;
        else if (x && !(out[k] = val(ud, n, x)))
            return ag_last_status();
    }
    return 0;
}

int ag__flex_call_run(const ag__flex_call *c, ag_tensor **outs) {
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
    const bool bwd = n->op == bwd_op;
    const int ibm = bwd ? 9 : 4, ibuf = bwd ? 12 : 7;
    ag__flex_call c = {.bwd = bwd};
    c.q = arg_tensor(n, 0, val, ud), c.k = arg_tensor(n, 1, val, ud);
    c.v = arg_tensor(n, 2, val, ud);
    if (!c.q || !c.k || !c.v)
        return ag_last_status() < 0 ? ag_last_status()
                                    : ag__err(AG_EINVAL, "run: %%%s: no query/key/value", n->name);
    c.score = n->args[bwd ? 7 : 3].u.node->sub;
    ag_tensor *parts[9], *sb[64], *mb[64];
    int rc = arg_list(n, ibm, val, ud, parts, &c.mask);
    if (!rc)
        rc = arg_list(n, ibuf, val, ud, sb, NULL);
    if (!rc)
        rc = arg_list(n, ibuf + 1, val, ud, mb, NULL);
    if (rc)
        return rc;
    c.parts = parts, c.sizes = n->args[ibm + 1].u.ints, c.scale = n->args[ibm + 2].u.f;
    c.sb = sb, c.nsb = n->args[ibuf].n, c.mb = mb, c.nmb = n->args[ibuf + 1].n;
    if (bwd) {
        c.out = arg_tensor(n, 3, val, ud), c.lse = arg_tensor(n, 4, val, ud);
        c.go = arg_tensor(n, 5, val, ud), c.gl = arg_tensor(n, 6, val, ud);
        if ((!c.out || !c.lse) && ag_last_status() < 0)
            return ag_last_status();
    }
    return ag__flex_call_run(&c, outs);
}
