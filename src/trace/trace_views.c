/* View-aware functionalization: mutations through views reach every alias of the storage.
 *
 * In: the functionalizing tracer's data mutations (trace.c's record_functional) and reads of
 * tensors (node_of). Out: graph nodes that keep all aliases of a storage consistent, as
 * PyTorch's FunctionalTensorMode does with its view metas.
 *
 * The first data mutation of a storage registers the storage's base: the mutated tensor's
 * ._base (the root of its view chain), or the tensor itself. A mutation of a tensor with the
 * base's geometry makes its new value the base's value; a mutation through a view scatters
 * the view's new value into the base (as_strided_scatter with the view's sizes, strides and
 * offset relative to the base). Every data mutation bumps the storage's generation. A tensor
 * of that storage read later with an older generation is regenerated from the base's current
 * value (as_strided, or the base node itself for the base's own geometry), so `b = a[1];
 * b.mul_(2); a + 1` reads the updated a. Storages without mutations have no entry and their
 * tensors are never touched, so graphs of models that mutate nothing through views are the
 * same as before. Relative offsets need a contiguous base; a mutation through a view of a
 * non-contiguous base is refused with a message. The joint export registers input bases
 * itself (synthetic and view bases). */
#include "trace_views.h"

typedef struct alias_entry {
    ag_storage *storage; /* a reference, so its address is not reused while the entry lives */
    ag_tmeta base;       /* the base's geometry */
    ag_node *node;       /* the base's current value */
    uint64_t ver;        /* data mutations so far */
} alias_entry;

struct ag__alias_table {
    alias_entry *e;
    int64_t n, cap;
};

ag__alias_table *ag__alias_table_new(void) {
    return ag__calloc(1, sizeof(ag__alias_table));
}

void ag__alias_table_free(ag__alias_table *a) {
    if (!a)
        return;
    for (int64_t i = 0; i < a->n; i++)
        ag__storage_release(a->e[i].storage);
    ag__free(a->e);
    ag__free(a);
}

static alias_entry *find(const ag__alias_table *a, const ag_storage *s) {
    for (int64_t i = 0; a && i < a->n; i++)
        if (a->e[i].storage == s)
            return &a->e[i];
    return NULL;
}

static alias_entry *add(ag__alias_table *a, ag_tensor *base, ag_node *node) {
    if (ag__grow((void **)&a->e, &a->cap, a->n + 1, sizeof *a->e))
        return NULL;
    alias_entry *e = &a->e[a->n++];
    e->storage = base->storage;
    e->storage->refcount++;
    ag__tmeta_of(base, &e->base);
    e->node = node;
    e->ver = 0;
    return e;
}

uint64_t ag__alias_current_ver(const ag__alias_table *a, const ag_tensor *t) {
    const alias_entry *e = find(a, t->storage);
    return e ? e->ver : 0;
}

static bool same_geometry(const ag_tmeta *x, const ag_tmeta *y) {
    if (x->ndim != y->ndim || x->offset != y->offset || x->dtype != y->dtype)
        return false;
    for (int d = 0; d < x->ndim; d++)
        if (x->sizes[d] != y->sizes[d] || (x->sizes[d] > 1 && x->strides[d] != y->strides[d]))
            return false;
    return true;
}

static void bind(ag__tracer *T, ag_tensor *t, ag_node *v, uint64_t ver) {
    ag__tracer_bind(T, t, v);
    t->trace_ver = ver;
}

ag_node *ag__alias_refresh(ag__tracer *T, ag__alias_table *a, ag_tensor *t) {
    alias_entry *e = find(a, t->storage);
    if (!e || t->trace_ver == e->ver)
        return t->trace;
    ag_tmeta m;
    ag__tmeta_of(t, &m);
    ag_node *v = e->node;
    if (!same_geometry(&m, &e->base)) {
        int64_t off = m.offset - e->base.offset;
        ag_garg ga[4] = {AG_GA_N(e->node), AG_GA_INTS(m.sizes, m.ndim),
                         AG_GA_INTS(m.strides, m.ndim), AG_GA_I(off)};
        v = ag__tracer_call(T, ag__op("as_strided"), ga, 4);
        if (!v)
            return NULL;
    }
    bind(T, t, v, e->ver);
    return v;
}

int ag__alias_data_mutation(ag__tracer *T, ag__alias_table *a, const char *op, ag_tensor *t,
                            ag_node *v) {
    alias_entry *e = find(a, t->storage);
    if (!e) {
        ag_tensor *root = t->base ? t->base : t;
        ag_node *bn = ag__tracer_node_of(T, root); /* t itself is still bound to its old value */
        if (!bn || !(e = add(a, root, bn)))
            return ag_last_status();
    }
    ag_tmeta m;
    ag__tmeta_of(t, &m);
    ag_node *nb = v;
    if (!same_geometry(&m, &e->base)) {
        if (!ag__tmeta_is_contiguous(&e->base)) {
            char b[128];
            return ag__err(AG_ENOTSUP,
                           "functionalize: %s mutates a view of a non-contiguous "
                           "tensor of shape %s; this is not supported (mutate a "
                           "contiguous clone instead)",
                           op, ag__fmt_sizes(b, sizeof b, e->base.ndim, e->base.sizes));
        }
        int64_t off = m.offset - e->base.offset;
        ag_garg ga[5] = {AG_GA_N(e->node), AG_GA_N(v), AG_GA_INTS(m.sizes, m.ndim),
                         AG_GA_INTS(m.strides, m.ndim), AG_GA_I(off)};
        nb = ag__tracer_call(T, ag__op("as_strided_scatter"), ga, 5);
        if (!nb)
            return ag_last_status();
    }
    e->node = nb;
    e->ver++;
    bind(T, t, v, e->ver);
    return 0;
}

void ag__alias_bind(ag__tracer *T, ag__alias_table *a, ag_tensor *t, ag_node *v) {
    bind(T, t, v, ag__alias_current_ver(a, t));
}

int ag__tracer_alias_register(ag__tracer *T, ag_tensor *base) {
    ag__alias_table *a = ag__tracer_aliases(T, true);
    if (!a)
        return AG_ENOMEM;
    if (find(a, base->storage))
        return ag__err(AG_EINVAL, "functionalize: the storage of this base is registered twice");
    ag_node *bn = ag__tracer_node_of(T, base);
    if (!bn || !add(a, base, bn))
        return ag_last_status();
    base->trace_ver = 0;
    return 0;
}

uint64_t ag__tracer_storage_mutations(ag__tracer *T, const ag_tensor *t) {
    return ag__alias_current_ver(ag__tracer_aliases(T, false), t);
}

ag_node *ag__tracer_storage_base(ag__tracer *T, const ag_tensor *t) {
    alias_entry *e = find(ag__tracer_aliases(T, false), t->storage);
    return e ? e->node : NULL;
}
