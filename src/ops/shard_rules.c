/* Placements and the sharding rules every op family shares.
 *
 * In: an op call's global metadata and the placement of each tensor input on a 1-D mesh of
 * `world` ranks (ag_shard_ctx, include/aotgrad/optable.h). Out: the placements the inputs must
 * take (want) so that running the op on each rank's local pieces gives outputs of known
 * placements (out) with no communication, and the arguments each rank calls the op with
 * (local_args). The sharding pass (src/parallel) calls ag_op_shard_rule for each node and inserts
 * the collectives that move inputs from `in` to `want`.
 *
 * The rules choose what costs least: an input already sharded is followed, a Replicate()
 * input is sliced locally for free, and a Partial input is reduced only where the op is not
 * linear in it. This file holds the placement strings, the pointwise rules (elementwise with
 * broadcasting, and the linear variants that keep Partial), the entry that picks an op's rule
 * and checks what it returned, and small helpers for the rules in the family files. */
#include "shard_rules.h"

#include "../core/internal.h"

#include <stdio.h>
#include <stdlib.h>

/* ---- placements ---- */

char *ag_placement_str(ag_placement p, char *buf, size_t n) {
    if (!buf || n == 0)
        return buf;
    switch (p.kind) {
    case AG_REPLICATE:
        snprintf(buf, n, "Replicate()");
        break;
    case AG_SHARD:
        if (p.split_factor > 1)
            snprintf(buf, n, "StridedShard(%d, %d)", p.dim, p.split_factor);
        else
            snprintf(buf, n, "Shard(%d)", p.dim);
        break;
    case AG_PARTIAL:
        snprintf(buf, n, "Partial(%s)", p.op == AG_PARTIAL_AVG ? "avg" : "sum");
        break;
    default:
        snprintf(buf, n, "<placement %d>", (int)p.kind);
        break;
    }
    return buf;
}

/* Reads a decimal int >= 0 at *s (spaces around it allowed); false when there is none or it
 * does not fit an int. */
static bool parse_nonneg(const char **s, int *out) {
    const char *q = *s;
    while (*q == ' ')
        q++;
    if (*q < '0' || *q > '9')
        return false;
    long long v = 0;
    while (*q >= '0' && *q <= '9') {
        v = v * 10 + (*q - '0');
        if (v > 0x7fffffff)
            return false;
        q++;
    }
    while (*q == ' ')
        q++;
    *s = q;
    *out = (int)v;
    return true;
}

static bool skip_prefix(const char **s, const char *prefix) {
    size_t n = strlen(prefix);
    if (strncmp(*s, prefix, n))
        return false;
    *s += n;
    return true;
}

int ag_placement_parse(const char *s, ag_placement *out) {
    AG__CHECK_NULL("ag_placement_parse", s);
    AG__CHECK_NULL("ag_placement_parse", out);
    const char *q = s;
    ag_placement p = {0};
    if (!strcmp(q, "Replicate()")) {
        p.kind = AG_REPLICATE;
    } else if (!strcmp(q, "Partial(sum)")) {
        p = AG_P_PARTIAL(AG_PARTIAL_SUM);
    } else if (!strcmp(q, "Partial(avg)")) {
        p = AG_P_PARTIAL(AG_PARTIAL_AVG);
    } else if (skip_prefix(&q, "Partial(")) {
        return ag__err(AG_EINVAL,
                       "ag_placement_parse: unsupported Partial reduce op in '%s' (expected "
                       "Partial(sum) or Partial(avg))",
                       s);
    } else if (skip_prefix(&q, "Shard(")) {
        int d;
        if (!parse_nonneg(&q, &d) || strcmp(q, ")"))
            return ag__err(AG_EINVAL,
                           "ag_placement_parse: expected Shard(dim) with a dim >= 0, got '%s'", s);
        p = AG_P_SHARD(d);
    } else if (skip_prefix(&q, "StridedShard(")) {
        int d, k;
        if (!parse_nonneg(&q, &d) || *q++ != ',' || !parse_nonneg(&q, &k) || strcmp(q, ")"))
            return ag__err(AG_EINVAL,
                           "ag_placement_parse: expected StridedShard(dim, split_factor) with a "
                           "dim >= 0, got '%s'",
                           s);
        if (k < 2)
            return ag__err(AG_EINVAL,
                           "ag_placement_parse: split factor %d in '%s' must be at least 2 (a "
                           "split factor of 1 is Shard(%d))",
                           k, s, d);
        p = ag__shard_p(d, k);
    } else {
        return ag__err(AG_EINVAL,
                       "ag_placement_parse: unknown placement '%s' (expected Replicate(), "
                       "Shard(d), StridedShard(d, k), Partial(sum) or Partial(avg))",
                       s);
    }
    *out = p;
    return 0;
}

bool ag_placement_eq(ag_placement a, ag_placement b) {
    if (a.kind != b.kind)
        return false;
    switch (a.kind) {
    case AG_SHARD:
        return a.dim == b.dim && ag__shard_sf(a) == ag__shard_sf(b);
    case AG_PARTIAL:
        return a.op == b.op;
    default:
        return true;
    }
}

bool ag_shard_divisible(int64_t n, int world, int split_factor) {
    if (world < 1 || n < 0)
        return false;
    int64_t k = split_factor > 1 ? split_factor : 1;
    return n % (k * world) == 0;
}

/* ---- helpers ---- */

ag_placement ag__shard_p(int d, int k) {
    ag_placement p = AG_P_SHARD(d);
    p.split_factor = k > 1 ? k : 0;
    return p;
}

int ag__shard_sf(ag_placement p) {
    return p.split_factor > 1 ? p.split_factor : 1;
}

bool ag__shard_op_is(const ag_shard_ctx *c, const char *name) {
    const char *sch = c->op ? c->op->schema : NULL;
    if (!sch)
        return false;
    size_t n = strlen(name);
    if (strncmp(sch, name, n))
        return false;
    char next = sch[n];
    return next == '(' || (next == '.' && !strchr(name, '.'));
}

double ag__shard_in_bytes(const ag_shard_ctx *c, int i) {
    const ag_tmeta *m = &c->in_meta[i];
    double n = 1;
    for (int d = 0; d < m->ndim; d++)
        n *= (double)m->sizes[d];
    return n * (double)ag_dtype_size(m->dtype);
}

double ag__shard_move_cost(const ag_shard_ctx *c, int i, ag_placement p) {
    if (ag_placement_eq(c->in[i], p) || c->in[i].kind == AG_REPLICATE)
        return 0;
    return ag__shard_in_bytes(c, i);
}

bool ag__shard_fits(const ag_shard_ctx *c, const ag_tmeta *m, ag_placement p) {
    if (p.kind != AG_SHARD)
        return p.kind == AG_REPLICATE || p.kind == AG_PARTIAL;
    if (p.dim < 0 || p.dim >= m->ndim)
        return false;
    return ag_shard_divisible(m->sizes[p.dim], c->world, p.split_factor);
}

/* ---- pointwise ---- */

/* The placement input i must take for the output to be `o` under broadcasting: the matching
 * dim sharded alike, or Replicate() where the input lacks the dim or broadcasts it (size 1). */
static ag_placement pointwise_want(const ag_shard_ctx *c, int i, ag_placement o) {
    if (o.kind != AG_SHARD)
        return AG_P_REPLICATE;
    const ag_tmeta *om = &c->out_meta[0], *im = &c->in_meta[i];
    int d = o.dim - (om->ndim - im->ndim);
    if (d < 0 || (im->sizes[d] == 1 && om->sizes[o.dim] != 1))
        return AG_P_REPLICATE;
    return ag__shard_p(d, o.split_factor);
}

/* The output placement a sharded input i gives, Replicate() when none. */
static ag_placement pointwise_out_of(const ag_shard_ctx *c, int i) {
    ag_placement p = c->in[i];
    if (p.kind != AG_SHARD)
        return AG_P_REPLICATE;
    const ag_tmeta *om = &c->out_meta[0], *im = &c->in_meta[i];
    int d = p.dim + (om->ndim - im->ndim);
    if (p.dim >= im->ndim || d < 0 || d >= om->ndim || im->sizes[p.dim] != om->sizes[d])
        return AG_P_REPLICATE;
    ag_placement o = ag__shard_p(d, p.split_factor);
    return ag__shard_fits(c, om, o) ? o : AG_P_REPLICATE;
}

int ag_shard_rule_pointwise(ag_shard_ctx *c) {
    if (!c)
        return ag__err(AG_EINVAL, "shard_rule_pointwise: c is NULL");
    if (c->noutputs < 1 || !c->out_meta)
        return AG_SHARD_NO_RULE;
    /* Candidates: the output placement each sharded input gives, then Replicate(); the one
     * that moves the fewest bytes wins, the earliest on a tie. */
    ag_placement best = AG_P_REPLICATE;
    double best_cost = -1;
    for (int i = 0; i <= c->ntensor_inputs; i++) {
        ag_placement o = i < c->ntensor_inputs ? pointwise_out_of(c, i) : AG_P_REPLICATE;
        if (i < c->ntensor_inputs && o.kind != AG_SHARD)
            continue;
        double cost = 0;
        for (int j = 0; j < c->ntensor_inputs; j++)
            cost += ag__shard_move_cost(c, j, pointwise_want(c, j, o));
        if (best_cost < 0 || cost < best_cost) {
            best = o;
            best_cost = cost;
        }
    }
    for (int j = 0; j < c->ntensor_inputs; j++)
        c->want[j] = pointwise_want(c, j, best);
    for (int k = 0; k < c->noutputs; k++)
        c->out[k] = best;
    return 0;
}

/* Whether every tensor input is Partial with one reduce op (stored in *op). */
static bool all_partial(const ag_shard_ctx *c, ag_partial_op *op) {
    if (c->ntensor_inputs < 1)
        return false;
    for (int i = 0; i < c->ntensor_inputs; i++)
        if (c->in[i].kind != AG_PARTIAL || c->in[i].op != c->in[0].op)
            return false;
    *op = c->in[0].op;
    return true;
}

/* Whether exactly input `which` (-1: any one) is Partial and every other input Replicate(); the
 * Partial one's index in *idx. */
static bool one_partial(const ag_shard_ctx *c, int which, int *idx) {
    int found = -1;
    for (int i = 0; i < c->ntensor_inputs; i++) {
        if (c->in[i].kind == AG_PARTIAL) {
            if (found >= 0)
                return false;
            found = i;
        } else if (c->in[i].kind != AG_REPLICATE) {
            return false;
        }
    }
    if (found < 0 || (which >= 0 && found != which))
        return false;
    *idx = found;
    return true;
}

int ag_shard_rule_linear_pointwise(ag_shard_ctx *c) {
    if (!c)
        return ag__err(AG_EINVAL, "shard_rule_linear_pointwise: c is NULL");
    if (c->noutputs < 1 || !c->out_meta)
        return AG_SHARD_NO_RULE;
    ag_partial_op op;
    int idx;
    bool keep = false;
    if (ag__shard_op_is(c, "add.Tensor") || ag__shard_op_is(c, "sub.Tensor") ||
        ag__shard_op_is(c, "neg")) {
        /* sum_r (a_r + alpha b_r) = A + alpha B, and the same for the mean. */
        keep = all_partial(c, &op);
    } else if (ag__shard_op_is(c, "add.Scalar") || ag__shard_op_is(c, "sub.Scalar")) {
        /* Adding a constant commutes with the mean of the pieces but not with their sum. */
        keep = all_partial(c, &op) && op == AG_PARTIAL_AVG;
    } else if (ag__shard_op_is(c, "mul.Tensor")) {
        keep = one_partial(c, -1, &idx);
        op = keep ? c->in[idx].op : AG_PARTIAL_SUM;
    } else if (ag__shard_op_is(c, "div.Tensor")) {
        keep = one_partial(c, 0, &idx); /* linear in the numerator only */
        op = keep ? c->in[idx].op : AG_PARTIAL_SUM;
    } else if (ag__shard_op_is(c, "mul.Scalar") || ag__shard_op_is(c, "div.Scalar")) {
        keep = all_partial(c, &op);
    }
    if (!keep)
        return ag_shard_rule_pointwise(c);
    for (int k = 0; k < c->noutputs; k++)
        c->out[k] = AG_P_PARTIAL(op);
    return 0;
}

/* ---- the entry the pass calls ---- */

static void reset(const ag_shard_ctx *c) {
    for (int i = 0; i < c->ntensor_inputs; i++)
        c->want[i] = c->in[i];
    for (int k = 0; k < c->noutputs; k++)
        c->out[k] = AG_P_REPLICATE;
    for (int a = 0; a < c->nargs; a++)
        c->local_args[a] = c->args[a];
}

static const char *op_name(const ag_opdef *def, char *buf, size_t n) {
    const char *s = def->schema ? def->schema : "?";
    size_t len = strcspn(s, "(");
    snprintf(buf, n, "%.*s", (int)(len < n ? len : n - 1), s);
    return buf;
}

int ag_op_shard_rule(const ag_opdef *def, ag_shard_ctx *c) {
    AG__CHECK_NULL("op_shard_rule", def);
    AG__CHECK_NULL("op_shard_rule", c);
    ag_shard_fn fn = def->shard;
    if (!fn && (def->flags & AG_OP_POINTWISE) &&
        !(def->flags & (AG_OP_INPLACE | AG_OP_RANDOM | AG_OP_EFFECTFUL)))
        fn = ag_shard_rule_pointwise;
    if (!fn)
        return AG_SHARD_NO_RULE;
    uint64_t errs = ag__err_count();
    int rc = fn(c);
    char name[96], pb[48];
    if (rc < 0) {
        reset(c);
        if (ag__err_count() == errs)
            return ag__err(rc, "shard rule of %s failed", op_name(def, name, sizeof name));
        return rc;
    }
    if (rc == AG_SHARD_NO_RULE) {
        reset(c);
        return rc;
    }
    if (rc != 0) {
        reset(c);
        return ag__err(AG_EINVAL, "shard rule of %s returned %d (expected 0 or AG_SHARD_NO_RULE)",
                       op_name(def, name, sizeof name), rc);
    }
    for (int i = 0; i < c->ntensor_inputs; i++) {
        if (!ag__shard_fits(c, &c->in_meta[i], c->want[i])) {
            char sz[96];
            ag__fmt_sizes(sz, sizeof sz, c->in_meta[i].ndim, c->in_meta[i].sizes);
            ag_placement_str(c->want[i], pb, sizeof pb);
            reset(c);
            return ag__err(AG_EINVAL,
                           "shard rule of %s asked for %s of input %d of shape %s on %d ranks "
                           "(out of range or uneven)",
                           op_name(def, name, sizeof name), pb, i, sz, c->world);
        }
    }
    for (int k = 0; k < c->noutputs; k++) {
        if (!ag__shard_fits(c, &c->out_meta[k], c->out[k])) {
            char sz[96];
            ag__fmt_sizes(sz, sizeof sz, c->out_meta[k].ndim, c->out_meta[k].sizes);
            ag_placement_str(c->out[k], pb, sizeof pb);
            reset(c);
            return ag__err(AG_EINVAL,
                           "shard rule of %s gave %s for output %d of shape %s on %d ranks (out "
                           "of range or uneven)",
                           op_name(def, name, sizeof name), pb, k, sz, c->world);
        }
    }
    return 0;
}
