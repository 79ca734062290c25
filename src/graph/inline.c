/* Inlining subgraphs: a flat copy of a graph whose invoke_subgraph calls are replaced by their
 * subgraphs' nodes (include/aotgrad/graph.h, ag_graph_inline_subgraphs).
 *
 * In: a graph with subgraph attributes and calls of them. Out: a new graph computing the same
 * values with no invoke_subgraph, for consumers that only know flat graphs (the sharding pass).
 * Each call's subgraph nodes are copied just before the call, the subgraph's placeholders
 * standing for the call's operands, with their vals and metadata; their names are made unique
 * in the outer graph as FX makes names (a copy of `mul` becomes `mul_3` when `mul` is taken).
 * Each getitem of the call is then replaced by the node the subgraph returns at its index, the
 * call is erased, and attributes no get_attr reads any more are dropped. A subgraph calling
 * subgraphs of its own (a region in a region) is made flat first, so inlining recurses.
 *
 * Checkpoint tags: a subgraph numbers its checkpointed regions' ac_graph_id from 1, the same in
 * every call. Each call's copies get fresh ids, above every id of the graph and increasing in
 * call order, as the flat trace numbers its regions: the partitioner's boundary rule (a
 * must-recompute value read by a later region is saved) needs consecutive calls told apart,
 * or two checkpointed blocks in a row become one region and the value between them is
 * recomputed instead of saved. */
#include "graph_internal.h"

/* x's name when g has no node of that name, else NULL (a name made from the op's). */
static const char *fresh(const ag_graph *g, const ag_node *x) {
    return ag_graph_find(g, x->name) || ag_graph_subgraph(g, x->name) ? NULL : x->name;
}

static ag_node *env_node(void *env, const ag_node *x) {
    return ((ag_node **)env)[x->index];
}

/* Copies subgraph node x into g (at g's insertion point), its node arguments mapped through
 * env (indexed by the subgraph's node index). */
static ag_node *copy_into(ag_graph *g, const ag_node *x, ag_node **env) {
    ag_node *m = NULL;
    switch (x->kind) {
    case AG_NODE_CALL: {
        ag_garg args[AG_MAX_ARGS];
        ag_node **lists[AG_MAX_ARGS] = {0};
        bool ok = true;
        for (int a = 0; a < x->nargs && ok; a++) {
            args[a] = x->args[a];
            if (args[a].kind == AG_GA_NODE && args[a].u.node) {
                args[a].u.node = env[args[a].u.node->index];
            } else if (args[a].kind == AG_GA_TUPLE) {
                ag_garg *t = ag__garg_tuple_map(&args[a], env_node, env);
                lists[a] = (ag_node **)(void *)t;
                ok = t != NULL;
                args[a].u.elems = t;
            } else if (args[a].kind == AG_GA_NODES) {
                lists[a] = ag__malloc(sizeof(ag_node *) * (size_t)(args[a].n ? args[a].n : 1));
                ok = lists[a] != NULL;
                for (int e = 0; ok && e < args[a].n; e++)
                    lists[a][e] = args[a].u.nodes[e] ? env[args[a].u.nodes[e]->index] : NULL;
                args[a].u.nodes = lists[a];
            }
        }
        if (ok)
            m = ag__graph_call_vals(g, x->op, args, x->nargs, x->vals, x->nvals, fresh(g, x));
        for (int a = 0; a < x->nargs; a++)
            ag__free(lists[a]);
        if (!ok)
            ag__err(AG_ENOMEM, "graph_inline_subgraphs: out of memory");
        break;
    }
    case AG_NODE_GETITEM:
        m = ag_graph_getitem(g, env[x->args[0].u.node->index], (int)x->args[1].u.i, fresh(g, x));
        break;
    case AG_NODE_GET_ATTR:
        m = ag_graph_get_attr(g, x->constant, fresh(g, x));
        break;
    default:
        ag__err(AG_EINVAL, "graph_inline_subgraphs: cannot copy %%%s", x->name);
        return NULL;
    }
    if (m && (ag__node_meta_copy(m, x) || ag_node_custom_copy(m, x)))
        return NULL;
    return m;
}

/* The ac_graph_id of subgraph copy m, mapped to this call's own: map[i] is the id given to the
 * subgraph's id i in this call (0 until first met), *next the next fresh id. */
static int renumber_region(ag_node *m, int64_t *map, int64_t nmap, int64_t *next) {
    ag_mval v = ag_node_meta_get(m, "ac_graph_id");
    if (v.kind != AG_MV_INT || v.u.i < 0 || v.u.i >= nmap)
        return 0;
    if (!map[v.u.i])
        map[v.u.i] = (*next)++;
    int rc = ag_node_meta_set(m, "ac_graph_id", (ag_mval){.kind = AG_MV_INT, .u.i = map[v.u.i]});
    return rc < 0 ? rc : 0;
}

/* The largest ac_graph_id of g's nodes (0 when none). */
static int64_t max_region_id(const ag_graph *g) {
    int64_t id = 0;
    for (const ag_node *n = g->first; n; n = n->next) {
        ag_mval v = ag_node_meta_get(n, "ac_graph_id");
        if (v.kind == AG_MV_INT && v.u.i > id)
            id = v.u.i;
    }
    return id;
}

/* Replaces call n (an invoke_subgraph of sub) by a copy of sub's nodes; *next_id is the next
 * fresh ac_graph_id. */
static int inline_call(ag_graph *g, ag_node *n, const ag_graph *sub, int64_t *next_id) {
    int nn = 0;
    for (const ag_node *x = sub->first; x; x = x->next)
        nn++;
    int64_t nmap = max_region_id(sub) + 1;
    ag_node **env = ag__calloc((size_t)(nn ? nn : 1), sizeof *env);
    int64_t *map = ag__calloc((size_t)nmap, sizeof *map);
    if (!env || !map) {
        ag__free(env);
        ag__free(map);
        return ag__err(AG_ENOMEM, "graph_inline_subgraphs: out of memory");
    }
    /* Node indices of sub are its own (ag_node_index renumbers on demand). */
    (void)ag_node_index(sub->first);
    const ag_garg *ops = &n->args[2];
    int k = 0, rc = 0;
    ag_graph_insert_before(g, n);
    for (const ag_node *x = sub->first; x && rc == 0; x = x->next) {
        if (x->kind == AG_NODE_PLACEHOLDER) {
            env[x->index] = k < ops->n ? ops->u.nodes[k] : NULL;
            k++;
        } else if (x->kind != AG_NODE_OUTPUT) {
            env[x->index] = copy_into(g, x, env);
            if (!env[x->index])
                rc = ag_last_status() ? ag_last_status() : AG_ENOMEM;
            else
                rc = renumber_region(env[x->index], map, nmap, next_id);
            /* A copy runs where the call ran: the forward's calls are forward, a joint
             * subgraph's calls backward (its forward part included, as the region's backward
             * reran it). */
            const char *tag = ag_node_partitioner_tag(n);
            if (rc == 0 && tag && !ag_node_partitioner_tag(env[x->index]))
                rc = ag_node_set_partitioner_tag(env[x->index], tag);
        }
    }
    ag_graph_insert_at_end(g);
    const ag_garg *o = &sub->output->args[0];
    /* The getitems of n: each replaced by what the subgraph returns at its index. */
    while (rc == 0 && n->nusers > 0) {
        ag_node *u = n->users[0].node;
        if (u->kind != AG_NODE_GETITEM) {
            rc = ag__err(AG_EINVAL,
                         "graph_inline_subgraphs: %%%s reads invoke_subgraph %%%s directly "
                         "(only getitems may)",
                         u->name, n->name);
            break;
        }
        int i = (int)u->args[1].u.i;
        ag_node *by = i >= 0 && i < o->n && o->u.nodes[i] ? env[o->u.nodes[i]->index] : NULL;
        if (!by) {
            rc = ag__err(AG_EINVAL, "graph_inline_subgraphs: %%%s reads output %d of %%%s, None",
                         u->name, i, n->name);
            break;
        }
        if ((rc = ag_node_replace_all_uses(u, by)) >= 0)
            rc = ag_graph_erase(g, u);
    }
    ag__free(env);
    ag__free(map);
    if (rc < 0)
        return rc;
    ag_node *attr = n->args[0].u.node;
    rc = ag_graph_erase(g, n);
    if (rc == 0 && attr->nusers == 0)
        rc = ag_graph_erase(g, attr);
    return rc < 0 ? rc : 0;
}

/* Inlines every call of g in place, its subgraphs first (a region in a region: the inner calls
 * are inlined into the outer subgraph, which is then flat when its own calls are inlined), and
 * drops the attributes no get_attr reads any more. */
static int inline_all(ag_graph *c) {
    int rc = 0;
    for (int k = 0; k < c->nsubs && rc == 0; k++)
        if (c->subs[k].g->nsubs)
            rc = inline_all(c->subs[k].g);
    /* The calls first: inlining one erases its getitems and get_attr. */
    int ncalls = 0;
    for (ag_node *n = c->first; n; n = n->next)
        ncalls += ag__call_subgraph(n) != NULL;
    ag_node **calls = rc ? NULL : ag__malloc(sizeof *calls * (size_t)(ncalls ? ncalls : 1));
    if (!rc && !calls)
        return AG_ENOMEM;
    ncalls = 0;
    for (ag_node *n = rc ? NULL : c->first; n; n = n->next)
        if (ag__call_subgraph(n))
            calls[ncalls++] = n;
    int64_t next_id = max_region_id(c) + 1;
    for (int k = 0; k < ncalls && rc == 0; k++)
        rc = inline_call(c, calls[k], ag__call_subgraph(calls[k]), &next_id);
    ag__free(calls);
    /* Attributes no get_attr reads any more. */
    for (int k = c->nsubs - 1; rc == 0 && k >= 0; k--) {
        bool read = false;
        for (const ag_node *n = c->first; n && !read; n = n->next)
            read = n->kind == AG_NODE_GET_ATTR && n->sub == c->subs[k].g;
        if (!read)
            ag__subgraph_remove(c, k);
    }
    return rc;
}

ag_graph *ag_graph_inline_subgraphs(const ag_graph *g) {
    AG__CHECK_NULL_RET("graph_inline_subgraphs", g, NULL);
    if (g->parent)
        return ag__err(AG_EINVAL, "graph_inline_subgraphs: the graph is a subgraph"), NULL;
    ag_graph *c = ag_graph_copy(g);
    if (!c)
        return NULL;
    if (inline_all(c)) {
        ag_graph_free(c);
        return NULL;
    }
    return c;
}
