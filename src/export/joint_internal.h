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
    /* The flat inputs' descriptors (alias.nflat owned references), in calling order:
     * ParamAOTInput, BufferAOTInput, PlainAOTInput, or SubclassGetAttrAOTInput(base=...) for
     * the inner tensors of a flattened subclass instance. Made once where the joint is made
     * (the export, ag_joint_update, the saved-joint reader); everything that asks which flat
     * input is what (static inputs, the compiled callable's messages) reads it. */
    ag_desc **flat_descs;
    /* Tensor subclasses flattened (subclass_flatten.c), or NULL. */
    ag__subx_info *subclass;
};

/* Releases n descriptors and their array (NULL: no-op). */
static inline void ag__joint_flat_descs_free(ag_desc **d, int n) {
    for (int i = 0; d && i < n; i++)
        ag_desc_release(d[i]);
    ag__free(d);
}

/* The forward effect tokens: the first primals. */
static inline int ag__joint_ntok(const ag_joint *j) {
    return j->layout.sec[AG_SEC_IN_FW_TOKENS].count;
}

#endif
