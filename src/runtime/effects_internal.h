/* The effect-token runtime wrapper (runtime/effects.c), used by compiled.c. */
#ifndef AG_RUNTIME_EFFECTS_INTERNAL_H
#define AG_RUNTIME_EFFECTS_INTERNAL_H

#include "aotgrad/compile.h"

/* Runs g (through plan p, or the interpreter when p is NULL) on `in` with ntok empty f32 effect
 * tokens added: in front of the inputs for a forward graph, behind them for a backward one
 * (backward). Stores the outputs without the token outputs (the forward's first ntok, the
 * backward's last ntok) in outs and returns their count, or a negative status. Outputs are
 * owned as ag_plan_run's: by the open scope if any, else by the caller. */
int ag__effect_tokens_run(const ag_graph *g, ag_plan *p, int ntok, bool backward,
                          ag_tensor *const *in, int nin, ag_tensor **outs, int max_out);

#endif
