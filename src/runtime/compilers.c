/* The two built-in graph compilers (ag_compiler_fn, include/aotgrad/compile.h): the planned
 * executor and the interpreter, written as any user's compiler would be, so the compiled
 * callable runs every graph through one interface whoever compiled it. */
#include "../core/internal.h"
#include "aotgrad/compile.h"
#include "plan_internal.h"

static int plan_run(void *self, ag_tensor *const *in, int nin, ag_tensor **outs, int max_out) {
    return ag_plan_run(self, in, nin, outs, max_out);
}
static void plan_destroy(void *self) {
    ag_plan_free(self);
}
static int64_t plan_peak(const void *self) {
    return ag_plan_peak_bytes(self);
}

static int compiler_plan(const ag_graph *g, void *user, ag_runnable *out, bool verified) {
    ag_plan *p = verified ? ag__plan_new_verified(g, user) : ag_plan_new(g, user);
    if (!p)
        return ag_last_status() ? ag_last_status() : AG_ENOMEM;
    *out = (ag_runnable){plan_run, plan_destroy, plan_peak, p};
    return 0;
}

int ag_compiler_plan(const ag_graph *g, void *user, ag_runnable *out) {
    AG__CHECK_NULL("compiler_plan", g);
    AG__CHECK_NULL("compiler_plan", out);
    return compiler_plan(g, user, out, false);
}

int ag__compiler_plan_verified(const ag_graph *g, void *user, ag_runnable *out) {
    return compiler_plan(g, user, out, true);
}

static int interp_run(void *self, ag_tensor *const *in, int nin, ag_tensor **outs, int max_out) {
    return ag_graph_run(self, in, nin, outs, max_out);
}

int ag_compiler_interpreter(const ag_graph *g, void *user, ag_runnable *out) {
    (void)user;
    AG__CHECK_NULL("compiler_interpreter", g);
    AG__CHECK_NULL("compiler_interpreter", out);
    /* The graph outlives the runnable (the contract), so the interpreter borrows it. */
    *out = (ag_runnable){interp_run, NULL, NULL, (void *)g};
    return 0;
}
