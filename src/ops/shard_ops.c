/* The sharding rules of the ops a training step runs (views, reductions, GEMMs, norms,
 * embedding, losses, attention, convolution, pooling, split/cat, factories), referenced from
 * each op's ag_opdef.shard in its family file.
 *
 * Most rules list strategies, DTensor's way: each strategy says which placement every tensor
 * input must take and which placement every output then has; pick() takes the valid one that
 * moves the fewest bytes from the inputs' current placements (a Replicate() input is sliced
 * locally, nearly free; nothing can be moved to Partial). Rules that only move dims around
 * (views, reductions over some dims) map the input's placement directly. Dims in arguments
 * may be negative (wrapped here), and an omitted Tensor? input still takes its number. */
#include "shard_rules.h"

#include "../core/internal.h"

#define MAXS 48 /* strategies per rule */
#define MAXIO 8 /* tensor inputs and outputs a strategy names */

typedef struct strat {
    ag_placement want[MAXIO];
    ag_placement out[MAXIO];
    double beta_scale; /* addmm: local beta = beta * beta_scale (0: unchanged) */
} strat;

typedef struct strats {
    strat s[MAXS];
    int n;
    int beta_arg; /* the argument beta_scale scales */
} strats;

static const ag_placement R = {.kind = AG_REPLICATE};

static strat *add(strats *ss) {
    if (ss->n >= MAXS)
        return NULL;
    strat *s = &ss->s[ss->n++];
    for (int i = 0; i < MAXIO; i++)
        s->want[i] = s->out[i] = R;
    s->beta_scale = 0;
    return s;
}

static double cost_of(const ag_shard_ctx *c, const strat *s) {
    double cost = 0;
    for (int i = 0; i < c->ntensor_inputs && i < MAXIO; i++) {
        ag_placement w = s->want[i];
        if (!ag__shard_fits(c, &c->in_meta[i], w))
            return -1;
        if (w.kind == AG_PARTIAL && !ag_placement_eq(c->in[i], w))
            return -1; /* nothing becomes Partial without communication we do not have */
        if (c->in[i].kind == AG_REPLICATE && w.kind == AG_SHARD)
            cost += 1e-3 * ag__shard_in_bytes(c, i); /* a local slice: prefer not slicing */
        else
            cost += ag__shard_move_cost(c, i, w);
    }
    for (int k = 0; k < c->noutputs && k < MAXIO; k++)
        if (!ag__shard_fits(c, &c->out_meta[k], s->out[k]))
            return -1;
    return cost;
}

/* Applies the cheapest valid strategy (the first on a tie); AG_SHARD_NO_RULE when none is. */
static int pick(ag_shard_ctx *c, const strats *ss) {
    if (c->ntensor_inputs > MAXIO || c->noutputs > MAXIO)
        return AG_SHARD_NO_RULE;
    int best = -1;
    double best_cost = 0;
    for (int i = 0; i < ss->n; i++) {
        double cost = cost_of(c, &ss->s[i]);
        if (cost >= 0 && (best < 0 || cost < best_cost)) {
            best = i;
            best_cost = cost;
        }
    }
    if (best < 0)
        return AG_SHARD_NO_RULE;
    const strat *s = &ss->s[best];
    for (int i = 0; i < c->ntensor_inputs; i++)
        c->want[i] = s->want[i];
    for (int k = 0; k < c->noutputs; k++)
        c->out[k] = s->out[k];
    if (s->beta_scale != 0 && ss->beta_arg > 0 && ss->beta_arg < c->nargs)
        c->local_args[ss->beta_arg] = AG_A_F(c->args[ss->beta_arg].u.f * s->beta_scale);
    return 0;
}

static int wrap(int64_t d, int n) {
    return (int)(d < 0 ? d + n : d);
}

/* The split factors worth trying: 1 and those of the inputs' shards. */
static int factors(const ag_shard_ctx *c, int *ks) {
    int n = 0;
    ks[n++] = 1;
    for (int i = 0; i < c->ntensor_inputs && n < 4; i++) {
        int k = c->in[i].kind == AG_SHARD ? ag__shard_sf(c->in[i]) : 1;
        bool seen = false;
        for (int j = 0; j < n; j++)
            seen |= ks[j] == k;
        if (!seen)
            ks[n++] = k;
    }
    return n;
}

/* The Partial reduce ops worth trying (both). */
static const ag_partial_op pops[] = {AG_PARTIAL_SUM, AG_PARTIAL_AVG};

/* ---- dim maps: views and ops that move dims around ---- */

/* Input 0's placement carried to the output through map (input dim -> output dim, -1: cannot
 * stay sharded); Partial passes when the op is linear, else the input is reduced first. Other
 * tensor inputs are replicated. */
static int map_unary(ag_shard_ctx *c, const int *map, bool linear) {
    ag_placement p = c->in[0];
    for (int i = 1; i < c->ntensor_inputs; i++)
        c->want[i] = R;
    ag_placement o = R;
    if (p.kind == AG_PARTIAL) {
        if (!linear) {
            c->want[0] = R;
            o = R;
        } else {
            o = p;
        }
    } else if (p.kind == AG_SHARD) {
        if (p.dim >= c->in_meta[0].ndim || map[p.dim] < 0)
            return AG_SHARD_NO_RULE;
        o = ag__shard_p(map[p.dim], p.split_factor);
        if (!ag__shard_fits(c, &c->out_meta[0], o))
            return AG_SHARD_NO_RULE;
    }
    for (int k = 0; k < c->noutputs; k++)
        c->out[k] = o;
    return 0;
}

static void identity_map(const ag_shard_ctx *c, int *map) {
    for (int d = 0; d < AG_MAX_DIMS; d++)
        map[d] = d < c->in_meta[0].ndim ? d : -1;
}

static bool float_out(const ag_shard_ctx *c) {
    ag_dtype dt = c->out_meta[0].dtype;
    return dt == AG_F32 || dt == AG_F64;
}

int ag__shard_identity(ag_shard_ctx *c) {
    int map[AG_MAX_DIMS];
    identity_map(c, map);
    return map_unary(c, map, float_out(c));
}

int ag__shard_transpose(ag_shard_ctx *c) {
    int n = c->in_meta[0].ndim, map[AG_MAX_DIMS];
    identity_map(c, map);
    int d0 = 0, d1 = n > 1 ? 1 : 0;
    if (!ag__shard_op_is(c, "t")) {
        d0 = wrap(c->args[1].u.i, n);
        d1 = wrap(c->args[2].u.i, n);
    }
    if (n >= 2 || d0 != d1) {
        map[d0] = d1;
        map[d1] = d0;
    }
    return map_unary(c, map, true);
}

int ag__shard_permute(ag_shard_ctx *c) {
    int n = c->in_meta[0].ndim, map[AG_MAX_DIMS];
    for (int o = 0; o < c->args[1].n && o < AG_MAX_DIMS; o++)
        map[wrap(c->args[1].u.ints[o], n)] = o;
    return map_unary(c, map, true);
}

int ag__shard_unsqueeze(ag_shard_ctx *c) {
    int n = c->in_meta[0].ndim, map[AG_MAX_DIMS];
    int at = wrap(c->args[1].u.i, n + 1);
    for (int d = 0; d < n; d++)
        map[d] = d < at ? d : d + 1;
    return map_unary(c, map, true);
}

int ag__shard_squeeze(ag_shard_ctx *c) {
    const ag_tmeta *m = &c->in_meta[0];
    int map[AG_MAX_DIMS], o = 0;
    bool all = ag__shard_op_is(c, "squeeze");
    int only = all ? -1 : wrap(c->args[1].u.i, m->ndim);
    for (int d = 0; d < m->ndim; d++) {
        bool gone = m->sizes[d] == 1 && (all || d == only);
        map[d] = gone ? -1 : o++;
    }
    /* squeeze() would drop a sharded dim whose chunk has size 1 on a rank. */
    ag_placement p = c->in[0];
    if (all && p.kind == AG_SHARD && p.dim < m->ndim && m->sizes[p.dim] == c->world)
        return AG_SHARD_NO_RULE;
    return map_unary(c, map, true);
}

/* slice.Tensor and select.int: the sliced dim cannot stay sharded. */
int ag__shard_slice(ag_shard_ctx *c) {
    int n = c->in_meta[0].ndim, map[AG_MAX_DIMS];
    int dim = wrap(c->args[1].u.i, n);
    bool select = ag__shard_op_is(c, "select.int");
    for (int d = 0; d < n; d++)
        map[d] = d == dim ? -1 : (select && d > dim ? d - 1 : d);
    return map_unary(c, map, true);
}

/* Rewrites the sizes argument `a` as the output's sizes with the sharded dim divided. */
static void local_sizes(ag_shard_ctx *c, int a) {
    const ag_tmeta *om = &c->out_meta[0];
    if (c->out[0].kind != AG_SHARD || a >= AG_MAX_ARGS)
        return;
    for (int d = 0; d < om->ndim; d++)
        c->ints[a][d] = om->sizes[d];
    c->ints[a][c->out[0].dim] /= c->world;
    c->local_args[a] = AG_A_INTS(c->ints[a], om->ndim);
}

int ag__shard_expand(ag_shard_ctx *c) {
    const ag_tmeta *im = &c->in_meta[0], *om = &c->out_meta[0];
    int map[AG_MAX_DIMS], off = om->ndim - im->ndim;
    for (int d = 0; d < im->ndim; d++)
        map[d] = im->sizes[d] == om->sizes[d + off] ? d + off : -1;
    int rc = map_unary(c, map, true);
    if (rc == 0)
        local_sizes(c, 1);
    return rc;
}

/* view/reshape: the shapes are cut into groups of dims whose products match; a shard of input
 * dim d (split factor k) cuts its group's flat range into P x k blocks (P: the product of the
 * group's dims before d), each split over the ranks. Output dim e of the group with Q dims
 * before it gives the same cut as StridedShard(e, P k / Q) when Q divides P k and e's size
 * divides by P k / Q x world. */
int ag__shard_view(ag_shard_ctx *c) {
    const ag_tmeta *im = &c->in_meta[0], *om = &c->out_meta[0];
    ag_placement p = c->in[0];
    if (p.kind != AG_SHARD)
        return map_unary(c, (int[AG_MAX_DIMS]){0}, true);
    int d = p.dim, i = 0, o = 0;
    while (i < im->ndim || o < om->ndim) {
        int i0 = i, o0 = o;
        int64_t pi = i < im->ndim ? im->sizes[i++] : 1, po = o < om->ndim ? om->sizes[o++] : 1;
        while (pi != po) {
            if (pi < po && i < im->ndim)
                pi *= im->sizes[i++];
            else if (po < pi && o < om->ndim)
                po *= om->sizes[o++];
            else
                return AG_SHARD_NO_RULE;
        }
        /* Size-1 dims after a group join it (they change no product). */
        while (i < im->ndim && im->sizes[i] == 1 && i != d)
            i++;
        if (d < i0 || d >= i)
            continue;
        int64_t before = 1;
        for (int j = i0; j < d; j++)
            before *= im->sizes[j];
        int64_t blocks = before * ag__shard_sf(p), q = 1;
        for (int e = o0; e < o; e++) {
            if (blocks % q == 0) {
                int64_t k = blocks / q;
                if (k <= 0x7fffffff && ag_shard_divisible(om->sizes[e], c->world, (int)k)) {
                    c->out[0] = ag__shard_p(e, (int)k);
                    for (int t = 1; t < c->ntensor_inputs; t++)
                        c->want[t] = R;
                    local_sizes(c, 1);
                    return 0;
                }
            }
            q *= om->sizes[e];
        }
        return AG_SHARD_NO_RULE;
    }
    return AG_SHARD_NO_RULE;
}

/* ---- reductions ---- */

/* sum.dim_IntList, mean.dim, sum: a sharded reduced dim gives Partial(sum) (Partial(avg) for
 * mean: the chunks are equal); Partial inputs stay Partial (both ops are linear). */
int ag__shard_sum(ag_shard_ctx *c) {
    const ag_tmeta *m = &c->in_meta[0];
    bool mean = ag__shard_op_is(c, "mean"), all = !mean && !ag__shard_op_is(c, "sum.dim_IntList");
    bool keep = !all && c->args[2].kind == AG_ARG_BOOL && c->args[2].u.b;
    bool reduced[AG_MAX_DIMS] = {0};
    if (all || c->args[1].kind != AG_ARG_INTS || c->args[1].n == 0) {
        for (int d = 0; d < m->ndim; d++)
            reduced[d] = true;
    } else {
        for (int j = 0; j < c->args[1].n; j++)
            reduced[wrap(c->args[1].u.ints[j], m->ndim)] = true;
    }
    if (!float_out(c) && c->in[0].kind != AG_SHARD)
        return c->in[0].kind == AG_REPLICATE ? 0 : AG_SHARD_NO_RULE;
    int map[AG_MAX_DIMS], o = 0;
    for (int d = 0; d < m->ndim; d++)
        map[d] = reduced[d] ? -1 : (keep ? d : o++);
    ag_placement p = c->in[0];
    if (p.kind == AG_SHARD && p.dim < m->ndim && reduced[p.dim]) {
        if (!float_out(c))
            return AG_SHARD_NO_RULE;
        c->out[0] = AG_P_PARTIAL(mean ? AG_PARTIAL_AVG : AG_PARTIAL_SUM);
        return 0;
    }
    return map_unary(c, map, true);
}

/* _softmax, _log_softmax: any dim but the softmax dim. */
int ag__shard_softmax(ag_shard_ctx *c) {
    int n = c->in_meta[0].ndim, map[AG_MAX_DIMS];
    identity_map(c, map);
    if (n > 0)
        map[wrap(c->args[1].u.i, n)] = -1;
    return map_unary(c, map, false);
}

/* _softmax_backward_data, _log_softmax_backward_data (grad_output, output, dim): both alike on
 * any dim but the softmax dim. */
int ag__shard_softmax_backward(ag_shard_ctx *c) {
    int n = c->in_meta[0].ndim, dim = wrap(c->args[2].u.i, n), ks[4], nk = factors(c, ks);
    strats ss = {.n = 0};
    for (int d = 0; d < n; d++)
        for (int j = 0; j < nk; j++) {
            if (d == dim)
                continue;
            strat *s = add(&ss);
            s->want[0] = s->want[1] = s->out[0] = ag__shard_p(d, ks[j]);
        }
    add(&ss);
    return pick(c, &ss);
}

/* ---- GEMMs ---- */

/* mm(a [n, k], b [k, m]) and bmm(a [B, n, k], b [B, k, m]). */
int ag__shard_mm(ag_shard_ctx *c) {
    int ks[4], nk = factors(c, ks), b = c->in_meta[0].ndim == 3;
    strats ss = {.n = 0};
    for (int j = 0; j < nk; j++) {
        ag_placement s0 = ag__shard_p(b, ks[j]), s1 = ag__shard_p(b + 1, ks[j]);
        strat *s;
        if (b) {
            s = add(&ss);
            s->want[0] = s->want[1] = s->out[0] = ag__shard_p(0, ks[j]);
        }
        s = add(&ss); /* rows of a */
        s->want[0] = s0, s->out[0] = s0;
        s = add(&ss); /* columns of b */
        s->want[1] = s1, s->out[0] = s1;
        s = add(&ss); /* the contraction: row-parallel */
        s->want[0] = s1, s->want[1] = s0, s->out[0] = AG_P_PARTIAL(AG_PARTIAL_SUM);
    }
    for (int j = 0; j < 2; j++) {
        strat *s = add(&ss);
        s->want[0] = s->out[0] = AG_P_PARTIAL(pops[j]);
        s = add(&ss);
        s->want[1] = s->out[0] = AG_P_PARTIAL(pops[j]);
    }
    add(&ss);
    return pick(c, &ss);
}

/* The placement a broadcast input (addmm's self) must take for output placement o. */
static ag_placement bcast_want(const ag_shard_ctx *c, int i, ag_placement o) {
    if (o.kind != AG_SHARD)
        return o.kind == AG_PARTIAL ? o : R;
    const ag_tmeta *om = &c->out_meta[0], *im = &c->in_meta[i];
    int d = o.dim - (om->ndim - im->ndim);
    if (d < 0 || (im->sizes[d] == 1 && om->sizes[o.dim] != 1))
        return R;
    return ag__shard_p(d, o.split_factor);
}

/* addmm(self, mat1 [n, k], mat2 [k, m]) = beta self + alpha mat1 @ mat2. Row-parallel with a
 * Replicate() self scales beta by 1/world on every rank, so the ranks' pieces sum to it once. */
int ag__shard_addmm(ag_shard_ctx *c) {
    int ks[4], nk = factors(c, ks);
    strats ss = {.n = 0, .beta_arg = 3};
    for (int j = 0; j < nk; j++) {
        ag_placement s0 = ag__shard_p(0, ks[j]), s1 = ag__shard_p(1, ks[j]);
        strat *s = add(&ss);
        s->want[1] = s0, s->out[0] = s0, s->want[0] = bcast_want(c, 0, s0);
        s = add(&ss);
        s->want[2] = s1, s->out[0] = s1, s->want[0] = bcast_want(c, 0, s1);
        s = add(&ss);
        s->want[1] = s1, s->want[2] = s0, s->out[0] = AG_P_PARTIAL(AG_PARTIAL_SUM);
        s->want[0] = AG_P_PARTIAL(AG_PARTIAL_SUM);
        s = add(&ss);
        s->want[1] = s1, s->want[2] = s0, s->out[0] = AG_P_PARTIAL(AG_PARTIAL_SUM);
        s->beta_scale = 1.0 / c->world;
    }
    ag_placement ps = AG_P_PARTIAL(AG_PARTIAL_SUM), pa = AG_P_PARTIAL(AG_PARTIAL_AVG);
    strat *s = add(&ss);
    s->want[0] = s->want[1] = s->out[0] = ps;
    s = add(&ss);
    s->want[0] = s->want[2] = s->out[0] = ps;
    s = add(&ss);
    s->want[1] = s->out[0] = pa; /* avg(beta self + alpha a_r b) = beta self + alpha A b */
    s = add(&ss);
    s->want[2] = s->out[0] = pa;
    add(&ss);
    return pick(c, &ss);
}

/* ---- norms ---- */

/* native_layer_norm(input, normalized_shape, weight?, bias?, eps) -> (out, mean, rstd): any
 * dim before the normalized ones; weight and bias whole. */
int ag__shard_layer_norm(ag_shard_ctx *c) {
    int n = c->in_meta[0].ndim - c->args[1].n, ks[4], nk = factors(c, ks);
    strats ss = {.n = 0};
    for (int d = 0; d < n; d++)
        for (int j = 0; j < nk; j++) {
            strat *s = add(&ss);
            s->want[0] = s->out[0] = s->out[1] = s->out[2] = ag__shard_p(d, ks[j]);
        }
    add(&ss);
    return pick(c, &ss);
}

/* native_layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, weight?, bias?,
 * mask) -> (grad_input, grad_weight, grad_bias): the grads of weight and bias are sums over the
 * sharded rows: Partial(sum). */
int ag__shard_layer_norm_backward(ag_shard_ctx *c) {
    int n = c->in_meta[0].ndim - c->args[2].n, ks[4], nk = factors(c, ks);
    strats ss = {.n = 0};
    for (int d = 0; d < n; d++)
        for (int j = 0; j < nk; j++) {
            strat *s = add(&ss);
            ag_placement p = ag__shard_p(d, ks[j]);
            s->want[0] = s->want[1] = s->want[2] = s->want[3] = s->out[0] = p;
            s->out[1] = s->out[2] = AG_P_PARTIAL(AG_PARTIAL_SUM);
        }
    add(&ss);
    return pick(c, &ss);
}

/* _native_batch_norm_legit_functional(input, weight?, bias?, running_mean, running_var,
 * training, momentum, eps) -> (out, save_mean, save_rstd, new_running_mean, new_running_var):
 * the channel dim only (the batch statistics need every sample). */
int ag__shard_batch_norm(ag_shard_ctx *c) {
    strats ss = {.n = 0};
    if (c->in_meta[0].ndim >= 2) {
        strat *s = add(&ss);
        ag_placement s0 = AG_P_SHARD(0);
        s->want[0] = s->out[0] = AG_P_SHARD(1);
        for (int i = 1; i < 5; i++)
            s->want[i] = i < c->ntensor_inputs && c->in_meta[i].ndim == 1 ? s0 : R;
        for (int k = 1; k < 5; k++)
            s->out[k] = k < c->noutputs && c->out_meta[k].ndim == 1 ? s0 : R;
    }
    add(&ss);
    return pick(c, &ss);
}

/* native_batch_norm_backward(grad_out, input, weight?, running_mean?, running_var?,
 * save_mean?, save_invstd?, train, eps, mask) -> (grad_input, grad_weight, grad_bias). */
int ag__shard_batch_norm_backward(ag_shard_ctx *c) {
    strats ss = {.n = 0};
    if (c->in_meta[0].ndim >= 2) {
        strat *s = add(&ss);
        ag_placement s0 = AG_P_SHARD(0);
        s->want[0] = s->want[1] = s->out[0] = AG_P_SHARD(1);
        for (int i = 2; i < 7; i++)
            s->want[i] = i < c->ntensor_inputs && c->in_meta[i].ndim == 1 ? s0 : R;
        for (int k = 1; k < 3; k++)
            s->out[k] = k < c->noutputs && c->out_meta[k].ndim == 1 ? s0 : R;
    }
    add(&ss);
    return pick(c, &ss);
}

/* ---- embedding, losses, attention ---- */

/* embedding(weight [V, D], indices [...]) -> [..., D]: indices sharded on any dim, or the
 * weight's columns. */
int ag__shard_embedding(ag_shard_ctx *c) {
    int ni = c->in_meta[1].ndim;
    strats ss = {.n = 0};
    for (int d = 0; d < ni; d++) {
        strat *s = add(&ss);
        s->want[1] = s->out[0] = AG_P_SHARD(d);
    }
    strat *s = add(&ss);
    s->want[0] = AG_P_SHARD(1);
    s->out[0] = AG_P_SHARD(ni);
    add(&ss);
    return pick(c, &ss);
}

/* embedding_dense_backward(grad_output [..., D], indices [...], num_weights, padding_idx,
 * scale_grad_by_freq) -> [V, D]: rows of a batch shard add up (Partial(sum)); the counts of
 * scale_grad_by_freq would need every index, so then only the columns. */
int ag__shard_embedding_backward(ag_shard_ctx *c) {
    int ni = c->in_meta[1].ndim;
    bool freq = c->args[4].kind == AG_ARG_BOOL && c->args[4].u.b;
    strats ss = {.n = 0};
    for (int d = 0; d < ni && !freq; d++) {
        strat *s = add(&ss);
        s->want[0] = s->want[1] = AG_P_SHARD(d);
        s->out[0] = AG_P_PARTIAL(AG_PARTIAL_SUM);
    }
    strat *s = add(&ss);
    s->want[0] = AG_P_SHARD(ni);
    s->out[0] = AG_P_SHARD(1);
    add(&ss);
    return pick(c, &ss);
}

/* gather(self, dim, index) -> [index's shape]: self and index sharded alike on a dim other
 * than `dim` where both have the same size. */
int ag__shard_gather(ag_shard_ctx *c) {
    const ag_tmeta *sm = &c->in_meta[0], *im = &c->in_meta[1];
    if (sm->ndim == 0 || im->ndim != sm->ndim)
        return AG_SHARD_NO_RULE;
    int dim = wrap(c->args[1].u.i, sm->ndim), ks[4], nk = factors(c, ks);
    strats ss = {.n = 0};
    for (int d = 0; d < sm->ndim; d++) {
        if (d == dim || sm->sizes[d] != im->sizes[d])
            continue;
        for (int j = 0; j < nk; j++) {
            strat *s = add(&ss);
            s->want[0] = s->want[1] = s->out[0] = ag__shard_p(d, ks[j]);
        }
    }
    add(&ss);
    return pick(c, &ss);
}

/* index_select(self, dim, index [k]): the index sharded (self whole) gives the output sharded
 * on `dim`; self sharded on another dim (the index whole) gives the output sharded alike. */
int ag__shard_index_select(ag_shard_ctx *c) {
    const ag_tmeta *sm = &c->in_meta[0];
    if (sm->ndim == 0 || c->in_meta[1].ndim != 1)
        return AG_SHARD_NO_RULE;
    int dim = wrap(c->args[1].u.i, sm->ndim);
    strats ss = {.n = 0};
    strat *s = add(&ss);
    s->want[1] = AG_P_SHARD(0);
    s->out[0] = AG_P_SHARD(dim);
    for (int d = 0; d < sm->ndim; d++) {
        if (d == dim)
            continue;
        s = add(&ss);
        s->want[0] = s->out[0] = AG_P_SHARD(d);
    }
    add(&ss);
    return pick(c, &ss);
}

enum { RED_NONE = 0, RED_MEAN = 1, RED_SUM = 2 };

/* nll_loss_forward(self [N, C], target [N], weight?, reduction, ignore_index) -> (output,
 * total_weight): the batch sharded. With reduction sum both outputs are sums over the batch:
 * Partial(sum); with none the output is per sample. Mean divides by the whole batch's total
 * weight, which no rank has: no rule. */
int ag__shard_nll_loss(ag_shard_ctx *c) {
    int64_t red = c->args[3].u.i;
    strats ss = {.n = 0};
    if (c->in_meta[0].ndim == 2 && red != RED_MEAN) {
        strat *s = add(&ss);
        s->want[0] = s->want[1] = AG_P_SHARD(0);
        s->out[0] = red == RED_SUM ? AG_P_PARTIAL(AG_PARTIAL_SUM) : AG_P_SHARD(0);
        s->out[1] = AG_P_PARTIAL(AG_PARTIAL_SUM);
    }
    add(&ss);
    return pick(c, &ss);
}

/* nll_loss_backward(grad_output, self, target, weight?, reduction, ignore_index, total_weight):
 * the batch sharded; grad_output and total_weight whole (per sample for none), so mean is
 * exact here: every rank divides by the global total weight. */
int ag__shard_nll_loss_backward(ag_shard_ctx *c) {
    int64_t red = c->args[4].u.i;
    strats ss = {.n = 0};
    if (c->in_meta[1].ndim == 2) {
        strat *s = add(&ss);
        s->want[1] = s->want[2] = s->out[0] = AG_P_SHARD(0);
        s->want[0] = red == RED_NONE ? AG_P_SHARD(0) : R;
    }
    add(&ss);
    return pick(c, &ss);
}

/* The placement a mask input takes for output placement p on dim d of a 4-d attention. */
static ag_placement mask_want(const ag_shard_ctx *c, int i, int d, ag_placement p) {
    if (i >= c->ntensor_inputs || c->in_meta[i].ndim == 0)
        return R;
    const ag_tmeta *m = &c->in_meta[i];
    int md = d - (4 - m->ndim);
    if (md < 0 || m->sizes[md] == 1)
        return R;
    return ag__shard_p(md, p.split_factor);
}

/* _scaled_dot_product_flash_attention_for_cpu(q, k, v [B, H, L, E], dropout_p, is_causal,
 * attn_mask?, scale) -> (out, logsumexp) and its backward (grad_out, q, k, v, out, logsumexp,
 * dropout_p, is_causal, attn_mask?, scale) -> (grad_q, grad_k, grad_v): batch or heads sharded,
 * everything alike. Dropout draws random numbers: no rule. */
int ag__shard_sdpa(ag_shard_ctx *c) {
    bool bw = c->noutputs == 3;
    int pdrop = bw ? 6 : 3, nin = bw ? 6 : 3, mask = nin;
    if (c->args[pdrop].kind == AG_ARG_FLOAT && c->args[pdrop].u.f != 0)
        return AG_SHARD_NO_RULE;
    if (c->in_meta[bw ? 1 : 0].ndim != 4)
        return AG_SHARD_NO_RULE;
    int ks[4], nk = factors(c, ks);
    strats ss = {.n = 0};
    for (int d = 0; d < 2; d++)
        for (int j = 0; j < nk; j++) {
            ag_placement p = ag__shard_p(d, ks[j]);
            strat *s = add(&ss);
            for (int i = 0; i < nin; i++)
                s->want[i] = p;
            s->want[mask] = mask_want(c, mask, d, p);
            for (int k = 0; k < c->noutputs; k++)
                s->out[k] = p;
        }
    add(&ss);
    return pick(c, &ss);
}

/* ---- convolution and pooling ---- */

/* convolution(input [N, C, ...], weight [O, C/g, ...], bias? [O], ...): the batch, or (one
 * group) the output channels with the weight's and bias's rows. */
int ag__shard_convolution(ag_shard_ctx *c) {
    bool transposed = c->args[6].kind == AG_ARG_BOOL && c->args[6].u.b;
    strats ss = {.n = 0};
    strat *s = add(&ss);
    s->want[0] = s->out[0] = AG_P_SHARD(0);
    if (!transposed && c->args[8].u.i == 1) {
        s = add(&ss);
        s->want[1] = AG_P_SHARD(0);
        s->want[2] = c->in_meta[2].ndim == 1 ? AG_P_SHARD(0) : R;
        s->out[0] = AG_P_SHARD(1);
    }
    add(&ss);
    return pick(c, &ss);
}

/* convolution_backward(grad_output, input, weight, ...) -> (grad_input, grad_weight,
 * grad_bias): the batch; the weight's and bias's grads are sums over it. */
int ag__shard_convolution_backward(ag_shard_ctx *c) {
    strats ss = {.n = 0};
    strat *s = add(&ss);
    s->want[0] = s->want[1] = s->out[0] = AG_P_SHARD(0);
    s->out[1] = s->out[2] = AG_P_PARTIAL(AG_PARTIAL_SUM);
    add(&ss);
    return pick(c, &ss);
}

/* max_pool2d_with_indices(self [N, C, H, W]) -> (out, indices) and its backward
 * (grad_output, self, ..., indices): batch or channels (indices are within each plane). */
int ag__shard_max_pool(ag_shard_ctx *c) {
    int ks[4], nk = factors(c, ks), nd = c->in_meta[0].ndim;
    strats ss = {.n = 0};
    for (int d = 0; d < nd - 2; d++)
        for (int j = 0; j < nk; j++) {
            ag_placement p = ag__shard_p(d, ks[j]);
            strat *s = add(&ss);
            for (int i = 0; i < c->ntensor_inputs; i++)
                s->want[i] = p;
            for (int k = 0; k < c->noutputs; k++)
                s->out[k] = p;
        }
    add(&ss);
    return pick(c, &ss);
}

/* ---- split and cat ---- */

/* split.Tensor(self, split_size, dim) -> Tensor[]: a dim other than the split one stays
 * sharded; StridedShard(dim, k) split into its k blocks gives k Shard(dim) pieces. */
int ag__shard_split(ag_shard_ctx *c) {
    const ag_tmeta *m = &c->in_meta[0];
    ag_placement p = c->in[0];
    int dim = wrap(c->args[2].u.i, m->ndim);
    if (p.kind == AG_SHARD && p.dim == dim) {
        int k = ag__shard_sf(p);
        if (k < 2 || k != c->noutputs || c->args[1].u.i * k != m->sizes[dim] ||
            !ag_shard_divisible(c->args[1].u.i, c->world, 0))
            return AG_SHARD_NO_RULE;
        for (int o = 0; o < c->noutputs; o++)
            c->out[o] = AG_P_SHARD(dim);
        c->local_args[1] = AG_A_I(c->args[1].u.i / c->world);
        return 0;
    }
    int map[AG_MAX_DIMS];
    identity_map(c, map);
    map[dim] = -1;
    if (p.kind == AG_SHARD) {
        for (int o = 0; o < c->noutputs; o++)
            if (!ag__shard_fits(c, &c->out_meta[o], p))
                return AG_SHARD_NO_RULE;
    }
    return map_unary(c, map, true);
}

/* cat(tensors, dim): all inputs sharded alike on another dim, or all Partial alike; n inputs
 * of one size each Shard(dim) give StridedShard(dim, n). */
int ag__shard_cat(ag_shard_ctx *c) {
    int n = c->ntensor_inputs;
    if (n < 1)
        return AG_SHARD_NO_RULE;
    const ag_tmeta *om = &c->out_meta[0];
    int dim = wrap(c->args[1].u.i, om->ndim);
    ag_placement p = c->in[0];
    bool same = true, equal_sizes = true;
    for (int i = 0; i < n; i++) {
        same &= ag_placement_eq(c->in[i], p) && c->in_meta[i].ndim == om->ndim;
        equal_sizes &=
            c->in_meta[i].ndim == om->ndim && c->in_meta[i].sizes[dim] == c->in_meta[0].sizes[dim];
    }
    /* Every input goes where the first one is when possible, else all are replicated. */
    ag_placement o = R, w = R;
    if (p.kind == AG_PARTIAL && same) {
        o = w = p;
    } else if (p.kind == AG_SHARD && p.dim != dim && p.dim < om->ndim) {
        o = w = p;
    } else if (p.kind == AG_SHARD && p.dim == dim && ag__shard_sf(p) == 1 && equal_sizes && n > 1) {
        w = p;
        o = ag__shard_p(dim, n);
    }
    for (int i = 0; i < n; i++)
        if (!ag__shard_fits(c, &c->in_meta[i], w))
            w = o = R;
    if (!ag__shard_fits(c, om, o))
        w = o = R;
    for (int i = 0; i < n; i++)
        c->want[i] = w;
    c->out[0] = o;
    return 0;
}

/* ---- factories ---- */

/* Factories make the whole tensor on every rank (random ones draw the same numbers there as
 * one process would); *_like ops read only their input's shape, so a sharded input gives a
 * sharded output and nothing moves. */
int ag__shard_factory(ag_shard_ctx *c) {
    for (int k = 0; k < c->noutputs; k++)
        c->out[k] = R;
    if (c->ntensor_inputs >= 1 && c->in[0].kind == AG_SHARD &&
        c->in_meta[0].ndim == c->out_meta[0].ndim)
        c->out[0] = c->in[0];
    return 0;
}
