/* The graph parser's tokens and values (see parse_internal.h): errors placed at line:column,
 * the per-line pool, Python string literals, names, numbers, VALs, metadata values and
 * descriptors. Everything reads one NUL-terminated line of untrusted text and stops at its end;
 * numbers are range-checked and VALs bounded so that no size computation downstream overflows.
 * The grammar that calls these lives in parse.c. */
#include "parse_internal.h"
#include "../core/pystr.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

typedef ag__tcur cur;
typedef ag__tparser parser;

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

int ag__lx_err(const cur *c, const char *at, const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return ag__err(AG_EFORMAT, "line %d:%d: %s", c->P->line0 + c->li + 1,
                   c->P->col0 + (int)(at - c->line) + 1, msg);
}

/* "expected WHAT, got ..." at the cursor. */
int ag__lx_expected(const cur *c, const char *what) {
    char g[64];
    return ag__lx_err(c, c->p, "expected %s, got %s", what, got(c->p, g, sizeof g));
}

/* A graph API call failed: its message, placed at `at` and naming the node (out of memory
 * stays out of memory). */
int ag__lx_api_err(const cur *c, const char *at, const char *node) {
    if (ag_last_status() == AG_ENOMEM)
        return AG_ENOMEM;
    char msg[768];
    snprintf(msg, sizeof msg, "%s", ag_last_error());
    return ag__lx_err(c, at, "%%%s: %s", node, msg);
}

/* ---- the line pool ---- */

void *ag__lx_alloc(parser *P, size_t n) {
    if (ag__grow((void **)&P->pool, &P->pool_cap, P->npool + 1, sizeof *P->pool))
        return NULL;
    void *p = ag__malloc(n);
    if (p)
        P->pool[P->npool++] = p;
    return p;
}

void ag__lx_pool_clear(parser *P) {
    for (int64_t i = 0; i < P->npool; i++)
        ag__free(P->pool[i]);
    P->npool = 0;
}

static void *pool_alloc(void *P, size_t n) {
    return ag__lx_alloc(P, n);
}

/* A Python string literal at the cursor (single or double quotes, Python's escapes; \udc80 ..
 * \udcff stand for raw bytes). The decoded string (pool-owned, NUL-terminated) never holds a
 * NUL: that is an error. */
int ag__lx_str(cur *c, char **out) {
    lx_skip_ws(c);
    const char *open = c->p;
    if (*open != '\'' && *open != '"')
        return ag__lx_expected(c, "a quoted string");
    size_t used;
    ag__pystr_err e;
    int rc = ag__pystr_parse(open, strlen(open), 0, pool_alloc, c->P, &used, out, NULL, &e);
    if (rc != AG_EFORMAT) {
        if (!rc)
            c->p = open + used;
        return rc;
    }
    const char *at = open + e.at;
    switch (e.code) {
    case AG__PYSTR_NOT_STRING:
    case AG__PYSTR_UNTERMINATED:
    case AG__PYSTR_NAMED:
        break;
    case AG__PYSTR_TRUNCATED:
        return ag__lx_err(c, at, "bad \\%c escape: expected %d hex digits", e.esc, e.digits);
    case AG__PYSTR_NUL:
        return ag__lx_err(c, at, "a string may not contain a NUL character");
    case AG__PYSTR_RANGE:
    case AG__PYSTR_SURROGATE:
        return ag__lx_err(c, at, "bad escape: code point 0x%x", (unsigned)e.cp);
    }
    return ag__lx_err(c, open, "unterminated string");
}

/* A name: [A-Za-z0-9_]+ or a quoted string (pool-owned). */
int ag__lx_name(cur *c, char **out, const char *what) {
    if (*c->p == '\'' || *c->p == '"') {
        const char *at = c->p;
        int rc = ag__lx_str(c, out);
        if (rc == 0 && !**out)
            return ag__lx_err(c, at, "empty %s", what);
        return rc;
    }
    size_t n = 0;
    while (lx_ident_char(c->p[n]))
        n++;
    if (!n)
        return ag__lx_expected(c, what);
    char *o = ag__lx_alloc(c->P, n + 1);
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
int ag__lx_number(cur *c, bool *is_float, int64_t *iv, double *f, bool single) {
    lx_skip_ws(c);
    const char *start = c->p, *s = c->p;
    bool neg = *s == '-';
    if (neg)
        s++;
    size_t w = lx_ident_len(s);
    if ((w == 3 && !strncmp(s, "inf", 3)) || (!neg && w == 3 && !strncmp(s, "nan", 3))) {
        *is_float = true;
        *f = s[0] == 'n' ? NAN : neg ? -INFINITY : INFINITY;
        c->p = s + 3;
        return 0;
    }
    if (*s < '0' || *s > '9')
        return ag__lx_expected(c, "a number");
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
            return ag__lx_expected(c, "exponent digits");
        }
        while (*s >= '0' && *s <= '9')
            s++;
    }
    size_t len = (size_t)(s - start);
    if (len > MAX_NUMBER)
        return ag__lx_err(c, start, "number too long");
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
                return ag__lx_err(c, start, "integer out of range");
            v = v * 10 + dig;
        }
        *iv = neg ? (int64_t)(0 - v) : (int64_t)v;
    }
    c->p = s;
    return 0;
}

int ag__lx_int(cur *c, int64_t *v, const char *what) {
    lx_skip_ws(c);
    const char *at = c->p;
    bool flt = false;
    double f;
    int rc = ag__lx_number(c, &flt, v, &f, false);
    if (rc)
        return rc;
    if (flt)
        return ag__lx_err(c, at, "expected %s (an int), got a float", what);
    return 0;
}

/* ---- VALs ---- */

static bool checked_madd(int64_t *acc, int64_t a, int64_t b) {
    int64_t t;
    return !__builtin_mul_overflow(a, b, &t) && !__builtin_add_overflow(*acc, t, acc) &&
           *acc <= MAX_EXTENT;
}

/* DTYPE[SIZES]{STRIDES}+OFFSET, with bounds that keep every size computation in range. */
int ag__lx_val(cur *c, ag_tmeta *m) {
    lx_skip_ws(c);
    memset(m, 0, sizeof *m);
    const char *at = c->p;
    static const char *const names[AG_NDTYPES] = {"f32", "f64", "i64", "b8", "i8"};
    size_t w = lx_ident_len(c->p);
    int dt = -1;
    for (int i = 0; i < AG_NDTYPES; i++)
        if (w == strlen(names[i]) && !strncmp(c->p, names[i], w))
            dt = i;
    if (dt < 0)
        return ag__lx_expected(c, "a VAL (f32, f64, i64 or b8 and its sizes)");
    c->p += w;
    m->dtype = (ag_dtype)dt;
    int rc = lx_expect(c, '[', "'['");
    if (rc)
        return rc;
    if (!lx_accept(c, ']')) {
        for (;;) {
            lx_skip_ws(c);
            const char *sat = c->p;
            if (m->ndim == AG_MAX_DIMS)
                return ag__lx_err(c, sat, "more than %d dimensions", AG_MAX_DIMS);
            if ((rc = ag__lx_int(c, &m->sizes[m->ndim], "a size")))
                return rc;
            if (m->sizes[m->ndim] < 0 || m->sizes[m->ndim] > MAX_EXTENT)
                return ag__lx_err(c, sat, "size %lld out of range", (long long)m->sizes[m->ndim]);
            m->ndim++;
            if (lx_accept(c, ']'))
                break;
            if ((rc = lx_expect(c, ',', "',' or ']'")))
                return rc;
        }
    }
    /* Contiguous strides, and a bound on the product of the sizes. */
    int64_t st = 1;
    for (int i = m->ndim - 1; i >= 0; i--) {
        m->strides[i] = st;
        int64_t s = m->sizes[i] > 1 ? m->sizes[i] : 1;
        if (__builtin_mul_overflow(st, s, &st) || st > MAX_EXTENT)
            return ag__lx_err(c, at, "VAL too large (more than 2^52 elements)");
    }
    if (*c->p == '{') { /* strides follow ']' directly: "  {" after a VAL is a custom dict */
        c->p++;
        int k = 0;
        if (!lx_accept(c, '}')) {
            for (;;) {
                lx_skip_ws(c);
                const char *sat = c->p;
                if (k == m->ndim)
                    return ag__lx_err(c, sat, "more strides than the %d sizes", m->ndim);
                if ((rc = ag__lx_int(c, &m->strides[k], "a stride")))
                    return rc;
                if (m->strides[k] < 0 || m->strides[k] > MAX_EXTENT)
                    return ag__lx_err(c, sat, "stride %lld out of range", (long long)m->strides[k]);
                k++;
                if (lx_accept(c, '}'))
                    break;
                if ((rc = lx_expect(c, ',', "',' or '}'")))
                    return rc;
            }
        }
        if (k != m->ndim)
            return ag__lx_err(c, at, "%d strides for %d sizes", k, m->ndim);
    }
    if (*c->p == '+') {
        c->p++;
        const char *oat = c->p;
        if ((rc = ag__lx_int(c, &m->offset, "an offset")))
            return rc;
        if (m->offset < 0 || m->offset > MAX_EXTENT)
            return ag__lx_err(c, oat, "offset %lld out of range", (long long)m->offset);
    }
    int64_t extent = m->offset;
    for (int i = 0; i < m->ndim; i++)
        if (m->sizes[i] > 0 && !checked_madd(&extent, m->sizes[i] - 1, m->strides[i]))
            return ag__lx_err(c, at, "VAL spans too much storage (more than 2^52 elements)");
    return 0;
}

/* Why a VAL an op inferred could not be written back in the text (the bounds parse_val
 * enforces), or NULL. Meta functions should refuse such shapes themselves; this keeps every
 * accepted text a fixed point of print(parse(...)) even where one does not. */
const char *ag__lx_val_out_of_range(const ag_tmeta *m) {
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
int ag__lx_vals(cur *c, ag_tmeta *vals, int *n) {
    *n = 0;
    if (!lx_accept(c, '('))
        return (*n = 1, ag__lx_val(c, &vals[0]));
    if (lx_accept(c, ')'))
        return 0;
    for (;;) {
        lx_skip_ws(c);
        if (*n == AG_MAX_OUTPUTS)
            return ag__lx_err(c, c->p, "more than %d outputs", AG_MAX_OUTPUTS);
        int rc = ag__lx_val(c, &vals[(*n)++]);
        if (rc)
            return rc;
        if (lx_accept(c, ')'))
            return 0;
        if ((rc = lx_expect(c, ',', "',' or ')'")))
            return rc;
        if (lx_accept(c, ')'))
            return 0;
    }
}

/* Formats vals as the printer does, into the pool (for messages). */
const char *ag__lx_vals_str(parser *P, const ag_tmeta *v, int n, bool tuple) {
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

/* A metadata value: None, True, False, a number or a string. */
int ag__lx_mval(cur *c, ag_mval *v) {
    lx_skip_ws(c);
    if (lx_accept_word(c, "None"))
        return (*v = (ag_mval){.kind = AG_MV_NONE}, 0);
    if (lx_accept_word(c, "True"))
        return (*v = (ag_mval){.kind = AG_MV_BOOL, .u.b = true}, 0);
    if (lx_accept_word(c, "False"))
        return (*v = (ag_mval){.kind = AG_MV_BOOL, .u.b = false}, 0);
    if (*c->p == '\'' || *c->p == '"') {
        char *s;
        int rc = ag__lx_str(c, &s);
        *v = (ag_mval){.kind = AG_MV_STR, .u.s = s};
        return rc;
    }
    if ((*c->p >= '0' && *c->p <= '9') || *c->p == '-' || !strncmp(c->p, "inf", 3) ||
        !strncmp(c->p, "nan", 3)) {
        bool flt = false;
        int64_t i = 0;
        double f = 0;
        int rc = ag__lx_number(c, &flt, &i, &f, false);
        if (rc)
            return rc;
        *v =
            flt ? (ag_mval){.kind = AG_MV_FLOAT, .u.f = f} : (ag_mval){.kind = AG_MV_INT, .u.i = i};
        return 0;
    }
    return ag__lx_expected(c, "a value (None, True, False, a number or a string)");
}

/* ---- descriptors ---- */

/* One descriptor repr at the cursor (or None: *d = NULL). ag_desc_parse's column is turned
 * into this line's. */
int ag__lx_desc(cur *c, ag_desc **d) {
    lx_skip_ws(c);
    *d = NULL;
    if (lx_accept_word(c, "None"))
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
        return ag__lx_err(c, at + col, "bad descriptor: %s", msg + off);
    return ag__lx_err(c, at, "bad descriptor: %s", msg);
}
