/* `aotgrad partition`: a zoo model's joint graph split into its forward and backward graphs.
 *
 *   aotgrad partition MODEL|FILE.joint [--config NAME] [--dropout P] [--partitioner default|mincut]
 *                           [--budget F] [--solver dp|greedy|ilp] [--format text|dot|svg]
 *                           [-o FILE]
 *
 * builds MODEL in meta mode (shapes only) and exports its joint graph (ag_export_joint), or
 * loads a saved joint (a name ending in .joint: ag_joint_load_file, `aotgrad export -o`),
 * partitions it (ag_partition: the default partitioner saves every forward value the backward
 * reads; mincut chooses what to save and what to recompute under the memory budget F in
 * [0, 1], 1 by default) and prints the forward graph, then the backward graph, then
 *
 *   saved: N tensors, B bytes; recomputed: K nodes, F FLOPs
 *   peak activation memory (model): P bytes (forward X, backward Y)
 *
 * the second line being the partitioner's peak-memory model of one step (values freed after
 * their last use, saved values alive from the forward into the backward, recomputed values from
 * their recomputation to their last use). --format dot prints both graphs as Graphviz DOT with
 * the saved values drawn with a thick red border; --format svg renders them through `dot` into
 * FILE's stem followed by -forward.svg and -backward.svg (needs -o). With -o the graphs go to
 * FILE and the summary to stdout; with DOT on stdout the summary goes to stderr.
 *
 * Exit status: 0 on success, 1 when the work fails (export, partition, I/O), 2 for a usage
 * error (an unknown option, model, configuration, or a budget outside [0, 1]). */
#include "cli.h"
#include "partition/partition_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef enum { FMT_TEXT, FMT_DOT, FMT_SVG } out_format;

typedef struct opts {
    ag_zoo_opts zoo;
    const char *model, *config, *out_path;
    out_format format;
    ag_partition_opts part;
} opts;

static const char usage[] =
    "usage: aotgrad partition MODEL|FILE.joint [--config NAME] [--dropout P] [--partitioner "
    "default|mincut] "
    "[--budget F] [--solver dp|greedy|ilp] [--format text|dot|svg] [-o FILE]\n"
    "       (aotgrad models lists the models)\n";

/* The zoo models whose last inputs are keyword arguments (as `aotgrad export`). */
static const struct {
    const char *model;
    int nkw;
    const char *names[2];
} zoo_kwargs[] = {
    {"kwargs", 1, {"scale"}},
};

static int bad(const char *what, const char *v) {
    fprintf(stderr, "aotgrad partition: %s, got '%s'\n%s", what, v ? v : "(nothing)", usage);
    return 2;
}

static int parse_opts(int argc, char **argv, opts *o) {
    o->part = (ag_partition_opts){
        .partitioner = AG_PARTITION_DEFAULT, .memory_budget = 1.0, .solver = AG_KNAPSACK_DP};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--config")) {
            if (!v)
                return bad("--config needs a configuration name", v);
            o->config = v;
            i++;
        } else if (!strcmp(a, "--dropout")) {
            if (cli_dropout_opt("partition", v, &o->zoo)) {
                fputs(usage, stderr);
                return 2;
            }
            i++;
        } else if (!strcmp(a, "--partitioner")) {
            if (v && !strcmp(v, "default"))
                o->part.partitioner = AG_PARTITION_DEFAULT;
            else if (v && !strcmp(v, "mincut"))
                o->part.partitioner = AG_PARTITION_MINCUT;
            else
                return bad("--partitioner needs default or mincut", v);
            i++;
        } else if (!strcmp(a, "--budget")) {
            if (cli_float_opt("partition", "--budget", v, 0, false, 1, &o->part.memory_budget)) {
                fputs(usage, stderr);
                return 2;
            }
            o->part.memory_budget = ag_memory_budget(o->part.memory_budget);
            i++;
        } else if (!strcmp(a, "--solver")) {
            if (v && !strcmp(v, "greedy"))
                o->part.solver = AG_KNAPSACK_GREEDY;
            else if (v && !strcmp(v, "dp"))
                o->part.solver = AG_KNAPSACK_DP;
            else if (v && !strcmp(v, "ilp"))
                o->part.solver = AG_KNAPSACK_ILP;
            else
                return bad("--solver needs greedy, dp or ilp", v);
            i++;
        } else if (!strcmp(a, "--format")) {
            if (v && !strcmp(v, "text"))
                o->format = FMT_TEXT;
            else if (v && !strcmp(v, "dot"))
                o->format = FMT_DOT;
            else if (v && !strcmp(v, "svg"))
                o->format = FMT_SVG;
            else
                return bad("--format needs text, dot or svg", v);
            i++;
        } else if (!strcmp(a, "-o")) {
            if (!v)
                return bad("-o needs a file name", v);
            o->out_path = v;
            i++;
        } else if (a[0] == '-' && a[1]) {
            return bad("unknown option", a);
        } else if (o->model) {
            return bad("unexpected argument", a);
        } else {
            o->model = a;
        }
    }
    if (!o->model) {
        fprintf(stderr, "aotgrad partition: missing MODEL\n%s", usage);
        return 2;
    }
    if (o->format == FMT_SVG && !o->out_path) {
        fprintf(stderr, "aotgrad partition: --format svg needs -o FILE\n%s", usage);
        return 2;
    }
    return 0;
}

/* Builds the model in meta mode and exports it. Returns 0 with *joint set, or the exit
 * status after a message. */
static int export_model(const opts *o, ag_joint **joint) {
    if (cli_is_joint_file(o->model)) { /* a saved joint: aotgrad export MODEL -o FILE.joint */
        if (o->config || o->zoo.set_dropout) {
            fprintf(stderr,
                    "aotgrad partition: --config and --dropout choose a zoo model's "
                    "build; %s is a saved joint\n%s",
                    o->model, usage);
            return 2;
        }
        return (*joint = cli_load_joint("partition", o->model)) ? 0 : 1;
    }
    int idx = -1;
    for (int i = 0; i < ag_zoo_count(); i++)
        if (!strcmp(ag_zoo_name(i), o->model))
            idx = i;
    if (idx < 0) {
        fprintf(stderr, "aotgrad partition: unknown model '%s'; the models are:", o->model);
        for (int i = 0; i < ag_zoo_count(); i++)
            fprintf(stderr, " %s", ag_zoo_name(i));
        fprintf(stderr, "\n");
        return 2;
    }
    ag_module *m = NULL;
    ag_tensor *in[4] = {0};
    int nin = 0;
    bool prev = ag_set_meta_mode(true);
    int rc = ag_zoo_build_opts(o->model, o->config, &o->zoo, &m, in, 4, &nin);
    ag_set_meta_mode(prev);
    if (rc) {
        fprintf(stderr, "aotgrad partition: %s\n", ag_last_error());
        return rc == AG_EINVAL ? 2 : 1;
    }
    int nkw = 0;
    const char *const *kw = NULL;
    for (size_t i = 0; i < sizeof zoo_kwargs / sizeof zoo_kwargs[0]; i++)
        if (!strcmp(zoo_kwargs[i].model, o->model) && zoo_kwargs[i].nkw <= nin) {
            nkw = zoo_kwargs[i].nkw;
            kw = zoo_kwargs[i].names;
        }
    *joint = ag_export_joint(m, in, nin - nkw, kw, in + nin - nkw, nkw, NULL);
    if (!*joint) {
        fprintf(stderr, "aotgrad partition: %s: %s\n", o->model, ag_last_error());
        rc = 1;
    }
    for (int i = 0; i < nin; i++)
        ag_tensor_free(in[i]);
    ag_module_free(m);
    return rc;
}

/* The forward's saved outputs, by name (pointers into fw, valid while it lives). */
static int saved_names(const ag_graph *fw, int nf, const char **names, int max) {
    const ag_garg *a = ag_node_arg(ag_graph_output_node(fw), 0);
    int n = 0;
    for (int k = nf; k < a->n && n < max; k++)
        names[n++] = ag_node_name(a->u.nodes[k]);
    return n;
}

/* path with its extension replaced by suffix ("out.svg" + "-forward.svg"). */
static char *with_suffix(const char *path, const char *suffix) {
    const char *slash = strrchr(path, '/'), *dot = strrchr(path, '.');
    size_t stem = dot && (!slash || dot > slash) ? (size_t)(dot - path) : strlen(path);
    char *s = malloc(stem + strlen(suffix) + 1);
    if (s) {
        memcpy(s, path, stem);
        strcpy(s + stem, suffix);
    }
    return s;
}

static int print_graphs(const opts *o, const ag_graph *fw, const ag_graph *bw, const char **hl,
                        int nhl) {
    char title[2][160];
    snprintf(title[0], sizeof title[0], "%s forward (%s)", o->model,
             o->part.partitioner == AG_PARTITION_MINCUT ? "mincut" : "default");
    snprintf(title[1], sizeof title[1], "%s backward (%s)", o->model,
             o->part.partitioner == AG_PARTITION_MINCUT ? "mincut" : "default");
    const ag_graph *gs[2] = {fw, bw};
    if (o->format == FMT_SVG) {
        static const char *const sfx[2] = {"-forward.svg", "-backward.svg"};
        for (int k = 0; k < 2; k++) {
            char *path = with_suffix(o->out_path, sfx[k]);
            if (!path) {
                fprintf(stderr, "aotgrad partition: out of memory\n");
                return 1;
            }
            ag_dot_opts d = {.title = title[k], .highlight = hl, .nhighlight = nhl};
            cli_out out;
            int rc = cli_out_open_name(&out, "partition", path);
            if (!rc && ag_graph_write_svg(gs[k], cli_out_name(&out), &d)) {
                fprintf(stderr, "aotgrad partition: %s\n", ag_last_error());
                cli_out_discard(&out);
                rc = 1;
            } else if (!rc) {
                rc = cli_out_close(&out);
            }
            if (!rc)
                fprintf(stderr, "wrote %s\n", path);
            free(path);
            if (rc)
                return 1;
        }
        return 0;
    }
    /* Both graphs are rendered before anything is written: a failure leaves -o's file alone. */
    char *s[2] = {0};
    for (int k = 0; k < 2; k++) {
        if (o->format == FMT_DOT) {
            ag_dot_opts d = {.title = title[k], .highlight = hl, .nhighlight = nhl};
            s[k] = ag_graph_to_dot(gs[k], &d);
        } else {
            s[k] = ag_graph_to_string(gs[k], NULL);
        }
        if (!s[k]) {
            fprintf(stderr, "aotgrad partition: %s\n", ag_last_error());
            ag_free(s[0]);
            return 1;
        }
    }
    cli_out out;
    int rc = cli_out_open(&out, "partition", o->out_path);
    if (!rc) {
        for (int k = 0; k < 2; k++) {
            if (o->format == FMT_TEXT)
                cli_out_puts(&out, k ? "\n# backward\n" : "# forward\n");
            cli_out_puts(&out, s[k]);
        }
        rc = cli_out_close(&out);
    }
    ag_free(s[0]);
    ag_free(s[1]);
    return rc;
}

int cli_partition(int argc, char **argv) {
    opts o = {0};
    int rc = parse_opts(argc, argv, &o);
    if (rc)
        return rc;
    ag_joint *j = NULL;
    if ((rc = export_model(&o, &j)))
        return rc;
    ag_graph *fw = NULL, *bw = NULL;
    ag_partition_stats st;
    ag__peak pk;
    int nf = ag_joint_num_fw_outputs(j);
    if (ag__partition_ex(ag_joint_graph(j), nf, &o.part, AG__BUDGET_PEAK, &fw, &bw, &st, &pk)) {
        fprintf(stderr, "aotgrad partition: %s: %s\n", o.model, ag_last_error());
        ag_joint_free(j);
        return 1;
    }
    const char **hl = malloc(sizeof *hl * (size_t)(st.saved_tensors + 1));
    if (!hl) {
        fprintf(stderr, "aotgrad partition: out of memory\n");
        rc = 1;
    } else {
        int nhl = saved_names(fw, nf, hl, st.saved_tensors);
        rc = print_graphs(&o, fw, bw, hl, nhl);
    }
    if (!rc) {
        FILE *sum = o.format == FMT_DOT && !o.out_path ? stderr : stdout;
        fprintf(sum, "%ssaved: %d tensors, %lld bytes; recomputed: %d nodes, %.0f FLOPs\n",
                o.format == FMT_TEXT && !o.out_path ? "\n" : "", st.saved_tensors,
                (long long)st.saved_bytes, st.recomputed_nodes, st.recomputed_flops);
        fprintf(sum, "peak activation memory (model): %lld bytes (forward %lld, backward %lld)\n",
                (long long)pk.peak, (long long)pk.fw_peak, (long long)pk.bw_peak);
    }
    free(hl);
    ag_graph_free(fw);
    ag_graph_free(bw);
    ag_joint_free(j);
    return rc;
}
