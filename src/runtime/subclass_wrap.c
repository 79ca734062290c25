/* Tensor subclasses around a compiled joint: upstream's AOTDispatchSubclassWrapper.
 *
 * In: the caller's outer inputs (some of them subclass instances) and the joint's record of
 * every outer input's, gradient's and output's structure (ag__subx_info). Out: outer outputs,
 * rebuilt as instances where the user's function returned instances.
 *
 * The forward and backward graphs work on plain tensors only; this layer translates at both
 * ends, and the autograd engine does the rest:
 *   - a subclass input is taken apart into its plain inner tensors; when it requires grad, the
 *     parts are fresh aliases made outputs of a SubclassUnwrapBackward node whose input is the
 *     outer tensor, so the compiled function's node sees ordinary inputs that require grad,
 *     and the node's backward puts the inner gradients back together (with the structure the
 *     export traced for the gradient) as the outer tensor's gradient;
 *   - a subclass output is rebuilt from the compiled function's plain outputs; when they carry
 *     gradients it is the output of a SubclassWrapBackward node whose inputs are those plain
 *     outputs, so an incoming instance gradient is taken apart into the flattened tangents.
 * A plain gradient where an instance is expected is an error naming the output (there is no
 * coercion: a TwoTensor output needs a TwoTensor gradient). A missing gradient stays missing
 * and the compiled backward materializes zeros, as for plain outputs. Shapes are static: no
 * symbolic sizes are passed. */
#include "compiled_internal.h"

#include <stdio.h>

/* ---- the autograd nodes at both ends ---- */

typedef struct end_ud {
    ag__subx_info *info;
    int index; /* the outer input (unwrap) or output (wrap) */
} end_ud;

static void end_ud_free(void *p) {
    end_ud *u = p;
    if (u)
        ag__subx_info_release(u->info);
    ag__free(u);
}

static end_ud *end_ud_new(ag__subx_info *info, int index) {
    end_ud *u = ag__malloc(sizeof *u);
    if (u) {
        u->info = ag__subx_info_retain(info);
        u->index = index;
    }
    return u;
}

/* The plain leaves of m, in flattening order. */
static void leaves(const ag__scmeta *m, const ag_tmeta **out, int *k) {
    if (!m->type) {
        out[(*k)++] = &m->outer;
        return;
    }
    for (int i = 0; i < m->type->ninner; i++)
        leaves(&m->inner[i], out, k);
}

/* SubclassUnwrapBackward: the gradients of an input's plain parts, put back together. */
static int unwrap_backward(void *ud, ag_tensor *const *gout, int nout, ag_tensor **gin, int nin,
                           const bool *needs) {
    end_ud *u = ud;
    (void)nin;
    bool any = false;
    for (int k = 0; k < nout; k++)
        any |= gout[k] != NULL;
    if (!needs[0] || !any)
        return 0;
    const ag__scmeta *in = &u->info->in[u->index], *gm = &u->info->grad[u->index];
    const ag__scmeta *m = ag__scmeta_same_structure(gm, in) ? gm : in;
    const ag_tmeta *lv[64];
    ag_tensor *flat[64];
    int n = 0;
    leaves(m, lv, &n);
    for (int k = 0; k < nout && k < 64; k++) {
        flat[k] = gout[k] ? gout[k] : ag_zeros(lv[k]->dtype, lv[k]->ndim, lv[k]->sizes);
        if (!flat[k])
            return ag_last_status();
    }
    gin[0] = ag__scmeta_wrap(m, flat);
    return gin[0] ? 0 : ag_last_status();
}

/* SubclassWrapBackward: an output's instance gradient, taken apart into its plain parts. */
static int wrap_backward(void *ud, ag_tensor *const *gout, int nout, ag_tensor **gin, int nin,
                         const bool *needs) {
    end_ud *u = ud;
    (void)nout;
    if (!gout[0])
        return 0;
    ag_tensor *flat[64];
    char what[96];
    snprintf(what, sizeof what, "compiled: the gradient of output %d", u->index);
    int rc = ag__scmeta_unwrap(&u->info->out[u->index], gout[0], flat, what);
    for (int k = 0; rc == 0 && k < nin; k++)
        if (needs[k] && !(gin[k] = ag__give(ag_tensor_keep(flat[k]))))
            rc = ag_last_status();
    return rc;
}

/* ---- the call ---- */

/* ---- the wrapper (compiled_internal.h) ---- */

/* A call's arrays: the flat inputs, their versions before the call, the flat outputs. */
typedef struct subx_call {
    ag_tensor **flat;
    uint64_t *ver;
    ag_tensor **dout;
} subx_call;

/* The outer inputs, checked against the exported structure and taken apart. */
/* A message's name for outer input i, whose parts start at flat input b: its descriptor (its
 * first part's, less the subclass levels) and position, "ParamAOTInput(target='w') (input 0)". */
static const char *outer_name(const ag_compiled *c, int i, int b, char *buf, size_t n) {
    const ag_desc *d = c->flat_desc && b >= 0 && b < c->nflat ? c->flat_desc[b] : NULL;
    while (d && (ag_desc_kind_of(d) == AG_DESC_SUBCLASS_GETATTR_INPUT ||
                 ag_desc_kind_of(d) == AG_DESC_SUBCLASS_SIZE_INPUT ||
                 ag_desc_kind_of(d) == AG_DESC_SUBCLASS_STRIDE_INPUT))
        d = ag_desc_nested(d);
    return ag__flat_input_name(d, "input", i, buf, n);
}

static int subclass_pre(ag_compiled *c, ag__call *s) {
    ag__subx_info *info = c->sub;
    if (!info)
        return 0;
    if (s->ninputs != info->nin)
        return ag__err(AG_EINVAL,
                       "compiled: %d inputs given, the exported function takes %d "
                       "(params, buffers, args)",
                       s->ninputs, info->nin);
    char name[320];
    for (int i = 0, b = 0; i < s->ninputs; b += info->in[i].nflat, i++)
        if (!s->inputs[i])
            return ag__has_error() ? ag_last_status()
                                   : ag__err(AG_EINVAL, "compiled: %s is NULL",
                                             outer_name(c, i, b, name, sizeof name));
    for (int i = 0, b = 0; i < info->nin; b += info->in[i].nflat, i++)
        if (info->in[i].nflat > 64)
            return ag__err(AG_ENOTSUP, "compiled: %s flattens into %d tensors (at most 64)",
                           outer_name(c, i, b, name, sizeof name), info->in[i].nflat);
    for (int k = 0; k < info->nout; k++)
        if (info->out[k].nflat > 64)
            return ag__err(AG_ENOTSUP, "compiled: output %d flattens into %d tensors (at most 64)",
                           k, info->out[k].nflat);
    int nfi = info->nflat_in, nfo = info->nflat_out;
    subx_call *x = ag__calloc(1, sizeof *x);
    if (!x)
        return AG_ENOMEM;
    s->sub = x;
    x->flat = ag__calloc((size_t)(nfi ? nfi : 1), sizeof *x->flat);
    x->ver = ag__calloc((size_t)(nfi ? nfi : 1), sizeof *x->ver);
    x->dout = ag__calloc((size_t)(nfo ? nfo : 1), sizeof *x->dout);
    if (!x->flat || !x->ver || !x->dout)
        return AG_ENOMEM;
    bool grad = ag_is_grad_enabled();
    int rc = 0;
    for (int i = 0, b = 0; i < info->nin && rc == 0; b += info->in[i].nflat, i++) {
        const ag__scmeta *m = &info->in[i];
        char what[340];
        snprintf(what, sizeof what, "compiled: %s", outer_name(c, i, b, name, sizeof name));
        if ((rc = ag__scmeta_unwrap(m, s->inputs[i], x->flat + b, what)))
            break;
        for (int k = 0; k < m->nflat; k++)
            x->ver[b + k] = ag_tensor_version(x->flat[b + k]);
        if (!m->type || !grad || !ag_tensor_requires_grad(s->inputs[i]))
            continue;
        for (int k = 0; k < m->nflat && rc == 0; k++)
            if (!(x->flat[b + k] = ag_detach(x->flat[b + k])))
                rc = ag_last_status();
        end_ud *u = rc == 0 ? end_ud_new(info, i) : NULL;
        if (rc == 0 && !u)
            rc = AG_ENOMEM;
        if (rc == 0)
            rc = ag__autograd_custom("SubclassUnwrapBackward", &s->inputs[i], 1, x->flat + b,
                                     m->nflat, NULL, unwrap_backward, u, end_ud_free);
    }
    s->flat = x->flat;
    s->nflat = nfi;
    s->flat_out = x->dout;
    return rc;
}

/* The outer outputs, rebuilt from their plain parts. */
static int subclass_post(ag_compiled *c, ag__call *s) {
    ag__subx_info *info = c->sub;
    if (!info)
        return 0;
    subx_call *x = s->sub;
    bool grad = ag_is_grad_enabled();
    int rc = 0;
    for (int k = 0, p = 0; k < info->nout && rc == 0; p += info->out[k].nflat, k++) {
        const ag__scmeta *m = &info->out[k];
        ag_tensor *o = ag__scmeta_wrap(m, x->dout + p);
        if (!o)
            return ag_last_status();
        bool diff = false;
        for (int e = 0; e < m->nflat; e++)
            diff |= x->dout[p + e] && ag_tensor_requires_grad(x->dout[p + e]);
        if (m->type && grad && diff) {
            end_ud *u = end_ud_new(info, k);
            rc = u ? ag__autograd_custom("SubclassWrapBackward", x->dout + p, m->nflat, &o, 1, NULL,
                                         wrap_backward, u, end_ud_free)
                   : AG_ENOMEM;
        }
        s->outs[k] = ag_tensor_keep(o);
    }
    return rc;
}

/* An input whose inner tensors were written back (a mutated subclass buffer) changed. */
static int subclass_commit(ag_compiled *c, ag__call *s) {
    ag__subx_info *info = c->sub;
    subx_call *x = s->sub;
    for (int i = 0, b = 0; info && i < info->nin; b += info->in[i].nflat, i++)
        for (int k = 0; k < info->in[i].nflat && info->in[i].type; k++)
            if (ag_tensor_version(x->flat[b + k]) != x->ver[b + k]) {
                ag_tensor_bump_version((ag_tensor *)s->inputs[i]);
                break;
            }
    return 0;
}

static void subclass_end(ag_compiled *c, ag__call *s) {
    (void)c;
    subx_call *x = s->sub;
    if (!x)
        return;
    ag__free(x->flat);
    ag__free(x->ver);
    ag__free(x->dout);
    ag__free(x);
    s->sub = NULL;
}

static void subclass_clear(ag_compiled *c) {
    ag__subx_info_release(c->sub);
    c->sub = NULL;
}

const ag__rt_wrapper ag__rtw_subclass = {
    .name = "subclass",
    .pre = subclass_pre,
    .post = subclass_post,
    .commit = subclass_commit,
    .end = subclass_end,
    .clear = subclass_clear,
};
