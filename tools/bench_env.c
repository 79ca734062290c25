/* The BLAS and thread report of `aotgrad bench`: which kernel set OpenBLAS picked (its core
 * name) against the best one this CPU runs, how many threads the kernels and GEMM use, the
 * environment variables that change either, and a warning for each setting that holds the run
 * below what the machine can do. A bench number is only comparable with another taken under
 * the same report: an environment variable such as OPENBLAS_CORETYPE=Haswell holds OpenBLAS to
 * its AVX2 kernels on an AVX-512 CPU (about 0.6x the GEMM throughput), and a user's machine
 * has no such setting. */
#include "bench_env.h"

#include <omp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

/* OpenBLAS's own introspection (cblas.h declares them too, but only some versions). */
char *openblas_get_corename(void);
char *openblas_get_config(void);
int openblas_get_num_threads(void);
int openblas_get_parallel(void);

/* Instruction-set levels of x86-64 GEMM kernels, in increasing order. */
enum isa { ISA_UNKNOWN, ISA_SSE, ISA_AVX, ISA_AVX2, ISA_AVX512 };
static const char *const isa_names[] = {"unknown", "SSE", "AVX", "AVX2", "AVX-512"};

/* The level of the kernels OpenBLAS runs under a core name (its DYNAMIC_ARCH targets). */
static enum isa corename_isa(const char *core) {
    static const struct {
        const char *name;
        enum isa isa;
    } cores[] = {
        {"SkylakeX", ISA_AVX512}, {"Cooperlake", ISA_AVX512}, {"SapphireRapids", ISA_AVX512},
        {"Haswell", ISA_AVX2},    {"Zen", ISA_AVX2},          {"Excavator", ISA_AVX2},
        {"Sandybridge", ISA_AVX}, {"Bulldozer", ISA_AVX},     {"Piledriver", ISA_AVX},
        {"Steamroller", ISA_AVX},
    };
    if (!core)
        return ISA_UNKNOWN;
    for (size_t i = 0; i < sizeof cores / sizeof cores[0]; i++)
        if (!strcasecmp(core, cores[i].name))
            return cores[i].isa;
    return ISA_SSE;
}

/* The best level this CPU (and the kernel, which must save the wide registers) supports. */
static enum isa cpu_isa(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
        return ISA_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return ISA_AVX2;
    if (__builtin_cpu_supports("avx"))
        return ISA_AVX;
    return ISA_SSE;
#else
    return ISA_UNKNOWN;
#endif
}

/* Environment variables that change which kernels run or how their threads behave. */
static const char *const env_names[] = {
    "OPENBLAS_CORETYPE", "OPENBLAS_NUM_THREADS",  "GOTO_NUM_THREADS", "OMP_NUM_THREADS",
    "OMP_WAIT_POLICY",   "GOMP_SPINCOUNT",        "OMP_DYNAMIC",      "OMP_PROC_BIND",
    "OMP_PLACES",        "OMP_MAX_ACTIVE_LEVELS", "OMP_THREAD_LIMIT",
};

static void warn(json_t *warnings, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void warn(json_t *warnings, const char *fmt, ...) {
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    printf("aotgrad bench: warning: %s\n", msg);
    json_array_append_new(warnings, json_string(msg));
}

json_t *bench_env_report(int threads) {
    const char *core = openblas_get_corename();
    const char *config = openblas_get_config();
    const int blas_threads = openblas_get_num_threads(), par = openblas_get_parallel();
    const enum isa have = cpu_isa(), used = corename_isa(core);
    const long cores = sysconf(_SC_NPROCESSORS_ONLN);
    static const char *const par_names[] = {"sequential", "pthreads", "openmp"};
    const char *par_name = par >= 0 && par <= 2 ? par_names[par] : "unknown";

    printf("aotgrad bench: OpenBLAS %s kernels (%s); CPU's best: %s; threads: %d for kernels, "
           "%d for GEMM (%s), %ld cores\n",
           core ? core : "?", isa_names[used], isa_names[have], threads, blas_threads, par_name,
           cores);
    printf("aotgrad bench: environment:");
    json_t *env = json_object(), *warnings = json_array();
    int nset = 0;
    for (size_t i = 0; i < sizeof env_names / sizeof env_names[0]; i++) {
        const char *e = getenv(env_names[i]);
        if (e)
            printf(" %s=%s", env_names[i], e), nset++;
        json_object_set_new(env, env_names[i], e ? json_string(e) : json_null());
    }
    printf("%s\n", nset ? "" : " none of the OpenBLAS/OpenMP variables is set");

    const char *coretype = getenv("OPENBLAS_CORETYPE");
    if (have != ISA_UNKNOWN && used < have)
        warn(warnings,
             "OpenBLAS runs its %s (%s) kernels on a CPU with %s%s%s%s: GEMM is held well below "
             "this machine's best; a user's machine without that setting is faster",
             core ? core : "?", isa_names[used], isa_names[have],
             coretype ? " because OPENBLAS_CORETYPE=" : "", coretype ? coretype : "",
             coretype ? " is set" : "");
    if (threads < cores)
        warn(warnings, "the kernels use %d of %ld cores (--threads or OMP_NUM_THREADS)", threads,
             cores);
    if (blas_threads < threads)
        warn(warnings, "OpenBLAS uses %d threads, fewer than the kernels' %d", blas_threads,
             threads);
    if (omp_get_dynamic())
        warn(warnings, "OMP_DYNAMIC lets OpenMP run parallel regions on fewer threads");

    json_t *j =
        json_pack("{s:{s:s?, s:s?, s:s, s:i, s:s}, s:s, s:{s:i, s:i, s:I}}", "blas", "corename",
                  core, "config", config, "kernel_isa", isa_names[used], "threads", blas_threads,
                  "threading", par_name, "cpu_isa", isa_names[have], "threads", "kernels", threads,
                  "omp_max_threads", omp_get_max_threads(), "cores", (json_int_t)cores);
    if (j) {
        json_object_set_new(j, "environment", env);
        json_object_set_new(j, "warnings", warnings);
    } else {
        json_decref(env);
        json_decref(warnings);
    }
    return j;
}

/* The first three fields of /proc/loadavg ("16.71 18.47 13.98"), or "unknown". */
void bench_loadavg(char *buf, size_t n) {
    snprintf(buf, n, "unknown");
    FILE *f = fopen("/proc/loadavg", "r");
    if (!f)
        return;
    double a, b, c;
    if (fscanf(f, "%lf %lf %lf", &a, &b, &c) == 3)
        snprintf(buf, n, "%.2f %.2f %.2f", a, b, c);
    fclose(f);
}

void bench_cpu_model(char *buf, size_t n) {
    snprintf(buf, n, "unknown");
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f)
        return;
    char line[512];
    while (fgets(line, sizeof line, f)) {
        char *colon = strchr(line, ':');
        if (strncmp(line, "model name", 10) || !colon)
            continue;
        colon++;
        while (*colon == ' ' || *colon == '\t')
            colon++;
        colon[strcspn(colon, "\n")] = 0;
        snprintf(buf, n, "%s", colon);
        break;
    }
    fclose(f);
}
