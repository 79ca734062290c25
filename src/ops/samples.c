/* Gradcheck sample calls declared by ops (ag_opdef.samples), like PyTorch's OpInfo sample
 * inputs. The gradcheck table test and `aotgrad ops` read them through ag__samples_collect. */
#include "../core/internal.h"
#include "samples.h"

#include <stdio.h>

struct ag_samples {
    ag__sample *items;
    int64_t n, cap;
    uint64_t state; /* xorshift stream for deterministic sample values */
    bool failed;
};

static double next_unit(ag_samples *s) {
    s->state ^= s->state << 13;
    s->state ^= s->state >> 7;
    s->state ^= s->state << 17;
    return (double)(s->state >> 11) * 0x1.0p-53;
}

static ag_tensor *rand_tensor(ag_samples *s, int ndim, const int64_t *sizes, double lo, double hi,
                              bool rg) {
    ag_tensor *t = ag__tensor_new(AG_F64, ndim, sizes, false);
    if (!t) {
        s->failed = true;
        return NULL;
    }
    double *d = (double *)t->storage->data;
    int64_t n = ag__numel(ndim, sizes);
    for (int64_t i = 0; i < n; i++)
        d[i] = lo + (hi - lo) * next_unit(s);
    t->requires_grad = rg;
    return t;
}

ag_tensor *ag_samples_rand(ag_samples *s, int ndim, const int64_t *sizes, double lo, double hi) {
    AG__CHECK_NULL_RET("samples_rand", s, NULL);
    return rand_tensor(s, ndim, sizes, lo, hi, true);
}

ag_tensor *ag_samples_rand_nograd(ag_samples *s, int ndim, const int64_t *sizes, double lo,
                                  double hi) {
    AG__CHECK_NULL_RET("samples_rand_nograd", s, NULL);
    return rand_tensor(s, ndim, sizes, lo, hi, false);
}

ag_tensor *ag_samples_rand_strided(ag_samples *s, int ndim, const int64_t *sizes, double lo,
                                   double hi) {
    AG__CHECK_NULL_RET("samples_rand_strided", s, NULL);
    if (ndim < 2)
        return ag_samples_rand(s, ndim, sizes, lo, hi);
    int64_t sw[AG_MAX_DIMS];
    memcpy(sw, sizes, sizeof(int64_t) * (size_t)ndim);
    sw[ndim - 1] = sizes[ndim - 2];
    sw[ndim - 2] = sizes[ndim - 1];
    ag_tensor *base = rand_tensor(s, ndim, sw, lo, hi, false);
    if (!base)
        return NULL;
    ag_tmeta m;
    ag__tmeta_of(base, &m);
    m.sizes[ndim - 1] = sizes[ndim - 1];
    m.sizes[ndim - 2] = sizes[ndim - 2];
    m.strides[ndim - 1] = base->strides[ndim - 2];
    m.strides[ndim - 2] = base->strides[ndim - 1];
    ag_tensor *v = ag__tensor_alias(base, &m);
    ag_tensor_free(base);
    if (!v) {
        s->failed = true;
        return NULL;
    }
    v->requires_grad = true;
    return v;
}

void ag_samples_add(ag_samples *s, const char *note, const ag_arg *args, int nargs) {
    AG__CHECK_NULL_RET("samples_add", s, );
    bool bad = s->failed || nargs > AG_MAX_ARGS;
    for (int i = 0; i < nargs && !bad; i++)
        if (args[i].kind == AG_ARG_TENSOR && !args[i].u.t)
            bad = true;
    if (bad || ag__grow((void **)&s->items, &s->cap, s->n + 1, sizeof *s->items)) {
        s->failed = true;
        for (int i = 0; i < nargs; i++) {
            if (args[i].kind == AG_ARG_TENSOR)
                ag_tensor_free(args[i].u.t);
            if (args[i].kind == AG_ARG_TENSORS)
                for (int k = 0; k < args[i].n; k++)
                    ag_tensor_free(args[i].u.ts[k]);
        }
        return;
    }
    ag__sample *c = &s->items[s->n++];
    memset(c, 0, sizeof *c);
    snprintf(c->note, sizeof c->note, "%s", note ? note : "");
    c->nargs = nargs;
    for (int i = 0; i < nargs; i++) {
        c->args[i] = args[i];
        if (args[i].kind == AG_ARG_TENSORS) {
            int n = args[i].n < AG__SAMPLE_MAX_LIST ? args[i].n : AG__SAMPLE_MAX_LIST;
            for (int k = 0; k < n; k++)
                c->lists[i][k] = args[i].u.ts[k];
            c->args[i].u.ts = c->lists[i];
            c->args[i].n = n;
        } else if (args[i].kind == AG_ARG_INTS) {
            int n = args[i].n < AG__SAMPLE_MAX_LIST ? args[i].n : AG__SAMPLE_MAX_LIST;
            memcpy(c->ints[i], args[i].u.ints, sizeof(int64_t) * (size_t)n);
            c->args[i].u.ints = c->ints[i];
            c->args[i].n = n;
        } else if (args[i].kind == AG_ARG_STR) {
            snprintf(c->strs[i], sizeof c->strs[i], "%s", args[i].u.s);
            c->args[i].u.s = c->strs[i];
        }
    }
}

int ag__samples_collect(const ag_op *op, ag__sample **items, int *n) {
    *items = NULL;
    *n = 0;
    if (!op->def->samples)
        return 0;
    ag_samples s = {.state =
                        0x9E3779B97F4A7C15ull ^ (uint64_t)(op->index + 1) * 0x2545F4914F6CDD1Dull};
    /* Sample tensors are made outside any scope: the cases own them. */
    bool prev = ag_set_grad_enabled(false);
    op->def->samples(&s);
    ag_set_grad_enabled(prev);
    if (s.failed) {
        ag__samples_free(s.items, (int)s.n);
        return ag__err(AG_ENOMEM, "%s: could not build gradcheck samples", op->name);
    }
    *items = s.items;
    *n = (int)s.n;
    return 0;
}

void ag__samples_free(ag__sample *items, int n) {
    for (int c = 0; c < n; c++)
        for (int i = 0; i < items[c].nargs; i++) {
            if (items[c].args[i].kind == AG_ARG_TENSOR)
                ag_tensor_free(items[c].args[i].u.t);
            else if (items[c].args[i].kind == AG_ARG_TENSORS)
                for (int k = 0; k < items[c].args[i].n; k++)
                    ag_tensor_free(items[c].args[i].u.ts[k]);
        }
    ag__free(items);
}
