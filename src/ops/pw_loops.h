/* Loop drivers for pointwise kernels: `out[i] = EXPR` over the strided iterator of
 * kernel_util.h for one to three inputs (PW1, PW2, PW3), and the float32 forms that apply a
 * vector function of fastmath.h (PW1V, PW2V).
 *
 * Usage, inside a kernel whose operands already have the computation's dtype:
 *     AG__FLOAT_SWITCH(out->dtype, T, PW2(out, a, b, T, T, T, x * y + (T)1));
 * EXPR sees x (and y, or p, x, y for PW3) as the current elements. Work is split into tasks,
 * rows of the iterator or PW_CHUNK pieces of one long row (contiguous same-shape operands
 * coalesce into a single row), run in parallel with OpenMP when the tensor is large; inner
 * loops have unit-stride (and broadcast) fast paths that GCC vectorizes. */
#ifndef AG_PW_LOOPS_H
#define AG_PW_LOOPS_H

#include "../core/kernel_util.h"
#include "fastmath.h"

#define PW_CHUNK 16384

/* Runs the body for every task (a row of the iterator, or a PW_CHUNK piece of a long row), in
 * parallel when the tensor is large. The body sees off[pw_i], the element offset of operand k at
 * the task's first element, and len, the task's element count. */
#define PW_DRIVE(it, ...)                                                                          \
    do {                                                                                           \
        const int64_t pw_cpr = ((it).inner + PW_CHUNK - 1) / PW_CHUNK;                             \
        const int64_t pw_ntask = (it).rows * pw_cpr;                                               \
        const int pw_par = (it).numel >= AG__PAR_MIN && pw_ntask > 1;                              \
        _Pragma("omp parallel for schedule(static) if (pw_par)") for (int64_t pw_t = 0;            \
                                                                      pw_t < pw_ntask; pw_t++) {   \
            int64_t off[AG__ITER_MAX];                                                             \
            ag__iter_row_offsets(&(it), pw_t / pw_cpr, off);                                       \
            const int64_t pw_b = pw_t % pw_cpr * PW_CHUNK;                                         \
            const int64_t len = (it).inner - pw_b < PW_CHUNK ? (it).inner - pw_b : PW_CHUNK;       \
            for (int pw_k = 0; pw_k < (it).n; pw_k++)                                              \
                off[pw_k] += pw_b * (it).inner_stride[pw_k];                                       \
            __VA_ARGS__                                                                            \
        }                                                                                          \
    } while (0)

/* out[i] = EXPR with x bound to X[i] (types TO, TX). */
#define PW1(OUT, X, TO, TX, EXPR)                                                                  \
    do {                                                                                           \
        ag__iter pw_it;                                                                            \
        ag_tensor *pw_ops[2] = {(OUT), (X)};                                                       \
        ag__iter_build(&pw_it, pw_ops, 2);                                                         \
        const int64_t pw_so = pw_it.inner_stride[0], pw_sx = pw_it.inner_stride[1];                \
        PW_DRIVE(pw_it, {                                                                          \
            TO *pw_o = (TO *)pw_it.base[0] + off[0];                                               \
            const TX *pw_x = (const TX *)pw_it.base[1] + off[1];                                   \
            if (pw_so == 1 && pw_sx == 1)                                                          \
                for (int64_t pw_i = 0; pw_i < len; pw_i++) {                                       \
                    const TX x = pw_x[pw_i];                                                       \
                    (void)x;                                                                       \
                    pw_o[pw_i] = (TO)(EXPR);                                                       \
                }                                                                                  \
            else                                                                                   \
                for (int64_t pw_i = 0; pw_i < len; pw_i++) {                                       \
                    const TX x = pw_x[pw_i * pw_sx];                                               \
                    (void)x;                                                                       \
                    pw_o[pw_i * pw_so] = (TO)(EXPR);                                               \
                }                                                                                  \
        });                                                                                        \
    } while (0)

/* out[i] = EXPR with x = X[i], y = Y[i] after broadcasting. Besides the all-unit-stride loop,
 * a broadcast operand that is constant along the inner dim ((N, C) * (N, 1), t * 0-dim) gets
 * its own vectorizable loop. */
#define PW2(OUT, X, Y, TO, TX, TY, EXPR)                                                           \
    do {                                                                                           \
        ag__iter pw_it;                                                                            \
        ag_tensor *pw_ops[3] = {(OUT), (X), (Y)};                                                  \
        ag__iter_build(&pw_it, pw_ops, 3);                                                         \
        const int64_t pw_so = pw_it.inner_stride[0], pw_sx = pw_it.inner_stride[1],                \
                      pw_sy = pw_it.inner_stride[2];                                               \
        PW_DRIVE(pw_it, {                                                                          \
            TO *pw_o = (TO *)pw_it.base[0] + off[0];                                               \
            const TX *pw_x = (const TX *)pw_it.base[1] + off[1];                                   \
            const TY *pw_y = (const TY *)pw_it.base[2] + off[2];                                   \
            if (pw_so == 1 && pw_sx == 1 && pw_sy == 1) {                                          \
                for (int64_t pw_i = 0; pw_i < len; pw_i++) {                                       \
                    const TX x = pw_x[pw_i];                                                       \
                    const TY y = pw_y[pw_i];                                                       \
                    pw_o[pw_i] = (TO)(EXPR);                                                       \
                }                                                                                  \
            } else if (pw_so == 1 && pw_sx == 1 && pw_sy == 0) {                                   \
                const TY y = *pw_y;                                                                \
                for (int64_t pw_i = 0; pw_i < len; pw_i++) {                                       \
                    const TX x = pw_x[pw_i];                                                       \
                    pw_o[pw_i] = (TO)(EXPR);                                                       \
                }                                                                                  \
            } else if (pw_so == 1 && pw_sx == 0 && pw_sy == 1) {                                   \
                const TX x = *pw_x;                                                                \
                for (int64_t pw_i = 0; pw_i < len; pw_i++) {                                       \
                    const TY y = pw_y[pw_i];                                                       \
                    pw_o[pw_i] = (TO)(EXPR);                                                       \
                }                                                                                  \
            } else {                                                                               \
                for (int64_t pw_i = 0; pw_i < len; pw_i++) {                                       \
                    const TX x = pw_x[pw_i * pw_sx];                                               \
                    const TY y = pw_y[pw_i * pw_sy];                                               \
                    pw_o[pw_i * pw_so] = (TO)(EXPR);                                               \
                }                                                                                  \
            }                                                                                      \
        });                                                                                        \
    } while (0)

/* out[i] = EXPR with p = P[i], x = X[i], y = Y[i] (where). */
#define PW3(OUT, P, X, Y, TO, TP, TX, TY, EXPR)                                                    \
    do {                                                                                           \
        ag__iter pw_it;                                                                            \
        ag_tensor *pw_ops[4] = {(OUT), (P), (X), (Y)};                                             \
        ag__iter_build(&pw_it, pw_ops, 4);                                                         \
        const int64_t pw_so = pw_it.inner_stride[0], pw_sp = pw_it.inner_stride[1],                \
                      pw_sx = pw_it.inner_stride[2], pw_sy = pw_it.inner_stride[3];                \
        PW_DRIVE(pw_it, {                                                                          \
            TO *pw_o = (TO *)pw_it.base[0] + off[0];                                               \
            const TP *pw_p = (const TP *)pw_it.base[1] + off[1];                                   \
            const TX *pw_x = (const TX *)pw_it.base[2] + off[2];                                   \
            const TY *pw_y = (const TY *)pw_it.base[3] + off[3];                                   \
            if (pw_it.inner_contig)                                                                \
                for (int64_t pw_i = 0; pw_i < len; pw_i++) {                                       \
                    const TP p = pw_p[pw_i];                                                       \
                    const TX x = pw_x[pw_i];                                                       \
                    const TY y = pw_y[pw_i];                                                       \
                    pw_o[pw_i] = (TO)(EXPR);                                                       \
                }                                                                                  \
            else                                                                                   \
                for (int64_t pw_i = 0; pw_i < len; pw_i++) {                                       \
                    const TP p = pw_p[pw_i * pw_sp];                                               \
                    const TX x = pw_x[pw_i * pw_sx];                                               \
                    const TY y = pw_y[pw_i * pw_sy];                                               \
                    pw_o[pw_i * pw_so] = (TO)(EXPR);                                               \
                }                                                                                  \
        });                                                                                        \
    } while (0)

/* f32 out[i] = VFN(x[i]) with VFN a vector function of fastmath.h, AG__VW lanes at a time. */
#define PW1V(OUT, X, VFN)                                                                          \
    do {                                                                                           \
        ag__iter pw_it;                                                                            \
        ag_tensor *pw_ops[2] = {(OUT), (X)};                                                       \
        ag__iter_build(&pw_it, pw_ops, 2);                                                         \
        const int64_t pw_so = pw_it.inner_stride[0], pw_sx = pw_it.inner_stride[1];                \
        PW_DRIVE(pw_it, {                                                                          \
            float *pw_o = (float *)pw_it.base[0] + off[0];                                         \
            const float *pw_x = (const float *)pw_it.base[1] + off[1];                             \
            for (int64_t pw_i = 0; pw_i < len; pw_i += AG__VW) {                                   \
                const int64_t pw_n = len - pw_i < AG__VW ? len - pw_i : AG__VW;                    \
                ag__vstore(pw_o + pw_i * pw_so, pw_so, pw_n,                                       \
                           VFN(ag__vload(pw_x + pw_i * pw_sx, pw_sx, pw_n)));                      \
            }                                                                                      \
        });                                                                                        \
    } while (0)

/* f32 out[i] = g[i] * VFN(y[i]) (the backward helpers: grad times a derivative). */
#define PW2V(OUT, G, Y, VFN)                                                                       \
    do {                                                                                           \
        ag__iter pw_it;                                                                            \
        ag_tensor *pw_ops[3] = {(OUT), (G), (Y)};                                                  \
        ag__iter_build(&pw_it, pw_ops, 3);                                                         \
        const int64_t pw_so = pw_it.inner_stride[0], pw_sg = pw_it.inner_stride[1],                \
                      pw_sy = pw_it.inner_stride[2];                                               \
        PW_DRIVE(pw_it, {                                                                          \
            float *pw_o = (float *)pw_it.base[0] + off[0];                                         \
            const float *pw_g = (const float *)pw_it.base[1] + off[1];                             \
            const float *pw_y = (const float *)pw_it.base[2] + off[2];                             \
            for (int64_t pw_i = 0; pw_i < len; pw_i += AG__VW) {                                   \
                const int64_t pw_n = len - pw_i < AG__VW ? len - pw_i : AG__VW;                    \
                ag__vstore(pw_o + pw_i * pw_so, pw_so, pw_n,                                       \
                           ag__vload(pw_g + pw_i * pw_sg, pw_sg, pw_n) *                           \
                               VFN(ag__vload(pw_y + pw_i * pw_sy, pw_sy, pw_n)));                  \
            }                                                                                      \
        });                                                                                        \
    } while (0)

#endif
