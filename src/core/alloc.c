/* The allocator hook. Every allocation of the library goes through ag__malloc/ag__free, which
 * call the user's hook (ag_set_allocator) or the default aligned_alloc. A NULL return becomes an
 * AG_ENOMEM error for the caller to propagate; tests inject failures through the hook. */
#include "internal.h"

#include <stdint.h>
#include <stdlib.h>

static void *default_alloc(void *ud, size_t size, size_t align) {
    (void)ud;
    /* malloc already gives 16-byte alignment; glibc's aligned path is much slower, and most
     * allocations (nodes, names, lists) are small. */
    if (align <= 16)
        return malloc(size ? size : 1);
    /* Rounding up a size near SIZE_MAX would wrap to a tiny block. */
    if (size > SIZE_MAX - align)
        return NULL;
    size_t rounded = (size + align - 1) / align * align;
    return aligned_alloc(align, rounded ? rounded : align);
}

static void default_free(void *ud, void *p) {
    (void)ud;
    free(p);
}

static ag_allocator cur = {default_alloc, default_free, NULL};

void ag_set_allocator(const ag_allocator *a) {
    if (a)
        cur = *a;
    else
        cur = (ag_allocator){default_alloc, default_free, NULL};
}

ag_allocator ag_get_allocator(void) { return cur; }

void *ag__malloc(size_t size) {
    /* Bookkeeping blocks of 256 bytes and more are 64-byte aligned; smaller ones (nodes, names,
     * list cells) only need malloc's 16. Tensor data always gets 64 (ag__malloc_data). */
    void *p = cur.alloc(cur.ud, size ? size : 1, size >= 256 ? AG_ALIGN : 16);
    if (!p)
        ag__err(AG_ENOMEM, "out of memory allocating %zu bytes", size);
    return p;
}

void *ag__malloc_data(size_t size) {
    void *p = cur.alloc(cur.ud, size ? size : 1, AG_ALIGN);
    if (!p)
        ag__err(AG_ENOMEM, "out of memory allocating %zu bytes of tensor data", size);
    return p;
}

void *ag__calloc(size_t count, size_t size) {
    if (size && count > SIZE_MAX / size) {
        ag__err(AG_ENOMEM, "allocation of %zu x %zu bytes overflows", count, size);
        return NULL;
    }
    void *p = ag__malloc(count * size);
    if (p)
        memset(p, 0, count * size);
    return p;
}

void ag__free(void *p) {
    if (p)
        cur.free(cur.ud, p);
}

int ag__grow(void **p, int64_t *cap, int64_t need, size_t elem) {
    if (need <= *cap)
        return 0;
    int64_t ncap = *cap ? *cap * 2 : 8;
    while (ncap < need)
        ncap *= 2;
    void *np = ag__malloc((size_t)ncap * elem);
    if (!np)
        return AG_ENOMEM;
    if (*p && *cap)
        memcpy(np, *p, (size_t)*cap * elem);
    ag__free(*p);
    *p = np;
    *cap = ncap;
    return 0;
}

char *ag__strdup(const char *s) {
    size_t n = strlen(s) + 1;
    char *d = ag__malloc(n);
    if (d)
        memcpy(d, s, n);
    return d;
}

void ag_free(void *p) { ag__free(p); }
