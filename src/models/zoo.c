/* The model zoo (include/aotgrad/zoo.h): named models with example inputs.
 *
 * In: a model name and an optional configuration name. Out: a module tree built from the nn
 * API (custom modules' forwards are written here) and its example inputs, drawn from the
 * generator reseeded to 0, so two builds are identical. The CLI traces these models, the tests
 * compare their traced graphs with eager runs, the benchmarks time tracing GPT-2.
 *
 * This file is written like user code: the call-site macros are on (AG_RECORD_SITES), so the
 * nodes traced from the forwards below point at this file's lines. Lines that tests look up
 * carry a `TRACE-MARK: <name>` comment; tests/test_trace.c finds them by scanning this file,
 * so keep each marked statement on one line.
 *
 * Meta mode: every input below is made by ops (randn, rand + mul + to_dtype, scalar_tensor),
 * never by writing through ag_tensor_data, and the nn constructors make data-less parameters
 * in meta mode, so building in meta mode allocates no tensor data. */
#define AG_RECORD_SITES
#include "../core/internal.h"
#include "zoo_effects.h"

#include <stdio.h>

/* ---- helpers for the forwards ---- */

/* Checks a forward's arity: exactly nin_want inputs and room for nout outputs. */
static int check_io(const ag_module *m, int nin, int nin_want, int max_out, int nout) {
    if (nin != nin_want)
        return ag__err(AG_EINVAL, "%s: expected %d input%s, got %d", ag_module_type(m), nin_want,
                       nin_want == 1 ? "" : "s", nin);
    if (max_out < nout)
        return ag__err(AG_EINVAL, "%s: returns %d outputs, room for %d", ag_module_type(m), nout,
                       max_out);
    return 0;
}

/* The status of the error that made an op return NULL. */
static int status(void) {
    return ag_last_status() < 0 ? ag_last_status() : AG_EINVAL;
}

/* Ends the forward's autorelease scope, handing res[0..n) (owned by that scope) to the caller
 * as new references. Returns n, or the pending error when a result is NULL. */
static int finish(ag_tensor *const *res, int n, ag_tensor **out) {
    int rc = n;
    for (int i = 0; i < n; i++)
        if (!res[i]) {
            rc = status();
            break;
        }
    for (int i = 0; i < n && rc >= 0; i++)
        out[i] = ag_tensor_keep(res[i]);
    ag_scope_end();
    return rc;
}

/* Calls child module `name` of m on x. A macro, not a function, so that the call site
 * recorded for the module call is the forward's own line. */
#define child(m, name, x) ag_module_forward(ag_module_child((m), (name)), (x))

/* ---- forwards ---- */

/* linear: x [N, 3] -> linear(x) [N, 2] */
static int linear_fwd(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    int rc = check_io(m, nin, 1, max_out, 1);
    if (rc)
        return rc;
    ag_scope_begin();
    ag_tensor *y = child(m, "linear", in[0]); /* TRACE-MARK: linear-forward */
    return finish(&y, 1, out);
}

/* multi_output: x [N, 3] -> (linear1(x) [N, 2], linear2(x) [N, 4]) */
static int multi_output_fwd(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out,
                            int max_out) {
    int rc = check_io(m, nin, 1, max_out, 2);
    if (rc)
        return rc;
    ag_scope_begin();
    /* One statement per traced call: the order in which C evaluates an initializer list's
     * (or a call's) elements is unspecified, and it would become the graph's order. */
    ag_tensor *y1 = child(m, "linear1", in[0]);
    ag_tensor *y2 = child(m, "linear2", in[0]);
    ag_tensor *y[2] = {y1, y2};
    return finish(y, 2, out);
}

/* kwargs: (x [N, 3], scale) -> linear(x) * scale. `scale` is Python's keyword argument; C
 * passes it as the second input (the export stage names it in the in_spec). */
static int kwargs_fwd(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    int rc = check_io(m, nin, 2, max_out, 1);
    if (rc)
        return rc;
    ag_scope_begin();
    ag_tensor *y = ag_mul(child(m, "linear", in[0]), in[1]); /* TRACE-MARK: kwargs-mul */
    return finish(&y, 1, out);
}

/* convbn: x [N, 1, H, W] -> relu(bn(conv(x))) [N, 3, H, W] */
static int convbn_fwd(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    int rc = check_io(m, nin, 1, max_out, 1);
    if (rc)
        return rc;
    ag_scope_begin();
    ag_tensor *y = child(m, "conv", in[0]); /* TRACE-MARK: convbn-conv */
    y = child(m, "bn", y);
    y = ag_relu(y); /* TRACE-MARK: convbn-relu */
    return finish(&y, 1, out);
}

/* grad_acc: x [N, 3] -> linear(x) - linear2(x); x is used twice, so its gradient is
 * accumulated from two paths in the backward. */
static int grad_acc_fwd(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    int rc = check_io(m, nin, 1, max_out, 1);
    if (rc)
        return rc;
    ag_scope_begin();
    ag_tensor *a = child(m, "linear", in[0]); /* traced first, as in Python */
    ag_tensor *b = child(m, "linear2", in[0]);
    ag_tensor *y = ag_sub(a, b);
    return finish(&y, 1, out);
}

/* two_tensor: x [N, 3] -> linear(x, weight, bias) [N, 2], a TwoTensor (weight and bias are
 * TwoTensor parameters: every op runs on their a halves and on their b halves). */
static int two_tensor_fwd(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out,
                          int max_out) {
    int rc = check_io(m, nin, 1, max_out, 1);
    if (rc)
        return rc;
    ag_scope_begin();
    ag_tensor *y = ag_linear(in[0], ag_module_param(m, "weight"), ag_module_param(m, "bias"));
    return finish(&y, 1, out);
}

/* mlp: x [N, 784] -> fc3(relu(fc2(relu(fc1(x))))) [N, 10] */
static int mlp_fwd(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    int rc = check_io(m, nin, 1, max_out, 1);
    if (rc)
        return rc;
    ag_scope_begin();
    ag_tensor *h = ag_relu(child(m, "fc1", in[0])); /* TRACE-MARK: mlp-fc1 */
    h = ag_relu(child(m, "fc2", h));
    ag_tensor *y = child(m, "fc3", h);
    return finish(&y, 1, out);
}

/* dropout_mlp: x [N, 16] -> fc2(drop(relu(fc1(x)))) [N, 4]; drop = Dropout(p) in training, so
 * every call draws a fresh mask. */
static int dropout_mlp_fwd(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out,
                           int max_out) {
    int rc = check_io(m, nin, 1, max_out, 1);
    if (rc)
        return rc;
    ag_scope_begin();
    ag_tensor *h = ag_relu(child(m, "fc1", in[0]));
    h = child(m, "drop", h); /* TRACE-MARK: dropout-mlp-drop */
    ag_tensor *y = child(m, "fc2", h);
    return finish(&y, 1, out);
}

/* cnn: x [N, 1, 28, 28] -> logits [N, 10].
 * [N,1,28,28] -conv1,bn1,relu-> [N,32,28,28] -pool1-> [N,32,14,14]
 *             -conv2,bn2,relu-> [N,64,14,14] -pool2-> [N,64,7,7] -flatten-> [N,3136]
 *             -fc1,relu-> [N,128] -fc2-> [N,10] */
static int cnn_fwd(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    int rc = check_io(m, nin, 1, max_out, 1);
    if (rc)
        return rc;
    ag_scope_begin();
    ag_tensor *h = ag_relu(child(m, "bn1", child(m, "conv1", in[0]))); /* TRACE-MARK: cnn-block1 */
    h = child(m, "pool1", h);
    h = ag_relu(child(m, "bn2", child(m, "conv2", h)));
    h = child(m, "pool2", h);
    h = child(m, "flatten", h);
    h = ag_relu(child(m, "fc1", h));
    ag_tensor *y = child(m, "fc2", h);
    return finish(&y, 1, out);
}

/* alias_views: (a [3, 4], b = a[1] [4], a view of a) -> (y[0], y.t(), b) with
 * y = (a + 1) * w, after b.mul_(2). The in-place update of b reaches a (the export merges
 * them into one ViewBaseAOTInput primal and writes the new base back into the caller's a);
 * y[0] and y.t() are two views of one intermediate (an IntermediateBaseAOTOutput with a
 * tangent; the compiled callable returns them as views of it); b is returned as is (an alias
 * of the caller's input). */
static int alias_views_fwd(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out,
                           int max_out) {
    int rc = check_io(m, nin, 2, max_out, 3);
    if (rc)
        return rc;
    ag_scope_begin();
    ag_tensor *b = ag_mul_scalar_(in[1], 2.0); /* TRACE-MARK: alias-views-mutation */
    ag_tensor *y = ag_mul(ag_add_scalar(in[0], 1.0), ag_module_param(m, "w"));
    ag_tensor *y0 = ag_select(y, 0, 0);
    ag_tensor *yt = ag_t(y);
    ag_tensor *res[3] = {y0, yt, b};
    return finish(res, 3, out);
}

/* ---- builders ---- */

/* Adds child to m unless an earlier step failed, in which case the child is freed and the
 * earlier status returned: chains of `rc = add(m, rc, ...)` need one check at the end. */
static int add(ag_module *m, int rc, const char *name, ag_module *c) {
    if (rc) {
        ag_module_free(c);
        return rc;
    }
    return ag_module_add_child(m, name, c);
}

static ag_module *new_model(const char *type, ag_forward_fn fwd, int *rc) {
    ag_module *m = ag_module_new(type, fwd, NULL, NULL);
    *rc = m ? 0 : status();
    return m;
}

static ag_module *build_linear(int *rc) {
    ag_module *m = new_model("LinearModel", linear_fwd, rc);
    *rc = add(m, *rc, "linear", ag_nn_linear(3, 2, true));
    return m;
}

static ag_module *build_multi_output(int *rc) {
    ag_module *m = new_model("MultiOutput", multi_output_fwd, rc);
    *rc = add(m, *rc, "linear1", ag_nn_linear(3, 2, true));
    *rc = add(m, *rc, "linear2", ag_nn_linear(3, 4, true));
    return m;
}

static ag_module *build_kwargs(int *rc) {
    ag_module *m = new_model("ModuleWithKwargs", kwargs_fwd, rc);
    *rc = add(m, *rc, "linear", ag_nn_linear(3, 2, true));
    return m;
}

static ag_module *build_convbn(int *rc) {
    ag_module *m = new_model("ConvBN", convbn_fwd, rc);
    *rc = add(m, *rc, "conv", ag_nn_conv2d(1, 3, 3, 1, 1, 1, 1, true));
    *rc = add(m, *rc, "bn", ag_nn_batchnorm2d(3, 1e-5, 0.1));
    if (!*rc)
        ag_module_train(m, true);
    return m;
}

static ag_module *build_grad_acc(int *rc) {
    ag_module *m = new_model("GradAcc", grad_acc_fwd, rc);
    *rc = add(m, *rc, "linear", ag_nn_linear(3, 2, true));
    *rc = add(m, *rc, "linear2", ag_nn_linear(3, 2, true));
    return m;
}

/* A TwoTensor parameter of the given shape: both halves uniform in [-0.5, 0.5). */
static int add_two_tensor_param(ag_module *m, int rc, const char *name, int ndim,
                                const int64_t *sizes) {
    if (rc)
        return rc;
    ag_scope_begin();
    ag_tensor *a = ag_sub_scalar(ag_rand(AG_F32, ndim, sizes), 0.5);
    ag_tensor *b = ag_sub_scalar(ag_rand(AG_F32, ndim, sizes), 0.5);
    ag_tensor *w = ag_two_tensor(a, b);
    rc = w ? ag_module_register_parameter(m, name, w) : status();
    ag_scope_end();
    return rc;
}

static ag_module *build_two_tensor(int *rc) {
    ag_module *m = new_model("TwoTensorLinear", two_tensor_fwd, rc);
    *rc = add_two_tensor_param(m, *rc, "weight", 2, (int64_t[]){2, 3});
    *rc = add_two_tensor_param(m, *rc, "bias", 1, (int64_t[]){2});
    return m;
}

static ag_module *build_mlp(int *rc) {
    ag_module *m = new_model("MLP", mlp_fwd, rc);
    *rc = add(m, *rc, "fc1", ag_nn_linear(784, 256, true));
    *rc = add(m, *rc, "fc2", ag_nn_linear(256, 128, true));
    *rc = add(m, *rc, "fc3", ag_nn_linear(128, 10, true));
    return m;
}

static ag_module *build_cnn(int *rc) {
    ag_module *m = new_model("FashionCNN", cnn_fwd, rc);
    *rc = add(m, *rc, "conv1", ag_nn_conv2d(1, 32, 3, 1, 1, 1, 1, true));
    *rc = add(m, *rc, "bn1", ag_nn_batchnorm2d(32, 1e-5, 0.1));
    *rc = add(m, *rc, "pool1", ag_nn_maxpool2d(2, 2, 0));
    *rc = add(m, *rc, "conv2", ag_nn_conv2d(32, 64, 3, 1, 1, 1, 1, true));
    *rc = add(m, *rc, "bn2", ag_nn_batchnorm2d(64, 1e-5, 0.1));
    *rc = add(m, *rc, "pool2", ag_nn_maxpool2d(2, 2, 0));
    *rc = add(m, *rc, "flatten", ag_nn_flatten(1, -1));
    *rc = add(m, *rc, "fc1", ag_nn_linear(64 * 7 * 7, 128, true));
    *rc = add(m, *rc, "fc2", ag_nn_linear(128, 10, true));
    if (!*rc)
        ag_module_train(m, true);
    return m;
}

static ag_module *build_alias_views(int *rc) {
    ag_module *m = new_model("AliasViews", alias_views_fwd, rc);
    ag_tensor *w = *rc ? NULL : ag_randn(AG_F32, 1, (int64_t[]){4});
    if (!*rc && !w)
        *rc = status();
    if (!*rc)
        *rc = ag_module_register_parameter(m, "w", w);
    ag_tensor_free(w); /* the module holds its own reference */
    return m;
}

/* The options of the build in progress (ag_zoo_build_opts). Models with dropout layers take
 * their probability from them. */
static _Thread_local const ag_zoo_opts *build_opts;

static double dropout_or(double def) {
    return build_opts && build_opts->set_dropout ? build_opts->dropout : def;
}

static ag_module *build_dropout_mlp(int *rc) {
    ag_module *m = new_model("DropoutMLP", dropout_mlp_fwd, rc);
    *rc = add(m, *rc, "fc1", ag_nn_linear(16, 32, true));
    *rc = add(m, *rc, "drop", ag_nn_dropout(dropout_or(0.5)));
    *rc = add(m, *rc, "fc2", ag_nn_linear(32, 4, true));
    if (!*rc)
        ag_module_train(m, true);
    return m;
}

/* Example inputs, made inside the caller's scope by ops only (meta mode makes them
 * data-less). in[] receives scope-owned tensors; returns how many. */
typedef int (*inputs_fn)(const char *config, ag_tensor **in);

static int x_4x3(const char *config, ag_tensor **in) {
    in[0] = ag_randn(AG_F32, 2, (int64_t[]){4, 3});
    return 1;
}

static int kwargs_inputs(const char *config, ag_tensor **in) {
    in[0] = ag_randn(AG_F32, 2, (int64_t[]){4, 3});
    in[1] = ag_scalar_tensor(AG_F32, 2.0); /* scale */
    return 2;
}

static int convbn_inputs(const char *config, ag_tensor **in) {
    in[0] = ag_randn(AG_F32, 4, (int64_t[]){2, 1, 4, 4});
    return 1;
}

static int grad_acc_inputs(const char *config, ag_tensor **in) {
    in[0] = ag_randn(AG_F32, 2, (int64_t[]){4, 3});
    if (in[0] && ag_tensor_set_requires_grad(in[0], true))
        in[0] = NULL;
    return 1;
}

static int mlp_inputs(const char *config, ag_tensor **in) {
    in[0] = ag_randn(AG_F32, 2, (int64_t[]){32, 784});
    return 1;
}

static int dropout_mlp_inputs(const char *config, ag_tensor **in) {
    in[0] = ag_randn(AG_F32, 2, (int64_t[]){8, 16});
    return 1;
}

static int cnn_inputs(const char *config, ag_tensor **in) {
    in[0] = ag_randn(AG_F32, 4, (int64_t[]){8, 1, 28, 28});
    return 1;
}

static int alias_views_inputs(const char *config, ag_tensor **in) {
    in[0] = ag_randn(AG_F32, 2, (int64_t[]){3, 4});
    in[1] = in[0] ? ag_select(in[0], 0, 1) : NULL; /* a view of in[0] */
    return 2;
}

/* ---- GPT-2 ---- */

static const char *const gpt2_configs[] = {"tiny", "gpt2-small", "gpt2-xl"};
/* gpt2_configs joined, for ag_zoo_configs (gpt2 is the one model with configurations). */
static const char gpt2_config_list[] = "tiny, gpt2-small, gpt2-xl";

static ag_gpt2_config gpt2_config(const char *config) {
    if (config && !strcmp(config, "gpt2-small"))
        return ag_gpt2_config_small();
    if (config && !strcmp(config, "gpt2-xl"))
        return ag_gpt2_config_xl();
    return ag_gpt2_config_tiny();
}

static ag_module *build_gpt2(const char *config, int *rc) {
    ag_gpt2_config cfg = gpt2_config(config);
    cfg.dropout = dropout_or(cfg.dropout);
    cfg.compile_region_blocks = build_opts && build_opts->nested_blocks;
    ag_module *m = ag_nn_gpt2(&cfg);
    *rc = m ? 0 : status();
    return m;
}

/* idx [2, 16] i64: uniform tokens in [0, vocab), as floor(U[0, 1) * (V - 0.5)) so that no
 * rounding of the f32 product reaches V. */
static int gpt2_inputs(const char *config, ag_tensor **in) {
    ag_gpt2_config cfg = gpt2_config(config);
    ag_tensor *u = ag_rand(AG_F32, 2, (int64_t[]){2, 16});
    in[0] = ag_to_dtype(ag_mul_scalar(u, (double)cfg.vocab_size - 0.5), AG_I64);
    return 1;
}

/* ---- the registry ---- */

typedef struct zoo_entry {
    const char *name, *description;
    const char *const *configs; /* NULL: only "default" */
    int nconfigs;
    ag_module *(*build)(int *rc); /* models without configurations */
    ag_module *(*build_cfg)(const char *config, int *rc);
    inputs_fn inputs;
    int ninputs;
} zoo_entry;

static const zoo_entry zoo[] = {
    {"linear", "Linear(3, 2) as attribute `linear`; x [4, 3]", NULL, 0, build_linear, NULL, x_4x3,
     1},
    {"multi_output", "linear1 = Linear(3, 2), linear2 = Linear(3, 4), returns both; x [4, 3]", NULL,
     0, build_multi_output, NULL, x_4x3, 1},
    {"kwargs", "linear(x) * scale, Linear(3, 2); x [4, 3], scale (the kwarg) a 0-dim tensor", NULL,
     0, build_kwargs, NULL, kwargs_inputs, 2},
    {"convbn", "Conv2d(1, 3, 3, padding=1) + BatchNorm2d(3) + relu, training; x [2, 1, 4, 4]", NULL,
     0, build_convbn, NULL, convbn_inputs, 1},
    {"grad_acc", "linear(x) - linear2(x), both Linear(3, 2); x [4, 3] requires grad", NULL, 0,
     build_grad_acc, NULL, grad_acc_inputs, 1},
    {"mlp", "MLP 784-256-128-10 with ReLU; x [32, 784]", NULL, 0, build_mlp, NULL, mlp_inputs, 1},
    {"cnn",
     "Fashion-MNIST CNN: 2x (Conv2d-BatchNorm2d-ReLU-MaxPool2d), Linear(3136, 128), "
     "Linear(128, 10), training; x [8, 1, 28, 28]",
     NULL, 0, build_cnn, NULL, cnn_inputs, 1},
    {"gpt2",
     "GPT-2 as nanoGPT: tiny (2 layers, 64 wide) by default, gpt2-small 124M, gpt2-xl 1.56B; "
     "idx [2, 16]",
     gpt2_configs, 3, NULL, build_gpt2, gpt2_inputs, 1},
    {"effects",
     "effectful op: log_value(linear1(x)), relu, log_value(linear2(.)), logged "
     "in forward and backward; x [4, 3]",
     NULL, 0, ag__zoo_build_effects, NULL, ag__zoo_effects_inputs, 1},
    {"alias_views",
     "b = a[1] mutated in place (b.mul_(2)), returns y[0], y.t() and b for y = (a + 1) * w, "
     "w [4]; a [3, 4], b a view of a",
     NULL, 0, build_alias_views, NULL, alias_views_inputs, 2},
    {"dropout_mlp",
     "Linear(16, 32)-ReLU-Dropout(0.5)-Linear(32, 4), training: draws a mask per call; x [8, 16]",
     NULL, 0, build_dropout_mlp, NULL, dropout_mlp_inputs, 1},
    {"two_tensor",
     "linear(x, weight, bias) with TwoTensor parameters weight [2, 3] and bias [2] (a tensor "
     "subclass); x [4, 3]; the output is a TwoTensor",
     NULL, 0, build_two_tensor, NULL, x_4x3, 1},
};

/* The models whose dropout probability the build options may set. */
static bool has_dropout(const char *name) {
    return !strcmp(name, "dropout_mlp") || !strcmp(name, "gpt2");
}
enum { NZOO = (int)(sizeof zoo / sizeof zoo[0]) };

int ag_zoo_count(void) {
    return NZOO;
}

const char *ag_zoo_name(int i) {
    return i >= 0 && i < NZOO ? zoo[i].name : NULL;
}

const char *ag_zoo_description(int i) {
    return i >= 0 && i < NZOO ? zoo[i].description : NULL;
}

const char *ag_zoo_configs(int i) {
    if (i < 0 || i >= NZOO)
        return NULL;
    return zoo[i].configs ? gpt2_config_list : "default";
}

/* "a, b, c" into buf. */
static const char *join(char *buf, size_t n, const char *const *items, int count) {
    size_t k = 0;
    buf[0] = 0;
    for (int i = 0; i < count && k < n; i++)
        k += (size_t)snprintf(buf + k, n - k, "%s%s", i ? ", " : "", items[i]);
    return buf;
}

static const zoo_entry *find_entry(const char *name) {
    for (int i = 0; i < NZOO; i++)
        if (!strcmp(zoo[i].name, name))
            return &zoo[i];
    return NULL;
}

/* Checks config against the entry's list; NULL and "default" pick the default. */
static int check_config(const zoo_entry *e, const char *config) {
    if (!config || !strcmp(config, "default"))
        return 0;
    for (int i = 0; i < e->nconfigs; i++)
        if (!strcmp(config, e->configs[i]))
            return 0;
    char b[256];
    if (!e->configs)
        return ag__err(AG_EINVAL,
                       "zoo: model '%s' has no configuration '%s' (it has only "
                       "'default')",
                       e->name, config);
    return ag__err(AG_EINVAL, "zoo: model '%s' has no configuration '%s' (configurations: %s)",
                   e->name, config, join(b, sizeof b, e->configs, e->nconfigs));
}

int ag_zoo_build(const char *name, const char *config, ag_module **model, ag_tensor **inputs,
                 int max_inputs, int *ninputs) {
    if (model)
        *model = NULL;
    if (ninputs)
        *ninputs = 0;
    AG__CHECK_NULL("zoo_build", name);
    AG__CHECK_NULL("zoo_build", model);
    AG__CHECK_NULL("zoo_build", inputs);
    AG__CHECK_NULL("zoo_build", ninputs);
    return ag_zoo_build_opts(name, config, NULL, model, inputs, max_inputs, ninputs);
}

int ag_zoo_build_opts(const char *name, const char *config, const ag_zoo_opts *opts,
                      ag_module **model, ag_tensor **inputs, int max_inputs, int *ninputs) {
    if (model)
        *model = NULL;
    if (ninputs)
        *ninputs = 0;
    AG__CHECK_NULL("zoo_build_opts", name);
    AG__CHECK_NULL("zoo_build_opts", model);
    AG__CHECK_NULL("zoo_build_opts", inputs);
    AG__CHECK_NULL("zoo_build_opts", ninputs);
    const zoo_entry *e = find_entry(name);
    if (!e) {
        const char *names[NZOO];
        for (int i = 0; i < NZOO; i++)
            names[i] = zoo[i].name;
        char b[256];
        return ag__err(AG_EINVAL, "zoo: unknown model '%s' (models: %s)", name,
                       join(b, sizeof b, names, NZOO));
    }
    int rc = check_config(e, config);
    if (rc)
        return rc;
    if (opts && opts->set_dropout) {
        if (!has_dropout(name))
            return ag__err(AG_EINVAL,
                           "zoo: model '%s' has no dropout (models with dropout: "
                           "dropout_mlp, gpt2)",
                           name);
        if (!(opts->dropout >= 0 && opts->dropout <= 1))
            return ag__err(AG_EINVAL, "zoo: dropout probability %g is not in [0, 1]",
                           opts->dropout);
    }
    if (opts && opts->nested_blocks && strcmp(name, "gpt2"))
        return ag__err(AG_EINVAL,
                       "zoo: model '%s' has no blocks to mark as nested compile "
                       "regions (only gpt2 has)",
                       name);
    if (max_inputs < e->ninputs)
        return ag__err(AG_EINVAL, "zoo: model '%s' takes %d input%s, room for %d", name, e->ninputs,
                       e->ninputs == 1 ? "" : "s", max_inputs);

    ag_manual_seed(0);
    build_opts = opts;
    ag_module *m = e->build ? e->build(&rc) : e->build_cfg(config, &rc);
    build_opts = NULL;
    if (rc) {
        ag_module_free(m);
        return rc;
    }
    /* The inputs are made in a scope of our own and kept, so the caller owns them whether or
     * not it has a scope open. */
    ag_tensor *in[2] = {NULL, NULL}; /* e->ninputs of them */
    ag_scope_begin();
    int n = e->inputs(config, in);
    for (int i = 0; i < n; i++)
        if (!in[i])
            rc = status();
    for (int i = 0; i < n && !rc; i++)
        inputs[i] = ag_tensor_keep(in[i]);
    ag_scope_end();
    if (rc) {
        ag_module_free(m);
        return rc;
    }
    *model = m;
    *ninputs = n;
    return 0;
}
