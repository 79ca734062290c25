/* keep_inference_input_mutations (ag_export_opts): input mutations of an inference graph kept
 * in the graph as trailing copy_ nodes (internal; inference_mutations.c). */
#ifndef AG_EXPORT_INFERENCE_MUTATIONS_H
#define AG_EXPORT_INFERENCE_MUTATIONS_H

#include "aotgrad/export.h"

/* Rewrites g, an inference joint (no tangents, no grads), as upstream's
 * keep_inference_input_mutations does: each output described as
 * InputMutationAOTOutput(mutated_input=D) whose input is mutated in its data only becomes a
 * `copy_(<placeholder described as D>, <new value>)` node placed just before the output node,
 * tagged must_be_in_forward, and leaves the output list (with its descriptor). info[i] are the
 * facts of the i-th placeholder for the first n placeholders (ag_joint_input_info: the
 * primals; the RNG seeds and offsets after them are never mutated inputs): an input whose
 * metadata is mutated, or that requires grad, keeps its InputMutationAOTOutput.
 * Running the graph then updates those inputs in place (the interpreter and the planned
 * executor both run an in-place op on a placeholder's tensor).
 *
 * Returns how many mutations moved into the graph (0: g unchanged; a second call finds none),
 * or a negative status naming the problem (a training joint, a count mismatch, a mutation
 * output whose input no placeholder carries); when a call fails g is unchanged. */
int ag__keep_input_mutations_in_graph(ag_graph *g, const ag_input_info *info, int n);

#endif
