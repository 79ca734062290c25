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
#include "subclass_wrap.h"

#include <stdio.h>

/* ---- gradients <-> primals, by descriptor ---- */


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

int ag__subx_call(ag_compiled *c, ag__subx_info *info, ag_tensor *const *inputs, int ninputs,
                  ag_tensor **outs, int max_out) {
    if (ninputs != info->nin)
        return ag__err(AG_EINVAL,
                       "compiled: %d inputs given, the exported function takes %d "
                       "(params, buffers, args)",
                       ninputs, info->nin);
    if (max_out < info->nout)
        return ag__err(AG_EINVAL, "compiled: room for %d outputs, %d needed", max_out, info->nout);
    for (int i = 0; i < ninputs; i++)
        if (!inputs[i])
            return ag__has_error() ? ag_last_status()
                                   : ag__err(AG_EINVAL, "compiled: input %d is NULL", i);
    for (int i = 0; i < info->nin; i++)
        if (info->in[i].nflat > 64)
            return ag__err(AG_ENOTSUP, "compiled: input %d flattens into %d tensors (at most 64)",
                           i, info->in[i].nflat);
    for (int k = 0; k < info->nout; k++)
        if (info->out[k].nflat > 64)
            return ag__err(AG_ENOTSUP, "compiled: output %d flattens into %d tensors (at most 64)",
                           k, info->out[k].nflat);
    int nfi = info->nflat_in, nfo = info->nflat_out;
    ag_tensor **flat = ag__calloc((size_t)(nfi ? nfi : 1), sizeof *flat);
    uint64_t *ver = ag__calloc((size_t)(nfi ? nfi : 1), sizeof *ver);
    ag_tensor **dout = ag__calloc((size_t)(nfo ? nfo : 1), sizeof *dout);
    if (!flat || !ver || !dout) {
        ag__free(flat);
        ag__free(ver);
        ag__free(dout);
        return AG_ENOMEM;
    }
    for (int k = 0; k < info->nout; k++)
        outs[k] = NULL;
    bool scoped = ag__in_scope(), grad = ag_is_grad_enabled();
    int rc = 0;
    ag_scope_begin();
    /* Inputs: checked against the exported structure and taken apart. */
    for (int i = 0, s = 0; i < info->nin && rc == 0; s += info->in[i].nflat, i++) {
        const ag__scmeta *m = &info->in[i];
        char what[64];
        snprintf(what, sizeof what, "compiled: input %d", i);
        if ((rc = ag__scmeta_unwrap(m, inputs[i], flat + s, what)))
            break;
        for (int k = 0; k < m->nflat; k++)
            ver[s + k] = ag_tensor_version(flat[s + k]);
        if (!m->type || !grad || !ag_tensor_requires_grad(inputs[i]))
            continue;
        for (int k = 0; k < m->nflat && rc == 0; k++)
            if (!(flat[s + k] = ag_detach(flat[s + k])))
                rc = ag_last_status();
        end_ud *u = rc == 0 ? end_ud_new(info, i) : NULL;
        if (rc == 0 && !u)
            rc = AG_ENOMEM;
        if (rc == 0)
            rc = ag__autograd_custom("SubclassUnwrapBackward", &inputs[i], 1, flat + s, m->nflat,
                                     NULL, unwrap_backward, u, end_ud_free);
    }
    int n = rc ? rc : ag__compiled_call_flat(c, flat, nfi, dout, nfo);
    if (n < 0)
        rc = n;
    /* An input whose inner tensors were written back (a mutated subclass buffer) changed. */
    for (int i = 0, s = 0; i < info->nin && rc == 0; s += info->in[i].nflat, i++)
        for (int k = 0; k < info->in[i].nflat && info->in[i].type; k++)
            if (ag_tensor_version(flat[s + k]) != ver[s + k]) {
                ag_tensor_bump_version(inputs[i]);
                break;
            }
    /* Outputs: rebuilt from their plain parts. */
    for (int k = 0, p = 0; k < info->nout && rc == 0; p += info->out[k].nflat, k++) {
        const ag__scmeta *m = &info->out[k];
        ag_tensor *o = ag__scmeta_wrap(m, dout + p);
        if (!o) {
            rc = ag_last_status();
            break;
        }
        bool diff = false;
        for (int e = 0; e < m->nflat; e++)
            diff |= dout[p + e] && ag_tensor_requires_grad(dout[p + e]);
        if (m->type && grad && diff) {
            end_ud *u = end_ud_new(info, k);
            rc = u ? ag__autograd_custom("SubclassWrapBackward", dout + p, m->nflat, &o, 1, NULL,
                                         wrap_backward, u, end_ud_free)
                   : AG_ENOMEM;
        }
        outs[k] = ag_tensor_keep(o);
    }
    ag_scope_end();
    for (int k = 0; k < info->nout; k++) {
        if (rc) {
            ag_tensor_free(outs[k]);
            outs[k] = NULL;
        } else if (scoped) {
            outs[k] = ag__give(outs[k]);
        }
    }
    ag__free(flat);
    ag__free(ver);
    ag__free(dout);
    return rc ? rc : info->nout;
}
