/* Collectives in flight: starting them (nonblocking MPI), making progress, completing them,
 * the timeout watchdog and the comm statistics.
 *
 * Enters: an ag__coll from a collective's kernel (its input already copied into a staging
 * tensor the entry owns, so the executor may reuse the input's buffer at once). Leaves: the
 * output tensor filled when wait_tensor (ag__coll_wait) completes the entry keyed by the
 * output's data pointer. The table is process-wide behind a mutex; a counter of pending entries
 * makes ag_dist_progress a single atomic load when nothing is in flight (the planned executor
 * calls it between steps). Waits poll MPI_Test with a deadline: a collective a peer never joins
 * ends the job with the op, the group and the seconds waited instead of hanging.
 *
 * Who keeps the output's memory alive until MPI is done writing it:
 *   - eager calls (the dispatcher): the entry holds a reference on the output's storage
 *     (ag__coll_hold), dropped when the collective completes: by wait_tensor, by the
 *     dispatcher's wait before an op reads the storage (ag__pending_wait_storage), by
 *     ag_dist_progress on the thread that started it, or by ag_dist_finalize. So a program
 *     may free the output (or end its scope) before the wait: MPI never writes into memory
 *     with a new owner, and nothing leaks once the collective completes;
 *   - the planned executor: arena buffers are not reference-counted, so no reference is taken;
 *     the plan keeps the output's buffer alive until the wait_tensor that reads it (a value
 *     lives until its last reader, and every collective's single reader is its wait), and a
 *     plan must not be freed while a run's collective is pending (runs end with every wait
 *     done). */
#include <limits.h>
#include <math.h>
#include <stdatomic.h>
#include <string.h>
#include <time.h>

#include "../core/internal.h"
#include "pending.h"
#include "procgroup.h"

typedef struct pend {
    const void *key; /* the output's data */
    MPI_Request req;
    ag_group *group;
    const char *op;
    ag_tensor *staging; /* freed when complete */
    void *out;          /* the output's data, its dtype and count (avg divides it) */
    ag_dtype dtype;
    int64_t numel;
    bool avg;
    bool done; /* completed by ag_dist_progress, not yet waited */
    double t0; /* start */
    int *vecs; /* all_to_all: send counts, send displs, recv counts, recv displs */
    /* Eager calls: a reference on the output's storage, dropped at completion (NULL for the
     * planned executor's buffers), and the thread that took it. */
    ag_storage *hold;
    pthread_t owner;
} pend;

static pthread_mutex_t table_lock = PTHREAD_MUTEX_INITIALIZER;
static pend *table;
static int64_t ntable, table_cap;
static atomic_int npending; /* entries in the table: progress skips everything when 0 */
static atomic_int nheld;    /* entries holding a storage: the dispatcher's check when 0 */

static _Thread_local ag_comm_stats stats;

void ag_comm_stats_get(ag_comm_stats *s) {
    if (s)
        *s = stats;
}
void ag_comm_stats_reset(void) {
    memset(&stats, 0, sizeof stats);
}

static MPI_Datatype mpi_type(ag_dtype dt) {
    switch (dt) {
    case AG_F32:
        return MPI_FLOAT;
    case AG_F64:
        return MPI_DOUBLE;
    case AG_I64:
        return MPI_INT64_T;
    case AG_BOOL:
        return MPI_C_BOOL;
    default:
        return MPI_DATATYPE_NULL;
    }
}

/* bool's max and min are or and and (MPI defines no order on C booleans). */
static MPI_Op mpi_op(const char *r, ag_dtype dt) {
    if (!strcmp(r, "max"))
        return dt == AG_BOOL ? MPI_LOR : MPI_MAX;
    if (!strcmp(r, "min"))
        return dt == AG_BOOL ? MPI_LAND : MPI_MIN;
    return MPI_SUM; /* sum, avg */
}

static int fits_int(const char *op, const ag_group *g, int64_t n) {
    if (n >= 0 && n <= INT_MAX)
        return 0;
    return ag__err(AG_ENOTSUP,
                   "%s on group '%s': %lld elements exceed what one MPI call can move (%d)", op,
                   g->name, (long long)n, INT_MAX);
}

static void divide(void *data, ag_dtype dt, int64_t n, int by) {
    if (dt == AG_F32) {
        float *p = data;
        for (int64_t i = 0; i < n; i++)
            p[i] /= (float)by;
    } else if (dt == AG_F64) {
        double *p = data;
        for (int64_t i = 0; i < n; i++)
            p[i] /= (double)by;
    }
}

static double payload_bytes(const ag__coll *c) {
    const ag_tensor *t = c->kind == AG__COLL_ALL_GATHER ? c->out : c->staging;
    return (double)ag_tensor_numel(t) * (double)ag_dtype_size(t->dtype);
}

/* Polls req until it completes; aborts the job after the timeout (measured from the start of
 * this wait). Sleeps a little between polls after the first few, so that a rank sharing a
 * core with its peers lets them run. */
static void wait_mpi(MPI_Request *req, const char *op, const ag_group *g) {
    double limit = ag_dist_timeout(), start = ag__dist_now();
    for (int spin = 0;; spin++) {
        int flag = 0;
        pthread_mutex_lock(&ag__mpi_lock);
        int rc = MPI_Test(req, &flag, MPI_STATUS_IGNORE);
        pthread_mutex_unlock(&ag__mpi_lock);
        if (rc != MPI_SUCCESS)
            ag__dist_mpi_fail(op, g, "MPI_Test", rc);
        if (flag)
            return;
        if (limit > 0 && ag__dist_now() - start > limit)
            ag_dist_abort(1,
                          "%s on group '%s' has not completed after %.3g s (the timeout, "
                          "ag_dist_set_timeout): a rank of the group failed or never reached it",
                          op, g->name, limit);
        if (spin > 64) {
            struct timespec ts = {0, spin > 4096 ? 200000 : 20000};
            nanosleep(&ts, NULL);
        }
    }
}

int ag__pending_wait_request(void *mpi_request, const char *op, ag_group *g) {
    wait_mpi((MPI_Request *)mpi_request, op, g);
    return 0;
}

/* Finishes an entry already removed from the table: waits if needed, divides for avg, frees
 * what it owns. */
static void finish(pend *p, bool count_wait) {
    double t = ag__dist_now();
    if (!p->done) {
        wait_mpi(&p->req, p->op, p->group);
        double end = ag__dist_now();
        stats.busy_s += end - p->t0;
        if (count_wait)
            stats.wait_s += end - t;
    }
    if (p->avg)
        divide(p->out, p->dtype, p->numel, p->group->size);
    ag_tensor_free(p->staging);
    ag__free(p->vecs);
    ag__storage_release(p->hold);
}

static int table_add(const pend *p) {
    pthread_mutex_lock(&table_lock);
    int rc = ag__grow((void **)&table, &table_cap, ntable + 1, sizeof *table);
    if (!rc) {
        table[ntable++] = *p;
        atomic_fetch_add(&npending, 1);
    }
    pthread_mutex_unlock(&table_lock);
    return rc;
}

/* Removes entry i (the table locked). */
static void table_remove_locked(int64_t i) {
    if (table[i].hold)
        atomic_fetch_sub(&nheld, 1);
    table[i] = table[--ntable];
    atomic_fetch_sub(&npending, 1);
    if (ntable == 0) {
        ag__free(table);
        table = NULL;
        table_cap = 0;
    }
}

/* Removes the first entry whose output data is key (key non-NULL) or whose held storage is st
 * into *out; false when none. */
static bool table_take(const void *key, const ag_storage *st, pend *out) {
    bool found = false;
    pthread_mutex_lock(&table_lock);
    for (int64_t i = 0; i < ntable; i++)
        if (key ? table[i].key == key : table[i].hold == st) {
            *out = table[i];
            table_remove_locked(i);
            found = true;
            break;
        }
    pthread_mutex_unlock(&table_lock);
    return found;
}

int ag__coll_wait(const void *data) {
    if (!data || atomic_load(&npending) == 0)
        return 0;
    pend p;
    if (!table_take(data, NULL, &p))
        return 0;
    finish(&p, true);
    return 1;
}

int ag__pending_wait_storage(const ag_storage *st) {
    if (!st || atomic_load(&nheld) == 0)
        return 0;
    int n = 0;
    pend p;
    while (table_take(NULL, st, &p)) {
        finish(&p, true);
        n++;
    }
    return n;
}

/* core's readers of tensor data (ag_tensor_data, ag_tensor_item_at, ...) call this. */
static void wait_storage_hook(const ag_storage *st) {
    ag__pending_wait_storage(st);
}

void ag__coll_hold(ag_tensor *out) {
    if (!out || atomic_load(&npending) == 0)
        return;
    const void *key = ag__base(out);
    pthread_mutex_lock(&table_lock);
    for (int64_t i = 0; i < ntable; i++)
        if (table[i].key == key && !table[i].hold) {
            table[i].hold = out->storage;
            table[i].owner = pthread_self();
            out->storage->refcount++;
            atomic_fetch_add(&nheld, 1);
            break;
        }
    pthread_mutex_unlock(&table_lock);
    atomic_store(&ag__data_wait_hook, wait_storage_hook);
}

int ag__pending_wait_all(void) {
    while (atomic_load(&npending) > 0) {
        pend p;
        pthread_mutex_lock(&table_lock);
        bool any = ntable > 0;
        if (any) {
            p = table[0];
            table_remove_locked(0);
        }
        pthread_mutex_unlock(&table_lock);
        if (any)
            finish(&p, false);
    }
    return 0;
}

/* A collective found complete: an eager one started on this thread is finished at once (its
 * storage reference dropped, so a freed output's memory returns now rather than at a wait that
 * may never come); the others are marked done for their wait (the storage reference counts
 * are not atomic: only the thread that took one drops it early). */
void ag_dist_progress(void) {
    if (atomic_load_explicit(&npending, memory_order_relaxed) == 0)
        return;
    pthread_t self = pthread_self();
    pthread_mutex_lock(&table_lock);
    for (int64_t i = 0; i < ntable;) {
        pend *p = &table[i];
        if (!p->done) {
            int flag = 0;
            pthread_mutex_lock(&ag__mpi_lock);
            int rc = MPI_Test(&p->req, &flag, MPI_STATUS_IGNORE);
            pthread_mutex_unlock(&ag__mpi_lock);
            if (rc != MPI_SUCCESS)
                ag__dist_mpi_fail(p->op, p->group, "MPI_Test", rc);
            if (flag) {
                p->done = true;
                stats.busy_s += ag__dist_now() - p->t0;
            }
        }
        if (p->done && p->hold && pthread_equal(p->owner, self)) {
            pend q = *p;
            table_remove_locked(i);
            finish(&q, false);
            continue;
        }
        i++;
    }
    pthread_mutex_unlock(&table_lock);
}

/* A group of one rank: the collective is a copy of the input. */
static int complete_local(ag__coll *c) {
    int rc = ag__copy_into(c->out, c->staging);
    ag_tensor_free(c->staging);
    c->staging = NULL;
    return rc;
}

static int start_mpi(ag__coll *c, pend *p) {
    ag_group *g = c->group;
    MPI_Datatype dt = mpi_type(c->staging->dtype);
    int64_t nin = ag_tensor_numel(c->staging), nout = ag_tensor_numel(c->out);
    void *send = ag__base(c->staging), *recv = ag__base(c->out);
    int rc = fits_int(c->op, g, nin);
    if (!rc)
        rc = fits_int(c->op, g, nout);
    if (rc)
        return rc;
    const char *what = NULL;
    int mrc = MPI_SUCCESS;
    pthread_mutex_lock(&ag__mpi_lock);
    switch (c->kind) {
    case AG__COLL_ALL_REDUCE:
        what = "MPI_Iallreduce";
        mrc = MPI_Iallreduce(send, recv, (int)nin, dt, mpi_op(c->reduce_op, c->staging->dtype),
                             g->comm, &p->req);
        break;
    case AG__COLL_ALL_GATHER:
        what = "MPI_Iallgather";
        mrc = MPI_Iallgather(send, (int)nin, dt, recv, (int)nin, dt, g->comm, &p->req);
        break;
    case AG__COLL_REDUCE_SCATTER:
        what = "MPI_Ireduce_scatter_block";
        mrc = MPI_Ireduce_scatter_block(send, recv, (int)nout, dt,
                                        mpi_op(c->reduce_op, c->staging->dtype), g->comm, &p->req);
        break;
    case AG__COLL_BROADCAST:
        /* MPI broadcasts in place: the root's data must already be in the output. */
        what = "MPI_Ibcast";
        if (g->rank == c->root)
            memcpy(recv, send, (size_t)nin * ag_dtype_size(c->staging->dtype));
        mrc = MPI_Ibcast(recv, (int)nout, dt, c->root, g->comm, &p->req);
        break;
    case AG__COLL_ALL_TO_ALL: {
        what = "MPI_Ialltoallv";
        int n = g->size;
        int *v = p->vecs;
        int64_t soff = 0, roff = 0;
        for (int s = 0; s < n; s++) {
            int64_t sc = c->send_rows[s] * c->row_elems, rcnt = c->recv_rows[s] * c->row_elems;
            v[s] = (int)sc, v[n + s] = (int)soff, v[2 * n + s] = (int)rcnt,
            v[3 * n + s] = (int)roff;
            soff += sc;
            roff += rcnt;
        }
        mrc = MPI_Ialltoallv(send, v, v + n, dt, recv, v + 2 * n, v + 3 * n, dt, g->comm, &p->req);
        break;
    }
    }
    pthread_mutex_unlock(&ag__mpi_lock);
    if (mrc != MPI_SUCCESS)
        ag__dist_mpi_fail(c->op, g, what, mrc);
    return 0;
}

int ag__coll_start(ag__coll *c) {
    ag_group *g = c->group;
    double bytes = ag_comm_bytes(c->op, payload_bytes(c), g->size);
    if (g->size == 1 || g->comm == MPI_COMM_NULL) {
        int rc = complete_local(c);
        if (!rc)
            stats.collectives++;
        return rc;
    }
    /* An output buffer still awaiting a collective (its tensor freed without a wait) is
     * completed first, so that MPI never writes into memory that has a new owner. */
    ag__coll_wait(ag__base(c->out));
    pend p = {.key = ag__base(c->out),
              .group = g,
              .op = c->op,
              .staging = c->staging,
              .out = ag__base(c->out),
              .dtype = c->out->dtype,
              .numel = ag_tensor_numel(c->out),
              .avg = c->reduce_op && !strcmp(c->reduce_op, "avg"),
              .t0 = ag__dist_now()};
    int rc = 0;
    if (c->kind == AG__COLL_ALL_TO_ALL) {
        p.vecs = ag__malloc(sizeof(int) * 4 * (size_t)g->size);
        if (!p.vecs)
            rc = AG_ENOMEM;
        int64_t ssum = 0, rsum = 0;
        for (int s = 0; !rc && s < g->size; s++) {
            ssum += c->send_rows[s] * c->row_elems;
            rsum += c->recv_rows[s] * c->row_elems;
        }
        if (!rc)
            rc = fits_int(c->op, g, ssum > rsum ? ssum : rsum);
    }
    if (!rc)
        rc = start_mpi(c, &p);
    if (!rc) {
        stats.collectives++;
        stats.bytes_sent += (int64_t)bytes;
        c->staging = NULL;
        /* The collective runs whatever happens now: without room in the table, complete it
         * here rather than lose track of its buffers. */
        if (table_add(&p))
            finish(&p, false);
        return 0;
    }
    ag__free(p.vecs);
    ag_tensor_free(c->staging);
    c->staging = NULL;
    return rc;
}
