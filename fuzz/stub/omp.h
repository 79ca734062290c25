/* A single-threaded stand-in for <omp.h>, used only by the fuzz build: the fuzzer needs no
 * threads, and this keeps it independent of clang's OpenMP runtime (libomp-dev). The library
 * is compiled without -fopenmp there, so its `#pragma omp` lines are ignored. */
#ifndef AG_FUZZ_OMP_STUB_H
#define AG_FUZZ_OMP_STUB_H

static inline int omp_get_thread_num(void) {
    return 0;
}
static inline int omp_get_num_threads(void) {
    return 1;
}
static inline int omp_get_max_threads(void) {
    return 1;
}
static inline int omp_get_num_procs(void) {
    return 1;
}
static inline int omp_in_parallel(void) {
    return 0;
}
static inline int omp_get_thread_limit(void) {
    return 1;
}
static inline void omp_set_num_threads(int n) {
    (void)n;
}

#endif
