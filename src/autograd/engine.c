/* Eager autograd: running backward over the nodes that op calls recorded
 * (src/core/autograd_graph.c).
 *
 * In: backward requests (ag_backward, ag_grad). Out: gradients in leaves' .grad or returned to
 * the caller.
 *
 * The engine collects the nodes reachable from the roots, marks those that lead to a wanted
 * gradient, counts dependencies, and runs ready nodes highest seq_nr first (PyTorch's CPU ready
 * queue order). Gradients that meet at a node input or leaf are summed by add calls made with
 * the thread's in_grad_acc flag set, so a tracer can tag them. Gradients whose shape differs
 * from the input's (broadcasting) are reduced with sum(keepdim) + view, as ATen's sum_to. */
#include "../core/autograd_graph.h"
#include "../core/ptrmap.h"

#include <stdio.h>

static _Atomic uint64_t engine_epoch; /* runs of all threads stamp nodes with distinct epochs */

/* ---- the engine ---- */

typedef struct leaf_slot {
    ag_tensor *leaf;
    ag_tensor *grad;
} leaf_slot;

typedef struct dfs_frame {
    ag_anode *n;
    int j; /* next edge */
} dfs_frame;

/* The arrays of one backward pass, with their capacities. */
typedef struct engine_mem {
    ag_anode **nodes;
    int64_t cap;
    char *pernode; /* deps, heap, needed, captured: per collected node */
    int64_t pernode_cap;
    ag_tensor **buf;
    int64_t buf_cap;
    leaf_slot *leaves;
    int64_t leaves_cap;
    dfs_frame *stack;
    int64_t stack_cap;
    char *node_tmp; /* run_node's arrays for a node with many inputs */
    int64_t node_tmp_cap;
} engine_mem;

typedef struct engine {
    engine_mem m;
    ag_anode **nodes; /* reachable nodes, DFS post-order (m.nodes) */
    int64_t nnodes;
    bool *needed;
    bool *captured;
    int64_t *deps;
    ag_tensor **buf; /* one slot per output of every collected node (node->bufoff) */
    int64_t nbuf;
    ag_anode **heap;
    int64_t nheap;
    leaf_slot *leaves; /* m.leaves */
    int64_t nleaves;
    bool kept; /* m is the thread's kept memory, given back at the end */
    /* what is wanted */
    bool accumulate;
    ag_tensor *const *inputs;
    int ninputs;
    uint64_t epoch;
    ag__ptrmap wanted, wanted_fn, leaf_idx; /* inputs; their grad_fns; leaf -> leaves[] slot */
} engine;

/* ---- per-thread kept memory ----
 * A backward pass needs arrays sized by the graph it runs (nodes, flags, dependency counts,
 * gradient slots, the ready heap, leaves, the DFS stack), a ones tensor to seed a scalar
 * output, and a compiled function's call makes one custom node. All of these are kept per
 * thread between passes, so the backward of a training step allocates no bookkeeping once
 * warm. A pass that starts while another holds the memory (a backward run from inside a
 * backward rule) allocates its own. Released at thread exit (ag__thread_caches_register). */
static _Thread_local engine_mem kept_mem;
static _Thread_local bool kept_busy;
static _Thread_local ag_tensor *kept_ones[2]; /* 0-dim f32 and f64 seeds */

static void mem_free(engine_mem *m) {
    ag__free(m->nodes);
    ag__free(m->pernode);
    ag__free(m->buf);
    ag__free(m->leaves);
    ag__free(m->stack);
    ag__free(m->node_tmp);
    memset(m, 0, sizeof *m);
}

static void engine_release_kept(void) {
    if (!kept_busy)
        mem_free(&kept_mem);
    for (int k = 0; k < 2; k++) {
        ag_tensor_free(kept_ones[k]);
        kept_ones[k] = NULL;
    }
}

static void engine_init(engine *e) {
    memset(e, 0, sizeof *e);
    if (!kept_busy) {
        e->m = kept_mem;
        e->kept = kept_busy = true;
        memset(&kept_mem, 0, sizeof kept_mem);
    }
}

/* Room for n elements of elem bytes in *p, zeroed. */
static int reserve_zero(void **p, int64_t *cap, int64_t n, size_t elem) {
    if (ag__grow(p, cap, n > 0 ? n : 1, elem))
        return AG_ENOMEM;
    memset(*p, 0, elem * (size_t)(n > 0 ? n : 1));
    return 0;
}

/* The implicit gradient of a scalar output r: ones_like(r), or for a 0-dim f32/f64 output
 * outside tracing the thread's kept one when nobody else holds it. A new reference. */
static ag_tensor *ones_seed(const engine *e, ag_tensor *r) {
    int k = r->dtype == AG_F32 ? 0 : r->dtype == AG_F64 ? 1 : -1;
    if (!e->kept || k < 0 || r->ndim != 0 || ag__tls()->tracing || !r->storage->data) {
        ag_scope_begin();
        ag_tensor *s = ag_tensor_keep(ag_ones_like(r));
        ag_scope_end();
        return s;
    }
    ag_tensor *s = kept_ones[k];
    if (s && (s->refcount != 1 || s->storage->refcount != 1 || s->grad || s->grad_fn ||
              s->requires_grad)) {
        ag_tensor_free(s); /* someone kept it: theirs now */
        s = kept_ones[k] = NULL;
    }
    if (!s) {
        ag_scope_begin();
        s = kept_ones[k] = ag_tensor_keep(ag_ones_like(r));
        ag_scope_end();
        if (!s)
            return NULL;
        ag__thread_caches_register(engine_release_kept);
    } else {
        /* Whoever held it last may have written to it. */
        if (k == 0)
            *(float *)ag_tensor_data(s) = 1;
        else
            *(double *)ag_tensor_data(s) = 1;
        s->storage->version++;
    }
    return ag_tensor_keep(s);
}

static bool is_wanted_leaf(const engine *e, const ag_tensor *leaf) {
    if (e->accumulate)
        return leaf->requires_grad;
    return ag__ptrmap_has(&e->wanted, leaf);
}

static bool node_captured(const engine *e, const ag_anode *n) {
    if (e->accumulate)
        return false;
    return ag__ptrmap_has(&e->wanted_fn, n);
}

/* Sums b into *slot (either may be NULL); *slot owns its reference. */
static int acc_into(ag_tensor **slot, ag_tensor *g) {
    if (!*slot) {
        *slot = ag_tensor_keep(g);
        return 0;
    }
    ag_tensor *s0 = *slot;
    if (s0->grad_donated && !ag__tls()->tracing && s0->storage->data &&
        ag_tensor_is_contiguous(s0) && s0->dtype == g->dtype && s0->ndim == g->ndim &&
        !memcmp(s0->sizes, g->sizes, sizeof(int64_t) * (size_t)g->ndim) &&
        s0->storage != g->storage) {
        /* A gradient its producer gave away (a compiled backward's output, memory no one else
         * reads) takes the sum in place, as a tied weight's two gradients meet. */
        ag_scope_begin();
        ag_tensor *r = ag_add_(s0, g, 1.0);
        ag_scope_end();
        return r ? 0 : ag_last_status();
    }
    ag__tls()->in_grad_acc = true;
    ag_scope_begin();
    ag_tensor *s = ag_tensor_keep(ag_add(*slot, g));
    ag_scope_end();
    ag__tls()->in_grad_acc = false;
    if (!s)
        return ag_last_status();
    ag_tensor_free(*slot);
    *slot = s;
    return 0;
}

static int collect(engine *e, ag_anode *root) {
    if (!root || root->epoch == e->epoch)
        return 0;
    /* Iterative post-order DFS: (node, next edge) pairs. */
    engine_mem *m = &e->m;
    int64_t sp = 0;
    if (ag__grow((void **)&m->stack, &m->stack_cap, 1, sizeof *m->stack))
        return AG_ENOMEM;
    root->epoch = e->epoch;
    m->stack[sp++] = (dfs_frame){root, 0};
    int rc = 0;
    while (sp) {
        dfs_frame *f = &m->stack[sp - 1];
        if (f->j < f->n->ntin) {
            ag_anode *c = f->n->edges[f->j++].fn;
            if (c && c->epoch != e->epoch) {
                c->epoch = e->epoch;
                if ((rc = ag__grow((void **)&m->stack, &m->stack_cap, sp + 1, sizeof *m->stack)))
                    break;
                m->stack[sp++] = (dfs_frame){c, 0};
            }
            continue;
        }
        if ((rc = ag__grow((void **)&m->nodes, &m->cap, e->nnodes + 1, sizeof *m->nodes)))
            break;
        e->nodes = m->nodes;
        f->n->idx = e->nnodes;
        e->nodes[e->nnodes++] = f->n;
        sp--;
    }
    return rc;
}

static void heap_push(engine *e, ag_anode *n) {
    int64_t i = e->nheap++;
    e->heap[i] = n;
    while (i > 0) {
        int64_t p = (i - 1) / 2;
        if (e->heap[p]->seq_nr >= e->heap[i]->seq_nr)
            break;
        ag_anode *t = e->heap[p];
        e->heap[p] = e->heap[i];
        e->heap[i] = t;
        i = p;
    }
}

static ag_anode *heap_pop(engine *e) {
    ag_anode *top = e->heap[0];
    e->heap[0] = e->heap[--e->nheap];
    int64_t i = 0;
    while (true) {
        int64_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < e->nheap && e->heap[l]->seq_nr > e->heap[m]->seq_nr)
            m = l;
        if (r < e->nheap && e->heap[r]->seq_nr > e->heap[m]->seq_nr)
            m = r;
        if (m == i)
            break;
        ag_anode *t = e->heap[m];
        e->heap[m] = e->heap[i];
        e->heap[i] = t;
        i = m;
    }
    return top;
}

static int leaf_deliver(engine *e, ag_tensor *leaf, ag_tensor *g) {
    /* ag_grad (the export's backward, many inputs) finds a leaf's slot by map; a training
     * step's backward scans, allocating nothing. */
    int64_t i = e->accumulate ? -1 : ag__ptrmap_get(&e->leaf_idx, leaf, -1);
    for (int64_t k = 0; e->accumulate && k < e->nleaves && i < 0; k++)
        if (e->leaves[k].leaf == leaf)
            i = k;
    if (i >= 0)
        return acc_into(&e->leaves[i].grad, g);
    if (ag__grow((void **)&e->m.leaves, &e->m.leaves_cap, e->nleaves + 1, sizeof *e->leaves) ||
        (!e->accumulate && ag__ptrmap_put(&e->leaf_idx, leaf, e->nleaves)))
        return AG_ENOMEM;
    e->leaves = e->m.leaves;
    e->leaves[e->nleaves++] = (leaf_slot){leaf, ag_tensor_keep(g)};
    return 0;
}

/* Reduces g to the input's shape (ATen's sum_to) and dtype. Returns a new reference. */
static ag_tensor *fit_grad(const char *opname, ag_tensor *g, const ag_tmeta *m) {
    ag_scope_begin();
    ag_tensor *r = g;
    bool same =
        g->ndim == m->ndim && !memcmp(g->sizes, m->sizes, sizeof(int64_t) * (size_t)m->ndim);
    if (!same) {
        int lead = g->ndim - m->ndim;
        int64_t dims[AG_MAX_DIMS];
        int nd = 0;
        bool ok = lead >= 0;
        for (int d = 0; ok && d < g->ndim; d++) {
            if (d < lead)
                dims[nd++] = d;
            else if (m->sizes[d - lead] == 1 && g->sizes[d] != 1)
                dims[nd++] = d;
            else if (m->sizes[d - lead] != g->sizes[d])
                ok = false;
        }
        if (!ok) {
            char a[128], b[128];
            ag__err(AG_EINVAL,
                    "%s: backward produced a gradient of shape %s for an input of shape %s", opname,
                    ag__fmt_sizes(a, sizeof a, g->ndim, g->sizes),
                    ag__fmt_sizes(b, sizeof b, m->ndim, m->sizes));
            r = NULL;
        } else {
            if (nd)
                r = ag_sum(r, dims, nd, true);
            if (lead > 0)
                r = ag_view(r, m->ndim, m->sizes);
        }
    }
    if (r && r->dtype != m->dtype)
        r = ag_to_dtype(r, m->dtype);
    ag_tensor *kept = r == g ? ag_tensor_keep(g) : ag_tensor_keep(r);
    ag_scope_end();
    return kept;
}

static int check_saved_versions(ag_anode *n) {
    if (!n->op)
        return n->released ? ag__err(AG_ESTATE,
                                     "%s: trying to backward through the graph a "
                                     "second time; pass retain_graph=true",
                                     n->custom_name)
                           : 0;
    if (n->released)
        return ag__err(AG_ESTATE,
                       "%s: trying to backward through the graph a second time (or directly "
                       "access saved tensors after they have already been freed). Saved "
                       "intermediate values of the graph are freed when you call backward; "
                       "pass retain_graph=true to backward through the graph a second time",
                       n->op->name);
    int v = 0;
    for (int i = 0; i < n->nargs; i++) {
        ag_tensor **ts = n->args[i].kind == AG_ARG_TENSOR    ? &n->args[i].u.t
                         : n->args[i].kind == AG_ARG_TENSORS ? n->args[i].u.ts
                                                             : NULL;
        int cnt = n->args[i].kind == AG_ARG_TENSOR    ? 1
                  : n->args[i].kind == AG_ARG_TENSORS ? n->args[i].n
                                                      : 0;
        for (int k = 0; k < cnt; k++) {
            ag_tensor *t = ts[k];
            if (!t)
                continue;
            uint64_t want = n->saved_ver[v++];
            if (t->storage->version != want) {
                char b[160];
                return ag__err(AG_ESTATE,
                               "%s: one of the variables needed for gradient computation has been "
                               "modified by an inplace operation: [%s] (saved argument '%s') is "
                               "at version %llu; expected version %llu instead",
                               n->op->name, ag_tensor_meta_str(t, b, sizeof b), n->op->args[i].name,
                               (unsigned long long)t->storage->version, (unsigned long long)want);
            }
        }
    }
    for (int k = 0; k < n->nout; k++) {
        ag_tensor *t = n->saved_out[k];
        if (!t)
            continue;
        uint64_t want = n->saved_ver[v++];
        if (t->storage->version != want) {
            char b[160];
            return ag__err(AG_ESTATE,
                           "%s: one of the variables needed for gradient computation has been "
                           "modified by an inplace operation: [%s] (output %d of %s) is at "
                           "version %llu; expected version %llu instead",
                           n->op->name, ag_tensor_meta_str(t, b, sizeof b), k, n->op->name,
                           (unsigned long long)t->storage->version, (unsigned long long)want);
        }
    }
    return 0;
}

/* Runs node n's backward rule with its buffered output grads and routes the results. */
static int run_node(engine *e, ag_anode *n) {
    int rc = check_saved_versions(n);
    if (rc)
        return rc;
    ag_tensor **gout = &e->buf[n->bufoff];
    /* Small nodes use the stack; a compiled function may have hundreds of inputs. */
    enum { SMALL = AG_MAX_ARGS + 64 };
    bool needs_s[SMALL];
    ag_tensor *gin_s[SMALL], *fitted_s[SMALL];
    bool *needs = needs_s;
    ag_tensor **gin = gin_s, **fitted = fitted_s;
    if (n->ntin > SMALL) {
        if (ag__grow((void **)&e->m.node_tmp, &e->m.node_tmp_cap,
                     (int64_t)(sizeof(bool) + 2 * sizeof(ag_tensor *)) * n->ntin, 1))
            return AG_ENOMEM;
        gin = (ag_tensor **)(void *)e->m.node_tmp;
        fitted = gin + n->ntin;
        needs = (bool *)(fitted + n->ntin);
    }
    bool any = false;
    for (int j = 0; j < n->ntin; j++) {
        const ag_edge *ed = &n->edges[j];
        needs[j] = (ed->fn && e->needed[ed->fn->idx] && ed->fn->epoch == e->epoch) ||
                   (ed->fn && e->captured[ed->fn->idx]) ||
                   (ed->leaf && is_wanted_leaf(e, ed->leaf));
        any |= needs[j];
        gin[j] = NULL;
    }
    if (!any)
        return 0;
    ag_bwctx ctx = {
        .op = n->op ? n->op->def : NULL,
        .args = n->args,
        .nargs = n->nargs,
        .outputs = n->saved_out,
        .input_meta = n->in_meta,
        .noutputs = n->nout,
        .grad_outputs = gout,
        .ntensor_inputs = n->ntin,
        .needs_grad = needs,
        .grad_inputs = gin,
    };
    ag__tls()->bw_seq_nr = n->seq_nr;
    uint64_t errs = ag__err_count();
    ag_scope_begin();
    rc = n->op ? n->op->def->backward(&ctx)
               : n->custom_bw(n->custom_ud, gout, n->nout, gin, n->ntin, needs);
    /* An op that failed inside the rule leaves a NULL gradient behind; unless the rule itself
     * cleared the error (a probe that fell back to another path), that is a failure. */
    if (rc == 0 && ag__err_count() != errs && ag_last_status() < 0)
        rc = ag_last_status();
    for (int j = 0; j < n->ntin; j++) {
        fitted[j] = NULL;
        if (rc == 0 && needs[j] && gin[j]) {
            fitted[j] = fit_grad(ag__anode_name(n), gin[j], &n->in_meta[j]);
            if (!fitted[j])
                rc = ag_last_status() ? ag_last_status() : AG_EINVAL;
        }
    }
    ag_scope_end();
    ag__tls()->bw_seq_nr = -1;
    for (int j = 0; j < n->ntin && rc == 0; j++) {
        if (!fitted[j])
            continue;
        const ag_edge *ed = &n->edges[j];
        if (ed->leaf) {
            rc = leaf_deliver(e, ed->leaf, fitted[j]);
        } else if (ed->fn) {
            int64_t ti = ed->fn->idx;
            rc = acc_into(&e->buf[e->nodes[ti]->bufoff + ed->input_nr], fitted[j]);
        }
    }
    for (int j = 0; j < n->ntin; j++)
        ag_tensor_free(fitted[j]);
    return rc;
}

static void engine_free(engine *e) {
    if (e->buf)
        for (int64_t i = 0; i < e->nbuf; i++)
            ag_tensor_free(e->buf[i]);
    for (int64_t i = 0; i < e->nleaves; i++)
        ag_tensor_free(e->leaves[i].grad);
    if (e->kept) {
        mem_free(&kept_mem); /* a nested pass's leftovers, if any */
        kept_mem = e->m;
        kept_busy = false;
        ag__thread_caches_register(engine_release_kept);
    } else {
        mem_free(&e->m);
    }
    ag__ptrmap_free(&e->wanted);
    ag__ptrmap_free(&e->wanted_fn);
    ag__ptrmap_free(&e->leaf_idx);
}

/* Accumulates into leaf.grad outside autograd (ATen's AccumulateGrad). */
static int accumulate_leaf(ag_tensor *leaf, ag_tensor *g) {
    if (!leaf->grad) {
        /* Take the gradient itself when nobody else can see its memory, or when its producer
         * donated it (a compiled backward's output: the executor's pool will not reuse the
         * storage while .grad holds it); otherwise copy, as AccumulateGrad does. */
        bool steal =
            ((g->refcount == 1 && g->storage->refcount == 1 && !g->is_view) || g->grad_donated) &&
            ag_tensor_is_contiguous(g) &&
            !g->sub; /* a subclass gradient's inner tensors may be shared: copy */
        ag_tensor *ng;
        if (steal) {
            ng = ag_tensor_keep(g);
        } else {
            ag_scope_begin();
            ng = ag_tensor_keep(ag_clone(g));
            ag_scope_end();
        }
        if (!ng)
            return ag_last_status();
        leaf->grad = ng;
        return 0;
    }
    ag_scope_begin();
    ag_tensor *r = ag_add_(leaf->grad, g, 1.0);
    ag_scope_end();
    return r ? 0 : ag_last_status();
}

/* fn names the public entry ("backward" or "grad") in messages. */
static int run_engine(const char *fn, ag_tensor *const *roots, ag_tensor *const *root_grads,
                      int nroots, ag_tensor *const *inputs, int ninputs, ag_tensor **grads,
                      bool retain, bool allow_unused) {
    engine e;
    engine_init(&e);
    e.accumulate = inputs == NULL;
    e.inputs = inputs;
    e.ninputs = ninputs;
    e.epoch = atomic_fetch_add_explicit(&engine_epoch, 1, memory_order_relaxed) + 1;
    int rc = 0;
    ag_tensor *seeds[64];
    if (nroots > 64) {
        engine_free(&e);
        return ag__err(AG_EINVAL, "%s: at most 64 outputs at once (%d given)", fn, nroots);
    }
    for (int i = 0; i < nroots; i++)
        seeds[i] = NULL;
    bool prev_grad = ag_set_grad_enabled(false);

    for (int i = 0; i < nroots && rc == 0; i++) {
        ag_tensor *r = roots[i];
        if (!r) {
            rc = ag__has_error() ? ag_last_status()
                                 : ag__err(AG_EINVAL, "%s: output %d is NULL", fn, i);
            break;
        }
        if (!r->requires_grad) {
            rc = ag__err(AG_EINVAL,
                         "%s: element %d of tensors does not require grad and "
                         "does not have a grad_fn",
                         fn, i);
            break;
        }
        ag_tensor *g = root_grads ? root_grads[i] : NULL;
        if (!g) {
            if (ag_tensor_numel(r) != 1) {
                char b[128];
                rc = ag__err(AG_EINVAL,
                             "%s: grad can be implicitly created only for "
                             "outputs with one element (output %d has shape %s)",
                             fn, i, ag__fmt_sizes(b, sizeof b, r->ndim, r->sizes));
                break;
            }
            seeds[i] = ones_seed(&e, r);
            if (!seeds[i])
                rc = ag_last_status();
        } else {
            /* As torch.autograd's checks of grad_outputs: same shape, same dtype (an integer
             * or bool gradient of a floating output is refused, not converted). */
            if (g->ndim != r->ndim ||
                memcmp(g->sizes, r->sizes, sizeof(int64_t) * (size_t)r->ndim)) {
                char a[128], b[128];
                rc = ag__err(AG_EINVAL,
                             "%s: Mismatch in shape: grad_output[%d] has a shape of %s and "
                             "output[%d] has a shape of %s",
                             fn, i, ag__fmt_sizes(a, sizeof a, g->ndim, g->sizes), i,
                             ag__fmt_sizes(b, sizeof b, r->ndim, r->sizes));
                break;
            }
            if (g->dtype != r->dtype) {
                rc = ag__err(AG_EINVAL,
                             "%s: Mismatch in dtype: grad_output[%d] has a dtype of %s and "
                             "output[%d] has a dtype of %s%s",
                             fn, i, ag_dtype_name(g->dtype), i, ag_dtype_name(r->dtype),
                             ag_dtype_is_float(g->dtype) ? ""
                                                         : " (only floating point tensors can "
                                                           "be gradients)");
                break;
            }
            seeds[i] = ag_tensor_keep(g);
        }
        if (rc == 0)
            rc = collect(&e, r->grad_fn);
    }
    for (int i = 0; i < ninputs && rc == 0; i++) {
        if (!inputs[i] || !inputs[i]->requires_grad)
            rc = ag__err(AG_EINVAL, "grad: input %d does not require grad", i);
        else if (ag__ptrmap_put(&e.wanted, inputs[i], i) ||
                 (inputs[i]->grad_fn && ag__ptrmap_put(&e.wanted_fn, inputs[i]->grad_fn, i)))
            rc = AG_ENOMEM;
    }
    int64_t nn = e.nnodes;
    if (rc == 0) {
        /* deps and heap (8-byte items) first, then the two flag arrays. */
        size_t per = sizeof(int64_t) + sizeof(ag_anode *) + 2 * sizeof(bool);
        int64_t nbuf = 0;
        for (int64_t i = 0; i < nn; i++) {
            e.nodes[i]->bufoff = nbuf;
            nbuf += e.nodes[i]->nout;
        }
        rc = reserve_zero((void **)&e.m.pernode, &e.m.pernode_cap, nn, per);
        if (rc == 0)
            rc = reserve_zero((void **)&e.m.buf, &e.m.buf_cap, nbuf, sizeof(ag_tensor *));
        if (rc == 0) {
            size_t n1 = (size_t)(nn ? nn : 1);
            e.deps = (int64_t *)(void *)e.m.pernode;
            e.heap = (ag_anode **)(void *)(e.deps + n1);
            e.needed = (bool *)(e.heap + n1);
            e.captured = e.needed + n1;
            e.buf = e.m.buf;
            e.nbuf = nbuf;
        }
    }
    if (rc == 0) {
        /* Post-order: every child precedes its parents, so needed[] is final when read. */
        for (int64_t i = 0; i < nn; i++) {
            ag_anode *n = e.nodes[i];
            e.captured[i] = node_captured(&e, n);
            bool need = false;
            for (int j = 0; j < n->ntin && !need; j++) {
                const ag_edge *ed = &n->edges[j];
                if (ed->leaf && is_wanted_leaf(&e, ed->leaf))
                    need = true;
                if (ed->fn && (e.needed[ed->fn->idx] || e.captured[ed->fn->idx]))
                    need = true;
            }
            e.needed[i] = need;
        }
        for (int64_t i = 0; i < nn; i++) {
            if (!e.needed[i])
                continue;
            ag_anode *n = e.nodes[i];
            for (int j = 0; j < n->ntin; j++) {
                ag_anode *c = n->edges[j].fn;
                if (c && (e.needed[c->idx] || e.captured[c->idx]))
                    e.deps[c->idx]++;
            }
        }
        /* Seed the roots. */
        for (int i = 0; i < nroots && rc == 0; i++) {
            ag_tensor *r = roots[i];
            if (r->grad_fn)
                rc = acc_into(&e.buf[r->grad_fn->bufoff + r->output_nr], seeds[i]);
            else if (is_wanted_leaf(&e, r))
                rc = leaf_deliver(&e, r, seeds[i]);
        }
        for (int i = 0; i < nroots && rc == 0; i++) {
            ag_anode *n = roots[i]->grad_fn;
            if (!n || e.deps[n->idx] != 0 || !(e.needed[n->idx] || e.captured[n->idx]))
                continue;
            bool dup = false;
            for (int64_t k = 0; k < e.nheap; k++)
                dup |= e.heap[k] == n;
            if (!dup)
                heap_push(&e, n);
        }
    }
    while (rc == 0 && e.nheap) {
        ag_anode *n = heap_pop(&e);
        if (e.needed[n->idx]) {
            rc = run_node(&e, n);
            if (rc)
                break;
            for (int j = 0; j < n->ntin; j++) {
                ag_anode *c = n->edges[j].fn;
                if (c && (e.needed[c->idx] || e.captured[c->idx]) && --e.deps[c->idx] == 0)
                    heap_push(&e, c);
            }
        }
        if (!e.captured[n->idx])
            for (int k = 0; k < n->nout; k++) {
                ag_tensor_free(e.buf[n->bufoff + k]);
                e.buf[n->bufoff + k] = NULL;
            }
    }
    /* Results. */
    if (rc == 0 && e.accumulate) {
        for (int64_t i = 0; i < e.nleaves && rc == 0; i++)
            rc = accumulate_leaf(e.leaves[i].leaf, e.leaves[i].grad);
    } else if (rc == 0) {
        for (int i = 0; i < ninputs; i++) {
            ag_tensor *in = inputs[i], *g = NULL;
            if (in->grad_fn) {
                g = e.buf[in->grad_fn->bufoff + in->output_nr];
            } else {
                int64_t k = ag__ptrmap_get(&e.leaf_idx, in, -1);
                g = k >= 0 ? e.leaves[k].grad : NULL;
            }
            if (!g && !allow_unused) {
                rc = ag__err(AG_EINVAL,
                             "grad: one of the differentiated tensors (input %d) "
                             "appears to not have been used in the graph; pass "
                             "allow_unused to get NULL for it",
                             i);
                break;
            }
            grads[i] = ag_tensor_keep(g);
        }
        if (rc)
            for (int i = 0; i < ninputs; i++) {
                ag_tensor_free(grads[i]);
                grads[i] = NULL;
            }
    }
    if (rc == 0 && !retain)
        for (int64_t i = 0; i < nn; i++)
            if (e.needed[i]) {
                ag__anode_release_saved(e.nodes[i]);
                e.nodes[i]->released = e.nodes[i]->has_saved || !e.nodes[i]->op;
            }
    for (int i = 0; i < nroots; i++)
        ag_tensor_free(seeds[i]);
    engine_free(&e);
    ag_set_grad_enabled(prev_grad);
    if (rc == 0 && ninputs > 0)
        for (int i = 0; i < ninputs; i++)
            grads[i] = ag__give(grads[i]);
    return rc;
}

int ag_backward(ag_tensor *output, ag_tensor *grad, bool retain_graph) {
    ag_tensor *roots[1] = {output};
    ag_tensor *gs[1] = {grad};
    return run_engine("backward", roots, gs, 1, NULL, 0, NULL, retain_graph, true);
}

int ag_grad(ag_tensor *const *outputs, ag_tensor *const *grad_outputs, int noutputs,
            ag_tensor *const *inputs, int ninputs, ag_tensor **grads, bool retain_graph,
            bool allow_unused) {
    AG__CHECK_NULL("grad", outputs);
    AG__CHECK_NULL("grad", inputs);
    AG__CHECK_NULL("grad", grads);
    if (noutputs <= 0 || ninputs <= 0)
        return ag__err(AG_EINVAL, "grad: %d outputs and %d inputs given (need at least one each)",
                       noutputs, ninputs);
    for (int i = 0; i < ninputs; i++)
        grads[i] = NULL;
    return run_engine("grad", outputs, grad_outputs, noutputs, inputs, ninputs, grads, retain_graph,
                      allow_unused);
}
