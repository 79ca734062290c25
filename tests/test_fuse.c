/* The executor's fusion of elementwise chains (src/runtime/fuse.c): every plan is run with
 * fusion and without (ag_plan_opts.no_fusion), and the results must be bit-identical.
 *   1. Hand-written graphs, one per group kind, with the fused kernels' cases (both layouts
 *      of addmm's right operand, an in-place gelu, ignored targets in cross-entropy, the
 *      dense one-hot gradient also returned): each group is found (names and count) and matches the
 * unfused plan, also in checking mode.
 *   2. A buffer that a later member's output is placed over (moved there with the test hook
 *      ag__plan_debug_move, as the memory plan may do) makes the group decline, run its
 *      members one by one and still give the same result.
 *   3. Every zoo model, compiled with fusion on and off, trains two steps (forward, backward,
 *      SGD) to bit-identical outputs, gradients and parameters; GPT-2's plans contain the
 *      groups its layers make (the zoo's losses are sums: cross-entropy is covered by 1). */
#include "testutil.h"
#include "runtime/plan_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static ag_tensor *rnd(ag_dtype dt, int ndim, const int64_t *sizes, uint64_t seed) {
    uint64_t st = seed * 0x9e3779b97f4a7c15ull + 1;
    return tu_rand_tensor(dt, ndim, sizes, -1, 1, tu_xorshift, &st);
}

static ag_graph *parse(const char *text) {
    ag_graph *g = ag_graph_parse(text, strlen(text));
    if (!g)
        fail_msg("parse: %s", ag_last_error());
    return g;
}

static ag_plan *plan(const ag_graph *g, bool fusion, bool checking) {
    ag_plan_opts o = {.checking = checking, .no_fusion = !fusion};
    ag_plan *p = ag_plan_new(g, &o);
    if (!p)
        fail_msg("plan_new: %s", ag_last_error());
    return p;
}

/* Runs g fused (checking mode as asked) and unfused on in; asserts the outputs are
 * bit-identical, twice (the second run reuses the pools). Returns the fused plan's stats. */
static ag__plan_stats compare(const char *what, const ag_graph *g, ag_plan *fused,
                              ag_tensor *const *in, int nin) {
    ag_plan *ref = plan(g, false, false);
    for (int run = 0; run < 2; run++) {
        ag_tensor *a[16], *b[16];
        int na = ag_plan_run(ref, in, nin, a, 16), nb = ag_plan_run(fused, in, nin, b, 16);
        if (na < 0 || nb < 0)
            fail_msg("%s: run: %s", what, ag_last_error());
        assert_int_equal(na, nb);
        for (int k = 0; k < na; k++) {
            if (!tu_same_bits(a[k], b[k]))
                fail_msg("%s: output %d differs (max %g)", what, k, tu_max_abs_diff(a[k], b[k]));
            ag_tensor_free(a[k]);
            ag_tensor_free(b[k]);
        }
    }
    ag__plan_stats s;
    ag__plan_get_stats(fused, &s);
    ag__plan_stats r;
    ag__plan_get_stats(ref, &r);
    assert_int_equal(r.fused_groups, 0);
    ag_plan_free(ref);
    return s;
}

/* Asserts p's fused groups are exactly `want` (names, in step order). */
static void expect_groups(const char *what, const ag_plan *p, const char *const *want, int n) {
    const char *names[64], *first[64];
    int k = ag__plan_fused_groups(p, names, first, 64);
    if (k != n)
        fail_msg("%s: %d fused groups, expected %d", what, k, n);
    for (int i = 0; i < n; i++)
        if (strcmp(names[i], want[i]))
            fail_msg("%s: group %d is %s (at %%%s), expected %s", what, i, names[i], first[i],
                     want[i]);
}

/* ---- 1. one graph per group kind ---- */

/* x (300, 64) @ op(B) + bias, then gelu: op(B) = t(w) (w (1000, 64)) or b2 (64, 1000) read as
 * it is. */
static const char *addmm_gelu_text =
    "graph():\n"
    "    %x : f32[300, 64]  # None\n"
    "    %w : f32[1000, 64]  # None\n"
    "    %b2 : f32[64, 1000]  # None\n"
    "    %bias : f32[1000]  # None\n"
    "    %t = t(%w)  # f32[64, 1000]{1, 64}\n"
    "    %addmm = addmm(%bias, %x, %t)  # f32[300, 1000]\n"
    "    %view = view(%addmm, [3, 100, 1000])  # f32[3, 100, 1000]\n"
    "    %gelu = gelu(%view, approximate='tanh')  # f32[3, 100, 1000]\n"
    "    %addmm_1 = addmm(%bias, %x, %b2)  # f32[300, 1000]\n"
    "    %gelu_1 = gelu(%addmm_1)  # f32[300, 1000]\n"
    "    %neg = neg(%gelu_1)  # f32[300, 1000]\n"
    "    return (%addmm, %gelu, %neg)  # [None, None, None]\n";

static void test_addmm_gelu(void **st) {
    (void)st;
    ag_graph *g = parse(addmm_gelu_text);
    ag_tensor *in[4] = {
        rnd(AG_F32, 2, (int64_t[]){300, 64}, 1), rnd(AG_F32, 2, (int64_t[]){1000, 64}, 2),
        rnd(AG_F32, 2, (int64_t[]){64, 1000}, 3), rnd(AG_F32, 1, (int64_t[]){1000}, 4)};
    const char *want[] = {"addmm+gelu", "addmm+gelu"};
    for (int checking = 0; checking < 2; checking++) {
        ag_plan *p = plan(g, true, checking);
        expect_groups("addmm+gelu", p, want, 2);
        ag__plan_stats s = compare("addmm+gelu", g, p, in, 4);
        assert_int_equal(s.fused_groups, 2);
        assert_int_equal(s.fused_declined, 0);
        /* gelu_1 writes into addmm_1's buffer (in place): the fused kernel sees out == y. */
        if (!checking)
            assert_true(s.inplace >= 1);
        ag_plan_free(p);
    }
    for (int i = 0; i < 4; i++)
        ag_tensor_free(in[i]);
    ag_graph_free(g);
}

/* The residual add and the next layer norm, with the p=0 dropout clone before the add (the
 * clone's copy is skipped), then without it. */
static const char *add_ln_text = "graph():\n"
                                 "    %x : f32[2, 150, 96]  # None\n"
                                 "    %w : f32[96, 96]  # None\n"
                                 "    %bias : f32[96]  # None\n"
                                 "    %lw : f32[96]  # None\n"
                                 "    %lb : f32[96]  # None\n"
                                 "    %view = view(%x, [300, 96])  # f32[300, 96]\n"
                                 "    %t = t(%w)  # f32[96, 96]{1, 96}\n"
                                 "    %addmm = addmm(%bias, %view, %t)  # f32[300, 96]\n"
                                 "    %view_1 = view(%addmm, [2, 150, 96])  # f32[2, 150, 96]\n"
                                 "    %clone = clone(%view_1)  # f32[2, 150, 96]\n"
                                 "    %add = add.Tensor(%x, %clone)  # f32[2, 150, 96]\n"
                                 "    %ln = native_layer_norm(%add, [96], %lw, %lb, 1e-05)  # "
                                 "(f32[2, 150, 96], f32[2, 150, 1], f32[2, 150, 1])\n"
                                 "    %getitem = getitem(%ln, 0)  # f32[2, 150, 96]\n"
                                 "    %getitem_1 = getitem(%ln, 1)  # f32[2, 150, 1]\n"
                                 "    %getitem_2 = getitem(%ln, 2)  # f32[2, 150, 1]\n"
                                 "    %exp = exp(%getitem)  # f32[2, 150, 96]\n"
                                 "    %add_1 = add.Tensor(%exp, %add)  # f32[2, 150, 96]\n"
                                 "    %ln_1 = native_layer_norm(%add_1, [96], None, %lb, 1e-05)  # "
                                 "(f32[2, 150, 96], f32[2, 150, 1], f32[2, 150, 1])\n"
                                 "    %getitem_3 = getitem(%ln_1, 0)  # f32[2, 150, 96]\n"
                                 "    return (%add, %getitem, %getitem_1, %getitem_2, %add_1, "
                                 "%getitem_3)  # [None, None, None, None, None, None]\n";

static void test_add_layer_norm(void **st) {
    (void)st;
    ag_graph *g = parse(add_ln_text);
    ag_tensor *in[5] = {rnd(AG_F32, 3, (int64_t[]){2, 150, 96}, 5),
                        rnd(AG_F32, 2, (int64_t[]){96, 96}, 6), rnd(AG_F32, 1, (int64_t[]){96}, 7),
                        rnd(AG_F32, 1, (int64_t[]){96}, 8), rnd(AG_F32, 1, (int64_t[]){96}, 9)};
    const char *want[] = {"clone+add+layer_norm", "add+layer_norm"};
    for (int checking = 0; checking < 2; checking++) {
        ag_plan *p = plan(g, true, checking);
        expect_groups("add+layer_norm", p, want, 2);
        ag__plan_stats s = compare("add+layer_norm", g, p, in, 5);
        assert_int_equal(s.fused_declined, 0);
        ag_plan_free(p);
    }
    for (int i = 0; i < 5; i++)
        ag_tensor_free(in[i]);
    ag_graph_free(g);
}

/* A layer norm's input gradient added to the residual gradient (acc, made in the graph so it
 * lives in the arena), weight and bias gradients returned. */
static const char *lnb_add_text =
    "graph():\n"
    "    %g : f32[300, 96]  # None\n"
    "    %x : f32[300, 96]  # None\n"
    "    %mean : f32[300, 1]  # None\n"
    "    %rstd : f32[300, 1]  # None\n"
    "    %lw : f32[96]  # None\n"
    "    %lb : f32[96]  # None\n"
    "    %a : f32[300, 96]  # None\n"
    "    %acc = neg(%a)  # f32[300, 96]\n"
    "    %lnb = native_layer_norm_backward(%g, %x, [96], %mean, %rstd, %lw, %lb, [1, 1, 1])  # "
    "(f32[300, 96], f32[96], f32[96])\n"
    "    %getitem = getitem(%lnb, 0)  # f32[300, 96]\n"
    "    %getitem_1 = getitem(%lnb, 1)  # f32[96]\n"
    "    %getitem_2 = getitem(%lnb, 2)  # f32[96]\n"
    "    %add = add.Tensor(%acc, %getitem)  # f32[300, 96]\n"
    "    return (%add, %getitem_1, %getitem_2)  # [None, None, None]\n";

static void test_layer_norm_backward_add(void **st) {
    (void)st;
    ag_graph *g = parse(lnb_add_text);
    ag_tensor *rstd = rnd(AG_F32, 2, (int64_t[]){300, 1}, 13);
    float *r = ag_tensor_data(rstd);
    for (int i = 0; i < 300; i++)
        r[i] = 1.5f + r[i]; /* positive */
    ag_tensor *in[7] = {
        rnd(AG_F32, 2, (int64_t[]){300, 96}, 10), rnd(AG_F32, 2, (int64_t[]){300, 96}, 11),
        rnd(AG_F32, 2, (int64_t[]){300, 1}, 12),  rstd,
        rnd(AG_F32, 1, (int64_t[]){96}, 14),      rnd(AG_F32, 1, (int64_t[]){96}, 15),
        rnd(AG_F32, 2, (int64_t[]){300, 96}, 16)};
    const char *want[] = {"layer_norm_backward+add"};
    for (int checking = 0; checking < 2; checking++) {
        ag_plan *p = plan(g, true, checking);
        expect_groups("layer_norm_backward+add", p, want, 1);
        ag__plan_stats s = compare("layer_norm_backward+add", g, p, in, 7);
        assert_int_equal(s.fused_declined, 0);
        ag_plan_free(p);
    }
    for (int i = 0; i < 7; i++)
        ag_tensor_free(in[i]);
    ag_graph_free(g);
}

/* Cross-entropy's backward, mean reduction with ignored rows; the second graph also returns
 * nll_loss_backward's dense gradient (written by the fused kernel then). */
static const char *nll_text =
    "graph():\n"
    "    %logits : f32[300, 50]  # None\n"
    "    %target : i64[300]  # None\n"
    "    %g : f32[]  # None\n"
    "    %tw : f32[]  # None\n"
    "    %y = _log_softmax(%logits, 1, False)  # f32[300, 50]\n"
    "    %d = nll_loss_backward(%g, %y, %target, None, 1, -100, %tw)  # f32[300, 50]\n"
    "    %out = _log_softmax_backward_data(%d, %y, 1, torch.float32)  # f32[300, 50]\n"
    "    return (%out";

static void test_nll_log_softmax_backward(void **st) {
    (void)st;
    int64_t tv[300];
    for (int i = 0; i < 300; i++)
        tv[i] = i % 7 == 3 ? -100 : (i * 13) % 50;
    ag_tensor *in[4] = {rnd(AG_F32, 2, (int64_t[]){300, 50}, 17),
                        ag_from_data(AG_I64, 1, (int64_t[]){300}, tv),
                        tu_tensor(AG_F32, 0, NULL, (double[]){0.75}),
                        tu_tensor(AG_F32, 0, NULL, (double[]){257.0})};
    for (int dense = 0; dense < 2; dense++) {
        char text[2048];
        snprintf(text, sizeof text, "%s%s", nll_text,
                 dense ? ", %d)  # [None, None]\n" : ")  # [None]\n");
        ag_graph *g = parse(text);
        const char *want[] = {"nll_loss_backward+log_softmax_backward"};
        for (int checking = 0; checking < 2; checking++) {
            ag_plan *p = plan(g, true, checking);
            expect_groups("nll+log_softmax", p, want, 1);
            ag__plan_stats s = compare("nll+log_softmax", g, p, in, 4);
            assert_int_equal(s.fused_declined, 0);
            ag_plan_free(p);
        }
        ag_graph_free(g);
    }
    for (int i = 0; i < 4; i++)
        ag_tensor_free(in[i]);
}

/* A training batch norm and its relu over (4, 3, 5, 7) (35 values a plane: the kernels' vector
 * steps and a tail), once with the batch norm output read only by the relu (not written) and
 * once also returned; then relu's backward into the batch norm backward, self with exact zeros
 * (relu of values of both signs). Both dtypes (TY is replaced). */
static const char *bn_relu_text =
    "graph():\n"
    "    %x : TY[4, 3, 5, 7]  # None\n"
    "    %w : TY[3]  # None\n"
    "    %b : TY[3]  # None\n"
    "    %rm : TY[3]  # None\n"
    "    %rv0 : TY[3]  # None\n"
    "    %rv = exp(%rv0)  # TY[3]\n"
    "    %bn = _native_batch_norm_legit_functional(%x, %w, %b, %rm, %rv, True, 0.1, 1e-05)  # "
    "(TY[4, 3, 5, 7], TY[3], TY[3], TY[3], TY[3])\n"
    "    %getitem = getitem(%bn, 0)  # TY[4, 3, 5, 7]\n"
    "    %getitem_1 = getitem(%bn, 1)  # TY[3]\n"
    "    %getitem_2 = getitem(%bn, 2)  # TY[3]\n"
    "    %getitem_3 = getitem(%bn, 3)  # TY[3]\n"
    "    %getitem_4 = getitem(%bn, 4)  # TY[3]\n"
    "    %relu = relu(%getitem)  # TY[4, 3, 5, 7]\n"
    "    %bn_1 = _native_batch_norm_legit_functional(%relu, None, None, %rm, %rv, True, 0.1, "
    "1e-05)  # (TY[4, 3, 5, 7], TY[3], TY[3], TY[3], TY[3])\n"
    "    %getitem_5 = getitem(%bn_1, 0)  # TY[4, 3, 5, 7]\n"
    "    %relu_1 = relu(%getitem_5)  # TY[4, 3, 5, 7]\n"
    "    %relu_2 = relu(%w)  # TY[3]\n"
    "    %r = relu(%x)  # TY[4, 3, 5, 7]\n"
    "    %neg = neg(%x)  # TY[4, 3, 5, 7]\n"
    "    %tb = threshold_backward(%neg, %r, 0.0)  # TY[4, 3, 5, 7]\n"
    "    %bnb = native_batch_norm_backward(%tb, %relu, %w, None, None, %getitem_1, %getitem_2, "
    "True, 1e-05, [1, 1, 1])  # (TY[4, 3, 5, 7], TY[3], TY[3])\n"
    "    %getitem_6 = getitem(%bnb, 0)  # TY[4, 3, 5, 7]\n"
    "    %getitem_7 = getitem(%bnb, 1)  # TY[3]\n"
    "    %getitem_8 = getitem(%bnb, 2)  # TY[3]\n"
    "    return (%relu, %getitem_1, %getitem_2, %getitem_3, %getitem_4, %relu_1, %getitem_5, "
    "%relu_2, %getitem_6, %getitem_7, %getitem_8)  # [None, None, None, None, None, None, None, "
    "None, None, None, None]\n";

static void test_batch_norm_relu(void **st) {
    (void)st;
    for (int d = 0; d < 2; d++) {
        const ag_dtype dt = d ? AG_F64 : AG_F32;
        char text[4096];
        const char *src = bn_relu_text;
        size_t k = 0;
        while (*src && k + 4 < sizeof text) {
            if (!strncmp(src, "TY", 2)) {
                memcpy(text + k, d ? "f64" : "f32", 3);
                k += 3;
                src += 2;
            } else {
                text[k++] = *src++;
            }
        }
        text[k] = 0;
        ag_graph *g = parse(text);
        ag_tensor *in[5] = {rnd(dt, 4, (int64_t[]){4, 3, 5, 7}, 30), rnd(dt, 1, (int64_t[]){3}, 31),
                            rnd(dt, 1, (int64_t[]){3}, 32), rnd(dt, 1, (int64_t[]){3}, 33),
                            rnd(dt, 1, (int64_t[]){3}, 34)};
        const char *want[] = {"batch_norm+relu", "batch_norm+relu",
                              "threshold_backward+batch_norm_backward"};
        ag__plan_stats ref;
        ag_plan *rp = plan(g, false, false);
        ag__plan_get_stats(rp, &ref);
        ag_plan_free(rp);
        for (int checking = 0; checking < 2; checking++) {
            ag_plan *p = plan(g, true, checking);
            expect_groups("batch_norm+relu", p, want, 3);
            ag__plan_stats s = compare("batch_norm+relu", g, p, in, 5);
            assert_int_equal(s.fused_groups, 3);
            assert_int_equal(s.fused_declined, 0);
            /* The backward group keeps nothing alive longer than unfused: grad_input may take
             * the place of the relu's gradient or output, as it would unfused. */
            assert_int_equal(s.arena_bytes, ref.arena_bytes);
            ag_plan_free(p);
        }
        for (int i = 0; i < 5; i++)
            ag_tensor_free(in[i]);
        ag_graph_free(g);
    }
}

/* ---- 2. a group declines when a later output is placed over an earlier input ---- */

/* Arena buffers (no in-place reuse): a [a, s], s [s, ln], ln's output [ln, out], each 115200
 * bytes; the mean and rstd are returned (their own storage), and so is out. */
static const char *overlap_text =
    "graph():\n"
    "    %x : f32[300, 96]  # None\n"
    "    %y : f32[300, 96]  # None\n"
    "    %lw : f32[96]  # None\n"
    "    %a = exp(%x)  # f32[300, 96]\n"
    "    %s = add.Tensor(%a, %y)  # f32[300, 96]\n"
    "    %ln = native_layer_norm(%s, [96], %lw, None, 1e-05)  # (f32[300, 96], f32[300, 1], "
    "f32[300, 1])\n"
    "    %getitem = getitem(%ln, 0)  # f32[300, 96]\n"
    "    %getitem_1 = getitem(%ln, 1)  # f32[300, 1]\n"
    "    %getitem_2 = getitem(%ln, 2)  # f32[300, 1]\n"
    "    %out = neg(%getitem)  # f32[300, 96]\n"
    "    return (%out, %getitem_1, %getitem_2)  # [None, None, None]\n";

static void test_declines_on_overlap(void **st) {
    (void)st;
    ag_graph *g = parse(overlap_text);
    ag_tensor *in[3] = {rnd(AG_F32, 2, (int64_t[]){300, 96}, 20),
                        rnd(AG_F32, 2, (int64_t[]){300, 96}, 21),
                        rnd(AG_F32, 1, (int64_t[]){96}, 22)};
    for (int moved = 0; moved < 2; moved++) {
        ag_plan_opts o = {.no_inplace = true};
        ag_plan *p = ag_plan_new(g, &o);
        assert_non_null(p);
        if (moved) {
            /* a and ln's output share memory (a is dead by then, one by one), s elsewhere: the
             * fused kernel would write output rows over rows of a it has yet to read. */
            assert_int_equal(ag__plan_debug_move(p, "a", 0, NULL), 0);
            assert_int_equal(ag__plan_debug_move(p, "s", 115200, NULL), 0);
            assert_int_equal(ag__plan_debug_move(p, "ln", 0, NULL), 0);
        } else {
            assert_int_equal(ag__plan_debug_move(p, "a", 0, NULL), 0);
            assert_int_equal(ag__plan_debug_move(p, "s", 115200, NULL), 0);
            assert_int_equal(ag__plan_debug_move(p, "ln", 115200 * 2, NULL) == 0 ||
                                 ag__plan_debug_move(p, "ln", 0, NULL) == 0,
                             1);
        }
        const char *want[] = {"add+layer_norm"};
        expect_groups("overlap", p, want, 1);
        ag__plan_stats s = compare("overlap", g, p, in, 3);
        if (moved)
            assert_int_equal(s.fused_declined, 2); /* both runs */
        ag_plan_free(p);
    }
    for (int i = 0; i < 3; i++)
        ag_tensor_free(in[i]);
    ag_graph_free(g);
}

/* ---- 3. the zoo, compiled with and without fusion ---- */

typedef struct side {
    ag_module *m;
    ag_tensor *in[8];
    int nin;
    ag_joint *j;
    ag_compiled *c;
    ag_optim *o;
} side;

static void side_open(side *s, const char *name, bool fusion) {
    assert_int_equal(ag_zoo_build(name, NULL, &s->m, s->in, 8, &s->nin), 0);
    s->j = ag_export_joint(s->m, s->in, s->nin, NULL, NULL, 0, NULL);
    assert_non_null(s->j);
    ag_compile_opts co = {.partition = {.partitioner = AG_PARTITION_MINCUT, .memory_budget = 1},
                          .plan = {.no_fusion = !fusion}};
    s->c = ag_compile_joint(s->j, &co);
    assert_non_null(s->c);
    s->o = ag_optim_sgd(s->m, 1e-2, 0.9, 0, false);
}

static void side_close(side *s) {
    ag_optim_free(s->o);
    ag_compiled_free(s->c);
    ag_joint_free(s->j);
    ag_module_free(s->m);
    for (int i = 0; i < s->nin; i++)
        ag_tensor_free(s->in[i]);
}

/* Fused groups in the plans of c's forward and backward graphs, by name. */
static int count_groups(const ag_compiled *c, const char *name) {
    int n = 0;
    for (int bw = 0; bw < 2; bw++) {
        const ag_graph *g = bw ? ag_compiled_backward_graph(c) : ag_compiled_forward_graph(c);
        if (!g)
            continue;
        ag_plan *p = plan(g, true, false);
        const char *names[256], *first[256];
        int k = ag__plan_fused_groups(p, names, first, 256);
        for (int i = 0; i < k && i < 256; i++)
            n += !strcmp(names[i], name);
        ag_plan_free(p);
    }
    return n;
}

static void test_zoo_fused_vs_unfused(void **st) {
    (void)st;
    for (int z = 0; z < ag_zoo_count(); z++) {
        const char *name = ag_zoo_name(z);
        side a = {0}, b = {0};
        side_open(&a, name, true);
        side_open(&b, name, false);
        for (int step = 0; step < 2; step++) {
            ag_scope_begin();
            ag_tensor *oa[16], *ob[16];
            uint64_t seed, off;
            ag_rng_get_state(&seed, &off);
            int na = ag_compiled_call_module(a.c, a.m, a.in, a.nin, oa, 16);
            ag_rng_set_state(seed, off);
            int nb = ag_compiled_call_module(b.c, b.m, b.in, b.nin, ob, 16);
            if (na < 0 || nb < 0)
                fail_msg("%s: call: %s", name, ag_last_error());
            assert_int_equal(na, nb);
            ag_tensor *la = NULL, *lb = NULL;
            for (int k = 0; k < na; k++) {
                if (!tu_same_bits(oa[k], ob[k]))
                    fail_msg("%s: step %d: output %d differs", name, step, k);
                if (!ag_tensor_requires_grad(oa[k]))
                    continue;
                ag_tensor *x = ag_sum_all(ag_mul_scalar(oa[k], 0.5 + k));
                ag_tensor *y = ag_sum_all(ag_mul_scalar(ob[k], 0.5 + k));
                la = la ? ag_add(la, x) : x;
                lb = lb ? ag_add(lb, y) : y;
            }
            if (la) {
                ag_rng_get_state(&seed, &off);
                assert_int_equal(ag_backward(la, NULL, false), 0);
                ag_rng_set_state(seed, off);
                assert_int_equal(ag_backward(lb, NULL, false), 0);
            }
            ag_named_tensors pa, pb;
            assert_int_equal(ag_module_named_parameters(a.m, true, &pa), 0);
            assert_int_equal(ag_module_named_parameters(b.m, true, &pb), 0);
            for (int i = 0; i < pa.n; i++)
                if (!tu_same_bits(ag_tensor_grad(pa.tensors[i]), ag_tensor_grad(pb.tensors[i])))
                    fail_msg("%s: step %d: grad of %s differs", name, step, pa.names[i]);
            assert_int_equal(ag_optim_step(a.o), 0);
            assert_int_equal(ag_optim_step(b.o), 0);
            ag_optim_zero_grad(a.o);
            ag_optim_zero_grad(b.o);
            for (int i = 0; i < pa.n; i++)
                assert_true(tu_same_bits(pa.tensors[i], pb.tensors[i]));
            ag_named_tensors_free(&pa);
            ag_named_tensors_free(&pb);
            ag_scope_end();
        }
        if (!strcmp(name, "cnn") || !strcmp(name, "convbn")) {
            /* Each conv + batch norm + relu block: its forward and its backward. */
            int n1 = count_groups(a.c, "batch_norm+relu"),
                n2 = count_groups(a.c, "threshold_backward+batch_norm_backward");
            print_message("  %s: batch_norm+relu %d, threshold_backward+batch_norm_backward %d\n",
                          name, n1, n2);
            assert_true(n1 >= 1);
            assert_int_equal(n1, n2);
            if (!strcmp(name, "cnn"))
                assert_int_equal(n1, 2);
        }
        if (!strcmp(name, "gpt2")) {
            /* Two layers: two MLPs, two residual adds per layer (before ln_2, and before the
             * next ln_1 or ln_f), and layer norm backward + residual gradient adds. */
            int n1 = count_groups(a.c, "addmm+gelu"),
                n2 = count_groups(a.c, "clone+add+layer_norm");
            int n3 = count_groups(a.c, "layer_norm_backward+add");
            print_message("  gpt2: addmm+gelu %d, clone+add+layer_norm %d, "
                          "layer_norm_backward+add %d\n",
                          n1, n2, n3);
            assert_int_equal(n1, 2);
            assert_int_equal(n2, 4);
            assert_true(n3 >= 3);
        }
        side_close(&a);
        side_close(&b);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_addmm_gelu),
        cmocka_unit_test(test_add_layer_norm),
        cmocka_unit_test(test_layer_norm_backward_add),
        cmocka_unit_test(test_nll_log_softmax_backward),
        cmocka_unit_test(test_batch_norm_relu),
        cmocka_unit_test(test_declines_on_overlap),
        cmocka_unit_test(test_zoo_fused_vs_unfused),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
