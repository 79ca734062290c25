/* Calibrates the communication cost model of dist.h on this machine. Run under mpirun:
 *
 *   mpirun --allow-run-as-root --oversubscribe -np 2 build/bench_comm
 *
 * It times the library's own collectives (ag_all_reduce / ag_all_gather_into_tensor followed
 * by ag_wait_tensor, as the executor runs them): a small all_reduce for the latency, large
 * all_reduces and all_gathers of several sizes for the bandwidth. Each size is timed over
 * several rounds between barriers and the best round kept (other work on the machine only
 * ever slows a round down). The model time = latency x steps + bytes sent / bandwidth is then
 * fitted by least squares on (steps, bytes sent) per call, and rank 0 prints the two constants
 * in the form ag_comm_model_set takes. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "aotgrad.h"

#include <time.h>

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Best seconds per call of `op` on n float32 elements over `rounds` rounds of `reps` calls. */
static double time_op(const char *op, int64_t n, int reps, int rounds, int world) {
    ag_tensor *x = ag_ones(AG_F32, 1, &n);
    double best = INFINITY;
    for (int r = 0; r < rounds; r++) {
        ag_group_barrier(ag_dist_world());
        double t0 = now();
        for (int k = 0; k < reps; k++) {
            ag_scope_begin();
            ag_tensor *y = !strcmp(op, "all_reduce") ? ag_all_reduce(x, "sum", "0")
                                                     : ag_all_gather_into_tensor(x, world, "0");
            if (!y || !ag_wait_tensor(y)) {
                fprintf(stderr, "bench_comm: %s\n", ag_last_error());
                exit(1);
            }
            ag_scope_end();
        }
        double t = (now() - t0) / reps;
        /* The round takes as long as its slowest rank. */
        ag_tensor *tt = ag_full(AG_F64, 0, NULL, t);
        ag_tensor *tm = ag_wait_tensor(ag_all_reduce(tt, "max", "0"));
        t = ag_tensor_item(tm);
        ag_tensor_free(tt);
        ag_tensor_free(tm);
        if (t < best)
            best = t;
    }
    ag_tensor_free(x);
    return best;
}

int main(void) {
    if (ag_dist_init()) {
        fprintf(stderr, "bench_comm: %s\n", ag_last_error());
        return 1;
    }
    int world = ag_group_size(ag_dist_world()), rank = ag_group_rank(ag_dist_world());
    if (world < 2) {
        fprintf(stderr, "bench_comm: run it under mpirun with 2 or more ranks\n");
        ag_dist_finalize();
        return 1;
    }
    /* (steps, bytes sent, seconds) of each measurement */
    double S[32], B[32], T[32];
    int m = 0;
    const char *ops[] = {"all_reduce", "all_gather_into_tensor"};
    const int64_t sizes[] = {1, 16, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22};
    if (rank == 0)
        printf("%-24s %12s %12s %12s\n", "op", "bytes", "seconds", "GB/s sent");
    for (int o = 0; o < 2; o++)
        for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
            int64_t n = sizes[s];
            double payload = 4.0 * (double)n * (o ? world : 1);
            int reps = n <= 16 ? 2000 : n <= (1 << 18) ? 50 : 8;
            double t = time_op(ops[o], n, reps, 7, world);
            double sent = ag_comm_bytes(ops[o], payload, world);
            double steps = o ? world - 1 : 2.0 * (world - 1);
            S[m] = steps, B[m] = sent, T[m] = t;
            m++;
            if (rank == 0)
                printf("%-24s %12.0f %12.3e %12.3f\n", ops[o], payload, t, sent / t / 1e9);
        }
    /* Least squares t = a S + b B, weighting each point by 1/t (relative errors), so the small
     * calls fix the latency and the large ones the bandwidth. */
    double ss = 0, sb = 0, bb = 0, st = 0, bt = 0;
    for (int i = 0; i < m; i++) {
        double w = 1 / (T[i] * T[i]);
        ss += w * S[i] * S[i], sb += w * S[i] * B[i], bb += w * B[i] * B[i];
        st += w * S[i] * T[i], bt += w * B[i] * T[i];
    }
    double det = ss * bb - sb * sb;
    double a = (st * bb - bt * sb) / det, b = (ss * bt - sb * st) / det;
    ag_comm_model fit = {a, 1 / b};
    if (rank == 0) {
        printf("fit over %d calls on %d ranks:\n", m, world);
        printf("latency_s %.3g bandwidth_Bps %.3g\n", fit.latency_s, fit.bandwidth_Bps);
        if (ag_comm_model_set(&fit))
            printf("(not a valid model: %s)\n", ag_last_error());
        for (int i = 0; i < m; i++)
            if (B[i] > 1e6)
                printf("  model %.3e s vs measured %.3e s at %.0f bytes sent\n",
                       fit.latency_s * S[i] + B[i] / fit.bandwidth_Bps, T[i], B[i]);
    }
    ag_dist_finalize();
    return 0;
}
