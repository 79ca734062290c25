/* Tests of the nn options of issue 15: cross-entropy's class weights and label smoothing (the
 * public function and the module), AvgPool2d and AdaptiveAvgPool2d modules, GPT-2's config
 * options, module dtype conversion and float64 layers, and custom modules built through the
 * public helpers only (their errors reaching the export's message). Expected values are
 * computed here in double from PyTorch's documented formulas, or are finite differences. */
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

static uint64_t rng_state = 987654321;

static ag_tensor *rand_t(ag_dtype dt, int ndim, const int64_t *sizes, double lo, double hi) {
    return tu_rand_tensor(dt, ndim, sizes, lo, hi, tu_lcg, &rng_state);
}

/* ---- cross-entropy with weight, ignore_index and label smoothing ---- */

enum { CE_N = 5, CE_C = 3 };
static const double ce_logits[CE_N * CE_C] = {0.2, -1.0, 0.7, 1.5,  0.3,  -0.4, -0.8, 0.1,
                                              2.0, 0.0,  0.5, -1.2, -0.3, 0.9,  0.4};
static const int64_t ce_target[CE_N] = {2, -100, 1, 0, 1};
static const double ce_weight[CE_C] = {0.5, 1.0, 2.0};

/* PyTorch's documented formula: with label smoothing ls the target distribution is
 * q_c = (1 - ls) [c == y_n] + ls / C, l_n = -sum_c w_c q_c log p_{n,c} (0 when y_n is
 * ignored); mean divides sum_n l_n by sum_n w_{y_n} over the kept samples. */
static void ce_reference(const double *w, double ls, int reduction, double *out) {
    double total = 0, sum = 0;
    for (int n = 0; n < CE_N; n++) {
        const double *x = &ce_logits[n * CE_C];
        double mx = x[0], z = 0;
        for (int c = 1; c < CE_C; c++)
            mx = fmax(mx, x[c]);
        for (int c = 0; c < CE_C; c++)
            z += exp(x[c] - mx);
        double l = 0;
        if (ce_target[n] != -100) {
            for (int c = 0; c < CE_C; c++) {
                double q = (1 - ls) * (c == ce_target[n]) + ls / CE_C;
                double logp = x[c] - mx - log(z);
                l -= (w ? w[c] : 1.0) * q * logp;
            }
            total += w ? w[ce_target[n]] : 1.0;
        }
        sum += l;
        if (reduction == AG_REDUCTION_NONE)
            out[n] = l;
    }
    if (reduction == AG_REDUCTION_SUM)
        out[0] = sum;
    else if (reduction == AG_REDUCTION_MEAN)
        out[0] = sum / total;
}

static ag_tensor *ce_target_tensor(void) {
    return ag_from_data(AG_I64, 1, (int64_t[]){CE_N}, ce_target);
}

static void test_ce_values(void **st) {
    (void)st;
    ag_scope_begin();
    ag_tensor *x = tu_tensor(AG_F32, 2, (int64_t[]){CE_N, CE_C}, ce_logits);
    ag_tensor *t = ce_target_tensor();
    ag_tensor *w = tu_tensor(AG_F32, 1, (int64_t[]){CE_C}, ce_weight);
    const double ls[] = {0.0, 0.1, 0.35};
    const int reds[] = {AG_REDUCTION_MEAN, AG_REDUCTION_SUM, AG_REDUCTION_NONE};
    for (int li = 0; li < 3; li++)
        for (int ri = 0; ri < 3; ri++)
            for (int wi = 0; wi < 2; wi++) {
                double want[CE_N];
                ce_reference(wi ? ce_weight : NULL, ls[li], reds[ri], want);
                ag_tensor *y = ag_cross_entropy_loss(x, t, wi ? w : NULL, reds[ri], -100, ls[li]);
                assert_non_null(y);
                tu_assert_close(y, want, 1e-5);
                /* The module computes the same, its weight a persistent buffer. */
                ag_module *m = ag_nn_cross_entropy_loss_ex(wi ? w : NULL, reds[ri], -100, ls[li]);
                assert_non_null(m);
                assert_string_equal(ag_module_type(m), "CrossEntropyLoss");
                assert_ptr_equal(ag_module_buffer(m, "weight"), wi ? w : NULL);
                ag_tensor *o[1];
                assert_int_equal(ag_module_call(m, (ag_tensor *[]){x, t}, 2, o, 1), 1);
                tu_assert_close(o[0], want, 1e-5);
                ag_module_free(m);
            }
    /* The old entry points keep their meaning (no weight, no smoothing). */
    double want;
    ce_reference(NULL, 0, AG_REDUCTION_MEAN, &want);
    tu_assert_close(ag_cross_entropy(x, t, AG_REDUCTION_MEAN, -100), &want, 1e-5);
    ag_module *m = ag_nn_cross_entropy_loss(AG_REDUCTION_MEAN, -100);
    assert_non_null(m);
    assert_null(ag_module_buffer(m, "weight"));
    ag_module_free(m);
    /* Bad options are refused by name. */
    assert_null(ag_nn_cross_entropy_loss_ex(NULL, AG_REDUCTION_MEAN, -100, 1.5));
    tu_assert_error_contains("label_smoothing");
    assert_null(ag_nn_cross_entropy_loss_ex(NULL, 7, -100, 0));
    tu_assert_error_contains("reduction 7");
    assert_null(ag_cross_entropy_loss(x, t, w, AG_REDUCTION_MEAN, -100, -0.5));
    tu_assert_error_contains("label_smoothing");
    /* The module's weight buffer follows module.to(dtype) (w itself: the module holds
     * that tensor); the loss is then f64. */
    ag_module *mw = ag_nn_cross_entropy_loss_ex(w, AG_REDUCTION_MEAN, -100, 0.1);
    assert_int_equal(ag_module_to_dtype(mw, AG_F64), 0);
    assert_int_equal(ag_tensor_dtype(ag_module_buffer(mw, "weight")), AG_F64);
    double want64;
    ce_reference(ce_weight, 0.1, AG_REDUCTION_MEAN, &want64);
    ag_tensor *o64[1];
    ag_tensor *x64 = tu_tensor(AG_F64, 2, (int64_t[]){CE_N, CE_C}, ce_logits);
    assert_int_equal(ag_module_call(mw, (ag_tensor *[]){x64, t}, 2, o64, 1), 1);
    assert_int_equal(ag_tensor_dtype(o64[0]), AG_F64);
    tu_assert_close(o64[0], &want64, 1e-12);
    ag_module_free(mw);
    ag_scope_end();
}

typedef struct ce_gc {
    ag_tensor *target, *weight;
    int reduction;
    double ls;
} ce_gc;

static int ce_fn(void *ud, ag_tensor *const *in, int n, ag_tensor **outs, int *nouts) {
    (void)n;
    const ce_gc *g = ud;
    outs[0] = ag_cross_entropy_loss(in[0], g->target, g->weight, g->reduction, -100, g->ls);
    *nouts = 1;
    return outs[0] ? 0 : ag_last_status();
}

static void test_ce_gradcheck(void **st) {
    (void)st;
    ag_scope_begin();
    ag_tensor *x = tu_leaf(AG_F64, 2, (int64_t[]){CE_N, CE_C}, ce_logits);
    ag_tensor *w = tu_tensor(AG_F64, 1, (int64_t[]){CE_C}, ce_weight);
    ag_tensor *t = ce_target_tensor();
    const int reds[] = {AG_REDUCTION_MEAN, AG_REDUCTION_SUM, AG_REDUCTION_NONE};
    for (int ri = 0; ri < 3; ri++) {
        ce_gc g = {t, w, reds[ri], 0.2};
        int rc = ag_gradcheck(ce_fn, &g, &x, 1, NULL);
        if (rc)
            print_error("%s\n", ag_last_error());
        assert_int_equal(rc, 0);
    }
    /* The analytical gradient of the mean against the formula's: d l / d x_{n,c} =
     * (sum_k w_k q_k) p_c - w_c q_c, over the total weight. */
    ag_tensor *loss = ag_cross_entropy_loss(x, t, w, AG_REDUCTION_MEAN, -100, 0.2);
    assert_int_equal(ag_backward(loss, NULL, false), 0);
    double total = 0;
    for (int n = 0; n < CE_N; n++)
        total += ce_target[n] == -100 ? 0 : ce_weight[ce_target[n]];
    double want[CE_N * CE_C];
    for (int n = 0; n < CE_N; n++) {
        const double *xr = &ce_logits[n * CE_C];
        double z = 0, wq = 0, q[CE_C];
        for (int c = 0; c < CE_C; c++)
            z += exp(xr[c]);
        for (int c = 0; c < CE_C; c++) {
            q[c] = 0.8 * (c == ce_target[n]) + 0.2 / CE_C;
            wq += ce_weight[c] * q[c];
        }
        for (int c = 0; c < CE_C; c++)
            want[n * CE_C + c] =
                ce_target[n] == -100 ? 0 : (wq * exp(xr[c]) / z - ce_weight[c] * q[c]) / total;
    }
    tu_assert_close(ag_tensor_grad(x), want, 1e-10);
    ag_scope_end();
}

/* ---- AvgPool2d, AdaptiveAvgPool2d ---- */

/* PyTorch's avg_pool2d on one (H, W) plane, from its documentation and ATen's definition of
 * the divisor. */
static int64_t pool_out(int64_t in, int64_t k, int64_t s, int64_t p, bool ceil_mode) {
    int64_t num = in + 2 * p - k;
    int64_t o = (ceil_mode ? (num + s - 1) / s : num / s) + 1;
    if (ceil_mode && (o - 1) * s >= in + p)
        o--;
    return o;
}

static void avg_reference(const double *x, int64_t H, int64_t W, int64_t k, int64_t s, int64_t p,
                          bool ceil_mode, bool cip, int64_t div, double *out, int64_t *OH,
                          int64_t *OW) {
    *OH = pool_out(H, k, s, p, ceil_mode);
    *OW = pool_out(W, k, s, p, ceil_mode);
    for (int64_t oh = 0; oh < *OH; oh++)
        for (int64_t ow = 0; ow < *OW; ow++) {
            int64_t h0 = oh * s - p, w0 = ow * s - p;
            int64_t h1 = h0 + k < H + p ? h0 + k : H + p, w1 = w0 + k < W + p ? w0 + k : W + p;
            int64_t pool = (h1 - h0) * (w1 - w0);
            h0 = h0 < 0 ? 0 : h0;
            w0 = w0 < 0 ? 0 : w0;
            h1 = h1 > H ? H : h1;
            w1 = w1 > W ? W : w1;
            double sum = 0;
            for (int64_t i = h0; i < h1; i++)
                for (int64_t j = w0; j < w1; j++)
                    sum += x[i * W + j];
            double d = div ? (double)div : cip ? (double)pool : (double)((h1 - h0) * (w1 - w0));
            out[oh * *OW + ow] = sum / d;
        }
}

static void test_avgpool_module(void **st) {
    (void)st;
    ag_scope_begin();
    double xv[5 * 6];
    for (int i = 0; i < 30; i++)
        xv[i] = (double)((i * 7) % 11) - 3.0;
    ag_tensor *x = tu_tensor(AG_F32, 4, (int64_t[]){1, 1, 5, 6}, xv);
    /* 2x2 by hand at (0, 0): x[0, 0..1] = -3, 4; x[1, 0..1] = 6, 2: 9 / 4. */
    ag_module *m = ag_nn_avgpool2d(2, 0, 0, false, true, 0);
    assert_non_null(m);
    assert_string_equal(ag_module_type(m), "AvgPool2d");
    assert_int_equal(ag_module_num_parameters(m), 0);
    ag_tensor *y = ag_module_forward(m, x);
    assert_non_null(y);
    tu_assert_shape(y, 4, (int64_t[]){1, 1, 2, 3});
    assert_true(fabs(ag_tensor_item_at(y, 0) - 2.25) < 1e-6);
    ag_module_free(m);
    const struct {
        int64_t k, s, p;
        bool ceil, cip;
        int64_t div;
    } cases[] = {{3, 2, 1, false, true, 0}, {3, 2, 1, false, false, 0}, {3, 2, 1, true, false, 0},
                 {2, 1, 1, true, true, 0},  {3, 2, 0, true, true, 0},   {2, 2, 1, false, true, 3}};
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        double want[64];
        int64_t OH, OW;
        avg_reference(xv, 5, 6, cases[c].k, cases[c].s, cases[c].p, cases[c].ceil, cases[c].cip,
                      cases[c].div, want, &OH, &OW);
        m = ag_nn_avgpool2d(cases[c].k, cases[c].s, cases[c].p, cases[c].ceil, cases[c].cip,
                            cases[c].div);
        assert_non_null(m);
        y = ag_module_forward(m, x);
        if (!y)
            print_error("case %zu: %s\n", c, ag_last_error());
        assert_non_null(y);
        tu_assert_shape(y, 4, (int64_t[]){1, 1, OH, OW});
        tu_assert_close(y, want, 1e-6);
        ag_module_free(m);
    }
    assert_null(ag_nn_avgpool2d(2, 2, 2, false, true, 0));
    tu_assert_error_contains("AvgPool2d");

    /* Adaptive: bins [floor(i H / O), ceil((i + 1) H / O)). 5 rows into 3: {0,1}, {1,2,3},
     * {3,4}; 6 columns into 4: {0,1}, {1,2}, {3,4}, {4,5}. */
    m = ag_nn_adaptive_avgpool2d(3, 4);
    assert_non_null(m);
    assert_string_equal(ag_module_type(m), "AdaptiveAvgPool2d");
    assert_int_equal(ag_module_num_parameters(m), 0);
    y = ag_module_forward(m, x);
    assert_non_null(y);
    tu_assert_shape(y, 4, (int64_t[]){1, 1, 3, 4});
    double want[12];
    for (int i = 0; i < 3; i++)
        for (int j = 0; j < 4; j++) {
            int h0 = i * 5 / 3, h1 = ((i + 1) * 5 + 2) / 3, w0 = j * 6 / 4,
                w1 = ((j + 1) * 6 + 3) / 4;
            double s = 0;
            for (int h = h0; h < h1; h++)
                for (int w = w0; w < w1; w++)
                    s += xv[h * 6 + w];
            want[i * 4 + j] = s / ((h1 - h0) * (w1 - w0));
        }
    tu_assert_close(y, want, 1e-6);
    ag_module_free(m);
    /* None (negative) keeps the input's size: (None, 1) averages each row. */
    m = ag_nn_adaptive_avgpool2d(-1, 1);
    y = ag_module_forward(m, x);
    assert_non_null(y);
    tu_assert_shape(y, 4, (int64_t[]){1, 1, 5, 1});
    for (int i = 0; i < 5; i++) {
        double s = 0;
        for (int w = 0; w < 6; w++)
            s += xv[i * 6 + w];
        want[i] = s / 6;
    }
    tu_assert_close(y, want, 1e-6);
    ag_module_free(m);
    ag_scope_end();
}

/* Exports m on x, checks the joint verifies, and that the compiled forward and gradients equal
 * eager's. */
static void export_matches_eager(ag_module *m, ag_tensor *x, double tol) {
    ag_joint *j = ag_export_joint(m, &x, 1, NULL, NULL, 0, NULL);
    if (!j)
        print_error("export: %s\n", ag_last_error());
    assert_non_null(j);
    assert_int_equal(ag_graph_verify(ag_joint_graph(j)), 0);
    ag_compiled *c = ag_compile_joint(j, NULL);
    if (!c)
        print_error("compile: %s\n", ag_last_error());
    assert_non_null(c);
    ag_named_tensors ps;
    assert_int_equal(ag_module_named_parameters(m, true, &ps), 0);
    ag_scope_begin();
    ag_tensor *eager = ag_module_forward(m, x);
    assert_non_null(eager);
    assert_int_equal(ag_backward(ag_sum_all(eager), NULL, false), 0);
    ag_tensor *eg[64];
    assert_true(ps.n <= 64);
    for (int i = 0; i < ps.n; i++) {
        eg[i] = ag_tensor_keep(ag_tensor_grad(ps.tensors[i]));
        ag_tensor_set_grad(ps.tensors[i], NULL);
    }
    ag_tensor *out[1];
    assert_int_equal(ag_compiled_call_module(c, m, &x, 1, out, 1), 1);
    assert_true(tu_max_abs_diff(out[0], eager) <= tol);
    assert_int_equal(ag_backward(ag_sum_all(out[0]), NULL, false), 0);
    for (int i = 0; i < ps.n; i++) {
        assert_non_null(ag_tensor_grad(ps.tensors[i]));
        assert_true(tu_max_abs_diff(ag_tensor_grad(ps.tensors[i]), eg[i]) <= tol);
        ag_tensor_free(eg[i]);
        ag_tensor_set_grad(ps.tensors[i], NULL);
    }
    ag_scope_end();
    ag_named_tensors_free(&ps);
    ag_compiled_free(c);
    ag_joint_free(j);
}

static void test_pool_modules_export(void **st) {
    (void)st;
    ag_manual_seed(3);
    ag_module *m = ag_nn_sequential();
    assert_int_equal(ag_nn_append(m, ag_nn_conv2d(1, 2, 3, 1, 1, 1, 1, true)), 0);
    assert_int_equal(ag_nn_append(m, ag_nn_avgpool2d(3, 2, 1, true, false, 0)), 0);
    assert_int_equal(ag_nn_append(m, ag_nn_adaptive_avgpool2d(2, 2)), 0);
    assert_int_equal(ag_nn_append(m, ag_nn_flatten(1, -1)), 0);
    assert_int_equal(ag_nn_append(m, ag_nn_linear(8, 3, true)), 0);
    ag_scope_begin();
    ag_tensor *x = rand_t(AG_F32, 4, (int64_t[]){2, 1, 7, 6}, -1, 1);
    export_matches_eager(m, x, 1e-5);
    ag_scope_end();
    ag_module_free(m);
}

/* ---- GPT-2 config options ---- */

static ag_gpt2_config mini_config(void) {
    return (ag_gpt2_config){
        .n_layer = 1, .n_head = 2, .n_embd = 8, .vocab_size = 11, .block_size = 6, .bias = true};
}

static ag_tensor *tokens(int64_t B, int64_t T, int64_t V, const int64_t *fixed) {
    int64_t v[64];
    for (int64_t i = 0; i < B * T; i++)
        v[i] = fixed ? fixed[i] : (int64_t)tu_lcg(&rng_state, 0, (double)V);
    return ag_from_data(AG_I64, 2, (int64_t[]){B, T}, v);
}

/* Mean cross entropy of logits (N, V) against targets, skipping `ignore`, in double. */
static double ce_of(const ag_tensor *logits, const int64_t *tgt, int64_t N, int64_t V,
                    int64_t ignore) {
    double sum = 0;
    int kept = 0;
    for (int64_t n = 0; n < N; n++) {
        if (tgt[n] == ignore)
            continue;
        double mx = -INFINITY, z = 0;
        for (int64_t c = 0; c < V; c++)
            mx = fmax(mx, ag_tensor_item_at(logits, n * V + c));
        for (int64_t c = 0; c < V; c++)
            z += exp(ag_tensor_item_at(logits, n * V + c) - mx);
        sum -= ag_tensor_item_at(logits, n * V + tgt[n]) - mx - log(z);
        kept++;
    }
    return sum / kept;
}

static void test_gpt2_defaults_unchanged(void **st) {
    (void)st;
    /* A zeroed option is the default: the same seed gives the same tree, tensors and outputs
     * as a config that spells the defaults out. */
    ag_gpt2_config a = mini_config(), b = mini_config();
    b.layer_norm_eps = 1e-5;
    b.activation = AG_GPT2_GELU_TANH;
    b.ignore_index = -1;
    ag_manual_seed(7);
    ag_module *ma = ag_nn_gpt2(&a);
    ag_manual_seed(7);
    ag_module *mb = ag_nn_gpt2(&b);
    assert_non_null(ma);
    assert_non_null(mb);
    assert_ptr_equal(ag_module_param(ma, "lm_head.weight"),
                     ag_module_param(ma, "transformer.wte.weight"));
    assert_string_equal(ag_module_type(ag_module_child(ma, "transformer.h.0.mlp.gelu")), "GELU");
    ag_scope_begin();
    const int64_t tg[8] = {1, -1, 3, 4, 10, -1, 0, 2};
    ag_tensor *idx = tokens(2, 4, 11, NULL), *tgt = tokens(2, 4, 11, tg);
    ag_tensor *oa[2], *ob[2];
    assert_int_equal(ag_module_call(ma, (ag_tensor *[]){idx, tgt}, 2, oa, 2), 2);
    assert_int_equal(ag_module_call(mb, (ag_tensor *[]){idx, tgt}, 2, ob, 2), 2);
    assert_true(tu_same_bits(oa[0], ob[0]));
    assert_true(tu_same_bits(oa[1], ob[1]));
    /* The loss is the mean over targets that are not -1 (nanoGPT's ignore_index). */
    double want = ce_of(oa[0], tg, 8, 11, -1);
    assert_true(fabs(ag_tensor_item_at(oa[1], 0) - want) < 1e-5);
    ag_scope_end();
    ag_module_free(ma);
    ag_module_free(mb);
}

/* LayerNorm over the last dim with weight 1, bias 0 (the initialization), in double. */
static void layer_norm_ref(const double *x, int64_t rows, int64_t C, double eps, double *out) {
    for (int64_t r = 0; r < rows; r++) {
        double mean = 0, var = 0;
        for (int64_t c = 0; c < C; c++)
            mean += x[r * C + c] / C;
        for (int64_t c = 0; c < C; c++)
            var += (x[r * C + c] - mean) * (x[r * C + c] - mean) / C;
        for (int64_t c = 0; c < C; c++)
            out[r * C + c] = (x[r * C + c] - mean) / sqrt(var + eps);
    }
}

static void test_gpt2_options(void **st) {
    (void)st;
    ag_scope_begin();
    /* eps: every LayerNorm uses it (checked against the formula on a small-variance input,
     * where eps 0.5 and 1e-5 differ a lot). */
    ag_gpt2_config c = mini_config();
    c.layer_norm_eps = 0.5;
    ag_manual_seed(1);
    ag_module *m = ag_nn_gpt2(&c);
    assert_non_null(m);
    double xv[2 * 8], want[2 * 8];
    for (int i = 0; i < 16; i++)
        xv[i] = 0.1 * sin(i * 1.3);
    ag_tensor *x = tu_tensor(AG_F32, 3, (int64_t[]){1, 2, 8}, xv);
    layer_norm_ref(xv, 2, 8, 0.5, want);
    const char *lns[] = {"transformer.ln_f", "transformer.h.0.ln_1", "transformer.h.0.ln_2"};
    for (int i = 0; i < 3; i++)
        tu_assert_close(ag_module_forward(ag_module_child(m, lns[i]), x), want, 1e-5);
    ag_module_free(m);

    /* activation: exact gelu and relu, at -1 and 1 (gelu(1) = 0.8413447 exact, 0.8411920
     * with tanh). */
    const struct {
        ag_gpt2_activation act;
        const char *type;
        double at_m1, at_1;
    } acts[] = {{AG_GPT2_GELU_TANH, "GELU", -0.1588080, 0.8411920},
                {AG_GPT2_GELU, "GELU", -0.1586553, 0.8413447},
                {AG_GPT2_RELU, "ReLU", 0.0, 1.0}};
    ag_tensor *pm = tu_tensor(AG_F32, 1, (int64_t[]){2}, (double[]){-1, 1});
    for (int i = 0; i < 3; i++) {
        c = mini_config();
        c.activation = acts[i].act;
        m = ag_nn_gpt2(&c);
        ag_module *act = ag_module_child(m, "transformer.h.0.mlp.gelu");
        assert_string_equal(ag_module_type(act), acts[i].type);
        tu_assert_close(ag_module_forward(act, pm), (double[]){acts[i].at_m1, acts[i].at_1}, 2e-6);
        ag_module_free(m);
    }
    c = mini_config();
    c.activation = (ag_gpt2_activation)9;
    assert_null(ag_nn_gpt2(&c));
    tu_assert_error_contains("activation 9");

    /* untied head: its own parameter lm_head.weight, last in named_parameters. */
    c = mini_config();
    ag_manual_seed(2);
    ag_module *tied = ag_nn_gpt2(&c);
    c.untied_lm_head = true;
    ag_manual_seed(2);
    m = ag_nn_gpt2(&c);
    assert_non_null(m);
    ag_named_tensors nt, ntt;
    assert_int_equal(ag_module_named_parameters(m, true, &nt), 0);
    assert_int_equal(ag_module_named_parameters(tied, true, &ntt), 0);
    assert_int_equal(nt.n, ntt.n + 1);
    assert_string_equal(nt.names[nt.n - 1], "lm_head.weight");
    for (int i = 0; i < ntt.n; i++) /* the same names and values before it */
        assert_string_equal(nt.names[i], ntt.names[i]);
    assert_ptr_not_equal(nt.tensors[nt.n - 1], ag_module_param(m, "transformer.wte.weight"));
    tu_assert_shape(nt.tensors[nt.n - 1], 2, (int64_t[]){11, 8});
    assert_int_equal(ag_module_num_parameters(m), ag_module_num_parameters(tied) + 11 * 8);
    ag_named_tensors_free(&nt);
    ag_named_tensors_free(&ntt);
    ag_module_free(tied);
    ag_module_free(m);

    /* ignore_index -100 (Hugging Face's) and loss_only. */
    c = mini_config();
    c.ignore_index = -100;
    ag_manual_seed(4);
    ag_module *full = ag_nn_gpt2(&c);
    c.loss_only = true;
    ag_manual_seed(4);
    m = ag_nn_gpt2(&c);
    const int64_t tg[6] = {1, -100, 3, 10, -100, 0};
    ag_tensor *idx = tokens(2, 3, 11, NULL), *tgt = tokens(2, 3, 11, tg);
    ag_tensor *o2[2], *o1[1];
    assert_int_equal(ag_module_call(full, (ag_tensor *[]){idx, tgt}, 2, o2, 2), 2);
    double want_loss = ce_of(o2[0], tg, 6, 11, -100);
    assert_true(fabs(ag_tensor_item_at(o2[1], 0) - want_loss) < 1e-5);
    assert_int_equal(ag_module_call(m, (ag_tensor *[]){idx, tgt}, 2, o1, 1), 1);
    tu_assert_shape(o1[0], 0, NULL);
    assert_true(tu_same_bits(o1[0], o2[1]));
    /* Without targets it still returns the logits. */
    assert_int_equal(ag_module_call(m, &idx, 1, o1, 1), 1);
    assert_true(tu_same_bits(o1[0], o2[0]));
    /* -1 is now a class index out of range, not ignored. */
    const int64_t bad[6] = {1, -1, 3, 10, 2, 0};
    assert_true(ag_module_call(full, (ag_tensor *[]){idx, tokens(2, 3, 11, bad)}, 2, o2, 2) < 0);
    /* The loss-only export: one user output, the loss. */
    ag_joint *j = ag_export_joint(m, (ag_tensor *[]){idx, tgt}, 2, NULL, NULL, 0, NULL);
    assert_non_null(j);
    assert_int_equal(ag_graph_verify(ag_joint_graph(j)), 0);
    ag_compiled *cc = ag_compile_joint(j, NULL);
    assert_non_null(cc);
    assert_int_equal(ag_compiled_call_module(cc, m, (ag_tensor *[]){idx, tgt}, 2, o1, 1), 1);
    assert_true(fabs(ag_tensor_item_at(o1[0], 0) - want_loss) < 1e-5);
    ag_compiled_free(cc);
    ag_joint_free(j);
    ag_module_free(full);
    ag_module_free(m);
    ag_scope_end();
}

/* ---- dtypes ---- */

static void assert_all_dtype(const ag_module *m, ag_dtype dt) {
    ag_named_tensors nt;
    assert_int_equal(ag_module_named_parameters(m, false, &nt), 0);
    for (int i = 0; i < nt.n; i++) {
        if (ag_tensor_dtype(nt.tensors[i]) != dt)
            print_error("%s is %s\n", nt.names[i], ag_dtype_short(ag_tensor_dtype(nt.tensors[i])));
        assert_int_equal(ag_tensor_dtype(nt.tensors[i]), dt);
        assert_true(ag_tensor_requires_grad(nt.tensors[i]));
    }
    ag_named_tensors_free(&nt);
}

typedef ag_module *(*build_fn)(void);
static ag_module *b_linear(void) {
    return ag_nn_linear(5, 3, true);
}
static ag_module *b_conv(void) {
    return ag_nn_conv2d(2, 3, 3, 2, 1, 1, 1, true);
}
static ag_module *b_bn(void) {
    return ag_nn_batchnorm2d(2, 1e-5, 0.1);
}
static ag_module *b_ln(void) {
    return ag_nn_layernorm(5, 1e-5, true);
}
static ag_module *b_cnn(void) {
    ag_module *m = ag_nn_sequential();
    ag_nn_append(m, ag_nn_conv2d(2, 4, 3, 1, 1, 1, 1, true));
    ag_nn_append(m, ag_nn_batchnorm2d(4, 1e-5, 0.1));
    ag_nn_append(m, ag_nn_gelu("tanh"));
    ag_nn_append(m, ag_nn_maxpool2d(2, 0, 0));
    ag_nn_append(m, ag_nn_avgpool2d(2, 1, 1, true, false, 0));
    ag_nn_append(m, ag_nn_adaptive_avgpool2d(2, 2));
    ag_nn_append(m, ag_nn_flatten(1, -1));
    ag_nn_append(m, ag_nn_dropout(0.0));
    ag_nn_append(m, ag_nn_linear(16, 3, true));
    ag_nn_append(m, ag_nn_relu());
    return m;
}

typedef struct layer_case {
    const char *name;
    build_fn build;
    int ndim;
    int64_t sizes[4];
} layer_case;

/* For gradcheck over a module's parameters: forward on a fixed input. */
typedef struct mod_gc {
    ag_module *m;
    ag_tensor *const *args;
    int nargs, out; /* which output */
} mod_gc;

static int mod_fn(void *ud, ag_tensor *const *in, int n, ag_tensor **outs, int *nouts) {
    (void)in;
    (void)n;
    const mod_gc *g = ud;
    ag_tensor *o[2];
    int k = ag_module_call(g->m, g->args, g->nargs, o, 2);
    if (k < 0)
        return k;
    outs[0] = o[g->out];
    *nouts = 1;
    return 0;
}

static void gradcheck_params(ag_module *m, ag_tensor *const *args, int nargs, int out) {
    ag_named_tensors nt;
    assert_int_equal(ag_module_named_parameters(m, true, &nt), 0);
    mod_gc g = {m, args, nargs, out};
    int rc = ag_gradcheck(mod_fn, &g, nt.tensors, nt.n,
                          &(ag_gradcheck_opts){.eps = 1e-6, .atol = 1e-6, .rtol = 1e-4});
    if (rc)
        print_error("%s: %s\n", ag_module_type(m), ag_last_error());
    assert_int_equal(rc, 0);
    ag_named_tensors_free(&nt);
}

static void test_float64_layers(void **st) {
    (void)st;
    const layer_case cases[] = {{"linear", b_linear, 2, {4, 5}},
                                {"conv", b_conv, 4, {2, 2, 5, 4}},
                                {"bn", b_bn, 4, {3, 2, 2, 3}},
                                {"ln", b_ln, 3, {2, 3, 5}},
                                {"cnn", b_cnn, 4, {2, 2, 8, 8}}};
    assert_int_equal(ag_get_default_dtype(), AG_F32);
    assert_int_equal(ag_set_default_dtype(AG_I64), AG_EINVAL);
    assert_int_equal(ag_get_default_dtype(), AG_F32);
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        /* Built directly in f64, and the same weights converted to f32. */
        assert_int_equal(ag_set_default_dtype(AG_F64), 0);
        ag_manual_seed(11);
        ag_module *m64 = cases[i].build();
        ag_manual_seed(11);
        ag_module *m32 = cases[i].build();
        assert_int_equal(ag_set_default_dtype(AG_F32), 0);
        assert_non_null(m64);
        assert_non_null(m32);
        assert_all_dtype(m64, AG_F64);
        assert_int_equal(ag_module_to_dtype(m32, AG_F32), 0);
        assert_all_dtype(m32, AG_F32);
        ag_scope_begin();
        ag_tensor *x64 = rand_t(AG_F64, cases[i].ndim, cases[i].sizes, -1, 1);
        ag_tensor *x32 = ag_to_dtype(x64, AG_F32);
        ag_tensor *y64 = ag_module_forward(m64, x64), *y32 = ag_module_forward(m32, x32);
        if (!y64)
            print_error("%s: %s\n", cases[i].name, ag_last_error());
        assert_non_null(y64);
        assert_non_null(y32);
        assert_int_equal(ag_tensor_dtype(y64), AG_F64);
        assert_int_equal(ag_tensor_dtype(y32), AG_F32);
        double d = tu_max_abs_diff(y64, y32);
        if (d > 1e-5)
            print_error("%s: f64 and f32 differ by %g\n", cases[i].name, d);
        assert_true(d <= 1e-5);
        ag_module *bn = ag_module_child(m64, "1");
        if (!strcmp(cases[i].name, "bn") || !strcmp(cases[i].name, "cnn")) {
            if (!strcmp(cases[i].name, "bn"))
                bn = m64;
            assert_int_equal(ag_tensor_dtype(ag_module_buffer(bn, "running_mean")), AG_F64);
            assert_int_equal(ag_tensor_dtype(ag_module_buffer(bn, "num_batches_tracked")), AG_I64);
        }
        gradcheck_params(m64, &x64, 1, 0);
        /* The f64 model exports and compiles: compiled equals eager. */
        export_matches_eager(m64, x64, 1e-12);
        ag_module_train(m64, false); /* eval: BatchNorm normalizes with the running stats */
        ag_tensor *e64 = ag_module_forward(m64, x64);
        assert_non_null(e64);
        assert_int_equal(ag_tensor_dtype(e64), AG_F64);
        ag_scope_end();
        ag_module_free(m64);
        ag_module_free(m32);
    }
}

/* GPT-2 (and so Embedding, LayerNorm, attention, GELU, the loss) built directly in f64 against
 * the same weights in f32. */
static void test_float64_gpt2(void **st) {
    (void)st;
    ag_gpt2_config c = mini_config();
    c.untied_lm_head = true;
    assert_int_equal(ag_set_default_dtype(AG_F64), 0);
    ag_manual_seed(21);
    ag_module *m64 = ag_nn_gpt2(&c);
    ag_manual_seed(21);
    ag_module *m32 = ag_nn_gpt2(&c);
    ag_manual_seed(21);
    ag_module *emb = ag_nn_embedding(11, 3);
    assert_int_equal(ag_set_default_dtype(AG_F32), 0);
    assert_non_null(m64);
    assert_non_null(emb);
    assert_all_dtype(m64, AG_F64);
    assert_all_dtype(emb, AG_F64);
    assert_int_equal(ag_module_to_dtype(m32, AG_F32), 0);
    ag_scope_begin();
    const int64_t tg[6] = {1, 2, 3, 10, -1, 0};
    ag_tensor *idx = tokens(2, 3, 11, NULL), *tgt = tokens(2, 3, 11, tg);
    ag_tensor *a[2], *b[2];
    assert_int_equal(ag_module_call(m64, (ag_tensor *[]){idx, tgt}, 2, a, 2), 2);
    assert_int_equal(ag_module_call(m32, (ag_tensor *[]){idx, tgt}, 2, b, 2), 2);
    assert_int_equal(ag_tensor_dtype(a[0]), AG_F64);
    assert_int_equal(ag_tensor_dtype(a[1]), AG_F64);
    assert_true(tu_max_abs_diff(a[0], b[0]) < 1e-5);
    assert_true(fabs(ag_tensor_item_at(a[1], 0) - ag_tensor_item_at(b[1], 0)) < 1e-5);
    double want = ce_of(a[0], tg, 6, 11, -1);
    assert_true(fabs(ag_tensor_item_at(a[1], 0) - want) < 1e-12);
    ag_tensor *e = ag_module_forward(emb, idx);
    assert_non_null(e);
    assert_int_equal(ag_tensor_dtype(e), AG_F64);
    tu_assert_shape(e, 3, (int64_t[]){2, 3, 3});
    ag_tensor *args[2] = {idx, tgt};
    gradcheck_params(m64, args, 2, 1);
    export_matches_eager(m64, idx, 1e-12);
    ag_scope_end();
    ag_module_free(m64);
    ag_module_free(m32);
    ag_module_free(emb);

    /* With dropout in training, attention takes nanoGPT's explicit path (masked_fill with
     * -inf, softmax, attention dropout): also float64 through. */
    c.dropout = 0.25;
    assert_int_equal(ag_set_default_dtype(AG_F64), 0);
    m64 = ag_nn_gpt2(&c);
    assert_int_equal(ag_set_default_dtype(AG_F32), 0);
    assert_non_null(m64);
    ag_scope_begin();
    ag_tensor *y = ag_module_forward(m64, tokens(2, 3, 11, NULL));
    assert_non_null(y);
    assert_int_equal(ag_tensor_dtype(y), AG_F64);
    for (int64_t i = 0; i < ag_tensor_numel(y); i++)
        assert_true(isfinite(ag_tensor_item_at(y, i)));
    ag_scope_end();
    ag_module_free(m64);
}

static void test_to_dtype(void **st) {
    (void)st;
    ag_gpt2_config c = mini_config();
    ag_manual_seed(5);
    ag_module *m = ag_nn_gpt2(&c);
    ag_manual_seed(5);
    ag_module *ref = ag_nn_gpt2(&c);
    ag_tensor *wte = ag_module_param(m, "transformer.wte.weight");
    ag_scope_begin();
    const int64_t tg[6] = {1, 2, 3, 10, -1, 0};
    ag_tensor *idx = tokens(2, 3, 11, NULL), *tgt = tokens(2, 3, 11, tg);
    /* A gradient converts with its parameter. */
    ag_tensor *o[2];
    assert_int_equal(ag_module_call(m, (ag_tensor *[]){idx, tgt}, 2, o, 2), 2);
    assert_int_equal(ag_backward(o[1], NULL, false), 0);
    assert_non_null(ag_tensor_grad(wte));
    double g0 = ag_tensor_item_at(ag_tensor_grad(wte), 3);

    assert_int_equal(ag_module_to_dtype(m, AG_F64), 0);
    assert_ptr_equal(ag_module_param(m, "transformer.wte.weight"), wte); /* identity kept */
    assert_ptr_equal(ag_module_param(m, "lm_head.weight"), wte);         /* still tied */
    assert_all_dtype(m, AG_F64);
    assert_int_equal(ag_tensor_dtype(ag_tensor_grad(wte)), AG_F64);
    assert_true(ag_tensor_item_at(ag_tensor_grad(wte), 3) == g0);
    ag_named_tensors nt;
    assert_int_equal(ag_module_named_parameters(m, true, &nt), 0);
    for (int i = 0; i < nt.n; i++)
        ag_tensor_set_grad(nt.tensors[i], NULL);
    ag_named_tensors_free(&nt);

    ag_tensor *r[2];
    assert_int_equal(ag_module_call(ref, (ag_tensor *[]){idx, tgt}, 2, r, 2), 2);
    assert_int_equal(ag_module_call(m, (ag_tensor *[]){idx, tgt}, 2, o, 2), 2);
    assert_int_equal(ag_tensor_dtype(o[1]), AG_F64);
    assert_true(tu_max_abs_diff(o[0], r[0]) < 1e-5);
    assert_true(fabs(ag_tensor_item_at(o[1], 0) - ag_tensor_item_at(r[1], 0)) < 1e-5);
    /* GPT-2 in f64 against finite differences (the loss, over every parameter). */
    ag_tensor *args[2] = {idx, tgt};
    gradcheck_params(m, args, 2, 1);

    /* And back to f32: the same values as the original (f32 -> f64 -> f32 is exact). */
    assert_int_equal(ag_module_to_dtype(m, AG_F32), 0);
    assert_all_dtype(m, AG_F32);
    assert_ptr_equal(ag_module_param(m, "lm_head.weight"), wte);
    assert_int_equal(ag_module_call(m, (ag_tensor *[]){idx, tgt}, 2, o, 2), 2);
    assert_true(tu_same_bits(o[0], r[0]));
    ag_scope_end();
    ag_module_free(ref);

    /* Failures change nothing: a non-float dtype, a buffer with autograd history (after
     * parameters that would convert). */
    assert_int_equal(ag_module_to_dtype(m, AG_I64), AG_EINVAL);
    tu_assert_error_contains("floating point");
    ag_scope_begin();
    ag_tensor *leaf = tu_leaf(AG_F32, 1, (int64_t[]){2}, (double[]){1, 2});
    assert_int_equal(ag_module_register_buffer(ag_module_child(m, "transformer.ln_f"), "hist",
                                               ag_mul_scalar(leaf, 2.0), true),
                     0);
    assert_int_equal(ag_module_to_dtype(m, AG_F64), AG_EINVAL);
    tu_assert_error_contains("transformer.ln_f.hist");
    assert_all_dtype(m, AG_F32);
    ag_scope_end();
    ag_module_free(m);
}

static int to_dtype_scenario(void *ud) {
    (void)ud;
    ag_module *m = ag_nn_batchnorm2d(3, 1e-5, 0.1);
    if (!m)
        return ag_last_status();
    ag_tensor *w = ag_module_param(m, "weight");
    int rc = ag_module_to_dtype(m, AG_F64);
    if (rc == 0 && (ag_tensor_dtype(w) != AG_F64 ||
                    ag_tensor_dtype(ag_module_buffer(m, "running_var")) != AG_F64 ||
                    ag_tensor_item_at(ag_module_buffer(m, "running_var"), 2) != 1.0))
        rc = -99;
    if (rc == AG_ENOMEM && ag_tensor_dtype(w) != AG_F32)
        rc = -98; /* a failure must leave it as it was */
    ag_module_free(m);
    return rc;
}

static void test_to_dtype_alloc_failures(void **st) {
    (void)st;
    assert_true(tu_alloc_failure_sweep(to_dtype_scenario, NULL, NULL) > 3);
}

/* The new modules built and called with every allocation failing in turn: AvgPool2d,
 * AdaptiveAvgPool2d, a weighted CrossEntropyLoss, an untied loss-only GPT-2. */
static int options_scenario(void *ud) {
    (void)ud;
    int rc = 0;
    ag_gpt2_config c = mini_config();
    c.untied_lm_head = true;
    c.loss_only = true;
    c.activation = AG_GPT2_RELU;
    ag_module *g = ag_nn_gpt2(&c);
    ag_module *s = ag_nn_sequential();
    if (!g || !s || ag_nn_append(s, ag_nn_avgpool2d(2, 1, 1, true, false, 3)) ||
        ag_nn_append(s, ag_nn_adaptive_avgpool2d(2, -1)))
        rc = ag_last_status();
    ag_scope_begin();
    ag_tensor *w = rc ? NULL : ag_full(AG_F32, 1, (int64_t[]){3}, 0.5);
    ag_module *ce = w ? ag_nn_cross_entropy_loss_ex(w, AG_REDUCTION_MEAN, 1, 0.2) : NULL;
    if (!rc && !ce)
        rc = ag_last_status();
    ag_tensor *o[1];
    if (!rc) {
        ag_tensor *x = ag_ones(AG_F32, 4, (int64_t[]){1, 2, 3, 3});
        ag_tensor *t = ag_zeros(AG_I64, 1, (int64_t[]){2});
        ag_tensor *y = x ? ag_module_forward(s, x) : NULL;
        ag_tensor *logits = y ? ag_reshape(y, 2, (int64_t[]){2, -1}) : NULL;
        ag_tensor *l3 = logits ? ag_slice(logits, 1, 0, 3, 1) : NULL;
        if (!t || !l3 || ag_module_call(ce, (ag_tensor *[]){l3, t}, 2, o, 1) < 0)
            rc = ag_last_status();
    }
    if (!rc) {
        ag_tensor *idx = ag_zeros(AG_I64, 2, (int64_t[]){1, 3});
        if (!idx || ag_module_call(g, (ag_tensor *[]){idx, idx}, 2, o, 1) != 1)
            rc = ag_last_status();
    }
    tu_alloc_cleanup_begin();
    ag_scope_end();
    ag_module_free(ce);
    ag_module_free(s);
    ag_module_free(g);
    tu_alloc_cleanup_end();
    return rc;
}

static void test_options_alloc_failures(void **st) {
    (void)st;
    assert_true(tu_alloc_failure_sweep(options_scenario, NULL,
                                       &(tu_sweep_opts){.what = "nn options",
                                                        .one_thread = true,
                                                        .every_up_to = 400,
                                                        .stride = 7}) > 50);
}

/* ---- custom modules through the public helpers ---- */

/* MyModule: y = child(x @ weight^T + bias), x must be (N, 4). */
static int my_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    int rc = ag_module_check_io(m, nin, 1, 1, max_out, 1);
    if (rc)
        return rc;
    ag_tensor *x = in[0];
    const int64_t *s = ag_tensor_sizes(x);
    if (ag_tensor_ndim(x) != 2 || s[1] != 4)
        return ag_set_error(AG_EINVAL, "mymodule: expected x of shape [N, 4], got [%lld, %lld]",
                            (long long)s[0], ag_tensor_ndim(x) > 1 ? (long long)s[1] : -1LL);
    ag_scope_begin();
    ag_tensor *h = ag_linear(x, ag_module_param(m, "weight"), ag_module_param(m, "bias"));
    return ag_module_return1(ag_module_forward_child(m, "act", h), out);
}

static ag_module *my_module(void) {
    ag_module *m = ag_module_new("MyModule", my_forward, NULL, NULL);
    int rc = m ? 0 : ag_last_status();
    if (!rc)
        rc = ag_module_add_tensor(m, "weight", true, ag_get_default_dtype(), 2, (int64_t[]){3, 4},
                                  AG_INIT_UNIFORM, -0.5, 0.5);
    if (!rc)
        rc = ag_module_add_tensor(m, "bias", true, ag_get_default_dtype(), 1, (int64_t[]){3},
                                  AG_INIT_ZEROS, 0, 0);
    if (!rc)
        rc = ag_module_add_tensor(m, "steps", false, AG_I64, 0, NULL, AG_INIT_ZEROS, 0, 0);
    if (!rc)
        rc = ag_module_add_child(m, "act", ag_nn_gelu("none"));
    if (rc) {
        ag_module_free(m);
        return NULL;
    }
    return m;
}

static void test_custom_module(void **st) {
    (void)st;
    ag_manual_seed(9);
    ag_module *m = my_module();
    assert_non_null(m);
    ag_tensor *w = ag_module_param(m, "weight");
    assert_true(ag_tensor_requires_grad(w));
    for (int i = 0; i < 12; i++)
        assert_true(fabs(ag_tensor_item_at(w, i)) <= 0.5);
    assert_int_equal(ag_tensor_dtype(ag_module_buffer(m, "steps")), AG_I64);
    ag_scope_begin();
    ag_tensor *bad = rand_t(AG_F32, 2, (int64_t[]){2, 3}, -1, 1);
    assert_null(ag_module_forward(m, bad));
    assert_string_equal(ag_last_error(), "mymodule: expected x of shape [N, 4], got [2, 3]");
    ag_joint *j = ag_export_joint(m, &bad, 1, NULL, NULL, 0, NULL);
    assert_null(j);
    assert_string_equal(ag_last_error(), "export: forward of MyModule failed: mymodule: expected "
                                         "x of shape [N, 4], got [2, 3]");
    /* A missing child is named. */
    assert_null(ag_module_forward_child(m, "nope", bad));
    tu_assert_error_contains("MyModule: no child module 'nope'");
    /* Wrong arity through the public check. */
    ag_tensor *o[1];
    assert_true(ag_module_call(m, (ag_tensor *[]){bad, bad}, 2, o, 1) < 0);
    tu_assert_error_contains("MyModule: forward takes 1 input, 2 given");
    /* Helpers refuse bad requests with nothing registered. */
    assert_int_equal(
        ag_module_add_tensor(m, "weight", true, AG_F32, 1, (int64_t[]){2}, AG_INIT_ZEROS, 0, 0),
        AG_EINVAL);
    tu_assert_error_contains("already exists");
    assert_int_equal(
        ag_module_add_tensor(m, "p", true, AG_I64, 1, (int64_t[]){2}, AG_INIT_ZEROS, 0, 0),
        AG_EINVAL);
    assert_null(ag_module_param(m, "p"));
    /* The good input exports, and compiled equals eager. */
    ag_tensor *x = rand_t(AG_F32, 2, (int64_t[]){5, 4}, -1, 1);
    export_matches_eager(m, x, 1e-6);
    /* And it converts to f64 with the rest (its integer buffer untouched). */
    assert_int_equal(ag_module_to_dtype(m, AG_F64), 0);
    assert_int_equal(ag_tensor_dtype(ag_module_param(m, "weight")), AG_F64);
    assert_int_equal(ag_tensor_dtype(ag_module_buffer(m, "steps")), AG_I64);
    ag_scope_end();
    ag_module_free(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_ce_values),
        cmocka_unit_test(test_ce_gradcheck),
        cmocka_unit_test(test_avgpool_module),
        cmocka_unit_test(test_pool_modules_export),
        cmocka_unit_test(test_gpt2_defaults_unchanged),
        cmocka_unit_test(test_gpt2_options),
        cmocka_unit_test(test_float64_layers),
        cmocka_unit_test(test_float64_gpt2),
        cmocka_unit_test(test_to_dtype),
        cmocka_unit_test(test_to_dtype_alloc_failures),
        cmocka_unit_test(test_options_alloc_failures),
        cmocka_unit_test(test_custom_module),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
