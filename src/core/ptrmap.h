/* A pointer-keyed hash map to int64 values (open addressing, linear probing, no deletion).
 * For sets and indexes over nodes and tensors that would otherwise be found by scanning a list:
 * the autograd engine's wanted inputs, the partitioner's and executor's per-node tables. */
#ifndef AG_PTRMAP_H
#define AG_PTRMAP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct ag__ptrslot {
    const void *key; /* NULL: empty */
    int64_t val;
} ag__ptrslot;

typedef struct ag__ptrmap {
    ag__ptrslot *slots;
    int64_t cap, len;
} ag__ptrmap;

/* A zeroed struct is an empty map. put returns 0 or AG_ENOMEM (the map unchanged); a NULL key
 * is not allowed. get returns `dflt` when the key is absent. */
int ag__ptrmap_put(ag__ptrmap *m, const void *key, int64_t val);
int64_t ag__ptrmap_get(const ag__ptrmap *m, const void *key, int64_t dflt);
bool ag__ptrmap_has(const ag__ptrmap *m, const void *key);
/* Room for n keys without growing (0 or AG_ENOMEM). */
int ag__ptrmap_reserve(ag__ptrmap *m, int64_t n);
void ag__ptrmap_free(ag__ptrmap *m);

#endif
