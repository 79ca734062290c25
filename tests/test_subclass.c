/* Tensor subclasses (include/aotgrad/subclass.h), issue 6 part 4: TwoTensor and
 * ScaledInt8Tensor eagerly (ops, autograd, optimizer, errors), a user-defined type with
 * metadata, the joint export's flattened descriptors (compared with the lists upstream's
 * aot_dispatch_subclass makes for the same models), the compiled callable against eager over
 * SGD steps, the FX utilities' refusal, the text format round trip, the CLI, and allocation
 * failure sweeps. */
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define F32 AG_F32
#define SZ(...) ((int64_t[]){__VA_ARGS__})
#define VALS(...) ((double[]){__VA_ARGS__})

static const char *repr(const ag_desc *d) {
    static char buf[8][512];
    static int k;
    char *b = buf[k++ % 8];
    ag_desc_repr(d, b, 512);
    return b;
}

/* Asserts a and b are plain tensors of the same shape and bitwise-equal values. */
static void assert_same_values(const ag_tensor *a, const ag_tensor *b) {
    assert_non_null(a);
    assert_non_null(b);
    assert_null(ag_tensor_subclass(a));
    assert_null(ag_tensor_subclass(b));
    assert_int_equal(ag_tensor_ndim(a), ag_tensor_ndim(b));
    for (int d = 0; d < ag_tensor_ndim(a); d++)
        assert_int_equal(ag_tensor_sizes(a)[d], ag_tensor_sizes(b)[d]);
    for (int64_t i = 0; i < ag_tensor_numel(a); i++)
        if (ag_tensor_item_at(a, i) != ag_tensor_item_at(b, i))
            fail_msg("element %lld: %.9g != %.9g", (long long)i, ag_tensor_item_at(a, i),
                     ag_tensor_item_at(b, i));
}

/* Largest relative difference of two tensors, instances compared by their inner tensors. */
static double rel(const ag_tensor *ref, const ag_tensor *got) {
    if (!ref || !got)
        return ref == got ? 0 : INFINITY;
    if (ag_tensor_subclass(ref) || ag_tensor_subclass(got)) {
        ag_tensor *a[8], *b[8];
        int na = ag_subclass_flatten_tensors((ag_tensor *const *)&ref, 1, a, 8);
        int nb = ag_subclass_flatten_tensors((ag_tensor *const *)&got, 1, b, 8);
        if (ag_tensor_subclass(ref) != ag_tensor_subclass(got) || na != nb)
            return INFINITY;
        double m = 0;
        for (int i = 0; i < na; i++)
            m = fmax(m, rel(a[i], b[i]));
        return m;
    }
    double m = 1;
    for (int64_t i = 0; i < ag_tensor_numel(ref); i++)
        m = fmax(m, fabs(ag_tensor_item_at(ref, i)));
    return tu_max_abs_diff(ref, got) / m;
}

/* The placeholders' names, descriptors and VALs ("f32[2, 3]") are exactly these. */
static void expect_placeholders(const ag_graph *g, const char *const *names,
                                const char *const *descs, const char *const *vals, int n) {
    ag_node **ph;
    int nph = ag_graph_placeholders(g, &ph);
    if (nph != n)
        fail_msg("%d placeholders, expected %d", nph, n);
    for (int i = 0; i < n; i++) {
        assert_string_equal(ag_node_name(ph[i]), names[i]);
        assert_string_equal(repr(ag_node_desc(ph[i])), descs[i]);
        char b[64];
        const ag_tmeta *m = ag_node_val(ph[i], 0);
        snprintf(b, sizeof b, "%s", ag_dtype_short(m->dtype));
        size_t k = strlen(b);
        snprintf(b + k, sizeof b - k, "[");
        for (int d = 0; d < m->ndim; d++) {
            k = strlen(b);
            snprintf(b + k, sizeof b - k, d ? ", %lld" : "%lld", (long long)m->sizes[d]);
        }
        k = strlen(b);
        snprintf(b + k, sizeof b - k, "]");
        assert_string_equal(b, vals[i]);
    }
}

/* The output node's descriptors are exactly these ("None" for None), and the outputs with a
 * None descriptor are None. */
static void expect_outputs(const ag_graph *g, const char *const *descs, int n) {
    const ag_node *out = ag_graph_output_node(g);
    assert_non_null(out);
    const ag_garg *a = ag_node_arg(out, 0);
    if (a->n != n)
        fail_msg("%d outputs, expected %d", a->n, n);
    for (int i = 0; i < n; i++) {
        assert_string_equal(repr(ag_node_output_desc(out, i)), descs[i]);
        if (!strcmp(descs[i], "None"))
            assert_null(a->u.nodes[i]);
        else
            assert_non_null(a->u.nodes[i]);
    }
}

/* ---- TwoTensor, eagerly ---- */

static void test_two_tensor_eager_ops(void **st) {
    (void)st;
    ag_tensor *a = tu_tensor(F32, 2, SZ(2, 3), VALS(1, -2, 3, -4, 5, -6));
    ag_tensor *b = tu_tensor(F32, 2, SZ(2, 3), VALS(0.5, 0.25, -1, 2, -3, 4));
    ag_tensor *x = tu_tensor(F32, 2, SZ(3, 2), VALS(1, 2, 3, 4, 5, 6));
    ag_tensor *t = ag_two_tensor(a, b);
    assert_non_null(t);
    assert_ptr_equal(ag_tensor_subclass(t), ag_two_tensor_type());
    assert_null(ag_tensor_subclass(a));
    assert_int_equal(ag_tensor_dtype(t), F32);
    tu_assert_shape(t, 2, SZ(2, 3));
    assert_ptr_equal(ag_subclass_attr(t, "a"), a);
    assert_ptr_equal(ag_subclass_attr(t, "b"), b);
    assert_null(ag_subclass_attr(t, "c"));
    ag_tensor *inner[AG_SUBCLASS_MAX_INNER];
    const void *meta = (const void *)1;
    assert_int_equal(ag_subclass_flatten(t, inner, &meta), 2);
    assert_ptr_equal(inner[0], a);
    assert_ptr_equal(inner[1], b);
    assert_null(meta);
    assert_int_equal(ag_subclass_flatten(a, inner, NULL), AG_EINVAL);

    ag_scope_begin();
    /* Every op runs on a and on b; results are TwoTensors of the per-half results. */
    struct {
        ag_tensor *got, *wa, *wb;
    } cases[] = {
        {ag_mm(t, x), ag_mm(a, x), ag_mm(b, x)},
        {ag_relu(ag_add(t, t)), ag_relu(ag_add(a, a)), ag_relu(ag_add(b, b))},
        {ag_mul(t, ag_t(x)), ag_mul(a, ag_t(x)), ag_mul(b, ag_t(x))}, /* with a plain tensor */
        {ag_sum(t, SZ(1), 1, false), ag_sum(a, SZ(1), 1, false), ag_sum(b, SZ(1), 1, false)},
        {ag_gt_scalar(t, 0), ag_gt_scalar(a, 0), ag_gt_scalar(b, 0)}, /* TwoTensor of bools */
        {ag_reshape(ag_t(t), 1, SZ(6)), ag_reshape(ag_t(a), 1, SZ(6)),
         ag_reshape(ag_t(b), 1, SZ(6))},
        {ag_cat((ag_tensor *[]){t, a}, 2, 0), ag_cat((ag_tensor *[]){a, a}, 2, 0),
         ag_cat((ag_tensor *[]){b, a}, 2, 0)},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        ag_tensor *g = cases[i].got;
        if (!g)
            fail_msg("case %zu: %s", i, ag_last_error());
        assert_ptr_equal(ag_tensor_subclass(g), ag_two_tensor_type());
        assert_same_values(ag_subclass_attr(g, "a"), cases[i].wa);
        assert_same_values(ag_subclass_attr(g, "b"), cases[i].wb);
        assert_int_equal(ag_tensor_dtype(g), ag_tensor_dtype(cases[i].wa));
        tu_assert_shape(g, ag_tensor_ndim(cases[i].wa), ag_tensor_sizes(cases[i].wa));
    }
    assert_int_equal(ag_tensor_dtype(cases[4].got), AG_BOOL);
    /* A multi-output op: split gives a TwoTensor per chunk. */
    ag_tensor *parts[4];
    assert_int_equal(ag_split(t, 1, 0, parts, 4), 2);
    assert_ptr_equal(ag_tensor_subclass(parts[1]), ag_two_tensor_type());
    assert_same_values(ag_subclass_attr(parts[1], "b"),
                       ag_select(b, 0, 1) ? ag_unsqueeze(ag_select(b, 0, 1), 0) : NULL);
    /* A view shares the instance's version counter; an in-place op writes both halves and
     * returns the outer tensor itself. */
    ag_tensor *v = ag_t(t);
    uint64_t v0 = ag_tensor_version(t);
    assert_int_equal(ag_tensor_version(v), v0);
    ag_tensor *r = ag_add_scalar_(t, 1.0);
    assert_ptr_equal(r, t);
    assert_int_equal(ag_tensor_version(t), v0 + 1);
    assert_int_equal(ag_tensor_version(v), v0 + 1);
    assert_true(ag_tensor_item_at(a, 0) == 2.0 && ag_tensor_item_at(b, 0) == 1.5);
    ag_scope_end();

    /* An instance has no data of its own. */
    assert_true(isnan(ag_tensor_item_at(t, 0)));
    tu_assert_error_contains("TwoTensor f32[2, 3] is a tensor subclass instance without data");
    ag_tensor_free(t);
    ag_tensor_free(a);
    ag_tensor_free(b);
    ag_tensor_free(x);
}

static void test_two_tensor_errors(void **st) {
    (void)st;
    ag_tensor *a = tu_tensor(F32, 2, SZ(2, 3), VALS(1, 2, 3, 4, 5, 6));
    ag_tensor *b = tu_tensor(F32, 2, SZ(3, 2), VALS(1, 2, 3, 4, 5, 6));
    ag_tensor *c = tu_tensor(AG_F64, 2, SZ(2, 3), VALS(1, 2, 3, 4, 5, 6));
    assert_null(ag_two_tensor(a, b));
    tu_assert_error_contains("TwoTensor: tensors a and b must have the same dtype, shape and "
                             "strides; got a f32[2, 3] and b f32[3, 2]");
    assert_null(ag_two_tensor(a, c));
    tu_assert_error_contains("b f64[2, 3]");
    ag_scope_begin();
    assert_null(ag_two_tensor(a, ag_t(b))); /* same shape, other strides */
    tu_assert_error_contains("same dtype, shape and strides");
    ag_scope_end();
    ag_clear_error();
    assert_null(ag_two_tensor(NULL, a));
    tu_assert_error_contains("two_tensor: a is NULL");
    /* A NULL from a failed op keeps that op's message. */
    ag_scope_begin();
    assert_null(ag_two_tensor(ag_mm(a, a), a));
    tu_assert_error_contains("mm");
    ag_scope_end();
    /* Ops check shapes against the outer metadata first. */
    ag_tensor *t = ag_two_tensor(a, a);
    assert_null(ag_mm(t, t));
    tu_assert_error_contains("mm");
    ag_tensor_free(t);
    ag_tensor_free(a);
    ag_tensor_free(b);
    ag_tensor_free(c);
}

/* Autograd runs above the subclass: gradients of TwoTensor leaves are TwoTensors whose halves
 * are the gradients of the same computation on the halves alone, accumulated into .grad. */
static void test_two_tensor_autograd(void **st) {
    (void)st;
    uint64_t seed = 7;
    ag_tensor *wa = tu_rand_tensor(F32, 2, SZ(2, 3), -1, 1, tu_xorshift, &seed);
    ag_tensor *wb = tu_rand_tensor(F32, 2, SZ(2, 3), -1, 1, tu_xorshift, &seed);
    ag_tensor *ba = tu_rand_tensor(F32, 1, SZ(2), -1, 1, tu_xorshift, &seed);
    ag_tensor *bb = tu_rand_tensor(F32, 1, SZ(2), -1, 1, tu_xorshift, &seed);
    ag_tensor *x = tu_rand_tensor(F32, 2, SZ(4, 3), -1, 1, tu_xorshift, &seed);
    ag_tensor *w = ag_two_tensor(wa, wb), *bias = ag_two_tensor(ba, bb);
    assert_int_equal(ag_tensor_set_requires_grad(w, true), 0);
    assert_int_equal(ag_tensor_set_requires_grad(bias, true), 0);
    assert_false(ag_tensor_requires_grad(wa)); /* the halves take no part in autograd */
    /* The same computation on each half alone, with plain leaves. */
    ag_tensor *ref_w[2], *ref_b[2];
    for (int h = 0; h < 2; h++) {
        ref_w[h] = ag_detach(h ? wb : wa);
        ref_b[h] = ag_detach(h ? bb : ba);
        ag_tensor_set_requires_grad(ref_w[h], true);
        ag_tensor_set_requires_grad(ref_b[h], true);
    }
    for (int pass = 0; pass < 2; pass++) { /* the second pass accumulates */
        ag_scope_begin();
        ag_tensor *y = ag_tanh(ag_linear(x, w, bias));
        ag_tensor *loss = ag_sum_all(ag_mul(y, y));
        assert_ptr_equal(ag_tensor_subclass(loss), ag_two_tensor_type());
        assert_true(ag_tensor_requires_grad(y));
        assert_non_null(ag_tensor_grad_fn_name(y));
        assert_int_equal(ag_backward(loss, NULL, false), 0);
        for (int h = 0; h < 2; h++) {
            ag_tensor *yh = ag_tanh(ag_linear(x, ref_w[h], ref_b[h]));
            assert_int_equal(ag_backward(ag_sum_all(ag_mul(yh, yh)), NULL, false), 0);
        }
        ag_scope_end();
        ag_tensor *gw = ag_tensor_grad(w), *gb = ag_tensor_grad(bias);
        assert_ptr_equal(ag_tensor_subclass(gw), ag_two_tensor_type());
        assert_ptr_equal(ag_tensor_subclass(gb), ag_two_tensor_type());
        for (int h = 0; h < 2; h++) {
            const char *attr = h ? "b" : "a";
            assert_same_values(ag_subclass_attr(gw, attr), ag_tensor_grad(ref_w[h]));
            assert_same_values(ag_subclass_attr(gb, attr), ag_tensor_grad(ref_b[h]));
        }
    }
    /* SGD updates both halves of a TwoTensor parameter from the matching gradient halves. */
    ag_module *m = ag_module_new("M", NULL, NULL, NULL);
    assert_int_equal(ag_module_register_parameter(m, "w", w), 0);
    ag_optim *o = ag_optim_sgd(m, 0.5, 0, 0, false);
    double a0 = ag_tensor_item_at(wa, 4), b0 = ag_tensor_item_at(wb, 4);
    double ga = ag_tensor_item_at(ag_subclass_attr(ag_tensor_grad(w), "a"), 4);
    double gbv = ag_tensor_item_at(ag_subclass_attr(ag_tensor_grad(w), "b"), 4);
    uint64_t ver = ag_tensor_version(w);
    assert_int_equal(ag_optim_step(o), 0);
    assert_true(ag_tensor_item_at(wa, 4) == (float)(a0 - (float)(0.5f * (float)ga)));
    assert_true(ag_tensor_item_at(wb, 4) == (float)(b0 - (float)(0.5f * (float)gbv)));
    assert_true(ag_tensor_version(w) > ver);
    ag_optim_zero_grad(o);
    assert_null(ag_tensor_grad(w));
    /* A plain gradient for a TwoTensor parameter is refused by the optimizer. */
    ag_tensor *pg = tu_tensor(F32, 2, SZ(2, 3), VALS(1, 1, 1, 1, 1, 1));
    assert_int_equal(ag_tensor_set_grad(w, pg), 0);
    assert_int_equal(ag_optim_step(o), AG_EINVAL);
    tu_assert_error_contains("SGD: parameter 0 is a TwoTensor but its gradient is a plain tensor");
    ag_optim_free(o);
    ag_module_free(m);
    for (int h = 0; h < 2; h++) {
        ag_tensor_free(ref_w[h]);
        ag_tensor_free(ref_b[h]);
    }
    ag_tensor_free(pg);
    ag_tensor_free(w);
    ag_tensor_free(bias);
    ag_tensor_free(wa);
    ag_tensor_free(wb);
    ag_tensor_free(ba);
    ag_tensor_free(bb);
    ag_tensor_free(x);
}

/* ---- ScaledInt8Tensor and int8 ---- */

static void test_scaled_int8(void **st) {
    (void)st;
    ag_tensor *x = tu_tensor(F32, 2, SZ(2, 3), VALS(0.5, -1.27, 0.0, 1.27, 0.3, -0.004));
    ag_tensor *q = ag_scaled_int8_quantize(x);
    assert_non_null(q);
    assert_ptr_equal(ag_tensor_subclass(q), ag_scaled_int8_type());
    assert_int_equal(ag_tensor_dtype(q), F32);
    tu_assert_shape(q, 2, SZ(2, 3));
    ag_tensor *qd = ag_subclass_attr(q, "qdata"), *sc = ag_subclass_attr(q, "scale");
    assert_int_equal(ag_tensor_dtype(qd), AG_I8);
    char b[64];
    assert_string_equal(ag_tensor_meta_str(qd, b, sizeof b), "i8[2, 3]");
    assert_string_equal(ag_tensor_meta_str(sc, b, sizeof b), "f32[]");
    /* scale = max|x| / 127; qdata rounded half away from zero (-0.4 -> 0). */
    tu_assert_near(ag_tensor_item(sc), 0.01, 1e-6, "scale", 0);
    tu_assert_values(qd, 2, SZ(2, 3), VALS(50, -127, 0, 127, 30, 0), 0);
    ag_scope_begin();
    /* Round trip: dequantize is within half a step of x. */
    ag_tensor *dq = ag_scaled_int8_dequantize(q);
    assert_null(ag_tensor_subclass(dq));
    for (int64_t i = 0; i < 6; i++)
        assert_true(fabs(ag_tensor_item_at(dq, i) - ag_tensor_item_at(x, i)) <= 0.005 + 1e-7);
    /* int8 conversions: to float and back. */
    ag_tensor *f = ag_to_dtype(qd, AG_F64);
    tu_assert_values(f, 2, SZ(2, 3), VALS(50, -127, 0, 127, 30, 0), 0);
    tu_assert_values(ag_to_dtype(f, AG_I8), 2, SZ(2, 3), VALS(50, -127, 0, 127, 30, 0), 0);
    tu_assert_values(ag_clone(qd), 2, SZ(2, 3), VALS(50, -127, 0, 127, 30, 0), 0);
    /* Ops dequantize and run densely: plain results equal to the op on the dequantized value. */
    ag_tensor *y = tu_tensor(F32, 2, SZ(3, 2), VALS(1, 2, 3, 4, 5, 6));
    assert_same_values(ag_mm(q, y), ag_mm(dq, y));
    assert_same_values(ag_add(y, ag_t(q)), ag_add(y, ag_t(dq)));
    assert_same_values(ag_linear(ag_t(y), q, NULL), ag_linear(ag_t(y), dq, NULL));
    ag_tensor *parts[4], *dparts[4]; /* a list-output op */
    assert_int_equal(ag_split(q, 1, 0, parts, 4), 2);
    assert_int_equal(ag_split(dq, 1, 0, dparts, 4), 2);
    assert_same_values(parts[1], dparts[1]);
    /* int8 has no arithmetic kernels. */
    assert_null(ag_add(qd, qd));
    tu_assert_error_contains("no kernel for dtype i8");
    /* A frozen weight cannot be written. */
    assert_null(ag_add_scalar_(q, 1.0));
    assert_int_equal(ag_last_status(), AG_ENOTSUP);
    tu_assert_error_contains("add_.Scalar: argument 'self' is a ScaledInt8Tensor, which cannot be "
                             "written in place");
    ag_scope_end();
    assert_null(ag_scaled_int8_quantize(qd));
    tu_assert_error_contains("needs a plain float tensor, got i8[2, 3]");
    assert_null(ag_scaled_int8_dequantize(x));
    tu_assert_error_contains("not a ScaledInt8Tensor");
    ag_tensor_free(q);
    ag_tensor_free(x);
}

/* ---- a user-defined type with metadata ---- */

/* Shifted: value = x + shift, with `shift` as metadata; ops run densely on the value. */
typedef struct shift_meta {
    double shift;
} shift_meta;
static const char *const shift_attrs[] = {"x"};

static ag_tensor *shift_unflatten(const ag_subclass_type *type, ag_tensor *const *inner,
                                  const void *meta, int ndim, const int64_t *sizes) {
    return ag_subclass_new(type, ag_tensor_dtype(inner[0]), ndim, sizes, NULL, inner, meta);
}

static int shift_dispatch(const ag_subclass_type *type, const ag_op *op, const ag_arg *args,
                          int nargs, ag_tensor **outs) {
    ag_arg a[AG_MAX_ARGS];
    for (int i = 0; i < nargs; i++) {
        a[i] = args[i];
        if (a[i].kind == AG_ARG_TENSOR && ag_tensor_subclass(a[i].u.t) == type) {
            const void *m;
            ag_tensor *in[AG_SUBCLASS_MAX_INNER];
            ag_subclass_flatten(a[i].u.t, in, &m);
            a[i].u.t = ag_add_scalar(in[0], ((const shift_meta *)m)->shift);
        }
    }
    int rc = ag_op_call(op, a, nargs, outs);
    return rc < 0 || ag_op_noutputs(op) < 0 ? rc : ag_op_noutputs(op);
}

static const ag_subclass_type shift_type = {
    .name = "Shifted",
    .ninner = 1,
    .attrs = shift_attrs,
    .meta_size = sizeof(shift_meta),
    .unflatten = shift_unflatten,
    .dispatch = shift_dispatch,
};

/* A type whose dispatch returns the wrong shape. */
static int bad_dispatch(const ag_subclass_type *type, const ag_op *op, const ag_arg *args,
                        int nargs, ag_tensor **outs) {
    (void)type, (void)op, (void)args, (void)nargs;
    outs[0] = ag_zeros(F32, 1, SZ(5));
    return 1;
}
static const ag_subclass_type bad_type = {
    .name = "Bad",
    .ninner = 1,
    .attrs = shift_attrs,
    .unflatten = shift_unflatten,
    .dispatch = bad_dispatch,
};

static int shifted_fwd(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)nin, (void)max_out;
    ag_scope_begin();
    out[0] = ag_tensor_keep(ag_mul(ag_module_buffer(m, "s"), in[0]));
    ag_scope_end();
    return out[0] ? 1 : ag_last_status();
}

static void test_user_type_with_metadata(void **st) {
    (void)st;
    ag_tensor *x = tu_tensor(F32, 1, SZ(3), VALS(1, 2, 3));
    shift_meta sm = {10};
    ag_tensor *s = ag_subclass_new(&shift_type, F32, 1, SZ(3), NULL, &x, &sm);
    assert_non_null(s);
    sm.shift = 99; /* the instance keeps its own copy */
    const void *m = NULL;
    ag_tensor *in[AG_SUBCLASS_MAX_INNER];
    assert_int_equal(ag_subclass_flatten(s, in, &m), 1);
    assert_true(((const shift_meta *)m)->shift == 10);
    ag_scope_begin();
    tu_assert_values(ag_mul_scalar(s, 2), 1, SZ(3), VALS(22, 24, 26), 0);
    ag_tensor *s2 = ag_subclass_unflatten(&shift_type, in, &(shift_meta){-1}, 1, SZ(3));
    tu_assert_values(ag_neg(s2), 1, SZ(3), VALS(0, -1, -2), 0);
    /* Exported as a buffer: its one inner tensor is a primal. */
    ag_module *mod = ag_module_new("ShiftedScale", shifted_fwd, NULL, NULL);
    assert_int_equal(ag_module_register_buffer(mod, "s", s, true), 0);
    ag_tensor *v = tu_leaf(F32, 1, SZ(3), VALS(1, -1, 2));
    ag_joint *j = ag_export_joint(mod, &v, 1, NULL, NULL, 0, NULL);
    assert_non_null(j);
    expect_placeholders(
        ag_joint_graph(j), (const char *[]){"primals_1", "primals_2", "tangents_1"},
        (const char *[]){"SubclassGetAttrAOTInput(base=BufferAOTInput(target='s'), attr='x')",
                         "PlainAOTInput(idx=0)", "TangentAOTInput(output=PlainAOTOutput(idx=0))"},
        (const char *[]){"f32[3]", "f32[3]", "f32[3]"}, 3);
    expect_outputs(ag_joint_graph(j),
                   (const char *[]){"PlainAOTOutput(idx=0)", "None",
                                    "GradAOTOutput(grad_of=PlainAOTInput(idx=0))"},
                   3);
    /* Saved joints name the type: refused until it is registered, then a round trip whose
     * callable computes the same. */
    char *text = NULL;
    size_t len = 0;
    assert_true(ag_joint_save(j, &text, &len) < 0);
    tu_assert_error_contains("Shifted, a tensor subclass type the loader cannot find by its name");
    assert_null(ag_subclass_type_find("Shifted"));
    assert_int_equal(ag_subclass_type_register(&shift_type), 0);
    assert_int_equal(ag_subclass_type_register(&shift_type), 0); /* again: a no-op */
    assert_ptr_equal(ag_subclass_type_find("Shifted"), &shift_type);
    assert_ptr_equal(ag_subclass_type_find("TwoTensor"), ag_two_tensor_type());
    assert_true(ag_subclass_type_register(&(ag_subclass_type){.name = "TwoTensor"}) < 0);
    tu_assert_error_contains("another type is registered as 'TwoTensor'");
    assert_int_equal(ag_joint_save(j, &text, &len), 0);
    assert_non_null(strstr(text, "Shifted(f32[3]"));
    ag_joint *loaded = ag_joint_load(text, len);
    assert_non_null(loaded);
    char *text2 = NULL;
    assert_int_equal(ag_joint_save(loaded, &text2, NULL), 0);
    assert_string_equal(text, text2);
    ag_free(text);
    ag_free(text2);
    ag_compiled *cl = ag_compile_joint(loaded, NULL);
    assert_non_null(cl);
    ag_tensor *yl;
    assert_int_equal(ag_compiled_call_module(cl, mod, &v, 1, &yl, 1), 1);
    tu_assert_values(yl, 1, SZ(3), VALS(11, -12, 26), 0);
    ag_compiled_free(cl);
    ag_joint_free(loaded);
    ag_compiled *c = ag_compile_joint(j, NULL);
    assert_non_null(c);
    ag_tensor *yc, *ye = ag_mul(s, v);
    assert_int_equal(ag_compiled_call_module(c, mod, &v, 1, &yc, 1), 1);
    assert_same_values(yc, ye);
    /* The metadata is not a graph input: a different shift changes nothing in the graph. */
    tu_assert_values(yc, 1, SZ(3), VALS(11, -12, 26), 0);
    assert_int_equal(ag_backward(ag_sum_all(yc), NULL, false), 0);
    tu_assert_values(ag_tensor_grad(v), 1, SZ(3), VALS(11, 12, 13), 0);
    ag_compiled_free(c);
    ag_joint_free(j);
    ag_module_free(mod);

    /* A dispatch whose result contradicts the op's meta function is an error. */
    ag_tensor *bad = ag_subclass_new(&bad_type, F32, 1, SZ(3), NULL, &x, NULL);
    assert_null(ag_neg(bad));
    tu_assert_error_contains(
        "neg: Bad's dispatch returned f32[5] for output 0; the op gives f32[3]");
    ag_scope_end(); /* bad, v, ... were made inside the scope */
    /* Types are checked. */
    static const ag_subclass_type incomplete = {
        .name = "Incomplete", .ninner = 1, .attrs = shift_attrs};
    assert_null(ag_subclass_new(&incomplete, F32, 1, SZ(3), NULL, &x, NULL));
    tu_assert_error_contains("subclass type 'Incomplete' needs");
    assert_null(ag_subclass_new(&shift_type, F32, 1, SZ(3), NULL, &x, NULL));
    tu_assert_error_contains("Shifted needs 8 bytes of metadata, got NULL");
    ag_tensor_free(s);
    ag_tensor_free(x);
}

/* ---- the joint export ---- */

static ag_joint *export_zoo(const char *name, ag_module **m, ag_tensor **in, int *nin) {
    assert_int_equal(ag_zoo_build(name, NULL, m, in, 4, nin), 0);
    ag_joint *j = ag_export_joint(*m, in, *nin, NULL, NULL, 0, NULL);
    if (!j)
        fail_msg("export %s: %s", name, ag_last_error());
    return j;
}

#define W_A "SubclassGetAttrAOTInput(base=ParamAOTInput(target='weight'), attr='a')"
#define W_B "SubclassGetAttrAOTInput(base=ParamAOTInput(target='weight'), attr='b')"
#define B_A "SubclassGetAttrAOTInput(base=ParamAOTInput(target='bias'), attr='a')"
#define B_B "SubclassGetAttrAOTInput(base=ParamAOTInput(target='bias'), attr='b')"
#define T_A "SubclassGetAttrAOTInput(base=TangentAOTInput(output=PlainAOTOutput(idx=0)), attr='a')"
#define T_B "SubclassGetAttrAOTInput(base=TangentAOTInput(output=PlainAOTOutput(idx=0)), attr='b')"
#define O_A "SubclassGetAttrAOTOutput(base=PlainAOTOutput(idx=0), attr='a')"
#define O_B "SubclassGetAttrAOTOutput(base=PlainAOTOutput(idx=0), attr='b')"
#define GW(x)                                                                                      \
    "SubclassGetAttrAOTOutput(base=GradAOTOutput(grad_of=ParamAOTInput(target='weight')), "        \
    "attr='" x "')"
#define GB(x)                                                                                      \
    "SubclassGetAttrAOTOutput(base=GradAOTOutput(grad_of=ParamAOTInput(target='bias')), attr='" x  \
    "')"

/* two_tensor: upstream flattens each TwoTensor parameter into its a and b (primals), the
 * TwoTensor output and its tangent likewise, each TwoTensor gradient into a and b, and leaves
 * one None for x, which needs no gradient. */
static void test_two_tensor_joint_descriptors(void **st) {
    (void)st;
    ag_module *m;
    ag_tensor *in[4];
    int nin;
    ag_joint *j = export_zoo("two_tensor", &m, in, &nin);
    const ag_graph *g = ag_joint_graph(j);
    expect_placeholders(g,
                        (const char *[]){"primals_1", "primals_2", "primals_3", "primals_4",
                                         "primals_5", "tangents_1", "tangents_2"},
                        (const char *[]){W_A, W_B, B_A, B_B, "PlainAOTInput(idx=0)", T_A, T_B},
                        (const char *[]){"f32[2, 3]", "f32[2, 3]", "f32[2]", "f32[2]", "f32[4, 3]",
                                         "f32[4, 2]", "f32[4, 2]"},
                        7);
    expect_outputs(g, (const char *[]){O_A, O_B, GW("a"), GW("b"), GB("a"), GB("b"), "None"}, 7);
    /* The forward runs each op on the a halves, then on the b halves. */
    const ag_node *out = ag_graph_output_node(g);
    assert_string_equal(ag_node_name(ag_node_arg(out, 0)->u.nodes[0]), "addmm");
    assert_string_equal(ag_node_name(ag_node_arg(out, 0)->u.nodes[1]), "addmm_1");
    assert_int_equal(ag_joint_num_primals(j), 5);
    assert_int_equal(ag_joint_num_tangents(j), 2);
    assert_int_equal(ag_joint_num_user_outputs(j), 2);
    assert_int_equal(ag_joint_num_fw_outputs(j), 2);
    assert_true(ag_joint_needs_autograd(j));
    /* params_spec names the outer parameters; static inputs are their flattened primals. */
    assert_int_equal(ag_joint_num_params(j), 2);
    assert_string_equal(ag_joint_param_fqn(j, 0), "weight");
    assert_string_equal(ag_joint_param_fqn(j, 1), "bias");
    assert_int_equal(ag_joint_num_static_inputs(j), 4);
    assert_int_equal(ag_joint_static_input(j, 3), 3);
    assert_int_equal(ag_joint_static_input(j, 4), -1);
    assert_true(ag_joint_input_info(j, 0)->requires_grad);
    assert_false(ag_joint_input_info(j, 4)->requires_grad);
    char b[256];
    ag_treespec_repr(ag_joint_in_spec(j), b, sizeof b);
    assert_string_equal(b, "TreeSpec(tuple, None, [TreeSpec(list, None, [*, *, *]), "
                           "TreeSpec(dict, [], [])])");
    ag_treespec_repr(ag_joint_out_spec(j), b, sizeof b);
    assert_string_equal(b, "*");
    /* Backward nodes carry their forward op's seq_nr, the inner ops of one outer op included:
     * both forward addmms carry the same seq_nr, recorded for the one outer addmm. */
    const ag_node *a0 = ag_node_arg(out, 0)->u.nodes[0], *a1 = ag_node_arg(out, 0)->u.nodes[1];
    assert_true(ag_node_seq_nr(a0) >= 0);
    assert_int_equal(ag_node_seq_nr(a0), ag_node_seq_nr(a1));
    assert_int_equal(ag_graph_verify(g), 0);
    ag_joint_free(j);
    ag_module_free(m);
    for (int i = 0; i < nin; i++)
        ag_tensor_free(in[i]);
}

/* Partitioned (upstream's TwoTensor example, static shapes): the forward returns the output's
 * a and b and then the saved values; the backward's placeholders keep the joint's
 * descriptors. */
static void test_two_tensor_partitioned(void **st) {
    (void)st;
    ag_module *m;
    ag_tensor *in[4];
    int nin;
    ag_joint *j = export_zoo("two_tensor", &m, in, &nin);
    for (int p = 0; p < 2; p++) {
        ag_compile_opts co = {
            .partition = {.partitioner = p ? AG_PARTITION_MINCUT : AG_PARTITION_DEFAULT,
                          .memory_budget = 1.0}};
        ag_compiled *c = ag_compile_joint(j, &co);
        assert_non_null(c);
        expect_outputs(ag_compiled_forward_graph(c),
                       (const char *[]){O_A, O_B, "SavedForBackwardsAOTOutput(idx=0)"}, 3);
        expect_placeholders(ag_compiled_backward_graph(c),
                            (const char *[]){"primals_5", "tangents_1", "tangents_2"},
                            (const char *[]){"PlainAOTInput(idx=0)", T_A, T_B},
                            (const char *[]){"f32[4, 3]", "f32[4, 2]", "f32[4, 2]"}, 3);
        expect_outputs(ag_compiled_backward_graph(c),
                       (const char *[]){GW("a"), GW("b"), GB("a"), GB("b"), "None"}, 5);
        ag_compiled_free(c);
    }
    ag_joint_free(j);
    ag_module_free(m);
    for (int i = 0; i < nin; i++)
        ag_tensor_free(in[i]);
}

/* A TwoTensor parameter's inner tensors are static inputs to the min-cut, as the plain
 * parameter is (upstream's treat_parameters_as_free_to_save; static_input_indices count the
 * flattened primals): y = sin(w.sum(0)) + x saves w (free) and recomputes the sum in the
 * backward, rather than save the sum, which costs bytes (3 x 4 floats of w against 4 of the
 * sum, but the sum is one step nearer the backward and fused by its users, which doubles its
 * weight: 2 * 16 * 1.1 < 48 * 1.21). Each half of the TwoTensor makes the plain model's
 * decision. */
static int sin_sum_fwd(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)nin, (void)max_out;
    ag_scope_begin();
    out[0] =
        ag_tensor_keep(ag_add(ag_sin(ag_sum(ag_module_param(m, "w"), SZ(0), 1, false)), in[0]));
    ag_scope_end();
    return out[0] ? 1 : ag_last_status();
}

static ag_module *sin_sum_module(bool two, uint64_t *seed) {
    ag_module *m = ag_module_new("SinSum", sin_sum_fwd, NULL, NULL);
    ag_tensor *a = tu_rand_tensor(F32, 2, SZ(3, 4), -1, 1, tu_xorshift, seed);
    ag_tensor *b = tu_rand_tensor(F32, 2, SZ(3, 4), -1, 1, tu_xorshift, seed);
    ag_tensor *w = two ? ag_two_tensor(a, b) : ag_tensor_keep(a);
    assert_non_null(w);
    assert_int_equal(ag_module_register_parameter(m, "w", w), 0);
    ag_tensor_free(w);
    ag_tensor_free(a);
    ag_tensor_free(b);
    return m;
}

static void test_two_tensor_param_free_to_save(void **st) {
    (void)st;
    static const char *const descs[2][4] = {
        {"ParamAOTInput(target='w')", "TangentAOTInput(output=PlainAOTOutput(idx=0))"},
        {"SubclassGetAttrAOTInput(base=ParamAOTInput(target='w'), attr='a')",
         "SubclassGetAttrAOTInput(base=ParamAOTInput(target='w'), attr='b')", T_A, T_B}};
    for (int two = 0; two < 2; two++) {
        uint64_t s1 = 7, s2 = 7;
        ag_module *me = sin_sum_module(two, &s1), *mc = sin_sum_module(two, &s2);
        ag_tensor *x = tu_rand_tensor(F32, 1, SZ(4), -1, 1, tu_xorshift, &s1);
        ag_joint *j = ag_export_joint(mc, &x, 1, NULL, NULL, 0, NULL);
        if (!j)
            fail_msg("export: %s", ag_last_error());
        assert_int_equal(ag_joint_num_static_inputs(j), 1 + two);
        ag_compile_opts co = {.partition = {.partitioner = AG_PARTITION_MINCUT}};
        ag_compiled *c = ag_compile_joint(j, &co);
        if (!c)
            fail_msg("compile: %s", ag_last_error());
        /* The backward reads w (each of its halves) and the tangent: no sum was saved. */
        ag_node **ph;
        int nph = ag_graph_placeholders(ag_compiled_backward_graph(c), &ph);
        assert_int_equal(nph, 2 + 2 * two);
        for (int i = 0; i < nph; i++)
            if (strcmp(repr(ag_node_desc(ph[i])), descs[two][i]))
                fail_msg("%s: backward placeholder %d is %s, expected %s",
                         two ? "TwoTensor" : "plain", i, repr(ag_node_desc(ph[i])), descs[two][i]);
        /* The same decisions per half: one sum recomputed, w's 48 bytes saved. */
        const ag_partition_stats *ps = ag_compiled_stats(c);
        assert_int_equal(ps->saved_tensors, 1 + two);
        assert_int_equal(ps->saved_bytes, 48 * (1 + two));
        assert_int_equal(ps->recomputed_nodes, 1 + two);
        /* and the gradient eager computes */
        ag_scope_begin();
        ag_tensor *ye, *yc;
        assert_int_equal(ag_module_call(me, &x, 1, &ye, 1), 1);
        assert_int_equal(ag_compiled_call_module(c, mc, &x, 1, &yc, 1), 1);
        assert_true(rel(ye, yc) <= 1e-6);
        assert_int_equal(ag_backward(ag_sum_all(ag_mul(ye, ye)), NULL, false), 0);
        assert_int_equal(ag_backward(ag_sum_all(ag_mul(yc, yc)), NULL, false), 0);
        ag_scope_end();
        assert_true(rel(ag_tensor_grad(ag_module_param(me, "w")),
                        ag_tensor_grad(ag_module_param(mc, "w"))) <= 1e-6);
        ag_compiled_free(c);
        ag_joint_free(j);
        ag_module_free(me);
        ag_module_free(mc);
        ag_tensor_free(x);
    }
}

/* A TwoTensor user input that requires grad: its gradient is GradAOTOutput(PlainAOTInput(0))
 * flattened. */
static int sin_mul_fwd(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)nin, (void)max_out;
    ag_scope_begin();
    out[0] = ag_tensor_keep(ag_mul(ag_sin(in[0]), ag_module_param(m, "w")));
    ag_scope_end();
    return out[0] ? 1 : ag_last_status();
}

static ag_module *sin_mul_module(uint64_t *seed) {
    ag_module *m = ag_module_new("SinMul", sin_mul_fwd, NULL, NULL);
    ag_tensor *a = tu_rand_tensor(F32, 2, SZ(2, 3), -1, 1, tu_xorshift, seed);
    ag_tensor *b = tu_rand_tensor(F32, 2, SZ(2, 3), -1, 1, tu_xorshift, seed);
    ag_tensor *w = ag_two_tensor(a, b);
    assert_int_equal(ag_module_register_parameter(m, "w", w), 0);
    ag_tensor_free(w);
    ag_tensor_free(a);
    ag_tensor_free(b);
    return m;
}

static ag_tensor *two_leaf(uint64_t *seed) {
    ag_tensor *a = tu_rand_tensor(F32, 2, SZ(2, 3), -1, 1, tu_xorshift, seed);
    ag_tensor *b = tu_rand_tensor(F32, 2, SZ(2, 3), -1, 1, tu_xorshift, seed);
    ag_tensor *x = ag_two_tensor(a, b);
    ag_tensor_set_requires_grad(x, true);
    ag_tensor_free(a);
    ag_tensor_free(b);
    return x;
}

static void test_two_tensor_input_requires_grad(void **st) {
    (void)st;
    uint64_t s1 = 3, s2 = 3;
    ag_module *me = sin_mul_module(&s1), *mc = sin_mul_module(&s2);
    ag_tensor *xe = two_leaf(&s1), *xc = two_leaf(&s2);
    ag_joint *j = ag_export_joint(mc, &xc, 1, NULL, NULL, 0, NULL);
    assert_non_null(j);
    expect_placeholders(
        ag_joint_graph(j),
        (const char *[]){"primals_1", "primals_2", "primals_3", "primals_4", "tangents_1",
                         "tangents_2"},
        (const char *[]){"SubclassGetAttrAOTInput(base=ParamAOTInput(target='w'), attr='a')",
                         "SubclassGetAttrAOTInput(base=ParamAOTInput(target='w'), attr='b')",
                         "SubclassGetAttrAOTInput(base=PlainAOTInput(idx=0), attr='a')",
                         "SubclassGetAttrAOTInput(base=PlainAOTInput(idx=0), attr='b')", T_A, T_B},
        (const char *[]){"f32[2, 3]", "f32[2, 3]", "f32[2, 3]", "f32[2, 3]", "f32[2, 3]",
                         "f32[2, 3]"},
        6);
    expect_outputs(
        ag_joint_graph(j),
        (const char *[]){O_A, O_B,
                         "SubclassGetAttrAOTOutput(base=GradAOTOutput(grad_of=ParamAOTInput("
                         "target='w')), attr='a')",
                         "SubclassGetAttrAOTOutput(base=GradAOTOutput(grad_of=ParamAOTInput("
                         "target='w')), attr='b')",
                         "SubclassGetAttrAOTOutput(base=GradAOTOutput(grad_of=PlainAOTInput("
                         "idx=0)), attr='a')",
                         "SubclassGetAttrAOTOutput(base=GradAOTOutput(grad_of=PlainAOTInput("
                         "idx=0)), attr='b')"},
        6);
    ag_compiled *c = ag_compile_joint(j, NULL);
    assert_non_null(c);
    for (int step = 0; step < 2; step++) {
        ag_scope_begin();
        ag_tensor *ye, *yc;
        assert_int_equal(ag_module_call(me, &xe, 1, &ye, 1), 1);
        assert_int_equal(ag_compiled_call_module(c, mc, &xc, 1, &yc, 1), 1);
        assert_ptr_equal(ag_tensor_subclass(yc), ag_two_tensor_type());
        assert_string_equal(ag_tensor_grad_fn_name(yc), "SubclassWrapBackward");
        assert_true(rel(ye, yc) <= 1e-6);
        assert_int_equal(ag_backward(ag_sum_all(ag_mul_scalar(ye, 0.75)), NULL, false), 0);
        assert_int_equal(ag_backward(ag_sum_all(ag_mul_scalar(yc, 0.75)), NULL, false), 0);
        ag_scope_end();
        /* gradients accumulate over the two steps */
        assert_ptr_equal(ag_tensor_subclass(ag_tensor_grad(xc)), ag_two_tensor_type());
        assert_true(rel(ag_tensor_grad(xe), ag_tensor_grad(xc)) <= 1e-6);
        assert_true(rel(ag_tensor_grad(ag_module_param(me, "w")),
                        ag_tensor_grad(ag_module_param(mc, "w"))) <= 1e-6);
    }
    ag_compiled_free(c);
    ag_joint_free(j);
    ag_module_free(me);
    ag_module_free(mc);
    ag_tensor_free(xe);
    ag_tensor_free(xc);
}

/* Nested: a TwoTensor of TwoTensors flattens recursively, w.a.b being
 * SubclassGetAttrAOTInput(base=SubclassGetAttrAOTInput(base=ParamAOTInput(target='w'),
 * attr='a'), attr='b'), as upstream's recursive flatten_subclass. */
static int nested_fwd(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)nin, (void)max_out;
    ag_scope_begin();
    out[0] = ag_tensor_keep(ag_mul(ag_sin(in[0]), ag_module_param(m, "w")));
    ag_scope_end();
    return out[0] ? 1 : ag_last_status();
}

static void test_nested_two_tensor(void **st) {
    (void)st;
    uint64_t seed = 9;
    ag_tensor *p[4];
    for (int i = 0; i < 4; i++)
        p[i] = tu_rand_tensor(F32, 1, SZ(3), -1, 1, tu_xorshift, &seed);
    ag_tensor *ab = ag_two_tensor(p[0], p[1]), *cd = ag_two_tensor(p[2], p[3]);
    ag_tensor *w = ag_two_tensor(ab, cd);
    ag_module *m = ag_module_new("Nested", nested_fwd, NULL, NULL);
    assert_int_equal(ag_module_register_parameter(m, "w", w), 0);
    ag_tensor *x = tu_rand_tensor(F32, 1, SZ(3), -1, 1, tu_xorshift, &seed);
    ag_joint *j = ag_export_joint(m, &x, 1, NULL, NULL, 0, NULL);
    assert_non_null(j);
#define NW(x, y)                                                                                   \
    "SubclassGetAttrAOTInput(base=SubclassGetAttrAOTInput(base=ParamAOTInput(target='w'), "        \
    "attr='" x "'), attr='" y "')"
#define NG(x, y)                                                                                   \
    "SubclassGetAttrAOTOutput(base=SubclassGetAttrAOTOutput(base=GradAOTOutput(grad_of="           \
    "ParamAOTInput(target='w')), attr='" x "'), attr='" y "')"
    expect_placeholders(
        ag_joint_graph(j),
        (const char *[]){"primals_1", "primals_2", "primals_3", "primals_4", "primals_5",
                         "tangents_1", "tangents_2", "tangents_3", "tangents_4"},
        (const char *[]){NW("a", "a"), NW("a", "b"), NW("b", "a"), NW("b", "b"),
                         "PlainAOTInput(idx=0)",
                         "SubclassGetAttrAOTInput(base=SubclassGetAttrAOTInput(base="
                         "TangentAOTInput(output=PlainAOTOutput(idx=0)), attr='a'), "
                         "attr='a')",
                         "SubclassGetAttrAOTInput(base=SubclassGetAttrAOTInput(base="
                         "TangentAOTInput(output=PlainAOTOutput(idx=0)), attr='a'), "
                         "attr='b')",
                         "SubclassGetAttrAOTInput(base=SubclassGetAttrAOTInput(base="
                         "TangentAOTInput(output=PlainAOTOutput(idx=0)), attr='b'), "
                         "attr='a')",
                         "SubclassGetAttrAOTInput(base=SubclassGetAttrAOTInput(base="
                         "TangentAOTInput(output=PlainAOTOutput(idx=0)), attr='b'), "
                         "attr='b')"},
        (const char *[]){"f32[3]", "f32[3]", "f32[3]", "f32[3]", "f32[3]", "f32[3]", "f32[3]",
                         "f32[3]", "f32[3]"},
        9);
    const ag_node *out = ag_graph_output_node(ag_joint_graph(j));
    assert_string_equal(repr(ag_node_output_desc(out, 4)), NG("a", "a"));
    assert_string_equal(repr(ag_node_output_desc(out, 7)), NG("b", "b"));
    assert_string_equal(repr(ag_node_output_desc(out, 8)), "None");
#undef NW
#undef NG
    ag_compiled *c = ag_compile_joint(j, NULL);
    assert_non_null(c);
    ag_scope_begin();
    ag_tensor *yc, *ye = ag_mul(ag_sin(x), w);
    assert_int_equal(ag_compiled_call_module(c, m, &x, 1, &yc, 1), 1);
    assert_ptr_equal(ag_tensor_subclass(ag_subclass_attr(yc, "b")), ag_two_tensor_type());
    assert_true(rel(ye, yc) == 0);
    assert_int_equal(ag_backward(ag_sum_all(yc), NULL, false), 0);
    ag_tensor *g = ag_tensor_grad(w), *flat[8];
    assert_int_equal(ag_subclass_flatten_tensors(&g, 1, flat, 8), 4);
    assert_ptr_equal(ag_tensor_subclass(ag_subclass_attr(g, "a")), ag_two_tensor_type());
    for (int i = 0; i < 4; i++)
        for (int64_t e = 0; e < 3; e++) /* d sum(sin(x) * w) / dw = sin(x) */
            tu_assert_near(ag_tensor_item_at(flat[i], e), sin(ag_tensor_item_at(x, e)), 1e-6,
                           "grad", e);
    ag_scope_end();
    ag_compiled_free(c);
    ag_joint_free(j);
    ag_module_free(m);
    ag_tensor_free(x);
    ag_tensor_free(w);
    ag_tensor_free(ab);
    ag_tensor_free(cd);
    for (int i = 0; i < 4; i++)
        ag_tensor_free(p[i]);
}

/* A gradient must have its input's structure: a plain parameter multiplied by a TwoTensor
 * input gets a TwoTensor gradient, which the flattened convention cannot pair with it. */
static int mul_p_fwd(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)nin, (void)max_out;
    ag_scope_begin();
    out[0] = ag_tensor_keep(ag_mul(in[0], ag_module_param(m, "p")));
    ag_scope_end();
    return out[0] ? 1 : ag_last_status();
}

static void test_gradient_structure_mismatch(void **st) {
    (void)st;
    uint64_t seed = 5;
    ag_module *m = ag_module_new("MulP", mul_p_fwd, NULL, NULL);
    ag_tensor *p = tu_rand_tensor(F32, 2, SZ(2, 3), -1, 1, tu_xorshift, &seed);
    assert_int_equal(ag_module_register_parameter(m, "p", p), 0);
    ag_tensor *x = two_leaf(&seed);
    ag_tensor_set_requires_grad(x, false);
    assert_null(ag_export_joint(m, &x, 1, NULL, NULL, 0, NULL));
    assert_int_equal(ag_last_status(), AG_ENOTSUP);
    tu_assert_error_contains("export: the gradient of ParamAOTInput(target='p') is a TwoTensor but "
                             "the input is a plain tensor");
    ag_module_free(m);
    ag_tensor_free(p);
    ag_tensor_free(x);
}

/* A frozen ScaledInt8 weight (a buffer): its qdata and scale are primals; as upstream, the
 * buffer has one None gradient however many tensors it flattens into. */
static int qlinear_fwd(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)nin, (void)max_out;
    ag_scope_begin();
    ag_tensor *h =
        ag_relu(ag_linear(in[0], ag_module_buffer(m, "weight"), ag_module_param(m, "bias")));
    out[0] = ag_tensor_keep(ag_module_forward(ag_module_child(m, "head"), h));
    ag_scope_end();
    return out[0] ? 1 : ag_last_status();
}

static ag_module *qlinear_module(void) {
    ag_manual_seed(11);
    ag_module *m = ag_module_new("QuantLinear", qlinear_fwd, NULL, NULL);
    ag_tensor *w = ag_randn(F32, 2, SZ(5, 3));
    ag_tensor *q = ag_scaled_int8_quantize(w);
    ag_tensor *bias = ag_zeros(F32, 1, SZ(5));
    assert_int_equal(ag_module_register_buffer(m, "weight", q, true), 0);
    assert_int_equal(ag_module_register_parameter(m, "bias", bias), 0);
    assert_int_equal(ag_module_add_child(m, "head", ag_nn_linear(5, 2, true)), 0);
    ag_tensor_free(w);
    ag_tensor_free(q);
    ag_tensor_free(bias);
    return m;
}

static void test_scaled_int8_frozen_weight(void **st) {
    (void)st;
    ag_module *me = qlinear_module(), *mc = qlinear_module();
    ag_manual_seed(12);
    ag_tensor *x = ag_randn(F32, 2, SZ(4, 3));
    ag_joint *j = ag_export_joint(mc, &x, 1, NULL, NULL, 0, NULL);
    if (!j)
        fail_msg("export: %s", ag_last_error());
    expect_placeholders(
        ag_joint_graph(j),
        (const char *[]){"primals_1", "primals_2", "primals_3", "primals_4", "primals_5",
                         "primals_6", "tangents_1"},
        (const char *[]){
            "ParamAOTInput(target='bias')", "ParamAOTInput(target='head.weight')",
            "ParamAOTInput(target='head.bias')",
            "SubclassGetAttrAOTInput(base=BufferAOTInput(target='weight'), attr='qdata')",
            "SubclassGetAttrAOTInput(base=BufferAOTInput(target='weight'), attr='scale')",
            "PlainAOTInput(idx=0)", "TangentAOTInput(output=PlainAOTOutput(idx=0))"},
        (const char *[]){"f32[5]", "f32[2, 5]", "f32[2]", "i8[5, 3]", "f32[]", "f32[4, 3]",
                         "f32[4, 2]"},
        7);
    expect_outputs(ag_joint_graph(j),
                   (const char *[]){"PlainAOTOutput(idx=0)",
                                    "GradAOTOutput(grad_of=ParamAOTInput(target='bias'))",
                                    "GradAOTOutput(grad_of=ParamAOTInput(target='head.weight'))",
                                    "GradAOTOutput(grad_of=ParamAOTInput(target='head.bias'))",
                                    "None", "None"},
                   6);
    assert_int_equal(ag_joint_num_static_inputs(j), 5);
    /* The graph dequantizes: _to_copy of the int8 primal to float32, times the scale. */
    bool found = false;
    for (ag_node *n = ag_graph_first(ag_joint_graph(j)); n; n = ag_node_next(n))
        if (ag_node_kind_of(n) == AG_NODE_CALL && !strcmp(ag_op_name(ag_node_op(n)), "_to_copy") &&
            !strcmp(ag_node_name(ag_node_arg_node(n, 0)), "primals_4"))
            found = true;
    assert_true(found);
    for (int p = 0; p < 2; p++) {
        ag_compile_opts co = {
            .partition = {.partitioner = p ? AG_PARTITION_MINCUT : AG_PARTITION_DEFAULT,
                          .memory_budget = 1.0}};
        ag_compiled *c = ag_compile_joint(j, &co);
        assert_non_null(c);
        ag_optim *oe = ag_optim_sgd(me, 0.1, 0, 0, false), *oc = ag_optim_sgd(mc, 0.1, 0, 0, false);
        for (int step = 0; step < 3; step++) {
            ag_scope_begin();
            ag_tensor *ye, *yc;
            assert_int_equal(ag_module_call(me, &x, 1, &ye, 1), 1);
            assert_int_equal(ag_compiled_call_module(c, mc, &x, 1, &yc, 1), 1);
            assert_true(rel(ye, yc) <= 1e-6);
            assert_int_equal(ag_backward(ag_sum_all(ag_mul(ye, ye)), NULL, false), 0);
            assert_int_equal(ag_backward(ag_sum_all(ag_mul(yc, yc)), NULL, false), 0);
            ag_named_tensors pe, pc;
            assert_int_equal(ag_module_named_parameters(me, false, &pe), 0);
            assert_int_equal(ag_module_named_parameters(mc, false, &pc), 0);
            for (int i = 0; i < pe.n; i++)
                assert_true(rel(ag_tensor_grad(pe.tensors[i]), ag_tensor_grad(pc.tensors[i])) <=
                            1e-6);
            ag_named_tensors_free(&pe);
            ag_named_tensors_free(&pc);
            assert_int_equal(ag_optim_step(oe), 0);
            assert_int_equal(ag_optim_step(oc), 0);
            ag_optim_zero_grad(oe);
            ag_optim_zero_grad(oc);
            ag_scope_end();
        }
        ag_optim_free(oe);
        ag_optim_free(oc);
        ag_compiled_free(c);
    }
    ag_joint_free(j);
    /* Nothing requires grad: a forward-only joint, still flattened, compiled the same way. */
    ag_named_tensors ps;
    assert_int_equal(ag_module_named_parameters(mc, false, &ps), 0);
    for (int i = 0; i < ps.n; i++)
        ag_tensor_set_requires_grad(ps.tensors[i], false);
    ag_named_tensors_free(&ps);
    j = ag_export_joint(mc, &x, 1, NULL, NULL, 0, NULL);
    assert_non_null(j);
    assert_false(ag_joint_needs_autograd(j));
    assert_int_equal(ag_joint_num_primals(j), 6);
    expect_outputs(ag_joint_graph(j), (const char *[]){"PlainAOTOutput(idx=0)"}, 1);
    ag_compiled *c = ag_compile_joint(j, NULL);
    assert_non_null(c);
    ag_scope_begin();
    ag_tensor *ye, *yc;
    assert_int_equal(ag_module_call(mc, &x, 1, &ye, 1), 1);
    assert_int_equal(ag_compiled_call_module(c, mc, &x, 1, &yc, 1), 1);
    assert_same_values(ye, yc);
    assert_false(ag_tensor_requires_grad(yc));
    ag_scope_end();
    ag_compiled_free(c);
    ag_joint_free(j);
    ag_module_free(me);
    ag_module_free(mc);
    ag_tensor_free(x);
}

/* A TwoTensor buffer updated in place by the forward (a running count): each mutated inner
 * tensor is a forward output SubclassGetAttrAOTOutput(base=InputMutationAOTOutput(...), 'a'),
 * placed first, and the compiled callable writes it back into the caller's halves. */
static int count_fwd(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)nin, (void)max_out;
    ag_scope_begin();
    ag_tensor *c = ag_add_scalar_(ag_module_buffer(m, "count"), 1.0);
    out[0] = c ? ag_tensor_keep(ag_mul(in[0], ag_module_param(m, "w"))) : NULL;
    ag_scope_end();
    return out[0] ? 1 : ag_last_status();
}

static ag_module *count_module(void) {
    ag_module *m = ag_module_new("Count", count_fwd, NULL, NULL);
    ag_tensor *a = ag_zeros(F32, 1, SZ(2)), *b = ag_full(F32, 1, SZ(2), 10);
    ag_tensor *c = ag_two_tensor(a, b), *w = ag_full(F32, 1, SZ(2), 3);
    assert_int_equal(ag_module_register_buffer(m, "count", c, true), 0);
    assert_int_equal(ag_module_register_parameter(m, "w", w), 0);
    ag_tensor_free(a);
    ag_tensor_free(b);
    ag_tensor_free(c);
    ag_tensor_free(w);
    return m;
}

static void test_two_tensor_buffer_mutation(void **st) {
    (void)st;
    ag_module *me = count_module(), *mc = count_module();
    ag_tensor *x = tu_tensor(F32, 1, SZ(2), VALS(1, 2));
    ag_joint *j = ag_export_joint(mc, &x, 1, NULL, NULL, 0, NULL);
    if (!j)
        fail_msg("export: %s", ag_last_error());
    assert_int_equal(ag_joint_num_mutated_inputs(j), 2);
    assert_true(ag_joint_input_info(j, 1)->mutates_data && ag_joint_input_info(j, 2)->mutates_data);
    expect_outputs(
        ag_joint_graph(j),
        (const char *[]){"SubclassGetAttrAOTOutput(base=InputMutationAOTOutput(mutated_input="
                         "BufferAOTInput(target='count')), attr='a')",
                         "SubclassGetAttrAOTOutput(base=InputMutationAOTOutput(mutated_input="
                         "BufferAOTInput(target='count')), attr='b')",
                         "PlainAOTOutput(idx=0)",
                         "GradAOTOutput(grad_of=ParamAOTInput(target='w'))", "None", "None"},
        6);
    ag_compiled *c = ag_compile_joint(j, NULL);
    assert_non_null(c);
    ag_tensor *count = ag_module_buffer(mc, "count");
    uint64_t v0 = ag_tensor_version(count);
    for (int step = 0; step < 2; step++) {
        ag_scope_begin();
        ag_tensor *ye, *yc;
        assert_int_equal(ag_module_call(me, &x, 1, &ye, 1), 1);
        assert_int_equal(ag_compiled_call_module(c, mc, &x, 1, &yc, 1), 1);
        assert_same_values(ye, yc);
        ag_scope_end();
    }
    tu_assert_values(ag_subclass_attr(count, "a"), 1, SZ(2), VALS(2, 2), 0);
    tu_assert_values(ag_subclass_attr(count, "b"), 1, SZ(2), VALS(12, 12), 0);
    assert_true(ag_tensor_version(count) > v0); /* the outer tensor saw the write-back */
    assert_true(rel(ag_module_buffer(me, "count"), count) == 0);
    ag_compiled_free(c);
    ag_joint_free(j);
    ag_module_free(me);
    ag_module_free(mc);
    ag_tensor_free(x);
}

/* ---- compiled against eager ---- */

/* two_tensor for three SGD steps, each partitioner: outputs and TwoTensor gradients equal. */
static void test_two_tensor_compiled_sgd(void **st) {
    (void)st;
    const double budgets[] = {1.0, 0.0};
    for (int p = 0; p < 3; p++) {
        ag_module *me, *mc;
        ag_tensor *ie[4], *ic[4];
        int ne, nc;
        assert_int_equal(ag_zoo_build("two_tensor", NULL, &me, ie, 4, &ne), 0);
        ag_joint *j = export_zoo("two_tensor", &mc, ic, &nc);
        ag_compile_opts co = {
            .partition = {.partitioner = p ? AG_PARTITION_MINCUT : AG_PARTITION_DEFAULT,
                          .memory_budget = ag_memory_budget(budgets[p == 2])},
            .interpret = p == 0};
        ag_compiled *c = ag_compile_joint(j, &co);
        assert_non_null(c);
        ag_joint_free(j); /* the callable keeps what it needs */
        ag_optim *oe = ag_optim_sgd(me, 0.05, 0.9, 0, false),
                 *oc = ag_optim_sgd(mc, 0.05, 0.9, 0, false);
        for (int step = 0; step < 3; step++) {
            ag_scope_begin();
            ag_tensor *ye, *yc;
            assert_int_equal(ag_module_call(me, ie, ne, &ye, 1), 1);
            assert_int_equal(ag_compiled_call_module(c, mc, ic, nc, &yc, 1), 1);
            assert_ptr_equal(ag_tensor_subclass(yc), ag_two_tensor_type());
            assert_true(rel(ye, yc) <= 1e-6);
            assert_int_equal(ag_backward(ag_sum_all(ag_mul(ye, ye)), NULL, false), 0);
            assert_int_equal(ag_backward(ag_sum_all(ag_mul(yc, yc)), NULL, false), 0);
            for (int i = 0; i < 2; i++) {
                const char *fqn = i ? "bias" : "weight";
                ag_tensor *ge = ag_tensor_grad(ag_module_param(me, fqn));
                ag_tensor *gc = ag_tensor_grad(ag_module_param(mc, fqn));
                assert_ptr_equal(ag_tensor_subclass(gc), ag_two_tensor_type());
                if (!(rel(ge, gc) <= 1e-6))
                    fail_msg("partitioner %d step %d: grad of %s differs by %g", p, step, fqn,
                             rel(ge, gc));
            }
            assert_int_equal(ag_optim_step(oe), 0);
            assert_int_equal(ag_optim_step(oc), 0);
            ag_optim_zero_grad(oe);
            ag_optim_zero_grad(oc);
            ag_scope_end();
        }
        /* The parameters moved identically. */
        assert_true(rel(ag_module_param(me, "weight"), ag_module_param(mc, "weight")) <= 1e-6);
        ag_optim_free(oe);
        ag_optim_free(oc);
        ag_compiled_free(c);
        ag_module_free(me);
        ag_module_free(mc);
        for (int i = 0; i < ne; i++)
            ag_tensor_free(ie[i]);
        for (int i = 0; i < nc; i++)
            ag_tensor_free(ic[i]);
    }
}

/* Runtime errors: a plain tensor where the export saw a TwoTensor, a plain gradient for a
 * TwoTensor output; and no gradient at all is zeros. */
static void test_compiled_errors(void **st) {
    (void)st;
    ag_module *m;
    ag_tensor *in[4];
    int nin;
    ag_joint *j = export_zoo("two_tensor", &m, in, &nin);
    ag_compiled *c = ag_compile_joint(j, NULL);
    assert_non_null(c);
    ag_scope_begin();
    ag_tensor *w = ag_module_param(m, "weight"), *b = ag_module_param(m, "bias"), *y;
    ag_tensor *plain = ag_zeros(F32, 2, SZ(2, 3));
    assert_int_equal(ag_compiled_call(c, (ag_tensor *[]){plain, b, in[0]}, 3, &y, 1), AG_EINVAL);
    tu_assert_error_contains("compiled: ParamAOTInput(target='weight') (input 0) is a plain "
                             "tensor; expected a TwoTensor");
    assert_int_equal(ag_compiled_call(c, (ag_tensor *[]){w, b, w}, 3, &y, 1), AG_EINVAL);
    tu_assert_error_contains(
        "compiled: PlainAOTInput(idx=0) (input 2) is a TwoTensor; expected a plain tensor");
    assert_int_equal(ag_compiled_call(c, (ag_tensor *[]){w, b}, 2, &y, 1), AG_EINVAL);
    tu_assert_error_contains("compiled: 2 inputs given, the exported function takes 3");
    assert_int_equal(ag_compiled_call(c, (ag_tensor *[]){w, b, in[0]}, 3, &y, 1), 1);
    assert_int_equal(ag_backward(y, ag_ones(F32, 2, SZ(4, 2)), false), AG_EINVAL);
    tu_assert_error_contains("compiled: the gradient of output 0 is a plain tensor; expected a "
                             "TwoTensor");
    /* A gradient that reaches only the a half: the b half's tangent is zeros. */
    assert_int_equal(ag_compiled_call(c, (ag_tensor *[]){w, b, in[0]}, 3, &y, 1), 1);
    assert_int_equal(ag_backward(ag_sum_all(ag_subclass_attr(y, "a")), NULL, false), 0);
    ag_tensor *gw = ag_tensor_grad(w);
    assert_ptr_equal(ag_tensor_subclass(gw), ag_two_tensor_type());
    for (int64_t i = 0; i < 6; i++)
        assert_true(ag_tensor_item_at(ag_subclass_attr(gw, "b"), i) == 0);
    assert_true(fabs(ag_tensor_item_at(ag_subclass_attr(gw, "a"), 0)) > 0);
    ag_tensor_set_grad(w, NULL);
    ag_tensor_set_grad(b, NULL);
    /* Without grad mode the outputs take no part in autograd. */
    ag_set_grad_enabled(false);
    assert_int_equal(ag_compiled_call(c, (ag_tensor *[]){w, b, in[0]}, 3, &y, 1), 1);
    ag_set_grad_enabled(true);
    assert_false(ag_tensor_requires_grad(y));
    assert_ptr_equal(ag_tensor_subclass(y), ag_two_tensor_type());
    ag_scope_end();
    ag_compiled_free(c);
    ag_joint_free(j);
    ag_module_free(m);
    for (int i = 0; i < nin; i++)
        ag_tensor_free(in[i]);
}

/* ---- FX utilities, text format, ag_trace ---- */

static void test_fx_utils_refuse(void **st) {
    (void)st;
    ag_module *m;
    ag_tensor *in[4];
    int nin;
    ag_joint *j = export_zoo("two_tensor", &m, in, &nin);
    const ag_graph *g = ag_joint_graph(j);
    assert_null(ag_fx_all_input_and_grad_nodes(g));
    assert_int_equal(ag_last_status(), AG_ENOTSUP);
    tu_assert_error_contains(
        "ag_fx_all_input_and_grad_nodes: Subclasses are currently not supported by this function, "
        "but a desugared subclass input was found at primals_1 (" W_A ").  The problem is that "
        "there may not necessarily be a 1-1 correspondence between primals/tangents/outputs/grads "
        "when subclasses are involved: for example, the primal might be a plain tensor but the "
        "tangent a tensor subclass that desugared into multiple plain tensors. It is not clear "
        "what exactly you would like this function to do in this case (Collect all nodes for the "
        "subclass together?  Match up the inner nodes if subclasses match exactly?)  If you have "
        "a concrete use case, please file an issue so we can understand it and design an API "
        "that works for your case.");
    /* Outputs are looked at first: the first subclass output. */
    assert_null(ag_fx_all_output_and_tangent_nodes(g));
    tu_assert_error_contains("a desugared subclass input was found at addmm (" O_A ")");
    assert_null(ag_fx_param_and_grad_nodes(g));
    assert_null(ag_fx_plain_output_and_tangent_nodes(g));
    assert_null(ag_fx_named_param_nodes(g));
    tu_assert_error_contains(
        "found at primals_1 (" W_A ").  The problem is that there may not "
        "necessarily be a 1-1 correspondence between a FQN and a plain tensor");
    assert_int_equal(ag_fx_param_nodes(g, NULL, 0), AG_ENOTSUP);
    ag_joint_free(j);
    ag_module_free(m);
    for (int i = 0; i < nin; i++)
        ag_tensor_free(in[i]);
}

static void round_trip(const ag_graph *g) {
    char *s1 = ag_graph_to_string(g, NULL);
    assert_non_null(s1);
    ag_graph *p = ag_graph_parse(s1, strlen(s1));
    if (!p)
        fail_msg("parse: %s\n%s", ag_last_error(), s1);
    char *s2 = ag_graph_to_string(p, NULL);
    assert_string_equal(s1, s2);
    ag_node **a, **b;
    int na = ag_graph_placeholders(g, &a), nb = ag_graph_placeholders(p, &b);
    assert_int_equal(na, nb);
    for (int i = 0; i < na; i++)
        assert_true(ag_desc_equal(ag_node_desc(a[i]), ag_node_desc(b[i])));
    const ag_node *oa = ag_graph_output_node(g), *ob = ag_graph_output_node(p);
    for (int i = 0; i < ag_node_arg(oa, 0)->n; i++)
        assert_true(ag_desc_equal(ag_node_output_desc(oa, i), ag_node_output_desc(ob, i)));
    assert_int_equal(ag_graph_verify(p), 0);
    ag_free(s1);
    ag_free(s2);
    ag_graph_free(p);
}

static void test_text_round_trip(void **st) {
    (void)st;
    ag_module *m;
    ag_tensor *in[4];
    int nin;
    ag_joint *j = export_zoo("two_tensor", &m, in, &nin);
    round_trip(ag_joint_graph(j));
    /* A parsed graph can replace the joint's (same descriptors) and compile. */
    char *s = ag_graph_to_string(ag_joint_graph(j), NULL);
    assert_int_equal(ag_joint_set_graph(j, ag_graph_parse(s, strlen(s))), 0);
    ag_free(s);
    ag_compiled *c = ag_compile_joint(j, NULL);
    assert_non_null(c);
    ag_compiled_free(c);
    ag_joint_free(j);
    ag_module_free(m);
    for (int i = 0; i < nin; i++)
        ag_tensor_free(in[i]);
    /* int8 VALs and the int8 dtype argument. */
    ag_module *q = qlinear_module();
    ag_tensor *x = ag_zeros(F32, 2, SZ(4, 3));
    j = ag_export_joint(q, &x, 1, NULL, NULL, 0, NULL);
    assert_non_null(j);
    s = ag_graph_to_string(ag_joint_graph(j), NULL);
    assert_non_null(strstr(s, "%primals_4 : i8[5, 3]"));
    assert_non_null(strstr(s, "_to_copy(%primals_4, dtype=torch.float32)"));
    ag_free(s);
    round_trip(ag_joint_graph(j));
    ag_joint_free(j);
    ag_module_free(q);
    ag_tensor_free(x);
    /* int8 constants print and parse as ints. */
    const char *text = "graph():\n"
                       "    %c = get_attr(c)  # i8[3]\n"
                       "    %f = _to_copy(%c, dtype=torch.float32)  # f32[3]\n"
                       "    return (%f,)\n"
                       "constant c : i8[3] = [-128, 0, 127]\n";
    ag_graph *g = ag_graph_parse(text, strlen(text));
    if (!g)
        fail_msg("parse: %s", ag_last_error());
    ag_tensor *out[1];
    assert_int_equal(ag_graph_run(g, NULL, 0, out, 1), 1);
    tu_assert_values(out[0], 1, SZ(3), VALS(-128, 0, 127), 0);
    ag_tensor_free(out[0]);
    round_trip(g);
    ag_graph_free(g);
    text =
        "graph():\n    %c = get_attr(c)  # i8[1]\n    return (%c,)\nconstant c : i8[1] = [128]\n";
    assert_null(ag_graph_parse(text, strlen(text)));
    tu_assert_error_contains("expected an int8 (-128 .. 127)");
}

static void test_trace_refuses_instances(void **st) {
    (void)st;
    ag_module *m;
    ag_tensor *in[4];
    int nin;
    assert_int_equal(ag_zoo_build("two_tensor", NULL, &m, in, 4, &nin), 0);
    assert_null(ag_trace_module(m, in, nin, NULL));
    tu_assert_error_contains("trace: input 0 is a TwoTensor (a tensor subclass); ag_trace takes "
                             "plain tensors");
    /* Built in meta mode, the model exports the same graph. */
    ag_module *mm;
    ag_tensor *im[4];
    int nim;
    bool prev = ag_set_meta_mode(true);
    assert_int_equal(ag_zoo_build("two_tensor", NULL, &mm, im, 4, &nim), 0);
    ag_set_meta_mode(prev);
    assert_true(ag_is_meta(ag_subclass_attr(ag_module_param(mm, "weight"), "a")));
    ag_joint *j1 = ag_export_joint(m, in, nin, NULL, NULL, 0, NULL);
    ag_joint *j2 = ag_export_joint(mm, im, nim, NULL, NULL, 0, NULL);
    char *s1 = ag_graph_to_string(ag_joint_graph(j1), NULL),
         *s2 = ag_graph_to_string(ag_joint_graph(j2), NULL);
    assert_string_equal(s1, s2);
    ag_free(s1);
    ag_free(s2);
    ag_joint_free(j1);
    ag_joint_free(j2);
    ag_module_free(m);
    ag_module_free(mm);
    for (int i = 0; i < nin; i++)
        ag_tensor_free(in[i]);
    for (int i = 0; i < nim; i++)
        ag_tensor_free(im[i]);
}

/* ---- the CLI ---- */

static void test_cli(void **st) {
    (void)st;
    if (!tu_cli_setup("/tmp/ag_test_subclass_XXXXXX"))
        skip();
    assert_int_equal(tu_cli_run("export two_tensor"), 0);
    tu_cli_has("out", "%primals_1 : f32[2, 3]  # " W_A);
    tu_cli_has("out", "%tangents_2 : f32[4, 2]  # " T_B);
    tu_cli_has("out", GB("b") ", None]");
    assert_int_equal(tu_cli_run("descriptors two_tensor"), 0);
    tu_cli_has("out", "params_spec: ['weight', 'bias']");
    tu_cli_has("out", "  primals_2    " W_B "\n");
    tu_cli_has("out", "  t_6          " GW("a") "\n");
    tu_cli_has("out", "no input/grad or output/tangent pairs: ag_fx_all_input_and_grad_nodes: "
                      "Subclasses are currently not supported by this function");
    assert_int_equal(tu_cli_run("check two_tensor"), 0);
    tu_cli_has("out", "two_tensor (mincut, budget 1, 3 steps): max relative difference: outputs 0, "
                      "gradients 0, buffers 0, inputs 0 (tolerance 1e-05): OK");
    assert_int_equal(tu_cli_run("check two_tensor --partitioner default --budget 0.5"), 0);
    tu_cli_has("out", ": OK");
    assert_int_equal(tu_cli_run("models"), 0);
    tu_cli_has("out", "two_tensor");
    tu_cli_cleanup((const char *const[]){"out", "err"}, 2);
}

/* ---- allocation failures ---- */

static int oom_eager(void *ud) {
    (void)ud;
    int rc = 0;
    ag_scope_begin();
    ag_tensor *a = ag_full(F32, 2, SZ(2, 3), 0.5), *b = ag_full(F32, 2, SZ(2, 3), -0.25);
    ag_tensor *x = ag_ones(F32, 2, SZ(4, 3));
    ag_tensor *w = ag_two_tensor(a, b);
    if (!w || !x) {
        rc = ag_last_status();
        goto out;
    }
    ag_tensor_set_requires_grad(w, true);
    ag_tensor *loss = ag_sum_all(ag_relu(ag_mm(x, ag_t(w))));
    if (!loss || (rc = ag_backward(loss, NULL, false)))
        rc = rc ? rc : ag_last_status();
    else if (!ag_tensor_grad(w))
        rc = -99;
    ag_tensor *q = rc ? NULL : ag_scaled_int8_quantize(a);
    if (rc == 0 && !ag_mm(x, ag_t(q)))
        rc = ag_last_status();
out:
    tu_alloc_cleanup_begin();
    ag_scope_end();
    tu_alloc_cleanup_end();
    return rc;
}

static int oom_pipeline(void *ud) {
    (void)ud;
    ag_module *m = NULL;
    ag_tensor *in[4];
    int nin = 0;
    int rc = ag_zoo_build("two_tensor", NULL, &m, in, 4, &nin);
    ag_joint *j = rc ? NULL : ag_export_joint(m, in, nin, NULL, NULL, 0, NULL);
    ag_compiled *c = j ? ag_compile_joint(j, NULL) : NULL;
    if (rc == 0 && !c)
        rc = ag_last_status();
    if (rc == 0) {
        ag_scope_begin();
        ag_tensor *y;
        int n = ag_compiled_call_module(c, m, in, nin, &y, 1);
        ag_tensor *loss = n == 1 ? ag_sum_all(y) : NULL;
        rc = n < 0 ? n : !loss ? ag_last_status() : ag_backward(loss, NULL, false);
        tu_alloc_cleanup_begin();
        ag_scope_end();
        tu_alloc_cleanup_end();
    }
    tu_alloc_cleanup_begin();
    ag_compiled_free(c);
    ag_joint_free(j);
    ag_module_free(m);
    for (int i = 0; i < nin; i++)
        ag_tensor_free(in[i]);
    tu_alloc_cleanup_end();
    return rc;
}

static void test_allocation_failures(void **st) {
    (void)st;
    tu_sweep_opts o = {.what = "two_tensor eager", .one_thread = true};
    assert_true(tu_alloc_failure_sweep(oom_eager, NULL, &o) >= 50);
    o.what = "two_tensor export + compile + call + backward";
    int64_t n = tu_alloc_failure_sweep(oom_pipeline, NULL, &o);
    print_message("two_tensor pipeline: %lld allocation points\n", (long long)n);
    assert_true(n >= 200);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_two_tensor_eager_ops),
        cmocka_unit_test(test_two_tensor_errors),
        cmocka_unit_test(test_two_tensor_autograd),
        cmocka_unit_test(test_scaled_int8),
        cmocka_unit_test(test_user_type_with_metadata),
        cmocka_unit_test(test_two_tensor_joint_descriptors),
        cmocka_unit_test(test_two_tensor_partitioned),
        cmocka_unit_test(test_two_tensor_param_free_to_save),
        cmocka_unit_test(test_two_tensor_input_requires_grad),
        cmocka_unit_test(test_nested_two_tensor),
        cmocka_unit_test(test_gradient_structure_mismatch),
        cmocka_unit_test(test_scaled_int8_frozen_weight),
        cmocka_unit_test(test_two_tensor_buffer_mutation),
        cmocka_unit_test(test_two_tensor_compiled_sgd),
        cmocka_unit_test(test_compiled_errors),
        cmocka_unit_test(test_fx_utils_refuse),
        cmocka_unit_test(test_text_round_trip),
        cmocka_unit_test(test_trace_refuses_instances),
        cmocka_unit_test(test_cli),
        cmocka_unit_test(test_allocation_failures),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
