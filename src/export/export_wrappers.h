/* The export's wrappers: upstream's CompilerWrapper stages on the export side (spec sections
 * 6.2-6.3), internal to the library.
 *
 * ag_export_joint (export.c) is a core -- bind the flat inputs to primal placeholders, trace the
 * forward, add tangents for the outputs that get one, trace the backward with ag_grad, make the
 * output node -- and an ordered list of wrappers around it, each one object of hooks in its
 * feature's file, listed in export.c in upstream's order (outermost first):
 *
 *   ag__dedupe_synthetic_base_wrapper  alias.c             which flat inputs become which
 *                                                          primals (duplicates, bases)
 *   ag__effect_tokens_wrapper          token_chain.c       forward and backward token chains
 *   ag__subclass_wrapper               subclass_flatten.c  tensor subclasses flattened
 *   ag__rng_wrapper                    rng_functionalize.c philox seeds and offsets
 *   ag__input_mutations_wrapper        input_mutations.c   mutated inputs returned
 *   ag__aliasing_outputs_wrapper       alias.c             metadata mutations, intermediate bases
 *
 * Every hook may be NULL. Hooks returning int return 0 or a negative status (the error set
 * with ag__err, naming the op and the values); a failure ends the pass, and the pass's `end`
 * hooks and the export's `release` hooks still run. `self` is the wrapper's own slot in the
 * state (NULL at first, kept across the export's passes): what the wrapper keeps there is its
 * own to free. */
#ifndef AG_EXPORT_WRAPPERS_H
#define AG_EXPORT_WRAPPERS_H

#include "../graph/graph_internal.h"
#include "joint_facts.h"
#include "aotgrad/export.h"

#define AG__EXPORT_MAX_WRAPPERS 16
#define AG__EXPORT_MAX_OUTS 64 /* user outputs (flattened), and extra forward outputs */

/* One output of the joint being built. */
typedef struct ag__export_output {
    ag_section sec;
    ag_node *node;      /* NULL: None (an input without a gradient) */
    ag_desc *desc;      /* owned by the pass; a wrapper may replace it (releasing the old one) */
    ag_tensor *tangent; /* the forward value the core gives a tangent for, or NULL (borrowed) */
    int primal;         /* an input mutation's primal, else -1 */
} ag__export_output;

/* What the core and the wrappers share. The first part holds for the whole export; every field
 * from `g` on is one pass's and is zeroed between passes. Arrays marked "owned" belong to the
 * pass until the joint takes them when the pass succeeds. */
typedef struct ag__export_pass {
    /* ---- the export ---- */
    ag_module *m;
    const ag_export_opts *o;
    const ag_named_tensors *ps, *bs; /* the module's parameters and buffers */
    ag_tensor *const *args, *const *kwargs;
    const char *const *kwarg_names;
    int nargs, nkwargs;
    /* The flat inputs (params, buffers, args, kwargs; borrowed tensors, an owned array) and
     * their descriptors (owned references), which say what each is (ParamAOTInput(target=fqn)
     * is the module's own parameter) and which the joint keeps; a `prepare` hook may replace
     * them (the subclass wrapper: by their inner tensors, SubclassGetAttrAOTInput(...)). */
    ag_tensor **flat;
    ag_desc **flat_descs;
    int nflat;
    bool flat_module_tensors; /* the flat params and buffers are the module's own tensors */
    ag__alias_plan *plan; /* the dedupe/synthetic-base wrapper's; the aliasing outputs read it */
    void *self[AG__EXPORT_MAX_WRAPPERS];

    /* ---- one pass ---- */
    ag_graph *g; /* the joint's graph */
    ag__tracer *T;
    int np;               /* primals (after `finish`: the forward tokens included) */
    ag_node **prim;       /* owned: their placeholders (without the tokens) */
    ag_tensor **primal_t; /* owned array: the tensor each primal is in this pass */
    /* Per primal or NULL (borrowed, the input mutations wrapper's): the leaf the primal's
     * gradient is taken for when the forward mutated primal_t in place (primal_t then holds
     * the new value, its history going back to that leaf through a clone). */
    ag_tensor *const *grad_leaf;
    ag_desc **primal_descs;               /* owned: np references */
    ag_input_info *in_info;               /* owned: np */
    ag_tensor **user;                     /* the forward's inputs (borrowed) */
    ag_tensor *outs[AG__EXPORT_MAX_OUTS]; /* the user outputs (borrowed) */
    int nouts, nspec;                     /* flattened user outputs; outer ones (the out_spec's) */
    ag_output_info *out_info;             /* owned: nouts */
    ag__joint_alias alias;                /* owned: the aliasing facts */
    bool any_rg_in, needs_autograd;
    ag__export_output *out; /* owned: the outputs so far, in section order */
    int nout, cap_out;
    ag_desc **tangent_descs; /* owned: the tangent placeholders' descriptors, then bw tokens' */
    int ntangent_descs, cap_tangent_descs;
    /* facts the wrappers leave for the joint */
    int nfw_tokens, nbw_tokens, nmutated, nrng;
    ag_desc *rng_descs[4]; /* owned */
    bool rng_fw_out;
    ag__subx_info *subclass; /* owned */
} ag__export_pass;

typedef int (*ag__export_hook)(ag__export_pass *st, void **self);

/* What a `settle` hook sees of the joint a pass made. */
typedef struct ag__export_settled {
    const ag_input_info *in_info; /* per primal, forward tokens excluded */
    bool needs_autograd;
    const ag__joint_alias *alias; /* flat inputs -> primals */
} ag__export_settled;

typedef struct ag__export_wrapper {
    const char *name;
    /* Once, before the first pass, innermost wrapper first (the user's inputs meet the
     * innermost one first): may replace st->flat / flat_descs, may set st->plan. */
    ag__export_hook prepare;
    /* Each pass, outermost first, before the forward is traced (the tracer is on st->g): may
     * make the primals' placeholders (st->prim, primal_descs via ag__export_primals) and bind
     * them, regenerate inputs, install tracer state (token chains, random hooks), set
     * st->user, the forward's inputs. */
    ag__export_hook begin;
    /* After the forward, outermost first: may replace the user outputs st->outs / nouts
     * (flattening) and st->any_rg_in (set by the core from st->primal_t). */
    ag__export_hook forward_done;
    /* Then, outermost first: reads what the forward did into st->in_info, out_info, alias,
     * may override requires_grad there, may refuse with upstream's message; the core then
     * decides st->needs_autograd. */
    ag__export_hook facts;
    /* For each output section in the layout's order (the forward's sections after `facts`,
     * the backward's after the backward), after the core's own outputs of it and innermost
     * wrapper first: appends this wrapper's outputs of section sec with ag__export_out, and
     * may rewrite the descriptors inner wrappers gave that section. */
    int (*outputs)(ag__export_pass *st, void **self, ag_section sec);
    /* With a backward, outermost first, once the forward's nodes are tagged and the tracer
     * records the backward: switches this wrapper's state to the backward. */
    ag__export_hook backward;
    /* Then, outermost first: a wrapper may trace the tangents, the backward and the gradients
     * itself (the subclass wrapper, at the outer level) and return 1; 0 leaves them to the
     * core, which gives a tangent to every output that has ag__export_out's `tangent`. */
    ag__export_hook trace_backward;
    /* After the output node is made (the tracer still on), outermost first: placeholders moved
     * or prepended (st->np, primal_descs, in_info), facts recorded for the joint, last
     * rewrites of the graph. */
    ag__export_hook finish;
    /* Each pass, whatever happened (also when `begin` failed or never ran), innermost first,
     * before the tracer ends: undoes `begin` (module tensors) and frees the pass's state. */
    void (*end)(ag__export_pass *st, void **self);
    /* After a pass made joint j, outermost first, until one returns non-zero: 1 asks for
     * another pass (the layout changed), a negative status refuses the layout. */
    int (*settle)(ag__export_pass *st, void **self, const ag__export_settled *f);
    /* Once, after the last pass, innermost first: frees what `prepare` made. */
    void (*release)(ag__export_pass *st, void **self);
} ag__export_wrapper;

/* ---- for the hooks (export_wrappers.c) ---- */

/* Makes room for n primals: st->prim, primal_t, primal_descs, in_info (zeroed); st->np = n. */
int ag__export_primals(ag__export_pass *st, int n);
/* Appends an output of section sec, taking desc (released on failure too). Sections come in
 * the layout's order: an output of a section before the last one's is refused (AG_ESTATE). */
int ag__export_out(ag__export_pass *st, ag_section sec, ag_node *node, ag_desc *desc,
                   ag_tensor *tangent);
/* Appends a tangent placeholder's descriptor (the tangents', then the backward tokens'),
 * taking desc (released on failure too). */
int ag__export_tangent(ag__export_pass *st, ag_desc *desc);

#endif
