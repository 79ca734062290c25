/* The compiled callable's aliasing wrappers (declared in src/export/alias.h): upstream's
 * AOTDedupeWrapper and AOTSyntheticBaseWrapper post_compile (flat inputs -> the graph's
 * primals) and the pieces of the RuntimeWrapper epilogue that regenerate aliasing outputs
 * and apply metadata mutations.
 *
 * In: the caller's flat inputs and the joint's aliasing facts. Out: the primals to run the
 * graph on (a removed duplicate is dropped after checking it is the first occurrence's
 * tensor; a view base is the inputs' ._base; a synthetic base is a 1-d tensor over their
 * storage, so writing the base's new value back updates every caller view), and outputs
 * regenerated as eager views (as_strided) of their base, so they share storage with it and
 * gradients flowing into them reach the base. Geometry recorded at export is relative to the
 * base's offset; strides are used as recorded, so a base must have the strides it had. */
#include "../export/alias.h"

#include <stdio.h>

static bool same_strides(const ag_tensor *t, const ag_tmeta *m) {
    if (t->ndim != m->ndim)
        return false;
    for (int d = 0; d < m->ndim; d++)
        if (t->sizes[d] != m->sizes[d] || (m->sizes[d] > 1 && t->strides[d] != m->strides[d]))
            return false;
    return true;
}

int ag__rt_primals(const ag__joint_alias *a, const ag_tmeta *pm, ag_tensor *const *flat,
                   int nflat, ag_tensor **prim, ag_tensor **owned, int *nowned) {
    *nowned = 0;
    for (int i = 0; i < nflat; i++)
        if (!flat[i])
            return ag__has_error() ? ag_last_status() : ag__err(AG_EINVAL, "compiled: input %d is NULL", i);
    for (int i = 0; i < nflat; i++) {
        const ag__flat_info *f = &a->flat[i];
        if (f->kind == AG__FLAT_DUP && flat[i] != flat[f->dup_of])
            return ag__err(AG_EINVAL, "compiled: input %d must be the same tensor as input %d: "
                                      "the graph was exported with one tensor passed twice and "
                                      "mutated, so the repeated argument was removed", i,
                           f->dup_of);
    }
    for (int p = 0; p < a->nprimals; p++) {
        const ag__primal_info *pi = &a->prim[p];
        ag_tensor *t = flat[pi->flat];
        if (pi->base == AG__BASE_NONE) {
            prim[p] = t;
            continue;
        }
        if (pi->base == AG__BASE_VIEW) {
            if (!t->base)
                return ag__err(AG_EINVAL, "compiled: input %d was a view at export (the graph "
                                          "takes its base as input %d) but is not a view now",
                               pi->flat, p);
            prim[p] = t->base;
        } else {
            int64_t numel = (int64_t)(t->storage->nbytes / ag_dtype_size(t->dtype));
            ag_tmeta m;
            ag__tmeta_contiguous(&m, t->dtype, 1, &numel);
            if (!(prim[p] = ag__tensor_alias(t, &m)))
                return ag_last_status();
            prim[p]->trace = NULL;
            owned[(*nowned)++] = prim[p];
        }
        if (prim[p]->offset != pm[p].offset || !same_strides(prim[p], &pm[p])) {
            char x[128], y[128];
            return ag__err(AG_EINVAL, "compiled: the base of input %d is %s with storage offset "
                                      "%lld; the graph was exported for %s with offset %lld",
                           pi->flat, ag__fmt_sizes(x, sizeof x, prim[p]->ndim, prim[p]->sizes),
                           (long long)prim[p]->offset, ag__fmt_sizes(y, sizeof y, pm[p].ndim, pm[p].sizes),
                           (long long)pm[p].offset);
        }
    }
    /* Merged inputs must be the views of their base that the graph regenerates. */
    for (int i = 0; i < nflat; i++) {
        const ag__flat_info *f = &a->flat[i];
        if (f->kind != AG__FLAT_VIEW)
            continue;
        ag_tensor *b = prim[f->primal], *v = flat[i];
        if (v->storage != b->storage || v->offset - b->offset != f->geom.offset ||
            !same_strides(v, &f->geom) || v->dtype != f->geom.dtype)
            return ag__err(AG_EINVAL, "compiled: input %d is not the view of its base (graph "
                                      "input %d) that it was at export: inputs that share memory "
                                      "must share it the same way on every call", i, f->primal);
    }
    return 0;
}

void ag__rt_set_geometry(ag_tensor *t, const ag_tmeta *rel, int64_t base_offset) {
    t->ndim = rel->ndim;
    memcpy(t->sizes, rel->sizes, sizeof t->sizes);
    memcpy(t->strides, rel->strides, sizeof t->strides);
    t->offset = base_offset + rel->offset;
}

ag_tensor *ag__rt_regen(ag_tensor *base, const ag_tmeta *rel, const ag_tmeta *base_meta,
                        bool requires_grad) {
    if (!same_strides(base, base_meta)) {
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
