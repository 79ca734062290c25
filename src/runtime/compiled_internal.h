/* The compiled callable's insides, shared by src/runtime/compiled.c (compiling a joint, the
 * autograd node, the call) and the runtime wrappers (one file each), which see a call through
 * ag__call and keep their state in ag_compiled.
 *
 * The runtime wrappers (upstream's post_compile stages and RuntimeWrapper epilogue) are one
 * ordered list, ag__rt_wrappers[], outermost first. A call runs every wrapper's `pre` in order
 * (the caller's inputs become the forward graph's), the core (the forward, the autograd node),
 * every `post` in reverse order (the forward's outputs become the caller's; may fail, must have
 * no effect on the caller's tensors or the generator) and, once all succeeded, every `commit` in
 * reverse order (the call's effects: the generator advanced, mutations written back); `end`
 * runs last whatever happened. The backward runs `bw_pre` and `bw_post` around the backward
 * graph. Adding a wrapper: a file with one `const ag__rt_wrapper`, a line in
 * ag__rt_wrappers[] (compiled.c), its state in ag_compiled. */
#ifndef AG_RUNTIME_COMPILED_INTERNAL_H
#define AG_RUNTIME_COMPILED_INTERNAL_H

#include "../export/alias.h"
#include "../export/subclass_flatten.h"
#include "aotgrad/compile.h"

#include <stdio.h>

/* Pointer arrays a call (or a backward) needs, kept in the callable between uses; a use that
 * finds them taken (a reentrant one) allocates its own. */
typedef struct ag__kept_ptrs {
    ag_tensor **p;
    int64_t cap;
    bool busy;
} ag__kept_ptrs;

typedef struct ag__bw_state ag__bw_state;
typedef struct ag__modcall ag__modcall;

struct ag_compiled {
    int64_t refcount; /* the callable and every pending backward node hold one */
    ag_graph *fw, *bw;
    ag_runnable fw_run, bw_run; /* what the compilers made of them, wrapped (tokens) */
    ag_plan_opts plan_opts;     /* the built-in planned executor's options */
    ag_partition_stats stats;
    /* The joint's calling convention (its layout) and the counts the call uses most. */
    ag_layout jl;
    int nprimals, nmutated, nuser, nsaved, ntangents;
    bool needs_autograd;
    ag_input_info *in_info; /* per primal */
    ag_output_info *out_info;
    ag_tmeta *in_meta;    /* expected dtype and shape per primal */
    int *tangent_of;      /* the autograd-node output each tangent belongs to */
    int *saved_primal;    /* for each saved value: the primal it is, or -1 */
    bool *grad_out;       /* primal i has a gradient among the backward's outputs */
    bool *out_diff;       /* per autograd-node output: carries a gradient (has a tangent) */
    int ntok_fw, ntok_bw; /* effect tokens (the token wrapper feeds and drops them) */
    void *rng;            /* the RNG wrapper's state (rng_wrap.c), or NULL */
    /* Aliasing (alias.c, alias_rt.c): the autograd node's outputs are the new values of the
     * input mutations that take a tangent, the user outputs that alias nothing, then the
     * intermediate bases; the other user outputs are regenerated. */
    ag__joint_alias alias;
    int nflat, nmetamut, ninter, nnode;
    int nfw_in, nbw_in;    /* inputs run_graph gives each graph (tokens excluded) */
    int *node_of_user;     /* per user output: its autograd-node output, or -1 */
    ag_tmeta *fw_out_meta; /* per forward output (tokens excluded): its geometry */
    /* The backward graph's output that is each primal's gradient, or -1 (by descriptor). */
    int *grad_slot;
    int nbw_grads;
    int *mut_primal; /* per input mutation output: the primal written back */
    /* per input mutation output: its autograd-node output when it takes a tangent (a data
     * mutation of a primal that requires grad: written back as an autograd-visible copy_), or
     * -1 (written back hidden from autograd) */
    int *node_of_mut;
    ag__subx_info *sub; /* the subclass wrapper's structures, or NULL */
    /* Descriptors for messages (references, NULL where unknown): each primal's placeholder's,
     * each flat input's (the joint's record, ag_joint_flat_input_desc; ag__rt_input_name). */
    ag_desc **prim_desc, **flat_desc;
    /* Kept between calls so a training step allocates no bookkeeping once warm. */
    ag__kept_ptrs call_mem, bw_mem; /* a call's and a backward's pointer arrays */
    ag__bw_state *spare_bw;         /* a released backward node's state, for the next call */
    /* ag_compiled_call_module's record of the parameter and buffer inputs by name, and the
     * module tensors it last found for them (call_module.c). */
    ag__modcall *modcall;
};

/* One call as the wrappers see it. Each level's arrays are set by the wrapper outside it: the
 * caller's inputs and outputs; the flat (plain) ones (the subclass wrapper's, else the caller's);
 * the forward graph's inputs (the primals, then the generator's state) and outputs. */
typedef struct ag__call {
    ag_tensor *const *inputs; /* the caller's, ninputs */
    ag_tensor **outs;         /* the caller's room, max_out */
    int ninputs, max_out;
    ag_tensor *const *flat; /* flat inputs, nflat (= inputs without subclasses) */
    ag_tensor **flat_out;   /* flat user outputs, c->nuser (= outs without subclasses) */
    int nflat;
    ag_tensor **prim;     /* the forward's inputs: primals, then the generator's state */
    ag_tensor **owned;    /* primals made for this call (merged bases), nowned of them */
    ag_tensor **node;     /* the autograd node's outputs (references owned by the call) */
    ag_tensor **node_raw; /* ... the executor's tensors they were detached from */
    ag_tensor **fo;       /* the forward's outputs (tokens dropped), nfo of them */
    ag_tensor **pre;      /* saved primals copied before the write-back changes them, or NULL */
    int nowned, nfin, nfw, nfo, nrun;
    void *sub; /* the subclass wrapper's per-call arrays */
} ag__call;

typedef struct ag__rt_wrapper {
    const char *name;
    /* At compile time, after the halves are compiled: read what it needs (by descriptor) into
     * c. NULL: nothing. */
    int (*init)(ag_compiled *c);
    int (*pre)(ag_compiled *c, ag__call *s);
    int (*post)(ag_compiled *c, ag__call *s);
    int (*commit)(ag_compiled *c, ag__call *s);
    void (*end)(ag_compiled *c, ag__call *s);
    /* The backward: bin holds the backward graph's inputs (saved values, tangents, then room for
     * what the wrapper feeds); grads its n outputs. */
    int (*bw_pre)(ag_compiled *c, ag_tensor **bin);
    int (*bw_post)(ag_compiled *c, ag_tensor *const *grads, int n);
    /* Frees its state in c. */
    void (*clear)(ag_compiled *c);
} ag__rt_wrapper;

/* The wrappers, each in its own file. */
extern const ag__rt_wrapper ag__rtw_subclass;  /* subclass_wrap.c: AOTDispatchSubclassWrapper */
extern const ag__rt_wrapper ag__rtw_dedupe;    /* alias_rt.c: dedupe + synthetic bases */
extern const ag__rt_wrapper ag__rtw_aliased;   /* alias_rt.c: outputs aliasing inputs/bases */
extern const ag__rt_wrapper ag__rtw_mutations; /* mutation_writeback.c: input mutations */
extern const ag__rt_wrapper ag__rtw_rng;       /* rng_wrap.c: functionalized RNG */
extern const ag__rt_wrapper ag__rtw_tokens;    /* effect_tokens.c: effect tokens */

/* call_module.c: reads the joint's parameter and buffer inputs (their FQNs, kinds, dtypes and
 * shapes) once the joint's facts are read (read_joint); frees that record. */
int ag__modcall_init(ag_compiled *c);
void ag__modcall_clear(ag_compiled *c);

/* A message's name for flat input i: "ParamAOTInput(target='fc.weight') (input 4)", or
 * "input 4" when its descriptor is unknown ("flat input" with tensor subclasses, whose flat
 * inputs are the instances' parts: "SubclassGetAttrAOTInput(...) (flat input 1)"). Returns buf. */
static inline const char *ag__rt_input_name(const ag_compiled *c, int i, char *buf, size_t n) {
    const ag_desc *d = c->flat_desc && i >= 0 && i < c->nflat ? c->flat_desc[i] : NULL;
    return ag__flat_input_name(d, c->sub ? "flat input" : "input", i, buf, n);
}

/* ... and primal p's: its flat input's name when it is one, else its placeholder's descriptor
 * (a view or synthetic base) and its graph input. */
static inline const char *ag__rt_primal_name(const ag_compiled *c, int p, char *buf, size_t n) {
    if (p < 0 || p >= c->nprimals || !c->prim_desc) {
        snprintf(buf, n, p < 0 ? "a value the forward computed" : "graph input %d", p);
        return buf;
    }
    const ag__primal_info *pi = &c->alias.prim[p];
    if (pi->base == AG__BASE_NONE && c->flat_desc && c->flat_desc[pi->flat])
        return ag__rt_input_name(c, pi->flat, buf, n);
    char r[200] = "?";
    if (c->prim_desc[p])
        ag_desc_repr(c->prim_desc[p], r, sizeof r);
    snprintf(buf, n, "%s (graph input %d, from input %d)", r, p, pi->flat);
    return buf;
}

/* Where output i of section s of the joint is among the forward's outputs as the callable gets
 * them (effect tokens, the first section, dropped by the token wrapper). */
static inline int ag__fw_at(const ag_compiled *c, ag_section s, int i) {
    return c->jl.sec[s].start - c->ntok_fw + i;
}

#endif
