/* The graph parser: text (docs/GRAPH_FORMAT.md) in, a graph out, or NULL with the first
 * problem as "line L:C: expected ..., got ...".
 *
 * The text is untrusted: any byte string gives a graph or a clean error, never a crash, a hang,
 * a leak or undefined behaviour (fuzz/fuzz_parse.c checks this). So: the input is copied once
 * and split into NUL-terminated lines, and every reader below stops at a line's end; nothing
 * recurses except descriptors (bounded by AG_DESC_MAX_DEPTH); sizes in VALs are bounded so no
 * meta computation overflows; constants allocate only what their values in the text fill.
 *
 * Graphs are built through the public graph API only, so a parsed graph is as well formed as
 * any other: calls get their vals from the op's meta function (the VAL in the text is then
 * compared with it), getitem reads its source's val, get_attr its constant's.
 *
 * Order of work: a pre-pass indexes the `constant` lines by name (a constant is used before its
 * line), then the lines are read in order; a constant's values are parsed when a get_attr
 * first uses it, and unused ones when their line is reached. Strings, lists and names read
 * while parsing one line live in a pool freed when the line is done. */
#include "text_internal.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

/* Limits for untrusted text. Real graphs are far below them. */
#define MAX_LIST 65536             /* elements of one list */
#define MAX_EXTENT (INT64_C(1) << 52) /* elements a VAL may span (sizes, strides, offset) */
#define CONST_SLACK 65536          /* storage a strided constant may have beyond 4 x numel */
#define MAX_NUMBER 400             /* characters of one number */

typedef struct centry {
    char *name;
    int li;          /* line index */
    int dup_of;      /* line index of an earlier constant of the same name, or -1 */
    bool parsed;
    ag_tensor *t;    /* owned once parsed */
} centry;

typedef struct parser {
    char *buf; /* the text, each line NUL-terminated */
    char **lines;
    int nlines;
    ag_graph *g;
    centry *ce;
    int64_t nce, ce_cap;
    ag__strmap consts; /* name -> centry index + 1 */
    void **pool;       /* allocations of the current line */
    int64_t npool, pool_cap;
    int64_t *ints;     /* scratch for int lists */
    int64_t ints_cap;
    void **ptrs;       /* scratch for node lists and descriptor lists */
    int64_t ptrs_cap;
    char *bytes;       /* scratch for constant values */
    int64_t bytes_cap;
    ag__sbuf trace;    /* continuation lines read so far */
    ag_node *last;     /* the node continuation lines would belong to */
    bool seen_other;   /* a non-placeholder node was read */
} parser;

/* A position: a line and a cursor in it. */
typedef struct cur {
    parser *P;
    int li;
    const char *line;
    const char *p;
} cur;

/* ---- errors ---- */

/* A short description of the text at s for "got ...". */
static const char *got(const char *s, char *buf, size_t n) {
    unsigned char c = (unsigned char)*s;
    if (!c) {
        snprintf(buf, n, "end of line");
    } else if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
               c == '_') {
        size_t k = 0;
        while (k < 24 && ((s[k] >= 'a' && s[k] <= 'z') || (s[k] >= 'A' && s[k] <= 'Z') ||
                          (s[k] >= '0' && s[k] <= '9') || s[k] == '_'))
            k++;
        snprintf(buf, n, "'%.*s%s'", (int)k, s, k == 24 ? "..." : "");
    } else if (c >= 0x20 && c < 0x7f) {
        snprintf(buf, n, "'%c'", c);
    } else {
        snprintf(buf, n, "byte 0x%02x", c);
    }
    return buf;
}

static int perr(const cur *c, const char *at, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int perr(const cur *c, const char *at, const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return ag__err(AG_EFORMAT, "line %d:%d: %s", c->li + 1, (int)(at - c->line) + 1, msg);
}

/* "expected WHAT, got ..." at the cursor. */
static int expected(const cur *c, const char *what) {
    char g[64];
    return perr(c, c->p, "expected %s, got %s", what, got(c->p, g, sizeof g));
}

/* A graph API call failed: its message, placed at `at` and naming the node (out of memory
 * stays out of memory). */
static int api_err(const cur *c, const char *at, const char *node) {
    if (ag_last_status() == AG_ENOMEM)
        return AG_ENOMEM;
    char msg[768];
    snprintf(msg, sizeof msg, "%s", ag_last_error());
    return perr(c, at, "%%%s: %s", node, msg);
}

/* ---- the line pool ---- */

static void *pool_alloc(parser *P, size_t n) {
    if (ag__grow((void **)&P->pool, &P->pool_cap, P->npool + 1, sizeof *P->pool))
        return NULL;
    void *p = ag__malloc(n);
    if (p)
        P->pool[P->npool++] = p;
    return p;
}

static void pool_clear(parser *P) {
    for (int64_t i = 0; i < P->npool; i++)
        ag__free(P->pool[i]);
    P->npool = 0;
}

/* ---- lexing ---- */

static bool ident_start(char ch) {
    return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || ch == '_';
}
static bool ident_char(char ch) { return ident_start(ch) || (ch >= '0' && ch <= '9'); }

static void skip_ws(cur *c) {
    while (*c->p == ' ' || *c->p == '\t')
        c->p++;
}

/* Consumes `ch` (after blanks) when it is next. */
static bool accept(cur *c, char ch) {
    skip_ws(c);
    if (*c->p != ch)
        return false;
    c->p++;
    return true;
}

static int expect(cur *c, char ch, const char *what) {
    if (accept(c, ch))
        return 0;
    return expected(c, what);
}

/* Consumes the word w (after blanks) when it is next and not followed by an identifier
 * character. */
static bool accept_word(cur *c, const char *w) {
    skip_ws(c);
    size_t n = strlen(w);
    if (strncmp(c->p, w, n) || ident_char(c->p[n]))
        return false;
    c->p += n;
    return true;
}

/* Length of the identifier at s (0 if none). */
static size_t ident_len(const char *s) {
    if (!ident_start(*s))
        return 0;
    size_t n = 1;
    while (ident_char(s[n]))
        n++;
    return n;
}

static int hexval(char ch) {
    if (ch >= '0' && ch <= '9')
        return ch - '0';
    if (ch >= 'a' && ch <= 'f')
        return ch - 'a' + 10;
    if (ch >= 'A' && ch <= 'F')
        return ch - 'A' + 10;
    return -1;
}

static size_t utf8_encode(uint32_t cp, char *out) {
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (char)(0xc0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3f));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (char)(0xe0 | (cp >> 12));
        out[1] = (char)(0x80 | ((cp >> 6) & 0x3f));
        out[2] = (char)(0x80 | (cp & 0x3f));
        return 3;
    }
    out[0] = (char)(0xf0 | (cp >> 18));
    out[1] = (char)(0x80 | ((cp >> 12) & 0x3f));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3f));
    out[3] = (char)(0x80 | (cp & 0x3f));
    return 4;
}

/* A Python string literal at the cursor (single or double quotes, Python's escapes; \udc80 ..
 * \udcff stand for raw bytes). The decoded string (pool-owned, NUL-terminated) never holds a
 * NUL: that is an error. */
static int parse_str(cur *c, char **out) {
    skip_ws(c);
    const char *open = c->p;
    char q = *c->p;
    if (q != '\'' && q != '"')
        return expected(c, "a quoted string");
    const char *s = c->p + 1;
    size_t span = 0;
    while (s[span] && s[span] != q)
        span += s[span] == '\\' && s[span + 1] ? 2 : 1;
    if (!s[span])
        return perr(c, open, "unterminated string");
    /* Escapes never decode to more bytes than they are written with. */
    char *o = pool_alloc(c->P, span + 1);
    if (!o)
        return AG_ENOMEM;
    size_t k = 0;
    for (size_t i = 0; i < span;) {
        const char *at = s + i;
        if (s[i] != '\\') {
            o[k++] = s[i++];
            continue;
        }
        char e = s[i + 1];
        i += 2;
        uint32_t cp;
        int digits = 0;
        switch (e) {
        case '\\': case '\'': case '"': cp = (uint32_t)e; break;
        case 'n': cp = '\n'; break;
        case 't': cp = '\t'; break;
        case 'r': cp = '\r'; break;
        case 'a': cp = 7; break;
        case 'b': cp = 8; break;
        case 'f': cp = 12; break;
        case 'v': cp = 11; break;
        case 'x': digits = 2; break;
        case 'u': digits = 4; break;
        case 'U': digits = 8; break;
        default:
            if (e >= '0' && e <= '7') {
                cp = (uint32_t)(e - '0');
                for (int d = 0; d < 2 && s[i] >= '0' && s[i] <= '7'; d++)
                    cp = cp * 8 + (uint32_t)(s[i++] - '0');
            } else {
                /* Python keeps an unknown escape as written. */
                o[k++] = '\\';
                o[k++] = e;
                continue;
            }
        }
        if (digits) {
            cp = 0;
            for (int d = 0; d < digits; d++) {
                int h = i < span ? hexval(s[i]) : -1;
                if (h < 0)
                    return perr(c, at, "bad \\%c escape: expected %d hex digits", e, digits);
                cp = cp * 16 + (uint32_t)h;
                i++;
            }
        }
        if (cp == 0)
            return perr(c, at, "a string may not contain a NUL character");
        if (cp >= 0xdc80 && cp <= 0xdcff) {
            o[k++] = (char)(cp - 0xdc00);
        } else if ((cp >= 0xd800 && cp <= 0xdfff) || cp > 0x10ffff) {
            return perr(c, at, "bad escape: code point 0x%x", (unsigned)cp);
        } else {
            k += utf8_encode(cp, o + k);
        }
    }
    o[k] = 0;
    c->p = s + span + 1;
    *out = o;
    return 0;
}

/* A name: [A-Za-z0-9_]+ or a quoted string (pool-owned). */
static int parse_name(cur *c, char **out, const char *what) {
    if (*c->p == '\'' || *c->p == '"') {
        const char *at = c->p;
        int rc = parse_str(c, out);
        if (rc == 0 && !**out)
            return perr(c, at, "empty %s", what);
        return rc;
    }
    size_t n = 0;
    while (ident_char(c->p[n]))
        n++;
    if (!n)
        return expected(c, what);
    char *o = pool_alloc(c->P, n + 1);
    if (!o)
        return AG_ENOMEM;
    memcpy(o, c->p, n);
    o[n] = 0;
    c->p += n;
    *out = o;
    return 0;
}

/* A number at the cursor: an int (-?[0-9]+) or a float (with '.' or an exponent, or inf,
 * -inf, nan). `single` reads floats with strtof into *f. */
static int parse_number(cur *c, bool *is_float, int64_t *iv, double *f, bool single) {
    skip_ws(c);
    const char *start = c->p, *s = c->p;
    bool neg = *s == '-';
    if (neg)
        s++;
    size_t w = ident_len(s);
    if ((w == 3 && !strncmp(s, "inf", 3)) || (!neg && w == 3 && !strncmp(s, "nan", 3))) {
        *is_float = true;
        *f = s[0] == 'n' ? NAN : neg ? -INFINITY : INFINITY;
        c->p = s + 3;
        return 0;
    }
    if (*s < '0' || *s > '9')
        return expected(c, "a number");
    while (*s >= '0' && *s <= '9')
        s++;
    bool flt = false;
    if (*s == '.') {
        flt = true;
        s++;
        while (*s >= '0' && *s <= '9')
            s++;
    }
    if (*s == 'e' || *s == 'E') {
        flt = true;
        s++;
        if (*s == '+' || *s == '-')
            s++;
        if (*s < '0' || *s > '9') {
            c->p = s;
            return expected(c, "exponent digits");
        }
        while (*s >= '0' && *s <= '9')
            s++;
    }
    size_t len = (size_t)(s - start);
    if (len > MAX_NUMBER)
        return perr(c, start, "number too long");
    *is_float = flt;
    if (flt) {
        char tmp[MAX_NUMBER + 1];
        memcpy(tmp, start, len);
        tmp[len] = 0;
        *f = single ? (double)strtof(tmp, NULL) : strtod(tmp, NULL);
    } else {
        uint64_t v = 0, lim = neg ? (uint64_t)INT64_MAX + 1 : (uint64_t)INT64_MAX;
        for (const char *d = start + neg; d < s; d++) {
            uint64_t dig = (uint64_t)(*d - '0');
            if (v > (lim - dig) / 10)
                return perr(c, start, "integer out of range");
            v = v * 10 + dig;
        }
        *iv = neg ? (int64_t)(0 - v) : (int64_t)v;
    }
    c->p = s;
    return 0;
}

static int parse_int(cur *c, int64_t *v, const char *what) {
    skip_ws(c);
    const char *at = c->p;
    bool flt = false;
    double f;
    int rc = parse_number(c, &flt, v, &f, false);
    if (rc)
        return rc;
    if (flt)
        return perr(c, at, "expected %s (an int), got a float", what);
    return 0;
}

/* ---- VALs ---- */

static bool checked_madd(int64_t *acc, int64_t a, int64_t b) {
    int64_t t;
    return !__builtin_mul_overflow(a, b, &t) && !__builtin_add_overflow(*acc, t, acc) &&
           *acc <= MAX_EXTENT;
}

/* DTYPE[SIZES]{STRIDES}+OFFSET, with bounds that keep every size computation in range. */
static int parse_val(cur *c, ag_tmeta *m) {
    skip_ws(c);
    memset(m, 0, sizeof *m);
    const char *at = c->p;
    static const char *const names[AG_NDTYPES] = {"f32", "f64", "i64", "b8"};
    size_t w = ident_len(c->p);
    int dt = -1;
    for (int i = 0; i < AG_NDTYPES; i++)
        if (w == strlen(names[i]) && !strncmp(c->p, names[i], w))
            dt = i;
    if (dt < 0)
        return expected(c, "a VAL (f32, f64, i64 or b8 and its sizes)");
    c->p += w;
    m->dtype = (ag_dtype)dt;
    int rc = expect(c, '[', "'['");
    if (rc)
        return rc;
    if (!accept(c, ']')) {
        for (;;) {
            skip_ws(c);
            const char *sat = c->p;
            if (m->ndim == AG_MAX_DIMS)
                return perr(c, sat, "more than %d dimensions", AG_MAX_DIMS);
            if ((rc = parse_int(c, &m->sizes[m->ndim], "a size")))
                return rc;
            if (m->sizes[m->ndim] < 0 || m->sizes[m->ndim] > MAX_EXTENT)
                return perr(c, sat, "size %lld out of range", (long long)m->sizes[m->ndim]);
            m->ndim++;
            if (accept(c, ']'))
                break;
            if ((rc = expect(c, ',', "',' or ']'")))
                return rc;
        }
    }
    /* Contiguous strides, and a bound on the product of the sizes. */
    int64_t st = 1;
    for (int i = m->ndim - 1; i >= 0; i--) {
        m->strides[i] = st;
        int64_t s = m->sizes[i] > 1 ? m->sizes[i] : 1;
        if (__builtin_mul_overflow(st, s, &st) || st > MAX_EXTENT)
            return perr(c, at, "VAL too large (more than 2^52 elements)");
    }
    if (*c->p == '{') { /* strides follow ']' directly: "  {" after a VAL is a custom dict */
        c->p++;
        int k = 0;
        if (!accept(c, '}')) {
            for (;;) {
                skip_ws(c);
                const char *sat = c->p;
                if (k == m->ndim)
                    return perr(c, sat, "more strides than the %d sizes", m->ndim);
                if ((rc = parse_int(c, &m->strides[k], "a stride")))
                    return rc;
                if (m->strides[k] < 0 || m->strides[k] > MAX_EXTENT)
                    return perr(c, sat, "stride %lld out of range", (long long)m->strides[k]);
                k++;
                if (accept(c, '}'))
                    break;
                if ((rc = expect(c, ',', "',' or '}'")))
                    return rc;
            }
        }
        if (k != m->ndim)
            return perr(c, at, "%d strides for %d sizes", k, m->ndim);
    }
    if (*c->p == '+') {
        c->p++;
        const char *oat = c->p;
        if ((rc = parse_int(c, &m->offset, "an offset")))
            return rc;
        if (m->offset < 0 || m->offset > MAX_EXTENT)
            return perr(c, oat, "offset %lld out of range", (long long)m->offset);
    }
    int64_t extent = m->offset;
    for (int i = 0; i < m->ndim; i++)
        if (m->sizes[i] > 0 && !checked_madd(&extent, m->sizes[i] - 1, m->strides[i]))
            return perr(c, at, "VAL spans too much storage (more than 2^52 elements)");
    return 0;
}

/* Why a VAL an op inferred could not be written back in the text (the bounds parse_val
 * enforces), or NULL. Meta functions should refuse such shapes themselves; this keeps every
 * accepted text a fixed point of print(parse(...)) even where one does not. */
static const char *val_out_of_range(const ag_tmeta *m) {
    if (m->ndim < 0 || m->ndim > AG_MAX_DIMS)
        return "a bad number of dimensions";
    int64_t numel = 1, extent = m->offset;
    if (m->offset < 0 || m->offset > MAX_EXTENT)
        return "an offset out of range";
    for (int i = 0; i < m->ndim; i++) {
        if (m->sizes[i] < 0 || m->sizes[i] > MAX_EXTENT)
            return "a size out of range";
        if (m->strides[i] < 0 || m->strides[i] > MAX_EXTENT)
            return "a stride out of range";
        if (__builtin_mul_overflow(numel, m->sizes[i] > 1 ? m->sizes[i] : 1, &numel) ||
            numel > MAX_EXTENT)
            return "more than 2^52 elements";
        if (m->sizes[i] > 0 && !checked_madd(&extent, m->sizes[i] - 1, m->strides[i]))
            return "a span of more than 2^52 elements";
    }
    return NULL;
}

/* A node's VALs: VAL, or a tuple "(VAL, ...)" / "()" / "(VAL,)". */
static int parse_vals(cur *c, ag_tmeta *vals, int *n) {
    *n = 0;
    if (!accept(c, '('))
        return (*n = 1, parse_val(c, &vals[0]));
    if (accept(c, ')'))
        return 0;
    for (;;) {
        skip_ws(c);
        if (*n == AG_MAX_OUTPUTS)
            return perr(c, c->p, "more than %d outputs", AG_MAX_OUTPUTS);
        int rc = parse_val(c, &vals[(*n)++]);
        if (rc)
            return rc;
        if (accept(c, ')'))
            return 0;
        if ((rc = expect(c, ',', "',' or ')'")))
            return rc;
        if (accept(c, ')'))
            return 0;
    }
}

/* Formats vals as the printer does, into the pool (for messages). */
static const char *vals_str(parser *P, const ag_tmeta *v, int n, bool tuple) {
    ag__sbuf b = {0};
    if (tuple)
        ag__sb_putc(&b, '(');
    for (int i = 0; i < n; i++) {
        if (i)
            ag__sb_puts(&b, ", ");
        ag__sb_val(&b, &v[i]);
    }
    if (tuple)
        ag__sb_puts(&b, n == 1 ? ",)" : ")");
    char *s = ag__sb_finish(&b);
    if (!s)
        return "?";
    if (ag__grow((void **)&P->pool, &P->pool_cap, P->npool + 1, sizeof *P->pool)) {
        ag__free(s);
        return "?";
    }
    P->pool[P->npool++] = s;
    return s;
}

/* `# VAL` after a call: checks it against the vals the graph inferred. */
static int check_vals(cur *c, ag_node *n) {
    skip_ws(c);
    const char *at = c->p;
    ag_tmeta vals[AG_MAX_OUTPUTS];
    int nv;
    int rc = parse_vals(c, vals, &nv);
    if (rc)
        return rc;
    bool same = nv == ag_node_num_vals(n);
    for (int i = 0; same && i < nv; i++)
        same = ag__tmeta_equal(&vals[i], ag_node_val(n, i));
    if (!same) {
        bool tuple = nv != 1 || ag_node_num_vals(n) != 1;
        const char *given = vals_str(c->P, vals, nv, tuple);
        const char *inferred = vals_str(c->P, ag_node_val(n, 0), ag_node_num_vals(n), tuple);
        return perr(c, at, "%%%s: VAL %s does not match the inferred %s", ag_node_name(n), given,
                    inferred);
    }
    return 0;
}

/* ---- metadata items ---- */

/* A metadata value: None, True, False, a number or a string. */
static int parse_mval(cur *c, ag_mval *v) {
    skip_ws(c);
    if (accept_word(c, "None"))
        return (*v = (ag_mval){.kind = AG_MV_NONE}, 0);
    if (accept_word(c, "True"))
        return (*v = (ag_mval){.kind = AG_MV_BOOL, .u.b = true}, 0);
    if (accept_word(c, "False"))
        return (*v = (ag_mval){.kind = AG_MV_BOOL, .u.b = false}, 0);
    if (*c->p == '\'' || *c->p == '"') {
        char *s;
        int rc = parse_str(c, &s);
        *v = (ag_mval){.kind = AG_MV_STR, .u.s = s};
        return rc;
    }
    if ((*c->p >= '0' && *c->p <= '9') || *c->p == '-' || !strncmp(c->p, "inf", 3) ||
        !strncmp(c->p, "nan", 3)) {
        bool flt = false;
        int64_t i = 0;
        double f = 0;
        int rc = parse_number(c, &flt, &i, &f, false);
        if (rc)
            return rc;
        *v = flt ? (ag_mval){.kind = AG_MV_FLOAT, .u.f = f} : (ag_mval){.kind = AG_MV_INT, .u.i = i};
        return 0;
    }
    return expected(c, "a value (None, True, False, a number or a string)");
}

static int parse_custom(cur *c, ag_node *n) {
    if (accept(c, '}'))
        return 0;
    for (;;) {
        skip_ws(c);
        char *key;
        int rc = parse_str(c, &key);
        if (rc)
            return rc;
        if ((rc = expect(c, ':', "':'")))
            return rc;
        skip_ws(c);
        const char *vat = c->p;
        ag_mval v;
        if ((rc = parse_mval(c, &v)))
            return rc;
        if (v.kind == AG_MV_NONE)
            return perr(c, vat, "custom annotation '%s' may not be None", key);
        if (ag_node_custom_set(n, key, v))
            return api_err(c, vat, ag_node_name(n));
        if (accept(c, '}'))
            return 0;
        if ((rc = expect(c, ',', "',' or '}'")))
            return rc;
        if (accept(c, '}'))
            return 0;
    }
}

static const char *const tags[] = {"is_forward", "is_backward", "must_be_in_forward",
                                   "must_be_in_backward"};
static const char *const recomputes[] = {"MUST_SAVE", "PREFER_SAVE", "MUST_RECOMPUTE",
                                         "PREFER_RECOMPUTE"};

/* A bare item word (a partitioner tag or gradient_acc): true when `word` is one. */
static int bare_item(cur *c, ag_node *n, const char *word, size_t w, bool *done) {
    *done = true;
    for (size_t i = 0; i < 4; i++)
        if (strlen(tags[i]) == w && !strncmp(word, tags[i], w))
            return ag_node_set_partitioner_tag(n, tags[i]) ? api_err(c, word, ag_node_name(n)) : 0;
    if (w == 12 && !strncmp(word, "gradient_acc", 12))
        return ag_node_set_gradient_acc(n, true) ? api_err(c, word, ag_node_name(n)) : 0;
    *done = false;
    return 0;
}

static bool is_value_word(const char *s, size_t w) {
    static const char *const words[] = {"None", "True", "False", "inf", "nan"};
    for (size_t i = 0; i < 5; i++)
        if (strlen(words[i]) == w && !strncmp(s, words[i], w))
            return true;
    return false;
}

/* The items after a node's VAL or descriptor, to the end of the line: a custom dict, bare
 * words (tags, gradient_acc) and key=VALUE pairs (recompute=POLICY among them). */
static int parse_items(cur *c, ag_node *n) {
    for (;;) {
        skip_ws(c);
        if (!*c->p)
            return 0;
        int rc;
        if (*c->p == '{') {
            c->p++;
            if ((rc = parse_custom(c, n)))
                return rc;
            continue;
        }
        char *key = NULL;
        size_t w = ident_len(c->p);
        if (*c->p == '\'' || *c->p == '"') {
            if ((rc = parse_str(c, &key)))
                return rc;
        } else if (w) {
            cur peek = *c;
            peek.p += w;
            skip_ws(&peek);
            if (*peek.p != '=') {
                bool done;
                if ((rc = bare_item(c, n, c->p, w, &done)))
                    return rc;
                if (!done)
                    return expected(c, "a metadata item");
                c->p += w;
                continue;
            }
            if (!(key = pool_alloc(c->P, w + 1)))
                return AG_ENOMEM;
            memcpy(key, c->p, w);
            key[w] = 0;
            c->p += w;
        } else {
            return expected(c, "a metadata item");
        }
        if ((rc = expect(c, '=', "'='")))
            return rc;
        skip_ws(c);
        const char *vat = c->p;
        size_t vw = ident_len(c->p);
        ag_mval v = {0};
        int r = -1;
        if (!strcmp(key, "recompute") && vw && !is_value_word(c->p, vw)) {
            for (int i = 0; i < 4; i++)
                if (strlen(recomputes[i]) == vw && !strncmp(c->p, recomputes[i], vw))
                    r = i;
            if (r < 0)
                return expected(c, "MUST_SAVE, PREFER_SAVE, MUST_RECOMPUTE or PREFER_RECOMPUTE");
            c->p += vw;
            v = (ag_mval){.kind = AG_MV_STR, .u.s = recomputes[r]};
        } else if ((rc = parse_mval(c, &v))) {
            return rc;
        }
        if (ag_node_meta_set(n, key, v))
            return api_err(c, vat, ag_node_name(n));
    }
}

/* ---- descriptors ---- */

/* One descriptor repr at the cursor (or None: *d = NULL). ag_desc_parse's column is turned
 * into this line's. */
static int parse_desc(cur *c, ag_desc **d) {
    skip_ws(c);
    *d = NULL;
    if (accept_word(c, "None"))
        return 0;
    size_t used = 0;
    const char *at = c->p;
    *d = ag_desc_parse(at, &used);
    if (*d) {
        c->p = at + used;
        return 0;
    }
    if (ag_last_status() == AG_ENOMEM)
        return AG_ENOMEM;
    char msg[768];
    snprintf(msg, sizeof msg, "%s", ag_last_error());
    size_t col = 0;
    int off = 0;
    if (sscanf(msg, "desc: column %zu: %n", &col, &off) == 1 && off > 0 && col <= strlen(at))
        return perr(c, at + col, "bad descriptor: %s", msg + off);
    return perr(c, at, "bad descriptor: %s", msg);
}

/* ---- arguments ---- */

static int parse_ref(cur *c, ag_node **out);

static bool is_list_type(ag_type t) { return t == AG_TY_TENSOR_LIST || t == AG_TY_OPT_TENSOR_LIST; }

/* [ints] or [%nodes / None]; an empty list takes the kind the schema wants. */
static int parse_list(cur *c, ag_type ty, ag_garg *out) {
    parser *P = c->P;
    c->p++; /* '[' */
    skip_ws(c);
    bool nodes = *c->p == '%' || (!strncmp(c->p, "None", 4) && !ident_char(c->p[4]));
    int n = 0, rc;
    if (*c->p == ']') {
        c->p++;
        nodes = is_list_type(ty);
    } else {
        for (;;) {
            skip_ws(c);
            if (n == MAX_LIST)
                return perr(c, c->p, "list longer than %d elements", MAX_LIST);
            if (nodes) {
                if (ag__grow((void **)&P->ptrs, &P->ptrs_cap, n + 1, sizeof *P->ptrs))
                    return AG_ENOMEM;
                ag_node *nd = NULL;
                if (!accept_word(c, "None")) {
                    if (*c->p != '%')
                        return expected(c, "a node or None");
                    if ((rc = parse_ref(c, &nd)))
                        return rc;
                }
                P->ptrs[n++] = nd;
            } else {
                if (ag__grow((void **)&P->ints, &P->ints_cap, n + 1, sizeof *P->ints))
                    return AG_ENOMEM;
                if ((rc = parse_int(c, &P->ints[n++], "a list element")))
                    return rc;
            }
            if (accept(c, ']'))
                break;
            if ((rc = expect(c, ',', "',' or ']'")))
                return rc;
            if (accept(c, ']'))
                break;
        }
    }
    size_t es = nodes ? sizeof(ag_node *) : sizeof(int64_t);
    void *v = pool_alloc(P, es * (size_t)(n ? n : 1));
    if (!v)
        return AG_ENOMEM;
    if (n)
        memcpy(v, nodes ? (void *)P->ptrs : (void *)P->ints, es * (size_t)n);
    *out = nodes ? AG_GA_NODES((ag_node **)v, n) : AG_GA_INTS((int64_t *)v, n);
    return 0;
}

static int parse_arg(cur *c, ag_type ty, ag_garg *out) {
    skip_ws(c);
    char ch = *c->p;
    int rc;
    if (ch == '%') {
        ag_node *n;
        if ((rc = parse_ref(c, &n)))
            return rc;
        *out = AG_GA_N(n);
        return 0;
    }
    if (ch == '[')
        return parse_list(c, ty, out);
    if (ch == '\'' || ch == '"') {
        char *s;
        if ((rc = parse_str(c, &s)))
            return rc;
        *out = AG_GA_S(s);
        return 0;
    }
    if (accept_word(c, "None"))
        return (*out = AG_GA_NIL, 0);
    if (accept_word(c, "True"))
        return (*out = AG_GA_B(true), 0);
    if (accept_word(c, "False"))
        return (*out = AG_GA_B(false), 0);
    if (!strncmp(c->p, "torch.", 6)) {
        static const char *const dts[AG_NDTYPES] = {"float32", "float64", "int64", "bool"};
        const char *w = c->p + 6;
        size_t n = ident_len(w);
        for (int i = 0; i < AG_NDTYPES; i++)
            if (n == strlen(dts[i]) && !strncmp(w, dts[i], n)) {
                c->p = w + n;
                *out = AG_GA_DT((ag_dtype)i);
                return 0;
            }
        c->p = w;
        return expected(c, "float32, float64, int64 or bool");
    }
    if ((ch >= '0' && ch <= '9') || ch == '-' || !strncmp(c->p, "inf", 3) ||
        !strncmp(c->p, "nan", 3)) {
        bool flt = false;
        int64_t i = 0;
        double f = 0;
        if ((rc = parse_number(c, &flt, &i, &f, false)))
            return rc;
        *out = flt ? AG_GA_F(f) : AG_GA_I(i);
        return 0;
    }
    return expected(c, "an argument");
}

/* The schema default of argument i as a graph argument (pointers borrowed from the schema). */
static bool default_garg(const ag_schema_arg *sa, ag_garg *out) {
    if (!sa->has_default)
        return false;
    const ag_arg *d = &sa->def;
    switch (d->kind) {
    case AG_ARG_NONE: *out = AG_GA_NIL; return true;
    case AG_ARG_INT: *out = AG_GA_I(d->u.i); return true;
    case AG_ARG_FLOAT: *out = AG_GA_F(d->u.f); return true;
    case AG_ARG_BOOL: *out = AG_GA_B(d->u.b); return true;
    case AG_ARG_INTS: *out = AG_GA_INTS(d->u.ints, d->n); return true;
    case AG_ARG_DTYPE: *out = AG_GA_DT(d->u.dt); return true;
    case AG_ARG_STR: *out = AG_GA_S(d->u.s); return true;
    default: return false;
    }
}

/* "(ARGS)" of a call: positional arguments, then name=value ones (any argument may be given
 * by name); arguments left out before the last one given take their defaults. */
static int parse_args(cur *c, const ag_op *op, ag_garg *args, int *nargs) {
    int nop = ag_op_nargs(op), pos = 0, top = 0, rc;
    bool set[AG_MAX_ARGS] = {false}, kw = false;
    if (!accept(c, ')')) {
        for (;;) {
            skip_ws(c);
            const char *at = c->p;
            int idx = -1;
            size_t w = ident_len(c->p);
            if (w) {
                cur peek = *c;
                peek.p += w;
                skip_ws(&peek);
                if (*peek.p == '=') {
                    for (int i = 0; i < nop; i++) {
                        const char *nm = ag_op_arg(op, i)->name;
                        if (strlen(nm) == w && !strncmp(nm, at, w))
                            idx = i;
                    }
                    if (idx < 0)
                        return perr(c, at, "%s has no argument '%.*s'", ag_op_name(op), (int)w, at);
                    if (set[idx])
                        return perr(c, at, "argument '%s' given twice", ag_op_arg(op, idx)->name);
                    kw = true;
                    c->p = peek.p + 1;
                }
            }
            if (idx < 0) {
                if (kw)
                    return perr(c, at, "positional argument after keyword arguments");
                if (pos >= nop)
                    return perr(c, at, "%s takes %d argument%s", ag_op_name(op), nop,
                                nop == 1 ? "" : "s");
                idx = pos++;
            }
            if ((rc = parse_arg(c, ag_op_arg(op, idx)->type, &args[idx])))
                return rc;
            set[idx] = true;
            if (idx + 1 > top)
                top = idx + 1;
            if (accept(c, ')'))
                break;
            if ((rc = expect(c, ',', "',' or ')'")))
                return rc;
            if (accept(c, ')'))
                break;
        }
    }
    for (int i = 0; i < top; i++)
        if (!set[i] && !default_garg(ag_op_arg(op, i), &args[i]))
            return perr(c, c->p - 1, "%s: missing argument '%s'", ag_op_name(op),
                        ag_op_arg(op, i)->name);
    *nargs = top;
    return 0;
}

/* ---- node references ---- */

/* The line index (in [from, to)) of a node line defining `name`, or -1. */
static int find_def_line(parser *P, const char *name, int from, int to) {
    size_t n = strlen(name);
    for (int li = from; li < to; li++) {
        const char *s = P->lines[li];
        if (*s != ' ')
            continue;
        while (*s == ' ')
            s++;
        if (*s++ != '%')
            continue;
        if (*s == '\'' || *s == '"') {
            cur t = {P, li, P->lines[li], s};
            char *nm;
            if (parse_name(&t, &nm, "name") || strcmp(nm, name))
                continue;
            s = t.p;
        } else {
            if (strncmp(s, name, n) || ident_char(s[n]))
                continue;
            s += n;
        }
        while (*s == ' ' || *s == '\t')
            s++;
        if (*s == ':' || *s == '=')
            return li;
    }
    return -1;
}

static int parse_ref(cur *c, ag_node **out) {
    skip_ws(c);
    const char *at = c->p;
    if (*c->p != '%')
        return expected(c, "'%name'");
    c->p++;
    char *name;
    int rc = parse_name(c, &name, "a node name");
    if (rc)
        return rc;
    ag_node *n = ag_graph_find(c->P->g, name);
    if (!n || ag_node_kind_of(n) == AG_NODE_OUTPUT) {
        int li = find_def_line(c->P, name, c->li, c->P->nlines);
        if (li >= 0)
            return perr(c, at, "%%%s is used before its definition on line %d", name, li + 1);
        return perr(c, at, "unknown node %%%s", name);
    }
    *out = n;
    return 0;
}

/* ---- constants ---- */

static int parse_constant(parser *P, centry *e);

/* Stores one parsed value of a constant at element offset `off`. */
static int const_value(cur *c, ag_dtype dt, char *dst) {
    skip_ws(c);
    const char *at = c->p;
    if (dt == AG_BOOL) {
        if (accept_word(c, "True"))
            return (*dst = 1, 0);
        if (accept_word(c, "False"))
            return (*dst = 0, 0);
        return expected(c, "True or False");
    }
    bool flt = false;
    int64_t i = 0;
    double f = 0;
    int rc = parse_number(c, &flt, &i, &f, dt == AG_F32);
    if (rc)
        return rc;
    if (dt == AG_I64) {
        if (flt)
            return perr(c, at, "expected an int, got a float");
        memcpy(dst, &i, 8);
    } else if (dt == AG_F32) {
        /* Ints are converted as strtof would read them. */
        float v = (float)f;
        if (!flt) {
            char tmp[32];
            snprintf(tmp, sizeof tmp, "%lld", (long long)i);
            v = strtof(tmp, NULL);
        }
        memcpy(dst, &v, 4);
    } else {
        double v = flt ? f : (double)i;
        memcpy(dst, &v, 8);
    }
    return 0;
}

/* `constant NAME : VAL = [v, ...]` (or `= meta`): builds e->t. */
static int parse_constant(parser *P, centry *e) {
    cur c = {P, e->li, P->lines[e->li], P->lines[e->li] + 8};
    char *name;
    int rc;
    skip_ws(&c);
    if ((rc = parse_name(&c, &name, "a constant name")))
        return rc;
    if ((rc = expect(&c, ':', "':'")))
        return rc;
    skip_ws(&c);
    const char *vat = c.p;
    ag_tmeta m;
    if ((rc = parse_val(&c, &m)) || (rc = expect(&c, '=', "'='")))
        return rc;
    int64_t numel = ag__numel(m.ndim, m.sizes), extent = m.offset + (numel > 0);
    for (int i = 0; i < m.ndim; i++)
        if (m.sizes[i] > 0)
            extent += (m.sizes[i] - 1) * m.strides[i];
    if (numel == 0)
        extent = m.offset;
    bool meta = accept_word(&c, "meta");
    int64_t n = 0;
    size_t es = ag_dtype_size(m.dtype);
    if (!meta) {
        skip_ws(&c);
        const char *lat = c.p;
        if ((rc = expect(&c, '[', "'[' or meta")))
            return rc;
        if (!accept(&c, ']')) {
            for (;;) {
                if (n == numel) {
                    skip_ws(&c);
                    return perr(&c, lat, "constant %s: more values than the %lld elements of its VAL",
                                name, (long long)numel);
                }
                if (ag__grow((void **)&P->bytes, &P->bytes_cap, (n + 1) * (int64_t)es, 1))
                    return AG_ENOMEM;
                if ((rc = const_value(&c, m.dtype, P->bytes + n * (int64_t)es)))
                    return rc;
                n++;
                if (accept(&c, ']'))
                    break;
                if ((rc = expect(&c, ',', "',' or ']'")))
                    return rc;
                if (accept(&c, ']'))
                    break;
            }
        }
        if (n != numel)
            return perr(&c, lat, "constant %s: %lld values for the %lld elements of its VAL", name,
                        (long long)n, (long long)numel);
        /* Gaps of a strided constant are allocated too: bounded by what the text provides. */
        if (extent > 4 * numel + CONST_SLACK)
            return perr(&c, vat, "constant %s: its strides and offset span %lld elements for %lld "
                                 "values", name, (long long)extent, (long long)numel);
    }
    skip_ws(&c);
    if (*c.p)
        return expected(&c, "end of line");
    ag_tensor *base = ag__tensor_new(m.dtype, 1, &extent, meta);
    if (!base)
        return ag_last_status() == AG_ENOMEM ? AG_ENOMEM : perr(&c, vat, "%s", ag_last_error());
    ag_tensor *t = ag__tensor_alias(base, &m);
    ag_tensor_free(base);
    if (!t)
        return AG_ENOMEM;
    if (!meta) {
        char *data = ag__base(t);
        memset(t->storage->data, 0, (size_t)extent * es); /* the gaps of a strided one */
        int64_t idx[AG_MAX_DIMS] = {0}, off = 0;
        for (int64_t k = 0; k < numel; k++) {
            memcpy(data + off * (int64_t)es, P->bytes + k * (int64_t)es, es);
            for (int d = m.ndim - 1; d >= 0; d--) {
                if (++idx[d] < m.sizes[d]) {
                    off += m.strides[d];
                    break;
                }
                off -= m.strides[d] * (idx[d] - 1);
                idx[d] = 0;
            }
        }
    }
    e->t = t;
    e->parsed = true;
    return 0;
}

/* Indexes the `constant` lines by name. Lines whose name cannot be read are left for the main
 * pass to report. */
static int index_constants(parser *P) {
    for (int li = 0; li < P->nlines; li++) {
        const char *s = P->lines[li];
        if (strncmp(s, "constant", 8) || (s[8] != ' ' && s[8] != '\t'))
            continue;
        cur c = {P, li, s, s + 8};
        skip_ws(&c);
        char *name;
        int rc = parse_name(&c, &name, "name");
        if (rc == AG_ENOMEM)
            return rc;
        if (rc)
            continue;
        if (ag__grow((void **)&P->ce, &P->ce_cap, P->nce + 1, sizeof *P->ce))
            return AG_ENOMEM;
        centry *e = &P->ce[P->nce];
        *e = (centry){.name = ag__strdup(name), .li = li, .dup_of = -1};
        if (!e->name)
            return AG_ENOMEM;
        P->nce++;
        intptr_t prev = (intptr_t)ag__strmap_get(&P->consts, e->name);
        if (prev) {
            e->dup_of = P->ce[prev - 1].li;
        } else if (ag__strmap_put(&P->consts, e->name, (void *)(intptr_t)P->nce)) {
            return AG_ENOMEM;
        }
    }
    pool_clear(P);
    return 0;
}

/* ---- lines ---- */

static int placeholder_line(cur *c, const char *start, const char *name) {
    parser *P = c->P;
    if (P->seen_other)
        return perr(c, start, "placeholder %%%s after other nodes (placeholders come first)", name);
    skip_ws(c);
    ag_tmeta m;
    bool has_val = !accept_word(c, "None");
    int rc;
    if (has_val && (rc = parse_val(c, &m)))
        return rc;
    ag_node *n = ag_graph_placeholder(P->g, name, has_val ? &m : NULL);
    if (!n)
        return api_err(c, start, name);
    P->last = n;
    if (!accept(c, '#')) {
        skip_ws(c);
        return *c->p ? expected(c, "'#' or end of line") : 0;
    }
    skip_ws(c);
    const char *dat = c->p;
    ag_desc *d;
    if ((rc = parse_desc(c, &d)))
        return rc;
    if (d && !ag_desc_is_input(d)) {
        ag_desc_release(d);
        return perr(c, dat, "%%%s: a placeholder takes an input descriptor (...AOTInput)", name);
    }
    rc = ag_node_set_desc(n, d);
    ag_desc_release(d);
    if (rc)
        return api_err(c, dat, name);
    return parse_items(c, n);
}

static int call_line(cur *c, const char *start, const char *name) {
    parser *P = c->P;
    P->seen_other = true;
    skip_ws(c);
    const char *opat = c->p;
    size_t w = ident_len(c->p);
    if (!w)
        return expected(c, "an op name");
    const char *e = c->p + w;
    if (e[0] == ':' && e[1] == ':' && ident_len(e + 2))
        e += 2 + ident_len(e + 2);
    if (e[0] == '.' && ident_char(e[1])) {
        e++;
        while (ident_char(*e))
            e++;
    }
    size_t oplen = (size_t)(e - opat);
    char *opname = pool_alloc(P, oplen + 1);
    if (!opname)
        return AG_ENOMEM;
    memcpy(opname, opat, oplen);
    opname[oplen] = 0;
    c->p = e;
    int rc = expect(c, '(', "'('");
    if (rc)
        return rc;
    ag_node *n;
    if (!strcmp(opname, "getitem")) {
        ag_node *src;
        int64_t idx;
        if ((rc = parse_ref(c, &src)) || (rc = expect(c, ',', "','")))
            return rc;
        skip_ws(c);
        const char *iat = c->p;
        if ((rc = parse_int(c, &idx, "an output index")))
            return rc;
        accept(c, ',');
        if ((rc = expect(c, ')', "')'")))
            return rc;
        if (idx < 0 || idx >= AG_MAX_OUTPUTS)
            return perr(c, iat, "%%%s: output index %lld out of range", name, (long long)idx);
        n = ag_graph_getitem(P->g, src, (int)idx, name);
    } else if (!strcmp(opname, "get_attr")) {
        skip_ws(c);
        const char *tat = c->p;
        char *target;
        if ((rc = parse_name(c, &target, "a constant name")))
            return rc;
        accept(c, ',');
        if ((rc = expect(c, ')', "')'")))
            return rc;
        intptr_t k = (intptr_t)ag__strmap_get(&P->consts, target);
        if (!k)
            return perr(c, tat, "unknown constant '%s' (no `constant %s` line)", target, target);
        centry *ce = &P->ce[k - 1];
        if (!ce->parsed && (rc = parse_constant(P, ce)))
            return rc;
        n = ag_graph_get_attr(P->g, ce->t, name);
    } else {
        const ag_op *op = ag_op_find(opname);
        if (!op)
            return perr(c, opat, "unknown op '%s'", opname);
        ag_garg args[AG_MAX_ARGS];
        int nargs;
        if ((rc = parse_args(c, op, args, &nargs)))
            return rc;
        n = ag_graph_call(P->g, op, args, nargs, name);
    }
    if (!n)
        return api_err(c, start, name);
    for (int i = 0; i < ag_node_num_vals(n); i++) {
        const char *why = val_out_of_range(ag_node_val(n, i));
        if (why)
            return perr(c, start, "%%%s: the inferred VAL %s has %s", name,
                        vals_str(P, ag_node_val(n, i), 1, false), why);
    }
    P->last = n;
    if (!accept(c, '#')) {
        skip_ws(c);
        return *c->p ? expected(c, "'#' or end of line") : 0;
    }
    if ((rc = check_vals(c, n)))
        return rc;
    return parse_items(c, n);
}

static int return_line(cur *c, const char *start) {
    parser *P = c->P;
    int rc = expect(c, '(', "'('");
    if (rc)
        return rc;
    int n = 0;
    if (!accept(c, ')')) {
        for (;;) {
            skip_ws(c);
            if (n == MAX_LIST)
                return perr(c, c->p, "more than %d outputs", MAX_LIST);
            if (ag__grow((void **)&P->ptrs, &P->ptrs_cap, n + 1, sizeof *P->ptrs))
                return AG_ENOMEM;
            ag_node *nd = NULL;
            if (!accept_word(c, "None")) {
                if (*c->p != '%')
                    return expected(c, "a node or None");
                const char *at = c->p;
                if ((rc = parse_ref(c, &nd)))
                    return rc;
                if (ag_node_kind_of(nd) == AG_NODE_CALL && ag_node_num_vals(nd) != 1)
                    return perr(c, at, "%%%s has %d outputs: return one through getitem",
                                ag_node_name(nd), ag_node_num_vals(nd));
            }
            P->ptrs[n++] = nd;
            if (accept(c, ')'))
                break;
            if ((rc = expect(c, ',', "',' or ')'")))
                return rc;
            if (accept(c, ')'))
                break;
        }
    }
    ag_node *out = ag_graph_output(P->g, (ag_node *const *)P->ptrs, n);
    if (!out)
        return api_err(c, start, "output");
    P->last = out;
    if (!accept(c, '#')) {
        skip_ws(c);
        return *c->p ? expected(c, "'#' or end of line") : 0;
    }
    if (accept_word(c, "None"))
        return parse_items(c, out);
    skip_ws(c);
    const char *lat = c->p;
    if ((rc = expect(c, '[', "'[' or None")))
        return rc;
    /* Descriptors go into the scratch array behind the outputs (which are no longer needed). */
    int nd = 0;
    rc = 0;
    if (!accept(c, ']')) {
        for (;;) {
            if (nd == MAX_LIST) {
                rc = perr(c, c->p, "too many descriptors");
                break;
            }
            if (ag__grow((void **)&P->ptrs, &P->ptrs_cap, nd + 1, sizeof *P->ptrs)) {
                rc = AG_ENOMEM;
                break;
            }
            skip_ws(c);
            const char *dat = c->p;
            ag_desc *d;
            if ((rc = parse_desc(c, &d)))
                break;
            P->ptrs[nd++] = d;
            if (d && !ag_desc_is_output(d)) {
                rc = perr(c, dat, "output %d: an output takes an output descriptor (...AOTOutput)",
                          nd - 1);
                break;
            }
            if (accept(c, ']'))
                break;
            if ((rc = expect(c, ',', "',' or ']'")))
                break;
            if (accept(c, ']'))
                break;
        }
    }
    if (!rc && nd != n)
        rc = perr(c, lat, "%d descriptors for %d outputs", nd, n);
    if (!rc && ag_node_set_output_descs(out, (ag_desc *const *)P->ptrs, nd))
        rc = api_err(c, lat, "output");
    for (int i = 0; i < nd; i++)
        ag_desc_release(P->ptrs[i]);
    return rc ? rc : parse_items(c, out);
}

/* A node line (the cursor after its indentation). */
static int node_line(cur *c) {
    const char *start = c->p;
    if (accept_word(c, "return"))
        return return_line(c, start);
    if (*c->p != '%')
        return expected(c, "'%name' or 'return'");
    c->p++;
    char *name;
    int rc = parse_name(c, &name, "a node name");
    if (rc)
        return rc;
    if (!strcmp(name, "output"))
        return perr(c, start, "the name %%output is reserved for the output node");
    if (ag_graph_find(c->P->g, name)) {
        int li = find_def_line(c->P, name, 0, c->li);
        return perr(c, start, "duplicate node name %%%s (first defined on line %d)", name, li + 1);
    }
    skip_ws(c);
    if (*c->p == ':') {
        c->p++;
        return placeholder_line(c, start, name);
    }
    if (*c->p == '=') {
        c->p++;
        return call_line(c, start, name);
    }
    return expected(c, "':' or '='");
}

/* Hands the collected continuation lines to their node. */
static int flush_trace(parser *P) {
    if (!P->trace.len)
        return 0;
    char *t = ag__sb_finish(&P->trace);
    if (!t)
        return AG_ENOMEM;
    int rc = ag_node_set_stack_trace(P->last, t);
    ag__free(t);
    return rc;
}

static bool is_blank(const char *s) {
    while (*s == ' ' || *s == '\t')
        s++;
    return !*s;
}

static bool blank_or_comment(const char *s) {
    while (*s == ' ' || *s == '\t')
        s++;
    return !*s || *s == '#';
}

static int parse_lines(parser *P) {
    int li = 0;
    for (; li < P->nlines && blank_or_comment(P->lines[li]); li++)
        ;
    cur c = {P, li < P->nlines ? li : P->nlines - 1, NULL, NULL};
    c.line = P->lines[c.li];
    c.p = li < P->nlines ? c.line : c.line + strlen(c.line);
    if (!accept_word(&c, "graph") || !accept(&c, '(') || !accept(&c, ')') || !accept(&c, ':'))
        return expected(&c, "'graph():'");
    skip_ws(&c);
    if (*c.p)
        return expected(&c, "end of line");
    bool have_return = false, in_node = false; /* in_node: continuation lines may follow */
    int rc;
    size_t ci = 0; /* next constant entry, in line order */
    for (li++; li < P->nlines; li++) {
        char *s = P->lines[li];
        c = (cur){P, li, s, s};
        if (in_node && !strncmp(s, "        ", 8) && !is_blank(s)) {
            if (P->trace.len)
                ag__sb_putc(&P->trace, '\n');
            ag__sb_puts(&P->trace, s + 8);
            if (P->trace.oom)
                return AG_ENOMEM;
            continue;
        }
        if ((rc = flush_trace(P)))
            return rc;
        in_node = false;
        if (blank_or_comment(s))
            continue;
        if (*s == ' ') {
            while (*c.p == ' ')
                c.p++;
            if (have_return)
                return expected(&c, "end of input or 'constant'");
            rc = node_line(&c);
            pool_clear(P);
            if (rc)
                return rc;
            in_node = true;
            have_return = ag_graph_output_node(P->g) != NULL;
            continue;
        }
        if (!have_return) {
            return expected(&c, "an indented node line or 'return'");
        }
        while (ci < (size_t)P->nce && P->ce[ci].li < li)
            ci++;
        if (ci < (size_t)P->nce && P->ce[ci].li == li) {
            centry *e = &P->ce[ci];
            if (e->dup_of >= 0)
                return perr(&c, s, "duplicate constant %s (first on line %d)", e->name,
                            e->dup_of + 1);
            rc = e->parsed ? 0 : parse_constant(P, e);
            pool_clear(P);
            if (rc)
                return rc;
            continue;
        }
        if (!strncmp(s, "constant", 8) && !ident_char(s[8])) {
            c.p = s + 8; /* a constant line whose name could not be read */
            skip_ws(&c);
            char *name;
            if ((rc = parse_name(&c, &name, "a constant name")))
                return rc;
        }
        return expected(&c, "end of input or 'constant'");
    }
    if ((rc = flush_trace(P)))
        return rc;
    if (!have_return) {
        c.li = P->nlines - 1;
        c.line = P->lines[c.li];
        c.p = c.line + strlen(c.line);
        return perr(&c, c.p, "expected 'return', got end of input");
    }
    return 0;
}

ag_graph *ag_graph_parse(const char *text, size_t len) {
    if (!text && len)
        return ag__err(AG_EINVAL, "graph_parse: NULL text"), NULL;
    parser P = {0};
    int rc = 0;
    /* The text as lines, each NUL-terminated ("\r\n" ends a line as "\n" does). */
    P.buf = ag__malloc(len + 1);
    if (!P.buf)
        return NULL;
    if (len)
        memcpy(P.buf, text, len);
    P.buf[len] = 0;
    int64_t nl = 1;
    for (size_t i = 0; i < len; i++) {
        if (P.buf[i] == '\n')
            nl++;
        if (!P.buf[i] || nl > INT32_MAX - 1) {
            int line = 1;
            size_t ls = 0;
            for (size_t k = 0; k < i; k++)
                if (P.buf[k] == '\n')
                    line++, ls = k + 1;
            const char *what = P.buf[i] ? "too many lines" : "unexpected NUL byte";
            ag__err(AG_EFORMAT, "line %d:%d: %s", line, (int)(i - ls) + 1, what);
            ag__free(P.buf);
            return NULL;
        }
    }
    P.lines = ag__malloc(sizeof(char *) * (size_t)nl);
    if (!P.lines) {
        ag__free(P.buf);
        return NULL;
    }
    P.lines[P.nlines++] = P.buf;
    for (size_t i = 0; i < len; i++)
        if (P.buf[i] == '\n') {
            P.buf[i] = 0;
            if (i > 0 && P.buf[i - 1] == '\r' && P.lines[P.nlines - 1] < P.buf + i)
                P.buf[i - 1] = 0;
            P.lines[P.nlines++] = P.buf + i + 1;
        }
    if (len && P.buf[len - 1] == '\r' && P.lines[P.nlines - 1] < P.buf + len)
        P.buf[len - 1] = 0;

    P.g = ag_graph_new();
    if (!P.g)
        rc = AG_ENOMEM;
    if (!rc)
        rc = index_constants(&P);
    if (!rc)
        rc = parse_lines(&P);

    pool_clear(&P);
    ag__free(P.pool);
    ag__free(P.ints);
    ag__free(P.ptrs);
    ag__free(P.bytes);
    ag__sb_free(&P.trace);
    for (int64_t i = 0; i < P.nce; i++) {
        ag__free(P.ce[i].name);
        ag_tensor_free(P.ce[i].t);
    }
    ag__free(P.ce);
    ag__strmap_free(&P.consts);
    ag__free(P.lines);
    ag__free(P.buf);
    if (rc) {
        ag_graph_free(P.g);
        return NULL;
    }
    return P.g;
}
