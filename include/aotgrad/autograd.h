/* Eager reverse-mode autograd.
 *
 * Every op call with an input that requires grad (while grad mode is on) creates an autograd
 * node that remembers the op, the tensors its backward rule needs (with their storage versions)
 * and where each input's gradient goes. Nodes get increasing sequence numbers (seq_nr), as in
 * PyTorch. ag_backward runs the backward rules in dependency order, highest seq_nr first among
 * ready nodes, sums gradients of values used more than once, reduces broadcast gradients to
 * their input's shape, and accumulates into the .grad of leaves. */
#ifndef AOTGRAD_AUTOGRAD_H
#define AOTGRAD_AUTOGRAD_H

#include "core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Grad mode. Returns the previous setting, so `bool prev = ag_set_grad_enabled(false); ...;
 * ag_set_grad_enabled(prev);` is a no-grad region. */
AG_API bool ag_set_grad_enabled(bool enabled);
AG_API bool ag_is_grad_enabled(void);

/* Backpropagates from `output`. grad is the gradient of output (borrowed), or NULL when output
 * has one element (then 1). Accumulates into .grad of every leaf that requires grad. Unless
 * retain_graph, the saved tensors are freed and a second backward through the same nodes is an
 * error. */
AG_API int ag_backward(ag_tensor *output, ag_tensor *grad, bool retain_graph);

/* Like torch.autograd.grad: gradients of `outputs` (with grad_outputs, entries may be NULL for
 * one-element outputs) with respect to `inputs`, stored as new references in grads (NULL for an
 * input that does not influence the outputs when allow_unused, else an error). Leaves' .grad
 * are not touched. */
AG_API int ag_grad(ag_tensor *const *outputs, ag_tensor *const *grad_outputs, int noutputs,
                   ag_tensor *const *inputs, int ninputs, ag_tensor **grads, bool retain_graph,
                   bool allow_unused);

/* The sequence number of t's autograd node (-1 for leaves and tensors without history). */
AG_API int64_t ag_tensor_seq_nr(const ag_tensor *t);
/* Name of t's autograd node ("AddmmBackward0"-like: op name + "Backward"), or NULL. */
AG_API const char *ag_tensor_grad_fn_name(const ag_tensor *t);

/* ---- activation checkpointing ---- */

/* A checkpointed function: reads nin borrowed inputs, stores up to max_out outputs (new
 * references, none NULL) and returns their count, or a negative status with a message set (as
 * ag_forward_fn). It may read other tensors (parameters); it must compute the same thing when
 * called again on the same inputs, and must not mutate its inputs. */
typedef int (*ag_checkpoint_fn)(void *ud, ag_tensor *const *inputs, int nin, ag_tensor **outs,
                                int max_out);

/* torch.utils.checkpoint.checkpoint(fn, *inputs, use_reentrant=False): returns fn's outputs
 * (their count; outs[0..n) new references the caller owns) without keeping the region's
 * activations. With grad mode on, fn runs with grad mode off and one autograd node
 * ("CheckpointFunctionBackward") leads from the outputs to every tensor requiring grad that
 * fn read (its inputs and the parameters it uses, so those get gradients as without the
 * checkpoint); its backward restores the generator's state as it was when fn ran (so dropout
 * draws the same masks), reruns fn with grad mode on, backpropagates through the rerun and
 * puts the generator back. fn and ud must stay valid until that backward ran or the outputs
 * were freed. With grad mode off, fn just runs. Under tracing (ag_export_joint) fn is traced
 * as usual and its forward nodes are tagged recompute=MUST_RECOMPUTE with the region's
 * ac_graph_id (1, 2, ... in the order the regions are traced; a region inside another belongs
 * to the outer one), so the partitioner recomputes them in the backward. Inside a nested
 * compile region the tags are the subgraphs' (ac_graph_id counted from 1 in each subgraph),
 * and a nested compile region called inside fn is checkpointed as a whole (see
 * ag_nested_compile_region). Errors: a NULL fn or
 * outs, max_out < 1, a NULL input (AG_EINVAL, nothing run); fn's own failure (its status and
 * message, nothing returned); in the backward, a rerun whose outputs differ in count, shape
 * or dtype (AG_EINVAL). */
AG_API int ag_checkpoint(ag_checkpoint_fn fn, void *ud, ag_tensor *const *inputs, int nin,
                         ag_tensor **outs, int max_out);

/* ---- nested compile regions ---- */

/* A region's function: as ag_checkpoint_fn (nin borrowed inputs; up to max_out outputs, new
 * references, none NULL; their count or a negative status with a message set). */
typedef int (*ag_region_fn)(void *ud, ag_tensor *const *inputs, int nin, ag_tensor **outs,
                            int max_out);

/* torch.compiler.nested_compile_region: marks fn as a region that is traced once and reused.
 * Eager (no trace active): just runs fn (same results, same autograd). Under a trace (ag_trace,
 * ag_trace_module, ag_export_joint) the first call with a given key (fn, and each input's
 * dtype, sizes, strides and requires_grad) traces fn in a nested session into a new subgraph
 * of the traced graph (`repeated_subgraphK`: placeholders arg0_1, arg1_1, ... for the inputs,
 * an output node returning a tuple) and records
 *     invoke_subgraph(%repeated_subgraphK, 'fw_subgraph_I', inputs...)
 * plus one getitem per output; later calls with the same key record a call of the same
 * subgraph without running fn. Its nodes carry the annotations open inside the region only
 * (the outer ones are not inherited, as upstream); the outer nodes take those open around
 * the call, and the invoke_subgraph the custom entry 'call_id' (1, 2, ...: one per call, the
 * backward call sharing its forward's). Under ag_export_joint with an input requiring grad,
 * the first call also traces the region's joint into `repeated_subgraphK+1` (placeholders:
 * the inputs, then one tangent per output; outputs: one gradient per input, None where the
 * input does not require grad, then the forward's outputs), and the backward records
 *     invoke_subgraph(%repeated_subgraphK+1, 'bw_subgraph_I_0', inputs..., tangents...)
 * plus a getitem per gradient needed. A region called inside another region's fn is traced
 * the same way into the outer region's subgraphs (upstream's nested invoke_subgraph): its
 * subgraphs are attributes of the outer one's (`repeated_subgraphK` numbered per graph), each
 * traced once per key however many levels and calls reach it (a copy in each graph calling
 * it), its identifiers numbered with the others'; the outer joint subgraph calls the inner
 * one's forward and joint subgraphs; random ops in it draw from the outer region's seed and
 * offset operands. Regions nest at most 16 deep (AG_ENOTSUP beyond: a region calling
 * itself). Checkpointing composes: ag_checkpoint called by fn tags its part of both
 * subgraphs (recompute=MUST_RECOMPUTE, ac_graph_id 1, 2, ... within each subgraph), and a
 * region called inside an ag_checkpoint'd function has all its forward nodes tagged (being
 * inside a checkpoint is then part of the key); the partitioner partitions the region's joint
 * once, saving what checkpointing saves and recomputing the rest in the partitioned backward
 * subgraph. Eager, checkpointing works as without the region. Random ops inside the region
 * (dropout, rand, ...) under ag_export_joint (RNG functionalization): both subgraphs take a
 * Philox seed and base offset after the inputs (placeholders philox_seed, philox_base_offset;
 * None as their gradients) and every call passes the export's seed and its own offset, so each
 * call draws what eager's call draws (compiled training stays bit-identical to eager). fn must
 * read the traced tensors it
 * uses through its inputs (it is traced with fresh stand-ins for them), and what it computes must
 * depend on nothing else: ud is not part of the key. Messages name the region `function 0x...`
 * (fn's address). Returns the output count; outs[0..n) are new references the caller owns
 * (data-less under a trace). Refused under a trace (AG_EINVAL or AG_ENOTSUP, naming the region): fn
 * reading a tensor of the enclosing trace that is not among its inputs, mutating an input in place,
 * an effectful op inside the region, a random op inside it under a trace without RNG
 * functionalization (ag_trace, ag_trace_module, keep_random_ops) or in its backward, an output
 * aliasing an input, more than 16 inputs+outputs (the RNG state's two included) for the joint. fn
 * and ud must stay valid while the trace runs. Errors also: a NULL fn or outs, max_out < 1, a NULL
 * input (AG_EINVAL, nothing run); fn's own failure (its status and message). Thread-safety: per
 * thread, as tracing. */
AG_API int ag_nested_compile_region(ag_region_fn fn, void *ud, ag_tensor *const *inputs, int nin,
                                    ag_tensor **outs, int max_out);

/* ---- gradcheck ---- */

/* A function of n float64 inputs storing up to AG_GRADCHECK_MAX_OUT outputs in outs and their
 * count in *nouts, returning 0 or a negative status. ag_gradcheck calls it inside an
 * autorelease scope of its own and never frees the outputs itself: they are the ops' results,
 * owned by that scope (do not ag_tensor_keep them, which would leak them). */
#define AG_GRADCHECK_MAX_OUT 4
typedef int (*ag_gradcheck_fn)(void *ud, ag_tensor *const *inputs, int n, ag_tensor **outs,
                               int *nouts);

/* Zero-initialized, or NULL: torch.autograd.gradcheck's defaults. Each field that is 0 means
 * its default; a tolerance of exactly 0 is asked for with AG_GRADCHECK_ZERO. Negative or
 * non-finite values are refused (AG_EINVAL). */
typedef struct ag_gradcheck_opts {
    double eps;  /* finite-difference step; 0: 1e-6 */
    double atol; /* 0: 1e-5; AG_GRADCHECK_ZERO: 0 */
    double rtol; /* 0: 1e-3; AG_GRADCHECK_ZERO: 0 */
} ag_gradcheck_opts;
/* A tolerance of 0 in ag_gradcheck_opts, where plain 0 means the default: negative zero (0 to
 * any arithmetic, told apart by its sign bit). */
#define AG_GRADCHECK_ZERO (-0.0)

/* Compares analytical gradients (ag_grad with random grad_outputs) against central finite
 * differences, for every input with requires_grad and every floating output. Inputs must be
 * float64. Returns 0 when they agree; otherwise AG_EINVAL with a message naming the input,
 * output, element and both values. opts may be NULL. */
AG_API int ag_gradcheck(ag_gradcheck_fn fn, void *ud, ag_tensor *const *inputs, int n,
                        const ag_gradcheck_opts *opts);

#ifdef __cplusplus
}
#endif
#endif
