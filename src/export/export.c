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
 * decomposition table applied.
 *
 * That is the core of the pass. Every cross-cutting feature (dedupe and synthetic bases, effect
 * tokens, subclasses, RNG functionalization, input mutations, aliasing outputs) is a wrapper
 * around it, one object of hooks in its feature's file, run from the list `wrappers[]` below
 * (export_wrappers.h says when each hook runs and what it may change). */
#include "../graph/graph_internal.h"
#include "aotgrad/export.h"
#include "export_wrappers.h"
#include "joint_internal.h"

#include <assert.h>
#include <stddef.h>
#include <stdio.h>

/* ---- accessors ---- */

ag_graph *ag_joint_graph(const ag_joint *j) {
    return j ? j->g : NULL;
}
int ag_joint_num_params(const ag_joint *j) {
    return j ? j->nparams : 0;
}
const char *ag_joint_param_fqn(const ag_joint *j, int i) {
    if (!j)
        return NULL;
    return i >= 0 && i < j->nparams ? j->params[i] : NULL;
}
int ag_joint_num_buffers(const ag_joint *j) {
    return j ? j->nbuffers : 0;
}
const char *ag_joint_buffer_fqn(const ag_joint *j, int i) {
    if (!j)
        return NULL;
    return i >= 0 && i < j->nbuffers ? j->buffers[i] : NULL;
}
const ag_treespec *ag_joint_in_spec(const ag_joint *j) {
    return j ? j->in_spec : NULL;
}
const ag_treespec *ag_joint_out_spec(const ag_joint *j) {
    return j ? j->out_spec : NULL;
}
/* Static inputs: the primals of parameters and buffers that are primals of their own (not
 * merged into a base, not removed as duplicates), in primal order, after the effect tokens. A
 * flat input is a parameter's or buffer's by its descriptor (ParamAOTInput, BufferAOTInput, or
 * an inner tensor of one: SubclassGetAttrAOTInput asks its base), as upstream's
 * _try_get_metadata_from_dynamo picks them. */
static int static_inputs(const ag_joint *j, int want) {
    int n = 0, ntok = ag__joint_ntok(j);
    for (int p = 0; p < j->nprimals - ntok; p++) {
        bool is_static = false;
        for (int i = 0; i < j->alias.nflat && !is_static; i++)
            is_static = j->alias.flat[i].kind == AG__FLAT_PRIMAL && j->alias.flat[i].primal == p &&
                        (ag_desc_is_param(j->flat_descs[i]) || ag_desc_is_buffer(j->flat_descs[i]));
        if (is_static && n++ == want)
            return ntok + p;
    }
    return want < 0 ? n : -1;
}
int ag_joint_num_static_inputs(const ag_joint *j) {
    return j ? static_inputs(j, -1) : 0;
}
ag__subx_info *ag__joint_subclass_info(const ag_joint *j) {
    return j->subclass;
}
int ag_joint_static_input(const ag_joint *j, int i) {
    if (!j)
        return -1;
    return i >= 0 ? static_inputs(j, i) : -1;
}
static int count(const ag_joint *j, ag_section s) {
    return j ? j->layout.sec[s].count : 0;
}
const ag_layout *ag_joint_layout(const ag_joint *j) {
    return j ? &j->layout : NULL;
}
int ag_joint_num_primals(const ag_joint *j) {
    return count(j, AG_SEC_IN_FW_TOKENS) + count(j, AG_SEC_IN_PRIMALS);
}
int ag_joint_num_tangents(const ag_joint *j) {
    return count(j, AG_SEC_IN_TANGENTS);
}
const ag_input_info *ag_joint_input_info(const ag_joint *j, int i) {
    if (!j)
        return NULL;
    return i >= 0 && i < j->nprimals ? &j->in_info[i] : NULL;
}
int ag_joint_num_user_outputs(const ag_joint *j) {
    return count(j, AG_SEC_OUT_USER);
}
const ag_output_info *ag_joint_output_info(const ag_joint *j, int i) {
    if (!j)
        return NULL;
    return i >= 0 && i < j->nuser_out ? &j->out_info[i] : NULL;
}
int ag_joint_num_mutated_inputs(const ag_joint *j) {
    return count(j, AG_SEC_OUT_MUTATIONS);
}
int ag_joint_num_fw_outputs(const ag_joint *j) {
    return j ? ag_layout_num_fw_outputs(&j->layout) : 0;
}
int ag_joint_num_forward_tokens(const ag_joint *j) {
    return count(j, AG_SEC_IN_FW_TOKENS);
}
int ag_joint_num_backward_tokens(const ag_joint *j) {
    return count(j, AG_SEC_IN_BW_TOKENS);
}
bool ag_joint_needs_autograd(const ag_joint *j) {
    return j ? j->needs_autograd : false;
}

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
    ag__joint_flat_descs_free(j->flat_descs, j->alias.nflat); /* (before the count goes) */
    ag__joint_alias_clear(&j->alias);
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
    /* The placeholders must carry the current graph's descriptors, in its order. */
    ag_node **cur;
    int ncur = ag_graph_placeholders(j->g, &cur);
    if (ncur >= 0 && nph != ncur)
        rc = ag__err(AG_EINVAL,
                     "joint_set_graph: the graph has %d placeholders; the calling "
                     "convention has %d (%d primals, %d tangents, %d philox seeds and "
                     "offsets); ag_joint_update takes a changed convention",
                     nph, ncur, ag_joint_num_primals(j), ag_joint_num_tangents(j),
                     count(j, AG_SEC_IN_FW_RNG) + count(j, AG_SEC_IN_BW_RNG));
    for (int i = 0; rc == 0 && i < nph; i++) {
        ag_desc *d = ag_node_desc(ph[i]);
        ag_desc *want = ag_node_desc(cur[i]);
        char a[256], b[256];
        if (!d)
            rc = ag__err(AG_EINVAL, "joint_set_graph: placeholder %s has no descriptor",
                         ag_node_name(ph[i]));
        else if (!ag_desc_equal(d, want)) {
            ag_desc_repr(d, a, sizeof a);
            ag_desc_repr(want, b, sizeof b);
            rc = ag__err(AG_EINVAL,
                         "joint_set_graph: placeholder %d (%s) is %s; the calling "
                         "convention expects %s there",
                         i, ag_node_name(ph[i]), a, b);
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
    ag_desc **primal_descs; /* borrowed from the new graph's placeholders */
    ag_input_info *in_info;
    char **params, **buffers;
    int nprimals, nparams, nbuffers;
    ag_treespec *in_spec;
    ag__joint_alias alias;
    ag_desc **flat_descs; /* nflat_descs references (alias.nflat once complete) */
    int nflat_descs;
} update_state;

static void update_state_clear(update_state *u) {
    for (int i = 0; u->params && i < u->nparams; i++)
        ag__free(u->params[i]);
    for (int i = 0; u->buffers && i < u->nbuffers; i++)
        ag__free(u->buffers[i]);
    ag__free(u->primal_descs);
    ag__free(u->in_info);
    ag__free(u->params);
    ag__free(u->buffers);
    ag_treespec_release(u->in_spec);
    ag__joint_flat_descs_free(u->flat_descs, u->nflat_descs);
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
    ag_node **oph; /* the current graph's: the export's primals */
    ag_graph_placeholders(j->g, &oph);
    bool same = np == j->nprimals;
    for (int i = 0; i < np; i++) {
        ag_desc *d = ag_node_desc(ph[i]);
        u->primal_descs[i] = d;
        same = same && ag_desc_equal(d, ag_node_desc(oph[i]));
    }
    bool plain_alias = !j->subclass;
    for (int f = 0; f < j->alias.nflat; f++)
        plain_alias = plain_alias && j->alias.flat[f].kind == AG__FLAT_PRIMAL &&
                      j->alias.prim[j->alias.flat[f].primal].base == AG__BASE_NONE;
    if (!same && !plain_alias)
        return ag__err(AG_ENOTSUP,
                       "joint_update: the joint's flat inputs are %s; a transform "
                       "may not add or drop its inputs",
                       j->subclass ? "tensor subclasses flattened"
                                   : "deduplicated or merged into bases");
    for (int i = 0; i < np; i++) {
        const ag_desc *d = u->primal_descs[i];
        int old = -1;
        for (int k = 0; k < j->nprimals && old < 0; k++)
            old = ag_desc_equal(d, ag_node_desc(oph[k])) ? k : -1;
        if (old >= 0) {
            u->in_info[i] = j->in_info[old];
        } else {
            ag_desc_kind kd = ag_desc_kind_of(d);
            if (kd != AG_DESC_PARAM && kd != AG_DESC_BUFFER && kd != AG_DESC_PLAIN_INPUT) {
                char r[256];
                ag_desc_repr(d, r, sizeof r);
                return ag__err(AG_ENOTSUP,
                               "joint_update: new input %s (%s): a transform may "
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
            return ag__err(AG_EINVAL,
                           "joint_update: input %s is mutated but input mutation "
                           "output %d is not its",
                           ag_node_name(ph[i]), k);
        k++;
    }
    /* The same flat inputs keep their descriptors; added or dropped inputs make the flat
     * inputs the primals, in order, described as their placeholders are. */
    int nf = same ? j->alias.nflat : pr->count;
    if (!(u->flat_descs = ag__calloc((size_t)nf + 1, sizeof *u->flat_descs)))
        return AG_ENOMEM;
    u->nflat_descs = nf;
    for (int f = 0; f < nf; f++)
        u->flat_descs[f] = ag_desc_retain(same ? j->flat_descs[f] : u->primal_descs[pr->start + f]);
    if (same)
        return ag__joint_alias_copy(&u->alias, &j->alias);
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
        a->flat[f] = (ag__flat_info){
            .kind = AG__FLAT_PRIMAL, .primal = f, .dup_of = -1, .metadata_mutation = -1};
        a->prim[f] = (ag__primal_info){.base = AG__BASE_NONE, .flat = f};
    }
    /* in_spec: the flat inputs, keyword arguments as at export when the plain inputs are. */
    const ag_treespec *kw = ag_treespec_child(j->in_spec, 1);
    int nkw = ag_treespec_num_children(kw), nplain_old = 0, nplain = 0;
    for (int k = 0; k < j->nprimals; k++)
        nplain_old += ag_desc_kind_of(ag_node_desc(oph[k])) == AG_DESC_PLAIN_INPUT;
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
    if (rc == 0 && ag_layout_count(&L, AG_SEC_IN_FW_TOKENS) != ag__joint_ntok(j))
        rc = ag__err(AG_ENOTSUP, "joint_update: a transform may not add or drop effect tokens");
    if (rc == 0)
        rc = update_primals(j, g, &L, &u);
    if (rc == 0 && ag_layout_count(&L, AG_SEC_OUT_USER) != j->nuser_out)
        rc = ag__err(AG_ENOTSUP,
                     "joint_update: the graph returns %d user outputs; the joint's "
                     "out_spec has %d",
                     ag_layout_count(&L, AG_SEC_OUT_USER), j->nuser_out);
    if (rc) {
        update_state_clear(&u);
        ag_graph_free(g);
        return rc;
    }
    /* Nothing can fail from here: the joint takes the new state (the counts and descriptors of
     * tangents, tokens and philox inputs are the new graph's layout). */
    update_state old = {NULL,        j->in_info,    j->params,     j->buffers,
                        j->nprimals, j->nparams,    j->nbuffers,   NULL,
                        j->alias,    j->flat_descs, j->alias.nflat};
    if (u.in_spec) {
        old.in_spec = j->in_spec;
        j->in_spec = u.in_spec;
    }
    update_state_clear(&old);
    j->in_info = u.in_info;
    j->params = u.params;
    j->buffers = u.buffers;
    j->nprimals = u.nprimals;
    j->nparams = u.nparams;
    j->nbuffers = u.nbuffers;
    j->alias = u.alias;
    j->flat_descs = u.flat_descs;
    ag__free(u.primal_descs); /* (borrowed descriptors) */
    j->needs_autograd = ag_layout_count(&L, AG_SEC_OUT_GRADS) > 0;
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
    size_t span = (size_t)(hi - lo + 1);
    ag_node **first = ag__calloc(2 * span, sizeof *first);
    if (!first)
        return AG_ENOMEM;
    ag_node **first_gi = first + span; /* the first forward getitem of each seq_nr */
    for (ag_node *n = ag_graph_first(g); n; n = ag_node_next(n)) {
        int64_t seq = ag_node_seq_nr(n);
        if (seq >= 0 && !is_backward(n) && !first[seq - lo])
            first[seq - lo] = n;
        if (seq >= 0 && !is_backward(n) && ag_node_kind_of(n) == AG_NODE_GETITEM &&
            !first_gi[seq - lo])
            first_gi[seq - lo] = n;
    }
    int rc = 0;
    for (ag_node *n = ag_graph_first(g); n && rc == 0; n = ag_node_next(n)) {
        int64_t seq = ag_node_seq_nr(n);
        if (seq < 0 || !is_backward(n) || ag_node_is_gradient_acc(n) || !first[seq - lo])
            continue;
        /* A backward getitem takes the forward getitem's (an invoke_subgraph's call_id is
         * the call's own, not its outputs'). */
        ag_node *f = ag_node_kind_of(n) == AG_NODE_GETITEM && first_gi[seq - lo]
                         ? first_gi[seq - lo]
                         : first[seq - lo];
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

/* ---- the pass: the core and the wrappers around it (export_wrappers.h) ---- */

/* Upstream's order, outermost first (spec 6.2-6.3): stage-1 dedupe and synthetic bases, effect
 * tokens, subclasses, RNG functionalization, and the traced function's own extra outputs. */
/* The wrappers, each in its feature's file. */
extern const ag__export_wrapper ag__dedupe_synthetic_base_wrapper, ag__effect_tokens_wrapper,
    ag__subclass_wrapper, ag__rng_wrapper, ag__input_mutations_wrapper,
    ag__aliasing_outputs_wrapper;

static const ag__export_wrapper *const wrappers[] = {
    &ag__dedupe_synthetic_base_wrapper,
    &ag__effect_tokens_wrapper,
    &ag__subclass_wrapper,
    &ag__rng_wrapper,
    &ag__input_mutations_wrapper,
    &ag__aliasing_outputs_wrapper,
};
enum { NWRAPPERS = (int)(sizeof wrappers / sizeof wrappers[0]) };
_Static_assert(NWRAPPERS <= AG__EXPORT_MAX_WRAPPERS, "export: too many wrappers");

typedef enum { H_PREPARE, H_BEGIN, H_FORWARD_DONE, H_FACTS, H_BACKWARD, H_FINISH } hook_id;

static int status_or(int fallback) {
    return ag_last_status() < 0 ? ag_last_status() : fallback;
}

/* Runs one kind of hook over the list: prepare innermost first, the others outermost first. */
static int run_hooks(ag__export_pass *st, hook_id h) {
    for (int k = 0; k < NWRAPPERS; k++) {
        int i = h == H_PREPARE ? NWRAPPERS - 1 - k : k;
        const ag__export_wrapper *w = wrappers[i];
        ag__export_hook f = h == H_PREPARE        ? w->prepare
                            : h == H_BEGIN        ? w->begin
                            : h == H_FORWARD_DONE ? w->forward_done
                            : h == H_FACTS        ? w->facts
                            : h == H_BACKWARD     ? w->backward
                                                  : w->finish;
        int rc = f ? f(st, &st->self[i]) : 0;
        if (rc)
            return rc < 0 ? rc : ag__err(AG_ESTATE, "export: wrapper %s: status %d", w->name, rc);
    }
    return 0;
}

/* The outputs of sections from..to: the core's user outputs, then each wrapper's, innermost
 * first. A user output that requires grad and aliases nothing gets a tangent (6.1(b)). */
static int add_outputs(ag__export_pass *st, ag_section from, ag_section to) {
    for (int s = from; s <= to; s++) {
        for (int k = 0; s == AG_SEC_OUT_USER && k < st->nouts; k++) {
            ag_tensor *o = st->outs[k];
            const ag_output_info *oi = &st->out_info[k];
            ag_node *n = o ? ag__tracer_node_of(st->T, o) : NULL;
            ag_desc *d = o && !n ? NULL : ag_desc_plain_output(k);
            bool tangent = o && oi->requires_grad && ag_dtype_is_float(o->dtype) &&
                           (oi->alias == AG_OUT_NON_ALIAS || oi->alias == AG_OUT_UNSAFE_VIEW_ALIAS);
            if (!d || ag__export_out(st, AG_SEC_OUT_USER, n, d, tangent ? o : NULL))
                return status_or(AG_ENOMEM);
        }
        for (int i = NWRAPPERS - 1; i >= 0; i--) {
            int rc = wrappers[i]->outputs ? wrappers[i]->outputs(st, &st->self[i], s) : 0;
            if (rc)
                return rc;
        }
    }
    return 0;
}

/* The joint: its names and input spec, the graph, the tracer, the scope of the pass. */
static ag_joint *pass_start(ag__export_pass *st) {
    const ag_named_tensors *ps = st->ps, *bs = st->bs;
    ag_joint *j = ag__calloc(1, sizeof *j);
    if (!j)
        return NULL;
    j->nparams = ps->n;
    j->nbuffers = bs->n;
    j->params = ag__calloc((size_t)(ps->n ? ps->n : 1), sizeof(char *));
    j->buffers = ag__calloc((size_t)(bs->n ? bs->n : 1), sizeof(char *));
    bool ok = j->params && j->buffers;
    for (int i = 0; ok && i < ps->n; i++)
        ok = (j->params[i] = ag__strdup(ps->names[i])) != NULL;
    for (int i = 0; ok && i < bs->n; i++)
        ok = (j->buffers[i] = ag__strdup(bs->names[i])) != NULL;
    ok = ok && (j->g = st->g = ag_graph_new()) != NULL;
    ok = ok && (j->in_spec =
                    make_in_spec(ps->n + bs->n + st->nargs, st->kwarg_names, st->nkwargs)) != NULL;
    ok = ok && (st->T = ag__tracer_begin(j->g, true)) != NULL;
    if (ok)
        ag__tracer_set_joint(st->T, true);
    if (!ok) {
        ag_joint_free(j); /* and the graph */
        st->g = NULL;
        return NULL;
    }
    ag_scope_begin();
    return j;
}

/* The forward, functionalized, with autograd recording; then what it did (the wrappers'
 * facts) and whether the joint needs a backward: outputs that alias inputs do not make it
 * need one (upstream). */
static int trace_forward(ag__export_pass *st, ag_joint *j) {
    int n = ag_module_call(st->m, st->user, st->nargs + st->nkwargs, st->outs, AG__EXPORT_MAX_OUTS);
    if (n < 0) {
        /* The forward's own message (a custom module's ag_set_error, a failed op), said as the
         * export's. */
        char why[1024];
        snprintf(why, sizeof why, "%s", ag__has_error() ? ag_last_error() : "");
        return ag__err(n, "export: forward of %s failed: %s", ag_module_type(st->m),
                       why[0] ? why : "(no message)");
    }
    st->nouts = st->nspec = n;
    for (int p = 0; p < st->np; p++)
        st->any_rg_in |=
            st->primal_t[p]->requires_grad && ag_dtype_is_float(st->primal_t[p]->dtype);
    int rc = run_hooks(st, H_FORWARD_DONE);
    if (rc)
        return rc;
    st->out_info = ag__calloc((size_t)(st->nouts ? st->nouts : 1), sizeof *st->out_info);
    /* One output is a bare leaf; several are a tuple. */
    j->out_spec = st->nspec == 1 ? ag_treespec_leaf() : flat_list_spec(st->nspec, true);
    if (!st->out_info || !j->out_spec)
        return AG_ENOMEM;
    if ((rc = run_hooks(st, H_FACTS)))
        return rc;
    bool any_rg_out = false; /* a mutated input with a tangent counts (input_mutations.c) */
    for (int p = 0; st->grad_leaf && p < st->np; p++)
        any_rg_out |= st->grad_leaf[p] && st->in_info[p].requires_grad;
    for (int k = 0; k < st->nouts; k++)
        any_rg_out |= st->out_info[k].requires_grad && st->out_info[k].alias != AG_OUT_IS_INPUT &&
                      st->out_info[k].alias != AG_OUT_ALIAS_OF_INPUT;
    st->needs_autograd = st->any_rg_in && any_rg_out;
    return 0;
}

/* Tangent placeholders for the outputs that take one, the backward rules run by the engine
 * (traced here), and one gradient output per primal (None without one). */
static int core_backward(ag__export_pass *st) {
    size_t c = (size_t)(st->nout ? st->nout : 1), cp = (size_t)(st->np ? st->np : 1);
    ag_tensor **seed = ag__calloc(c, sizeof *seed), **root = ag__calloc(c, sizeof *root);
    ag_tensor **grad_of = ag__calloc(cp, sizeof *grad_of), **grads = ag__calloc(cp, sizeof *grads);
    int rc = seed && root && grad_of && grads ? 0 : AG_ENOMEM, nt = 0, ng = 0;
    for (int e = 0; rc == 0 && e < st->nout; e++) {
        ag_tensor *o = st->out[e].tangent;
        if (!o)
            continue;
        ag_desc *td = ag_desc_tangent(st->out[e].desc);
        if (!td || ag__export_tangent(st, td)) {
            rc = status_or(AG_ENOMEM);
            break;
        }
        char name[32];
        snprintf(name, sizeof name, "tangents_%d", nt + 1);
        ag_tmeta mt;
        ag__tmeta_contiguous(&mt, o->dtype, o->ndim, o->sizes);
        ag_node *tp = ag_graph_placeholder(st->g, name, &mt);
        ag_tensor *tt = NULL;
        if (!tp || ag_node_set_desc(tp, td) || ag_node_set_partitioner_tag(tp, "is_backward") ||
            !(tt = ag__tensor_new(o->dtype, o->ndim, o->sizes, true))) {
            rc = status_or(AG_ENOMEM);
            break;
        }
        ag__tracer_bind(st->T, tt, tp);
        root[nt] = o;
        if (!(seed[nt++] = ag__give(tt)))
            rc = status_or(AG_ENOMEM);
    }
    for (int p = 0; rc == 0 && p < st->np; p++)
        if (st->in_info[p].requires_grad)
            grad_of[ng++] = st->grad_leaf && st->grad_leaf[p] ? st->grad_leaf[p] : st->primal_t[p];
    if (rc == 0 && ng > 0 && nt > 0)
        rc = ag_grad(root, seed, nt, grad_of, ng, grads, false, true);
    for (int p = 0, gi = 0; rc == 0 && p < st->np; p++) {
        ag_tensor *gt = st->in_info[p].requires_grad ? grads[gi++] : NULL;
        ag_node *gn = gt ? ag__tracer_node_of(st->T, gt) : NULL;
        ag_desc *gd = gn ? ag_desc_grad(st->primal_descs[p]) : NULL;
        if ((gt && !gd) || ag__export_out(st, AG_SEC_OUT_GRADS, gn, gd, NULL))
            rc = status_or(AG_ENOMEM);
    }
    ag__free(seed);
    ag__free(root);
    ag__free(grad_of);
    ag__free(grads);
    return rc;
}

/* Everything traced so far is forward; the tangents and what follows is backward. */
static int trace_backward(ag__export_pass *st) {
    for (ag_node *n = ag_graph_first(st->g); n; n = ag_node_next(n))
        if (ag_node_set_partitioner_tag(n, "is_forward"))
            return status_or(AG_ENOMEM);
    ag__tracer_set_tag(st->T, "is_backward");
    ag__tracer_set_stack_traces(st->T, false);
    int rc = run_hooks(st, H_BACKWARD);
    for (int i = 0; rc == 0 && i < NWRAPPERS; i++) {
        int r = wrappers[i]->trace_backward ? wrappers[i]->trace_backward(st, &st->self[i]) : 0;
        if (r != 0)
            return r < 0 ? r : 0;
    }
    return rc ? rc : core_backward(st);
}

static int output_node(ag__export_pass *st) {
    size_t c = (size_t)(st->nout ? st->nout : 1);
    ag_node **nodes = ag__calloc(c, sizeof *nodes);
    ag_desc **descs = ag__calloc(c, sizeof *descs);
    int rc = nodes && descs ? 0 : AG_ENOMEM;
    for (int e = 0; rc == 0 && e < st->nout; e++) {
        nodes[e] = st->out[e].node;
        descs[e] = st->out[e].desc;
    }
    if (rc == 0 && (!ag_graph_output(st->g, nodes, st->nout) ||
                    ag_node_set_output_descs(ag_graph_output_node(st->g), descs, st->nout)))
        rc = status_or(AG_ENOMEM);
    if (rc == 0 && st->needs_autograd)
        rc = copy_fwd_metadata(st->g);
    ag__free(nodes);
    ag__free(descs);
    return rc;
}

/* Everything per pass the state owns, released, and the pass's fields zeroed. */
static void pass_clear(ag__export_pass *st) {
    for (int p = 0; st->primal_descs && p < st->np; p++)
        ag_desc_release(st->primal_descs[p]);
    for (int e = 0; e < st->nout; e++)
        ag_desc_release(st->out[e].desc);
    for (int t = 0; t < st->ntangent_descs; t++)
        ag_desc_release(st->tangent_descs[t]);
    for (int r = 0; r < st->nrng; r++)
        ag_desc_release(st->rng_descs[r]);
    ag__free(st->prim);
    ag__free(st->primal_t);
    ag__free(st->primal_descs);
    ag__free(st->in_info);
    ag__free(st->out_info);
    ag__free(st->out);
    ag__free(st->tangent_descs);
    ag__joint_alias_clear(&st->alias);
    ag__subx_info_release(st->subclass);
    memset(&st->g, 0, sizeof *st - offsetof(ag__export_pass, g));
}

/* The joint takes the pass's graph facts; then its layout, dead code removed, decompositions. */
static int joint_take(ag_joint *j, ag__export_pass *st) {
    j->nprimals = st->np;
    j->in_info = st->in_info;
    j->nuser_out = st->nouts;
    j->out_info = st->out_info;
    j->needs_autograd = st->needs_autograd;
    j->alias = st->alias;
    j->subclass = st->subclass;
    st->in_info = NULL;
    st->out_info = NULL;
    memset(&st->alias, 0, sizeof st->alias);
    st->subclass = NULL;
    /* The flat inputs' descriptors, as the wrappers left them (the subclass wrapper's are the
     * inner tensors'), one per flat input of the aliasing facts. */
    assert(st->nflat == j->alias.nflat);
    if (!(j->flat_descs = ag__calloc((size_t)(st->nflat ? st->nflat : 1), sizeof *j->flat_descs)))
        return AG_ENOMEM;
    for (int i = 0; i < st->nflat; i++)
        j->flat_descs[i] = ag_desc_retain(st->flat_descs[i]);
    if (ag_graph_layout(j->g, 0, &j->layout) || ag_graph_dce(j->g) < 0)
        return status_or(AG_EINVAL);
    if (st->o->decompositions &&
        (ag_graph_decompose(j->g, st->o->decompositions) < 0 || ag_graph_dce(j->g) < 0))
        return status_or(AG_EINVAL);
    return 0;
}

/* One pass: the joint for the wrappers' current layout of the flat inputs. */
static ag_joint *export_pass(ag__export_pass *st) {
    ag_joint *j = pass_start(st);
    if (!j)
        return NULL;
    int rc = run_hooks(st, H_BEGIN);
    if (rc == 0)
        rc = trace_forward(st, j);
    if (rc == 0)
        rc = add_outputs(st, AG_SEC_OUT_FW_TOKENS, AG_SEC_OUT_FW_RNG_OFFSET);
    if (rc == 0 && st->needs_autograd)
        rc = trace_backward(st);
    if (rc == 0 && st->needs_autograd)
        rc = add_outputs(st, AG_SEC_OUT_BW_RNG_OFFSET, AG_SEC_OUT_BW_TOKENS);
    if (rc == 0)
        rc = output_node(st);
    if (rc == 0)
        rc = run_hooks(st, H_FINISH);
    for (int i = NWRAPPERS - 1; i >= 0; i--)
        if (wrappers[i]->end)
            wrappers[i]->end(st, &st->self[i]);
    ag__tracer_end(st->T);
    st->T = NULL;
    if (rc == 0)
        rc = joint_take(j, st);
    ag_scope_end();
    pass_clear(st);
    if (rc) {
        ag_joint_free(j);
        return NULL;
    }
    return j;
}

/* The flat inputs (params, buffers, args, kwargs) and their descriptors, the record the
 * wrappers read (which flat input is a parameter, which buffer) and the joint keeps. */
static int flat_inputs(ag__export_pass *st) {
    const ag_named_tensors *ps = st->ps, *bs = st->bs;
    int n = ps->n + bs->n + st->nargs + st->nkwargs, k = 0;
    st->flat = ag__calloc((size_t)(n ? n : 1), sizeof *st->flat);
    st->flat_descs = ag__calloc((size_t)(n ? n : 1), sizeof *st->flat_descs);
    if (!st->flat || !st->flat_descs)
        return AG_ENOMEM;
    int rc = ag__desc_module_inputs(ps->names, ps->n, bs->names, bs->n, st->nargs + st->nkwargs,
                                    st->flat_descs);
    if (rc)
        return rc;
    st->nflat = n;
    st->flat_module_tensors = true;
    for (int i = 0; i < ps->n; i++)
        st->flat[k++] = ps->tensors[i];
    for (int i = 0; i < bs->n; i++)
        st->flat[k++] = bs->tensors[i];
    for (int i = 0; i < st->nargs; i++)
        st->flat[k++] = st->args[i];
    for (int i = 0; i < st->nkwargs; i++)
        st->flat[k++] = st->kwargs[i];
    return 0;
}

/* After a pass: 0 when every wrapper takes its layout, 1 for another pass, or a refusal. */
static int settle(ag__export_pass *st, const ag_joint *j) {
    ag__export_settled f = {j->in_info + ag__joint_ntok(j), j->needs_autograd, &j->alias};
    for (int i = 0; i < NWRAPPERS; i++) {
        int r = wrappers[i]->settle ? wrappers[i]->settle(st, &st->self[i], &f) : 0;
        if (r != 0)
            return r;
    }
    return 0;
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
    ag__export_pass st = {.m = m,
                          .o = &o,
                          .ps = &ps,
                          .bs = &bs,
                          .args = args,
                          .kwargs = kwargs,
                          .kwarg_names = kwarg_names,
                          .nargs = nargs,
                          .nkwargs = nkwargs};
    ag_joint *j = NULL;
    bool grad_prev = ag_set_grad_enabled(true);
    int rc = ag_module_named_parameters(m, false, &ps);
    if (rc == 0)
        rc = ag_module_named_buffers(m, false, &bs);
    if (rc == 0)
        rc = flat_inputs(&st);
    if (rc == 0)
        rc = run_hooks(&st, H_PREPARE);
    /* Upstream's stage-1 wrappers decide which flat inputs become which primals from what the
     * forward does to them: a first pass assumes the common case, and a second one runs only
     * when a duplicate input is mutated or aliasing inputs turned out not to need (or to need)
     * a shared base. */
    for (int pass = 0; rc == 0 && !j; pass++) {
        if (!(j = export_pass(&st)))
            rc = status_or(AG_EINVAL);
        else if ((rc = settle(&st, j)) != 0) {
            ag_joint_free(j);
            j = NULL;
            if (rc > 0 && pass > 0)
                rc = ag__err(AG_EINVAL, "export: the inputs' layout did not settle after two "
                                        "passes");
            else if (rc > 0)
                rc = 0;
        }
    }
    if (!j && !ag_last_status())
        ag__err(AG_EINVAL, "export: failed");
    ag_set_grad_enabled(grad_prev);
    for (int i = NWRAPPERS - 1; i >= 0; i--)
        if (wrappers[i]->release)
            wrappers[i]->release(&st, &st.self[i]);
    for (int i = 0; st.flat_descs && i < st.nflat; i++)
        ag_desc_release(st.flat_descs[i]);
    ag__free(st.flat_descs);
    ag__free(st.flat);
    ag_named_tensors_free(&ps);
    ag_named_tensors_free(&bs);
    return j;
}

/* ---- aliasing facts ---- */

const ag__joint_alias *ag__joint_alias_of(const ag_joint *j) {
    return &j->alias;
}
int ag_joint_num_metadata_mutations(const ag_joint *j) {
    return count(j, AG_SEC_OUT_METADATA_MUTATIONS);
}
int ag_joint_num_intermediate_bases(const ag_joint *j) {
    return count(j, AG_SEC_OUT_INTERMEDIATE_BASES);
}
int ag_joint_num_flat_inputs(const ag_joint *j) {
    return j ? j->alias.nflat : 0;
}
int ag_joint_flat_input_primal(const ag_joint *j, int flat) {
    if (!j)
        return -1;
    if (flat < 0 || flat >= j->alias.nflat || j->alias.flat[flat].primal < 0)
        return -1;
    return ag__joint_ntok(j) + j->alias.flat[flat].primal;
}
const ag_desc *ag_joint_flat_input_desc(const ag_joint *j, int flat) {
    if (!j || !j->flat_descs || flat < 0 || flat >= j->alias.nflat)
        return NULL;
    return j->flat_descs[flat];
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
    int ntok = ag__joint_ntok(j);
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
