/* The zoo's `effects` model and its effectful custom op (include/aotgrad/zoo.h).
 *
 * In: x [4, 3]. Out: y [4, 2], computed as
 *     h = log_value(linear1(x), 'h')        linear1 = Linear(3, 4)
 *     y = log_value(linear2(relu(h)), 'y')  linear2 = Linear(4, 2)
 * where aotgrad_demo::log_value(Tensor x, str tag, bool grad=False) -> Tensor is a user op
 * flagged AG_OP_EFFECTFUL, registered on first use like any user's (ag_op_register): its kernel
 * returns a copy of x and appends a record of x (tag, element count, sum) to a process-wide log;
 * its backward logs the incoming gradient with the same op (grad=True) and passes it on. So
 * one training step logs, in program order: h, y (forward), then y's and h's gradients
 * (backward). Upstream's effectful custom ops (registered with _register_effectful_op) are
 * usually `-> ()`; this one returns its input so that autograd reaches its backward, where a
 * user's autograd.Function would call the logging op from its own backward instead.
 *
 * Exported, each call becomes with_effects on the forward's or the backward's effect token;
 * compiled, the effects run exactly once per call, in the same order and on the same values as
 * in eager mode, which the tests and `aotgrad check effects` compare through the log.
 *
 * Like zoo.c this file is written as user code: call sites are recorded (AG_RECORD_SITES). */
#define AG_RECORD_SITES
#include "../core/internal.h"
#include "zoo_effects.h"

#include <pthread.h>
#include <stdio.h>

/* ---- the log ---- */

static pthread_mutex_t log_lock = PTHREAD_MUTEX_INITIALIZER;
static ag_zoo_log_record *log_recs;
static int64_t log_n, log_cap;
static _Atomic bool log_echo;

__attribute__((destructor)) static void log_free(void) {
    ag__free(log_recs);
    log_recs = NULL;
    log_n = log_cap = 0;
}

int ag_zoo_log_count(void) {
    pthread_mutex_lock(&log_lock);
    int n = (int)log_n;
    pthread_mutex_unlock(&log_lock);
    return n;
}

int ag_zoo_log_get(int i, ag_zoo_log_record *out) {
    AG__CHECK_NULL("zoo_log_get", out);
    pthread_mutex_lock(&log_lock);
    int rc = 0;
    if (i < 0 || i >= log_n)
        rc = ag__err(AG_EINVAL, "zoo log: no record %d (the log has %lld)", i, (long long)log_n);
    else
        *out = log_recs[i];
    pthread_mutex_unlock(&log_lock);
    return rc;
}

void ag_zoo_log_clear(void) {
    pthread_mutex_lock(&log_lock);
    log_n = 0;
    pthread_mutex_unlock(&log_lock);
}

void ag_zoo_log_echo(bool on) {
    log_echo = on;
}

/* ---- the op ---- */

/* Output: x's dtype and sizes, contiguous. */
static int log_value_meta(const ag_arg *a, ag_tmeta *o) {
    const ag_tensor *x = a[0].u.t;
    if (!ag_dtype_is_float(x->dtype))
        return ag__err(AG_EINVAL, "aotgrad_demo::log_value: x must be f32 or f64, got %s",
                       ag_dtype_short(x->dtype));
    ag__tmeta_contiguous(&o[0], x->dtype, x->ndim, x->sizes);
    return 0;
}

/* The side effect: one record of x; then out = x. */
static int log_value_kernel(const ag_arg *a, ag_tensor **o) {
    const ag_tensor *x = a[0].u.t;
    ag_zoo_log_record r = {.grad = a[2].kind == AG_ARG_BOOL && a[2].u.b};
    snprintf(r.tag, sizeof r.tag, "%s", a[1].kind == AG_ARG_STR && a[1].u.s ? a[1].u.s : "");
    r.numel = ag_tensor_numel(x);
    for (int64_t i = 0; i < r.numel; i++)
        r.sum += ag__get_f64(x, i);
    pthread_mutex_lock(&log_lock);
    int rc = ag__grow((void **)&log_recs, &log_cap, log_n + 1, sizeof *log_recs);
    if (rc == 0)
        log_recs[log_n++] = r;
    pthread_mutex_unlock(&log_lock);
    if (rc)
        return rc;
    if (log_echo)
        fprintf(stderr, "aotgrad_demo::log_value: %s%s numel=%lld sum=%.17g\n", r.tag,
                r.grad ? " (grad)" : "", (long long)r.numel, r.sum);
    return ag__copy_into(o[0], x);
}

static const ag_op *log_op(void);

/* The gradient passes through, logged on its way (grad=True; a second-order gradient would
 * be logged with grad=False again). */
static int log_value_backward(ag_bwctx *c) {
    ag_tensor *g = c->grad_outputs[0];
    if (!c->needs_grad[0] || !g)
        return 0;
    bool grad = c->args[2].kind == AG_ARG_BOOL && c->args[2].u.b;
    c->grad_inputs[0] = ag_op_call1(log_op(), (ag_arg[]){AG_A_T(g), c->args[1], AG_A_B(!grad)}, 3);
    return c->grad_inputs[0] ? 0 : ag_last_status();
}

static void log_value_samples(ag_samples *s) {
    ag_samples_add(
        s, "3x2",
        (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, (int64_t[]){3, 2}, -1, 1)), AG_A_S("sample")}, 2);
}

static const ag_opdef log_value_def = {
    .schema = "aotgrad_demo::log_value(Tensor x, str tag, bool grad=False) -> Tensor",
    .flags = AG_OP_EFFECTFUL,
    .meta = log_value_meta,
    .kernel = log_value_kernel,
    .dtypes = AG_DT_FLOAT,
    .backward = log_value_backward,
    .samples = log_value_samples,
};

/* Found or registered under a lock: threads building the model at once would otherwise both
 * register it, and one would fail with "already exists". */
static const ag_op *log_op(void) {
    static const ag_op *_Atomic cached;
    static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
    const ag_op *op = atomic_load_explicit(&cached, memory_order_acquire);
    if (op)
        return op;
    pthread_mutex_lock(&lock);
    op = ag_op_find("aotgrad_demo::log_value");
    if (!op)
        op = ag_op_register(&log_value_def);
    if (op)
        atomic_store_explicit(&cached, op, memory_order_release);
    pthread_mutex_unlock(&lock);
    return op;
}

const ag_op *ag_zoo_log_value_op(void) {
    return log_op();
}

/* ---- the model ---- */

static ag_tensor *log_value_call(ag_tensor *x, const char *tag) {
    const ag_op *op = log_op();
    return op ? ag_op_call1(op, (ag_arg[]){AG_A_T(x), AG_A_S(tag)}, 2) : NULL;
}
/* As an op entry point of ops.h: the call site is recorded for stack traces. */
#define log_value(x, tag) (ag_site(__FILE__, __LINE__, __func__), log_value_call((x), (tag)))

static int effects_fwd(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    if (nin != 1 || max_out < 1)
        return ag__err(AG_EINVAL, "%s: takes 1 input and returns 1 output", ag_module_type(m));
    ag_scope_begin();
    ag_tensor *h = log_value(ag_module_forward(ag_module_child(m, "linear1"), in[0]), "h");
    ag_tensor *y = ag_module_forward(ag_module_child(m, "linear2"), ag_relu(h));
    y = log_value(y, "y");
    int rc = y ? 1 : (ag_last_status() < 0 ? ag_last_status() : AG_EINVAL);
    if (y)
        out[0] = ag_tensor_keep(y);
    ag_scope_end();
    return rc;
}

ag_module *ag__zoo_build_effects(int *rc) {
    ag_module *m = ag_module_new("EffectsModel", effects_fwd, NULL, NULL);
    *rc = m && log_op() ? 0 : (ag_last_status() < 0 ? ag_last_status() : AG_ENOMEM);
    if (!*rc)
        *rc = ag_module_add_child(m, "linear1", ag_nn_linear(3, 4, true));
    if (!*rc)
        *rc = ag_module_add_child(m, "linear2", ag_nn_linear(4, 2, true));
    return m;
}

int ag__zoo_effects_inputs(const char *config, ag_tensor **in) {
    (void)config;
    in[0] = ag_randn(AG_F32, 2, (int64_t[]){4, 3});
    return 1;
}
