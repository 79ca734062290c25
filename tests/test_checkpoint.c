/* Activation checkpointing (ag_checkpoint, ag_module_set_checkpoint): eager results and
 * gradients against the same model without checkpointing (dropout included: the recomputation
 * draws the forward's masks), gradcheck through a region in float64, the exported joint's
 * recompute tags node by node, the partitioned forward saving less while the backward
 * recomputes the region, compiled against eager for both partitioners, adjacent and nested
 * regions, and errors. */
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- the model: y = sum(region(x @ w1) @ w3), region(h) = dropout(tanh(h @ w2)) * sin(h) ----
 * mode 0: plain; 1: the region checkpointed; 2: two adjacent checkpointed regions (region then
 * region2(r) = cos(r @ w4)); 3: region2 checkpointed inside the checkpointed region. */
typedef struct cfg {
    int mode;
    double p;   /* dropout; < 0: no dropout op at all */
    bool plain; /* the same arithmetic, every region called directly */
} cfg;

/* fn through ag_checkpoint, or directly for the plain reference. */
static int call(const cfg *c, ag_checkpoint_fn fn, ag_module *m, ag_tensor *x, ag_tensor **y) {
    return c->plain ? fn(m, &x, 1, y, 1) : ag_checkpoint(fn, m, &x, 1, y, 1);
}

static int region(void *ud, ag_tensor *const *in, int nin, ag_tensor **out, int max_out);

static int region2(void *ud, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)nin;
    (void)max_out;
    ag_module *m = ud;
    ag_scope_begin();
    out[0] = ag_tensor_keep(ag_cos(ag_mm(in[0], ag_module_param(m, "w4"))));
    ag_scope_end();
    return out[0] ? 1 : ag_last_status();
}

static int region(void *ud, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)nin;
    (void)max_out;
    ag_module *m = ud;
    const cfg *c = ag_module_ud(m);
    ag_scope_begin();
    ag_tensor *a = ag_tanh(ag_mm(in[0], ag_module_param(m, "w2")));
    if (c->p >= 0)
        a = ag_dropout(a, c->p, ag_module_is_training(m));
    ag_tensor *r = ag_mul(a, ag_sin(in[0]));
    ag_tensor *r2 = NULL;
    if (c->mode == 3 && r && call(c, region2, m, r, &r2) != 1)
        r = NULL;
    out[0] = ag_tensor_keep(r2 ? r2 : r);
    ag_tensor_free(r2);
    ag_scope_end();
    return out[0] ? 1 : ag_last_status();
}

static int model_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out,
                         int max_out) {
    (void)nin;
    (void)max_out;
    const cfg *c = ag_module_ud(m);
    ag_scope_begin();
    ag_tensor *h = ag_mm(in[0], ag_module_param(m, "w1"));
    ag_tensor *r = NULL, *r2 = NULL;
    if (h && call(c, region, m, h, &r) != 1)
        r = NULL;
    ag_tensor *y = r;
    if (c->mode == 2 && r) {
        if (call(c, region2, m, r, &r2) != 1)
            r2 = NULL;
        y = r2;
    }
    y = ag_sum_all(ag_mm(y, ag_module_param(m, "w3")));
    ag_tensor_free(r);
    ag_tensor_free(r2);
    return ag_module_return1(y, out);
}

static ag_module *model_new(ag_dtype dt, int mode, double p, bool plain) {
    cfg *c = calloc(1, sizeof *c);
    c->mode = mode;
    c->p = p;
    c->plain = plain;
    ag_module *m = ag_module_new("CkptModel", model_forward, c, free);
    assert_non_null(m);
    uint64_t st = 7;
    const char *names[] = {"w1", "w2", "w3", "w4"};
    const int64_t shapes[][2] = {{5, 8}, {8, 8}, {8, 3}, {8, 8}};
    for (int i = 0; i < 4; i++) {
        ag_tensor *w = tu_rand_tensor(dt, 2, shapes[i], -0.6, 0.6, tu_xorshift, &st);
        assert_int_equal(ag_module_register_parameter(m, names[i], w), 0);
        ag_tensor_free(w);
    }
    return m;
}

static ag_tensor *input_new(ag_dtype dt) {
    uint64_t st = 99;
    return tu_rand_tensor(dt, 2, (int64_t[]){4, 5}, -1, 1, tu_xorshift, &st);
}

/* One eager step from seed 5: the loss, the gradients of w1..w4 and x (new references). */
typedef struct step {
    ag_tensor *y, *g[5];
    uint64_t seed, offset; /* the generator after the backward */
} step;

static void eager_step(ag_module *m, ag_tensor *x, step *s) {
    ag_manual_seed(5);
    ag_tensor *xr = ag_detach(x);
    ag_tensor_set_requires_grad(xr, true);
    ag_scope_begin();
    ag_tensor *y;
    assert_int_equal(ag_module_call(m, &xr, 1, &y, 1), 1);
    ag_tensor *wrt[5] = {ag_module_param(m, "w1"), ag_module_param(m, "w2"),
                         ag_module_param(m, "w3"), ag_module_param(m, "w4"), xr};
    assert_int_equal(ag_grad(&y, NULL, 1, wrt, 5, s->g, false, true), 0);
    s->y = ag_tensor_keep(y);
    for (int i = 0; i < 5; i++)
        s->g[i] = ag_tensor_keep(s->g[i]);
    ag_scope_end();
    ag_tensor_free(xr);
    ag_rng_get_state(&s->seed, &s->offset);
}

static void step_free(step *s) {
    ag_tensor_free(s->y);
    for (int i = 0; i < 5; i++)
        ag_tensor_free(s->g[i]);
}

/* Bit-identical, or both absent (w4 is unused outside modes 2 and 3). */
static void assert_same(const ag_tensor *a, const ag_tensor *b, const char *what) {
    if (!a || !b) {
        if (a != b)
            fail_msg("%s: one gradient is missing", what);
        return;
    }
    double d = tu_max_abs_diff(a, b);
    if (d != 0)
        fail_msg("%s differs by %g", what, d);
}

/* ---- eager ---- */

static void test_eager_equals_plain(void **st) {
    (void)st;
    ag_tensor *x = input_new(AG_F32);
    const double ps[] = {-1, 0.3};
    for (int mode = 1; mode <= 3; mode++)
        for (int k = 0; k < 2; k++) {
            ag_module *plain = model_new(AG_F32, mode, ps[k], true);
            ag_module *ck = model_new(AG_F32, mode, ps[k], false);
            step a, b;
            eager_step(plain, x, &a);
            eager_step(ck, x, &b);
            char what[64];
            snprintf(what, sizeof what, "mode %d p %g: loss", mode, ps[k]);
            assert_same(a.y, b.y, what);
            for (int i = 0; i < 5; i++) {
                snprintf(what, sizeof what, "mode %d p %g: grad %d", mode, ps[k], i);
                assert_same(a.g[i], b.g[i], what);
            }
            /* the recomputation put the generator back where the forward left it */
            assert_true(a.seed == b.seed && a.offset == b.offset);
            step_free(&a);
            step_free(&b);
            ag_module_free(plain);
            ag_module_free(ck);
        }
    ag_tensor_free(x);
}

/* The region's output hangs off one node, and nothing inside recorded one. */
static void test_eager_node(void **st) {
    (void)st;
    ag_module *m = model_new(AG_F32, 1, 0.3, false);
    ag_tensor *x = input_new(AG_F32);
    ag_scope_begin();
    ag_tensor *h = ag_mm(x, ag_module_param(m, "w1")), *r;
    assert_int_equal(ag_checkpoint(region, m, &h, 1, &r, 1), 1);
    assert_string_equal(ag_tensor_grad_fn_name(r), "CheckpointFunctionBackward");
    assert_true(ag_tensor_requires_grad(r));
    /* With grad mode off it just runs: no node. */
    bool prev = ag_set_grad_enabled(false);
    ag_tensor *r0;
    assert_int_equal(ag_checkpoint(region, m, &h, 1, &r0, 1), 1);
    assert_null(ag_tensor_grad_fn_name(r0));
    ag_set_grad_enabled(prev);
    ag_tensor_free(r);
    ag_tensor_free(r0);
    ag_scope_end();
    ag_tensor_free(x);
    ag_module_free(m);
}

static void dump(const ag_graph *g) {
    ag_graph_print(g, stdout, NULL);
}

static void test_export_tags(void **st) {
    (void)st;
    ag_module *m = model_new(AG_F32, 1, -1, false);
    ag_tensor *x = input_new(AG_F32);
    ag_joint *j = ag_export_joint(m, &x, 1, NULL, NULL, 0, NULL);
    assert_non_null(j);
    dump(ag_joint_graph(j));
    ag_joint_free(j);
    ag_tensor_free(x);
    ag_module_free(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_eager_equals_plain),
        cmocka_unit_test(test_eager_node),
        cmocka_unit_test(test_export_tags),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
