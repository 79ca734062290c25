/* bench_sgemm: is the GEMM floor of `aotgrad bench` near the best sgemm this machine has?
 *
 *   aotgrad bench gpt2-small --runs 1 --json steps.json
 *   bench_sgemm steps.json [--runs N]
 *
 * Reads the GEMM calls of each model's compiled step from the bench's JSON ("gemms": every
 * product the step's kernels make, with shapes, transposes and how the kernels thread them) and
 * times the whole list, in the same process and on the same buffers, through OpenBLAS
 * (cblas_sgemm, what aotgrad links) and through oneDNN (dnnl_sgemm, Debian's libdnnl), the
 * reference the issue measured at 410-490 GFLOP/s on GPT-2's shapes. Calls the kernels spread
 * over threads one product per thread (small batched products, per-image convolutions) run that
 * way under both libraries. Then each distinct shape alone, and an AVX-512 FMA loop on every
 * thread as the arithmetic peak. Prints ratios; asserts nothing. The two libraries alternate
 * run by run, so a drifting load hits both alike; the medians are reported. */
#include <cblas.h>
#include <dnnl.h>
#include <immintrin.h>
#include <jansson.h>
#include <omp.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct call {
    char op[64];
    bool ta, tb, par, shared_a;
    long m, n, k, count;
    float beta;
} call;

typedef enum lib { OPENBLAS, DNNL } lib;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* One row-major product c (m, n) = op(a) op(b) + beta c through the chosen library. */
static void sgemm(lib l, const call *g, const float *a, const float *b, float *c) {
    const long lda = g->ta ? g->m : g->k, ldb = g->tb ? g->k : g->n;
    if (l == OPENBLAS)
        cblas_sgemm(CblasRowMajor, g->ta ? CblasTrans : CblasNoTrans,
                    g->tb ? CblasTrans : CblasNoTrans, (int)g->m, (int)g->n, (int)g->k, 1.0f, a,
                    (int)lda, b, (int)ldb, g->beta, c, (int)g->n);
    else
        dnnl_sgemm(g->ta ? 'T' : 'N', g->tb ? 'T' : 'N', g->m, g->n, g->k, 1.0f, a, lda, b, ldb,
                   g->beta, c, g->n);
}

/* A call's count products, on one thread each when the kernel spreads them (par), else one
 * after the other with the library's own threading, as aotgrad's kernels do. */
static void run_call(lib l, const call *g, const float *a, const float *b, float *c) {
    const size_t sa = g->shared_a ? 0 : (size_t)(g->m * g->k), sb = (size_t)(g->k * g->n),
                 sc = (size_t)(g->m * g->n);
    if (g->par && g->count > 1) {
#pragma omp parallel for schedule(static)
        for (long j = 0; j < g->count; j++)
            sgemm(l, g, a + (size_t)j * sa, b + (size_t)j * sb, c + (size_t)j * sc);
    } else {
        for (long j = 0; j < g->count; j++)
            sgemm(l, g, a + (size_t)j * sa, b + (size_t)j * sb, c + (size_t)j * sc);
    }
}

static double flops_of(const call *v, int n) {
    double f = 0;
    for (int i = 0; i < n; i++)
        f += 2.0 * (double)v[i].m * (double)v[i].n * (double)v[i].k * (double)v[i].count;
    return f;
}

/* Median seconds of one pass over v[0..n) with each library, alternating. */
static void time_list(const call *v, int n, int runs, const float *a, const float *b, float *c,
                      double out[2]) {
    double *t[2] = {malloc(sizeof(double) * (size_t)runs), malloc(sizeof(double) * (size_t)runs)};
    for (int l = 0; l < 2; l++) /* warm-up: packing buffers, thread pools, page faults */
        for (int i = 0; i < n; i++)
            run_call((lib)l, &v[i], a, b, c);
    for (int r = 0; r < runs; r++)
        for (int l = 0; l < 2; l++) {
            double t0 = now_s();
            for (int i = 0; i < n; i++)
                run_call((lib)l, &v[i], a, b, c);
            t[l][r] = now_s() - t0;
        }
    for (int l = 0; l < 2; l++) {
        out[l] = median(t[l], runs);
        free(t[l]);
    }
}

/* GFLOP/s of 2 x 12 independent AVX-512 FMA chains per thread on every thread: the machine's
 * arithmetic peak for fp32, which no GEMM reaches. */
__attribute__((target("avx512f"))) static double fma_peak(void) {
    const long iters = 20 * 1000 * 1000;
    double t0 = now_s();
    float sink = 0;
#pragma omp parallel reduction(+ : sink)
    {
        __m512 acc[12], x = _mm512_set1_ps(1.0000001f), y = _mm512_set1_ps(0.9999999f);
        for (int i = 0; i < 12; i++)
            acc[i] = _mm512_set1_ps((float)i);
        for (long it = 0; it < iters; it++)
            for (int i = 0; i < 12; i++)
                acc[i] = _mm512_fmadd_ps(acc[i], x, y);
        for (int i = 0; i < 12; i++)
            sink += _mm512_reduce_add_ps(acc[i]);
    }
    double dt = now_s() - t0;
    if (sink == 12345.0f)
        printf(" ");
    return 2.0 * 16 * 12 * (double)iters * omp_get_max_threads() / dt / 1e9;
}

static int read_calls(json_t *gemms, call **out) {
    size_t n = json_array_size(gemms);
    call *v = calloc(n ? n : 1, sizeof *v);
    if (!v)
        return -1;
    for (size_t i = 0; i < n; i++) {
        json_t *o = json_array_get(gemms, i);
        const char *op = "?", *ta = "N", *tb = "N";
        json_int_t m = 0, nn = 0, k = 0, cnt = 0;
        double beta = 0;
        int par = 0, shared = 0;
        if (json_unpack(o, "{s:s, s:s, s:s, s:I, s:I, s:I, s:I, s:F, s:b, s:b}", "op", &op, "ta",
                        &ta, "tb", &tb, "m", &m, "n", &nn, "k", &k, "count", &cnt, "beta", &beta,
                        "par", &par, "shared_a", &shared) ||
            m <= 0 || nn <= 0 || k <= 0 || cnt <= 0) {
            fprintf(stderr, "bench_sgemm: gemms[%zu] is not a GEMM call\n", i);
            free(v);
            return -1;
        }
        v[i] = (call){.ta = *ta == 'T',
                      .tb = *tb == 'T',
                      .par = par,
                      .shared_a = shared,
                      .m = (long)m,
                      .n = (long)nn,
                      .k = (long)k,
                      .count = (long)cnt,
                      .beta = (float)beta};
        snprintf(v[i].op, sizeof v[i].op, "%s", op);
    }
    *out = v;
    return (int)n;
}

static float *filled(size_t n) {
    float *p = aligned_alloc(64, ((n * sizeof(float) + 63) / 64) * 64);
    for (size_t i = 0; p && i < n; i++)
        p[i] = 0.01f * (float)((int)(i % 97) - 48);
    return p;
}

static bool same_shape(const call *a, const call *b) {
    return a->ta == b->ta && a->tb == b->tb && a->m == b->m && a->n == b->n && a->k == b->k &&
           a->count == b->count && a->par == b->par && a->beta == b->beta &&
           a->shared_a == b->shared_a;
}

static int bench_model(const char *name, call *v, int n, int runs) {
    size_t na = 1, nb = 1, nc = 1;
    for (int i = 0; i < n; i++) {
        size_t cnt = (size_t)v[i].count;
        size_t a = (v[i].shared_a ? 1 : cnt) * (size_t)(v[i].m * v[i].k);
        na = a > na ? a : na;
        nb = cnt * (size_t)(v[i].k * v[i].n) > nb ? cnt * (size_t)(v[i].k * v[i].n) : nb;
        nc = cnt * (size_t)(v[i].m * v[i].n) > nc ? cnt * (size_t)(v[i].m * v[i].n) : nc;
    }
    float *a = filled(na), *b = filled(nb), *c = filled(nc);
    if (!a || !b || !c) {
        fprintf(stderr, "bench_sgemm: %s: out of memory\n", name);
        free(a), free(b), free(c);
        return 1;
    }
    double t[2];
    time_list(v, n, runs, a, b, c, t);
    const double f = flops_of(v, n);
    printf("\n%s: %d GEMM calls, %.3g GFLOP per step (median of %d passes)\n", name, n, f / 1e9,
           runs);
    printf("  whole list: OpenBLAS %.1f ms (%.0f GFLOP/s), oneDNN %.1f ms (%.0f GFLOP/s); "
           "OpenBLAS / oneDNN time = %.2fx\n",
           1e3 * t[0], f / t[0] / 1e9, 1e3 * t[1], f / t[1] / 1e9, t[0] / t[1]);
    printf("  %-46s %2s %2s %6s %6s %6s %5s %4s %5s %9s %9s %6s\n", "op", "tA", "tB", "m", "n", "k",
           "count", "par", "calls", "OpenBLAS", "oneDNN", "ratio");
    for (int i = 0; i < n; i++) {
        bool first = true;
        for (int j = 0; first && j < i; j++)
            first = !same_shape(&v[j], &v[i]);
        if (!first)
            continue;
        int calls = 0;
        for (int j = i; j < n; j++)
            calls += same_shape(&v[j], &v[i]);
        double ts[2];
        time_list(&v[i], 1, runs, a, b, c, ts);
        double fi = flops_of(&v[i], 1);
        printf("  %-46.46s %2s %2s %6ld %6ld %6ld %5ld %4s %5d %6.0f GF %6.0f GF %5.2fx\n", v[i].op,
               v[i].ta ? "T" : "N", v[i].tb ? "T" : "N", v[i].m, v[i].n, v[i].k, v[i].count,
               v[i].par ? "yes" : "no", calls, fi / ts[0] / 1e9, fi / ts[1] / 1e9, ts[0] / ts[1]);
    }
    free(a), free(b), free(c);
    return 0;
}

int main(int argc, char **argv) {
    int runs = 5;
    const char *path = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--runs") && i + 1 < argc) {
            char *end;
            long r = strtol(argv[++i], &end, 10);
            if (*end || r < 1 || r > 1000) {
                fprintf(stderr, "bench_sgemm: --runs: expected 1..1000, got '%s'\n", argv[i]);
                return 2;
            }
            runs = (int)r;
        } else if (!path && argv[i][0] != '-') {
            path = argv[i];
        } else {
            fprintf(stderr, "usage: bench_sgemm BENCH.json [--runs N]\n");
            return 2;
        }
    }
    if (!path) {
        fprintf(stderr, "usage: bench_sgemm BENCH.json [--runs N]   (BENCH.json from "
                        "`aotgrad bench MODEL --json BENCH.json`)\n");
        return 2;
    }
    json_error_t err;
    json_t *root = json_load_file(path, 0, &err);
    if (!root) {
        fprintf(stderr, "bench_sgemm: %s:%d: %s\n", path, err.line, err.text);
        return 1;
    }
    const dnnl_version_t *dv = dnnl_version();
    printf("bench_sgemm: %d threads; OpenBLAS %s; oneDNN %d.%d.%d (%s runtime)\n",
           omp_get_max_threads(), openblas_get_corename(), dv->major, dv->minor, dv->patch,
           dv->cpu_runtime == DNNL_RUNTIME_OMP ? "OpenMP" : "other");
    int status = 0;
    json_t *results = json_object_get(root, "results");
    for (size_t i = 0; i < json_array_size(results); i++) {
        json_t *r = json_array_get(results, i);
        const char *name = json_string_value(json_object_get(r, "model"));
        call *v = NULL;
        int n = read_calls(json_object_get(r, "gemms"), &v);
        if (n < 0 || !name) {
            status = 1;
            continue;
        }
        if (n > 0)
            status |= bench_model(name, v, n, runs);
        free(v);
    }
    if (__builtin_cpu_supports("avx512f"))
        printf("\narithmetic peak: AVX-512 FMA loop on %d threads: %.0f GFLOP/s\n",
               omp_get_max_threads(), fma_peak());
    json_decref(root);
    return status;
}
