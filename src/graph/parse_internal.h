/* Internals of the graph parser, shared by parse.c (the grammar: lines, nodes, arguments,
 * metadata items, constants) and parse_lex.c (tokens and values: errors placed at line:column,
 * the per-line pool, strings, names, numbers, VALs, metadata values, descriptors). Every
 * reader works on one NUL-terminated line and stops at its end. */
#ifndef AG_PARSE_INTERNAL_H
#define AG_PARSE_INTERNAL_H

#include "text_internal.h"

/* Limits for untrusted text. Real graphs are far below them. */
#define MAX_LIST 65536                /* elements of one list */
#define MAX_EXTENT (INT64_C(1) << 52) /* elements a VAL may span (sizes, strides, offset) */
#define CONST_SLACK 65536             /* storage a strided constant may have beyond 4 x numel */
#define MAX_NUMBER 400                /* characters of one number */
/* Custom keys, and other metadata items, of one node (the graph searches its per-node maps
 * linearly). */
#define MAX_ITEMS 1024

typedef struct ag__tconst {
    char *name;
    int li;     /* line index */
    int dup_of; /* line index of an earlier constant of the same name, or -1 */
    bool parsed;
    ag_tensor *t; /* owned once parsed */
} ag__tconst;

typedef struct ag__tparser {
    char *buf;    /* the text, each line NUL-terminated */
    char **lines; /* the lines of the block being parsed (the graph or one subgraph) */
    int nlines;
    int line0;        /* the text's line index of lines[0] (errors count lines in the whole text) */
    int col0;         /* columns cut from the lines' starts (a nested subgraph's indentation) */
    bool is_sub;      /* the block opens with `subgraph NAME():` rather than `graph():` */
    ag_graph *parent; /* for a subgraph block: the graph whose attribute it becomes */
    bool block_follows; /* another block follows this one */
    ag_graph *g;
    ag__tconst *ce;
    int64_t nce, ce_cap;
    ag__strmap consts; /* name -> index in ce + 1 */
    void **pool;       /* allocations of the current line */
    int64_t npool, pool_cap;
    int64_t *ints; /* scratch for int lists */
    int64_t ints_cap;
    void **ptrs; /* scratch for node lists and descriptor lists */
    int64_t ptrs_cap;
    char *bytes; /* scratch for constant values */
    int64_t bytes_cap;
    ag__sbuf trace;  /* continuation lines read so far */
    ag_node *last;   /* the node continuation lines would belong to */
    bool seen_other; /* a non-placeholder node was read */
} ag__tparser;

/* A position: a line and a cursor in it. */
typedef struct ag__tcur {
    ag__tparser *P;
    int li;
    const char *line;
    const char *p;
} ag__tcur;

/* ---- errors and the line pool (parse_lex.c) ---- */

/* Sets "line L:C: <fmt>" with C the column of `at` in c's line; returns AG_EFORMAT. */
int ag__lx_err(const ag__tcur *c, const char *at, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* "expected WHAT, got ..." at the cursor. */
int ag__lx_expected(const ag__tcur *c, const char *what);
/* A graph API call failed: its message placed at `at`, naming the node (AG_ENOMEM stays). */
int ag__lx_api_err(const ag__tcur *c, const char *at, const char *node);
/* Memory freed with the current line (ag__lx_pool_clear). */
void *ag__lx_alloc(ag__tparser *P, size_t n);
void ag__lx_pool_clear(ag__tparser *P);

/* ---- tokens (parse_lex.c): each reads at the cursor and advances it, or fails ---- */

/* A Python string literal; the decoded string is pool-owned and holds no NUL. */
int ag__lx_str(ag__tcur *c, char **out);
/* A name: [A-Za-z0-9_]+ or a quoted string (pool-owned); `what` names it in errors. */
int ag__lx_name(ag__tcur *c, char **out, const char *what);
/* An int (-?[0-9]+, range-checked) or a float ('.' or an exponent, inf, -inf, nan); `single`
 * reads floats with strtof. */
int ag__lx_number(ag__tcur *c, bool *is_float, int64_t *iv, double *f, bool single);
int ag__lx_int(ag__tcur *c, int64_t *v, const char *what);
/* DTYPE[SIZES]{STRIDES}+OFFSET within the limits above. */
int ag__lx_val(ag__tcur *c, ag_tmeta *m);
/* VAL, or a tuple of them: "(VAL, ...)", "(VAL,)", "()". */
int ag__lx_vals(ag__tcur *c, ag_tmeta *vals, int *n);
/* Why an inferred VAL breaks those limits, or NULL. */
const char *ag__lx_val_out_of_range(const ag_tmeta *m);
/* Vals as the printer writes them (pool-owned), for messages. */
const char *ag__lx_vals_str(ag__tparser *P, const ag_tmeta *v, int n, bool tuple);
/* A metadata value: None, True, False, a number or a string. */
int ag__lx_mval(ag__tcur *c, ag_mval *v);
/* A descriptor repr, or None (*d = NULL); *d is a new reference. */
int ag__lx_desc(ag__tcur *c, ag_desc **d);

/* parse_effects.c: the with_effects op of a `with_effects(%token, 'ns::op', ...)` line, found
 * by looking ahead at its first two arguments (the cursor is left where it was). */
int ag__lx_with_effects_op(ag__tcur *c, const ag_op **op);

/* ---- small lexing helpers ---- */

static inline bool lx_ident_start(char ch) {
    return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || ch == '_';
}
static inline bool lx_ident_char(char ch) {
    return lx_ident_start(ch) || (ch >= '0' && ch <= '9');
}

static inline void lx_skip_ws(ag__tcur *c) {
    while (*c->p == ' ' || *c->p == '\t')
        c->p++;
}

/* Consumes `ch` (after blanks) when it is next. */
static inline bool lx_accept(ag__tcur *c, char ch) {
    lx_skip_ws(c);
    if (*c->p != ch)
        return false;
    c->p++;
    return true;
}

static inline int lx_expect(ag__tcur *c, char ch, const char *what) {
    if (lx_accept(c, ch))
        return 0;
    return ag__lx_expected(c, what);
}

/* Consumes the word w (after blanks) when it is next and not followed by an identifier
 * character. */
static inline bool lx_accept_word(ag__tcur *c, const char *w) {
    lx_skip_ws(c);
    size_t n = strlen(w);
    if (strncmp(c->p, w, n) || lx_ident_char(c->p[n]))
        return false;
    c->p += n;
    return true;
}

/* Length of the identifier at s (0 if none). */
static inline size_t lx_ident_len(const char *s) {
    if (!lx_ident_start(*s))
        return 0;
    size_t n = 1;
    while (lx_ident_char(s[n]))
        n++;
    return n;
}

#endif
