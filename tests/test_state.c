/* Tests of state files and the training recipe's pieces: safetensors files of named tensors
 * (every dtype, metadata, hostile files through the same reader), module loading with options
 * (non-strict with a report, a partial state dict, dtype conversion, the errors that stay),
 * parameter groups (AdamW per group against hand-computed updates), clipping by the global
 * norm, the warmup + cosine schedule, and optimizer state save/load (resume bit-identical to an
 * uninterrupted run). Expected values are computed here from the definitions. */
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static char tmpdir[64];

static const char *tmp_path(const char *name) {
    static char buf[4][256];
    static int k;
    char *p = buf[k++ % 4];
    snprintf(p, sizeof buf[0], "%s/%s", tmpdir, name);
    return p;
}

static int setup(void **state) {
    (void)state;
    snprintf(tmpdir, sizeof tmpdir, "/tmp/ag_state_XXXXXX");
    return mkdtemp(tmpdir) ? 0 : -1;
}

static int teardown(void **state) {
    (void)state;
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", tmpdir);
    return system(cmd) == 0 ? 0 : -1;
}

/* ---- safetensors files of named tensors ---- */

static void test_named_roundtrip(void **state) {
    (void)state;
    ag_tensor *f32 = tu_tensor(AG_F32, 2, (int64_t[]){2, 3}, (double[]){1, 2, 3, 4, 5, 6.5});
    ag_tensor *f64 = tu_tensor(AG_F64, 1, (int64_t[]){2}, (double[]){1e-300, -0.1});
    ag_tensor *i64 = tu_tensor(AG_I64, 1, (int64_t[]){3}, (double[]){-7, 0, 1LL << 40});
    ag_tensor *b = tu_tensor(AG_BOOL, 1, (int64_t[]){3}, (double[]){1, 0, 1});
    ag_tensor *s = ag_scalar_tensor(AG_F64, 42.0);
    ag_tensor *empty = ag_zeros(AG_F32, 2, (int64_t[]){0, 4});
    /* A non-contiguous view is written contiguously. */
    ag_tensor *tr = ag_transpose(f32, 0, 1);
    const char *names[] = {"x", "y.z", "idx", "mask", "step", "none", "xt"};
    ag_tensor *ts[] = {f32, f64, i64, b, s, empty, tr};
    const char *meta[] = {"format", "pt", "note", "hello", NULL};
    const char *p = tmp_path("named.safetensors");
    assert_int_equal(ag_safetensors_save(p, names, ts, 7, meta), 0);
    ag_tensor_dict d;
    assert_int_equal(ag_safetensors_load(p, &d), 0);
    assert_int_equal(d.n, 7);
    for (int i = 0; i < 7; i++) {
        /* The order of the data in the file: the save's list order. */
        assert_string_equal(d.names[i], names[i]);
        ag_tensor *t = ag_tensor_dict_get(&d, names[i]);
        assert_ptr_equal(t, d.tensors[i]);
        assert_int_equal(ag_tensor_dtype(t), ag_tensor_dtype(ts[i]));
        tu_assert_shape(t, ag_tensor_ndim(ts[i]), ag_tensor_sizes(ts[i]));
        assert_true(tu_max_abs_diff(t, ts[i]) == 0);
    }
    assert_int_equal(ag_tensor_item_at(ag_tensor_dict_get(&d, "idx"), 2), (double)(1LL << 40));
    assert_string_equal(ag_tensor_dict_meta(&d, "note"), "hello");
    assert_string_equal(ag_tensor_dict_meta(&d, "format"), "pt");
    assert_null(ag_tensor_dict_meta(&d, "other"));
    assert_null(ag_tensor_dict_get(&d, "other"));
    ag_tensor_dict_free(&d);
    assert_int_equal(d.n, 0);
    ag_tensor_dict_free(NULL);

    /* Bad arguments: nothing written. */
    const char *q = tmp_path("bad.safetensors");
    const char *dup[] = {"a", "a"};
    assert_int_equal(ag_safetensors_save(q, dup, ts, 2, NULL), AG_EINVAL);
    tu_assert_error_contains("'a' is given twice");
    const char *reserved[] = {"__metadata__"};
    assert_int_equal(ag_safetensors_save(q, reserved, ts, 1, NULL), AG_EINVAL);
    tu_assert_error_contains("reserved");
    const char *odd_meta[] = {"k", NULL};
    assert_int_equal(ag_safetensors_save(q, names, ts, 1, odd_meta), AG_EINVAL);
    tu_assert_error_contains("'k' has no value");
    assert_int_not_equal(access(q, F_OK), 0);
    for (int i = 0; i < 7; i++)
        ag_tensor_free(ts[i]);
}

/* The reader's checks apply to files of named tensors too, and a dtype aotgrad lacks is named. */
static void test_named_hostile(void **state) {
    (void)state;
    const char *p = tmp_path("h.safetensors");
    const char *hdrs[] = {
        "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
        "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
        "{\"a\":{\"dtype\":\"F16\",\"shape\":[2],\"data_offsets\":[0,4]}}",
        "{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}",
    };
    const size_t ndata[] = {12, 4, 8};
    const int codes[] = {AG_EFORMAT, AG_ENOTSUP, AG_EFORMAT};
    const char *needles[] = {"overlaps", "'a' in", "3 elements of F32 need 12"};
    for (int k = 0; k < 3; k++) {
        size_t h = strlen(hdrs[k]), padded = (h + 7) / 8 * 8;
        unsigned char buf[512] = {0};
        for (int i = 0; i < 8; i++)
            buf[i] = (unsigned char)((uint64_t)padded >> (8 * i));
        memcpy(buf + 8, hdrs[k], h);
        memset(buf + 8 + h, ' ', padded - h);
        FILE *f = fopen(p, "wb");
        assert_non_null(f);
        assert_int_equal(fwrite(buf, 1, 8 + padded + ndata[k], f), 8 + padded + ndata[k]);
        fclose(f);
        ag_tensor_dict d = {.n = 99};
        assert_int_equal(ag_safetensors_load(p, &d), codes[k]);
        tu_assert_error_contains(needles[k]);
        assert_int_equal(d.n, 0);
        assert_null(d.names);
    }
    ag_tensor_dict d;
    assert_int_equal(ag_safetensors_load(tmp_path("absent"), &d), AG_EIO);
}

/* ---- module loading with options ---- */

/* Linear(3, 2) in dtype dt with weights w (6 values) and bias b (2). */
static ag_module *lin(ag_dtype dt, const double *w, const double *b) {
    ag_module *m = ag_module_new("Linear", NULL, NULL, NULL);
    ag_tensor *tw = tu_tensor(dt, 2, (int64_t[]){2, 3}, w),
              *tb = tu_tensor(dt, 1, (int64_t[]){2}, b);
    assert_int_equal(ag_module_register_parameter(m, "weight", tw), 0);
    assert_int_equal(ag_module_register_parameter(m, "bias", tb), 0);
    ag_tensor_free(tw);
    ag_tensor_free(tb);
    return m;
}

static const double W0[6] = {1, 2, 3, 4, 5, 6}, B0[2] = {7, 8};
static const double W1[6] = {0.1, 0.2, 0.3, 0.4, 0.5, 0.6}, B1[2] = {-1, -2};

static void test_load_non_strict(void **state) {
    (void)state;
    /* A file with weight (right shape), an unexpected key, and no bias. */
    ag_tensor *w = tu_tensor(AG_F32, 2, (int64_t[]){2, 3}, W1);
    ag_tensor *extra = tu_tensor(AG_F32, 1, (int64_t[]){1}, (double[]){9});
    const char *names[] = {"weight", "head.extra"};
    ag_tensor *ts[] = {w, extra};
    const char *p = tmp_path("partial.safetensors");
    assert_int_equal(ag_safetensors_save(p, names, ts, 2, NULL), 0);
    ag_module *m = lin(AG_F32, W0, B0);
    /* Strict (zeroed options, the default): refused, the module unchanged. */
    ag_load_opts strict = {0};
    ag_load_report rep = {.nmissing = 5};
    assert_int_equal(ag_module_load_ex(m, p, &strict, &rep), AG_EINVAL);
    tu_assert_error_contains("holds 'head.extra', which the module does not have");
    assert_int_equal(rep.nmissing, 0);
    tu_assert_values(ag_module_param(m, "weight"), 2, (int64_t[]){2, 3}, W0, 0);
    /* Non-strict: weight loaded, bias kept, both lists reported. */
    ag_load_opts ns = {.non_strict = true};
    assert_int_equal(ag_module_load_ex(m, p, &ns, &rep), 0);
    tu_assert_values(ag_module_param(m, "weight"), 2, (int64_t[]){2, 3}, W1, 1e-7);
    tu_assert_values(ag_module_param(m, "bias"), 1, (int64_t[]){2}, B0, 0);
    assert_int_equal(rep.nmissing, 1);
    assert_string_equal(rep.missing[0], "bias");
    assert_int_equal(rep.nunexpected, 1);
    assert_string_equal(rep.unexpected[0], "head.extra");
    ag_load_report_free(&rep);
    assert_null(rep.missing);
    ag_load_report_free(NULL);
    /* Strict without the extra key: bias is missing. */
    assert_int_equal(ag_safetensors_save(p, names, ts, 1, NULL), 0);
    assert_int_equal(ag_module_load(m, p), AG_EINVAL);
    tu_assert_error_contains("'bias' is missing");
    /* A shape mismatch is an error even non-strict, and changes nothing. */
    ag_tensor *bad = tu_tensor(AG_F32, 1, (int64_t[]){3}, (double[]){0, 0, 0});
    ag_tensor *ts2[] = {w, bad};
    const char *names2[] = {"weight", "bias"};
    ag_module *m2 = lin(AG_F32, W0, B0);
    assert_int_equal(ag_safetensors_save(p, names2, ts2, 2, NULL), 0);
    assert_int_equal(ag_module_load_ex(m2, p, &ns, &rep), AG_EINVAL);
    tu_assert_error_contains("'bias' has shape [3]");
    tu_assert_values(ag_module_param(m2, "weight"), 2, (int64_t[]){2, 3}, W0, 0);
    /* A partial state dict in memory. */
    ag_tensor_dict sd = {0};
    assert_int_equal(ag_safetensors_load(p, &sd), 0);
    ag_tensor_free(sd.tensors[1]);
    sd.tensors[1] = tu_tensor(AG_F32, 1, (int64_t[]){1}, (double[]){3});
    free(NULL);
    assert_int_equal(ag_module_load_dict(m2, &sd, &ns, &rep), AG_EINVAL); /* bias [1] vs [2] */
    sd.n = 1; /* weight only (the second entry freed below) */
    assert_int_equal(ag_module_load_dict(m2, &sd, &ns, &rep), 0);
    tu_assert_values(ag_module_param(m2, "weight"), 2, (int64_t[]){2, 3}, W1, 1e-7);
    assert_int_equal(rep.nmissing, 1);
    assert_int_equal(rep.nunexpected, 0);
    ag_load_report_free(&rep);
    assert_int_equal(ag_module_load_dict(m2, &sd, NULL, NULL), AG_EINVAL);
    tu_assert_error_contains("'bias' is missing from 'the state dict'");
    sd.n = 2;
    ag_tensor_dict_free(&sd);
    ag_tensor_free(bad);
    ag_tensor_free(w);
    ag_tensor_free(extra);
    ag_module_free(m);
    ag_module_free(m2);
}

static void test_load_convert_dtype(void **state) {
    (void)state;
    /* 0.1 is not a float: f64 -> f32 rounds, f32 -> f64 is exact. */
    ag_module *m64 = lin(AG_F64, W1, B1), *m32 = lin(AG_F32, W0, B0);
    const char *p = tmp_path("f64.safetensors");
    assert_int_equal(ag_module_save(m64, p), 0);
    assert_int_equal(ag_module_load(m32, p), AG_EINVAL);
    tu_assert_error_contains("'weight' has dtype F64");
    tu_assert_error_contains("the module's is F32");
    tu_assert_values(ag_module_param(m32, "weight"), 2, (int64_t[]){2, 3}, W0, 0);
    ag_load_opts conv = {.convert_dtype = true};
    assert_int_equal(ag_module_load_ex(m32, p, &conv, NULL), 0);
    const float *w32 = ag_tensor_data(ag_module_param(m32, "weight"));
    for (int i = 0; i < 6; i++)
        assert_true(w32[i] == (float)W1[i]);
    assert_int_equal(ag_tensor_dtype(ag_module_param(m32, "weight")), AG_F32);
    /* And back: the f32 values exactly. */
    const char *q = tmp_path("f32.safetensors");
    assert_int_equal(ag_module_save(m32, q), 0);
    assert_int_equal(ag_module_load_ex(m64, q, &conv, NULL), 0);
    const double *w64 = ag_tensor_data(ag_module_param(m64, "weight"));
    for (int i = 0; i < 6; i++)
        assert_true(w64[i] == (double)(float)W1[i]);
    /* Conversion into an integer tensor is not offered: the mismatch stays an error. */
    ag_module *mi = ag_module_new("Holder", NULL, NULL, NULL);
    ag_tensor *ib = tu_tensor(AG_I64, 1, (int64_t[]){2}, (double[]){1, 2});
    assert_int_equal(ag_module_register_buffer(mi, "bias", ib, true), 0);
    ag_tensor_free(ib);
    ag_load_opts both = {.convert_dtype = true, .non_strict = true};
    assert_int_equal(ag_module_load_ex(mi, q, &both, NULL), AG_EINVAL);
    tu_assert_error_contains("'bias' has dtype F32");
    ag_module_free(mi);
    ag_module_free(m32);
    ag_module_free(m64);
}

/* ---- parameter groups ---- */

static void adamw_ref(double *p, double *mm, double *vv, const double *g, int n, int t, double lr,
                      double b1, double b2, double eps, double wd) {
    for (int i = 0; i < n; i++) {
        p[i] -= lr * wd * p[i];
        mm[i] = b1 * mm[i] + (1 - b1) * g[i];
        vv[i] = b2 * vv[i] + (1 - b2) * g[i] * g[i];
        double mhat = mm[i] / (1 - pow(b1, t)), vhat = vv[i] / (1 - pow(b2, t));
        p[i] -= lr * mhat / (sqrt(vhat) + eps);
    }
}

static void test_adamw_groups(void **state) {
    (void)state;
    ag_module *m = lin(AG_F64, W0, B0);
    ag_named_tensors decay, no_decay;
    assert_int_equal(ag_module_decay_split(m, &decay, &no_decay), 0);
    assert_int_equal(decay.n, 1);
    assert_string_equal(decay.names[0], "weight");
    assert_int_equal(no_decay.n, 1);
    assert_string_equal(no_decay.names[0], "bias");
    /* Group 0: defaults (wd 0.1); group 1: wd 0, its own lr and betas. */
    ag_param_group gs[2] = {
        {.params = decay.tensors, .names = (const char *const *)decay.names, .n = decay.n},
        {.params = no_decay.tensors,
         .names = (const char *const *)no_decay.names,
         .n = no_decay.n,
         .set = AG_GROUP_WEIGHT_DECAY | AG_GROUP_LR | AG_GROUP_BETAS,
         .weight_decay = 0,
         .lr = 0.05,
         .beta1 = 0.8,
         .beta2 = 0.99},
    };
    ag_optim *o = ag_optim_adamw_groups(gs, 2, 0.01, 0.9, 0.999, 1e-8, 0.1);
    assert_non_null(o);
    assert_int_equal(ag_optim_num_groups(o), 2);
    assert_true(ag_optim_group_lr(o, 1) == 0.05);
    ag_tensor *w = ag_module_param(m, "weight"), *b = ag_module_param(m, "bias");
    double pw[6], pb[2], mw[6] = {0}, vw[6] = {0}, mb[2] = {0}, vb[2] = {0};
    memcpy(pw, W0, sizeof pw);
    memcpy(pb, B0, sizeof pb);
    const double gw[2][6] = {{0.5, -0.5, 1, 2, -3, 0.25}, {-1, 0.5, 0.5, 0, 1, 2}};
    const double gb[2][2] = {{1, -2}, {0.5, 0.25}};
    for (int t = 1; t <= 2; t++) {
        ag_tensor *tgw = tu_tensor(AG_F64, 2, (int64_t[]){2, 3}, gw[t - 1]);
        ag_tensor *tgb = tu_tensor(AG_F64, 1, (int64_t[]){2}, gb[t - 1]);
        ag_tensor_set_grad(w, tgw);
        ag_tensor_set_grad(b, tgb);
        ag_tensor_free(tgw);
        ag_tensor_free(tgb);
        assert_int_equal(ag_optim_step(o), 0);
        adamw_ref(pw, mw, vw, gw[t - 1], 6, t, 0.01, 0.9, 0.999, 1e-8, 0.1);
        adamw_ref(pb, mb, vb, gb[t - 1], 2, t, 0.05, 0.8, 0.99, 1e-8, 0.0);
        tu_assert_values(w, 2, (int64_t[]){2, 3}, pw, 1e-13);
        tu_assert_values(b, 1, (int64_t[]){2}, pb, 1e-13);
    }
    /* set_lr sets every group's. */
    ag_optim_set_lr(o, 0.5);
    assert_true(ag_optim_group_lr(o, 0) == 0.5 && ag_optim_group_lr(o, 1) == 0.5);
    assert_int_equal(ag_optim_set_group_lr(o, 2, 0.1), AG_EINVAL);
    assert_true(isnan(ag_optim_group_lr(o, 2)));
    ag_optim_free(o);
    /* A bad group value names the rule. */
    gs[1].beta1 = 1.0;
    assert_null(ag_optim_adamw_groups(gs, 2, 0.01, 0.9, 0.999, 1e-8, 0.1));
    tu_assert_error_contains("beta");
    /* SGD groups: momentum 0 in group 1 (plain SGD), 0.9 in group 0. */
    gs[1].set = AG_GROUP_MOMENTUM;
    gs[1].momentum = 0;
    o = ag_optim_sgd_groups(gs, 2, 0.1, 0.9, 0, false);
    assert_non_null(o);
    memcpy(pw, ag_tensor_data(w), sizeof pw);
    memcpy(pb, ag_tensor_data(b), sizeof pb);
    assert_int_equal(ag_optim_step(o), 0); /* the grads of the last AdamW step */
    for (int i = 0; i < 6; i++)
        pw[i] -= 0.1 * gw[1][i];
    for (int i = 0; i < 2; i++)
        pb[i] -= 0.1 * gb[1][i];
    tu_assert_values(w, 2, (int64_t[]){2, 3}, pw, 1e-14);
    tu_assert_values(b, 1, (int64_t[]){2}, pb, 1e-14);
    assert_int_equal(ag_optim_step(o), 0);
    for (int i = 0; i < 6; i++)
        pw[i] -= 0.1 * (0.9 * gw[1][i] + gw[1][i]);
    for (int i = 0; i < 2; i++)
        pb[i] -= 0.1 * gb[1][i];
    tu_assert_values(w, 2, (int64_t[]){2, 3}, pw, 1e-14);
    tu_assert_values(b, 1, (int64_t[]){2}, pb, 1e-14);
    ag_optim_free(o);
    ag_named_tensors_free(&decay);
    ag_named_tensors_free(&no_decay);
    ag_module_free(m);
}

/* ---- clipping ---- */

static void test_clip_grad_norm(void **state) {
    (void)state;
    ag_tensor *a = tu_leaf(AG_F32, 1, (int64_t[]){2}, (double[]){0, 0});
    ag_tensor *b = tu_leaf(AG_F64, 2, (int64_t[]){2, 2}, (double[]){0, 0, 0, 0});
    ag_tensor *c = tu_leaf(AG_F32, 1, (int64_t[]){1}, (double[]){0}); /* no grad */
    ag_tensor *ga = tu_tensor(AG_F32, 1, (int64_t[]){2}, (double[]){3, 4});
    ag_tensor *gb = tu_tensor(AG_F64, 2, (int64_t[]){2, 2}, (double[]){1, 2, 2, 4});
    ag_tensor_set_grad(a, ga);
    ag_tensor_set_grad(b, gb);
    ag_tensor *ps[] = {a, b, c};
    /* total = sqrt(9 + 16 + 1 + 4 + 4 + 16) = sqrt(50) */
    double total = 0, want = sqrt(50.0);
    assert_int_equal(ag_clip_grad_norm(ps, 3, 10.0, &total), 0); /* under max: unchanged */
    assert_true(fabs(total - want) < 1e-12);
    tu_assert_values(ag_tensor_grad(a), 1, (int64_t[]){2}, (double[]){3, 4}, 0);
    assert_int_equal(ag_clip_grad_norm(ps, 3, 1.0, &total), 0);
    double coef = 1.0 / (want + 1e-6);
    tu_assert_values(ag_tensor_grad(a), 1, (int64_t[]){2}, (double[]){3 * coef, 4 * coef}, 1e-7);
    tu_assert_values(ag_tensor_grad(b), 2, (int64_t[]){2, 2},
                     (double[]){coef, 2 * coef, 2 * coef, 4 * coef}, 1e-15);
    /* After clipping the norm is max_norm (less the 1e-6). */
    assert_int_equal(ag_clip_grad_norm(ps, 3, 100.0, &total), 0);
    assert_true(fabs(total - want / (want + 1e-6)) < 1e-7);
    /* A non-finite gradient: the total is inf and the grads become NaN (0 * inf) and 0. */
    ag_tensor *ginf = tu_tensor(AG_F32, 1, (int64_t[]){2}, (double[]){INFINITY, 1});
    ag_tensor_set_grad(a, ginf);
    assert_int_equal(ag_clip_grad_norm(ps, 2, 1.0, &total), 0);
    assert_true(isinf(total));
    assert_true(isnan(ag_tensor_item_at(ag_tensor_grad(a), 0)));
    assert_true(ag_tensor_item_at(ag_tensor_grad(a), 1) == 0);
    assert_int_equal(ag_clip_grad_norm(ps, 2, -1.0, NULL), AG_EINVAL);
    tu_assert_error_contains("max_norm");
    ag_tensor_free(ginf);
    ag_tensor_free(ga);
    ag_tensor_free(gb);
    ag_tensor_free(a);
    ag_tensor_free(b);
    ag_tensor_free(c);
}

/* ---- schedules ---- */

static void test_lr_schedule(void **state) {
    (void)state;
    ag_lr_schedule s = {.kind = AG_LR_WARMUP_COSINE,
                        .lr = 6e-4,
                        .min_lr = 6e-5,
                        .warmup_iters = 10,
                        .decay_iters = 50};
    assert_true(fabs(ag_lr_at(&s, 0) - 6e-4 * 1 / 10) < 1e-18);
    assert_true(fabs(ag_lr_at(&s, 4) - 6e-4 * 5 / 10) < 1e-18);
    assert_true(fabs(ag_lr_at(&s, 9) - 6e-4) < 1e-18);
    assert_true(fabs(ag_lr_at(&s, 10) - 6e-4) < 1e-18);                         /* cos(0) */
    assert_true(fabs(ag_lr_at(&s, 30) - (6e-5 + 0.5 * (6e-4 - 6e-5))) < 1e-18); /* cos(pi/2) */
    assert_true(fabs(ag_lr_at(&s, 20) - (6e-5 + 0.5 * (1 + cos(M_PI / 4)) * 5.4e-4)) < 1e-18);
    assert_true(fabs(ag_lr_at(&s, 50) - 6e-5) < 1e-18);
    assert_true(ag_lr_at(&s, 51) == 6e-5);
    assert_true(ag_lr_at(&s, 1000000) == 6e-5);
    assert_true(isnan(ag_lr_at(&s, -1)));
    s.decay_iters = 5;
    assert_true(isnan(ag_lr_at(&s, 0)));
    ag_lr_schedule c = {.lr = 0.1}; /* zeroed kind: constant */
    assert_true(ag_lr_at(&c, 0) == 0.1 && ag_lr_at(&c, 12345) == 0.1);
    assert_true(isnan(ag_lr_at(NULL, 0)));
}

/* ---- optimizer state ---- */

/* A module of weight (2, 3) and bias (2), with fixed values, trained on gradients drawn from
 * the step number, under AdamW groups (no decay on the bias) or SGD with momentum. */
static ag_optim *make_opt(ag_module *m, bool sgd) {
    ag_named_tensors d, nd;
    assert_int_equal(ag_module_decay_split(m, &d, &nd), 0);
    ag_param_group gs[2] = {
        {.params = d.tensors, .names = (const char *const *)d.names, .n = d.n},
        {.params = nd.tensors,
         .names = (const char *const *)nd.names,
         .n = nd.n,
         .set = AG_GROUP_WEIGHT_DECAY,
         .weight_decay = 0},
    };
    ag_optim *o = sgd ? ag_optim_sgd_groups(gs, 2, 0.05, 0.9, 0.01, true)
                      : ag_optim_adamw_groups(gs, 2, 0.01, 0.9, 0.95, 1e-8, 0.1);
    assert_non_null(o);
    ag_named_tensors_free(&d);
    ag_named_tensors_free(&nd);
    return o;
}

static void train_steps(ag_module *m, ag_optim *o, int from, int to) {
    ag_lr_schedule s = {.kind = AG_LR_WARMUP_COSINE,
                        .lr = 0.01,
                        .min_lr = 0.001,
                        .warmup_iters = 2,
                        .decay_iters = 6};
    for (int it = from; it < to; it++) {
        ag_tensor *ps[2] = {ag_module_param(m, "weight"), ag_module_param(m, "bias")};
        for (int k = 0; k < 2; k++) {
            int64_t n = ag_tensor_numel(ps[k]);
            double g[6];
            for (int64_t i = 0; i < n; i++)
                g[i] = sin(1.3 * (double)(it * 7 + i + 3 * k)) * (1 + it);
            ag_tensor *t = tu_tensor(AG_F32, ag_tensor_ndim(ps[k]), ag_tensor_sizes(ps[k]), g);
            ag_tensor_set_grad(ps[k], t);
            ag_tensor_free(t);
        }
        assert_int_equal(ag_optim_clip_grad_norm(o, 1.0, NULL), 0);
        ag_optim_set_lr(o, ag_lr_at(&s, it));
        assert_int_equal(ag_optim_step(o), 0);
        ag_optim_zero_grad(o);
    }
}

/* A module converted after its optimizer made state (AdamW's moments in f32): the next step is
 * refused, naming both dtypes, and changes nothing (it used to update through the f32 moments
 * as if they were f64, past their end). */
static void test_optim_state_after_to_dtype(void **state) {
    (void)state;
    ag_module *m = lin(AG_F32, W0, B0);
    ag_optim *o = make_opt(m, false);
    train_steps(m, o, 0, 1);
    assert_int_equal(ag_module_to_dtype(m, AG_F64), 0);
    ag_tensor *w = ag_module_param(m, "weight");
    double before = ag_tensor_item_at(w, 0);
    ag_tensor *g = tu_tensor(AG_F64, 2, (int64_t[]){2, 3}, W1);
    assert_int_equal(ag_tensor_set_grad(w, g), 0);
    ag_tensor_free(g);
    assert_int_equal(ag_optim_step(o), AG_EINVAL);
    tu_assert_error_contains("its optimizer state is");
    tu_assert_error_contains("make the optimizer after converting");
    assert_true(ag_tensor_item_at(w, 0) == before);
    ag_optim_free(o);
    ag_module_free(m);
}

static void test_optim_resume(void **state) {
    (void)state;
    for (int sgd = 0; sgd < 2; sgd++) {
        /* Uninterrupted: 8 steps. */
        ag_module *ref = lin(AG_F32, W1, B1);
        ag_optim *oref = make_opt(ref, sgd);
        train_steps(ref, oref, 0, 8);
        /* 3 steps, saved (model + optimizer), a fresh model and optimizer loaded, 5 more. */
        ag_module *a = lin(AG_F32, W1, B1);
        ag_optim *oa = make_opt(a, sgd);
        train_steps(a, oa, 0, 3);
        const char *mp = tmp_path("model.safetensors"), *op = tmp_path("optim.safetensors");
        assert_int_equal(ag_module_save(a, mp), 0);
        assert_int_equal(ag_optim_save(oa, op), 0);
        ag_optim_free(oa);
        ag_module_free(a);
        ag_module *b = lin(AG_F32, W0, B0);
        ag_optim *ob = make_opt(b, sgd);
        assert_int_equal(ag_module_load(b, mp), 0);
        assert_int_equal(ag_optim_load(ob, op), 0);
        train_steps(b, ob, 3, 8);
        assert_true(tu_same_bits(ag_module_param(b, "weight"), ag_module_param(ref, "weight")));
        assert_true(tu_same_bits(ag_module_param(b, "bias"), ag_module_param(ref, "bias")));
        /* Without the optimizer state the run differs (the test can fail). */
        ag_module *c = lin(AG_F32, W0, B0);
        ag_optim *oc = make_opt(c, sgd);
        assert_int_equal(ag_module_load(c, mp), 0);
        train_steps(c, oc, 3, 8);
        assert_false(tu_same_bits(ag_module_param(c, "weight"), ag_module_param(ref, "weight")));
        /* The file's names: per group, FQN and state. */
        ag_tensor_dict d;
        assert_int_equal(ag_safetensors_load(op, &d), 0);
        assert_non_null(ag_tensor_dict_get(&d, "g0.lr"));
        assert_non_null(ag_tensor_dict_get(&d, "g1.bias.step"));
        assert_int_equal(ag_tensor_item(ag_tensor_dict_get(&d, "g0.weight.step")), 3);
        assert_non_null(
            ag_tensor_dict_get(&d, sgd ? "g0.weight.momentum_buffer" : "g0.weight.exp_avg_sq"));
        ag_tensor_dict_free(&d);
        ag_optim_free(oc);
        ag_module_free(c);
        ag_optim_free(ob);
        ag_module_free(b);
        ag_optim_free(oref);
        ag_module_free(ref);
    }
}

static void test_optim_load_refuses(void **state) {
    (void)state;
    ag_module *a = lin(AG_F32, W1, B1);
    ag_optim *oa = make_opt(a, false);
    train_steps(a, oa, 0, 2);
    const char *op = tmp_path("optim2.safetensors");
    assert_int_equal(ag_optim_save(oa, op), 0);
    /* Another kind. */
    ag_optim *os = make_opt(a, true);
    assert_int_equal(ag_optim_load(os, op), AG_EINVAL);
    tu_assert_error_contains("holds the state of AdamW, not of SGD");
    /* Another shape: a Linear(2, 2) under the same names. */
    ag_module *m = ag_module_new("Linear", NULL, NULL, NULL);
    ag_tensor *tw = ag_zeros(AG_F32, 2, (int64_t[]){2, 2}),
              *tb = ag_zeros(AG_F32, 1, (int64_t[]){2});
    ag_module_register_parameter(m, "weight", tw);
    ag_module_register_parameter(m, "bias", tb);
    ag_tensor_free(tw);
    ag_tensor_free(tb);
    ag_optim *om = make_opt(m, false);
    assert_int_equal(ag_optim_load(om, op), AG_EINVAL);
    tu_assert_error_contains("'g0.weight.exp_avg' in");
    tu_assert_error_contains("is f32[2, 3]; this optimizer's is f32[2, 2]");
    /* One group instead of two: the bias's state is under another name. */
    ag_optim *one = ag_optim_adamw(m, 0.01, 0.9, 0.95, 1e-8, 0.1);
    ag_optim *one_a = ag_optim_adamw(a, 0.01, 0.9, 0.95, 1e-8, 0.1);
    assert_int_equal(ag_optim_load(one_a, op), AG_EINVAL);
    tu_assert_error_contains("which this optimizer does not have");
    /* The refused loads changed nothing: one_a steps as a fresh optimizer. */
    ag_optim_free(one);
    ag_optim_free(one_a);
    ag_optim_free(om);
    ag_module_free(m);
    ag_optim_free(os);
    ag_optim_free(oa);
    ag_module_free(a);
}

/* ---- allocation failures ---- */

typedef struct oom_case {
    const char *file, *partial;
    ag_module *m;
    ag_optim *o;
} oom_case;

static int oom_load_dict(void *ud) {
    const oom_case *c = ud;
    ag_tensor_dict d;
    int rc = ag_safetensors_load(c->file, &d);
    ag_tensor_dict_free(&d);
    return rc;
}

static int oom_load_module(void *ud) {
    const oom_case *c = ud;
    ag_load_opts ns = {.non_strict = true, .convert_dtype = true};
    ag_load_report rep;
    int rc = ag_module_load_ex(c->m, c->partial, &ns, &rep);
    ag_load_report_free(&rep);
    return rc;
}

static int oom_optim_state(void *ud) {
    const oom_case *c = ud;
    int rc = ag_optim_save(c->o, c->file);
    return rc ? rc : ag_optim_load(c->o, c->file);
}

static int oom_groups(void *ud) {
    const oom_case *c = ud;
    ag_named_tensors d, nd;
    int rc = ag_module_decay_split(c->m, &d, &nd);
    if (rc)
        return rc;
    ag_param_group gs[2] = {
        {.params = d.tensors, .names = (const char *const *)d.names, .n = d.n},
        {.params = nd.tensors, .n = nd.n, .set = AG_GROUP_WEIGHT_DECAY},
    };
    ag_optim *o = ag_optim_adamw_groups(gs, 2, 0.01, 0.9, 0.95, 1e-8, 0.1);
    rc = o ? ag_optim_clip_grad_norm(o, 0.1, NULL) : ag_last_status();
    ag_optim_free(o);
    ag_named_tensors_free(&d);
    ag_named_tensors_free(&nd);
    return rc;
}

static void test_alloc_failures(void **state) {
    (void)state;
    oom_case c = {.file = tmp_path("oom.safetensors"), .partial = tmp_path("oomp.safetensors")};
    c.m = lin(AG_F32, W1, B1);
    c.o = make_opt(c.m, false);
    train_steps(c.m, c.o, 0, 2);
    ag_tensor *w64 = tu_tensor(AG_F64, 2, (int64_t[]){2, 3}, W0);
    const char *names[] = {"weight", "unknown"};
    ag_tensor *ts[] = {w64, w64};
    assert_int_equal(ag_safetensors_save(c.partial, names, ts, 2, NULL), 0);
    ag_tensor_free(w64);
    /* Grads for the clip. */
    ag_tensor *g = tu_tensor(AG_F32, 2, (int64_t[]){2, 3}, W0);
    ag_tensor_set_grad(ag_module_param(c.m, "weight"), g);
    ag_tensor_free(g);
    tu_sweep_opts o = {.what = "optimizer state save/load", .one_thread = true};
    tu_alloc_failure_sweep(oom_optim_state, &c, &o);
    assert_int_equal(ag_optim_save(c.o, c.file), 0);
    o.what = "safetensors_load";
    tu_alloc_failure_sweep(oom_load_dict, &c, &o);
    o.what = "module_load_ex (non-strict, converting)";
    tu_alloc_failure_sweep(oom_load_module, &c, &o);
    o.what = "groups and clip";
    tu_alloc_failure_sweep(oom_groups, &c, &o);
    ag_optim_free(c.o);
    ag_module_free(c.m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_named_roundtrip),
        cmocka_unit_test(test_named_hostile),
        cmocka_unit_test(test_load_non_strict),
        cmocka_unit_test(test_load_convert_dtype),
        cmocka_unit_test(test_adamw_groups),
        cmocka_unit_test(test_clip_grad_norm),
        cmocka_unit_test(test_lr_schedule),
        cmocka_unit_test(test_optim_resume),
        cmocka_unit_test(test_optim_load_refuses),
        cmocka_unit_test(test_alloc_failures),
        cmocka_unit_test(test_optim_state_after_to_dtype),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
