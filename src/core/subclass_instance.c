/* Tensor subclass instances (include/aotgrad/subclass.h): construction, flattening and the
 * creation metas the export and the compiled callable use to take instances apart and put them
 * back together (subclass_instance.h).
 *
 * In: a type, outer metadata, inner tensors. Out: an ag_tensor whose storage is data-less and
 * whose `sub` points at a refcounted record of the type, the inner tensors and a copy of the
 * metadata. Aliases of an instance (detach, saved tensors of autograd nodes, view results)
 * share the record, so they see the same inner tensors. The dispatcher's part, running ops on
 * instances (and ag_subclass_call_inner for dispatch callbacks), is in src/ops/subclass_call.c. */
#include "subclass_instance.h"

#include <stdio.h>

/* ---- the shared record ---- */

void ag__subdata_retain(struct ag__subdata *s) {
    s->refcount++;
}

void ag__subdata_release(struct ag__subdata *s) {
    if (!s || --s->refcount > 0)
        return;
    for (int i = 0; i < AG_SUBCLASS_MAX_INNER; i++)
        ag_tensor_free(s->inner[i]);
    ag__free(s->meta);
    ag__free(s);
}

/* ---- instances ---- */

int ag__subclass_type_check(const char *who, const ag_subclass_type *type) {
    if (!type)
        return ag__err(AG_EINVAL, "%s: NULL subclass type", who);
    if (!type->name || type->ninner < 1 || type->ninner > AG_SUBCLASS_MAX_INNER || !type->attrs ||
        !type->unflatten || !type->dispatch)
        return ag__err(AG_EINVAL,
                       "%s: subclass type '%s' needs a name, 1 to %d inner tensors with attribute "
                       "names, an unflatten and a dispatch callback",
                       who, type->name ? type->name : "?", AG_SUBCLASS_MAX_INNER);
    for (int i = 0; i < type->ninner; i++)
        if (!type->attrs[i])
            return ag__err(AG_EINVAL, "%s: subclass type '%s' has no name for inner tensor %d", who,
                           type->name, i);
    return 0;
}

ag_tensor *ag_subclass_new(const ag_subclass_type *type, ag_dtype dtype, int ndim,
                           const int64_t *sizes, const int64_t *strides, ag_tensor *const *inner,
                           const void *meta) {
    if (ag__subclass_type_check("subclass_new", type))
        return NULL;
    for (int i = 0; i < type->ninner; i++)
        if (!inner || !inner[i]) {
            if (ag__has_error()) /* a failed op made it: keep that message */
                return NULL;
            return ag__err(AG_EINVAL, "subclass_new: %s: inner tensor '%s' is NULL", type->name,
                           type->attrs[i]),
                   NULL;
        }
    if ((unsigned)dtype >= AG_NDTYPES)
        return ag__err(AG_EINVAL, "subclass_new: %s: bad dtype %d", type->name, (int)dtype), NULL;
    if (type->meta_size && !meta)
        return ag__err(AG_EINVAL, "subclass_new: %s needs %zu bytes of metadata, got NULL",
                       type->name, type->meta_size),
               NULL;
    if (ndim > 0 && !sizes)
        return ag__err(AG_EINVAL, "subclass_new: %s: NULL sizes", type->name), NULL;
    ag_tensor *t = ag__tensor_new(dtype, ndim, sizes, true);
    struct ag__subdata *s = t ? ag__calloc(1, sizeof *s) : NULL;
    if (s && type->meta_size && !(s->meta = ag__malloc(type->meta_size))) {
        ag__free(s);
        s = NULL;
    }
    if (!s) {
        ag_tensor_free(t);
        return NULL;
    }
    if (strides)
        memcpy(t->strides, strides, sizeof(int64_t) * (size_t)ndim);
    s->refcount = 1;
    s->type = type;
    if (type->meta_size)
        memcpy(s->meta, meta, type->meta_size);
    for (int i = 0; i < type->ninner; i++)
        s->inner[i] = ag_tensor_keep(inner[i]);
    t->sub = s;
    return ag__give(t);
}

const ag_subclass_type *ag_tensor_subclass(const ag_tensor *t) {
    return t && t->sub ? t->sub->type : NULL;
}

int ag_subclass_flatten(const ag_tensor *t, ag_tensor **inner, const void **meta) {
    if (!t || !t->sub)
        return ag__err(AG_EINVAL, "subclass_flatten: %s", t ? "a plain tensor" : "NULL tensor");
    for (int i = 0; i < t->sub->type->ninner; i++)
        inner[i] = t->sub->inner[i];
    if (meta)
        *meta = t->sub->meta;
    return t->sub->type->ninner;
}

ag_tensor *ag_subclass_inner(const ag_tensor *t, int i) {
    return t && t->sub && i >= 0 && i < t->sub->type->ninner ? t->sub->inner[i] : NULL;
}

ag_tensor *ag_subclass_attr(const ag_tensor *t, const char *attr) {
    if (!t || !t->sub || !attr)
        return NULL;
    for (int i = 0; i < t->sub->type->ninner; i++)
        if (!strcmp(t->sub->type->attrs[i], attr))
            return t->sub->inner[i];
    return NULL;
}

ag_tensor *ag_subclass_unflatten(const ag_subclass_type *type, ag_tensor *const *inner,
                                 const void *meta, int ndim, const int64_t *outer_sizes) {
    if (ag__subclass_type_check("subclass_unflatten", type))
        return NULL;
    return type->unflatten(type, inner, meta, ndim, outer_sizes);
}

static int flatten_into(ag_tensor *t, ag_tensor **out, int max, int k) {
    if (!t || !t->sub) {
        if (k < max)
            out[k] = t;
        return k + 1;
    }
    for (int i = 0; i < t->sub->type->ninner; i++)
        k = flatten_into(t->sub->inner[i], out, max, k);
    return k;
}

int ag_subclass_flatten_tensors(ag_tensor *const *ts, int n, ag_tensor **out, int max) {
    if (n < 0 || max < 0)
        return ag__err(AG_EINVAL, "subclass_flatten_tensors: negative count (n %d, max %d)", n,
                       max);
    if (n > 0)
        AG__CHECK_NULL("subclass_flatten_tensors", ts);
    if (max > 0)
        AG__CHECK_NULL("subclass_flatten_tensors", out);
    int k = 0;
    for (int i = 0; i < n; i++)
        k = flatten_into(ts[i], out, max, k);
    return k;
}

/* ---- running an op on inner tensors ---- */

/* ---- creation metas ---- */

void ag__scmeta_clear(ag__scmeta *m) {
    if (m->inner)
        for (int i = 0; i < m->type->ninner; i++)
            ag__scmeta_clear(&m->inner[i]);
    ag__free(m->inner);
    ag__free(m->meta);
    memset(m, 0, sizeof *m);
    m->nflat = 1;
}

int ag__scmeta_of(const ag_tensor *t, ag__scmeta *m) {
    memset(m, 0, sizeof *m);
    m->nflat = 1;
    ag__tmeta_of(t, &m->outer);
    if (!t->sub)
        return 0;
    const ag_subclass_type *type = t->sub->type;
    m->type = type;
    m->nflat = 0;
    m->inner = ag__calloc((size_t)type->ninner, sizeof *m->inner);
    if (!m->inner || (type->meta_size && !(m->meta = ag__malloc(type->meta_size)))) {
        ag__scmeta_clear(m);
        return AG_ENOMEM;
    }
    if (type->meta_size)
        memcpy(m->meta, t->sub->meta, type->meta_size);
    for (int i = 0; i < type->ninner; i++)
        m->inner[i].nflat = 1; /* so clearing a half-built tree stays sound */
    for (int i = 0; i < type->ninner; i++) {
        if (ag__scmeta_of(t->sub->inner[i], &m->inner[i])) {
            ag__scmeta_clear(m);
            return AG_ENOMEM;
        }
        m->nflat += m->inner[i].nflat;
    }
    return 0;
}

int ag__scmeta_copy(ag__scmeta *dst, const ag__scmeta *src) {
    *dst = *src;
    dst->meta = NULL;
    dst->inner = NULL;
    if (!src->type)
        return 0;
    const ag_subclass_type *type = src->type;
    dst->inner = ag__calloc((size_t)type->ninner, sizeof *dst->inner);
    if (!dst->inner || (type->meta_size && !(dst->meta = ag__malloc(type->meta_size)))) {
        ag__scmeta_clear(dst);
        return AG_ENOMEM;
    }
    if (type->meta_size)
        memcpy(dst->meta, src->meta, type->meta_size);
    for (int i = 0; i < type->ninner; i++)
        dst->inner[i].nflat = 1;
    for (int i = 0; i < type->ninner; i++)
        if (ag__scmeta_copy(&dst->inner[i], &src->inner[i])) {
            ag__scmeta_clear(dst);
            return AG_ENOMEM;
        }
    return 0;
}

bool ag__scmeta_same_structure(const ag__scmeta *a, const ag__scmeta *b) {
    if (a->type != b->type)
        return false;
    for (int i = 0; a->type && i < a->type->ninner; i++)
        if (!ag__scmeta_same_structure(&a->inner[i], &b->inner[i]))
            return false;
    return true;
}

const char *ag__scmeta_name(const ag__scmeta *m) {
    return m->type ? m->type->name : "plain tensor";
}

static int unwrap_rec(const ag__scmeta *m, ag_tensor *t, ag_tensor **flat, int k,
                      const char *what) {
    const ag_subclass_type *got = ag_tensor_subclass(t);
    if (got != m->type)
        return ag__err(AG_EINVAL, "%s is a %s; expected a %s", what,
                       got ? got->name : "plain tensor", ag__scmeta_name(m));
    if (!m->type) {
        flat[k] = t;
        return k + 1;
    }
    for (int i = 0; i < m->type->ninner && k >= 0; i++)
        k = unwrap_rec(&m->inner[i], t->sub->inner[i], flat, k, what);
    return k;
}

int ag__scmeta_unwrap(const ag__scmeta *m, ag_tensor *t, ag_tensor **flat, const char *what) {
    int k = unwrap_rec(m, t, flat, 0, what);
    return k < 0 ? k : 0;
}

static ag_tensor *wrap_rec(const ag__scmeta *m, ag_tensor *const *flat, int *k) {
    if (!m->type)
        return flat[(*k)++];
    ag_tensor *inner[AG_SUBCLASS_MAX_INNER] = {0};
    ag_scope_begin();
    bool ok = true;
    for (int i = 0; i < m->type->ninner && ok; i++)
        ok = (inner[i] = wrap_rec(&m->inner[i], flat, k)) != NULL;
    ag_tensor *r = ok ? ag_tensor_keep(m->type->unflatten(m->type, inner, m->meta, m->outer.ndim,
                                                          m->outer.sizes))
                      : NULL;
    ag_scope_end();
    return r ? ag__give(r) : NULL;
}

ag_tensor *ag__scmeta_wrap(const ag__scmeta *m, ag_tensor *const *flat) {
    int k = 0;
    if (!m->type)
        return ag__give(ag_tensor_keep(flat[0]));
    return wrap_rec(m, flat, &k);
}

static int descs_rec(const ag__scmeta *m, const ag_desc *base, ag_desc **out, int *k) {
    if (!m->type) {
        out[(*k)++] = ag_desc_retain(base);
        return 0;
    }
    bool in = ag_desc_is_input(base);
    for (int i = 0; i < m->type->ninner; i++) {
        const char *attr = m->type->attrs[i];
        ag_desc *d = in ? ag_desc_subclass_getattr_input(base, attr)
                        : ag_desc_subclass_getattr_output(base, attr);
        if (!d)
            return ag_last_status();
        int rc = descs_rec(&m->inner[i], d, out, k);
        ag_desc_release(d);
        if (rc)
            return rc;
    }
    return 0;
}

int ag__scmeta_descs(const ag__scmeta *m, const ag_desc *base, ag_desc **out) {
    int k = 0;
    int rc = descs_rec(m, base, out, &k);
    if (rc)
        for (int i = 0; i < k; i++) {
            ag_desc_release(out[i]);
            out[i] = NULL;
        }
    return rc;
}
