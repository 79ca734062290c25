/* ag_compile_joint: a joint graph compiled back into a differentiable callable (the
 * aot_dispatch_autograd back end: partition, compile forward and backward, runtime wrappers).
 *
 * In: an ag_joint. Out: ag_compiled, whose call runs the forward graph on the flat inputs and
 * returns ordinary eager tensors attached to the autograd graph through one custom node; the
 * engine calls that node's backward, which runs the backward graph on the saved tensors and the
 * incoming gradients and hands back one gradient per input that requires grad.
 *
 * The runtime wrappers (spec section 8) are objects listed in wrappers[] below, each in its own
 * file (see compiled_internal.h for how a call runs them): tensor subclasses unwrapped and
 * rewrapped, flat inputs mapped to primals (dedupe, synthetic bases), aliasing outputs
 * regenerated as views, input mutations written back, the generator's state fed and advanced,
 * effect tokens fed and dropped. The core here: outputs that need no grad are left without
 * history; missing output gradients are materialized as zeros; gradients are aligned to inputs
 * by descriptor; inputs saved for backward are checked against their storage version, so an
 * in-place change before backward is an error. */
#include "../graph/graph_internal.h"
#include "compiled_internal.h"
#include "plan_internal.h"

#include <stdio.h>

/* The runtime wrappers, outermost first (see compiled_internal.h). */
static const ag__rt_wrapper *const wrappers[] = {
    &ag__rtw_subclass,  /* outer instances <-> their plain inner tensors */
    &ag__rtw_dedupe,    /* flat inputs -> primals (duplicates dropped, bases merged) */
    &ag__rtw_aliased,   /* outputs aliasing inputs or intermediates, regenerated as views */
    &ag__rtw_mutations, /* input mutations written back */
    &ag__rtw_rng,       /* the generator's state in, its new offset out */
    &ag__rtw_tokens,    /* effect tokens fed and dropped around each graph */
};
#define NWRAPPERS ((int)(sizeof wrappers / sizeof wrappers[0]))

/* n zeroed pointers: the kept array when free, else a new one (NULL: ENOMEM). */
static ag_tensor **ptrs_take(ag__kept_ptrs *k, int64_t n) {
    if (n < 1)
        n = 1;
    if (k->busy)
        return ag__calloc((size_t)n, sizeof(ag_tensor *));
    if (ag__grow((void **)&k->p, &k->cap, n, sizeof *k->p))
        return NULL;
    memset(k->p, 0, sizeof *k->p * (size_t)n);
    k->busy = true;
    return k->p;
}

static void ptrs_give(ag__kept_ptrs *k, ag_tensor **p) {
    if (p && p == k->p)
        k->busy = false;
    else
        ag__free(p);
}

typedef ag__bw_state bw_state;
static void bw_state_destroy(bw_state *s);

static void runnable_clear(ag_runnable *r) {
    if (r->destroy)
        r->destroy(r->self);
    *r = (ag_runnable){0};
}

static void compiled_release(ag_compiled *c) {
    if (!c || --c->refcount > 0)
        return;
    for (int w = 0; w < NWRAPPERS; w++)
        if (wrappers[w]->clear)
            wrappers[w]->clear(c);
    ag__modcall_clear(c);
    runnable_clear(&c->fw_run);
    runnable_clear(&c->bw_run);
    ag_graph_free(c->fw);
    ag_graph_free(c->bw);
    ag__free(c->in_info);
    ag__free(c->out_info);
    ag__free(c->in_meta);
    ag__free(c->tangent_of);
    ag__free(c->saved_primal);
    ag__free(c->grad_out);
    ag__free(c->out_diff);
    ag__free(c->node_of_user);
    ag__free(c->fw_out_meta);
    ag__free(c->grad_slot);
    ag__free(c->mut_primal);
    ag__free(c->node_of_mut);
    for (int i = 0; c->prim_desc && i < c->nprimals; i++)
        ag_desc_release(c->prim_desc[i]);
    for (int i = 0; c->flat_desc && i < c->nflat; i++)
        ag_desc_release(c->flat_desc[i]);
    ag__free(c->prim_desc);
    ag__free(c->flat_desc);
    ag__joint_alias_clear(&c->alias);
    ag__free(c->call_mem.p);
    ag__free(c->bw_mem.p);
    bw_state_destroy(c->spare_bw);
    ag__free(c);
}

void ag_compiled_free(ag_compiled *c) {
    compiled_release(c);
}

const ag_graph *ag_compiled_forward_graph(const ag_compiled *c) {
    return c ? c->fw : NULL;
}
const ag_graph *ag_compiled_backward_graph(const ag_compiled *c) {
    return c ? c->bw : NULL;
}
const ag_partition_stats *ag_compiled_stats(const ag_compiled *c) {
    return c ? &c->stats : NULL;
}
int64_t ag_compiled_peak_bytes(const ag_compiled *c, bool backward) {
    if (!c)
        return 0;
    const ag_runnable *r = backward ? &c->bw_run : &c->fw_run;
    return r->run && r->peak_bytes ? r->peak_bytes(r->self) : -1;
}

static int run_graph(ag_compiled *c, bool backward, ag_tensor *const *in, int nin, ag_tensor **outs,
                     int max_out) {
    const ag_runnable *r = backward ? &c->bw_run : &c->fw_run;
    return r->run(r->self, in, nin, outs, max_out);
}

/* ---- compiling: read the joint's convention, split it, read the halves, compile them ---- */

/* The output descriptor a tangent belongs to: TangentAOTInput(output=X) -> X, and
 * SubclassGetAttrAOTInput(base=T, attr) -> SubclassGetAttrAOTOutput(base=<T's>, attr). NULL
 * (no error set) for any other descriptor; NULL with AG_ENOMEM set when out of memory. */
static ag_desc *output_of_tangent(const ag_desc *d) {
    if (ag_desc_kind_of(d) == AG_DESC_TANGENT)
        return ag_desc_retain(ag_desc_nested(d));
    if (ag_desc_kind_of(d) != AG_DESC_SUBCLASS_GETATTR_INPUT)
        return NULL;
    ag_desc *base = output_of_tangent(ag_desc_nested(d));
    ag_desc *r = base ? ag_desc_subclass_getattr_output(base, ag_desc_attr(d)) : NULL;
    ag_desc_release(base);
    return r;
}

/* The input descriptor an output of kind `wrapper` describes: GradAOTOutput(X) and
 * InputMutationAOTOutput(X) -> X, and SubclassGetAttrAOTOutput(base=B, attr) ->
 * SubclassGetAttrAOTInput(base=<B's>, attr). NULL (no error set) for any other descriptor; NULL
 * with AG_ENOMEM set when out of memory. */
static ag_desc *input_of_output(const ag_desc *d, ag_desc_kind wrapper) {
    if (ag_desc_kind_of(d) == wrapper)
        return ag_desc_retain(ag_desc_nested(d));
    if (ag_desc_kind_of(d) != AG_DESC_SUBCLASS_GETATTR_OUTPUT)
        return NULL;
    ag_desc *base = input_of_output(ag_desc_nested(d), wrapper);
    ag_desc *r = base ? ag_desc_subclass_getattr_input(base, ag_desc_attr(d)) : NULL;
    ag_desc_release(base);
    return r;
}

/* The primal (index among the joint's primals, tokens excluded) that output descriptor d of
 * kind `wrapper` describes; -1 with an error naming it when none. */
static int primal_of(const ag_compiled *c, ag_node *const *prim_ph, const ag_desc *d,
                     ag_desc_kind wrapper, const char *what, int k, int hint) {
    ag_desc *x = input_of_output(d, wrapper);
    int p = -1;
    /* hint: where it usually is (gradients come in primal order), tried first */
    if (x && hint >= 0 && hint < c->nprimals && ag_desc_equal(ag_node_desc(prim_ph[hint]), x))
        p = hint;
    for (int i = 0; x && i < c->nprimals && p < 0; i++)
        p = ag_desc_equal(ag_node_desc(prim_ph[i]), x) ? i : -1;
    ag_desc_release(x);
    if (p < 0 && ag_last_status() != AG_ENOMEM) {
        char r[256] = "None";
        ag_desc_repr(d, r, sizeof r);
        ag__err(AG_EINVAL, "compile: %s %d (%s) is the %s of no primal of the joint", what, k, r,
                wrapper == AG_DESC_GRAD ? "gradient" : "mutation");
    }
    return p;
}

/* The position among outputs [from, to) of out whose descriptor is d, or -1. */
static int find_output(const ag_node *out, int from, int to, const ag_desc *d) {
    for (int k = from; k < to; k++)
        if (ag_desc_equal(ag_node_output_desc(out, k), d))
            return k;
    return -1;
}

/* Each tangent's autograd-node output, by descriptor: the tangent of an input mutation, of a
 * user output that aliases nothing, or of an intermediate base. An output without a tangent
 * carries no gradient. */
static int read_tangents(ag_compiled *c, const ag_graph *g, ag_node *const *ph) {
    ag_node *gout = ag_graph_output_node(g);
    const ag_range *u = &c->jl.sec[AG_SEC_OUT_USER],
                   *ib = &c->jl.sec[AG_SEC_OUT_INTERMEDIATE_BASES];
    const ag_range *mr = &c->jl.sec[AG_SEC_OUT_MUTATIONS];
    for (int t = 0; t < c->ntangents; t++) {
        const ag_node *tp = ph[c->jl.sec[AG_SEC_IN_TANGENTS].start + t];
        ag_desc *od = output_of_tangent(ag_node_desc(tp));
        int k = od ? find_output(gout, mr->start, ib->start + ib->count, od) : -1;
        int node = -1;
        if (k >= mr->start && k < mr->start + mr->count)
            node = c->node_of_mut[k - mr->start];
        else if (k >= u->start && k < u->start + u->count)
            node = c->node_of_user[k - u->start];
        else if (k >= ib->start)
            node = c->nnode - c->ninter + (k - ib->start);
        ag_desc_release(od);
        if (node < 0)
            return ag_last_status() == AG_ENOMEM
                       ? AG_ENOMEM
                       : ag__err(AG_EINVAL,
                                 "compile: tangent %s is the tangent of no "
                                 "differentiable output of the joint",
                                 ag_node_name(tp));
        c->tangent_of[t] = node;
        c->out_diff[node] = true;
    }
    return 0;
}

/* The descriptors that name inputs in messages: each primal's placeholder's, and each flat
 * input's, the joint's record of them (ParamAOTInput(target='w'), PlainAOTInput(idx=0),
 * SubclassGetAttrAOTInput(...) for a part of a tensor subclass instance). */
static int read_input_descs(ag_compiled *c, const ag_joint *j, ag_node *const *prim_ph) {
    c->prim_desc = ag__calloc((size_t)(c->nprimals ? c->nprimals : 1), sizeof *c->prim_desc);
    c->flat_desc = ag__calloc((size_t)(c->nflat ? c->nflat : 1), sizeof *c->flat_desc);
    if (!c->prim_desc || !c->flat_desc)
        return AG_ENOMEM;
    for (int p = 0; p < c->nprimals; p++)
        c->prim_desc[p] = ag_desc_retain(ag_node_desc(prim_ph[p]));
    for (int i = 0; i < c->nflat; i++)
        c->flat_desc[i] = ag_desc_retain(ag_joint_flat_input_desc(j, i));
    return 0;
}

/* The joint's facts the call needs, from its layout and descriptors. */
static int read_joint(ag_compiled *c, const ag_joint *j) {
    const ag_layout *L = ag_joint_layout(j);
    c->jl = *L;
    c->ntok_fw = ag_layout_count(L, AG_SEC_IN_FW_TOKENS);
    c->ntok_bw = ag_layout_count(L, AG_SEC_IN_BW_TOKENS);
    c->nprimals = ag_layout_count(L, AG_SEC_IN_PRIMALS);
    c->ntangents = ag_layout_count(L, AG_SEC_IN_TANGENTS);
    c->nmutated = ag_layout_count(L, AG_SEC_OUT_MUTATIONS);
    c->nuser = ag_layout_count(L, AG_SEC_OUT_USER);
    c->nmetamut = ag_layout_count(L, AG_SEC_OUT_METADATA_MUTATIONS);
    c->ninter = ag_layout_count(L, AG_SEC_OUT_INTERMEDIATE_BASES);
    c->needs_autograd = ag_joint_needs_autograd(j);
    c->nflat = ag_joint_num_flat_inputs(j);
    int np = c->nprimals ? c->nprimals : 1, nu = c->nuser ? c->nuser : 1;
    int nfwo = ag_layout_num_fw_outputs(L) - c->ntok_fw;
    c->in_info = ag__calloc((size_t)np, sizeof *c->in_info);
    c->in_meta = ag__calloc((size_t)np, sizeof *c->in_meta);
    c->out_info = ag__calloc((size_t)nu, sizeof *c->out_info);
    c->out_diff = ag__calloc((size_t)(c->nmutated + nu + c->ninter), sizeof *c->out_diff);
    c->tangent_of = ag__calloc((size_t)(c->ntangents ? c->ntangents : 1), sizeof *c->tangent_of);
    c->grad_out = ag__calloc((size_t)np, sizeof *c->grad_out);
    c->node_of_user = ag__calloc((size_t)nu, sizeof *c->node_of_user);
    c->fw_out_meta = ag__calloc((size_t)(nfwo ? nfwo : 1), sizeof *c->fw_out_meta);
    c->grad_slot = ag__calloc((size_t)np, sizeof *c->grad_slot);
    c->mut_primal = ag__calloc((size_t)(c->nmutated ? c->nmutated : 1), sizeof *c->mut_primal);
    c->node_of_mut = ag__calloc((size_t)(c->nmutated ? c->nmutated : 1), sizeof *c->node_of_mut);
    c->sub = ag__subx_info_retain(ag__joint_subclass_info(j));
    if (!c->in_info || !c->in_meta || !c->out_info || !c->out_diff || !c->tangent_of ||
        !c->grad_out || !c->node_of_user || !c->fw_out_meta || !c->grad_slot || !c->mut_primal ||
        !c->node_of_mut || ag__joint_alias_copy(&c->alias, ag__joint_alias_of(j)))
        return AG_ENOMEM;
    const ag_graph *g = ag_joint_graph(j);
    ag_node **ph;
    if (ag_graph_placeholders(g, &ph) < 0)
        return ag_last_status();
    int p0 = L->sec[AG_SEC_IN_PRIMALS].start;
    for (int i = 0; i < c->nprimals; i++) {
        c->in_info[i] = *ag_joint_input_info(j, p0 + i);
        c->in_meta[i] = *ag_node_val(ph[p0 + i], 0);
    }
    ag_node *gout = ag_graph_output_node(g);
    for (int k = 0; k < nfwo; k++) {
        ag_node *on = ag_node_arg(gout, 0)->u.nodes[c->ntok_fw + k];
        if (on)
            c->fw_out_meta[k] = *ag_node_val(on, 0);
    }
    /* The autograd node's outputs: the new values of input mutations that take a tangent, user
     * outputs that alias nothing (the others are regenerated from their base), then the
     * intermediate bases. */
    const ag_range *mr = &L->sec[AG_SEC_OUT_MUTATIONS], *tr = &L->sec[AG_SEC_IN_TANGENTS];
    for (int k = 0; k < c->nmutated; k++) {
        c->node_of_mut[k] = -1;
        for (int t = 0; t < tr->count && c->node_of_mut[k] < 0; t++) {
            const ag_desc *td = ag_node_desc(ph[tr->start + t]);
            if (ag_desc_kind_of(td) == AG_DESC_TANGENT &&
                ag_desc_equal(ag_desc_nested(td), ag_node_output_desc(gout, mr->start + k)))
                c->node_of_mut[k] = c->nnode++;
        }
    }
    for (int k = 0; k < c->nuser; k++) {
        c->out_info[k] = *ag_joint_output_info(j, k);
        ag_output_alias a = c->out_info[k].alias;
        bool own = a == AG_OUT_NON_ALIAS || a == AG_OUT_UNSAFE_VIEW_ALIAS;
        c->node_of_user[k] = own ? c->nnode++ : -1;
    }
    c->nnode += c->ninter;
    /* Each input mutation's primal, by descriptor (a mutation kept in the graph has none). */
    for (int k = 0; k < c->nmutated; k++) {
        const ag_desc *d = ag_node_output_desc(gout, L->sec[AG_SEC_OUT_MUTATIONS].start + k);
        if ((c->mut_primal[k] = primal_of(c, ph + p0, d, AG_DESC_INPUT_MUTATION, "output",
                                          L->sec[AG_SEC_OUT_MUTATIONS].start + k, -1)) < 0)
            return ag_last_status();
    }
    int rc = read_input_descs(c, j, ph + p0);
    return rc ? rc : read_tangents(c, g, ph);
}

/* The forward and backward graphs: a pair given, the user's partition function, or ours. */
static int split(ag_compiled *c, const ag_joint *j, const ag_compile_opts *o) {
    const ag_graph *g = ag_joint_graph(j);
    int nfw = ag_layout_num_fw_outputs(&c->jl), rc;
    if (!c->needs_autograd)
        return (c->fw = ag_graph_copy(g)) ? 0 : ag_last_status();
    if (o->fw_graph) {
        c->fw = ag_graph_copy(o->fw_graph);
        c->bw = c->fw ? ag_graph_copy(o->bw_graph) : NULL;
        rc = c->bw ? 0 : ag_last_status();
    } else if (o->partition_fn) {
        rc = o->partition_fn(g, nfw, o->partition_user, &c->fw, &c->bw);
        if (rc == 0 && (!c->fw || !c->bw))
            rc = ag__err(AG_EINVAL, "compile: the partition function returned no %s graph",
                         c->fw ? "backward" : "forward");
    } else {
        rc = ag_partition(g, nfw, &o->partition, &c->fw, &c->bw, &c->stats);
    }
    if (rc == 0 && (o->fw_graph || o->partition_fn) &&
        ((rc = ag_graph_verify(c->fw)) || (rc = ag_graph_verify(c->bw))))
        ag__err(rc, "compile: the %s graph given does not verify: %s",
                ag_graph_verify(c->fw) ? "forward" : "backward", ag_last_error());
    return rc;
}

/* The forward: it returns the joint's forward outputs, described as the joint describes them,
 * then the saved values; which of those are primals. */
static int read_forward(ag_compiled *c, const ag_joint *j) {
    const ag_graph *g = ag_joint_graph(j);
    ag_node *jo = ag_graph_output_node(g), *fo = ag_graph_output_node(c->fw);
    int nfw = ag_layout_num_fw_outputs(&c->jl);
    int nfo = fo ? ag_node_arg(fo, 0)->n : -1;
    if (nfo < nfw)
        return ag__err(AG_EINVAL,
                       "compile: the forward graph returns %d outputs; the joint has "
                       "%d forward outputs",
                       nfo, nfw);
    for (int k = 0; k < nfw; k++)
        if (!ag_desc_equal(ag_node_output_desc(fo, k), ag_node_output_desc(jo, k))) {
            char a[256] = "None", b[256] = "None";
            ag_desc_repr(ag_node_output_desc(fo, k), a, sizeof a);
            ag_desc_repr(ag_node_output_desc(jo, k), b, sizeof b);
            return ag__err(AG_EINVAL, "compile: forward output %d is %s; the joint's is %s", k, a,
                           b);
        }
    /* The forward takes the joint's forward inputs and returns, after the forward outputs, only
     * values saved for the backward (their descriptors say so when it has a backward). */
    ag_layout fl;
    int rc = ag_graph_layout(c->fw, 0, &fl);
    if (rc)
        return rc;
    int nback = ag_layout_count(&fl, AG_SEC_IN_TANGENTS) +
                ag_layout_count(&fl, AG_SEC_IN_BW_TOKENS) + ag_layout_count(&fl, AG_SEC_IN_BW_RNG);
    if (nback > 0 || ag_layout_count(&fl, AG_SEC_IN_PRIMALS) != c->nprimals ||
        ag_layout_count(&fl, AG_SEC_IN_FW_TOKENS) != c->ntok_fw)
        return ag__err(AG_EINVAL,
                       "compile: the forward graph takes %d primals, %d forward tokens "
                       "and %d backward inputs; the joint's forward takes %d, %d and 0",
                       ag_layout_count(&fl, AG_SEC_IN_PRIMALS),
                       ag_layout_count(&fl, AG_SEC_IN_FW_TOKENS), nback, c->nprimals, c->ntok_fw);
    if (c->bw && ag_layout_count(&fl, AG_SEC_OUT_SAVED) != nfo - nfw)
        return ag__err(AG_EINVAL,
                       "compile: the forward graph returns %d outputs after the joint's "
                       "%d forward outputs, %d of them described "
                       "SavedForBackwardsAOTOutput",
                       nfo - nfw, nfw, ag_layout_count(&fl, AG_SEC_OUT_SAVED));
    c->nsaved = c->bw ? nfo - nfw : 0;
    c->saved_primal = ag__calloc((size_t)(c->nsaved ? c->nsaved : 1), sizeof *c->saved_primal);
    if (!c->saved_primal)
        return AG_ENOMEM;
    ag_node **fph;
    int nfph = ag_graph_placeholders(c->fw, &fph);
    if (nfph < 0)
        return nfph;
    for (int s = 0; s < c->nsaved; s++) {
        ag_node *v = ag_node_arg(fo, 0)->u.nodes[nfw + s];
        c->saved_primal[s] = -1;
        /* Placeholders come first (verified), so a placeholder's index is its position. */
        int i = v && ag_node_kind_of(v) == AG_NODE_PLACEHOLDER ? ag_node_index(v) : -1;
        if (i >= c->ntok_fw && i < c->ntok_fw + c->nprimals && fph[i] == v)
            c->saved_primal[s] = i - c->ntok_fw;
    }
    c->nfw_in = nfph - c->ntok_fw; /* what run_graph is given: tokens excluded */
    return 0;
}

/* The backward: its layout after the saved values, and each primal's gradient by descriptor. */
static int read_backward(ag_compiled *c, const ag_joint *j) {
    ag_layout bl;
    int rc = ag_graph_layout(c->bw, c->nsaved, &bl);
    if (rc)
        return rc;
    if (ag_layout_count(&bl, AG_SEC_IN_TANGENTS) != c->ntangents)
        return ag__err(AG_EINVAL, "compile: the backward graph takes %d tangents; the joint has %d",
                       ag_layout_count(&bl, AG_SEC_IN_TANGENTS), c->ntangents);
    c->nbw_in = bl.ninputs - c->ntok_bw; /* what run_graph is given: tokens excluded */
    c->nbw_grads = ag_layout_count(&bl, AG_SEC_OUT_GRADS);
    ag_node *bo = ag_graph_output_node(c->bw), **ph;
    if (ag_graph_placeholders(ag_joint_graph(j), &ph) < 0)
        return ag_last_status();
    ph += c->jl.sec[AG_SEC_IN_PRIMALS].start;
    for (int i = 0; i < c->nprimals; i++)
        c->grad_slot[i] = -1;
    for (int b = 0; b < c->nbw_grads; b++) {
        const ag_desc *d = ag_node_output_desc(bo, bl.sec[AG_SEC_OUT_GRADS].start + b);
        int p = d ? primal_of(c, ph, d, AG_DESC_GRAD, "backward output", b, b) : -1;
        if (d && p < 0)
            return ag_last_status();
        if (p >= 0) { /* (grads come first among the outputs run_graph returns) */
            c->grad_slot[p] = bl.sec[AG_SEC_OUT_GRADS].start + b;
            c->grad_out[p] = ag_node_arg(bo, 0)->u.nodes[c->grad_slot[p]] != NULL;
        }
    }
    return 0;
}

/* Each half through its compiler: the user's, or the planned executor (the interpreter). The
 * halves ag_partition built from the exported (verified) joint are not verified again by the
 * executor in Release builds (ag__plan_new_verified); a pair or a partition function given
 * by the user is (split above). */
static int compile_halves(ag_compiled *c, const ag_compile_opts *o) {
    bool ours = c->needs_autograd && !o->fw_graph && !o->partition_fn;
    ag_compiler_fn builtin = o->interpret ? ag_compiler_interpreter
                             : ours       ? ag__compiler_plan_verified
                                          : ag_compiler_plan;
    c->plan_opts = o->plan;
    int rc = o->fw_compiler ? o->fw_compiler(c->fw, o->fw_compiler_user, &c->fw_run)
                            : builtin(c->fw, &c->plan_opts, &c->fw_run);
    if (rc == 0 && c->bw)
        rc = o->bw_compiler ? o->bw_compiler(c->bw, o->bw_compiler_user, &c->bw_run)
                            : builtin(c->bw, &c->plan_opts, &c->bw_run);
    if (rc == 0 && (!c->fw_run.run || (c->bw && !c->bw_run.run)))
        rc = ag__err(AG_EINVAL, "compile: the %s compiler returned no run function",
                     c->fw_run.run ? "backward" : "forward");
    return rc;
}

ag_compiled *ag_compile_joint(const ag_joint *j, const ag_compile_opts *opts) {
    AG__CHECK_NULL_RET("compile_joint", j, NULL);
    /* NULL and a zeroed struct are the same: upstream's defaults (ag_compile_opts). */
    ag_compile_opts o = opts ? *opts : (ag_compile_opts){0};
    if (!o.fw_graph != !o.bw_graph)
        return ag__err(AG_EINVAL, "compile: a pre-partitioned pair needs both the forward and "
                                  "the backward graph"),
               NULL;
    ag_compiled *c = ag__calloc(1, sizeof *c);
    if (!c)
        return NULL;
    c->refcount = 1;
    int rc = read_joint(c, j);
    if (rc == 0)
        rc = ag__modcall_init(c);
    if (rc == 0)
        rc = split(c, j, &o);
    if (rc == 0)
        rc = read_forward(c, j);
    if (rc == 0 && c->bw)
        rc = read_backward(c, j);
    if (rc == 0)
        rc = compile_halves(c, &o);
    for (int w = 0; rc == 0 && w < NWRAPPERS; w++)
        if (wrappers[w]->init)
            rc = wrappers[w]->init(c);
    if (rc) {
        if (!ag_last_status())
            ag__err(rc, "compile: failed");
        compiled_release(c);
        return NULL;
    }
    return c;
}

/* ---- the backward node ---- */

struct ag__bw_state {
    ag_compiled *c;
    ag_tensor **saved; /* nsaved references */
    uint64_t *saved_versions;
    ag_tensor **zeros_like; /* per tangent: an output to shape missing gradients after */
    int *rg_primal;         /* the node's inputs: primal index of each */
    int nrg;
};

static void bw_state_destroy(bw_state *s) {
    if (!s)
        return;
    ag__free(s->saved);
    ag__free(s->saved_versions);
    ag__free(s->zeros_like);
    ag__free(s->rg_primal);
    ag__free(s);
}

/* The node's release: drops the tensors and keeps the arrays as the callable's spare. */
static void bw_state_free(void *ud) {
    bw_state *s = ud;
    if (!s)
        return;
    ag_compiled *c = s->c;
    for (int i = 0; i < c->nsaved; i++)
        ag_tensor_free(s->saved ? s->saved[i] : NULL);
    for (int i = 0; i < c->ntangents; i++)
        ag_tensor_free(s->zeros_like ? s->zeros_like[i] : NULL);
    if (!c->spare_bw && s->saved && s->saved_versions && s->zeros_like && s->rg_primal) {
        c->spare_bw = s;
    } else {
        bw_state_destroy(s);
    }
    compiled_release(c);
}

/* A backward state for the next call: the spare, cleared, or new arrays. */
static bw_state *bw_state_new(ag_compiled *c) {
    bw_state *s = c->spare_bw;
    size_t ns = (size_t)(c->nsaved ? c->nsaved : 1), nt = (size_t)(c->ntangents ? c->ntangents : 1);
    size_t np = (size_t)(c->nprimals ? c->nprimals : 1);
    if (s) {
        c->spare_bw = NULL;
        memset(s->saved, 0, sizeof *s->saved * ns);
        memset(s->zeros_like, 0, sizeof *s->zeros_like * nt);
        s->nrg = 0;
    } else if ((s = ag__calloc(1, sizeof *s))) {
        s->saved = ag__calloc(ns, sizeof *s->saved);
        s->saved_versions = ag__calloc(ns, sizeof(uint64_t));
        s->zeros_like = ag__calloc(nt, sizeof(ag_tensor *));
        s->rg_primal = ag__calloc(np, sizeof(int));
        if (!s->saved || !s->saved_versions || !s->zeros_like || !s->rg_primal) {
            bw_state_destroy(s);
            return NULL;
        }
    }
    if (s) {
        c->refcount++;
        s->c = c;
    }
    return s;
}

static int compiled_backward(void *ud, ag_tensor *const *gout, int nout, ag_tensor **gin, int nin,
                             const bool *needs) {
    bw_state *s = ud;
    ag_compiled *c = s->c;
    (void)nout;
    for (int i = 0; i < c->nsaved; i++)
        if (s->saved[i] && s->saved[i]->storage->version != s->saved_versions[i]) {
            char name[320];
            return ag__err(AG_ESTATE,
                           "compiled backward: an input saved for backward (%s) was modified "
                           "by an inplace operation after the forward",
                           ag__rt_primal_name(c, c->saved_primal[i], name, sizeof name));
        }
    int nbin = c->nbw_in;
    int ngrads = c->nbw_grads + 1; /* the updated philox offset may follow the grads */
    ag_tensor **bin = ptrs_take(&c->bw_mem, (int64_t)nbin + ngrads);
    ag_tensor **grads = bin ? bin + nbin : NULL;
    int rc = bin ? 0 : AG_ENOMEM;
    for (int i = 0; rc == 0 && i < c->nsaved; i++)
        bin[i] = s->saved[i];
    for (int t = 0; rc == 0 && t < c->ntangents; t++) {
        ag_tensor *g = gout[c->tangent_of[t]];
        /* A missing gradient is zero; a non-contiguous one is made contiguous, as the traced
         * tangent was. */
        if (!g)
            g = ag_zeros_like(s->zeros_like[t]);
        else if (!ag_tensor_is_contiguous(g))
            g = ag_contiguous(g);
        if (!g)
            rc = ag_last_status();
        bin[c->nsaved + t] = g;
    }
    for (int w = 0; rc == 0 && w < NWRAPPERS; w++)
        if (wrappers[w]->bw_pre)
            rc = wrappers[w]->bw_pre(c, bin);
    if (rc == 0) {
        bool prev = ag_set_grad_enabled(false);
        int n = run_graph(c, true, bin, nbin, grads, ngrads);
        ag_set_grad_enabled(prev);
        rc = n < 0 ? n : 0;
        for (int w = NWRAPPERS - 1; rc == 0 && w >= 0; w--)
            if (wrappers[w]->bw_post)
                rc = wrappers[w]->bw_post(c, grads, n);
    }
    /* The engine runs this inside a scope, which owns what run_graph returned. */
    for (int j = 0; rc == 0 && j < nin; j++) {
        int p = c->grad_slot[s->rg_primal[j]];
        if (needs[j] && grads[p]) {
            /* A gradient made by the executor for this input alone may become a leaf's .grad
             * uncopied (even as a view of its own buffer, such as t(t(mm))); one whose storage
             * is also another input's gradient's, or one of the backward's own inputs' (a
             * tangent passed straight through), must be copied. */
            bool shared = false;
            for (int q = 0; q < c->nbw_grads && !shared; q++)
                shared = q != p && grads[q] && grads[q]->storage == grads[p]->storage;
            for (int q = 0; q < nbin && !shared; q++)
                shared = bin[q] && bin[q]->storage == grads[p]->storage;
            grads[p]->grad_donated = !shared;
            gin[j] = grads[p];
        }
    }
    ptrs_give(&c->bw_mem, bin);
    return rc;
}

/* ---- calling: the wrappers' pre, the core, their post and commit ---- */

/* The call's pointer arrays, one kept block: prim, owned, node, node_raw, fo, rg. */
static int call_alloc(ag_compiled *c, ag__call *s) {
    int npa = c->nprimals ? c->nprimals : 1, nn1 = c->nnode ? c->nnode : 1;
    s->nfin = c->nfw_in;
    s->nfw = ag_layout_num_fw_outputs(&c->jl) - c->ntok_fw;
    s->nfo = s->nfw + c->nsaved;
    s->prim =
        ptrs_take(&c->call_mem, (int64_t)s->nfin + 1 + 2 * npa + 2 * nn1 + (s->nfo ? s->nfo : 1));
    if (!s->prim)
        return AG_ENOMEM;
    s->owned = s->prim + s->nfin + 1;
    s->node = s->owned + npa;
    s->node_raw = s->node + nn1;
    s->fo = s->node_raw + nn1;
    return 0;
}

/* The forward, with grad mode off. A primal the backward reads (a partition that recomputes
 * from inputs) and that the write-back will change is saved as it was: the backward sees the
 * forward's value, as eager's autograd does. */
static int call_forward(ag_compiled *c, ag__call *s) {
    bool prev = ag_set_grad_enabled(false);
    s->nrun = run_graph(c, false, s->prim, s->nfin, s->fo, s->nfo);
    int rc = s->nrun < 0 ? s->nrun : 0;
    for (int i = 0; rc == 0 && i < c->nsaved; i++) {
        int p = c->saved_primal[i];
        if (p < 0 || p >= c->nprimals || !c->in_info[p].mutates_data)
            continue;
        if (!s->pre && !(s->pre = ag__calloc((size_t)c->nsaved, sizeof *s->pre))) {
            rc = AG_ENOMEM;
            break;
        }
        ag_tensor *x = s->prim[p];
        s->pre[i] = ag__tensor_new(x->dtype, x->ndim, x->sizes, false);
        rc = s->pre[i] ? ag__copy_into(s->pre[i], x) : ag_last_status();
    }
    ag_set_grad_enabled(prev);
    return rc;
}

/* The autograd node's outputs (fresh handles of the user outputs that alias nothing and of the
 * intermediate bases), attached to one node holding the saved values when gradients flow; the
 * user outputs it has are the call's (the aliased ones come from their wrapper). */
static int call_attach(ag_compiled *c, ag__call *s) {
    int rc = 0;
    for (int k = 0; rc == 0 && k < c->nmutated; k++) {
        int ni = c->node_of_mut[k];
        ag_tensor *t = ni >= 0 ? s->fo[ag__fw_at(c, AG_SEC_OUT_MUTATIONS, k)] : NULL;
        if (!t)
            continue;
        s->node_raw[ni] = t;
        s->node[ni] = ag_tensor_keep(ag_detach(t)); /* owned here until the write-back */
        if (!s->node[ni])
            rc = ag_last_status();
    }
    for (int k = 0; rc == 0 && k < c->nuser + c->ninter; k++) {
        int ni = k < c->nuser ? c->node_of_user[k] : c->nnode - c->ninter + (k - c->nuser);
        if (ni < 0)
            continue;
        ag_tensor *t =
            s->fo[k < c->nuser ? ag__fw_at(c, AG_SEC_OUT_USER, k)
                               : ag__fw_at(c, AG_SEC_OUT_INTERMEDIATE_BASES, k - c->nuser)];
        s->node_raw[ni] = t;
        s->node[ni] = t ? ag_detach(t) : NULL;
        if (s->node[ni])
            s->node[ni] = ag_tensor_keep(s->node[ni]); /* owned here until handed out */
        if (t && !s->node[ni])
            rc = ag_last_status();
    }
    if (rc == 0 && c->needs_autograd) {
        bw_state *b = bw_state_new(c);
        ag_tensor **rg = s->fo + (s->nfo ? s->nfo : 1); /* the node's inputs */
        if (!b)
            return AG_ENOMEM;
        for (int i = 0; i < c->nsaved; i++) {
            int p = c->saved_primal[i];
            /* A saved primal is the caller's tensor: remember its version. */
            b->saved[i] = ag_tensor_keep(s->pre && s->pre[i] ? s->pre[i]
                                         : p >= 0            ? s->prim[p]
                                                             : s->fo[s->nfw + i]);
            b->saved_versions[i] = b->saved[i] ? b->saved[i]->storage->version : 0;
        }
        /* The executor's tensors, not the node's outputs (which would hold the node). */
        for (int t = 0; t < c->ntangents; t++)
            b->zeros_like[t] = ag_tensor_keep(s->node_raw[c->tangent_of[t]]);
        for (int i = 0; i < c->nprimals; i++)
            if (c->in_info[i].requires_grad && c->grad_out[i] && s->prim[i]->requires_grad) {
                b->rg_primal[b->nrg] = i;
                rg[b->nrg++] = s->prim[i];
            }
        rc = ag__autograd_custom("CompiledFunction", rg, b->nrg, s->node, c->nnode, c->out_diff,
                                 compiled_backward, b, bw_state_free);
    }
    for (int k = 0; k < c->nuser; k++)
        s->flat_out[k] =
            c->node_of_user[k] >= 0 ? ag_tensor_keep(s->node[c->node_of_user[k]]) : NULL;
    return rc;
}

static void call_release(ag_compiled *c, ag__call *s) {
    for (int i = 0; s->pre && i < c->nsaved; i++)
        ag_tensor_free(s->pre[i]);
    ag__free(s->pre);
    for (int k = 0; s->prim && k < c->nnode; k++)
        ag_tensor_free(s->node[k]);
    for (int k = 0; k < s->nowned; k++)
        ag_tensor_free(s->owned[k]);
    ptrs_give(&c->call_mem, s->prim);
}

int ag_compiled_call(ag_compiled *c, ag_tensor *const *inputs, int ninputs, ag_tensor **outs,
                     int max_out) {
    AG__CHECK_NULL("compiled_call", c);
    if (ninputs > 0)
        AG__CHECK_NULL("compiled_call", inputs);
    if (max_out > 0)
        AG__CHECK_NULL("compiled_call", outs);
    int nout = c->sub ? c->sub->nout : c->nuser;
    if (max_out < nout)
        return ag__err(AG_EINVAL, "compiled: room for %d outputs, %d needed", max_out, nout);
    for (int k = 0; k < nout; k++)
        outs[k] = NULL;
    ag__call s = {.inputs = inputs,
                  .outs = outs,
                  .ninputs = ninputs,
                  .max_out = max_out,
                  .flat = inputs,
                  .flat_out = outs,
                  .nflat = ninputs};
    int rc = call_alloc(c, &s);
    /* Everything made here lives in this scope; what must outlive the call is kept. */
    bool scoped = ag__in_scope();
    ag_scope_begin();
    int w = 0;
    for (; rc == 0 && w < NWRAPPERS; w++)
        if (wrappers[w]->pre)
            rc = wrappers[w]->pre(c, &s);
    if (rc == 0)
        rc = call_forward(c, &s);
    if (rc == 0)
        rc = call_attach(c, &s);
    for (int k = w - 1; rc == 0 && k >= 0; k--)
        if (wrappers[k]->post)
            rc = wrappers[k]->post(c, &s);
    for (int k = w - 1; rc == 0 && k >= 0; k--)
        if (wrappers[k]->commit)
            rc = wrappers[k]->commit(c, &s);
    ag_scope_end();
    if (s.flat_out != outs) /* the flat outputs the subclass wrapper rebuilt outs from */
        for (int k = 0; k < c->nuser; k++)
            ag_tensor_free(s.flat_out[k]);
    for (int k = 0; k < NWRAPPERS; k++)
        if (wrappers[k]->end)
            wrappers[k]->end(c, &s);
    call_release(c, &s);
    for (int k = 0; k < nout; k++) {
        if (rc) {
            ag_tensor_free(outs[k]);
            outs[k] = NULL;
        } else if (scoped) {
            outs[k] = ag__give(outs[k]);
        }
    }
    return rc ? rc : nout;
}
