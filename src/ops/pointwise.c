/* Pointwise ops: arithmetic (add, sub, mul, div, pow), unary math and activations, where,
 * masked_fill, clamp, comparisons, the in-place forms that optimizers and autograd use (add_,
 * mul_, copy_, zero_, fill_), and the ATen backward helpers of the activations
 * (threshold_backward, sigmoid_backward, tanh_backward, gelu_backward, silu_backward).
 *
 * Each op is one ag_opdef: schema, flags, meta (broadcasting and PyTorch's type promotion), a
 * kernel, a backward rule written with ops (ATen's derivatives.yaml), and gradcheck samples.
 * Kernels compute in one dtype: operands of another dtype are first converted into contiguous
 * temporaries. Then a loop driver of pw_loops.h runs `out[i] = EXPR` over the strided
 * iterator (vectorized inner loops, OpenMP across rows or chunks); float32 sqrt and the
 * transcendental activations use the vectorized math of fastmath.h, float64 uses libm. */
#include "../core/kernel_util.h"
#include "family.h"
#include "fastmath.h"
#include "pw_loops.h"

#include <stdio.h>
#include <tgmath.h>

/* float64 activations (f32 uses the vector versions of fastmath.h, same formulas). GELU is
 * written with erfc, which stays accurate in the negative tail: gelu(x) = x cdf(x) with
 * cdf(x) = erfc(-x / sqrt 2) / 2, and ATen's derivative gelu'(x) = cdf(x) + x pdf(x). For
 * the tanh approximation, with t = tanh(b (x + k x^3)):
 * gelu'(x) = 0.5 (1 + t) + 0.5 x (1 - t^2) b (1 + 3 k x^2). */
static const double gelu_b = 0.7978845608028654, gelu_k = 0.044715;
static inline double sigmoid_d(double x) {
    return 1 / (1 + exp(-x));
}
static inline double gelu_d(double x) {
    return 0.5 * x * erfc(-x * M_SQRT1_2);
}
static inline double gelu_tanh_d(double x) {
    return 0.5 * x * (1 + tanh(gelu_b * (x + gelu_k * x * x * x)));
}
static inline double dgelu_d(double x) {
    return 0.5 * erfc(-x * M_SQRT1_2) + x * 0.3989422804014327 * exp(-0.5 * x * x);
}
static inline double dgelu_tanh_d(double x) {
    const double t = tanh(gelu_b * (x + gelu_k * x * x * x));
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * gelu_b * (1 + 3 * gelu_k * x * x);
}
static inline double dsilu_d(double x) {
    const double s = sigmoid_d(x);
    return s * (1 + x * (1 - s));
}

/* i64 power by squaring; wraps on overflow like ATen's integer pow. */
static inline int64_t ipow(int64_t base, int64_t e) {
    uint64_t r = 1, b = (uint64_t)base;
    for (; e > 0; e >>= 1, b *= b)
        if (e & 1)
            r *= b;
    return (int64_t)r;
}

/* ---- dtype rules (PyTorch's) ---- */

static bool is_float(ag_dtype d) {
    return d == AG_F32 || d == AG_F64;
}

static const char *torch_dtype(ag_dtype d) {
    static const char *const names[] = {"Float", "Double", "Long", "Bool"};
    return (unsigned)d < AG_NDTYPES ? names[d] : "?";
}

/* result_type of two tensors: a 0-dim tensor next to one with dims can raise the category
 * (bool < integral < floating) but not the precision within a category, so f32[3] * f64[] is
 * f32 while i64[3] * f64[] is f64. */
static ag_dtype result_type(const ag_tensor *a, const ag_tensor *b) {
    if ((a->ndim == 0) == (b->ndim == 0))
        return ag__promote(a->dtype, b->dtype);
    ag_dtype dim = a->ndim ? a->dtype : b->dtype, zero = a->ndim ? b->dtype : a->dtype;
    if (is_float(dim))
        return dim;
    if (dim == AG_BOOL || is_float(zero))
        return ag__promote(dim, zero);
    return dim;
}

/* Ops that compute in floating point (div, exp, sigmoid, ...) make integral inputs f32. */
static ag_dtype floating(ag_dtype d) {
    return is_float(d) ? d : AG_F32;
}

/* PyTorch's can_cast for in-place results: no float -> integral, no non-bool -> bool. */
static bool can_cast(ag_dtype from, ag_dtype to) {
    if (is_float(from) && !is_float(to))
        return false;
    return from == AG_BOOL || to != AG_BOOL;
}

/* ---- shared meta and kernel helpers ---- */

/* out: the broadcast of a's and b's shapes (b may be NULL), dtype dt, contiguous. */
static int pw_meta(const char *op, const ag_tensor *a, const ag_tensor *b, ag_dtype dt,
                   ag_tmeta *o) {
    if (!b) {
        ag__tmeta_contiguous(o, dt, a->ndim, a->sizes);
        return 0;
    }
    int n;
    int64_t sizes[AG_MAX_DIMS];
    int rc = ag__broadcast(op, a->ndim, a->sizes, b->ndim, b->sizes, &n, sizes);
    if (rc)
        return rc;
    ag__tmeta_contiguous(o, dt, n, sizes);
    return 0;
}

/* In-place ops write the result (meta o) into self: it must have self's shape and a dtype that
 * casts to self's. On success o becomes self's own meta. */
static int inplace_meta(const char *op, const ag_tensor *self, ag_tmeta *o) {
    char a[128], b[128];
    if (o->ndim != self->ndim || memcmp(o->sizes, self->sizes, sizeof(int64_t) * (size_t)o->ndim))
        return ag__err(AG_EINVAL, "%s: output with shape %s doesn't match the broadcast shape %s",
                       op, ag__fmt_sizes(a, sizeof a, self->ndim, self->sizes),
                       ag__fmt_sizes(b, sizeof b, o->ndim, o->sizes));
    if (!can_cast(o->dtype, self->dtype))
        return ag__err(AG_EINVAL, "%s: result type %s can't be cast to the desired output type %s",
                       op, torch_dtype(o->dtype), torch_dtype(self->dtype));
    ag__tmeta_of(self, o);
    return 0;
}

/* Points *t at a contiguous copy converted to dt when its dtype differs; kernels then compute
 * in a single dtype. The copy is *tmp over per-thread scratch slot `slot` (0 for the first
 * operand, 1 for the second; nothing to free). */
static int to_dtype_tmp(ag_tensor **t, ag_dtype dt, ag__scratch_tensor *tmp, int slot) {
    if ((*t)->dtype == dt)
        return 0;
    ag_tensor *c = ag__scratch_tensor_new(tmp, slot, dt, (*t)->ndim, (*t)->sizes);
    if (!c)
        return AG_ENOMEM;
    int rc = ag__copy_into(c, *t);
    *t = c;
    return rc;
}

/* A backward rule's status: an op that failed inside the rule (out of memory) left a NULL
 * where a needed gradient should be; report its error instead of "no gradient". */
static int bw_status(const ag_bwctx *c) {
    for (int j = 0; j < c->ntensor_inputs; j++)
        if (c->needs_grad[j] && !c->grad_inputs[j])
            return ag_last_status() < 0 ? ag_last_status() : AG_EINVAL;
    return 0;
}

/* The `0` of ATen's where(cond, grad, 0): a 0-dim tensor of t's dtype. */
static ag_tensor *zero_of(const ag_tensor *t) {
    return t ? ag_scalar_tensor(t->dtype, 0.0) : NULL;
}

/* ---- gradcheck samples ---- */

static void unary_samples(ag_samples *s, double lo, double hi) {
    int64_t sz[] = {3, 4};
    ag_samples_add(s, "3x4", (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, sz, lo, hi))}, 1);
    ag_samples_add(s, "transposed 3x4",
                   (ag_arg[]){AG_A_T(ag_samples_rand_strided(s, 2, sz, lo, hi))}, 1);
}
static void samples_any(ag_samples *s) {
    unary_samples(s, -2, 2);
}
static void samples_pos(ag_samples *s) {
    unary_samples(s, 0.5, 2);
}
/* Both signs, away from a kink at 0 (abs, relu, sign). */
static void samples_kink(ag_samples *s) {
    unary_samples(s, 0.1, 1);
    unary_samples(s, -1, -0.1);
}

/* (3, 4) with (3, 4), (4) and a transposed (3, 4) with (3, 1); `lo` bounds `other` away from 0
 * for div. */
static void binary_samples(ag_samples *s, double lo) {
    int64_t a[] = {3, 4}, b[] = {4}, c[] = {3, 1};
    ag_samples_add(s, "same shape",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, a, -1, 1)),
                              AG_A_T(ag_samples_rand(s, 2, a, lo, 1))},
                   2);
    ag_samples_add(s, "broadcast",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, a, -1, 1)),
                              AG_A_T(ag_samples_rand(s, 1, b, lo, 1))},
                   2);
    ag_samples_add(s, "strided+broadcast",
                   (ag_arg[]){AG_A_T(ag_samples_rand_strided(s, 2, a, -1, 1)),
                              AG_A_T(ag_samples_rand(s, 2, c, lo, 1))},
                   2);
}
static void mul_samples(ag_samples *s) {
    binary_samples(s, -1);
}
static void div_samples(ag_samples *s) {
    binary_samples(s, 0.5);
}

static void scalar_samples(ag_samples *s) {
    int64_t a[] = {3, 4};
    ag_samples_add(s, "3x4", (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, a, -1, 1)), AG_A_F(1.5)}, 2);
    ag_samples_add(s, "transposed, negative",
                   (ag_arg[]){AG_A_T(ag_samples_rand_strided(s, 2, a, -1, 1)), AG_A_F(-0.75)}, 2);
}

/* A bool tensor of the given shape with a fixed true/false pattern. */
static ag_tensor *sample_mask(int ndim, const int64_t *sizes) {
    ag_tensor *m = ag__tensor_new(AG_BOOL, ndim, sizes, false);
    if (m)
        for (int64_t i = 0; i < ag__numel(ndim, sizes); i++)
            ((bool *)m->storage->data)[i] = (i * 7 + 3) % 5 < 2;
    return m;
}

/* ---- arithmetic: add, sub, mul, div (Tensor and Scalar forms, in-place forms) ---- */

typedef enum { AR_ADD, AR_SUB, AR_MUL, AR_DIV } arith_kind;

/* Meta of every arithmetic op: a[0] self, a[1] other (a tensor, or a Scalar when `scalar`),
 * a[2] alpha for add and sub. */
static int arith_meta(arith_kind k, bool scalar, bool inplace, const ag_arg *a, ag_tmeta *o) {
    static const char *const names[] = {"add", "sub", "mul", "div"};
    const ag_tensor *x = a[0].u.t, *y = scalar ? NULL : a[1].u.t;
    char op[8];
    snprintf(op, sizeof op, "%s%s", names[k], inplace ? "_" : "");
    ag_dtype dt = y ? result_type(x, y) : ag__promote_scalar(x->dtype, a[1].u.f);
    if (k == AR_DIV)
        dt = floating(dt); /* true division */
    int rc = pw_meta(op, x, y, dt, o);
    if (rc)
        return rc;
    if (k == AR_SUB && dt == AG_BOOL)
        return ag__err(AG_EINVAL,
                       "%s: subtraction, the `-` operator, with two bool tensors is "
                       "not supported; use logical_xor instead",
                       op);
    if ((k == AR_ADD || k == AR_SUB) && !is_float(dt) && a[2].u.f != floor(a[2].u.f))
        return ag__err(AG_EINVAL,
                       "%s: for integral input tensors, argument alpha must not be a "
                       "floating point number (alpha %g)",
                       op, a[2].u.f);
    /* int64 results: the scalars become int64 (checked: no undefined casts) and the kernel
     * wraps on overflow, as PyTorch's integer arithmetic does. */
    if (dt == AG_I64 && (k == AR_ADD || k == AR_SUB) && (rc = ag__check_fits(op, a[2].u.f, dt)))
        return rc;
    if (dt == AG_I64 && scalar && (rc = ag__check_fits(op, a[1].u.f, dt)))
        return rc;
    return inplace ? inplace_meta(op, x, o) : 0;
}

/* out = x (op) alpha * y, all of out's dtype. */
static int arith_tensor(arith_kind k, ag_tensor *out, ag_tensor *xt, ag_tensor *yt, double alpha) {
    if (out->dtype == AG_BOOL) { /* logical: add is or, mul is and (sub, div never give bool) */
        const bool al = alpha != 0;
        if (k == AR_ADD)
            PW2(out, xt, yt, bool, bool, bool, x || (al && y));
        else
            PW2(out, xt, yt, bool, bool, bool, x &&y);
        return 0;
    }
    if (out->dtype == AG_I64) { /* wrapping; alpha was checked to fit in the meta */
        const int64_t al = (int64_t)alpha;
        if (k == AR_ADD)
            PW2(out, xt, yt, int64_t, int64_t, int64_t, ag__wadd(x, ag__wmul(al, y)));
        else if (k == AR_SUB)
            PW2(out, xt, yt, int64_t, int64_t, int64_t, ag__wsub(x, ag__wmul(al, y)));
        else if (k == AR_MUL)
            PW2(out, xt, yt, int64_t, int64_t, int64_t, ag__wmul(x, y));
        else
            return ag__err(AG_ENOTSUP, "div: no integer kernel (true division is floating)");
        return 0;
    }
    AG__FLOAT_SWITCH(out->dtype, T, {
        const T al = (T)alpha;
        if (k == AR_ADD && alpha == 1)
            PW2(out, xt, yt, T, T, T, x + y);
        else if (k == AR_ADD)
            PW2(out, xt, yt, T, T, T, x + al * y);
        else if (k == AR_SUB && alpha == 1)
            PW2(out, xt, yt, T, T, T, x - y);
        else if (k == AR_SUB)
            PW2(out, xt, yt, T, T, T, x - al * y);
        else if (k == AR_MUL)
            PW2(out, xt, yt, T, T, T, x * y);
        else
            PW2(out, xt, yt, T, T, T, x / y);
    });
    return 0;
}

/* out = x (op) s * alpha (alpha 1 for mul and div). */
static int arith_scalar(arith_kind k, ag_tensor *out, ag_tensor *xt, double s, double alpha) {
    if (out->dtype == AG_BOOL) {
        const bool c = s != 0;
        if (k == AR_ADD)
            PW1(out, xt, bool, bool, x || c);
        else
            PW1(out, xt, bool, bool, x &&c);
        return 0;
    }
    if (out->dtype == AG_I64) { /* wrapping; s and alpha were checked to fit in the meta */
        const int64_t c = ag__wmul((int64_t)s, (int64_t)alpha);
        if (k == AR_ADD)
            PW1(out, xt, int64_t, int64_t, ag__wadd(x, c));
        else if (k == AR_SUB)
            PW1(out, xt, int64_t, int64_t, ag__wsub(x, c));
        else if (k == AR_MUL)
            PW1(out, xt, int64_t, int64_t, ag__wmul(x, c));
        else
            return ag__err(AG_ENOTSUP, "div: no integer kernel (true division is floating)");
        return 0;
    }
    s *= alpha;
    AG__FLOAT_SWITCH(out->dtype, T, {
        const T c = (T)s;
        if (k == AR_ADD)
            PW1(out, xt, T, T, x + c);
        else if (k == AR_SUB)
            PW1(out, xt, T, T, x - c);
        else if (k == AR_MUL)
            PW1(out, xt, T, T, x * c);
        else
            PW1(out, xt, T, T, x / c);
    });
    return 0;
}

static int arith_kernel(arith_kind k, bool scalar, const ag_arg *a, ag_tensor *out) {
    double alpha = (k == AR_ADD || k == AR_SUB) ? a[2].u.f : 1.0;
    ag_tensor *x = a[0].u.t, *y = scalar ? NULL : a[1].u.t;
    ag__scratch_tensor tx, ty;
    int rc = to_dtype_tmp(&x, out->dtype, &tx, 0);
    if (!rc && y)
        rc = to_dtype_tmp(&y, out->dtype, &ty, 1);
    if (!rc)
        rc = y ? arith_tensor(k, out, x, y, alpha) : arith_scalar(k, out, x, a[1].u.f, alpha);
    return rc;
}

#define ARITH_FNS(name, k, scalar, inplace)                                                        \
    static int name##_meta(const ag_arg *a, ag_tmeta *o) {                                         \
        return arith_meta(k, scalar, inplace, a, o);                                               \
    }                                                                                              \
    static int name##_kernel(const ag_arg *a, ag_tensor **o) {                                     \
        return arith_kernel(k, scalar, a, o[0]);                                                   \
    }
ARITH_FNS(add, AR_ADD, false, false)
ARITH_FNS(sub, AR_SUB, false, false)
ARITH_FNS(mul, AR_MUL, false, false)
ARITH_FNS(div, AR_DIV, false, false)
ARITH_FNS(add_scalar, AR_ADD, true, false)
ARITH_FNS(sub_scalar, AR_SUB, true, false)
ARITH_FNS(mul_scalar, AR_MUL, true, false)
ARITH_FNS(div_scalar, AR_DIV, true, false)
ARITH_FNS(add_inplace, AR_ADD, false, true)
ARITH_FNS(add_scalar_inplace, AR_ADD, true, true)
ARITH_FNS(mul_inplace, AR_MUL, false, true)
ARITH_FNS(mul_scalar_inplace, AR_MUL, true, true)

static int add_backward(ag_bwctx *c) {
    ag_tensor *g = c->grad_outputs[0];
    double alpha = c->args[2].u.f;
    if (c->needs_grad[0])
        c->grad_inputs[0] = g;
    if (c->needs_grad[1])
        c->grad_inputs[1] = alpha == 1.0 ? g : ag_mul_scalar(g, alpha);
    return bw_status(c);
}

static int sub_backward(ag_bwctx *c) {
    ag_tensor *g = c->grad_outputs[0];
    double alpha = c->args[2].u.f;
    if (c->needs_grad[0])
        c->grad_inputs[0] = g;
    if (c->needs_grad[1])
        c->grad_inputs[1] = alpha == 1.0 ? ag_neg(g) : ag_mul_scalar(ag_neg(g), alpha);
    return bw_status(c);
}

/* mul.Tensor and mul_.Tensor (whose args[0] is the saved original self). */
static int mul_backward(ag_bwctx *c) {
    ag_tensor *g = c->grad_outputs[0];
    if (c->needs_grad[0])
        c->grad_inputs[0] = ag_mul(g, c->args[1].u.t);
    if (c->needs_grad[1])
        c->grad_inputs[1] = ag_mul(g, c->args[0].u.t);
    return bw_status(c);
}

/* self: grad / other; other: -grad * ((self / other) / other), as ATen writes it. */
static int div_backward(ag_bwctx *c) {
    ag_tensor *g = c->grad_outputs[0], *x = c->args[0].u.t, *y = c->args[1].u.t;
    if (c->needs_grad[0])
        c->grad_inputs[0] = ag_div(g, y);
    if (c->needs_grad[1]) {
        ag_tensor *ng = ag_neg(g); /* traced before x / y / y on every compiler */
        c->grad_inputs[1] = ag_mul(ng, ag_div(ag_div(x, y), y));
    }
    return bw_status(c);
}

/* add.Scalar, sub.Scalar, add_.Scalar: the gradient passes through. */
static int identity_backward(ag_bwctx *c) {
    c->grad_inputs[0] = c->grad_outputs[0];
    return bw_status(c);
}

static int mul_scalar_backward(ag_bwctx *c) {
    c->grad_inputs[0] = ag_mul_scalar(c->grad_outputs[0], c->args[1].u.f);
    return bw_status(c);
}

static int div_scalar_backward(ag_bwctx *c) {
    c->grad_inputs[0] = ag_div_scalar(c->grad_outputs[0], c->args[1].u.f);
    return bw_status(c);
}

static void add_samples(ag_samples *s) {
    int64_t a[] = {3, 4}, b[] = {4}, c[] = {3, 1};
    ag_samples_add(s, "same shape",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, a, -1, 1)),
                              AG_A_T(ag_samples_rand(s, 2, a, -1, 1))},
                   2);
    ag_samples_add(s, "broadcast",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, a, -1, 1)),
                              AG_A_T(ag_samples_rand(s, 1, b, -1, 1)), AG_A_F(2.5)},
                   3);
    ag_samples_add(s, "strided+broadcast",
                   (ag_arg[]){AG_A_T(ag_samples_rand_strided(s, 2, a, -1, 1)),
                              AG_A_T(ag_samples_rand(s, 2, c, -1, 1))},
                   2);
}

static const ag_opdef op_add = {
    .schema = "add.Tensor(Tensor self, Tensor other, *, Scalar alpha=1) -> Tensor",
    .flags = AG_OP_POINTWISE,
    .meta = add_meta,
    .kernel = add_kernel,
    .dtypes = AG_DT_ALL,
    .backward = add_backward,
    .samples = add_samples,
    .shard = ag_shard_rule_linear_pointwise,
};

static const ag_opdef op_sub = {
    .schema = "sub.Tensor(Tensor self, Tensor other, *, Scalar alpha=1) -> Tensor",
    .flags = AG_OP_POINTWISE,
    .meta = sub_meta,
    .kernel = sub_kernel,
    .dtypes = AG_DT_ALL,
    .backward = sub_backward,
    .samples = add_samples,
    .shard = ag_shard_rule_linear_pointwise,
};
static const ag_opdef op_mul = {
    .schema = "mul.Tensor(Tensor self, Tensor other) -> Tensor",
    .flags = AG_OP_POINTWISE,
    .meta = mul_meta,
    .kernel = mul_kernel,
    .dtypes = AG_DT_ALL,
    .backward = mul_backward,
    .save_args = 3,
    .samples = mul_samples,
    .shard = ag_shard_rule_linear_pointwise,
};
static const ag_opdef op_div = {
    .schema = "div.Tensor(Tensor self, Tensor other) -> Tensor",
    .flags = AG_OP_POINTWISE,
    .meta = div_meta,
    .kernel = div_kernel,
    .dtypes = AG_DT_ALL,
    .backward = div_backward,
    .save_args = 3,
    .samples = div_samples,
    .shard = ag_shard_rule_linear_pointwise,
};
static const ag_opdef op_add_scalar = {
    .schema = "add.Scalar(Tensor self, Scalar other, Scalar alpha=1) -> Tensor",
    .flags = AG_OP_POINTWISE,
    .meta = add_scalar_meta,
    .kernel = add_scalar_kernel,
    .dtypes = AG_DT_ALL,
    .backward = identity_backward,
    .samples = scalar_samples,
    .shard = ag_shard_rule_linear_pointwise,
};
static const ag_opdef op_sub_scalar = {
    .schema = "sub.Scalar(Tensor self, Scalar other, Scalar alpha=1) -> Tensor",
    .flags = AG_OP_POINTWISE,
    .meta = sub_scalar_meta,
    .kernel = sub_scalar_kernel,
    .dtypes = AG_DT_ALL,
    .backward = identity_backward,
    .samples = scalar_samples,
    .shard = ag_shard_rule_linear_pointwise,
};
static const ag_opdef op_mul_scalar = {
    .schema = "mul.Scalar(Tensor self, Scalar other) -> Tensor",
    .flags = AG_OP_POINTWISE,
    .meta = mul_scalar_meta,
    .kernel = mul_scalar_kernel,
    .dtypes = AG_DT_ALL,
    .backward = mul_scalar_backward,
    .samples = scalar_samples,
    .shard = ag_shard_rule_linear_pointwise,
};
static const ag_opdef op_div_scalar = {
    .schema = "div.Scalar(Tensor self, Scalar other) -> Tensor",
    .flags = AG_OP_POINTWISE,
    .meta = div_scalar_meta,
    .kernel = div_scalar_kernel,
    .dtypes = AG_DT_ALL,
    .backward = div_scalar_backward,
    .samples = scalar_samples,
    .shard = ag_shard_rule_linear_pointwise,
};

/* ---- pow.Tensor_Scalar ---- */

static int pow_meta(const ag_arg *a, ag_tmeta *o) {
    const ag_tensor *x = a[0].u.t;
    double e = a[1].u.f;
    ag_dtype dt = ag__promote_scalar(x->dtype, e);
    if (!is_float(dt) && e < 0)
        return ag__err(AG_EINVAL,
                       "pow: integers to negative integer powers are not allowed "
                       "(exponent %g)",
                       e);
    int rc = ag__check_fits("pow", e, dt);
    return rc ? rc : pw_meta("pow", x, NULL, dt, o);
}

/* Common exponents get exact, vectorizable forms, as in ATen's CPU kernel. */
static int pow_run(ag_tensor *out, ag_tensor *xt, double e) {
    if (out->dtype == AG_I64) {
        const int64_t n = (int64_t)e;
        PW1(out, xt, int64_t, int64_t, ipow(x, n));
        return 0;
    }
    AG__FLOAT_SWITCH(out->dtype, T, {
        const T te = (T)e;
        if (e == 1)
            PW1(out, xt, T, T, x);
        else if (e == 2)
            PW1(out, xt, T, T, x * x);
        else if (e == 3)
            PW1(out, xt, T, T, x * x * x);
        else if (e == 0.5)
            PW1(out, xt, T, T, sqrt(x));
        else if (e == -0.5)
            PW1(out, xt, T, T, (T)1 / sqrt(x));
        else if (e == -1)
            PW1(out, xt, T, T, (T)1 / x);
        else
            PW1(out, xt, T, T, pow(x, te));
    });
    return 0;
}

static int pow_kernel(const ag_arg *a, ag_tensor **o) {
    ag_tensor *x = a[0].u.t;
    ag__scratch_tensor tmp;
    int rc = to_dtype_tmp(&x, o[0]->dtype, &tmp, 0);
    if (!rc)
        rc = pow_run(o[0], x, a[1].u.f);
    return rc;
}

/* grad * (exponent * self^(exponent - 1)); zeros for exponent 0. */
static int pow_backward(ag_bwctx *c) {
    ag_tensor *x = c->args[0].u.t;
    double e = c->args[1].u.f;
    if (e == 0)
        c->grad_inputs[0] = ag_zeros_like(x);
    else
        c->grad_inputs[0] = ag_mul(c->grad_outputs[0], ag_mul_scalar(ag_pow_scalar(x, e - 1), e));
    return bw_status(c);
}

static void pow_samples(ag_samples *s) {
    int64_t a[] = {3, 4};
    ag_samples_add(s, "square", (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, a, -2, 2)), AG_A_F(2)}, 2);
    ag_samples_add(s, "cube, transposed",
                   (ag_arg[]){AG_A_T(ag_samples_rand_strided(s, 2, a, -2, 2)), AG_A_F(3)}, 2);
    ag_samples_add(s, "x^-1.5", (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, a, 0.5, 2)), AG_A_F(-1.5)},
                   2);
    ag_samples_add(s, "sqrt", (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, a, 0.5, 2)), AG_A_F(0.5)}, 2);
}

static const ag_opdef op_pow = {
    .schema = "pow.Tensor_Scalar(Tensor self, Scalar exponent) -> Tensor",
    .flags = AG_OP_POINTWISE,
    .meta = pow_meta,
    .kernel = pow_kernel,
    .dtypes = (1u << AG_F32) | (1u << AG_F64) | (1u << AG_I64) | (1u << AG_BOOL),
    .backward = pow_backward,
    .save_args = 1,
    .samples = pow_samples,
};

/* ---- unary math and activations ---- */

typedef enum {
    UN_NEG,
    UN_EXP,
    UN_LOG,
    UN_SQRT,
    UN_RSQRT,
    UN_ABS,
    UN_TANH,
    UN_SIGMOID,
    UN_RELU,
    UN_GELU,
    UN_GELU_TANH,
    UN_SILU,
    UN_SIN,
    UN_COS,
    UN_SIGN,
} unary_kind;

static const char *const unary_names[] = {
    "neg",  "exp",  "log",  "sqrt", "rsqrt", "abs", "tanh", "sigmoid",
    "relu", "gelu", "gelu", "silu", "sin",   "cos", "sign",
};

static int unary_meta(unary_kind k, const ag_arg *a, ag_tmeta *o) {
    const ag_tensor *x = a[0].u.t;
    if (k == UN_NEG && x->dtype == AG_BOOL)
        return ag__err(AG_EINVAL, "neg: negation, the `-` operator, on a bool tensor is not "
                                  "supported; use logical_not to invert a mask");
    /* neg, abs, relu and sign keep integral dtypes; the rest compute in floating point. */
    bool keep = k == UN_NEG || k == UN_ABS || k == UN_RELU || k == UN_SIGN;
    return pw_meta(unary_names[k], x, NULL, keep ? x->dtype : floating(x->dtype), o);
}

static int unary_run(unary_kind k, ag_tensor *out, ag_tensor *xt) {
    if (out->dtype == AG_I64) {
        typedef int64_t T;
        switch (k) {
        /* -INT64_MIN wraps to INT64_MIN (so does its abs), as in PyTorch */
        case UN_NEG:
            PW1(out, xt, T, T, ag__wsub(0, x));
            break;
        case UN_ABS:
            PW1(out, xt, T, T, x < 0 ? ag__wsub(0, x) : x);
            break;
        case UN_RELU:
            PW1(out, xt, T, T, x < 0 ? 0 : x);
            break;
        case UN_SIGN:
            PW1(out, xt, T, T, (x > 0) - (x < 0));
            break;
        default:
            return ag__err(AG_ENOTSUP, "%s: no integer kernel", unary_names[k]);
        }
        return 0;
    }
    if (out->dtype == AG_F32) { /* sqrt and the activations vectorize via fastmath.h */
        switch (k) {
        case UN_SQRT:
            PW1V(out, xt, ag__vsqrt);
            return 0;
        case UN_RSQRT:
            PW1V(out, xt, ag__vrsqrt);
            return 0;
        case UN_EXP:
            PW1V(out, xt, ag__vexp);
            return 0;
        case UN_TANH:
            PW1V(out, xt, ag__vtanh);
            return 0;
        case UN_SIGMOID:
            PW1V(out, xt, ag__vsigmoid);
            return 0;
        case UN_SILU:
            PW1V(out, xt, ag__vsilu);
            return 0;
        case UN_GELU:
            PW1V(out, xt, ag__vgelu);
            return 0;
        case UN_GELU_TANH:
            PW1V(out, xt, ag__vgelu_tanh);
            return 0;
        default:
            break;
        }
    }
    /* The float instantiation of the cases above is not reached: f32 returned already. */
    AG__FLOAT_SWITCH(
        out->dtype, T, switch (k) {
            case UN_NEG:
                PW1(out, xt, T, T, -x);
                break;
            case UN_EXP:
                PW1(out, xt, T, T, exp(x));
                break;
            case UN_LOG:
                PW1(out, xt, T, T, log(x));
                break;
            case UN_SQRT:
                PW1(out, xt, T, T, sqrt(x));
                break;
            case UN_RSQRT:
                PW1(out, xt, T, T, (T)1 / sqrt(x));
                break;
            case UN_ABS:
                PW1(out, xt, T, T, fabs(x));
                break;
            case UN_TANH:
                PW1(out, xt, T, T, tanh(x));
                break;
            case UN_SIGMOID:
                PW1(out, xt, T, T, sigmoid_d(x));
                break;
            case UN_RELU:
                PW1(out, xt, T, T, x < 0 ? (T)0 : x);
                break; /* NaN stays NaN */
            case UN_GELU:
                PW1(out, xt, T, T, gelu_d(x));
                break;
            case UN_GELU_TANH:
                PW1(out, xt, T, T, gelu_tanh_d(x));
                break;
            case UN_SILU:
                PW1(out, xt, T, T, x * sigmoid_d(x));
                break;
            case UN_SIN:
                PW1(out, xt, T, T, sin(x));
                break;
            case UN_COS:
                PW1(out, xt, T, T, cos(x));
                break;
            case UN_SIGN:
                PW1(out, xt, T, T, (T)((x > 0) - (x < 0)));
                break;
        });
    return 0;
}

static int unary_kernel(unary_kind k, const ag_arg *a, ag_tensor *out) {
    ag_tensor *x = a[0].u.t;
    ag__scratch_tensor tmp;
    int rc = to_dtype_tmp(&x, out->dtype, &tmp, 0);
    if (!rc)
        rc = unary_run(k, out, x);
    return rc;
}

#define UNARY_FNS(name, k)                                                                         \
    static int name##_meta(const ag_arg *a, ag_tmeta *o) {                                         \
        return unary_meta(k, a, o);                                                                \
    }                                                                                              \
    static int name##_kernel(const ag_arg *a, ag_tensor **o) {                                     \
        return unary_kernel(k, a, o[0]);                                                           \
    }
UNARY_FNS(neg, UN_NEG)
UNARY_FNS(exp, UN_EXP)
UNARY_FNS(log, UN_LOG)
UNARY_FNS(sqrt, UN_SQRT)
UNARY_FNS(rsqrt, UN_RSQRT)
UNARY_FNS(abs, UN_ABS)
UNARY_FNS(tanh, UN_TANH)
UNARY_FNS(sigmoid, UN_SIGMOID)
UNARY_FNS(relu, UN_RELU)
UNARY_FNS(silu, UN_SILU)
UNARY_FNS(sin, UN_SIN)
UNARY_FNS(cos, UN_COS)
UNARY_FNS(sign, UN_SIGN)

/* gelu's `approximate`: "none" (also for None) or "tanh"; -1 for anything else. */
static int gelu_mode(const char *op, const ag_arg *a) {
    const char *s = a->kind == AG_ARG_STR && a->u.s ? a->u.s : "none";
    if (!strcmp(s, "none"))
        return 0;
    if (!strcmp(s, "tanh"))
        return 1;
    ag__err(AG_EINVAL, "%s: approximate must be 'none' or 'tanh', not '%s'", op, s);
    return -1;
}

static int gelu_meta(const ag_arg *a, ag_tmeta *o) {
    return gelu_mode("gelu", &a[1]) < 0 ? AG_EINVAL : unary_meta(UN_GELU, a, o);
}

static int gelu_kernel(const ag_arg *a, ag_tensor **o) {
    return unary_kernel(gelu_mode("gelu", &a[1]) ? UN_GELU_TANH : UN_GELU, a, o[0]);
}

#define G (c->grad_outputs[0])
#define SELF (c->args[0].u.t)
#define RESULT (c->outputs[0])
/* One-input rules: the engine only calls them when that input needs a gradient. */
static int neg_backward(ag_bwctx *c) {
    c->grad_inputs[0] = ag_neg(G);
    return bw_status(c);
}
static int exp_backward(ag_bwctx *c) {
    c->grad_inputs[0] = ag_mul(G, RESULT);
    return bw_status(c);
}
static int log_backward(ag_bwctx *c) {
    c->grad_inputs[0] = ag_div(G, SELF);
    return bw_status(c);
}
static int sqrt_backward(ag_bwctx *c) {
    c->grad_inputs[0] = ag_div(G, ag_mul_scalar(RESULT, 2));
    return bw_status(c);
}
static int rsqrt_backward(ag_bwctx *c) {
    ag_tensor *half = ag_mul_scalar(G, -0.5); /* traced before the power */
    c->grad_inputs[0] = ag_mul(half, ag_pow_scalar(RESULT, 3));
    return bw_status(c);
}
static int abs_backward(ag_bwctx *c) {
    c->grad_inputs[0] = ag_mul(G, ag_sign(SELF));
    return bw_status(c);
}
static int tanh_backward(ag_bwctx *c) {
    c->grad_inputs[0] = ag_tanh_backward(G, RESULT);
    return bw_status(c);
}
static int sigmoid_backward(ag_bwctx *c) {
    c->grad_inputs[0] = ag_sigmoid_backward(G, RESULT);
    return bw_status(c);
}
static int relu_backward(ag_bwctx *c) {
    c->grad_inputs[0] = ag_threshold_backward(G, RESULT, 0);
    return bw_status(c);
}
static int gelu_backward(ag_bwctx *c) {
    c->grad_inputs[0] = ag_gelu_backward(G, SELF, gelu_mode("gelu", &c->args[1]) ? "tanh" : "none");
    return bw_status(c);
}
static int silu_backward(ag_bwctx *c) {
    c->grad_inputs[0] = ag_silu_backward(G, SELF);
    return bw_status(c);
}
static int sin_backward(ag_bwctx *c) {
    c->grad_inputs[0] = ag_mul(G, ag_cos(SELF));
    return bw_status(c);
}
static int cos_backward(ag_bwctx *c) {
    c->grad_inputs[0] = ag_mul(G, ag_neg(ag_sin(SELF)));
    return bw_status(c);
}
static int sign_backward(ag_bwctx *c) {
    c->grad_inputs[0] = ag_zeros_like(G);
    return bw_status(c);
}

static void gelu_samples(ag_samples *s) {
    int64_t a[] = {3, 4};
    unary_samples(s, -3, 3);
    ag_samples_add(s, "tanh", (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, a, -3, 3)), AG_A_S("tanh")},
                   2);
}

#define UNARY_DT ((1u << AG_F32) | (1u << AG_F64) | (1u << AG_I64))
/* Decompositions for the "core" table (ag_decomp_table_core): the formulas PyTorch's
 * torch._decomp uses, written with ops. gelu 'none' needs erf, which the table lacks, so that
 * variant reports AG_ENOTSUP and stays whole. */
static int silu_decomp(const ag_arg *a, ag_tensor **o) {
    o[0] = ag_mul(a[0].u.t, ag_sigmoid(a[0].u.t));
    return o[0] ? 0 : ag_last_status();
}

static int gelu_decomp(const ag_arg *a, ag_tensor **o) {
    if (gelu_mode("gelu", &a[1]) != 1)
        return AG_ENOTSUP;
    /* 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3))) */
    ag_tensor *x = a[0].u.t;
    ag_tensor *inner = ag_mul_scalar(ag_add(x, ag_mul_scalar(ag_pow_scalar(x, 3.0), 0.044715)),
                                     0.7978845608028654);
    ag_tensor *half_x = ag_mul_scalar(x, 0.5); /* traced before tanh + 1 on every compiler */
    o[0] = ag_mul(half_x, ag_add_scalar(ag_tanh(inner), 1.0));
    return o[0] ? 0 : ag_last_status();
}

#define neg_decomp NULL
#define exp_decomp NULL
#define log_decomp NULL
#define sqrt_decomp NULL
#define rsqrt_decomp NULL
#define abs_decomp NULL
#define tanh_decomp NULL
#define sigmoid_decomp NULL
#define relu_decomp NULL
#define sin_decomp NULL
#define cos_decomp NULL
#define sign_decomp NULL
/* neg is linear: it keeps Partial inputs Partial; the others take the default pointwise rule. */
#define neg_shard ag_shard_rule_linear_pointwise
#define exp_shard NULL
#define log_shard NULL
#define sqrt_shard NULL
#define rsqrt_shard NULL
#define abs_shard NULL
#define tanh_shard NULL
#define sigmoid_shard NULL
#define relu_shard NULL
#define gelu_shard NULL
#define silu_shard NULL
#define sin_shard NULL
#define cos_shard NULL
#define sign_shard NULL

#define UNARY_OP(name, sch, dts, save_a, save_o, smp)                                              \
    static const ag_opdef op_##name = {                                                            \
        .schema = sch,                                                                             \
        .flags = AG_OP_POINTWISE,                                                                  \
        .meta = name##_meta,                                                                       \
        .kernel = name##_kernel,                                                                   \
        .dtypes = dts,                                                                             \
        .backward = name##_backward,                                                               \
        .save_args = save_a,                                                                       \
        .save_outputs = save_o,                                                                    \
        .samples = smp,                                                                            \
        .decomp = name##_decomp,                                                                   \
        .shard = name##_shard,                                                                     \
    };
UNARY_OP(neg, "neg(Tensor self) -> Tensor", AG_DT_ALL, 0, 0, samples_any)
UNARY_OP(exp, "exp(Tensor self) -> Tensor", AG_DT_ALL, 0, 1, samples_any)
UNARY_OP(log, "log(Tensor self) -> Tensor", AG_DT_ALL, 1, 0, samples_pos)
UNARY_OP(sqrt, "sqrt(Tensor self) -> Tensor", AG_DT_ALL, 0, 1, samples_pos)
UNARY_OP(rsqrt, "rsqrt(Tensor self) -> Tensor", AG_DT_ALL, 0, 1, samples_pos)
UNARY_OP(abs, "abs(Tensor self) -> Tensor", UNARY_DT, 1, 0, samples_kink)
UNARY_OP(tanh, "tanh(Tensor self) -> Tensor", AG_DT_ALL, 0, 1, samples_any)
UNARY_OP(sigmoid, "sigmoid(Tensor self) -> Tensor", AG_DT_ALL, 0, 1, samples_any)
UNARY_OP(relu, "relu(Tensor self) -> Tensor", UNARY_DT, 0, 1, samples_kink)
UNARY_OP(gelu, "gelu(Tensor self, *, str approximate='none') -> Tensor", AG_DT_FLOAT, 1, 0,
         gelu_samples)
UNARY_OP(silu, "silu(Tensor self) -> Tensor", AG_DT_FLOAT, 1, 0, samples_any)
UNARY_OP(sin, "sin(Tensor self) -> Tensor", AG_DT_ALL, 1, 0, samples_any)
UNARY_OP(cos, "cos(Tensor self) -> Tensor", AG_DT_ALL, 1, 0, samples_any)
UNARY_OP(sign, "sign(Tensor self) -> Tensor", UNARY_DT, 0, 0, samples_kink)

/* ---- clamp(Tensor self, Scalar? min=None, Scalar? max=None) ---- */

static int clamp_meta(const ag_arg *a, ag_tmeta *o) {
    const ag_tensor *x = a[0].u.t;
    bool has_lo = a[1].kind == AG_ARG_FLOAT, has_hi = a[2].kind == AG_ARG_FLOAT;
    if (!has_lo && !has_hi)
        return ag__err(AG_EINVAL, "clamp: at least one of 'min' or 'max' must not be None");
    ag_dtype dt = x->dtype;
    if (has_lo)
        dt = ag__promote_scalar(dt, a[1].u.f);
    if (has_hi)
        dt = ag__promote_scalar(dt, a[2].u.f);
    return pw_meta("clamp", x, NULL, dt, o);
}

/* A clamp bound for int64 tensors (integral: the meta promoted anything else to float): bounds
 * beyond the range clamp nothing on that side. */
static int64_t sat_i64(double v) {
    return v >= 0x1p63 ? INT64_MAX : v < -0x1p63 ? INT64_MIN : (int64_t)v;
}

/* min(max(x, lo), hi) as PyTorch: lo > hi gives hi everywhere; NaN inputs stay NaN. */
static int clamp_run(ag_tensor *out, ag_tensor *xt, const ag_arg *a) {
    bool has_lo = a[1].kind == AG_ARG_FLOAT, has_hi = a[2].kind == AG_ARG_FLOAT;
    if (out->dtype == AG_I64) {
        const int64_t hi = has_hi ? sat_i64(a[2].u.f) : INT64_MAX;
        int64_t lo = has_lo ? sat_i64(a[1].u.f) : INT64_MIN;
        lo = lo > hi ? hi : lo;
        PW1(out, xt, int64_t, int64_t, x < lo ? lo : (x > hi ? hi : x));
        return 0;
    }
    AG__FLOAT_SWITCH(out->dtype, T, {
        const T hi = has_hi ? (T)a[2].u.f : (T)INFINITY;
        const T lo = has_lo ? ((T)a[1].u.f > hi ? hi : (T)a[1].u.f) : (T)-INFINITY;
        PW1(out, xt, T, T, x < lo ? lo : (x > hi ? hi : x));
    });
    return 0;
}

static int clamp_kernel(const ag_arg *a, ag_tensor **o) {
    ag_tensor *x = a[0].u.t;
    ag__scratch_tensor tmp;
    int rc = to_dtype_tmp(&x, o[0]->dtype, &tmp, 0);
    if (!rc)
        rc = clamp_run(o[0], x, a);
    return rc;
}

/* ATen's clamp_backward: where(min <= self <= max, grad, 0) (subgradient 1 at the bounds). */
static int clamp_backward(ag_bwctx *c) {
    ag_tensor *mask = NULL;
    if (c->args[1].kind == AG_ARG_FLOAT)
        mask = ag_ge_scalar(SELF, c->args[1].u.f);
    if (c->args[2].kind == AG_ARG_FLOAT) {
        ag_tensor *m = ag_le_scalar(SELF, c->args[2].u.f);
        mask = mask ? ag_mul(mask, m) : m; /* logical and of bool masks */
    }
    c->grad_inputs[0] = ag_where(mask, G, zero_of(G));
    return bw_status(c);
}

static void clamp_samples(ag_samples *s) {
    int64_t a[] = {3, 4};
    ag_samples_add(s, "min and max",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, a, -2, 2)), AG_A_F(-0.95), AG_A_F(1.05)},
                   3);
    ag_samples_add(
        s, "min, transposed",
        (ag_arg[]){AG_A_T(ag_samples_rand_strided(s, 2, a, -2, 2)), AG_A_F(0.05), AG_A_NONE}, 3);
    ag_samples_add(
        s, "max", (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, a, -2, 2)), AG_A_NONE, AG_A_F(-0.15)}, 3);
}

static const ag_opdef op_clamp = {
    .schema = "clamp(Tensor self, Scalar? min=None, Scalar? max=None) -> Tensor",
    .flags = AG_OP_POINTWISE,
    .meta = clamp_meta,
    .kernel = clamp_kernel,
    .dtypes = UNARY_DT,
    .backward = clamp_backward,
    .save_args = 1,
    .samples = clamp_samples,
};

/* ---- where.self(Tensor condition, Tensor self, Tensor other) ---- */

static int where_meta(const ag_arg *a, ag_tmeta *o) {
    const ag_tensor *p = a[0].u.t, *x = a[1].u.t, *y = a[2].u.t;
    if (p->dtype != AG_BOOL)
        return ag__err(AG_EINVAL, "where: expected condition to be a bool tensor, but got %s",
                       ag_dtype_short(p->dtype));
    int rc = pw_meta("where", x, y, result_type(x, y), o);
    if (rc)
        return rc;
    ag_tmeta xy = *o;
    int n;
    int64_t sizes[AG_MAX_DIMS];
    rc = ag__broadcast("where", p->ndim, p->sizes, xy.ndim, xy.sizes, &n, sizes);
    if (!rc)
        ag__tmeta_contiguous(o, xy.dtype, n, sizes);
    return rc;
}

static int where_run(ag_tensor *out, ag_tensor *cond, ag_tensor *xt, ag_tensor *yt) {
    /* The condition is read as uint8_t: GCC 12 vectorizes a select on a byte mask, not on a
     * bool. */
    AG__ALL_SWITCH(out->dtype, T, PW3(out, cond, xt, yt, T, uint8_t, T, T, p ? x : y));
    return 0;
}

static int where_kernel(const ag_arg *a, ag_tensor **o) {
    ag_tensor *x = a[1].u.t, *y = a[2].u.t;
    ag__scratch_tensor tx, ty;
    int rc = to_dtype_tmp(&x, o[0]->dtype, &tx, 0);
    if (!rc)
        rc = to_dtype_tmp(&y, o[0]->dtype, &ty, 1);
    if (!rc)
        rc = where_run(o[0], a[0].u.t, x, y);
    return rc;
}

/* self: where(cond, grad, 0); other: where(cond, 0, grad). The engine sums broadcast dims. */
static int where_backward(ag_bwctx *c) {
    ag_tensor *p = c->args[0].u.t;
    if (c->needs_grad[1])
        c->grad_inputs[1] = ag_where(p, G, zero_of(G));
    if (c->needs_grad[2])
        c->grad_inputs[2] = ag_where(p, zero_of(G), G);
    return bw_status(c);
}

static void where_samples(ag_samples *s) {
    int64_t a[] = {3, 4}, b[] = {4};
    ag_samples_add(s, "same shape",
                   (ag_arg[]){AG_A_T(sample_mask(2, a)), AG_A_T(ag_samples_rand(s, 2, a, -1, 1)),
                              AG_A_T(ag_samples_rand(s, 2, a, -1, 1))},
                   3);
    ag_samples_add(s, "broadcast",
                   (ag_arg[]){AG_A_T(sample_mask(1, b)),
                              AG_A_T(ag_samples_rand_strided(s, 2, a, -1, 1)),
                              AG_A_T(ag_samples_rand(s, 1, b, -1, 1))},
                   3);
}

static const ag_opdef op_where = {
    .schema = "where.self(Tensor condition, Tensor self, Tensor other) -> Tensor",
    .flags = AG_OP_POINTWISE,
    .meta = where_meta,
    .kernel = where_kernel,
    .dtypes = AG_DT_ALL,
    .backward = where_backward,
    .save_args = 1,
    .samples = where_samples,
};

/* ---- masked_fill.Scalar(Tensor self, Tensor mask, Scalar value) ---- */

static int masked_fill_meta(const ag_arg *a, ag_tmeta *o) {
    const ag_tensor *x = a[0].u.t, *m = a[1].u.t;
    if (m->dtype != AG_BOOL)
        return ag__err(AG_EINVAL,
                       "masked_fill: only supports boolean masks, but got mask with "
                       "dtype %s",
                       ag_dtype_short(m->dtype));
    return pw_meta("masked_fill", x, m, x->dtype, o);
}

static int masked_fill_kernel(const ag_arg *a, ag_tensor **o) {
    int rc = ag__check_fits("masked_fill", a[2].u.f, o[0]->dtype);
    if (rc)
        return rc;
    AG__ALL_SWITCH(o[0]->dtype, T, {
        const T v = (T)a[2].u.f;
        PW2(o[0], a[0].u.t, a[1].u.t, T, T, uint8_t, y ? v : x); /* bytes: see where_run */
    });
    return 0;
}

static int masked_fill_backward(ag_bwctx *c) {
    c->grad_inputs[0] = ag_masked_fill(G, c->args[1].u.t, 0);
    return bw_status(c);
}

static void masked_fill_samples(ag_samples *s) {
    int64_t a[] = {3, 4}, b[] = {4};
    ag_samples_add(
        s, "same shape",
        (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, a, -1, 1)), AG_A_T(sample_mask(2, a)), AG_A_F(0.5)},
        3);
    ag_samples_add(s, "broadcast mask, transposed",
                   (ag_arg[]){AG_A_T(ag_samples_rand_strided(s, 2, a, -1, 1)),
                              AG_A_T(sample_mask(1, b)), AG_A_F(-2)},
                   3);
}

static const ag_opdef op_masked_fill = {
    .schema = "masked_fill.Scalar(Tensor self, Tensor mask, Scalar value) -> Tensor",
    .flags = AG_OP_POINTWISE,
    .meta = masked_fill_meta,
    .kernel = masked_fill_kernel,
    .dtypes = AG_DT_ALL,
    .backward = masked_fill_backward,
    .save_args = 2,
    .samples = masked_fill_samples,
};

/* ---- comparisons: eq, ne, lt, le, gt, ge (.Tensor and .Scalar); bool results ---- */

typedef enum { CMP_EQ, CMP_NE, CMP_LT, CMP_LE, CMP_GT, CMP_GE } cmp_kind;

static const char *const cmp_names[] = {"eq", "ne", "lt", "le", "gt", "ge"};

static int cmp_meta(cmp_kind k, bool scalar, const ag_arg *a, ag_tmeta *o) {
    return pw_meta(cmp_names[k], a[0].u.t, scalar ? NULL : a[1].u.t, AG_BOOL, o);
}

/* Compares x with y (or the scalar s) in x's dtype (the promoted one). */
static int cmp_run(cmp_kind k, ag_tensor *out, ag_tensor *xt, ag_tensor *yt, double s) {
    AG__ALL_SWITCH(xt->dtype, T, {
        const T c = (T)s;
        switch (k) {
        case CMP_EQ:
            if (yt)
                PW2(out, xt, yt, bool, T, T, x == y);
            else
                PW1(out, xt, bool, T, x == c);
            break;
        case CMP_NE:
            if (yt)
                PW2(out, xt, yt, bool, T, T, x != y);
            else
                PW1(out, xt, bool, T, x != c);
            break;
        case CMP_LT:
            if (yt)
                PW2(out, xt, yt, bool, T, T, x < y);
            else
                PW1(out, xt, bool, T, x < c);
            break;
        case CMP_LE:
            if (yt)
                PW2(out, xt, yt, bool, T, T, x <= y);
            else
                PW1(out, xt, bool, T, x <= c);
            break;
        case CMP_GT:
            if (yt)
                PW2(out, xt, yt, bool, T, T, x > y);
            else
                PW1(out, xt, bool, T, x > c);
            break;
        case CMP_GE:
            if (yt)
                PW2(out, xt, yt, bool, T, T, x >= y);
            else
                PW1(out, xt, bool, T, x >= c);
            break;
        }
    });
    return 0;
}

static int cmp_kernel(cmp_kind k, bool scalar, const ag_arg *a, ag_tensor *out) {
    ag_tensor *x = a[0].u.t, *y = scalar ? NULL : a[1].u.t;
    ag__scratch_tensor tx, ty;
    ag_dtype dt = y ? result_type(x, y) : ag__promote_scalar(x->dtype, a[1].u.f);
    if (!y && !ag__fits_dtype(a[1].u.f, dt))
        dt = AG_F64; /* an integer beyond int64's range: compare as doubles, not via a cast */
    int rc = to_dtype_tmp(&x, dt, &tx, 0);
    if (!rc && y)
        rc = to_dtype_tmp(&y, dt, &ty, 1);
    if (!rc)
        rc = cmp_run(k, out, x, y, scalar ? a[1].u.f : 0);
    return rc;
}

#define CMP_OP(name, k, scalar, sch)                                                               \
    static int name##_meta(const ag_arg *a, ag_tmeta *o) {                                         \
        return cmp_meta(k, scalar, a, o);                                                          \
    }                                                                                              \
    static int name##_kernel(const ag_arg *a, ag_tensor **o) {                                     \
        return cmp_kernel(k, scalar, a, o[0]);                                                     \
    }                                                                                              \
    static const ag_opdef op_##name = {                                                            \
        .schema = sch,                                                                             \
        .flags = AG_OP_POINTWISE | AG_OP_NONDIFF,                                                  \
        .meta = name##_meta,                                                                       \
        .kernel = name##_kernel,                                                                   \
        .dtypes = AG_DT_ALL,                                                                       \
    };
CMP_OP(eq, CMP_EQ, false, "eq.Tensor(Tensor self, Tensor other) -> Tensor")
CMP_OP(ne, CMP_NE, false, "ne.Tensor(Tensor self, Tensor other) -> Tensor")
CMP_OP(lt, CMP_LT, false, "lt.Tensor(Tensor self, Tensor other) -> Tensor")
CMP_OP(le, CMP_LE, false, "le.Tensor(Tensor self, Tensor other) -> Tensor")
CMP_OP(gt, CMP_GT, false, "gt.Tensor(Tensor self, Tensor other) -> Tensor")
CMP_OP(ge, CMP_GE, false, "ge.Tensor(Tensor self, Tensor other) -> Tensor")
CMP_OP(eq_scalar, CMP_EQ, true, "eq.Scalar(Tensor self, Scalar other) -> Tensor")
CMP_OP(ne_scalar, CMP_NE, true, "ne.Scalar(Tensor self, Scalar other) -> Tensor")
CMP_OP(lt_scalar, CMP_LT, true, "lt.Scalar(Tensor self, Scalar other) -> Tensor")
CMP_OP(le_scalar, CMP_LE, true, "le.Scalar(Tensor self, Scalar other) -> Tensor")
CMP_OP(gt_scalar, CMP_GT, true, "gt.Scalar(Tensor self, Scalar other) -> Tensor")
CMP_OP(ge_scalar, CMP_GE, true, "ge.Scalar(Tensor self, Scalar other) -> Tensor")

/* ---- backward helpers: f(grad_output, self or output) ---- */

typedef enum { BW_THRESHOLD, BW_SIGMOID, BW_TANH, BW_GELU, BW_GELU_TANH, BW_SILU } bw_kind;

static const char *const bw_names[] = {"threshold_backward", "sigmoid_backward", "tanh_backward",
                                       "gelu_backward",      "gelu_backward",    "silu_backward"};

static int bw_meta(bw_kind k, const ag_arg *a, ag_tmeta *o) {
    const ag_tensor *g = a[0].u.t, *x = a[1].u.t;
    if (!is_float(g->dtype) || !is_float(x->dtype))
        return ag__err(AG_EINVAL, "%s: expected floating point tensors, got %s and %s", bw_names[k],
                       ag_dtype_short(g->dtype), ag_dtype_short(x->dtype));
    return pw_meta(bw_names[k], g, x, result_type(g, x), o);
}

/* x is grad_output, y is self (threshold, gelu, silu) or the forward output (sigmoid, tanh). */
static int bw_run(bw_kind k, ag_tensor *out, ag_tensor *gt, ag_tensor *yt, double threshold) {
    if (out->dtype == AG_F32 && k >= BW_GELU) {
        if (k == BW_GELU)
            PW2V(out, gt, yt, ag__vdgelu);
        else if (k == BW_GELU_TANH)
            PW2V(out, gt, yt, ag__vdgelu_tanh);
        else
            PW2V(out, gt, yt, ag__vdsilu);
        return 0;
    }
    AG__FLOAT_SWITCH(out->dtype, T, {
        const T th = (T)threshold;
        switch (k) {
        case BW_THRESHOLD:
            PW2(out, gt, yt, T, T, T, y <= th ? (T)0 : x);
            break;
        case BW_SIGMOID:
            PW2(out, gt, yt, T, T, T, x * ((T)1 - y) * y);
            break;
        case BW_TANH:
            PW2(out, gt, yt, T, T, T, x * ((T)1 - y * y));
            break;
        case BW_GELU:
            PW2(out, gt, yt, T, T, T, x * dgelu_d(y));
            break;
        case BW_GELU_TANH:
            PW2(out, gt, yt, T, T, T, x * dgelu_tanh_d(y));
            break;
        case BW_SILU:
            PW2(out, gt, yt, T, T, T, x * dsilu_d(y));
            break;
        }
    });
    return 0;
}

static int bw_kernel(bw_kind k, const ag_arg *a, ag_tensor *out) {
    ag_tensor *g = a[0].u.t, *y = a[1].u.t;
    ag__scratch_tensor tg, ty;
    int rc = to_dtype_tmp(&g, out->dtype, &tg, 0);
    if (!rc)
        rc = to_dtype_tmp(&y, out->dtype, &ty, 1);
    if (!rc)
        rc = bw_run(k, out, g, y, k == BW_THRESHOLD ? a[2].u.f : 0);
    return rc;
}

#define BW_FNS(name, k)                                                                            \
    static int name##_meta(const ag_arg *a, ag_tmeta *o) {                                         \
        return bw_meta(k, a, o);                                                                   \
    }                                                                                              \
    static int name##_kernel(const ag_arg *a, ag_tensor **o) {                                     \
        return bw_kernel(k, a, o[0]);                                                              \
    }
BW_FNS(threshold_bw, BW_THRESHOLD)
BW_FNS(sigmoid_bw, BW_SIGMOID)
BW_FNS(tanh_bw, BW_TANH)
BW_FNS(silu_bw, BW_SILU)

static int gelu_bw_meta(const ag_arg *a, ag_tmeta *o) {
    return gelu_mode("gelu_backward", &a[2]) < 0 ? AG_EINVAL : bw_meta(BW_GELU, a, o);
}
static int gelu_bw_kernel(const ag_arg *a, ag_tensor **o) {
    return bw_kernel(gelu_mode("gelu_backward", &a[2]) ? BW_GELU_TANH : BW_GELU, a, o[0]);
}

/* Double backward, ATen's formulas. Inputs: 0 grad_output, 1 self/output; G is the incoming
 * gradient of the helper's result. */
static int threshold_bw_backward(ag_bwctx *c) {
    if (c->needs_grad[0])
        c->grad_inputs[0] = ag_threshold_backward(G, c->args[1].u.t, c->args[2].u.f);
    if (c->needs_grad[1])
        c->grad_inputs[1] = ag_zeros_like(G);
    return bw_status(c);
}

/* output: grad * grad_output * (1 - 2 output). */
static int sigmoid_bw_backward(ag_bwctx *c) {
    ag_tensor *go = c->args[0].u.t, *y = c->args[1].u.t;
    if (c->needs_grad[0])
        c->grad_inputs[0] = ag_sigmoid_backward(G, y);
    if (c->needs_grad[1]) {
        ag_tensor *gg = ag_mul(G, go); /* traced before 1 - 2y on every compiler */
        c->grad_inputs[1] = ag_mul(gg, ag_add_scalar(ag_mul_scalar(y, -2), 1));
    }
    return bw_status(c);
}

/* output: -2 output * grad * grad_output. */
static int tanh_bw_backward(ag_bwctx *c) {
    ag_tensor *go = c->args[0].u.t, *y = c->args[1].u.t;
    if (c->needs_grad[0])
        c->grad_inputs[0] = ag_tanh_backward(G, y);
    if (c->needs_grad[1])
        c->grad_inputs[1] = ag_mul(ag_mul(ag_mul_scalar(y, -2), G), go);
    return bw_status(c);
}

/* silu'(x) = s (1 + x (1 - s)) with s = sigmoid(x); silu''(x) = s (1 - s) (2 + x (1 - 2 s)). */
static int silu_bw_backward(ag_bwctx *c) {
    ag_tensor *go = c->args[0].u.t, *x = c->args[1].u.t;
    if (c->needs_grad[0])
        c->grad_inputs[0] = ag_silu_backward(G, x);
    if (c->needs_grad[1]) {
        ag_tensor *s = ag_sigmoid(x);
        ag_tensor *ds = ag_mul(s, ag_sub_scalar(ag_neg(s), -1)); /* s (1 - s) */
        ag_tensor *t = ag_add_scalar(ag_mul(x, ag_add_scalar(ag_mul_scalar(s, -2), 1)), 2);
        ag_tensor *gg = ag_mul(G, go); /* traced before ds * t on every compiler */
        c->grad_inputs[1] = ag_mul(gg, ag_mul(ds, t));
    }
    return bw_status(c);
}

/* gelu'' for 'none': pdf(x) (2 - x^2). For 'tanh', with t = tanh(b (x + k x^3)) and
 * u = b (1 + 3 k x^2): (1 - t^2) (u - x t u^2 + 3 b k x^2). */
static int gelu_bw_backward(ag_bwctx *c) {
    ag_tensor *go = c->args[0].u.t, *x = c->args[1].u.t;
    bool tanh_mode = gelu_mode("gelu_backward", &c->args[2]) == 1;
    if (c->needs_grad[0])
        c->grad_inputs[0] = ag_gelu_backward(G, x, tanh_mode ? "tanh" : "none");
    if (!c->needs_grad[1])
        return bw_status(c);
    const double b = 0.7978845608028654, k = 0.044715;
    ag_tensor *x2 = ag_mul(x, x), *d2;
    if (!tanh_mode) {
        ag_tensor *pdf = ag_mul_scalar(ag_exp(ag_mul_scalar(x2, -0.5)), 0.3989422804014327);
        d2 = ag_mul(pdf, ag_add_scalar(ag_neg(x2), 2));
    } else {
        ag_tensor *t = ag_tanh(ag_mul_scalar(ag_add(x, ag_mul_scalar(ag_mul(x2, x), k)), b));
        ag_tensor *u = ag_add_scalar(ag_mul_scalar(x2, 3 * b * k), b);
        /* One traced call per statement where two would be arguments of one call: C leaves
         * their order unspecified, and it would become the graph's order. */
        ag_tensor *lhs = ag_add(u, ag_mul_scalar(x2, 3 * b * k));
        ag_tensor *xt = ag_mul(x, t);
        ag_tensor *inner = ag_sub(lhs, ag_mul(xt, ag_mul(u, u)));
        d2 = ag_mul(ag_add_scalar(ag_neg(ag_mul(t, t)), 1), inner);
    }
    c->grad_inputs[1] = ag_mul(ag_mul(G, go), d2);
    return bw_status(c);
}

static void bw_samples(ag_samples *s, double lo, double hi, const ag_arg *extra) {
    int64_t a[] = {3, 4};
    int n = extra ? 3 : 2;
    ag_samples_add(s, "3x4",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, a, -1, 1)),
                              AG_A_T(ag_samples_rand(s, 2, a, lo, hi)), extra ? *extra : AG_A_NONE},
                   n);
    ag_samples_add(s, "transposed",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, a, -1, 1)),
                              AG_A_T(ag_samples_rand_strided(s, 2, a, lo, hi)),
                              extra ? *extra : AG_A_NONE},
                   n);
}
static void threshold_bw_samples(ag_samples *s) {
    bw_samples(s, -1, 1, &AG_A_F(0.25));
}
static void sigmoid_bw_samples(ag_samples *s) {
    bw_samples(s, 0.05, 0.95, NULL);
}
static void tanh_bw_samples(ag_samples *s) {
    bw_samples(s, -0.95, 0.95, NULL);
}
static void silu_bw_samples(ag_samples *s) {
    bw_samples(s, -3, 3, NULL);
}
static void gelu_bw_samples(ag_samples *s) {
    bw_samples(s, -3, 3, NULL);
    bw_samples(s, -3, 3, &AG_A_S("tanh"));
}

#define BW_OP(name, sch, save)                                                                     \
    static const ag_opdef op_##name = {                                                            \
        .schema = sch,                                                                             \
        .flags = AG_OP_POINTWISE | AG_OP_BACKWARD_HELPER,                                          \
        .meta = name##_meta,                                                                       \
        .kernel = name##_kernel,                                                                   \
        .dtypes = AG_DT_FLOAT,                                                                     \
        .backward = name##_backward,                                                               \
        .save_args = save,                                                                         \
        .samples = name##_samples,                                                                 \
    };
BW_OP(threshold_bw,
      "threshold_backward(Tensor grad_output, Tensor self, Scalar threshold) -> Tensor", 2)
BW_OP(sigmoid_bw, "sigmoid_backward(Tensor grad_output, Tensor output) -> Tensor", 3)
BW_OP(tanh_bw, "tanh_backward(Tensor grad_output, Tensor output) -> Tensor", 3)
BW_OP(gelu_bw,
      "gelu_backward(Tensor grad_output, Tensor self, *, str approximate='none') -> Tensor", 3)
BW_OP(silu_bw, "silu_backward(Tensor grad_output, Tensor self) -> Tensor", 3)

/* ---- in place: add_, mul_, copy_, zero_, fill_ ---- */

/* copy_: src broadcasts to self; any dtype converts. */
static int copy_meta(const ag_arg *a, ag_tmeta *o) {
    const ag_tensor *self = a[0].u.t;
    int rc = pw_meta("copy_", self, a[1].u.t, self->dtype, o);
    return rc ? rc : inplace_meta("copy_", self, o);
}

static int copy_kernel(const ag_arg *a, ag_tensor **o) {
    ag_tensor *src = a[1].u.t;
    if (src->dtype != o[0]->dtype)
        return ag__copy_convert("copy_", o[0], src);
    AG__ALL_SWITCH(src->dtype, T, PW1(o[0], src, T, T, x));
    return 0;
}

static int self_meta(const ag_arg *a, ag_tmeta *o) {
    ag__tmeta_of(a[0].u.t, o);
    return 0;
}

static int fill_value(ag_tensor *out, double v) {
    int rc = ag__check_fits("fill_", v, out->dtype);
    if (rc)
        return rc;
    AG__ALL_SWITCH(out->dtype, T, {
        const T c = (T)v;
        PW1(out, out, T, T, c);
    });
    return 0;
}

static int fill_kernel(const ag_arg *a, ag_tensor **o) {
    return fill_value(o[0], a[1].u.f);
}
static int zero_kernel(const ag_arg *a, ag_tensor **o) {
    return fill_value(o[0], 0);
}

/* self: zeros_like(grad) (its old value is overwritten); src: grad (the engine reduces
 * broadcast dims and converts to src's dtype). */
static int copy_backward(ag_bwctx *c) {
    if (c->needs_grad[0])
        c->grad_inputs[0] = ag_zeros_like(G);
    if (c->ntensor_inputs > 1 && c->needs_grad[1])
        c->grad_inputs[1] = G;
    return bw_status(c);
}

/* In-place samples: gradcheck runs in-place ops on a clone of self (x.clone().add_(y)), so
 * self is an ordinary leaf that requires grad; the gradient reaches it through the clone.
 * Arguments: self (3, 4), then `other` (a tensor, broadcast (4) or transposed, or the Scalar
 * v), then alpha, as many as nargs says. */
static void inplace_samples(ag_samples *s, int nargs, bool tensor, double v, double alpha) {
    int64_t a[] = {3, 4}, b[] = {4};
    ag_tensor *x = ag_samples_rand(s, 2, a, -1, 1);
    ag_arg other = tensor ? AG_A_T(ag_samples_rand(s, 1, b, -1, 1)) : AG_A_F(v);
    ag_samples_add(s, "3x4", (ag_arg[]){AG_A_T(x), other, AG_A_F(alpha)}, nargs);
    x = ag_samples_rand_strided(s, 2, a, -1, 1);
    other = tensor ? AG_A_T(ag_samples_rand_strided(s, 2, a, -1, 1)) : AG_A_F(v);
    ag_samples_add(s, "transposed", (ag_arg[]){AG_A_T(x), other}, nargs < 2 ? nargs : 2);
}
static void add_inplace_samples(ag_samples *s) {
    inplace_samples(s, 3, true, 0, 2.5);
}
static void add_scalar_inplace_samples(ag_samples *s) {
    inplace_samples(s, 3, false, 1.5, 2.5);
}
static void mul_inplace_samples(ag_samples *s) {
    inplace_samples(s, 2, true, 0, 0);
}
static void mul_scalar_inplace_samples(ag_samples *s) {
    inplace_samples(s, 2, false, -0.75, 0);
}
static void copy_samples(ag_samples *s) {
    inplace_samples(s, 2, true, 0, 0);
}
static void zero_samples(ag_samples *s) {
    inplace_samples(s, 1, false, 0, 0);
}
static void fill_samples(ag_samples *s) {
    inplace_samples(s, 2, false, 0.5, 0);
}

/* `fn` names the functional variant that functionalization (the joint export) records in
 * place of the in-place op: same arguments, result = the new value of self. */
#define INPLACE_OP(name, sch, meta_fn, kernel_fn, bw, save, smp, fn)                               \
    INPLACE_OP_FLAGS(name, 0, sch, meta_fn, kernel_fn, bw, save, smp, fn)
#define INPLACE_OP_FLAGS(name, more, sch, meta_fn, kernel_fn, bw, save, smp, fn)                   \
    static const ag_opdef op_##name = {                                                            \
        .schema = sch,                                                                             \
        .flags = AG_OP_POINTWISE | AG_OP_INPLACE | (more),                                         \
        .meta = meta_fn,                                                                           \
        .kernel = kernel_fn,                                                                       \
        .dtypes = AG_DT_ALL,                                                                       \
        .backward = bw,                                                                            \
        .save_args = save,                                                                         \
        .samples = smp,                                                                            \
        .functional = fn,                                                                          \
    };
INPLACE_OP(add_inplace,
           "add_.Tensor(Tensor(a!) self, Tensor other, *, Scalar alpha=1) -> Tensor(a!)",
           add_inplace_meta, add_inplace_kernel, add_backward, 0, add_inplace_samples, "add.Tensor")
INPLACE_OP(add_scalar_inplace,
           "add_.Scalar(Tensor(a!) self, Scalar other, Scalar alpha=1) -> Tensor(a!)",
           add_scalar_inplace_meta, add_scalar_inplace_kernel, identity_backward, 0,
           add_scalar_inplace_samples, "add.Scalar")
/* mul_ reads the original self in backward: the dispatcher saves a copy before the kernel. */
INPLACE_OP(mul_inplace, "mul_.Tensor(Tensor(a!) self, Tensor other) -> Tensor(a!)",
           mul_inplace_meta, mul_inplace_kernel, mul_backward, 3, mul_inplace_samples, "mul.Tensor")
INPLACE_OP(mul_scalar_inplace, "mul_.Scalar(Tensor(a!) self, Scalar other) -> Tensor(a!)",
           mul_scalar_inplace_meta, mul_scalar_inplace_kernel, mul_scalar_backward, 0,
           mul_scalar_inplace_samples, "mul.Scalar")
INPLACE_OP(copy, "copy_(Tensor(a!) self, Tensor src, bool non_blocking=False) -> Tensor(a!)",
           copy_meta, copy_kernel, copy_backward, 0, copy_samples, "copy")
INPLACE_OP_FLAGS(zero, AG_OP_FILL, "zero_(Tensor(a!) self) -> Tensor(a!)", self_meta, zero_kernel,
                 copy_backward, 0, zero_samples, "zero")
INPLACE_OP_FLAGS(fill, AG_OP_FILL, "fill_.Scalar(Tensor(a!) self, Scalar value) -> Tensor(a!)",
                 self_meta, fill_kernel, copy_backward, 0, fill_samples, "fill.Scalar")

/* The functional variants of copy_, zero_ and fill_ (what functionalization records): a new
 * contiguous tensor of self's shape and dtype. */
static int functional_copy_meta(const ag_arg *a, ag_tmeta *o) {
    int rc = copy_meta(a, o);
    if (rc == 0)
        ag__tmeta_contiguous(o, a[0].u.t->dtype, a[0].u.t->ndim, a[0].u.t->sizes);
    return rc;
}

static int functional_self_meta(const ag_arg *a, ag_tmeta *o) {
    ag__tmeta_contiguous(o, a[0].u.t->dtype, a[0].u.t->ndim, a[0].u.t->sizes);
    return 0;
}

#define FUNCTIONAL_OP(name, sch, meta_fn, kernel_fn, smp)                                          \
    static const ag_opdef op_##name = {                                                            \
        .schema = sch,                                                                             \
        .flags = AG_OP_POINTWISE,                                                                  \
        .meta = meta_fn,                                                                           \
        .kernel = kernel_fn,                                                                       \
        .dtypes = AG_DT_ALL,                                                                       \
        .backward = copy_backward,                                                                 \
        .samples = smp,                                                                            \
    };
FUNCTIONAL_OP(copy_functional, "copy(Tensor self, Tensor src, bool non_blocking=False) -> Tensor",
              functional_copy_meta, copy_kernel, copy_samples)
FUNCTIONAL_OP(zero_functional, "zero(Tensor self) -> Tensor", functional_self_meta, zero_kernel,
              zero_samples)
FUNCTIONAL_OP(fill_functional, "fill.Scalar(Tensor self, Scalar value) -> Tensor",
              functional_self_meta, fill_kernel, fill_samples)

#undef G
#undef SELF
#undef RESULT

/* ---- entry points ---- */

#define ENTRY_T(fn, name)                                                                          \
    ag_tensor *fn(ag_tensor *a) {                                                                  \
        AG__OP(op, name);                                                                          \
        return ag__call1(op, (ag_arg[]){AG_A_T(a)}, 1);                                            \
    }
#define ENTRY_TT(fn, name)                                                                         \
    ag_tensor *fn(ag_tensor *a, ag_tensor *b) {                                                    \
        AG__OP(op, name);                                                                          \
        return ag__call1(op, (ag_arg[]){AG_A_T(a), AG_A_T(b)}, 2);                                 \
    }
#define ENTRY_TS(fn, name)                                                                         \
    ag_tensor *fn(ag_tensor *a, double s) {                                                        \
        AG__OP(op, name);                                                                          \
        return ag__call1(op, (ag_arg[]){AG_A_T(a), AG_A_F(s)}, 2);                                 \
    }

ENTRY_TT(ag_add, "add.Tensor")
ENTRY_TT(ag_sub, "sub.Tensor")
ENTRY_TT(ag_mul, "mul.Tensor")
ENTRY_TT(ag_div, "div.Tensor")
ENTRY_TS(ag_add_scalar, "add.Scalar")
ENTRY_TS(ag_sub_scalar, "sub.Scalar")
ENTRY_TS(ag_mul_scalar, "mul.Scalar")
ENTRY_TS(ag_div_scalar, "div.Scalar")
ENTRY_TS(ag_pow_scalar, "pow.Tensor_Scalar")
ENTRY_T(ag_neg, "neg")
ENTRY_T(ag_exp, "exp")
ENTRY_T(ag_log, "log")
ENTRY_T(ag_sqrt, "sqrt")
ENTRY_T(ag_rsqrt, "rsqrt")
ENTRY_T(ag_abs, "abs")
ENTRY_T(ag_tanh, "tanh")
ENTRY_T(ag_sigmoid, "sigmoid")
ENTRY_T(ag_relu, "relu")
ENTRY_T(ag_silu, "silu")
ENTRY_T(ag_sin, "sin")
ENTRY_T(ag_cos, "cos")
ENTRY_T(ag_sign, "sign")
ENTRY_TT(ag_eq, "eq.Tensor")
ENTRY_TT(ag_ne, "ne.Tensor")
ENTRY_TT(ag_lt, "lt.Tensor")
ENTRY_TT(ag_le, "le.Tensor")
ENTRY_TT(ag_gt, "gt.Tensor")
ENTRY_TT(ag_ge, "ge.Tensor")
ENTRY_TS(ag_eq_scalar, "eq.Scalar")
ENTRY_TS(ag_ne_scalar, "ne.Scalar")
ENTRY_TS(ag_lt_scalar, "lt.Scalar")
ENTRY_TS(ag_le_scalar, "le.Scalar")
ENTRY_TS(ag_gt_scalar, "gt.Scalar")
ENTRY_TS(ag_ge_scalar, "ge.Scalar")
ENTRY_TT(ag_sigmoid_backward, "sigmoid_backward")
ENTRY_TT(ag_tanh_backward, "tanh_backward")
ENTRY_TT(ag_silu_backward, "silu_backward")
ENTRY_TT(ag_mul_, "mul_.Tensor")
ENTRY_TS(ag_add_scalar_, "add_.Scalar")
ENTRY_TS(ag_mul_scalar_, "mul_.Scalar")
ENTRY_TT(ag_copy_, "copy_")
ENTRY_T(ag_zero_, "zero_")
ENTRY_TS(ag_fill_, "fill_.Scalar")

ag_tensor *ag_add_alpha(ag_tensor *a, ag_tensor *b, double alpha) {
    AG__OP(op, "add.Tensor");
    return ag__call1(op, (ag_arg[]){AG_A_T(a), AG_A_T(b), AG_A_F(alpha)}, 3);
}

ag_tensor *ag_add_(ag_tensor *a, ag_tensor *b, double alpha) {
    AG__OP(op, "add_.Tensor");
    return ag__call1(op, (ag_arg[]){AG_A_T(a), AG_A_T(b), AG_A_F(alpha)}, 3);
}

/* A recognized `approximate` is passed as a string literal: autograd nodes keep the pointer. */
static ag_arg approximate_arg(const char *s) {
    if (!s || !strcmp(s, "none"))
        return AG_A_S("none");
    return AG_A_S(!strcmp(s, "tanh") ? "tanh" : s);
}

ag_tensor *ag_gelu(ag_tensor *a, const char *approximate) {
    AG__OP(op, "gelu");
    return ag__call1(op, (ag_arg[]){AG_A_T(a), approximate_arg(approximate)}, 2);
}

ag_tensor *ag_gelu_backward(ag_tensor *grad, ag_tensor *self, const char *approximate) {
    AG__OP(op, "gelu_backward");
    return ag__call1(op, (ag_arg[]){AG_A_T(grad), AG_A_T(self), approximate_arg(approximate)}, 3);
}

ag_tensor *ag_threshold_backward(ag_tensor *grad, ag_tensor *self, double threshold) {
    AG__OP(op, "threshold_backward");
    return ag__call1(op, (ag_arg[]){AG_A_T(grad), AG_A_T(self), AG_A_F(threshold)}, 3);
}

ag_tensor *ag_clamp(ag_tensor *a, double min, double max) {
    AG__OP(op, "clamp");
    return ag__call1(op,
                     (ag_arg[]){AG_A_T(a), isnan(min) ? AG_A_NONE : AG_A_F(min),
                                isnan(max) ? AG_A_NONE : AG_A_F(max)},
                     3);
}

ag_tensor *ag_where(ag_tensor *cond, ag_tensor *a, ag_tensor *b) {
    AG__OP(op, "where.self");
    return ag__call1(op, (ag_arg[]){AG_A_T(cond), AG_A_T(a), AG_A_T(b)}, 3);
}

ag_tensor *ag_masked_fill(ag_tensor *a, ag_tensor *mask, double v) {
    AG__OP(op, "masked_fill.Scalar");
    return ag__call1(op, (ag_arg[]){AG_A_T(a), AG_A_T(mask), AG_A_F(v)}, 3);
}

const ag_opdef *const ag__ops_pointwise[] = {
    &op_add,
    &op_sub,
    &op_mul,
    &op_div,
    &op_add_scalar,
    &op_sub_scalar,
    &op_mul_scalar,
    &op_div_scalar,
    &op_pow,
    &op_neg,
    &op_exp,
    &op_log,
    &op_sqrt,
    &op_rsqrt,
    &op_abs,
    &op_tanh,
    &op_sigmoid,
    &op_relu,
    &op_gelu,
    &op_silu,
    &op_sin,
    &op_cos,
    &op_sign,
    &op_clamp,
    &op_where,
    &op_masked_fill,
    &op_eq,
    &op_ne,
    &op_lt,
    &op_le,
    &op_gt,
    &op_ge,
    &op_eq_scalar,
    &op_ne_scalar,
    &op_lt_scalar,
    &op_le_scalar,
    &op_gt_scalar,
    &op_ge_scalar,
    &op_threshold_bw,
    &op_sigmoid_bw,
    &op_tanh_bw,
    &op_gelu_bw,
    &op_silu_bw,
    &op_add_inplace,
    &op_add_scalar_inplace,
    &op_mul_inplace,
    &op_mul_scalar_inplace,
    &op_copy,
    &op_zero,
    &op_fill,
    &op_copy_functional,
    &op_zero_functional,
    &op_fill_functional,
    NULL,
};
