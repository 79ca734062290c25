/* Helpers for CPU kernels: a strided N-operand iterator with broadcasting and dimension
 * coalescing, typed dispatch macros, and the OpenMP threshold.
 *
 * Usage (out = a + b, any strides, broadcasting):
 *     ag__iter it;
 *     ag_tensor *ops[3] = {out, a, b};
 *     ag__iter_build(&it, ops, 3);     // out's shape; inputs broadcast to it
 *     AG__ITER_ROWS(it, {
 *         float *o = (float *)it.base[0] + off[0];
 *         const float *x = (const float *)it.base[1] + off[1];
 *         const float *y = (const float *)it.base[2] + off[2];
 *         const int64_t so = it.inner_stride[0], sx = it.inner_stride[1], sy = ...;
 *         for (int64_t k = 0; k < len; k++) o[k * so] = x[k * sx] + y[k * sy];
 *     });
 * Rows (all dims but the innermost after coalescing) are split across OpenMP threads when the
 * tensor is large. When every inner stride is 1 (it.inner_contig) the inner loop vectorizes. */
#ifndef AG_KERNEL_UTIL_H
#define AG_KERNEL_UTIL_H

#include "internal.h"

#define AG__ITER_MAX 6
/* Elements per parallel region below which kernels stay single-threaded. */
#define AG__PAR_MIN 32768

typedef struct ag__iter {
    int n;    /* operands; 0 is the output */
    int ndim; /* after coalescing, >= 1 */
    int64_t sizes[AG_MAX_DIMS];
    int64_t strides[AG__ITER_MAX][AG_MAX_DIMS];
    char *base[AG__ITER_MAX];
    int64_t numel;
    int64_t rows;  /* numel / inner */
    int64_t inner; /* size of the innermost dim */
    int64_t inner_stride[AG__ITER_MAX];
    bool inner_contig; /* all inner strides are 1 */
} ag__iter;

/* ops[0] defines the shape; the others must broadcast to it (the meta function checked). */
void ag__iter_build(ag__iter *it, ag_tensor *const *ops, int n);
/* Element offsets (in elements, not bytes) of row r for every operand. */
void ag__iter_row_offsets(const ag__iter *it, int64_t r, int64_t *off);

#define AG__ITER_ROWS(it, ...)                                                                     \
    do {                                                                                           \
        const int64_t ag__rows = (it).rows;                                                        \
        const int ag__par = (it).numel >= AG__PAR_MIN && ag__rows > 1;                             \
        _Pragma("omp parallel for schedule(static) if (ag__par)") for (int64_t ag__r = 0;          \
                                                                       ag__r < ag__rows;           \
                                                                       ag__r++) {                  \
            int64_t off[AG__ITER_MAX];                                                             \
            ag__iter_row_offsets(&(it), ag__r, off);                                               \
            const int64_t len = (it).inner;                                                        \
            (void)len;                                                                             \
            __VA_ARGS__                                                                            \
        }                                                                                          \
    } while (0)

/* A loop over i in [0, n) whose body calls BLAS (or anything else that opens OpenMP regions):
 * on the team when `par`, else as a plain loop on the calling thread, with `pragma` the OpenMP
 * directive as a string ("omp parallel for schedule(static)").
 *
 * Never put `#pragma omp parallel ... if (cond)` around such a body. A false `if` still opens a
 * team of one thread, and the BLAS call's own parallel region inside it is then nested: libgomp
 * serves nested teams from no pool, so every GEMM started and ended a thread of its own while the
 * pool's idle thread kept spinning (libgomp's default wait policy) on the other core. On two
 * cores the GEMM's second half then shared a core with that spinner: the mlp step's GEMMs ran
 * 2.4x slower than the same GEMMs alone (docs/PERFORMANCE.md, "Threads"). */
#define AG__BLAS_FOR(par, pragma, i, n, ...)                                                       \
    do {                                                                                           \
        const int64_t ag__n = (n);                                                                 \
        if (par) {                                                                                 \
            _Pragma(pragma) for (int64_t i = 0; i < ag__n; i++) {                                  \
                __VA_ARGS__                                                                        \
            }                                                                                      \
        } else {                                                                                   \
            for (int64_t i = 0; i < ag__n; i++) {                                                  \
                __VA_ARGS__                                                                        \
            }                                                                                      \
        }                                                                                          \
    } while (0)

/* Double -> integral conversions. C leaves a cast of NaN, an infinity or a value outside the
 * target's range undefined, so every scalar argument (fill values, alpha, exponents, clamp
 * bounds) and every float element converted to int64 or int8 is checked first. Float and bool
 * targets take anything. */
static inline bool ag__fits_dtype(double v, ag_dtype dt) {
    if (dt == AG_I64)
        return v >= -0x1p63 && v < 0x1p63; /* false for NaN */
    if (dt == AG_I8)
        return v > -129.0 && v < 128.0;
    return true;
}
/* 0, or AG_EINVAL "<op>: value <v> cannot be converted to type int64 without overflow"
 * (PyTorch's wording) when v does not fit dt. */
int ag__check_fits(const char *op, double v, ag_dtype dt);

/* int64 arithmetic that wraps (two's complement, computed in uint64) instead of overflowing:
 * signed overflow is undefined in C; PyTorch's integer tensors wrap. */
static inline int64_t ag__wadd(int64_t a, int64_t b) {
    return (int64_t)((uint64_t)a + (uint64_t)b);
}
static inline int64_t ag__wsub(int64_t a, int64_t b) {
    return (int64_t)((uint64_t)a - (uint64_t)b);
}
static inline int64_t ag__wmul(int64_t a, int64_t b) {
    return (int64_t)((uint64_t)a * (uint64_t)b);
}

/* Typed dispatch: runs the statement list with `T` typedef'd to the C type of dt. FLOAT covers
 * f32/f64, NUM adds i64, ALL adds bool; other dtypes return AG_ENOTSUP from the enclosing
 * function. */
#define AG__CASE(dtv, CT, T, ...)                                                                  \
    case dtv: {                                                                                    \
        typedef CT T;                                                                              \
        __VA_ARGS__;                                                                               \
        break;                                                                                     \
    }
#define AG__BAD_DTYPE(dt)                                                                          \
    default:                                                                                       \
        return ag__err(AG_ENOTSUP, "kernel: dtype %s not supported", ag_dtype_short(dt));
#define AG__FLOAT_SWITCH(dt, T, ...)                                                               \
    switch (dt) {                                                                                  \
        AG__CASE(AG_F32, float, T, __VA_ARGS__)                                                    \
        AG__CASE(AG_F64, double, T, __VA_ARGS__)                                                   \
        AG__BAD_DTYPE(dt)                                                                          \
    }
#define AG__NUM_SWITCH(dt, T, ...)                                                                 \
    switch (dt) {                                                                                  \
        AG__CASE(AG_F32, float, T, __VA_ARGS__)                                                    \
        AG__CASE(AG_F64, double, T, __VA_ARGS__)                                                   \
        AG__CASE(AG_I64, int64_t, T, __VA_ARGS__)                                                  \
        AG__BAD_DTYPE(dt)                                                                          \
    }
#define AG__ALL_SWITCH(dt, T, ...)                                                                 \
    switch (dt) {                                                                                  \
        AG__CASE(AG_F32, float, T, __VA_ARGS__)                                                    \
        AG__CASE(AG_F64, double, T, __VA_ARGS__)                                                   \
        AG__CASE(AG_I64, int64_t, T, __VA_ARGS__)                                                  \
        AG__CASE(AG_BOOL, bool, T, __VA_ARGS__)                                                    \
        AG__BAD_DTYPE(dt)                                                                          \
    }
/* Every dtype, int8 included (copies and dtype conversions only: int8 has no arithmetic). */
#define AG__COPY_SWITCH(dt, T, ...)                                                                \
    switch (dt) {                                                                                  \
        AG__CASE(AG_F32, float, T, __VA_ARGS__)                                                    \
        AG__CASE(AG_F64, double, T, __VA_ARGS__)                                                   \
        AG__CASE(AG_I64, int64_t, T, __VA_ARGS__)                                                  \
        AG__CASE(AG_BOOL, bool, T, __VA_ARGS__)                                                    \
        AG__CASE(AG_I8, int8_t, T, __VA_ARGS__)                                                    \
        AG__BAD_DTYPE(dt)                                                                          \
    }

#endif
