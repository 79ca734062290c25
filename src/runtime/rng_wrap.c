/* The functionalized-RNG runtime wrapper (upstream's FunctionalizedRngRuntimeWrapper; spec 8).
 *
 * In: a partitioned graph whose random draws read philox seed and offset placeholders (the
 * export's RNG functionalization, src/export/rng_functionalize.c). Out: around each run of it, the
 * calling thread's generator's state goes in as those two inputs, and the generator's offset is
 * moved to the updated offset the graph returns, exactly as far as eager's draws would have
 * moved it. The forward feeds the state at the time of the forward, the backward at the time
 * of the backward, as eager's draws happen then. So a compiled model trains bit-identically to
 * eager from the same seed.
 *
 * The positions come from descriptors, not from counting: whatever else the graphs take and
 * return, the wrapper feeds the placeholders described PhiloxForwardSeedAOTInput and
 * PhiloxForwardBaseOffsetAOTInput (backward: PhiloxBackward...) and reads the output described
 * PhiloxUpdatedForwardOffsetAOTOutput (PhiloxUpdatedBackwardOffsetAOTOutput). */
#include "rng_wrap.h"

int ag__rng_wrap_init(ag__rng_wrap *w, const ag_graph *g, bool backward) {
    w->seed_in = w->offset_in = w->offset_out = -1;
    w->seed_t = w->offset_t = NULL;
    if (!g)
        return 0;
    const ag_desc_kind seed_k =
        backward ? AG_DESC_PHILOX_BACKWARD_SEED : AG_DESC_PHILOX_FORWARD_SEED;
    const ag_desc_kind off_k =
        backward ? AG_DESC_PHILOX_BACKWARD_BASE_OFFSET : AG_DESC_PHILOX_FORWARD_BASE_OFFSET;
    const ag_desc_kind out_k =
        backward ? AG_DESC_PHILOX_UPDATED_BACKWARD_OFFSET : AG_DESC_PHILOX_UPDATED_FORWARD_OFFSET;
    ag_node **ph;
    int nph = ag_graph_placeholders(g, &ph);
    if (nph < 0)
        return nph;
    for (int i = 0; i < nph; i++) {
        const ag_desc *d = ag_node_desc(ph[i]);
        if (d && ag_desc_kind_of(d) == seed_k)
            w->seed_in = i;
        else if (d && ag_desc_kind_of(d) == off_k)
            w->offset_in = i;
    }
    ag_node *out = ag_graph_output_node(g);
    int nout = out ? ag_node_arg(out, 0)->n : 0;
    for (int i = 0; i < nout; i++) {
        const ag_desc *d = ag_node_output_desc(out, i);
        if (d && ag_desc_kind_of(d) == out_k)
            w->offset_out = i;
    }
    const char *side = backward ? "backward" : "forward";
    if ((w->seed_in < 0) != (w->offset_in < 0) || (w->seed_in < 0) != (w->offset_out < 0))
        return ag__err(AG_EINVAL,
                       "compile: the %s graph has %s philox seed, %s base offset and "
                       "%s updated offset; RNG functionalization needs all three or "
                       "none",
                       side, w->seed_in < 0 ? "no" : "a", w->offset_in < 0 ? "no" : "a",
                       w->offset_out < 0 ? "no" : "an");
    return 0;
}

int ag__rng_wrap_num_inputs(const ag__rng_wrap *w) {
    return w->seed_in < 0 ? 0 : 2;
}

/* *slot holding v: refilled in place when the wrapper's tensor is free, else a new one. */
static int fill_scalar(ag_tensor **slot, int64_t v) {
    ag_tensor *t = *slot;
    if (!t || t->refcount != 1 || t->storage->refcount != 1) {
        ag_tensor_free(t);
        *slot = t = ag__tensor_new(AG_I64, 0, NULL, false);
        if (!t)
            return ag_last_status();
    }
    *(int64_t *)ag__base(t) = v;
    t->storage->version++;
    return 0;
}

int ag__rng_wrap_feed(ag__rng_wrap *w, ag_tensor **in) {
    if (w->seed_in < 0)
        return 0;
    uint64_t seed, offset;
    ag_rng_get_state(&seed, &offset);
    /* The bits as they are: the graph's int64 arithmetic wraps as the generator's does. */
    int rc = fill_scalar(&w->seed_t, (int64_t)seed);
    if (rc == 0)
        rc = fill_scalar(&w->offset_t, (int64_t)offset);
    in[w->seed_in] = w->seed_t;
    in[w->offset_in] = w->offset_t;
    return rc;
}

void ag__rng_wrap_clear(ag__rng_wrap *w) {
    ag_tensor_free(w->seed_t);
    ag_tensor_free(w->offset_t);
    w->seed_t = w->offset_t = NULL;
}

int ag__rng_wrap_advance(const ag__rng_wrap *w, ag_tensor *const *outs, int nouts) {
    if (w->offset_out < 0)
        return 0;
    const ag_tensor *t = w->offset_out < nouts ? outs[w->offset_out] : NULL;
    if (!t || t->dtype != AG_I64 || t->ndim != 0)
        return ag__err(AG_EINVAL,
                       "compiled: the updated philox offset (output %d) is not a 0-dim "
                       "int64 tensor",
                       w->offset_out);
    uint64_t seed, offset;
    ag_rng_get_state(&seed, &offset);
    ag_rng_set_state(seed, (uint64_t) * (const int64_t *)ag__base(t));
    return 0;
}

/* ---- the wrapper (compiled_internal.h) ---- */

#include "compiled_internal.h"

typedef struct rng_state {
    ag__rng_wrap fw, bw;
} rng_state;

/* Where each graph takes the generator's state and returns its offset, as positions in what
 * the callable passes and gets: effect tokens (first in the forward; before the philox inputs
 * and after the updated offset in the backward) are the token wrapper's, inside this one. A
 * callable whose graphs draw nothing keeps no state. */
static int rng_init(ag_compiled *c) {
    rng_state *r = ag__calloc(1, sizeof *r);
    if (!r)
        return AG_ENOMEM;
    int rc = ag__rng_wrap_init(&r->fw, c->fw, false);
    if (rc == 0) /* (no backward graph: nothing to feed) */
        rc = ag__rng_wrap_init(&r->bw, c->bw, true);
    if (rc || (r->fw.seed_in < 0 && r->bw.seed_in < 0 && r->fw.offset_out < 0)) {
        ag__free(r);
        return rc;
    }
    if (r->fw.seed_in >= 0) {
        r->fw.seed_in -= c->ntok_fw;
        r->fw.offset_in -= c->ntok_fw;
    }
    if (r->fw.offset_out >= 0)
        r->fw.offset_out -= c->ntok_fw;
    if (r->bw.seed_in >= 0) {
        r->bw.seed_in -= c->ntok_bw;
        r->bw.offset_in -= c->ntok_bw;
    }
    c->rng = r;
    return 0;
}

static int rng_pre(ag_compiled *c, ag__call *s) {
    rng_state *r = c->rng;
    return r ? ag__rng_wrap_feed(&r->fw, s->prim) : 0;
}
static int rng_commit(ag_compiled *c, ag__call *s) {
    rng_state *r = c->rng;
    return r ? ag__rng_wrap_advance(&r->fw, s->fo, s->nrun) : 0;
}
/* Draws in the backward start where the generator is then, as eager's would. */
static int rng_bw_pre(ag_compiled *c, ag_tensor **bin) {
    rng_state *r = c->rng;
    return r ? ag__rng_wrap_feed(&r->bw, bin) : 0;
}
static int rng_bw_post(ag_compiled *c, ag_tensor *const *grads, int n) {
    rng_state *r = c->rng;
    return r ? ag__rng_wrap_advance(&r->bw, grads, n) : 0;
}
static void rng_clear(ag_compiled *c) {
    rng_state *r = c->rng;
    if (r) {
        ag__rng_wrap_clear(&r->fw);
        ag__rng_wrap_clear(&r->bw);
    }
    ag__free(r);
    c->rng = NULL;
}

const ag__rt_wrapper ag__rtw_rng = {
    .name = "functionalized_rng",
    .init = rng_init,
    .pre = rng_pre,
    .commit = rng_commit,
    .bw_pre = rng_bw_pre,
    .bw_post = rng_bw_post,
    .clear = rng_clear,
};
