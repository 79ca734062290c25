/* Factory ops: tensors made from sizes and values rather than from input data (empty, zeros,
 * ones, full, arange, scalar_tensor, the *_like forms), random tensors drawn from the Philox
 * generator (rand, randn, uniform_, normal_), and ag_from_data, which copies caller memory into
 * a new leaf. Factories never require grad. */
#include "../core/kernel_util.h"
#include "family.h"
#include "shard_rules.h"

#include <math.h>

static ag_dtype dtype_or(const ag_arg *a, ag_dtype def) {
    return a->kind == AG_ARG_DTYPE ? a->u.dt : def;
}

int ag__sizes_check(const char *op, const ag_arg *sz) {
    if (sz->n > AG_MAX_DIMS)
        return ag__err(AG_EINVAL, "%s: %d dimensions (at most %d)", op, sz->n, AG_MAX_DIMS);
    for (int i = 0; i < sz->n; i++)
        if (sz->u.ints[i] < 0)
            return ag__err(AG_EINVAL, "%s: negative size %lld in dim %d", op,
                           (long long)sz->u.ints[i], i);
    return 0;
}

/* Fills every element of a contiguous tensor with v. */
static int fill_value(ag_tensor *t, double v) {
    int rc = ag__check_fits("full", v, t->dtype);
    if (rc)
        return rc;
    int64_t n = ag_tensor_numel(t);
    const int par = n > AG__PAR_MIN;
    AG__ALL_SWITCH(t->dtype, T, {
        T *p = (T *)ag__base(t);
        T x = (T)v;
        _Pragma("omp parallel for schedule(static) if (par)") for (int64_t i = 0; i < n; i++) p[i] =
            x;
    });
    return 0;
}

/* ---- empty / zeros / ones / full (sizes first) ---- */

static int sized_meta(const char *op, const ag_arg *sz, ag_dtype dt, ag_tmeta *o) {
    int rc = ag__sizes_check(op, sz);
    if (rc)
        return rc;
    ag__tmeta_contiguous(o, dt, sz->n, sz->u.ints);
    return 0;
}

static int empty_meta(const ag_arg *a, ag_tmeta *o) {
    return sized_meta("empty", &a[0], dtype_or(&a[1], AG_F32), o);
}
static int zeros_meta(const ag_arg *a, ag_tmeta *o) {
    return sized_meta("zeros", &a[0], dtype_or(&a[1], AG_F32), o);
}
static int ones_meta(const ag_arg *a, ag_tmeta *o) {
    return sized_meta("ones", &a[0], dtype_or(&a[1], AG_F32), o);
}
static int full_meta(const ag_arg *a, ag_tmeta *o) {
    return sized_meta("full", &a[0], dtype_or(&a[2], AG_F32), o);
}

/* empty memory is zeroed anyway: reproducible results and quiet memory checkers. */
static int zero_kernel(const ag_arg *a, ag_tensor **o) {
    return fill_value(o[0], 0.0);
}
static int one_kernel(const ag_arg *a, ag_tensor **o) {
    return fill_value(o[0], 1.0);
}
static int full_kernel(const ag_arg *a, ag_tensor **o) {
    return fill_value(o[0], a[1].u.f);
}

#define AG_FACTORY (AG_OP_FACTORY | AG_OP_NONDIFF)

static const ag_opdef op_empty = {
    .schema = "empty.memory_format(SymInt[] size, *, ScalarType? dtype=None) -> Tensor",
    .flags = AG_FACTORY,
    .meta = empty_meta,
    .kernel = zero_kernel,
    .dtypes = AG_DT_ALL,
    .shard = ag__shard_factory,
};
static const ag_opdef op_zeros = {
    .schema = "zeros(SymInt[] size, *, ScalarType? dtype=None) -> Tensor",
    .flags = AG_FACTORY,
    .meta = zeros_meta,
    .kernel = zero_kernel,
    .dtypes = AG_DT_ALL,
    .shard = ag__shard_factory,
};
static const ag_opdef op_ones = {
    .schema = "ones(SymInt[] size, *, ScalarType? dtype=None) -> Tensor",
    .flags = AG_FACTORY,
    .meta = ones_meta,
    .kernel = one_kernel,
    .dtypes = AG_DT_ALL,
    .shard = ag__shard_factory,
};
static const ag_opdef op_full = {
    .schema = "full(SymInt[] size, Scalar fill_value, *, ScalarType? dtype=None) -> Tensor",
    .flags = AG_FACTORY,
    .meta = full_meta,
    .kernel = full_kernel,
    .dtypes = AG_DT_ALL,
    .shard = ag__shard_factory,
};

ag_tensor *ag_empty(ag_dtype dt, int ndim, const int64_t *sizes) {
    AG__OP(op, "empty.memory_format");
    return ag__call1(op, (ag_arg[]){AG_A_INTS(sizes, ndim), AG_A_DT(dt)}, 2);
}
ag_tensor *ag_zeros(ag_dtype dt, int ndim, const int64_t *sizes) {
    AG__OP(op, "zeros");
    return ag__call1(op, (ag_arg[]){AG_A_INTS(sizes, ndim), AG_A_DT(dt)}, 2);
}
ag_tensor *ag_ones(ag_dtype dt, int ndim, const int64_t *sizes) {
    AG__OP(op, "ones");
    return ag__call1(op, (ag_arg[]){AG_A_INTS(sizes, ndim), AG_A_DT(dt)}, 2);
}
ag_tensor *ag_full(ag_dtype dt, int ndim, const int64_t *sizes, double value) {
    AG__OP(op, "full");
    return ag__call1(op, (ag_arg[]){AG_A_INTS(sizes, ndim), AG_A_F(value), AG_A_DT(dt)}, 3);
}

/* ---- *_like ---- */

static int like_meta(const ag_arg *a, ag_tmeta *o, int dt_arg) {
    const ag_tensor *t = a[0].u.t;
    ag__tmeta_contiguous(o, dtype_or(&a[dt_arg], t->dtype), t->ndim, t->sizes);
    return 0;
}
static int zeros_like_meta(const ag_arg *a, ag_tmeta *o) {
    return like_meta(a, o, 1);
}
static int full_like_meta(const ag_arg *a, ag_tmeta *o) {
    return like_meta(a, o, 2);
}

static const ag_opdef op_zeros_like = {
    .schema = "zeros_like(Tensor self, *, ScalarType? dtype=None) -> Tensor",
    .flags = AG_FACTORY,
    .meta = zeros_like_meta,
    .kernel = zero_kernel,
    .dtypes = AG_DT_ALL,
    .shard = ag__shard_factory,
};
static const ag_opdef op_ones_like = {
    .schema = "ones_like(Tensor self, *, ScalarType? dtype=None) -> Tensor",
    .flags = AG_FACTORY,
    .meta = zeros_like_meta,
    .kernel = one_kernel,
    .dtypes = AG_DT_ALL,
    .shard = ag__shard_factory,
};
static const ag_opdef op_full_like = {
    .schema = "full_like(Tensor self, Scalar fill_value, *, ScalarType? dtype=None) -> Tensor",
    .flags = AG_FACTORY,
    .meta = full_like_meta,
    .kernel = full_kernel,
    .dtypes = AG_DT_ALL,
    .shard = ag__shard_factory,
};

ag_tensor *ag_zeros_like(ag_tensor *a) {
    AG__OP(op, "zeros_like");
    return ag__call1(op, (ag_arg[]){AG_A_T(a)}, 1);
}
ag_tensor *ag_ones_like(ag_tensor *a) {
    AG__OP(op, "ones_like");
    return ag__call1(op, (ag_arg[]){AG_A_T(a)}, 1);
}
ag_tensor *ag_full_like(ag_tensor *a, double v) {
    AG__OP(op, "full_like");
    return ag__call1(op, (ag_arg[]){AG_A_T(a), AG_A_F(v)}, 2);
}

/* ---- scalar_tensor, arange ---- */

static int scalar_meta(const ag_arg *a, ag_tmeta *o) {
    ag__tmeta_contiguous(o, dtype_or(&a[1], AG_F32), 0, NULL);
    return 0;
}
static int scalar_kernel(const ag_arg *a, ag_tensor **o) {
    return fill_value(o[0], a[0].u.f);
}

static const ag_opdef op_scalar_tensor = {
    .schema = "scalar_tensor(Scalar s, *, ScalarType? dtype=None) -> Tensor",
    .flags = AG_FACTORY,
    .meta = scalar_meta,
    .kernel = scalar_kernel,
    .dtypes = AG_DT_ALL,
    .shard = ag__shard_factory,
};

ag_tensor *ag_scalar_tensor(ag_dtype dt, double value) {
    AG__OP(op, "scalar_tensor");
    return ag__call1(op, (ag_arg[]){AG_A_F(value), AG_A_DT(dt)}, 2);
}

static int arange_meta(const ag_arg *a, ag_tmeta *o) {
    double start = a[0].u.f, end = a[1].u.f, step = a[2].u.f;
    if (step == 0 || !isfinite(start) || !isfinite(end) || !isfinite(step))
        return ag__err(AG_EINVAL,
                       "arange: step must be nonzero and bounds finite (start %g, end "
                       "%g, step %g)",
                       start, end, step);
    if ((end - start) / step < 0)
        return ag__err(AG_EINVAL,
                       "arange: upper bound %g and lower bound %g inconsistent with "
                       "step sign %g",
                       end, start, step);
    double count = ceil((end - start) / step);
    if (!(count <= (double)AG__MAX_NUMEL))
        return ag__err(AG_EINVAL, "arange: %g elements (start %g, end %g, step %g) is too many",
                       count, start, end, step);
    int64_t n = (int64_t)count;
    ag_dtype dt = dtype_or(&a[3], AG_I64);
    /* every value start + i * step must convert to dt (the last one is the extreme) */
    int rc = n ? ag__check_fits("arange", start, dt) : 0;
    if (!rc && n)
        rc = ag__check_fits("arange", start + (double)(n - 1) * step, dt);
    if (rc)
        return rc;
    ag__tmeta_contiguous(o, dt, 1, &n);
    return 0;
}

static int arange_kernel(const ag_arg *a, ag_tensor **o) {
    double start = a[0].u.f, step = a[2].u.f;
    int64_t n = o[0]->sizes[0];
    AG__ALL_SWITCH(o[0]->dtype, T, {
        T *p = (T *)o[0]->storage->data;
        for (int64_t i = 0; i < n; i++)
            p[i] = (T)(start + (double)i * step);
    });
    return 0;
}

static const ag_opdef op_arange = {
    .schema = "arange.start_step(Scalar start, Scalar end, Scalar step=1, *, ScalarType? "
              "dtype=None) -> Tensor",
    .flags = AG_FACTORY,
    .meta = arange_meta,
    .kernel = arange_kernel,
    .dtypes = (1u << AG_F32) | (1u << AG_F64) | (1u << AG_I64),
    .shard = ag__shard_factory,
};

ag_tensor *ag_arange(ag_dtype dt, double start, double end, double step) {
    AG__OP(op, "arange.start_step");
    return ag__call1(op, (ag_arg[]){AG_A_F(start), AG_A_F(end), AG_A_F(step), AG_A_DT(dt)}, 4);
}

/* ---- random ---- */

/* Reserves the tensor's counters from the generator and fills it (contiguous) from them with
 * the fill philox_rand shares (philox.c), so a functional draw reproduces it exactly. */
static int draw(ag_tensor *t, bool normal, double lo, double hi) {
    uint64_t seed, offset;
    ag__rng_reserve(ag_tensor_numel(t), &seed, &offset);
    return ag__philox_fill(t, seed, offset, normal, lo, hi);
}

static int rand_meta(const ag_arg *a, ag_tmeta *o) {
    return sized_meta("rand", &a[0], dtype_or(&a[1], AG_F32), o);
}
static int rand_kernel(const ag_arg *a, ag_tensor **o) {
    return draw(o[0], false, 0, 1);
}
static int randn_kernel(const ag_arg *a, ag_tensor **o) {
    return draw(o[0], true, 0, 1);
}

static const ag_opdef op_rand = {
    .schema = "rand(SymInt[] size, *, ScalarType? dtype=None) -> Tensor",
    .flags = AG_FACTORY | AG_OP_RANDOM,
    .meta = rand_meta,
    .kernel = rand_kernel,
    .dtypes = AG_DT_FLOAT,
    .shard = ag__shard_factory,
};
static const ag_opdef op_randn = {
    .schema = "randn(SymInt[] size, *, ScalarType? dtype=None) -> Tensor",
    .flags = AG_FACTORY | AG_OP_RANDOM,
    .meta = rand_meta,
    .kernel = randn_kernel,
    .dtypes = AG_DT_FLOAT,
    .shard = ag__shard_factory,
};

ag_tensor *ag_rand(ag_dtype dt, int ndim, const int64_t *sizes) {
    AG__OP(op, "rand");
    return ag__call1(op, (ag_arg[]){AG_A_INTS(sizes, ndim), AG_A_DT(dt)}, 2);
}
ag_tensor *ag_randn(ag_dtype dt, int ndim, const int64_t *sizes) {
    AG__OP(op, "randn");
    return ag__call1(op, (ag_arg[]){AG_A_INTS(sizes, ndim), AG_A_DT(dt)}, 2);
}

/* In-place initializers: draw into a contiguous scratch, then copy into (possibly strided) self. */
static int inplace_draw(ag_tensor *self, bool normal, double p0, double p1) {
    if (ag_tensor_is_contiguous(self))
        return draw(self, normal, p0, p1);
    ag_tensor *tmp = ag__tensor_new(self->dtype, self->ndim, self->sizes, false);
    if (!tmp)
        return AG_ENOMEM;
    int rc = draw(tmp, normal, p0, p1);
    if (!rc)
        rc = ag__copy_into(self, tmp);
    ag_tensor_free(tmp);
    return rc;
}

static int self_meta(const ag_arg *a, ag_tmeta *o) {
    ag__tmeta_of(a[0].u.t, o);
    return 0;
}
static int uniform_kernel(const ag_arg *a, ag_tensor **o) {
    return inplace_draw(o[0], false, a[1].u.f, a[2].u.f);
}
static int normal_kernel(const ag_arg *a, ag_tensor **o) {
    return inplace_draw(o[0], true, a[1].u.f, a[2].u.f);
}

static const ag_opdef op_uniform_ = {
    .schema = "uniform_(Tensor(a!) self, float from=0, float to=1) -> Tensor(a!)",
    .flags = AG_OP_INPLACE | AG_OP_RANDOM | AG_OP_NONDIFF,
    .meta = self_meta,
    .kernel = uniform_kernel,
    .dtypes = AG_DT_FLOAT,
};
static const ag_opdef op_normal_ = {
    .schema = "normal_(Tensor(a!) self, float mean=0, float std=1) -> Tensor(a!)",
    .flags = AG_OP_INPLACE | AG_OP_RANDOM | AG_OP_NONDIFF,
    .meta = self_meta,
    .kernel = normal_kernel,
    .dtypes = AG_DT_FLOAT,
};

ag_tensor *ag_uniform_(ag_tensor *a, double lo, double hi) {
    AG__OP(op, "uniform_");
    return ag__call1(op, (ag_arg[]){AG_A_T(a), AG_A_F(lo), AG_A_F(hi)}, 3);
}
ag_tensor *ag_normal_(ag_tensor *a, double mean, double std) {
    AG__OP(op, "normal_");
    return ag__call1(op, (ag_arg[]){AG_A_T(a), AG_A_F(mean), AG_A_F(std)}, 3);
}

/* ---- from caller memory (not an op: the data is a constant of the program) ---- */

ag_tensor *ag_from_data(ag_dtype dt, int ndim, const int64_t *sizes, const void *data) {
    if ((unsigned)dt >= AG_NDTYPES)
        return ag__err(AG_EINVAL, "from_data: bad dtype %d", (int)dt), NULL;
    if (ndim > 0)
        AG__CHECK_NULL_RET("from_data", sizes, NULL);
    if (!data && ag__numel(ndim, sizes) > 0)
        return ag__err(AG_EINVAL, "from_data: data is NULL"), NULL;
    ag_tensor *t = ag__tensor_new(dt, ndim, sizes, false);
    if (!t)
        return NULL;
    if (t->storage->nbytes)
        memcpy(t->storage->data, data, t->storage->nbytes);
    return ag__give(t);
}

const ag_opdef *const ag__ops_factory[] = {
    &op_empty,     &op_zeros,     &op_ones,          &op_full,   &op_zeros_like,
    &op_ones_like, &op_full_like, &op_scalar_tensor, &op_arange, &op_rand,
    &op_randn,     &op_uniform_,  &op_normal_,       NULL,
};
