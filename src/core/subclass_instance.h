/* Internal helpers for tensor subclasses (core/subclass_instance.c), shared by the export
 * (src/export/subclass_flatten.c) and the compiled callable (src/runtime/subclass_wrap.c).
 *
 * A creation meta (ag__scmeta) is upstream's SubclassCreationMeta: how to rebuild a (possibly
 * nested) subclass instance from its flattened plain tensors. It is a tree: a plain tensor is
 * a leaf (type NULL); an instance node has its type, outer metadata, a copy of the instance's
 * metadata and one child per inner tensor. */
#ifndef AG_CORE_SUBCLASS_H
#define AG_CORE_SUBCLASS_H

#include "internal.h"

struct ag__subdata {
    int64_t refcount;
    const ag_subclass_type *type;
    void *meta; /* type->meta_size bytes, or NULL */
    ag_tensor *inner[AG_SUBCLASS_MAX_INNER];
};

typedef struct ag__scmeta {
    const ag_subclass_type *type; /* NULL: a plain tensor */
    ag_tmeta outer;               /* dtype, sizes, strides of the tensor */
    void *meta;                   /* owned copy of the instance's metadata (or NULL) */
    struct ag__scmeta *inner;     /* type->ninner children (owned), NULL for a leaf */
    int nflat;                    /* plain tensors in this subtree (1 for a leaf) */
} ag__scmeta;

/* 0, or AG_EINVAL naming `who` when type lacks a name, 1 to AG_SUBCLASS_MAX_INNER inner
 * tensors with attribute names, an unflatten or a dispatch callback. */
int ag__subclass_type_check(const char *who, const ag_subclass_type *type);

/* The creation meta of t (a plain tensor gives a leaf). 0 or AG_ENOMEM (m cleared). */
int ag__scmeta_of(const ag_tensor *t, ag__scmeta *m);
int ag__scmeta_copy(ag__scmeta *dst, const ag__scmeta *src);
void ag__scmeta_clear(ag__scmeta *m); /* frees what m owns; m becomes an empty leaf */
/* Whether two metas have the same structure: the same types at the same places. */
bool ag__scmeta_same_structure(const ag__scmeta *a, const ag__scmeta *b);
/* Flattens t, which must have m's structure, into m->nflat plain tensors (borrowed). On a
 * mismatch: AG_EINVAL with "<what> is a plain tensor / a TwoTensor; expected ...". */
int ag__scmeta_unwrap(const ag__scmeta *m, ag_tensor *t, ag_tensor **flat, const char *what);
/* Rebuilds a tensor of m's structure from m->nflat plain tensors (each type's unflatten with
 * the recorded metadata and outer sizes); a leaf gives flat[0] itself. Returns a new (or,
 * inside a scope, scope-owned) reference, or NULL. */
ag_tensor *ag__scmeta_wrap(const ag__scmeta *m, ag_tensor *const *flat);
/* The descriptors of m's flattened tensors: base itself for a leaf, else
 * SubclassGetAttr{Input,Output}(base, attr) per inner tensor, recursively (inputs or outputs
 * as base is). Stores m->nflat new references in out; 0 or a negative status (none kept). */
int ag__scmeta_descs(const ag__scmeta *m, const ag_desc *base, ag_desc **out);
/* "TwoTensor" or "plain tensor", for messages. */
const char *ag__scmeta_name(const ag__scmeta *m);

#endif
