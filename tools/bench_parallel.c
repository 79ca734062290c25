/* `aotgrad bench --parallel`: distributed training steps, N ranks x 1 thread against 1 rank x N
 * threads on the same cores (docs/PERFORMANCE.md, "Issue 14: distributed steps", records a run).
 *
 *   aotgrad bench --parallel [MODEL...] [STRATEGY...] [--np N] [--runs N] [--warmup N]
 *                 [--seed S] [--json FILE] [--mpirun PATH]
 *
 * MODEL is mlp (the zoo's 784-256-128-10 MLP, batch 128, x ~ N(0, 1)), gpt2 (the tiny
 * character-level GPT-2 of `aotgrad train --model gpt2`: 2 layers, 64 wide, 4 heads, B 16 x
 * T 64, uniform random tokens) or cnn (the zoo's cnn, batch 128, x ~ U[0, 1)); STRATEGY is dp,
 * fsdp or tp. Without any, all of them. Targets are uniform random classes; the global batch is
 * the same on every rank and in the reference (one batch, reused every step).
 *
 * One command runs both halves. Started without mpirun, the bench first times the reference in
 * this process: the compiled step of the whole model with N threads (--np, default 2), as
 * `aotgrad train` runs it. Then it runs itself under MPI,
 *   mpirun --oversubscribe -np N <this aotgrad> bench --parallel ... --ranks-out TMPFILE
 * (--mpirun PATH names another launcher; the ranks get OMP_NUM_THREADS=1, and OpenMPI's two
 * run-as-root variables when run as root), whose rank 0 writes the N-rank rows to TMPFILE, and
 * prints both halves in one table. Started under mpirun by the user (any world: one machine or
 * a hostfile's), it times that world's sharded steps only, with the threads the ranks were given,
 * and prints no reference.
 *
 * Each row, on every rank: the step module built from the seed, exported as one joint for the
 * global batch, the strategy's plan (ag_shard_plan_strategy_new; for dp also with
 * ag_shard_plan_set_no_overlap, the "overlap off" row), this rank's sharded joint compiled and
 * called through train_dist.c as `aotgrad train --parallel` does, then backward and AdamW over
 * the local pieces. After --warmup steps, --runs timed steps each start after a barrier; a
 * step's time is the slowest rank's, and the row reports their median.
 *
 * Communication, read from ag_comm_stats (dist.h) around the timed steps:
 *   bytes/step   what one rank sent per step (the mean over ranks)
 *   hidden       1 - sum(wait_s) / sum(busy_s) over all ranks and timed steps, where busy_s runs
 *                from each collective's start to its completion and wait_s is the time blocked in
 *                wait_tensor: 1 means every collective completed behind computation, 0 means the
 *                step waited for all of it
 * and compared with the least any implementation of the strategy must send per rank and step,
 * on N ranks with P the bytes of the model's parameters (tied ones once, fp32):
 *   dp    2(N-1)/N x P   a ring all_reduce of the gradients
 *   fsdp  (N-1)/N x (2P + Pb)   all_gather of the parameters in the forward, reduce_scatter of
 *                        the gradients, and all_gather again in the backward of the Pb bytes of
 *                        parameters the backward reads (a backward node of the unsharded joint
 *                        uses them or a view of them): a Linear's bias, or the weight of a
 *                        Linear whose input is a user input, is not needed there. 3(N-1)/N x P
 *                        when the backward reads every parameter.
 *   tp    2(N-1)/N x A   Megatron's all_reduces of activations: A sums, over the row-parallel
 *                        Linears (weight Shard(1)), their output's bytes (one all_reduce in the
 *                        forward), and over the column-parallel Linears (weight Shard(0) or
 *                        StridedShard(0, k)), their input's bytes (one all_reduce of its gradient
 *                        in the backward) unless that input is a user input, which needs no
 *                        gradient; the shapes are read from the unsharded joint and the plan.
 *
 * Exit status: 0, 1 when a step or the MPI run fails, 2 for a usage error. */
#include "bench_env.h"
#include "cli.h"
#include "train_dist.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define NMODELS 3
#define NSTRATS 3
#define MAXROWS (NMODELS * (NSTRATS + 1))

static const char *const model_names[NMODELS] = {"mlp", "gpt2", "cnn"};
static const char *const strat_names[NSTRATS] = {"dp", "fsdp", "tp"};

static const char formula_dp[] = "2(N-1)/N x P (ring all_reduce of the gradients)";
static const char formula_fsdp[] =
    "(N-1)/N x (2P + Pb) (all_gather of the parameters in the forward, reduce_scatter of the "
    "gradients, all_gather again in the backward of the Pb bytes of parameters the backward "
    "reads)";
static const char formula_tp[] =
    "2(N-1)/N x A, A = output bytes of the row-parallel Linears (forward all_reduce) + input "
    "bytes of the column-parallel Linears not reading a user input (backward all_reduce)";
static const char formula_hidden[] =
    "1 - sum(wait_s) / sum(busy_s) over ranks and timed steps (ag_comm_stats: busy_s from each "
    "collective's start to its completion, wait_s blocked in wait_tensor)";

typedef struct popts {
    bool model[NMODELS], strat[NSTRATS];
    int np, runs, warmup;
    unsigned long long seed;
    const char *json, *mpirun, *ranks_out;
} popts;

/* One timed configuration: the reference (strategy NULL) or a sharded step. */
typedef struct prow {
    char model[16], strategy[16];
    bool overlap;
    int ranks, threads;
    double step_s, final_loss;
    double bytes, min_bytes, collectives; /* per rank and step; min_bytes < 0: unknown */
    double wait_s, busy_s;                /* per rank and step */
} prow;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static void note(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void note(const char *fmt, ...) {
    va_list ap;
    fflush(stdout);
    fprintf(stderr, "aotgrad bench: ");
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
}

/* ---- the cases ---- */

typedef struct pcase {
    const char *name;
    ag_module *step;
    ag_tensor *in[2];
    double lr, beta2, wd; /* AdamW as `aotgrad train` sets it (beta1 0.9, eps 1e-8) */
} pcase;

static void case_free(pcase *pc) {
    ag_module_free(pc->step);
    ag_tensor_free(pc->in[0]);
    ag_tensor_free(pc->in[1]);
    memset(pc, 0, sizeof *pc);
}

/* Uniform integers in [0, k) from a 64-bit LCG, as an i64 tensor. */
static ag_tensor *lcg_ints(int ndim, const int64_t *sizes, int64_t k, uint64_t *state) {
    int64_t n = 1;
    for (int d = 0; d < ndim; d++)
        n *= sizes[d];
    int64_t *v = malloc(sizeof *v * (size_t)n);
    if (!v) {
        ag_set_error(AG_ENOMEM, "bench: out of memory");
        return NULL;
    }
    for (int64_t i = 0; i < n; i++) {
        *state = *state * 6364136223846793005ull + 1442695040888963407ull;
        v[i] = (int64_t)((*state >> 33) % (uint64_t)k);
    }
    ag_tensor *t = ag_from_data(AG_I64, ndim, sizes, v);
    free(v);
    return t;
}

/* The model `which` from the seed, its training step module and its global batch; the same on
 * every rank. 0 or a negative status. */
static int case_build(pcase *pc, int which, uint64_t seed) {
    memset(pc, 0, sizeof *pc);
    pc->name = model_names[which];
    bool gpt2 = which == 1;
    ag_manual_seed(seed);
    ag_module *model = NULL;
    if (gpt2) {
        ag_gpt2_config cfg = ag_gpt2_config_tiny();
        model = ag_nn_gpt2(&cfg);
    } else {
        ag_tensor *zin[8];
        int nz = 0;
        if (ag_zoo_build(pc->name, NULL, &model, zin, 8, &nz))
            model = NULL;
        for (int i = 0; i < nz; i++)
            ag_tensor_free(zin[i]);
    }
    if (!model || !(pc->step = cli_train_step_new(model, gpt2)))
        return ag_last_status() ? ag_last_status() : AG_ENOMEM;
    uint64_t rng = seed * 2654435761u + 11;
    if (gpt2) {
        ag_gpt2_config cfg = ag_gpt2_config_tiny();
        int64_t bt[2] = {16, cfg.block_size};
        pc->in[0] = lcg_ints(2, bt, cfg.vocab_size, &rng);
        pc->in[1] = lcg_ints(2, bt, cfg.vocab_size, &rng);
        pc->lr = 3e-3, pc->beta2 = 0.95, pc->wd = 0.1;
    } else {
        int64_t B = 128;
        pc->in[0] = which == 0 ? ag_randn(AG_F32, 2, (int64_t[]){B, 784})
                               : ag_rand(AG_F32, 4, (int64_t[]){B, 1, 28, 28});
        pc->in[1] = lcg_ints(1, &B, 10, &rng);
        pc->lr = 2e-3, pc->beta2 = 0.999, pc->wd = 0.01;
    }
    return pc->in[0] && pc->in[1] ? 0 : ag_last_status();
}

/* The step joint for the global batch, captured from data-less inputs of the batch's shapes. */
static ag_joint *case_export(const pcase *pc) {
    ag_tensor *ex[2];
    bool meta = ag_set_meta_mode(true);
    for (int i = 0; i < 2; i++)
        ex[i] = ag_zeros(ag_tensor_dtype(pc->in[i]), ag_tensor_ndim(pc->in[i]),
                         ag_tensor_sizes(pc->in[i]));
    ag_set_meta_mode(meta);
    ag_joint *j = ex[0] && ex[1] ? ag_export_joint(pc->step, ex, 2, NULL, NULL, 0, NULL) : NULL;
    ag_tensor_free(ex[0]);
    ag_tensor_free(ex[1]);
    return j;
}

/* ---- the theoretical minimum ---- */

static bool is_op(const ag_node *n, const char *name) {
    return n && ag_node_kind_of(n) == AG_NODE_CALL && !strcmp(ag_op_name(ag_node_op(n)), name);
}

static double val_bytes(const ag_tmeta *m) {
    double n = (double)ag_dtype_size(m->dtype);
    for (int d = 0; d < m->ndim; d++)
        n *= (double)m->sizes[d];
    return n;
}

/* The Linear that multiplies by weight placeholder w: the first addmm(bias, x, t(w)) or
 * mm(x, t(w)) in graph order (the forward's); *x its activation argument. NULL when none. */
static const ag_node *linear_of(const ag_node *w, const ag_node **x) {
    const ag_node *best = NULL;
    for (int i = 0; i < ag_node_num_users(w); i++) {
        const ag_node *t = ag_node_user(w, i);
        if (!is_op(t, "t"))
            continue;
        for (int k = 0; k < ag_node_num_users(t); k++) {
            const ag_node *mm = ag_node_user(t, k);
            int xa = is_op(mm, "addmm") && ag_node_arg_node(mm, 2) == t ? 1
                     : is_op(mm, "mm") && ag_node_arg_node(mm, 1) == t  ? 0
                                                                        : -1;
            if (xa >= 0 && (!best || ag_node_index(mm) < ag_node_index(best))) {
                best = mm;
                *x = ag_node_arg_node(mm, xa);
            }
        }
    }
    return best && *x ? best : NULL;
}

/* Whether x is a user input, seen through views. */
static bool is_user_input(const ag_node *x) {
    while (x && ag_node_kind_of(x) == AG_NODE_CALL &&
           (ag_op_def(ag_node_op(x))->flags & AG_OP_VIEW))
        x = ag_node_arg_node(x, 0);
    const ag_desc *d = x && ag_node_kind_of(x) == AG_NODE_PLACEHOLDER ? ag_node_desc(x) : NULL;
    return d && ag_desc_kind_of(d) == AG_DESC_PLAIN_INPUT;
}

static bool is_backward(const ag_node *n) {
    const char *tag = ag_node_partitioner_tag(n);
    return tag && !strcmp(tag, "is_backward");
}

/* Whether the backward reads the parameter p: a backward node uses p or a forward view of it. */
static bool backward_reads(const ag_node *p) {
    for (int i = 0; i < ag_node_num_users(p); i++) {
        const ag_node *u = ag_node_user(p, i);
        if (is_backward(u))
            return true;
        if (ag_node_kind_of(u) == AG_NODE_CALL && ag_node_arg_node(u, 0) == p &&
            (ag_op_def(ag_node_op(u))->flags & AG_OP_VIEW) && backward_reads(u))
            return true;
    }
    return false;
}

/* The minimum bytes one rank sends per step under the strategy (the formulas above), from the
 * unsharded joint j and the plan; -1 when a tp weight's Linear is not recognized. */
static double min_bytes(const ag_joint *j, const ag_shard_plan *plan, const ag_module *step,
                        const char *strategy, int n) {
    double P = 4.0 * (double)ag_module_num_parameters(step), f = (double)(n - 1) / n;
    ag_node **ph;
    int nph = ag_graph_placeholders(ag_joint_graph(j), &ph);
    if (!strcmp(strategy, "dp"))
        return 2 * f * P;
    if (!strcmp(strategy, "fsdp")) {
        double Pb = 0; /* the parameters the backward reads (tied ones once) */
        const ag_tensor *seen[1024];
        int nseen = 0;
        for (int i = 0; i < nph; i++) {
            const ag_desc *d = ag_node_desc(ph[i]);
            if (!d || ag_desc_kind_of(d) != AG_DESC_PARAM || !backward_reads(ph[i]))
                continue;
            const ag_tensor *t = ag_module_param(step, ag_desc_target(d));
            bool dup = false;
            for (int k = 0; k < nseen && !dup; k++)
                dup = seen[k] == t;
            if (dup)
                continue;
            if (nseen < 1024)
                seen[nseen++] = t;
            Pb += val_bytes(ag_node_val(ph[i], 0));
        }
        return f * (2 * P + Pb);
    }
    double A = 0;
    for (int i = 0; i < nph; i++) {
        const ag_desc *d = ag_node_desc(ph[i]);
        ag_placement pl;
        if (!d || ag_desc_kind_of(d) != AG_DESC_PARAM || !ag_shard_plan_get(plan, d, &pl) ||
            pl.kind != AG_SHARD || ag_node_val(ph[i], 0)->ndim != 2)
            continue; /* replicated: the same gradient on every rank, nothing to send */
        const ag_node *x = NULL, *mm = linear_of(ph[i], &x);
        if (!mm)
            return -1;
        if (pl.dim == 1)
            A += val_bytes(ag_node_val(mm, 0)); /* row-parallel: its output */
        else if (!is_user_input(x))
            A += val_bytes(ag_node_val(x, 0)); /* column-parallel: its input's gradient */
    }
    return 2 * f * A;
}

/* ---- timing ---- */

static const ag_compile_opts compile_opts = {
    .partition = {.partitioner = AG_PARTITION_MINCUT, .memory_budget = 1.0}};

/* One training step, as `aotgrad train` runs it: the compiled forward (of the whole model, c,
 * or of this rank's shard, d), backward, AdamW, zero_grad. 0 with *loss_v, or a negative
 * status. */
static int train_step(pcase *pc, ag_compiled *c, dist_train *d, ag_optim *opt, double *loss_v) {
    ag_scope_begin();
    ag_tensor *loss = NULL;
    int rc = d ? dist_train_call(d, pc->in, 2, &loss)
               : ag_compiled_call_module(c, pc->step, pc->in, 2, &loss, 1);
    if (rc == 1) {
        *loss_v = ag_tensor_item(loss);
        rc = isfinite(*loss_v) ? ag_backward(loss, NULL, false)
                               : ag_set_error(AG_EINVAL, "bench: the loss is %g", *loss_v);
    } else if (rc >= 0) {
        rc = ag_set_error(AG_EINVAL, "bench: the step returned %d outputs, not 1", rc);
    }
    if (!rc)
        rc = ag_optim_step(opt);
    ag_optim_zero_grad(opt);
    ag_scope_end();
    return rc;
}

/* The reference: the whole model's compiled step in this process. 0 or a negative status. */
static int run_reference(int which, const popts *o, prow *r) {
    pcase pc;
    int rc = case_build(&pc, which, o->seed);
    ag_joint *j = rc ? NULL : case_export(&pc);
    ag_compiled *c = j ? ag_compile_joint(j, &compile_opts) : NULL;
    ag_optim *opt = c ? ag_optim_adamw(pc.step, pc.lr, 0.9, pc.beta2, 1e-8, pc.wd) : NULL;
    double *times = calloc((size_t)o->runs, sizeof *times);
    if (!rc && !opt)
        rc = ag_last_status() ? ag_last_status() : AG_ENOMEM;
    if (!rc && !times)
        rc = ag_set_error(AG_ENOMEM, "bench: out of memory");
    for (int s = 0; !rc && s < o->warmup + o->runs; s++) {
        double t0 = now_s();
        rc = train_step(&pc, c, NULL, opt, &r->final_loss);
        if (s >= o->warmup)
            times[s - o->warmup] = now_s() - t0;
    }
    if (!rc) {
        snprintf(r->model, sizeof r->model, "%s", model_names[which]);
        r->ranks = 1;
        r->threads = ag_get_num_threads();
        r->step_s = median(times, o->runs);
    }
    free(times);
    ag_optim_free(opt);
    ag_compiled_free(c);
    ag_joint_free(j);
    case_free(&pc);
    return rc;
}

/* One sharded row on this world. A collective: every rank runs the same rows in the same
 * order. 0 or a negative status (the caller ends the job: a peer may wait in a collective). */
static int run_sharded(int which, int strat, bool overlap, const popts *o, prow *r) {
    pcase pc;
    ag_mesh mesh;
    ag_shard_plan *plan = NULL;
    dist_train *d = NULL;
    ag_optim *opt = NULL;
    ag_tensor *const *params = NULL;
    int rc = ag_mesh_world(&mesh);
    if (!rc)
        rc = case_build(&pc, which, o->seed);
    else
        memset(&pc, 0, sizeof pc);
    ag_joint *j = rc ? NULL : case_export(&pc);
    if (j && (plan = ag_shard_plan_strategy_new(strat_names[strat], j, &mesh)) && !overlap)
        ag_shard_plan_set_no_overlap(plan, true);
    if (plan)
        d = dist_train_new_plan(j, pc.step, plan, &compile_opts);
    if (d) {
        int np = dist_train_params(d, &params);
        opt = ag_optim_adamw_tensors(params, np, pc.lr, 0.9, pc.beta2, 1e-8, pc.wd);
    }
    double *times = calloc((size_t)o->runs + 1, sizeof *times);
    if (!rc && !opt)
        rc = ag_last_status() ? ag_last_status() : AG_ENOMEM;
    if (!rc && !times)
        rc = ag_set_error(AG_ENOMEM, "bench: out of memory");
    if (!rc)
        r->min_bytes = min_bytes(j, plan, pc.step, strat_names[strat], mesh.size);
    for (int s = 0; !rc && s < o->warmup; s++)
        rc = train_step(&pc, NULL, d, opt, &r->final_loss);
    double tot[4] = {0}; /* bytes, collectives, wait_s, busy_s */
    for (int s = 0; !rc && s < o->runs; s++) {
        ag_comm_stats a, b;
        rc = ag_group_barrier(ag_dist_world());
        ag_comm_stats_get(&a);
        double t0 = now_s();
        if (!rc)
            rc = train_step(&pc, NULL, d, opt, &r->final_loss);
        times[s] = now_s() - t0;
        ag_comm_stats_get(&b);
        tot[0] += (double)(b.bytes_sent - a.bytes_sent);
        tot[1] += (double)(b.collectives - a.collectives);
        tot[2] += b.wait_s - a.wait_s;
        tot[3] += b.busy_s - a.busy_s;
    }
    /* The slowest rank's time for each step; the sums over ranks. */
    if (!rc && mesh.size > 1) {
        ag_scope_begin();
        ag_tensor *mx = ag_wait_tensor(
            ag_all_reduce(ag_from_data(AG_F64, 1, (int64_t[]){o->runs}, times), "max", mesh.group));
        ag_tensor *sum = ag_wait_tensor(
            ag_all_reduce(ag_from_data(AG_F64, 1, (int64_t[]){4}, tot), "sum", mesh.group));
        if (!mx || !sum)
            rc = ag_last_status() ? ag_last_status() : AG_ENOMEM;
        for (int s = 0; !rc && s < o->runs; s++)
            times[s] = ag_tensor_item_at(mx, s);
        for (int k = 0; !rc && k < 4; k++)
            tot[k] = ag_tensor_item_at(sum, k);
        ag_scope_end();
    }
    if (!rc) {
        snprintf(r->model, sizeof r->model, "%s", model_names[which]);
        snprintf(r->strategy, sizeof r->strategy, "%s", strat_names[strat]);
        r->overlap = overlap;
        r->ranks = mesh.size;
        r->threads = ag_get_num_threads();
        r->step_s = median(times, o->runs);
        double per = (double)mesh.size * o->runs;
        r->bytes = tot[0] / per;
        r->collectives = tot[1] / per;
        r->wait_s = tot[2] / per;
        r->busy_s = tot[3] / per;
    }
    free(times);
    ag_optim_free(opt);
    dist_train_free(d);
    ag_shard_plan_free(plan);
    ag_joint_free(j);
    case_free(&pc);
    return rc;
}

/* ---- output ---- */

static json_t *jnum(double v) {
    return isfinite(v) ? json_real(v) : json_null();
}

static double hidden_of(const prow *r) {
    return r->busy_s > 0 ? 1 - r->wait_s / r->busy_s : NAN;
}

static json_t *row_json(const prow *r, const prow *ref) {
    json_t *o = json_object();
    json_object_set_new(o, "model", json_string(r->model));
    json_object_set_new(o, "ranks", json_integer(r->ranks));
    json_object_set_new(o, "threads_per_rank", json_integer(r->threads));
    json_object_set_new(o, "step_s", jnum(r->step_s));
    json_object_set_new(o, "final_loss", jnum(r->final_loss));
    if (!r->strategy[0])
        return o;
    json_object_set_new(o, "strategy", json_string(r->strategy));
    json_object_set_new(o, "overlap", json_boolean(r->overlap));
    json_object_set_new(o, "step_over_reference",
                        ref ? jnum(r->step_s / ref->step_s) : json_null());
    json_object_set_new(o, "bytes_per_step", jnum(r->bytes));
    json_object_set_new(o, "min_bytes_per_step",
                        r->min_bytes >= 0 ? jnum(r->min_bytes) : json_null());
    json_object_set_new(o, "bytes_over_min",
                        r->min_bytes > 0 ? jnum(r->bytes / r->min_bytes) : json_null());
    json_object_set_new(o, "collectives_per_step", jnum(r->collectives));
    json_object_set_new(o, "wait_s_per_step", jnum(r->wait_s));
    json_object_set_new(o, "busy_s_per_step", jnum(r->busy_s));
    json_object_set_new(o, "hidden_fraction", jnum(hidden_of(r)));
    return o;
}

static double jget(const json_t *o, const char *k) {
    const json_t *v = json_object_get(o, k);
    return json_is_number(v) ? json_number_value(v) : NAN;
}

/* A row written by the ranks' run (row_json). 0, or -1 when a field is missing. */
static int row_parse(const json_t *o, prow *r) {
    memset(r, 0, sizeof *r);
    const char *m = json_string_value(json_object_get(o, "model"));
    const char *s = json_string_value(json_object_get(o, "strategy"));
    if (!m || !s || !json_is_boolean(json_object_get(o, "overlap")))
        return -1;
    snprintf(r->model, sizeof r->model, "%s", m);
    snprintf(r->strategy, sizeof r->strategy, "%s", s);
    r->overlap = json_is_true(json_object_get(o, "overlap"));
    r->ranks = (int)jget(o, "ranks");
    r->threads = (int)jget(o, "threads_per_rank");
    r->step_s = jget(o, "step_s");
    r->final_loss = jget(o, "final_loss");
    r->bytes = jget(o, "bytes_per_step");
    r->min_bytes = json_is_number(json_object_get(o, "min_bytes_per_step"))
                       ? jget(o, "min_bytes_per_step")
                       : -1;
    r->collectives = jget(o, "collectives_per_step");
    r->wait_s = jget(o, "wait_s_per_step");
    r->busy_s = jget(o, "busy_s_per_step");
    return r->ranks > 0 && isfinite(r->step_s) ? 0 : -1;
}

static const prow *find_ref(const prow *refs, int nref, const char *model) {
    for (int i = 0; i < nref; i++)
        if (!strcmp(refs[i].model, model))
            return &refs[i];
    return NULL;
}

static void print_table(const prow *refs, int nref, const prow *rows, int nrows, const popts *o) {
    int ranks = nrows ? rows[0].ranks : o->np, thr = nrows ? rows[0].threads : 1;
    printf("\ntraining steps (compiled forward + backward + AdamW), median of %d steps after %d "
           "warm-up; %d ranks x %d thread%s",
           o->runs, o->warmup, ranks, thr, thr == 1 ? "" : "s");
    if (nref)
        printf(" against 1 rank x %d threads (the reference)", refs[0].threads);
    printf("\n  %-5s %-5s %-7s %9s %9s %7s %10s %10s %8s %6s %9s %9s %7s %9s\n", "model", "strat",
           "overlap", "ref ms", "step ms", "/ref", "KB/step", "min KB", "/min", "colls", "wait ms",
           "busy ms", "hidden", "loss");
    for (int i = 0; i < nref; i++)
        printf("  %-5s %-5s %-7s %9.3f %9s %7s %10s %10s %8s %6s %9s %9s %7s %9.4f\n",
               refs[i].model, "-", "-", 1e3 * refs[i].step_s, "-", "-", "-", "-", "-", "-", "-",
               "-", "-", refs[i].final_loss);
    for (int i = 0; i < nrows; i++) {
        const prow *r = &rows[i], *ref = find_ref(refs, nref, r->model);
        char refms[32] = "-", ratio[32] = "-", minkb[32] = "-", over[32] = "-", hid[32] = "-";
        if (ref) {
            snprintf(refms, sizeof refms, "%.3f", 1e3 * ref->step_s);
            snprintf(ratio, sizeof ratio, "%.2fx", r->step_s / ref->step_s);
        }
        if (r->min_bytes >= 0)
            snprintf(minkb, sizeof minkb, "%.1f", r->min_bytes / 1024);
        if (r->min_bytes > 0)
            snprintf(over, sizeof over, "%.2fx", r->bytes / r->min_bytes);
        if (isfinite(hidden_of(r)))
            snprintf(hid, sizeof hid, "%.0f%%", 100 * hidden_of(r));
        printf("  %-5s %-5s %-7s %9s %9.3f %7s %10.1f %10s %8s %6.0f %9.3f %9.3f %7s %9.4f\n",
               r->model, r->strategy, r->overlap ? "on" : "off", refms, 1e3 * r->step_s, ratio,
               r->bytes / 1024, minkb, over, r->collectives, 1e3 * r->wait_s, 1e3 * r->busy_s, hid,
               r->final_loss);
    }
    printf("minimum bytes per rank and step on N ranks, P = parameter bytes (fp32, tied once):\n"
           "  dp    %s\n  fsdp  %s\n  tp    %s\n"
           "KB/step, colls, wait and busy: per rank and step (mean over ranks); step ms: the "
           "slowest rank's\nhidden: %s\n",
           formula_dp, formula_fsdp, formula_tp, formula_hidden);
}

/* The report: the rows as JSON, to --json FILE (or the internal --ranks-out FILE). 0 or 1. */
static int write_json(const char *path, json_t *root) {
    char *text = json_dumps(root, JSON_INDENT(2));
    cli_out out;
    int status = 0;
    if (!text) {
        fprintf(stderr, "aotgrad bench: writing %s: out of memory\n", path);
        status = 1;
    } else if (cli_out_open(&out, "bench", path)) {
        status = 1;
    } else {
        cli_out_puts(&out, text);
        cli_out_puts(&out, "\n");
        status = cli_out_close(&out);
    }
    free(text);
    return status;
}

static json_t *report_json(const prow *refs, int nref, const prow *rows, int nrows, const popts *o,
                           const char *cmd) {
    char cpu[256], load[64];
    bench_cpu_model(cpu, sizeof cpu);
    bench_loadavg(load, sizeof load);
    json_t *root = json_object(), *ra = json_array(), *rr = json_array();
    json_object_set_new(root, "command", json_string(cmd));
    json_object_set_new(
        root, "machine",
        json_pack("{s:s, s:I}", "cpu", cpu, "cores", (json_int_t)sysconf(_SC_NPROCESSORS_ONLN)));
    json_object_set_new(root, "runs", json_integer(o->runs));
    json_object_set_new(root, "warmup", json_integer(o->warmup));
    json_object_set_new(root, "seed", json_integer((json_int_t)o->seed));
    json_object_set_new(root, "loadavg_end", json_string(load));
    json_object_set_new(root, "formulas",
                        json_pack("{s:s, s:s, s:s, s:s}", "dp", formula_dp, "fsdp", formula_fsdp,
                                  "tp", formula_tp, "hidden", formula_hidden));
    for (int i = 0; i < nref; i++)
        json_array_append_new(ra, row_json(&refs[i], NULL));
    for (int i = 0; i < nrows; i++)
        json_array_append_new(rr, row_json(&rows[i], find_ref(refs, nref, rows[i].model)));
    json_object_set_new(root, "reference", ra);
    json_object_set_new(root, "results", rr);
    return root;
}

/* ---- the two halves ---- */

/* Under MPI: every sharded row on this world. Rank 0 prints the table (started by the user) or
 * writes the rows to --ranks-out (started by the launcher below). */
static int ranks_main(const popts *o, const char *cmd) {
    ag_group *w = ag_dist_world();
    int rank = ag_group_rank(w), size = ag_group_size(w);
    if (o->ranks_out && ag_set_num_threads(1))
        ag_dist_abort(1, "bench: %s", ag_last_error());
    if (rank == 0 && !o->ranks_out) {
        char cpu[256], load[64];
        bench_cpu_model(cpu, sizeof cpu);
        bench_loadavg(load, sizeof load);
        printf("aotgrad bench --parallel: %s; %ld cores; %d ranks x %d thread(s) under mpirun "
               "(no 1-rank reference: run it without mpirun for both halves); seed %llu\n",
               cpu, sysconf(_SC_NPROCESSORS_ONLN), size, ag_get_num_threads(), o->seed);
        printf("load average at start: %s\n", load);
    }
    prow rows[MAXROWS];
    int nrows = 0;
    for (int m = 0; m < NMODELS; m++)
        for (int s = 0; s < NSTRATS; s++)
            for (int ov = 1; ov >= 0; ov--) {
                if (!o->model[m] || !o->strat[s] || (!ov && strcmp(strat_names[s], "dp")))
                    continue;
                if (rank == 0)
                    note("%s --parallel %s%s on %d ranks", model_names[m], strat_names[s],
                         ov ? "" : " (overlap off)", size);
                memset(&rows[nrows], 0, sizeof rows[nrows]);
                if (run_sharded(m, s, ov, o, &rows[nrows])) {
                    fflush(stdout);
                    ag_dist_abort(1, "bench: %s --parallel %s: %s", model_names[m], strat_names[s],
                                  ag_last_error());
                }
                nrows++;
            }
    int status = 0;
    if (rank == 0) {
        json_t *root = report_json(NULL, 0, rows, nrows, o, cmd);
        if (!root) {
            status = 1;
        } else if (o->ranks_out) {
            status = write_json(o->ranks_out, root);
        } else {
            print_table(NULL, 0, rows, nrows, o);
            if (o->json)
                status = write_json(o->json, root);
        }
        json_decref(root);
    }
    fflush(stdout);
    ag_dist_finalize();
    return status;
}

/* Runs the N-rank half: mpirun on this same program. 0 with the rows in *out, or 1 after the
 * message. */
static int launch_ranks(const popts *o, prow *rows, int *nrows) {
    char self[4096], tmpl[] = "/tmp/aotgrad-bench-XXXXXX";
    ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
    if (len <= 0) {
        fprintf(stderr,
                "aotgrad bench: --parallel: cannot find this program (/proc/self/exe): %s\n",
                strerror(errno));
        return 1;
    }
    self[len] = 0;
    int fd = mkstemp(tmpl);
    if (fd < 0) {
        fprintf(stderr, "aotgrad bench: --parallel: cannot make a temporary file: %s\n",
                strerror(errno));
        return 1;
    }
    close(fd);
    char np[16], runs[16], warmup[16], seed[32];
    snprintf(np, sizeof np, "%d", o->np);
    snprintf(runs, sizeof runs, "%d", o->runs);
    snprintf(warmup, sizeof warmup, "%d", o->warmup);
    snprintf(seed, sizeof seed, "%llu", o->seed);
    const char *argv[32];
    int n = 0;
    argv[n++] = o->mpirun;
    argv[n++] = "--oversubscribe";
    argv[n++] = "-np";
    argv[n++] = np;
    argv[n++] = self;
    argv[n++] = "bench";
    argv[n++] = "--parallel";
    for (int m = 0; m < NMODELS; m++)
        if (o->model[m])
            argv[n++] = model_names[m];
    for (int s = 0; s < NSTRATS; s++)
        if (o->strat[s])
            argv[n++] = strat_names[s];
    const char *tail[] = {"--runs", runs, "--warmup", warmup, "--seed", seed, "--ranks-out", tmpl};
    for (size_t i = 0; i < sizeof tail / sizeof *tail; i++)
        argv[n++] = tail[i];
    argv[n] = NULL;
    char cmd[1024] = "";
    for (int i = 0; i < n; i++) {
        size_t l = strlen(cmd);
        snprintf(cmd + l, sizeof cmd - l, "%s%s", i ? " " : "", argv[i]);
    }
    note("%s", cmd);
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid == 0) {
        setenv("OMP_NUM_THREADS", "1", 1);
        if (geteuid() == 0) { /* OpenMPI refuses root without both */
            setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
            setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
        }
        execvp(argv[0], (char *const *)argv);
        fprintf(stderr, "aotgrad bench: --parallel: cannot run %s: %s\n", argv[0], strerror(errno));
        _exit(127);
    }
    int st = 0, status = 0;
    if (pid < 0) {
        fprintf(stderr, "aotgrad bench: --parallel: cannot start %s: %s\n", o->mpirun,
                strerror(errno));
        status = 1;
    } else {
        while (waitpid(pid, &st, 0) < 0 && errno == EINTR)
            ;
        if (!WIFEXITED(st) || WEXITSTATUS(st)) {
            fprintf(stderr, "aotgrad bench: --parallel: the %d-rank run failed (%s %d): %s\n",
                    o->np, WIFEXITED(st) ? "exit status" : "signal",
                    WIFEXITED(st) ? WEXITSTATUS(st) : WTERMSIG(st), cmd);
            status = 1;
        }
    }
    json_error_t err;
    json_t *root = status ? NULL : json_load_file(tmpl, 0, &err);
    json_t *res = root ? json_object_get(root, "results") : NULL;
    if (!status && !json_is_array(res)) {
        fprintf(stderr, "aotgrad bench: --parallel: the %d-rank run wrote no results to %s%s%s\n",
                o->np, tmpl, root ? "" : ": ", root ? "" : err.text);
        status = 1;
    }
    for (size_t i = 0; !status && i < json_array_size(res); i++) {
        if (*nrows == MAXROWS || row_parse(json_array_get(res, i), &rows[*nrows])) {
            fprintf(stderr,
                    "aotgrad bench: --parallel: result %zu of the %d-rank run is "
                    "malformed\n",
                    i, o->np);
            status = 1;
        } else {
            (*nrows)++;
        }
    }
    json_decref(root);
    unlink(tmpl);
    return status;
}

/* Without MPI: the reference here, then the N-rank half under mpirun; one table. */
static int launcher_main(const popts *o, const char *cmd) {
    if (ag_set_num_threads(o->np)) {
        fprintf(stderr, "aotgrad bench: --np %d: %s\n", o->np, ag_last_error());
        return 2;
    }
    char cpu[256], load[64];
    bench_cpu_model(cpu, sizeof cpu);
    bench_loadavg(load, sizeof load);
    printf("aotgrad bench --parallel: %s; %ld cores; %d ranks x 1 thread (mpirun) against 1 rank "
           "x %d threads; median of %d steps after %d warm-up; seed %llu\n",
           cpu, sysconf(_SC_NPROCESSORS_ONLN), o->np, ag_get_num_threads(), o->runs, o->warmup,
           o->seed);
    printf("load average at start: %s\n", load);
    prow refs[NMODELS], rows[MAXROWS];
    int nref = 0, nrows = 0;
    for (int m = 0; m < NMODELS; m++) {
        if (!o->model[m])
            continue;
        note("%s: 1 rank x %d threads", model_names[m], ag_get_num_threads());
        memset(&refs[nref], 0, sizeof refs[nref]);
        if (run_reference(m, o, &refs[nref])) {
            fprintf(stderr, "aotgrad bench: %s: %s\n", model_names[m], ag_last_error());
            return 1;
        }
        nref++;
    }
    int status = launch_ranks(o, rows, &nrows);
    print_table(refs, nref, rows, nrows, o);
    bench_loadavg(load, sizeof load);
    printf("load average at end: %s\n", load);
    if (o->json) {
        json_t *root = report_json(refs, nref, rows, nrows, o, cmd);
        if (!root || write_json(o->json, root))
            status = 1;
        json_decref(root);
    }
    return status;
}

static void usage(FILE *f) {
    fprintf(f, "usage: aotgrad bench --parallel [mlp|gpt2|cnn ...] [dp|fsdp|tp ...] [--np N] "
               "[--runs N] [--warmup N] [--seed S] [--json FILE] [--mpirun PATH]\n"
               "  Times the training step of each model under each strategy on N ranks x 1 thread "
               "(default 2)\n  against the whole model's step on 1 rank x N threads, with the "
               "bytes sent per step against\n  the strategy's minimum and the share of "
               "communication hidden behind computation (dp also\n  with overlap off). Run it "
               "without mpirun: it times the reference, then launches\n  `mpirun "
               "--oversubscribe -np N` on itself for the N-rank half. Under mpirun it times\n  "
               "that world only. Defaults: all models and strategies, --runs 20 --warmup 3 "
               "--seed 0.\n");
}

int cli_bench_parallel(int argc, char **argv) {
    popts o = {.np = 2, .runs = 20, .warmup = 3, .mpirun = "mpirun"};
    bool any_model = false, any_strat = false;
    for (int i = 1; i < argc; i++) {
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        long long x = 0;
        int rc = 0, m = 0, s = 0;
        while (m < NMODELS && strcmp(argv[i], model_names[m]))
            m++;
        while (s < NSTRATS && strcmp(argv[i], strat_names[s]))
            s++;
        if (!strcmp(argv[i], "--parallel")) {
            continue;
        } else if (m < NMODELS) {
            o.model[m] = any_model = true;
        } else if (s < NSTRATS) {
            o.strat[s] = any_strat = true;
        } else if (!strcmp(argv[i], "--np")) {
            rc = cli_int_opt("bench", "--np", v, 2, 1024, &x), o.np = (int)x, i++;
        } else if (!strcmp(argv[i], "--runs")) {
            rc = cli_int_opt("bench", "--runs", v, 1, 100000, &x), o.runs = (int)x, i++;
        } else if (!strcmp(argv[i], "--warmup")) {
            rc = cli_int_opt("bench", "--warmup", v, 0, 100000, &x), o.warmup = (int)x, i++;
        } else if (!strcmp(argv[i], "--seed")) {
            rc = cli_int_opt("bench", "--seed", v, 0, (long long)1 << 62, &x),
            o.seed = (unsigned long long)x, i++;
        } else if (!strcmp(argv[i], "--json") && v && v[0]) {
            o.json = v, i++;
        } else if (!strcmp(argv[i], "--mpirun") && v && v[0]) {
            o.mpirun = v, i++;
        } else if (!strcmp(argv[i], "--ranks-out") && v && v[0]) {
            o.ranks_out = v, i++;
        } else if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            usage(stdout);
            return 0;
        } else {
            fprintf(stderr, "aotgrad bench: --parallel: bad argument '%s'%s\n", argv[i],
                    !strcmp(argv[i], "--threads")
                        ? " (the reference runs 1 rank x N threads, the ranks 1 thread each: "
                          "set N with --np)"
                        : "");
            usage(stderr);
            return 2;
        }
        if (rc)
            return 2;
    }
    for (int k = 0; k < NMODELS; k++)
        o.model[k] |= !any_model;
    for (int k = 0; k < NSTRATS; k++)
        o.strat[k] |= !any_strat;
    char cmd[1024] = "aotgrad";
    for (int i = 0; i < argc; i++) {
        size_t l = strlen(cmd);
        snprintf(cmd + l, sizeof cmd - l, " %s", argv[i]);
    }
    if (ag_dist_init()) {
        fprintf(stderr, "aotgrad bench: %s\n", ag_last_error());
        return 1;
    }
    if (ag_dist_uses_mpi())
        return ranks_main(&o, cmd);
    int status = 2;
    if (o.ranks_out)
        fprintf(stderr, "aotgrad bench: --ranks-out is internal: the N-rank half of `aotgrad "
                        "bench --parallel` writes its rows there under mpirun\n");
    else
        status = launcher_main(&o, cmd);
    ag_dist_finalize(); /* a world of one: no MPI here */
    return status;
}
