/* The helpers the graph's text shares (text_internal.h): the printer (print.c), the parser
 * (parse.c), the DOT writer (dot.c) and the module stacks (modstack_text.c) write through one
 * growing buffer and spell VALs, Python-quoted strings, round-tripping floats, descriptors and
 * node names the same way. */
#include "text_internal.h"
#include "../core/pystr.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

/* ---- the buffer ---- */

bool ag__sb_reserve(ag__sbuf *b, size_t extra) {
    if (b->oom)
        return false;
    if (b->len + extra + 1 <= b->cap)
        return true;
    size_t ncap = b->cap ? b->cap : 256;
    while (ncap < b->len + extra + 1)
        ncap *= 2;
    char *np = ag__malloc(ncap);
    if (!np) {
        b->oom = true;
        return false;
    }
    if (b->len)
        memcpy(np, b->p, b->len);
    ag__free(b->p);
    b->p = np;
    b->cap = ncap;
    return true;
}

void ag__sb_putn(ag__sbuf *b, const char *s, size_t n) {
    if (!ag__sb_reserve(b, n))
        return;
    memcpy(b->p + b->len, s, n);
    b->len += n;
}

void ag__sb_puts(ag__sbuf *b, const char *s) {
    ag__sb_putn(b, s, strlen(s));
}

void ag__sb_putc(ag__sbuf *b, char c) {
    if (b->len + 2 <= b->cap || ag__sb_reserve(b, 1))
        b->p[b->len++] = c;
}

void ag__sb_printf(ag__sbuf *b, const char *fmt, ...) {
    char tmp[256];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n < 0)
        return;
    if ((size_t)n < sizeof tmp) {
        ag__sb_putn(b, tmp, (size_t)n);
        return;
    }
    if (!ag__sb_reserve(b, (size_t)n))
        return;
    va_start(ap, fmt);
    vsnprintf(b->p + b->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
}

char *ag__sb_finish(ag__sbuf *b) {
    if (b->oom || !ag__sb_reserve(b, 0)) {
        ag__sb_free(b);
        return NULL;
    }
    b->p[b->len] = 0;
    char *r = b->p;
    b->p = NULL;
    b->len = b->cap = 0;
    return r;
}

void ag__sb_free(ag__sbuf *b) {
    ag__free(b->p);
    b->p = NULL;
    b->len = b->cap = 0;
}

/* ---- values ---- */

static const char *dtype_short(ag_dtype dt) {
    const char *s = (unsigned)dt < AG_NDTYPES ? ag_dtype_short(dt) : NULL;
    return s ? s : "?";
}

void ag__sb_val(ag__sbuf *b, const ag_tmeta *m) {
    ag__sb_puts(b, dtype_short(m->dtype));
    ag__sb_putc(b, '[');
    int nd = m->ndim < 0 ? 0 : m->ndim > AG_MAX_DIMS ? AG_MAX_DIMS : m->ndim;
    for (int i = 0; i < nd; i++)
        ag__sb_printf(b, i ? ", %lld" : "%lld", (long long)m->sizes[i]);
    ag__sb_putc(b, ']');
    /* Exactly the strides ag__tmeta_contiguous would give; anything else is spelled out. */
    bool contiguous = true;
    int64_t st = 1;
    for (int i = nd - 1; i >= 0; i--) {
        if (m->strides[i] != st)
            contiguous = false;
        if (m->sizes[i] > 1 && st <= INT64_MAX / m->sizes[i])
            st *= m->sizes[i];
    }
    if (!contiguous) {
        ag__sb_putc(b, '{');
        for (int i = 0; i < nd; i++)
            ag__sb_printf(b, i ? ", %lld" : "%lld", (long long)m->strides[i]);
        ag__sb_putc(b, '}');
    }
    if (m->offset)
        ag__sb_printf(b, "+%lld", (long long)m->offset);
}

void ag__sb_pystr(ag__sbuf *b, const char *s, size_t n) {
    size_t need = ag__pystr_repr(s, n, NULL, 0);
    if (!ag__sb_reserve(b, need))
        return;
    ag__pystr_repr(s, n, b->p + b->len, need + 1);
    b->len += need;
}

/* Writes the shortest %.{p}g spelling of v that reads back identically (strtof when
 * `single`), with ".0" appended when it would read as an int. */
static void put_real(ag__sbuf *b, double v, bool single) {
    if (isnan(v)) {
        ag__sb_puts(b, "nan");
        return;
    }
    if (isinf(v)) {
        ag__sb_puts(b, v < 0 ? "-inf" : "inf");
        return;
    }
    char buf[40];
    int maxp = single ? 9 : 17;
    for (int p = 1; p <= maxp; p++) {
        snprintf(buf, sizeof buf, "%.*g", p, v);
        if (single ? strtof(buf, NULL) == (float)v : strtod(buf, NULL) == v)
            break;
    }
    ag__sb_puts(b, buf);
    if (!strpbrk(buf, ".e"))
        ag__sb_puts(b, ".0");
}

void ag__sb_double(ag__sbuf *b, double v) {
    put_real(b, v, false);
}
void ag__sb_float(ag__sbuf *b, float v) {
    put_real(b, v, true);
}

void ag__sb_desc(ag__sbuf *b, const ag_desc *d) {
    size_t n = ag_desc_repr(d, NULL, 0);
    if (!ag__sb_reserve(b, n))
        return;
    ag_desc_repr(d, b->p + b->len, n + 1);
    b->len += n;
}

bool ag__is_plain_name(const char *s) {
    if (!*s)
        return false;
    for (; *s; s++)
        if (!((*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z') || (*s >= '0' && *s <= '9') ||
              *s == '_'))
            return false;
    return true;
}

void ag__sb_name(ag__sbuf *b, const char *name) {
    if (ag__is_plain_name(name))
        ag__sb_puts(b, name);
    else
        ag__sb_pystr(b, name, strlen(name));
}

/* ---- nodes ---- */
