/* The effect-token runtime wrapper (runtime/effect_tokens.c), used by compiled.c. */
#ifndef AG_RUNTIME_EFFECTS_INTERNAL_H
#define AG_RUNTIME_EFFECTS_INTERNAL_H

#include "aotgrad/compile.h"

/* Runs g (through r, what its compiler made of it) on `in` with ntok empty f32 effect
 * tokens added where g's placeholders carry token descriptors (the forward's first, the
 * backward's after its tangents), the caller's inputs filling the other placeholders in order.
 * Stores the outputs without those described as tokens in outs and returns their count, or a
 * negative status. Outputs are owned as ag_plan_run's: by the open scope if any, else by the
 * caller. */
/* What a run keeps for the next one (so a warm run allocates nothing): the empty token tensor
 * (never written, so shared by every run) and the argument arrays. Zero-initialized. */
typedef struct ag__effect_cache {
    ag_tensor *tok;
    ag_tensor **xin, **xout;
    int cap_in, cap_out;
} ag__effect_cache;

int ag__effect_tokens_run(ag__effect_cache *e, const ag_graph *g, const ag_runnable *r, int ntok,
                          ag_tensor *const *in, int nin, ag_tensor **outs, int max_out);
void ag__effect_cache_clear(ag__effect_cache *e);

#endif
