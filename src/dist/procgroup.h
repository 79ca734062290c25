/* Process groups inside the library: what src/dist's files and the collective kernels
 * (src/ops/collectives.c) share. The public side is include/aotgrad/dist.h. */
#ifndef AG_PROCGROUP_H
#define AG_PROCGROUP_H

#include <mpi.h>
#include <pthread.h>

#include "aotgrad/dist.h"

struct ag_group {
    char name[16];
    MPI_Comm comm; /* MPI_COMM_NULL in a world without MPI */
    int rank, size;
    struct ag_group *next; /* the library's list of groups (world first) */
};

/* Held around every MPI call (MPI_THREAD_SERIALIZED: one thread at a time in MPI). */
extern pthread_mutex_t ag__mpi_lock;

/* Aborts the job because MPI call `what` failed with `err` during `op` on group g. */
void ag__dist_mpi_fail(const char *op, const ag_group *g, const char *what, int err)
    __attribute__((noreturn));

/* Seconds on a monotonic clock. */
double ag__dist_now(void);

#endif
