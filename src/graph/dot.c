/* Pictures of graphs: a graph in, Graphviz DOT text (or an SVG file drawn by Graphviz's `dot`
 * program) out.
 *
 * One DOT node per graph node and one edge from each argument node to its user. Placeholders
 * are ellipses labelled by their descriptor ("Param linear.weight", "Tangent (Plain 0)",
 * "Plain 0"), calls are records (name | op | val), the output node is a box listing its
 * descriptors. Forward nodes (partitioner tag is_forward / must_be_in_forward, or none) and
 * backward nodes (is_backward / must_be_in_backward) are filled with two colours, explained by
 * a legend; nodes named in ag_dot_opts.highlight get a thick red border. Labels are escaped
 * for records (quotes, backslashes, < > { } |) whatever the shape, so any node name is safe.
 * Each subgraph is a cluster of its own nodes, with a dashed edge from each get_attr of it; a
 * subgraph's subgraphs (a region in a region) are clusters inside its cluster.
 *
 * ag_graph_write_svg runs `dot -Tsvg -o PATH` with posix_spawnp (no shell: the path is passed
 * as one argument) and feeds it the DOT on a pipe. */
#define _GNU_SOURCE /* pipe2 */
#include "text_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

#define FW_COLOR "#cfe2ff"
#define BW_COLOR "#ffd8a8"
#define OUT_COLOR "#e9ecef"
#define HL_COLOR "#d00000"

/* Appends s escaped for a DOT record label inside double quotes. */
static void put_esc(ag__sbuf *b, const char *s) {
    for (; *s; s++) {
        switch (*s) {
        case '"':
        case '\\':
        case '{':
        case '}':
        case '|':
        case '<':
        case '>':
            ag__sb_putc(b, '\\');
            ag__sb_putc(b, *s);
            break;
        case '\n':
            ag__sb_puts(b, "\\n");
            break;
        case '\r':
            break;
        default:
            ag__sb_putc(b, *s);
        }
    }
}

/* Escapes the last `from..len` bytes of b in place (they were written unescaped). */
static void esc_tail(ag__sbuf *b, size_t from) {
    if (b->oom)
        return;
    size_t n = b->len - from;
    char *tmp = ag__malloc(n + 1);
    if (!tmp) {
        b->oom = true;
        return;
    }
    memcpy(tmp, b->p + from, n);
    tmp[n] = 0;
    b->len = from;
    put_esc(b, tmp);
    ag__free(tmp);
}

/* "Param linear.weight", "Plain 0", "Tangent (Plain 0)", "Grad (Param fc.weight)". */
static void put_desc_label(ag__sbuf *b, const ag_desc *d) {
    if (!d) {
        ag__sb_puts(b, "None");
        return;
    }
    ag_desc_kind k = ag_desc_kind_of(d);
    const char *name = ag_desc_kind_name(k);
    size_t n = strlen(name);
    const char *suffix = strstr(name, "AOTInput")    ? "AOTInput"
                         : strstr(name, "AOTOutput") ? "AOTOutput"
                                                     : "";
    size_t sn = strlen(suffix);
    if (sn && n > sn && !strcmp(name + n - sn, suffix))
        n -= sn;
    ag__sb_putn(b, name, n);
    unsigned f = ag_desc_kind_fields(k);
    if (f & AG_DESC_HAS_STR) {
        const char *s = ag_desc_target(d) ? ag_desc_target(d) : ag_desc_attr(d);
        ag__sb_putc(b, ' ');
        ag__sb_puts(b, s ? s : "");
    }
    if (f & AG_DESC_HAS_IDX)
        ag__sb_printf(b, " %lld", (long long)ag_desc_idx(d));
    if (f & AG_DESC_HAS_NESTED) {
        ag__sb_puts(b, " (");
        put_desc_label(b, ag_desc_nested(d));
        ag__sb_putc(b, ')');
    }
}

static bool is_backward(const ag_node *n) {
    const char *t = ag_node_partitioner_tag(n);
    return t && (!strcmp(t, "is_backward") || !strcmp(t, "must_be_in_backward"));
}

static void put_vals_esc(ag__sbuf *b, const ag_node *n) {
    size_t from = b->len;
    if (n->nvals == 0) {
        ag__sb_puts(b, "None");
    } else if (n->nvals == 1) {
        ag__sb_val(b, &n->vals[0]);
    } else {
        ag__sb_putc(b, '(');
        for (int i = 0; i < n->nvals; i++) {
            if (i)
                ag__sb_puts(b, ", ");
            ag__sb_val(b, &n->vals[i]);
        }
        ag__sb_putc(b, ')');
    }
    esc_tail(b, from);
}

/* DOT ids: the graph's nodes are n<index>, subgraph k's s<k>n<index>, its subgraph j's
 * s<k>s<j>n<index>. */
static void put_node_decl(ag__sbuf *b, const char *pfx, const ag_node *n, int id, bool hl) {
    ag__sb_printf(b, "  %sn%d [", pfx, id);
    switch (n->kind) {
    case AG_NODE_PLACEHOLDER:
        ag__sb_puts(b, "shape=ellipse, label=\"");
        if (n->desc) {
            size_t from = b->len;
            put_desc_label(b, n->desc);
            esc_tail(b, from);
            ag__sb_puts(b, "\\n");
        }
        ag__sb_putc(b, '%');
        put_esc(b, n->name);
        ag__sb_puts(b, "\\n");
        put_vals_esc(b, n);
        ag__sb_putc(b, '"');
        break;
    case AG_NODE_OUTPUT: {
        ag__sb_puts(b, "shape=box, label=\"output");
        const ag_garg *a = n->nargs ? &n->args[0] : NULL;
        int cnt = a && a->kind == AG_GA_NODES ? a->n : 0;
        for (int i = 0; i < cnt; i++) {
            ag__sb_printf(b, "\\n%d: ", i);
            size_t from = b->len;
            if (n->has_out_descs) {
                put_desc_label(b, ag_node_output_desc(n, i));
            } else if (a->u.nodes[i]) {
                ag__sb_putc(b, '%');
                ag__sb_puts(b, a->u.nodes[i]->name);
            } else {
                ag__sb_puts(b, "None");
            }
            esc_tail(b, from);
        }
        ag__sb_putc(b, '"');
        break;
    }
    default:
        ag__sb_puts(b, "shape=record, label=\"{%");
        put_esc(b, n->name);
        ag__sb_putc(b, '|');
        if (n->kind == AG_NODE_CALL) {
            put_esc(b, ag_op_name(n->op));
            if (ag_op_with_effects_target(n->op)) { /* the effect it runs */
                ag__sb_putc(b, ' ');
                put_esc(b, ag_op_name(ag_op_with_effects_target(n->op)));
            }
        } else if (n->kind == AG_NODE_GETITEM)
            ag__sb_printf(b, "getitem %lld", (long long)n->args[1].u.i);
        else
            ag__sb_puts(b, "get_attr");
        ag__sb_putc(b, '|');
        int k = n->sub ? ag__subgraph_index(n->graph, n->sub) : -1;
        if (k >= 0) {
            ag__sb_puts(b, "subgraph ");
            put_esc(b, n->graph->subs[k].name);
        } else {
            put_vals_esc(b, n);
        }
        ag__sb_puts(b, "}\"");
        break;
    }
    if (n->kind == AG_NODE_OUTPUT)
        ag__sb_puts(b, ", style=filled, fillcolor=\"" OUT_COLOR "\"");
    else
        ag__sb_printf(b, ", style=filled, fillcolor=\"%s\"", is_backward(n) ? BW_COLOR : FW_COLOR);
    if (hl)
        ag__sb_puts(b, ", penwidth=3, color=\"" HL_COLOR "\"");
    ag__sb_puts(b, "];\n");
}

/* One edge per distinct argument node of n. */
static void put_edges(ag__sbuf *b, const char *pfx, const ag_node *n) {
    const ag_node *seen[64];
    int nseen = 0;
    for (int i = 0; i < n->nargs; i++) {
        const ag_garg *a = &n->args[i];
        int cnt = ag__garg_nrefs(a);
        for (int k = 0; k < cnt; k++) {
            const ag_node *src = ag__garg_ref(a, k);
            if (!src)
                continue;
            bool dup = false;
            for (int j = 0; j < nseen && !dup; j++)
                dup = seen[j] == src;
            if (dup)
                continue;
            if (nseen < 64)
                seen[nseen++] = src;
            ag__sb_printf(b, "  %sn%d -> %sn%d;\n", pfx, ag_node_index(src), pfx, ag_node_index(n));
        }
    }
}

/* A cluster per subgraph of g (whose nodes' ids start with pfx), and a dashed edge from each
 * get_attr of it to the cluster; a subgraph's own subgraphs are clusters inside its cluster
 * (ids s<k> appended per level). */
static void put_subgraphs(ag__sbuf *b, const ag_graph *g, const char *pfx) {
    if (g->nsubs && !pfx[0])
        ag__sb_puts(b, "  compound=true;\n");
    for (int k = 0; k < g->nsubs; k++) {
        const ag_graph *s = g->subs[k].g;
        char sp[160];
        snprintf(sp, sizeof sp, "%ss%d", pfx, k);
        ag__sb_printf(b, "  subgraph cluster_%s {\n  label=\"subgraph ", sp);
        put_esc(b, g->subs[k].name);
        ag__sb_puts(b, "\";\n  style=rounded;\n  fontsize=10;\n");
        for (const ag_node *n = s->first; n; n = n->next)
            put_node_decl(b, sp, n, ag_node_index(n), false);
        for (const ag_node *n = s->first; n; n = n->next)
            put_edges(b, sp, n);
        put_subgraphs(b, s, sp);
        ag__sb_puts(b, "  }\n");
        for (const ag_node *n = g->first; n && s->first; n = n->next)
            if (n->sub == s)
                ag__sb_printf(b, "  %sn%d -> %sn0 [style=dashed, lhead=cluster_%s];\n", pfx,
                              ag_node_index(n), sp, sp);
    }
}

char *ag_graph_to_dot(const ag_graph *g, const ag_dot_opts *opts) {
    AG__CHECK_NULL_RET("graph_to_dot", g, NULL);
    static const ag_dot_opts defaults = {0};
    const ag_dot_opts *o = opts ? opts : &defaults;
    int count = (int)g->count;
    bool *hl = ag__calloc((size_t)(count ? count : 1), 1);
    if (!hl)
        return NULL;
    bool any_hl = false;
    for (int i = 0; i < o->nhighlight; i++) {
        ag_node *n = o->highlight && o->highlight[i] ? ag_graph_find(g, o->highlight[i]) : NULL;
        if (n) {
            hl[ag_node_index(n)] = true;
            any_hl = true;
        }
    }
    ag__sbuf b = {0};
    ag__sb_reserve(&b, (size_t)count * 160 + 512);
    ag__sb_puts(&b, "digraph G {\n");
    if (o->title) {
        ag__sb_puts(&b, "  label=\"");
        put_esc(&b, o->title);
        ag__sb_puts(&b, "\";\n  labelloc=t;\n");
    }
    ag__sb_puts(&b, "  rankdir=TB;\n  node [fontname=\"Helvetica\", fontsize=10];\n"
                    "  edge [arrowsize=0.6];\n");
    for (const ag_node *n = g->first; n; n = n->next)
        put_node_decl(&b, "", n, ag_node_index(n), hl[ag_node_index(n)]);
    for (const ag_node *n = g->first; n; n = n->next)
        put_edges(&b, "", n);
    put_subgraphs(&b, g, "");
    ag__sb_puts(&b, "  subgraph cluster_legend {\n    label=\"legend\";\n    style=dashed;\n"
                    "    fontsize=10;\n"
                    "    legend_forward [shape=box, style=filled, fillcolor=\"" FW_COLOR
                    "\", label=\"forward\"];\n"
                    "    legend_backward [shape=box, style=filled, fillcolor=\"" BW_COLOR
                    "\", label=\"backward\"];\n");
    if (any_hl)
        ag__sb_puts(&b, "    legend_saved [shape=box, penwidth=3, color=\"" HL_COLOR
                        "\", label=\"saved\"];\n");
    ag__sb_puts(&b, "  }\n}\n");
    ag__free(hl);
    return ag__sb_finish(&b);
}

/* ---- SVG through Graphviz ---- */

/* Writes dot text to `fd` while draining the child's stderr into errbuf, so that neither side
 * can block the other. Returns 0, or an errno. */
static int pump(int fd, const char *s, size_t n, int errfd, char *errbuf, size_t errcap) {
    size_t off = 0, elen = 0;
    bool in_open = true, err_open = true;
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    if (n == 0) {
        close(fd);
        in_open = false;
    }
    int rc = 0;
    while (in_open || err_open) {
        struct pollfd p[2];
        int np = 0, ii = -1, ei = -1;
        if (in_open)
            p[ii = np++] = (struct pollfd){.fd = fd, .events = POLLOUT};
        if (err_open)
            p[ei = np++] = (struct pollfd){.fd = errfd, .events = POLLIN};
        if (poll(p, (nfds_t)np, -1) < 0) {
            if (errno == EINTR)
                continue;
            rc = errno;
            break;
        }
        if (ii >= 0 && p[ii].revents) {
            ssize_t w = write(fd, s + off, n - off);
            if (w > 0)
                off += (size_t)w;
            else if (w < 0 && errno != EAGAIN && errno != EINTR) {
                rc = errno == EPIPE ? 0 : errno; /* dot quit early: its status tells why */
                close(fd);
                in_open = false;
            }
            if (in_open && off == n) {
                close(fd);
                in_open = false;
            }
        }
        if (ei >= 0 && p[ei].revents) {
            char tmp[512];
            ssize_t r = read(errfd, tmp, sizeof tmp);
            if (r > 0) {
                size_t k = (size_t)r < errcap - 1 - elen ? (size_t)r : errcap - 1 - elen;
                memcpy(errbuf + elen, tmp, k);
                elen += k;
            } else if (r == 0 || (errno != EAGAIN && errno != EINTR)) {
                err_open = false;
            }
        }
    }
    if (in_open)
        close(fd);
    errbuf[elen] = 0;
    return rc;
}

int ag_graph_write_svg(const ag_graph *g, const char *path, const ag_dot_opts *opts) {
    AG__CHECK_NULL("graph_write_svg", g);
    AG__CHECK_NULL("graph_write_svg", path);
    if (!*path)
        return ag__err(AG_EINVAL, "graph_write_svg: no output path");
    char *dot = ag_graph_to_dot(g, opts);
    if (!dot)
        return AG_ENOMEM;
    int in[2], er[2];
    if (pipe2(in, O_CLOEXEC)) {
        ag_free(dot);
        return ag__err(AG_EIO, "write_svg: pipe: %s", strerror(errno));
    }
    if (pipe2(er, O_CLOEXEC)) {
        close(in[0]);
        close(in[1]);
        ag_free(dot);
        return ag__err(AG_EIO, "write_svg: pipe: %s", strerror(errno));
    }
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, in[0], 0);
    posix_spawn_file_actions_adddup2(&fa, er[1], 2);
    char *argv[] = {"dot", "-Tsvg", "-o", (char *)path, NULL};
    pid_t pid;
    int sp = posix_spawnp(&pid, "dot", &fa, NULL, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    close(in[0]);
    close(er[1]);
    if (sp) {
        close(in[1]);
        close(er[0]);
        ag_free(dot);
        if (sp == ENOENT)
            return ag__err(AG_ENOTSUP, "write_svg: Graphviz's `dot` program was not found: install "
                                       "the Debian package graphviz (scripts/install-deps.sh)");
        return ag__err(AG_EIO, "write_svg: cannot run dot: %s", strerror(sp));
    }
    /* A dot that exits before reading everything must not kill us with SIGPIPE: block it on
     * this thread while writing, then discard one that became pending. */
    sigset_t pipe_set, old;
    sigemptyset(&pipe_set);
    sigaddset(&pipe_set, SIGPIPE);
    sigset_t pending;
    sigpending(&pending);
    bool was_pending = sigismember(&pending, SIGPIPE) == 1;
    pthread_sigmask(SIG_BLOCK, &pipe_set, &old);
    char errbuf[1024];
    int wr = pump(in[1], dot, strlen(dot), er[0], errbuf, sizeof errbuf);
    close(er[0]);
    if (!was_pending) {
        struct timespec zero = {0, 0};
        while (sigtimedwait(&pipe_set, NULL, &zero) == SIGPIPE)
            ;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    ag_free(dot);
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
        ;
    if (wr)
        return ag__err(AG_EIO, "write_svg: writing to dot: %s", strerror(wr));
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        char *nl = strchr(errbuf, '\n');
        if (nl)
            *nl = 0;
        return ag__err(AG_EIO, "write_svg: dot -Tsvg -o %s failed (%s %d)%s%s", path,
                       WIFEXITED(status) ? "exit status" : "signal",
                       WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status),
                       errbuf[0] ? ": " : "", errbuf);
    }
    return 0;
}
