/* The module tree: named parameters, buffers and children in registration order, lookups by
 * dotted path, PyTorch's named_parameters()/named_buffers() traversal, train/eval, and the
 * call wrapper that hands a forward's outputs to the caller's autorelease scope.
 *
 * In: modules built by layers.c, gpt2.c or users (ag_module_new + register calls). Out: the
 * lists of fully qualified names and tensors that optimizers, state files and (later) the
 * tracer's parameter/buffer inputs are made from. A module owns its children and holds one
 * reference to each of its parameters and buffers; the same tensor may be registered on two
 * modules (weight tying), and remove_duplicate then keeps only its first sighting. */
#include "nn_internal.h"

#include <stdio.h>

typedef struct nn_entry {
    char *name;
    ag_tensor *t;
    bool persistent; /* buffers only */
} nn_entry;

typedef struct nn_child {
    char *name;
    ag_module *m;
} nn_child;

struct ag_module {
    char *type;
    ag_forward_fn forward;
    void *ud;
    void (*ud_free)(void *);
    bool training;
    bool checkpoint;     /* forward through ag_checkpoint */
    bool compile_region; /* forward as a nested compile region under tracing */
    ag_module *parent;
    nn_entry *params;
    int64_t nparams, cap_params;
    nn_entry *buffers;
    int64_t nbuffers, cap_buffers;
    nn_child *children;
    int64_t nchildren, cap_children;
    /* Changes whenever a parameter, buffer or child is added anywhere in the subtree, or a
     * tensor is swapped or converted: a value drawn from one process-wide counter, so that no
     * two states of any modules, freed ones included, share it (ag__module_stamp). */
    uint64_t stamp;
};

static uint64_t next_stamp = 1;

/* A new stamp for m and its ancestors (whose subtrees changed with m's). */
static void touch(ag_module *m) {
    uint64_t s = __atomic_fetch_add(&next_stamp, 1, __ATOMIC_RELAXED);
    for (; m; m = m->parent)
        m->stamp = s;
}

uint64_t ag__module_stamp(const ag_module *m) {
    return m ? m->stamp : 0;
}

int ag__nn_status(void) {
    int s = ag_last_status();
    return s < 0 ? s : ag__err(AG_EINVAL, "nn: operation failed without an error message");
}

/* ---- construction ---- */

/* The module owns `ud` from here on: it is freed with ud_free even when this fails. */
ag_module *ag_module_new(const char *type_name, ag_forward_fn forward, void *ud,
                         void (*ud_free)(void *)) {
    if (!type_name) { /* the module owns ud from the call on, as when allocation fails */
        if (ud && ud_free)
            ud_free(ud);
        return ag__err(AG_EINVAL, "module_new: type_name is NULL"), NULL;
    }
    ag_module *m = ag__calloc(1, sizeof *m);
    char *type = m ? ag__strdup(type_name) : NULL;
    if (!type) {
        ag__free(m);
        if (ud && ud_free)
            ud_free(ud);
        return NULL;
    }
    m->type = type;
    m->forward = forward;
    m->ud = ud;
    m->ud_free = ud_free;
    m->training = true; /* PyTorch modules start in training mode */
    touch(m);
    return m;
}

static void free_entries(nn_entry *e, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        ag__free(e[i].name);
        ag_tensor_free(e[i].t);
    }
    ag__free(e);
}

void ag_module_free(ag_module *m) {
    if (!m)
        return;
    for (int64_t i = 0; i < m->nchildren; i++) {
        ag__free(m->children[i].name);
        ag_module_free(m->children[i].m);
    }
    ag__free(m->children);
    free_entries(m->params, m->nparams);
    free_entries(m->buffers, m->nbuffers);
    if (m->ud && m->ud_free)
        m->ud_free(m->ud);
    ag__free(m->type);
    ag__free(m);
}

static const nn_entry *find_entry(const nn_entry *e, int64_t n, const char *name) {
    for (int64_t i = 0; i < n; i++)
        if (!strcmp(e[i].name, name))
            return &e[i];
    return NULL;
}

static ag_module *find_child(const ag_module *m, const char *name, size_t len) {
    for (int64_t i = 0; i < m->nchildren; i++)
        if (strlen(m->children[i].name) == len && !strncmp(m->children[i].name, name, len))
            return m->children[i].m;
    return NULL;
}

/* PyTorch's rules for attribute names: non-empty, no '.', not already taken by a parameter,
 * buffer or child of the same module. */
static int check_name(const ag_module *m, const char *what, const char *name) {
    if (!m)
        return ag__err(AG_EINVAL, "%s: m is NULL", what);
    if (!name)
        return ag__err(AG_EINVAL, "%s: name is NULL", what);
    if (!*name)
        return ag__err(AG_EINVAL, "%s: name can't be empty", what);
    if (strchr(name, '.'))
        return ag__err(AG_EINVAL, "%s: name '%s' can't contain '.'", what, name);
    if (find_entry(m->params, m->nparams, name) || find_entry(m->buffers, m->nbuffers, name) ||
        find_child(m, name, strlen(name)))
        return ag__err(AG_EINVAL, "%s: attribute '%s' already exists in %s", what, name, m->type);
    return 0;
}

/* A NULL argument (a tensor or module) after a failed constructor keeps that constructor's
 * message, so that chains like ag_nn_append(seq, ag_nn_linear(...)) report the first error. */
static int null_arg(const char *what, const char *noun, const char *name) {
    if (ag__has_error() && ag_last_status() < 0)
        return ag_last_status();
    if (!name)
        return ag__err(AG_EINVAL, "%s: %s is NULL", what, noun);
    return ag__err(AG_EINVAL, "%s: %s '%s' is NULL", what, noun, name);
}

static int add_entry(nn_entry **e, int64_t *n, int64_t *cap, const char *name, ag_tensor *t,
                     bool persistent) {
    char *nm = ag__strdup(name);
    if (!nm || ag__grow((void **)e, cap, *n + 1, sizeof **e)) {
        ag__free(nm);
        return AG_ENOMEM;
    }
    ag__tensor_retain(t);
    (*e)[(*n)++] = (nn_entry){nm, t, persistent};
    return 0;
}

int ag_module_register_parameter(ag_module *m, const char *name, ag_tensor *t) {
    int rc = check_name(m, "module_register_parameter", name);
    if (rc)
        return rc;
    if (!t)
        return null_arg("module_register_parameter", "parameter", name);
    if (t->grad_fn)
        return ag__err(AG_EINVAL,
                       "register_parameter: cannot assign a non-leaf tensor to parameter '%s' "
                       "(it was produced by an op; detach it first)",
                       name);
    if (!ag_dtype_is_float(t->dtype))
        return ag__err(AG_EINVAL,
                       "register_parameter: parameter '%s' must be floating point, not %s", name,
                       ag_dtype_short(t->dtype));
    rc = add_entry(&m->params, &m->nparams, &m->cap_params, name, t, true);
    if (rc)
        return rc;
    t->requires_grad = true; /* cannot fail now: a float leaf */
    touch(m);
    return 0;
}

int ag_module_register_buffer(ag_module *m, const char *name, ag_tensor *t, bool persistent) {
    int rc = check_name(m, "module_register_buffer", name);
    if (rc)
        return rc;
    if (!t)
        return null_arg("module_register_buffer", "buffer", name);
    rc = add_entry(&m->buffers, &m->nbuffers, &m->cap_buffers, name, t, persistent);
    if (rc == 0)
        touch(m);
    return rc;
}

/* The module owns `child` from here on: it is freed when this fails. */
int ag_module_add_child(ag_module *m, const char *name, ag_module *child) {
    int rc;
    if (!child) {
        rc = null_arg("module_add_child", "child", name);
    } else if (child->parent) {
        /* Owned by another module: freeing it here would break that one; leave it alone. */
        return ag__err(AG_EINVAL, "add_child: module '%s' (%s) already has a parent",
                       name ? name : "?", child->type);
    } else if ((rc = check_name(m, "module_add_child", name)) == 0) {
        for (const ag_module *a = m; a; a = a->parent)
            if (a == child) {
                /* A cycle: the tree would own itself. Freeing child would free m too. */
                return ag__err(AG_EINVAL, "add_child: adding '%s' would make a cycle", name);
            }
        char *nm = ag__strdup(name);
        if (!nm || ag__grow((void **)&m->children, &m->cap_children, m->nchildren + 1,
                            sizeof *m->children)) {
            ag__free(nm);
            rc = AG_ENOMEM;
        } else {
            m->children[m->nchildren++] = (nn_child){nm, child};
            child->parent = m;
            touch(m);
            return 0;
        }
    }
    ag_module_free(child);
    return rc;
}

void *ag_module_ud(const ag_module *m) {
    return m ? m->ud : NULL;
}
const char *ag_module_type(const ag_module *m) {
    return m ? m->type : NULL;
}

/* ---- lookups ---- */

/* The name m is registered under in its parent ("" for a root). */
static const char *module_name_in_parent(const ag_module *m) {
    const ag_module *p = m->parent;
    for (int64_t i = 0; p && i < p->nchildren; i++)
        if (p->children[i].m == m)
            return p->children[i].name;
    return "";
}

ag_module *ag_module_child(const ag_module *m, const char *path) {
    if (!m || !path)
        return NULL;
    const ag_module *cur = m;
    const char *s = path;
    while (*s) {
        const char *dot = strchr(s, '.');
        size_t len = dot ? (size_t)(dot - s) : strlen(s);
        cur = find_child(cur, s, len);
        if (!cur)
            return NULL;
        s += len;
        if (*s == '.')
            s++;
    }
    return (ag_module *)cur;
}

/* Splits "a.b.name" into the module at "a.b" (*owner when owner is not NULL) and "name". */
static const nn_entry *lookup_in(const ag_module *m, const char *fqn, bool param,
                                 ag_module **owner_out) {
    if (!m || !fqn)
        return NULL;
    const char *dot = strrchr(fqn, '.');
    const ag_module *owner = m;
    const char *leaf = fqn;
    if (dot) {
        size_t plen = (size_t)(dot - fqn);
        char path[512];
        if (plen >= sizeof path)
            return NULL;
        memcpy(path, fqn, plen);
        path[plen] = 0;
        owner = ag_module_child(m, path);
        leaf = dot + 1;
        if (!owner)
            return NULL;
    }
    if (owner_out)
        *owner_out = (ag_module *)owner;
    return param ? find_entry(owner->params, owner->nparams, leaf)
                 : find_entry(owner->buffers, owner->nbuffers, leaf);
}

static const nn_entry *lookup(const ag_module *m, const char *fqn, bool param) {
    return lookup_in(m, fqn, param, NULL);
}

ag_tensor *ag_module_param(const ag_module *m, const char *fqn) {
    const nn_entry *e = lookup(m, fqn, true);
    return e ? e->t : NULL;
}

ag_tensor *ag_module_buffer(const ag_module *m, const char *fqn) {
    const nn_entry *e = lookup(m, fqn, false);
    return e ? e->t : NULL;
}

ag_tensor *ag__module_swap_tensor(ag_module *m, const char *fqn, bool param, ag_tensor *t) {
    ag_module *owner = NULL;
    nn_entry *e = (nn_entry *)lookup_in(m, fqn, param, &owner);
    if (!e)
        return NULL;
    ag_tensor *old = e->t;
    e->t = t;
    touch(owner);
    return old;
}

int ag_module_num_children(const ag_module *m) {
    return m ? (int)m->nchildren : 0;
}

ag_module *ag_module_child_at(const ag_module *m, int i, const char **name) {
    if (!m || i < 0 || i >= m->nchildren)
        return NULL;
    if (name)
        *name = m->children[i].name;
    return m->children[i].m;
}

/* ---- named_parameters / named_buffers ---- */

typedef struct nt_builder {
    ag_named_tensors *out;
    int64_t cap_names, cap_tensors;
    bool dedup;
    char *prefix; /* the dotted path of the module being walked, built in place */
    int64_t prefix_cap;
} nt_builder;

static bool nt_contains(const ag_named_tensors *nt, const ag_tensor *t) {
    for (int i = 0; i < nt->n; i++)
        if (nt->tensors[i] == t)
            return true;
    return false;
}

/* Adds prefix.name (lp: the prefix's length). */
static int nt_push(nt_builder *b, size_t lp, const char *name, ag_tensor *t) {
    ag_named_tensors *o = b->out;
    if (b->dedup && nt_contains(o, t))
        return 0;
    size_t ln = strlen(name);
    char *fqn = ag__malloc(lp + ln + 2);
    if (!fqn)
        return AG_ENOMEM;
    if (lp) {
        memcpy(fqn, b->prefix, lp);
        fqn[lp] = '.';
        memcpy(fqn + lp + 1, name, ln + 1);
    } else {
        memcpy(fqn, name, ln + 1);
    }
    if (ag__grow((void **)&o->names, &b->cap_names, o->n + 1, sizeof *o->names) ||
        ag__grow((void **)&o->tensors, &b->cap_tensors, o->n + 1, sizeof *o->tensors)) {
        ag__free(fqn);
        return AG_ENOMEM;
    }
    o->names[o->n] = fqn;
    o->tensors[o->n] = t;
    o->n++;
    return 0;
}

enum { WALK_PARAMS = 1, WALK_BUFFERS = 2, WALK_PERSISTENT_ONLY = 4 };

/* Pre-order: a module's own entries, then each child's subtree, as PyTorch's named_modules()
 * + _named_members() do. b->prefix holds m's path (lp characters); a child's path is written
 * after it and cut off again. */
static int walk(const ag_module *m, size_t lp, int what, nt_builder *b) {
    int rc = 0;
    if (what & WALK_PARAMS)
        for (int64_t i = 0; i < m->nparams && !rc; i++)
            rc = nt_push(b, lp, m->params[i].name, m->params[i].t);
    if (what & WALK_BUFFERS)
        for (int64_t i = 0; i < m->nbuffers && !rc; i++)
            if (!(what & WALK_PERSISTENT_ONLY) || m->buffers[i].persistent)
                rc = nt_push(b, lp, m->buffers[i].name, m->buffers[i].t);
    for (int64_t i = 0; i < m->nchildren && !rc; i++) {
        const char *cn = m->children[i].name;
        size_t lc = strlen(cn), ls = lp + (lp ? 1 : 0) + lc;
        if (ag__grow((void **)&b->prefix, &b->prefix_cap, (int64_t)ls + 1, 1))
            return AG_ENOMEM;
        if (lp)
            b->prefix[lp] = '.';
        memcpy(b->prefix + ls - lc, cn, lc + 1);
        rc = walk(m->children[i].m, ls, what, b);
    }
    return rc;
}

void ag_named_tensors_free(ag_named_tensors *nt) {
    if (!nt)
        return;
    for (int i = 0; i < nt->n; i++)
        ag__free(nt->names[i]);
    ag__free(nt->names);
    ag__free(nt->tensors);
    memset(nt, 0, sizeof *nt);
}

static int named(const ag_module *m, int what, bool dedup, ag_named_tensors *out, const char *fn) {
    AG__CHECK_NULL(fn, out);
    memset(out, 0, sizeof *out);
    AG__CHECK_NULL(fn, m);
    nt_builder b = {.out = out, .dedup = dedup};
    int rc = walk(m, 0, what, &b);
    ag__free(b.prefix);
    if (rc)
        ag_named_tensors_free(out);
    return rc;
}

int ag_module_named_parameters(const ag_module *m, bool remove_duplicate, ag_named_tensors *out) {
    return named(m, WALK_PARAMS, remove_duplicate, out, "module_named_parameters");
}

int ag_module_named_buffers(const ag_module *m, bool remove_duplicate, ag_named_tensors *out) {
    return named(m, WALK_BUFFERS, remove_duplicate, out, "module_named_buffers");
}

static int64_t flat_walk(const ag_module *m, bool params, ag_tensor **out, int64_t cap, int64_t n) {
    const nn_entry *e = params ? m->params : m->buffers;
    int64_t ne = params ? m->nparams : m->nbuffers;
    for (int64_t i = 0; i < ne; i++, n++)
        if (n < cap)
            out[n] = e[i].t;
    for (int64_t i = 0; i < m->nchildren; i++)
        n = flat_walk(m->children[i].m, params, out, cap, n);
    return n;
}

int64_t ag__module_flat_tensors(const ag_module *m, ag_tensor **out, int64_t cap) {
    int64_t n = flat_walk(m, true, out, cap, 0);
    return flat_walk(m, false, out, cap, n);
}

/* The path being visited, built in place: on the stack while it fits, else on the heap. */
typedef struct visit {
    ag__module_tensor_fn fn;
    void *ud;
    char *path;
    size_t cap;
    bool heap;
} visit;

/* Writes the name after the first lp characters of the path (with a '.' when lp > 0);
 * returns the new length, or 0 when out of memory. */
static size_t visit_name(visit *v, size_t lp, const char *name) {
    size_t ln = strlen(name), need = lp + (lp ? 1 : 0) + ln + 1;
    if (need > v->cap) {
        size_t cap = need * 2;
        char *p = ag__malloc(cap);
        if (!p)
            return 0;
        memcpy(p, v->path, lp);
        if (v->heap)
            ag__free(v->path);
        v->path = p;
        v->cap = cap;
        v->heap = true;
    }
    if (lp)
        v->path[lp] = '.';
    memcpy(v->path + need - 1 - ln, name, ln + 1);
    return need - 1;
}

static int visit_walk(const ag_module *m, size_t lp, bool params, visit *v) {
    const nn_entry *e = params ? m->params : m->buffers;
    int64_t ne = params ? m->nparams : m->nbuffers;
    int rc = 0;
    for (int64_t i = 0; i < ne && rc == 0; i++)
        rc = visit_name(v, lp, e[i].name) ? v->fn(v->ud, v->path, e[i].t, params) : AG_ENOMEM;
    for (int64_t i = 0; i < m->nchildren && rc == 0; i++) {
        size_t lc = visit_name(v, lp, m->children[i].name);
        rc = lc ? visit_walk(m->children[i].m, lc, params, v) : AG_ENOMEM;
    }
    return rc;
}

int ag__module_visit_tensors(const ag_module *m, ag__module_tensor_fn fn, void *ud) {
    char buf[256];
    visit v = {.fn = fn, .ud = ud, .path = buf, .cap = sizeof buf};
    int rc = visit_walk(m, 0, true, &v);
    if (rc == 0)
        rc = visit_walk(m, 0, false, &v);
    if (v.heap)
        ag__free(v.path);
    return rc;
}

int ag__nn_state_tensors(const ag_module *m, bool remove_duplicate, ag_named_tensors *out) {
    if (!out)
        return ag__err(AG_EINVAL, "state_tensors: NULL output");
    memset(out, 0, sizeof *out);
    if (!m)
        return ag__err(AG_EINVAL, "state_tensors: NULL module");
    nt_builder b = {.out = out, .dedup = remove_duplicate};
    int rc = walk(m, 0, WALK_PARAMS, &b);
    if (!rc)
        rc = walk(m, 0, WALK_BUFFERS | WALK_PERSISTENT_ONLY, &b);
    ag__free(b.prefix);
    if (rc)
        ag_named_tensors_free(out);
    return rc;
}

/* Returns the element count, or a negative status when the list cannot be built. */
int64_t ag_module_num_parameters(const ag_module *m) {
    AG__CHECK_NULL("module_num_parameters", m);
    ag_named_tensors nt;
    int rc = ag_module_named_parameters(m, true, &nt);
    if (rc)
        return rc;
    int64_t n = 0;
    for (int i = 0; i < nt.n; i++)
        n += ag_tensor_numel(nt.tensors[i]);
    ag_named_tensors_free(&nt);
    return n;
}

/* ---- modes ---- */

void ag_module_train(ag_module *m, bool training) {
    if (!m)
        return;
    m->training = training;
    for (int64_t i = 0; i < m->nchildren; i++)
        ag_module_train(m->children[i].m, training);
}

bool ag_module_is_training(const ag_module *m) {
    return m && m->training;
}

int ag_module_set_checkpoint(ag_module *m, bool on) {
    AG__CHECK_NULL("module_set_checkpoint", m);
    if (on && !m->forward)
        return ag__err(AG_EINVAL,
                       "%s: a module without a forward (a container) cannot be checkpointed; "
                       "checkpoint its children",
                       m->type);
    m->checkpoint = on;
    return 0;
}

bool ag_module_is_checkpointed(const ag_module *m) {
    return m && m->checkpoint;
}

int ag_module_set_compile_region(ag_module *m, bool on) {
    AG__CHECK_NULL("module_set_compile_region", m);
    if (on && !m->forward)
        return ag__err(AG_EINVAL,
                       "%s: a module without a forward (a container) cannot be a compile "
                       "region; mark its children",
                       m->type);
    m->compile_region = on;
    return 0;
}

bool ag_module_is_compile_region(const ag_module *m) {
    return m && m->compile_region;
}

/* ag_checkpoint's function for a checkpointed module: its own forward. */
static int checkpointed_forward(void *ud, ag_tensor *const *in, int nin, ag_tensor **out,
                                int max_out) {
    ag_module *m = ud;
    return m->forward(m, in, nin, out, max_out);
}

/* m's forward, through ag_checkpoint when m is checkpointed (not as a compile region: this is
 * also the body a region traces, trace/region_trace.c, so a checkpointed region's subgraphs
 * carry the checkpoint's recompute tags). */
int ag__module_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    if (!m->forward)
        return ag__err(AG_EINVAL, "%s: this module has no forward", m->type);
    if (m->checkpoint)
        return ag_checkpoint(checkpointed_forward, m, in, nin, out, max_out);
    return m->forward(m, in, nin, out, max_out);
}

/* m's forward: under tracing as a nested compile region (trace/region_trace.c), else as it is
 * (checkpointed if m is: upstream's nested_compile_region around a checkpointed function). */
static int region_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out,
                          int max_out) {
    if (!ag__tls()->tracing || !ag__region_hook)
        return ag__module_forward(m, in, nin, out, max_out);
    ag__region r = {.name = m->type,
                    .key = (const void *)(uintptr_t)m->forward,
                    .type = m->type,
                    .module = m,
                    .checkpoint = m->checkpoint,
                    .inputs = in,
                    .nin = nin};
    return ag__region_hook(&r, out, max_out);
}

/* ---- calling ---- */

int ag_module_check_io(const ag_module *m, int nin, int min_in, int max_in, int max_out,
                       int need_out) {
    AG__CHECK_NULL("module_check_io", m);
    if (nin < min_in || nin > max_in) {
        if (min_in == max_in)
            return ag__err(AG_EINVAL, "%s: forward takes %d input%s, %d given", m->type, min_in,
                           min_in == 1 ? "" : "s", nin);
        return ag__err(AG_EINVAL, "%s: forward takes %d to %d inputs, %d given", m->type, min_in,
                       max_in, nin);
    }
    if (max_out < need_out)
        return ag__err(AG_EINVAL, "%s: forward returns %d outputs, room for %d given", m->type,
                       need_out, max_out);
    return 0;
}

int ag_module_return1(ag_tensor *y, ag_tensor **out) {
    if (!out) {
        ag_scope_end();
        return ag__err(AG_EINVAL, "module_return1: out is NULL");
    }
    out[0] = ag_tensor_keep(y);
    ag_scope_end();
    return y ? 1 : ag__nn_status();
}

ag_tensor *ag_module_forward_child(ag_module *m, const char *name, ag_tensor *x) {
    if (!m)
        return null_arg("module_forward_child", "m", NULL), NULL;
    if (!name)
        return null_arg("module_forward_child", "name", NULL), NULL;
    ag_module *c = ag_module_child(m, name);
    if (!c)
        return ag__err(AG_EINVAL, "%s: no child module '%s'", m->type, name), NULL;
    return ag_module_forward(c, x);
}

/* ---- default dtype ---- */

static _Thread_local ag_dtype default_dtype = AG_F32;

int ag_set_default_dtype(ag_dtype dt) {
    if (dt != AG_F32 && dt != AG_F64)
        return ag__err(AG_EINVAL,
                       "set_default_dtype: only floating point dtypes (f32, f64) are "
                       "supported as default, got %d",
                       (int)dt);
    default_dtype = dt;
    return 0;
}

ag_dtype ag_get_default_dtype(void) {
    return default_dtype;
}

/* ---- module calls seen by a tracer ---- */

static _Thread_local const ag__module_observer *observer;

const ag__module_observer *ag__module_set_observer(const ag__module_observer *obs) {
    const ag__module_observer *prev = observer;
    observer = obs;
    return prev;
}

static int module_enter(const ag_module *m) {
    return observer ? observer->enter(observer->ud, m) : 0;
}

static void module_exit(const ag_module *m) {
    if (observer)
        observer->exit(observer->ud, m);
}

char *ag__module_path(const ag_module *root, const ag_module *m) {
    size_t len = 0;
    const ag_module *c = m;
    for (; c && c != root; c = c->parent)
        len += strlen(module_name_in_parent(c)) + 1;
    if (c != root)
        return NULL; /* m is not inside root */
    char *path = ag__malloc(len + 1);
    if (!path)
        return NULL;
    path[len > 0 ? len - 1 : 0] = 0;
    size_t end = len > 0 ? len - 1 : 0; /* written right to left: innermost name last */
    for (c = m; c != root; c = c->parent) {
        const char *name = module_name_in_parent(c);
        size_t n = strlen(name);
        end -= n;
        memcpy(path + end, name, n);
        if (end > 0)
            path[--end] = '.';
    }
    return path;
}

/* Runs m's forward (which stores new references) and hands the outputs to the caller's open
 * scope, if any. A forward that fails must store nothing. */
int ag_module_call(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    if (out)
        for (int i = 0; i < max_out; i++)
            out[i] = NULL;
    if (!m)
        return null_arg("module_call", "m", NULL);
    AG__CHECK_NULL("module_call", out);
    if (nin > 0)
        AG__CHECK_NULL("module_call", in);
    if (!m->forward)
        return ag__err(AG_EINVAL,
                       "%s: this module has no forward (it is a container: call its children)",
                       m->type);
    if (!out || max_out < 1)
        return ag__err(AG_EINVAL, "%s: no room for outputs (max_out %d)", m->type, max_out);
    if (nin < 0 || (nin > 0 && !in))
        return ag__err(AG_EINVAL, "%s: bad input list", m->type);
    for (int i = 0; i < nin; i++)
        if (!in[i]) {
            if (ag__has_error() && ag_last_status() < 0)
                return ag_last_status();
            return ag__err(AG_EINVAL, "%s: input %d is NULL", m->type, i);
        }
    /* The caller's site becomes an outer stack frame for the ops the forward runs. */
    ag_site_push();
    int n = module_enter(m);
    if (n == 0) {
        /* a compile region that is also checkpointed: the region around the checkpoint */
        n = m->compile_region ? region_forward(m, in, nin, out, max_out)
                              : ag__module_forward(m, in, nin, out, max_out);
        module_exit(m);
    }
    ag_site_pop();
    if (n < 0) {
        for (int i = 0; i < max_out; i++)
            out[i] = NULL;
        return n;
    }
    if (n > max_out) {
        /* A forward broke its contract; we cannot know what it stored past max_out. */
        return ag__err(AG_EINVAL, "%s: forward returned %d outputs, room for %d", m->type, n,
                       max_out);
    }
    for (int i = 0; i < n; i++) {
        if (!out[i]) {
            for (int k = i + 1; k < n; k++)
                ag_tensor_free(out[k]);
            for (int k = 0; k < max_out; k++)
                out[k] = NULL;
            return ag__err(AG_EINVAL, "%s: forward returned NULL output %d", m->type, i);
        }
        out[i] = ag__give(out[i]);
        if (!out[i]) { /* the scope could not grow; out[i] was released */
            for (int k = i + 1; k < n; k++)
                ag_tensor_free(out[k]);
            for (int k = 0; k < max_out; k++)
                out[k] = NULL;
            return AG_ENOMEM;
        }
    }
    return n;
}

ag_tensor *ag_module_forward(ag_module *m, ag_tensor *x) {
    if (!m)
        return null_arg("module_forward", "m", NULL), NULL;
    if (!x)
        return null_arg("module_forward", "x", NULL), NULL;
    ag_tensor *y = NULL;
    int n = ag_module_call(m, &x, 1, &y, 1);
    if (n == 0) {
        ag__err(AG_EINVAL, "%s: forward returned no output", m->type);
        return NULL;
    }
    return n < 0 ? NULL : y;
}

/* ---- creating parameters and buffers ---- */

int ag_module_add_tensor(ag_module *m, const char *name, bool param, ag_dtype dt, int ndim,
                         const int64_t *sizes, ag_init init, double a, double b) {
    int rc = check_name(m, "module_add_tensor", name);
    if (rc)
        return rc;
    if (ndim < 0 || ndim > AG_MAX_DIMS || (ndim > 0 && !sizes) || (int)dt < 0 || dt >= AG_NDTYPES)
        return ag__err(AG_EINVAL, "module_add_tensor: '%s': bad dtype %d or ndim %d (sizes %s)",
                       name, (int)dt, ndim, sizes ? "given" : "NULL");
    if ((int)init < AG_INIT_ZEROS || init > AG_INIT_NORMAL)
        return ag__err(AG_EINVAL, "module_add_tensor: '%s': unknown init %d", name, (int)init);
    if ((init == AG_INIT_UNIFORM || init == AG_INIT_NORMAL) && !ag_dtype_is_float(dt))
        return ag__err(AG_EINVAL, "module_add_tensor: '%s': random init of a %s tensor", name,
                       ag_dtype_short(dt));
    if (param && !ag_dtype_is_float(dt))
        return ag__err(AG_EINVAL,
                       "module_add_tensor: parameter '%s' must be floating point, not %s", name,
                       ag_dtype_short(dt));
    /* In meta mode (ag_set_meta_mode) the tensor gets no data and there is nothing to fill:
     * a model the size of GPT-2 small can be built for tracing without its weights. */
    bool meta = ag__tls()->tracing;
    ag_tensor *t = ag__tensor_new(dt, ndim, sizes, meta);
    if (!t)
        return ag_last_status();
    int64_t n = ag_tensor_numel(t);
    void *p = ag_tensor_data(t);
    if (!meta) {
        switch (init) {
        case AG_INIT_ZEROS:
            memset(p, 0, (size_t)n * ag_dtype_size(dt));
            break;
        case AG_INIT_ONES:
            for (int64_t i = 0; i < n; i++) {
                if (dt == AG_F32)
                    ((float *)p)[i] = 1.0f;
                else if (dt == AG_F64)
                    ((double *)p)[i] = 1.0;
                else if (dt == AG_I64)
                    ((int64_t *)p)[i] = 1;
                else if (dt == AG_I8)
                    ((int8_t *)p)[i] = 1;
                else
                    ((bool *)p)[i] = true;
            }
            break;
        case AG_INIT_UNIFORM:
        case AG_INIT_NORMAL: {
            /* Drawn by the ops so that the generator's stream is the one every op uses. */
            bool prev = ag_set_grad_enabled(false);
            ag_scope_begin();
            ag_tensor *r = init == AG_INIT_UNIFORM ? ag_uniform_(t, a, b) : ag_normal_(t, a, b);
            if (!r)
                rc = ag__nn_status();
            ag_scope_end();
            ag_set_grad_enabled(prev);
            break;
        }
        }
    }
    if (!rc)
        rc = param ? ag_module_register_parameter(m, name, t)
                   : ag_module_register_buffer(m, name, t, true);
    ag_tensor_free(t);
    return rc;
}

/* ---- module.to(dtype) ---- */

/* One tensor to convert and its converted copy (whose storage it takes at the commit). */
typedef struct conv_item {
    ag_tensor *t, *fresh;
    const char *what, *name; /* for messages: "parameter"/"buffer"/"gradient of", the fqn */
} conv_item;

typedef struct conv_list {
    conv_item *items;
    int64_t n, cap;
} conv_list;

static int conv_add(conv_list *l, ag_tensor *t, ag_dtype dt, const char *what, const char *name) {
    if (!t || !ag_dtype_is_float(t->dtype) || t->dtype == dt)
        return 0;
    for (int64_t i = 0; i < l->n; i++)
        if (l->items[i].t == t)
            return 0; /* tied: converted once, both names keep the one tensor */
    if (t->grad_fn)
        return ag__err(AG_EINVAL,
                       "module_to_dtype: %s '%s' has autograd history (%s); only leaves "
                       "convert",
                       what, name, ag_tensor_grad_fn_name(t));
    if (t->is_view || t->base || t->sub)
        return ag__err(AG_EINVAL,
                       "module_to_dtype: %s '%s' is a %s; it cannot change dtype in place", what,
                       name, t->sub ? "tensor subclass instance" : "view of another tensor");
    if (ag__grow((void **)&l->items, &l->cap, l->n + 1, sizeof *l->items))
        return AG_ENOMEM;
    l->items[l->n++] = (conv_item){t, NULL, what, name};
    return 0;
}

/* fresh = t converted to dt (contiguous; data-less when t has none). */
static ag_tensor *conv_copy(ag_tensor *t, ag_dtype dt) {
    bool meta = !t->storage->data;
    ag_tensor *f = ag__tensor_new(dt, t->ndim, t->sizes, meta);
    if (!f || meta)
        return f;
    int64_t n = ag_tensor_numel(t);
    void *dst = ag_tensor_data(f);
    if (ag_tensor_is_contiguous(t)) {
        const void *src = ag_tensor_data(t);
        if (t->dtype == AG_F32 && dt == AG_F64)
            for (int64_t i = 0; i < n; i++)
                ((double *)dst)[i] = ((const float *)src)[i];
        else if (t->dtype == AG_F64 && dt == AG_F32)
            for (int64_t i = 0; i < n; i++)
                ((float *)dst)[i] = (float)((const double *)src)[i];
        return f;
    }
    (void)ag_tensor_data(t); /* completes pending collectives writing it */
    for (int64_t i = 0; i < n; i++) {
        double v = ag__get_f64(t, i);
        if (dt == AG_F64)
            ((double *)dst)[i] = v;
        else
            ((float *)dst)[i] = (float)v;
    }
    return f;
}

int ag_module_to_dtype(ag_module *m, ag_dtype dt) {
    AG__CHECK_NULL("module_to_dtype", m);
    if (dt != AG_F32 && dt != AG_F64)
        return ag__err(AG_EINVAL,
                       "module_to_dtype: nn.Module.to only accepts floating point "
                       "dtypes (f32, f64), got %s",
                       (int)dt >= 0 && dt < AG_NDTYPES ? ag_dtype_short(dt) : "an unknown dtype");
    ag_named_tensors ps = {0}, bs = {0};
    conv_list l = {0};
    int rc = ag_module_named_parameters(m, true, &ps);
    if (!rc)
        rc = ag_module_named_buffers(m, true, &bs);
    for (int i = 0; i < ps.n && !rc; i++) {
        rc = conv_add(&l, ps.tensors[i], dt, "parameter", ps.names[i]);
        if (!rc && ps.tensors[i]->grad)
            rc = conv_add(&l, ps.tensors[i]->grad, dt, "gradient of", ps.names[i]);
    }
    for (int i = 0; i < bs.n && !rc; i++)
        rc = conv_add(&l, bs.tensors[i], dt, "buffer", bs.names[i]);
    /* Every copy first: a failure here leaves the module as it was. */
    for (int64_t i = 0; i < l.n && !rc; i++)
        if (!(l.items[i].fresh = conv_copy(l.items[i].t, dt)))
            rc = ag__nn_status();
    if (!rc) {
        /* Commit: each tensor takes its copy's storage; the copy takes (and frees) the old. A
         * saved reference to the old values (an autograd graph not run yet) sees a new version
         * and refuses to use them, as after an in-place change. */
        for (int64_t i = 0; i < l.n; i++) {
            ag_tensor *t = l.items[i].t, *f = l.items[i].fresh;
            ag_storage *old = t->storage;
            f->storage->version = old->version + 1;
            t->storage = f->storage;
            f->storage = old;
            f->dtype = t->dtype; /* the old storage is released with its own byte count */
            t->dtype = dt;
            t->offset = 0;
            memcpy(t->strides, f->strides, sizeof t->strides);
        }
        if (l.n)
            touch(m);
    }
    for (int64_t i = 0; i < l.n; i++)
        ag_tensor_free(l.items[i].fresh);
    ag__free(l.items);
    ag_named_tensors_free(&ps);
    ag_named_tensors_free(&bs);
    return rc;
}
