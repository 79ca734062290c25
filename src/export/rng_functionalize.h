/* RNG functionalization of the joint export (src/export/rng_functionalize.c), used by its
 * wrapper there (ag__rng_wrapper).
 *
 * While installed on the export's tracer, every random op the model (or a backward rule) calls
 * is recorded as a draw from explicit generator state: placeholders fwd_seed / fwd_base_offset
 * (PhiloxForwardSeedAOTInput, PhiloxForwardBaseOffsetAOTInput) for draws in the forward,
 * bwd_seed / bwd_base_offset for draws in the backward, made when a side first draws. Each draw
 * reads offset add(base_offset, k), k the count of numbers that side drew before it (upstream's
 * PhiloxStateTracker); the side's total becomes the output add(base_offset, total), described
 * PhiloxUpdatedForwardOffsetAOTOutput / PhiloxUpdatedBackwardOffsetAOTOutput. */
#ifndef AG_EXPORT_RNG_INTERNAL_H
#define AG_EXPORT_RNG_INTERNAL_H

#include "../graph/graph_internal.h"

typedef struct ag__rng_fn ag__rng_fn;

/* Installs RNG functionalization on tracer T, which traces into g. NULL when out of memory. */
ag__rng_fn *ag__rng_begin(ag__tracer *T, ag_graph *g);
/* Draws from now on belong to the backward (upstream's mark_beginning_of_backward). */
void ag__rng_mark_backward(ag__rng_fn *R);
/* When the forward (backward) side drew: traces its updated offset add(base_offset, total) and
 * stores the node and a new descriptor reference; returns 1. Returns 0 when the side drew
 * nothing, a negative status on failure. */
int ag__rng_updated_offset(ag__rng_fn *R, bool backward, ag_node **node, ag_desc **desc);
/* Moves the philox placeholders behind every other placeholder, in the order fwd_seed,
 * fwd_base_offset, bwd_seed, bwd_base_offset, and stores their descriptors (new references)
 * in descs[0..4); returns how many there are. */
int ag__rng_finish(ag__rng_fn *R, ag_desc **descs);
/* Frees the state (call it once the tracer has ended); NULL is a no-op. */
void ag__rng_free(ag__rng_fn *R);

#endif
