/* Activation checkpointing: torch.utils.checkpoint.checkpoint with use_reentrant=False.
 *
 * In: a function over tensors (ag_checkpoint_fn) and its inputs. Out: its outputs, whose
 * backward recomputes the function instead of reading activations kept from the forward.
 *
 * Eager, grad mode on: the function runs with grad mode off, so no op records a node and
 * nothing is saved; meanwhile the dispatcher hands every tensor argument that requires grad to
 * a collector (ag__tls()->ckpt_capture, called from ag__autograd_wanted): those tensors (the
 * inputs and parameters the region reads, from outside it, since nothing made inside requires
 * grad) are the inputs of one custom autograd node whose outputs are the function's. The
 * generator's (seed, offset) is kept. The node's backward sets the generator to it, reruns the
 * function with grad mode on while the collected tensors pose as leaves (their grad_fn
 * detached for the rerun, so the inner ag_grad stops at them and never runs the outer graph),
 * backpropagates the incoming gradients through the rerun with ag_grad, and puts the
 * generator and the tensors' histories back.
 *
 * Under tracing the function is traced as usual; ag__tls()->ckpt_region marks the region, and
 * the tracer (src/trace/trace.c) tags the forward nodes it records then with
 * recompute=MUST_RECOMPUTE and the region's ac_graph_id, upstream's checkpoint tags, which
 * the partitioner (src/partition/) honours. */
#include "../core/internal.h"

typedef struct ckpt {
    ag_checkpoint_fn fn;
    void *ud;
    int nin;
    ag_tensor **inputs; /* kept: the rerun's inputs */
    int next, cap_ext;
    ag_tensor **ext; /* kept: the tensors requiring grad that the region read */
    int nout;
    ag_tmeta *out_meta; /* the forward's outputs, checked against the rerun's */
    uint64_t seed, offset;
    int capture_rc;
} ckpt;

static void ckpt_free(void *p) {
    ckpt *c = p;
    if (!c)
        return;
    for (int i = 0; i < c->nin; i++)
        ag_tensor_free(c->inputs[i]);
    for (int i = 0; i < c->next; i++)
        ag_tensor_free(c->ext[i]);
    ag__free(c->inputs);
    ag__free(c->ext);
    ag__free(c->out_meta);
    ag__free(c);
}

static int capture(void *ud, ag_tensor *t) {
    ckpt *c = ud;
    for (int i = 0; i < c->next; i++)
        if (c->ext[i] == t)
            return 0;
    if (c->next == c->cap_ext) {
        int cap = c->cap_ext ? 2 * c->cap_ext : 16;
        ag_tensor **e = ag__malloc((size_t)cap * sizeof *e);
        if (!e) {
            c->capture_rc = AG_ENOMEM;
            return AG_ENOMEM;
        }
        if (c->next)
            memcpy(e, c->ext, (size_t)c->next * sizeof *e);
        ag__free(c->ext);
        c->ext = e;
        c->cap_ext = cap;
    }
    c->ext[c->next++] = ag_tensor_keep(t);
    return 0;
}

static void free_outs(ag_tensor **outs, int n) {
    for (int i = 0; i < n; i++) {
        ag_tensor_free(outs[i]);
        outs[i] = NULL;
    }
}

/* Runs fn and checks its side of the contract. Returns the output count or a status (outs
 * cleared). */
static int run_fn(ag_checkpoint_fn fn, void *ud, ag_tensor *const *in, int nin, ag_tensor **outs,
                  int max_out) {
    for (int i = 0; i < max_out; i++)
        outs[i] = NULL;
    uint64_t errs = ag__err_count();
    int n = fn(ud, in, nin, outs, max_out);
    if (n < 0) {
        for (int i = 0; i < max_out; i++)
            outs[i] = NULL; /* the contract: a failed fn stored nothing it kept */
        if (ag__err_count() == errs)
            ag__err(n, "checkpoint: fn failed with status %d and set no message", n);
        return n;
    }
    if (n > max_out) {
        return ag__err(AG_EINVAL, "checkpoint: fn returned %d outputs, room for %d", n, max_out);
    }
    for (int i = 0; i < n; i++)
        if (!outs[i]) {
            free_outs(outs, n);
            return ag__err(AG_EINVAL, "checkpoint: fn returned NULL output %d", i);
        }
    return n;
}

/* The node's backward: rerun with grad mode on from the forward's generator state, then
 * ag_grad through the rerun to the collected tensors. */
static int ckpt_backward(void *ud, ag_tensor *const *gout, int nout, ag_tensor **gin, int nin,
                         const bool *needs) {
    ckpt *c = ud;
    enum { MAXO = 64 };
    ag_tensor *outs[MAXO];
    uint64_t seed0, off0;
    ag_rng_get_state(&seed0, &off0);
    ag_rng_set_state(c->seed, c->offset);
    /* The collected tensors pose as leaves during the rerun. */
    struct ag_anode **fns = ag__malloc((size_t)(c->next ? c->next : 1) * sizeof *fns);
    int *nrs = ag__malloc((size_t)(c->next ? c->next : 1) * sizeof *nrs);
    if (!fns || !nrs) {
        ag__free(fns);
        ag__free(nrs);
        ag_rng_set_state(seed0, off0);
        return AG_ENOMEM;
    }
    for (int j = 0; j < c->next; j++) {
        fns[j] = c->ext[j]->grad_fn;
        nrs[j] = c->ext[j]->output_nr;
        c->ext[j]->grad_fn = NULL;
    }
    bool prev = ag_set_grad_enabled(true);
    int n = run_fn(c->fn, c->ud, c->inputs, c->nin, outs, c->nout < MAXO ? c->nout : MAXO);
    ag_set_grad_enabled(prev);
    ag_rng_set_state(seed0, off0);
    int rc = n < 0 ? n : 0;
    if (rc == 0 && n != c->nout)
        rc = ag__err(AG_EINVAL, "checkpoint: the recomputation returned %d outputs, the forward %d",
                     n, c->nout);
    for (int k = 0; k < n && rc == 0; k++) {
        ag_tmeta m;
        ag__tmeta_of(outs[k], &m);
        if (m.dtype != c->out_meta[k].dtype || m.ndim != c->out_meta[k].ndim ||
            memcmp(m.sizes, c->out_meta[k].sizes, sizeof(int64_t) * (size_t)m.ndim)) {
            char a[128], b[128];
            rc = ag__err(AG_EINVAL,
                         "checkpoint: recomputed output %d is %s %s, the forward's was %s %s "
                         "(fn must compute the same thing again)",
                         k, ag_dtype_name(m.dtype), ag__fmt_sizes(a, sizeof a, m.ndim, m.sizes),
                         ag_dtype_name(c->out_meta[k].dtype),
                         ag__fmt_sizes(b, sizeof b, c->out_meta[k].ndim, c->out_meta[k].sizes));
        }
    }
    /* Roots: the rerun's outputs that have a gradient and a history. */
    ag_tensor *roots[MAXO], *rgrads[MAXO];
    int nr = 0;
    for (int k = 0; k < n && k < nout && rc == 0; k++)
        if (gout[k] && outs[k]->requires_grad) {
            roots[nr] = outs[k];
            rgrads[nr++] = gout[k];
        }
    ag_tensor **want = ag__malloc((size_t)(nin ? nin : 1) * sizeof *want);
    ag_tensor **res = ag__malloc((size_t)(nin ? nin : 1) * sizeof *res);
    int *slot = ag__malloc((size_t)(nin ? nin : 1) * sizeof *slot);
    if (rc == 0 && (!want || !res || !slot))
        rc = AG_ENOMEM;
    int nw = 0;
    for (int j = 0; j < nin && rc == 0; j++)
        if (needs[j]) {
            slot[nw] = j;
            want[nw++] = c->ext[j];
        }
    if (rc == 0 && nr > 0 && nw > 0) {
        rc = ag_grad(roots, rgrads, nr, want, nw, res, false, true);
        for (int k = 0; k < nw && rc == 0; k++)
            gin[slot[k]] = res[k]; /* in the backward's scope */
    }
    for (int j = 0; j < c->next; j++) {
        c->ext[j]->grad_fn = fns[j];
        c->ext[j]->output_nr = nrs[j];
    }
    if (n > 0)
        free_outs(outs, n);
    ag__free(fns);
    ag__free(nrs);
    ag__free(want);
    ag__free(res);
    ag__free(slot);
    return rc;
}

/* Under tracing: fn traced in place, its nodes tagged by the tracer. */
static int traced(ag_checkpoint_fn fn, void *ud, ag_tensor *const *inputs, int nin,
                  ag_tensor **outs, int max_out) {
    ag__tls_state *ts = ag__tls();
    int64_t prev = ts->ckpt_region;
    if (!prev)
        ts->ckpt_region = ++ts->ckpt_serial;
    int n = run_fn(fn, ud, inputs, nin, outs, max_out);
    ts->ckpt_region = prev;
    return n;
}

int ag_checkpoint(ag_checkpoint_fn fn, void *ud, ag_tensor *const *inputs, int nin,
                  ag_tensor **outs, int max_out) {
    AG__CHECK_NULL("checkpoint", outs);
    for (int i = 0; i < max_out; i++)
        outs[i] = NULL;
    AG__CHECK_NULL("checkpoint", fn);
    if (max_out < 1)
        return ag__err(AG_EINVAL, "checkpoint: no room for outputs (max_out %d)", max_out);
    if (nin < 0 || (nin > 0 && !inputs))
        return ag__err(AG_EINVAL, "checkpoint: bad input list (%d inputs)", nin);
    for (int i = 0; i < nin; i++)
        if (!inputs[i]) {
            if (ag__has_error() && ag_last_status() < 0)
                return ag_last_status();
            return ag__err(AG_EINVAL, "checkpoint: input %d is NULL", i);
        }
    ag__tls_state *ts = ag__tls();
    if (ts->tracing)
        return traced(fn, ud, inputs, nin, outs, max_out);
    if (!ag_is_grad_enabled())
        return run_fn(fn, ud, inputs, nin, outs, max_out);

    ckpt *c = ag__calloc(1, sizeof *c);
    if (!c || !(c->inputs = ag__calloc((size_t)(nin ? nin : 1), sizeof *c->inputs))) {
        ag__free(c);
        return AG_ENOMEM;
    }
    c->fn = fn;
    c->ud = ud;
    c->nin = nin;
    for (int i = 0; i < nin; i++)
        c->inputs[i] = ag_tensor_keep(inputs[i]);
    ag_rng_get_state(&c->seed, &c->offset);
    /* The inputs that require grad lead the node's edges, read or not (as upstream's). */
    for (int i = 0; i < nin; i++)
        if (ag_tensor_requires_grad(inputs[i]) && ag_dtype_is_float(ag_tensor_dtype(inputs[i])))
            capture(c, inputs[i]);

    int (*prev_cap)(void *, ag_tensor *) = ts->ckpt_capture;
    void *prev_ud = ts->ckpt_capture_ud;
    ts->ckpt_capture = capture;
    ts->ckpt_capture_ud = c;
    bool prev = ag_set_grad_enabled(false);
    int n = run_fn(fn, ud, inputs, nin, outs, max_out);
    ag_set_grad_enabled(prev);
    ts->ckpt_capture = prev_cap;
    ts->ckpt_capture_ud = prev_ud;
    /* A region inside another region's no-grad forward: the outer node must lead to what this
     * one read too. */
    for (int j = 0; j < c->next && prev_cap; j++)
        prev_cap(prev_ud, c->ext[j]);
    int rc = n < 0 ? n : c->capture_rc;
    if (rc == 0 && !(c->out_meta = ag__calloc((size_t)(n ? n : 1), sizeof *c->out_meta)))
        rc = AG_ENOMEM;
    /* An output that is one of the region's own inputs (or a tensor it read) gets a history of
     * its own: a new alias, as a view made under the checkpoint would be. */
    for (int k = 0; k < n && rc == 0; k++) {
        bool outer = false;
        for (int i = 0; i < nin; i++)
            outer |= outs[k] == inputs[i];
        for (int j = 0; j < c->next; j++)
            outer |= outs[k] == c->ext[j];
        if (outer) {
            ag_tmeta m;
            ag__tmeta_of(outs[k], &m);
            ag_tensor *a = ag__tensor_alias(outs[k], &m);
            if (!a) {
                rc = AG_ENOMEM;
                break;
            }
            a->is_view = true;
            ag_tensor_free(outs[k]);
            outs[k] = a;
        }
        ag__tmeta_of(outs[k], &c->out_meta[k]);
    }
    if (rc) {
        if (n > 0)
            free_outs(outs, n);
        ckpt_free(c);
        return rc;
    }
    c->nout = n;
    if (n > 64) {
        free_outs(outs, n);
        ckpt_free(c);
        return ag__err(AG_EINVAL, "checkpoint: at most 64 outputs (fn returned %d)", n);
    }
    /* The node owns c from here (freed at once when nothing requires grad). */
    rc = ag__autograd_custom("CheckpointFunctionBackward", c->ext, c->next, outs, n, NULL,
                             ckpt_backward, c, ckpt_free);
    if (rc) {
        free_outs(outs, n);
        return rc;
    }
    return n;
}
