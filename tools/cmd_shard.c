/* `aotgrad shard MODEL --world N [--rank R] --parallel dp|fsdp|tp [--batch B] [--config NAME]
 * [--format text|dot|svg] [-o FILE]`: what rank R of N runs under a strategy, without MPI.
 *
 * The zoo model is built in meta mode (shapes only). For mlp, cnn and gpt2 the graph is the
 * training step of `aotgrad train` (the model and its loss, cli_train_step_new) on a global
 * batch of B (default: the zoo's example batch, 32 for mlp, 8 for cnn, 2 for gpt2; dp and fsdp
 * need B to split among the N ranks); other zoo models are exported as they are. The strategy's
 * plan shards the joint for rank R on a mesh of N ranks (ag_shard_joint needs no process
 * group), and the sharded joint is printed as `export` prints a joint: the graph text, DOT, or
 * SVG (-o FILE). Then, on stdout (stderr when the graph goes to stdout as DOT), the summary:
 *
 *   per rank: params B bytes, optimizer state B bytes, saved activations B bytes;
 *   communication: B bytes in K collectives per step
 *   replicated for want of a sharding rule: OP xN, ... (or "none")
 *   decomposed to shard: OP xN, ... (or "none"): nodes replaced by their decompositions
 *   because whole they would all_gather a sharded input (ag_shard_summary.decomposed_ops)
 *
 * params, optimizer state, communication and collectives are ag_shard_summary_get's; saved
 * activations are what the min-cut partitioner (budget 1, as `train`) saves between the
 * sharded forward and backward.
 *
 * Exit status: 0, 1 when sharding fails, 2 for a usage error. */
#include "cli.h"
#include "train_dist.h"

#include <stdio.h>
#include <string.h>

static const char shard_usage[] =
    "usage: aotgrad shard MODEL --world N [--rank R] --parallel dp|fsdp|tp [--batch B] "
    "[--config NAME] [--format text|dot|svg] [-o FILE]\n";

typedef enum { SH_TEXT, SH_DOT, SH_SVG } sh_format;

typedef struct shard_opts {
    const char *model, *config, *strategy, *out_path;
    long long world, rank, batch;
    sh_format format;
} shard_opts;

static int parse(int argc, char **argv, shard_opts *o) {
    o->rank = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int rc = 0;
        if (!strcmp(a, "--world"))
            rc = cli_int_opt("shard", "--world", v, 1, 1 << 20, &o->world), i++;
        else if (!strcmp(a, "--rank"))
            rc = cli_int_opt("shard", "--rank", v, 0, 1 << 20, &o->rank), i++;
        else if (!strcmp(a, "--batch"))
            rc = cli_int_opt("shard", "--batch", v, 1, (long long)1 << 30, &o->batch), i++;
        else if (!strcmp(a, "--parallel") && v &&
                 (!strcmp(v, "dp") || !strcmp(v, "fsdp") || !strcmp(v, "tp")))
            o->strategy = v, i++;
        else if (!strcmp(a, "--config") && v)
            o->config = v, i++;
        else if (!strcmp(a, "-o") && v)
            o->out_path = v, i++;
        else if (!strcmp(a, "--format") && v && !strcmp(v, "text"))
            o->format = SH_TEXT, i++;
        else if (!strcmp(a, "--format") && v && !strcmp(v, "dot"))
            o->format = SH_DOT, i++;
        else if (!strcmp(a, "--format") && v && !strcmp(v, "svg"))
            o->format = SH_SVG, i++;
        else if (a[0] != '-' && !o->model)
            o->model = a;
        else {
            if (!strcmp(a, "--parallel") && v)
                fprintf(stderr, "aotgrad shard: --parallel: expected dp, fsdp or tp, got '%s'\n",
                        v);
            else if (!strcmp(a, "--format") && v)
                fprintf(stderr, "aotgrad shard: --format needs text, dot or svg, got '%s'\n", v);
            else
                fprintf(stderr, "aotgrad shard: bad option '%s'\n", a);
            rc = -1;
        }
        if (rc) {
            fputs(shard_usage, stderr);
            return 2;
        }
    }
    const char *missing = !o->model      ? "MODEL"
                          : !o->world    ? "--world N"
                          : !o->strategy ? "--parallel dp|fsdp|tp"
                                         : NULL;
    if (missing) {
        fprintf(stderr, "aotgrad shard: %s is required\n%s", missing, shard_usage);
        return 2;
    }
    if (o->rank >= o->world) {
        fprintf(stderr, "aotgrad shard: --rank %lld is not a rank of a world of %lld\n", o->rank,
                o->world);
        return 2;
    }
    if (o->format == SH_SVG && !o->out_path) {
        fprintf(stderr, "aotgrad shard: --format svg needs -o FILE\n");
        return 2;
    }
    return 0;
}

/* The joint of the model (its training step for mlp, cnn and gpt2), exported on shapes only. */
static int export_step(const shard_opts *o, ag_joint **joint) {
    bool step = !strcmp(o->model, "mlp") || !strcmp(o->model, "cnn") || !strcmp(o->model, "gpt2");
    bool gpt2 = !strcmp(o->model, "gpt2");
    ag_module *m = NULL;
    ag_tensor *in[4] = {0};
    int nin = 0;
    bool prev = ag_set_meta_mode(true);
    int rc = ag_zoo_build(o->model, o->config, &m, in, 4, &nin);
    if (rc) {
        ag_set_meta_mode(prev);
        fprintf(stderr, "aotgrad shard: %s\n", ag_last_error());
        return rc == AG_EINVAL ? 2 : 1;
    }
    if (step) {
        /* The global batch: the zoo's example input with dim 0 = --batch, and its targets. */
        int64_t sz[AG_MAX_DIMS];
        int nd = ag_tensor_ndim(in[0]);
        memcpy(sz, ag_tensor_sizes(in[0]), sizeof(int64_t) * (size_t)nd);
        if (o->batch)
            sz[0] = o->batch;
        ag_tensor *x = ag_zeros(ag_tensor_dtype(in[0]), nd, sz);
        ag_tensor *y = ag_zeros(AG_I64, gpt2 ? 2 : 1, sz);
        for (int i = 0; i < nin; i++)
            ag_tensor_free(in[i]);
        in[0] = x;
        in[1] = y;
        nin = 2;
        m = cli_train_step_new(m, gpt2);
    }
    *joint = m && in[0] && in[1] ? ag_export_joint(m, in, nin, NULL, NULL, 0, NULL) : NULL;
    ag_set_meta_mode(prev);
    if (!*joint)
        fprintf(stderr, "aotgrad shard: %s: %s\n", o->model, ag_last_error());
    for (int i = 0; i < nin; i++)
        ag_tensor_free(in[i]);
    ag_module_free(m);
    return *joint ? 0 : 1;
}

static int write_graph(const shard_opts *o, const ag_graph *g) {
    char title[200];
    snprintf(title, sizeof title, "%s, rank %lld of %lld, %s", o->model, o->rank, o->world,
             o->strategy);
    ag_dot_opts dopts = {.title = title};
    cli_out out;
    if (o->format == SH_SVG) {
        if (cli_out_open_name(&out, "shard", o->out_path))
            return 1;
        if (ag_graph_write_svg(g, cli_out_name(&out), &dopts)) {
            fprintf(stderr, "aotgrad shard: %s\n", ag_last_error());
            cli_out_discard(&out);
            return 1;
        }
        return cli_out_close(&out);
    }
    char *s = o->format == SH_DOT ? ag_graph_to_dot(g, &dopts) : ag_graph_to_string(g, NULL);
    if (!s) {
        fprintf(stderr, "aotgrad shard: %s\n", ag_last_error());
        return 1;
    }
    int rc = cli_out_open(&out, "shard", o->out_path);
    if (!rc) {
        cli_out_puts(&out, s);
        rc = cli_out_close(&out);
    }
    ag_free(s);
    return rc;
}

int cli_shard(int argc, char **argv) {
    shard_opts o = {0};
    int rc = parse(argc, argv, &o);
    if (rc)
        return rc;
    ag_joint *j = NULL, *local = NULL;
    if ((rc = export_step(&o, &j)))
        return rc;
    ag_mesh mesh = {.size = (int)o.world, .rank = (int)o.rank, .group = "0"};
    ag_shard_plan *plan = ag_shard_plan_strategy_new(o.strategy, j, &mesh);
    local = plan ? ag_shard_joint(j, &mesh, plan) : NULL;
    ag_shard_plan_free(plan);
    ag_joint_free(j);
    ag_shard_summary sum;
    ag_partition_opts po = {.partitioner = AG_PARTITION_MINCUT, .memory_budget = 1.0};
    ag_partition_stats st = {0};
    ag_graph *fw = NULL, *bw = NULL;
    if (!local || ag_shard_summary_get(local, &sum) ||
        ag_partition(ag_joint_graph(local), ag_joint_num_fw_outputs(local), &po, &fw, &bw, &st)) {
        fprintf(stderr, "aotgrad shard: %s %s on %lld ranks: %s\n", o.model, o.strategy, o.world,
                ag_last_error());
        ag_joint_free(local);
        return 1;
    }
    ag_graph_free(fw);
    ag_graph_free(bw);
    rc = write_graph(&o, ag_joint_graph(local));
    /* The summary goes where it does not mix into a graph written to stdout as DOT. */
    FILE *f = o.format == SH_DOT && !o.out_path ? stderr : stdout;
    if (!rc) {
        fprintf(f,
                "per rank: params %lld bytes, optimizer state %lld bytes, saved activations "
                "%lld bytes; communication: %lld bytes in %d collectives per step\n",
                (long long)sum.param_bytes, (long long)sum.optim_bytes, (long long)st.saved_bytes,
                (long long)sum.comm_bytes, sum.ncollectives);
        fprintf(f, "replicated for want of a sharding rule: %s\n",
                sum.nfallback ? sum.fallback_ops : "none");
        fprintf(f, "decomposed to shard: %s\n", sum.ndecomposed ? sum.decomposed_ops : "none");
    }
    ag_joint_free(local);
    return rc;
}
