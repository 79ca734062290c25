/* Max-flow on the min-cut partitioner's flow networks: igraph_maxflow against our Dinic
 * (src/partition/mincut.c), on the networks of the zoo's joints.
 *
 *   bench_maxflow [REPEATS]
 *
 * For each model (gpt2 tiny, gpt2-small, cnn, mlp; built in meta mode, exported, classified) it
 * builds the network solve_min_cut builds with upstream's default bans, checks that both
 * solvers find the same flow value, and prints the median time of each over REPEATS runs
 * (default 50); igraph's time includes building its graph from the edge list, as the
 * partitioner would have to. The partitioner was to keep igraph unless our own is clearly
 * faster: Dinic is 10-18x faster on these networks (Release build: mlp 0.8 vs 10 us, cnn 3.7
 * vs 24 us, gpt2 tiny 14 vs 145 us, gpt2-small 116 vs 2118 us), so the partitioner uses it.
 * A budget strictly between 0 and 1 solves ~45 cuts, so this matters on gpt2-small. */
#include "../src/partition/partition_internal.h"
#include "../tests/maxflow_igraph.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* ---- the benchmark ---- */

static int bench_model(const char *name, const char *config, int repeats) {
    ag_module *m;
    ag_tensor *in[8];
    int nin;
    bool prev = ag_set_meta_mode(true);
    int rc = ag_zoo_build(name, config, &m, in, 8, &nin);
    ag_set_meta_mode(prev);
    if (rc) {
        fprintf(stderr, "%s: %s\n", name, ag_last_error());
        return 1;
    }
    ag_joint *j = ag_export_joint(m, in, nin, NULL, NULL, 0, NULL);
    if (!j) {
        fprintf(stderr, "%s: export: %s\n", name, ag_last_error());
        return 1;
    }
    ag__part P;
    ag__flow_net net;
    ag__mincut_opts o = ag__mincut_default_opts();
    if (ag__part_init(&P, ag_joint_graph(j), ag_joint_num_fw_outputs(j)) ||
        ag__mincut_network(&P, &o, NULL, &net, NULL)) {
        fprintf(stderr, "%s: %s\n", name, ag_last_error());
        return 1;
    }
    double *flow = malloc(sizeof(double) * (size_t)net.nedges);
    double *ti = malloc(sizeof(double) * (size_t)repeats),
           *td = malloc(sizeof(double) * (size_t)repeats);
    double vi = 0, vd = 0;
    for (int r = 0; r < repeats; r++) {
        double t0 = now_us();
        if (ag__maxflow_igraph(&net, &vi, flow)) {
            fprintf(stderr, "%s: igraph: %s\n", name, ag_last_error());
            return 1;
        }
        double t1 = now_us();
        if (ag__maxflow_dinic(&net, &vd, flow)) {
            fprintf(stderr, "%s: dinic: %s\n", name, ag_last_error());
            return 1;
        }
        double t2 = now_us();
        ti[r] = t1 - t0;
        td[r] = t2 - t1;
    }
    qsort(ti, (size_t)repeats, sizeof(double), cmp_double);
    qsort(td, (size_t)repeats, sizeof(double), cmp_double);
    printf("%-18s %6d nodes %6d verts %6d edges  flow %.0f %s  igraph %8.1f us  dinic %8.1f us\n",
           config ? config : name, P.nn, net.nverts, net.nedges, vi,
           vi == vd ? "(same)" : "(DIFFER)", ti[repeats / 2], td[repeats / 2]);
    free(flow);
    free(ti);
    free(td);
    ag__flow_net_free(&net);
    ag__part_free(&P);
    ag_joint_free(j);
    ag_module_free(m);
    for (int i = 0; i < nin; i++)
        ag_tensor_free(in[i]);
    return vi == vd ? 0 : 1;
}

int main(int argc, char **argv) {
    int repeats = argc > 1 ? atoi(argv[1]) : 50;
    if (repeats < 1)
        repeats = 1;
    int rc = 0;
    rc |= bench_model("mlp", NULL, repeats);
    rc |= bench_model("cnn", NULL, repeats);
    rc |= bench_model("gpt2", "tiny", repeats);
    rc |= bench_model("gpt2", "gpt2-small", repeats);
    return rc;
}
