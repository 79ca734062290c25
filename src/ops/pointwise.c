/* Pointwise ops: arithmetic (add, sub, mul, div, pow), activations, comparisons, where,
 * masked_fill, clamp, and their ATen backward helpers (threshold_backward, ...).
 *
 * Each op is one ag_opdef: schema, flags, meta (broadcast + promotion), a kernel over the
 * strided iterator, a backward rule written with ops, and gradcheck samples. */
#include "kernel_util.h"
#include "family.h"

#include <math.h>

/* ---- shared meta: broadcast two tensors, promote dtypes ---- */

static int binary_meta(const char *op, const ag_tensor *a, const ag_tensor *b, ag_tmeta *out) {
    int n;
    int64_t sizes[AG_MAX_DIMS];
    int rc = ag__broadcast(op, a->ndim, a->sizes, b->ndim, b->sizes, &n, sizes);
    if (rc)
        return rc;
    ag__tmeta_contiguous(out, ag__promote(a->dtype, b->dtype), n, sizes);
    return 0;
}

/* ---- add.Tensor: self + alpha * other ---- */

static int add_meta(const ag_arg *a, ag_tmeta *o) { return binary_meta("add", a[0].u.t, a[1].u.t, o); }

static int add_kernel(const ag_arg *a, ag_tensor **o) {
    ag_tensor *x = a[0].u.t, *y = a[1].u.t, *out = o[0];
    double alpha = a[2].u.f;
    if (x->dtype != out->dtype || y->dtype != out->dtype) {
        /* Mixed dtypes: compute in the result dtype from converted copies. */
        ag_tensor *cx = ag__tensor_new(out->dtype, x->ndim, x->sizes, false);
        ag_tensor *cy = ag__tensor_new(out->dtype, y->ndim, y->sizes, false);
        int rc = (!cx || !cy) ? AG_ENOMEM : 0;
        if (!rc)
            rc = ag__copy_into(cx, x);
        if (!rc)
            rc = ag__copy_into(cy, y);
        ag_arg b[3] = {AG_A_T(cx), AG_A_T(cy), AG_A_F(alpha)};
        if (!rc)
            rc = add_kernel(b, o);
        ag_tensor_free(cx);
        ag_tensor_free(cy);
        return rc;
    }
    ag__iter it;
    ag_tensor *ops[3] = {out, x, y};
    ag__iter_build(&it, ops, 3);
    AG__ALL_SWITCH(out->dtype, T, AG__ITER_ROWS(it, {
        T *po = (T *)it.base[0] + off[0];
        const T *px = (const T *)it.base[1] + off[1];
        const T *py = (const T *)it.base[2] + off[2];
        const int64_t so = it.inner_stride[0], sx = it.inner_stride[1], sy = it.inner_stride[2];
        const T al = (T)alpha;
        if (it.inner_contig)
            for (int64_t k = 0; k < len; k++)
                po[k] = (T)(px[k] + al * py[k]);
        else
            for (int64_t k = 0; k < len; k++)
                po[k * so] = (T)(px[k * sx] + al * py[k * sy]);
    }));
    return 0;
}

static int add_backward(ag_bwctx *c) {
    ag_tensor *g = c->grad_outputs[0];
    double alpha = c->args[2].u.f;
    if (c->needs_grad[0])
        c->grad_inputs[0] = g;
    if (c->needs_grad[1])
        c->grad_inputs[1] = alpha == 1.0 ? g : ag_mul_scalar(g, alpha);
    return 0;
}

static void add_samples(ag_samples *s) {
    int64_t a[] = {3, 4}, b[] = {4}, c[] = {3, 1};
    ag_samples_add(s, "same shape", (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, a, -1, 1)),
                                               AG_A_T(ag_samples_rand(s, 2, a, -1, 1))}, 2);
    ag_samples_add(s, "broadcast", (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, a, -1, 1)),
                                              AG_A_T(ag_samples_rand(s, 1, b, -1, 1)),
                                              AG_A_F(2.5)}, 3);
    ag_samples_add(s, "strided+broadcast", (ag_arg[]){AG_A_T(ag_samples_rand_strided(s, 2, a, -1, 1)),
                                                      AG_A_T(ag_samples_rand(s, 2, c, -1, 1))}, 2);
}

static const ag_opdef op_add = {
    .schema = "add.Tensor(Tensor self, Tensor other, *, Scalar alpha=1) -> Tensor",
    .flags = AG_OP_POINTWISE,
    .meta = add_meta,
    .kernel = add_kernel,
    .dtypes = AG_DT_ALL,
    .backward = add_backward,
    .samples = add_samples,
};

ag_tensor *ag_add(ag_tensor *a, ag_tensor *b) {
    AG__OP(op, "add.Tensor");
    return ag__call1(op, (ag_arg[]){AG_A_T(a), AG_A_T(b)}, 2);
}

ag_tensor *ag_add_alpha(ag_tensor *a, ag_tensor *b, double alpha) {
    AG__OP(op, "add.Tensor");
    return ag__call1(op, (ag_arg[]){AG_A_T(a), AG_A_T(b), AG_A_F(alpha)}, 3);
}

const ag_opdef *const ag__ops_pointwise[] = {
    &op_add,
    NULL,
};
