/* RNG functionalization of the joint export (upstream's functionalize_rng_ops; spec 6.3 item 3).
 *
 * In: the calls of random ops (AG_OP_RANDOM) that the export's tracer sees while the model's
 * forward and the backward rules run. Out: in the joint graph, draws from explicit generator
 * state instead (philox_rand / philox_randn, src/ops/philox.c), the seed and base offset
 * placeholders of each side that draws, and the offset each side leaves the generator at.
 *
 * Each random op's call becomes its functional form (src/trace/rng_draws.c) drawing from the
 * side's seed at add(base_offset, k), k the numbers the side drew before this call. Eager draws
 * reserve the same n counters, so a compiled model fed the generator's (seed, offset) and
 * advanced to the returned offset draws exactly what eager draws. A nested compile region's call
 * whose body draws n numbers reserves them here too (reserve_hook): its subgraph takes the seed
 * and add(base_offset, k) as operands and draws from them (src/trace/region_trace.c). */
#include "../graph/graph_internal.h"
#include "export_wrappers.h"

#include <stdio.h>

typedef struct ag__rng_fn ag__rng_fn;

/* Installs RNG functionalization on tracer T, which traces into g. NULL when out of memory. */
static ag__rng_fn *ag__rng_begin(ag__tracer *T, ag_graph *g);
/* Draws from now on belong to the backward (upstream's mark_beginning_of_backward). */
static void ag__rng_mark_backward(ag__rng_fn *R);
/* When the forward (backward) side drew: traces its updated offset add(base_offset, total) and
 * stores the node and a new descriptor reference; returns 1. Returns 0 when the side drew
 * nothing, a negative status on failure. */
static int ag__rng_updated_offset(ag__rng_fn *R, bool backward, ag_node **node, ag_desc **desc);
/* Moves the philox placeholders behind every other placeholder, in the order fwd_seed,
 * fwd_base_offset, bwd_seed, bwd_base_offset, and stores their descriptors (new references)
 * in descs[0..4); returns how many there are. */
static int ag__rng_finish(ag__rng_fn *R, ag_desc **descs);
/* Frees the state (call it once the tracer has ended); NULL is a no-op. */
static void ag__rng_free(ag__rng_fn *R);

typedef struct rng_side {
    ag_node *seed_ph, *offset_ph; /* placeholders, made at the side's first draw */
    ag_tensor *seed, *base;       /* meta tensors bound to them */
    int64_t drawn;                /* numbers drawn so far */
} rng_side;

struct ag__rng_fn {
    ag__tracer *T;
    ag_graph *g;
    bool backward;
    rng_side side[2]; /* forward, backward */
};

/* The side's placeholders, made on its first draw. */
static int ensure_side(ag__rng_fn *R, int s) {
    rng_side *S = &R->side[s];
    if (S->seed_ph)
        return 0;
    static const char *const names[2][2] = {{"fwd_seed", "fwd_base_offset"},
                                            {"bwd_seed", "bwd_base_offset"}};
    ag_tmeta m;
    ag__tmeta_contiguous(&m, AG_I64, 0, NULL);
    for (int k = 0; k < 2; k++) {
        ag_desc *d =
            s == 0
                ? (k == 0 ? ag_desc_philox_forward_seed() : ag_desc_philox_forward_base_offset())
                : (k == 0 ? ag_desc_philox_backward_seed() : ag_desc_philox_backward_base_offset());
        ag_node *p = d ? ag_graph_placeholder(R->g, names[s][k], &m) : NULL;
        int rc = p ? ag_node_set_desc(p, d) : ag_last_status();
        ag_desc_release(d);
        if (rc == 0 && s == 1)
            rc = ag_node_set_partitioner_tag(p, "is_backward");
        ag_tensor *t = rc == 0 ? ag__tensor_new(AG_I64, 0, NULL, true) : NULL;
        if (!t) {
            /* Leave no half-made side behind. */
            if (p)
                ag_graph_erase(R->g, p);
            if (k == 1) {
                ag_graph_erase(R->g, S->seed_ph);
                ag_tensor_free(S->seed);
                S->seed_ph = NULL;
                S->seed = NULL;
            }
            return ag_last_status() ? ag_last_status() : AG_ENOMEM;
        }
        ag__tracer_bind(R->T, t, p);
        if (k == 0) {
            S->seed_ph = p;
            S->seed = t;
        } else {
            S->offset_ph = p;
            S->base = t;
        }
    }
    return 0;
}

static int random_hook(void *ud, const ag_op *op, const ag_arg *args, int nargs, ag_tensor **outs,
                       int nouts) {
    (void)nargs;
    (void)nouts;
    ag__rng_fn *R = ud;
    int d = ag__rng_call_draws(op, args);
    if (d <= 0)
        return d < 0 ? d : 1; /* 1: record the call as it is */
    rng_side *S = &R->side[R->backward];
    int rc = ensure_side(R, R->backward);
    return rc ? rc : ag__rng_record(R->T, S->seed, S->base, &S->drawn, op, args, outs);
}

/* A nested compile region's call (ag__trace_rng_reserve_fn): its body draws n numbers from the
 * current side's seed at add(base_offset, drawn before), which its subgraph takes as operands. */
static int reserve_hook(void *ud, int64_t n, ag_tensor **seed, ag_tensor **offset) {
    ag__rng_fn *R = ud;
    rng_side *S = &R->side[R->backward];
    int rc = ensure_side(R, R->backward);
    if (rc)
        return rc;
    bool prev = ag_set_grad_enabled(false);
    ag_scope_begin();
    ag_tensor *t = ag_add_scalar(S->base, (double)S->drawn);
    *offset = t && ag__tracer_node_of(R->T, t) ? ag_tensor_keep(t) : NULL;
    ag_scope_end();
    ag_set_grad_enabled(prev);
    if (!*offset)
        return ag_last_status() < 0 ? ag_last_status() : AG_ENOMEM;
    *seed = ag_tensor_keep(S->seed);
    S->drawn += n;
    return 0;
}

static ag__rng_fn *ag__rng_begin(ag__tracer *T, ag_graph *g) {
    ag__rng_fn *R = ag__calloc(1, sizeof *R);
    if (!R)
        return NULL;
    R->T = T;
    R->g = g;
    ag__tracer_set_random(T, random_hook, R);
    ag__tracer_set_rng_reserve(T, reserve_hook, R);
    return R;
}

static void ag__rng_mark_backward(ag__rng_fn *R) {
    R->backward = true;
}

static int ag__rng_updated_offset(ag__rng_fn *R, bool backward, ag_node **node, ag_desc **desc) {
    rng_side *S = &R->side[backward];
    *node = NULL;
    *desc = NULL;
    if (!S->seed_ph)
        return 0;
    bool prev = ag_set_grad_enabled(false);
    ag_scope_begin();
    ag_tensor *t = ag_add_scalar(S->base, (double)S->drawn);
    ag_node *n = t ? ag__tracer_node_of(R->T, t) : NULL;
    ag_scope_end();
    ag_set_grad_enabled(prev);
    ag_desc *d = n ? (backward ? ag_desc_philox_updated_backward_offset()
                               : ag_desc_philox_updated_forward_offset())
                   : NULL;
    if (!d)
        return ag_last_status() < 0 ? ag_last_status() : AG_ENOMEM;
    *node = n;
    *desc = d;
    return 1;
}

static int ag__rng_finish(ag__rng_fn *R, ag_desc **descs) {
    ag_node **ph;
    int nph = ag_graph_placeholders(R->g, &ph);
    if (nph < 0)
        return nph;
    ag_node *pos = nph ? ph[nph - 1] : NULL;
    int n = 0;
    for (int s = 0; s < 2; s++) {
        ag_node *mine[2] = {R->side[s].seed_ph, R->side[s].offset_ph};
        for (int k = 0; k < 2 && mine[k]; k++) {
            if (mine[k] != pos) {
                int rc = ag_graph_move_after(R->g, mine[k], pos);
                if (rc)
                    return rc;
            }
            pos = mine[k];
            descs[n++] = ag_desc_retain(ag_node_desc(mine[k]));
        }
    }
    return n;
}

static void ag__rng_free(ag__rng_fn *R) {
    if (!R)
        return;
    for (int s = 0; s < 2; s++) {
        ag_tensor_free(R->side[s].seed);
        ag_tensor_free(R->side[s].base);
    }
    ag__free(R);
}

/* ---- the export's wrapper (export_wrappers.h) ----
 * RNG functionalization (upstream's functionalize_rng_ops), unless keep_random_ops: the
 * forward's updated offset is the last forward output, the backward's the output after the
 * gradients, and the seeds and offsets the last placeholders. Its slot holds the state. */
static int rng_begin(ag__export_pass *st, void **self) {
    if (st->o->keep_random_ops)
        return 0;
    *self = ag__rng_begin(st->T, st->g);
    return *self ? 0 : AG_ENOMEM;
}

static int rng_outputs(ag__export_pass *st, void **self, ag_section sec) {
    bool backward = sec == AG_SEC_OUT_BW_RNG_OFFSET;
    if (!*self || (!backward && sec != AG_SEC_OUT_FW_RNG_OFFSET))
        return 0;
    ag_node *node;
    ag_desc *desc;
    int r = ag__rng_updated_offset(*self, backward, &node, &desc);
    if (r == 1 && (r = ag__export_out(st, sec, node, desc, NULL)) == 0)
        r = 1;
    if (r < 0)
        return r;
    if (!backward)
        st->rng_fw_out = r == 1;
    return 0;
}

static int rng_backward(ag__export_pass *st, void **self) {
    (void)st;
    if (*self)
        ag__rng_mark_backward(*self);
    return 0;
}

static int rng_finish(ag__export_pass *st, void **self) {
    if (!*self)
        return 0;
    int n = ag__rng_finish(*self, st->rng_descs);
    st->nrng = n < 0 ? 0 : n;
    return n < 0 ? n : 0;
}

static void rng_end(ag__export_pass *st, void **self) {
    if (*self && st->T) {
        ag__tracer_set_random(st->T, NULL, NULL);
        ag__tracer_set_rng_reserve(st->T, NULL, NULL);
    }
    ag__rng_free(*self);
    *self = NULL;
}

const ag__export_wrapper ag__rng_wrapper = {
    .name = "rng_functionalize",
    .begin = rng_begin,
    .outputs = rng_outputs,
    .backward = rng_backward,
    .finish = rng_finish,
    .end = rng_end,
};
