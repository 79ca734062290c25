/* flex_attention compiled with a score_mod buffer indexed by position (its joint graph's
 * gradient a scatter-add whose index varies over the tile) and edge tiles: the planned
 * executor's tile plans (src/runtime/plan_flex.c) and the interpreter's joint backward against
 * eager; warm runs of the planned halves allocate nothing; allocation failures while planning
 * and running them fail cleanly. test_flex_attention.c covers the rest of flex_attention. */
#include "testutil.h"
#include "runtime/plan_internal.h"
#include "flex_alloc_count.h"

#include <string.h>

static uint64_t rng = 0x2545f4914f6cdd1dull;

static ag_tensor *rnd(ag_dtype dt, int64_t a, int64_t b, int64_t c, int64_t d, bool grad) {
    ag_tensor *t = tu_rand_tensor(dt, 4, (int64_t[]){a, b, c, d}, -1, 1, tu_xorshift, &rng);
    if (grad)
        ag_tensor_set_requires_grad(t, true);
    return t;
}

/* score_mod = score + bias[kv_idx] + bias[q_idx] (bias a learned [T] parameter: its gradient in
 * the joint graph is a scatter-add whose index varies over the tile, run expanded to the tile)
 * under a causal block mask of 8 x 8 blocks over T = 20 (full tiles and 8 x 4, 4 x 8, 4 x 4 edge
 * tiles). Compiled (planned and interpreted), over two calls, the output and the gradients of
 * q, k, v and bias equal eager flex_attention's and ag_grad's (1e-10, float64: a bias gradient
 * summed over the wrong positions or a wrong edge tile differs by order 0.1); warm runs of the
 * planned halves allocate nothing. */
#define PB_T 20

static ag_tensor *pos_bias(void *ud, ag_tensor *score, ag_tensor *b, ag_tensor *h, ag_tensor *qi,
                           ag_tensor *ki, ag_tensor *const *bufs, int nbuf) {
    (void)ud, (void)b, (void)h;
    assert_int_equal(nbuf, 1);
    return ag_add(ag_add(score, ag_index(bufs[0], &ki, 1)), ag_index(bufs[0], &qi, 1));
}

static ag_tensor *causal_only(void *ud, ag_tensor *b, ag_tensor *h, ag_tensor *qi, ag_tensor *ki,
                              ag_tensor *const *bufs, int nbuf) {
    (void)ud, (void)b, (void)h, (void)bufs, (void)nbuf;
    return ag_ge(qi, ki);
}

static int pos_bias_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out,
                            int max_out) {
    (void)nin, (void)max_out;
    ag_tensor *bias = ag_module_param(m, "bias");
    ag_score_mod sm = {pos_bias, NULL, &bias, 1};
    ag_scope_begin();
    ag_tensor *o = NULL;
    int rc = ag_flex_attention(in[0], in[1], in[2], &sm, ag_module_ud(m), NULL, &o, NULL);
    if (rc) {
        ag_scope_end();
        return rc;
    }
    return ag_module_return1(o, out);
}

static void test_compiled_position_bias(void **state) {
    (void)state;
    ag_mask_mod mm = {causal_only, NULL, NULL, 0};
    ag_block_mask *bm = ag_create_block_mask(&mm, 1, 1, PB_T, PB_T, 8, 8);
    assert_non_null(bm);
    ag_module *m = ag_module_new("FlexPosBias", pos_bias_forward, bm, NULL);
    assert_int_equal(
        ag_module_add_tensor(m, "bias", true, AG_F64, 1, (int64_t[]){PB_T}, AG_INIT_UNIFORM, -1, 1),
        0);
    ag_tensor *bias = ag_module_param(m, "bias"), *x[3];
    for (int i = 0; i < 3; i++)
        x[i] = rnd(AG_F64, 1, 2, PB_T, 4, true);
    ag_joint *j = ag_export_joint(m, x, 3, NULL, NULL, 0, NULL);
    if (!j)
        fail_msg("export: %s", ag_last_error());
    for (int i = 0; i < 3; i++)
        ag_tensor_free(x[i]);
    for (int interpret = 0; interpret < 2; interpret++) {
        ag_compile_opts co = {.interpret = interpret};
        ag_compiled *c = ag_compile_joint(j, &co);
        if (!c)
            fail_msg("compile: %s", ag_last_error());
        for (int call = 0; call < 2; call++) {
            for (int i = 0; i < 3; i++)
                x[i] = rnd(AG_F64, 1, 2, PB_T, 4, true);
            ag_tensor *tangent = rnd(AG_F64, 1, 2, PB_T, 4, false);
            ag_tensor *wrt[4] = {x[0], x[1], x[2], bias}, *ge[4], *gc[4], *ye = NULL, *yc = NULL;
            assert_int_equal(ag_module_call(m, x, 3, &ye, 1), 1);
            assert_int_equal(ag_grad(&ye, &tangent, 1, wrt, 4, ge, false, false), 0);
            if (ag_compiled_call_module(c, m, x, 3, &yc, 1) != 1 ||
                ag_grad(&yc, &tangent, 1, wrt, 4, gc, false, false))
                fail_msg("%s call %d: %s", interpret ? "interpreted" : "planned", call,
                         ag_last_error());
            double d = tu_max_abs_diff(ye, yc);
            if (!(d < 1e-10))
                fail_msg("call %d: output differs by %g", call, d);
            for (int i = 0; i < 4; i++)
                if (!((d = tu_max_abs_diff(ge[i], gc[i])) < 1e-10))
                    fail_msg("%s call %d: gradient %d differs by %g",
                             interpret ? "interpreted" : "planned", call, i, d);
            for (int i = 0; i < 4; i++) {
                ag_tensor_free(ge[i]);
                ag_tensor_free(gc[i]);
            }
            ag_tensor_free(ye);
            ag_tensor_free(yc);
            ag_tensor_free(tangent);
            for (int i = 0; i < 3; i++)
                ag_tensor_free(x[i]);
            bool prev = ag_set_grad_enabled(false);
            ag_scope_begin();
            assert_non_null(ag_mul_scalar_(bias, -1.25));
            ag_scope_end();
            ag_set_grad_enabled(prev);
        }
        if (!interpret) {
            warm_halves w;
            warm_halves_run(&w, c, &rng);
            assert_int_equal(w.af.flex + w.af.other, 0);
            assert_int_equal(w.ab.flex + w.ab.other, 0);
            warm_halves_free(&w);
        }
        ag_compiled_free(c);
    }
    ag_joint_free(j);
    ag_module_free(m);
    ag_block_mask_free(bm);
}

/* Allocation failures while planning and running the compiled halves (the tile plans) and
 * while interpreting the backward (the joint graph's tile copies): each fails cleanly, nothing
 * leaks (tu_alloc_failure_sweep: every allocation point, then memory exhausted from it on). */
typedef struct oom_case {
    const ag_graph *fw, *bw;
    ag_tensor *in[16], *bi[16]; /* bi: from nsaved on, the backward's tangents */
    int nin, nsaved, nbi;
    bool interpret; /* the backward by ag_graph_run */
} oom_case;

static int oom_scenario(void *ud) {
    oom_case *oc = ud;
    ag_plan *pf = ag_plan_new(oc->fw, NULL), *pb = oc->interpret ? NULL : ag_plan_new(oc->bw, NULL);
    ag_tensor *fo[16] = {0}, *bo[16] = {0}, *bi[16];
    memcpy(bi, oc->bi, sizeof bi);
    int rc = pf && (oc->interpret || pb) ? 0 : ag_last_status(), nfo = 0, nbo = 0;
    if (!rc && (nfo = ag_plan_run(pf, oc->in, oc->nin, fo, 16)) < 0)
        rc = nfo;
    for (int i = 0; i < oc->nsaved && !rc; i++)
        bi[i] = fo[i + 1];
    if (!rc && (nbo = oc->interpret ? ag_graph_run(oc->bw, bi, oc->nbi, bo, 16)
                                    : ag_plan_run(pb, bi, oc->nbi, bo, 16)) < 0)
        rc = nbo;
    tu_alloc_cleanup_begin();
    for (int i = 0; i < nbo; i++)
        ag_tensor_free(bo[i]);
    for (int i = 0; i < nfo; i++)
        ag_tensor_free(fo[i]);
    ag_plan_free(pf);
    ag_plan_free(pb);
    tu_alloc_cleanup_end();
    return rc;
}

static void test_out_of_memory(void **state) {
    (void)state;
    ag_mask_mod mm = {causal_only, NULL, NULL, 0};
    ag_block_mask *bm = ag_create_block_mask(&mm, 1, 1, 12, 12, 8, 8);
    ag_module *m = ag_module_new("FlexPosBias", pos_bias_forward, bm, NULL);
    assert_int_equal(
        ag_module_add_tensor(m, "bias", true, AG_F64, 1, (int64_t[]){12}, AG_INIT_UNIFORM, -1, 1),
        0);
    ag_tensor *x[3];
    for (int i = 0; i < 3; i++)
        x[i] = rnd(AG_F64, 1, 1, 12, 2, true);
    ag_joint *j = ag_export_joint(m, x, 3, NULL, NULL, 0, NULL);
    ag_compiled *c = j ? ag_compile_joint(j, NULL) : NULL;
    if (!c)
        fail_msg("export/compile: %s", ag_last_error());
    oom_case oc = {.fw = ag_compiled_forward_graph(c), .bw = ag_compiled_backward_graph(c)};
    fill_inputs(oc.fw, 0, oc.in, &oc.nin, &rng);
    ag_plan *pf = ag_plan_new(oc.fw, NULL);
    ag_tensor *fo[16];
    const int nfo = pf ? ag_plan_run(pf, oc.in, oc.nin, fo, 16) : -1;
    assert_true(nfo > 1);
    for (int i = 0; i < nfo; i++)
        ag_tensor_free(fo[i]);
    ag_plan_free(pf);
    oc.nsaved = nfo - 1;
    fill_inputs(oc.bw, oc.nsaved, oc.bi, &oc.nbi, &rng);
    for (int k = 0; k < 2; k++) {
        oc.interpret = k;
        tu_sweep_opts o = {.what = k ? "flex_attention planned, backward interpreted"
                                     : "flex_attention planned (tile plans)",
                           .one_thread = true};
        assert_true(tu_alloc_failure_sweep(oom_scenario, &oc, &o) > 10);
        o.persistent = true;
        assert_true(tu_alloc_failure_sweep(oom_scenario, &oc, &o) > 10);
    }
    for (int i = 0; i < oc.nin; i++)
        ag_tensor_free(oc.in[i]);
    for (int i = oc.nsaved; i < oc.nbi; i++)
        ag_tensor_free(oc.bi[i]);
    for (int i = 0; i < 3; i++)
        ag_tensor_free(x[i]);
    ag_compiled_free(c);
    ag_joint_free(j);
    ag_module_free(m);
    ag_block_mask_free(bm);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_compiled_position_bias),
        cmocka_unit_test(test_out_of_memory),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
