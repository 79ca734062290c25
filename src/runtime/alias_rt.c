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
        ag__err(AG_ENOTSUP,
                "compiled: an output aliases a tensor of shape %s whose strides "
                "differ from the export's; it cannot be regenerated as a view",
                ag__fmt_sizes(x, sizeof x, base->ndim, base->sizes));
        return NULL;
    }
    ag_tensor *r =
        ag_as_strided(base, rel->ndim, rel->sizes, rel->strides, base->offset + rel->offset);
    /* The output's requires_grad is the traced one (gen_alias_from_base's patch). */
    if (r && !requires_grad && ag_tensor_requires_grad(r))
        r = ag_detach(r);
    return r;
}

/* ---- the wrappers (compiled_internal.h) ---- */

#include "compiled_internal.h"

/* Dedupe and synthetic bases (upstream's AOTDedupeWrapper and AOTSyntheticBaseWrapper): the
 * flat inputs become the primals (removed duplicates dropped, merged inputs replaced by their
 * base), each checked against the dtype and shape the graph was exported (or updated) for; the
 * metadata mutations of merged inputs are the call's last effect. */
static int dedupe_pre(ag_compiled *c, ag__call *s) {
    if (s->nflat != c->nflat)
        return ag__err(AG_EINVAL,
                       "compiled: %d inputs given, the exported function takes %d "
                       "(params, buffers, args)",
                       s->nflat, c->nflat);
    int rc = ag__rt_primals_named(&c->alias, c->in_meta, s->flat, s->nflat, c->flat_desc,
                                  c->sub ? "flat input" : "input", s->prim, s->owned, &s->nowned);
    char name[320];
    for (int i = 0; rc == 0 && i < c->nprimals; i++) {
        const ag_tmeta *m = &c->in_meta[i];
        ag_tensor *t = s->prim[i];
        if (t->dtype != m->dtype || t->ndim != m->ndim ||
            memcmp(t->sizes, m->sizes, sizeof(int64_t) * (size_t)m->ndim)) {
            char a[128], b[128];
            rc = ag__err(AG_EINVAL, "compiled: %s is %s%s; the graph was exported for %s%s",
                         ag__rt_primal_name(c, i, name, sizeof name), ag_dtype_short(t->dtype),
                         ag__fmt_sizes(a, sizeof a, t->ndim, t->sizes), ag_dtype_short(m->dtype),
                         ag__fmt_sizes(b, sizeof b, m->ndim, m->sizes));
        }
    }
    /* An input that requires grad now but did not at export has no gradient in the joint:
     * refused before anything runs rather than left silently without one (upstream's guards
     * would recompile; the callable does not own the module to export it again). One that
     * required grad then but not now is fine: its gradient is computed and dropped. */
    for (int i = 0; rc == 0 && ag_is_grad_enabled() && i < c->nprimals; i++)
        if (!c->in_info[i].requires_grad && ag_tensor_requires_grad(s->prim[i]))
            rc = ag__err(AG_EINVAL,
                         "compiled: %s requires grad but did not when the joint was exported, "
                         "so the compiled function has no gradient for it; export again with "
                         "it requiring grad (or call with grad mode off, or detach it)",
                         ag__rt_primal_name(c, i, name, sizeof name));
    return rc;
}

static int dedupe_commit(ag_compiled *c, ag__call *s) {
    for (int i = 0; i < c->nflat; i++) {
        const ag__flat_info *f = &c->alias.flat[i];
        if (f->kind == AG__FLAT_VIEW && f->metadata_mutation >= 0)
            ag__rt_set_geometry(s->flat[i], &f->new_geom, s->prim[f->primal]->offset);
    }
    return 0;
}

const ag__rt_wrapper ag__rtw_dedupe = {
    .name = "dedupe_and_synthetic_bases",
    .pre = dedupe_pre,
    .commit = dedupe_commit,
};

/* Outputs that alias an input, an intermediate base or another output (upstream's
 * RuntimeWrapper epilogue): regenerated as views of their base after the autograd node is
 * attached, so gradients reach it; aliases of other outputs last. */
static ag_tensor *regen_output(ag_compiled *c, ag__call *s, int k) {
    const ag_output_info *oi = &c->out_info[k];
    const ag_tmeta *geom = &c->alias.out[k].geom;
    int b = oi->base_index;
    switch (oi->alias) {
    case AG_OUT_IS_INPUT:
        return s->prim[b];
    case AG_OUT_ALIAS_OF_INPUT:
        return ag__rt_regen(s->prim[b], geom, &c->in_meta[b], oi->requires_grad);
    case AG_OUT_ALIAS_OF_INTERMEDIATE:
    case AG_OUT_ALIAS_OF_INTERMEDIATE_SAVE_AS_OUTPUT:
        return ag__rt_regen(s->node[c->nnode - c->ninter + b], geom,
                            &c->fw_out_meta[ag__fw_at(c, AG_SEC_OUT_INTERMEDIATE_BASES, b)],
                            oi->requires_grad);
    case AG_OUT_ALIAS_OF_INTERMEDIATE_BASE_IS_USER_OUTPUT:
        return ag__rt_regen(s->flat_out[b], geom, &c->fw_out_meta[ag__fw_at(c, AG_SEC_OUT_USER, b)],
                            oi->requires_grad);
    default:
        return NULL;
    }
}

static int aliased_post(ag_compiled *c, ag__call *s) {
    for (int pass = 0; pass < 2; pass++)
        for (int k = 0; k < c->nuser; k++) {
            ag_output_alias a = c->out_info[k].alias;
            bool of_output = a == AG_OUT_ALIAS_OF_INTERMEDIATE_BASE_IS_USER_OUTPUT;
            if (c->node_of_user[k] >= 0 || of_output != (pass == 1) ||
                !s->fo[ag__fw_at(c, AG_SEC_OUT_USER, k)])
                continue;
            ag_tensor *r = regen_output(c, s, k);
            if (!r)
                return ag_last_status() ? ag_last_status() : AG_EINVAL;
            s->flat_out[k] = ag_tensor_keep(r);
        }
    return 0;
}

const ag__rt_wrapper ag__rtw_aliased = {.name = "aliased_outputs", .post = aliased_post};
