/* CopySlices (copy_slices.c): the base's history after an in-place op on a view that takes part
 * in autograd. Internal to the library. */
#ifndef AG_OPS_COPY_SLICES_H
#define AG_OPS_COPY_SLICES_H

#include "../core/internal.h"

/* Whether the op just recorded on outs (by ag__autograd_record) mutated a view in place, so
 * its base's history must become CopySlices. */
bool ag__copyslices_wanted(const ag_op *op, ag_tensor *const *outs, int nouts);
/* Gives view's base a CopySlices node (its old history, the view's new one) and the view the
 * as_strided history of the new base. 0 or a negative status. */
int ag__copyslices_record(ag_tensor *view);

#endif
