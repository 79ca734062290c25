/* Python str literals: repr() of a byte string and a parser for the literals it writes (and
 * the rest of Python's escapes). Shared by the descriptor repr/parser (src/core/desc.c), the
 * graph printer and parser (src/graph/print.c, parse_lex.c) and the treespec repr
 * (src/export/treespec.c), so that all of them quote and unquote strings the same way. */
#ifndef AG_PYSTR_H
#define AG_PYSTR_H

#include <stddef.h>
#include <stdint.h>

/* Python's repr() of s[0..len) taken as UTF-8: single quotes unless it holds ' and no ";
 * escapes for backslash, the quote, \t \n \r, other control characters as \xhh; non-ASCII code
 * points raw when Python's str.isprintable() holds for them, else \xhh, \uhhhh or \Uhhhhhhhh;
 * bytes that are not valid UTF-8 as \udc80..\udcff (Python's surrogateescape). Writes at most
 * n bytes to buf, NUL included (buf may be NULL when n is 0), and returns the length of the full
 * text, as snprintf does. */
size_t ag__pystr_repr(const char *s, size_t len, char *buf, size_t n);

/* Flags of ag__pystr_parse. */
enum {
    AG__PYSTR_NO_NEWLINE = 1,   /* a raw '\n' or '\r' before the closing quote: unterminated */
    AG__PYSTR_CONTINUATION = 2, /* a backslash before '\n' or '\r' is a line continuation */
    AG__PYSTR_NO_NAMED = 4,     /* \N{...} is an error (else kept as written, like unknown ones) */
};

/* Why ag__pystr_parse failed. */
typedef enum ag__pystr_errcode {
    AG__PYSTR_NOT_STRING = 1, /* text does not start with ' or " */
    AG__PYSTR_UNTERMINATED,   /* no closing quote */
    AG__PYSTR_TRUNCATED,      /* \x, \u or \U without its hex digits (esc, digits) */
    AG__PYSTR_NAMED,          /* \N with AG__PYSTR_NO_NAMED */
    AG__PYSTR_NUL,            /* an escape decoding to NUL */
    AG__PYSTR_RANGE,          /* a code point past U+10FFFF (cp) */
    AG__PYSTR_SURROGATE,      /* a surrogate other than \udc80..\udcff (cp) */
} ag__pystr_errcode;

typedef struct ag__pystr_err {
    ag__pystr_errcode code;
    size_t at;   /* offset in text: the opening quote, or the backslash of the escape */
    char esc;    /* AG__PYSTR_TRUNCATED: the escape letter */
    int digits;  /* AG__PYSTR_TRUNCATED: the hex digits it needs */
    uint32_t cp; /* AG__PYSTR_RANGE, AG__PYSTR_SURROGATE: the code point */
} ag__pystr_err;

/* Reads the Python string literal at text[0..len) (the text also ends at a NUL) and decodes
 * it: Python's escapes, \udc80..\udcff standing for raw bytes. The decoded string never holds a
 * NUL (that is an error) and is NUL-terminated in a buffer from alloc(ctx, size), or from
 * ag__malloc when alloc is NULL (then it is the caller's; with alloc it is never freed here).
 * Returns 0 with *out, *out_len (may be NULL) and *consumed (the bytes up to and including the
 * closing quote; may be NULL) set; AG_ENOMEM; or AG_EFORMAT with *err filled in and no error
 * message set: each caller words its own. */
int ag__pystr_parse(const char *text, size_t len, unsigned flags, void *(*alloc)(void *, size_t),
                    void *ctx, size_t *consumed, char **out, size_t *out_len, ag__pystr_err *err);

#endif
