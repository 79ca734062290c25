/* ag_compiled_call_module finds the module's parameters and buffers by the names the joint
 * recorded (ParamAOTInput(target=fqn), BufferAOTInput(target=fqn)), not by the module's order.
 *
 * Each model here is built twice from one seed, so the two builds hold equal values in distinct
 * tensors: one registered as the export saw it (eager reference and exported), one with its
 * children or parameters registered in another order, whose shapes agree position by position,
 * so that taking the module's order would run without complaint and compute something else (the
 * tests show that it would, by passing the tensors in that order to ag_compiled_call). The
 * compiled call on the reordered module gives eager's outputs and gradients; BatchNorm's
 * running statistics land in its buffers; tied weights (one tensor under two names) and
 * TwoTensor parameters work; a module that lacks a name, holds it as the other kind, with
 * another shape or dtype, or holds a name the joint does not take, is refused naming it. */
#include "testutil.h"

#include <math.h>
#include <string.h>

#define F32 AG_F32
#define SZ(...) ((int64_t[]){__VA_ARGS__})

/* ---- models ---- */

/* Lin: y = x @ weight^T + bias (bias a parameter or a buffer, or none). */
static int lin_fwd(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    int rc = ag_module_check_io(m, nin, 1, 1, max_out, 1);
    if (rc)
        return rc;
    ag_tensor *b = ag_module_param(m, "bias");
    ag_scope_begin();
    ag_tensor *y =
        ag_linear(in[0], ag_module_param(m, "weight"), b ? b : ag_module_buffer(m, "bias"));
    return ag_module_return1(y, out);
}

/* Registers the tensors it is given (NULL: none), in the order given: bias first when
 * bias_first. */
static ag_module *lin(ag_tensor *w, ag_tensor *b, bool bias_buffer, bool bias_first) {
    ag_module *m = ag_module_new("Lin", lin_fwd, NULL, NULL);
    assert_non_null(m);
    for (int k = 0; k < 2; k++) {
        bool bias = (k == 0) == bias_first;
        ag_tensor *t = bias ? b : w;
        if (!t)
            continue;
        int rc = bias && bias_buffer ? ag_module_register_buffer(m, "bias", t, true)
                                     : ag_module_register_parameter(m, bias ? "bias" : "weight", t);
        assert_int_equal(rc, 0);
    }
    return m;
}

/* A parent of two children that runs them as named here, whatever order they are registered
 * in: y = second(relu(first(x))), or relu(second(first(x))) when relu_last. */
typedef struct chain {
    const char *first, *second;
    bool relu_last;
} chain;

static int chain_fwd(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    const chain *ch = ag_module_ud(m);
    int rc = ag_module_check_io(m, nin, 1, 1, max_out, 1);
    if (rc)
        return rc;
    ag_scope_begin();
    ag_tensor *h = ag_module_forward_child(m, ch->first, in[0]);
    if (h && !ch->relu_last)
        h = ag_relu(h);
    ag_tensor *y = h ? ag_module_forward_child(m, ch->second, h) : NULL;
    if (y && ch->relu_last)
        y = ag_relu(y);
    return ag_module_return1(y, out);
}

static ag_module *chain_new(const chain *ch) {
    ag_module *m = ag_module_new("Chain", chain_fwd, (void *)ch, NULL);
    assert_non_null(m);
    return m;
}

/* Children (name, module) registered in the order given. */
static ag_module *parent(ag_module *m, const char *n0, ag_module *c0, const char *n1,
                         ag_module *c1) {
    assert_int_equal(ag_module_add_child(m, n0, c0), 0);
    assert_int_equal(ag_module_add_child(m, n1, c1), 0);
    return m;
}

static const chain ab = {"a", "b", false};

/* What to change in the second build of the pair model. */
enum {
    REVERSED = 1,       /* children b then a: named_parameters b.weight, b.bias, a.weight, a.bias */
    NO_B_BIAS = 2,      /* b has no bias */
    A_WEIGHT_43 = 4,    /* a.weight is [4, 3] */
    A_BIAS_F64 = 8,     /* a.bias is f64 */
    A_BIAS_BUFFER = 16, /* a.bias is a buffer */
};

/* The pair model b(relu(a(x))), a and b Lin(3, 3); values drawn from seed in one order
 * whatever the flags, so builds from one seed hold equal values. */
static ag_module *pair_model(uint64_t seed, unsigned flags) {
    ag_module *m = chain_new(&ab); /* (first: it often takes a freed model's address) */
    ag_tensor *w1 = tu_rand_tensor(F32, 2, SZ(3, 3), -1, 1, tu_xorshift, &seed);
    ag_tensor *b1 = tu_rand_tensor(F32, 1, SZ(3), -1, 1, tu_xorshift, &seed);
    ag_tensor *w2 = tu_rand_tensor(F32, 2, SZ(3, 3), -1, 1, tu_xorshift, &seed);
    ag_tensor *b2 = tu_rand_tensor(F32, 1, SZ(3), -1, 1, tu_xorshift, &seed);
    if (flags & A_WEIGHT_43) {
        ag_tensor_free(w1);
        w1 = tu_rand_tensor(F32, 2, SZ(4, 3), -1, 1, tu_xorshift, &seed);
    }
    if (flags & A_BIAS_F64) {
        ag_tensor_free(b1);
        b1 = ag_zeros(AG_F64, 1, SZ(3));
    }
    ag_module *a = lin(w1, b1, flags & A_BIAS_BUFFER, false);
    ag_module *b = lin(w2, flags & NO_B_BIAS ? NULL : b2, false, false);
    if (flags & REVERSED)
        parent(m, "b", b, "a", a);
    else
        parent(m, "a", a, "b", b);
    ag_tensor_free(w1);
    ag_tensor_free(b1);
    ag_tensor_free(w2);
    ag_tensor_free(b2);
    return m;
}

/* ---- helpers ---- */

/* Max |a - b| over the plain tensors a and b flatten into; INFINITY when their structures
 * differ or one is missing. */
static double diff(const ag_tensor *a, const ag_tensor *b) {
    if (!a || !b)
        return a == b ? 0 : INFINITY;
    ag_tensor *pa[8], *pb[8];
    int na = ag_subclass_flatten_tensors((ag_tensor *const *)&a, 1, pa, 8);
    int nb = ag_subclass_flatten_tensors((ag_tensor *const *)&b, 1, pb, 8);
    if (ag_tensor_subclass(a) != ag_tensor_subclass(b) || na != nb)
        return INFINITY;
    double m = 0;
    for (int i = 0; i < na; i++)
        m = fmax(m, tu_max_abs_diff(pa[i], pb[i]));
    return m;
}

static ag_compiled *compile_from(ag_module *m, ag_tensor *x, ag_joint **jout) {
    ag_joint *j = ag_export_joint(m, &x, 1, NULL, NULL, 0, NULL);
    if (!j)
        fail_msg("export: %s", ag_last_error());
    ag_compiled *c = ag_compile_joint(j, NULL);
    if (!c)
        fail_msg("compile: %s", ag_last_error());
    if (jout)
        *jout = j;
    else
        ag_joint_free(j);
    return c;
}

/* Eager on me and compiled on mc, each with a backward of sum(y * y): the outputs and every
 * parameter's gradient (by name) agree. */
static void expect_as_eager(ag_compiled *c, ag_module *me, ag_module *mc, ag_tensor *x) {
    ag_scope_begin();
    ag_tensor *ye, *yc;
    assert_int_equal(ag_module_call(me, &x, 1, &ye, 1), 1);
    if (ag_compiled_call_module(c, mc, &x, 1, &yc, 1) != 1)
        fail_msg("compiled_call_module: %s", ag_last_error());
    if (diff(ye, yc) > 1e-5)
        fail_msg("the compiled output differs from eager's by %g", diff(ye, yc));
    assert_int_equal(ag_backward(ag_sum_all(ag_mul(ye, ye)), NULL, false), 0);
    assert_int_equal(ag_backward(ag_sum_all(ag_mul(yc, yc)), NULL, false), 0);
    ag_scope_end();
    ag_named_tensors pe, pc;
    assert_int_equal(ag_module_named_parameters(me, true, &pe), 0);
    assert_int_equal(ag_module_named_parameters(mc, true, &pc), 0);
    assert_int_equal(pe.n, pc.n);
    for (int i = 0; i < pe.n; i++) {
        const ag_tensor *ge = ag_tensor_grad(pe.tensors[i]);
        const ag_tensor *gc = ag_tensor_grad(ag_module_param(mc, pe.names[i]));
        assert_non_null(ge);
        if (diff(ge, gc) > 1e-5)
            fail_msg("the gradient of %s differs from eager's by %g", pe.names[i], diff(ge, gc));
    }
    ag_named_tensors_free(&pe);
    ag_named_tensors_free(&pc);
}

/* What the old gather did: mc's parameters then buffers in its own order (remove_duplicate
 * false), then x, given to ag_compiled_call. The caller checks that it ran (the shapes agree)
 * and computed something other than eager's y. */
static double positional_diff(ag_compiled *c, ag_module *me, ag_module *mc, ag_tensor *x) {
    ag_named_tensors ps, bs;
    assert_int_equal(ag_module_named_parameters(mc, false, &ps), 0);
    assert_int_equal(ag_module_named_buffers(mc, false, &bs), 0);
    ag_tensor *in[16];
    int n = 0;
    for (int i = 0; i < ps.n; i++)
        in[n++] = ps.tensors[i];
    for (int i = 0; i < bs.n; i++)
        in[n++] = bs.tensors[i];
    in[n++] = x;
    bool prev = ag_set_grad_enabled(false);
    ag_module_train(mc, false); /* (no write-back into the buffers) */
    ag_module_train(me, false);
    ag_scope_begin();
    ag_tensor *yp = NULL, *ye = NULL;
    int rc = ag_compiled_call(c, in, n, &yp, 1);
    if (rc != 1)
        fail_msg("the positional call was refused: %s", ag_last_error());
    assert_int_equal(ag_module_call(me, &x, 1, &ye, 1), 1);
    double d = diff(ye, yp);
    ag_scope_end();
    ag_set_grad_enabled(prev);
    ag_module_train(mc, true);
    ag_module_train(me, true);
    ag_named_tensors_free(&ps);
    ag_named_tensors_free(&bs);
    return d;
}

/* ---- tests ---- */

/* The same parameters registered in another order: eager's outputs and gradients, where the
 * module's order would have swapped a and b (same shapes) without an error. */
static void test_reordered_children(void **st) {
    (void)st;
    uint64_t seed = 11;
    ag_tensor *x = tu_rand_tensor(F32, 2, SZ(4, 3), -1, 1, tu_xorshift, &seed);
    ag_module *me = pair_model(5, 0), *mc = pair_model(5, REVERSED);
    ag_joint *j;
    ag_compiled *c = compile_from(me, x, &j);
    /* the joint's names, and the reordered module's own order */
    assert_int_equal(ag_joint_num_params(j), 4);
    assert_string_equal(ag_joint_param_fqn(j, 0), "a.weight");
    assert_string_equal(ag_joint_param_fqn(j, 2), "b.weight");
    ag_named_tensors ps;
    assert_int_equal(ag_module_named_parameters(mc, false, &ps), 0);
    assert_string_equal(ps.names[0], "b.weight");
    ag_named_tensors_free(&ps);
    expect_as_eager(c, me, mc, x);
    /* a second call on the unchanged module (its tensors kept): the same again */
    expect_as_eager(c, me, mc, x);
    assert_true(positional_diff(c, me, mc, x) > 1e-3);
    ag_compiled_free(c);
    ag_joint_free(j);
    ag_module_free(me);
    ag_module_free(mc);
    ag_tensor_free(x);
}

/* Conv2d then BatchNorm2d (exported), and the same registered bn first, training: the compiled
 * call's running statistics land in the reordered module's buffers, equal to eager's, step
 * after step. */
static void test_batchnorm_buffers(void **st) {
    (void)st;
    static const chain cb = {"conv", "bn", true};
    ag_module *mod[2];
    for (int k = 0; k < 2; k++) {
        ag_manual_seed(3);
        ag_module *conv = ag_nn_conv2d(1, 3, 3, 1, 1, 1, 1, true);
        ag_module *bn = ag_nn_batchnorm2d(3, 1e-5, 0.1);
        mod[k] = k ? parent(chain_new(&cb), "bn", bn, "conv", conv)
                   : parent(chain_new(&cb), "conv", conv, "bn", bn);
    }
    uint64_t seed = 4;
    ag_tensor *x = tu_rand_tensor(F32, 4, SZ(2, 1, 4, 4), -1, 1, tu_xorshift, &seed);
    ag_compiled *c = compile_from(mod[0], x, NULL);
    const char *bufs[] = {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"};
    for (int step = 0; step < 2; step++) {
        expect_as_eager(c, mod[0], mod[1], x);
        for (int i = 0; i < 3; i++) {
            ag_tensor *be = ag_module_buffer(mod[0], bufs[i]);
            ag_tensor *bc = ag_module_buffer(mod[1], bufs[i]);
            if (diff(be, bc) > 1e-6)
                fail_msg("step %d: %s differs from eager's by %g", step, bufs[i], diff(be, bc));
        }
    }
    /* and they moved: two updates from zeros (mean) and 2 batches counted */
    tu_assert_near(ag_tensor_item_at(ag_module_buffer(mod[1], bufs[2]), 0), 2, 0, bufs[2], 0);
    double moved = 0;
    for (int i = 0; i < 3; i++)
        moved += fabs(ag_tensor_item_at(ag_module_buffer(mod[1], bufs[0]), i));
    assert_true(moved > 1e-4);
    ag_compiled_free(c);
    for (int k = 0; k < 2; k++)
        ag_module_free(mod[k]);
    ag_tensor_free(x);
}

/* One weight under two names (enc.weight, dec.weight), as GPT-2's lm_head and wte: the export
 * lists both names (remove_duplicate=False) and the call finds the one tensor under each; its
 * gradient is the sum of both uses, as eager's. Registered dec first, the biases (both [3])
 * would have been swapped by the module's order. */
static void test_tied_weight(void **st) {
    (void)st;
    static const chain ed = {"enc", "dec", false};
    ag_module *mod[2];
    for (int k = 0; k < 2; k++) {
        uint64_t seed = 21;
        ag_tensor *w = tu_rand_tensor(F32, 2, SZ(3, 3), -1, 1, tu_xorshift, &seed);
        ag_tensor *be = tu_rand_tensor(F32, 1, SZ(3), -1, 1, tu_xorshift, &seed);
        ag_tensor *bd = tu_rand_tensor(F32, 1, SZ(3), -1, 1, tu_xorshift, &seed);
        ag_module *enc = lin(w, be, false, false), *dec = lin(w, bd, false, false);
        mod[k] = k ? parent(chain_new(&ed), "dec", dec, "enc", enc)
                   : parent(chain_new(&ed), "enc", enc, "dec", dec);
        ag_tensor_free(w);
        ag_tensor_free(be);
        ag_tensor_free(bd);
    }
    assert_ptr_equal(ag_module_param(mod[1], "enc.weight"), ag_module_param(mod[1], "dec.weight"));
    uint64_t seed = 8;
    ag_tensor *x = tu_rand_tensor(F32, 2, SZ(4, 3), -1, 1, tu_xorshift, &seed);
    ag_joint *j;
    ag_compiled *c = compile_from(mod[0], x, &j);
    assert_int_equal(ag_joint_num_params(j), 4);
    assert_string_equal(ag_joint_param_fqn(j, 0), "enc.weight");
    assert_string_equal(ag_joint_param_fqn(j, 2), "dec.weight");
    expect_as_eager(c, mod[0], mod[1], x);
    assert_true(positional_diff(c, mod[0], mod[1], x) > 1e-3);
    ag_compiled_free(c);
    ag_joint_free(j);
    for (int k = 0; k < 2; k++)
        ag_module_free(mod[k]);
    ag_tensor_free(x);
}

/* GPT-2 (tiny, lm_head tied to wte): both names among the joint's parameters, one tensor, and
 * the compiled loss and the tied weight's gradient are eager's. */
static void test_gpt2_tied(void **st) {
    (void)st;
    ag_module *me, *mc;
    ag_tensor *in[4], *in2[4];
    int nin;
    assert_int_equal(ag_zoo_build("gpt2", NULL, &me, in, 4, &nin), 0);
    assert_int_equal(ag_zoo_build("gpt2", NULL, &mc, in2, 4, &nin), 0);
    ag_joint *j = ag_export_joint(me, in, nin, NULL, NULL, 0, NULL);
    assert_non_null(j);
    int lm = -1, wte = -1;
    for (int i = 0; i < ag_joint_num_params(j); i++) {
        if (!strcmp(ag_joint_param_fqn(j, i), "lm_head.weight"))
            lm = i;
        if (!strcmp(ag_joint_param_fqn(j, i), "transformer.wte.weight"))
            wte = i;
    }
    assert_true(lm >= 0 && wte >= 0);
    assert_ptr_equal(ag_module_param(mc, "lm_head.weight"),
                     ag_module_param(mc, "transformer.wte.weight"));
    ag_compiled *c = ag_compile_joint(j, NULL);
    assert_non_null(c);
    ag_scope_begin();
    ag_tensor *ye[2], *yc[2];
    int n = ag_module_call(me, in, nin, ye, 2);
    assert_true(n >= 1);
    assert_int_equal(ag_compiled_call_module(c, mc, in, nin, yc, 2), n);
    assert_true(diff(ye[0], yc[0]) <= 1e-4);
    assert_int_equal(ag_backward(ag_sum_all(ye[0]), NULL, false), 0);
    assert_int_equal(ag_backward(ag_sum_all(yc[0]), NULL, false), 0);
    ag_scope_end();
    assert_true(diff(ag_tensor_grad(ag_module_param(me, "lm_head.weight")),
                     ag_tensor_grad(ag_module_param(mc, "lm_head.weight"))) <= 1e-4);
    ag_compiled_free(c);
    ag_joint_free(j);
    ag_module_free(me);
    ag_module_free(mc);
    for (int i = 0; i < nin; i++) {
        ag_tensor_free(in[i]);
        ag_tensor_free(in2[i]);
    }
}

/* TwoTensor parameters w1, w2 (both [3, 3]): y = linear(relu(linear(x, w1)), w2), a
 * TwoTensor; the module registering w2 first gets eager's output and gradients. */
static int two_fwd(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    int rc = ag_module_check_io(m, nin, 1, 1, max_out, 1);
    if (rc)
        return rc;
    ag_scope_begin();
    ag_tensor *h = ag_relu(ag_linear(in[0], ag_module_param(m, "w1"), NULL));
    return ag_module_return1(ag_linear(h, ag_module_param(m, "w2"), NULL), out);
}

static ag_module *two_model(bool reversed) {
    uint64_t seed = 31;
    ag_tensor *p[4];
    for (int i = 0; i < 4; i++)
        p[i] = tu_rand_tensor(F32, 2, SZ(3, 3), -1, 1, tu_xorshift, &seed);
    ag_tensor *w[2] = {ag_two_tensor(p[0], p[1]), ag_two_tensor(p[2], p[3])};
    ag_module *m = ag_module_new("TwoMLP", two_fwd, NULL, NULL);
    for (int k = 0; k < 2; k++) {
        int i = reversed ? 1 - k : k;
        assert_int_equal(ag_module_register_parameter(m, i ? "w2" : "w1", w[i]), 0);
    }
    for (int i = 0; i < 4; i++)
        ag_tensor_free(p[i]);
    ag_tensor_free(w[0]);
    ag_tensor_free(w[1]);
    return m;
}

static void test_subclass_params(void **st) {
    (void)st;
    ag_module *me = two_model(false), *mc = two_model(true);
    uint64_t seed = 2;
    ag_tensor *x = tu_rand_tensor(F32, 2, SZ(4, 3), -1, 1, tu_xorshift, &seed);
    ag_joint *j;
    ag_compiled *c = compile_from(me, x, &j);
    assert_int_equal(ag_joint_num_flat_inputs(j), 5); /* two parts each, and x */
    expect_as_eager(c, me, mc, x);
    assert_true(positional_diff(c, me, mc, x) > 1e-3);
    /* a module lacking one of them: refused by name */
    ag_module *half = ag_module_new("TwoMLP", two_fwd, NULL, NULL);
    assert_int_equal(ag_module_register_parameter(half, "w1", ag_module_param(me, "w1")), 0);
    ag_tensor *y = NULL;
    assert_int_equal(ag_compiled_call_module(c, half, &x, 1, &y, 1), AG_EINVAL);
    tu_assert_error_contains("compiled_call_module: the module has no parameter 'w2'");
    assert_null(y);
    ag_module_free(half);
    ag_compiled_free(c);
    ag_joint_free(j);
    ag_module_free(me);
    ag_module_free(mc);
    ag_tensor_free(x);
}

/* A refused call has no other effect: no output, no gradient, the buffers untouched. */
static void expect_refused(ag_compiled *c, ag_module *m, ag_tensor *x, const char *msg) {
    ag_tensor *y = NULL;
    int rc = ag_compiled_call_module(c, m, &x, 1, &y, 1);
    if (rc != AG_EINVAL)
        fail_msg("expected a refusal (%s), got %d: %s", msg, rc, ag_last_error());
    tu_assert_error_contains(msg);
    assert_null(y);
    ag_named_tensors ps;
    assert_int_equal(ag_module_named_parameters(m, false, &ps), 0);
    for (int i = 0; i < ps.n; i++)
        assert_null(ag_tensor_grad(ps.tensors[i]));
    ag_named_tensors_free(&ps);
}

static void test_refusals_name_the_fqn(void **st) {
    (void)st;
    uint64_t seed = 11;
    ag_tensor *x = tu_rand_tensor(F32, 2, SZ(4, 3), -1, 1, tu_xorshift, &seed);
    ag_module *me = pair_model(5, 0);
    ag_compiled *c = compile_from(me, x, NULL);
    struct {
        unsigned flags;
        const char *msg;
    } cases[] = {
        {NO_B_BIAS | REVERSED, "compiled_call_module: the module has no parameter 'b.bias', "
                               "which the compiled function takes as its input 3"},
        {A_WEIGHT_43, "compiled_call_module: the module's parameter 'a.weight' is f32[4, 3]; the "
                      "compiled function takes f32[3, 3] (input 0)"},
        {A_BIAS_F64, "compiled_call_module: the module's parameter 'a.bias' is f64[3]; the "
                     "compiled function takes f32[3] (input 1)"},
        {A_BIAS_BUFFER, "compiled_call_module: 'a.bias' is a buffer of the module; the compiled "
                        "function takes it as a parameter (input 1)"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        ag_module *m = pair_model(5, cases[k].flags);
        expect_refused(c, m, x, cases[k].msg);
        ag_module_free(m);
    }
    /* The argument count. */
    ag_tensor *y = NULL;
    assert_int_equal(ag_compiled_call_module(c, me, (ag_tensor *[]){x, x}, 2, &y, 1), AG_EINVAL);
    tu_assert_error_contains("compiled_call_module: 2 args given, the compiled function takes 1 "
                             "after the module's 4 parameters and buffers");
    /* Extra tensors the joint does not take: refused, also after a call that succeeded (the
     * tensors it found are not reused for a module that changed since). */
    ag_module *m = pair_model(5, REVERSED);
    ag_scope_begin();
    assert_int_equal(ag_compiled_call_module(c, m, &x, 1, &y, 1), 1);
    ag_scope_end();
    ag_tensor *s = ag_zeros(F32, 1, SZ(3));
    assert_int_equal(ag_module_register_parameter(ag_module_child(m, "a"), "scale", s), 0);
    ag_tensor_free(s);
    y = NULL;
    assert_int_equal(ag_compiled_call_module(c, m, &x, 1, &y, 1), AG_EINVAL);
    tu_assert_error_contains("compiled_call_module: the module's parameter 'a.scale' is not an "
                             "input of the compiled function (its joint takes 4 parameters and "
                             "buffers); export the module again");
    assert_null(y);
    ag_module_free(m);
    m = pair_model(5, 0);
    ag_tensor *cnt = ag_zeros(AG_I64, 0, NULL);
    assert_int_equal(ag_module_register_buffer(ag_module_child(m, "b"), "count", cnt, true), 0);
    ag_tensor_free(cnt);
    expect_refused(c, m, x, "compiled_call_module: the module's buffer 'b.count' is not an input");
    ag_module_free(m);
    ag_compiled_free(c);
    ag_module_free(me);
    ag_tensor_free(x);
}

/* One callable called on modules in turn (each holding its own values): each call computes
 * with the module it is given, not the one before, nor a freed one that had its address. */
static void test_modules_in_turn(void **st) {
    (void)st;
    uint64_t seed = 11;
    ag_tensor *x = tu_rand_tensor(F32, 2, SZ(4, 3), -1, 1, tu_xorshift, &seed);
    ag_module *m[3] = {pair_model(5, 0), pair_model(6, REVERSED), pair_model(7, 0)};
    ag_compiled *c = compile_from(m[0], x, NULL);
    bool prev = ag_set_grad_enabled(false);
    for (int k = 0; k < 7; k++) {
        ag_module *cur = m[(k * 2) % 3];
        ag_scope_begin();
        ag_tensor *ye, *yc;
        assert_int_equal(ag_module_call(cur, &x, 1, &ye, 1), 1);
        assert_int_equal(ag_compiled_call_module(c, cur, &x, 1, &yc, 1), 1);
        assert_true(diff(ye, yc) <= 1e-5);
        ag_scope_end();
    }
    /* A module freed and another built, often at the freed one's address: its own tensors. */
    bool reused = false;
    for (int k = 0; k < 4; k++) {
        uintptr_t old = (uintptr_t)m[1];
        ag_module_free(m[1]);
        m[1] = pair_model(40 + (uint64_t)k, k % 2 ? REVERSED : 0);
        reused |= (uintptr_t)m[1] == old;
        ag_scope_begin();
        ag_tensor *ye, *yc;
        assert_int_equal(ag_module_call(m[1], &x, 1, &ye, 1), 1);
        assert_int_equal(ag_compiled_call_module(c, m[1], &x, 1, &yc, 1), 1);
        assert_true(diff(ye, yc) <= 1e-5);
        ag_scope_end();
    }
    if (!reused)
        print_message("(no module was built at a freed one's address this time)\n");
    ag_set_grad_enabled(prev);
    ag_compiled_free(c);
    for (int k = 0; k < 3; k++)
        ag_module_free(m[k]);
    ag_tensor_free(x);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_reordered_children), cmocka_unit_test(test_batchnorm_buffers),
        cmocka_unit_test(test_tied_weight),        cmocka_unit_test(test_gpt2_tied),
        cmocka_unit_test(test_subclass_params),    cmocka_unit_test(test_refusals_name_the_fqn),
        cmocka_unit_test(test_modules_in_turn),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
