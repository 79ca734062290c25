/* Collectives in flight: what the kernels of src/ops/collectives.c start and wait_tensor
 * completes. MPI stays inside src/dist: callers describe a collective by kind and tensors. */
#ifndef AG_PENDING_H
#define AG_PENDING_H

#include "../core/internal.h"
#include "aotgrad/dist.h"

/* The group named `name` for collective `op`: initializes a world of size 1 first when no
 * launcher started this process and ag_dist_init was not called (so single-process programs
 * need no setup); an error naming op and group when there is no such group, or when a
 * launcher started the process and ag_dist_init was not called. */
int ag__dist_group(const char *op, const char *name, ag_group **out);

typedef enum ag__coll_kind {
    AG__COLL_ALL_REDUCE,
    AG__COLL_ALL_GATHER,     /* along dim 0, rank order */
    AG__COLL_REDUCE_SCATTER, /* along dim 0, equal blocks */
    AG__COLL_ALL_TO_ALL,     /* rows per rank in send_rows / recv_rows */
    AG__COLL_BROADCAST,
} ag__coll_kind;

typedef struct ag__coll {
    ag__coll_kind kind;
    const char *op; /* "all_reduce", ...: named in messages and the stats */
    ag_group *group;
    const char *reduce_op; /* "sum", "avg", "max", "min" for the reductions */
    int root;              /* broadcast's src */
    /* Contiguous copy of the input, owned by the collective from the call on (freed when it
     * completes, or at once when the start fails). */
    ag_tensor *staging;
    /* The output (contiguous, allocated by the dispatcher, borrowed): MPI writes into it and
     * its data pointer is the key wait_tensor completes. */
    ag_tensor *out;
    const int64_t *send_rows, *recv_rows; /* all_to_all: group size entries each (copied) */
    int64_t row_elems;                    /* all_to_all: elements per row of dim 0 */
} ag__coll;

/* Starts c (checked by the caller against the group). A group of one rank completes at once.
 * 0, or a negative code with a message (counts beyond MPI's int); an MPI failure aborts the
 * job (ag_dist_abort). */
int ag__coll_start(ag__coll *c);
/* Completes the collective whose output data is `data`: 1 when there was one (avg divided by
 * the group size), 0 when none is pending for it. Blocks, aborting the job after the timeout. */
int ag__coll_wait(const void *data);
/* Eager calls (the dispatcher, right after a collective's kernel started it): the entry for
 * out's data takes a reference on out's storage, dropped when the collective completes, so
 * freeing out before the wait cannot hand MPI's destination to a new owner. No-op when none is
 * pending for it. The planned executor never calls it (see pending.c). */
void ag__coll_hold(ag_tensor *out);
/* Completes every collective whose entry holds storage st (an eager op is about to read it):
 * how many. One atomic load when no entry holds a storage. */
int ag__pending_wait_storage(const ag_storage *st);
/* The check that every rank of g issues the same collectives in the same order
 * (src/dist/seq_check.c): hashes[i] (never 0) and descs[i] (what a message shows, e.g.
 * "all_reduce(f32, 4096 elements, 'sum', '0') at %ar") describe this rank's n collectives on
 * g. 0 when every rank of g has the same sequence (at once for a group of one rank); otherwise
 * the job ends on every rank (ag_dist_abort) with `what`, the first collective that differs and
 * what rank 0 and a differing rank run there. AG_ENOMEM before communicating. Every rank of g
 * must call it at the same point of its program, as for any collective. */
int ag__dist_check_sequence(const char *what, ag_group *g, const uint64_t *hashes,
                            const char *const *descs, int64_t n);
/* Completes every pending collective (ag_dist_finalize). */
int ag__pending_wait_all(void);
/* Waits for one MPI request (an MPI_Request *) under the timeout; `op` and g name it. */
int ag__pending_wait_request(void *mpi_request, const char *op, ag_group *g);

#endif
