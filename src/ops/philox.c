/* Functional random ops: philox_rand and philox_randn draw from a generator state passed in
 * explicitly as two 0-dim int64 tensors (seed, offset) instead of reading and advancing the
 * thread's default generator (src/core/rng_state.c). They are pure functions of their inputs, so
 * they are not flagged random: CSE, DCE and the min-cut partitioner may treat them like any other
 * recomputable op, and a recomputation gives the same numbers.
 *
 * The joint export (src/export/rng_functionalize.c) records every random draw of a traced model as
 * one of these ops (upstream's functionalize_rng_ops with its philox_rand prim). Both draw with
 * ag__philox_fill, the very code the eager random ops (rand, randn, uniform_, normal_ in
 * factory.c) run after reserving their counters, so philox_rand(size, seed, offset, low, high)
 * is bit-identical to what eager's uniform draw gives with the generator at (seed, offset); a
 * draw of n values uses counters offset .. offset+n-1.
 *
 *   philox_rand(size, seed, offset, low=0, high=1, *, dtype)  U[low, high): low + (high-low) u
 *   philox_randn(size, seed, offset, mean=0, std=1, *, dtype) N(mean, std^2): mean + std z
 * The affine parameters exist so that uniform_ and normal_ have a functional form computing
 * exactly eager's arithmetic. dtype is float32 (default) or float64. */
#include "../core/kernel_util.h"
#include "family.h"

/* ---- the fill shared with the eager random ops ---- */

int ag__philox_fill(ag_tensor *t, uint64_t seed, uint64_t offset, bool normal, double lo,
                    double hi) {
    int64_t n = ag_tensor_numel(t);
    if (t->dtype == AG_F32) {
        float *p = (float *)ag__base(t);
        if (normal)
            ag__philox_normal_f32(seed, offset, n, p);
        else
            ag__philox_uniform_f32(seed, offset, n, p);
        if (lo != 0.0 || hi != 1.0)
            for (int64_t i = 0; i < n; i++)
                p[i] = (float)(normal ? lo + hi * p[i] : lo + (hi - lo) * p[i]);
    } else if (t->dtype == AG_F64) {
        double *p = (double *)ag__base(t);
        if (normal)
            ag__philox_normal_f64(seed, offset, n, p);
        else
            ag__philox_uniform_f64(seed, offset, n, p);
        if (lo != 0.0 || hi != 1.0)
            for (int64_t i = 0; i < n; i++)
                p[i] = normal ? lo + hi * p[i] : lo + (hi - lo) * p[i];
    } else {
        return ag__err(AG_ENOTSUP, "random: dtype %s not supported", ag_dtype_short(t->dtype));
    }
    return 0;
}

/* ---- philox_rand / philox_randn ---- */

/* a: size, seed, offset, low|mean, high|std, dtype. */
static int philox_meta(const char *op, const ag_arg *a, ag_tmeta *o) {
    const ag_arg *sz = &a[0];
    int rc = ag__sizes_check(op, sz);
    if (rc)
        return rc;
    static const char *const names[] = {"seed", "offset"};
    for (int k = 0; k < 2; k++) {
        const ag_tensor *t = a[1 + k].u.t;
        if (t->dtype != AG_I64 || t->ndim != 0) {
            char b[128];
            return ag__err(AG_EINVAL, "%s: %s must be a 0-dim int64 tensor, got %s", op, names[k],
                           ag_tensor_meta_str(t, b, sizeof b));
        }
    }
    ag_dtype dt = a[5].kind == AG_ARG_DTYPE ? a[5].u.dt : AG_F32;
    if (dt != AG_F32 && dt != AG_F64)
        return ag__err(AG_EINVAL, "%s: dtype %s is not supported (float32 or float64)", op,
                       ag_dtype_short(dt));
    ag__tmeta_contiguous(o, dt, sz->n, sz->u.ints);
    return 0;
}

static int philox_kernel(const ag_arg *a, ag_tensor **o, bool normal) {
    uint64_t seed = (uint64_t) * (const int64_t *)ag__base(a[1].u.t);
    uint64_t offset = (uint64_t) * (const int64_t *)ag__base(a[2].u.t);
    return ag__philox_fill(o[0], seed, offset, normal, a[3].u.f, a[4].u.f);
}

static int rand_meta(const ag_arg *a, ag_tmeta *o) {
    return philox_meta("philox_rand", a, o);
}
static int randn_meta(const ag_arg *a, ag_tmeta *o) {
    return philox_meta("philox_randn", a, o);
}
static int rand_kernel(const ag_arg *a, ag_tensor **o) {
    return philox_kernel(a, o, false);
}
static int randn_kernel(const ag_arg *a, ag_tensor **o) {
    return philox_kernel(a, o, true);
}

/* The dispatcher checks `dtypes` against the first tensor argument, here the int64 seed; the
 * output dtype is checked by the meta function. */
static const ag_opdef op_philox_rand = {
    .schema = "philox_rand(SymInt[] size, Tensor seed, Tensor offset, float low=0, float high=1, "
              "*, ScalarType? dtype=None) -> Tensor",
    .flags = AG_OP_NONDIFF,
    .meta = rand_meta,
    .kernel = rand_kernel,
    .dtypes = 1u << AG_I64,
};
static const ag_opdef op_philox_randn = {
    .schema = "philox_randn(SymInt[] size, Tensor seed, Tensor offset, float mean=0, float std=1, "
              "*, ScalarType? dtype=None) -> Tensor",
    .flags = AG_OP_NONDIFF,
    .meta = randn_meta,
    .kernel = randn_kernel,
    .dtypes = 1u << AG_I64,
};

ag_tensor *ag_philox_rand(ag_tensor *seed, ag_tensor *offset, ag_dtype dt, int ndim,
                          const int64_t *sizes, double low, double high) {
    AG__OP(op, "philox_rand");
    return ag__call1(op,
                     (ag_arg[]){AG_A_INTS(sizes, ndim), AG_A_T(seed), AG_A_T(offset), AG_A_F(low),
                                AG_A_F(high), AG_A_DT(dt)},
                     6);
}

ag_tensor *ag_philox_randn(ag_tensor *seed, ag_tensor *offset, ag_dtype dt, int ndim,
                           const int64_t *sizes, double mean, double std) {
    AG__OP(op, "philox_randn");
    return ag__call1(op,
                     (ag_arg[]){AG_A_INTS(sizes, ndim), AG_A_T(seed), AG_A_T(offset), AG_A_F(mean),
                                AG_A_F(std), AG_A_DT(dt)},
                     6);
}

const ag_opdef *const ag__ops_philox[] = {
    &op_philox_rand,
    &op_philox_randn,
    NULL,
};
