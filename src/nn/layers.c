/* The built-in modules: Linear, Conv2d, BatchNorm2d, LayerNorm, Embedding, Dropout, ReLU,
 * GELU, MaxPool2d, AvgPool2d, AdaptiveAvgPool2d, Flatten, Sequential, ModuleList and
 * CrossEntropyLoss.
 *
 * Each constructor registers its parameters and buffers under PyTorch's names with PyTorch's
 * default initialization (drawn from aotgrad's generator), and each forward is a few op calls
 * inside its own autorelease scope whose result it keeps, so the caller gets a new reference
 * (ag_module_call then hands it to the caller's scope). Forwards only call ops and read sizes,
 * never tensor data, so that they trace. */
/* Module code records its call sites like user code, as torch/nn frames appear in PyTorch
 * stack traces. Each traced op call is kept on one line: a call spanning lines records its
 * first line under GCC and its last under Clang (see include/aotgrad/sites.h). */
#define AG_RECORD_SITES
#include "nn_internal.h"

#include <math.h>
#include <stdio.h>

/* One input, one output: the common shape of a layer's forward. */
typedef ag_tensor *(*unary_fn)(ag_module *m, ag_tensor *x);

static int unary_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int max_out,
                         unary_fn f) {
    int rc = ag_module_check_io(m, nin, 1, 1, max_out, 1);
    if (rc)
        return rc;
    ag_scope_begin();
    return ag_module_return1(f(m, in[0]), out);
}

#define NN_UNARY_FORWARD(name)                                                                     \
    static int name##_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out,        \
                              int max_out) {                                                       \
        return unary_forward(m, in, nin, out, max_out, name##_apply);                              \
    }

/* A module with a copy of `ud` (size bytes) as its user data. */
static ag_module *module_with(const char *type, ag_forward_fn fwd, const void *ud, size_t size) {
    void *copy = NULL;
    if (ud) {
        copy = ag__malloc(size);
        if (!copy)
            return NULL;
        memcpy(copy, ud, size);
    }
    return ag_module_new(type, fwd, copy, copy ? ag__free : NULL);
}

/* Frees m and returns NULL when rc reports a failure: `return done(m, rc);`. */
static ag_module *done(ag_module *m, int rc) {
    if (rc) {
        ag_module_free(m);
        return NULL;
    }
    return m;
}

/* ---- Linear: y = x @ weight^T + bias; weight (out, in), bias (out) ---- */

static ag_tensor *linear_apply(ag_module *m, ag_tensor *x) {
    return ag_linear(x, ag_module_param(m, "weight"), ag_module_param(m, "bias"));
}
NN_UNARY_FORWARD(linear)

static int check_features(const char *op, int64_t in, int64_t out) {
    if (in <= 0 || out <= 0)
        return ag__err(AG_EINVAL,
                       "%s: in_features and out_features must be positive, got %lld "
                       "and %lld",
                       op, (long long)in, (long long)out);
    return 0;
}

ag_module *ag_nn_linear(int64_t in_features, int64_t out_features, bool bias) {
    if (check_features("Linear", in_features, out_features))
        return NULL;
    ag_module *m = ag_module_new("Linear", linear_forward, NULL, NULL);
    if (!m)
        return NULL;
    /* kaiming_uniform_(a=sqrt(5)) reduces to U(-1/sqrt(fan_in), 1/sqrt(fan_in)); the bias
     * uses the same bound. */
    double bound = 1.0 / sqrt((double)in_features);
    int rc = ag_module_add_tensor(m, "weight", true, ag_get_default_dtype(), 2,
                                  (int64_t[]){out_features, in_features}, AG_INIT_UNIFORM, -bound,
                                  bound);
    if (!rc && bias)
        rc = ag_module_add_tensor(m, "bias", true, ag_get_default_dtype(), 1, &out_features,
                                  AG_INIT_UNIFORM, -bound, bound);
    return done(m, rc);
}

ag_module *ag__nn_linear_normal(int64_t in_features, int64_t out_features, bool bias, double std,
                                ag_tensor *tied) {
    if (check_features("Linear", in_features, out_features))
        return NULL;
    if (tied &&
        (tied->ndim != 2 || tied->sizes[0] != out_features || tied->sizes[1] != in_features)) {
        char b[128];
        ag__err(AG_EINVAL, "Linear: tied weight has shape %s, expected [%lld, %lld]",
                ag__fmt_sizes(b, sizeof b, tied->ndim, tied->sizes), (long long)out_features,
                (long long)in_features);
        return NULL;
    }
    ag_module *m = ag_module_new("Linear", linear_forward, NULL, NULL);
    if (!m)
        return NULL;
    int rc = tied ? ag_module_register_parameter(m, "weight", tied)
                  : ag_module_add_tensor(m, "weight", true, ag_get_default_dtype(), 2,
                                         (int64_t[]){out_features, in_features}, AG_INIT_NORMAL,
                                         0.0, std);
    if (!rc && bias)
        rc = ag_module_add_tensor(m, "bias", true, ag_get_default_dtype(), 1, &out_features,
                                  AG_INIT_ZEROS, 0, 0);
    return done(m, rc);
}

/* ---- Conv2d: weight (O, C/groups, k, k), bias (O) ---- */

typedef struct conv_ud {
    int64_t stride[2], padding[2], dilation[2], groups;
} conv_ud;

static ag_tensor *conv2d_apply(ag_module *m, ag_tensor *x) {
    const conv_ud *u = ag_module_ud(m);
    ag_tensor *w = ag_module_param(m, "weight"), *b = ag_module_param(m, "bias");
    return ag_conv2d(x, w, b, u->stride, u->padding, u->dilation, u->groups);
}
NN_UNARY_FORWARD(conv2d)

ag_module *ag_nn_conv2d(int64_t in_ch, int64_t out_ch, int64_t kernel, int64_t stride,
                        int64_t padding, int64_t dilation, int64_t groups, bool bias) {
    if (in_ch <= 0 || out_ch <= 0 || kernel <= 0 || stride <= 0 || padding < 0 || dilation <= 0 ||
        groups <= 0) {
        ag__err(AG_EINVAL,
                "Conv2d: bad arguments (in_channels %lld, out_channels %lld, "
                "kernel_size %lld, stride %lld, padding %lld, dilation %lld, groups "
                "%lld): sizes, stride, dilation and groups must be positive, padding "
                "non-negative",
                (long long)in_ch, (long long)out_ch, (long long)kernel, (long long)stride,
                (long long)padding, (long long)dilation, (long long)groups);
        return NULL;
    }
    if (in_ch % groups || out_ch % groups) {
        ag__err(AG_EINVAL,
                "Conv2d: in_channels (%lld) and out_channels (%lld) must be divisible "
                "by groups (%lld)",
                (long long)in_ch, (long long)out_ch, (long long)groups);
        return NULL;
    }
    conv_ud u = {{stride, stride}, {padding, padding}, {dilation, dilation}, groups};
    ag_module *m = module_with("Conv2d", conv2d_forward, &u, sizeof u);
    if (!m)
        return NULL;
    int64_t fan_in = in_ch / groups * kernel * kernel;
    double bound = 1.0 / sqrt((double)fan_in);
    int rc = ag_module_add_tensor(m, "weight", true, ag_get_default_dtype(), 4,
                                  (int64_t[]){out_ch, in_ch / groups, kernel, kernel},
                                  AG_INIT_UNIFORM, -bound, bound);
    if (!rc && bias)
        rc = ag_module_add_tensor(m, "bias", true, ag_get_default_dtype(), 1, &out_ch,
                                  AG_INIT_UNIFORM, -bound, bound);
    return done(m, rc);
}

/* ---- BatchNorm2d: weight, bias (C); buffers running_mean, running_var (C) and
 * num_batches_tracked (i64, 0-dim) ---- */

typedef struct bn_ud {
    double eps, momentum;
} bn_ud;

static ag_tensor *batchnorm2d_apply(ag_module *m, ag_tensor *x) {
    const bn_ud *u = ag_module_ud(m);
    if (x->ndim != 4) {
        ag__err(AG_EINVAL, "BatchNorm2d: expected 4D input (got %dD input)", x->ndim);
        return NULL;
    }
    bool training = ag_module_is_training(m);
    if (training) {
        /* PyTorch counts the batches seen in training, outside autograd. */
        bool prev = ag_set_grad_enabled(false);
        ag_tensor *r = ag_add_scalar_(ag_module_buffer(m, "num_batches_tracked"), 1.0);
        ag_set_grad_enabled(prev);
        if (!r)
            return NULL;
    }
    /* Training: batch statistics, running stats updated in place by the op. Eval: the
     * running statistics normalize. */
    ag_tensor *y = NULL, *save_mean = NULL, *save_invstd = NULL;
    ag_tensor *w = ag_module_param(m, "weight"), *b = ag_module_param(m, "bias");
    ag_tensor *rm = ag_module_buffer(m, "running_mean"), *rv = ag_module_buffer(m, "running_var");
    double mom = u->momentum, eps = u->eps;
    ag_native_batch_norm(x, w, b, rm, rv, training, mom, eps, &y, &save_mean, &save_invstd);
    return y;
}
NN_UNARY_FORWARD(batchnorm2d)

ag_module *ag_nn_batchnorm2d(int64_t num_features, double eps, double momentum) {
    if (num_features <= 0 || !(eps >= 0) || !(momentum >= 0 && momentum <= 1)) {
        ag__err(AG_EINVAL, "BatchNorm2d: bad arguments (num_features %lld, eps %g, momentum %g)",
                (long long)num_features, eps, momentum);
        return NULL;
    }
    bn_ud u = {eps, momentum};
    ag_module *m = module_with("BatchNorm2d", batchnorm2d_forward, &u, sizeof u);
    if (!m)
        return NULL;
    const int64_t *c = &num_features;
    int rc =
        ag_module_add_tensor(m, "weight", true, ag_get_default_dtype(), 1, c, AG_INIT_ONES, 0, 0);
    if (!rc)
        rc = ag_module_add_tensor(m, "bias", true, ag_get_default_dtype(), 1, c, AG_INIT_ZEROS, 0,
                                  0);
    if (!rc)
        rc = ag_module_add_tensor(m, "running_mean", false, ag_get_default_dtype(), 1, c,
                                  AG_INIT_ZEROS, 0, 0);
    if (!rc)
        rc = ag_module_add_tensor(m, "running_var", false, ag_get_default_dtype(), 1, c,
                                  AG_INIT_ONES, 0, 0);
    if (!rc)
        rc = ag_module_add_tensor(m, "num_batches_tracked", false, AG_I64, 0, NULL, AG_INIT_ZEROS,
                                  0, 0);
    return done(m, rc);
}

/* ---- LayerNorm over the last dim: weight, bias (dim) ---- */

typedef struct ln_ud {
    int64_t dim;
    double eps;
} ln_ud;

static ag_tensor *layernorm_apply(ag_module *m, ag_tensor *x) {
    const ln_ud *u = ag_module_ud(m);
    ag_tensor *w = ag_module_param(m, "weight"), *b = ag_module_param(m, "bias");
    return ag_layer_norm(x, 1, &u->dim, w, b, u->eps);
}
NN_UNARY_FORWARD(layernorm)

ag_module *ag__nn_layernorm_ex(int64_t dim, double eps, bool weight, bool bias) {
    if (dim <= 0 || !(eps >= 0)) {
        ag__err(AG_EINVAL, "LayerNorm: bad arguments (normalized_shape %lld, eps %g)",
                (long long)dim, eps);
        return NULL;
    }
    ln_ud u = {dim, eps};
    ag_module *m = module_with("LayerNorm", layernorm_forward, &u, sizeof u);
    if (!m)
        return NULL;
    int rc = weight ? ag_module_add_tensor(m, "weight", true, ag_get_default_dtype(), 1, &dim,
                                           AG_INIT_ONES, 0, 0)
                    : 0;
    if (!rc && bias)
        rc = ag_module_add_tensor(m, "bias", true, ag_get_default_dtype(), 1, &dim, AG_INIT_ZEROS,
                                  0, 0);
    return done(m, rc);
}

ag_module *ag_nn_layernorm(int64_t dim, double eps, bool elementwise_affine) {
    return ag__nn_layernorm_ex(dim, eps, elementwise_affine, elementwise_affine);
}

/* ---- Embedding: weight (num, dim) ---- */

static ag_tensor *embedding_apply(ag_module *m, ag_tensor *idx) {
    return ag_embedding(ag_module_param(m, "weight"), idx);
}
NN_UNARY_FORWARD(embedding)

ag_module *ag__nn_embedding_normal(int64_t num, int64_t dim, double std) {
    if (num <= 0 || dim <= 0) {
        ag__err(AG_EINVAL,
                "Embedding: num_embeddings (%lld) and embedding_dim (%lld) must be "
                "positive",
                (long long)num, (long long)dim);
        return NULL;
    }
    ag_module *m = ag_module_new("Embedding", embedding_forward, NULL, NULL);
    if (!m)
        return NULL;
    return done(m, ag_module_add_tensor(m, "weight", true, ag_get_default_dtype(), 2,
                                        (int64_t[]){num, dim}, AG_INIT_NORMAL, 0.0, std));
}

ag_module *ag_nn_embedding(int64_t num, int64_t dim) {
    return ag__nn_embedding_normal(num, dim, 1.0);
}

/* ---- parameterless layers ---- */

typedef struct dropout_ud {
    double p;
} dropout_ud;

static ag_tensor *dropout_apply(ag_module *m, ag_tensor *x) {
    const dropout_ud *u = ag_module_ud(m);
    return ag_dropout(x, u->p, ag_module_is_training(m));
}
NN_UNARY_FORWARD(dropout)

ag_module *ag_nn_dropout(double p) {
    if (!(p >= 0 && p <= 1)) {
        ag__err(AG_EINVAL, "Dropout: dropout probability has to be between 0 and 1, but got %g", p);
        return NULL;
    }
    dropout_ud u = {p};
    return module_with("Dropout", dropout_forward, &u, sizeof u);
}

static ag_tensor *relu_apply(ag_module *m, ag_tensor *x) {
    (void)m;
    return ag_relu(x);
}
NN_UNARY_FORWARD(relu)

ag_module *ag_nn_relu(void) {
    return ag_module_new("ReLU", relu_forward, NULL, NULL);
}

typedef struct gelu_ud {
    char approximate[8]; /* "none" or "tanh" */
} gelu_ud;

static ag_tensor *gelu_apply(ag_module *m, ag_tensor *x) {
    const gelu_ud *u = ag_module_ud(m);
    return ag_gelu(x, u->approximate);
}
NN_UNARY_FORWARD(gelu)

ag_module *ag_nn_gelu(const char *approximate) {
    if (!approximate)
        approximate = "none";
    if (strcmp(approximate, "none") && strcmp(approximate, "tanh")) {
        ag__err(AG_EINVAL, "GELU: approximate must be 'none' or 'tanh', not '%s'", approximate);
        return NULL;
    }
    gelu_ud u = {{0}};
    strcpy(u.approximate, approximate);
    return module_with("GELU", gelu_forward, &u, sizeof u);
}

typedef struct pool_ud {
    int64_t kernel[2], stride[2], padding[2];
} pool_ud;

static ag_tensor *maxpool2d_apply(ag_module *m, ag_tensor *x) {
    const pool_ud *u = ag_module_ud(m);
    return ag_max_pool2d(x, u->kernel, u->stride, u->padding);
}
NN_UNARY_FORWARD(maxpool2d)

/* A pooling module's square window: stride <= 0 becomes the kernel size (PyTorch's None); 0,
 * or AG_EINVAL naming the module when the kernel is empty or the padding more than half of it. */
static int pool_window(const char *who, int64_t kernel, int64_t *stride, int64_t padding) {
    if (*stride <= 0)
        *stride = kernel;
    if (kernel <= 0 || padding < 0 || padding * 2 > kernel)
        return ag__err(AG_EINVAL,
                       "%s: bad arguments (kernel_size %lld, stride %lld, padding %lld): padding "
                       "should be at most half of the kernel size",
                       who, (long long)kernel, (long long)*stride, (long long)padding);
    return 0;
}

ag_module *ag_nn_maxpool2d(int64_t kernel, int64_t stride, int64_t padding) {
    if (pool_window("MaxPool2d", kernel, &stride, padding))
        return NULL;
    pool_ud u = {{kernel, kernel}, {stride, stride}, {padding, padding}};
    return module_with("MaxPool2d", maxpool2d_forward, &u, sizeof u);
}

typedef struct avgpool_ud {
    int64_t kernel[2], stride[2], padding[2], divisor_override;
    bool ceil_mode, count_include_pad;
} avgpool_ud;

static ag_tensor *avgpool2d_apply(ag_module *m, ag_tensor *x) {
    const avgpool_ud *u = ag_module_ud(m);
    const bool ceil = u->ceil_mode, cip = u->count_include_pad;
    return ag_avg_pool2d_ex(x, u->kernel, u->stride, u->padding, ceil, cip, u->divisor_override);
}
NN_UNARY_FORWARD(avgpool2d)

ag_module *ag_nn_avgpool2d(int64_t kernel, int64_t stride, int64_t padding, bool ceil_mode,
                           bool count_include_pad, int64_t divisor_override) {
    if (pool_window("AvgPool2d", kernel, &stride, padding))
        return NULL;
    avgpool_ud u = {{kernel, kernel}, {stride, stride}, {padding, padding},
                    divisor_override, ceil_mode,        count_include_pad};
    return module_with("AvgPool2d", avgpool2d_forward, &u, sizeof u);
}

typedef struct adaptive_ud {
    int64_t output_size[2]; /* negative: None, the input's size */
} adaptive_ud;

static ag_tensor *adaptive_avgpool2d_apply(ag_module *m, ag_tensor *x) {
    const adaptive_ud *u = ag_module_ud(m);
    if (x->ndim != 3 && x->ndim != 4) {
        char b[128];
        ag__err(AG_EINVAL, "AdaptiveAvgPool2d: expected a 3-d or 4-d input, got %s",
                ag_tensor_meta_str(x, b, sizeof b));
        return NULL;
    }
    int64_t o[2];
    for (int d = 0; d < 2; d++)
        o[d] = u->output_size[d] < 0 ? x->sizes[x->ndim - 2 + d] : u->output_size[d];
    return ag_adaptive_avg_pool2d(x, o);
}
NN_UNARY_FORWARD(adaptive_avgpool2d)

ag_module *ag_nn_adaptive_avgpool2d(int64_t out_h, int64_t out_w) {
    adaptive_ud u = {{out_h, out_w}};
    return module_with("AdaptiveAvgPool2d", adaptive_avgpool2d_forward, &u, sizeof u);
}

typedef struct flatten_ud {
    int start, end;
} flatten_ud;

/* Dims start..end of x merged into one, as torch.flatten (a reshape). */
static ag_tensor *flatten_apply(ag_module *m, ag_tensor *x) {
    const flatten_ud *u = ag_module_ud(m);
    if (x->ndim == 0)
        return ag_reshape(x, 1, (int64_t[]){1});
    int s = ag__wrap_dim("Flatten", u->start, x->ndim);
    int e = ag__wrap_dim("Flatten", u->end, x->ndim);
    if (s < 0 || e < 0)
        return NULL;
    if (s > e) {
        ag__err(AG_EINVAL, "Flatten: start_dim (%d) cannot come after end_dim (%d)", u->start,
                u->end);
        return NULL;
    }
    if (s == e)
        return x;
    int64_t sizes[AG_MAX_DIMS];
    int n = 0;
    for (int d = 0; d < s; d++)
        sizes[n++] = x->sizes[d];
    int64_t merged = 1;
    for (int d = s; d <= e; d++)
        merged *= x->sizes[d];
    sizes[n++] = merged;
    for (int d = e + 1; d < x->ndim; d++)
        sizes[n++] = x->sizes[d];
    return ag_reshape(x, n, sizes);
}
NN_UNARY_FORWARD(flatten)

ag_module *ag_nn_flatten(int start_dim, int end_dim) {
    flatten_ud u = {start_dim, end_dim};
    return module_with("Flatten", flatten_forward, &u, sizeof u);
}

/* ---- containers ---- */

/* Chains the children: the first gets every input, each next one the previous outputs. An
 * empty Sequential returns its inputs, as PyTorch's does. */
static int sequential_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out,
                              int max_out) {
    ag_tensor *bufs[2][AG_MAX_OUTPUTS];
    ag_tensor *const *cur = in;
    int ncur = nin;
    ag_scope_begin();
    for (int i = 0; i < ag_module_num_children(m); i++) {
        ag_tensor **next = bufs[i & 1];
        int n = ag_module_call(ag_module_child_at(m, i, NULL), cur, ncur, next, AG_MAX_OUTPUTS);
        if (n < 0) {
            ag_scope_end();
            return n;
        }
        cur = next;
        ncur = n;
    }
    if (ncur > max_out) {
        ag_scope_end();
        return ag__err(AG_EINVAL, "Sequential: the last module returned %d outputs, room for %d",
                       ncur, max_out);
    }
    for (int i = 0; i < ncur; i++)
        out[i] = ag_tensor_keep(cur[i]);
    ag_scope_end();
    return ncur;
}

ag_module *ag_nn_sequential(void) {
    return ag_module_new("Sequential", sequential_forward, NULL, NULL);
}

ag_module *ag_nn_module_list(void) {
    return ag_module_new("ModuleList", NULL, NULL, NULL);
}

/* Appends child under the next index ("0", "1", ...); takes ownership even on failure. */
int ag_nn_append(ag_module *seq, ag_module *child) {
    if (!seq) {
        ag_module_free(child);
        return ag__err(AG_EINVAL, "nn_append: seq is NULL");
    }
    if (!child) /* a failed constructor's message stays: ag_nn_append(seq, ag_nn_linear(...)) */
        return ag__has_error() && ag_last_status() < 0
                   ? ag_last_status()
                   : ag__err(AG_EINVAL, "nn_append: child is NULL");
    char name[24];
    snprintf(name, sizeof name, "%d", ag_module_num_children(seq));
    return ag_module_add_child(seq, name, child);
}

/* ---- losses ---- */

typedef struct ce_ud {
    int reduction;
    int64_t ignore_index;
    double label_smoothing;
} ce_ud;

/* The class weights are the buffer "weight" (as PyTorch's _WeightedLoss registers them), so
 * they are in the state dict and follow ag_module_to_dtype. */
static int cross_entropy_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out,
                                 int max_out) {
    int rc = ag_module_check_io(m, nin, 2, 2, max_out, 1);
    if (rc)
        return rc;
    const ce_ud *u = ag_module_ud(m);
    ag_tensor *w = ag_module_buffer(m, "weight");
    const double ls = u->label_smoothing;
    ag_scope_begin();
    ag_tensor *y = ag_cross_entropy_loss(in[0], in[1], w, u->reduction, u->ignore_index, ls);
    return ag_module_return1(y, out);
}

ag_module *ag_nn_cross_entropy_loss_ex(ag_tensor *weight, int reduction, int64_t ignore_index,
                                       double label_smoothing) {
    if (reduction != AG_REDUCTION_NONE && reduction != AG_REDUCTION_MEAN &&
        reduction != AG_REDUCTION_SUM) {
        ag__err(AG_EINVAL, "CrossEntropyLoss: reduction %d is not none (0), mean (1) or sum (2)",
                reduction);
        return NULL;
    }
    if (!(label_smoothing >= 0 && label_smoothing <= 1)) {
        ag__err(AG_EINVAL, "CrossEntropyLoss: label_smoothing must be in [0, 1], got %g",
                label_smoothing);
        return NULL;
    }
    if (weight && (weight->ndim != 1 || !ag_dtype_is_float(weight->dtype))) {
        char b[128];
        ag__err(AG_EINVAL,
                "CrossEntropyLoss: weight must be a 1-D float tensor of C classes, got %s",
                ag_tensor_meta_str(weight, b, sizeof b));
        return NULL;
    }
    ce_ud u = {reduction, ignore_index, label_smoothing};
    ag_module *m = module_with("CrossEntropyLoss", cross_entropy_forward, &u, sizeof u);
    if (!m || !weight)
        return m;
    return done(m, ag_module_register_buffer(m, "weight", weight, true));
}

ag_module *ag_nn_cross_entropy_loss(int reduction, int64_t ignore_index) {
    return ag_nn_cross_entropy_loss_ex(NULL, reduction, ignore_index, 0.0);
}
