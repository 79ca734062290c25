/* The default allocator's cache of tensor data (src/core/alloc.c): a freed block of 64 KiB or
 * more is handed out again for a request of its size class and of no other, the cache never
 * holds more than its cap, ag_allocator_release_cache empties it, a hook set with
 * ag_set_allocator sees every data allocation and free with the sizes asked (the cache is
 * emptied and bypassed), four threads that pass blocks to each other find their patterns
 * intact, ASan builds poison cached blocks, and a warm eager training step of an MLP faults
 * almost none of its memory in again (it faulted in every activation on each step before). */
#include "testutil.h"
#include "core/internal.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "core/asan.h"

static ag__dcache_stats stats(void) {
    ag__dcache_stats s;
    ag__data_cache_stats(&s);
    return s;
}

static bool aligned64(const void *p) {
    return ((uintptr_t)p & 63) == 0;
}

/* 100000 and 110000 bytes both round up to 114688 (7 x 16 KiB, the class 1.75 x 64 KiB);
 * 120000 rounds up to 131072 (2^17), another class. */
static void test_reuse_same_class(void **state) {
    (void)state;
    ag_allocator_release_cache();
    ag__dcache_stats s0 = stats();
    assert_int_equal(s0.bytes, 0);
    assert_int_equal(s0.blocks, 0);

    void *a = ag__malloc_data(100000);
    assert_non_null(a);
    assert_true(aligned64(a));
    memset(a, 0x5a, 100000);
    ag__free_data(a, 100000);
    ag__dcache_stats s1 = stats();
    assert_int_equal(s1.blocks, 1);
    assert_int_equal(s1.bytes, 114688);

    void *b = ag__malloc_data(100000);
    assert_ptr_equal(b, a);
    ag__free_data(b, 100000);
    /* Another size of the same class, at its top. */
    void *c = ag__malloc_data(114688);
    assert_ptr_equal(c, a);
    memset(c, 1, 114688); /* the whole class size is usable */
    ag__free_data(c, 114688);
    void *d = ag__malloc_data(110000);
    assert_ptr_equal(d, a);
    ag__dcache_stats s2 = stats();
    assert_int_equal(s2.hits - s0.hits, 3);
    assert_int_equal(s2.blocks, 0);
    ag__free_data(d, 110000);

    /* Blocks below 64 KiB are not cached. */
    void *small = ag__malloc_data(AG__DATA_CACHE_MIN - 64);
    assert_non_null(small);
    assert_true(aligned64(small));
    ag__free_data(small, AG__DATA_CACHE_MIN - 64);
    assert_int_equal(stats().blocks, 1);
    ag_allocator_release_cache();
}

static void test_classes_do_not_mix(void **state) {
    (void)state;
    ag_allocator_release_cache();
    void *a = ag__malloc_data(100000); /* class 114688 */
    ag__free_data(a, 100000);
    void *b = ag__malloc_data(120000); /* class 131072: not a's block */
    assert_non_null(b);
    assert_ptr_not_equal(b, a);
    ag__dcache_stats s = stats();
    assert_int_equal(s.blocks, 1);
    assert_int_equal(s.bytes, 114688);
    void *c = ag__malloc_data(65536); /* class 65536: smaller than a's block, still not it */
    assert_ptr_not_equal(c, a);
    assert_ptr_not_equal(c, b);
    ag__free_data(b, 120000);
    ag__free_data(c, 65536);
    s = stats();
    assert_int_equal(s.blocks, 3);
    assert_int_equal(s.bytes, 114688 + 131072 + 65536);
    /* Each comes back for its own class. */
    assert_ptr_equal(ag__malloc_data(60000 + 5536), c);
    assert_ptr_equal(ag__malloc_data(130000), b);
    assert_ptr_equal(ag__malloc_data(98305), a);
    ag__free_data(a, 98305);
    ag__free_data(b, 130000);
    ag__free_data(c, 65536);
    ag_allocator_release_cache();
}

static void test_cap_holds(void **state) {
    (void)state;
    ag_allocator_release_cache();
    size_t old = ag__data_cache_set_cap((size_t)1 << 20);
    assert_true(old >= AG__DATA_CACHE_MIN);
    /* The default: a quarter of physical memory. */
    assert_true((double)old <= (double)sysconf(_SC_PHYS_PAGES) * (double)sysconf(_SC_PAGESIZE) / 4);

    enum { N = 12 };
    void *p[N];
    for (int i = 0; i < N; i++) {
        p[i] = ag__malloc_data(200000); /* class 229376: four fit in 1 MiB */
        assert_non_null(p[i]);
    }
    size_t tracked = stats().tracked;
    for (int i = 0; i < N; i++) {
        ag__free_data(p[i], 200000);
        assert_true(stats().bytes <= ((size_t)1 << 20));
    }
    ag__dcache_stats s = stats();
    assert_int_equal(s.blocks, 4);
    assert_int_equal(s.bytes, 4 * 229376);
    assert_true(s.peak_bytes <= ((size_t)1 << 20));
    assert_int_equal(s.tracked, tracked - (N - 4)); /* the other eight went to the system */

    /* A request larger than the cap is neither cached nor rounded. */
    void *big = ag__malloc_data((size_t)2 << 20);
    assert_non_null(big);
    ag__free_data(big, (size_t)2 << 20);
    assert_int_equal(stats().blocks, 4);

    /* Lowering the cap frees down to it. */
    ag__data_cache_set_cap(2 * 229376);
    s = stats();
    assert_int_equal(s.blocks, 2);
    assert_true(s.bytes <= 2 * 229376);

    ag__data_cache_set_cap(old);
    ag_allocator_release_cache();
}

static void test_release_empties(void **state) {
    (void)state;
    void *p[5];
    size_t sizes[5] = {65536, 70000, 300000, 1 << 20, 3000000};
    for (int i = 0; i < 5; i++)
        p[i] = ag__malloc_data(sizes[i]);
    size_t tracked = stats().tracked;
    for (int i = 0; i < 5; i++)
        ag__free_data(p[i], sizes[i]);
    ag__dcache_stats s = stats();
    assert_true(s.blocks >= 5);
    assert_int_equal(s.tracked, tracked); /* cached blocks stay known to the cache */
    ag_allocator_release_cache();
    s = stats();
    assert_int_equal(s.blocks, 0);
    assert_int_equal(s.bytes, 0);
    assert_int_equal(s.tracked, tracked - 5);
}

/* ---- a hook that records the data allocations it sees ---- */

#define HOOK_MAX 64
static struct {
    ag_allocator prev;
    int nalloc, nfree;
    void *ptr[HOOK_MAX];
    size_t size[HOOK_MAX];
    void *freed[HOOK_MAX];
} hk;

static void *hk_alloc(void *ud, size_t size, size_t align) {
    (void)ud;
    void *p = hk.prev.alloc(hk.prev.ud, size, align);
    if (p && align == AG_ALIGN && size >= AG__DATA_CACHE_MIN && hk.nalloc < HOOK_MAX) {
        hk.ptr[hk.nalloc] = p;
        hk.size[hk.nalloc++] = size;
    }
    return p;
}

static void hk_free(void *ud, void *p) {
    (void)ud;
    for (int i = 0; p && i < hk.nalloc; i++)
        if (hk.ptr[i] == p && hk.nfree < HOOK_MAX)
            hk.freed[hk.nfree++] = p;
    hk.prev.free(hk.prev.ud, p);
}

static bool hk_saw_free(const void *p) {
    for (int i = 0; i < hk.nfree; i++)
        if (hk.freed[i] == p)
            return true;
    return false;
}

static void test_hook_bypasses_cache(void **state) {
    (void)state;
    ag_allocator_release_cache();
    /* A block cached, and one in use made by the cache, before the hook. */
    void *cached = ag__malloc_data(100000);
    void *before = ag__malloc_data(300000);
    ag__free_data(cached, 100000);
    assert_int_equal(stats().blocks, 1);
    size_t tracked = stats().tracked;

    memset(&hk, 0, sizeof hk);
    hk.prev = ag_get_allocator();
    ag_set_allocator(&(ag_allocator){hk_alloc, hk_free, NULL});
    assert_int_equal(stats().blocks, 0); /* setting a hook released the cache */
    assert_int_equal(stats().tracked, tracked - 1);

    /* The hook sees the sizes asked, not class sizes, and every free. */
    void *a = ag__malloc_data(100000);
    ag_tensor *t = ag_zeros(AG_F32, 1, (int64_t[]){30000}); /* 120000 bytes */
    assert_non_null(t);
    void *kept = ag__malloc_data(200000); /* freed after the hook is gone */
    assert_int_equal(hk.nalloc, 3);
    assert_ptr_equal(hk.ptr[0], a);
    assert_int_equal(hk.size[0], 100000);
    assert_int_equal(hk.size[1], 120000);
    assert_int_equal(hk.size[2], 200000);
    ag__free_data(a, 100000);
    ag_tensor_free(t);
    assert_int_equal(hk.nfree, 2);
    assert_true(hk_saw_free(a));
    assert_true(hk_saw_free(hk.ptr[1]));
    assert_int_equal(stats().blocks, 0); /* nothing was cached while hooked */

    /* A block the cache made, freed while hooked, goes to the hook's free (not the cache). */
    ag__free_data(before, 300000);
    assert_int_equal(stats().blocks, 0);
    assert_int_equal(stats().tracked, tracked - 2);

    ag_set_allocator(&hk.prev);
    /* A block the hook made, freed with the default allocator back, is not the cache's: it goes
     * to the system, not into the class it would round to. */
    ag__free_data(kept, 200000);
    assert_int_equal(stats().blocks, 0);
    /* The cache works again. */
    void *x = ag__malloc_data(100000);
    ag__free_data(x, 100000);
    assert_ptr_equal(ag__malloc_data(100000), x);
    ag__free_data(x, 100000);
    ag_allocator_release_cache();
}

#ifdef AG__ASAN
/* A cached block is poisoned, so a use after free of tensor data is still reported; a reused
 * one is unpoisoned up to the size asked and poisoned beyond it. */
static void test_asan_poisons_cached_blocks(void **state) {
    (void)state;
    ag_allocator_release_cache();
    void *a = ag__malloc_data(100000);
    assert_false(__asan_address_is_poisoned(a));
    assert_false(__asan_address_is_poisoned((char *)a + 99999));
    assert_true(__asan_address_is_poisoned((char *)a + 100000));
    ag__free_data(a, 100000);
    assert_true(__asan_address_is_poisoned(a));
    assert_true(__asan_address_is_poisoned((char *)a + 50000));
    void *b = ag__malloc_data(104000);
    assert_ptr_equal(b, a);
    assert_false(__asan_address_is_poisoned((char *)b + 103999));
    assert_true(__asan_address_is_poisoned((char *)b + 104000));
    ag__free_data(b, 104000);
    ag_allocator_release_cache();
}
#endif

/* ---- threads passing blocks to each other ---- */

#define TH_N 4
#define TH_SLOTS 16
#define TH_ITERS 400

static struct {
    pthread_mutex_t mu;
    void *p[TH_SLOTS];
    size_t size[TH_SLOTS];
    uint64_t tag[TH_SLOTS];
    _Atomic int bad;
} th = {.mu = PTHREAD_MUTEX_INITIALIZER};

static uint64_t pattern(uint64_t tag, size_t i) {
    return (tag ^ (uint64_t)i) * 0x9E3779B97F4A7C15ull;
}

static void fill(void *p, size_t size, uint64_t tag) {
    uint64_t *w = p;
    for (size_t i = 0; i < size / 8; i++)
        w[i] = pattern(tag, i);
}

static bool check(const void *p, size_t size, uint64_t tag) {
    const uint64_t *w = p;
    for (size_t i = 0; i < size / 8; i++)
        if (w[i] != pattern(tag, i))
            return false;
    return true;
}

static void *th_main(void *arg) {
    uint64_t rng = 0x1234567ull + (uint64_t)(uintptr_t)arg * 0x1000193ull;
    for (int it = 0; it < TH_ITERS; it++) {
        /* Sizes from 8 bytes to 512 KiB, log-uniform, multiples of 8; most are cacheable. */
        uint64_t r = tu_xorshift_next(&rng);
        unsigned shift = 3 + (unsigned)(r % 17);
        size_t size =
            (((size_t)1 << shift) + (size_t)((r >> 8) % ((size_t)1 << shift))) & ~(size_t)7;
        if (size == 0)
            size = 8;
        void *p = ag__malloc_data(size);
        if (!p || !aligned64(p)) {
            atomic_store(&th.bad, 1);
            break;
        }
        uint64_t tag = tu_xorshift_next(&rng);
        fill(p, size, tag);
        int slot = (int)((r >> 40) % TH_SLOTS);
        pthread_mutex_lock(&th.mu);
        void *q = th.p[slot];
        size_t qs = th.size[slot];
        uint64_t qt = th.tag[slot];
        th.p[slot] = p;
        th.size[slot] = size;
        th.tag[slot] = tag;
        pthread_mutex_unlock(&th.mu);
        if (q) { /* most likely made by another thread */
            if (!check(q, qs, qt))
                atomic_store(&th.bad, 1);
            ag__free_data(q, qs);
        }
    }
    return NULL;
}

static void test_threads(void **state) {
    (void)state;
    ag_allocator_release_cache();
    uint64_t hits0 = stats().hits;
    pthread_t t[TH_N];
    for (int i = 0; i < TH_N; i++)
        assert_int_equal(pthread_create(&t[i], NULL, th_main, (void *)(uintptr_t)(i + 1)), 0);
    for (int i = 0; i < TH_N; i++)
        pthread_join(t[i], NULL);
    for (int i = 0; i < TH_SLOTS; i++)
        if (th.p[i]) {
            if (!check(th.p[i], th.size[i], th.tag[i]))
                th.bad = 1;
            ag__free_data(th.p[i], th.size[i]);
            th.p[i] = NULL;
        }
    assert_int_equal(atomic_load(&th.bad), 0);
    ag__dcache_stats s = stats();
    assert_true(s.hits > hits0); /* blocks were reused, across threads among others */
    assert_true(s.bytes <= s.cap);
    ag_allocator_release_cache();
    assert_int_equal(stats().blocks, 0);
}

/* ---- an eager training step faults nothing in once warm ---- */

static _Atomic int64_t data_bytes; /* data bytes allocated while step_hook is set */
static ag_allocator step_prev;

static void *step_alloc(void *ud, size_t size, size_t align) {
    (void)ud;
    if (align == AG_ALIGN && size >= AG__DATA_CACHE_MIN)
        atomic_fetch_add(&data_bytes, (int64_t)size);
    return step_prev.alloc(step_prev.ud, size, align);
}

static void step_free(void *ud, void *p) {
    (void)ud;
    step_prev.free(step_prev.ud, p);
}

static void train_step(ag_module *m, ag_optim *o, ag_tensor *x) {
    ag_scope_begin();
    ag_tensor *out = NULL;
    assert_int_equal(ag_module_call(m, &x, 1, &out, 1), 1);
    ag_tensor *loss = ag_mean(out, NULL, 0, false);
    assert_non_null(loss);
    assert_int_equal(ag_backward(loss, NULL, false), 0);
    assert_int_equal(ag_optim_step(o), 0);
    ag_optim_zero_grad(o);
    ag_scope_end();
}

static long minflt(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_minflt;
}

static void test_warm_eager_step_does_not_fault(void **state) {
    (void)state;
    ag_allocator_release_cache();
    /* One thread: how often glibc alone gave the step's memory back varied from run to run with
     * two (per-thread arenas); with one it returned it on every step. */
    int threads = ag_get_num_threads();
    ag_set_num_threads(1);
    ag_manual_seed(0);
    ag_module *m = ag_nn_sequential();
    assert_non_null(m);
    for (int i = 0; i < 7; i++)
        assert_int_equal(
            ag_nn_append(m, i % 2 == 0 ? ag_nn_linear(1024, 1024, true) : ag_nn_relu()), 0);
    ag_optim *o = ag_optim_sgd(m, 1e-3, 0.9, 0.0, false);
    assert_non_null(o);
    ag_tensor *x = ag_randn(AG_F32, 2, (int64_t[]){256, 1024});
    assert_non_null(x);

    for (int i = 0; i < 2; i++) /* warm up: momentum buffers, scratch, the cache */
        train_step(m, o, x);

    /* What one step allocates in tensor data, through a hook (which bypasses the cache). */
    step_prev = ag_get_allocator();
    atomic_store(&data_bytes, 0);
    ag_set_allocator(&(ag_allocator){step_alloc, step_free, NULL});
    train_step(m, o, x);
    ag_set_allocator(&step_prev);
    int64_t step_bytes = atomic_load(&data_bytes), step_pages = step_bytes / 4096;
    /* At least the four Linear outputs and three ReLU outputs (1 MiB each) and the four weight
     * gradients (4 MiB each). */
    assert_true(step_bytes >= (int64_t)(4 + 3 + 4 * 4) << 20);
    train_step(m, o, x); /* refills the cache the hook emptied */
    train_step(m, o, x);

    long f0 = minflt();
    for (int i = 0; i < 3; i++)
        train_step(m, o, x);
    long faults = minflt() - f0;
    print_message("  3 warm steps: %ld page faults; one step allocates %lld pages of data\n",
                  faults, (long long)step_pages);
    if (faults * 10 >= 3 * step_pages)
        fail_msg("3 warm eager steps made %ld page faults, not under 10%% of the %lld pages "
                 "they allocate",
                 faults, (long long)(3 * step_pages));
    ag_tensor_free(x);
    ag_optim_free(o);
    ag_module_free(m);
    ag_set_num_threads(threads);
    ag_allocator_release_cache();
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_reuse_same_class),
        cmocka_unit_test(test_classes_do_not_mix),
        cmocka_unit_test(test_cap_holds),
        cmocka_unit_test(test_release_empties),
        cmocka_unit_test(test_hook_bypasses_cache),
#ifdef AG__ASAN
        cmocka_unit_test(test_asan_poisons_cached_blocks),
#endif
        cmocka_unit_test(test_threads),
        cmocka_unit_test(test_warm_eager_step_does_not_fault),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
