/* The aggregate argument kinds of graph nodes, tuples (AG_GA_TUPLE) and dicts (AG_GA_DICT), and
 * the walk over the node references any argument holds (ag_garg_num_refs / ag_garg_ref), which
 * every reader of arguments uses so that a node referenced inside a tuple is a use like any
 * other.
 *
 * In: arguments as callers pass them (borrowed). Out: the checks that an aggregate is well
 * formed (elements of scalar kinds or nodes; dict keys distinct), its deep copy and free (the
 * graph owns its arguments), equality and hash for CSE. graph.c calls these from its own
 * argument handling; upstream's higher-order ops take such arguments (flex_attention's
 * block_mask tuple and kernel_options dict, src/graph/flex_hop.c). */
#include "graph_internal.h"

#include <stdio.h>

int ag_garg_num_refs(const ag_garg *a) {
    return a ? ag__garg_nrefs(a) : 0;
}

ag_node *ag_garg_ref(const ag_garg *a, int k) {
    return a && k >= 0 && k < ag__garg_nrefs(a) ? ag__garg_ref(a, k) : NULL;
}

ag_node **ag__garg_slot(ag_garg *a, int k) {
    if (k < 0 || k >= ag_garg_num_refs(a))
        return NULL;
    if (a->kind == AG_GA_NODE)
        return &a->u.node;
    if (a->kind == AG_GA_NODES)
        return &a->u.nodes[k];
    ag_garg *e = (ag_garg *)&a->u.elems[k];
    return e->kind == AG_GA_NODE ? &e->u.node : NULL;
}

const char *ag__garg_kind_name(ag_garg_kind k) {
    static const char *const names[] = {"None",    "a node",  "a node list", "an int",
                                        "a float", "a bool",  "an int list", "a dtype",
                                        "a str",   "a tuple", "a dict"};
    return (unsigned)k < sizeof names / sizeof names[0] ? names[k] : "an unknown kind";
}

static bool tuple_elem_ok(ag_garg_kind k) {
    return k == AG_GA_NONE || k == AG_GA_NODE || k == AG_GA_INT || k == AG_GA_FLOAT ||
           k == AG_GA_BOOL;
}

int ag__garg_check(const char *fn, const ag_garg *a) {
    if (a->kind != AG_GA_TUPLE && a->kind != AG_GA_DICT)
        return 0;
    const char *what = a->kind == AG_GA_TUPLE ? "tuple" : "dict";
    const int max = a->kind == AG_GA_TUPLE ? AG__TUPLE_MAX : AG__DICT_MAX;
    if (a->n < 0 || a->n > max || (a->n > 0 && !a->u.elems))
        return ag__err(AG_EINVAL, "%s: a %s of %d elements%s (at most %d)", fn, what, a->n,
                       a->n > 0 && !a->u.elems ? " and no array" : "", max);
    if (a->kind == AG_GA_TUPLE) {
        for (int k = 0; k < a->n; k++) {
            const ag_garg *e = &a->u.elems[k];
            if (!tuple_elem_ok(e->kind))
                return ag__err(AG_EINVAL,
                               "%s: tuple element %d is %s (elements are None, nodes, ints, "
                               "floats or bools)",
                               fn, k, ag__garg_kind_name(e->kind));
            if (e->kind == AG_GA_NODE && !e->u.node)
                return ag__err(AG_EINVAL, "%s: tuple element %d is a NULL node (None is AG_GA_NIL)",
                               fn, k);
        }
        return 0;
    }
    for (int k = 0; k < a->n; k++) {
        const ag_gitem *it = &a->u.items[k];
        if (!it->key || !it->key[0])
            return ag__err(AG_EINVAL, "%s: dict item %d has no key", fn, k);
        if ((unsigned)it->v.kind > AG_MV_STR || (it->v.kind == AG_MV_STR && !it->v.u.s))
            return ag__err(AG_EINVAL, "%s: dict item '%s' has no value of a scalar kind", fn,
                           it->key);
        for (int j = 0; j < k; j++)
            if (!strcmp(a->u.items[j].key, it->key))
                return ag__err(AG_EINVAL, "%s: dict key '%s' given twice", fn, it->key);
    }
    return 0;
}

/* ---- copy and free ---- */

int ag__garg_agg_copy(ag_garg *dst, const ag_garg *src) {
    size_t n = (size_t)(src->n > 0 ? src->n : 0);
    if (src->kind == AG_GA_TUPLE) {
        ag_garg *v = ag__malloc(sizeof *v * (n ? n : 1));
        if (!v)
            return AG_ENOMEM;
        if (n)
            memcpy(v, src->u.elems, sizeof *v * n);
        dst->u.elems = v;
        return 0;
    }
    ag_gitem *v = ag__calloc(n ? n : 1, sizeof *v);
    if (!v)
        return AG_ENOMEM;
    dst->u.items = v;
    for (size_t k = 0; k < n; k++) {
        const ag_gitem *it = &src->u.items[k];
        v[k].v = it->v;
        v[k].key = ag__strdup(it->key ? it->key : "");
        if (v[k].key && it->v.kind == AG_MV_STR && !(v[k].v.u.s = ag__strdup(it->v.u.s))) {
            ag__free((void *)v[k].key);
            v[k].key = NULL;
        }
        if (!v[k].key) {
            dst->n = (int)k; /* the items made so far, freed below */
            ag__garg_agg_free(dst);
            return AG_ENOMEM;
        }
    }
    return 0;
}

void ag__garg_agg_free(ag_garg *a) {
    if (a->kind == AG_GA_TUPLE) {
        ag__free((void *)a->u.elems);
    } else if (a->kind == AG_GA_DICT) {
        ag_gitem *v = (ag_gitem *)a->u.items;
        for (int k = 0; v && k < a->n; k++) {
            ag__free((void *)v[k].key);
            if (v[k].v.kind == AG_MV_STR)
                ag__free((void *)v[k].v.u.s);
        }
        ag__free(v);
    }
}

/* ---- equality and hash (CSE) ---- */

static bool mval_equal(const ag_mval *a, const ag_mval *b) {
    if (a->kind != b->kind)
        return false;
    switch (a->kind) {
    case AG_MV_INT:
        return a->u.i == b->u.i;
    case AG_MV_FLOAT:
        return !memcmp(&a->u.f, &b->u.f, sizeof a->u.f);
    case AG_MV_BOOL:
        return a->u.b == b->u.b;
    case AG_MV_STR:
        return !strcmp(a->u.s, b->u.s);
    default:
        return true;
    }
}

/* (graph_internal.h) Nested in tuples: their elements are arguments of the scalar and node
 * kinds. */
bool ag__garg_equal(const ag_garg *a, const ag_garg *b) {
    if (a->kind != b->kind)
        return false;
    switch (a->kind) {
    case AG_GA_NONE:
        return true;
    case AG_GA_NODE:
        return a->u.node == b->u.node;
    case AG_GA_NODES:
        return a->n == b->n &&
               (a->n == 0 || !memcmp(a->u.nodes, b->u.nodes, sizeof(ag_node *) * (size_t)a->n));
    case AG_GA_INT:
        return a->u.i == b->u.i;
    case AG_GA_FLOAT:
        return !memcmp(&a->u.f, &b->u.f, sizeof a->u.f);
    case AG_GA_BOOL:
        return a->u.b == b->u.b;
    case AG_GA_INTS:
        return a->n == b->n &&
               (a->n == 0 || !memcmp(a->u.ints, b->u.ints, sizeof(int64_t) * (size_t)a->n));
    case AG_GA_DTYPE:
        return a->u.dt == b->u.dt;
    case AG_GA_STR:
        return !strcmp(a->u.s ? a->u.s : "", b->u.s ? b->u.s : "");
    case AG_GA_TUPLE:
    case AG_GA_DICT:
        return ag__garg_agg_equal(a, b);
    }
    return false;
}

bool ag__garg_agg_equal(const ag_garg *a, const ag_garg *b) {
    if (a->kind != b->kind || a->n != b->n)
        return false;
    for (int k = 0; k < a->n; k++)
        if (a->kind == AG_GA_TUPLE ? !ag__garg_equal(&a->u.elems[k], &b->u.elems[k])
                                   : strcmp(a->u.items[k].key, b->u.items[k].key) ||
                                         !mval_equal(&a->u.items[k].v, &b->u.items[k].v))
            return false;
    return true;
}

static uint64_t mix(uint64_t h, uint64_t v) {
    return h ^ (v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2));
}

uint64_t ag__garg_agg_hash(const ag_garg *a) {
    uint64_t h = mix((uint64_t)a->kind, (uint64_t)a->n);
    for (int k = 0; k < a->n; k++) {
        if (a->kind == AG_GA_DICT) {
            h = mix(h, ag__strhash(a->u.items[k].key));
            continue;
        }
        const ag_garg *e = &a->u.elems[k];
        uint64_t v = 0;
        if (e->kind == AG_GA_NODE)
            v = (uint64_t)(uintptr_t)e->u.node;
        else if (e->kind == AG_GA_INT)
            v = (uint64_t)e->u.i;
        else if (e->kind == AG_GA_BOOL)
            v = e->u.b;
        else if (e->kind == AG_GA_FLOAT)
            memcpy(&v, &e->u.f, sizeof v);
        h = mix(mix(h, (uint64_t)e->kind), v);
    }
    return h;
}

ag_garg *ag__garg_tuple_map(const ag_garg *a, ag_node *(*fn)(void *ctx, const ag_node *x),
                            void *ctx) {
    ag_garg *v = ag__malloc(sizeof *v * (size_t)(a->n > 0 ? a->n : 1));
    if (!v) {
        ag__err(AG_ENOMEM, "out of memory copying a tuple argument");
        return NULL;
    }
    for (int k = 0; k < a->n; k++) {
        v[k] = a->u.elems[k];
        if (v[k].kind == AG_GA_NODE && v[k].u.node && !(v[k].u.node = fn(ctx, v[k].u.node))) {
            ag__free(v);
            return NULL;
        }
    }
    return v;
}
