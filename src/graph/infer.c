/* Meta inference for graph nodes: the op table's meta function run on data-less tensor shells
 * built from the argument nodes' vals. Used when a node is created and by the verifier and the
 * meta re-inference pass, so a graph's vals always mean what the ops compute. */
#include "graph_internal.h"

#include <math.h>

typedef struct shells {
    ag_tensor t[AG_MAX_ARGS * 8];
    ag_storage s[AG_MAX_ARGS * 8];
    ag_tensor *lists[AG_MAX_ARGS][64];
    int used;
} shells;

static ag_tensor *shell_of(shells *sh, const ag_node *n) {
    if (!n || n->nvals != 1 || sh->used >= (int)(sizeof sh->t / sizeof sh->t[0]))
        return NULL;
    ag_tensor *t = &sh->t[sh->used];
    ag_storage *s = &sh->s[sh->used++];
    memset(t, 0, sizeof *t);
    memset(s, 0, sizeof *s);
    const ag_tmeta *m = &n->vals[0];
    t->refcount = 1;
    t->dtype = m->dtype;
    t->ndim = m->ndim;
    memcpy(t->sizes, m->sizes, sizeof t->sizes);
    memcpy(t->strides, m->strides, sizeof t->strides);
    t->offset = m->offset;
    s->refcount = 1;
    s->nbytes = SIZE_MAX / 4; /* unknown storage extent: never the reason a meta check fails */
    t->storage = s;
    return t;
}

static int to_args(const ag_op *op, const ag_garg *args, int nargs, ag_arg *out, shells *sh) {
    for (int i = 0; i < nargs; i++) {
        const ag_garg *g = &args[i];
        switch (g->kind) {
        case AG_GA_NONE:
            out[i] = AG_A_NONE;
            break;
        case AG_GA_NODE:
            out[i] = AG_A_T(shell_of(sh, g->u.node));
            if (!out[i].u.t)
                return ag__err(AG_EINVAL, "%s: argument %d (%s) is not a single tensor value",
                               ag_op_name(op), i, g->u.node ? g->u.node->name : "None");
            break;
        case AG_GA_NODES:
            if (g->n > 64)
                return ag__err(AG_EINVAL, "%s: tensor list of %d elements (at most 64)", ag_op_name(op), g->n);
            for (int k = 0; k < g->n; k++) {
                sh->lists[i][k] = g->u.nodes[k] ? shell_of(sh, g->u.nodes[k]) : NULL;
                if (g->u.nodes[k] && !sh->lists[i][k])
                    return ag__err(AG_EINVAL, "%s: element %d of argument %d is not a tensor value",
                                   ag_op_name(op), k, i);
            }
            out[i] = AG_A_TS(sh->lists[i], g->n);
            break;
        case AG_GA_INT:
            out[i] = AG_A_I(g->u.i);
            break;
        case AG_GA_FLOAT:
            out[i] = AG_A_F(g->u.f);
            break;
        case AG_GA_BOOL:
            out[i] = AG_A_B(g->u.b);
            break;
        case AG_GA_INTS:
            out[i] = AG_A_INTS(g->u.ints, g->n);
            break;
        case AG_GA_DTYPE:
            out[i] = AG_A_DT(g->u.dt);
            break;
        case AG_GA_STR:
            out[i] = AG_A_S(g->u.s);
            break;
        }
    }
    return 0;
}

int ag__infer_meta(const ag_op *op, const ag_garg *args, int nargs, ag_tmeta *vals, int *nvals) {
    if (nargs > AG_MAX_ARGS)
        return ag__err(AG_EINVAL, "%s: %d arguments", ag_op_name(op), nargs);
    shells *sh = ag__malloc(sizeof *sh);
    if (!sh)
        return AG_ENOMEM;
    sh->used = 0;
    ag_arg a[AG_MAX_ARGS], full[AG_MAX_ARGS];
    int rc = to_args(op, args, nargs, a, sh);
    if (rc == 0)
        rc = ag__op_check_args(op, a, nargs, full);
    if (rc == 0) {
        memset(vals, 0, sizeof(ag_tmeta) * AG_MAX_OUTPUTS);
        rc = ag_op_def(op)->meta(full, vals);
        if (rc >= 0) {
            *nvals = ag_op_noutputs(op) < 0 ? rc : ag_op_noutputs(op);
            rc = ag__check_out_metas(ag_op_name(op), vals, *nvals);
        }
    }
    ag__free(sh);
    return rc;
}

int ag__node_cost(const ag_node *n, ag_cost *c) {
    c->flops = c->bytes = 0;
    if (n->kind != AG_NODE_CALL)
        return 0;
    shells *sh = ag__malloc(sizeof *sh);
    if (!sh)
        return AG_ENOMEM;
    sh->used = 0;
    ag_arg a[AG_MAX_ARGS];
    int rc = to_args(n->op, n->args, n->nargs, a, sh);
    if (rc == 0)
        rc = ag_op_cost(n->op, a, n->nargs, c);
    ag__free(sh);
    return rc;
}

static bool float_eq(double a, double b) { return a == b || (isnan(a) && isnan(b)); }

bool ag__garg_is_default(const ag_op *op, int i, const ag_garg *g) {
    const ag_schema_arg *sa = ag_op_arg(op, i);
    if (!sa || !sa->has_default)
        return false;
    const ag_arg *d = &sa->def;
    switch (g->kind) {
    case AG_GA_NONE:
        return d->kind == AG_ARG_NONE;
    case AG_GA_INT:
        return (d->kind == AG_ARG_INT && d->u.i == g->u.i) ||
               (d->kind == AG_ARG_FLOAT && d->u.f == (double)g->u.i);
    case AG_GA_FLOAT:
        return (d->kind == AG_ARG_FLOAT && float_eq(d->u.f, g->u.f)) ||
               (d->kind == AG_ARG_INT && (double)d->u.i == g->u.f);
    case AG_GA_BOOL:
        return d->kind == AG_ARG_BOOL && d->u.b == g->u.b;
    case AG_GA_INTS:
        return d->kind == AG_ARG_INTS && d->n == g->n &&
               (g->n == 0 || !memcmp(d->u.ints, g->u.ints, sizeof(int64_t) * (size_t)g->n));
    case AG_GA_STR:
        return d->kind == AG_ARG_STR && !strcmp(d->u.s, g->u.s);
    case AG_GA_DTYPE:
        return d->kind == AG_ARG_DTYPE && d->u.dt == g->u.dt;
    default:
        return false;
    }
}
