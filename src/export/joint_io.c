/* Saved joints: ag_joint_save / ag_joint_load and the joint's hash (include/aotgrad/export.h;
 * the format is described with an example in docs/JOINT_FORMAT.md).
 *
 * In: a joint (to save or hash) or text (to load). Out: the text, a 64-bit hash, or a joint
 * that behaves as the one saved: the same graph, calling convention and aliasing facts, so
 * ag_compile_joint makes the same callable of it.
 *
 * The text is a header of one fact per line (format and version; params_spec, buffers_spec,
 * in_spec and out_spec; needs_autograd; the per-primal input facts; the per-user-output facts;
 * the aliasing facts of src/export/alias.h: flat inputs -> primals and their descriptors,
 * where each primal comes from, geometries) followed by the graph in its own text format
 * (src/graph/print.c, with seq_nr, stack traces, annotations and every metadata item). What the
 * graph already says is not repeated: the counts of primals, tangents, tokens, RNG inputs and extra
 * outputs, and the descriptors the joint keeps, are read back from the graph's layout
 * (ag_graph_layout), as the export leaves them. The reader checks every line and every index
 * against the graph, so text edited by hand gives a joint the runtime can use or an error naming
 * the line. */
#include "../core/pystr.h"
#include "../graph/text_internal.h"
#include "joint_internal.h"
#include "subclass_flatten.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#define FORMAT_NAME "aotgrad-joint"
/* Version 2 adds each flat input's descriptor (` desc=` on its flat_inputs line); version 1
 * files still load, their flat inputs' descriptors derived once from params_spec,
 * buffers_spec and the subclass lines. */
#define FORMAT_VERSION 2
#define FORMAT_OLDEST 1
#define SPEC_MAX_DEPTH 64

static const char *const alias_names[] = {
    "non_alias",
    "is_input",
    "alias_of_input",
    "alias_of_intermediate",
    "alias_of_intermediate_save_as_output",
    "alias_of_intermediate_base_is_user_output",
    "unsafe_view_alias",
};
#define NALIAS ((int)(sizeof alias_names / sizeof alias_names[0]))
static const char *const flat_names[] = {"primal", "dup", "view"};
static const char *const base_names[] = {"none", "view", "synthetic"};

/* ---- writing ---- */

static const char *py_bool(bool b) {
    return b ? "True" : "False";
}

/* A geometry, complete: "f32[2, 3]{3, 1}+0" (strides and offset always; the offset may be
 * negative, "-4", as offsets relative to a base may be). */
static void put_geom(ag__sbuf *b, const ag_tmeta *m) {
    ag__sb_puts(b, (unsigned)m->dtype < AG_NDTYPES ? ag_dtype_short(m->dtype) : "?");
    for (int pass = 0; pass < 2; pass++) {
        ag__sb_putc(b, pass ? '{' : '[');
        for (int d = 0; d < m->ndim && d < AG_MAX_DIMS; d++)
            ag__sb_printf(b, "%s%lld", d ? ", " : "", (long long)(pass ? m->strides : m->sizes)[d]);
        ag__sb_putc(b, pass ? '}' : ']');
    }
    ag__sb_printf(b, "%s%lld", m->offset < 0 ? "" : "+", (long long)m->offset);
}

static void put_fqns(ag__sbuf *b, char *const *names, int n) {
    ag__sb_putc(b, '[');
    for (int i = 0; i < n; i++) {
        if (i)
            ag__sb_puts(b, ", ");
        ag__sb_pystr(b, names[i], strlen(names[i]));
    }
    ag__sb_puts(b, "]\n");
}

static void put_desc(ag__sbuf *b, const ag_desc *d) {
    size_t n = ag_desc_repr(d, NULL, 0);
    if (!ag__sb_reserve(b, n + 1))
        return;
    ag_desc_repr(d, b->p + b->len, n + 1);
    b->len += n;
}

static void put_spec(ag__sbuf *b, const ag_treespec *s) {
    size_t n = ag_treespec_repr(s, NULL, 0);
    if (!ag__sb_reserve(b, n + 1))
        return;
    ag_treespec_repr(s, b->p + b->len, n + 1);
    b->len += n;
    ag__sb_putc(b, '\n');
}

/* ---- tensor subclasses ---- */

/* The subclass type a saved joint names: built in or registered (ag_subclass_type_register). */
static const ag_subclass_type *known_type(const char *name, size_t n) {
    char buf[128];
    if (n >= sizeof buf)
        return NULL;
    memcpy(buf, name, n);
    buf[n] = 0;
    return ag_subclass_type_find(buf);
}

/* 0, or AG_ENOTSUP naming the first type in m the loader could not find by its name. */
static int check_known(const ag__scmeta *m, const char *what, int i, const char *fn) {
    if (!m->type)
        return 0;
    if (known_type(m->type->name, strlen(m->type->name)) != m->type)
        return ag__err(AG_ENOTSUP,
                       "%s: %s %d is a %s, a tensor subclass type the loader cannot find by its "
                       "name (register it with ag_subclass_type_register)",
                       fn, what, i, m->type->name);
    for (int k = 0; k < m->type->ninner; k++)
        if (check_known(&m->inner[k], what, i, fn))
            return AG_ENOTSUP;
    return 0;
}

/* "TwoTensor(GEOM; a=GEOM, b=GEOM)", nested instances in place of an inner GEOM, and
 * "; meta=HEX" (the metadata's bytes) before the ')' for a type with metadata. */
static void put_scmeta(ag__sbuf *b, const ag__scmeta *m) {
    if (!m->type) {
        put_geom(b, &m->outer);
        return;
    }
    ag__sb_printf(b, "%s(", m->type->name);
    put_geom(b, &m->outer);
    for (int k = 0; k < m->type->ninner; k++) {
        ag__sb_printf(b, "%s%s=", k ? ", " : "; ", m->type->attrs[k]);
        put_scmeta(b, &m->inner[k]);
    }
    if (m->type->meta_size) {
        ag__sb_puts(b, "; meta=");
        for (size_t i = 0; i < m->type->meta_size; i++)
            ag__sb_printf(b, "%02x", ((const unsigned char *)m->meta)[i]);
    }
    ag__sb_putc(b, ')');
}

static void put_scmetas(ag__sbuf *b, const char *key, const ag__scmeta *m, int n) {
    ag__sb_printf(b, "%s: %d\n", key, n);
    for (int i = 0; i < n; i++) {
        ag__sb_printf(b, "  %d %s", i, m[i].type ? "" : "plain ");
        put_scmeta(b, &m[i]);
        ag__sb_putc(b, '\n');
    }
}

static int check_savable(const ag_joint *j, const char *fn) {
    const ag__subx_info *sx = j->subclass;
    for (int i = 0; sx && i < sx->nin; i++)
        if (check_known(&sx->in[i], "input", i, fn) || check_known(&sx->grad[i], "gradient", i, fn))
            return AG_ENOTSUP;
    for (int k = 0; sx && k < sx->nout; k++)
        if (check_known(&sx->out[k], "output", k, fn))
            return AG_ENOTSUP;
    if (j->alias.nuser != j->nuser_out || j->alias.nprimals != j->nprimals - ag__joint_ntok(j))
        return ag__err(AG_EINVAL,
                       "%s: the joint's aliasing facts cover %d primals and %d "
                       "outputs, its graph has %d and %d",
                       fn, j->alias.nprimals, j->alias.nuser, j->nprimals - ag__joint_ntok(j),
                       j->nuser_out);
    return 0;
}

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return x < y ? -1 : x > y;
}

/* The graph as the hash sees it: without stack traces, and with each seq_nr replaced by its
 * rank among the graph's seq_nrs (they count autograd nodes made since the process started,
 * so the same model exported twice numbers its nodes from different starts; which nodes share
 * a number, and their order, is what the graph says). */
static char *canonical_graph_text(const ag_graph *src) {
    ag_graph *g = ag_graph_copy(src);
    if (!g)
        return NULL;
    int64_t n = 0;
    for (ag_node *x = ag_graph_first(g); x; x = ag_node_next(x))
        n += ag_node_seq_nr(x) >= 0;
    int64_t *seq = ag__malloc(sizeof *seq * (size_t)(n ? n : 1));
    char *s = NULL;
    if (seq) {
        int64_t k = 0, nu = 0;
        for (ag_node *x = ag_graph_first(g); x; x = ag_node_next(x))
            if (ag_node_seq_nr(x) >= 0)
                seq[k++] = ag_node_seq_nr(x);
        qsort(seq, (size_t)n, sizeof *seq, cmp_i64);
        for (int64_t i = 0; i < n; i++)
            if (i == 0 || seq[i] != seq[nu - 1])
                seq[nu++] = seq[i];
        bool ok = true;
        for (ag_node *x = ag_graph_first(g); x && ok; x = ag_node_next(x)) {
            int64_t v = ag_node_seq_nr(x);
            if (v < 0)
                continue;
            int64_t lo = 0, hi = nu - 1;
            while (lo < hi) {
                int64_t mid = (lo + hi) / 2;
                if (seq[mid] < v)
                    lo = mid + 1;
                else
                    hi = mid;
            }
            ok = ag_node_set_seq_nr(x, lo) == 0;
        }
        ag_print_opts po = {.seq_nr = true};
        s = ok ? ag_graph_to_string(g, &po) : NULL;
        ag__free(seq);
    }
    ag_graph_free(g);
    return s;
}

/* The saved text; canonical: the hash's form (canonical_graph_text). */
static char *save_text(const ag_joint *j, bool canonical, size_t *len, const char *fn) {
    if (check_savable(j, fn))
        return NULL;
    const ag__joint_alias *a = &j->alias;
    ag__sbuf b = {0};
    ag__sb_printf(&b, "%s %d\nparams_spec: ", FORMAT_NAME, FORMAT_VERSION);
    put_fqns(&b, j->params, j->nparams);
    ag__sb_puts(&b, "buffers_spec: ");
    put_fqns(&b, j->buffers, j->nbuffers);
    ag__sb_puts(&b, "in_spec: ");
    put_spec(&b, j->in_spec);
    ag__sb_puts(&b, "out_spec: ");
    put_spec(&b, j->out_spec);
    ag__sb_printf(&b, "needs_autograd: %s\ninput_info: %d\n", py_bool(j->needs_autograd),
                  j->nprimals);
    for (int p = 0; p < j->nprimals; p++) {
        const ag_input_info *ii = &j->in_info[p];
        ag__sb_printf(&b, "  %d mutates_data=%s mutates_metadata=%s requires_grad=%s\n", p,
                      py_bool(ii->mutates_data), py_bool(ii->mutates_metadata),
                      py_bool(ii->requires_grad));
    }
    ag__sb_printf(&b, "output_info: %d\n", j->nuser_out);
    for (int k = 0; k < j->nuser_out; k++) {
        const ag_output_info *oi = &j->out_info[k];
        ag__sb_printf(&b, "  %d alias=%s base_index=%d requires_grad=%s geom=", k,
                      (unsigned)oi->alias < (unsigned)NALIAS ? alias_names[oi->alias] : "?",
                      oi->base_index, py_bool(oi->requires_grad));
        put_geom(&b, &a->out[k].geom);
        ag__sb_putc(&b, '\n');
    }
    ag__sb_printf(&b, "flat_inputs: %d\n", a->nflat);
    for (int i = 0; i < a->nflat; i++) {
        const ag__flat_info *f = &a->flat[i];
        ag__sb_printf(&b, "  %d kind=%s primal=%d dup_of=%d metadata_mutation=%d geom=", i,
                      (unsigned)f->kind < 3 ? flat_names[f->kind] : "?", f->primal, f->dup_of,
                      f->metadata_mutation);
        put_geom(&b, &f->geom);
        ag__sb_puts(&b, " new_geom=");
        put_geom(&b, &f->new_geom);
        ag__sb_puts(&b, " desc=");
        put_desc(&b, j->flat_descs[i]);
        ag__sb_putc(&b, '\n');
    }
    ag__sb_printf(&b, "primal_sources: %d\n", a->nprimals);
    for (int p = 0; p < a->nprimals; p++) {
        const ag__primal_info *pi = &a->prim[p];
        ag__sb_printf(&b, "  %d base=%s flat=%d new_geom=", p,
                      (unsigned)pi->base < 3 ? base_names[pi->base] : "?", pi->flat);
        put_geom(&b, &pi->new_geom);
        ag__sb_putc(&b, '\n');
    }
    ag__sb_printf(&b, "metadata_mutations: %d\nintermediate_bases: %d\n", a->nmetadata_mutations,
                  a->nintermediate_bases);
    if (j->subclass) {
        put_scmetas(&b, "subclass_inputs", j->subclass->in, j->subclass->nin);
        put_scmetas(&b, "subclass_grads", j->subclass->grad, j->subclass->nin);
        put_scmetas(&b, "subclass_outputs", j->subclass->out, j->subclass->nout);
    }
    ag_print_opts po = {.seq_nr = true, .stack_trace = true};
    char *gs = b.oom       ? NULL
               : canonical ? canonical_graph_text(j->g)
                           : ag_graph_to_string(j->g, &po);
    if (gs) {
        ag__sb_puts(&b, gs);
        ag__free(gs);
    } else {
        b.oom = true;
    }
    if (b.oom) {
        ag__sb_free(&b);
        return NULL;
    }
    *len = b.len;
    return ag__sb_finish(&b);
}

int ag_joint_save(const ag_joint *j, char **text, size_t *len) {
    AG__CHECK_NULL("joint_save", j);
    AG__CHECK_NULL("joint_save", text);
    size_t n = 0;
    char *s = save_text(j, false, &n, "joint_save");
    if (!s)
        return ag_last_status() ? ag_last_status() : AG_ENOMEM;
    *text = s;
    if (len)
        *len = n;
    return 0;
}

int ag_joint_save_file(const ag_joint *j, const char *path) {
    AG__CHECK_NULL("joint_save_file", j);
    AG__CHECK_NULL("joint_save_file", path);
    size_t n = 0;
    char *s = save_text(j, false, &n, "joint_save_file");
    if (!s)
        return ag_last_status() ? ag_last_status() : AG_ENOMEM;
    /* Written next to path and renamed onto it when complete: a failed save leaves path as it
     * was. */
    size_t plen = strlen(path);
    char *tmp = ag__malloc(plen + 32);
    if (!tmp) {
        ag__free(s);
        return AG_ENOMEM;
    }
    snprintf(tmp, plen + 32, "%s.tmp.%ld", path, (long)getpid());
    int rc = 0;
    FILE *f = fopen(tmp, "wb");
    if (!f) {
        rc = ag__err(AG_EIO, "joint_save_file: cannot create %s: %s", tmp, strerror(errno));
    } else {
        bool ok = fwrite(s, 1, n, f) == n;
        int e = ok ? 0 : errno;
        if (fclose(f) != 0 && ok) {
            ok = false;
            e = errno;
        }
        if (ok && rename(tmp, path) != 0) {
            ok = false;
            e = errno;
        }
        if (!ok) {
            remove(tmp);
            rc = ag__err(AG_EIO, "joint_save_file: writing %s: %s", path, strerror(e));
        }
    }
    ag__free(tmp);
    ag__free(s);
    return rc;
}

/* 64-bit FNV-1a, as the descriptors' hashes (desc.c). */
int ag_joint_hash(const ag_joint *j, uint64_t *out) {
    AG__CHECK_NULL("joint_hash", j);
    AG__CHECK_NULL("joint_hash", out);
    size_t n = 0;
    char *s = save_text(j, true, &n, "joint_hash");
    if (!s)
        return ag_last_status() ? ag_last_status() : AG_ENOMEM;
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++)
        h = (h ^ (unsigned char)s[i]) * 0x100000001b3ull;
    ag__free(s);
    *out = h;
    return 0;
}

/* ---- reading ---- */

/* A cursor over the text's lines. */
typedef struct rd {
    const char *s, *end; /* the whole text */
    const char *p, *eol; /* in the current line */
    int line;            /* 1-based number of the current line */
    const char *fn;      /* the call, for messages */
} rd;

/* Moves to the next line (the first when line is 0). False at the end of the text. */
static bool next_line(rd *r) {
    const char *start = r->line == 0 ? r->s : r->eol < r->end ? r->eol + 1 : r->end;
    r->line++;
    r->p = start;
    r->eol = memchr(start, '\n', (size_t)(r->end - start));
    if (!r->eol)
        r->eol = r->end;
    return start < r->end;
}

/* "line L: <what>, got '<rest of the line>'" (the rest cut at 40 bytes). */
static int bad(const rd *r, const char *what) {
    int n = (int)(r->eol - r->p);
    const char *trail = n > 40 ? "..." : "";
    if (r->p >= r->end)
        return ag__err(AG_EFORMAT, "%s: line %d: %s, got end of input", r->fn, r->line, what);
    if (n > 0 && r->eol[-1] == '\r')
        n--;
    return ag__err(AG_EFORMAT, "%s: line %d: %s, got '%.*s%s'", r->fn, r->line, what,
                   n > 40 ? 40 : n, r->p, trail);
}

static bool lit(rd *r, const char *s) {
    size_t n = strlen(s);
    if ((size_t)(r->eol - r->p) < n || memcmp(r->p, s, n))
        return false;
    r->p += n;
    return true;
}

static bool at_eol(const rd *r) {
    return r->p == r->eol || (r->p + 1 == r->eol && *r->p == '\r');
}

static bool get_i64(rd *r, int64_t *v) {
    const char *q = r->p;
    bool neg = q < r->eol && *q == '-';
    q += neg;
    if (q >= r->eol || *q < '0' || *q > '9')
        return false;
    uint64_t x = 0;
    for (; q < r->eol && *q >= '0' && *q <= '9'; q++) {
        if (x > (UINT64_C(1) << 62))
            return false;
        x = x * 10 + (uint64_t)(*q - '0');
    }
    if (x > (UINT64_C(1) << 62))
        return false;
    *v = neg ? -(int64_t)x : (int64_t)x;
    r->p = q;
    return true;
}

static bool get_int(rd *r, int *v, int lo, int hi) {
    int64_t x;
    const char *save = r->p;
    if (!get_i64(r, &x) || x < lo || x > hi) {
        r->p = save;
        return false;
    }
    *v = (int)x;
    return true;
}

static bool get_bool(rd *r, bool *v) {
    if (lit(r, "True"))
        return *v = true, true;
    if (lit(r, "False"))
        return *v = false, true;
    return false;
}

/* One of names[0..n): the longest that matches up to a space or the end of the line. */
static bool get_word(rd *r, const char *const *names, int n, int *idx) {
    const char *q = r->p;
    while (q < r->eol && *q != ' ' && *q != '\r')
        q++;
    for (int i = 0; i < n; i++)
        if (strlen(names[i]) == (size_t)(q - r->p) && !memcmp(names[i], r->p, (size_t)(q - r->p))) {
            *idx = i;
            r->p = q;
            return true;
        }
    return false;
}

static bool get_geom(rd *r, ag_tmeta *m) {
    memset(m, 0, sizeof *m);
    int dt;
    const char *q = r->p;
    static const char *const dts[] = {"f32", "f64", "i64", "b8", "i8"};
    while (q < r->eol && *q != '[')
        q++;
    rd t = *r;
    t.eol = q;
    if (!get_word(&t, dts, AG_NDTYPES, &dt) || t.p != q)
        return false;
    m->dtype = (ag_dtype)dt;
    r->p = q;
    int nsizes = 0;
    for (int pass = 0; pass < 2; pass++) {
        if (!lit(r, pass ? "{" : "["))
            return false;
        int n = 0;
        while (!lit(r, pass ? "}" : "]")) {
            if (n >= AG_MAX_DIMS || (n > 0 && !lit(r, ", ")))
                return false;
            int64_t v;
            if (!get_i64(r, &v) || (!pass && v < 0))
                return false;
            (pass ? m->strides : m->sizes)[n++] = v;
        }
        if (pass && n != nsizes)
            return false;
        nsizes = n;
    }
    m->ndim = nsizes;
    if (r->p < r->eol && *r->p == '+')
        r->p++;
    return get_i64(r, &m->offset);
}

/* "key: " at the start of the line, after moving to the next line. */
static int header(rd *r, const char *key) {
    char what[96];
    snprintf(what, sizeof what, "expected '%s: '", key);
    next_line(r);
    const char *start = r->p;
    if (!lit(r, key) || !lit(r, ": ")) {
        r->p = start;
        return bad(r, what);
    }
    return 0;
}

static int end_of_line(rd *r) {
    return at_eol(r) ? 0 : bad(r, "expected the end of the line");
}

/* A Python string literal; *out from ag__malloc. */
static int get_pystr(rd *r, char **out) {
    size_t used = 0;
    ag__pystr_err e;
    int rc = ag__pystr_parse(r->p, (size_t)(r->eol - r->p), AG__PYSTR_NO_NEWLINE, NULL, NULL, &used,
                             out, NULL, &e);
    if (rc == AG_ENOMEM)
        return rc;
    if (rc)
        return bad(r, "expected a Python string literal");
    r->p += used;
    return 0;
}

/* ['a', 'b'] into a new array of *n strings. */
static int get_fqns(rd *r, char ***out, int *n) {
    if (!lit(r, "["))
        return bad(r, "expected a list of names '['");
    int cap = 0, rc = 0;
    char **v = NULL;
    while (rc == 0 && !lit(r, "]")) {
        if (*n > 0 && !lit(r, ", ")) {
            rc = bad(r, "expected ', ' or ']'");
            break;
        }
        if (*n == cap) {
            int ncap = cap ? 2 * cap : 8;
            char **nv = ag__calloc((size_t)ncap, sizeof *nv);
            if (!nv) {
                rc = AG_ENOMEM;
                break;
            }
            if (*n)
                memcpy(nv, v, sizeof *v * (size_t)*n);
            ag__free(v);
            v = nv;
            cap = ncap;
        }
        if ((rc = get_pystr(r, &v[*n])) == 0)
            (*n)++;
    }
    *out = v ? v : ag__calloc(1, sizeof(char *));
    if (!*out && rc == 0)
        rc = AG_ENOMEM;
    return rc ? rc : end_of_line(r);
}

/* A treespec as ag_treespec_repr writes it. */
static ag_treespec *get_spec(rd *r, int depth) {
    if (lit(r, "*"))
        return ag_treespec_leaf();
    if (depth >= SPEC_MAX_DEPTH)
        return bad(r, "expected a treespec nested less deeply"), NULL;
    static const char *const kinds[] = {"tuple", "list", "dict", "NoneType"};
    int kind = -1;
    const char *q = r->p;
    if (!lit(r, "TreeSpec("))
        return bad(r, "expected a treespec ('*' or 'TreeSpec(')"), NULL;
    q = r->p;
    while (q < r->eol && *q != ',')
        q++;
    rd t = *r;
    t.eol = q;
    if (!get_word(&t, kinds, 4, &kind) || t.p != q)
        return bad(r, "expected a treespec type (tuple, list, dict or NoneType)"), NULL;
    r->p = q;
    char **keys = NULL;
    int nkeys = 0, rc = 0;
    if (!lit(r, ", "))
        rc = bad(r, "expected ', '");
    else if (kind == 2) {
        if (!lit(r, "["))
            rc = bad(r, "expected the dict's keys '['");
        while (rc == 0 && !lit(r, "]")) {
            if (nkeys > 0 && !lit(r, ", ")) {
                rc = bad(r, "expected ', ' or ']'");
                break;
            }
            char **nk = ag__calloc((size_t)nkeys + 1, sizeof *nk);
            if (!nk) {
                rc = AG_ENOMEM;
                break;
            }
            if (nkeys)
                memcpy(nk, keys, sizeof *keys * (size_t)nkeys);
            ag__free(keys);
            keys = nk;
            if ((rc = get_pystr(r, &keys[nkeys])) == 0)
                nkeys++;
        }
    } else if (!lit(r, "None")) {
        rc = bad(r, "expected the context None");
    }
    if (rc == 0 && !lit(r, ", ["))
        rc = bad(r, "expected ', ['");
    ag_treespec **ch = NULL;
    int n = 0;
    while (rc == 0 && !lit(r, "]")) {
        if (n > 0 && !lit(r, ", ")) {
            rc = bad(r, "expected ', ' or ']'");
            break;
        }
        ag_treespec **nc = ag__calloc((size_t)n + 1, sizeof *nc);
        if (!nc) {
            rc = AG_ENOMEM;
            break;
        }
        if (n)
            memcpy(nc, ch, sizeof *ch * (size_t)n);
        ag__free(ch);
        ch = nc;
        if (!(ch[n] = get_spec(r, depth + 1)))
            rc = ag_last_status() ? ag_last_status() : AG_ENOMEM;
        else
            n++;
    }
    if (rc == 0 && !lit(r, ")"))
        rc = bad(r, "expected ')'");
    if (rc == 0 && kind == 2 && nkeys != n)
        rc = ag__err(AG_EFORMAT, "%s: line %d: a dict treespec with %d keys and %d children", r->fn,
                     r->line, nkeys, n);
    if (rc == 0 && kind == 3 && n != 0)
        rc = ag__err(AG_EFORMAT, "%s: line %d: a None treespec has no children", r->fn, r->line);
    ag_treespec *s = NULL;
    if (rc == 0) {
        s = kind == 0   ? ag_treespec_tuple(ch, n)
            : kind == 1 ? ag_treespec_list(ch, n)
            : kind == 2 ? ag_treespec_dict((const char *const *)keys, ch, n)
                        : ag_treespec_none();
    }
    for (int i = 0; i < n; i++)
        ag_treespec_release(ch[i]);
    for (int i = 0; i < nkeys; i++)
        ag__free(keys[i]);
    ag__free(ch);
    ag__free(keys);
    return s;
}

static int spec_line(rd *r, const char *key, ag_treespec **out) {
    int rc = header(r, key);
    if (rc)
        return rc;
    if (!(*out = get_spec(r, 0)))
        return ag_last_status() ? ag_last_status() : AG_ENOMEM;
    return end_of_line(r);
}

/* "key: N" with N in [0, max]; the entries follow, one a line, "  i ...". */
static int count_line(rd *r, const char *key, int *n) {
    int rc = header(r, key);
    if (rc)
        return rc;
    if (!get_int(r, n, 0, 1 << 24))
        return bad(r, "expected a count");
    return end_of_line(r);
}

static int entry_start(rd *r, int i, const char *what) {
    char msg[96];
    snprintf(msg, sizeof msg, "expected %s %d ('  %d ...')", what, i, i);
    int k;
    next_line(r);
    const char *start = r->p;
    if (!lit(r, "  ") || !get_int(r, &k, i, i) || !lit(r, " ")) {
        r->p = start;
        return bad(r, msg);
    }
    return 0;
}

#define FIELD(r, key, getter, ...)                                                                 \
    do {                                                                                           \
        const char *at_ = (r)->p;                                                                  \
        if (!lit(r, key) || !getter(r, __VA_ARGS__)) {                                             \
            (r)->p = at_;                                                                          \
            return bad(r, "expected '" key "VALUE'");                                              \
        }                                                                                          \
    } while (0)

static int read_input_info(rd *r, ag_input_info *ii, int p) {
    int rc = entry_start(r, p, "input");
    if (rc)
        return rc;
    FIELD(r, "mutates_data=", get_bool, &ii->mutates_data);
    FIELD(r, " mutates_metadata=", get_bool, &ii->mutates_metadata);
    FIELD(r, " requires_grad=", get_bool, &ii->requires_grad);
    return end_of_line(r);
}

static int read_output_info(rd *r, ag_output_info *oi, ag__out_info *ao, int k) {
    int rc = entry_start(r, k, "output");
    if (rc)
        return rc;
    int kind;
    if (!lit(r, "alias=") || !get_word(r, alias_names, NALIAS, &kind))
        return bad(r, "expected 'alias=' and an output alias kind (non_alias, is_input, "
                      "alias_of_input, alias_of_intermediate, "
                      "alias_of_intermediate_save_as_output, "
                      "alias_of_intermediate_base_is_user_output, unsafe_view_alias)");
    oi->alias = (ag_output_alias)kind;
    FIELD(r, " base_index=", get_int, &oi->base_index, -1, INT_MAX);
    FIELD(r, " requires_grad=", get_bool, &oi->requires_grad);
    FIELD(r, " geom=", get_geom, &ao->geom);
    return end_of_line(r);
}

/* " desc=REPR" up to the end of the line into a new reference *d. */
static int get_desc_field(rd *r, ag_desc **d) {
    if (!lit(r, " desc="))
        return bad(r, "expected ' desc=' and the flat input's descriptor");
    size_t n = (size_t)(r->eol - r->p);
    if (n > 0 && r->p[n - 1] == '\r')
        n--;
    char *text = ag__malloc(n + 1); /* (the text need not end in NUL: a copy of the line) */
    if (!text)
        return AG_ENOMEM;
    memcpy(text, r->p, n);
    text[n] = '\0';
    *d = ag_desc_parse(text, NULL);
    ag__free(text);
    if (*d) {
        r->p = r->eol;
        return 0;
    }
    if (ag_last_status() == AG_ENOMEM)
        return AG_ENOMEM;
    char msg[512];
    snprintf(msg, sizeof msg, "%s", ag_last_error());
    return ag__err(AG_EFORMAT, "%s: line %d: bad descriptor: %s", r->fn, r->line, msg);
}

/* A flat input's line; from version 2 on it ends with its descriptor (into *d). */
static int read_flat(rd *r, ag__flat_info *f, int i, int version, ag_desc **d) {
    int rc = entry_start(r, i, "flat input");
    if (rc)
        return rc;
    int kind;
    if (!lit(r, "kind=") || !get_word(r, flat_names, 3, &kind))
        return bad(r, "expected 'kind=' and primal, dup or view");
    f->kind = (ag__flat_kind)kind;
    FIELD(r, " primal=", get_int, &f->primal, -1, INT_MAX);
    FIELD(r, " dup_of=", get_int, &f->dup_of, -1, INT_MAX);
    FIELD(r, " metadata_mutation=", get_int, &f->metadata_mutation, -1, INT_MAX);
    FIELD(r, " geom=", get_geom, &f->geom);
    FIELD(r, " new_geom=", get_geom, &f->new_geom);
    if (version >= 2 && (rc = get_desc_field(r, d)))
        return rc;
    return end_of_line(r);
}

static int read_source(rd *r, ag__primal_info *pi, int p) {
    int rc = entry_start(r, p, "primal source");
    if (rc)
        return rc;
    int kind;
    if (!lit(r, "base=") || !get_word(r, base_names, 3, &kind))
        return bad(r, "expected 'base=' and none, view or synthetic");
    pi->base = (ag__base_kind)kind;
    FIELD(r, " flat=", get_int, &pi->flat, 0, INT_MAX);
    FIELD(r, " new_geom=", get_geom, &pi->new_geom);
    return end_of_line(r);
}

static int line_err(const char *fn, int line, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int line_err(const char *fn, int line, const char *fmt, ...) {
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return ag__err(AG_EFORMAT, "%s: line %d: %s", fn, line, msg);
}

static int hexval(char c) {
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
}

/* One creation meta (put_scmeta) into m (a cleared leaf, which ag__scmeta_clear frees at any
 * point); top: an entry, "plain GEOM" or an instance; else an inner tensor, GEOM or an
 * instance. */
static int get_scmeta(rd *r, ag__scmeta *m, int depth, bool top) {
    if (top && lit(r, "plain "))
        return get_geom(r, &m->outer) ? 0 : bad(r, "expected a geometry after 'plain '");
    const char *q = r->p;
    while (q < r->eol && (*q == '_' || (*q >= 'a' && *q <= 'z') || (*q >= 'A' && *q <= 'Z') ||
                          (q > r->p && *q >= '0' && *q <= '9')))
        q++;
    if (q == r->p || q == r->eol || *q != '(') {
        if (top)
            return bad(r, "expected 'plain GEOM' or a tensor subclass 'TYPE(GEOM; ATTR=...)'");
        return get_geom(r, &m->outer) ? 0 : bad(r, "expected a geometry or a tensor subclass");
    }
    const ag_subclass_type *type = known_type(r->p, (size_t)(q - r->p));
    if (!type)
        return ag__err(AG_EFORMAT,
                       "%s: line %d: no tensor subclass type '%.*s' is registered "
                       "(ag_subclass_type_register)",
                       r->fn, r->line, (int)(q - r->p), r->p);
    if (depth >= SPEC_MAX_DEPTH)
        return bad(r, "tensor subclasses nested more than 64 deep");
    r->p = q + 1;
    if (!get_geom(r, &m->outer))
        return bad(r, "expected the subclass tensor's geometry");
    if (!(m->inner = ag__calloc((size_t)type->ninner, sizeof *m->inner)))
        return AG_ENOMEM;
    m->type = type;
    m->nflat = 0;
    for (int k = 0; k < type->ninner; k++)
        m->inner[k].nflat = 1;
    if (type->meta_size && !(m->meta = ag__calloc(1, type->meta_size)))
        return AG_ENOMEM;
    for (int k = 0; k < type->ninner; k++) {
        char what[96];
        snprintf(what, sizeof what, "expected '%s%s=' (inner tensor %d of %s)", k ? ", " : "; ",
                 type->attrs[k], k, type->name);
        if (!lit(r, k ? ", " : "; ") || !lit(r, type->attrs[k]) || !lit(r, "="))
            return bad(r, what);
        int rc = get_scmeta(r, &m->inner[k], depth + 1, false);
        if (rc)
            return rc;
        m->nflat += m->inner[k].nflat;
    }
    if (type->meta_size) {
        char what[96];
        snprintf(what, sizeof what, "expected '; meta=' and %zu hex bytes (%s's metadata)",
                 type->meta_size, type->name);
        if (!lit(r, "; meta=") || (size_t)(r->eol - r->p) < 2 * type->meta_size)
            return bad(r, what);
        for (size_t i = 0; i < type->meta_size; i++) {
            int hi = hexval(r->p[0]), lo = hexval(r->p[1]);
            if (hi < 0 || lo < 0)
                return bad(r, what);
            ((unsigned char *)m->meta)[i] = (unsigned char)(hi * 16 + lo);
            r->p += 2;
        }
    }
    return lit(r, ")") ? 0 : bad(r, "expected ')'");
}

/* "key: N" and N entries; *out from ag__calloc (N + 1 cleared leaves). */
static int read_scmetas(rd *r, const char *key, const char *what, ag__scmeta **out, int *n) {
    int rc = count_line(r, key, n);
    if (rc)
        return rc;
    if (!(*out = ag__calloc((size_t)*n + 1, sizeof **out)))
        return AG_ENOMEM;
    for (int i = 0; i <= *n; i++)
        (*out)[i].nflat = 1;
    for (int i = 0; i < *n; i++)
        if ((rc = entry_start(r, i, what)) || (rc = get_scmeta(r, &(*out)[i], 0, true)) ||
            (rc = end_of_line(r)))
            return rc;
    return 0;
}

/* Lines of the header, for the checks against the graph. */
typedef struct lines {
    int version; /* the file's format version */
    int input_info, output_info, flat, sources, metamut, inter, in_spec, out_spec;
    int sub_in, sub_grad, sub_out; /* 0: no subclass lines */
} lines;

/* The subclass lines (after intermediate_bases) into a new j->subclass. */
static int read_subclass(rd *r, ag_joint *j, lines *L) {
    ag__subx_info *sx = ag__calloc(1, sizeof *sx);
    if (!sx)
        return AG_ENOMEM;
    sx->refcount = 1;
    j->subclass = sx;
    int ngrad = 0, rc;
    if ((rc = read_scmetas(r, "subclass_inputs", "subclass input", &sx->in, &sx->nin)))
        return rc;
    L->sub_in = r->line - sx->nin;
    ag__scmeta *grad = NULL; /* kept apart until its count is known to be nin */
    rc = read_scmetas(r, "subclass_grads", "subclass gradient", &grad, &ngrad);
    L->sub_grad = r->line - ngrad;
    if (rc == 0 && ngrad != sx->nin)
        rc = line_err(r->fn, L->sub_grad,
                      "subclass_grads lists %d gradients; subclass_inputs lists %d inputs", ngrad,
                      sx->nin);
    if (rc) {
        for (int i = 0; grad && i < ngrad; i++)
            ag__scmeta_clear(&grad[i]);
        ag__free(grad);
        return rc;
    }
    sx->grad = grad;
    if ((rc = read_scmetas(r, "subclass_outputs", "subclass output", &sx->out, &sx->nout)))
        return rc;
    L->sub_out = r->line - sx->nout;
    for (int i = 0; i < sx->nin; i++)
        sx->nflat_in += sx->in[i].nflat;
    for (int k = 0; k < sx->nout; k++)
        sx->nflat_out += sx->out[k].nflat;
    return 0;
}

/* Reads the header into j (which ag_joint_free can free at any point). */
static int read_header(rd *r, ag_joint *j, lines *L) {
    int version = 0, rc;
    if (!next_line(r) || !lit(r, FORMAT_NAME " "))
        return bad(r, "expected the header '" FORMAT_NAME " 2'");
    if (!get_int(r, &version, 0, INT_MAX) || !at_eol(r))
        return bad(r, "expected a format version after '" FORMAT_NAME " '");
    if (version < FORMAT_OLDEST || version > FORMAT_VERSION)
        return ag__err(AG_EFORMAT,
                       "%s: line 1: format version %d; this aotgrad reads versions %d to %d", r->fn,
                       version, FORMAT_OLDEST, FORMAT_VERSION);
    L->version = version;
    if ((rc = header(r, "params_spec")) || (rc = get_fqns(r, &j->params, &j->nparams)))
        return rc;
    if ((rc = header(r, "buffers_spec")) || (rc = get_fqns(r, &j->buffers, &j->nbuffers)))
        return rc;
    if ((rc = spec_line(r, "in_spec", &j->in_spec)))
        return rc;
    L->in_spec = r->line;
    if ((rc = spec_line(r, "out_spec", &j->out_spec)))
        return rc;
    L->out_spec = r->line;
    if ((rc = header(r, "needs_autograd")))
        return rc;
    if (!get_bool(r, &j->needs_autograd))
        return bad(r, "expected True or False");
    if ((rc = end_of_line(r)))
        return rc;
    int n;
    if ((rc = count_line(r, "input_info", &n)))
        return rc;
    L->input_info = r->line;
    if (!(j->in_info = ag__calloc((size_t)n + 1, sizeof *j->in_info)))
        return AG_ENOMEM;
    j->nprimals = n; /* checked against the graph below */
    for (int p = 0; p < n; p++)
        if ((rc = read_input_info(r, &j->in_info[p], p)))
            return rc;
    if ((rc = count_line(r, "output_info", &n)))
        return rc;
    L->output_info = r->line;
    ag__joint_alias *a = &j->alias;
    j->out_info = ag__calloc((size_t)n + 1, sizeof *j->out_info);
    a->out = ag__calloc((size_t)n + 1, sizeof *a->out);
    if (!j->out_info || !a->out)
        return AG_ENOMEM;
    j->nuser_out = a->nuser = n;
    for (int k = 0; k < n; k++)
        if ((rc = read_output_info(r, &j->out_info[k], &a->out[k], k)))
            return rc;
    if ((rc = count_line(r, "flat_inputs", &n)))
        return rc;
    L->flat = r->line;
    a->flat = ag__calloc((size_t)n + 1, sizeof *a->flat);
    j->flat_descs = ag__calloc((size_t)n + 1, sizeof *j->flat_descs);
    if (!a->flat || !j->flat_descs)
        return AG_ENOMEM;
    a->nflat = n;
    for (int i = 0; i < n; i++)
        if ((rc = read_flat(r, &a->flat[i], i, version, &j->flat_descs[i])))
            return rc;
    if ((rc = count_line(r, "primal_sources", &n)))
        return rc;
    L->sources = r->line;
    if (!(a->prim = ag__calloc((size_t)n + 1, sizeof *a->prim)))
        return AG_ENOMEM;
    a->nprimals = n;
    for (int p = 0; p < n; p++)
        if ((rc = read_source(r, &a->prim[p], p)))
            return rc;
    if ((rc = count_line(r, "metadata_mutations", &a->nmetadata_mutations)))
        return rc;
    L->metamut = r->line;
    if ((rc = count_line(r, "intermediate_bases", &a->nintermediate_bases)))
        return rc;
    L->inter = r->line;
    rd peek = *r;
    if (next_line(&peek) && lit(&peek, "subclass_inputs: "))
        return read_subclass(r, j, L);
    return 0;
}

/* The graph's line and column in the whole text: the parser numbers from the graph's first
 * line. */
static int graph_error(const rd *r, int first_line) {
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", ag_last_error()); /* ag__err writes where it reads */
    int status = ag_last_status() == AG_ENOMEM ? AG_ENOMEM : AG_EFORMAT;
    int l = 0, c = 0, used = 0;
    if (sscanf(msg, "line %d:%d: %n", &l, &c, &used) == 2 && used > 0)
        return ag__err(status, "%s: line %d:%d: %s", r->fn, l + first_line - 1, c, msg + used);
    return ag__err(status, "%s: the graph (from line %d): %s", r->fn, first_line, msg);
}

#define CHECK(cond, line, ...)                                                                     \
    do {                                                                                           \
        if (!(cond))                                                                               \
            return line_err(fn, line, __VA_ARGS__);                                                \
    } while (0)

/* Whether a flattened tensor's dtype and sizes are the graph value's. */
static bool same_shape(const ag_tmeta *a, const ag_tmeta *v) {
    return v && a->dtype == v->dtype && a->ndim == v->ndim &&
           !memcmp(a->sizes, v->sizes, sizeof *a->sizes * (size_t)a->ndim);
}

/* The plain tensors of m, in order, against the graph values vals[*k...] (NULL: not a
 * value, unchecked). Returns the index of the first that differs in *bad, or -1. */
static void leaves_against(const ag__scmeta *m, const ag_tmeta *const *vals, int *k, int *bad) {
    if (!m->type) {
        if (*bad < 0 && vals[*k] && !same_shape(&m->outer, vals[*k]))
            *bad = *k;
        ++*k;
        return;
    }
    for (int i = 0; i < m->type->ninner; i++)
        leaves_against(&m->inner[i], vals, k, bad);
}

/* The subclass lines against the specs, the graph's layout and its values. */
static int check_subclass(ag_joint *j, const lines *L, const char *fn, int nspec_in,
                          int nspec_out) {
    ag__subx_info *sx = j->subclass;
    const ag_layout *lay = &j->layout;
    CHECK(nspec_in == sx->nin, L->in_spec, "in_spec has %d leaves; subclass_inputs lists %d",
          nspec_in, sx->nin);
    CHECK(nspec_out == sx->nout, L->out_spec, "out_spec has %d leaves; subclass_outputs lists %d",
          nspec_out, sx->nout);
    CHECK(j->nparams + j->nbuffers <= sx->nin, L->sub_in,
          "%d subclass inputs, fewer than the %d params and buffers", sx->nin,
          j->nparams + j->nbuffers);
    CHECK(sx->nflat_in == j->alias.nflat, L->sub_in,
          "the subclass inputs flatten into %d tensors; flat_inputs lists %d", sx->nflat_in,
          j->alias.nflat);
    CHECK(sx->nflat_out == j->nuser_out, L->sub_out,
          "the subclass outputs flatten into %d tensors; the graph has %d user outputs",
          sx->nflat_out, j->nuser_out);
    for (int i = 0; i < sx->nin; i++)
        CHECK(!sx->grad[i].type || ag__scmeta_same_structure(&sx->grad[i], &sx->in[i]),
              L->sub_grad + 1 + i, "gradient %d is a %s; its input is a %s", i,
              ag__scmeta_name(&sx->grad[i]), ag__scmeta_name(&sx->in[i]));
    /* Each flat input that is a primal of its own, and each user output, has the dtype and
     * sizes the graph gives it. */
    int nv = sx->nflat_in > sx->nflat_out ? sx->nflat_in : sx->nflat_out;
    const ag_tmeta **vals = ag__calloc((size_t)nv + 1, sizeof *vals);
    if (!vals)
        return AG_ENOMEM;
    ag_node **ph = NULL;
    ag_graph_placeholders(j->g, &ph);
    int p0 = ag_layout_start(lay, AG_SEC_IN_PRIMALS);
    for (int f = 0; f < sx->nflat_in; f++) {
        const ag__flat_info *fi = &j->alias.flat[f];
        if (fi->kind == AG__FLAT_PRIMAL && j->alias.prim[fi->primal].base == AG__BASE_NONE)
            vals[f] = ag_node_val(ph[p0 + fi->primal], 0);
    }
    int rc = 0, k = 0;
    for (int i = 0; i < sx->nin && rc == 0; i++) {
        int at = -1, k0 = k;
        leaves_against(&sx->in[i], vals, &k, &at);
        if (at >= 0)
            rc = line_err(fn, L->sub_in + 1 + i,
                          "input %d's plain tensor %d (flat input %d) has another dtype or "
                          "sizes than the graph's primal",
                          i, at - k0, at);
    }
    memset(vals, 0, sizeof *vals * ((size_t)nv + 1));
    ag_node *on = ag_graph_output_node(j->g);
    int o0 = ag_layout_start(lay, AG_SEC_OUT_USER);
    const ag_garg *oa = on && ag_node_nargs(on) > 0 ? ag_node_arg(on, 0) : NULL;
    for (int u = 0; oa && oa->kind == AG_GA_NODES && u < sx->nflat_out && o0 + u < oa->n; u++) {
        ag_node *x = oa->u.nodes[o0 + u];
        vals[u] = x && ag_node_num_vals(x) == 1 ? ag_node_val(x, 0) : NULL;
    }
    k = 0;
    for (int i = 0; i < sx->nout && rc == 0; i++) {
        int at = -1, k0 = k;
        leaves_against(&sx->out[i], vals, &k, &at);
        if (at >= 0)
            rc = line_err(fn, L->sub_out + 1 + i,
                          "output %d's plain tensor %d (user output %d) has another dtype or "
                          "sizes than the graph's output",
                          i, at - k0, at);
    }
    ag__free(vals);
    return rc;
}

/* Everything the header says, against the graph's layout and itself. */
static int check_facts(ag_joint *j, const lines *L, const char *fn) {
    const ag_layout *lay = &j->layout;
    const ag__joint_alias *a = &j->alias;
    int nfw = ag_layout_count(lay, AG_SEC_IN_FW_TOKENS);
    int np = nfw + ag_layout_count(lay, AG_SEC_IN_PRIMALS);
    int npa = np - nfw; /* primals after the tokens */
    CHECK(j->nprimals == np, L->input_info,
          "input_info lists %d primals; the graph has %d (%d "
          "forward tokens and %d primals)",
          j->nprimals, np, nfw, npa);
    CHECK(j->nuser_out == ag_layout_count(lay, AG_SEC_OUT_USER), L->output_info,
          "output_info lists %d user outputs; the graph has %d", j->nuser_out,
          ag_layout_count(lay, AG_SEC_OUT_USER));
    int nmut = 0;
    for (int p = 0; p < np; p++)
        nmut += j->in_info[p].mutates_data || j->in_info[p].mutates_metadata;
    CHECK(nmut == ag_layout_count(lay, AG_SEC_OUT_MUTATIONS), L->input_info,
          "input_info says %d primals are mutated; the graph has %d input mutation outputs", nmut,
          ag_layout_count(lay, AG_SEC_OUT_MUTATIONS));
    CHECK(a->nprimals == npa, L->sources,
          "primal_sources lists %d primals; the graph has %d "
          "(after %d forward tokens)",
          a->nprimals, npa, nfw);
    CHECK(a->nmetadata_mutations == ag_layout_count(lay, AG_SEC_OUT_METADATA_MUTATIONS), L->metamut,
          "%d metadata mutations; the graph has %d metadata mutation outputs",
          a->nmetadata_mutations, ag_layout_count(lay, AG_SEC_OUT_METADATA_MUTATIONS));
    CHECK(a->nintermediate_bases == ag_layout_count(lay, AG_SEC_OUT_INTERMEDIATE_BASES), L->inter,
          "%d intermediate bases; the graph has %d intermediate base outputs",
          a->nintermediate_bases, ag_layout_count(lay, AG_SEC_OUT_INTERMEDIATE_BASES));
    CHECK(ag_layout_count(lay, AG_SEC_OUT_SAVED) == 0, L->inter + 1,
          "the graph returns saved "
          "values (a partitioned forward), not a joint");
    CHECK(j->needs_autograd || (ag_layout_count(lay, AG_SEC_IN_TANGENTS) == 0 &&
                                ag_layout_count(lay, AG_SEC_OUT_GRADS) == 0),
          L->input_info - 1, "needs_autograd is False but the graph has tangents or gradients");
    for (int p = 0; p < nfw; p++)
        CHECK(!j->in_info[p].mutates_data && !j->in_info[p].mutates_metadata &&
                  !j->in_info[p].requires_grad,
              L->input_info + 1 + p,
              "input %d is a forward token: it is not mutated and does "
              "not require grad",
              p);
    int nspec_in = ag_treespec_num_leaves(j->in_spec);
    int nspec_out = ag_treespec_num_leaves(j->out_spec);
    if (j->subclass) {
        int rc = check_subclass(j, L, fn, nspec_in, nspec_out);
        if (rc)
            return rc;
    } else {
        CHECK(nspec_in == a->nflat, L->in_spec, "in_spec has %d leaves; flat_inputs lists %d",
              nspec_in, a->nflat);
        CHECK(nspec_out == j->nuser_out, L->out_spec,
              "out_spec has %d leaves; output_info lists %d", nspec_out, j->nuser_out);
        CHECK(j->nparams + j->nbuffers <= a->nflat, L->flat,
              "%d flat inputs, fewer than the %d "
              "params and buffers",
              a->nflat, j->nparams + j->nbuffers);
    }
    for (int p = 0; p < npa; p++) {
        int line = L->sources + 1 + p;
        CHECK(a->prim[p].flat < a->nflat, line, "primal %d: flat input %d out of range [0, %d)", p,
              a->prim[p].flat, a->nflat);
    }
    for (int i = 0; i < a->nflat; i++) {
        const ag__flat_info *f = &a->flat[i];
        int line = L->flat + 1 + i;
        CHECK(f->primal >= 0 && f->primal < npa, line,
              "flat input %d: primal %d out of range "
              "[0, %d)",
              i, f->primal, npa);
        if (f->kind == AG__FLAT_DUP) {
            CHECK(f->dup_of >= 0 && f->dup_of < i && a->flat[f->dup_of].kind != AG__FLAT_DUP, line,
                  "flat input %d: dup_of %d is not an earlier flat input that is kept", i,
                  f->dup_of);
            CHECK(a->flat[f->dup_of].primal == f->primal, line,
                  "flat input %d: primal %d, but "
                  "the input it repeats (%d) is primal %d",
                  i, f->primal, f->dup_of, a->flat[f->dup_of].primal);
        }
        if (f->kind == AG__FLAT_VIEW)
            CHECK(f->metadata_mutation >= -1 && f->metadata_mutation < a->nmetadata_mutations, line,
                  "flat input %d: metadata_mutation %d out of range [-1, %d)", i,
                  f->metadata_mutation, a->nmetadata_mutations);
        if (f->kind == AG__FLAT_PRIMAL)
            CHECK(a->prim[f->primal].flat == i || a->prim[f->primal].base != AG__BASE_NONE, line,
                  "flat input %d is primal %d, whose source (line %d) is flat input %d", i,
                  f->primal, L->sources + 1 + f->primal, a->prim[f->primal].flat);
    }
    for (int k = 0; k < j->nuser_out; k++) {
        const ag_output_info *oi = &j->out_info[k];
        int line = L->output_info + 1 + k, hi = -1;
        const char *of = "";
        switch (oi->alias) {
        case AG_OUT_IS_INPUT:
        case AG_OUT_ALIAS_OF_INPUT:
            hi = npa, of = "primals";
            break;
        case AG_OUT_ALIAS_OF_INTERMEDIATE:
        case AG_OUT_ALIAS_OF_INTERMEDIATE_SAVE_AS_OUTPUT:
            hi = a->nintermediate_bases, of = "intermediate bases";
            break;
        case AG_OUT_ALIAS_OF_INTERMEDIATE_BASE_IS_USER_OUTPUT:
            hi = j->nuser_out, of = "user outputs";
            break;
        default:
            break;
        }
        if (hi >= 0)
            CHECK(oi->base_index >= 0 && oi->base_index < hi, line,
                  "output %d (%s): base_index "
                  "%d out of range [0, %d) (its base is one of the %s)",
                  k, alias_names[oi->alias], oi->base_index, hi, of);
        if (oi->alias == AG_OUT_ALIAS_OF_INTERMEDIATE_BASE_IS_USER_OUTPUT)
            CHECK(j->out_info[oi->base_index].alias == AG_OUT_NON_ALIAS ||
                      j->out_info[oi->base_index].alias == AG_OUT_UNSAFE_VIEW_ALIAS,
                  line, "output %d: its base, output %d, is itself regenerated", k, oi->base_index);
    }
    return 0;
}

/* A version 1 file's flat input descriptors, derived once as the export lays them out:
 * params_spec, buffers_spec, then the user's inputs; with subclass lines, each outer input's
 * plain inner tensors as SubclassGetAttrAOTInput of its descriptor. (check_facts has checked
 * the counts: the params and buffers fit, the subclass inputs flatten into the flat inputs.) */
static int derive_flat_descs(ag_joint *j) {
    const ag__subx_info *sx = j->subclass;
    int nouter = sx ? sx->nin : j->alias.nflat;
    ag_desc **outer = ag__calloc((size_t)nouter + 1, sizeof *outer);
    if (!outer)
        return AG_ENOMEM;
    int rc = ag__desc_module_inputs(j->params, j->nparams, j->buffers, j->nbuffers,
                                    nouter - j->nparams - j->nbuffers, outer);
    for (int i = 0, f = 0; rc == 0 && i < nouter; i++) {
        if (!sx) {
            j->flat_descs[i] = ag_desc_retain(outer[i]);
            continue;
        }
        rc = ag__scmeta_descs(&sx->in[i], outer[i], j->flat_descs + f);
        f += sx->in[i].nflat;
    }
    for (int i = 0; i < nouter; i++)
        ag_desc_release(outer[i]);
    ag__free(outer);
    return rc;
}

/* Each flat input that is a primal of its own is described as its placeholder is. */
static int check_flat_descs(const ag_joint *j, const lines *L, const char *fn) {
    ag_node **ph = NULL;
    ag_graph_placeholders(j->g, &ph);
    int p0 = ag_layout_start(&j->layout, AG_SEC_IN_PRIMALS);
    for (int i = 0; i < j->alias.nflat; i++) {
        const ag__flat_info *f = &j->alias.flat[i];
        if (f->kind != AG__FLAT_PRIMAL || j->alias.prim[f->primal].base != AG__BASE_NONE)
            continue;
        const ag_desc *want = ag_node_desc(ph[p0 + f->primal]);
        if (ag_desc_equal(j->flat_descs[i], want))
            continue;
        char a[256] = "None", b[256] = "None";
        ag_desc_repr(j->flat_descs[i], a, sizeof a);
        if (want)
            ag_desc_repr(want, b, sizeof b);
        return line_err(fn, L->version >= 2 ? L->flat + 1 + i : L->flat,
                        "flat input %d is %s%s; its primal %s is %s", i, a,
                        L->version >= 2 ? "" : " (by params_spec and buffers_spec)",
                        ag_node_name(ph[p0 + f->primal]), b);
    }
    return 0;
}

/* The descriptors and counts the joint keeps, from the layout (as the export sets them). */
static int take_layout(ag_joint *j, const lines *L, const char *fn) {
    const ag_layout *lay = &j->layout;
    int rc = L->version < 2 ? derive_flat_descs(j) : 0;
    if (rc == 0)
        rc = check_flat_descs(j, L, fn);
    if (rc)
        return rc;
    int nrng = ag_layout_count(lay, AG_SEC_IN_FW_RNG) + ag_layout_count(lay, AG_SEC_IN_BW_RNG);
    if (nrng > 4)
        return ag__err(AG_EFORMAT,
                       "%s: the graph has %d philox seed and offset inputs, at most 4 "
                       "(a seed and an offset for each side)",
                       fn, nrng);
    return 0;
}

static ag_joint *load(const char *text, size_t len, const char *fn) {
    if (len > AG_GRAPH_TEXT_MAX + ((size_t)1 << 26))
        return ag__err(AG_EFORMAT, "%s: the text is %zu bytes, more than the limit", fn, len), NULL;
    if (memchr(text, 0, len))
        return ag__err(AG_EFORMAT, "%s: the text holds a NUL byte", fn), NULL;
    rd r = {.s = text, .end = text + len, .fn = fn};
    lines L = {0};
    ag_joint *j = ag__calloc(1, sizeof *j);
    if (!j)
        return NULL;
    int rc = read_header(&r, j, &L);
    if (rc == 0) {
        next_line(&r); /* the graph starts here */
        int first = r.line;
        const char *g0 = r.p < r.end ? r.p : r.end;
        if (!(j->g = ag_graph_parse(g0, (size_t)(r.end - g0))))
            rc = graph_error(&r, first);
        else if ((rc = ag_graph_layout(j->g, 0, &j->layout)))
            rc = graph_error(&r, first);
    }
    if (rc == 0)
        rc = check_facts(j, &L, fn);
    if (rc == 0)
        rc = take_layout(j, &L, fn);
    if (rc) {
        if (rc == AG_ENOMEM && !ag__has_error())
            ag__err(AG_ENOMEM, "%s: out of memory", fn);
        ag_joint_free(j);
        return NULL;
    }
    return j;
}

ag_joint *ag_joint_load(const char *text, size_t len) {
    AG__CHECK_NULL_RET("joint_load", text, NULL);
    return load(text, len, "joint_load");
}

ag_joint *ag_joint_load_file(const char *path) {
    AG__CHECK_NULL_RET("joint_load_file", path, NULL);
    FILE *f = fopen(path, "rb");
    if (!f)
        return ag__err(AG_EIO, "joint_load_file: cannot open %s: %s", path, strerror(errno)), NULL;
    ag__sbuf b = {0};
    char chunk[65536];
    size_t n;
    bool too_big = false;
    while (!b.oom && (n = fread(chunk, 1, sizeof chunk, f)) > 0) {
        if (b.len + n > AG_GRAPH_TEXT_MAX + ((size_t)1 << 26)) {
            too_big = true;
            break;
        }
        ag__sb_putn(&b, chunk, n);
    }
    int err = ferror(f) ? errno : 0;
    fclose(f);
    if (b.oom || err || too_big) {
        ag__sb_free(&b);
        if (err)
            ag__err(AG_EIO, "joint_load_file: reading %s: %s", path, strerror(err));
        else if (too_big)
            ag__err(AG_EFORMAT, "joint_load_file: %s is larger than the limit of a saved joint",
                    path);
        return NULL;
    }
    size_t len = b.len;
    char *text = ag__sb_finish(&b);
    if (!text && len == 0)
        text = ag__strdup("");
    if (!text)
        return NULL;
    /* Errors name the file: "joint_load_file: PATH: line 3: ...". */
    char *fn = ag__malloc(strlen(path) + 32);
    ag_joint *j = NULL;
    if (fn) {
        snprintf(fn, strlen(path) + 32, "joint_load_file: %s", path);
        j = load(text, len, fn);
        ag__free(fn);
    }
    ag__free(text);
    return j;
}
