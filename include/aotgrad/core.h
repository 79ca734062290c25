/* aotgrad core: dtypes, status codes and errors, the allocator hook, tensors and views.
 *
 * Ownership in one paragraph. A tensor is a refcounted handle over a refcounted storage; views
 * share the storage. Every function that returns an `ag_tensor *` returns a new reference that
 * the caller releases with ag_tensor_free(). To keep model code readable there is also an
 * autorelease scope, like Objective-C's autorelease pools: between ag_scope_begin() and
 * ag_scope_end() every tensor returned by an op is owned by the scope instead, so chained calls
 * such as ag_relu(ag_linear(x, w, b)) leak nothing; ag_tensor_keep(t) takes a reference of your
 * own that outlives the scope. Ops given a NULL tensor return NULL and keep the first error
 * message, so a chain can be checked once at its end.
 *
 * NULL arguments, for every public function. No function crashes on a NULL pointer argument.
 * A fallible call (one returning a status or a new object) given a NULL handle or required
 * pointer fails with AG_EINVAL and a message that starts with the call's name, without or
 * (descriptors, pytrees, FX utilities) with its ag_ prefix, and names the parameter
 * ("graph_erase: g is NULL", "plan_run: p is NULL"), with no other effect. Op entry points
 * (ag_add, ag_softmax, ...) name the ATen op they run instead, as all their errors do
 * ("add.Tensor: argument 'other' is NULL", "_softmax: argument 'self' is NULL"). They, and
 * the module calls given a NULL tensor or child (ag_module_register_parameter, _buffer,
 * ag_module_add_child, ag_nn_append, ag_module_call, ag_module_forward), keep an earlier
 * error's message instead, so the first failure of a chain is the one reported. Destructors and
 * releases (ag_tensor_free, ag_graph_free, ...) accept NULL as a no-op. Accessors and predicates of
 * a NULL handle (ag_tensor_ndim, ag_node_name, ag_joint_num_params, ...) return a neutral value (0,
 * -1 for indices, false, NULL) and leave the error state alone, so they can sit inside expressions.
 * Where NULL means something else (a default, an empty list with n == 0), the function's comment
 * says so. tests/test_api_contract.c calls every public function taking a pointer with NULLs,
 * tests/test_api_null_args.c the main entry points of each family with one NULL at a time. */
#ifndef AOTGRAD_CORE_H
#define AOTGRAD_CORE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(AG_BUILDING_LIBRARY) && defined(__GNUC__)
#define AG_API __attribute__((visibility("default")))
#else
#define AG_API
#endif

/* The version of the headers compiled against; ag_version() says the library's at run time
 * (they differ when a program runs against another build of libaotgrad than it was compiled
 * with). CMakeLists.txt's project(VERSION) must agree (configuring checks it). */
#define AG_VERSION_MAJOR 0
#define AG_VERSION_MINOR 1
#define AG_VERSION_PATCH 0
#define AG_VERSION_STRING "0.1.0"

/* The running library's version, "MAJOR.MINOR.PATCH" ("0.1.0"): a static string, never NULL,
 * owned by the library (do not free). */
AG_API const char *ag_version(void);

#define AG_MAX_DIMS 8

/* Status codes. 0 is success; every failure is negative and sets ag_last_error(). */
enum {
    AG_OK = 0,
    AG_EINVAL = -1,  /* bad argument: shape, dtype, range */
    AG_ENOMEM = -2,  /* the allocator hook returned NULL */
    AG_ESTATE = -3,  /* call not valid in this state (e.g. backward twice) */
    AG_EIO = -4,     /* file could not be read or written */
    AG_EFORMAT = -5, /* file contents malformed */
    AG_ENOTSUP = -6, /* not supported (dtype without kernel, ...) */
};

typedef enum ag_dtype {
    AG_F32 = 0,
    AG_F64 = 1,
    AG_I64 = 2,
    AG_BOOL = 3,
    AG_I8 = 4, /* storage only (quantized data): copies and conversions, no arithmetic */
    AG_NDTYPES
} ag_dtype;

/* "f32", "f64", "i64", "b8", "i8" (the graph printer's spelling) and "float32", ... */
AG_API const char *ag_dtype_short(ag_dtype dt);
AG_API const char *ag_dtype_name(ag_dtype dt);
AG_API size_t ag_dtype_size(ag_dtype dt);
AG_API bool ag_dtype_is_float(ag_dtype dt);

/* ---- errors ---- */

/* The message of the last failed call on this thread ("" if none). Owned by the library. */
AG_API const char *ag_last_error(void);
/* The status code of the last failed call on this thread (0 if none). */
AG_API int ag_last_status(void);
AG_API void ag_clear_error(void);
/* Sets this thread's error, as a failing library call does, and returns status (a status that
 * is not negative becomes AG_EINVAL): for code the library calls back (a graph compiler, a
 * partition function, a custom op's kernel or meta function) to say why it failed. printf-style
 * fmt; the message is truncated at 1023 bytes. */
AG_API int ag_set_error(int status, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* ---- allocation ---- */

/* Every allocation of the library (tensor data, tensor structs, autograd nodes, lists) goes
 * through this hook. alloc must return memory aligned to `align` (a power of two: 64 for tensor
 * data and blocks of 256 bytes or more, 16 for smaller bookkeeping) or NULL; free accepts NULL.
 * The default uses aligned_alloc/free, and keeps freed tensor data of 64 KiB or more in a cache
 * (at most a quarter of physical memory) to hand out again for a request of the
 * same size class (within a quarter above it), so that repeated steps do not fault their memory
 * in again. A hook sees every allocation with the size asked and every free: setting one
 * releases the cache and bypasses it. Set it before creating any tensor; tensors must be freed
 * by the hook that allocated them. The hook is process-wide and its functions are called from
 * every thread that uses the library (and from OpenMP workers), so they must be thread-safe;
 * ag_set_allocator itself is not: call it while no other thread is inside the library. */
typedef struct ag_allocator {
    void *(*alloc)(void *ud, size_t size, size_t align);
    void (*free)(void *ud, void *ptr);
    void *ud;
} ag_allocator;

AG_API void ag_set_allocator(const ag_allocator *a); /* NULL restores the default */
/* Frees memory the library returned to the caller (strings such as ag_graph_to_string's). */
AG_API void ag_free(void *p);
AG_API ag_allocator ag_get_allocator(void);
/* Returns every block the default allocator's cache holds to the system (the cache fills again
 * as tensors are freed); it is also released at process exit. Safe to call from any thread, at
 * any time, as are the allocations and frees the cache serves. */
AG_API void ag_allocator_release_cache(void);

/* ---- tensors ---- */

typedef struct ag_tensor ag_tensor;

/* Constructors. Each returns a new reference (or, inside a scope, a scope-owned one) or NULL. */
AG_API ag_tensor *ag_empty(ag_dtype dt, int ndim, const int64_t *sizes);
AG_API ag_tensor *ag_zeros(ag_dtype dt, int ndim, const int64_t *sizes);
AG_API ag_tensor *ag_ones(ag_dtype dt, int ndim, const int64_t *sizes);
AG_API ag_tensor *ag_full(ag_dtype dt, int ndim, const int64_t *sizes, double value);
AG_API ag_tensor *ag_arange(ag_dtype dt, double start, double end, double step);
/* Copies `data` (ndim sizes, contiguous, of dtype dt). */
AG_API ag_tensor *ag_from_data(ag_dtype dt, int ndim, const int64_t *sizes, const void *data);
AG_API ag_tensor *ag_scalar_tensor(ag_dtype dt, double value); /* 0-dim */

/* Releases one reference; NULL is a no-op. */
AG_API void ag_tensor_free(ag_tensor *t);
/* Takes a reference owned by the caller (escapes any scope); returns t. */
AG_API ag_tensor *ag_tensor_keep(ag_tensor *t);

/* Autorelease scopes (nest). ag_scope_end releases every tensor the scope owns. */
AG_API void ag_scope_begin(void);
AG_API void ag_scope_end(void);

/* Metadata. The pointers returned stay valid while the tensor lives. */
AG_API ag_dtype ag_tensor_dtype(const ag_tensor *t);
AG_API int ag_tensor_ndim(const ag_tensor *t);
AG_API const int64_t *ag_tensor_sizes(const ag_tensor *t);
AG_API const int64_t *ag_tensor_strides(const ag_tensor *t);
AG_API int64_t ag_tensor_size(const ag_tensor *t, int dim); /* negative dim counts from the end */
AG_API int64_t ag_tensor_offset(const ag_tensor *t);
AG_API int64_t ag_tensor_numel(const ag_tensor *t);
AG_API bool ag_tensor_is_contiguous(const ag_tensor *t);
/* Pointer to element [0,...,0] (storage + offset); NULL for meta tensors. Writing through it
 * bypasses autograd's version checks: call ag_tensor_bump_version() after in-place writes. */
AG_API void *ag_tensor_data(const ag_tensor *t);
AG_API bool ag_tensor_same_storage(const ag_tensor *a, const ag_tensor *b);
/* PyTorch's ._base: the tensor a view op's output was made from (the root of a chain of
 * views), borrowed; NULL for a tensor that is not such a view (detach makes none). */
AG_API ag_tensor *ag_tensor_base(const ag_tensor *t);
AG_API uint64_t ag_tensor_version(const ag_tensor *t);
AG_API void ag_tensor_bump_version(ag_tensor *t);
/* Element read as double, by flat row-major index over the (possibly strided) view. */
AG_API double ag_tensor_item_at(const ag_tensor *t, int64_t flat_index);
AG_API double ag_tensor_item(const ag_tensor *t); /* a one-element tensor */
/* Copies the elements into `out` as doubles (numel of them), row-major. */
AG_API int ag_tensor_to_doubles(const ag_tensor *t, double *out);
/* "f32[2, 3]" into buf; returns buf. */
AG_API char *ag_tensor_meta_str(const ag_tensor *t, char *buf, size_t n);
/* Prints shape and values (at most `max_elems`) to stdout, for debugging. */
AG_API void ag_tensor_print(const ag_tensor *t, const char *name, int max_elems);

/* ---- autograd flags on tensors ---- */
AG_API int ag_tensor_set_requires_grad(ag_tensor *t, bool requires_grad); /* leaves only */
AG_API bool ag_tensor_requires_grad(const ag_tensor *t);
AG_API bool ag_tensor_is_leaf(const ag_tensor *t);
/* The accumulated gradient of a leaf, borrowed (NULL if none yet). */
AG_API ag_tensor *ag_tensor_grad(const ag_tensor *t);
/* Replaces .grad (NULL clears it); the tensor takes its own reference to g. */
AG_API int ag_tensor_set_grad(ag_tensor *t, ag_tensor *g);
/* A new tensor sharing storage with t, outside the autograd graph. Given NULL it keeps an
 * earlier error, as ops do, so ag_detach(ag_relu(x)) reports relu's failure. */
AG_API ag_tensor *ag_detach(ag_tensor *t);

/* ---- random numbers (Philox-4x32-10, counter based) ---- */

/* The default generator's state. Each draw of n values consumes a whole number of 128-bit
 * counters starting at `offset` and advances it; the values depend only on (seed, offset,
 * index), never on the thread count. Each thread has its own default generator, starting at
 * seed 0x5eed, offset 0 (torch has one per process): these calls set or read the calling
 * thread's, so a thread's draws do not depend on what other threads seed or draw, and a thread
 * you start does not inherit the seed of the thread that started it. */
AG_API void ag_manual_seed(uint64_t seed);
AG_API void ag_rng_get_state(uint64_t *seed, uint64_t *offset);
AG_API void ag_rng_set_state(uint64_t seed, uint64_t offset);

/* ---- threads ----
 * The number of OpenMP threads that kernels and GEMM use (see "Threads" in aotgrad.h).
 * Like OpenMP's omp_set_num_threads it sets the calling thread's count: kernels run on the
 * OpenMP pool of the thread that calls them, and a thread you start begins with the default
 * (OMP_NUM_THREADS, else one per processor). AG_EINVAL, and nothing changed, for n < 1 or n
 * above 8 per processor (or above OMP_THREAD_LIMIT). ag_get_num_threads: the calling thread's
 * count. */
AG_API int ag_set_num_threads(int n);
AG_API int ag_get_num_threads(void);

#ifdef __cplusplus
}
#endif
#endif
