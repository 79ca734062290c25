/* String-keyed open-addressing hash map (see strmap.h). Deleted slots become tombstones; the
 * table is rebuilt when live entries plus tombstones pass 70% of its capacity. Each slot keeps
 * its key's hash: probes compare hashes before strings, and a rebuild reads no key (the keys
 * are the callers' strings, such as graph node names, spread over memory). */
#include "strmap.h"
#include "internal.h"

#include <assert.h>
#include <string.h>

static const char tomb_key[] = "";
#define TOMB (tomb_key)

/* Eight bytes at a time (a node name is hashed several times on its way through the
 * pipeline; FNV's byte loop was most of a probe). The table reads the low bits: the final
 * mix spreads every byte into them. */
uint64_t ag__strhash(const char *s) {
    size_t n = strlen(s);
    uint64_t h = 0x9e3779b97f4a7c15ull ^ (uint64_t)n;
    for (; n >= 8; s += 8, n -= 8) {
        uint64_t w;
        memcpy(&w, s, 8);
        h = (h ^ w) * 0xff51afd7ed558ccdull;
        h ^= h >> 32;
    }
    uint64_t w = 0;
    memcpy(&w, s, n);
    h = (h ^ w) * 0xc4ceb9fe1a85ec53ull;
    h ^= h >> 29;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 32;
    return h;
}

static int64_t find_slot_h(const ag__strmap *m, const char *key, uint64_t h, bool for_insert) {
    if (!m->cap)
        return -1;
    /* The probe ends at an empty slot: the capacity is a power of two and never full. */
    assert((m->cap & (m->cap - 1)) == 0 && m->len + m->tombs < m->cap);
    uint64_t mask = (uint64_t)m->cap - 1;
    int64_t first_tomb = -1;
    for (uint64_t i = h & mask;; i = (i + 1) & mask) {
        const ag__strslot *x = &m->slots[i];
        if (!x->key)
            return for_insert && first_tomb >= 0 ? first_tomb : (for_insert ? (int64_t)i : -1);
        if (x->key == TOMB) {
            if (first_tomb < 0)
                first_tomb = (int64_t)i;
        } else if (x->hash == h && (x->key == key || !strcmp(x->key, key))) {
            return (int64_t)i;
        }
    }
}

static int64_t find_slot(const ag__strmap *m, const char *key, bool for_insert) {
    return m->cap ? find_slot_h(m, key, ag__strhash(key), for_insert) : -1;
}

static int rehash(ag__strmap *m, int64_t ncap) {
    ag__strslot *slots = ag__calloc((size_t)ncap, sizeof *slots);
    if (!slots)
        return AG_ENOMEM;
    ag__strmap old = *m;
    m->slots = slots;
    m->cap = ncap;
    m->len = 0;
    m->tombs = 0;
    uint64_t mask = (uint64_t)ncap - 1;
    for (int64_t i = 0; i < old.cap; i++)
        if (old.slots[i].key && old.slots[i].key != TOMB) {
            uint64_t s = old.slots[i].hash & mask; /* the keys are distinct: the first free slot */
            while (slots[s].key)
                s = (s + 1) & mask;
            slots[s] = old.slots[i];
            m->len++;
        }
    assert(m->len == old.len); /* the count of live keys follows the table */
    ag__free(old.slots);
    return 0;
}

/* Inlined into each entry point: a graph names every node through one of them. */
static inline __attribute__((always_inline)) int put_h(ag__strmap *m, const char *key, void *val,
                                                       bool replace, uint64_t h) {
    if ((m->len + m->tombs + 1) * 10 >= m->cap * 7) {
        int64_t ncap = m->cap ? m->cap : 16;
        while ((m->len + 1) * 10 >= ncap * 5)
            ncap *= 2;
        if (rehash(m, ncap))
            return AG_ENOMEM;
    }
    int64_t s = find_slot_h(m, key, h, true);
    ag__strslot *x = &m->slots[s];
    if (x->key && x->key != TOMB) {
        if (!replace)
            return 1;
        x->val = val;
        return 0;
    }
    if (x->key == TOMB)
        m->tombs--;
    *x = (ag__strslot){key, val, h};
    m->len++;
    assert((m->len + m->tombs) * 10 < m->cap * 7); /* below the load limit */
    return 0;
}

int ag__strmap_put(ag__strmap *m, const char *key, void *val) {
    return put_h(m, key, val, true, ag__strhash(key));
}

int ag__strmap_put_new(ag__strmap *m, const char *key, void *val) {
    return put_h(m, key, val, false, ag__strhash(key));
}

int ag__strmap_put_new_h(ag__strmap *m, const char *key, void *val, uint64_t h) {
    assert(h == ag__strhash(key));
    return put_h(m, key, val, false, h);
}

void *ag__strmap_get(const ag__strmap *m, const char *key) {
    int64_t s = find_slot(m, key, false);
    return s >= 0 ? m->slots[s].val : NULL;
}

void *ag__strmap_get_h(const ag__strmap *m, const char *key, uint64_t h) {
    int64_t s = m->cap ? find_slot_h(m, key, h, false) : -1;
    return s >= 0 ? m->slots[s].val : NULL;
}

bool ag__strmap_has(const ag__strmap *m, const char *key) {
    return find_slot(m, key, false) >= 0;
}

void ag__strmap_del(ag__strmap *m, const char *key) {
    int64_t s = find_slot(m, key, false);
    if (s < 0)
        return;
    m->slots[s].key = TOMB;
    m->slots[s].val = NULL;
    m->len--;
    m->tombs++;
    assert(m->len >= 0);
}

void ag__strmap_free(ag__strmap *m) {
    ag__free(m->slots);
    m->slots = NULL;
    m->cap = m->len = m->tombs = 0;
}

int ag__strmap_reserve(ag__strmap *m, int64_t n) {
    int64_t ncap = m->cap ? m->cap : 16;
    while ((n + 1) * 10 >= ncap * 5)
        ncap *= 2;
    return ncap > m->cap ? rehash(m, ncap) : 0;
}
