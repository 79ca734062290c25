/* Optimizers: SGD (momentum, weight decay, Nesterov) and AdamW, with torch.optim's update
 * formulas (single-tensor, CPU, non-capturable code paths).
 *
 * An optimizer holds parameter groups (torch.optim's param_groups: a group's own lr, weight
 * decay, momentum or betas) and a reference to each parameter (deduplicated, in group then
 * list order; a module's in named_parameters order, one group) and its per-parameter state
 * (momentum buffer; AdamW's exp_avg, exp_avg_sq and step count), allocated on the parameter's first
 * step. ag_optim_step is the hot path of training: one fused pass over the raw data of all
 * parameters (each element of p, grad and state read and written once) in one OpenMP region,
 * written outside autograd (like torch.no_grad), bumping each parameter's version so stale saved
 * tensors are caught. After the first step it allocates nothing (unless a gradient arrives
 * non-contiguous or in another dtype, which needs a converted copy).
 *
 * Also here: clipping gradients by their global norm (clip_grad_norm_), learning-rate
 * schedules (warmup + cosine, a pure function of the iteration) and the optimizer's state
 * saved to and restored from a safetensors file (safetensors.c) for resuming. */
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
    int group;
    char *name;         /* "<fqn>" or "<fqn>.<inner>" (owned), for messages and state files */
    ag_tensor *s1, *s2; /* SGD: momentum_buffer; AdamW: exp_avg, exp_avg_sq */
    int64_t step;
    ag_tensor *g; /* this step's gradient, borrowed or a converted copy (gtmp) */
    bool gtmp;
} opt_param;

/* A parameter group's hyperparameters. */
typedef struct opt_group {
    double lr, momentum, weight_decay, beta1, beta2, eps;
} opt_group;

struct ag_optim {
    int kind;
    bool nesterov;
    int ngroups;
    opt_group *groups;
    int n;
    opt_param *ps;
};

/* Group g's parameter names: the given name, or "<i>". */
static char *param_name(const ag_param_group *gr, int i, int inner, int nf) {
    char num[32], *s;
    const char *base = gr->names && gr->names[i] ? gr->names[i] : num;
    snprintf(num, sizeof num, "%d", i);
    size_t n = strlen(base) + 16;
    if ((s = ag__malloc(n)))
        snprintf(s, n, nf > 1 || inner ? "%s.%d" : "%s", base, inner);
    return s;
}

/* An optimizer over the groups' tensors, each taken once (a tensor listed twice, GPT-2's tied
 * weight, is updated once, by its first group). Hyperparameters are set by the caller. */
static ag_optim *optim_new_groups(const ag_param_group *grs, int ngroups, int kind,
                                  const char *who) {
    int total = 0;
    if (ngroups < 0 || (ngroups > 0 && !grs)) {
        ag__err(AG_EINVAL, "%s: %s (ngroups = %d)", who,
                ngroups < 0 ? "negative group count" : "groups is NULL", ngroups);
        return NULL;
    }
    for (int g = 0; g < ngroups; g++) {
        if (grs[g].n < 0 || (grs[g].n > 0 && !grs[g].params)) {
            ag__err(AG_EINVAL, "%s: group %d: %s (n = %d)", who, g,
                    grs[g].n < 0 ? "negative count" : "params is NULL", grs[g].n);
            return NULL;
        }
        for (int i = 0; i < grs[g].n; i++) {
            ag_tensor *const *t = &grs[g].params[i];
            if (!*t) {
                if (ngroups > 1)
                    ag__err(AG_EINVAL, "%s: group %d: parameter %d is NULL", who, g, i);
                else
                    ag__err(AG_EINVAL, "%s: parameter %d is NULL", who, i);
                return NULL;
            }
            int nf = ag_subclass_flatten_tensors(t, 1, NULL, 0);
            if (nf > 64) {
                if (grs[g].names)
                    ag__err(AG_ENOTSUP, "%s: parameter %s is made of %d plain tensors (at most 64)",
                            who, grs[g].names[i], nf);
                else
                    ag__err(AG_ENOTSUP, "%s: parameter %d is made of %d plain tensors (at most 64)",
                            who, i, nf);
                return NULL;
            }
            total += nf;
        }
    }
    ag_optim *o = ag__calloc(1, sizeof *o);
    opt_param *ps = o ? ag__calloc(total ? (size_t)total : 1, sizeof *ps) : NULL;
    opt_group *gs = ps ? ag__calloc(ngroups ? (size_t)ngroups : 1, sizeof *gs) : NULL;
    if (!gs) {
        ag__free(ps);
        ag__free(o);
        return NULL;
    }
    o->kind = kind;
    o->ps = ps;
    o->groups = gs;
    o->ngroups = ngroups;
    int k = 0;
    bool oom = false;
    for (int g = 0; g < ngroups; g++) {
        for (int i = 0; i < grs[g].n; i++) {
            ag_tensor *t = grs[g].params[i];
            bool seen = false;
            for (int h = 0; h <= g && !seen; h++)
                for (int j = 0; j < (h < g ? grs[h].n : i) && !seen; j++)
                    seen = grs[h].params[j] == t;
            if (seen)
                continue;
            ag_tensor *flat[64];
            int nf = ag_subclass_flatten_tensors(&t, 1, flat, 64);
            for (int f = 0; f < nf; f++, k++) {
                ps[k].p = flat[f];
                ag__tensor_retain(ps[k].p);
                ps[k].group = g;
                oom |= !(ps[k].name = param_name(&grs[g], i, f, nf));
                if (ag_tensor_subclass(t)) {
                    ps[k].outer = ag_tensor_keep(t);
                    ps[k].inner = f;
                }
            }
        }
    }
    o->n = k;
    if (oom) {
        ag_optim_free(o);
        return NULL;
    }
    return o;
}

static ag_optim *optim_new_list(ag_tensor *const *ts, const char *const *names, int n, int kind,
                                const char *who) {
    ag_param_group gr = {.params = ts, .names = names, .n = n};
    return optim_new_groups(&gr, 1, kind, who);
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

static int sgd_check(double lr, double momentum, double weight_decay, bool nesterov) {
    if (!(lr >= 0))
        return ag__err(AG_EINVAL, "SGD: invalid learning rate: %g", lr);
    if (!(momentum >= 0))
        return ag__err(AG_EINVAL, "SGD: invalid momentum value: %g", momentum);
    if (!(weight_decay >= 0))
        return ag__err(AG_EINVAL, "SGD: invalid weight_decay value: %g", weight_decay);
    if (nesterov && momentum <= 0)
        return ag__err(AG_EINVAL, "SGD: Nesterov momentum requires a momentum and zero dampening");
    return 0;
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

/* Each group's hyperparameters: the defaults d, overridden by the group's set fields; checked
 * with the optimizer's rules. grs NULL: every group takes d. */
static int groups_resolve(const ag_param_group *grs, int ngroups, const opt_group *d, int kind,
                          bool nesterov, opt_group *out) {
    for (int g = 0; g < ngroups; g++) {
        opt_group v = *d;
        unsigned set = grs ? grs[g].set : 0;
        if (set & AG_GROUP_LR)
            v.lr = grs[g].lr;
        if (set & AG_GROUP_WEIGHT_DECAY)
            v.weight_decay = grs[g].weight_decay;
        if (set & AG_GROUP_MOMENTUM)
            v.momentum = grs[g].momentum;
        if (set & AG_GROUP_BETAS) {
            v.beta1 = grs[g].beta1;
            v.beta2 = grs[g].beta2;
        }
        if (set & AG_GROUP_EPS)
            v.eps = grs[g].eps;
        int rc = kind == OPT_SGD ? sgd_check(v.lr, v.momentum, v.weight_decay, nesterov)
                                 : adamw_check(v.lr, v.beta1, v.beta2, v.eps, v.weight_decay);
        if (rc)
            return rc;
        out[g] = v;
    }
    return 0;
}

/* Sets the hyperparameters of o's groups (grs NULL: o has one group, which takes d); frees o
 * and returns NULL when one is invalid. */
static ag_optim *optim_finish(ag_optim *o, const ag_param_group *grs, const opt_group *d,
                              bool nesterov) {
    if (!o)
        return NULL;
    o->nesterov = nesterov;
    if (groups_resolve(grs, o->ngroups, d, o->kind, nesterov, o->groups)) {
        ag_optim_free(o);
        return NULL;
    }
    return o;
}

ag_optim *ag_optim_sgd(ag_module *m, double lr, double momentum, double weight_decay,
                       bool nesterov) {
    AG__CHECK_NULL_RET("optim_sgd", m, NULL);
    if (sgd_check(lr, momentum, weight_decay, nesterov))
        return NULL;
    opt_group d = {.lr = lr, .momentum = momentum, .weight_decay = weight_decay};
    return optim_finish(optim_new(m, OPT_SGD, "SGD"), NULL, &d, nesterov);
}

ag_optim *ag_optim_sgd_groups(const ag_param_group *groups, int ngroups, double lr, double momentum,
                              double weight_decay, bool nesterov) {
    opt_group d = {.lr = lr, .momentum = momentum, .weight_decay = weight_decay};
    opt_group *tmp = ag__calloc(ngroups > 0 ? (size_t)ngroups : 1, sizeof *tmp);
    if (!tmp)
        return NULL;
    int rc = ngroups >= 0 && groups ? groups_resolve(groups, ngroups, &d, OPT_SGD, nesterov, tmp)
                                    : sgd_check(lr, momentum, weight_decay, nesterov);
    ag__free(tmp);
    if (rc)
        return NULL;
    return optim_finish(optim_new_groups(groups, ngroups, OPT_SGD, "SGD"), groups, &d, nesterov);
}

ag_optim *ag_optim_adamw(ag_module *m, double lr, double beta1, double beta2, double eps,
                         double weight_decay) {
    AG__CHECK_NULL_RET("optim_adamw", m, NULL);
    if (adamw_check(lr, beta1, beta2, eps, weight_decay))
        return NULL;
    opt_group d = {
        .lr = lr, .beta1 = beta1, .beta2 = beta2, .eps = eps, .weight_decay = weight_decay};
    return optim_finish(optim_new(m, OPT_ADAMW, "AdamW"), NULL, &d, false);
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
    opt_group d = {
        .lr = lr, .beta1 = beta1, .beta2 = beta2, .eps = eps, .weight_decay = weight_decay};
    return optim_finish(optim_new_list(params, NULL, n, OPT_ADAMW, "AdamW"), NULL, &d, false);
}

ag_optim *ag_optim_adamw_groups(const ag_param_group *groups, int ngroups, double lr, double beta1,
                                double beta2, double eps, double weight_decay) {
    opt_group d = {
        .lr = lr, .beta1 = beta1, .beta2 = beta2, .eps = eps, .weight_decay = weight_decay};
    opt_group *tmp = ag__calloc(ngroups > 0 ? (size_t)ngroups : 1, sizeof *tmp);
    if (!tmp)
        return NULL;
    int rc = ngroups >= 0 && groups ? groups_resolve(groups, ngroups, &d, OPT_ADAMW, false, tmp)
                                    : adamw_check(lr, beta1, beta2, eps, weight_decay);
    ag__free(tmp);
    if (rc)
        return NULL;
    return optim_finish(optim_new_groups(groups, ngroups, OPT_ADAMW, "AdamW"), groups, &d, false);
}

int ag_module_decay_split(const ag_module *m, ag_named_tensors *decay, ag_named_tensors *no_decay) {
    AG__CHECK_NULL("module_decay_split", decay);
    AG__CHECK_NULL("module_decay_split", no_decay);
    memset(decay, 0, sizeof *decay);
    memset(no_decay, 0, sizeof *no_decay);
    AG__CHECK_NULL("module_decay_split", m);
    ag_named_tensors all;
    int rc = ag_module_named_parameters(m, true, &all);
    if (rc)
        return rc;
    ag_named_tensors *out[2] = {decay, no_decay};
    for (int k = 0; k < 2 && !rc; k++) {
        out[k]->names = ag__calloc(all.n ? (size_t)all.n : 1, sizeof(char *));
        out[k]->tensors = ag__calloc(all.n ? (size_t)all.n : 1, sizeof(ag_tensor *));
        if (!out[k]->names || !out[k]->tensors)
            rc = AG_ENOMEM;
    }
    for (int i = 0; i < all.n && !rc; i++) {
        ag_named_tensors *o = out[ag_tensor_ndim(all.tensors[i]) >= 2 ? 0 : 1];
        o->tensors[o->n] = all.tensors[i];
        if (!(o->names[o->n] = ag__strdup(all.names[i])))
            rc = AG_ENOMEM;
        else
            o->n++;
    }
    ag_named_tensors_free(&all);
    if (rc) {
        ag_named_tensors_free(decay);
        ag_named_tensors_free(no_decay);
    }
    return rc;
}

void ag_optim_free(ag_optim *o) {
    if (!o)
        return;
    for (int i = 0; i < o->n; i++) {
        ag_tensor_free(o->ps[i].p);
        ag_tensor_free(o->ps[i].outer);
        ag_tensor_free(o->ps[i].s1);
        ag_tensor_free(o->ps[i].s2);
        ag__free(o->ps[i].name);
    }
    ag__free(o->ps);
    ag__free(o->groups);
    ag__free(o);
}

void ag_optim_set_lr(ag_optim *o, double lr) {
    for (int g = 0; o && g < o->ngroups; g++)
        o->groups[g].lr = lr;
}

int ag_optim_num_groups(const ag_optim *o) {
    return o ? o->ngroups : 0;
}

double ag_optim_group_lr(const ag_optim *o, int g) {
    return o && g >= 0 && g < o->ngroups ? o->groups[g].lr : NAN;
}

int ag_optim_set_group_lr(ag_optim *o, int g, double lr) {
    AG__CHECK_NULL("optim_set_group_lr", o);
    if (g < 0 || g >= o->ngroups)
        return ag__err(AG_EINVAL, "optim_set_group_lr: group %d of %d", g, o->ngroups);
    if (!(lr >= 0))
        return ag__err(AG_EINVAL, "optim_set_group_lr: invalid learning rate: %g", lr);
    o->groups[g].lr = lr;
    return 0;
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
    const opt_group *gr = &o->groups[q->group];
    if (o->kind == OPT_SGD) {
        c.lr = gr->lr;
        c.wd = gr->weight_decay;
        c.mu = gr->momentum;
        c.keep = q->step == 1 ? 0 : gr->momentum;
        c.nesterov = o->nesterov;
        f = f32 ? sgd_span_float : sgd_span_double;
    } else {
        double bc1 = 1 - pow(gr->beta1, (double)q->step);
        double bc2 = 1 - pow(gr->beta2, (double)q->step);
        c.decay = 1 - gr->lr * gr->weight_decay;
        c.w1 = 1 - gr->beta1;
        c.b2 = gr->beta2;
        c.w2 = 1 - gr->beta2;
        c.eps = gr->eps;
        c.step_size = gr->lr / bc1;
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
        /* State made before the module was converted (ag_module_to_dtype) has the old dtype:
         * updating through it would read and write past its end. */
        for (int k = 0; k < 2; k++) {
            const ag_tensor *st = k ? q->s2 : q->s1;
            if (st && st->dtype != p->dtype)
                return ag__err(AG_EINVAL,
                               "%s: parameter %d is %s but its optimizer state is %s (the "
                               "module was converted after the optimizer's first step); make "
                               "the optimizer after converting, as in PyTorch",
                               who, i, ag_dtype_name(p->dtype), ag_dtype_name(st->dtype));
        }
        bool need1 = o->kind == OPT_ADAMW || o->groups[q->group].momentum != 0;
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

/* ---- clipping by the global norm ---- */

/* Sum of squares of g's elements, in double. */
static double grad_sumsq(const ag_tensor *g) {
    int64_t n = ag_tensor_numel(g);
    double s = 0;
    if (g->dtype == AG_F32) {
        const float *d = ag_tensor_data(g);
        for (int64_t i = 0; i < n; i++)
            s += (double)d[i] * (double)d[i];
    } else {
        const double *d = ag_tensor_data(g);
        for (int64_t i = 0; i < n; i++)
            s += d[i] * d[i];
    }
    return s;
}

static void grad_scale(ag_tensor *g, double coef) {
    int64_t n = ag_tensor_numel(g);
    if (g->dtype == AG_F32) {
        float *d = ag_tensor_data(g), c = (float)coef;
        for (int64_t i = 0; i < n; i++)
            d[i] *= c;
    } else {
        double *d = ag_tensor_data(g);
        for (int64_t i = 0; i < n; i++)
            d[i] *= coef;
    }
}

int ag_clip_grad_norm(ag_tensor *const *params, int n, double max_norm, double *total_norm) {
    if (n < 0 || (n > 0 && !params))
        return ag__err(AG_EINVAL, "clip_grad_norm: %s (n = %d)",
                       n < 0 ? "negative count" : "params is NULL", n);
    if (!(max_norm >= 0))
        return ag__err(AG_EINVAL, "clip_grad_norm: max_norm must be >= 0, got %g", max_norm);
    /* Checks and contiguous copies first, so that a failure changes no gradient. */
    ag_tensor **work = ag__calloc(n ? (size_t)n : 1, sizeof *work);
    if (!work)
        return AG_ENOMEM;
    int rc = 0;
    for (int i = 0; i < n && !rc; i++) {
        char b[128];
        if (!params[i]) {
            rc = ag__err(AG_EINVAL, "clip_grad_norm: parameter %d is NULL", i);
            break;
        }
        ag_tensor *g = params[i]->grad;
        if (!g)
            continue;
        if (ag_tensor_subclass(g) || !ag_dtype_is_float(g->dtype) || !g->storage->data)
            rc = ag__err(AG_EINVAL,
                         "clip_grad_norm: the gradient of parameter %d (%s) must be a float32 "
                         "or float64 tensor with data",
                         i,
                         ag_tensor_subclass(g) ? ag_tensor_subclass(g)->name
                                               : ag_tensor_meta_str(g, b, sizeof b));
        else if (ag_tensor_is_contiguous(g))
            work[i] = g;
        else if (!(work[i] = ag__tensor_new(g->dtype, g->ndim, g->sizes, false)) ||
                 (rc = ag__copy_into(work[i], g)))
            rc = rc ? rc : AG_ENOMEM;
    }
    double total = 0;
    /* A tensor listed twice counts once (its gradient is one tensor). */
    for (int i = 0; i < n && !rc; i++) {
        bool seen = false;
        for (int j = 0; j < i && !seen; j++)
            seen = params[j] == params[i];
        if (work[i] && !seen)
            total += grad_sumsq(work[i]);
    }
    total = sqrt(total);
    /* upstream: grads *= clamp(max_norm / (total + 1e-6), max=1); NaN stays NaN. */
    double coef = max_norm / (total + 1e-6);
    for (int i = 0; i < n && !rc && !(coef >= 1); i++) {
        bool seen = false;
        for (int j = 0; j < i && !seen; j++)
            seen = params[j] == params[i];
        if (!work[i] || seen)
            continue;
        grad_scale(work[i], coef);
        if (work[i] != params[i]->grad)
            ag__copy_into(params[i]->grad, work[i]);
        ag_tensor_bump_version(params[i]->grad);
    }
    for (int i = 0; i < n; i++)
        if (work[i] && work[i] != params[i]->grad)
            ag_tensor_free(work[i]);
    ag__free(work);
    if (!rc && total_norm)
        *total_norm = total;
    return rc;
}

int ag_optim_clip_grad_norm(ag_optim *o, double max_norm, double *total_norm) {
    AG__CHECK_NULL("optim_clip_grad_norm", o);
    ag_tensor **ts = ag__calloc(o->n ? (size_t)o->n : 1, sizeof *ts);
    if (!ts)
        return AG_ENOMEM;
    int n = 0;
    for (int i = 0; i < o->n; i++) {
        ag_tensor *t = o->ps[i].outer ? o->ps[i].outer : o->ps[i].p;
        if (!n || ts[n - 1] != t) /* a subclass's inner tensors are consecutive */
            ts[n++] = t;
    }
    int rc = ag_clip_grad_norm(ts, n, max_norm, total_norm);
    ag__free(ts);
    return rc;
}

/* ---- learning-rate schedules ---- */

double ag_lr_at(const ag_lr_schedule *s, int64_t it) {
    if (!s || it < 0)
        return NAN;
    if (s->kind == AG_LR_CONSTANT)
        return s->lr;
    if (s->kind != AG_LR_WARMUP_COSINE || s->warmup_iters < 0 || s->decay_iters < s->warmup_iters)
        return NAN;
    if (it < s->warmup_iters)
        return s->lr * (double)(it + 1) / (double)s->warmup_iters;
    if (it > s->decay_iters)
        return s->min_lr;
    int64_t span = s->decay_iters - s->warmup_iters;
    double r = span ? (double)(it - s->warmup_iters) / (double)span : 0.0;
    double coeff = 0.5 * (1.0 + cos(M_PI * r));
    return s->min_lr + coeff * (s->lr - s->min_lr);
}

/* ---- state save/load ---- */

enum { KEY_STEP, KEY_S1, KEY_S2 };

static char *state_key(const ag_optim *o, const opt_param *q, int which) {
    static const char *const sgd[] = {"step", "momentum_buffer", ""};
    static const char *const adamw[] = {"step", "exp_avg", "exp_avg_sq"};
    const char *suffix = (o->kind == OPT_SGD ? sgd : adamw)[which];
    size_t n = strlen(q->name) + strlen(suffix) + 32;
    char *s = ag__malloc(n);
    if (s)
        snprintf(s, n, "g%d.%s.%s", q->group, q->name, suffix);
    return s;
}

static char *group_key(int g) {
    char *s = ag__malloc(32);
    if (s)
        snprintf(s, 32, "g%d.lr", g);
    return s;
}

static const char *optim_kind_name(const ag_optim *o) {
    return o->kind == OPT_SGD ? "SGD" : "AdamW";
}

int ag_optim_save(const ag_optim *o, const char *path) {
    AG__CHECK_NULL("optim_save", o);
    AG__CHECK_NULL("optim_save", path);
    int cap = o->ngroups + 3 * o->n, n = 0, rc = 0;
    char **names = ag__calloc(cap ? (size_t)cap : 1, sizeof *names);
    ag_tensor **ts = ag__calloc(cap ? (size_t)cap : 1, sizeof *ts);
    if (!names || !ts)
        rc = AG_ENOMEM;
    for (int g = 0; g < o->ngroups && !rc; g++, n++) {
        names[n] = group_key(g);
        ts[n] = ag__tensor_new(AG_F64, 0, NULL, false);
        if (!names[n] || !ts[n])
            rc = AG_ENOMEM;
        else
            *(double *)ag_tensor_data(ts[n]) = o->groups[g].lr;
    }
    for (int i = 0; i < o->n && !rc; i++) {
        const opt_param *q = &o->ps[i];
        if (!q->step)
            continue;
        names[n] = state_key(o, q, KEY_STEP);
        ts[n] = ag__tensor_new(AG_I64, 0, NULL, false);
        if (!names[n] || !ts[n]) {
            rc = AG_ENOMEM;
            n++;
            break;
        }
        *(int64_t *)ag_tensor_data(ts[n++]) = q->step;
        for (int k = 0; k < 2 && !rc; k++) {
            ag_tensor *s = k ? q->s2 : q->s1;
            if (!s)
                continue;
            if (!(names[n] = state_key(o, q, k ? KEY_S2 : KEY_S1)))
                rc = AG_ENOMEM;
            else
                ts[n++] = ag_tensor_keep(s);
        }
    }
    const char *meta[] = {"optimizer", optim_kind_name(o), "format", "aotgrad.optim", NULL};
    if (!rc)
        rc = ag_safetensors_save(path, (const char *const *)names, ts, n, meta);
    for (int i = 0; i < cap && names && ts; i++) {
        ag__free(names[i]);
        ag_tensor_free(ts[i]);
    }
    ag__free(names);
    ag__free(ts);
    return rc;
}

/* The tensor named key in d, checked against dtype and shape (shape NULL: a scalar); counts a
 * match in *used. NULL when absent (no error) or, with *rc set, when it does not fit. */
static ag_tensor *state_get(const ag_tensor_dict *d, const char *path, const char *key, ag_dtype dt,
                            const ag_tensor *like, int *used, int *rc) {
    ag_tensor *t = ag_tensor_dict_get(d, key);
    if (!t)
        return NULL;
    (*used)++;
    int nd = like ? like->ndim : 0;
    const int64_t *sz = like ? like->sizes : NULL;
    if (t->dtype != dt || t->ndim != nd ||
        (nd && memcmp(t->sizes, sz, sizeof(int64_t) * (size_t)nd))) {
        char a[128], b[128];
        ag_tensor_meta_str(t, a, sizeof a);
        snprintf(b, sizeof b, "%s", ag_dtype_short(dt));
        ag__fmt_sizes(b + strlen(b), sizeof b - strlen(b), nd, sz);
        *rc = ag__err(AG_EINVAL, "optim_load: '%s' in '%s' is %s; this optimizer's is %s", key,
                      path, a, b);
        return NULL;
    }
    return t;
}

int ag_optim_load(ag_optim *o, const char *path) {
    AG__CHECK_NULL("optim_load", o);
    AG__CHECK_NULL("optim_load", path);
    ag_tensor_dict d;
    int rc = ag_safetensors_load(path, &d);
    if (rc)
        return rc;
    const char *kind = ag_tensor_dict_meta(&d, "optimizer");
    if (!kind || strcmp(kind, optim_kind_name(o)))
        rc = ag__err(AG_EINVAL, "optim_load: '%s' holds the state of %s%s, not of %s", path,
                     kind ? "" : "no optimizer", kind ? kind : "", optim_kind_name(o));
    /* Everything is matched and checked before the optimizer changes. */
    double *lrs = ag__calloc(o->ngroups ? (size_t)o->ngroups : 1, sizeof *lrs);
    int64_t *steps = ag__calloc(o->n ? (size_t)o->n : 1, sizeof *steps);
    ag_tensor **s = ag__calloc(2 * (size_t)(o->n ? o->n : 1), sizeof *s);
    if (!rc && (!lrs || !steps || !s))
        rc = AG_ENOMEM;
    int used = 0;
    for (int g = 0; g < o->ngroups && !rc; g++) {
        char *key = group_key(g);
        ag_tensor *t = key ? state_get(&d, path, key, AG_F64, NULL, &used, &rc) : NULL;
        if (!key)
            rc = AG_ENOMEM;
        else if (!t && !rc)
            rc = ag__err(AG_EINVAL, "optim_load: '%s' has no '%s' (this optimizer has %d groups)",
                         path, key, o->ngroups);
        else if (t)
            lrs[g] = *(double *)ag_tensor_data(t);
        ag__free(key);
    }
    for (int i = 0; i < o->n && !rc; i++) {
        const opt_param *q = &o->ps[i];
        char *key = state_key(o, q, KEY_STEP);
        ag_tensor *t = key ? state_get(&d, path, key, AG_I64, NULL, &used, &rc) : NULL;
        if (!key)
            rc = AG_ENOMEM;
        if (t && (steps[i] = *(int64_t *)ag_tensor_data(t)) <= 0)
            rc = ag__err(AG_EINVAL, "optim_load: '%s' in '%s' is %lld; a step count is positive",
                         key, path, (long long)steps[i]);
        bool need[2] = {o->kind == OPT_ADAMW || o->groups[q->group].momentum != 0,
                        o->kind == OPT_ADAMW};
        for (int k = 0; k < 2 && t && !rc; k++) {
            if (!need[k])
                continue;
            char *sk = state_key(o, q, k ? KEY_S2 : KEY_S1);
            ag_tensor *st = sk ? state_get(&d, path, sk, q->p->dtype, q->p, &used, &rc) : NULL;
            if (!sk)
                rc = AG_ENOMEM;
            else if (!st && !rc)
                rc = ag__err(AG_EINVAL, "optim_load: '%s' has '%s' but no '%s'", path, key, sk);
            s[2 * i + k] = st;
            ag__free(sk);
        }
        ag__free(key);
    }
    if (!rc && used != d.n) {
        /* A name this optimizer does not have: another model, other groups, another kind. */
        for (int i = 0; i < d.n && !rc; i++) {
            bool known = false;
            for (int g = 0; g < o->ngroups && !known; g++) {
                char *key = group_key(g);
                known = key && !strcmp(key, d.names[i]);
                ag__free(key);
            }
            for (int p = 0; p < o->n && !known; p++)
                for (int k = KEY_STEP; k <= KEY_S2 && !known; k++) {
                    char *key = state_key(o, &o->ps[p], k);
                    known = key && !strcmp(key, d.names[i]);
                    ag__free(key);
                }
            if (!known)
                rc = ag__err(AG_EINVAL,
                             "optim_load: '%s' holds '%s', which this optimizer does not have",
                             path, d.names[i]);
        }
        if (!rc)
            rc = ag__err(AG_EINVAL, "optim_load: '%s' does not match this optimizer", path);
    }
    if (!rc) {
        for (int g = 0; g < o->ngroups; g++)
            o->groups[g].lr = lrs[g];
        for (int i = 0; i < o->n; i++) {
            opt_param *q = &o->ps[i];
            ag_tensor_free(q->s1);
            ag_tensor_free(q->s2);
            q->s1 = s[2 * i] ? ag_tensor_keep(s[2 * i]) : NULL;
            q->s2 = s[2 * i + 1] ? ag_tensor_keep(s[2 * i + 1]) : NULL;
            q->step = steps[i];
        }
    }
    ag__free(lrs);
    ag__free(steps);
    ag__free(s);
    ag_tensor_dict_free(&d);
    return rc;
}
