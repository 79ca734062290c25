/* Eager flex_attention with a score_mod on the traced path (src/runtime/flex_eager.c: score_mod
 * traced once into its score and joint graphs, run per tile by per-thread tile plans) against
 * the per-tile path it replaced (the score_mod called per tile through the op dispatcher,
 * differentiated per tile with ag_grad; forced here by clearing the runtime's hook) and against
 * attention materialized from primitive ops: causal, sliding window and document masks, ALiBi
 * with learnable slopes (a buffer requiring grad) and a learnable [H, L, S] bias, float32 and
 * float64, edge tiles; a float64 gradcheck against finite differences; which path ran (the
 * score_mod's call count and ag__flex_eager_counts); an untraceable score_mod (it reads its
 * buffer's data) taking the per-tile path; 1 vs 2 threads; calls from two threads at once; an
 * allocation-failure sweep. */
#include "testutil.h"
#include "autograd/flex_internal.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

static int calls; /* score_mod calls */

enum { M_CAUSAL, M_SLIDING, M_DOC, NMASK };
static const int64_t doc_ids[20] = {0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2};

static bool keep(int kind, int64_t i, int64_t j) {
    if (kind == M_CAUSAL)
        return j <= i;
    if (kind == M_SLIDING)
        return j <= i && i - j < 6;
    return doc_ids[i] == doc_ids[j];
}

static ag_tensor *mask_fn(void *ud, ag_tensor *b, ag_tensor *h, ag_tensor *qi, ag_tensor *ki,
                          ag_tensor *const *bufs, int nbuf) {
    (void)b, (void)h, (void)nbuf;
    const int kind = *(const int *)ud;
    if (kind == M_CAUSAL)
        return ag_ge(qi, ki);
    if (kind == M_SLIDING) {
        ag_tensor *c = ag_ge(qi, ki);
        return ag_where(c, ag_lt_scalar(ag_sub(qi, ki), 6), c);
    }
    return ag_eq(ag_index(bufs[0], &qi, 1), ag_index(bufs[0], &ki, 1));
}

/* ALiBi: score + slopes[h] * (kv_idx - q_idx). */
static ag_tensor *alibi(void *ud, ag_tensor *score, ag_tensor *b, ag_tensor *h, ag_tensor *qi,
                        ag_tensor *ki, ag_tensor *const *bufs, int nbuf) {
    (void)ud, (void)b, (void)nbuf;
    calls++;
    ag_tensor *rel = ag_to_dtype(ag_sub(ki, qi), ag_tensor_dtype(score));
    return ag_add(score, ag_mul(ag_index(bufs[0], &h, 1), rel));
}

/* A learned bias [H, L, S]: score + bias[h, q_idx, kv_idx], then a soft-cap. */
static ag_tensor *learned_bias(void *ud, ag_tensor *score, ag_tensor *b, ag_tensor *h,
                               ag_tensor *qi, ag_tensor *ki, ag_tensor *const *bufs, int nbuf) {
    (void)ud, (void)b, (void)nbuf;
    calls++;
    ag_tensor *idx[3] = {h, qi, ki};
    ag_tensor *s = ag_add(score, ag_index(bufs[0], idx, 3));
    return ag_mul_scalar(ag_tanh(ag_div_scalar(s, 4)), 4);
}

/* ALiBi reading its slopes' data in C: it cannot be traced (a data-less stand-in has none). */
static ag_tensor *alibi_reads_data(void *ud, ag_tensor *score, ag_tensor *b, ag_tensor *h,
                                   ag_tensor *qi, ag_tensor *ki, ag_tensor *const *bufs, int nbuf) {
    (void)ud, (void)b, (void)nbuf;
    calls++;
    const void *p = ag_tensor_data(bufs[0]);
    if (!p) {
        ag_set_error(AG_EINVAL, "alibi_reads_data: no data");
        return NULL;
    }
    return alibi(ud, score, b, h, qi, ki, bufs, nbuf);
}

static uint64_t rng = 0x1234567887654321ull;

static ag_tensor *rnd(ag_dtype dt, int nd, const int64_t *sz, bool grad) {
    ag_tensor *t = tu_rand_tensor(dt, nd, sz, -1, 1, tu_xorshift, &rng);
    if (grad)
        ag_tensor_set_requires_grad(t, true);
    return t;
}

enum { B = 2, H = 3, T = 20, E = 5, BS = 8 };

typedef struct run_out {
    ag_tensor *r[6]; /* out, lse, dq, dk, dv, dbuf (kept) */
} run_out;

static void run_free(run_out *o) {
    for (int i = 0; i < 6; i++)
        ag_tensor_free(o->r[i]);
}

/* One flex_attention call and the gradients of sum(out * w) + sum(lse) into o. */
static void run(ag_tensor *const *qkv, ag_tensor *buf, ag_score_mod_fn fn, ag_block_mask *bm,
                run_out *o) {
    ag_scope_begin();
    ag_score_mod sm = {fn, NULL, &buf, 1};
    ag_flex_opts fo = {.q_block_size = BS, .kv_block_size = BS};
    ag_tensor *out = NULL, *lse = NULL;
    assert_int_equal(ag_flex_attention(qkv[0], qkv[1], qkv[2], &sm, bm, &fo, &out, &lse), 0);
    ag_tensor *w = ag_sin(ag_detach(out));
    ag_tensor *loss = ag_add(ag_sum_all(ag_mul(out, w)), ag_sum_all(ag_mul_scalar(lse, 0.5)));
    ag_tensor *wrt[4] = {qkv[0], qkv[1], qkv[2], buf}, *g[4] = {0};
    assert_int_equal(ag_grad(&loss, NULL, 1, wrt, 4, g, false, false), 0);
    o->r[0] = ag_tensor_keep(out);
    o->r[1] = ag_tensor_keep(lse);
    for (int i = 0; i < 4; i++)
        o->r[2 + i] = g[i] ? ag_tensor_keep(g[i]) : NULL;
    ag_scope_end();
}

static double max_diff(const ag_tensor *a, const ag_tensor *b) {
    assert_non_null(a);
    assert_non_null(b);
    assert_int_equal(ag_tensor_numel(a), ag_tensor_numel(b));
    double m = 0;
    for (int64_t i = 0; i < ag_tensor_numel(a); i++) {
        const double x = ag_tensor_item_at(a, i), y = ag_tensor_item_at(b, i);
        if (isinf(x) || isinf(y)) {
            assert_true(x == y);
            continue;
        }
        m = fabs(x - y) > m ? fabs(x - y) : m;
    }
    return m;
}

/* Materialized reference out [B, H, T, E] of the ALiBi case (plain C, float64). */
static void reference_alibi(ag_tensor *const *qkv, const ag_tensor *slopes, int kind, double *out) {
    const double scale = 1 / sqrt((double)E);
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t i = 0; i < T; i++) {
                double s[T], mx = -INFINITY, sum = 0;
                for (int64_t j = 0; j < T; j++) {
                    double d = 0;
                    for (int64_t e = 0; e < E; e++)
                        d += ag_tensor_item_at(qkv[0], ((b * H + h) * T + i) * E + e) *
                             ag_tensor_item_at(qkv[1], ((b * H + h) * T + j) * E + e);
                    s[j] = keep(kind, i, j)
                               ? d * scale + ag_tensor_item_at(slopes, h) * (double)(j - i)
                               : -INFINITY;
                    mx = s[j] > mx ? s[j] : mx;
                }
                for (int64_t j = 0; j < T; j++)
                    sum += s[j] == -INFINITY ? 0 : exp(s[j] - mx);
                for (int64_t e = 0; e < E; e++) {
                    double acc = 0;
                    for (int64_t j = 0; j < T; j++)
                        if (s[j] != -INFINITY)
                            acc += exp(s[j] - mx) / sum *
                                   ag_tensor_item_at(qkv[2], ((b * H + h) * T + j) * E + e);
                    out[((b * H + h) * T + i) * E + e] = acc;
                }
            }
}

static ag_block_mask *make_mask(int *kind, ag_tensor **doc) {
    ag_mask_mod mm = {mask_fn, kind, doc, 1};
    ag_block_mask *bm = ag_create_block_mask(&mm, 1, 1, T, T, BS, BS);
    assert_non_null(bm);
    return bm;
}

/* Traced vs per-tile vs materialized, every mask, both score_mods, both dtypes. */
static void test_traced_vs_per_tile(void **state) {
    (void)state;
    const ag__flex_eager_hooks *hooks = ag__flex_eager;
    assert_non_null(hooks); /* the runtime installed it */
    ag_tensor *doc = ag_from_data(AG_I64, 1, (int64_t[]){T}, doc_ids);
    for (int dti = 0; dti < 2; dti++) {
        const ag_dtype dt = dti ? AG_F64 : AG_F32;
        const double tol = dt == AG_F64 ? 1e-12 : 2e-5;
        for (int kind = 0; kind < NMASK; kind++)
            for (int sc = 0; sc < 2; sc++) {
                const int64_t qs[4] = {B, H, T, E};
                ag_tensor *qkv[3] = {rnd(dt, 4, qs, true), rnd(dt, 4, qs, true),
                                     rnd(dt, 4, qs, true)};
                ag_tensor *buf = sc ? rnd(dt, 3, (int64_t[]){H, T, T}, true)
                                    : tu_leaf(dt, 1, (int64_t[]){H}, (double[]){0.5, -0.25, 0.125});
                ag_score_mod_fn fn = sc ? learned_bias : alibi;
                ag_block_mask *bm = make_mask(&kind, &doc);
                run_out tr = {0}, pt = {0};
                int64_t c0 = ag__flex_eager_counts[0], c1 = ag__flex_eager_counts[1];
                calls = 0;
                run(qkv, buf, fn, bm, &tr);
                assert_int_equal(calls, 3); /* forward: 1 trace; backward: score and joint */
                assert_int_equal(ag__flex_eager_counts[0] - c0, 2);
                assert_int_equal(ag__flex_eager_counts[1] - c1, 0);
                ag__flex_eager = NULL; /* the per-tile path */
                calls = 0;
                run(qkv, buf, fn, bm, &pt);
                ag__flex_eager = hooks;
                assert_true(calls > 3); /* per tile */
                assert_int_equal(ag__flex_eager_counts[1] - c1, 2);
                /* the forward: the same ops on the same tiles, bit for bit */
                assert_true(tu_same_bits(tr.r[0], pt.r[0]));
                assert_true(tu_same_bits(tr.r[1], pt.r[1]));
                const char *nm[6] = {"out", "lse", "dq", "dk", "dv", "dbuf"};
                for (int i = 0; i < 6; i++) {
                    const double d = max_diff(tr.r[i], pt.r[i]);
                    if (d > tol * (i < 2 ? 1 : 10))
                        fail_msg("%s mask %d score %d: %s differs by %g", ag_dtype_name(dt), kind,
                                 sc, nm[i], d);
                }
                if (!sc) {
                    double want[B * H * T * E];
                    reference_alibi(qkv, buf, kind, want);
                    tu_assert_close(tr.r[0], want, dt == AG_F64 ? 1e-12 : 1e-5);
                }
                run_free(&tr);
                run_free(&pt);
                ag_block_mask_free(bm);
                for (int i = 0; i < 3; i++)
                    ag_tensor_free(qkv[i]);
                ag_tensor_free(buf);
            }
    }
    ag_tensor_free(doc);
}

/* Whether the forward is bit-identical to the per-tile path (reported, float32 and float64). */
static void test_forward_bits(void **state) {
    (void)state;
    const ag__flex_eager_hooks *hooks = ag__flex_eager;
    int kind = M_CAUSAL;
    ag_tensor *doc = ag_from_data(AG_I64, 1, (int64_t[]){T}, doc_ids);
    ag_block_mask *bm = make_mask(&kind, &doc);
    const int64_t qs[4] = {B, H, T, E};
    ag_tensor *qkv[3] = {rnd(AG_F32, 4, qs, true), rnd(AG_F32, 4, qs, true),
                         rnd(AG_F32, 4, qs, true)};
    ag_tensor *slopes = tu_leaf(AG_F32, 1, (int64_t[]){H}, (double[]){0.5, -0.25, 0.125});
    run_out tr = {0}, pt = {0};
    run(qkv, slopes, alibi, bm, &tr);
    ag__flex_eager = NULL;
    run(qkv, slopes, alibi, bm, &pt);
    ag__flex_eager = hooks;
    assert_true(tu_same_bits(tr.r[0], pt.r[0])); /* out: the same ops on the same tiles */
    assert_true(tu_same_bits(tr.r[1], pt.r[1]));
    run_free(&tr);
    run_free(&pt);
    for (int i = 0; i < 3; i++)
        ag_tensor_free(qkv[i]);
    ag_tensor_free(slopes);
    ag_block_mask_free(bm);
    ag_tensor_free(doc);
}

/* An untraceable score_mod runs per tile, with the traced ALiBi's results. */
static void test_untraceable_falls_back(void **state) {
    (void)state;
    int kind = M_SLIDING;
    ag_tensor *doc = ag_from_data(AG_I64, 1, (int64_t[]){T}, doc_ids);
    ag_block_mask *bm = make_mask(&kind, &doc);
    const int64_t qs[4] = {B, H, T, E};
    ag_tensor *qkv[3] = {rnd(AG_F64, 4, qs, true), rnd(AG_F64, 4, qs, true),
                         rnd(AG_F64, 4, qs, true)};
    ag_tensor *slopes = tu_leaf(AG_F64, 1, (int64_t[]){H}, (double[]){0.5, -0.25, 0.125});
    run_out tr = {0}, fb = {0};
    run(qkv, slopes, alibi, bm, &tr);
    const int64_t c0 = ag__flex_eager_counts[0], c1 = ag__flex_eager_counts[1];
    calls = 0;
    run(qkv, slopes, alibi_reads_data, bm, &fb);
    assert_int_equal(ag__flex_eager_counts[0] - c0, 0);
    assert_int_equal(ag__flex_eager_counts[1] - c1, 2);
    /* forward: 1 failed trace + one call per visited tile; backward: 2 failed traces + per tile */
    assert_true(calls > 3 + 2 * B * H);
    assert_false(ag__has_error()); /* the failed trace's message is not left behind */
    for (int i = 0; i < 6; i++)
        assert_true(max_diff(tr.r[i], fb.r[i]) < 1e-12);
    run_free(&tr);
    run_free(&fb);
    for (int i = 0; i < 3; i++)
        ag_tensor_free(qkv[i]);
    ag_tensor_free(slopes);
    ag_block_mask_free(bm);
    ag_tensor_free(doc);
}

/* 1 and 2 threads: the same results (buffer gradients summed per thread: to rounding). */
static void test_threads(void **state) {
    (void)state;
    int kind = M_DOC;
    ag_tensor *doc = ag_from_data(AG_I64, 1, (int64_t[]){T}, doc_ids);
    ag_block_mask *bm = make_mask(&kind, &doc);
    const int64_t qs[4] = {B, H, T, E};
    ag_tensor *qkv[3] = {rnd(AG_F32, 4, qs, true), rnd(AG_F32, 4, qs, true),
                         rnd(AG_F32, 4, qs, true)};
    ag_tensor *slopes = tu_leaf(AG_F32, 1, (int64_t[]){H}, (double[]){0.5, -0.25, 0.125});
    const int nth = ag_get_num_threads();
    run_out one = {0}, two = {0};
    ag_set_num_threads(1);
    run(qkv, slopes, alibi, bm, &one);
    ag_set_num_threads(2);
    run(qkv, slopes, alibi, bm, &two);
    ag_set_num_threads(nth);
    for (int i = 0; i < 5; i++)
        assert_true(tu_same_bits(one.r[i], two.r[i])); /* each row on one thread */
    assert_true(max_diff(one.r[5], two.r[5]) < 1e-5);
    run_free(&one);
    run_free(&two);
    for (int i = 0; i < 3; i++)
        ag_tensor_free(qkv[i]);
    ag_tensor_free(slopes);
    ag_block_mask_free(bm);
    ag_tensor_free(doc);
}

/* Calls from two threads at once: each its own trace and tile plans, results as on one. */
typedef struct par_job {
    ag_tensor *qkv[3], *slopes;
    ag_block_mask *bm;
    ag_tensor *r[6]; /* kept */
    int rc;
} par_job;

static void *par_run(void *ud) {
    par_job *j = ud;
    ag_scope_begin();
    ag_score_mod sm = {alibi, NULL, &j->slopes, 1};
    ag_flex_opts fo = {.q_block_size = BS, .kv_block_size = BS};
    ag_tensor *out = NULL, *lse = NULL, *g[4] = {0};
    j->rc = ag_flex_attention(j->qkv[0], j->qkv[1], j->qkv[2], &sm, j->bm, &fo, &out, &lse);
    if (!j->rc) {
        ag_tensor *loss = ag_add(ag_sum_all(ag_mul(out, ag_sin(ag_detach(out)))),
                                 ag_sum_all(ag_mul_scalar(lse, 0.5)));
        ag_tensor *wrt[4] = {j->qkv[0], j->qkv[1], j->qkv[2], j->slopes};
        j->rc = loss ? ag_grad(&loss, NULL, 1, wrt, 4, g, false, false) : ag_last_status();
    }
    if (!j->rc) {
        j->r[0] = ag_tensor_keep(out);
        j->r[1] = ag_tensor_keep(lse);
        for (int i = 0; i < 4; i++)
            j->r[2 + i] = ag_tensor_keep(g[i]);
    }
    ag_scope_end();
    return NULL;
}

static void test_concurrent_calls(void **state) {
    (void)state;
    int kind = M_CAUSAL;
    ag_tensor *doc = ag_from_data(AG_I64, 1, (int64_t[]){T}, doc_ids);
    ag_block_mask *bm = make_mask(&kind, &doc);
    const int64_t qs[4] = {B, H, T, E};
    par_job jobs[2];
    for (int t = 0; t < 2; t++) {
        jobs[t] = (par_job){
            {rnd(AG_F64, 4, qs, true), rnd(AG_F64, 4, qs, true), rnd(AG_F64, 4, qs, true)},
            tu_leaf(AG_F64, 1, (int64_t[]){H}, (double[]){0.5, -0.25 * t, 0.125}),
            bm,
            {0},
            0};
    }
    run_out want[2] = {0};
    for (int t = 0; t < 2; t++)
        run(jobs[t].qkv, jobs[t].slopes, alibi, bm, &want[t]);
    for (int round = 0; round < 3; round++) {
        pthread_t th[2];
        for (int t = 0; t < 2; t++)
            assert_int_equal(pthread_create(&th[t], NULL, par_run, &jobs[t]), 0);
        for (int t = 0; t < 2; t++)
            pthread_join(th[t], NULL);
        for (int t = 0; t < 2; t++) {
            assert_int_equal(jobs[t].rc, 0);
            for (int i = 0; i < 6; i++) {
                assert_true(max_diff(jobs[t].r[i], want[t].r[i]) < 1e-12);
                ag_tensor_free(jobs[t].r[i]);
                jobs[t].r[i] = NULL;
            }
        }
    }
    for (int t = 0; t < 2; t++) {
        run_free(&want[t]);
        for (int i = 0; i < 3; i++)
            ag_tensor_free(jobs[t].qkv[i]);
        ag_tensor_free(jobs[t].slopes);
    }
    ag_block_mask_free(bm);
    ag_tensor_free(doc);
}

typedef struct gc_ud {
    ag_block_mask *bm;
    ag_score_mod_fn fn;
} gc_ud;

static int gc_fn(void *ud, ag_tensor *const *in, int n, ag_tensor **outs, int *nouts) {
    (void)n;
    gc_ud *g = ud;
    ag_tensor *buf = in[3];
    ag_score_mod sm = {g->fn, NULL, &buf, 1};
    ag_flex_opts fo = {.q_block_size = 4, .kv_block_size = 4};
    *nouts = 2;
    return ag_flex_attention(in[0], in[1], in[2], &sm, g->bm, &fo, &outs[0], &outs[1]);
}

/* float64 gradcheck of the traced path: q, k, v and a learnable bias. */
static void test_gradcheck_traced(void **state) {
    (void)state;
    ag_scope_begin();
    int kind = M_SLIDING;
    ag_mask_mod mm = {mask_fn, &kind, NULL, 0};
    gc_ud g = {ag_create_block_mask(&mm, 1, 1, 9, 9, 4, 4), learned_bias};
    const int64_t qs[4] = {1, 2, 9, 3};
    ag_tensor *in[4] = {rnd(AG_F64, 4, qs, true), rnd(AG_F64, 4, qs, true),
                        rnd(AG_F64, 4, qs, true), rnd(AG_F64, 3, (int64_t[]){2, 9, 9}, true)};
    const int64_t c0 = ag__flex_eager_counts[0];
    if (ag_gradcheck(gc_fn, &g, in, 4, NULL))
        fail_msg("gradcheck: %s", ag_last_error());
    assert_true(ag__flex_eager_counts[0] > c0);
    ag_block_mask_free(g.bm);
    ag_scope_end();
}

typedef struct oom_case {
    ag_tensor *qkv[3], *slopes, *doc;
} oom_case;

static int oom_step(void *ud) {
    oom_case *oc = ud;
    int kind = M_CAUSAL;
    ag_mask_mod mm = {mask_fn, &kind, &oc->doc, 1};
    ag_block_mask *bm = ag_create_block_mask(&mm, 1, 1, T, T, BS, BS);
    if (!bm)
        return ag_last_status();
    ag_scope_begin();
    ag_score_mod sm = {alibi, NULL, &oc->slopes, 1};
    ag_flex_opts fo = {.q_block_size = BS, .kv_block_size = BS};
    ag_tensor *out = NULL, *lse = NULL, *g[4] = {0};
    int rc = ag_flex_attention(oc->qkv[0], oc->qkv[1], oc->qkv[2], &sm, bm, &fo, &out, &lse);
    ag_block_mask_free(bm);
    if (!rc) {
        ag_tensor *wrt[4] = {oc->qkv[0], oc->qkv[1], oc->qkv[2], oc->slopes};
        ag_tensor *loss = ag_add(ag_sum_all(out), ag_sum_all(lse));
        rc = loss ? ag_grad(&loss, NULL, 1, wrt, 4, g, false, false) : ag_last_status();
    }
    tu_alloc_cleanup_begin();
    ag_scope_end();
    tu_alloc_cleanup_end();
    return rc;
}

static void test_out_of_memory(void **state) {
    (void)state;
    const int64_t qs[4] = {1, 2, T, E};
    oom_case oc = {{rnd(AG_F64, 4, qs, true), rnd(AG_F64, 4, qs, true), rnd(AG_F64, 4, qs, true)},
                   tu_leaf(AG_F64, 1, (int64_t[]){2}, (double[]){0.5, -0.25}),
                   ag_from_data(AG_I64, 1, (int64_t[]){T}, doc_ids)};
    const int64_t c0 = ag__flex_eager_counts[0];
    tu_sweep_opts o = {.what = "eager traced flex_attention", .every_up_to = 400, .stride = 7};
    assert_true(tu_alloc_failure_sweep(oom_step, &oc, &o) > 0);
    assert_true(ag__flex_eager_counts[0] > c0);
    for (int i = 0; i < 3; i++)
        ag_tensor_free(oc.qkv[i]);
    ag_tensor_free(oc.slopes);
    ag_tensor_free(oc.doc);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_traced_vs_per_tile),     cmocka_unit_test(test_forward_bits),
        cmocka_unit_test(test_untraceable_falls_back), cmocka_unit_test(test_threads),
        cmocka_unit_test(test_concurrent_calls),       cmocka_unit_test(test_gradcheck_traced),
        cmocka_unit_test(test_out_of_memory),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
