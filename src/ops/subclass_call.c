/* The dispatcher's path for op calls with a tensor subclass instance among the arguments
 * (include/aotgrad/subclass.h): PyTorch's order, where autograd runs above
 * __torch_dispatch__.
 *
 * In: a call whose arguments are checked and filled and whose output metadata the op's meta
 * function computed from the outer tensors (optable.c's call_raw; composites never get here,
 * they decompose first). Out: the outputs, from the type's dispatch callback, checked against
 * those metas; in-place ops return their outer self; an autograd node recorded on the outer
 * tensors when an input requires grad. No tracer hook runs for the outer op: the callback's
 * own op calls on inner tensors are what a trace records, and while the outer op is recorded
 * by autograd they carry its seq_nr, as the inner calls of a __torch_dispatch__ carry the
 * autograd node's sequence number upstream. */
#include "copy_slices.h"
#include "../core/subclass_instance.h"

#include <stdio.h>

const ag_subclass_type *ag__subclass_dispatcher(const ag_op *op, const ag_arg *full) {
    for (int i = 0; i < op->nargs; i++) {
        if (full[i].kind == AG_ARG_TENSOR && full[i].u.t && full[i].u.t->sub)
            return full[i].u.t->sub->type;
        if (full[i].kind == AG_ARG_TENSORS)
            for (int k = 0; k < full[i].n; k++)
                if (full[i].u.ts[k] && full[i].u.ts[k]->sub)
                    return full[i].u.ts[k]->sub->type;
    }
    return NULL;
}

static void free_outs(ag_tensor **outs, int n) {
    for (int i = 0; i < n; i++) {
        ag_tensor_free(outs[i]);
        outs[i] = NULL;
    }
}

/* Runs the type's callback with grad mode off inside a scope of its own; on success outs hold
 * references of ours, checked against the metas. */
static int run_dispatch(const ag_subclass_type *type, const ag_op *op, const ag_arg *full,
                        const ag_tmeta *metas, int nouts, ag_tensor **outs) {
    ag__tls_state *ts = ag__tls();
    ag_tensor *tmp[AG_MAX_OUTPUTS] = {0};
    ts->dispatch_depth++;
    uint64_t errs = ag__err_count();
    ag_scope_begin();
    int n = type->dispatch(type, op, full, op->nargs, tmp);
    if (n >= 0 && ag__err_count() != errs && ag_last_status() < 0)
        n = ag_last_status();
    if (n < 0 && ag_last_status() == 0)
        n = ag__err(AG_EINVAL, "%s: %s's dispatch failed without a message", op->name, type->name);
    if (n >= 0 && n != nouts)
        n = ag__err(AG_EINVAL, "%s: %s's dispatch returned %d outputs, the op has %d", op->name,
                    type->name, n, nouts);
    for (int k = 0; n >= 0 && k < nouts; k++) {
        const ag_tensor *t = tmp[k];
        char a[160], b[160];
        if (!t) {
            n = ag__err(AG_EINVAL, "%s: %s's dispatch returned no output %d", op->name, type->name,
                        k);
        } else if (t->dtype != metas[k].dtype || t->ndim != metas[k].ndim ||
                   memcmp(t->sizes, metas[k].sizes, sizeof(int64_t) * (size_t)t->ndim)) {
            n = ag__err(AG_EINVAL, "%s: %s's dispatch returned %s for output %d; the op gives %s%s",
                        op->name, type->name, ag_tensor_meta_str(t, a, sizeof a), k,
                        ag_dtype_short(metas[k].dtype),
                        ag__fmt_sizes(b, sizeof b, metas[k].ndim, metas[k].sizes));
        }
    }
    for (int k = 0; k < nouts; k++)
        outs[k] = n >= 0 ? ag_tensor_keep(tmp[k]) : NULL;
    ag_scope_end();
    ts->dispatch_depth--;
    return n < 0 ? n : 0;
}

int ag__subclass_call(const ag_subclass_type *type, const ag_op *op, const ag_arg *full,
                      const ag_tmeta *metas, int nouts, ag_tensor **outs) {
    const ag_opdef *def = op->def;
    ag__tls_state *ts = ag__tls();
    const bool wanted = ag__autograd_wanted(op, full, op->nargs);
    int rc = ag__autograd_check_inplace(op, full, op->nargs);
    if (rc)
        return rc;
    const bool inplace = def->flags & AG_OP_INPLACE;
    const bool records = wanted && def->backward;

    bool prev_grad = ag_set_grad_enabled(false);
    /* Inner calls traced in a forward carry the seq_nr of the node about to be recorded. */
    int64_t prev_seq = ts->bw_seq_nr;
    if (prev_seq < 0 && records)
        ts->bw_seq_nr = ag__autograd_current_seq() + 1;
    /* An in-place op whose backward needs the original self saves a copy taken first. */
    ag_tensor *orig_self = NULL;
    if (inplace && (def->save_args & 1) && wanted) {
        ag_scope_begin();
        orig_self = ag_tensor_keep(ag_clone(full[0].u.t));
        ag_scope_end();
        if (!orig_self)
            rc = ag_last_status();
    }
    if (rc == 0)
        rc = run_dispatch(type, op, full, metas, nouts, outs);
    ts->bw_seq_nr = prev_seq;
    ag_set_grad_enabled(prev_grad);
    if (rc) {
        ag_tensor_free(orig_self);
        return rc;
    }

    if (inplace) { /* the outer self is the result, whatever the callback wrapped */
        ag_tensor_free(outs[0]);
        outs[0] = ag_tensor_keep(full[0].u.t);
    } else if ((def->flags & AG_OP_VIEW) && outs[0]->sub && full[0].u.t->sub &&
               outs[0]->storage != full[0].u.t->storage) {
        /* A view of an instance shares its version counter (the outer storage), as
         * return_and_correct_aliasing makes upstream. */
        ag_storage *s = outs[0]->storage;
        outs[0]->storage = full[0].u.t->storage;
        outs[0]->storage->refcount++;
        ag__storage_release(s);
        outs[0]->is_view = true;
    }
    for (int i = 0; i < op->nargs; i++)
        if (op->mutates[i] && full[i].kind == AG_ARG_TENSOR && full[i].u.t)
            full[i].u.t->storage->version++;
    rc = wanted ? ag__autograd_record(op, full, op->nargs, outs, nouts, orig_self) : 0;
    if (rc == 0 && wanted && ag__copyslices_wanted(op, outs, nouts))
        rc = ag__copyslices_record(outs[0]);
    ag_tensor_free(orig_self);
    if (rc)
        free_outs(outs, nouts);
    return rc;
}

/* ---- for dispatch callbacks ---- */

int ag_subclass_call_inner(const ag_op *op, const ag_arg *args, int nargs,
                           const ag_subclass_type *type, int k, ag_tensor **outs) {
    if (!op || nargs < 0 || nargs > AG_MAX_ARGS || (nargs && !args))
        return ag__err(AG_EINVAL, "subclass_call_inner: bad op or arguments");
    if (ag__subclass_type_check("subclass_call_inner", type))
        return AG_EINVAL;
    if (k < 0 || k >= type->ninner)
        return ag__err(AG_EINVAL, "subclass_call_inner: %s has no inner tensor %d", type->name, k);
    ag_arg a[AG_MAX_ARGS];
    ag_tensor **lists[AG_MAX_ARGS] = {0};
    int rc = 0;
    for (int i = 0; i < nargs && rc == 0; i++) {
        a[i] = args[i];
        if (a[i].kind == AG_ARG_TENSOR && ag_tensor_subclass(a[i].u.t) == type) {
            a[i].u.t = a[i].u.t->sub->inner[k];
        } else if (a[i].kind == AG_ARG_TENSORS && a[i].n > 0) {
            lists[i] = ag__malloc(sizeof(ag_tensor *) * (size_t)a[i].n);
            if (!lists[i]) {
                rc = AG_ENOMEM;
                break;
            }
            for (int e = 0; e < a[i].n; e++) {
                ag_tensor *t = a[i].u.ts[e];
                lists[i][e] = ag_tensor_subclass(t) == type ? t->sub->inner[k] : t;
            }
            a[i].u.ts = lists[i];
        }
    }
    if (rc == 0) {
        rc = ag_op_call(op, a, nargs, outs);
        if (rc >= 0 && ag_op_noutputs(op) >= 0) /* a list op returned its count */
            rc = ag_op_noutputs(op);
    }
    for (int i = 0; i < nargs; i++)
        ag__free(lists[i]);
    return rc;
}
