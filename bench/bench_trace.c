/* bench_trace: how long tracing takes, and that it grows linearly with the model.
 *
 * Builds GPT-2 (768 wide, 12 heads, vocab 50257, context 1024: GPT-2 small's shape) in meta
 * mode, so no weights are allocated, and traces its forward on idx [2, 16] several times:
 * 2 warm-up runs, then the median of 7 timed runs (--reps changes it). Rows for 12 layers
 * (GPT-2 small itself), 48 and 96 layers show that the time per node stays flat. Columns:
 * build ms (meta-mode construction), trace ms (with stack traces, the default), trace ms
 * without stack traces, graph nodes, ns per node (with stack traces) and the bytes the library
 * allocated during one trace (through the allocator hook).
 *
 *   bench_trace [--reps N] [--warmup N] [--layers 12,48,96] [--json FILE]
 *
 * No timed assertion: numbers are for the reader (milliseconds are expected). */
#include "aotgrad.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + 1e-6 * (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* Counts the bytes allocated while installed. */
typedef struct counter {
    ag_allocator prev;
    size_t bytes;
} counter;

static void *count_alloc(void *ud, size_t size, size_t align) {
    counter *c = ud;
    c->bytes += size;
    return c->prev.alloc(c->prev.ud, size, align);
}

static void count_free(void *ud, void *p) {
    counter *c = ud;
    c->prev.free(c->prev.ud, p);
}

typedef struct row {
    int layers;
    double params_m, build_ms, trace_ms, trace_nost_ms, ns_per_node, alloc_mib;
    int nodes;
} row;

/* GPT-2 small's shape with n_layer layers, built in meta mode, and idx [2, 16]. */
static int build(int layers, ag_module **m, ag_tensor **idx) {
    ag_gpt2_config cfg = ag_gpt2_config_small();
    cfg.n_layer = layers;
    bool prev = ag_set_meta_mode(true);
    ag_manual_seed(0);
    *m = ag_nn_gpt2(&cfg);
    ag_scope_begin();
    ag_tensor *u = ag_rand(AG_F32, 2, (int64_t[]){2, 16});
    *idx = ag_tensor_keep(ag_to_dtype(ag_mul_scalar(u, (double)cfg.vocab_size - 0.5), AG_I64));
    ag_scope_end();
    ag_set_meta_mode(prev);
    if (!*m || !*idx) {
        ag_module_free(*m);
        ag_tensor_free(*idx);
        return -1;
    }
    return 0;
}

/* Median trace time over reps runs after warmup runs; *nodes from the last graph. */
static double time_trace(ag_module *m, ag_tensor *idx, bool stack_traces, int warmup, int reps,
                         int *nodes) {
    ag_trace_opts o = {.no_stack_traces = !stack_traces};
    double *t = malloc(sizeof(double) * (size_t)reps);
    if (!t)
        return -1;
    for (int i = 0; i < warmup + reps; i++) {
        double t0 = now_ms();
        ag_graph *g = ag_trace_module(m, &idx, 1, &o);
        double dt = now_ms() - t0;
        if (!g) {
            free(t);
            return -1;
        }
        *nodes = ag_graph_num_nodes(g);
        ag_graph_free(g);
        if (i >= warmup)
            t[i - warmup] = dt;
    }
    double med = median(t, reps);
    free(t);
    return med;
}

static int measure(int layers, int warmup, int reps, row *r) {
    memset(r, 0, sizeof *r);
    r->layers = layers;
    /* Build: median of the same number of runs. */
    double *bt = malloc(sizeof(double) * (size_t)reps);
    ag_module *m = NULL;
    ag_tensor *idx = NULL;
    if (!bt)
        return -1;
    for (int i = 0; i < warmup + reps; i++) {
        double t0 = now_ms();
        if (build(layers, &m, &idx)) {
            free(bt);
            return -1;
        }
        double dt = now_ms() - t0;
        if (i >= warmup)
            bt[i - warmup] = dt;
        if (i + 1 < warmup + reps) {
            ag_module_free(m);
            ag_tensor_free(idx);
        }
    }
    r->build_ms = median(bt, reps);
    free(bt);
    r->params_m = (double)ag_module_num_parameters(m) / 1e6;

    int nodes = 0;
    r->trace_ms = time_trace(m, idx, true, warmup, reps, &nodes);
    r->trace_nost_ms = time_trace(m, idx, false, warmup, reps, &nodes);
    r->nodes = nodes;
    int rc = r->trace_ms < 0 || r->trace_nost_ms < 0 ? -1 : 0;
    if (!rc) {
        r->ns_per_node = r->trace_ms * 1e6 / nodes;
        counter c = {.prev = ag_get_allocator()};
        ag_allocator hook = {count_alloc, count_free, &c};
        ag_set_allocator(&hook);
        ag_graph *g = ag_trace_module(m, &idx, 1, NULL);
        ag_set_allocator(&c.prev);
        rc = g ? 0 : -1;
        ag_graph_free(g);
        r->alloc_mib = (double)c.bytes / (1 << 20);
    }
    ag_module_free(m);
    ag_tensor_free(idx);
    return rc;
}

static void usage(FILE *f) {
    fprintf(f, "usage: bench_trace [--reps N] [--warmup N] [--layers L1,L2,...] [--json FILE]\n");
}

int main(int argc, char **argv) {
    int reps = 7, warmup = 2;
    int layers[16] = {12, 48, 96}, nlayers = 3;
    const char *json = NULL;
    for (int i = 1; i < argc; i++) {
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        char *end = NULL;
        if (!strcmp(argv[i], "--reps") && v && (reps = (int)strtol(v, &end, 10)) > 0 && !*end) {
            i++;
        } else if (!strcmp(argv[i], "--warmup") && v && (warmup = (int)strtol(v, &end, 10)) >= 0 &&
                   !*end) {
            i++;
        } else if (!strcmp(argv[i], "--json") && v) {
            json = v;
            i++;
        } else if (!strcmp(argv[i], "--layers") && v) {
            nlayers = 0;
            for (const char *p = v; *p && nlayers < 16;) {
                long l = strtol(p, &end, 10);
                if (end == p || l <= 0 || l > 10000 || (*end && *end != ',')) {
                    fprintf(stderr, "bench_trace: bad --layers '%s'\n", v);
                    return 2;
                }
                layers[nlayers++] = (int)l;
                p = *end ? end + 1 : end;
            }
            i++;
        } else if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            usage(stdout);
            return 0;
        } else {
            fprintf(stderr, "bench_trace: bad option '%s'\n", argv[i]);
            usage(stderr);
            return 2;
        }
    }

    printf("bench_trace: GPT-2 small's shape (768 wide, 12 heads, vocab 50257, ctx 1024) with N "
           "layers, built in meta mode; trace of forward(idx [2, 16]); median of %d after %d "
           "warm-up%s\n\n",
           reps, warmup, warmup == 1 ? "" : "s");
    printf("%-7s %9s %10s %10s %14s %7s %8s %10s\n", "layers", "params", "build ms", "trace ms",
           "trace ms (no", "nodes", "ns/node", "alloc MiB");
    printf("%-7s %9s %10s %10s %14s %7s %8s %10s\n", "", "", "", "", "stack traces)", "", "",
           "per trace");
    row rows[16];
    for (int i = 0; i < nlayers; i++) {
        if (measure(layers[i], warmup, reps, &rows[i])) {
            fprintf(stderr, "bench_trace: %d layers: %s\n", layers[i], ag_last_error());
            return 1;
        }
        const row *r = &rows[i];
        printf("%-7d %8.1fM %10.2f %10.2f %14.2f %7d %8.0f %10.1f\n", r->layers, r->params_m,
               r->build_ms, r->trace_ms, r->trace_nost_ms, r->nodes, r->ns_per_node, r->alloc_mib);
        fflush(stdout);
    }

    if (json) {
        FILE *f = fopen(json, "w");
        if (!f) {
            fprintf(stderr, "bench_trace: cannot write %s: %s\n", json, strerror(errno));
            return 1;
        }
        fprintf(f,
                "{\n  \"benchmark\": \"trace\",\n  \"model\": \"gpt2-small shape, meta mode\",\n"
                "  \"input\": [2, 16],\n  \"reps\": %d,\n  \"warmup\": %d,\n  \"rows\": [\n",
                reps, warmup);
        for (int i = 0; i < nlayers; i++) {
            const row *r = &rows[i];
            fprintf(
                f,
                "    {\"layers\": %d, \"params\": %.0f, \"build_ms\": %.4f, \"trace_ms\": %.4f, "
                "\"trace_no_stack_traces_ms\": %.4f, \"nodes\": %d, \"ns_per_node\": %.1f, "
                "\"alloc_bytes\": %.0f}%s\n",
                r->layers, r->params_m * 1e6, r->build_ms, r->trace_ms, r->trace_nost_ms, r->nodes,
                r->ns_per_node, r->alloc_mib * (1 << 20), i + 1 < nlayers ? "," : "");
        }
        fprintf(f, "  ]\n}\n");
        if (fclose(f)) {
            fprintf(stderr, "bench_trace: error writing %s\n", json);
            return 1;
        }
    }
    return 0;
}
