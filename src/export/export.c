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
#include "subclass.h"

#include <stdio.h>

struct ag_joint {
    ag_graph *g;
    char **params, **buffers;
    int nparams, nbuffers;
    ag_treespec *in_spec, *out_spec;
    int nprimals, ntangents, nuser_out, nmutated;
    ag_input_info *in_info;
    ag_output_info *out_info;
    bool needs_autograd;
    ag_desc **primal_descs; /* for ag_joint_set_graph's checks */
    ag_desc **tangent_descs;
    ag__subx_info *subclass; /* tensor subclasses flattened (subclass.c), or NULL */
};

/* ---- accessors ---- */

ag_graph *ag_joint_graph(const ag_joint *j) { return j->g; }
int ag_joint_num_params(const ag_joint *j) { return j->nparams; }
const char *ag_joint_param_fqn(const ag_joint *j, int i) {
    return i >= 0 && i < j->nparams ? j->params[i] : NULL;
}
int ag_joint_num_buffers(const ag_joint *j) { return j->nbuffers; }
const char *ag_joint_buffer_fqn(const ag_joint *j, int i) {
    return i >= 0 && i < j->nbuffers ? j->buffers[i] : NULL;
}
const ag_treespec *ag_joint_in_spec(const ag_joint *j) { return j->in_spec; }
const ag_treespec *ag_joint_out_spec(const ag_joint *j) { return j->out_spec; }
int ag_joint_num_static_inputs(const ag_joint *j) {
    return j->subclass ? j->subclass->nstatic : j->nparams + j->nbuffers;
}
int ag_joint_static_input(const ag_joint *j, int i) {
    return i >= 0 && i < ag_joint_num_static_inputs(j) ? i : -1;
}
ag__subx_info *ag__joint_subclass_info(const ag_joint *j) { return j->subclass; }
int ag_joint_num_primals(const ag_joint *j) { return j->nprimals; }
int ag_joint_num_tangents(const ag_joint *j) { return j->ntangents; }
const ag_input_info *ag_joint_input_info(const ag_joint *j, int i) {
    return i >= 0 && i < j->nprimals ? &j->in_info[i] : NULL;
}
int ag_joint_num_user_outputs(const ag_joint *j) { return j->nuser_out; }
const ag_output_info *ag_joint_output_info(const ag_joint *j, int i) {
    return i >= 0 && i < j->nuser_out ? &j->out_info[i] : NULL;
}
int ag_joint_num_mutated_inputs(const ag_joint *j) { return j->nmutated; }
int ag_joint_num_fw_outputs(const ag_joint *j) { return j->nmutated + j->nuser_out; }
bool ag_joint_needs_autograd(const ag_joint *j) { return j->needs_autograd; }

void ag_joint_free(ag_joint *j) {
    if (!j)
        return;
    ag_graph_free(j->g);
    for (int i = 0; j->params && i < j->nparams; i++) /* NULL when its allocation failed */
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
    for (int i = 0; i < j->ntangents; i++)
        ag_desc_release(j->tangent_descs ? j->tangent_descs[i] : NULL);
    ag__free(j->primal_descs);
    ag__free(j->tangent_descs);
    ag__subx_info_release(j->subclass);
    ag__free(j);
}

/* ---- the convention checks of ag_joint_set_graph ---- */

int ag_joint_set_graph(ag_joint *j, ag_graph *g) {
    int rc = 0;
    ag_node **ph;
    int nph = g ? ag_graph_placeholders(g, &ph) : AG_EINVAL;
    if (!g)
        return ag__err(AG_EINVAL, "joint_set_graph: NULL graph");
    if (nph < 0) {
        ag_graph_free(g);
        return nph;
    }
    if (nph != j->nprimals + j->ntangents)
        rc = ag__err(AG_EINVAL, "joint_set_graph: the graph has %d placeholders; the calling "
                                "convention has %d primals and %d tangents", nph, j->nprimals,
                     j->ntangents);
    for (int i = 0; rc == 0 && i < nph; i++) {
        ag_desc *d = ag_node_desc(ph[i]);
        ag_desc *want = i < j->nprimals ? j->primal_descs[i] : j->tangent_descs[i - j->nprimals];
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
    return 0;
}

/* ---- building ---- */

/* Forward metadata onto backward nodes (upstream's copy_fwd_metadata_to_bw_nodes): the first
 * forward node of each seq_nr created the autograd node; backward nodes with that seq_nr (but
 * not gradient accumulations, whose seq_nr is not theirs) take its annotations and its stack
 * trace, as anomaly mode gives backward nodes their forward op's trace. */
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
        if (rc == 0 && ag_node_stack_trace(f))
            rc = ag_node_set_stack_trace(n, ag_node_stack_trace(f));
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

typedef struct export_state {
    ag_joint *j;
    ag__tracer *T;
    ag_tensor **flat;    /* primal tensors (params, buffers, args, kwargs), borrowed */
    ag_node **prim;      /* their placeholders */
    int *dup_of;         /* index of an earlier slot holding the same tensor, or -1 */
    int nflat;
    ag__subx *sx;        /* tensor subclasses flattened (subclass.c); NULL when none is used */
} export_state;

static int run_forward(ag_module *m, export_state *st, int first_user, int nuser,
                       ag_tensor **outs, int max_out) {
    ag_tensor **in = st->sx ? ag__subx_outer_inputs(st->sx) : st->flat; /* the outer inputs */
    return ag_module_call(m, in + first_user, nuser, outs, max_out);
}

ag_joint *ag_export_joint(ag_module *m, ag_tensor *const *args, int nargs,
                          const char *const *kwarg_names, ag_tensor *const *kwargs, int nkwargs,
                          const ag_export_opts *opts) {
    if (!m)
        return ag__err(AG_EINVAL, "export: NULL module"), NULL;
    for (int i = 0; i < nargs; i++)
        if (!args[i])
            return ag__err(AG_EINVAL, "export: argument %d is NULL", i), NULL;
    for (int i = 0; i < nkwargs; i++)
        if (!kwargs[i] || !kwarg_names || !kwarg_names[i])
            return ag__err(AG_EINVAL, "export: keyword argument %d is NULL or unnamed", i), NULL;
    ag_export_opts o = {0};
    if (opts)
        o = *opts;

    ag_joint *j = ag__calloc(1, sizeof *j);
    ag_named_tensors ps = {0}, bs = {0};
    export_state st = {0};
    ag_tensor *outs[64] = {0};
    ag_tensor **tangent_in = NULL, **needs_out = NULL, **grad_of = NULL, **grads = NULL;
    ag_node **out_nodes = NULL;
    ag_desc **out_descs = NULL;
    int rc = 0, nouts = 0, nout_total = 0;
    bool scoped = false, grad_prev = ag_set_grad_enabled(true);
    if (!j)
        goto fail;
    st.j = j;
    if (ag_module_named_parameters(m, false, &ps) || ag_module_named_buffers(m, false, &bs))
        goto fail;
    j->nparams = ps.n;
    j->nbuffers = bs.n;
    j->params = ag__calloc((size_t)(ps.n ? ps.n : 1), sizeof(char *));
    j->buffers = ag__calloc((size_t)(bs.n ? bs.n : 1), sizeof(char *));
    if (!j->params || !j->buffers)
        goto fail;
    for (int i = 0; i < ps.n; i++)
        if (!(j->params[i] = ag__strdup(ps.names[i])))
            goto fail;
    for (int i = 0; i < bs.n; i++)
        if (!(j->buffers[i] = ag__strdup(bs.names[i])))
            goto fail;

    /* Flat inputs and their placeholders. */
    st.nflat = ps.n + bs.n + nargs + nkwargs;
    /* Tensor subclass inputs are flattened into their plain inner tensors. */
    if (ag__subx_begin(&st.sx, &ps, &bs, args, nargs, kwargs, nkwargs))
        goto fail;
    if (st.sx)
        st.nflat = ag__subx_num_flat(st.sx);
    j->nprimals = st.nflat;
    st.flat = ag__calloc((size_t)(st.nflat ? st.nflat : 1), sizeof *st.flat);
    st.prim = ag__calloc((size_t)(st.nflat ? st.nflat : 1), sizeof *st.prim);
    st.dup_of = ag__calloc((size_t)(st.nflat ? st.nflat : 1), sizeof *st.dup_of);
    j->primal_descs = ag__calloc((size_t)(st.nflat ? st.nflat : 1), sizeof(ag_desc *));
    j->in_info = ag__calloc((size_t)(st.nflat ? st.nflat : 1), sizeof *j->in_info);
    j->g = ag_graph_new();
    if (!st.flat || !st.prim || !st.dup_of || !j->primal_descs || !j->in_info || !j->g)
        goto fail;
    for (int i = 0; i < st.nflat; i++) {
        ag_tensor *t;
        ag_desc *d;
        if (st.sx) {
            t = ag__subx_flat(st.sx, i, &d);
        } else if (i < ps.n) {
            t = ps.tensors[i];
            d = ag_desc_param(ps.names[i]);
        } else if (i < ps.n + bs.n) {
            t = bs.tensors[i - ps.n];
            d = ag_desc_buffer(bs.names[i - ps.n]);
        } else if (i < ps.n + bs.n + nargs) {
            t = args[i - ps.n - bs.n];
            d = ag_desc_plain_input(i - ps.n - bs.n);
        } else {
            t = kwargs[i - ps.n - bs.n - nargs];
            d = ag_desc_plain_input(i - ps.n - bs.n);
        }
        st.flat[i] = t;
        j->primal_descs[i] = d;
        if (!d)
            goto fail;
        char name[32];
        snprintf(name, sizeof name, "primals_%d", i + 1);
        ag_tmeta mt;
        ag__tmeta_of(t, &mt);
        st.prim[i] = ag_graph_placeholder(j->g, name, &mt);
        if (!st.prim[i] || ag_node_set_desc(st.prim[i], d))
            goto fail;
        j->in_info[i].requires_grad = st.sx ? ag__subx_flat_requires_grad(st.sx, i)
                                            : t->requires_grad && ag_dtype_is_float(t->dtype);
    }
    j->in_spec = make_in_spec(ps.n + bs.n + nargs, kwarg_names, nkwargs);
    if (!j->in_spec)
        goto fail;

    /* The forward, functionalized, with autograd recording. */
    st.T = ag__tracer_begin(j->g, true);
    if (!st.T)
        goto fail;
    /* The same tensor may fill two slots (GPT-2's lm_head.weight is transformer.wte.weight):
     * it is bound to its first placeholder, and the later ones stay unused with no gradient
     * (upstream collapses such duplicates to the first occurrence). */
    for (int i = 0; i < st.nflat; i++) {
        st.dup_of[i] = -1;
        for (int k = 0; k < i && st.dup_of[i] < 0; k++)
            if (st.flat[k] == st.flat[i])
                st.dup_of[i] = k;
        if (st.dup_of[i] < 0)
            ag__tracer_bind(st.T, st.flat[i], st.prim[i]);
    }
    ag_scope_begin();
    scoped = true;
    nouts = run_forward(m, &st, ps.n + bs.n, nargs + nkwargs, outs, 64);
    if (nouts < 0)
        goto fail;
    int nspec = nouts; /* the user's outputs; subclass ones are flattened from here on */
    if ((nouts = ag__subx_outputs(&st.sx, outs, nouts, 64, st.flat, j->primal_descs, st.nflat,
                                  ps.n + bs.n)) < 0)
        goto fail;
    j->nuser_out = nouts;
    j->out_info = ag__calloc((size_t)(nouts ? nouts : 1), sizeof *j->out_info);
    /* One output is a bare leaf; several are a tuple. */
    j->out_spec = nspec == 1 ? ag_treespec_leaf() : flat_list_spec(nspec, true);
    if (!j->out_info || !j->out_spec)
        goto fail;

    /* Which inputs were mutated: their tensor is now bound to a node other than their
     * placeholder. A metadata-only mutation would change their view; we have none yet. */
    for (int i = 0; i < st.nflat; i++)
        if (st.dup_of[i] < 0 && ag__tracer_node_of(st.T, st.flat[i]) != st.prim[i]) {
            j->in_info[i].mutates_data = true;
            j->nmutated++;
            if (j->in_info[i].requires_grad) {
                rc = ag__err(AG_ENOTSUP, "export: input %d (%s) requires grad and is mutated in "
                                         "place; mutating a parameter or input that requires "
                                         "grad is not supported", i, ag_node_name(st.prim[i]));
                goto fail;
            }
        }
    bool any_rg_in = false, any_rg_out = false;
    for (int i = 0; i < st.nflat; i++)
        any_rg_in |= j->in_info[i].requires_grad;
    for (int k = 0; k < nouts; k++) {
        ag_tensor *t = outs[k];
        ag_output_info *oi = &j->out_info[k];
        oi->base_index = -1;
        oi->requires_grad = st.sx ? ag__subx_out_requires_grad(st.sx, k) : t && t->requires_grad;
        for (int i = 0; t && i < st.nflat; i++) {
            if (ag__tracer_node_of(st.T, t) == st.prim[i]) {
                oi->alias = AG_OUT_IS_INPUT;
                oi->base_index = i;
            } else if (t->storage == st.flat[i]->storage && oi->alias == AG_OUT_NON_ALIAS) {
                oi->alias = AG_OUT_ALIAS_OF_INPUT;
                oi->base_index = i;
            }
        }
        any_rg_out |= oi->requires_grad;
    }
    j->needs_autograd = any_rg_in && any_rg_out;

    /* Tangents: one per user output that requires grad and does not alias an input. */
    nout_total = j->nmutated + nouts + (j->needs_autograd ? st.nflat : 0);
    out_nodes = ag__calloc((size_t)(nout_total ? nout_total : 1), sizeof *out_nodes);
    out_descs = ag__calloc((size_t)(nout_total ? nout_total : 1), sizeof *out_descs);
    tangent_in = ag__calloc((size_t)(nouts ? nouts : 1), sizeof *tangent_in);
    needs_out = ag__calloc((size_t)(nouts ? nouts : 1), sizeof *needs_out);
    j->tangent_descs = ag__calloc((size_t)(nouts ? nouts : 1), sizeof(ag_desc *));
    if (!out_nodes || !out_descs || !tangent_in || !needs_out || !j->tangent_descs)
        goto fail;
    int no = 0;
    for (int i = 0; i < st.nflat; i++)
        if (j->in_info[i].mutates_data) {
            out_nodes[no] = ag__tracer_node_of(st.T, st.flat[i]);
            if (!(out_descs[no++] = st.sx ? ag__subx_mutation_desc(st.sx, i)
                                          : ag_desc_input_mutation(j->primal_descs[i])))
                goto fail;
        }
    for (int k = 0; k < nouts; k++) {
        out_nodes[no] = outs[k] ? ag__tracer_node_of(st.T, outs[k]) : NULL;
        if (outs[k] && !out_nodes[no])
            goto fail;
        if (!(out_descs[no++] = st.sx ? ag__subx_out_desc(st.sx, k) : ag_desc_plain_output(k)))
            goto fail;
    }
    if (j->needs_autograd && st.sx) {
        /* Tensor subclasses: tangents and gradients at the outer level, flattened. */
        if (ag__subx_backward(st.sx, j->g, st.T, j->out_info, out_nodes, out_descs, &no,
                              j->tangent_descs, &j->ntangents))
            goto fail;
    } else if (j->needs_autograd) {
        /* Everything traced so far is forward; tangents and what follows is backward. */
        for (ag_node *n = ag_graph_first(j->g); n; n = ag_node_next(n))
            if (ag_node_set_partitioner_tag(n, "is_forward"))
                goto fail;
        int nt = 0;
        for (int k = 0; k < nouts; k++) {
            ag_output_info *oi = &j->out_info[k];
            if (!oi->requires_grad || oi->alias != AG_OUT_NON_ALIAS ||
                !ag_dtype_is_float(outs[k]->dtype))
                continue;
            ag_desc *od = out_descs[j->nmutated + k];
            ag_desc *td = ag_desc_tangent(od);
            if (!td)
                goto fail;
            j->tangent_descs[nt] = td;
            char name[32];
            snprintf(name, sizeof name, "tangents_%d", nt + 1);
            ag_tmeta mt;
            ag_tensor *out_k = outs[k];
            ag__tmeta_contiguous(&mt, out_k->dtype, out_k->ndim, out_k->sizes);
            ag_node *tp = ag_graph_placeholder(j->g, name, &mt);
            if (!tp || ag_node_set_desc(tp, td) || ag_node_set_partitioner_tag(tp, "is_backward"))
                goto fail;
            ag_tensor *tt = ag__tensor_new(out_k->dtype, out_k->ndim, out_k->sizes, true);
            if (!tt)
                goto fail;
            ag__tracer_bind(st.T, tt, tp);
            tangent_in[nt] = ag__give(tt);
            needs_out[nt++] = out_k;
            if (!tangent_in[nt - 1])
                goto fail;
        }
        j->ntangents = nt;
        /* The backward: the engine runs the op table's backward rules, traced here. */
        grad_of = ag__calloc((size_t)st.nflat, sizeof *grad_of);
        grads = ag__calloc((size_t)st.nflat, sizeof *grads);
        if (!grad_of || !grads)
            goto fail;
        int ng = 0;
        for (int i = 0; i < st.nflat; i++)
            if (j->in_info[i].requires_grad && st.dup_of[i] < 0)
                grad_of[ng++] = st.flat[i];
        ag__tracer_set_tag(st.T, "is_backward");
        ag__tracer_set_stack_traces(st.T, false);
        if (ng > 0 && nt > 0 && ag_grad(needs_out, tangent_in, nt, grad_of, ng, grads, false, true))
            goto fail;
        int gi = 0;
        for (int i = 0; i < st.nflat; i++) {
            ag_node *gn = NULL;
            ag_desc *gd = NULL;
            if (j->in_info[i].requires_grad && st.dup_of[i] < 0) {
                ag_tensor *gt = grads[gi++];
                if (gt) {
                    gn = ag__tracer_node_of(st.T, gt);
                    if (!gn)
                        goto fail;
                    if (!(gd = ag_desc_grad(j->primal_descs[i])))
                        goto fail;
                }
            }
            out_nodes[no] = gn;
            out_descs[no++] = gd;
        }
    }
    ag__tracer_end(st.T);
    st.T = NULL;
    if (!ag_graph_output(j->g, out_nodes, no) ||
        ag_node_set_output_descs(ag_graph_output_node(j->g), out_descs, no))
        goto fail;
    if (j->needs_autograd && copy_fwd_metadata(j->g))
        goto fail;
    if (ag_graph_dce(j->g) < 0)
        goto fail;
    if (o.decompositions) {
        if (ag_graph_decompose(j->g, o.decompositions) < 0 || ag_graph_dce(j->g) < 0)
            goto fail;
    }
    if (ag__subx_finish(st.sx, &j->subclass))
        goto fail;
    ag_scope_end();
    scoped = false;
    goto done;

fail:
    if (rc == 0)
        rc = ag_last_status() ? ag_last_status() : ag__err(AG_EINVAL, "export: failed");
    if (st.T)
        ag__tracer_end(st.T);
    if (scoped)
        ag_scope_end();
    ag_joint_free(j);
    j = NULL;
done:
    ag_set_grad_enabled(grad_prev);
    for (int i = 0; out_descs && i < nout_total; i++)
        ag_desc_release(out_descs[i]);
    ag__free(out_descs);
    ag__free(out_nodes);
    ag__free(tangent_in);
    ag__free(needs_out);
    ag__free(grad_of);
    ag__free(grads);
    ag__free(st.flat);
    ag__free(st.prim);
    ag__free(st.dup_of);
    ag__subx_free(st.sx);
    ag_named_tensors_free(&ps);
    ag_named_tensors_free(&bs);
    return j;
}
