/* Max-flow on the min-cut partitioner's flow networks: igraph_maxflow (what the partitioner
 * uses) against a plain Dinic written here, on the networks of the zoo's joints.
 *
 *   bench_maxflow [REPEATS]
 *
 * For each model (gpt2 tiny, gpt2-small, cnn, mlp; built in meta mode, exported, classified) it
 * builds the network solve_min_cut builds with upstream's default bans, checks that both
 * solvers find the same flow value, and prints the median time of each over REPEATS runs
 * (default 50). The partitioner keeps igraph unless Dinic is clearly faster on these graphs:
 * the flow is a small part of a partition either way (the budget search solves ~45 cuts). */
#include "../src/partition/partition_internal.h"

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

/* ---- Dinic: BFS levels, then blocking flows by DFS with per-vertex edge cursors ---- */

typedef struct dinic {
    int n, m;          /* vertices, residual arcs (2 per edge) */
    int *head, *next, *to;
    double *cap;       /* residual capacity per arc */
    int *level, *iter, *queue;
} dinic;

static void dinic_init(dinic *d, const ag__flow_net *net) {
    d->n = net->nverts;
    d->m = 2 * net->nedges;
    d->head = malloc(sizeof(int) * (size_t)d->n);
    d->next = malloc(sizeof(int) * (size_t)d->m);
    d->to = malloc(sizeof(int) * (size_t)d->m);
    d->cap = malloc(sizeof(double) * (size_t)d->m);
    d->level = malloc(sizeof(int) * (size_t)d->n);
    d->iter = malloc(sizeof(int) * (size_t)d->n);
    d->queue = malloc(sizeof(int) * (size_t)d->n);
    for (int v = 0; v < d->n; v++)
        d->head[v] = -1;
    for (int e = 0; e < net->nedges; e++) {
        int a = 2 * e, b = a + 1;
        d->to[a] = net->to[e];
        d->cap[a] = net->cap[e];
        d->next[a] = d->head[net->from[e]];
        d->head[net->from[e]] = a;
        d->to[b] = net->from[e];
        d->cap[b] = 0;
        d->next[b] = d->head[net->to[e]];
        d->head[net->to[e]] = b;
    }
}

static void dinic_free(dinic *d) {
    free(d->head);
    free(d->next);
    free(d->to);
    free(d->cap);
    free(d->level);
    free(d->iter);
    free(d->queue);
}

static bool dinic_bfs(dinic *d, int s, int t) {
    for (int v = 0; v < d->n; v++)
        d->level[v] = -1;
    int qh = 0, qt = 0;
    d->level[s] = 0;
    d->queue[qt++] = s;
    while (qh < qt) {
        int v = d->queue[qh++];
        for (int a = d->head[v]; a >= 0; a = d->next[a])
            if (d->cap[a] > 0 && d->level[d->to[a]] < 0) {
                d->level[d->to[a]] = d->level[v] + 1;
                d->queue[qt++] = d->to[a];
            }
    }
    return d->level[t] >= 0;
}

static double dinic_dfs(dinic *d, int v, int t, double f) {
    if (v == t)
        return f;
    for (int *a = &d->iter[v]; *a >= 0; *a = d->next[*a]) {
        int w = d->to[*a];
        if (d->cap[*a] > 0 && d->level[w] == d->level[v] + 1) {
            double g = dinic_dfs(d, w, t, f < d->cap[*a] ? f : d->cap[*a]);
            if (g > 0) {
                d->cap[*a] -= g;
                d->cap[*a ^ 1] += g;
                return g;
            }
        }
    }
    return 0;
}

static double dinic_maxflow(const ag__flow_net *net) {
    dinic d;
    dinic_init(&d, net);
    double flow = 0;
    while (dinic_bfs(&d, net->source, net->sink)) {
        memcpy(d.iter, d.head, sizeof(int) * (size_t)d.n);
        double f;
        while ((f = dinic_dfs(&d, net->source, net->sink, net->inf)) > 0)
            flow += f;
    }
    dinic_free(&d);
    return flow;
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
    double *ti = malloc(sizeof(double) * (size_t)repeats), *td = malloc(sizeof(double) * (size_t)repeats);
    double vi = 0, vd = 0;
    for (int r = 0; r < repeats; r++) {
        double t0 = now_us();
        if (ag__maxflow_igraph(&net, &vi, flow)) {
            fprintf(stderr, "%s: igraph: %s\n", name, ag_last_error());
            return 1;
        }
        double t1 = now_us();
        vd = dinic_maxflow(&net);
        double t2 = now_us();
        ti[r] = t1 - t0;
        td[r] = t2 - t1;
    }
    qsort(ti, (size_t)repeats, sizeof(double), cmp_double);
    qsort(td, (size_t)repeats, sizeof(double), cmp_double);
    printf("%-18s %6d nodes %6d verts %6d edges  flow %.0f %s  igraph %8.1f us  dinic %8.1f us\n",
           config ? config : name, P.nn, net.nverts, net.nedges, vi, vi == vd ? "(same)" : "(DIFFER)",
           ti[repeats / 2], td[repeats / 2]);
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
