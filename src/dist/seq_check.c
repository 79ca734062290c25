/* The check that every rank of a group issues the same collectives in the same order (MPI
 * matches collectives by their order on a communicator: a rank whose compiled graph differs
 * would pair its all_reduce with a peer's all_gather, and the job would hang or compute
 * garbage).
 *
 * Enters: this rank's sequence of collectives on one group, as a hash per collective and a
 * description of each (src/runtime/coll_order.c builds them from a plan). Leaves: 0 when every
 * rank of the group has the same sequence; otherwise the job ends on every rank with a message
 * naming the first collective that differs and what each side runs there. The common case costs
 * one all_gather of two integers per rank; only a mismatch exchanges the per-collective hashes
 * and then the two descriptions, so that each rank can say what its peer runs. */
#include <stdio.h>
#include <string.h>

#include "../core/internal.h"
#include "pending.h"
#include "procgroup.h"

#define DESC_BYTES 160 /* one description on the wire */

/* All-gathers `count` uint64 from every rank of g into `all` (g->size * count). */
static void gather_u64(ag_group *g, const uint64_t *mine, uint64_t *all, int count) {
    MPI_Request req;
    pthread_mutex_lock(&ag__mpi_lock);
    int rc = MPI_Iallgather(mine, count, MPI_UINT64_T, all, count, MPI_UINT64_T, g->comm, &req);
    pthread_mutex_unlock(&ag__mpi_lock);
    if (rc != MPI_SUCCESS)
        ag__dist_mpi_fail("collective check", g, "MPI_Iallgather", rc);
    ag__pending_wait_request(&req, "collective check", g);
}

static void gather_bytes(ag_group *g, const char *mine, char *all, int count) {
    MPI_Request req;
    pthread_mutex_lock(&ag__mpi_lock);
    int rc = MPI_Iallgather(mine, count, MPI_CHAR, all, count, MPI_CHAR, g->comm, &req);
    pthread_mutex_unlock(&ag__mpi_lock);
    if (rc != MPI_SUCCESS)
        ag__dist_mpi_fail("collective check", g, "MPI_Iallgather", rc);
    ag__pending_wait_request(&req, "collective check", g);
}

static uint64_t mix(uint64_t h, uint64_t x) {
    h ^= x + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    return h;
}

int ag__dist_check_sequence(const char *what, ag_group *g, const uint64_t *hashes,
                            const char *const *descs, int64_t n) {
    if (!g || g->size == 1 || g->comm == MPI_COMM_NULL)
        return 0;
    uint64_t mine[2] = {(uint64_t)n, 0x51ed270b27a1f1a3ull};
    for (int64_t i = 0; i < n; i++)
        mine[1] = mix(mine[1], hashes[i]);
    int size = g->size;
    uint64_t *all = ag__malloc(sizeof(uint64_t) * 2 * (size_t)size);
    if (!all)
        return AG_ENOMEM;
    gather_u64(g, mine, all, 2);
    bool same = true;
    uint64_t nmax = 0;
    for (int r = 0; r < size; r++) {
        same &= all[2 * r] == mine[0] && all[2 * r + 1] == mine[1];
        if (all[2 * r] > nmax)
            nmax = all[2 * r];
    }
    ag__free(all);
    if (same)
        return 0;
    /* Every rank sees the mismatch (each has every rank's pair): find the first collective
     * that differs, from everyone's per-collective hashes (0 past a sequence's end: the
     * caller's hashes are never 0). Memory failures below still end the job, less precisely. */
    int64_t first = -1;
    uint64_t *mh = ag__calloc((size_t)(nmax ? nmax : 1), sizeof(uint64_t));
    uint64_t *ah = ag__calloc((size_t)(nmax ? nmax : 1) * (size_t)size, sizeof(uint64_t));
    if (mh && ah && nmax <= (uint64_t)(INT32_MAX / 2)) {
        if (n)
            memcpy(mh, hashes, sizeof(uint64_t) * (size_t)n);
        gather_u64(g, mh, ah, (int)nmax);
        for (uint64_t i = 0; i < nmax && first < 0; i++)
            for (int r = 1; r < size; r++)
                if (ah[(size_t)r * nmax + i] != ah[i]) {
                    first = (int64_t)i;
                    break;
                }
    }
    ag__free(mh);
    ag__free(ah);
    if (first < 0)
        ag_dist_abort(1,
                      "%s: the ranks of group '%s' issue different collectives (%lld on this "
                      "rank); every rank must run the same collectives in the same order",
                      what, g->name, (long long)n);
    char d[DESC_BYTES];
    if (first < n)
        snprintf(d, sizeof d, "%s", descs[first]);
    else
        snprintf(d, sizeof d, "nothing (its %lld collectives end before)", (long long)n);
    char *ad = ag__malloc((size_t)DESC_BYTES * (size_t)size);
    if (!ad)
        ag_dist_abort(1,
                      "%s: the ranks of group '%s' issue different collectives: collective "
                      "%lld is %s on this rank",
                      what, g->name, (long long)first, d);
    gather_bytes(g, d, ad, DESC_BYTES);
    /* Name rank 0's and the first rank whose collective there differs from rank 0's. */
    int other = 1;
    for (int r = 1; r < size; r++)
        if (strncmp(ad + (size_t)r * DESC_BYTES, ad, DESC_BYTES)) {
            other = r;
            break;
        }
    char d0[DESC_BYTES], d1[DESC_BYTES];
    memcpy(d0, ad, DESC_BYTES);
    memcpy(d1, ad + (size_t)other * DESC_BYTES, DESC_BYTES);
    d0[DESC_BYTES - 1] = d1[DESC_BYTES - 1] = 0;
    ag__free(ad);
    ag_dist_abort(1,
                  "%s: the ranks of group '%s' issue different collectives: collective %lld "
                  "is %s on rank 0 but %s on rank %d; every rank must run the same collectives "
                  "in the same order",
                  what, g->name, (long long)first, d0, d1, other);
}
