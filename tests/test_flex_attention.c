/* flex_attention and block masks (include/aotgrad/flex_attention.h): the block mask's
 * structure for a small causal case, exactly; which tiles the kernel visits (mask_mod only on
 * partial tiles, score_mod never on empty ones); outputs, logsumexp and gradients against plain
 * masked attention built from primitive ops (matmul, masked_fill, softmax, matmul; the mask and
 * the ALiBi bias built from plain C loops) for causal, sliding window, document masking,
 * ALiBi as a score_mod with a learned slope buffer, grouped-query attention, cross attention
 * and rows masked everywhere, in float32 and float64; gradcheck in float64; errors; traced and
 * exported joints, interpreted, and compiled (both partitioners, planned and interpreted)
 * against eager. */
#include "testutil.h"
#include "runtime/plan_internal.h"
#include "flex_alloc_count.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { M_NONE, M_CAUSAL, M_SLIDING, M_DOC, M_LATE };
#define WINDOW 5
#define LATE_FROM 5

typedef struct mcase {
    int kind;
    const int64_t *doc_ids; /* M_DOC: per-token document ids (the mask_mod's buffer too) */
    int calls;              /* mask_mod calls */
} mcase;

/* The truth, in plain C. */
static bool keep(const mcase *c, int64_t i, int64_t j) {
    switch (c->kind) {
    case M_CAUSAL:
        return j <= i;
    case M_SLIDING:
        return j <= i && i - j < WINDOW;
    case M_DOC:
        return c->doc_ids[i] == c->doc_ids[j];
    case M_LATE:
        return i >= LATE_FROM && j <= i;
    default:
        return true;
    }
}

static ag_tensor *and_(ag_tensor *a, ag_tensor *b) {
    return ag_where(a, b, a);
}

/* The same masks as mask_mods over tensors. */
static ag_tensor *mask_fn(void *ud, ag_tensor *b, ag_tensor *h, ag_tensor *qi, ag_tensor *ki,
                          ag_tensor *const *bufs, int nbuf) {
    (void)b;
    (void)h;
    mcase *c = ud;
    c->calls++;
    switch (c->kind) {
    case M_CAUSAL:
        return ag_ge(qi, ki);
    case M_SLIDING:
        return and_(ag_ge(qi, ki), ag_lt_scalar(ag_sub(qi, ki), WINDOW));
    case M_DOC:
        assert_int_equal(nbuf, 1);
        return ag_eq(ag_index(bufs[0], &qi, 1), ag_index(bufs[0], &ki, 1));
    case M_LATE:
        return and_(ag_ge_scalar(qi, LATE_FROM), ag_ge(qi, ki));
    default:
        return ag_ge_scalar(qi, 0);
    }
}

static int score_calls;

/* ALiBi: score + slope[h] * (kv_idx - q_idx). */
static ag_tensor *alibi(void *ud, ag_tensor *score, ag_tensor *b, ag_tensor *h, ag_tensor *qi,
                        ag_tensor *ki, ag_tensor *const *bufs, int nbuf) {
    (void)ud;
    (void)b;
    assert_int_equal(nbuf, 1);
    score_calls++;
    ag_tensor *rel = ag_to_dtype(ag_sub(ki, qi), ag_tensor_dtype(score));
    return ag_add(score, ag_mul(ag_index(bufs[0], &h, 1), rel));
}

/* A plain tanh soft-cap (no buffers): 4 tanh(score / 4). */
static ag_tensor *softcap(void *ud, ag_tensor *score, ag_tensor *b, ag_tensor *h, ag_tensor *qi,
                          ag_tensor *ki, ag_tensor *const *bufs, int nbuf) {
    (void)ud, (void)b, (void)h, (void)qi, (void)ki, (void)bufs, (void)nbuf;
    score_calls++;
    return ag_mul_scalar(ag_tanh(ag_div_scalar(score, 4)), 4);
}

/* ---- the reference: materialized attention from primitive ops ---- */
typedef struct ref_opts {
    const mcase *mask;
    ag_tensor *slopes; /* ALiBi when set */
    bool softcap;
    double scale;
} ref_opts;

/* out (and lse) of plain attention; results in the open scope. */
static ag_tensor *reference(ag_tensor *q, ag_tensor *k, ag_tensor *v, const ref_opts *o,
                            ag_tensor **lse) {
    const ag_dtype dt = ag_tensor_dtype(q);
    const int64_t B = ag_tensor_size(q, 0), Hq = ag_tensor_size(q, 1), L = ag_tensor_size(q, 2);
    const int64_t Hkv = ag_tensor_size(k, 1), S = ag_tensor_size(k, 2), E = ag_tensor_size(k, 3);
    const int64_t Ev = ag_tensor_size(v, 3);
    if (Hkv != Hq) { /* grouped-query: repeat each kv head */
        const int64_t G = Hq / Hkv;
        int64_t ke[5] = {B, Hkv, G, S, E}, kr[4] = {B, Hq, S, E};
        int64_t ve[5] = {B, Hkv, G, S, Ev}, vr[4] = {B, Hq, S, Ev};
        k = ag_reshape(ag_expand(ag_unsqueeze(k, 2), 5, ke), 4, kr);
        v = ag_reshape(ag_expand(ag_unsqueeze(v, 2), 5, ve), 4, vr);
    }
    ag_tensor *s = ag_mul_scalar(ag_matmul(q, ag_transpose(k, 2, 3)), o->scale);
    if (o->slopes) {
        double *rel = malloc(sizeof(double) * (size_t)(L * S));
        for (int64_t i = 0; i < L; i++)
            for (int64_t j = 0; j < S; j++)
                rel[i * S + j] = (double)(j - i);
        ag_tensor *r = tu_tensor(dt, 2, (int64_t[]){L, S}, rel);
        free(rel);
        s = ag_add(s, ag_mul(ag_view(o->slopes, 4, (int64_t[]){1, Hq, 1, 1}), r));
    }
    if (o->softcap)
        s = ag_mul_scalar(ag_tanh(ag_div_scalar(s, 4)), 4);
    double *drop = malloc(sizeof(double) * (size_t)(L * S)),
           *any = malloc(sizeof(double) * (size_t)L);
    for (int64_t i = 0; i < L; i++) {
        any[i] = 0;
        for (int64_t j = 0; j < S; j++) {
            const bool kk = !o->mask || keep(o->mask, i, j);
            drop[i * S + j] = !kk;
            any[i] += kk;
        }
        any[i] = any[i] > 0;
    }
    ag_tensor *dropm = tu_tensor(AG_BOOL, 2, (int64_t[]){L, S}, drop);
    ag_tensor *anym = tu_tensor(AG_BOOL, 2, (int64_t[]){L, 1}, any);
    free(drop);
    free(any);
    s = ag_masked_fill(s, dropm, -1e30);
    ag_tensor *p = ag_softmax(s, -1);
    p = ag_where(anym, p, ag_zeros_like(p));
    if (lse)
        *lse = ag_logsumexp(s, (int64_t[]){-1}, 1, false);
    return ag_matmul(p, v);
}

/* ---- helpers ---- */
static uint64_t rng = 0x9e3779b97f4a7c15ull;

static ag_tensor *rnd(ag_dtype dt, int64_t a, int64_t b, int64_t c, int64_t d, bool grad) {
    ag_tensor *t = tu_rand_tensor(dt, 4, (int64_t[]){a, b, c, d}, -1, 1, tu_xorshift, &rng);
    if (grad)
        ag_tensor_set_requires_grad(t, true);
    return t;
}

typedef struct fcase {
    const char *name;
    int mask;
    int score; /* 0 none, 1 alibi, 2 softcap */
    int64_t B, Hq, Hkv, L, S, E, Ev, QB, KB;
    bool with_lse_grad;
} fcase;

static void check_case(const fcase *fc, ag_dtype dt) {
    ag_scope_begin();
    const double tol = dt == AG_F64 ? 1e-10 : 2e-5;
    ag_tensor *q = rnd(dt, fc->B, fc->Hq, fc->L, fc->E, true);
    ag_tensor *k = rnd(dt, fc->B, fc->Hkv, fc->S, fc->E, true);
    ag_tensor *v = rnd(dt, fc->B, fc->Hkv, fc->S, fc->Ev, true);
    ag_tensor *slopes = NULL;
    if (fc->score == 1) {
        double sl[8];
        for (int h = 0; h < fc->Hq; h++)
            sl[h] = pow(2.0, -(h + 1.0)) * (h % 2 ? -1 : 1);
        slopes = tu_leaf(dt, 1, (int64_t[]){fc->Hq}, sl);
    }
    int64_t doc_ids[256];
    for (int64_t i = 0; i < fc->L && i < 256; i++)
        doc_ids[i] = i < 7 ? 0 : i < 9 ? 1 : i < 23 ? 2 : 3;
    mcase mc = {.kind = fc->mask, .doc_ids = doc_ids};
    ag_tensor *doc = NULL;
    if (fc->mask == M_DOC) {
        double d[256];
        for (int64_t i = 0; i < fc->L; i++)
            d[i] = (double)doc_ids[i];
        doc = tu_tensor(AG_I64, 1, (int64_t[]){fc->L}, d);
    }
    ag_block_mask *bm = NULL;
    if (fc->mask != M_NONE) {
        ag_mask_mod mm = {mask_fn, &mc, &doc, doc ? 1 : 0};
        bm = ag_create_block_mask(&mm, 1, 1, fc->L, fc->S, fc->QB, fc->KB);
        assert_non_null(bm);
    }
    ag_score_mod sm = {fc->score == 1 ? alibi : softcap, NULL, &slopes, fc->score == 1 ? 1 : 0};
    ag_flex_opts fo = {
        .enable_gqa = fc->Hq != fc->Hkv, .q_block_size = fc->QB, .kv_block_size = fc->KB};
    ag_tensor *out = NULL, *lse = NULL;
    int rc = ag_flex_attention(q, k, v, fc->score ? &sm : NULL, bm, &fo, &out, &lse);
    if (rc)
        fail_msg("%s: %s", fc->name, ag_last_error());
    ref_opts ro = {fc->mask != M_NONE ? &mc : NULL, slopes, fc->score == 2,
                   1.0 / sqrt((double)fc->E)};
    ag_tensor *rlse = NULL;
    ag_tensor *rout = reference(q, k, v, &ro, &rlse);
    assert_non_null(rout);
    tu_assert_shape(out, 4, (int64_t[]){fc->B, fc->Hq, fc->L, fc->Ev});
    tu_assert_shape(lse, 3, (int64_t[]){fc->B, fc->Hq, fc->L});
    double d = tu_max_abs_diff(out, rout);
    if (!(d <= tol))
        fail_msg("%s %s: out differs from the reference by %g", fc->name, ag_dtype_name(dt), d);
    /* logsumexp: -inf on rows masked everywhere, the reference's elsewhere */
    for (int64_t r = 0; r < ag_tensor_numel(lse); r++) {
        const int64_t i = r % fc->L;
        bool any = false;
        for (int64_t j = 0; j < fc->S; j++)
            any |= fc->mask == M_NONE || keep(&mc, i, j);
        const double got = ag_tensor_item_at(lse, r), want = ag_tensor_item_at(rlse, r);
        if (!any)
            assert_true(isinf(got) && got < 0);
        else
            tu_assert_near(got, want, tol, fc->name, r);
    }
    /* gradients of sum(out * w) (+ sum(lse * w2)) */
    ag_tensor *w = rnd(dt, fc->B, fc->Hq, fc->L, fc->Ev, false);
    ag_tensor *w2 =
        tu_rand_tensor(dt, 3, (int64_t[]){fc->B, fc->Hq, fc->L}, -1, 1, tu_xorshift, &rng);
    ag_tensor *loss = ag_sum_all(ag_mul(out, w)), *rloss = ag_sum_all(ag_mul(rout, w));
    if (fc->with_lse_grad) {
        loss = ag_add(loss, ag_sum_all(ag_mul(lse, w2)));
        rloss = ag_add(rloss, ag_sum_all(ag_mul(rlse, w2)));
    }
    ag_tensor *ins[4] = {q, k, v, slopes};
    const int nin = slopes ? 4 : 3;
    ag_tensor *g[4] = {0}, *rg[4] = {0};
    assert_int_equal(ag_grad(&loss, NULL, 1, ins, nin, g, false, false), 0);
    assert_int_equal(ag_grad(&rloss, NULL, 1, ins, nin, rg, false, false), 0);
    const char *nm[4] = {"dq", "dk", "dv", "dslopes"};
    for (int i = 0; i < nin; i++) {
        double gd = tu_max_abs_diff(g[i], rg[i]);
        const double gtol = i == 3 ? tol * (double)(fc->B * fc->L * fc->S) : tol * 10;
        if (!(gd <= gtol))
            fail_msg("%s %s: %s differs from the reference by %g", fc->name, ag_dtype_name(dt),
                     nm[i], gd);
    }
    ag_block_mask_free(bm);
    ag_scope_end();
}

static const fcase cases[] = {
    {"plain", M_NONE, 0, 2, 2, 2, 19, 19, 8, 6, 8, 8, true},
    {"cross attention", M_NONE, 0, 1, 2, 2, 13, 29, 8, 5, 8, 8, true},
    {"causal", M_CAUSAL, 0, 2, 3, 3, 37, 37, 8, 6, 8, 8, true},
    {"causal, one tile", M_CAUSAL, 0, 1, 2, 2, 9, 9, 4, 4, 0, 0, true},
    {"sliding window", M_SLIDING, 0, 2, 2, 2, 40, 40, 8, 8, 8, 8, true},
    {"document", M_DOC, 0, 1, 2, 2, 31, 31, 8, 8, 8, 8, true},
    {"alibi causal", M_CAUSAL, 1, 2, 4, 4, 33, 33, 8, 8, 8, 16, true},
    {"softcap sliding", M_SLIDING, 2, 1, 2, 2, 27, 27, 8, 4, 8, 8, true},
    {"gqa causal", M_CAUSAL, 0, 2, 4, 2, 25, 25, 8, 8, 8, 8, true},
    {"gqa alibi", M_NONE, 1, 1, 4, 1, 17, 17, 4, 4, 8, 8, true},
    {"masked rows", M_LATE, 0, 1, 2, 2, 21, 21, 8, 8, 8, 8, false},
    {"masked rows alibi", M_LATE, 1, 1, 2, 2, 21, 21, 8, 8, 4, 8, false},
};

static void test_matches_reference_f64(void **state) {
    (void)state;
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
        check_case(&cases[i], AG_F64);
}

static void test_matches_reference_f32(void **state) {
    (void)state;
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
        check_case(&cases[i], AG_F32);
}

/* Causal, 12 x 12 in 4 x 4 blocks: block (i, j) full below the diagonal, partial on it, empty
 * above; the lists as upstream lays them out (listed blocks first, then the rest). */
static void test_block_mask_structure(void **state) {
    (void)state;
    mcase mc = {.kind = M_CAUSAL};
    ag_mask_mod mm = {mask_fn, &mc, NULL, 0};
    ag_block_mask *bm = ag_create_block_mask(&mm, 1, 1, 12, 12, 4, 4);
    assert_non_null(bm);
    assert_int_equal(mc.calls, 9); /* every tile once, at creation */
    int64_t shp[6];
    assert_int_equal(ag_block_mask_shape(bm, shp), 0);
    const int64_t want_shape[6] = {1, 1, 12, 12, 4, 4};
    assert_memory_equal(shp, want_shape, sizeof shp);
    tu_assert_values(ag_block_mask_tensor(bm, AG_BM_KV_NUM_BLOCKS), 3, (int64_t[]){1, 1, 3},
                     (double[]){1, 1, 1}, 0);
    tu_assert_values(ag_block_mask_tensor(bm, AG_BM_KV_INDICES), 4, (int64_t[]){1, 1, 3, 3},
                     (double[]){0, 1, 2, 1, 0, 2, 2, 0, 1}, 0);
    tu_assert_values(ag_block_mask_tensor(bm, AG_BM_FULL_KV_NUM_BLOCKS), 3, (int64_t[]){1, 1, 3},
                     (double[]){0, 1, 2}, 0);
    tu_assert_values(ag_block_mask_tensor(bm, AG_BM_FULL_KV_INDICES), 4, (int64_t[]){1, 1, 3, 3},
                     (double[]){0, 1, 2, 0, 1, 2, 0, 1, 2}, 0);
    tu_assert_values(ag_block_mask_tensor(bm, AG_BM_Q_NUM_BLOCKS), 3, (int64_t[]){1, 1, 3},
                     (double[]){1, 1, 1}, 0);
    tu_assert_values(ag_block_mask_tensor(bm, AG_BM_Q_INDICES), 4, (int64_t[]){1, 1, 3, 3},
                     (double[]){0, 1, 2, 1, 0, 2, 2, 0, 1}, 0);
    tu_assert_values(ag_block_mask_tensor(bm, AG_BM_FULL_Q_NUM_BLOCKS), 3, (int64_t[]){1, 1, 3},
                     (double[]){2, 1, 0}, 0);
    tu_assert_values(ag_block_mask_tensor(bm, AG_BM_FULL_Q_INDICES), 4, (int64_t[]){1, 1, 3, 3},
                     (double[]){1, 2, 0, 2, 0, 1, 0, 1, 2}, 0);
    assert_null(ag_block_mask_tensor(bm, (ag_block_mask_part)8));

    /* The kernel: mask_mod on the 3 diagonal tiles only; score_mod traced once (forward: its
     * score graph; backward: score and joint graphs), its graphs run on the visited tiles
     * (tests/test_flex_eager_traced.c counts the per-tile calls of the fallback). */
    ag_scope_begin();
    ag_tensor *q = rnd(AG_F64, 2, 3, 12, 4, true), *k = rnd(AG_F64, 2, 3, 12, 4, true);
    ag_tensor *v = rnd(AG_F64, 2, 3, 12, 4, true);
    mc.calls = 0;
    score_calls = 0;
    ag_score_mod sm = {softcap, NULL, NULL, 0};
    ag_tensor *out = NULL;
    assert_int_equal(ag_flex_attention(q, k, v, &sm, bm, NULL, &out, NULL), 0);
    assert_int_equal(mc.calls, 3);
    assert_int_equal(score_calls, 1);
    assert_string_equal(ag_tensor_grad_fn_name(out), "FlexAttentionBackward0");
    mc.calls = 0;
    score_calls = 0;
    assert_int_equal(ag_backward(ag_sum_all(out), NULL, false), 0);
    assert_int_equal(mc.calls, 3);
    assert_int_equal(score_calls, 2);
    ag_scope_end();
    ag_block_mask_free(bm);
    ag_block_mask_free(NULL);

    /* Sizes not multiples of the block: 10 x 10 in 4 x 4 blocks, sliding window 5 (row i keeps
     * i-4 .. i). Rows 0-3: block 0 partial. Rows 4-7: block 0 partial (row 4 keeps 0-3, row 7
     * only 3), block 1 partial. Rows 8-9: block 0 empty (row 8 keeps 4-8), block 1 partial
     * (row 9 keeps 5-9), block 2 (8-9) partial. */
    mc.kind = M_SLIDING;
    bm = ag_create_block_mask(&mm, 1, 1, 10, 10, 4, 4);
    assert_non_null(bm);
    tu_assert_values(ag_block_mask_tensor(bm, AG_BM_KV_NUM_BLOCKS), 3, (int64_t[]){1, 1, 3},
                     (double[]){1, 2, 2}, 0);
    tu_assert_values(ag_block_mask_tensor(bm, AG_BM_FULL_KV_NUM_BLOCKS), 3, (int64_t[]){1, 1, 3},
                     (double[]){0, 0, 0}, 0);
    tu_assert_values(ag_block_mask_tensor(bm, AG_BM_KV_INDICES), 4, (int64_t[]){1, 1, 3, 3},
                     (double[]){0, 1, 2, 0, 1, 2, 1, 2, 0}, 0);
    ag_block_mask_free(bm);

    /* no mask_mod: every block full */
    bm = ag_create_block_mask(NULL, 2, 1, 5, 9, 4, 4);
    assert_non_null(bm);
    tu_assert_values(ag_block_mask_tensor(bm, AG_BM_FULL_KV_NUM_BLOCKS), 3, (int64_t[]){2, 1, 2},
                     (double[]){3, 3, 3, 3}, 0);
    tu_assert_values(ag_block_mask_tensor(bm, AG_BM_KV_NUM_BLOCKS), 3, (int64_t[]){2, 1, 2},
                     (double[]){0, 0, 0, 0}, 0);
    ag_block_mask_free(bm);
}

/* ---- gradcheck ---- */
typedef struct gc_ud {
    ag_block_mask *bm;
    bool alibi;
} gc_ud;

static int gc_fn(void *ud, ag_tensor *const *in, int n, ag_tensor **outs, int *nouts) {
    gc_ud *g = ud;
    ag_tensor *slopes = n > 3 ? in[3] : NULL;
    ag_score_mod sm = {alibi, NULL, &slopes, 1};
    ag_flex_opts fo = {.q_block_size = 4, .kv_block_size = 4};
    int rc = ag_flex_attention(in[0], in[1], in[2], g->alibi ? &sm : NULL, g->bm, &fo, &outs[0],
                               &outs[1]);
    *nouts = 2;
    return rc;
}

static void test_gradcheck(void **state) {
    (void)state;
    ag_scope_begin();
    mcase mc = {.kind = M_SLIDING};
    ag_mask_mod mm = {mask_fn, &mc, NULL, 0};
    gc_ud g = {ag_create_block_mask(&mm, 1, 1, 9, 9, 4, 4), true};
    assert_non_null(g.bm);
    ag_tensor *in[4] = {rnd(AG_F64, 1, 2, 9, 3, true), rnd(AG_F64, 1, 2, 9, 3, true),
                        rnd(AG_F64, 1, 2, 9, 2, true),
                        tu_leaf(AG_F64, 1, (int64_t[]){2}, (double[]){0.5, -0.25})};
    if (ag_gradcheck(gc_fn, &g, in, 4, NULL))
        fail_msg("gradcheck: %s", ag_last_error());
    g.alibi = false;
    mc.kind = M_DOC; /* unused: plain causal below */
    ag_block_mask_free(g.bm);
    mc.kind = M_CAUSAL;
    g.bm = ag_create_block_mask(&mm, 1, 1, 9, 9, 4, 4);
    if (ag_gradcheck(gc_fn, &g, in, 3, NULL))
        fail_msg("gradcheck causal: %s", ag_last_error());
    ag_block_mask_free(g.bm);
    ag_scope_end();
}

/* ---- errors ---- */
static ag_tensor *bad_mask(void *ud, ag_tensor *b, ag_tensor *h, ag_tensor *qi, ag_tensor *ki,
                           ag_tensor *const *bufs, int nbuf) {
    (void)ud, (void)b, (void)h, (void)ki, (void)bufs, (void)nbuf;
    return ag_to_dtype(qi, AG_F32); /* not bool */
}

static ag_tensor *bad_score(void *ud, ag_tensor *score, ag_tensor *b, ag_tensor *h, ag_tensor *qi,
                            ag_tensor *ki, ag_tensor *const *bufs, int nbuf) {
    (void)ud, (void)score, (void)b, (void)h, (void)qi, (void)bufs, (void)nbuf;
    return ag_to_dtype(ag_cat((ag_tensor *[]){ki, ki}, 2, 1), AG_F64); /* [1, 2 bk] */
}

static ag_tensor *null_score(void *ud, ag_tensor *score, ag_tensor *b, ag_tensor *h, ag_tensor *qi,
                             ag_tensor *ki, ag_tensor *const *bufs, int nbuf) {
    (void)ud, (void)score, (void)b, (void)h, (void)qi, (void)ki, (void)bufs, (void)nbuf;
    return NULL;
}

static void expect_fail(int rc, ag_tensor *const *out, const char *needle) {
    assert_int_equal(rc, AG_EINVAL);
    assert_null(*out);
    tu_assert_error_contains(needle);
}

static void test_errors(void **state) {
    (void)state;
    ag_scope_begin();
    ag_tensor *q = rnd(AG_F64, 1, 2, 8, 4, true), *k = rnd(AG_F64, 1, 2, 8, 4, false);
    ag_tensor *v = rnd(AG_F64, 1, 2, 8, 4, false), *out = q;
    expect_fail(ag_flex_attention(NULL, k, v, NULL, NULL, NULL, &out, NULL), &out,
                "flex_attention: q is NULL");
    assert_int_equal(ag_flex_attention(q, k, v, NULL, NULL, NULL, NULL, NULL), AG_EINVAL);
    tu_assert_error_contains("out is NULL");
    ag_tensor *q3 = ag_view(q, 3, (int64_t[]){2, 8, 4});
    expect_fail(ag_flex_attention(q3, k, v, NULL, NULL, NULL, &out, NULL), &out,
                "query must be 4-d");
    ag_tensor *qi = ag_to_dtype(q, AG_I64);
    expect_fail(ag_flex_attention(qi, k, v, NULL, NULL, NULL, &out, NULL), &out,
                "query must be float32 or float64, got int64");
    ag_tensor *k32 = ag_to_dtype(k, AG_F32);
    expect_fail(ag_flex_attention(q, k32, v, NULL, NULL, NULL, &out, NULL), &out, "one dtype");
    ag_tensor *k5 = rnd(AG_F64, 1, 2, 8, 5, false);
    expect_fail(ag_flex_attention(q, k5, v, NULL, NULL, NULL, &out, NULL), &out,
                "sizes do not match");
    ag_tensor *k1 = rnd(AG_F64, 1, 1, 8, 4, false), *v1 = rnd(AG_F64, 1, 1, 8, 4, false);
    expect_fail(ag_flex_attention(q, k1, v1, NULL, NULL, NULL, &out, NULL), &out,
                "unless enable_gqa");
    ag_tensor *q3h = rnd(AG_F64, 1, 3, 8, 4, false), *k2 = rnd(AG_F64, 1, 2, 8, 4, false);
    ag_flex_opts gqa = {.enable_gqa = true};
    expect_fail(ag_flex_attention(q3h, k2, k2, NULL, NULL, &gqa, &out, NULL), &out, "multiple");
    ag_block_mask *bm = ag_create_block_mask(NULL, 1, 1, 9, 8, 4, 4);
    expect_fail(ag_flex_attention(q, k, v, NULL, bm, NULL, &out, NULL), &out, "Q_LEN=9");
    ag_block_mask_free(bm);
    bm = ag_create_block_mask(NULL, 1, 3, 8, 8, 4, 4);
    expect_fail(ag_flex_attention(q, k, v, NULL, bm, NULL, &out, NULL), &out, "H=3");
    ag_block_mask_free(bm);
    ag_mask_mod mm = {bad_mask, NULL, NULL, 0};
    assert_null(ag_create_block_mask(&mm, 1, 1, 8, 8, 4, 4));
    tu_assert_error_contains("mask_mod returned a float32 tensor, expected bool");
    assert_null(ag_create_block_mask(NULL, 1, 0, 8, 8, 4, 4));
    tu_assert_error_contains("H=0");
    ag_tensor *nullbuf = NULL;
    ag_mask_mod mm2 = {mask_fn, NULL, &nullbuf, 1};
    assert_null(ag_create_block_mask(&mm2, 1, 1, 8, 8, 4, 4));
    tu_assert_error_contains("buffer 0 is NULL");
    ag_score_mod sm = {bad_score, NULL, NULL, 0};
    expect_fail(ag_flex_attention(q, k, v, &sm, NULL, NULL, &out, NULL), &out,
                "does not broadcast to the tile [8, 8]");
    ag_score_mod sm2 = {null_score, NULL, NULL, 0};
    expect_fail(ag_flex_attention(q, k, v, &sm2, NULL, NULL, &out, NULL), &out,
                "score_mod returned NULL");
    ag_score_mod sm3 = {alibi, NULL, &nullbuf, 1};
    expect_fail(ag_flex_attention(q, k, v, &sm3, NULL, NULL, &out, NULL), &out,
                "score_mod buffer 0 is NULL");
    /* after all that, a good call still works */
    assert_int_equal(ag_flex_attention(q, k, v, NULL, NULL, NULL, &out, NULL), 0);
    assert_non_null(out);
    assert_int_equal(ag_block_mask_shape(NULL, (int64_t[6]){0}), AG_EINVAL);
    ag_scope_end();
}

/* A strided (transposed) query gives what its contiguous copy gives. */
static void test_strided_inputs(void **state) {
    (void)state;
    ag_scope_begin();
    ag_tensor *qt = rnd(AG_F64, 1, 10, 2, 4, false); /* [B, L, H, E] */
    ag_tensor *q = ag_transpose(qt, 1, 2), *qc = ag_contiguous(q);
    ag_tensor *k = rnd(AG_F64, 1, 2, 10, 4, false), *v = rnd(AG_F64, 1, 2, 10, 3, false);
    ag_tensor *a = NULL, *b = NULL;
    assert_int_equal(ag_flex_attention(q, k, v, NULL, NULL, NULL, &a, NULL), 0);
    assert_int_equal(ag_flex_attention(qc, k, v, NULL, NULL, NULL, &b, NULL), 0);
    assert_true(tu_max_abs_diff(a, b) == 0);
    ag_scope_end();
}

/* A mask that depends on b and h (causal where b == h, a sliding window elsewhere), in a block
 * mask of B=2, H=2: each (b, h) slice of the output and of the gradients equals a call on that
 * slice alone with its own mask. */
static ag_tensor *per_head_mask(void *ud, ag_tensor *b, ag_tensor *h, ag_tensor *qi, ag_tensor *ki,
                                ag_tensor *const *bufs, int nbuf) {
    (void)ud, (void)bufs, (void)nbuf;
    ag_tensor *causal = ag_ge(qi, ki);
    ag_tensor *sliding = and_(causal, ag_lt_scalar(ag_sub(qi, ki), WINDOW));
    return ag_where(ag_ne(b, h), sliding, causal);
}

static void test_per_head_masks(void **state) {
    (void)state;
    ag_scope_begin();
    const int64_t L = 23;
    ag_tensor *q = rnd(AG_F64, 2, 2, L, 4, true), *k = rnd(AG_F64, 2, 2, L, 4, true);
    ag_tensor *v = rnd(AG_F64, 2, 2, L, 3, true), *w = rnd(AG_F64, 2, 2, L, 3, false);
    ag_mask_mod mm = {per_head_mask, NULL, NULL, 0};
    ag_block_mask *bm = ag_create_block_mask(&mm, 2, 2, L, L, 8, 8);
    assert_non_null(bm);
    ag_score_mod sm = {softcap, NULL, NULL, 0};
    ag_tensor *out = NULL;
    assert_int_equal(ag_flex_attention(q, k, v, &sm, bm, NULL, &out, NULL), 0);
    ag_tensor *loss = ag_sum_all(ag_mul(out, w));
    ag_tensor *ins[3] = {q, k, v}, *g[3];
    assert_int_equal(ag_grad(&loss, NULL, 1, ins, 3, g, false, false), 0);
    mcase causal = {.kind = M_CAUSAL}, sliding = {.kind = M_SLIDING};
    ag_mask_mod mc = {mask_fn, &causal, NULL, 0}, ms = {mask_fn, &sliding, NULL, 0};
    ag_block_mask *bc = ag_create_block_mask(&mc, 1, 1, L, L, 8, 8);
    ag_block_mask *bs = ag_create_block_mask(&ms, 1, 1, L, L, 8, 8);
    for (int b = 0; b < 2; b++)
        for (int h = 0; h < 2; h++) {
            ag_tensor *t[4] = {q, k, v, w}, *sl[4];
            for (int i = 0; i < 4; i++) {
                ag_tensor *x = ag_detach(ag_slice(ag_slice(t[i], 0, b, b + 1, 1), 1, h, h + 1, 1));
                sl[i] = ag_contiguous(x);
                if (i < 3)
                    ag_tensor_set_requires_grad(sl[i], true);
            }
            ag_tensor *o1 = NULL;
            assert_int_equal(
                ag_flex_attention(sl[0], sl[1], sl[2], &sm, b == h ? bc : bs, NULL, &o1, NULL), 0);
            ag_tensor *want = ag_slice(ag_slice(out, 0, b, b + 1, 1), 1, h, h + 1, 1);
            assert_true(tu_max_abs_diff(o1, want) < 1e-12);
            ag_tensor *l1 = ag_sum_all(ag_mul(o1, sl[3])), *g1[3];
            assert_int_equal(ag_grad(&l1, NULL, 1, sl, 3, g1, false, false), 0);
            for (int i = 0; i < 3; i++) {
                ag_tensor *gw = ag_slice(ag_slice(g[i], 0, b, b + 1, 1), 1, h, h + 1, 1);
                assert_true(tu_max_abs_diff(g1[i], gw) < 1e-12);
            }
        }
    ag_block_mask_free(bm);
    ag_block_mask_free(bc);
    ag_block_mask_free(bs);
    ag_scope_end();
}

/* ---- score_mod and mask_mod as graphs (ag_trace_score_mod, ...) ---- */

static ag_tensor *identity_score(void *ud, ag_tensor *score, ag_tensor *b, ag_tensor *h,
                                 ag_tensor *qi, ag_tensor *ki, ag_tensor *const *bufs, int nbuf) {
    (void)ud, (void)b, (void)h, (void)qi, (void)ki, (void)bufs, (void)nbuf;
    return score;
}

/* The traced graphs, as printed (ag_graph_to_string, default options). */
static const char *const GRAPH_IDENTITY = "graph():\n"
                                          "    %arg0_1 : f32[]  # None\n"
                                          "    %arg1_1 : i64[]  # None\n"
                                          "    %arg2_1 : i64[]  # None\n"
                                          "    %arg3_1 : i64[]  # None\n"
                                          "    %arg4_1 : i64[]  # None\n"
                                          "    return (%arg0_1,)\n";
static const char *const GRAPH_IDENTITY_JOINT = "graph():\n"
                                                "    %arg0_1 : f32[]  # None\n"
                                                "    %arg1_1 : i64[]  # None\n"
                                                "    %arg2_1 : i64[]  # None\n"
                                                "    %arg3_1 : i64[]  # None\n"
                                                "    %arg4_1 : i64[]  # None\n"
                                                "    %arg5_1 : f32[]  # None\n"
                                                "    return (%arg5_1, None, None, None, None)\n";
static const char *const GRAPH_ALIBI =
    "graph():\n"
    "    %arg0_1 : f64[]  # None\n"
    "    %arg1_1 : i64[]  # None\n"
    "    %arg2_1 : i64[]  # None\n"
    "    %arg3_1 : i64[]  # None\n"
    "    %arg4_1 : i64[]  # None\n"
    "    %arg5_1 : f64[2]  # None\n"
    "    %sub = sub.Tensor(%arg4_1, %arg3_1)  # i64[]\n"
    "    %_to_copy = _to_copy(%sub, dtype=torch.float64)  # f64[]\n"
    "    %index = index.Tensor(%arg5_1, [%arg2_1])  # f64[]\n"
    "    %mul = mul.Tensor(%index, %_to_copy)  # f64[]\n"
    "    %add = add.Tensor(%arg0_1, %mul)  # f64[]\n"
    "    return (%add,)\n";
static const char *const GRAPH_DOC_MASK =
    "graph():\n"
    "    %arg0_1 : i64[]  # None\n"
    "    %arg1_1 : i64[]  # None\n"
    "    %arg2_1 : i64[]  # None\n"
    "    %arg3_1 : i64[]  # None\n"
    "    %arg4_1 : i64[31]  # None\n"
    "    %index = index.Tensor(%arg4_1, [%arg3_1])  # i64[]\n"
    "    %index_1 = index.Tensor(%arg4_1, [%arg2_1])  # i64[]\n"
    "    %eq = eq.Tensor(%index_1, %index)  # b8[]\n"
    "    return (%eq,)\n";
static const char *const GRAPH_ALIBI_JOINT =
    "graph():\n"
    "    %arg0_1 : f64[]  # None\n"
    "    %arg1_1 : i64[]  # None\n"
    "    %arg2_1 : i64[]  # None\n"
    "    %arg3_1 : i64[]  # None\n"
    "    %arg4_1 : i64[]  # None\n"
    "    %arg5_1 : f64[]  # None\n"
    "    %arg6_1 : f64[2]  # None\n"
    "    %sub = sub.Tensor(%arg4_1, %arg3_1)  # i64[]\n"
    "    %_to_copy = _to_copy(%sub, dtype=torch.float64)  # f64[]\n"
    "    %index = index.Tensor(%arg6_1, [%arg2_1])  # f64[]\n"
    "    %mul = mul.Tensor(%index, %_to_copy)  # f64[]\n"
    "    %add = add.Tensor(%arg0_1, %mul)  # f64[]\n"
    "    %mul_1 = mul.Tensor(%arg5_1, %_to_copy)  # f64[]\n"
    "    %new_zeros = new_zeros(%mul_1, [2])  # f64[2]\n"
    "    %index_put = index_put(%new_zeros, [%arg2_1], %mul_1, True)  # f64[2]\n"
    "    return (%arg5_1, None, None, None, None, %index_put)\n";

static void expect_graph(const ag_graph *g, const char *want) {
    assert_non_null(g);
    char *s = ag_graph_to_string(g, NULL);
    assert_non_null(s);
    if (strcmp(s, want))
        fail_msg("graph:\n%s\nwant:\n%s", s, want);
    ag_free(s);
}

/* ag_graph_run on inputs of other shapes than the traced 0-d ones: a copy whose placeholders
 * take the inputs' metadata (as ag_score_mod_graph runs a graph on a tile). */
static int run_reshaped(const ag_graph *g, ag_tensor *const *in, int n, ag_tensor **out, int max) {
    ag_graph *c = ag_graph_copy(g);
    assert_non_null(c);
    int i = 0;
    for (ag_node *x = ag_graph_first(c); x; x = ag_node_next(x))
        if (ag_node_kind_of(x) == AG_NODE_PLACEHOLDER) {
            ag_tmeta m =
                tu_tmeta(ag_tensor_dtype(in[i]), ag_tensor_ndim(in[i]), ag_tensor_sizes(in[i]));
            i++;
            assert_int_equal(ag_node_set_val(x, 0, &m), 0);
        }
    if (ag_graph_reinfer_meta(c))
        fail_msg("reinfer: %s", ag_last_error());
    int r = ag_graph_run(c, in, n, out, max);
    ag_graph_free(c);
    return r;
}

/* ALiBi (slopes: input 3) under the block mask ud, for ag_trace. */
static int alibi_flex(void *ud, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)nin, (void)max_out;
    ag_score_mod sm = {alibi, NULL, &in[3], 1};
    return ag_flex_attention(in[0], in[1], in[2], &sm, ud, NULL, &out[0], &out[1]) ? -1 : 2;
}

static void test_traced_mods(void **state) {
    (void)state;
    ag_scope_begin();
    /* upstream test 14's score_mod: the identity */
    ag_score_mod id = {identity_score, NULL, NULL, 0};
    ag_graph *g = ag_trace_score_mod(&id, AG_F32);
    expect_graph(g, GRAPH_IDENTITY);
    ag_graph_free(g);
    g = ag_trace_score_mod_joint(&id, AG_F32);
    expect_graph(g, GRAPH_IDENTITY_JOINT);
    ag_graph_free(g);

    /* ALiBi with its slopes a buffer; document masking with its ids a buffer */
    int64_t ids[31];
    double dids[31];
    for (int i = 0; i < 31; i++)
        dids[i] = (double)(ids[i] = i < 7 ? 0 : i < 9 ? 1 : i < 23 ? 2 : 3);
    ag_tensor *doc = tu_tensor(AG_I64, 1, (int64_t[]){31}, dids);
    ag_tensor *slopes = tu_leaf(AG_F64, 1, (int64_t[]){2}, (double[]){0.5, -0.25});
    ag_score_mod sm = {alibi, NULL, &slopes, 1};
    mcase mc = {.kind = M_DOC, .doc_ids = ids};
    ag_mask_mod mm = {mask_fn, &mc, &doc, 1};
    ag_graph *sg = ag_trace_score_mod(&sm, AG_F64), *mg = ag_trace_mask_mod(&mm);
    ag_graph *jg = ag_trace_score_mod_joint(&sm, AG_F64);
    expect_graph(sg, GRAPH_ALIBI);
    expect_graph(mg, GRAPH_DOC_MASK);
    expect_graph(jg, GRAPH_ALIBI_JOINT);

    /* the graphs run where the functions ran: the same outputs and gradients, bit for bit */
    ag_tensor *q = rnd(AG_F64, 1, 2, 31, 4, true), *k = rnd(AG_F64, 1, 2, 31, 4, true);
    ag_tensor *v = rnd(AG_F64, 1, 2, 31, 3, true);
    ag_block_mask *bm = ag_create_block_mask(&mm, 1, 1, 31, 31, 8, 8);
    ag_mask_mod mmg = {ag_mask_mod_graph, mg, &doc, 1};
    ag_block_mask *bmg = ag_create_block_mask(&mmg, 1, 1, 31, 31, 8, 8);
    assert_non_null(bm);
    if (!bmg)
        fail_msg("%s", ag_last_error());
    for (int p = 0; p < 8; p++) {
        ag_tensor *a = ag_block_mask_tensor(bm, (ag_block_mask_part)p);
        assert_true(tu_max_abs_diff(a, ag_block_mask_tensor(bmg, (ag_block_mask_part)p)) == 0);
    }
    ag_score_mod smg = {ag_score_mod_graph, sg, &slopes, 1};
    ag_tensor *o1 = NULL, *o2 = NULL, *l1 = NULL, *l2 = NULL;
    assert_int_equal(ag_flex_attention(q, k, v, &sm, bm, NULL, &o1, &l1), 0);
    assert_int_equal(ag_flex_attention(q, k, v, &smg, bmg, NULL, &o2, &l2), 0);
    assert_true(tu_max_abs_diff(o1, o2) == 0);
    assert_true(tu_max_abs_diff(l1, l2) == 0);
    ag_tensor *ins[4] = {q, k, v, slopes}, *g1[4], *g2[4];
    ag_tensor *loss1 = ag_add(ag_sum_all(o1), ag_sum_all(l1));
    ag_tensor *loss2 = ag_add(ag_sum_all(o2), ag_sum_all(l2));
    assert_int_equal(ag_grad(&loss1, NULL, 1, ins, 4, g1, false, false), 0);
    assert_int_equal(ag_grad(&loss2, NULL, 1, ins, 4, g2, false, false), 0);
    for (int i = 0; i < 4; i++)
        assert_true(tu_max_abs_diff(g1[i], g2[i]) == 0);
    /* The same call traced and run by the interpreter (flex_attention with sdpa_score0 and
     * sdpa_mask0, its tiles 8 x 8, 8 x 7, 7 x 8 and 7 x 7, each shape's re-inferred graph
     * reused across the call's tiles): the same output and logsumexp, bit for bit. */
    ag_graph *tg = ag_trace(alibi_flex, bm, ins, 4, NULL, NULL, NULL);
    if (!tg)
        fail_msg("trace: %s", ag_last_error());
    ag_tensor *run[2];
    if (ag_graph_run(tg, ins, 4, run, 2) != 2)
        fail_msg("run: %s", ag_last_error());
    assert_true(tu_max_abs_diff(run[0], o1) == 0);
    assert_true(tu_max_abs_diff(run[1], l1) == 0);
    ag_graph_free(tg);

    /* the joint graph's gradient: softcap's d/ds 4 tanh(s / 4) = 1 - tanh(s / 4)^2, and for
     * ALiBi grad_slope[h] = sum of grad * (kv - q) over the tile */
    ag_score_mod sc = {softcap, NULL, NULL, 0};
    ag_graph *cj = ag_trace_score_mod_joint(&sc, AG_F64);
    assert_non_null(cj);
    double sv[5] = {-3, -0.5, 0, 1.25, 7}, gv[5] = {0.5, -2, 1, 3, -1};
    ag_tensor *st = tu_tensor(AG_F64, 1, (int64_t[]){5}, sv);
    ag_tensor *gt = tu_tensor(AG_F64, 1, (int64_t[]){5}, gv);
    ag_tensor *zero = ag_scalar_tensor(AG_I64, 0);
    ag_tensor *jin[6] = {st, zero, zero, zero, zero, gt}, *jout[8];
    assert_int_equal(run_reshaped(cj, jin, 6, jout, 8), 5);
    for (int i = 0; i < 5; i++) {
        const double t = tanh(sv[i] / 4);
        tu_assert_near(ag_tensor_item_at(jout[0], i), gv[i] * (1 - t * t), 1e-12, "dscore", i);
    }
    for (int i = 1; i < 5; i++)
        assert_null(jout[i]);
    ag_graph_free(cj);
    /* The joint graph is a 0-d function (upstream vmaps it over the tile): run per entry of a
     * 3 x 4 tile, the slopes' gradients summed. */
    ag_tensor *s34 = rnd(AG_F64, 1, 1, 3, 4, false), *g34 = rnd(AG_F64, 1, 1, 3, 4, false);
    double want = 0, got = 0;
    for (int i = 0; i < 3; i++)
        for (int j = 0; j < 4; j++) {
            const double gij = ag_tensor_item_at(g34, i * 4 + j);
            ag_tensor *ain[7] = {ag_scalar_tensor(AG_F64, ag_tensor_item_at(s34, i * 4 + j)),
                                 zero,
                                 ag_scalar_tensor(AG_I64, 1),
                                 ag_scalar_tensor(AG_I64, i),
                                 ag_scalar_tensor(AG_I64, j),
                                 ag_scalar_tensor(AG_F64, gij),
                                 slopes};
            assert_int_equal(ag_graph_run(jg, ain, 7, jout, 8), 6);
            tu_assert_near(ag_tensor_item(jout[0]), gij, 0, "dscore", i * 4 + j);
            tu_assert_near(ag_tensor_item_at(jout[5], 0), 0, 0, "dslope0", i * 4 + j);
            got += ag_tensor_item_at(jout[5], 1);
            want += gij * (double)(j - i);
        }
    tu_assert_near(got, want, 1e-12, "dslope1", 0);

    /* errors */
    assert_null(ag_trace_score_mod(&sm, AG_I64));
    tu_assert_error_contains("trace_score_mod: the scores' dtype must be float32 or float64");
    ag_tensor *nb = NULL;
    ag_mask_mod bad = {mask_fn, &mc, &nb, 1};
    assert_null(ag_trace_mask_mod(&bad));
    tu_assert_error_contains("trace_mask_mod: buffer 0 is NULL");
    ag_score_mod nul = {null_score, NULL, NULL, 0};
    assert_null(ag_trace_score_mod(&nul, AG_F32));
    tu_assert_error_contains("trace_score_mod: the function returned NULL");

    ag_block_mask_free(bm);
    ag_block_mask_free(bmg);
    ag_graph_free(sg);
    ag_graph_free(mg);
    ag_graph_free(jg);
    ag_scope_end();
}

/* ---- upstream test 14: test_preserve_annotate_flex_attention, on the CPU ----
 * An identity score_mod and a block-causal mask over per-token document ids (a buffer), the
 * call inside annotate({'compile_with_inductor': 'flex_attention'}); the exported joint has
 * get_attr sdpa_score0, sdpa_mask0, fw_graph0, joint_graph0, mask_graph0 and the calls
 * flex_attention and flex_attention_backward, each carrying the annotation. Upstream's sizes
 * (batch 2, 4 heads, 288 tokens, head_dim 64); float32. */
typedef struct t14 {
    ag_block_mask *bm;
} t14;

static ag_tensor *block_causal(void *ud, ag_tensor *b, ag_tensor *h, ag_tensor *qi, ag_tensor *ki,
                               ag_tensor *const *bufs, int nbuf) {
    (void)ud, (void)h, (void)nbuf;
    ag_tensor *iq[2] = {b, qi}, *ik[2] = {b, ki};
    return and_(ag_eq(ag_index(bufs[0], iq, 2), ag_index(bufs[0], ik, 2)), ag_ge(qi, ki));
}

static int flex_module_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out,
                               int max_out) {
    (void)nin, (void)max_out;
    t14 *t = ag_module_ud(m);
    ag_score_mod id = {identity_score, NULL, NULL, 0};
    ag_scope_begin();
    ag_annotate_begin("compile_with_inductor",
                      (ag_mval){.kind = AG_MV_STR, .u.s = "flex_attention"});
    ag_tensor *o = NULL;
    int rc = ag_flex_attention(in[0], in[1], in[2], &id, t->bm, NULL, &o, NULL);
    ag_annotate_end();
    if (rc) {
        ag_scope_end();
        return rc;
    }
    return ag_module_return1(o, out);
}

static void test_upstream_14_annotations(void **state) {
    (void)state;
    const int64_t B = 2, H = 4, T = 12 * 24, E = 64;
    double *ids = malloc(sizeof(double) * (size_t)(B * T));
    for (int64_t i = 0; i < B * T; i++)
        ids[i] = (i % T) >= T / 2; /* the second half of each sequence is document 1 */
    ag_tensor *seq_idx = tu_tensor(AG_I64, 2, (int64_t[]){B, T}, ids);
    free(ids);
    ag_mask_mod mm = {block_causal, NULL, &seq_idx, 1};
    t14 t = {ag_create_block_mask(&mm, 1, 1, T, T, 0, 0)};
    assert_non_null(t.bm);
    ag_module *m = ag_module_new("FlexAttentionModule", flex_module_forward, &t, NULL);
    ag_tensor *x[3];
    for (int i = 0; i < 3; i++) {
        x[i] = ag_randn(AG_F32, 4, (int64_t[]){B, H, T, E});
        ag_tensor_set_requires_grad(x[i], true);
    }
    ag_joint *j = ag_export_joint(m, x, 3, NULL, NULL, 0, NULL);
    if (!j)
        fail_msg("export: %s", ag_last_error());
    const ag_graph *g = ag_joint_graph(j);
    assert_int_equal(ag_graph_verify(g), 0);
    const char *want[7][2] = {{"get_attr", "sdpa_score0"},        {"get_attr", "sdpa_mask0"},
                              {"call", "flex_attention"},         {"get_attr", "fw_graph0"},
                              {"get_attr", "joint_graph0"},       {"get_attr", "mask_graph0"},
                              {"call", "flex_attention_backward"}};
    for (int w = 0; w < 7; w++) {
        const ag_node *n = ag_graph_find(g, want[w][1]);
        if (!n)
            fail_msg("no node %s", want[w][1]);
        assert_int_equal(ag_node_kind_of(n),
                         !strcmp(want[w][0], "call") ? AG_NODE_CALL : AG_NODE_GET_ATTR);
        ag_mval v;
        if (ag_node_custom_count(n) != 1 ||
            strcmp(ag_node_custom_key_at(n, 0, &v), "compile_with_inductor") ||
            v.kind != AG_MV_STR || strcmp(v.u.s, "flex_attention"))
            fail_msg("%s lacks {'compile_with_inductor': 'flex_attention'}", want[w][1]);
    }
    /* the calls as printed: get_attr arguments, the block mask's tensors as constants */
    char *txt = ag_graph_to_string(g, NULL);
    /* upstream's arguments: the block mask as BlockMask.as_tuple() (Q_LEN, KV_LEN, 8 tensors,
     * Q_BLOCK_SIZE, KV_BLOCK_SIZE, the mask graph), _apply_kernel_options' dict for a CPU call
     * without return_lse, the buffers as tuples */
    assert_non_null(strstr(
        txt, "%flex_attention = flex_attention(%primals_1, %primals_2, %primals_3, "
             "%sdpa_score0, (288, 288, %_tensor_constant0, %_tensor_constant1, "
             "%_tensor_constant2, %_tensor_constant3, %_tensor_constant4, %_tensor_constant5, "
             "%_tensor_constant6, %_tensor_constant7, 128, 128, %sdpa_mask0), 0.125, "
             "{'BACKEND': 'AUTO', 'PRESCALE_QK': False, 'ROWS_GUARANTEED_SAFE': False, "
             "'BLOCKS_ARE_CONTIGUOUS': False, 'WRITE_DQ': True, 'OUTPUT_LOGSUMEXP': False, "
             "'OUTPUT_MAX': False}, (), (%_tensor_constant8,))  # (f32[2, 4, 288, 64], "
             "f32[2, 4, 288])"));
    assert_non_null(strstr(
        txt, "%flex_attention_backward = flex_attention_backward(%primals_1, %primals_2, "
             "%primals_3, %getitem, %getitem_1, %tangents_1, None, %fw_graph0, %joint_graph0, "
             "(288, 288, %_tensor_constant0_1, %_tensor_constant1_1, %_tensor_constant2_1, "
             "%_tensor_constant3_1, %_tensor_constant4_1, %_tensor_constant5_1, "
             "%_tensor_constant6_1, %_tensor_constant7_1, 128, 128, %mask_graph0), 0.125, "
             "{'BACKEND': 'AUTO', 'PRESCALE_QK': False, 'ROWS_GUARANTEED_SAFE': False, "
             "'BLOCKS_ARE_CONTIGUOUS': False, 'WRITE_DQ': True, 'OUTPUT_LOGSUMEXP': False, "
             "'OUTPUT_MAX': False}, (), (%_tensor_constant8_1,))  # (f32[2, 4, 288, 64], "
             "f32[2, 4, 288, 64], f32[2, 4, 288, 64])"));
    /* it parses back to the same text */
    ag_graph *back = ag_graph_parse(txt, strlen(txt));
    if (!back)
        fail_msg("parse: %s", ag_last_error());
    char *txt2 = ag_graph_to_string(back, NULL);
    assert_string_equal(txt, txt2);
    ag_free(txt2);
    ag_graph_free(back);
    ag_free(txt);
    /* The interpreter runs the joint (the ops with the subgraphs as score_mod and mask_mod):
     * the output and the gradients equal eager flex_attention's and ag_grad's. */
    ag_tensor *tangent = ag_randn(AG_F32, 4, (int64_t[]){B, H, T, E});
    ag_tensor *jin[4] = {x[0], x[1], x[2], tangent}, *jout[8];
    int nj = ag_graph_run(g, jin, 4, jout, 8);
    if (nj != 4)
        fail_msg("run: %s", ag_last_error());
    ag_score_mod id = {identity_score, NULL, NULL, 0};
    ag_tensor *eo = NULL, *eg[3];
    assert_int_equal(ag_flex_attention(x[0], x[1], x[2], &id, t.bm, NULL, &eo, NULL), 0);
    assert_int_equal(ag_grad(&eo, &tangent, 1, x, 3, eg, false, false), 0);
    assert_true(tu_max_abs_diff(jout[0], eo) < 1e-6);
    for (int i = 0; i < 3; i++)
        if (!(tu_max_abs_diff(jout[1 + i], eg[i]) < 1e-5))
            fail_msg("interpreted gradient %d differs by %g", i,
                     tu_max_abs_diff(jout[1 + i], eg[i]));
    /* Compiled (the default partitioner, the planned executor): the same results. */
    ag_compiled *c = ag_compile_joint(j, NULL);
    if (!c)
        fail_msg("compile: %s", ag_last_error());
    ag_tensor *yc = NULL, *gc[3];
    if (ag_compiled_call_module(c, m, x, 3, &yc, 1) != 1 ||
        ag_grad(&yc, &tangent, 1, x, 3, gc, false, false))
        fail_msg("compiled: %s", ag_last_error());
    assert_true(tu_max_abs_diff(yc, eo) < 1e-6);
    for (int i = 0; i < 3; i++)
        if (!(tu_max_abs_diff(gc[i], eg[i]) < 1e-5))
            fail_msg("compiled gradient %d differs by %g", i, tu_max_abs_diff(gc[i], eg[i]));
    for (int i = 0; i < 3; i++)
        ag_tensor_free(gc[i]);
    ag_tensor_free(yc);
    ag_compiled_free(c);
    for (int i = 0; i < 4; i++)
        ag_tensor_free(jout[i]);
    for (int i = 0; i < 3; i++)
        ag_tensor_free(eg[i]);
    ag_tensor_free(eo);
    ag_tensor_free(tangent);
    /* More configurations (both partitioners, budgets, the interpreter): test_compiled. */
    ag_joint_free(j);
    ag_module_free(m);
    for (int i = 0; i < 3; i++)
        ag_tensor_free(x[i]);
    ag_tensor_free(seq_idx);
    ag_block_mask_free(t.bm);
}

/* ag_trace of a plain call (no score_mod, no block mask): upstream's defaults are recorded (an
 * identity sdpa_score0, a block mask of full blocks as constants, no mask graph), and the
 * graph runs to eager's result. */
static int plain_flex(void *ud, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)ud, (void)nin, (void)max_out;
    return ag_flex_attention(in[0], in[1], in[2], NULL, NULL, NULL, &out[0], &out[1]) ? -1 : 2;
}

static void test_trace_defaults(void **state) {
    (void)state;
    ag_scope_begin();
    ag_tensor *x[3] = {rnd(AG_F64, 1, 2, 10, 4, false), rnd(AG_F64, 1, 2, 10, 4, false),
                       rnd(AG_F64, 1, 2, 10, 3, false)};
    ag_graph *g = ag_trace(plain_flex, NULL, x, 3, NULL, NULL, NULL);
    if (!g)
        fail_msg("trace: %s", ag_last_error());
    assert_int_equal(ag_graph_verify(g), 0);
    char *txt = ag_graph_to_string(g, NULL);
    if (strstr(txt, "empty"))
        fail_msg("%s", txt);
    /* return_lse: OUTPUT_LOGSUMEXP is True */
    assert_non_null(strstr(txt, "%flex_attention = flex_attention(%arg0, %arg1, %arg2, "
                                "%sdpa_score0, (10, 10, %_tensor_constant0, %_tensor_constant1, "
                                "%_tensor_constant2, %_tensor_constant3, %_tensor_constant4, "
                                "%_tensor_constant5, %_tensor_constant6, %_tensor_constant7, "
                                "128, 128, None), 0.5, {'BACKEND': 'AUTO', 'PRESCALE_QK': False, "
                                "'ROWS_GUARANTEED_SAFE': False, 'BLOCKS_ARE_CONTIGUOUS': False, "
                                "'WRITE_DQ': True, 'OUTPUT_LOGSUMEXP': True, 'OUTPUT_MAX': "
                                "False}, (), ())"));
    assert_non_null(strstr(txt, "constant _tensor_constant2 : i64[1, 1, 1] = [1]"));
    ag_free(txt);
    ag_tensor *run[2], *eo = NULL, *el = NULL;
    assert_int_equal(ag_graph_run(g, x, 3, run, 2), 2);
    assert_int_equal(ag_flex_attention(x[0], x[1], x[2], NULL, NULL, NULL, &eo, &el), 0);
    assert_true(tu_max_abs_diff(run[0], eo) == 0);
    assert_true(tu_max_abs_diff(run[1], el) == 0);
    ag_graph_free(g);
    ag_scope_end();
}

/* ---- partitioned and compiled ----
 * A module: y = flex_attention(q, k, v, score_mod=ALiBi with the learnable parameter `slopes`
 * as its buffer, block_mask=causal within documents) * w, w a parameter [Ev]. Exported, its
 * joint compiled with the default and the min-cut partitioner at budgets 0 and 1, its halves
 * run by the planned executor and by the interpreter: over two calls (new q, k, v, tangent and
 * parameters each), the output and the gradients of q, k, v, slopes and w equal eager
 * flex_attention's and ag_grad's. Tolerance 1e-10 in float64: every path runs the same flex
 * kernel (the same tiles in the same order); what may differ is the summation order of the
 * planned reductions around it (w's gradient), a few ulps, where a wrong mask, a lost buffer
 * gradient or a stale saved value gives differences of order 0.01 to 1. Structure: the
 * forward graph holds flex_attention, the backward flex_attention_backward and no
 * flex_attention (never recomputed), and both of its outputs (out, logsumexp) are saved. */
#define FC_B 2
#define FC_H 2
#define FC_T 24
#define FC_E 8

static ag_tensor *causal_doc(void *ud, ag_tensor *b, ag_tensor *h, ag_tensor *qi, ag_tensor *ki,
                             ag_tensor *const *bufs, int nbuf) {
    (void)ud, (void)b, (void)h;
    assert_int_equal(nbuf, 1);
    return and_(ag_ge(qi, ki), ag_eq(ag_index(bufs[0], &qi, 1), ag_index(bufs[0], &ki, 1)));
}

static int alibi_module_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out,
                                int max_out) {
    (void)nin, (void)max_out;
    ag_block_mask *bm = ag_module_ud(m);
    ag_tensor *slopes = ag_module_param(m, "slopes");
    ag_score_mod sm = {alibi, NULL, &slopes, 1};
    ag_scope_begin();
    ag_tensor *o = NULL;
    int rc = ag_flex_attention(in[0], in[1], in[2], &sm, bm, NULL, &o, NULL);
    if (rc) {
        ag_scope_end();
        return rc;
    }
    return ag_module_return1(ag_mul(o, ag_module_param(m, "w")), out);
}

/* Whether output k of g's output node is getitem(%<call of op>, idx). */
static bool output_is_item(const ag_graph *g, int k, const char *op, int idx) {
    const ag_garg *a = ag_node_arg(ag_graph_output_node(g), 0);
    const ag_node *n = k < a->n ? a->u.nodes[k] : NULL;
    if (!n || ag_node_kind_of(n) != AG_NODE_GETITEM || ag_node_arg(n, 1)->u.i != idx)
        return false;
    const ag_node *src = ag_node_arg_node(n, 0);
    return ag_node_kind_of(src) == AG_NODE_CALL && !strcmp(ag_op_name(ag_node_op(src)), op);
}

static int count_calls(const ag_graph *g, const char *op) {
    int c = 0;
    for (const ag_node *n = ag_graph_first(g); n; n = ag_node_next(n))
        c += ag_node_kind_of(n) == AG_NODE_CALL && !strcmp(ag_op_name(ag_node_op(n)), op);
    return c;
}

/* Edits joint graph j to return 2 * each of its outputs (add(x, x)). */
static void double_joint_outputs(ag_graph *j) {
    assert_non_null(j);
    ag_node *o = ag_graph_output_node(j);
    const ag_garg *oa = ag_node_arg(o, 0);
    ag_node *outs[16];
    const int n = oa->n;
    assert_true(n <= 16);
    const ag_op *add = ag_op_find("add.Tensor");
    for (int i = 0; i < n; i++) {
        ag_node *x = oa->u.nodes[i];
        outs[i] = x ? ag_graph_call(j, add, (ag_garg[]){AG_GA_N(x), AG_GA_N(x)}, 2, NULL) : NULL;
        assert_true(!x || outs[i]);
    }
    assert_int_equal(ag_node_set_arg(o, 0, AG_GA_NODES(outs, n)), 0);
}

static void test_compiled(void **state) {
    (void)state;
    const int64_t doc[FC_T] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1,
                               1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2};
    double dd[FC_T];
    for (int i = 0; i < FC_T; i++)
        dd[i] = (double)doc[i];
    ag_tensor *doc_t = tu_tensor(AG_I64, 1, (int64_t[]){FC_T}, dd);
    ag_mask_mod mm = {causal_doc, NULL, &doc_t, 1};
    ag_block_mask *bm = ag_create_block_mask(&mm, 1, 1, FC_T, FC_T, 8, 8);
    assert_non_null(bm);
    ag_module *m = ag_module_new("FlexAlibi", alibi_module_forward, bm, NULL);
    assert_int_equal(ag_module_add_tensor(m, "slopes", true, AG_F64, 1, (int64_t[]){FC_H},
                                          AG_INIT_UNIFORM, -0.5, -0.1),
                     0);
    assert_int_equal(
        ag_module_add_tensor(m, "w", true, AG_F64, 1, (int64_t[]){FC_E}, AG_INIT_UNIFORM, 0.5, 1.5),
        0);
    ag_tensor *p[2] = {ag_module_param(m, "slopes"), ag_module_param(m, "w")};
    ag_tensor *x[3];
    for (int i = 0; i < 3; i++)
        x[i] = rnd(AG_F64, FC_B, FC_H, FC_T, FC_E, true);
    ag_joint *j = ag_export_joint(m, x, 3, NULL, NULL, 0, NULL);
    if (!j)
        fail_msg("export: %s", ag_last_error());
    for (int i = 0; i < 3; i++)
        ag_tensor_free(x[i]);
    for (int cfg = 0; cfg < 8; cfg++) {
        const bool mincut = cfg & 1, interpret = cfg & 4;
        const double budget = (cfg & 2) ? 1.0 : 0.0;
        ag_compile_opts co = {
            .partition = {.partitioner = mincut ? AG_PARTITION_MINCUT : AG_PARTITION_DEFAULT,
                          .memory_budget = ag_memory_budget(budget)},
            .interpret = interpret};
        ag_compiled *c = ag_compile_joint(j, &co);
        if (!c)
            fail_msg("compile (%s, budget %g, %s): %s", mincut ? "min-cut" : "default", budget,
                     interpret ? "interpreted" : "planned", ag_last_error());
        const ag_graph *fw = ag_compiled_forward_graph(c), *bw = ag_compiled_backward_graph(c);
        assert_int_equal(count_calls(fw, "flex_attention"), 1);
        assert_int_equal(count_calls(bw, "flex_attention_backward"), 1);
        assert_int_equal(count_calls(bw, "flex_attention"), 0);
        /* each side holds the subgraphs its calls read, and only those */
        assert_int_equal(ag_graph_num_subgraphs(fw), 2);
        assert_non_null(ag_graph_subgraph(fw, "sdpa_score0"));
        assert_non_null(ag_graph_subgraph(fw, "sdpa_mask0"));
        assert_int_equal(ag_graph_num_subgraphs(bw), 3);
        assert_non_null(ag_graph_subgraph(bw, "fw_graph0"));
        assert_non_null(ag_graph_subgraph(bw, "joint_graph0"));
        assert_non_null(ag_graph_subgraph(bw, "mask_graph0"));
        const int nfo = ag_node_arg(ag_graph_output_node(fw), 0)->n;
        bool saved_out = false, saved_lse = false;
        for (int k = 1; k < nfo; k++) {
            saved_out |= output_is_item(fw, k, "flex_attention", 0);
            saved_lse |= output_is_item(fw, k, "flex_attention", 1);
        }
        if (!saved_out || !saved_lse)
            fail_msg("config %d: out saved %d, logsumexp saved %d", cfg, saved_out, saved_lse);
        for (int call = 0; call < 2; call++) {
            for (int i = 0; i < 3; i++)
                x[i] = rnd(AG_F64, FC_B, FC_H, FC_T, FC_E, true);
            ag_tensor *tangent = rnd(AG_F64, FC_B, FC_H, FC_T, FC_E, false);
            ag_tensor *wrt[5] = {x[0], x[1], x[2], p[0], p[1]}, *ge[5], *gc[5];
            ag_tensor *ye = NULL, *yc = NULL;
            assert_int_equal(ag_module_call(m, x, 3, &ye, 1), 1);
            assert_int_equal(ag_grad(&ye, &tangent, 1, wrt, 5, ge, false, false), 0);
            if (ag_compiled_call_module(c, m, x, 3, &yc, 1) != 1)
                fail_msg("config %d call %d: %s", cfg, call, ag_last_error());
            if (ag_grad(&yc, &tangent, 1, wrt, 5, gc, false, false))
                fail_msg("config %d call %d: backward: %s", cfg, call, ag_last_error());
            double d = tu_max_abs_diff(ye, yc);
            if (!(d < 1e-10))
                fail_msg("config %d call %d: output differs by %g", cfg, call, d);
            for (int i = 0; i < 5; i++)
                if (!((d = tu_max_abs_diff(ge[i], gc[i])) < 1e-10))
                    fail_msg("config %d call %d: gradient %d differs by %g", cfg, call, i, d);
            for (int i = 0; i < 5; i++) {
                ag_tensor_free(ge[i]);
                ag_tensor_free(gc[i]);
            }
            ag_tensor_free(ye);
            ag_tensor_free(yc);
            ag_tensor_free(tangent);
            for (int i = 0; i < 3; i++)
                ag_tensor_free(x[i]);
            /* new parameters for the next call */
            bool prev = ag_set_grad_enabled(false);
            ag_scope_begin(); /* the ops' returned references */
            assert_non_null(ag_mul_scalar_(p[0], 1.5));
            assert_non_null(ag_add_scalar_(p[1], 0.25));
            ag_scope_end();
            ag_set_grad_enabled(prev);
        }
        ag_compiled_free(c);
    }
    /* Warm runs of the planned halves allocate nothing, the flex steps included (their
     * graphs run per tile through plans made at ag_plan_new, into memory the plans own). Then
     * joint_graph0 is what the backward (planned or interpreted) runs for score_mod's
     * gradient: the backward graph with its joint edited to return twice grad_score and twice
     * the slopes' gradient gives twice the gradients of q, k and slopes (linear in the scores'
     * gradient) and the same gradients of v and w, where a backward differentiating fw_graph0
     * would not change. */
    {
        ag_compiled *c = ag_compile_joint(j, NULL);
        assert_non_null(c);
        warm_halves w;
        warm_halves_run(&w, c, &rng);
        const ag_graph *bw = ag_compiled_backward_graph(c);
        print_message("  warm runs: forward plan %lld allocations in flex_attention, %lld "
                      "elsewhere; backward plan %lld in flex_attention_backward, %lld "
                      "elsewhere\n",
                      (long long)w.af.flex, (long long)w.af.other, (long long)w.ab.flex,
                      (long long)w.ab.other);
        assert_int_equal(w.af.other, 0);
        assert_int_equal(w.ab.other, 0);
        assert_int_equal(w.af.flex, 0);
        assert_int_equal(w.ab.flex, 0);
        ag_graph *ed = ag_graph_copy(bw);
        assert_non_null(ed);
        double_joint_outputs(ag_graph_subgraph(ed, "joint_graph0"));
        ag_plan *pe = ag_plan_new(ed, NULL);
        if (!pe)
            fail_msg("plan_new (edited joint): %s", ag_last_error());
        ag_tensor *eo[16];
        /* outputs: the gradients of slopes, w, q, k, v */
        assert_int_equal(w.nbo, 5);
        const double factor[5] = {2, 1, 2, 2, 1};
        for (int run = 0; run < 2; run++) { /* the planned executor, the interpreter */
            const int ne =
                run ? ag_graph_run(ed, w.bi, w.nbi, eo, 16) : ag_plan_run(pe, w.bi, w.nbi, eo, 16);
            if (ne != w.nbo)
                fail_msg("edited joint (%s): %s", run ? "interpreted" : "planned", ag_last_error());
            for (int i = 0; i < w.nbo; i++) {
                ag_tensor *want = ag_mul_scalar(w.bo[i], factor[i]);
                ag_tensor *zero = ag_zeros_like(w.bo[i]);
                const double d = tu_max_abs_diff(eo[i], want), mag = tu_max_abs_diff(w.bo[i], zero);
                ag_tensor_free(zero);
                if (!(d < 1e-12 * (1 + mag)) || !(mag > 1e-3))
                    fail_msg(
                        "edited joint (%s): gradient %d differs from %g x the original's by %g "
                        "(magnitude %g)",
                        run ? "interpreted" : "planned", i, factor[i], d, mag);
                ag_tensor_free(want);
                ag_tensor_free(eo[i]);
            }
        }
        ag_plan_free(pe);
        ag_graph_free(ed);
        warm_halves_free(&w);
        ag_compiled_free(c);
    }
    /* The forward tagged MUST_RECOMPUTE (activation checkpointing over it): flex_attention is
     * still not recomputed in the backward (banned like random ops and subgraph calls), at
     * budgets 0 and 1. */
    for (int b = 0; b < 2; b++) {
        ag_graph *g = ag_graph_copy(ag_joint_graph(j));
        assert_non_null(g);
        ag_node *first = ag_graph_find(g, "flex_attention"), *last = ag_graph_find(g, "mul");
        assert_non_null(first);
        assert_non_null(last);
        assert_int_equal(ag_tag_region_recompute(g, first, last, AG_MUST_RECOMPUTE), 0);
        ag_partition_opts po = {.memory_budget = ag_memory_budget(b)};
        ag_graph *fw = NULL, *bw = NULL;
        if (ag_partition(g, ag_layout_num_fw_outputs(ag_joint_layout(j)), &po, &fw, &bw, NULL))
            fail_msg("partition (recompute tags, budget %d): %s", b, ag_last_error());
        assert_int_equal(count_calls(fw, "flex_attention"), 1);
        assert_int_equal(count_calls(bw, "flex_attention"), 0);
        assert_int_equal(count_calls(bw, "flex_attention_backward"), 1);
        ag_graph_free(fw);
        ag_graph_free(bw);
        ag_graph_free(g);
    }
    ag_joint_free(j);
    ag_module_free(m);
    ag_block_mask_free(bm);
    ag_tensor_free(doc_t);
}

/* ---- out of memory ----
 * A block mask (document masking, its ids a buffer), flex_attention with ALiBi and its
 * backward to q, k, v and the slopes: each allocation failing in turn (and every one from
 * there on) fails the step with ENOMEM and leaks nothing. */
typedef struct oom_case {
    ag_tensor *q, *k, *v, *slopes, *doc;
    mcase mc;
} oom_case;

static int oom_step(void *ud) {
    oom_case *oc = ud;
    ag_mask_mod mm = {mask_fn, &oc->mc, &oc->doc, 1};
    ag_block_mask *bm = ag_create_block_mask(&mm, 1, 1, 12, 12, 4, 4);
    if (!bm)
        return ag_last_status();
    ag_scope_begin();
    ag_score_mod sm = {alibi, NULL, &oc->slopes, 1};
    ag_tensor *out = NULL, *lse = NULL, *g[4] = {0};
    int rc = ag_flex_attention(oc->q, oc->k, oc->v, &sm, bm, NULL, &out, &lse);
    ag_block_mask_free(bm);
    if (!rc) {
        ag_tensor *wrt[4] = {oc->q, oc->k, oc->v, oc->slopes};
        ag_tensor *loss = ag_add(ag_sum_all(out), ag_sum_all(lse));
        rc = loss ? ag_grad(&loss, NULL, 1, wrt, 4, g, false, false) : ag_last_status();
    }
    tu_alloc_cleanup_begin();
    ag_scope_end();
    tu_alloc_cleanup_end();
    return rc;
}

/* Tracing the functions into graphs and running flex_attention with the graphs in their place. */
static int oom_trace(void *ud) {
    oom_case *oc = ud;
    ag_score_mod sm = {alibi, NULL, &oc->slopes, 1};
    ag_mask_mod mm = {mask_fn, &oc->mc, &oc->doc, 1};
    ag_graph *sg = ag_trace_score_mod(&sm, AG_F64), *jg = ag_trace_score_mod_joint(&sm, AG_F64);
    ag_graph *mg = ag_trace_mask_mod(&mm);
    int rc = sg && jg && mg ? 0 : ag_last_status();
    ag_block_mask *bm = NULL;
    if (!rc) {
        ag_mask_mod mmg = {ag_mask_mod_graph, mg, &oc->doc, 1};
        bm = ag_create_block_mask(&mmg, 1, 1, 12, 12, 4, 4);
        rc = bm ? 0 : ag_last_status();
    }
    ag_scope_begin();
    if (!rc) {
        ag_score_mod smg = {ag_score_mod_graph, sg, &oc->slopes, 1};
        ag_tensor *out = NULL, *g[4];
        rc = ag_flex_attention(oc->q, oc->k, oc->v, &smg, bm, NULL, &out, NULL);
        ag_tensor *loss = rc ? NULL : ag_sum_all(out);
        ag_tensor *wrt[4] = {oc->q, oc->k, oc->v, oc->slopes};
        if (!rc)
            rc = loss ? ag_grad(&loss, NULL, 1, wrt, 4, g, false, false) : ag_last_status();
    }
    tu_alloc_cleanup_begin();
    ag_scope_end();
    ag_block_mask_free(bm);
    ag_graph_free(sg);
    ag_graph_free(jg);
    ag_graph_free(mg);
    tu_alloc_cleanup_end();
    return rc;
}

/* The call traced (its functions as subgraphs) and run by the interpreter: 5 x 5 blocks over
 * 12 positions, so tiles of four shapes, a re-inferred graph kept per shape during the call. */
static int oom_interp(void *ud) {
    oom_case *oc = ud;
    ag_mask_mod mm = {mask_fn, &oc->mc, &oc->doc, 1};
    ag_block_mask *bm = ag_create_block_mask(&mm, 1, 1, 12, 12, 5, 5);
    ag_tensor *in[4] = {oc->q, oc->k, oc->v, oc->slopes}, *out[2] = {0};
    ag_graph *g = bm ? ag_trace(alibi_flex, bm, in, 4, NULL, NULL, NULL) : NULL;
    int rc = g ? 0 : ag_last_status();
    if (!rc) {
        const int n = ag_graph_run(g, in, 4, out, 2);
        rc = n < 0 ? n : n == 2 ? 0 : AG_EINVAL;
    }
    tu_alloc_cleanup_begin();
    for (int i = 0; i < 2 && !rc; i++)
        ag_tensor_free(out[i]);
    ag_graph_free(g);
    ag_block_mask_free(bm);
    tu_alloc_cleanup_end();
    return rc;
}

static void test_out_of_memory(void **st) {
    (void)st;
    int64_t ids[12] = {0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2};
    double d[12];
    for (int i = 0; i < 12; i++)
        d[i] = (double)ids[i];
    oom_case oc = {rnd(AG_F64, 1, 2, 12, 4, true),
                   rnd(AG_F64, 1, 2, 12, 4, true),
                   rnd(AG_F64, 1, 2, 12, 3, true),
                   tu_leaf(AG_F64, 1, (int64_t[]){2}, (double[]){0.5, -0.25}),
                   tu_tensor(AG_I64, 1, (int64_t[]){12}, d),
                   {.kind = M_DOC, .doc_ids = ids}};
    tu_sweep_opts o = {.what = "flex_attention", .one_thread = true};
    assert_true(tu_alloc_failure_sweep(oom_step, &oc, &o) > 10);
    o.persistent = true;
    assert_true(tu_alloc_failure_sweep(oom_step, &oc, &o) > 10);
    tu_sweep_opts ot = {.what = "flex_attention's functions as graphs", .one_thread = true};
    assert_true(tu_alloc_failure_sweep(oom_trace, &oc, &ot) > 10);
    ot.persistent = true;
    assert_true(tu_alloc_failure_sweep(oom_trace, &oc, &ot) > 10);
    tu_sweep_opts oi = {.what = "flex_attention traced, interpreted", .one_thread = true};
    assert_true(tu_alloc_failure_sweep(oom_interp, &oc, &oi) > 10);
    oi.persistent = true;
    assert_true(tu_alloc_failure_sweep(oom_interp, &oc, &oi) > 10);
    ag_tensor_free(oc.q);
    ag_tensor_free(oc.k);
    ag_tensor_free(oc.v);
    ag_tensor_free(oc.slopes);
    ag_tensor_free(oc.doc);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_block_mask_structure),
        cmocka_unit_test(test_matches_reference_f64),
        cmocka_unit_test(test_matches_reference_f32),
        cmocka_unit_test(test_gradcheck),
        cmocka_unit_test(test_strided_inputs),
        cmocka_unit_test(test_per_head_masks),
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_traced_mods),
        cmocka_unit_test(test_upstream_14_annotations),
        cmocka_unit_test(test_trace_defaults),
        cmocka_unit_test(test_compiled),
        cmocka_unit_test(test_out_of_memory),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
