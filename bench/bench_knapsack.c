/* The knapsack solvers of the memory budget on the partitioner's own problems: greedy, dp and
 * ilp (COIN-OR CBC, what libaotgrad links) against GLPK's branch-and-cut (GPL, the reference:
 * linked into this program only, when libglpk-dev is installed).
 *
 *   bench_knapsack [REPEATS]
 *
 * For each model (mlp, cnn, gpt2 tiny, gpt2-small; built in meta mode, exported, classified) it
 * runs the min-cut's memory-budget search once (ag__choose_saved, default peak mode, budget
 * 0.5) with a hook on ag__knapsack that copies every problem the search builds: one item set
 * (the aggressive cut's banned nodes, memory normalized to the budget's range, runtime their
 * FLOPs) at each memory limit of its grid 0, 1/40, ..., 1. For the limits 0.1, 0.3, 0.5 and
 * 0.8 (upstream's raw mode solves the same problem at limit = budget) it prints, per solver,
 * the saved runtime reached (the objective, FLOPs; larger is better), the memory used and the
 * median time over REPEATS runs (default 5); then the total time of the whole grid, which is
 * what one ag_partition call at a budget strictly inside (0, 1) spends in the knapsack. dp
 * solves on memory quantized to 1/10000 (upstream's), so it can differ from the exact optimum
 * either way by a hair. Exit status 1 when CBC and GLPK reach different optima. */
#include "../src/partition/partition_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef AG_BENCH_GLPK
#include <glpk.h>
#endif

static double now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* ---- the captured problems ---- */

typedef struct problem {
    double *memory, *runtime, limit;
    int n;
} problem;

typedef struct capture {
    problem p[64];
    int np;
} capture;

static void on_knapsack(void *ctx, const double *memory, const double *runtime, int n,
                        double max_memory) {
    capture *c = ctx;
    if (c->np == 64 || n <= 0)
        return;
    problem *p = &c->p[c->np++];
    p->memory = malloc(sizeof(double) * (size_t)n);
    p->runtime = malloc(sizeof(double) * (size_t)n);
    memcpy(p->memory, memory, sizeof(double) * (size_t)n);
    memcpy(p->runtime, runtime, sizeof(double) * (size_t)n);
    p->n = n;
    p->limit = max_memory;
}

/* ---- GLPK, the reference (the ILP libaotgrad solved before CBC) ---- */

#ifdef AG_BENCH_GLPK
static int glpk_solve(const double *memory, const double *runtime, int n, double max_memory,
                      bool *save, double *total) {
    int *ia = malloc(sizeof(int) * (size_t)(n + 1)), *ja = malloc(sizeof(int) * (size_t)(n + 1));
    double *ar = malloc(sizeof(double) * (size_t)(n + 1));
    int was = glp_term_out(GLP_OFF);
    glp_prob *lp = glp_create_prob();
    glp_set_obj_dir(lp, GLP_MAX);
    glp_add_rows(lp, 1);
    glp_set_row_bnds(lp, 1, GLP_UP, 0.0, max_memory);
    glp_add_cols(lp, n);
    for (int k = 1; k <= n; k++) {
        glp_set_col_kind(lp, k, GLP_BV);
        glp_set_obj_coef(lp, k, runtime[k - 1]);
        ia[k] = 1;
        ja[k] = k;
        ar[k] = memory[k - 1];
    }
    glp_load_matrix(lp, n, ia, ja, ar);
    glp_iocp parm;
    glp_init_iocp(&parm);
    parm.presolve = GLP_ON;
    parm.msg_lev = GLP_MSG_OFF;
    int rc = glp_intopt(lp, &parm) != 0 || glp_mip_status(lp) != GLP_OPT;
    *total = 0;
    for (int k = 1; !rc && k <= n; k++) {
        save[k - 1] = glp_mip_col_val(lp, k) > 0.5;
        if (save[k - 1])
            *total += runtime[k - 1];
    }
    glp_delete_prob(lp);
    glp_term_out(was);
    free(ia);
    free(ja);
    free(ar);
    return rc;
}
#endif

/* ---- the benchmark ---- */

enum { NSOLVERS = 4 };
static const char *solver_names[NSOLVERS] = {"greedy", "dp", "ilp(cbc)", "glpk"};

static const ag_knapsack solver_of[3] = {AG_KNAPSACK_GREEDY, AG_KNAPSACK_DP, AG_KNAPSACK_ILP};

static int solve(int s, const problem *p, bool *save, double *total) {
    if (s < 3)
        return ag__knapsack(solver_of[s], p->memory, p->runtime, p->n, p->limit, save, total);
#ifdef AG_BENCH_GLPK
    return glpk_solve(p->memory, p->runtime, p->n, p->limit, save, total);
#else
    return 1;
#endif
}

static int have_solver(int s) {
#ifdef AG_BENCH_GLPK
    return 1;
#else
    return s < 3;
#endif
}

/* Median time (us) of REPEATS solves; the objective and memory used of the last. */
static int time_solver(int s, const problem *p, int repeats, double *us, double *obj,
                       double *used) {
    bool *save = malloc(sizeof(bool) * (size_t)p->n);
    double *t = malloc(sizeof(double) * (size_t)repeats);
    int rc = 0;
    for (int r = 0; r < repeats && !rc; r++) {
        double t0 = now_us();
        rc = solve(s, p, save, obj);
        t[r] = now_us() - t0;
    }
    *used = 0;
    for (int k = 0; k < p->n; k++)
        if (save[k])
            *used += p->memory[k];
    qsort(t, (size_t)repeats, sizeof(double), cmp_double);
    *us = t[repeats / 2];
    free(save);
    free(t);
    return rc;
}

/* One table row: every solver on p. Returns 0, or -1 when a solver failed; sets
 * bench_row_differs when CBC's optimum is not GLPK's. */
static int bench_row_differs;
static int bench_row(const char *label, const problem *p, int repeats) {
    double obj[NSOLVERS] = {0}, used[NSOLVERS] = {0}, us[NSOLVERS] = {0};
    bench_row_differs = 0;
    printf("| %s | %d | %.1f |", label, p->n, p->limit);
    for (int s = 0; s < NSOLVERS; s++) {
        if (!have_solver(s)) {
            printf(" - |");
            continue;
        }
        if (time_solver(s, p, repeats, &us[s], &obj[s], &used[s])) {
            fprintf(stderr, "%s: %s failed: %s\n", label, solver_names[s], ag_last_error());
            return -1;
        }
        printf(" %.6g (mem %.4f) %.1f us |", obj[s], used[s], us[s]);
    }
    printf("\n");
    if (have_solver(3) && fabs(obj[2] - obj[3]) > 1e-12 * fabs(obj[3])) {
        fprintf(stderr, "%s at %.1f: CBC's optimum %.17g differs from GLPK's %.17g\n", label,
                p->limit, obj[2], obj[3]);
        bench_row_differs = 1;
    }
    return 0;
}

/* Random problems of the partitioner's shape (memory normalized to sum 1, runtime FLOPs
 * independent of memory) but larger, for how the solvers scale. */
static int bench_random(int n, int repeats) {
    problem p = {.memory = malloc(sizeof(double) * (size_t)n),
                 .runtime = malloc(sizeof(double) * (size_t)n),
                 .limit = 0.3,
                 .n = n};
    uint64_t x = 0x9e3779b97f4a7c15ull ^ (uint64_t)n;
    double sum = 0;
    for (int k = 0; k < n; k++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        p.memory[k] = 1 + (double)(x % 1000);
        sum += p.memory[k];
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        double noise = (double)(x % 1000);
        p.runtime[k] = 1 + noise * 1e4;
    }
    for (int k = 0; k < n; k++)
        p.memory[k] /= sum;
    int rc = bench_row("random", &p, repeats);
    free(p.memory);
    free(p.runtime);
    return rc < 0 || bench_row_differs;
}

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
    capture cap = {.np = 0};
    int *saved = NULL, nsaved = 0;
    if (ag__part_init(&P, ag_joint_graph(j), ag_joint_num_fw_outputs(j))) {
        fprintf(stderr, "%s: %s\n", name, ag_last_error());
        return 1;
    }
    ag__knapsack_set_hook(on_knapsack, &cap);
    rc = ag__choose_saved(&P, 0.5, AG_KNAPSACK_GREEDY, AG__BUDGET_PEAK, &saved, &nsaved);
    ag__knapsack_set_hook(NULL, NULL);
    if (rc) {
        fprintf(stderr, "%s: %s\n", name, ag_last_error());
        return 1;
    }
    const char *label = config ? config : name;
    if (!strcmp(label, "tiny"))
        label = "gpt2 tiny";
    if (cap.np == 0)
        printf("| %s | (no knapsack: the aggressive cut bans nothing the budget could save) |||||"
               "|\n",
               label);
    int status = 0;
    static const double limits[] = {0.1, 0.3, 0.5, 0.8};
    for (size_t li = 0; li < sizeof limits / sizeof limits[0]; li++)
        for (int k = 0; k < cap.np; k++)
            if (fabs(cap.p[k].limit - limits[li]) < 1e-12) {
                if (bench_row(label, &cap.p[k], repeats) < 0)
                    return 1;
                status |= bench_row_differs;
                break;
            }
    if (cap.np) {
        /* The whole grid: what one partition call spends in the knapsack. */
        printf("| %s | %d | grid of %d |", label, cap.p[0].n, cap.np);
        for (int s = 0; s < NSOLVERS; s++) {
            if (!have_solver(s)) {
                printf(" - |");
                continue;
            }
            double sum = 0, us, obj, used;
            for (int k = 0; k < cap.np; k++) {
                if (time_solver(s, &cap.p[k], repeats, &us, &obj, &used)) {
                    fprintf(stderr, "%s: %s failed: %s\n", label, solver_names[s], ag_last_error());
                    return 1;
                }
                sum += us;
            }
            printf(" total %.1f us |", sum);
        }
        printf("\n");
    }
    for (int k = 0; k < cap.np; k++) {
        free(cap.p[k].memory);
        free(cap.p[k].runtime);
    }
    ag__free(saved);
    ag__part_free(&P);
    ag_joint_free(j);
    ag_module_free(m);
    for (int i = 0; i < nin; i++)
        ag_tensor_free(in[i]);
    return status;
}

int main(int argc, char **argv) {
    int repeats = argc > 1 ? atoi(argv[1]) : 5;
    if (repeats < 1)
        repeats = 1;
    printf("| model | items | limit |");
    for (int s = 0; s < NSOLVERS; s++)
        printf(" %s: saved runtime (memory used) time |", solver_names[s]);
    printf("\n|---|---|---|---|---|---|---|\n");
    int rc = 0;
    rc |= bench_model("mlp", NULL, repeats);
    rc |= bench_model("cnn", NULL, repeats);
    rc |= bench_model("gpt2", "tiny", repeats);
    rc |= bench_model("gpt2", "gpt2-small", repeats);
    rc |= bench_model("convbn", NULL, repeats);
    rc |= bench_random(100, repeats);
    rc |= bench_random(1000, repeats);
    return rc;
}
