/* Per-thread scratch memory for CPU kernels, so that a compiled step allocates nothing after
 * its first run. Each thread has AG__SCRATCH_SLOTS slots; ag__scratch(slot, bytes) returns the
 * slot's 64-byte-aligned block, replacing it (through ag__malloc_data, contents not kept) only
 * when a larger size is asked, so a kernel that runs again on the same shapes reuses the block
 * of its first run. Blocks are freed when their thread exits, by ag__scratch_release_all, and,
 * for the thread that calls exit(), by a library destructor, so leak checkers see a clean heap.
 * Blocks are freed through the allocator hook installed at that time, like every other
 * allocation of the library. The same exit hook frees the other per-thread caches (the
 * autograd engine's kept memory, the spare custom node), each through the release function
 * its owner registered (ag__thread_caches_register). Two helpers build temporary tensors without
 * allocating: a contiguous tensor over a slot (ag__scratch_tensor_new, ag__scratch_contiguous) and
 * a view of another tensor's storage in a struct on the caller's stack (ag__tensor_view_tmp).
 *
 * Rules for kernels:
 *   - A block is valid until the next ag__scratch call with the same slot on the same thread:
 *     two buffers needed at once use two slots, and a kernel never calls code that takes a slot
 *     it is holding. Kernels never call other kernels through the dispatcher, so the slots
 *     below only have to be distinct within one kernel and the helpers it calls.
 *   - OpenMP worker threads have thread-locals of their own: a kernel with a parallel region
 *     takes ONE block from the calling thread before the region, sized for every thread
 *     (omp_get_max_threads() or its num_threads), and each thread uses its region of it
 *     (omp_get_thread_num()).
 *   - A failure returns NULL with AG_ENOMEM set; the slot is then empty.
 *
 * Slot use, per kernel (file: kernels -> slot: buffer):
 *   reduce_kernels.c  sum, mean, amax, var, logsumexp -> 0: per-output double (or int64)
 *                       results, with the mean of var and the max of logsumexp; 1: per-chunk
 *                       partials of run_reduce and col_sum (called while 0 is held).
 *                     _softmax, _log_softmax, their backward data -> 0: per-thread gathered
 *                       rows (strided rows only).
 *                     argmax without dim -> 0: contiguous copy of a strided input.
 *   reduce.c          sum / mean with a dtype argument -> 2: the input converted to it (held
 *                       while the reduction uses 0 and 1).
 *   conv.c            convolution -> 0: per-thread im2col columns; 1, 2: contiguous copies of
 *                       input, weight (strided only).
 *                     convolution_backward -> 0: per-thread columns and weight-gradient
 *                       accumulators; 1, 2, 3: contiguous grad_output, input, weight.
 *                     max_pool2d_with_indices, avg_pool2d, _adaptive_avg_pool2d and their
 *                       backward -> 1 (and 2 for max pooling's indices): contiguous copies.
 *   views.c           slice_backward, select_backward, as_strided_scatter -> none (their
 *                       destination is a view on the stack).
 *   index.c           cat, stack, split.Tensor -> none: their slices are views on the stack.
 *                     index_select, index_add, gather, scatter_add -> 0: the wrapped index
 *                       values; 1: contiguous source (index_select, index_add).
 *                     index.Tensor, index_put, index_put_ -> 0: pre offsets; 1: post offsets;
 *                       2: broadcast offsets; 3: one index's values broadcast; 4: a mask's
 *                       coordinates; 5: index_put's values broadcast to the indexed shape.
 *   nn_ops.c          embedding -> 1: contiguous indices.
 *                     embedding_dense_backward -> 1, 2: contiguous grad, indices; 3: per-row
 *                       counts (scale_grad_by_freq).
 *                     nll_loss_forward, nll_loss_backward -> 1: contiguous target.
 *                     _scaled_dot_product_flash_attention_for_cpu (+ _backward) -> 0:
 *                       per-thread score matrices; 1, 2, 3, 4: packed query, key, value,
 *                       grad_output; 5: contiguous logsumexp (backward).
 *   norm.c            native_layer_norm -> 1, 2, 3: contiguous input, weight, bias.
 *                     native_layer_norm_backward -> 1 to 5: contiguous grad, input, mean,
 *                       rstd, weight.
 *                     native_batch_norm (and the functional form) -> 1: contiguous input.
 *                     native_batch_norm_backward -> 1, 2: contiguous grad, input.
 *   linalg.c          mm, bmm, addmm -> 0, 1: copies of operands whose layout BLAS
 *                       cannot read.
 *   pointwise.c       kernels with an operand of another dtype than the computation's -> 0,
 *                       1: first and second operand converted.
 *   flex_attention.c  (src/autograd) ag_flex_attention and its backward -> 6: the partial
 *                       tiles' masks and their index (filled while the user's mask_mod runs
 *                       ops, which take slots 0-5 only); 7: per-thread tile workspaces (held
 *                       while a score_mod runs ops). */
#include "internal.h"

#include <assert.h>
#include <pthread.h>

/* The part of a block past the size asked for is poisoned, so that a kernel reading or writing
 * beyond its request is caught as if the block were exactly that size. */
#include "asan.h"

typedef struct scratch_slot {
    void *p;
    size_t cap; /* bytes, a multiple of AG_ALIGN */
} scratch_slot;

static _Thread_local scratch_slot slots[AG__SCRATCH_SLOTS];
static _Thread_local bool registered; /* this thread's slots are known to the exit key */

static pthread_key_t exit_key;
static pthread_once_t exit_once = PTHREAD_ONCE_INIT;
static bool exit_key_ok;

static void release(scratch_slot *s) {
    for (int i = 0; i < AG__SCRATCH_SLOTS; i++) {
        if (s[i].p) {
            AG__UNPOISON(s[i].p, s[i].cap);
            ag__free_data(s[i].p, s[i].cap);
        }
        s[i].p = NULL;
        s[i].cap = 0;
    }
}

/* The release functions of the other per-thread caches, process-wide, in registration order. */
#define MAX_CACHE_KINDS 4
static void (*_Atomic cache_releases[MAX_CACHE_KINDS])(void);

static void release_caches(void) {
    for (int i = 0; i < MAX_CACHE_KINDS; i++) {
        void (*f)(void) = atomic_load(&cache_releases[i]);
        if (f)
            f();
    }
}

/* Runs at the exit of a thread that took scratch; `v` is that thread's slots array. */
static void on_thread_exit(void *v) {
    release(v);
    release_caches();
}

static void make_exit_key(void) {
    exit_key_ok = pthread_key_create(&exit_key, on_thread_exit) == 0;
}

static void register_thread(void) {
    if (!registered) {
        pthread_once(&exit_once, make_exit_key);
        if (exit_key_ok)
            pthread_setspecific(exit_key, slots);
        registered = true;
    }
}

void ag__thread_caches_register(void (*release_fn)(void)) {
    for (int i = 0; i < MAX_CACHE_KINDS; i++) {
        void (*cur)(void) = atomic_load(&cache_releases[i]);
        if (cur == release_fn)
            break;
        if (!cur && atomic_compare_exchange_strong(&cache_releases[i], &cur, release_fn))
            break;
        if (cur == release_fn) /* another thread registered it first */
            break;
        /* the kinds are the library's own few: the table never fills */
        assert(i < MAX_CACHE_KINDS - 1);
    }
    register_thread();
}

void ag__thread_caches_release(void) {
    release_caches();
}

void *ag__scratch(int slot, size_t bytes) {
    if (slot < 0 || slot >= AG__SCRATCH_SLOTS) {
        ag__err(AG_EINVAL, "scratch: slot %d out of range [0, %d)", slot, AG__SCRATCH_SLOTS);
        return NULL;
    }
    scratch_slot *s = &slots[slot];
    if (bytes > SIZE_MAX - AG_ALIGN) {
        ag__err(AG_ENOMEM, "scratch: %zu bytes is too large", bytes);
        return NULL;
    }
    if (bytes > s->cap || !s->p) {
        size_t cap = (bytes + AG_ALIGN - 1) / AG_ALIGN * AG_ALIGN;
        if (cap == 0)
            cap = AG_ALIGN;
        /* Free first: the old contents are not needed, and the peak stays one block. */
        if (s->p) {
            AG__UNPOISON(s->p, s->cap);
            ag__free_data(s->p, s->cap);
        }
        s->p = NULL;
        s->cap = 0;
        void *p = ag__malloc_data(cap);
        if (!p)
            return NULL;
        register_thread();
        s->p = p;
        s->cap = cap;
    }
    AG__UNPOISON(s->p, bytes);
    AG__POISON((char *)s->p + bytes, s->cap - bytes);
    return s->p;
}

void ag__scratch_release_all(void) {
    release(slots);
}

/* The thread running exit() (usually the main thread) gets no key destructor call. */
__attribute__((destructor)) static void scratch_fini(void) {
    ag__scratch_release_all();
    ag__thread_caches_release();
}

ag_tensor *ag__scratch_tensor_new(ag__scratch_tensor *tmp, int slot, ag_dtype dt, int ndim,
                                  const int64_t *sizes) {
    size_t nbytes = (size_t)ag__numel(ndim, sizes) * ag_dtype_size(dt);
    void *data = ag__scratch(slot, nbytes);
    if (!data)
        return NULL;
    memset(tmp, 0, sizeof *tmp);
    ag_tmeta m;
    ag__tmeta_contiguous(&m, dt, ndim, sizes);
    tmp->s = (ag_storage){.refcount = 1, .data = data, .nbytes = nbytes, .version = 0};
    tmp->t.refcount = 1;
    tmp->t.dtype = dt;
    tmp->t.ndim = ndim;
    memcpy(tmp->t.sizes, m.sizes, sizeof tmp->t.sizes);
    memcpy(tmp->t.strides, m.strides, sizeof tmp->t.strides);
    tmp->t.storage = &tmp->s;
    return &tmp->t;
}

ag_tensor *ag__tensor_view_tmp(ag_tensor *v, const ag_tensor *t, const ag_tmeta *m) {
    memset(v, 0, sizeof *v);
    v->refcount = 1;
    v->dtype = m->dtype;
    v->ndim = m->ndim;
    memcpy(v->sizes, m->sizes, sizeof v->sizes);
    memcpy(v->strides, m->strides, sizeof v->strides);
    v->offset = m->offset;
    v->storage = t->storage;
    return v;
}

int ag__scratch_contiguous(ag__scratch_tensor *tmp, int slot, const ag_tensor *src,
                           const ag_tensor **out) {
    *out = src;
    if (!src || ag_tensor_is_contiguous(src))
        return 0;
    ag_tensor *t = ag__scratch_tensor_new(tmp, slot, src->dtype, src->ndim, src->sizes);
    if (!t)
        return ag_last_status();
    int rc = ag__copy_into(t, src);
    if (rc)
        return rc;
    *out = t;
    return 0;
}
