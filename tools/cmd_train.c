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
 *   --save FILE / --load FILE          the full parameters under the model's FQNs (safetensors),
 *                                      gathered from every rank; loads into any world size
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

static void progress(long long step, long long total, double loss, double rate, bool tty) {
    if (tty) {
        int width = 30, filled = (int)(width * (double)step / (double)total);
        printf("\r[");
        for (int i = 0; i < width; i++)
            putchar(i < filled ? '=' : (i == filled ? '>' : ' '));
        printf("] %lld/%lld  loss %.4f  %.0f samples/s   ", step, total, loss, rate);
        if (step == total)
            putchar('\n');
        fflush(stdout);
    } else if (step == 1 || step == total || step % (total >= 10 ? total / 10 : 1) == 0) {
        printf("  step %lld/%lld  loss %.4f  %.0f samples/s\n", step, total, loss, rate);
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
    const char *model, *data;
    ag_partitioner partitioner;
    const char *parallel;    /* --parallel dp|fsdp|tp, or NULL */
    const char *save, *load; /* --save FILE, --load FILE */
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
        r->opt = r->d ? ag_optim_adamw_tensors(params, np, o->lr, b1, b2, 1e-8, wd) : NULL;
    } else {
        r->c = ag_compile_joint(j, &co);
        r->opt = r->c ? ag_optim_adamw(step, o->lr, b1, b2, 1e-8, wd) : NULL;
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
    if (rc == 0 && !bad_loss)
        rc = ag_optim_step(r->opt);
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

static int train_fmnist(const train_opts *o) {
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
    bool tty = progress_bar(o);
    double t0 = now_s(), loss_v = NAN;
    for (long long s = 0; status == 0 && s < total; s++) {
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
        double el = now_s() - t0;
        progress(s + 1, total, loss_v, (double)((s + 1) * B) / (el > 0 ? el : 1e-9), tty);
        if (ferror(stdout)) { /* reported by main */
            status = 1;
            break;
        }
    }
    if (status == 0)
        status = finish_params(&r, model, o);
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

static int train_gpt2(const train_opts *o) {
    const char *path = o->data ? o->data : "/usr/share/common-licenses/GPL-3";
    size_t nbytes = 0;
    unsigned char *text =
        (unsigned char *)cli_read_file("train", path, "training text", CLI_MAX_INPUT, &nbytes);
    int64_t n = (int64_t)nbytes;
    ag_gpt2_config cfg = ag_gpt2_config_tiny();
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
    ag_module *step = model && !status ? cli_train_step_new(model, true) : NULL;
    if (!step && !status)
        status = train_fail(o, 1, "%s", ag_last_error());
    if (status && !step)
        ag_module_free(model);
    long long total = o->steps > 0 ? o->steps : 300;
    runner r = {0};
    if (!status) {
        printf("aotgrad train: character-level GPT-2 (%lld layers, %lld wide, %lld heads, "
               "context %lld, %lld parameters) on %s (%lld bytes), batch %lld, %lld steps\n",
               (long long)cfg.n_layer, (long long)cfg.n_embd, (long long)cfg.n_head, (long long)T,
               (long long)ag_module_num_parameters(model), path, (long long)n, (long long)B, total);
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
    bool tty = progress_bar(o);
    double t0 = now_s(), loss_v = NAN;
    for (long long s = 0; status == 0 && s < total; s++) {
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
        double el = now_s() - t0;
        progress(s + 1, total, loss_v, (double)((s + 1) * B * T) / (el > 0 ? el : 1e-9), tty);
        if (ferror(stdout)) { /* reported by main */
            status = 1;
            break;
        }
    }
    if (status == 0)
        status = finish_params(&r, model, o);
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
            putchar((int)ch);
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
        else if (!strcmp(argv[i], "--save") && v)
            o.save = v, i++;
        else if (!strcmp(argv[i], "--load") && v)
            o.load = v, i++;
        else if (!strcmp(argv[i], "--parallel") && v &&
                 (!strcmp(v, "dp") || !strcmp(v, "fsdp") || !strcmp(v, "tp")))
            o.parallel = v, i++;
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
                            "[--parallel dp|fsdp|tp] [--save FILE] [--load FILE]\n");
            return 2;
        }
    }
    /* Unset options are 0 (no flag can set 0: --steps, --batch and --lr must be positive). */
    bool gpt2 = !strcmp(o.model, "gpt2");
    if (!gpt2 && strcmp(o.model, "cnn") && strcmp(o.model, "mlp")) {
        fprintf(stderr, "aotgrad train: unknown model '%s' (cnn, mlp or gpt2)\n", o.model);
        return 2;
    }
    o.batch = o.batch ? o.batch : gpt2 ? 16 : 128;
    o.lr = o.lr ? o.lr : gpt2 ? 3e-3 : 2e-3;
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
