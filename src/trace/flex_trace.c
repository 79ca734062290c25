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
#include "../core/internal.h"

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

/* Traces the function described by m: placeholders arg0_1, arg1_1, ... */
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
            in[i] = ag_empty(is_score ? dt : AG_I64, 0, NULL);
        } else {
            const ag_tensor *b = bufs[i - nlead];
            in[i] = ag_empty(ag_tensor_dtype(b), ag_tensor_ndim(b), ag_tensor_sizes(b));
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

/* ---- graphs as score_mod / mask_mod ---- */

/* Runs g on tile-shaped inputs, as upstream vmaps the 0-d function over the tile: a copy of g
 * whose placeholders take the inputs' metadata, its calls' vals inferred again. The result
 * (output 0) belongs to the open scope, or is a new reference when none is open. */
static ag_tensor *run_graph(const ag_graph *g, ag_tensor *const *lead, int nlead,
                            ag_tensor *const *bufs, int nbuf) {
    ag_tensor *in[70];
    if (nbuf < 0 || nlead + nbuf > 70 || (nbuf > 0 && !bufs)) {
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
    ag_graph *c = ag_graph_copy(g);
    if (!c)
        return NULL;
    int rc = 0, i = 0;
    for (ag_node *n = ag_graph_first(c); n && !rc; n = ag_node_next(n))
        if (ag_node_kind_of(n) == AG_NODE_PLACEHOLDER) {
            if (i >= nlead + nbuf || !in[i]) {
                rc = ag__err(AG_EINVAL,
                             "flex_attention: the graph function takes more than the "
                             "%d inputs given, or input %d is NULL",
                             nlead + nbuf, i);
                break;
            }
            ag_tmeta m;
            ag__tmeta_of(in[i++], &m);
            rc = ag_node_set_val(n, 0, &m);
        }
    if (!rc)
        rc = ag_graph_reinfer_meta(c);
    ag_tensor *out[AG_MAX_OUTPUTS] = {0};
    const bool scoped = ag__in_scope();
    int n = rc ? rc : ag_graph_run(c, in, nlead + nbuf, out, AG_MAX_OUTPUTS);
    ag_graph_free(c);
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

ag_tensor *ag_score_mod_graph(void *graph, ag_tensor *score, ag_tensor *b, ag_tensor *h,
                              ag_tensor *q_idx, ag_tensor *kv_idx, ag_tensor *const *buffers,
                              int nbuffers) {
    AG__CHECK_NULL_RET("score_mod_graph", graph, NULL);
    ag_tensor *lead[5] = {score, b, h, q_idx, kv_idx};
    return run_graph(graph, lead, 5, buffers, nbuffers);
}

ag_tensor *ag_mask_mod_graph(void *graph, ag_tensor *b, ag_tensor *h, ag_tensor *q_idx,
                             ag_tensor *kv_idx, ag_tensor *const *buffers, int nbuffers) {
    AG__CHECK_NULL_RET("mask_mod_graph", graph, NULL);
    ag_tensor *lead[4] = {b, h, q_idx, kv_idx};
    return run_graph(graph, lead, 4, buffers, nbuffers);
}
