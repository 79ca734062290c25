/* The executor's flex_attention / flex_attention_backward steps (flex_hop.c's higher-order
 * ops; plan.c runs them as steps like multi-output kernels).
 *
 * At ag_plan_new, a step's score graph (sdpa_score0 / fw_graph0), mask graph (sdpa_mask0 /
 * mask_graph0) and, for the backward, joint graph (joint_graph0) are each planned once per tile
 * shape the call has (the full Q_BLOCK_SIZE x KV_BLOCK_SIZE tile and the edge tiles: at most
 * four): a copy of the 0-d graph whose placeholders take the tile's shapes, so its ops run
 * broadcast over the tile as upstream's vmap runs them (ag__flex_tile_graph: a buffer's
 * gradient, an index_put accumulating one element, adds every tile position's), with its own
 * plan, the tile's index tensors and the plan's output destinations made then too. At a run the
 * kernel (ag__flex_run_raw) calls, per tile, the score plan on the tile's scores, the mask plan
 * on each partial tile, and in the backward the joint plan (score, b, h, q_idx, kv_idx,
 * grad_score, buffers -> grad_score, the buffers' gradients) on the raw scores and the
 * gradient of the modified ones, as upstream's flex_attention_backward runs joint_graph; each
 * tile's buffer gradients are summed into the step's gradient outputs. The step's outputs are
 * written in place (out, logsumexp, grad q, k, v, buffer grads); inputs that are not contiguous
 * are copied into tensors the step keeps. A warm run allocates nothing. An identity score graph
 * (and its joint returning grad_score) runs nothing per tile, and the tiles then run on all
 * threads.
 *
 * A step whose graphs cannot be planned on tiles (an op that does not broadcast over the tile,
 * a result of another shape) runs the interpreter's code instead (ag__flex_call_run: its graphs
 * interpreted per tile, score_mod's gradient through autograd on the score graph), which
 * allocates per run. */
#include "plan_internal.h"
#include "../autograd/flex_internal.h"
#include "../graph/graph_internal.h"

#include <stdio.h>

enum { FN_SCORE, FN_MASK, FN_JOINT, NFN };
enum { MAX_IN = 70, NTMP = 10, MAX_THREADS = 8 };

typedef struct tile_plan {
    ag_graph *g;                    /* the tile's copy of the graph */
    ag_plan *p;                     /* NULL: no tile of this shape */
    ag_tensor *in[6];               /* the leading inputs (score, b, h, q_idx, kv_idx, grad) */
    ag_tensor *out[AG_MAX_OUTPUTS]; /* the plan's output destinations, NULL for None */
    int nout;
} tile_plan;

typedef struct tile_fn {
    bool on; /* false: nothing to run (an identity, no mask) */
    int nlead;
    /* per thread (nth), by (bq != Q_BLOCK_SIZE) * 2 + (bk != KV_BLOCK_SIZE) */
    tile_plan t[MAX_THREADS][4];
} tile_fn;

struct ag__flex_tiles {
    ag_dtype dt;
    int64_t QB, KB;
    int nsb; /* score_mod buffers */
    int nth; /* threads the tiles run on: each its own tile plans */
    tile_fn fn[NFN];
    ag__flex_tile_fns fns;
    /* this run's */
    ag_tensor *const *sb, *const *mb;
    int nmb;
    ag_tensor *const *bgrad; /* the step's buffer gradients (NULL entries: not needed) */
    ag_tensor **acc;         /* per thread, per buffer: gradient sums (nth > 1; made on use) */
    ag_tensor *tmp[NTMP];    /* contiguous copies, zeros, unneeded outputs (made on first use) */
    int failed;              /* a tile failed: its status, msg its message (first one) */
    char msg[512];
};

static void tile_fn_free(tile_fn *f) {
    for (int s = 0; s < 4 * MAX_THREADS; s++) {
        tile_plan *t = &f->t[s / 4][s % 4];
        ag_plan_free(t->p);
        ag_graph_free(t->g);
        for (int i = 0; i < 6; i++)
            ag_tensor_free(t->in[i]);
        for (int i = 0; i < t->nout; i++)
            ag_tensor_free(t->out[i]);
    }
}

void ag__plan_flex_free(pflex *f) {
    ag_graph_free(f->score);
    ag_graph_free(f->mask);
    ag_graph_free(f->joint);
    if (!f->tiles)
        return;
    for (int k = 0; k < NFN; k++)
        tile_fn_free(&f->tiles->fn[k]);
    for (int i = 0; i < NTMP; i++)
        ag_tensor_free(f->tiles->tmp[i]);
    for (int i = 0; f->tiles->acc && i < f->tiles->nth * f->tiles->nsb; i++)
        ag_tensor_free(f->tiles->acc[i]);
    ag__free(f->tiles->acc);
    ag__free(f->tiles);
    f->tiles = NULL;
}

/* The bytes the step's tile plans hold for intermediates: their arenas, every thread's. */
int64_t ag__plan_flex_bytes(const pflex *f) {
    int64_t b = 0;
    for (int k = 0; f->tiles && k < NFN; k++)
        for (int s = 0; s < 4 * MAX_THREADS; s++)
            b += ag_plan_peak_bytes(f->tiles->fn[k].t[s / 4][s % 4].p);
    return b;
}

/* ---- building ---- */

/* The plan of graph g (function kind) for tiles [bq, bk]: 0, or a status (the step then falls
 * back to the interpreter's code). */
static int tile_plan_build(tile_plan *t, const ag_graph *g, int kind, ag_dtype dt, int64_t bq,
                           int64_t bk, const ag_tmeta *bufs, int nbuf, const ag_plan_opts *o) {
    const int64_t tile[2] = {bq, bk}, col[2] = {bq, 1}, row[2] = {1, bk};
    ag_tmeta m[MAX_IN];
    int n = 0;
    if (kind != FN_MASK)
        ag__tmeta_contiguous(&m[n++], dt, 2, tile);
    ag__tmeta_contiguous(&m[n++], AG_I64, 0, NULL);
    ag__tmeta_contiguous(&m[n++], AG_I64, 0, NULL);
    ag__tmeta_contiguous(&m[n++], AG_I64, 2, col);
    ag__tmeta_contiguous(&m[n++], AG_I64, 2, row);
    if (kind == FN_JOINT)
        ag__tmeta_contiguous(&m[n++], dt, 2, tile);
    const int nlead = n;
    if (nlead + nbuf > MAX_IN)
        return ag__err(AG_EINVAL, "flex_attention: %d buffers", nbuf);
    for (int i = 0; i < nbuf; i++)
        m[n++] = bufs[i];
    if (!(t->g = ag__flex_tile_graph(g, m, n, bq, bk)) || !(t->p = ag_plan_new(t->g, o)))
        return ag_last_status() < 0 ? ag_last_status() : AG_ENOMEM;
    for (int i = 0; i < nlead; i++)
        if (!(t->in[i] = ag__tensor_new(m[i].dtype, m[i].ndim, m[i].sizes, false)))
            return AG_ENOMEM;
    const ag_garg *oa = ag_node_arg(ag_graph_output_node(t->g), 0);
    const int want = kind == FN_JOINT ? 5 + nbuf : 1;
    if (!oa || oa->kind != AG_GA_NODES || oa->n != want || oa->n > AG_MAX_OUTPUTS)
        return ag__err(AG_EINVAL, "flex_attention: the graph has %d outputs, expected %d",
                       oa ? oa->n : 0, want);
    for (int i = 0; i < oa->n; i++) {
        const ag_node *x = oa->u.nodes[i];
        const ag_tmeta *v = x && ag_node_num_vals(x) == 1 ? ag_node_val(x, 0) : NULL;
        if (x && !v)
            return ag__err(AG_EINVAL, "flex_attention: output %d is not a tensor", i);
        bool ok = true;
        if (i == 0 && v)
            ok = ag__flex_fits_tile(v, bq, bk) &&
                 (kind == FN_MASK ? v->dtype == AG_BOOL : ag_dtype_is_float(v->dtype));
        else if (i == 0)
            ok = kind == FN_JOINT; /* a score_mod ignoring the score: no gradient */
        else if (i >= 5 && v)
            ok = ag__flex_reduces_to(v, &bufs[i - 5]);
        if (!ok)
            return ag__err(AG_EINVAL, "flex_attention: output %d does not fit the tile", i);
        t->nout = i + 1;
        if (v && !(t->out[i] = ag__tensor_new(v->dtype, v->ndim, v->sizes, false)))
            return AG_ENOMEM;
    }
    return 0;
}

/* Whether g returns its placeholder number ph as output 0 and None everywhere else (the
 * identity score_mod, its joint). */
static bool returns_placeholder(const ag_graph *g, int ph) {
    const ag_node *o = ag_graph_output_node(g);
    const ag_garg *oa = o ? ag_node_arg(o, 0) : NULL;
    if (!oa || oa->kind != AG_GA_NODES || oa->n < 1 || !oa->u.nodes[0] ||
        ag_node_kind_of(oa->u.nodes[0]) != AG_NODE_PLACEHOLDER)
        return false;
    for (int i = 1; i < oa->n; i++)
        if (oa->u.nodes[i])
            return false;
    int j = 0;
    for (const ag_node *y = ag_graph_first(g); y && y != oa->u.nodes[0]; y = ag_node_next(y))
        j += ag_node_kind_of(y) == AG_NODE_PLACEHOLDER;
    return j == ph;
}

/* The metadata of the n buffers (tuple elements, each a tensor node) into m. */
static void buffer_metas(const ag_garg *elems, int n, ag_tmeta *m) {
    for (int k = 0; k < n; k++)
        m[k] = *ag_node_val(elems[k].u.node, 0);
}

/* The tile plans of graphs score, mask (may be NULL) and, for the backward (bwd), joint, for
 * calls of dtype dt over L x S in QB x KB tiles with score_mod buffers sb[nsb] and mask_mod
 * buffers mb[nmb] (their metadata); NULL with the error set and its status in *status when one
 * cannot be made. */
static struct ag__flex_tiles *tiles_new(const ag_plan_opts *o, ag_dtype dt, int64_t L, int64_t S,
                                        int64_t QB, int64_t KB, const ag_tmeta *sb, int nsb,
                                        const ag_tmeta *mb, int nmb, const ag_graph *score,
                                        const ag_graph *mask, const ag_graph *joint, bool bwd,
                                        int *status) {
    if (bwd && !joint) {
        *status = ag__err(AG_EINVAL, "flex_attention: unexpected arguments");
        return NULL;
    }
    struct ag__flex_tiles *st = ag__calloc(1, sizeof *st);
    if (!st) {
        *status = AG_ENOMEM;
        return NULL;
    }
    st->dt = dt;
    st->QB = QB;
    st->KB = KB;
    st->nsb = nsb;
    st->nth = ag_get_num_threads() < MAX_THREADS ? ag_get_num_threads() : MAX_THREADS;
    if (st->nth < 1)
        st->nth = 1;
    const int64_t bqs[2] = {L >= st->QB ? st->QB : 0, L % st->QB};
    const int64_t bks[2] = {S >= st->KB ? st->KB : 0, S % st->KB};
    const ag_graph *gs[NFN] = {score, mask, joint};
    const ag_tmeta *bufs[NFN] = {sb, mb, sb};
    const int nbufs[NFN] = {nsb, nmb, nsb};
    st->fn[FN_SCORE].on = !returns_placeholder(score, 0);
    st->fn[FN_MASK].on = mask != NULL;
    st->fn[FN_JOINT].on = bwd && !returns_placeholder(joint, 5);
    int rc = 0;
    for (int k = 0; k < NFN && !rc; k++) {
        tile_fn *f = &st->fn[k];
        f->nlead = k == FN_MASK ? 4 : k == FN_JOINT ? 6 : 5;
        const int nth = k == FN_MASK ? 1 : st->nth; /* masks: evaluated serially */
        for (int th = 0; th < nth && f->on && !rc; th++)
            for (int i = 0; i < 2 && !rc; i++)
                for (int j = 0; j < 2 && !rc; j++)
                    if (bqs[i] > 0 && bks[j] > 0)
                        rc = tile_plan_build(&f->t[th][i * 2 + j], gs[k], k, st->dt, bqs[i], bks[j],
                                             bufs[k], nbufs[k], o);
    }
    if (rc) {
        pflex tmp = {.tiles = st};
        ag__plan_flex_free(&tmp);
        *status = rc;
        return NULL;
    }
    return st;
}

/* The tile plans of step x's graphs (tiles_new). */
static struct ag__flex_tiles *tiles_build(const ag_plan *p, const ag__flex_args *fa,
                                          const ag_graph *score, const ag_graph *mask,
                                          const ag_graph *joint, int *status) {
    ag_tmeta sb[64], mb[64];
    buffer_metas(fa->sb, fa->nsb, sb);
    buffer_metas(fa->mb, fa->nmb, mb);
    const ag_tmeta *qm = ag_node_val(fa->q, 0), *km = ag_node_val(fa->k, 0);
    return tiles_new(&p->opts, qm->dtype, qm->sizes[2], km->sizes[2], fa->sizes[2], fa->sizes[3],
                     sb, fa->nsb, mb, fa->nmb, score, mask, joint, fa->bwd, status);
}

int ag__plan_flex_graphs_of(ag_plan *p, const ag_node *x) {
    ag__flex_args fa;
    if (ag__flex_args_read(ag_node_op(x), ag_node_arg(x, 0), ag_node_nargs(x), &fa)) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", ag_last_error());
        return ag__err(AG_EINVAL, "plan_new: %%%s: %s", ag_node_name(x), msg);
    }
    const ag_node *sn = fa.score, *mn = fa.mask;
    if (ag__grow((void **)&p->flex, &p->flex_cap, p->nflex + 1, sizeof *p->flex))
        return AG_ENOMEM;
    pflex *f = &p->flex[p->nflex];
    *f = (pflex){0};
    memcpy(f->sizes, fa.sizes, sizeof f->sizes);
    f->score = ag_graph_copy(ag_node_subgraph(sn));
    f->mask = mn ? ag_graph_copy(ag_node_subgraph(mn)) : NULL;
    const ag_graph *jg = fa.bwd ? ag_node_subgraph(fa.joint) : NULL;
    f->joint = jg ? ag_graph_copy(jg) : NULL;
    if (!f->score || (mn && !f->mask) || (jg && !f->joint)) {
        ag__plan_flex_free(f);
        return ag_last_status() < 0 ? ag_last_status() : AG_ENOMEM;
    }
    /* the tile plans; without them (graphs that do not run on tiles) the step runs the
     * interpreter's code; out of memory is a failure */
    uint64_t errs = ag__err_count();
    int status = 0;
    f->tiles = tiles_build(p, &fa, f->score, f->mask, f->joint, &status);
    if (!f->tiles && status == AG_ENOMEM) {
        ag__plan_flex_free(f);
        return ag__err(AG_ENOMEM, "plan_new: %s: out of memory planning its graphs' tiles",
                       ag_node_name(x));
    }
    if (!f->tiles && ag__err_count() != errs)
        ag_clear_error();
    p->nflex++;
    return 0;
}

/* ---- the per-tile functions ---- */

static tile_plan *tile_of(struct ag__flex_tiles *st, int kind, int tid, int64_t bq, int64_t bk) {
    return &st->fn[kind].t[tid][(bq != st->QB) * 2 + (bk != st->KB)];
}

/* rc, a tile's failure (on any thread): the first one's message kept for the step. */
static int tile_failed(struct ag__flex_tiles *st, int rc) {
    int none = 0;
    if (rc && __atomic_compare_exchange_n(&st->failed, &none, rc, false, __ATOMIC_ACQ_REL,
                                          __ATOMIC_ACQUIRE))
        snprintf(st->msg, sizeof st->msg, "%s", ag_last_error());
    return rc;
}

/* Sets the tile's b, h, q_idx and kv_idx (t->in from `at`) and runs its plan on them and the
 * buffers. */
static int run_tile(struct ag__flex_tiles *st, int kind, tile_plan *t, int at, int64_t b, int64_t h,
                    int64_t q0, int64_t bq, int64_t k0, int64_t bk) {
    *(int64_t *)ag_tensor_data(t->in[at]) = b;
    *(int64_t *)ag_tensor_data(t->in[at + 1]) = h;
    int64_t *qi = ag_tensor_data(t->in[at + 2]), *ki = ag_tensor_data(t->in[at + 3]);
    for (int64_t i = 0; i < bq; i++)
        qi[i] = q0 + i;
    for (int64_t j = 0; j < bk; j++)
        ki[j] = k0 + j;
    const int nlead = st->fn[kind].nlead;
    ag_tensor *const *bufs = kind == FN_MASK ? st->mb : st->sb;
    const int nbuf = kind == FN_MASK ? st->nmb : st->nsb;
    ag_tensor *in[MAX_IN];
    for (int i = 0; i < nlead; i++)
        in[i] = t->in[i];
    for (int i = 0; i < nbuf; i++)
        in[nlead + i] = bufs[i];
    return tile_failed(st, ag__plan_run_into(t->p, in, nlead + nbuf, t->out, t->nout));
}

static int score_tile(void *ud, int tid, int64_t b, int64_t h, int64_t q0, int64_t bq, int64_t k0,
                      int64_t bk, void *S) {
    struct ag__flex_tiles *st = ud;
    tile_plan *t = tile_of(st, FN_SCORE, tid, bq, bk);
    memcpy(ag_tensor_data(t->in[0]), S, (size_t)(bq * bk) * ag_dtype_size(st->dt));
    int rc = run_tile(st, FN_SCORE, t, 1, b, h, q0, bq, k0, bk);
    if (!rc)
        ag__flex_store_tile(t->out[0], st->dt, bq, bk, S, bk);
    return rc;
}

static int mask_tile(void *ud, int tid, int64_t b, int64_t h, int64_t q0, int64_t bq, int64_t k0,
                     int64_t bk, uint8_t *dst, int64_t ld) {
    struct ag__flex_tiles *st = ud;
    tile_plan *t = tile_of(st, FN_MASK, tid, bq, bk);
    int rc = run_tile(st, FN_MASK, t, 0, b, h, q0, bq, k0, bk);
    if (!rc)
        ag__flex_store_tile(t->out[0], AG_BOOL, bq, bk, dst, ld);
    return rc;
}

static int joint_tile(void *ud, int tid, int64_t b, int64_t h, int64_t q0, int64_t bq, int64_t k0,
                      int64_t bk, const void *S0, void *dS) {
    struct ag__flex_tiles *st = ud;
    tile_plan *t = tile_of(st, FN_JOINT, tid, bq, bk);
    const size_t bytes = (size_t)(bq * bk) * ag_dtype_size(st->dt);
    memcpy(ag_tensor_data(t->in[0]), S0, bytes);
    memcpy(ag_tensor_data(t->in[5]), dS, bytes);
    int rc = run_tile(st, FN_JOINT, t, 1, b, h, q0, bq, k0, bk);
    if (rc)
        return rc;
    if (t->out[0])
        ag__flex_store_tile(t->out[0], st->dt, bq, bk, dS, bk);
    else
        memset(dS, 0, bytes); /* score_mod ignored the score */
    for (int i = 0; i < st->nsb; i++)
        if (t->out[5 + i] && st->bgrad[i])
            ag__flex_add_reduced(st->nth > 1 ? st->acc[tid * st->nsb + i] : st->bgrad[i],
                                 t->out[5 + i]);
    return 0;
}

/* ---- running ---- */

/* The step's tensor `slot` of dtype dt and sizes (contiguous, kept across runs). */
static ag_tensor *tmp_of(struct ag__flex_tiles *st, int slot, ag_dtype dt, int nd,
                         const int64_t *sizes) {
    ag_tensor *c = st->tmp[slot];
    bool same = c && ag_tensor_dtype(c) == dt && ag_tensor_ndim(c) == nd;
    for (int d = 0; same && d < nd; d++)
        same = ag_tensor_size(c, d) == sizes[d];
    if (same)
        return c;
    ag_tensor_free(c);
    st->tmp[slot] = ag__tensor_new(dt, nd, sizes, false);
    if (!st->tmp[slot])
        ag__err(AG_ENOMEM, "flex_attention: out of memory");
    return st->tmp[slot];
}

/* t, or its contiguous copy in tensor `slot`. */
static ag_tensor *contig(struct ag__flex_tiles *st, int slot, ag_tensor *t) {
    if (ag_tensor_is_contiguous(t))
        return t;
    ag_tensor *c = tmp_of(st, slot, ag_tensor_dtype(t), ag_tensor_ndim(t), ag_tensor_sizes(t));
    return c && !ag__copy_into(c, t) ? c : NULL;
}

/* An output the kernel writes: the step's own when contiguous, else tensor `slot` (copied
 * back by put_back). */
static ag_tensor *dest(struct ag__flex_tiles *st, int slot, ag_tensor *out, ag_dtype dt, int nd,
                       const int64_t *sizes) {
    return out && ag_tensor_is_contiguous(out) ? out : tmp_of(st, slot, dt, nd, sizes);
}

static int put_back(ag_tensor *out, ag_tensor *d) {
    return out && out != d ? ag__copy_into(out, d) : 0;
}

/* Zeroes buffer i's gradient bg and, with several threads, each thread's sum for it (made on
 * first use). */
static int zero_acc(struct ag__flex_tiles *st, int i, ag_tensor *bg) {
    const size_t bytes = (size_t)ag_tensor_numel(bg) * ag_dtype_size(ag_tensor_dtype(bg));
    memset(ag_tensor_data(bg), 0, bytes);
    if (st->nth < 2)
        return 0;
    if (!st->acc && !(st->acc = ag__calloc((size_t)(st->nth * st->nsb), sizeof *st->acc)))
        return AG_ENOMEM;
    for (int th = 0; th < st->nth; th++) {
        ag_tensor **a = &st->acc[th * st->nsb + i];
        if (!*a && !(*a = ag__tensor_new(ag_tensor_dtype(bg), ag_tensor_ndim(bg),
                                         ag_tensor_sizes(bg), false)))
            return AG_ENOMEM;
        memset(ag_tensor_data(*a), 0, bytes);
    }
    return 0;
}

/* The kernel's status rc, with the failed tile's message when a tile failed (perhaps on
 * another thread). */
static int raw_failed(struct ag__flex_tiles *st, int rc) {
    if (rc && st->failed)
        return ag__err(rc, "%s", st->msg);
    return rc;
}

/* The planned run of step s: the kernel on raw memory with the tile plans. */
static int run_tiles(const pflex *f, pstep *s, bool bwd) {
    struct ag__flex_tiles *st = f->tiles;
    const ag_arg *a = s->args; /* block_mask: its 13 elements, the tensors bound (2..9) */
    const int ibm = bwd ? 9 : 4, ibuf = bwd ? 12 : 7;
    ag_tensor *q = contig(st, 0, a[0].u.t), *k = contig(st, 1, a[1].u.t);
    ag_tensor *v = contig(st, 2, a[2].u.t);
    if (!q || !k || !v)
        return ag_last_status() < 0 ? ag_last_status() : AG_ENOMEM;
    st->failed = 0;
    st->fns = (ag__flex_tile_fns){st, st->nth, st->fn[FN_SCORE].on ? score_tile : NULL,
                                  st->fn[FN_MASK].on ? mask_tile : NULL,
                                  st->fn[FN_JOINT].on ? joint_tile : NULL};
    st->sb = a[ibuf].u.ts;
    st->mb = a[ibuf + 1].u.ts;
    st->nmb = a[ibuf + 1].n;
    st->bgrad = bwd ? s->outs + 3 : NULL;
    const int64_t *qs = ag_tensor_sizes(q), *ks = ag_tensor_sizes(k), *vs = ag_tensor_sizes(v);
    ag__flex_raw r = ag__flex_raw_of(bwd, a[ibm + 1].u.f, q, k, v);
    r.parts = a[ibm].u.ts + 2;
    r.sizes = f->sizes;
    r.fns = &st->fns;
    const int64_t osz[4] = {qs[0], qs[1], qs[2], vs[3]};
    if (!bwd) {
        ag_tensor *o = dest(st, 3, s->outs[0], r.dt, 4, osz);
        ag_tensor *l = dest(st, 4, s->outs[1], r.dt, 3, osz);
        if (!o || !l)
            return AG_ENOMEM;
        r.out = ag_tensor_data(o);
        r.lse = ag_tensor_data(l);
        int rc = raw_failed(st, ag__flex_run_raw(&r));
        if (!rc)
            rc = put_back(s->outs[0], o);
        return rc ? rc : put_back(s->outs[1], l);
    }
    ag_tensor *o = contig(st, 3, a[3].u.t), *l = contig(st, 4, a[4].u.t);
    ag_tensor *go = a[5].kind == AG_ARG_TENSOR ? contig(st, 5, a[5].u.t) : NULL;
    ag_tensor *gl = a[6].kind == AG_ARG_TENSOR ? contig(st, 6, a[6].u.t) : NULL;
    if (a[5].kind != AG_ARG_TENSOR && (go = tmp_of(st, 5, r.dt, 4, osz)))
        memset(ag_tensor_data(go), 0, (size_t)ag_tensor_numel(go) * ag_dtype_size(r.dt));
    ag_tensor *g[3] = {dest(st, 7, s->outs[0], r.dt, 4, qs), dest(st, 8, s->outs[1], r.dt, 4, ks),
                       dest(st, 9, s->outs[2], r.dt, 4, vs)};
    if (!o || !l || !go || (a[6].kind == AG_ARG_TENSOR && !gl) || !g[0] || !g[1] || !g[2])
        return ag_last_status() < 0 ? ag_last_status() : AG_ENOMEM;
    for (int i = 0; i < st->nsb; i++) {
        ag_tensor *bg = s->outs[3 + i];
        if (bg && !ag_tensor_is_contiguous(bg))
            return ag__err(AG_EINVAL, "flex_attention_backward: a buffer's gradient output is "
                                      "not contiguous");
        if (bg && zero_acc(st, i, bg))
            return AG_ENOMEM;
    }
    r.out = ag_tensor_data(o);
    r.lse = ag_tensor_data(l);
    r.dout = ag_tensor_data(go);
    r.dlse = gl ? ag_tensor_data(gl) : NULL;
    r.dq = ag_tensor_data(g[0]);
    r.dk = ag_tensor_data(g[1]);
    r.dv = ag_tensor_data(g[2]);
    int rc = raw_failed(st, ag__flex_run_raw(&r));
    for (int i = 0; i < st->nsb && !rc && st->nth > 1; i++)
        for (int th = 0; th < st->nth && s->outs[3 + i]; th++)
            ag__flex_add_reduced(s->outs[3 + i], st->acc[th * st->nsb + i]);
    for (int i = 0; i < 3 && !rc; i++)
        rc = put_back(s->outs[i], g[i]);
    return rc;
}

/* The interpreter's run (ag__flex_call_run) on the step's bound tensors and the plan's copies
 * of its graphs; the results are copied into the step's buffers. */
static int run_interpreted(const pflex *f, pstep *s, bool bwd) {
    const ag_arg *a = s->args;
    const int ibm = bwd ? 9 : 4, ibuf = bwd ? 12 : 7;
    ag__flex_call c = {.bwd = bwd,
                       .q = a[0].u.t,
                       .k = a[1].u.t,
                       .v = a[2].u.t,
                       .score = f->score,
                       .mask = f->mask,
                       .joint = f->joint,
                       .parts = a[ibm].u.ts + 2,
                       .sizes = f->sizes,
                       .scale = a[ibm + 1].u.f,
                       .sb = a[ibuf].u.ts,
                       .nsb = a[ibuf].n,
                       .mb = a[ibuf + 1].u.ts,
                       .nmb = a[ibuf + 1].n};
    if (bwd) {
        c.out = a[3].u.t, c.lse = a[4].u.t;
        c.go = a[5].kind == AG_ARG_TENSOR ? a[5].u.t : NULL;
        c.gl = a[6].kind == AG_ARG_TENSOR ? a[6].u.t : NULL;
    }
    ag_tensor *outs[AG_MAX_OUTPUTS] = {0};
    ag_scope_begin();
    int n = ag__flex_call_run(&c, outs);
    for (int i = 0; i < n; i++)
        ag_tensor_keep(outs[i]);
    ag_scope_end();
    int rc = n < 0 ? n : 0;
    if (!rc && n != s->nouts)
        rc = ag__err(AG_EINVAL, "%d output(s), the graph expects %d", n, s->nouts);
    for (int i = 0; i < n && !rc; i++)
        if (s->outs[i])
            rc = ag__copy_into(s->outs[i], outs[i]);
    for (int i = 0; i < n; i++)
        ag_tensor_free(outs[i]);
    return rc;
}

int ag__plan_run_flex(ag_plan *p, pstep *s) {
    const pflex *f = &p->flex[s->flex - 1];
    const bool bwd = s->op == ag__op_flex_attention(true);
    int rc = f->tiles ? run_tiles(f, s, bwd) : run_interpreted(f, s, bwd);
    if (rc < 0) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", ag_last_error());
        return ag__err(rc, "plan: %%%s: %s", p->names[s->node], msg);
    }
    return 0;
}

/* ---- eager flex_attention's tiles (flex_eager.c) ---- */

struct ag__flex_tiles *ag__flex_tiles_new(ag_dtype dt, int64_t L, int64_t S, int64_t QB, int64_t KB,
                                          const ag_graph *score, const ag_graph *joint,
                                          const ag_tmeta *sb, int nsb, int *status) {
    const ag_plan_opts o = {0};
    return tiles_new(&o, dt, L, S, QB, KB, sb, nsb, NULL, 0, score, NULL, joint, joint != NULL,
                     status);
}

void ag__flex_tiles_free(struct ag__flex_tiles *st) {
    pflex tmp = {.tiles = st};
    if (st)
        ag__plan_flex_free(&tmp);
}

int ag__flex_tiles_bind(struct ag__flex_tiles *st, ag_tensor *const *bufs, ag_tensor *const *bgrad,
                        const ag__flex_tile_fns **fns) {
    st->failed = 0;
    st->fns = (ag__flex_tile_fns){st, st->nth, st->fn[FN_SCORE].on ? score_tile : NULL, NULL,
                                  st->fn[FN_JOINT].on && bgrad ? joint_tile : NULL};
    st->sb = bufs;
    st->mb = NULL;
    st->nmb = 0;
    st->bgrad = bgrad;
    for (int i = 0; bgrad && i < st->nsb; i++)
        if (bgrad[i] && zero_acc(st, i, bgrad[i]))
            return AG_ENOMEM;
    *fns = &st->fns;
    return 0;
}

int ag__flex_tiles_done(struct ag__flex_tiles *st, int rc) {
    rc = raw_failed(st, rc);
    for (int i = 0; i < st->nsb && !rc && st->nth > 1 && st->bgrad; i++)
        for (int th = 0; th < st->nth && st->bgrad[i]; th++)
            ag__flex_add_reduced(st->bgrad[i], st->acc[th * st->nsb + i]);
    st->sb = st->bgrad = NULL;
    return rc;
}
