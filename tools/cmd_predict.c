/* `aotgrad predict MODEL [--config C] --world N[,N...] [--parallel dp|fsdp|tp|all]
 * [--batch B | --batch-per-rank b] [--seq T] [--gflops F] [--mem-gbps M] [--latency S]
 * [--bandwidth B] [--format md|tsv] [-o FILE]`: predicted step time and per-rank memory of a
 * training step on worlds that need not exist, from the graphs one rank would run.
 *
 * For each world size N and strategy the tool does what `aotgrad shard` does (the step joint of
 * mlp, cnn or gpt2 exported in meta mode, the strategy's plan, ag_shard_joint for rank 0 of a
 * virtual mesh of N ranks: no MPI), then partitions the sharded joint with the min-cut
 * partitioner (budget 1, as `train`) and reads the two graphs the rank would run:
 *   compute     every call node but the collectives costs max(flops / F, bytes / M), with the op
 *               table's estimate (ag_op_cost) and F, M the GEMM and memory rates (measured here
 *               unless given: an f32 [1024, 768] @ [768, 3072] mm, and an add of two 64 MiB f32
 *               tensors, each the best of 5 after a warm-up, on this process's threads);
 *   optimizer   AdamW reads parameter, gradient and two moments and writes three of them: 28
 *               bytes per local f32 parameter element at the memory rate;
 *   comm        every collective of the forward and backward graphs (the backward's recomputed
 *               fsdp gathers included), ag_comm_bytes and ag_comm_time of its payload on N ranks
 *               (the calibrated model of dist.h, or --latency / --bandwidth);
 *   step        full overlap: max(compute, comm) + optimizer; no overlap: compute + comm +
 *               optimizer;
 *   memory      local parameters (tied ones once), their gradients, AdamW's two moments, and the
 *               partitioner's peak-memory model of the activations (saved values included).
 * The global batch is B (--batch), or b sequences per rank times N (--batch-per-rank, default 1);
 * for gpt2 each sequence has T tokens (--seq, default the model's context). A strategy that does
 * not apply prints "n/a" and why: dp and fsdp when the global batch does not split among the N
 * ranks, tp on gpt2 when the heads do not, and any strategy the pass refuses.
 *
 * --format md (the default) prints a Markdown table with SI units; tsv prints raw numbers (bytes,
 * seconds, FLOPs), one row per world and strategy, for scripts and tests.
 *
 * Exit status: 0, 1 when the export or a measurement fails, 2 for a usage error. */
#include "cli.h"
#include "partition/partition_internal.h" /* ag__partition_ex: the peak-memory model */
#include "train_dist.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static const char predict_usage[] =
    "usage: aotgrad predict mlp|cnn|gpt2 [--config C] --world N[,N...] "
    "[--parallel dp|fsdp|tp|all] [--batch B | --batch-per-rank b] [--seq T] [--gflops F] "
    "[--mem-gbps M] [--latency S] [--bandwidth B] [--format md|tsv] [-o FILE]\n";

#define MAX_WORLDS 16

typedef struct predict_opts {
    const char *model, *config, *strategy, *out_path;
    long long worlds[MAX_WORLDS];
    int nworlds;
    long long batch, per_rank, seq;
    double gflops, mem_gbps, latency, bandwidth;
    bool tsv;
} predict_opts;

static int parse_worlds(const char *v, predict_opts *o) {
    if (!v) {
        fprintf(stderr, "aotgrad predict: --world needs N[,N...]\n");
        return -1;
    }
    char buf[32];
    for (const char *p = v;;) {
        size_t n = strcspn(p, ",");
        if (o->nworlds == MAX_WORLDS) {
            fprintf(stderr, "aotgrad predict: --world: at most %d sizes\n", MAX_WORLDS);
            return -1;
        }
        snprintf(buf, sizeof buf, "%.*s", (int)(n < sizeof buf ? n : sizeof buf - 1), p);
        if (n >= sizeof buf ||
            cli_int_opt("predict", "--world", buf, 1, 1 << 20, &o->worlds[o->nworlds++]))
            return -1;
        if (!p[n])
            return 0;
        p += n + 1;
    }
}

static int parse(int argc, char **argv, predict_opts *o) {
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int rc = 0;
        if (!strcmp(a, "--world"))
            rc = parse_worlds(v, o), i++;
        else if (!strcmp(a, "--batch"))
            rc = cli_int_opt("predict", "--batch", v, 1, (long long)1 << 30, &o->batch), i++;
        else if (!strcmp(a, "--batch-per-rank"))
            rc = cli_int_opt("predict", "--batch-per-rank", v, 1, 1 << 20, &o->per_rank), i++;
        else if (!strcmp(a, "--seq"))
            rc = cli_int_opt("predict", "--seq", v, 1, 1 << 20, &o->seq), i++;
        else if (!strcmp(a, "--gflops"))
            rc = cli_float_opt("predict", "--gflops", v, 0, true, HUGE_VAL, &o->gflops), i++;
        else if (!strcmp(a, "--mem-gbps"))
            rc = cli_float_opt("predict", "--mem-gbps", v, 0, true, HUGE_VAL, &o->mem_gbps), i++;
        else if (!strcmp(a, "--latency"))
            rc = cli_float_opt("predict", "--latency", v, 0, true, HUGE_VAL, &o->latency), i++;
        else if (!strcmp(a, "--bandwidth"))
            rc = cli_float_opt("predict", "--bandwidth", v, 0, true, HUGE_VAL, &o->bandwidth), i++;
        else if (!strcmp(a, "--parallel") && v &&
                 (!strcmp(v, "dp") || !strcmp(v, "fsdp") || !strcmp(v, "tp") || !strcmp(v, "all")))
            o->strategy = v, i++;
        else if (!strcmp(a, "--config") && v)
            o->config = v, i++;
        else if (!strcmp(a, "-o") && v)
            o->out_path = v, i++;
        else if (!strcmp(a, "--format") && v && (!strcmp(v, "md") || !strcmp(v, "tsv")))
            o->tsv = !strcmp(v, "tsv"), i++;
        else if (a[0] != '-' && !o->model)
            o->model = a;
        else {
            if (!strcmp(a, "--parallel") && v)
                fprintf(stderr,
                        "aotgrad predict: --parallel: expected dp, fsdp, tp or all, got '%s'\n", v);
            else if (!strcmp(a, "--format") && v)
                fprintf(stderr, "aotgrad predict: --format needs md or tsv, got '%s'\n", v);
            else
                fprintf(stderr, "aotgrad predict: bad option '%s'\n", a);
            rc = -1;
        }
        if (rc) {
            fputs(predict_usage, stderr);
            return 2;
        }
    }
    const char *why =
        !o->model                 ? "MODEL is required"
        : !o->nworlds             ? "--world N is required"
        : o->batch && o->per_rank ? "--batch (global) and --batch-per-rank exclude each other"
        : strcmp(o->model, "mlp") && strcmp(o->model, "cnn") && strcmp(o->model, "gpt2")
            ? "MODEL must be mlp, cnn or gpt2 (a model with a training step)"
        : o->seq && strcmp(o->model, "gpt2") ? "--seq applies to gpt2 only"
                                             : NULL;
    if (why) {
        fprintf(stderr, "aotgrad predict: %s\n%s", why, predict_usage);
        return 2;
    }
    for (int i = 0; i < o->nworlds && o->per_rank; i++)
        if (o->per_rank * o->worlds[i] > (long long)1 << 30) {
            fprintf(stderr,
                    "aotgrad predict: --batch-per-rank %lld on %lld ranks is a global batch of "
                    "%lld, above the limit of %lld\n",
                    o->per_rank, o->worlds[i], o->per_rank * o->worlds[i], (long long)1 << 30);
            return 2;
        }
    if (!o->strategy)
        o->strategy = "all";
    if (!o->batch && !o->per_rank)
        o->per_rank = 1;
    return 0;
}

/* ---- rates measured on this machine ---- */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* The best of 5 timed calls of `op` (after one warm-up) on a and b, or -1 on failure. */
static double best_time(ag_tensor *(*op)(ag_tensor *, ag_tensor *), ag_tensor *a, ag_tensor *b) {
    double best = INFINITY;
    for (int r = 0; r < 6; r++) {
        double t0 = now_s();
        ag_tensor *c = op(a, b);
        double t = now_s() - t0;
        if (!c)
            return -1;
        ag_tensor_free(c);
        if (r > 0 && t < best)
            best = t;
    }
    return best;
}

static double measure(bool gemm) {
    int64_t ga[2] = {1024, 768}, gb[2] = {768, 3072}, n = (int64_t)16 << 20;
    ag_tensor *a = gemm ? ag_randn(AG_F32, 2, ga) : ag_randn(AG_F32, 1, &n);
    ag_tensor *b = gemm ? ag_randn(AG_F32, 2, gb) : ag_randn(AG_F32, 1, &n);
    double t = a && b ? best_time(gemm ? ag_mm : ag_add, a, b) : -1;
    ag_tensor_free(a);
    ag_tensor_free(b);
    if (!(t > 0))
        return -1;
    return gemm ? 2.0 * 1024 * 768 * 3072 / t : 3.0 * 4 * (double)n / t;
}

/* ---- the step joint ---- */

/* The GPT-2 configuration --config names (the zoo's names; the export refuses others). */
static ag_gpt2_config gpt2_cfg(const predict_opts *o) {
    if (o->config && !strcmp(o->config, "gpt2-small"))
        return ag_gpt2_config_small();
    if (o->config && !strcmp(o->config, "gpt2-xl"))
        return ag_gpt2_config_xl();
    return ag_gpt2_config_tiny();
}

/* The training step of the model on a global batch of `batch` (and `seq` tokens for gpt2),
 * exported on shapes only; *step keeps the module (its parameters name the tied ones). */
static int export_step(const predict_opts *o, int64_t batch, int64_t seq, ag_module **step,
                       ag_joint **joint) {
    bool gpt2 = !strcmp(o->model, "gpt2");
    ag_module *m = NULL;
    ag_tensor *in[4] = {0};
    int nin = 0;
    bool prev = ag_set_meta_mode(true);
    int rc = ag_zoo_build(o->model, o->config, &m, in, 4, &nin);
    if (rc) {
        ag_set_meta_mode(prev);
        fprintf(stderr, "aotgrad predict: %s\n", ag_last_error());
        return rc == AG_EINVAL ? 2 : 1;
    }
    int64_t sz[AG_MAX_DIMS];
    int nd = ag_tensor_ndim(in[0]);
    memcpy(sz, ag_tensor_sizes(in[0]), sizeof(int64_t) * (size_t)nd);
    sz[0] = batch;
    if (gpt2)
        sz[1] = seq;
    ag_tensor *x = ag_zeros(ag_tensor_dtype(in[0]), nd, sz);
    ag_tensor *y = ag_zeros(AG_I64, gpt2 ? 2 : 1, sz);
    for (int i = 0; i < nin; i++)
        ag_tensor_free(in[i]);
    *step = cli_train_step_new(m, gpt2);
    *joint = *step && x && y ? ag_export_joint(*step, (ag_tensor *[]){x, y}, 2, NULL, NULL, 0, NULL)
                             : NULL;
    ag_set_meta_mode(prev);
    if (!*joint)
        fprintf(stderr, "aotgrad predict: %s: %s\n", o->model, ag_last_error());
    ag_tensor_free(x);
    ag_tensor_free(y);
    if (!*joint) {
        ag_module_free(*step);
        *step = NULL;
        return 1;
    }
    return 0;
}

/* ---- one prediction ---- */

typedef struct rates {
    double flops_ps, mem_Bps; /* GEMM FLOP/s, memory bytes/s */
} rates;

typedef struct prediction {
    char na[256]; /* non-empty: the strategy does not apply, and why */
    double flops, compute_s, optim_s, comm_bytes, comm_s;
    int ncoll;
    int64_t param_bytes, grad_bytes, optim_bytes, act_bytes, saved_bytes;
    int nfallback;
    char fallback_ops[256];
} prediction;

static int64_t meta_bytes(const ag_tmeta *m) {
    int64_t n = 1;
    for (int d = 0; d < m->ndim; d++)
        n *= m->sizes[d];
    return n * (int64_t)ag_dtype_size(m->dtype);
}

static bool is_collective(const ag_node *n) {
    return ag_node_kind_of(n) == AG_NODE_CALL &&
           (ag_op_def(ag_node_op(n))->flags & AG_OP_COLLECTIVE);
}

/* Compute and communication of one graph the rank runs (the forward or the backward). */
static int cost_graph(const ag_graph *g, int world, const rates *r, prediction *p) {
    for (ag_node *n = ag_graph_first(g); n; n = ag_node_next(n)) {
        if (ag_node_kind_of(n) != AG_NODE_CALL)
            continue;
        const char *op = ag_op_name(ag_node_op(n));
        if (is_collective(n)) {
            if (strstr(op, "wait_tensor"))
                continue;
            /* The payload: all_gather's output, every other collective's input. */
            ag_node *in = ag_node_arg_node(n, 0);
            bool gather = strstr(op, "all_gather") != NULL;
            double b = (double)meta_bytes(gather || !in ? ag_node_val(n, 0) : ag_node_val(in, 0));
            p->comm_bytes += ag_comm_bytes(op, b, world);
            p->comm_s += ag_comm_time(op, b, world);
            p->ncoll++;
            continue;
        }
        ag_cost c;
        int rc = ag__node_cost(n, &c);
        if (rc)
            return rc;
        p->flops += c.flops;
        p->compute_s += fmax(c.flops / r->flops_ps, c.bytes / r->mem_Bps);
    }
    return 0;
}

/* Local parameter and buffer bytes of the sharded joint, each module tensor once (GPT-2's
 * lm_head.weight is transformer.wte.weight: two placeholders, one tensor). */
static int local_state(const ag_joint *local, ag_module *step, prediction *p) {
    ag_node **ph = NULL;
    int n = ag_graph_placeholders(ag_joint_graph(local), &ph);
    if (n < 0)
        return n;
    const ag_tensor **seen = malloc(sizeof *seen * (size_t)(n + 1));
    if (!seen)
        return ag_set_error(AG_ENOMEM, "predict: out of memory");
    int nseen = 0;
    for (int i = 0; i < n; i++) {
        const ag_desc *d = ag_node_desc(ph[i]);
        bool param = ag_desc_is_param(d);
        if (!param && !ag_desc_is_buffer(d))
            continue;
        const char *fqn = ag_desc_target(d);
        const ag_tensor *t = param ? ag_module_param(step, fqn) : ag_module_buffer(step, fqn);
        bool dup = false;
        for (int k = 0; k < nseen && !dup; k++)
            dup = seen[k] == t;
        if (dup)
            continue;
        seen[nseen++] = t;
        int64_t b = meta_bytes(ag_node_val(ph[i], 0));
        p->param_bytes += b;
        if (param)
            p->grad_bytes += b;
    }
    free(seen);
    p->optim_bytes = 2 * p->grad_bytes;
    return 0;
}

/* Writes reason into p->na with its newlines flattened. */
static void not_applicable(prediction *p, const char *reason) {
    snprintf(p->na, sizeof p->na, "%s", reason);
    for (char *c = p->na; *c; c++)
        if (*c == '\n' || *c == '\t' || *c == '|')
            *c = ' ';
}

static int predict_one(const predict_opts *o, const ag_joint *j, ag_module *step, int world,
                       int64_t batch, const char *strategy, const rates *r, prediction *p) {
    memset(p, 0, sizeof *p);
    char why[256];
    bool gpt2 = !strcmp(o->model, "gpt2");
    ag_gpt2_config gc = gpt2_cfg(o);
    if (strcmp(strategy, "tp") && batch % world) {
        snprintf(why, sizeof why, "the global batch of %lld does not split among %d ranks",
                 (long long)batch, world);
        not_applicable(p, why);
        return 0;
    }
    if (!strcmp(strategy, "tp") && gpt2 && gc.n_head % world) {
        snprintf(why, sizeof why, "tp splits heads: %lld heads do not split among %d ranks",
                 (long long)gc.n_head, world);
        not_applicable(p, why);
        return 0;
    }
    ag_mesh mesh = {.size = world, .rank = 0, .group = "0"};
    ag_shard_plan *plan = ag_shard_plan_strategy_new(strategy, j, &mesh);
    ag_joint *local = plan ? ag_shard_joint(j, &mesh, plan) : NULL;
    ag_shard_plan_free(plan);
    if (!local) {
        not_applicable(p, ag_last_error());
        return 0;
    }
    ag_shard_summary sum;
    ag_partition_opts po = {.partitioner = AG_PARTITION_MINCUT, .memory_budget = 1.0};
    ag_partition_stats st;
    ag__peak pk;
    ag_graph *fw = NULL, *bw = NULL;
    int rc = ag_shard_summary_get(local, &sum);
    if (!rc)
        rc = ag__partition_ex(ag_joint_graph(local), ag_joint_num_fw_outputs(local), &po,
                              AG__BUDGET_PEAK, &fw, &bw, &st, &pk);
    if (!rc)
        rc = cost_graph(fw, world, r, p);
    if (!rc)
        rc = cost_graph(bw, world, r, p);
    if (!rc)
        rc = local_state(local, step, p);
    if (rc)
        fprintf(stderr, "aotgrad predict: %s %s on %d ranks: %s\n", o->model, strategy, world,
                ag_last_error());
    ag_graph_free(fw);
    ag_graph_free(bw);
    ag_joint_free(local);
    if (rc)
        return 1;
    p->act_bytes = pk.peak;
    p->saved_bytes = pk.saved;
    p->optim_s = 7.0 * (double)p->grad_bytes / r->mem_Bps;
    p->nfallback = sum.nfallback;
    snprintf(p->fallback_ops, sizeof p->fallback_ops, "%s", sum.fallback_ops);
    return 0;
}

/* ---- output ---- */

/* bytes with an SI prefix: "1.23 GB". */
static const char *si(double v, const char *unit, char *buf, size_t n) {
    static const char *const pre[] = {"", "k", "M", "G", "T", "P"};
    int k = 0;
    while (fabs(v) >= 1000 && k < 5)
        v /= 1000, k++;
    snprintf(buf, n, "%.3g %s%s", v, pre[k], unit);
    return buf;
}

static void print_header(cli_out *out, const predict_opts *o, ag_module *step, const rates *r,
                         bool measured_f, bool measured_m, int64_t seq) {
    ag_comm_model cm;
    ag_comm_model_get(&cm);
    char b1[32], b2[32];
    if (o->tsv) {
        cli_out_printf(out,
                       "# %s%s%s: gflops %.6g, mem_gbps %.6g, latency_s %.6g, bandwidth_Bps %.6g\n",
                       o->model, o->config ? " " : "", o->config ? o->config : "",
                       r->flops_ps / 1e9, r->mem_Bps / 1e9, cm.latency_s, cm.bandwidth_Bps);
        cli_out_puts(out, "world\tstrategy\tbatch\tflops\tcompute_s\toptim_s\tcomm_bytes\t"
                          "collectives\tcomm_s\tstep_overlap_s\tstep_serial_s\tparam_bytes\t"
                          "grad_bytes\toptim_bytes\tact_bytes\tsaved_bytes\ttotal_bytes\t"
                          "fallback\tnote\n");
        return;
    }
    cli_out_printf(
        out, "%s%s%s: %s parameters", o->model, o->config ? " " : "", o->config ? o->config : "",
        si((double)ag_module_num_parameters(ag_module_child(step, "model")), "", b1, sizeof b1));
    if (seq)
        cli_out_printf(out, ", %lld tokens per sequence", (long long)seq);
    if (o->batch)
        cli_out_printf(out, ", global batch %lld\n", o->batch);
    else
        cli_out_printf(out, ", global batch %lld per rank x world size\n", o->per_rank);
    cli_out_printf(out,
                   "compute: GEMM %s (%s), memory %s (%s), %d threads; each node takes "
                   "max(FLOPs / GEMM rate, bytes / memory rate)\n",
                   si(r->flops_ps, "FLOP/s", b1, sizeof b1),
                   measured_f ? "measured: f32 mm [1024, 768] @ [768, 3072], best of 5" : "given",
                   si(r->mem_Bps, "B/s", b2, sizeof b2),
                   measured_m ? "measured: add of two 64 MiB f32 tensors, best of 5" : "given",
                   ag_get_num_threads());
    cli_out_printf(out,
                   "communication: latency %.3g s per ring step, bandwidth %s per rank "
                   "(ag_comm_model)\n\n",
                   cm.latency_s, si(cm.bandwidth_Bps, "B/s", b1, sizeof b1));
    cli_out_puts(out, "| world | strategy | global batch | FLOPs per rank | compute | optimizer | "
                      "sent per rank | collectives | communication | step (overlap .. none) | "
                      "params | grads | AdamW state | activations | memory per rank |\n");
    cli_out_puts(out,
                 "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|\n");
}

static void print_row(cli_out *out, bool tsv, int world, const char *strategy, int64_t batch,
                      const prediction *p) {
    double step_lo = fmax(p->compute_s, p->comm_s) + p->optim_s;
    double step_hi = p->compute_s + p->comm_s + p->optim_s;
    int64_t total = p->param_bytes + p->grad_bytes + p->optim_bytes + p->act_bytes;
    if (tsv) {
        if (p->na[0]) {
            cli_out_printf(out, "%d\t%s\t%lld", world, strategy, (long long)batch);
            for (int i = 0; i < 15; i++)
                cli_out_puts(out, "\tn/a");
            cli_out_printf(out, "\tn/a: %s\n", p->na);
            return;
        }
        cli_out_printf(
            out,
            "%d\t%s\t%lld\t%.17g\t%.17g\t%.17g\t%.17g\t%d\t%.17g\t%.17g\t%.17g\t%lld\t%lld\t%"
            "lld\t%lld\t%lld\t%lld\t%d\t%s\n",
            world, strategy, (long long)batch, p->flops, p->compute_s, p->optim_s, p->comm_bytes,
            p->ncoll, p->comm_s, step_lo, step_hi, (long long)p->param_bytes,
            (long long)p->grad_bytes, (long long)p->optim_bytes, (long long)p->act_bytes,
            (long long)p->saved_bytes, (long long)total, p->nfallback,
            p->nfallback ? p->fallback_ops : "");
        return;
    }
    if (p->na[0]) {
        cli_out_printf(out, "| %d | %s | %lld | n/a: %s |||||||||||\n", world, strategy,
                       (long long)batch, p->na);
        return;
    }
    char b[10][32];
    cli_out_printf(out,
                   "| %d | %s | %lld | %s | %.3g s | %.3g s | %s | %d | %.3g s | %.3g .. %.3g s | "
                   "%s | %s | %s | %s | %s |\n",
                   world, strategy, (long long)batch, si(p->flops, "", b[0], 32), p->compute_s,
                   p->optim_s, si(p->comm_bytes, "B", b[1], 32), p->ncoll, p->comm_s, step_lo,
                   step_hi, si((double)p->param_bytes, "B", b[2], 32),
                   si((double)p->grad_bytes, "B", b[3], 32),
                   si((double)p->optim_bytes, "B", b[4], 32),
                   si((double)p->act_bytes, "B", b[5], 32), si((double)total, "B", b[6], 32));
}

int cli_predict(int argc, char **argv) {
    predict_opts o = {0};
    int rc = parse(argc, argv, &o);
    if (rc)
        return rc;
    if (o.latency || o.bandwidth) {
        ag_comm_model cm;
        ag_comm_model_get(&cm);
        if (o.latency)
            cm.latency_s = o.latency;
        if (o.bandwidth)
            cm.bandwidth_Bps = o.bandwidth;
        ag_comm_model_set(&cm); /* both positive and finite: the parser checked */
    }
    rates r = {o.gflops * 1e9, o.mem_gbps * 1e9};
    if (!o.gflops && !((r.flops_ps = measure(true)) > 0)) {
        fprintf(stderr, "aotgrad predict: measuring the GEMM rate: %s\n", ag_last_error());
        return 1;
    }
    if (!o.mem_gbps && !((r.mem_Bps = measure(false)) > 0)) {
        fprintf(stderr, "aotgrad predict: measuring the memory rate: %s\n", ag_last_error());
        return 1;
    }
    static const char *const all[] = {"dp", "fsdp", "tp"};
    const char *const *strategies = strcmp(o.strategy, "all") ? &o.strategy : all;
    int nstrat = strcmp(o.strategy, "all") ? 1 : 3;
    cli_out out;
    if (cli_out_open(&out, "predict", o.out_path))
        return 1;
    char fallbacks[4096] = "";
    size_t nfb = 0;
    for (int w = 0; w < o.nworlds && !rc; w++) {
        int world = (int)o.worlds[w];
        int64_t batch = o.batch ? o.batch : o.per_rank * world;
        ag_module *step = NULL;
        ag_joint *j = NULL;
        int64_t seq = strcmp(o.model, "gpt2") ? 0 : o.seq ? o.seq : gpt2_cfg(&o).block_size;
        if ((rc = export_step(&o, batch, seq ? seq : 1, &step, &j)))
            break;
        if (w == 0)
            print_header(&out, &o, step, &r, !o.gflops, !o.mem_gbps, seq);
        for (int s = 0; s < nstrat && !rc; s++) {
            prediction p;
            rc = predict_one(&o, j, step, world, batch, strategies[s], &r, &p);
            if (rc)
                break;
            print_row(&out, o.tsv, world, strategies[s], batch, &p);
            if (!o.tsv && !p.na[0] && p.nfallback && nfb < sizeof fallbacks)
                nfb +=
                    (size_t)snprintf(fallbacks + nfb, sizeof fallbacks - nfb,
                                     "%s on %d ranks: %s\n", strategies[s], world, p.fallback_ops);
        }
        ag_joint_free(j);
        ag_module_free(step);
    }
    if (!rc && fallbacks[0])
        cli_out_printf(&out, "\nreplicated for want of a sharding rule:\n%s", fallbacks);
    if (rc) {
        cli_out_discard(&out);
        return rc;
    }
    return cli_out_close(&out);
}
