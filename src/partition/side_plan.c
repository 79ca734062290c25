/* What each side of a partition runs for a saved set, and the peak-memory model of a training
 * step run that way (spec 7.2's _extract_graph_with_inputs_outputs, _extract_fwd_bwd_modules and
 * reordering_to_mimic_autograd_engine, computed on node indices of the classified joint).
 *
 * In: a classified joint graph (partition.c) and a saved set. Out: an ag__plan (the saved values
 * the backward reads, each side's body in the order it runs) and its ag__peak. A plan is cheap
 * next to building graphs, so the min-cut's budget search (mincut.c) scores many candidate
 * saved sets with it; partition.c materializes the chosen one as the forward and backward
 * graphs. This file uses only the classification (partition_internal.h), so the partition
 * files depend on each other in a line: partition.c -> mincut.c -> side_plan.c. */
#include "side_plan.h"

#include <assert.h>
#include <stdlib.h>

#ifndef NDEBUG
/* Debug check that a side's body runs: each of its nodes reads only the side's inputs (have[i]
 * true, P->nn entries, overwritten) and nodes earlier in the body. For the backward this says
 * that the saved set is a cut: every forward value the backward reads is saved or recomputed
 * there from saved values. */
static bool body_closed(const ag__part *P, bool *have, const int *body, int nbody) {
    for (int p = 0; p < nbody; p++) {
        const ag__pinfo *pi = &P->info[body[p]];
        for (int a = 0; a < pi->nargs; a++)
            if (!have[pi->args[a]])
                return false;
        have[body[p]] = true;
    }
    return true;
}
#endif

int ag__side_nodes(const ag__part *P, const bool *is_input, bool backward, const int *outs,
                   int nouts, bool *valid, bool *needed) {
    for (int i = 0; i < P->nn; i++) {
        const ag__pinfo *pi = &P->info[i];
        needed[i] = false;
        if (is_input[i]) {
            valid[i] = true;
            continue;
        }
        valid[i] = false;
        if ((pi->must_bw && !backward) || (pi->must_fw && backward))
            continue;
        switch (pi->kind) {
        case AG_NODE_GET_ATTR:
            valid[i] = true;
            break;
        case AG_NODE_CALL:
        case AG_NODE_GETITEM:
            valid[i] = true;
            for (int a = 0; a < pi->nargs && valid[i]; a++)
                valid[i] = valid[pi->args[a]];
            break;
        default:
            break;
        }
    }
    for (int k = 0; k < nouts; k++) {
        if (outs[k] < 0)
            continue;
        if (!valid[outs[k]])
            return ag__err(AG_EINVAL,
                           "partition: node %s was invalid, but is an output of the %s "
                           "graph",
                           ag__node_name(P->info[outs[k]].node), backward ? "backward" : "forward");
        needed[outs[k]] = true;
    }
    for (int i = P->nn - 1; i >= 0; i--) {
        const ag__pinfo *pi = &P->info[i];
        if (pi->effectful && valid[i] && !is_input[i])
            needed[i] = true;
        if (needed[i] && !is_input[i])
            for (int a = 0; a < pi->nargs; a++)
                needed[pi->args[a]] = true;
    }
    return 0;
}

/* ---- plans: what each side runs ---- */

void ag__plan_free(ag__plan *pl) {
    ag__free(pl->saved);
    ag__free(pl->fw);
    ag__free(pl->bw);
    memset(pl, 0, sizeof *pl);
}

/* Collects into sel the not-yet-emitted ancestors of x (x included) and emits them in graph
 * order: upstream's insert_node_in_graph. */
static int emit_with_ancestors(const ag__part *P, int x, bool *emitted, int *stack, int *sel,
                               int *out, int *nout) {
    if (emitted[x])
        return 0;
    int sp = 0, ns = 0;
    stack[sp++] = x;
    emitted[x] = true; /* marks "collected"; all collected nodes are emitted below */
    while (sp) {
        int y = stack[--sp];
        sel[ns++] = y;
        const ag__pinfo *pi = &P->info[y];
        for (int a = 0; a < pi->nargs; a++)
            if (!emitted[pi->args[a]]) {
                emitted[pi->args[a]] = true;
                stack[sp++] = pi->args[a];
            }
    }
    qsort(sel, (size_t)ns, sizeof(int), ag__cmp_int);
    for (int k = 0; k < ns; k++)
        out[(*nout)++] = sel[k];
    return 0;
}

/* reordering_to_mimic_autograd_engine: the backward is rebuilt from its first node that reads
 * a tangent on, each node preceded by its not-yet-emitted ancestors in their original order,
 * so a recomputed forward value is made just before the first backward node that needs it. */
static void reorder_backward(const ag__part *P, const bool *is_input, const int *body, int nbody,
                             bool *emitted, int *stack, int *sel, int *out) {
    int first = -1;
    for (int p = 0; p < nbody && first < 0; p++) {
        const ag__pinfo *pi = &P->info[body[p]];
        for (int a = 0; a < pi->nargs; a++)
            if (P->info[pi->args[a]].tangent) {
                first = p;
                break;
            }
    }
    if (first < 0) {
        memcpy(out, body, sizeof(int) * (size_t)nbody);
        return;
    }
    for (int i = 0; i < P->nn; i++)
        emitted[i] = is_input[i] || !ag__is_body_kind(P->info[i].kind);
    int nout = 0;
    for (int p = first; p < nbody; p++)
        emit_with_ancestors(P, body[p], emitted, stack, sel, out, &nout);
    /* The output node's remaining ancestors. */
    for (int p = 0; p < first; p++)
        emit_with_ancestors(P, body[p], emitted, stack, sel, out, &nout);
}

int ag__plan_make(const ag__part *P, const int *saved_in, int nsaved_in, ag__plan *pl) {
    memset(pl, 0, sizeof *pl);
    int nn = P->nn, rc = 0;
    bool *flags = ag__calloc((size_t)nn, 5 * sizeof(bool));
    int *scratch = ag__malloc(sizeof(int) * (size_t)nn * 3 + sizeof(int));
    int *outs = ag__malloc(sizeof(int) * (size_t)(P->num_fwd_outputs + nn + 1));
    pl->saved = ag__malloc(sizeof(int) * (size_t)(nn + 1));
    pl->fw = ag__malloc(sizeof(int) * (size_t)(nn + 1));
    pl->bw = ag__malloc(sizeof(int) * (size_t)(nn + 1));
    if (!flags || !scratch || !outs || !pl->saved || !pl->fw || !pl->bw) {
        rc = AG_ENOMEM;
        goto done;
    }
    bool *is_saved = flags, *is_in = flags + nn, *valid = is_in + nn, *needed = valid + nn,
         *used = needed + nn;
    for (int k = 0; k < nsaved_in; k++) {
        int s = saved_in[k];
        if (s < 0 || s >= nn ||
            (!ag__is_body_kind(P->info[s].kind) && P->info[s].kind != AG_NODE_PLACEHOLDER)) {
            rc = ag__err(AG_EINVAL, "partition: saved value %d is not a value node", s);
            goto done;
        }
        if (P->info[s].tuple) {
            rc = ag__err(AG_EINVAL, "partition: %s returns several tensors; save its getitems",
                         ag__node_name(P->info[s].node));
            goto done;
        }
        is_saved[s] = true;
    }
    /* The backward: inputs are the saved values and the tangents. */
    for (int i = 0; i < nn; i++)
        is_in[i] = is_saved[i] || P->info[i].tangent;
    int nbo = P->nouts - P->num_fwd_outputs;
    if ((rc = ag__side_nodes(P, is_in, true, P->outs + P->num_fwd_outputs, nbo, valid, needed)))
        goto done;
    /* Saved values the backward never reads are dropped. */
    for (int i = 0; i < nn; i++)
        if (needed[i] && !is_in[i] && ag__is_body_kind(P->info[i].kind))
            for (int a = 0; a < P->info[i].nargs; a++)
                used[P->info[i].args[a]] = true;
    for (int k = 0; k < nbo; k++)
        if (P->outs[P->num_fwd_outputs + k] >= 0)
            used[P->outs[P->num_fwd_outputs + k]] = true;
    int nbody = 0;
    for (int i = 0; i < nn; i++) {
        if (is_saved[i] && used[i])
            pl->saved[pl->nsaved++] = i;
        if (needed[i] && !is_in[i] && ag__is_body_kind(P->info[i].kind))
            scratch[nbody++] = i;
    }
    /* Reorder the backward body (scratch) into pl->bw. */
    {
        bool *emitted = valid; /* free again: the forward pass below recomputes it */
        int *stack = scratch + nn, *sel = stack + nn;
        for (int i = 0; i < nn; i++)
            is_in[i] = (is_saved[i] && used[i]) || P->info[i].tangent;
        reorder_backward(P, is_in, scratch, nbody, emitted, stack, sel, pl->bw);
        pl->nbw = nbody;
#ifndef NDEBUG
        memcpy(needed, is_in, (size_t)nn); /* needed is free until the forward pass */
        assert(body_closed(P, needed, pl->bw, pl->nbw));
#endif
    }
    /* The forward: primals -> forward outputs + saved values. */
    memset(is_in, 0, (size_t)nn);
    for (int k = 0; k < P->nprimals; k++)
        is_in[P->primals[k]] = true;
    int no = 0;
    for (int k = 0; k < P->num_fwd_outputs; k++)
        outs[no++] = P->outs[k];
    for (int k = 0; k < pl->nsaved; k++)
        outs[no++] = pl->saved[k];
    if ((rc = ag__side_nodes(P, is_in, false, outs, no, valid, needed)))
        goto done;
    for (int i = 0; i < nn; i++)
        if (needed[i] && !is_in[i] && ag__is_body_kind(P->info[i].kind))
            pl->fw[pl->nfw++] = i;
#ifndef NDEBUG
    if (rc == 0) {
        assert(body_closed(P, is_in, pl->fw, pl->nfw)); /* is_in: the primals */
        for (int k = 0; k < pl->nsaved; k++)            /* the forward makes every saved value */
            assert(is_in[pl->saved[k]]);
    }
#endif
done:
    ag__free(flags);
    ag__free(scratch);
    ag__free(outs);
    if (rc)
        ag__plan_free(pl);
    return rc;
}

/* ---- the peak-memory model ---- */

/* One side's simulation state: key[x] is the storage node x's value lives in (-1: none of the
 * step's), kbytes[k] its size, last[k] the last position that reads it (n: kept to the end),
 * live[k] whether it is allocated now. */
typedef struct sim {
    const ag__part *P;
    int *key;        /* per node: storage key, -1 when external / no storage */
    int64_t *kbytes; /* per key */
    int *last;       /* per key: last position it is read (n: kept to the end) */
    bool *live;
} sim;

/* Bytes a tuple call allocates for its outputs. */
static int64_t tuple_bytes(const ag__pinfo *pi) {
    return pi->bytes;
}

/* Runs order[0..n) from start_bytes live: each node allocates its value, the peak is taken
 * while its inputs and output are both alive, then what it read for the last time is freed.
 * Returns the peak; *end receives the bytes alive at the end. */
static int64_t run_sim(sim *S, const int *order, int n, int64_t start_bytes, int64_t *end) {
    const ag__part *P = S->P;
    int64_t cur = start_bytes, peak = start_bytes;
    for (int p = 0; p < n; p++) {
        int x = order[p];
        const ag__pinfo *pi = &P->info[x];
        int64_t transient = 0;
        if (pi->kind == AG_NODE_CALL && pi->tuple) {
            /* All outputs are written by the call; those read through a getitem stay, the
             * others die at once. */
            int64_t kept = 0;
            for (int u = 0; u < pi->nusers; u++) {
                int g = pi->users[u];
                int k = S->key[g];
                if (P->info[g].kind == AG_NODE_GETITEM && k >= 0 && !S->live[k] &&
                    S->last[k] >= 0) {
                    S->live[k] = true;
                    cur += S->kbytes[k];
                    kept += S->kbytes[k];
                }
            }
            /* A subgraph call also holds its subgraph's intermediates while it runs. */
            transient = tuple_bytes(pi) + pi->sub_extra - kept;
            if (transient < 0)
                transient = 0;
        } else if (pi->kind == AG_NODE_CALL && !pi->view) {
            int k = S->key[x];
            if (k >= 0 && !S->live[k]) {
                S->live[k] = true;
                cur += S->kbytes[k];
            }
        }
        if (cur + transient > peak)
            peak = cur + transient;
        /* Free what this node read for the last time (and its own value if nobody reads it). */
        for (int a = 0; a <= pi->nargs; a++) {
            int y = a < pi->nargs ? pi->args[a] : x;
            int k = S->key[y];
            if (k >= 0 && S->live[k] && S->last[k] <= p) {
                S->live[k] = false;
                cur -= S->kbytes[k];
            }
        }
    }
    *end = cur;
    return peak;
}

int64_t ag__subgraph_extra_bytes(const ag_graph *sub) {
    int n = 0;
    for (ag_node *x = ag_graph_first(sub); x; x = ag_node_next(x))
        n++;
    /* Per node: the node owning its storage (-1: none of the run's), its bytes when it owns
     * it, the last position reading that storage, and whether it is an output's. */
    int *root = ag__malloc(sizeof(int) * (size_t)(2 * n + 1));
    int64_t *bytes = ag__calloc((size_t)n + 1, sizeof(int64_t));
    bool *out = ag__calloc((size_t)n + 1, sizeof(bool));
    if (!root || !bytes || !out) {
        ag__free(root);
        ag__free(bytes);
        ag__free(out);
        return ag__err(AG_ENOMEM, "partition: out of memory");
    }
    int *last = root + n;
    int p = 0;
    for (ag_node *x = ag_graph_first(sub); x; x = ag_node_next(x), p++) {
        root[p] = -1;
        last[p] = -1;
        ag_node_kind k = ag_node_kind_of(x);
        if (k == AG_NODE_GETITEM) {
            root[p] = root[ag_node_index(ag__node_arg_node(x, 0))];
        } else if (k == AG_NODE_CALL) {
            const ag_garg *a0 = ag__node_arg(x, 0);
            if ((ag_op_def(ag__node_op(x))->flags & AG_OP_VIEW) && a0 && a0->kind == AG_GA_NODE &&
                a0->u.node) {
                root[p] = root[ag_node_index(a0->u.node)];
            } else {
                root[p] = p;
                for (int v = 0; v < ag__node_num_vals(x); v++) {
                    const ag_tmeta *m = ag__node_val(x, v);
                    bytes[p] += ag__numel(m->ndim, m->sizes) * (int64_t)ag_dtype_size(m->dtype);
                }
            }
        }
        for (int a = 0; a < ag__node_nargs(x); a++) {
            const ag_garg *g = ag__node_arg(x, a);
            int cnt = ag__garg_nrefs(g);
            for (int e = 0; e < cnt; e++) {
                ag_node *d = ag__garg_ref(g, e);
                int r = d ? root[ag_node_index(d)] : -1;
                if (r < 0)
                    continue;
                if (k == AG_NODE_OUTPUT)
                    out[r] = true;
                else if (last[r] < p)
                    last[r] = p;
            }
        }
    }
    int64_t cur = 0, peak = 0;
    p = 0;
    for (ag_node *x = ag_graph_first(sub); x; x = ag_node_next(x), p++) {
        if (root[p] == p && !out[p])
            cur += bytes[p];
        /* a call of a subgraph of sub's own (a region in a region) holds that subgraph's
         * intermediates too while it runs */
        const ag_graph *inner = ag__call_subgraph(x);
        int64_t ex = inner ? ag__subgraph_extra_bytes(inner) : 0;
        if (ex < 0) {
            peak = ex;
            break;
        }
        if (cur + ex > peak)
            peak = cur + ex;
        /* Free what this node read for the last time, and its own value if nothing reads it. */
        for (int a = 0; a <= ag__node_nargs(x); a++) {
            const ag_garg *g = a < ag__node_nargs(x) ? ag__node_arg(x, a) : NULL;
            int cnt = !g ? 1 : ag__garg_nrefs(g);
            for (int e = 0; e < cnt; e++) {
                ag_node *d = !g ? x : ag__garg_ref(g, e);
                int r = d ? root[ag_node_index(d)] : -1;
                if (r >= 0 && !out[r] && bytes[r] && last[r] <= p) {
                    cur -= bytes[r];
                    bytes[r] = 0; /* freed */
                }
            }
        }
    }
    ag__free(root);
    ag__free(bytes);
    ag__free(out);
    return peak;
}

void ag__plan_recompute(const ag__part *P, const ag__plan *pl, int *nodes, double *flops) {
    /* Forward nodes the backward runs again. */
    *nodes = 0;
    *flops = 0;
    for (int p = 0; p < pl->nbw; p++) {
        const ag__pinfo *pi = &P->info[pl->bw[p]];
        if (pi->kind != AG_NODE_CALL || pi->req_bw)
            continue;
        const char *tag = ag_node_partitioner_tag(pi->node);
        if (tag && (!strcmp(tag, "is_backward") || !strcmp(tag, "must_be_in_backward")))
            continue;
        (*nodes)++;
        *flops += pi->flops;
    }
}

int ag__plan_peak(const ag__part *P, const ag__plan *pl, ag__peak *out) {
    memset(out, 0, sizeof *out);
    int nn = P->nn;
    sim S = {.P = P};
    S.key = ag__malloc(sizeof(int) * (size_t)nn * 3);
    S.kbytes = ag__calloc((size_t)nn * 2, sizeof(int64_t));
    S.live = ag__calloc((size_t)nn * 2, sizeof(bool));
    bool *is_saved = ag__calloc((size_t)nn, sizeof(bool));
    if (!S.key || !S.kbytes || !S.live || !is_saved) {
        ag__free(S.key);
        ag__free(S.kbytes);
        ag__free(S.live);
        ag__free(is_saved);
        return AG_ENOMEM;
    }
    S.last = S.key + nn; /* keys are < 2 nn */

    /* Forward: a node's key is its storage root (joint index); graph inputs and constants and
     * views of them have none. */
    for (int i = 0; i < nn; i++) {
        const ag__pinfo *pi = &P->info[i];
        S.key[i] = pi->external || pi->tuple || pi->kind == AG_NODE_OUTPUT ? -1 : pi->root;
    }
    for (int i = 0; i < 2 * nn; i++)
        S.last[i] = -1;
    for (int i = 0; i < nn; i++)
        if (S.key[i] == i)
            S.kbytes[i] = P->info[i].bytes;
    for (int p = 0; p < pl->nfw; p++) {
        const ag__pinfo *pi = &P->info[pl->fw[p]];
        for (int a = 0; a < pi->nargs; a++) {
            int k = S.key[pi->args[a]];
            if (k >= 0 && S.last[k] < p)
                S.last[k] = p;
        }
        int k = S.key[pl->fw[p]];
        if (k >= 0 && S.last[k] < p)
            S.last[k] = p;
    }
    for (int k = 0; k < pl->nsaved; k++)
        if (S.key[pl->saved[k]] >= 0)
            S.last[S.key[pl->saved[k]]] = pl->nfw;
    out->fw_peak = run_sim(&S, pl->fw, pl->nfw, 0, &out->fw_end);

    /* Backward: a saved value's storage is key nn + root (it was made by the forward), a
     * recomputed value's is its own root, so recomputing a saved value's base never merges
     * with the saved copy. */
    for (int k = 0; k < pl->nsaved; k++)
        is_saved[pl->saved[k]] = true;
    for (int i = 0; i < nn; i++) {
        const ag__pinfo *pi = &P->info[i];
        S.key[i] = -1;
        if (is_saved[i]) {
            S.key[i] = pi->external ? -1 : nn + pi->root;
            if (S.key[i] >= 0)
                S.kbytes[S.key[i]] = P->info[pi->root].bytes;
        }
    }
    for (int p = 0; p < pl->nbw; p++) {
        int x = pl->bw[p];
        const ag__pinfo *pi = &P->info[x];
        if (pi->kind == AG_NODE_GET_ATTR || pi->tuple)
            S.key[x] = -1;
        else if (pi->view && pi->nargs > 0)
            S.key[x] = S.key[pi->args[0]];
        else if (pi->pass)
            S.key[x] = S.key[pi->pass - 1];
        else
            S.key[x] = x;
        if (S.key[x] == x)
            S.kbytes[x] = pi->bytes;
    }
    for (int i = 0; i < 2 * nn; i++) {
        S.last[i] = -1;
        S.live[i] = false;
    }
    int64_t start = 0;
    for (int k = 0; k < pl->nsaved; k++) {
        int key = S.key[pl->saved[k]];
        if (key >= 0 && !S.live[key]) {
            S.live[key] = true;
            start += S.kbytes[key];
        }
    }
    out->saved = start;
    for (int p = 0; p < pl->nbw; p++) {
        const ag__pinfo *pi = &P->info[pl->bw[p]];
        for (int a = 0; a < pi->nargs; a++) {
            int k = S.key[pi->args[a]];
            if (k >= 0 && S.last[k] < p)
                S.last[k] = p;
        }
        int k = S.key[pl->bw[p]];
        if (k >= 0 && S.last[k] < p)
            S.last[k] = p;
    }
    int64_t bw_end;
    out->bw_peak = run_sim(&S, pl->bw, pl->nbw, start, &bw_end);
    out->peak = out->fw_peak > out->bw_peak ? out->fw_peak : out->bw_peak;

    ag__plan_recompute(P, pl, &out->recomputed_nodes, &out->recompute_flops);
    ag__free(S.key);
    ag__free(S.kbytes);
    ag__free(S.live);
    ag__free(is_saved);
    return 0;
}

/* A forward effect (with_effects, must stay in the forward) is never run by the backward, so
 * every value it makes is saved; those the backward does not read are dropped by the plan. */
static int save_effect_outputs(const ag__part *P, int **saved, int *nsaved) {
    int add = 0;
    for (int i = 0; i < P->nn; i++)
        if (P->info[i].must_fw && P->info[i].kind == AG_NODE_CALL && P->info[i].tuple &&
            (P->info[i].opflags & AG_OP_EFFECTFUL))
            add += P->info[i].nusers;
    if (!add)
        return 0;
    int *v = ag__malloc(sizeof(int) * (size_t)(*nsaved + add));
    if (!v)
        return AG_ENOMEM;
    memcpy(v, *saved, sizeof(int) * (size_t)*nsaved);
    int n = *nsaved;
    for (int i = 0; i < P->nn; i++) {
        const ag__pinfo *pi = &P->info[i];
        if (pi->must_fw && pi->kind == AG_NODE_CALL && pi->tuple && (pi->opflags & AG_OP_EFFECTFUL))
            for (int u = 0; u < pi->nusers; u++)
                if (P->info[pi->users[u]].kind == AG_NODE_GETITEM)
                    v[n++] = pi->users[u];
    }
    ag__free(*saved);
    *saved = v;
    *nsaved = n;
    return 0;
}

/* A forward node the backward must not run again: a random op (AG_OP_RANDOM) reads the
 * running thread's generator, so a recomputed draw would give other numbers; a collective
 * (AG_OP_COLLECTIVE) would communicate again, and every rank must issue the same collectives in
 * the same order, so only those tagged AG_MUST_RECOMPUTE (FSDP's parameter gathers and their
 * waits) are run again. */
static bool never_recomputed(const ag__pinfo *pi) {
    if (pi->kind != AG_NODE_CALL || pi->req_bw)
        return false;
    if (pi->opflags & AG_OP_COLLECTIVE)
        return pi->policy != AG_MUST_RECOMPUTE;
    return pi->random || (pi->opflags & AG_OP_SUBGRAPH); /* a region's forward runs once */
}

/* Whether the backward would run x again and must save it instead. A collective whose
 * wait_tensor the backward would also run again is not saved itself: its wait is (a pending
 * result is never a saved value), and the collective then drops out of the backward. */
static bool save_instead(const ag__part *P, const bool *in_bw, int x) {
    const ag__pinfo *pi = &P->info[x];
    if (!never_recomputed(pi))
        return false;
    if (pi->opflags & AG_OP_COLLECTIVE)
        for (int u = 0; u < pi->nusers; u++)
            if (in_bw[pi->users[u]] && never_recomputed(&P->info[pi->users[u]]))
                return false;
    return true;
}

/* Random ops and collectives are not recomputed (never_recomputed). The export functionalizes
 * random ops into philox ops, which may be recomputed; random ops remain only in graphs
 * exported with keep_random_ops or built otherwise. Whatever saved set was chosen (an
 * inputs-only set under memory budget 0 included), such a node the backward would run again is
 * saved instead (its getitems for a tuple), until none is left. The values of forward effects
 * are saved too (save_effect_outputs). */
int ag__save_random_nodes(const ag__part *P, int **saved, int *nsaved, ag__plan *out) {
    int rc0 = save_effect_outputs(P, saved, nsaved);
    if (rc0)
        return rc0;
    bool *in_bw = ag__calloc((size_t)P->nn, sizeof(bool));
    if (!in_bw)
        return AG_ENOMEM;
    for (int round = 0; round < P->nn; round++) {
        ag__plan pl;
        int rc = ag__plan_make(P, *saved, *nsaved, &pl);
        if (rc) {
            ag__free(in_bw);
            return rc;
        }
        memset(in_bw, 0, (size_t)P->nn * sizeof(bool));
        for (int p = 0; p < pl.nbw; p++)
            in_bw[pl.bw[p]] = true;
        int add = 0;
        for (int p = 0; p < pl.nbw; p++)
            add += save_instead(P, in_bw, pl.bw[p]) ? 1 + P->info[pl.bw[p]].nusers : 0;
        if (!add) {
            if (out) /* the plan of the final set: the caller's next step, not made twice */
                *out = pl;
            else
                ag__plan_free(&pl);
            ag__free(in_bw);
            return 0;
        }
        int *v = ag__malloc(sizeof(int) * (size_t)(*nsaved + add));
        if (!v) {
            ag__plan_free(&pl);
            ag__free(in_bw);
            return AG_ENOMEM;
        }
        memcpy(v, *saved, sizeof(int) * (size_t)*nsaved);
        int n = *nsaved;
        for (int p = 0; p < pl.nbw; p++) {
            int x = pl.bw[p];
            const ag__pinfo *pi = &P->info[x];
            if (!save_instead(P, in_bw, x))
                continue;
            if (!pi->tuple)
                v[n++] = x;
            else
                for (int u = 0; u < pi->nusers; u++)
                    if (P->info[pi->users[u]].kind == AG_NODE_GETITEM)
                        v[n++] = pi->users[u];
        }
        ag__plan_free(&pl);
        ag__free(*saved);
        *saved = v;
        *nsaved = n;
    }
    ag__free(in_bw);
    return out ? ag__plan_make(P, *saved, *nsaved, out) : 0;
}
