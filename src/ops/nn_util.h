/* Helpers shared by the neural-network op files (norm.c, nn_ops.c): optional-argument access,
 * shape checks with messages that name the op, packing of non-contiguous inputs for kernels,
 * cost helpers, and multi-output entry-point plumbing. Private to src/ops. */
#ifndef AG_NN_UTIL_H
#define AG_NN_UTIL_H

#include "../core/kernel_util.h"

/* The tensor of an optional argument (None, or a tensor not saved for backward: NULL). */
static inline ag_tensor *targ(const ag_arg *a) {
    return a->kind == AG_ARG_TENSOR ? a->u.t : NULL;
}

/* Element [0, ...] of t as an untyped pointer (ag__base gives char *). */
static inline void *data_of(const ag_tensor *t) {
    return ag__base(t);
}

static inline char *shape_str(const ag_tensor *t, char *buf, size_t n) {
    return ag__fmt_sizes(buf, n, t->ndim, t->sizes);
}

static inline bool same_sizes(int na, const int64_t *a, int nb, const int64_t *b) {
    return na == nb && (na == 0 || !memcmp(a, b, sizeof(int64_t) * (size_t)na));
}

/* An output that an output_mask did not ask for: ATen returns an undefined tensor there; we
 * return an empty one of shape [0]. */
static inline void meta_unused(ag_tmeta *m, ag_dtype dt) {
    int64_t zero = 0;
    ag__tmeta_contiguous(m, dt, 1, &zero);
}

/* t's elements in row-major order: t's own data when contiguous, else a packed copy in *tmp
 * over per-thread scratch slot `slot` (nothing to free; each operand a kernel packs takes its
 * own slot, see src/core/scratch.c). NULL (error set) when the copy cannot be made. */
static inline const void *pack(ag_tensor *t, ag__scratch_tensor *tmp, int slot) {
    const ag_tensor *c;
    if (ag__scratch_contiguous(tmp, slot, t, &c))
        return NULL;
    return data_of(c);
}

/* Checks that an optional per-feature tensor (weight, bias, running stats) has `ndim` sizes
 * equal to `sizes` and the input's dtype. */
static inline int check_param(const char *op, const char *name, const ag_tensor *p, ag_dtype dt,
                              int ndim, const int64_t *sizes) {
    if (!p)
        return 0;
    char a[128], b[128];
    if (!same_sizes(p->ndim, p->sizes, ndim, sizes))
        return ag__err(AG_EINVAL, "%s: %s has shape %s, expected %s", op, name,
                       shape_str(p, a, sizeof a), ag__fmt_sizes(b, sizeof b, ndim, sizes));
    if (p->dtype != dt)
        return ag__err(AG_EINVAL, "%s: %s has dtype %s, expected %s like the input", op, name,
                       ag_dtype_short(p->dtype), ag_dtype_short(dt));
    return 0;
}

static inline int check_float(const char *op, const char *name, const ag_tensor *t) {
    if (!ag_dtype_is_float(t->dtype))
        return ag__err(AG_EINVAL, "%s: %s must be float32 or float64, got %s", op, name,
                       ag_dtype_short(t->dtype));
    return 0;
}

static inline double tensor_bytes(const ag_tensor *t) {
    return t ? (double)ag_tensor_numel(t) * (double)ag_dtype_size(t->dtype) : 0;
}

/* Bytes read (the tensor arguments among the first nargs) plus bytes written (the outputs). */
static inline double io_bytes(const ag_arg *a, int nargs, const ag_tmeta *o, int nouts) {
    double b = 0;
    for (int i = 0; i < nargs; i++)
        if (a[i].kind == AG_ARG_TENSOR)
            b += tensor_bytes(a[i].u.t);
    for (int k = 0; k < nouts; k++)
        b += (double)ag__numel(o[k].ndim, o[k].sizes) * (double)ag_dtype_size(o[k].dtype);
    return b;
}

/* Stores a multi-output call's results in the non-NULL destinations and drops the others
 * (outside a scope the caller owns them, so unwanted ones are released here). */
static inline int call_outs(const ag_op *op, const ag_arg *args, int nargs, ag_tensor **const *dst,
                            int nouts) {
    ag_tensor *r[AG_MAX_OUTPUTS] = {0};
    int rc = ag__calln(op, args, nargs, r, nouts);
    for (int i = 0; i < nouts; i++) {
        if (dst[i])
            *dst[i] = rc < 0 ? NULL : r[i];
        else if (rc >= 0 && !ag__in_scope())
            ag_tensor_free(r[i]);
    }
    return rc < 0 ? rc : 0;
}

/* Per-channel parameters (weight, bias, running stats, class weights), read through their
 * stride since they may be views. */
typedef struct chan {
    char *p;
    int64_t stride;
} chan;

static inline chan chan_of(ag_tensor *t) {
    return t ? (chan){data_of(t), t->strides[0]} : (chan){NULL, 0};
}

#endif
