/* The two tensor subclass types that ship with the library (include/aotgrad/subclass.h):
 *
 *   TwoTensor         a pair (a, b) that runs every op on both halves, upstream's test
 *                     subclass torch.testing._internal.two_tensor.TwoTensor;
 *   ScaledInt8Tensor  int8 data with one float32 scale, dequantized by every op that touches
 *                     it (a frozen, quantized weight).
 *
 * Both are written with the public subclass API only, as a user's own type would be. */
#include "../core/internal.h"

#include <math.h>
#include <pthread.h>
#include <string.h>

/* ---- TwoTensor ---- */

static const char *const two_attrs[] = {"a", "b"};

/* __tensor_unflatten__: a and b must agree in dtype, sizes and strides; the outer tensor takes
 * a's dtype and strides, and the outer sizes (a's sizes). */
static ag_tensor *two_unflatten(const ag_subclass_type *type, ag_tensor *const *inner,
                                const void *meta, int ndim, const int64_t *sizes) {
    (void)meta;
    ag_tensor *a = inner[0], *b = inner[1];
    char x[128], y[128];
    if (!a || !b)
        return ag__has_error()
                   ? NULL
                   : (ag__err(AG_EINVAL, "TwoTensor: inner tensor %s is NULL", a ? "b" : "a"),
                      NULL);
    if (ag_tensor_dtype(a) != ag_tensor_dtype(b) || ag_tensor_ndim(a) != ag_tensor_ndim(b) ||
        memcmp(ag_tensor_sizes(a), ag_tensor_sizes(b),
               sizeof(int64_t) * (size_t)ag_tensor_ndim(a)) ||
        memcmp(ag_tensor_strides(a), ag_tensor_strides(b),
               sizeof(int64_t) * (size_t)ag_tensor_ndim(a)))
        return ag__err(AG_EINVAL,
                       "TwoTensor: tensors a and b must have the same dtype, shape and strides; "
                       "got a %s and b %s",
                       ag_tensor_meta_str(a, x, sizeof x), ag_tensor_meta_str(b, y, sizeof y)),
               NULL;
    if (ndim != ag_tensor_ndim(a) ||
        memcmp(sizes, ag_tensor_sizes(a), sizeof(int64_t) * (size_t)ndim))
        return ag__err(AG_EINVAL, "TwoTensor: outer size %s differs from a's %s",
                       ag__fmt_sizes(x, sizeof x, ndim, sizes), ag_tensor_meta_str(a, y, sizeof y)),
               NULL;
    return ag_subclass_new(type, ag_tensor_dtype(a), ndim, sizes, ag_tensor_strides(a), inner,
                           NULL);
}

/* __torch_dispatch__: the op on the a's, the op on the b's, outputs paired up. Every output of
 * an aotgrad op is a tensor (comparisons give TwoTensors of bools). */
static int two_dispatch(const ag_subclass_type *type, const ag_op *op, const ag_arg *args,
                        int nargs, ag_tensor **outs) {
    ag_tensor *ra[AG_MAX_OUTPUTS] = {0}, *rb[AG_MAX_OUTPUTS] = {0};
    int na = ag_subclass_call_inner(op, args, nargs, type, 0, ra);
    if (na < 0)
        return na;
    int nb = ag_subclass_call_inner(op, args, nargs, type, 1, rb);
    if (nb < 0)
        return nb;
    if (na != nb)
        return ag__err(AG_EINVAL, "TwoTensor: %s gave %d outputs on a and %d on b", ag_op_name(op),
                       na, nb);
    for (int k = 0; k < na; k++)
        if (!(outs[k] = ag_two_tensor(ra[k], rb[k])))
            return ag_last_status();
    return na;
}

static const ag_subclass_type two_type = {
    .name = "TwoTensor",
    .ninner = 2,
    .attrs = two_attrs,
    .unflatten = two_unflatten,
    .dispatch = two_dispatch,
};

const ag_subclass_type *ag_two_tensor_type(void) {
    return &two_type;
}

ag_tensor *ag_two_tensor(ag_tensor *a, ag_tensor *b) {
    if (!a || !b) {
        if (!ag__has_error())
            ag__err(AG_EINVAL, "two_tensor: %s is NULL", a ? "b" : "a");
        return NULL;
    }
    return two_unflatten(&two_type, (ag_tensor *[]){a, b}, NULL, ag_tensor_ndim(a),
                         ag_tensor_sizes(a));
}

/* ---- ScaledInt8Tensor ---- */

static const char *const sq_attrs[] = {"qdata", "scale"};

/* The metadata: the dtype ops see (the quantized tensor's original dtype). */
typedef struct sq_meta {
    ag_dtype dtype;
} sq_meta;

static ag_tensor *sq_unflatten(const ag_subclass_type *type, ag_tensor *const *inner,
                               const void *meta, int ndim, const int64_t *sizes) {
    ag_tensor *q = inner[0], *s = inner[1];
    const sq_meta *m = meta;
    char x[128], y[128];
    if (!q || !s || !m)
        return ag__has_error() ? NULL
                               : (ag__err(AG_EINVAL, "ScaledInt8Tensor: NULL %s",
                                          !q   ? "qdata"
                                          : !s ? "scale"
                                               : "metadata"),
                                  NULL);
    if (ag_tensor_dtype(q) != AG_I8 || ag_tensor_ndim(q) != ndim ||
        memcmp(ag_tensor_sizes(q), sizes, sizeof(int64_t) * (size_t)ndim) ||
        ag_tensor_dtype(s) != AG_F32 || ag_tensor_ndim(s) != 0 || !ag_dtype_is_float(m->dtype))
        return ag__err(AG_EINVAL,
                       "ScaledInt8Tensor: needs qdata i8 of the outer size %s and a 0-dim f32 "
                       "scale, for a float dtype; got qdata %s and scale %s",
                       ag__fmt_sizes(x, sizeof x, ndim, sizes), ag_tensor_meta_str(q, y, sizeof y),
                       ag_tensor_meta_str(s, x, sizeof x)),
               NULL;
    return ag_subclass_new(type, m->dtype, ndim, sizes, NULL, inner, m);
}

/* __torch_dispatch__: every ScaledInt8Tensor argument is replaced by its dequantized value and
 * the op runs densely; nothing may write into one. */
static int sq_dispatch(const ag_subclass_type *type, const ag_op *op, const ag_arg *args, int nargs,
                       ag_tensor **outs) {
    ag_arg a[AG_MAX_ARGS];
    ag_tensor *list[AG_MAX_ARGS][64];
    for (int i = 0; i < nargs; i++) {
        a[i] = args[i];
        if (a[i].kind == AG_ARG_TENSOR && ag_tensor_subclass(a[i].u.t) == type) {
            if (op->mutates[i])
                return ag__err(AG_ENOTSUP,
                               "%s: argument '%s' is a ScaledInt8Tensor, which cannot be written "
                               "in place (a frozen quantized weight: dequantize it first)",
                               ag_op_name(op), op->args[i].name);
            if (!(a[i].u.t = ag_scaled_int8_dequantize(a[i].u.t)))
                return ag_last_status();
        } else if (a[i].kind == AG_ARG_TENSORS) {
            if (a[i].n > 64)
                return ag__err(AG_ENOTSUP,
                               "%s: ScaledInt8Tensor in a list of %d tensors (at most 64)",
                               ag_op_name(op), a[i].n);
            for (int k = 0; k < a[i].n; k++) {
                ag_tensor *t = a[i].u.ts[k];
                list[i][k] = ag_tensor_subclass(t) == type ? ag_scaled_int8_dequantize(t) : t;
                if (t && !list[i][k])
                    return ag_last_status();
            }
            a[i].u.ts = list[i];
        }
    }
    int rc = ag_op_call(op, a, nargs, outs);
    return rc >= 0 && ag_op_noutputs(op) >= 0 ? ag_op_noutputs(op) : rc; /* lists: their count */
}

static const ag_subclass_type sq_type = {
    .name = "ScaledInt8Tensor",
    .ninner = 2,
    .attrs = sq_attrs,
    .meta_size = sizeof(sq_meta),
    .unflatten = sq_unflatten,
    .dispatch = sq_dispatch,
};

const ag_subclass_type *ag_scaled_int8_type(void) {
    return &sq_type;
}

ag_tensor *ag_scaled_int8_quantize(ag_tensor *x) {
    if (!x) {
        if (!ag__has_error())
            ag__err(AG_EINVAL, "scaled_int8_quantize: x is NULL");
        return NULL;
    }
    if (ag_tensor_subclass(x) || !ag_dtype_is_float(ag_tensor_dtype(x))) {
        char b[128];
        return ag__err(AG_EINVAL, "scaled_int8_quantize: needs a plain float tensor, got %s%s%s",
                       ag_tensor_subclass(x) ? ag_tensor_subclass(x)->name : "",
                       ag_tensor_subclass(x) ? " " : "", ag_tensor_meta_str(x, b, sizeof b)),
               NULL;
    }
    bool prev = ag_set_grad_enabled(false);
    ag_scope_begin();
    ag_tensor *scale =
        ag_div_scalar(ag_clamp(ag_amax(ag_abs(x), NULL, 0, false), 1e-12, NAN), 127.0);
    ag_tensor *y = ag_div(x, scale);
    /* round half away from zero, then clamp; the int8 conversion truncates */
    y = ag_clamp(ag_add(y, ag_mul_scalar(ag_sign(y), 0.5)), -127.0, 127.0);
    ag_tensor *q = ag_to_dtype(y, AG_I8);
    if (scale && ag_tensor_dtype(scale) != AG_F32)
        scale = ag_to_dtype(scale, AG_F32);
    sq_meta m = {ag_tensor_dtype(x)};
    ag_tensor *r = q && scale ? ag_tensor_keep(ag_subclass_new(&sq_type, m.dtype, ag_tensor_ndim(x),
                                                               ag_tensor_sizes(x), NULL,
                                                               (ag_tensor *[]){q, scale}, &m))
                              : NULL;
    ag_scope_end();
    ag_set_grad_enabled(prev);
    return r ? ag__give(r) : NULL;
}

ag_tensor *ag_scaled_int8_dequantize(ag_tensor *t) {
    if (ag_tensor_subclass(t) != &sq_type) {
        if (t || !ag__has_error())
            ag__err(AG_EINVAL, "scaled_int8_dequantize: not a ScaledInt8Tensor");
        return NULL;
    }
    ag_tensor *inner[AG_SUBCLASS_MAX_INNER];
    const void *meta;
    ag_subclass_flatten(t, inner, &meta);
    ag_dtype dt = ((const sq_meta *)meta)->dtype;
    ag_scope_begin();
    ag_tensor *s = dt == AG_F32 ? inner[1] : ag_to_dtype(inner[1], dt);
    ag_tensor *r = ag_tensor_keep(ag_mul(ag_to_dtype(inner[0], dt), s));
    ag_scope_end();
    return r ? ag__give(r) : NULL;
}

/* ---- the registry: types found by name (a saved joint names its types) ---- */

static pthread_mutex_t reg_lock = PTHREAD_MUTEX_INITIALIZER;
static const ag_subclass_type **reg; /* the registered types, never freed */
static int64_t nreg, capreg;

static const ag_subclass_type *find_locked(const char *name) {
    const ag_subclass_type *const builtin[] = {&two_type, &sq_type};
    for (size_t i = 0; i < sizeof builtin / sizeof builtin[0]; i++)
        if (!strcmp(builtin[i]->name, name))
            return builtin[i];
    for (int64_t i = 0; i < nreg; i++)
        if (!strcmp(reg[i]->name, name))
            return reg[i];
    return NULL;
}

int ag_subclass_type_register(const ag_subclass_type *type) {
    AG__CHECK_NULL("subclass_type_register", type);
    if (!type->name || !type->name[0])
        return ag__err(AG_EINVAL, "subclass_type_register: the type has no name");
    pthread_mutex_lock(&reg_lock);
    const ag_subclass_type *have = find_locked(type->name);
    int rc = 0;
    if (have && have != type)
        rc = ag__err(AG_EINVAL, "subclass_type_register: another type is registered as '%s'",
                     type->name);
    else if (!have && ag__grow((void **)&reg, &capreg, nreg + 1, sizeof *reg))
        rc = AG_ENOMEM;
    else if (!have)
        reg[nreg++] = type;
    pthread_mutex_unlock(&reg_lock);
    return rc;
}

const ag_subclass_type *ag_subclass_type_find(const char *name) {
    if (!name)
        return NULL;
    pthread_mutex_lock(&reg_lock);
    const ag_subclass_type *t = find_locked(name);
    pthread_mutex_unlock(&reg_lock);
    return t;
}
