/* Effect tokens of the joint export (export/token_chain.c, used by its wrapper there,
 * ag__effect_tokens_wrapper): the forward's and the backward's token chains, their placeholders
 * and their final tokens. */
#ifndef AG_EXPORT_EFFECTS_INTERNAL_H
#define AG_EXPORT_EFFECTS_INTERNAL_H

#include "../graph/graph_internal.h"

typedef struct ag__export_tokens {
    ag__token_chain fw, bw; /* set on the tracer for the forward, then for the backward */
    ag_graph *g;
    int nprimals; /* placeholders before the forward token: its arrival renumbers them */
} ag__export_tokens;

/* Chains for the export into g, whose nprimals primal placeholders exist already. The forward
 * token, made on the forward's first effect, becomes the first placeholder primals_1
 * (ForwardTokenAOTInput(0)) and the other primals shift to primals_2..; the backward token,
 * made on the backward's first effect, is placeholder tangents_token
 * (BackwardTokenAOTInput(0), tagged is_backward) after the tangents. Every effectful op shares
 * one token per chain (one effect key, as upstream's ORDERED effect type). */
void ag__export_tokens_init(ag__export_tokens *tk, ag_graph *g, int nprimals);
/* How many tokens a chain has (0 or 1). */
int ag__export_tokens_count(const ag__export_tokens *tk, bool backward);
/* Stores the chain's final tokens and their output descriptors (ForwardTokenAOTOutput(i) /
 * BackwardTokenAOTOutput(i), new references) at nodes/descs; returns how many, or a negative
 * status. */
int ag__export_tokens_outputs(const ag__export_tokens *tk, bool backward, ag_node **nodes,
                              ag_desc **descs);

#endif
