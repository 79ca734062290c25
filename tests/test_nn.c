/* Tests of src/nn: module trees and PyTorch's parameter/buffer names, the built-in layers,
 * BatchNorm's running statistics, GPT-2's structure, SGD and AdamW against their formulas,
 * safetensors files (round trip, mismatches, truncated and corrupted files), a small training
 * run, and allocation failures at every point of the main calls. Expected values are computed
 * here in double from the definitions, never by the code under test. */
#define _GNU_SOURCE /* memmem */
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- helpers ---- */

static uint64_t lcg_state = 12345;
static double lcg_unit(void) { /* deterministic uniform [0,1) */
    return tu_lcg(&lcg_state, 0, 1);
}

static ag_tensor *rand_tensor(ag_dtype dt, int ndim, const int64_t *sizes, double lo, double hi) {
    return tu_rand_tensor(dt, ndim, sizes, lo, hi, tu_lcg, &lcg_state);
}

static void assert_names(const ag_named_tensors *nt, const char *const *want, int n) {
    if (nt->n != n) {
        for (int i = 0; i < nt->n; i++)
            print_error("  got %s\n", nt->names[i]);
    }
    assert_int_equal(nt->n, n);
    for (int i = 0; i < n; i++)
        assert_string_equal(nt->names[i], want[i]);
}

static double mean_of(const ag_tensor *t) {
    double s = 0;
    int64_t n = ag_tensor_numel(t);
    for (int64_t i = 0; i < n; i++)
        s += ag_tensor_item_at(t, i);
    return s / (double)n;
}

static double std_of(const ag_tensor *t) {
    double m = mean_of(t), s = 0;
    int64_t n = ag_tensor_numel(t);
    for (int64_t i = 0; i < n; i++) {
        double d = ag_tensor_item_at(t, i) - m;
        s += d * d;
    }
    return sqrt(s / (double)n);
}

static char tmpdir[64];

static const char *tmp_path(const char *name) {
    static char buf[4][160];
    static int k;
    char *p = buf[k++ & 3];
    snprintf(p, 160, "%s/%s", tmpdir, name);
    return p;
}

static long read_file(const char *path, unsigned char **data) {
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    *data = malloc((size_t)n + 1);
    assert_int_equal(fread(*data, 1, (size_t)n, f), (size_t)n);
    fclose(f);
    return n;
}

static void write_file(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(data, 1, n, f), n);
    fclose(f);
}

/* A copy of every state tensor's values, to check that failed calls change nothing. */
typedef struct snapshot {
    int n;
    double **vals;
} snapshot;

static snapshot take_snapshot(const ag_module *m) {
    ag_named_tensors nt;
    assert_int_equal(ag_module_named_parameters(m, true, &nt), 0);
    ag_named_tensors nb;
    assert_int_equal(ag_module_named_buffers(m, true, &nb), 0);
    snapshot s = {nt.n + nb.n, calloc((size_t)(nt.n + nb.n), sizeof(double *))};
    for (int i = 0; i < s.n; i++) {
        ag_tensor *t = i < nt.n ? nt.tensors[i] : nb.tensors[i - nt.n];
        s.vals[i] = malloc(sizeof(double) * (size_t)(ag_tensor_numel(t) + 1));
        ag_tensor_to_doubles(t, s.vals[i]);
    }
    ag_named_tensors_free(&nt);
    ag_named_tensors_free(&nb);
    return s;
}

static bool snapshot_equal(const ag_module *m, const snapshot *s) {
    snapshot now = take_snapshot(m);
    ag_named_tensors nt, nb;
    ag_module_named_parameters(m, true, &nt);
    ag_module_named_buffers(m, true, &nb);
    bool eq = now.n == s->n;
    for (int i = 0; eq && i < s->n; i++) {
        ag_tensor *t = i < nt.n ? nt.tensors[i] : nb.tensors[i - nt.n];
        eq = memcmp(now.vals[i], s->vals[i], sizeof(double) * (size_t)ag_tensor_numel(t)) == 0;
    }
    ag_named_tensors_free(&nt);
    ag_named_tensors_free(&nb);
    for (int i = 0; i < now.n; i++)
        free(now.vals[i]);
    free(now.vals);
    return eq;
}

static void snapshot_free(snapshot *s) {
    for (int i = 0; i < s->n; i++)
        free(s->vals[i]);
    free(s->vals);
}

/* Sequential(Linear(4, 8), Sequential(Conv2d(3, 6, 3), BatchNorm2d(6)),
 *            ModuleList[Linear(2, 2), LayerNorm(5)]) */
static ag_module *nested_model(void) {
    ag_module *root = ag_nn_sequential();
    if (!root)
        return NULL;
    /* Containers are attached before they are filled: append takes ownership, so a failure
     * anywhere leaves one tree to free. */
    int rc = ag_nn_append(root, ag_nn_linear(4, 8, true));
    ag_module *inner = rc ? NULL : ag_nn_sequential();
    if (!rc)
        rc = ag_nn_append(root, inner);
    if (!rc)
        rc = ag_nn_append(inner, ag_nn_conv2d(3, 6, 3, 1, 0, 1, 1, true));
    if (!rc)
        rc = ag_nn_append(inner, ag_nn_batchnorm2d(6, 1e-5, 0.1));
    ag_module *list = rc ? NULL : ag_nn_module_list();
    if (!rc)
        rc = ag_nn_append(root, list);
    if (!rc)
        rc = ag_nn_append(list, ag_nn_linear(2, 2, true));
    if (!rc)
        rc = ag_nn_append(list, ag_nn_layernorm(5, 1e-5, true));
    if (rc) {
        ag_module_free(root);
        return NULL;
    }
    return root;
}

/* ---- module tree and names ---- */

static void test_fqn_order_nested(void **state) {
    (void)state;
    ag_module *m = nested_model();
    assert_non_null(m);
    ag_named_tensors nt;
    assert_int_equal(ag_module_named_parameters(m, true, &nt), 0);
    /* What PyTorch prints for [n for n, _ in model.named_parameters()]. */
    const char *want[] = {"0.weight", "0.bias",     "1.0.weight", "1.0.bias",   "1.1.weight",
                          "1.1.bias", "2.0.weight", "2.0.bias",   "2.1.weight", "2.1.bias"};
    assert_names(&nt, want, 10);
    /* Shapes: Linear (out, in); Conv2d (O, C/groups, k, k). */
    assert_int_equal(ag_tensor_size(nt.tensors[0], 0), 8);
    assert_int_equal(ag_tensor_size(nt.tensors[0], 1), 4);
    assert_int_equal(ag_tensor_ndim(nt.tensors[2]), 4);
    assert_int_equal(ag_tensor_size(nt.tensors[2], 0), 6);
    assert_int_equal(ag_tensor_size(nt.tensors[2], 1), 3);
    assert_int_equal(ag_tensor_size(nt.tensors[2], 3), 3);
    for (int i = 0; i < nt.n; i++)
        assert_true(ag_tensor_requires_grad(nt.tensors[i]));
    ag_named_tensors_free(&nt);

    ag_named_tensors nb;
    assert_int_equal(ag_module_named_buffers(m, true, &nb), 0);
    const char *wantb[] = {"1.1.running_mean", "1.1.running_var", "1.1.num_batches_tracked"};
    assert_names(&nb, wantb, 3);
    assert_int_equal(ag_tensor_dtype(nb.tensors[2]), AG_I64);
    assert_int_equal(ag_tensor_ndim(nb.tensors[2]), 0);
    assert_false(ag_tensor_requires_grad(nb.tensors[0]));
    ag_named_tensors_free(&nb);

    assert_int_equal(ag_module_num_parameters(m),
                     8 * 4 + 8 + 6 * 3 * 9 + 6 + 6 + 6 + 4 + 2 + 5 + 5);
    assert_string_equal(ag_module_type(ag_module_child(m, "1.0")), "Conv2d");
    assert_string_equal(ag_module_type(ag_module_child(m, "2")), "ModuleList");
    assert_null(ag_module_child(m, "1.7"));
    assert_ptr_equal(ag_module_param(m, "1.1.bias"),
                     ag_module_param(ag_module_child(m, "1.1"), "bias"));
    assert_non_null(ag_module_buffer(m, "1.1.running_var"));
    assert_null(ag_module_param(m, "1.1.running_var")); /* a buffer, not a parameter */
    assert_null(ag_module_param(m, "9.weight"));
    assert_int_equal(ag_module_num_children(m), 3);
    const char *name = NULL;
    assert_non_null(ag_module_child_at(m, 2, &name));
    assert_string_equal(name, "2");

    /* train/eval reach every descendant. */
    assert_true(ag_module_is_training(ag_module_child(m, "1.1")));
    ag_module_train(m, false);
    assert_false(ag_module_is_training(ag_module_child(m, "1.1")));
    assert_false(ag_module_is_training(ag_module_child(m, "2.0")));
    ag_module_train(m, true);
    assert_true(ag_module_is_training(ag_module_child(m, "2.1")));

    /* A ModuleList is a container without forward. */
    ag_tensor *x = rand_tensor(AG_F32, 1, (int64_t[]){2}, -1, 1);
    assert_null(ag_module_forward(ag_module_child(m, "2"), x));
    tu_assert_error_contains("ModuleList");
    tu_assert_error_contains("no forward");
    ag_tensor_free(x);
    ag_module_free(m);
}

static void test_own_params_before_children(void **state) {
    (void)state;
    ag_module *m = ag_module_new("Custom", NULL, NULL, NULL);
    ag_tensor *a = rand_tensor(AG_F32, 1, (int64_t[]){3}, -1, 1);
    ag_tensor *z = rand_tensor(AG_F32, 1, (int64_t[]){2}, -1, 1);
    ag_tensor *buf = rand_tensor(AG_F32, 1, (int64_t[]){2}, -1, 1);
    assert_int_equal(ag_module_register_parameter(m, "a", a), 0);
    assert_int_equal(ag_module_add_child(m, "sub", ag_nn_linear(2, 3, true)), 0);
    assert_int_equal(ag_module_register_parameter(m, "z", z), 0);
    assert_int_equal(ag_module_register_buffer(m, "scratch", buf, false), 0);
    assert_true(ag_tensor_requires_grad(a));

    /* A module's own parameters come before its children's, whatever the registration order. */
    ag_named_tensors nt;
    assert_int_equal(ag_module_named_parameters(m, true, &nt), 0);
    const char *want[] = {"a", "z", "sub.weight", "sub.bias"};
    assert_names(&nt, want, 4);
    assert_ptr_equal(nt.tensors[0], a);
    ag_named_tensors_free(&nt);
    ag_named_tensors nb;
    assert_int_equal(ag_module_named_buffers(m, true, &nb), 0);
    const char *wantb[] = {"scratch"};
    assert_names(&nb, wantb, 1);
    ag_named_tensors_free(&nb);

    /* Name rules and bad tensors. */
    assert_int_equal(ag_module_register_parameter(m, "a", z), AG_EINVAL);
    tu_assert_error_contains("already exists");
    assert_int_equal(ag_module_register_buffer(m, "sub", z, true), AG_EINVAL);
    tu_assert_error_contains("already exists");
    assert_int_equal(ag_module_register_parameter(m, "x.y", z), AG_EINVAL);
    tu_assert_error_contains("can't contain '.'");
    assert_int_equal(ag_module_register_parameter(m, "", z), AG_EINVAL);
    ag_tensor *idx = tu_tensor(AG_I64, 1, (int64_t[]){2}, (double[]){1, 2});
    assert_int_equal(ag_module_register_parameter(m, "i", idx), AG_EINVAL);
    tu_assert_error_contains("floating point");
    ag_tensor *nonleaf = ag_mul_scalar(a, 2.0); /* a requires grad: the result has history */
    assert_non_null(nonleaf);
    assert_int_equal(ag_module_register_parameter(m, "nl", nonleaf), AG_EINVAL);
    tu_assert_error_contains("non-leaf");
    ag_clear_error();
    assert_int_equal(ag_module_register_parameter(m, "n", NULL), AG_EINVAL);
    /* A failed registration changed nothing. */
    assert_int_equal(ag_module_num_parameters(m), 3 + 2 + 6 + 3);

    /* add_child: a module with a parent, and a NULL child from a failed constructor. */
    ag_module *sub = ag_module_child(m, "sub");
    ag_module *other = ag_nn_sequential();
    assert_int_equal(ag_module_add_child(other, "s", sub), AG_EINVAL);
    tu_assert_error_contains("already has a parent");
    assert_null(ag_nn_linear(0, 3, true));
    tu_assert_error_contains("Linear");
    assert_int_equal(ag_nn_append(other, ag_nn_linear(-1, 3, true)), AG_EINVAL);
    tu_assert_error_contains("in_features"); /* the constructor's message is kept */
    assert_int_equal(ag_module_num_children(other), 0);
    ag_module_free(other);

    ag_tensor_free(nonleaf);
    ag_tensor_free(idx);
    ag_tensor_free(a);
    ag_tensor_free(z);
    ag_tensor_free(buf);
    ag_module_free(m);
}

static void test_remove_duplicate_tied(void **state) {
    (void)state;
    ag_module *root = ag_module_new("Tied", NULL, NULL, NULL);
    ag_module *enc = ag_nn_linear(3, 4, false);
    ag_module *dec = ag_module_new("Decoder", NULL, NULL, NULL);
    ag_tensor *w = ag_module_param(enc, "weight");
    assert_int_equal(ag_module_register_parameter(dec, "weight", w), 0);
    assert_int_equal(ag_module_add_child(root, "enc", enc), 0);
    assert_int_equal(ag_module_add_child(root, "dec", dec), 0);
    ag_named_tensors nt;
    assert_int_equal(ag_module_named_parameters(root, true, &nt), 0);
    const char *dedup[] = {"enc.weight"};
    assert_names(&nt, dedup, 1);
    ag_named_tensors_free(&nt);
    assert_int_equal(ag_module_named_parameters(root, false, &nt), 0);
    const char *all[] = {"enc.weight", "dec.weight"};
    assert_names(&nt, all, 2);
    assert_ptr_equal(nt.tensors[0], nt.tensors[1]);
    ag_named_tensors_free(&nt);
    assert_int_equal(ag_module_num_parameters(root), 12);
    ag_module_free(root);
}

/* ---- GPT-2 ---- */

static void test_gpt2_tiny_names(void **state) {
    (void)state;
    ag_manual_seed(1);
    ag_gpt2_config c = ag_gpt2_config_tiny();
    assert_int_equal(c.n_layer, 2);
    assert_int_equal(c.n_embd, 64);
    assert_int_equal(c.vocab_size, 256);
    ag_module *m = ag_nn_gpt2(&c);
    assert_non_null(m);

    char want[64][80];
    const char *wantp[64];
    int n = 0;
    snprintf(want[n++], 80, "transformer.wte.weight");
    snprintf(want[n++], 80, "transformer.wpe.weight");
    const char *per_block[] = {"ln_1.weight",      "ln_1.bias",          "attn.c_attn.weight",
                               "attn.c_attn.bias", "attn.c_proj.weight", "attn.c_proj.bias",
                               "ln_2.weight",      "ln_2.bias",          "mlp.c_fc.weight",
                               "mlp.c_fc.bias",    "mlp.c_proj.weight",  "mlp.c_proj.bias"};
    for (int l = 0; l < c.n_layer; l++)
        for (int k = 0; k < 12; k++)
            snprintf(want[n++], 80, "transformer.h.%d.%s", l, per_block[k]);
    snprintf(want[n++], 80, "transformer.ln_f.weight");
    snprintf(want[n++], 80, "transformer.ln_f.bias");
    snprintf(want[n++], 80, "lm_head.weight");
    for (int i = 0; i < n; i++)
        wantp[i] = want[i];

    ag_named_tensors nt;
    assert_int_equal(ag_module_named_parameters(m, true, &nt), 0);
    assert_names(&nt, wantp, n - 1); /* lm_head.weight is transformer.wte.weight */
    ag_named_tensors_free(&nt);
    assert_int_equal(ag_module_named_parameters(m, false, &nt), 0);
    assert_names(&nt, wantp, n);
    assert_ptr_equal(nt.tensors[n - 1], nt.tensors[0]);
    ag_named_tensors_free(&nt);
    ag_named_tensors nb;
    assert_int_equal(ag_module_named_buffers(m, true, &nb), 0);
    assert_int_equal(nb.n, 0);
    ag_named_tensors_free(&nb);

    int64_t C = c.n_embd, V = c.vocab_size, L = c.n_layer;
    int64_t per_layer =
        2 * C + (C * 3 * C + 3 * C) + (C * C + C) + 2 * C + (C * 4 * C + 4 * C) + (4 * C * C + C);
    assert_int_equal(ag_module_num_parameters(m), V * C + c.block_size * C + L * per_layer + 2 * C);

    /* nanoGPT's initialization. */
    ag_tensor *wte = ag_module_param(m, "transformer.wte.weight");
    assert_int_equal(ag_tensor_size(wte, 0), V);
    assert_true(fabs(std_of(wte) - 0.02) < 0.002);
    ag_tensor *cattn = ag_module_param(m, "transformer.h.0.attn.c_attn.weight");
    assert_int_equal(ag_tensor_size(cattn, 0), 3 * C);
    assert_int_equal(ag_tensor_size(cattn, 1), C);
    assert_true(fabs(std_of(cattn) - 0.02) < 0.001);
    double proj_std = 0.02 / sqrt(2.0 * (double)L);
    assert_true(fabs(std_of(ag_module_param(m, "transformer.h.1.attn.c_proj.weight")) - proj_std) <
                0.001);
    assert_true(fabs(std_of(ag_module_param(m, "transformer.h.1.mlp.c_proj.weight")) - proj_std) <
                0.0006);
    assert_true(fabs(std_of(ag_module_param(m, "transformer.h.1.mlp.c_fc.weight")) - 0.02) < 0.001);
    ag_tensor *bias = ag_module_param(m, "transformer.h.0.mlp.c_fc.bias");
    assert_true(std_of(bias) == 0 && mean_of(bias) == 0);
    ag_tensor *lnw = ag_module_param(m, "transformer.ln_f.weight");
    assert_true(std_of(lnw) == 0 && mean_of(lnw) == 1);
    ag_module_free(m);

    /* bias=false drops every Linear and LayerNorm bias (nanoGPT's config.bias). */
    c.bias = false;
    m = ag_nn_gpt2(&c);
    assert_non_null(m);
    assert_int_equal(ag_module_named_parameters(m, true, &nt), 0);
    assert_int_equal(nt.n, 2 + 6 * L + 1);
    for (int i = 0; i < nt.n; i++)
        assert_null(strstr(nt.names[i], "bias"));
    ag_named_tensors_free(&nt);
    ag_module_free(m);

    c = ag_gpt2_config_tiny();
    c.n_head = 5;
    assert_null(ag_nn_gpt2(&c));
    tu_assert_error_contains("divisible");

    ag_gpt2_config s = ag_gpt2_config_small();
    assert_int_equal(s.n_layer, 12);
    assert_int_equal(s.n_head, 12);
    assert_int_equal(s.n_embd, 768);
    assert_int_equal(s.vocab_size, 50257);
    assert_int_equal(s.block_size, 1024);
}

static ag_tensor *rand_tokens(int64_t B, int64_t T, int64_t V) {
    double v[256];
    assert_true(B * T <= 256);
    for (int64_t i = 0; i < B * T; i++)
        v[i] = floor(lcg_unit() * (double)V);
    return tu_tensor(AG_I64, 2, (int64_t[]){B, T}, v);
}

static void test_gpt2_forward(void **state) {
    (void)state;
    ag_manual_seed(2);
    ag_gpt2_config c = ag_gpt2_config_tiny();
    ag_module *m = ag_nn_gpt2(&c);
    assert_non_null(m);
    int64_t B = 2, T = 8, V = c.vocab_size;
    ag_tensor *idx = rand_tokens(B, T, V);
    ag_tensor *tgt = rand_tokens(B, T, V);

    ag_tensor *logits = ag_module_forward(m, idx);
    assert_non_null(logits);
    assert_int_equal(ag_tensor_ndim(logits), 3);
    assert_int_equal(ag_tensor_size(logits, 0), B);
    assert_int_equal(ag_tensor_size(logits, 1), T);
    assert_int_equal(ag_tensor_size(logits, 2), V);

    /* Causality: changing the last token leaves the earlier positions' logits unchanged, and
     * changes the last position's. */
    ag_tensor *idx2 = ag_clone(idx);
    ((int64_t *)ag_tensor_data(idx2))[T - 1] = (((int64_t *)ag_tensor_data(idx))[T - 1] + 7) % V;
    ag_tensor *logits2 = ag_module_forward(m, idx2);
    assert_non_null(logits2);
    double early = 0, last = 0;
    for (int64_t t = 0; t < T; t++)
        for (int64_t v = 0; v < V; v++) {
            double d =
                fabs(ag_tensor_item_at(logits, t * V + v) - ag_tensor_item_at(logits2, t * V + v));
            if (t < T - 1)
                early = fmax(early, d);
            else
                last = fmax(last, d);
        }
    assert_true(early < 1e-5);
    assert_true(last > 1e-4);

    /* With targets: (logits, loss); at init the logits are small, so the loss is near ln V. */
    ag_tensor *outs[2] = {NULL, NULL};
    assert_int_equal(ag_module_call(m, (ag_tensor *[]){idx, tgt}, 2, outs, 2), 2);
    assert_int_equal(ag_tensor_ndim(outs[1]), 0);
    double loss0 = ag_tensor_item(outs[1]);
    assert_true(fabs(loss0 - log((double)V)) < 0.1);
    assert_int_equal(ag_backward(outs[1], NULL, false), 0);
    ag_named_tensors nt;
    assert_int_equal(ag_module_named_parameters(m, true, &nt), 0);
    for (int i = 0; i < nt.n; i++) {
        if (!ag_tensor_grad(nt.tensors[i]))
            print_error("no grad for %s\n", nt.names[i]);
        assert_non_null(ag_tensor_grad(nt.tensors[i]));
    }
    ag_named_tensors_free(&nt);
    ag_tensor_free(outs[0]);
    ag_tensor_free(outs[1]);

    /* A few AdamW steps on the same batch lower the loss (an end-to-end smoke test). */
    ag_optim *o = ag_optim_adamw(m, 3e-3, 0.9, 0.95, 1e-8, 0.1);
    assert_non_null(o);
    double loss = loss0;
    for (int step = 0; step < 15; step++) {
        ag_optim_step(o);
        ag_optim_zero_grad(o);
        ag_scope_begin();
        assert_int_equal(ag_module_call(m, (ag_tensor *[]){idx, tgt}, 2, outs, 2), 2);
        loss = ag_tensor_item(outs[1]);
        assert_int_equal(ag_backward(outs[1], NULL, false), 0);
        ag_scope_end();
    }
    assert_true(loss < 0.7 * loss0);
    ag_optim_free(o);

    /* Errors: too long a sequence, wrong dtype, no room for two outputs. */
    ag_tensor *long_idx = ag_zeros(AG_I64, 2, (int64_t[]){1, c.block_size + 1});
    assert_null(ag_module_forward(m, long_idx));
    tu_assert_error_contains("block size is only 64");
    ag_tensor *fidx = ag_zeros(AG_F32, 2, (int64_t[]){1, 4});
    assert_null(ag_module_forward(m, fidx));
    tu_assert_error_contains("int64");
    assert_true(ag_module_call(m, (ag_tensor *[]){idx, tgt}, 2, outs, 1) < 0);
    tu_assert_error_contains("GPT");
    assert_null(outs[0]);

    ag_tensor_free(long_idx);
    ag_tensor_free(fidx);
    ag_tensor_free(logits);
    ag_tensor_free(logits2);
    ag_tensor_free(idx);
    ag_tensor_free(idx2);
    ag_tensor_free(tgt);
    ag_module_free(m);
}

/* ---- layers ---- */

static void test_layer_inits(void **state) {
    (void)state;
    ag_manual_seed(3);
    ag_module *lin = ag_nn_linear(100, 50, true);
    ag_tensor *w = ag_module_param(lin, "weight"), *b = ag_module_param(lin, "bias");
    assert_int_equal(ag_tensor_size(w, 0), 50);
    assert_int_equal(ag_tensor_size(w, 1), 100);
    double bound = 1.0 / sqrt(100.0);
    for (int64_t i = 0; i < ag_tensor_numel(w); i++)
        assert_true(fabs(ag_tensor_item_at(w, i)) <= bound);
    for (int64_t i = 0; i < ag_tensor_numel(b); i++)
        assert_true(fabs(ag_tensor_item_at(b, i)) <= bound);
    /* U(-a, a) has std a/sqrt(3). */
    assert_true(fabs(std_of(w) - bound / sqrt(3.0)) < 0.05 * bound);
    ag_module_free(lin);

    ag_module *conv = ag_nn_conv2d(4, 8, 3, 1, 1, 1, 2, true);
    w = ag_module_param(conv, "weight");
    assert_int_equal(ag_tensor_size(w, 0), 8);
    assert_int_equal(ag_tensor_size(w, 1), 2);
    bound = 1.0 / sqrt(2.0 * 9.0);
    double mx = 0;
    for (int64_t i = 0; i < ag_tensor_numel(w); i++)
        mx = fmax(mx, fabs(ag_tensor_item_at(w, i)));
    assert_true(mx <= bound && mx > 0.8 * bound);
    ag_module_free(conv);
    assert_null(ag_nn_conv2d(3, 8, 3, 1, 1, 1, 2, true));
    tu_assert_error_contains("divisible by groups");

    ag_module *emb = ag_nn_embedding(100, 40);
    assert_true(fabs(std_of(ag_module_param(emb, "weight")) - 1.0) < 0.05);
    ag_module_free(emb);

    ag_module *ln = ag_nn_layernorm(6, 1e-5, true);
    assert_true(mean_of(ag_module_param(ln, "weight")) == 1 &&
                std_of(ag_module_param(ln, "weight")) == 0);
    assert_true(mean_of(ag_module_param(ln, "bias")) == 0 &&
                std_of(ag_module_param(ln, "bias")) == 0);
    ag_module_free(ln);
    ln = ag_nn_layernorm(6, 1e-5, false);
    assert_int_equal(ag_module_num_parameters(ln), 0);
    ag_module_free(ln);

    ag_module *bn = ag_nn_batchnorm2d(3, 1e-5, 0.1);
    assert_true(mean_of(ag_module_param(bn, "weight")) == 1);
    assert_true(mean_of(ag_module_buffer(bn, "running_var")) == 1);
    assert_true(mean_of(ag_module_buffer(bn, "running_mean")) == 0);
    assert_true(ag_tensor_item(ag_module_buffer(bn, "num_batches_tracked")) == 0);
    ag_module_free(bn);
}

static void test_layer_forwards(void **state) {
    (void)state;
    ag_manual_seed(4);
    /* Sequential(Flatten(), Linear(6, 3), ReLU()) on x (2, 2, 3) against x W^T + b by hand. */
    ag_module *seq = ag_nn_sequential();
    assert_int_equal(ag_nn_append(seq, ag_nn_flatten(1, -1)), 0);
    assert_int_equal(ag_nn_append(seq, ag_nn_linear(6, 3, true)), 0);
    assert_int_equal(ag_nn_append(seq, ag_nn_relu()), 0);
    ag_tensor *x = rand_tensor(AG_F32, 3, (int64_t[]){2, 2, 3}, -1, 1);
    ag_tensor *y = ag_module_forward(seq, x);
    assert_non_null(y);
    ag_tensor *w = ag_module_param(seq, "1.weight"), *b = ag_module_param(seq, "1.bias");
    double want[6];
    for (int n = 0; n < 2; n++)
        for (int o = 0; o < 3; o++) {
            double s = ag_tensor_item_at(b, o);
            for (int i = 0; i < 6; i++)
                s += ag_tensor_item_at(x, n * 6 + i) * ag_tensor_item_at(w, o * 6 + i);
            want[n * 3 + o] = s > 0 ? s : 0;
        }
    tu_assert_values(y, 2, (int64_t[]){2, 3}, want, 1e-5);
    ag_tensor_free(y);

    /* Inside a scope the output belongs to the scope (no free needed, no leak). */
    ag_scope_begin();
    assert_non_null(ag_module_forward(seq, x));
    ag_scope_end();

    /* Wrong arity is an error naming the module. */
    ag_tensor *outs[1];
    assert_true(ag_module_call(ag_module_child(seq, "1"), (ag_tensor *[]){x, x}, 2, outs, 1) < 0);
    tu_assert_error_contains("Linear");
    ag_module_free(seq);
    ag_tensor_free(x);

    /* Dropout: identity in eval; in training zeros or scaled by 1/(1-p). */
    ag_module *drop = ag_nn_dropout(0.5);
    ag_tensor *ones = ag_ones(AG_F32, 1, (int64_t[]){1000});
    y = ag_module_forward(drop, ones);
    int zeros = 0;
    for (int64_t i = 0; i < 1000; i++) {
        double v = ag_tensor_item_at(y, i);
        assert_true(v == 0.0 || fabs(v - 2.0) < 1e-6);
        zeros += v == 0.0;
    }
    assert_true(zeros > 400 && zeros < 600);
    ag_tensor_free(y);
    ag_module_train(drop, false);
    y = ag_module_forward(drop, ones);
    for (int64_t i = 0; i < 1000; i++)
        assert_true(ag_tensor_item_at(y, i) == 1.0);
    ag_tensor_free(y);
    ag_module_free(drop);
    ag_tensor_free(ones);
    assert_null(ag_nn_dropout(1.5));

    /* GELU(tanh) against its formula. */
    ag_module *gelu = ag_nn_gelu("tanh");
    ag_tensor *g_in = tu_tensor(AG_F64, 1, (int64_t[]){3}, (double[]){-1.5, 0.3, 2.0});
    y = ag_module_forward(gelu, g_in);
    double gw[3];
    for (int i = 0; i < 3; i++) {
        double v = ag_tensor_item_at(g_in, i);
        gw[i] = 0.5 * v * (1 + tanh(sqrt(2 / M_PI) * (v + 0.044715 * v * v * v)));
    }
    tu_assert_values(y, 1, (int64_t[]){3}, gw, 1e-9);
    ag_tensor_free(y);
    ag_tensor_free(g_in);
    ag_module_free(gelu);
    assert_null(ag_nn_gelu("fast"));
    tu_assert_error_contains("GELU");

    /* MaxPool2d(2): stride defaults to the kernel. */
    ag_module *pool = ag_nn_maxpool2d(2, 0, 0);
    ag_tensor *p_in = tu_tensor(AG_F32, 4, (int64_t[]){1, 1, 4, 4},
                                (double[]){1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16});
    y = ag_module_forward(pool, p_in);
    tu_assert_values(y, 4, (int64_t[]){1, 1, 2, 2}, (double[]){6, 8, 14, 16}, 0);
    ag_tensor_free(y);
    ag_tensor_free(p_in);
    ag_module_free(pool);

    /* Embedding rows; LayerNorm by hand. */
    ag_module *emb = ag_nn_embedding(5, 3);
    ag_tensor *ids = tu_tensor(AG_I64, 1, (int64_t[]){2}, (double[]){4, 1});
    y = ag_module_forward(emb, ids);
    ag_tensor *ew = ag_module_param(emb, "weight");
    double ewant[6];
    for (int k = 0; k < 3; k++) {
        ewant[k] = ag_tensor_item_at(ew, 4 * 3 + k);
        ewant[3 + k] = ag_tensor_item_at(ew, 1 * 3 + k);
    }
    tu_assert_values(y, 2, (int64_t[]){2, 3}, ewant, 0);
    ag_tensor_free(y);
    ag_tensor_free(ids);
    ag_module_free(emb);

    ag_module *ln = ag_nn_layernorm(4, 1e-5, true);
    ag_tensor *l_in = tu_tensor(AG_F32, 2, (int64_t[]){2, 4}, (double[]){1, 2, 3, 4, -2, 0, 0, 6});
    y = ag_module_forward(ln, l_in);
    double lw[8];
    for (int r = 0; r < 2; r++) {
        double mu = 0, var = 0;
        for (int k = 0; k < 4; k++)
            mu += ag_tensor_item_at(l_in, r * 4 + k) / 4;
        for (int k = 0; k < 4; k++)
            var += pow(ag_tensor_item_at(l_in, r * 4 + k) - mu, 2) / 4;
        for (int k = 0; k < 4; k++)
            lw[r * 4 + k] = (ag_tensor_item_at(l_in, r * 4 + k) - mu) / sqrt(var + 1e-5);
    }
    tu_assert_values(y, 2, (int64_t[]){2, 4}, lw, 1e-5);
    ag_tensor_free(y);
    ag_tensor_free(l_in);
    ag_module_free(ln);

    /* CrossEntropyLoss(mean) against -mean(log softmax[target]). */
    ag_module *ce = ag_nn_cross_entropy_loss(AG_REDUCTION_MEAN, -100);
    ag_tensor *logits = tu_tensor(AG_F64, 2, (int64_t[]){2, 3}, (double[]){1, 2, 3, 0.5, -1, 2});
    ag_tensor *tgt = tu_tensor(AG_I64, 1, (int64_t[]){2}, (double[]){0, 2});
    ag_tensor *loss = NULL;
    assert_int_equal(ag_module_call(ce, (ag_tensor *[]){logits, tgt}, 2, &loss, 1), 1);
    double l0 = -(1 - log(exp(1) + exp(2) + exp(3)));
    double l1 = -(2 - log(exp(0.5) + exp(-1) + exp(2)));
    tu_assert_values(loss, 0, NULL, (double[]){(l0 + l1) / 2}, 1e-12);
    ag_tensor_free(loss);
    ag_tensor_free(logits);
    ag_tensor_free(tgt);
    ag_module_free(ce);

    /* Flatten of dims 0..1 of a (2, 3, 4) tensor; start after end is an error. */
    ag_module *fl = ag_nn_flatten(0, 1);
    ag_tensor *f_in = ag_zeros(AG_F32, 3, (int64_t[]){2, 3, 4});
    y = ag_module_forward(fl, f_in);
    assert_int_equal(ag_tensor_ndim(y), 2);
    assert_int_equal(ag_tensor_size(y, 0), 6);
    assert_int_equal(ag_tensor_size(y, 1), 4);
    ag_tensor_free(y);
    ag_module_free(fl);
    fl = ag_nn_flatten(2, 0);
    assert_null(ag_module_forward(fl, f_in));
    tu_assert_error_contains("Flatten");
    ag_module_free(fl);
    ag_tensor_free(f_in);
}

/* ---- BatchNorm2d running statistics ---- */

/* Per-channel mean and biased/unbiased variance over (N, H, W) of x (N, C, H, W). */
static void channel_stats(const ag_tensor *x, int c, double *mean, double *var_b, double *var_u) {
    int64_t N = ag_tensor_size(x, 0), C = ag_tensor_size(x, 1);
    int64_t HW = ag_tensor_size(x, 2) * ag_tensor_size(x, 3), cnt = N * HW;
    double s = 0, ss = 0;
    for (int64_t n = 0; n < N; n++)
        for (int64_t k = 0; k < HW; k++)
            s += ag_tensor_item_at(x, (n * C + c) * HW + k);
    *mean = s / (double)cnt;
    for (int64_t n = 0; n < N; n++)
        for (int64_t k = 0; k < HW; k++)
            ss += pow(ag_tensor_item_at(x, (n * C + c) * HW + k) - *mean, 2);
    *var_b = ss / (double)cnt;
    *var_u = ss / (double)(cnt - 1);
}

static void test_batchnorm_running_stats(void **state) {
    (void)state;
    const int C = 3;
    const double eps = 1e-5, mom = 0.1;
    ag_module *bn = ag_nn_batchnorm2d(C, eps, mom);
    ag_tensor *x1 = rand_tensor(AG_F32, 4, (int64_t[]){4, C, 2, 3}, -1, 3);
    ag_tensor *x2 = rand_tensor(AG_F32, 4, (int64_t[]){4, C, 2, 3}, -4, 1);
    double rm[3] = {0, 0, 0}, rv[3] = {1, 1, 1};
    ag_tensor *xs[2] = {x1, x2};
    for (int step = 0; step < 2; step++) {
        ag_tensor *y = ag_module_forward(bn, xs[step]);
        assert_non_null(y);
        double want[72];
        for (int c = 0; c < C; c++) {
            double mean, vb, vu;
            channel_stats(xs[step], c, &mean, &vb, &vu);
            rm[c] = (1 - mom) * rm[c] + mom * mean;
            rv[c] = (1 - mom) * rv[c] + mom * vu; /* unbiased variance in the running stat */
            for (int n = 0; n < 4; n++)
                for (int k = 0; k < 6; k++) {
                    int64_t i = (n * C + c) * 6 + k;
                    want[i] = (ag_tensor_item_at(xs[step], i) - mean) / sqrt(vb + eps);
                }
        }
        tu_assert_values(y, 4, (int64_t[]){4, C, 2, 3}, want, 1e-5);
        ag_tensor_free(y);
    }
    tu_assert_values(ag_module_buffer(bn, "running_mean"), 1, (int64_t[]){C}, rm, 1e-6);
    tu_assert_values(ag_module_buffer(bn, "running_var"), 1, (int64_t[]){C}, rv, 1e-6);
    ag_tensor *nbt = ag_module_buffer(bn, "num_batches_tracked");
    assert_int_equal(ag_tensor_dtype(nbt), AG_I64);
    assert_int_equal(ag_tensor_ndim(nbt), 0);
    assert_true(ag_tensor_item(nbt) == 2);

    /* Eval: the running statistics normalize, and nothing is updated. */
    ag_module_train(bn, false);
    ag_tensor *y = ag_module_forward(bn, x1);
    double want[72];
    for (int c = 0; c < C; c++)
        for (int n = 0; n < 4; n++)
            for (int k = 0; k < 6; k++) {
                int64_t i = (n * C + c) * 6 + k;
                want[i] = (ag_tensor_item_at(x1, i) - rm[c]) / sqrt(rv[c] + eps);
            }
    tu_assert_values(y, 4, (int64_t[]){4, C, 2, 3}, want, 1e-5);
    tu_assert_values(ag_module_buffer(bn, "running_mean"), 1, (int64_t[]){C}, rm, 1e-6);
    assert_true(ag_tensor_item(nbt) == 2);
    ag_tensor_free(y);

    ag_tensor *x3 = ag_zeros(AG_F32, 3, (int64_t[]){4, C, 2});
    assert_null(ag_module_forward(bn, x3));
    tu_assert_error_contains("expected 4D input (got 3D input)");
    ag_tensor_free(x3);
    ag_tensor_free(x1);
    ag_tensor_free(x2);
    ag_module_free(bn);
}

/* ---- optimizers ---- */

/* A module holding one parameter "w" with the given values. */
static ag_module *holder(ag_dtype dt, int n, const double *vals) {
    ag_module *m = ag_module_new("Holder", NULL, NULL, NULL);
    ag_tensor *w = tu_tensor(dt, 1, (int64_t[]){n}, vals);
    assert_int_equal(ag_module_register_parameter(m, "w", w), 0);
    ag_tensor_free(w);
    return m;
}

static void set_grad(ag_tensor *p, const double *g) {
    ag_tensor *t = tu_tensor(ag_tensor_dtype(p), 1, (int64_t[]){ag_tensor_numel(p)}, g);
    assert_int_equal(ag_tensor_set_grad(p, t), 0);
    ag_tensor_free(t);
}

static void test_sgd(void **state) {
    (void)state;
    const double p0[3] = {1.0, -2.0, 0.5}, g1[3] = {0.3, -0.1, 2.0}, g2[3] = {-0.5, 0.2, 1.0};
    for (int variant = 0; variant < 3; variant++) {
        double lr = 0.1, mu = 0.9, wd = variant >= 1 ? 0.01 : 0.0;
        bool nesterov = variant == 2;
        ag_module *m = holder(AG_F64, 3, p0);
        ag_tensor *p = ag_module_param(m, "w");
        ag_optim *o = ag_optim_sgd(m, lr, mu, wd, nesterov);
        assert_non_null(o);
        double want[3], buf[3];
        memcpy(want, p0, sizeof want);
        for (int step = 0; step < 2; step++) {
            const double *g = step ? g2 : g1;
            set_grad(p, g);
            uint64_t v0 = ag_tensor_version(p);
            assert_int_equal(ag_optim_step(o), 0);
            assert_true(ag_tensor_version(p) > v0);
            for (int i = 0; i < 3; i++) {
                double d = g[i] + wd * want[i];
                buf[i] = step == 0 ? d : mu * buf[i] + d;
                d = nesterov ? d + mu * buf[i] : buf[i];
                want[i] -= lr * d;
            }
            tu_assert_values(p, 1, (int64_t[]){3}, want, 1e-14);
        }
        /* zero_grad sets grads to None; a step without grads changes nothing. */
        ag_optim_zero_grad(o);
        assert_null(ag_tensor_grad(p));
        assert_int_equal(ag_optim_step(o), 0);
        tu_assert_values(p, 1, (int64_t[]){3}, want, 1e-14);
        ag_optim_free(o);
        ag_module_free(m);
    }
    ag_module *m = holder(AG_F32, 3, p0);
    assert_null(ag_optim_sgd(m, -1, 0, 0, false));
    tu_assert_error_contains("learning rate");
    assert_null(ag_optim_sgd(m, 0.1, 0, 0, true));
    tu_assert_error_contains("Nesterov");
    ag_module_free(m);
}

static void adamw_reference(double *p, double *mm, double *vv, const double *g, int n, int t,
                            double lr, double b1, double b2, double eps, double wd) {
    for (int i = 0; i < n; i++) {
        p[i] -= lr * wd * p[i];
        mm[i] = b1 * mm[i] + (1 - b1) * g[i];
        vv[i] = b2 * vv[i] + (1 - b2) * g[i] * g[i];
        double mhat = mm[i] / (1 - pow(b1, t)), vhat = vv[i] / (1 - pow(b2, t));
        p[i] -= lr * mhat / (sqrt(vhat) + eps);
    }
}

static void test_adamw(void **state) {
    (void)state;
    const double p0[4] = {1.0, -2.0, 0.5, 0.0}, g1[4] = {0.3, -0.1, 2.0, 1e-3},
                 g2[4] = {-0.5, 0.2, 1.0, -1e-3};
    const double lr = 1e-2, b1 = 0.9, b2 = 0.999, eps = 1e-8, wd = 0.1;
    for (int f32 = 0; f32 < 2; f32++) {
        ag_module *m = holder(f32 ? AG_F32 : AG_F64, 4, p0);
        /* A second parameter that never gets a gradient: skipped, no state. */
        ag_tensor *idle = tu_tensor(AG_F32, 1, (int64_t[]){2}, (double[]){5, 6});
        assert_int_equal(ag_module_register_parameter(m, "idle", idle), 0);
        ag_tensor *p = ag_module_param(m, "w");
        ag_optim *o = ag_optim_adamw(m, lr, b1, b2, eps, wd);
        assert_non_null(o);
        double want[4], mm[4] = {0}, vv[4] = {0};
        memcpy(want, p0, sizeof want);
        for (int step = 1; step <= 2; step++) {
            const double *g = step == 1 ? g1 : g2;
            set_grad(p, g);
            assert_int_equal(ag_optim_step(o), 0);
            adamw_reference(want, mm, vv, g, 4, step, lr, b1, b2, eps, wd);
            tu_assert_values(p, 1, (int64_t[]){4}, want, f32 ? 1e-6 : 1e-13);
        }
        tu_assert_values(idle, 1, (int64_t[]){2}, (double[]){5, 6}, 0);
        /* lr changes take effect on the next step. */
        ag_optim_set_lr(o, 0.0);
        assert_int_equal(ag_optim_step(o), 0);
        adamw_reference(want, mm, vv, g2, 4, 3, 0.0, b1, b2, eps, wd);
        tu_assert_values(p, 1, (int64_t[]){4}, want, f32 ? 1e-6 : 1e-13);
        ag_tensor_free(idle);
        ag_optim_free(o);
        ag_module_free(m);
    }
    ag_module *m = holder(AG_F32, 2, p0);
    assert_null(ag_optim_adamw(m, 1e-3, 1.0, 0.999, 1e-8, 0));
    tu_assert_error_contains("beta");
    ag_module_free(m);
}

/* AdamW over a list of tensors: the update of ag_optim_adamw, a tensor listed twice updated
 * once, a tensor without a gradient left alone; bad lists refused. */
static void test_adamw_tensors(void **state) {
    (void)state;
    const double p0[4] = {1.0, -2.0, 0.5, 0.0}, g1[4] = {0.3, -0.1, 2.0, 1e-3};
    const double lr = 1e-2, b1 = 0.9, b2 = 0.95, eps = 1e-8, wd = 0.1;
    ag_tensor *a = tu_tensor(AG_F32, 1, (int64_t[]){4}, p0);
    ag_tensor *idle = tu_tensor(AG_F32, 1, (int64_t[]){2}, (double[]){5, 6});
    ag_tensor_set_requires_grad(a, true);
    ag_tensor *list[3] = {a, idle, a};
    ag_optim *o = ag_optim_adamw_tensors(list, 3, lr, b1, b2, eps, wd);
    assert_non_null(o);
    double want[4], mm[4] = {0}, vv[4] = {0};
    memcpy(want, p0, sizeof want);
    for (int step = 1; step <= 2; step++) {
        set_grad(a, g1);
        assert_int_equal(ag_optim_step(o), 0);
        adamw_reference(want, mm, vv, g1, 4, step, lr, b1, b2, eps, wd);
        tu_assert_values(a, 1, (int64_t[]){4}, want, 1e-6);
    }
    tu_assert_values(idle, 1, (int64_t[]){2}, (double[]){5, 6}, 0);
    ag_optim_free(o);
    list[1] = NULL;
    assert_null(ag_optim_adamw_tensors(list, 3, lr, b1, b2, eps, wd));
    tu_assert_error_contains("parameter 1 is NULL");
    assert_null(ag_optim_adamw_tensors(&a, 1, lr, b1, 1.5, eps, wd));
    tu_assert_error_contains("beta");
    assert_null(ag_optim_adamw_tensors(NULL, 2, lr, b1, b2, eps, wd));
    tu_assert_error_contains("params is NULL");
    ag_tensor_free(a);
    ag_tensor_free(idle);
}

/* A parameter big enough for the multi-threaded path (odd size: uneven spans), both
 * optimizers, two steps, every element against the formulas. */
static void test_optim_large(void **state) {
    (void)state;
    enum { N = 100003 };
    double *p0 = malloc(sizeof(double) * N), *g = malloc(sizeof(double) * N);
    double *want = malloc(sizeof(double) * N), *mm = calloc(N, sizeof(double));
    double *vv = calloc(N, sizeof(double));
    for (int i = 0; i < N; i++) {
        p0[i] = lcg_unit() * 2 - 1;
        g[i] = lcg_unit() * 2 - 1;
    }
    for (int kind = 0; kind < 2; kind++) {
        ag_module *m = holder(AG_F32, N, p0);
        ag_tensor *p = ag_module_param(m, "w");
        ag_optim *o = kind ? ag_optim_adamw(m, 1e-2, 0.9, 0.999, 1e-8, 0.1)
                           : ag_optim_sgd(m, 0.1, 0.9, 0.01, true);
        for (int i = 0; i < N; i++) {
            want[i] = (float)p0[i];
            mm[i] = vv[i] = 0;
        }
        for (int step = 1; step <= 2; step++) {
            set_grad(p, g);
            assert_int_equal(ag_optim_step(o), 0);
            if (kind) {
                adamw_reference(want, mm, vv, g, N, step, 1e-2, 0.9, 0.999, 1e-8, 0.1);
            } else {
                for (int i = 0; i < N; i++) {
                    double d = (double)(float)g[i] + 0.01 * want[i];
                    mm[i] = step == 1 ? d : 0.9 * mm[i] + d;
                    want[i] -= 0.1 * (d + 0.9 * mm[i]);
                }
            }
        }
        const float *got = ag_tensor_data(p);
        double worst = 0;
        for (int i = 0; i < N; i++)
            worst = fmax(worst, fabs(got[i] - want[i]) / (1 + fabs(want[i])));
        assert_true(worst < 1e-5);
        ag_optim_free(o);
        ag_module_free(m);
    }
    free(p0);
    free(g);
    free(want);
    free(mm);
    free(vv);
}

/* ---- allocation counting and failure injection ---- */

/* Gives every parameter of m a gradient of ones. */
static void set_ones_grads(ag_module *m) {
    ag_named_tensors nt;
    assert_int_equal(ag_module_named_parameters(m, true, &nt), 0);
    for (int i = 0; i < nt.n; i++) {
        ag_tensor *g = ag_ones_like(nt.tensors[i]);
        ag_tensor_set_grad(nt.tensors[i], g);
        ag_tensor_free(g);
    }
    ag_named_tensors_free(&nt);
}

static void test_optim_step_no_alloc(void **state) {
    (void)state;
    ag_module *m = nested_model();
    set_ones_grads(m);
    for (int kind = 0; kind < 2; kind++) {
        ag_optim *o = kind ? ag_optim_adamw(m, 1e-3, 0.9, 0.999, 1e-8, 0.01)
                           : ag_optim_sgd(m, 0.1, 0.9, 0, false);
        assert_int_equal(ag_optim_step(o), 0); /* allocates the state */
        tu_alloc_count_begin();
        int rc = 0;
        for (int k = 0; k < 3 && rc == 0; k++)
            rc = ag_optim_step(o);
        int64_t calls = tu_alloc_count_end();
        assert_int_equal(rc, 0);
        assert_int_equal(calls, 0);
        ag_optim_free(o);
    }
    ag_module_free(m);
}

/* tu_alloc_failure_sweep of fn; the callers warm up first, so even the clean run must free
 * everything it allocates. */
static void for_every_failure(int (*fn)(void *), void *ud, const char *what) {
    tu_sweep_opts o = {.what = what, .clean_run_frees_all = true};
    tu_alloc_failure_sweep(fn, ud, &o);
}

static int build_and_free(void *ud) {
    (void)ud;
    ag_module *m = nested_model();
    if (!m)
        return ag_last_status();
    ag_named_tensors nt;
    int rc = ag_module_named_parameters(m, false, &nt);
    if (!rc)
        ag_named_tensors_free(&nt);
    ag_module_free(m);
    return rc;
}

static int build_gpt2(void *ud) {
    (void)ud;
    ag_gpt2_config c = ag_gpt2_config_tiny();
    c.n_layer = 1;
    c.vocab_size = 16;
    c.block_size = 8;
    c.n_embd = 8;
    c.n_head = 2;
    ag_module *m = ag_nn_gpt2(&c);
    if (!m)
        return ag_last_status();
    ag_module_free(m);
    return 0;
}

static int optim_run(void *ud) {
    ag_module *m = ud;
    ag_optim *o = ag_optim_adamw(m, 1e-3, 0.9, 0.999, 1e-8, 0.01);
    if (!o)
        return ag_last_status();
    int rc = ag_optim_step(o);
    ag_optim_free(o);
    return rc;
}

typedef struct io_case {
    ag_module *m;
    const char *path;
} io_case;

static int save_run(void *ud) {
    io_case *c = ud;
    return ag_module_save(c->m, c->path);
}

typedef struct load_case {
    ag_module *m;
    const char *path;
    const snapshot *before; /* m's values before any load */
} load_case;

/* Puts the snapshot's values back into m's state tensors (contiguous, as modules make them). */
static void snapshot_restore(ag_module *m, const snapshot *s) {
    ag_named_tensors nt, nb;
    assert_int_equal(ag_module_named_parameters(m, true, &nt), 0);
    assert_int_equal(ag_module_named_buffers(m, true, &nb), 0);
    assert_int_equal(nt.n + nb.n, s->n);
    for (int i = 0; i < s->n; i++) {
        ag_tensor *t = i < nt.n ? nt.tensors[i] : nb.tensors[i - nt.n];
        assert_true(ag_tensor_is_contiguous(t));
        void *d = ag_tensor_data(t);
        for (int64_t e = 0; e < ag_tensor_numel(t); e++) {
            switch (ag_tensor_dtype(t)) {
            case AG_F32:
                ((float *)d)[e] = (float)s->vals[i][e];
                break;
            case AG_F64:
                ((double *)d)[e] = s->vals[i][e];
                break;
            case AG_I64:
                ((int64_t *)d)[e] = (int64_t)s->vals[i][e];
                break;
            default:
                fail();
            }
        }
    }
    ag_named_tensors_free(&nt);
    ag_named_tensors_free(&nb);
}

/* Loads into m as it was before any load; a failed load must change nothing. The restore and
 * the comparison are bookkeeping, outside the allocations counted (and outside the allocations
 * that fail). */
static int load_run(void *ud) {
    load_case *c = ud;
    tu_alloc_pause();
    snapshot_restore(c->m, c->before);
    tu_alloc_resume();
    int rc = ag_module_load(c->m, c->path);
    if (rc) {
        tu_alloc_pause();
        bool unchanged = snapshot_equal(c->m, c->before);
        tu_alloc_resume();
        if (!unchanged) {
            print_error("load: a failed load (status %d) changed the module\n", rc);
            return -99; /* the sweep fails: not AG_ENOMEM */
        }
    }
    return rc;
}

typedef struct fwd_case {
    ag_module *m;
    ag_tensor *in[2];
    int nin;
} fwd_case;

/* One forward (in a scope, as training code runs it) and a backward of the outputs' sum. */
static int forward_run(void *ud) {
    fwd_case *c = ud;
    ag_tensor *outs[2] = {NULL, NULL};
    ag_scope_begin();
    int n = ag_module_call(c->m, c->in, c->nin, outs, 2);
    int rc = n < 0 ? n : ag_backward(ag_sum_all(outs[n - 1]), NULL, false);
    ag_scope_end();
    return rc;
}

static void test_forward_alloc_failures(void **state) {
    (void)state;
    ag_manual_seed(30);
    ag_gpt2_config cfg = {.n_layer = 1,
                          .n_head = 2,
                          .n_embd = 8,
                          .vocab_size = 16,
                          .block_size = 8,
                          .dropout = 0.1,
                          .bias = true};
    ag_module *gpt = ag_nn_gpt2(&cfg);
    ag_tensor *idx = rand_tokens(2, 4, 16), *tgt = rand_tokens(2, 4, 16);
    fwd_case g = {gpt, {idx, tgt}, 2};
    assert_int_equal(forward_run(&g), 0); /* warm-up */
    for_every_failure(forward_run, &g, "gpt2 forward");

    ag_module *m = ag_nn_sequential();
    assert_int_equal(ag_nn_append(m, ag_nn_conv2d(2, 4, 3, 1, 1, 1, 1, true)), 0);
    assert_int_equal(ag_nn_append(m, ag_nn_batchnorm2d(4, 1e-5, 0.1)), 0);
    assert_int_equal(ag_nn_append(m, ag_nn_relu()), 0);
    assert_int_equal(ag_nn_append(m, ag_nn_maxpool2d(2, 0, 0)), 0);
    assert_int_equal(ag_nn_append(m, ag_nn_flatten(1, -1)), 0);
    assert_int_equal(ag_nn_append(m, ag_nn_linear(16, 3, true)), 0);
    ag_tensor *x = rand_tensor(AG_F32, 4, (int64_t[]){2, 2, 4, 4}, -1, 1);
    fwd_case s = {m, {x}, 1};
    assert_int_equal(forward_run(&s), 0);
    for_every_failure(forward_run, &s, "conv net forward");

    ag_tensor_free(x);
    ag_tensor_free(idx);
    ag_tensor_free(tgt);
    ag_module_free(m);
    ag_module_free(gpt);
}

static void test_alloc_failures(void **state) {
    (void)state;
    /* Warm up the op table and anything else built once per process. */
    assert_int_equal(build_and_free(NULL), 0);
    for_every_failure(build_and_free, NULL, "nested model");
    for_every_failure(build_gpt2, NULL, "gpt2");

    ag_module *m = nested_model();
    set_ones_grads(m);
    for_every_failure(optim_run, m, "adamw");

    io_case c = {m, tmp_path("alloc.safetensors")};
    for_every_failure(save_run, &c, "save");
    ag_module *m2 = nested_model();
    snapshot s = take_snapshot(m2);
    for_every_failure(load_run, &(load_case){m2, c.path, &s}, "load");
    assert_false(snapshot_equal(m2, &s));
    snapshot_free(&s);
    s = take_snapshot(m);
    assert_true(snapshot_equal(m2, &s));
    snapshot_free(&s);
    ag_module_free(m2);
    ag_module_free(m);
    remove(c.path);
}

/* ---- safetensors ---- */

static void test_safetensors_roundtrip(void **state) {
    (void)state;
    ag_manual_seed(10);
    ag_module *m = nested_model();
    /* One training step of the BatchNorm so its buffers hold non-default values. */
    ag_tensor *x = rand_tensor(AG_F32, 4, (int64_t[]){2, 6, 3, 3}, -1, 1);
    ag_tensor *y = ag_module_forward(ag_module_child(m, "1.1"), x);
    assert_non_null(y);
    ag_tensor_free(y);
    ag_tensor_free(x);
    const char *path = tmp_path("model.safetensors");
    assert_int_equal(ag_module_save(m, path), 0);

    /* The file: 8-byte length, JSON header padded to 8, then every tensor's bytes. */
    unsigned char *data;
    long size = read_file(path, &data);
    uint64_t hlen = 0;
    for (int i = 0; i < 8; i++)
        hlen |= (uint64_t)data[i] << (8 * i);
    assert_int_equal(hlen % 8, 0);
    assert_true(data[8] == '{');
    int64_t total = 0;
    ag_named_tensors st;
    assert_int_equal(ag_module_named_parameters(m, true, &st), 0);
    for (int i = 0; i < st.n; i++)
        total += ag_tensor_numel(st.tensors[i]) * 4;
    ag_named_tensors_free(&st);
    total += 6 * 4 * 2 + 8; /* running_mean, running_var (f32), num_batches_tracked (i64) */
    assert_int_equal(size, 8 + (long)hlen + total);
    char *hdr = strndup((char *)data + 8, hlen);
    assert_non_null(
        strstr(hdr, "\"0.weight\":{\"dtype\":\"F32\",\"shape\":[8,4],\"data_offsets\":[0,128]}"));
    assert_non_null(strstr(hdr, "\"1.1.num_batches_tracked\":{\"dtype\":\"I64\",\"shape\":[]"));
    free(hdr);

    ag_manual_seed(11);
    ag_module *m2 = nested_model();
    snapshot s = take_snapshot(m);
    assert_false(snapshot_equal(m2, &s));
    ag_tensor *p = ag_module_param(m2, "0.weight");
    uint64_t v0 = ag_tensor_version(p);
    assert_int_equal(ag_module_load(m2, path), 0);
    assert_true(snapshot_equal(m2, &s));
    assert_true(ag_tensor_version(p) > v0);
    assert_true(ag_tensor_item(ag_module_buffer(m2, "1.1.num_batches_tracked")) == 1);
    snapshot_free(&s);

    /* Truncated at every length: an error, never a crash, and the module unchanged. */
    ag_module *m3 = nested_model();
    s = take_snapshot(m3);
    const char *cut = tmp_path("cut.safetensors");
    for (long n = 0; n < size; n++) {
        write_file(cut, data, (size_t)n);
        assert_true(ag_module_load(m3, cut) < 0);
        assert_true(snapshot_equal(m3, &s));
    }
    /* Corrupted header bytes: any outcome but a crash; failures change nothing. */
    unsigned char *bad = malloc((size_t)size);
    const char subst[] = {'}', '9', '"', '-', 0, '[', 'x'};
    for (uint64_t i = 8; i < 8 + hlen; i++)
        for (size_t k = 0; k < sizeof subst; k++) {
            memcpy(bad, data, (size_t)size);
            bad[i] = (unsigned char)subst[k];
            write_file(cut, bad, (size_t)size);
            if (ag_module_load(m3, cut) < 0)
                assert_true(snapshot_equal(m3, &s));
            else {
                snapshot_free(&s);
                s = take_snapshot(m3);
            }
        }
    /* A header length beyond the file, and one beyond 64 bits' worth of sense. */
    memcpy(bad, data, (size_t)size);
    bad[7] = 0x40;
    write_file(cut, bad, (size_t)size);
    assert_int_equal(ag_module_load(m3, cut), AG_EFORMAT);
    tu_assert_error_contains("header length");
    free(bad);
    snapshot_free(&s);
    ag_module_free(m3);
    free(data);
    ag_module_free(m2);
    ag_module_free(m);
    remove(cut);
    remove(path);
}

/* Writes a safetensors file with the given JSON header and `ndata` zero bytes of data. */
static void write_st(const char *path, const char *json, size_t ndata) {
    size_t h = strlen(json);
    size_t n = 8 + h + ndata;
    unsigned char *buf = calloc(1, n);
    for (int i = 0; i < 8; i++)
        buf[i] = (unsigned char)((uint64_t)h >> (8 * i));
    memcpy(buf + 8, json, h);
    write_file(path, buf, n);
    free(buf);
}

static void test_safetensors_errors(void **state) {
    (void)state;
    const char *path = tmp_path("lin.safetensors");
    ag_module *a = ag_nn_linear(3, 4, true);
    assert_int_equal(ag_module_save(a, path), 0);

    /* Wrong shape: Linear(4, 3) has weight (3, 4). */
    ag_module *b = ag_nn_linear(4, 3, true);
    assert_int_equal(ag_module_load(b, path), AG_EINVAL);
    tu_assert_error_contains("'weight' has shape [4, 3]");
    tu_assert_error_contains("[3, 4]");
    ag_module_free(b);

    /* Missing: a module with one more parameter. */
    ag_module *c = ag_nn_linear(3, 4, true);
    ag_tensor *extra = ag_zeros(AG_F32, 1, (int64_t[]){2});
    assert_int_equal(ag_module_register_parameter(c, "scale", extra), 0);
    assert_int_equal(ag_module_load(c, path), AG_EINVAL);
    tu_assert_error_contains("'scale' is missing");
    ag_tensor_free(extra);
    ag_module_free(c);

    /* Unexpected: the file has a tensor the module lacks. */
    ag_module *d = ag_nn_linear(3, 4, false);
    assert_int_equal(ag_module_load(d, path), AG_EINVAL);
    tu_assert_error_contains("'bias'");
    ag_module_free(d);

    /* Wrong dtype. */
    const char *p2 = tmp_path("hand.safetensors");
    write_st(p2,
             "{\"weight\":{\"dtype\":\"F64\",\"shape\":[4,3],\"data_offsets\":[0,96]},"
             "\"bias\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[96,112]}}",
             112);
    assert_int_equal(ag_module_load(a, p2), AG_EINVAL);
    tu_assert_error_contains("dtype F64");

    /* Offsets outside the data, sizes that disagree with the shape, junk. */
    write_st(p2,
             "{\"weight\":{\"dtype\":\"F32\",\"shape\":[4,3],\"data_offsets\":[0,48]},"
             "\"bias\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[48,1000064]}}",
             64);
    assert_int_equal(ag_module_load(a, p2), AG_EFORMAT);
    tu_assert_error_contains("data_offsets");
    write_st(p2,
             "{\"weight\":{\"dtype\":\"F32\",\"shape\":[4,3],\"data_offsets\":[0,40]},"
             "\"bias\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[48,64]}}",
             64);
    assert_int_equal(ag_module_load(a, p2), AG_EFORMAT);
    write_st(p2, "{\"weight\":{\"dtype\":\"F32\",\"shape\":[4,-3],\"data_offsets\":[0,48]}}", 64);
    assert_int_equal(ag_module_load(a, p2), AG_EFORMAT);
    write_st(p2,
             "{\"weight\":{\"dtype\":\"F32\",\"shape\":[4611686018427387904,4],"
             "\"data_offsets\":[0,48]}}",
             64);
    assert_int_equal(ag_module_load(a, p2), AG_EFORMAT);
    write_st(p2, "[1, 2]", 0);
    assert_int_equal(ag_module_load(a, p2), AG_EFORMAT);
    write_st(p2, "{\"weight\": 3}", 0);
    assert_int_equal(ag_module_load(a, p2), AG_EFORMAT);
    write_st(p2, "{\"weight\":", 0);
    assert_int_equal(ag_module_load(a, p2), AG_EFORMAT);
    tu_assert_error_contains("malformed header");
    assert_int_equal(ag_module_load(a, tmp_path("does-not-exist")), AG_EIO);
    assert_int_equal(ag_module_save(a, "/nonexistent-dir/x.safetensors"), AG_EIO);
    tu_assert_error_contains("/nonexistent-dir/x.safetensors");

    /* A hand-written valid file with extra metadata and unusual key order loads. */
    float vals[16];
    for (int i = 0; i < 16; i++)
        vals[i] = (float)i * 0.5f;
    const char *json = "{\"__metadata__\":{\"format\":\"pt\"},"
                       "\"bias\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[48,64]},"
                       "\"weight\":{\"dtype\":\"F32\",\"shape\":[4,3],\"data_offsets\":[0,48]}}";
    size_t h = strlen(json);
    unsigned char *buf = calloc(1, 8 + h + 64);
    buf[0] = (unsigned char)h;
    memcpy(buf + 8, json, h);
    memcpy(buf + 8 + h, vals, 64);
    write_file(p2, buf, 8 + h + 64);
    free(buf);
    assert_int_equal(ag_module_load(a, p2), 0);
    double wv[12], bv[4];
    for (int i = 0; i < 12; i++)
        wv[i] = i * 0.5;
    for (int i = 0; i < 4; i++)
        bv[i] = (12 + i) * 0.5;
    tu_assert_values(ag_module_param(a, "weight"), 2, (int64_t[]){4, 3}, wv, 0);
    tu_assert_values(ag_module_param(a, "bias"), 1, (int64_t[]){4}, bv, 0);
    ag_module_free(a);
    remove(path);
    remove(p2);
}

static void test_safetensors_gpt2_tied(void **state) {
    (void)state;
    ag_manual_seed(20);
    ag_gpt2_config c = ag_gpt2_config_tiny();
    ag_module *m = ag_nn_gpt2(&c);
    const char *path = tmp_path("gpt2.safetensors");
    assert_int_equal(ag_module_save(m, path), 0);
    ag_manual_seed(21);
    ag_module *m2 = ag_nn_gpt2(&c);
    assert_int_equal(ag_module_load(m2, path), 0);
    snapshot s = take_snapshot(m);
    assert_true(snapshot_equal(m2, &s));
    snapshot_free(&s);
    /* The tie survives: lm_head.weight is still the embedding. */
    assert_ptr_equal(ag_module_param(m2, "lm_head.weight"),
                     ag_module_param(m2, "transformer.wte.weight"));
    unsigned char *data;
    long size = read_file(path, &data);
    assert_true(size > 0);
    assert_null(memmem(data, (size_t)size, "lm_head", 7)); /* stored once, under wte */
    free(data);
    ag_module_free(m);
    ag_module_free(m2);
    remove(path);
}

/* ---- training ---- */

static void test_mlp_training(void **state) {
    (void)state;
    ag_manual_seed(5);
    /* Two classes by quadrant (XOR of signs), points away from the axes. */
    enum { N = 64 };
    double xv[2 * N], yv[N];
    for (int i = 0; i < N; i++) {
        double a, b;
        do {
            a = lcg_unit() * 2 - 1;
            b = lcg_unit() * 2 - 1;
        } while (fabs(a) < 0.15 || fabs(b) < 0.15);
        xv[2 * i] = a;
        xv[2 * i + 1] = b;
        yv[i] = (a > 0) != (b > 0);
    }
    ag_tensor *x = tu_tensor(AG_F32, 2, (int64_t[]){N, 2}, xv);
    ag_tensor *y = tu_tensor(AG_I64, 1, (int64_t[]){N}, yv);
    ag_module *net = ag_nn_sequential();
    assert_int_equal(ag_nn_append(net, ag_nn_linear(2, 16, true)), 0);
    assert_int_equal(ag_nn_append(net, ag_nn_relu()), 0);
    assert_int_equal(ag_nn_append(net, ag_nn_linear(16, 2, true)), 0);
    ag_module *crit = ag_nn_cross_entropy_loss(AG_REDUCTION_MEAN, -100);
    ag_optim *o = ag_optim_adamw(net, 0.03, 0.9, 0.999, 1e-8, 0.01);
    double first = 0, last = 0;
    for (int step = 0; step < 300; step++) {
        ag_scope_begin();
        ag_tensor *loss = NULL;
        ag_tensor *logits = ag_module_forward(net, x);
        assert_int_equal(ag_module_call(crit, (ag_tensor *[]){logits, y}, 2, &loss, 1), 1);
        last = ag_tensor_item(loss);
        if (step == 0)
            first = last;
        ag_optim_zero_grad(o);
        assert_int_equal(ag_backward(loss, NULL, false), 0);
        assert_int_equal(ag_optim_step(o), 0);
        ag_scope_end();
    }
    assert_true(last < 0.3 * first);
    ag_optim_free(o);
    ag_module_free(crit);
    ag_module_free(net);
    ag_tensor_free(x);
    ag_tensor_free(y);
}

static int setup(void **state) {
    (void)state;
    snprintf(tmpdir, sizeof tmpdir, "/tmp/ag_test_nn_XXXXXX");
    return mkdtemp(tmpdir) ? 0 : -1;
}

static int teardown(void **state) {
    (void)state;
    return rmdir(tmpdir);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fqn_order_nested),
        cmocka_unit_test(test_own_params_before_children),
        cmocka_unit_test(test_remove_duplicate_tied),
        cmocka_unit_test(test_gpt2_tiny_names),
        cmocka_unit_test(test_layer_inits),
        cmocka_unit_test(test_sgd),
        cmocka_unit_test(test_adamw),
        cmocka_unit_test(test_optim_step_no_alloc),
        cmocka_unit_test(test_optim_large),
        cmocka_unit_test(test_safetensors_roundtrip),
        cmocka_unit_test(test_safetensors_errors),
        cmocka_unit_test(test_safetensors_gpt2_tied),
        cmocka_unit_test(test_alloc_failures),
        cmocka_unit_test(test_forward_alloc_failures),
        cmocka_unit_test(test_layer_forwards),
        cmocka_unit_test(test_batchnorm_running_stats),
        cmocka_unit_test(test_gpt2_forward),
        cmocka_unit_test(test_mlp_training),
        cmocka_unit_test(test_adamw_tensors),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
