/* ag_compiled_call_module: the compiled callable called on a module, whose parameters and
 * buffers are found by the names the joint recorded for them.
 *
 * In: the joint's flat input descriptors, read at compile time (ag__modcall_init) into one slot
 * per parameter or buffer input (ParamAOTInput(target=fqn), BufferAOTInput(target=fqn); a
 * tensor subclass instance's parts are described through its own descriptor, so an instance
 * parameter is one slot) and a hash map from FQN to slot. Out: the callable's inputs in the
 * joint's order, each parameter and buffer the module's tensor registered under that name, the
 * call's args in the other places (after them, as the export made it).
 *
 * Resolving walks the module once, hashing each of its names once, and checks that it holds
 * exactly the joint's names, each as the same kind (parameter or buffer) with the dtype and
 * shape the joint takes. The tensors found are kept with the module's pointer and stamp
 * (ag__module_stamp, which changes whenever the module's tree gains or swaps a tensor or
 * converts one, and is never shared with another module, freed ones included): a later call on
 * the unchanged module copies pointers, with no walk and no string. */
#include "../core/strmap.h"
#include "../nn/nn_internal.h"
#include "compiled_internal.h"

struct ag__modcall {
    int nin;               /* the callable's inputs (the outer ones with tensor subclasses) */
    int nslots, nargs;     /* ... of them parameters and buffers, and the others (args) */
    int *src;              /* per input: its slot (>= 0), or -1 - k for args[k] */
    const char **fqn;      /* per slot: the target (borrowed from c->flat_desc) */
    bool *param;           /* per slot: ParamAOTInput (else BufferAOTInput) */
    int *input;            /* per slot: its input */
    int *first;            /* per slot: the first slot of the same name (itself when unique) */
    const ag_tmeta **meta; /* per slot: the dtype and shape the joint takes, NULL if unknown */
    ag_tensor **t;         /* per slot: the module's tensor (borrowed), valid for (m, stamp) */
    signed char *found;    /* per slot, while resolving: 0 absent, 1 a parameter, 2 a buffer */
    ag__strmap by_fqn;     /* name -> its first slot + 1 */
    const ag_module *m;    /* the module t was resolved in (NULL: none) ... */
    uint64_t stamp;        /* ... and its stamp then */
    ag__kept_ptrs in;      /* the call's input array, kept between calls */
};

/* The descriptor of callable input i: flat input i's, or, with tensor subclasses, that of the
 * instance whose first part is flat input b (its parts' descriptors nest the instance's). */
static const ag_desc *input_desc(const ag_compiled *c, int b) {
    const ag_desc *d = c->flat_desc && b >= 0 && b < c->nflat ? c->flat_desc[b] : NULL;
    while (d && (ag_desc_kind_of(d) == AG_DESC_SUBCLASS_GETATTR_INPUT ||
                 ag_desc_kind_of(d) == AG_DESC_SUBCLASS_SIZE_INPUT ||
                 ag_desc_kind_of(d) == AG_DESC_SUBCLASS_STRIDE_INPUT))
        d = ag_desc_nested(d);
    return d;
}

/* The dtype and shape the joint takes for callable input i (flat input i without subclasses):
 * an instance's outer metadata; a primal's placeholder; a view's geometry at export; a removed
 * duplicate's first occurrence's. NULL where unknown. */
static const ag_tmeta *input_meta(const ag_compiled *c, int i) {
    if (c->sub)
        return i < c->sub->nin ? &c->sub->in[i].outer : NULL;
    if (!c->alias.flat || i >= c->alias.nflat)
        return NULL;
    const ag__flat_info *f = &c->alias.flat[i];
    for (int hops = 0; f->kind == AG__FLAT_DUP && hops < 2; hops++) {
        if (f->dup_of < 0 || f->dup_of >= c->alias.nflat)
            return NULL;
        f = &c->alias.flat[f->dup_of];
    }
    if (f->kind == AG__FLAT_VIEW)
        return &f->geom;
    if (f->kind == AG__FLAT_PRIMAL && f->primal >= 0 && f->primal < c->nprimals &&
        c->alias.prim[f->primal].base == AG__BASE_NONE)
        return &c->in_meta[f->primal];
    return NULL;
}

static void modcall_free(ag__modcall *mc) {
    if (!mc)
        return;
    ag__free(mc->src);
    ag__free(mc->fqn);
    ag__free(mc->param);
    ag__free(mc->input);
    ag__free(mc->first);
    ag__free(mc->meta);
    ag__free(mc->t);
    ag__free(mc->found);
    ag__strmap_free(&mc->by_fqn);
    ag__free(mc->in.p);
    ag__free(mc);
}

void ag__modcall_clear(ag_compiled *c) {
    modcall_free(c->modcall);
    c->modcall = NULL;
}

int ag__modcall_init(ag_compiled *c) {
    ag__modcall *mc = ag__calloc(1, sizeof *mc);
    if (!mc)
        return AG_ENOMEM;
    c->modcall = mc;
    mc->nin = c->sub ? c->sub->nin : c->nflat;
    size_t n = (size_t)(mc->nin ? mc->nin : 1);
    mc->src = ag__calloc(n, sizeof *mc->src);
    mc->fqn = ag__calloc(n, sizeof *mc->fqn);
    mc->param = ag__calloc(n, sizeof *mc->param);
    mc->input = ag__calloc(n, sizeof *mc->input);
    mc->first = ag__calloc(n, sizeof *mc->first);
    mc->meta = ag__calloc(n, sizeof *mc->meta);
    mc->t = ag__calloc(n, sizeof *mc->t);
    mc->found = ag__calloc(n, sizeof *mc->found);
    mc->in.p = ag__calloc(n, sizeof *mc->in.p);
    if (!mc->src || !mc->fqn || !mc->param || !mc->input || !mc->first || !mc->meta || !mc->t ||
        !mc->found || !mc->in.p || ag__strmap_reserve(&mc->by_fqn, mc->nin))
        return AG_ENOMEM;
    for (int i = 0, b = 0; i < mc->nin; b += c->sub ? c->sub->in[i].nflat : 1, i++) {
        const ag_desc *d = input_desc(c, b);
        if (!ag_desc_is_param(d) && !ag_desc_is_buffer(d)) {
            mc->src[i] = -1 - mc->nargs++;
            continue;
        }
        int s = mc->nslots++;
        mc->src[i] = s;
        mc->input[s] = i;
        mc->param[s] = ag_desc_is_param(d);
        mc->fqn[s] = ag_desc_target(d) ? ag_desc_target(d) : ""; /* (never NULL) */
        mc->meta[s] = input_meta(c, i);
        mc->first[s] = s;
        void *at = ag__strmap_get(&mc->by_fqn, mc->fqn[s]);
        if (at)
            mc->first[s] = (int)(intptr_t)at - 1;
        else if (ag__strmap_put(&mc->by_fqn, mc->fqn[s], (void *)(intptr_t)(s + 1)))
            return AG_ENOMEM;
    }
    return 0;
}

/* ---- resolving: the module's tensors by the joint's names ---- */

typedef struct resolve {
    ag__modcall *mc;
    char extra[200]; /* the first name the joint does not take ("" when none) */
    bool extra_param;
    int nextra;
} resolve;

static int resolve_one(void *ud, const char *fqn, ag_tensor *t, bool param) {
    resolve *r = ud;
    ag__modcall *mc = r->mc;
    void *at = ag__strmap_get(&mc->by_fqn, fqn);
    if (!at) {
        if (r->nextra++ == 0) {
            snprintf(r->extra, sizeof r->extra, "%s", fqn);
            r->extra_param = param;
        }
        return 0;
    }
    int s = (int)(intptr_t)at - 1;
    mc->t[s] = t;
    mc->found[s] = param ? 1 : 2;
    return 0;
}

/* A slot's name for messages: "parameter 'fc.weight'". */
static const char *kind_name(bool param) {
    return param ? "parameter" : "buffer";
}

/* Finds every slot's tensor in m and checks them; on success remembers (m, its stamp). */
static int modcall_resolve(ag_compiled *c, ag__modcall *mc, const ag_module *m) {
    mc->m = NULL;
    memset(mc->found, 0, sizeof *mc->found * (size_t)(mc->nslots ? mc->nslots : 1));
    resolve r = {.mc = mc};
    int rc = ag__module_visit_tensors(m, resolve_one, &r);
    if (rc)
        return rc;
    for (int s = 0; s < mc->nslots; s++) {
        int f = mc->first[s];
        if (!mc->found[f])
            return ag__err(AG_EINVAL,
                           "compiled_call_module: the module has no %s '%s', which the compiled "
                           "function takes as its input %d (the joint was exported from a "
                           "module that had it)",
                           kind_name(mc->param[s]), mc->fqn[s], mc->input[s]);
        if ((mc->found[f] == 1) != mc->param[s])
            return ag__err(AG_EINVAL,
                           "compiled_call_module: '%s' is a %s of the module; the compiled "
                           "function takes it as a %s (input %d)",
                           mc->fqn[s], kind_name(mc->found[f] == 1), kind_name(mc->param[s]),
                           mc->input[s]);
        mc->t[s] = mc->t[f];
        const ag_tmeta *e = mc->meta[s];
        const ag_tensor *t = mc->t[s];
        if (e && (t->dtype != e->dtype || t->ndim != e->ndim ||
                  memcmp(t->sizes, e->sizes, sizeof(int64_t) * (size_t)e->ndim))) {
            char a[128], b[128];
            return ag__err(AG_EINVAL,
                           "compiled_call_module: the module's %s '%s' is %s%s; the compiled "
                           "function takes %s%s (input %d)",
                           kind_name(mc->param[s]), mc->fqn[s], ag_dtype_short(t->dtype),
                           ag__fmt_sizes(a, sizeof a, t->ndim, t->sizes), ag_dtype_short(e->dtype),
                           ag__fmt_sizes(b, sizeof b, e->ndim, e->sizes), mc->input[s]);
        }
    }
    if (r.nextra)
        return ag__err(AG_EINVAL,
                       "compiled_call_module: the module's %s '%s'%s is not an input of the "
                       "compiled function (its joint takes %d parameters and buffers); export "
                       "the module again, or pass the inputs to ag_compiled_call",
                       kind_name(r.extra_param), r.extra, r.nextra > 1 ? " (and others)" : "",
                       mc->nslots);
    mc->m = m;
    mc->stamp = ag__module_stamp(m);
    return 0;
}

int ag_compiled_call_module(ag_compiled *c, ag_module *m, ag_tensor *const *args, int nargs,
                            ag_tensor **outs, int max_out) {
    AG__CHECK_NULL("compiled_call_module", c);
    AG__CHECK_NULL("compiled_call_module", m);
    if (nargs < 0)
        return ag__err(AG_EINVAL, "compiled_call_module: negative argument count %d", nargs);
    if (nargs > 0)
        AG__CHECK_NULL("compiled_call_module", args);
    if (max_out > 0)
        AG__CHECK_NULL("compiled_call_module", outs);
    ag__modcall *mc = c->modcall;
    if (mc->m != m || mc->stamp != ag__module_stamp(m)) {
        int rc = modcall_resolve(c, mc, m);
        if (rc)
            return rc;
    }
    if (nargs != mc->nargs)
        return ag__err(AG_EINVAL,
                       "compiled_call_module: %d args given, the compiled function takes %d "
                       "after the module's %d parameters and buffers",
                       nargs, mc->nargs, mc->nslots);
    /* The inputs in the joint's order, in the kept array unless a call inside this one (a
     * forward calling the callable again) holds it. */
    bool kept = !mc->in.busy;
    ag_tensor **in = kept ? mc->in.p : ag__calloc((size_t)(mc->nin ? mc->nin : 1), sizeof *in);
    if (!in)
        return AG_ENOMEM;
    mc->in.busy = true;
    for (int i = 0; i < mc->nin; i++)
        in[i] = mc->src[i] >= 0 ? mc->t[mc->src[i]] : args[-1 - mc->src[i]];
    int rc = ag_compiled_call(c, in, mc->nin, outs, max_out);
    if (kept)
        mc->in.busy = false;
    else
        ag__free(in);
    return rc;
}
