/* The op registry and the dispatcher.
 *
 * In: op definitions (ag_opdef) from the family files (pointwise.c, reduce.c, ...) and from
 * users (ag_op_register). Out: registered ops with parsed schemas, and ag_op_call, which runs
 * one op call: argument checks against the schema, defaults, the meta function, output
 * allocation (or aliasing for views and in-place ops), the kernel, version bumps of mutated
 * arguments, the autograd record, and the tracer hook. Every later stage (tracing, export,
 * partitioning, the executor) reaches ops only through this table. */
#include "copy_slices.h"
#include "../core/internal.h"
#include "../dist/pending.h"
#include "family.h"

#include <ctype.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

/* The thread's tracer hook (src/trace/trace.c): per thread, so that one thread's trace never
 * sees another thread's op calls. */
_Thread_local ag__trace_hook_fn ag__trace_hook;
_Thread_local ag__region_hook_fn ag__region_hook;

/* ---- registry ----
 * Built-in ops are registered once, by the first call that needs the table (pthread_once, so
 * threads making their first calls at once all wait for the whole table). User ops are added
 * under reg_lock, and every read of the table takes it too: an append may move the array. An
 * op itself never moves or changes once registered, so the pointers handed out stay valid
 * without the lock. */

static ag_op **ops;
static int64_t nops, ops_cap;
static pthread_once_t builtins_once = PTHREAD_ONCE_INIT;
static pthread_mutex_t reg_lock = PTHREAD_MUTEX_INITIALIZER;

static const ag_opdef *const *const families[] = {
    ag__ops_pointwise, ag__ops_views,         ag__ops_reduce, ag__ops_linalg,
    ag__ops_conv,      ag__ops_norm,          ag__ops_nn,     ag__ops_index,
    ag__ops_factory,   ag__ops_inplace_views, ag__ops_philox, ag__ops_collectives,
};

/* ---- schema parsing ---- */

typedef struct {
    const char *s;
    const char *start;
    char err[160];
} parser;

static void skip_ws(parser *p) {
    while (*p->s == ' ')
        p->s++;
}

static bool lit(parser *p, const char *t) {
    skip_ws(p);
    size_t n = strlen(t);
    if (strncmp(p->s, t, n) == 0) {
        p->s += n;
        return true;
    }
    return false;
}

static int parse_type(parser *p, ag_type *ty, bool *mutates) {
    skip_ws(p);
    const char *b = p->s;
    while (isalnum((unsigned char)*p->s) || *p->s == '_')
        p->s++;
    size_t n = (size_t)(p->s - b);
    char base[32];
    if (n == 0 || n >= sizeof base) {
        snprintf(p->err, sizeof p->err, "expected a type at column %d", (int)(b - p->start));
        return -1;
    }
    memcpy(base, b, n);
    base[n] = 0;
    *mutates = false;
    if (*p->s == '(') { /* alias annotation: (a), (a!) */
        const char *close = strchr(p->s, ')');
        if (!close) {
            snprintf(p->err, sizeof p->err, "unclosed alias annotation");
            return -1;
        }
        *mutates = memchr(p->s, '!', (size_t)(close - p->s)) != NULL;
        p->s = close + 1;
    }
    bool list = false, opt = false;
    if (*p->s == '[') {
        const char *close = strchr(p->s, ']');
        if (!close) {
            snprintf(p->err, sizeof p->err, "unclosed list type");
            return -1;
        }
        list = true;
        p->s = close + 1;
    }
    if (*p->s == '?') {
        opt = true;
        p->s++;
    }
    /* Tensor?[] is a list of optional tensors. */
    if (!list && opt && *p->s == '[') {
        p->s = strchr(p->s, ']') + 1;
        list = true;
    }
    if (!strcmp(base, "Tensor"))
        *ty = list ? (opt ? AG_TY_OPT_TENSOR_LIST : AG_TY_TENSOR_LIST)
                   : (opt ? AG_TY_OPT_TENSOR : AG_TY_TENSOR);
    else if (!strcmp(base, "int") || !strcmp(base, "SymInt"))
        *ty =
            list ? (opt ? AG_TY_OPT_INT_LIST : AG_TY_INT_LIST) : (opt ? AG_TY_OPT_INT : AG_TY_INT);
    else if (!strcmp(base, "float"))
        *ty = opt ? AG_TY_OPT_FLOAT : AG_TY_FLOAT;
    else if (!strcmp(base, "Scalar"))
        *ty = opt ? AG_TY_OPT_FLOAT : AG_TY_SCALAR;
    else if (!strcmp(base, "bool") && list)
        *ty = AG_TY_INT_LIST; /* bool[3] output masks are passed as int lists of 0/1 */
    else if (!strcmp(base, "bool"))
        *ty = opt ? AG_TY_OPT_BOOL : AG_TY_BOOL;
    else if (!strcmp(base, "ScalarType"))
        *ty = opt ? AG_TY_OPT_DTYPE : AG_TY_DTYPE;
    else if (!strcmp(base, "str"))
        *ty = AG_TY_STR;
    else if (!strcmp(base, "Any") && !list && !opt)
        *ty = AG_TY_ANY;
    else {
        snprintf(p->err, sizeof p->err, "unknown type '%s'", base);
        return -1;
    }
    return 0;
}

static int parse_default(parser *p, ag_op *op, int ai, int64_t **intpool, int *npool) {
    ag_arg *d = &op->args[ai].def;
    skip_ws(p);
    if (lit(p, "None")) {
        *d = AG_A_NONE;
    } else if (lit(p, "True")) {
        *d = AG_A_B(true);
    } else if (lit(p, "False")) {
        *d = AG_A_B(false);
    } else if (*p->s == '[') {
        p->s++;
        int64_t *vals = *intpool + *npool;
        int cnt = 0;
        while (true) {
            skip_ws(p);
            if (*p->s == ']') {
                p->s++;
                break;
            }
            char *end;
            long long v = strtoll(p->s, &end, 10);
            if (end == p->s || *npool + cnt >= 32) {
                snprintf(p->err, sizeof p->err, "bad int list default");
                return -1;
            }
            vals[cnt++] = v;
            p->s = end;
            lit(p, ",");
        }
        *d = AG_A_INTS(vals, cnt);
        *npool += cnt;
    } else if (*p->s == '\'' || *p->s == '"') {
        char q = *p->s++;
        const char *b = p->s;
        while (*p->s && *p->s != q)
            p->s++;
        /* The string lives in arg_names' buffer: the schema copy we parse from. */
        *(char *)p->s = 0;
        p->s++;
        *d = AG_A_S(b);
    } else {
        char *end;
        double v = strtod(p->s, &end);
        if (end == p->s) {
            snprintf(p->err, sizeof p->err, "bad default at column %d", (int)(p->s - p->start));
            return -1;
        }
        bool is_int = true;
        for (const char *c = p->s; c < end; c++)
            if (*c == '.' || *c == 'e' || *c == 'E')
                is_int = false;
        p->s = end;
        ag_type ty = op->args[ai].type;
        if (is_int && (ty == AG_TY_INT || ty == AG_TY_OPT_INT))
            *d = AG_A_I((int64_t)v);
        else if (ty == AG_TY_INT_LIST || ty == AG_TY_OPT_INT_LIST) {
            /* int[2] stride=1 means [1, 1] */
            int64_t *vals = *intpool + *npool;
            vals[0] = vals[1] = (int64_t)v;
            *d = AG_A_INTS(vals, 2);
            *npool += 2;
        } else
            *d = AG_A_F(v);
    }
    op->args[ai].has_default = true;
    return 0;
}

/* Parses def->schema into op. The op owns one buffer holding the name, argument names and
 * string defaults, plus an int pool for list defaults. */
static int parse_schema(ag_op *op) {
    const char *schema = op->def->schema;
    size_t n = strlen(schema);
    char *buf = ag__malloc(n + 1 + 32 * sizeof(int64_t) + 8);
    if (!buf)
        return AG_ENOMEM;
    memcpy(buf, schema, n + 1);
    int64_t *intpool = (int64_t *)(void *)(buf + ((n + 1 + 7) / 8) * 8);
    int npool = 0;
    op->arg_names = buf;
    parser p = {.s = buf, .start = buf};
    char *paren = strchr(buf, '(');
    if (!paren)
        return ag__err(AG_EINVAL, "op schema '%s': missing '('", schema);
    *paren = 0;
    op->name = buf;
    p.s = paren + 1;
    bool kwonly = false;
    op->nargs = 0;
    skip_ws(&p);
    if (*p.s == ')')
        p.s++;
    else
        while (true) {
            if (lit(&p, "*")) {
                kwonly = true;
                lit(&p, ",");
                continue;
            }
            if (op->nargs >= AG_MAX_ARGS)
                return ag__err(AG_EINVAL, "op schema '%s': more than %d arguments", schema,
                               AG_MAX_ARGS);
            int ai = op->nargs++;
            ag_schema_arg *a = &op->args[ai];
            if (parse_type(&p, &a->type, &op->mutates[ai]))
                return ag__err(AG_EINVAL, "op schema '%s': %s", schema, p.err);
            skip_ws(&p);
            char *nb = (char *)p.s;
            while (isalnum((unsigned char)*p.s) || *p.s == '_')
                p.s++;
            if (p.s == nb)
                return ag__err(AG_EINVAL, "op schema '%s': expected an argument name", schema);
            char *ne = (char *)p.s;
            a->kwarg_only = kwonly;
            a->has_default = false;
            bool more;
            skip_ws(&p);
            if (*p.s == '=') {
                p.s++;
                *ne = 0; /* safe: '=' already consumed */
                if (parse_default(&p, op, ai, &intpool, &npool))
                    return ag__err(AG_EINVAL, "op schema '%s': %s", schema, p.err);
                skip_ws(&p);
            }
            more = *p.s == ',';
            bool close = *p.s == ')';
            if (!more && !close)
                return ag__err(AG_EINVAL, "op schema '%s': expected ',' or ')' at column %d",
                               schema, (int)(p.s - p.start));
            p.s++;
            *ne = 0;
            a->name = nb;
            if (close)
                break;
        }
    if (!lit(&p, "->"))
        return ag__err(AG_EINVAL, "op schema '%s': missing '->'", schema);
    skip_ws(&p);
    op->out_is_list = false;
    if (*p.s == '(') {
        int cnt = 0;
        const char *q = p.s + 1;
        while (*q && *q != ')') {
            if (!strncmp(q, "Tensor", 6))
                cnt++;
            q++;
        }
        op->noutputs = cnt;
    } else if (strstr(p.s, "Tensor[]")) {
        op->noutputs = -1;
        op->out_is_list = true;
    } else if (!strncmp(p.s, "Tensor", 6)) {
        op->noutputs = 1;
    } else {
        return ag__err(AG_EINVAL, "op schema '%s': unsupported return type", schema);
    }
    return 0;
}

static void op_free(ag_op *op) {
    if (!op)
        return;
    ag__free(op->arg_names);
    ag__free(op);
}

/* Parses def and appends it to the table (the schema is parsed before the lock is taken). */
static const ag_op *register_def(const ag_opdef *def) {
    ag_op *op = ag__calloc(1, sizeof *op);
    if (!op)
        return NULL;
    op->def = def;
    if (parse_schema(op)) {
        op_free(op);
        return NULL;
    }
    pthread_mutex_lock(&reg_lock);
    int rc = 0;
    for (int64_t i = 0; i < nops && !rc; i++)
        if (!strcmp(ops[i]->name, op->name))
            rc = ag__err(AG_EINVAL, "op_register: an op named '%s' already exists", op->name);
    if (!rc)
        rc = ag__grow((void **)&ops, &ops_cap, nops + 1, sizeof *ops);
    if (!rc) {
        op->index = (int)nops;
        ops[nops++] = op;
    }
    pthread_mutex_unlock(&reg_lock);
    if (rc) {
        op_free(op);
        return NULL;
    }
    return op;
}

/* An op parsed from def but kept out of the registry (the with_effects wrappers of
 * src/ops/with_effects.c, which all carry the name `with_effects`). */
ag_op *ag__op_new_detached(const ag_opdef *def) {
    ag_op *op = ag__calloc(1, sizeof *op);
    if (!op)
        return NULL;
    op->def = def;
    op->index = -1;
    if (parse_schema(op)) {
        op_free(op);
        return NULL;
    }
    return op;
}

void ag__op_free_detached(ag_op *op) {
    op_free(op);
}

static void register_builtins(void) {
    for (size_t f = 0; f < sizeof families / sizeof families[0]; f++)
        for (const ag_opdef *const *d = families[f]; *d; d++)
            if (!register_def(*d)) {
                fprintf(stderr, "aotgrad: built-in op table is broken: %s\n", ag_last_error());
                abort();
            }
}

static void load_builtins(void) {
    pthread_once(&builtins_once, register_builtins);
}

/* Frees the registry at exit so leak checkers see a clean heap. */
__attribute__((destructor)) static void registry_free(void) {
    for (int64_t i = 0; i < nops; i++)
        op_free(ops[i]);
    ag__free(ops);
    ops = NULL;
    nops = ops_cap = 0;
}

const ag_op *ag_op_find(const char *name) {
    AG__CHECK_NULL_RET("op_find", name, NULL);
    load_builtins();
    const ag_op *found = NULL;
    pthread_mutex_lock(&reg_lock);
    for (int64_t i = 0; i < nops && !found; i++)
        if (!strcmp(ops[i]->name, name))
            found = ops[i];
    pthread_mutex_unlock(&reg_lock);
    return found;
}

const ag_op *ag__op(const char *name) {
    const ag_op *op = ag_op_find(name);
    if (!op) {
        fprintf(stderr, "aotgrad: internal error: op '%s' is not in the table\n", name);
        abort();
    }
    return op;
}

int ag_op_count(void) {
    load_builtins();
    pthread_mutex_lock(&reg_lock);
    int n = (int)nops;
    pthread_mutex_unlock(&reg_lock);
    return n;
}

const ag_op *ag_op_at(int i) {
    load_builtins();
    pthread_mutex_lock(&reg_lock);
    const ag_op *op = i >= 0 && i < nops ? ops[i] : NULL;
    pthread_mutex_unlock(&reg_lock);
    return op;
}

const char *ag_op_name(const ag_op *op) {
    return op ? op->name : NULL;
}
const ag_opdef *ag_op_def(const ag_op *op) {
    return op ? op->def : NULL;
}
int ag_op_nargs(const ag_op *op) {
    return op ? op->nargs : 0;
}
const ag_schema_arg *ag_op_arg(const ag_op *op, int i) {
    if (!op)
        return NULL;
    return i >= 0 && i < op->nargs ? &op->args[i] : NULL;
}
int ag_op_noutputs(const ag_op *op) {
    return op ? op->noutputs : 0;
}

const ag_op *ag_op_register(const ag_opdef *def) {
    load_builtins();
    if (!def || !def->schema || !def->meta)
        return ag__err(AG_EINVAL, "op_register: a definition needs a schema and a meta function"),
               NULL;
    const char *colons = strstr(def->schema, "::");
    const char *paren = strchr(def->schema, '(');
    if (!colons || !paren || colons > paren)
        return ag__err(AG_EINVAL, "op_register: '%s' must be named namespace::name", def->schema),
               NULL;
    if (!def->kernel && !(def->flags & AG_OP_COMPOSITE))
        return ag__err(AG_EINVAL, "op_register: '%s' has no kernel", def->schema), NULL;
    return register_def(def);
}

static const char *const flag_names[] = {
    "pointwise",         "reduction",    "view",    "inplace",    "random",
    "compute_intensive", "nondiff",      "factory", "effectful",  "backward_helper",
    "composite",         "inplace_view", "fill",    "collective", "subgraph",
};

char *ag_op_flags_str(uint32_t flags, char *buf, size_t n) {
    AG__CHECK_NULL_RET("op_flags_str", buf, NULL);
    size_t k = 0;
    buf[0] = 0;
    for (size_t i = 0; i < sizeof flag_names / sizeof flag_names[0]; i++)
        if (flags & (1u << i))
            k += (size_t)snprintf(buf + k, k < n ? n - k : 0, "%s%s", k ? "," : "", flag_names[i]);
    return buf;
}

/* ---- argument checking ---- */

static const char *type_name(ag_type t) {
    static const char *const names[] = {"Tensor", "Tensor?", "Tensor[]",   "Tensor?[]",   "int",
                                        "int?",   "float",   "float?",     "Scalar",      "bool",
                                        "int[]",  "int[]?",  "ScalarType", "ScalarType?", "str",
                                        "bool?",  "Any"};
    return names[t];
}

static bool kind_ok(ag_type ty, ag_arg *a) {
    switch (ty) {
    case AG_TY_TENSOR:
        return a->kind == AG_ARG_TENSOR;
    case AG_TY_OPT_TENSOR:
        if (a->kind == AG_ARG_TENSOR && !a->u.t)
            *a = AG_A_NONE;
        return a->kind == AG_ARG_TENSOR || a->kind == AG_ARG_NONE;
    case AG_TY_TENSOR_LIST:
    case AG_TY_OPT_TENSOR_LIST:
        return a->kind == AG_ARG_TENSORS;
    case AG_TY_INT:
        return a->kind == AG_ARG_INT;
    case AG_TY_OPT_INT:
        return a->kind == AG_ARG_INT || a->kind == AG_ARG_NONE;
    case AG_TY_FLOAT:
    case AG_TY_SCALAR:
    case AG_TY_OPT_FLOAT:
        if (a->kind == AG_ARG_INT)
            *a = AG_A_F((double)a->u.i);
        return a->kind == AG_ARG_FLOAT || (ty == AG_TY_OPT_FLOAT && a->kind == AG_ARG_NONE);
    case AG_TY_BOOL:
        return a->kind == AG_ARG_BOOL;
    case AG_TY_OPT_BOOL:
        return a->kind == AG_ARG_BOOL || a->kind == AG_ARG_NONE;
    case AG_TY_INT_LIST:
        return a->kind == AG_ARG_INTS;
    case AG_TY_OPT_INT_LIST:
        return a->kind == AG_ARG_INTS || a->kind == AG_ARG_NONE;
    case AG_TY_DTYPE:
        return a->kind == AG_ARG_DTYPE;
    case AG_TY_OPT_DTYPE:
        return a->kind == AG_ARG_DTYPE || a->kind == AG_ARG_NONE;
    case AG_TY_STR:
        return a->kind == AG_ARG_STR || a->kind == AG_ARG_NONE;
    case AG_TY_ANY:
        return true;
    }
    return false;
}

/* Copies args into full[], filling defaults and checking kinds. Returns 0, or an error that
 * names the op and argument; when a tensor argument is NULL and an error is already pending
 * (a failed earlier op in a chain), that first message is kept. */
int ag__op_check_args(const ag_op *op, const ag_arg *args, int nargs, ag_arg *full) {
    if (nargs > op->nargs)
        return ag__err(AG_EINVAL, "%s: takes %d arguments, %d given", op->name, op->nargs, nargs);
    for (int i = 0; i < op->nargs; i++) {
        const ag_schema_arg *sa = &op->args[i];
        if (i < nargs) {
            full[i] = args[i];
        } else if (sa->has_default) {
            full[i] = sa->def;
        } else {
            return ag__err(AG_EINVAL, "%s: missing argument '%s'", op->name, sa->name);
        }
        if (full[i].kind == AG_ARG_TENSOR && !full[i].u.t && sa->type == AG_TY_TENSOR) {
            if (ag__has_error())
                return ag_last_status();
            return ag__err(AG_EINVAL, "%s: argument '%s' is NULL", op->name, sa->name);
        }
        if (!kind_ok(sa->type, &full[i]))
            return ag__err(AG_EINVAL, "%s: argument '%s' must be %s", op->name, sa->name,
                           type_name(sa->type));
        if (full[i].kind == AG_ARG_TENSORS) {
            if (full[i].n > 0 && !full[i].u.ts)
                return ag__err(AG_EINVAL, "%s: argument '%s' is NULL", op->name, sa->name);
            if (full[i].n < 0)
                return ag__err(AG_EINVAL, "%s: argument '%s' is a bad tensor list", op->name,
                               sa->name);
            if (sa->type == AG_TY_TENSOR_LIST)
                for (int k = 0; k < full[i].n; k++)
                    if (!full[i].u.ts[k]) {
                        if (ag__has_error())
                            return ag_last_status();
                        return ag__err(AG_EINVAL, "%s: element %d of '%s' is NULL", op->name, k,
                                       sa->name);
                    }
        }
        if (full[i].kind == AG_ARG_INTS && full[i].n > 0 && !full[i].u.ints)
            return ag__err(AG_EINVAL, "%s: argument '%s' is a NULL int list", op->name, sa->name);
        if (full[i].kind == AG_ARG_INTS && full[i].n < 0)
            return ag__err(AG_EINVAL, "%s: argument '%s' has a negative length %d", op->name,
                           sa->name, full[i].n);
    }
    if (op->def->flags & AG_OP_EFFECTFUL)
        return ag__with_effects_check(op, full); /* the wrapped op named matches (with_effects.c) */
    return 0;
}

/* ---- the call ---- */

static void free_outs(ag_tensor **outs, int n) {
    for (int i = 0; i < n; i++) {
        ag_tensor_free(outs[i]);
        outs[i] = NULL;
    }
}

/* Whether two different index tuples of t reach one memory location, when that is cheap to
 * see: a dim of size > 1 with stride 0 (an expanded view), or two dims of size > 1 whose
 * strides s <= s' have s' = m*s with m < size of the s dim (stepping m along the one and once
 * along the other lands on one element). Other overlapping geometries (only as_strided makes
 * them) are not caught, as PyTorch does not catch them. */
static bool internal_overlap(const ag_tensor *t) {
    for (int i = 0; i < t->ndim; i++) {
        if (t->sizes[i] < 2)
            continue;
        int64_t si = t->strides[i] < 0 ? -t->strides[i] : t->strides[i];
        if (si == 0)
            return true;
        for (int j = 0; j < t->ndim; j++) {
            if (j == i || t->sizes[j] < 2)
                continue;
            int64_t sj = t->strides[j] < 0 ? -t->strides[j] : t->strides[j];
            if (sj >= si && sj % si == 0 && sj / si < t->sizes[i])
                return true;
        }
    }
    return false;
}

/* Refuses a write into a tensor with internal overlap: which element the kernel leaves where
 * two share memory would depend on its loop order (and on the thread count). Ops flagged
 * AG_OP_FILL write one value everywhere and may; in-place view ops write no data. */
static int check_mutated_overlap(const ag_op *op, const ag_arg *full) {
    if (op->def->flags & (AG_OP_FILL | AG_OP_INPLACE_VIEW))
        return 0;
    for (int i = 0; i < op->nargs; i++) {
        if (!op->mutates[i])
            continue;
        int n = full[i].kind == AG_ARG_TENSOR ? 1 : full[i].kind == AG_ARG_TENSORS ? full[i].n : 0;
        for (int k = 0; k < n; k++) {
            const ag_tensor *t = full[i].kind == AG_ARG_TENSOR ? full[i].u.t : full[i].u.ts[k];
            if (t && internal_overlap(t)) {
                char sz[128], st[128];
                return ag__err(AG_EINVAL,
                               "%s: unsupported operation: more than one element of the "
                               "written-to tensor '%s' (sizes %s, strides %s) refers to a single "
                               "memory location. Please clone() the tensor before performing "
                               "the operation.",
                               op->name, op->args[i].name,
                               ag__fmt_sizes(sz, sizeof sz, t->ndim, t->sizes),
                               ag__fmt_sizes(st, sizeof st, t->ndim, t->strides));
            }
        }
    }
    return 0;
}

/* Completes the pending eager collectives that write a tensor argument's storage. */
static void wait_pending_args(const ag_op *op, const ag_arg *full) {
    for (int i = 0; i < op->nargs; i++) {
        if (full[i].kind == AG_ARG_TENSOR && full[i].u.t)
            ag__pending_wait_storage(full[i].u.t->storage);
        else if (full[i].kind == AG_ARG_TENSORS)
            for (int k = 0; k < full[i].n; k++)
                if (full[i].u.ts[k])
                    ag__pending_wait_storage(full[i].u.ts[k]->storage);
    }
}

/* Zeroes the metas op's meta function fills, its outputs (every slot for a list of outputs,
 * whose count is known after it runs; not the whole array for a fixed count: that is 9 kB per
 * call), and runs it. */
int ag__op_run_meta(const ag_op *op, const ag_arg *full, ag_tmeta *metas) {
    int n = op->out_is_list || op->noutputs > AG_MAX_OUTPUTS ? AG_MAX_OUTPUTS : op->noutputs;
    memset(metas, 0, sizeof(ag_tmeta) * (size_t)(n > 0 ? n : 0));
    return op->def->meta(full, metas);
}

/* Runs the call; on success outs hold references owned by the caller (not given to a scope). */
static int call_raw(const ag_op *op, const ag_arg *full, ag_tensor **outs, int *nouts_p) {
    const ag_opdef *def = op->def;
    ag__tls_state *ts = ag__tls();

    if (def->flags & AG_OP_COMPOSITE) {
        /* Runs the decomposition in a scope of its own; keep the results. */
        ag_tensor *tmp[AG_MAX_OUTPUTS] = {0};
        ts->dispatch_depth++;
        uint64_t errs = ag__err_count();
        ag_scope_begin();
        int rc = def->decomp(full, tmp);
        if (rc >= 0 && ag__err_count() != errs && ag_last_status() < 0)
            rc = ag_last_status();
        int n = op->noutputs > 0 ? op->noutputs : 0;
        if (op->out_is_list && rc > 0)
            n = rc;
        for (int i = 0; i < n; i++)
            outs[i] = rc >= 0 ? ag_tensor_keep(tmp[i]) : NULL;
        ag_scope_end();
        ts->dispatch_depth--;
        if (rc < 0)
            return rc;
        for (int i = 0; i < n; i++)
            if (!outs[i]) {
                free_outs(outs, n);
                return ag__err(AG_EINVAL, "%s: decomposition produced no output %d", op->name, i);
            }
        *nouts_p = n;
        return 0;
    }

    ag_tmeta metas[AG_MAX_OUTPUTS];
    int rc = ag__op_run_meta(op, full, metas);
    if (rc < 0)
        return rc;
    int nouts = op->out_is_list ? rc : op->noutputs;
    if (nouts > AG_MAX_OUTPUTS)
        return ag__err(AG_EINVAL, "%s: %d outputs (at most %d)", op->name, nouts, AG_MAX_OUTPUTS);
    if ((rc = ag__check_out_metas(op->name, metas, nouts)))
        return rc;
    if ((rc = check_mutated_overlap(op, full)))
        return rc;
    /* A tensor subclass argument: autograd above, the type's dispatch instead of the kernel. */
    const ag_subclass_type *sub = ag__subclass_dispatcher(op, full);
    if (sub) {
        rc = ag__subclass_call(sub, op, full, metas, nouts, outs);
        if (rc == 0)
            *nouts_p = nouts;
        return rc;
    }

    /* A meta input (or tracing mode) makes the whole call symbolic: no kernel runs. */
    bool meta = ts->tracing;
    ag_dtype kdt = AG_F32;
    bool have_tensor = false;
    for (int i = 0; i < op->nargs; i++) {
        if (full[i].kind == AG_ARG_TENSOR && full[i].u.t) {
            if (!have_tensor)
                kdt = full[i].u.t->dtype;
            have_tensor = true;
            if (ag__is_meta(full[i].u.t))
                meta = true;
        } else if (full[i].kind == AG_ARG_TENSORS) {
            for (int k = 0; k < full[i].n; k++)
                if (full[i].u.ts[k]) {
                    if (!have_tensor)
                        kdt = full[i].u.ts[k]->dtype;
                    have_tensor = true;
                    if (ag__is_meta(full[i].u.ts[k]))
                        meta = true;
                }
        }
    }
    if (!have_tensor && nouts > 0)
        kdt = metas[0].dtype;
    if (!(def->flags & AG_OP_VIEW) && !(def->dtypes & (1u << kdt)))
        return ag__err(AG_ENOTSUP, "%s: no kernel for dtype %s", op->name, ag_dtype_short(kdt));

    /* Whether this call records an autograd node: decided once, used by the in-place copy, the
     * tracer's seq_nr and the record itself. */
    const bool wanted = ag__autograd_wanted(op, full, op->nargs);
    rc = ag__autograd_check_inplace(op, full, op->nargs);
    if (rc)
        return rc;

    for (int i = 0; i < nouts; i++) {
        if (i == 0 && (def->flags & AG_OP_INPLACE)) {
            outs[0] = ag_tensor_keep(full[0].u.t);
        } else if (i == 0 && (def->flags & AG_OP_VIEW)) {
            outs[0] = ag__tensor_alias(full[0].u.t, &metas[0]);
            if (outs[0]) {
                outs[0]->is_view = true;
                /* ._base: the root of the view chain, as PyTorch keeps it */
                ag_tensor *root = full[0].u.t->base ? full[0].u.t->base : full[0].u.t;
                outs[0]->base = ag_tensor_keep(root);
            }
        } else {
            outs[i] = ag__tensor_from_meta(&metas[i], meta);
        }
        if (!outs[i]) {
            free_outs(outs, i);
            return ag_last_status();
        }
    }

    /* An eager collective's output read before its wait_tensor: completed first, as PyTorch's
     * AsyncCollectiveTensor waits on first use (a view reads nothing and does not wait). */
    if (!meta && !(def->flags & AG_OP_VIEW))
        wait_pending_args(op, full);

    /* An in-place op whose backward needs the original self saves a copy taken before the
     * kernel overwrites it (autograd's original_self). */
    ag_tensor *orig_self = NULL;
    if ((def->flags & AG_OP_INPLACE) && (def->save_args & 1) && wanted) {
        orig_self = ag__tensor_new(full[0].u.t->dtype, full[0].u.t->ndim, full[0].u.t->sizes, meta);
        if (orig_self) {
            /* Under tracing the copy stands for self's value before the mutation. */
            orig_self->trace = full[0].u.t->trace;
            orig_self->trace_id = full[0].u.t->trace_id;
        }
        if (!orig_self || (!meta && ag__copy_into(orig_self, full[0].u.t))) {
            ag_tensor_free(orig_self);
            free_outs(outs, nouts);
            return ag_last_status();
        }
    }
    if (!meta && def->kernel && !(def->flags & AG_OP_VIEW)) {
        ts->dispatch_depth++;
        rc = def->kernel(full, outs);
        ts->dispatch_depth--;
        if (rc < 0) {
            ag_tensor_free(orig_self);
            free_outs(outs, nouts);
            return rc;
        }
        /* The collective started: its entry keeps the output's storage until it completes,
         * whatever happens to the output from here on (freed by a failure below, or by the
         * caller before its wait_tensor). */
        if (def->flags & AG_OP_COLLECTIVE)
            for (int i = 0; i < nouts; i++)
                ag__coll_hold(outs[i]);
    }
    for (int i = 0; i < op->nargs; i++)
        if (op->mutates[i] && full[i].kind == AG_ARG_TENSOR && full[i].u.t)
            full[i].u.t->storage->version++;

    /* The tracer runs before the autograd record, so that tensors the record saves (aliases of
     * inputs and outputs) already carry their graph nodes; it is told the seq_nr the record is
     * about to assign. */
    if (ag__trace_hook) {
        bool records = wanted && def->backward;
        ts->trace_seq = records ? ag__autograd_current_seq() + 1 : ag__autograd_current_seq();
        rc = ag__trace_hook(op, full, op->nargs, outs, nouts);
        if (rc < 0) {
            ag_tensor_free(orig_self);
            free_outs(outs, nouts);
            return rc;
        }
    }
    rc = wanted ? ag__autograd_record(op, full, op->nargs, outs, nouts, orig_self) : 0;
    if (rc == 0 && wanted && ag__copyslices_wanted(op, outs, nouts))
        rc = ag__copyslices_record(outs[0]);
    ag_tensor_free(orig_self);
    if (rc < 0) {
        free_outs(outs, nouts);
        return rc;
    }
    /* An in-place view op: self takes the view's geometry, its data untouched. Last, so that
     * the tracer (which reads self's old value) and the autograd record (self's old shape)
     * see self as it was. */
    if (def->flags & AG_OP_INPLACE_VIEW) {
        ag_tensor *self = full[0].u.t;
        self->ndim = metas[0].ndim;
        memcpy(self->sizes, metas[0].sizes, sizeof self->sizes);
        memcpy(self->strides, metas[0].strides, sizeof self->strides);
        self->offset = metas[0].offset;
    }
    *nouts_p = nouts;
    return 0;
}

int ag_op_call(const ag_op *op, const ag_arg *args, int nargs, ag_tensor **outs) {
    AG__CHECK_NULL("op_call", op);
    ag_arg full[AG_MAX_ARGS];
    int rc = ag__op_check_args(op, args, nargs, full);
    if (rc)
        return rc;
    int n = 0;
    rc = call_raw(op, full, outs, &n);
    if (rc < 0)
        return rc;
    for (int i = 0; i < n; i++) {
        outs[i] = ag__give(outs[i]);
        if (!outs[i]) {
            for (int k = i + 1; k < n; k++)
                ag_tensor_free(outs[k]);
            return AG_ENOMEM;
        }
    }
    return op->out_is_list ? n : 0;
}

ag_tensor *ag_op_call1(const ag_op *op, const ag_arg *args, int nargs) {
    AG__CHECK_NULL_RET("op_call1", op, NULL);
    ag_tensor *outs[AG_MAX_OUTPUTS] = {0};
    int rc = ag_op_call(op, args, nargs, outs);
    if (rc < 0)
        return NULL;
    /* Extra outputs of a multi-output op are dropped (their owner is the caller or scope). */
    if (!ag__in_scope())
        for (int i = 1; i < AG_MAX_OUTPUTS; i++)
            ag_tensor_free(outs[i]);
    return outs[0];
}

ag_tensor *ag__call1(const ag_op *op, const ag_arg *args, int nargs) {
    return ag_op_call1(op, args, nargs);
}

int ag__calln(const ag_op *op, const ag_arg *args, int nargs, ag_tensor **outs, int nouts) {
    ag_tensor *tmp[AG_MAX_OUTPUTS] = {0};
    int rc = ag_op_call(op, args, nargs, tmp);
    if (rc < 0) {
        for (int i = 0; i < nouts; i++)
            outs[i] = NULL;
        return rc;
    }
    for (int i = 0; i < AG_MAX_OUTPUTS; i++) {
        if (i < nouts)
            outs[i] = tmp[i];
        else if (!ag__in_scope())
            ag_tensor_free(tmp[i]);
    }
    return rc;
}

/* ---- cost ---- */

int ag_op_cost(const ag_op *op, const ag_arg *args, int nargs, ag_cost *c) {
    AG__CHECK_NULL("op_cost", op);
    AG__CHECK_NULL("op_cost", args);
    AG__CHECK_NULL("op_cost", c);
    ag_arg full[AG_MAX_ARGS];
    int rc = ag__op_check_args(op, args, nargs, full);
    if (rc)
        return rc;
    c->flops = c->bytes = 0;
    if (op->def->flags & AG_OP_COMPOSITE)
        return 0;
    ag_tmeta metas[AG_MAX_OUTPUTS];
    rc = ag__op_run_meta(op, full, metas);
    if (rc < 0)
        return rc;
    int nouts = op->out_is_list ? rc : op->noutputs;
    if (op->def->cost) {
        op->def->cost(full, metas, nouts, c);
        return 0;
    }
    if (op->def->flags & AG_OP_VIEW)
        return 0;
    for (int i = 0; i < op->nargs; i++) {
        if (full[i].kind == AG_ARG_TENSOR && full[i].u.t)
            c->bytes +=
                (double)ag_tensor_numel(full[i].u.t) * (double)ag_dtype_size(full[i].u.t->dtype);
        if (full[i].kind == AG_ARG_TENSORS)
            for (int k = 0; k < full[i].n; k++)
                if (full[i].u.ts[k])
                    c->bytes += (double)ag_tensor_numel(full[i].u.ts[k]) *
                                (double)ag_dtype_size(full[i].u.ts[k]->dtype);
    }
    for (int i = 0; i < nouts; i++) {
        double ne = (double)ag__numel(metas[i].ndim, metas[i].sizes);
        c->bytes += ne * (double)ag_dtype_size(metas[i].dtype);
        c->flops += ne;
    }
    return 0;
}
