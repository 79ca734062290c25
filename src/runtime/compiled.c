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
 * against their storage version, so an in-place change before backward is an error. Tensor
 * subclass inputs and outputs are unwrapped and rewrapped around this callable (subclass.c). */
#include "../graph/graph_internal.h"
#include "aotgrad/compile.h"
#include "subclass.h"

#include <stdio.h>

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
    int *tangent_of;        /* user output index of each tangent */
    int *saved_primal;      /* for each saved value: the primal it is, or -1 */
    bool *grad_out;         /* primal i gets a gradient from the backward graph */
    bool *out_diff;         /* per user output: carries a gradient */
    int *grad_slot;         /* per primal: the backward graph's output that is its gradient, or -1 */
    int nbw_out;
    ag__subx_info *sub;     /* tensor subclasses to unwrap and rewrap (subclass.c), or NULL */
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
    ag__free(c->grad_slot);
    ag__subx_info_release(c->sub);
    ag__free(c);
}

void ag_compiled_free(ag_compiled *c) { compiled_release(c); }

const ag_graph *ag_compiled_forward_graph(const ag_compiled *c) { return c->fw; }
const ag_graph *ag_compiled_backward_graph(const ag_compiled *c) { return c->bw; }
const ag_partition_stats *ag_compiled_stats(const ag_compiled *c) { return &c->stats; }
int64_t ag_compiled_peak_bytes(const ag_compiled *c, bool backward) {
    const ag_plan *p = backward ? c->bw_plan : c->fw_plan;
    return p ? ag_plan_peak_bytes(p) : -1;
}

static int run_graph(const ag_compiled *c, bool backward, ag_tensor *const *in, int nin,
                     ag_tensor **outs, int max_out) {
    if (c->interpret)
        return ag_graph_run(backward ? c->bw : c->fw, in, nin, outs, max_out);
    return ag_plan_run(backward ? c->bw_plan : c->fw_plan, in, nin, outs, max_out);
}

ag_compiled *ag_compile_joint(const ag_joint *j, const ag_compile_opts *opts) {
    ag_compile_opts o = {0};
    o.partition.memory_budget = 1.0;
    if (opts)
        o = *opts;
    ag_compiled *c = ag__calloc(1, sizeof *c);
    if (!c)
        return NULL;
    c->refcount = 1;
    c->interpret = o.interpret;
    c->nprimals = ag_joint_num_primals(j);
    c->nmutated = ag_joint_num_mutated_inputs(j);
    c->nuser = ag_joint_num_user_outputs(j);
    c->ntangents = ag_joint_num_tangents(j);
    c->needs_autograd = ag_joint_needs_autograd(j);
    int np = c->nprimals ? c->nprimals : 1, nu = c->nuser ? c->nuser : 1;
    c->in_info = ag__calloc((size_t)np, sizeof *c->in_info);
    c->in_meta = ag__calloc((size_t)np, sizeof *c->in_meta);
    c->out_info = ag__calloc((size_t)nu, sizeof *c->out_info);
    c->out_diff = ag__calloc((size_t)nu, sizeof *c->out_diff);
    c->tangent_of = ag__calloc((size_t)(c->ntangents ? c->ntangents : 1), sizeof *c->tangent_of);
    c->grad_out = ag__calloc((size_t)np, sizeof *c->grad_out);
    c->grad_slot = ag__calloc((size_t)np, sizeof *c->grad_slot);
    c->sub = ag__subx_info_retain(ag__joint_subclass_info(j));
    if (!c->in_info || !c->in_meta || !c->out_info || !c->out_diff || !c->tangent_of || !c->grad_out ||
        !c->grad_slot)
        goto fail;
    for (int i = 0; i < c->nprimals; i++)
        c->grad_slot[i] = i;
    const ag_graph *g = ag_joint_graph(j);
    ag_node **ph;
    int nph = ag_graph_placeholders(g, &ph);
    if (nph < 0)
        goto fail;
    for (int i = 0; i < c->nprimals; i++) {
        c->in_info[i] = *ag_joint_input_info(j, i);
        c->in_meta[i] = *ag_node_val(ph[i], 0);
    }
    int nt = 0;
    for (int k = 0; k < c->nuser; k++) {
        c->out_info[k] = *ag_joint_output_info(j, k);
        /* An output gets a tangent (and so carries a gradient) exactly as the export decided. */
        const ag_output_info *oi = &c->out_info[k];
        ag_node *out = ag_graph_output_node(g);
        ag_node *on = ag_node_arg(out, 0)->u.nodes[c->nmutated + k];
        bool diff = c->needs_autograd && oi->requires_grad && oi->alias == AG_OUT_NON_ALIAS && on &&
                    ag_dtype_is_float(ag_node_val(on, 0)->dtype);
        c->out_diff[k] = diff;
        if (diff && nt < c->ntangents)
            c->tangent_of[nt++] = k;
    }
    if (nt != c->ntangents) {
        ag__err(AG_EINVAL, "compile: %d tangents in the joint but %d differentiable outputs",
                c->ntangents, nt);
        goto fail;
    }
    int nfw = ag_joint_num_fw_outputs(j);
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
            for (int i = 0; v && i < nfph; i++)
                if (fph[i] == v)
                    c->saved_primal[s] = i;
        }
        ag_node *bo = ag_graph_output_node(c->bw);
        int nbo = ag_node_arg(bo, 0)->n;
        c->nbw_out = nbo;
        /* With subclasses a primal's gradient is found by descriptor (an input without one has
         * a single None however many primals it flattened into). */
        if (c->sub) {
            if (ag__subx_grad_slots(bo, ph, c->nprimals, c->grad_slot))
                goto fail;
        } else if (nbo != c->nprimals) {
            ag__err(AG_EINVAL, "compile: the backward graph has %d outputs for %d primals", nbo,
                    c->nprimals);
            goto fail;
        }
        for (int i = 0; i < c->nprimals; i++)
            c->grad_out[i] = c->grad_slot[i] >= 0 && ag_node_arg(bo, 0)->u.nodes[c->grad_slot[i]];
    } else {
        c->fw = ag_graph_copy(g);
        if (!c->fw)
            goto fail;
    }
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

typedef struct bw_state {
    ag_compiled *c;
    ag_tensor **saved;      /* nsaved references */
    uint64_t *saved_versions;
    ag_tensor **zeros_like; /* per tangent: an output to shape missing gradients after */
    int *rg_primal;         /* the node's inputs: primal index of each */
    int nrg;
} bw_state;

static void bw_state_free(void *ud) {
    bw_state *s = ud;
    if (!s)
        return;
    for (int i = 0; i < s->c->nsaved; i++)
        ag_tensor_free(s->saved ? s->saved[i] : NULL);
    for (int i = 0; i < s->c->ntangents; i++)
        ag_tensor_free(s->zeros_like ? s->zeros_like[i] : NULL);
    ag__free(s->saved);
    ag__free(s->saved_versions);
    ag__free(s->zeros_like);
    ag__free(s->rg_primal);
    compiled_release(s->c);
    ag__free(s);
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
    int nbin = c->nsaved + c->ntangents;
    ag_tensor **bin = ag__calloc((size_t)(nbin ? nbin : 1), sizeof *bin);
    ag_tensor **grads = ag__calloc((size_t)(c->nbw_out ? c->nbw_out : 1), sizeof *grads);
    int rc = bin && grads ? 0 : AG_ENOMEM;
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
    if (rc == 0) {
        bool prev = ag_set_grad_enabled(false);
        int n = run_graph(c, true, bin, nbin, grads, c->nbw_out);
        ag_set_grad_enabled(prev);
        if (n < 0)
            rc = n;
    }
    /* The engine runs this inside a scope, which owns what run_graph returned. */
    for (int j = 0; rc == 0 && j < nin; j++) {
        int p = c->grad_slot[s->rg_primal[j]];
        if (needs[j] && grads[p]) {
            /* A gradient made by the executor for this input alone may become a leaf's .grad
             * uncopied; one that is also another input's gradient, or is one of the backward's
             * own inputs (a tangent passed straight through), must be copied. */
            bool shared = false;
            for (int q = 0; q < c->nbw_out && !shared; q++)
                shared = q != p && grads[q] == grads[p];
            for (int q = 0; q < nbin && !shared; q++)
                shared = bin[q] == grads[p];
            grads[p]->grad_donated = !shared;
            gin[j] = grads[p];
        }
    }
    ag__free(bin);
    ag__free(grads);
    return rc;
}

/* ---- calling ---- */

int ag_compiled_call(ag_compiled *c, ag_tensor *const *inputs, int ninputs, ag_tensor **outs,
                     int max_out) {
    if (c->sub) /* unwraps subclass inputs, calls the flat callable, rewraps */
        return ag__subx_call(c, c->sub, inputs, ninputs, outs, max_out);
    return ag__compiled_call_flat(c, inputs, ninputs, outs, max_out);
}

int ag__compiled_call_flat(ag_compiled *c, ag_tensor *const *inputs, int ninputs, ag_tensor **outs,
                           int max_out) {
    if (ninputs != c->nprimals)
        return ag__err(AG_EINVAL, "compiled: %d inputs given, the exported function takes %d "
                                  "(params, buffers, args)", ninputs, c->nprimals);
    if (max_out < c->nuser)
        return ag__err(AG_EINVAL, "compiled: room for %d outputs, %d needed", max_out, c->nuser);
    for (int i = 0; i < ninputs; i++) {
        const ag_tmeta *m = &c->in_meta[i];
        ag_tensor *t = inputs[i];
        if (!t)
            return ag__has_error() ? ag_last_status() : ag__err(AG_EINVAL, "compiled: input %d is NULL", i);
        if (t->dtype != m->dtype || t->ndim != m->ndim ||
            memcmp(t->sizes, m->sizes, sizeof(int64_t) * (size_t)m->ndim)) {
            char a[128], b[128];
            return ag__err(AG_EINVAL, "compiled: input %d is %s%s; the graph was exported for %s%s", i,
                           ag_dtype_short(t->dtype), ag__fmt_sizes(a, sizeof a, t->ndim, t->sizes),
                           ag_dtype_short(m->dtype), ag__fmt_sizes(b, sizeof b, m->ndim, m->sizes));
        }
    }
    int nfw = c->nmutated + c->nuser;
    int nfo = nfw + c->nsaved;
    ag_tensor **fo = ag__calloc((size_t)(nfo ? nfo : 1), sizeof *fo);
    if (!fo)
        return AG_ENOMEM;
    /* Everything made here lives in this scope; what must outlive the call is kept. */
    bool scoped = ag__in_scope();
    ag_scope_begin();
    bool prev = ag_set_grad_enabled(false);
    int n = run_graph(c, false, inputs, ninputs, fo, nfo);
    int rc = n < 0 ? n : 0;
    /* Write input mutations back (BatchNorm's running statistics), as eager mutated them. */
    for (int i = 0, k = 0; rc == 0 && i < c->nprimals; i++)
        if (c->in_info[i].mutates_data) {
            rc = ag__copy_into(inputs[i], fo[k++]);
            inputs[i]->storage->version++;
        }
    ag_set_grad_enabled(prev);
    /* User outputs: fresh handles, attached to one autograd node when gradients can flow. */
    for (int k = 0; rc == 0 && k < c->nuser; k++) {
        ag_tensor *t = fo[c->nmutated + k];
        outs[k] = t ? ag_detach(t) : NULL;
        if (outs[k])
            outs[k] = ag_tensor_keep(outs[k]); /* owned here until handed out below */
        if (t && !outs[k])
            rc = ag_last_status();
    }
    if (rc == 0 && c->needs_autograd) {
        bw_state *s = ag__calloc(1, sizeof *s);
        ag_tensor **rg = ag__calloc((size_t)(c->nprimals ? c->nprimals : 1), sizeof *rg);
        if (s) {
            c->refcount++;
            s->c = c;
            s->saved = ag__calloc((size_t)(c->nsaved ? c->nsaved : 1), sizeof *s->saved);
            s->saved_versions = ag__calloc((size_t)(c->nsaved ? c->nsaved : 1), sizeof(uint64_t));
            s->zeros_like = ag__calloc((size_t)(c->ntangents ? c->ntangents : 1), sizeof(ag_tensor *));
            s->rg_primal = ag__calloc((size_t)(c->nprimals ? c->nprimals : 1), sizeof(int));
        }
        if (!s || !rg || !s->saved || !s->saved_versions || !s->zeros_like || !s->rg_primal) {
            bw_state_free(s);
            ag__free(rg);
            rc = AG_ENOMEM;
        } else {
            for (int i = 0; i < c->nsaved; i++) {
                int p = c->saved_primal[i];
                /* A saved primal is the caller's tensor: remember its version. */
                s->saved[i] = ag_tensor_keep(p >= 0 ? inputs[p] : fo[nfw + i]);
                s->saved_versions[i] = s->saved[i] ? s->saved[i]->storage->version : 0;
            }
            for (int t = 0; t < c->ntangents; t++)
                s->zeros_like[t] = ag_tensor_keep(fo[c->nmutated + c->tangent_of[t]]);
            for (int i = 0; i < c->nprimals; i++)
                if (c->in_info[i].requires_grad && c->grad_out[i] && inputs[i]->requires_grad) {
                    s->rg_primal[s->nrg] = i;
                    rg[s->nrg++] = inputs[i];
                }
            rc = ag__autograd_custom("CompiledFunction", rg, s->nrg, outs, c->nuser, c->out_diff,
                                     compiled_backward, s, bw_state_free);
            ag__free(rg);
        }
    }
    ag_scope_end();
    ag__free(fo);
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
    ag_named_tensors ps = {0}, bs = {0};
    if (ag_module_named_parameters(m, false, &ps) || ag_module_named_buffers(m, false, &bs)) {
        ag_named_tensors_free(&ps);
        return ag_last_status();
    }
    int n = ps.n + bs.n + nargs;
    ag_tensor **in = ag__calloc((size_t)(n ? n : 1), sizeof *in);
    int rc = in ? 0 : AG_ENOMEM;
    if (in) {
        int k = 0;
        for (int i = 0; i < ps.n; i++)
            in[k++] = ps.tensors[i];
        for (int i = 0; i < bs.n; i++)
            in[k++] = bs.tensors[i];
        for (int i = 0; i < nargs; i++)
            in[k++] = args[i];
        rc = ag_compiled_call(c, in, n, outs, max_out);
    }
    ag__free(in);
    ag_named_tensors_free(&ps);
    ag_named_tensors_free(&bs);
    return rc;
}
