/* What `aotgrad bench` reports about the BLAS and the threads it runs with (bench_env.c). */
#ifndef AG_BENCH_ENV_H
#define AG_BENCH_ENV_H

#include <jansson.h>
#include <stddef.h>

/* Prints, after "aotgrad bench: ", OpenBLAS's kernel set (core name) and threading, the CPU's
 * best kernel set, the OpenMP settings that matter, and one "warning:" line for each setting of
 * the environment that holds the run below what the machine can do. Returns the same facts as
 * a new JSON object {blas: {...}, cpu_isa, threads: {...}, environment: {...}, warnings: [...]}
 * owned by the caller (NULL when out of memory). `threads` is the bench's thread count. */
json_t *bench_env_report(int threads);

/* The first three fields of /proc/loadavg ("16.71 18.47 13.98"), or "unknown". */
void bench_loadavg(char *buf, size_t n);
/* The CPU's model name from /proc/cpuinfo, or "unknown". */
void bench_cpu_model(char *buf, size_t n);

#endif
