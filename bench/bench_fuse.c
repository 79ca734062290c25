/* The executor's fused groups (src/runtime/fuse.c) against the same plans with fusion off, on
 * the chains GPT-2 small's training step makes (B * T = ROWS rows of width 768, vocabulary
 * 50257):
 *
 *   bench_fuse [ROWS] [REPEATS]
 *
 * For each chain it builds a plan with fusion and one without (ag_plan_opts.no_fusion),
 * runs them alternately REPEATS times (default 30) on the same inputs and prints the fastest
 * run of each, by wall clock and by process CPU time (the CPU time is steadier on a shared
 * machine: threads waiting passively use none). The chains:
 *   addmm+gelu            the MLP's c_fc (ROWS x 768 @ 768 x 3072, bias) and its gelu;
 *   clone+add+layer_norm  the residual add (after the p=0 dropout's clone) and the next
 *                         layer norm;
 *   layer_norm_backward+add  a layer norm's input gradient added to the residual gradient;
 *   cross-entropy backward   log_softmax, then nll_loss_backward and log_softmax's backward
 *                         helper (the forward log_softmax is in both timings). */
#include "aotgrad.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double seconds(clockid_t clock) {
    struct timespec t;
    clock_gettime(clock, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int repeats = 30;

static int bench(const char *what, const char *text, ag_tensor **in, int nin) {
    ag_graph *g = ag_graph_parse(text, strlen(text));
    ag_plan_opts fused = {0}, plain = {.no_fusion = true};
    ag_plan *p[2] = {g ? ag_plan_new(g, &fused) : NULL, g ? ag_plan_new(g, &plain) : NULL};
    if (!p[0] || !p[1]) {
        fprintf(stderr, "bench_fuse: %s: %s\n", what, ag_last_error());
        return 1;
    }
    double wall[2] = {1e30, 1e30}, cpu[2] = {1e30, 1e30};
    for (int r = 0; r < repeats; r++)
        for (int k = 0; k < 2; k++) {
            ag_tensor *out[8];
            double w0 = seconds(CLOCK_MONOTONIC), c0 = seconds(CLOCK_PROCESS_CPUTIME_ID);
            int n = ag_plan_run(p[k], in, nin, out, 8);
            double w = seconds(CLOCK_MONOTONIC) - w0, c = seconds(CLOCK_PROCESS_CPUTIME_ID) - c0;
            if (n < 0) {
                fprintf(stderr, "bench_fuse: %s: %s\n", what, ag_last_error());
                return 1;
            }
            for (int i = 0; i < n; i++)
                ag_tensor_free(out[i]);
            wall[k] = w < wall[k] ? w : wall[k];
            cpu[k] = c < cpu[k] ? c : cpu[k];
        }
    printf("  %-26s %9.3f %9.3f %6.3f  %9.3f %9.3f %6.3f\n", what, 1e3 * wall[0], 1e3 * wall[1],
           wall[0] / wall[1], 1e3 * cpu[0], 1e3 * cpu[1], cpu[0] / cpu[1]);
    ag_plan_free(p[0]);
    ag_plan_free(p[1]);
    ag_graph_free(g);
    return 0;
}

int main(int argc, char **argv) {
    const int64_t m = argc > 1 ? atoll(argv[1]) : 256;
    repeats = argc > 2 ? atoi(argv[2]) : 30;
    if (m < 1 || repeats < 1) {
        fprintf(stderr, "usage: bench_fuse [ROWS] [REPEATS]\n");
        return 2;
    }
    long long M = (long long)m;
    char text[4096];
    ag_manual_seed(0);
    printf("bench_fuse: %lld rows, fastest of %d runs, %d threads\n", M, repeats,
           ag_get_num_threads());
    printf("  %-26s %9s %9s %6s  %9s %9s %6s\n", "chain", "fused ms", "plain ms", "ratio",
           "fused cpu", "plain cpu", "ratio");
    int rc = 0;

    snprintf(text, sizeof text,
             "graph():\n"
             "    %%x : f32[%lld, 768]  # None\n"
             "    %%w : f32[3072, 768]  # None\n"
             "    %%bias : f32[3072]  # None\n"
             "    %%t = t(%%w)  # f32[768, 3072]{1, 768}\n"
             "    %%addmm = addmm(%%bias, %%x, %%t)  # f32[%lld, 3072]\n"
             "    %%gelu = gelu(%%addmm, approximate='tanh')  # f32[%lld, 3072]\n"
             "    return (%%addmm, %%gelu)  # [None, None]\n",
             M, M, M);
    ag_tensor *a[3] = {ag_randn(AG_F32, 2, (int64_t[]){m, 768}),
                       ag_randn(AG_F32, 2, (int64_t[]){3072, 768}),
                       ag_randn(AG_F32, 1, (int64_t[]){3072})};
    rc |= bench("addmm+gelu", text, a, 3);

    snprintf(text, sizeof text,
             "graph():\n"
             "    %%x : f32[%lld, 768]  # None\n"
             "    %%h : f32[%lld, 768]  # None\n"
             "    %%lw : f32[768]  # None\n"
             "    %%lb : f32[768]  # None\n"
             "    %%e = neg(%%h)  # f32[%lld, 768]\n"
             "    %%clone = clone(%%e)  # f32[%lld, 768]\n"
             "    %%add = add.Tensor(%%x, %%clone)  # f32[%lld, 768]\n"
             "    %%ln = native_layer_norm(%%add, [768], %%lw, %%lb, 1e-05)  # (f32[%lld, 768], "
             "f32[%lld, 1], f32[%lld, 1])\n"
             "    %%g0 = getitem(%%ln, 0)  # f32[%lld, 768]\n"
             "    %%g1 = getitem(%%ln, 1)  # f32[%lld, 1]\n"
             "    %%g2 = getitem(%%ln, 2)  # f32[%lld, 1]\n"
             "    return (%%add, %%g0, %%g1, %%g2)  # [None, None, None, None]\n",
             M, M, M, M, M, M, M, M, M, M, M);
    ag_tensor *b[4] = {
        ag_randn(AG_F32, 2, (int64_t[]){m, 768}), ag_randn(AG_F32, 2, (int64_t[]){m, 768}),
        ag_randn(AG_F32, 1, (int64_t[]){768}), ag_randn(AG_F32, 1, (int64_t[]){768})};
    rc |= bench("clone+add+layer_norm", text, b, 4);

    snprintf(text, sizeof text,
             "graph():\n"
             "    %%g : f32[%lld, 768]  # None\n"
             "    %%x : f32[%lld, 768]  # None\n"
             "    %%mean : f32[%lld, 1]  # None\n"
             "    %%rstd : f32[%lld, 1]  # None\n"
             "    %%lw : f32[768]  # None\n"
             "    %%lb : f32[768]  # None\n"
             "    %%acc : f32[%lld, 768]  # None\n"
             "    %%lnb = native_layer_norm_backward(%%g, %%x, [768], %%mean, %%rstd, %%lw, %%lb, "
             "[1, 1, 1])  # (f32[%lld, 768], f32[768], f32[768])\n"
             "    %%gx = getitem(%%lnb, 0)  # f32[%lld, 768]\n"
             "    %%gw = getitem(%%lnb, 1)  # f32[768]\n"
             "    %%gb = getitem(%%lnb, 2)  # f32[768]\n"
             "    %%add = add.Tensor(%%acc, %%gx)  # f32[%lld, 768]\n"
             "    return (%%gx, %%gw, %%gb, %%add)  # [None, None, None, None]\n",
             M, M, M, M, M, M, M, M);
    ag_tensor *c[7] = {
        ag_randn(AG_F32, 2, (int64_t[]){m, 768}), ag_randn(AG_F32, 2, (int64_t[]){m, 768}),
        ag_randn(AG_F32, 2, (int64_t[]){m, 1}),   ag_ones(AG_F32, 2, (int64_t[]){m, 1}),
        ag_randn(AG_F32, 1, (int64_t[]){768}),    ag_randn(AG_F32, 1, (int64_t[]){768}),
        ag_randn(AG_F32, 2, (int64_t[]){m, 768})};
    rc |= bench("layer_norm_backward+add", text, c, 7);

    snprintf(text, sizeof text,
             "graph():\n"
             "    %%logits : f32[%lld, 50257]  # None\n"
             "    %%target : i64[%lld]  # None\n"
             "    %%g : f32[]  # None\n"
             "    %%tw : f32[]  # None\n"
             "    %%y = _log_softmax(%%logits, 1, False)  # f32[%lld, 50257]\n"
             "    %%d = nll_loss_backward(%%g, %%y, %%target, None, 1, -100, %%tw)  # f32[%lld, "
             "50257]\n"
             "    %%out = _log_softmax_backward_data(%%d, %%y, 1, torch.float32)  # f32[%lld, "
             "50257]\n"
             "    return (%%out)  # [None]\n",
             M, M, M, M, M);
    int64_t *tv = malloc(sizeof(int64_t) * (size_t)m);
    if (!tv)
        return 1;
    for (int64_t i = 0; i < m; i++)
        tv[i] = (i * 7919) % 50257;
    ag_tensor *d[4] = {ag_randn(AG_F32, 2, (int64_t[]){m, 50257}),
                       ag_from_data(AG_I64, 1, (int64_t[]){m}, tv), ag_ones(AG_F32, 0, NULL),
                       ag_ones(AG_F32, 0, NULL)};
    free(tv);
    rc |= bench("cross-entropy backward", text, d, 4);

    for (int i = 0; i < 3; i++)
        ag_tensor_free(a[i]);
    for (int i = 0; i < 4; i++)
        ag_tensor_free(b[i]);
    for (int i = 0; i < 7; i++)
        ag_tensor_free(c[i]);
    for (int i = 0; i < 4; i++)
        ag_tensor_free(d[i]);
    return rc;
}
