/* Vectorized float32 math for kernels: sqrt, exp, tanh, erfc and the activations built on them
 * (sigmoid, silu, gelu and their derivatives), AG__VW lanes at a time.
 *
 * glibc's expf, tanhf and erff are opaque scalar calls, so loops over them run at several ns
 * per element. These functions work on GCC vector types (ag__vf: AG__VW floats, one register
 * of the widest ISA that -march allows: AVX-512, AVX or SSE), so they vectorize regardless of the
 * auto-vectorizer's heuristics (scalar formulations with selects defeat it under
 * -ftrapping-math). Accuracy is a few ulp over the whole float range (tests/test_pointwise.c
 * checks them against libm in float64), like the Sleef-based CPU kernels of PyTorch. NaN
 * propagates; overflow gives inf and underflow subnormals or 0, as expf does.
 *
 * Use: load up to AG__VW values into an ag__vf (ag__vload), apply, store (ag__vstore);
 * kernels keep libm for float64. */
#ifndef AG_FASTMATH_H
#define AG_FASTMATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE__)
#include <immintrin.h>
#endif

/* Lanes: one native register (AVX-512, AVX or SSE), so values travel in registers. */
#if defined(__AVX512F__)
#define AG__VW 16
#elif defined(__AVX__)
#define AG__VW 8
#else
#define AG__VW 4
#endif
#define AG__VINLINE static inline __attribute__((always_inline))
typedef float ag__vf __attribute__((vector_size(AG__VW * sizeof(float))));
typedef int32_t ag__vi __attribute__((vector_size(AG__VW * sizeof(int32_t))));

/* Lanes of m (all ones or all zeros, from a vector comparison) pick a, the others b. */
AG__VINLINE ag__vf ag__vsel(ag__vi m, ag__vf a, ag__vf b) {
    return (ag__vf)(((ag__vi)a & m) | ((ag__vi)b & ~m));
}

/* n elements at stride s (n <= AG__VW; the other lanes are 0). */
AG__VINLINE ag__vf ag__vload(const float *p, int64_t s, int64_t n) {
    ag__vf v = {0};
    if (s == 1 && n == AG__VW)
        memcpy(&v, p, sizeof v);
    else
        for (int64_t k = 0; k < n; k++)
            v[k] = p[k * s];
    return v;
}

AG__VINLINE void ag__vstore(float *p, int64_t s, int64_t n, ag__vf v) {
    if (s == 1 && n == AG__VW)
        memcpy(p, &v, sizeof v);
    else
        for (int64_t k = 0; k < n; k++)
            p[k * s] = v[k];
}

/* Correctly rounded sqrt. libm's sqrtf keeps loops scalar (it may set errno), so this uses
 * the instruction directly where there is one. */
AG__VINLINE ag__vf ag__vsqrt(ag__vf x) {
#if AG__VW == 16
    return (ag__vf)_mm512_sqrt_ps((__m512)x);
#elif AG__VW == 8
    return (ag__vf)_mm256_sqrt_ps((__m256)x);
#elif defined(__SSE__)
    return (ag__vf)_mm_sqrt_ps((__m128)x);
#else
    for (int k = 0; k < AG__VW; k++)
        x[k] = sqrtf(x[k]);
    return x;
#endif
}

AG__VINLINE ag__vf ag__vrsqrt(ag__vf x) {
    return 1.0f / ag__vsqrt(x);
}

/* Cephes' expf: x = n ln2 + r with |r| <= ln2 / 2 (ln2 split in two for precision), a
 * degree-6 polynomial for e^r, and 2^n applied as two normal powers of two so that results
 * near the overflow and underflow limits round as expf's do. */
AG__VINLINE ag__vf ag__vexp(ag__vf x) {
    const float hi = 88.72283935546875f, lo = -103.97208404541015625f;
    const ag__vf zero = {0};
    ag__vf xc = ag__vsel(x < hi, x, zero + hi); /* NaN lanes become hi, restored below */
    xc = ag__vsel(xc > lo, xc, zero + lo);
    const ag__vf fx = xc * 1.44269504088896341f + 0.5f;
    const ag__vf t = __builtin_convertvector(__builtin_convertvector(fx, ag__vi), ag__vf);
    const ag__vf n = t - ag__vsel(t > fx, zero + 1.0f, zero); /* floor(fx) */
    const ag__vf r = xc - n * 0.693359375f + n * 2.12194440e-4f;
    ag__vf p = zero + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const ag__vi ni = __builtin_convertvector(n, ag__vi), a = ni >> 1, b = ni - a;
    ag__vf y = (p * r * r + r + 1.0f) * (ag__vf)((a + 127) << 23) * (ag__vf)((b + 127) << 23);
    y = ag__vsel(x > hi, zero + INFINITY, y);
    y = ag__vsel(x < lo, zero, y);
    return ag__vsel(x != x, x, y);
}

/* Cephes' tanhf: an odd polynomial for |x| < 0.625 (no cancellation near 0), else
 * 1 - 2 / (e^{2|x|} + 1) with x's sign. */
AG__VINLINE ag__vf ag__vtanh(ag__vf x) {
    const ag__vf zero = {0}, z = x * x;
    const ag__vi neg = x < 0;
    const ag__vf ax = ag__vsel(neg, -x, x);
    ag__vf p = zero - 5.70498872745e-3f;
    p = p * z + 2.06390887954e-2f;
    p = p * z - 5.37397155531e-2f;
    p = p * z + 1.33314422036e-1f;
    p = p * z - 3.33332819422e-1f;
    p = p * z * x + x;
    const ag__vf q = 1.0f - 2.0f / (ag__vexp(ax + ax) + 1.0f);
    return ag__vsel(ax < 0.625f, p, ag__vsel(neg, -q, q));
}

/* erfc with relative error below 1.2e-7 everywhere (Numerical Recipes' erfcc: a Chebyshev fit
 * of erfc(z) e^{z^2} in t = 1 / (1 + z/2)); accurate in the tails, which GELU of negative
 * inputs needs. */
AG__VINLINE ag__vf ag__verfc(ag__vf x) {
    const ag__vf zero = {0};
    const ag__vi neg = x < 0;
    const ag__vf z = ag__vsel(neg, -x, x);
    const ag__vf t = 1.0f / (1.0f + 0.5f * z);
    ag__vf p = zero + 0.17087277f;
    p = p * t - 0.82215223f;
    p = p * t + 1.48851587f;
    p = p * t - 1.13520398f;
    p = p * t + 0.27886807f;
    p = p * t - 0.18628806f;
    p = p * t + 0.09678418f;
    p = p * t + 0.37409196f;
    p = p * t + 1.00002368f;
    p = p * t - 1.26551223f;
    const ag__vf r = t * ag__vexp(p - z * z);
    return ag__vsel(neg, 2.0f - r, r);
}

/* ---- activations and their derivatives (ATen's formulas; see pointwise.c) ---- */

#define AG__GELU_B 0.7978845608028654f /* sqrt(2 / pi) */
#define AG__GELU_K 0.044715f

AG__VINLINE ag__vf ag__vsigmoid(ag__vf x) {
    return 1.0f / (1.0f + ag__vexp(-x));
}
AG__VINLINE ag__vf ag__vsilu(ag__vf x) {
    return x / (1.0f + ag__vexp(-x));
}
AG__VINLINE ag__vf ag__vgelu(ag__vf x) {
    return 0.5f * x * ag__verfc(x * -0.70710678118654752f);
}
AG__VINLINE ag__vf ag__vgelu_tanh(ag__vf x) {
    return 0.5f * x * (1.0f + ag__vtanh(AG__GELU_B * (x + AG__GELU_K * x * x * x)));
}
AG__VINLINE ag__vf ag__vdgelu(ag__vf x) {
    return 0.5f * ag__verfc(x * -0.70710678118654752f) +
           x * 0.3989422804014327f * ag__vexp(-0.5f * x * x);
}
AG__VINLINE ag__vf ag__vdgelu_tanh(ag__vf x) {
    const ag__vf t = ag__vtanh(AG__GELU_B * (x + AG__GELU_K * x * x * x));
    return 0.5f * (1.0f + t) +
           0.5f * x * (1.0f - t * t) * AG__GELU_B * (1.0f + 3 * AG__GELU_K * x * x);
}
AG__VINLINE ag__vf ag__vdsilu(ag__vf x) {
    const ag__vf s = ag__vsigmoid(x);
    return s * (1.0f + x * (1.0f - s));
}

#endif
