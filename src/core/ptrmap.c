/* Pointer-keyed hash map (see ptrmap.h). The table is kept at most half full. */
#include "ptrmap.h"
#include "internal.h"

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
    uint64_t mask = (uint64_t)m->cap - 1;
    uint64_t i = ptr_hash(key) & mask;
    while (m->keys[i] && m->keys[i] != key)
        i = (i + 1) & mask;
    return (int64_t)i;
}

static int rehash(ag__ptrmap *m, int64_t ncap) {
    const void **keys = ag__calloc((size_t)ncap, sizeof *keys);
    int64_t *vals = ag__malloc(sizeof *vals * (size_t)ncap);
    if (!keys || !vals) {
        ag__free(keys);
        ag__free(vals);
        return AG_ENOMEM;
    }
    ag__ptrmap old = *m;
    m->keys = keys;
    m->vals = vals;
    m->cap = ncap;
    for (int64_t i = 0; i < old.cap; i++)
        if (old.keys[i]) {
            int64_t s = find_slot(m, old.keys[i]);
            m->keys[s] = old.keys[i];
            m->vals[s] = old.vals[i];
        }
    ag__free(old.keys);
    ag__free(old.vals);
    return 0;
}

int ag__ptrmap_reserve(ag__ptrmap *m, int64_t n) {
    int64_t ncap = m->cap ? m->cap : 16;
    while (ncap < 2 * n)
        ncap *= 2;
    return ncap > m->cap ? rehash(m, ncap) : 0;
}

int ag__ptrmap_put(ag__ptrmap *m, const void *key, int64_t val) {
    if ((m->len + 1) * 2 > m->cap && ag__ptrmap_reserve(m, m->len + 1))
        return AG_ENOMEM;
    int64_t s = find_slot(m, key);
    if (!m->keys[s]) {
        m->keys[s] = key;
        m->len++;
    }
    m->vals[s] = val;
    return 0;
}

int64_t ag__ptrmap_get(const ag__ptrmap *m, const void *key, int64_t dflt) {
    if (!m->cap)
        return dflt;
    int64_t s = find_slot(m, key);
    return m->keys[s] ? m->vals[s] : dflt;
}

bool ag__ptrmap_has(const ag__ptrmap *m, const void *key) {
    return m->cap && m->keys[find_slot(m, key)];
}

void ag__ptrmap_free(ag__ptrmap *m) {
    ag__free(m->keys);
    ag__free(m->vals);
    m->keys = NULL;
    m->vals = NULL;
    m->cap = m->len = 0;
}
