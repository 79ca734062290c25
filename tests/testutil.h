/* Shared helpers for the cmocka tests: tensors from literal or pseudo-random values, value and
 * error assertions, allocation counting and failure injection (the OOM sweep every family's
 * test runs), and gradcheck over an op's declared samples. Each test program is one
 * tests/test_*.c linked with testutil.c. */
#ifndef AG_TESTUTIL_H
#define AG_TESTUTIL_H

#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "aotgrad.h"

/* ---- tensors ---- */

/* A tensor from literal values: T(AG_F32, 2, ((int64_t[]){2, 3}), ((double[]){1,2,3,4,5,6})). */
ag_tensor *tu_tensor(ag_dtype dt, int ndim, const int64_t *sizes, const double *vals);
/* tu_tensor, made a leaf that requires grad. */
ag_tensor *tu_leaf(ag_dtype dt, int ndim, const int64_t *sizes, const double *vals);

/* Deterministic generators, independent of the library's Philox generator. Each advances
 * *state and returns a value in [lo, hi). */
typedef double (*tu_gen)(uint64_t *state, double lo, double hi);
double tu_xorshift(uint64_t *state, double lo, double hi); /* xorshift64 (13, 7, 17) */
double tu_lcg(uint64_t *state, double lo, double hi);      /* Knuth's MMIX LCG */
/* The raw xorshift64 step behind tu_xorshift: the new state. */
uint64_t tu_xorshift_next(uint64_t *state);
/* A tensor of the given shape filled in row-major order with gen(state, lo, hi). */
ag_tensor *tu_rand_tensor(ag_dtype dt, int ndim, const int64_t *sizes, double lo, double hi,
                          tu_gen gen, uint64_t *state);

/* ---- assertions ---- */

/* Asserts t has the given shape. */
void tu_assert_shape(const ag_tensor *t, int ndim, const int64_t *sizes);
/* Asserts |got - want| <= tol * (1 + |want|); a failure names what[i]. */
void tu_assert_near(double got, double want, double tol, const char *what, int64_t i);
/* Asserts t's elements (row-major, any dtype and layout) are want[] within tol * (1 + |want|);
 * a failure names what[element]. tu_assert_close names them "element". */
void tu_assert_close_named(const ag_tensor *t, const double *want, double tol, const char *what);
void tu_assert_close(const ag_tensor *t, const double *want, double tol);
/* Asserts t has the given shape and values within tol (absolute + relative). */
void tu_assert_values(const ag_tensor *t, int ndim, const int64_t *sizes, const double *vals,
                      double tol);
/* Max |a-b| over elements; shapes must match. */
double tu_max_abs_diff(const ag_tensor *a, const ag_tensor *b);
/* Asserts the last error contains `needle`. */
void tu_assert_error_contains(const char *needle);

/* ---- allocation counting and failure injection ----
 *
 * A counting allocator wraps the one installed before it (Lua's EMERGENCYGCTESTS, SQLite's OOM
 * tests). tu_alloc_failure_sweep runs a scenario once cleanly, then again and again with the
 * N-th allocation failing, N = 1, 2, ..., until a run completes without reaching N. Every
 * failing run must return AG_ENOMEM with ag_last_status() == AG_ENOMEM (no crash, no success
 * that hides the failure), every other run 0, and after every run the number of live
 * allocations must be back at the baseline: nothing leaked. The counters are atomic, so the
 * kernels' worker threads may allocate. */

typedef struct tu_sweep_opts {
    const char *what; /* names the scenario in failure messages */
    /* The clean first run is a warm-up: what it keeps (the op registry, the scope stack and
     * other process-wide tables built on first use) is the baseline. With this set it must
     * keep nothing as well (the caller warmed those tables up beforehand). */
    bool clean_run_frees_all;
    /* Runs the sweep on one thread, so the N-th allocation is the same one in every run. */
    bool one_thread;
    int64_t max_points; /* fails beyond this many allocation points; 0: 100000 */
    /* For scenarios too slow to fail every allocation: N = 1 .. every_up_to, then only every
     * stride-th N (every_up_to + stride, + 2 stride, ...) until a run completes. 0: every N. */
    int64_t every_up_to, stride;
    /* Every allocation from the N-th on fails, not only the N-th (memory stays exhausted):
     * the scenario's error and cleanup paths must cope with further failures. */
    bool persistent;
    /* When not NULL, gets the number of allocations a failure-free run makes (with a stride,
     * the first swept N that the scenario did not reach, less one). */
    int64_t *allocations;
} tu_sweep_opts;

/* Runs the sweep described above over scenario(ud), which returns 0 or a negative status and
 * must release what it allocates. opts may be NULL. Returns the number of allocation points
 * exercised (the runs that failed an allocation). */
int64_t tu_alloc_failure_sweep(int (*scenario)(void *ud), void *ud, const tu_sweep_opts *opts);

/* Allocations between these two calls, made by a sweep's scenario, are cleanup after its
 * result is known (releasing a scope may allocate: the autograd engine grows a stack to free a
 * node chain and falls back to recursion when it cannot). A run whose injected failure lands
 * there gets only the leak check. */
void tu_alloc_cleanup_begin(void);
void tu_alloc_cleanup_end(void);
/* Between these two calls allocations are neither counted as points nor failed (they still
 * count as live): the scenario's own bookkeeping and checks. */
void tu_alloc_pause(void);
void tu_alloc_resume(void);

/* Counts allocations: begin installs the counting allocator (no failures), end restores the
 * previous one and returns the number of allocations made in between. */
void tu_alloc_count_begin(void);
int64_t tu_alloc_count_end(void);

/* Same dtype, shape and bits, element by element as doubles (so -0.0 differs from 0.0; any
 * NaN equals any NaN); subclass instances compare by their inner tensors. NULL equals NULL. */
bool tu_same_bits(ag_tensor *a, ag_tensor *b);

/* ---- descriptor lists ---- */

/* "name: desc" for every placeholder of g, one per line, and g's output descriptors ("None"
 * for a missing one), ", "-separated. Static buffers: the next call overwrites them. */
/* A descriptor's repr ("None" for NULL) in one of 8 rotating static buffers. */
const char *tu_desc_repr(const ag_desc *d);
/* Asserts g's placeholders (outputs) carry exactly these descriptor reprs, in order, naming the
 * first that differs. */
void tu_expect_placeholder_descs(const ag_graph *g, const char *const *descs, int n);
void tu_expect_output_descs(const ag_graph *g, const char *const *descs, int n);
const char *tu_placeholders_str(const ag_graph *g);
const char *tu_outputs_str(const ag_graph *g);

/* testutil::noisy(Tensor x) -> Tensor: 2 x; its backward multiplies the gradient by
 * 2 (1 + U[0, 1)), a fresh draw of x's size in the backward (registered on first use). */
const ag_op *tu_noisy_op(void);

/* A "TrainStep" module owning model (child "model") whose forward returns
 * loss = sum_k (0.5 + 0.25 k) sum(out_k) over the model's float outputs, the loss that
 * `aotgrad check` and `bench --zoo` use. NULL with the library's error when it cannot be made;
 * model is freed then. */
ag_module *tu_sum_loss_step(ag_module *model);

/* ---- building graphs by hand ---- */

/* Contiguous metadata: TM(AG_F32, 4, 3) is f32[4, 3], TM0(AG_F32) a scalar. */
ag_tmeta tu_tmeta(ag_dtype dt, int ndim, const int64_t *sizes);
#define NSIZES(...) ((int)(sizeof((int64_t[]){__VA_ARGS__}) / sizeof(int64_t)))
#define TM(dt, ...) tu_tmeta(dt, NSIZES(__VA_ARGS__), (int64_t[]){__VA_ARGS__})
#define TM0(dt) tu_tmeta(dt, 0, NULL)
/* A placeholder of metadata m; fails the test when it cannot be made. */
ag_node *tu_ph(ag_graph *g, const char *name, ag_tmeta m);
/* The op named `name`; fails the test when there is none. */
const ag_op *tu_op(const char *name);
/* ag_graph_call of the op named `op` on n arguments (GARGS(...) spells both); fails the test
 * when the call fails. */
ag_node *tu_call(ag_graph *g, const char *op, const ag_garg *a, int n, const char *name);
#define GARGS(...)                                                                                 \
    (ag_garg[]){__VA_ARGS__}, (int)(sizeof((ag_garg[]){__VA_ARGS__}) / sizeof(ag_garg))

/* ---- running the aotgrad CLI ----
 *
 * The CLI tests run the aotgrad binary that sits next to the test program, with stdout and
 * stderr going to the files "out" and "err" of a fresh temporary directory. */

/* Finds the binary and makes the directory from tmp_template (a mkdtemp template such as
 * "/tmp/ag_test_fx_XXXXXX"); returns false when there is no binary (the caller skips). */
bool tu_cli_setup(const char *tmp_template);
/* The directory tu_cli_setup made. */
const char *tu_cli_dir(void);
/* Runs the binary with args (shell syntax); returns its exit status, or -1. */
int tu_cli_run(const char *args);
/* The contents of the file `name` of the directory (malloc'd, NUL-terminated). */
char *tu_cli_read(const char *name);
/* A whole file's text, NUL-terminated (free() it); fails the test when it cannot be read. */
char *tu_read_file(const char *path);
/* Asserts the file `name` of the directory contains needle (tu_cli_has) or not (tu_cli_lacks);
 * a failure prints the file. */
void tu_cli_has(const char *name, const char *needle);
void tu_cli_lacks(const char *name, const char *needle);
/* Writes text to the file `name` of the directory. */
void tu_cli_write(const char *name, const char *text);
/* Removes the n files named and then the directory. */
void tu_cli_cleanup(const char *const *names, int n);

/* ---- gradcheck of an op's declared samples ---- */

/* Runs ag_gradcheck on every sample of op, as the table-wide test does: every tensor argument
 * (lists included) is a gradcheck input, an in-place op is checked on a clone of self
 * (x.clone().add_(y), so the sample keeps its values and gradients reach self through clone),
 * and outputs flagged nondiff_outputs are left out. The generator is seeded with 42 before each
 * case. Prints each failing case with its message; returns the number of failing cases and sets
 * *ncases (may be NULL) to the number of samples. */
int tu_gradcheck_samples(const ag_op *op, int *ncases);
/* tu_gradcheck_samples of the op named `name`; fails the test if there is no such op, it has
 * no sample, or any sample fails. Returns the number of samples. */
int tu_gradcheck_op(const char *name);
/* tu_gradcheck_op of each of the n names; returns the fewest samples any of them has. */
int tu_gradcheck_ops(const char *const *names, size_t n);

/* ---- RNG functionalization ---- */

/* What to feed a philox placeholder of a joint (or partitioned) graph so that its draws are
 * eager's with the generator at (seed, offset): a new 0-dim int64 tensor holding the seed for
 * a Philox*SeedAOTInput, the offset for a Philox*BaseOffsetAOTInput; NULL for any other
 * placeholder. Caller frees. */
ag_tensor *tu_philox_input(const ag_node *placeholder, uint64_t seed, uint64_t offset);

#endif
