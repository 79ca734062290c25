/* ag_export_joint: the joint forward+backward graph with descriptors (include/aotgrad/export.h).
 *
 * In: a module, example args and kwargs. Out: an ag_joint holding the functional joint graph,
 * the calling convention (params_spec, buffers_spec, in_spec, out_spec, static inputs) and
 * per-input / per-output facts.
 *
 * How: one tracing session over a new graph. Placeholders primals_1.. stand for the flat inputs
 * (the module's real parameter and buffer tensors are bound to them, so no weight is copied and
 * nothing runs on data). The forward runs with autograd recording and with functionalization,
 * so in-place updates become functional ops whose results rebind the mutated tensors. Then
 * tangent placeholders are added for the outputs that need them, and ag_grad runs the backward
 * rules in the same session: the backward nodes land in the same graph, tagged is_backward and
 * numbered by the engine with their forward op's seq_nr. Finally forward metadata (annotations,
 * stack traces) is copied onto backward nodes, dead code is removed and the optional
 * decomposition table applied. */
#include "../graph/graph_internal.h"
#include "aotgrad/export.h"
#include "alias.h"
#include "inference_mutations.h"
#include "joint_internal.h"
#include "rng_functionalize.h"
#include "subclass_flatten.h"
#include "token_chain.h"

#include <stdio.h>

/* ---- accessors ---- */

ag_graph *ag_joint_graph(const ag_joint *j) { return j ? j->g : NULL; }
int ag_joint_num_params(const ag_joint *j) { return j ? j->nparams : 0; }
const char *ag_joint_param_fqn(const ag_joint *j, int i) {
    if (!j)
        return NULL;
    return i >= 0 && i < j->nparams ? j->params[i] : NULL;
}
int ag_joint_num_buffers(const ag_joint *j) { return j ? j->nbuffers : 0; }
const char *ag_joint_buffer_fqn(const ag_joint *j, int i) {
    if (!j)
        return NULL;
    return i >= 0 && i < j->nbuffers ? j->buffers[i] : NULL;
}
const ag_treespec *ag_joint_in_spec(const ag_joint *j) { return j ? j->in_spec : NULL; }
const ag_treespec *ag_joint_out_spec(const ag_joint *j) { return j ? j->out_spec : NULL; }
/* Static inputs: the primals of parameters and buffers that are primals of their own (not
 * merged into a base, not removed as duplicates), in primal order, after the effect tokens. */
static int static_inputs(const ag_joint *j, int want) {
    int n = 0;
    for (int p = 0; p < j->nprimals - j->nfw_tokens; p++) {
        bool is_static = false;
        for (int i = 0; i < j->npb_flat && !is_static; i++)
            is_static = j->alias.flat[i].kind == AG__FLAT_PRIMAL && j->alias.flat[i].primal == p;
        if (is_static && n++ == want)
            return j->nfw_tokens + p;
    }
    return want < 0 ? n : -1;
}
int ag_joint_num_static_inputs(const ag_joint *j) { return j ? static_inputs(j, -1) : 0; }
ag__subx_info *ag__joint_subclass_info(const ag_joint *j) { return j->subclass; }
int ag_joint_static_input(const ag_joint *j, int i) {
    if (!j)
        return -1;
    return i >= 0 ? static_inputs(j, i) : -1;
}
static int count(const ag_joint *j, ag_section s) { return j ? j->layout.sec[s].count : 0; }
const ag_layout *ag_joint_layout(const ag_joint *j) { return j ? &j->layout : NULL; }
int ag_joint_num_primals(const ag_joint *j) {
    return count(j, AG_SEC_IN_FW_TOKENS) + count(j, AG_SEC_IN_PRIMALS);
}
int ag_joint_num_tangents(const ag_joint *j) { return count(j, AG_SEC_IN_TANGENTS); }
const ag_input_info *ag_joint_input_info(const ag_joint *j, int i) {
    if (!j)
        return NULL;
    return i >= 0 && i < j->nprimals ? &j->in_info[i] : NULL;
}
int ag_joint_num_user_outputs(const ag_joint *j) { return count(j, AG_SEC_OUT_USER); }
const ag_output_info *ag_joint_output_info(const ag_joint *j, int i) {
    if (!j)
        return NULL;
    return i >= 0 && i < j->nuser_out ? &j->out_info[i] : NULL;
}
int ag_joint_num_mutated_inputs(const ag_joint *j) { return count(j, AG_SEC_OUT_MUTATIONS); }
int ag_joint_num_fw_outputs(const ag_joint *j) { return j ? ag_layout_num_fw_outputs(&j->layout) : 0; }
int ag_joint_num_forward_tokens(const ag_joint *j) { return count(j, AG_SEC_IN_FW_TOKENS); }
int ag_joint_num_backward_tokens(const ag_joint *j) { return count(j, AG_SEC_IN_BW_TOKENS); }
bool ag_joint_needs_autograd(const ag_joint *j) { return j ? j->needs_autograd : false; }

void ag_joint_free(ag_joint *j) {
    if (!j)
        return;
    ag_graph_free(j->g);
    for (int i = 0; j->params && i < j->nparams; i++)
        ag__free(j->params[i]);
    for (int i = 0; j->buffers && i < j->nbuffers; i++)
        ag__free(j->buffers[i]);
    ag__free(j->params);
    ag__free(j->buffers);
    ag_treespec_release(j->in_spec);
    ag_treespec_release(j->out_spec);
    ag__free(j->in_info);
    ag__free(j->out_info);
    for (int i = 0; i < j->nprimals; i++)
        ag_desc_release(j->primal_descs ? j->primal_descs[i] : NULL);
    for (int i = 0; i < j->ntangents + j->nbw_tokens; i++)
        ag_desc_release(j->tangent_descs ? j->tangent_descs[i] : NULL);
    ag__free(j->primal_descs);
    ag__free(j->tangent_descs);
    ag__joint_alias_clear(&j->alias);
    for (int i = 0; i < j->nrng; i++)
        ag_desc_release(j->rng_descs[i]);
    ag__subx_info_release(j->subclass);
    ag__free(j);
}

/* ---- the convention checks of ag_joint_set_graph ---- */

int ag_joint_set_graph(ag_joint *j, ag_graph *g) {
    if (!j) { /* the joint would have owned g */
        ag_graph_free(g);
        return ag__err(AG_EINVAL, "joint_set_graph: j is NULL");
    }
    int rc = 0;
    ag_node **ph;
    int nph = g ? ag_graph_placeholders(g, &ph) : AG_EINVAL;
    if (!g)
        return ag__err(AG_EINVAL, "joint_set_graph: g is NULL");
    if (nph < 0) {
        ag_graph_free(g);
        return nph;
    }
    int nt = j->ntangents + j->nbw_tokens;
    if (nph != j->nprimals + nt + j->nrng)
        rc = ag__err(AG_EINVAL, "joint_set_graph: the graph has %d placeholders; the calling "
                                "convention has %d primals and %d tangents%s", nph, j->nprimals,
                     nt, j->nrng ? " and the philox seeds and offsets" : "");
    for (int i = 0; rc == 0 && i < nph; i++) {
        ag_desc *d = ag_node_desc(ph[i]);
        int t = i - j->nprimals;
        ag_desc *want = t < 0 ? j->primal_descs[i] : t < nt ? j->tangent_descs[t] : j->rng_descs[t - nt];
        char a[256], b[256];
        if (!d)
            rc = ag__err(AG_EINVAL, "joint_set_graph: placeholder %s has no descriptor",
                         ag_node_name(ph[i]));
        else if (!ag_desc_equal(d, want)) {
            ag_desc_repr(d, a, sizeof a);
            ag_desc_repr(want, b, sizeof b);
            rc = ag__err(AG_EINVAL, "joint_set_graph: placeholder %d (%s) is %s; the calling "
                                    "convention expects %s there", i, ag_node_name(ph[i]), a, b);
        }
    }
    ag_node *out = ag_graph_output_node(g);
    if (rc == 0 && !out)
        rc = ag__err(AG_EINVAL, "joint_set_graph: the graph has no output node");
    if (rc == 0 && !ag_node_has_output_descs(out))
        rc = ag__err(AG_EINVAL, "joint_set_graph: the output node carries no descriptors");
    if (rc == 0)
        rc = ag_graph_verify(g);
    if (rc) {
        ag_graph_free(g);
        return rc;
    }
    ag_graph_free(j->g);
    j->g = g;
    return ag_graph_layout(g, 0, &j->layout); /* the same sections: the descriptors are */
}

/* ---- the open transform path ---- */

static ag_treespec *make_in_spec(int nlist, const char *const *kw, int nkw);

/* The new primal state of an update: descriptors, facts and static inputs of g's primals. */
typedef struct update_state {
    ag_desc **primal_descs, **tangent_descs, *rng_descs[4];
    ag_input_info *in_info;
    char **params, **buffers;
    int nprimals, nparams, nbuffers, nrng;
    ag_treespec *in_spec;
    ag__joint_alias alias;
} update_state;

static void update_state_clear(update_state *u, int ntangents) {
    for (int i = 0; u->primal_descs && i < u->nprimals; i++)
        ag_desc_release(u->primal_descs[i]);
    for (int i = 0; u->tangent_descs && i < ntangents; i++)
        ag_desc_release(u->tangent_descs[i]);
    for (int i = 0; i < u->nrng; i++)
        ag_desc_release(u->rng_descs[i]);
    for (int i = 0; u->params && i < u->nparams; i++)
        ag__free(u->params[i]);
    for (int i = 0; u->buffers && i < u->nbuffers; i++)
        ag__free(u->buffers[i]);
    ag__free(u->primal_descs);
    ag__free(u->tangent_descs);
    ag__free(u->in_info);
    ag__free(u->params);
    ag__free(u->buffers);
    ag_treespec_release(u->in_spec);
    ag__joint_alias_clear(&u->alias);
}

/* The position of the output among [from, from + n) whose descriptor is the k-th kind-`kind`
 * descriptor wrapping d (InputMutation(d), Grad(d)), or -1. */
static int output_wrapping(const ag_node *out, const ag_range *r, ag_desc_kind kind,
                           const ag_desc *d) {
    for (int k = r->start; k < r->start + r->count; k++) {
        const ag_desc *od = ag_node_output_desc(out, k);
        if (od && ag_desc_kind_of(od) == kind && ag_desc_equal(ag_desc_nested(od), d))
            return k;
    }
    return -1;
}

/* Reads g's primals: each keeps its facts when the export made it, and a new one (a parameter,
 * buffer or plain input the transform added) gets them from the outputs that describe it. */
static int update_primals(const ag_joint *j, const ag_graph *g, const ag_layout *L,
                          update_state *u) {
    ag_node **ph, *out = ag_graph_output_node(g);
    ag_graph_placeholders(g, &ph);
    const ag_range *pr = &L->sec[AG_SEC_IN_PRIMALS];
    int np = ag_layout_count(L, AG_SEC_IN_FW_TOKENS) + pr->count;
    u->nprimals = np;
    u->primal_descs = ag__calloc((size_t)np + 1, sizeof *u->primal_descs);
    u->in_info = ag__calloc((size_t)np + 1, sizeof *u->in_info);
    u->params = ag__calloc((size_t)pr->count + 1, sizeof(char *));
    u->buffers = ag__calloc((size_t)pr->count + 1, sizeof(char *));
    if (!u->primal_descs || !u->in_info || !u->params || !u->buffers)
        return AG_ENOMEM;
    bool same = np == j->nprimals;
    for (int i = 0; i < np; i++) {
        ag_desc *d = ag_node_desc(ph[i]);
        u->primal_descs[i] = ag_desc_retain(d);
        same = same && ag_desc_equal(d, j->primal_descs[i]);
    }
    bool plain_alias = !j->subclass;
    for (int f = 0; f < j->alias.nflat; f++)
        plain_alias = plain_alias && j->alias.flat[f].kind == AG__FLAT_PRIMAL &&
                      j->alias.prim[j->alias.flat[f].primal].base == AG__BASE_NONE;
    if (!same && !plain_alias)
        return ag__err(AG_ENOTSUP, "joint_update: the joint's flat inputs are %s; a transform "
                                   "may not add or drop its inputs",
                       j->subclass ? "tensor subclasses flattened"
                                   : "deduplicated or merged into bases");
    for (int i = 0; i < np; i++) {
        const ag_desc *d = u->primal_descs[i];
        int old = -1;
        for (int k = 0; k < j->nprimals && old < 0; k++)
            old = ag_desc_equal(d, j->primal_descs[k]) ? k : -1;
        if (old >= 0) {
            u->in_info[i] = j->in_info[old];
        } else {
            ag_desc_kind kd = ag_desc_kind_of(d);
            if (kd != AG_DESC_PARAM && kd != AG_DESC_BUFFER && kd != AG_DESC_PLAIN_INPUT) {
                char r[256];
                ag_desc_repr(d, r, sizeof r);
                return ag__err(AG_ENOTSUP, "joint_update: new input %s (%s): a transform may "
                                           "add parameters, buffers and plain inputs only",
                               ag_node_name(ph[i]), r);
            }
            int gk = output_wrapping(out, &L->sec[AG_SEC_OUT_GRADS], AG_DESC_GRAD, d);
            u->in_info[i].requires_grad = gk >= 0 && ag_node_arg(out, 0)->u.nodes[gk];
            u->in_info[i].mutates_data =
                output_wrapping(out, &L->sec[AG_SEC_OUT_MUTATIONS], AG_DESC_INPUT_MUTATION, d) >= 0;
        }
        if (ag_desc_kind_of(d) == AG_DESC_PARAM &&
            !(u->params[u->nparams++] = ag__strdup(ag_desc_target(d))))
            return AG_ENOMEM;
        if (ag_desc_kind_of(d) == AG_DESC_BUFFER &&
            !(u->buffers[u->nbuffers++] = ag__strdup(ag_desc_target(d))))
            return AG_ENOMEM;
    }
    /* Input mutations are written back in primal order: the k-th one is the k-th mutated
     * primal's. */
    const ag_range *mr = &L->sec[AG_SEC_OUT_MUTATIONS];
    for (int i = 0, k = 0; i < np; i++) {
        if (!u->in_info[i].mutates_data && !u->in_info[i].mutates_metadata)
            continue;
        const ag_desc *od = k < mr->count ? ag_node_output_desc(out, mr->start + k) : NULL;
        if (!od || !ag_desc_equal(ag_desc_nested(od), u->primal_descs[i]))
            return ag__err(AG_EINVAL, "joint_update: input %s is mutated but input mutation "
                                      "output %d is not its", ag_node_name(ph[i]), k);
        k++;
    }
    if (same)
        return ag__joint_alias_copy(&u->alias, &j->alias);
    /* Added or dropped inputs: the flat inputs are the primals, in order. */
    int nf = pr->count;
    ag__joint_alias *a = &u->alias;
    a->flat = ag__calloc((size_t)nf + 1, sizeof *a->flat);
    a->prim = ag__calloc((size_t)nf + 1, sizeof *a->prim);
    a->out = ag__calloc((size_t)j->alias.nuser + 1, sizeof *a->out);
    if (!a->flat || !a->prim || !a->out)
        return AG_ENOMEM;
    a->nflat = a->nprimals = nf;
    a->nuser = j->alias.nuser;
    memcpy(a->out, j->alias.out, sizeof *a->out * (size_t)a->nuser);
    for (int f = 0; f < nf; f++) {
        a->flat[f] = (ag__flat_info){.kind = AG__FLAT_PRIMAL, .primal = f, .dup_of = -1,
                                     .metadata_mutation = -1};
        a->prim[f] = (ag__primal_info){.base = AG__BASE_NONE, .flat = f};
    }
    /* in_spec: the flat inputs, keyword arguments as at export when the plain inputs are. */
    const ag_treespec *kw = ag_treespec_child(j->in_spec, 1);
    int nkw = ag_treespec_num_children(kw), nplain_old = 0, nplain = 0;
    for (int k = 0; k < j->nprimals; k++)
        nplain_old += ag_desc_kind_of(j->primal_descs[k]) == AG_DESC_PLAIN_INPUT;
    for (int k = 0; k < np; k++)
        nplain += ag_desc_kind_of(u->primal_descs[k]) == AG_DESC_PLAIN_INPUT;
    if (nplain != nplain_old)
        nkw = 0;
    const char *keys[64];
    for (int k = 0; k < nkw && k < 64; k++)
        keys[k] = ag_treespec_key(kw, k);
    u->in_spec = make_in_spec(nf - nkw, keys, nkw);
    return u->in_spec ? 0 : AG_ENOMEM;
}

int ag_joint_update(ag_joint *j, ag_graph *g) {
    if (!j || !g) {
        ag_graph_free(g);
        return ag__err(AG_EINVAL, "joint_update: %s is NULL", j ? "g" : "j");
    }
    ag_layout L;
    update_state u = {0};
    int rc = ag_graph_verify(g);
    if (rc == 0)
        rc = ag_graph_layout(g, 0, &L);
    if (rc == 0 && ag_layout_count(&L, AG_SEC_IN_FW_TOKENS) != j->nfw_tokens)
        rc = ag__err(AG_ENOTSUP, "joint_update: a transform may not add or drop effect tokens");
    if (rc == 0)
        rc = update_primals(j, g, &L, &u);
    int nt = ag_layout_count(&L, AG_SEC_IN_TANGENTS) + ag_layout_count(&L, AG_SEC_IN_BW_TOKENS);
    ag_node **ph;
    if (rc == 0 && ag_graph_placeholders(g, &ph) >= 0 &&
        !(u.tangent_descs = ag__calloc((size_t)nt + 1, sizeof *u.tangent_descs)))
        rc = AG_ENOMEM;
    for (int t = 0; rc == 0 && t < nt; t++)
        u.tangent_descs[t] = ag_desc_retain(ag_node_desc(ph[L.sec[AG_SEC_IN_TANGENTS].start + t]));
    for (int s = AG_SEC_IN_FW_RNG; rc == 0 && s <= AG_SEC_IN_BW_RNG; s++)
        for (int k = 0; k < L.sec[s].count && u.nrng < 4; k++)
            u.rng_descs[u.nrng++] = ag_desc_retain(ag_node_desc(ph[L.sec[s].start + k]));
    if (rc == 0 && ag_layout_count(&L, AG_SEC_OUT_USER) != j->nuser_out)
        rc = ag__err(AG_ENOTSUP, "joint_update: the graph returns %d user outputs; the joint's "
                                 "out_spec has %d", ag_layout_count(&L, AG_SEC_OUT_USER),
                     j->nuser_out);
    if (rc) {
        update_state_clear(&u, nt);
        ag_graph_free(g);
        return rc;
    }
    /* Nothing can fail from here: the joint takes the new state. */
    update_state old = {j->primal_descs, j->tangent_descs, {0}, j->in_info, j->params,
                        j->buffers, j->nprimals, j->nparams, j->nbuffers, j->nrng, NULL, j->alias};
    memcpy(old.rng_descs, j->rng_descs, sizeof old.rng_descs);
    if (u.in_spec) {
        old.in_spec = j->in_spec;
        j->in_spec = u.in_spec;
    }
    update_state_clear(&old, j->ntangents + j->nbw_tokens);
    j->primal_descs = u.primal_descs;
    j->tangent_descs = u.tangent_descs;
    memcpy(j->rng_descs, u.rng_descs, sizeof j->rng_descs);
    j->in_info = u.in_info;
    j->params = u.params;
    j->buffers = u.buffers;
    j->nprimals = u.nprimals;
    j->nparams = u.nparams;
    j->nbuffers = u.nbuffers;
    j->nrng = u.nrng;
    j->alias = u.alias;
    j->ntangents = ag_layout_count(&L, AG_SEC_IN_TANGENTS);
    j->nbw_tokens = ag_layout_count(&L, AG_SEC_IN_BW_TOKENS);
    j->rng_fw_out = ag_layout_count(&L, AG_SEC_OUT_FW_RNG_OFFSET) > 0;
    j->nmutated = ag_layout_count(&L, AG_SEC_OUT_MUTATIONS);
    j->needs_autograd = ag_layout_count(&L, AG_SEC_OUT_GRADS) > 0;
    j->npb_flat = j->subclass ? j->npb_flat : u.nparams + u.nbuffers;
    ag_graph_free(j->g);
    j->g = g;
    j->layout = L;
    return 0;
}

/* ---- building ---- */

/* Forward metadata onto backward nodes (upstream's copy_fwd_metadata_to_bw_nodes): the first
 * forward node of each seq_nr created the autograd node; backward nodes with that seq_nr (but
 * not gradient accumulations, whose seq_nr is not theirs) take its annotations, its module
 * stack as fwd_nn_module_stack and its stack trace, as anomaly mode gives backward nodes their
 * forward op's trace. */
static bool is_backward(const ag_node *n) {
    const char *tag = ag_node_partitioner_tag(n);
    return tag && !strcmp(tag, "is_backward");
}

static int copy_fwd_metadata(ag_graph *g) {
    int64_t lo = INT64_MAX, hi = -1;
    for (ag_node *n = ag_graph_first(g); n; n = ag_node_next(n)) {
        int64_t seq = ag_node_seq_nr(n);
        if (seq >= 0) {
            lo = seq < lo ? seq : lo;
            hi = seq > hi ? seq : hi;
        }
    }
    if (hi < 0)
        return 0;
    ag_node **first = ag__calloc((size_t)(hi - lo + 1), sizeof *first);
    if (!first)
        return AG_ENOMEM;
    for (ag_node *n = ag_graph_first(g); n; n = ag_node_next(n)) {
        int64_t seq = ag_node_seq_nr(n);
        if (seq >= 0 && !is_backward(n) && !first[seq - lo])
            first[seq - lo] = n;
    }
    int rc = 0;
    for (ag_node *n = ag_graph_first(g); n && rc == 0; n = ag_node_next(n)) {
        int64_t seq = ag_node_seq_nr(n);
        if (seq < 0 || !is_backward(n) || ag_node_is_gradient_acc(n) || !first[seq - lo])
            continue;
        ag_node *f = first[seq - lo];
        rc = ag_node_custom_copy(n, f);
        if (rc == 0) /* the text shared, not copied */
            rc = ag__node_meta_copy_key_as(n, "fwd_nn_module_stack", f, "nn_module_stack");
        if (rc == 0 && ag_node_stack_trace(f))
            rc = ag__node_meta_copy_key(n, f, "stack_trace"); /* the text shared, not copied */
    }
    ag__free(first);
    return rc;
}

static ag_treespec *flat_list_spec(int n, bool as_tuple) {
    ag_treespec **leaves = ag__calloc((size_t)(n ? n : 1), sizeof *leaves);
    if (!leaves)
        return NULL;
    ag_treespec *s = NULL;
    bool ok = true;
    for (int i = 0; i < n && ok; i++)
        ok = (leaves[i] = ag_treespec_leaf()) != NULL;
    if (ok)
        s = as_tuple ? ag_treespec_tuple(leaves, n) : ag_treespec_list(leaves, n);
    for (int i = 0; i < n; i++)
        ag_treespec_release(leaves[i]);
    ag__free(leaves);
    return s;
}

static ag_treespec *make_in_spec(int nlist, const char *const *kw, int nkw) {
    ag_treespec *list = flat_list_spec(nlist, false);
    ag_treespec **kv = ag__calloc((size_t)(nkw ? nkw : 1), sizeof *kv);
    ag_treespec *dict = NULL, *top = NULL;
    bool ok = list && kv;
    for (int i = 0; ok && i < nkw; i++)
        ok = (kv[i] = ag_treespec_leaf()) != NULL;
    if (ok)
        dict = ag_treespec_dict(kw, kv, nkw);
    if (dict) {
        ag_treespec *pair[2] = {list, dict};
        top = ag_treespec_tuple(pair, 2);
    }
    for (int i = 0; kv && i < nkw; i++)
        ag_treespec_release(kv[i]);
    ag__free(kv);
    ag_treespec_release(list);
    ag_treespec_release(dict);
    return top;
}

/* The forward's effect tokens (effects.c) are the first primals: their descriptors and input
 * facts go in front of the flat inputs'. */
static int prepend_forward_tokens(ag_joint *j) {
    int n = j->nfw_tokens;
    if (n == 0)
        return 0;
    memmove(j->primal_descs + n, j->primal_descs, sizeof *j->primal_descs * (size_t)j->nprimals);
    memmove(j->in_info + n, j->in_info, sizeof *j->in_info * (size_t)j->nprimals);
    j->nprimals += n;
    for (int i = 0; i < n; i++) {
        j->in_info[i] = (ag_input_info){0};
        if (!(j->primal_descs[i] = ag_desc_forward_token_input(i)))
            return AG_ENOMEM;
    }
    return 0;
}

/* With tensor subclasses: the facts the alias plan gathered on the inner tensors are the
 * outer tensors' (requires_grad is the instance's), and the aliasing the flattening cannot
 * express is refused with upstream's message. */
static int subclass_facts(const ag__subx *sx, ag_joint *j, ag_node *const *prim) {
    const ag__joint_alias *a = &j->alias;
    if (a->nintermediate_bases > 0 || a->nmetadata_mutations > 0)
        return ag__err(AG_ENOTSUP, "export: outputs aliasing intermediates and metadata "
                                   "mutations are not supported together with tensor subclasses");
    for (int p = 0; p < a->nprimals; p++) {
        const ag_tmeta *m = ag_node_val(prim[p], 0);
        j->in_info[p].requires_grad =
            ag__subx_flat_requires_grad(sx, a->prim[p].flat) && ag_dtype_is_float(m->dtype);
    }
    for (int k = 0; k < j->nuser_out; k++)
        j->out_info[k].requires_grad = ag__subx_out_requires_grad(sx, k);
    return 0;
}

/* The final layout with tensor subclasses: inputs merged into a base, or removed duplicates
 * among a subclass's inner tensors, are refused with upstream's message. */
static int subclass_layout_check(const ag__subx *sx, const ag_joint *j) {
    const ag__joint_alias *a = &j->alias;
    for (int i = 0; i < a->nflat; i++)
        if (a->flat[i].kind == AG__FLAT_VIEW ||
            (a->flat[i].kind == AG__FLAT_DUP && ag__subx_flat_is_inner(sx, i)))
            return ag__err(AG_ENOTSUP,
                           "Encountered aliased inputs that are mutated in the graph, but at "
                           "least one input/output to the graph is a tensor subclass. This is "
                           "not supported today. You can try to remove the aliasing yourself as "
                           "a workaround, or otherwise file an issue on github.");
    return 0;
}

/* One pass: the joint for the plan's current layout of the flat inputs (alias.c). */
typedef struct export_in {
    ag_module *m;
    ag__alias_plan *P;
    const ag_named_tensors *ps, *bs;
    ag_desc *const *descs; /* of the flat inputs */
    ag__subx **sxp;        /* tensor subclasses flattened (subclass.c); *sxp NULL when none */
    int nflat, nargs, nkwargs;
    const char *const *kwarg_names;
    const ag_export_opts *o;
} export_in;

static ag_joint *export_pass(const export_in *in) {
    const ag_named_tensors *ps = in->ps, *bs = in->bs;
    ag__alias_plan *P = in->P;
    ag_joint *j = ag__calloc(1, sizeof *j);
    ag__tracer *T = NULL;
    ag_node **prim = NULL;
    ag_tensor *outs[64] = {0}, *extra[64] = {0}, **user = NULL;
    ag_desc *extra_desc[64] = {0};
    ag_tensor **tangent_in = NULL, **needs_out = NULL, **grad_of = NULL, **grads = NULL;
    ag_node **out_nodes = NULL;
    ag_desc **out_descs = NULL;
    ag__export_tokens tk;
    ag__rng_fn *rng = NULL;
    int rc = 0, nouts = 0, nout_total = 0, nextra = 0;
    bool scoped = false, begun = false;
    ag__subx *sx = *in->sxp;
    if (!j)
        goto fail;
    j->nparams = ps->n;
    j->nbuffers = bs->n;
    j->params = ag__calloc((size_t)(ps->n ? ps->n : 1), sizeof(char *));
    j->buffers = ag__calloc((size_t)(bs->n ? bs->n : 1), sizeof(char *));
    if (!j->params || !j->buffers)
        goto fail;
    for (int i = 0; i < ps->n; i++)
        if (!(j->params[i] = ag__strdup(ps->names[i])))
            goto fail;
    for (int i = 0; i < bs->n; i++)
        if (!(j->buffers[i] = ag__strdup(bs->names[i])))
            goto fail;

    /* The primals' placeholders. */
    int np = ag__aplan_num_primals(P);
    j->nprimals = np;
    prim = ag__calloc((size_t)(np ? np : 1), sizeof *prim);
    j->primal_descs = ag__calloc((size_t)np + 1, sizeof(ag_desc *)); /* + a token */
    j->in_info = ag__calloc((size_t)np + 1, sizeof *j->in_info);
    j->g = ag_graph_new();
    if (!prim || !j->primal_descs || !j->in_info || !j->g)
        goto fail;
    for (int p = 0; p < np; p++) {
        ag_desc *d = ag_desc_retain(ag__aplan_primal_desc(P, p));
        j->primal_descs[p] = d;
        char name[32];
        snprintf(name, sizeof name, "primals_%d", p + 1);
        ag_tmeta mt;
        ag__tmeta_of(ag__aplan_primal_example(P, p), &mt);
        prim[p] = ag_graph_placeholder(j->g, name, &mt);
        if (!prim[p] || ag_node_set_desc(prim[p], d))
            goto fail;
    }
    j->in_spec = make_in_spec(ps->n + bs->n + in->nargs, in->kwarg_names, in->nkwargs);
    if (!j->in_spec)
        goto fail;

    /* The forward, functionalized, with autograd recording; effectful ops threaded by tokens. */
    T = ag__tracer_begin(j->g, true);
    if (!T)
        goto fail;
    ag__export_tokens_init(&tk, j->g, np);
    ag__tracer_set_token_chain(T, &tk.fw);
    /* Random ops draw from philox seed/offset placeholders (rng.c). */
    if (!in->o->keep_random_ops && !(rng = ag__rng_begin(T, j->g)))
        goto fail;
    ag_scope_begin();
    scoped = true;
    begun = true;
    if (ag__aplan_begin(P, in->m, T, prim, &user))
        goto fail;
    /* With tensor subclasses the plan's tensors are the inner ones: the forward gets the outer
     * inputs rebuilt from them. */
    if (sx && ag__subx_pass_begin(sx, in->m, user, &user))
        goto fail;
    nouts = ag_module_call(in->m, user, in->nargs + in->nkwargs, outs, 64);
    if (nouts < 0)
        goto fail;
    int nspec = nouts; /* the user's outputs; subclass instances are flattened from here on */
    /* (plain inputs with subclass outputs: the pass's flat tensors are the outer inputs) */
    nouts = ag__subx_outputs(in->sxp, outs, nouts, 64, ag__aplan_flat_tensors(P), in->descs,
                             in->nflat, ps->n + bs->n);
    if (nouts < 0)
        goto fail;
    sx = *in->sxp;
    j->nuser_out = nouts;
    j->out_info = ag__calloc((size_t)(nouts ? nouts : 1), sizeof *j->out_info);
    /* One output is a bare leaf; several are a tuple. */
    j->out_spec = nspec == 1 ? ag_treespec_leaf() : flat_list_spec(nspec, true);
    if (!j->out_info || !j->out_spec)
        goto fail;

    /* Mutated inputs and aliasing outputs (alias.c). */
    bool any_rg_in = false, any_rg_out = false;
    for (int p = 0; p < np && !sx; p++) {
        ag_tensor *t = ag__aplan_primal_tensor(P, p);
        any_rg_in |= t->requires_grad && ag_dtype_is_float(t->dtype);
    }
    for (int i = 0; sx && i < in->nflat; i++)
        any_rg_in |= ag__subx_flat_requires_grad(sx, i);
    if (ag__aplan_analyze(P, T, outs, nouts, any_rg_in, j->in_info, j->out_info, &j->alias))
        goto fail;
    if (sx && subclass_facts(sx, j, prim))
        goto fail;
    for (int p = 0; p < np; p++) {
        j->nmutated += j->in_info[p].mutates_data || j->in_info[p].mutates_metadata;
        if (j->in_info[p].mutates_data && j->in_info[p].requires_grad) {
            rc = ag__err(AG_ENOTSUP, "export: input %d (%s) requires grad and is mutated in "
                                     "place; mutating a parameter or input that requires "
                                     "grad is not supported", p, ag_node_name(prim[p]));
            goto fail;
        }
    }
    /* Outputs that alias inputs do not make the graph need autograd (upstream). */
    for (int k = 0; k < nouts; k++)
        any_rg_out |= j->out_info[k].requires_grad && j->out_info[k].alias != AG_OUT_IS_INPUT &&
                      j->out_info[k].alias != AG_OUT_ALIAS_OF_INPUT;
    j->needs_autograd = any_rg_in && any_rg_out;
    nextra = ag__aplan_extra_outputs(P, j->out_info, extra, extra_desc, 64);
    if (nextra < 0)
        goto fail;
    j->nmetamut = j->alias.nmetadata_mutations;
    j->ninter = j->alias.nintermediate_bases;

    /* Tangents: user outputs that require grad and alias nothing, then intermediate bases. */
    /* + 2 tokens, + 2 philox offsets */
    nout_total = 4 + j->nmutated + nouts + nextra + (j->needs_autograd ? (sx ? in->nflat : np) : 0);
    out_nodes = ag__calloc((size_t)(nout_total ? nout_total : 1), sizeof *out_nodes);
    out_descs = ag__calloc((size_t)(nout_total ? nout_total : 1), sizeof *out_descs);
    tangent_in = ag__calloc((size_t)(nouts + nextra ? nouts + nextra : 1), sizeof *tangent_in);
    needs_out = ag__calloc((size_t)(nouts + nextra ? nouts + nextra : 1), sizeof *needs_out);
    j->tangent_descs = ag__calloc((size_t)(nouts + nextra) + 1, sizeof(ag_desc *)); /* + a token */
    if (!out_nodes || !out_descs || !tangent_in || !needs_out || !j->tangent_descs)
        goto fail;
    int no = ag__export_tokens_outputs(&tk, false, out_nodes, out_descs);
    if (no < 0)
        goto fail;
    j->nfw_tokens = no;
    for (int p = 0; p < np; p++)
        if (j->in_info[p].mutates_data || j->in_info[p].mutates_metadata) {
            out_nodes[no] = ag__tracer_node_of(T, ag__aplan_primal_tensor(P, p));
            out_descs[no] = sx ? ag__subx_mutation_desc(sx, j->alias.prim[p].flat)
                               : ag_desc_input_mutation(j->primal_descs[p]);
            if (!out_nodes[no] || !out_descs[no++])
                goto fail;
        }
    for (int k = 0; k < nouts; k++) {
        out_nodes[no] = outs[k] ? ag__tracer_node_of(T, outs[k]) : NULL;
        if (outs[k] && !out_nodes[no])
            goto fail;
        if (!(out_descs[no++] = sx ? ag__subx_out_desc(sx, k) : ag_desc_plain_output(k)))
            goto fail;
    }
    for (int e = 0; e < nextra; e++) {
        out_nodes[no] = ag__tracer_node_of(T, extra[e]);
        out_descs[no++] = ag_desc_retain(extra_desc[e]);
        if (!out_nodes[no - 1])
            goto fail;
    }
    if (rng) { /* the forward's updated philox offset, after the user outputs */
        int r = ag__rng_updated_offset(rng, false, &out_nodes[no], &out_descs[no]);
        if (r < 0)
            goto fail;
        j->rng_fw_out = r == 1;
        no += r;
    }
    if (j->needs_autograd) {
        /* Everything traced so far is forward; tangents and what follows is backward. */
        for (ag_node *n = ag_graph_first(j->g); n; n = ag_node_next(n))
            if (ag_node_set_partitioner_tag(n, "is_forward"))
                goto fail;
        if (sx) {
            /* Tangents and gradients of the outer tensors, flattened (subclass.c). */
            ag__tracer_set_tag(T, "is_backward");
            ag__tracer_set_stack_traces(T, false);
            ag__tracer_set_token_chain(T, &tk.bw);
            if (rng)
                ag__rng_mark_backward(rng);
            if (ag__subx_backward(sx, j->g, T, j->out_info, out_nodes, out_descs, &no,
                                  j->tangent_descs, &j->ntangents))
                goto fail;
        } else {
            int nt = 0;
            for (int k = 0; k < nouts + j->ninter; k++) {
                ag_tensor *out_k;
                ag_desc *od;
                if (k < nouts) {
                    const ag_output_info *oi = &j->out_info[k];
                    if (!oi->requires_grad || !ag_dtype_is_float(outs[k]->dtype) ||
                        (oi->alias != AG_OUT_NON_ALIAS && oi->alias != AG_OUT_UNSAFE_VIEW_ALIAS))
                        continue;
                    out_k = outs[k];
                    od = out_descs[j->nfw_tokens + j->nmutated + k];
                } else { /* intermediate bases always take part in the backward */
                    out_k = extra[j->nmetamut + k - nouts];
                    od = out_descs[j->nfw_tokens + j->nmutated + nouts + j->nmetamut + k - nouts];
                }
                ag_desc *td = ag_desc_tangent(od);
                if (!td)
                    goto fail;
                j->tangent_descs[nt] = td;
                j->ntangents = nt + 1; /* ag_joint_free releases it from now on */
                char name[32];
                snprintf(name, sizeof name, "tangents_%d", nt + 1);
                ag_tmeta mt;
                ag__tmeta_contiguous(&mt, out_k->dtype, out_k->ndim, out_k->sizes);
                ag_node *tp = ag_graph_placeholder(j->g, name, &mt);
                if (!tp || ag_node_set_desc(tp, td) || ag_node_set_partitioner_tag(tp, "is_backward"))
                    goto fail;
                ag_tensor *tt = ag__tensor_new(out_k->dtype, out_k->ndim, out_k->sizes, true);
                if (!tt)
                    goto fail;
                ag__tracer_bind(T, tt, tp);
                tangent_in[nt] = ag__give(tt);
                needs_out[nt++] = out_k;
                if (!tangent_in[nt - 1])
                    goto fail;
            }
            j->ntangents = nt;
            /* The backward: the engine runs the op table's backward rules, traced here. */
            grad_of = ag__calloc((size_t)(np ? np : 1), sizeof *grad_of);
            grads = ag__calloc((size_t)(np ? np : 1), sizeof *grads);
            if (!grad_of || !grads)
                goto fail;
            int ng = 0;
            for (int p = 0; p < np; p++)
                if (j->in_info[p].requires_grad)
                    grad_of[ng++] = ag__aplan_primal_tensor(P, p);
            ag__tracer_set_tag(T, "is_backward");
            ag__tracer_set_stack_traces(T, false);
            ag__tracer_set_token_chain(T, &tk.bw);
            if (rng)
                ag__rng_mark_backward(rng);
            if (ng > 0 && nt > 0 && ag_grad(needs_out, tangent_in, nt, grad_of, ng, grads, false, true))
                goto fail;
            int gi = 0;
            for (int p = 0; p < np; p++) {
                ag_node *gn = NULL;
                ag_desc *gd = NULL;
                if (j->in_info[p].requires_grad) {
                    ag_tensor *gt = grads[gi++];
                    if (gt) {
                        gn = ag__tracer_node_of(T, gt);
                        if (!gn)
                            goto fail;
                        if (!(gd = ag_desc_grad(j->primal_descs[p])))
                            goto fail;
                    }
                }
                out_nodes[no] = gn;
                out_descs[no++] = gd;
            }
        }
        if (rng) { /* the backward's updated philox offset, after the grads */
            int r = ag__rng_updated_offset(rng, true, &out_nodes[no], &out_descs[no]);
            if (r < 0)
                goto fail;
            no += r;
        }
        int nb = ag__export_tokens_outputs(&tk, true, out_nodes + no, out_descs + no);
        if (nb < 0)
            goto fail;
        j->nbw_tokens = nb;
        no += nb;
        for (int k = 0; k < nb; k++)
            if (!(j->tangent_descs[j->ntangents + k] = ag_desc_backward_token_input(k)))
                goto fail;
    }
    if (rng && (j->nrng = ag__rng_finish(rng, j->rng_descs)) < 0) {
        j->nrng = 0;
        goto fail;
    }
    j->npb_flat = sx ? ag__subx_num_static(sx) : ps->n + bs->n;
    if (ag__subx_finish(sx, &j->subclass))
        goto fail;
    if (sx)
        ag__subx_pass_end(sx, in->m);
    ag__aplan_end(P, in->m);
    begun = false;
    ag__tracer_end(T);
    T = NULL;
    if (prepend_forward_tokens(j))
        goto fail;
    if (!ag_graph_output(j->g, out_nodes, no) ||
        ag_node_set_output_descs(ag_graph_output_node(j->g), out_descs, no))
        goto fail;
    if (j->needs_autograd && copy_fwd_metadata(j->g))
        goto fail;
    /* Inference with keep_inference_input_mutations: data mutations stay in the graph. */
    if (!j->needs_autograd && in->o->keep_inference_input_mutations &&
        ag__keep_input_mutations_in_graph(j->g, j->in_info, j->nprimals) < 0)
        goto fail;
    if (ag_graph_layout(j->g, 0, &j->layout))
        goto fail;
    if (ag_graph_dce(j->g) < 0)
        goto fail;
    if (in->o->decompositions) {
        if (ag_graph_decompose(j->g, in->o->decompositions) < 0 || ag_graph_dce(j->g) < 0)
            goto fail;
    }
    ag_scope_end();
    scoped = false;
    goto done;

fail:
    if (rc == 0)
        rc = ag_last_status() ? ag_last_status() : ag__err(AG_EINVAL, "export: failed");
    if (begun && sx)
        ag__subx_pass_end(sx, in->m);
    if (begun)
        ag__aplan_end(P, in->m);
    if (T)
        ag__tracer_end(T);
    if (scoped)
        ag_scope_end();
    ag_joint_free(j);
    j = NULL;
done:
    for (int i = 0; out_descs && i < nout_total; i++)
        ag_desc_release(out_descs[i]);
    for (int e = 0; e < 64; e++)
        ag_desc_release(extra_desc[e]);
    ag__free(out_descs);
    ag__free(out_nodes);
    ag__free(tangent_in);
    ag__free(needs_out);
    ag__free(grad_of);
    ag__free(grads);
    ag__free(prim);
    ag__rng_free(rng);
    if (ag__subx_pass_owned(sx)) { /* made for this pass's subclass outputs */
        ag__subx_free(sx);
        *in->sxp = NULL;
    }
    return j;
}

ag_joint *ag_export_joint(ag_module *m, ag_tensor *const *args, int nargs,
                          const char *const *kwarg_names, ag_tensor *const *kwargs, int nkwargs,
                          const ag_export_opts *opts) {
    AG__CHECK_NULL_RET("export_joint", m, NULL);
    if (nargs > 0)
        AG__CHECK_NULL_RET("export_joint", args, NULL);
    if (nkwargs > 0) {
        AG__CHECK_NULL_RET("export_joint", kwarg_names, NULL);
        AG__CHECK_NULL_RET("export_joint", kwargs, NULL);
    }
    for (int i = 0; i < nargs; i++)
        if (!args[i])
            return ag__err(AG_EINVAL, "export_joint: argument %d is NULL", i), NULL;
    for (int i = 0; i < nkwargs; i++)
        if (!kwargs[i] || !kwarg_names[i])
            return ag__err(AG_EINVAL, "export_joint: keyword argument %d is NULL or unnamed", i),
                   NULL;
    ag_export_opts o = {0};
    if (opts)
        o = *opts;
    ag_named_tensors ps = {0}, bs = {0};
    ag_joint *j = NULL;
    ag_tensor **flat = NULL;
    ag_desc **descs = NULL;
    char **fqns = NULL;
    ag__alias_plan *P = NULL;
    ag__subx *sx = NULL;
    int nflat = 0, nouter = 0, npb = 0;
    bool grad_prev = ag_set_grad_enabled(true);
    if (ag_module_named_parameters(m, false, &ps) || ag_module_named_buffers(m, false, &bs))
        goto done;
    /* The flat inputs and their descriptors. */
    nflat = ps.n + bs.n + nargs + nkwargs;
    flat = ag__calloc((size_t)(nflat ? nflat : 1), sizeof *flat);
    descs = ag__calloc((size_t)(nflat ? nflat : 1), sizeof *descs);
    fqns = ag__calloc((size_t)(ps.n + bs.n ? ps.n + bs.n : 1), sizeof *fqns);
    if (!flat || !descs || !fqns)
        goto done;
    for (int i = 0; i < nflat; i++) {
        if (i < ps.n) {
            flat[i] = ps.tensors[i];
            descs[i] = ag_desc_param(ps.names[i]);
            fqns[i] = ps.names[i];
        } else if (i < ps.n + bs.n) {
            flat[i] = bs.tensors[i - ps.n];
            descs[i] = ag_desc_buffer(bs.names[i - ps.n]);
            fqns[i] = bs.names[i - ps.n];
        } else if (i < ps.n + bs.n + nargs) {
            flat[i] = args[i - ps.n - bs.n];
            descs[i] = ag_desc_plain_input(i - ps.n - bs.n);
        } else {
            flat[i] = kwargs[i - ps.n - bs.n - nargs];
            descs[i] = ag_desc_plain_input(i - ps.n - bs.n);
        }
        if (!descs[i])
            goto done;
    }
    nouter = nflat;
    npb = ps.n + bs.n;
    /* Tensor subclass instances are flattened into their inner tensors, which the alias plan
     * then lays out like any flat input (all of them fresh leaves: the forward sees instances
     * rebuilt from them, subclass.c). */
    if (ag__subx_begin(&sx, &ps, &bs, args, nargs, kwargs, nkwargs))
        goto done;
    if (sx) {
        for (int i = 0; i < nouter; i++)
            ag_desc_release(descs[i]);
        ag__free(descs);
        ag__free(flat);
        nflat = 0;
        int n = ag__subx_num_flat(sx);
        flat = ag__calloc((size_t)(n ? n : 1), sizeof *flat);
        descs = ag__calloc((size_t)(n ? n : 1), sizeof *descs);
        if (!flat || !descs)
            goto done;
        for (nflat = 0; nflat < n; nflat++)
            flat[nflat] = ag__subx_flat(sx, nflat, &descs[nflat]);
        npb = 0;
    }
    /* Upstream's stage-1 wrappers decide which flat inputs become which primals from what
     * the forward does to them: a first pass assumes the common case, and a second one runs
     * only when a duplicate input is mutated or aliasing inputs turned out not to need (or to
     * need) a shared base. */
    P = ag__aplan_new(flat, descs, nflat, npb ? ps.n : 0, npb ? bs.n : 0, fqns);
    if (!P)
        goto done;
    export_in in = {m, P, &ps, &bs, descs, &sx, nflat, nargs, nkwargs, kwarg_names, &o};
    j = export_pass(&in);
    int r = j ? ag__aplan_refine(P, j->in_info + j->nfw_tokens, j->needs_autograd) : 0;
    if (r != 0) {
        ag_joint_free(j);
        j = r > 0 ? export_pass(&in) : NULL;
        if (j && (r = ag__aplan_refine(P, j->in_info + j->nfw_tokens, j->needs_autograd)) != 0) {
            ag_joint_free(j);
            j = NULL;
            if (r > 0)
                ag__err(AG_EINVAL, "export: the inputs' layout did not settle after two passes");
        }
    }
    if (j && sx && subclass_layout_check(sx, j)) {
        ag_joint_free(j);
        j = NULL;
    }
done:
    if (!j && !ag_last_status())
        ag__err(AG_EINVAL, "export: failed");
    ag_set_grad_enabled(grad_prev);
    ag__aplan_free(P);
    ag__subx_free(sx);
    for (int i = 0; descs && i < nflat; i++)
        ag_desc_release(descs[i]);
    ag__free(descs);
    ag__free(flat);
    ag__free(fqns);
    ag_named_tensors_free(&ps);
    ag_named_tensors_free(&bs);
    return j;
}

/* ---- aliasing facts ---- */

const ag__joint_alias *ag__joint_alias_of(const ag_joint *j) { return &j->alias; }
int ag_joint_num_metadata_mutations(const ag_joint *j) { return count(j, AG_SEC_OUT_METADATA_MUTATIONS); }
int ag_joint_num_intermediate_bases(const ag_joint *j) { return count(j, AG_SEC_OUT_INTERMEDIATE_BASES); }
int ag_joint_num_flat_inputs(const ag_joint *j) { return j ? j->alias.nflat : 0; }
int ag_joint_flat_input_primal(const ag_joint *j, int flat) {
    if (!j)
        return -1;
    if (flat < 0 || flat >= j->alias.nflat || j->alias.flat[flat].primal < 0)
        return -1;
    return j->nfw_tokens + j->alias.flat[flat].primal;
}

int ag_joint_primals_from_flat(const ag_joint *j, ag_tensor *const *flat, int nflat,
                               ag_tensor **primals, int max) {
    AG__CHECK_NULL("joint_primals_from_flat", j);
    if (nflat > 0)
        AG__CHECK_NULL("joint_primals_from_flat", flat);
    if (max > 0)
        AG__CHECK_NULL("joint_primals_from_flat", primals);
    const ag__joint_alias *a = &j->alias;
    if (nflat != a->nflat)
        return ag__err(AG_EINVAL, "joint_primals_from_flat: %d inputs given, the joint takes %d",
                       nflat, a->nflat);
    if (max < j->nprimals)
        return ag__err(AG_EINVAL, "joint_primals_from_flat: room for %d primals, %d needed", max,
                       j->nprimals);
    ag_tmeta *pm = ag__calloc((size_t)(j->nprimals ? j->nprimals : 1), sizeof *pm);
    ag_tensor **owned = ag__calloc((size_t)(j->nprimals ? j->nprimals : 1), sizeof *owned);
    ag_node **ph;
    int nowned = 0, rc = pm && owned ? 0 : AG_ENOMEM;
    if (rc == 0 && ag_graph_placeholders(j->g, &ph) < 0)
        rc = ag_last_status();
    for (int p = 0; rc == 0 && p < j->nprimals; p++)
        pm[p] = *ag_node_val(ph[p], 0);
    /* Effect tokens first: empty tensors, as upstream's EffectTokensWrapper feeds. */
    int ntok = j->nfw_tokens;
    for (int p = 0; rc == 0 && p < ntok; p++) {
        ag_scope_begin();
        primals[p] = ag_tensor_keep(ag_empty(AG_F32, 1, (int64_t[]){0}));
        ag_scope_end();
        if (!primals[p])
            rc = ag_last_status();
        else
            owned[nowned++] = primals[p];
    }
    if (rc == 0) {
        int nrt = 0;
        rc = ag__rt_primals(a, pm + ntok, flat, nflat, primals + ntok, owned + nowned, &nrt);
        nowned += nrt;
    }
    for (int p = 0; rc == 0 && p < j->nprimals; p++) {
        bool own = false;
        for (int k = 0; k < nowned; k++)
            own |= owned[k] == primals[p];
        if (!own)
            ag_tensor_keep(primals[p]);
    }
    if (rc)
        for (int k = 0; k < nowned; k++)
            ag_tensor_free(owned[k]);
    ag__free(pm);
    ag__free(owned);
    return rc ? rc : j->nprimals;
}
