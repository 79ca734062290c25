/* CopySlices (upstream's name): after an in-place op on a view of a tensor that takes part in
 * autograd, the base's history. Called by the dispatcher (optable.c, subclass_call.c) right
 * after it recorded the op's node on the view (core/autograd_graph.c); it lives here, above the
 * core, because its backward and the view's new history are ops. */
#include "copy_slices.h"
#include "aotgrad/ops.h"

#include <string.h>

/* After the op's node is recorded on the view v, the base b gets a node with two inputs: b's
 * old history and v's new one (the op's node). Its backward sends the gradient of b's new
 * value to b's old history with v's region zeroed, and v's region to the op's node (whose
 * backward reaches b's old history again through v's view chain). v's history becomes the
 * as_strided view of the new b, as upstream. */
typedef struct copyslices {
    int ndim;
    int64_t sizes[AG_MAX_DIMS], strides[AG_MAX_DIMS];
    int64_t off; /* v's offset relative to b's (b is contiguous) */
} copyslices;

static int copyslices_backward(void *ud, ag_tensor *const *gout, int nout, ag_tensor **gin, int nin,
                               const bool *needs) {
    (void)nout, (void)nin;
    const copyslices *g = ud;
    ag_tensor *go = gout[0];
    if (!go)
        return 0;
    if (needs[0]) {
        ag_tensor *z = ag_zeros(go->dtype, g->ndim, g->sizes);
        gin[0] = ag__call1(ag__op("as_strided_scatter"),
                           (ag_arg[]){AG_A_T(go), AG_A_T(z), AG_A_INTS(g->sizes, g->ndim),
                                      AG_A_INTS(g->strides, g->ndim), AG_A_I(g->off)},
                           5);
    }
    if (needs[1]) {
        ag_tensor *c = ag_clone(go); /* contiguous, offset 0 */
        gin[1] = c ? ag_as_strided(c, g->ndim, g->sizes, g->strides, g->off) : NULL;
    }
    return 0;
}

int ag__copyslices_record(ag_tensor *view) {
    ag_tensor *base = view->base;
    copyslices *g = ag__malloc(sizeof *g);
    if (!g)
        return AG_ENOMEM;
    g->ndim = view->ndim;
    memcpy(g->sizes, view->sizes, sizeof g->sizes);
    memcpy(g->strides, view->strides, sizeof g->strides);
    g->off = view->offset - base->offset;
    ag_tensor *ins[2] = {base, view};
    int rc =
        ag__autograd_custom("CopySlices", ins, 2, &base, 1, NULL, copyslices_backward, g, ag__free);
    if (rc)
        return rc;
    const ag_op *as = ag__op("as_strided");
    if (!as)
        return ag_last_status();
    ag_arg a[4] = {AG_A_T(base), AG_A_INTS(view->sizes, view->ndim),
                   AG_A_INTS(view->strides, view->ndim), AG_A_I(view->offset)};
    return ag__autograd_record(as, a, 4, &view, 1, NULL);
}

bool ag__copyslices_wanted(const ag_op *op, ag_tensor *const *outs, int nouts) {
    const ag_opdef *def = ag_op_def(op);
    return nouts > 0 && outs[0] && (def->flags & AG_OP_INPLACE) &&
           !(def->flags & AG_OP_INPLACE_VIEW) && outs[0]->is_view && outs[0]->base &&
           outs[0]->grad_fn && outs[0]->requires_grad;
}
