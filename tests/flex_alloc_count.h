/* Shared by test_flex_attention.c and test_flex_plan.c: counting a planned run's allocations by
 * the step making them (include after testutil.h and runtime/plan_internal.h). */
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

#endif
