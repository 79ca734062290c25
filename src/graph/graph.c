/* The graph IR (include/aotgrad/graph.h): nodes in a doubly linked list, their arguments and
 * users, FX-style naming, and the mutation API that passes use.
 *
 * In: node creation calls from the tracer, the parser and passes. Out: a graph that the
 * printer, verifier, interpreter and later stages read. Invariants kept by every function
 * here: names are unique; each node's users list holds exactly the nodes whose arguments
 * reference it (with a use count per user); the output node, if any, is last. A node's
 * metadata entries and the strings they hold live in node_meta.c. */
#include "graph_internal.h"
#include "../core/asan.h"

#include <assert.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>

/* ---- small helpers ---- */

static const char *const python_builtins[] = {
    /* Names FX will not give a node as-is (keywords and builtins that ops are named after or
     * that could plausibly collide); they start at _1. */
    "abs",    "all",      "any",   "bin",    "bool",     "bytes", "chr",    "dict",   "dir",
    "divmod", "filter",   "float", "format", "hash",     "hex",   "id",     "input",  "int",
    "iter",   "len",      "list",  "map",    "max",      "min",   "next",   "object", "oct",
    "open",   "ord",      "pow",   "print",  "range",    "repr",  "round",  "set",    "slice",
    "sorted", "str",      "sum",   "super",  "tuple",    "type",  "vars",   "zip",    "and",
    "as",     "assert",   "break", "class",  "continue", "def",   "del",    "elif",   "else",
    "except", "finally",  "for",   "from",   "global",   "if",    "import", "in",     "is",
    "lambda", "nonlocal", "not",   "or",     "pass",     "raise", "return", "try",    "while",
    "with",   "yield",    "None",  "True",   "False",    "self",
};

static bool illegal_name(const char *s) {
    /* Every entry is 2 to 8 letters: most names (getitem_3, add_1) are out after a few bytes. */
    size_t n = 0;
    for (; s[n]; n++)
        if (n == 8 || !((s[n] >= 'a' && s[n] <= 'z') || (s[n] >= 'A' && s[n] <= 'Z')))
            return false;
    for (size_t i = 0; i < sizeof python_builtins / sizeof python_builtins[0]; i++)
        if (python_builtins[i][0] == s[0] && !strcmp(s, python_builtins[i]))
            return true;
    return false;
}

int ag__garg_copy(ag_garg *dst, const ag_garg *src) {
    *dst = *src;
    if (src->kind == AG_GA_INTS) {
        int64_t *v = ag__malloc(sizeof(int64_t) * (size_t)(src->n ? src->n : 1));
        if (!v)
            return AG_ENOMEM;
        if (src->n)
            memcpy(v, src->u.ints, sizeof(int64_t) * (size_t)src->n);
        dst->u.ints = v;
    } else if (src->kind == AG_GA_NODES) {
        ag_node **v = ag__malloc(sizeof(ag_node *) * (size_t)(src->n ? src->n : 1));
        if (!v)
            return AG_ENOMEM;
        if (src->n)
            memcpy(v, src->u.nodes, sizeof(ag_node *) * (size_t)src->n);
        dst->u.nodes = v;
    } else if (src->kind == AG_GA_STR) {
        dst->u.s = ag__strdup(src->u.s ? src->u.s : "");
        if (!dst->u.s)
            return AG_ENOMEM;
    } else if (src->kind == AG_GA_TUPLE || src->kind == AG_GA_DICT) {
        return ag__garg_agg_copy(dst, src);
    }
    return 0;
}

void ag__garg_free(ag_garg *a) {
    if (a->kind == AG_GA_INTS)
        ag__free((void *)a->u.ints);
    else if (a->kind == AG_GA_NODES)
        ag__free(a->u.nodes);
    else if (a->kind == AG_GA_STR)
        ag__free((void *)a->u.s);
    else if (a->kind == AG_GA_TUPLE || a->kind == AG_GA_DICT)
        ag__garg_agg_free(a);
    a->kind = AG_GA_NONE;
}

/* ---- users ---- */

/* `fresh`: user is a node being committed, so it can only be def's last user already (from
 * an earlier argument of its own) and the list need not be searched. */
static int add_use(ag_node *def, ag_node *user, bool fresh) {
    if (def->nusers > 0 && def->users[def->nusers - 1].node == user) {
        def->users[def->nusers - 1].count++;
        return 0;
    }
    for (int i = 0; !fresh && i < def->nusers; i++)
        if (def->users[i].node == user) {
            def->users[i].count++;
            return 0;
        }
    if (def->nusers == def->users_cap) {
        /* Most values have one or two users: the list starts inside the node. */
        int ncap = def->users_cap ? 2 * def->users_cap : AG__USERS_INLINE;
        ag__use *nu =
            ncap == AG__USERS_INLINE ? def->users_inline : ag__malloc(sizeof *nu * (size_t)ncap);
        if (!nu)
            return AG_ENOMEM;
        if (def->nusers)
            memcpy(nu, def->users, sizeof *nu * (size_t)def->nusers);
        if (def->users && def->users != def->users_inline) /* NULL: the first user */
            ag__free(def->users);
        def->users = nu;
        def->users_cap = ncap;
    }
    assert(def->nusers < def->users_cap);
    assert((def->users == def->users_inline) == (def->users_cap == AG__USERS_INLINE));
    def->users[def->nusers++] = (ag__use){user, 1};
    return 0;
}

static void drop_use(ag_node *def, ag_node *user) {
    for (int i = def->nusers - 1; i >= 0; i--) /* the latest users go first (DCE erases them) */
        if (def->users[i].node == user) {
            assert(def->users[i].count > 0);
            if (--def->users[i].count == 0) {
                memmove(&def->users[i], &def->users[i + 1],
                        sizeof *def->users * (size_t)(def->nusers - i - 1));
                def->nusers--;
            }
            return;
        }
    assert(!"drop_use: the user is not in the definition's user list");
}

/* Registers (or, with add=false, unregisters) the uses made by one argument. On failure while
 * adding, the uses added so far are undone. */
static int arg_uses_ex(ag_node *user, const ag_garg *a, bool add, bool fresh) {
    if (a->kind == AG_GA_NODE && a->u.node) {
        if (!add) {
            drop_use(a->u.node, user);
            return 0;
        }
        return add_use(a->u.node, user, fresh);
    }
    if (a->kind == AG_GA_NODES || a->kind == AG_GA_TUPLE)
        for (int k = 0, cnt = ag__garg_nrefs(a); k < cnt; k++) {
            ag_node *d = ag__garg_ref(a, k);
            if (!d)
                continue;
            if (!add) {
                drop_use(d, user);
            } else if (add_use(d, user, fresh)) {
                for (int j = 0; j < k; j++)
                    if (ag__garg_ref(a, j))
                        drop_use(ag__garg_ref(a, j), user);
                return AG_ENOMEM;
            }
        }
    return 0;
}

static int arg_uses(ag_node *user, const ag_garg *a, bool add) {
    return arg_uses_ex(user, a, add, false);
}

#ifndef NDEBUG
/* How many references of user's arguments point at def. */
static int refs_to(const ag_node *user, const ag_node *def) {
    int c = 0;
    for (int i = 0; i < user->nargs; i++) {
        const ag_garg *a = &user->args[i];
        for (int k = 0, cnt = ag__garg_nrefs(a); k < cnt; k++)
            c += ag__garg_ref(a, k) == def;
    }
    return c;
}

/* Debug check: every node user reads lists user with the count of its references (or, once
 * the uses are dropped, not at all). */
static bool uses_match(const ag_node *user, bool dropped) {
    for (int i = 0; i < user->nargs; i++) {
        const ag_garg *a = &user->args[i];
        int k = ag__garg_nrefs(a);
        for (int e = 0; e < k; e++) {
            const ag_node *d = ag__garg_ref(a, e);
            if (!d)
                continue;
            int listed = 0;
            for (int u = 0; u < d->nusers; u++)
                if (d->users[u].node == user)
                    listed += d->users[u].count;
            if (listed != (dropped ? 0 : refs_to(user, d)))
                return false;
        }
    }
    return true;
}
#endif

/* ---- node memory ---- */

/* node_alloc zeroes the fields, which come first; the inline arrays and val1 come last. */
_Static_assert(offsetof(ag_node, has_out_descs) < offsetof(ag_node, args_inline) &&
                   offsetof(ag_node, val1) > offsetof(ag_node, name_inline),
               "ag_node layout: node_alloc zeroes up to args_inline");

static ag_node *node_alloc(ag_graph *g) {
    ag_node *n = g->free_nodes;
    if (n) {
        AG__UNPOISON(n, sizeof *n);
        g->free_nodes = n->next;
    } else {
        ag__node_block *b = g->blocks;
        if (!b || b->used == b->cap) {
            int cap = !b ? 8 : b->cap < 128 ? 2 * b->cap : 128;
            b = ag__malloc(sizeof *b + sizeof(ag_node) * (size_t)cap);
            if (!b)
                return NULL;
            b->cap = cap;
            b->used = 0;
            b->next = g->blocks;
            g->blocks = b;
        }
        n = &b->nodes[b->used++];
    }
    /* The fields are zeroed; the inline arrays and val1 are not (each is read only below its
     * count: nargs, nusers, nmeta, the name's terminator, nvals), which keeps a new node to
     * the cache lines its header spans. */
    memset(n, 0, offsetof(ag_node, args_inline));
    n->args = n->args_inline;
    return n;
}

/* Room for `count` arguments. */
static int node_args_reserve(ag_node *n, int count) {
    /* Callers check the count (the op's schema, ag_node_set_arg's bound) before. */
    assert(count >= 0 && count <= AG_MAX_ARGS);
    assert(n->nargs <= (n->args == n->args_inline ? AG__ARGS_INLINE : AG_MAX_ARGS));
    if (count <= AG__ARGS_INLINE || n->args != n->args_inline)
        return 0;
    ag_garg *a = ag__malloc(sizeof *a * AG_MAX_ARGS);
    if (!a)
        return AG_ENOMEM;
    memcpy(a, n->args, sizeof *a * (size_t)n->nargs);
    n->args = a;
    return 0;
}

static void node_release(ag_graph *g, ag_node *n) {
    assert(!n->prev && !n->next && g->first != n && g->last != n); /* unlinked first */
    n->next = g->free_nodes;
    g->free_nodes = n;
    AG__POISON(n, sizeof *n);
}

static int node_set_name(ag_node *n, const char *s) {
    size_t len = strlen(s);
    if (len < sizeof n->name_inline) {
        memcpy(n->name_inline, s, len + 1);
        n->name = n->name_inline;
        return 0;
    }
    n->name = ag__strdup(s);
    return n->name ? 0 : AG_ENOMEM;
}

static void node_free_name(ag_node *n) {
    if (n->name != n->name_inline)
        ag__free(n->name);
    n->name = NULL;
}

/* ---- graph ---- */

ag_graph *ag_graph_new(void) {
    ag_graph *g = ag__calloc(1, sizeof *g);
    return g;
}

/* Frees what the node owns (not the node itself). */
static void node_clear(ag_node *n) {
    for (int i = 0; i < n->nargs; i++)
        ag__garg_free(&n->args[i]);
    if (n->args != n->args_inline)
        ag__free(n->args);
    if (n->users && n->users != n->users_inline)
        ag__free(n->users);
    node_free_name(n);
    if (n->vals != &n->val1)
        ag__free(n->vals);
    ag_tensor_free(n->constant);
    ag__meta_entries_free(n->meta, n->nmeta, n->meta_inline);
    ag__meta_entries_free(n->custom, n->ncustom, NULL);
    ag_desc_release(n->desc);
    for (int i = 0; i < n->nout_descs; i++)
        ag_desc_release(n->out_descs[i]);
    ag__free(n->out_descs);
}

static void node_free(ag_node *n) {
    node_clear(n);
    node_release(n->graph, n);
}

void ag_graph_free(ag_graph *g) {
    if (!g)
        return;
    for (ag_node *n = g->first; n; n = n->next)
        node_clear(n);
    for (ag__node_block *b = g->blocks, *next; b; b = next) {
        next = b->next;
        AG__UNPOISON(b, sizeof *b + sizeof(ag_node) * (size_t)b->cap);
        ag__free(b);
    }
    ag__strmap_free(&g->names);
    ag__strmap_free(&g->base_idx);
    ag__strmap_free(&g->shared_strs);
    ag__strpool_release(g->strings);
    for (int i = 0; i < g->nshared; i++)
        ag__strpool_release(g->shared[i]);
    ag__free(g->shared);
    for (int64_t i = 0; i < g->nbases; i++)
        ag__free(g->bases[i].base);
    ag__free(g->bases);
    ag__free(g->ph_cache);
    ag__subgraphs_free(g);
    ag__free(g);
}

int ag_graph_num_nodes(const ag_graph *g) {
    return g ? (int)g->count : 0;
}
ag_node *ag_graph_first(const ag_graph *g) {
    return g ? g->first : NULL;
}
ag_node *ag_graph_last(const ag_graph *g) {
    return g ? g->last : NULL;
}
ag_node *ag_node_next(const ag_node *n) {
    return n ? n->next : NULL;
}
ag_node *ag_node_prev(const ag_node *n) {
    return n ? n->prev : NULL;
}
ag_node *ag_graph_output_node(const ag_graph *g) {
    return g ? g->output : NULL;
}
ag_node *ag_graph_find(const ag_graph *g, const char *name) {
    return g && name ? ag__strmap_get(&g->names, name) : NULL;
}

int ag_graph_placeholders(const ag_graph *g_, ag_node ***out) {
    AG__CHECK_NULL("graph_placeholders", g_);
    AG__CHECK_NULL("graph_placeholders", out);
    ag_graph *g = (ag_graph *)g_;
    int cnt = (int)g->nph;
    int64_t cap = g->ph_cap;
    if (ag__grow((void **)&g->ph_cache, &cap, cnt + 1, sizeof *g->ph_cache))
        return AG_ENOMEM;
    g->ph_cap = cap;
    /* Placeholders normally lead the list, so the walk stops after them. */
    int k = 0;
    for (ag_node *n = g->first; n && k < cnt; n = n->next)
        if (n->kind == AG_NODE_PLACEHOLDER)
            g->ph_cache[k++] = n;
    *out = g->ph_cache;
    return cnt;
}

int ag_node_index(const ag_node *n) {
    if (!n)
        return -1;
    ag_graph *g = n->graph;
    if (g->order_dirty) {
        int i = 0;
        for (ag_node *m = g->first; m; m = m->next)
            m->index = i++;
        assert(i == g->count); /* the count follows the list */
        g->order_dirty = false;
    }
    return n->index;
}

/* ---- names ---- */

/* "<base>_<num>" into out (as snprintf "%s_%lld" would write it; out holds 160 bytes and
 * base at most 127 characters). */
static void fmt_numbered(char *out, const char *base, int64_t num) {
    size_t n = strlen(base);
    memcpy(out, base, n);
    out[n++] = '_';
    char digits[24];
    int k = 0;
    uint64_t u = num < 0 ? (uint64_t)0 - (uint64_t)num : (uint64_t)num;
    do {
        digits[k++] = (char)('0' + u % 10);
        u /= 10;
    } while (u);
    if (num < 0)
        out[n++] = '-';
    while (k)
        out[n++] = digits[--k];
    out[n] = 0;
}

static bool name_in_table(void *g, const char *name) {
    return ag__strmap_has(&((ag_graph *)g)->names, name);
}

static int make_name(ag_graph *g, const char *candidate, char *out) {
    return ag__graph_make_name(g, candidate, name_in_table, g, out);
}

/* A candidate split as FX does: a trailing _<digits> is split off as a counter (*num, else
 * -1), the rest is the base (its characters made legal); the base's counter entry in g (made
 * when new) into *bc_idx. */
static inline __attribute__((always_inline)) int
parse_candidate(ag_graph *g, const char *candidate, char *base, int64_t *num, int64_t *bc_idx) {
    size_t n = 0;
    for (const char *c = candidate; *c && n + 1 < 128; c++)
        base[n++] = (char)((*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') ||
                                   (*c >= '0' && *c <= '9') || *c == '_'
                               ? *c
                               : '_');
    base[n] = 0;
    if (n == 0)
        strcpy(base, "_unnamed");
    if (base[0] >= '0' && base[0] <= '9') {
        memmove(base + 1, base, strlen(base) + 1);
        base[0] = '_';
    }
    *num = -1;
    char *us = strrchr(base, '_');
    if (us && us[1]) {
        bool digits = true;
        for (char *d = us + 1; *d; d++)
            digits &= *d >= '0' && *d <= '9';
        if (digits && us != base) {
            *num = strtoll(us + 1, NULL, 10);
            *us = 0;
        }
    }
    void *bi = ag__strmap_get(&g->base_idx, base);
    if (!bi) {
        int64_t cap = g->bases_cap;
        if (ag__grow((void **)&g->bases, &cap, g->nbases + 1, sizeof *g->bases))
            return AG_ENOMEM;
        g->bases_cap = cap;
        char *b = ag__strdup(base);
        if (!b || ag__strmap_put(&g->base_idx, b, (void *)(intptr_t)(g->nbases + 1))) {
            ag__free(b);
            return AG_ENOMEM;
        }
        g->bases[g->nbases++] = (ag__base_count){b, 0};
        bi = (void *)(intptr_t)g->nbases;
    }
    *bc_idx = (intptr_t)bi - 1;
    return 0;
}

/* The next free name for `candidate` into out (160 bytes), FX's rules: a trailing _<digits> is
 * split off as a counter, and the base keeps its own running count. */
int ag__graph_make_name(ag_graph *g, const char *candidate, bool (*taken)(void *, const char *),
                        void *ctx, char *out) {
    char base[128];
    int64_t num, bi;
    if (parse_candidate(g, candidate, base, &num, &bi))
        return AG_ENOMEM;
    char *cand = out;
    if (num >= 0)
        fmt_numbered(cand, base, num);
    else
        memcpy(cand, base, strlen(base) + 1);
    if (num <= 0)
        num = g->bases[bi].count;
    while (taken(ctx, cand) || illegal_name(cand)) {
        num++;
        fmt_numbered(cand, base, num);
    }
    g->bases[bi].count = num;
    return 0;
}

int ag__graph_name_gen_init(ag_graph *g, const char *candidate, ag__name_gen *ng) {
    int64_t num;
    if (parse_candidate(g, candidate, ng->text, &num, &ng->base))
        return AG_ENOMEM;
    if (num >= 0)
        return 1;
    ng->len = strlen(ng->text);
    ng->illegal = illegal_name(ng->text);
    ng->hash = ag__strhash(ng->text);
    return 0;
}

/* ag__graph_make_name's loop for a candidate without a counter: the base itself, then
 * <base>_<count + 1>, ... (a name with a counter is never a builtin's). */
const char *ag__graph_name_gen_next(ag_graph *g, ag__name_gen *ng,
                                    bool (*taken)(void *, const char *, uint64_t), void *ctx,
                                    uint64_t *hash) {
    int64_t num = g->bases[ng->base].count;
    ng->text[ng->len] = 0;
    uint64_t h = ng->hash;
    bool illegal = ng->illegal;
    while (illegal || taken(ctx, ng->text, h)) {
        num++;
        char *d = ng->text + ng->len;
        *d++ = '_';
        char digits[24];
        int k = 0;
        uint64_t u = (uint64_t)num; /* num > 0: the count starts at 0 */
        do {
            digits[k++] = (char)('0' + u % 10);
            u /= 10;
        } while (u);
        while (k)
            *d++ = digits[--k];
        *d = 0;
        h = ag__strhash(ng->text);
        illegal = false;
    }
    g->bases[ng->base].count = num;
    *hash = h;
    return ng->text;
}

/* ---- node creation ---- */

static void link_at_insert_point(ag_graph *g, ag_node *n) {
    assert(!n->prev && !n->next && g->first != n); /* a new or unlinked node */
    ag_node *before = g->insert_before;
    if (!g->explicit_insert && g->output)
        before = g->output;
    if (g->explicit_insert == 2 && g->insert_after) {
        before = g->insert_after->next;
        g->insert_after = n; /* consecutive inserts keep their order */
    }
    if (before) {
        n->next = before;
        n->prev = before->prev;
        if (before->prev)
            before->prev->next = n;
        else
            g->first = n;
        before->prev = n;
    } else {
        n->prev = g->last;
        if (g->last)
            g->last->next = n;
        else
            g->first = n;
        g->last = n;
    }
    assert(n->prev ? n->prev->next == n : g->first == n);
    assert(n->next ? n->next->prev == n : g->last == n);
    g->count++;
    g->nph += n->kind == AG_NODE_PLACEHOLDER;
    g->order_dirty = true;
}

static void unlink_node(ag_graph *g, ag_node *n) {
    assert(g->count > 0);
    assert(n->prev ? n->prev->next == n : g->first == n);
    assert(n->next ? n->next->prev == n : g->last == n);
    if (n->kind == AG_NODE_PLACEHOLDER)
        g->last_ph = NULL;
    if (n->prev)
        n->prev->next = n->next;
    else
        g->first = n->next;
    if (n->next)
        n->next->prev = n->prev;
    else
        g->last = n->prev;
    n->prev = n->next = NULL;
    g->count--;
    g->nph -= n->kind == AG_NODE_PLACEHOLDER;
    assert(g->nph >= 0 && g->nph <= g->count && (g->count == 0) == (g->first == NULL));
    g->order_dirty = true;
    if (g->insert_before == n)
        g->insert_before = NULL, g->explicit_insert = 0;
    if (g->insert_after == n)
        g->insert_after = NULL, g->explicit_insert = 0;
}

void ag_graph_insert_before(ag_graph *g, ag_node *n) {
    AG__CHECK_NULL_RET("graph_insert_before", g, );
    g->insert_before = n;
    g->insert_after = NULL;
    g->explicit_insert = 1;
}

void ag_graph_insert_after(ag_graph *g, ag_node *n) {
    AG__CHECK_NULL_RET("graph_insert_after", g, );
    g->insert_after = n;
    g->insert_before = NULL;
    g->explicit_insert = 2;
}

void ag_graph_insert_at_end(ag_graph *g) {
    AG__CHECK_NULL_RET("graph_insert_at_end", g, );
    g->insert_before = NULL;
    g->insert_after = NULL;
    g->explicit_insert = 0;
}

/* A node with name and args set up, not yet linked (a given name already taken is refused
 * by node_commit: one probe of the name table). */
static ag_node *node_new(ag_graph *g, ag_node_kind kind, const char *name, const char *candidate) {
    if (name && !*name) {
        ag__err(AG_EINVAL, "graph: a node named '%s' already exists", name);
        return NULL;
    }
    ag_node *n = node_alloc(g);
    if (!n)
        return NULL;
    n->graph = g;
    n->kind = kind;
    n->vals = &n->val1;
    char made[160];
    if ((!name && make_name(g, candidate, made)) || node_set_name(n, name ? name : made)) {
        node_release(g, n);
        return NULL;
    }
    return n;
}

/* Registers the node's name (refused when taken, unless `replace`: a copy) and uses and
 * links it; frees it on failure. */
static ag_node *node_commit_ex(ag_graph *g, ag_node *n, bool at_placeholders, bool replace) {
    for (int i = 0; i < n->nargs; i++)
        if (arg_uses_ex(n, &n->args[i], true, true)) {
            for (int j = 0; j < i; j++)
                arg_uses(n, &n->args[j], false);
            node_free(n);
            return NULL;
        }
    int rc =
        replace ? ag__strmap_put(&g->names, n->name, n) : ag__strmap_put_new(&g->names, n->name, n);
    if (rc) {
        if (rc > 0)
            ag__err(AG_EINVAL, "graph: a node named '%s' already exists", n->name);
        for (int j = 0; j < n->nargs; j++)
            arg_uses(n, &n->args[j], false);
        node_free(n);
        return NULL;
    }
    if (at_placeholders) {
        /* After the last placeholder (before the first other node); remembered, so adding N
         * placeholders costs O(N), not O(N^2). */
        ag_node *pos = g->last_ph ? g->last_ph->next : g->first;
        while (pos && pos->kind == AG_NODE_PLACEHOLDER)
            pos = pos->next;
        int saved = g->explicit_insert;
        ag_node *sb = g->insert_before, *sa = g->insert_after;
        g->explicit_insert = 1;
        g->insert_before = pos;
        link_at_insert_point(g, n);
        g->explicit_insert = saved;
        g->insert_before = sb;
        g->insert_after = sa;
        g->last_ph = n;
    } else {
        link_at_insert_point(g, n);
    }
    return n;
}

static ag_node *node_commit(ag_graph *g, ag_node *n, bool at_placeholders) {
    return node_commit_ex(g, n, at_placeholders, false);
}

ag_node *ag_graph_placeholder(ag_graph *g, const char *name, const ag_tmeta *val) {
    AG__CHECK_NULL_RET("graph_placeholder", g, NULL);
    ag_node *n = node_new(g, AG_NODE_PLACEHOLDER, name, "arg");
    if (!n)
        return NULL;
    if (val) {
        n->val1 = *val;
        n->nvals = 1;
    }
    return node_commit(g, n, true);
}

static int set_vals(ag_node *n, const ag_tmeta *vals, int cnt) {
    if (n->vals != &n->val1)
        ag__free(n->vals);
    n->vals = &n->val1;
    n->nvals = 0;
    if (cnt > 1) {
        n->vals = ag__malloc(sizeof(ag_tmeta) * (size_t)cnt);
        if (!n->vals) {
            n->vals = &n->val1;
            return AG_ENOMEM;
        }
    }
    if (cnt > 0)
        memcpy(n->vals, vals, sizeof(ag_tmeta) * (size_t)cnt);
    n->nvals = cnt;
    return 0;
}

void ag__call_name_base(const ag_op *op, char *base) {
    const char *colons = strstr(ag_op_name(op), "::");
    const char *b = colons ? colons + 2 : ag_op_name(op);
    const char *dot = strchr(b, '.');
    size_t len = dot ? (size_t)(dot - b) : strlen(b);
    if (len >= 96)
        len = 95;
    memcpy(base, b, len);
    base[len] = 0;
}

ag_node *ag__graph_call_vals(ag_graph *g, const ag_op *op, const ag_garg *args, int nargs,
                             const ag_tmeta *vals, int nvals, const char *name) {
    /* Trailing arguments equal to their schema defaults are dropped, as FX does not show
     * arguments that were not passed. */
    while (nargs > 0 && ag__garg_is_default(op, nargs - 1, &args[nargs - 1]))
        nargs--;
    char base[96];
    ag__call_name_base(op, base);
    ag_node *n = node_new(g, AG_NODE_CALL, name, base);
    if (!n)
        return NULL;
    n->op = op;
    if (node_args_reserve(n, nargs)) {
        node_free(n);
        return NULL;
    }
    for (int i = 0; i < nargs; i++) {
        if (ag__garg_copy(&n->args[i], &args[i])) {
            n->nargs = i;
            node_free(n);
            return NULL;
        }
        n->nargs = i + 1;
    }
    if (set_vals(n, vals, nvals)) {
        node_free(n);
        return NULL;
    }
    return node_commit(g, n, false);
}

ag_node *ag_graph_call(ag_graph *g, const ag_op *op, const ag_garg *args, int nargs,
                       const char *name) {
    AG__CHECK_NULL_RET("graph_call", g, NULL);
    AG__CHECK_NULL_RET("graph_call", op, NULL);
    if (nargs > 0)
        AG__CHECK_NULL_RET("graph_call", args, NULL);
    for (int i = 0; i < nargs; i++)
        if (ag__garg_check(ag_op_name(op), &args[i]))
            return NULL;
    if (ag__subgraph_check_args(g, op, args, nargs))
        return NULL;
    ag_tmeta vals[AG_MAX_OUTPUTS];
    int nvals = 0;
    if (ag__infer_meta(op, args, nargs, vals, &nvals))
        return NULL;
    return ag__graph_call_vals(g, op, args, nargs, vals, nvals, name);
}

ag_node *ag_graph_getitem(ag_graph *g, ag_node *src, int idx, const char *name) {
    AG__CHECK_NULL_RET("graph_getitem", g, NULL);
    AG__CHECK_NULL_RET("graph_getitem", src, NULL);
    /* A tuple of one is read by getitem too when the op returns a tuple (invoke_subgraph). */
    bool tuple = src->kind == AG_NODE_CALL && src->op &&
                 (src->nvals >= 2 || (ag_op_def(src->op)->flags & AG_OP_SUBGRAPH));
    if (!tuple || idx < 0 || idx >= src->nvals)
        return ag__err(AG_EINVAL, "getitem: %s has no output %d", src->name, idx), NULL;
    if (ag__call_output_is_none(src, idx))
        return ag__err(AG_EINVAL,
                       "getitem: output %d of %%%s is None in its subgraph (nothing to read)", idx,
                       src->name),
               NULL;
    ag_node *n = node_new(g, AG_NODE_GETITEM, name, "getitem");
    if (!n)
        return NULL;
    n->args[0] = AG_GA_N(src);
    n->args[1] = AG_GA_I(idx);
    n->nargs = 2;
    n->val1 = src->vals[idx];
    n->nvals = 1;
    return node_commit(g, n, false);
}

ag_node *ag_graph_get_attr(ag_graph *g, ag_tensor *value, const char *name) {
    AG__CHECK_NULL_RET("graph_get_attr", g, NULL);
    AG__CHECK_NULL_RET("graph_get_attr", value, NULL);
    if (name && ag_graph_subgraph(g, name))
        return ag__err(AG_EINVAL, "graph_get_attr: '%s' is the name of a subgraph", name), NULL;
    char cand[64];
    if (!name) {
        snprintf(cand, sizeof cand, "_tensor_constant%lld", (long long)g->nconst);
        while (ag__strmap_has(&g->names, cand) || ag_graph_subgraph(g, cand))
            snprintf(cand, sizeof cand, "_tensor_constant%lld", (long long)++g->nconst);
    }
    ag_node *n = node_new(g, AG_NODE_GET_ATTR, name ? name : cand, NULL);
    if (!n)
        return NULL;
    if (!name)
        g->nconst++;
    n->constant = ag_tensor_keep(value);
    ag__tmeta_of(value, &n->val1);
    n->nvals = 1;
    return node_commit(g, n, false);
}

ag_node *ag_graph_get_attr_subgraph(ag_graph *g, const char *attr, const char *name) {
    AG__CHECK_NULL_RET("graph_get_attr_subgraph", g, NULL);
    AG__CHECK_NULL_RET("graph_get_attr_subgraph", attr, NULL);
    ag_graph *sub = ag_graph_subgraph(g, attr);
    if (!sub)
        return ag__err(AG_EINVAL, "graph_get_attr_subgraph: the graph has no subgraph '%s'", attr),
               NULL;
    if (!name && !ag__strmap_has(&g->names, attr))
        name = attr;
    ag_node *n = node_new(g, AG_NODE_GET_ATTR, name, attr);
    if (!n)
        return NULL;
    n->sub = sub;
    return node_commit(g, n, false);
}

ag_graph *ag_node_subgraph(const ag_node *n) {
    return n && n->kind == AG_NODE_GET_ATTR ? n->sub : NULL;
}

ag_node *ag_graph_output(ag_graph *g, ag_node *const *outs, int cnt) {
    AG__CHECK_NULL_RET("graph_output", g, NULL);
    if (cnt > 0)
        AG__CHECK_NULL_RET("graph_output", outs, NULL);
    if (g->output)
        return ag__err(AG_ESTATE, "graph: the graph already has an output node"), NULL;
    ag_node *n = node_new(g, AG_NODE_OUTPUT, "output", NULL);
    if (!n)
        return NULL;
    ag_garg a = AG_GA_NODES((ag_node **)outs, cnt);
    if (ag__garg_copy(&n->args[0], &a)) {
        node_free(n);
        return NULL;
    }
    n->nargs = 1;
    int saved = g->explicit_insert;
    g->explicit_insert = 0;
    g->insert_before = NULL;
    ag_node *r = node_commit(g, n, false);
    g->explicit_insert = saved;
    if (r)
        g->output = r;
    return r;
}

/* ---- mutation ---- */

int ag_node_set_arg(ag_node *n, int i, ag_garg a) {
    AG__CHECK_NULL("node_set_arg", n);
    if (i < 0 || i > n->nargs || i >= AG_MAX_ARGS)
        return ag__err(AG_EINVAL, "set_arg: %s has no argument %d", n->name, i);
    if (ag__garg_check("set_arg", &a))
        return AG_EINVAL;
    ag_garg copy;
    if (node_args_reserve(n, i + 1) || ag__garg_copy(&copy, &a))
        return AG_ENOMEM;
    if (arg_uses(n, &copy, true)) {
        ag__garg_free(&copy);
        return AG_ENOMEM;
    }
    if (i < n->nargs) {
        arg_uses(n, &n->args[i], false);
        ag__garg_free(&n->args[i]);
    } else {
        n->nargs++;
    }
    n->args[i] = copy;
    return 0;
}

/* The elements of tuple a (an argument of u) that are n become by (NULL: None elements);
 * their count, or AG_ENOMEM. */
static int tuple_replace(ag_garg *a, const ag_node *n, ag_node *by, ag_node *u) {
    int replaced = 0;
    for (int k = 0; k < a->n; k++) {
        ag_garg *e = (ag_garg *)&a->u.elems[k];
        if (e->kind != AG_GA_NODE || e->u.node != n)
            continue;
        if (by && add_use(by, u, false))
            return AG_ENOMEM;
        *e = by ? AG_GA_N(by) : AG_GA_NIL;
        replaced++;
    }
    return replaced;
}

int ag_node_replace_all_uses(ag_node *n, ag_node *by) {
    AG__CHECK_NULL("node_replace_all_uses", n);
    if (by == n)
        return 0;
    int replaced = 0;
    /* Each user may be rewritten; iterate over a snapshot since users change. */
    while (n->nusers > 0) {
        ag_node *u = n->users[0].node;
        int cnt = n->users[0].count;
        for (int i = 0; i < u->nargs; i++) {
            ag_garg *a = &u->args[i];
            if (a->kind == AG_GA_NODE && a->u.node == n) {
                if (by && add_use(by, u, false))
                    return AG_ENOMEM;
                a->u.node = by;
                if (!by)
                    a->kind = AG_GA_NONE;
                replaced++;
            } else if (a->kind == AG_GA_NODES) {
                for (int k = 0; k < a->n; k++)
                    if (a->u.nodes[k] == n) {
                        if (by && add_use(by, u, false))
                            return AG_ENOMEM;
                        a->u.nodes[k] = by;
                        replaced++;
                    }
            } else if (a->kind == AG_GA_TUPLE) {
                int r = tuple_replace(a, n, by, u);
                if (r < 0)
                    return r;
                replaced += r;
            }
        }
        for (int k = 0; k < cnt; k++)
            drop_use(n, u);
    }
    return replaced;
}

int ag_graph_erase(ag_graph *g, ag_node *n) {
    AG__CHECK_NULL("graph_erase", g);
    AG__CHECK_NULL("graph_erase", n);
    if (n->nusers > 0)
        return ag__err(AG_ESTATE, "erase: %s still has %d user(s), e.g. %s", n->name, n->nusers,
                       n->users[0].node->name);
    assert(uses_match(n, false));
    for (int i = 0; i < n->nargs; i++)
        arg_uses(n, &n->args[i], false);
    assert(uses_match(n, true));
    ag__strmap_del(&g->names, n->name);
    if (g->output == n)
        g->output = NULL;
    unlink_node(g, n);
    node_free(n);
    return 0;
}

static int move_node(ag_graph *g, ag_node *n, ag_node *pos, bool before) {
    if (n == pos)
        return 0;
    if (n->graph != g || pos->graph != g)
        return ag__err(AG_EINVAL, "move: nodes of another graph");
    int saved = g->explicit_insert;
    ag_node *sb = g->insert_before, *sa = g->insert_after;
    unlink_node(g, n);
    g->explicit_insert = 1;
    g->insert_before = before ? pos : pos->next;
    g->insert_after = NULL;
    link_at_insert_point(g, n);
    g->explicit_insert = saved;
    g->insert_before = sb == n ? NULL : sb;
    g->insert_after = sa == n ? NULL : sa;
    return 0;
}

int ag_graph_move_before(ag_graph *g, ag_node *n, ag_node *pos) {
    AG__CHECK_NULL("graph_move_before", g);
    AG__CHECK_NULL("graph_move_before", n);
    AG__CHECK_NULL("graph_move_before", pos);
    return move_node(g, n, pos, true);
}
int ag_graph_move_after(ag_graph *g, ag_node *n, ag_node *pos) {
    AG__CHECK_NULL("graph_move_after", g);
    AG__CHECK_NULL("graph_move_after", n);
    AG__CHECK_NULL("graph_move_after", pos);
    return move_node(g, n, pos, false);
}

int ag_node_rename(ag_graph *g, ag_node *n, const char *name) {
    AG__CHECK_NULL("node_rename", g);
    AG__CHECK_NULL("node_rename", n);
    AG__CHECK_NULL("node_rename", name);
    if (!*name)
        return ag__err(AG_EINVAL, "rename: empty name");
    if (ag__strmap_has(&g->names, name))
        return ag__err(AG_EINVAL, "rename: a node named '%s' already exists", name);
    char *nn = ag__strdup(name);
    if (!nn)
        return AG_ENOMEM;
    ag__strmap_del(&g->names, n->name);
    if (ag__strmap_put(&g->names, nn, n)) {
        ag__strmap_put(&g->names, n->name, n); /* cannot fail: the slot was just freed */
        ag__free(nn);
        return AG_ENOMEM;
    }
    node_free_name(n);
    n->name = nn;
    return 0;
}

/* ---- reading ---- */

ag_node_kind ag_node_kind_of(const ag_node *n) {
    return n ? n->kind : (ag_node_kind)0;
}
const char *ag_node_name(const ag_node *n) {
    return n ? n->name : NULL;
}
const ag_op *ag_node_op(const ag_node *n) {
    return n ? n->op : NULL;
}
int ag_node_nargs(const ag_node *n) {
    return n ? n->nargs : 0;
}
const ag_garg *ag_node_arg(const ag_node *n, int i) {
    if (!n)
        return NULL;
    return i >= 0 && i < n->nargs ? &n->args[i] : NULL;
}
ag_node *ag_node_arg_node(const ag_node *n, int i) {
    if (!n)
        return NULL;
    return i >= 0 && i < n->nargs && n->args[i].kind == AG_GA_NODE ? n->args[i].u.node : NULL;
}
int ag_node_num_users(const ag_node *n) {
    return n ? n->nusers : 0;
}
ag_node *ag_node_user(const ag_node *n, int i) {
    if (!n)
        return NULL;
    return i >= 0 && i < n->nusers ? n->users[i].node : NULL;
}
int ag_node_num_vals(const ag_node *n) {
    return n ? n->nvals : 0;
}
const ag_tmeta *ag_node_val(const ag_node *n, int i) {
    if (!n)
        return NULL;
    return i >= 0 && i < n->nvals ? &n->vals[i] : NULL;
}
int ag_node_set_val(ag_node *n, int i, const ag_tmeta *m) {
    AG__CHECK_NULL("node_set_val", n);
    AG__CHECK_NULL("node_set_val", m);
    if (i < 0 || i > n->nvals || i >= AG_MAX_OUTPUTS)
        return ag__err(AG_EINVAL, "set_val: %s has no output %d", n->name, i);
    if (i == n->nvals) {
        ag_tmeta tmp[AG_MAX_OUTPUTS];
        memcpy(tmp, n->vals, sizeof(ag_tmeta) * (size_t)n->nvals);
        tmp[i] = *m;
        return set_vals(n, tmp, i + 1);
    }
    n->vals[i] = *m;
    return 0;
}
ag_tensor *ag_node_constant(const ag_node *n) {
    return n ? n->constant : NULL;
}

int ag_node_set_desc(ag_node *n, ag_desc *d) {
    AG__CHECK_NULL("node_set_desc", n);
    if (n->kind != AG_NODE_PLACEHOLDER)
        return ag__err(AG_EINVAL, "set_desc: %s is not a placeholder", n->name);
    if (d && !ag_desc_is_input(d))
        return ag__err(AG_EINVAL, "set_desc: %s: a placeholder takes an input descriptor", n->name);
    ag_desc_retain(d);
    ag_desc_release(n->desc);
    n->desc = d;
    return 0;
}

ag_desc *ag_node_desc(const ag_node *n) {
    return n ? n->desc : NULL;
}

int ag_node_set_output_descs(ag_node *out, ag_desc *const *descs, int cnt) {
    AG__CHECK_NULL("node_set_output_descs", out);
    if (out->kind != AG_NODE_OUTPUT)
        return ag__err(AG_EINVAL, "set_output_descs: %s is not the output node", out->name);
    int nouts = out->nargs ? out->args[0].n : 0;
    if (cnt != nouts)
        return ag__err(AG_EINVAL, "set_output_descs: %d descriptors for %d outputs", cnt, nouts);
    for (int i = 0; i < cnt; i++)
        if (descs[i] && ag_desc_is_input(descs[i]))
            return ag__err(AG_EINVAL,
                           "set_output_descs: output %d: an output takes an output "
                           "descriptor",
                           i);
    ag_desc **v = ag__calloc((size_t)(cnt ? cnt : 1), sizeof *v);
    if (!v)
        return AG_ENOMEM;
    for (int i = 0; i < cnt; i++)
        v[i] = ag_desc_retain(descs[i]);
    for (int i = 0; i < out->nout_descs; i++)
        ag_desc_release(out->out_descs[i]);
    ag__free(out->out_descs);
    out->out_descs = v;
    out->nout_descs = cnt;
    out->has_out_descs = true;
    return 0;
}

ag_desc *ag_node_output_desc(const ag_node *out, int i) {
    if (!out)
        return NULL;
    return i >= 0 && i < out->nout_descs ? out->out_descs[i] : NULL;
}
bool ag_node_has_output_descs(const ag_node *out) {
    return out ? out->has_out_descs : false;
}

int ag__graph_reserve(ag_graph *g, int64_t nnodes) {
    return ag__strmap_reserve(&g->names, nnodes);
}

/* ---- copy ---- */

ag_node *ag__copy_map_get(const ag__copy_map *map, const ag_node *x) {
    int64_t i = x->index;
    return i >= 0 && i < map->cnt && map->from[i] == x ? map->to[i] : NULL;
}

void ag__copy_map_set(ag__copy_map *map, const ag_node *x, ag_node *to) {
    int64_t i = x->index;
    if (i >= 0 && i < map->cnt && map->from[i] == x)
        map->to[i] = to;
}

ag_graph *ag__graph_copy_shell(const ag_graph *src) {
    ag_graph *g = ag_graph_new();
    int rc = g ? ag__subgraphs_copy(g, src) : AG_ENOMEM;
    if (rc == 0)
        rc = ag__graph_reserve(g, src->count);
    /* Name counters carry over so that later nodes are named as in the source graph. */
    for (int64_t i = 0; i < src->nbases && rc == 0; i++) {
        int64_t cap = g->bases_cap;
        char *b = ag__strdup(src->bases[i].base);
        if (!b || ag__grow((void **)&g->bases, &cap, g->nbases + 1, sizeof *g->bases) ||
            ag__strmap_put(&g->base_idx, b, (void *)(intptr_t)(g->nbases + 1))) {
            ag__free(b);
            rc = AG_ENOMEM;
            break;
        }
        g->bases_cap = cap;
        g->bases[g->nbases++] = (ag__base_count){b, src->bases[i].count};
    }
    if (rc) {
        ag_graph_free(g);
        return NULL;
    }
    g->nconst = src->nconst;
    return g;
}

int ag__graph_copy_nodes(ag_graph *g, const ag_graph *src, ag__copy_hook hook, void *ctx) {
    /* Source node -> its copy, by the source's positions (ag_node_index's cache, filled by
     * the first call): a node that is not in the source maps to NULL. */
    int64_t cnt = src->count;
    ag__copy_map map = {ag__calloc((size_t)(2 * cnt + 1), sizeof(ag_node *)), NULL, cnt};
    if (!map.from)
        return AG_ENOMEM;
    map.to = map.from + cnt;
    if (src->first)
        (void)ag_node_index(src->first);
    for (ag_node *n = src->first; n; n = n->next)
        if (n->index >= 0 && n->index < cnt)
            map.from[n->index] = n;
    int rc = 0;
    for (ag_node *n = src->first; n && rc == 0; n = n->next) {
        if (hook) {
            int h = hook(ctx, g, n, &map);
            if (h < 0) {
                rc = h;
                break;
            }
            if (h > 0)
                continue;
        }
        ag_node *m = node_alloc(g);
        if (!m) {
            rc = AG_ENOMEM;
            break;
        }
        m->graph = g;
        m->kind = n->kind;
        m->op = n->op;
        m->vals = &m->val1;
        if (node_set_name(m, n->name) || set_vals(m, n->vals, n->nvals)) {
            node_free(m);
            rc = AG_ENOMEM;
            break;
        }
        m->constant = ag_tensor_keep(n->constant);
        if (n->sub) {
            int k = ag__subgraph_index(src, n->sub);
            m->sub = k >= 0 ? g->subs[k].g : NULL;
        }
        rc = node_args_reserve(m, n->nargs);
        for (int i = 0; i < n->nargs && rc == 0; i++) {
            ag_garg a = n->args[i];
            ag_node *tmp[64];
            if (a.kind == AG_GA_NODE && a.u.node) {
                a.u.node = ag__copy_map_get(&map, a.u.node);
            } else if (a.kind == AG_GA_NODES) {
                ag_node **nv = a.n <= 64 ? tmp : ag__malloc(sizeof(ag_node *) * (size_t)a.n);
                if (!nv) {
                    rc = AG_ENOMEM;
                    break;
                }
                for (int k = 0; k < a.n; k++)
                    nv[k] = a.u.nodes[k] ? ag__copy_map_get(&map, a.u.nodes[k]) : NULL;
                a.u.nodes = nv;
                rc = ag__garg_copy(&m->args[i], &a);
                if (nv != tmp)
                    ag__free(nv);
                if (rc == 0)
                    m->nargs = i + 1;
                continue;
            }
            rc = ag__garg_copy(&m->args[i], &a);
            if (rc == 0)
                m->nargs = i + 1;
            for (int k = 0; rc == 0 && a.kind == AG_GA_TUPLE && k < a.n; k++) {
                ag_node **slot = ag__garg_slot(&m->args[i], k); /* a tuple's node: its copy's */
                ag_node *to = slot ? ag__copy_map_get(&map, *slot) : NULL;
                if (slot && to)
                    *slot = to;
                else if (slot) /* nothing stands for it: None, as a NODE argument gets */
                    ((ag_garg *)m->args[i].u.elems)[k] = AG_GA_NIL;
            }
        }
        if (rc == 0)
            rc = ag__node_meta_copy(m, n); /* m->graph is g */
        for (int i = 0; i < n->ncustom && rc == 0; i++)
            rc = ag__entry_copy(g, &m->custom, &m->ncustom, &m->custom_cap, NULL, &n->custom[i]);
        m->desc = ag_desc_retain(n->desc);
        if (rc == 0 && n->has_out_descs) {
            m->out_descs =
                ag__calloc((size_t)(n->nout_descs ? n->nout_descs : 1), sizeof(ag_desc *));
            if (!m->out_descs)
                rc = AG_ENOMEM;
            else {
                for (int i = 0; i < n->nout_descs; i++)
                    m->out_descs[i] = ag_desc_retain(n->out_descs[i]);
                m->nout_descs = n->nout_descs;
                m->has_out_descs = true;
            }
        }
        if (rc) {
            node_free(m);
            break;
        }
        ag__copy_map_set(&map, n, m); /* a failed commit frees m and ends the copy */
        ag_node *r = node_commit_ex(g, m, false, true);
        if (!r) {
            rc = AG_ENOMEM;
            break;
        }
        if (r->kind == AG_NODE_OUTPUT)
            g->output = r;
    }
    ag__free(map.from);
    return rc;
}

ag_graph *ag_graph_copy(const ag_graph *src) {
    AG__CHECK_NULL_RET("graph_copy", src, NULL);
    ag_graph *g = ag__graph_copy_shell(src);
    if (g && ag__graph_copy_nodes(g, src, NULL, NULL)) {
        ag_graph_free(g);
        return NULL;
    }
    return g;
}
