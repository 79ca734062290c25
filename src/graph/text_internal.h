/* Helpers shared by the graph printer (print.c), parser (parse.c) and DOT writer (dot.c): a
 * growing string buffer, and the spellings of values that all three must agree on (VALs,
 * Python-quoted strings, round-tripping floats, descriptor reprs). Defined in text_internal.c. */
#ifndef AG_TEXT_INTERNAL_H
#define AG_TEXT_INTERNAL_H

#include "graph_internal.h"

/* A growing byte buffer. One allocation failure makes it sticky-failed: later appends are
 * no-ops and ag__sb_finish returns NULL (the error is already set by ag__malloc). */
typedef struct ag__sbuf {
    char *p;
    size_t len, cap;
    bool oom;
} ag__sbuf;

bool ag__sb_reserve(ag__sbuf *b, size_t extra);
void ag__sb_putn(ag__sbuf *b, const char *s, size_t n);
void ag__sb_puts(ag__sbuf *b, const char *s);
void ag__sb_putc(ag__sbuf *b, char c);
void ag__sb_printf(ag__sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* The NUL-terminated contents (the caller owns them), or NULL after a failure. */
char *ag__sb_finish(ag__sbuf *b);
void ag__sb_free(ag__sbuf *b);

/* "f32[2, 3]", with "{s0, s1}" when the strides are not the contiguous ones and "+OFF" when
 * the storage offset is not 0. */
void ag__sb_val(ag__sbuf *b, const ag_tmeta *m);
/* Python's repr() of a byte string: single quotes unless it holds ' and no "; escapes for
 * backslash, the quote, \t \n \r, other control bytes as \xhh, bytes that are not UTF-8 as
 * \udcXX (Python's surrogateescape). */
void ag__sb_pystr(ag__sbuf *b, const char *s, size_t n);
/* The shortest decimal that reads back (strtod) as exactly v, always with a '.' or an
 * exponent: 1.0, 0.1, 1e-05, inf, -inf, nan. */
void ag__sb_double(ag__sbuf *b, double v);
/* The same for a float (reads back with strtof). */
void ag__sb_float(ag__sbuf *b, float v);
/* The descriptor's repr ("None" for NULL). */
void ag__sb_desc(ag__sbuf *b, const ag_desc *d);
/* A node name as the text writes it after '%': bare when it is made of [A-Za-z0-9_], else
 * Python-quoted. */
void ag__sb_name(ag__sbuf *b, const char *name);
bool ag__is_plain_name(const char *s);

/* Equality of two metas over their dims (unused tail entries ignored). */

#endif
