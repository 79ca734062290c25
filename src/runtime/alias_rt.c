/* The compiled callable's aliasing wrappers (declared in src/export/alias.h): the pieces of
 * upstream's RuntimeWrapper epilogue that regenerate aliasing outputs and apply metadata
 * mutations. (The flat inputs -> primals half, AOTDedupeWrapper and AOTSyntheticBaseWrapper
 * post_compile, is ag__rt_primals in src/export/alias.c: ag_joint_primals_from_flat uses it
 * too.)
 *
 * In: the joint's aliasing facts and the graph's outputs. Out: outputs regenerated as eager
 * views (as_strided) of their base, so they share storage with it and
 * gradients flowing into them reach the base. Geometry recorded at export is relative to the
 * base's offset; strides are used as recorded, so a base must have the strides it had. */
#include "../export/alias.h"

#include <stdio.h>

void ag__rt_set_geometry(ag_tensor *t, const ag_tmeta *rel, int64_t base_offset) {
    t->ndim = rel->ndim;
    memcpy(t->sizes, rel->sizes, sizeof t->sizes);
    memcpy(t->strides, rel->strides, sizeof t->strides);
    t->offset = base_offset + rel->offset;
}

ag_tensor *ag__rt_regen(ag_tensor *base, const ag_tmeta *rel, const ag_tmeta *base_meta,
                        bool requires_grad) {
    if (!ag__same_strides(base, base_meta)) {
        char x[128];
        ag__err(AG_ENOTSUP, "compiled: an output aliases a tensor of shape %s whose strides "
                            "differ from the export's; it cannot be regenerated as a view",
                ag__fmt_sizes(x, sizeof x, base->ndim, base->sizes));
        return NULL;
    }
    ag_tensor *r = ag_as_strided(base, rel->ndim, rel->sizes, rel->strides,
                                 base->offset + rel->offset);
    /* The output's requires_grad is the traced one (gen_alias_from_base's patch). */
    if (r && !requires_grad && ag_tensor_requires_grad(r))
        r = ag_detach(r);
    return r;
}
