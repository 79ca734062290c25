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
 * AG__MP_BEST runs them all and keeps the smallest arena. Each is O(n^2) in the number of
 * items, fine for the thousands of values of our graphs. */
#include "plan_internal.h"

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

/* Places items in the order of keys[] into off[]; *placed is scratch of n ints (the placed
 * items sorted by offset). Returns the arena size. */
static int64_t place_all(const ag__mp_item *items, int n, const order_key *keys, bool best_fit,
                         int64_t *off, int *placed) {
    int np = 0;
    int64_t arena = 0;
    for (int r = 0; r < n; r++) {
        int i = keys[r].idx;
        const ag__mp_item *it = &items[i];
        if (it->size == 0) { /* takes no room: never conflicts */
            off[i] = 0;
            continue;
        }
        /* Walk the placed items alive together with it in offset order; `cursor` is the end
         * of the highest range seen so far, so [cursor, next offset) is a free gap. */
        int64_t cursor = 0, best = -1, best_gap = INT64_MAX;
        for (int q = 0; q < np; q++) {
            const ag__mp_item *o = &items[placed[q]];
            if (!live_together(it, o))
                continue;
            int64_t o_off = off[placed[q]];
            if (o_off > cursor) {
                int64_t gap = o_off - cursor;
                if (gap >= it->size && (!best_fit || gap < best_gap)) {
                    best = cursor;
                    best_gap = gap;
                    if (!best_fit)
                        break;
                }
            }
            if (o_off + o->size > cursor)
                cursor = o_off + o->size;
        }
        if (best < 0)
            best = cursor;
        off[i] = best;
        if (best + it->size > arena)
            arena = best + it->size;
        /* insert into placed[], keeping offset order */
        int pos = np;
        while (pos > 0 && off[placed[pos - 1]] > best) {
            placed[pos] = placed[pos - 1];
            pos--;
        }
        placed[pos] = i;
        np++;
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
    int *placed = ag__malloc(sizeof *placed * nn);
    int nsteps = 0;
    int64_t *live = live_profile(items, n, &nsteps);
    if (!keys || !off || !best_off || !placed || !live) {
        ag__free(keys);
        ag__free(off);
        ag__free(best_off);
        ag__free(placed);
        ag__free(live);
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
        int64_t a = place_all(items, n, keys, best_fit, off, placed);
        if (a < best) {
            best = a;
            memcpy(best_off, off, sizeof *off * nn);
        }
    }
    for (int i = 0; i < n; i++)
        items[i].offset = best_off[i];
    *arena = best == INT64_MAX ? 0 : best;
    ag__free(keys);
    ag__free(off);
    ag__free(best_off);
    ag__free(placed);
    ag__free(live);
    return 0;
}
