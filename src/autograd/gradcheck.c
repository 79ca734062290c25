/* ag_gradcheck: analytical gradients from the engine against float64 central differences.
 * The function is evaluated with the generator reset to the same state every time, so random
 * ops (dropout) see the same draws in every evaluation. */
#include "../core/internal.h"

#include <math.h>

static double *elem_ptr(ag_tensor *t, int64_t i) {
    int64_t off = t->offset;
    for (int d = t->ndim - 1; d >= 0; d--) {
        off += (i % t->sizes[d]) * t->strides[d];
        i /= t->sizes[d];
    }
    return (double *)t->storage->data + off;
}

/* sum_k <w_k, out_k> over float outputs, evaluated without grad. */
static int eval_dot(ag_gradcheck_fn fn, void *ud, ag_tensor *const *inputs, int n, ag_tensor **w,
                    uint64_t seed, uint64_t offset, double *res) {
    ag_rng_set_state(seed, offset);
    ag_tensor *outs[AG_GRADCHECK_MAX_OUT] = {0};
    int nouts = 0;
    bool prev = ag_set_grad_enabled(false);
    ag_scope_begin();
    int rc = fn(ud, inputs, n, outs, &nouts);
    double acc = 0;
    for (int k = 0; rc == 0 && k < nouts; k++) {
        if (!outs[k] || !w[k])
            continue;
        int64_t ne = ag_tensor_numel(outs[k]);
        for (int64_t i = 0; i < ne; i++)
            acc += ag__get_f64(w[k], i) * ag__get_f64(outs[k], i);
    }
    ag_scope_end();
    ag_set_grad_enabled(prev);
    *res = acc;
    return rc;
}

int ag_gradcheck(ag_gradcheck_fn fn, void *ud, ag_tensor *const *inputs, int n,
                 const ag_gradcheck_opts *opts) {
    AG__CHECK_NULL("gradcheck", fn);
    /* NULL and a zeroed struct are the same: torch.autograd.gradcheck's defaults; a field's
     * +0 is its default, -0 (AG_GRADCHECK_ZERO) a tolerance of 0. */
    ag_gradcheck_opts o = opts ? *opts : (ag_gradcheck_opts){0};
    if (!(o.eps >= 0 && o.eps < INFINITY && o.atol >= 0 && o.atol < INFINITY && o.rtol >= 0 &&
          o.rtol < INFINITY))
        return ag__err(AG_EINVAL,
                       "gradcheck: eps %g, atol %g and rtol %g must be finite and not negative",
                       o.eps, o.atol, o.rtol);
    if (o.eps == 0)
        o.eps = 1e-6;
    if (o.atol == 0 && !signbit(o.atol))
        o.atol = 1e-5;
    if (o.rtol == 0 && !signbit(o.rtol))
        o.rtol = 1e-3;
    for (int i = 0; i < n; i++)
        if (!inputs[i] || (inputs[i]->requires_grad && inputs[i]->dtype != AG_F64))
            return ag__err(AG_EINVAL, "gradcheck: input %d must be a float64 tensor", i);
    /* Which inputs are differentiated is decided before the first call: an in-place op makes
     * its mutated input require grad as a side effect. */
    bool rg[64];
    if (n > 64)
        return ag__err(AG_EINVAL, "gradcheck: at most 64 inputs");
    for (int i = 0; i < n; i++)
        rg[i] = inputs[i]->requires_grad;
    uint64_t seed, offset;
    ag_rng_get_state(&seed, &offset);

    ag_scope_begin();
    ag_tensor *outs[AG_GRADCHECK_MAX_OUT] = {0};
    ag_tensor *w[AG_GRADCHECK_MAX_OUT] = {0};
    ag_tensor *fouts[AG_GRADCHECK_MAX_OUT], *fw[AG_GRADCHECK_MAX_OUT];
    ag_tensor *rg_in[64], *grads[64] = {0};
    int nouts = 0, nf = 0, nrg = 0, rc;
    ag_rng_set_state(seed, offset);
    rc = fn(ud, inputs, n, outs, &nouts);
    if (rc == 0) {
        /* Fixed pseudo-random output weights so every element of every output matters. */
        uint64_t st = 0x243F6A8885A308D3ull;
        for (int k = 0; k < nouts; k++) {
            if (!outs[k] || !ag_dtype_is_float(outs[k]->dtype) || !outs[k]->requires_grad)
                continue;
            w[k] = ag_zeros_like(outs[k]);
            w[k] = w[k] ? ag_to_dtype(w[k], AG_F64) : NULL;
            if (!w[k]) {
                rc = ag_last_status();
                break;
            }
            int64_t ne = ag_tensor_numel(w[k]);
            double *d = (double *)ag_tensor_data(w[k]);
            for (int64_t i = 0; i < ne; i++) {
                st ^= st << 13;
                st ^= st >> 7;
                st ^= st << 17;
                d[i] = 0.5 + (double)(st >> 11) * 0x1.0p-53;
            }
            fouts[nf] = outs[k];
            fw[nf++] = w[k];
        }
    }
    for (int i = 0; i < n && rc == 0; i++)
        if (rg[i])
            rg_in[nrg++] = inputs[i];
    if (rc == 0 && nf == 0)
        rc = ag__err(AG_EINVAL, "gradcheck: no output requires grad");
    if (rc == 0 && nrg > 0)
        rc = ag_grad(fouts, fw, nf, rg_in, nrg, grads, false, true);
    /* Numerical derivatives, one element at a time. */
    int r = 0;
    for (int i = 0; i < n && rc == 0; i++) {
        ag_tensor *in = inputs[i];
        if (!rg[i])
            continue;
        ag_tensor *g = grads[r++];
        int64_t ne = ag_tensor_numel(in);
        for (int64_t e = 0; e < ne && rc == 0; e++) {
            double *p = elem_ptr(in, e), orig = *p, fp, fm;
            *p = orig + o.eps;
            rc = eval_dot(fn, ud, inputs, n, w, seed, offset, &fp);
            *p = orig - o.eps;
            if (rc == 0)
                rc = eval_dot(fn, ud, inputs, n, w, seed, offset, &fm);
            *p = orig;
            if (rc)
                break;
            double num = (fp - fm) / (2 * o.eps);
            double ana = g ? ag__get_f64(g, e) : 0.0;
            if (!(fabs(ana - num) <= o.atol + o.rtol * fabs(num)))
                rc = ag__err(AG_EINVAL,
                             "gradcheck: input %d, element %lld: analytical %.10g vs numerical "
                             "%.10g",
                             i, (long long)e, ana, num);
        }
    }
    ag_scope_end();
    ag_rng_set_state(seed, offset);
    return rc;
}
