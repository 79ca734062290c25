/* Thread count for kernels (OpenMP) and GEMM (OpenBLAS, OpenMP flavour, so one setting serves
 * both). */
#include "internal.h"

#include <omp.h>

void ag_set_num_threads(int n) { omp_set_num_threads(n > 0 ? n : 1); }

int ag_get_num_threads(void) { return omp_get_max_threads(); }
