/* The knapsack solvers of the memory budget (upstream's greedy_knapsack, dp_knapsack and
 * ilp_knapsack, torch/_functorch/_activation_checkpointing/knapsack.py).
 *
 * In: n items, each with a memory (the bytes of a value, normalized so the budget's range is
 * [0, 1]) and a runtime (the FLOPs recomputing it would cost), and a memory limit. Out: which
 * items to save so the saved runtime is largest with their memory within the limit; the others
 * may be recomputed.
 *   greedy: by runtime per memory, highest first, taking each item that still fits;
 *   dp:     exact 0/1 knapsack on memory quantized to 1/10000 (upstream's S), float32 table;
 *           an item is saved when it changes the table's value at the backtracked capacity;
 *   ilp:    a binary program solved by GLPK's branch-and-cut (upstream uses scipy's milp). */
#include "partition_internal.h"

#include <glpk.h>
#include <math.h>
#include <stdlib.h>

/* ---- greedy ---- */

static double ratio(const double *memory, const double *runtime, int i) {
    return memory[i] > 0 ? runtime[i] / memory[i] : INFINITY;
}
static int greedy(const double *memory, const double *runtime, int n, double max_memory, bool *save,
                  double *total) {
    int *order = ag__malloc(sizeof(int) * (size_t)(n + 1));
    if (!order)
        return AG_ENOMEM;
    /* Stable insertion sort by ratio, highest first (Python's sorted is stable). */
    for (int i = 0; i < n; i++) {
        double r = ratio(memory, runtime, i);
        int k = i;
        while (k > 0 && ratio(memory, runtime, order[k - 1]) < r) {
            order[k] = order[k - 1];
            k--;
        }
        order[k] = i;
    }
    double used = 0;
    *total = 0;
    for (int k = 0; k < n; k++) {
        int i = order[k];
        save[i] = used + memory[i] <= max_memory;
        if (save[i]) {
            used += memory[i];
            *total += runtime[i];
        }
    }
    ag__free(order);
    return 0;
}

/* ---- dynamic programming ---- */

static int dp(const double *memory, const double *runtime, int n, double max_memory, bool *save,
              double *total) {
    const double S = 10000;
    int64_t Q = (int64_t)nearbyint(max_memory * S); /* round half to even, as Python's round */
    if (Q < 0)
        Q = 0;
    size_t w = (size_t)Q + 1, words = (w + 63) / 64;
    float *prev = ag__calloc(w, sizeof(float)), *cur = ag__calloc(w, sizeof(float));
    uint64_t *keep = ag__calloc((size_t)n * words + 1, sizeof(uint64_t));
    int64_t *qm = ag__malloc(sizeof(int64_t) * (size_t)(n + 1));
    if (!prev || !cur || !keep || !qm) {
        ag__free(prev);
        ag__free(cur);
        ag__free(keep);
        ag__free(qm);
        return AG_ENOMEM;
    }
    for (int i = 0; i < n; i++) {
        qm[i] = (int64_t)nearbyint(memory[i] * S);
        float rt = (float)runtime[i];
        uint64_t *kb = keep + (size_t)i * words;
        for (size_t j = 0; j < w; j++) {
            float v = prev[j];
            if (qm[i] == 0)
                v = prev[j] + rt;
            else if ((int64_t)j >= qm[i]) {
                float t = prev[j - (size_t)qm[i]] + rt;
                v = t > v ? t : v;
            }
            cur[j] = v;
            if (v != prev[j])
                kb[j / 64] |= 1ull << (j % 64);
        }
        float *t = prev;
        prev = cur;
        cur = t;
    }
    *total = prev[Q];
    int64_t j = Q;
    for (int i = n - 1; i >= 0; i--) {
        const uint64_t *kb = keep + (size_t)i * words;
        save[i] = (kb[j / 64] >> (j % 64)) & 1;
        if (save[i])
            j -= qm[i];
    }
    ag__free(prev);
    ag__free(cur);
    ag__free(keep);
    ag__free(qm);
    return 0;
}

/* ---- integer linear program (GLPK) ---- */

static int ilp(const double *memory, const double *runtime, int n, double max_memory, bool *save,
               double *total) {
    int *ia = ag__malloc(sizeof(int) * (size_t)(n + 1));
    int *ja = ag__malloc(sizeof(int) * (size_t)(n + 1));
    double *ar = ag__malloc(sizeof(double) * (size_t)(n + 1));
    if (!ia || !ja || !ar) {
        ag__free(ia);
        ag__free(ja);
        ag__free(ar);
        return AG_ENOMEM;
    }
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
    int ret = glp_intopt(lp, &parm);
    int rc = 0;
    if (ret != 0 || glp_mip_status(lp) != GLP_OPT) {
        rc = ag__err(AG_EINVAL,
                     "partition: the ILP knapsack solver failed (glp_intopt %d, "
                     "status %d)",
                     ret, glp_mip_status(lp));
    } else {
        *total = 0;
        for (int k = 1; k <= n; k++) {
            save[k - 1] = glp_mip_col_val(lp, k) > 0.5;
            if (save[k - 1])
                *total += runtime[k - 1];
        }
    }
    glp_delete_prob(lp);
    glp_term_out(was);
    ag__free(ia);
    ag__free(ja);
    ag__free(ar);
    return rc;
}

int ag__knapsack(ag_knapsack solver, const double *memory, const double *runtime, int n,
                 double max_memory, bool *save, double *total) {
    *total = 0;
    if (n <= 0)
        return 0;
    switch (solver) {
    case AG_KNAPSACK_GREEDY:
        return greedy(memory, runtime, n, max_memory, save, total);
    case AG_KNAPSACK_DP:
        return dp(memory, runtime, n, max_memory, save, total);
    case AG_KNAPSACK_ILP:
        return ilp(memory, runtime, n, max_memory, save, total);
    }
    return ag__err(AG_EINVAL, "partition: unknown knapsack solver %d", (int)solver);
}
