/* Pointer-keyed hash map (see ptrmap.h). The table is kept at most half full. */
#include "ptrmap.h"
#include "internal.h"

#include <assert.h>

static uint64_t ptr_hash(const void *p) {
    uint64_t x = (uint64_t)(uintptr_t)p; /* murmur3's finalizer */
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
}

static int64_t find_slot(const ag__ptrmap *m, const void *key) {
    /* The probe ends at an empty slot: the capacity is a power of two and never full. */
    assert(m->cap > 0 && (m->cap & (m->cap - 1)) == 0 && m->len < m->cap);
    uint64_t mask = (uint64_t)m->cap - 1;
    uint64_t i = ptr_hash(key) & mask;
    while (m->slots[i].key && m->slots[i].key != key)
        i = (i + 1) & mask;
    return (int64_t)i;
}

static int rehash(ag__ptrmap *m, int64_t ncap) {
    ag__ptrslot *slots = ag__calloc((size_t)ncap, sizeof *slots);
    if (!slots)
        return AG_ENOMEM;
    ag__ptrmap old = *m;
    m->slots = slots;
    m->cap = ncap;
    int64_t live = 0;
    for (int64_t i = 0; i < old.cap; i++)
        if (old.slots[i].key) {
            m->slots[find_slot(m, old.slots[i].key)] = old.slots[i];
            live++;
        }
    assert(live == m->len); /* the count of keys follows the table */
    (void)live;
    ag__free(old.slots);
    return 0;
}

int ag__ptrmap_reserve(ag__ptrmap *m, int64_t n) {
    int64_t ncap = m->cap ? m->cap : 16;
    while (ncap < 2 * n)
        ncap *= 2;
    return ncap > m->cap ? rehash(m, ncap) : 0;
}

int ag__ptrmap_put(ag__ptrmap *m, const void *key, int64_t val) {
    assert(key); /* NULL marks an empty slot */
    if ((m->len + 1) * 2 > m->cap && ag__ptrmap_reserve(m, m->len + 1))
        return AG_ENOMEM;
    ag__ptrslot *x = &m->slots[find_slot(m, key)];
    if (!x->key) {
        x->key = key;
        m->len++;
    }
    x->val = val;
    assert(m->len * 2 <= m->cap); /* at most half full */
    return 0;
}

int64_t ag__ptrmap_get(const ag__ptrmap *m, const void *key, int64_t dflt) {
    if (!m->cap)
        return dflt;
    const ag__ptrslot *x = &m->slots[find_slot(m, key)];
    return x->key ? x->val : dflt;
}

bool ag__ptrmap_has(const ag__ptrmap *m, const void *key) {
    return m->cap && m->slots[find_slot(m, key)].key;
}

void ag__ptrmap_free(ag__ptrmap *m) {
    ag__free(m->slots);
    m->slots = NULL;
    m->cap = m->len = 0;
}
