/* The executor's invoke_subgraph calls (plan.c runs them as steps; flex_attention's are in
 * plan_flex.c).
 *
 * Subgraphs. A call of invoke_subgraph is a step like a multi-output kernel whose outputs the
 * memory plan places as any other; its subgraph gets one plan of its own (made at ag_plan_new
 * with the same options, whatever the number of calls) that the step runs on the operands with
 * the step's output structs as destinations: a subgraph output that is a kernel output of its
 * own is computed straight into the caller's buffer; an operand passed through (a region's
 * forward saving its input) is no buffer at all: the call's getitem reads the operand's value,
 * as a view would, unless a later node of the graph may mutate a value (then it is copied, as
 * are views and constants). A None output (a grad nobody needs) is left empty. The subgraph's
 * plan hands nothing out, so no buffer of the caller aliases one that the next call
 * overwrites.
 */
#include "plan_internal.h"
#include "../graph/graph_internal.h"

#include <stdio.h>

/* ---- building ---- */

/* The plan of subgraph sub (*k: its index), made on first use with the plan's options: a
 * subgraph is planned once however many calls run it. */
int ag__plan_subplan_of(ag_plan *p, const ag_graph *sub, int *k) {
    for (int i = 0; i < p->nsubplans; i++)
        if (p->subgraphs[i] == sub) {
            if (k)
                *k = i;
            return 0;
        }
    int n = p->nsubplans;
    if (ag__grow((void **)&p->subgraphs, &p->subgraphs_cap, n + 1, sizeof *p->subgraphs) ||
        ag__grow((void **)&p->subplans, &p->subplans_cap, n + 1, sizeof *p->subplans))
        return AG_ENOMEM;
    const ag_graph **gs = p->subgraphs;
    ag_plan **ps = p->subplans;
    ag_plan *sp = ag_plan_new(sub, &p->opts);
    if (!sp) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", ag_last_error());
        int rc = ag_last_status();
        return ag__err(rc < 0 ? rc : AG_EINVAL, "plan_new: a subgraph: %s", msg);
    }
    gs[n] = sub;
    ps[n] = sp;
    p->nsubplans = n + 1;
    if (k)
        *k = n;
    return 0;
}

/* Whether call x may write a tensor it reads: an in-place or mutating op, or a subgraph call
 * whose subgraph holds one. */
bool ag__plan_may_mutate(const ag_node *x) {
    const ag_op *op = ag__node_op(x);
    if (ag_op_def(op)->flags & AG_OP_INPLACE)
        return true;
    for (int a = 0; a < op->nargs; a++)
        if (op->mutates[a])
            return true;
    if (ag_op_def(op)->flags & AG_OP_SUBGRAPH) {
        const ag_graph *sub = ag__node_subgraph(ag__node_arg_node(x, 0));
        for (ag_node *y = sub ? ag_graph_first(sub) : NULL; y; y = ag_node_next(y))
            if (ag_node_kind_of(y) == AG_NODE_CALL && ag__plan_may_mutate(y))
                return true;
    }
    return false;
}

/* Output k of subgraph call x when its subgraph returns placeholder j there: the value of
 * operand j, which the call's readers then read directly (no copy into a buffer of its own);
 * else -1. Only when nothing after the call may mutate a value (p->last_mut), so the operand
 * and the output cannot diverge. */
int ag__plan_passthrough_value(ag_plan *p, const ag_node *x, int j) {
    if (j < 0 || ag_node_index(x) <= p->last_mut)
        return -1;
    const ag_garg *ops = ag__node_arg(x, 2);
    int v = -1;
    if (!ops || ops->kind != AG_GA_NODES || j >= ops->n || !ops->u.nodes[j] ||
        ag__plan_val_of_node(p, x, ops->u.nodes[j], &v))
        return -1;
    return v;
}

/* ---- running ---- */

/* A subgraph's run (ag__plan_run_into): an output buffer whose value is output k itself is bound
 * to dst[k]'s storage (its kernel writes there); the others come from their pools. */
static int acquire_storages_into(ag_plan *p, ag_tensor *const *dst) {
    for (int bi = 0; bi < p->nbufs; bi++)
        p->bufs[bi].into = NULL;
    for (int k = 0; k < p->nouts; k++) {
        const pout *po = &p->outs[k];
        if (po->val < 0 || po->same_as >= 0)
            continue;
        const pv *x = &p->vals[po->val];
        if (x->kind != PV_BUF || x->root != po->val || !p->bufs[x->buf].out ||
            p->bufs[x->buf].into || dst[k]->storage->nbytes < (size_t)p->bufs[x->buf].bytes)
            continue;
        p->bufs[x->buf].into = dst[k]->storage;
    }
    return ag__plan_acquire_out_buffers(p);
}

/* A subgraph's run: output k is written into dst[k] (a contiguous tensor of its val, which the
 * caller owns): computed there when it is a kernel output of its own, else copied (an input
 * passed through, a view, a constant); a None output writes nothing (dst[k] is the f32[0] of
 * its val). Nothing is handed out. */
int ag__plan_run_into(ag_plan *p, ag_tensor *const *inputs, int ninputs, ag_tensor *const *dst,
                      int ndst) {
    if (ndst != p->nouts)
        return ag__err(AG_EINVAL, "plan: the subgraph has %d outputs, the call %d", p->nouts, ndst);
    int rc = ag__plan_bind_inputs(p, inputs, ninputs);
    if (rc == 0 && p->coll_check)
        rc = ag__plan_check_collectives(p);
    if (rc == 0)
        rc = ag__plan_ensure_arena(p);
    if (rc == 0)
        rc = acquire_storages_into(p, dst);
    if (rc)
        return rc;
    ag_scope_begin();
    rc = ag__plan_run_steps(p);
    ag_scope_end();
    if (rc) {
        ag__plan_settle_collectives(p);
        return rc;
    }
    for (int k = 0; k < p->nouts; k++) {
        const pout *po = &p->outs[k];
        if (po->val < 0)
            continue; /* None: its val in the call is an f32[0] nothing reads */
        const pv *x = &p->vals[po->val];
        if (po->same_as < 0 && x->kind == PV_BUF && x->root == po->val &&
            p->bufs[x->buf].into == dst[k]->storage) {
            p->ninto++;
            continue; /* computed in the caller's buffer */
        }
        if (x->kind == PV_INPUT && dst[k] == inputs[x->ph]) {
            p->npass++; /* the caller reads the operand itself */
            continue;
        }
        const ag_tensor *src = x->kind == PV_INPUT ? inputs[x->ph] : p->tp[po->val];
        if ((rc = ag__copy_into(dst[k], src)))
            return rc;
        p->ncopy++;
    }
    p->nruns++;
    return 0;
}

/* invoke_subgraph: runs the subgraph's plan on the operands, its outputs written into the
 * step's buffers (ag__plan_run_into): nothing of the subplan's is handed out, so nothing of the
 * outer plan aliases a buffer the next call reuses, and a warm run allocates nothing. */
int ag__plan_run_subgraph(ag_plan *p, pstep *s) {
    ag_plan *sp = p->subplans[s->sub - 1];
    const ag_arg *ops = &s->args[2];
    int rc = ag__plan_run_into(sp, ops->u.ts, ops->n, s->outs, s->nouts);
    if (rc < 0) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", ag_last_error());
        return ag__err(rc, "plan: %%%s: %s", p->names[s->node], msg);
    }
    return 0;
}
