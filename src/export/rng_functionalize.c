/* RNG functionalization of the joint export (upstream's functionalize_rng_ops; spec 6.3 item 3).
 *
 * In: the calls of random ops (AG_OP_RANDOM) that the export's tracer sees while the model's
 * forward and the backward rules run. Out: in the joint graph, draws from explicit generator
 * state instead (philox_rand / philox_randn, src/ops/philox.c), the seed and base offset
 * placeholders of each side that draws, and the offset each side leaves the generator at.
 *
 * The functional form of each random op (k: numbers the side drew before this call, n: numel):
 *   rand(size, dtype)           philox_rand(size, seed, add(base_offset, k), dtype=dtype)
 *   randn(size, dtype)          philox_randn(size, seed, add(base_offset, k), dtype=dtype)
 *   uniform_(self, from, to)    self := philox_rand(self.size, seed, add(..), from, to, dtype)
 *   normal_(self, mean, std)    self := philox_randn(self.size, seed, add(..), mean, std, dtype)
 *   native_dropout(x, p, True)  u = philox_rand(x.size, seed, add(..), dtype=x.dtype)
 *                               mask = ge(u, p); out = mul(mul(mask, x), scale)
 *                               with scale = 1/(1-p) (0 when p = 1): the eager kernel keeps
 *                               u >= p and computes (mask * x) * scale in x's dtype, so the two
 *                               agree bit for bit.
 * Eager draws reserve the same n counters, so a compiled model fed the generator's (seed,
 * offset) and advanced to the returned offset draws exactly what eager draws. An evaluation-mode
 * native_dropout draws nothing and is recorded as it is. The emitted nodes are traced by
 * calling the ops on the meta tensors with grad mode off; they take the random op's seq_nr. The
 * op's outputs (dropout's mask included, which its autograd node saves) are bound to them, so
 * native_dropout's backward rule reads the mask node. Any other random op is refused. */
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

typedef enum { R_RAND, R_RANDN, R_UNIFORM, R_NORMAL, R_DROPOUT } rkind;

/* The functional form of one call (see the file comment); outs get bound to its nodes. */
static int emit(ag__rng_fn *R, rkind k, const ag_arg *args, ag_tensor **outs) {
    rng_side *S = &R->side[R->backward];
    ag_tensor *ref = k == R_DROPOUT ? args[0].u.t : outs[0]; /* gives size and dtype */
    int64_t n = ag_tensor_numel(ref);
    int nd = ag_tensor_ndim(ref);
    const int64_t *sz = ag_tensor_sizes(ref);
    ag_dtype dt = ag_tensor_dtype(ref);
    int rc = 0;
    ag_scope_begin();
    ag_tensor *off = ag_add_scalar(S->base, (double)S->drawn);
    ag_tensor *r = NULL, *mask = NULL;
    if (off) {
        switch (k) {
        case R_RAND:
            r = ag_philox_rand(S->seed, off, dt, nd, sz, 0.0, 1.0);
            break;
        case R_RANDN:
            r = ag_philox_randn(S->seed, off, dt, nd, sz, 0.0, 1.0);
            break;
        case R_UNIFORM:
            r = ag_philox_rand(S->seed, off, dt, nd, sz, args[1].u.f, args[2].u.f);
            break;
        case R_NORMAL:
            r = ag_philox_randn(S->seed, off, dt, nd, sz, args[1].u.f, args[2].u.f);
            break;
        case R_DROPOUT: {
            const double p = args[1].u.f, scale = p < 1 ? 1.0 / (1.0 - p) : 0.0;
            mask = ag_ge_scalar(ag_philox_rand(S->seed, off, dt, nd, sz, 0.0, 1.0), p);
            r = mask ? ag_mul_scalar(ag_mul(mask, args[0].u.t), scale) : NULL;
            break;
        }
        }
    }
    ag_node *rn = r ? ag__tracer_node_of(R->T, r) : NULL;
    ag_node *mn = mask ? ag__tracer_node_of(R->T, mask) : NULL;
    if (!rn || (k == R_DROPOUT && !mn))
        rc = ag_last_status() < 0 ? ag_last_status() : AG_EINVAL;
    ag_scope_end();
    if (rc)
        return rc;
    S->drawn += n;
    ag__tracer_bind(R->T, outs[0], rn);
    if (k == R_DROPOUT)
        ag__tracer_bind(R->T, outs[1], mn);
    return 0;
}

static int random_hook(void *ud, const ag_op *op, const ag_arg *args, int nargs, ag_tensor **outs,
                       int nouts) {
    (void)nargs;
    (void)nouts;
    ag__rng_fn *R = ud;
    static const struct {
        const char *name;
        rkind kind;
    } forms[] = {{"rand", R_RAND},
                 {"randn", R_RANDN},
                 {"uniform_", R_UNIFORM},
                 {"normal_", R_NORMAL},
                 {"native_dropout", R_DROPOUT}};
    const char *name = ag_op_name(op);
    int f = -1;
    for (int i = 0; i < (int)(sizeof forms / sizeof forms[0]) && f < 0; i++)
        if (!strcmp(name, forms[i].name))
            f = i;
    if (f < 0)
        return ag__err(AG_ENOTSUP,
                       "export: %s draws random numbers and has no functional form "
                       "for RNG functionalization (rand, randn, uniform_, normal_ and "
                       "native_dropout have one)",
                       name);
    if (forms[f].kind == R_DROPOUT && !(args[2].kind == AG_ARG_NONE || args[2].u.b))
        return 1; /* evaluation: no draw */
    int rc = ensure_side(R, R->backward);
    if (rc)
        return rc;
    /* The emitted nodes take this call's seq_nr (the dispatcher gives nested calls their own). */
    ag__tls_state *ts = ag__tls();
    int64_t seq = ts->bw_seq_nr >= 0 ? ts->bw_seq_nr : ts->trace_seq;
    ag_node *last = ag_graph_last(R->g);
    bool prev = ag_set_grad_enabled(false);
    rc = emit(R, forms[f].kind, args, outs);
    ag_set_grad_enabled(prev);
    for (ag_node *m = last ? ag_node_next(last) : NULL; m && rc == 0 && seq >= 0;
         m = ag_node_next(m))
        rc = ag_node_set_seq_nr(m, seq);
    return rc;
}

static ag__rng_fn *ag__rng_begin(ag__tracer *T, ag_graph *g) {
    ag__rng_fn *R = ag__calloc(1, sizeof *R);
    if (!R)
        return NULL;
    R->T = T;
    R->g = g;
    ag__tracer_set_random(T, random_hook, R);
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
    if (*self && st->T)
        ag__tracer_set_random(st->T, NULL, NULL);
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
