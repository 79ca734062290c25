/* The functionalized-RNG runtime wrapper of the compiled callable (upstream's
 * FunctionalizedRngRuntimeWrapper), used by compiled.c; rng_wrap.c has the details. */
#ifndef AG_RNG_WRAP_H
#define AG_RNG_WRAP_H

#include "../core/internal.h"
#include "aotgrad/graph.h"

/* Where one partitioned graph takes the generator's state and returns its new offset, found
 * by descriptor: the forward's PhiloxForward{Seed,BaseOffset}AOTInput placeholders and
 * PhiloxUpdatedForwardOffsetAOTOutput output, or the backward's counterparts. */
typedef struct ag__rng_wrap {
    int seed_in, offset_in;       /* placeholder positions, -1: the graph draws nothing */
    int offset_out;               /* output position of the updated offset, -1: none */
    ag_tensor *seed_t, *offset_t; /* the 0-dim tensors fed last time, reused when free */
} ag__rng_wrap;

/* Reads g's descriptors; errors when the seed comes without its offset or output. */
int ag__rng_wrap_init(ag__rng_wrap *w, const ag_graph *g, bool backward);
/* Number of graph inputs the wrapper supplies (0 or 2). */
int ag__rng_wrap_num_inputs(const ag__rng_wrap *w);
/* Stores the generator's seed and offset, as 0-dim int64 tensors the wrapper owns (refilled in
 * place when nothing else holds last call's, e.g. a pending backward that saved them), at
 * in[seed_in] and in[offset_in] (borrowed). No-op when the graph draws nothing. */
int ag__rng_wrap_feed(ag__rng_wrap *w, ag_tensor **in);
/* Releases the wrapper's tensors. */
void ag__rng_wrap_clear(ag__rng_wrap *w);
/* Sets the generator's offset to the updated offset the graph returned in outs. */
int ag__rng_wrap_advance(const ag__rng_wrap *w, ag_tensor *const *outs, int nouts);

#endif
