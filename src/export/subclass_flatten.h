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

#include "joint_facts.h"
#include "../core/subclass_instance.h"
#include "../graph/graph_internal.h"
#include "aotgrad/export.h"

/* What a joint with subclasses records for its compiled callable: the structure of every outer
 * input, of its gradient (as traced) and of every outer user output. Refcounted: the joint and
 * each compiled callable made from it hold one. */
struct ag__subx_info {
    int64_t refcount;
    int nin;          /* outer inputs: params, buffers, args, kwargs */
    ag__scmeta *in;   /* per outer input */
    ag__scmeta *grad; /* per outer input: its gradient's structure (a leaf when plain or none) */
    int nout;         /* outer user outputs */
    ag__scmeta *out;  /* per outer user output */
    int nflat_in, nflat_out;
};

void ag__subx_info_release(ag__subx_info *info); /* NULL: no-op */
ag__subx_info *ag__subx_info_retain(ag__subx_info *info);
/* The joint's record (export.c), NULL for a joint without subclasses. */
ag__subx_info *ag__joint_subclass_info(const ag_joint *j);

#endif
