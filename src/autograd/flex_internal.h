/* flex_attention's internals shared with the tracer (src/trace/flex_trace.c), which records
 * ag_flex_attention's call as flex_attention / flex_attention_backward nodes while a trace is
 * active. */
#ifndef AG_FLEX_INTERNAL_H
#define AG_FLEX_INTERNAL_H

#include "../core/internal.h"

/* Set by the tracer when a session starts: ag_flex_attention's work under tracing, called
 * with checked arguments (scale already resolved, > 0); same contract as ag_flex_attention. */
typedef int (*ag__flex_trace_fn)(ag_tensor *q, ag_tensor *k, ag_tensor *v,
                                 const ag_score_mod *score_mod, const ag_block_mask *block_mask,
                                 double scale, ag_tensor **out, ag_tensor **lse);
extern ag__flex_trace_fn ag__flex_trace_hook;
/* trace/flex_trace.c: the hook. */
int ag__flex_traced(ag_tensor *q, ag_tensor *k, ag_tensor *v, const ag_score_mod *score_mod,
                    const ag_block_mask *block_mask, double scale, ag_tensor **out,
                    ag_tensor **lse);

/* The block mask's mask_mod (fn NULL when it has none) into *out. */
void ag__block_mask_mod(const ag_block_mask *m, ag_mask_mod *out);
/* Another reference to m (dropped by ag_block_mask_free). */
ag_block_mask *ag__block_mask_retain(const ag_block_mask *m);

#endif
