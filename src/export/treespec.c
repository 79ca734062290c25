/* Pytree specs and trees: the C counterpart of torch.utils._pytree's TreeSpec, tree_flatten and
 * tree_unflatten, which the joint export uses to describe its calling convention (in_spec is
 * the spec of `(flat list of params, buffers and args, kwargs dict)`, out_spec the spec of the
 * user outputs).
 *
 * In: containers (tuple, list, dict with string keys in insertion order), None and tensor
 * leaves. Out: an immutable, refcounted ag_treespec (shape only: kinds, dict keys, child
 * counts) with PyTorch's repr, structural equality and leaf counts; and ag_tree values (the
 * same shapes holding tensors) that flatten to their leaves in depth-first order plus a spec,
 * and unflatten back from a spec and a leaf list.
 *
 * Specs are shared by reference and never change after construction, so a joint's in_spec can
 * be handed out without copying. Refcounts are plain integers: specs are built and released on
 * one thread (the export's), and sharing across threads is not a use case. Every allocation
 * goes through ag__malloc; a failing constructor frees what it had made and reports AG_ENOMEM
 * (or AG_EINVAL for a bad argument), leaving its arguments as they were, except for the
 * ag_tree containers, which own their children also on failure (see below). A NULL child
 * (a failed constructor's result) fails the container and keeps the first error's message, as
 * ops given a NULL tensor do, so a nested construction can be checked once at its end. */
#include "../core/internal.h"
#include "../core/pystr.h"

#include <limits.h>

struct ag_treespec {
    int64_t refcount;
    ag_tree_kind kind;
    int n;                  /* children */
    int num_leaves;         /* tensors below (a LEAF counts 1, NONE 0) */
    ag_treespec **children; /* n references */
    char **keys;            /* DICT: n keys */
    char **key_reprs;       /* DICT: Python's repr() of each key, for ag_treespec_repr */
};

struct ag_tree {
    ag_tree_kind kind;
    int n;
    ag_tree **children; /* owned */
    char **keys;        /* DICT */
    ag_tensor *t;       /* LEAF: a reference */
};

static const char *kind_type_name(ag_tree_kind k) {
    switch (k) {
    case AG_TREE_TUPLE:
        return "tuple";
    case AG_TREE_LIST:
        return "list";
    case AG_TREE_DICT:
        return "dict";
    case AG_TREE_NONE:
        return "NoneType";
    case AG_TREE_LEAF:
        break;
    }
    return "*";
}

/* Python's repr() of a str (src/core/pystr.c). Returns a new string, or NULL with AG_ENOMEM. */
static char *py_str_repr(const char *s) {
    size_t n = strlen(s), len = ag__pystr_repr(s, n, NULL, 0);
    char *buf = ag__malloc(len + 1);
    if (buf)
        ag__pystr_repr(s, n, buf, len + 1);
    return buf;
}

/* Dict keys must be present and distinct (a Python dict cannot repeat one). */
static int check_keys(const char *who, const char *const *keys, int n) {
    if (n > 0 && !keys)
        return ag__err(AG_EINVAL, "%s: NULL keys for %d entries", who, n);
    for (int i = 0; i < n; i++) {
        if (!keys[i])
            return ag__err(AG_EINVAL, "%s: key %d is NULL", who, i);
        for (int j = 0; j < i; j++)
            if (!strcmp(keys[i], keys[j]))
                return ag__err(AG_EINVAL, "%s: key '%s' appears twice (entries %d and %d)", who,
                               keys[i], j, i);
    }
    return 0;
}

static void free_strs(char **v, int n) {
    if (!v)
        return;
    for (int i = 0; i < n; i++)
        ag__free(v[i]);
    ag__free(v);
}

/* Copies n keys into *out (and, when reprs is given, their Python reprs). */
static int copy_keys(const char *const *keys, int n, char ***out, char ***reprs) {
    char **k = ag__calloc((size_t)(n ? n : 1), sizeof *k);
    char **r = reprs ? ag__calloc((size_t)(n ? n : 1), sizeof *r) : NULL;
    if (!k || (reprs && !r))
        goto fail;
    for (int i = 0; i < n; i++) {
        if (!(k[i] = ag__strdup(keys[i])))
            goto fail;
        if (reprs && !(r[i] = py_str_repr(keys[i])))
            goto fail;
    }
    *out = k;
    if (reprs)
        *reprs = r;
    return 0;
fail:
    free_strs(k, n);
    free_strs(r, n);
    return AG_ENOMEM;
}

/* ---- specs ---- */

static void spec_free(ag_treespec *s) {
    for (int i = 0; i < s->n; i++)
        ag_treespec_release(s->children[i]);
    ag__free(s->children);
    free_strs(s->keys, s->n);
    free_strs(s->key_reprs, s->n);
    ag__free(s);
}

static ag_treespec *spec_new(ag_tree_kind kind) {
    ag_treespec *s = ag__calloc(1, sizeof *s);
    if (!s)
        return NULL;
    s->refcount = 1;
    s->kind = kind;
    s->num_leaves = kind == AG_TREE_LEAF;
    return s;
}

ag_treespec *ag_treespec_leaf(void) {
    return spec_new(AG_TREE_LEAF);
}

ag_treespec *ag_treespec_none(void) {
    return spec_new(AG_TREE_NONE);
}

static ag_treespec *spec_container(const char *who, ag_tree_kind kind, const char *const *keys,
                                   ag_treespec *const *children, int n) {
    if (n < 0)
        return ag__err(AG_EINVAL, "%s: negative child count %d", who, n), NULL;
    if (n > 0 && !children)
        return ag__err(AG_EINVAL, "%s: NULL children for %d entries", who, n), NULL;
    int64_t leaves = 0;
    for (int i = 0; i < n; i++) {
        if (!children[i]) {
            /* a failed constructor's NULL: keep its message, as ops do with NULL tensors */
            if (!ag__has_error())
                ag__err(AG_EINVAL, "%s: child %d is NULL", who, i);
            return NULL;
        }
        leaves += children[i]->num_leaves;
    }
    if (leaves > INT_MAX)
        return ag__err(AG_EINVAL, "%s: more than %d leaves", who, INT_MAX), NULL;
    if (kind == AG_TREE_DICT && check_keys(who, keys, n))
        return NULL;
    ag_treespec *s = spec_new(kind);
    if (!s)
        return NULL;
    s->children = ag__calloc((size_t)(n ? n : 1), sizeof *s->children);
    if (!s->children || (kind == AG_TREE_DICT && copy_keys(keys, n, &s->keys, &s->key_reprs))) {
        ag__free(s->children);
        ag__free(s);
        return NULL;
    }
    for (int i = 0; i < n; i++)
        s->children[i] = ag_treespec_retain(children[i]);
    s->n = n;
    s->num_leaves = (int)leaves;
    return s;
}

ag_treespec *ag_treespec_tuple(ag_treespec *const *children, int n) {
    return spec_container("ag_treespec_tuple", AG_TREE_TUPLE, NULL, children, n);
}

ag_treespec *ag_treespec_list(ag_treespec *const *children, int n) {
    return spec_container("ag_treespec_list", AG_TREE_LIST, NULL, children, n);
}

ag_treespec *ag_treespec_dict(const char *const *keys, ag_treespec *const *children, int n) {
    return spec_container("ag_treespec_dict", AG_TREE_DICT, keys, children, n);
}

ag_treespec *ag_treespec_retain(const ag_treespec *s) {
    ag_treespec *m = (ag_treespec *)s;
    if (m)
        m->refcount++;
    return m;
}

void ag_treespec_release(ag_treespec *s) {
    if (s && --s->refcount == 0)
        spec_free(s);
}

ag_tree_kind ag_treespec_kind(const ag_treespec *s) {
    return s ? s->kind : AG_TREE_NONE;
}

int ag_treespec_num_children(const ag_treespec *s) {
    return s ? s->n : 0;
}

const ag_treespec *ag_treespec_child(const ag_treespec *s, int i) {
    return s && i >= 0 && i < s->n ? s->children[i] : NULL;
}

const char *ag_treespec_key(const ag_treespec *s, int i) {
    return s && s->kind == AG_TREE_DICT && i >= 0 && i < s->n ? s->keys[i] : NULL;
}

int ag_treespec_num_leaves(const ag_treespec *s) {
    return s ? s->num_leaves : 0;
}

bool ag_treespec_equal(const ag_treespec *a, const ag_treespec *b) {
    if (a == b)
        return true;
    if (!a || !b || a->kind != b->kind || a->n != b->n || a->num_leaves != b->num_leaves)
        return false;
    for (int i = 0; i < a->n; i++) {
        if (a->kind == AG_TREE_DICT && strcmp(a->keys[i], b->keys[i]))
            return false;
        if (!ag_treespec_equal(a->children[i], b->children[i]))
            return false;
    }
    return true;
}

/* snprintf-style writer: writes what fits, counts everything. */
typedef struct sbuf {
    char *buf;
    size_t n, len;
} sbuf;

static void sb_puts(sbuf *b, const char *s) {
    for (; *s; s++, b->len++)
        if (b->len + 1 < b->n)
            b->buf[b->len] = *s;
}

/* torch.utils._pytree: `TreeSpec(<type>, <context>, [<children>])`, a leaf is `*`; the context
 * of a dict is its key list, of tuple/list/None `None`. Upstream breaks the child list over
 * lines with indentation; this prints it on one line, separated by ", ". */
static void repr_into(sbuf *b, const ag_treespec *s) {
    if (s->kind == AG_TREE_LEAF) {
        sb_puts(b, "*");
        return;
    }
    sb_puts(b, "TreeSpec(");
    sb_puts(b, kind_type_name(s->kind));
    if (s->kind == AG_TREE_DICT) {
        sb_puts(b, ", [");
        for (int i = 0; i < s->n; i++) {
            if (i)
                sb_puts(b, ", ");
            sb_puts(b, s->key_reprs[i]);
        }
        sb_puts(b, "], [");
    } else {
        sb_puts(b, ", None, [");
    }
    for (int i = 0; i < s->n; i++) {
        if (i)
            sb_puts(b, ", ");
        repr_into(b, s->children[i]);
    }
    sb_puts(b, "])");
}

size_t ag_treespec_repr(const ag_treespec *s, char *buf, size_t n) {
    sbuf b = {buf, n, 0};
    if (s)
        repr_into(&b, s);
    else
        sb_puts(&b, "None");
    if (n)
        buf[b.len < n ? b.len : n - 1] = 0;
    return b.len;
}

/* ---- trees ---- */

static ag_tree *tree_new(ag_tree_kind kind) {
    ag_tree *t = ag__calloc(1, sizeof(ag_tree));
    if (t)
        t->kind = kind;
    return t;
}

ag_tree *ag_tree_leaf(ag_tensor *t) {
    if (!t)
        return ag__err(AG_EINVAL, "ag_tree_leaf: NULL tensor (use ag_tree_none for None)"), NULL;
    ag_tree *r = tree_new(AG_TREE_LEAF);
    if (!r)
        return NULL;
    r->t = ag_tensor_keep(t);
    return r;
}

ag_tree *ag_tree_none(void) {
    return tree_new(AG_TREE_NONE);
}

void ag_tree_free(ag_tree *t) {
    if (!t)
        return;
    for (int i = 0; i < t->n; i++)
        ag_tree_free(t->children[i]);
    ag__free(t->children);
    free_strs(t->keys, t->n);
    ag_tensor_free(t->t);
    ag__free(t);
}

/* Containers own their children from the call on: on failure the children are freed, so a
 * nested construction can be written as one expression and checked once. */
static ag_tree *tree_container(const char *who, ag_tree_kind kind, const char *const *keys,
                               ag_tree *const *children, int n) {
    ag_tree *r = NULL;
    int rc = 0;
    if (n < 0)
        rc = ag__err(AG_EINVAL, "%s: negative child count %d", who, n);
    else if (n > 0 && !children)
        rc = ag__err(AG_EINVAL, "%s: NULL children for %d entries", who, n);
    for (int i = 0; !rc && i < n; i++)
        if (!children[i])
            rc = ag__has_error() ? ag_last_status()
                                 : ag__err(AG_EINVAL, "%s: child %d is NULL", who, i);
    if (!rc && kind == AG_TREE_DICT)
        rc = check_keys(who, keys, n);
    if (!rc && (r = tree_new(kind))) {
        r->children = ag__calloc((size_t)(n ? n : 1), sizeof *r->children);
        if (!r->children || (kind == AG_TREE_DICT && copy_keys(keys, n, &r->keys, NULL))) {
            ag__free(r->children);
            ag__free(r);
            r = NULL;
        }
    }
    if (!r) {
        for (int i = 0; n > 0 && children && i < n; i++)
            ag_tree_free(children[i]);
        return NULL;
    }
    for (int i = 0; i < n; i++)
        r->children[i] = children[i];
    r->n = n;
    return r;
}

ag_tree *ag_tree_tuple(ag_tree *const *children, int n) {
    return tree_container("ag_tree_tuple", AG_TREE_TUPLE, NULL, children, n);
}

ag_tree *ag_tree_list(ag_tree *const *children, int n) {
    return tree_container("ag_tree_list", AG_TREE_LIST, NULL, children, n);
}

ag_tree *ag_tree_dict(const char *const *keys, ag_tree *const *children, int n) {
    return tree_container("ag_tree_dict", AG_TREE_DICT, keys, children, n);
}

ag_tree_kind ag_tree_kind_of(const ag_tree *t) {
    return t ? t->kind : AG_TREE_NONE;
}

int ag_tree_num_children(const ag_tree *t) {
    return t ? t->n : 0;
}

ag_tree *ag_tree_child(const ag_tree *t, int i) {
    return t && i >= 0 && i < t->n ? t->children[i] : NULL;
}

const char *ag_tree_key(const ag_tree *t, int i) {
    return t && t->kind == AG_TREE_DICT && i >= 0 && i < t->n ? t->keys[i] : NULL;
}

ag_tensor *ag_tree_tensor(const ag_tree *t) {
    return t && t->kind == AG_TREE_LEAF ? t->t : NULL;
}

/* The tree's spec (a new reference) and its leaves appended at leaves[*k]. */
static ag_treespec *flatten_into(const ag_tree *t, ag_tensor **leaves, int *k) {
    if (t->kind == AG_TREE_LEAF) {
        leaves[(*k)++] = t->t;
        return ag_treespec_leaf();
    }
    if (t->kind == AG_TREE_NONE)
        return ag_treespec_none();
    ag_treespec **kids = ag__calloc((size_t)(t->n ? t->n : 1), sizeof *kids);
    if (!kids)
        return NULL;
    ag_treespec *s = NULL;
    int i = 0;
    for (; i < t->n; i++)
        if (!(kids[i] = flatten_into(t->children[i], leaves, k)))
            break;
    if (i == t->n)
        s = spec_container("ag_tree_flatten", t->kind, (const char *const *)t->keys, kids, t->n);
    for (int j = 0; j < i; j++)
        ag_treespec_release(kids[j]);
    ag__free(kids);
    return s;
}

static int64_t count_leaves(const ag_tree *t) {
    if (t->kind == AG_TREE_LEAF)
        return 1;
    int64_t c = 0;
    for (int i = 0; i < t->n; i++)
        c += count_leaves(t->children[i]);
    return c;
}

int ag_tree_flatten(const ag_tree *t, ag_tensor ***leaves, ag_treespec **spec) {
    if (!t || !leaves || !spec)
        return ag__err(AG_EINVAL, "ag_tree_flatten: NULL %s", !t ? "tree" : "output pointer");
    int64_t cnt = count_leaves(t);
    if (cnt > INT_MAX)
        return ag__err(AG_EINVAL, "ag_tree_flatten: more than %d leaves", INT_MAX);
    ag_tensor **v = ag__calloc((size_t)(cnt ? cnt : 1), sizeof *v);
    if (!v)
        return AG_ENOMEM;
    int k = 0;
    ag_treespec *s = flatten_into(t, v, &k);
    if (!s) {
        ag__free(v);
        return ag_last_status();
    }
    *leaves = v;
    *spec = s;
    return k;
}

static ag_tree *unflatten_from(const ag_treespec *s, ag_tensor *const *leaves, int *k) {
    if (s->kind == AG_TREE_LEAF)
        return ag_tree_leaf(leaves[(*k)++]);
    if (s->kind == AG_TREE_NONE)
        return ag_tree_none();
    ag_tree **kids = ag__calloc((size_t)(s->n ? s->n : 1), sizeof *kids);
    if (!kids)
        return NULL;
    int i = 0;
    for (; i < s->n; i++)
        if (!(kids[i] = unflatten_from(s->children[i], leaves, k)))
            break;
    ag_tree *r = NULL;
    if (i == s->n)
        r = tree_container("ag_tree_unflatten", s->kind, (const char *const *)s->keys, kids, s->n);
    else
        for (int j = 0; j < i; j++)
            ag_tree_free(kids[j]);
    ag__free(kids);
    return r;
}

ag_tree *ag_tree_unflatten(const ag_treespec *spec, ag_tensor *const *leaves, int n) {
    if (!spec)
        return ag__err(AG_EINVAL, "ag_tree_unflatten: spec is NULL"), NULL;
    if (n != spec->num_leaves)
        return ag__err(AG_EINVAL, "ag_tree_unflatten: the spec has %d leaves but %d were given",
                       spec->num_leaves, n),
               NULL;
    if (n > 0 && !leaves)
        return ag__err(AG_EINVAL, "ag_tree_unflatten: NULL leaves for %d entries", n), NULL;
    for (int i = 0; i < n; i++)
        if (!leaves[i])
            return ag__err(AG_EINVAL, "ag_tree_unflatten: leaf %d is NULL", i), NULL;
    int k = 0;
    return unflatten_from(spec, leaves, &k);
}
