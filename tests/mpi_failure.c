/* A job in which one rank fails while its peers wait in a collective; tests/mpi_failure.sh runs
 * it under mpirun and checks that the job ends within seconds with the failing rank's message.
 *   mpi_failure abort    rank 1 meets a bad input and calls ag_dist_abort
 *   mpi_failure exit     rank 1 exits without a word (a crashed process)
 *   mpi_failure timeout  rank 1 never joins; rank 0's wait gives up after the 2 s timeout */
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "aotgrad.h"

int main(int argc, char **argv) {
    if (argc != 2 || ag_dist_init())
        return 2;
    const char *mode = argv[1];
    ag_group *w = ag_dist_world();
    int rank = ag_group_rank(w);
    ag_dist_set_timeout(!strcmp(mode, "timeout") ? 2 : 60);
    ag_tensor *x = ag_ones(AG_F32, 1, (int64_t[]){16});
    if (rank == 1) {
        if (!strcmp(mode, "abort")) {
            /* A bad input on this rank only. */
            ag_tensor *bad = ag_all_gather_into_tensor(x, 3, "0");
            if (!bad)
                ag_dist_abort(1, "%s", ag_last_error());
        } else if (!strcmp(mode, "exit")) {
            _exit(3);
        } else {
            sleep(60);
        }
        return 0;
    }
    ag_tensor *y = ag_wait_tensor(ag_all_reduce(x, "sum", "0"));
    printf("rank %d: all_reduce completed (%p): the failure went unnoticed\n", rank, (void *)y);
    ag_dist_finalize();
    return 0;
}
