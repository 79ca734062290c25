/* Tracing: running model code on data-less tensors so that every op call appends a graph node.
 *
 * The same code that runs eagerly traces: while a trace is active the dispatcher skips kernels,
 * gives every op result metadata only (like PyTorch's fake tensors), and hands each call to the
 * tracer, which appends a call node whose arguments are the nodes of the tensors passed in.
 * Tensors that carry data but no node (constants made before tracing) become get_attr nodes.
 *
 * Call sites. Every public op entry point is also a macro (aotgrad/sites.h) that records
 * __FILE__, __LINE__ and __func__ of the caller before the call; module calls and annotated
 * function calls push that site as an outer frame. A node's stack_trace lists the frames
 * outermost first, in Python's traceback format, so it points at the user's source lines:
 *   File "model.c", line 42, in mlp_forward
 *     h = ag_relu(ag_module_forward(self->fc1, x));
 * Ops called inside other ops (composites, backward rules) keep the user's frame.
 *
 * Annotations. ag_annotate_begin(key, value) / ag_annotate_end() nest like
 * torch.fx.traceback.annotate; every node created inside carries the merged map in its
 * `custom` metadata (inner values win). ag_annotate_fn runs a function inside an annotation
 * and makes the function a frame of the stack trace, like annotate_fn. */
#ifndef AOTGRAD_TRACE_H
#define AOTGRAD_TRACE_H

#include "core.h"
#include "flex_attention.h"
#include "graph.h"
#include "nn.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- meta mode ---- */
/* While on, factories and ops produce data-less tensors (shape, dtype, strides only) and run no
 * kernels: build a large model for tracing without allocating its weights. Returns the
 * previous setting. Tracing turns it on for its duration. Meta mode and trace sessions
 * belong to the calling thread: other threads keep running real kernels, and several threads
 * may trace (or export, or decompose graphs) at once. */
AG_API bool ag_set_meta_mode(bool on);
AG_API bool ag_is_meta(const ag_tensor *t); /* no data */

/* ---- tracing ---- */
/* Zero-initialized, or NULL (the same): composites decomposed, stack traces recorded. */
typedef struct ag_trace_opts {
    bool decompose_composites; /* reserved: composites always decompose today */
    bool no_stack_traces;      /* skip recording stack_trace (faster) */
} ag_trace_opts;

/* A function to trace: reads `nin` inputs, stores up to max_out outputs, returns their count
 * or a negative status. */
typedef int (*ag_trace_fn)(void *ud, ag_tensor *const *in, int nin, ag_tensor **out, int max_out);

/* Traces fn on the inputs. Each input becomes a placeholder named names[i] (NULL: arg<i>)
 * with descriptor descs[i] (may be NULL). Returns the graph (caller frees) or NULL. */
AG_API ag_graph *ag_trace(ag_trace_fn fn, void *ud, ag_tensor *const *inputs, int ninputs,
                          const char *const *names, ag_desc *const *descs,
                          const ag_trace_opts *opts);

/* Traces a module's forward: placeholders primals_1.. for its parameters
 * (ParamAOTInput(fqn), named_parameters order, duplicates kept), then buffers
 * (BufferAOTInput(fqn)), then the inputs (PlainAOTInput(i)); the output node's descriptors are
 * PlainAOTOutput(i). Parameters keep their real values untouched: only metadata flows. */
AG_API ag_graph *ag_trace_module(ag_module *m, ag_tensor *const *inputs, int ninputs,
                                 const ag_trace_opts *opts);

/* ---- call sites and annotations ---- */
AG_API void ag_annotate_begin(const char *key, ag_mval value);
AG_API void ag_annotate_end(void);
/* Runs fn(ud) inside the annotation {key: value}; fn's caller site is kept as a stack frame
 * named `fn_name`. Returns fn's result. */
AG_API int ag_annotate_fn(const char *key, ag_mval value, const char *fn_name, int (*fn)(void *ud),
                          void *ud);
/* Records the caller's site (used by the macros in sites.h). */
AG_API void ag_site(const char *file, int line, const char *func);
/* Pushes / pops the current site as an outer frame (module calls do this). */
AG_API void ag_site_push(void);
AG_API void ag_site_pop(void);

/* ---- flex_attention's functions as graphs ----
 * Upstream traces flex_attention's score_mod and mask_mod into subgraphs of the joint
 * (sdpa_score0 and fw_graph0, joint_graph0, sdpa_mask0 and mask_graph0). These trace them the
 * same way, on 0-d stand-ins (a score of dtype dt; b, h, q_idx, kv_idx int64), every buffer a
 * placeholder of its own after those; placeholders are named arg0_1, arg1_1, ... as upstream's.
 *   ag_trace_score_mod:       (score, b, h, q_idx, kv_idx, *buffers) -> (new score)
 *   ag_trace_score_mod_joint: (score, b, h, q_idx, kv_idx, grad, *buffers) ->
 *                             (grad of score, None, None, None, None, grad of each buffer
 *                              (None for one that is not float or gets no gradient))
 *   ag_trace_mask_mod:        (b, h, q_idx, kv_idx, *buffers) -> (keep)
 * dt: float32 or float64. The buffers are read for their metadata only. Safe inside another
 * trace (fresh stand-ins are traced, so the outer trace's bindings stay). Returns a graph the
 * caller frees, or NULL with AG_EINVAL (a NULL function, a NULL buffer, more than 64 buffers,
 * another dt, the function's own failure) or AG_ENOMEM. */
AG_API ag_graph *ag_trace_score_mod(const ag_score_mod *score_mod, ag_dtype dt);
AG_API ag_graph *ag_trace_score_mod_joint(const ag_score_mod *score_mod, ag_dtype dt);
AG_API ag_graph *ag_trace_mask_mod(const ag_mask_mod *mask_mod);

#ifdef __cplusplus
}
#endif
#endif
