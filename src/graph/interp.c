/* The graph interpreter (ag_graph_run): the reference executor that every later stage is
 * checked against.
 *
 * In: a graph and one real tensor per placeholder. Out: the tensors the output node lists.
 * Each node runs in graph order: a placeholder takes its input (after a dtype/shape check
 * against its val), a get_attr its constant, a call goes through the dispatcher (ag_op_call:
 * so autograd records when inputs require grad, and a tracer, when active, sees every call),
 * a getitem picks one output of a multi-output call, and invoke_subgraph runs its subgraph
 * (ag_graph_run on the operands). A node's tensors are released as soon as
 * the last node reading them has run, so memory stays bounded by the live values rather than
 * the graph's length. */
#include "graph_internal.h"

#include <stdio.h>

typedef struct run_state {
    const ag_graph *g;
    int64_t nnodes;
    int64_t *first;     /* per node (by index): its first slot in `slots` */
    int64_t *remaining; /* per node: references still to be read */
    ag_tensor **slots;  /* one per output of each node; NULL when not (or no longer) live */
    int64_t nslots;
    ag_tensor **lists; /* scratch for Tensor[] arguments */
    int64_t lists_cap;
} run_state;

static int nslots_of(const ag_node *n) {
    return n->kind == AG_NODE_CALL ? (n->nvals > 0 ? n->nvals : 1) : 1;
}

static void release_node(run_state *st, const ag_node *n) {
    int64_t f = st->first[n->index];
    for (int k = 0; k < nslots_of(n); k++) {
        ag_tensor_free(st->slots[f + k]);
        st->slots[f + k] = NULL;
    }
}

static void state_free(run_state *st) {
    if (st->slots)
        for (int64_t i = 0; i < st->nslots; i++)
            ag_tensor_free(st->slots[i]);
    ag__free(st->slots);
    ag__free(st->first);
    ag__free(st->remaining);
    ag__free(st->lists);
}

/* Counts every reference once per occurrence (a node used twice by one user is read twice),
 * sizes the slot array and the Tensor[] scratch, and checks that each argument node is defined
 * earlier in this graph (a cheap guard; ag_graph_verify is the full check). */
static int state_init(run_state *st, const ag_graph *g) {
    memset(st, 0, sizeof *st);
    st->g = g;
    if (g->first)
        (void)ag_node_index(g->first); /* refreshes every node's index */
    st->nnodes = g->count;
    int64_t n = st->nnodes ? st->nnodes : 1;
    st->first = ag__malloc(sizeof *st->first * (size_t)n);
    st->remaining = ag__calloc((size_t)n, sizeof *st->remaining);
    if (!st->first || !st->remaining)
        return AG_ENOMEM;
    int64_t lists = 0;
    for (const ag_node *u = g->first; u; u = u->next) {
        st->first[u->index] = st->nslots;
        st->nslots += nslots_of(u);
        int64_t in_lists = 0;
        for (int i = 0; i < u->nargs; i++) {
            const ag_garg *a = &u->args[i];
            int cnt = ag__garg_nrefs(a);
            if (a->kind == AG_GA_NODES || a->kind == AG_GA_TUPLE)
                in_lists += a->n;
            for (int k = 0; k < cnt; k++) {
                const ag_node *d = ag__garg_ref(a, k);
                if (!d)
                    continue;
                if (d->graph != g || d->index >= u->index)
                    return ag__err(AG_EINVAL, "run: %%%s uses %%%s before it is defined", u->name,
                                   d->name);
                st->remaining[d->index]++;
            }
        }
        if (in_lists > lists)
            lists = in_lists;
    }
    st->slots = ag__calloc((size_t)(st->nslots ? st->nslots : 1), sizeof *st->slots);
    st->lists = ag__malloc(sizeof *st->lists * (size_t)(lists ? lists : 1));
    if (!st->slots || !st->lists)
        return AG_ENOMEM;
    st->lists_cap = lists;
    return 0;
}

/* The tensor a node argument reads. */
static ag_tensor *value_of(run_state *st, const ag_node *user, const ag_node *d) {
    if (d->kind == AG_NODE_CALL && d->nvals > 1) {
        ag__err(AG_EINVAL, "run: %%%s: reads %%%s, which has %d outputs (use getitem)", user->name,
                d->name, d->nvals);
        return NULL;
    }
    ag_tensor *t = st->slots[st->first[d->index]];
    if (!t)
        ag__err(AG_EINVAL, "run: %%%s: reads %%%s, which has no value", user->name, d->name);
    return t;
}

/* Marks one read of each argument node; releases those read for the last time. */
static void consume_args(run_state *st, const ag_node *u) {
    for (int i = 0; i < u->nargs; i++) {
        const ag_garg *a = &u->args[i];
        int cnt = ag__garg_nrefs(a);
        for (int k = 0; k < cnt; k++) {
            const ag_node *d = ag__garg_ref(a, k);
            if (d && --st->remaining[d->index] == 0)
                release_node(st, d);
        }
    }
}

static bool shape_matches(const ag_tensor *t, const ag_tmeta *m) {
    if (t->dtype != m->dtype || t->ndim != m->ndim)
        return false;
    for (int d = 0; d < m->ndim; d++)
        if (t->sizes[d] != m->sizes[d])
            return false;
    return true;
}

static int run_placeholder(run_state *st, const ag_node *n, int idx, ag_tensor *in) {
    if (!in)
        return ag__err(AG_EINVAL, "run: input %d (%%%s) is NULL", idx, n->name);
    if (n->nvals == 1 && !shape_matches(in, &n->vals[0])) {
        char got[128], want[128];
        ag_tensor_meta_str(in, got, sizeof got);
        char sz[112];
        ag__fmt_sizes(sz, sizeof sz, n->vals[0].ndim, n->vals[0].sizes);
        snprintf(want, sizeof want, "%s%s", ag_dtype_short(n->vals[0].dtype), sz);
        return ag__err(AG_EINVAL, "run: input %d (%%%s) is %s but the placeholder expects %s", idx,
                       n->name, got, want);
    }
    st->slots[st->first[n->index]] = ag_tensor_keep(in);
    return 0;
}

/* A higher-order call's outputs (rc of them, kept references, or rc < 0 with the error set)
 * into n's slots, or the error named after n. */
static int take_call_outputs(run_state *st, const ag_node *n, ag_tensor **outs, int rc) {
    if (rc < 0) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", ag_last_error());
        return ag__err(rc, "run: %%%s: %s", n->name, msg);
    }
    if (rc != n->nvals) {
        for (int i = 0; i < rc; i++)
            ag_tensor_free(outs[i]);
        return ag__err(AG_EINVAL, "run: %%%s: %d output(s), the graph expects %d", n->name, rc,
                       n->nvals);
    }
    int64_t f = st->first[n->index];
    for (int i = 0; i < rc; i++)
        st->slots[f + i] = outs[i];
    return 0;
}

/* invoke_subgraph: runs the subgraph on the operands (argument 2). */
static int run_subgraph_call(run_state *st, const ag_node *n, const ag_graph *sub) {
    const ag_garg *a = &n->args[2];
    ag_tensor **v = st->lists;
    for (int k = 0; k < a->n; k++) {
        v[k] = a->u.nodes[k] ? value_of(st, n, a->u.nodes[k]) : NULL;
        if (!v[k])
            return a->u.nodes[k] ? ag_last_status()
                                 : ag__err(AG_EINVAL, "run: %%%s: operand %d is None", n->name, k);
    }
    ag_tensor *outs[AG_MAX_OUTPUTS] = {0};
    ag_scope_begin();
    int rc = ag_graph_run(sub, v, a->n, outs, AG_MAX_OUTPUTS);
    for (int i = 0; i < rc; i++)
        ag_tensor_keep(outs[i]);
    ag_scope_end();
    return take_call_outputs(st, n, outs, rc);
}

static ag_tensor *flex_value(void *ud, const ag_node *user, const ag_node *x) {
    return value_of(ud, user, x);
}

/* flex_attention's higher-order ops (flex_hop.c). */
static int run_flex_call(run_state *st, const ag_node *n) {
    ag_tensor *outs[AG_MAX_OUTPUTS] = {0};
    ag_scope_begin();
    int rc = ag__flex_run(n, flex_value, st, outs);
    for (int i = 0; i < rc; i++)
        ag_tensor_keep(outs[i]);
    ag_scope_end();
    return take_call_outputs(st, n, outs, rc);
}

static int run_call(run_state *st, const ag_node *n) {
    const ag_graph *sub = ag__call_subgraph(n);
    if (sub)
        return run_subgraph_call(st, n, sub);
    if (ag__op_is_flex(n->op))
        return run_flex_call(st, n);
    ag_arg args[AG_MAX_ARGS];
    int64_t used = 0;
    for (int i = 0; i < n->nargs; i++) {
        const ag_garg *a = &n->args[i];
        switch (a->kind) {
        case AG_GA_NONE:
            args[i] = AG_A_NONE;
            break;
        case AG_GA_NODE:
            if (!a->u.node) {
                args[i] = AG_A_NONE;
                break;
            }
            args[i] = AG_A_T(value_of(st, n, a->u.node));
            if (!args[i].u.t)
                return ag_last_status();
            break;
        case AG_GA_NODES: {
            ag_tensor **v = st->lists + used;
            for (int k = 0; k < a->n; k++) {
                v[k] = a->u.nodes[k] ? value_of(st, n, a->u.nodes[k]) : NULL;
                if (a->u.nodes[k] && !v[k])
                    return ag_last_status();
            }
            used += a->n;
            args[i] = AG_A_TS(v, a->n);
            break;
        }
        case AG_GA_TUPLE:
        case AG_GA_DICT: /* the higher-order ops' only (verify refuses others) */
            return ag__err(AG_EINVAL, "run: %%%s: argument %d is %s, which %s does not take",
                           n->name, i, ag__garg_kind_name(a->kind), ag_op_name(n->op));
        default: /* a constant: int, float, bool, ints, dtype, str */
            args[i] = ag__garg_const_arg(a);
            break;
        }
    }
    /* The dispatcher hands results to the innermost scope; a scope of our own per call lets
     * us take plain references and drop them as soon as the last reader ran. */
    ag_tensor *outs[AG_MAX_OUTPUTS] = {0};
    ag_scope_begin();
    int rc = ag_op_call(n->op, args, n->nargs, outs);
    int nouts = rc < 0 ? 0 : ag_op_noutputs(n->op) > 0 ? ag_op_noutputs(n->op) : rc;
    for (int i = 0; i < nouts; i++)
        ag_tensor_keep(outs[i]);
    ag_scope_end();
    if (rc < 0) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", ag_last_error());
        return ag__err(rc, "run: %%%s: %s", n->name, msg);
    }
    int want = n->nvals;
    if (nouts != want) {
        for (int i = 0; i < nouts; i++)
            ag_tensor_free(outs[i]);
        return ag__err(AG_EINVAL, "run: %%%s: %s produced %d output(s), the graph expects %d",
                       n->name, ag_op_name(n->op), nouts, want);
    }
    int64_t f = st->first[n->index];
    for (int i = 0; i < nouts; i++)
        st->slots[f + i] = outs[i];
    return 0;
}

static int run_getitem(run_state *st, const ag_node *n) {
    const ag_node *src = n->nargs == 2 && n->args[0].kind == AG_GA_NODE ? n->args[0].u.node : NULL;
    int64_t idx = n->nargs == 2 && n->args[1].kind == AG_GA_INT ? n->args[1].u.i : -1;
    if (!src || src->kind != AG_NODE_CALL || idx < 0 || idx >= nslots_of(src))
        return ag__err(AG_EINVAL, "run: %%%s: bad getitem", n->name);
    ag_tensor *t = st->slots[st->first[src->index] + idx];
    st->slots[st->first[n->index]] = ag_tensor_keep(t);
    return 0;
}

/* Takes a reference to each output (NULL for None). All are checked before any is taken, so
 * a failure leaves nothing to release. */
static int take_outputs(run_state *st, const ag_node *out, ag_tensor **outs) {
    const ag_garg *a = &out->args[0];
    for (int k = 0; k < a->n; k++)
        if (a->u.nodes[k] && !value_of(st, out, a->u.nodes[k]))
            return ag_last_status();
    for (int k = 0; k < a->n; k++)
        outs[k] = a->u.nodes[k] ? ag_tensor_keep(value_of(st, out, a->u.nodes[k])) : NULL;
    return a->n;
}

static int run_nodes(run_state *st, const ag_graph *g, ag_tensor *const *inputs, ag_tensor **outs) {
    int rc = state_init(st, g);
    int iph = 0;
    for (const ag_node *n = g->first; n && rc == 0; n = n->next) {
        switch (n->kind) {
        case AG_NODE_PLACEHOLDER:
            rc = run_placeholder(st, n, iph, inputs[iph]);
            iph++;
            break;
        case AG_NODE_GET_ATTR:
            if (n->sub)
                break; /* a subgraph: read by invoke_subgraph itself, no tensor */
            if (!n->constant)
                rc = ag__err(AG_EINVAL, "run: %%%s: get_attr without a constant", n->name);
            else
                st->slots[st->first[n->index]] = ag_tensor_keep(n->constant);
            break;
        case AG_NODE_CALL:
            rc = run_call(st, n);
            break;
        case AG_NODE_GETITEM:
            rc = run_getitem(st, n);
            break;
        case AG_NODE_OUTPUT:
            return take_outputs(st, n, outs);
        }
        if (rc < 0)
            break;
        consume_args(st, n);
        if (st->remaining[n->index] == 0)
            release_node(st, n); /* nothing reads it: dead code, or an effect */
    }
    return rc < 0 ? rc : ag__err(AG_EINVAL, "run: the output node is not in the node list");
}

int ag_graph_run(const ag_graph *g, ag_tensor *const *inputs, int ninputs, ag_tensor **outs,
                 int max_out) {
    AG__CHECK_NULL("graph_run", g);
    if (ninputs > 0)
        AG__CHECK_NULL("graph_run", inputs);
    if (max_out > 0)
        AG__CHECK_NULL("graph_run", outs);
    const ag_node *out = g->output;
    if (!out || out->nargs != 1 || out->args[0].kind != AG_GA_NODES)
        return ag__err(AG_EINVAL, "run: the graph has no output node");
    int nph = 0;
    for (const ag_node *n = g->first; n; n = n->next)
        nph += n->kind == AG_NODE_PLACEHOLDER;
    if (nph != ninputs)
        return ag__err(AG_EINVAL, "run: graph has %d placeholders, %d inputs given", nph, ninputs);
    if (out->args[0].n > max_out)
        return ag__err(AG_EINVAL, "run: the graph has %d outputs, room for %d given",
                       out->args[0].n, max_out);

    /* Results are handed to the caller's scope, if one is open, only at the end: the run
     * itself works inside a scope of its own (where each call's scope nests cheaply). */
    bool caller_scope = ag__in_scope();
    run_state st;
    ag_scope_begin();
    int rc = run_nodes(&st, g, inputs, outs);
    state_free(&st);
    ag_scope_end();
    if (rc > 0 && caller_scope)
        for (int k = 0; k < rc; k++) {
            if (outs[k] && !ag__give(outs[k])) {
                /* ag__give released outs[k]; the earlier ones belong to the scope now. */
                for (int j = k; j < rc; j++) {
                    if (j > k)
                        ag_tensor_free(outs[j]);
                    outs[j] = NULL;
                }
                return AG_ENOMEM;
            }
        }
    return rc;
}
