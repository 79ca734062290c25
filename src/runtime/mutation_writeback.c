/* The input-mutation wrapper of the compiled callable (upstream's RuntimeWrapper epilogue for
 * MUTATED_OUT_GRAPH inputs): each InputMutationAOTOutput's new value is written back into the
 * primal its descriptor names, the caller's tensor, as eager mutated it (BatchNorm's running
 * statistics, a base's new value): metadata first (as_strided_), then data, bumping the
 * storage's version. It is a commit: the call's effect once nothing else can fail. Mutations
 * kept in the graph (keep_inference_input_mutations) have no output and are not written.
 *
 * A data mutation that takes a tangent (its primal requires grad) is an output of the
 * CompiledFunction node, and its write-back is the eager copy_ of that output into the
 * caller's tensor, recorded by autograd when grad mode is on: afterwards the tensor's history
 * is the copy, as eager's in-place op would have left it, and a loss computed from it reaches
 * the compiled backward (a view's base gets a CopySlices history, as in eager). Eager refuses
 * that in-place op on a leaf that requires grad and on a view of one; the call refuses them
 * before it runs. Other mutations are
 * written hidden from autograd. */
#include "compiled_internal.h"

static int mutations_pre(ag_compiled *c, ag__call *s) {
    if (!ag_is_grad_enabled())
        return 0;
    for (int k = 0; k < c->nmutated; k++) {
        int i = c->mut_primal[k];
        ag_tensor *x = s->prim[i];
        if (c->node_of_mut[k] < 0 || !x)
            continue;
        char name[320];
        if (ag_tensor_requires_grad(x) && !x->grad_fn)
            return ag__err(AG_EINVAL,
                           "compiled: %s is a leaf tensor that requires "
                           "grad and the compiled function mutates it in place: a leaf tensor "
                           "that requires grad is being used in an in-place operation (pass a "
                           "non-leaf, such as its clone, or call with grad mode off)",
                           ag__rt_primal_name(c, i, name, sizeof name));
        /* A view's write-back gives its base a CopySlices history, as eager's in-place op
         * does: refused here, before the call runs, where eager refuses that op. */
        const ag_tensor *base = x->is_view ? ag_tensor_base(x) : NULL;
        if (x->is_view && ag_tensor_requires_grad(x) &&
            (!base || !ag_tensor_is_contiguous(base) ||
             (ag_tensor_requires_grad(base) && !base->grad_fn)))
            return ag__err(base ? AG_EINVAL : AG_ENOTSUP,
                           "compiled: %s is a view %s and the compiled "
                           "function mutates it in place",
                           ag__rt_primal_name(c, i, name, sizeof name),
                           !base ? "without a base"
                           : !ag_tensor_is_contiguous(base)
                               ? "of a non-contiguous base"
                               : "of a leaf tensor that requires grad");
    }
    return 0;
}

static int mutations_commit(ag_compiled *c, ag__call *s) {
    int rc = 0;
    for (int k = 0; rc == 0 && k < c->nmutated; k++) {
        int i = c->mut_primal[k];
        const ag_input_info *ii = &c->in_info[i];
        ag_tensor *x = s->prim[i];
        if (ii->mutates_metadata)
            ag__rt_set_geometry(x, &c->alias.prim[i].new_geom, x->offset);
        if (!ii->mutates_data)
            continue;
        int ni = c->node_of_mut[k];
        if (ni >= 0 && s->node[ni]) {
            ag_scope_begin();
            rc = ag_copy_(x, s->node[ni]) ? 0 : ag_last_status();
            ag_scope_end();
        } else {
            rc = ag__copy_into(x, s->fo[ag__fw_at(c, AG_SEC_OUT_MUTATIONS, k)]);
            x->storage->version++;
        }
    }
    return rc;
}

const ag__rt_wrapper ag__rtw_mutations = {
    .name = "input_mutations", .pre = mutations_pre, .commit = mutations_commit};
