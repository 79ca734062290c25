/* A string-keyed hash map to pointers (open addressing, keys borrowed from the caller, who
 * keeps them alive while they are in the map). Used for node names and parser symbol tables. */
#ifndef AG_STRMAP_H
#define AG_STRMAP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct ag__strslot {
    const char *key; /* NULL: empty */
    void *val;
    uint64_t hash; /* the key's ag__strhash */
} ag__strslot;

typedef struct ag__strmap {
    ag__strslot *slots; /* key, value and hash together: a probe touches one place */
    int64_t cap, len, tombs;
} ag__strmap;

/* All functions return 0 or AG_ENOMEM; a zeroed struct is an empty map. */
int ag__strmap_put(ag__strmap *m, const char *key, void *val);
/* Adds key when it is absent (0); 1 when it is present (the map is unchanged); AG_ENOMEM. */
int ag__strmap_put_new(ag__strmap *m, const char *key, void *val);
/* The same with the key's ag__strhash h computed by the caller. */
int ag__strmap_put_new_h(ag__strmap *m, const char *key, void *val, uint64_t h);
void *ag__strmap_get(const ag__strmap *m, const char *key);
/* The same with the key's ag__strhash h computed by the caller (who may have prefetched its
 * slot with ag__strmap_prefetch, as the verifier does a few nodes ahead). */
void *ag__strmap_get_h(const ag__strmap *m, const char *key, uint64_t h);
static inline void ag__strmap_prefetch(const ag__strmap *m, uint64_t h) {
    if (m->cap)
        __builtin_prefetch(&m->slots[h & (uint64_t)(m->cap - 1)]);
}
bool ag__strmap_has(const ag__strmap *m, const char *key);
void ag__strmap_del(ag__strmap *m, const char *key);
void ag__strmap_free(ag__strmap *m);
/* Room for n keys without rebuilding the table. */
int ag__strmap_reserve(ag__strmap *m, int64_t n);
uint64_t ag__strhash(const char *s);

#endif
