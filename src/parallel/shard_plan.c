/* Sharding plans (a placement per parameter, buffer, user input and user output, plus the
 * communication options), the world's mesh, the placements nodes carry, and the summary of a
 * rank's sharded joint.
 *
 * In: descriptors and placements from a user or a strategy (strategies.c); a sharded joint for
 * the summary. Out: the plan ag_shard_joint reads (shard_joint.c); the summary's byte counts. */
#include "shard_internal.h"
#include "../core/strmap.h"

#include <stdarg.h>
#include <stdio.h>

int ag__shard_err(int code, const char *fmt, ...) {
    char prev[1024], head[1024];
    snprintf(prev, sizeof prev, "%s", ag_last_error());
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(head, sizeof head, fmt, ap);
    va_end(ap);
    return ag__err(code, "%s: %s", head, prev);
}

ag_shard_plan *ag_shard_plan_new(void) {
    ag_shard_plan *p = ag__calloc(1, sizeof *p);
    if (p)
        snprintf(p->strategy, sizeof p->strategy, "custom");
    return p;
}

void ag_shard_plan_free(ag_shard_plan *p) {
    if (!p)
        return;
    for (int64_t i = 0; i < p->n; i++)
        ag_desc_release(p->e[i].desc);
    ag__free(p->e);
    ag__free(p);
}

void ag__shard_plan_set_strategy(ag_shard_plan *p, const char *name) {
    snprintf(p->strategy, sizeof p->strategy, "%s", name);
}

const char *ag_shard_plan_strategy(const ag_shard_plan *p) {
    return p ? p->strategy : NULL;
}

void ag_shard_plan_set_bucket_bytes(ag_shard_plan *p, int64_t bytes) {
    if (p)
        p->bucket_bytes = bytes;
}

void ag_shard_plan_set_no_overlap(ag_shard_plan *p, bool no_overlap) {
    if (p)
        p->no_overlap = no_overlap;
}

void ag_shard_plan_set_gather_params(ag_shard_plan *p, bool gather) {
    if (p)
        p->gather_params = gather;
}

static bool plannable(const ag_desc *d) {
    switch (ag_desc_kind_of(d)) {
    case AG_DESC_PARAM:
    case AG_DESC_BUFFER:
    case AG_DESC_PLAIN_INPUT:
    case AG_DESC_PLAIN_OUTPUT:
        return true;
    default:
        return false;
    }
}

static int check_placement(const char *fn, const ag_desc *d, ag_placement pl) {
    char ds[256];
    ag_desc_repr(d, ds, sizeof ds);
    if (pl.kind == AG_SHARD && (pl.dim < 0 || pl.split_factor < 0))
        return ag__err(AG_EINVAL,
                       "%s: %s: a Shard needs dim >= 0 and split_factor >= 0 (got %d, %d)", fn, ds,
                       pl.dim, pl.split_factor);
    if (pl.kind == AG_PARTIAL && pl.op != AG_PARTIAL_SUM && pl.op != AG_PARTIAL_AVG)
        return ag__err(AG_EINVAL, "%s: %s: Partial reduce op %d is not sum or avg", fn, ds,
                       (int)pl.op);
    if (pl.kind != AG_REPLICATE && pl.kind != AG_SHARD && pl.kind != AG_PARTIAL)
        return ag__err(AG_EINVAL, "%s: %s: placement kind %d is not Replicate, Shard or Partial",
                       fn, ds, (int)pl.kind);
    if (pl.kind == AG_PARTIAL && ag_desc_is_input(d))
        return ag__err(AG_EINVAL,
                       "%s: %s: an input is placed Shard() or Replicate(), not Partial()", fn, ds);
    return 0;
}

int ag_shard_plan_set(ag_shard_plan *p, const ag_desc *d, ag_placement pl) {
    AG__CHECK_NULL("shard_plan_set", p);
    AG__CHECK_NULL("shard_plan_set", d);
    if (!plannable(d)) {
        char ds[256];
        ag_desc_repr(d, ds, sizeof ds);
        return ag__err(AG_EINVAL,
                       "shard_plan_set: %s: a plan places ParamAOTInput, BufferAOTInput, "
                       "PlainAOTInput and PlainAOTOutput only",
                       ds);
    }
    int rc = check_placement("shard_plan_set", d, pl);
    if (rc)
        return rc;
    if (pl.kind == AG_SHARD && pl.split_factor == 1)
        pl.split_factor = 0;
    for (int64_t i = 0; i < p->n; i++)
        if (ag_desc_equal(p->e[i].desc, d)) {
            p->e[i].pl = pl;
            return 0;
        }
    if (p->n == p->cap && ag__grow((void **)&p->e, &p->cap, p->n + 1, sizeof *p->e))
        return AG_ENOMEM;
    p->e[p->n].desc = ag_desc_retain(d);
    p->e[p->n].pl = pl;
    p->n++;
    return 0;
}

static int set_made(ag_shard_plan *p, ag_desc *d, ag_placement pl) {
    if (!d)
        return ag_last_status() ? ag_last_status() : AG_ENOMEM;
    int rc = ag_shard_plan_set(p, d, pl);
    ag_desc_release(d);
    return rc;
}

int ag_shard_plan_set_param(ag_shard_plan *p, const char *fqn, ag_placement pl) {
    AG__CHECK_NULL("shard_plan_set_param", p);
    AG__CHECK_NULL("shard_plan_set_param", fqn);
    return set_made(p, ag_desc_param(fqn), pl);
}

int ag_shard_plan_set_input(ag_shard_plan *p, int idx, ag_placement pl) {
    AG__CHECK_NULL("shard_plan_set_input", p);
    if (idx < 0)
        return ag__err(AG_EINVAL, "shard_plan_set_input: index %d is negative", idx);
    return set_made(p, ag_desc_plain_input(idx), pl);
}

int ag_shard_plan_set_output(ag_shard_plan *p, int idx, ag_placement pl) {
    AG__CHECK_NULL("shard_plan_set_output", p);
    if (idx < 0)
        return ag__err(AG_EINVAL, "shard_plan_set_output: index %d is negative", idx);
    return set_made(p, ag_desc_plain_output(idx), pl);
}

bool ag_shard_plan_get(const ag_shard_plan *p, const ag_desc *d, ag_placement *out) {
    if (out)
        *out = AG_P_REPLICATE;
    if (!p || !d)
        return false;
    for (int64_t i = 0; i < p->n; i++)
        if (ag_desc_equal(p->e[i].desc, d)) {
            if (out)
                *out = p->e[i].pl;
            return true;
        }
    /* set_param names a buffer too: a BufferAOTInput takes the entry of its FQN as a param. */
    if (ag_desc_kind_of(d) == AG_DESC_BUFFER) {
        ag_desc *pd = ag_desc_param(ag_desc_target(d));
        bool found = false;
        for (int64_t i = 0; pd && i < p->n && !found; i++)
            if (ag_desc_equal(p->e[i].desc, pd)) {
                if (out)
                    *out = p->e[i].pl;
                found = true;
            }
        ag_desc_release(pd);
        return found;
    }
    return false;
}

/* ---- the mesh ---- */

int ag_mesh_world(ag_mesh *out) {
    AG__CHECK_NULL("mesh_world", out);
    ag_group *w = ag_dist_world();
    if (!w)
        return ag__err(AG_ESTATE, "mesh_world: the world is not initialized (call ag_dist_init "
                                  "first)");
    out->size = ag_group_size(w);
    out->rank = ag_group_rank(w);
    out->group = ag_group_name(w);
    return 0;
}

/* ---- node helpers ---- */

bool ag__node_is_op(const ag_node *n, const char *name) {
    return n && ag_node_kind_of(n) == AG_NODE_CALL && !strcmp(ag_op_name(ag_node_op(n)), name);
}

bool ag__node_is_collective(const ag_node *n) {
    return n && ag_node_kind_of(n) == AG_NODE_CALL &&
           (ag_op_def(ag_node_op(n))->flags & AG_OP_COLLECTIVE);
}

int ag__node_set_placement(ag_node *n, ag_placement pl) {
    char buf[64];
    ag_placement_str(pl, buf, sizeof buf);
    return ag_node_meta_set(n, "placement", (ag_mval){.kind = AG_MV_STR, .u.s = buf});
}

ag_placement ag_node_placement(const ag_node *n) {
    ag_placement pl = AG_P_REPLICATE;
    ag_mval v = ag_node_meta_get(n, "placement");
    if (v.kind == AG_MV_STR && ag_placement_parse(v.u.s, &pl))
        pl = AG_P_REPLICATE;
    return pl;
}

/* ---- the summary ---- */

static int64_t val_bytes(const ag_tmeta *m) {
    int64_t n = 1;
    for (int d = 0; d < m->ndim; d++)
        n *= m->sizes[d];
    return n * (int64_t)ag_dtype_size(m->dtype);
}

/* The world size a collective runs on: its group_size argument, else the meta the pass set. */
static int coll_world(const ag_node *n) {
    for (int i = 0; i < ag_node_nargs(n); i++) {
        const ag_schema_arg *sa = ag_op_arg(ag_node_op(n), i);
        if (sa && !strcmp(sa->name, "group_size") && ag_node_arg(n, i)->kind == AG_GA_INT)
            return (int)ag_node_arg(n, i)->u.i;
    }
    ag_mval v = ag_node_meta_get(n, "group_size");
    return v.kind == AG_MV_INT ? (int)v.u.i : 1;
}

static int64_t node_comm_bytes(const ag_node *n) {
    if (ag_node_kind_of(n) != AG_NODE_CALL || !ag__node_is_collective(n) ||
        ag__node_is_op(n, AG__C10D_WAIT))
        return 0;
    const char *op = ag_op_name(ag_node_op(n));
    ag_node *in = ag_node_arg_node(n, 0);
    const ag_tmeta *m =
        ag__node_is_op(n, AG__C10D_ALL_GATHER) || !in ? ag_node_val(n, 0) : ag_node_val(in, 0);
    double b = ag_comm_bytes(op, (double)val_bytes(m), coll_world(n));
    return b > 0 ? (int64_t)b : 0;
}

int64_t ag__graph_comm_bytes(const ag_graph *g) {
    int64_t b = 0;
    for (ag_node *n = ag_graph_first(g); n; n = ag_node_next(n))
        b += node_comm_bytes(n);
    return b;
}

/* "op xN, op2 xM" of the counted ops into buf (truncated with "..."). */
static void count_list(char *buf, size_t cap, const char *const *ops, const int *count, int n) {
    size_t len = 0;
    buf[0] = 0;
    for (int i = 0; i < n; i++) {
        char item[128];
        int w = snprintf(item, sizeof item, "%s%s x%d", i ? ", " : "", ops[i], count[i]);
        if (len + (size_t)w + 4 >= cap) {
            snprintf(buf + len, cap - len, "...");
            break;
        }
        memcpy(buf + len, item, (size_t)w + 1);
        len += (size_t)w;
    }
}

/* Counts op under ops[0..*n) (a new entry when it is not there and there is room). */
static void count_op(const char **ops, int *count, int *n, const char *op) {
    int i = 0;
    while (i < *n && strcmp(ops[i], op))
        i++;
    if (i == *n && *n < 64) {
        ops[*n] = op;
        count[(*n)++] = 0;
    }
    if (i < *n)
        count[i]++;
}

int ag_shard_summary_get(const ag_joint *sharded, ag_shard_summary *out) {
    AG__CHECK_NULL("shard_summary_get", sharded);
    AG__CHECK_NULL("shard_summary_get", out);
    ag_shard_summary s;
    memset(&s, 0, sizeof s);
    const char *fops[64], *dops[64];
    int fcount[64], dcount[64], nf = 0, nd = 0;
    /* Decomposed nodes by their original node's name: the first piece of each counts. */
    ag__strmap seen = {0};
    int rc = 0;
    for (ag_node *n = ag_graph_first(ag_joint_graph(sharded)); n && !rc; n = ag_node_next(n)) {
        ag_node_kind k = ag_node_kind_of(n);
        if (k == AG_NODE_PLACEHOLDER) {
            const ag_desc *d = ag_node_desc(n);
            if (ag_desc_is_param(d) || ag_desc_is_buffer(d))
                s.param_bytes += val_bytes(ag_node_val(n, 0));
            if (ag_desc_is_param(d))
                s.optim_bytes += 2 * val_bytes(ag_node_val(n, 0));
            continue;
        }
        if (k != AG_NODE_CALL)
            continue;
        if (ag__node_is_collective(n) && !ag__node_is_op(n, AG__C10D_WAIT)) {
            /* A gather tagged to be recomputed (fsdp's) runs again in the backward. */
            int times = ag_node_recompute(n) == AG_MUST_RECOMPUTE ? 2 : 1;
            s.comm_bytes += times * node_comm_bytes(n);
            s.ncollectives += times;
        }
        ag_mval fb = ag_node_meta_get(n, "shard_fallback");
        if (fb.kind == AG_MV_BOOL && fb.u.b) {
            s.nfallback++;
            count_op(fops, fcount, &nf, ag_op_name(ag_node_op(n)));
        }
        ag_mval dop = ag_node_meta_get(n, "shard_decomposed");
        ag_mval dnode = ag_node_meta_get(n, "shard_decomposed_node");
        if (dop.kind == AG_MV_STR && dnode.kind == AG_MV_STR && !ag__strmap_has(&seen, dnode.u.s)) {
            if ((rc = ag__strmap_put(&seen, dnode.u.s, (void *)1)))
                break;
            s.ndecomposed++;
            count_op(dops, dcount, &nd, dop.u.s);
        }
    }
    ag__strmap_free(&seen);
    if (rc)
        return rc;
    count_list(s.fallback_ops, sizeof s.fallback_ops, fops, fcount, nf);
    count_list(s.decomposed_ops, sizeof s.decomposed_ops, dops, dcount, nd);
    *out = s;
    return 0;
}
