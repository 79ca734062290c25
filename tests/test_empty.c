/* Empty tensors through every op family: a batch of 0, a 0-length reduced or softmax dim, an
 * all-ignored loss. The expected results are PyTorch's: an empty result of the right shape,
 * sum 0, mean and var NaN (0/0), logsumexp -inf, nll/cross-entropy 'mean' NaN, 'sum' 0, 'none'
 * empty, and the reductions that have no identity (argmax, amax) refused with PyTorch's
 * message. Backward runs through the autograd engine and must give gradients of the inputs'
 * shapes, zero where a parameter meets an empty batch. The sanitizer build runs this under
 * ASan and UBSan, which catch an integer division by an empty extent or a read past it; the
 * compiled path (export, partition, plan) is checked on the zoo's mlp, cnn, gpt2 and
 * dropout_mlp and on a linear + cross-entropy module, each with a batch of 0. argmin, max.dim,
 * min.dim, prod, std, var_mean, group_norm and nll_loss2d are not in the op table, so they are
 * not covered here. */
#include "testutil.h"

#include <math.h>
#include <string.h>

#define S(...) ((int64_t[]){__VA_ARGS__})
#define V(...) ((double[]){__VA_ARGS__})

/* Extra tensors a case's forward uses besides its input (made in each case's scope). */
static ag_tensor *P[4];

/* Every element of t is `fill` (NaN matches NaN). */
static void assert_all(const ag_tensor *t, double fill, const char *what) {
    int64_t n = ag_tensor_numel(t);
    for (int64_t i = 0; i < n; i++) {
        double v = ag_tensor_item_at(t, i);
        bool ok = isnan(fill) ? isnan(v) : v == fill;
        if (!ok)
            fail_msg("%s: element %lld is %g, expected %g", what, (long long)i, v, fill);
    }
}

/* ---- the forward functions of the table (x is the case's input, a leaf) ---- */

static ag_tensor *f_softmax1(ag_tensor *x) {
    return ag_softmax(x, 1);
}
static ag_tensor *f_softmax0(ag_tensor *x) {
    return ag_softmax(x, 0);
}
static ag_tensor *f_softmax_last(ag_tensor *x) {
    return ag_softmax(x, -1);
}
static ag_tensor *f_log_softmax1(ag_tensor *x) {
    return ag_log_softmax(x, 1);
}
static ag_tensor *f_log_softmax0(ag_tensor *x) {
    return ag_log_softmax(x, 0);
}
static ag_tensor *f_log_softmax_last(ag_tensor *x) {
    return ag_log_softmax(x, -1);
}
static ag_tensor *f_sum0(ag_tensor *x) {
    return ag_sum(x, S(0), 1, false);
}
static ag_tensor *f_sum_all(ag_tensor *x) {
    return ag_sum_all(x);
}
static ag_tensor *f_mean0(ag_tensor *x) {
    return ag_mean(x, S(0), 1, false);
}
static ag_tensor *f_mean1(ag_tensor *x) {
    return ag_mean(x, S(1), 1, true);
}
static ag_tensor *f_mean_all(ag_tensor *x) {
    return ag_mean_all(x);
}
static ag_tensor *f_var0(ag_tensor *x) {
    return ag_var(x, S(0), 1, 1.0, false);
}
static ag_tensor *f_var0_c0(ag_tensor *x) {
    return ag_var(x, S(0), 1, 0.0, false);
}
static ag_tensor *f_var_all(ag_tensor *x) {
    return ag_var(x, NULL, 0, 1.0, false);
}
static ag_tensor *f_lse0(ag_tensor *x) {
    return ag_logsumexp(x, S(0), 1, false);
}
static ag_tensor *f_amax1(ag_tensor *x) {
    return ag_amax(x, S(1), 1, false);
}
static ag_tensor *f_argmax1(ag_tensor *x) {
    return ag_argmax(x, 1, false);
}
static ag_tensor *f_argmax1_keep(ag_tensor *x) {
    return ag_argmax(x, 1, true);
}
static ag_tensor *f_relu(ag_tensor *x) {
    return ag_relu(x);
}
static ag_tensor *f_gelu(ag_tensor *x) {
    return ag_gelu(x, "none");
}
static ag_tensor *f_gelu_tanh(ag_tensor *x) {
    return ag_gelu(x, "tanh");
}
static ag_tensor *f_dropout(ag_tensor *x) {
    return ag_dropout(x, 0.5, true);
}

static ag_tensor *f_nll(ag_tensor *x, int red) {
    ag_tensor *t = ag_zeros(AG_I64, 1, S(ag_tensor_size(x, 0)));
    return ag_nll_loss(x, t, red, -100);
}
static ag_tensor *f_nll_mean(ag_tensor *x) {
    return f_nll(x, AG_REDUCTION_MEAN);
}
static ag_tensor *f_nll_sum(ag_tensor *x) {
    return f_nll(x, AG_REDUCTION_SUM);
}
static ag_tensor *f_nll_none(ag_tensor *x) {
    return f_nll(x, AG_REDUCTION_NONE);
}
static ag_tensor *f_ce(ag_tensor *x, int red) {
    ag_tensor *t = ag_zeros(AG_I64, 1, S(ag_tensor_size(x, 0)));
    return ag_cross_entropy(x, t, red, -100);
}
static ag_tensor *f_ce_mean(ag_tensor *x) {
    return f_ce(x, AG_REDUCTION_MEAN);
}
static ag_tensor *f_ce_sum(ag_tensor *x) {
    return f_ce(x, AG_REDUCTION_SUM);
}
static ag_tensor *f_ce_none(ag_tensor *x) {
    return f_ce(x, AG_REDUCTION_NONE);
}
/* every target ignored: (2, 3) log-probs, targets -100 */
static ag_tensor *f_nll_ignored(ag_tensor *x, int red, bool ce) {
    ag_tensor *t = ag_full(AG_I64, 1, S(ag_tensor_size(x, 0)), -100);
    return ce ? ag_cross_entropy(x, t, red, -100) : ag_nll_loss(x, t, red, -100);
}
static ag_tensor *f_nll_ign_mean(ag_tensor *x) {
    return f_nll_ignored(x, AG_REDUCTION_MEAN, 0);
}
static ag_tensor *f_nll_ign_sum(ag_tensor *x) {
    return f_nll_ignored(x, AG_REDUCTION_SUM, 0);
}
static ag_tensor *f_ce_ign_mean(ag_tensor *x) {
    return f_nll_ignored(x, AG_REDUCTION_MEAN, 1);
}
static ag_tensor *f_ce_ign_sum(ag_tensor *x) {
    return f_nll_ignored(x, AG_REDUCTION_SUM, 1);
}

static ag_tensor *f_layer_norm(ag_tensor *x) {
    return ag_layer_norm(x, 1, S(ag_tensor_size(x, -1)), P[0], P[1], 1e-5);
}
static ag_tensor *f_layer_norm_nw(ag_tensor *x) {
    return ag_layer_norm(x, 1, S(ag_tensor_size(x, -1)), NULL, NULL, 1e-5);
}
static ag_tensor *f_batch_norm(ag_tensor *x, bool training) {
    ag_tensor *out = NULL, *sm = NULL, *si = NULL;
    if (ag_native_batch_norm(x, P[0], P[1], P[2], P[3], training, 0.1, 1e-5, &out, &sm, &si) < 0)
        return NULL;
    return out;
}
static ag_tensor *f_bn_train(ag_tensor *x) {
    return f_batch_norm(x, true);
}
static ag_tensor *f_bn_eval(ag_tensor *x) {
    return f_batch_norm(x, false);
}
static ag_tensor *f_conv(ag_tensor *x) {
    return ag_conv2d(x, P[0], P[1], S(1, 1), S(1, 1), S(1, 1), 1);
}
static ag_tensor *f_max_pool(ag_tensor *x) {
    return ag_max_pool2d(x, S(2, 2), S(2, 2), S(0, 0));
}
static ag_tensor *f_avg_pool(ag_tensor *x) {
    return ag_avg_pool2d(x, S(2, 2), S(2, 2), S(0, 0), false, true);
}
static ag_tensor *f_adaptive_pool(ag_tensor *x) {
    return ag_adaptive_avg_pool2d(x, S(2, 2));
}
static ag_tensor *f_linear(ag_tensor *x) {
    return ag_linear(x, P[0], P[1]);
}
static ag_tensor *f_mm(ag_tensor *x) {
    return ag_mm(x, P[0]);
}
static ag_tensor *f_bmm(ag_tensor *x) {
    return ag_bmm(x, P[0]);
}
static ag_tensor *f_matmul(ag_tensor *x) {
    return ag_matmul(x, P[0]);
}
static ag_tensor *f_embedding(ag_tensor *x) {
    return ag_embedding(x, P[0]);
}
static ag_tensor *f_sdpa(ag_tensor *x) {
    return ag_scaled_dot_product_attention(x, x, x, false, 0);
}
static ag_tensor *f_sdpa_causal(ag_tensor *x) {
    return ag_scaled_dot_product_attention(x, x, x, true, 0);
}

static ag_tensor *f_softmax_t(ag_tensor *x) {
    return ag_softmax(ag_transpose(x, 0, 1), 1);
}
static ag_tensor *f_log_softmax_t0(ag_tensor *x) {
    return ag_log_softmax(ag_transpose(x, 0, 1), 0);
}
static ag_tensor *f_argmax_t(ag_tensor *x) {
    return ag_argmax(ag_transpose(x, 0, 1), 1, false);
}
static ag_tensor *f_lse_keep(ag_tensor *x) {
    return ag_logsumexp(x, S(0, 1), 2, true);
}
static ag_tensor *f_sum_t(ag_tensor *x) {
    return ag_sum(ag_transpose(x, 0, 1), S(1), 1, false);
}
static ag_tensor *f_index_select0(ag_tensor *x) {
    return ag_index_select(x, 0, P[0]);
}
static ag_tensor *f_index_select1(ag_tensor *x) {
    return ag_index_select(x, 1, P[0]);
}
static ag_tensor *f_gather1(ag_tensor *x) {
    return ag_gather(x, 1, P[0]);
}
static ag_tensor *f_index0(ag_tensor *x) {
    return ag_index(x, (ag_tensor *const[]){P[0]}, 1);
}
static ag_tensor *f_index_add(ag_tensor *x) {
    return ag_index_add(x, 0, P[0], ag_zeros(AG_F32, 2, S(0, ag_tensor_size(x, 1))), 1);
}
static ag_tensor *f_scatter_add(ag_tensor *x) {
    return ag_scatter_add(x, 0, P[0], ag_zeros(AG_F32, 2, S(0, ag_tensor_size(x, 1))));
}
static ag_tensor *f_cat(ag_tensor *x) {
    return ag_cat((ag_tensor *const[]){x, P[0]}, 2, 0);
}

/* The extra tensors: P[k] of shape psz[k] filled with pfill[k], requires grad when pgrad. */
typedef struct ecase {
    const char *name;
    ag_tensor *(*fn)(ag_tensor *x);
    int xnd;
    int64_t xs[4];
    int ond;
    int64_t os[4];
    double fill; /* every output element (none when the output is empty) */
    bool grad;   /* differentiable in x: backward of sum(out) gives x a gradient of zeros */
    int np;
    int pnd[4];
    int64_t ps[4][4];
    double pfill[4];
    bool pgrad[4]; /* backward gives P[k] a gradient of zeros */
    bool pint;     /* P[0] is an i64 index tensor */
    ag_dtype dt;   /* of x: AG_F32 unless given */
    double gfill;  /* every element of x's gradient: 0 unless given */
} ecase;

#define X(...) .xnd = NS(__VA_ARGS__), .xs = {__VA_ARGS__}
#define O(...) .ond = NS(__VA_ARGS__), .os = {__VA_ARGS__}
#define O0 .ond = 0, .os = {0}
#define NS(...) ((int)(sizeof(S(__VA_ARGS__)) / sizeof(int64_t)))

static const ecase cases[] = {
    /* softmax and log_softmax: a batch of 0, a 0-length dim, both */
    {"softmax batch 0", f_softmax1, X(0, 5), O(0, 5), 0, true},
    {"softmax over a 0-length dim", f_softmax1, X(3, 0), O(3, 0), 0, true},
    {"softmax over the 0-sized batch dim", f_softmax0, X(0, 5), O(0, 5), 0, true},
    {"softmax 3-d, empty middle", f_softmax_last, X(2, 0, 3), O(2, 0, 3), 0, true},
    {"log_softmax batch 0", f_log_softmax1, X(0, 5), O(0, 5), 0, true},
    {"log_softmax over a 0-length dim", f_log_softmax1, X(3, 0), O(3, 0), 0, true},
    {"log_softmax over the 0-sized batch dim", f_log_softmax0, X(0, 5), O(0, 5), 0, true},
    {"log_softmax 3-d, empty last", f_log_softmax_last, X(2, 3, 0), O(2, 3, 0), 0, true},
    /* reductions with an identity or a defined empty value */
    {"sum over an empty dim", f_sum0, X(0, 4), O(4), 0, true},
    {"sum of everything", f_sum_all, X(0, 4), O0, 0, true},
    {"mean over an empty dim", f_mean0, X(0, 4), O(4), NAN, true},
    {"mean over a full dim of an empty tensor", f_mean1, X(0, 4), O(0, 1), 0, true},
    {"mean of everything", f_mean_all, X(3, 0), O0, NAN, true},
    {"var over an empty dim", f_var0, X(0, 4), O(4), NAN, true},
    {"var (correction 0) over an empty dim", f_var0_c0, X(0, 4), O(4), NAN, true},
    {"var of everything", f_var_all, X(2, 0, 3), O0, NAN, true},
    {"logsumexp over an empty dim", f_lse0, X(0, 4), O(4), -INFINITY, true},
    {"amax over a full dim of an empty tensor", f_amax1, X(0, 4), O(0), 0, true},
    {"argmax over a full dim of an empty tensor", f_argmax1, X(0, 4), O(0), 0, false},
    {"argmax keepdim of an empty tensor", f_argmax1_keep, X(0, 4), O(0, 1), 0, false},
    /* pointwise */
    {"relu batch 0", f_relu, X(0, 4), O(0, 4), 0, true},
    {"gelu batch 0", f_gelu, X(0, 4), O(0, 4), 0, true},
    {"gelu tanh batch 0", f_gelu_tanh, X(0, 4), O(0, 4), 0, true},
    {"dropout batch 0", f_dropout, X(0, 4), O(0, 4), 0, true},
    /* losses: batch 0 and every target ignored */
    {"nll_loss mean batch 0", f_nll_mean, X(0, 5), O0, NAN, true},
    {"nll_loss sum batch 0", f_nll_sum, X(0, 5), O0, 0, true},
    {"nll_loss none batch 0", f_nll_none, X(0, 5), O(0), 0, true},
    {"cross_entropy mean batch 0", f_ce_mean, X(0, 5), O0, NAN, true},
    {"cross_entropy sum batch 0", f_ce_sum, X(0, 5), O0, 0, true},
    {"cross_entropy none batch 0", f_ce_none, X(0, 5), O(0), 0, true},
    {"nll_loss mean, every target ignored", f_nll_ign_mean, X(2, 3), O0, NAN, true},
    {"nll_loss sum, every target ignored", f_nll_ign_sum, X(2, 3), O0, 0, true},
    {"cross_entropy mean, every target ignored", f_ce_ign_mean, X(2, 3), O0, NAN, true},
    {"cross_entropy sum, every target ignored", f_ce_ign_sum, X(2, 3), O0, 0, true},
    /* normalization */
    {"layer_norm batch 0",
     f_layer_norm,
     X(0, 4),
     O(0, 4),
     0,
     true,
     2,
     {1, 1},
     {{4}, {4}},
     {1, 0},
     {true, true}},
    {"layer_norm batch 0, no affine", f_layer_norm_nw, X(0, 3, 4), O(0, 3, 4), 0, true},
    {"layer_norm over a 0-length dim", f_layer_norm_nw, X(3, 0), O(3, 0), 0, true},
    {"batch_norm training batch 0",
     f_bn_train,
     X(0, 3),
     O(0, 3),
     0,
     true,
     4,
     {1, 1, 1, 1},
     {{3}, {3}, {3}, {3}},
     {1, 0, 0.5, 2},
     {true, true}},
    {"batch_norm training 4-d batch 0",
     f_bn_train,
     X(0, 3, 2, 2),
     O(0, 3, 2, 2),
     0,
     true,
     4,
     {1, 1, 1, 1},
     {{3}, {3}, {3}, {3}},
     {1, 0, 0.5, 2},
     {true, true}},
    {"batch_norm eval batch 0",
     f_bn_eval,
     X(0, 3),
     O(0, 3),
     0,
     true,
     4,
     {1, 1, 1, 1},
     {{3}, {3}, {3}, {3}},
     {1, 0, 0.5, 2},
     {true, true}},
    /* convolution and pooling */
    {"conv2d batch 0",
     f_conv,
     X(0, 2, 5, 5),
     O(0, 3, 5, 5),
     0,
     true,
     2,
     {4, 1},
     {{3, 2, 3, 3}, {3}},
     {0.5, 1},
     {true, true}},
    {"max_pool2d batch 0", f_max_pool, X(0, 2, 4, 4), O(0, 2, 2, 2), 0, true},
    {"avg_pool2d batch 0", f_avg_pool, X(0, 2, 4, 4), O(0, 2, 2, 2), 0, true},
    {"adaptive_avg_pool2d batch 0", f_adaptive_pool, X(0, 2, 4, 4), O(0, 2, 2, 2), 0, true},
    /* matrix products: a batch of 0, and a 0-length inner dim (zeros, as PyTorch) */
    {"linear batch 0",
     f_linear,
     X(0, 4),
     O(0, 3),
     0,
     true,
     2,
     {2, 1},
     {{3, 4}, {3}},
     {1, 1},
     {true, true}},
    {"linear 3-d batch 0",
     f_linear,
     X(0, 2, 4),
     O(0, 2, 3),
     0,
     true,
     2,
     {2, 1},
     {{3, 4}, {3}},
     {1, 1},
     {true, true}},
    {"mm batch 0", f_mm, X(0, 4), O(0, 3), 0, true, 1, {2}, {{4, 3}}, {1}, {true}},
    {"mm inner 0", f_mm, X(2, 0), O(2, 3), 0, true, 1, {2}, {{0, 3}}, {1}, {true}},
    {"bmm batch 0", f_bmm, X(0, 2, 3), O(0, 2, 4), 0, true, 1, {3}, {{0, 3, 4}}, {1}, {true}},
    {"bmm inner 0", f_bmm, X(2, 3, 0), O(2, 3, 4), 0, true, 1, {3}, {{2, 0, 4}}, {1}, {true}},
    {"matmul batch 0", f_matmul, X(0, 4), O(0, 3), 0, true, 1, {2}, {{4, 3}}, {1}, {true}},
    {"matmul 3-d batch 0",
     f_matmul,
     X(2, 0, 4),
     O(2, 0, 3),
     0,
     true,
     1,
     {2},
     {{4, 3}},
     {1},
     {true}},
    {"matmul inner 0", f_matmul, X(2, 2, 0), O(2, 2, 3), 0, true, 1, {2}, {{0, 3}}, {1}, {true}},
    /* embedding: x is the weight, P[0] the (empty) indices */
    {"embedding of no indices",
     f_embedding,
     X(5, 3),
     O(0, 3),
     0,
     true,
     1,
     {1},
     {{0}},
     {0},
     {false},
     true},
    {"embedding of a (2, 0) index",
     f_embedding,
     X(5, 3),
     O(2, 0, 3),
     0,
     true,
     1,
     {2},
     {{2, 0}},
     {0},
     {false},
     true},
    /* float64, non-contiguous and integer inputs */
    {"softmax f64 batch 0", f_softmax1, X(0, 5), O(0, 5), 0, true, .dt = AG_F64},
    {"log_softmax f64 over a 0-length dim", f_log_softmax1, X(3, 0), O(3, 0), 0, true,
     .dt = AG_F64},
    {"mean f64 over an empty dim", f_mean0, X(0, 4), O(4), NAN, true, .dt = AG_F64},
    {"var f64 of everything", f_var_all, X(0), O0, NAN, true, .dt = AG_F64},
    {"softmax of a transposed empty tensor", f_softmax_t, X(5, 0), O(0, 5), 0, true},
    {"log_softmax over a transposed 0-length dim", f_log_softmax_t0, X(5, 0), O(0, 5), 0, true},
    {"argmax of a transposed empty tensor", f_argmax_t, X(4, 0), O(0), 0, false},
    {"logsumexp keepdim of everything", f_lse_keep, X(0, 3), O(1, 1), -INFINITY, true},
    {"sum over a transposed empty dim", f_sum_t, X(0, 3), O(3), 0, true},
    {"sum i64 over an empty dim", f_sum0, X(0, 4), O(4), 0, false, .dt = AG_I64},
    {"amax i64 over a full dim", f_amax1, X(0, 4), O(0), 0, false, .dt = AG_I64},
    {"argmax i64 over a full dim", f_argmax1, X(0, 4), O(0), 0, false, .dt = AG_I64},
    /* indexing with no indices, and of empty tensors */
    {"index_select of no indices",
     f_index_select0,
     X(5, 3),
     O(0, 3),
     0,
     true,
     1,
     {1},
     {{0}},
     {0},
     {false},
     true},
    {"index_select of an empty tensor",
     f_index_select1,
     X(0, 3),
     O(0, 2),
     0,
     true,
     1,
     {1},
     {{2}},
     {1},
     {false},
     true},
    {"gather of no indices",
     f_gather1,
     X(3, 4),
     O(3, 0),
     0,
     true,
     1,
     {2},
     {{3, 0}},
     {0},
     {false},
     true},
    {"index with an empty index",
     f_index0,
     X(3, 4),
     O(0, 4),
     0,
     true,
     1,
     {1},
     {{0}},
     {0},
     {false},
     true},
    {"index_add of nothing",
     f_index_add,
     X(5, 3),
     O(5, 3),
     0.25,
     true,
     1,
     {1},
     {{0}},
     {0},
     {false},
     true,
     .gfill = 1},
    {"scatter_add of nothing",
     f_scatter_add,
     X(3, 4),
     O(3, 4),
     0.25,
     true,
     1,
     {2},
     {{0, 4}},
     {0},
     {false},
     true,
     .gfill = 1},
    {"cat of an empty tensor", f_cat, X(0, 3), O(2, 3), 1, true, 1, {2}, {{2, 3}}, {1}},
    /* attention */
    {"sdpa batch 0", f_sdpa, X(0, 2, 4, 8), O(0, 2, 4, 8), 0, true},
    {"sdpa length 0", f_sdpa, X(1, 2, 0, 8), O(1, 2, 0, 8), 0, true},
    {"sdpa causal length 0", f_sdpa_causal, X(1, 2, 0, 8), O(1, 2, 0, 8), 0, true},
};

static void run_case(const ecase *c) {
    ag_scope_begin();
    ag_tensor *x = ag_full(c->dt, c->xnd, c->xs, c->dt == AG_I64 ? 1 : 0.25);
    assert_non_null(x);
    if (c->grad)
        assert_int_equal(ag_tensor_set_requires_grad(x, true), 0);
    for (int k = 0; k < 4; k++)
        P[k] = NULL;
    for (int k = 0; k < c->np; k++) {
        P[k] = ag_full(k == 0 && c->pint ? AG_I64 : AG_F32, c->pnd[k], c->ps[k], c->pfill[k]);
        assert_non_null(P[k]);
        if (c->pgrad[k])
            assert_int_equal(ag_tensor_set_requires_grad(P[k], true), 0);
    }
    ag_tensor *y = c->fn(x);
    if (!y)
        fail_msg("%s: failed: %s", c->name, ag_last_error());
    tu_assert_shape(y, c->ond, c->os);
    assert_all(y, c->fill, c->name);
    if (c->grad) {
        ag_tensor *s = ag_sum_all(y);
        assert_non_null(s);
        if (ag_backward(s, NULL, false) < 0)
            fail_msg("%s: backward failed: %s", c->name, ag_last_error());
        ag_tensor *gx = ag_tensor_grad(x);
        if (!gx)
            fail_msg("%s: no gradient for the input", c->name);
        tu_assert_shape(gx, c->xnd, c->xs);
        assert_all(gx, c->gfill, c->name);
        for (int k = 0; k < c->np; k++) {
            if (!c->pgrad[k])
                continue;
            ag_tensor *gp = ag_tensor_grad(P[k]);
            if (!gp)
                fail_msg("%s: no gradient for parameter %d", c->name, k);
            tu_assert_shape(gp, c->pnd[k], c->ps[k]);
            assert_all(gp, 0, c->name);
        }
    }
    ag_scope_end();
}

static void test_table(void **st) {
    (void)st;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        run_case(&cases[i]);
}

/* The reductions without an identity refuse an empty reduced dim, as PyTorch does. */
static void test_refusals(void **st) {
    (void)st;
    ag_scope_begin();
    ag_tensor *e30 = ag_zeros(AG_F32, 2, S(3, 0)), *e04 = ag_zeros(AG_F32, 2, S(0, 4));
    assert_null(ag_argmax(e30, 1, false));
    assert_int_equal(ag_last_status(), AG_EINVAL);
    tu_assert_error_contains("argmax(): Expected reduction dim 1 to have non-zero size.");
    ag_clear_error();
    assert_null(ag_argmax(e30, -1, true));
    tu_assert_error_contains("argmax(): Expected reduction dim 1 to have non-zero size.");
    ag_clear_error();
    assert_null(ag_argmax_all(e04));
    assert_int_equal(ag_last_status(), AG_EINVAL);
    tu_assert_error_contains(
        "argmax(): Expected reduction dim to be specified for input.numel() == 0.");
    ag_clear_error();
    assert_null(ag_amax(e30, S(1), 1, false));
    tu_assert_error_contains("amax(): Expected reduction dim 1 to have non-zero size.");
    ag_clear_error();
    assert_null(ag_amax(e04, NULL, 0, false));
    tu_assert_error_contains("amax(): Expected reduction dim 0 to have non-zero size.");
    ag_clear_error();
    ag_scope_end();
}

/* batch_norm in training with a batch of 0 leaves the running statistics as they were (there
 * is nothing to average; PyTorch's batch_norm returns before updating them). */
static void test_batch_norm_running_stats(void **st) {
    (void)st;
    ag_scope_begin();
    ag_tensor *x = ag_zeros(AG_F32, 3, S(0, 2, 3));
    ag_tensor *rm = tu_tensor(AG_F32, 1, S(2), V(0.5, -1)),
              *rv = tu_tensor(AG_F32, 1, S(2), V(2, 3));
    ag_tensor *out = NULL, *sm = NULL, *si = NULL;
    assert_int_equal(ag_native_batch_norm(x, NULL, NULL, rm, rv, true, 0.1, 1e-5, &out, &sm, &si),
                     0);
    tu_assert_shape(out, 3, S(0, 2, 3));
    tu_assert_shape(sm, 1, S(2));
    tu_assert_shape(si, 1, S(2));
    tu_assert_values(rm, 1, S(2), V(0.5, -1), 0);
    tu_assert_values(rv, 1, S(2), V(2, 3), 0);
    /* no channels either */
    assert_int_equal(ag_native_batch_norm(ag_zeros(AG_F32, 2, S(0, 0)), NULL, NULL, NULL, NULL,
                                          true, 0.1, 1e-5, &out, &sm, &si),
                     0);
    tu_assert_shape(out, 2, S(0, 0));
    tu_assert_shape(sm, 1, S(0));
    /* one value per channel is still refused, in PyTorch's words */
    ag_tensor *one = ag_zeros(AG_F32, 2, S(1, 2));
    assert_int_equal(ag_native_batch_norm(one, NULL, NULL, rm, rv, true, 0.1, 1e-5, &out, &sm, &si),
                     AG_EINVAL);
    tu_assert_error_contains(
        "native_batch_norm: Expected more than 1 value per channel when training, got input "
        "size [1, 2]");
    ag_clear_error();
    ag_scope_end();
}

/* The backward helpers called directly on empty operands. */
static void test_backward_helpers(void **st) {
    (void)st;
    ag_scope_begin();
    ag_tensor *e = ag_zeros(AG_F32, 2, S(0, 5)), *e2 = ag_zeros(AG_F32, 2, S(3, 0));
    ag_tensor *r = ag_softmax_backward_data(e, e, 1, AG_F32);
    assert_non_null(r);
    tu_assert_shape(r, 2, S(0, 5));
    r = ag_log_softmax_backward_data(e2, e2, 1, AG_F32);
    assert_non_null(r);
    tu_assert_shape(r, 2, S(3, 0));
    r = ag_softmax_backward_data(e2, e2, 0, AG_F32);
    assert_non_null(r);
    tu_assert_shape(r, 2, S(3, 0));
    /* nll_loss_backward with a batch of 0: an empty gradient for every reduction */
    ag_tensor *t = ag_zeros(AG_I64, 1, S(0));
    const ag_op *nb = ag_op_find("nll_loss_backward");
    assert_non_null(nb);
    for (int red = 0; red < 3; red++) {
        ag_tensor *go = red == 0 ? ag_zeros(AG_F32, 1, S(0)) : ag_scalar_tensor(AG_F32, 1);
        ag_tensor *tw = ag_scalar_tensor(AG_F32, 0);
        ag_arg a[7] = {AG_A_T(go),  AG_A_T(e),    AG_A_T(t), AG_A_NONE,
                       AG_A_I(red), AG_A_I(-100), AG_A_T(tw)};
        ag_tensor *gi = ag_op_call1(nb, a, 7);
        if (!gi)
            fail_msg("nll_loss_backward reduction %d: %s", red, ag_last_error());
        tu_assert_shape(gi, 2, S(0, 5));
    }
    /* embedding_dense_backward of no indices: zeros of the weight's shape */
    ag_tensor *ge =
        ag_embedding_dense_backward(ag_zeros(AG_F32, 2, S(0, 3)), ag_zeros(AG_I64, 1, S(0)), 5, -1);
    assert_non_null(ge);
    tu_assert_shape(ge, 2, S(5, 3));
    assert_all(ge, 0, "embedding_dense_backward");
    ag_scope_end();
}

/* Backward of the sum of every float output of a call: the module's parameters' gradients are
 * all zero, and at least one parameter gets one. */
static void backward_zero_grads(const char *what, ag_module *m, ag_tensor **outs, int n) {
    ag_tensor *total = NULL;
    for (int k = 0; k < n; k++) {
        if (!ag_dtype_is_float(ag_tensor_dtype(outs[k])) || !ag_tensor_requires_grad(outs[k]))
            continue;
        ag_tensor *s = ag_sum_all(outs[k]);
        total = total ? ag_add(total, s) : s;
    }
    if (!total)
        fail_msg("%s: no differentiable output", what);
    if (ag_backward(total, NULL, false) < 0)
        fail_msg("%s: backward: %s", what, ag_last_error());
    ag_named_tensors ps;
    assert_int_equal(ag_module_named_parameters(m, true, &ps), 0);
    int with_grad = 0;
    for (int i = 0; i < ps.n; i++) {
        ag_tensor *g = ag_tensor_grad(ps.tensors[i]);
        if (g) {
            tu_assert_shape(g, ag_tensor_ndim(ps.tensors[i]), ag_tensor_sizes(ps.tensors[i]));
            assert_all(g, 0, ps.names[i]);
            with_grad++;
        }
        ag_tensor_set_grad(ps.tensors[i], NULL);
    }
    ag_named_tensors_free(&ps);
    if (with_grad == 0)
        fail_msg("%s: no parameter got a gradient", what);
}

/* Every output of a batch-0 call has no elements (or is a scalar). */
static void outputs_empty(const char *what, ag_tensor **outs, int n) {
    for (int k = 0; k < n; k++)
        if (ag_tensor_ndim(outs[k]) > 0 && ag_tensor_numel(outs[k]) != 0)
            fail_msg("%s: output %d has %lld elements", what, k,
                     (long long)ag_tensor_numel(outs[k]));
}

/* The compiled path: zoo models exported, compiled and run with a batch of 0 (their input
 * replaced by an empty one of the same shape otherwise) give the eager result: empty outputs
 * and zero gradients for the parameters. */
static void check_zoo_batch0(const char *name) {
    ag_module *m = NULL;
    ag_tensor *in[4] = {NULL};
    int nin = 0;
    assert_int_equal(ag_zoo_build(name, NULL, &m, in, 4, &nin), 0);
    assert_int_equal(nin, 1);
    int64_t sz[AG_MAX_DIMS];
    int nd = ag_tensor_ndim(in[0]);
    memcpy(sz, ag_tensor_sizes(in[0]), sizeof(int64_t) * (size_t)nd);
    sz[0] = 0;
    ag_tensor *x = ag_zeros(ag_tensor_dtype(in[0]), nd, sz);
    ag_tensor *outs[8];
    /* eager */
    ag_scope_begin();
    int n = ag_module_call(m, &x, 1, outs, 8);
    if (n < 0)
        fail_msg("%s: eager call with a batch of 0: %s", name, ag_last_error());
    outputs_empty(name, outs, n);
    backward_zero_grads(name, m, outs, n);
    ag_scope_end();
    /* compiled */
    ag_joint *j = ag_export_joint(m, &x, 1, NULL, NULL, 0, NULL);
    if (!j)
        fail_msg("%s: export: %s", name, ag_last_error());
    ag_compiled *c = ag_compile_joint(j, NULL);
    if (!c)
        fail_msg("%s: compile: %s", name, ag_last_error());
    ag_scope_begin();
    int nc = ag_compiled_call_module(c, m, &x, 1, outs, 8);
    if (nc != n)
        fail_msg("%s: compiled call: %d (eager %d): %s", name, nc, n, ag_last_error());
    outputs_empty(name, outs, nc);
    backward_zero_grads(name, m, outs, nc);
    ag_scope_end();
    /* The batch-0 program called with the model's own batch is refused or runs, never a
     * crash. */
    ag_scope_begin();
    if (ag_compiled_call_module(c, m, in, 1, outs, 8) < 0)
        ag_clear_error();
    ag_scope_end();
    ag_compiled_free(c);
    ag_joint_free(j);
    ag_tensor_free(x);
    ag_tensor_free(in[0]);
    ag_module_free(m);
}

static void test_compiled_zoo_batch0(void **st) {
    (void)st;
    check_zoo_batch0("mlp");
    check_zoo_batch0("cnn");
    check_zoo_batch0("gpt2");
    check_zoo_batch0("dropout_mlp");
}

/* cross_entropy(x @ w^T, target) with the reduction in the module's ud. */
static int ce_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)nin;
    (void)max_out;
    ag_scope_begin();
    int red = *(const int *)ag_module_ud(m);
    ag_tensor *logits = ag_linear(in[0], ag_module_param(m, "w"), NULL);
    out[0] = ag_tensor_keep(ag_cross_entropy(logits, in[1], red, -100));
    ag_scope_end();
    return out[0] ? 1 : ag_last_status();
}

/* A compiled cross-entropy with a batch of 0 (the executor fuses nll_loss_backward with
 * log_softmax's backward): 'mean' NaN, 'sum' 0, 'none' empty, the weight's gradient zeros. */
static void test_compiled_cross_entropy_batch0(void **st) {
    (void)st;
    static const int reds[3] = {AG_REDUCTION_MEAN, AG_REDUCTION_SUM, AG_REDUCTION_NONE};
    static const double want[3] = {NAN, 0, 0};
    for (int r = 0; r < 3; r++) {
        ag_module *m = ag_module_new("CE", ce_forward, (void *)&reds[r], NULL);
        assert_non_null(m);
        ag_tensor *w = ag_full(AG_F32, 2, S(5, 4), 0.5);
        assert_int_equal(ag_module_register_parameter(m, "w", w), 0);
        ag_tensor_free(w);
        ag_tensor *in[2] = {ag_zeros(AG_F32, 2, S(0, 4)), ag_zeros(AG_I64, 1, S(0))};
        ag_joint *j = ag_export_joint(m, in, 2, NULL, NULL, 0, NULL);
        if (!j)
            fail_msg("export: %s", ag_last_error());
        ag_compiled *c = ag_compile_joint(j, NULL);
        if (!c)
            fail_msg("compile: %s", ag_last_error());
        ag_scope_begin();
        ag_tensor *y = NULL;
        if (ag_compiled_call_module(c, m, in, 2, &y, 1) != 1)
            fail_msg("compiled call: %s", ag_last_error());
        if (reds[r] == AG_REDUCTION_NONE)
            tu_assert_shape(y, 1, S(0));
        else
            tu_assert_shape(y, 0, NULL);
        assert_all(y, want[r], "compiled cross_entropy");
        backward_zero_grads("compiled cross_entropy", m, &y, 1);
        ag_scope_end();
        ag_compiled_free(c);
        ag_joint_free(j);
        ag_tensor_free(in[0]);
        ag_tensor_free(in[1]);
        ag_module_free(m);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_table),
        cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_batch_norm_running_stats),
        cmocka_unit_test(test_backward_helpers),
        cmocka_unit_test(test_compiled_zoo_batch0),
        cmocka_unit_test(test_compiled_cross_entropy_batch0),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
