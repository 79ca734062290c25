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
 *   ilp:    a binary program solved by COIN-OR CBC's branch-and-bound through its C interface
 *           (upstream uses scipy's milp; CBC, under the Eclipse Public License, is what
 *           autoparallel's solver uses through PuLP). CBC is not reentrant (its command-line
 *           layer keeps static state), so calls are serialized by a lock; its log is off.
 * bench/bench_knapsack.c times the three (and GLPK, its reference) on the partitioner's own
 * problems, captured through ag__knapsack_set_hook. */
#include "partition_internal.h"

#include <coin/Cbc_C_Interface.h>
#include <math.h>
#include <omp.h>
#include <pthread.h>
#include <stdlib.h>

static _Thread_local ag__knapsack_hook_fn hook;
static _Thread_local void *hook_ctx;

void ag__knapsack_set_hook(ag__knapsack_hook_fn fn, void *ctx) {
    hook = fn;
    hook_ctx = ctx;
}

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

/* ---- integer linear program (CBC) ---- */

static pthread_mutex_t cbc_lock = PTHREAD_MUTEX_INITIALIZER;

/* maximize sum runtime[i] x[i] subject to sum memory[i] x[i] <= max_memory, x binary. */
static int ilp(const double *memory, const double *runtime, int n, double max_memory, bool *save,
               double *total) {
    CoinBigIndex *start = ag__malloc(sizeof(CoinBigIndex) * (size_t)(n + 1));
    int *row = ag__calloc((size_t)n, sizeof(int));
    double *ub = ag__malloc(sizeof(double) * (size_t)n);
    if (!start || !row || !ub) {
        ag__free(start);
        ag__free(row);
        ag__free(ub);
        return AG_ENOMEM;
    }
    for (int k = 0; k <= n; k++)
        start[k] = k;
    for (int k = 0; k < n; k++)
        ub[k] = 1;
    int rc = 0;
    /* Clp's factorization calls BLAS on 1x1 bases; OpenBLAS (OpenMP flavour) would open a
     * team of this thread's OpenMP size for each call, which cost 250 ms instead of 1 ms per
     * 12-item problem on a loaded machine. One thread here (this thread's setting only). */
    int nthreads = omp_get_max_threads();
    omp_set_num_threads(1);
    pthread_mutex_lock(&cbc_lock);
    Cbc_Model *m = Cbc_newModel();
    /* One row; columns in [0, 1], integer; rows' lower bound -inf (NULL). */
    Cbc_loadProblem(m, n, 1, start, row, memory, NULL, ub, runtime, NULL, &max_memory);
    for (int k = 0; k < n; k++)
        Cbc_setInteger(m, k);
    Cbc_setObjSense(m, -1); /* maximize */
    Cbc_setLogLevel(m, 0);
    Cbc_setParameter(m, "log", "0");
    Cbc_setParameter(m, "slog", "0");
    /* Plain branch-and-bound on the LP bound: CBC's primal heuristics, preprocessing and cut
     * generators take 5 ms instead of 1 ms on the partitioner's 12-item problems (which it
     * solves 41 times per partition), though they halve the time of 1000 random items; the
     * optimum does not depend on them. */
    Cbc_setParameter(m, "heuristicsOnOff", "off");
    Cbc_setParameter(m, "preprocess", "off");
    Cbc_setParameter(m, "cuts", "off");
    /* The exact optimum, as GLPK's and scipy's defaults give on these sizes. */
    Cbc_setAllowableGap(m, 0);
    Cbc_setAllowableFractionGap(m, 0);
    int ret = Cbc_solve(m);
    const double *x = Cbc_getColSolution(m);
    if (ret != 0 || !Cbc_isProvenOptimal(m) || !x) {
        rc = ag__err(AG_EINVAL,
                     "partition: the ILP knapsack solver (CBC %s) found no optimum for %d items "
                     "within memory %g (Cbc_solve %d, status %d, secondary status %d)",
                     Cbc_getVersion(), n, max_memory, ret, Cbc_status(m), Cbc_secondaryStatus(m));
    } else {
        *total = 0;
        for (int k = 0; k < n; k++) {
            save[k] = x[k] > 0.5;
            if (save[k])
                *total += runtime[k];
        }
    }
    Cbc_deleteModel(m);
    pthread_mutex_unlock(&cbc_lock);
    omp_set_num_threads(nthreads);
    ag__free(start);
    ag__free(row);
    ag__free(ub);
    return rc;
}

int ag__knapsack(ag_knapsack solver, const double *memory, const double *runtime, int n,
                 double max_memory, bool *save, double *total) {
    *total = 0;
    if (hook)
        hook(hook_ctx, memory, runtime, n, max_memory);
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
