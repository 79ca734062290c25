/* The min-cut rematerialization partition (upstream's min_cut_rematerialization_partition,
 * solve_min_cut and choose_saved_values_set; spec 7.2).
 *
 * In: a classified joint graph (partition.c). Out: the set of values the forward saves for the
 * backward; everything else the backward needs it recomputes from them.
 *
 * The saved set is a minimum cut of a flow network in which every node n is an edge
 * n_in -> n_out whose capacity is what saving n costs (its bytes, scaled by how far it is from
 * the backward and doubled when every user could fuse it), every use is an infinite edge
 * n_out -> user_in, the nodes the backward cannot do without are tied to the sink and the
 * nodes that may not be recomputed ("banned": the primals, compute-intensive and random ops,
 * ops outside the recomputable set, reductions that shrink their input 4x, values the backward
 * must materialize anyway, ...) to the source.
 *
 * Op classes (the recomputable set). Upstream lists ATen ops by name; aotgrad reads the op
 * table's flags instead, so a new op is classified where it is declared:
 *   recomputable = pointwise, reduction, view and factory ops (neither random, in-place,
 *                  effectful nor compute-intensive) plus getitem and the named ops below
 *                  (clone, _to_copy, index.Tensor, gather: upstream's list; split.Tensor: a view
 *                  in ATen, decomposed into slices by upstream's decompositions; the
 *                  functional random ops philox_rand and philox_randn, which the RNG
 *                  functionalization of the export emits: recomputed from the saved seed and
 *                  offset they give the same numbers, so a dropout mask need not be saved);
 *   random       = AG_OP_RANDOM (native_dropout, rand, randn, ...);
 *   compute-intensive = AG_OP_COMPUTE_INTENSIVE (mm, bmm, addmm, convolution(+backward),
 *                  flash attention(+backward));
 *   fusible      = recomputable or random; a cat consumer fuses with anything;
 *   collective   = AG_OP_COLLECTIVE (_c10d_functional::*): banned, since a recomputation runs
 *                  the communication again, unless the node is tagged AG_MUST_RECOMPUTE (FSDP's
 *                  parameter gathers and their waits, gathered again in the backward instead of
 *                  saved); never fusible.
 * Differences from upstream's list: every view op is recomputable (upstream misses transpose,
 * which its decompositions turn into permute); cat, embedding, the norms and softmax are not
 * (as upstream, whose decompositions would expose their pointwise parts).
 *
 * Configuration as upstream's defaults: recompute_views = False (views are weighed like other
 * values, but never banned), max_dist_from_bw = 1000 (so the dist_from_bw ban never fires),
 * treat_parameters_as_free_to_save = True (saving a parameter or buffer, or a subclass
 * parameter's inner tensor, costs 0), every ban_recompute_* option on, aggressive_recomputation
 * off.
 *
 * Recompute policies (node meta "recompute", as activation checkpointing sets them): MUST_SAVE
 * bans recomputation; MUST_RECOMPUTE and PREFER_RECOMPUTE tie n_in to the sink so n is never
 * saved (upstream treats both alike); PREFER_SAVE has no effect, as in upstream's min-cut. One
 * deviation: random ops (AG_OP_RANDOM, left in a graph only when the export kept them:
 * ag_export_opts.keep_random_ops, or in graphs built otherwise) are never recomputed whatever
 * their tag or the budget, because they read the running thread's generator; they are saved.
 *
 * Max-flow: our Dinic (below), measured against igraph_maxflow in bench/bench_maxflow.c and
 * clearly faster on these networks; igraph_maxflow (GPL) is kept as the reference in the tests
 * and the bench only (tests/maxflow_igraph.c), never in the library.
 *
 * Budgets strictly between 0 and 1: see choose_saved_values_set below. */
#include "partition_internal.h"
#include "side_plan.h"

#include <math.h>
#include <stdlib.h>

/* ---- op classes ---- */

void ag__op_classes(const ag_op *op, bool *recomputable, bool *random, bool *compute_intensive,
                    bool *view, bool *is_cat) {
    static const char *const extra[] = {"clone",        "_to_copy", "index.Tensor", "gather",
                                        "split.Tensor", "alias",    "philox_rand",  "philox_randn"};
    uint32_t f = ag_op_def(op)->flags;
    const char *name = ag_op_name(op);
    *random = (f & AG_OP_RANDOM) != 0;
    *compute_intensive = (f & AG_OP_COMPUTE_INTENSIVE) != 0;
    *view = (f & AG_OP_VIEW) != 0;
    *is_cat = !strcmp(name, "cat");
    bool r = false;
    if (!(f & (AG_OP_RANDOM | AG_OP_COMPUTE_INTENSIVE | AG_OP_INPLACE | AG_OP_EFFECTFUL |
               AG_OP_COLLECTIVE))) {
        r = (f & (AG_OP_POINTWISE | AG_OP_REDUCTION | AG_OP_VIEW | AG_OP_FACTORY)) != 0;
        for (size_t i = 0; !r && i < sizeof extra / sizeof extra[0]; i++)
            r = !strcmp(name, extra[i]);
    }
    *recomputable = r;
}

ag__mincut_opts ag__mincut_default_opts(void) {
    return (ag__mincut_opts){true, true, true, true, true};
}

/* ---- the network ---- */

#define CAP_INF (-1.0) /* marker replaced by net->inf once every finite capacity is known */

typedef struct builder {
    const ag__part *P;
    const ag__mincut_opts *o;
    const bool *dont_ban;
    bool *banned;
    ag__flow_net *net;
    int64_t cap;
    int rc;
} builder;

static void add_edge(builder *b, int from, int to, double cap) {
    ag__flow_net *net = b->net;
    if (b->rc)
        return;
    if (net->nedges == b->cap) {
        int64_t c1 = b->cap, c2 = b->cap, c3 = b->cap;
        if (ag__grow((void **)&net->from, &c1, net->nedges + 1, sizeof(int)) ||
            ag__grow((void **)&net->to, &c2, net->nedges + 1, sizeof(int)) ||
            ag__grow((void **)&net->cap, &c3, net->nedges + 1, sizeof(double))) {
            b->rc = AG_ENOMEM;
            return;
        }
        b->cap = c1 < c2 ? (c1 < c3 ? c1 : c3) : (c2 < c3 ? c2 : c3);
    }
    net->from[net->nedges] = from;
    net->to[net->nedges] = to;
    net->cap[net->nedges++] = cap;
}

static int v_in(int i) {
    return 2 + 2 * i;
}
static int v_out(int i) {
    return 3 + 2 * i;
}

static bool must_recompute(const ag__pinfo *pi) {
    /* A random op is never recomputed (see ag__save_random_nodes), nor an effectful one (it
     * would run twice): their policy is ignored. A collective is recomputed only when tagged
     * MUST (a preference does not justify communicating twice). */
    if (pi->opflags & AG_OP_COLLECTIVE)
        return pi->policy == AG_MUST_RECOMPUTE;
    return !pi->random && !(pi->opflags & AG_OP_EFFECTFUL) &&
           (pi->policy == AG_MUST_RECOMPUTE || pi->policy == AG_PREFER_RECOMPUTE);
}

static bool is_fusible(const ag__part *P, int a, int b) {
    if (P->info[b].is_cat)
        return true; /* memory fusion into a cat; a cat is no producer of a fusion */
    return P->info[a].fusible && P->info[b].fusible;
}

/* Some user could not fuse n's computation (or n is an input): n is written to memory anyway. */
static bool is_materialized(const ag__part *P, int i) {
    const ag__pinfo *pi = &P->info[i];
    if (pi->kind == AG_NODE_PLACEHOLDER)
        return true;
    for (int u = 0; u < pi->nusers; u++)
        if (!is_fusible(P, i, pi->users[u]))
            return true;
    return false;
}

/* A backward user (through view chains) that cannot fuse the value: recomputing it would not
 * be free, the backward would materialize it. */
static bool is_materialized_backwards(const ag__part *P, int i, int *stack) {
    if (P->info[i].view)
        return false;
    int sp = 0;
    stack[sp++] = i;
    while (sp) {
        int cur = stack[--sp];
        const ag__pinfo *pc = &P->info[cur];
        for (int u = 0; u < pc->nusers; u++) {
            int user = pc->users[u];
            if (!P->info[user].req_fw && !is_fusible(P, cur, user))
                return true;
            if (P->info[user].view)
                stack[sp++] = user;
        }
    }
    return false;
}

/* The sum of sizes of n's direct tensor arguments, each occurrence counted as upstream does. */
static int64_t input_bytes(const ag__part *P, int i) {
    const ag_node *n = P->info[i].node;
    int64_t s = 0;
    for (int a = 0; a < ag_node_nargs(n); a++) {
        const ag_garg *g = ag_node_arg(n, a);
        if (g->kind == AG_GA_NODE && g->u.node)
            s += P->info[ag_node_index(g->u.node)].bytes;
    }
    return s;
}

static bool should_ban_recomputation(const ag__part *P, const ag__mincut_opts *o, int i,
                                     int *stack) {
    const ag__pinfo *pi = &P->info[i];
    if (pi->kind != AG_NODE_CALL)
        return false; /* getitem, placeholders, constants */
    if (pi->policy == AG_MUST_SAVE)
        return true;
    if (o->ban_if_not_in_allowlist) {
        if (!pi->recomputable)
            return true;
    } else if (pi->random || pi->compute_intensive ||
               (pi->opflags & (AG_OP_EFFECTFUL | AG_OP_COLLECTIVE))) {
        return true;
    }
    if (o->ban_if_materialized_backward && is_materialized_backwards(P, i, stack))
        return true;
    /* max_dist_from_bw = 1000: `1000 > dist > max_dist_from_bw` never holds. */
    if (o->ban_if_reduction)
        return pi->bytes * 4 < input_bytes(P, i);
    return false;
}

/* Ties n_in to the source unless n is a view, the knapsack allowed its recomputation, or the
 * user asked for it. Random and effectful ops and subgraph calls (a region's forward runs once)
 * are banned regardless, collectives unless tagged
 * MUST (see must_recompute). */
static bool ban(builder *b, int i) {
    const ag__pinfo *pi = &b->P->info[i];
    if (pi->opflags & AG_OP_COLLECTIVE) {
        if (must_recompute(pi))
            return false;
    } else if (!pi->random && !(pi->opflags & (AG_OP_EFFECTFUL | AG_OP_SUBGRAPH))) {
        if (pi->view || (b->dont_ban && b->dont_ban[i]) || must_recompute(pi))
            return false;
    }
    if (!b->banned[i]) {
        b->banned[i] = true;
        add_edge(b, b->net->source, v_in(i), CAP_INF);
    }
    return true;
}

static double node_weight(const ag__part *P, int i) {
    const ag__pinfo *pi = &P->info[i];
    if (pi->tuple)
        return CAP_INF; /* not a tensor: its getitems are what can be saved */
    if (pi->static_input)
        return 0; /* treat_parameters_as_free_to_save */
    int64_t d = pi->dist < 1 ? 1 : pi->dist > 100 ? 100 : pi->dist;
    /* Bias towards saving values close to the backward; upstream's int() truncation. */
    double w = floor((double)pi->bytes * pow(1.1, (double)d));
    return is_materialized(P, i) ? w : 2 * w;
}

/* A small binary min-heap of (order, flag, node) for the two chain scans. */
typedef struct hitem {
    int order, flag, node;
} hitem;
typedef struct heap {
    hitem *v;
    int n;
    int64_t cap;
} heap;

static bool hless(hitem a, hitem b) {
    if (a.order != b.order)
        return a.order < b.order;
    if (a.flag != b.flag)
        return a.flag < b.flag;
    return a.node < b.node;
}

static int hpush(heap *h, hitem x) {
    if (ag__grow((void **)&h->v, &h->cap, h->n + 1, sizeof(hitem)))
        return AG_ENOMEM;
    int i = h->n++;
    h->v[i] = x;
    while (i > 0 && hless(h->v[i], h->v[(i - 1) / 2])) {
        hitem t = h->v[i];
        h->v[i] = h->v[(i - 1) / 2];
        h->v[(i - 1) / 2] = t;
        i = (i - 1) / 2;
    }
    return 0;
}

static hitem hpop(heap *h) {
    hitem top = h->v[0];
    h->v[0] = h->v[--h->n];
    int i = 0;
    for (;;) {
        int l = 2 * i + 1, r = l + 1, m = i;
        if (l < h->n && hless(h->v[l], h->v[m]))
            m = l;
        if (r < h->n && hless(h->v[r], h->v[m]))
            m = r;
        if (m == i)
            break;
        hitem t = h->v[i];
        h->v[i] = h->v[m];
        h->v[m] = t;
        i = m;
    }
    return top;
}

static bool hcontains(const heap *h, hitem x) {
    for (int i = 0; i < h->n; i++)
        if (h->v[i].order == x.order && h->v[i].flag == x.flag && h->v[i].node == x.node)
            return true;
    return false;
}

/* find_first_unfusible: from the forward users of a value, the fw_order of the first node
 * reached through an edge that cannot fuse (max_range when none is within it). */
static int find_first_unfusible(const ag__part *P, heap *h, const int *start, int nstart,
                                int max_range, int *rc) {
    h->n = 0;
    for (int k = 0; k < nstart; k++)
        if ((*rc = hpush(h, (hitem){P->info[start[k]].fw_order, 1, start[k]})))
            return max_range;
    while (h->n) {
        hitem it = hpop(h);
        if (!it.flag)
            return it.order;
        const ag__pinfo *pi = &P->info[it.node];
        for (int u = 0; u < pi->nusers; u++) {
            int user = pi->users[u];
            if (!P->info[user].req_fw || P->info[user].fw_order > max_range)
                continue;
            hitem v = {P->info[user].fw_order, is_fusible(P, it.node, user) ? 1 : 0, user};
            if (!hcontains(h, v) && (*rc = hpush(h, v)))
                return max_range;
        }
    }
    return max_range;
}

/* ban_if_used_far_apart: a value read by a fusible forward user after its first unfusible use
 * would be recomputed far from where it is live; ban those users. */
static void ban_used_far_apart(builder *b, heap *h, int *users) {
    const ag__part *P = b->P;
    for (int i = 0; i < P->nn && !b->rc; i++) {
        const ag__pinfo *pi = &P->info[i];
        if (!pi->req_fw)
            continue;
        int nu = 0, maxo = -1;
        for (int u = 0; u < pi->nusers; u++)
            if (P->info[pi->users[u]].req_fw) {
                users[nu++] = pi->users[u];
                if (P->info[pi->users[u]].fw_order > maxo)
                    maxo = P->info[pi->users[u]].fw_order;
            }
        if (!nu)
            continue;
        int first = find_first_unfusible(P, h, users, nu, maxo, &b->rc);
        for (int u = 0; u < pi->nusers && !b->rc; u++) {
            int user = pi->users[u];
            if (P->info[user].req_fw && P->info[user].fw_order > first && is_fusible(P, i, user) &&
                !b->banned[user])
                ban(b, user);
        }
    }
}

/* ban_if_long_fusible_chains: a fusible chain spanning more than 100 forward positions is cut
 * by banning the node where it runs out. */
static void ban_long_fusible_chains(builder *b, heap *h, bool *visited) {
    const ag__part *P = b->P;
    for (int s = 0; s < P->nn && !b->rc; s++) {
        if (!P->info[s].req_fw)
            continue;
        h->n = 0;
        int start_order = P->info[s].fw_order;
        if ((b->rc = hpush(h, (hitem){start_order, 0, s})))
            return;
        while (h->n) {
            hitem it = hpop(h);
            int cur = it.node;
            if (visited[cur])
                continue;
            visited[cur] = true;
            if (P->info[cur].fw_order > start_order + 100 && h->n == 0) {
                ban(b, cur);
                break;
            }
            const ag__pinfo *pc = &P->info[cur];
            for (int u = 0; u < pc->nusers; u++) {
                int user = pc->users[u];
                if (P->info[user].req_fw && is_fusible(P, cur, user) && !b->banned[user] &&
                    (b->rc = hpush(h, (hitem){P->info[user].fw_order, 0, user})))
                    return;
            }
        }
    }
}

void ag__flow_net_free(ag__flow_net *net) {
    ag__free(net->from);
    ag__free(net->to);
    ag__free(net->cap);
    memset(net, 0, sizeof *net);
}

int ag__mincut_network(const ag__part *P, const ag__mincut_opts *o, const bool *dont_ban,
                       ag__flow_net *net, bool *banned_out) {
    memset(net, 0, sizeof *net);
    net->nverts = 2 + 2 * P->nn;
    net->source = 0;
    net->sink = 1;
    bool *banned = banned_out ? banned_out : ag__calloc((size_t)P->nn, sizeof(bool));
    int *stack = ag__malloc(sizeof(int) * (size_t)(P->nn + 1) * 2);
    bool *visited = ag__calloc((size_t)P->nn, sizeof(bool));
    heap h = {0};
    builder b = {.P = P, .o = o, .dont_ban = dont_ban, .banned = banned, .net = net};
    if (!banned || !stack || !visited) {
        b.rc = AG_ENOMEM;
        goto done;
    }
    if (banned_out)
        memset(banned, 0, (size_t)P->nn);
    for (int i = 0; i < P->nn && !b.rc; i++) {
        const ag__pinfo *pi = &P->info[i];
        if (pi->kind == AG_NODE_OUTPUT)
            continue;
        if (pi->req_bw) {
            if (!pi->primal) {
                add_edge(&b, v_in(i), net->sink, CAP_INF);
                continue;
            }
            /* An input the backward returns as is: x_in on the source, x_out on the sink, so
             * x itself is cut (saved). */
            add_edge(&b, v_out(i), net->sink, CAP_INF);
        }
        if (must_recompute(pi)) {
            /* x_in on the sink's side: x is never saved. */
            add_edge(&b, v_in(i), net->sink, CAP_INF);
            continue;
        }
        if (pi->primal)
            ban(&b, i);
        if (pi->req_fw && should_ban_recomputation(P, o, i, stack))
            ban(&b, i);
        add_edge(&b, v_in(i), v_out(i), node_weight(P, i));
        for (int u = 0; u < pi->nusers; u++)
            if (P->info[pi->users[u]].kind != AG_NODE_OUTPUT)
                add_edge(&b, v_out(i), v_in(pi->users[u]), CAP_INF);
    }
    if (!b.rc && o->ban_if_used_far_apart)
        ban_used_far_apart(&b, &h, stack);
    if (!b.rc && o->ban_if_long_fusible_chains)
        ban_long_fusible_chains(&b, &h, visited);
    if (!b.rc) {
        /* Infinity: more than every finite capacity together, so any cut through an infinite
         * edge costs more than every finite cut. Capacities are integers; keep their sum
         * exactly representable (below 2^52) by scaling weights down if a model is huge. */
        double total = 0;
        for (int e = 0; e < net->nedges; e++)
            if (net->cap[e] != CAP_INF)
                total += net->cap[e];
        double scale = 1;
        while (total / scale >= 4503599627370496.0)
            scale *= 2;
        total = 0;
        for (int e = 0; e < net->nedges; e++)
            if (net->cap[e] != CAP_INF) {
                net->cap[e] = floor(net->cap[e] / scale);
                total += net->cap[e];
            }
        net->inf = total + 1;
        for (int e = 0; e < net->nedges; e++)
            if (net->cap[e] == CAP_INF)
                net->cap[e] = net->inf;
    }
done:
    ag__free(h.v);
    ag__free(stack);
    ag__free(visited);
    if (!banned_out)
        ag__free(banned);
    if (b.rc)
        ag__flow_net_free(net);
    return b.rc;
}

/* ---- max-flow (our Dinic) ----
 *
 * bench/bench_maxflow.c measures it against igraph_maxflow on the zoo's networks (the same flow
 * value on each): with the Release build, 0.8 vs 10 us (mlp), 3.7 vs 24 us (cnn), 14 vs 145 us
 * (gpt2 tiny), 116 vs 2118 us (gpt2-small). These networks are thin (every vertex has one or
 * two out-arcs besides its users) and shallow in flow, where Dinic's few BFS phases beat
 * igraph's push-relabel with its global relabelling, so the partitioner uses this one; igraph
 * stays as the reference the tests and the bench compare against. */

int ag__maxflow_dinic(const ag__flow_net *net, double *value, double *flow) {
    int n = net->nverts, m = 2 * net->nedges;
    int *ints = ag__malloc(sizeof(int) * ((size_t)n * 5 + (size_t)m * 2 + 1));
    double *cap = ag__malloc(sizeof(double) * (size_t)(m + 1));
    if (!ints || !cap) {
        ag__free(ints);
        ag__free(cap);
        return AG_ENOMEM;
    }
    int *head = ints, *level = head + n, *iter = level + n, *queue = iter + n, *path = queue + n;
    int *next = path + n, *to = next + m;
    for (int v = 0; v < n; v++)
        head[v] = -1;
    /* Arc 2e is edge e, arc 2e+1 its reverse; the reverse's residual capacity is e's flow. */
    for (int e = 0; e < net->nedges; e++) {
        int a = 2 * e, b = a + 1, u = net->from[e], w = net->to[e];
        to[a] = w;
        cap[a] = net->cap[e];
        next[a] = head[u];
        head[u] = a;
        to[b] = u;
        cap[b] = 0;
        next[b] = head[w];
        head[w] = b;
    }
    int s = net->source, t = net->sink;
    double total = 0;
    for (;;) {
        /* Levels by BFS over arcs with residual capacity. */
        for (int v = 0; v < n; v++)
            level[v] = -1;
        int qh = 0, qt = 0;
        level[s] = 0;
        queue[qt++] = s;
        while (qh < qt) {
            int v = queue[qh++];
            for (int a = head[v]; a >= 0; a = next[a])
                if (cap[a] > 0 && level[to[a]] < 0) {
                    level[to[a]] = level[v] + 1;
                    queue[qt++] = to[a];
                }
        }
        if (level[t] < 0)
            break;
        /* A blocking flow by depth-first search along level-increasing arcs, iteratively:
         * path[] holds the arcs from s to v. */
        memcpy(iter, head, sizeof(int) * (size_t)n);
        int depth = 0, v = s;
        for (;;) {
            if (v == t) {
                double f = cap[path[0]];
                for (int k = 1; k < depth; k++)
                    if (cap[path[k]] < f)
                        f = cap[path[k]];
                int k0 = -1;
                for (int k = 0; k < depth; k++) {
                    cap[path[k]] -= f;
                    cap[path[k] ^ 1] += f;
                    if (k0 < 0 && cap[path[k]] <= 0)
                        k0 = k;
                }
                total += f;
                depth = k0; /* back to the tail of the first saturated arc */
                v = to[path[k0] ^ 1];
                continue;
            }
            int a = iter[v];
            while (a >= 0 && !(cap[a] > 0 && level[to[a]] == level[v] + 1))
                a = next[a];
            iter[v] = a;
            if (a >= 0) {
                path[depth++] = a;
                v = to[a];
                continue;
            }
            level[v] = -1; /* a dead end for the rest of this phase */
            if (depth == 0)
                break;
            a = path[--depth];
            v = to[a ^ 1];
            iter[v] = next[iter[v]];
        }
    }
    *value = total;
    for (int e = 0; e < net->nedges; e++)
        flow[e] = cap[2 * e + 1];
    ag__free(ints);
    ag__free(cap);
    return 0;
}

/* ---- solve_min_cut ---- */

/* Marks the vertices that can reach the sink in the residual network of `flow`: a residual
 * edge x -> y exists for an edge (x, y) below capacity and for an edge (y, x) carrying flow. */
static int sink_side(const ag__flow_net *net, const double *flow, bool *tside) {
    int nv = net->nverts, ne = net->nedges;
    int *start = ag__calloc((size_t)(2 * nv + 2), sizeof(int));
    int *adj = ag__malloc(sizeof(int) * (size_t)(2 * ne + 1));
    int *queue = ag__malloc(sizeof(int) * (size_t)(nv + 1));
    if (!start || !adj || !queue) {
        ag__free(start);
        ag__free(adj);
        ag__free(queue);
        return AG_ENOMEM;
    }
    /* One list per vertex holding both its in-edges and its out-edges (edge ids). */
    for (int e = 0; e < ne; e++) {
        start[net->to[e] + 1]++;
        start[net->from[e] + 1]++;
    }
    for (int v = 0; v < nv; v++)
        start[v + 1] += start[v];
    int *fill = start + nv + 1;
    memcpy(fill, start, sizeof(int) * (size_t)nv);
    for (int e = 0; e < ne; e++) {
        adj[fill[net->to[e]]++] = e;
        adj[fill[net->from[e]]++] = e;
    }
    int qh = 0, qt = 0;
    tside[net->sink] = true;
    queue[qt++] = net->sink;
    while (qh < qt) {
        int y = queue[qh++];
        for (int k = start[y]; k < start[y + 1]; k++) {
            int e = adj[k], x;
            if (net->to[e] == y && flow[e] < net->cap[e])
                x = net->from[e];
            else if (net->from[e] == y && flow[e] > 0)
                x = net->to[e];
            else
                continue;
            if (!tside[x]) {
                tside[x] = true;
                queue[qt++] = x;
            }
        }
    }
    ag__free(start);
    ag__free(adj);
    ag__free(queue);
    return 0;
}

int ag__solve_min_cut(const ag__part *P, const ag__mincut_opts *o, const bool *dont_ban,
                      int **saved, int *nsaved, bool *banned) {
    *saved = NULL;
    *nsaved = 0;
    ag__flow_net net;
    int rc = ag__mincut_network(P, o, dont_ban, &net, banned);
    if (rc)
        return rc;
    double *flow = ag__malloc(sizeof(double) * (size_t)(net.nedges + 1));
    bool *tside = ag__calloc((size_t)net.nverts, sizeof(bool));
    int *out = ag__malloc(sizeof(int) * (size_t)(P->nn + 1));
    double value = 0;
    if (!flow || !tside || !out) {
        rc = AG_ENOMEM;
        goto done;
    }
    if ((rc = ag__maxflow_dinic(&net, &value, flow)))
        goto done;
    if (!(value < net.inf)) {
        /* Some node the backward needs can only be made from a banned node through another
         * banned node: no finite cut. */
        rc = ag__err(AG_EINVAL, "partition: the min-cut has infinite cost (a value the "
                                "backward needs cannot be saved or recomputed)");
        goto done;
    }
    /* networkx's minimum_cut returns the cut nearest the sink: the sink side is every vertex
     * that can still reach the sink in the residual network. Upstream's tie-breaking depends
     * on it, so compute it rather than take igraph's partition. */
    if ((rc = sink_side(&net, flow, tside)))
        goto done;
    int n = 0;
    for (int i = 0; i < P->nn; i++)
        if (P->info[i].kind != AG_NODE_OUTPUT && !tside[v_in(i)] && tside[v_out(i)])
            out[n++] = i;
    *saved = out;
    *nsaved = n;
    out = NULL;
done:
    ag__free(flow);
    ag__free(tside);
    ag__free(out);
    ag__flow_net_free(&net);
    return rc;
}

/* ---- choose_saved_values_set: the memory budget ----
 *
 * Upstream (AG__BUDGET_RAW): budget 0 saves only the inputs and budget 1 is the runtime-
 * optimized cut. In between it measures the cuts' saved bytes relative to [inputs, optimized]:
 * if the "more aggressive" cut (bans for far-apart uses, long fusible chains and materialized
 * backward uses lifted) or the aggressive one (also the allowlist ban lifted) fits the budget,
 * it is taken; else a knapsack over the aggressive cut's banned nodes chooses which to save
 * (maximizing the runtime they save, each weighing its bytes) within the budget, and the others
 * are allowed to be recomputed (dont_ban) in a final cut.
 *
 * That measures the wrong thing. A saved byte is not a peak byte: a value the backward
 * recomputes is alive from its recomputation to its last use, and recomputation is scheduled
 * just before the first backward user, so recomputing a chain of values recreates them all at
 * the start of the backward. Upstream users see the peak rise as the budget falls (1144, 508,
 * 275, 325, 411 MB at budgets 0.05 to 0.30).
 *
 * The default (AG__BUDGET_PEAK) keeps upstream's candidates but chooses on the peak-memory
 * model (ag__plan_peak: forward and backward simulated with recomputed values' lifetimes):
 *   - the family is fixed, independent of the budget: the inputs-only set, the runtime-optimized
 *     cut, the two more aggressive cuts, and the knapsack's cut for each memory limit of a fixed
 *     grid (0, 1/G, ..., 1);
 *   - each is scored by its planned peak and the FLOPs its backward recomputes;
 *   - budget b allows a peak of minP + b (maxP - minP), where maxP is the runtime-optimized
 *     cut's peak and minP the family's lowest; among the candidates within it the one that
 *     recomputes the fewest FLOPs is taken (ties: lower peak, fewer saved bytes, family order).
 * Monotonic by construction: for b < b' the candidates allowed at b are a subset of those at
 * b'. If the choice at b' is allowed at b it is also the best there (the same order), so both
 * choose it; otherwise its peak exceeds b's limit, which bounds b's choice. Budget 1 is the
 * runtime-optimized cut (peak maxP, the largest allowed anywhere); budget 0 allows only peak
 * minP and takes the inputs-only set when it reaches it (upstream's answer), else the cheapest
 * set that does. */

#define BUDGET_GRID 40

static int copy_ints(const int *v, int n, int **out) {
    *out = ag__malloc(sizeof(int) * (size_t)(n + 1));
    if (!*out)
        return AG_ENOMEM;
    memcpy(*out, v, sizeof(int) * (size_t)n);
    return 0;
}

static int64_t set_bytes(const ag__part *P, const int *v, int n) {
    int64_t s = 0;
    for (int k = 0; k < n; k++)
        s += P->info[v[k]].bytes;
    return s;
}

/* The knapsack's items: the aggressive cut's banned nodes that the backward needs, whose
 * storage is not an input's, and that the user did not mark MUST_SAVE; by size, largest
 * first (graph order among equals). */
typedef struct items {
    int *node, n;
    int *must_save, nmust;
    double *memory, *runtime;
    bool *save;
} items;

static void items_free(items *it) {
    ag__free(it->node);
    ag__free(it->must_save);
    ag__free(it->memory);
    ag__free(it->runtime);
    ag__free(it->save);
    memset(it, 0, sizeof *it);
}

static int items_make(const ag__part *P, const bool *banned, double min_act, double max_act,
                      items *it) {
    memset(it, 0, sizeof *it);
    int nn = P->nn;
    it->node = ag__malloc(sizeof(int) * (size_t)(nn + 1));
    it->must_save = ag__malloc(sizeof(int) * (size_t)(nn + 1));
    it->memory = ag__malloc(sizeof(double) * (size_t)(nn + 1));
    it->runtime = ag__malloc(sizeof(double) * (size_t)(nn + 1));
    it->save = ag__malloc(sizeof(bool) * (size_t)(nn + 1));
    if (!it->node || !it->must_save || !it->memory || !it->runtime || !it->save) {
        items_free(it);
        return AG_ENOMEM;
    }
    for (int i = 0; i < nn; i++) {
        const ag__pinfo *pi = &P->info[i];
        if (!banned[i] || pi->dist >= 1000000000 || P->info[pi->root].primal)
            continue;
        if (pi->policy == AG_MUST_SAVE)
            it->must_save[it->nmust++] = i;
        else
            it->node[it->n++] = i;
    }
    /* Stable insertion sort by size, largest first. */
    for (int k = 1; k < it->n; k++) {
        int x = it->node[k], j = k;
        while (j > 0 && P->info[it->node[j - 1]].bytes < P->info[x].bytes) {
            it->node[j] = it->node[j - 1];
            j--;
        }
        it->node[j] = x;
    }
    for (int k = 0; k < it->n; k++) {
        const ag__pinfo *pi = &P->info[it->node[k]];
        it->memory[k] = ((double)pi->bytes / 1e9) / (max_act - min_act);
        it->runtime[k] = pi->flops > 1 ? pi->flops : 1;
    }
    return 0;
}

/* The knapsack at memory limit `limit`, then the aggressive cut with the items it did not keep
 * allowed to be recomputed. */
static int knapsack_cut(const ag__part *P, items *it, double limit, ag_knapsack solver,
                        const ag__mincut_opts *aggressive, bool *dont_ban, int **saved,
                        int *nsaved) {
    double total;
    int rc = ag__knapsack(solver, it->memory, it->runtime, it->n, limit < 0 ? 0 : limit, it->save,
                          &total);
    if (rc)
        return rc;
    memset(dont_ban, 0, (size_t)P->nn);
    for (int k = 0; k < it->n; k++)
        dont_ban[it->node[k]] = !it->save[k];
    return ag__solve_min_cut(P, aggressive, dont_ban, saved, nsaved, NULL);
}

static int inputs_plus(const ag__part *P, const int *extra, int nextra, int **saved, int *nsaved) {
    int *v = ag__malloc(sizeof(int) * (size_t)(P->nprimals + nextra + 1));
    if (!v)
        return AG_ENOMEM;
    memcpy(v, P->primals, sizeof(int) * (size_t)P->nprimals);
    if (nextra)
        memcpy(v + P->nprimals, extra, sizeof(int) * (size_t)nextra);
    *saved = v;
    *nsaved = P->nprimals + nextra;
    return 0;
}

/* ---- upstream's choice ---- */

static int choose_raw(const ag__part *P, double budget, ag_knapsack solver, int *opt, int nopt,
                      int **saved, int *nsaved) {
    ag__mincut_opts more = ag__mincut_default_opts();
    more.ban_if_used_far_apart = more.ban_if_long_fusible_chains = false;
    more.ban_if_materialized_backward = false;
    ag__mincut_opts aggr = more;
    aggr.ban_if_not_in_allowlist = false;
    double min_act = (double)set_bytes(P, P->primals, P->nprimals) / 1e9;
    double max_act = (double)set_bytes(P, opt, nopt) / 1e9;
    if (max_act <= min_act)
        return copy_ints(opt, nopt, saved) ? AG_ENOMEM : (*nsaved = nopt, 0);
    int *v = NULL, n = 0;
    int rc = ag__solve_min_cut(P, &more, NULL, &v, &n, NULL);
    if (rc)
        return rc;
    if (((double)set_bytes(P, v, n) / 1e9 - min_act) / (max_act - min_act) < budget) {
        *saved = v;
        *nsaved = n;
        return 0;
    }
    ag__free(v);
    bool *banned = ag__calloc((size_t)P->nn, 2 * sizeof(bool));
    if (!banned)
        return AG_ENOMEM;
    if ((rc = ag__solve_min_cut(P, &aggr, NULL, &v, &n, banned))) {
        ag__free(banned);
        return rc;
    }
    if (((double)set_bytes(P, v, n) / 1e9 - min_act) / (max_act - min_act) < budget) {
        ag__free(banned);
        *saved = v;
        *nsaved = n;
        return 0;
    }
    ag__free(v);
    items it;
    if ((rc = items_make(P, banned, min_act, max_act, &it))) {
        ag__free(banned);
        return rc;
    }
    if (it.n == 0)
        rc = inputs_plus(P, it.must_save, it.nmust, saved, nsaved);
    else
        rc = knapsack_cut(P, &it, budget, solver, &aggr, banned + P->nn, saved, nsaved);
    items_free(&it);
    ag__free(banned);
    return rc;
}

/* ---- the peak-aware choice ---- */

typedef struct cand {
    int *saved, n;
    ag__peak pk;
    int64_t bytes;
} cand;

static bool same_set(const cand *a, const int *v, int n) {
    if (a->n != n)
        return false;
    for (int k = 0; k < n; k++)
        if (a->saved[k] != v[k])
            return false;
    return true;
}

/* Adds a candidate (taking v) unless the family already has that set; scores it. */
static int add_cand(const ag__part *P, cand *c, int *nc, int *v, int n) {
    ag__plan pl;
    int rc = ag__save_random_nodes(P, &v, &n, &pl);
    if (rc) {
        ag__free(v);
        return rc;
    }
    ag__free(v);
    for (int k = 0; k < *nc; k++)
        if (same_set(&c[k], pl.saved, pl.nsaved)) {
            ag__plan_free(&pl);
            return 0;
        }
    cand *x = &c[*nc];
    rc = ag__plan_peak(P, &pl, &x->pk);
    if (rc == 0) {
        x->saved = pl.saved;
        x->n = pl.nsaved;
        pl.saved = NULL;
        x->bytes = set_bytes(P, x->saved, x->n);
        (*nc)++;
    }
    ag__plan_free(&pl);
    return rc;
}

/* a before b in the choice order: fewer recomputed FLOPs, lower peak, fewer saved bytes. */
static bool cand_better(const cand *a, const cand *b) {
    if (a->pk.recompute_flops != b->pk.recompute_flops)
        return a->pk.recompute_flops < b->pk.recompute_flops;
    if (a->pk.peak != b->pk.peak)
        return a->pk.peak < b->pk.peak;
    return a->bytes < b->bytes;
}

static int choose_peak(const ag__part *P, double budget, ag_knapsack solver, int *opt, int nopt,
                       int **saved, int *nsaved) {
    ag__mincut_opts more = ag__mincut_default_opts();
    more.ban_if_used_far_apart = more.ban_if_long_fusible_chains = false;
    more.ban_if_materialized_backward = false;
    ag__mincut_opts aggr = more;
    aggr.ban_if_not_in_allowlist = false;
    cand *c = ag__calloc(BUDGET_GRID + 8, sizeof *c);
    bool *banned = ag__calloc((size_t)P->nn, 2 * sizeof(bool));
    int nc = 0, rc = AG_ENOMEM, *v = NULL, n = 0;
    items it = {0};
    if (!c || !banned)
        goto done;
    /* c[0]: inputs only; c[1]: the runtime-optimized cut (budget 1). */
    if ((rc = inputs_plus(P, NULL, 0, &v, &n)) || (rc = add_cand(P, c, &nc, v, n)))
        goto done;
    int opt_at = nc;
    if ((rc = copy_ints(opt, nopt, &v)) || (rc = add_cand(P, c, &nc, v, nopt)))
        goto done;
    if (opt_at == nc) /* the optimized cut saves only inputs */
        opt_at = 0;
    if ((rc = ag__solve_min_cut(P, &more, NULL, &v, &n, NULL)) || (rc = add_cand(P, c, &nc, v, n)))
        goto done;
    if ((rc = ag__solve_min_cut(P, &aggr, NULL, &v, &n, banned)) ||
        (rc = add_cand(P, c, &nc, v, n)))
        goto done;
    double min_act = (double)set_bytes(P, P->primals, P->nprimals) / 1e9;
    double max_act = (double)set_bytes(P, opt, nopt) / 1e9;
    if (max_act > min_act) {
        if ((rc = items_make(P, banned, min_act, max_act, &it)))
            goto done;
        if (it.n == 0) {
            if ((rc = inputs_plus(P, it.must_save, it.nmust, &v, &n)) ||
                (rc = add_cand(P, c, &nc, v, n)))
                goto done;
        }
        for (int k = 0; it.n && k <= BUDGET_GRID; k++)
            if ((rc = knapsack_cut(P, &it, (double)k / BUDGET_GRID, solver, &aggr, banned + P->nn,
                                   &v, &n)) ||
                (rc = add_cand(P, c, &nc, v, n)))
                goto done;
    }
    int64_t minp = c[0].pk.peak, maxp = c[opt_at].pk.peak;
    for (int k = 0; k < nc; k++)
        if (c[k].pk.peak < minp)
            minp = c[k].pk.peak;
    /* The allowed peak; at budget 0 the inputs-only set wins when it reaches the minimum. */
    double limit = (double)minp + budget * (double)(maxp - minp);
    bool inputs_only = budget <= 0 && c[0].pk.peak <= minp;
    int best = inputs_only ? 0 : -1;
    for (int k = 0; !inputs_only && k < nc; k++)
        if ((double)c[k].pk.peak <= limit && (best < 0 || cand_better(&c[k], &c[best])))
            best = k;
    *saved = c[best].saved;
    *nsaved = c[best].n;
    c[best].saved = NULL;
    rc = 0;
done:
    if (c)
        for (int k = 0; k < nc; k++)
            ag__free(c[k].saved);
    ag__free(c);
    ag__free(banned);
    items_free(&it);
    return rc;
}

int ag__choose_saved(const ag__part *P, double budget, ag_knapsack solver, ag__budget_mode mode,
                     int **saved, int *nsaved) {
    *saved = NULL;
    *nsaved = 0;
    if (!(budget >= 0 && budget <= 1))
        return ag__err(AG_EINVAL, "partition: memory budget %g is outside [0, 1]", budget);
    if (budget == 0 && mode == AG__BUDGET_RAW)
        return inputs_plus(P, NULL, 0, saved, nsaved);
    ag__mincut_opts o = ag__mincut_default_opts();
    int *opt = NULL, nopt = 0;
    int rc = ag__solve_min_cut(P, &o, NULL, &opt, &nopt, NULL);
    if (rc)
        return rc;
    if (budget == 1) {
        *saved = opt;
        *nsaved = nopt;
        return 0;
    }
    rc = mode == AG__BUDGET_RAW ? choose_raw(P, budget, solver, opt, nopt, saved, nsaved)
                                : choose_peak(P, budget, solver, opt, nopt, saved, nsaved);
    ag__free(opt);
    return rc;
}
