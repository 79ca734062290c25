/* The graph printer: a graph in, its text (docs/GRAPH_FORMAT.md) out.
 *
 * The text is canonical: one spelling per graph, so that print(parse(print(g))) == print(g).
 * Everything goes into one growing buffer (amortised O(1) appends), so printing is linear in
 * the output: a GPT-2 joint graph of ~10k nodes prints in milliseconds. The helpers it shares with
 * the parser, the DOT writer and the module stacks (buffer, VALs, quoted strings,
 * round-tripping floats) are in text_internal.c.
 *
 * Metadata that has no dedicated spelling is still printed, as a generic `key=VALUE` item, so
 * nothing a graph carries is lost in a round trip; a well-known key holding a value of the
 * wrong kind (say seq_nr set to a string through ag_node_meta_set) prints generically too. A
 * stack trace that continuation lines cannot carry exactly (an empty or blank line, a '\r')
 * prints as a quoted `stack_trace='...'` item instead. Subgraphs print after the graph, one
 * `subgraph NAME():` block each. */
#include "text_internal.h"
#include "../core/pystr.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

static const char *const torch_dtypes[AG_NDTYPES] = {"torch.float32", "torch.float64",
                                                     "torch.int64", "torch.bool", "torch.int8"};

static void put_node_ref(ag__sbuf *b, const ag_node *n) {
    if (!n) {
        ag__sb_puts(b, "None");
        return;
    }
    ag__sb_putc(b, '%');
    ag__sb_name(b, n->name);
}

static void put_mval(ag__sbuf *b, ag_mval v);
static void put_garg(ag__sbuf *b, const ag_garg *a);

/* A tuple as Python prints one: `(1, %a)`, `(%a,)`, `()`; a dict `{'KEY': False, ...}`. */
static void put_aggregate(ag__sbuf *b, const ag_garg *a) {
    bool tuple = a->kind == AG_GA_TUPLE;
    ag__sb_putc(b, tuple ? '(' : '{');
    for (int k = 0; k < a->n; k++) {
        if (k)
            ag__sb_puts(b, ", ");
        if (tuple) {
            put_garg(b, &a->u.elems[k]);
        } else {
            const char *key = a->u.items[k].key ? a->u.items[k].key : "";
            ag__sb_pystr(b, key, strlen(key));
            ag__sb_puts(b, ": ");
            put_mval(b, a->u.items[k].v);
        }
    }
    ag__sb_puts(b, tuple && a->n == 1 ? ",)" : tuple ? ")" : "}");
}

static void put_garg(ag__sbuf *b, const ag_garg *a) {
    switch (a->kind) {
    case AG_GA_TUPLE:
    case AG_GA_DICT:
        put_aggregate(b, a);
        break;
    case AG_GA_NONE:
        ag__sb_puts(b, "None");
        break;
    case AG_GA_NODE:
        put_node_ref(b, a->u.node);
        break;
    case AG_GA_NODES:
        ag__sb_putc(b, '[');
        for (int k = 0; k < a->n; k++) {
            if (k)
                ag__sb_puts(b, ", ");
            put_node_ref(b, a->u.nodes[k]);
        }
        ag__sb_putc(b, ']');
        break;
    case AG_GA_INT:
        ag__sb_printf(b, "%lld", (long long)a->u.i);
        break;
    case AG_GA_FLOAT:
        ag__sb_double(b, a->u.f);
        break;
    case AG_GA_BOOL:
        ag__sb_puts(b, a->u.b ? "True" : "False");
        break;
    case AG_GA_INTS:
        ag__sb_putc(b, '[');
        for (int k = 0; k < a->n; k++)
            ag__sb_printf(b, k ? ", %lld" : "%lld", (long long)a->u.ints[k]);
        ag__sb_putc(b, ']');
        break;
    case AG_GA_DTYPE:
        ag__sb_puts(b, (unsigned)a->u.dt < AG_NDTYPES ? torch_dtypes[a->u.dt] : "None");
        break;
    case AG_GA_STR:
        ag__sb_pystr(b, a->u.s ? a->u.s : "", a->u.s ? strlen(a->u.s) : 0);
        break;
    }
}

static void put_mval(ag__sbuf *b, ag_mval v) {
    switch (v.kind) {
    case AG_MV_NONE:
        ag__sb_puts(b, "None");
        break;
    case AG_MV_INT:
        ag__sb_printf(b, "%lld", (long long)v.u.i);
        break;
    case AG_MV_FLOAT:
        ag__sb_double(b, v.u.f);
        break;
    case AG_MV_BOOL:
        ag__sb_puts(b, v.u.b ? "True" : "False");
        break;
    case AG_MV_STR:
        ag__sb_pystr(b, v.u.s ? v.u.s : "", v.u.s ? strlen(v.u.s) : 0);
        break;
    }
}

static bool valid_tag(ag_mval v) {
    return v.kind == AG_MV_STR &&
           (!strcmp(v.u.s, "is_forward") || !strcmp(v.u.s, "is_backward") ||
            !strcmp(v.u.s, "must_be_in_forward") || !strcmp(v.u.s, "must_be_in_backward"));
}

static bool valid_recompute(ag_mval v) {
    if (v.kind != AG_MV_STR)
        return false;
    for (int r = AG_MUST_SAVE; r <= AG_PREFER_RECOMPUTE; r++)
        if (!strcmp(v.u.s, ag__recompute_name((ag_recompute)r)))
            return true;
    return false;
}

/* Whether continuation lines carry the trace exactly: no line blank (spaces and tabs only),
 * no '\r'. */
static bool trace_as_lines(const char *t) {
    if (!*t)
        return false;
    for (const char *line = t;;) {
        const char *end = strchr(line, '\n');
        if (!end)
            end = line + strlen(line);
        bool blank = true;
        for (const char *c = line; c < end; c++) {
            if (*c == '\r')
                return false;
            if (*c != ' ' && *c != '\t')
                blank = false;
        }
        if (blank)
            return false;
        if (!*end)
            return true;
        line = end + 1;
    }
}

/* True when key (with value v) prints in a dedicated spelling or not at all, rather than as a
 * generic key=VALUE item. */
static bool well_known(const char *key, ag_mval v) {
    if (!strcmp(key, "seq_nr"))
        return v.kind == AG_MV_INT;
    if (!strcmp(key, "partitioner_tag"))
        return valid_tag(v);
    if (!strcmp(key, "is_gradient_acc"))
        return v.kind == AG_MV_BOOL && v.u.b;
    if (!strcmp(key, "recompute"))
        return valid_recompute(v);
    if (!strcmp(key, "stack_trace"))
        return v.kind == AG_MV_STR;
    if (!strcmp(key, "nn_module_stack") || !strcmp(key, "fwd_nn_module_stack"))
        return true; /* a stack's text (ag_node_meta_set stores nothing else there) */
    return false;
}

/* The metadata items of a node, each preceded by two spaces; returns how many. */
static int put_items(ag__sbuf *b, const ag_node *n, const ag_print_opts *o) {
    int cnt = 0;
    if (!o->no_custom && n->ncustom > 0) {
        ag__sb_puts(b, "  {");
        for (int i = 0; i < n->ncustom; i++) {
            if (i)
                ag__sb_puts(b, ", ");
            ag__sb_pystr(b, n->custom[i].key, strlen(n->custom[i].key));
            ag__sb_puts(b, ": ");
            put_mval(b, n->custom[i].v);
        }
        ag__sb_putc(b, '}');
        cnt++;
    }
    ag_mval seq = ag_node_meta_get(n, "seq_nr");
    if (o->seq_nr && seq.kind == AG_MV_INT) {
        ag__sb_printf(b, "  seq_nr=%lld", (long long)seq.u.i);
        cnt++;
    }
    if (!o->no_meta) {
        ag_mval tag = ag_node_meta_get(n, "partitioner_tag");
        if (valid_tag(tag)) {
            ag__sb_puts(b, "  ");
            ag__sb_puts(b, tag.u.s);
            cnt++;
        }
        ag_mval ga = ag_node_meta_get(n, "is_gradient_acc");
        if (ga.kind == AG_MV_BOOL && ga.u.b) {
            ag__sb_puts(b, "  gradient_acc");
            cnt++;
        }
        ag_mval rc = ag_node_meta_get(n, "recompute");
        if (valid_recompute(rc)) {
            ag__sb_puts(b, "  recompute=");
            ag__sb_puts(b, rc.u.s);
            cnt++;
        }
    }
    if (o->module_stack) {
        static const char *const keys[] = {"nn_module_stack", "fwd_nn_module_stack"};
        for (int k = 0; k < 2; k++) {
            ag_mval ms = ag_node_meta_get(n, keys[k]);
            if (ms.kind != AG_MV_STR)
                continue;
            ag__sb_printf(b, "  %s=", keys[k]);
            ag__sb_puts(b, ms.u.s); /* already in the printed spelling */
            cnt++;
        }
    }
    if (!o->no_meta) {
        for (int i = 0; i < n->nmeta; i++) {
            if (well_known(n->meta[i].key, n->meta[i].v))
                continue;
            ag__sb_puts(b, "  ");
            ag__sb_name(b, n->meta[i].key);
            ag__sb_putc(b, '=');
            put_mval(b, n->meta[i].v);
            cnt++;
        }
    }
    const char *st = ag_node_stack_trace(n);
    if (o->stack_trace && st && !trace_as_lines(st)) {
        ag__sb_puts(b, "  stack_trace=");
        ag__sb_pystr(b, st, strlen(st));
        cnt++;
    }
    return cnt;
}

static void put_vals(ag__sbuf *b, const ag_node *n) {
    bool tuple = n->nvals != 1 || (n->kind == AG_NODE_CALL && ag_op_noutputs(n->op) != 1);
    if (!tuple) {
        ag__sb_val(b, &n->vals[0]);
        return;
    }
    if (n->kind == AG_NODE_PLACEHOLDER && n->nvals == 0) {
        ag__sb_puts(b, "None");
        return;
    }
    ag__sb_putc(b, '(');
    for (int i = 0; i < n->nvals; i++) {
        if (i)
            ag__sb_puts(b, ", ");
        ag__sb_val(b, &n->vals[i]);
    }
    if (n->nvals == 1)
        ag__sb_putc(b, ',');
    ag__sb_putc(b, ')');
}

static void put_call(ag__sbuf *b, const ag_node *n) {
    ag__sb_puts(b, ag_op_name(n->op));
    ag__sb_putc(b, '(');
    if (n->op == ag_op_invoke_subgraph() && n->nargs == 3 && n->args[2].kind == AG_GA_NODES) {
        /* invoke_subgraph: the operands as trailing arguments, as upstream prints them */
        put_garg(b, &n->args[0]);
        ag__sb_puts(b, ", ");
        put_garg(b, &n->args[1]);
        for (int k = 0; k < n->args[2].n; k++) {
            ag__sb_puts(b, ", ");
            if (n->args[2].u.nodes[k])
                put_node_ref(b, n->args[2].u.nodes[k]);
            else
                ag__sb_puts(b, "None");
        }
        ag__sb_putc(b, ')');
        return;
    }
    for (int i = 0; i < n->nargs; i++) {
        if (i)
            ag__sb_puts(b, ", ");
        const ag_schema_arg *sa = ag_op_arg(n->op, i);
        if (sa && sa->kwarg_only) {
            ag__sb_puts(b, sa->name);
            ag__sb_putc(b, '=');
        }
        put_garg(b, &n->args[i]);
    }
    ag__sb_putc(b, ')');
}

static void put_node(ag__sbuf *b, const ag_node *n, const ag_print_opts *o) {
    ag__sb_puts(b, "    ");
    switch (n->kind) {
    case AG_NODE_PLACEHOLDER:
        put_node_ref(b, n);
        ag__sb_puts(b, " : ");
        put_vals(b, n);
        ag__sb_puts(b, "  # ");
        ag__sb_desc(b, n->desc);
        put_items(b, n, o);
        break;
    case AG_NODE_OUTPUT: {
        ag__sb_puts(b, "return (");
        const ag_garg *a = n->nargs ? &n->args[0] : NULL;
        int cnt = a && a->kind == AG_GA_NODES ? a->n : 0;
        for (int i = 0; i < cnt; i++) {
            if (i)
                ag__sb_puts(b, ", ");
            put_node_ref(b, a->u.nodes[i]);
        }
        if (cnt == 1)
            ag__sb_putc(b, ',');
        ag__sb_putc(b, ')');
        size_t mark = b->len;
        ag__sb_puts(b, "  # ");
        if (n->has_out_descs) {
            ag__sb_putc(b, '[');
            for (int i = 0; i < n->nout_descs; i++) {
                if (i)
                    ag__sb_puts(b, ", ");
                ag__sb_desc(b, n->out_descs[i]);
            }
            ag__sb_putc(b, ']');
            put_items(b, n, o);
        } else {
            ag__sb_puts(b, "None");
            if (put_items(b, n, o) == 0 && !b->oom)
                b->len = mark; /* nothing to say: no comment at all */
        }
        break;
    }
    default:
        put_node_ref(b, n);
        ag__sb_puts(b, " = ");
        if (n->kind == AG_NODE_CALL) {
            put_call(b, n);
        } else if (n->kind == AG_NODE_GETITEM) {
            ag__sb_puts(b, "getitem(");
            put_node_ref(b, n->args[0].u.node);
            ag__sb_printf(b, ", %lld)", (long long)n->args[1].u.i);
        } else {
            ag__sb_puts(b, "get_attr(");
            int k = n->sub ? ag__subgraph_index(n->graph, n->sub) : -1;
            ag__sb_name(b, k >= 0 ? n->graph->subs[k].name : n->name);
            ag__sb_putc(b, ')');
        }
        ag__sb_puts(b, "  # ");
        if (n->sub)
            ag__sb_puts(b, "subgraph");
        else
            put_vals(b, n);
        put_items(b, n, o);
        break;
    }
    ag__sb_putc(b, '\n');
    const char *st = ag_node_stack_trace(n);
    if (o->stack_trace && st && trace_as_lines(st)) {
        for (const char *line = st;;) {
            const char *end = strchr(line, '\n');
            size_t len = end ? (size_t)(end - line) : strlen(line);
            ag__sb_puts(b, "        ");
            ag__sb_putn(b, line, len);
            ag__sb_putc(b, '\n');
            if (!end)
                break;
            line = end + 1;
        }
    }
}

/* One element of a constant, read at element offset `off` from its first element. */
static void put_elem(ag__sbuf *b, ag_dtype dt, const char *base, int64_t off) {
    switch (dt) {
    case AG_F32: {
        float v;
        memcpy(&v, base + off * 4, 4);
        ag__sb_float(b, v);
        break;
    }
    case AG_F64: {
        double v;
        memcpy(&v, base + off * 8, 8);
        ag__sb_double(b, v);
        break;
    }
    case AG_I64: {
        int64_t v;
        memcpy(&v, base + off * 8, 8);
        ag__sb_printf(b, "%lld", (long long)v);
        break;
    }
    case AG_I8:
        ag__sb_printf(b, "%d", (int)(int8_t)base[off]);
        break;
    default:
        ag__sb_puts(b, base[off] ? "True" : "False");
        break;
    }
}

/* `constant NAME : VAL = [v0, v1, ...]`, values row-major over the (possibly strided) view;
 * `= meta` for a tensor without data. */
static void put_constant(ag__sbuf *b, const ag_node *n) {
    const ag_tensor *t = n->constant;
    ag_tmeta m;
    ag__tmeta_of(t, &m);
    ag__sb_puts(b, "constant ");
    ag__sb_name(b, n->name);
    ag__sb_puts(b, " : ");
    ag__sb_val(b, &m);
    const char *base = ag_tensor_data(t);
    if (!base) {
        ag__sb_puts(b, " = meta\n");
        return;
    }
    ag__sb_puts(b, " = [");
    int64_t numel = ag__numel(m.ndim, m.sizes);
    int64_t idx[AG_MAX_DIMS] = {0}, off = 0;
    for (int64_t e = 0; e < numel; e++) {
        if (e)
            ag__sb_puts(b, ", ");
        put_elem(b, m.dtype, base, off);
        /* Advance the row-major index, keeping the element offset in step. */
        for (int d = m.ndim - 1; d >= 0; d--) {
            if (++idx[d] < m.sizes[d]) {
                off += m.strides[d];
                break;
            }
            off -= m.strides[d] * (idx[d] - 1);
            idx[d] = 0;
        }
    }
    ag__sb_puts(b, "]\n");
}

/* The node lines, then the constant lines. */
static void put_body(ag__sbuf *b, const ag_graph *g, const ag_print_opts *o) {
    bool consts = false;
    for (const ag_node *n = g->first; n; n = n->next) {
        put_node(b, n, o);
        consts |= n->kind == AG_NODE_GET_ATTR && n->constant;
    }
    if (consts) {
        ag__sb_putc(b, '\n');
        for (const ag_node *n = g->first; n; n = n->next)
            if (n->kind == AG_NODE_GET_ATTR && n->constant)
                put_constant(b, n);
    }
}

/* Each subgraph of g after g's lines (as print_readable prints submodules after forward): a
 * `subgraph NAME():` block, then its own subgraphs' blocks, each level indented four spaces more
 * than its parent's (a nested submodule's class). */
static void put_subgraphs(ag__sbuf *b, const ag_graph *g, const ag_print_opts *o, int depth) {
    for (int i = 0; i < g->nsubs; i++) {
        ag__sbuf t = {0}, *d = depth ? &t : b; /* a nested block: written, then indented */
        ag__sb_puts(b, "\n");
        ag__sb_puts(d, "subgraph ");
        ag__sb_name(d, g->subs[i].name);
        ag__sb_puts(d, "():\n");
        put_body(d, g->subs[i].g, o);
        if (depth) {
            if (t.oom)
                b->oom = true;
            for (size_t k = 0; k < t.len && !t.oom;) { /* each non-empty line indented */
                const char *nl = memchr(t.p + k, '\n', t.len - k);
                size_t e = nl ? (size_t)(nl - t.p) + 1 : t.len;
                if (t.p[k] != '\n')
                    for (int s = 0; s < depth; s++)
                        ag__sb_puts(b, "    ");
                ag__sb_putn(b, t.p + k, e - k);
                k = e;
            }
            ag__sb_free(&t);
        }
        put_subgraphs(b, g->subs[i].g, o, depth + 1);
    }
}

char *ag_graph_to_string(const ag_graph *g, const ag_print_opts *opts) {
    AG__CHECK_NULL_RET("graph_to_string", g, NULL);
    static const ag_print_opts defaults = {0};
    const ag_print_opts *o = opts ? opts : &defaults;
    ag__sbuf b = {0};
    /* ~100 bytes a node: one allocation for most graphs. */
    ag__sb_reserve(&b, (size_t)g->count * 112 + 64);
    ag__sb_puts(&b, "graph():\n");
    put_body(&b, g, o);
    put_subgraphs(&b, g, o, 0);
    return ag__sb_finish(&b);
}

int ag_graph_print(const ag_graph *g, FILE *f, const ag_print_opts *opts) {
    AG__CHECK_NULL("graph_print", g);
    AG__CHECK_NULL("graph_print", f);
    char *s = ag_graph_to_string(g, opts);
    if (!s)
        return AG_ENOMEM;
    size_t n = strlen(s);
    size_t w = fwrite(s, 1, n, f);
    ag_free(s);
    if (w != n)
        return ag__err(AG_EIO, "graph_print: write failed");
    return 0;
}
