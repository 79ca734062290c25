/* bench_flex_attention: flex_attention's tiled kernel against attention materialized from
 * primitive ops, on the CPU.
 *
 * Shapes: B=1, H=12, T=1024 (query and key length), E=64, float32 (GPT-2 small's attention at
 * T=1024). Masks: causal, a causal sliding window of 128, and causal with an ALiBi bias (a
 * score_mod over tensors for flex, evaluated per tile through ops on the calling thread; an
 * added [1, H, T, T] bias for the primitive reference), as a block mask of 128 x 128
 * blocks for flex_attention (built once, outside the timings; its build time is reported) and
 * as a [T, T] bool mask for the references. Also timed, "compiled": the same flex_attention
 * call in a module (ALiBi's slopes a buffer of it), its joint exported and compiled
 * (ag_compile_joint, the planned executor; the forward and backward steps of flex_attention
 * run the score, mask and joint graphs per tile through plans made at compile time). References,
 * timed in the same run:
 *   - "primitive": matmul(q, k^T) * scale, masked_fill(-inf), softmax, matmul(p, v): the whole
 *     [B, H, T, T] score and probability tensors live at once;
 *   - "sdpa": ag_scaled_dot_product_attention with is_causal (a fused kernel that still forms
 *     each (b, h)'s T x T scores; it takes no other mask, so it runs for the causal mask only).
 * Reported per mask and implementation: the median seconds of the forward and of forward +
 * backward (gradients of q, k, v from a fixed upstream gradient), and the peak bytes the
 * library held above the call's start (an allocator hook counting every allocation, the
 * kernel's per-thread scratch included: each peak is measured on a fresh thread, whose scratch
 * is empty), with flex's ratios to the primitive reference.
 *
 *   bench_flex_attention [--runs N] [--threads N] [--t T] [--mask 0|1|2]
 *
 * No timed assertion: numbers are for the reader (docs/PERFORMANCE.md records a run). */
#include "aotgrad.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* ---- the counting allocator: live bytes and their peak ---- */
static _Atomic int64_t live_bytes, peak_bytes;

static void *count_alloc(void *ud, size_t size, size_t align) {
    (void)ud;
    const size_t hdr = align < 16 ? 16 : align;
    char *p = aligned_alloc(hdr, (size + hdr + hdr - 1) / hdr * hdr);
    if (!p)
        return NULL;
    ((size_t *)(p + hdr))[-1] = hdr;
    ((size_t *)(p + hdr))[-2] = size;
    int64_t now = atomic_fetch_add(&live_bytes, (int64_t)size) + (int64_t)size;
    int64_t pk = atomic_load(&peak_bytes);
    while (now > pk && !atomic_compare_exchange_weak(&peak_bytes, &pk, now)) {
    }
    return p + hdr;
}

static void count_free(void *ud, void *ptr) {
    (void)ud;
    if (!ptr)
        return;
    const size_t hdr = ((size_t *)ptr)[-1], size = ((size_t *)ptr)[-2];
    atomic_fetch_sub(&live_bytes, (int64_t)size);
    free((char *)ptr - hdr);
}

/* ---- the masks and the score_mod ---- */
static int64_t window; /* 0: causal */
static bool use_alibi; /* ALiBi as a score_mod (flex) or an added bias (primitive) */

static ag_tensor *alibi(void *ud, ag_tensor *score, ag_tensor *b, ag_tensor *h, ag_tensor *qi,
                        ag_tensor *ki, ag_tensor *const *bufs, int nbuf) {
    (void)ud, (void)b, (void)nbuf;
    ag_tensor *rel = ag_to_dtype(ag_sub(ki, qi), ag_tensor_dtype(score));
    return ag_add(score, ag_mul(ag_index(bufs[0], &h, 1), rel));
}

static ag_tensor *mask_mod(void *ud, ag_tensor *b, ag_tensor *h, ag_tensor *qi, ag_tensor *ki,
                           ag_tensor *const *bufs, int nbuf) {
    (void)ud, (void)b, (void)h, (void)bufs, (void)nbuf;
    ag_tensor *causal = ag_ge(qi, ki);
    if (!window)
        return causal;
    return ag_where(causal, ag_lt_scalar(ag_sub(qi, ki), (double)window), causal);
}

typedef struct setup {
    int64_t B, H, T, E;
    ag_tensor *q, *k, *v, *gout; /* q, k, v require grad */
    ag_tensor *drop;             /* [T, T] bool: true where masked out */
    ag_block_mask *bm;
    ag_tensor *slopes, *rel; /* ALiBi: [H] slopes, [T, T] kv - q */
    ag_module *m;            /* "compiled": flex_attention in a module (slopes its buffer) */
    ag_compiled *c;          /* its joint, compiled (planned executor) */
} setup;

enum { IMPL_FLEX, IMPL_COMPILED, IMPL_PRIMITIVE, IMPL_SDPA, NIMPL };
static const char *impl_name[NIMPL] = {"flex", "compiled", "primitive", "sdpa"};

/* The module of the "compiled" rows: out = flex_attention(q, k, v) with the bench's block mask
 * (its ud) and, for ALiBi, score_mod over the module's buffer "slopes". */
static int flex_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)nin, (void)max_out;
    ag_tensor *slopes = ag_module_buffer(m, "slopes");
    ag_score_mod sm = {alibi, NULL, &slopes, 1};
    ag_scope_begin();
    ag_tensor *o = NULL;
    int rc = ag_flex_attention(in[0], in[1], in[2], use_alibi ? &sm : NULL, ag_module_ud(m), NULL,
                               &o, NULL);
    if (rc) {
        ag_scope_end();
        return rc;
    }
    return ag_module_return1(o, out);
}

/* Exports and compiles s->m's joint on s's q, k, v: 0 or -1. */
static int compile_module(setup *s, const float *slopes) {
    s->m = ag_module_new("Flex", flex_forward, s->bm, NULL);
    if (!s->m || ag_module_add_tensor(s->m, "slopes", false, AG_F32, 1, (int64_t[]){s->H},
                                      AG_INIT_ZEROS, 0, 0))
        return -1;
    memcpy(ag_tensor_data(ag_module_buffer(s->m, "slopes")), slopes, sizeof(float) * (size_t)s->H);
    ag_tensor *x[3] = {s->q, s->k, s->v};
    ag_joint *j = ag_export_joint(s->m, x, 3, NULL, NULL, 0, NULL);
    s->c = j ? ag_compile_joint(j, NULL) : NULL;
    ag_joint_free(j);
    return s->c ? 0 : -1;
}

/* One forward (and backward): 0 or a status. */
static int run(const setup *s, int impl, bool backward) {
    ag_scope_begin();
    ag_tensor *out = NULL;
    if (impl == IMPL_FLEX) {
        ag_tensor *slopes = s->slopes;
        ag_score_mod sm = {alibi, NULL, &slopes, 1};
        if (ag_flex_attention(s->q, s->k, s->v, use_alibi ? &sm : NULL, s->bm, NULL, &out, NULL))
            out = NULL;
    } else if (impl == IMPL_COMPILED) {
        ag_tensor *x[3] = {s->q, s->k, s->v};
        if (ag_compiled_call_module(s->c, s->m, x, 3, &out, 1) != 1) /* out: the scope's */
            out = NULL;
    } else if (impl == IMPL_PRIMITIVE) {
        ag_tensor *sc =
            ag_mul_scalar(ag_matmul(s->q, ag_transpose(s->k, 2, 3)), 1.0 / sqrt((double)s->E));
        if (use_alibi)
            sc = ag_add(sc, ag_mul(ag_view(s->slopes, 4, (int64_t[]){1, s->H, 1, 1}), s->rel));
        ag_tensor *p = ag_softmax(ag_masked_fill(sc, s->drop, -INFINITY), -1);
        out = ag_matmul(p, s->v);
    } else {
        out = ag_scaled_dot_product_attention(s->q, s->k, s->v, true, 0.0);
    }
    int rc = out ? 0 : -1;
    if (!rc && backward)
        rc = ag_backward(out, s->gout, false);
    ag_scope_end();
    if (backward) {
        ag_tensor_set_grad(s->q, NULL);
        ag_tensor_set_grad(s->k, NULL);
        ag_tensor_set_grad(s->v, NULL);
    }
    return rc;
}

typedef struct peak_job {
    const setup *s;
    int impl;
    bool backward;
    int64_t peak;
    int rc;
} peak_job;

static void *peak_thread(void *p) {
    peak_job *j = p;
    atomic_store(&peak_bytes, atomic_load(&live_bytes));
    const int64_t base = atomic_load(&live_bytes);
    j->rc = run(j->s, j->impl, j->backward);
    j->peak = atomic_load(&peak_bytes) - base;
    return NULL;
}

static int64_t measure_peak(const setup *s, int impl, bool backward, int *rc) {
    peak_job j = {s, impl, backward, 0, 0};
    pthread_t th;
    pthread_create(&th, NULL, peak_thread, &j);
    pthread_join(th, NULL);
    *rc = j.rc;
    return j.peak;
}

int main(int argc, char **argv) {
    int runs = 10, threads = 0, only = -1; /* only: one mask (0 causal, 1 sliding, 2 ALiBi) */
    int64_t T = 1024;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--runs") && i + 1 < argc)
            runs = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc)
            threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--t") && i + 1 < argc)
            T = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--mask") && i + 1 < argc)
            only = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: bench_flex_attention [--runs N] [--threads N] [--t T] "
                            "[--mask 0|1|2]\n");
            return 2;
        }
    }
    if (runs < 1 || T < 1) {
        fprintf(stderr, "bench_flex_attention: --runs and --t must be >= 1\n");
        return 2;
    }
    ag_allocator counting = {count_alloc, count_free, NULL};
    ag_set_allocator(&counting);
    if (threads > 0)
        ag_set_num_threads(threads);
    printf("bench_flex_attention: B=1 H=12 T=%lld E=64 float32, %d runs, %d threads (medians)\n",
           (long long)T, runs, ag_get_num_threads());
    printf("%-16s %-10s %10s %10s %12s %12s\n", "mask", "impl", "fwd_s", "fwd+bwd_s", "peak_fwd_MB",
           "peak_fb_MB");
    const int64_t windows[3] = {0, 128, 0};
    for (int w = 0; w < 3; w++) {
        if (only >= 0 && w != only)
            continue;
        window = windows[w];
        use_alibi = w == 2;
        setup s = {.B = 1, .H = 12, .T = T, .E = 64};
        double sl[12], *rel = malloc(sizeof(double) * (size_t)(T * T));
        for (int h = 0; h < 12; h++)
            sl[h] = pow(2.0, -8.0 * (h + 1) / 12.0);
        for (int64_t i = 0; i < T; i++)
            for (int64_t j = 0; j < T; j++)
                rel[i * T + j] = (double)(j - i);
        float *relf = malloc(sizeof(float) * (size_t)(T * T)), slf[12];
        for (int64_t i = 0; i < T * T; i++)
            relf[i] = (float)rel[i];
        for (int h = 0; h < 12; h++)
            slf[h] = (float)sl[h];
        s.rel = ag_from_data(AG_F32, 2, (int64_t[]){T, T}, relf);
        s.slopes = ag_from_data(AG_F32, 1, (int64_t[]){12}, slf);
        free(rel);
        free(relf);
        ag_manual_seed(0);
        s.q = ag_randn(AG_F32, 4, (int64_t[]){s.B, s.H, T, s.E});
        s.k = ag_randn(AG_F32, 4, (int64_t[]){s.B, s.H, T, s.E});
        s.v = ag_randn(AG_F32, 4, (int64_t[]){s.B, s.H, T, s.E});
        s.gout = ag_randn(AG_F32, 4, (int64_t[]){s.B, s.H, T, s.E});
        ag_tensor_set_requires_grad(s.q, true);
        ag_tensor_set_requires_grad(s.k, true);
        ag_tensor_set_requires_grad(s.v, true);
        bool *drop = malloc((size_t)(T * T));
        for (int64_t i = 0; i < T; i++)
            for (int64_t j = 0; j < T; j++)
                drop[i * T + j] = !(j <= i && (!window || i - j < window));
        s.drop = ag_from_data(AG_BOOL, 2, (int64_t[]){T, T}, drop);
        free(drop);
        ag_mask_mod mm = {mask_mod, NULL, NULL, 0};
        double t0 = now_s();
        s.bm = ag_create_block_mask(&mm, 1, 1, T, T, 128, 128);
        const double build_s = now_s() - t0;
        if (!s.bm) {
            fprintf(stderr, "create_block_mask: %s\n", ag_last_error());
            return 1;
        }
        if (compile_module(&s, slf)) {
            fprintf(stderr, "compile: %s\n", ag_last_error());
            return 1;
        }
        double med[NIMPL][2];
        int64_t peak[NIMPL][2];
        double *ts = malloc(sizeof(double) * (size_t)runs);
        const int nimpl = window || use_alibi ? IMPL_SDPA : NIMPL;
        for (int impl = 0; impl < nimpl; impl++)
            for (int bw = 0; bw < 2; bw++) {
                int rc = 0;
                peak[impl][bw] = measure_peak(&s, impl, bw, &rc);
                rc |= run(&s, impl, bw); /* warm */
                for (int r = 0; r < runs && !rc; r++) {
                    t0 = now_s();
                    rc = run(&s, impl, bw);
                    ts[r] = now_s() - t0;
                }
                if (rc) {
                    fprintf(stderr, "%s: %s\n", impl_name[impl], ag_last_error());
                    return 1;
                }
                qsort(ts, (size_t)runs, sizeof *ts, cmp_double);
                med[impl][bw] = ts[runs / 2];
            }
        free(ts);
        char name[32];
        snprintf(name, sizeof name,
                 use_alibi ? "causal+alibi"
                 : window  ? "sliding %lld"
                           : "causal",
                 (long long)window);
        for (int impl = 0; impl < nimpl; impl++)
            printf("%-16s %-10s %10.4f %10.4f %12.2f %12.2f\n", name, impl_name[impl], med[impl][0],
                   med[impl][1], (double)peak[impl][0] / 1048576.0,
                   (double)peak[impl][1] / 1048576.0);
        printf("%-16s flex/primitive: time fwd %.2fx, fwd+bwd %.2fx; peak fwd %.3fx, fwd+bwd "
               "%.3fx; block mask built in %.4f s\n",
               name, med[IMPL_FLEX][0] / med[IMPL_PRIMITIVE][0],
               med[IMPL_FLEX][1] / med[IMPL_PRIMITIVE][1],
               (double)peak[IMPL_FLEX][0] / (double)peak[IMPL_PRIMITIVE][0],
               (double)peak[IMPL_FLEX][1] / (double)peak[IMPL_PRIMITIVE][1], build_s);
        ag_compiled_free(s.c);
        ag_module_free(s.m);
        ag_block_mask_free(s.bm);
        ag_tensor_free(s.q);
        ag_tensor_free(s.k);
        ag_tensor_free(s.v);
        ag_tensor_free(s.gout);
        ag_tensor_free(s.drop);
        ag_tensor_free(s.rel);
        ag_tensor_free(s.slopes);
    }
    return 0;
}
