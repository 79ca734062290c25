/* Decomposition tables and the decomposition pass (declared in include/aotgrad/graph.h): each
 * call to an op in the table is replaced by the nodes its decomposition function emits when
 * traced in place (ag__trace_replace_node in trace.c), until no call of a table op remains;
 * ag_graph_decompose_node does it for one node (the sharding pass decomposes only the nodes
 * that would otherwise gather their inputs).
 * A graph pass, but one that runs op code on stand-ins, so it lives with the tracer. */
#include "../graph/graph_internal.h"

struct ag_decomp_table {
    const ag_op **ops;
    ag_decomp_fn *fns;
    int64_t n, cap, fcap;
};

ag_decomp_table *ag_decomp_table_new(void) {
    return ag__calloc(1, sizeof(ag_decomp_table));
}

void ag_decomp_table_free(ag_decomp_table *t) {
    if (!t)
        return;
    ag__free(t->ops);
    ag__free(t->fns);
    ag__free(t);
}

int ag_decomp_table_add(ag_decomp_table *t, const ag_op *op, ag_decomp_fn fn) {
    AG__CHECK_NULL("decomp_table_add", t);
    AG__CHECK_NULL("decomp_table_add", op);
    AG__CHECK_NULL("decomp_table_add", fn);
    for (int64_t i = 0; i < t->n; i++)
        if (t->ops[i] == op) {
            t->fns[i] = fn;
            return 0;
        }
    if (ag__grow((void **)&t->ops, &t->cap, t->n + 1, sizeof *t->ops) ||
        ag__grow((void **)&t->fns, &t->fcap, t->n + 1, sizeof *t->fns))
        return AG_ENOMEM;
    t->ops[t->n] = op;
    t->fns[t->n++] = fn;
    return 0;
}

ag_decomp_table *ag_decomp_table_core(void) {
    ag_decomp_table *t = ag_decomp_table_new();
    if (!t)
        return NULL;
    for (int i = 0; i < ag_op_count(); i++) {
        const ag_op *op = ag_op_at(i);
        const ag_opdef *d = ag_op_def(op);
        if (d->decomp && !(d->flags & AG_OP_COMPOSITE) && ag_decomp_table_add(t, op, d->decomp)) {
            ag_decomp_table_free(t);
            return NULL;
        }
    }
    return t;
}

static ag_decomp_fn lookup(const ag_decomp_table *t, const ag_op *op) {
    for (int64_t i = 0; i < t->n; i++)
        if (t->ops[i] == op)
            return t->fns[i];
    return NULL;
}

static int decompose_one(ag_graph *g, const ag_decomp_table *t);

/* g, then each subgraph (a nested compile region's forward and joint), theirs too (a region in
 * a region). */
static int decompose_tree(ag_graph *g, const ag_decomp_table *t) {
    int replaced = decompose_one(g, t);
    for (int i = 0; replaced >= 0 && i < ag_graph_num_subgraphs(g); i++) {
        int r = decompose_tree(ag_graph_subgraph_at(g, i, NULL), t);
        replaced = r < 0 ? r : replaced + r;
    }
    return replaced;
}

int ag_graph_decompose(ag_graph *g, const ag_decomp_table *t) {
    AG__CHECK_NULL("graph_decompose", g);
    AG__CHECK_NULL("graph_decompose", t);
    return decompose_tree(g, t);
}

static int decompose_one(ag_graph *g, const ag_decomp_table *t) {
    int replaced = 0;
    /* A decomposition may emit ops that are themselves in the table: sweep until none is left.
     * Each sweep only visits nodes that existed when it started. */
    for (int sweep = 0; sweep < 64; sweep++) {
        /* Replacing a node erases it and its getitems, so collect the candidates first. */
        ag_node **todo = NULL;
        int64_t ntodo = 0, cap = 0;
        for (ag_node *n = g->first; n; n = n->next)
            if (n->kind == AG_NODE_CALL && lookup(t, n->op)) {
                if (ag__grow((void **)&todo, &cap, ntodo + 1, sizeof *todo)) {
                    ag__free(todo);
                    return AG_ENOMEM;
                }
                todo[ntodo++] = n;
            }
        int before = replaced;
        for (int64_t i = 0; i < ntodo; i++) {
            int rc = ag__trace_replace_node(g, todo[i], lookup(t, todo[i]->op));
            if (rc == AG_ENOTSUP) {
                ag_clear_error(); /* this variant has no decomposition (e.g. gelu 'none') */
                continue;
            }
            if (rc) {
                ag__free(todo);
                return rc;
            }
            replaced++;
        }
        ag__free(todo);
        if (replaced == before)
            return replaced;
    }
    return ag__err(AG_EINVAL, "decompose: decompositions did not reach a fixed point after 64 "
                              "sweeps (an op's decomposition emits the op itself?)");
}

int ag_graph_decompose_node(ag_graph *g, ag_node *n, ag_decomp_fn fn) {
    AG__CHECK_NULL("graph_decompose_node", g);
    AG__CHECK_NULL("graph_decompose_node", n);
    AG__CHECK_NULL("graph_decompose_node", fn);
    if (n->graph != g || n->kind != AG_NODE_CALL)
        return ag__err(AG_EINVAL,
                       "graph_decompose_node: node '%s' is not a call node of this graph", n->name);
    return ag__trace_replace_node(g, n, fn);
}
