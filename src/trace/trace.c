/* The tracer: turns op calls on data-less tensors into graph nodes (see include/aotgrad/trace.h).
 *
 * In: a function or module and example inputs. Out: a graph whose placeholders are the inputs,
 * whose call nodes are the ops the code ran (composites already decomposed by the dispatcher),
 * and whose nodes carry stack_trace, custom annotations, seq_nr and is_gradient_acc.
 *
 * Mechanics: while a trace is active the thread is in meta mode (kernels are skipped, factories
 * make data-less tensors) and the dispatcher's trace hook points here. Each tensor remembers its
 * node (tensor->trace) together with the id of the trace that made it, so tensors left over
 * from an earlier trace are never confused with this one's. */
#include "../autograd/flex_internal.h"
#include "../graph/graph_internal.h"
#include "../nn/nn_internal.h"
#include "aotgrad/trace.h"
#include "trace_views.h"
#include "../core/call_sites.h"

#include <stdio.h>
#include <stdlib.h>

/* ---- annotations ---- */

#define MAX_ANN 64
typedef struct ann {
    char key[64];
    ag_mval v;
    char str[128];
} ann;
static _Thread_local ann anns[MAX_ANN];
static _Thread_local int nanns;
/* The first annotation nodes get: a nested region's session starts above the annotations
 * open around the call (its nodes do not inherit them, as upstream). */
static _Thread_local int ann_base;

void ag_annotate_begin(const char *key, ag_mval v) {
    if (nanns < MAX_ANN && key) {
        ann *a = &anns[nanns];
        snprintf(a->key, sizeof a->key, "%s", key);
        a->v = v;
        if (v.kind == AG_MV_STR) {
            snprintf(a->str, sizeof a->str, "%s", v.u.s ? v.u.s : "");
            a->v.u.s = a->str;
        }
    }
    nanns++;
}

void ag_annotate_end(void) {
    if (nanns > ann_base)
        nanns--;
}

int ag_annotate_fn(const char *key, ag_mval value, const char *fn_name, int (*fn)(void *),
                   void *ud) {
    AG__CHECK_NULL("annotate_fn", fn);
    ag_annotate_begin(key, value);
    ag_site_push();
    /* Until fn records sites of its own, its ops are attributed to fn itself. */
    ag__sites *S = ag__sites_tls();
    S->cur.func = fn_name;
    S->gen++;
    int rc = fn(ud);
    ag_site_pop();
    ag_annotate_end();
    return rc;
}

/* ---- meta mode ---- */

bool ag_set_meta_mode(bool on) {
    ag__tls_state *ts = ag__tls();
    bool prev = ts->tracing;
    ts->tracing = on;
    return prev;
}

bool ag_is_meta(const ag_tensor *t) {
    return t && ag__is_meta(t);
}

/* ---- the tracer ---- */

typedef struct src_file {
    const char *path; /* the __FILE__ pointer */
    char *text;
    char **lines;
    int nlines;
} src_file;

/* A module call in progress (nn_module_stack): the stack's text up to and including it, in
 * the graph's pool (NULL: no module's frame is open). */
typedef struct mframe {
    const ag_module *m;
    const char *stack;
    int depth; /* frames in stack */
} mframe;

typedef struct ag__tracer tracer;
struct ag__tracer {
    ag_graph *g;
    uint64_t id;
    ag_trace_opts opts;
    uint64_t trace_gen; /* sites.gen the cached stack string was built for */
    char *trace_str;
    src_file *files;
    int64_t nfiles, files_cap;
    bool bare;          /* add no metadata of our own (passes copy it from the node they replace) */
    bool functionalize; /* record mutating ops as their functional variants */
    const char *tag;    /* partitioner_tag for new nodes, or NULL */
    /* Checkpointed regions (ag_checkpoint): the serial of the last one seen and its
     * ac_graph_id (1, 2, ... in this session). */
    int64_t ckpt_serial, ckpt_id;
    ag__token_chain *tokens;       /* effect tokens (the export), or NULL */
    ag__alias_table *aliases;      /* storages mutated under functionalization (trace_views.c) */
    ag__trace_random_fn random_fn; /* RNG functionalization (the joint export), or NULL */
    void *random_ud;
    ag__trace_rng_reserve_fn rng_reserve; /* the RNG state of a region's call, or NULL */
    void *rng_reserve_ud;
    /* saved thread state, restored by tracer_end */
    tracer *prev_active;
    ag__trace_hook_fn prev_hook;
    bool prev_meta;
    ag__site prev_site; /* the thread's call site before the session (restored at the end) */
    int prev_nframes;
    /* module calls (nn_module_stack): the observer nn calls, the open calls, and how often each
     * module path was called (keys owned here) */
    ag__module_observer mobs;
    const ag__module_observer *prev_mobs;
    mframe *mframes;
    int64_t nmframes, mframes_cap;
    ag__strmap mcalls;
    /* Nested compile regions (region_trace.c): the regions traced so far (the outermost session's),
     * whether this session builds a joint (the export), the session a nested one traces
     * inside and the region it traces (NULL: not nested), and the thread state a nested
     * session set aside (restored at its end). */
    ag__region_cache *regions;
    bool joint;
    tracer *parent;
    const char *region;
    int saved_ann_base, saved_nanns; /* the annotations open around a nested session */
    ag__tls_state saved_ts;
    ag__region_hook_fn prev_region_hook;
};

static _Thread_local tracer *active;
static uint64_t next_trace_id = 1;

static const src_file *load_source(tracer *T, const char *path) {
    for (int64_t i = 0; i < T->nfiles; i++)
        if (T->files[i].path == path || !strcmp(T->files[i].path, path))
            return &T->files[i];
    if (ag__grow((void **)&T->files, &T->files_cap, T->nfiles + 1, sizeof *T->files))
        return NULL;
    src_file *f = &T->files[T->nfiles++];
    memset(f, 0, sizeof *f);
    f->path = path;
    FILE *fp = fopen(path, "rb");
    if (!fp)
        return f;
    fseek(fp, 0, SEEK_END);
    long n = ftell(fp);
    fseek(fp, 0, SEEK_SET);
    if (n > 0 && n < (16l << 20) && !(f->text = ag__malloc((size_t)n + 1))) {
        fclose(fp);
        T->nfiles--; /* not cached: a later call retries */
        return NULL;
    }
    if (f->text) {
        size_t got = fread(f->text, 1, (size_t)n, fp);
        f->text[got] = 0;
        int cnt = 1;
        for (size_t i = 0; i < got; i++)
            cnt += f->text[i] == '\n';
        f->lines = ag__malloc(sizeof(char *) * (size_t)cnt);
        if (!f->lines) {
            ag__free(f->text);
            fclose(fp);
            T->nfiles--;
            return NULL;
        }
        {
            char *p = f->text;
            f->lines[f->nlines++] = p;
            for (; *p; p++)
                if (*p == '\n') {
                    *p = 0;
                    if (f->nlines < cnt)
                        f->lines[f->nlines++] = p + 1;
                }
        }
    }
    fclose(fp);
    return f;
}

/* Text appended to buf (cap n > 0) as snprintf writes it: k counts every character, the buffer
 * keeps what fits before its terminating NUL. */
typedef struct bounded {
    char *buf;
    size_t n, k;
} bounded;

static void b_put(bounded *b, const char *s, size_t len) {
    if (b->k < b->n - 1) {
        size_t room = b->n - 1 - b->k;
        memcpy(b->buf + b->k, s, len < room ? len : room);
    }
    b->k += len;
}

static void b_puts(bounded *b, const char *s) {
    b_put(b, s, strlen(s));
}

static void b_int(bounded *b, int v) {
    char d[16];
    int i = sizeof d;
    unsigned u = v < 0 ? 0u - (unsigned)v : (unsigned)v;
    do
        d[--i] = (char)('0' + u % 10);
    while (u /= 10);
    if (v < 0)
        d[--i] = '-';
    b_put(b, d + i, sizeof d - (size_t)i);
}

static size_t b_end(bounded *b) {
    b->buf[b->k < b->n ? b->k : b->n - 1] = 0;
    return b->k;
}

/* Formats one frame (as "  File \"%s\", line %d, in %s\n" then "    %s\n" would, without
 * printf: stack traces are formatted per call site); *failed is set when the source cache could
 * not grow (out of memory). */
static size_t fmt_frame(tracer *T, const ag__site *s, char *buf, size_t n, bool *failed) {
    if (!s->file)
        return 0;
    bounded b = {buf, n, 0};
    b_put(&b, "  File \"", 8);
    b_puts(&b, s->file);
    b_put(&b, "\", line ", 8);
    b_int(&b, s->line);
    b_put(&b, ", in ", 5);
    b_puts(&b, s->func ? s->func : "?");
    b_put(&b, "\n", 1);
    size_t k = b_end(&b);
    const src_file *f = load_source(T, s->file);
    if (!f)
        *failed = true;
    if (f && s->line >= 1 && s->line <= f->nlines && k < n) {
        const char *l = f->lines[s->line - 1];
        while (*l == ' ' || *l == '\t')
            l++;
        bounded c = {buf + k, n - k, 0};
        b_put(&c, "    ", 4);
        b_puts(&c, l);
        b_put(&c, "\n", 1);
        k += b_end(&c);
    }
    return k < n ? k : n;
}

/* The current stack as text (cached until a site changes); NULL with an error set when out of
 * memory, NULL without one when there is no site at all. */
static const char *stack_string(tracer *T) {
    const ag__sites *S = ag__sites_tls();
    const ag__site *frames = S->frames;
    if (T->trace_str && T->trace_gen == S->gen)
        return T->trace_str;
    char buf[8192];
    size_t k = 0;
    bool failed = false;
    int nf = S->nframes < AG__MAX_FRAMES ? S->nframes : AG__MAX_FRAMES;
    for (int i = 0; i < nf && k < sizeof buf; i++) {
        if (i > 0 && frames[i].file == frames[i - 1].file && frames[i].line == frames[i - 1].line)
            continue;
        k += fmt_frame(T, &frames[i], buf + k, sizeof buf - k, &failed);
    }
    bool same_as_top =
        nf > 0 && frames[nf - 1].file == S->cur.file && frames[nf - 1].line == S->cur.line;
    if (!same_as_top && k < sizeof buf)
        k += fmt_frame(T, &S->cur, buf + k, sizeof buf - k, &failed);
    if (k > 0 && buf[k - 1] == '\n')
        buf[k - 1] = 0;
    ag__free(T->trace_str);
    T->trace_str = NULL;
    if (failed)
        return NULL;
    T->trace_str = k ? ag__strdup(buf) : NULL;
    if (T->trace_str)
        T->trace_gen = S->gen;
    return T->trace_str;
}

static bool in_backward(const tracer *T) {
    return T->tag && !strcmp(T->tag, "is_backward");
}

/* A new get_attr node for constant t, with the metadata a node made now gets as upstream's
 * get_attr nodes do (fx's create_node copies the current node metadata): the open
 * annotations, the partitioner tag, and in a backward the running backward node's seq_nr,
 * through which the export copies its forward op's annotations onto it as onto the backward's
 * calls. A forward constant gets no seq_nr: it must never be the forward node a backward
 * node's metadata is taken from. name: NULL for _tensor_constantN. */
static ag_node *new_constant(tracer *T, ag_tensor *t, const char *name) {
    ag_node *n = ag_graph_get_attr(T->g, t, name);
    if (!n || T->bare)
        return n;
    ag__tls_state *ts = ag__tls();
    int rc = 0;
    if (ts->bw_seq_nr >= 0)
        rc = ag_node_set_seq_nr(n, ts->bw_seq_nr);
    if (!rc && T->tag)
        rc = ag_node_set_partitioner_tag(n, T->tag);
    int na = nanns < MAX_ANN ? nanns : MAX_ANN;
    for (int i = ann_base; i < na && !rc; i++)
        rc = ag_node_custom_set(n, anns[i].key, anns[i].v);
    if (rc) {
        ag_graph_erase(T->g, n);
        return NULL;
    }
    return n;
}

/* A constant the forward made a get_attr for, used by the backward: the backward gets a
 * get_attr of its own (`_tensor_constant0_1` for `_tensor_constant0`, as upstream), so the
 * partitioner never saves a constant for the backward, and the backward's uses share it. */
static ag_node *backward_constant(tracer *T, ag_tensor *t, ag_node *fwd) {
    char name[80];
    for (int k = 1;; k++) {
        snprintf(name, sizeof name, "%s_%d", ag_node_name(fwd), k);
        if (!ag_graph_find(T->g, name))
            break;
    }
    ag_node *n = new_constant(T, t, name);
    if (n)
        t->trace = n;
    return n;
}

/* The node standing for tensor t in this trace: its own node, or a new get_attr constant for
 * a tensor with data made outside the trace. */
static ag_node *node_of(tracer *T, ag_tensor *t) {
    if (!t)
        return NULL;
    if (t->trace && t->trace_id == T->id) {
        ag_node *n = T->aliases ? ag__alias_refresh(T, T->aliases, t) : t->trace;
        if (n && n == t->trace && ag_node_kind_of(n) == AG_NODE_GET_ATTR && in_backward(T)) {
            const char *tag = ag_node_partitioner_tag(n);
            if (!tag || strcmp(tag, "is_backward"))
                return backward_constant(T, t, n);
        }
        return n;
    }
    bool outer_const = false;
    for (const tracer *p = T->parent; p && t->trace; p = p->parent)
        if (t->trace_id == p->id) {
            if (ag__is_meta(t) || ag_node_kind_of(t->trace) != AG_NODE_GET_ATTR) {
                char b[128];
                ag__err(AG_EINVAL,
                        "nested_compile_region %s: the region reads a tensor of the enclosing "
                        "trace (%s, %%%s) that is not among its inputs; pass it as an input",
                        T->region, ag_tensor_meta_str(t, b, sizeof b), ag_node_name(t->trace));
                return NULL;
            }
            outer_const = true; /* a constant: the subgraph gets its own get_attr */
        }
    if (ag__is_meta(t)) {
        char b[128];
        ag__err(AG_EINVAL,
                "trace: a data-less tensor %s that was not made in this trace is used "
                "(was the model built in meta mode but called outside ag_trace?)",
                ag_tensor_meta_str(t, b, sizeof b));
        return NULL;
    }
    ag_node *n = new_constant(T, t, NULL);
    if (!n || outer_const) /* never re-tag the enclosing trace's tensors */
        return n;
    t->trace = n;
    t->trace_id = T->id;
    t->trace_ver = ag__alias_current_ver(T->aliases, t);
    return n;
}

/* ---- module stacks ----
 * Each module call opens a frame holding the stack's text with the call added, as upstream's
 * non-strict export records it: key "L__self__" + path (+ "@N" for the N-th repeated call of
 * that path), the path below the outermost module called, the module's type. The text is kept
 * once in the graph and every node made inside the call points at it. */

/* How often a module path was called in this session (the map's key is `path`). */
typedef struct mcall {
    int64_t calls;
    char path[];
} mcall;

/* Opens f's own frame for a call of module m at path: f->stack becomes the parent's text with
 * the frame added. */
static int open_frame(tracer *T, mframe *f, const ag_module *m, const char *path) {
    size_t plen = strlen(path);
    mcall *mc = ag__strmap_get(&T->mcalls, path);
    if (!mc) {
        if (!(mc = ag__malloc(sizeof *mc + plen + 1)))
            return AG_ENOMEM;
        mc->calls = 0;
        memcpy(mc->path, path, plen + 1);
        if (ag__strmap_put(&T->mcalls, mc->path, mc)) {
            ag__free(mc);
            return AG_ENOMEM;
        }
    }
    size_t klen = plen + 40;
    char *key = ag__malloc(klen);
    if (!key)
        return AG_ENOMEM;
    if (mc->calls > 0)
        snprintf(key, klen, "L__self__%s@%lld", path, (long long)mc->calls);
    else
        snprintf(key, klen, "L__self__%s", path);
    char *text = ag__modstack_push(f->stack, key, path, ag_module_type(m));
    ag__free(key);
    const char *shared = text ? ag__graph_shared_str(T->g, text) : NULL;
    ag__free(text);
    if (!shared)
        return AG_ENOMEM;
    mc->calls++;
    f->stack = shared;
    f->depth++;
    return 0;
}

static int module_enter(void *ud, const ag_module *m) {
    tracer *T = ud;
    if (ag__grow((void **)&T->mframes, &T->mframes_cap, T->nmframes + 1, sizeof *T->mframes))
        return AG_ENOMEM;
    const mframe *top = T->nmframes ? &T->mframes[T->nmframes - 1] : NULL;
    mframe f = top ? *top : (mframe){0};
    f.m = m;
    /* The outermost call is the root (path ''); a module outside it gets no frame of its own
     * (upstream traces through it without recording one), nor does one nested too deep. */
    uint64_t errs = ag__err_count();
    char *path = top ? ag__module_path(T->mframes[0].m, m) : ag__strdup("");
    if (!path && ag__err_count() != errs)
        return ag_last_status();
    int rc = path && f.depth < AG_MODULE_STACK_MAX ? open_frame(T, &f, m, path) : 0;
    ag__free(path);
    if (rc)
        return rc;
    T->mframes[T->nmframes++] = f;
    return 0;
}

static void module_exit(void *ud, const ag_module *m) {
    tracer *T = ud;
    (void)m;
    if (T->nmframes > 0) /* calls begun before the session have no frame */
        T->nmframes--;
}

static void module_frames_free(tracer *T) {
    for (int64_t i = 0; i < T->mcalls.cap; i++)
        if (T->mcalls.slots[i].key)
            ag__free(T->mcalls.slots[i].val); /* no deletions: every key is live */
    ag__strmap_free(&T->mcalls);
    ag__free(T->mframes);
    T->mframes = NULL;
    T->nmframes = T->mframes_cap = 0;
}

static int set_node_meta(tracer *T, ag_node *n) {
    if (T->bare)
        return 0;
    ag__tls_state *ts = ag__tls();
    int rc = 0;
    int64_t seq = ts->bw_seq_nr >= 0 ? ts->bw_seq_nr : ts->trace_seq;
    if (seq >= 0)
        rc = ag_node_set_seq_nr(n, seq);
    if (!rc && ts->in_grad_acc)
        rc = ag_node_set_gradient_acc(n, true);
    if (!rc && T->tag)
        rc = ag_node_set_partitioner_tag(n, T->tag);
    /* A forward node of a checkpointed region: upstream's checkpoint tags. */
    if (!rc && ts->ckpt_region && ts->bw_seq_nr < 0 && !in_backward(T)) {
        if (ts->ckpt_region != T->ckpt_serial) {
            T->ckpt_serial = ts->ckpt_region;
            T->ckpt_id++;
        }
        rc = ag_node_set_recompute(n, AG_MUST_RECOMPUTE);
        if (!rc)
            rc =
                ag_node_meta_set(n, "ac_graph_id", (ag_mval){.kind = AG_MV_INT, .u.i = T->ckpt_id});
    }
    int na = nanns < MAX_ANN ? nanns : MAX_ANN;
    for (int i = ann_base; i < na && !rc; i++)
        rc = ag_node_custom_set(n, anns[i].key, anns[i].v);
    if (!rc && T->nmframes > 0 && T->mframes[T->nmframes - 1].stack)
        rc = ag__node_meta_set_shared(n, "nn_module_stack", T->mframes[T->nmframes - 1].stack);
    if (!rc && !T->opts.no_stack_traces) {
        uint64_t errs = ag__err_count();
        const char *st = stack_string(T);
        if (st)
            rc = ag_node_set_stack_trace(n, st);
        else if (ag__err_count() != errs)
            rc = ag_last_status();
    }
    return rc;
}

/* Functionalization: a call that mutates arguments is recorded as its functional variant, and
 * each mutated tensor is rebound to the node holding its new value, so later reads see it and
 * the graph itself mutates nothing (PyTorch's FunctionalTensorMode). A data mutation also
 * reaches the other aliases of the tensor's storage (trace_views.c); an in-place view op
 * (t_) changes only the tensor's own metadata. */
static int record_functional(tracer *T, const ag_op *op, const ag_arg *args, int nargs,
                             const ag_garg *ga, ag_tensor **outs, int nouts) {
    const char *fname = ag_op_def(op)->functional;
    const ag_op *fop = fname ? ag_op_find(fname) : NULL;
    if (!fop)
        return ag__err(AG_ENOTSUP,
                       "functionalize: %s mutates its input and has no functional "
                       "variant",
                       ag_op_name(op));
    ag_node *n = ag_graph_call(T->g, fop, ga, nargs, NULL);
    if (!n || set_node_meta(T, n))
        return ag_last_status();
    if (ag_op_def(op)->flags & AG_OP_INPLACE_VIEW) {
        ag__alias_bind(T, T->aliases, outs[0], n);
        return 0;
    }
    ag__alias_table *at = ag__tracer_aliases(T, true);
    if (!at)
        return AG_ENOMEM;
    if (ag_op_def(op)->flags & AG_OP_INPLACE) /* the functional op's only output is self's value */
        return ag__alias_data_mutation(T, at, ag_op_name(op), outs[0], n);
    int k = 0;
    for (; k < nouts; k++) {
        ag_node *v = ag_graph_getitem(T->g, n, k, NULL);
        if (!v || set_node_meta(T, v))
            return ag_last_status();
        outs[k]->trace = v;
        outs[k]->trace_id = T->id;
    }
    for (int i = 0; i < nargs; i++) {
        if (!op->mutates[i] || args[i].kind != AG_ARG_TENSOR || !args[i].u.t)
            continue;
        ag_node *v = ag_graph_getitem(T->g, n, k++, NULL);
        if (!v || set_node_meta(T, v))
            return ag_last_status();
        int rc = ag__alias_data_mutation(T, at, ag_op_name(op), args[i].u.t, v);
        if (rc)
            return rc;
    }
    return 0;
}

ag_node *ag__tracer_call(ag__tracer *T, const ag_op *op, const ag_garg *args, int nargs) {
    ag_node *n = ag_graph_call(T->g, op, args, nargs, NULL);
    if (!n || set_node_meta(T, n))
        return NULL;
    return n;
}

ag__alias_table *ag__tracer_aliases(ag__tracer *T, bool create) {
    if (!T->aliases && create)
        T->aliases = ag__alias_table_new();
    return T->aliases;
}

static int trace_hook(const ag_op *op, const ag_arg *args, int nargs, ag_tensor **outs, int nouts) {
    tracer *T = active;
    if (!T)
        return 0;
    if (T->region && (ag_op_def(op)->flags & AG_OP_EFFECTFUL))
        return ag__err(AG_ENOTSUP,
                       "nested_compile_region %s: %s is effectful; effectful ops inside a "
                       "region are not supported",
                       T->region, ag_op_name(op));
    if (T->region && !T->random_fn && (ag_op_def(op)->flags & AG_OP_RANDOM))
        return ag__err(AG_ENOTSUP,
                       "nested_compile_region %s: %s is a random op; a region draws random "
                       "numbers only in the joint export with RNG functionalization (a trace "
                       "without it, or keep_random_ops, records random ops as they are)",
                       T->region, ag_op_name(op));
    if (T->random_fn && (ag_op_def(op)->flags & AG_OP_RANDOM)) {
        /* The functional form is recorded there; 1 means "record the call as it is". */
        int rc = T->random_fn(T->random_ud, op, args, nargs, outs, nouts);
        if (rc <= 0)
            return rc;
    }
    ag_garg ga[AG_MAX_ARGS];
    ag_node *lists[AG_MAX_ARGS][64];
    for (int i = 0; i < nargs; i++) {
        const ag_arg *a = &args[i];
        switch (a->kind) {
        case AG_ARG_NONE:
            ga[i] = AG_GA_NIL;
            break;
        case AG_ARG_TENSOR:
            ga[i] = a->u.t ? AG_GA_N(node_of(T, a->u.t)) : AG_GA_NIL;
            if (a->u.t && !ga[i].u.node)
                return ag_last_status();
            break;
        case AG_ARG_TENSORS:
            if (a->n > 64)
                return ag__err(AG_ENOTSUP, "trace: %s: tensor list of %d (at most 64)",
                               ag_op_name(op), a->n);
            for (int k = 0; k < a->n; k++) {
                lists[i][k] = a->u.ts[k] ? node_of(T, a->u.ts[k]) : NULL;
                if (a->u.ts[k] && !lists[i][k])
                    return ag_last_status();
            }
            ga[i] = AG_GA_NODES(lists[i], a->n);
            break;
        case AG_ARG_INT:
            ga[i] = AG_GA_I(a->u.i);
            break;
        case AG_ARG_FLOAT:
            ga[i] = AG_GA_F(a->u.f);
            break;
        case AG_ARG_BOOL:
            ga[i] = AG_GA_B(a->u.b);
            break;
        case AG_ARG_INTS:
            ga[i] = AG_GA_INTS(a->u.ints, a->n);
            break;
        case AG_ARG_DTYPE:
            ga[i] = AG_GA_DT(a->u.dt);
            break;
        case AG_ARG_STR:
            ga[i] = AG_GA_S(a->u.s);
            break;
        }
    }
    if (T->tokens && (ag_op_def(op)->flags & AG_OP_EFFECTFUL) && !ag_op_with_effects_target(op))
        return ag__trace_effect(T, T->g, T->tokens, op, ga, nargs, outs, nouts);
    if (T->functionalize) {
        bool mutates = false;
        for (int i = 0; i < nargs; i++)
            mutates |= op->mutates[i] && args[i].kind == AG_ARG_TENSOR && args[i].u.t;
        if (mutates)
            return record_functional(T, op, args, nargs, ga, outs, nouts);
    }
    ag_tmeta vals[AG_MAX_OUTPUTS];
    for (int k = 0; k < nouts; k++)
        ag__tmeta_of(outs[k], &vals[k]);
    /* An in-place view op (t_) changes self's geometry after this hook: the node's value has
     * the new one. */
    if ((ag_op_def(op)->flags & AG_OP_INPLACE_VIEW) && ag_op_def(op)->meta(args, &vals[0]) < 0)
        return ag_last_status();
    ag_node *n = ag__graph_call_vals(T->g, op, ga, nargs, vals, nouts, NULL);
    if (!n || set_node_meta(T, n))
        return ag_last_status();
    bool single = ag_op_noutputs(op) == 1;
    for (int k = 0; k < nouts; k++) {
        ag_node *v = n;
        if (!single) {
            v = ag_graph_getitem(T->g, n, k, NULL);
            if (!v || set_node_meta(T, v))
                return ag_last_status();
        }
        outs[k]->trace = v;
        outs[k]->trace_id = T->id;
        if (T->aliases) /* a view of a mutated storage is made from its current value */
            outs[k]->trace_ver = ag__alias_current_ver(T->aliases, outs[k]);
    }
    return 0;
}

static void tracer_free(tracer *T) {
    ag__region_cache_free(T->regions);
    T->regions = NULL;
    ag__alias_table_free(T->aliases);
    T->aliases = NULL;
    ag__free(T->trace_str);
    T->trace_str = NULL;
    for (int64_t i = 0; i < T->nfiles; i++) {
        ag__free(T->files[i].text);
        ag__free(T->files[i].lines);
    }
    ag__free(T->files);
    T->files = NULL;
    T->nfiles = T->files_cap = 0;
    module_frames_free(T);
}

/* Makes T the thread's active tracer: meta mode on, the dispatcher's hook pointing here. */
static void tracer_activate(tracer *T) {
    /* A session starts from a clean call stack: the site left behind by the last op the user
     * called before tracing (building inputs, say) is not a frame of the traced code. The
     * replace-node sessions of passes keep the thread's state untouched. */
    ag__sites *S = ag__sites_tls();
    T->prev_site = S->cur;
    T->prev_nframes = S->nframes;
    if (!T->bare) {
        if (!T->parent) { /* a nested session continues its parent's stack */
            S->cur = (ag__site){0};
            S->gen++;
        }
        T->mobs = (ag__module_observer){module_enter, module_exit, T};
        T->prev_mobs = ag__module_set_observer(&T->mobs);
    }
    T->prev_active = active;
    T->prev_hook = ag__trace_hook;
    T->prev_meta = ag_set_meta_mode(true);
    active = T;
    ag__trace_hook = trace_hook;
    T->prev_region_hook = ag__region_hook;
    if (!T->bare)
        ag__region_hook = ag__trace_region;
    ag__flex_trace_hook = ag__flex_traced; /* flex_attention under a trace (flex_trace.c) */
}

static void tracer_deactivate(tracer *T) {
    if (!T->bare)
        ag__module_set_observer(T->prev_mobs);
    ag__sites *S = ag__sites_tls();
    S->cur = T->prev_site;
    S->nframes = T->prev_nframes;
    S->gen++;
    active = T->prev_active;
    ag__trace_hook = T->prev_hook;
    ag__region_hook = T->prev_region_hook;
    ag_set_meta_mode(T->prev_meta);
}

ag__tracer *ag__tracer_begin(ag_graph *g, bool functionalize) {
    tracer *T = ag__calloc(1, sizeof *T);
    if (!T)
        return NULL;
    T->g = g;
    T->id = __atomic_fetch_add(&next_trace_id, 1, __ATOMIC_RELAXED);
    T->functionalize = functionalize;
    tracer_activate(T);
    return T;
}

void ag__tracer_end(ag__tracer *T) {
    if (!T)
        return;
    tracer_deactivate(T);
    if (T->parent) {
        ann_base = T->saved_ann_base;
        nanns = T->saved_nanns; /* a region that failed may leave its own open */
        ag__tls_state *ts = ag__tls();
        ts->bw_seq_nr = T->saved_ts.bw_seq_nr;
        ts->in_grad_acc = T->saved_ts.in_grad_acc;
        ts->ckpt_region = T->saved_ts.ckpt_region;
        ts->ckpt_capture = T->saved_ts.ckpt_capture;
        ts->ckpt_capture_ud = T->saved_ts.ckpt_capture_ud;
        ts->leaf_inplace = T->saved_ts.leaf_inplace;
        ts->leaf_inplace_ud = T->saved_ts.leaf_inplace_ud;
        ag_set_grad_enabled(!T->saved_ts.grad_disabled);
    }
    tracer_free(T);
    ag__free(T);
}

/* In a region's session the leaves requiring grad are the operands' stand-ins. */
static int refuse_leaf_inplace(void *ud, ag_tensor *self) {
    (void)self;
    const tracer *T = ud;
    return ag__err(AG_ENOTSUP,
                   "nested_compile_region %s: the region mutates an operand in place; mutating "
                   "inputs, parameters or buffers inside a region is not supported",
                   T->region);
}

/* A session tracing a region's function into sub inside parent (region_trace.c): the thread's
 * call sites and module frames continue the parent's, the annotations open around the call
 * and the thread's per-trace state (backward seq_nr, checkpoint region, leaf in-place hook)
 * are set aside until ag__tracer_end, and grad mode is on. */
ag__tracer *ag__tracer_begin_nested(ag__tracer *parent, ag_graph *sub, const char *region) {
    tracer *T = ag__calloc(1, sizeof *T);
    if (!T)
        return NULL;
    T->g = sub;
    T->id = __atomic_fetch_add(&next_trace_id, 1, __ATOMIC_RELAXED);
    T->functionalize = true;
    T->opts = parent->opts;
    T->parent = parent;
    T->region = region;
    /* The parent's open module calls, their texts kept in sub's pool. */
    if (parent->nmframes > 0) {
        if (ag__grow((void **)&T->mframes, &T->mframes_cap, parent->nmframes, sizeof *T->mframes)) {
            ag__free(T);
            return NULL;
        }
        for (int64_t i = 0; i < parent->nmframes; i++) {
            T->mframes[i] = parent->mframes[i];
            if (parent->mframes[i].stack &&
                !(T->mframes[i].stack = ag__graph_shared_str(sub, parent->mframes[i].stack))) {
                tracer_free(T);
                ag__free(T);
                return NULL;
            }
        }
        T->nmframes = parent->nmframes;
    }
    ag__tls_state *ts = ag__tls();
    T->saved_ts = *ts;
    T->saved_ann_base = ann_base;
    T->saved_nanns = nanns;
    ann_base = nanns;
    ts->bw_seq_nr = -1;
    ts->in_grad_acc = false;
    ts->ckpt_region = 0;
    ts->ckpt_capture = NULL;
    ts->ckpt_capture_ud = NULL;
    ts->leaf_inplace = refuse_leaf_inplace;
    ts->leaf_inplace_ud = T;
    ag_set_grad_enabled(true);
    tracer_activate(T);
    return T;
}

ag__tracer *ag__tracer_active(void) {
    return active;
}
ag__tracer *ag__tracer_parent(const ag__tracer *T) {
    return T->parent;
}
const char *ag__tracer_region(const ag__tracer *T) {
    return T->region;
}
ag_graph *ag__tracer_graph(const ag__tracer *T) {
    return T->g;
}
uint64_t ag__tracer_id(const ag__tracer *T) {
    return T->id;
}
ag__region_cache **ag__tracer_regions(ag__tracer *T) {
    return &T->regions;
}
bool ag__tracer_joint(const ag__tracer *T) {
    return T->joint;
}
void ag__tracer_set_joint(ag__tracer *T, bool on) {
    T->joint = on;
}
bool ag__tracer_in_backward(const ag__tracer *T) {
    return in_backward(T);
}

/* The annotations open in the parent around a nested session (those a nested session set
 * aside), as custom metadata of n. */
int ag__tracer_outer_anns(const ag__tracer *T, ag_node *n) {
    int na = T->saved_nanns < MAX_ANN ? T->saved_nanns : MAX_ANN;
    for (int i = T->saved_ann_base; i < na; i++) {
        int rc = ag_node_custom_set(n, anns[i].key, anns[i].v);
        if (rc)
            return rc;
    }
    return 0;
}

/* A subgraph's get_attr made now: the partitioner tag and the open annotations (no seq_nr,
 * as upstream's get_attr of a subgraph has none). */
int ag__tracer_attr_meta(ag__tracer *T, ag_node *n) {
    int rc = T->tag ? ag_node_set_partitioner_tag(n, T->tag) : 0;
    int na = nanns < MAX_ANN ? nanns : MAX_ANN;
    for (int i = ann_base; i < na && !rc; i++)
        rc = ag_node_custom_set(n, anns[i].key, anns[i].v);
    if (!rc && T->nmframes > 0 && T->mframes[T->nmframes - 1].stack)
        rc = ag__node_meta_set_shared(n, "nn_module_stack", T->mframes[T->nmframes - 1].stack);
    return rc;
}

void ag__tracer_set_tag(ag__tracer *T, const char *tag) {
    T->tag = tag;
}
void ag__tracer_set_token_chain(ag__tracer *T, ag__token_chain *c) {
    T->tokens = c;
}
int ag__tracer_node_meta(ag__tracer *T, ag_node *n) {
    return set_node_meta(T, n);
}
void ag__tracer_set_stack_traces(ag__tracer *T, bool on) {
    T->opts.no_stack_traces = !on;
}
void ag__tracer_set_random(ag__tracer *T, ag__trace_random_fn fn, void *ud) {
    T->random_fn = fn;
    T->random_ud = ud;
}
void ag__tracer_set_rng_reserve(ag__tracer *T, ag__trace_rng_reserve_fn fn, void *ud) {
    T->rng_reserve = fn;
    T->rng_reserve_ud = ud;
}
bool ag__tracer_has_rng_reserve(const ag__tracer *T) {
    return T->rng_reserve != NULL;
}
int ag__tracer_rng_reserve(ag__tracer *T, int64_t n, ag_tensor **seed, ag_tensor **offset) {
    *seed = *offset = NULL;
    if (!T->rng_reserve)
        return ag__err(AG_ENOTSUP, "trace: this session does not functionalize random ops");
    return T->rng_reserve(T->rng_reserve_ud, n, seed, offset);
}

void ag__tracer_bind(ag__tracer *T, ag_tensor *t, ag_node *n) {
    t->trace = n;
    t->trace_id = T->id;
    t->trace_ver = ag__alias_current_ver(T->aliases, t);
}

ag_node *ag__tracer_node_of(ag__tracer *T, ag_tensor *t) {
    return node_of(T, t);
}

bool ag__tracer_bound(ag__tracer *T, const ag_tensor *t) {
    return t && t->trace && t->trace_id == T->id;
}

ag_graph *ag_trace(ag_trace_fn fn, void *ud, ag_tensor *const *inputs, int ninputs,
                   const char *const *names, ag_desc *const *descs, const ag_trace_opts *opts) {
    AG__CHECK_NULL_RET("trace", fn, NULL);
    if (ninputs > 0)
        AG__CHECK_NULL_RET("trace", inputs, NULL);
    tracer T = {0};
    T.g = ag_graph_new();
    if (!T.g)
        return NULL;
    T.id = __atomic_fetch_add(&next_trace_id, 1, __ATOMIC_RELAXED);
    if (opts)
        T.opts = *opts;
    int rc = 0;
    for (int i = 0; i < ninputs && rc == 0; i++) {
        ag_tensor *t = inputs[i];
        if (!t) {
            rc = ag__has_error() ? ag_last_status()
                                 : ag__err(AG_EINVAL, "trace: input %d is NULL", i);
            break;
        }
        if (t->sub) {
            rc = ag__err(AG_ENOTSUP,
                         "trace: input %d is a %s (a tensor subclass); ag_trace takes "
                         "plain tensors (ag_export_joint flattens subclasses)",
                         i, ag_tensor_subclass(t)->name);
            break;
        }
        ag_tmeta m;
        ag__tmeta_of(t, &m);
        char nm[32];
        snprintf(nm, sizeof nm, "arg%d", i);
        ag_node *p = ag_graph_placeholder(T.g, names && names[i] ? names[i] : nm, &m);
        if (!p || (descs && descs[i] && ag_node_set_desc(p, descs[i]))) {
            rc = ag_last_status();
            break;
        }
        t->trace = p;
        t->trace_id = T.id;
    }
    ag_tensor *outs[64];
    int nouts = 0;
    if (rc == 0) {
        tracer_activate(&T);
        ag_scope_begin();
        nouts = fn(ud, inputs, ninputs, outs, 64);
        if (nouts < 0) {
            rc = nouts;
        } else {
            ag_node *on[64];
            for (int k = 0; k < nouts && rc == 0; k++) {
                on[k] = outs[k] ? node_of(&T, outs[k]) : NULL;
                if (outs[k] && !on[k])
                    rc = ag_last_status();
            }
            if (rc == 0 && !ag_graph_output(T.g, on, nouts))
                rc = ag_last_status();
        }
        ag_scope_end();
        tracer_deactivate(&T);
    }
    tracer_free(&T);
    if (rc) {
        if (rc > 0 || ag_last_status() == 0)
            ag__err(AG_EINVAL, "trace: the traced function failed");
        ag_graph_free(T.g);
        return NULL;
    }
    return T.g;
}

/* ---- decomposition in place ---- */

/* A data-less tensor standing for node n's value (output `k` of n's vals). */
static ag_tensor *stand_in(tracer *T, ag_node *n) {
    if (!n || n->nvals != 1)
        return NULL;
    const ag_tmeta *m = &n->vals[0];
    ag_tensor *t = ag__tensor_new(m->dtype, m->ndim, m->sizes, true);
    if (!t)
        return NULL;
    memcpy(t->strides, m->strides, sizeof t->strides);
    t->offset = m->offset;
    t->trace = n;
    t->trace_id = T->id;
    return t;
}

int ag__trace_replace_node(ag_graph *g, ag_node *n, ag_decomp_fn fn) {
    tracer T = {0};
    T.g = g;
    T.id = __atomic_fetch_add(&next_trace_id, 1, __ATOMIC_RELAXED);
    T.bare = true; /* new nodes inherit the replaced node's metadata below */
    ag_arg args[AG_MAX_ARGS];
    ag_tensor *lists[AG_MAX_ARGS][64];
    ag_tensor *owned[AG_MAX_ARGS * 8];
    int nowned = 0, rc = 0;
    for (int i = 0; i < n->nargs && rc == 0; i++) {
        const ag_garg *a = &n->args[i];
        switch (a->kind) {
        case AG_GA_NONE:
            args[i] = AG_A_NONE;
            break;
        default: /* a constant: int, float, bool, ints, dtype, str */
            args[i] = ag__garg_const_arg(a);
            break;
        case AG_GA_NODE:
            args[i] = AG_A_T(stand_in(&T, a->u.node));
            if (!args[i].u.t)
                rc = ag_last_status() ? ag_last_status() : AG_EINVAL;
            else
                owned[nowned++] = args[i].u.t;
            break;
        case AG_GA_NODES:
            for (int k = 0; k < a->n && k < 64 && rc == 0; k++) {
                lists[i][k] = a->u.nodes[k] ? stand_in(&T, a->u.nodes[k]) : NULL;
                if (a->u.nodes[k] && !lists[i][k])
                    rc = ag_last_status() ? ag_last_status() : AG_EINVAL;
                else if (lists[i][k] && nowned < (int)(sizeof owned / sizeof owned[0]))
                    owned[nowned++] = lists[i][k];
            }
            args[i] = AG_A_TS(lists[i], a->n);
            break;
        }
    }
    ag_arg full[AG_MAX_ARGS];
    if (rc == 0)
        rc = ag__op_check_args(n->op, args, n->nargs, full);
    int nouts = ag_op_noutputs(n->op) > 0 ? ag_op_noutputs(n->op) : n->nvals;
    ag_node *first_new = n->prev;
    if (rc == 0) {
        bool prev_grad = ag_set_grad_enabled(false);
        tracer_activate(&T);
        ag_graph_insert_before(g, n);
        ag_tensor *outs[AG_MAX_OUTPUTS] = {0};
        ag_scope_begin();
        rc = fn(full, outs);
        ag_node *onodes[AG_MAX_OUTPUTS] = {0};
        for (int k = 0; rc >= 0 && k < nouts; k++) {
            onodes[k] = outs[k] ? node_of(&T, outs[k]) : NULL;
            if (!onodes[k])
                rc = ag_last_status() ? ag_last_status() : AG_EINVAL;
        }
        ag_scope_end();
        ag_graph_insert_at_end(g);
        tracer_deactivate(&T);
        ag_set_grad_enabled(prev_grad);
        if (rc < 0) {
            /* The decomposition failed (or has no variant for these arguments): take back what
             * it emitted, last first (each node's users come after it), so the graph is as it
             * was. */
            while (n->prev != first_new && n->prev && ag_graph_erase(g, n->prev) == 0)
                ;
        }
        if (rc >= 0) {
            rc = 0;
            /* New nodes take the replaced node's metadata (seq_nr, tags, annotations, trace). */
            for (ag_node *m = first_new ? first_new->next : g->first; m && m != n && rc == 0;
                 m = m->next) {
                rc = ag__node_meta_copy(m, n);
                if (rc == 0)
                    rc = ag_node_custom_copy(m, n);
            }
            /* Rewire users: getitem users of a multi-output node take output k. */
            if (rc == 0 && ag_op_noutputs(n->op) == 1) {
                rc = ag_node_replace_all_uses(n, onodes[0]) < 0 ? AG_ENOMEM : 0;
            } else if (rc == 0) {
                while (n->nusers > 0 && rc == 0) {
                    ag_node *u = n->users[0].node;
                    if (u->kind != AG_NODE_GETITEM) {
                        rc = ag__err(AG_EINVAL, "decompose: %s is used directly by %s", n->name,
                                     u->name);
                        break;
                    }
                    int k = (int)u->args[1].u.i;
                    if (ag_node_replace_all_uses(u, onodes[k]) < 0 || ag_graph_erase(g, u))
                        rc = ag_last_status();
                }
            }
            if (rc == 0)
                rc = ag_graph_erase(g, n);
        }
    }
    for (int i = 0; i < nowned; i++)
        ag_tensor_free(owned[i]);
    tracer_free(&T);
    return rc;
}

/* ---- modules ---- */

typedef struct module_call {
    ag_module *m;
    int first_input; /* inputs[first_input..] are the user's */
} module_call;

static int call_module(void *ud, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    module_call *mc = ud;
    return ag_module_call(mc->m, in + mc->first_input, nin - mc->first_input, out, max_out);
}

ag_graph *ag_trace_module(ag_module *m, ag_tensor *const *inputs, int ninputs,
                          const ag_trace_opts *opts) {
    AG__CHECK_NULL_RET("trace_module", m, NULL);
    if (ninputs > 0)
        AG__CHECK_NULL_RET("trace_module", inputs, NULL);
    ag_named_tensors ps = {0}, bs = {0};
    if (ag_module_named_parameters(m, false, &ps) || ag_module_named_buffers(m, false, &bs)) {
        ag_named_tensors_free(&ps);
        return NULL;
    }
    int total = ps.n + bs.n + ninputs;
    ag_tensor **all = ag__calloc((size_t)(total ? total : 1), sizeof *all);
    ag_desc **descs = ag__calloc((size_t)(total ? total : 1), sizeof *descs);
    char **names = ag__calloc((size_t)(total ? total : 1), sizeof *names);
    ag_graph *g = NULL;
    bool ok = all && descs && names &&
              ag__desc_module_inputs(ps.names, ps.n, bs.names, bs.n, ninputs, descs) == 0;
    /* The tensors in the descriptors' order: parameters, buffers, inputs. */
    for (int i = 0; ok && i < ps.n; i++)
        all[i] = ps.tensors[i];
    for (int i = 0; ok && i < bs.n; i++)
        all[ps.n + i] = bs.tensors[i];
    for (int i = 0; ok && i < ninputs; i++)
        all[ps.n + bs.n + i] = inputs[i];
    for (int i = 0; ok && i < total; i++) {
        char nm[32];
        snprintf(nm, sizeof nm, "primals_%d", i + 1);
        ok = (names[i] = ag__strdup(nm)) != NULL;
    }
    if (ok) {
        module_call mc = {m, ps.n + bs.n};
        g = ag_trace(call_module, &mc, all, total, (const char *const *)names, descs, opts);
    }
    if (g) {
        ag_node *out = ag_graph_output_node(g);
        int no = ag_node_arg(out, 0)->n;
        ag_desc **od = ag__calloc((size_t)(no ? no : 1), sizeof *od);
        bool dok = od != NULL;
        for (int i = 0; dok && i < no; i++)
            dok = (od[i] = ag_desc_plain_output(i)) != NULL;
        if (!dok || ag_node_set_output_descs(out, od, no)) {
            ag_graph_free(g);
            g = NULL;
        }
        for (int i = 0; od && i < no; i++)
            ag_desc_release(od[i]);
        ag__free(od);
    }
    for (int i = 0; i < total; i++) {
        if (names)
            ag__free(names[i]);
        if (descs)
            ag_desc_release(descs[i]);
    }
    ag__free(names);
    ag__free(descs);
    ag__free(all);
    ag_named_tensors_free(&ps);
    ag_named_tensors_free(&bs);
    return g;
}
