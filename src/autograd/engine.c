/* Eager autograd: recording nodes at op-call time and running backward.
 *
 * In: op calls from the dispatcher (ag__autograd_record) and backward requests (ag_backward,
 * ag_grad). Out: gradients in leaves' .grad or returned to the caller.
 *
 * Recording saves, for each node, the op, a copy of its arguments with the tensors the op's save
 * masks ask for (as detached aliases plus their storage versions), and an edge per tensor input
 * saying where its gradient goes: the producing node's input slot, or a leaf.
 *
 * The engine collects the nodes reachable from the roots, marks those that lead to a wanted
 * gradient, counts dependencies, and runs ready nodes highest seq_nr first (PyTorch's CPU ready
 * queue order). Gradients that meet at a node input or leaf are summed by add calls made with
 * the thread's in_grad_acc flag set, so a tracer can tag them. Gradients whose shape differs
 * from the input's (broadcasting) are reduced with sum(keepdim) + view, as ATen's sum_to. */
#include "../core/internal.h"
#include "../core/ptrmap.h"

#include <stdio.h>

typedef struct ag_edge {
    struct ag_anode *fn; /* producing node, or NULL */
    int input_nr;        /* output slot of fn */
    ag_tensor *leaf;     /* leaf that requires grad, or NULL */
} ag_edge;

typedef struct ag_anode {
    int64_t refcount;
    int64_t seq_nr;
    const ag_op *op;
    int nargs;
    ag_arg args[AG_MAX_ARGS];
    void *argmem; /* copied int lists and tensor-list arrays */
    int ntin;
    ag_edge *edges;
    ag_tmeta *in_meta;
    int nout;
    ag_tensor *saved_out[AG_MAX_OUTPUTS];
    uint64_t saved_ver[32 + AG_MAX_OUTPUTS]; /* save_args has 32 bits */
    int nsaved_ver;
    bool released;
    bool has_saved;
    /* engine scratch */
    uint64_t epoch;
    int64_t idx;
    int64_t bufoff; /* first slot of this node's output grads in engine.buf */
    struct ag_anode *free_next; /* release worklist */
    int cap_in;                 /* custom nodes: room in edges and in_meta (recycling) */
    /* A custom node (op == NULL): a compiled function's backward. */
    const char *custom_name;
    ag__custom_bw_fn custom_bw;
    void *custom_ud;
    void (*custom_free)(void *);
} ag_anode;

static _Thread_local ag__tls_state tls = {.bw_seq_nr = -1};
static _Thread_local int64_t next_seq_nr;
static _Atomic uint64_t engine_epoch; /* runs of all threads stamp nodes with distinct epochs */

ag__tls_state *ag__tls(void) { return &tls; }

bool ag_set_grad_enabled(bool enabled) {
    bool prev = !tls.grad_disabled;
    tls.grad_disabled = !enabled;
    return prev;
}

bool ag_is_grad_enabled(void) { return !tls.grad_disabled; }

/* ---- node lifetime ---- */

static void release_saved(ag_anode *n) {
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

static bool keep_custom_node(ag_anode *n);
static ag_anode *take_custom_node(int nin);

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
        release_saved(n);
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

bool ag__autograd_wanted(const ag_op *op, const ag_arg *args, int nargs) {
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

int ag__autograd_check_inplace(const ag_op *op, const ag_arg *args, int nargs) {
    if (!(op->def->flags & AG_OP_INPLACE) || tls.grad_disabled)
        return 0;
    ag_tensor *self = args[0].u.t;
    if (self->requires_grad && !self->grad_fn)
        return ag__err(AG_EINVAL,
                       "%s: a leaf tensor that requires grad is being used in an in-place "
                       "operation (wrap it in ag_set_grad_enabled(false) if that is intended)",
                       op->name);
    if (self->is_view && ag__autograd_wanted(op, args, nargs))
        return ag__err(AG_ENOTSUP,
                       "%s: in-place operation on a view of a tensor that takes part in autograd "
                       "is not supported yet; apply the op out of place", op->name);
    return 0;
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

int ag__autograd_record(const ag_op *op, const ag_arg *args, int nargs, ag_tensor **outs,
                        int nouts, ag_tensor *orig_self) {
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

int64_t ag__autograd_current_seq(void) { return next_seq_nr - 1; }

int64_t ag_tensor_seq_nr(const ag_tensor *t) {
    return t && t->grad_fn ? t->grad_fn->seq_nr : -1;
}

static const char *node_name(const ag_anode *n) { return n->op ? n->op->name : n->custom_name; }

const char *ag_tensor_grad_fn_name(const ag_tensor *t) {
    return t && t->grad_fn ? node_name(t->grad_fn) : NULL;
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
 * backward rule) allocates its own. Released at thread exit (ag__thread_caches_release). */
static _Thread_local engine_mem kept_mem;
static _Thread_local bool kept_busy;
static _Thread_local ag_tensor *kept_ones[2]; /* 0-dim f32 and f64 seeds */
static _Thread_local ag_anode *kept_node;     /* one released custom node, for reuse */

static void mem_free(engine_mem *m) {
    ag__free(m->nodes);
    ag__free(m->pernode);
    ag__free(m->buf);
    ag__free(m->leaves);
    ag__free(m->stack);
    ag__free(m->node_tmp);
    memset(m, 0, sizeof *m);
}

static void free_custom_node(ag_anode *n) {
    ag__free(n->edges);
    ag__free(n->in_meta);
    ag__free(n);
}

void ag__engine_release_kept(void) {
    if (!kept_busy)
        mem_free(&kept_mem);
    for (int k = 0; k < 2; k++) {
        ag_tensor_free(kept_ones[k]);
        kept_ones[k] = NULL;
    }
    if (kept_node)
        free_custom_node(kept_node);
    kept_node = NULL;
}

/* Called by ag__anode_release for a custom node whose last reference went (its ud already
 * freed): keeps it as the thread's spare unless the spare has at least as much room. */
static bool keep_custom_node(ag_anode *n) {
    if (kept_node && kept_node->cap_in >= n->cap_in)
        return false;
    if (kept_node)
        free_custom_node(kept_node);
    ag__thread_caches_register();
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
    if (!e->kept || k < 0 || r->ndim != 0 || tls.tracing || !r->storage->data) {
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
        ag__thread_caches_register();
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
    if (s0->grad_donated && !tls.tracing && s0->storage->data && ag_tensor_is_contiguous(s0) &&
        s0->dtype == g->dtype && s0->ndim == g->ndim &&
        !memcmp(s0->sizes, g->sizes, sizeof(int64_t) * (size_t)g->ndim) &&
        s0->storage != g->storage) {
        /* A gradient its producer gave away (a compiled backward's output, memory no one else
         * reads) takes the sum in place, as a tied weight's two gradients meet. */
        ag_scope_begin();
        ag_tensor *r = ag_add_(s0, g, 1.0);
        ag_scope_end();
        return r ? 0 : ag_last_status();
    }
    tls.in_grad_acc = true;
    ag_scope_begin();
    ag_tensor *s = ag_tensor_keep(ag_add(*slot, g));
    ag_scope_end();
    tls.in_grad_acc = false;
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
    bool same = g->ndim == m->ndim &&
                !memcmp(g->sizes, m->sizes, sizeof(int64_t) * (size_t)m->ndim);
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
            ag__err(AG_EINVAL, "%s: backward produced a gradient of shape %s for an input of shape %s",
                    opname, ag__fmt_sizes(a, sizeof a, g->ndim, g->sizes),
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
        return n->released ? ag__err(AG_ESTATE, "%s: trying to backward through the graph a "
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
        int cnt = n->args[i].kind == AG_ARG_TENSOR ? 1 : n->args[i].kind == AG_ARG_TENSORS ? n->args[i].n : 0;
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
                               n->op->name, ag_tensor_meta_str(t, b, sizeof b),
                               n->op->args[i].name, (unsigned long long)t->storage->version,
                               (unsigned long long)want);
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
                   (ed->fn && e->captured[ed->fn->idx]) || (ed->leaf && is_wanted_leaf(e, ed->leaf));
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
    tls.bw_seq_nr = n->seq_nr;
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
            fitted[j] = fit_grad(node_name(n), gin[j], &n->in_meta[j]);
            if (!fitted[j])
                rc = ag_last_status() ? ag_last_status() : AG_EINVAL;
        }
    }
    ag_scope_end();
    tls.bw_seq_nr = -1;
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
        ag__thread_caches_register();
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
        bool steal = ((g->refcount == 1 && g->storage->refcount == 1 && !g->is_view) ||
                      g->grad_donated) &&
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
            if (g->ndim != r->ndim || memcmp(g->sizes, r->sizes, sizeof(int64_t) * (size_t)r->ndim)) {
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
                rc = ag__err(AG_EINVAL, "grad: one of the differentiated tensors (input %d) "
                                        "appears to not have been used in the graph; pass "
                                        "allow_unused to get NULL for it", i);
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
                release_saved(e.nodes[i]);
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
