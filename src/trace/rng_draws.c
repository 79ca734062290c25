/* A random op's call recorded as Philox draws from explicit state (the functional forms of
 * upstream's functionalize_rng_ops), for the joint export's RNG functionalization
 * (src/export/rng_functionalize.c) and for the draws of a nested compile region's body, which
 * read the region's own seed and offset operands (region_trace.c).
 *
 * In: a call of a random op (AG_OP_RANDOM) seen by the tracer's random hook, 0-dim int64 meta
 * tensors bound to a seed and a base offset, and the numbers k drawn from them before. Out:
 *   rand(size, dtype)           philox_rand(size, seed, add(base_offset, k), dtype=dtype)
 *   randn(size, dtype)          philox_randn(size, seed, add(base_offset, k), dtype=dtype)
 *   uniform_(self, from, to)    self := philox_rand(self.size, seed, add(..), from, to, dtype)
 *   normal_(self, mean, std)    self := philox_randn(self.size, seed, add(..), mean, std, dtype)
 *   native_dropout(x, p, True)  u = philox_rand(x.size, seed, add(..), dtype=x.dtype)
 *                               mask = ge(u, p); out = mul(mul(mask, x), scale)
 *                               with scale = 1/(1-p) (0 when p = 1): the eager kernel keeps
 *                               u >= p and computes (mask * x) * scale in x's dtype, so the two
 *                               agree bit for bit.
 * Eager draws reserve the same n counters, so state fed the generator's (seed, offset) draws
 * exactly what eager draws. An evaluation-mode native_dropout draws nothing and is recorded as it
 * is. The emitted nodes are traced by calling the ops on the meta tensors with grad mode off;
 * they take the random op's seq_nr. The op's outputs (dropout's mask included, which its autograd
 * node saves) are bound to them, so native_dropout's backward rule reads the mask node. */
#include "../graph/graph_internal.h"

typedef enum { R_RAND, R_RANDN, R_UNIFORM, R_NORMAL, R_DROPOUT } rkind;

static const struct {
    const char *name;
    rkind kind;
} forms[] = {{"rand", R_RAND},
             {"randn", R_RANDN},
             {"uniform_", R_UNIFORM},
             {"normal_", R_NORMAL},
             {"native_dropout", R_DROPOUT}};

static int form_of(const ag_op *op) {
    const char *name = ag_op_name(op);
    for (int i = 0; i < (int)(sizeof forms / sizeof forms[0]); i++)
        if (!strcmp(name, forms[i].name))
            return i;
    return -1;
}

int ag__rng_call_draws(const ag_op *op, const ag_arg *args) {
    int f = form_of(op);
    if (f < 0)
        return ag__err(AG_ENOTSUP,
                       "export: %s draws random numbers and has no functional form "
                       "for RNG functionalization (rand, randn, uniform_, normal_ and "
                       "native_dropout have one)",
                       ag_op_name(op));
    if (forms[f].kind == R_DROPOUT && !(args[2].kind == AG_ARG_NONE || args[2].u.b))
        return 0; /* evaluation: no draw */
    return 1;
}

/* The functional form of one call (see the file comment); outs get bound to its nodes. */
static int emit(ag__tracer *T, ag_tensor *seed, ag_tensor *base, int64_t *drawn, rkind k,
                const ag_arg *args, ag_tensor **outs) {
    ag_tensor *ref = k == R_DROPOUT ? args[0].u.t : outs[0]; /* gives size and dtype */
    int64_t n = ag_tensor_numel(ref);
    int nd = ag_tensor_ndim(ref);
    const int64_t *sz = ag_tensor_sizes(ref);
    ag_dtype dt = ag_tensor_dtype(ref);
    int rc = 0;
    ag_scope_begin();
    ag_tensor *off = ag_add_scalar(base, (double)*drawn);
    ag_tensor *r = NULL, *mask = NULL;
    if (off) {
        switch (k) {
        case R_RAND:
            r = ag_philox_rand(seed, off, dt, nd, sz, 0.0, 1.0);
            break;
        case R_RANDN:
            r = ag_philox_randn(seed, off, dt, nd, sz, 0.0, 1.0);
            break;
        case R_UNIFORM:
            r = ag_philox_rand(seed, off, dt, nd, sz, args[1].u.f, args[2].u.f);
            break;
        case R_NORMAL:
            r = ag_philox_randn(seed, off, dt, nd, sz, args[1].u.f, args[2].u.f);
            break;
        case R_DROPOUT: {
            const double p = args[1].u.f, scale = p < 1 ? 1.0 / (1.0 - p) : 0.0;
            mask = ag_ge_scalar(ag_philox_rand(seed, off, dt, nd, sz, 0.0, 1.0), p);
            r = mask ? ag_mul_scalar(ag_mul(mask, args[0].u.t), scale) : NULL;
            break;
        }
        }
    }
    ag_node *rn = r ? ag__tracer_node_of(T, r) : NULL;
    ag_node *mn = mask ? ag__tracer_node_of(T, mask) : NULL;
    if (!rn || (k == R_DROPOUT && !mn))
        rc = ag_last_status() < 0 ? ag_last_status() : AG_EINVAL;
    ag_scope_end();
    if (rc)
        return rc;
    *drawn += n;
    ag__tracer_bind(T, outs[0], rn);
    if (k == R_DROPOUT)
        ag__tracer_bind(T, outs[1], mn);
    return 0;
}

int ag__rng_record(ag__tracer *T, ag_tensor *seed, ag_tensor *base, int64_t *drawn, const ag_op *op,
                   const ag_arg *args, ag_tensor **outs) {
    int f = form_of(op);
    if (f < 0)
        return ag__rng_call_draws(op, args);
    /* The emitted nodes take this call's seq_nr (the dispatcher gives nested calls their own). */
    ag__tls_state *ts = ag__tls();
    int64_t seq = ts->bw_seq_nr >= 0 ? ts->bw_seq_nr : ts->trace_seq;
    ag_graph *g = ag__tracer_graph(T);
    ag_node *last = ag_graph_last(g);
    bool prev = ag_set_grad_enabled(false);
    int rc = emit(T, seed, base, drawn, forms[f].kind, args, outs);
    ag_set_grad_enabled(prev);
    for (ag_node *m = last ? ag_node_next(last) : NULL; m && rc == 0 && seq >= 0;
         m = ag_node_next(m))
        rc = ag_node_set_seq_nr(m, seq);
    return rc;
}
