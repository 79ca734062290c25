/* Python str literals, written and read (see pystr.h for who uses them).
 *
 * ---- Python's repr() of a str ----
 *
 * The C string is taken as UTF-8. Bytes that are not part of a valid UTF-8 sequence stand for
 * the lone surrogates U+DC80..U+DCFF, as Python's surrogateescape decodes them (os.fsdecode), so
 * they print as '\udcff' and parse back to the same byte. Non-ASCII code points print raw when
 * Python's str.isprintable() holds for them, else escaped; not_printable() approximates
 * isprintable() without the Unicode database: it knows every control, format, separator,
 * private-use, surrogate and noncharacter code point, and the unassigned planes 4-13, but
 * treats unassigned code points in planes 0-3 as printable (Python escapes those, and which
 * ones are unassigned depends on its Unicode version). */
#include "pystr.h"

#include "internal.h"

#include <stdbool.h>
#include <stdio.h>
#include <string.h>

/* Decodes one strict UTF-8 sequence at s[0..n); returns its length, or 0 when invalid
 * (overlong forms, surrogates and code points past U+10FFFF are invalid). */
static size_t utf8_decode(const unsigned char *s, size_t n, uint32_t *cp) {
    unsigned char c = s[0];
    if (c < 0x80) {
        *cp = c;
        return 1;
    }
    size_t len;
    unsigned char lo = 0x80, hi = 0xbf;
    if (c >= 0xc2 && c <= 0xdf) {
        len = 2;
    } else if (c >= 0xe0 && c <= 0xef) {
        len = 3;
        if (c == 0xe0)
            lo = 0xa0;
        else if (c == 0xed)
            hi = 0x9f;
    } else if (c >= 0xf0 && c <= 0xf4) {
        len = 4;
        if (c == 0xf0)
            lo = 0x90;
        else if (c == 0xf4)
            hi = 0x8f;
    } else {
        return 0;
    }
    if (n < len || s[1] < lo || s[1] > hi)
        return 0;
    uint32_t v = c & (0x3fu >> (len - 1));
    v = (v << 6) | (s[1] & 0x3f);
    for (size_t i = 2; i < len; i++) {
        if (s[i] < 0x80 || s[i] > 0xbf)
            return 0;
        v = (v << 6) | (s[i] & 0x3f);
    }
    *cp = v;
    return len;
}

/* Code points Python's repr() escapes (an approximation of str.isprintable() without the
 * Unicode database, the same as the descriptor printer's). */
static bool not_printable(uint32_t cp) {
    static const uint32_t ranges[][2] = {
        {0x80, 0xa0},       {0xad, 0xad},       {0x600, 0x605},     {0x61c, 0x61c},
        {0x6dd, 0x6dd},     {0x70f, 0x70f},     {0x890, 0x891},     {0x8e2, 0x8e2},
        {0x1680, 0x1680},   {0x180e, 0x180e},   {0x2000, 0x200f},   {0x2028, 0x202f},
        {0x205f, 0x206f},   {0x3000, 0x3000},   {0xd800, 0xf8ff},   {0xfdd0, 0xfdef},
        {0xfeff, 0xfeff},   {0xfff0, 0xfffb},   {0xfffe, 0xffff},   {0x110bd, 0x110bd},
        {0x110cd, 0x110cd}, {0x13430, 0x1343f}, {0x1bca0, 0x1bca3}, {0x1d173, 0x1d17a},
        {0x1fffe, 0x1ffff}, {0x2fffe, 0x2ffff}, {0x3fffe, 0xe00ff}, {0xe01f0, 0x10ffff},
    };
    for (size_t i = 0; i < sizeof ranges / sizeof ranges[0]; i++)
        if (cp >= ranges[i][0] && cp <= ranges[i][1])
            return true;
    return false;
}

/* Output with snprintf semantics: len counts the full text, buf gets what fits. */
typedef struct out_buf {
    char *buf;
    size_t n;
    size_t len;
} out_buf;

static void put(out_buf *b, const char *s, size_t k) {
    for (size_t i = 0; i < k; i++, b->len++)
        if (b->len + 1 < b->n)
            b->buf[b->len] = s[i];
}

static void putc_(out_buf *b, char c) {
    put(b, &c, 1);
}

static void put_hex(out_buf *b, const char *fmt, uint32_t v) {
    char tmp[16];
    int k = snprintf(tmp, sizeof tmp, fmt, (unsigned)v);
    put(b, tmp, (size_t)k);
}

size_t ag__pystr_repr(const char *str, size_t n, char *buf, size_t cap) {
    out_buf ob = {buf, cap, 0}, *b = &ob;
    const unsigned char *s = (const unsigned char *)str;
    bool has_sq = memchr(s, '\'', n) != NULL, has_dq = memchr(s, '"', n) != NULL;
    char quote = has_sq && !has_dq ? '"' : '\'';
    putc_(b, quote);
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        size_t k = utf8_decode(s + i, n - i, &cp);
        if (!k) {
            put_hex(b, "\\udc%02x", s[i]);
            i++;
            continue;
        }
        if (cp == (uint32_t)quote || cp == '\\') {
            putc_(b, '\\');
            putc_(b, (char)cp);
        } else if (cp == '\t') {
            put(b, "\\t", 2);
        } else if (cp == '\n') {
            put(b, "\\n", 2);
        } else if (cp == '\r') {
            put(b, "\\r", 2);
        } else if (cp < 0x20 || cp == 0x7f) {
            put_hex(b, "\\x%02x", cp);
        } else if (cp < 0x7f || !not_printable(cp)) {
            put(b, (const char *)s + i, k);
        } else if (cp <= 0xff) {
            put_hex(b, "\\x%02x", cp);
        } else if (cp <= 0xffff) {
            put_hex(b, "\\u%04x", cp);
        } else {
            put_hex(b, "\\U%08x", cp);
        }
        i += k;
    }
    putc_(b, quote);
    if (cap)
        buf[b->len < cap ? b->len : cap - 1] = 0;
    return b->len;
}

/* ---- parsing a literal ---- */

static int hex_value(char c) {
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
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

static int fail(ag__pystr_err *err, ag__pystr_errcode code, size_t at) {
    err->code = code;
    err->at = at;
    return AG_EFORMAT;
}

int ag__pystr_parse(const char *s, size_t len, unsigned flags, void *(*alloc)(void *, size_t),
                    void *ctx, size_t *consumed, char **out, size_t *out_len, ag__pystr_err *err) {
    memset(err, 0, sizeof *err);
#define AT(i) ((i) < len ? s[i] : 0)
    char q = AT(0);
    if (q != '\'' && q != '"')
        return fail(err, AG__PYSTR_NOT_STRING, 0);
    size_t end = 1;
    for (;; end++) {
        char c = AT(end);
        if (c == 0 || ((flags & AG__PYSTR_NO_NEWLINE) && (c == '\n' || c == '\r')))
            return fail(err, AG__PYSTR_UNTERMINATED, 0);
        if (c == q)
            break;
        if (c == '\\') {
            if (AT(end + 1) == 0)
                return fail(err, AG__PYSTR_UNTERMINATED, 0);
            end++;
        }
    }
    /* Escapes never decode to more bytes than they are written with. */
    char *buf = alloc ? alloc(ctx, end) : ag__malloc(end);
    if (!buf)
        return AG_ENOMEM;
    size_t n = 0;
    int rc = 0;
    for (size_t i = 1; i < end;) {
        if (s[i] != '\\') {
            buf[n++] = s[i++];
            continue;
        }
        size_t esc = i;
        char e = s[i + 1];
        i += 2;
        uint32_t cp = 0;
        int digits = 0;
        switch (e) {
        case '\n':
        case '\r':
            if (flags & AG__PYSTR_CONTINUATION)
                continue;
            buf[n++] = '\\'; /* kept as written, like any unknown escape */
            buf[n++] = e;
            continue;
        case '\\':
        case '\'':
        case '"':
            cp = (uint32_t)e;
            break;
        case 'a':
            cp = 7;
            break;
        case 'b':
            cp = 8;
            break;
        case 'f':
            cp = 12;
            break;
        case 'n':
            cp = 10;
            break;
        case 'r':
            cp = 13;
            break;
        case 't':
            cp = 9;
            break;
        case 'v':
            cp = 11;
            break;
        case 'x':
            digits = 2;
            break;
        case 'u':
            digits = 4;
            break;
        case 'U':
            digits = 8;
            break;
        case 'N':
            if (flags & AG__PYSTR_NO_NAMED) {
                rc = fail(err, AG__PYSTR_NAMED, esc);
                goto done;
            }
            buf[n++] = '\\';
            buf[n++] = e;
            continue;
        default:
            if (e >= '0' && e <= '7') {
                cp = (uint32_t)(e - '0');
                for (int k = 0; k < 2 && s[i] >= '0' && s[i] <= '7'; k++)
                    cp = cp * 8 + (uint32_t)(s[i++] - '0');
            } else { /* Python keeps unknown escapes as written */
                buf[n++] = '\\';
                buf[n++] = e;
                continue;
            }
        }
        if (digits) {
            cp = 0;
            for (int k = 0; k < digits; k++) {
                int h = i < end ? hex_value(s[i]) : -1;
                if (h < 0) {
                    rc = fail(err, AG__PYSTR_TRUNCATED, esc);
                    err->esc = e;
                    err->digits = digits;
                    goto done;
                }
                cp = cp * 16 + (uint32_t)h;
                i++;
            }
        }
        if (cp == 0) {
            rc = fail(err, AG__PYSTR_NUL, esc);
            goto done;
        }
        if (cp > 0x10ffff) {
            rc = fail(err, AG__PYSTR_RANGE, esc);
            err->cp = cp;
            goto done;
        }
        if (cp >= 0xdc80 && cp <= 0xdcff) { /* surrogateescape: a raw byte */
            buf[n++] = (char)(cp - 0xdc00);
        } else if (cp >= 0xd800 && cp <= 0xdfff) {
            rc = fail(err, AG__PYSTR_SURROGATE, esc);
            err->cp = cp;
            goto done;
        } else {
            n += utf8_encode(cp, buf + n);
        }
    }
#undef AT
    buf[n] = 0;
    if (consumed)
        *consumed = end + 1;
    if (out_len)
        *out_len = n;
    *out = buf;
    return 0;
done:
    if (!alloc)
        ag__free(buf);
    return rc;
}
