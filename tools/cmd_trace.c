/* `aotgrad models`, `aotgrad trace` and `aotgrad show`: the model zoo and graph files.
 *
 *   aotgrad models
 *       lists the zoo: name, configurations and a one-line description.
 *   aotgrad trace MODEL [--config NAME] [--dropout P] [--format text|dot|svg] [-o FILE]
 *                       [--seq-nr] [--stack-traces] [--module-stacks]
 *       builds MODEL in meta mode (no weights are allocated, so gpt2-small costs kilobytes),
 *       traces its forward and prints the graph as text (docs/GRAPH_FORMAT.md), as Graphviz DOT,
 *       or renders it to SVG (needs -o).
 *   aotgrad show FILE [--format text|dot|svg] [-o FILE]
 *       parses a graph file, verifies it and prints it again with all the metadata it holds;
 *       a malformed file gives "FILE:LINE:COL: message" on stderr. FILE may be a device or a
 *       pipe (/dev/stdin); at most CLI_MAX_INPUT bytes (256 MiB) are read. A FILE ending in
 *       .joint is a saved joint (docs/JOINT_FORMAT.md): it is loaded, header checks included,
 *       and its graph printed; errors read "FILE: joint_load: line L: message".
 *
 * Exit status: 0 on success, 1 when the work fails (a trace error, a bad graph file, an I/O
 * error), 2 for a usage error (an unknown option, model or configuration). */
#include "cli.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef enum { FMT_TEXT, FMT_DOT, FMT_SVG } out_format;

/* Options shared by trace and show. */
typedef struct out_opts {
    out_format format;
    const char *out_path; /* -o; NULL: stdout */
    ag_print_opts print;
} out_opts;

static const char trace_usage[] =
    "usage: aotgrad trace MODEL [--config NAME] [--dropout P] [--format text|dot|svg] [-o FILE] "
    "[--seq-nr] [--stack-traces] [--module-stacks]\n"
    "       (aotgrad models lists the models)\n";
static const char show_usage[] = "usage: aotgrad show FILE [--format text|dot|svg] [-o FILE]\n";

/* ---- models ---- */

int cli_models(int argc, char **argv) {
    if (argc > 1) {
        fprintf(stderr, "aotgrad models: unexpected argument '%s'\nusage: aotgrad models\n",
                argv[1]);
        return 2;
    }
    for (int i = 0; i < ag_zoo_count(); i++) {
        const char *cfg = ag_zoo_configs(i);
        printf("%-13s %s", ag_zoo_name(i), ag_zoo_description(i));
        if (strcmp(cfg, "default"))
            printf(" [configs: %s]", cfg);
        printf("\n");
    }
    return 0;
}

/* ---- output ---- */

static int parse_format(const char *cmd, const char *v, out_format *f) {
    if (v && !strcmp(v, "text"))
        *f = FMT_TEXT;
    else if (v && !strcmp(v, "dot"))
        *f = FMT_DOT;
    else if (v && !strcmp(v, "svg"))
        *f = FMT_SVG;
    else {
        fprintf(stderr, "aotgrad %s: --format needs text, dot or svg, got '%s'\n", cmd,
                v ? v : "(nothing)");
        return -1;
    }
    return 0;
}

/* Prints g as the options ask; returns the exit status. */
static int emit(const char *cmd, const ag_graph *g, const out_opts *o, const char *title) {
    ag_dot_opts dopts = {.title = title};
    cli_out out;
    if (o->format == FMT_SVG) {
        if (cli_out_open_name(&out, cmd, o->out_path))
            return 1;
        if (ag_graph_write_svg(g, cli_out_name(&out), &dopts)) {
            fprintf(stderr, "aotgrad %s: %s\n", cmd, ag_last_error());
            cli_out_discard(&out);
            return 1;
        }
        return cli_out_close(&out);
    }
    char *s = o->format == FMT_DOT ? ag_graph_to_dot(g, &dopts) : ag_graph_to_string(g, &o->print);
    if (!s) {
        fprintf(stderr, "aotgrad %s: %s\n", cmd, ag_last_error());
        return 1;
    }
    int rc = cli_out_open(&out, cmd, o->out_path);
    if (!rc) {
        cli_out_puts(&out, s);
        rc = cli_out_close(&out);
    }
    ag_free(s);
    return rc;
}

/* Parses the options both commands take; the first non-option argument goes to *positional.
 * Returns 0, or 2 after printing a usage message. is_trace allows trace's own options. */
static int parse_opts(const char *cmd, int argc, char **argv, bool is_trace, const char *usage,
                      out_opts *o, const char **positional, const char **config, ag_zoo_opts *zoo) {
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--format")) {
            if (parse_format(cmd, v, &o->format))
                return 2;
            i++;
        } else if (!strcmp(a, "-o")) {
            if (!v) {
                fprintf(stderr, "aotgrad %s: -o needs a file name\n%s", cmd, usage);
                return 2;
            }
            o->out_path = v;
            i++;
        } else if (is_trace && !strcmp(a, "--config")) {
            if (!v) {
                fprintf(stderr, "aotgrad %s: --config needs a configuration name\n%s", cmd, usage);
                return 2;
            }
            *config = v;
            i++;
        } else if (is_trace && !strcmp(a, "--dropout")) {
            if (cli_dropout_opt(cmd, v, zoo)) {
                fputs(usage, stderr);
                return 2;
            }
            i++;
        } else if (is_trace && !strcmp(a, "--seq-nr")) {
            o->print.seq_nr = true;
        } else if (is_trace && !strcmp(a, "--stack-traces")) {
            o->print.stack_trace = true;
        } else if (is_trace && !strcmp(a, "--module-stacks")) {
            o->print.module_stack = true;
        } else if (a[0] == '-' && a[1]) {
            fprintf(stderr, "aotgrad %s: unknown option '%s'\n%s", cmd, a, usage);
            return 2;
        } else if (*positional) {
            fprintf(stderr, "aotgrad %s: unexpected argument '%s'\n%s", cmd, a, usage);
            return 2;
        } else {
            *positional = a;
        }
    }
    if (!*positional) {
        fprintf(stderr, "aotgrad %s: missing %s\n%s", cmd, is_trace ? "MODEL" : "FILE", usage);
        return 2;
    }
    if (o->format == FMT_SVG && !o->out_path) {
        fprintf(stderr, "aotgrad %s: --format svg needs -o FILE\n%s", cmd, usage);
        return 2;
    }
    return 0;
}

/* ---- trace ---- */

static int find_model(const char *name) {
    for (int i = 0; i < ag_zoo_count(); i++)
        if (!strcmp(ag_zoo_name(i), name))
            return i;
    return -1;
}

int cli_trace(int argc, char **argv) {
    out_opts o = {0};
    const char *model_name = NULL, *config = NULL;
    ag_zoo_opts zoo = {0};
    int rc = parse_opts("trace", argc, argv, true, trace_usage, &o, &model_name, &config, &zoo);
    if (rc)
        return rc;
    int idx = find_model(model_name);
    if (idx < 0) {
        fprintf(stderr, "aotgrad trace: unknown model '%s'; the models are:", model_name);
        for (int i = 0; i < ag_zoo_count(); i++)
            fprintf(stderr, " %s", ag_zoo_name(i));
        fprintf(stderr, "\n");
        return 2;
    }
    /* Meta mode: the weights get shapes but no data; tracing only reads shapes. */
    ag_module *m = NULL;
    ag_tensor *in[4] = {0};
    int nin = 0;
    bool prev = ag_set_meta_mode(true);
    rc = ag_zoo_build_opts(model_name, config, &zoo, &m, in, 4, &nin);
    ag_set_meta_mode(prev);
    if (rc) {
        /* The only way a known model fails to build here is a bad configuration. */
        fprintf(stderr, "aotgrad trace: %s\n", ag_last_error());
        return rc == AG_EINVAL ? 2 : 1;
    }
    ag_graph *g = ag_trace_module(m, in, nin, NULL);
    if (!g) {
        fprintf(stderr, "aotgrad trace: %s: %s\n", model_name, ag_last_error());
        rc = 1;
    } else {
        char title[128];
        snprintf(title, sizeof title, "%s%s%s", model_name, config ? " " : "",
                 config ? config : "");
        rc = emit("trace", g, &o, title);
    }
    ag_graph_free(g);
    for (int i = 0; i < nin; i++)
        ag_tensor_free(in[i]);
    ag_module_free(m);
    return rc;
}

/* ---- show ---- */

int cli_show(int argc, char **argv) {
    out_opts o = {0};
    const char *path = NULL, *unused = NULL;
    int rc = parse_opts("show", argc, argv, false, show_usage, &o, &path, &unused, NULL);
    if (rc)
        return rc;
    /* Show everything the file holds. */
    o.print.seq_nr = true;
    o.print.stack_trace = true;
    o.print.module_stack = true;
    size_t len = 0;
    char *text = cli_read_file("show", path, "graph files", CLI_MAX_INPUT, &len);
    if (!text)
        return 1;
    /* show reads what every aotgrad command prints, so the zoo's custom ops (the effects
     * model's aotgrad_demo::log_value) are registered first, as building the model would. A
     * library user registers their own ops before parsing text that names them. */
    if (!ag_zoo_log_value_op()) {
        fprintf(stderr, "aotgrad show: %s\n", ag_last_error());
        free(text);
        return 1;
    }
    if (cli_is_joint_file(path)) { /* a saved joint: its graph (the header is checked too) */
        ag_joint *j = ag_joint_load(text, len);
        free(text);
        if (!j) {
            fprintf(stderr, "aotgrad show: %s: %s\n", path, ag_last_error());
            return 1;
        }
        rc = emit("show", ag_joint_graph(j), &o, path);
        ag_joint_free(j);
        return rc;
    }
    ag_graph *g = ag_graph_parse(text, len);
    free(text);
    if (!g) {
        /* The parser says "line L:C: what"; compilers' "FILE:L:C: what" lets editors jump. */
        const char *msg = ag_last_error();
        int line = 0, col = 0, used = 0;
        if (sscanf(msg, "line %d:%d:%n", &line, &col, &used) == 2 && used > 0)
            fprintf(stderr, "%s:%d:%d:%s\n", path, line, col, msg + used);
        else
            fprintf(stderr, "%s: %s\n", path, msg);
        return 1;
    }
    if (ag_graph_verify(g)) {
        fprintf(stderr, "%s: the graph does not verify: %s\n", path, ag_last_error());
        ag_graph_free(g);
        return 1;
    }
    rc = emit("show", g, &o, path);
    ag_graph_free(g);
    return rc;
}
