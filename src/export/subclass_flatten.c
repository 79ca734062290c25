/* Tensor subclasses in ag_export_joint: upstream's aot_dispatch_subclass for the joint
 * (spec section 6.3, item 4), with static shapes.
 *
 * In: the outer inputs of an export (params, buffers, args, kwargs), some of them subclass
 * instances, and after the forward the outer user outputs. Out: the flattened calling
 * convention the joint graph has, and the record (ag__subx_info) the compiled callable uses to
 * unwrap inputs and rewrap outputs and gradients.
 *
 *   primals   each outer input flattened recursively into its plain inner tensors, in attrs
 *             order: SubclassGetAttrAOTInput(base=ParamAOTInput(target='w'), attr='a'), ...
 *             (a plain input keeps its own descriptor);
 *   outputs   each user output flattened: SubclassGetAttrAOTOutput(base=PlainAOTOutput(idx=k),
 *             attr='a'); an input mutation of an inner tensor is
 *             SubclassGetAttrAOTOutput(base=InputMutationAOTOutput(<outer>), attr=...);
 *   tangents  one per plain inner tensor of an output that gets a tangent:
 *             SubclassGetAttrAOTInput(base=TangentAOTInput(output=PlainAOTOutput(idx=k)), 'a');
 *   grads     per outer input, its gradient flattened:
 *             SubclassGetAttrAOTOutput(base=GradAOTOutput(grad_of=ParamAOTInput('w')), 'a'),
 *             or one None for an input without a gradient (as upstream, which unwraps the
 *             list of gradients, a None staying one None).
 * Shapes are static, so no SubclassSize/SubclassStride descriptors are made.
 *
 * Autograd runs at the outer level, as in eager: the forward's autograd nodes are recorded on
 * the outer tensors, the tangents of a subclass output are wrapped into an instance of the
 * output's structure, and ag_grad differentiates with respect to the outer inputs; the
 * subclasses' dispatch callbacks emit the inner ops the trace records. A gradient must have
 * its input's structure (a TwoTensor's gradient is a TwoTensor, a plain input's is plain): the
 * compiled callable pairs gradients with primals by descriptor. */
#include "subclass_flatten.h"
#include "alias.h"
#include "export_wrappers.h"
#include "../nn/nn_internal.h"

#include <stdio.h>

typedef struct ag__subx ag__subx;

/* Looks at the n outer inputs (params, buffers, args, kwargs: borrowed) and their descriptors
 * (ParamAOTInput, BufferAOTInput, PlainAOTInput: borrowed); when one is a subclass instance,
 * *sx becomes the flattening state, else NULL. 0 or a negative status. */
static int ag__subx_begin(ag__subx **sx, ag_tensor *const *in, ag_desc *const *descs, int n);
static int ag__subx_num_flat(const ag__subx *sx);
/* Flattened primal i: its plain tensor (borrowed) and, in *desc, a new reference to its
 * descriptor. */
static ag_tensor *ag__subx_flat(const ag__subx *sx, int i, ag_desc **desc);
static bool ag__subx_flat_requires_grad(const ag__subx *sx,
                                        int i); /* its outer input's, if float */
/* Whether flattened input i is an inner tensor of a subclass instance (not a plain input). */
static bool ag__subx_flat_is_inner(const ag__subx *sx, int i);
/* Starts an export pass: inner[] holds the pass's tensors for the flattened inputs (the
 * alias plan's, bound to the placeholders); the outer inputs are rebuilt from them (instances
 * rewrapped, requires_grad as the caller's), the module's parameters and buffers replaced by
 * theirs until ag__subx_pass_end, and *user receives the outer user inputs to call the forward
 * with. */
static int ag__subx_pass_begin(ag__subx *sx, ag_module *m, ag_tensor *const *inner,
                               ag_tensor ***user);
/* Ends the pass: the module's tensors are restored and the pass's outer inputs and outputs
 * dropped (the input flattening stays for the next pass). */
static void ag__subx_pass_end(ag__subx *sx, ag_module *m);
/* Whether the state was made by ag__subx_outputs for plain inputs (freed after its pass). */
static bool ag__subx_pass_owned(const ag__subx *sx);
/* After the forward: replaces the outer outputs outs[0..nouts) by their flattened plain
 * tensors (the state keeps the outer ones) and returns the new count, or a negative status.
 * Creates the state when the inputs were plain but an output is a subclass (the flat primals
 * are then the outer inputs: flat/flat_descs). */
static int ag__subx_outputs(ag__subx **sx, ag_tensor **outs, int nouts, int max_out,
                            ag_tensor *const *flat, ag_desc *const *flat_descs, int nflat);
static bool ag__subx_out_requires_grad(const ag__subx *sx,
                                       int k);                /* flattened output k's outer's */
static ag_desc *ag__subx_out_desc(const ag__subx *sx, int k); /* new reference */
static ag_desc *ag__subx_mutation_desc(const ag__subx *sx, int i); /* of flattened primal i; new */
/* A copy of the record (NULL without a state); 0 or AG_ENOMEM. */
static int ag__subx_finish(ag__subx *sx, ag__subx_info **info);
static void ag__subx_free(ag__subx *sx); /* NULL: no-op */

struct ag__subx {
    /* outer inputs */
    int nin;
    ag_tensor **in;    /* borrowed */
    ag_desc **in_desc; /* owned */
    ag__scmeta *in_meta;
    ag__scmeta *grad_meta;
    int *in_start;   /* first flattened primal of each outer input; [nin] = nflat */
    int nuser_first; /* the first outer input that is the user's (after params and buffers) */
    /* this pass: the outer tensors the forward sees (references), and the module tensors they
     * replace while it runs */
    ag_tensor **cur;
    ag_tensor **swapped;
    bool pass_owned; /* made by ag__subx_outputs for this pass only (plain inputs) */
    /* flattened primals */
    int nflat;
    ag_tensor **flat;
    ag_desc **flat_desc; /* owned */
    int *flat_of;        /* outer input of each */
    /* outer outputs and their flattening */
    int nout;
    ag_tensor **out; /* references of ours */
    ag__scmeta *out_meta;
    int *out_start; /* [nout] = nout_flat */
    int nout_flat;
    int *oflat_of;
    ag_desc **oflat_desc; /* owned */
};

static void metas_free(ag__scmeta *m, int n) {
    for (int i = 0; m && i < n; i++)
        ag__scmeta_clear(&m[i]);
    ag__free(m);
}

static void ag__subx_free(ag__subx *sx) {
    if (!sx)
        return;
    for (int i = 0; sx->in_desc && i < sx->nin; i++)
        ag_desc_release(sx->in_desc[i]);
    for (int i = 0; sx->flat_desc && i < sx->nflat; i++)
        ag_desc_release(sx->flat_desc[i]);
    for (int i = 0; sx->out && i < sx->nout; i++)
        ag_tensor_free(sx->out[i]);
    for (int i = 0; sx->oflat_desc && i < sx->nout_flat; i++)
        ag_desc_release(sx->oflat_desc[i]);
    ag__free(sx->in);
    ag__free(sx->in_desc);
    metas_free(sx->in_meta, sx->nin);
    metas_free(sx->grad_meta, sx->nin);
    ag__free(sx->in_start);
    for (int i = 0; sx->cur && i < sx->nin; i++)
        ag_tensor_free(sx->cur[i]);
    ag__free(sx->cur);
    ag__free(sx->swapped);
    ag__free(sx->flat);
    ag__free(sx->flat_desc);
    ag__free(sx->flat_of);
    ag__free(sx->out);
    metas_free(sx->out_meta, sx->nout);
    ag__free(sx->out_start);
    ag__free(sx->oflat_of);
    ag__free(sx->oflat_desc);
    ag__free(sx);
}

/* ---- the record ---- */

void ag__subx_info_release(ag__subx_info *info) {
    if (!info || --info->refcount > 0)
        return;
    metas_free(info->in, info->nin);
    metas_free(info->grad, info->nin);
    metas_free(info->out, info->nout);
    ag__free(info);
}

ag__subx_info *ag__subx_info_retain(ag__subx_info *info) {
    if (info)
        info->refcount++;
    return info;
}

static int ag__subx_finish(ag__subx *sx, ag__subx_info **out) {
    *out = NULL;
    if (!sx)
        return 0;
    ag__subx_info *info = ag__calloc(1, sizeof *info);
    if (!info)
        return AG_ENOMEM;
    info->refcount = 1;
    info->nin = sx->nin;
    info->nout = sx->nout;
    info->nflat_in = sx->nflat;
    info->nflat_out = sx->nout_flat;
    size_t ci = (size_t)(sx->nin ? sx->nin : 1), co = (size_t)(sx->nout ? sx->nout : 1);
    info->in = ag__calloc(ci, sizeof *info->in);
    info->grad = ag__calloc(ci, sizeof *info->grad);
    info->out = ag__calloc(co, sizeof *info->out);
    int rc = info->in && info->grad && info->out ? 0 : AG_ENOMEM;
    for (int i = 0; i < sx->nin && rc == 0; i++)
        if ((rc = ag__scmeta_copy(&info->in[i], &sx->in_meta[i])) == 0)
            rc = ag__scmeta_copy(&info->grad[i], &sx->grad_meta[i]);
    for (int k = 0; k < sx->nout && rc == 0; k++)
        rc = ag__scmeta_copy(&info->out[k], &sx->out_meta[k]);
    if (rc) {
        ag__subx_info_release(info);
        return rc;
    }
    *out = info;
    return 0;
}

/* ---- inputs ---- */

/* Outer input o is the module's own parameter or buffer (by its descriptor). */
static bool outer_is_pb(const ag__subx *sx, int o) {
    ag_desc_kind k = ag_desc_kind_of(sx->in_desc[o]);
    return k == AG_DESC_PARAM || k == AG_DESC_BUFFER;
}

/* Shows the module tensor t in place of outer parameter or buffer o; returns the one it had. */
static ag_tensor *swap_pb(const ag__subx *sx, ag_module *m, int o, ag_tensor *t) {
    return ag__module_swap_tensor(m, ag_desc_target(sx->in_desc[o]),
                                  ag_desc_kind_of(sx->in_desc[o]) == AG_DESC_PARAM, t);
}

/* Builds the state over n outer inputs (tensors borrowed, descriptors taken over). */
static int subx_new(ag__subx **out, ag_tensor *const *in, ag_desc **descs, int n) {
    ag__subx *sx = ag__calloc(1, sizeof *sx);
    size_t cn = (size_t)(n ? n : 1);
    if (sx) {
        sx->nin = n;
        sx->in = ag__calloc(cn, sizeof *sx->in);
        sx->in_desc = ag__calloc(cn, sizeof *sx->in_desc);
        sx->in_meta = ag__calloc(cn, sizeof *sx->in_meta);
        sx->grad_meta = ag__calloc(cn, sizeof *sx->grad_meta);
        sx->in_start = ag__calloc(cn + 1, sizeof *sx->in_start);
        sx->cur = ag__calloc(cn, sizeof *sx->cur);
        sx->swapped = ag__calloc(cn, sizeof *sx->swapped);
    }
    if (!sx || !sx->in || !sx->in_desc || !sx->in_meta || !sx->grad_meta || !sx->in_start ||
        !sx->cur || !sx->swapped) {
        for (int i = 0; i < n; i++)
            ag_desc_release(descs[i]);
        if (sx)
            sx->nin = 0;
        ag__subx_free(sx);
        return AG_ENOMEM;
    }
    for (int i = 0; i < n; i++) {
        sx->in[i] = in[i];
        sx->in_desc[i] = descs[i];
        sx->in_meta[i].nflat = sx->grad_meta[i].nflat = 1;
    }
    int rc = 0, nf = 0;
    for (int i = 0; i < n && rc == 0; i++) {
        rc = ag__scmeta_of(in[i], &sx->in_meta[i]);
        sx->in_start[i] = nf;
        nf += sx->in_meta[i].nflat;
    }
    sx->in_start[n] = nf;
    sx->nflat = nf;
    for (int i = 0; i < n; i++) /* (the convention puts the user's inputs last) */
        sx->nuser_first = outer_is_pb(sx, i) ? i + 1 : sx->nuser_first;
    size_t cf = (size_t)(nf ? nf : 1);
    if (rc == 0) {
        sx->flat = ag__calloc(cf, sizeof *sx->flat);
        sx->flat_desc = ag__calloc(cf, sizeof *sx->flat_desc);
        sx->flat_of = ag__calloc(cf, sizeof *sx->flat_of);
        rc = sx->flat && sx->flat_desc && sx->flat_of ? 0 : AG_ENOMEM;
    }
    for (int i = 0; i < n && rc == 0; i++) {
        int s = sx->in_start[i];
        ag_subclass_flatten_tensors(&in[i], 1, sx->flat + s, sx->in_meta[i].nflat);
        rc = ag__scmeta_descs(&sx->in_meta[i], sx->in_desc[i], sx->flat_desc + s);
        for (int k = 0; k < sx->in_meta[i].nflat; k++)
            sx->flat_of[s + k] = i;
    }
    if (rc) {
        ag__subx_free(sx);
        return rc;
    }
    *out = sx;
    return 0;
}

static int ag__subx_begin(ag__subx **sx, ag_tensor *const *in, ag_desc *const *descs, int n) {
    *sx = NULL;
    bool any = false;
    for (int i = 0; i < n; i++)
        any |= ag_tensor_subclass(in[i]) != NULL;
    if (!any)
        return 0;
    ag_desc **d = ag__calloc((size_t)(n ? n : 1), sizeof *d);
    if (!d)
        return AG_ENOMEM;
    for (int i = 0; i < n; i++)
        d[i] = ag_desc_retain(descs[i]);
    int rc = subx_new(sx, in, d, n); /* takes the references */
    ag__free(d);
    return rc;
}

static int ag__subx_num_flat(const ag__subx *sx) {
    return sx->nflat;
}

static ag_tensor *ag__subx_flat(const ag__subx *sx, int i, ag_desc **desc) {
    *desc = ag_desc_retain(sx->flat_desc[i]);
    return sx->flat[i];
}

static bool ag__subx_flat_requires_grad(const ag__subx *sx, int i) {
    const ag_tensor *o = sx->in[sx->flat_of[i]];
    return ag_tensor_requires_grad(o) && ag_dtype_is_float(ag_tensor_dtype(o)) &&
           ag_dtype_is_float(ag_tensor_dtype(sx->flat[i]));
}

static bool ag__subx_flat_is_inner(const ag__subx *sx, int i) {
    return sx->in_meta[sx->flat_of[i]].type != NULL;
}

/* ---- one export pass ---- */

static int ag__subx_pass_begin(ag__subx *sx, ag_module *m, ag_tensor *const *inner,
                               ag_tensor ***user) {
    int rc = 0;
    for (int o = 0; o < sx->nin && rc == 0; o++) {
        const ag__scmeta *mt = &sx->in_meta[o];
        ag_tensor *t;
        if (!mt->type) {
            t = ag_tensor_keep(inner[sx->in_start[o]]);
        } else {
            ag_scope_begin();
            t = ag_tensor_keep(ag__scmeta_wrap(mt, inner + sx->in_start[o]));
            ag_scope_end();
            if (t)
                t->requires_grad = sx->in[o]->requires_grad;
        }
        if (!t) {
            rc = ag_last_status() ? ag_last_status() : AG_ENOMEM;
            break;
        }
        sx->cur[o] = t;
    }
    /* The module's parameters and buffers (by their descriptors' targets) are the pass's
     * tensors while the forward runs. */
    for (int o = 0; o < sx->nin && rc == 0 && m; o++)
        if (outer_is_pb(sx, o))
            sx->swapped[o] = swap_pb(sx, m, o, sx->cur[o]);
    *user = sx->cur + sx->nuser_first;
    return rc;
}

static void ag__subx_pass_end(ag__subx *sx, ag_module *m) {
    for (int o = sx->nin - 1; o >= 0; o--) { /* reversed: tied names restore last */
        if (sx->swapped[o] && m)
            swap_pb(sx, m, o, sx->swapped[o]);
        sx->swapped[o] = NULL;
    }
    for (int o = 0; o < sx->nin; o++) {
        ag_tensor_free(sx->cur[o]);
        sx->cur[o] = NULL;
    }
    /* The outputs are the pass's. */
    for (int k = 0; sx->out && k < sx->nout; k++)
        ag_tensor_free(sx->out[k]);
    for (int e = 0; sx->oflat_desc && e < sx->nout_flat; e++)
        ag_desc_release(sx->oflat_desc[e]);
    metas_free(sx->out_meta, sx->nout);
    ag__free(sx->out);
    ag__free(sx->out_start);
    ag__free(sx->oflat_of);
    ag__free(sx->oflat_desc);
    sx->out = NULL;
    sx->out_meta = NULL;
    sx->out_start = sx->oflat_of = NULL;
    sx->oflat_desc = NULL;
    sx->nout = sx->nout_flat = 0;
}

static bool ag__subx_pass_owned(const ag__subx *sx) {
    return sx && sx->pass_owned;
}

/* ---- outputs ---- */

static int ag__subx_outputs(ag__subx **sxp, ag_tensor **outs, int nouts, int max_out,
                            ag_tensor *const *flat, ag_desc *const *flat_descs, int nflat) {
    bool any = false;
    for (int k = 0; k < nouts; k++)
        any |= ag_tensor_subclass(outs[k]) != NULL;
    if (!*sxp && !any)
        return nouts;
    if (!*sxp) { /* plain inputs: the flat primals are the outer inputs */
        ag_desc **d = ag__calloc((size_t)(nflat ? nflat : 1), sizeof *d);
        if (!d)
            return AG_ENOMEM;
        for (int i = 0; i < nflat; i++)
            d[i] = ag_desc_retain(flat_descs[i]);
        int rc = subx_new(sxp, flat, d, nflat);
        ag__free(d);
        if (rc)
            return rc;
        (*sxp)->pass_owned = true;
        for (int i = 0; i < nflat; i++)
            (*sxp)->cur[i] = ag_tensor_keep(flat[i]);
    }
    ag__subx *sx = *sxp;
    size_t cn = (size_t)(nouts ? nouts : 1);
    sx->out = ag__calloc(cn, sizeof *sx->out);
    sx->out_meta = ag__calloc(cn, sizeof *sx->out_meta);
    sx->out_start = ag__calloc(cn + 1, sizeof *sx->out_start);
    if (!sx->out || !sx->out_meta || !sx->out_start)
        return AG_ENOMEM;
    sx->nout = nouts;
    for (int k = 0; k < nouts; k++)
        sx->out_meta[k].nflat = 1;
    int nf = 0;
    for (int k = 0; k < nouts; k++) {
        if (!outs[k])
            return ag__err(AG_EINVAL, "export: output %d is NULL", k);
        if (ag__scmeta_of(outs[k], &sx->out_meta[k]))
            return AG_ENOMEM;
        sx->out_start[k] = nf;
        nf += sx->out_meta[k].nflat;
    }
    sx->out_start[nouts] = nf;
    if (nf > max_out)
        return ag__err(AG_ENOTSUP, "export: the outputs flatten into %d plain tensors (at most %d)",
                       nf, max_out);
    size_t cf = (size_t)(nf ? nf : 1);
    sx->oflat_of = ag__calloc(cf, sizeof *sx->oflat_of);
    sx->oflat_desc = ag__calloc(cf, sizeof *sx->oflat_desc);
    if (!sx->oflat_of || !sx->oflat_desc)
        return AG_ENOMEM;
    sx->nout_flat = nf;
    for (int k = 0; k < nouts; k++) {
        ag_desc *base = ag_desc_plain_output(k);
        int rc = base ? ag__scmeta_descs(&sx->out_meta[k], base, sx->oflat_desc + sx->out_start[k])
                      : ag_last_status();
        ag_desc_release(base);
        if (rc)
            return rc;
        for (int e = sx->out_start[k]; e < sx->out_start[k + 1]; e++)
            sx->oflat_of[e] = k;
    }
    /* Keep the outer outputs, then put their plain tensors in their place. */
    for (int k = 0; k < nouts; k++)
        sx->out[k] = ag_tensor_keep(outs[k]);
    ag_subclass_flatten_tensors(sx->out, nouts, outs, max_out);
    return nf;
}

static bool ag__subx_out_requires_grad(const ag__subx *sx, int k) {
    return ag_tensor_requires_grad(sx->out[sx->oflat_of[k]]);
}

static ag_desc *ag__subx_out_desc(const ag__subx *sx, int k) {
    return ag_desc_retain(sx->oflat_desc[k]);
}

static ag_desc *ag__subx_mutation_desc(const ag__subx *sx, int i) {
    int o = sx->flat_of[i];
    ag_desc *base = ag_desc_input_mutation(sx->in_desc[o]);
    ag_desc *all[64] = {0}, *r = NULL;
    if (!base)
        return NULL;
    if (sx->in_meta[o].nflat > 64) {
        ag_desc_release(base);
        return ag__err(AG_ENOTSUP, "export: input %d flattens into %d tensors (at most 64)", o,
                       sx->in_meta[o].nflat),
               NULL;
    }
    if (ag__scmeta_descs(&sx->in_meta[o], base, all) == 0) {
        r = ag_desc_retain(all[i - sx->in_start[o]]);
        for (int e = 0; e < sx->in_meta[o].nflat; e++)
            ag_desc_release(all[e]);
    }
    ag_desc_release(base);
    return r;
}

/* ---- tangents and gradients ---- */

static bool gets_tangent(const ag_output_info *oi, const ag_tensor *t) {
    return oi->requires_grad &&
           (oi->alias == AG_OUT_NON_ALIAS || oi->alias == AG_OUT_UNSAFE_VIEW_ALIAS) &&
           ag_dtype_is_float(t->dtype);
}

/* The autograd part of the export with subclasses (the forward is tagged and the tracer
 * records the backward): one tangent placeholder per plain inner tensor of each output that
 * gets a tangent, the backward at the outer level, and the gradients' plain tensors as the
 * pass's GRADS outputs (one None per input without a gradient). */
static int subx_backward(ag__subx *sx, ag__export_pass *st) {
    ag_graph *g = st->g;
    ag__tracer *T = st->T;
    const ag_output_info *out_info = st->out_info;
    size_t cn = (size_t)(sx->nout ? sx->nout : 1), ci = (size_t)(sx->nin ? sx->nin : 1);
    ag_tensor **roots = ag__calloc(cn, sizeof *roots), **seeds = ag__calloc(cn, sizeof *seeds);
    ag_tensor **grad_of = ag__calloc(ci, sizeof *grad_of), **grads = ag__calloc(ci, sizeof *grads);
    ag_tensor *flat[64];
    ag_desc *descs[64] = {0};
    int rc = roots && seeds && grad_of && grads ? 0 : AG_ENOMEM;
    int nt = 0, nr = 0;
    /* Tangents: one placeholder per plain tensor of an output that gets one, wrapped back into
     * the output's structure to seed the backward. */
    for (int k = 0; k < sx->nout && rc == 0; k++) {
        int s = sx->out_start[k], n = sx->out_meta[k].nflat, cnt = 0;
        ag_tensor *pl[64];
        ag_subclass_flatten_tensors(&sx->out[k], 1, pl, 64);
        for (int e = 0; e < n && e < 64; e++)
            cnt += gets_tangent(&out_info[s + e], pl[e]);
        if (cnt == 0)
            continue;
        if (cnt != n || n > 64) {
            rc = ag__err(AG_ENOTSUP,
                         "export: output %d is a %s whose inner tensors cannot all "
                         "carry a gradient (%d of %d can)",
                         k, ag__scmeta_name(&sx->out_meta[k]), cnt, n);
            break;
        }
        ag_desc *od = ag_desc_plain_output(k), *td = od ? ag_desc_tangent(od) : NULL;
        rc = td ? ag__scmeta_descs(&sx->out_meta[k], td, descs) : ag_last_status();
        ag_desc_release(od);
        ag_desc_release(td);
        for (int e = 0; e < n && rc == 0; e++) {
            char name[32];
            snprintf(name, sizeof name, "tangents_%d", nt + 1);
            ag_tmeta mt;
            ag__tmeta_contiguous(&mt, pl[e]->dtype, pl[e]->ndim, pl[e]->sizes);
            ag_node *tp = ag_graph_placeholder(g, name, &mt);
            ag_tensor *tt =
                tp ? ag__tensor_new(pl[e]->dtype, pl[e]->ndim, pl[e]->sizes, true) : NULL;
            if (!tt || ag_node_set_desc(tp, descs[e]) ||
                ag_node_set_partitioner_tag(tp, "is_backward")) {
                ag_tensor_free(tt);
                rc = ag_last_status();
                break;
            }
            rc = ag__export_tangent(st, descs[e]);
            descs[e] = NULL;
            nt++;
            if (rc) {
                ag_tensor_free(tt);
                break;
            }
            ag__tracer_bind(T, tt, tp);
            if (!(flat[e] = ag__give(tt)))
                rc = ag_last_status();
        }
        for (int e = 0; e < n; e++) {
            ag_desc_release(descs[e]);
            descs[e] = NULL;
        }
        if (rc == 0) {
            roots[nr] = sx->out[k];
            if (!(seeds[nr++] = ag__scmeta_wrap(&sx->out_meta[k], flat)))
                rc = ag_last_status();
        }
    }
    /* The backward, differentiating with respect to the outer inputs. */
    int ng = 0;
    for (int i = 0; i < sx->nin && rc == 0; i++)
        if (ag_tensor_requires_grad(sx->cur[i]) && ag_dtype_is_float(ag_tensor_dtype(sx->cur[i])))
            grad_of[ng++] = sx->cur[i];
    if (rc == 0 && ng > 0 && nr > 0)
        rc = ag_grad(roots, seeds, nr, grad_of, ng, grads, false, true);
    /* Gradients, flattened: one None for an input without one. */
    for (int i = 0, gi = 0; i < sx->nin && rc == 0; i++) {
        ag_tensor *gt = NULL;
        if (ag_tensor_requires_grad(sx->cur[i]) && ag_dtype_is_float(ag_tensor_dtype(sx->cur[i])))
            gt = grads[gi++];
        if (!gt) {
            rc = ag__export_out(st, AG_SEC_OUT_GRADS, NULL, NULL, NULL);
            continue;
        }
        ag__scmeta *gm = &sx->grad_meta[i];
        ag__scmeta_clear(gm);
        if ((rc = ag__scmeta_of(gt, gm)))
            break;
        if (!ag__scmeta_same_structure(gm, &sx->in_meta[i])) {
            char b[256];
            ag_desc_repr(sx->in_desc[i], b, sizeof b);
            rc = ag__err(AG_ENOTSUP,
                         "export: the gradient of %s is a %s but the input is a %s; "
                         "a gradient must have its input's subclass structure",
                         b, ag__scmeta_name(gm), ag__scmeta_name(&sx->in_meta[i]));
            break;
        }
        if (gm->nflat > 64) {
            rc = ag__err(AG_ENOTSUP, "export: a gradient flattens into %d tensors (at most 64)",
                         gm->nflat);
            break;
        }
        ag_desc *gd = ag_desc_grad(sx->in_desc[i]);
        rc = gd ? ag__scmeta_descs(gm, gd, descs) : ag_last_status();
        ag_desc_release(gd);
        if (rc)
            break;
        ag_subclass_flatten_tensors(&gt, 1, flat, 64);
        for (int e = 0; e < gm->nflat; e++) {
            ag_node *gn = rc == 0 ? ag__tracer_node_of(T, flat[e]) : NULL;
            if (!gn && rc == 0)
                rc = ag_last_status();
            int r = ag__export_out(st, AG_SEC_OUT_GRADS, gn, descs[e], NULL); /* takes it */
            descs[e] = NULL;
            rc = rc ? rc : r;
        }
    }
    ag__free(roots);
    ag__free(seeds);
    ag__free(grad_of);
    ag__free(grads);
    return rc;
}

/* ---- the export's wrapper (export_wrappers.h) ----
 * Tensor subclasses (upstream's aot_dispatch_subclass): the flat inputs become the plain inner
 * tensors before the alias plan lays them out, the forward sees instances rebuilt from them,
 * the user outputs are flattened after it, and the backward runs at the outer level. Its slot
 * holds the state, NULL while no input or output is a subclass instance. */
static int sc_prepare(ag__export_pass *st, void **self) {
    ag__subx *sx = NULL;
    int rc = ag__subx_begin(&sx, st->flat, st->flat_descs, st->nflat);
    *self = sx;
    if (rc || !sx)
        return rc;
    int n = ag__subx_num_flat(sx);
    ag_tensor **flat = ag__calloc((size_t)(n ? n : 1), sizeof *flat);
    ag_desc **descs = ag__calloc((size_t)(n ? n : 1), sizeof *descs);
    if (!flat || !descs) {
        ag__free(flat);
        ag__free(descs);
        return AG_ENOMEM;
    }
    for (int i = 0; i < st->nflat; i++)
        ag_desc_release(st->flat_descs[i]);
    ag__free(st->flat_descs);
    ag__free(st->flat);
    st->flat = flat;
    st->flat_descs = descs;
    for (int i = 0; i < n; i++)
        flat[i] = ag__subx_flat(sx, i, &descs[i]);
    st->nflat = n;
    st->flat_module_tensors = false; /* the plan sees inner tensors, all fresh leaves */
    return 0;
}

static int sc_begin(ag__export_pass *st, void **self) {
    return *self ? ag__subx_pass_begin(*self, st->m, st->user, &st->user) : 0;
}

/* The user outputs flattened (the state is made here when only outputs are instances: the
 * flat primals are then the outer inputs). With subclass inputs, whether any input requires
 * grad is the outer inputs' question. */
static int sc_forward_done(ag__export_pass *st, void **self) {
    int n = ag__subx_outputs((ag__subx **)self, st->outs, st->nouts, AG__EXPORT_MAX_OUTS,
                             ag__aplan_flat_tensors(st->plan), st->flat_descs, st->nflat);
    if (n < 0)
        return n;
    st->nouts = n;
    if (*self) {
        st->any_rg_in = false;
        for (int i = 0; i < st->nflat; i++)
            st->any_rg_in |= ag__subx_flat_requires_grad(*self, i);
    }
    return 0;
}

/* The facts the alias plan gathered on the inner tensors are the outer tensors'
 * (requires_grad is the instance's), and the aliasing the flattening cannot express is
 * refused. */
static int sc_facts(ag__export_pass *st, void **self) {
    const ag__subx *sx = *self;
    const ag__joint_alias *a = &st->alias;
    if (!sx)
        return 0;
    if (a->nintermediate_bases > 0 || a->nmetadata_mutations > 0)
        return ag__err(AG_ENOTSUP, "export: outputs aliasing intermediates and metadata "
                                   "mutations are not supported together with tensor subclasses");
    for (int p = 0; p < a->nprimals; p++) {
        const ag_tmeta *m = ag_node_val(st->prim[p], 0);
        st->in_info[p].requires_grad =
            ag__subx_flat_requires_grad(sx, a->prim[p].flat) && ag_dtype_is_float(m->dtype);
    }
    for (int k = 0; k < st->nouts; k++)
        st->out_info[k].requires_grad = ag__subx_out_requires_grad(sx, k);
    return 0;
}

/* Input mutations and user outputs get the flattened descriptors: SubclassGetAttrAOTOutput of
 * the outer input's mutation, of the outer output. */
static int sc_outputs(ag__export_pass *st, void **self, ag_section sec) {
    const ag__subx *sx = *self;
    if (!sx || (sec != AG_SEC_OUT_MUTATIONS && sec != AG_SEC_OUT_USER))
        return 0;
    for (int e = 0, k = 0; e < st->nout; e++) {
        ag__export_output *o = &st->out[e];
        if (o->sec != sec)
            continue;
        ag_desc *d = sec == AG_SEC_OUT_USER
                         ? ag__subx_out_desc(sx, k++)
                         : ag__subx_mutation_desc(sx, st->alias.prim[o->primal].flat);
        if (!d)
            return ag_last_status() < 0 ? ag_last_status() : AG_ENOMEM;
        ag_desc_release(o->desc);
        o->desc = d;
    }
    return 0;
}

static int sc_trace_backward(ag__export_pass *st, void **self) {
    if (!*self)
        return 0;
    int rc = subx_backward(*self, st);
    return rc ? rc : 1;
}

static int sc_finish(ag__export_pass *st, void **self) {
    return ag__subx_finish(*self, &st->subclass);
}

static void sc_end(ag__export_pass *st, void **self) {
    ag__subx *sx = *self;
    if (sx)
        ag__subx_pass_end(sx, st->m);
    if (ag__subx_pass_owned(sx)) { /* made for this pass's subclass outputs */
        ag__subx_free(sx);
        *self = NULL;
    }
}

/* The final layout: inputs merged into a base, or removed duplicates among a subclass's inner
 * tensors, are refused with upstream's message. */
static int sc_settle(ag__export_pass *st, void **self, const ag__export_settled *f) {
    (void)st;
    const ag__subx *sx = *self;
    const ag__joint_alias *a = f->alias;
    for (int i = 0; sx && i < a->nflat; i++)
        if (a->flat[i].kind == AG__FLAT_VIEW ||
            (a->flat[i].kind == AG__FLAT_DUP && ag__subx_flat_is_inner(sx, i)))
            return ag__err(AG_ENOTSUP,
                           "Encountered aliased inputs that are mutated in the graph, but at "
                           "least one input/output to the graph is a tensor subclass. This is "
                           "not supported today. You can try to remove the aliasing yourself as "
                           "a workaround, or otherwise file an issue on github.");
    return 0;
}

static void sc_release(ag__export_pass *st, void **self) {
    (void)st;
    ag__subx_free(*self);
    *self = NULL;
}

const ag__export_wrapper ag__subclass_wrapper = {
    .name = "subclass",
    .prepare = sc_prepare,
    .begin = sc_begin,
    .forward_done = sc_forward_done,
    .facts = sc_facts,
    .outputs = sc_outputs,
    .trace_backward = sc_trace_backward,
    .finish = sc_finish,
    .end = sc_end,
    .settle = sc_settle,
    .release = sc_release,
};
