/* Thread count for kernels (OpenMP) and GEMM (OpenBLAS, OpenMP flavour, so one setting serves
 * both). The count is OpenMP's nthreads-var: it belongs to the calling thread, and the parallel
 * regions of the kernels that thread runs use it. */
#include "internal.h"

#include <omp.h>

/* The most threads ag_set_num_threads accepts: 8 per processor, and never past
 * OMP_THREAD_LIMIT. More only oversubscribes the machine (and at some point libgomp aborts the
 * process when it cannot start them). */
int ag_set_num_threads(int n) {
    if (n < 1)
        return ag__err(AG_EINVAL, "set_num_threads: expected a positive number of threads, got %d",
                       n);
    int procs = omp_get_num_procs(), limit = omp_get_thread_limit();
    int cap = procs > 0 && procs < (1 << 24) ? 8 * procs : 8;
    if (limit > 0 && limit < cap && n > limit)
        return ag__err(AG_EINVAL, "set_num_threads: %d threads is more than OMP_THREAD_LIMIT (%d)",
                       n, limit);
    if (n > cap)
        return ag__err(AG_EINVAL,
                       "set_num_threads: %d threads is more than %d (8 per processor; this "
                       "machine has %d)",
                       n, cap, procs);
    omp_set_num_threads(n);
    return 0;
}

int ag_get_num_threads(void) {
    return omp_get_max_threads();
}
