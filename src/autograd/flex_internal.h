/* flex_attention's internals shared with the tracer (src/trace/flex_trace.c), which records
 * ag_flex_attention's call as flex_attention / flex_attention_backward nodes while a trace is
 * active. */
#ifndef AG_FLEX_INTERNAL_H
#define AG_FLEX_INTERNAL_H

#include "../core/internal.h"

/* Set by the tracer when a session starts: ag_flex_attention's work under tracing, called
 * with checked arguments (scale already resolved, > 0); same contract as ag_flex_attention. */
typedef int (*ag__flex_trace_fn)(ag_tensor *q, ag_tensor *k, ag_tensor *v,
                                 const ag_score_mod *score_mod, const ag_block_mask *block_mask,
                                 double scale, ag_tensor **out, ag_tensor **lse);
extern ag__flex_trace_fn ag__flex_trace_hook;
/* trace/flex_trace.c: the hook. */
int ag__flex_traced(ag_tensor *q, ag_tensor *k, ag_tensor *v, const ag_score_mod *score_mod,
                    const ag_block_mask *block_mask, double scale, ag_tensor **out,
                    ag_tensor **lse);

/* The block mask's mask_mod (fn NULL when it has none) into *out. */
void ag__block_mask_mod(const ag_block_mask *m, ag_mask_mod *out);
/* Another reference to m (dropped by ag_block_mask_free). */
/* The end of a flex_attention call: rc != 0 frees res[0..1] and returns rc; else hands res[0]
 * to *out and res[1] to *lse (freed when lse is NULL) through the caller's scope; AG_ENOMEM
 * when the scope cannot take them. */
int ag__flex_hand_out(int rc, ag_tensor *res[2], ag_tensor **out, ag_tensor **lse);
ag_block_mask *ag__block_mask_retain(const ag_block_mask *m);

/* flex_attention_backward on explicit tensors (the graph layer's interpreter): grads gets
 * grad_query, grad_key, grad_value and a gradient per score_mod buffer (NULL when none
 * reached it), results of the open scope. grad_out and grad_lse may be NULL (zeros). 0 or a
 * negative status with a message. */
int ag__flex_attention_backward(ag_tensor *q, ag_tensor *k, ag_tensor *v, ag_tensor *out,
                                ag_tensor *lse, ag_tensor *grad_out, ag_tensor *grad_lse,
                                const ag_score_mod *score_mod, const ag_block_mask *block_mask,
                                double scale, ag_tensor **grads);
/* A block mask over existing parts (8 int64 tensors in ag_block_mask_part order, referenced,
 * not copied) with sizes (KV_LEN, Q_LEN, Q_BLOCK_SIZE, KV_BLOCK_SIZE) and mask_mod (may be
 * NULL); NULL with AG_EINVAL when the parts do not fit the sizes. */
ag_block_mask *ag__block_mask_from_parts(ag_tensor *const *parts, const int64_t *sizes,
                                         const ag_mask_mod *mask_mod);

/* ---- the kernel on raw memory (the planned executor's flex steps, runtime/plan_flex.c) ----
 * Per-tile functions instead of score_mod / mask_mod over tensors, each 0 or a negative status
 * with the error set; (b, h) the tile's batch and head, rows q0 .. q0 + bq - 1, columns
 * k0 .. k0 + bk - 1; tid is the calling thread's number, 0 .. nthreads - 1: with nthreads > 1
 * the kernel calls them from up to nthreads threads at once (each thread its own tid), else
 * serially on the calling thread. mask is always called serially (tid 0).
 *   score: S [bq, bk] (contiguous, the call's dtype) <- score_mod(S), in place;
 *   mask:  dst [bq, bk] bytes (row stride ld) <- mask_mod, 0 or 1;
 *   joint: the backward of score_mod at the raw scores S0 [bq, bk]: dS (in: the gradient of
 *          the modified scores; out: of the raw scores), in place; the score_mod buffers'
 *          gradients are the function's business (accumulated where its ud says).
 * A NULL function is the identity (score), no mask_mod (mask: partial blocks need one), the
 * identity's backward (joint). */
typedef struct ag__flex_tile_fns {
    void *ud;
    int nthreads; /* < 2: serial */
    int (*score)(void *ud, int tid, int64_t b, int64_t h, int64_t q0, int64_t bq, int64_t k0,
                 int64_t bk, void *S);
    int (*mask)(void *ud, int tid, int64_t b, int64_t h, int64_t q0, int64_t bq, int64_t k0,
                int64_t bk, uint8_t *dst, int64_t ld);
    int (*joint)(void *ud, int tid, int64_t b, int64_t h, int64_t q0, int64_t bq, int64_t k0,
                 int64_t bk, const void *S0, void *dS);
} ag__flex_tile_fns;

/* One forward (bwd false: out and lse written) or backward (dq, dk, dv written) on contiguous
 * [B, H, len, dim] arrays of dtype dt (float32 or float64), the block mask's 8 int64 tensors
 * (parts, ag_block_mask_part order) with block_mask_sizes (KV_LEN, Q_LEN, Q_BLOCK_SIZE,
 * KV_BLOCK_SIZE). dlse may be NULL (zero). Allocates nothing once the kernel's scratch has
 * grown to the call's size. 0 or a negative status with a message. */
typedef struct ag__flex_raw {
    bool bwd;
    ag_dtype dt;
    int64_t B, Hq, Hkv, L, S, E, Ev;
    double scale;
    const void *q, *k, *v;
    void *out, *lse;         /* forward: written; backward: the saved ones */
    const void *dout, *dlse; /* backward */
    void *dq, *dk, *dv;      /* backward: written */
    ag_tensor *const *parts;
    const int64_t *sizes;
    const ag__flex_tile_fns *fns;
} ag__flex_raw;
int ag__flex_run_raw(const ag__flex_raw *r);
/* A raw call's geometry, dtype and q, k, v pointers from contiguous [B, H, L, E] q, k, v (the
 * rest zero, for the caller to fill). */
ag__flex_raw ag__flex_raw_of(bool bwd, double scale, const ag_tensor *q, const ag_tensor *k,
                             const ag_tensor *v);
/* For the per-tile functions: dst [bq, bk] (row stride ld elements, dtype dt: float32,
 * float64 or bool) <- r, a contiguous float or bool tensor that broadcasts to the tile
 * (ag__flex_fits_tile), converted. */
void ag__flex_store_tile(const ag_tensor *r, ag_dtype dt, int64_t bq, int64_t bk, void *dst,
                         int64_t ld);
/* acc (a buffer's gradient: contiguous, float32 or float64) += g (contiguous, float) summed over
 * its leading dimensions and those where acc has size 1 (ag__flex_reduces_to(g, acc)). */
void ag__flex_add_reduced(ag_tensor *acc, const ag_tensor *g);
/* Whether metadata m broadcasts to the tile [bq, bk]; whether a gradient of metadata g sums to
 * a buffer of metadata b as ag__flex_add_reduced sums it. */
bool ag__flex_fits_tile(const ag_tmeta *m, int64_t bq, int64_t bk);
bool ag__flex_reduces_to(const ag_tmeta *g, const ag_tmeta *b);

/* Set by the runtime layer when the library is loaded (src/runtime/flex_eager.c): eager
 * flex_attention's score_mod traced into graphs (sdpa_score0, joint_graph0) and planned per tile
 * shape, so the kernel runs it per tile on all threads without the op dispatcher or ag_grad.
 * NULL (a static link without the runtime): score_mod is called per tile on the calling thread.
 *   make: the plans for score_mod sm on a call of dtype dt over L x S in QB x KB tiles, its
 *         buffers' metadata from sm->buffers (their contiguous layout), with the backward's
 *         joint when bwd: 0 with *h set; 1 when sm cannot be traced or planned (no error left:
 *         call it per tile); < 0 (out of memory) with the error set.
 *   bind: a run's buffers (contiguous, the metadata made for) and, in the backward, the
 *         buffers' gradient sums (contiguous, zeroed by bind; NULL entries: not needed) -> the
 *         kernel's tile functions (*fns, valid until done).
 *   done: after the kernel returned rc: the per-thread gradient sums added, a failed tile's
 *         message; returns the status.
 *   free: h (NULL: no-op).
 * One run at a time per h. */
typedef struct ag__flex_eager_hooks {
    int (*make)(const ag_score_mod *sm, ag_dtype dt, int64_t L, int64_t S, int64_t QB, int64_t KB,
                bool bwd, void **h);
    int (*bind)(void *h, ag_tensor *const *bufs, ag_tensor *const *bgrad,
                const ag__flex_tile_fns **fns);
    int (*done)(void *h, int rc);
    void (*free)(void *h);
} ag__flex_eager_hooks;
extern const ag__flex_eager_hooks *ag__flex_eager;
/* Counts the eager calls (forward or backward) that ran score_mod through the hook above
 * ([0]) and per tile ([1]); for tests. */
extern _Atomic int64_t ag__flex_eager_counts[2];

#endif
