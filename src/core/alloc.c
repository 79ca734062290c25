/* The allocator hook, and the default allocator's cache of tensor data. Every allocation of the
 * library goes through ag__malloc/ag__free (bookkeeping) or ag__malloc_data/ag__free_data
 * (tensor data), which call the user's hook (ag_set_allocator) or the default allocator. A NULL
 * return becomes an AG_ENOMEM error for the caller to propagate; tests inject failures through
 * the hook.
 *
 * The data cache. An eager step allocates its activations and gradients afresh and frees them
 * at its end; glibc serves blocks of a megabyte or more by mmap (or trims its heap top when
 * they are freed), so every step page-faulted its activations in again, about a tenth of the
 * step's time. With the default allocator, tensor data of at least AG__DATA_CACHE_MIN bytes is
 * therefore kept when freed, and handed out again for a request of the same size class, as
 * PyTorch's caching allocators and ggml's buffers do:
 *   - A request is rounded up to its class: the sizes 2^k, 1.25 2^k, 1.5 2^k and 1.75 2^k, so a
 *     block is under a quarter larger than what was asked. The block is allocated (64-byte
 *     aligned) at the class size; a freed block goes to its class's list and a request of that
 *     class takes the most recently freed one. Classes do not mix.
 *   - The cache holds at most dc.cap bytes, a quarter of physical memory: an eager GPT-2 small
 *     step frees and asks again for about 1.5 GB, and with a 1 GiB cap it missed and faulted
 *     as much as without a cache (its step: 1.6-1.7 s capped, 1.3 s uncapped). A freed
 *     block that would take it past the cap goes back to the system, and so does a request
 *     larger than the cap (neither rounded nor tracked).
 *   - The cache knows the blocks it made (an address set), so a block it did not make is freed
 *     to the system even when it arrives with a cacheable size (one a hook allocated, freed
 *     after the hook was removed); the size given to ag__free_data must be the size asked.
 *   - One mutex guards it: tensors are freed on other threads than the ones that made them.
 *   - With a hook set the cache is bypassed: the hook sees every allocation with the size
 *     asked and every free. ag_set_allocator empties the cache first, and so do
 *     ag_allocator_release_cache and, at process exit, a destructor that runs after the other
 *     library destructors (the scratch slots' release frees into the cache), so leak checkers
 *     see a clean heap. Frees after that destructor go straight to the system.
 *   - Under AddressSanitizer the cache stays on, but a cached block is poisoned, and the tail of
 *     a block beyond the size asked too, so a use after free of tensor data, or an overflow
 *     past it, is still reported.
 *   - A failed system allocation releases the cache and tries once more.
 * The cache's own index (the class lists and the address set) is part of the default
 * allocator, so it uses malloc directly; when it cannot grow, a block is simply not cached. */
#include "internal.h"

#include <assert.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

#include "asan.h"

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

static bool is_default(void) {
    return cur.alloc == default_alloc && cur.free == default_free;
}

/* ---- the data cache ---- */

#define DC_NCLASSES (4 * 64)

typedef struct dc_list {
    void **v;
    size_t n, cap;
} dc_list;

typedef struct dc_slot {
    uintptr_t key; /* 0: empty */
    unsigned cls;
} dc_slot;

static struct {
    pthread_mutex_t mu;
    bool cap_known; /* cap computed (or set by a test) */
    bool closed;    /* the exit destructor ran: nothing is cached any more */
    size_t cap;
    size_t bytes, blocks, peak;
    uint64_t hits, misses;
    dc_list cls[DC_NCLASSES];
    dc_slot *set; /* the blocks the cache made, in use or cached; open addressing */
    size_t set_n, set_cap;
} dc = {.mu = PTHREAD_MUTEX_INITIALIZER};

/* The class of a request of n >= AG__DATA_CACHE_MIN bytes and the bytes of its blocks: n
 * rounded up to a multiple of a quarter of the power of two at or below it. False when the
 * rounding would overflow. */
static bool dc_class(size_t n, unsigned *cls, size_t *bytes) {
    assert(n >= AG__DATA_CACHE_MIN); /* so the quarter step below is at least 1 */
    unsigned k = 63u - (unsigned)__builtin_clzll((unsigned long long)n);
    size_t step = (size_t)1 << (k - 2);
    if (n > SIZE_MAX - (step - 1))
        return false;
    size_t r = (n + step - 1) & ~(step - 1);
    unsigned k2 = 63u - (unsigned)__builtin_clzll((unsigned long long)r);
    *cls = 4 * k2 + (unsigned)((r >> (k2 - 2)) & 3);
    *bytes = r;
    assert(*cls < DC_NCLASSES && r >= n && r - n < step);
    return true;
}

static size_t dc_class_bytes(unsigned cls) {
    assert(cls < DC_NCLASSES && cls / 4 >= 2);
    unsigned k = cls / 4;
    return ((size_t)1 << k) + (size_t)(cls % 4) * ((size_t)1 << (k - 2));
}

/* Called with dc.mu held. */
static void dc_init_cap(void) {
    if (dc.cap_known)
        return;
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    size_t cap = (size_t)1 << 30; /* when the memory size is unknown */
    if (pages > 0 && page > 0)
        cap = (size_t)((uint64_t)pages * (uint64_t)page / 4);
    dc.cap = cap;
    dc.cap_known = true;
}

/* ---- the address set (linear probing, deletion by backward shift); dc.mu held ---- */

static size_t dc_hash(uintptr_t key) {
    return (size_t)(((uint64_t)(key >> 6) * 0x9E3779B97F4A7C15ull) >> 32) & (dc.set_cap - 1);
}

static dc_slot *dc_find(const void *p) {
    if (!dc.set_cap)
        return NULL;
    assert(dc.set_n < dc.set_cap); /* an empty slot ends every probe */
    uintptr_t key = (uintptr_t)p;
    for (size_t i = dc_hash(key);; i = (i + 1) & (dc.set_cap - 1)) {
        if (dc.set[i].key == key)
            return &dc.set[i];
        if (!dc.set[i].key)
            return NULL;
    }
}

static void dc_put_slot(dc_slot *set, size_t cap, uintptr_t key, unsigned cls) {
    size_t i = (size_t)(((uint64_t)(key >> 6) * 0x9E3779B97F4A7C15ull) >> 32) & (cap - 1);
    while (set[i].key && set[i].key != key)
        i = (i + 1) & (cap - 1);
    set[i] = (dc_slot){key, cls};
}

/* Records block p of class cls. False when the set cannot grow (p is then not tracked). */
static bool dc_track(void *p, unsigned cls) {
    dc_slot *s = dc_find(p);
    if (s) { /* an address freed behind the cache's back and made again */
        s->cls = cls;
        return true;
    }
    if ((dc.set_n + 1) * 4 > dc.set_cap * 3) {
        size_t ncap = dc.set_cap ? dc.set_cap * 2 : 64;
        dc_slot *ns = calloc(ncap, sizeof *ns);
        if (!ns)
            return false;
        for (size_t i = 0; i < dc.set_cap; i++)
            if (dc.set[i].key)
                dc_put_slot(ns, ncap, dc.set[i].key, dc.set[i].cls);
        free(dc.set);
        dc.set = ns;
        dc.set_cap = ncap;
    }
    dc_put_slot(dc.set, dc.set_cap, (uintptr_t)p, cls);
    dc.set_n++;
    return true;
}

static void dc_untrack(dc_slot *s) {
    assert(s->key && dc.set_n > 0 && s >= dc.set && s < dc.set + dc.set_cap);
    size_t mask = dc.set_cap - 1, i = (size_t)(s - dc.set);
    s->key = 0;
    dc.set_n--;
    /* Move later entries of the probe run back into the hole when their home allows it. */
    for (size_t j = (i + 1) & mask; dc.set[j].key; j = (j + 1) & mask) {
        size_t home = dc_hash(dc.set[j].key);
        bool between = i <= j ? (home > i && home <= j) : (home > i || home <= j);
        if (!between) {
            dc.set[i] = dc.set[j];
            dc.set[j].key = 0;
            i = j;
        }
    }
}

/* Frees every cached block; dc.mu held. Returns the bytes freed. */
static size_t dc_release_locked(void) {
    size_t freed = dc.bytes, counted = 0;
    for (unsigned c = 0; c < DC_NCLASSES; c++) {
        dc_list *l = &dc.cls[c];
        size_t bytes = l->n ? dc_class_bytes(c) : 0;
        counted += bytes * l->n;
        for (size_t i = 0; i < l->n; i++) {
            dc_slot *s = dc_find(l->v[i]);
            if (s)
                dc_untrack(s);
            AG__UNPOISON(l->v[i], bytes);
            free(l->v[i]);
        }
        free(l->v);
        *l = (dc_list){0};
    }
    assert(counted == freed); /* the byte count follows the class lists */
    (void)counted;
    dc.bytes = dc.blocks = 0;
    return freed;
}

void ag_allocator_release_cache(void) {
    pthread_mutex_lock(&dc.mu);
    dc_release_locked();
    pthread_mutex_unlock(&dc.mu);
}

/* fork() while another thread holds the cache's lock would leave the child's copy locked
 * forever: the forking thread takes the lock around fork, and both sides release it. */
static void dc_lock(void) {
    pthread_mutex_lock(&dc.mu);
}
static void dc_unlock(void) {
    pthread_mutex_unlock(&dc.mu);
}
__attribute__((constructor)) static void dc_atfork(void) {
    pthread_atfork(dc_lock, dc_unlock, dc_unlock);
}

/* Runs after the library's other destructors (the scratch slots', which free into the cache):
 * destructors of a lower priority run later. */
__attribute__((destructor(101))) static void dc_fini(void) {
    pthread_mutex_lock(&dc.mu);
    dc_release_locked();
    dc.closed = true;
    free(dc.set);
    dc.set = NULL;
    dc.set_n = dc.set_cap = 0;
    pthread_mutex_unlock(&dc.mu);
}

void ag__data_cache_stats(ag__dcache_stats *out) {
    pthread_mutex_lock(&dc.mu);
    dc_init_cap();
    *out = (ag__dcache_stats){.bytes = dc.bytes,
                              .blocks = dc.blocks,
                              .peak_bytes = dc.peak,
                              .cap = dc.cap,
                              .tracked = dc.set_n,
                              .hits = dc.hits,
                              .misses = dc.misses};
    pthread_mutex_unlock(&dc.mu);
}

size_t ag__data_cache_set_cap(size_t cap) {
    pthread_mutex_lock(&dc.mu);
    dc_init_cap();
    size_t old = dc.cap;
    dc.cap = cap;
    /* Drop the largest classes first until the rest fits. */
    for (unsigned c = DC_NCLASSES; c-- > 0 && dc.bytes > cap;) {
        dc_list *l = &dc.cls[c];
        size_t bytes = l->n ? dc_class_bytes(c) : 0;
        while (l->n && dc.bytes > cap) {
            void *p = l->v[--l->n];
            dc_slot *s = dc_find(p);
            if (s)
                dc_untrack(s);
            AG__UNPOISON(p, bytes);
            free(p);
            dc.bytes -= bytes;
            dc.blocks--;
        }
    }
    dc.peak = dc.bytes;
    pthread_mutex_unlock(&dc.mu);
    return old;
}

/* A request of `size` bytes of tensor data with the default allocator: from the cache when
 * size is cacheable, else from the system. */
static void *dc_alloc(size_t size) {
    unsigned cls;
    size_t bytes;
    if (size < AG__DATA_CACHE_MIN || !dc_class(size, &cls, &bytes))
        return default_alloc(NULL, size ? size : 1, AG_ALIGN);
    pthread_mutex_lock(&dc.mu);
    dc_init_cap();
    if (dc.closed || bytes > dc.cap) {
        pthread_mutex_unlock(&dc.mu);
        return default_alloc(NULL, size, AG_ALIGN);
    }
    dc_list *l = &dc.cls[cls];
    if (l->n) {
        assert(dc.bytes >= bytes && dc.blocks > 0);
        void *p = l->v[--l->n];
        dc.bytes -= bytes;
        dc.blocks--;
        dc.hits++;
        AG__UNPOISON(p, size);
        pthread_mutex_unlock(&dc.mu);
        return p;
    }
    dc.misses++;
    pthread_mutex_unlock(&dc.mu);
    void *p = aligned_alloc(AG_ALIGN, bytes);
    if (!p) {
        ag_allocator_release_cache();
        p = aligned_alloc(AG_ALIGN, bytes);
        if (!p)
            return NULL;
    }
    pthread_mutex_lock(&dc.mu);
    bool tracked = !dc.closed && dc_track(p, cls);
    pthread_mutex_unlock(&dc.mu);
    /* The tail beyond the size asked is poisoned (ASan) so that an overflow is reported; an
     * untracked block goes back to the system without passing the cache's unpoisoning. */
    if (tracked)
        AG__POISON((char *)p + size, bytes - size);
    return p;
}

/* ---- the entry points ---- */

void ag_set_allocator(const ag_allocator *a) {
    /* Cached blocks belong to the default allocator: a hook must not see them freed, and
     * neither must the default see blocks a hook made. */
    ag_allocator_release_cache();
    if (a)
        cur = *a;
    else
        cur = (ag_allocator){default_alloc, default_free, NULL};
}

ag_allocator ag_get_allocator(void) {
    return cur;
}

void *ag__malloc(size_t size) {
    /* Bookkeeping blocks of 256 bytes and more are 64-byte aligned; smaller ones (nodes, names,
     * list cells) only need malloc's 16. Tensor data always gets 64 (ag__malloc_data). */
    size_t align = size >= 256 ? AG_ALIGN : 16;
    void *p = cur.alloc(cur.ud, size ? size : 1, align);
    if (!p && is_default()) {
        ag_allocator_release_cache();
        p = default_alloc(NULL, size ? size : 1, align);
    }
    if (!p)
        ag__err(AG_ENOMEM, "out of memory allocating %zu bytes", size);
    return p;
}

void *ag__malloc_data(size_t size) {
    void *p = is_default() ? dc_alloc(size) : cur.alloc(cur.ud, size ? size : 1, AG_ALIGN);
    if (!p)
        ag__err(AG_ENOMEM, "out of memory allocating %zu bytes of tensor data", size);
    return p;
}

void ag__free_data(void *p, size_t size) {
    if (!p)
        return;
    if (size < AG__DATA_CACHE_MIN) {
        ag__free(p);
        return;
    }
    pthread_mutex_lock(&dc.mu);
    dc_slot *s = dc_find(p);
    if (!s) { /* not made by the cache: a hook's block, or one larger than the cap */
        pthread_mutex_unlock(&dc.mu);
        ag__free(p);
        return;
    }
    unsigned cls = s->cls, asked_cls;
    size_t bytes = dc_class_bytes(cls), asked_bytes;
    bool same = dc_class(size, &asked_cls, &asked_bytes) && asked_cls == cls;
    if (same && is_default() && !dc.closed && dc.bytes + bytes <= dc.cap) {
        dc_list *l = &dc.cls[cls];
        if (l->n == l->cap) {
            size_t ncap = l->cap ? l->cap * 2 : 8;
            void **nv = realloc(l->v, ncap * sizeof *nv);
            if (nv) {
                l->v = nv;
                l->cap = ncap;
            }
        }
        if (l->n < l->cap) {
            /* Poisoned before another thread can take it and unpoison it. */
            AG__POISON(p, bytes);
            l->v[l->n++] = p;
            dc.bytes += bytes;
            dc.blocks++;
            if (dc.bytes > dc.peak)
                dc.peak = dc.bytes;
            pthread_mutex_unlock(&dc.mu);
            return;
        }
    }
    dc_untrack(s);
    pthread_mutex_unlock(&dc.mu);
    AG__UNPOISON(p, bytes);
    ag__free(p);
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

void ag_free(void *p) {
    ag__free(p);
}
