/* Tests of the per-thread kernel scratch (src/core/scratch.c) and of the property it exists
 * for: a kernel called again on the same shapes allocates nothing but its outputs.
 *
 *   1. The API: 64-byte alignment, growth only when a larger size is asked (one allocation,
 *      the old block freed), reuse of the same block for equal or smaller sizes, independent
 *      slots, an out-of-range slot, allocation failure (NULL with AG_ENOMEM, the slot usable
 *      again afterwards), release by ag__scratch_release_all and at thread exit, and the
 *      scratch-tensor helpers.
 *   2. Zero allocation: sum over dim 0, convolution and convolution_backward (contiguous and
 *      strided inputs), split.Tensor + cat + stack, the view backward helpers (slice_backward,
 *      select_backward, as_strided_scatter) and the flash-attention op with its backward are
 *      called through ag_op_call twice to warm up; during a third call a counting allocator
 *      must see exactly the allocations of the op's output tensors (what ag__tensor_new costs,
 *      measured here, per output), and the third call's results must equal the first's bit
 *      for bit (stale scratch contents must not leak into results).
 *   3. Allocation failures on a cold cache: the failure sweep over about twenty kernels that
 *      take scratch (reductions, softmax, argmax, convolution, pooling, joins, indexing,
 *      attention, layer norm, mm on a layout BLAS cannot read, mixed-dtype add, embedding
 *      backward), each run starting and ending with an empty cache. */
#include "testutil.h"
#include "core/internal.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#define SZ(...) ((int64_t[]){__VA_ARGS__})

/* ---- a counting allocator with failure injection ---- */

static struct {
    ag_allocator prev;
    _Atomic int64_t allocs, frees;
    _Atomic bool fail; /* every allocation fails while set */
} ca;

static void *c_alloc(void *ud, size_t size, size_t align) {
    (void)ud;
    if (atomic_load(&ca.fail))
        return NULL;
    atomic_fetch_add(&ca.allocs, 1);
    return ca.prev.alloc(ca.prev.ud, size, align);
}

static void c_free(void *ud, void *p) {
    (void)ud;
    if (p)
        atomic_fetch_add(&ca.frees, 1);
    ca.prev.free(ca.prev.ud, p);
}

static void count_begin(void) {
    ca.prev = ag_get_allocator();
    atomic_store(&ca.allocs, 0);
    atomic_store(&ca.frees, 0);
    atomic_store(&ca.fail, false);
    ag_set_allocator(&(ag_allocator){c_alloc, c_free, NULL});
}

static void count_end(void) {
    ag_set_allocator(&ca.prev);
    atomic_store(&ca.fail, false);
}

static bool aligned64(const void *p) {
    return ((uintptr_t)p & 63) == 0;
}

/* ---- 1. the API ---- */

static void test_alignment_growth_reuse(void **st) {
    (void)st;
    ag__scratch_release_all();
    count_begin();
    char *a = ag__scratch(0, 100);
    assert_non_null(a);
    assert_true(aligned64(a));
    assert_int_equal(atomic_load(&ca.allocs), 1);
    memset(a, 1, 100);
    /* Equal and smaller sizes: the same block, no allocation. */
    assert_ptr_equal(ag__scratch(0, 100), a);
    assert_ptr_equal(ag__scratch(0, 1), a);
    assert_ptr_equal(ag__scratch(0, 0), a);
    assert_ptr_equal(ag__scratch(0, 64), a);
    assert_int_equal(atomic_load(&ca.allocs), 1);
    assert_int_equal(atomic_load(&ca.frees), 0);
    /* Larger: one new block, the old one freed; the new one is fully writable. */
    char *b = ag__scratch(0, 100000);
    assert_non_null(b);
    assert_true(aligned64(b));
    memset(b, 2, 100000);
    assert_int_equal(atomic_load(&ca.allocs), 2);
    assert_int_equal(atomic_load(&ca.frees), 1);
    assert_ptr_equal(ag__scratch(0, 5000), b);
    assert_ptr_equal(ag__scratch(0, 100000), b);
    assert_int_equal(atomic_load(&ca.allocs), 2);
    /* Other slots are independent blocks, each aligned, none overlapping. */
    char *p[AG__SCRATCH_SLOTS];
    for (int s = 0; s < AG__SCRATCH_SLOTS; s++) {
        size_t n = 64 * (size_t)(s + 1) + 3; /* odd sizes still give aligned blocks */
        p[s] = ag__scratch(s, n);
        assert_non_null(p[s]);
        assert_true(aligned64(p[s]));
        memset(p[s], s, n);
    }
    assert_ptr_equal(p[0], b);
    for (int s = 1; s < AG__SCRATCH_SLOTS; s++)
        for (int k = 0; k < 64 * (s + 1) + 3; k++)
            assert_int_equal(p[s][k], s);
    assert_int_equal(atomic_load(&ca.allocs), 2 + AG__SCRATCH_SLOTS - 1);
    /* Release frees every block; the next request allocates again. */
    ag__scratch_release_all();
    assert_int_equal(atomic_load(&ca.frees), atomic_load(&ca.allocs));
    ag__scratch_release_all(); /* nothing left: harmless */
    assert_int_equal(atomic_load(&ca.frees), atomic_load(&ca.allocs));
    assert_non_null(ag__scratch(3, 10));
    assert_int_equal(atomic_load(&ca.allocs), 2 + AG__SCRATCH_SLOTS);
    ag__scratch_release_all();
    assert_int_equal(atomic_load(&ca.frees), atomic_load(&ca.allocs));
    count_end();
}

static void test_bad_slot(void **st) {
    (void)st;
    ag_clear_error();
    assert_null(ag__scratch(-1, 8));
    assert_int_equal(ag_last_status(), AG_EINVAL);
    tu_assert_error_contains("slot -1");
    ag_clear_error();
    assert_null(ag__scratch(AG__SCRATCH_SLOTS, 8));
    assert_int_equal(ag_last_status(), AG_EINVAL);
}

static void test_allocation_failure(void **st) {
    (void)st;
    ag__scratch_release_all();
    count_begin();
    char *a = ag__scratch(1, 256);
    assert_non_null(a);
    atomic_store(&ca.fail, true);
    /* No growth needed: no allocation, so no failure. */
    ag_clear_error();
    assert_ptr_equal(ag__scratch(1, 200), a);
    assert_int_equal(ag_last_status(), 0);
    /* Growth fails cleanly: NULL, AG_ENOMEM, the old block freed (the slot is empty). */
    assert_null(ag__scratch(1, 1 << 20));
    assert_int_equal(ag_last_status(), AG_ENOMEM);
    assert_int_equal(atomic_load(&ca.frees), atomic_load(&ca.allocs));
    /* An empty slot asks again, and fails again, while the allocator fails. */
    ag_clear_error();
    assert_null(ag__scratch(1, 1));
    assert_int_equal(ag_last_status(), AG_ENOMEM);
    /* The scratch-tensor helpers report it too. */
    ag_clear_error();
    ag__scratch_tensor tmp;
    assert_null(ag__scratch_tensor_new(&tmp, 1, AG_F32, 2, SZ(4, 4)));
    assert_int_equal(ag_last_status(), AG_ENOMEM);
    atomic_store(&ca.fail, false);
    /* Usable again once allocation works. */
    char *b = ag__scratch(1, 1 << 20);
    assert_non_null(b);
    assert_true(aligned64(b));
    memset(b, 0, 1 << 20);
    ag__scratch_release_all();
    assert_int_equal(atomic_load(&ca.frees), atomic_load(&ca.allocs));
    count_end();
}

static void *thread_body(void *ud) {
    (void)ud;
    void *p = ag__scratch(0, 4096);
    void *q = ag__scratch(5, 100);
    memset(p, 7, 4096);
    memset(q, 7, 100);
    return (p && q) ? p : NULL;
}

/* Blocks of a thread that exits are freed with it. */
static void test_release_at_thread_exit(void **st) {
    (void)st;
    count_begin();
    pthread_t th;
    void *res = NULL;
    assert_int_equal(pthread_create(&th, NULL, thread_body, NULL), 0);
    assert_int_equal(pthread_join(th, &res), 0);
    assert_non_null(res);
    assert_int_equal(atomic_load(&ca.allocs), 2);
    assert_int_equal(atomic_load(&ca.frees), 2);
    count_end();
}

static void test_scratch_tensors(void **st) {
    (void)st;
    ag_tensor *x = tu_tensor(AG_F64, 2, SZ(2, 3), (double[]){1, 2, 3, 4, 5, 6});
    ag_tensor *xt = ag_t(x); /* (3, 2), strided */
    ag__scratch_tensor tmp;
    const ag_tensor *c = NULL;
    /* Contiguous: itself, no copy. */
    assert_int_equal(ag__scratch_contiguous(&tmp, 2, x, &c), 0);
    assert_ptr_equal(c, x);
    assert_int_equal(ag__scratch_contiguous(&tmp, 2, NULL, &c), 0);
    assert_null(c);
    /* Strided: a contiguous copy in slot 2 with the same values. */
    assert_int_equal(ag__scratch_contiguous(&tmp, 2, xt, &c), 0);
    assert_ptr_equal(c, &tmp.t);
    assert_true(ag_tensor_is_contiguous(c));
    assert_ptr_equal(ag_tensor_data(c), ag__scratch(2, 6 * sizeof(double)));
    assert_true(aligned64(ag_tensor_data(c)));
    tu_assert_values(c, 2, SZ(3, 2), (double[]){1, 4, 2, 5, 3, 6}, 0);
    /* A fresh (dtype, sizes) tensor over a slot. */
    ag_tensor *t = ag__scratch_tensor_new(&tmp, 4, AG_I64, 3, SZ(2, 3, 4));
    assert_non_null(t);
    assert_int_equal(ag_tensor_numel(t), 24);
    assert_int_equal(ag_tensor_dtype(t), AG_I64);
    assert_true(ag_tensor_is_contiguous(t));
    assert_ptr_equal(ag_tensor_data(t), ag__scratch(4, 24 * sizeof(int64_t)));
    ag_tensor_free(xt);
    ag_tensor_free(x);
}

/* ---- 2. no allocation after warm-up ---- */

/* Allocations ag__tensor_new makes for one output (tensor struct, storage struct, data). */
static int64_t tensor_cost(void) {
    count_begin();
    ag_tensor *t = ag__tensor_new(AG_F32, 2, SZ(3, 5), false);
    int64_t n = atomic_load(&ca.allocs);
    ag_tensor_free(t);
    count_end();
    assert_non_null(t);
    return n;
}

typedef struct call {
    const char *op;
    ag_arg args[AG_MAX_ARGS];
    int nargs;
    int nouts; /* outputs it makes */
} call;

/* Runs the calls in order; outs gets every output (the caller frees them). */
static void run_calls(call *c, int n, ag_tensor **outs, int *nouts) {
    *nouts = 0;
    for (int i = 0; i < n; i++) {
        const ag_op *op = ag_op_find(c[i].op);
        assert_non_null(op);
        int rc = ag_op_call(op, c[i].args, c[i].nargs, outs + *nouts);
        if (rc < 0)
            fail_msg("%s: %s", c[i].op, ag_last_error());
        *nouts += c[i].nouts;
    }
}

static void assert_bits_equal(const ag_tensor *a, const ag_tensor *b, const char *what) {
    assert_int_equal(ag_tensor_numel(a), ag_tensor_numel(b));
    size_t n = (size_t)ag_tensor_numel(a) * ag_dtype_size(ag_tensor_dtype(a));
    if (n && memcmp(ag_tensor_data(a), ag_tensor_data(b), n) != 0)
        fail_msg("%s: third call differs from the first", what);
}

/* Calls the sequence three times; the third may allocate its outputs and nothing else. */
static void expect_outputs_only(const char *what, call *c, int n) {
    const int64_t per = tensor_cost(); /* 3 today: tensor, storage, data */
    assert_true(per >= 1);
    ag_tensor *first[16], *second[16], *third[16];
    int n1, n2, n3;
    run_calls(c, n, first, &n1);
    run_calls(c, n, second, &n2);
    for (int i = 0; i < n2; i++)
        ag_tensor_free(second[i]);
    count_begin();
    run_calls(c, n, third, &n3);
    int64_t got = atomic_load(&ca.allocs);
    count_end();
    assert_int_equal(n1, n3);
    if (got != per * n3)
        fail_msg("%s: %lld allocations for %d outputs (expected %lld)", what, (long long)got, n3,
                 (long long)(per * n3));
    for (int i = 0; i < n1; i++) {
        assert_bits_equal(first[i], third[i], what);
        ag_tensor_free(first[i]);
        ag_tensor_free(third[i]);
    }
}

static uint64_t rng = 0x9E3779B97F4A7C15ull;

static ag_tensor *rnd(int ndim, const int64_t *sizes) {
    return tu_rand_tensor(AG_F32, ndim, sizes, -1, 1, tu_xorshift, &rng);
}

/* A random tensor of `sizes` with dims d0 and d1 swapped: a strided view (its base released). */
static ag_tensor *rnd_transposed(int ndim, const int64_t *sizes, int d0, int d1) {
    ag_tensor *base = rnd(ndim, sizes);
    ag_tensor *t = ag_transpose(base, d0, d1);
    ag_tensor_free(base);
    assert_false(ag_tensor_is_contiguous(t));
    return t;
}

static void test_sum_dim0(void **st) {
    (void)st;
    ag_tensor *x = rnd(2, SZ(64, 32));
    int64_t dim0[] = {0};
    call c[] = {{"sum.dim_IntList", {AG_A_T(x), AG_A_INTS(dim0, 1), AG_A_B(false)}, 3, 1}};
    expect_outputs_only("sum over dim 0", c, 1);
    /* A large one takes the chunked paths with per-chunk partials (slot 1). */
    ag_tensor *big = rnd(2, SZ(4096, 24));
    c[0].args[0] = AG_A_T(big);
    expect_outputs_only("sum over dim 0, 4096 rows", c, 1);
    ag_tensor_free(big);
    ag_tensor_free(x);
}

static void conv_calls(call *c, ag_tensor *x, ag_tensor *w, ag_tensor *b, ag_tensor *g) {
    static int64_t one[2] = {1, 1}, zero[2] = {0, 0}, bias_sizes[1] = {4}, mask[3] = {1, 1, 1};
    c[0] = (call){"convolution",
                  {AG_A_T(x), AG_A_T(w), AG_A_T(b), AG_A_INTS(one, 2), AG_A_INTS(one, 2),
                   AG_A_INTS(one, 2), AG_A_B(false), AG_A_INTS(zero, 2), AG_A_I(1)},
                  9,
                  1};
    c[1] = (call){"convolution_backward",
                  {AG_A_T(g), AG_A_T(x), AG_A_T(w), AG_A_INTS(bias_sizes, 1), AG_A_INTS(one, 2),
                   AG_A_INTS(one, 2), AG_A_INTS(one, 2), AG_A_B(false), AG_A_INTS(zero, 2),
                   AG_A_I(1), AG_A_INTS(mask, 3)},
                  11,
                  3};
}

static void test_convolution(void **st) {
    (void)st;
    ag_tensor *x = rnd(4, SZ(8, 3, 12, 12)), *w = rnd(4, SZ(4, 3, 3, 3)), *b = rnd(1, SZ(4));
    ag_tensor *g = rnd(4, SZ(8, 4, 12, 12));
    call c[2];
    conv_calls(c, x, w, b, g);
    expect_outputs_only("convolution", c, 1);
    expect_outputs_only("convolution_backward", c + 1, 1);
    expect_outputs_only("convolution + convolution_backward", c, 2);
    /* Strided input, weight and grad_output: their contiguous copies are scratch too. */
    ag_tensor *xs = rnd_transposed(4, SZ(8, 3, 12, 12), 2, 3);
    ag_tensor *ws = rnd_transposed(4, SZ(4, 3, 3, 3), 2, 3);
    ag_tensor *gs = rnd_transposed(4, SZ(8, 4, 12, 12), 2, 3);
    conv_calls(c, xs, ws, b, gs);
    expect_outputs_only("strided convolution + convolution_backward", c, 2);
    ag_tensor_free(xs);
    ag_tensor_free(ws);
    ag_tensor_free(gs);
    ag_tensor_free(x);
    ag_tensor_free(w);
    ag_tensor_free(b);
    ag_tensor_free(g);
}

static void test_split_cat(void **st) {
    (void)st;
    ag_tensor *x = rnd(3, SZ(4, 10, 6));
    ag_tensor *parts[3];
    const ag_op *split = ag_op_find("split.Tensor");
    assert_int_equal(ag_op_call(split, (ag_arg[]){AG_A_T(x), AG_A_I(4), AG_A_I(1)}, 3, parts), 3);
    call c[] = {
        {"split.Tensor", {AG_A_T(x), AG_A_I(4), AG_A_I(1)}, 3, 3},
        {"cat", {AG_A_TS(parts, 3), AG_A_I(1)}, 2, 1},
        {"stack", {AG_A_TS(parts, 2), AG_A_I(0)}, 2, 1},
    };
    expect_outputs_only("split.Tensor + cat + stack", c, 3);
    /* The view backward helpers write through views of their output. */
    ag_tensor *g = rnd(3, SZ(4, 3, 6)), *g1 = rnd(2, SZ(4, 6)), *src = rnd(2, SZ(3, 2));
    static int64_t in_sizes[] = {4, 10, 6}, as_size[] = {3, 2}, as_stride[] = {6, 1};
    call v[] = {
        {"slice_backward",
         {AG_A_T(g), AG_A_INTS(in_sizes, 3), AG_A_I(1), AG_A_I(2), AG_A_I(8), AG_A_I(2)},
         6,
         1},
        {"select_backward", {AG_A_T(g1), AG_A_INTS(in_sizes, 3), AG_A_I(1), AG_A_I(7)}, 4, 1},
        {"as_strided_scatter",
         {AG_A_T(x), AG_A_T(src), AG_A_INTS(as_size, 2), AG_A_INTS(as_stride, 2), AG_A_I(5)},
         5,
         1},
    };
    expect_outputs_only("slice_backward + select_backward + as_strided_scatter", v, 3);
    ag_tensor_free(g);
    ag_tensor_free(g1);
    ag_tensor_free(src);
    for (int i = 0; i < 3; i++)
        ag_tensor_free(parts[i]);
    ag_tensor_free(x);
}

static void test_attention(void **st) {
    (void)st;
    int64_t sz[] = {2, 3, 16, 8};
    ag_tensor *q = rnd(4, sz), *k = rnd(4, sz), *v = rnd(4, sz), *g = rnd(4, sz);
    const ag_op *fwd = ag_op_find("_scaled_dot_product_flash_attention_for_cpu");
    ag_tensor *fo[2];
    ag_arg fargs[] = {AG_A_T(q), AG_A_T(k), AG_A_T(v), AG_A_F(0.0), AG_A_B(true)};
    assert_int_equal(ag_op_call(fwd, fargs, 5, fo), 0);
    call c[] = {
        {"_scaled_dot_product_flash_attention_for_cpu",
         {AG_A_T(q), AG_A_T(k), AG_A_T(v), AG_A_F(0.0), AG_A_B(true)},
         5,
         2},
        {"_scaled_dot_product_flash_attention_for_cpu_backward",
         {AG_A_T(g), AG_A_T(q), AG_A_T(k), AG_A_T(v), AG_A_T(fo[0]), AG_A_T(fo[1]), AG_A_F(0.0),
          AG_A_B(true), AG_A_NONE, AG_A_NONE},
         10,
         3},
    };
    expect_outputs_only("flash attention forward + backward", c, 2);
    /* Query and grad_output whose rows are not contiguous are packed into scratch. */
    ag_tensor *qs = rnd_transposed(4, SZ(2, 3, 8, 16), 2, 3);
    ag_tensor *gs = rnd_transposed(4, SZ(2, 3, 8, 16), 2, 3);
    c[0].args[0] = AG_A_T(qs);
    c[1].args[0] = AG_A_T(gs);
    c[1].args[1] = AG_A_T(qs);
    expect_outputs_only("flash attention with strided query", c, 2);
    ag_tensor *tensors[] = {q, k, v, g, fo[0], fo[1], qs, gs};
    for (size_t i = 0; i < sizeof tensors / sizeof *tensors; i++)
        ag_tensor_free(tensors[i]);
}

/* ---- 3. failures while the scratch is cold ---- */

/* Each run of the sweep starts and ends with an empty cache, so every block is allocated
 * again: each failing allocation (an output or a block) must give AG_ENOMEM, leaking nothing. */
typedef struct cold {
    call *c;
    int n;
} cold;

static int cold_scenario(void *ud) {
    const cold *k = ud;
    ag__scratch_release_all();
    int rc = 0;
    for (int i = 0; i < k->n && rc == 0; i++) {
        ag_tensor *outs[AG_MAX_OUTPUTS] = {0};
        rc = ag_op_call(ag_op_find(k->c[i].op), k->c[i].args, k->c[i].nargs, outs);
        for (int j = 0; j < k->c[i].nouts && rc >= 0; j++)
            ag_tensor_free(outs[j]);
        rc = rc < 0 ? rc : 0;
    }
    ag__scratch_release_all();
    return rc;
}

static void test_cold_scratch_failures(void **st) {
    (void)st;
    ag_tensor *big = rnd(2, SZ(4096, 24)), *x = rnd(2, SZ(64, 32));
    ag_tensor *xt = rnd_transposed(2, SZ(32, 64), 0, 1);
    ag_tensor *cx = rnd(4, SZ(8, 3, 12, 12)), *cw = rnd(4, SZ(4, 3, 3, 3)), *cb = rnd(1, SZ(4));
    ag_tensor *xs = rnd_transposed(4, SZ(8, 3, 12, 12), 2, 3);
    ag_tensor *gs = rnd_transposed(4, SZ(8, 4, 12, 12), 2, 3);
    ag_tensor *idx = tu_tensor(AG_I64, 1, SZ(3), (double[]){2, -1, 0});
    ag_tensor *vals = rnd(2, SZ(3, 32));
    ag_tensor *sp = rnd(3, SZ(4, 10, 6));
    int64_t sq[] = {2, 3, 16, 8};
    ag_tensor *q = rnd_transposed(4, SZ(2, 3, 8, 16), 2, 3), *kk = rnd(4, sq), *v = rnd(4, sq);
    ag_tensor *g = rnd(4, sq), *fo[2];
    ag_tensor *lw = rnd(1, SZ(32)), *lb = rnd(1, SZ(32));
    ag_tensor *wide = rnd(2, SZ(32, 128)), *mw = rnd(2, SZ(64, 5));
    ag_tensor *mstr = ag_slice(wide, 1, 0, 128, 2); /* (32, 64), strides (128, 2): no BLAS layout */
    ag_tensor *ints = tu_tensor(AG_I64, 2, SZ(2, 3), (double[]){1, 2, 3, 4, 5, 6});
    ag_tensor *small = rnd(2, SZ(2, 3));
    ag_tensor *eg = rnd(2, SZ(5, 8)),
              *eidx = tu_tensor(AG_I64, 1, SZ(5), (double[]){1, 3, 1, 0, 9});
    assert_int_equal(ag_op_call(ag_op_find("_scaled_dot_product_flash_attention_for_cpu"),
                                (ag_arg[]){AG_A_T(q), AG_A_T(kk), AG_A_T(v)}, 3, fo),
                     0);
    assert_false(ag_tensor_is_contiguous(mstr));
    static int64_t d0[] = {0}, d1[] = {1}, k2[] = {2, 2}, ln_shape[] = {32};
    static int64_t one[2] = {1, 1}, zero[2] = {0, 0}, bias_sizes[1] = {4}, mask[3] = {1, 1, 1};
    ag_tensor *ix_list[] = {idx};
    ag_tensor *parts[3];
    assert_int_equal(ag_op_call(ag_op_find("split.Tensor"),
                                (ag_arg[]){AG_A_T(sp), AG_A_I(4), AG_A_I(1)}, 3, parts),
                     3);
    call c[] = {
        {"sum.dim_IntList", {AG_A_T(big), AG_A_INTS(d0, 1), AG_A_B(false)}, 3, 1},
        {"sum.dim_IntList", {AG_A_T(x), AG_A_INTS(d0, 1), AG_A_B(false), AG_A_DT(AG_F64)}, 4, 1},
        {"var.correction", {AG_A_T(big), AG_A_INTS(d0, 1)}, 2, 1},
        {"logsumexp", {AG_A_T(x), AG_A_INTS(d1, 1)}, 2, 1},
        {"_softmax", {AG_A_T(x), AG_A_I(0), AG_A_B(false)}, 3, 1},
        {"argmax", {AG_A_T(xt)}, 1, 1},
        {"convolution",
         {AG_A_T(xs), AG_A_T(cw), AG_A_T(cb), AG_A_INTS(one, 2), AG_A_INTS(one, 2),
          AG_A_INTS(one, 2), AG_A_B(false), AG_A_INTS(zero, 2), AG_A_I(1)},
         9,
         1},
        {"convolution_backward",
         {AG_A_T(gs), AG_A_T(xs), AG_A_T(cw), AG_A_INTS(bias_sizes, 1), AG_A_INTS(one, 2),
          AG_A_INTS(one, 2), AG_A_INTS(one, 2), AG_A_B(false), AG_A_INTS(zero, 2), AG_A_I(1),
          AG_A_INTS(mask, 3)},
         11,
         3},
        {"max_pool2d_with_indices", {AG_A_T(xs), AG_A_INTS(k2, 2)}, 2, 2},
        {"split.Tensor", {AG_A_T(sp), AG_A_I(4), AG_A_I(1)}, 3, 3},
        {"cat", {AG_A_TS(parts, 3), AG_A_I(1)}, 2, 1},
        {"index_select", {AG_A_T(xt), AG_A_I(0), AG_A_T(idx)}, 3, 1},
        {"index.Tensor", {AG_A_T(x), AG_A_TS(ix_list, 1)}, 2, 1},
        {"index_put", {AG_A_T(x), AG_A_TS(ix_list, 1), AG_A_T(vals), AG_A_B(true)}, 4, 1},
        {"_scaled_dot_product_flash_attention_for_cpu", {AG_A_T(q), AG_A_T(kk), AG_A_T(v)}, 3, 2},
        {"_scaled_dot_product_flash_attention_for_cpu_backward",
         {AG_A_T(g), AG_A_T(q), AG_A_T(kk), AG_A_T(v), AG_A_T(fo[0]), AG_A_T(fo[1]), AG_A_F(0.0),
          AG_A_B(false), AG_A_NONE, AG_A_NONE},
         10,
         3},
        {"native_layer_norm",
         {AG_A_T(xt), AG_A_INTS(ln_shape, 1), AG_A_T(lw), AG_A_T(lb), AG_A_F(1e-5)},
         5,
         3},
        {"mm", {AG_A_T(mstr), AG_A_T(mw)}, 2, 1},
        {"add.Tensor", {AG_A_T(small), AG_A_T(ints)}, 2, 1},
        {"embedding_dense_backward",
         {AG_A_T(eg), AG_A_T(eidx), AG_A_I(10), AG_A_I(-1), AG_A_B(true)},
         5,
         1},
    };
    cold k = {c, (int)(sizeof c / sizeof *c)};
    /* Each call works warm and cold, and allocates only its outputs when warm. */
    for (int i = 0; i < k.n; i++) {
        char what[96];
        snprintf(what, sizeof what, "%s (case %d)", c[i].op, i);
        expect_outputs_only(what, &c[i], 1);
    }
    tu_sweep_opts o = {.what = "kernels on a cold scratch", .one_thread = true};
    int64_t points = tu_alloc_failure_sweep(cold_scenario, &k, &o);
    assert_true(points > 3 * k.n);
    print_message("  %lld allocation points\n", (long long)points);
    ag_tensor *ts[] = {big, x,    xt,   cx,    cw, cb,    xs,       gs,       idx,     vals,
                       sp,  q,    kk,   v,     g,  fo[0], fo[1],    lw,       lb,      wide,
                       mw,  mstr, ints, small, eg, eidx,  parts[0], parts[1], parts[2]};
    for (size_t i = 0; i < sizeof ts / sizeof *ts; i++)
        ag_tensor_free(ts[i]);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_alignment_growth_reuse),
        cmocka_unit_test(test_bad_slot),
        cmocka_unit_test(test_allocation_failure),
        cmocka_unit_test(test_release_at_thread_exit),
        cmocka_unit_test(test_scratch_tensors),
        cmocka_unit_test(test_sum_dim0),
        cmocka_unit_test(test_convolution),
        cmocka_unit_test(test_split_cat),
        cmocka_unit_test(test_attention),
        cmocka_unit_test(test_cold_scratch_failures),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
