/* Process groups over MPI, and the communication cost model.
 *
 * A program that trains on several processes calls ag_dist_init once (after MPI_Init if it
 * uses MPI itself, or instead of it), then runs the same code on every rank (SPMD). The
 * collectives themselves are ops of the op table (_c10d_functional::all_reduce, ...; their entry
 * points are in ops.h), so they run eagerly, trace into graphs, print, parse and compile like
 * any op. Their group_name argument names a group of this header ("0" is the world).
 *
 * Launched by mpirun (or any launcher that sets OpenMPI's OMPI_COMM_WORLD_SIZE, or PMIx's
 * PMIX_RANK), ag_dist_init initializes MPI and the world has one rank per process. Started any
 * other way it does not touch MPI: the world has size 1, every collective is a copy, and a
 * program written for N ranks runs as one process.
 *
 * Threads. MPI is initialized with MPI_THREAD_SERIALIZED: one thread at a time may run a
 * collective or a call of this header, and every rank must issue the collectives of a group in
 * the same order (as MPI requires). Kernels stay multi-threaded (OpenMP) inside each rank.
 *
 * Asynchrony. A collective's kernel starts the communication and returns; wait_tensor completes
 * it. Eagerly, the output stays valid however it is used before its wait: reading it (any op,
 * a view's reader, ag_tensor_data, ag_tensor_item_at, ag_tensor_to_doubles) first waits for the
 * result, as PyTorch's AsyncCollectiveTensor waits on first use, and freeing it (or ending its
 * scope) before the wait is safe: the pending collective keeps the output's storage until it
 * completes (at a wait, at ag_dist_progress on the thread that started it, or at
 * ag_dist_finalize). In a compiled graph every collective's result goes through wait_tensor
 * before any other use, and the executor keeps the output's buffer until that wait.
 *
 * Failure. A rank that fails calls ag_dist_abort (the CLI does on any error once training runs):
 * it prints "aotgrad: rank R of N: <message>" and ends every rank of the job (MPI_Abort), so no
 * rank waits forever for a dead peer. A collective that has not completed after the timeout
 * (ag_dist_set_timeout; default 300 s, 0 disables) aborts the job the same way, naming the
 * op, the group and how long it waited. */
#ifndef AOTGRAD_DIST_H
#define AOTGRAD_DIST_H

#include "core.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ag_group ag_group;

/* Initializes the world (idempotent: a second call returns 0 and does nothing). Uses MPI when
 * launched by an MPI launcher (see above) or when the program already called MPI_Init; then
 * ag_dist_finalize calls MPI_Finalize only if ag_dist_init called MPI_Init. 0, or a negative
 * AG_E* code with a message (MPI failed to start). */
AG_API int ag_dist_init(void);
/* Waits for every pending collective, frees the groups made by ag_group_split and finalizes MPI
 * (if this library initialized it). Idempotent; after it ag_dist_init may not be called again
 * when MPI was used (MPI's rule). */
AG_API int ag_dist_finalize(void);
AG_API bool ag_dist_is_initialized(void);
/* True when the world runs on MPI (even with one rank). */
AG_API bool ag_dist_uses_mpi(void);

/* The world group (borrowed; NULL before ag_dist_init). Its name is "0". */
AG_API ag_group *ag_dist_world(void);
AG_API int ag_group_rank(const ag_group *g); /* this process's rank in g */
AG_API int ag_group_size(const ag_group *g);
AG_API const char *ag_group_name(const ag_group *g); /* borrowed */
/* The group named `name` ("0", or a name ag_group_split gave); borrowed; NULL when none. */
AG_API ag_group *ag_group_find(const char *name);
/* MPI_Comm_split: every rank of parent calls it with its color (>= 0) and key; ranks with the
 * same color form one group, ordered by key then parent rank. Groups are named "1", "2", ... in
 * the order of the splits, the same on every rank (a split's groups share one name: each rank
 * belongs to exactly one of them). The library owns the group (freed by ag_dist_finalize). NULL
 * with a message on failure (on every rank). */
AG_API ag_group *ag_group_split(ag_group *parent, int color, int key);
/* Blocks until every rank of g reached it. */
AG_API int ag_group_barrier(ag_group *g);

/* Ends the whole job: prints "aotgrad: rank R of N: <message>" on stderr and calls MPI_Abort
 * with code (exit(code) in a world without MPI; a negative AG_E* code is made positive). A NULL
 * fmt prints "(no message)". Does not return. */
AG_API void ag_dist_abort(int code, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((noreturn, format(printf, 2, 3)))
#endif
    ;
/* Seconds a collective may take before the job is aborted (0: wait forever). Process-wide. */
AG_API void ag_dist_set_timeout(double seconds);
AG_API double ag_dist_timeout(void);

/* Makes progress on pending collectives without blocking (MPI_Test on each). The executor calls
 * it between nodes so that communication moves on while kernels run; a program that overlaps
 * eager work with a started collective may call it too. */
AG_API void ag_dist_progress(void);

/* ---- statistics: what the collectives cost (this thread's counters) ---- */
typedef struct ag_comm_stats {
    int64_t collectives; /* collectives started */
    int64_t bytes_sent;  /* bytes this rank sent, by the ring formulas of ag_comm_bytes */
    double busy_s;       /* seconds from each collective's start to its completion, summed */
    double wait_s;       /* seconds spent blocked in wait_tensor (the exposed communication) */
} ag_comm_stats;
AG_API void ag_comm_stats_get(ag_comm_stats *s);
AG_API void ag_comm_stats_reset(void);

/* ---- the cost model: time = latency * steps + bytes / bandwidth ----
 * `bytes` is the op's per-rank payload: the input of all_reduce, reduce_scatter_tensor,
 * all_to_all_single and broadcast, the output of all_gather_into_tensor. On n ranks the ring
 * algorithms send per rank: all_reduce 2(n-1)/n x bytes in 2(n-1) steps, all_gather and
 * reduce_scatter (n-1)/n x bytes in n-1 steps, all_to_all (n-1)/n x bytes in n-1 steps,
 * broadcast bytes in ceil(log2 n) steps; wait_tensor and n = 1 cost nothing. */
typedef struct ag_comm_model {
    double latency_s;     /* per step */
    double bandwidth_Bps; /* bytes per second per rank */
} ag_comm_model;
/* The model in use (process-wide). Its default is what bench/bench_comm measured on the
 * development machine (docs/DISTRIBUTED.md); set your own from its output. */
AG_API void ag_comm_model_get(ag_comm_model *m);
AG_API int ag_comm_model_set(const ag_comm_model *m); /* AG_EINVAL unless both > 0, finite */
/* Bytes one rank sends and predicted seconds for collective `op` ("all_reduce",
 * "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "broadcast",
 * "wait_tensor", with or without the "_c10d_functional::" prefix) on n ranks; -1 for an unknown
 * op. */
AG_API double ag_comm_bytes(const char *op, double bytes, int n);
AG_API double ag_comm_time(const char *op, double bytes, int n);

#ifdef __cplusplus
}
#endif
#endif
