/* The graph parser: text (docs/GRAPH_FORMAT.md) in, a graph out, or NULL with the first
 * problem as "line L:C: expected ..., got ...".
 *
 * The text is untrusted: any byte string gives a graph or a clean error, never a crash, a hang,
 * a leak or undefined behaviour (fuzz/fuzz_parse.c checks this). So: the input is copied once
 * and split into NUL-terminated lines, and every reader below stops at a line's end; nothing
 * recurses except descriptors (bounded by AG_DESC_MAX_DEPTH) and nested subgraph blocks
 * (bounded by AG_SUBGRAPH_MAX_DEPTH); sizes in VALs are bounded so no
 * meta computation overflows; constants allocate only what their values in the text fill.
 *
 * Graphs are built through the public graph API only, so a parsed graph is as well formed as
 * any other: calls get their vals from the op's meta function (the VAL in the text is then
 * compared with it), getitem reads its source's val, get_attr its constant's.
 *
 * Order of work: the text is cut into blocks, the graph's lines and one block per `subgraph
 * NAME():` line; the subgraph blocks are parsed first, each into a graph of its own that
 * becomes an attribute of the graph, so that the graph's get_attr lines find them (a subgraph's
 * own subgraphs, its blocks indented four more spaces after its lines, likewise first). In each
 * block a pre-pass indexes the `constant` lines by name (a constant is used before its
 * line), then the lines are read in order; a constant's values are parsed when a get_attr
 * first uses it, and unused ones when their line is reached. Strings, lists and names read
 * while parsing one line live in a pool freed when the line is done.
 *
 * This file is the grammar (lines, nodes, arguments, metadata items, constants); the tokens
 * and values it reads (strings, numbers, VALs, descriptors, errors at line:column) are in
 * parse_lex.c, their shared declarations in parse_internal.h. */
#include "parse_internal.h"

#include <stdio.h>
#include <stdlib.h>

typedef ag__tcur cur;
typedef ag__tparser parser;
typedef ag__tconst centry;

/* `# VAL` after a call: checks it against the vals the graph inferred. */
static int check_vals(cur *c, ag_node *n) {
    lx_skip_ws(c);
    const char *at = c->p;
    ag_tmeta vals[AG_MAX_OUTPUTS];
    int nv;
    int rc = ag__lx_vals(c, vals, &nv);
    if (rc)
        return rc;
    bool same = nv == ag_node_num_vals(n);
    for (int i = 0; same && i < nv; i++)
        same = ag__tmeta_equal(&vals[i], ag_node_val(n, i));
    if (!same) {
        bool tuple = nv != 1 || ag_node_num_vals(n) != 1;
        const char *given = ag__lx_vals_str(c->P, vals, nv, tuple);
        const char *inferred = ag__lx_vals_str(c->P, ag_node_val(n, 0), ag_node_num_vals(n), tuple);
        return ag__lx_err(c, at, "%%%s: VAL %s does not match the inferred %s", ag_node_name(n),
                          given, inferred);
    }
    return 0;
}

/* ---- metadata items ---- */

static int parse_custom(cur *c, ag_node *n) {
    if (lx_accept(c, '}'))
        return 0;
    for (;;) {
        lx_skip_ws(c);
        char *key;
        int rc = ag__lx_str(c, &key);
        if (rc)
            return rc;
        if ((rc = lx_expect(c, ':', "':'")))
            return rc;
        lx_skip_ws(c);
        const char *vat = c->p;
        ag_mval v;
        if ((rc = ag__lx_mval(c, &v)))
            return rc;
        if (v.kind == AG_MV_NONE)
            return ag__lx_err(c, vat, "custom annotation '%s' may not be None", key);
        if (ag_node_custom_count(n) >= MAX_ITEMS)
            return ag__lx_err(c, vat, "more than %d custom annotations on one node", MAX_ITEMS);
        if (ag_node_custom_set(n, key, v))
            return ag__lx_api_err(c, vat, ag_node_name(n));
        if (lx_accept(c, '}'))
            return 0;
        if ((rc = lx_expect(c, ',', "',' or '}'")))
            return rc;
        if (lx_accept(c, '}'))
            return 0;
    }
}

static int blank_str(cur *c, char **out) {
    lx_skip_ws(c);
    return ag__lx_str(c, out);
}

/* `nn_module_stack={'KEY': ('PATH', 'TYPE'), ...}` (or fwd_nn_module_stack), after the '{':
 * the frames in any spacing Python would read (a trailing comma too); `{}` is no stack. */
static int parse_module_stack(cur *c, ag_node *n, bool fwd, const char *at) {
    ag_module_frame *f = NULL;
    int count = 0, cap = 0;
    while (!lx_accept(c, '}')) {
        if (count == AG_MODULE_STACK_MAX)
            return ag__lx_err(c, c->p, "more than %d frames in a module stack",
                              AG_MODULE_STACK_MAX);
        if (count == cap) {
            cap = cap ? 2 * cap : 8;
            ag_module_frame *nf = ag__lx_alloc(c->P, sizeof *nf * (size_t)cap);
            if (!nf)
                return AG_ENOMEM;
            if (count)
                memcpy(nf, f, sizeof *nf * (size_t)count);
            f = nf; /* the old array stays in the line's pool */
        }
        char *s[3];
        int rc = blank_str(c, &s[0]);
        if (!rc)
            rc = lx_expect(c, ':', "':'");
        if (!rc)
            rc = lx_expect(c, '(', "'(' opening a frame's (path, type)");
        if (!rc)
            rc = blank_str(c, &s[1]);
        if (!rc)
            rc = lx_expect(c, ',', "','");
        if (!rc)
            rc = blank_str(c, &s[2]);
        if (!rc)
            rc = lx_expect(c, ')', "')'");
        if (rc)
            return rc;
        f[count++] = (ag_module_frame){s[0], s[1], s[2]};
        if (lx_accept(c, '}'))
            break;
        if ((rc = lx_expect(c, ',', "',' or '}'")))
            return rc;
    }
    int rc = fwd ? ag_node_set_fwd_nn_module_stack(n, f, count)
                 : ag_node_set_nn_module_stack(n, f, count);
    return rc ? ag__lx_api_err(c, at, ag_node_name(n)) : 0;
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
            return ag_node_set_partitioner_tag(n, tags[i])
                       ? ag__lx_api_err(c, word, ag_node_name(n))
                       : 0;
    if (w == 12 && !strncmp(word, "gradient_acc", 12))
        return ag_node_set_gradient_acc(n, true) ? ag__lx_api_err(c, word, ag_node_name(n)) : 0;
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
        lx_skip_ws(c);
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
        size_t w = lx_ident_len(c->p);
        if (*c->p == '\'' || *c->p == '"') {
            if ((rc = ag__lx_str(c, &key)))
                return rc;
        } else if (w) {
            cur peek = *c;
            peek.p += w;
            lx_skip_ws(&peek);
            if (*peek.p != '=') {
                bool done;
                if ((rc = bare_item(c, n, c->p, w, &done)))
                    return rc;
                if (!done)
                    return ag__lx_expected(c, "a metadata item");
                c->p += w;
                continue;
            }
            if (!(key = ag__lx_alloc(c->P, w + 1)))
                return AG_ENOMEM;
            memcpy(key, c->p, w);
            key[w] = 0;
            c->p += w;
        } else {
            return ag__lx_expected(c, "a metadata item");
        }
        if ((rc = lx_expect(c, '=', "'='")))
            return rc;
        lx_skip_ws(c);
        const char *vat = c->p;
        size_t vw = lx_ident_len(c->p);
        ag_mval v = {0};
        int r = -1;
        bool fwd = !strcmp(key, "fwd_nn_module_stack");
        if (*c->p == '{' && (fwd || !strcmp(key, "nn_module_stack"))) {
            c->p++;
            if ((rc = parse_module_stack(c, n, fwd, vat)))
                return rc;
            continue;
        }
        if (!strcmp(key, "recompute") && vw && !is_value_word(c->p, vw)) {
            for (int i = 0; i < 4; i++)
                if (strlen(recomputes[i]) == vw && !strncmp(c->p, recomputes[i], vw))
                    r = i;
            if (r < 0)
                return ag__lx_expected(
                    c, "MUST_SAVE, PREFER_SAVE, MUST_RECOMPUTE or PREFER_RECOMPUTE");
            c->p += vw;
            v = (ag_mval){.kind = AG_MV_STR, .u.s = recomputes[r]};
        } else if ((rc = ag__lx_mval(c, &v))) {
            return rc;
        }
        if (ag_node_meta_count(n) >= MAX_ITEMS)
            return ag__lx_err(c, vat, "more than %d metadata items on one node", MAX_ITEMS);
        if (ag_node_meta_set(n, key, v))
            return ag__lx_api_err(c, vat, ag_node_name(n));
    }
}

/* ---- arguments ---- */

static int parse_ref(cur *c, ag_node **out);

static bool is_list_type(ag_type t) {
    return t == AG_TY_TENSOR_LIST || t == AG_TY_OPT_TENSOR_LIST;
}

/* [ints] or [%nodes / None]; an empty list takes the kind the schema wants. */
static int parse_list(cur *c, ag_type ty, ag_garg *out) {
    parser *P = c->P;
    c->p++; /* '[' */
    lx_skip_ws(c);
    bool nodes = *c->p == '%' || (!strncmp(c->p, "None", 4) && !lx_ident_char(c->p[4]));
    int n = 0, rc;
    if (*c->p == ']') {
        c->p++;
        nodes = is_list_type(ty);
    } else {
        for (;;) {
            lx_skip_ws(c);
            if (n == MAX_LIST)
                return ag__lx_err(c, c->p, "list longer than %d elements", MAX_LIST);
            if (nodes) {
                if (ag__grow((void **)&P->ptrs, &P->ptrs_cap, n + 1, sizeof *P->ptrs))
                    return AG_ENOMEM;
                ag_node *nd = NULL;
                if (!lx_accept_word(c, "None")) {
                    if (*c->p != '%')
                        return ag__lx_expected(c, "a node or None");
                    if ((rc = parse_ref(c, &nd)))
                        return rc;
                }
                P->ptrs[n++] = nd;
            } else {
                if (ag__grow((void **)&P->ints, &P->ints_cap, n + 1, sizeof *P->ints))
                    return AG_ENOMEM;
                if ((rc = ag__lx_int(c, &P->ints[n++], "a list element")))
                    return rc;
            }
            if (lx_accept(c, ']'))
                break;
            if ((rc = lx_expect(c, ',', "',' or ']'")))
                return rc;
            if (lx_accept(c, ']'))
                break;
        }
    }
    size_t es = nodes ? sizeof(ag_node *) : sizeof(int64_t);
    void *v = ag__lx_alloc(P, es * (size_t)(n ? n : 1));
    if (!v)
        return AG_ENOMEM;
    if (n)
        memcpy(v, nodes ? (void *)P->ptrs : (void *)P->ints, es * (size_t)n);
    *out = nodes ? AG_GA_NODES((ag_node **)v, n) : AG_GA_INTS((int64_t *)v, n);
    return 0;
}

static int parse_arg(cur *c, ag_type ty, ag_garg *out);

/* "(ELEM, ...)" (a tuple: None, nodes, ints, floats, bools; `(x,)` for one) or
 * "{'KEY': VALUE, ...}" (a dict of scalars), read into parser memory. */
static int parse_aggregate(cur *c, ag_garg *out) {
    parser *P = c->P;
    const bool tuple = *c->p == '(';
    const char close = tuple ? ')' : '}';
    c->p++; /* `(x)` is read as the tuple `(x,)`, as the return line reads `(%a)` */
    size_t es = tuple ? sizeof(ag_garg) : sizeof(ag_gitem);
    void *buf = NULL; /* the elements so far (heap; copied into parser memory at the end) */
    int64_t cap = 0;
    int n = 0, rc = 0;
    while (!lx_accept(c, close)) {
        lx_skip_ws(c);
        const char *at = c->p;
        if (n == (tuple ? AG__TUPLE_MAX : AG__DICT_MAX)) {
            rc = ag__lx_err(c, at,
                            tuple ? "tuple longer than %d elements" : "dict of more than %d items",
                            tuple ? AG__TUPLE_MAX : AG__DICT_MAX);
            break;
        }
        if ((rc = ag__grow(&buf, &cap, n + 1, es)))
            break;
        if (tuple) {
            ag_garg *e = (ag_garg *)buf + n;
            if (*at == '(' || *at == '[' || *at == '{' || *at == '\'' || *at == '"' ||
                !strncmp(at, "torch.", 6)) {
                rc =
                    ag__lx_expected(c, "a tuple element (None, a node, an int, a float or a bool)");
                break;
            }
            if ((rc = parse_arg(c, AG_TY_ANY, e)))
                break;
        } else {
            ag_gitem *it = (ag_gitem *)buf + n;
            char *key;
            if ((rc = ag__lx_str(c, &key)))
                break;
            if (!*key) {
                rc = ag__lx_err(c, at, "an empty dict key");
                break;
            }
            for (int j = 0; j < n && !rc; j++)
                if (!strcmp(((ag_gitem *)buf)[j].key, key))
                    rc = ag__lx_err(c, at, "dict key '%s' given twice", key);
            if (rc || (rc = lx_expect(c, ':', "':'")) || (rc = ag__lx_mval(c, &it->v)))
                break;
            it->key = key;
        }
        n++;
        if (lx_accept(c, close))
            break;
        if ((rc = lx_expect(c, ',', tuple ? "',' or ')'" : "',' or '}'")))
            break;
    }
    void *v = rc ? NULL : ag__lx_alloc(P, es * (size_t)(n ? n : 1));
    if (!rc && !v)
        rc = AG_ENOMEM;
    if (!rc && n)
        memcpy(v, buf, es * (size_t)n);
    ag__free(buf);
    if (rc)
        return rc;
    *out = tuple ? AG_GA_TUPLE((ag_garg *)v, n) : AG_GA_DICT((ag_gitem *)v, n);
    return 0;
}

static int parse_arg(cur *c, ag_type ty, ag_garg *out) {
    lx_skip_ws(c);
    char ch = *c->p;
    int rc;
    if (ch == '(' || ch == '{')
        return parse_aggregate(c, out);
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
        if ((rc = ag__lx_str(c, &s)))
            return rc;
        *out = AG_GA_S(s);
        return 0;
    }
    if (lx_accept_word(c, "None"))
        return (*out = AG_GA_NIL, 0);
    if (lx_accept_word(c, "True"))
        return (*out = AG_GA_B(true), 0);
    if (lx_accept_word(c, "False"))
        return (*out = AG_GA_B(false), 0);
    if (!strncmp(c->p, "torch.", 6)) {
        static const char *const dts[AG_NDTYPES] = {"float32", "float64", "int64", "bool", "int8"};
        const char *w = c->p + 6;
        size_t n = lx_ident_len(w);
        for (int i = 0; i < AG_NDTYPES; i++)
            if (n == strlen(dts[i]) && !strncmp(w, dts[i], n)) {
                c->p = w + n;
                *out = AG_GA_DT((ag_dtype)i);
                return 0;
            }
        c->p = w;
        return ag__lx_expected(c, "float32, float64, int64 or bool");
    }
    if ((ch >= '0' && ch <= '9') || ch == '-' || !strncmp(c->p, "inf", 3) ||
        !strncmp(c->p, "nan", 3)) {
        bool flt = false;
        int64_t i = 0;
        double f = 0;
        if ((rc = ag__lx_number(c, &flt, &i, &f, false)))
            return rc;
        *out = flt ? AG_GA_F(f) : AG_GA_I(i);
        return 0;
    }
    return ag__lx_expected(c, "an argument");
}

/* The schema default of argument i as a graph argument (pointers borrowed from the schema). */
static bool default_garg(const ag_schema_arg *sa, ag_garg *out) {
    if (!sa->has_default)
        return false;
    const ag_arg *d = &sa->def;
    switch (d->kind) {
    case AG_ARG_NONE:
        *out = AG_GA_NIL;
        return true;
    case AG_ARG_INT:
        *out = AG_GA_I(d->u.i);
        return true;
    case AG_ARG_FLOAT:
        *out = AG_GA_F(d->u.f);
        return true;
    case AG_ARG_BOOL:
        *out = AG_GA_B(d->u.b);
        return true;
    case AG_ARG_INTS:
        *out = AG_GA_INTS(d->u.ints, d->n);
        return true;
    case AG_ARG_DTYPE:
        *out = AG_GA_DT(d->u.dt);
        return true;
    case AG_ARG_STR:
        *out = AG_GA_S(d->u.s);
        return true;
    default:
        return false;
    }
}

/* "(ARGS)" of a call: positional arguments, then name=value ones (any argument may be given
 * by name); arguments left out before the last one given take their defaults. */
static int parse_args(cur *c, const ag_op *op, ag_garg *args, int *nargs) {
    int nop = ag_op_nargs(op), pos = 0, top = 0, rc;
    bool set[AG_MAX_ARGS] = {false}, kw = false;
    if (!lx_accept(c, ')')) {
        for (;;) {
            lx_skip_ws(c);
            const char *at = c->p;
            int idx = -1;
            size_t w = lx_ident_len(c->p);
            if (w) {
                cur peek = *c;
                peek.p += w;
                lx_skip_ws(&peek);
                if (*peek.p == '=') {
                    for (int i = 0; i < nop; i++) {
                        const char *nm = ag_op_arg(op, i)->name;
                        if (strlen(nm) == w && !strncmp(nm, at, w))
                            idx = i;
                    }
                    if (idx < 0)
                        return ag__lx_err(c, at, "%s has no argument '%.*s'", ag_op_name(op),
                                          (int)w, at);
                    if (set[idx])
                        return ag__lx_err(c, at, "argument '%s' given twice",
                                          ag_op_arg(op, idx)->name);
                    kw = true;
                    c->p = peek.p + 1;
                }
            }
            if (idx < 0) {
                if (kw)
                    return ag__lx_err(c, at, "positional argument after keyword arguments");
                if (pos >= nop)
                    return ag__lx_err(c, at, "%s takes %d argument%s", ag_op_name(op), nop,
                                      nop == 1 ? "" : "s");
                idx = pos++;
            }
            if ((rc = parse_arg(c, ag_op_arg(op, idx)->type, &args[idx])))
                return rc;
            set[idx] = true;
            if (idx + 1 > top)
                top = idx + 1;
            if (lx_accept(c, ')'))
                break;
            if ((rc = lx_expect(c, ',', "',' or ')'")))
                return rc;
            if (lx_accept(c, ')'))
                break;
        }
    }
    for (int i = 0; i < top; i++)
        if (!set[i] && !default_garg(ag_op_arg(op, i), &args[i]))
            return ag__lx_err(c, c->p - 1, "%s: missing argument '%s'", ag_op_name(op),
                              ag_op_arg(op, i)->name);
    *nargs = top;
    return 0;
}

/* invoke_subgraph's arguments as upstream prints them: the subgraph's get_attr, the
 * identifier, then the operands as trailing arguments (`invoke_subgraph(%s, 'id', %a, %b)`);
 * they become the schema's operand list. */
static int parse_invoke_args(cur *c, const ag_op *op, ag_garg *args, int *nargs) {
    parser *P = c->P;
    int rc, n = 0;
    for (int i = 0; i < 2; i++) {
        lx_skip_ws(c);
        const char *at = c->p;
        if (i == 0 ? *at != '%' : (*at != '\'' && *at != '"'))
            return ag__lx_expected(c, i == 0 ? "the subgraph's get_attr node"
                                             : "the identifier (a string)");
        if ((rc = parse_arg(c, ag_op_arg(op, i)->type, &args[i])))
            return rc;
        if (i == 0 && (rc = lx_expect(c, ',', "','")))
            return rc;
    }
    while (lx_accept(c, ',')) {
        lx_skip_ws(c);
        if (*c->p == ')')
            break;
        if (*c->p != '%')
            return ag__lx_expected(c, "an operand node");
        if (n == MAX_LIST)
            return ag__lx_err(c, c->p, "more than %d operands", MAX_LIST);
        if (ag__grow((void **)&P->ptrs, &P->ptrs_cap, n + 1, sizeof *P->ptrs))
            return AG_ENOMEM;
        ag_node *nd;
        if ((rc = parse_ref(c, &nd)))
            return rc;
        P->ptrs[n++] = nd;
    }
    if ((rc = lx_expect(c, ')', "',' or ')'")))
        return rc;
    ag_node **v = ag__lx_alloc(P, sizeof *v * (size_t)(n ? n : 1));
    if (!v)
        return AG_ENOMEM;
    if (n)
        memcpy(v, P->ptrs, sizeof *v * (size_t)n);
    args[2] = AG_GA_NODES(v, n);
    *nargs = 3;
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
            if (ag__lx_name(&t, &nm, "name") || strcmp(nm, name))
                continue;
            s = t.p;
        } else {
            if (strncmp(s, name, n) || lx_ident_char(s[n]))
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
    lx_skip_ws(c);
    const char *at = c->p;
    if (*c->p != '%')
        return ag__lx_expected(c, "'%name'");
    c->p++;
    char *name;
    int rc = ag__lx_name(c, &name, "a node name");
    if (rc)
        return rc;
    ag_node *n = ag_graph_find(c->P->g, name);
    if (!n || ag_node_kind_of(n) == AG_NODE_OUTPUT) {
        int li = find_def_line(c->P, name, c->li, c->P->nlines);
        if (li >= 0)
            return ag__lx_err(c, at, "%%%s is used before its definition on line %d", name,
                              c->P->line0 + li + 1);
        return ag__lx_err(c, at, "unknown node %%%s", name);
    }
    *out = n;
    return 0;
}

/* ---- constants ---- */

/* Stores one parsed value of a constant at element offset `off`. */
static int const_value(cur *c, ag_dtype dt, char *dst) {
    lx_skip_ws(c);
    const char *at = c->p;
    if (dt == AG_BOOL) {
        if (lx_accept_word(c, "True"))
            return (*dst = 1, 0);
        if (lx_accept_word(c, "False"))
            return (*dst = 0, 0);
        return ag__lx_expected(c, "True or False");
    }
    bool flt = false;
    int64_t i = 0;
    double f = 0;
    int rc = ag__lx_number(c, &flt, &i, &f, dt == AG_F32);
    if (rc)
        return rc;
    if (dt == AG_I64) {
        if (flt)
            return ag__lx_err(c, at, "expected an int, got a float");
        memcpy(dst, &i, 8);
    } else if (dt == AG_I8) {
        if (flt || i < INT8_MIN || i > INT8_MAX)
            return ag__lx_err(c, at, "expected an int8 (-128 .. 127)");
        *dst = (char)(int8_t)i;
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
    lx_skip_ws(&c);
    if ((rc = ag__lx_name(&c, &name, "a constant name")))
        return rc;
    if ((rc = lx_expect(&c, ':', "':'")))
        return rc;
    lx_skip_ws(&c);
    const char *vat = c.p;
    ag_tmeta m;
    if ((rc = ag__lx_val(&c, &m)) || (rc = lx_expect(&c, '=', "'='")))
        return rc;
    int64_t numel = ag__numel(m.ndim, m.sizes), extent = m.offset + (numel > 0);
    for (int i = 0; i < m.ndim; i++)
        if (m.sizes[i] > 0)
            extent += (m.sizes[i] - 1) * m.strides[i];
    if (numel == 0)
        extent = m.offset;
    bool meta = lx_accept_word(&c, "meta");
    int64_t n = 0;
    size_t es = ag_dtype_size(m.dtype);
    if (!meta) {
        lx_skip_ws(&c);
        const char *lat = c.p;
        if ((rc = lx_expect(&c, '[', "'[' or meta")))
            return rc;
        if (!lx_accept(&c, ']')) {
            for (;;) {
                if (n == numel) {
                    lx_skip_ws(&c);
                    return ag__lx_err(&c, lat,
                                      "constant %s: more values than the %lld elements of its VAL",
                                      name, (long long)numel);
                }
                if (ag__grow((void **)&P->bytes, &P->bytes_cap, (n + 1) * (int64_t)es, 1))
                    return AG_ENOMEM;
                if ((rc = const_value(&c, m.dtype, P->bytes + n * (int64_t)es)))
                    return rc;
                n++;
                if (lx_accept(&c, ']'))
                    break;
                if ((rc = lx_expect(&c, ',', "',' or ']'")))
                    return rc;
                if (lx_accept(&c, ']'))
                    break;
            }
        }
        if (n != numel)
            return ag__lx_err(&c, lat, "constant %s: %lld values for the %lld elements of its VAL",
                              name, (long long)n, (long long)numel);
        /* Gaps of a strided constant are allocated too: bounded by what the text provides. */
        if (extent > 4 * numel + CONST_SLACK)
            return ag__lx_err(&c, vat,
                              "constant %s: its strides and offset span %lld elements for %lld "
                              "values",
                              name, (long long)extent, (long long)numel);
    }
    lx_skip_ws(&c);
    if (*c.p)
        return ag__lx_expected(&c, "end of line");
    ag_tensor *base = ag__tensor_new(m.dtype, 1, &extent, meta);
    if (!base)
        return ag_last_status() == AG_ENOMEM ? AG_ENOMEM
                                             : ag__lx_err(&c, vat, "%s", ag_last_error());
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
        lx_skip_ws(&c);
        char *name;
        int rc = ag__lx_name(&c, &name, "name");
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
    ag__lx_pool_clear(P);
    return 0;
}

/* ---- lines ---- */

static int placeholder_line(cur *c, const char *start, const char *name) {
    parser *P = c->P;
    if (P->seen_other)
        return ag__lx_err(c, start, "placeholder %%%s after other nodes (placeholders come first)",
                          name);
    lx_skip_ws(c);
    ag_tmeta m;
    bool has_val = !lx_accept_word(c, "None");
    int rc;
    if (has_val && (rc = ag__lx_val(c, &m)))
        return rc;
    ag_node *n = ag_graph_placeholder(P->g, name, has_val ? &m : NULL);
    if (!n)
        return ag__lx_api_err(c, start, name);
    P->last = n;
    if (!lx_accept(c, '#')) {
        lx_skip_ws(c);
        return *c->p ? ag__lx_expected(c, "'#' or end of line") : 0;
    }
    lx_skip_ws(c);
    const char *dat = c->p;
    ag_desc *d;
    if ((rc = ag__lx_desc(c, &d)))
        return rc;
    if (d && !ag_desc_is_input(d)) {
        ag_desc_release(d);
        return ag__lx_err(c, dat, "%%%s: a placeholder takes an input descriptor (...AOTInput)",
                          name);
    }
    rc = ag_node_set_desc(n, d);
    ag_desc_release(d);
    if (rc)
        return ag__lx_api_err(c, dat, name);
    return parse_items(c, n);
}

static int call_line(cur *c, const char *start, const char *name) {
    parser *P = c->P;
    P->seen_other = true;
    lx_skip_ws(c);
    const char *opat = c->p;
    size_t w = lx_ident_len(c->p);
    if (!w)
        return ag__lx_expected(c, "an op name");
    const char *e = c->p + w;
    if (e[0] == ':' && e[1] == ':' && lx_ident_len(e + 2))
        e += 2 + lx_ident_len(e + 2);
    if (e[0] == '.' && lx_ident_char(e[1])) {
        e++;
        while (lx_ident_char(*e))
            e++;
    }
    size_t oplen = (size_t)(e - opat);
    char *opname = ag__lx_alloc(P, oplen + 1);
    if (!opname)
        return AG_ENOMEM;
    memcpy(opname, opat, oplen);
    opname[oplen] = 0;
    c->p = e;
    int rc = lx_expect(c, '(', "'('");
    if (rc)
        return rc;
    ag_node *n;
    if (!strcmp(opname, "getitem")) {
        ag_node *src;
        int64_t idx;
        if ((rc = parse_ref(c, &src)) || (rc = lx_expect(c, ',', "','")))
            return rc;
        lx_skip_ws(c);
        const char *iat = c->p;
        if ((rc = ag__lx_int(c, &idx, "an output index")))
            return rc;
        lx_accept(c, ',');
        if ((rc = lx_expect(c, ')', "')'")))
            return rc;
        if (idx < 0 || idx >= AG_MAX_OUTPUTS)
            return ag__lx_err(c, iat, "%%%s: output index %lld out of range", name, (long long)idx);
        n = ag_graph_getitem(P->g, src, (int)idx, name);
    } else if (!strcmp(opname, "get_attr")) {
        lx_skip_ws(c);
        const char *tat = c->p;
        char *target;
        if ((rc = ag__lx_name(c, &target, "a constant name")))
            return rc;
        lx_accept(c, ',');
        if ((rc = lx_expect(c, ')', "')'")))
            return rc;
        intptr_t k = (intptr_t)ag__strmap_get(&P->consts, target);
        if (ag_graph_subgraph(P->g, target)) {
            if (k)
                return ag__lx_err(c, tat, "'%s' names both a constant and a subgraph", target);
            n = ag_graph_get_attr_subgraph(P->g, target, name);
        } else {
            if (!k)
                return ag__lx_err(c, tat,
                                  "unknown attribute '%s' (no `constant %s` line or `subgraph "
                                  "%s():` block)",
                                  target, target, target);
            centry *ce = &P->ce[k - 1];
            if (!ce->parsed && (rc = parse_constant(P, ce)))
                return rc;
            n = ag_graph_get_attr(P->g, ce->t, name);
        }
    } else {
        const ag_op *op = ag_op_find(opname);
        if (!op && !strcmp(opname, "invoke_subgraph") && !(op = ag_op_invoke_subgraph()))
            return AG_ENOMEM;
        if (!op)
            op = ag__op_flex_find(opname); /* flex_attention's higher-order ops (flex_hop.c) */
        if (!op && !strcmp(opname, "with_effects") && (rc = ag__lx_with_effects_op(c, &op)))
            return rc;
        if (!op)
            return ag__lx_err(c, opat, "unknown op '%s'", opname);
        ag_garg args[AG_MAX_ARGS];
        int nargs = 0;
        const char *aat = c->p;
        if (op == ag_op_invoke_subgraph() ? (rc = parse_invoke_args(c, op, args, &nargs))
                                          : (rc = parse_args(c, op, args, &nargs)))
            return rc;
        ag__flex_legacy legacy; /* flex_attention written before tuples: upstream's form */
        if (ag__op_is_flex(op) && ag__flex_legacy_args(op, args, &nargs, &legacy) < 0)
            return ag__lx_api_err(c, aat, name);
        n = ag_graph_call(P->g, op, args, nargs, name);
    }
    if (!n)
        return ag__lx_api_err(c, start, name);
    for (int i = 0; i < ag_node_num_vals(n); i++) {
        const char *why = ag__lx_val_out_of_range(ag_node_val(n, i));
        if (why)
            return ag__lx_err(c, start, "%%%s: the inferred VAL %s has %s", name,
                              ag__lx_vals_str(P, ag_node_val(n, i), 1, false), why);
    }
    P->last = n;
    if (!lx_accept(c, '#')) {
        lx_skip_ws(c);
        return *c->p ? ag__lx_expected(c, "'#' or end of line") : 0;
    }
    if (ag_node_subgraph(n)) {
        if (!lx_accept_word(c, "subgraph"))
            return ag__lx_expected(c, "'subgraph' (a get_attr of a subgraph has no VAL)");
    } else if ((rc = check_vals(c, n))) {
        return rc;
    }
    return parse_items(c, n);
}

static int return_line(cur *c, const char *start) {
    parser *P = c->P;
    int rc = lx_expect(c, '(', "'('");
    if (rc)
        return rc;
    int n = 0;
    if (!lx_accept(c, ')')) {
        for (;;) {
            lx_skip_ws(c);
            if (n == MAX_LIST)
                return ag__lx_err(c, c->p, "more than %d outputs", MAX_LIST);
            if (ag__grow((void **)&P->ptrs, &P->ptrs_cap, n + 1, sizeof *P->ptrs))
                return AG_ENOMEM;
            ag_node *nd = NULL;
            if (!lx_accept_word(c, "None")) {
                if (*c->p != '%')
                    return ag__lx_expected(c, "a node or None");
                const char *at = c->p;
                if ((rc = parse_ref(c, &nd)))
                    return rc;
                if (ag_node_kind_of(nd) == AG_NODE_CALL && ag_node_num_vals(nd) != 1)
                    return ag__lx_err(c, at, "%%%s has %d outputs: return one through getitem",
                                      ag_node_name(nd), ag_node_num_vals(nd));
            }
            P->ptrs[n++] = nd;
            if (lx_accept(c, ')'))
                break;
            if ((rc = lx_expect(c, ',', "',' or ')'")))
                return rc;
            if (lx_accept(c, ')'))
                break;
        }
    }
    ag_node *out = ag_graph_output(P->g, (ag_node *const *)P->ptrs, n);
    if (!out)
        return ag__lx_api_err(c, start, "output");
    P->last = out;
    if (!lx_accept(c, '#')) {
        lx_skip_ws(c);
        return *c->p ? ag__lx_expected(c, "'#' or end of line") : 0;
    }
    if (lx_accept_word(c, "None"))
        return parse_items(c, out);
    lx_skip_ws(c);
    const char *lat = c->p;
    if ((rc = lx_expect(c, '[', "'[' or None")))
        return rc;
    /* Descriptors go into the scratch array behind the outputs (which are no longer needed). */
    int nd = 0;
    rc = 0;
    if (!lx_accept(c, ']')) {
        for (;;) {
            if (nd == MAX_LIST) {
                rc = ag__lx_err(c, c->p, "too many descriptors");
                break;
            }
            if (ag__grow((void **)&P->ptrs, &P->ptrs_cap, nd + 1, sizeof *P->ptrs)) {
                rc = AG_ENOMEM;
                break;
            }
            lx_skip_ws(c);
            const char *dat = c->p;
            ag_desc *d;
            if ((rc = ag__lx_desc(c, &d)))
                break;
            P->ptrs[nd++] = d;
            if (d && !ag_desc_is_output(d)) {
                rc = ag__lx_err(c, dat,
                                "output %d: an output takes an output descriptor (...AOTOutput)",
                                nd - 1);
                break;
            }
            if (lx_accept(c, ']'))
                break;
            if ((rc = lx_expect(c, ',', "',' or ']'")))
                break;
            if (lx_accept(c, ']'))
                break;
        }
    }
    if (!rc && nd != n)
        rc = ag__lx_err(c, lat, "%d descriptors for %d outputs", nd, n);
    if (!rc && ag_node_set_output_descs(out, (ag_desc *const *)P->ptrs, nd))
        rc = ag__lx_api_err(c, lat, "output");
    for (int i = 0; i < nd; i++)
        ag_desc_release(P->ptrs[i]);
    return rc ? rc : parse_items(c, out);
}

/* A node line (the cursor after its indentation). */
static int node_line(cur *c) {
    const char *start = c->p;
    if (lx_accept_word(c, "return"))
        return return_line(c, start);
    if (*c->p != '%')
        return ag__lx_expected(c, "'%name' or 'return'");
    c->p++;
    char *name;
    int rc = ag__lx_name(c, &name, "a node name");
    if (rc)
        return rc;
    if (!strcmp(name, "output"))
        return ag__lx_err(c, start, "the name %%output is reserved for the output node");
    if (ag_graph_find(c->P->g, name)) {
        int li = find_def_line(c->P, name, 0, c->li);
        return ag__lx_err(c, start, "duplicate node name %%%s (first defined on line %d)", name,
                          c->P->line0 + li + 1);
    }
    lx_skip_ws(c);
    if (*c->p == ':') {
        c->p++;
        return placeholder_line(c, start, name);
    }
    if (*c->p == '=') {
        c->p++;
        return call_line(c, start, name);
    }
    return ag__lx_expected(c, "':' or '='");
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

static int parse_block_lines(parser *P, int li);

/* The block: its header (`graph():`, or `subgraph NAME():`), then its lines. */
static int parse_lines(parser *P) {
    int li = 0;
    for (; li < P->nlines && blank_or_comment(P->lines[li]); li++)
        ;
    cur c = {P, li < P->nlines ? li : P->nlines - 1, NULL, NULL};
    c.line = P->lines[c.li];
    c.p = li < P->nlines ? c.line : c.line + strlen(c.line);
    int rc;
    cur hc = c; /* the header, where a subgraph block's errors as a whole are placed */
    char *sub_name = NULL;
    if (P->is_sub) {
        if (!lx_accept_word(&c, "subgraph"))
            return ag__lx_expected(&c, "'subgraph NAME():'");
        lx_skip_ws(&c);
        hc = c;
        if ((rc = ag__lx_name(&c, &sub_name, "a subgraph name")))
            return rc;
        if (!lx_accept(&c, '(') || !lx_accept(&c, ')') || !lx_accept(&c, ':'))
            return ag__lx_expected(&c, "'():'");
        if (ag_graph_subgraph(P->parent, sub_name))
            return ag__lx_err(&hc, hc.p, "duplicate subgraph %s", sub_name);
    } else if (!lx_accept_word(&c, "graph") || !lx_accept(&c, '(') || !lx_accept(&c, ')') ||
               !lx_accept(&c, ':')) {
        return ag__lx_expected(&c, "'graph():'");
    }
    lx_skip_ws(&c);
    if (*c.p)
        return ag__lx_expected(&c, "end of line");
    if (sub_name && !(sub_name = ag__strdup(sub_name)))
        return AG_ENOMEM;
    rc = parse_block_lines(P, li);
    if (rc == 0 && sub_name && ag_graph_add_subgraph(P->parent, sub_name, P->g)) {
        char msg[768];
        snprintf(msg, sizeof msg, "%s", ag_last_error());
        rc = ag_last_status() == AG_ENOMEM ? AG_ENOMEM : ag__lx_err(&hc, hc.p, "%s", msg);
    }
    if (rc == 0 && sub_name)
        P->g = NULL; /* the parent owns it now */
    ag__free(sub_name);
    return rc;
}

/* The lines after the header at li. */
static int parse_block_lines(parser *P, int li) {
    cur c = {P, li, P->lines[li], P->lines[li]};
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
                return ag__lx_expected(&c, "end of input or 'constant'");
            rc = node_line(&c);
            ag__lx_pool_clear(P);
            if (rc)
                return rc;
            in_node = true;
            have_return = ag_graph_output_node(P->g) != NULL;
            continue;
        }
        if (!have_return) {
            return ag__lx_expected(&c, "an indented node line or 'return'");
        }
        while (ci < (size_t)P->nce && P->ce[ci].li < li)
            ci++;
        if (ci < (size_t)P->nce && P->ce[ci].li == li) {
            centry *e = &P->ce[ci];
            if (e->dup_of >= 0)
                return ag__lx_err(&c, s, "duplicate constant %s (first on line %d)", e->name,
                                  P->line0 + e->dup_of + 1);
            rc = e->parsed ? 0 : parse_constant(P, e);
            ag__lx_pool_clear(P);
            if (rc)
                return rc;
            continue;
        }
        if (!strncmp(s, "constant", 8) && !lx_ident_char(s[8])) {
            c.p = s + 8; /* a constant line whose name could not be read */
            lx_skip_ws(&c);
            char *name;
            if ((rc = ag__lx_name(&c, &name, "a constant name")))
                return rc;
        }
        return ag__lx_expected(&c, "end of input or 'constant'");
    }
    if ((rc = flush_trace(P)))
        return rc;
    if (!have_return) {
        c.li = P->nlines - 1;
        c.line = P->lines[c.li];
        c.p = c.line + strlen(c.line);
        return ag__lx_err(&c, c.p, "expected 'return', got %s",
                          P->block_follows ? "the next subgraph block" : "end of input");
    }
    return 0;
}

static bool is_block_header(const char *s) {
    return !strncmp(s, "subgraph", 8) && (s[8] == ' ' || s[8] == '\t');
}

static int parse_block(parser *P, int from, int to, bool is_sub, int depth);

/* Lines [from, to) of P's lines, the first a block header: each `subgraph NAME():` block (up to
 * the next header) parsed into an attribute of P->g. depth: how deep these subgraphs nest. */
static int parse_sub_blocks(parser *P, int from, int to, int depth) {
    int rc = 0;
    for (int li = from; li < to && !rc;) {
        int end = li + 1;
        while (end < to && !is_block_header(P->lines[end]))
            end++;
        rc = parse_block(P, li, end, true, depth);
        li = end;
    }
    return rc;
}

/* A subgraph block's own subgraphs (lines [from, to) of Q, the first `    subgraph NAME():`):
 * the lines less their four spaces of indentation, parsed as blocks of their own into Q->g. */
static int parse_nested(parser *Q, int from, int to, int depth) {
    if (depth > AG_SUBGRAPH_MAX_DEPTH) {
        cur c = {Q, from, Q->lines[from], Q->lines[from]};
        return ag__lx_err(&c, c.p, "subgraphs nested more than %d deep", AG_SUBGRAPH_MAX_DEPTH);
    }
    char **lines = ag__malloc(sizeof(char *) * (size_t)(to - from));
    if (!lines)
        return AG_ENOMEM;
    int rc = 0;
    for (int li = from; li < to && !rc; li++) {
        char *s = Q->lines[li];
        if (!strncmp(s, "    ", 4)) {
            lines[li - from] = s + 4;
        } else if (is_blank(s)) {
            lines[li - from] = s + strlen(s);
        } else {
            cur c = {Q, li, s, s};
            rc = ag__lx_expected(&c, "a line of a nested subgraph block (indented four spaces "
                                     "more than its parent's)");
        }
    }
    parser R = {.buf = Q->buf,
                .lines = lines,
                .nlines = to - from,
                .line0 = Q->line0 + from,
                .col0 = Q->col0 + 4,
                .g = Q->g};
    if (!rc)
        rc = parse_sub_blocks(&R, 0, R.nlines, depth);
    ag__free(lines);
    return rc;
}

/* Parses lines [from, to) of P's lines as one block: the graph P->g, or (is_sub) a subgraph
 * that becomes an attribute of P->g, its own subgraphs (blocks indented four more spaces after
 * its lines) parsed first. depth: how deep the block's subgraph nests (1 for the graph's). */
static int parse_block(parser *P, int from, int to, bool is_sub, int depth) {
    int own_end = to;
    for (int li = from + 1; is_sub && li < to && own_end == to; li++)
        if (!strncmp(P->lines[li], "    ", 4) && is_block_header(P->lines[li] + 4))
            own_end = li;
    parser Q = {.buf = P->buf,
                .lines = P->lines + from,
                .nlines = own_end - from,
                .line0 = P->line0 + from,
                .col0 = P->col0,
                .is_sub = is_sub,
                .parent = P->g,
                .block_follows = own_end < to || to < P->nlines};
    Q.g = is_sub ? ag_graph_new() : P->g;
    int rc = Q.g ? 0 : AG_ENOMEM;
    if (!rc && own_end < to) {
        Q.nlines = to - from; /* the nested blocks' lines, relative to Q's */
        rc = parse_nested(&Q, own_end - from, to - from, depth + 1);
        Q.nlines = own_end - from;
    }
    if (!rc)
        rc = index_constants(&Q);
    if (!rc)
        rc = parse_lines(&Q);
    ag__lx_pool_clear(&Q);
    ag__free(Q.pool);
    ag__free(Q.ints);
    ag__free(Q.ptrs);
    ag__free(Q.bytes);
    ag__sb_free(&Q.trace);
    for (int64_t i = 0; i < Q.nce; i++) {
        ag__free(Q.ce[i].name);
        ag_tensor_free(Q.ce[i].t);
    }
    ag__free(Q.ce);
    ag__strmap_free(&Q.consts);
    if (is_sub)
        ag_graph_free(Q.g); /* NULL once the parent took it */
    return rc;
}

ag_graph *ag_graph_parse(const char *text, size_t len) {
    AG__CHECK_NULL_RET("graph_parse", text, NULL);
    /* Bounds first, over the caller's text before anything is allocated, so that a huge or
     * binary input (a device's endless bytes read into a buffer) is refused at its first bad
     * byte: the size, NUL bytes, the number of lines (the line table costs 8 bytes a line). */
    if (len > AG_GRAPH_TEXT_MAX)
        return ag__err(AG_EFORMAT,
                       "graph_parse: the text is %zu bytes; a graph text may have at most %zu", len,
                       (size_t)AG_GRAPH_TEXT_MAX),
               NULL;
    int64_t nl = 1;
    size_t ls = 0; /* start of line nl */
    for (size_t i = 0; i < len; i++) {
        if (text[i] == '\n') {
            if (nl == AG_GRAPH_TEXT_MAX_LINES && i + 1 < len)
                return ag__err(AG_EFORMAT, "line %lld:1: more than %d lines", (long long)nl + 1,
                               AG_GRAPH_TEXT_MAX_LINES),
                       NULL;
            nl++;
            ls = i + 1;
        } else if (!text[i]) {
            return ag__err(AG_EFORMAT, "line %lld:%zu: unexpected NUL byte", (long long)nl,
                           i - ls + 1),
                   NULL;
        }
    }
    parser P = {0};
    int rc = 0;
    /* The text as lines, each NUL-terminated ("\r\n" ends a line as "\n" does). */
    P.buf = ag__malloc(len + 1);
    if (!P.buf)
        return NULL;
    if (len)
        memcpy(P.buf, text, len);
    P.buf[len] = 0;
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

    /* Blocks: the graph's lines, then each `subgraph NAME():` line (at the start of a line, after
     * the first) opens a subgraph's. The subgraphs are parsed first, so that the graph's
     * get_attr lines find them. */
    P.g = ag_graph_new();
    if (!P.g)
        rc = AG_ENOMEM;
    int main_end = P.nlines;
    for (int li = 1; li < P.nlines && main_end == P.nlines; li++)
        if (is_block_header(P.lines[li]))
            main_end = li;
    if (!rc)
        rc = parse_sub_blocks(&P, main_end, P.nlines, 1);
    if (!rc)
        rc = parse_block(&P, 0, main_end, false, 0);
    ag__free(P.lines);
    ag__free(P.buf);
    if (rc) {
        ag_graph_free(P.g);
        return NULL;
    }
    return P.g;
}
