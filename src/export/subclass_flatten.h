/* Tensor subclasses in the joint export (export/subclass_flatten.c) and what the joint keeps for
 * the compiled callable (runtime/subclass_wrap.c): upstream's aot_dispatch_subclass.
 *
 * The export's subclass wrapper (ag__subclass_wrapper, export_wrappers.h) asks this file for
 * the flattened primals (one per plain inner tensor, with SubclassGetAttrAOTInput
 * descriptors), flattens the user outputs after the forward, and traces the whole autograd
 * part (tangents, gradients) itself when a subclass is involved. Models without subclasses
 * never create the state (sx stays NULL), so their graphs are untouched. */
#ifndef AG_EXPORT_SUBCLASS_H
#define AG_EXPORT_SUBCLASS_H

#include "../core/subclass_instance.h"
#include "../graph/graph_internal.h"
#include "aotgrad/export.h"

/* What a joint with subclasses records for its compiled callable: the structure of every outer
 * input, of its gradient (as traced) and of every outer user output. Refcounted: the joint and
 * each compiled callable made from it hold one. */
typedef struct ag__subx_info {
    int64_t refcount;
    int nin;          /* outer inputs: params, buffers, args, kwargs */
    ag__scmeta *in;   /* per outer input */
    ag__scmeta *grad; /* per outer input: its gradient's structure (a leaf when plain or none) */
    int nout;         /* outer user outputs */
    ag__scmeta *out;  /* per outer user output */
    int nstatic;      /* flattened primals that come from params and buffers */
    int nflat_in, nflat_out;
} ag__subx_info;

void ag__subx_info_release(ag__subx_info *info); /* NULL: no-op */
ag__subx_info *ag__subx_info_retain(ag__subx_info *info);
/* The joint's record (export.c), NULL for a joint without subclasses. */
ag__subx_info *ag__joint_subclass_info(const ag_joint *j);

/* ---- the export ---- */
typedef struct ag__subx ag__subx;

/* Looks at the outer inputs (params, buffers, args, kwargs); when one is a subclass instance,
 * *sx becomes the flattening state, else NULL. 0 or a negative status. */
int ag__subx_begin(ag__subx **sx, const ag_named_tensors *ps, const ag_named_tensors *bs,
                   ag_tensor *const *args, int nargs, ag_tensor *const *kwargs, int nkwargs);
int ag__subx_num_flat(const ag__subx *sx);
/* Flattened primal i: its plain tensor (borrowed) and, in *desc, a new reference to its
 * descriptor. */
ag_tensor *ag__subx_flat(const ag__subx *sx, int i, ag_desc **desc);
bool ag__subx_flat_requires_grad(const ag__subx *sx, int i); /* its outer input's, if float */
/* Whether flattened input i is an inner tensor of a subclass instance (not a plain input). */
bool ag__subx_flat_is_inner(const ag__subx *sx, int i);
/* Starts an export pass: inner[] holds the pass's tensors for the flattened inputs (the
 * alias plan's, bound to the placeholders); the outer inputs are rebuilt from them (instances
 * rewrapped, requires_grad as the caller's), the module's parameters and buffers replaced by
 * theirs until ag__subx_pass_end, and *user receives the outer user inputs to call the forward
 * with. */
int ag__subx_pass_begin(ag__subx *sx, ag_module *m, ag_tensor *const *inner, ag_tensor ***user);
/* Ends the pass: the module's tensors are restored and the pass's outer inputs and outputs
 * dropped (the input flattening stays for the next pass). */
void ag__subx_pass_end(ag__subx *sx, ag_module *m);
/* Whether the state was made by ag__subx_outputs for plain inputs (freed after its pass). */
bool ag__subx_pass_owned(const ag__subx *sx);
int ag__subx_num_static(const ag__subx *sx); /* flattened inputs from params and buffers */
/* After the forward: replaces the outer outputs outs[0..nouts) by their flattened plain
 * tensors (the state keeps the outer ones) and returns the new count, or a negative status.
 * Creates the state when the inputs were plain but an output is a subclass (the flat primals
 * are then the outer inputs: flat/flat_descs, nstatic of them from params and buffers). */
int ag__subx_outputs(ag__subx **sx, ag_tensor **outs, int nouts, int max_out,
                     ag_tensor *const *flat, ag_desc *const *flat_descs, int nflat, int nstatic);
bool ag__subx_out_requires_grad(const ag__subx *sx, int k); /* flattened output k's outer's */
ag_desc *ag__subx_out_desc(const ag__subx *sx, int k);      /* new reference */
ag_desc *ag__subx_mutation_desc(const ag__subx *sx, int i); /* of flattened primal i; new */
/* A copy of the record (NULL without a state); 0 or AG_ENOMEM. */
int ag__subx_finish(ag__subx *sx, ag__subx_info **info);
void ag__subx_free(ag__subx *sx); /* NULL: no-op */

#endif
