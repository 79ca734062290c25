/* bench_subgraph_plan: a joint whose repeated block is one invoke_subgraph region, against the
 * same joint inlined (ag_graph_inline_subgraphs), as the depth grows.
 *
 * The joint is written as graph text (upstream test 23's form): an MLP block
 * y = addmm(b2, relu(addmm(b1, x, w1^T)), w2^T) (x [B, D], w1 [H, D], w2 [D, H]) in a region,
 * called N times in sequence with N weight sets, its joint subgraph called N times in the
 * backward. For each N (12, 48, 96 unless --depths says otherwise) and each form (region,
 * inlined) it reports: the graph nodes (outer graph; with the region, plus the two
 * subgraphs'); the compile time, ag_partition (the region's joint subgraph partitioned once,
 * then the outer joint) plus ag_plan_new of the forward and backward graphs (one subgraph plan
 * each for the region), median of --reps; the time of one compiled step (forward plan run,
 * then backward plan run on its saved values and a tangent), median of --reps after a warm-up;
 * and the ratio region / inlined of each, measured in the same run. Gradients of both forms
 * are compared (max relative difference printed): they run the same kernels.
 *
 *   bench_subgraph_plan [--reps N] [--threads N] [--depths 12,48,96] [--B 64] [--D 128]
 *                       [--H 512] [--mincut]
 *
 * No timed assertion: numbers are for the reader (docs/PERFORMANCE.md records a run). */
#include "aotgrad.h"

#include <math.h>
#include <stdarg.h>
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

/* A growing string. */
typedef struct sbuf {
    char *s;
    size_t n, cap;
} sbuf;

static void put(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(sbuf *b, const char *fmt, ...) {
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int k = vsnprintf(b->s + b->n, b->cap - b->n, fmt, ap);
        va_end(ap);
        if (k >= 0 && (size_t)k < b->cap - b->n) {
            b->n += (size_t)k;
            return;
        }
        b->cap = b->cap * 2 + (size_t)k + 4096;
        b->s = realloc(b->s, b->cap);
        if (!b->s) {
            fprintf(stderr, "out of memory\n");
            exit(1);
        }
    }
}

/* The joint's text for depth n. Inputs: x, then (w1, b1, w2, b2) per call; one tangent. */
static char *joint_text(int n, int B, int D, int H) {
    sbuf b = {0};
    put(&b, "graph():\n    %%primals_1 : f32[%d, %d]  # PlainAOTInput(idx=0)\n", B, D);
    for (int c = 0; c < n; c++) {
        put(&b, "    %%primals_%d : f32[%d, %d]  # PlainAOTInput(idx=%d)\n", 2 + 4 * c, H, D,
            1 + 4 * c);
        put(&b, "    %%primals_%d : f32[%d]  # PlainAOTInput(idx=%d)\n", 3 + 4 * c, H, 2 + 4 * c);
        put(&b, "    %%primals_%d : f32[%d, %d]  # PlainAOTInput(idx=%d)\n", 4 + 4 * c, D, H,
            3 + 4 * c);
        put(&b, "    %%primals_%d : f32[%d]  # PlainAOTInput(idx=%d)\n", 5 + 4 * c, D, 4 + 4 * c);
    }
    put(&b, "    %%tangents_1 : f32[%d, %d]  # TangentAOTInput(output=PlainAOTOutput(idx=0))\n", B,
        D);
    char prev[32] = "primals_1";
    for (int c = 0; c < n; c++) {
        put(&b,
            "    %%fa%d = get_attr(repeated_subgraph0)  # subgraph\n"
            "    %%fc%d = invoke_subgraph(%%fa%d, 'fw_subgraph_0', %%%s, %%primals_%d, "
            "%%primals_%d, %%primals_%d, %%primals_%d)  # (f32[%d, %d],)\n"
            "    %%y%d = getitem(%%fc%d, 0)  # f32[%d, %d]\n",
            c, c, c, prev, 2 + 4 * c, 3 + 4 * c, 4 + 4 * c, 5 + 4 * c, B, D, c, c, B, D);
        snprintf(prev, sizeof prev, "y%d", c);
    }
    char g[32] = "tangents_1";
    for (int c = n - 1; c >= 0; c--) {
        char in[32];
        if (c == 0)
            snprintf(in, sizeof in, "primals_1");
        else
            snprintf(in, sizeof in, "y%d", c - 1);
        put(&b,
            "    %%ba%d = get_attr(repeated_subgraph1)  # subgraph\n"
            "    %%bc%d = invoke_subgraph(%%ba%d, 'bw_subgraph_0_0', %%%s, %%primals_%d, "
            "%%primals_%d, %%primals_%d, %%primals_%d, %%%s)  # (f32[%d, %d], f32[%d, %d], "
            "f32[%d], f32[%d, %d], f32[%d], f32[%d, %d])\n",
            c, c, c, in, 2 + 4 * c, 3 + 4 * c, 4 + 4 * c, 5 + 4 * c, g, B, D, H, D, H, D, H, D, B,
            D);
        put(&b, "    %%g%d_0 = getitem(%%bc%d, 0)  # f32[%d, %d]\n", c, c, B, D);
        put(&b, "    %%g%d_1 = getitem(%%bc%d, 1)  # f32[%d, %d]\n", c, c, H, D);
        put(&b, "    %%g%d_2 = getitem(%%bc%d, 2)  # f32[%d]\n", c, c, H);
        put(&b, "    %%g%d_3 = getitem(%%bc%d, 3)  # f32[%d, %d]\n", c, c, D, H);
        put(&b, "    %%g%d_4 = getitem(%%bc%d, 4)  # f32[%d]\n", c, c, D);
        snprintf(g, sizeof g, "g%d_0", c);
    }
    put(&b, "    return (%%y%d, %%g0_0", n - 1);
    for (int c = 0; c < n; c++)
        for (int o = 1; o < 5; o++)
            put(&b, ", %%g%d_%d", c, o);
    put(&b, ")  # [PlainAOTOutput(idx=0)");
    for (int i = 0; i < 1 + 4 * n; i++)
        put(&b, ", GradAOTOutput(grad_of=PlainAOTInput(idx=%d))", i);
    put(&b, "]\n\n");
    /* The region's forward and joint subgraphs. */
    static const char *const phs = "    %%arg0_1 : f32[%d, %d]  # None\n"
                                   "    %%arg1_1 : f32[%d, %d]  # None\n"
                                   "    %%arg2_1 : f32[%d]  # None\n"
                                   "    %%arg3_1 : f32[%d, %d]  # None\n"
                                   "    %%arg4_1 : f32[%d]  # None\n";
    static const char *const fwd =
        "    %%t = t(%%arg1_1)  # f32[%d, %d]{1, %d}\n"
        "    %%addmm = addmm(%%arg2_1, %%arg0_1, %%t)  # f32[%d, %d]\n"
        "    %%relu = relu(%%addmm)  # f32[%d, %d]\n"
        "    %%t_1 = t(%%arg3_1)  # f32[%d, %d]{1, %d}\n"
        "    %%addmm_1 = addmm(%%arg4_1, %%relu, %%t_1)  # f32[%d, %d]\n";
    put(&b, "subgraph repeated_subgraph0():\n");
    put(&b, phs, B, D, H, D, H, D, H, D);
    put(&b, fwd, D, H, D, B, H, B, H, H, D, H, B, D);
    put(&b, "    return (%%addmm_1,)\n\nsubgraph repeated_subgraph1():\n");
    put(&b, phs, B, D, H, D, H, D, H, D);
    put(&b, "    %%arg5_1 : f32[%d, %d]  # None\n", B, D);
    put(&b, fwd, D, H, D, B, H, B, H, H, D, H, B, D);
    put(&b,
        "    %%mm = mm(%%arg5_1, %%arg3_1)  # f32[%d, %d]\n"
        "    %%t_2 = t(%%arg5_1)  # f32[%d, %d]{1, %d}\n"
        "    %%mm_1 = mm(%%t_2, %%relu)  # f32[%d, %d]\n"
        "    %%sum_1 = sum.dim_IntList(%%arg5_1, [0])  # f32[%d]\n"
        "    %%threshold_backward = threshold_backward(%%mm, %%relu, 0)  # f32[%d, %d]\n"
        "    %%mm_2 = mm(%%threshold_backward, %%arg1_1)  # f32[%d, %d]\n"
        "    %%t_3 = t(%%threshold_backward)  # f32[%d, %d]{1, %d}\n"
        "    %%mm_3 = mm(%%t_3, %%arg0_1)  # f32[%d, %d]\n"
        "    %%sum_2 = sum.dim_IntList(%%threshold_backward, [0])  # f32[%d]\n"
        "    return (%%mm_2, %%mm_3, %%sum_2, %%mm_1, %%sum_1, %%addmm_1)\n",
        B, H, D, B, D, D, H, D, B, H, B, D, H, B, H, H, D, H);
    return b.s;
}

static int num_nodes_all(const ag_graph *g) {
    int n = ag_graph_num_nodes(g);
    for (int i = 0; i < ag_graph_num_subgraphs(g); i++)
        n += ag_graph_num_nodes(ag_graph_subgraph_at(g, i, NULL));
    return n;
}

static void die(const char *what) {
    fprintf(stderr, "bench_subgraph_plan: %s: %s\n", what, ag_last_error());
    exit(1);
}

typedef struct result {
    int nodes;
    double compile_ms, step_ms;
    ag_tensor **grads; /* the last step's backward outputs (caller frees) */
    int ngrads;
} result;

/* Compiles g (partition + both plans) reps times, then times reps steps after a warm-up. */
static void run_form(const ag_graph *g, ag_tensor **in, int nin, ag_tensor *tangent, int reps,
                     const ag_partition_opts *po, result *r) {
    double *t = calloc((size_t)reps, sizeof *t);
    ag_graph *fw = NULL, *bw = NULL;
    ag_plan *pf = NULL, *pb = NULL;
    for (int k = 0; k < reps; k++) {
        ag_graph_free(fw);
        ag_graph_free(bw);
        ag_plan_free(pf);
        ag_plan_free(pb);
        double t0 = now_ms();
        if (ag_partition(g, 1, po, &fw, &bw, NULL))
            die("partition");
        pf = ag_plan_new(fw, NULL);
        pb = ag_plan_new(bw, NULL);
        if (!pf || !pb)
            die("plan_new");
        t[k] = now_ms() - t0;
    }
    r->nodes = num_nodes_all(g);
    r->compile_ms = median(t, reps);
    int nfo = 1 + 4096, nbo = nin;
    ag_tensor **fo = calloc((size_t)nfo, sizeof *fo), **bin = calloc((size_t)nfo, sizeof *bin);
    r->grads = calloc((size_t)nbo, sizeof *r->grads);
    r->ngrads = nbo;
    for (int k = -1; k < reps; k++) {
        for (int i = 0; i < nbo; i++) {
            ag_tensor_free(r->grads[i]);
            r->grads[i] = NULL;
        }
        double t0 = now_ms();
        int nf = ag_plan_run(pf, in, nin, fo, nfo);
        if (nf < 1)
            die("forward run");
        for (int i = 1; i < nf; i++)
            bin[i - 1] = fo[i];
        bin[nf - 1] = tangent;
        if (ag_plan_run(pb, bin, nf, r->grads, nbo) != nbo)
            die("backward run");
        if (k >= 0)
            t[k] = now_ms() - t0;
        for (int i = 0; i < nf; i++) {
            ag_tensor_free(fo[i]);
            fo[i] = NULL;
        }
    }
    r->step_ms = median(t, reps);
    free(fo);
    free(bin);
    free(t);
    ag_plan_free(pf);
    ag_plan_free(pb);
    ag_graph_free(fw);
    ag_graph_free(bw);
}

static double max_rel_diff(const result *a, const result *b) {
    double m = 0;
    for (int i = 0; i < a->ngrads; i++) {
        int64_t n = ag_tensor_numel(a->grads[i]);
        for (int64_t e = 0; e < n; e++) {
            double x = ag_tensor_item_at(a->grads[i], e), y = ag_tensor_item_at(b->grads[i], e);
            double d = fabs(x - y) / (1e-6 + fabs(x));
            m = d > m ? d : m;
        }
    }
    return m;
}

static void free_result(result *r) {
    for (int i = 0; i < r->ngrads; i++)
        ag_tensor_free(r->grads[i]);
    free(r->grads);
}

int main(int argc, char **argv) {
    int reps = 5, B = 64, D = 128, H = 512;
    bool mincut = false;
    char depths[128] = "12,48,96";
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--reps") && i + 1 < argc && atoi(argv[i + 1]) > 0)
            reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc && atoi(argv[i + 1]) > 0)
            ag_set_num_threads(atoi(argv[++i]));
        else if (!strcmp(argv[i], "--depths") && i + 1 < argc)
            snprintf(depths, sizeof depths, "%s", argv[++i]);
        else if (!strcmp(argv[i], "--B") && i + 1 < argc && atoi(argv[i + 1]) > 0)
            B = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--D") && i + 1 < argc && atoi(argv[i + 1]) > 0)
            D = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--H") && i + 1 < argc && atoi(argv[i + 1]) > 0)
            H = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--mincut"))
            mincut = true;
        else {
            fprintf(stderr, "usage: bench_subgraph_plan [--reps N] [--threads N] [--depths "
                            "12,48,96] [--B 64] [--D 128] [--H 512] [--mincut]\n");
            return 2;
        }
    }
    ag_partition_opts po = {.partitioner = mincut ? AG_PARTITION_MINCUT : AG_PARTITION_DEFAULT};
    printf("MLP block (B=%d, D=%d, H=%d) as an invoke_subgraph region vs inlined; %s "
           "partitioner; median of %d\n",
           B, D, H, mincut ? "min-cut" : "default", reps);
    printf("%5s %8s %8s %12s %12s %8s %10s %10s %8s %9s\n", "N", "nodes_r", "nodes_i",
           "compile_r_ms", "compile_i_ms", "ratio", "step_r_ms", "step_i_ms", "ratio", "grad_diff");
    char *save = NULL;
    for (char *tok = strtok_r(depths, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        int n = atoi(tok);
        if (n < 1)
            continue;
        char *text = joint_text(n, B, D, H);
        ag_graph *g = ag_graph_parse(text, strlen(text));
        free(text);
        if (!g)
            die("parse");
        ag_graph *flat = ag_graph_inline_subgraphs(g);
        if (!flat)
            die("inline");
        int nin = 1 + 4 * n;
        ag_tensor **in = calloc((size_t)nin, sizeof *in);
        ag_manual_seed(1);
        for (int i = 0; i < nin; i++) {
            int64_t sizes[2];
            int nd;
            int k = i == 0 ? -1 : (i - 1) % 4;
            if (k < 0)
                nd = 2, sizes[0] = B, sizes[1] = D;
            else if (k == 0)
                nd = 2, sizes[0] = H, sizes[1] = D;
            else if (k == 1)
                nd = 1, sizes[0] = H;
            else if (k == 2)
                nd = 2, sizes[0] = D, sizes[1] = H;
            else
                nd = 1, sizes[0] = D;
            /* Small weights keep activations bounded over 96 blocks. */
            in[i] = ag_randn(AG_F32, nd, sizes);
            if (!in[i])
                die("randn");
            ag_tensor *s = ag_mul_scalar(in[i], k < 0 ? 1.0 : 1.0 / sqrt((double)(k < 2 ? D : H)));
            ag_tensor_free(in[i]);
            in[i] = s;
        }
        int64_t ts[2] = {B, D};
        ag_tensor *tangent = ag_randn(AG_F32, 2, ts);
        result rr, ri;
        run_form(g, in, nin, tangent, reps, &po, &rr);
        run_form(flat, in, nin, tangent, reps, &po, &ri);
        printf("%5d %8d %8d %12.2f %12.2f %8.3f %10.2f %10.2f %8.3f %9.1e\n", n, rr.nodes, ri.nodes,
               rr.compile_ms, ri.compile_ms, rr.compile_ms / ri.compile_ms, rr.step_ms, ri.step_ms,
               rr.step_ms / ri.step_ms, max_rel_diff(&ri, &rr));
        fflush(stdout);
        free_result(&rr);
        free_result(&ri);
        for (int i = 0; i < nin; i++)
            ag_tensor_free(in[i]);
        free(in);
        ag_tensor_free(tangent);
        ag_graph_free(flat);
        ag_graph_free(g);
    }
    return 0;
}
