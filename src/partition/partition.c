/* Partitioning a joint graph into a forward and a backward graph (upstream's
 * torch/_functorch/partitioners.py; spec section 7).
 *
 * In: a joint graph (primals..., tangents...) -> (forward outputs..., grads...) whose first
 * num_fwd_outputs outputs are the forward's. Out: two new graphs,
 *   forward:  (primals...) -> (forward outputs..., saved...), the saved outputs described by
 *             SavedForBackwardsAOTOutput(i), the others keeping the joint's descriptors;
 *   backward: (saved..., tangents...) -> (grads...), tangent and grad descriptors kept, its
 *             nodes in the order the autograd engine would run them.
 *
 * This file holds what both partitioners share: the classification of joint nodes (primals,
 * tangents, required forward / backward nodes, dist_from_bw), the materialization as graphs of
 * what each side runs for a saved set (the "plan", computed first on node indices by
 * side_plan.c, with the backward reordering and the peak-memory model, so the budget search can
 * score many saved sets cheaply), upstream's default_partition, the public ag_partition and
 * ag_tag_region_recompute. The min-cut choice of the saved set lives in mincut.c; the entry
 * points that partition a joint's regions first (ag_partition, ag__partition_ex) in
 * subgraph_partition.c. */
#include "partition_internal.h"
#include "side_plan.h"

#include <assert.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

/* ---- small helpers ---- */

static int idx_of(const ag_node *n) {
    return ag__node_index(n);
}

static int64_t tmeta_bytes(const ag_tmeta *m) {
    return ag__numel(m->ndim, m->sizes) * (int64_t)ag_dtype_size(m->dtype);
}

/* ---- classification ---- */

/* The operand that output k of subgraph call n passes through (its subgraph returns a
 * placeholder there), or NULL. The executor reads the operand instead of a copy (plan.c). */
static ag_node *passed_operand(const ag_node *n, int k) {
    const ag_graph *sub = ag__node_subgraph(ag__node_arg_node(n, 0));
    const ag_node *o = sub ? ag_graph_output_node(sub) : NULL;
    const ag_garg *oa = o ? ag__node_arg(o, 0) : NULL;
    if (!oa || oa->kind != AG_GA_NODES || k < 0 || k >= oa->n || !oa->u.nodes[k] ||
        ag_node_kind_of(oa->u.nodes[k]) != AG_NODE_PLACEHOLDER)
        return NULL;
    int j = 0;
    for (ag_node *y = ag_graph_first(sub); y && y != oa->u.nodes[k]; y = ag__node_next(y))
        j += ag_node_kind_of(y) == AG_NODE_PLACEHOLDER;
    const ag_garg *ops = ag__node_arg(n, 2);
    return ops && ops->kind == AG_GA_NODES && j < ops->n ? ops->u.nodes[j] : NULL;
}

/* passed_operand with the last subgraph's outputs worked out once (a region's calls all call
 * one subgraph, each asked for every output). */
typedef struct pass_memo {
    const ag_graph *sub;
    int ph[AG_MAX_OUTPUTS], n;
} pass_memo;

static ag_node *passed_operand_memo(const ag_node *n, int k, pass_memo *m) {
    const ag_graph *sub = ag__node_subgraph(ag__node_arg_node(n, 0));
    if (!sub)
        return NULL;
    if (k >= AG_MAX_OUTPUTS)
        return passed_operand(n, k);
    if (sub != m->sub) {
        m->n = ag__subgraph_passthrough(sub, m->ph, AG_MAX_OUTPUTS);
        m->sub = sub;
    }
    int j = k >= 0 && k < m->n ? m->ph[k] : -1;
    const ag_garg *ops = ag__node_arg(n, 2);
    return j >= 0 && ops && ops->kind == AG_GA_NODES && j < ops->n ? ops->u.nodes[j] : NULL;
}

void ag__part_free(ag__part *P) {
    ag__free(P->pool);
    ag__free(P->info);
    if (P->g_borrowed)
        P->g = NULL;
    ag__free(P->outs);
    ag__free(P->primals);
    ag__free(P->tangents);
    ag_graph_free(P->g);
    memset(P, 0, sizeof *P);
}

/* Distinct argument nodes of n, as indices. */
/* The node references of n's arguments (None elements not counted). */
static int64_t count_refs(const ag_node *n) {
    int64_t c = 0;
    for (int a = 0; a < ag__node_nargs(n); a++) {
        const ag_garg *g = ag__node_arg(n, a);
        for (int e = 0, k = ag__garg_nrefs(g); e < k; e++)
            c += ag__garg_ref(g, e) != NULL;
    }
    return c;
}

/* pi->args (already pointing at room for every reference of n): the distinct nodes n reads,
 * in argument order. mark[] (one int per node, never equal to `stamp` before this call) tells
 * the ones already taken. */
static void collect_args(ag__pinfo *pi, const ag_node *n, int *mark, int stamp) {
    int cnt = 0;
    for (int a = 0; a < ag__node_nargs(n); a++) {
        const ag_garg *g = ag__node_arg(n, a);
        int k = ag__garg_nrefs(g);
        for (int e = 0; e < k; e++) {
            const ag_node *m = ag__garg_ref(g, e);
            if (!m)
                continue;
            int x = idx_of(m);
            if (mark[x] == stamp)
                continue;
            mark[x] = stamp;
            pi->args[cnt++] = x;
        }
    }
    pi->nargs = cnt;
}

/* upstream's cleanup_recompute_tags: when two checkpointed regions touch with no operator in
 * between, the value at the boundary is still stashed: a must-recompute node read by a
 * must-recompute node of a later region (a larger ac_graph_id) becomes MUST_SAVE. */
static int cleanup_recompute_tags(ag_graph *g) {
    for (ag_node *n = ag_graph_first(g); n; n = ag__node_next(n)) {
        ag_recompute r = ag_node_recompute(n);
        if (r != AG_MUST_RECOMPUTE && r != AG_PREFER_RECOMPUTE)
            continue;
        ag_mval id = ag_node_meta_get(n, "ac_graph_id");
        for (int u = 0; u < ag__node_num_users(n); u++) {
            ag_node *user = ag__node_user(n, u);
            ag_recompute ru = ag_node_recompute(user);
            ag_mval uid = ag_node_meta_get(user, "ac_graph_id");
            if ((ru == AG_MUST_RECOMPUTE || ru == AG_PREFER_RECOMPUTE) && id.kind == AG_MV_INT &&
                uid.kind == AG_MV_INT && uid.u.i > id.u.i) {
                int rc = ag_node_set_recompute(n, AG_MUST_SAVE);
                if (rc)
                    return rc;
                break;
            }
        }
    }
    return 0;
}

static bool has_recompute_tags(const ag_graph *g) {
    for (ag_node *n = ag_graph_first(g); n; n = ag__node_next(n)) {
        ag_recompute r = ag_node_recompute(n);
        if (r == AG_MUST_RECOMPUTE || r == AG_PREFER_RECOMPUTE)
            return true;
    }
    return false;
}

/* Backward inputs: tangents, backward tokens and the backward's philox seed and offset, told
 * by their descriptors' sections; other placeholders (primals, the forward's tokens and philox
 * inputs) are forward inputs. A graph built without descriptors is read by upstream's naming
 * rule. */
static bool is_bw_input(const ag_node *n) {
    const ag_desc *pd = ag_node_desc(n);
    ag_section sec = pd ? ag_desc_section(pd) : AG_SEC_NONE;
    const char *nm = ag__node_name(n);
    return pd ? sec == AG_SEC_IN_TANGENTS || sec == AG_SEC_IN_BW_TOKENS || sec == AG_SEC_IN_BW_RNG
              : strstr(nm, "tangents") || strstr(nm, "bwd_seed") || strstr(nm, "bwd_base_offset");
}

/* The joint the partitioner reads (P->g): verified unless the caller has, and without dead
 * code or touching checkpoint regions. Fills P->g, g_borrowed, nn, num_fwd_outputs, nouts. */
static int part_graph(ag__part *P, const ag_graph *joint, int num_fwd_outputs, bool verified) {
    memset(P, 0, sizeof *P);
    P->meta_budget = -1;
    if (!joint)
        return ag__err(AG_EINVAL, "partition: NULL joint graph");
    if (!ag_graph_output_node(joint))
        return ag__err(AG_EINVAL, "partition: the joint graph has no output node");
    int rc = verified ? 0 : ag_graph_verify(joint);
    if (rc)
        return rc;
    int nouts = ag__node_arg(ag_graph_output_node(joint), 0)->n;
    if (num_fwd_outputs < 0 || num_fwd_outputs > nouts)
        return ag__err(AG_EINVAL, "partition: num_fwd_outputs %d is outside [0, %d]",
                       num_fwd_outputs, nouts);
    /* upstream: DCE first, then clean the recompute tags of touching regions. Both change a
     * private copy; a joint they would leave as it is (an exported joint has no dead code and
     * usually no recompute tags) is read in place. */
    if (!ag__graph_has_dead_code(joint) && !has_recompute_tags(joint)) {
        P->g = (ag_graph *)joint; /* only read from here on */
        P->g_borrowed = true;
    } else {
        P->g = ag_graph_copy(joint);
        if (!P->g)
            return ag_last_status() ? ag_last_status() : AG_ENOMEM;
        if ((rc = ag_graph_dce(P->g)) < 0 || (rc = cleanup_recompute_tags(P->g)) < 0) {
            ag__part_free(P);
            return rc;
        }
    }
    P->nn = ag_graph_num_nodes(P->g);
    P->num_fwd_outputs = num_fwd_outputs;
    P->nouts = nouts;
    return 0;
}

int ag__part_init_req_bw(ag__part *P, const ag_graph *joint, int num_fwd_outputs, bool **req_bw) {
    *req_bw = NULL;
    int rc = part_graph(P, joint, num_fwd_outputs, false);
    if (rc)
        return rc;
    bool *req = ag__calloc((size_t)(P->nn ? P->nn : 1), sizeof *req);
    if (!req) {
        ag__part_free(P);
        return AG_ENOMEM;
    }
    /* What ag__part_init_ex's sweep marks: a node is required by the backward when it is a
     * backward input or must be in the backward, or reads one that is (its arguments come
     * before it); then a subgraph's get_attr by all of its users, and the backward outputs. */
    int i = 0;
    for (ag_node *n = ag_graph_first(P->g); n; n = ag__node_next(n), i++) {
        ag_node_kind k = ag__node_kind(n);
        if (k == AG_NODE_OUTPUT)
            continue;
        const char *tag = ag_node_partitioner_tag(n);
        bool r =
            k == AG_NODE_PLACEHOLDER ? is_bw_input(n) : tag && !strcmp(tag, "must_be_in_backward");
        if (!r && k == AG_NODE_CALL && tag && ag_op_with_effects_target(ag__node_op(n)))
            r = !strcmp(tag, "is_backward");
        for (int a = 0; a < ag__node_nargs(n) && !r; a++) {
            const ag_garg *g = ag__node_arg(n, a);
            int cnt = ag__garg_nrefs(g);
            for (int e = 0; e < cnt && !r; e++) {
                const ag_node *m = ag__garg_ref(g, e);
                r = m && req[idx_of(m)];
            }
        }
        req[i] = r;
    }
    i = 0;
    for (ag_node *n = ag_graph_first(P->g); n; n = ag__node_next(n), i++) {
        if (ag__node_kind(n) != AG_NODE_GET_ATTR || !ag__node_subgraph(n))
            continue;
        bool bw = ag__node_num_users(n) > 0;
        for (int u = 0; u < ag__node_num_users(n); u++)
            bw &= req[idx_of(ag__node_user(n, u))];
        req[i] = bw;
    }
    const ag_garg *oa = ag__node_arg(ag_graph_output_node(P->g), 0);
    for (int k = num_fwd_outputs; k < P->nouts; k++)
        if (oa->u.nodes[k])
            req[idx_of(oa->u.nodes[k])] = true;
#ifndef NDEBUG
    /* Debug builds (the sanitizer runs of the tests) check the sweep against the full one. */
    ag__part F;
    int frc = ag__part_init_ex(&F, P->g, num_fwd_outputs, true);
    if (frc) {
        ag__free(req);
        ag__part_free(P);
        return frc;
    }
    assert(F.nn == P->nn);
    for (int k = 0; k < F.nn; k++)
        assert(F.info[k].req_bw == req[k]);
    ag__part_free(&F);
#endif
    *req_bw = req;
    return 0;
}

int ag__part_init(ag__part *P, const ag_graph *joint, int num_fwd_outputs) {
    return ag__part_init_ex(P, joint, num_fwd_outputs, false);
}

int ag__part_init_ex(ag__part *P, const ag_graph *joint, int num_fwd_outputs, bool verified) {
    int *mark = NULL;
    int rc = part_graph(P, joint, num_fwd_outputs, verified);
    if (rc)
        return rc;
    int nouts = P->nouts;
    P->info = ag__calloc((size_t)P->nn, sizeof *P->info);
    P->outs = ag__malloc(sizeof(int) * (size_t)(nouts ? nouts : 1));
    P->primals = ag__malloc(sizeof(int) * (size_t)P->nn);
    P->tangents = ag__malloc(sizeof(int) * (size_t)P->nn);
    mark = ag__malloc(sizeof(int) * (size_t)P->nn);
    /* Every node's distinct arguments and distinct users, in one block: each list holds at
     * most the node's references, so twice the graph's references bound the total. */
    int64_t refs = 0, pooled = 0;
    for (ag_node *n = ag_graph_first(P->g); n; n = ag__node_next(n))
        refs += count_refs(n);
    P->pool = ag__malloc(sizeof(int) * (size_t)(2 * refs + 1));
    rc = AG_ENOMEM;
    if (!P->info || !P->outs || !P->primals || !P->tangents || !mark || !P->pool)
        goto fail;
    for (int k = 0; k < P->nn; k++)
        mark[k] = -1;

    /* Per-node facts. */
    int i = 0;
    const ag_graph *seen_sub[8]; /* subgraphs called, with their sub_extra and cost */
    int64_t seen_extra[8];
    double seen_flops[8];
    int nseen = 0, next_seen = 0;
    const char *mb_key = ag__meta_interned("memory_budget"); /* found by pointer */
    pass_memo pm = {0};
    for (ag_node *n = ag_graph_first(P->g); n; n = ag__node_next(n), i++) {
        ag__pinfo *pi = &P->info[i];
        pi->node = n;
        pi->kind = ag__node_kind(n);
        pi->fw_order = -1;
        pi->root = i;
        pi->args = P->pool + pooled;
        collect_args(pi, n, mark, i);
        pooled += pi->nargs;
        const char *tag = ag_node_partitioner_tag(n);
        pi->must_fw = tag && !strcmp(tag, "must_be_in_forward");
        pi->must_bw = tag && !strcmp(tag, "must_be_in_backward");
        pi->policy = ag_node_recompute(n);
        if (pi->policy == AG_MUST_RECOMPUTE || pi->policy == AG_PREFER_RECOMPUTE)
            P->has_recompute_tags = true;
        ag_mval mb = ag_node_meta_get(n, mb_key);
        if (mb.kind == AG_MV_FLOAT && P->meta_budget < 0)
            P->meta_budget = mb.u.f;
        if (pi->kind == AG_NODE_PLACEHOLDER) {
            pi->tangent = is_bw_input(n);
            pi->primal = !pi->tangent;
            if (pi->primal)
                P->primals[P->nprimals++] = i;
            else
                P->tangents[P->ntangents++] = i;
            const ag_desc *d = ag_node_desc(n);
            /* A subclass parameter's inner tensors too (upstream's static_input_indices count
             * the flattened inputs): ag_desc_is_param/_buffer look through the subclass. */
            pi->static_input = pi->primal && d && (ag_desc_is_param(d) || ag_desc_is_buffer(d));
            pi->external = true;
        } else if (pi->kind == AG_NODE_GET_ATTR) {
            pi->external = true;
        } else if (pi->kind == AG_NODE_OUTPUT) {
            P->out = i;
        }
        if (pi->kind == AG_NODE_CALL) {
            const ag_op *op = ag__node_op(n);
            pi->opflags = ag_op_def(op)->flags;
            pi->tuple = ag_op_noutputs(op) != 1 || (pi->opflags & AG_OP_SUBGRAPH);
            bool costed = false;
            if (pi->opflags & AG_OP_SUBGRAPH) {
                /* What its subgraph holds while it runs (peak model) and what a run costs,
                 * once per subgraph (the last few remembered), not once per call. */
                const ag_graph *sub = ag__node_subgraph(ag__node_arg_node(n, 0));
                pi->sub_extra = -1;
                for (int e = 0; e < nseen && pi->sub_extra < 0; e++)
                    if (seen_sub[e] == sub) {
                        pi->sub_extra = seen_extra[e];
                        pi->flops = seen_flops[e];
                        costed = true;
                    }
                if (pi->sub_extra < 0 && sub) {
                    ag_cost c;
                    if ((pi->sub_extra = ag__subgraph_extra_bytes(sub)) < 0) {
                        rc = (int)pi->sub_extra;
                        goto fail;
                    }
                    if ((rc = ag__node_cost(n, &c)))
                        goto fail;
                    pi->flops = c.flops;
                    costed = true;
                    seen_sub[next_seen] = sub;
                    seen_extra[next_seen] = pi->sub_extra;
                    seen_flops[next_seen] = pi->flops;
                    next_seen = (next_seen + 1) % 8;
                    nseen = nseen < 8 ? nseen + 1 : 8;
                }
                if (pi->sub_extra < 0)
                    pi->sub_extra = 0;
            }
            pi->effectful = (pi->opflags & (AG_OP_EFFECTFUL | AG_OP_INPLACE)) != 0;
            /* upstream's _must_be_in_backward: a backward with_effects stays in the backward;
             * a forward one stays in the forward (an effect is never run twice). */
            if (ag_op_with_effects_target(op) && tag) {
                pi->must_bw |= !strcmp(tag, "is_backward");
                pi->must_fw |= !strcmp(tag, "is_forward");
            }
            ag__op_classes(op, &pi->recomputable, &pi->random, &pi->compute_intensive, &pi->view,
                           &pi->is_cat);
            pi->fusible = pi->recomputable || pi->random;
            ag_cost c;
            if (!costed && (rc = ag__node_cost(n, &c)))
                goto fail;
            if (!costed)
                pi->flops = c.flops;
            /* A view shares its base's storage (peak model). */
            if (pi->view && pi->nargs > 0) {
                pi->root = P->info[pi->args[0]].root;
                pi->external = P->info[pi->root].external;
            }
        } else if (pi->kind == AG_NODE_GETITEM) {
            pi->recomputable = pi->fusible = true; /* operator.getitem is in upstream's list */
            /* An operand a subgraph call passes through: the operand's storage (peak model). */
            ag_node *src = ag__node_arg_node(n, 0);
            ag_node *opnd = src && (ag_op_def(ag__node_op(src))->flags & AG_OP_SUBGRAPH)
                                ? passed_operand_memo(src, (int)ag__node_arg(n, 1)->u.i, &pm)
                                : NULL;
            if (opnd) {
                pi->pass = idx_of(opnd) + 1;
                pi->root = P->info[pi->pass - 1].root;
                pi->external = P->info[pi->root].external;
            }
        }
        for (int v = 0; v < ag__node_num_vals(n); v++)
            if (!(pi->opflags & AG_OP_SUBGRAPH) || !passed_operand_memo(n, v, &pm))
                pi->bytes += tmeta_bytes(ag__node_val(n, v));
    }
    ag__free(mark);
    mark = NULL;
    /* Users: distinct, in graph order (each user appears once in ag_node_user). */
    for (i = 0; i < P->nn; i++) {
        ag__pinfo *pi = &P->info[i];
        int k = ag__node_num_users(pi->node);
        if (k) {
            pi->users = P->pool + pooled;
            pooled += k;
            for (int u = 0; u < k; u++)
                pi->users[u] = idx_of(ag__node_user(pi->node, u));
            /* Users are listed in creation order, mostly graph order already (a region call
             * has one user per output): sorted only when they are not. */
            bool sorted = true;
            for (int u = 1; u < k && sorted; u++)
                sorted = pi->users[u - 1] < pi->users[u];
            if (!sorted && k > 8) {
                qsort(pi->users, (size_t)k, sizeof(int), ag__cmp_int);
            } else if (!sorted) { /* most values have one or two users: no qsort call */
                for (int u = 1; u < k; u++)
                    for (int v = u; v > 0 && pi->users[v - 1] > pi->users[v]; v--) {
                        int x = pi->users[v];
                        pi->users[v] = pi->users[v - 1];
                        pi->users[v - 1] = x;
                    }
            }
            pi->nusers = k;
        }
    }
    const ag_garg *oa = ag__node_arg(P->info[P->out].node, 0);
    for (int k = 0; k < nouts; k++)
        P->outs[k] = oa->u.nodes[k] ? idx_of(oa->u.nodes[k]) : -1;

    /* required_bw_nodes: tangents, must_be_in_backward nodes and their users, transitively
     * (users come later, so one sweep in graph order closes the set), plus backward outputs. */
    for (i = 0; i < P->nn; i++) {
        ag__pinfo *pi = &P->info[i];
        if (pi->kind == AG_NODE_OUTPUT)
            continue;
        if (pi->tangent || pi->must_bw)
            pi->req_bw = true;
        if (pi->req_bw)
            for (int u = 0; u < pi->nusers; u++)
                P->info[pi->users[u]].req_bw = true;
    }
    P->info[P->out].req_bw = false;
    /* A get_attr of a subgraph called only by backward nodes stays in the backward (it has no
     * tensor value and is never saved); one of a forward call is free, as a constant. */
    for (i = 0; i < P->nn; i++) {
        ag__pinfo *pi = &P->info[i];
        if (pi->kind != AG_NODE_GET_ATTR || !ag__node_subgraph(pi->node))
            continue;
        bool bw = pi->nusers > 0;
        for (int u = 0; u < pi->nusers; u++)
            bw &= P->info[pi->users[u]].req_bw;
        pi->req_bw = pi->must_bw = bw;
    }
    for (int k = num_fwd_outputs; k < nouts; k++)
        if (P->outs[k] >= 0)
            P->info[P->outs[k]].req_bw = true;
    /* required_fw_nodes: the forward-only graph's nodes (primals -> forward outputs). */
    {
        bool *is_in = ag__calloc((size_t)P->nn, 3 * sizeof(bool));
        if (!is_in)
            goto fail;
        bool *valid = is_in + P->nn, *needed = valid + P->nn;
        for (int k = 0; k < P->nprimals; k++)
            is_in[P->primals[k]] = true;
        rc = ag__side_nodes(P, is_in, false, P->outs, num_fwd_outputs, valid, needed);
        int order = 0;
        for (i = 0; rc == 0 && i < P->nn; i++)
            if (needed[i] && ag__is_body_kind(P->info[i].kind)) {
                P->info[i].req_fw = true;
                P->info[i].fw_order = order++;
            }
        ag__free(is_in);
        if (rc)
            goto fail;
    }
    for (i = 0; i < P->nn; i++)
        P->nreq_bw += P->info[i].req_bw;
    /* dist_from_bw: how many forward steps separate a node from the backward. */
    for (i = P->nn - 1; i >= 0; i--) {
        ag__pinfo *pi = &P->info[i];
        if (pi->kind == AG_NODE_OUTPUT) {
            pi->dist = 1000000000;
        } else if (!pi->req_fw) {
            pi->dist = 0;
        } else {
            pi->dist = 1000000000;
            for (int u = 0; u < pi->nusers; u++) {
                int64_t d = P->info[pi->users[u]].dist + 1;
                if (d < pi->dist)
                    pi->dist = d;
            }
        }
    }
    return 0;
fail:
    ag__free(mark);
    if (rc >= 0)
        rc = AG_ENOMEM;
    ag__part_free(P);
    return rc;
}

/* ---- materializing the graphs ---- */

/* Copies node metadata (every key, custom annotations) from src to dst. */
static int copy_meta(ag_node *dst, const ag_node *src) {
    int rc = ag__node_meta_copy(dst, src); /* strings shared with the joint's nodes */
    return rc ? rc : ag_node_custom_copy(dst, src);
}

/* The copy of joint node d in the side being built: one made before (a side's nodes are built
 * in an order where every argument comes first, which is what lets ag_compile_joint's
 * executor skip verifying the sides; ag__plan_new_verified), else NULL with a message. */
static ag_node *env_of(ag_node **env, const ag_node *d, const ag_node *user) {
    ag_node *m = env[idx_of(d)];
    if (!m)
        ag__err(AG_EINVAL, "partition: %%%s reads %%%s, which its side does not compute before it",
                ag__node_name(user), ag__node_name(d));
    return m;
}

/* env_of for a tuple's elements (ag__garg_tuple_map). */
struct env_ctx {
    ag_node **env;
    const ag_node *user;
};

static ag_node *env_node(void *ctx, const ag_node *x) {
    struct env_ctx *c = ctx;
    return env_of(c->env, x, c->user);
}

/* Copies body node x of the joint into dst, its node arguments mapped through env. */
static ag_node *copy_node(ag_graph *dst, const ag__part *P, int x, ag_node **env) {
    const ag_node *n = P->info[x].node;
    ag_node *m = NULL;
    switch (ag__node_kind(n)) {
    case AG_NODE_CALL: {
        int na = ag__node_nargs(n);
        ag_garg args[AG_MAX_ARGS] = {0};
        ag_node **lists[AG_MAX_ARGS] = {0};
        bool ok = true;
        for (int a = 0; a < na && ok; a++) {
            args[a] = *ag__node_arg(n, a);
            if (args[a].kind == AG_GA_NODE && args[a].u.node) {
                ok = (args[a].u.node = env_of(env, args[a].u.node, n)) != NULL;
            } else if (args[a].kind == AG_GA_TUPLE) {
                struct env_ctx ec = {env, n};
                ag_garg *t = ag__garg_tuple_map(&args[a], env_node, &ec);
                lists[a] = (ag_node **)(void *)t;
                ok = t != NULL;
                args[a].u.elems = t;
            } else if (args[a].kind == AG_GA_NODES) {
                lists[a] = ag__malloc(sizeof(ag_node *) * (size_t)(args[a].n ? args[a].n : 1));
                if (!lists[a]) {
                    ok = false;
                    break;
                }
                for (int e = 0; e < args[a].n && ok; e++)
                    ok = !(lists[a][e] = args[a].u.nodes[e] ? env_of(env, args[a].u.nodes[e], n)
                                                            : NULL) == !args[a].u.nodes[e];
                args[a].u.nodes = lists[a];
            }
        }
        if (ok) /* the vals are the joint node's (copied by the new node) */
            m = ag__graph_call_vals(dst, n->op, args, na, n->vals, n->nvals, n->name);
        for (int a = 0; a < na; a++)
            ag__free(lists[a]);
        break;
    }
    case AG_NODE_GETITEM: {
        ag_node *src = env_of(env, ag__node_arg_node(n, 0), n);
        m = src ? ag_graph_getitem(dst, src, (int)ag__node_arg(n, 1)->u.i, ag__node_name(n)) : NULL;
        break;
    }
    case AG_NODE_GET_ATTR: {
        const ag_graph *sub = ag__node_subgraph(n);
        if (!sub) {
            m = ag_graph_get_attr(dst, ag_node_constant(n), ag__node_name(n));
            break;
        }
        /* A subgraph: the side takes a copy of the attribute on its first get_attr. */
        const char *attr = NULL;
        for (int k = 0; k < ag_graph_num_subgraphs(P->g) && !attr; k++)
            if (ag_graph_subgraph_at(P->g, k, &attr) != sub)
                attr = NULL;
        if (attr && !ag_graph_subgraph(dst, attr)) {
            ag_graph *c = ag_graph_copy(sub);
            if (!c || ag_graph_add_subgraph(dst, attr, c)) {
                ag_graph_free(c);
                return NULL;
            }
        }
        m = attr ? ag_graph_get_attr_subgraph(dst, attr, ag__node_name(n)) : NULL;
        break;
    }
    default:
        ag__err(AG_EINVAL, "partition: cannot copy %s", ag__node_name(n));
        return NULL;
    }
    if (m && copy_meta(m, n))
        return NULL;
    return m;
}

/* A placeholder standing for joint node x (same name, val, metadata and descriptor). */
static ag_node *copy_placeholder(ag_graph *dst, const ag__part *P, int x) {
    const ag_node *n = P->info[x].node;
    if (ag__node_num_vals(n) != 1) {
        ag__err(AG_EINVAL, "partition: %s is not a single tensor and cannot be a graph input",
                ag__node_name(n));
        return NULL;
    }
    ag_node *m = ag_graph_placeholder(dst, ag__node_name(n), ag__node_val(n, 0));
    if (!m || copy_meta(m, n))
        return NULL;
    if (ag__node_kind(n) == AG_NODE_PLACEHOLDER && ag_node_desc(n) &&
        ag_node_set_desc(m, ag_node_desc(n)))
        return NULL;
    return m;
}

/* Builds one graph: placeholders for inputs, the body, the output node with descs. */
static ag_graph *build_graph(const ag__part *P, const int *inputs, int nin, const int *body,
                             int nbody, const int *outs, int nouts, ag_desc *const *descs) {
    ag_graph *g = ag_graph_new();
    ag_node **env = ag__calloc((size_t)P->nn, sizeof *env);
    ag_node **on = ag__malloc(sizeof *on * (size_t)(nouts ? nouts : 1));
    bool ok = g && env && on && ag__graph_reserve(g, nin + nbody + 1) == 0;
    for (int k = 0; ok && k < nin; k++)
        ok = (env[inputs[k]] = copy_placeholder(g, P, inputs[k])) != NULL;
    for (int k = 0; ok && k < nbody; k++)
        ok = (env[body[k]] = copy_node(g, P, body[k], env)) != NULL;
    for (int k = 0; ok && k < nouts; k++)
        ok = (on[k] = outs[k] >= 0 ? env_of(env, P->info[outs[k]].node, P->info[P->out].node)
                                   : NULL) != NULL ||
             outs[k] < 0;
    ag_node *o = ok ? ag_graph_output(g, on, nouts) : NULL;
    ok = o && ag_node_set_output_descs(o, descs, nouts) == 0 && ag_graph_dce(g) >= 0;
    /* subgraph attributes whose get_attr the side does not keep */
    for (int k = ok ? ag_graph_num_subgraphs(g) - 1 : -1; k >= 0; k--) {
        const ag_graph *s = ag_graph_subgraph_at(g, k, NULL);
        bool read = false;
        for (const ag_node *n = ag_graph_first(g); n && !read; n = ag__node_next(n))
            read = ag__node_subgraph(n) == s;
        if (!read)
            ag__subgraph_remove(g, k);
    }
    ag__free(env);
    ag__free(on);
    if (!ok) {
        ag_graph_free(g);
        return NULL;
    }
    return g;
}

int ag__plan_graphs(const ag__part *P, const ag__plan *pl, ag_graph **fw, ag_graph **bw) {
    *fw = *bw = NULL;
    const ag_node *jo = P->info[P->out].node;
    int nfo = P->num_fwd_outputs + pl->nsaved, nbo = P->nouts - P->num_fwd_outputs;
    int *fouts = ag__malloc(sizeof(int) * (size_t)(nfo + 1));
    int *bins = ag__malloc(sizeof(int) * (size_t)(pl->nsaved + P->ntangents + 1));
    ag_desc **fdesc = ag__calloc((size_t)(nfo + 1), sizeof *fdesc);
    ag_desc **bdesc = ag__calloc((size_t)(nbo + 1), sizeof *bdesc);
    int rc = AG_ENOMEM;
    if (!fouts || !bins || !fdesc || !bdesc)
        goto done;
    for (int k = 0; k < P->num_fwd_outputs; k++) {
        fouts[k] = P->outs[k];
        fdesc[k] = ag_desc_retain(ag_node_output_desc(jo, k));
    }
    for (int k = 0; k < pl->nsaved; k++) {
        fouts[P->num_fwd_outputs + k] = pl->saved[k];
        if (!(fdesc[P->num_fwd_outputs + k] = ag_desc_saved_for_backwards(k)))
            goto done;
    }
    for (int k = 0; k < nbo; k++)
        bdesc[k] = ag_desc_retain(ag_node_output_desc(jo, P->num_fwd_outputs + k));
    memcpy(bins, pl->saved, sizeof(int) * (size_t)pl->nsaved);
    memcpy(bins + pl->nsaved, P->tangents, sizeof(int) * (size_t)P->ntangents);
    *fw = build_graph(P, P->primals, P->nprimals, pl->fw, pl->nfw, fouts, nfo, fdesc);
    *bw = *fw ? build_graph(P, bins, pl->nsaved + P->ntangents, pl->bw, pl->nbw,
                            P->outs + P->num_fwd_outputs, nbo, bdesc)
              : NULL;
    if (!*fw || !*bw) {
        rc = ag_last_status() ? ag_last_status() : AG_ENOMEM;
        ag_graph_free(*fw);
        ag_graph_free(*bw);
        *fw = *bw = NULL;
    } else {
        rc = 0;
    }
done:
    if (fdesc)
        for (int k = 0; k < nfo; k++)
            ag_desc_release(fdesc[k]);
    if (bdesc)
        for (int k = 0; k < nbo; k++)
            ag_desc_release(bdesc[k]);
    ag__free(fdesc);
    ag__free(bdesc);
    ag__free(fouts);
    ag__free(bins);
    return rc;
}

/* ---- default_partition ---- */

int ag__default_saved(const ag__part *P, int **saved, int *nsaved) {
    *saved = NULL;
    *nsaved = 0;
    int nn = P->nn;
    bool *flags = ag__calloc((size_t)nn, 3 * sizeof(bool));
    int *v = ag__malloc(sizeof(int) * (size_t)(nn + 1));
    if (!flags || !v) {
        ag__free(flags);
        ag__free(v);
        return AG_ENOMEM;
    }
    bool *is_in = flags, *valid = flags + nn, *fwset = valid + nn;
    for (int k = 0; k < P->nprimals; k++)
        is_in[P->primals[k]] = true;
    int rc = ag__side_nodes(P, is_in, false, P->outs, P->num_fwd_outputs, valid, fwset);
    int n = 0;
    for (int i = 0; rc == 0 && i < nn; i++) {
        const ag__pinfo *pi = &P->info[i];
        if (!fwset[i])
            continue;
        if (pi->tuple) {
            /* A tuple cannot be saved: save its getitems (unused ones are pruned later). */
            for (int u = 0; u < pi->nusers; u++)
                if (P->info[pi->users[u]].kind == AG_NODE_GETITEM)
                    v[n++] = pi->users[u];
            continue;
        }
        bool bw_use = false;
        for (int u = 0; u < pi->nusers && !bw_use; u++)
            bw_use = !fwset[pi->users[u]];
        if (bw_use)
            v[n++] = i;
    }
    ag__free(flags);
    if (rc) {
        ag__free(v);
        return rc;
    }
    *saved = v;
    *nsaved = n;
    return 0;
}

/* ---- the public entry points ---- */

int ag__memory_budget_of(double field, double *budget) {
    if (field == 0) { /* +0: the default; -0 (AG_MEMORY_BUDGET_ZERO): budget 0 */
        *budget = signbit(field) ? 0.0 : 1.0;
        return 0;
    }
    if (!(field > 0 && field <= 1))
        return ag__err(AG_EINVAL,
                       "partition: memory budget %g is outside [0, 1] (budget 0 is "
                       "AG_MEMORY_BUDGET_ZERO; 0 means the default, 1)",
                       field);
    *budget = field;
    return 0;
}

int ag__partition_flat(const ag_graph *joint, int num_fwd_outputs, const ag_partition_opts *opts,
                       ag__budget_mode mode, ag_graph **fw, ag_graph **bw,
                       ag_partition_stats *stats, ag__peak *peak, bool verified) {
    if (!fw || !bw)
        return ag__err(AG_EINVAL, "partition: NULL result pointer");
    *fw = *bw = NULL;
    /* NULL and a zeroed struct are the same: upstream's defaults. */
    ag_partition_opts o = opts ? *opts : (ag_partition_opts){0};
    if (o.partitioner != AG_PARTITION_DEFAULT && o.partitioner != AG_PARTITION_MINCUT)
        return ag__err(AG_EINVAL, "partition: unknown partitioner %d", (int)o.partitioner);
    if (o.solver != AG_KNAPSACK_GREEDY && o.solver != AG_KNAPSACK_DP && o.solver != AG_KNAPSACK_ILP)
        return ag__err(AG_EINVAL, "partition: unknown knapsack solver %d", (int)o.solver);
    double budget = 1.0;
    int rc = ag__memory_budget_of(o.memory_budget, &budget);
    if (rc)
        return rc;
    ag__part P;
    rc = ag__part_init_ex(&P, joint, num_fwd_outputs, verified);
    if (rc)
        return rc;
    if (P.meta_budget >= 0) {
        /* A node's meta "memory_budget" overrides the option, as upstream's config. */
        if (!(P.meta_budget <= 1)) {
            rc = ag__err(AG_EINVAL, "partition: memory budget %g is outside [0, 1]", P.meta_budget);
            goto done;
        }
        budget = P.meta_budget;
    }
    int *saved = NULL, nsaved = 0;
    /* default_partition delegates to the min-cut when recompute policies are present; the
     * min-cut falls back to the default when nothing is required by the backward. */
    bool mincut = o.partitioner == AG_PARTITION_MINCUT || P.has_recompute_tags;
    if (mincut && P.nreq_bw == 0)
        mincut = false;
    rc = mincut ? ag__choose_saved(&P, budget, o.solver, mode, &saved, &nsaved)
                : ag__default_saved(&P, &saved, &nsaved);
    ag__plan pl = {0};
    if (rc == 0) /* the plan of the final saved set with it */
        rc = ag__save_random_nodes(&P, &saved, &nsaved, &pl);
#ifndef NDEBUG
    /* ag__save_random_nodes left no random forward node for the backward to draw again, and
     * no collective to run again that is not tagged MUST_RECOMPUTE. */
    for (int p = 0; rc == 0 && p < pl.nbw; p++) {
        const ag__pinfo *pi = &P.info[pl.bw[p]];
        assert(!(pi->kind == AG_NODE_CALL && pi->random && !pi->req_bw));
        assert(!(pi->kind == AG_NODE_CALL && (pi->opflags & AG_OP_COLLECTIVE) && !pi->req_bw &&
                 pi->policy != AG_MUST_RECOMPUTE));
    }
#endif
    ag__free(saved);
    ag__peak pk = {0};
    if (rc == 0 && peak) /* the memory model; the stats need only what is recomputed */
        rc = ag__plan_peak(&P, &pl, &pk);
    else if (rc == 0 && stats)
        ag__plan_recompute(&P, &pl, &pk.recomputed_nodes, &pk.recompute_flops);
    if (rc == 0)
        rc = ag__plan_graphs(&P, &pl, fw, bw);
    if (rc == 0) {
        if (stats) {
            memset(stats, 0, sizeof *stats);
            stats->saved_tensors = pl.nsaved;
            for (int k = 0; k < pl.nsaved; k++)
                stats->saved_bytes += P.info[pl.saved[k]].bytes;
            stats->recomputed_nodes = pk.recomputed_nodes;
            stats->recomputed_flops = pk.recompute_flops;
        }
        if (peak)
            *peak = pk;
    }
    ag__plan_free(&pl);
done:
    ag__part_free(&P);
    return rc;
}

int ag_tag_region_recompute(ag_graph *g, ag_node *first, ag_node *last, ag_recompute policy) {
    AG__CHECK_NULL("tag_region_recompute", g);
    AG__CHECK_NULL("tag_region_recompute", first);
    AG__CHECK_NULL("tag_region_recompute", last);
    if ((unsigned)policy > AG_PREFER_RECOMPUTE)
        return ag__err(AG_EINVAL, "tag_region_recompute: bad policy %d", (int)policy);
    if (ag_graph_find(g, ag__node_name(first)) != first ||
        ag_graph_find(g, ag__node_name(last)) != last)
        return ag__err(AG_EINVAL, "tag_region_recompute: %s or %s is not a node of this graph",
                       ag__node_name(first), ag__node_name(last));
    if (ag_node_index(first) > ag_node_index(last))
        return ag__err(AG_EINVAL, "tag_region_recompute: %s comes after %s", ag__node_name(first),
                       ag__node_name(last));
    /* Each region gets the next ac_graph_id, so touching regions are told apart (upstream's
     * cleanup_recompute_tags saves the value at their boundary). */
    int64_t id = 0;
    for (ag_node *n = ag_graph_first(g); n; n = ag__node_next(n)) {
        ag_mval v = ag_node_meta_get(n, "ac_graph_id");
        if (v.kind == AG_MV_INT && v.u.i >= id)
            id = v.u.i + 1;
    }
    ag_node *stop = ag_node_next(last);
    for (ag_node *n = first; n != stop; n = ag__node_next(n)) {
        ag_node_kind k = ag__node_kind(n);
        if (k != AG_NODE_CALL && k != AG_NODE_GETITEM)
            continue;
        int rc = policy == AG_RECOMPUTE_NONE
                     ? ag_node_meta_del(n, "ac_graph_id")
                     : ag_node_meta_set(n, "ac_graph_id", (ag_mval){.kind = AG_MV_INT, .u.i = id});
        if (rc >= 0)
            rc = ag_node_set_recompute(n, policy);
        if (rc < 0) {
            /* Undo the region so far (deleting never allocates). */
            for (ag_node *m = first; m != n; m = ag__node_next(m)) {
                ag_node_meta_del(m, "ac_graph_id");
                ag_node_set_recompute(m, AG_RECOMPUTE_NONE);
            }
            return rc;
        }
    }
    return 0;
}
