/* bench_regions: what marking GPT-2's blocks as nested compile regions buys the capture
 * pipeline, and what it costs the compiled step.
 *
 * For GPT-2 of 12, 48 and 96 layers (n_embd 64, 4 heads, vocab 256, B=8, T=64 by default),
 * flat (today's graphs) and with each block a nested compile region
 * (ag_gpt2_config.compile_region_blocks: one block traced, differentiated and partitioned
 * once, every call site invoking the same subgraphs), the model's loss (loss_only) is
 * exported as one joint and compiled with the default options. Reported per variant: the
 * joint's nodes (outer graph plus its subgraphs), the median seconds of the pipeline
 * (ag_export_joint: trace + joint; ag_compile_joint: partition + plans) and of a compiled step
 * (forward + backward, no optimizer), flat and regions timed interleaved in the same run, and
 * the largest difference between the two variants' losses and gradients (the same weights).
 * The reference timed with each pipeline run ("copy ms"): deep copies of the three graphs the
 * pipeline returned (the joint, the forward, the backward), the cost of making their nodes once
 * more with nothing traced, differentiated, partitioned or planned. A pipeline can be no flatter
 * in depth than that: with regions, what grows is the outer graphs' per-call nodes.
 *
 *   bench_regions [--runs N] [--threads N] [--layers 12,48,96] [--embd N]
 *
 * No timed assertion: numbers are for the reader (docs/PERFORMANCE.md records a run). */
#include "aotgrad.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return v[n / 2];
}

static ag_tensor *tokens(int64_t B, int64_t T, int64_t V, uint64_t seed) {
    ag_manual_seed(seed);
    ag_tensor *u = ag_rand(AG_F32, 2, (int64_t[]){B, T});
    ag_tensor *s = ag_mul_scalar(u, (double)V - 0.5);
    ag_tensor *t = ag_to_dtype(s, AG_I64);
    ag_tensor_free(u);
    ag_tensor_free(s);
    return t;
}

static int count_nodes(const ag_graph *g) {
    int n = ag_graph_num_nodes(g);
    for (int i = 0; i < ag_graph_num_subgraphs(g); i++)
        n += count_nodes(ag_graph_subgraph_at(g, i, NULL));
    return n;
}

/* The reference: seconds to deep-copy the graphs the pipeline made (the joint, the forward
 * and the backward graph, each with its subgraphs), i.e. to make their nodes once more with
 * names, metadata and users but no tracing, differentiation, partitioning or planning. */
static double copy_outputs_s(const ag_joint *j, const ag_compiled *c) {
    const ag_graph *g[3] = {ag_joint_graph(j), ag_compiled_forward_graph(c),
                            ag_compiled_backward_graph(c)};
    double t0 = now_s();
    for (int i = 0; i < 3; i++)
        ag_graph_free(ag_graph_copy(g[i]));
    return now_s() - t0;
}

typedef struct variant {
    ag_module *m;
    ag_joint *j;
    ag_compiled *c;
    double *pipe_s, *export_s, *step_s, *copy_s;
    float loss;
} variant;

/* One compiled step: the loss, its backward into the parameters' .grad (kept when keep). */
static int step(variant *v, ag_tensor *const *in, bool keep) {
    ag_scope_begin();
    ag_tensor *loss = NULL;
    int n = ag_compiled_call_module(v->c, v->m, in, 2, &loss, 1);
    int rc = n == 1 ? ag_backward(loss, NULL, false) : -1;
    if (rc == 0)
        v->loss = *(const float *)ag_tensor_data(loss);
    ag_scope_end();
    if (!keep) {
        ag_named_tensors nt;
        if (ag_module_named_parameters(v->m, true, &nt) == 0) {
            for (int i = 0; i < nt.n; i++)
                ag_tensor_set_grad(nt.tensors[i], NULL);
            ag_named_tensors_free(&nt);
        }
    }
    return rc;
}

/* The largest |a - b| over both modules' parameter gradients. */
static double grad_diff(ag_module *a, ag_module *b) {
    ag_named_tensors na, nb;
    double d = INFINITY;
    if (ag_module_named_parameters(a, true, &na))
        return d;
    if (ag_module_named_parameters(b, true, &nb) == 0) {
        d = na.n == nb.n ? 0 : INFINITY;
        for (int i = 0; i < na.n && i < nb.n; i++) {
            ag_tensor *ga = ag_tensor_grad(na.tensors[i]), *gb = ag_tensor_grad(nb.tensors[i]);
            if (!ga || !gb || ag_tensor_numel(ga) != ag_tensor_numel(gb)) {
                d = INFINITY;
                break;
            }
            const float *x = ag_tensor_data(ga), *y = ag_tensor_data(gb);
            for (int64_t k = 0; k < ag_tensor_numel(ga); k++)
                d = fmax(d, fabs((double)x[k] - (double)y[k]));
        }
        ag_named_tensors_free(&nb);
    }
    ag_named_tensors_free(&na);
    return d;
}

static int bench_depth(int layers, int embd, int runs) {
    ag_gpt2_config cfg = ag_gpt2_config_tiny();
    cfg.n_layer = layers;
    cfg.n_embd = embd;
    cfg.loss_only = true;
    int64_t B = 8, T = 64;
    ag_tensor *in[2] = {tokens(B, T, cfg.vocab_size, 1), tokens(B, T, cfg.vocab_size, 2)};
    variant v[2] = {{0}};
    int rc = 0;
    for (int k = 0; k < 2 && rc == 0; k++) {
        cfg.compile_region_blocks = k == 1;
        ag_manual_seed(1234);
        v[k].m = ag_nn_gpt2(&cfg);
        v[k].pipe_s = calloc((size_t)runs, sizeof(double));
        v[k].export_s = calloc((size_t)runs, sizeof(double));
        v[k].step_s = calloc((size_t)runs, sizeof(double));
        v[k].copy_s = calloc((size_t)runs, sizeof(double));
        if (!v[k].m || !v[k].pipe_s || !v[k].export_s || !v[k].step_s || !v[k].copy_s) {
            fprintf(stderr, "bench_regions: %d layers: %s\n", layers, ag_last_error());
            rc = 1;
        }
    }
    /* the pipeline: one warm-up, then the runs interleaved; the last run's compiled kept */
    for (int r = -1; r < runs && rc == 0; r++)
        for (int k = 0; k < 2 && rc == 0; k++) {
            ag_compiled_free(v[k].c);
            ag_joint_free(v[k].j);
            v[k].c = NULL;
            double t0 = now_s();
            v[k].j = ag_export_joint(v[k].m, in, 2, NULL, NULL, 0, NULL);
            double t1 = now_s();
            v[k].c = v[k].j ? ag_compile_joint(v[k].j, NULL) : NULL;
            double t2 = now_s();
            if (!v[k].c) {
                fprintf(stderr, "bench_regions: %d layers, %s: %s\n", layers,
                        k ? "regions" : "flat", ag_last_error());
                rc = 1;
            } else if (r >= 0) {
                v[k].export_s[r] = t1 - t0;
                v[k].pipe_s[r] = t2 - t0;
                v[k].copy_s[r] = copy_outputs_s(v[k].j, v[k].c);
            }
        }
    /* the compiled step, interleaved; the first step's gradients compared */
    double dloss = 0, dgrad = 0;
    for (int k = 0; k < 2 && rc == 0; k++)
        rc = step(&v[k], in, true);
    if (rc == 0) {
        dloss = fabs((double)v[0].loss - (double)v[1].loss);
        dgrad = grad_diff(v[0].m, v[1].m);
    }
    for (int r = 0; r < runs && rc == 0; r++)
        for (int k = 0; k < 2 && rc == 0; k++) {
            double t0 = now_s();
            rc = step(&v[k], in, false);
            v[k].step_s[r] = now_s() - t0;
        }
    if (rc)
        fprintf(stderr, "bench_regions: %d layers: %s\n", layers, ag_last_error());
    for (int k = 0; k < 2 && rc == 0; k++) {
        double pipe = median(v[k].pipe_s, runs), ex = median(v[k].export_s, runs),
               st = median(v[k].step_s, runs);
        double cp = median(v[k].copy_s, runs);
        printf("| %d | %s | %d | %.2f | %.2f | %.2f | %.2f | %.1fx | %.4f |\n", layers,
               k ? "regions" : "flat", count_nodes(ag_joint_graph(v[k].j)), ex * 1e3,
               (pipe - ex) * 1e3, pipe * 1e3, cp * 1e3, pipe / cp, st);
    }
    if (rc == 0)
        printf("|   | regions / flat | | %.2fx | %.2fx | %.2fx | %.2fx | | %.2fx |\n",
               median(v[1].export_s, runs) / median(v[0].export_s, runs),
               (median(v[1].pipe_s, runs) - median(v[1].export_s, runs)) /
                   (median(v[0].pipe_s, runs) - median(v[0].export_s, runs)),
               median(v[1].pipe_s, runs) / median(v[0].pipe_s, runs),
               median(v[1].copy_s, runs) / median(v[0].copy_s, runs),
               median(v[1].step_s, runs) / median(v[0].step_s, runs));
    if (rc == 0)
        printf("|   | loss diff %.1e, grad diff %.1e | | | | | | | |\n", dloss, dgrad);
    for (int k = 0; k < 2; k++) {
        ag_compiled_free(v[k].c);
        ag_joint_free(v[k].j);
        ag_module_free(v[k].m);
        free(v[k].pipe_s);
        free(v[k].export_s);
        free(v[k].step_s);
        free(v[k].copy_s);
    }
    ag_tensor_free(in[0]);
    ag_tensor_free(in[1]);
    return rc;
}

int main(int argc, char **argv) {
    int runs = 5, embd = 64;
    const char *layers = "12,48,96";
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--runs") && i + 1 < argc && atoi(argv[i + 1]) > 0)
            runs = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc && atoi(argv[i + 1]) > 0)
            ag_set_num_threads(atoi(argv[++i]));
        else if (!strcmp(argv[i], "--layers") && i + 1 < argc)
            layers = argv[++i];
        else if (!strcmp(argv[i], "--embd") && i + 1 < argc && atoi(argv[i + 1]) > 0 &&
                 atoi(argv[i + 1]) % 4 == 0)
            embd = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: bench_regions [--runs N] [--threads N] [--layers 12,48,96] "
                            "[--embd N (a multiple of 4)]\n");
            return 2;
        }
    }
    printf("GPT-2 n_embd %d, 4 heads, vocab 256, B=8, T=64; threads %d, median of %d runs "
           "(after one warm-up), flat and regions interleaved\n\n",
           embd, ag_get_num_threads(), runs);
    printf("| layers | blocks | joint nodes | export ms | compile ms | pipeline ms | copy ms | "
           "pipeline / copy | compiled step s |\n");
    printf("|---|---|---|---|---|---|---|---|---|\n");
    char buf[256];
    snprintf(buf, sizeof buf, "%s", layers);
    int rc = 0;
    for (char *tok = strtok(buf, ","); tok && rc == 0; tok = strtok(NULL, ",")) {
        int n = atoi(tok);
        if (n <= 0) {
            fprintf(stderr, "bench_regions: bad layer count '%s'\n", tok);
            return 2;
        }
        rc = bench_depth(n, embd, runs);
    }
    return rc;
}
