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
 * They have no eager kernel yet: the interpreter and the executor refuse them. */
#include "graph_internal.h"

#include <pthread.h>

static int refuse_meta(const ag_arg *args, ag_tmeta *out) {
    (void)args, (void)out;
    return ag__err(AG_ENOTSUP, "flex_attention: a higher-order op of graphs; its calls are "
                               "inferred by the graph layer");
}

static int refuse_kernel(const ag_arg *args, ag_tensor **outs) {
    (void)args, (void)outs;
    return ag__err(AG_ENOTSUP, "flex_attention: running the higher-order op in a graph is not "
                               "supported yet (call ag_flex_attention eagerly)");
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
