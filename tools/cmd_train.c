/* `aotgrad train`: the main job. A training step captured and compiled by aotgrad itself:
 * the model and its loss are exported as one joint graph with descriptors, partitioned by the
 * min-cut partitioner, compiled onto the memory-planned executor, and trained with AdamW.
 *
 *   aotgrad train                      the `cnn` zoo model on Fashion-MNIST, one epoch
 *   aotgrad train --steps N            stop after N steps
 *   aotgrad train --model gpt2 [--data FILE]   a character-level tiny GPT-2 on a text file
 *                                      (default /usr/share/common-licenses/GPL-3), then a sample
 *   aotgrad train --model mlp          the zoo's mlp on the flattened Fashion-MNIST images
 *   mpirun -np N aotgrad train --parallel dp|fsdp|tp   the same training on N ranks: each rank
 *                                      runs its shard of the step (train_dist.c); --batch is
 *                                      the global batch, so the losses are the one process's
 *   --save FILE.safetensors / --load FILE   the full parameters under the model's FQNs
 *                                      (safetensors), gathered from every rank; loads into any
 *                                      world size
 *   --save DIR / --resume DIR          a checkpoint (model, AdamW state, step, the data
 *                                      sampler's and generator's state); resuming with the same
 *                                      flags prints the uninterrupted run's losses; under
 *                                      --parallel each rank saves its optimizer shard (resume
 *                                      on the same strategy and world size)
 *   --checkpoint                       gpt2 with each block checkpointed (ag_checkpoint): its
 *                                      activations recomputed in the backward (the same losses,
 *                                      less saved memory), also under --parallel (the
 *                                      sharding pass keeps the recompute tags)
 *   --nested-blocks                    gpt2 with each block a nested compile region
 *                                      (ag_module_set_compile_region): one block traced,
 *                                      differentiated, partitioned and planned once, every block
 *                                      calling it (the same losses); under --parallel the
 *                                      sharding pass inlines the regions first; with
 *                                      --checkpoint each region is checkpointed inside (its
 *                                      partition, done once, saves only the block's operands)
 *   --dropout P                        gpt2's dropout probability (default 0; nanoGPT's
 *                                      embedding, attention, residual and MLP dropout), with
 *                                      --nested-blocks too (each call of the block draws its
 *                                      own masks, as eager does)
 *   --schedule cosine|constant --warmup N --decay-steps N --min-lr F --clip F
 *                                      the recipe: gpt2 defaults to nanoGPT's (warmup + cosine,
 *                                      clip 1.0, no weight decay on biases and norms); cnn and
 *                                      mlp to a constant lr without clipping
 *
 * Under --parallel every rank builds the same full model from the seed and reads the same data;
 * rank 0 alone writes to stdout (the single-process output), and any error after the world
 * started ends every rank through ag_dist_abort ("aotgrad: rank R of N: train: ...") so that no
 * rank waits forever in a collective for a failed peer.
 *
 * Before the first step it checks what a hostile command line can get wrong: every numeric
 * flag is strictly parsed and range-checked (cli_util.c; --lr must be finite and > 0), a batch
 * larger than the training set is refused, and the memory one step needs (the compiled plan's
 * arenas, saved activations, parameters with their gradients and AdamW state, the batch) is
 * estimated from a capture on data-less example inputs and compared with the memory this
 * process can get (MemAvailable, or less under a cgroup limit), so a batch that cannot fit is
 * refused before anything large is allocated. During training a non-finite loss stops the run
 * (exit 1) before the optimizer applies it; so does a failed write to stdout.
 *
 * Exit status: 0 on success, 1 when training fails (data, capture, a non-finite loss, memory),
 * 2 for a usage error (a bad flag or value). */
#include "cli.h"
#include "train_dist.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define FMNIST_DIR "/usr/share/datasets/fashion-mnist"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- summary of the capture ---- */

static void print_summary(const ag_joint *j, const ag_compiled *c, double export_s,
                          double compile_s) {
    const ag_graph *g = ag_joint_graph(j);
    int counts[64] = {0};
    ag_node **ph;
    int nph = ag_graph_placeholders(g, &ph);
    for (int i = 0; i < nph; i++)
        if (ag_node_desc(ph[i]))
            counts[ag_desc_kind_of(ag_node_desc(ph[i]))]++;
    ag_node *out = ag_graph_output_node(g);
    int nout = ag_node_arg(out, 0)->n, nnone = 0;
    for (int i = 0; i < nout; i++) {
        ag_desc *d = ag_node_output_desc(out, i);
        if (d)
            counts[ag_desc_kind_of(d)]++;
        else
            nnone++;
    }
    printf("joint graph: %d nodes; descriptors:", ag_graph_num_nodes(g));
    for (int k = 0; k < AG_DESC_NKINDS && k < 64; k++)
        if (counts[k])
            printf(" %s x%d", ag_desc_kind_name((ag_desc_kind)k), counts[k]);
    printf(" None x%d\n", nnone);
    const ag_partition_stats *st = ag_compiled_stats(c);
    printf("partition (min-cut): saved %d tensors, %.2f MB; recomputed %d nodes, %.3g FLOPs\n",
           st->saved_tensors, (double)st->saved_bytes / 1e6, st->recomputed_nodes,
           st->recomputed_flops);
    printf("planned peak: forward %.2f MB, backward %.2f MB; capture %.1f ms, compile %.1f ms\n",
           (double)ag_compiled_peak_bytes(c, false) / 1e6,
           (double)ag_compiled_peak_bytes(c, true) / 1e6, 1e3 * export_s, 1e3 * compile_s);
}

/* "1:02:03" or "2:03" for a duration in seconds. */
static char *fmt_time(double sec, char *buf, size_t n) {
    long long t = sec > 0 && sec < 1e9 ? (long long)(sec + 0.5) : 0;
    if (t >= 3600)
        snprintf(buf, n, "%lld:%02lld:%02lld", t / 3600, t / 60 % 60, t % 60);
    else
        snprintf(buf, n, "%lld:%02lld", t / 60, t % 60);
    return buf;
}

/* One step's report: on a terminal a bar redrawn in place with the rate, the elapsed time and
 * the time left (from the rate of this run's steps so far); otherwise plain lines, at the
 * first and last step and every tenth of the run. `steps_per_s` counts this run's steps (a
 * resumed run's first step is its own). */
static void progress(long long step, long long total, double loss, double rate, const char *unit,
                     double steps_per_s, double elapsed, bool tty) {
    if (tty) {
        int width = 30, filled = (int)(width * (double)step / (double)total);
        char el[32], eta[32];
        printf("\r[");
        for (int i = 0; i < width; i++)
            putchar(i < filled ? '=' : (i == filled ? '>' : ' '));
        printf(
            "] %lld/%lld  loss %.4f  %.0f samples/s  %s<%s   ", step, total, loss, rate,
            fmt_time(elapsed, el, sizeof el),
            fmt_time(steps_per_s > 0 ? (double)(total - step) / steps_per_s : 0, eta, sizeof eta));
        if (step == total)
            putchar('\n');
        fflush(stdout);
    } else if (step == 1 || step == total || step % (total >= 10 ? total / 10 : 1) == 0) {
        printf("  step %lld/%lld  loss %.4f  %.0f %s/s\n", step, total, loss, rate, unit);
        fflush(stdout);
    }
}

/* A deterministic permutation (Fisher-Yates with a 64-bit LCG). */
static void shuffle(int64_t *p, int64_t n, uint64_t *state) {
    for (int64_t i = 0; i < n; i++)
        p[i] = i;
    for (int64_t i = n - 1; i > 0; i--) {
        *state = *state * 6364136223846793005ull + 1442695040888963407ull;
        int64_t j = (int64_t)((*state >> 33) % (uint64_t)(i + 1));
        int64_t t = p[i];
        p[i] = p[j];
        p[j] = t;
    }
}

typedef struct train_opts {
    long long steps, batch, seed;
    double lr, budget;
    /* The recipe (gpt2's defaults: warmup + cosine, clip 1, no decay on biases and norms; cnn
     * and mlp: a constant lr, no clipping, one group). -1: the model's default. */
    int cosine;                /* --schedule cosine (1) | constant (0) */
    long long warmup, decay;   /* --warmup N, --decay-steps N */
    double min_lr, clip;       /* --min-lr F, --clip F (0: off) */
    bool groups;               /* weight decay only on tensors of 2 or more dims */
    const char *ckpt, *resume; /* --save DIR, --resume DIR */
    ag_lr_schedule sched;      /* resolved once the run's steps are known */
    const char *model, *data;
    ag_partitioner partitioner;
    const char *parallel;    /* --parallel dp|fsdp|tp, or NULL */
    const char *save, *load; /* --save FILE, --load FILE */
    bool checkpoint;         /* --checkpoint: gpt2's blocks checkpointed */
    bool nested_blocks;      /* --nested-blocks: gpt2's blocks nested compile regions */
    bool set_dropout;        /* --dropout P given */
    double dropout;          /* gpt2's dropout probability */
    int rank, world;         /* of the world under --parallel; 0 and 1 otherwise */
} train_opts;

/* The progress bar on a terminal, step lines otherwise. Under MPI the lines: mpirun hands each
 * rank a pseudo-terminal even when its own output is a pipe, so isatty cannot tell. */
static bool progress_bar(const train_opts *o) {
    return isatty(1) && !(o->parallel && ag_dist_uses_mpi());
}

/* Ends the run with a message: "aotgrad train: MSG" and `status` in one process; under
 * --parallel ag_dist_abort, which ends every rank of the job (a peer may be waiting in a
 * collective for this one), with the same message. */
static int train_fail(const train_opts *o, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int train_fail(const train_opts *o, int status, const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (o->parallel) {
        fflush(stdout);
        ag_dist_abort(status, "train: %s", msg);
    }
    fprintf(stderr, "aotgrad train: %s\n", msg);
    return status;
}

/* What runs a step: the compiled step of the whole model in one process, or this rank's share
 * of the sharded step (--parallel), and AdamW over the parameters it updates. */
typedef struct runner {
    ag_module *step;
    ag_compiled *c; /* one process */
    dist_train *d;  /* --parallel */
    ag_optim *opt;
} runner;

static void runner_free(runner *r) {
    ag_compiled_free(r->c);
    dist_train_free(r->d);
    ag_optim_free(r->opt);
    r->c = NULL;
    r->d = NULL;
    r->opt = NULL;
}

/* AdamW over the step module's parameters (or, under --parallel, this rank's pieces), with
 * --groups nanoGPT's two groups: weight decay wd on the tensors of 2 or more dims (matmul and
 * embedding weights), none on the others (biases, LayerNorm weights). NULL with a message. */
static ag_optim *make_optim(ag_module *step, ag_tensor *const *params, const char *const *names,
                            int np, const train_opts *o, double b1, double b2, double wd) {
    if (!o->groups && step)
        return ag_optim_adamw(step, o->lr, b1, b2, 1e-8, wd);
    if (!o->groups) {
        ag_param_group g = {.params = params, .names = names, .n = np};
        return ag_optim_adamw_groups(&g, 1, o->lr, b1, b2, 1e-8, wd);
    }
    ag_named_tensors d = {0}, nd = {0};
    ag_tensor **split = NULL;
    const char **split_names = NULL;
    ag_param_group gs[2] = {{0}, {.set = AG_GROUP_WEIGHT_DECAY, .weight_decay = 0}};
    if (step) {
        if (ag_module_decay_split(step, &d, &nd))
            return NULL;
        gs[0] =
            (ag_param_group){.params = d.tensors, .names = (const char *const *)d.names, .n = d.n};
        gs[1].params = nd.tensors;
        gs[1].names = (const char *const *)nd.names;
        gs[1].n = nd.n;
    } else {
        /* The local pieces keep their parameters' number of dims. */
        split = malloc(sizeof *split * (size_t)(np ? np : 1));
        split_names = malloc(sizeof *split_names * (size_t)(np ? np : 1));
        if (!split || !split_names) {
            free(split);
            free(split_names);
            ag_set_error(AG_ENOMEM, "train: out of memory");
            return NULL;
        }
        int k = 0;
        for (int pass = 0; pass < 2; pass++) {
            for (int i = 0; i < np; i++)
                if ((ag_tensor_ndim(params[i]) >= 2) == (pass == 0)) {
                    split_names[k] = names ? names[i] : NULL;
                    split[k++] = params[i];
                }
            if (pass == 0)
                gs[0] = (ag_param_group){.params = split, .n = k};
        }
        gs[1].params = split + gs[0].n;
        gs[1].n = k - gs[0].n;
        if (names) {
            gs[0].names = split_names;
            gs[1].names = split_names + gs[0].n;
        }
    }
    ag_optim *opt = ag_optim_adamw_groups(gs, 2, o->lr, b1, b2, 1e-8, wd);
    ag_named_tensors_free(&d);
    ag_named_tensors_free(&nd);
    free(split);
    free(split_names);
    return opt;
}

/* Exports the step module for example inputs (data-less: the capture reads only shapes),
 * shards it for this rank under --parallel, compiles it, makes the optimizer (AdamW with
 * betas b1, b2 and weight decay wd); prints the summary of what this rank runs. 0, or a
 * negative status with the message in ag_last_error. */
static int capture(runner *r, ag_module *step, ag_tensor *const *ex, int nex, const train_opts *o,
                   double b1, double b2, double wd) {
    r->step = step;
    double t0 = now_s();
    ag_joint *j = ag_export_joint(step, ex, nex, NULL, NULL, 0, NULL);
    if (!j)
        return ag_last_status();
    double t1 = now_s();
    ag_compile_opts co = {
        .partition = {.partitioner = o->partitioner, .memory_budget = ag_memory_budget(o->budget)}};
    if (o->parallel) {
        r->d = dist_train_new(j, step, o->parallel, &co);
        ag_tensor *const *params = NULL;
        int np = r->d ? dist_train_params(r->d, &params) : 0;
        r->opt =
            r->d ? make_optim(NULL, params, dist_train_param_names(r->d), np, o, b1, b2, wd) : NULL;
    } else {
        r->c = ag_compile_joint(j, &co);
        r->opt = r->c ? make_optim(step, NULL, NULL, 0, o, b1, b2, wd) : NULL;
    }
    double t2 = now_s();
    if (r->opt)
        print_summary(r->d ? dist_train_joint(r->d) : j, r->d ? dist_train_compiled(r->d) : r->c,
                      t1 - t0, t2 - t1);
    ag_joint_free(j);
    if (!r->opt) {
        int rc = ag_last_status();
        runner_free(r);
        return rc ? rc : AG_ENOMEM;
    }
    return 0;
}

static const ag_compiled *runner_compiled(const runner *r) {
    return r->d ? dist_train_compiled(r->d) : r->c;
}

/* One training step on the global batch `in`: forward, the loss's check, backward, AdamW.
 * 0 with *loss_v set; 1 after the message (a failed call or a non-finite loss). */
static int runner_step(runner *r, ag_tensor *const *in, int nin, long long s, double *loss_v,
                       const train_opts *o) {
    ag_scope_begin();
    ag_tensor *loss = NULL;
    int rc = r->d ? dist_train_call(r->d, in, nin, &loss)
                  : ag_compiled_call_module(r->c, r->step, in, nin, &loss, 1);
    bool bad_loss = false;
    if (rc == 1) {
        *loss_v = ag_tensor_item(loss);
        bad_loss = !isfinite(*loss_v);
        rc = bad_loss ? 0 : ag_backward(loss, NULL, false);
    }
    /* The recipe's step: clip the gradients' global norm, set this step's lr, then AdamW. */
    double norm = 0;
    if (rc == 0 && !bad_loss && o->clip > 0)
        rc = r->d ? dist_train_clip_grad_norm(r->d, o->clip, &norm)
                  : ag_optim_clip_grad_norm(r->opt, o->clip, &norm);
    if (rc == 0 && !bad_loss) {
        ag_optim_set_lr(r->opt, ag_lr_at(&o->sched, s));
        rc = ag_optim_step(r->opt);
    }
    ag_optim_zero_grad(r->opt);
    ag_scope_end();
    if (bad_loss) /* a NaN or infinite loss would spread to every weight */
        return train_fail(o, 1, "step %lld: loss is %s; stopping (lower --lr?)", s + 1,
                          isnan(*loss_v) ? "nan"
                          : *loss_v > 0  ? "inf"
                                         : "-inf");
    if (rc)
        return train_fail(o, 1, "step %lld: %s", s + 1, ag_last_error());
    return 0;
}

/* After training: the full parameters back in the module (gathered from every rank under
 * --parallel), saved to --save FILE by rank 0. 0, or 1 after the message. */
static int finish_params(runner *r, ag_module *model, const train_opts *o) {
    if (r->d && dist_train_gather(r->d))
        return train_fail(o, 1, "gathering the parameters: %s", ag_last_error());
    if (o->save && o->rank == 0 && ag_module_save(model, o->save))
        return train_fail(o, 1, "--save %s: %s", o->save, ag_last_error());
    return 0;
}

/* --load FILE into the full model, before it is captured and sharded. 0, or 1 after the
 * message. */
static int load_params(ag_module *model, const train_opts *o) {
    if (o->load && ag_module_load(model, o->load))
        return train_fail(o, 1, "--load %s: %s", o->load, ag_last_error());
    return 0;
}

/* ---- checkpoints: --save DIR, --resume DIR ----
 * A directory of three safetensors files, what a run needs to go on as if it had not stopped:
 *   model.safetensors  the module state (what --save FILE writes)
 *   optim.safetensors  AdamW's state (ag_optim_save: step counts, both moments, each group's lr)
 *   train.safetensors  "step" (steps done), "data_rng" (the batch sampler's state),
 *                      "rng_seed"/"rng_offset" (the generator's, for dropout), "perm" (the
 *                      Fashion-MNIST epoch's order); __metadata__ model and batch.
 * A run resumed with the same flags prints the losses of the uninterrupted run. */

/* --save PATH: a checkpoint directory unless PATH names a .safetensors file. */
static bool is_ckpt_dir(const char *path) {
    size_t n = strlen(path), k = strlen(".safetensors");
    return n < k || strcmp(path + n - k, ".safetensors") != 0;
}

static const char *ckpt_file(const char *dir, const char *name, char *buf, size_t n) {
    snprintf(buf, n, "%s/%s", dir, name);
    return buf;
}

/* The optimizer's state: one file in one process; under --parallel each rank's shard of it,
 * "optim.<strategy>.rank<R>-of-<N>.safetensors" (resumable only by the same strategy on the
 * same number of ranks). */
static const char *optim_file(const char *dir, const train_opts *o, char *buf, size_t n) {
    if (o->parallel)
        snprintf(buf, n, "%s/optim.%s.rank%d-of-%d.safetensors", dir, o->parallel, o->rank,
                 o->world);
    else
        snprintf(buf, n, "%s/optim.safetensors", dir);
    return buf;
}

/* Writes the checkpoint of a run after `step` steps (rank 0; not under --parallel). 0, or 1
 * after the message. */
static int ckpt_save(const runner *r, ag_module *model, const train_opts *o, long long step,
                     uint64_t data_rng, const int64_t *perm, int64_t nperm) {
    char path[4096], batch[32];
    if (mkdir(o->ckpt, 0777) && errno != EEXIST)
        return train_fail(o, 1, "--save %s: cannot create the directory: %s", o->ckpt,
                          strerror(errno));
    if (ag_optim_save(r->opt, optim_file(o->ckpt, o, path, sizeof path)))
        return train_fail(o, 1, "--save %s: %s", o->ckpt, ag_last_error());
    if (o->rank != 0) /* rank 0 writes what every rank holds the same */
        return 0;
    if (ag_module_save(model, ckpt_file(o->ckpt, "model.safetensors", path, sizeof path)))
        return train_fail(o, 1, "--save %s: %s", o->ckpt, ag_last_error());
    uint64_t seed, offset;
    ag_rng_get_state(&seed, &offset);
    int64_t v[4] = {step, (int64_t)data_rng, (int64_t)seed, (int64_t)offset};
    ag_tensor *ts[5] = {NULL};
    for (int i = 0; i < 4; i++)
        ts[i] = ag_from_data(AG_I64, 0, NULL, &v[i]);
    ts[4] = perm ? ag_from_data(AG_I64, 1, &nperm, perm) : NULL;
    const char *names[5] = {"step", "data_rng", "rng_seed", "rng_offset", "perm"};
    snprintf(batch, sizeof batch, "%lld", o->batch);
    const char *meta[] = {"model", o->model, "batch", batch, NULL};
    int rc = 0;
    for (int i = 0; i < (perm ? 5 : 4); i++)
        rc |= !ts[i];
    if (!rc)
        rc = ag_safetensors_save(ckpt_file(o->ckpt, "train.safetensors", path, sizeof path), names,
                                 ts, perm ? 5 : 4, meta);
    for (int i = 0; i < 5; i++)
        ag_tensor_free(ts[i]);
    if (rc)
        return train_fail(o, 1, "--save %s: %s", o->ckpt, ag_last_error());
    return 0;
}

/* --resume DIR, part 1: the model's state, before the step is captured. 0, or 1 after the
 * message. */
static int ckpt_load_model(ag_module *model, const train_opts *o) {
    char path[4096];
    if (o->resume &&
        ag_module_load(model, ckpt_file(o->resume, "model.safetensors", path, sizeof path)))
        return train_fail(o, 1, "--resume %s: %s", o->resume, ag_last_error());
    return 0;
}

static int64_t dict_i64(const ag_tensor_dict *d, const char *name, bool *ok) {
    ag_tensor *t = ag_tensor_dict_get(d, name);
    if (!t || ag_tensor_dtype(t) != AG_I64 || ag_tensor_ndim(t) != 0) {
        *ok = false;
        return 0;
    }
    return *(const int64_t *)ag_tensor_data(t);
}

/* --resume DIR, part 2, once the optimizer exists: its state, the step to start at (*s0), the
 * batch sampler's state and the generator's, the epoch's order (perm, nperm: Fashion-MNIST). 0,
 * or 1 after the message. */
static int ckpt_load_state(runner *r, const train_opts *o, long long total, long long *s0,
                           uint64_t *data_rng, int64_t *perm, int64_t nperm) {
    char path[4096];
    *s0 = 0;
    if (!o->resume)
        return 0;
    if (ag_optim_load(r->opt, optim_file(o->resume, o, path, sizeof path)))
        return train_fail(o, 1, "--resume %s: %s%s", o->resume, ag_last_error(),
                          o->parallel ? " (a checkpoint made under --parallel resumes with the "
                                        "same strategy on the same number of ranks)"
                                      : "");
    ag_tensor_dict d;
    if (ag_safetensors_load(ckpt_file(o->resume, "train.safetensors", path, sizeof path), &d))
        return train_fail(o, 1, "--resume %s: %s", o->resume, ag_last_error());
    bool ok = true;
    long long step = dict_i64(&d, "step", &ok);
    uint64_t drng = (uint64_t)dict_i64(&d, "data_rng", &ok);
    uint64_t seed = (uint64_t)dict_i64(&d, "rng_seed", &ok);
    uint64_t offset = (uint64_t)dict_i64(&d, "rng_offset", &ok);
    const char *model = ag_tensor_dict_meta(&d, "model"), *batch = ag_tensor_dict_meta(&d, "batch");
    ag_tensor *pt = ag_tensor_dict_get(&d, "perm");
    int status = 0;
    char want[32];
    snprintf(want, sizeof want, "%lld", o->batch);
    if (!ok || !model || !batch ||
        (perm && (!pt || ag_tensor_numel(pt) != nperm || ag_tensor_dtype(pt) != AG_I64)))
        status =
            train_fail(o, 1, "--resume %s: %s does not hold this run's state", o->resume, path);
    else if (strcmp(model, o->model) || strcmp(batch, want))
        status = train_fail(o, 2,
                            "--resume %s: the checkpoint is of --model %s --batch %s, not "
                            "--model %s --batch %lld",
                            o->resume, model, batch, o->model, o->batch);
    else if (step >= total)
        status = train_fail(o, 2,
                            "--resume %s: the checkpoint is at step %lld; --steps %lld "
                            "leaves nothing to do (--steps counts from the start of the run)",
                            o->resume, step, total);
    if (!status) {
        *s0 = step;
        *data_rng = drng;
        ag_rng_set_state(seed, offset);
        if (perm)
            memcpy(perm, ag_tensor_data(pt), sizeof(int64_t) * (size_t)nperm);
        printf("resumed from %s at step %lld\n", o->resume, step);
    }
    ag_tensor_dict_free(&d);
    return status;
}

/* The run's schedule, once its steps are known, and a line saying what the optimizer does.
 * 0, or 2 after the message. */
static int resolve_recipe(train_opts *o, long long total, double wd) {
    long long warmup = o->warmup >= 0 ? o->warmup
                       : o->cosine    ? (total / 20 < 100 ? total / 20 : 100)
                                      : 0;
    long long decay = o->decay >= 0 ? o->decay : total;
    o->sched = (ag_lr_schedule){.kind = o->cosine ? AG_LR_WARMUP_COSINE : AG_LR_CONSTANT,
                                .lr = o->lr,
                                .min_lr = o->min_lr >= 0 ? o->min_lr : o->lr / 10,
                                .warmup_iters = warmup,
                                .decay_iters = decay};
    if (o->cosine && decay < warmup)
        return train_fail(o, 2, "--decay-steps %lld is less than --warmup %lld", decay, warmup);
    if (o->cosine)
        printf("optimizer: AdamW lr %g, warmup %lld steps, cosine to %g at step %lld; ", o->lr,
               warmup, o->sched.min_lr, decay);
    else
        printf("optimizer: AdamW lr %g (constant); ", o->lr);
    printf("weight decay %g%s; ", wd, o->groups ? " (none on biases and norms)" : "");
    if (o->clip > 0)
        printf("gradients clipped to norm %g\n", o->clip);
    else
        printf("no gradient clipping\n");
    return 0;
}

/* ---- memory ---- */

/* A number from the first line of a file, or -1 ("max", missing, unreadable). */
static double read_number_file(const char *path) {
    FILE *f = fopen(path, "r");
    if (!f)
        return -1;
    char line[64];
    double v = -1;
    if (fgets(line, sizeof line, f)) {
        char *end;
        errno = 0;
        double x = strtod(line, &end);
        if (end != line && errno == 0 && x >= 0)
            v = x;
    }
    fclose(f);
    return v;
}

/* Bytes this process can still allocate: MemAvailable (the kernel's estimate, page cache it
 * can drop included), or less when a cgroup (v2 or v1) limits the memory. */
static double available_bytes(void) {
    double avail = -1;
    FILE *f = fopen("/proc/meminfo", "r");
    if (f) {
        char line[128];
        long long kb;
        while (fgets(line, sizeof line, f))
            if (sscanf(line, "MemAvailable: %lld kB", &kb) == 1) {
                avail = (double)kb * 1024;
                break;
            }
        fclose(f);
    }
    if (avail < 0)
        avail = (double)sysconf(_SC_AVPHYS_PAGES) * (double)sysconf(_SC_PAGESIZE);
    /* The process's groups from /proc/self/cgroup: "0::/path" (v2), "N:memory:/path" (v1).
     * Inside a container the group may not be mounted under its path: try the root too. */
    char group[2][512] = {"", ""};
    if ((f = fopen("/proc/self/cgroup", "r"))) {
        char line[512];
        while (fgets(line, sizeof line, f)) {
            line[strcspn(line, "\n")] = 0;
            const char *v1 = strstr(line, ":memory:");
            if (!strncmp(line, "0::", 3))
                snprintf(group[0], sizeof group[0], "%s", line + 3);
            else if (v1)
                snprintf(group[1], sizeof group[1], "%s", v1 + 8);
        }
        fclose(f);
    }
    static const char *const files[2][2] = {
        {"/sys/fs/cgroup%s/memory.max", "/sys/fs/cgroup%s/memory.current"},
        {"/sys/fs/cgroup/memory%s/memory.limit_in_bytes",
         "/sys/fs/cgroup/memory%s/memory.usage_in_bytes"},
    };
    for (int k = 0; k < 4; k++) {
        const char *g = k & 1 ? "" : group[k / 2];
        if (!(k & 1) && (!g[0] || !strcmp(g, "/")))
            continue;
        char path[640];
        snprintf(path, sizeof path, files[k / 2][0], g);
        double limit = read_number_file(path);
        snprintf(path, sizeof path, files[k / 2][1], g);
        double used = read_number_file(path);
        /* v1 says "no limit" with a number near 2^63. */
        if (limit > 0 && used >= 0 && limit < 1e18 && limit - used < avail)
            avail = limit > used ? limit - used : 0;
    }
    return avail;
}

/* Refuses a step that cannot fit: the compiled plans' arenas (forward and backward), the saved
 * activations between them, parameters with gradients and two AdamW moments (4 x float32), and
 * the batch's own buffers (data_bytes). 0, or 1 after the message. */
static int check_memory(const ag_compiled *c, const ag_module *model, long long batch,
                        double data_bytes, const train_opts *o) {
    double need = (double)ag_compiled_peak_bytes(c, false) +
                  (double)ag_compiled_peak_bytes(c, true) +
                  (double)ag_compiled_stats(c)->saved_bytes +
                  4.0 * 4.0 * (double)ag_module_num_parameters(model) + data_bytes;
    double avail = available_bytes();
    if (need <= avail)
        return 0;
    return train_fail(o, 1, "--batch %lld needs about %.3g GB; this machine has %.1f GB available",
                      batch, need / 1e9, avail / 1e9);
}

/* ---- Fashion-MNIST: cnn, or mlp on the flattened images ---- */

static int train_fmnist(train_opts *o) {
    ag_tensor *xtr, *ytr, *xte, *yte;
    const char *dir = o->data ? o->data : FMNIST_DIR;
    bool mlp = !strcmp(o->model, "mlp");
    if (ag_fashion_mnist_load(dir, true, &xtr, &ytr) ||
        ag_fashion_mnist_load(dir, false, &xte, &yte)) {
        if (!o->data && !o->parallel)
            fprintf(stderr, "aotgrad train: Fashion-MNIST comes with the Debian package "
                            "dataset-fashion-mnist (scripts/install-deps.sh installs it)\n");
        return train_fail(o, 1, "%s", ag_last_error());
    }
    if (mlp) { /* (N, 1, 28, 28) -> (N, 784) */
        ag_tensor *a = ag_reshape(xtr, 2, (int64_t[]){ag_tensor_size(xtr, 0), 784});
        ag_tensor *b = ag_reshape(xte, 2, (int64_t[]){ag_tensor_size(xte, 0), 784});
        ag_tensor_free(xtr);
        ag_tensor_free(xte);
        xtr = a;
        xte = b;
    }
    int64_t ntr = ag_tensor_size(xtr, 0), B = o->batch;
    int status = 0;
    if (!xtr || !xte) {
        status = train_fail(o, 1, "%s", ag_last_error());
    } else if (B > ntr) {
        status = train_fail(o, 2, "--batch %lld is larger than the training set (%lld images)",
                            (long long)B, (long long)ntr);
    }
    ag_module *model = NULL;
    ag_tensor *zin[8];
    int nzin = 0;
    if (!status && ag_zoo_build(o->model, NULL, &model, zin, 8, &nzin))
        status = train_fail(o, 1, "%s", ag_last_error());
    for (int i = 0; i < nzin; i++)
        ag_tensor_free(zin[i]);
    if (!status)
        status = load_params(model, o);
    if (!status)
        status = ckpt_load_model(model, o);
    ag_module *step = status ? NULL : cli_train_step_new(model, false);
    if (!status && !step)
        status = train_fail(o, 1, "%s", ag_last_error());
    if (status && !step)
        ag_module_free(model);
    long long total = o->steps > 0 ? o->steps : ntr / B;
    runner r = {0};
    if (!status) {
        printf("aotgrad train: %s on Fashion-MNIST (%lld training images, %lld test), batch "
               "%lld, AdamW lr %g, %d threads, %lld steps\n",
               o->model, (long long)ntr, (long long)ag_tensor_size(xte, 0), (long long)B, o->lr,
               ag_get_num_threads(), total);
        status = resolve_recipe(o, total, 0.01);
    }
    if (!status) {
        bool meta = ag_set_meta_mode(true);
        ag_tensor *ex[2] = {mlp ? ag_zeros(AG_F32, 2, (int64_t[]){B, 784})
                                : ag_zeros(AG_F32, 4, (int64_t[]){B, 1, 28, 28}),
                            ag_zeros(AG_I64, 1, (int64_t[]){B})};
        ag_set_meta_mode(meta);
        if (!ex[0] || !ex[1] || capture(&r, step, ex, 2, o, 0.9, 0.999, 0.01))
            status = train_fail(o, 1, "%s", ag_last_error());
        ag_tensor_free(ex[0]);
        ag_tensor_free(ex[1]);
    }
    /* The batch: indices, the gathered images and labels. */
    if (!status)
        status = check_memory(runner_compiled(&r), model, B, (double)B * (8 + 28 * 28 * 4 + 8), o);
    int64_t *perm = status ? NULL : malloc(sizeof(int64_t) * (size_t)ntr);
    if (!status && !perm)
        status = train_fail(o, 1, "out of memory");
    uint64_t rng = (uint64_t)o->seed * 2654435761u + 1;
    long long s0 = 0;
    if (!status)
        status = ckpt_load_state(&r, o, total, &s0, &rng, perm, ntr);
    bool tty = progress_bar(o);
    double t0 = now_s(), loss_v = NAN;
    for (long long s = s0; status == 0 && s < total; s++) {
        int64_t off = (s * B) % (ntr - ntr % B);
        if (off == 0)
            shuffle(perm, ntr, &rng);
        ag_scope_begin();
        ag_tensor *idx = ag_from_data(AG_I64, 1, &B, perm + off);
        ag_tensor *in[2] = {ag_index_select(xtr, 0, idx), ag_index_select(ytr, 0, idx)};
        if (!in[0] || !in[1])
            status = train_fail(o, 1, "step %lld: %s", s + 1, ag_last_error());
        else
            status = runner_step(&r, in, 2, s, &loss_v, o);
        ag_scope_end();
        if (status)
            break;
        double el = now_s() - t0, done = (double)(s + 1 - s0);
        progress(s + 1, total, loss_v, done * (double)B / (el > 0 ? el : 1e-9), "samples",
                 done / (el > 0 ? el : 1e-9), el, tty);
        if (ferror(stdout)) { /* reported by main */
            status = 1;
            break;
        }
    }
    if (status == 0)
        status = finish_params(&r, model, o);
    if (status == 0 && o->ckpt) /* after finish_params: the parameters gathered */
        status = ckpt_save(&r, model, o, total, rng, perm, ntr);
    if (status == 0 && o->rank == 0) {
        /* Test accuracy, eagerly in evaluation mode (running statistics). */
        ag_module_train(model, false);
        bool prev = ag_set_grad_enabled(false);
        int64_t nte = ag_tensor_size(xte, 0), hits = 0;
        for (int64_t b = 0; b < nte && !status; b += 1000) {
            ag_scope_begin();
            int64_t e = b + 1000 < nte ? b + 1000 : nte;
            ag_tensor *xb = ag_slice(xte, 0, b, e, 1), *yb = ag_slice(yte, 0, b, e, 1);
            ag_tensor *pred = ag_argmax(ag_module_forward(model, xb), 1, false);
            ag_tensor *h = ag_sum_all(ag_eq(pred, yb));
            if (!h)
                status = train_fail(o, 1, "evaluation: %s", ag_last_error());
            else
                hits += (int64_t)ag_tensor_item(h);
            ag_scope_end();
        }
        ag_set_grad_enabled(prev);
        if (!status)
            printf("test accuracy %.2f%% (%lld/%lld) after %lld steps; final loss %.4f; %.1f s\n",
                   100.0 * (double)hits / (double)nte, (long long)hits, (long long)nte, total,
                   loss_v, now_s() - t0);
    }
    free(perm);
    runner_free(&r);
    ag_module_free(step);
    ag_tensor_free(xtr);
    ag_tensor_free(ytr);
    ag_tensor_free(xte);
    ag_tensor_free(yte);
    return status;
}

/* ---- character-level GPT-2 ---- */

static int train_gpt2(train_opts *o) {
    const char *path = o->data ? o->data : "/usr/share/common-licenses/GPL-3";
    size_t nbytes = 0;
    unsigned char *text =
        (unsigned char *)cli_read_file("train", path, "training text", CLI_MAX_INPUT, &nbytes);
    int64_t n = (int64_t)nbytes;
    ag_gpt2_config cfg = ag_gpt2_config_tiny();
    cfg.checkpoint_blocks = o->checkpoint;
    cfg.compile_region_blocks = o->nested_blocks;
    if (o->set_dropout)
        cfg.dropout = o->dropout;
    int64_t T = cfg.block_size, B = o->batch;
    if (!text || n < T + 2) {
        free(text);
        if (text)
            return train_fail(o, 1, "%s holds %lld bytes; the model needs at least %lld", path,
                              (long long)n, (long long)(T + 2));
        if (!o->data)
            return train_fail(o, 1, "%s comes with Debian's base-files package", path);
        return train_fail(o, 1, "cannot read %s", path);
    }
    ag_manual_seed((uint64_t)o->seed);
    ag_module *model = ag_nn_gpt2(&cfg);
    int status = model ? load_params(model, o) : 0;
    if (model && !status)
        status = ckpt_load_model(model, o);
    ag_module *step = model && !status ? cli_train_step_new(model, true) : NULL;
    if (!step && !status)
        status = train_fail(o, 1, "%s", ag_last_error());
    if (status && !step)
        ag_module_free(model);
    long long total = o->steps > 0 ? o->steps : 300;
    runner r = {0};
    if (!status) {
        char drop[48] = "";
        if (cfg.dropout > 0)
            snprintf(drop, sizeof drop, ", dropout %g", cfg.dropout);
        printf("aotgrad train: character-level GPT-2 (%lld layers, %lld wide, %lld heads, "
               "context %lld, %lld parameters%s%s) on %s (%lld bytes), batch %lld, %lld steps\n",
               (long long)cfg.n_layer, (long long)cfg.n_embd, (long long)cfg.n_head, (long long)T,
               (long long)ag_module_num_parameters(model), drop,
               o->checkpoint && o->nested_blocks ? ", blocks as checkpointed nested compile regions"
               : o->checkpoint                   ? ", blocks checkpointed"
               : o->nested_blocks                ? ", blocks as nested compile regions"
                                                 : "",
               path, (long long)n, (long long)B, total);
        status = resolve_recipe(o, total, 0.1);
    }
    if (!status) {
        bool meta = ag_set_meta_mode(true);
        ag_tensor *ex[2] = {ag_zeros(AG_I64, 2, (int64_t[]){B, T}),
                            ag_zeros(AG_I64, 2, (int64_t[]){B, T})};
        ag_set_meta_mode(meta);
        if (!ex[0] || !ex[1] || capture(&r, step, ex, 2, o, 0.9, 0.95, 0.1))
            status = train_fail(o, 1, "%s", ag_last_error());
        ag_tensor_free(ex[0]);
        ag_tensor_free(ex[1]);
    }
    /* The batch: xs and ys here, and the two tensors made from them each step. */
    if (!status)
        status = check_memory(runner_compiled(&r), model, B, 4.0 * 8.0 * (double)B * (double)T, o);
    int64_t *xs = NULL, *ys = NULL;
    if (!status && (!(xs = malloc(sizeof(int64_t) * (size_t)(B * T))) ||
                    !(ys = malloc(sizeof(int64_t) * (size_t)(B * T)))))
        status = train_fail(o, 1, "out of memory");
    uint64_t rng = (uint64_t)o->seed * 2654435761u + 7;
    long long s0 = 0;
    if (!status)
        status = ckpt_load_state(&r, o, total, &s0, &rng, NULL, 0);
    bool tty = progress_bar(o);
    double t0 = now_s(), loss_v = NAN;
    for (long long s = s0; status == 0 && s < total; s++) {
        for (int64_t b = 0; b < B; b++) {
            rng = rng * 6364136223846793005ull + 1442695040888963407ull;
            int64_t start = (int64_t)((rng >> 33) % (uint64_t)(n - T - 1));
            for (int64_t t = 0; t < T; t++) {
                xs[b * T + t] = text[start + t];
                ys[b * T + t] = text[start + t + 1];
            }
        }
        ag_scope_begin();
        ag_tensor *in[2] = {ag_from_data(AG_I64, 2, (int64_t[]){B, T}, xs),
                            ag_from_data(AG_I64, 2, (int64_t[]){B, T}, ys)};
        if (!in[0] || !in[1])
            status = train_fail(o, 1, "step %lld: %s", s + 1, ag_last_error());
        else
            status = runner_step(&r, in, 2, s, &loss_v, o);
        ag_scope_end();
        if (status)
            break;
        double el = now_s() - t0, done = (double)(s + 1 - s0);
        progress(s + 1, total, loss_v, done * (double)(B * T) / (el > 0 ? el : 1e-9), "tokens",
                 done / (el > 0 ? el : 1e-9), el, tty);
        if (ferror(stdout)) { /* reported by main */
            status = 1;
            break;
        }
    }
    if (status == 0)
        status = finish_params(&r, model, o);
    if (status == 0 && o->ckpt) /* after finish_params: the parameters gathered */
        status = ckpt_save(&r, model, o, total, rng, NULL, 0);
    if (status == 0 && o->rank == 0) {
        /* A sample: temperature 0.8 from the first line of the text, eagerly. */
        printf("sample:\n");
        int64_t ctx[256];
        int64_t len = 0;
        for (; len < 16 && len < n; len++)
            ctx[len] = text[len];
        for (int64_t i = 0; i < len; i++)
            putchar((int)ctx[i]);
        bool prev = ag_set_grad_enabled(false);
        ag_module_train(model, false);
        for (int k = 0; k < 200; k++) {
            ag_scope_begin();
            int64_t w = len < T ? len : T;
            ag_tensor *idx = ag_from_data(AG_I64, 2, (int64_t[]){1, w}, ctx + len - w);
            ag_tensor *logits = ag_module_forward(model, idx);
            ag_tensor *last = ag_select(ag_select(logits, 0, 0), 0, w - 1);
            ag_tensor *p = ag_softmax(ag_div_scalar(last, 0.8), 0);
            double u = (double)((rng = rng * 6364136223846793005ull + 1) >> 11) * 0x1.0p-53,
                   acc = 0;
            int64_t ch = 0;
            for (int64_t v = 0; p && v < ag_tensor_numel(p); v++) {
                acc += ag_tensor_item_at(p, v);
                if (acc >= u) {
                    ch = v;
                    break;
                }
            }
            ag_scope_end();
            /* A byte-level model this short trained emits any byte: keep the terminal sane. */
            putchar(ch == '\n' || (ch >= 32 && ch < 127) ? (int)ch : '?');
            if (len == (int64_t)(sizeof ctx / sizeof ctx[0])) {
                memmove(ctx, ctx + 1, sizeof ctx - sizeof ctx[0]);
                len--;
            }
            ctx[len++] = ch;
        }
        ag_set_grad_enabled(prev);
        printf("\nfinal loss %.4f after %lld steps; %.1f s\n", loss_v, total, now_s() - t0);
    }
    free(xs);
    free(ys);
    free(text);
    runner_free(&r);
    ag_module_free(step);
    return status;
}

int cli_train(int argc, char **argv) {
    train_opts o = {.steps = 0,
                    .batch = 0,
                    .seed = 0,
                    .lr = 0,
                    .budget = 1.0,
                    .cosine = -1,
                    .warmup = -1,
                    .decay = -1,
                    .min_lr = -1,
                    .clip = -1,
                    .model = "cnn",
                    .partitioner = AG_PARTITION_MINCUT,
                    .world = 1};
    for (int i = 1; i < argc; i++) {
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        int rc = 0;
        if (!strcmp(argv[i], "--steps"))
            rc = cli_int_opt("train", "--steps", v, 1, 1000000000, &o.steps), i++;
        else if (!strcmp(argv[i], "--seed"))
            rc = cli_int_opt("train", "--seed", v, 0, (long long)1 << 62, &o.seed), i++;
        else if (!strcmp(argv[i], "--batch")) /* memory is checked once the step is compiled */
            rc = cli_int_opt("train", "--batch", v, 1, (long long)1 << 30, &o.batch), i++;
        else if (!strcmp(argv[i], "--lr"))
            rc = cli_float_opt("train", "--lr", v, 0, true, HUGE_VAL, &o.lr), i++;
        else if (!strcmp(argv[i], "--budget"))
            rc = cli_float_opt("train", "--budget", v, 0, false, 1, &o.budget), i++;
        else if (!strcmp(argv[i], "--model") && v)
            o.model = v, i++;
        else if (!strcmp(argv[i], "--data") && v)
            o.data = v, i++;
        else if (!strcmp(argv[i], "--save") && v && is_ckpt_dir(v))
            o.ckpt = v, i++;
        else if (!strcmp(argv[i], "--save") && v)
            o.save = v, i++;
        else if (!strcmp(argv[i], "--resume") && v)
            o.resume = v, i++;
        else if (!strcmp(argv[i], "--warmup"))
            rc = cli_int_opt("train", "--warmup", v, 0, 1000000000, &o.warmup), i++;
        else if (!strcmp(argv[i], "--decay-steps"))
            rc = cli_int_opt("train", "--decay-steps", v, 0, 1000000000, &o.decay), i++;
        else if (!strcmp(argv[i], "--min-lr"))
            rc = cli_float_opt("train", "--min-lr", v, 0, false, HUGE_VAL, &o.min_lr), i++;
        else if (!strcmp(argv[i], "--clip"))
            rc = cli_float_opt("train", "--clip", v, 0, false, HUGE_VAL, &o.clip), i++;
        else if (!strcmp(argv[i], "--schedule") && v && !strcmp(v, "cosine"))
            o.cosine = 1, i++;
        else if (!strcmp(argv[i], "--schedule") && v && !strcmp(v, "constant"))
            o.cosine = 0, i++;
        else if (!strcmp(argv[i], "--load") && v)
            o.load = v, i++;
        else if (!strcmp(argv[i], "--parallel") && v &&
                 (!strcmp(v, "dp") || !strcmp(v, "fsdp") || !strcmp(v, "tp")))
            o.parallel = v, i++;
        else if (!strcmp(argv[i], "--checkpoint"))
            o.checkpoint = true;
        else if (!strcmp(argv[i], "--nested-blocks"))
            o.nested_blocks = true;
        else if (!strcmp(argv[i], "--dropout"))
            rc = cli_float_opt("train", "--dropout", v, 0, false, 1, &o.dropout), i++,
            o.set_dropout = true;
        else if (!strcmp(argv[i], "--partitioner") && v && !strcmp(v, "default"))
            o.partitioner = AG_PARTITION_DEFAULT, i++;
        else if (!strcmp(argv[i], "--partitioner") && v && !strcmp(v, "mincut"))
            o.partitioner = AG_PARTITION_MINCUT, i++;
        else {
            if (!strcmp(argv[i], "--parallel") && v)
                fprintf(stderr, "aotgrad train: --parallel: expected dp, fsdp or tp, got '%s'\n",
                        v);
            else
                fprintf(stderr, "aotgrad train: bad option '%s'\n", argv[i]);
            rc = -1;
        }
        if (rc) {
            fprintf(stderr, "usage: aotgrad train [--model cnn|mlp|gpt2] [--data PATH] "
                            "[--steps N] [--batch B] [--lr F] [--seed S] "
                            "[--partitioner default|mincut] [--budget F] "
                            "[--parallel dp|fsdp|tp] [--save FILE.safetensors|DIR] [--load FILE] "
                            "[--resume DIR] [--schedule cosine|constant] [--warmup N] "
                            "[--decay-steps N] [--min-lr F] [--clip F] [--checkpoint] "
                            "[--nested-blocks] [--dropout P]\n");
            return 2;
        }
    }
    /* Unset options are 0 (no flag can set 0: --steps, --batch and --lr must be positive). */
    bool gpt2 = !strcmp(o.model, "gpt2");
    if (!gpt2 && strcmp(o.model, "cnn") && strcmp(o.model, "mlp")) {
        fprintf(stderr, "aotgrad train: unknown model '%s' (cnn, mlp or gpt2)\n", o.model);
        return 2;
    }
    if (o.checkpoint && !gpt2) {
        fprintf(stderr,
                "aotgrad train: --checkpoint checkpoints gpt2's blocks; --model %s has "
                "none (use --model gpt2)\n",
                o.model);
        return 2;
    }
    if (o.set_dropout && !gpt2) {
        fprintf(stderr,
                "aotgrad train: --dropout sets gpt2's dropout; --model %s has no dropout "
                "layers (use --model gpt2)\n",
                o.model);
        return 2;
    }
    if (o.nested_blocks && !gpt2) {
        fprintf(stderr,
                "aotgrad train: --nested-blocks makes gpt2's blocks nested compile regions; "
                "--model %s has none (use --model gpt2)\n",
                o.model);
        return 2;
    }
    o.batch = o.batch ? o.batch : gpt2 ? 16 : 128;
    o.lr = o.lr ? o.lr : gpt2 ? 3e-3 : 2e-3;
    /* gpt2 follows nanoGPT's recipe; cnn and mlp keep a constant lr unless told otherwise. */
    o.cosine = o.cosine >= 0 ? o.cosine : gpt2;
    o.clip = o.clip >= 0 ? o.clip : gpt2 ? 1.0 : 0.0;
    o.groups = gpt2;
    if (o.parallel) {
        /* Every rank runs this same command (SPMD); rank 0 alone writes to stdout. */
        if (ag_dist_init()) {
            fprintf(stderr, "aotgrad train: %s\n", ag_last_error());
            return 1;
        }
        o.rank = ag_group_rank(ag_dist_world());
        o.world = ag_group_size(ag_dist_world());
        if (o.rank != 0 && !freopen("/dev/null", "w", stdout))
            train_fail(&o, 1, "rank %d: cannot silence stdout", o.rank);
        /* dp and fsdp shard the batch (Shard(0) of the inputs): --batch is the global batch. */
        if (strcmp(o.parallel, "tp") && o.batch % o.world) {
            if (o.rank == 0)
                fprintf(stderr,
                        "aotgrad train: --batch %lld does not split among %d ranks (--parallel "
                        "%s shards the global batch): use a multiple of %d\n",
                        o.batch, o.world, o.parallel, o.world);
            ag_dist_finalize();
            return 2;
        }
    }
    int status;
    if (gpt2) {
        status = train_gpt2(&o);
    } else {
        ag_manual_seed((uint64_t)o.seed);
        status = train_fmnist(&o);
    }
    if (o.parallel) {
        fflush(stdout);
        ag_dist_finalize();
    }
    return status;
}
