/* Optimizers: SGD (momentum, weight decay, Nesterov) and AdamW, with torch.optim's update
 * formulas (single-tensor, CPU, non-capturable code paths).
 *
 * An optimizer holds a reference to each parameter of a module (deduplicated, in
 * named_parameters order) and its per-parameter state (momentum buffer; AdamW's exp_avg,
 * exp_avg_sq and step count), allocated on the parameter's first step. ag_optim_step is the
 * hot path of training: one fused pass over the raw data of all parameters (each element of
 * p, grad and state read and written once) in one OpenMP region, written outside autograd
 * (like torch.no_grad), bumping each parameter's version so stale saved tensors are caught.
 * After the first step it allocates nothing (unless a gradient arrives non-contiguous or in
 * another dtype, which needs a converted copy). */
#include "nn_internal.h"

#include <math.h>
#include <omp.h>

enum { OPT_SGD, OPT_ADAMW };

/* Steps with more elements than this (all parameters together) use all OpenMP threads. */
#define OPT_PAR_MIN 32768

/* The AdamW loop vectorizes only when the build passes -fno-math-errno: with errno semantics
 * every sqrt is a call behind a branch (GCC 12 ignores the flag as a function attribute or
 * pragma). */
#define SQRT(x) _Generic((x), float : sqrtf, default : sqrt)(x)

typedef struct opt_param {
    ag_tensor *p;
    /* A tensor subclass parameter is updated through its plain inner tensors, one entry each:
     * p is inner tensor `inner` of the flattened `outer`, whose gradient (an instance of the
     * same type) gives the matching inner gradient. NULL for plain parameters. */
    ag_tensor *outer;
    int inner;
    ag_tensor *s1, *s2; /* SGD: momentum_buffer; AdamW: exp_avg, exp_avg_sq */
    int64_t step;
    ag_tensor *g; /* this step's gradient, borrowed or a converted copy (gtmp) */
    bool gtmp;
} opt_param;

struct ag_optim {
    int kind;
    double lr, momentum, weight_decay, beta1, beta2, eps;
    bool nesterov;
    int n;
    opt_param *ps;
};

/* An optimizer over n tensors (names[i] names tensor i in messages; NULL: "#i"), each taken once
 * (a tensor listed twice, GPT-2's tied weight, is updated once). */
static ag_optim *optim_new_list(ag_tensor *const *ts, const char *const *names, int n, int kind,
                                const char *who) {
    int total = 0;
    for (int i = 0; i < n; i++) {
        if (!ts[i]) {
            ag__err(AG_EINVAL, "%s: parameter %d is NULL", who, i);
            return NULL;
        }
        int nf = ag_subclass_flatten_tensors(&ts[i], 1, NULL, 0);
        if (nf > 64) {
            if (names)
                ag__err(AG_ENOTSUP, "%s: parameter %s is made of %d plain tensors (at most 64)",
                        who, names[i], nf);
            else
                ag__err(AG_ENOTSUP, "%s: parameter %d is made of %d plain tensors (at most 64)",
                        who, i, nf);
            return NULL;
        }
        total += nf;
    }
    ag_optim *o = ag__calloc(1, sizeof *o);
    opt_param *ps = o ? ag__calloc(total ? (size_t)total : 1, sizeof *ps) : NULL;
    if (!ps) {
        ag__free(o);
        return NULL;
    }
    o->kind = kind;
    o->ps = ps;
    int k = 0;
    for (int i = 0; i < n; i++) {
        bool seen = false;
        for (int j = 0; j < i && !seen; j++)
            seen = ts[j] == ts[i];
        if (seen)
            continue;
        ag_tensor *flat[64];
        int nf = ag_subclass_flatten_tensors(&ts[i], 1, flat, 64);
        for (int f = 0; f < nf; f++, k++) {
            ps[k].p = flat[f];
            ag__tensor_retain(ps[k].p);
            if (ag_tensor_subclass(ts[i])) {
                ps[k].outer = ag_tensor_keep(ts[i]);
                ps[k].inner = f;
            }
        }
    }
    o->n = k;
    return o;
}

static ag_optim *optim_new(ag_module *m, int kind, const char *who) {
    ag_named_tensors nt;
    if (!m) {
        ag__err(AG_EINVAL, "%s: NULL module", who);
        return NULL;
    }
    if (ag_module_named_parameters(m, true, &nt))
        return NULL;
    ag_optim *o = optim_new_list(nt.tensors, (const char *const *)nt.names, nt.n, kind, who);
    ag_named_tensors_free(&nt);
    return o;
}

ag_optim *ag_optim_sgd(ag_module *m, double lr, double momentum, double weight_decay,
                       bool nesterov) {
    AG__CHECK_NULL_RET("optim_sgd", m, NULL);
    if (!(lr >= 0)) {
        ag__err(AG_EINVAL, "SGD: invalid learning rate: %g", lr);
        return NULL;
    }
    if (!(momentum >= 0)) {
        ag__err(AG_EINVAL, "SGD: invalid momentum value: %g", momentum);
        return NULL;
    }
    if (!(weight_decay >= 0)) {
        ag__err(AG_EINVAL, "SGD: invalid weight_decay value: %g", weight_decay);
        return NULL;
    }
    if (nesterov && momentum <= 0) {
        ag__err(AG_EINVAL, "SGD: Nesterov momentum requires a momentum and zero dampening");
        return NULL;
    }
    ag_optim *o = optim_new(m, OPT_SGD, "SGD");
    if (o) {
        o->lr = lr;
        o->momentum = momentum;
        o->weight_decay = weight_decay;
        o->nesterov = nesterov;
    }
    return o;
}

/* The hyperparameters' checks, torch.optim.AdamW's messages. */
static int adamw_check(double lr, double beta1, double beta2, double eps, double weight_decay) {
    if (!(lr >= 0))
        return ag__err(AG_EINVAL, "AdamW: invalid learning rate: %g", lr);
    if (!(eps >= 0))
        return ag__err(AG_EINVAL, "AdamW: invalid epsilon value: %g", eps);
    if (!(beta1 >= 0 && beta1 < 1) || !(beta2 >= 0 && beta2 < 1))
        return ag__err(AG_EINVAL,
                       "AdamW: invalid beta parameters: (%g, %g), each must be in [0, 1)", beta1,
                       beta2);
    if (!(weight_decay >= 0))
        return ag__err(AG_EINVAL, "AdamW: invalid weight_decay value: %g", weight_decay);
    return 0;
}

static ag_optim *adamw_set(ag_optim *o, double lr, double beta1, double beta2, double eps,
                           double weight_decay) {
    if (o) {
        o->lr = lr;
        o->beta1 = beta1;
        o->beta2 = beta2;
        o->eps = eps;
        o->weight_decay = weight_decay;
    }
    return o;
}

ag_optim *ag_optim_adamw(ag_module *m, double lr, double beta1, double beta2, double eps,
                         double weight_decay) {
    AG__CHECK_NULL_RET("optim_adamw", m, NULL);
    if (adamw_check(lr, beta1, beta2, eps, weight_decay))
        return NULL;
    return adamw_set(optim_new(m, OPT_ADAMW, "AdamW"), lr, beta1, beta2, eps, weight_decay);
}

ag_optim *ag_optim_adamw_tensors(ag_tensor *const *params, int n, double lr, double beta1,
                                 double beta2, double eps, double weight_decay) {
    if (n < 0 || (n > 0 && !params)) {
        ag__err(AG_EINVAL, "optim_adamw_tensors: %s (n = %d)",
                n < 0 ? "negative count" : "params is NULL", n);
        return NULL;
    }
    if (adamw_check(lr, beta1, beta2, eps, weight_decay))
        return NULL;
    return adamw_set(optim_new_list(params, NULL, n, OPT_ADAMW, "AdamW"), lr, beta1, beta2, eps,
                     weight_decay);
}

void ag_optim_free(ag_optim *o) {
    if (!o)
        return;
    for (int i = 0; i < o->n; i++) {
        ag_tensor_free(o->ps[i].p);
        ag_tensor_free(o->ps[i].outer);
        ag_tensor_free(o->ps[i].s1);
        ag_tensor_free(o->ps[i].s2);
    }
    ag__free(o->ps);
    ag__free(o);
}

void ag_optim_set_lr(ag_optim *o, double lr) {
    if (o)
        o->lr = lr;
}

void ag_optim_zero_grad(ag_optim *o) {
    if (!o)
        return;
    for (int i = 0; i < o->n; i++)
        ag_tensor_set_grad(o->ps[i].outer ? o->ps[i].outer : o->ps[i].p, NULL);
}

/* ---- the update loops ----
 * Each parameter is split into one contiguous span per thread; a span is a plain loop over
 * restrict pointers that the compiler vectorizes. Coefficients are computed in double (as
 * Python floats) and applied in the parameter's precision (as torch's CPU kernels do). */

typedef struct upd_coef {
    double lr, wd, mu, keep; /* SGD */
    bool nesterov;
    double decay, w1, b2, w2, eps, step_size, bc2_sqrt; /* AdamW */
} upd_coef;

/* SGD with dampening 0: d = g + wd p; b = keep b + d (keep is 0 on the first step, where
 * torch's buffer is a clone of d, else mu); p -= lr (nesterov ? d + mu b : b). */
#define SGD_SPAN(T)                                                                                \
    static void sgd_span_##T(const opt_param *q, const upd_coef *c, int64_t lo, int64_t hi) {      \
        T *restrict p = ag_tensor_data(q->p);                                                      \
        const T *restrict g = ag_tensor_data(q->g);                                                \
        const T lr = (T)c->lr, wd = (T)c->wd;                                                      \
        if (!q->s1) {                                                                              \
            for (int64_t i = lo; i < hi; i++)                                                      \
                p[i] = p[i] - lr * (g[i] + wd * p[i]);                                             \
            return;                                                                                \
        }                                                                                          \
        T *restrict buf = ag_tensor_data(q->s1);                                                   \
        const T keep = (T)c->keep, mu = (T)c->mu;                                                  \
        if (c->nesterov) {                                                                         \
            for (int64_t i = lo; i < hi; i++) {                                                    \
                T d = g[i] + wd * p[i];                                                            \
                T b = keep * buf[i] + d;                                                           \
                buf[i] = b;                                                                        \
                p[i] = p[i] - lr * (d + mu * b);                                                   \
            }                                                                                      \
        } else {                                                                                   \
            for (int64_t i = lo; i < hi; i++) {                                                    \
                T b = keep * buf[i] + (g[i] + wd * p[i]);                                          \
                buf[i] = b;                                                                        \
                p[i] = p[i] - lr * b;                                                              \
            }                                                                                      \
        }                                                                                          \
    }

/* torch.optim.adamw (_single_tensor_adam with decoupled weight decay):
 *   p *= 1 - lr wd;  m = lerp(m, g, 1 - b1);  v = b2 v + (1 - b2) g g;
 *   p -= (lr / bc1) m / (sqrt(v) / sqrt(bc2) + eps),  bc_i = 1 - b_i^step. */
#define ADAMW_SPAN(T)                                                                              \
    static void adamw_span_##T(const opt_param *q, const upd_coef *c, int64_t lo, int64_t hi) {    \
        T *restrict p = ag_tensor_data(q->p);                                                      \
        const T *restrict g = ag_tensor_data(q->g);                                                \
        T *restrict ea = ag_tensor_data(q->s1);                                                    \
        T *restrict es = ag_tensor_data(q->s2);                                                    \
        const T decay = (T)c->decay, w1 = (T)c->w1, b2 = (T)c->b2, w2 = (T)c->w2;                  \
        const T eps = (T)c->eps, step_size = (T)c->step_size, bc2_sqrt = (T)c->bc2_sqrt;           \
        for (int64_t i = lo; i < hi; i++) {                                                        \
            T gi = g[i];                                                                           \
            T m = ea[i] + w1 * (gi - ea[i]);                                                       \
            T v = b2 * es[i] + w2 * gi * gi;                                                       \
            ea[i] = m;                                                                             \
            es[i] = v;                                                                             \
            p[i] = p[i] * decay - step_size * (m / (SQRT(v) / bc2_sqrt + eps));                    \
        }                                                                                          \
    }

SGD_SPAN(float)
SGD_SPAN(double)
ADAMW_SPAN(float)
ADAMW_SPAN(double)

typedef void (*span_fn)(const opt_param *q, const upd_coef *c, int64_t lo, int64_t hi);

/* Elements [lo, hi) of parameter q. */
static void update_param(const ag_optim *o, const opt_param *q, int64_t lo, int64_t hi) {
    upd_coef c = {0};
    span_fn f;
    bool f32 = q->p->dtype == AG_F32;
    if (o->kind == OPT_SGD) {
        c.lr = o->lr;
        c.wd = o->weight_decay;
        c.mu = o->momentum;
        c.keep = q->step == 1 ? 0 : o->momentum;
        c.nesterov = o->nesterov;
        f = f32 ? sgd_span_float : sgd_span_double;
    } else {
        double bc1 = 1 - pow(o->beta1, (double)q->step);
        double bc2 = 1 - pow(o->beta2, (double)q->step);
        c.decay = 1 - o->lr * o->weight_decay;
        c.w1 = 1 - o->beta1;
        c.b2 = o->beta2;
        c.w2 = 1 - o->beta2;
        c.eps = o->eps;
        c.step_size = o->lr / bc1;
        c.bc2_sqrt = sqrt(bc2);
        f = f32 ? adamw_span_float : adamw_span_double;
    }
    f(q, &c, lo, hi);
}

/* Elements [lo, hi) of the concatenation of every parameter with a gradient this step, in
 * parameter order: one span per parameter the range touches. */
static void update_range(const ag_optim *o, int64_t lo, int64_t hi) {
    int64_t base = 0;
    for (int i = 0; i < o->n && base < hi; i++) {
        const opt_param *q = &o->ps[i];
        if (!q->g)
            continue;
        int64_t n = ag_tensor_numel(q->p);
        int64_t a = lo > base ? lo - base : 0, b = hi - base < n ? hi - base : n;
        if (a < b)
            update_param(o, q, a, b);
        base += n;
    }
}

/* One pass over all parameters: each element of p, g and the state is read and written once,
 * and the parameters' elements, taken together, are split evenly over the threads in one
 * parallel region (small parameters do not get a region each). The arithmetic is the span
 * functions' whatever the split, so results do not depend on the thread count. */
static void update_all(const ag_optim *o) {
    int64_t total = 0;
    for (int i = 0; i < o->n; i++)
        if (o->ps[i].g)
            total += ag_tensor_numel(o->ps[i].p);
    if (total <= OPT_PAR_MIN) {
        update_range(o, 0, total);
        return;
    }
#pragma omp parallel
    {
        int64_t t = omp_get_thread_num(), k = omp_get_num_threads();
        update_range(o, total * t / k, total * (t + 1) / k);
    }
}

static ag_tensor *zeros_like(const ag_tensor *p) {
    ag_tensor *t = ag__tensor_new(p->dtype, p->ndim, p->sizes, false);
    if (t)
        memset(ag_tensor_data(t), 0, (size_t)ag_tensor_numel(t) * ag_dtype_size(t->dtype));
    return t;
}

/* Everything that can fail happens here, before any parameter changes: checks, lazily
 * allocated state, converted gradients. */
static int prepare(ag_optim *o, const char *who) {
    for (int i = 0; i < o->n; i++) {
        opt_param *q = &o->ps[i];
        ag_tensor *p = q->p, *g = p->grad;
        q->g = NULL;
        q->gtmp = false;
        char b[128];
        if (q->outer && (g = q->outer->grad)) {
            ag_tensor *flat[64];
            const ag_subclass_type *want = ag_tensor_subclass(q->outer);
            if (ag_tensor_subclass(g) != want ||
                ag_subclass_flatten_tensors(&g, 1, flat, 64) !=
                    ag_subclass_flatten_tensors(&q->outer, 1, NULL, 0))
                return ag__err(AG_EINVAL,
                               "%s: parameter %d is a %s but its gradient is a %s of another "
                               "structure",
                               who, i, want->name,
                               ag_tensor_subclass(g) ? ag_tensor_subclass(g)->name
                                                     : "plain tensor");
            g = flat[q->inner];
        }
        if (!g)
            continue;
        if (!ag_dtype_is_float(p->dtype) || !ag_tensor_is_contiguous(p) || !p->storage->data)
            return ag__err(AG_EINVAL,
                           "%s: parameter %d (%s) must be a contiguous float32 or "
                           "float64 tensor with data",
                           who, i, ag_tensor_meta_str(p, b, sizeof b));
        if (g->ndim != p->ndim || memcmp(g->sizes, p->sizes, sizeof(int64_t) * (size_t)p->ndim))
            return ag__err(AG_EINVAL,
                           "%s: gradient of parameter %d has shape %s, the parameter "
                           "has %s",
                           who, i, ag_tensor_meta_str(g, b, sizeof b),
                           ag__fmt_sizes(b + 64, 64, p->ndim, p->sizes));
        if (!g->storage->data)
            return ag__err(AG_EINVAL, "%s: gradient of parameter %d has no data", who, i);
        if (g->dtype != p->dtype || !ag_tensor_is_contiguous(g)) {
            ag_tensor *c = ag__tensor_new(p->dtype, p->ndim, p->sizes, false);
            if (!c || ag__copy_into(c, g)) {
                ag_tensor_free(c);
                return ag__nn_status();
            }
            g = c;
            q->gtmp = true;
        }
        q->g = g;
        bool need1 = o->kind == OPT_ADAMW || o->momentum != 0;
        if (need1 && !q->s1 && !(q->s1 = zeros_like(p)))
            return AG_ENOMEM;
        if (o->kind == OPT_ADAMW && !q->s2 && !(q->s2 = zeros_like(p)))
            return AG_ENOMEM;
    }
    return 0;
}

static void release_tmp(ag_optim *o) {
    for (int i = 0; i < o->n; i++) {
        if (o->ps[i].gtmp)
            ag_tensor_free(o->ps[i].g);
        o->ps[i].g = NULL;
        o->ps[i].gtmp = false;
    }
}

int ag_optim_step(ag_optim *o) {
    AG__CHECK_NULL("optim_step", o);
    const char *who = o->kind == OPT_SGD ? "SGD" : "AdamW";
    int rc = prepare(o, who);
    if (rc) {
        release_tmp(o);
        return rc;
    }
    /* A parameter no gradient reached is skipped, as torch does. */
    for (int i = 0; i < o->n; i++)
        o->ps[i].step += o->ps[i].g != NULL;
    update_all(o);
    for (int i = 0; i < o->n; i++) {
        opt_param *q = &o->ps[i];
        if (!q->g)
            continue;
        ag_tensor_bump_version(q->p);
        if (q->outer)
            ag_tensor_bump_version(q->outer);
        if (q->s1)
            ag_tensor_bump_version(q->s1);
        if (q->s2)
            ag_tensor_bump_version(q->s2);
    }
    release_tmp(o);
    return 0;
}
