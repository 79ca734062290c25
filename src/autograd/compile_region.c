/* Nested compile regions (torch.compiler.nested_compile_region; include/aotgrad/autograd.h).
 *
 * Eager, the region is just its function. Under tracing the tracer's region hook
 * (ag__region_hook, set by an active tracing session: src/trace/region_trace.c) traces it into a
 * subgraph once per key and records an invoke_subgraph call. */
#include "../core/internal.h"

/* Runs fn and checks its side of the contract (as ag_checkpoint's). */
static int run_fn(ag_region_fn fn, void *ud, ag_tensor *const *in, int nin, ag_tensor **outs,
                  int max_out) {
    uint64_t errs = ag__err_count();
    int n = fn(ud, in, nin, outs, max_out);
    if (n < 0) {
        for (int i = 0; i < max_out; i++)
            outs[i] = NULL;
        if (ag__err_count() == errs)
            ag__err(n, "nested_compile_region: fn failed with status %d and set no message", n);
        return n;
    }
    if (n > max_out)
        return ag__err(AG_EINVAL, "nested_compile_region: fn returned %d outputs, room for %d", n,
                       max_out);
    for (int i = 0; i < n; i++)
        if (!outs[i]) {
            for (int k = 0; k < n; k++) {
                ag_tensor_free(outs[k]);
                outs[k] = NULL;
            }
            return ag__err(AG_EINVAL, "nested_compile_region: fn returned NULL output %d", i);
        }
    return n;
}

int ag_nested_compile_region(ag_region_fn fn, void *ud, ag_tensor *const *inputs, int nin,
                             ag_tensor **outs, int max_out) {
    AG__CHECK_NULL("nested_compile_region", outs);
    for (int i = 0; i < max_out; i++)
        outs[i] = NULL;
    AG__CHECK_NULL("nested_compile_region", fn);
    if (max_out < 1)
        return ag__err(AG_EINVAL, "nested_compile_region: no room for outputs (max_out %d)",
                       max_out);
    if (nin < 0 || (nin > 0 && !inputs))
        return ag__err(AG_EINVAL, "nested_compile_region: bad input list (%d inputs)", nin);
    for (int i = 0; i < nin; i++)
        if (!inputs[i]) {
            if (ag__has_error() && ag_last_status() < 0)
                return ag_last_status();
            return ag__err(AG_EINVAL, "nested_compile_region: input %d is NULL", i);
        }
    if (ag__tls()->tracing && ag__region_hook) {
        char name[48];
        snprintf(name, sizeof name, "function %p", (void *)(uintptr_t)fn);
        ag__region r = {.name = name,
                        .key = (const void *)(uintptr_t)fn,
                        .fn = fn,
                        .ud = ud,
                        .inputs = inputs,
                        .nin = nin};
        return ag__region_hook(&r, outs, max_out);
    }
    return run_fn(fn, ud, inputs, nin, outs, max_out);
}
