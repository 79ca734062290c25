/* An insertion-ordered hash map keyed by descriptor value, as the Python dicts that the FX
 * utilities (get_all_input_and_grad_nodes, ...) return in graph order.
 *
 * In: descriptors (keys, compared with ag_desc_equal) and opaque values. Out: lookups and
 * iteration in insertion order. The layout is CPython's compact dict: an entries array in
 * insertion order plus an open-addressing index table (linear probing, at most 2/3 full) of
 * positions into it. Growth allocates the new arrays before touching the old ones, so a failed
 * put leaves the map as it was. */
#include "internal.h"

typedef struct map_entry {
    ag_desc *key; /* the map's reference */
    void *value;
    uint64_t hash;
} map_entry;

struct ag_desc_map {
    map_entry *entries;
    int64_t len, cap;
    int64_t *slots; /* index into entries, or -1 */
    int64_t nslots; /* a power of two, or 0 */
};

ag_desc_map *ag_desc_map_new(void) {
    return ag__calloc(1, sizeof(ag_desc_map));
}

void ag_desc_map_free(ag_desc_map *m) {
    if (!m)
        return;
    for (int64_t i = 0; i < m->len; i++)
        ag_desc_release(m->entries[i].key);
    ag__free(m->entries);
    ag__free(m->slots);
    ag__free(m);
}

/* The slot holding key, or the empty slot where it would go. */
static int64_t probe(const int64_t *slots, int64_t nslots, const map_entry *entries,
                     const ag_desc *key, uint64_t h) {
    int64_t mask = nslots - 1, i = (int64_t)(h & (uint64_t)mask);
    while (slots[i] >= 0) {
        const map_entry *e = &entries[slots[i]];
        if (e->hash == h && ag_desc_equal(e->key, key))
            return i;
        i = (i + 1) & mask;
    }
    return i;
}

int64_t ag_desc_map_find(const ag_desc_map *m, const ag_desc *key) {
    if (!m || !key || !m->nslots)
        return -1;
    return m->slots[probe(m->slots, m->nslots, m->entries, key, ag_desc_hash(key))];
}

void *ag_desc_map_get(const ag_desc_map *m, const ag_desc *key) {
    int64_t i = ag_desc_map_find(m, key);
    return i >= 0 ? m->entries[i].value : NULL;
}

int ag_desc_map_put(ag_desc_map *m, const ag_desc *key, void *value) {
    if (!m || !key)
        return ag__err(AG_EINVAL, "ag_desc_map_put: %s is NULL", m ? "key" : "map");
    int64_t found = ag_desc_map_find(m, key);
    if (found >= 0) {
        m->entries[found].value = value;
        return 0;
    }
    /* Make room first; commit only when every allocation succeeded. */
    map_entry *entries = m->entries;
    int64_t cap = m->cap;
    if (m->len == cap) {
        cap = cap ? cap * 2 : 8;
        entries = ag__malloc((size_t)cap * sizeof *entries);
        if (!entries)
            return AG_ENOMEM;
        if (m->len)
            memcpy(entries, m->entries, (size_t)m->len * sizeof *entries);
    }
    int64_t *slots = m->slots, nslots = m->nslots;
    if ((m->len + 1) * 3 > nslots * 2) {
        nslots = nslots ? nslots * 2 : 16;
        slots = ag__malloc((size_t)nslots * sizeof *slots);
        if (!slots) {
            if (entries != m->entries)
                ag__free(entries);
            return AG_ENOMEM;
        }
        for (int64_t i = 0; i < nslots; i++)
            slots[i] = -1;
        for (int64_t j = 0; j < m->len; j++)
            slots[probe(slots, nslots, entries, entries[j].key, entries[j].hash)] = j;
    }
    if (entries != m->entries) {
        ag__free(m->entries);
        m->entries = entries;
        m->cap = cap;
    }
    if (slots != m->slots) {
        ag__free(m->slots);
        m->slots = slots;
        m->nslots = nslots;
    }
    uint64_t h = ag_desc_hash(key);
    m->slots[probe(m->slots, m->nslots, m->entries, key, h)] = m->len;
    m->entries[m->len++] = (map_entry){ag_desc_retain(key), value, h};
    return 0;
}

int64_t ag_desc_map_size(const ag_desc_map *m) {
    return m ? m->len : 0;
}

const ag_desc *ag_desc_map_key(const ag_desc_map *m, int64_t i) {
    return m && i >= 0 && i < m->len ? m->entries[i].key : NULL;
}

void *ag_desc_map_value(const ag_desc_map *m, int64_t i) {
    return m && i >= 0 && i < m->len ? m->entries[i].value : NULL;
}

int ag_desc_map_set_value(ag_desc_map *m, int64_t i, void *value) {
    if (!m || i < 0 || i >= m->len)
        return ag__err(AG_EINVAL, "ag_desc_map_set_value: index %lld out of range [0, %lld)",
                       (long long)i, (long long)ag_desc_map_size(m));
    m->entries[i].value = value;
    return 0;
}
