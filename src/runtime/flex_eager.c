/* Eager flex_attention's score_mod on tile plans (the hook of src/autograd/flex_internal.h).
 *
 * In: an eager ag_flex_attention call's score_mod (a C function over tensors), its dtype, sizes
 * and tiles. Out: the kernel's per-tile functions running score_mod's traced graphs: the
 * score_mod is traced once on 0-d stand-ins into sdpa_score0 (and, for the backward,
 * joint_graph0: its forward and ag_grad's backward recorded), each planned per tile shape and
 * per thread (plan_flex.c's tile plans, as a compiled flex_attention step runs them), so the
 * tiles run on all threads, allocation-free, without the op dispatcher. A score_mod that cannot
 * be traced (it fails on data-less tensors, calls an op with no meta function) or whose graph
 * does not run on tiles is left to the autograd layer, which calls it per tile.
 *
 * The hook is installed when the library is loaded (a constructor): libaotgrad.so always has
 * it; a static link takes this file because libaotgrad's CMake targets and pkg-config file ask
 * the linker for ag__flex_eager_anchor. Nothing is cached between calls: each forward and each
 * backward traces and plans anew (about a millisecond), so nothing outlives the call, whatever
 * the score_mod's user data becomes and whichever thread calls. */
#include "plan_internal.h"
#include "../autograd/flex_internal.h"
#include "aotgrad/trace.h"

typedef struct eager_tiles {
    ag_graph *score, *joint;
    struct ag__flex_tiles *st;
} eager_tiles;

static void et_free(void *h) {
    eager_tiles *e = h;
    if (!e)
        return;
    ag__flex_tiles_free(e->st);
    ag_graph_free(e->score);
    ag_graph_free(e->joint);
    ag__free(e);
}

/* Whether the error just set is an allocation failure (the call then fails). */
static bool out_of_memory(int status) {
    return status == AG_ENOMEM || (ag_last_status() == AG_ENOMEM);
}

static int et_make(const ag_score_mod *sm, ag_dtype dt, int64_t L, int64_t S, int64_t QB,
                   int64_t KB, bool bwd, void **h) {
    *h = NULL;
    if (sm->nbuffers > 64)
        return 1;
    ag_tmeta sb[64];
    for (int i = 0; i < sm->nbuffers; i++)
        ag__tmeta_contiguous(&sb[i], ag_tensor_dtype(sm->buffers[i]),
                             ag_tensor_ndim(sm->buffers[i]), ag_tensor_sizes(sm->buffers[i]));
    eager_tiles *e = ag__calloc(1, sizeof *e);
    if (!e)
        return AG_ENOMEM;
    const uint64_t errs = ag__err_count();
    int status = 0;
    e->score = ag_trace_score_mod(sm, dt);
    if (e->score && bwd)
        e->joint = ag_trace_score_mod_joint(sm, dt);
    if (e->score && (!bwd || e->joint))
        e->st = ag__flex_tiles_new(dt, L, S, QB, KB, e->score, e->joint, sb, sm->nbuffers, &status);
    if (e->st) {
        *h = e;
        return 0;
    }
    et_free(e);
    if (ag__err_count() != errs && out_of_memory(status))
        return AG_ENOMEM;
    if (ag__err_count() != errs)
        ag_clear_error();
    return 1;
}

static int et_bind(void *h, ag_tensor *const *bufs, ag_tensor *const *bgrad,
                   const ag__flex_tile_fns **fns) {
    eager_tiles *e = h;
    return ag__flex_tiles_bind(e->st, bufs, bgrad, fns);
}

static int et_done(void *h, int rc) {
    eager_tiles *e = h;
    return ag__flex_tiles_done(e->st, rc);
}

static const ag__flex_eager_hooks hooks = {et_make, et_bind, et_done, et_free};

/* Named by the link options of the static library, so that a static link takes this file. */
int ag__flex_eager_anchor;

__attribute__((constructor)) static void install(void) {
    ag__flex_eager = &hooks;
}
