/* flex_attention's user functions as graphs (include/aotgrad/trace.h, "flex_attention's
 * functions as graphs"): upstream's sdpa_score0 / fw_graph0, joint_graph0 and sdpa_mask0 /
 * mask_graph0 subgraphs, and the callbacks that run such a graph as a score_mod or mask_mod.
 *
 * In: an ag_score_mod or ag_mask_mod (C functions over tensors) and the dtype of the scores.
 * Out: graphs traced on 0-d stand-ins (score, b, h, q_idx, kv_idx as upstream's make_fx traces
 * them), each buffer a placeholder after those, so the graph is a pure function of its
 * placeholders. Fresh stand-ins are traced, never the buffers themselves, so tracing here
 * inside an outer trace leaves the outer trace's bindings alone. The joint graph is
 * score_mod's forward followed by its backward, recorded by running ag_grad under the trace. */
#include "../autograd/flex_internal.h"
#include "../graph/graph_internal.h"

#include <stdio.h>

enum { MOD_SCORE, MOD_JOINT, MOD_MASK };

typedef struct mod_trace {
    int kind;
    const ag_score_mod *sm;
    const ag_mask_mod *mm;
    int nbuf;
} mod_trace;

/* 0 when the function returned a tensor; else its status, or a message when it set none (no
 * error recorded since errs). */
static int returned(ag_tensor *r, uint64_t errs, const char *what) {
    if (r)
        return 0;
    if (ag__err_count() != errs && ag_last_status() < 0)
        return ag_last_status();
    return ag__err(AG_EINVAL, "trace_%s: the function returned NULL and set no error", what);
}

static int traced_fn(void *ud, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)nin;
    mod_trace *m = ud;
    if (m->kind == MOD_MASK) {
        uint64_t errs = ag__err_count();
        ag_tensor *r = m->mm->fn(m->mm->ud, in[0], in[1], in[2], in[3], in + 4, m->nbuf);
        int rc = returned(r, errs, "mask_mod");
        if (rc)
            return rc;
        out[0] = r;
        return 1;
    }
    const int nb = m->kind == MOD_JOINT ? 6 : 5; /* the buffers' placeholders follow */
    uint64_t errs = ag__err_count();
    ag_tensor *r = m->sm->fn(m->sm->ud, in[0], in[1], in[2], in[3], in[4], in + nb, m->nbuf);
    int rc = returned(r, errs, m->kind == MOD_JOINT ? "score_mod_joint" : "score_mod");
    if (rc)
        return rc;
    if (m->kind == MOD_SCORE) {
        out[0] = r;
        return 1;
    }
    /* joint: (grad of score, None for b, h, q_idx, kv_idx, grad of each buffer) */
    if (5 + m->nbuf > max_out)
        return ag__err(AG_EINVAL, "trace_score_mod_joint: %d buffers (at most %d)", m->nbuf,
                       max_out - 5);
    ag_tensor *want[65], *res[65];
    int slot[65], nw = 0;
    want[nw] = in[0];
    slot[nw++] = 0;
    for (int i = 0; i < m->nbuf; i++)
        if (ag_tensor_requires_grad(in[nb + i])) {
            want[nw] = in[nb + i];
            slot[nw++] = 5 + i;
        }
    for (int k = 0; k < 5 + m->nbuf; k++)
        out[k] = NULL;
    if (ag_tensor_requires_grad(r)) {
        rc = ag_grad(&r, &in[5], 1, want, nw, res, false, true);
        if (rc)
            return rc;
        for (int k = 0; k < nw; k++)
            out[slot[k]] = res[k];
    }
    return 5 + m->nbuf;
}

/* Traces the function described by m: placeholders arg0_1, arg1_1, ... The stand-ins are
 * data-less tensors made outside the dispatcher, so an outer trace records nothing for them. */
static ag_graph *trace_mod(mod_trace *m, ag_dtype dt, ag_tensor *const *bufs, const char *what) {
    const int nlead = m->kind == MOD_MASK ? 4 : m->kind == MOD_JOINT ? 6 : 5;
    if (m->nbuf < 0 || m->nbuf > 64 || (m->nbuf > 0 && !bufs)) {
        ag__err(AG_EINVAL, "%s: bad buffer list (%d buffers, at most 64)", what, m->nbuf);
        return NULL;
    }
    for (int i = 0; i < m->nbuf; i++)
        if (!bufs[i]) {
            ag__err(AG_EINVAL, "%s: buffer %d is NULL", what, i);
            return NULL;
        }
    if (m->kind != MOD_MASK && dt != AG_F32 && dt != AG_F64) {
        ag__err(AG_EINVAL, "%s: the scores' dtype must be float32 or float64, got %s", what,
                ag_dtype_name(dt));
        return NULL;
    }
    ag_tensor *in[70] = {0};
    char names[70][16];
    const char *np[70];
    const int n = nlead + m->nbuf;
    ag_graph *g = NULL;
    ag_scope_begin();
    bool prev = ag_set_grad_enabled(m->kind == MOD_JOINT);
    int rc = 0;
    for (int i = 0; i < n && !rc; i++) {
        snprintf(names[i], sizeof names[i], "arg%d_1", i);
        np[i] = names[i];
        if (i < nlead) {
            const bool is_score =
                m->kind != MOD_MASK && (i == 0 || (m->kind == MOD_JOINT && i == 5));
            in[i] = ag__tensor_new(is_score ? dt : AG_I64, 0, NULL, true);
        } else {
            const ag_tensor *b = bufs[i - nlead];
            in[i] = ag__tensor_new(ag_tensor_dtype(b), ag_tensor_ndim(b), ag_tensor_sizes(b), true);
        }
        if (!in[i])
            rc = ag_last_status() < 0 ? ag_last_status() : AG_ENOMEM;
        else if (m->kind == MOD_JOINT &&
                 (i == 0 || (i >= nlead && ag_dtype_is_float(ag_tensor_dtype(in[i])))))
            rc = ag_tensor_set_requires_grad(in[i], true);
    }
    if (!rc)
        g = ag_trace(traced_fn, m, in, n, np, NULL, &(ag_trace_opts){.no_stack_traces = true});
    ag_set_grad_enabled(prev);
    ag_scope_end();
    for (int i = 0; i < n; i++)
        ag_tensor_free(in[i]);
    return g;
}

ag_graph *ag_trace_score_mod(const ag_score_mod *score_mod, ag_dtype dt) {
    AG__CHECK_NULL_RET("trace_score_mod", score_mod, NULL);
    AG__CHECK_NULL_RET("trace_score_mod", score_mod->fn, NULL);
    mod_trace m = {MOD_SCORE, score_mod, NULL, score_mod->nbuffers};
    return trace_mod(&m, dt, score_mod->buffers, "trace_score_mod");
}

ag_graph *ag_trace_score_mod_joint(const ag_score_mod *score_mod, ag_dtype dt) {
    AG__CHECK_NULL_RET("trace_score_mod_joint", score_mod, NULL);
    AG__CHECK_NULL_RET("trace_score_mod_joint", score_mod->fn, NULL);
    mod_trace m = {MOD_JOINT, score_mod, NULL, score_mod->nbuffers};
    return trace_mod(&m, dt, score_mod->buffers, "trace_score_mod_joint");
}

ag_graph *ag_trace_mask_mod(const ag_mask_mod *mask_mod) {
    AG__CHECK_NULL_RET("trace_mask_mod", mask_mod, NULL);
    AG__CHECK_NULL_RET("trace_mask_mod", mask_mod->fn, NULL);
    mod_trace m = {MOD_MASK, NULL, mask_mod, mask_mod->nbuffers};
    return trace_mod(&m, AG_BOOL, mask_mod->buffers, "trace_mask_mod");
}

/* ---- ag_flex_attention under a trace: the higher-order op nodes ----
 * The forward records get_attr sdpa_scoreN (and sdpa_maskN), the block mask's tensors as
 * constants, and flex_attention(...) read through two getitems; its outputs lead to a custom
 * autograd node whose backward, run by the joint export's backward trace, records get_attr
 * fw_graphN, joint_graphN (and mask_graphN) and flex_attention_backward(...) read through a
 * getitem per gradient. Every node takes the session's metadata (annotations, seq_nr: the
 * forward nodes the custom node's, so the backward's nodes match them as upstream's do). */

typedef struct flex_rec {
    ag_score_mod sm; /* fn NULL: the identity */
    ag_tensor **sbufs;
    int nsbuf;
    ag_block_mask *bm; /* a reference */
    double scale;
    ag_dtype dt;
    bool return_lse; /* the caller asked for logsumexp: kernel_options' OUTPUT_LOGSUMEXP */
    /* the forward's nodes of q, k, v, out and logsumexp (the node must not keep its own
     * outputs: they hold the node) */
    ag_node *nq, *nk, *nv, *nout, *nlse;
    char score_name[32], mask_name[32];
} flex_rec;

static void rec_free(void *p) {
    flex_rec *r = p;
    if (!r)
        return;
    for (int i = 0; i < r->nsbuf; i++)
        ag_tensor_free(r->sbufs[i]);
    ag__free(r->sbufs);
    ag_block_mask_free(r->bm);
    ag__free(r);
}

static ag_tensor *identity_mod(void *ud, ag_tensor *score, ag_tensor *b, ag_tensor *h,
                               ag_tensor *qi, ag_tensor *ki, ag_tensor *const *bufs, int nbuf) {
    (void)ud, (void)b, (void)h, (void)qi, (void)ki, (void)bufs, (void)nbuf;
    return score;
}

/* Adds sub to g as <prefix>N (the first free N) and returns its get_attr node with the
 * session's metadata; frees sub on failure. */
static ag_node *add_sub(ag__tracer *T, ag_graph *g, const char *prefix, ag_graph *sub,
                        char *name_out) {
    if (!sub)
        return NULL;
    char name[32];
    for (int i = 0;; i++) {
        snprintf(name, sizeof name, "%s%d", prefix, i);
        if (!ag_graph_subgraph(g, name) && !ag_graph_find(g, name))
            break;
    }
    if (ag_graph_add_subgraph(g, name, sub)) {
        ag_graph_free(sub);
        return NULL;
    }
    if (name_out)
        snprintf(name_out, 32, "%s", name);
    ag_node *n = ag_graph_get_attr_subgraph(g, name, NULL);
    if (n && ag__tracer_node_meta(T, n))
        return NULL;
    return n;
}

/* The block mask's argument list (8 tensors, the mask graph's get_attr or None) and sizes. */
/* The block mask as upstream's BlockMask.as_tuple() into bm[13]: (Q_LEN, KV_LEN, its 8
 * tensors' nodes (None for a part it lacks), Q_BLOCK_SIZE, KV_BLOCK_SIZE, the mask graph's
 * get_attr or None). */
static int mask_tuple(ag__tracer *T, const flex_rec *r, ag_node *mask_attr, ag_garg *bm) {
    int64_t shp[6]; /* B, H, Q_LEN, KV_LEN, Q_BLOCK_SIZE, KV_BLOCK_SIZE */
    ag_block_mask_shape(r->bm, shp);
    bm[0] = AG_GA_I(shp[2]);
    bm[1] = AG_GA_I(shp[3]);
    for (int p = 0; p < 8; p++) {
        ag_tensor *t = ag_block_mask_tensor(r->bm, (ag_block_mask_part)p);
        ag_node *x = t ? ag__tracer_node_of(T, t) : NULL;
        if (t && !x)
            return ag_last_status();
        bm[2 + p] = x ? AG_GA_N(x) : AG_GA_NIL;
    }
    bm[10] = AG_GA_I(shp[4]);
    bm[11] = AG_GA_I(shp[5]);
    bm[12] = mask_attr ? AG_GA_N(mask_attr) : AG_GA_NIL;
    return 0;
}

/* The nodes of n tensors (a call's buffers) as tuple elements into out. */
static int buffer_tuple(ag__tracer *T, ag_tensor *const *ts, int n, ag_garg *out) {
    if (n > 64)
        return ag__err(AG_EINVAL, "flex_attention: %d buffers (at most 64)", n);
    for (int i = 0; i < n; i++) {
        ag_node *x = ag__tracer_node_of(T, ts[i]);
        if (!x)
            return ag_last_status() < 0 ? ag_last_status() : AG_ENOMEM;
        out[i] = AG_GA_N(x);
    }
    return 0;
}

/* Records call `op` with args and binds a meta tensor to each output (through getitem). */
static int record_call(ag__tracer *T, ag_graph *g, const ag_op *op, const ag_garg *ga, int nargs,
                       ag_tensor **outs, int max_out) {
    ag_tmeta vals[AG_MAX_OUTPUTS];
    int nv = 0;
    int rc = ag__infer_meta(op, ga, nargs, vals, &nv);
    if (rc)
        return rc;
    if (nv > max_out)
        return ag__err(AG_EINVAL, "%s: %d outputs", ag_op_name(op), nv);
    ag_node *n = ag__graph_call_vals(g, op, ga, nargs, vals, nv, NULL);
    if (!n || ag__tracer_node_meta(T, n))
        return ag_last_status();
    for (int k = 0; k < nv; k++) {
        ag_node *gi = ag_graph_getitem(g, n, k, NULL);
        if (!gi || ag__tracer_node_meta(T, gi))
            return ag_last_status();
        ag_tensor *t = ag__tensor_new(vals[k].dtype, vals[k].ndim, vals[k].sizes, true);
        if (!t)
            return AG_ENOMEM;
        ag__tracer_bind(T, t, gi);
        outs[k] = t;
    }
    return nv;
}

static int traced_backward(void *ud, ag_tensor *const *gout, int nout, ag_tensor **gin, int nin,
                           const bool *needs) {
    flex_rec *r = ud;
    ag__tracer *T = ag__tracer_active();
    if (!T)
        return ag__err(AG_EINVAL, "flex_attention: the traced node's backward ran outside a trace");
    ag_graph *g = ag__tracer_graph(T);
    ag_score_mod id = {identity_mod, NULL, NULL, 0};
    const ag_score_mod *sm = r->sm.fn ? &r->sm : &id;
    ag_graph *fw = ag_graph_copy(ag_graph_subgraph(g, r->score_name));
    ag_node *fw_attr = add_sub(T, g, "fw_graph", fw, NULL);
    if (!fw_attr)
        return ag_last_status() < 0 ? ag_last_status() : AG_ENOMEM;
    ag_node *joint_attr = add_sub(T, g, "joint_graph", ag_trace_score_mod_joint(sm, r->dt), NULL);
    if (!joint_attr)
        return ag_last_status() < 0 ? ag_last_status() : AG_ENOMEM;
    ag_node *mask_attr = NULL;
    if (r->mask_name[0]) {
        ag_graph *mg = ag_graph_copy(ag_graph_subgraph(g, r->mask_name));
        if (!(mask_attr = add_sub(T, g, "mask_graph", mg, NULL)))
            return ag_last_status() < 0 ? ag_last_status() : AG_ENOMEM;
    }
    ag_tensor *dout = gout[0]; /* NULL: None (no gradient reached the output) */
    ag_garg bm[13], sb[64], mb[64];
    int rc = mask_tuple(T, r, mask_attr, bm);
    ag_mask_mod mm;
    ag__block_mask_mod(r->bm, &mm);
    if (!rc)
        rc = buffer_tuple(T, r->sbufs, r->nsbuf, sb);
    if (!rc)
        rc = buffer_tuple(T, mm.buffers, mm.nbuffers, mb);
    ag_node *nq = r->nq, *nk = r->nk, *nv = r->nv, *no = r->nout, *nl = r->nlse;
    ag_node *ngo = rc || !dout ? NULL : ag__tracer_node_of(T, dout);
    ag_node *ngl = nout > 1 && gout[1] ? ag__tracer_node_of(T, gout[1]) : NULL;
    if (!rc && (!nq || !nk || !nv || !no || !nl || (dout && !ngo) || (nout > 1 && gout[1] && !ngl)))
        rc = ag_last_status() < 0 ? ag_last_status() : AG_ENOMEM;
    if (rc)
        return rc;
    ag_garg ga[14] = {AG_GA_N(nq),
                      AG_GA_N(nk),
                      AG_GA_N(nv),
                      AG_GA_N(no),
                      AG_GA_N(nl),
                      ngo ? AG_GA_N(ngo) : AG_GA_NIL,
                      ngl ? AG_GA_N(ngl) : AG_GA_NIL,
                      AG_GA_N(fw_attr),
                      AG_GA_N(joint_attr),
                      AG_GA_TUPLE(bm, 13),
                      AG_GA_F(r->scale),
                      ag__flex_kernel_options(r->return_lse),
                      AG_GA_TUPLE(sb, r->nsbuf),
                      AG_GA_TUPLE(mb, mm.nbuffers)};
    const ag_op *op = ag__op_flex_attention(true);
    ag_tensor *grads[AG_MAX_OUTPUTS] = {0};
    int n = op ? record_call(T, g, op, ga, 14, grads, AG_MAX_OUTPUTS) : AG_ENOMEM;
    if (n < 0)
        return n;
    for (int j = 0; j < n; j++) {
        if (j < nin && needs[j])
            gin[j] = ag__give(grads[j]);
        else
            ag_tensor_free(grads[j]);
    }
    return 0;
}

int ag__flex_traced(ag_tensor *q, ag_tensor *k, ag_tensor *v, const ag_score_mod *score_mod,
                    const ag_block_mask *block_mask, double scale, ag_tensor **out,
                    ag_tensor **lse) {
    ag__tracer *T = ag__tracer_active();
    if (!T)
        return ag__err(AG_EINVAL, "flex_attention: no active trace");
    ag_graph *g = ag__tracer_graph(T);
    const int nsbuf = score_mod ? score_mod->nbuffers : 0;
    for (int i = 0; i < nsbuf; i++)
        if (!ag_dtype_is_float(ag_tensor_dtype(score_mod->buffers[i])))
            return ag__err(AG_EINVAL,
                           "flex_attention: under tracing, score_mod's buffers must be float "
                           "tensors (buffer %d is %s)",
                           i, ag_dtype_name(ag_tensor_dtype(score_mod->buffers[i])));
    flex_rec *r = ag__calloc(1, sizeof *r);
    if (!r || (nsbuf && !(r->sbufs = ag__calloc((size_t)nsbuf, sizeof *r->sbufs)))) {
        ag__free(r);
        return AG_ENOMEM;
    }
    r->dt = ag_tensor_dtype(q);
    r->scale = scale;
    r->return_lse = lse != NULL;
    if (score_mod)
        r->sm = *score_mod;
    for (int i = 0; i < nsbuf; i++, r->nsbuf++)
        r->sbufs[i] = ag_tensor_keep(score_mod->buffers[i]);
    r->sm.buffers = r->sbufs;
    int rc = 0;
    if (block_mask) {
        r->bm = ag__block_mask_retain(block_mask);
    } else { /* upstream's default: every block full, 128 x 128 */
        r->bm = ag_create_block_mask(NULL, 1, 1, ag_tensor_size(q, 2), ag_tensor_size(k, 2), 0, 0);
        if (!r->bm)
            rc = ag_last_status() < 0 ? ag_last_status() : AG_ENOMEM;
    }
    ag_score_mod id = {identity_mod, NULL, NULL, 0};
    ag_node *score_attr = NULL, *mask_attr = NULL;
    ag_mask_mod mm = {0};
    if (!rc) {
        score_attr = add_sub(T, g, "sdpa_score", ag_trace_score_mod(r->sm.fn ? &r->sm : &id, r->dt),
                             r->score_name);
        ag__block_mask_mod(r->bm, &mm);
        if (score_attr && mm.fn)
            mask_attr = add_sub(T, g, "sdpa_mask", ag_trace_mask_mod(&mm), r->mask_name);
        if (!score_attr || (mm.fn && !mask_attr))
            rc = ag_last_status() < 0 ? ag_last_status() : AG_ENOMEM;
    }
    /* the outputs, then the autograd node (its seq_nr goes on the forward's nodes) */
    int64_t osz[4] = {ag_tensor_size(q, 0), ag_tensor_size(q, 1), ag_tensor_size(q, 2),
                      ag_tensor_size(v, 3)};
    ag_garg bm[13], sb[64], mb[64];
    if (!rc)
        rc = mask_tuple(T, r, mask_attr, bm);
    if (!rc)
        rc = buffer_tuple(T, r->sbufs, r->nsbuf, sb);
    if (!rc)
        rc = buffer_tuple(T, mm.buffers, mm.nbuffers, mb);
    ag_node *nq = rc ? NULL : ag__tracer_node_of(T, q), *nk = rc ? NULL : ag__tracer_node_of(T, k);
    ag_node *nv = rc ? NULL : ag__tracer_node_of(T, v);
    if (!rc && (!nq || !nk || !nv))
        rc = ag_last_status();
    ag_tensor *res[2] = {NULL, NULL};
    (void)osz;
    if (!rc) {
        ag_garg ga[9] = {AG_GA_N(nq),
                         AG_GA_N(nk),
                         AG_GA_N(nv),
                         AG_GA_N(score_attr),
                         AG_GA_TUPLE(bm, 13),
                         AG_GA_F(scale),
                         ag__flex_kernel_options(lse != NULL),
                         AG_GA_TUPLE(sb, r->nsbuf),
                         AG_GA_TUPLE(mb, mm.nbuffers)};
        const ag_op *op = ag__op_flex_attention(false);
        /* The node's seq_nr: the autograd node made below takes the next number. */
        ag__tls_state *ts = ag__tls();
        const int64_t prev_seq = ts->trace_seq;
        bool grad = false;
        ag_tensor *ins[3 + 64] = {q, k, v};
        for (int i = 0; i < r->nsbuf; i++)
            ins[3 + i] = r->sbufs[i];
        for (int i = 0; i < 3 + r->nsbuf; i++)
            grad |= ag_is_grad_enabled() && ag_tensor_requires_grad(ins[i]);
        if (grad)
            ts->trace_seq = ag__autograd_current_seq() + 1;
        int n = op ? record_call(T, g, op, ga, 9, res, 2) : AG_ENOMEM;
        ts->trace_seq = prev_seq;
        rc = n < 0 ? n : 0;
        if (!rc) {
            r->nq = nq;
            r->nk = nk;
            r->nv = nv;
            r->nout = ag__tracer_node_of(T, res[0]);
            r->nlse = ag__tracer_node_of(T, res[1]);
            bool diff[2] = {true, true};
            rc = ag__autograd_custom("FlexAttentionBackward0", ins, 3 + r->nsbuf, res, lse ? 2 : 1,
                                     diff, traced_backward, r, rec_free);
            r = NULL;
        }
    }
    rec_free(r);
    return ag__flex_hand_out(rc, res, out, lse);
}
