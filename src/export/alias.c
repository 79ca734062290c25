/* Views and aliasing in the joint export: upstream's AOTDedupeWrapper and
 * AOTSyntheticBaseWrapper (which flat inputs become which primals) and the aliasing half of
 * its metadata analysis (which inputs are mutated, which outputs alias inputs or
 * intermediates). See alias.h for the interface; export.c drives it.
 *
 * In: the flat inputs (params, buffers, user args, kwargs) and one traced forward. Out: the
 * primals and their descriptors, the facts the compiled callable needs (ag__joint_alias), the
 * extra forward outputs (metadata mutations of merged inputs, intermediate bases).
 *
 * Upstream's rules, as implemented here:
 * - Duplicates (one tensor in two slots). When no duplicated tensor is mutated (data or
 *   metadata), each later slot gets its own leaf (a separate tensor over the same storage;
 *   a tied parameter is shown to the forward through the module under its own name) and its
 *   own placeholder and gradient: the graph works whether or not the caller passes the same
 *   tensor twice (strategy 1). When one is mutated, every later occurrence of every
 *   duplicated tensor is removed: the graph has the first occurrence's placeholder and
 *   descriptor, and the compiled callable drops the repeated argument after checking that it
 *   is the same tensor (strategy 2).
 * - Synthetic bases. Inputs (after deduplication) are grouped by storage in order of first
 *   appearance. A group of two or more that overlap in memory and see a data mutation becomes
 *   one base primal: ViewBaseAOTInput(base_of=<desc of the first member with a ._base>) whose
 *   value is that ._base, when the members are views of one base (members without a ._base
 *   must be that base), else SyntheticBaseAOTInput(base_of=<desc of the first member>), a 1-d
 *   tensor over the whole storage. With autograd only the first kind is supported (upstream's
 *   assertion "aot_autograd() does not yet handle non-differentiable view input mutations.").
 *   The primals are then [bases..., the other inputs grouped by storage], as upstream orders
 *   them; the members are regenerated in the graph from their base with as_strided, and a
 *   member's metadata mutation becomes a MetadataMutationAOTOutput(idx) output.
 * - Outputs. An output that is an input is `is_input`; one that shares an input's storage is
 *   `alias_of_input` (an input merged into a base counts as an alias of the base); neither
 *   gets a tangent, and both are regenerated from the caller's tensor at run time. An output
 *   that is a view of an intermediate, both requiring grad, is `unsafe_view_alias` (treated
 *   as a plain output) when no other output shares its storage; otherwise its base becomes
 *   an extra forward output IntermediateBaseAOTOutput(base_of=<the first such output's
 *   desc>) with a tangent (or, when the base is itself a user output, the output is
 *   regenerated from that one), and the output is regenerated from it at run time.
 *   (`output.detach()` returned beside `output` is regenerated from `output`.)
 *
 * Differences from upstream: merged inputs are always regenerated with as_strided (upstream
 * replays the recorded view function when it can); aotgrad has no multi-output view ops, so
 * upstream's multi-output-view exception never applies; an `is_input` output refers to the
 * slot whose tensor it is (upstream takes the last input sharing its storage). */
#include "alias.h"
#include "export_wrappers.h"
#include "../core/ptrmap.h"
#include "../nn/nn_internal.h"
#include "../trace/trace_views.h"

#include <stdio.h>

/* ---- geometry helpers ---- */

static void rel_geom(ag_tmeta *out, const ag_tensor *t, int64_t base_offset) {
    ag__tmeta_of(t, out);
    out->offset -= base_offset;
}

/* Lowest and highest element offset of t (empty: hi < lo). */
static void extent(const ag_tensor *t, int64_t *lo, int64_t *hi) {
    *lo = t->offset;
    *hi = t->offset;
    for (int d = 0; d < t->ndim; d++) {
        if (t->sizes[d] == 0) {
            *hi = *lo - 1;
            return;
        }
        *hi += (t->sizes[d] - 1) * t->strides[d];
    }
}

static bool is_dense(const ag_tensor *t) {
    ag_tmeta m;
    ag__tmeta_of(t, &m);
    return ag__tmeta_is_contiguous(&m);
}

/* Marks t's elements in bits (offsets relative to lo). */
static void mark(const ag_tensor *t, int64_t lo, unsigned char *bits, bool test, bool *hit) {
    int64_t n = ag__numel(t->ndim, t->sizes), idx[AG_MAX_DIMS] = {0};
    for (int64_t e = 0; e < n; e++) {
        int64_t off = t->offset - lo;
        for (int d = 0; d < t->ndim; d++)
            off += idx[d] * t->strides[d];
        if (test && (bits[off >> 3] >> (off & 7) & 1))
            *hit = true;
        if (!test)
            bits[off >> 3] |= (unsigned char)(1u << (off & 7));
        for (int d = t->ndim - 1; d >= 0 && ++idx[d] == t->sizes[d]; d--)
            idx[d] = 0;
    }
}

/* Whether a and b (same storage) share an element: their extents must intersect; a dense
 * tensor covers its extent; two strided ones are compared element by element (ranges over
 * 2^24 elements are taken as overlapping). */
static bool overlap(const ag_tensor *a, const ag_tensor *b) {
    int64_t alo, ahi, blo, bhi;
    extent(a, &alo, &ahi);
    extent(b, &blo, &bhi);
    if (ahi < alo || bhi < blo || ahi < blo || bhi < alo)
        return false;
    if (is_dense(a) || is_dense(b))
        return true;
    int64_t lo = alo < blo ? alo : blo, hi = ahi > bhi ? ahi : bhi;
    if (hi - lo >= (1 << 24))
        return true;
    unsigned char *bits = ag__calloc((size_t)((hi - lo) / 8 + 1), 1);
    if (!bits)
        return true;
    bool hit = false;
    mark(a, lo, bits, false, &hit);
    mark(b, lo, bits, true, &hit);
    ag__free(bits);
    return hit;
}

/* ---- the plan ---- */

typedef struct group {
    ag__base_kind kind;
    int base_of;     /* the flat input whose desc the base's wraps */
    ag_tensor *base; /* VIEW: the caller's ._base (borrowed) */
} group;

struct ag__alias_plan {
    ag_tensor *const *flat;
    ag_desc *const *descs;
    bool module_tensors; /* the flat parameters and buffers are the module's own tensors */
    int nflat;
    int *dup_of; /* first slot holding the same tensor, or -1 */
    bool dedupe; /* strategy 2: later occurrences removed */
    int *group;  /* per flat: merged group, or -1 */
    group *groups;
    int ngroups;
    int nprim;
    int *prim_flat;   /* per primal: its flat input (a group's: base_of) */
    int *prim_group;  /* per primal: its group (a base), or -1 */
    int *flat_primal; /* per flat: its primal (a member: its base's; a dup: the kept one's) */
    ag_desc **prim_desc;
    ag_tensor **example; /* per primal: a tensor of its geometry (bases: made here) */
    /* per pass */
    ag_tensor **tt;      /* per flat: the tensor the forward sees (a reference) */
    ag_tensor **ptt;     /* per primal: the tensor bound to the placeholder (a reference) */
    ag_tmeta *start;     /* per flat: tt's geometry when the pass began */
    ag_tmeta *pb_geom;   /* per flat param/buffer: its geometry before the pass */
    ag_tensor **swapped; /* per flat param/buffer: the module's own tensor when another is shown */
    ag_tensor **user;
    /* per pass, after the forward */
    bool *data_mut, *meta_mut; /* per flat */
    int *mm_flat;              /* flat inputs with MetadataMutationAOTOutput, in order */
    int nmm;
    ag_tensor **inter; /* intermediate bases (borrowed from the forward's outputs) */
    int *inter_first;  /* the first output aliasing each */
    int ninter;
};

/* Flat input i is the module's own parameter or buffer (its descriptor says which; the inner
 * tensors of flattened subclass inputs are fresh leaves, all of them). */
static bool is_pb(const ag__alias_plan *P, int i) {
    if (!P->module_tensors)
        return false;
    ag_desc_kind k = ag_desc_kind_of(P->descs[i]);
    return k == AG_DESC_PARAM || k == AG_DESC_BUFFER;
}

/* Shows the module tensor t in place of flat parameter or buffer i; returns the one it had. */
static ag_tensor *swap_pb(const ag__alias_plan *P, ag_module *m, int i, ag_tensor *t) {
    return ag__module_swap_tensor(m, ag_desc_target(P->descs[i]),
                                  ag_desc_kind_of(P->descs[i]) == AG_DESC_PARAM, t);
}

static void free_layout(ag__alias_plan *P) {
    for (int p = 0; P->prim_desc && p < P->nprim; p++)
        ag_desc_release(P->prim_desc[p]);
    for (int p = 0; P->example && p < P->nprim; p++)
        ag_tensor_free(P->example[p]);
    ag__free(P->prim_desc);
    ag__free(P->example);
    ag__free(P->prim_flat);
    ag__free(P->prim_group);
    ag__free(P->flat_primal);
    ag__free(P->groups);
    P->prim_desc = NULL;
    P->example = NULL;
    P->prim_flat = P->prim_group = P->flat_primal = NULL;
    P->groups = NULL;
    P->nprim = P->ngroups = 0;
}

void ag__aplan_free(ag__alias_plan *P) {
    if (!P)
        return;
    free_layout(P);
    ag__free(P->dup_of);
    ag__free(P->group);
    ag__free(P->tt);
    ag__free(P->ptt);
    ag__free(P->start);
    ag__free(P->pb_geom);
    ag__free(P->swapped);
    ag__free(P->user);
    ag__free(P->data_mut);
    ag__free(P->meta_mut);
    ag__free(P->mm_flat);
    ag__free(P->inter);
    ag__free(P->inter_first);
    ag__free(P);
}

/* The flat inputs that are not removed as duplicates, in order. */
static bool kept(const ag__alias_plan *P, int i) {
    return !P->dedupe || P->dup_of[i] < 0;
}

/* The group's kind and base by upstream's rules. strict: raise upstream's errors (the final
 * layout); otherwise fall back to a synthetic base (the speculative first pass). */
static int classify_group(ag__alias_plan *P, const int *members, int n, bool autograd, bool strict,
                          group *g) {
    for (int k = 0; k + 1 < n && strict; k++) {
        const ag_tensor *v1 = P->flat[members[k]], *v2 = P->flat[members[k + 1]];
        bool diff_views = v1 == v2 || (v1->base && (v1->base == v2->base || v1->base == v2)) ||
                          (v2->base && v1 == v2->base);
        if (autograd && !diff_views)
            return ag__err(AG_ENOTSUP,
                           "export: inputs %d and %d share memory and one is "
                           "mutated, but they are not views of one base: "
                           "aot_autograd() does not yet handle non-differentiable "
                           "view input mutations.",
                           members[k], members[k + 1]);
        bool same_dtype = v1->dtype == v2->dtype && (!v1->base || v1->base->dtype == v1->dtype) &&
                          (!v2->base || v2->base->dtype == v2->dtype);
        if (!same_dtype)
            return ag__err(AG_ENOTSUP,
                           "export: inputs %d and %d share memory and one is "
                           "mutated: aot_autograd() does not yet handle input "
                           "mutations on views with different dtypes.",
                           members[k], members[k + 1]);
    }
    g->kind = AG__BASE_SYNTHETIC;
    g->base_of = members[0];
    g->base = NULL;
    for (int k = 0; k < n; k++) {
        ag_tensor *v = P->flat[members[k]];
        if (v->base && !g->base) {
            g->base = v->base;
            g->base_of = members[k];
        }
    }
    if (!g->base) {
        g->base_of = members[0];
        return 0;
    }
    for (int k = 0; k < n; k++) {
        ag_tensor *v = P->flat[members[k]];
        if (v->base ? v->base != g->base : v != g->base) {
            if (strict)
                return ag__err(AG_ENOTSUP,
                               "export: input %d shares memory with mutated input "
                               "%d but is not a view of its base: aot_autograd() "
                               "does not yet handle non-differentiable view input "
                               "mutations.",
                               members[k], g->base_of);
            g->kind = AG__BASE_SYNTHETIC;
            g->base = NULL;
            g->base_of = members[0];
            return 0;
        }
    }
    g->kind = AG__BASE_VIEW;
    return 0;
}

/* Builds the layout: groups (merged when `merge` says so for the group's members), primal
 * order, descriptors. merge(P, members, n) -> 1 merge, 0 not, < 0 error. */
static int build_layout(ag__alias_plan *P, int (*merge)(ag__alias_plan *, const int *, int, void *),
                        void *ud, bool autograd, bool strict) {
    free_layout(P);
    int n = P->nflat, rc = 0;
    int *order = ag__calloc((size_t)(n ? n : 1), sizeof *order); /* kept inputs by storage */
    int *gstart = ag__calloc((size_t)(n + 1), sizeof *gstart);
    P->groups = ag__calloc((size_t)(n ? n : 1), sizeof *P->groups);
    P->prim_flat = ag__calloc((size_t)(n ? n : 1), sizeof(int));
    P->prim_group = ag__calloc((size_t)(n ? n : 1), sizeof(int));
    P->flat_primal = ag__calloc((size_t)(n ? n : 1), sizeof(int));
    P->prim_desc = ag__calloc((size_t)(n ? n : 1), sizeof(ag_desc *));
    P->example = ag__calloc((size_t)(n ? n : 1), sizeof(ag_tensor *));
    if (!order || !gstart || !P->groups || !P->prim_flat || !P->prim_group || !P->flat_primal ||
        !P->prim_desc || !P->example) {
        rc = AG_ENOMEM;
        goto out;
    }
    /* Storage groups of the kept inputs, in order of first appearance, each in input order:
     * group numbers from a storage -> group map, then a counting sort. */
    int ng = 0;
    ag__ptrmap gmap = {0};
    int *gid = ag__malloc(sizeof *gid * (size_t)(n ? n : 1));
    if (!gid || ag__ptrmap_reserve(&gmap, n)) {
        ag__free(gid);
        ag__ptrmap_free(&gmap);
        rc = AG_ENOMEM;
        goto out;
    }
    for (int i = 0; i < n; i++) {
        P->group[i] = -1;
        gid[i] = -1;
        if (!kept(P, i))
            continue;
        int64_t g = ag__ptrmap_get(&gmap, P->flat[i]->storage, -1);
        if (g < 0) {
            g = ng++;
            ag__ptrmap_put(&gmap, P->flat[i]->storage, g); /* reserved: cannot fail */
        }
        gid[i] = (int)g;
        gstart[g + 1]++;
    }
    for (int s = 0; s < ng; s++)
        gstart[s + 1] += gstart[s];
    for (int i = 0; i < n; i++)
        if (gid[i] >= 0)
            order[gstart[gid[i]]++] = i;
    for (int s = ng; s > 0; s--) /* the fill advanced each start to the next group's */
        gstart[s] = gstart[s - 1];
    gstart[0] = 0;
    ag__free(gid);
    ag__ptrmap_free(&gmap);
    /* Which groups merge, and their bases: the bases come first among the primals. */
    bool *merged = ag__calloc((size_t)(ng ? ng : 1), sizeof(bool));
    if (!merged) {
        rc = AG_ENOMEM;
        goto out;
    }
    for (int s = 0; s < ng && rc == 0; s++) {
        int cnt = gstart[s + 1] - gstart[s];
        if (cnt < 2)
            continue;
        int m = merge(P, order + gstart[s], cnt, ud);
        if (m < 0) {
            rc = m;
            break;
        }
        if (!m)
            continue;
        group *g = &P->groups[P->ngroups];
        rc = classify_group(P, order + gstart[s], cnt, autograd, strict, g);
        if (rc)
            break;
        merged[s] = true;
        int p = P->nprim++;
        P->prim_flat[p] = g->base_of;
        P->prim_group[p] = P->ngroups;
        for (int k = gstart[s]; k < gstart[s + 1]; k++) {
            P->group[order[k]] = P->ngroups;
            P->flat_primal[order[k]] = p;
        }
        const ag_desc *bd = P->descs[g->base_of];
        P->prim_desc[p] =
            g->kind == AG__BASE_VIEW ? ag_desc_view_base(bd) : ag_desc_synthetic_base(bd);
        /* The example the placeholder is made from: the base, or the whole storage. */
        ag_tensor *src = P->flat[g->base_of];
        ag_tmeta mt;
        if (g->kind == AG__BASE_VIEW) {
            ag__tmeta_of(g->base, &mt);
        } else {
            int64_t numel = (int64_t)(src->storage->nbytes / ag_dtype_size(src->dtype));
            ag__tmeta_contiguous(&mt, src->dtype, 1, &numel);
        }
        P->example[p] = ag__tensor_alias(src, &mt);
        P->ngroups++;
        if (!P->prim_desc[p] || !P->example[p])
            rc = ag_last_status();
    }
    /* The other inputs: grouped by storage when there are bases (upstream's other_args),
     * else in their own order (upstream returns the inputs unchanged). */
    if (P->ngroups == 0)
        for (int i = 0, k = 0; i < n; i++)
            if (kept(P, i))
                order[k++] = i;
    for (int s = 0; s < ng && rc == 0; s++) {
        if (merged[s])
            continue;
        for (int k = gstart[s]; k < gstart[s + 1]; k++) {
            int i = order[k], p = P->nprim++;
            P->prim_flat[p] = i;
            P->prim_group[p] = -1;
            P->flat_primal[i] = p;
            P->prim_desc[p] = ag_desc_retain(P->descs[i]);
            P->example[p] = ag_tensor_keep(P->flat[i]);
        }
    }
    for (int i = 0; i < n && rc == 0; i++)
        if (!kept(P, i))
            P->flat_primal[i] = P->flat_primal[P->dup_of[i]];
    ag__free(merged);
out:
    ag__free(order);
    ag__free(gstart);
    return rc;
}

/* The first pass merges every group of distinct tensors that overlap (a tied weight's extra
 * leaves are not distinct: they share the one tensor). */
static int merge_speculative(ag__alias_plan *P, const int *m, int n, void *ud) {
    (void)ud;
    for (int a = 0; a < n; a++)
        for (int b = a + 1; b < n; b++)
            if (P->flat[m[a]] != P->flat[m[b]] && overlap(P->flat[m[a]], P->flat[m[b]]))
                return 1;
    return 0;
}

/* The final layout merges groups with a data mutation whose members overlap. */
static int merge_final(ag__alias_plan *P, const int *m, int n, void *ud) {
    (void)ud;
    bool mutated = false;
    for (int a = 0; a < n; a++)
        mutated |= P->data_mut[m[a]];
    if (!mutated)
        return 0;
    for (int a = 0; a < n; a++)
        for (int b = a + 1; b < n; b++)
            if (overlap(P->flat[m[a]], P->flat[m[b]]))
                return 1;
    return 0;
}

ag__alias_plan *ag__aplan_new(ag_tensor *const *flat, ag_desc *const *descs, int nflat,
                              bool module_tensors) {
    ag__alias_plan *P = ag__calloc(1, sizeof *P);
    if (!P)
        return NULL;
    P->flat = flat;
    P->descs = descs;
    P->nflat = nflat;
    P->module_tensors = module_tensors;
    size_t n = (size_t)(nflat ? nflat : 1);
    P->dup_of = ag__calloc(n, sizeof(int));
    P->group = ag__calloc(n, sizeof(int));
    P->tt = ag__calloc(n, sizeof(ag_tensor *));
    P->ptt = ag__calloc(n, sizeof(ag_tensor *));
    P->start = ag__calloc(n, sizeof(ag_tmeta));
    P->pb_geom = ag__calloc(n, sizeof(ag_tmeta));
    P->swapped = ag__calloc(n, sizeof(ag_tensor *));
    P->user = ag__calloc(n, sizeof(ag_tensor *));
    P->data_mut = ag__calloc(n, sizeof(bool));
    P->meta_mut = ag__calloc(n, sizeof(bool));
    P->mm_flat = ag__calloc(n, sizeof(int));
    if (!P->dup_of || !P->group || !P->tt || !P->ptt || !P->start || !P->pb_geom || !P->swapped ||
        !P->user || !P->data_mut || !P->meta_mut || !P->mm_flat) {
        ag__aplan_free(P);
        return NULL;
    }
    ag__ptrmap first = {0}; /* tensor -> its first slot */
    if (ag__ptrmap_reserve(&first, nflat)) {
        ag__aplan_free(P);
        return NULL;
    }
    for (int i = 0; i < nflat; i++) {
        P->dup_of[i] = flat[i] ? (int)ag__ptrmap_get(&first, flat[i], -1) : -1;
        if (P->dup_of[i] < 0 && flat[i])
            ag__ptrmap_put(&first, flat[i], i); /* reserved: cannot fail */
    }
    ag__ptrmap_free(&first);
    if (build_layout(P, merge_speculative, NULL, false, false)) {
        ag__aplan_free(P);
        return NULL;
    }
    return P;
}

int ag__aplan_num_primals(const ag__alias_plan *P) {
    return P->nprim;
}
const ag_desc *ag__aplan_primal_desc(const ag__alias_plan *P, int p) {
    return P->prim_desc[p];
}
ag_tensor *ag__aplan_primal_example(const ag__alias_plan *P, int p) {
    return P->example[p];
}
ag_tensor *ag__aplan_primal_tensor(const ag__alias_plan *P, int p) {
    return P->ptt[p];
}
ag_tensor *const *ag__aplan_flat_tensors(const ag__alias_plan *P) {
    return P->tt;
}

/* A new leaf over t's storage with t's geometry: what a slot of the forward sees in place of
 * the caller's tensor (upstream's `a.detach().requires_grad_(a.requires_grad)`). */
static ag_tensor *leaf_like(ag_tensor *t, const ag_tmeta *m) {
    ag_tensor *s = ag__tensor_alias(t, m);
    if (s) {
        s->requires_grad = t->requires_grad;
        s->is_view = t->is_view;
        s->trace = NULL;
        s->trace_id = 0;
    }
    return s;
}

int ag__aplan_begin(ag__alias_plan *P, ag_module *m, ag__tracer *T, ag_node *const *ph,
                    ag_tensor ***user) {
    int rc = 0, nuser = 0;
    for (int i = 0; i < P->nflat; i++)
        if (is_pb(P, i))
            ag__tmeta_of(P->flat[i], &P->pb_geom[i]);
    /* Placeholders: the module's own tensor for a parameter or buffer that is its own primal,
     * a new leaf for everything else (user args, extra leaves of tied weights, bases). */
    for (int p = 0; p < P->nprim && rc == 0; p++) {
        int i = P->prim_flat[p];
        ag_tensor *t;
        if (P->prim_group[p] >= 0) {
            ag_tmeta mt;
            ag__tmeta_of(P->example[p], &mt);
            const group *g = &P->groups[P->prim_group[p]];
            t = leaf_like(g->kind == AG__BASE_VIEW ? g->base : P->flat[i], &mt);
            if (t && g->kind == AG__BASE_SYNTHETIC)
                t->requires_grad = false; /* torch.empty(0).set_(storage) */
            if (t)
                t->is_view = false;
        } else if (is_pb(P, i) && P->dup_of[i] < 0) {
            t = ag_tensor_keep(P->flat[i]);
        } else {
            ag_tmeta mt;
            ag__tmeta_of(P->flat[i], &mt);
            t = leaf_like(P->flat[i], &mt);
        }
        if (!t) {
            rc = ag_last_status();
            break;
        }
        P->ptt[p] = t;
        ag__tracer_bind(T, t, ph[p]);
        if (P->prim_group[p] < 0) {
            P->tt[i] = ag_tensor_keep(t);
        } else if ((rc = ag__tracer_alias_register(T, t))) {
            break;
        }
    }
    /* Merged inputs: regenerated from their base in the graph. */
    ag_scope_begin();
    for (int i = 0; i < P->nflat && rc == 0; i++) {
        if (P->group[i] < 0)
            continue;
        ag_tensor *b = P->ptt[P->flat_primal[i]], *v = P->flat[i];
        ag_tensor *r = ag_as_strided(b, v->ndim, v->sizes, v->strides, v->offset);
        if (!r)
            rc = ag_last_status();
        else
            P->tt[i] = ag_tensor_keep(r);
    }
    ag_scope_end();
    for (int i = 0; i < P->nflat && rc == 0; i++)
        if (!P->tt[i]) /* a removed duplicate: the kept slot's tensor */
            P->tt[i] = ag_tensor_keep(P->tt[P->dup_of[i]]);
    /* The module shows the forward the slot's tensor. */
    for (int i = 0; i < P->nflat && rc == 0; i++)
        if (is_pb(P, i) && P->tt[i] != P->flat[i])
            P->swapped[i] = swap_pb(P, m, i, P->tt[i]);
    for (int i = 0; i < P->nflat; i++) {
        if (P->tt[i])
            ag__tmeta_of(P->tt[i], &P->start[i]);
        if (!is_pb(P, i)) /* the user's inputs, in order */
            P->user[nuser++] = P->tt[i];
    }
    *user = P->user;
    return rc;
}

void ag__aplan_end(ag__alias_plan *P, ag_module *m) {
    for (int i = 0; i < P->nflat; i++) {
        if (!is_pb(P, i))
            continue;
        if (P->swapped[i])
            swap_pb(P, m, i, P->swapped[i]);
        P->swapped[i] = NULL;
        /* The export changes no module tensor: metadata mutations are undone. */
        ag_tensor *t = P->flat[i];
        const ag_tmeta *g = &P->pb_geom[i];
        t->ndim = g->ndim;
        memcpy(t->sizes, g->sizes, sizeof t->sizes);
        memcpy(t->strides, g->strides, sizeof t->strides);
        t->offset = g->offset;
    }
    for (int i = 0; i < P->nflat; i++) {
        ag_tensor_free(P->tt[i]);
        P->tt[i] = NULL;
    }
    for (int p = 0; p < P->nprim; p++) {
        ag_tensor_free(P->ptt[p]);
        P->ptt[p] = NULL;
    }
}

/* ---- analysis ---- */

/* The primal an output sharing storage s aliases: that of the last input with that storage
 * (upstream's storage map keeps the last), or -1. */
static int input_of_storage(const ag__alias_plan *P, const ag_storage *s) {
    int p = -1;
    for (int i = 0; i < P->nflat; i++)
        if (P->tt[i] && P->tt[i]->storage == s)
            p = P->flat_primal[i];
    return p;
}

int ag__aplan_analyze(ag__alias_plan *P, ag__tracer *T, ag_tensor *const *outs, int nouts,
                      bool any_rg_in, ag_input_info *info, ag_output_info *oi, ag__joint_alias *A) {
    memset(A, 0, sizeof *A);
    A->nflat = P->nflat;
    A->nprimals = P->nprim;
    A->nuser = nouts;
    A->flat = ag__calloc((size_t)(P->nflat ? P->nflat : 1), sizeof *A->flat);
    A->prim = ag__calloc((size_t)(P->nprim ? P->nprim : 1), sizeof *A->prim);
    A->out = ag__calloc((size_t)(nouts ? nouts : 1), sizeof *A->out);
    ag__free(P->inter);
    ag__free(P->inter_first);
    P->inter = ag__calloc((size_t)(nouts ? nouts : 1), sizeof *P->inter);
    P->inter_first = ag__calloc((size_t)(nouts ? nouts : 1), sizeof *P->inter_first);
    P->ninter = P->nmm = 0;
    if (!A->flat || !A->prim || !A->out || !P->inter || !P->inter_first)
        return AG_ENOMEM;
    /* Inputs: data mutations are per storage (a mutation through any alias mutates them all),
     * metadata mutations per tensor. */
    for (int i = 0; i < P->nflat; i++) {
        ag_tmeta now;
        ag__tmeta_of(P->tt[i], &now);
        P->data_mut[i] = ag__tracer_storage_mutations(T, P->tt[i]) > 0;
        P->meta_mut[i] = !ag__tmeta_equal(&now, &P->start[i]);
    }
    for (int p = 0; p < P->nprim; p++) {
        ag_tensor *t = P->ptt[p];
        int i = P->prim_flat[p];
        ag__primal_info *pi = &A->prim[p];
        pi->flat = i;
        pi->base = P->prim_group[p] >= 0 ? P->groups[P->prim_group[p]].kind : AG__BASE_NONE;
        info[p].requires_grad = t->requires_grad && ag_dtype_is_float(t->dtype);
        info[p].mutates_data = ag__tracer_storage_mutations(T, t) > 0;
        info[p].mutates_metadata = pi->base == AG__BASE_NONE && P->meta_mut[i];
        if (info[p].mutates_metadata)
            rel_geom(&pi->new_geom, P->tt[i], P->start[i].offset);
    }
    for (int i = 0; i < P->nflat; i++) {
        ag__flat_info *fi = &A->flat[i];
        fi->primal = P->flat_primal[i];
        fi->dup_of = -1;
        fi->metadata_mutation = -1;
        if (!kept(P, i)) {
            fi->kind = AG__FLAT_DUP;
            fi->dup_of = P->dup_of[i];
        } else if (P->group[i] >= 0) {
            int64_t boff = P->example[fi->primal]->offset;
            fi->kind = AG__FLAT_VIEW;
            fi->geom = P->start[i];
            fi->geom.offset -= boff;
            if (P->meta_mut[i]) {
                fi->metadata_mutation = P->nmm;
                P->mm_flat[P->nmm++] = i;
                rel_geom(&fi->new_geom, P->tt[i], boff);
            }
        } else {
            fi->kind = AG__FLAT_PRIMAL;
        }
    }
    A->nmetadata_mutations = P->nmm;
    /* Outputs. */
    for (int k = 0; k < nouts; k++) {
        ag_tensor *t = outs[k];
        ag_output_info *o = &oi[k];
        o->alias = AG_OUT_NON_ALIAS;
        o->base_index = -1;
        o->requires_grad = t && t->requires_grad;
        if (!t)
            continue;
        int same = 0; /* outputs sharing t's storage, t included */
        for (int q = 0; q < nouts; q++)
            same += outs[q] && outs[q]->storage == t->storage;
        int p = input_of_storage(P, t->storage);
        if (p >= 0) {
            int own = -1;
            for (int i = 0; i < P->nflat && own < 0; i++)
                if (P->tt[i] == t)
                    own = i;
            if (own >= 0 && P->group[own] < 0) {
                o->alias = AG_OUT_IS_INPUT;
                p = P->flat_primal[own];
            } else {
                o->alias = AG_OUT_ALIAS_OF_INPUT;
            }
            o->base_index = p;
            rel_geom(&A->out[k].geom, t, P->ptt[p]->offset);
        } else if (any_rg_in && t->base && t->requires_grad && t->base->requires_grad) {
            if (same == 1) {
                o->alias = AG_OUT_UNSAFE_VIEW_ALIAS; /* hidden from autograd: a plain output */
                continue;
            }
            int user = -1;
            for (int q = 0; q < nouts; q++)
                if (outs[q] == t->base)
                    user = q;
            if (user >= 0) {
                o->alias = AG_OUT_ALIAS_OF_INTERMEDIATE_BASE_IS_USER_OUTPUT;
                o->base_index = user;
            } else {
                int b = -1;
                for (int q = 0; q < P->ninter && b < 0; q++)
                    if (P->inter[q] == t->base)
                        b = q;
                if (b >= 0) {
                    o->alias = AG_OUT_ALIAS_OF_INTERMEDIATE;
                } else {
                    b = P->ninter++;
                    P->inter[b] = t->base;
                    P->inter_first[b] = k;
                    o->alias = AG_OUT_ALIAS_OF_INTERMEDIATE_SAVE_AS_OUTPUT;
                }
                o->base_index = b;
            }
            rel_geom(&A->out[k].geom, t, t->base->offset);
        } else if (same > 1 && !t->requires_grad) {
            /* `(out, out.detach())`: regenerated from the output with the same metadata that
             * requires grad (upstream issue 100348). */
            ag_tmeta mt, mq;
            ag__tmeta_of(t, &mt);
            for (int q = 0; q < nouts && o->base_index < 0; q++) {
                if (q == k || !outs[q] || outs[q] == t || outs[q]->storage != t->storage ||
                    !outs[q]->requires_grad)
                    continue;
                ag__tmeta_of(outs[q], &mq);
                if (ag__tmeta_equal(&mt, &mq)) {
                    o->alias = AG_OUT_ALIAS_OF_INTERMEDIATE_BASE_IS_USER_OUTPUT;
                    o->base_index = q;
                    rel_geom(&A->out[k].geom, t, outs[q]->offset);
                }
            }
        }
    }
    A->nintermediate_bases = P->ninter;
    return 0;
}

int ag__aplan_extra_outputs(ag__alias_plan *P, const ag_output_info *oi, ag_tensor **t, ag_desc **d,
                            int max) {
    (void)oi;
    int n = 0;
    if (P->nmm + P->ninter > max)
        return ag__err(AG_EINVAL, "export: %d extra outputs, room for %d", P->nmm + P->ninter, max);
    for (int k = 0; k < P->nmm; k++, n++) {
        t[n] = P->tt[P->mm_flat[k]];
        if (!(d[n] = ag_desc_metadata_mutation(k)))
            return ag_last_status();
    }
    for (int b = 0; b < P->ninter; b++, n++) {
        t[n] = P->inter[b];
        ag_desc *po = ag_desc_plain_output(P->inter_first[b]);
        d[n] = po ? ag_desc_intermediate_base(po) : NULL;
        ag_desc_release(po);
        if (!d[n])
            return ag_last_status();
    }
    return n;
}

/* ---- the final layout ---- */

int ag__aplan_refine(ag__alias_plan *P, const ag_input_info *info, bool needs_autograd) {
    (void)info;
    bool dedupe = false;
    for (int i = 0; i < P->nflat; i++) {
        int first = P->dup_of[i];
        if (first < 0)
            continue;
        for (int k = 0; k < P->nflat; k++)
            if (P->flat[k] == P->flat[first] && (P->data_mut[k] || P->meta_mut[k]))
                dedupe = true;
    }
    /* Which flat inputs the pass merged, to compare with the final layout. */
    int *was = ag__calloc((size_t)(P->nflat ? P->nflat : 1), sizeof *was);
    if (!was)
        return AG_ENOMEM;
    bool was_dedupe = P->dedupe;
    for (int i = 0; i < P->nflat; i++)
        was[i] = P->group[i] >= 0 ? P->flat_primal[i] : -1;
    int prev_nprim = P->nprim;
    P->dedupe = dedupe;
    int rc = build_layout(P, merge_final, NULL, needs_autograd, true);
    bool changed = dedupe != was_dedupe || prev_nprim != P->nprim;
    for (int i = 0; rc == 0 && i < P->nflat && !changed; i++)
        changed = (P->group[i] >= 0 ? P->flat_primal[i] : -1) != was[i];
    ag__free(was);
    return rc ? rc : changed ? 1 : 0;
}

/* ---- the export's wrappers (export_wrappers.h) ---- */

/* Dedupe and synthetic bases (upstream's AOTDedupeWrapper, AOTSyntheticBaseWrapper): the plan
 * lays the flat inputs out as primals, binds the primal placeholders, regenerates merged
 * inputs from their base, reads what the forward did to the inputs and outputs, and after a
 * pass says whether its layout stands. Its slot holds the plan while a pass has begun. */
static int dsb_prepare(ag__export_pass *st, void **self) {
    (void)self;
    st->plan = ag__aplan_new(st->flat, st->flat_descs, st->nflat, st->flat_module_tensors);
    return st->plan ? 0 : ag_last_status() < 0 ? ag_last_status() : AG_ENOMEM;
}

static int dsb_begin(ag__export_pass *st, void **self) {
    ag__alias_plan *P = st->plan;
    int np = ag__aplan_num_primals(P), rc = ag__export_primals(st, np);
    for (int p = 0; rc == 0 && p < np; p++) {
        ag_desc *d = ag_desc_retain(ag__aplan_primal_desc(P, p));
        st->primal_descs[p] = d;
        char name[32] = "primals_"; /* primals_N (without printf: one per parameter) */
        char digits[12];
        int nd = 0;
        for (unsigned u = (unsigned)p + 1; u; u /= 10)
            digits[nd++] = (char)('0' + u % 10);
        for (int i = 0; i < nd; i++)
            name[8 + i] = digits[nd - 1 - i];
        name[8 + nd] = 0;
        ag_tmeta mt;
        ag__tmeta_of(ag__aplan_primal_example(P, p), &mt);
        st->prim[p] = ag_graph_placeholder(st->g, name, &mt);
        if (!st->prim[p] || ag_node_set_desc(st->prim[p], d))
            rc = ag_last_status() < 0 ? ag_last_status() : AG_ENOMEM;
    }
    if (rc)
        return rc;
    *self = P; /* begun: `end` undoes it */
    if ((rc = ag__aplan_begin(P, st->m, st->T, st->prim, &st->user)))
        return rc;
    for (int p = 0; p < np; p++)
        st->primal_t[p] = ag__aplan_primal_tensor(P, p);
    return 0;
}

static int dsb_facts(ag__export_pass *st, void **self) {
    (void)self;
    return ag__aplan_analyze(st->plan, st->T, st->outs, st->nouts, st->any_rg_in, st->in_info,
                             st->out_info, &st->alias);
}

static void dsb_end(ag__export_pass *st, void **self) {
    if (*self)
        ag__aplan_end(st->plan, st->m);
    *self = NULL;
}

static int dsb_settle(ag__export_pass *st, void **self, const ag__export_settled *f) {
    (void)self;
    return ag__aplan_refine(st->plan, f->in_info, f->needs_autograd);
}

static void dsb_release(ag__export_pass *st, void **self) {
    (void)self;
    ag__aplan_free(st->plan);
    st->plan = NULL;
}

const ag__export_wrapper ag__dedupe_synthetic_base_wrapper = {
    .name = "dedupe_synthetic_base",
    .prepare = dsb_prepare,
    .begin = dsb_begin,
    .facts = dsb_facts,
    .end = dsb_end,
    .settle = dsb_settle,
    .release = dsb_release,
};

/* Aliasing outputs: metadata mutations of merged inputs (MetadataMutationAOTOutput) and the
 * intermediate bases of outputs that alias an intermediate (IntermediateBaseAOTOutput, each
 * taking a tangent), after the user outputs. Its slot holds the pass's extra outputs. */
typedef struct aliasing_outputs {
    int n;
    ag_tensor *t[AG__EXPORT_MAX_OUTS];
    ag_desc *d[AG__EXPORT_MAX_OUTS];
} aliasing_outputs;

static int ao_facts(ag__export_pass *st, void **self) {
    aliasing_outputs *A = ag__calloc(1, sizeof *A);
    if (!A)
        return AG_ENOMEM;
    *self = A;
    A->n = ag__aplan_extra_outputs(st->plan, st->out_info, A->t, A->d, AG__EXPORT_MAX_OUTS);
    return A->n < 0 ? A->n : 0;
}

static int ao_outputs(ag__export_pass *st, void **self, ag_section sec) {
    aliasing_outputs *A = *self;
    int nmm = st->alias.nmetadata_mutations;
    bool inter = sec == AG_SEC_OUT_INTERMEDIATE_BASES;
    if (!A || (sec != AG_SEC_OUT_METADATA_MUTATIONS && !inter))
        return 0;
    for (int e = inter ? nmm : 0; e < (inter ? A->n : nmm); e++) {
        ag_node *n = ag__tracer_node_of(st->T, A->t[e]);
        if (!n)
            return ag_last_status() < 0 ? ag_last_status() : AG_ENOMEM;
        int rc = ag__export_out(st, sec, n, A->d[e], inter ? A->t[e] : NULL);
        A->d[e] = NULL;
        if (rc)
            return rc;
    }
    return 0;
}

static void ao_end(ag__export_pass *st, void **self) {
    (void)st;
    aliasing_outputs *A = *self;
    for (int e = 0; A && e < AG__EXPORT_MAX_OUTS; e++)
        ag_desc_release(A->d[e]);
    ag__free(A);
    *self = NULL;
}

const ag__export_wrapper ag__aliasing_outputs_wrapper = {
    .name = "aliasing_outputs",
    .facts = ao_facts,
    .outputs = ao_outputs,
    .end = ao_end,
};

/* ---- the joint's copy ---- */

void ag__joint_alias_clear(ag__joint_alias *a) {
    if (!a)
        return;
    ag__free(a->flat);
    ag__free(a->prim);
    ag__free(a->out);
    memset(a, 0, sizeof *a);
}

int ag__joint_alias_copy(ag__joint_alias *dst, const ag__joint_alias *src) {
    *dst = *src;
    dst->flat = ag__malloc(sizeof *dst->flat * (size_t)(src->nflat ? src->nflat : 1));
    dst->prim = ag__malloc(sizeof *dst->prim * (size_t)(src->nprimals ? src->nprimals : 1));
    dst->out = ag__malloc(sizeof *dst->out * (size_t)(src->nuser ? src->nuser : 1));
    if (!dst->flat || !dst->prim || !dst->out) {
        ag__joint_alias_clear(dst);
        return AG_ENOMEM;
    }
    if (src->nflat)
        memcpy(dst->flat, src->flat, sizeof *dst->flat * (size_t)src->nflat);
    if (src->nprimals)
        memcpy(dst->prim, src->prim, sizeof *dst->prim * (size_t)src->nprimals);
    if (src->nuser)
        memcpy(dst->out, src->out, sizeof *dst->out * (size_t)src->nuser);
    return 0;
}

/* ---- flat inputs -> primals at run time (AOTDedupeWrapper and AOTSyntheticBaseWrapper
 * post_compile): a removed duplicate is dropped after checking it is the first occurrence's
 * tensor; a view base is the inputs' ._base; a synthetic base is a 1-d tensor over their
 * storage, so writing the base's new value back updates every caller view. Used by the
 * compiled callable and ag_joint_primals_from_flat. ---- */

bool ag__same_strides(const ag_tensor *t, const ag_tmeta *m) {
    if (t->ndim != m->ndim)
        return false;
    for (int d = 0; d < m->ndim; d++)
        if (t->sizes[d] != m->sizes[d] || (m->sizes[d] > 1 && t->strides[d] != m->strides[d]))
            return false;
    return true;
}

const char *ag__flat_input_name(const ag_desc *d, const char *pos, int i, char *buf, size_t n) {
    char r[200];
    if (d && ag_desc_repr(d, r, sizeof r) < sizeof r)
        snprintf(buf, n, "%s (%s %d)", r, pos, i);
    else
        snprintf(buf, n, "%s %d", pos, i);
    return buf;
}

int ag__rt_primals(const ag__joint_alias *a, const ag_tmeta *pm, ag_tensor *const *flat, int nflat,
                   ag_tensor **prim, ag_tensor **owned, int *nowned) {
    return ag__rt_primals_named(a, pm, flat, nflat, NULL, "input", prim, owned, nowned);
}

int ag__rt_primals_named(const ag__joint_alias *a, const ag_tmeta *pm, ag_tensor *const *flat,
                         int nflat, ag_desc *const *fd, const char *pos, ag_tensor **prim,
                         ag_tensor **owned, int *nowned) {
    char n1[320], n2[320];
#define NAME(buf, i) ag__flat_input_name(fd ? fd[i] : NULL, pos, (i), buf, sizeof buf)
    *nowned = 0;
    for (int i = 0; i < nflat; i++)
        if (!flat[i])
            return ag__has_error() ? ag_last_status()
                                   : ag__err(AG_EINVAL, "compiled: %s is NULL", NAME(n1, i));
    for (int i = 0; i < nflat; i++) {
        const ag__flat_info *f = &a->flat[i];
        if (f->kind == AG__FLAT_DUP && flat[i] != flat[f->dup_of])
            return ag__err(AG_EINVAL,
                           "compiled: %s must be the same tensor as %s: "
                           "the graph was exported with one tensor passed twice and "
                           "mutated, so the repeated argument was removed",
                           NAME(n1, i), NAME(n2, f->dup_of));
    }
    for (int p = 0; p < a->nprimals; p++) {
        const ag__primal_info *pi = &a->prim[p];
        ag_tensor *t = flat[pi->flat];
        if (pi->base == AG__BASE_NONE) {
            prim[p] = t;
            continue;
        }
        if (pi->base == AG__BASE_VIEW) {
            if (!t->base)
                return ag__err(AG_EINVAL,
                               "compiled: %s was a view at export (the graph "
                               "takes its base as graph input %d) but is not a view now",
                               NAME(n1, pi->flat), p);
            prim[p] = t->base;
        } else {
            int64_t numel = (int64_t)(t->storage->nbytes / ag_dtype_size(t->dtype));
            ag_tmeta m;
            ag__tmeta_contiguous(&m, t->dtype, 1, &numel);
            if (!(prim[p] = ag__tensor_alias(t, &m)))
                return ag_last_status();
            prim[p]->trace = NULL;
            owned[(*nowned)++] = prim[p];
        }
        if (prim[p]->offset != pm[p].offset || !ag__same_strides(prim[p], &pm[p])) {
            char x[128], y[128];
            return ag__err(
                AG_EINVAL,
                "compiled: the base of %s is %s with storage offset "
                "%lld; the graph was exported for %s with offset %lld",
                NAME(n1, pi->flat), ag__fmt_sizes(x, sizeof x, prim[p]->ndim, prim[p]->sizes),
                (long long)prim[p]->offset, ag__fmt_sizes(y, sizeof y, pm[p].ndim, pm[p].sizes),
                (long long)pm[p].offset);
        }
    }
    /* Merged inputs must be the views of their base that the graph regenerates. */
    for (int i = 0; i < nflat; i++) {
        const ag__flat_info *f = &a->flat[i];
        if (f->kind != AG__FLAT_VIEW)
            continue;
        ag_tensor *b = prim[f->primal], *v = flat[i];
        if (v->storage != b->storage || v->offset - b->offset != f->geom.offset ||
            !ag__same_strides(v, &f->geom) || v->dtype != f->geom.dtype)
            return ag__err(AG_EINVAL,
                           "compiled: %s is not the view of its base (graph "
                           "input %d) that it was at export: inputs that share memory "
                           "must share it the same way on every call",
                           NAME(n1, i), f->primal);
    }
    return 0;
#undef NAME
}
