/* Views and aliasing in the joint export and the compiled callable (alias.c, and
 * src/runtime/alias_rt.c): upstream's stage-1 wrappers (AOTDedupeWrapper,
 * AOTSyntheticBaseWrapper) and the aliasing half of its RuntimeWrapper epilogue.
 * Internal to the library. */
#ifndef AG_EXPORT_ALIAS_H
#define AG_EXPORT_ALIAS_H

#include "../graph/graph_internal.h"
#include "aotgrad/export.h"

#include "joint_facts.h"

void ag__joint_alias_clear(ag__joint_alias *a);
int ag__joint_alias_copy(ag__joint_alias *dst, const ag__joint_alias *src);
/* export.c: the joint's aliasing facts (borrowed). */
const ag__joint_alias *ag__joint_alias_of(const ag_joint *j);

/* ---- the export's plan (alias.c) ----
 * One export pass traces the forward with a layout: which flat inputs become which primals.
 * The first pass assumes no duplicate is mutated (duplicates stay separate leaves, upstream's
 * strategy 1) and merges every group of distinct inputs that overlap in one storage into a
 * base; ag__aplan_refine then applies upstream's rules to what the pass saw (a mutated
 * duplicate removes all duplicates; only groups with a data mutation keep their base) and
 * says whether a second pass with the final layout is needed. */

/* flat: params, buffers, user args, kwargs (borrowed, they must outlive the plan); descs:
 * theirs (borrowed too), which say which flat inputs are parameters and buffers
 * (ParamAOTInput / BufferAOTInput, by target); module_tensors: whether those are the module's
 * own tensors, which the plan binds and swaps (false for inner tensors of subclasses). */
ag__alias_plan *ag__aplan_new(ag_tensor *const *flat, ag_desc *const *descs, int nflat,
                              bool module_tensors);
void ag__aplan_free(ag__alias_plan *P);
int ag__aplan_num_primals(const ag__alias_plan *P);
/* Primal p's descriptor (borrowed) and the example tensor its placeholder stands for. */
const ag_desc *ag__aplan_primal_desc(const ag__alias_plan *P, int p);
ag_tensor *ag__aplan_primal_example(const ag__alias_plan *P, int p);

/* Starts a pass: binds the placeholders to tensors standing for the primals, regenerates
 * merged inputs from their base (as_strided ops, traced), and points module m's parameters
 * and buffers at the tensors the graph must see for them (separate leaves for tied weights).
 * *user receives the tensors to call the forward with (nflat - nparams - nbuffers). */
int ag__aplan_begin(ag__alias_plan *P, ag_module *m, ag__tracer *T, ag_node *const *placeholders,
                    ag_tensor ***user);
/* The tensor primal p is in this pass (for gradients). */
ag_tensor *ag__aplan_primal_tensor(const ag__alias_plan *P, int p);
/* The tensors the flat inputs are in this pass (what the forward sees for them; nflat). */
ag_tensor *const *ag__aplan_flat_tensors(const ag__alias_plan *P);
/* After the forward: mutations of primals (into info, one per primal) and of merged inputs,
 * the aliasing of the outputs (out_info, one per output; nothing requires grad unless
 * any_rg_in). Fills *alias (owned by the caller afterwards). */
int ag__aplan_analyze(ag__alias_plan *P, ag__tracer *T, ag_tensor *const *outs, int nouts,
                      bool any_rg_in, ag_input_info *info, ag_output_info *out_info,
                      ag__joint_alias *alias);
/* The extra forward outputs the analysis found: metadata mutations of merged inputs, then
 * intermediate bases, as tensors (borrowed) with their descriptors (new references). */
int ag__aplan_extra_outputs(ag__alias_plan *P, const ag_output_info *out_info, ag_tensor **t,
                            ag_desc **d, int max);
/* Undoes begin's changes to the module (its tensors and their geometry). */
void ag__aplan_end(ag__alias_plan *P, ag_module *m);
/* Decides the final layout from the pass just made (needs_autograd: its joint's). Returns 1
 * when another pass is needed, 0 when the pass was final, or a negative status with
 * upstream's message when the aliasing is not supported. */
int ag__aplan_refine(ag__alias_plan *P, const ag_input_info *info, bool needs_autograd);

/* ---- the compiled callable's wrappers (ag__rt_primals in alias.c, the others in
 * src/runtime/alias_rt.c) ---- */

/* t has m's sizes and, along every dim of size > 1, m's strides. */
bool ag__same_strides(const ag_tensor *t, const ag_tmeta *m);
/* The primals for flat inputs: prim[p] is borrowed (a flat input or its ._base) or, for a
 * synthetic base, a new tensor recorded in owned[] (*nowned of them, the caller frees).
 * Checks duplicates and merged views against the export; errors name the inputs. */
int ag__rt_primals(const ag__joint_alias *a, const ag_tmeta *prim_meta, ag_tensor *const *flat,
                   int nflat, ag_tensor **prim, ag_tensor **owned, int *nowned);
/* ag__rt_primals whose errors name flat input i by flat_desc[i] (nflat entries, NULL ones and a
 * NULL array allowed) and `pos` ("input", or "flat input" where the flat inputs are parts of
 * tensor subclass instances). */
int ag__rt_primals_named(const ag__joint_alias *a, const ag_tmeta *prim_meta,
                         ag_tensor *const *flat, int nflat, ag_desc *const *flat_desc,
                         const char *pos, ag_tensor **prim, ag_tensor **owned, int *nowned);
/* A message's name for a flat input: "PlainAOTInput(idx=0) (input 2)" from its descriptor d, or
 * "input 2" when d is NULL. Returns buf. */
const char *ag__flat_input_name(const ag_desc *d, const char *pos, int i, char *buf, size_t n);
/* Applies metadata mutations of primal p (data is copied by the caller). */
void ag__rt_set_geometry(ag_tensor *t, const ag_tmeta *rel, int64_t base_offset);
/* The output regenerated from its base (an eager view, differentiable through base). */
ag_tensor *ag__rt_regen(ag_tensor *base, const ag_tmeta *rel, const ag_tmeta *base_meta,
                        bool requires_grad);

#endif
