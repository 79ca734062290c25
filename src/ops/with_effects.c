/* with_effects: the op that threads an effectful op's call through an effect token (upstream's
 * with_effects higher-order op; include/aotgrad/optable.h, "effects").
 *
 * In: an op flagged AG_OP_EFFECTFUL. Out: an op named `with_effects` whose schema is the
 * wrapped op's, with two leading arguments, and which returns a list:
 *     aotgrad_demo::log_value(Tensor x, str tag, bool grad=False) -> Tensor
 *     with_effects(Tensor token, str op, Tensor x, str tag, bool grad=False) -> Tensor[]
 *         returns (new_token f32[0], the op's output)
 * Because it is an ordinary op of its own (schema, meta, kernel), every stage reads it without
 * a special case: the dispatcher checks its arguments, meta inference and the verifier infer
 * its vals, the interpreter and the executor run its kernel (which calls the wrapped op's
 * kernel), the printer writes it as any call. Its flags (effectful, nondiff) are what DCE, CSE
 * and the partitioners read. The `op` argument names the wrapped op, so the parser can pick the
 * with_effects op of a text line, and every argument check (ag__op_check_args) confirms the
 * name matches the op the with_effects op was made for, so a meta function or kernel never runs
 * on arguments laid out for another op.
 *
 * The wrappers are made on first use and kept for the process (freed at exit); they are not
 * in the registry, because all of them share the name `with_effects`. The list is guarded by
 * a lock, so threads may ask for wrappers (and call with_effects ops) at once; a wrapper never
 * moves or changes once listed. */
#include "../core/internal.h"

#include <pthread.h>
#include <stdio.h>

typedef struct wrapper {
    const ag_op *target; /* the effectful op */
    ag_op *op;           /* its with_effects op */
    ag_opdef def;
    char *schema;
} wrapper;

static wrapper **wrappers;
static int64_t nwrappers, wrappers_cap;
static pthread_mutex_t wrappers_lock = PTHREAD_MUTEX_INITIALIZER;

__attribute__((destructor)) static void wrappers_free(void) {
    for (int64_t i = 0; i < nwrappers; i++) {
        ag__op_free_detached(wrappers[i]->op);
        ag__free(wrappers[i]->schema);
        ag__free(wrappers[i]);
    }
    ag__free(wrappers);
    wrappers = NULL;
    nwrappers = wrappers_cap = 0;
}

static const wrapper *by_op(const ag_op *op) {
    const wrapper *found = NULL;
    pthread_mutex_lock(&wrappers_lock);
    for (int64_t i = 0; i < nwrappers && !found; i++)
        if (wrappers[i]->op == op)
            found = wrappers[i];
    pthread_mutex_unlock(&wrappers_lock);
    return found;
}

/* The wrapper of `target`, or NULL; the caller holds wrappers_lock. */
static const wrapper *by_target_locked(const ag_op *target) {
    for (int64_t i = 0; i < nwrappers; i++)
        if (wrappers[i]->target == target)
            return wrappers[i];
    return NULL;
}

/* The wrapped op named by a with_effects call's `op` argument (only ops that have a wrapper:
 * a valid call was checked against its wrapper's target). */
static const ag_op *target_named(const ag_arg *a) {
    if (a->kind != AG_ARG_STR || !a->u.s)
        return NULL;
    const ag_op *found = NULL;
    pthread_mutex_lock(&wrappers_lock);
    for (int64_t i = 0; i < nwrappers && !found; i++)
        if (!strcmp(ag_op_name(wrappers[i]->target), a->u.s))
            found = wrappers[i]->target;
    pthread_mutex_unlock(&wrappers_lock);
    return found;
}

/* args: token, op name, then the wrapped op's arguments. outs[0] is the new token (f32[0]),
 * outs[1..] the wrapped op's outputs. */
static int with_effects_meta(const ag_arg *a, ag_tmeta *outs) {
    const ag_op *w = target_named(&a[1]);
    if (!w)
        return ag__err(AG_EINVAL, "with_effects: '%s' is not an op with a with_effects wrapper",
                       a[1].kind == AG_ARG_STR && a[1].u.s ? a[1].u.s : "None");
    if (ag_tensor_numel(a[0].u.t) != 0) {
        char b[128];
        return ag__err(AG_EINVAL, "with_effects(%s): the token must be an empty tensor, got %s",
                       ag_op_name(w), ag_tensor_meta_str(a[0].u.t, b, sizeof b));
    }
    ag__tmeta_contiguous(&outs[0], AG_F32, 1, (const int64_t[]){0});
    int rc = ag_op_def(w)->meta(a + 2, outs + 1);
    if (rc < 0)
        return rc;
    int n = ag_op_noutputs(w) < 0 ? rc : ag_op_noutputs(w);
    if (n + 1 > AG_MAX_OUTPUTS)
        return ag__err(AG_EINVAL, "with_effects(%s): %d outputs (at most %d)", ag_op_name(w), n,
                       AG_MAX_OUTPUTS - 1);
    return n + 1;
}

/* Runs the wrapped op's kernel on its own arguments and outputs; the token output has no
 * elements to write. The dtype check is the dispatcher's, made for the wrapped op (the
 * dispatcher and the executor checked the token's). */
static int with_effects_kernel(const ag_arg *a, ag_tensor **outs) {
    const ag_op *w = target_named(&a[1]);
    if (!w)
        return ag__err(AG_EINVAL, "with_effects: no wrapped op");
    bool have = false;
    ag_dtype kdt = AG_F32;
    for (int i = 0; i < ag_op_nargs(w) && !have; i++) {
        const ag_arg *x = &a[2 + i];
        if (x->kind == AG_ARG_TENSOR && x->u.t) {
            kdt = x->u.t->dtype;
            have = true;
        }
        for (int k = 0; x->kind == AG_ARG_TENSORS && k < x->n && !have; k++)
            if (x->u.ts[k]) {
                kdt = x->u.ts[k]->dtype;
                have = true;
            }
    }
    if (!have && outs[1])
        kdt = outs[1]->dtype;
    if (!(ag_op_def(w)->dtypes & (1u << kdt)))
        return ag__err(AG_ENOTSUP, "%s: no kernel for dtype %s", ag_op_name(w),
                       ag_dtype_short(kdt));
    return ag_op_def(w)->kernel(a + 2, outs + 1);
}

int ag__with_effects_check(const ag_op *op, const ag_arg *full) {
    const wrapper *wr = by_op(op);
    if (!wr)
        return 0;
    if (full[1].kind != AG_ARG_STR || !full[1].u.s || strcmp(full[1].u.s, ag_op_name(wr->target)))
        return ag__err(AG_EINVAL,
                       "with_effects: argument 'op' is %s%s%s, but this with_effects "
                       "op wraps '%s'",
                       full[1].kind == AG_ARG_STR && full[1].u.s ? "'" : "",
                       full[1].kind == AG_ARG_STR && full[1].u.s ? full[1].u.s : "None",
                       full[1].kind == AG_ARG_STR && full[1].u.s ? "'" : "",
                       ag_op_name(wr->target));
    return 0;
}

const ag_op *ag_op_with_effects_target(const ag_op *op) {
    const wrapper *wr = op ? by_op(op) : NULL;
    return wr ? wr->target : NULL;
}

/* The text between the schema's first '(' and its matching ')': the argument list. */
static int arg_list(const char *schema, const char **b, size_t *n) {
    const char *open = strchr(schema, '(');
    if (!open)
        return -1;
    int depth = 0;
    for (const char *p = open; *p; p++) {
        depth += *p == '(' ? 1 : *p == ')' ? -1 : 0;
        if (depth == 0) {
            *b = open + 1;
            *n = (size_t)(p - open - 1);
            return 0;
        }
    }
    return -1;
}

const ag_op *ag_op_with_effects(const ag_op *op) {
    if (!op)
        return ag__err(AG_EINVAL, "op_with_effects: op is NULL"), NULL;
    pthread_mutex_lock(&wrappers_lock);
    const wrapper *have = by_target_locked(op);
    pthread_mutex_unlock(&wrappers_lock);
    if (have)
        return have->op;
    const ag_opdef *d = ag_op_def(op);
    const char *name = ag_op_name(op);
    const char *why = NULL;
    if (!(d->flags & AG_OP_EFFECTFUL))
        why = "it is not effectful (AG_OP_EFFECTFUL)";
    else if (by_op(op))
        why = "it is a with_effects op itself";
    else if (d->flags & (AG_OP_VIEW | AG_OP_INPLACE | AG_OP_COMPOSITE) || !d->kernel)
        why = "views, in-place and composite ops cannot be wrapped";
    else if (ag_op_nargs(op) + 2 > AG_MAX_ARGS)
        why = "it has too many arguments";
    else if (ag_op_noutputs(op) + 1 > AG_MAX_OUTPUTS)
        why = "it has too many outputs";
    for (int i = 0; !why && i < ag_op_nargs(op); i++) {
        if (op->mutates[i])
            why = "it mutates an argument";
        else if (!strcmp(ag_op_arg(op, i)->name, "token") || !strcmp(ag_op_arg(op, i)->name, "op"))
            why = "it has an argument named 'token' or 'op'";
    }
    const char *args = NULL;
    size_t nargs = 0;
    if (!why && arg_list(d->schema, &args, &nargs))
        why = "its schema has no argument list";
    if (why)
        return ag__err(AG_EINVAL, "with_effects: cannot wrap %s: %s", name, why), NULL;

    /* Made outside the lock; listed under it, unless another thread listed one first. */
    wrapper *wr = ag__calloc(1, sizeof *wr);
    size_t cap = nargs + 64;
    if (!wr || !(wr->schema = ag__malloc(cap))) {
        ag__free(wr);
        return NULL;
    }
    snprintf(wr->schema, cap, "with_effects(Tensor token, str op%s%.*s) -> Tensor[]",
             ag_op_nargs(op) ? ", " : "", (int)nargs, args);
    wr->target = op;
    wr->def = (ag_opdef){
        .schema = wr->schema,
        .flags = AG_OP_EFFECTFUL | AG_OP_NONDIFF,
        .meta = with_effects_meta,
        .kernel = with_effects_kernel,
        .dtypes = AG_DT_ALL,
    };
    if (!(wr->op = ag__op_new_detached(&wr->def))) {
        ag__free(wr->schema);
        ag__free(wr);
        return NULL;
    }
    pthread_mutex_lock(&wrappers_lock);
    const wrapper *first = by_target_locked(op);
    int rc =
        first ? 0 : ag__grow((void **)&wrappers, &wrappers_cap, nwrappers + 1, sizeof *wrappers);
    if (!first && !rc)
        wrappers[nwrappers++] = wr;
    pthread_mutex_unlock(&wrappers_lock);
    if (first || rc) {
        ag__op_free_detached(wr->op);
        ag__free(wr->schema);
        ag__free(wr);
        return first ? first->op : NULL;
    }
    return wr->op;
}
