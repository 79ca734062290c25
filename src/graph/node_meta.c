/* A node's metadata (include/aotgrad/graph.h: ag_node_meta_*, the typed accessors seq_nr,
 * stack_trace, partitioner_tag, is_gradient_acc, recompute, and the custom annotations): the
 * entry lists of graph_internal.h, the interned keys and values, and the string pools that
 * hold the other strings. graph.c creates, copies and frees the nodes that carry them. */
#include "graph_internal.h"

#include <assert.h>
#include <stdatomic.h>
#include <string.h>

/* ---- interned metadata strings ----
 * The keys the library sets on most nodes and the values of partitioner_tag and recompute are
 * stored once here; entries point at them instead of holding copies (graph_internal.h). A
 * pointer into this table is recognized by its address, so the typed accessors below, which
 * pass these pointers, find their entries without comparing strings. */
static const char interned[][24] = {
    "seq_nr",
    "partitioner_tag",
    "stack_trace",
    "is_gradient_acc",
    "recompute",
    "ac_graph_id",
    "memory_budget",
    "is_forward",
    "is_backward",
    "must_be_in_forward",
    "must_be_in_backward",
    "MUST_SAVE",
    "PREFER_SAVE",
    "MUST_RECOMPUTE",
    "PREFER_RECOMPUTE",
    "nn_module_stack",
    "fwd_nn_module_stack",
};
enum {
    K_SEQ_NR,
    K_TAG,
    K_STACK_TRACE,
    K_GRAD_ACC,
    K_RECOMPUTE,
    K_AC_GRAPH_ID,
    K_MEMORY_BUDGET,
    V_IS_FORWARD,
    V_IS_BACKWARD,
    V_MUST_FW,
    V_MUST_BW,
    V_MUST_SAVE,
    V_PREFER_SAVE,
    V_MUST_RECOMPUTE,
    V_PREFER_RECOMPUTE,
    K_NN_MODULE_STACK,
    K_FWD_NN_MODULE_STACK,
    NINTERNED
};
_Static_assert(NINTERNED == sizeof interned / sizeof interned[0], "interned table and enum");

static bool is_interned(const char *s) {
    uintptr_t p = (uintptr_t)s, lo = (uintptr_t)interned[0];
    return p >= lo && p < (uintptr_t)interned[NINTERNED] && (p - lo) % sizeof interned[0] == 0;
}

/* The interned copy of s, or NULL when s is not one of the table's strings. */
static const char *intern(const char *s) {
    if (is_interned(s))
        return s;
    for (int i = 0; i < NINTERNED; i++)
        if (interned[i][0] == s[0] && !strcmp(interned[i], s))
            return interned[i];
    return NULL;
}

const char *ag__meta_interned(const char *s) {
    return intern(s);
}

/* ---- string pools ----
 * Metadata strings that are not interned live in string pools: append-only chunks, freed
 * together when the last graph using the pool is freed. A graph writes only into its own
 * pool; an entry copied from another graph's node shares the string, and the graph holds the
 * pool it lives in (one count per pool and graph, not one per string). So copying a stack
 * trace to another node or graph touches neither the text nor a count beside it. A string
 * that is replaced or deleted stays in its pool until the pool is freed. Counts are atomic:
 * copies of a graph may be freed on other threads. */
typedef struct strchunk {
    struct strchunk *next;
    size_t cap, used;
    char data[];
} strchunk;

struct ag__strpool {
    _Atomic int64_t refs;
    strchunk *chunks;
};

void ag__strpool_release(ag__strpool *p) {
    if (!p || atomic_fetch_sub_explicit(&p->refs, 1, memory_order_acq_rel) != 1)
        return;
    for (strchunk *c = p->chunks, *next; c; c = next) {
        next = c->next;
        ag__free(c);
    }
    ag__free(p);
}

/* A copy of s in g's own pool. */
static const char *pool_add(ag_graph *g, const char *s) {
    if (!g->strings) {
        g->strings = ag__calloc(1, sizeof *g->strings);
        if (!g->strings)
            return NULL;
        atomic_init(&g->strings->refs, 1);
    }
    ag__strpool *p = g->strings;
    size_t n = strlen(s) + 1;
    strchunk *c = p->chunks;
    if (!c || c->cap - c->used < n) {
        size_t cap = 16384 - sizeof *c;
        if (cap < n)
            cap = n;
        c = ag__malloc(sizeof *c + cap);
        if (!c)
            return NULL;
        c->cap = cap;
        c->used = 0;
        c->next = p->chunks;
        p->chunks = c;
    }
    char *d = c->data + c->used;
    memcpy(d, s, n);
    c->used += n;
    return d;
}

#ifndef NDEBUG
static bool pool_owns(const ag__strpool *p, const char *s) {
    for (const strchunk *c = p ? p->chunks : NULL; c; c = c->next)
        if (s >= c->data && s < c->data + c->used)
            return true;
    return false;
}
#endif

const char *ag__graph_shared_str(ag_graph *g, const char *s) {
    const char *p = ag__strmap_get(&g->shared_strs, s);
    if (p)
        return p;
    if (!(p = pool_add(g, s)) || ag__strmap_put(&g->shared_strs, p, (void *)p))
        return NULL; /* a copy left in the pool is freed with it */
    return p;
}

/* Makes g hold pool p (nothing to do when it is g's own or already held). */
static int pool_hold(ag_graph *g, ag__strpool *p) {
    if (p == g->strings)
        return 0;
    for (int i = 0; i < g->nshared; i++)
        if (g->shared[i] == p)
            return 0;
    int64_t cap = g->shared_cap;
    if (ag__grow((void **)&g->shared, &cap, g->nshared + 1, sizeof *g->shared))
        return AG_ENOMEM;
    g->shared_cap = cap;
    atomic_fetch_add_explicit(&p->refs, 1, memory_order_relaxed);
    g->shared[g->nshared++] = p;
    return 0;
}

static void entry_clear(ag__mentry *x) {
    if (!is_interned(x->key))
        ag__free((void *)x->key);
}

void ag__meta_entries_free(ag__mentry *e, int n, const ag__mentry *inline_buf) {
    for (int i = 0; i < n; i++)
        entry_clear(&e[i]);
    if (e && e != inline_buf)
        ag__free(e);
}

/* ---- metadata ---- */

/* The entry for key: an interned key is found by its pointer, any other by its text among
 * the entries that own their key. */
static ag__mentry *entry_find(ag__mentry *e, int n, const char *key, const char *ik) {
    for (int i = 0; i < n; i++)
        if (ik ? e[i].key == ik : (!is_interned(e[i].key) && !strcmp(e[i].key, key)))
            return &e[i];
    return NULL;
}

/* Room for one more entry; a node's metadata starts in its inline array. */
static int entries_reserve(ag__mentry **e, int n, int *cap, ag__mentry *inline_buf) {
    if (n < *cap)
        return 0;
    if (!*e && inline_buf) {
        *e = inline_buf;
        *cap = AG__META_INLINE;
        return 0;
    }
    int ncap = *cap ? 2 * *cap : 4;
    ag__mentry *ne = ag__malloc(sizeof *ne * (size_t)ncap);
    if (!ne)
        return AG_ENOMEM;
    if (n)
        memcpy(ne, *e, sizeof *ne * (size_t)n);
    if (*e != inline_buf)
        ag__free(*e);
    *e = ne;
    *cap = ncap;
    return 0;
}

/* Sets key to v on a list of g's. `from`: the pool v.u.s lives in, to share it from (NULL:
 * an outside string, interned or copied into g's pool). */
static int entry_set_ex(ag_graph *g, ag__mentry **e, int *n, int *cap, ag__mentry *inline_buf,
                        const char *key, ag_mval v, ag__strpool *from) {
    ag_mval copy = v;
    ag__strpool *pool = NULL;
    if (v.kind == AG_MV_STR && from) {
        if (pool_hold(g, from))
            return AG_ENOMEM;
        pool = from;
    } else if (v.kind == AG_MV_STR) {
        const char *str = v.u.s ? v.u.s : "";
        copy.u.s = intern(str);
        if (!copy.u.s) {
            if (!(copy.u.s = pool_add(g, str)))
                return AG_ENOMEM;
            pool = g->strings;
        }
    }
    const char *ik = intern(key);
    ag__mentry *x = entry_find(*e, *n, key, ik);
    if (x) {
        x->v = copy;
        x->pool = pool;
        return 0;
    }
    char *k = ik ? NULL : ag__strdup(key);
    if ((!ik && !k) || entries_reserve(e, *n, cap, inline_buf)) {
        ag__free(k);
        return AG_ENOMEM;
    }
    (*e)[(*n)++] = (ag__mentry){ik ? ik : k, copy, pool};
    return 0;
}

static int entry_set(ag_graph *g, ag__mentry **e, int *n, int *cap, ag__mentry *inline_buf,
                     const char *key, ag_mval v) {
    return entry_set_ex(g, e, n, cap, inline_buf, key, v, NULL);
}

/* Sets x's key and value on a list of g's, sharing x's string. */
int ag__entry_copy(ag_graph *g, ag__mentry **e, int *n, int *cap, ag__mentry *inline_buf,
                   const ag__mentry *x) {
    return entry_set_ex(g, e, n, cap, inline_buf, x->key, x->v, x->pool);
}

static int entry_del(ag__mentry *e, int *n, const char *key) {
    ag__mentry *x = entry_find(e, *n, key, intern(key));
    if (!x)
        return 0;
    entry_clear(x);
    int i = (int)(x - e);
    memmove(&e[i], &e[i + 1], sizeof *e * (size_t)(*n - i - 1));
    (*n)--;
    return 1;
}

static ag_mval entry_get(const ag__mentry *e, int n, const char *key) {
    ag__mentry *x = entry_find((ag__mentry *)e, n, key, intern(key));
    return x ? x->v : (ag_mval){.kind = AG_MV_NONE};
}

/* The typed accessors pass interned keys: found by pointer. */
static ag_mval meta_get_interned(const ag_node *n, int k) {
    for (int i = 0; i < n->nmeta; i++)
        if (n->meta[i].key == interned[k])
            return n->meta[i].v;
    return (ag_mval){.kind = AG_MV_NONE};
}

int ag_node_meta_set(ag_node *n, const char *key, ag_mval v) {
    AG__CHECK_NULL("node_meta_set", n);
    AG__CHECK_NULL("node_meta_set", key);
    const char *ik = intern(key);
    if (ik == interned[K_NN_MODULE_STACK] || ik == interned[K_FWD_NN_MODULE_STACK]) {
        int rc = ag__modstack_check(ik, v);
        if (rc)
            return rc;
    }
    return entry_set(n->graph, &n->meta, &n->nmeta, &n->meta_cap, n->meta_inline, key, v);
}

int ag__node_meta_set_shared(ag_node *n, const char *key, const char *s) {
    assert(pool_owns(n->graph->strings, s));
    return entry_set_ex(n->graph, &n->meta, &n->nmeta, &n->meta_cap, n->meta_inline, key,
                        (ag_mval){.kind = AG_MV_STR, .u.s = s}, n->graph->strings);
}
ag_mval ag_node_meta_get(const ag_node *n, const char *key) {
    if (!n || !key)
        return (ag_mval){.kind = AG_MV_NONE};
    return entry_get(n->meta, n->nmeta, key);
}
int ag_node_meta_del(ag_node *n, const char *key) {
    AG__CHECK_NULL("node_meta_del", n);
    AG__CHECK_NULL("node_meta_del", key);
    return entry_del(n->meta, &n->nmeta, key);
}
int ag_node_meta_count(const ag_node *n) {
    return n ? n->nmeta : 0;
}
const char *ag_node_meta_key_at(const ag_node *n, int i, ag_mval *v) {
    if (!n)
        return NULL;
    if (i < 0 || i >= n->nmeta)
        return NULL;
    if (v)
        *v = n->meta[i].v;
    return n->meta[i].key;
}

/* Whether entry x can be copied as it is (what entry_set_ex would store): its string value, if
 * any, lives in a pool or is interned. */
static bool entry_copies_as_is(const ag__mentry *x) {
    return x->v.kind != AG_MV_STR || x->pool || is_interned(x->v.u.s);
}

int ag__node_meta_copy(ag_node *dst, const ag_node *src) {
    if (dst == src)
        return 0;
    bool bulk = dst->nmeta == 0 && !dst->meta && src->nmeta > 0 && src->nmeta <= AG__META_INLINE;
    for (int i = 0; i < src->nmeta && bulk; i++)
        bulk = entry_copies_as_is(&src->meta[i]);
    if (bulk) {
        /* A new node (a copy's): src's keys are distinct, so entry_set_ex would append each
         * entry in order; done without looking each key up. */
        const ag__strpool *held = NULL;
        dst->meta = dst->meta_inline;
        dst->meta_cap = AG__META_INLINE;
        for (int i = 0; i < src->nmeta; i++) {
            const ag__mentry *x = &src->meta[i];
            if (x->pool && x->pool != held) {
                if (pool_hold(dst->graph, x->pool))
                    return AG_ENOMEM;
                held = x->pool;
            }
            char *k = is_interned(x->key) ? (char *)x->key : ag__strdup(x->key);
            if (!k)
                return AG_ENOMEM;
            dst->meta[dst->nmeta++] = (ag__mentry){k, x->v, x->pool};
        }
        return 0;
    }
    for (int i = 0; i < src->nmeta; i++)
        if (ag__entry_copy(dst->graph, &dst->meta, &dst->nmeta, &dst->meta_cap, dst->meta_inline,
                           &src->meta[i]))
            return AG_ENOMEM;
    return 0;
}

int ag__node_meta_copy_key(ag_node *dst, const ag_node *src, const char *key) {
    return ag__node_meta_copy_key_as(dst, key, src, key);
}

int ag__node_meta_copy_key_as(ag_node *dst, const char *dst_key, const ag_node *src,
                              const char *src_key) {
    if (dst == src && !strcmp(dst_key, src_key))
        return 0;
    const ag__mentry *x = entry_find(src->meta, src->nmeta, src_key, intern(src_key));
    if (!x)
        return ag_node_meta_del(dst, dst_key), 0;
    ag_mval v = x->v; /* read before dst's list may move */
    return entry_set_ex(dst->graph, &dst->meta, &dst->nmeta, &dst->meta_cap, dst->meta_inline,
                        dst_key, v, x->pool);
}

int64_t ag_node_seq_nr(const ag_node *n) {
    if (!n)
        return -1;
    ag_mval v = meta_get_interned(n, K_SEQ_NR);
    return v.kind == AG_MV_INT ? v.u.i : -1;
}
int ag_node_set_seq_nr(ag_node *n, int64_t s) {
    AG__CHECK_NULL("node_set_seq_nr", n);
    if (s < 0)
        return ag_node_meta_del(n, interned[K_SEQ_NR]), 0;
    return ag_node_meta_set(n, interned[K_SEQ_NR], (ag_mval){.kind = AG_MV_INT, .u.i = s});
}
const char *ag_node_stack_trace(const ag_node *n) {
    if (!n)
        return NULL;
    ag_mval v = meta_get_interned(n, K_STACK_TRACE);
    return v.kind == AG_MV_STR ? v.u.s : NULL;
}
int ag_node_set_stack_trace(ag_node *n, const char *t) {
    AG__CHECK_NULL("node_set_stack_trace", n);
    if (!t)
        return ag_node_meta_del(n, interned[K_STACK_TRACE]), 0;
    return ag_node_meta_set(n, interned[K_STACK_TRACE], (ag_mval){.kind = AG_MV_STR, .u.s = t});
}
const char *ag_node_partitioner_tag(const ag_node *n) {
    if (!n)
        return NULL;
    ag_mval v = meta_get_interned(n, K_TAG);
    return v.kind == AG_MV_STR ? v.u.s : NULL;
}
int ag_node_set_partitioner_tag(ag_node *n, const char *tag) {
    AG__CHECK_NULL("node_set_partitioner_tag", n);
    if (!tag)
        return ag_node_meta_del(n, interned[K_TAG]), 0;
    for (int i = V_IS_FORWARD; i <= V_MUST_BW; i++)
        if (!strcmp(tag, interned[i]))
            return ag_node_meta_set(n, interned[K_TAG],
                                    (ag_mval){.kind = AG_MV_STR, .u.s = interned[i]});
    return ag__err(AG_EINVAL,
                   "partitioner_tag: '%s' is not one of is_forward, is_backward, "
                   "must_be_in_forward, must_be_in_backward",
                   tag);
}
bool ag_node_is_gradient_acc(const ag_node *n) {
    if (!n)
        return false;
    ag_mval v = meta_get_interned(n, K_GRAD_ACC);
    return v.kind == AG_MV_BOOL && v.u.b;
}
int ag_node_set_gradient_acc(ag_node *n, bool v) {
    AG__CHECK_NULL("node_set_gradient_acc", n);
    if (!v)
        return ag_node_meta_del(n, interned[K_GRAD_ACC]), 0;
    return ag_node_meta_set(n, interned[K_GRAD_ACC], (ag_mval){.kind = AG_MV_BOOL, .u.b = true});
}

static const char *const recompute_names[] = {NULL, interned[V_MUST_SAVE], interned[V_PREFER_SAVE],
                                              interned[V_MUST_RECOMPUTE],
                                              interned[V_PREFER_RECOMPUTE]};

const char *ag__recompute_name(ag_recompute r) {
    return (unsigned)r < 5 ? recompute_names[r] : NULL;
}

ag_recompute ag_node_recompute(const ag_node *n) {
    if (!n)
        return (ag_recompute)0;
    ag_mval v = meta_get_interned(n, K_RECOMPUTE);
    if (v.kind != AG_MV_STR)
        return AG_RECOMPUTE_NONE;
    for (int i = 1; i < 5; i++)
        if (v.u.s == recompute_names[i] || !strcmp(v.u.s, recompute_names[i]))
            return (ag_recompute)i;
    return AG_RECOMPUTE_NONE;
}
int ag_node_set_recompute(ag_node *n, ag_recompute r) {
    AG__CHECK_NULL("node_set_recompute", n);
    if (r == AG_RECOMPUTE_NONE)
        return ag_node_meta_del(n, interned[K_RECOMPUTE]), 0;
    if ((unsigned)r >= 5)
        return ag__err(AG_EINVAL, "recompute: bad policy %d", (int)r);
    return ag_node_meta_set(n, interned[K_RECOMPUTE],
                            (ag_mval){.kind = AG_MV_STR, .u.s = recompute_names[r]});
}

int ag_node_custom_set(ag_node *n, const char *key, ag_mval v) {
    AG__CHECK_NULL("node_custom_set", n);
    AG__CHECK_NULL("node_custom_set", key);
    if (v.kind == AG_MV_NONE)
        return ag__err(AG_EINVAL, "custom: value of '%s' is None", key);
    return entry_set(n->graph, &n->custom, &n->ncustom, &n->custom_cap, NULL, key, v);
}
ag_mval ag_node_custom_get(const ag_node *n, const char *key) {
    if (!n || !key)
        return (ag_mval){.kind = AG_MV_NONE};
    return entry_get(n->custom, n->ncustom, key);
}
int ag_node_custom_count(const ag_node *n) {
    return n ? n->ncustom : 0;
}
const char *ag_node_custom_key_at(const ag_node *n, int i, ag_mval *v) {
    if (!n)
        return NULL;
    if (i < 0 || i >= n->ncustom)
        return NULL;
    if (v)
        *v = n->custom[i].v;
    return n->custom[i].key;
}
void ag_node_custom_clear(ag_node *n) {
    AG__CHECK_NULL_RET("node_custom_clear", n, );
    ag__meta_entries_free(n->custom, n->ncustom, NULL);
    n->custom = NULL;
    n->ncustom = n->custom_cap = 0;
}
int ag_node_custom_copy(ag_node *dst, const ag_node *src) {
    AG__CHECK_NULL("node_custom_copy", dst);
    AG__CHECK_NULL("node_custom_copy", src);
    if (dst == src)
        return 0;
    ag__mentry *e = NULL;
    int cnt = 0, cap = 0;
    for (int i = 0; i < src->ncustom; i++)
        if (ag__entry_copy(dst->graph, &e, &cnt, &cap, NULL, &src->custom[i])) {
            ag__meta_entries_free(e, cnt, NULL);
            return AG_ENOMEM;
        }
    ag__meta_entries_free(dst->custom, dst->ncustom, NULL);
    dst->custom = e;
    dst->ncustom = cnt;
    dst->custom_cap = cap;
    return 0;
}
