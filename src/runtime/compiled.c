/* ag_compile_joint: a joint graph compiled back into a differentiable callable (the
 * aot_dispatch_autograd back end: partition, compile forward and backward, runtime wrappers).
 *
 * In: an ag_joint. Out: ag_compiled, whose call runs the forward graph on the flat inputs and
 * returns ordinary eager tensors attached to the autograd graph through one custom node; the
 * engine calls that node's backward, which runs the backward graph on the saved tensors and the
 * incoming gradients and hands back one gradient per input that requires grad.
 *
 * Runtime wrappers that apply here (spec section 8): input mutations are written back into the
 * caller's tensors after the forward (BatchNorm running stats change exactly as in eager);
 * outputs that need no grad are left without history; missing output gradients are
 * materialized as zeros; gradients are aligned to inputs; inputs saved for backward are checked
 * against their storage version, so an in-place change before backward is an error; effect
 * tokens are fed as empty tensors and their outputs dropped (effects.c). The
 * aliasing wrappers (alias_rt.c) map the caller's flat inputs to the graph's primals (removed
 * duplicates, view and synthetic bases) and regenerate outputs that alias inputs or
 * intermediates as views of their base; metadata mutations are applied to the caller's
 * tensors. A joint with functionalized random ops gets the generator's state as its philox
 * inputs and advances the generator by what it drew (rng_wrap.c), in the forward and in the
 * backward. Tensor subclass inputs and outputs are unwrapped and rewrapped around this
 * callable (subclass.c): the flat inputs are then the instances' inner tensors. */
#include "../graph/graph_internal.h"
#include "../export/alias.h"
#include "../nn/nn_internal.h"
#include "aotgrad/compile.h"
#include "effect_tokens.h"
#include "rng_wrap.h"
#include "subclass_wrap.h"

#include <stdio.h>

/* Pointer arrays a call (or a backward) needs, kept in the callable between uses; a use that
 * finds them taken (a reentrant one) allocates its own. */
typedef struct kept_ptrs {
    ag_tensor **p;
    int64_t cap;
    bool busy;
} kept_ptrs;

/* n zeroed pointers: the kept array when free, else a new one (NULL: ENOMEM). */
static ag_tensor **ptrs_take(kept_ptrs *k, int64_t n) {
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

static void ptrs_give(kept_ptrs *k, ag_tensor **p) {
    if (p && p == k->p)
        k->busy = false;
    else
        ag__free(p);
}

typedef struct bw_state bw_state;
static void bw_state_destroy(bw_state *s);

struct ag_compiled {
    int64_t refcount; /* the callable and every pending backward node hold one */
    ag_graph *fw, *bw;
    ag_plan *fw_plan, *bw_plan;
    bool interpret;
    ag_partition_stats stats;
    int nprimals, nmutated, nuser, nsaved, ntangents;
    bool needs_autograd;
    ag_input_info *in_info; /* per primal */
    ag_output_info *out_info;
    ag_tmeta *in_meta;      /* expected dtype and shape per primal */
    int *tangent_of;        /* the autograd-node output each tangent belongs to */
    int *saved_primal;      /* for each saved value: the primal it is, or -1 */
    bool *grad_out;         /* the backward graph's output i is a gradient (of primal i) */
    bool *out_diff;         /* per autograd-node output: carries a gradient */
    int ntok_fw, ntok_bw;   /* effect tokens, fed and dropped by run_graph (effects.c) */
    /* Philox inputs and output of each graph (rng_wrap.c), as positions in the arrays the
     * callable passes to run_graph (effect tokens excluded). */
    ag__rng_wrap rng_fw, rng_bw;
    ag__effect_cache eff_fw, eff_bw; /* the token wrapper's state between runs */
    /* Aliasing (alias_rt.c): the autograd node's outputs are the user outputs that alias
     * nothing, then the intermediate bases; the other user outputs are regenerated. */
    ag__joint_alias alias;
    int nflat, nmetamut, ninter, nnode;
    int *node_of_user;      /* per user output: its autograd-node output, or -1 */
    ag_tmeta *fw_out_meta;  /* per forward output (before saved values): its geometry */
    /* Tensor subclasses (subclass.c): the backward graph's output that is each primal's
     * gradient, or -1 (found by descriptor: an input without a gradient has one None however
     * many primals it flattened into), and the structures to unwrap and rewrap, or NULL. */
    int *grad_slot;
    int nbw_grads;
    ag__subx_info *sub;
    /* Kept between calls so a training step allocates no bookkeeping once warm. */
    kept_ptrs call_mem, bw_mem; /* a call's and a backward's pointer arrays */
    bw_state *spare_bw;         /* a released backward node's state, for the next call */
};

static void compiled_release(ag_compiled *c) {
    if (!c || --c->refcount > 0)
        return;
    ag_plan_free(c->fw_plan);
    ag_plan_free(c->bw_plan);
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
    ag__subx_info_release(c->sub);
    ag__rng_wrap_clear(&c->rng_fw);
    ag__rng_wrap_clear(&c->rng_bw);
    ag__effect_cache_clear(&c->eff_fw);
    ag__effect_cache_clear(&c->eff_bw);
    ag__joint_alias_clear(&c->alias);
    ag__free(c->call_mem.p);
    ag__free(c->bw_mem.p);
    bw_state_destroy(c->spare_bw);
    ag__free(c);
}

void ag_compiled_free(ag_compiled *c) { compiled_release(c); }

const ag_graph *ag_compiled_forward_graph(const ag_compiled *c) { return c ? c->fw : NULL; }
const ag_graph *ag_compiled_backward_graph(const ag_compiled *c) { return c ? c->bw : NULL; }
const ag_partition_stats *ag_compiled_stats(const ag_compiled *c) {
    return c ? &c->stats : NULL;
}
int64_t ag_compiled_peak_bytes(const ag_compiled *c, bool backward) {
    if (!c)
        return 0;
    const ag_plan *p = backward ? c->bw_plan : c->fw_plan;
    return p ? ag_plan_peak_bytes(p) : -1;
}

static int run_graph(ag_compiled *c, bool backward, ag_tensor *const *in, int nin,
                     ag_tensor **outs, int max_out) {
    int ntok = backward ? c->ntok_bw : c->ntok_fw;
    if (ntok)
        return ag__effect_tokens_run(backward ? &c->eff_bw : &c->eff_fw,
                                     backward ? c->bw : c->fw,
                                     c->interpret ? NULL : backward ? c->bw_plan : c->fw_plan, ntok,
                                     backward, in, nin, outs, max_out);
    if (c->interpret)
        return ag_graph_run(backward ? c->bw : c->fw, in, nin, outs, max_out);
    return ag_plan_run(backward ? c->bw_plan : c->fw_plan, in, nin, outs, max_out);
}

ag_compiled *ag_compile_joint(const ag_joint *j, const ag_compile_opts *opts) {
    AG__CHECK_NULL_RET("compile_joint", j, NULL);
    ag_compile_opts o = {0};
    o.partition.memory_budget = 1.0;
    if (opts)
        o = *opts;
    ag_compiled *c = ag__calloc(1, sizeof *c);
    if (!c)
        return NULL;
    c->refcount = 1;
    c->interpret = o.interpret;
    /* The graph's primals after the forward effect tokens (which run_graph feeds). */
    c->ntok_fw = ag_joint_num_forward_tokens(j);
    c->ntok_bw = ag_joint_num_backward_tokens(j);
    c->nprimals = ag_joint_num_primals(j) - c->ntok_fw;
    c->nmutated = ag_joint_num_mutated_inputs(j);
    c->nuser = ag_joint_num_user_outputs(j);
    c->ntangents = ag_joint_num_tangents(j);
    c->needs_autograd = ag_joint_needs_autograd(j);
    c->nflat = ag_joint_num_flat_inputs(j);
    c->nmetamut = ag_joint_num_metadata_mutations(j);
    c->ninter = ag_joint_num_intermediate_bases(j);
    int np = c->nprimals ? c->nprimals : 1, nu = c->nuser ? c->nuser : 1;
    int nfwo = ag_joint_num_fw_outputs(j) - c->ntok_fw; /* forward outputs after the tokens */
    c->in_info = ag__calloc((size_t)np, sizeof *c->in_info);
    c->in_meta = ag__calloc((size_t)np, sizeof *c->in_meta);
    c->out_info = ag__calloc((size_t)nu, sizeof *c->out_info);
    c->out_diff = ag__calloc((size_t)(nu + c->ninter), sizeof *c->out_diff);
    c->tangent_of = ag__calloc((size_t)(c->ntangents ? c->ntangents : 1), sizeof *c->tangent_of);
    c->grad_out = ag__calloc((size_t)np, sizeof *c->grad_out);
    c->node_of_user = ag__calloc((size_t)nu, sizeof *c->node_of_user);
    c->fw_out_meta = ag__calloc((size_t)(nfwo ? nfwo : 1), sizeof *c->fw_out_meta);
    c->grad_slot = ag__calloc((size_t)np, sizeof *c->grad_slot);
    c->sub = ag__subx_info_retain(ag__joint_subclass_info(j));
    if (!c->in_info || !c->in_meta || !c->out_info || !c->out_diff || !c->tangent_of ||
        !c->grad_out || !c->node_of_user || !c->fw_out_meta || !c->grad_slot ||
        ag__joint_alias_copy(&c->alias, ag__joint_alias_of(j)))
        goto fail;
    const ag_graph *g = ag_joint_graph(j);
    ag_node **ph;
    int nph = ag_graph_placeholders(g, &ph);
    if (nph < 0)
        goto fail;
    for (int i = 0; i < c->nprimals; i++) {
        c->in_info[i] = *ag_joint_input_info(j, c->ntok_fw + i);
        c->in_meta[i] = *ag_node_val(ph[c->ntok_fw + i], 0);
    }
    int nt = 0;
    ag_node *gout = ag_graph_output_node(g);
    for (int k = 0; k < nfwo; k++) {
        ag_node *on = ag_node_arg(gout, 0)->u.nodes[c->ntok_fw + k];
        if (on)
            c->fw_out_meta[k] = *ag_node_val(on, 0);
    }
    for (int k = 0; k < c->nuser; k++) {
        c->out_info[k] = *ag_joint_output_info(j, k);
        /* An output gets a tangent (and so carries a gradient) exactly as the export decided;
         * outputs aliasing an input or an intermediate are regenerated instead. */
        const ag_output_info *oi = &c->out_info[k];
        c->node_of_user[k] = -1;
        if (oi->alias != AG_OUT_NON_ALIAS && oi->alias != AG_OUT_UNSAFE_VIEW_ALIAS)
            continue;
        ag_node *on = ag_node_arg(gout, 0)->u.nodes[c->ntok_fw + c->nmutated + k];
        bool diff = c->needs_autograd && oi->requires_grad && on &&
                    ag_dtype_is_float(ag_node_val(on, 0)->dtype);
        c->node_of_user[k] = c->nnode;
        c->out_diff[c->nnode++] = diff;
        if (diff && nt < c->ntangents)
            c->tangent_of[nt++] = c->nnode - 1;
    }
    for (int b = 0; b < c->ninter; b++) { /* intermediate bases always have a tangent */
        c->out_diff[c->nnode++] = c->needs_autograd;
        if (c->needs_autograd && nt < c->ntangents)
            c->tangent_of[nt++] = c->nnode - 1;
    }
    if (nt != c->ntangents) {
        ag__err(AG_EINVAL, "compile: %d tangents in the joint but %d differentiable outputs",
                c->ntangents, nt);
        goto fail;
    }
    int nfw = ag_joint_num_fw_outputs(j); /* forward effect tokens included */
    if (c->needs_autograd) {
        if (ag_partition(g, nfw, &o.partition, &c->fw, &c->bw, &c->stats))
            goto fail;
        ag_node *fo = ag_graph_output_node(c->fw);
        int nfo = ag_node_arg(fo, 0)->n;
        c->nsaved = nfo - nfw;
        c->saved_primal = ag__calloc((size_t)(c->nsaved ? c->nsaved : 1), sizeof *c->saved_primal);
        if (!c->saved_primal)
            goto fail;
        ag_node **fph;
        int nfph = ag_graph_placeholders(c->fw, &fph);
        if (nfph < 0)
            goto fail;
        for (int s = 0; s < c->nsaved; s++) {
            ag_node *v = ag_node_arg(fo, 0)->u.nodes[nfw + s];
            c->saved_primal[s] = -1;
            /* Placeholders come first (verified), so a placeholder's index is its position. */
            int i = v && ag_node_kind_of(v) == AG_NODE_PLACEHOLDER ? ag_node_index(v) : -1;
            if (i >= c->ntok_fw && i < nfph && fph[i] == v)
                c->saved_primal[s] = i - c->ntok_fw;
        }
        ag_node *bo = ag_graph_output_node(c->bw);
        int nbo = ag_node_arg(bo, 0)->n;
        if (ag__rng_wrap_init(&c->rng_bw, c->bw, true))
            goto fail;
        /* Backward tokens come before the philox placeholders and after its offset output. */
        if (c->rng_bw.seed_in >= 0) {
            c->rng_bw.seed_in -= c->ntok_bw;
            c->rng_bw.offset_in -= c->ntok_bw;
        }
        c->nbw_grads = nbo - c->ntok_bw - (c->rng_bw.offset_out >= 0);
        if (c->sub) {
            if (ag__subx_grad_slots(bo, ph + c->ntok_fw, c->nprimals, c->grad_slot))
                goto fail;
        } else if (c->nbw_grads != c->nprimals) {
            ag__err(AG_EINVAL, "compile: the backward graph has %d outputs for %d primals and %d "
                               "effect tokens", nbo, c->nprimals, c->ntok_bw);
            goto fail;
        } else {
            for (int i = 0; i < c->nprimals; i++)
                c->grad_slot[i] = i;
        }
        for (int i = 0; i < c->nprimals; i++)
            c->grad_out[i] = c->grad_slot[i] >= 0 && ag_node_arg(bo, 0)->u.nodes[c->grad_slot[i]];
    } else {
        c->fw = ag_graph_copy(g);
        if (!c->fw)
            goto fail;
    }
    if (ag__rng_wrap_init(&c->rng_fw, c->fw, false))
        goto fail;
    /* Forward tokens are the first inputs and outputs. */
    if (c->rng_fw.seed_in >= 0) {
        c->rng_fw.seed_in -= c->ntok_fw;
        c->rng_fw.offset_in -= c->ntok_fw;
    }
    if (c->rng_fw.offset_out >= 0)
        c->rng_fw.offset_out -= c->ntok_fw;
    if (!c->interpret) {
        c->fw_plan = ag_plan_new(c->fw, &o.plan);
        if (!c->fw_plan || (c->bw && !(c->bw_plan = ag_plan_new(c->bw, &o.plan))))
            goto fail;
    }
    return c;
fail:
    compiled_release(c);
    return NULL;
}

/* ---- the backward node ---- */

struct bw_state {
    ag_compiled *c;
    ag_tensor **saved;      /* nsaved references */
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
        if (s->saved[i] && s->saved[i]->storage->version != s->saved_versions[i])
            return ag__err(AG_ESTATE, "compiled backward: an input saved for backward (forward "
                                      "graph input %d) was modified by an inplace operation "
                                      "after the forward", c->saved_primal[i]);
    int nbin = c->nsaved + c->ntangents + ag__rng_wrap_num_inputs(&c->rng_bw);
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
    /* Draws in the backward start where the generator is now, as eager's would. */
    if (rc == 0)
        rc = ag__rng_wrap_feed(&c->rng_bw, bin);
    if (rc == 0) {
        bool prev = ag_set_grad_enabled(false);
        int n = run_graph(c, true, bin, nbin, grads, ngrads);
        ag_set_grad_enabled(prev);
        if (n < 0)
            rc = n;
        else
            rc = ag__rng_wrap_advance(&c->rng_bw, grads, n);
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

/* ---- calling ---- */

/* Regenerates user output k, which aliases an input, an intermediate base or another output,
 * as a view of that base (after the autograd node is attached, so gradients reach it). */
static ag_tensor *regen_output(ag_compiled *c, int k, ag_tensor *const *prim, ag_tensor **node,
                               ag_tensor **outs) {
    const ag_output_info *oi = &c->out_info[k];
    const ag_tmeta *geom = &c->alias.out[k].geom;
    int b = oi->base_index, nfw0 = c->nmutated + c->nuser + c->nmetamut;
    switch (oi->alias) {
    case AG_OUT_IS_INPUT:
        return prim[b];
    case AG_OUT_ALIAS_OF_INPUT:
        return ag__rt_regen(prim[b], geom, &c->in_meta[b], oi->requires_grad);
    case AG_OUT_ALIAS_OF_INTERMEDIATE:
    case AG_OUT_ALIAS_OF_INTERMEDIATE_SAVE_AS_OUTPUT:
        return ag__rt_regen(node[c->nnode - c->ninter + b], geom, &c->fw_out_meta[nfw0 + b],
                            oi->requires_grad);
    case AG_OUT_ALIAS_OF_INTERMEDIATE_BASE_IS_USER_OUTPUT:
        return ag__rt_regen(outs[b], geom, &c->fw_out_meta[c->nmutated + b], oi->requires_grad);
    default:
        return NULL;
    }
}

int ag_compiled_call(ag_compiled *c, ag_tensor *const *inputs, int ninputs, ag_tensor **outs,
                     int max_out) {
    AG__CHECK_NULL("compiled_call", c);
    if (ninputs > 0)
        AG__CHECK_NULL("compiled_call", inputs);
    if (max_out > 0)
        AG__CHECK_NULL("compiled_call", outs);
    if (c->sub) /* unwraps subclass inputs, calls the plain callable, rewraps */
        return ag__subx_call(c, c->sub, inputs, ninputs, outs, max_out);
    return ag__compiled_call_flat(c, inputs, ninputs, outs, max_out);
}

int ag__compiled_call_flat(ag_compiled *c, ag_tensor *const *inputs, int ninputs, ag_tensor **outs,
                           int max_out) {
    if (ninputs != c->nflat)
        return ag__err(AG_EINVAL, "compiled: %d inputs given, the exported function takes %d "
                                  "(params, buffers, args)", ninputs, c->nflat);
    if (max_out < c->nuser)
        return ag__err(AG_EINVAL, "compiled: room for %d outputs, %d needed", max_out, c->nuser);
    int npa = c->nprimals ? c->nprimals : 1;
    /* The forward's inputs: the primals, then the generator's state when it draws. */
    int nfin = c->nprimals + ag__rng_wrap_num_inputs(&c->rng_fw);
    int nn1 = c->nnode ? c->nnode : 1;
    int nfw = c->nmutated + c->nuser + c->nmetamut + c->ninter + (c->rng_fw.offset_out >= 0);
    int nfo = nfw + c->nsaved;
    /* One block: prim, owned, node, node_raw, fo, rg. */
    ag_tensor **prim =
        ptrs_take(&c->call_mem, (int64_t)nfin + 1 + 2 * npa + 2 * nn1 + (nfo ? nfo : 1));
    ag_tensor **owned = prim ? prim + nfin + 1 : NULL;
    ag_tensor **node = prim ? owned + npa : NULL;
    ag_tensor **node_raw = prim ? node + nn1 : NULL;
    ag_tensor **fo = prim ? node_raw + nn1 : NULL;
    int nowned = 0;
    int rc = prim ? 0 : AG_ENOMEM;
    /* The primals: removed duplicates dropped, merged inputs replaced by their base. */
    if (rc == 0)
        rc = ag__rt_primals(&c->alias, c->in_meta, inputs, ninputs, prim, owned, &nowned);
    for (int i = 0; rc == 0 && i < c->nprimals; i++) {
        const ag_tmeta *m = &c->in_meta[i];
        ag_tensor *t = prim[i];
        if (t->dtype != m->dtype || t->ndim != m->ndim ||
            memcmp(t->sizes, m->sizes, sizeof(int64_t) * (size_t)m->ndim)) {
            char a[128], b[128];
            rc = ag__err(AG_EINVAL, "compiled: input %d is %s%s; the graph was exported for %s%s",
                         c->alias.prim[i].flat, ag_dtype_short(t->dtype),
                         ag__fmt_sizes(a, sizeof a, t->ndim, t->sizes), ag_dtype_short(m->dtype),
                         ag__fmt_sizes(b, sizeof b, m->ndim, m->sizes));
        }
    }
    if (rc) {
        for (int k = 0; k < nowned; k++)
            ag_tensor_free(owned[k]);
        ptrs_give(&c->call_mem, prim);
        return rc;
    }
    /* Everything made here lives in this scope; what must outlive the call is kept. */
    bool scoped = ag__in_scope();
    ag_scope_begin();
    bool prev = ag_set_grad_enabled(false);
    rc = ag__rng_wrap_feed(&c->rng_fw, prim);
    int n = rc ? rc : run_graph(c, false, prim, nfin, fo, nfo);
    if (rc == 0 && n < 0)
        rc = n;
    /* A primal the backward reads (a partition that recomputes from inputs) and that the
     * write-back below changes is saved as it was: the backward sees the forward's value,
     * as eager's autograd does. */
    ag_tensor **pre = NULL;
    for (int i = 0; rc == 0 && i < c->nsaved; i++) {
        int p = c->saved_primal[i];
        if (p < 0 || p >= c->nprimals || !c->in_info[p].mutates_data)
            continue;
        if (!pre && !(pre = ag__calloc((size_t)c->nsaved, sizeof *pre))) {
            rc = AG_ENOMEM;
            break;
        }
        pre[i] = ag__tensor_new(prim[p]->dtype, prim[p]->ndim, prim[p]->sizes, false);
        rc = pre[i] ? ag__copy_into(pre[i], prim[p]) : ag_last_status();
    }
    ag_set_grad_enabled(prev);
    /* The autograd node's outputs: fresh handles of the user outputs that alias nothing and
     * of the intermediate bases, attached to one node when gradients can flow. */
    for (int k = 0; rc == 0 && k < c->nuser + c->ninter; k++) {
        int ni = k < c->nuser ? c->node_of_user[k] : c->nnode - c->ninter + (k - c->nuser);
        if (ni < 0)
            continue;
        ag_tensor *t = fo[k < c->nuser ? c->nmutated + k : c->nmutated + c->nuser + c->nmetamut + (k - c->nuser)];
        node_raw[ni] = t;
        node[ni] = t ? ag_detach(t) : NULL;
        if (node[ni])
            node[ni] = ag_tensor_keep(node[ni]); /* owned here until handed out below */
        if (t && !node[ni])
            rc = ag_last_status();
    }
    if (rc == 0 && c->needs_autograd) {
        bw_state *s = bw_state_new(c);
        ag_tensor **rg = fo + (nfo ? nfo : 1); /* the node's inputs */
        if (!s) {
            rc = AG_ENOMEM;
        } else {
            for (int i = 0; i < c->nsaved; i++) {
                int p = c->saved_primal[i];
                /* A saved primal is the caller's tensor: remember its version. */
                s->saved[i] = ag_tensor_keep(pre && pre[i] ? pre[i] : p >= 0 ? prim[p] : fo[nfw + i]);
                s->saved_versions[i] = s->saved[i] ? s->saved[i]->storage->version : 0;
            }
            /* The executor's tensors, not the node's outputs (which would hold the node). */
            for (int t = 0; t < c->ntangents; t++)
                s->zeros_like[t] = ag_tensor_keep(node_raw[c->tangent_of[t]]);
            for (int i = 0; i < c->nprimals; i++)
                if (c->in_info[i].requires_grad && c->grad_out[i] && prim[i]->requires_grad) {
                    s->rg_primal[s->nrg] = i;
                    rg[s->nrg++] = prim[i];
                }
            rc = ag__autograd_custom("CompiledFunction", rg, s->nrg, node, c->nnode, c->out_diff,
                                     compiled_backward, s, bw_state_free);
        }
    }
    /* User outputs: the node's, then the regenerated aliases (those of other outputs last). */
    for (int k = 0; k < c->nuser; k++)
        outs[k] = c->node_of_user[k] >= 0 ? ag_tensor_keep(node[c->node_of_user[k]]) : NULL;
    for (int pass = 0; pass < 2 && rc == 0; pass++)
        for (int k = 0; k < c->nuser && rc == 0; k++) {
            bool of_output = c->out_info[k].alias == AG_OUT_ALIAS_OF_INTERMEDIATE_BASE_IS_USER_OUTPUT;
            if (c->node_of_user[k] >= 0 || of_output != (pass == 1) || !fo[c->nmutated + k])
                continue;
            ag_tensor *r = regen_output(c, k, prim, node, outs);
            if (!r)
                rc = ag_last_status() ? ag_last_status() : AG_EINVAL;
            else
                outs[k] = ag_tensor_keep(r);
        }
    /* The call's effects come last, once nothing can fail, so a failed call has none: the
     * generator's offset moves past the forward's draws, and input mutations are written back
     * (BatchNorm's running statistics, a base's new value) as eager mutated them: metadata
     * first (as_strided_), then data. */
    if (rc == 0)
        rc = ag__rng_wrap_advance(&c->rng_fw, fo, n);
    for (int i = 0, k = 0; rc == 0 && i < c->nprimals; i++) {
        const ag_input_info *ii = &c->in_info[i];
        if (!ii->mutates_data && !ii->mutates_metadata)
            continue;
        if (ii->mutates_metadata)
            ag__rt_set_geometry(prim[i], &c->alias.prim[i].new_geom, prim[i]->offset);
        if (ii->mutates_data) {
            rc = ag__copy_into(prim[i], fo[k]);
            prim[i]->storage->version++;
        }
        k++;
    }
    /* Metadata mutations of inputs merged into a base. */
    for (int i = 0; rc == 0 && i < c->nflat; i++) {
        const ag__flat_info *f = &c->alias.flat[i];
        if (f->kind == AG__FLAT_VIEW && f->metadata_mutation >= 0)
            ag__rt_set_geometry(inputs[i], &f->new_geom, prim[f->primal]->offset);
    }
    ag_scope_end();
    for (int i = 0; pre && i < c->nsaved; i++)
        ag_tensor_free(pre[i]);
    ag__free(pre);
    for (int k = 0; k < c->nnode; k++)
        ag_tensor_free(node[k]);
    for (int k = 0; k < nowned; k++)
        ag_tensor_free(owned[k]);
    ptrs_give(&c->call_mem, prim);
    for (int k = 0; k < c->nuser; k++) {
        if (rc) {
            ag_tensor_free(outs[k]);
            outs[k] = NULL;
        } else if (scoped) {
            outs[k] = ag__give(outs[k]);
        }
    }
    return rc ? rc : c->nuser;
}

int ag_compiled_call_module(ag_compiled *c, ag_module *m, ag_tensor *const *args, int nargs,
                            ag_tensor **outs, int max_out) {
    AG__CHECK_NULL("compiled_call_module", c);
    AG__CHECK_NULL("compiled_call_module", m);
    if (nargs < 0)
        return ag__err(AG_EINVAL, "compiled_call_module: negative argument count %d", nargs);
    if (nargs > 0)
        AG__CHECK_NULL("compiled_call_module", args);
    if (max_out > 0)
        AG__CHECK_NULL("compiled_call_module", outs);
    /* The flat inputs (parameters, buffers, args), on the stack when they fit. */
    ag_tensor *stack_in[512];
    int64_t nt = ag__module_flat_tensors(m, NULL, 0), n = nt + nargs;
    ag_tensor **in = n <= 512 ? stack_in : ag__calloc((size_t)n, sizeof *in);
    if (!in)
        return AG_ENOMEM;
    ag__module_flat_tensors(m, in, nt);
    for (int i = 0; i < nargs; i++)
        in[nt + i] = args[i];
    int rc = ag_compiled_call(c, in, (int)n, outs, max_out);
    if (in != stack_in)
        ag__free(in);
    return rc;
}
