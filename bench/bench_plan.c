/* bench_plan: the executor (ag_plan_run) against the interpreter (ag_graph_run) on joint
 * graphs, and how close its arena comes to the ideal.
 *
 * For the gpt2 (tiny) and cnn zoo models (and any others named with --models), exports the
 * joint graph and times one run of it with each executor: 2 warm-up runs, then the median of
 * 7 timed runs (--reps, --warmup change them). Both run the same kernels; the interpreter goes
 * through the dispatcher and allocates every intermediate, the plan calls kernels on
 * pre-bound arguments in one arena. Columns: graph nodes and kernel calls; the time
 * ag_plan_new takes (verification, lifetimes, the memory plan); milliseconds per
 * run for the interpreter, the plan and the plan in checking mode; the speedup; allocations
 * per run made by each (through the allocator hook, after warm-up, outputs released between
 * runs); and the plan's memory: arena, ideal peak (the most bytes alive at one node, a lower
 * bound for any arena), the sum of all intermediate values (no reuse), the arena without
 * in-place reuse, and the bytes of outputs handed to the caller per run. When the
 * partitioner is built, the default partition's forward and backward graphs get rows too.
 *
 *   bench_plan [--reps N] [--warmup N] [--threads N] [--models gpt2,cnn]
 *
 * --threads sets the kernels' thread count (ag_set_num_threads); on a loaded machine one
 * thread gives the steadiest numbers, as OpenMP barriers spin when cores are oversubscribed.
 * No timed assertion: numbers are for the reader. */
#include "aotgrad.h"
#include "../src/runtime/plan_internal.h"

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

/* Counts allocations while installed. */
typedef struct counter {
    ag_allocator prev;
    int64_t n;
} counter;

static void *count_alloc(void *ud, size_t size, size_t align) {
    counter *c = ud;
    __atomic_fetch_add(&c->n, 1, __ATOMIC_RELAXED);
    return c->prev.alloc(c->prev.ud, size, align);
}

static void count_free(void *ud, void *p) {
    counter *c = ud;
    c->prev.free(c->prev.ud, p);
}

static int reps = 7, warmup = 2;

#define MAXT 512

typedef int (*run_fn)(void *ex, ag_tensor *const *in, int nin, ag_tensor **out, int max);

static int run_interp(void *ex, ag_tensor *const *in, int nin, ag_tensor **out, int max) {
    return ag_graph_run(ex, in, nin, out, max);
}

static int run_plan(void *ex, ag_tensor *const *in, int nin, ag_tensor **out, int max) {
    return ag_plan_run(ex, in, nin, out, max);
}

/* Median ms per run; *allocs: allocations of one run after warm-up. -1 on failure. */
static double time_runs(run_fn fn, void *ex, ag_tensor *const *in, int nin, int64_t *allocs) {
    ag_tensor *out[MAXT];
    double t[64];
    for (int r = 0; r < warmup + reps; r++) {
        double t0 = now_ms();
        int n = fn(ex, in, nin, out, MAXT);
        double t1 = now_ms();
        if (n < 0) {
            fprintf(stderr, "run: %s\n", ag_last_error());
            return -1;
        }
        for (int k = 0; k < n; k++)
            ag_tensor_free(out[k]);
        if (r >= warmup)
            t[r - warmup] = t1 - t0;
    }
    counter c = {.prev = ag_get_allocator()};
    ag_set_allocator(&(ag_allocator){count_alloc, count_free, &c});
    int n = fn(ex, in, nin, out, MAXT);
    ag_set_allocator(&c.prev);
    for (int k = 0; k < n; k++)
        ag_tensor_free(out[k]);
    *allocs = c.n;
    return median(t, reps);
}

static void row(const char *model, const char *graph, ag_graph *g, ag_tensor *const *in, int nin) {
    double t0 = now_ms();
    ag_plan *p = ag_plan_new(g, NULL);
    double tnew = now_ms() - t0;
    ag_plan *pc = ag_plan_new(g, &(ag_plan_opts){.checking = true});
    ag_plan *pn = ag_plan_new(g, &(ag_plan_opts){.no_inplace = true});
    if (!p || !pc || !pn) {
        fprintf(stderr, "%s %s: plan_new: %s\n", model, graph, ag_last_error());
        ag_plan_free(p);
        ag_plan_free(pc);
        ag_plan_free(pn);
        return;
    }
    int64_t ai = 0, ap = 0, ac = 0;
    double ti = time_runs(run_interp, g, in, nin, &ai);
    double tp = time_runs(run_plan, p, in, nin, &ap);
    double tc = time_runs(run_plan, pc, in, nin, &ac);
    ag__plan_stats s, sn;
    ag__plan_get_stats(p, &s);
    ag__plan_get_stats(pn, &sn);
    printf("| %-5s | %-5s | %5d | %4d | %7.3f | %8.3f | %8.3f | %8.3f | %5.2fx | %6lld | %4lld | "
           "%9.1f | "
           "%9.1f | %9.1f | %9.1f | %9.1f |\n",
           model, graph, s.nodes, s.kernel_steps, tnew, ti, tp, tc, tp > 0 ? ti / tp : 0,
           (long long)ai, (long long)ap, s.arena_bytes / 1024.0, s.ideal_bytes / 1024.0,
           s.sum_bytes / 1024.0, sn.arena_bytes / 1024.0, s.output_bytes / 1024.0);
    ag_plan_free(p);
    ag_plan_free(pc);
    ag_plan_free(pn);
}

/* The joint's inputs: parameters, copies of buffers, example inputs, tangents of 0.5. */
static int bench_model(const char *name) {
    ag_module *m;
    ag_tensor *ex[8], *in[MAXT];
    int nex;
    if (ag_zoo_build(name, NULL, &m, ex, 8, &nex)) {
        fprintf(stderr, "%s: %s\n", name, ag_last_error());
        return 1;
    }
    ag_joint *j = ag_export_joint(m, ex, nex, NULL, NULL, 0, NULL);
    if (!j) {
        fprintf(stderr, "%s: export: %s\n", name, ag_last_error());
        return 1;
    }
    ag_named_tensors ps, bs;
    ag_module_named_parameters(m, false, &ps);
    ag_module_named_buffers(m, false, &bs);
    int k = 0;
    ag_scope_begin();
    for (int i = 0; i < ps.n; i++)
        in[k++] = ag_tensor_keep(ps.tensors[i]);
    for (int i = 0; i < bs.n; i++)
        in[k++] = ag_tensor_keep(ag_clone(bs.tensors[i]));
    for (int i = 0; i < nex; i++)
        in[k++] = ex[i];
    ag_graph *g = ag_joint_graph(j);
    ag_node **phs;
    int nph = ag_graph_placeholders(g, &phs);
    for (; k < nph; k++) {
        const ag_tmeta *mt = ag_node_val(phs[k], 0);
        in[k] = ag_tensor_keep(ag_full(mt->dtype, mt->ndim, mt->sizes, 0.5));
    }
    ag_scope_end();
    row(name, "joint", g, in, k);

    int np = ag_joint_num_primals(j), nfo = ag_joint_num_fw_outputs(j);
    ag_graph *fw = NULL, *bw = NULL;
    if (ag_joint_num_tangents(j) > 0 && ag_partition(g, nfo, NULL, &fw, &bw, NULL) == 0) {
        row(name, "fw", fw, in, np);
        /* The backward's inputs: the forward's saved outputs, then the tangents. */
        ag_tensor *fo[MAXT], *bin[MAXT];
        int nf = ag_graph_run(fw, in, np, fo, MAXT);
        if (nf >= 0) {
            int nb = 0;
            for (int i = nfo; i < nf; i++)
                bin[nb++] = fo[i];
            for (int i = np; i < k; i++)
                bin[nb++] = in[i];
            row(name, "bw", bw, bin, nb);
            for (int i = 0; i < nf; i++)
                ag_tensor_free(fo[i]);
        }
    }
    ag_graph_free(fw);
    ag_graph_free(bw);
    for (int i = 0; i < k; i++)
        ag_tensor_free(in[i]);
    ag_named_tensors_free(&ps);
    ag_named_tensors_free(&bs);
    ag_joint_free(j);
    ag_module_free(m);
    return 0;
}

int main(int argc, char **argv) {
    const char *models = "gpt2,cnn";
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--reps") && i + 1 < argc)
            reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--warmup") && i + 1 < argc)
            warmup = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc) {
            if (ag_set_num_threads(atoi(argv[++i]))) {
                fprintf(stderr, "bench_plan: --threads: %s\n", ag_last_error());
                return 2;
            }
        } else if (!strcmp(argv[i], "--models") && i + 1 < argc)
            models = argv[++i];
        else {
            fprintf(stderr,
                    "usage: bench_plan [--reps N] [--warmup N] [--threads N] [--models a,b]\n");
            return 2;
        }
    }
    if (reps < 1 || reps > 64)
        reps = 7;
    printf("executor vs interpreter: median of %d runs after %d warm-up, %d kernel thread(s); "
           "memory in KiB\n\n",
           reps, warmup, ag_get_num_threads());
    printf(
        "| model | graph | nodes | kern | plan_new ms | interp ms | plan ms | check ms | speedup | "
        "allocs interp | plan | arena | ideal | sum | arena no-inplace | outputs |\n");
    printf("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    char buf[256];
    snprintf(buf, sizeof buf, "%s", models);
    int rc = 0;
    for (char *tok = strtok(buf, ","); tok; tok = strtok(NULL, ","))
        rc |= bench_model(tok);
    return rc;
}
