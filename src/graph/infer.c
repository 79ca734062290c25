/* Meta inference for graph nodes: the op table's meta function run on data-less tensor shells
 * built from the argument nodes' vals. Used when a node is created and by the verifier and the
 * meta re-inference pass, so a graph's vals always mean what the ops compute. */
#include "graph_internal.h"

#include <math.h>

ag_arg ag__garg_const_arg(const ag_garg *a) {
    switch (a->kind) {
    case AG_GA_INT:
        return AG_A_I(a->u.i);
    case AG_GA_FLOAT:
        return AG_A_F(a->u.f);
    case AG_GA_BOOL:
        return AG_A_B(a->u.b);
    case AG_GA_INTS:
        return AG_A_INTS(a->u.ints, a->n);
    case AG_GA_DTYPE:
        return AG_A_DT(a->u.dt);
    case AG_GA_STR:
        return AG_A_S(a->u.s);
    default:
        return AG_A_NONE;
    }
}

/* Tensor shells for one call's arguments, sized for its node references: on the stack for the
 * usual handful, else one heap block (a call runs for every node created, verified and costed,
 * so a fixed worst-case block per call would be tens of kB of allocator traffic each time). */
enum { SHELLS_MAX = AG_MAX_ARGS * 8, SHELLS_STACK = 8 };

typedef struct shells {
    ag_tensor *t;
    ag_storage *s;
    ag_tensor **lists; /* the tensor lists' elements, list after list */
    int used, cap, nlist;
    ag_tensor t_stack[SHELLS_STACK];
    ag_storage s_stack[SHELLS_STACK];
    ag_tensor *l_stack[SHELLS_STACK];
    void *heap;
} shells;

static int shells_init(shells *sh, const ag_garg *args, int nargs) {
    int refs = 0, listed = 0;
    for (int i = 0; i < nargs; i++)
        if (args[i].kind == AG_GA_NODE)
            refs++;
        else if ((args[i].kind == AG_GA_NODES || args[i].kind == AG_GA_TUPLE) && args[i].n > 0 &&
                 args[i].n <= 64) {
            refs += args[i].n;
            listed += args[i].n;
        }
    sh->used = sh->nlist = 0;
    sh->cap = refs < SHELLS_MAX ? refs : SHELLS_MAX;
    sh->heap = NULL;
    if (sh->cap <= SHELLS_STACK && listed <= SHELLS_STACK) {
        sh->t = sh->t_stack;
        sh->s = sh->s_stack;
        sh->lists = sh->l_stack;
        return 0;
    }
    size_t nt = (size_t)sh->cap, nl = (size_t)listed;
    sh->heap =
        ag__malloc(nt * (sizeof(ag_tensor) + sizeof(ag_storage)) + nl * sizeof(ag_tensor *) + 1);
    if (!sh->heap)
        return AG_ENOMEM;
    sh->t = sh->heap;
    sh->s = (ag_storage *)(void *)(sh->t + nt);
    sh->lists = (ag_tensor **)(void *)(sh->s + nt);
    return 0;
}

static ag_tensor *shell_of(shells *sh, const ag_node *n) {
    if (!n || n->nvals != 1 || sh->used >= sh->cap)
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
                return ag__err(AG_EINVAL, "%s: tensor list of %d elements (at most 64)",
                               ag_op_name(op), g->n);
            ag_tensor **list = sh->lists + sh->nlist;
            sh->nlist += g->n;
            for (int k = 0; k < g->n; k++) {
                list[k] = g->u.nodes[k] ? shell_of(sh, g->u.nodes[k]) : NULL;
                if (g->u.nodes[k] && !list[k])
                    return ag__err(AG_EINVAL, "%s: element %d of argument %d is not a tensor value",
                                   ag_op_name(op), k, i);
            }
            out[i] = AG_A_TS(list, g->n);
            break;
        case AG_GA_TUPLE:
        case AG_GA_DICT: /* the higher-order ops' only, which have their own inference */
            return ag__err(AG_EINVAL, "%s: argument %d is %s; it takes none", ag_op_name(op), i,
                           ag__garg_kind_name(g->kind));
        default: /* a constant: int, float, bool, ints, dtype, str */
            out[i] = ag__garg_const_arg(g);
            break;
        }
    }
    return 0;
}

/* A subgraph get_attr is an argument of invoke_subgraph only, and invoke_subgraph's tuple is
 * read through getitem. */
static int check_node_arg(const ag_op *op, int i, const ag_node *x) {
    if (!x)
        return 0;
    if (x->sub)
        return ag__err(AG_EINVAL,
                       "%s: argument %d (%%%s) is a subgraph; only invoke_subgraph "
                       "takes one",
                       ag_op_name(op), i, x->name);
    if (x->kind == AG_NODE_CALL && x->op && (ag_op_def(x->op)->flags & AG_OP_SUBGRAPH))
        return ag__err(AG_EINVAL, "%s: argument %d (%%%s) is a tuple; read it through getitem",
                       ag_op_name(op), i, x->name);
    return 0;
}

int ag__infer_meta(const ag_op *op, const ag_garg *args, int nargs, ag_tmeta *vals, int *nvals) {
    if (nargs > AG_MAX_ARGS)
        return ag__err(AG_EINVAL, "%s: %d arguments", ag_op_name(op), nargs);
    /* The hook for higher-order ops: their outputs are their subgraph's (subgraph.c). */
    if (ag_op_def(op)->flags & AG_OP_SUBGRAPH)
        return ag__subgraph_infer(op, args, nargs, vals, nvals);
    for (int i = 0; i < nargs; i++) {
        int rc = 0;
        for (int k = 0, cnt = ag__garg_nrefs(&args[i]); k < cnt && rc == 0; k++)
            rc = check_node_arg(op, i, ag__garg_ref(&args[i], k));
        if (rc)
            return rc;
    }
    shells shv, *sh = &shv;
    if (shells_init(sh, args, nargs))
        return AG_ENOMEM;
    ag_arg a[AG_MAX_ARGS], full[AG_MAX_ARGS];
    int rc = to_args(op, args, nargs, a, sh);
    if (rc == 0)
        rc = ag__op_check_args(op, a, nargs, full);
    if (rc == 0) {
        rc = ag__op_run_meta(op, full, vals);
        if (rc >= 0) {
            *nvals = ag_op_noutputs(op) < 0 ? rc : ag_op_noutputs(op);
            rc = ag__check_out_metas(ag_op_name(op), vals, *nvals);
        }
    }
    ag__free(sh->heap);
    return rc;
}

int ag__node_cost(const ag_node *n, ag_cost *c) {
    c->flops = c->bytes = 0;
    if (n->kind != AG_NODE_CALL)
        return 0;
    const ag_graph *sub = ag__call_subgraph(n);
    if (sub) { /* a call of a subgraph costs what one run of its nodes costs */
        for (const ag_node *x = sub->first; x; x = x->next) {
            ag_cost xc;
            int rc = ag__node_cost(x, &xc);
            if (rc)
                return rc;
            c->flops += xc.flops;
            c->bytes += xc.bytes;
        }
        return 0;
    }
    if (n->op && (ag_op_def(n->op)->flags & AG_OP_SUBGRAPH))
        return 0;
    shells shv, *sh = &shv;
    if (shells_init(sh, n->args, n->nargs))
        return AG_ENOMEM;
    ag_arg a[AG_MAX_ARGS];
    int rc = to_args(n->op, n->args, n->nargs, a, sh);
    if (rc == 0)
        rc = ag_op_cost(n->op, a, n->nargs, c);
    ag__free(sh->heap);
    return rc;
}

static bool float_eq(double a, double b) {
    return a == b || (isnan(a) && isnan(b));
}

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
