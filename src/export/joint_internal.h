/* The joint's state (struct ag_joint), shared by the export (export.c), which builds it, and
 * the saved-joint reader and writer (joint_io.c), which rebuilds it from text. Internal to the
 * library: users see the accessors of include/aotgrad/export.h. */
#ifndef AG_EXPORT_JOINT_INTERNAL_H
#define AG_EXPORT_JOINT_INTERNAL_H

#include "alias.h"
#include "subclass_flatten.h"

struct ag_joint {
    ag_graph *g;
    ag_layout layout; /* read from g's descriptors (layout.c) whenever g is set */
    char **params, **buffers;
    int nparams, nbuffers;
    ag_treespec *in_spec, *out_spec;
    int nprimals, ntangents, nuser_out, nmutated;
    ag_input_info *in_info;
    ag_output_info *out_info;
    bool needs_autograd;
    ag_desc **primal_descs;     /* for ag_joint_set_graph's checks */
    ag_desc **tangent_descs;    /* tangents, then backward tokens */
    int nfw_tokens, nbw_tokens; /* effect tokens (effects.c): first primals, last tangents */
    int nmetamut, ninter;       /* extra forward outputs (alias.c) */
    ag__joint_alias alias;      /* flat inputs -> primals, aliasing outputs (alias.c) */
    /* RNG functionalization (rng.c): the philox placeholders after the tangents and backward
     * tokens, and whether the forward returns its updated offset (before the grads). */
    int nrng;
    ag_desc *rng_descs[4];
    bool rng_fw_out;
    /* Tensor subclasses flattened (subclass.c), or NULL; the flat inputs that are parameters
     * and buffers (their inner tensors when flattened). */
    ag__subx_info *subclass;
    int npb_flat;
};

#endif
