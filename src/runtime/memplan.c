/* The memory planner: offsets in one arena for buffers with known lifetimes.
 *
 * In: items with a size in bytes and a lifetime [start, end] in steps (inclusive: a buffer
 * read by the step that defines another is alive at that step together with it). Out: an
 * offset per item such that two items alive at a common step never share a byte, and the
 * arena size (the highest end offset).
 *
 * Finding the smallest arena is NP-hard (it is dynamic storage allocation); greedy placement
 * gets within a few percent of the lower bound on real graphs (Pisarchyk & Lee, "Efficient
 * memory management for deep neural net inference", 2020, as in TFLite's arena planner). Each
 * strategy takes the items in some order and puts each into a gap of the address range that
 * is free during its whole lifetime, given the items already placed: the lowest such gap
 * (first fit) or the smallest one that fits (best fit). The orders: by size, largest first
 * (big buffers are the hard ones to fit late); by "breadth", the most bytes alive at any step
 * of the item's lifetime (the busiest moments decide the peak, so their items go first); and
 * in execution order, which is what a free-list allocator running the graph would do.
 * AG__MP_BEST runs them all and keeps the smallest arena. Each pass looks only at the placed
 * items alive together with the one it places (see live_index below), so a pass costs
 * O(n log n) plus the overlaps, not O(n^2): the backward of a 96-layer GPT-2 has ~7000
 * buffers. */
#include "plan_internal.h"

#include <assert.h>
#include <stdlib.h>

static bool live_together(const ag__mp_item *a, const ag__mp_item *b) {
    return a->start <= b->end && b->start <= a->end;
}

/* Live bytes at every step 0..maxstep (a new array, or NULL on ENOMEM). */
static int64_t *live_profile(const ag__mp_item *items, int n, int *nsteps) {
    int maxstep = 0;
    for (int i = 0; i < n; i++)
        maxstep = items[i].end > maxstep ? items[i].end : maxstep;
    int64_t *live = ag__calloc((size_t)maxstep + 2, sizeof *live);
    if (!live)
        return NULL;
    for (int i = 0; i < n; i++) {
        assert(items[i].start >= 0 && items[i].start <= items[i].end && items[i].size >= 0);
        live[items[i].start] += items[i].size;
        live[items[i].end + 1] -= items[i].size;
    }
    for (int t = 1; t <= maxstep + 1; t++)
        live[t] += live[t - 1];
    *nsteps = maxstep + 1;
    return live;
}

int64_t ag__memplan_ideal(const ag__mp_item *items, int n) {
    if (n <= 0)
        return 0;
    int nsteps = 0;
    int64_t *live = live_profile(items, n, &nsteps);
    if (!live)
        return AG_ENOMEM;
    int64_t best = 0;
    for (int t = 0; t < nsteps; t++)
        best = live[t] > best ? live[t] : best;
    ag__free(live);
    return best;
}

bool ag__memplan_valid(const ag__mp_item *items, int n, int *a, int *b) {
    for (int i = 0; i < n; i++)
        for (int j = i + 1; j < n; j++) {
            const ag__mp_item *x = &items[i], *y = &items[j];
            if (x->size == 0 || y->size == 0 || !live_together(x, y))
                continue;
            if (x->offset < y->offset + y->size && y->offset < x->offset + x->size) {
                *a = i;
                *b = j;
                return false;
            }
        }
    return true;
}

/* ---- one greedy pass ---- */

typedef struct order_key {
    int idx;
    int64_t k1, k2, k3; /* compared in turn, larger first */
} order_key;

static int cmp_key(const void *pa, const void *pb) {
    const order_key *a = pa, *b = pb;
    if (a->k1 != b->k1)
        return a->k1 > b->k1 ? -1 : 1;
    if (a->k2 != b->k2)
        return a->k2 > b->k2 ? -1 : 1;
    if (a->k3 != b->k3)
        return a->k3 > b->k3 ? -1 : 1;
    return a->idx - b->idx;
}

/* ---- finding the placed items alive together with a new one ----
 *
 * A greedy pass needs, for each item, the already placed items whose lifetimes intersect its
 * own, in offset order. Scanning every placed item makes a pass O(n^2); instead the items are
 * sorted by start once, and a max tree over that order holds the latest end among the placed
 * items of each range. The items alive together with [s, e] are the placed ones with
 * start <= e (a prefix of the order) and end >= s (subtrees whose latest end is below s are
 * skipped), found in O((k + 1) log n) for k results, then sorted by offset. The gap search
 * reads only their offsets and sizes, and items with equal offsets can be taken in any order
 * (after the first of them the cursor is past that offset), so the placement is exactly the
 * one the quadratic scan gives. */

typedef struct live_index {
    int n, leaves; /* leaves: a power of two >= n */
    int *by_start; /* item indices sorted by start (then index) */
    int *starts;   /* starts in that order */
    int *leaf_of;  /* item -> its position in by_start */
    int *maxend;   /* tree of 2 * leaves nodes: latest end of the placed items below, or -1 */
} live_index;

typedef struct start_key {
    int start, idx;
} start_key;

static int cmp_start(const void *pa, const void *pb) {
    const start_key *a = pa, *b = pb;
    if (a->start != b->start)
        return a->start < b->start ? -1 : 1;
    return a->idx - b->idx;
}

static void live_index_free(live_index *x) {
    ag__free(x->by_start);
    ag__free(x->starts);
    ag__free(x->leaf_of);
    ag__free(x->maxend);
}

static int live_index_init(live_index *x, const ag__mp_item *items, int n) {
    memset(x, 0, sizeof *x);
    x->n = n;
    x->leaves = 1;
    while (x->leaves < n)
        x->leaves *= 2;
    x->by_start = ag__malloc(sizeof *x->by_start * (size_t)n);
    x->starts = ag__malloc(sizeof *x->starts * (size_t)n);
    x->leaf_of = ag__malloc(sizeof *x->leaf_of * (size_t)n);
    x->maxend = ag__malloc(sizeof *x->maxend * 2 * (size_t)x->leaves);
    start_key *sk = ag__malloc(sizeof *sk * (size_t)n);
    if (!x->by_start || !x->starts || !x->leaf_of || !x->maxend || !sk) {
        ag__free(sk);
        live_index_free(x);
        return AG_ENOMEM;
    }
    for (int i = 0; i < n; i++)
        sk[i] = (start_key){items[i].start, i};
    qsort(sk, (size_t)n, sizeof *sk, cmp_start);
    for (int r = 0; r < n; r++) {
        x->by_start[r] = sk[r].idx;
        x->starts[r] = sk[r].start;
        x->leaf_of[sk[r].idx] = r;
    }
    ag__free(sk);
    return 0;
}

static void live_index_clear(live_index *x) {
    for (int i = 0; i < 2 * x->leaves; i++)
        x->maxend[i] = -1;
}

static void live_index_place(live_index *x, int item, int end) {
    for (int v = x->leaves + x->leaf_of[item]; v >= 1 && x->maxend[v] < end; v /= 2)
        x->maxend[v] = end;
}

/* Appends to out[] the placed items at tree node v (covering positions [lo, hi)) with
 * position < limit and end >= s. */
static void live_index_collect(const live_index *x, int v, int lo, int hi, int limit, int s,
                               int *out, int *k) {
    if (lo >= limit || x->maxend[v] < s)
        return;
    if (hi - lo == 1) {
        assert(*k < x->n); /* each placed item once */
        out[(*k)++] = x->by_start[lo];
        return;
    }
    int mid = (lo + hi) / 2;
    live_index_collect(x, 2 * v, lo, mid, limit, s, out, k);
    live_index_collect(x, 2 * v + 1, mid, hi, limit, s, out, k);
}

typedef struct placed_ref {
    int64_t off, size;
} placed_ref;

static int cmp_off(const void *pa, const void *pb) {
    const placed_ref *a = pa, *b = pb;
    return a->off < b->off ? -1 : a->off > b->off;
}

/* Places items in the order of keys[] into off[]; `found` (n ints) and `refs` (n entries) are
 * scratch. Returns the arena size. */
static int64_t place_all(const ag__mp_item *items, int n, const order_key *keys, bool best_fit,
                         int64_t *off, live_index *x, int *found, placed_ref *refs) {
    int64_t arena = 0;
    live_index_clear(x);
    for (int r = 0; r < n; r++) {
        int i = keys[r].idx;
        const ag__mp_item *it = &items[i];
        if (it->size == 0) { /* takes no room: never conflicts */
            off[i] = 0;
            continue;
        }
        /* The placed items alive together with it, in offset order. */
        int k = 0, limit = 0;
        for (int lo = 0, hi = n; lo < hi;) { /* positions with start <= it->end */
            int mid = (lo + hi) / 2;
            if (x->starts[mid] <= it->end)
                lo = limit = mid + 1;
            else
                hi = mid;
        }
        live_index_collect(x, 1, 0, x->leaves, limit, it->start, found, &k);
        for (int q = 0; q < k; q++)
            refs[q] = (placed_ref){off[found[q]], items[found[q]].size};
        qsort(refs, (size_t)k, sizeof *refs, cmp_off);
        /* `cursor` is the end of the highest range seen so far, so [cursor, next offset) is a
         * free gap. */
        int64_t cursor = 0, best = -1, best_gap = INT64_MAX;
        for (int q = 0; q < k; q++) {
            int64_t o_off = refs[q].off;
            if (o_off > cursor) {
                int64_t gap = o_off - cursor;
                if (gap >= it->size && (!best_fit || gap < best_gap)) {
                    best = cursor;
                    best_gap = gap;
                    if (!best_fit)
                        break;
                }
            }
            if (o_off + refs[q].size > cursor)
                cursor = o_off + refs[q].size;
        }
        if (best < 0)
            best = cursor;
#ifndef NDEBUG
        /* No placed item alive together with it shares a byte with its place. */
        for (int q = 0; q < k; q++)
            assert(refs[q].off >= best + it->size || refs[q].off + refs[q].size <= best);
#endif
        off[i] = best;
        if (best + it->size > arena)
            arena = best + it->size;
        live_index_place(x, i, it->end);
    }
    return arena;
}

/* Fills keys[] with the order of a strategy; `live` is the per-step live bytes (breadth). */
static void make_order(const ag__mp_item *items, int n, ag__mp_strategy s, const int64_t *live,
                       order_key *keys) {
    for (int i = 0; i < n; i++) {
        const ag__mp_item *it = &items[i];
        order_key k = {.idx = i};
        int64_t len = (int64_t)it->end - it->start;
        switch (s) {
        case AG__MP_BREADTH: {
            int64_t br = 0;
            for (int t = it->start; t <= it->end; t++)
                br = live[t] > br ? live[t] : br;
            k.k1 = br;
            k.k2 = it->size;
            k.k3 = len;
            break;
        }
        case AG__MP_ORDER_BEST_FIT:
            k.k1 = -(int64_t)it->start;
            k.k2 = it->size;
            k.k3 = len;
            break;
        default:
            k.k1 = it->size;
            k.k2 = len;
            k.k3 = -(int64_t)it->start;
            break;
        }
        keys[i] = k;
    }
    qsort(keys, (size_t)n, sizeof *keys, cmp_key);
}

int ag__memplan(ag__mp_item *items, int n, ag__mp_strategy strategy, int64_t *arena) {
    *arena = 0;
    if (n <= 0)
        return 0;
    size_t nn = (size_t)n;
    order_key *keys = ag__malloc(sizeof *keys * nn);
    int64_t *off = ag__malloc(sizeof *off * nn);
    int64_t *best_off = ag__malloc(sizeof *best_off * nn);
    int *found = ag__malloc(sizeof *found * nn);
    placed_ref *refs = ag__malloc(sizeof *refs * nn);
    int nsteps = 0;
    int64_t *live = live_profile(items, n, &nsteps);
    live_index x;
    int xrc = live_index_init(&x, items, n);
    if (!keys || !off || !best_off || !found || !refs || !live || xrc) {
        ag__free(keys);
        ag__free(off);
        ag__free(best_off);
        ag__free(found);
        ag__free(refs);
        ag__free(live);
        if (!xrc)
            live_index_free(&x);
        return AG_ENOMEM;
    }
    static const ag__mp_strategy all[] = {AG__MP_SIZE_FIRST_FIT, AG__MP_SIZE_BEST_FIT,
                                          AG__MP_BREADTH, AG__MP_ORDER_BEST_FIT};
    int64_t best = INT64_MAX;
    for (size_t s = 0; s < sizeof all / sizeof all[0]; s++) {
        if (strategy != AG__MP_BEST && strategy != all[s])
            continue;
        make_order(items, n, all[s], live, keys);
        bool best_fit = all[s] == AG__MP_SIZE_BEST_FIT || all[s] == AG__MP_ORDER_BEST_FIT;
        int64_t a = place_all(items, n, keys, best_fit, off, &x, found, refs);
        if (a < best) {
            best = a;
            memcpy(best_off, off, sizeof *off * nn);
        }
    }
    for (int i = 0; i < n; i++) {
        items[i].offset = best_off[i];
        assert(items[i].offset >= 0 && items[i].offset + items[i].size <= best);
    }
    *arena = best == INT64_MAX ? 0 : best;
#ifndef NDEBUG
    /* Buffers that never overlap need at least the bytes alive at the busiest step. */
    for (int t = 0; t < nsteps; t++)
        assert(live[t] <= *arena);
#endif
    ag__free(keys);
    ag__free(off);
    ag__free(best_off);
    ag__free(found);
    ag__free(refs);
    ag__free(live);
    live_index_free(&x);
    return 0;
}
