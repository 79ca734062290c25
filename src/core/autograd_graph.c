/* The autograd graph: the nodes that op calls record and backward passes run, the thread's
 * grad mode and autograd state, and the node counter (seq_nr).
 *
 * In: op calls from the dispatcher (ag__autograd_wanted, ag__autograd_check_inplace,
 * ag__autograd_record) and compiled functions' calls (ag__autograd_custom). Out: nodes
 * attached to the outputs' grad_fn, freed with the last tensor or node that refers to them
 * (ag__anode_release, which tensor.c calls). The engine that runs them backward is
 * src/autograd/engine.c.
 *
 * Recording saves, for each node, the op, a copy of its arguments with the tensors the op's save
 * masks ask for (as detached aliases plus their storage versions), and an edge per tensor input
 * saying where its gradient goes: the producing node's input slot, or a leaf. */
#include "autograd_graph.h"

static _Thread_local ag__tls_state tls = {.bw_seq_nr = -1};
static _Thread_local int64_t next_seq_nr;

ag__tls_state *ag__tls(void) {
    return &tls;
}

bool ag_set_grad_enabled(bool enabled) {
    bool prev = !tls.grad_disabled;
    tls.grad_disabled = !enabled;
    return prev;
}

bool ag_is_grad_enabled(void) {
    return !tls.grad_disabled;
}

/* ---- the spare custom node ----
 * A compiled function's call makes one custom node; the thread keeps the last one released for
 * the next call, so a training step allocates no node once warm. */
static _Thread_local ag_anode *kept_node;

static void free_custom_node(ag_anode *n) {
    ag__free(n->edges);
    ag__free(n->in_meta);
    ag__free(n);
}

/* Called by ag__anode_release for a custom node whose last reference went (its ud already
 * freed): keeps it as the thread's spare unless the spare has at least as much room. */
static bool keep_custom_node(ag_anode *n) {
    if (kept_node && kept_node->cap_in >= n->cap_in)
        return false;
    if (kept_node)
        free_custom_node(kept_node);
    ag__thread_caches_register(ag__anode_cache_release);
    kept_node = n;
    return true;
}

/* The spare custom node, cleared, if it has room for nin inputs. */
static ag_anode *take_custom_node(int nin) {
    ag_anode *n = kept_node;
    if (!n || n->cap_in < nin)
        return NULL;
    kept_node = NULL;
    ag_edge *edges = n->edges;
    ag_tmeta *in_meta = n->in_meta;
    int cap = n->cap_in;
    memset(n, 0, sizeof *n);
    memset(edges, 0, sizeof *edges * (size_t)cap);
    n->edges = edges;
    n->in_meta = in_meta;
    n->cap_in = cap;
    return n;
}

void ag__anode_cache_release(void) {
    if (kept_node)
        free_custom_node(kept_node);
    kept_node = NULL;
}

/* ---- node lifetime ---- */

void ag__anode_release_saved(ag_anode *n) {
    for (int i = 0; i < n->nargs; i++) {
        if (n->args[i].kind == AG_ARG_TENSOR) {
            ag_tensor_free(n->args[i].u.t);
            n->args[i].u.t = NULL;
        } else if (n->args[i].kind == AG_ARG_TENSORS) {
            for (int k = 0; k < n->args[i].n; k++) {
                ag_tensor_free(n->args[i].u.ts[k]);
                n->args[i].u.ts[k] = NULL;
            }
        }
    }
    for (int k = 0; k < n->nout; k++) {
        ag_tensor_free(n->saved_out[k]);
        n->saved_out[k] = NULL;
    }
}

void ag__anode_release(ag_anode *first) {
    /* Iterative and allocation-free, so freeing a deep chain can neither overflow the stack nor
     * fail: nodes whose count reaches zero are chained through free_next. */
    if (!first || --first->refcount > 0)
        return;
    first->free_next = NULL;
    ag_anode *work = first;
    while (work) {
        ag_anode *n = work;
        work = n->free_next;
        ag__anode_release_saved(n);
        for (int j = 0; j < n->ntin; j++) {
            ag_tensor_free(n->edges[j].leaf);
            ag_anode *c = n->edges[j].fn;
            if (c && --c->refcount == 0) {
                c->free_next = work;
                work = c;
            }
        }
        if (n->custom_free)
            n->custom_free(n->custom_ud);
        if (!n->op && keep_custom_node(n))
            continue;
        ag__free(n->edges);
        ag__free(n->in_meta);
        ag__free(n->argmem);
        ag__free(n);
    }
}

/* ---- recording ---- */

static bool tensor_input_requires_grad(const ag_tensor *t) {
    return t && t->requires_grad && ag_dtype_is_float(t->dtype);
}

/* A checkpointed region's forward runs with grad mode off; its collector sees each tensor
 * argument that requires grad (src/autograd/checkpoint.c). */
static void ckpt_capture_args(const ag_arg *args, int nargs) {
    for (int i = 0; i < nargs; i++) {
        if (args[i].kind == AG_ARG_TENSOR && tensor_input_requires_grad(args[i].u.t))
            tls.ckpt_capture(tls.ckpt_capture_ud, args[i].u.t);
        if (args[i].kind == AG_ARG_TENSORS)
            for (int k = 0; k < args[i].n; k++)
                if (tensor_input_requires_grad(args[i].u.ts[k]))
                    tls.ckpt_capture(tls.ckpt_capture_ud, args[i].u.ts[k]);
    }
}

bool ag__autograd_wanted(const ag_op *op, const ag_arg *args, int nargs) {
    if (tls.grad_disabled && tls.ckpt_capture && !(op->def->flags & AG_OP_NONDIFF))
        ckpt_capture_args(args, nargs);
    if (tls.grad_disabled || (op->def->flags & AG_OP_NONDIFF))
        return false;
    for (int i = 0; i < nargs; i++) {
        if (args[i].kind == AG_ARG_TENSOR && tensor_input_requires_grad(args[i].u.t))
            return true;
        if (args[i].kind == AG_ARG_TENSORS)
            for (int k = 0; k < args[i].n; k++)
                if (tensor_input_requires_grad(args[i].u.ts[k]))
                    return true;
    }
    return false;
}

/* An in-place op's target t (the mutated tensor, or a mutated view's base) may not be a leaf
 * that requires grad; the export's hook may first give it a history (a clone). */
static int refuse_grad_leaf(const ag_op *op, ag_tensor *t, const char *what, const char *hint) {
    if (t->requires_grad && !t->grad_fn && tls.leaf_inplace) {
        int r = tls.leaf_inplace(tls.leaf_inplace_ud, t);
        if (r < 0)
            return r;
    }
    if (t->requires_grad && !t->grad_fn)
        return ag__err(AG_EINVAL,
                       "%s: %s that requires grad is being used in an in-place operation%s",
                       op->name, what, hint);
    return 0;
}

int ag__autograd_check_inplace(const ag_op *op, const ag_arg *args, int nargs) {
    if (!(op->def->flags & AG_OP_INPLACE) || tls.grad_disabled)
        return 0;
    ag_tensor *self = args[0].u.t;
    int rc = refuse_grad_leaf(op, self, "a leaf tensor",
                              " (wrap it in ag_set_grad_enabled(false) if that is intended)");
    if (rc || !self->is_view || !ag__autograd_wanted(op, args, nargs))
        return rc;
    ag_tensor *base = self->base;
    if (!base || (op->def->flags & AG_OP_INPLACE_VIEW))
        return ag__err(AG_ENOTSUP,
                       "%s: in-place operation on a view of a tensor that takes part in autograd "
                       "is not supported yet; apply the op out of place",
                       op->name);
    /* The base's history becomes CopySlices (src/ops/copy_slices.c). */
    if ((rc = refuse_grad_leaf(op, base, "a view of a leaf tensor", "")))
        return rc;
    if (base->requires_grad && !self->grad_fn)
        return ag__err(AG_EINVAL,
                       "%s: a view was created in no_grad mode and is being modified in place "
                       "with grad mode enabled",
                       op->name);
    if (!ag_tensor_is_contiguous(base)) {
        char x[128], y[128];
        return ag__err(AG_ENOTSUP,
                       "%s: in-place operation on a view of a non-contiguous base (sizes %s, "
                       "strides %s) that takes part in autograd is not supported",
                       op->name, ag__fmt_sizes(x, sizeof x, base->ndim, base->sizes),
                       ag__fmt_sizes(y, sizeof y, base->ndim, base->strides));
    }
    return 0;
}

void ag__tensor_set_history(ag_tensor *dst, const ag_tensor *src) {
    ag_anode *fn = src ? src->grad_fn : NULL;
    if (fn)
        fn->refcount++;
    if (dst->grad_fn)
        ag__anode_release(dst->grad_fn);
    dst->grad_fn = fn;
    dst->output_nr = fn ? src->output_nr : 0;
}

/* Copies one argument into the node: int lists into argmem, tensors as saved aliases (if
 * `save`) or NULL. */
static ag_tensor *saved_alias(ag_tensor *t, ag_anode *n) {
    if (!t)
        return NULL;
    ag_tmeta m;
    ag__tmeta_of(t, &m);
    ag_tensor *a = ag__tensor_alias(t, &m);
    if (a) {
        a->is_view = t->is_view;
        n->saved_ver[n->nsaved_ver++] = t->storage->version;
    }
    return a;
}

static void edge_of(ag_edge *e, ag_tensor *t) {
    e->fn = NULL;
    e->leaf = NULL;
    e->input_nr = 0;
    if (!tensor_input_requires_grad(t))
        return;
    if (t->grad_fn) {
        e->fn = t->grad_fn;
        e->fn->refcount++;
        e->input_nr = t->output_nr;
    } else {
        e->leaf = ag_tensor_keep(t);
    }
}

int ag__autograd_record(const ag_op *op, const ag_arg *args, int nargs, ag_tensor **outs, int nouts,
                        ag_tensor *orig_self) {
    const ag_opdef *def = op->def; /* the caller checked ag__autograd_wanted */
    if (!def->backward)
        return ag__err(AG_ENOTSUP, "%s: an input requires grad but the op has no backward rule",
                       op->name);
    ag_anode *n = ag__calloc(1, sizeof *n);
    if (!n)
        return AG_ENOMEM;
    n->refcount = 1;
    n->op = op;
    n->nargs = nargs;
    /* Count tensor inputs and the bytes of lists to copy. */
    size_t mem = 0;
    int ntin = 0;
    for (int i = 0; i < nargs; i++) {
        if (args[i].kind == AG_ARG_TENSORS) {
            ntin += args[i].n;
            mem += sizeof(ag_tensor *) * (size_t)args[i].n;
        } else if (args[i].kind == AG_ARG_INTS) {
            mem += sizeof(int64_t) * (size_t)args[i].n;
        } else if (args[i].kind == AG_ARG_TENSOR ||
                   (args[i].kind == AG_ARG_NONE && (op->args[i].type == AG_TY_OPT_TENSOR))) {
            ntin++;
        }
    }
    n->ntin = ntin;
    n->argmem = mem ? ag__malloc(mem) : NULL;
    n->edges = ag__calloc((size_t)(ntin ? ntin : 1), sizeof *n->edges);
    n->in_meta = ag__calloc((size_t)(ntin ? ntin : 1), sizeof *n->in_meta);
    if ((mem && !n->argmem) || !n->edges || !n->in_meta) {
        ag__free(n->argmem);
        ag__free(n->edges);
        ag__free(n->in_meta);
        ag__free(n);
        return AG_ENOMEM;
    }
    char *mp = n->argmem;
    int j = 0;
    bool oom = false;
    int maxsaved = (int)(sizeof n->saved_ver / sizeof n->saved_ver[0]) - AG_MAX_OUTPUTS;
    for (int i = 0; i < nargs; i++) {
        ag_arg a = args[i];
        if (a.kind == AG_ARG_TENSOR) {
            bool save = j < 32 && (def->save_args >> j) & 1;
            ag_tensor *src = (i == 0 && orig_self) ? orig_self : a.u.t;
            if (save && n->nsaved_ver < maxsaved) {
                a.u.t = saved_alias(src, n);
                oom |= !a.u.t;
            } else {
                a.u.t = NULL;
            }
            edge_of(&n->edges[j], args[i].u.t);
            ag__tmeta_of(args[i].u.t, &n->in_meta[j]);
            j++;
        } else if (a.kind == AG_ARG_NONE && op->args[i].type == AG_TY_OPT_TENSOR) {
            j++;
        } else if (a.kind == AG_ARG_TENSORS) {
            ag_tensor **ts = (ag_tensor **)(void *)mp;
            mp += sizeof(ag_tensor *) * (size_t)a.n;
            for (int k = 0; k < a.n; k++, j++) {
                ag_tensor *t = args[i].u.ts[k];
                bool save = j < 32 && (def->save_args >> j) & 1;
                ts[k] = save && t && n->nsaved_ver < maxsaved ? saved_alias(t, n) : NULL;
                oom |= save && t && !ts[k];
                edge_of(&n->edges[j], t);
                if (t)
                    ag__tmeta_of(t, &n->in_meta[j]);
            }
            a.u.ts = ts;
        } else if (a.kind == AG_ARG_INTS) {
            int64_t *v = (int64_t *)(void *)mp;
            mp += sizeof(int64_t) * (size_t)a.n;
            if (a.n)
                memcpy(v, args[i].u.ints, sizeof(int64_t) * (size_t)a.n);
            a.u.ints = v;
        }
        n->args[i] = a;
    }
    n->nout = nouts;
    for (int k = 0; k < nouts; k++) {
        if ((def->save_outputs >> k) & 1) {
            n->saved_out[k] = saved_alias(outs[k], n);
            oom |= !n->saved_out[k];
        }
    }
    if (oom) {
        ag__anode_release(n);
        return AG_ENOMEM;
    }
    n->has_saved = n->nsaved_ver > 0;
    n->seq_nr = next_seq_nr++;
    /* Outputs join the graph. For in-place ops outs[0] is the mutated input itself, whose old
     * history is already captured in the edges above. */
    for (int k = 0; k < nouts; k++) {
        ag_tensor *o = outs[k];
        if (!ag_dtype_is_float(o->dtype) || ((def->nondiff_outputs >> k) & 1))
            continue;
        if (o->grad_fn)
            ag__anode_release(o->grad_fn);
        n->refcount++;
        o->grad_fn = n;
        o->output_nr = k;
        o->requires_grad = true;
    }
    ag__anode_release(n); /* the outputs hold it now (or nothing does: freed) */
    return 0;
}

int64_t ag__autograd_current_seq(void) {
    return next_seq_nr - 1;
}

int64_t ag_tensor_seq_nr(const ag_tensor *t) {
    return t && t->grad_fn ? t->grad_fn->seq_nr : -1;
}

const char *ag_tensor_grad_fn_name(const ag_tensor *t) {
    return t && t->grad_fn ? ag__anode_name(t->grad_fn) : NULL;
}

int ag__autograd_custom(const char *name, ag_tensor *const *inputs, int nin, ag_tensor **outs,
                        int nouts, const bool *out_diff, ag__custom_bw_fn fn, void *ud,
                        void (*ud_free)(void *)) {
    bool any = false;
    for (int i = 0; i < nin; i++)
        any |= tensor_input_requires_grad(inputs[i]);
    if (tls.grad_disabled || !any) {
        if (ud_free)
            ud_free(ud);
        return 0;
    }
    ag_anode *n = take_custom_node(nin);
    if (!n && (n = ag__calloc(1, sizeof *n))) {
        n->cap_in = nin ? nin : 1;
        n->edges = ag__calloc((size_t)n->cap_in, sizeof *n->edges);
        n->in_meta = ag__calloc((size_t)n->cap_in, sizeof *n->in_meta);
    }
    if (!n || !n->edges || !n->in_meta) {
        if (n) {
            ag__free(n->edges);
            ag__free(n->in_meta);
        }
        ag__free(n);
        if (ud_free)
            ud_free(ud);
        return AG_ENOMEM;
    }
    n->refcount = 1;
    n->custom_name = name;
    n->custom_bw = fn;
    n->custom_ud = ud;
    n->custom_free = ud_free;
    n->ntin = nin;
    for (int i = 0; i < nin; i++) {
        edge_of(&n->edges[i], inputs[i]);
        ag__tmeta_of(inputs[i], &n->in_meta[i]);
    }
    n->nout = nouts;
    n->seq_nr = next_seq_nr++;
    for (int k = 0; k < nouts; k++) {
        ag_tensor *o = outs[k];
        if (!o || !ag_dtype_is_float(o->dtype) || (out_diff && !out_diff[k]))
            continue;
        if (o->grad_fn)
            ag__anode_release(o->grad_fn);
        n->refcount++;
        o->grad_fn = n;
        o->output_nr = k;
        o->requires_grad = true;
    }
    ag__anode_release(n);
    return 0;
}
