/* Process groups over MPI: the world, its splits, abort and the timeout (dist.h).
 *
 * Enters: the process's environment (was it started by an MPI launcher?). Leaves: ag_group
 * handles naming an MPI communicator each (a duplicate of MPI_COMM_WORLD for the world, so the
 * library's collectives never match a user's own MPI calls), or, in a process no launcher
 * started, a world of size 1 on which MPI is never called. Groups are named by a counter ("0"
 * the world, then one name per ag_group_split), so every rank names the same split the same.
 * MPI errors return to us (MPI_ERRORS_RETURN) and end the job through ag_dist_abort with the
 * op, group and MPI's own message. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../core/internal.h"
#include "pending.h"
#include "procgroup.h"

pthread_mutex_t ag__mpi_lock = PTHREAD_MUTEX_INITIALIZER;

static pthread_mutex_t state_lock = PTHREAD_MUTEX_INITIALIZER;
static ag_group *groups;   /* the world, then the splits, in order */
static bool initialized;   /* between ag_dist_init and ag_dist_finalize */
static bool uses_mpi;      /* the world runs on MPI */
static bool we_init_mpi;   /* ag_dist_init called MPI_Init (so finalize calls MPI_Finalize) */
static bool mpi_finalized; /* MPI was finalized: it may not start again */
static int nsplits;
static _Atomic double timeout_s = 300.0;

double ag__dist_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Started by a launcher: OpenMPI's mpirun sets OMPI_COMM_WORLD_SIZE, PMIx launchers PMIX_RANK. */
static bool launched(void) {
    return getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMIX_RANK");
}

static ag_group *group_new(const char *name, MPI_Comm comm, int rank, int size) {
    ag_group *g = ag__calloc(1, sizeof *g);
    if (!g)
        return NULL;
    snprintf(g->name, sizeof g->name, "%s", name);
    g->comm = comm;
    g->rank = rank;
    g->size = size;
    return g;
}

static int mpi_err(const char *what, int err) {
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    if (MPI_Error_string(err, msg, &len) != MPI_SUCCESS)
        snprintf(msg, sizeof msg, "error %d", err);
    return ag__err(AG_ESTATE, "dist_init: %s failed: %s", what, msg);
}

static int init_mpi(void) {
    int already = 0;
    MPI_Initialized(&already);
    if (!already && !launched())
        return 0;
    if (mpi_finalized)
        return ag__err(AG_ESTATE, "dist_init: MPI was finalized by ag_dist_finalize and cannot "
                                  "start again");
    if (!already) {
        int provided = 0;
        int rc = MPI_Init_thread(NULL, NULL, MPI_THREAD_SERIALIZED, &provided);
        if (rc != MPI_SUCCESS)
            return mpi_err("MPI_Init_thread", rc);
        we_init_mpi = true;
    }
    MPI_Comm comm;
    int rc = MPI_Comm_dup(MPI_COMM_WORLD, &comm);
    if (rc != MPI_SUCCESS)
        return mpi_err("MPI_Comm_dup", rc);
    MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
    int rank = 0, size = 1;
    MPI_Comm_rank(comm, &rank);
    MPI_Comm_size(comm, &size);
    ag_group *w = group_new("0", comm, rank, size);
    if (!w) {
        MPI_Comm_free(&comm);
        return AG_ENOMEM;
    }
    groups = w;
    uses_mpi = true;
    return 0;
}

int ag_dist_init(void) {
    pthread_mutex_lock(&state_lock);
    int rc = 0;
    if (!initialized) {
        rc = init_mpi();
        if (!rc && !groups) {
            groups = group_new("0", MPI_COMM_NULL, 0, 1);
            if (!groups)
                rc = AG_ENOMEM;
        }
        if (!rc) {
            initialized = true;
            nsplits = 0;
        }
    }
    pthread_mutex_unlock(&state_lock);
    return rc;
}

int ag_dist_finalize(void) {
    if (!ag_dist_is_initialized())
        return 0;
    int rc = ag__pending_wait_all();
    pthread_mutex_lock(&state_lock);
    for (ag_group *g = groups, *next; g; g = next) {
        next = g->next;
        if (g->comm != MPI_COMM_NULL)
            MPI_Comm_free(&g->comm);
        ag__free(g);
    }
    groups = NULL;
    if (uses_mpi && we_init_mpi) {
        MPI_Finalize();
        mpi_finalized = true;
    }
    initialized = uses_mpi = we_init_mpi = false;
    pthread_mutex_unlock(&state_lock);
    return rc;
}

bool ag_dist_is_initialized(void) {
    pthread_mutex_lock(&state_lock);
    bool r = initialized;
    pthread_mutex_unlock(&state_lock);
    return r;
}

bool ag_dist_uses_mpi(void) {
    pthread_mutex_lock(&state_lock);
    bool r = initialized && uses_mpi;
    pthread_mutex_unlock(&state_lock);
    return r;
}

ag_group *ag_dist_world(void) {
    pthread_mutex_lock(&state_lock);
    ag_group *w = initialized ? groups : NULL;
    pthread_mutex_unlock(&state_lock);
    return w;
}

int ag_group_rank(const ag_group *g) {
    return g ? g->rank : -1;
}
int ag_group_size(const ag_group *g) {
    return g ? g->size : 0;
}
const char *ag_group_name(const ag_group *g) {
    return g ? g->name : NULL;
}

ag_group *ag_group_find(const char *name) {
    if (!name)
        return NULL;
    pthread_mutex_lock(&state_lock);
    ag_group *g = groups;
    while (g && strcmp(g->name, name))
        g = g->next;
    pthread_mutex_unlock(&state_lock);
    return g;
}

int ag__dist_group(const char *op, const char *name, ag_group **out) {
    *out = NULL;
    if (!ag_dist_is_initialized()) {
        int already = 0;
        MPI_Initialized(&already);
        if (launched() || already)
            return ag__err(AG_ESTATE,
                           "%s: the default process group has not been initialized: call "
                           "ag_dist_init first",
                           op);
        int rc = ag_dist_init();
        if (rc)
            return rc;
    }
    *out = ag_group_find(name);
    if (!*out)
        return ag__err(AG_EINVAL, "%s: no process group named '%s' (\"0\" is the world)", op,
                       name ? name : "None");
    return 0;
}

ag_group *ag_group_split(ag_group *parent, int color, int key) {
    if (!parent)
        return ag__err(AG_EINVAL, "group_split: parent is NULL"), NULL;
    if (color < 0)
        return ag__err(AG_EINVAL, "group_split: color must be >= 0, got %d", color), NULL;
    /* Ranks agree on the name because they make their splits in the same order. */
    char name[16];
    pthread_mutex_lock(&state_lock);
    snprintf(name, sizeof name, "%d", nsplits + 1);
    pthread_mutex_unlock(&state_lock);
    MPI_Comm comm = MPI_COMM_NULL;
    int rank = 0, size = 1;
    if (parent->comm != MPI_COMM_NULL) {
        pthread_mutex_lock(&ag__mpi_lock);
        int rc = MPI_Comm_split(parent->comm, color, key, &comm);
        if (rc == MPI_SUCCESS) {
            MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
            MPI_Comm_rank(comm, &rank);
            MPI_Comm_size(comm, &size);
        }
        pthread_mutex_unlock(&ag__mpi_lock);
        if (rc != MPI_SUCCESS)
            ag__dist_mpi_fail("group_split", parent, "MPI_Comm_split", rc);
    }
    ag_group *g = group_new(name, comm, rank, size);
    if (!g) {
        if (comm != MPI_COMM_NULL)
            MPI_Comm_free(&comm);
        return NULL;
    }
    pthread_mutex_lock(&state_lock);
    ag_group **tail = &groups;
    while (*tail)
        tail = &(*tail)->next;
    *tail = g;
    nsplits++;
    pthread_mutex_unlock(&state_lock);
    return g;
}

int ag_group_barrier(ag_group *g) {
    AG__CHECK_NULL("group_barrier", g);
    if (g->comm == MPI_COMM_NULL || g->size == 1)
        return 0;
    pthread_mutex_lock(&ag__mpi_lock);
    MPI_Request req;
    int rc = MPI_Ibarrier(g->comm, &req);
    pthread_mutex_unlock(&ag__mpi_lock);
    if (rc != MPI_SUCCESS)
        ag__dist_mpi_fail("barrier", g, "MPI_Ibarrier", rc);
    return ag__pending_wait_request(&req, "barrier", g);
}

/* ---- failure ---- */

static void vabort(int code, const char *fmt, va_list ap) __attribute__((noreturn));
static void vabort(int code, const char *fmt, va_list ap) {
    int rank = 0, size = 1, mpi_up = 0, mpi_down = 0;
    MPI_Initialized(&mpi_up);
    MPI_Finalized(&mpi_down);
    bool mpi = mpi_up && !mpi_down;
    if (mpi) {
        MPI_Comm_rank(MPI_COMM_WORLD, &rank);
        MPI_Comm_size(MPI_COMM_WORLD, &size);
    }
    char msg[1024];
    if (fmt)
        vsnprintf(msg, sizeof msg, fmt, ap);
    else
        snprintf(msg, sizeof msg, "(no message)");
    /* One write, so that ranks' lines do not interleave mid-line. */
    fprintf(stderr, "aotgrad: rank %d of %d: %s\n", rank, size, msg);
    fflush(stderr);
    fflush(stdout);
    /* A negative AG_E* status becomes its absolute value: exit statuses are 0..255. */
    if (mpi)
        MPI_Abort(MPI_COMM_WORLD, code < 0 ? -code : code);
    exit(code < 0 ? -code : code);
}

void ag_dist_abort(int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vabort(code, fmt, ap);
}

void ag__dist_mpi_fail(const char *op, const ag_group *g, const char *what, int err) {
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    if (MPI_Error_string(err, msg, &len) != MPI_SUCCESS)
        snprintf(msg, sizeof msg, "error %d", err);
    ag_dist_abort(1, "%s on group '%s': %s failed: %s", op, g ? g->name : "?", what, msg);
}

void ag_dist_set_timeout(double seconds) {
    timeout_s = isfinite(seconds) && seconds > 0 ? seconds : 0;
}

double ag_dist_timeout(void) {
    return timeout_s;
}
