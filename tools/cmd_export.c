/* `aotgrad export` and `aotgrad descriptors`: a zoo model's joint forward+backward graph with
 * descriptors (ag_export_joint) and its calling convention.
 *
 *   aotgrad export MODEL [--config NAME] [--nested-blocks] [--decompose core]
 *                        [--format text|dot|svg|joint]
 *                        [-o FILE] [--seq-nr] [--stack-traces] [--module-stacks]
 *       builds MODEL in meta mode (shapes only: the export reads no weight), exports the joint
 *       graph and prints it as text (docs/GRAPH_FORMAT.md, descriptors included), as Graphviz
 *       DOT, or renders it to SVG (needs -o). --format joint, or -o FILE.joint without
 *       --format, writes the saved joint (ag_joint_save, docs/JOINT_FORMAT.md: the calling
 *       convention and the graph in full) that `aotgrad partition` and `aotgrad check` read;
 *       the model is then built with its data, so constants hold their values. --decompose
 *       core applies the core decomposition table (ag_decomp_table_core) during the export, as
 *       upstream's decompositions=.
 *   aotgrad descriptors MODEL [--config NAME]
 *       prints params_spec, buffers_spec, in_spec and out_spec, then every differentiable input
 *       with its placeholder and gradient (ag_fx_all_input_and_grad_nodes) and every
 *       differentiable output with its node and tangent (ag_fx_all_output_and_tangent_nodes),
 *       then, when there are any, the inputs and outputs no gradient pairs with (the philox
 *       seeds and offsets of a model with random ops); for a joint with tensor subclasses,
 *       which those utilities refuse, every placeholder and output with its descriptor
 *       instead, and the utilities' message.
 *   Both take --dropout P: the dropout probability of zoo models with dropout layers, and
 *   --nested-blocks: gpt2 with each block a nested compile region (traced once into a
 *   subgraph every block calls: invoke_subgraph, fw_subgraph_0 / bw_subgraph_0_0).
 *
 * C has no keyword arguments, so the zoo passes keyword inputs positionally, last; the table
 * zoo_kwargs below names them, and they reach the export as kwargs (upstream's
 * `forward(x, *, scale)` gets in_spec `TreeSpec(tuple, None, [..., TreeSpec(dict, ['scale'],
 * [*])])`).
 *
 * Exit status: 0 on success, 1 when the work fails (an export error, an I/O error), 2 for a
 * usage error (an unknown option, model or configuration). */
#include "cli.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef enum { FMT_TEXT, FMT_DOT, FMT_SVG, FMT_JOINT } out_format;

typedef struct opts {
    ag_zoo_opts zoo;
    const char *model, *config, *out_path;
    out_format format;
    bool format_given; /* --format: else -o FILE.joint picks FMT_JOINT */
    bool decompose;
    ag_print_opts print;
} opts;

static const char export_usage[] =
    "usage: aotgrad export MODEL [--config NAME] [--dropout P] [--nested-blocks] "
    "[--decompose core]\n"
    "       [--format text|dot|svg|joint] [-o FILE] [--seq-nr] [--stack-traces] "
    "[--module-stacks]\n"
    "       (aotgrad models lists the models; -o FILE.joint or --format joint writes the saved\n"
    "       joint that partition and check read)\n";
static const char desc_usage[] = "usage: aotgrad descriptors MODEL [--config NAME] [--dropout P] "
                                 "[--nested-blocks]\n"
                                 "       (aotgrad models lists the models)\n";

/* The zoo models whose last inputs are keyword arguments, and their names. */
static const struct {
    const char *model;
    int nkw;
    const char *names[2];
} zoo_kwargs[] = {
    {"kwargs", 1, {"scale"}},
};

/* ---- options ---- */

/* Parses argv; is_export allows the printing options. Returns 0, or 2 after a usage message. */
static int parse_opts(const char *cmd, int argc, char **argv, bool is_export, const char *usage,
                      opts *o) {
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--config")) {
            if (!v) {
                fprintf(stderr, "aotgrad %s: --config needs a configuration name\n%s", cmd, usage);
                return 2;
            }
            o->config = v;
            i++;
        } else if (!strcmp(a, "--dropout")) {
            if (cli_dropout_opt(cmd, v, &o->zoo)) {
                fputs(usage, stderr);
                return 2;
            }
            i++;
        } else if (!strcmp(a, "--nested-blocks")) {
            o->zoo.nested_blocks = true;
        } else if (is_export && !strcmp(a, "--decompose")) {
            if (!v || strcmp(v, "core")) {
                fprintf(stderr, "aotgrad %s: --decompose needs 'core', got '%s'\n%s", cmd,
                        v ? v : "(nothing)", usage);
                return 2;
            }
            o->decompose = true;
            i++;
        } else if (is_export && !strcmp(a, "--format")) {
            if (v && !strcmp(v, "text"))
                o->format = FMT_TEXT;
            else if (v && !strcmp(v, "dot"))
                o->format = FMT_DOT;
            else if (v && !strcmp(v, "svg"))
                o->format = FMT_SVG;
            else if (v && !strcmp(v, "joint"))
                o->format = FMT_JOINT;
            else {
                fprintf(stderr, "aotgrad %s: --format needs text, dot, svg or joint, got '%s'\n%s",
                        cmd, v ? v : "(nothing)", usage);
                return 2;
            }
            o->format_given = true;
            i++;
        } else if (is_export && !strcmp(a, "-o")) {
            if (!v) {
                fprintf(stderr, "aotgrad %s: -o needs a file name\n%s", cmd, usage);
                return 2;
            }
            o->out_path = v;
            i++;
        } else if (is_export && !strcmp(a, "--seq-nr")) {
            o->print.seq_nr = true;
        } else if (is_export && !strcmp(a, "--stack-traces")) {
            o->print.stack_trace = true;
        } else if (is_export && !strcmp(a, "--module-stacks")) {
            o->print.module_stack = true;
        } else if (a[0] == '-' && a[1]) {
            fprintf(stderr, "aotgrad %s: unknown option '%s'\n%s", cmd, a, usage);
            return 2;
        } else if (o->model) {
            fprintf(stderr, "aotgrad %s: unexpected argument '%s'\n%s", cmd, a, usage);
            return 2;
        } else {
            o->model = a;
        }
    }
    if (!o->model) {
        fprintf(stderr, "aotgrad %s: missing MODEL\n%s", cmd, usage);
        return 2;
    }
    if (o->format == FMT_SVG && !o->out_path) {
        fprintf(stderr, "aotgrad %s: --format svg needs -o FILE\n%s", cmd, usage);
        return 2;
    }
    if (!o->format_given && o->out_path && cli_is_joint_file(o->out_path))
        o->format = FMT_JOINT;
    return 0;
}

/* ---- the export ---- */

/* Builds the model and exports it. Returns 0 with *joint set, or the exit status after a
 * message. */
static int export_model(const char *cmd, const opts *o, ag_joint **joint) {
    int idx = -1;
    for (int i = 0; i < ag_zoo_count(); i++)
        if (!strcmp(ag_zoo_name(i), o->model))
            idx = i;
    if (idx < 0) {
        fprintf(stderr, "aotgrad %s: unknown model '%s'; the models are:", cmd, o->model);
        for (int i = 0; i < ag_zoo_count(); i++)
            fprintf(stderr, " %s", ag_zoo_name(i));
        fprintf(stderr, "\n");
        return 2;
    }
    /* Meta mode: weights get shapes but no data; the export only reads shapes. A saved joint
     * is built with data, so that constants the trace makes hold their values. */
    ag_module *m = NULL;
    ag_tensor *in[4] = {0};
    int nin = 0;
    bool prev = ag_set_meta_mode(o->format != FMT_JOINT);
    int rc = ag_zoo_build_opts(o->model, o->config, &o->zoo, &m, in, 4, &nin);
    ag_set_meta_mode(prev);
    if (rc) {
        /* The only way a known model fails to build here is a bad configuration. */
        fprintf(stderr, "aotgrad %s: %s\n", cmd, ag_last_error());
        return rc == AG_EINVAL ? 2 : 1;
    }
    int nkw = 0;
    const char *const *kw = NULL;
    for (size_t i = 0; i < sizeof zoo_kwargs / sizeof zoo_kwargs[0]; i++)
        if (!strcmp(zoo_kwargs[i].model, o->model) && zoo_kwargs[i].nkw <= nin) {
            nkw = zoo_kwargs[i].nkw;
            kw = zoo_kwargs[i].names;
        }
    ag_export_opts eo = {0};
    ag_decomp_table *core = NULL;
    if (o->decompose && !(core = ag_decomp_table_core())) {
        fprintf(stderr, "aotgrad %s: %s\n", cmd, ag_last_error());
        rc = 1;
    } else {
        eo.decompositions = core;
        *joint = ag_export_joint(m, in, nin - nkw, kw, in + nin - nkw, nkw, &eo);
        if (!*joint) {
            fprintf(stderr, "aotgrad %s: %s: %s\n", cmd, o->model, ag_last_error());
            rc = 1;
        }
    }
    ag_decomp_table_free(core);
    for (int i = 0; i < nin; i++)
        ag_tensor_free(in[i]);
    ag_module_free(m);
    return rc;
}

/* ---- export ---- */

int cli_export(int argc, char **argv) {
    opts o = {0};
    int rc = parse_opts("export", argc, argv, true, export_usage, &o);
    if (rc)
        return rc;
    ag_joint *j = NULL;
    if ((rc = export_model("export", &o, &j)))
        return rc;
    const ag_graph *g = ag_joint_graph(j);
    char title[160];
    snprintf(title, sizeof title, "%s%s%s joint", o.model, o.config ? " " : "",
             o.config ? o.config : "");
    ag_dot_opts dopts = {.title = title};
    cli_out out;
    if (o.format == FMT_JOINT) {
        char *s = NULL;
        size_t n = 0;
        if (ag_joint_save(j, &s, &n)) {
            fprintf(stderr, "aotgrad export: %s: %s\n", o.model, ag_last_error());
            rc = 1;
        } else {
            rc = cli_out_open(&out, "export", o.out_path);
            if (!rc) {
                cli_out_write(&out, s, n);
                rc = cli_out_close(&out);
            }
            ag_free(s);
        }
    } else if (o.format == FMT_SVG) {
        if (cli_out_open_name(&out, "export", o.out_path)) {
            rc = 1;
        } else if (ag_graph_write_svg(g, cli_out_name(&out), &dopts)) {
            fprintf(stderr, "aotgrad export: %s\n", ag_last_error());
            cli_out_discard(&out);
            rc = 1;
        } else {
            rc = cli_out_close(&out);
        }
    } else {
        char *s =
            o.format == FMT_DOT ? ag_graph_to_dot(g, &dopts) : ag_graph_to_string(g, &o.print);
        if (!s) {
            fprintf(stderr, "aotgrad export: %s\n", ag_last_error());
            rc = 1;
        } else {
            rc = cli_out_open(&out, "export", o.out_path);
            if (!rc) {
                cli_out_puts(&out, s);
                rc = cli_out_close(&out);
            }
            ag_free(s);
        }
    }
    ag_joint_free(j);
    return rc;
}

/* ---- descriptors ---- */

/* A growable string; on allocation failure it stops growing and remembers it. */
typedef struct sbuf {
    char *s;
    size_t len, cap;
    bool oom;
} sbuf;

static void sb_put(sbuf *b, const char *s, size_t n) {
    if (b->oom)
        return;
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (b->len + n + 1 > cap)
            cap *= 2;
        char *ns = realloc(b->s, cap);
        if (!ns) {
            b->oom = true;
            return;
        }
        b->s = ns;
        b->cap = cap;
    }
    memcpy(b->s + b->len, s, n);
    b->len += n;
    b->s[b->len] = 0;
}

static void sb_str(sbuf *b, const char *s) {
    sb_put(b, s, strlen(s));
}

/* Appends a descriptor's repr (None for NULL), padded with spaces to `width`. */
static void sb_desc(sbuf *b, const ag_desc *d, size_t width) {
    size_t n = ag_desc_repr(d, NULL, 0);
    char *tmp = malloc(n + 1);
    if (!tmp) {
        b->oom = true;
        return;
    }
    ag_desc_repr(d, tmp, n + 1);
    sb_put(b, tmp, n);
    free(tmp);
    for (; n < width; n++)
        sb_put(b, " ", 1);
}

/* Python's repr of a list of strings; the strings are quoted as Python quotes them by printing
 * each as a ParamAOTInput target (the descriptor printer implements repr(str)). */
static void sb_str_list(sbuf *b, int n, const char *(*get)(const ag_joint *, int),
                        const ag_joint *j) {
    static const char prefix[] = "ParamAOTInput(target=";
    sb_str(b, "[");
    for (int i = 0; i < n; i++) {
        ag_desc *d = ag_desc_param(get(j, i));
        if (!d) {
            b->oom = true;
            return;
        }
        size_t len = ag_desc_repr(d, NULL, 0);
        char *tmp = malloc(len + 1);
        if (tmp) {
            ag_desc_repr(d, tmp, len + 1);
            if (i)
                sb_str(b, ", ");
            sb_put(b, tmp + sizeof prefix - 1, len - (sizeof prefix - 1) - 1);
            free(tmp);
        } else
            b->oom = true;
        ag_desc_release(d);
    }
    sb_str(b, "]");
}

static void sb_spec(sbuf *b, const ag_treespec *s) {
    size_t n = ag_treespec_repr(s, NULL, 0);
    char *tmp = malloc(n + 1);
    if (!tmp) {
        b->oom = true;
        return;
    }
    ag_treespec_repr(s, tmp, n + 1);
    sb_put(b, tmp, n);
    free(tmp);
}

/* One table: a header line, then `descriptor  node  paired` per pair, columns aligned. */
static void sb_pairs(sbuf *b, const char *title, const ag_fx_pairs *p, const char *const *cols) {
    int n = ag_fx_pairs_count(p);
    size_t w0 = strlen(cols[0]), w1 = strlen(cols[1]);
    for (int i = 0; i < n; i++) {
        size_t k = ag_desc_repr(ag_fx_pairs_desc(p, i), NULL, 0);
        w0 = k > w0 ? k : w0;
        const ag_node *f = ag_fx_pairs_first(p, i);
        k = strlen(f ? ag_node_name(f) : "None");
        w1 = k > w1 ? k : w1;
    }
    char line[64];
    snprintf(line, sizeof line, " (%d):\n", n);
    sb_str(b, title);
    sb_str(b, line);
    for (int i = -1; i < n; i++) {
        const ag_node *f = i < 0 ? NULL : ag_fx_pairs_first(p, i);
        const ag_node *s = i < 0 ? NULL : ag_fx_pairs_second(p, i);
        const char *c1 = i < 0 ? cols[1] : f ? ag_node_name(f) : "None";
        const char *c2 = i < 0 ? cols[2] : s ? ag_node_name(s) : "None";
        sb_str(b, "  ");
        if (i < 0) {
            sb_str(b, cols[0]);
            for (size_t k = strlen(cols[0]); k < w0; k++)
                sb_str(b, " ");
        } else {
            sb_desc(b, ag_fx_pairs_desc(p, i), w0);
        }
        sb_str(b, "  ");
        sb_str(b, c1);
        for (size_t k = strlen(c1); k < w1; k++)
            sb_str(b, " ");
        sb_str(b, "  ");
        sb_str(b, c2);
        sb_str(b, "\n");
    }
}

/* The placeholders and outputs whose descriptors are not differentiable (no gradient or tangent
 * pairs with them: philox seeds and offsets, ...), as `descriptor  node` lines; nothing when
 * there are none. */
static void sb_other(sbuf *b, const ag_graph *g) {
    ag_node **ph;
    int nph = ag_graph_placeholders(g, &ph);
    const ag_node *out = ag_graph_output_node(g);
    int nout = out ? ag_node_arg(out, 0)->n : 0;
    const ag_desc *d[64];
    const ag_node *nd[64];
    int n = 0;
    for (int i = 0; i < nph && n < 64; i++)
        if (ag_node_desc(ph[i]) && !ag_desc_is_differentiable(ag_node_desc(ph[i]))) {
            d[n] = ag_node_desc(ph[i]);
            nd[n++] = ph[i];
        }
    for (int i = 0; i < nout && n < 64; i++) {
        const ag_desc *od = ag_node_output_desc(out, i);
        if (od && !ag_desc_is_differentiable(od)) {
            d[n] = od;
            nd[n++] = ag_node_arg(out, 0)->u.nodes[i];
        }
    }
    if (n == 0)
        return;
    size_t w = strlen("descriptor");
    for (int i = 0; i < n; i++) {
        size_t k = ag_desc_repr(d[i], NULL, 0);
        w = k > w ? k : w;
    }
    char line[64];
    snprintf(line, sizeof line, "\nnon-differentiable inputs and outputs (%d):\n  ", n);
    sb_str(b, line);
    sb_str(b, "descriptor");
    for (size_t k = strlen("descriptor"); k < w; k++)
        sb_str(b, " ");
    sb_str(b, "  node\n");
    for (int i = 0; i < n; i++) {
        sb_str(b, "  ");
        sb_desc(b, d[i], w);
        sb_str(b, "  ");
        sb_str(b, nd[i] ? ag_node_name(nd[i]) : "None");
        sb_str(b, "\n");
    }
}

/* For a graph the FX utilities refuse (tensor subclasses: no 1-1 pairing), every placeholder
 * and every output with its descriptor, in graph order. */
static void sb_flat_descs(sbuf *b, const ag_graph *g) {
    ag_node **ph;
    int nph = ag_graph_placeholders(g, &ph);
    const ag_node *out = ag_graph_output_node(g);
    const ag_garg *oa = out ? ag_node_arg(out, 0) : NULL;
    int nout = oa && oa->kind == AG_GA_NODES ? oa->n : 0;
    size_t w = strlen("placeholder");
    for (int i = 0; i < nph; i++)
        w = strlen(ag_node_name(ph[i])) > w ? strlen(ag_node_name(ph[i])) : w;
    for (int i = 0; i < nout; i++)
        if (oa->u.nodes[i] && strlen(ag_node_name(oa->u.nodes[i])) > w)
            w = strlen(ag_node_name(oa->u.nodes[i]));
    char line[64];
    for (int pass = 0; pass < 2; pass++) {
        int n = pass ? nout : nph;
        snprintf(line, sizeof line, "%s (%d):\n", pass ? "outputs" : "inputs", n < 0 ? 0 : n);
        sb_str(b, line);
        for (int i = -1; i < n; i++) {
            const ag_node *nd = i < 0 ? NULL : pass ? oa->u.nodes[i] : ph[i];
            const char *c1 = i < 0 ? (pass ? "node" : "placeholder")
                             : nd  ? ag_node_name(nd)
                                   : "None";
            sb_str(b, "  ");
            sb_str(b, c1);
            for (size_t k = strlen(c1); k < w + 2; k++)
                sb_str(b, " ");
            if (i < 0)
                sb_str(b, "descriptor");
            else
                sb_desc(b, pass ? ag_node_output_desc(out, i) : ag_node_desc(ph[i]), 0);
            sb_str(b, "\n");
        }
        if (!pass)
            sb_str(b, "\n");
    }
}

int cli_descriptors(int argc, char **argv) {
    opts o = {0};
    int rc = parse_opts("descriptors", argc, argv, false, desc_usage, &o);
    if (rc)
        return rc;
    ag_joint *j = NULL;
    if ((rc = export_model("descriptors", &o, &j)))
        return rc;
    const ag_graph *g = ag_joint_graph(j);
    ag_fx_pairs *ig = ag_fx_all_input_and_grad_nodes(g);
    ag_fx_pairs *ot = ig ? ag_fx_all_output_and_tangent_nodes(g) : NULL;
    /* Tensor subclasses: the utilities refuse (as upstream's do); list the descriptors. */
    char refusal[1024] = "";
    if (!ot && ag_last_status() == AG_ENOTSUP)
        snprintf(refusal, sizeof refusal, "%s", ag_last_error());
    if (!ot && !refusal[0]) {
        fprintf(stderr, "aotgrad descriptors: %s: %s\n", o.model, ag_last_error());
        ag_fx_pairs_free(ig);
        ag_joint_free(j);
        return 1;
    }
    sbuf b = {0};
    sb_str(&b, "params_spec: ");
    sb_str_list(&b, ag_joint_num_params(j), ag_joint_param_fqn, j);
    sb_str(&b, "\nbuffers_spec: ");
    sb_str_list(&b, ag_joint_num_buffers(j), ag_joint_buffer_fqn, j);
    sb_str(&b, "\nin_spec: ");
    sb_spec(&b, ag_joint_in_spec(j));
    sb_str(&b, "\nout_spec: ");
    sb_spec(&b, ag_joint_out_spec(j));
    sb_str(&b, "\n\n");
    if (refusal[0]) {
        sb_flat_descs(&b, g);
        sb_str(&b, "\nno input/grad or output/tangent pairs: ");
        sb_str(&b, refusal);
        sb_str(&b, "\n");
    } else {
        sb_pairs(&b, "differentiable inputs -> grads", ig,
                 (const char *const[]){"input", "placeholder", "grad"});
        sb_str(&b, "\n");
        sb_pairs(&b, "differentiable outputs -> tangents", ot,
                 (const char *const[]){"output", "node", "tangent"});
        sb_other(&b, g);
    }
    if (b.oom) {
        fprintf(stderr, "aotgrad descriptors: out of memory\n");
        rc = 1;
    } else {
        cli_out out;
        rc = cli_out_open(&out, "descriptors", NULL);
        if (!rc) {
            cli_out_puts(&out, b.s);
            rc = cli_out_close(&out);
        }
    }
    free(b.s);
    ag_fx_pairs_free(ot);
    ag_fx_pairs_free(ig);
    ag_joint_free(j);
    return rc;
}
