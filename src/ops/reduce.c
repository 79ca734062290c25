/* Reductions and softmax: sum.dim_IntList, mean.dim, amax, var.correction, logsumexp, argmax,
 * _softmax, _log_softmax and their ATen backward helpers _softmax_backward_data and
 * _log_softmax_backward_data.
 *
 * Each op is one ag_opdef: schema, flags, meta (reduced shape and result dtype), a kernel that
 * resolves dims and dtypes and calls the loops in reduce_kernels.c, a backward rule written with
 * ops as in ATen's derivatives.yaml, and gradcheck samples. */
#include "family.h"
#include "shard_rules.h"
#include "reduce_kernels.h"

/* ---- argument helpers shared by the meta functions, kernels and backward rules ---- */

/* The dims of an `int[1]?` argument; None and [] both mean every dim. */
static void dims_of(const ag_arg *a, const int64_t **dims, int *n) {
    if (a->kind == AG_ARG_INTS) {
        *dims = a->u.ints;
        *n = a->n;
    } else {
        *dims = NULL;
        *n = 0;
    }
}

static int reduce_mask(const char *op, const ag_tensor *x, const ag_arg *dimarg, bool *reduce) {
    const int64_t *dims;
    int n;
    dims_of(dimarg, &dims, &n);
    return ag__reduce_dims(op, x->ndim, dims, n, reduce);
}

/* Number of elements each output reduces over. */
static int64_t reduced_count(const ag_tensor *x, const bool *reduce) {
    int64_t n = 1;
    for (int d = 0; d < x->ndim; d++)
        if (reduce[d])
            n *= x->sizes[d];
    return n;
}

/* Meta of a reduction of self (args[0]) over the dims in *dimarg. */
static int red_meta(const char *op, const ag_arg *a, const ag_arg *dimarg, bool keepdim,
                    ag_dtype dt, ag_tmeta *out, bool *reduce) {
    const ag_tensor *x = a[0].u.t;
    int rc = reduce_mask(op, x, dimarg, reduce);
    if (rc)
        return rc;
    ag_tmeta in;
    ag__tmeta_of(x, &in);
    ag__reduce_meta(&in, reduce, keepdim, dt, out);
    return 0;
}

/* Sum or mean of x, or of a copy of x converted to dt when the dtypes differ (as ATen does).
 * The copy lives in scratch slot 2 (the reduction itself uses 0 and 1). */
static int with_dtype(const ag_tensor *x, ag_dtype dt, const bool *reduce, ag_tensor *out,
                      bool mean) {
    if (x->dtype == dt)
        return ag__reduce_sum(x, reduce, out, mean);
    ag__scratch_tensor tmp;
    ag_tensor *cx = ag__scratch_tensor_new(&tmp, 2, dt, x->ndim, x->sizes);
    if (!cx)
        return ag_last_status();
    int rc = ag__copy_into(cx, x);
    if (rc == 0)
        rc = ag__reduce_sum(cx, reduce, out, mean);
    return rc;
}

/* ---- backward helpers ---- */

static int status_of(const ag_tensor *t) {
    if (t)
        return 0;
    return ag_last_status() ? ag_last_status() : AG_EINVAL;
}

/* g with the dims that a reduction over *dimarg of an ndim-d input removed put back as size 1
 * (ATen's unsqueeze_multiple / restore_reduced_dims). */
static ag_tensor *restore_dims(ag_tensor *g, int ndim, const ag_arg *dimarg, bool keepdim) {
    if (keepdim || ndim == 0 || !g)
        return g;
    bool reduce[AG_MAX_DIMS];
    const int64_t *dims;
    int n;
    dims_of(dimarg, &dims, &n);
    if (ag__reduce_dims("restore_reduced_dims", ndim, dims, n, reduce))
        return NULL;
    for (int d = 0; d < ndim; d++)
        if (reduce[d])
            g = ag_unsqueeze(g, d);
    return g;
}

/* ---- costs ---- */

static double tensor_bytes(const ag_tensor *t) {
    return (double)ag__numel(t->ndim, t->sizes) * (double)ag_dtype_size(t->dtype);
}

static void cost_k(const ag_arg *a, const ag_tmeta *o, double flops_per_elem, ag_cost *c) {
    const ag_tensor *x = a[0].u.t;
    c->flops = flops_per_elem * (double)ag__numel(x->ndim, x->sizes);
    c->bytes = tensor_bytes(x) +
               (double)ag__numel(o[0].ndim, o[0].sizes) * (double)ag_dtype_size(o[0].dtype);
}

static void cost_1(const ag_arg *a, const ag_tmeta *o, int n, ag_cost *c) {
    cost_k(a, o, 1, c);
}
static void cost_3(const ag_arg *a, const ag_tmeta *o, int n, ag_cost *c) {
    cost_k(a, o, 3, c);
}
static void cost_5(const ag_arg *a, const ag_tmeta *o, int n, ag_cost *c) {
    cost_k(a, o, 5, c);
}

static void cost_bwdata(const ag_arg *a, const ag_tmeta *o, int n, ag_cost *c) {
    cost_k(a, o, 4, c);
    c->bytes += tensor_bytes(a[1].u.t);
}

/* ---- sum.dim_IntList ---- */

static int sum_meta(const ag_arg *a, ag_tmeta *o) {
    const ag_tensor *x = a[0].u.t;
    ag_dtype dt = a[3].kind == AG_ARG_DTYPE     ? a[3].u.dt
                  : ag_dtype_is_float(x->dtype) ? x->dtype
                                                : AG_I64;
    if (dt == AG_BOOL)
        return ag__err(AG_ENOTSUP, "sum: dtype b8 is not supported for the result");
    bool reduce[AG_MAX_DIMS];
    return red_meta("sum", a, &a[1], a[2].u.b, dt, o, reduce);
}

static int sum_kernel(const ag_arg *a, ag_tensor **o) {
    const ag_tensor *x = a[0].u.t;
    bool reduce[AG_MAX_DIMS];
    int rc = reduce_mask("sum", x, &a[1], reduce);
    if (rc)
        return rc;
    /* Integral inputs summing to i64 are read as they are; other dtype changes convert first
     * (as ATen does). */
    if (o[0]->dtype == AG_I64 && !ag_dtype_is_float(x->dtype))
        return ag__reduce_sum(x, reduce, o[0], false);
    return with_dtype(x, o[0]->dtype, reduce, o[0], false);
}

/* sum: grad expanded back to self's shape. */
static int sum_backward(ag_bwctx *c) {
    const ag_tmeta *x = &c->input_meta[0];
    ag_tensor *g = restore_dims(c->grad_outputs[0], x->ndim, &c->args[1], c->args[2].u.b);
    c->grad_inputs[0] = ag_expand(g, x->ndim, x->sizes);
    return status_of(c->grad_inputs[0]);
}

static void sum_samples(ag_samples *s) {
    int64_t a[] = {3, 4}, b[] = {2, 3, 4};
    ag_samples_add(
        s, "dim 1",
        (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, a, -1, 1)), AG_A_INTS(((int64_t[]){1}), 1)}, 2);
    ag_samples_add(s, "dims 0,-1 keepdim",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 3, b, -1, 1)),
                              AG_A_INTS(((int64_t[]){0, -1}), 2), AG_A_B(true)},
                   3);
    ag_samples_add(s, "strided, all dims",
                   (ag_arg[]){AG_A_T(ag_samples_rand_strided(s, 2, a, -1, 1)), AG_A_NONE}, 2);
    ag_samples_add(
        s, "strided dim 0",
        (ag_arg[]){AG_A_T(ag_samples_rand_strided(s, 2, a, -1, 1)), AG_A_INTS(((int64_t[]){0}), 1)},
        2);
}

static const ag_opdef op_sum = {
    .schema = "sum.dim_IntList(Tensor self, int[1]? dim, bool keepdim=False, *, "
              "ScalarType? dtype=None) -> Tensor",
    .flags = AG_OP_REDUCTION,
    .meta = sum_meta,
    .kernel = sum_kernel,
    .dtypes = AG_DT_ALL,
    .backward = sum_backward,
    .cost = cost_1,
    .samples = sum_samples,
    .shard = ag__shard_sum,
};

ag_tensor *ag_sum(ag_tensor *a, const int64_t *dims, int ndims, bool keepdim) {
    AG__OP(op, "sum.dim_IntList");
    ag_arg dim = ndims > 0 ? AG_A_INTS(dims, ndims) : AG_A_NONE;
    return ag__call1(op, (ag_arg[]){AG_A_T(a), dim, AG_A_B(keepdim)}, 3);
}

ag_tensor *ag_sum_all(ag_tensor *a) {
    return ag_sum(a, NULL, 0, false);
}

/* ---- mean.dim ---- */

static int mean_meta(const ag_arg *a, ag_tmeta *o) {
    const ag_tensor *x = a[0].u.t;
    ag_dtype dt = a[3].kind == AG_ARG_DTYPE ? a[3].u.dt : x->dtype;
    if (!ag_dtype_is_float(dt))
        return ag__err(AG_EINVAL,
                       "mean: could not infer output dtype. Input dtype must be either a floating "
                       "point or complex dtype. Got: %s",
                       ag_dtype_short(dt));
    bool reduce[AG_MAX_DIMS];
    return red_meta("mean", a, &a[1], a[2].u.b, dt, o, reduce);
}

static int mean_kernel(const ag_arg *a, ag_tensor **o) {
    const ag_tensor *x = a[0].u.t;
    bool reduce[AG_MAX_DIMS];
    int rc = reduce_mask("mean", x, &a[1], reduce);
    if (rc)
        return rc;
    return with_dtype(x, o[0]->dtype, reduce, o[0], true);
}

/* mean: sum's backward divided by the count. */
static int mean_backward(ag_bwctx *c) {
    const ag_tmeta *x = &c->input_meta[0];
    const int64_t *dims;
    int n;
    dims_of(&c->args[1], &dims, &n);
    bool reduce[AG_MAX_DIMS];
    int rc = ag__reduce_dims("mean", x->ndim, dims, n, reduce);
    if (rc)
        return rc;
    int64_t count = 1;
    for (int d = 0; d < x->ndim; d++)
        if (reduce[d])
            count *= x->sizes[d];
    ag_tensor *g = restore_dims(c->grad_outputs[0], x->ndim, &c->args[1], c->args[2].u.b);
    g = ag_expand(g, x->ndim, x->sizes);
    c->grad_inputs[0] = ag_div_scalar(g, (double)count);
    return status_of(c->grad_inputs[0]);
}

static void mean_samples(ag_samples *s) {
    int64_t a[] = {3, 4}, b[] = {2, 3, 4};
    ag_samples_add(
        s, "dim -1",
        (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, a, -1, 1)), AG_A_INTS(((int64_t[]){-1}), 1)}, 2);
    ag_samples_add(s, "dims 0,2 keepdim",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 3, b, -1, 1)),
                              AG_A_INTS(((int64_t[]){0, 2}), 2), AG_A_B(true)},
                   3);
    ag_samples_add(s, "strided, all dims",
                   (ag_arg[]){AG_A_T(ag_samples_rand_strided(s, 2, a, -1, 1)), AG_A_NONE}, 2);
}

static const ag_opdef op_mean = {
    .schema = "mean.dim(Tensor self, int[1]? dim, bool keepdim=False, *, ScalarType? dtype=None) "
              "-> Tensor",
    .flags = AG_OP_REDUCTION,
    .meta = mean_meta,
    .kernel = mean_kernel,
    .dtypes = AG_DT_ALL,
    .backward = mean_backward,
    .cost = cost_1,
    .samples = mean_samples,
    .shard = ag__shard_sum,
};

ag_tensor *ag_mean(ag_tensor *a, const int64_t *dims, int ndims, bool keepdim) {
    AG__OP(op, "mean.dim");
    ag_arg dim = ndims > 0 ? AG_A_INTS(dims, ndims) : AG_A_NONE;
    return ag__call1(op, (ag_arg[]){AG_A_T(a), dim, AG_A_B(keepdim)}, 3);
}

ag_tensor *ag_mean_all(ag_tensor *a) {
    return ag_mean(a, NULL, 0, false);
}

/* ---- amax ---- */

/* Max-like reductions have no identity: every reduced dim must be non-empty. */
static int check_nonempty(const char *op, const ag_tensor *x, const bool *reduce) {
    for (int d = 0; d < x->ndim; d++)
        if (reduce[d] && x->sizes[d] == 0)
            return ag__err(AG_EINVAL, "%s(): Expected reduction dim %d to have non-zero size.", op,
                           d);
    return 0;
}

static int amax_meta(const ag_arg *a, ag_tmeta *o) {
    bool reduce[AG_MAX_DIMS];
    int rc = red_meta("amax", a, &a[1], a[2].u.b, a[0].u.t->dtype, o, reduce);
    return rc ? rc : check_nonempty("amax", a[0].u.t, reduce);
}

static int amax_kernel(const ag_arg *a, ag_tensor **o) {
    bool reduce[AG_MAX_DIMS];
    int rc = reduce_mask("amax", a[0].u.t, &a[1], reduce);
    return rc ? rc : ag__reduce_amax(a[0].u.t, reduce, o[0]);
}

/* amax: the gradient is shared evenly by the elements equal to the max (ATen's
 * scale_grad_by_count(restore_reduced_dims(grad), restore_reduced_dims(result) == self)). */
static int amax_backward(ag_bwctx *c) {
    ag_tensor *x = c->args[0].u.t, *res = c->outputs[0];
    bool keepdim = c->args[2].u.b;
    ag_tensor *g = restore_dims(c->grad_outputs[0], x->ndim, &c->args[1], keepdim);
    ag_tensor *r = restore_dims(res, x->ndim, &c->args[1], keepdim);
    ag_tensor *mask = ag_eq(r, x);
    const int64_t *dims;
    int n;
    dims_of(&c->args[1], &dims, &n);
    ag_tensor *count = ag_sum(mask, dims, n, true);
    c->grad_inputs[0] = ag_mul(ag_div(g, count), mask);
    return status_of(c->grad_inputs[0]);
}

static void amax_samples(ag_samples *s) {
    int64_t a[] = {3, 4}, b[] = {2, 3, 4};
    ag_samples_add(
        s, "dim 1",
        (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, a, -1, 1)), AG_A_INTS(((int64_t[]){1}), 1)}, 2);
    ag_samples_add(s, "dims 0,2 keepdim",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 3, b, -1, 1)),
                              AG_A_INTS(((int64_t[]){0, 2}), 2), AG_A_B(true)},
                   3);
    ag_samples_add(s, "strided, all dims",
                   (ag_arg[]){AG_A_T(ag_samples_rand_strided(s, 2, a, -1, 1))}, 1);
}

static const ag_opdef op_amax = {
    .schema = "amax(Tensor self, int[1] dim=[], bool keepdim=False) -> Tensor",
    .flags = AG_OP_REDUCTION,
    .meta = amax_meta,
    .kernel = amax_kernel,
    .dtypes = AG_DT_ALL,
    .backward = amax_backward,
    .save_args = 1,
    .save_outputs = 1,
    .cost = cost_1,
    .samples = amax_samples,
};

ag_tensor *ag_amax(ag_tensor *a, const int64_t *dims, int ndims, bool keepdim) {
    AG__OP(op, "amax");
    return ag__call1(
        op, (ag_arg[]){AG_A_T(a), AG_A_INTS(dims, ndims > 0 ? ndims : 0), AG_A_B(keepdim)}, 3);
}

/* ---- var.correction ---- */

static double correction_of(const ag_arg *a) {
    return a->kind == AG_ARG_FLOAT ? a->u.f : 1.0;
}

static int var_meta(const ag_arg *a, ag_tmeta *o) {
    bool reduce[AG_MAX_DIMS];
    return red_meta("var", a, &a[1], a[3].u.b, a[0].u.t->dtype, o, reduce);
}

static int var_kernel(const ag_arg *a, ag_tensor **o) {
    bool reduce[AG_MAX_DIMS];
    int rc = reduce_mask("var", a[0].u.t, &a[1], reduce);
    return rc ? rc : ag__reduce_var(a[0].u.t, reduce, correction_of(&a[2]), o[0]);
}

/* var: grad * 2 (x - mean) / (N - correction) (ATen's var_backward). */
static int var_backward(ag_bwctx *c) {
    ag_tensor *x = c->args[0].u.t;
    bool reduce[AG_MAX_DIMS];
    int rc = reduce_mask("var", x, &c->args[1], reduce);
    if (rc)
        return rc;
    const int64_t *dims;
    int n;
    dims_of(&c->args[1], &dims, &n);
    double dof = (double)reduced_count(x, reduce) - correction_of(&c->args[2]);
    ag_tensor *g = c->grad_outputs[0], *mean;
    if (x->ndim == 0 || n == 0) {
        mean = ag_mean_all(x);
    } else {
        if (x->ndim > 1)
            g = restore_dims(g, x->ndim, &c->args[1], c->args[3].u.b);
        mean = ag_mean(x, dims, n, true);
    }
    ag_tensor *scaled = ag_mul_scalar(g, 2.0 / dof); /* traced before x - mean */
    c->grad_inputs[0] = ag_mul(scaled, ag_sub(x, mean));
    return status_of(c->grad_inputs[0]);
}

static void var_samples(ag_samples *s) {
    int64_t a[] = {3, 4}, b[] = {2, 3, 4};
    ag_samples_add(
        s, "dim 1",
        (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, a, -1, 1)), AG_A_INTS(((int64_t[]){1}), 1)}, 2);
    ag_samples_add(s, "dims 0,2 correction 0 keepdim",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 3, b, -1, 1)),
                              AG_A_INTS(((int64_t[]){0, 2}), 2), AG_A_F(0), AG_A_B(true)},
                   4);
    ag_samples_add(s, "strided, all dims",
                   (ag_arg[]){AG_A_T(ag_samples_rand_strided(s, 2, a, -1, 1))}, 1);
}

static const ag_opdef op_var = {
    .schema = "var.correction(Tensor self, int[1]? dim=None, *, Scalar? correction=None, "
              "bool keepdim=False) -> Tensor",
    .flags = AG_OP_REDUCTION,
    .meta = var_meta,
    .kernel = var_kernel,
    .dtypes = AG_DT_FLOAT,
    .backward = var_backward,
    .save_args = 1,
    .cost = cost_3,
    .samples = var_samples,
};

ag_tensor *ag_var(ag_tensor *a, const int64_t *dims, int ndims, double correction, bool keepdim) {
    AG__OP(op, "var.correction");
    ag_arg dim = ndims > 0 ? AG_A_INTS(dims, ndims) : AG_A_NONE;
    return ag__call1(op, (ag_arg[]){AG_A_T(a), dim, AG_A_F(correction), AG_A_B(keepdim)}, 4);
}

/* ---- logsumexp ---- */

static int logsumexp_meta(const ag_arg *a, ag_tmeta *o) {
    bool reduce[AG_MAX_DIMS];
    return red_meta("logsumexp", a, &a[1], a[2].u.b, a[0].u.t->dtype, o, reduce);
}

static int logsumexp_kernel(const ag_arg *a, ag_tensor **o) {
    bool reduce[AG_MAX_DIMS];
    int rc = reduce_mask("logsumexp", a[0].u.t, &a[1], reduce);
    return rc ? rc : ag__reduce_logsumexp(a[0].u.t, reduce, o[0]);
}

/* logsumexp: grad * exp(self - result), both restored to self's rank. */
static int logsumexp_backward(ag_bwctx *c) {
    ag_tensor *x = c->args[0].u.t;
    bool keepdim = c->args[2].u.b;
    ag_tensor *g = restore_dims(c->grad_outputs[0], x->ndim, &c->args[1], keepdim);
    ag_tensor *r = restore_dims(c->outputs[0], x->ndim, &c->args[1], keepdim);
    c->grad_inputs[0] = ag_mul(g, ag_exp(ag_sub(x, r)));
    return status_of(c->grad_inputs[0]);
}

static void logsumexp_samples(ag_samples *s) {
    int64_t a[] = {3, 4}, b[] = {2, 3, 4};
    ag_samples_add(
        s, "dim 1",
        (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, a, -2, 2)), AG_A_INTS(((int64_t[]){1}), 1)}, 2);
    ag_samples_add(s, "dims 0,2 keepdim",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 3, b, -2, 2)),
                              AG_A_INTS(((int64_t[]){0, 2}), 2), AG_A_B(true)},
                   3);
    ag_samples_add(
        s, "strided dim 0",
        (ag_arg[]){AG_A_T(ag_samples_rand_strided(s, 2, a, -2, 2)), AG_A_INTS(((int64_t[]){0}), 1)},
        2);
}

static const ag_opdef op_logsumexp = {
    .schema = "logsumexp(Tensor self, int[1] dim, bool keepdim=False) -> Tensor",
    .flags = AG_OP_REDUCTION,
    .meta = logsumexp_meta,
    .kernel = logsumexp_kernel,
    .dtypes = AG_DT_FLOAT,
    .backward = logsumexp_backward,
    .save_args = 1,
    .save_outputs = 1,
    .cost = cost_5,
    .samples = logsumexp_samples,
};

ag_tensor *ag_logsumexp(ag_tensor *a, const int64_t *dims, int ndims, bool keepdim) {
    AG__OP(op, "logsumexp");
    return ag__call1(
        op, (ag_arg[]){AG_A_T(a), AG_A_INTS(dims, ndims > 0 ? ndims : 0), AG_A_B(keepdim)}, 3);
}

/* ---- argmax ---- */

static int argmax_meta(const ag_arg *a, ag_tmeta *o) {
    const ag_tensor *x = a[0].u.t;
    bool keepdim = a[2].u.b;
    if (a[1].kind == AG_ARG_NONE) {
        if (ag__numel(x->ndim, x->sizes) == 0)
            return ag__err(AG_EINVAL, "argmax(): Expected reduction dim to be specified for "
                                      "input.numel() == 0.");
        int64_t ones[AG_MAX_DIMS];
        for (int d = 0; d < x->ndim; d++)
            ones[d] = 1;
        ag__tmeta_contiguous(o, AG_I64, keepdim ? x->ndim : 0, ones);
        return 0;
    }
    int d = ag__wrap_dim("argmax", a[1].u.i, x->ndim);
    if (d < 0)
        return AG_EINVAL;
    if (x->ndim > 0 && x->sizes[d] == 0)
        return ag__err(AG_EINVAL, "argmax(): Expected reduction dim %d to have non-zero size.", d);
    bool reduce[AG_MAX_DIMS] = {0};
    if (x->ndim > 0)
        reduce[d] = true;
    ag_tmeta in;
    ag__tmeta_of(x, &in);
    ag__reduce_meta(&in, reduce, keepdim, AG_I64, o);
    return 0;
}

static int argmax_kernel(const ag_arg *a, ag_tensor **o) {
    ag_tensor *x = a[0].u.t;
    if (a[1].kind == AG_ARG_NONE)
        return ag__argmax(x, -1, o[0]);
    return ag__argmax(x, x->ndim ? ag__wrap_dim("argmax", a[1].u.i, x->ndim) : 0, o[0]);
}

static const ag_opdef op_argmax = {
    .schema = "argmax(Tensor self, int? dim=None, bool keepdim=False) -> Tensor",
    .flags = AG_OP_REDUCTION | AG_OP_NONDIFF,
    .meta = argmax_meta,
    .kernel = argmax_kernel,
    .dtypes = (1u << AG_F32) | (1u << AG_F64) | (1u << AG_I64),
    .cost = cost_1,
};

ag_tensor *ag_argmax(ag_tensor *a, int dim, bool keepdim) {
    AG__OP(op, "argmax");
    return ag__call1(op, (ag_arg[]){AG_A_T(a), AG_A_I(dim), AG_A_B(keepdim)}, 3);
}

ag_tensor *ag_argmax_all(ag_tensor *a) {
    AG__OP(op, "argmax");
    return ag__call1(op, (ag_arg[]){AG_A_T(a), AG_A_NONE, AG_A_B(false)}, 3);
}

/* ---- _softmax, _log_softmax ---- */

static int softmax_meta_common(const char *op, const ag_arg *a, ag_tmeta *o) {
    const ag_tensor *x = a[0].u.t;
    if (ag__wrap_dim(op, a[1].u.i, x->ndim) < 0)
        return AG_EINVAL;
    if (a[2].u.b)
        return ag__err(AG_ENOTSUP, "%s: half_to_float is only supported for half inputs (got %s)",
                       op, ag_dtype_short(x->dtype));
    ag__tmeta_contiguous(o, x->dtype, x->ndim, x->sizes);
    return 0;
}

static int softmax_meta(const ag_arg *a, ag_tmeta *o) {
    return softmax_meta_common("_softmax", a, o);
}
static int log_softmax_meta(const ag_arg *a, ag_tmeta *o) {
    return softmax_meta_common("_log_softmax", a, o);
}

static int softmax_run(const ag_arg *a, ag_tensor **o, bool logp) {
    ag_tensor *x = a[0].u.t;
    int d = x->ndim ? ag__wrap_dim("_softmax", a[1].u.i, x->ndim) : 0;
    return ag__softmax(x, d, logp, o[0]);
}

static int softmax_kernel(const ag_arg *a, ag_tensor **o) {
    return softmax_run(a, o, false);
}
static int log_softmax_kernel(const ag_arg *a, ag_tensor **o) {
    return softmax_run(a, o, true);
}

/* _softmax: _softmax_backward_data(grad, result, dim, self.dtype). */
static int softmax_backward(ag_bwctx *c) {
    ag_tensor *y = c->outputs[0];
    c->grad_inputs[0] =
        ag_softmax_backward_data(c->grad_outputs[0], y, (int)c->args[1].u.i, y->dtype);
    return status_of(c->grad_inputs[0]);
}

static int log_softmax_backward(ag_bwctx *c) {
    ag_tensor *y = c->outputs[0];
    c->grad_inputs[0] =
        ag_log_softmax_backward_data(c->grad_outputs[0], y, (int)c->args[1].u.i, y->dtype);
    return status_of(c->grad_inputs[0]);
}

static void softmax_samples(ag_samples *s) {
    int64_t a[] = {3, 5}, b[] = {2, 3, 4};
    ag_samples_add(s, "dim 1",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, a, -2, 2)), AG_A_I(1), AG_A_B(false)},
                   3);
    ag_samples_add(s, "3-d dim 1",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 3, b, -2, 2)), AG_A_I(1), AG_A_B(false)},
                   3);
    ag_samples_add(
        s, "strided dim -1",
        (ag_arg[]){AG_A_T(ag_samples_rand_strided(s, 2, a, -2, 2)), AG_A_I(-1), AG_A_B(false)}, 3);
}

/* Core decompositions (torch._decomp): max-shifted exp / sum, and its log form. */
static int softmax_decomp(const ag_arg *a, ag_tensor **o) {
    int64_t dim = a[1].u.i;
    ag_tensor *x = a[0].u.t;
    ag_tensor *e = ag_exp(ag_sub(x, ag_amax(x, &dim, 1, true)));
    o[0] = ag_div(e, ag_sum(e, &dim, 1, true));
    return o[0] ? 0 : ag_last_status();
}

static int log_softmax_decomp(const ag_arg *a, ag_tensor **o) {
    int64_t dim = a[1].u.i;
    ag_tensor *x = a[0].u.t;
    ag_tensor *shifted = ag_sub(x, ag_amax(x, &dim, 1, true));
    o[0] = ag_sub(shifted, ag_log(ag_sum(ag_exp(shifted), &dim, 1, true)));
    return o[0] ? 0 : ag_last_status();
}

static const ag_opdef op_softmax = {
    .decomp = softmax_decomp,
    .schema = "_softmax(Tensor self, int dim, bool half_to_float) -> Tensor",
    .flags = 0,
    .meta = softmax_meta,
    .kernel = softmax_kernel,
    .dtypes = AG_DT_FLOAT,
    .backward = softmax_backward,
    .save_outputs = 1,
    .cost = cost_5,
    .samples = softmax_samples,
    .shard = ag__shard_softmax,
};

static const ag_opdef op_log_softmax = {
    .decomp = log_softmax_decomp,
    .schema = "_log_softmax(Tensor self, int dim, bool half_to_float) -> Tensor",
    .flags = 0,
    .meta = log_softmax_meta,
    .kernel = log_softmax_kernel,
    .dtypes = AG_DT_FLOAT,
    .backward = log_softmax_backward,
    .save_outputs = 1,
    .cost = cost_5,
    .samples = softmax_samples,
    .shard = ag__shard_softmax,
};

ag_tensor *ag_softmax(ag_tensor *a, int dim) {
    AG__OP(op, "_softmax");
    return ag__call1(op, (ag_arg[]){AG_A_T(a), AG_A_I(dim), AG_A_B(false)}, 3);
}

ag_tensor *ag_log_softmax(ag_tensor *a, int dim) {
    AG__OP(op, "_log_softmax");
    return ag__call1(op, (ag_arg[]){AG_A_T(a), AG_A_I(dim), AG_A_B(false)}, 3);
}

/* ---- _softmax_backward_data, _log_softmax_backward_data ---- */

static int bwdata_meta(const char *op, const ag_arg *a, ag_tmeta *o) {
    const ag_tensor *g = a[0].u.t, *y = a[1].u.t;
    char b1[128], b2[128];
    if (g->ndim != y->ndim || memcmp(g->sizes, y->sizes, sizeof(int64_t) * (size_t)g->ndim) != 0)
        return ag__err(AG_EINVAL, "%s: grad_output %s and output %s must have the same shape", op,
                       ag__fmt_sizes(b1, sizeof b1, g->ndim, g->sizes),
                       ag__fmt_sizes(b2, sizeof b2, y->ndim, y->sizes));
    if (g->dtype != y->dtype || !ag_dtype_is_float(g->dtype))
        return ag__err(AG_EINVAL,
                       "%s: grad_output (%s) and output (%s) must have the same float dtype", op,
                       ag_dtype_short(g->dtype), ag_dtype_short(y->dtype));
    if (a[3].u.dt != g->dtype)
        return ag__err(AG_ENOTSUP, "%s: input_dtype %s differs from grad_output's %s", op,
                       ag_dtype_short(a[3].u.dt), ag_dtype_short(g->dtype));
    if (ag__wrap_dim(op, a[2].u.i, g->ndim) < 0)
        return AG_EINVAL;
    ag__tmeta_contiguous(o, g->dtype, g->ndim, g->sizes);
    return 0;
}

static int softmax_bwd_meta(const ag_arg *a, ag_tmeta *o) {
    return bwdata_meta("_softmax_backward_data", a, o);
}
static int log_softmax_bwd_meta(const ag_arg *a, ag_tmeta *o) {
    return bwdata_meta("_log_softmax_backward_data", a, o);
}

static int bwdata_run(const ag_arg *a, ag_tensor **o, bool logp) {
    ag_tensor *g = a[0].u.t;
    int d = g->ndim ? ag__wrap_dim("_softmax_backward_data", a[2].u.i, g->ndim) : 0;
    return ag__softmax_backward(g, a[1].u.t, d, logp, o[0]);
}

static int softmax_bwd_kernel(const ag_arg *a, ag_tensor **o) {
    return bwdata_run(a, o, false);
}
static int log_softmax_bwd_kernel(const ag_arg *a, ag_tensor **o) {
    return bwdata_run(a, o, true);
}

/* d/d(grad_output) is the same op applied to the incoming grad G; d/d(output) is ATen's
 * softmax_double_backward: g G - sum(y g) G - g sum(y G). */
static int softmax_bwd_backward(ag_bwctx *c) {
    ag_tensor *G = c->grad_outputs[0], *g = c->args[0].u.t, *y = c->args[1].u.t;
    int64_t dim = c->args[2].u.i;
    if (c->needs_grad[0]) {
        c->grad_inputs[0] = ag_softmax_backward_data(G, y, (int)dim, c->args[3].u.dt);
        if (!c->grad_inputs[0])
            return status_of(NULL);
    }
    if (c->needs_grad[1]) {
        ag_tensor *syg = ag_sum(ag_mul(y, g), &dim, 1, true);
        ag_tensor *syG = ag_sum(ag_mul(y, G), &dim, 1, true);
        /* one traced call per statement: C leaves the order of a call's arguments unspecified */
        ag_tensor *gG = ag_mul(g, G);
        ag_tensor *d = ag_sub(gG, ag_mul(syg, G));
        c->grad_inputs[1] = ag_sub(d, ag_mul(g, syG));
        return status_of(c->grad_inputs[1]);
    }
    return 0;
}

/* d/d(grad_output) = G - sum(G exp(y)); d/d(output) = -sum(g) exp(y) G. */
static int log_softmax_bwd_backward(ag_bwctx *c) {
    ag_tensor *G = c->grad_outputs[0], *g = c->args[0].u.t, *y = c->args[1].u.t;
    int64_t dim = c->args[2].u.i;
    ag_tensor *ey = ag_exp(y);
    if (c->needs_grad[0]) {
        c->grad_inputs[0] = ag_sub(G, ag_sum(ag_mul(G, ey), &dim, 1, true));
        if (!c->grad_inputs[0])
            return status_of(NULL);
    }
    if (c->needs_grad[1]) {
        c->grad_inputs[1] = ag_mul(ag_mul(ag_neg(ag_sum(g, &dim, 1, true)), ey), G);
        return status_of(c->grad_inputs[1]);
    }
    return 0;
}

static void bwdata_samples(ag_samples *s) {
    int64_t a[] = {3, 5}, b[] = {2, 3, 4};
    ag_samples_add(s, "dim 1",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, a, -1, 1)),
                              AG_A_T(ag_samples_rand(s, 2, a, 0.1, 0.9)), AG_A_I(1),
                              AG_A_DT(AG_F64)},
                   4);
    ag_samples_add(s, "3-d dim 1",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 3, b, -1, 1)),
                              AG_A_T(ag_samples_rand(s, 3, b, -1, 0)), AG_A_I(1), AG_A_DT(AG_F64)},
                   4);
    ag_samples_add(s, "strided grad, dim -1",
                   (ag_arg[]){AG_A_T(ag_samples_rand_strided(s, 2, a, -1, 1)),
                              AG_A_T(ag_samples_rand(s, 2, a, -1, 0)), AG_A_I(-1), AG_A_DT(AG_F64)},
                   4);
}

static const ag_opdef op_softmax_bwd = {
    .schema = "_softmax_backward_data(Tensor grad_output, Tensor output, int dim, "
              "ScalarType input_dtype) -> Tensor",
    .flags = AG_OP_BACKWARD_HELPER,
    .meta = softmax_bwd_meta,
    .kernel = softmax_bwd_kernel,
    .dtypes = AG_DT_FLOAT,
    .backward = softmax_bwd_backward,
    .save_args = 3,
    .cost = cost_bwdata,
    .samples = bwdata_samples,
    .shard = ag__shard_softmax_backward,
};

static const ag_opdef op_log_softmax_bwd = {
    .schema = "_log_softmax_backward_data(Tensor grad_output, Tensor output, int dim, "
              "ScalarType input_dtype) -> Tensor",
    .flags = AG_OP_BACKWARD_HELPER,
    .meta = log_softmax_bwd_meta,
    .kernel = log_softmax_bwd_kernel,
    .dtypes = AG_DT_FLOAT,
    .backward = log_softmax_bwd_backward,
    .save_args = 3,
    .cost = cost_bwdata,
    .samples = bwdata_samples,
    .shard = ag__shard_softmax_backward,
};

ag_tensor *ag_softmax_backward_data(ag_tensor *grad, ag_tensor *output, int dim,
                                    ag_dtype input_dtype) {
    AG__OP(op, "_softmax_backward_data");
    return ag__call1(
        op, (ag_arg[]){AG_A_T(grad), AG_A_T(output), AG_A_I(dim), AG_A_DT(input_dtype)}, 4);
}

ag_tensor *ag_log_softmax_backward_data(ag_tensor *grad, ag_tensor *output, int dim,
                                        ag_dtype input_dtype) {
    AG__OP(op, "_log_softmax_backward_data");
    return ag__call1(
        op, (ag_arg[]){AG_A_T(grad), AG_A_T(output), AG_A_I(dim), AG_A_DT(input_dtype)}, 4);
}

const ag_opdef *const ag__ops_reduce[] = {
    &op_sum,    &op_mean,    &op_amax,        &op_var,         &op_logsumexp,
    &op_argmax, &op_softmax, &op_log_softmax, &op_softmax_bwd, &op_log_softmax_bwd,
    NULL,
};
