/* Nested compile regions under tracing (ag_nested_compile_region, ag_module_set_compile_region;
 * upstream's torch.compiler.nested_compile_region and its invoke_subgraph HOP).
 *
 * In: a region's call seen by the tracer's region hook (ag__region: a function or a module,
 * its inputs). Out: in the traced graph, get_attr(repeated_subgraphK) + invoke_subgraph(...,
 * 'fw_subgraph_I', operands...) + one getitem per output, and data-less outputs bound to the
 * getitems; with autograd recording, an autograd node whose backward (traced by the joint
 * export) records invoke_subgraph(repeated_subgraphK+1, 'bw_subgraph_I_0', operands...,
 * tangents...) + a getitem per gradient.
 *
 * The first call with a key (the function or the module's forward, type, training and
 * checkpointing, and every operand's dtype, sizes, strides and requires_grad) traces the region in
 * a nested session (trace.c: ag__tracer_begin_nested) on fresh data-less stand-ins for its
 * operands, into a new subgraph; for a joint it also traces the region's joint: the forward again,
 * then ag_grad from one tangent per output back to the operands requiring grad. The cache lives in
 * the outermost session; later calls only emit the call.
 *
 * A region called inside another region's body (upstream's nested invoke_subgraph) goes through
 * the same hook in the outer region's nested session: its subgraphs become attributes of the
 * outer region's subgraph being traced (repeated_subgraphN numbered per graph) and its call an
 * invoke_subgraph there. Entries are per key across all levels (identifiers numbered in the
 * order regions are first traced); each records its sites, the graphs calling it with its
 * attributes there, and a graph that calls a region traced for another gets a copy of the
 * subgraph (outer's joint subgraph reruns outer's body, so it calls inner's forward subgraph
 * and, from its ag_grad, inner's joint, traced then). A subgraph freed on a failure takes its
 * sites with it. In the body the module form's tensors are the outer region's stand-ins, so a
 * region called there names its operands at the call, and a module's swap gives back what it
 * held. A draw in the inner body reads the outer region's seed and offset operands (its call
 * reserves them from the outer region's, region_reserve). Regions nest at most
 * REGION_MAX_DEPTH deep.
 *
 * A checkpointed region (a checkpointed module, or a function calling ag_checkpoint) traces
 * its body through ag_checkpoint, so both subgraphs' forward nodes carry the checkpoint's
 * recompute=MUST_RECOMPUTE and ac_graph_id (numbered from 1 in each subgraph: a nested session
 * starts with no checkpoint open), and the region's joint partitions once to save what
 * checkpointing saves.
 *
 * Random ops in the body (the joint export's RNG functionalization; upstream threads graph-safe
 * RNG state into invoke_subgraph's subgraphs): the nested session records each draw from two
 * more placeholders after the operands, philox_seed and philox_base_offset (rng_draws.c), erased
 * again when the body draws nothing. Every call then reserves the numbers one call draws
 * (ag__tracer_rng_reserve) and passes the seed and its own offset after its operands, the
 * backward call the same two (the joint subgraph takes them before its tangents and returns None
 * as their gradients): N calls draw N masks, eager's. A backward that draws is refused. */
#include "../graph/graph_internal.h"
#include "../nn/nn_internal.h"

#include <stdio.h>

/* A graph calling a region (the outermost graph or a subgraph: a region called inside another
 * region's body is called from that region's subgraphs): the region's attributes there, each
 * added on first need (a copy of the one traced, when traced for another graph). */
typedef struct region_site {
    ag_graph *g;
    char fw_attr[48], bw_attr[48]; /* "" until needed */
    ag_node *fw_attr_node;         /* the first forward call's get_attr there */
} region_site;

typedef struct region_entry {
    bool ready; /* traced; a region being traced, or one that failed, is never looked up */
    const void *key;
    char *type; /* NULL for the function form */
    bool training;
    bool checkpoint; /* the body is checkpointed (ag__region.checkpoint) */
    int nops;
    ag_tmeta *ops;
    bool *rg;                        /* operand requires grad */
    int index;                       /* I of fw_subgraph_I */
    char fw_ident[32], bw_ident[32]; /* fw_subgraph_I, bw_subgraph_I_0 (made once) */
    bool has_bw;                     /* the joint subgraph is traced (an attribute of a site) */
    region_site *sites;
    int64_t nsites, sites_cap;
    int nout;
    ag_tmeta out[AG_MAX_OUTPUTS];
    bool out_rg[AG_MAX_OUTPUTS];
    bool grad_none[AG_MAX_OUTPUTS]; /* the joint's gradient output j is None */
    int nrng;                       /* 2 when the body draws (seed and offset operands), else 0 */
    int64_t drawn;                  /* the numbers one call draws */
} region_entry;

/* The regions of the outermost session, entries by index (a region traced inside another's
 * body is added while the outer one is traced, so entries are allocated one by one). */
struct ag__region_cache {
    region_entry **e;
    int64_t n, cap;
    int64_t calls; /* call_id of the last call */
};

void ag__region_cache_free(ag__region_cache *c) {
    if (!c)
        return;
    for (int64_t i = 0; i < c->n; i++) {
        ag__free(c->e[i]->type);
        ag__free(c->e[i]->ops);
        ag__free(c->e[i]->rg);
        ag__free(c->e[i]->sites);
        ag__free(c->e[i]);
    }
    ag__free(c->e);
    ag__free(c);
}

/* Regions nest at most this deep (a region calling itself would trace forever). */
enum { REGION_MAX_DEPTH = 16 };

/* The cache of the outermost session (nested sessions trace into it too). */
static ag__region_cache **root_cache(ag__tracer *T) {
    while (ag__tracer_parent(T))
        T = ag__tracer_parent(T);
    return ag__tracer_regions(T);
}

static int session_depth(const ag__tracer *T) {
    int d = 0;
    for (; ag__tracer_parent(T); T = ag__tracer_parent(T))
        d++;
    return d;
}

static bool is_float_rg(const ag_tensor *t) {
    return t->requires_grad && ag_dtype_is_float(t->dtype);
}

/* ---- operands ---- */

/* A region call's operands: the inputs, then (module form) the module's parameters and
 * buffers, deduplicated. ps/bs: every name under which the module reaches each of them (for
 * swapping in the stand-ins), built by operands_names only when a region is traced. */
typedef struct operands {
    ag_tensor **t;
    int n;
    bool named;              /* ps and bs built */
    ag_named_tensors ps, bs; /* remove_duplicate false */
} operands;

static void operands_free(operands *o) {
    ag__free(o->t);
    ag_named_tensors_free(&o->ps);
    ag_named_tensors_free(&o->bs);
}

/* The operands without names: the module's parameters then buffers in named_parameters' and
 * named_buffers' order (ag__module_flat_tensors), each kept once (an input passed twice is two
 * operands). */
static int operands_of(const ag__region *r, operands *o) {
    memset(o, 0, sizeof *o);
    ag_tensor *buf[64], **flat = buf; /* one walk unless the module has more tensors */
    int64_t nt = r->module ? ag__module_flat_tensors(r->module, buf, 64) : 0;
    if (nt > 64) {
        if (!(flat = ag__malloc((size_t)nt * sizeof *flat)))
            return AG_ENOMEM;
        ag__module_flat_tensors(r->module, flat, nt);
    }
    int64_t cap = r->nin + nt;
    if (!(o->t = ag__calloc((size_t)(cap ? cap : 1), sizeof *o->t))) {
        if (flat != buf)
            ag__free(flat);
        return AG_ENOMEM;
    }
    for (int i = 0; i < r->nin; i++)
        o->t[o->n++] = r->inputs[i];
    for (int64_t j = 0; j < nt; j++) {
        bool seen = false;
        for (int i = 0; i < o->n && !seen; i++)
            seen = o->t[i] == flat[j];
        if (!seen)
            o->t[o->n++] = flat[j];
    }
    if (flat != buf)
        ag__free(flat);
    return 0;
}

/* The module's names of its operands (a no-op for the function form, or when built). Every
 * parameter or buffer operand must still be reachable in the module (a lazily traced joint runs
 * after the call): one that was replaced since is refused; tensors added since are not operands
 * and stay as they are. */
static int operands_names(const ag__region *r, operands *o) {
    if (!r->module || o->named)
        return 0;
    if (ag_module_named_parameters(r->module, false, &o->ps) ||
        ag_module_named_buffers(r->module, false, &o->bs))
        return ag_last_status();
    o->named = true;
    for (int k = r->nin; k < o->n; k++) {
        bool found = false;
        for (int pass = 0; pass < 2 && !found; pass++) {
            const ag_named_tensors *nt = pass ? &o->bs : &o->ps;
            for (int i = 0; i < nt->n && !found; i++)
                found = o->t[k] == nt->tensors[i];
        }
        if (!found)
            return ag__err(AG_EINVAL,
                           "nested_compile_region %s: operand %d, a parameter or buffer of the "
                           "module when the region was called, is no longer one of its "
                           "parameters or buffers",
                           r->name, k);
    }
    return 0;
}

/* ---- the cache ---- */

static region_entry *lookup(ag__region_cache *c, const ag__region *r, const operands *o) {
    bool training = r->module && ag_module_is_training(r->module);
    for (int64_t i = 0; c && i < c->n; i++) {
        region_entry *e = c->e[i];
        if (!e->ready || e->key != r->key || e->nops != o->n || e->training != training ||
            e->checkpoint != r->checkpoint || (!e->type) != (!r->type) ||
            (e->type && strcmp(e->type, r->type)))
            continue;
        bool same = true;
        for (int k = 0; k < o->n && same; k++) {
            ag_tmeta m;
            ag__tmeta_of(o->t[k], &m);
            same = ag__tmeta_equal(&m, &e->ops[k]) && e->rg[k] == is_float_rg(o->t[k]);
        }
        if (same)
            return e;
    }
    return NULL;
}

/* The first free name repeated_subgraphN of g. */
static void free_attr_name(ag_graph *g, char *buf, size_t n) {
    for (int k = ag_graph_num_subgraphs(g);; k++) {
        snprintf(buf, n, "repeated_subgraph%d", k);
        if (!ag_graph_subgraph(g, buf) && !ag_graph_find(g, buf))
            return;
    }
}

/* ---- tracing a region ---- */

/* Runs the region's function on ins (the stand-ins): the module form with its parameters and
 * buffers swapped for their stand-ins meanwhile, then given back what they held (the real
 * tensors, or an enclosing region's stand-ins while that region is traced). */
static int run_region(const ag__region *r, const operands *o, ag_tensor **ins, ag_tensor **outs,
                      int max_out) {
    if (!r->module)
        return r->fn(r->ud, ins, r->nin, outs, max_out);
    ag_module *m = r->module;
    int nn = o->ps.n + o->bs.n;
    ag_tensor *buf[64], **held = nn > 64 ? ag__malloc(sizeof *held * (size_t)nn) : buf;
    if (!held)
        return AG_ENOMEM;
    /* each fqn's tensor -> the stand-in of its operand */
    for (int pass = 0, h = 0; pass < 2; pass++) {
        const ag_named_tensors *nt = pass ? &o->bs : &o->ps;
        for (int i = 0; i < nt->n; i++, h++) {
            held[h] = NULL;
            for (int k = r->nin; k < o->n; k++)
                if (o->t[k] == nt->tensors[i]) {
                    held[h] = ag__module_swap_tensor(m, nt->names[i], !pass, ins[k]);
                    break;
                }
        }
    }
    int n = ag__module_forward(m, ins, r->nin, outs, max_out);
    for (int pass = 0, h = 0; pass < 2; pass++) {
        const ag_named_tensors *nt = pass ? &o->bs : &o->ps;
        for (int i = 0; i < nt->n; i++, h++)
            if (held[h])
                ag__module_swap_tensor(m, nt->names[i], !pass, held[h]);
    }
    if (held != buf)
        ag__free(held);
    return n;
}

/* Backward nodes of a joint subgraph take the custom metadata and stack trace of the first
 * forward node with their seq_nr (as the export does for the outer graph). */
static int copy_fwd_meta(ag_node *first_bw) {
    for (ag_node *b = first_bw; b; b = ag_node_next(b)) {
        int64_t seq = ag_node_seq_nr(b);
        if (seq < 0 || ag_node_is_gradient_acc(b) || ag_node_kind_of(b) == AG_NODE_OUTPUT)
            continue;
        for (ag_node *f = ag_graph_first(b->graph); f && f != first_bw; f = ag_node_next(f))
            if (ag_node_seq_nr(f) == seq) {
                int rc = ag_node_custom_copy(b, f);
                if (rc == 0 && ag_node_stack_trace(f))
                    rc = ag__node_meta_copy_key(b, f, "stack_trace");
                if (rc)
                    return rc;
                break;
            }
    }
    return 0;
}

/* The draws of a region's body (the nested session's random hook): from the subgraph's seed
 * and base offset placeholders. */
typedef struct region_rng {
    ag__tracer *S;
    ag_tensor *seed, *base;
    int64_t drawn;
} region_rng;

static int region_random(void *ud, const ag_op *op, const ag_arg *args, int nargs, ag_tensor **outs,
                         int nouts) {
    (void)nargs;
    (void)nouts;
    region_rng *R = ud;
    int d = ag__rng_call_draws(op, args);
    if (d <= 0)
        return d < 0 ? d : 1; /* 1: record the call as it is */
    return ag__rng_record(R->S, R->seed, R->base, &R->drawn, op, args, outs);
}

/* A region call in the body (the nested session's reserve hook): the numbers it draws come
 * from this region's seed at add(base_offset, drawn before), as a draw of the body would. */
static int region_reserve(void *ud, int64_t n, ag_tensor **seed, ag_tensor **offset) {
    region_rng *R = ud;
    bool prev = ag_set_grad_enabled(false);
    ag_scope_begin();
    ag_tensor *t = ag_add_scalar(R->base, (double)R->drawn);
    *offset = t && ag__tracer_node_of(R->S, t) ? ag_tensor_keep(t) : NULL;
    ag_scope_end();
    ag_set_grad_enabled(prev);
    if (!*offset)
        return ag_last_status() < 0 ? ag_last_status() : AG_ENOMEM;
    *seed = ag_tensor_keep(R->seed);
    R->drawn += n;
    return 0;
}

static void drop_sub(ag__tracer *T, ag_graph *sub);

/* Traces the region into a new subgraph: its forward (joint false: e->nout, e->out*, e->nrng
 * and e->drawn are filled), or its joint (placeholders: operands, the RNG operands, then one
 * tangent per output; outputs: a gradient per operand (None for the RNG operands), then the
 * forward's outputs). When T functionalizes random ops, the forward takes a seed and a base
 * offset after the operands, kept when the body draws (e->nrng 2), erased when it does not.
 * Returns the subgraph or NULL. */
static ag_graph *trace_sub(ag__tracer *T, const ag__region *r, const operands *o, region_entry *e,
                           bool joint) {
    ag_graph *sub = ag_graph_new();
    if (!sub)
        return NULL;
    int nrng = joint ? e->nrng : ag__tracer_has_rng_reserve(T) ? 2 : 0;
    int nph = o->n + nrng + (joint ? e->nout : 0);
    ag_tensor **ins = ag__calloc((size_t)(nph ? nph : 1), sizeof *ins);
    ag__tracer *S = ins ? ag__tracer_begin_nested(T, sub, r->name) : NULL;
    if (!S) {
        ag__free(ins);
        ag_graph_free(sub);
        return NULL;
    }
    int rc = 0;
    ag_node *rng_ph[2] = {0};
    for (int i = 0; i < nph && rc == 0; i++) {
        ag_tmeta m;
        bool rg = false;
        char name[32];
        snprintf(name, sizeof name, "arg%d_1", i);
        if (i < o->n) {
            ag__tmeta_of(o->t[i], &m);
            rg = e->rg[i];
        } else if (i < o->n + nrng) {
            ag__tmeta_contiguous(&m, AG_I64, 0, NULL);
            snprintf(name, sizeof name, "%s", i == o->n ? "philox_seed" : "philox_base_offset");
        } else {
            const ag_tmeta *om = &e->out[i - o->n - nrng];
            ag__tmeta_contiguous(&m, om->dtype, om->ndim, om->sizes);
        }
        ag_node *ph = ag_graph_placeholder(sub, name, &m);
        if (ph && i >= o->n && i < o->n + nrng)
            rng_ph[i - o->n] = ph;
        if (!ph || ag__tracer_outer_anns(S, ph) ||
            !(ins[i] = ag__tensor_new(m.dtype, m.ndim, m.sizes, true))) {
            rc = ag_last_status() ? ag_last_status() : AG_ENOMEM;
            break;
        }
        memcpy(ins[i]->strides, m.strides, sizeof ins[i]->strides);
        ins[i]->offset = m.offset;
        ins[i]->requires_grad = rg;
        ag__tracer_bind(S, ins[i], ph);
    }
    region_rng rs = {S, NULL, NULL, 0};
    if (rc == 0 && nrng) {
        rs.seed = ins[o->n];
        rs.base = ins[o->n + 1];
        ag__tracer_set_random(S, region_random, &rs);
        ag__tracer_set_rng_reserve(S, region_reserve, &rs); /* regions called in the body */
    }
    ag_tensor *outs[AG_MAX_OUTPUTS + 1] = {0};
    ag_node *onodes[2 * AG_MAX_OUTPUTS] = {0};
    int n = 0, non = 0;
    ag_scope_begin();
    if (rc == 0) {
        uint64_t errs = ag__err_count();
        /* a checkpointed region: its body's forward nodes tagged as one checkpoint (the
         * nested session began with none open; a checkpointed module's own ag_checkpoint
         * joins this one) */
        ag__tls_state *ts = ag__tls();
        if (r->checkpoint)
            ts->ckpt_region = ++ts->ckpt_serial;
        n = run_region(r, o, ins, outs, AG_MAX_OUTPUTS + 1);
        ts->ckpt_region = 0;
        if (n >= 0 && joint && rs.drawn != e->drawn)
            rc = ag__err(AG_EINVAL, "nested_compile_region %s: drew %lld random numbers, then %lld",
                         r->name, (long long)e->drawn, (long long)rs.drawn);
        if (rc == 0 && n < 0) {
            char why[512];
            snprintf(why, sizeof why, "%s", ag__err_count() != errs ? ag_last_error() : "");
            /* a region inside it that failed names itself (and a chain of them stays short) */
            if (!strncmp(why, "nested_compile_region ", 22))
                rc = ag__err(n, "%s", why);
            else
                rc = ag__err(n, "nested_compile_region %s: the region failed: %s", r->name,
                             why[0] ? why : "(no message)");
        } else if (n > AG_MAX_OUTPUTS) {
            rc = ag__err(AG_ENOTSUP, "nested_compile_region %s: more than %d outputs", r->name,
                         AG_MAX_OUTPUTS);
        }
    }
    for (int i = 0; i < o->n && rc == 0; i++)
        if (ins[i]->storage->version != 0)
            rc = ag__err(AG_ENOTSUP,
                         "nested_compile_region %s: the region mutates its operand %d (%s) in "
                         "place; mutating inputs, parameters or buffers inside a region is not "
                         "supported",
                         r->name, i, i < r->nin ? "an input" : "a parameter or buffer");
    for (int k = 0; k < n && rc == 0; k++) {
        for (int i = 0; i < o->n && rc == 0; i++)
            if (outs[k]->storage == ins[i]->storage)
                rc = ag__err(AG_ENOTSUP,
                             "nested_compile_region %s: output %d aliases operand %d (is it or a "
                             "view of it); return a copy (clone) instead",
                             r->name, k, i);
        if (rc == 0 && joint && n != e->nout)
            rc = ag__err(AG_EINVAL, "nested_compile_region %s: %d outputs, then %d", r->name,
                         e->nout, n);
    }
    if (rc == 0 && joint && o->n + nrng + n > AG_MAX_OUTPUTS)
        rc = ag__err(AG_ENOTSUP,
                     "nested_compile_region %s: the joint would have %d outputs (%d operands + "
                     "%d outputs; at most %d)",
                     r->name, o->n + nrng + n, o->n + nrng, n, AG_MAX_OUTPUTS);
    if (rc == 0 && joint) {
        ag_node *last_fw = ag_graph_last(sub);
        ag_tensor *roots[AG_MAX_OUTPUTS], *seeds[AG_MAX_OUTPUTS], *want[AG_MAX_OUTPUTS];
        ag_tensor *grads[AG_MAX_OUTPUTS] = {0};
        int nr = 0, nw = 0;
        for (int k = 0; k < n; k++)
            if (is_float_rg(outs[k])) {
                roots[nr] = outs[k];
                seeds[nr++] = ins[o->n + nrng + k];
            }
        for (int i = 0; i < o->n; i++)
            if (e->rg[i])
                want[nw++] = ins[i];
        if (nr > 0 && nw > 0)
            rc = ag_grad(roots, seeds, nr, want, nw, grads, false, true);
        for (int i = 0, w = 0; i < o->n && rc == 0; i++) {
            ag_tensor *gt = e->rg[i] ? grads[w++] : NULL;
            onodes[non] = gt ? ag__tracer_node_of(S, gt) : NULL;
            if (gt && !onodes[non])
                rc = ag_last_status();
            e->grad_none[i] = !onodes[non++];
        }
        for (int i = 0; i < nrng; i++) { /* the seed and offset: no gradient */
            e->grad_none[o->n + i] = true;
            onodes[non++] = NULL;
        }
        /* A backward rule drawing (none of the functional forms' rules does) would need the
         * backward's own RNG state. */
        if (rc == 0 && rs.drawn != e->drawn)
            rc = ag__err(AG_ENOTSUP,
                         "nested_compile_region %s: the region's backward draws random numbers; "
                         "a region's backward drawing is not supported",
                         r->name);
        if (rc == 0)
            rc = copy_fwd_meta(last_fw ? ag_node_next(last_fw) : ag_graph_first(sub));
    }
    for (int k = 0; k < n && rc == 0; k++) {
        if (!(onodes[non++] = ag__tracer_node_of(S, outs[k])))
            rc = ag_last_status();
        if (!joint) {
            ag__tmeta_of(outs[k], &e->out[k]);
            e->out_rg[k] = is_float_rg(outs[k]);
        }
    }
    if (!joint) {
        e->nout = n;
        e->drawn = rs.drawn;
        e->nrng = rs.drawn > 0 ? nrng : 0;
    }
    ag_node *on = NULL;
    if (rc == 0 && (!(on = ag_graph_output(sub, onodes, non)) || ag__tracer_outer_anns(S, on)))
        rc = ag_last_status() ? ag_last_status() : AG_ENOMEM;
    ag_scope_end();
    ag__tracer_end(S);
    for (int k = 0; k < n; k++)
        ag_tensor_free(outs[k]); /* fn's new references */
    for (int i = 0; i < nph; i++)
        ag_tensor_free(ins[i]);
    ag__free(ins);
    /* a body that draws nothing takes no RNG operands */
    for (int i = 0; i < 2 && rc == 0 && !joint && !e->nrng; i++)
        if (rng_ph[i])
            rc = ag_graph_erase(sub, rng_ph[i]);
    if (rc) {
        drop_sub(T, sub);
        return NULL;
    }
    return sub;
}

/* ---- where a region is called ---- */

/* Forgets the sites in g and in its subgraphs, which are being freed (a failed trace). A region
 * whose joint (forward) subgraph was in those graphs only is traced again when next needed (a
 * new entry for its next call). */
static void purge_sites(ag__region_cache *c, const ag_graph *g) {
    for (int i = 0; i < ag_graph_num_subgraphs(g); i++)
        purge_sites(c, ag_graph_subgraph_at(g, i, NULL));
    for (int64_t i = 0; c && i < c->n; i++) {
        region_entry *e = c->e[i];
        bool fw = false, bw = false, gone = false;
        for (int64_t k = e->nsites - 1; k >= 0; k--) {
            if (e->sites[k].g == g) {
                memmove(e->sites + k, e->sites + k + 1,
                        sizeof *e->sites * (size_t)(e->nsites - k - 1));
                e->nsites--;
                gone = true;
                continue;
            }
            fw |= e->sites[k].fw_attr[0] != 0;
            bw |= e->sites[k].bw_attr[0] != 0;
        }
        if (gone && !bw)
            e->has_bw = false;
        if (gone && !fw)
            e->ready = false;
    }
}

/* Frees sub, a subgraph traced for the session T that no graph took. */
static void drop_sub(ag__tracer *T, ag_graph *sub) {
    purge_sites(*root_cache(T), sub);
    ag_graph_free(sub);
}

/* e's site in g (made empty on first need), or NULL (out of memory). */
static region_site *site_of(region_entry *e, ag_graph *g) {
    for (int64_t k = 0; k < e->nsites; k++)
        if (e->sites[k].g == g)
            return &e->sites[k];
    if (ag__grow((void **)&e->sites, &e->sites_cap, e->nsites + 1, sizeof *e->sites))
        return NULL;
    region_site *s = &e->sites[e->nsites++];
    memset(s, 0, sizeof *s);
    s->g = g;
    return s;
}

/* Adds sub to g as the first free repeated_subgraphN, written to name (freed on failure). */
static int add_sub(ag__tracer *T, ag_graph *g, ag_graph *sub, char *name, size_t cap) {
    free_attr_name(g, name, cap);
    if (ag_graph_add_subgraph(g, name, sub)) {
        drop_sub(T, sub);
        name[0] = 0;
        return ag_last_status();
    }
    return 0;
}

/* The name of e's forward (bw: joint) subgraph in g: a copy of the one traced for another graph
 * added to g on first need. NULL on failure. */
static const char *attr_in(ag__tracer *T, region_entry *e, ag_graph *g, bool bw) {
    region_site *s = site_of(e, g);
    if (!s)
        return NULL;
    if ((bw ? s->bw_attr : s->fw_attr)[0])
        return bw ? s->bw_attr : s->fw_attr;
    const ag_graph *src = NULL;
    for (int64_t k = 0; k < e->nsites && !src; k++) {
        const char *a = bw ? e->sites[k].bw_attr : e->sites[k].fw_attr;
        if (a[0])
            src = ag_graph_subgraph(e->sites[k].g, a);
    }
    if (!src) {
        ag__err(AG_EINVAL, "nested_compile_region: region %d has no traced %s subgraph", e->index,
                bw ? "joint" : "forward");
        return NULL;
    }
    ag_graph *copy = ag_graph_copy(src);
    char *name = bw ? s->bw_attr : s->fw_attr;
    if (!copy || add_sub(T, g, copy, name, sizeof s->fw_attr))
        return NULL;
    return name;
}

/* A new entry for r, traced: its forward subgraph (and, want_joint, its joint) an attribute of
 * the session's graph. Its slot is taken first, so the regions its body calls, traced
 * meanwhile, get the next indices; a failed entry stays, dead. */
static region_entry *new_entry(ag__tracer *T, const ag__region *r, operands *o, bool want_joint) {
    ag__region_cache **cp = root_cache(T);
    if (!*cp && !(*cp = ag__calloc(1, sizeof **cp)))
        return NULL;
    ag__region_cache *c = *cp;
    region_entry *e = NULL;
    if (ag__grow((void **)&c->e, &c->cap, c->n + 1, sizeof *c->e) ||
        !(e = ag__calloc(1, sizeof *e)))
        return NULL;
    c->e[c->n] = e;
    e->index = (int)c->n++;
    e->key = r->key;
    e->training = r->module && ag_module_is_training(r->module);
    e->checkpoint = r->checkpoint;
    e->nops = o->n;
    snprintf(e->fw_ident, sizeof e->fw_ident, "fw_subgraph_%d", e->index);
    snprintf(e->bw_ident, sizeof e->bw_ident, "bw_subgraph_%d_0", e->index);
    e->ops = ag__calloc((size_t)(o->n ? o->n : 1), sizeof *e->ops);
    e->rg = ag__calloc((size_t)(o->n ? o->n : 1), sizeof *e->rg);
    bool ok = e->ops && e->rg && (!r->type || (e->type = ag__strdup(r->type))) &&
              operands_names(r, o) == 0;
    for (int i = 0; ok && i < o->n; i++) {
        ag__tmeta_of(o->t[i], &e->ops[i]);
        e->rg[i] = is_float_rg(o->t[i]);
    }
    ag_graph *g = ag__tracer_graph(T);
    ag_graph *fw = ok ? trace_sub(T, r, o, e, false) : NULL;
    region_site *s = fw ? site_of(e, g) : NULL;
    if (fw && !s)
        drop_sub(T, fw);
    ok = s && add_sub(T, g, fw, s->fw_attr, sizeof s->fw_attr) == 0;
    bool any_rg = false, any_out_rg = false;
    for (int i = 0; ok && i < o->n; i++)
        any_rg |= e->rg[i];
    for (int k = 0; k < e->nout; k++)
        any_out_rg |= e->out_rg[k];
    if (ok && want_joint && any_rg && any_out_rg) {
        ag_graph *bw = trace_sub(T, r, o, e, true);
        s = bw ? site_of(e, g) : NULL; /* the sites may have moved meanwhile */
        ok = s && add_sub(T, g, bw, s->bw_attr, sizeof s->bw_attr) == 0;
        e->has_bw = ok;
    }
    if (!ok) {
        /* dead: never looked up (the attributes added stay, unused) */
        e->key = NULL;
        if (!ag_last_status())
            ag__err(AG_ENOMEM, "nested_compile_region %s: out of memory", r->name);
        return NULL;
    }
    e->ready = true;
    return e;
}

/* ---- the backward ---- */

typedef struct region_bw {
    ag__region r; /* fn, ud, module, key, type (borrowed: valid while the trace runs) */
    char name[64];
    uint64_t trace_id; /* the outermost session's */
    int64_t entry, call_id;
    int nops, nreal; /* the call's operands: the region's nreal, then its RNG operands */
    ag_tensor **ops; /* kept */
    operands o;      /* the module's names, for a lazily traced joint */
} region_bw;

static void region_bw_free(void *p) {
    region_bw *b = p;
    if (!b)
        return;
    for (int i = 0; i < b->nops; i++)
        ag_tensor_free(b->ops[i]);
    ag__free(b->ops);
    ag_named_tensors_free(&b->o.ps);
    ag_named_tensors_free(&b->o.bs);
    ag__free(b);
}

/* getitem k of inv and a data-less tensor bound to it in *out: a new reference, or (give) a
 * result of the open scope. */
static int emit_getitem(ag__tracer *T, ag_node *inv, int k, const ag_tmeta *m, bool give,
                        ag_tensor **out) {
    ag_node *gi = ag_graph_getitem(ag__tracer_graph(T), inv, k, NULL);
    if (!gi || ag__tracer_node_meta(T, gi))
        return ag_last_status() ? ag_last_status() : AG_ENOMEM;
    ag_tensor *t = ag__tensor_new(m->dtype, m->ndim, m->sizes, true);
    if (!t)
        return ag_last_status() ? ag_last_status() : AG_ENOMEM;
    memcpy(t->strides, m->strides, sizeof t->strides);
    t->offset = m->offset;
    ag__tracer_bind(T, t, gi);
    *out = give ? ag__give(t) : t;
    return *out ? 0 : AG_ENOMEM;
}

static int region_backward(void *ud, ag_tensor *const *gout, int nout, ag_tensor **gin, int nin,
                           const bool *needs) {
    region_bw *b = ud;
    ag__tracer *T = ag__tracer_active();
    if (!T || ag__tracer_id(T) != b->trace_id)
        return ag__err(AG_ENOTSUP,
                       "nested_compile_region %s: the backward of a traced region runs only in "
                       "the trace that recorded it",
                       b->name);
    region_entry *e = (*root_cache(T))->e[b->entry];
    ag_graph *g = ag__tracer_graph(T);
    if (!e->has_bw) { /* a trace that is not a joint export, or a region in a region: now */
        b->o.t = b->ops;
        b->o.n = b->nreal;
        ag_graph *bw = operands_names(&b->r, &b->o) ? NULL : trace_sub(T, &b->r, &b->o, e, true);
        b->o.t = NULL;
        region_site *s = bw ? site_of(e, g) : NULL;
        if (bw && !s)
            drop_sub(T, bw);
        if (!s || add_sub(T, g, bw, s->bw_attr, sizeof s->bw_attr))
            return ag_last_status() ? ag_last_status() : AG_ENOMEM;
        e->has_bw = true;
    }
    const char *bw_attr = attr_in(T, e, g, true);
    if (!bw_attr)
        return ag_last_status() ? ag_last_status() : AG_ENOMEM;
    int nargs = b->nops + e->nout, rc = 0;
    ag_node **args = ag__calloc((size_t)nargs, sizeof *args);
    if (!args)
        return AG_ENOMEM;
    for (int i = 0; i < b->nops && rc == 0; i++)
        if (!(args[i] = ag__tracer_node_of(T, b->ops[i])))
            rc = ag_last_status();
    for (int k = 0; k < e->nout && rc == 0; k++) {
        ag_tensor *t = k < nout ? gout[k] : NULL;
        if (!t) /* an output without a gradient: a zero tangent */
            t = ag_zeros(e->out[k].dtype, e->out[k].ndim, e->out[k].sizes);
        if (!t || !(args[b->nops + k] = ag__tracer_node_of(T, t)))
            rc = ag_last_status() ? ag_last_status() : AG_ENOMEM;
    }
    /* the get_attr takes the forward call's metadata (the first forward call in this graph) */
    const region_site *fs = site_of(e, g);
    const ag_node *fw_attr_node = fs ? fs->fw_attr_node : NULL;
    ag_node *attr = NULL, *inv = NULL;
    if (rc == 0 &&
        (!(attr = ag_graph_get_attr_subgraph(g, bw_attr, NULL)) || ag__tracer_attr_meta(T, attr) ||
         (fw_attr_node && ag_node_custom_copy(attr, fw_attr_node)) ||
         !(inv = ag_graph_invoke_subgraph(g, attr, e->bw_ident, args, nargs, NULL)) ||
         ag__tracer_node_meta(T, inv) ||
         ag_node_custom_set(inv, "call_id", (ag_mval){.kind = AG_MV_INT, .u.i = b->call_id})))
        rc = ag_last_status() ? ag_last_status() : AG_ENOMEM;
    for (int j = 0; j < nin && j < b->nops && rc == 0; j++)
        if (needs[j] && e->rg[j] && !e->grad_none[j])
            rc = emit_getitem(T, inv, j, &e->ops[j], true, &gin[j]);
    ag__free(args);
    return rc;
}

/* ---- the hook ---- */

int ag__trace_region(const ag__region *r0, ag_tensor **outs, int max_out) {
    ag__tracer *T = ag__tracer_active();
    /* Outside a session: the function itself. A region inside a region's body is traced into
     * that region's subgraph, as a call of its own subgraph (an attribute of the outer one). */
    if (!T) {
        if (r0->module)
            return ag__module_forward(r0->module, r0->inputs, r0->nin, outs, max_out);
        return r0->fn(r0->ud, r0->inputs, r0->nin, outs, max_out);
    }
    if (session_depth(T) >= REGION_MAX_DEPTH)
        return ag__err(AG_ENOTSUP,
                       "nested_compile_region %s: regions nested more than %d deep (does the "
                       "region call itself?)",
                       r0->name, REGION_MAX_DEPTH);
    /* A region called inside a checkpoint's forward is checkpointed too: its subgraphs' forward
     * nodes carry the tags (the outer call's nodes do as well, but an invoke_subgraph is never
     * recomputed: the region's partition is what saves less). */
    ag__tls_state *ts0 = ag__tls();
    ag__region rr = *r0;
    rr.checkpoint |= ts0->ckpt_region && ts0->bw_seq_nr < 0 && !ag__tracer_in_backward(T);
    const ag__region *r = &rr;
    operands o;
    int rc = operands_of(r, &o);
    /* In a region's body the module holds that region's stand-ins only while its body runs: a
     * region called there names its operands now, for its joint traced later. */
    if (rc == 0 && ag__tracer_parent(T))
        rc = operands_names(r, &o);
    ag_node **nodes = rc ? NULL : ag__calloc((size_t)o.n + 2, sizeof *nodes);
    if (!rc && !nodes)
        rc = AG_ENOMEM;
    for (int i = 0; i < o.n && rc == 0; i++)
        if (!(nodes[i] = ag__tracer_node_of(T, o.t[i])))
            rc = ag_last_status();
    bool want_ag = false;
    for (int i = 0; i < o.n; i++)
        want_ag |= is_float_rg(o.t[i]);
    want_ag = want_ag && ag_is_grad_enabled();
    region_entry *e = NULL;
    if (rc == 0 && !(e = lookup(*root_cache(T), r, &o)) &&
        !(e = new_entry(T, r, &o, want_ag && ag__tracer_joint(T))))
        rc = ag_last_status() ? ag_last_status() : AG_ENOMEM;
    if (rc == 0 && e->nout > max_out)
        rc = ag__err(AG_EINVAL, "nested_compile_region %s: %d outputs, room for %d", r->name,
                     e->nout, max_out);
    bool any_out_rg = false;
    for (int k = 0; e && k < e->nout; k++)
        any_out_rg |= e->out_rg[k];
    want_ag = want_ag && any_out_rg;
    ag_graph *g = ag__tracer_graph(T);
    ag__region_cache *c = *root_cache(T);
    ag_node *attr = NULL, *inv = NULL;
    int64_t call_id = c ? c->calls + 1 : 1;
    ag_tensor *rng[2] = {0}; /* the call's seed and offset when the body draws */
    int nops = o.n;
    if (rc == 0) {
        /* The call's nodes carry the seq_nr of the autograd node made below (upstream's). */
        ag__tls_state *ts = ag__tls();
        ts->trace_seq = want_ag ? ag__autograd_current_seq() + 1 : ag__autograd_current_seq();
        /* A body that draws takes its RNG state as operands: the call draws the next numbers
         * of the session's generator, as eager's call of the region does. */
        if (e->nrng) {
            rc = ag__tracer_rng_reserve(T, e->drawn, &rng[0], &rng[1]);
            for (int k = 0; k < 2 && rc == 0; k++)
                if (!(nodes[nops++] = ag__tracer_node_of(T, rng[k])))
                    rc = ag_last_status();
        }
    }
    const char *fw_attr = rc == 0 ? attr_in(T, e, g, false) : NULL;
    if (rc == 0 && !fw_attr)
        rc = ag_last_status() ? ag_last_status() : AG_ENOMEM;
    if (rc == 0) {
        if (!(attr = ag_graph_get_attr_subgraph(g, fw_attr, NULL)) ||
            ag__tracer_attr_meta(T, attr) ||
            !(inv = ag_graph_invoke_subgraph(g, attr, e->fw_ident, nodes, nops, NULL)) ||
            ag__tracer_node_meta(T, inv) ||
            ag_node_custom_set(inv, "call_id", (ag_mval){.kind = AG_MV_INT, .u.i = call_id}))
            rc = ag_last_status() ? ag_last_status() : AG_ENOMEM;
        else
            c->calls = call_id;
        region_site *st = rc == 0 ? site_of(e, g) : NULL; /* made by attr_in */
        if (st && !st->fw_attr_node)
            st->fw_attr_node = attr;
    }
    int n = 0;
    for (; rc == 0 && n < e->nout; n++)
        rc = emit_getitem(T, inv, n, &e->out[n], false, &outs[n]);
    region_bw *b = NULL;
    if (rc == 0 && want_ag) {
        b = ag__calloc(1, sizeof *b);
        if (b && (b->ops = ag__calloc((size_t)nops + 1, sizeof *b->ops))) {
            b->r = *r;
            size_t ln = strnlen(r->name, sizeof b->name - 1); /* truncated as before */
            memcpy(b->name, r->name, ln);
            b->name[ln] = 0;
            b->r.name = b->name;
            b->trace_id = ag__tracer_id(T);
            b->entry = e->index;
            b->call_id = call_id;
            b->nops = nops;
            b->nreal = o.n;
            for (int i = 0; i < o.n; i++)
                b->ops[i] = ag_tensor_keep(o.t[i]);
            for (int i = o.n; i < nops; i++)
                b->ops[i] = ag_tensor_keep(rng[i - o.n]);
            b->o.named = o.named;
            b->o.ps = o.ps;
            b->o.bs = o.bs;
            o.named = false;
            memset(&o.ps, 0, sizeof o.ps);
            memset(&o.bs, 0, sizeof o.bs);
            rc = ag__autograd_custom("InvokeSubgraphAutogradOp", o.t, o.n, outs, n, e->out_rg,
                                     region_backward, b, region_bw_free);
        } else {
            ag__free(b);
            rc = AG_ENOMEM;
        }
    }
    ag__free(nodes);
    operands_free(&o);
    ag_tensor_free(rng[0]);
    ag_tensor_free(rng[1]);
    if (rc) {
        for (int k = 0; k < n && k < max_out; k++) {
            ag_tensor_free(outs[k]);
            outs[k] = NULL;
        }
        return rc;
    }
    return n;
}
