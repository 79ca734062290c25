/* Philox-4x32-10 counter-based random numbers (Salmon et al., "Parallel random numbers: as easy
 * as 1, 2, 3", SC'11). The default generator is just a (seed, offset) pair: a draw of n values
 * reserves counters offset .. offset+n-1 and value i is computed from counter offset+i alone,
 * so results never depend on how the work is split across threads. The joint export later
 * turns seed and offset into graph inputs. */
#include "internal.h"

#include <math.h>

typedef struct {
    uint32_t v[4];
} philox4;

static philox4 philox(uint64_t seed, uint64_t counter) {
    uint32_t c0 = (uint32_t)counter, c1 = (uint32_t)(counter >> 32), c2 = 0, c3 = 0;
    uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    for (int r = 0; r < 10; r++) {
        uint64_t p0 = (uint64_t)0xD2511F53u * c0, p1 = (uint64_t)0xCD9E8D57u * c2;
        uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0, n2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
        c1 = (uint32_t)p1;
        c3 = (uint32_t)p0;
        c0 = n0;
        c2 = n2;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    return (philox4){{c0, c1, c2, c3}};
}

/* The default generator, one per thread (torch has one per process): a thread's draws then
 * depend only on its own seeding and draws, so threads that each build and train a model get
 * the numbers a sequential run gets (include/aotgrad/core.h). Every thread starts at
 * (0x5eed, 0). */
static _Thread_local uint64_t g_seed = 0x5eed, g_offset;

void ag_manual_seed(uint64_t seed) {
    g_seed = seed;
    g_offset = 0;
}
void ag_rng_get_state(uint64_t *seed, uint64_t *offset) {
    AG__CHECK_NULL_RET("rng_get_state", seed, );
    AG__CHECK_NULL_RET("rng_get_state", offset, );
    *seed = g_seed;
    *offset = g_offset;
}
void ag_rng_set_state(uint64_t seed, uint64_t offset) {
    g_seed = seed;
    g_offset = offset;
}

void ag__rng_reserve(int64_t n, uint64_t *seed, uint64_t *offset) {
    *seed = g_seed;
    *offset = g_offset;
    g_offset += (uint64_t)n;
}

static inline double u53(philox4 r) {
    uint64_t x = ((uint64_t)r.v[0] << 21) ^ (uint64_t)(r.v[1] >> 11);
    return (double)(x & ((1ull << 53) - 1)) * 0x1.0p-53;
}

static inline float u24(uint32_t x) {
    return (float)(x >> 8) * 0x1.0p-24f;
}

void ag__philox_uniform_f64(uint64_t seed, uint64_t offset, int64_t n, double *out) {
#pragma omp parallel for schedule(static) if (n > 65536)
    for (int64_t i = 0; i < n; i++)
        out[i] = u53(philox(seed, offset + (uint64_t)i));
}

void ag__philox_uniform_f32(uint64_t seed, uint64_t offset, int64_t n, float *out) {
#pragma omp parallel for schedule(static) if (n > 65536)
    for (int64_t i = 0; i < n; i++)
        out[i] = u24(philox(seed, offset + (uint64_t)i).v[0]);
}

/* Box-Muller from two uniforms of the element's own counter; 1-u keeps log's argument > 0. */
static inline double normal_of(philox4 r) {
    double u1 = 1.0 - (double)r.v[0] * 0x1.0p-32, u2 = (double)r.v[1] * 0x1.0p-32;
    return sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * u2);
}

void ag__philox_normal_f64(uint64_t seed, uint64_t offset, int64_t n, double *out) {
#pragma omp parallel for schedule(static) if (n > 65536)
    for (int64_t i = 0; i < n; i++)
        out[i] = normal_of(philox(seed, offset + (uint64_t)i));
}

void ag__philox_normal_f32(uint64_t seed, uint64_t offset, int64_t n, float *out) {
#pragma omp parallel for schedule(static) if (n > 65536)
    for (int64_t i = 0; i < n; i++)
        out[i] = (float)normal_of(philox(seed, offset + (uint64_t)i));
}
