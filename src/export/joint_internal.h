/* The joint's state (struct ag_joint), shared by the export (export.c), which builds it, and
 * the saved-joint reader and writer (joint_io.c), which rebuilds it from text. Internal to the
 * library: users see the accessors of include/aotgrad/export.h. */
#ifndef AG_EXPORT_JOINT_INTERNAL_H
#define AG_EXPORT_JOINT_INTERNAL_H

#include "alias.h"
#include "subclass_flatten.h"

/* The counts and descriptors of the convention's sections (tokens, tangents, philox inputs,
 * mutation and extra outputs) are the graph's: read them from `layout`, never keep copies. */
struct ag_joint {
    ag_graph *g;
    ag_layout layout; /* read from g's descriptors (layout.c) whenever g is set */
    char **params, **buffers;
    int nparams, nbuffers;
    ag_treespec *in_spec, *out_spec;
    int nprimals;  /* in_info's length: forward tokens and primals */
    int nuser_out; /* out_info's length */
    ag_input_info *in_info;
    ag_output_info *out_info;
    bool needs_autograd;
    ag__joint_alias alias; /* flat inputs -> primals, aliasing outputs (alias.c) */
    /* Tensor subclasses flattened (subclass_flatten.c), or NULL; the flat inputs that are
     * parameters and buffers (their inner tensors when flattened). */
    ag__subx_info *subclass;
    int npb_flat;
};

/* The forward effect tokens: the first primals. */
static inline int ag__joint_ntok(const ag_joint *j) {
    return j->layout.sec[AG_SEC_IN_FW_TOKENS].count;
}

#endif
