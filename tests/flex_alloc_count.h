/* Shared by test_flex_attention.c and test_flex_plan.c: a compiled callable's halves planned
 * and run warm, the allocations of the warm runs counted by the step making them (include
 * after testutil.h and runtime/plan_internal.h). */
#ifndef FLEX_ALLOC_COUNT_H
#define FLEX_ALLOC_COUNT_H

#include <string.h>

/* Allocations during a plan's run, split by the step running (the plan's step hook): flex
 * steps' and all others'. Atomic: flex kernels may allocate on OpenMP workers. */
typedef struct fc_allocs {
    ag_allocator prev;
    bool in_flex;
    int64_t flex, other;
} fc_allocs;

static void *fc_alloc(void *ud, size_t size, size_t align) {
    fc_allocs *l = ud;
    __atomic_fetch_add(l->in_flex ? &l->flex : &l->other, 1, __ATOMIC_RELAXED);
    return l->prev.alloc(l->prev.ud, size, align);
}

static void fc_free(void *ud, void *ptr) {
    fc_allocs *l = ud;
    l->prev.free(l->prev.ud, ptr);
}

static void fc_step(const char *op, const char *node, void *ud) {
    (void)node;
    ((fc_allocs *)ud)->in_flex = op && !strncmp(op, "flex_attention", 14);
}

/* Runs plan p on in twice; the second (warm) run's allocations go to *a. Returns the output
 * count; outs hold the second run's outputs. */
static int run_twice_counting(ag_plan *p, ag_tensor *const *in, int nin, ag_tensor **outs, int max,
                              fc_allocs *a) {
    int n = ag_plan_run(p, in, nin, outs, max);
    if (n < 0)
        fail_msg("plan run: %s", ag_last_error());
    for (int i = 0; i < n; i++)
        ag_tensor_free(outs[i]);
    memset(a, 0, sizeof *a);
    a->prev = ag_get_allocator();
    ag_set_allocator(&(ag_allocator){fc_alloc, fc_free, a});
    ag__plan_set_step_hook(fc_step, a);
    n = ag_plan_run(p, in, nin, outs, max);
    ag__plan_set_step_hook(NULL, NULL);
    ag_set_allocator(&a->prev);
    if (n < 0)
        fail_msg("plan run: %s", ag_last_error());
    return n;
}

/* A tensor for each placeholder of g from index `from` on (uniform in [-1, 1], from *rng). */
static void fill_inputs(const ag_graph *g, int from, ag_tensor **in, int *nin, uint64_t *rng) {
    int k = 0;
    for (const ag_node *n = ag_graph_first(g); n; n = ag_node_next(n))
        if (ag_node_kind_of(n) == AG_NODE_PLACEHOLDER && k++ >= from) {
            const ag_tmeta *m = ag_node_val(n, 0);
            in[k - 1] = tu_rand_tensor(m->dtype, m->ndim, m->sizes, -1, 1, tu_xorshift, rng);
        }
    *nin = k;
}

/* A compiled callable's halves planned and each run twice, the warm runs counted: the forward
 * on random inputs, the backward on its saved values and random tangents. */
typedef struct warm_halves {
    ag_plan *pf, *pb;
    ag_tensor *in[16], *fo[16], *bi[16], *bo[16];
    int nin, nfo, nbi, nbo;
    fc_allocs af, ab;
} warm_halves;

static void warm_halves_run(warm_halves *w, const ag_compiled *c, uint64_t *rng) {
    memset(w, 0, sizeof *w);
    const ag_graph *fw = ag_compiled_forward_graph(c), *bw = ag_compiled_backward_graph(c);
    w->pf = ag_plan_new(fw, NULL);
    w->pb = ag_plan_new(bw, NULL);
    if (!w->pf || !w->pb)
        fail_msg("plan_new: %s", ag_last_error());
    fill_inputs(fw, 0, w->in, &w->nin, rng);
    w->nfo = run_twice_counting(w->pf, w->in, w->nin, w->fo, 16, &w->af);
    fill_inputs(bw, w->nfo - 1, w->bi, &w->nbi, rng);
    for (int i = 1; i < w->nfo; i++)
        w->bi[i - 1] = w->fo[i];
    w->nbo = run_twice_counting(w->pb, w->bi, w->nbi, w->bo, 16, &w->ab);
}

static void warm_halves_free(warm_halves *w) {
    for (int i = 0; i < w->nbo; i++)
        ag_tensor_free(w->bo[i]);
    for (int i = w->nfo - 1; i < w->nbi; i++)
        ag_tensor_free(w->bi[i]);
    for (int i = 0; i < w->nfo; i++)
        ag_tensor_free(w->fo[i]);
    for (int i = 0; i < w->nin; i++)
        ag_tensor_free(w->in[i]);
    ag_plan_free(w->pf);
    ag_plan_free(w->pb);
}

#endif
