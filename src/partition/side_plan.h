/* What each side of a partition runs for a saved set, and the peak-memory model of a step run
 * that way (side_plan.c). partition.c and mincut.c use it; it uses only the classified joint
 * (partition_internal.h). */
#ifndef AG_SIDE_PLAN_H
#define AG_SIDE_PLAN_H

#include "partition_internal.h"

/* Marks valid[i] for the nodes a side can compute from its inputs (upstream's InvalidNode
 * propagation in _extract_graph_with_inputs_outputs) and needed[i] for those its outputs (and
 * its effectful nodes) read, inputs included; is_input, valid and needed hold P->nn entries.
 * Errors (AG_EINVAL) when an output is invalid. */
int ag__side_nodes(const ag__part *P, const bool *is_input, bool backward, const int *outs,
                   int nouts, bool *valid, bool *needed);

/* Builds the plan for `saved` (joint indices, any order, duplicates allowed): extraction as
 * _extract_fwd_bwd_modules (unused saved values dropped), then the backward reordering.
 * Errors (AG_EINVAL) when an output cannot be computed from its side's inputs. On success *pl
 * owns three arrays that ag__plan_free releases; on failure *pl is empty. */
int ag__plan_make(const ag__part *P, const int *saved, int nsaved, ag__plan *pl);
void ag__plan_free(ag__plan *pl);

/* The peak-memory model of one training step run as the plan says: the forward with values
 * freed after their last use and the saved values kept to its end, then the backward starting
 * with the saved values alive, recomputed values alive from their recomputation to their last
 * use. A subgraph call (invoke_subgraph) holds its outputs and, while it runs, its subgraph's
 * intermediates (ag__subgraph_extra_bytes) on top of what is live at the call. Views share their
 * base's storage; a multi-output call writes all its outputs at once. Graph inputs, tangents and
 * constants cost nothing, and other graph outputs (user outputs, gradients) leave the step's memory
 * when made: they belong to the caller, are the same for every partition, and counting gradients to
 * the end would bury the activations under the parameter-sized gradients. The executor
 * (src/runtime) reports the real planned peaks. */
int ag__plan_peak(const ag__part *P, const ag__plan *pl, ag__peak *out);
/* What the plan's backward recomputes (the forward nodes it runs again, their op-table flops):
 * ag__plan_peak's recomputed_nodes and recompute_flops without the memory model. */
void ag__plan_recompute(const ag__part *P, const ag__plan *pl, int *nodes, double *flops);

/* What running subgraph sub (an invoke_subgraph's) holds beyond its inputs and outputs: the
 * highest bytes of its intermediate values alive at once (a call of a nested subgraph adding
 * that subgraph's, recursively), each freed after its last read (views share their base's storage;
 * inputs and constants cost nothing; the outputs are the caller's buffers, counted by the call).
 * The peak model adds it to what is live at each call (ag__pinfo.sub_extra). A negative status on
 * failure (out of memory). */
int64_t ag__subgraph_extra_bytes(const ag_graph *sub);

/* Adds to a saved set every random node the backward would otherwise run again (aotgrad does
 * not functionalize the generator), every collective it would run again that is not tagged
 * AG_MUST_RECOMPUTE (its wait_tensor's value, so that no rank communicates twice), and every
 * value of a forward effect; *saved (an ag__malloc'd
 * array the caller owns) is reallocated. out (may be NULL) receives ag__plan_make's plan of the
 * final set (the caller frees it with ag__plan_free), which the check has made anyway. */
int ag__save_random_nodes(const ag__part *P, int **saved, int *nsaved, ag__plan *out);

#endif
