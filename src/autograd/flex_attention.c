/* flex_attention and block masks (include/aotgrad/flex_attention.h), eager on the CPU.
 *
 * In: query, key, value, a score_mod and a block mask built from a mask_mod (C functions over
 * aotgrad tensors). Out: the attention output and its logsumexp, and, with grad mode on, one
 * autograd node ("FlexAttentionBackward0") whose backward is flex_attention_backward's math.
 *
 * The kernel works on (q block x kv block) tiles. For each (b, h, q block) the forward visits
 * the block mask's full blocks (no mask evaluated) and partial blocks (mask applied), never the
 * empty ones, and keeps a running max, sum and output accumulator (online softmax), so memory is
 * one tile per thread, never L x S. The backward recomputes each tile's probabilities from the
 * saved logsumexp. The typed loops are in flex_tiles.inc. Partial tiles' masks are evaluated
 * once per call before the loops (mask_mod is user code calling aotgrad ops: it runs on the
 * calling thread, never inside the OpenMP region); with a score_mod (user code too, evaluated
 * per tile) the loops run on the calling thread. score_mod's gradient per tile goes through the
 * autograd engine (ag_grad on the tile's recorded score_mod graph).
 *
 * Scratch (src/core/scratch.c): slot 6 holds the partial tiles' masks and their index; slot 7
 * the per-thread tile workspaces. No op kernel uses those slots, so the user functions called
 * while they are held cannot clobber them; flex_attention inside a score_mod or mask_mod is
 * refused. */
#include "flex_internal.h"

#include "../core/kernel_util.h"
#include "aotgrad/flex_attention.h"

#include <cblas.h>
#include <math.h>
#include <omp.h>

#define FLEX_SLOT_MASKS 6
#define FLEX_SLOT_WS 7

ag__flex_trace_fn ag__flex_trace_hook;
const ag__flex_eager_hooks *ag__flex_eager;
_Atomic int64_t ag__flex_eager_counts[2];

/* flex_attention running on this thread (nesting refused: the scratch slots are held). */
static _Thread_local int flex_depth;

struct ag_block_mask {
    _Atomic int refs; /* calls on several threads may share a block mask */
    int64_t B, H, L, S, QB, KB, nq, nk;
    ag_tensor *parts[8];
    ag_mask_mod_fn fn;
    void *ud;
    ag_tensor **bufs; /* kept */
    int nbuf;
};

static inline int64_t min64(int64_t a, int64_t b) {
    return a < b ? a : b;
}

/* Everything one forward or backward call needs. */
typedef struct flex {
    ag_dtype dt;
    int64_t B, Hq, Hkv, G, L, S, E, Ev;
    double scale;
    const void *q, *k, *v;
    void *out, *lse;         /* forward: written; backward: the saved ones (read) */
    const void *dout, *dlse; /* backward: incoming gradients (dlse may be NULL) */
    void *dq, *dk, *dv;      /* backward: zeroed, accumulated */
    int64_t QB, KB, nq, nk;  /* tile sizes and counts */
    const ag_block_mask *bm; /* NULL: every block full */
    const uint8_t *pm;       /* partial tiles' masks, QB x KB bytes each */
    const int64_t *pm_index; /* [bmB, bmH, nq, nk] -> tile number, -1 */
    ag_score_mod_fn sfn;     /* NULL: no score_mod */
    void *sud;
    ag_tensor **sbuf; /* the buffers score_mod receives (detached; leaves in the backward) */
    int nsbuf;
    ag_tensor **sgrad; /* backward: kept sums of the buffers' gradients (NULL entries: none) */
    const bool *sneed; /* backward: which buffers need a gradient */
    ag_tensor *pend_root, *pend_leaf; /* backward: the open tile's score_mod result and input */
    const ag__flex_tile_fns *tf;      /* ag__flex_run_raw: the per-tile functions (else NULL) */
} flex;

/* A row's key blocks: n[0] full ones, n[1] partial ones; idx NULL means 0, 1, ... */
typedef struct blocks {
    int64_t n[2];
    const int64_t *idx[2];
} blocks;

static int64_t bm_row(const ag_block_mask *m, int64_t b, int64_t h, int64_t qb) {
    const int64_t mb = m->B == 1 ? 0 : b, mh = m->H == 1 ? 0 : h;
    return (mb * m->H + mh) * m->nq + qb;
}

static void row_blocks(const flex *f, int64_t b, int64_t h, int64_t qb, blocks *rb) {
    if (!f->bm) {
        rb->n[0] = f->nk;
        rb->idx[0] = NULL;
        rb->n[1] = 0;
        rb->idx[1] = NULL;
        return;
    }
    const ag_block_mask *m = f->bm;
    const int64_t r = bm_row(m, b, h, qb);
    const int64_t *full_n = ag_tensor_data(m->parts[AG_BM_FULL_KV_NUM_BLOCKS]);
    const int64_t *full_i = ag_tensor_data(m->parts[AG_BM_FULL_KV_INDICES]);
    const int64_t *part_n = ag_tensor_data(m->parts[AG_BM_KV_NUM_BLOCKS]);
    const int64_t *part_i = ag_tensor_data(m->parts[AG_BM_KV_INDICES]);
    rb->n[0] = full_n[r];
    rb->idx[0] = full_i + r * m->nk;
    rb->n[1] = part_n[r];
    rb->idx[1] = part_i + r * m->nk;
}

static const uint8_t *partial_tile(const flex *f, int64_t b, int64_t h, int64_t qb, int64_t kb) {
    const int64_t t = f->pm_index[bm_row(f->bm, b, h, qb) * f->nk + kb];
    return f->pm + (size_t)t * (size_t)(f->QB * f->KB);
}

/* ---- the user functions, on one tile ---- */

/* [n, 1] (column) or [1, n] int64 positions start, start + 1, ... */
static ag_tensor *positions(int64_t start, int64_t n, bool column) {
    ag_tensor *a = ag_arange(AG_I64, (double)start, (double)(start + n), 1);
    int64_t sz[2] = {column ? n : 1, column ? 1 : n};
    return a ? ag_view(a, 2, sz) : NULL;
}

/* Status of a failed step: the error already set, else ENOMEM. */
static int failed(void) {
    return ag__has_error() && ag_last_status() < 0 ? ag_last_status() : AG_ENOMEM;
}

/* r, a user function's result for a [bq, bk] tile, broadcast to the tile and converted to dt:
 * the tensor (in the open scope), or NULL with a message. */
static ag_tensor *tile_result(ag_tensor *r, const char *what, ag_dtype dt, int64_t bq, int64_t bk) {
    if (!r) {
        if (!ag__has_error() || ag_last_status() >= 0)
            ag__err(AG_EINVAL, "flex_attention: %s returned NULL and set no error", what);
        return NULL;
    }
    const ag_dtype rd = ag_tensor_dtype(r);
    const bool is_mask = dt == AG_BOOL;
    if (is_mask ? rd != AG_BOOL : !ag_dtype_is_float(rd)) {
        ag__err(AG_EINVAL, "flex_attention: %s returned a %s tensor, expected %s", what,
                ag_dtype_name(rd), is_mask ? "bool" : "a float one");
        return NULL;
    }
    const int nd = ag_tensor_ndim(r);
    const int64_t *sz = ag_tensor_sizes(r);
    bool ok = nd <= 2;
    for (int d = 0; d < nd && ok; d++) {
        const int64_t want = d == nd - 1 ? bk : bq;
        ok = sz[d] == 1 || sz[d] == want;
    }
    if (!ok) {
        char buf[128];
        ag__err(AG_EINVAL,
                "flex_attention: %s returned shape %s, which does not broadcast to the tile [%lld, "
                "%lld]",
                what, ag__fmt_sizes(buf, sizeof buf, nd, sz), (long long)bq, (long long)bk);
        return NULL;
    }
    int64_t tile[2] = {bq, bk};
    ag_tensor *e = ag_expand(r, 2, tile);
    if (e && rd != dt)
        e = ag_to_dtype(e, dt);
    return e;
}

/* Copies tile tensor t ([bq, bk], any layout) into dst (row stride ld elements). */
static int tile_copy(ag_tensor *t, void *dst, int64_t ld) {
    ag_tensor *c = ag_contiguous(t);
    if (!c)
        return failed();
    const int64_t bq = ag_tensor_size(c, 0), bk = ag_tensor_size(c, 1);
    const size_t es = ag_dtype_size(ag_tensor_dtype(c));
    const char *src = ag_tensor_data(c);
    for (int64_t i = 0; i < bq; i++)
        memcpy((char *)dst + (size_t)(i * ld) * es, src + (size_t)(i * bk) * es, (size_t)bk * es);
    return 0;
}

/* mask_mod on tile (q0.., k0..) of (b, h) into dst (bytes, row stride ld); *ntrue counts the
 * kept positions. */
static int mask_tile(const ag_block_mask *m, int64_t b, int64_t h, int64_t q0, int64_t bq,
                     int64_t k0, int64_t bk, uint8_t *dst, int64_t ld, int64_t *ntrue) {
    ag_scope_begin();
    bool prev = ag_set_grad_enabled(false);
    int rc = 0;
    ag_tensor *bt = ag_scalar_tensor(AG_I64, (double)b), *ht = ag_scalar_tensor(AG_I64, (double)h);
    ag_tensor *qi = positions(q0, bq, true), *ki = positions(k0, bk, false);
    if (!bt || !ht || !qi || !ki)
        rc = failed();
    ag_tensor *r = NULL;
    if (!rc) {
        uint64_t errs = ag__err_count();
        r = m->fn(m->ud, bt, ht, qi, ki, m->bufs, m->nbuf);
        if (!r && ag__err_count() == errs)
            ag__err(AG_EINVAL, "flex_attention: mask_mod returned NULL and set no error");
        r = r ? tile_result(r, "mask_mod", AG_BOOL, bq, bk) : NULL;
        rc = r ? tile_copy(r, dst, ld) : failed();
    }
    if (!rc) {
        int64_t n = 0;
        for (int64_t i = 0; i < bq; i++)
            for (int64_t j = 0; j < bk; j++)
                n += dst[i * ld + j] != 0;
        *ntrue = n;
    }
    ag_set_grad_enabled(prev);
    ag_scope_end();
    return rc;
}

/* The tile's index tensors and score tensor (from S), in the open scope. */
static int score_args(const flex *f, int64_t b, int64_t h, int64_t q0, int64_t bq, int64_t k0,
                      int64_t bk, const void *S, ag_tensor **a) {
    int64_t tile[2] = {bq, bk};
    a[0] = ag_from_data(f->dt, 2, tile, S);
    a[1] = ag_scalar_tensor(AG_I64, (double)b);
    a[2] = ag_scalar_tensor(AG_I64, (double)h);
    a[3] = positions(q0, bq, true);
    a[4] = positions(k0, bk, false);
    for (int i = 0; i < 5; i++)
        if (!a[i])
            return failed();
    return 0;
}

static ag_tensor *call_score(const flex *f, ag_tensor *const *a) {
    uint64_t errs = ag__err_count();
    ag_tensor *r = f->sfn(f->sud, a[0], a[1], a[2], a[3], a[4], f->sbuf, f->nsbuf);
    if (!r && ag__err_count() == errs)
        ag__err(AG_EINVAL, "flex_attention: score_mod returned NULL and set no error");
    return r ? tile_result(r, "score_mod", f->dt, ag_tensor_size(a[0], 0), ag_tensor_size(a[0], 1))
             : NULL;
}

/* Forward: S <- score_mod(S), grad mode off. */
static int score_fwd(flex *f, int64_t b, int64_t h, int64_t q0, int64_t bq, int64_t k0, int64_t bk,
                     void *S) {
    ag_scope_begin();
    bool prev = ag_set_grad_enabled(false);
    ag_tensor *a[5];
    int rc = score_args(f, b, h, q0, bq, k0, bk, S, a);
    if (!rc) {
        ag_tensor *r = call_score(f, a);
        rc = r ? tile_copy(r, S, bk) : failed();
    }
    ag_set_grad_enabled(prev);
    ag_scope_end();
    return rc;
}

/* Backward, first half: S <- score_mod(S) with its graph recorded; the scope stays open until
 * score_bwd_finish (closed here on failure). */
static int score_bwd_begin(flex *f, int64_t b, int64_t h, int64_t q0, int64_t bq, int64_t k0,
                           int64_t bk, void *S) {
    ag_scope_begin();
    bool prev = ag_set_grad_enabled(true);
    ag_tensor *a[5];
    int rc = score_args(f, b, h, q0, bq, k0, bk, S, a);
    if (!rc)
        rc = ag_tensor_set_requires_grad(a[0], true);
    ag_tensor *r = NULL;
    if (!rc) {
        r = call_score(f, a);
        rc = r ? tile_copy(r, S, bk) : failed();
    }
    ag_set_grad_enabled(prev);
    if (rc) {
        ag_scope_end();
        return rc;
    }
    f->pend_root = r;
    f->pend_leaf = a[0];
    return 0;
}

/* Backward, second half: dS (the gradient of the modified scores) <- the gradient of the raw
 * scores through score_mod; the buffers' gradients added to f->sgrad. Closes the scope. */
static int score_bwd_finish(flex *f, int64_t bq, int64_t bk, void *dS) {
    int64_t tile[2] = {bq, bk};
    const size_t es = ag_dtype_size(f->dt);
    int rc = 0;
    enum { MAXB = 64 };
    ag_tensor *want[1 + MAXB], *res[1 + MAXB];
    int slot[1 + MAXB], nw = 0;
    want[nw] = f->pend_leaf;
    slot[nw++] = -1;
    for (int i = 0; i < f->nsbuf; i++)
        if (f->sneed[i]) {
            want[nw] = f->sbuf[i];
            slot[nw++] = i;
        }
    if (!ag_tensor_requires_grad(f->pend_root)) {
        memset(dS, 0, (size_t)(bq * bk) * es); /* score_mod ignored the score */
    } else {
        ag_tensor *g = ag_from_data(f->dt, 2, tile, dS);
        rc = g ? ag_grad(&f->pend_root, &g, 1, want, nw, res, false, true) : failed();
        if (!rc && res[0])
            rc = tile_copy(res[0], dS, bk);
        else if (!rc)
            memset(dS, 0, (size_t)(bq * bk) * es);
        for (int k = 1; k < nw && !rc; k++) {
            if (!res[k])
                continue;
            ag_tensor **acc = &f->sgrad[slot[k]];
            ag_tensor *sum = *acc ? ag_add(*acc, res[k]) : res[k];
            if (!sum) {
                rc = failed();
                break;
            }
            ag_tensor *kept = ag_tensor_keep(sum);
            ag_tensor_free(*acc);
            *acc = kept;
        }
    }
    f->pend_root = f->pend_leaf = NULL;
    ag_scope_end();
    return rc;
}

/* ---- the typed tile loops ---- */

#define T float
#define SUF f32
#define GEMM cblas_sgemm
#define EXP expf
#define LOG logf
#include "flex_tiles.inc"
#undef T
#undef SUF
#undef GEMM
#undef EXP
#undef LOG

#define T double
#define SUF f64
#define GEMM cblas_dgemm
#define EXP exp
#define LOG log
#include "flex_tiles.inc"
#undef T
#undef SUF
#undef GEMM
#undef EXP
#undef LOG

/* The user's functions run ops on one small tile at a time, on the calling thread: their ops
 * run single-threaded meanwhile (an OpenMP region per tiny op costs more than the op, and far
 * more on a loaded machine). Returns the thread count to restore with omp_set_num_threads. */
static int one_thread_begin(void) {
    const int nth = omp_get_max_threads();
    omp_set_num_threads(1);
    return nth;
}

/* Evaluates mask_mod on every partial tile the call visits (slot 6). */
static int prepare_masks(flex *f) {
    f->pm = NULL;
    f->pm_index = NULL;
    const ag_block_mask *m = f->bm;
    const bool raw = f->tf && f->tf->mask;
    if (!m || (!m->fn && !raw))
        return 0;
    const int64_t nrows = m->B * m->H * m->nq;
    const int64_t *part_n = ag_tensor_data(m->parts[AG_BM_KV_NUM_BLOCKS]);
    const int64_t *part_i = ag_tensor_data(m->parts[AG_BM_KV_INDICES]);
    int64_t ntiles = 0;
    for (int64_t r = 0; r < nrows; r++)
        ntiles += part_n[r];
    const size_t tile = (size_t)(m->QB * m->KB);
    const size_t idx_bytes = (size_t)(nrows * m->nk) * sizeof(int64_t);
    char *blk = ag__scratch(FLEX_SLOT_MASKS, idx_bytes + (size_t)ntiles * tile + 1);
    if (!blk)
        return AG_ENOMEM;
    int64_t *index = (int64_t *)blk;
    uint8_t *pm = (uint8_t *)(blk + idx_bytes);
    for (int64_t i = 0; i < nrows * m->nk; i++)
        index[i] = -1;
    int64_t t = 0;
    int rc = 0;
    const int nth = one_thread_begin();
    for (int64_t mb = 0; mb < m->B && !rc; mb++)
        for (int64_t mh = 0; mh < m->H && !rc; mh++)
            for (int64_t qb = 0; qb < m->nq && !rc; qb++) {
                const int64_t r = (mb * m->H + mh) * m->nq + qb;
                for (int64_t j = 0; j < part_n[r] && !rc; j++, t++) {
                    const int64_t kb = part_i[r * m->nk + j], q0 = qb * m->QB, k0 = kb * m->KB;
                    int64_t n;
                    const int64_t bq = min64(m->QB, m->L - q0), bk = min64(m->KB, m->S - k0);
                    rc = raw ? f->tf->mask(f->tf->ud, 0, mb, mh, q0, bq, k0, bk,
                                           pm + (size_t)t * tile, m->KB)
                             : mask_tile(m, mb, mh, q0, bq, k0, bk, pm + (size_t)t * tile, m->KB,
                                         &n);
                    index[r * m->nk + kb] = t;
                }
            }
    omp_set_num_threads(nth);
    if (rc)
        return rc;
    f->pm = pm;
    f->pm_index = index;
    return 0;
}

/* Iteration i's row when iterations go round-robin to nth threads: every other round of nth
 * reversed, so that thread t gets rows t, 2 nth - 1 - t, 2 nth + t, ...: a causal mask's short
 * and long rows (q block qb has qb + 1 key blocks) spread evenly. */
static int64_t snake(int64_t i, int64_t n, int nth) {
    const int64_t g = i / nth, pos = i % nth;
    if (!(g & 1) || (g + 1) * nth > n)
        return i;
    return g * nth + (nth - 1 - pos);
}

/* Iteration r of run_rows: forward, row r = (b, h, q block); backward, r = (b, kv head), its
 * rows (one iteration owns its dK, dV rows). A failure (only user or raw functions fail) goes
 * to *err. */
static void run_iter(flex *f, bool backward, int64_t r, void *blk, size_t ws, int *err) {
    const size_t off = (size_t)omp_get_thread_num() * ws;
    if (!backward) {
        const int64_t qb = r % f->nq, bh = r / f->nq;
        if (*err)
            return;
        int e = f->dt == AG_F32 ? fwd_row_f32(f, bh / f->Hq, bh % f->Hq, qb, (float *)blk + off)
                                : fwd_row_f64(f, bh / f->Hq, bh % f->Hq, qb, (double *)blk + off);
        if (e)
            *err = e;
        return;
    }
    const int64_t b = r / f->Hkv, hk = r % f->Hkv;
    for (int64_t g = 0; g < f->G && !*err; g++)
        for (int64_t qb = 0; qb < f->nq && !*err; qb++) {
            const int64_t h = hk * f->G + g;
            int e = f->dt == AG_F32 ? bwd_row_f32(f, b, h, qb, (float *)blk + off)
                                    : bwd_row_f64(f, b, h, qb, (double *)blk + off);
            if (e)
                *err = e;
        }
}

/* Runs every row's forward or backward. */
static int run_rows(flex *f, bool backward) {
    int rc = prepare_masks(f);
    if (rc)
        return rc;
    /* user functions run on the calling thread, the raw ones on up to their nthreads; the ops
     * they run, single-threaded */
    const bool raw_fns = f->tf && (f->tf->score || f->tf->joint);
    const bool serial = f->sfn || raw_fns;
    int nth = ag_get_num_threads();
    if (f->sfn || (raw_fns && f->tf->nthreads < 2))
        nth = 1;
    else if (raw_fns && nth > f->tf->nthreads)
        nth = f->tf->nthreads;
    const size_t ws = (size_t)(2 * f->QB * f->KB + f->QB * (f->Ev > f->E ? f->Ev : f->E) +
                               4 * f->QB + 16 + (f->tf ? f->QB * f->KB : 0));
    void *blk = ag__scratch(FLEX_SLOT_WS, (size_t)nth * ws * ag_dtype_size(f->dt));
    if (!blk)
        return AG_ENOMEM;
    int err = 0;
    const int prev_nth = serial ? one_thread_begin() : 0;
    /* With raw functions on several threads each row goes to the same thread at every run
     * (static schedule, in snake order): a thread's tile plans meet the same tile shapes, so
     * they are warm after the first run. */
    const bool fixed = raw_fns && nth > 1;
    const int64_t n = backward ? f->B * f->Hkv : f->B * f->Hq * f->nq;
    if (fixed)
        AG__BLAS_FOR(true, "omp parallel for schedule(static, 1) num_threads(nth)", i, n,
                     { run_iter(f, backward, snake(i, n, nth), blk, ws, &err); });
    else
        AG__BLAS_FOR(nth > 1, "omp parallel for schedule(dynamic) num_threads(nth)", r, n,
                     { run_iter(f, backward, r, blk, ws, &err); });
    if (serial)
        omp_set_num_threads(prev_nth);
    return err;
}

/* Runs every row's forward or backward with f's score_mod (f->sfn, if any) on the runtime's
 * tile plans of its traced graphs when it traces (ag__flex_eager: every thread, no dispatcher),
 * else called per tile by run_rows. Backward: bgrad[i] receives buffer i's gradient (kept
 * zeros made here; NULL where f->sneed[i] is false). */
static int run_rows_traced(flex *f, bool backward, ag_tensor **bgrad) {
    const ag__flex_eager_hooks *hk = ag__flex_eager;
    if (!f->sfn)
        return run_rows(f, backward);
    const ag_score_mod sm = {f->sfn, f->sud, f->sbuf, f->nsbuf};
    void *h = NULL;
    int rc = hk ? hk->make(&sm, f->dt, f->L, f->S, f->QB, f->KB, backward, &h) : 1;
    if (rc < 0)
        return rc;
    if (rc) {
        ag__flex_eager_counts[1]++;
        return run_rows(f, backward);
    }
    ag__flex_eager_counts[0]++;
    ag_scope_begin();
    bool prev = ag_set_grad_enabled(false);
    ag_tensor *bufs[64];
    for (int i = 0; i < f->nsbuf && !rc; i++) {
        ag_tensor *c = ag_contiguous(f->sbuf[i]);
        if (!(bufs[i] = c ? ag_detach(c) : NULL))
            rc = failed();
    }
    for (int i = 0; backward && i < f->nsbuf && !rc; i++) {
        if (!f->sneed[i])
            continue;
        ag_tensor *z =
            ag_zeros(ag_tensor_dtype(bufs[i]), ag_tensor_ndim(bufs[i]), ag_tensor_sizes(bufs[i]));
        if (!z || !(bgrad[i] = ag_tensor_keep(z)))
            rc = failed();
    }
    ag_set_grad_enabled(prev);
    const ag__flex_tile_fns *fns = NULL;
    if (!rc)
        rc = hk->bind(h, bufs, backward ? bgrad : NULL, &fns);
    if (!rc) {
        flex g = *f;
        g.sfn = NULL;
        g.tf = fns;
        rc = hk->done(h, run_rows(&g, backward));
    }
    ag_scope_end();
    hk->free(h);
    return rc;
}

/* ---- block masks ---- */

/* An int64 tensor with data, made outside the dispatcher: a block mask built while a trace is
 * active (flex_attention's default mask) holds data, not graph nodes. */
static ag_tensor *kept_empty(int ndim, const int64_t *sizes) {
    return ag__tensor_new(AG_I64, ndim, sizes, false);
}

void ag_block_mask_free(ag_block_mask *m) {
    if (!m || --m->refs > 0)
        return;
    for (int i = 0; i < 8; i++)
        ag_tensor_free(m->parts[i]);
    for (int i = 0; i < m->nbuf; i++)
        ag_tensor_free(m->bufs[i]);
    ag__free(m->bufs);
    ag__free(m);
}

/* num [B, H, nrows] and idx [B, H, nrows, ncols] of the blocks whose class (cls, indexed by
 * get(r, c)) is want: listed first, ascending, then the others ascending. */
static void fill_lists(const uint8_t *cls, int64_t BH, int64_t nrows, int64_t ncols,
                       bool transposed, uint8_t want, int64_t *num, int64_t *idx) {
    for (int64_t bh = 0; bh < BH; bh++)
        for (int64_t r = 0; r < nrows; r++) {
            int64_t *row = idx + (bh * nrows + r) * ncols, n = 0;
            for (int pass = 0; pass < 2; pass++)
                for (int64_t c = 0; c < ncols; c++) {
                    const int64_t qb = transposed ? c : r, kb = transposed ? r : c;
                    const int64_t nk = transposed ? nrows : ncols;
                    const bool is = cls[(bh * (transposed ? ncols : nrows) + qb) * nk + kb] == want;
                    if (is == (pass == 0))
                        row[n++] = c;
                    if (pass == 0 && is)
                        num[bh * nrows + r]++;
                }
        }
}

ag_block_mask *ag_create_block_mask(const ag_mask_mod *mask_mod, int64_t B, int64_t H,
                                    int64_t q_len, int64_t kv_len, int64_t q_block_size,
                                    int64_t kv_block_size) {
    const int64_t QB = q_block_size ? q_block_size : 128, KB = kv_block_size ? kv_block_size : 128;
    if (B < 1 || H < 1 || q_len < 1 || kv_len < 1 || QB < 1 || KB < 1) {
        ag__err(AG_EINVAL,
                "create_block_mask: B=%lld, H=%lld, Q_LEN=%lld, KV_LEN=%lld and the block sizes "
                "(%lld, %lld) must be >= 1",
                (long long)B, (long long)H, (long long)q_len, (long long)kv_len, (long long)QB,
                (long long)KB);
        return NULL;
    }
    const bool has_fn = mask_mod && mask_mod->fn;
    const int nbuf = has_fn ? mask_mod->nbuffers : 0;
    if (nbuf < 0 || (nbuf > 0 && !mask_mod->buffers)) {
        ag__err(AG_EINVAL, "create_block_mask: bad buffer list (%d buffers)", nbuf);
        return NULL;
    }
    for (int i = 0; i < nbuf; i++)
        if (!mask_mod->buffers[i]) {
            ag__err(AG_EINVAL, "create_block_mask: mask_mod buffer %d is NULL", i);
            return NULL;
        }
    ag_block_mask *m = ag__calloc(1, sizeof *m);
    if (!m || (nbuf && !(m->bufs = ag__calloc((size_t)nbuf, sizeof *m->bufs)))) {
        ag__free(m);
        return NULL;
    }
    m->refs = 1;
    m->B = B;
    m->H = H;
    m->L = q_len;
    m->S = kv_len;
    m->QB = QB;
    m->KB = KB;
    m->nq = (q_len + QB - 1) / QB;
    m->nk = (kv_len + KB - 1) / KB;
    if (has_fn) {
        m->fn = mask_mod->fn;
        m->ud = mask_mod->ud;
    }
    for (int i = 0; i < nbuf; i++, m->nbuf++)
        m->bufs[i] = ag_tensor_keep(mask_mod->buffers[i]);
    const int64_t BH = B * H, nq = m->nq, nk = m->nk;
    uint8_t *cls = ag__malloc((size_t)(BH * nq * nk));
    uint8_t *tile = ag__malloc((size_t)(QB * KB));
    int rc = cls && tile ? 0 : AG_ENOMEM;
    const int nth = one_thread_begin();
    for (int64_t bh = 0; bh < BH && !rc; bh++)
        for (int64_t qb = 0; qb < nq && !rc; qb++)
            for (int64_t kb = 0; kb < nk && !rc; kb++) {
                const int64_t q0 = qb * QB, k0 = kb * KB, bq = min64(QB, q_len - q0),
                              bk = min64(KB, kv_len - k0);
                int64_t n = bq * bk;
                if (has_fn)
                    rc = mask_tile(m, bh / H, bh % H, q0, bq, k0, bk, tile, KB, &n);
                cls[(bh * nq + qb) * nk + kb] = n == 0 ? 0 : n == bq * bk ? 2 : 1;
            }
    omp_set_num_threads(nth);
    int64_t rows[3] = {B, H, nq}, rows_t[3] = {B, H, nk};
    int64_t full[4] = {B, H, nq, nk}, full_t[4] = {B, H, nk, nq};
    for (int p = 0; p < 8 && !rc; p++) {
        const bool q_side = p >= AG_BM_Q_NUM_BLOCKS, is_num = p % 2 == 0;
        m->parts[p] =
            is_num ? kept_empty(3, q_side ? rows_t : rows) : kept_empty(4, q_side ? full_t : full);
        if (!m->parts[p])
            rc = failed();
    }
    if (!rc) {
        for (int p = 0; p < 8; p += 2) {
            memset(ag_tensor_data(m->parts[p]), 0, (size_t)ag_tensor_numel(m->parts[p]) * 8);
            const bool q_side = p >= AG_BM_Q_NUM_BLOCKS;
            const uint8_t want = p == AG_BM_KV_NUM_BLOCKS || p == AG_BM_Q_NUM_BLOCKS ? 1 : 2;
            fill_lists(cls, BH, q_side ? nk : nq, q_side ? nq : nk, q_side, want,
                       ag_tensor_data(m->parts[p]), ag_tensor_data(m->parts[p + 1]));
        }
    }
    ag__free(cls);
    ag__free(tile);
    if (rc) {
        ag_block_mask_free(m);
        return NULL;
    }
    return m;
}

void ag__block_mask_mod(const ag_block_mask *m, ag_mask_mod *out) {
    *out = (ag_mask_mod){m->fn, m->ud, m->bufs, m->nbuf};
}

ag_block_mask *ag__block_mask_retain(const ag_block_mask *m) {
    ag_block_mask *w = (ag_block_mask *)m;
    w->refs++;
    return w;
}

ag_tensor *ag_block_mask_tensor(const ag_block_mask *m, ag_block_mask_part part) {
    if (!m || (int)part < 0 || (int)part >= 8)
        return NULL;
    return m->parts[part];
}

int ag_block_mask_shape(const ag_block_mask *m, int64_t out[6]) {
    AG__CHECK_NULL("block_mask_shape", m);
    AG__CHECK_NULL("block_mask_shape", out);
    int64_t v[6] = {m->B, m->H, m->L, m->S, m->QB, m->KB};
    memcpy(out, v, sizeof v);
    return 0;
}

/* ---- flex_attention and its autograd node ---- */

typedef struct flex_saved {
    flex f;               /* sizes, scale, tiles, block mask, score_mod (pointers below) */
    ag_tensor *q, *k, *v; /* kept, contiguous, detached */
    ag_tensor *out, *lse; /* kept, detached */
    ag_block_mask *bm;    /* a reference */
    ag_tensor **bufs;     /* kept: score_mod's buffers */
    int nbuf;
    int nout;
} flex_saved;

static void saved_free(void *p) {
    flex_saved *s = p;
    if (!s)
        return;
    ag_tensor_free(s->q);
    ag_tensor_free(s->k);
    ag_tensor_free(s->v);
    ag_tensor_free(s->out);
    ag_tensor_free(s->lse);
    ag_block_mask_free(s->bm);
    for (int i = 0; i < s->nbuf; i++)
        ag_tensor_free(s->bufs[i]);
    ag__free(s->bufs);
    ag__free(s);
}

static ag_tensor *contiguous_data(ag_tensor *t) {
    ag_tensor *c = ag_contiguous(t);
    return c ? ag_detach(c) : NULL;
}

/* flex_attention_backward: gradients of q, k, v and score_mod's buffers. */
static int flex_backward(void *ud, ag_tensor *const *gout, int nout, ag_tensor **gin, int nin,
                         const bool *needs) {
    flex_saved *s = ud;
    if (flex_depth)
        return ag__err(AG_EINVAL, "flex_attention: backward inside a score_mod or mask_mod");
    flex f = s->f;
    bool prev = ag_set_grad_enabled(false);
    ag_tensor *dout = gout[0] ? contiguous_data(gout[0]) : ag_zeros_like(s->out);
    ag_tensor *dlse = nout > 1 && gout[1] ? contiguous_data(gout[1]) : NULL;
    ag_tensor *dq = ag_zeros_like(s->q), *dk = ag_zeros_like(s->k), *dv = ag_zeros_like(s->v);
    ag_tensor *leaves[64] = {0}, *sgrad[64] = {0};
    bool sneed[64] = {0};
    int rc = dout && dq && dk && dv && (nout < 2 || !gout[1] || dlse) ? 0 : failed();
    ag_set_grad_enabled(prev);
    for (int i = 0; i < s->nbuf && !rc; i++) {
        sneed[i] = needs[3 + i];
        if (!(leaves[i] = ag_detach(s->bufs[i])))
            rc = failed();
        else if (sneed[i] && ag_dtype_is_float(ag_tensor_dtype(leaves[i])))
            rc = ag_tensor_set_requires_grad(leaves[i], true);
        else
            sneed[i] = false;
    }
    if (!rc) {
        f.q = ag_tensor_data(s->q);
        f.k = ag_tensor_data(s->k);
        f.v = ag_tensor_data(s->v);
        f.out = ag_tensor_data(s->out);
        f.lse = ag_tensor_data(s->lse);
        f.dout = ag_tensor_data(dout);
        f.dlse = dlse ? ag_tensor_data(dlse) : NULL;
        f.dq = ag_tensor_data(dq);
        f.dk = ag_tensor_data(dk);
        f.dv = ag_tensor_data(dv);
        f.sbuf = leaves;
        f.nsbuf = s->nbuf;
        f.sgrad = sgrad;
        f.sneed = sneed;
        f.bm = s->bm;
        flex_depth++;
        rc = run_rows_traced(&f, true, sgrad);
        flex_depth--;
    }
    if (!rc) {
        ag_tensor *g[3] = {dq, dk, dv};
        for (int j = 0; j < 3; j++)
            gin[j] = needs[j] ? g[j] : NULL;
        for (int i = 0; i < s->nbuf && i + 3 < nin; i++)
            gin[3 + i] = sneed[i] && sgrad[i] ? ag__give(ag_tensor_keep(sgrad[i])) : NULL;
    }
    for (int i = 0; i < s->nbuf; i++)
        ag_tensor_free(sgrad[i]);
    return rc;
}

static int check_inputs(ag_tensor *q, ag_tensor *k, ag_tensor *v, const ag_score_mod *sm,
                        const ag_block_mask *bm, const ag_flex_opts *o) {
    AG__CHECK_NULL("flex_attention", q);
    AG__CHECK_NULL("flex_attention", k);
    AG__CHECK_NULL("flex_attention", v);
    ag_tensor *t[3] = {q, k, v};
    const char *nm[3] = {"query", "key", "value"};
    for (int i = 0; i < 3; i++) {
        char buf[128];
        if (ag_tensor_ndim(t[i]) != 4)
            return ag__err(AG_EINVAL, "flex_attention: %s must be 4-d [B, H, len, dim], got %s",
                           nm[i], ag_tensor_meta_str(t[i], buf, sizeof buf));
        if (ag_tensor_dtype(t[i]) != AG_F32 && ag_tensor_dtype(t[i]) != AG_F64)
            return ag__err(AG_EINVAL, "flex_attention: %s must be float32 or float64, got %s",
                           nm[i], ag_dtype_name(ag_tensor_dtype(t[i])));
        if (ag_tensor_dtype(t[i]) != ag_tensor_dtype(q))
            return ag__err(
                AG_EINVAL,
                "flex_attention: query, key and value must have one dtype, got %s, %s, %s",
                ag_dtype_name(ag_tensor_dtype(q)), ag_dtype_name(ag_tensor_dtype(k)),
                ag_dtype_name(ag_tensor_dtype(v)));
    }
    const int64_t *qs = ag_tensor_sizes(q), *ks = ag_tensor_sizes(k), *vs = ag_tensor_sizes(v);
    if (qs[0] != ks[0] || qs[0] != vs[0] || qs[3] != ks[3] || ks[1] != vs[1] || ks[2] != vs[2])
        return ag__err(AG_EINVAL,
                       "flex_attention: sizes do not match: query [%lld, %lld, %lld, %lld], key "
                       "[%lld, %lld, %lld, %lld], value [%lld, %lld, %lld, %lld] (want query [B, "
                       "Hq, L, E], key [B, Hkv, S, E], value [B, Hkv, S, Ev])",
                       (long long)qs[0], (long long)qs[1], (long long)qs[2], (long long)qs[3],
                       (long long)ks[0], (long long)ks[1], (long long)ks[2], (long long)ks[3],
                       (long long)vs[0], (long long)vs[1], (long long)vs[2], (long long)vs[3]);
    const bool gqa = o && o->enable_gqa;
    if (qs[1] != ks[1] && !(gqa && ks[1] > 0 && qs[1] % ks[1] == 0))
        return ag__err(AG_EINVAL, "flex_attention: query has %lld heads and key/value %lld: %s",
                       (long long)qs[1], (long long)ks[1],
                       gqa ? "with enable_gqa the query's heads must be a multiple of the key's"
                           : "they must match unless enable_gqa is set");
    if (bm) {
        if (bm->L != qs[2] || bm->S != ks[2])
            return ag__err(AG_EINVAL,
                           "flex_attention: the block mask is for Q_LEN=%lld, KV_LEN=%lld; query "
                           "length is %lld, key length %lld",
                           (long long)bm->L, (long long)bm->S, (long long)qs[2], (long long)ks[2]);
        if ((bm->B != 1 && bm->B != qs[0]) || (bm->H != 1 && bm->H != qs[1]))
            return ag__err(AG_EINVAL,
                           "flex_attention: the block mask's B=%lld, H=%lld must be 1 or the "
                           "query's (%lld, %lld)",
                           (long long)bm->B, (long long)bm->H, (long long)qs[0], (long long)qs[1]);
    }
    if (o && (!isfinite(o->scale) || o->q_block_size < 0 || o->kv_block_size < 0))
        return ag__err(AG_EINVAL, "flex_attention: bad options (scale %g, block sizes %lld, %lld)",
                       o->scale, (long long)o->q_block_size, (long long)o->kv_block_size);
    if (sm && sm->fn) {
        if (sm->nbuffers < 0 || sm->nbuffers > 64 || (sm->nbuffers > 0 && !sm->buffers))
            return ag__err(AG_EINVAL,
                           "flex_attention: bad score_mod buffer list (%d buffers, at most 64)",
                           sm->nbuffers);
        for (int i = 0; i < sm->nbuffers; i++)
            if (!sm->buffers[i])
                return ag__err(AG_EINVAL, "flex_attention: score_mod buffer %d is NULL", i);
    }
    if (flex_depth)
        return ag__err(AG_EINVAL, "flex_attention: called inside a score_mod or mask_mod");
    return 0;
}

/* Sizes, scale and tiles of a call. */
static void setup_flex(flex *f, const ag_tensor *q, const ag_tensor *k, const ag_tensor *v,
                       const ag_block_mask *block_mask, const ag_flex_opts *opts) {
    const int64_t *qs = ag_tensor_sizes(q), *ks = ag_tensor_sizes(k), *vs = ag_tensor_sizes(v);
    f->dt = ag_tensor_dtype(q);
    f->B = qs[0];
    f->Hq = qs[1];
    f->Hkv = ks[1];
    f->G = f->Hkv ? f->Hq / f->Hkv : 1;
    f->L = qs[2];
    f->S = ks[2];
    f->E = qs[3];
    f->Ev = vs[3];
    f->scale = opts && opts->scale != 0 ? opts->scale : 1.0 / sqrt((double)(f->E ? f->E : 1));
    f->QB = block_mask ? block_mask->QB : opts && opts->q_block_size ? opts->q_block_size : 128;
    f->KB = block_mask ? block_mask->KB : opts && opts->kv_block_size ? opts->kv_block_size : 128;
    f->nq = (f->L + f->QB - 1) / f->QB;
    f->nk = (f->S + f->KB - 1) / f->KB;
}

int ag__flex_attention_backward(ag_tensor *q, ag_tensor *k, ag_tensor *v, ag_tensor *out,
                                ag_tensor *lse, ag_tensor *grad_out, ag_tensor *grad_lse,
                                const ag_score_mod *score_mod, const ag_block_mask *block_mask,
                                double scale, ag_tensor **grads) {
    const ag_score_mod *sm = score_mod && score_mod->fn ? score_mod : NULL;
    int rc = check_inputs(q, k, v, sm, block_mask, NULL);
    if (rc)
        return rc;
    const ag_tensor *chk[2] = {out, lse};
    for (int i = 0; i < 2; i++)
        if (!chk[i] || ag_tensor_dtype(chk[i]) != ag_tensor_dtype(q) ||
            ag_tensor_ndim(chk[i]) != 4 - i)
            return ag__err(AG_EINVAL, "flex_attention_backward: bad %s", i ? "logsumexp" : "out");
    flex_saved s = {0};
    ag_flex_opts o = {.scale = scale};
    setup_flex(&s.f, q, k, v, block_mask, &o);
    s.f.bm = s.bm = (ag_block_mask *)block_mask;
    if (sm) {
        s.f.sfn = sm->fn;
        s.f.sud = sm->ud;
        s.bufs = (ag_tensor **)sm->buffers;
        s.nbuf = sm->nbuffers;
    }
    bool prev = ag_set_grad_enabled(false);
    s.q = contiguous_data(q);
    s.k = contiguous_data(k);
    s.v = contiguous_data(v);
    s.out = contiguous_data(out);
    s.lse = contiguous_data(lse);
    ag_set_grad_enabled(prev);
    if (!s.q || !s.k || !s.v || !s.out || !s.lse)
        return failed();
    bool needs[3 + 64];
    for (int i = 0; i < 3 + s.nbuf; i++)
        needs[i] = true;
    ag_tensor *gout[2] = {grad_out, grad_lse};
    return flex_backward(&s, gout, 2, grads, 3 + s.nbuf, needs);
}

/* m (zeroed by the caller) <- the sizes of a block mask over parts with sizes, the parts
 * borrowed; AG_EINVAL when the parts do not fit the sizes. */
static int mask_over_parts(ag_block_mask *m, ag_tensor *const *parts, const int64_t *sizes) {
    const int64_t S = sizes[0], L = sizes[1], QB = sizes[2], KB = sizes[3];
    if (L < 1 || S < 1 || QB < 1 || KB < 1)
        return ag__err(AG_EINVAL, "flex_attention: bad block mask sizes (%lld, %lld, %lld, %lld)",
                       (long long)S, (long long)L, (long long)QB, (long long)KB);
    const int64_t nq = (L + QB - 1) / QB, nk = (S + KB - 1) / KB;
    for (int p = 0; p < 8; p++) {
        const ag_tensor *t = parts[p];
        const bool q_side = p >= AG_BM_Q_NUM_BLOCKS, is_num = p % 2 == 0;
        const int64_t rows = q_side ? nk : nq, cols = q_side ? nq : nk;
        if (!t || ag_tensor_dtype(t) != AG_I64 || !ag_tensor_is_contiguous(t) ||
            ag_tensor_ndim(t) != (is_num ? 3 : 4) ||
            ag_tensor_size(t, 0) != ag_tensor_size(parts[0], 0) ||
            ag_tensor_size(t, 1) != ag_tensor_size(parts[0], 1) || ag_tensor_size(t, 2) != rows ||
            (!is_num && ag_tensor_size(t, 3) != cols))
            return ag__err(AG_EINVAL,
                           "flex_attention: block mask tensor %d does not fit Q_LEN=%lld, "
                           "KV_LEN=%lld in %lld x %lld blocks",
                           p, (long long)L, (long long)S, (long long)QB, (long long)KB);
    }
    m->refs = 1;
    m->B = ag_tensor_size(parts[0], 0);
    m->H = ag_tensor_size(parts[0], 1);
    m->L = L;
    m->S = S;
    m->QB = QB;
    m->KB = KB;
    m->nq = nq;
    m->nk = nk;
    for (int p = 0; p < 8; p++)
        m->parts[p] = parts[p];
    return 0;
}

/* ---- the helpers of the raw kernel's callers (flex_internal.h) ---- */

bool ag__flex_fits_tile(const ag_tmeta *m, int64_t bq, int64_t bk) {
    if (m->ndim > 2)
        return false;
    for (int d = 0; d < m->ndim; d++) {
        const int64_t want = d == m->ndim - 1 ? bk : bq, n = m->sizes[d];
        if (n != 1 && n != want)
            return false;
    }
    return true;
}

bool ag__flex_reduces_to(const ag_tmeta *g, const ag_tmeta *b) {
    if (!ag_dtype_is_float(g->dtype) || !ag_dtype_is_float(b->dtype) || g->ndim < b->ndim)
        return false;
    for (int d = 0; d < b->ndim; d++) {
        const int64_t gs = g->sizes[g->ndim - b->ndim + d];
        if (gs != b->sizes[d] && b->sizes[d] != 1)
            return false;
    }
    return true;
}

static double get_f(const void *p, ag_dtype dt, int64_t i) {
    return dt == AG_F32 ? (double)((const float *)p)[i] : ((const double *)p)[i];
}

void ag__flex_store_tile(const ag_tensor *r, ag_dtype dt, int64_t bq, int64_t bk, void *dst,
                         int64_t ld) {
    const int nd = ag_tensor_ndim(r);
    const int64_t *sz = ag_tensor_sizes(r);
    const int64_t si = nd == 2 && sz[0] > 1 ? sz[1] : 0;
    const int64_t sj = nd >= 1 && sz[nd - 1] > 1 ? 1 : 0;
    const ag_dtype rd = ag_tensor_dtype(r);
    const void *src = ag_tensor_data(r);
    const size_t es = ag_dtype_size(dt);
    for (int64_t i = 0; i < bq; i++) {
        char *row = (char *)dst + (size_t)(i * ld) * es;
        if (rd == dt && sj == 1) {
            memcpy(row, (const char *)src + (size_t)(i * si) * es, (size_t)bk * es);
            continue;
        }
        for (int64_t j = 0; j < bk; j++) {
            const int64_t at = i * si + j * sj;
            if (dt == AG_BOOL)
                ((uint8_t *)row)[j] = ((const uint8_t *)src)[at] != 0;
            else if (dt == AG_F32)
                ((float *)row)[j] = (float)get_f(src, rd, at);
            else
                ((double *)row)[j] = get_f(src, rd, at);
        }
    }
}

void ag__flex_add_reduced(ag_tensor *acc, const ag_tensor *g) {
    const int nd = ag_tensor_ndim(g), na = ag_tensor_ndim(acc);
    const int64_t *gs = ag_tensor_sizes(g), *as = ag_tensor_sizes(acc);
    int64_t astride[AG_MAX_DIMS], idx[AG_MAX_DIMS] = {0}, st = 1;
    for (int d = na - 1; d >= 0; d--) {
        astride[d] = as[d] > 1 ? st : 0;
        st *= as[d];
    }
    const int64_t n = ag_tensor_numel(g);
    const ag_dtype gd = ag_tensor_dtype(g), ad = ag_tensor_dtype(acc);
    const void *src = ag_tensor_data(g);
    void *dst = ag_tensor_data(acc);
    int64_t off = 0;
    for (int64_t e = 0; e < n; e++) {
        const double x = get_f(src, gd, e);
        if (ad == AG_F32)
            ((float *)dst)[off] += (float)x;
        else
            ((double *)dst)[off] += x;
        for (int d = nd - 1; d >= 0; d--) { /* next index, off following it */
            const int da = d - (nd - na);
            const int64_t s = da >= 0 ? astride[da] : 0;
            if (++idx[d] < gs[d]) {
                off += s;
                break;
            }
            off -= s * (gs[d] - 1);
            idx[d] = 0;
        }
    }
}

ag__flex_raw ag__flex_raw_of(bool bwd, double scale, const ag_tensor *q, const ag_tensor *k,
                             const ag_tensor *v) {
    const int64_t *qs = ag_tensor_sizes(q), *ks = ag_tensor_sizes(k);
    return (ag__flex_raw){.bwd = bwd,
                          .dt = ag_tensor_dtype(q),
                          .B = qs[0],
                          .Hq = qs[1],
                          .Hkv = ks[1],
                          .L = qs[2],
                          .S = ks[2],
                          .E = qs[3],
                          .Ev = ag_tensor_size(v, 3),
                          .scale = scale,
                          .q = ag_tensor_data(q),
                          .k = ag_tensor_data(k),
                          .v = ag_tensor_data(v)};
}

int ag__flex_run_raw(const ag__flex_raw *r) {
    ag_block_mask m = {0};
    int rc = mask_over_parts(&m, r->parts, r->sizes);
    if (rc)
        return rc;
    if ((r->dt != AG_F32 && r->dt != AG_F64) || m.L != r->L || m.S != r->S ||
        (m.B != 1 && m.B != r->B) || (m.H != 1 && m.H != r->Hq) || r->Hkv < 1 || r->Hq % r->Hkv ||
        (r->bwd && !r->dout))
        return ag__err(AG_EINVAL,
                       "flex_attention: the call does not fit its block mask (B=%lld, H=%lld, "
                       "Q_LEN=%lld, KV_LEN=%lld) or its dtype %s",
                       (long long)m.B, (long long)m.H, (long long)m.L, (long long)m.S,
                       ag_dtype_name(r->dt));
    if (flex_depth)
        return ag__err(AG_EINVAL, "flex_attention: called inside a score_mod or mask_mod");
    const int64_t *part_n = ag_tensor_data(m.parts[AG_BM_KV_NUM_BLOCKS]);
    for (int64_t i = 0; i < m.B * m.H * m.nq && !(r->fns && r->fns->mask); i++)
        if (part_n[i])
            return ag__err(AG_EINVAL, "flex_attention: the block mask has partial blocks but "
                                      "no mask_mod");
    flex f = {.dt = r->dt,
              .B = r->B,
              .Hq = r->Hq,
              .Hkv = r->Hkv,
              .G = r->Hq / r->Hkv,
              .L = r->L,
              .S = r->S,
              .E = r->E,
              .Ev = r->Ev,
              .scale = r->scale,
              .q = r->q,
              .k = r->k,
              .v = r->v,
              .out = r->out,
              .lse = r->lse,
              .dout = r->dout,
              .dlse = r->dlse,
              .dq = r->dq,
              .dk = r->dk,
              .dv = r->dv,
              .QB = m.QB,
              .KB = m.KB,
              .nq = m.nq,
              .nk = m.nk,
              .bm = &m,
              .tf = r->fns};
    if (r->bwd) {
        const size_t es = ag_dtype_size(r->dt);
        memset(r->dq, 0, (size_t)(r->B * r->Hq * r->L * r->E) * es);
        memset(r->dk, 0, (size_t)(r->B * r->Hkv * r->S * r->E) * es);
        memset(r->dv, 0, (size_t)(r->B * r->Hkv * r->S * r->Ev) * es);
    }
    flex_depth++;
    rc = run_rows(&f, r->bwd);
    flex_depth--;
    return rc;
}

ag_block_mask *ag__block_mask_from_parts(ag_tensor *const *parts, const int64_t *sizes,
                                         const ag_mask_mod *mask_mod) {
    ag_block_mask over = {0};
    if (mask_over_parts(&over, parts, sizes))
        return NULL;
    const int nbuf = mask_mod && mask_mod->fn ? mask_mod->nbuffers : 0;
    ag_block_mask *m = ag__calloc(1, sizeof *m);
    if (!m || (nbuf && !(m->bufs = ag__calloc((size_t)nbuf, sizeof *m->bufs)))) {
        ag__free(m);
        return NULL;
    }
    ag_tensor **bufs = m->bufs;
    *m = over;
    m->bufs = bufs;
    for (int p = 0; p < 8; p++)
        m->parts[p] = ag_tensor_keep(parts[p]);
    if (mask_mod && mask_mod->fn) {
        m->fn = mask_mod->fn;
        m->ud = mask_mod->ud;
        for (int i = 0; i < nbuf; i++, m->nbuf++)
            m->bufs[i] = ag_tensor_keep(mask_mod->buffers[i]);
    }
    return m;
}

int ag_flex_attention(ag_tensor *q, ag_tensor *k, ag_tensor *v, const ag_score_mod *score_mod,
                      const ag_block_mask *block_mask, const ag_flex_opts *opts, ag_tensor **out,
                      ag_tensor **lse) {
    AG__CHECK_NULL("flex_attention", out);
    *out = NULL;
    if (lse)
        *lse = NULL;
    int rc = check_inputs(q, k, v, score_mod, block_mask, opts);
    if (rc)
        return rc;
    if (ag__tls()->tracing) {
        if (!ag__flex_trace_hook)
            return ag__err(AG_EINVAL, "flex_attention: tracing without the tracer's hook");
        const double sc =
            opts && opts->scale != 0
                ? opts->scale
                : 1.0 / sqrt((double)(ag_tensor_size(q, 3) ? ag_tensor_size(q, 3) : 1));
        return ag__flex_trace_hook(q, k, v, score_mod && score_mod->fn ? score_mod : NULL,
                                   block_mask, sc, out, lse);
    }
    const ag_score_mod *sm = score_mod && score_mod->fn ? score_mod : NULL;
    flex_saved *s = ag__calloc(1, sizeof *s);
    if (!s ||
        (sm && sm->nbuffers && !(s->bufs = ag__calloc((size_t)sm->nbuffers, sizeof *s->bufs)))) {
        ag__free(s);
        return AG_ENOMEM;
    }
    flex *f = &s->f;
    setup_flex(f, q, k, v, block_mask, opts);
    if (block_mask) {
        s->bm = (ag_block_mask *)block_mask;
        s->bm->refs++;
    }
    f->bm = s->bm;
    if (sm) {
        f->sfn = sm->fn;
        f->sud = sm->ud;
        for (int i = 0; i < sm->nbuffers; i++, s->nbuf++)
            s->bufs[i] = ag_tensor_keep(sm->buffers[i]);
        f->sbuf = s->bufs;
        f->nsbuf = s->nbuf;
    }
    s->nout = lse ? 2 : 1;

    ag_scope_begin();
    bool prev = ag_set_grad_enabled(false);
    ag_tensor *qc = contiguous_data(q), *kc = contiguous_data(k), *vc = contiguous_data(v);
    int64_t osz[4] = {f->B, f->Hq, f->L, f->Ev};
    ag_tensor *o = ag_empty(f->dt, 4, osz), *l = ag_empty(f->dt, 3, osz);
    ag_set_grad_enabled(prev);
    if (!qc || !kc || !vc || !o || !l)
        rc = failed();
    if (!rc) {
        s->q = ag_tensor_keep(qc);
        s->k = ag_tensor_keep(kc);
        s->v = ag_tensor_keep(vc);
        f->q = ag_tensor_data(qc);
        f->k = ag_tensor_data(kc);
        f->v = ag_tensor_data(vc);
        f->out = ag_tensor_data(o);
        f->lse = ag_tensor_data(l);
        flex_depth++;
        rc = run_rows_traced(f, false, NULL);
        flex_depth--;
    }
    ag_tensor *res[2] = {NULL, NULL};
    if (!rc) {
        res[0] = ag_tensor_keep(o);
        res[1] = ag_tensor_keep(l);
        ag_tensor *od = ag_detach(o), *ld = ag_detach(l);
        if (!res[0] || !res[1] || !od || !ld)
            rc = failed();
        else {
            s->out = ag_tensor_keep(od);
            s->lse = ag_tensor_keep(ld);
        }
    }
    ag_scope_end();
    if (!rc) {
        /* the node's inputs: q, k, v and score_mod's buffers */
        ag_tensor *ins[3 + 64] = {q, k, v};
        for (int i = 0; i < s->nbuf; i++)
            ins[3 + i] = s->bufs[i];
        bool diff[2] = {true, true};
        rc = ag__autograd_custom("FlexAttentionBackward0", ins, 3 + s->nbuf, res, s->nout, diff,
                                 flex_backward, s, saved_free);
        s = NULL; /* owned by the node, or freed */
    }
    saved_free(s);
    return ag__flex_hand_out(rc, res, out, lse);
}

int ag__flex_hand_out(int rc, ag_tensor *res[2], ag_tensor **out, ag_tensor **lse) {
    if (rc) {
        ag_tensor_free(res[0]);
        ag_tensor_free(res[1]);
        return rc;
    }
    *out = ag__give(res[0]);
    if (lse)
        *lse = ag__give(res[1]);
    else
        ag_tensor_free(res[1]);
    return *out && (!lse || *lse) ? 0 : AG_ENOMEM;
}
