/* Tensors, storage and views: construction, reference counting, metadata accessors,
 * autorelease scopes, element access and dtype-converting copies. Ops live in src/ops; this
 * file only manages the objects they work on. */
#include "internal.h"
#include "kernel_util.h"

#include <math.h>
#include <stdio.h>

/* ---- dtypes ---- */

static const char *const dt_short[] = {"f32", "f64", "i64", "b8", "i8"};
static const char *const dt_name[] = {"float32", "float64", "int64", "bool", "int8"};
static const size_t dt_size[] = {4, 8, 8, 1, 1};

const char *ag_dtype_short(ag_dtype dt) {
    return (unsigned)dt < AG_NDTYPES ? dt_short[dt] : "?";
}
const char *ag_dtype_name(ag_dtype dt) {
    return (unsigned)dt < AG_NDTYPES ? dt_name[dt] : "?";
}
size_t ag_dtype_size(ag_dtype dt) {
    return (unsigned)dt < AG_NDTYPES ? dt_size[dt] : 0;
}
bool ag_dtype_is_float(ag_dtype dt) {
    return dt == AG_F32 || dt == AG_F64;
}

/* ---- metadata helpers ---- */

int64_t ag__numel(int ndim, const int64_t *sizes) {
    int64_t n = 1;
    for (int i = 0; i < ndim; i++)
        n = ag__sat_mul(n, sizes[i]);
    return n;
}

int ag__check_out_metas(const char *op, const ag_tmeta *m, int n) {
    for (int k = 0; k < n; k++) {
        if (m[k].ndim < 0 || m[k].ndim > AG_MAX_DIMS)
            return ag__err(AG_EINVAL, "%s: output %d has %d dimensions", op, k, m[k].ndim);
        for (int d = 0; d < m[k].ndim; d++)
            if (m[k].sizes[d] < 0)
                return ag__err(AG_EINVAL, "%s: output %d has negative size %lld in dim %d", op, k,
                               (long long)m[k].sizes[d], d);
        int64_t ne = ag__numel(m[k].ndim, m[k].sizes);
        if (ne > AG__MAX_NUMEL) {
            char b[256];
            return ag__err(AG_EINVAL, "%s: output %d of shape %s has too many elements", op, k,
                           ag__fmt_sizes(b, sizeof b, m[k].ndim, m[k].sizes));
        }
    }
    return 0;
}

void ag__tmeta_contiguous(ag_tmeta *m, ag_dtype dt, int ndim, const int64_t *sizes) {
    m->dtype = dt;
    m->ndim = ndim;
    m->offset = 0;
    int64_t st = 1;
    for (int i = ndim - 1; i >= 0; i--) {
        m->sizes[i] = sizes[i];
        m->strides[i] = st;
        st = ag__sat_mul(st, sizes[i] > 1 ? sizes[i] : 1);
    }
}

bool ag__tmeta_is_contiguous(const ag_tmeta *m) {
    int64_t st = 1;
    for (int i = m->ndim - 1; i >= 0; i--) {
        if (m->sizes[i] == 1)
            continue;
        if (m->strides[i] != st)
            return false;
        st *= m->sizes[i];
    }
    return true;
}

void ag__tmeta_of(const ag_tensor *t, ag_tmeta *m) {
    m->dtype = t->dtype;
    m->ndim = t->ndim;
    memcpy(m->sizes, t->sizes, sizeof m->sizes);
    memcpy(m->strides, t->strides, sizeof m->strides);
    m->offset = t->offset;
}

bool ag__is_meta(const ag_tensor *t) {
    return t->storage->data == NULL;
}

int ag__wrap_dim(const char *op, int64_t dim, int ndim) {
    int n = ndim > 0 ? ndim : 1;
    if (dim < -n || dim >= n) {
        ag__err(AG_EINVAL,
                "%s: Dimension out of range (expected to be in range of [%d, %d], but got %lld)",
                op, -n, n - 1, (long long)dim);
        return -1;
    }
    return (int)(dim < 0 ? dim + n : dim);
}

/* ---- construction ---- */

static ag_storage *storage_new(size_t nbytes, bool meta) {
    ag_storage *s = ag__malloc(sizeof *s);
    if (!s)
        return NULL;
    s->refcount = 1;
    s->nbytes = nbytes;
    s->version = 0;
    s->data = NULL;
    if (!meta) {
        s->data = ag__malloc_data(nbytes);
        if (!s->data) {
            ag__free(s);
            return NULL;
        }
    }
    return s;
}

void ag__storage_release(ag_storage *s) {
    if (s && --s->refcount == 0) {
        ag__free_data(s->data, s->nbytes);
        ag__free(s);
    }
}

static ag_tensor *tensor_shell(void) {
    ag_tensor *t = ag__malloc(sizeof *t);
    if (!t)
        return NULL;
    memset(t, 0, sizeof *t);
    t->refcount = 1;
    return t;
}

ag_tensor *ag__tensor_new(ag_dtype dt, int ndim, const int64_t *sizes, bool meta) {
    if (ndim < 0 || ndim > AG_MAX_DIMS) {
        ag__err(AG_EINVAL, "tensor: %d dimensions (at most %d)", ndim, AG_MAX_DIMS);
        return NULL;
    }
    for (int i = 0; i < ndim; i++)
        if (sizes[i] < 0) {
            ag__err(AG_EINVAL, "tensor: negative size %lld in dim %d", (long long)sizes[i], i);
            return NULL;
        }
    if ((unsigned)dt >= AG_NDTYPES) {
        ag__err(AG_EINVAL, "tensor: bad dtype %d", (int)dt);
        return NULL;
    }
    /* The byte count must describe every element: a shape whose element count saturates or
     * whose byte count wraps around size_t would get a storage smaller than its geometry. */
    int64_t numel = ag__numel(ndim, sizes);
    size_t nbytes;
    if (numel > AG__MAX_NUMEL ||
        __builtin_mul_overflow((size_t)numel, ag_dtype_size(dt), &nbytes)) {
        char b[256];
        ag__err(AG_EINVAL,
                "tensor: storage size calculation overflowed with sizes=%s and dtype %s (at "
                "most %lld elements)",
                ag__fmt_sizes(b, sizeof b, ndim, sizes), ag_dtype_name(dt),
                (long long)AG__MAX_NUMEL);
        return NULL;
    }
    ag_tensor *t = tensor_shell();
    if (!t)
        return NULL;
    ag_tmeta m = {0};
    ag__tmeta_contiguous(&m, dt, ndim, sizes);
    t->dtype = dt;
    t->ndim = ndim;
    memcpy(t->sizes, m.sizes, sizeof t->sizes);
    memcpy(t->strides, m.strides, sizeof t->strides);
    t->storage = storage_new(nbytes, meta);
    if (!t->storage) {
        ag__free(t);
        return NULL;
    }
    return t;
}

ag_tensor *ag__tensor_from_meta(const ag_tmeta *m, bool meta) {
    return ag__tensor_new(m->dtype, m->ndim, m->sizes, meta);
}

ag_tensor *ag__tensor_alias(ag_tensor *src, const ag_tmeta *m) {
    ag_tensor *t = tensor_shell();
    if (!t)
        return NULL;
    t->dtype = m->dtype;
    t->ndim = m->ndim;
    memcpy(t->sizes, m->sizes, sizeof t->sizes);
    memcpy(t->strides, m->strides, sizeof t->strides);
    t->offset = m->offset;
    t->storage = src->storage;
    t->storage->refcount++;
    t->trace = src->trace;
    t->trace_id = src->trace_id;
    t->trace_ver = src->trace_ver;
    t->sub = src->sub; /* an alias of a subclass instance shares its inner tensors */
    if (t->sub)
        ag__subdata_retain(t->sub);
    return t;
}

void ag__tensor_retain(ag_tensor *t) {
    t->refcount++;
}

void ag_tensor_free(ag_tensor *t) {
    if (!t || --t->refcount > 0)
        return;
    ag__storage_release(t->storage);
    ag_tensor_free(t->base);
    ag__subdata_release(t->sub);
    ag_tensor_free(t->grad);
    if (t->grad_fn)
        ag__anode_release(t->grad_fn);
    ag__free(t);
}

ag_tensor *ag_tensor_keep(ag_tensor *t) {
    if (t)
        t->refcount++;
    return t;
}

/* ---- scopes ---- */

/* The first SCOPE_INLINE entries live in a per-thread array, so the scopes of a compiled
 * training step (its outputs and saved values) allocate nothing; more go to a heap array, freed
 * when the outermost scope ends. */
#define SCOPE_INLINE 1024
static _Thread_local ag_tensor *scope_inline[SCOPE_INLINE];
static _Thread_local ag_tensor **scope_items;
static _Thread_local int64_t scope_len, scope_cap;
/* Scope marks live in a fixed array so that opening a scope can never fail; nesting deeper
 * than AG__MAX_SCOPES is a programming error reported through ag_last_error (the extra scopes
 * then share the innermost mark). */
#define AG__MAX_SCOPES 256
static _Thread_local int64_t scope_marks[AG__MAX_SCOPES];
static _Thread_local int64_t scope_depth;

void ag_scope_begin(void) {
    if (scope_depth < AG__MAX_SCOPES)
        scope_marks[scope_depth] = scope_len;
    else
        ag__err(AG_ESTATE, "scope_begin: scopes nested deeper than %d", AG__MAX_SCOPES);
    scope_depth++;
}

void ag_scope_end(void) {
    if (scope_depth == 0)
        return;
    scope_depth--;
    int64_t mark = scope_marks[scope_depth < AG__MAX_SCOPES ? scope_depth : AG__MAX_SCOPES - 1];
    /* Newest first, so views die before their bases. */
    while (scope_len > mark)
        ag_tensor_free(scope_items[--scope_len]);
    if (scope_depth == 0 && scope_items != scope_inline) {
        ag__free(scope_items);
        scope_items = NULL;
        scope_len = scope_cap = 0;
    }
}

bool ag__in_scope(void) {
    return scope_depth > 0;
}

ag_tensor *ag__give(ag_tensor *t) {
    if (!t || scope_depth == 0)
        return t;
    if (!scope_items) {
        scope_items = scope_inline;
        scope_cap = SCOPE_INLINE;
    }
    if (scope_len == scope_cap) {
        /* Past the inline entries: a heap array (ag__grow frees the array it grows, so the
         * inline one is copied here instead). */
        bool inl = scope_items == scope_inline;
        ag_tensor **items = inl ? NULL : scope_items;
        int64_t cap = inl ? 0 : scope_cap;
        if (ag__grow((void **)&items, &cap, scope_len + 1, sizeof *items)) {
            ag_tensor_free(t);
            return NULL;
        }
        if (inl)
            memcpy(items, scope_inline, sizeof *items * (size_t)scope_len);
        scope_items = items;
        scope_cap = cap;
    }
    scope_items[scope_len++] = t;
    return t;
}

/* ---- accessors ---- */

ag_dtype ag_tensor_dtype(const ag_tensor *t) {
    return t ? t->dtype : AG_F32;
}
int ag_tensor_ndim(const ag_tensor *t) {
    return t ? t->ndim : 0;
}
const int64_t *ag_tensor_sizes(const ag_tensor *t) {
    return t ? t->sizes : NULL;
}
const int64_t *ag_tensor_strides(const ag_tensor *t) {
    return t ? t->strides : NULL;
}
int64_t ag_tensor_offset(const ag_tensor *t) {
    return t ? t->offset : 0;
}
int64_t ag_tensor_numel(const ag_tensor *t) {
    return t ? ag__numel(t->ndim, t->sizes) : 0;
}

int64_t ag_tensor_size(const ag_tensor *t, int dim) {
    if (!t)
        return 0;
    int d = ag__wrap_dim("size", dim, t->ndim);
    if (d < 0)
        return -1;
    return t->ndim ? t->sizes[d] : 1;
}

bool ag_tensor_is_contiguous(const ag_tensor *t) {
    if (!t)
        return false;
    ag_tmeta m;
    ag__tmeta_of(t, &m);
    return ag__tmeta_is_contiguous(&m);
}

_Atomic(ag__data_wait_fn) ag__data_wait_hook;

/* t's data is about to be read or handed out: a pending eager collective writing it completes
 * first (see ag__data_wait_hook). */
static void data_ready(const ag_tensor *t) {
    ag__data_wait_fn f = atomic_load_explicit(&ag__data_wait_hook, memory_order_relaxed);
    if (f && t->storage->data)
        f(t->storage);
}

void *ag_tensor_data(const ag_tensor *t) {
    if (!t)
        return NULL;
    data_ready(t);
    return t->storage->data ? ag__base(t) : NULL;
}

bool ag_tensor_same_storage(const ag_tensor *a, const ag_tensor *b) {
    if (!a)
        return false;
    if (!b)
        return false;
    return a->storage == b->storage;
}

ag_tensor *ag_tensor_base(const ag_tensor *t) {
    return t ? t->base : NULL;
}

uint64_t ag_tensor_version(const ag_tensor *t) {
    return t ? t->storage->version : 0;
}
void ag_tensor_bump_version(ag_tensor *t) {
    AG__CHECK_NULL_RET("tensor_bump_version", t, );
    t->storage->version++;
}

double ag__get_f64(const ag_tensor *t, int64_t i) {
    int64_t off = t->offset;
    for (int d = t->ndim - 1; d >= 0; d--) {
        int64_t sz = t->sizes[d];
        off += (i % sz) * t->strides[d];
        i /= sz;
    }
    const char *p = (const char *)t->storage->data;
    switch (t->dtype) {
    case AG_F32:
        return ((const float *)p)[off];
    case AG_F64:
        return ((const double *)p)[off];
    case AG_I64:
        return (double)((const int64_t *)p)[off];
    case AG_BOOL:
        return ((const bool *)p)[off] ? 1.0 : 0.0;
    case AG_I8:
        return (double)((const int8_t *)p)[off];
    default:
        return NAN;
    }
}

double ag_tensor_item_at(const ag_tensor *t, int64_t i) {
    AG__CHECK_NULL_RET("tensor_item_at", t, NAN);
    if (t && t->sub) {
        char b[128];
        ag__err(AG_EINVAL,
                "item: %s %s is a tensor subclass instance without data of its own; "
                "read its inner tensors (ag_subclass_inner)",
                ag_tensor_subclass(t)->name, ag_tensor_meta_str(t, b, sizeof b));
        return NAN;
    }
    if (t && !t->storage->data) {
        char b[128];
        ag__err(AG_ENOTSUP,
                "item: %s is a data-less (traced or meta) tensor; reading its values "
                "is data-dependent and cannot be traced",
                ag_tensor_meta_str(t, b, sizeof b));
        return NAN;
    }
    if (i < 0 || i >= ag_tensor_numel(t)) {
        ag__err(AG_EINVAL, "item_at: index %lld out of range", (long long)i);
        return NAN;
    }
    data_ready(t);
    return ag__get_f64(t, i);
}

double ag_tensor_item(const ag_tensor *t) {
    AG__CHECK_NULL_RET("tensor_item", t, NAN);
    if (t && ag_tensor_numel(t) != 1) {
        char b[128];
        ag__err(AG_EINVAL, "item: a tensor of shape %s has %lld elements, not 1",
                ag__fmt_sizes(b, sizeof b, t->ndim, t->sizes), (long long)ag_tensor_numel(t));
        return NAN;
    }
    return ag_tensor_item_at(t, 0);
}

int ag_tensor_to_doubles(const ag_tensor *t, double *out) {
    AG__CHECK_NULL("tensor_to_doubles", t);
    AG__CHECK_NULL("tensor_to_doubles", out);
    if (!t->storage->data)
        return ag__err(AG_EINVAL, "to_doubles: tensor without data");
    data_ready(t);
    int64_t n = ag_tensor_numel(t);
    for (int64_t i = 0; i < n; i++)
        out[i] = ag__get_f64(t, i);
    return 0;
}

char *ag_tensor_meta_str(const ag_tensor *t, char *buf, size_t n) {
    AG__CHECK_NULL_RET("tensor_meta_str", t, NULL);
    AG__CHECK_NULL_RET("tensor_meta_str", buf, NULL);
    char s[256];
    snprintf(buf, n, "%s%s", ag_dtype_short(t->dtype),
             ag__fmt_sizes(s, sizeof s, t->ndim, t->sizes));
    return buf;
}

void ag_tensor_print(const ag_tensor *t, const char *name, int max_elems) {
    char b[300];
    if (!t) {
        printf("%s: NULL\n", name ? name : "tensor");
        return;
    }
    printf("%s: %s", name ? name : "tensor", ag_tensor_meta_str(t, b, sizeof b));
    if (t->sub) {
        printf(" %s\n", ag_tensor_subclass(t)->name);
        for (int i = 0; ag_subclass_inner(t, i); i++) {
            char nm[160];
            snprintf(nm, sizeof nm, "  %s.%s", name ? name : "tensor",
                     ag_tensor_subclass(t)->attrs[i]);
            ag_tensor_print(ag_subclass_inner(t, i), nm, max_elems);
        }
        return;
    }
    if (!t->storage->data) {
        printf(" (meta)\n");
        return;
    }
    int64_t n = ag_tensor_numel(t);
    printf(" = [");
    for (int64_t i = 0; i < n && i < max_elems; i++)
        printf(i ? ", %.6g" : "%.6g", ag__get_f64(t, i));
    printf(n > max_elems ? ", ...]\n" : "]\n");
}

/* ---- copies ---- */

int ag__copy_into(ag_tensor *dst, const ag_tensor *src) {
    ag__iter it;
    ag_tensor *ops[2] = {dst, (ag_tensor *)src};
    ag__iter_build(&it, ops, 2);
#define AG__COPY_LOOP(TD, TS)                                                                      \
    AG__ITER_ROWS(it, {                                                                            \
        TD *o = (TD *)it.base[0] + off[0];                                                         \
        const TS *x = (const TS *)it.base[1] + off[1];                                             \
        const int64_t so = it.inner_stride[0], sx = it.inner_stride[1];                            \
        for (int64_t k = 0; k < len; k++)                                                          \
            o[k * so] = (TD)x[k * sx];                                                             \
    })
    switch (src->dtype) {
    case AG_F32:
        AG__COPY_SWITCH(dst->dtype, TD, AG__COPY_LOOP(TD, float));
        break;
    case AG_F64:
        AG__COPY_SWITCH(dst->dtype, TD, AG__COPY_LOOP(TD, double));
        break;
    case AG_I64:
        AG__COPY_SWITCH(dst->dtype, TD, AG__COPY_LOOP(TD, int64_t));
        break;
    case AG_BOOL:
        AG__COPY_SWITCH(dst->dtype, TD, AG__COPY_LOOP(TD, bool));
        break;
    case AG_I8:
        AG__COPY_SWITCH(dst->dtype, TD, AG__COPY_LOOP(TD, int8_t));
        break;
    default:
        return ag__err(AG_ENOTSUP, "copy: bad dtype");
    }
#undef AG__COPY_LOOP
    return 0;
}

/* Flat row-major position of the first element of float tensor t that does not convert to
 * the integral dtype dt, or -1. */
static int64_t first_unfit(const ag_tensor *t, ag_dtype dt, double *bad) {
    ag__iter it;
    ag_tensor *ops[1] = {(ag_tensor *)t};
    ag__iter_build(&it, ops, 1);
    for (int64_t r = 0; r < it.rows; r++) {
        int64_t off[AG__ITER_MAX];
        ag__iter_row_offsets(&it, r, off);
        for (int64_t k = 0; k < it.inner; k++) {
            const char *p =
                it.base[0] + (off[0] + k * it.inner_stride[0]) * (int64_t)ag_dtype_size(t->dtype);
            double v = t->dtype == AG_F32 ? (double)*(const float *)(const void *)p
                                          : *(const double *)(const void *)p;
            if (!ag__fits_dtype(v, dt)) {
                *bad = v;
                return r * it.inner + k;
            }
        }
    }
    return -1;
}

int ag__copy_convert(const char *op, ag_tensor *dst, const ag_tensor *src) {
    if (ag_dtype_is_float(src->dtype) && (dst->dtype == AG_I64 || dst->dtype == AG_I8) &&
        ag_tensor_numel(src) > 0) {
        double v = 0;
        int64_t i = first_unfit(src, dst->dtype, &v);
        if (i >= 0)
            return ag__err(AG_EINVAL,
                           "%s: cannot convert %s value %g (element %lld) to %s: NaN, "
                           "infinity or out of range",
                           op, ag_dtype_name(src->dtype), v, (long long)i,
                           ag_dtype_name(dst->dtype));
    }
    return ag__copy_into(dst, src);
}

/* ---- autograd flags ---- */

int ag_tensor_set_requires_grad(ag_tensor *t, bool rg) {
    AG__CHECK_NULL("tensor_set_requires_grad", t);
    if (t->grad_fn)
        return ag__err(AG_EINVAL,
                       "set_requires_grad: you can only change requires_grad flags of leaf "
                       "variables (this tensor was produced by an op)");
    if (rg && !ag_dtype_is_float(t->dtype))
        return ag__err(AG_EINVAL,
                       "set_requires_grad: only floating point tensors can require "
                       "gradients (dtype %s)",
                       ag_dtype_short(t->dtype));
    t->requires_grad = rg;
    return 0;
}

bool ag_tensor_requires_grad(const ag_tensor *t) {
    return t && t->requires_grad;
}
bool ag_tensor_is_leaf(const ag_tensor *t) {
    return t && t->grad_fn == NULL;
}
ag_tensor *ag_tensor_grad(const ag_tensor *t) {
    return t ? t->grad : NULL;
}

int ag_tensor_set_grad(ag_tensor *t, ag_tensor *g) {
    AG__CHECK_NULL("tensor_set_grad", t);
    /* The checks of PyTorch's .grad setter: the gradient must match t in dtype, size and
     * device (meta or not; a subclass wrapper holds no data of its own and is checked by the
     * optimizer), and t cannot be its own gradient. */
    if (g == t)
        return ag__err(AG_EINVAL, "tensor_set_grad: can't assign a tensor as its own grad");
    if (g && g->dtype != t->dtype)
        return ag__err(AG_EINVAL,
                       "tensor_set_grad: assigned grad has data of a different type (%s for a "
                       "tensor of %s)",
                       ag_dtype_name(g->dtype), ag_dtype_name(t->dtype));
    if (g &&
        (g->ndim != t->ndim || memcmp(g->sizes, t->sizes, sizeof(int64_t) * (size_t)t->ndim))) {
        char a[128], b[128];
        return ag__err(AG_EINVAL,
                       "tensor_set_grad: assigned grad has data of a different size (%s for a "
                       "tensor of size %s)",
                       ag__fmt_sizes(a, sizeof a, g->ndim, g->sizes),
                       ag__fmt_sizes(b, sizeof b, t->ndim, t->sizes));
    }
    if (g && !t->sub && !g->sub && ag__is_meta(g) != ag__is_meta(t))
        return ag__err(AG_EINVAL,
                       "tensor_set_grad: assigned grad has data located on a different device "
                       "(%s for a %s tensor)",
                       ag__is_meta(g) ? "meta" : "data", ag__is_meta(t) ? "meta" : "data");
    if (g)
        g->refcount++;
    ag_tensor_free(t->grad);
    t->grad = g;
    return 0;
}

ag_tensor *ag_detach(ag_tensor *t) {
    if (!t) { /* like an op, keeps an earlier error: ag_detach(ag_relu(NULL)) */
        if (!ag__has_error() || ag_last_status() >= 0)
            ag__err(AG_EINVAL, "detach: t is NULL");
        return NULL;
    }
    ag_tmeta m;
    ag__tmeta_of(t, &m);
    ag_tensor *d = ag__tensor_alias(t, &m);
    if (d)
        d->is_view = true;
    return ag__give(d);
}

bool ag__tmeta_equal(const ag_tmeta *a, const ag_tmeta *b) {
    if (a->dtype != b->dtype || a->ndim != b->ndim || a->offset != b->offset)
        return false;
    for (int d = 0; d < a->ndim; d++)
        if (a->sizes[d] != b->sizes[d] || a->strides[d] != b->strides[d])
            return false;
    return true;
}
