/* The executor: a graph compiled for repeated execution on the CPU kernels with a static
 * memory plan (ag_plan_new / ag_plan_run, include/aotgrad/compile.h).
 *
 * In: a verified graph. Out: a plan that, given one tensor per placeholder, calls each node's
 * kernel directly (no dispatcher: no autograd, no tracer, no output allocation) on tensor
 * structs the plan owns, and hands the graph's outputs to the caller.
 *
 * Values. Every node output is a value with a tensor struct made once at ag_plan_new and an
 * argument array pre-bound to those structs (defaults filled, int lists and strings copied,
 * so the plan does not read the graph again). A placeholder's struct takes the caller's
 * tensor's geometry and storage at each run; a get_attr value is the graph's constant (the
 * plan keeps a reference); a kernel output owns a buffer; a view (AG_OP_VIEW, no kernel)
 * aliases its base's storage with the geometry its meta function computes, once at
 * ag_plan_new, or at every run for views of placeholders (the caller's strides may differ
 * from the traced ones); a getitem is the multi-output call's value itself; an in-place op's
 * (AG_OP_INPLACE) output is its self.
 *
 * Lifetimes and buffers. Time is the node index. A value lives from the node that defines it
 * to the last node that reads it; a view keeps its base's buffer alive until the view's last
 * read. Kernel outputs that the caller gets back (directly or through a view) are "output
 * buffers": fresh storage each run (see below). Every other buffer gets a 64-byte-aligned
 * place in one arena from the offset allocator (memplan.c), which reuses memory as values
 * die. In-place reuse: a pointwise, single-output, non-mutating kernel whose output has the
 * shape and dtype of a tensor argument whose buffer dies at this node (no later reader, not
 * an output, not an input or constant, read by no other argument through a view) writes into
 * that buffer instead of a new one: the two values share one buffer.
 *
 * What allocates. ag_plan_new allocates the plan. The first run allocates the arena. Output
 * buffers come from per-buffer pools of storages: a storage whose only reference is the
 * pool's (the caller dropped every tensor and view of it) is reused, else a new one is made;
 * the tensor structs handed out come from per-output pools reused the same way (their
 * autograd fields are cleared first). At most one idle spare per pool is kept. So from the
 * second run on, a run allocates nothing if the caller released the previous run's outputs,
 * except what some kernels allocate internally as scratch (im2col in convolution, partial
 * sums in some reductions, contiguous copies for BLAS of oddly strided operands, dtype
 * conversions of mixed-dtype operands; tests/test_plan.c counts them) and the caller's scope
 * growing when outputs are given to it.
 *
 * Fusion (fuse.c, unless ag_plan_opts.no_fusion or AG_NO_FUSION=1). Runs of consecutive
 * kernel calls that a fused kernel computes in one pass (a residual add and the layer norm
 * after it, a layer norm's backward and the gradient add after it, cross-entropy's backward,
 * ...) become groups: the first step of a group runs the fused kernel on all members' bound
 * arguments, and the values the members read live until the group's last node, so the memory
 * plan never places a member's output over what the fused kernel still reads. A group whose
 * operands a run finds unsuitable runs its members one by one. Results are bit-identical.
 *
 * Higher-order calls (plan_calls.c, plan_flex.c). An invoke_subgraph call and a
 * flex_attention(_backward) call are steps like multi-output kernels whose outputs the memory
 * plan places as any other: the first runs its subgraph's own plan (one per subgraph) with the
 * step's buffers as destinations, the second its graphs' plans per tile; see there.
 *
 * Checking mode (ag_plan_opts.checking) fills every arena buffer with a poison pattern (a
 * NaN with a fixed payload for floats, 0xAB bytes otherwise) at the start of a run and as soon
 * as its last reader ran; before each kernel it checks that no two buffers alive at that node
 * overlap in the arena and that the first, middle and last elements of every arena operand
 * are not poison. A plan is not reentrant: one run at a time. */
#include "plan_internal.h"
#include "fuse.h"
#include "aotgrad/dist.h"
#include "../dist/pending.h"
#include "../graph/graph_internal.h"

#include <assert.h>
#include <stdio.h>
#include <stdlib.h>

static int64_t align_up(int64_t n) {
    return (n + AG_ALIGN - 1) / AG_ALIGN * AG_ALIGN;
}

static int64_t val_bytes(const ag_tmeta *m) {
    return ag__numel(m->ndim, m->sizes) * (int64_t)ag_dtype_size(m->dtype);
}

static const char *nname(const ag_plan *p, int node) {
    return p->names[node];
}

static bool same_shape(const ag_tmeta *a, const ag_tmeta *b) {
    if (a->dtype != b->dtype || a->ndim != b->ndim)
        return false;
    for (int d = 0; d < a->ndim; d++)
        if (a->sizes[d] != b->sizes[d])
            return false;
    return true;
}

static void set_geometry(ag_tensor *t, const ag_tmeta *m) {
    t->dtype = m->dtype;
    t->ndim = m->ndim;
    memcpy(t->sizes, m->sizes, sizeof t->sizes);
    memcpy(t->strides, m->strides, sizeof t->strides);
    t->offset = m->offset;
}

/* ---- pools ---- */

/* Points t at storage s, dropping its old storage (the tensor.c release, which is static
 * there: free data and struct at refcount 0). */
static void swap_storage(ag_tensor *t, ag_storage *s) {
    ag_storage *old = t->storage;
    s->refcount++;
    t->storage = s;
    ag__storage_release(old);
}

/* An idle handed-out struct (the caller dropped it): clear what the caller may have set and
 * stop holding its storage, so the storage can be seen free. */
static void reclaim(ag_plan *p, ag_tensor *t) {
    if (t->grad) {
        ag_tensor_free(t->grad);
        t->grad = NULL;
    }
    if (t->grad_fn) {
        ag__anode_release(t->grad_fn);
        t->grad_fn = NULL;
    }
    t->requires_grad = false;
    t->grad_donated = false;
    t->output_nr = 0;
    t->trace = NULL;
    t->trace_id = 0;
    if (t->storage != &p->dummy)
        swap_storage(t, &p->dummy);
}

static void pool_free(tpool *tp) {
    for (int64_t i = 0; i < tp->n; i++)
        ag_tensor_free(tp->t[i]);
    ag__free(tp->t);
    tp->t = NULL;
    tp->n = tp->cap = 0;
}

/* Frees idle entries beyond one spare (not `keep`); idle(t) says whether t is unused. */
static void pool_trim(tpool *tp, const ag_tensor *keep, bool (*idle)(const ag_tensor *)) {
    int spare = 0;
    int64_t w = 0;
    for (int64_t i = 0; i < tp->n; i++) {
        ag_tensor *t = tp->t[i];
        if (t != keep && idle(t) && spare++ >= 1) {
            ag_tensor_free(t);
            continue;
        }
        tp->t[w++] = t;
    }
    tp->n = w;
}

static bool owner_idle(const ag_tensor *t) {
    return t->storage->refcount == 1;
}
static bool slot_idle(const ag_tensor *t) {
    return t->refcount == 1;
}

/* ---- building: values ---- */

int ag__plan_val_of_node(const ag_plan *p, const ag_node *user, const ag_node *d, int *v) {
    int di = ag__node_index(d);
    if (ag__node_kind(d) == AG_NODE_CALL && ag__node_num_vals(d) > 1 &&
        ag__node_kind(user) != AG_NODE_GETITEM)
        return ag__err(AG_EINVAL, "plan_new: %%%s reads %%%s, which has %d outputs (use getitem)",
                       ag__node_name(user), ag__node_name(d), ag__node_num_vals(d));
    if (p->node_val[di] < 0)
        return ag__err(AG_EINVAL, "plan_new: %%%s reads %%%s, which has no value",
                       ag__node_name(user), ag__node_name(d));
    *v = p->node_val[di];
    return 0;
}

static int new_value(ag_plan *p, pv_kind kind, int node, const ag_tmeta *m) {
    int v = p->nvals++;
    pv *x = &p->vals[v];
    memset(x, 0, sizeof *x);
    x->kind = kind;
    x->node = node;
    x->root = v;
    x->buf = -1;
    x->ph = -1;
    x->last = node;
    if (m)
        x->val = *m;
    return v;
}

/* The values of g; *ncalls: its call nodes (the most steps a plan can have). */
static int count_values(const ag_graph *g, int *ncalls) {
    int n = 0;
    *ncalls = 0;
    for (ag_node *x = ag_graph_first(g); x; x = ag__node_next(x)) {
        ag_node_kind k = ag__node_kind(x);
        if (k == AG_NODE_PLACEHOLDER || k == AG_NODE_GET_ATTR)
            n++;
        else if (k == AG_NODE_CALL) {
            (*ncalls)++;
            uint32_t f = ag_op_def(ag__node_op(x))->flags;
            n += (f & AG_OP_VIEW) ? 1 : (f & AG_OP_INPLACE) ? 0 : ag__node_num_vals(x);
        }
    }
    return n;
}

/* Assigns every node its values (kinds, roots) and checks what the executor supports. */
static int assign_values(ag_plan *p, const ag_graph *g) {
    p->last_mut = -1;
    /* A subgraph call's answer walks its subgraph: asked once per run of calls of one. */
    const ag_op *mop = NULL;
    const ag_graph *msub = NULL;
    bool mut = false;
    for (ag_node *x = ag_graph_first(g); x; x = ag__node_next(x)) {
        const ag_graph *sub = ag__node_kind(x) == AG_NODE_CALL ? ag__call_subgraph(x) : NULL;
        if (ag__node_kind(x) == AG_NODE_CALL && (!sub || sub != msub || ag__node_op(x) != mop))
            mut = ag__plan_may_mutate(x), mop = ag__node_op(x), msub = sub;
        if (ag__node_kind(x) == AG_NODE_CALL && mut)
            p->last_mut = ag__node_index(x);
    }
    const ag_graph *pt_sub = NULL; /* the last subgraph called, its outputs' operands */
    int pt[AG_MAX_OUTPUTS], npt = 0;
    for (ag_node *x = ag_graph_first(g); x; x = ag__node_next(x)) {
        int i = ag__node_index(x);
        p->node_val[i] = -1;
        switch (ag__node_kind(x)) {
        case AG_NODE_PLACEHOLDER: {
            if (ag__node_num_vals(x) != 1)
                return ag__err(AG_EINVAL, "plan_new: placeholder %%%s has no val",
                               ag__node_name(x));
            int v = new_value(p, PV_INPUT, i, ag__node_val(x, 0));
            p->vals[v].ph = p->nph;
            p->ph_val[p->nph++] = v;
            p->node_val[i] = v;
            break;
        }
        case AG_NODE_GET_ATTR: {
            /* A subgraph has no value; one that invoke_subgraph calls gets a plan, one that
             * only flex_attention reads none here (its step plans it per tile shape). */
            if (ag__node_subgraph(x)) {
                bool invoked = false;
                for (int u = 0; u < ag__node_num_users(x) && !invoked; u++)
                    invoked = !ag__op_is_flex(ag__node_op(ag__node_user(x, u)));
                int rc = invoked ? ag__plan_subplan_of(p, ag__node_subgraph(x), NULL) : 0;
                if (rc)
                    return rc;
                break;
            }
            ag_tensor *c = ag_node_constant(x);
            if (!c || !c->storage->data)
                return ag__err(AG_EINVAL, "plan_new: %%%s: get_attr without a real constant",
                               ag__node_name(x));
            ag_tmeta m;
            ag__tmeta_of(c, &m);
            int v = new_value(p, PV_CONST, i, &m);
            p->tp[v] = ag_tensor_keep(c);
            p->node_val[i] = v;
            break;
        }
        case AG_NODE_GETITEM: {
            const ag_garg *a0 = ag__node_arg(x, 0), *a1 = ag__node_arg(x, 1);
            ag_node *src = a0 && a0->kind == AG_GA_NODE ? a0->u.node : NULL;
            int64_t k = a1 && a1->kind == AG_GA_INT ? a1->u.i : -1;
            if (!src || ag__node_kind(src) != AG_NODE_CALL || k < 0 ||
                k >= ag__node_num_vals(src) || p->node_val[ag__node_index(src)] < 0)
                return ag__err(AG_EINVAL, "plan_new: %%%s: bad getitem", ag__node_name(x));
            p->node_val[i] = p->node_val[ag__node_index(src)] + (int)k;
            if (p->vals[p->node_val[i]].pass) /* an operand passed through: read it */
                p->node_val[i] = p->vals[p->node_val[i]].pass - 1;
            break;
        }
        case AG_NODE_CALL: {
            const ag_op *op = ag__node_op(x);
            const ag_opdef *def = ag_op_def(op);
            int nv = ag__node_num_vals(x);
            if (def->flags & AG_OP_VIEW) {
                int base = -1;
                const ag_garg *a0 = ag__node_arg(x, 0);
                if (nv != 1 || !a0 || a0->kind != AG_GA_NODE || !a0->u.node)
                    return ag__err(AG_EINVAL, "plan_new: %%%s: view %s without a base",
                                   ag__node_name(x), ag_op_name(op));
                int rc = ag__plan_val_of_node(p, x, a0->u.node, &base);
                if (rc)
                    return rc;
                int v = new_value(p, PV_ALIAS, i, ag__node_val(x, 0));
                p->vals[v].root = p->vals[base].root;
                p->vals[v].dyn = p->vals[p->vals[base].root].kind == PV_INPUT;
                p->node_val[i] = v;
                break;
            }
            if (!def->kernel)
                return ag__err(AG_EINVAL,
                               "plan_new: %%%s: %s has no kernel (composite ops must be "
                               "decomposed before planning)",
                               ag__node_name(x), ag_op_name(op));
            if (nv > AG_MAX_OUTPUTS)
                return ag__err(AG_EINVAL, "plan_new: %%%s: %d outputs (at most %d)",
                               ag__node_name(x), nv, AG_MAX_OUTPUTS);
            if (def->flags & AG_OP_INPLACE) {
                const ag_garg *a0 = ag__node_arg(x, 0);
                if (nv != 1 || !a0 || a0->kind != AG_GA_NODE || !a0->u.node)
                    return ag__err(AG_EINVAL, "plan_new: %%%s: in-place %s without self",
                                   ag__node_name(x), ag_op_name(op));
                int rc = ag__plan_val_of_node(p, x, a0->u.node, &p->node_val[i]);
                if (rc)
                    return rc;
                break;
            }
            if (def->flags & AG_OP_SUBGRAPH) { /* its outputs' operands, once per subgraph */
                const ag_graph *sub = ag__node_subgraph(ag__node_arg_node(x, 0));
                if (sub != pt_sub)
                    npt = sub ? ag__subgraph_passthrough(sub, pt, AG_MAX_OUTPUTS) : 0;
                pt_sub = sub;
            }
            for (int k = 0; k < nv; k++) {
                int v = new_value(p, PV_BUF, i, ag__node_val(x, k));
                if (k == 0)
                    p->node_val[i] = v;
                int src = (def->flags & AG_OP_SUBGRAPH)
                              ? ag__plan_passthrough_value(p, x, k < npt ? pt[k] : -1)
                              : -1;
                if (src >= 0) {
                    p->vals[v].kind = PV_ALIAS;
                    p->vals[v].root = p->vals[src].root;
                    p->vals[v].pass = src + 1;
                }
            }
            break;
        }
        case AG_NODE_OUTPUT:
            break;
        }
    }
    return 0;
}

/* Calls fn(p, user index, value) for each tensor a node reads (getitem reads nothing: its
 * value is its source's). */
typedef int (*read_fn)(ag_plan *p, const ag_node *user, int v, void *ud);

static int for_each_read(ag_plan *p, const ag_node *x, read_fn fn, void *ud) {
    if (ag__node_kind(x) == AG_NODE_GETITEM)
        return 0;
    for (int i = 0; i < ag__node_nargs(x); i++) {
        const ag_garg *a = ag__node_arg(x, i);
        int cnt = ag__garg_nrefs(a);
        for (int k = 0; k < cnt; k++) {
            ag_node *d = ag__garg_ref(a, k);
            if (!d || ag__node_subgraph(d))
                continue;
            int v = -1, rc = ag__plan_val_of_node(p, x, d, &v);
            if (rc == 0)
                rc = fn(p, x, v, ud);
            if (rc)
                return rc;
        }
    }
    return 0;
}

static int note_read(ag_plan *p, const ag_node *user, int v, void *ud) {
    (void)ud;
    int t = ag__node_index(user);
    if (t > p->vals[v].last)
        p->vals[v].last = t;
    return 0;
}

/* ---- building: buffers ---- */

typedef struct inplace_q {
    int x;     /* candidate value */
    int other; /* set when another argument shares x's buffer */
} inplace_q;

static int buf_of(const ag_plan *p, int v) {
    return p->vals[p->vals[v].root].buf;
}

static int check_other(ag_plan *p, const ag_node *user, int v, void *ud) {
    (void)user;
    inplace_q *q = ud;
    if (v != q->x && buf_of(p, v) >= 0 && buf_of(p, v) == buf_of(p, q->x))
        q->other = 1;
    return 0;
}

/* The value whose buffer output value o of node x may take over, or -1. */
static int inplace_source(ag_plan *p, const ag_node *x, int o, const bool *out_root) {
    const ag_op *op = ag__node_op(x);
    const ag_opdef *def = ag_op_def(op);
    if (p->opts.no_inplace || !(def->flags & AG_OP_POINTWISE) || (def->flags & AG_OP_INPLACE) ||
        ag__node_num_vals(x) != 1 || out_root[o])
        return -1;
    for (int i = 0; i < op->nargs; i++)
        if (op->mutates[i])
            return -1;
    int t = ag__node_index(x);
    for (int i = 0; i < ag__node_nargs(x); i++) {
        const ag_garg *a = ag__node_arg(x, i);
        if (a->kind != AG_GA_NODE || !a->u.node)
            continue;
        int v = -1;
        if (ag__plan_val_of_node(p, x, a->u.node, &v))
            return -1;
        const pv *xv = &p->vals[v];
        if (xv->kind != PV_BUF || xv->buf < 0)
            continue;
        const pbuf *b = &p->bufs[xv->buf];
        if (b->out || b->end != t || b->size < align_up(val_bytes(&p->vals[o].val)) ||
            !same_shape(&xv->val, &p->vals[o].val))
            continue;
        inplace_q q = {.x = v};
        for_each_read(p, x, check_other, &q);
        if (!q.other)
            return v;
    }
    return -1;
}

static int plan_buffers(ag_plan *p, const ag_graph *g, const int *rend, const bool *out_root) {
    for (ag_node *x = ag_graph_first(g); x; x = ag__node_next(x)) {
        int i = ag__node_index(x);
        if (ag__node_kind(x) != AG_NODE_CALL)
            continue;
        uint32_t f = ag_op_def(ag__node_op(x))->flags;
        if (f & (AG_OP_VIEW | AG_OP_INPLACE))
            continue;
        for (int k = 0; k < ag__node_num_vals(x); k++) {
            int o = p->node_val[i] + k;
            pv *ov = &p->vals[o];
            if (ov->pass) /* an operand passed through: no buffer */
                continue;
            int src = k == 0 ? inplace_source(p, x, o, out_root) : -1;
            if (!out_root[o]) {
                p->sum_bytes += align_up(val_bytes(&ov->val));
                p->nplanned++;
            }
            if (src >= 0) {
                ov->buf = p->vals[src].buf;
                pbuf *b = &p->bufs[ov->buf];
                b->end = rend[o] > b->end ? rend[o] : b->end;
                p->ninplace++;
                continue;
            }
            pbuf *b = &p->bufs[p->nbufs]; /* malloc'd: each buffer is written whole here */
            ov->buf = p->nbufs++;
            int64_t bytes = val_bytes(&ov->val);
            *b = (pbuf){.bytes = bytes,
                        .size = align_up(bytes),
                        .start = i,
                        .end = rend[o],
                        .out = out_root[o],
                        .offset = -1,
                        .root = o,
                        .st = {.refcount = 1, .nbytes = (size_t)bytes}};
            if (b->out)
                p->out_bytes += b->bytes;
        }
    }
    /* Offsets for the arena buffers. */
    ag__mp_item *items = ag__malloc(sizeof *items * (size_t)(p->nbufs ? p->nbufs : 1));
    int *map = ag__malloc(sizeof *map * (size_t)(p->nbufs ? p->nbufs : 1));
    if (!items || !map) {
        ag__free(items);
        ag__free(map);
        return AG_ENOMEM;
    }
    int n = 0;
    for (int b = 0; b < p->nbufs; b++)
        if (!p->bufs[b].out) {
            items[n] = (ag__mp_item){
                .size = p->bufs[b].size, .start = p->bufs[b].start, .end = p->bufs[b].end};
            map[n++] = b;
        }
    int rc = ag__memplan(items, n, AG__MP_BEST, &p->arena_bytes);
    if (rc == 0) {
        p->ideal_bytes = ag__memplan_ideal(items, n);
        if (p->ideal_bytes < 0)
            rc = (int)p->ideal_bytes;
    }
    if (rc == 0) {
        for (int k = 0; k < n; k++) {
            /* Sizes are rounded to AG_ALIGN, so every offset stays aligned, inside the arena. */
            assert(items[k].size % AG_ALIGN == 0 && items[k].offset % AG_ALIGN == 0);
            assert(items[k].offset + items[k].size <= p->arena_bytes);
            p->bufs[map[k]].offset = items[k].offset;
        }
        assert(p->ideal_bytes <= p->arena_bytes);
        p->narena_bufs = n;
    }
    ag__free(items);
    ag__free(map);
    return rc;
}

/* ---- building: tensor structs and steps ---- */

/* The bytes of a call's step memory: 8-byte items (its output structs, then the tensor
 * pointers and ints of its arguments) first, then the
 * reads, then strings, rounded up to 8 so that the next step's block stays aligned. */
static size_t step_mem_bytes(const ag_node *x, size_t *wide_out, int *nreads_out) {
    size_t wide = sizeof(ag_tensor *) * (size_t)ag__node_num_vals(x), chars = 0; /* outs */
    int nreads = 0;
    for (int i = 0; i < ag__node_nargs(x); i++) {
        const ag_garg *a = ag__node_arg(x, i);
        if (a->kind == AG_GA_NODES || a->kind == AG_GA_TUPLE) {
            wide += sizeof(ag_tensor *) * (size_t)a->n;
            nreads += a->n;
        } else if (a->kind == AG_GA_INTS)
            wide += sizeof(int64_t) * (size_t)a->n;
        else if (a->kind == AG_GA_STR && a->u.s)
            chars += strlen(a->u.s) + 1;
        else if (a->kind == AG_GA_NODE)
            nreads++;
    }
    if (wide_out)
        *wide_out = wide;
    if (nreads_out)
        *nreads_out = nreads;
    return (wide + sizeof(int) * (size_t)nreads + chars + 7) / 8 * 8;
}

/* Converts node arguments to kernel arguments over the plan's structs into s->args (defaults
 * filled); lists, int arrays and strings are copied into s->mem, carved from p->step_mem. */
static int bind_args(ag_plan *p, const ag_node *x, pstep *s) {
    const ag_op *op = ag__node_op(x);
    int na = ag__node_nargs(x);
    size_t wide = 0;
    int nreads = 0;
    size_t bytes = step_mem_bytes(x, &wide, &nreads);
    if (p->step_mem_used + bytes > p->step_mem_size)
        return ag__err(AG_EINVAL, "plan_new: %%%s: step memory miscounted", ag__node_name(x));
    s->mem = p->step_mem + p->step_mem_used;
    p->step_mem_used += bytes;
    char *m = s->mem;
    s->reads = (int *)(m + wide);
    char *mstr = m + wide + sizeof(int) * (size_t)nreads;
    s->outs = (ag_tensor **)m; /* the output structs first (make_steps fills them) */
    m += sizeof(ag_tensor *) * (size_t)ag__node_num_vals(x);
    for (int k = 0; k < ag__node_num_vals(x); k++)
        s->outs[k] = NULL;
    ag_arg raw[AG_MAX_ARGS];
    for (int i = 0; i < na; i++) {
        const ag_garg *a = ag__node_arg(x, i);
        int v = -1;
        switch (a->kind) {
        case AG_GA_NONE:
            raw[i] = AG_A_NONE;
            break;
        case AG_GA_NODE:
            if (!a->u.node || ag__node_subgraph(a->u.node)) { /* a subgraph: the step's plan */
                raw[i] = AG_A_NONE;
                break;
            }
            if (ag__plan_val_of_node(p, x, a->u.node, &v))
                return ag_last_status();
            s->reads[s->nreads++] = v;
            raw[i] = AG_A_T(p->tp[v]);
            break;
        case AG_GA_NODES:
        case AG_GA_TUPLE: { /* a tuple: its tensors in place, NULL for its other elements */
            ag_tensor **ts = (ag_tensor **)m;
            m += sizeof(ag_tensor *) * (size_t)a->n;
            for (int k = 0; k < a->n; k++) {
                ag_node *d = ag__garg_ref(a, k);
                ts[k] = NULL;
                if (!d || ag__node_subgraph(d)) /* a flex mask graph */
                    continue;
                if (ag__plan_val_of_node(p, x, d, &v))
                    return ag_last_status();
                s->reads[s->nreads++] = v;
                ts[k] = p->tp[v];
            }
            raw[i] = AG_A_TS(ts, a->n);
            break;
        }
        case AG_GA_INT:
            raw[i] = AG_A_I(a->u.i);
            break;
        case AG_GA_FLOAT:
            raw[i] = AG_A_F(a->u.f);
            break;
        case AG_GA_BOOL:
            raw[i] = AG_A_B(a->u.b);
            break;
        case AG_GA_INTS: {
            int64_t *v2 = (int64_t *)m;
            m += sizeof(int64_t) * (size_t)a->n;
            if (a->n)
                memcpy(v2, a->u.ints, sizeof(int64_t) * (size_t)a->n);
            raw[i] = AG_A_INTS(v2, a->n);
            break;
        }
        case AG_GA_DTYPE:
            raw[i] = AG_A_DT(a->u.dt);
            break;
        case AG_GA_DICT: /* flex_attention's kernel_options: read at ag_plan_new */
            raw[i] = AG_A_NONE;
            break;
        case AG_GA_STR: {
            if (!a->u.s) {
                raw[i] = AG_A_NONE;
                break;
            }
            size_t len = strlen(a->u.s) + 1;
            memcpy(mstr, a->u.s, len);
            raw[i] = AG_A_S(mstr);
            mstr += len;
            break;
        }
        }
    }
    if (ag_op_def(op)->flags & AG_OP_SUBGRAPH) { /* run by its plan: no schema to fill */
        memcpy(s->args, raw, sizeof(ag_arg) * (size_t)na);
        return 0;
    }
    int rc = ag__op_check_args(op, raw, na, s->args);
    if (rc) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", ag_last_error());
        return ag__err(rc, "plan_new: %%%s: %s", ag__node_name(x), msg);
    }
    return 0;
}

/* The kernel's dtype, as the dispatcher picks it: the first tensor argument's, else the
 * first output's. */
static ag_dtype kernel_dtype(const pstep *s, int nargs, const ag_tmeta *out0) {
    for (int i = 0; i < nargs; i++) {
        if (s->args[i].kind == AG_ARG_TENSOR && s->args[i].u.t)
            return s->args[i].u.t->dtype;
        if (s->args[i].kind == AG_ARG_TENSORS)
            for (int k = 0; k < s->args[i].n; k++)
                if (s->args[i].u.ts[k])
                    return s->args[i].u.ts[k]->dtype;
    }
    return out0 ? out0->dtype : AG_F32;
}

/* Runs a view's meta function on the bound arguments and gives value v that geometry. */
static int view_geometry(ag_plan *p, const pstep *s, int v, const char *who) {
    ag_tmeta metas[AG_MAX_OUTPUTS];
    int rc = ag__op_run_meta(s->op, s->args, metas); /* it runs at every dynamic view step */
    if (rc < 0) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", ag_last_error());
        return ag__err(rc, "%s: %%%s: %s", who, nname(p, s->node), msg);
    }
    if (!same_shape(&metas[0], &p->vals[v].val)) {
        char got[112], want[112];
        ag__fmt_sizes(got, sizeof got, metas[0].ndim, metas[0].sizes);
        ag__fmt_sizes(want, sizeof want, p->vals[v].val.ndim, p->vals[v].val.sizes);
        return ag__err(AG_EINVAL, "%s: %%%s: view gives %s%s, the graph says %s%s", who,
                       nname(p, s->node), ag_dtype_short(metas[0].dtype), got,
                       ag_dtype_short(p->vals[v].val.dtype), want);
    }
    set_geometry(p->tp[v], &metas[0]);
    return 0;
}

/* Storage a value's struct points at before the first run (arena, or the dummy). */
static ag_storage *initial_storage(ag_plan *p, int v) {
    const pv *r = &p->vals[p->vals[v].root];
    if (r->kind == PV_CONST)
        return p->tp[p->vals[v].root]->storage;
    if (r->kind == PV_BUF && !p->bufs[r->buf].out)
        return &p->bufs[r->buf].st;
    return &p->dummy;
}

static int make_steps(ag_plan *p, const ag_graph *g) {
    /* Structs of inputs and buffers first: views read them. */
    for (int v = 0; v < p->nvals; v++) {
        pv *x = &p->vals[v];
        if (x->kind == PV_CONST)
            continue;
        ag_tensor *t = &p->tens[v];
        memset(t, 0, sizeof *t);
        t->refcount = 1;
        p->tp[v] = t;
        if (x->kind == PV_BUF) {
            ag_tmeta m;
            ag__tmeta_contiguous(&m, x->val.dtype, x->val.ndim, x->val.sizes);
            set_geometry(t, &m);
        } else {
            set_geometry(t, &x->val);
        }
        t->storage = initial_storage(p, v);
        t->is_view = x->kind == PV_ALIAS;
    }
    for (ag_node *x = ag_graph_first(g); x; x = ag__node_next(x)) {
        if (ag__node_kind(x) != AG_NODE_CALL)
            continue;
        int i = ag__node_index(x);
        const ag_op *op = ag__node_op(x);
        const ag_opdef *def = ag_op_def(op);
        pstep *s = &p->steps[p->nsteps];
        memset(s, 0, sizeof *s);
        s->node = i;
        s->op = op;
        int rc = bind_args(p, x, s);
        if (rc)
            return rc;
        if (def->flags & AG_OP_VIEW) {
            int v = p->node_val[i];
            rc = view_geometry(p, s, v, "plan_new");
            if (rc)
                return rc;
            if (!p->vals[v].dyn) /* fixed geometry: nothing to do at run time */
                continue;
            s->kind = STEP_VIEW;
            s->view_val = v;
            p->nview++;
            p->nsteps++;
            continue;
        }
        s->kind = STEP_KERNEL;
        if (ag__op_is_flex(op)) {
            if ((rc = ag__plan_flex_graphs_of(p, x)))
                return rc;
            s->flex = p->nflex;
        } else if (def->flags & AG_OP_SUBGRAPH) {
            int k = 0;
            if ((rc = ag__plan_subplan_of(p, ag__node_subgraph(ag__node_arg_node(x, 0)), &k)))
                return rc;
            s->sub = k + 1;
        }
        int nv = ag__node_num_vals(x);
        s->nouts = nv;
        for (int k = 0; k < nv; k++) {
            int v = p->node_val[i] + ((def->flags & AG_OP_INPLACE) ? 0 : k);
            /* an operand passed through: the subgraph's plan sees its struct as the output */
            s->outs[k] = p->tp[p->vals[v].pass ? p->vals[v].pass - 1 : v];
        }
        ag_dtype kdt = kernel_dtype(s, op->nargs, nv ? ag__node_val(x, 0) : NULL);
        p->nsteps++;
        p->nkernel++;
        if (!(def->dtypes & (1u << kdt)))
            return ag__err(AG_ENOTSUP, "plan_new: %%%s: %s has no kernel for dtype %s",
                           ag__node_name(x), ag_op_name(op), ag_dtype_short(kdt));
    }
    return 0;
}

static int make_outputs(ag_plan *p, const ag_graph *g, bool *out_root) {
    ag_node *o = ag_graph_output_node(g);
    const ag_garg *a = ag__node_arg(o, 0);
    p->out_node = ag__node_index(o);
    p->nouts = a->n;
    p->outs = ag__calloc((size_t)(a->n ? a->n : 1), sizeof *p->outs);
    p->pick = ag__calloc((size_t)(a->n ? a->n : 1), sizeof *p->pick);
    /* per value: its first output slot, or -1 */
    int *first_slot = ag__malloc(sizeof *first_slot * (size_t)(p->nvals ? p->nvals : 1));
    if (!p->outs || !p->pick || !first_slot) {
        ag__free(first_slot);
        return AG_ENOMEM;
    }
    for (int v = 0; v < p->nvals; v++)
        first_slot[v] = -1;
    int rc = 0;
    for (int k = 0; k < a->n && rc == 0; k++) {
        pout *po = &p->outs[k];
        po->val = -1;
        po->same_as = -1;
        if (!a->u.nodes[k])
            continue;
        if ((rc = ag__plan_val_of_node(p, o, a->u.nodes[k], &po->val)))
            break;
        po->same_as = first_slot[po->val];
        if (po->same_as < 0)
            first_slot[po->val] = k;
        int r = p->vals[po->val].root;
        if (p->vals[r].kind == PV_BUF)
            out_root[r] = true;
    }
    ag__free(first_slot);
    return rc;
}

/* Fusion (fuse.c): runs of consecutive kernel calls that one fused kernel computes. The
 * values a group's members read stay alive until its last member, so that no member's output
 * is placed over memory the fused kernel still reads (one-by-one execution would allow it). */
static int extend_read(ag_plan *p, const ag_node *user, int v, void *ud) {
    (void)user;
    int end = *(const int *)ud;
    if (p->vals[v].last < end)
        p->vals[v].last = end;
    return 0;
}

static int find_fused_groups(ag_plan *p, const ag_graph *g) {
    p->fuse_at = ag__calloc((size_t)(p->nnodes ? p->nnodes : 1), sizeof *p->fuse_at);
    if (!p->fuse_at)
        return AG_ENOMEM;
    ag_node *chain[AG__FUSE_MAX];
    ag_node *x = ag_graph_first(g);
    while (x) {
        if (ag__node_kind(x) != AG_NODE_CALL || (ag_op_def(ag__node_op(x))->flags & AG_OP_VIEW)) {
            x = ag__node_next(x);
            continue;
        }
        /* The kernel calls from x on, up to the next step that is not one (a view of an input
         * is recomputed each run: a step of its own). */
        int n = 0;
        for (ag_node *y = x; y && n < AG__FUSE_MAX; y = ag__node_next(y)) {
            if (ag__node_kind(y) != AG_NODE_CALL)
                continue;
            if (ag_op_def(ag__node_op(y))->flags & AG_OP_VIEW) {
                if (p->vals[p->node_val[ag__node_index(y)]].dyn)
                    break;
                continue;
            }
            chain[n++] = y;
        }
        ag__fuse_group grp;
        int len = n >= 2 ? ag__fuse_match(chain, n, &grp) : 0;
        if (len < 2) {
            x = ag__node_next(x);
            continue;
        }
        int end = ag__node_index(chain[len - 1]);
        for (int k = 0; k < len - 1 && !grp.f->reads_end_early; k++) {
            int rc = for_each_read(p, chain[k], extend_read, &end);
            if (rc)
                return rc;
        }
        p->fuse_at[ag__node_index(x)] = grp;
        p->nfused++;
        x = ag__node_next(chain[len - 1]);
    }
    return 0;
}

static int build(ag_plan *p, const ag_graph *g, bool verified) {
#ifndef NDEBUG
    verified = false; /* Debug builds (the sanitizer runs of the tests) check every graph */
#endif
    int rc = verified ? 0 : ag_graph_verify(g);
    if (rc) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", ag_last_error());
        return ag__err(rc, "plan_new: the graph does not verify: %s", msg);
    }
    int nn = ag_graph_num_nodes(g);
    p->nnodes = nn;
    size_t n1 = (size_t)(nn ? nn : 1);
    p->names = ag__calloc(n1, sizeof *p->names);
    p->node_val = ag__malloc(sizeof *p->node_val * n1);
    p->ph_val = ag__malloc(sizeof *p->ph_val * n1);
    int ncalls = 0, nv = count_values(g, &ncalls);
    p->steps = ag__malloc(sizeof *p->steps * (size_t)(ncalls ? ncalls : 1));
    size_t v1 = (size_t)(nv ? nv : 1);
    p->vals = ag__malloc(sizeof *p->vals * v1);
    p->tens = ag__malloc(sizeof *p->tens * v1);
    p->tp = ag__calloc(v1, sizeof *p->tp);
    p->bufs = ag__malloc(sizeof *p->bufs * v1); /* at most one per value, filled in order */
    int *rend = ag__malloc(sizeof *rend * v1);
    bool *out_root = ag__calloc(v1, sizeof *out_root);
    if (!p->names || !p->node_val || !p->ph_val || !p->steps || !p->vals || !p->tens || !p->tp ||
        !p->bufs || !rend || !out_root) {
        rc = AG_ENOMEM;
        goto done;
    }
    /* Node names and the steps' argument memory, each in one block. */
    size_t name_bytes = 0;
    for (ag_node *x = ag_graph_first(g); x; x = ag__node_next(x)) {
        name_bytes += strlen(ag__node_name(x)) + 1;
        if (ag__node_kind(x) == AG_NODE_CALL)
            p->step_mem_size += step_mem_bytes(x, NULL, NULL);
    }
    p->name_chars = ag__malloc(name_bytes);
    p->step_mem = ag__malloc(p->step_mem_size ? p->step_mem_size : 1);
    if (!p->name_chars || !p->step_mem) {
        rc = AG_ENOMEM;
        goto done;
    }
    char *nc = p->name_chars;
    for (ag_node *x = ag_graph_first(g); x; x = ag__node_next(x)) {
        size_t len = strlen(ag__node_name(x)) + 1;
        memcpy(nc, ag__node_name(x), len);
        p->names[ag__node_index(x)] = nc;
        nc += len;
    }
    if ((rc = assign_values(p, g)))
        goto done;
    /* Last reads; a view's reads keep its root alive. */
    for (ag_node *x = ag_graph_first(g); x; x = ag__node_next(x))
        if ((rc = for_each_read(p, x, note_read, NULL)))
            goto done;
    if (!p->opts.no_fusion && !ag__fuse_disabled_by_env() && (rc = find_fused_groups(p, g)))
        goto done;
    for (int v = 0; v < p->nvals; v++)
        rend[v] = p->vals[v].last;
    for (int v = 0; v < p->nvals; v++) {
        int r = p->vals[v].root;
        if (p->vals[v].last > rend[r])
            rend[r] = p->vals[v].last;
    }
    if ((rc = make_outputs(p, g, out_root)) || (rc = plan_buffers(p, g, rend, out_root)) ||
        (rc = make_steps(p, g)))
        goto done;
    if (p->fuse_at)
        for (int si = 0; si < p->nsteps; si++)
            p->steps[si].fuse = p->fuse_at[p->steps[si].node];
    if (p->opts.checking) {
        size_t b1 = (size_t)(p->nbufs ? p->nbufs : 1);
        p->by_end = ag__malloc(sizeof *p->by_end * b1);
        p->live = ag__malloc(sizeof *p->live * b1);
        if (!p->by_end || !p->live) {
            rc = AG_ENOMEM;
            goto done;
        }
    }
done:
    ag__free(rend);
    ag__free(out_root);
    return rc;
}

int ag__plan_fused_groups(const ag_plan *p, const char **names, const char **first, int max) {
    int k = 0;
    for (int si = 0; p && si < p->nsteps; si++)
        if (p->steps[si].fuse.f) {
            if (k < max) {
                names[k] = p->steps[si].fuse.f->name;
                first[k] = nname(p, p->steps[si].node);
            }
            k++;
        }
    return k;
}

static ag_plan *plan_new(const ag_graph *g, const ag_plan_opts *opts, bool verified) {
    ag_plan *p = ag__calloc(1, sizeof *p);
    if (!p)
        return NULL;
    if (opts)
        p->opts = *opts;
    p->dummy.refcount = 1;
    /* Views of inputs are laid out at plan_new, before any storage is bound: as_strided's
     * bound check must not fail on the data-less stand-in (runs use the real storage). */
    p->dummy.nbytes = (size_t)1 << 62;
    if (build(p, g, verified)) {
        int rc = ag_last_status();
        char msg[512];
        snprintf(msg, sizeof msg, "%s", ag_last_error());
        ag_plan_free(p);
        ag__err(rc < 0 ? rc : AG_EINVAL, "%s", msg); /* freeing may not clobber it, but be sure */
        return NULL;
    }
    if (ag__coll_check_wanted(opts))
        for (int si = 0; si < p->nsteps && !p->coll_check; si++)
            p->coll_check = p->steps[si].kind == STEP_KERNEL &&
                            (ag_op_def(p->steps[si].op)->flags & AG_OP_COLLECTIVE);
    return p;
}

ag_plan *ag_plan_new(const ag_graph *g, const ag_plan_opts *opts) {
    AG__CHECK_NULL_RET("plan_new", g, NULL);
    return plan_new(g, opts, false);
}

ag_plan *ag__plan_new_verified(const ag_graph *g, const ag_plan_opts *opts) {
    return plan_new(g, opts, true);
}

/* The first run of a plan with collectives: the ranks compare their sequences of them. */
int ag__plan_check_collectives(ag_plan *p) {
    int n = 0;
    for (int si = 0; si < p->nsteps; si++)
        n += p->steps[si].kind == STEP_KERNEL &&
             (ag_op_def(p->steps[si].op)->flags & AG_OP_COLLECTIVE);
    ag__coll_step *cs = ag__malloc(sizeof *cs * (size_t)(n ? n : 1));
    if (!cs)
        return AG_ENOMEM;
    n = 0;
    for (int si = 0; si < p->nsteps; si++) {
        const pstep *s = &p->steps[si];
        if (s->kind == STEP_KERNEL && (ag_op_def(s->op)->flags & AG_OP_COLLECTIVE))
            cs[n++] = (ag__coll_step){s->op, s->args, s->outs[0], nname(p, s->node)};
    }
    int rc = ag__coll_check(cs, n);
    ag__free(cs);
    if (rc == 0)
        p->coll_check = false;
    return rc;
}

void ag_plan_free(ag_plan *p) {
    if (!p)
        return;
    if (p->outs)
        for (int k = 0; k < p->nouts; k++)
            pool_free(&p->outs[k].pool);
    if (p->bufs)
        for (int b = 0; b < p->nbufs; b++)
            pool_free(&p->bufs[b].owners);
    if (p->vals && p->tp)
        for (int v = 0; v < p->nvals; v++)
            if (p->vals[v].kind == PV_CONST)
                ag_tensor_free(p->tp[v]);
    ag__free(p->step_mem);
    ag__free(p->name_chars);
    ag__free(p->names);
    ag__free(p->node_val);
    ag__free(p->ph_val);
    ag__free(p->steps);
    ag__free(p->vals);
    ag__free(p->tens);
    ag__free(p->tp);
    ag__free(p->bufs);
    ag__free(p->outs);
    ag__free(p->pick);
    ag__free(p->arena);
    ag__free(p->by_end);
    ag__free(p->live);
    ag__free(p->fuse_at);
    for (int k = 0; k < p->nsubplans; k++)
        ag_plan_free(p->subplans[k]);
    for (int k = 0; k < p->nflex; k++)
        ag__plan_flex_free(&p->flex[k]);
    ag__free(p->flex);
    ag__free(p->subplans);
    ag__free(p->subgraphs);
    ag__free(p);
}

int64_t ag_plan_peak_bytes(const ag_plan *p) {
    if (!p)
        return 0;
    /* The plans it runs inside its steps hold their own arenas, alive with it. */
    int64_t b = p->arena_bytes;
    for (int k = 0; k < p->nsubplans; k++)
        b += ag_plan_peak_bytes(p->subplans[k]);
    for (int k = 0; k < p->nflex; k++)
        b += ag__plan_flex_bytes(&p->flex[k]);
    return b;
}
int64_t ag_plan_output_bytes(const ag_plan *p) {
    return p ? p->out_bytes : 0;
}

void ag__plan_get_stats(const ag_plan *p, ag__plan_stats *s) {
    memset(s, 0, sizeof *s);
    if (!p)
        return;
    s->nodes = p->nnodes;
    s->kernel_steps = p->nkernel;
    s->view_steps = p->nview;
    s->values = p->nplanned;
    s->buffers = p->narena_bufs;
    s->inplace = p->ninplace;
    for (int b = 0; b < p->nbufs; b++)
        if (p->bufs[b].out) {
            s->output_buffers++;
            s->pooled_storages += p->bufs[b].owners.n;
        }
    s->fused_groups = p->nfused;
    s->subplans = p->nsubplans;
    for (int k = 0; k < p->nsubplans; k++) {
        ag__plan_stats ss;
        ag__plan_get_stats(p->subplans[k], &ss);
        s->subplan_runs += ss.runs;
        s->subplan_direct_outputs += ss.direct_outputs;
        s->subplan_passed_outputs += ss.passed_outputs;
        s->subplan_copied_outputs += ss.copied_outputs;
    }
    s->passed_outputs = p->npass;
    s->copied_outputs = p->ncopy;
    s->runs = p->nruns;
    s->direct_outputs = p->ninto;
    s->fused_declined = p->fused_declined;
    s->arena_bytes = p->arena_bytes;
    s->sum_bytes = p->sum_bytes;
    s->ideal_bytes = p->ideal_bytes;
    s->output_bytes = p->out_bytes;
}

int ag__plan_debug_move(ag_plan *p, const char *name, int64_t offset, const char *end_at) {
    int node = -1, end = -1;
    for (int i = 0; i < p->nnodes; i++) {
        if (strcmp(p->names[i], name) == 0)
            node = i;
        if (end_at && strcmp(p->names[i], end_at) == 0)
            end = i;
    }
    if (node < 0 || p->node_val[node] < 0 || (end_at && end < 0))
        return ag__err(AG_EINVAL, "plan_debug_move: no node %s", node < 0 ? name : end_at);
    const pv *x = &p->vals[p->node_val[node]];
    if (x->kind != PV_BUF || p->bufs[x->buf].out || p->arena)
        return ag__err(AG_EINVAL, "plan_debug_move: %%%s has no arena buffer (or ran)", name);
    pbuf *b = &p->bufs[x->buf];
    if (offset >= 0) {
        if (offset + b->size > p->arena_bytes)
            return ag__err(AG_EINVAL, "plan_debug_move: offset %lld outside the arena",
                           (long long)offset);
        b->offset = offset;
    }
    if (end >= 0)
        b->end = end;
    return 0;
}

/* ---- running ---- */

static const uint32_t POISON_F32 = 0x7fc0dead;
static const uint64_t POISON_F64 = 0x7ff8deadbeefdeadull;

static void poison(pbuf *b, ag_dtype dt) {
    char *d = b->st.data;
    size_t n = (size_t)b->bytes;
    if (dt == AG_F32)
        for (size_t i = 0; i + 4 <= n; i += 4)
            memcpy(d + i, &POISON_F32, 4);
    else if (dt == AG_F64)
        for (size_t i = 0; i + 8 <= n; i += 8)
            memcpy(d + i, &POISON_F64, 8);
    else
        memset(d, 0xab, n);
}

static bool is_poison(const ag_tensor *t, int64_t i) {
    int64_t off = t->offset;
    for (int d = t->ndim - 1; d >= 0; d--) {
        off += (i % t->sizes[d]) * t->strides[d];
        i /= t->sizes[d];
    }
    size_t es = ag_dtype_size(t->dtype);
    const char *e = (const char *)t->storage->data + (size_t)off * es;
    if (t->dtype == AG_F32)
        return memcmp(e, &POISON_F32, 4) == 0;
    if (t->dtype == AG_F64)
        return memcmp(e, &POISON_F64, 8) == 0;
    for (size_t k = 0; k < es; k++)
        if ((unsigned char)e[k] != 0xab)
            return false;
    return true;
}

static int check_before(ag_plan *p, const pstep *s) {
    /* No two arena buffers alive at this node overlap (sorted by offset, neighbours). */
    int t = s->node, n = 0;
    for (int b = 0; b < p->nbufs; b++) {
        const pbuf *x = &p->bufs[b];
        if (!x->out && x->size > 0 && x->start <= t && t <= x->end) {
            int k = n++;
            while (k > 0 && p->bufs[p->live[k - 1]].offset > x->offset) {
                p->live[k] = p->live[k - 1];
                k--;
            }
            p->live[k] = b;
        }
    }
    for (int k = 1; k < n; k++) {
        const pbuf *a = &p->bufs[p->live[k - 1]], *b = &p->bufs[p->live[k]];
        if (a->offset + a->size > b->offset)
            return ag__err(AG_ESTATE,
                           "plan: before %%%s: the buffers of %%%s [%lld, %lld) and %%%s "
                           "[%lld, %lld) are both alive and overlap",
                           nname(p, t), nname(p, p->vals[a->root].node), (long long)a->offset,
                           (long long)(a->offset + a->size), nname(p, p->vals[b->root].node),
                           (long long)b->offset, (long long)(b->offset + b->size));
    }
    /* Operands in the arena are not poison (first, middle and last elements). wait_tensor (the
     * collective that is also pointwise) is exempt: its operand is the output of a collective
     * in flight, which MPI fills only when this very step completes it. */
    uint32_t f = ag_op_def(s->op)->flags;
    bool completes = (f & AG_OP_COLLECTIVE) && (f & AG_OP_POINTWISE);
    for (int r = 0; r < s->nreads && !completes; r++) {
        int v = s->reads[r];
        int bi = buf_of(p, v);
        if (bi < 0 || p->bufs[bi].out)
            continue;
        const ag_tensor *x = p->tp[v];
        int64_t ne = ag__numel(x->ndim, x->sizes);
        if (ne == 0)
            continue;
        int64_t at[3] = {0, ne / 2, ne - 1};
        for (int k = 0; k < 3; k++)
            if (is_poison(x, at[k]))
                return ag__err(AG_ESTATE,
                               "plan: %%%s reads %%%s (element %lld), whose buffer was freed "
                               "(poisoned)",
                               nname(p, t), nname(p, p->vals[v].node), (long long)at[k]);
    }
    return 0;
}

/* Arena buffers sorted by end, so the poisoning after each step walks forward. */
static void sort_by_end(ag_plan *p, int *n) {
    int k = 0;
    for (int b = 0; b < p->nbufs; b++) {
        if (p->bufs[b].out)
            continue;
        int j = k++;
        while (j > 0 && p->bufs[p->by_end[j - 1]].end > p->bufs[b].end) {
            p->by_end[j] = p->by_end[j - 1];
            j--;
        }
        p->by_end[j] = b;
    }
    *n = k;
}

int ag__plan_bind_inputs(ag_plan *p, ag_tensor *const *inputs, int ninputs) {
    if (ninputs != p->nph)
        return ag__err(AG_EINVAL, "plan: the graph has %d placeholders, %d inputs given", p->nph,
                       ninputs);
    for (int k = 0; k < p->nph; k++) {
        const pv *x = &p->vals[p->ph_val[k]];
        const ag_tensor *in = inputs[k];
        if (!in)
            return ag__err(AG_EINVAL, "plan: input %d (%%%s) is NULL", k, nname(p, x->node));
        ag_tmeta m;
        ag__tmeta_of(in, &m);
        if (!same_shape(&m, &x->val)) {
            char got[128], sz[112], want[128];
            ag_tensor_meta_str(in, got, sizeof got);
            ag__fmt_sizes(sz, sizeof sz, x->val.ndim, x->val.sizes);
            snprintf(want, sizeof want, "%s%s", ag_dtype_short(x->val.dtype), sz);
            return ag__err(AG_EINVAL, "plan: input %d (%%%s) is %s but the placeholder expects %s",
                           k, nname(p, x->node), got, want);
        }
        if (!in->storage->data)
            return ag__err(AG_EINVAL, "plan: input %d (%%%s) is a meta tensor (no data)", k,
                           nname(p, x->node));
    }
    for (int k = 0; k < p->nph; k++) {
        ag_tensor *t = &p->tens[p->ph_val[k]];
        ag_tmeta m;
        ag__tmeta_of(inputs[k], &m);
        set_geometry(t, &m);
        t->storage = inputs[k]->storage;
    }
    return 0;
}

/* Takes this run's storage for every output buffer (reusing free ones) and points every
 * value at its storage. On ENOMEM nothing is handed out and the pools stay consistent. */
/* This run's storage of each output buffer not bound to a caller's storage: an idle one from
 * its pool, else a new one. */
int ag__plan_acquire_out_buffers(ag_plan *p) {
    for (int bi = 0; bi < p->nbufs; bi++) {
        pbuf *b = &p->bufs[bi];
        if (!b->out || b->into)
            continue;
        b->cur = NULL;
        for (int64_t i = 0; i < b->owners.n && !b->cur; i++)
            if (owner_idle(b->owners.t[i]))
                b->cur = b->owners.t[i];
        if (!b->cur) {
            if (ag__grow((void **)&b->owners.t, &b->owners.cap, b->owners.n + 1,
                         sizeof(ag_tensor *)))
                return AG_ENOMEM;
            ag_tensor *o = ag__tensor_from_meta(&p->vals[b->root].val, false);
            if (!o)
                return ag_last_status();
            b->owners.t[b->owners.n++] = o;
            b->cur = o;
        }
        pool_trim(&b->owners, b->cur, owner_idle);
    }
    /* Every value rooted at an input or an output buffer takes this run's storage. */
    for (int v = 0; v < p->nvals; v++) {
        const pv *x = &p->vals[v];
        const pv *r = &p->vals[x->root];
        if (x->kind == PV_CONST || x->kind == PV_INPUT)
            continue;
        if (r->kind == PV_INPUT)
            p->tens[v].storage = p->tens[x->root].storage;
        else if (r->kind == PV_BUF && p->bufs[r->buf].out)
            p->tens[v].storage =
                p->bufs[r->buf].into ? p->bufs[r->buf].into : p->bufs[r->buf].cur->storage;
    }
    return 0;
}

static int acquire_storages(ag_plan *p) {
    for (int bi = 0; bi < p->nbufs; bi++)
        p->bufs[bi].into = NULL;
    for (int k = 0; k < p->nouts; k++) {
        tpool *tp = &p->outs[k].pool;
        for (int64_t i = 0; i < tp->n; i++)
            if (slot_idle(tp->t[i]))
                reclaim(p, tp->t[i]);
    }
    return ag__plan_acquire_out_buffers(p);
}

/* Per thread: a profiler sees the steps of the plans its own thread runs. */
static _Thread_local ag__plan_step_fn step_hook;
static _Thread_local void *step_hook_ud;

void ag__plan_set_step_hook(ag__plan_step_fn fn, void *ud) {
    step_hook = fn;
    step_hook_ud = ud;
}

/* Calls one step's kernel (a subgraph's or flex_attention's call: plan_calls.c); bumps the
 * versions of what it mutates. */
static int run_kernel(ag_plan *p, pstep *s, ag__tls_state *ts) {
    if (s->sub)
        return ag__plan_run_subgraph(p, s);
    if (step_hook)
        step_hook(ag_op_name(s->op), nname(p, s->node), step_hook_ud);
    if (s->flex)
        return ag__plan_run_flex(p, s);
    ts->dispatch_depth++;
    int rc = ag_op_def(s->op)->kernel(s->args, s->outs);
    ts->dispatch_depth--;
    if (rc < 0) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", ag_last_error());
        return ag__err(rc, "plan: %%%s: %s", nname(p, s->node), msg);
    }
    for (int i = 0; i < s->op->nargs; i++)
        if (s->op->mutates[i] && s->args[i].kind == AG_ARG_TENSOR && s->args[i].u.t)
            s->args[i].u.t->storage->version++;
    return 0;
}

/* Runs the fused group that starts at step si: 0, a negative status, or 1 (declined, nothing
 * written that the members' one-by-one run would not overwrite). */
static int run_fused(ag_plan *p, int si, ag__tls_state *ts) {
    const pstep *s = &p->steps[si];
    ag__fuse_member m[AG__FUSE_MAX];
    for (int k = 0; k < s->fuse.f->n; k++) {
        const pstep *x = &p->steps[si + k];
        m[k] = (ag__fuse_member){x->op, x->args, x->outs};
    }
    if (step_hook)
        step_hook(s->fuse.f->label, nname(p, s->node), step_hook_ud);
    ts->dispatch_depth++;
    int rc = s->fuse.f->run(m, s->fuse.flags);
    ts->dispatch_depth--;
    if (rc < 0) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", ag_last_error());
        return ag__err(rc, "plan: %%%s (fused %s): %s", nname(p, s->node), s->fuse.f->name, msg);
    }
    return rc;
}

/* A run that failed may have started collectives whose wait_tensor never ran: MPI would
 * still write into the arena, which the caller may free with the plan. Complete them here
 * (each rank runs the same steps, so the peers reach these collectives too; a peer that never
 * does ends the job through the timeout watchdog). A started collective has no pending entry
 * once its wait ran, and ag__coll_wait does nothing then. */
void ag__plan_settle_collectives(ag_plan *p) {
    for (int si = 0; si < p->nsteps; si++) {
        const pstep *s = &p->steps[si];
        if (s->kind == STEP_KERNEL && (ag_op_def(s->op)->flags & AG_OP_COLLECTIVE) &&
            s->nouts > 0 && s->outs[0] && s->outs[0]->storage->data)
            ag__coll_wait(ag__base(s->outs[0]));
    }
}

int ag__plan_run_steps(ag_plan *p) {
    int nend = 0, next_end = 0;
    if (p->opts.checking) {
        sort_by_end(p, &nend);
        for (int b = 0; b < p->nbufs; b++)
            if (!p->bufs[b].out)
                poison(&p->bufs[b], p->vals[p->bufs[b].root].val.dtype);
    }
    ag__tls_state *ts = ag__tls();
    for (int si = 0; si < p->nsteps; si++) {
        pstep *s = &p->steps[si];
        if (s->kind == STEP_VIEW) {
            int rc = view_geometry(p, s, s->view_val, "plan");
            if (rc)
                return rc;
            continue;
        }
        if (p->opts.checking) {
            int rc = check_before(p, s);
            if (rc)
                return rc;
        }
        /* A fused group runs as one kernel, unless it declines this run's operands: then its
         * members run one by one, this one now and the others as the next steps. */
        int rc = s->fuse.f ? run_fused(p, si, ts) : 1;
        if (rc < 0)
            return rc;
        /* Values that died inside a group whose reads end early may have had their bytes
         * written by a later member's outputs already: not poisoned. */
        int keep_from = p->nnodes, keep_to = -1;
        if (rc == 0) {
            if (s->fuse.f->reads_end_early) {
                keep_from = s->node;
                keep_to = p->steps[si + s->fuse.f->n - 1].node;
            }
            si += s->fuse.f->n - 1;
        } else {
            if (s->fuse.f)
                p->fused_declined++;
            if ((rc = run_kernel(p, s, ts)))
                return rc;
        }
        /* Collectives started by earlier steps move on while this one's successors compute
         * (one atomic load when none is in flight). */
        ag_dist_progress();
        if (p->opts.checking) {
            /* Poison what no later step reads. */
            int horizon = si + 1 < p->nsteps ? p->steps[si + 1].node : p->nnodes;
            while (next_end < nend && p->bufs[p->by_end[next_end]].end < horizon) {
                pbuf *b = &p->bufs[p->by_end[next_end++]];
                if (b->end < keep_from || b->end >= keep_to)
                    poison(b, p->vals[b->root].val.dtype);
            }
        }
    }
    if (step_hook)
        step_hook(NULL, NULL, step_hook_ud);
    return 0;
}

/* Hands out the outputs: new references, the inputs and constants themselves, the rest
 * through the per-slot pools. */
static int take_outputs(ag_plan *p, ag_tensor *const *inputs, ag_tensor **outs) {
    /* Phase 1 (may fail, hands out nothing): a struct for every slot that needs one. */
    ag_tensor **pick = p->pick;
    int rc = 0;
    for (int k = 0; k < p->nouts; k++) {
        pout *po = &p->outs[k];
        pick[k] = NULL;
        if (po->val < 0 || po->same_as >= 0)
            continue;
        pv_kind kind = p->vals[po->val].kind;
        if (kind == PV_INPUT || kind == PV_CONST)
            continue;
        for (int64_t i = 0; i < po->pool.n && !pick[k]; i++)
            if (slot_idle(po->pool.t[i]))
                pick[k] = po->pool.t[i];
        if (!pick[k]) {
            if (ag__grow((void **)&po->pool.t, &po->pool.cap, po->pool.n + 1,
                         sizeof(ag_tensor *))) {
                rc = AG_ENOMEM;
                break;
            }
            ag_tmeta m;
            ag__tmeta_of(p->tp[po->val], &m);
            ag_tensor *t = ag__tensor_alias(p->tp[po->val], &m);
            if (!t) {
                rc = ag_last_status();
                break;
            }
            po->pool.t[po->pool.n++] = t;
            pick[k] = t;
        } else {
            ag_tmeta m;
            ag__tmeta_of(p->tp[po->val], &m);
            set_geometry(pick[k], &m);
            swap_storage(pick[k], p->tp[po->val]->storage);
        }
        pick[k]->is_view = p->vals[po->val].kind == PV_ALIAS;
        pool_trim(&po->pool, pick[k], slot_idle);
    }
    /* Phase 2: references. */
    if (rc == 0)
        for (int k = 0; k < p->nouts; k++) {
            const pout *po = &p->outs[k];
            if (po->val < 0)
                outs[k] = NULL;
            else if (po->same_as >= 0)
                outs[k] = ag_tensor_keep(outs[po->same_as]);
            else if (p->vals[po->val].kind == PV_INPUT)
                outs[k] = ag_tensor_keep(inputs[p->vals[po->val].ph]);
            else if (p->vals[po->val].kind == PV_CONST)
                outs[k] = ag_tensor_keep(p->tp[po->val]);
            else
                outs[k] = ag_tensor_keep(pick[k]);
        }
    return rc;
}

/* The arena, allocated by the first run. */
int ag__plan_ensure_arena(ag_plan *p) {
    if (p->arena)
        return 0;
    p->arena = ag__malloc((size_t)(p->arena_bytes > 0 ? p->arena_bytes : AG_ALIGN));
    if (!p->arena)
        return AG_ENOMEM;
    for (int b = 0; b < p->nbufs; b++)
        if (!p->bufs[b].out)
            p->bufs[b].st.data = p->arena + p->bufs[b].offset;
    return 0;
}

int ag_plan_run(ag_plan *p, ag_tensor *const *inputs, int ninputs, ag_tensor **outs, int max_out) {
    AG__CHECK_NULL("plan_run", p);
    if (ninputs > 0)
        AG__CHECK_NULL("plan_run", inputs);
    if (max_out > 0)
        AG__CHECK_NULL("plan_run", outs);
    if (p->nouts > max_out || (p->nouts > 0 && !outs))
        return ag__err(AG_EINVAL, "plan: the graph has %d outputs, room for %d given", p->nouts,
                       max_out);
    int rc = ag__plan_bind_inputs(p, inputs, ninputs);
    if (rc)
        return rc;
    if (p->coll_check && (rc = ag__plan_check_collectives(p)))
        return rc;
    if ((rc = ag__plan_ensure_arena(p)))
        return rc;
    if ((rc = acquire_storages(p)))
        return rc;
    /* Kernels that call ops internally hand their temporaries to a scope: ours. */
    bool caller_scope = ag__in_scope();
    ag_scope_begin();
    rc = ag__plan_run_steps(p);
    ag_scope_end();
    if (rc) {
        ag__plan_settle_collectives(p);
        return rc;
    }
    if ((rc = take_outputs(p, inputs, outs)))
        return rc;
    p->nruns++;
    if (caller_scope)
        for (int k = 0; k < p->nouts; k++)
            if (outs[k] && !ag__give(outs[k])) {
                /* ag__give released outs[k]; the earlier ones belong to the scope now. */
                for (int j = k; j < p->nouts; j++) {
                    if (j > k)
                        ag_tensor_free(outs[j]);
                    outs[j] = NULL;
                }
                return AG_ENOMEM;
            }
    return p->nouts;
}
