/* Hostile arguments to the op kernels and meta functions: what a graph file or a careless
 * caller can hand the dispatcher. Every case must end in a clean error naming the op (or in the
 * result PyTorch gives), never in an out-of-bounds access, an overflow or a silently truncated
 * argument; the sanitizer build runs these under ASan and UBSan.
 *
 * - backward helpers given a gradient of the wrong shape (slice_backward, select_backward,
 *   as_strided_scatter), directly and from graph text;
 * - tensors whose byte count overflows, views whose extent overflows or leaves the storage;
 * - a table of view ops with huge, negative and INT64_MIN arguments;
 * - dims beyond the int range (dim=4294967296 is out of range, not dim 0). */
#include "testutil.h"

#include <limits.h>
#include <math.h>
#include <string.h>

#define S(...) ((int64_t[]){__VA_ARGS__})
#define NS(...) ((int)(sizeof(S(__VA_ARGS__)) / sizeof(int64_t)))

/* The call failed with AG_EINVAL and a message containing needle. */
static void expect_einval(int rc, const char *needle) {
    if (rc >= 0)
        fail_msg("expected an error containing \"%s\", the call succeeded", needle);
    if (ag_last_status() != AG_EINVAL)
        fail_msg("expected AG_EINVAL (\"%s\"), got %d: %s", needle, ag_last_status(),
                 ag_last_error());
    tu_assert_error_contains(needle);
    ag_clear_error();
}

static int call(const char *op, const ag_arg *args, int n, ag_tensor **outs) {
    const ag_op *o = ag_op_find(op);
    if (!o)
        fail_msg("no op %s", op);
    return ag_op_call(o, args, n, outs);
}

/* Parsing must fail (the meta function refuses the node) with a message containing needle. */
static void expect_parse_error(const char *text, const char *needle) {
    ag_graph *g = ag_graph_parse(text, strlen(text));
    if (g) {
        ag_graph_free(g);
        fail_msg("graph parsed; expected an error containing \"%s\"\n%s", needle, text);
    }
    tu_assert_error_contains(needle);
    ag_clear_error();
}

/* ---- backward helpers with a gradient of the wrong shape ---- */

static void test_slice_backward_wrong_grad(void **st) {
    (void)st;
    ag_scope_begin();
    /* x[1:5:2] of a [5, 4] input is [2, 4]; a [2, 2] gradient used to be read as [2, 4]. */
    ag_tensor *g = ag_ones(AG_F32, 2, S(2, 2)), *out = NULL;
    ag_arg a[6] = {AG_A_T(g), AG_A_INTS(S(5, 4), 2), AG_A_I(0), AG_A_I(1), AG_A_I(5), AG_A_I(2)};
    expect_einval(call("slice_backward", a, 6, &out),
                  "slice_backward: grad_output of shape [2, 2] does not match the shape [2, 4]");
    assert_null(out);
    /* the right shape works and writes rows 1 and 3 */
    a[0] = AG_A_T(ag_ones(AG_F32, 2, S(2, 4)));
    assert_int_equal(call("slice_backward", a, 6, &out), 0);
    double want[20] = {0};
    for (int j = 0; j < 4; j++)
        want[4 + j] = want[12 + j] = 1;
    tu_assert_values(out, 2, S(5, 4), want, 0);
    /* step 0, a dim beyond int, negative and overflowing input_sizes */
    a[5] = AG_A_I(0);
    expect_einval(call("slice_backward", a, 6, &out),
                  "slice_backward: slice step must be positive");
    a[5] = AG_A_I(1);
    a[2] = AG_A_I(4294967296LL);
    expect_einval(call("slice_backward", a, 6, &out),
                  "slice_backward: Dimension out of range (expected to be in range of [-2, 1], "
                  "but got 4294967296)");
    a[2] = AG_A_I(0);
    a[1] = AG_A_INTS(S(-5, 4), 2);
    expect_einval(call("slice_backward", a, 6, &out), "slice_backward: output 0 has negative size");
    a[1] = AG_A_INTS(S(INT64_MAX, INT64_MAX), 2);
    expect_einval(call("slice_backward", a, 6, &out), "too many elements");
    a[1] = AG_A_INTS(S(5, 4), 0);
    expect_einval(call("slice_backward", a, 6, &out), "slice_backward: input_sizes [] must have");
    ag_scope_end();
}

static void test_select_backward_wrong_grad(void **st) {
    (void)st;
    ag_scope_begin();
    /* x[1] of a [3, 4] input is [4]; a [3] gradient used to be read as [4]. */
    ag_tensor *out = NULL;
    ag_arg a[4] = {AG_A_T(ag_ones(AG_F64, 1, S(3))), AG_A_INTS(S(3, 4), 2), AG_A_I(0), AG_A_I(1)};
    expect_einval(call("select_backward", a, 4, &out),
                  "select_backward: grad_output of shape [3] does not match the shape [4]");
    a[0] = AG_A_T(ag_ones(AG_F64, 1, S(4)));
    a[3] = AG_A_I(3);
    expect_einval(call("select_backward", a, 4, &out),
                  "select_backward: index 3 out of range for tensor of size 3 at dimension 0");
    a[3] = AG_A_I(INT64_MIN);
    expect_einval(call("select_backward", a, 4, &out), "select_backward: index");
    a[3] = AG_A_I(-1);
    a[2] = AG_A_I(-4294967296LL);
    expect_einval(call("select_backward", a, 4, &out),
                  "select_backward: Dimension out of range (expected to be in range of [-2, 1], "
                  "but got -4294967296)");
    a[2] = AG_A_I(0);
    assert_int_equal(call("select_backward", a, 4, &out), 0);
    tu_assert_values(out, 2, S(3, 4), ((double[]){0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1}), 0);
    ag_scope_end();
}

static void test_as_strided_scatter_bounds(void **st) {
    (void)st;
    ag_scope_begin();
    ag_tensor *self = ag_zeros(AG_F32, 1, S(6)), *out = NULL;
    /* a [4] view with stride 2 reaches element 6 of a 6-element self */
    ag_arg a[5] = {AG_A_T(self), AG_A_T(ag_ones(AG_F32, 1, S(4))), AG_A_INTS(S(4), 1),
                   AG_A_INTS(S(2), 1), AG_A_I(0)};
    expect_einval(call("as_strided_scatter", a, 5, &out),
                  "as_strided_scatter: sizes [4], strides [2] and storage offset 0 reach element "
                  "6, out of bounds for a storage of 6 elements");
    a[3] = AG_A_INTS(S(1), 1);
    a[4] = AG_A_I(-1);
    expect_einval(call("as_strided_scatter", a, 5, &out), "invalid storage offset -1");
    a[4] = AG_A_I(2);
    assert_int_equal(call("as_strided_scatter", a, 5, &out), 0);
    tu_assert_values(out, 1, S(6), ((double[]){0, 0, 1, 1, 1, 1}), 0);
    ag_scope_end();
}

static void test_backward_helpers_from_graph_text(void **st) {
    (void)st;
    expect_parse_error("graph():\n"
                       "    %g : f32[2, 2]\n"
                       "    %sb = slice_backward(%g, [5, 4], 0, 1, 5, 2)  # f32[5, 4]\n"
                       "    return (%sb)\n",
                       "slice_backward: grad_output of shape [2, 2] does not match");
    expect_parse_error("graph():\n"
                       "    %g : f32[3]\n"
                       "    %sb = select_backward(%g, [3, 4], 0, 1)  # f32[3, 4]\n"
                       "    return (%sb)\n",
                       "select_backward: grad_output of shape [3] does not match");
    expect_parse_error("graph():\n"
                       "    %g : f32[4]\n"
                       "    %sb = slice_backward(%g, [4], 0, 0, 4, 0)  # f32[4]\n"
                       "    return (%sb)\n",
                       "slice_backward: slice step must be positive");
    expect_parse_error("graph():\n"
                       "    %x : f32[3, 4]\n"
                       "    %t = transpose.int(%x, 4294967296, 1)  # f32[4, 3]{1, 4}\n"
                       "    return (%t)\n",
                       "transpose: Dimension out of range (expected to be in range of [-2, 1], "
                       "but got 4294967296)");
    /* a well-formed one still parses and runs */
    const char *ok = "graph():\n"
                     "    %g : f32[2, 4]\n"
                     "    %sb = slice_backward(%g, [5, 4], 0, 1, 5, 2)  # f32[5, 4]\n"
                     "    return (%sb)\n";
    ag_graph *g = ag_graph_parse(ok, strlen(ok));
    if (!g)
        fail_msg("%s", ag_last_error());
    ag_scope_begin();
    ag_tensor *in = ag_ones(AG_F32, 2, S(2, 4)), *out = NULL;
    assert_int_equal(ag_graph_run(g, &in, 1, &out, 1), 1);
    assert_float_equal(ag_tensor_item_at(out, 3 * 4 + 2), 1.0, 0);
    assert_float_equal(ag_tensor_item_at(out, 2 * 4 + 2), 0.0, 0);
    ag_scope_end();
    ag_graph_free(g);
}

/* ---- storage sizes and view extents ---- */

static void test_storage_size_overflow(void **st) {
    (void)st;
    /* 2^61 doubles are 2^64 bytes: the byte count used to wrap to a 0-byte storage. */
    double v = 0;
    ag_tensor *t = ag_from_data(AG_F64, 1, S((int64_t)1 << 61), &v);
    if (t)
        fail_msg("a [2^61] f64 tensor was made");
    expect_einval(-1, "storage size calculation overflowed with sizes=[2305843009213693952] and "
                      "dtype float64");
    assert_null(ag_from_data(AG_I8, 2, S((int64_t)1 << 40, (int64_t)1 << 40), &v));
    expect_einval(-1, "storage size calculation overflowed");
    assert_null(ag_from_data(AG_F32, 1, S(-3), &v));
    expect_einval(-1, "negative size -3");
    ag_scope_begin();
    assert_null(ag_empty(AG_F64, 1, S((int64_t)1 << 61)));
    expect_einval(-1, "too many elements");
    ag_scope_end();
}

static void test_as_strided_extent(void **st) {
    (void)st;
    ag_scope_begin();
    ag_tensor *x = ag_zeros(AG_F32, 1, S(8));
    /* an empty view with a huge stride used to pass (its extent was not computed), and a select
     * on it then computed 1 + INT64_MAX */
    assert_null(ag_as_strided(x, 2, S(2, 0), S(INT64_MAX, 1), 1));
    expect_einval(-1, "as_strided: sizes [2, 0], strides [9223372036854775807, 1] and storage "
                      "offset 1 reach element 9223372036854775807");
    assert_null(ag_as_strided(x, 2, S(3, 3), S(INT64_MAX / 2, INT64_MAX / 2), 0));
    expect_einval(-1, "out of bounds for a storage of 8 elements");
    assert_null(ag_as_strided(x, 1, S(-1), S(1), 0));
    expect_einval(-1, "as_strided: Trying to create tensor with negative dimension -1: [-1]");
    assert_null(ag_as_strided(x, 1, S(2), S(-1), 0));
    expect_einval(-1, "as_strided: Negative strides are not supported at the moment, got strides: "
                      "[-1]");
    ag_arg a[4] = {AG_A_T(x), AG_A_INTS(S(2), 1), AG_A_INTS(S(1), 1), AG_A_I(INT64_MIN)};
    ag_tensor *out = NULL;
    expect_einval(call("as_strided", a, 4, &out), "as_strided: Tensor: invalid storage offset");
    a[3] = AG_A_I(INT64_MAX);
    a[1] = AG_A_INTS(S(0), 1);
    expect_einval(call("as_strided", a, 4, &out), "reach element 9223372036854775807");
    a[1] = AG_A_INTS(S(2, 2), 2);
    expect_einval(call("as_strided", a, 4, &out), "mismatch in length of strides and shape");
    /* an empty view anywhere inside the bounds is fine, as in PyTorch */
    ag_tensor *e = ag_as_strided(x, 2, S(0, 3), S(100, 1), 20);
    assert_non_null(e);
    assert_int_equal(ag_tensor_numel(e), 0);
    /* views of views stay in bounds: a select on an unsqueezed empty view */
    ag_tensor *u = ag_unsqueeze(ag_as_strided(x, 2, S(0, 5), S(1, 1), 0), 2);
    assert_non_null(u);
    assert_non_null(ag_select(u, 1, 4));
    ag_scope_end();
}

/* ---- view ops with hostile arguments ---- */

typedef struct view_case {
    const char *op;
    const char *what;
    int nargs;
    ag_arg args[5];    /* args[0] is replaced by the [2, 3] input */
    const char *error; /* NULL: must succeed */
    int64_t want_ndim; /* on success: the result's shape */
    int64_t want_sizes[4];
} view_case;

#define I(x) AG_A_I(x)
#define L(...) AG_A_INTS(S(__VA_ARGS__), NS(__VA_ARGS__))
#define X AG_A_NONE
#define BIG 4294967296LL

static const view_case view_cases[] = {
    {"view", "-1 twice", 2, {X, L(-1, -1)}, "view: only one dimension can be inferred", 0, {0}},
    {"view", "-2", 2, {X, L(-2, -3)}, "view: invalid shape dimension -2", 0, {0}},
    {"view", "INT64_MIN", 2, {X, L(INT64_MIN)}, "view: invalid shape dimension", 0, {0}},
    {"view",
     "overflowing product",
     2,
     {X, L((int64_t)1 << 62, (int64_t)1 << 62)},
     "view: shape",
     0,
     {0}},
    {"view",
     "overflowing product with -1",
     2,
     {X, L((int64_t)1 << 62, 8, -1)},
     "view: shape",
     0,
     {0}},
    {"view", "zero with -1", 2, {X, L(0, -1)}, "view: shape [0, -1] is invalid", 0, {0}},
    {"view", "ok", 2, {X, L(3, -1)}, NULL, 2, {3, 2}},
    {"reshape",
     "-1 twice",
     2,
     {X, L(-1, 2, -1)},
     "reshape: only one dimension can be inferred",
     0,
     {0}},
    {"reshape", "huge", 2, {X, L(INT64_MAX, INT64_MAX, 0)}, "reshape: shape", 0, {0}},
    {"expand",
     "-2",
     2,
     {X, L(-2, 3)},
     "expand: Trying to create tensor with negative dimension -2",
     0,
     {0}},
    {"expand",
     "INT64_MIN leading",
     2,
     {X, L(INT64_MIN, 2, 3)},
     "expand: -1 not allowed in leading, non-existing dimension 0",
     0,
     {0}},
    {"expand",
     "huge",
     2,
     {X, L((int64_t)1 << 40, (int64_t)1 << 40, 2, 3)},
     "too many elements",
     0,
     {0}},
    {"expand", "too few", 2, {X, L(3)}, "expand: the number of sizes provided (1)", 0, {0}},
    {"permute", "repeated", 2, {X, L(0, 0)}, "permute: dim 0 repeated", 0, {0}},
    {"permute",
     "INT64_MIN",
     2,
     {X, L(INT64_MIN, 0)},
     "permute: Dimension out of range (expected to be in range of [-2, 1], but got "
     "-9223372036854775808)",
     0,
     {0}},
    {"permute", "2^32", 2, {X, L(BIG, 0)}, "permute: Dimension out of range", 0, {0}},
    {"permute", "wrong count", 2, {X, L(0)}, "permute: 1 dims given for a 2-d tensor", 0, {0}},
    {"transpose.int",
     "2^32",
     3,
     {X, I(BIG), I(1)},
     "transpose: Dimension out of range (expected to be in range of [-2, 1], but got 4294967296)",
     0,
     {0}},
    {"transpose.int", "2^32 + 1", 3, {X, I(0), I(BIG + 1)}, "but got 4294967297", 0, {0}},
    {"transpose.int",
     "INT64_MIN",
     3,
     {X, I(INT64_MIN), I(0)},
     "transpose: Dimension out of range",
     0,
     {0}},
    {"slice.Tensor",
     "dim 2^32",
     5,
     {X, I(BIG), I(0), I(1), I(1)},
     "slice: Dimension out of range (expected to be in range of [-2, 1], but got 4294967296)",
     0,
     {0}},
    {"slice.Tensor",
     "step 0",
     5,
     {X, I(0), I(0), I(2), I(0)},
     "slice: slice step must be positive",
     0,
     {0}},
    {"slice.Tensor",
     "step -1",
     5,
     {X, I(0), I(0), I(2), I(-1)},
     "slice: slice step must be positive",
     0,
     {0}},
    {"slice.Tensor",
     "step INT64_MIN",
     5,
     {X, I(0), I(0), I(2), I(INT64_MIN)},
     "slice: slice step must be positive",
     0,
     {0}},
    {"slice.Tensor",
     "INT64_MIN..INT64_MAX",
     5,
     {X, I(1), I(INT64_MIN), I(INT64_MAX), I(1)},
     NULL,
     2,
     {2, 3}},
    {"slice.Tensor",
     "INT64_MAX..INT64_MIN",
     5,
     {X, I(1), I(INT64_MAX), I(INT64_MIN), I(1)},
     NULL,
     2,
     {2, 0}},
    {"slice.Tensor", "step INT64_MAX", 5, {X, I(1), I(0), I(3), I(INT64_MAX)}, NULL, 2, {2, 1}},
    {"select.int", "index INT64_MIN", 3, {X, I(1), I(INT64_MIN)}, "select: index", 0, {0}},
    {"select.int", "index INT64_MAX", 3, {X, I(0), I(INT64_MAX)}, "select: index", 0, {0}},
    {"select.int",
     "dim 2^32",
     3,
     {X, I(BIG), I(0)},
     "select: Dimension out of range (expected to be in range of [-2, 1], but got 4294967296)",
     0,
     {0}},
    {"unsqueeze",
     "dim 2^32",
     2,
     {X, I(BIG)},
     "unsqueeze: Dimension out of range (expected to be in range of [-3, 2], but got 4294967296)",
     0,
     {0}},
    {"unsqueeze",
     "dim INT64_MIN",
     2,
     {X, I(INT64_MIN)},
     "unsqueeze: Dimension out of range",
     0,
     {0}},
    {"squeeze.dim",
     "dim -2^32 - 1",
     2,
     {X, I(-BIG - 1)},
     "squeeze: Dimension out of range (expected to be in range of [-2, 1], but got -4294967297)",
     0,
     {0}},
    {"as_strided",
     "negative size",
     4,
     {X, L(-1, 2), L(1, 1), I(0)},
     "as_strided: Trying to create tensor with negative dimension -1",
     0,
     {0}},
    {"as_strided",
     "size overflow",
     4,
     {X, L((int64_t)1 << 62, 4), L(1, 1), I(0)},
     "out of bounds for a storage of 6 elements",
     0,
     {0}},
    {"as_strided", "stride INT64_MAX", 4, {X, L(2), L(INT64_MAX), I(0)}, "out of bounds", 0, {0}},
    {"as_strided",
     "offset INT64_MIN",
     4,
     {X, L(1), L(1), I(INT64_MIN)},
     "invalid storage offset",
     0,
     {0}},
    {"as_strided",
     "sizes without strides",
     4,
     {X, L(2, 3), L(1), X},
     "as_strided: mismatch in length of strides and shape (2 sizes, 1 strides",
     0,
     {0}},
    {"t", "ok", 1, {X}, NULL, 2, {3, 2}},
    {"alias", "ok", 1, {X}, NULL, 2, {2, 3}},
    {"sum.dim_IntList",
     "dim 2^32",
     2,
     {X, L(BIG)},
     "sum: Dimension out of range (expected to be in range of [-2, 1], but got 4294967296)",
     0,
     {0}},
    {"_softmax",
     "dim 2^32",
     3,
     {X, I(BIG), AG_A_B(false)},
     "_softmax: Dimension out of range",
     0,
     {0}},
    {"argmax",
     "dim -2^32",
     3,
     {X, I(-BIG), AG_A_B(false)},
     "argmax: Dimension out of range",
     0,
     {0}},
};

static void test_view_ops_table(void **st) {
    (void)st;
    ag_scope_begin();
    ag_tensor *x = ag_arange(AG_F32, 0, 6, 1);
    x = ag_view(x, 2, S(2, 3));
    for (size_t i = 0; i < sizeof view_cases / sizeof view_cases[0]; i++) {
        const view_case *c = &view_cases[i];
        ag_arg a[5];
        memcpy(a, c->args, sizeof a);
        a[0] = AG_A_T(x);
        ag_tensor *out = NULL;
        int rc = call(c->op, a, c->nargs, &out);
        if (!c->error) {
            if (rc < 0)
                fail_msg("%s (%s): %s", c->op, c->what, ag_last_error());
            tu_assert_shape(out, (int)c->want_ndim, c->want_sizes);
            continue;
        }
        if (rc >= 0)
            fail_msg("%s (%s): succeeded, expected \"%s\"", c->op, c->what, c->error);
        if (ag_last_status() != AG_EINVAL || !strstr(ag_last_error(), c->error))
            fail_msg("%s (%s): got %d \"%s\", expected \"%s\"", c->op, c->what, ag_last_status(),
                     ag_last_error(), c->error);
        ag_clear_error();
    }
    ag_scope_end();
}

/* A negative list length from the C API is refused before any meta function sees it. */
static void test_negative_list_length(void **st) {
    (void)st;
    ag_scope_begin();
    ag_tensor *x = ag_zeros(AG_F32, 1, S(4)), *out = NULL;
    expect_einval(call("view", (ag_arg[]){AG_A_T(x), AG_A_INTS(S(4), -1)}, 2, &out),
                  "view: argument 'size' has a negative length -1");
    ag_scope_end();
}

/* ---- int64 arithmetic and conversions to integers ---- */

static ag_tensor *i64s(int n, const int64_t *v) {
    return ag_from_data(AG_I64, 1, (int64_t[]){n}, v);
}

static int64_t at(ag_tensor *t, int64_t i) {
    return ((const int64_t *)ag_tensor_data(t))[i];
}

/* Overflow wraps (two's complement) as PyTorch's integer tensors do; no undefined behaviour
 * (the sanitizer build halts on signed overflow). */
static void test_int64_wraps(void **st) {
    (void)st;
    ag_scope_begin();
    ag_tensor *big = i64s(3, S(INT64_MAX, INT64_MIN, -7));
    ag_tensor *one = i64s(3, S(1, 1, 1));
    ag_tensor *r = ag_add(big, one);
    assert_true(at(r, 0) == INT64_MIN && at(r, 1) == INT64_MIN + 1 && at(r, 2) == -6);
    r = ag_sub(big, ag_neg(one));
    assert_true(at(r, 0) == INT64_MIN);
    r = ag_sub(big, one);
    assert_true(at(r, 1) == INT64_MAX);
    r = ag_mul(big, i64s(3, S(2, -1, 3)));
    assert_true(at(r, 0) == -2 && at(r, 1) == INT64_MIN && at(r, 2) == -21);
    r = ag_neg(big);
    assert_true(at(r, 0) == -INT64_MAX && at(r, 1) == INT64_MIN && at(r, 2) == 7);
    r = ag_abs(big);
    assert_true(at(r, 0) == INT64_MAX && at(r, 1) == INT64_MIN && at(r, 2) == 7);
    r = ag_add_scalar(big, 1);
    assert_true(at(r, 0) == INT64_MIN);
    r = ag_mul_scalar(big, 2);
    assert_true(at(r, 1) == 0 && at(r, 2) == -14);
    r = ag_pow_scalar(i64s(2, S(3, (int64_t)1 << 32)), 2);
    assert_true(at(r, 0) == 9 && at(r, 1) == 0);
    /* add with alpha: x + alpha * y in int64 */
    r = ag_op_call1(ag_op_find("add.Tensor"), (ag_arg[]){AG_A_T(big), AG_A_T(one), AG_A_F(-2)}, 3);
    assert_true(at(r, 0) == INT64_MAX - 2 && at(r, 1) == INT64_MAX - 1 && at(r, 2) == -9);
    r = ag_sum_all(big);
    assert_int_equal(at(r, 0), -8); /* MAX + MIN - 7 */
    ag_scope_end();
}

static void test_int64_scalars_out_of_range(void **st) {
    (void)st;
    ag_scope_begin();
    ag_tensor *x = i64s(2, S(1, 2));
    assert_null(ag_add_scalar(x, 1e30));
    expect_einval(-1, "add: value 1e+30 cannot be converted to type int64 without overflow");
    assert_null(ag_mul_scalar(x, -1e19));
    expect_einval(-1, "mul: value -1e+19 cannot be converted to type int64");
    assert_null(
        ag_op_call1(ag_op_find("add.Tensor"), (ag_arg[]){AG_A_T(x), AG_A_T(x), AG_A_F(0x1p63)}, 3));
    expect_einval(-1, "add: value 9.22337e+18 cannot be converted to type int64");
    assert_null(ag_pow_scalar(x, 1e300));
    expect_einval(-1, "pow: value 1e+300 cannot be converted to type int64");
    assert_null(ag_full(AG_I64, 1, S(2), NAN));
    expect_einval(-1, "full: value nan cannot be converted to type int64");
    assert_null(ag_full(AG_I64, 1, S(2), INFINITY));
    expect_einval(-1, "full: value inf cannot be converted");
    assert_null(ag_masked_fill(x, ag_full(AG_BOOL, 1, S(2), 1), -1e20));
    expect_einval(-1, "masked_fill: value -1e+20 cannot be converted");
    assert_null(ag_arange(AG_I64, 0, 1e20, 1e18));
    expect_einval(-1, "arange: value 9.9e+19 cannot be converted to type int64");
    /* bounds beyond the range clamp nothing */
    ag_tensor *c = ag_clamp(i64s(2, S(INT64_MIN, INT64_MAX)), -1e30, 1e30);
    assert_true(at(c, 0) == INT64_MIN && at(c, 1) == INT64_MAX);
    ag_tensor *cn =
        ag_op_call1(ag_op_find("clamp"), (ag_arg[]){AG_A_T(x), AG_A_F(NAN), AG_A_NONE}, 3);
    assert_int_equal(ag_tensor_dtype(cn), AG_F32); /* a NaN bound makes it a float op */
    /* a comparison with an integer beyond int64 compares as doubles */
    ag_tensor *e = ag_lt_scalar(x, 1e30);
    assert_true(((const bool *)ag_tensor_data(e))[0] && ((const bool *)ag_tensor_data(e))[1]);
    ag_scope_end();
}

static void test_float_to_int_conversion(void **st) {
    (void)st;
    ag_scope_begin();
    ag_tensor *f = ag_from_data(AG_F32, 1, S(4), (float[]){1.5f, -2.5f, NAN, 3});
    assert_null(ag_to_dtype(f, AG_I64));
    expect_einval(-1, "_to_copy: cannot convert float32 value nan (element 2) to int64");
    ag_tensor *g = ag_from_data(AG_F64, 1, S(2), (double[]){1, 1e19});
    assert_null(ag_to_dtype(g, AG_I64));
    expect_einval(-1, "_to_copy: cannot convert float64 value 1e+19 (element 1) to int64");
    assert_null(ag_to_dtype(ag_from_data(AG_F64, 1, S(1), (double[]){-INFINITY}), AG_I8));
    expect_einval(-1, "to int8");
    assert_null(ag_to_dtype(ag_from_data(AG_F64, 1, S(1), (double[]){300}), AG_I8));
    expect_einval(-1, "_to_copy: cannot convert float64 value 300 (element 0) to int8");
    /* copy_ into an int64 tensor refuses before writing anything */
    ag_tensor *dst = i64s(2, S(7, 8));
    assert_null(ag_copy_(dst, g));
    expect_einval(-1, "copy_: cannot convert float64 value 1e+19");
    assert_true(at(dst, 0) == 7 && at(dst, 1) == 8);
    /* in range: truncation toward zero, as C and PyTorch */
    ag_tensor *ok = ag_to_dtype(ag_from_data(AG_F32, 1, S(2), (float[]){1.5f, -2.5f}), AG_I64);
    assert_true(at(ok, 0) == 1 && at(ok, 1) == -2);
    ag_scope_end();
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_slice_backward_wrong_grad),
        cmocka_unit_test(test_select_backward_wrong_grad),
        cmocka_unit_test(test_as_strided_scatter_bounds),
        cmocka_unit_test(test_backward_helpers_from_graph_text),
        cmocka_unit_test(test_storage_size_overflow),
        cmocka_unit_test(test_as_strided_extent),
        cmocka_unit_test(test_view_ops_table),
        cmocka_unit_test(test_negative_list_length),
        cmocka_unit_test(test_int64_wraps),
        cmocka_unit_test(test_int64_scalars_out_of_range),
        cmocka_unit_test(test_float_to_int_conversion),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
