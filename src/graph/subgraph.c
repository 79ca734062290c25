/* Subgraphs: a graph's named graph attributes and the higher-order op invoke_subgraph that
 * calls them (include/aotgrad/graph.h, "subgraphs").
 *
 * In: graphs handed to ag_graph_add_subgraph, calls of invoke_subgraph. Out: the attribute
 * list the printer, parser, verifier and copies walk; the meta inference of invoke_subgraph,
 * which the op's own meta function cannot do (it sees tensors, not the graph): ag__infer_meta
 * hands every call of an AG_OP_SUBGRAPH op here. The op itself is an ordinary op definition
 * (schema, flags) kept out of the registry, as the with_effects wrappers are: its kernel and
 * meta function only refuse, since a subgraph has no eager value. */
#include "graph_internal.h"

#include <pthread.h>
#include <stdio.h>

/* ---- the attribute list ---- */

void ag__subgraphs_free(ag_graph *g) {
    for (int i = 0; i < g->nsubs; i++) {
        ag__free(g->subs[i].name);
        ag_graph_free(g->subs[i].g);
    }
    ag__free(g->subs);
    g->subs = NULL;
    g->nsubs = 0;
    g->subs_cap = 0;
}

int ag__subgraph_index(const ag_graph *g, const ag_graph *sub) {
    for (int i = 0; i < g->nsubs; i++)
        if (g->subs[i].g == sub)
            return i;
    return -1;
}

static bool is_identifier(const char *s) {
    if (!((*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z') || *s == '_'))
        return false;
    for (; *s; s++)
        if (!((*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z') || (*s >= '0' && *s <= '9') ||
              *s == '_'))
            return false;
    return true;
}

/* Appends (name, sub) without checks; 0 or AG_ENOMEM with nothing changed. */
static int push(ag_graph *g, const char *name, ag_graph *sub) {
    char *nm = ag__strdup(name);
    if (!nm || ag__grow((void **)&g->subs, &g->subs_cap, g->nsubs + 1, sizeof *g->subs)) {
        ag__free(nm);
        return AG_ENOMEM;
    }
    g->subs[g->nsubs++] = (ag__subgraph){nm, sub};
    sub->parent = g;
    return 0;
}

/* How many levels of subgraphs g holds below itself (0: none). */
static int depth_below(const ag_graph *g) {
    int d = 0;
    for (int i = 0; i < g->nsubs; i++) {
        int k = 1 + depth_below(g->subs[i].g);
        d = k > d ? k : d;
    }
    return d;
}

int ag_graph_add_subgraph(ag_graph *g, const char *name, ag_graph *sub) {
    AG__CHECK_NULL("graph_add_subgraph", g);
    AG__CHECK_NULL("graph_add_subgraph", name);
    AG__CHECK_NULL("graph_add_subgraph", sub);
    const char *why = NULL;
    if (!is_identifier(name))
        why = "the name is not an identifier ([A-Za-z_][A-Za-z0-9_]*)";
    else if (ag_graph_subgraph(g, name))
        why = "the graph has a subgraph of that name";
    else if (sub == g)
        why = "a graph cannot be its own subgraph";
    else if (sub->parent)
        why = "the graph is already a subgraph";
    else if (!sub->output)
        why = "the subgraph has no output node";
    if (!why) { /* nesting: no cycle (sub an ancestor of g), and a bounded depth */
        int above = 0;
        for (const ag_graph *a = g; a && !why; a = a->parent, above++)
            if (a == sub)
                why = "the subgraph is the graph's own ancestor";
        if (!why && above + depth_below(sub) > AG_SUBGRAPH_MAX_DEPTH) /* sub's level: above */
            why = "subgraphs would nest too deeply";
    }
    if (!why) {
        const ag_node *n = ag_graph_find(g, name);
        if (n && n->kind == AG_NODE_GET_ATTR && n->constant)
            why = "a constant of the graph has that name";
    }
    if (why)
        return ag__err(AG_EINVAL, "graph_add_subgraph: '%s': %s", name, why);
    return push(g, name, sub);
}

void ag__subgraph_remove(ag_graph *g, int k) {
    ag__free(g->subs[k].name);
    ag_graph_free(g->subs[k].g);
    memmove(g->subs + k, g->subs + k + 1, sizeof *g->subs * (size_t)(g->nsubs - k - 1));
    g->nsubs--;
}

ag_graph *ag_graph_subgraph(const ag_graph *g, const char *name) {
    if (!g || !name)
        return NULL;
    for (int i = 0; i < g->nsubs; i++)
        if (!strcmp(g->subs[i].name, name))
            return g->subs[i].g;
    return NULL;
}

int ag_graph_num_subgraphs(const ag_graph *g) {
    return g ? g->nsubs : 0;
}

ag_graph *ag_graph_subgraph_at(const ag_graph *g, int i, const char **name) {
    if (name)
        *name = NULL;
    if (!g || i < 0 || i >= g->nsubs)
        return NULL;
    if (name)
        *name = g->subs[i].name;
    return g->subs[i].g;
}

int ag__subgraphs_copy(ag_graph *dst, const ag_graph *src) {
    for (int i = 0; i < src->nsubs; i++) {
        ag_graph *c = ag_graph_copy(src->subs[i].g);
        if (!c)
            return AG_ENOMEM;
        if (push(dst, src->subs[i].name, c)) {
            ag_graph_free(c);
            return AG_ENOMEM;
        }
    }
    return 0;
}

int ag__subgraph_check_args(const ag_graph *g, const ag_op *op, const ag_garg *args, int nargs) {
    for (int i = 0; i < nargs; i++) {
        const ag_garg *a = &args[i];
        int cnt = ag__garg_nrefs(a);
        for (int k = 0; k < cnt; k++) {
            const ag_node *d = ag__garg_ref(a, k);
            /* A graph and its subgraphs share no nodes (other graphs: not checked here). */
            if (d && d->graph != g &&
                (d->graph == g->parent || d->graph->parent == g ||
                 (g->parent && d->graph->parent == g->parent)))
                return ag__err(AG_EINVAL,
                               "graph_call: %s: argument %d (%%%s) is a node of another graph "
                               "(a graph and its subgraphs reference only their own nodes)",
                               ag_op_name(op), i, d->name);
        }
    }
    return 0;
}

/* ---- the op ---- */

static int refuse_meta(const ag_arg *args, ag_tmeta *out) {
    (void)args, (void)out;
    return ag__err(AG_ENOTSUP, "invoke_subgraph: a subgraph has no eager value; its calls are "
                               "inferred and run by the graph layer (ag_graph_run)");
}

static int refuse_kernel(const ag_arg *args, ag_tensor **outs) {
    (void)args, (void)outs;
    return ag__err(AG_ENOTSUP, "invoke_subgraph: no eager kernel (run the graph with "
                               "ag_graph_run)");
}

static const ag_opdef invoke_def = {
    .schema = "invoke_subgraph(Tensor subgraph, str identifier, Tensor[] operands) -> Tensor[]",
    .flags = AG_OP_SUBGRAPH,
    .meta = refuse_meta,
    .kernel = refuse_kernel,
    .dtypes = AG_DT_ALL,
};

static ag_op *invoke_op;
static pthread_once_t invoke_once = PTHREAD_ONCE_INIT;

static void make_invoke_op(void) {
    invoke_op = ag__op_new_detached(&invoke_def);
}

__attribute__((destructor)) static void free_invoke_op(void) {
    ag__op_free_detached(invoke_op);
    invoke_op = NULL;
}

const ag_op *ag_op_invoke_subgraph(void) {
    pthread_once(&invoke_once, make_invoke_op);
    if (!invoke_op)
        ag__err(AG_ENOMEM, "invoke_subgraph: out of memory making the op");
    return invoke_op;
}

ag_node *ag_graph_invoke_subgraph(ag_graph *g, ag_node *attr, const char *identifier,
                                  ag_node *const *operands, int noperands, const char *name) {
    AG__CHECK_NULL_RET("graph_invoke_subgraph", g, NULL);
    AG__CHECK_NULL_RET("graph_invoke_subgraph", attr, NULL);
    AG__CHECK_NULL_RET("graph_invoke_subgraph", identifier, NULL);
    if (noperands > 0)
        AG__CHECK_NULL_RET("graph_invoke_subgraph", operands, NULL);
    if (noperands < 0)
        return ag__err(AG_EINVAL, "graph_invoke_subgraph: %d operands", noperands), NULL;
    const ag_op *op = ag_op_invoke_subgraph();
    if (!op)
        return NULL;
    ag_garg args[3] = {AG_GA_N(attr), AG_GA_S(identifier),
                       AG_GA_NODES((ag_node **)operands, noperands)};
    return ag_graph_call(g, op, args, 3, name);
}

/* ---- meta inference ---- */

bool ag__call_output_is_none(const ag_node *n, int i) {
    const ag_graph *sub = ag__call_subgraph(n);
    if (!sub || !sub->output || sub->output->nargs != 1 || sub->output->args[0].kind != AG_GA_NODES)
        return false;
    const ag_garg *o = &sub->output->args[0];
    return i >= 0 && i < o->n && !o->u.nodes[i];
}

int ag__subgraph_passthrough(const ag_graph *sub, int *ph_of, int max) {
    const ag_node *o = sub->output;
    if (!o || o->nargs < 1 || o->args[0].kind != AG_GA_NODES)
        return 0;
    const ag_garg *oa = &o->args[0];
    int n = oa->n < max ? oa->n : max, left = 0;
    for (int k = 0; k < n; k++) {
        const ag_node *y = oa->u.nodes[k];
        ph_of[k] = y && y->kind == AG_NODE_PLACEHOLDER ? -2 : -1; /* -2: not counted yet */
        left += ph_of[k] == -2;
    }
    /* The placeholders' positions, in one walk that stops after the last one returned. */
    int j = 0;
    for (const ag_node *y = sub->first; y && left > 0; y = y->next) {
        if (y->kind != AG_NODE_PLACEHOLDER)
            continue;
        for (int k = 0; k < n; k++)
            if (ph_of[k] == -2 && oa->u.nodes[k] == y) {
                ph_of[k] = j;
                left--;
            }
        j++;
    }
    return n;
}

const ag_graph *ag__call_subgraph(const ag_node *n) {
    if (n->kind != AG_NODE_CALL || !n->op || !(ag_op_def(n->op)->flags & AG_OP_SUBGRAPH) ||
        n->nargs < 1 || n->args[0].kind != AG_GA_NODE || !n->args[0].u.node)
        return NULL;
    return n->args[0].u.node->sub;
}

static const char *meta_str(const ag_tmeta *m, char *buf, size_t n) {
    char sz[112];
    ag__fmt_sizes(sz, sizeof sz, m->ndim, m->sizes);
    snprintf(buf, n, "%s%s", ag_dtype_short(m->dtype), sz);
    return buf;
}

int ag__subgraph_infer(const ag_op *op, const ag_garg *args, int nargs, ag_tmeta *vals,
                       int *nvals) {
    if (ag__op_is_flex(op)) /* flex_attention's higher-order ops (flex_hop.c) */
        return ag__flex_infer(op, args, nargs, vals, nvals);
    const char *opn = ag_op_name(op);
    if (nargs != 3 || args[0].kind != AG_GA_NODE || !args[0].u.node || args[1].kind != AG_GA_STR ||
        !args[1].u.s || args[2].kind != AG_GA_NODES)
        return ag__err(AG_EINVAL,
                       "%s: takes (subgraph, identifier, operands): a get_attr of a "
                       "subgraph, a string and a list of nodes",
                       opn);
    const ag_node *attr = args[0].u.node;
    const ag_graph *sub = attr->sub;
    if (!sub)
        return ag__err(AG_EINVAL, "%s: argument 0 (%%%s) is not a get_attr of a subgraph", opn,
                       attr->name);
    int k = attr->graph ? ag__subgraph_index(attr->graph, sub) : -1;
    if (k < 0)
        return ag__err(AG_EINVAL, "%s: %%%s refers to a subgraph its graph does not own", opn,
                       attr->name);
    const char *sname = attr->graph->subs[k].name;
    int nph = (int)sub->nph; /* kept by the node list (graph.c): no walk per call */
    const ag_node *ph = sub->first;
    if (args[2].n != nph)
        return ag__err(AG_EINVAL, "%s: %d operand(s) for the %d placeholder(s) of %s", opn,
                       args[2].n, nph, sname);
    for (int i = 0; i < args[2].n; i++, ph = ph->next) {
        while (ph->kind != AG_NODE_PLACEHOLDER)
            ph = ph->next;
        const ag_node *x = args[2].u.nodes[i];
        if (!x)
            return ag__err(AG_EINVAL, "%s: operand %d is None", opn, i);
        if (x->nvals != 1 || (x->kind == AG_NODE_CALL && ag_op_noutputs(x->op) != 1))
            return ag__err(AG_EINVAL, "%s: operand %d (%%%s) is not one tensor", opn, i, x->name);
        if (ph->nvals != 1)
            return ag__err(AG_EINVAL, "%s: placeholder %%%s of %s has no val", opn, ph->name,
                           sname);
        const ag_tmeta *a = &x->vals[0], *b = &ph->vals[0];
        bool same = a->dtype == b->dtype && a->ndim == b->ndim;
        for (int d = 0; same && d < a->ndim; d++)
            same = a->sizes[d] == b->sizes[d];
        if (!same) {
            char sa[160], sb[160];
            return ag__err(
                AG_EINVAL, "%s: operand %d (%%%s) is %s but placeholder %%%s of %s is %s", opn, i,
                x->name, meta_str(a, sa, sizeof sa), ph->name, sname, meta_str(b, sb, sizeof sb));
        }
    }
    const ag_node *out = sub->output;
    if (!out || out->nargs != 1 || out->args[0].kind != AG_GA_NODES)
        return ag__err(AG_EINVAL, "%s: %s has no output node", opn, sname);
    const ag_garg *o = &out->args[0];
    if (o->n > AG_MAX_OUTPUTS)
        return ag__err(AG_EINVAL, "%s: %s has %d outputs (at most %d)", opn, sname, o->n,
                       AG_MAX_OUTPUTS);
    for (int i = 0; i < o->n; i++) {
        const ag_node *x = o->u.nodes[i];
        if (!x) { /* None (a grad of an operand that needs none): no tensor, nothing to read */
            int64_t zero = 0;
            memset(&vals[i], 0, sizeof vals[i]);
            ag__tmeta_contiguous(&vals[i], AG_F32, 1, &zero);
            continue;
        }
        if (x->nvals != 1)
            return ag__err(AG_EINVAL, "%s: output %d of %s is not one tensor", opn, i, sname);
        vals[i] = x->vals[0];
    }
    *nvals = o->n;
    return 0;
}
