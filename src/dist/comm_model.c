/* The communication cost model of dist.h: time = latency x steps + bytes sent / bandwidth, with
 * the ring algorithms' bytes and steps per collective. The partitioner's costs, the sharding
 * summary and the bench's predictions read it; ag_comm_model_set replaces its two constants.
 *
 * Defaults measured on the development machine (2 cores, OpenMPI 4.1 over shared memory) by
 *   OMP_NUM_THREADS=1 mpirun --allow-run-as-root --oversubscribe -np 2 build/bench_comm
 * (bench/bench_comm.c): three runs fitted latency 4.04e-6 .. 4.89e-6 s and bandwidth
 * 1.17e9 .. 1.24e9 B/s, with other builds on the machine; the best of each is kept. Large
 * single calls reach 1.3-1.8 GB/s, so the model is conservative for them. */
#include <math.h>
#include <pthread.h>
#include <string.h>

#include "../core/internal.h"
#include "aotgrad/dist.h"

#define DEFAULT_LATENCY_S 4.04e-6
#define DEFAULT_BANDWIDTH_BPS 1.24e9

static pthread_mutex_t model_lock = PTHREAD_MUTEX_INITIALIZER;
static ag_comm_model model = {DEFAULT_LATENCY_S, DEFAULT_BANDWIDTH_BPS};

void ag_comm_model_get(ag_comm_model *m) {
    if (!m)
        return;
    pthread_mutex_lock(&model_lock);
    *m = model;
    pthread_mutex_unlock(&model_lock);
}

int ag_comm_model_set(const ag_comm_model *m) {
    AG__CHECK_NULL("comm_model_set", m);
    if (!(isfinite(m->latency_s) && m->latency_s > 0) ||
        !(isfinite(m->bandwidth_Bps) && m->bandwidth_Bps > 0))
        return ag__err(
            AG_EINVAL,
            "comm_model_set: latency_s (%g) and bandwidth_Bps (%g) must both be positive "
            "and finite",
            m->latency_s, m->bandwidth_Bps);
    pthread_mutex_lock(&model_lock);
    model = *m;
    pthread_mutex_unlock(&model_lock);
    return 0;
}

/* Bytes sent per rank as a fraction of the payload and the number of sequential steps, for op on
 * n ranks; false for an unknown op. */
static bool ring(const char *op, int n, double *frac, double *steps) {
    static const char prefix[] = "_c10d_functional::";
    if (op && !strncmp(op, prefix, sizeof prefix - 1))
        op += sizeof prefix - 1;
    if (!op)
        return false;
    double k = n - 1;
    if (!strcmp(op, "all_reduce"))
        *frac = 2 * k / n, *steps = 2 * k;
    else if (!strcmp(op, "all_gather_into_tensor") || !strcmp(op, "reduce_scatter_tensor") ||
             !strcmp(op, "all_to_all_single"))
        *frac = k / n, *steps = k;
    else if (!strcmp(op, "broadcast"))
        *frac = 1, *steps = ceil(log2((double)n));
    else if (!strcmp(op, "wait_tensor"))
        *frac = 0, *steps = 0;
    else
        return false;
    if (n == 1)
        *frac = 0, *steps = 0;
    return true;
}

double ag_comm_bytes(const char *op, double bytes, int n) {
    double frac, steps;
    if (n < 1 || !(bytes >= 0) || !ring(op, n, &frac, &steps))
        return -1;
    return frac * bytes;
}

double ag_comm_time(const char *op, double bytes, int n) {
    double frac, steps;
    if (n < 1 || !(bytes >= 0) || !ring(op, n, &frac, &steps))
        return -1;
    ag_comm_model m;
    ag_comm_model_get(&m);
    return m.latency_s * steps + frac * bytes / m.bandwidth_Bps;
}
