/* `aotgrad bench`: the performance suite (docs/PERFORMANCE.md says what each number means and
 * records a run).
 *
 *   aotgrad bench [MODEL...] [--json FILE] [--runs N] [--warmup N] [--threads T] [--seed S]
 *                 [--zoo] [--pipeline-scaling] [--profile] [--gemms]
 *   aotgrad bench --parallel ...      distributed steps (bench_parallel.c)
 *
 * MODEL is mlp (8 x Linear(1024, 1024) with ReLU between, batch 256, cross-entropy over 1024
 * classes), cnn (the zoo's cnn at Fashion-MNIST shapes, batch 128, cross-entropy over 10
 * classes) or gpt2-small (ag_gpt2_config_small(), B=4, T=64, the model's own loss). Without
 * MODEL, --zoo or --pipeline-scaling the bench runs everything: the three models, the zoo and
 * the pipeline scaling.
 *
 * Each model is wrapped, as `aotgrad train` does, in a TrainStep module computing the loss, and
 * trained with AdamW in fp32. A step is forward + backward + optimizer step (+ zero_grad):
 *   eager:    ag_module_call(step) -> ag_backward -> ag_optim_step
 *   compiled: ag_compiled_call_module(compiled step) -> ag_backward -> ag_optim_step
 * for two compilations of one joint (the default partitioner and the min-cut one, budget 1).
 * The three variants share the model and the optimizer and run interleaved (eager, default,
 * min-cut, eager, ...) so that a drifting machine load hits them alike; after --warmup steps
 * of each, --runs timed runs give the median seconds per step (a run repeats the step until it
 * lasts at least 20 ms, for the small zoo models).
 *
 * Per model it also reports the GEMM floor (the BLAS products of one compiled step, read off
 * its forward and backward graphs, timed alone through cblas_sgemm), the capture pipeline's
 * times (ag_export_joint, which traces and exports in one call; ag_compile_joint, and its two
 * stages, ag_partition and ag_plan_new, run on their own) and the planned memory of four
 * partitionings. --zoo times eager against compiled steps for every zoo model (a loss summing
 * its outputs); --pipeline-scaling times export and compile of data-less (meta mode) GPT-2
 * small variants with 12, 48 and 96 layers; --profile breaks the compiled step down into
 * phases and kernels; --gemms lists the GEMM calls of the floor. */
#include "bench_env.h"
#include "cli.h"
#include "runtime/plan_internal.h" /* ag__plan_set_step_hook: the per-kernel profile */

#include <cblas.h>
#include <jansson.h>
#include <math.h>
#include <omp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define MIN_RUN_S 0.02 /* a timed run repeats the step until it lasts this long */
#define MAX_REPS 1000

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* The median of v[0..n) (sorts v). */
static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* a / b as a JSON number, or null when it is not finite (jansson refuses NaN and inf). */
static json_t *jratio(double a, double b) {
    double r = a / b;
    return isfinite(r) ? json_real(r) : json_null();
}

/* A progress line on stderr, after whatever stdout holds so far. */
static void note(const char *fmt, ...) {
    va_list ap;
    fflush(stdout);
    fprintf(stderr, "aotgrad bench: ");
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
}

static void bench_error(const char *what) {
    fprintf(stderr, "aotgrad bench: %s: %s\n", what, ag_last_error());
}

/* ---- the training step module: loss = criterion(model(inputs...)) ---- */

typedef enum loss_kind {
    LOSS_CE,   /* cross_entropy(model(in[0]), in[1]) */
    LOSS_GPT2, /* model(idx, targets) returns (logits, loss) */
    LOSS_SUM,  /* sum_k (0.5 + 0.25 k) * sum(output_k) over the float outputs (the zoo) */
} loss_kind;

typedef struct step_ud {
    ag_module *model;
    loss_kind loss;
} step_ud;

static int step_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    step_ud *u = ag_module_ud(m);
    ag_tensor *loss = NULL, *o[16] = {0};
    (void)max_out;
    ag_scope_begin();
    if (u->loss == LOSS_CE) {
        loss = ag_cross_entropy(ag_module_forward(u->model, in[0]), in[1], AG_REDUCTION_MEAN, -100);
    } else if (u->loss == LOSS_GPT2) {
        if (ag_module_call(u->model, in, nin, o, 2) == 2)
            loss = o[1];
    } else {
        int n = ag_module_call(u->model, in, nin, o, 16);
        for (int k = 0; k < n; k++) {
            if (!o[k] || !ag_dtype_is_float(ag_tensor_dtype(o[k])))
                continue;
            ag_tensor *s = ag_sum_all(ag_mul_scalar(o[k], 0.5 + 0.25 * k));
            loss = loss ? ag_add(loss, s) : s;
            if (!loss)
                break;
        }
    }
    out[0] = loss ? ag_tensor_keep(loss) : NULL;
    ag_scope_end();
    return out[0] ? 1 : ag_last_status();
}

/* The step module owns the model as its child "model". NULL model: NULL. */
static ag_module *make_step(ag_module *model, loss_kind loss) {
    step_ud *u = model ? calloc(1, sizeof *u) : NULL;
    if (!u) {
        ag_module_free(model);
        return NULL;
    }
    u->model = model;
    u->loss = loss;
    ag_module *s = ag_module_new("TrainStep", step_forward, u, free);
    if (!s) {
        free(u);
        ag_module_free(model);
        return NULL;
    }
    if (ag_module_add_child(s, "model", model)) {
        ag_module_free(s);
        ag_module_free(model);
        return NULL;
    }
    return s;
}

/* ---- the benchmarked cases ---- */

typedef struct bench_case {
    char name[32];
    char what[256]; /* shapes, loss and optimizer in one line */
    ag_module *step;
    ag_tensor *in[8];
    int nin;
    ag_optim *opt;
} bench_case;

static void case_free(bench_case *bc) {
    for (int i = 0; i < bc->nin; i++)
        ag_tensor_free(bc->in[i]);
    ag_optim_free(bc->opt);
    ag_module_free(bc->step);
    memset(bc, 0, sizeof *bc);
}

/* Class indices uniform in [0, classes), from a 64-bit LCG seeded with `seed`. */
static ag_tensor *random_targets(int ndim, const int64_t *sizes, int64_t classes, uint64_t seed) {
    int64_t n = 1;
    for (int d = 0; d < ndim; d++)
        n *= sizes[d];
    int64_t *v = malloc(sizeof(int64_t) * (size_t)(n > 0 ? n : 1));
    if (!v) {
        fprintf(stderr, "aotgrad bench: out of memory\n");
        return NULL;
    }
    uint64_t s = seed * 6364136223846793005ull + 1442695040888963407ull;
    for (int64_t i = 0; i < n; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        v[i] = (int64_t)((s >> 33) % (uint64_t)classes);
    }
    ag_tensor *t = ag_from_data(AG_I64, ndim, sizes, v);
    free(v);
    return t;
}

/* Finishes a case: wraps the model into the step module and makes the optimizer. */
static int case_finish(bench_case *bc, ag_module *model, loss_kind loss, double lr, double beta2,
                       double wd) {
    for (int i = 0; i < bc->nin; i++)
        if (!bc->in[i]) {
            ag_module_free(model);
            return -1;
        }
    bc->step = make_step(model, loss);
    bc->opt = bc->step ? ag_optim_adamw(bc->step, lr, 0.9, beta2, 1e-8, wd) : NULL;
    return bc->opt ? 0 : -1;
}

static int build_mlp(bench_case *bc, uint64_t seed) {
    ag_manual_seed(seed);
    ag_module *m = ag_nn_sequential();
    for (int i = 0; m && i < 15; i++) {
        ag_module *layer = i % 2 == 0 ? ag_nn_linear(1024, 1024, true) : ag_nn_relu();
        if (!layer || ag_nn_append(m, layer)) {
            ag_module_free(layer); /* a failed append took nothing */
            ag_module_free(m);
            m = NULL;
        }
    }
    if (!m)
        return -1;
    snprintf(bc->name, sizeof bc->name, "mlp");
    snprintf(bc->what, sizeof bc->what,
             "8 x Linear(1024, 1024) with ReLU between (8.4M parameters), x f32[256, 1024], "
             "cross-entropy over 1024 classes, AdamW");
    bc->in[0] = ag_randn(AG_F32, 2, (int64_t[]){256, 1024});
    bc->in[1] = random_targets(1, (int64_t[]){256}, 1024, seed);
    bc->nin = 2;
    return case_finish(bc, m, LOSS_CE, 1e-4, 0.999, 0.01);
}

static int build_cnn(bench_case *bc, uint64_t seed) {
    ag_module *m = NULL;
    ag_tensor *zin[8];
    int nz = 0;
    if (ag_zoo_build("cnn", NULL, &m, zin, 8, &nz))
        return -1;
    for (int i = 0; i < nz; i++)
        ag_tensor_free(zin[i]);
    ag_manual_seed(seed);
    snprintf(bc->name, sizeof bc->name, "cnn");
    snprintf(bc->what, sizeof bc->what,
             "the zoo's cnn (training mode), x f32[128, 1, 28, 28] in [0, 1), cross-entropy over "
             "10 classes, AdamW");
    bc->in[0] = ag_rand(AG_F32, 4, (int64_t[]){128, 1, 28, 28});
    bc->in[1] = random_targets(1, (int64_t[]){128}, 10, seed);
    bc->nin = 2;
    return case_finish(bc, m, LOSS_CE, 1e-4, 0.999, 0.01);
}

static int build_gpt2_small(bench_case *bc, uint64_t seed) {
    ag_gpt2_config cfg = ag_gpt2_config_small();
    ag_manual_seed(seed);
    ag_module *m = ag_nn_gpt2(&cfg);
    if (!m)
        return -1;
    snprintf(bc->name, sizeof bc->name, "gpt2-small");
    snprintf(bc->what, sizeof bc->what,
             "GPT-2 small (12 layers, 768 wide, 12 heads, vocab 50257, %.1fM parameters), idx "
             "and targets i64[4, 64], the model's cross-entropy, AdamW, fp32",
             (double)ag_module_num_parameters(m) / 1e6);
    int64_t bt[2] = {4, 64};
    bc->in[0] = random_targets(2, bt, cfg.vocab_size, seed);
    bc->in[1] = random_targets(2, bt, cfg.vocab_size, seed + 1);
    bc->nin = 2;
    return case_finish(bc, m, LOSS_GPT2, 1e-4, 0.95, 0.1);
}

static const struct {
    const char *name;
    int (*build)(bench_case *bc, uint64_t seed);
} models[] = {
    {"mlp", build_mlp},
    {"cnn", build_cnn},
    {"gpt2-small", build_gpt2_small},
};
#define NMODELS ((int)(sizeof models / sizeof models[0]))

/* ---- one step ---- */

/* Seconds spent in each phase of the steps run since the last reset (--profile). */
typedef struct phases {
    double forward, backward, optim, total;
    const double *kernel_clock; /* seconds spent in plan kernels so far (the profile's), or NULL */
    double fw_kernels, bw_kernels;
} phases;

/* One training step: forward through c (NULL: eagerly), backward, AdamW step, zero_grad. The
 * loss goes to *loss when loss is not NULL; phase times are added to *ph when not NULL. */
/* The loss's value; a tensor subclass instance (the two_tensor model's loss is a TwoTensor)
 * holds no data itself: the sum of its plain inner tensors' values stands for it. */
static double loss_value(ag_tensor *l) {
    if (!l || !ag_tensor_subclass(l))
        return ag_tensor_item(l);
    ag_tensor *inner[16];
    int n = ag_subclass_flatten_tensors(&l, 1, inner, 16);
    double v = n > 0 && n <= 16 ? 0 : NAN;
    for (int i = 0; i < n && i < 16; i++)
        v += ag_tensor_item(inner[i]);
    return v;
}

static int one_step(bench_case *bc, ag_compiled *c, double *loss, phases *ph) {
    double t0 = ph ? now_s() : 0, t1 = 0, t2 = 0, t3 = 0;
    double k0 = ph && ph->kernel_clock ? *ph->kernel_clock : 0, k1 = k0, k2 = k0;
    ag_scope_begin();
    ag_tensor *l = NULL;
    int rc = c ? ag_compiled_call_module(c, bc->step, bc->in, bc->nin, &l, 1)
               : ag_module_call(bc->step, bc->in, bc->nin, &l, 1);
    if (ph) {
        t1 = now_s();
        k1 = ph->kernel_clock ? *ph->kernel_clock : 0;
    }
    if (rc == 1) {
        if (loss)
            *loss = loss_value(l);
        rc = ag_backward(l, NULL, false);
    } else if (rc >= 0) {
        fprintf(stderr, "aotgrad bench: %s: the step returned %d outputs, not 1\n", bc->name, rc);
        rc = AG_EINVAL;
    }
    if (ph) {
        t2 = now_s();
        k2 = ph->kernel_clock ? *ph->kernel_clock : 0;
    }
    if (rc == 0)
        rc = ag_optim_step(bc->opt);
    if (ph)
        t3 = now_s();
    ag_optim_zero_grad(bc->opt);
    ag_scope_end();
    if (ph) {
        double t4 = now_s();
        ph->forward += t1 - t0;
        ph->backward += t2 - t1;
        ph->optim += t3 - t2;
        ph->total += t4 - t0;
        ph->fw_kernels += k1 - k0;
        ph->bw_kernels += k2 - k1;
    }
    return rc;
}

/* Times nmodes variants of the step (cs[i] NULL: eager), interleaved: `warmup` steps of each,
 * then `runs` rounds, each timing one run of every variant. A run repeats the step *reps
 * times, reps chosen from the slowest variant's last warm-up step so that a run lasts at least
 * MIN_RUN_S. med[i] gets variant i's median seconds per step. */
static int time_steps(bench_case *bc, ag_compiled *const *cs, int nmodes, int runs, int warmup,
                      double *med, int *reps) {
    double slowest = 0;
    for (int i = 0; i < nmodes; i++)
        for (int w = 0; w < (warmup > 0 ? warmup : 1); w++) {
            double loss = NAN, t0 = now_s();
            if (one_step(bc, cs[i], &loss, NULL)) {
                bench_error(bc->name);
                return -1;
            }
            if (!isfinite(loss)) {
                fprintf(stderr, "aotgrad bench: %s: the loss is %g\n", bc->name, loss);
                return -1;
            }
            slowest = fmax(slowest, now_s() - t0);
        }
    int r = slowest > 0 ? (int)ceil(MIN_RUN_S / slowest) : MAX_REPS;
    *reps = r < 1 ? 1 : (r > MAX_REPS ? MAX_REPS : r);
    double *samples = malloc(sizeof(double) * (size_t)(nmodes * runs));
    if (!samples)
        return -1;
    for (int k = 0; k < runs; k++)
        for (int i = 0; i < nmodes; i++) {
            double t0 = now_s();
            for (int s = 0; s < *reps; s++)
                if (one_step(bc, cs[i], NULL, NULL)) {
                    bench_error(bc->name);
                    free(samples);
                    return -1;
                }
            samples[i * runs + k] = (now_s() - t0) / *reps;
        }
    for (int i = 0; i < nmodes; i++)
        med[i] = median(samples + i * runs, runs);
    free(samples);
    return 0;
}

/* ---- the capture pipeline ---- */

typedef struct pipe_times {
    double export_s;    /* ag_export_joint: tracing and export are one call */
    double compile_s;   /* ag_compile_joint (min-cut, budget 1): partition + plans */
    double partition_s; /* ag_partition alone, the same options */
    double plan_s;      /* ag_plan_new of the forward and backward graphs */
    int nodes, fw_nodes, bw_nodes;
} pipe_times;

static const ag_compile_opts mincut1 = {
    .partition = {.partitioner = AG_PARTITION_MINCUT, .memory_budget = 1.0}};

/* One pass of the pipeline on step(in...). */
static int pipeline_once(ag_module *step, ag_tensor *const *in, int nin, pipe_times *pt) {
    double t0 = now_s();
    ag_joint *j = ag_export_joint(step, in, nin, NULL, NULL, 0, NULL);
    if (!j)
        return -1;
    double t1 = now_s();
    ag_compiled *c = ag_compile_joint(j, &mincut1);
    double t2 = now_s();
    ag_graph *fw = NULL, *bw = NULL;
    ag_plan *pf = NULL, *pb = NULL;
    int rc = c ? ag_partition(ag_joint_graph(j), ag_joint_num_fw_outputs(j), &mincut1.partition,
                              &fw, &bw, NULL)
               : -1;
    double t3 = now_s();
    if (rc == 0) {
        pf = ag_plan_new(fw, NULL);
        pb = pf && bw ? ag_plan_new(bw, NULL) : NULL;
        if (!pf || (bw && !pb))
            rc = -1;
    }
    double t4 = now_s();
    if (rc == 0) {
        pt->export_s = t1 - t0;
        pt->compile_s = t2 - t1;
        pt->partition_s = t3 - t2;
        pt->plan_s = t4 - t3;
        pt->nodes = ag_graph_num_nodes(ag_joint_graph(j));
        pt->fw_nodes = ag_graph_num_nodes(fw);
        pt->bw_nodes = bw ? ag_graph_num_nodes(bw) : 0;
    }
    ag_plan_free(pf);
    ag_plan_free(pb);
    ag_graph_free(fw);
    ag_graph_free(bw);
    ag_compiled_free(c);
    ag_joint_free(j);
    return rc;
}

/* The median of each time over `runs` passes, after one untimed pass. */
static int time_pipeline(ag_module *step, ag_tensor *const *in, int nin, int runs,
                         pipe_times *out) {
    pipe_times p;
    if (pipeline_once(step, in, nin, &p))
        return -1;
    double *v = malloc(sizeof(double) * 4 * (size_t)runs);
    if (!v)
        return -1;
    for (int k = 0; k < runs; k++) {
        if (pipeline_once(step, in, nin, &p)) {
            free(v);
            return -1;
        }
        v[k] = p.export_s;
        v[runs + k] = p.compile_s;
        v[2 * runs + k] = p.partition_s;
        v[3 * runs + k] = p.plan_s;
    }
    *out = p;
    out->export_s = median(v, runs);
    out->compile_s = median(v + runs, runs);
    out->partition_s = median(v + 2 * runs, runs);
    out->plan_s = median(v + 3 * runs, runs);
    free(v);
    return 0;
}

/* ---- planned memory ---- */

typedef struct peak_info {
    int64_t fw_arena, bw_arena; /* ag_compiled_peak_bytes */
    int64_t saved_activations;  /* distinct storages of saved values the forward computes */
    int64_t peak;               /* fw_arena + bw_arena + saved_activations */
    int saved_tensors;          /* ag_partition_stats */
    int64_t saved_bytes;        /* ag_partition_stats: every saved value, inputs included */
    int recomputed_nodes;
    double compile_s;
} peak_info;

static int64_t meta_bytes(const ag_tmeta *m) {
    int64_t n = 1;
    for (int d = 0; d < m->ndim; d++)
        n *= m->sizes[d];
    return n * (int64_t)ag_dtype_size(m->dtype);
}

/* The node whose kernel made v's storage: views are followed to their base. NULL when the
 * storage is a graph input's or a constant's. */
static const ag_node *storage_root(const ag_node *v) {
    while (v && ag_node_kind_of(v) == AG_NODE_CALL &&
           (ag_op_def(ag_node_op(v))->flags & AG_OP_VIEW))
        v = ag_node_arg_node(v, 0);
    return v && (ag_node_kind_of(v) == AG_NODE_CALL || ag_node_kind_of(v) == AG_NODE_GETITEM)
               ? v
               : NULL;
}

static int peak_of(const ag_joint *j, const ag_compiled *c, peak_info *pk) {
    const ag_graph *fw = ag_compiled_forward_graph(c);
    ag_node *out = ag_graph_output_node(fw);
    const ag_garg *outs = ag_node_arg(out, 0);
    int nfw = ag_joint_num_fw_outputs(j);
    const ag_node **seen = calloc((size_t)(outs->n > 0 ? outs->n : 1), sizeof *seen);
    if (!seen)
        return -1;
    int nseen = 0;
    pk->saved_activations = 0;
    for (int i = nfw; i < outs->n; i++) {
        const ag_node *r = storage_root(outs->u.nodes[i]);
        bool dup = !r;
        for (int k = 0; !dup && k < nseen; k++)
            dup = seen[k] == r;
        if (dup)
            continue;
        seen[nseen++] = r;
        pk->saved_activations += meta_bytes(ag_node_val(r, 0));
    }
    free(seen);
    const ag_partition_stats *st = ag_compiled_stats(c);
    pk->fw_arena = ag_compiled_peak_bytes(c, false);
    pk->bw_arena = ag_compiled_peak_bytes(c, true);
    pk->peak = pk->fw_arena + (pk->bw_arena > 0 ? pk->bw_arena : 0) + pk->saved_activations;
    pk->saved_tensors = st->saved_tensors;
    pk->saved_bytes = st->saved_bytes;
    pk->recomputed_nodes = st->recomputed_nodes;
    return 0;
}

static const struct {
    const char *key;
    ag_partitioner partitioner;
    double budget;
} peak_cfgs[] = {
    {"default", AG_PARTITION_DEFAULT, 1.0},
    {"mincut_1", AG_PARTITION_MINCUT, 1.0},
    {"mincut_0.5", AG_PARTITION_MINCUT, 0.5},
    {"mincut_0", AG_PARTITION_MINCUT, 0.0},
};
#define NPEAK ((int)(sizeof peak_cfgs / sizeof peak_cfgs[0]))

/* ---- the GEMM floor ---- */

/* One GEMM call of a kernel: `count` products C (m, n) = op(A) (m, k) op(B) (k, n) + beta C,
 * row-major. par: the kernel spreads them over threads with BLAS single-threaded inside
 * (convolution's images, attention's heads, small bmm batches); otherwise they run one after
 * the other and BLAS threads each. shared_a: every product reads one A (a convolution's
 * weight). */
typedef struct gemm_call {
    const char *op;
    CBLAS_TRANSPOSE ta, tb;
    int64_t m, n, k, count;
    float beta;
    bool par, shared_a;
} gemm_call;

typedef struct gemm_list {
    gemm_call *v;
    int n, cap;
    double flops;
} gemm_list;

static int gemm_add(gemm_list *l, const char *op, CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int64_t m,
                    int64_t n, int64_t k, int64_t count, float beta, bool par, bool shared_a) {
    if (m <= 0 || n <= 0 || k <= 0 || count <= 0)
        return 0;
    if (l->n == l->cap) {
        int cap = l->cap ? 2 * l->cap : 64;
        gemm_call *v = realloc(l->v, sizeof *v * (size_t)cap);
        if (!v)
            return -1;
        l->v = v;
        l->cap = cap;
    }
    l->v[l->n++] = (gemm_call){op, ta, tb, m, n, k, count, beta, par, shared_a};
    l->flops += 2.0 * (double)m * (double)n * (double)k * (double)count;
    return 0;
}

/* How linalg.c's kernels hand a (rows, cols) operand with strides (s0, s1) to BLAS: as it is
 * (row-major), transposed (column-major), or, when BLAS cannot read it, as a contiguous copy. */
static CBLAS_TRANSPOSE blas_trans(const ag_tmeta *v) {
    int nd = v->ndim;
    int64_t rows = v->sizes[nd - 2], cols = v->sizes[nd - 1];
    int64_t s0 = v->strides[nd - 2], s1 = v->strides[nd - 1];
    int64_t rmin = rows > 1 ? rows : 1, cmin = cols > 1 ? cols : 1;
    if ((s1 == 1 || cols <= 1) && (rows <= 1 || s0 >= cmin))
        return CblasNoTrans;
    if ((s0 == 1 || rows <= 1) && (cols <= 1 || s1 >= rmin))
        return CblasTrans;
    return CblasNoTrans;
}

static const ag_tmeta *arg_val(const ag_node *n, int i) {
    ag_node *a = ag_node_arg_node(n, i);
    return a ? ag_node_val(a, 0) : NULL;
}

static int64_t arg_int(const ag_node *n, int i, int64_t dflt) {
    const ag_garg *a = i < ag_node_nargs(n) ? ag_node_arg(n, i) : NULL;
    return a && a->kind == AG_GA_INT ? a->u.i : dflt;
}

static double arg_scalar(const ag_node *n, int i, double dflt) {
    const ag_garg *a = i < ag_node_nargs(n) ? ag_node_arg(n, i) : NULL;
    if (a && a->kind == AG_GA_INT)
        return (double)a->u.i;
    return a && a->kind == AG_GA_FLOAT ? a->u.f : dflt;
}

static int64_t lead_numel(const ag_tmeta *v, int trailing) {
    int64_t n = 1;
    for (int d = 0; d < v->ndim - trailing; d++)
        n *= v->sizes[d];
    return n;
}

/* Appends the GEMM calls the kernels of g's nodes make, with the shapes, transposes and
 * threading the kernels choose (src/ops/linalg.c, conv_kernels.inc, nn_ops.c). */
static int collect_gemms(const ag_graph *g, int nthreads, gemm_list *l) {
    int rc = 0;
    for (ag_node *n = ag_graph_first(g); n && rc == 0; n = ag_node_next(n)) {
        if (ag_node_kind_of(n) != AG_NODE_CALL)
            continue;
        const char *op = ag_op_name(ag_node_op(n));
        const ag_tmeta *out = ag_node_val(n, 0);
        if (!strcmp(op, "mm") || !strcmp(op, "addmm")) {
            int o = !strcmp(op, "addmm");
            const ag_tmeta *a = arg_val(n, o), *b = arg_val(n, o + 1);
            float beta = o ? (float)arg_scalar(n, 3, 1.0) : 0.0f;
            rc = gemm_add(l, op, blas_trans(a), blas_trans(b), out->sizes[0], out->sizes[1],
                          a->sizes[1], 1, beta, false, false);
        } else if (!strcmp(op, "bmm")) {
            const ag_tmeta *a = arg_val(n, 0), *b = arg_val(n, 1);
            int64_t B = out->sizes[0], m = out->sizes[1], nn = out->sizes[2], k = a->sizes[2];
            bool par = B > 1 && m * nn * k <= (1 << 20) && nthreads > 1;
            rc = gemm_add(l, op, blas_trans(a), blas_trans(b), m, nn, k, B, 0, par, false);
        } else if (!strcmp(op, "convolution") || !strcmp(op, "convolution_backward")) {
            /* im2col + GEMM per image and group: x (N, C, H, W), w (O, C/G, kh, kw), output
             * (N, O, OH, OW); images spread over threads. */
            bool bwd = op[11] == '_';
            const ag_tmeta *x = arg_val(n, bwd ? 1 : 0), *w = arg_val(n, bwd ? 2 : 1);
            const ag_tmeta *y = bwd ? arg_val(n, 0) : out;
            int64_t G = arg_int(n, bwd ? 9 : 8, 1), N = x->sizes[0];
            int64_t Og = w->sizes[0] / G, K = w->sizes[1] * w->sizes[2] * w->sizes[3];
            int64_t P = y->sizes[2] * y->sizes[3];
            bool par = N > 1 && nthreads > 1;
            if (!bwd) {
                bool bias = ag_node_arg_node(n, 2) != NULL;
                rc = gemm_add(l, op, CblasNoTrans, CblasNoTrans, Og, P, K, N * G, bias ? 1 : 0, par,
                              true);
            } else {
                const ag_garg *mask = ag_node_nargs(n) > 10 ? ag_node_arg(n, 10) : NULL;
                bool gx = !mask || mask->kind != AG_GA_INTS || mask->n < 2 || mask->u.ints[0];
                bool gw = !mask || mask->kind != AG_GA_INTS || mask->n < 2 || mask->u.ints[1];
                if (gx) /* gx columns = w^T @ go */
                    rc = gemm_add(l, op, CblasTrans, CblasNoTrans, K, P, Og, N * G, 0, par, true);
                if (gw && rc == 0) /* gw += go @ im2col(x)^T */
                    rc = gemm_add(l, op, CblasNoTrans, CblasTrans, Og, K, P, N * G, 1, par, false);
            }
        } else if (!strncmp(op, "_scaled_dot_product_flash_attention_for_cpu", 43)) {
            /* Per (batch, head), one per thread: forward S = Q K^T, O = P V; backward recomputes
             * S = Q K^T, then dV = P^T dO, dP = dO V^T, dQ = dS K, dK = dS^T Q. */
            bool bwd = op[43] == '_';
            const ag_tmeta *q = arg_val(n, bwd ? 1 : 0), *k = arg_val(n, bwd ? 2 : 1),
                           *v = arg_val(n, bwd ? 3 : 2);
            int64_t nb = lead_numel(q, 2), L = q->sizes[q->ndim - 2], S = k->sizes[k->ndim - 2];
            int64_t E = q->sizes[q->ndim - 1], Ev = v->sizes[v->ndim - 1];
            bool par = nb > 1 && nthreads > 1;
            const CBLAS_TRANSPOSE N_ = CblasNoTrans, T_ = CblasTrans;
            rc = gemm_add(l, op, N_, T_, L, S, E, nb, 0, par, false);
            if (!bwd) {
                if (rc == 0)
                    rc = gemm_add(l, op, N_, N_, L, Ev, S, nb, 0, par, false);
            } else {
                if (rc == 0)
                    rc = gemm_add(l, op, T_, N_, S, Ev, L, nb, 0, par, false);
                if (rc == 0)
                    rc = gemm_add(l, op, N_, T_, L, S, Ev, nb, 0, par, false);
                if (rc == 0)
                    rc = gemm_add(l, op, N_, N_, L, E, S, nb, 0, par, false);
                if (rc == 0)
                    rc = gemm_add(l, op, T_, N_, S, E, L, nb, 0, par, false);
            }
        }
    }
    return rc;
}

/* Runs every call of the list once on the buffers a, b, c (large enough for any call). */
static void run_gemms(const gemm_list *l, const float *a, const float *b, float *c, int nthreads) {
    for (int i = 0; i < l->n; i++) {
        const gemm_call *g = &l->v[i];
        const int m = (int)g->m, n = (int)g->n, k = (int)g->k;
        const int lda = g->ta == CblasNoTrans ? k : m, ldb = g->tb == CblasNoTrans ? n : k;
        const size_t sa = g->shared_a ? 0 : (size_t)(m * k), sb = (size_t)(k * n),
                     sc = (size_t)(m * n);
        const int64_t cnt = g->count;
        if (g->par && cnt > 1) {
            int nthr = cnt < nthreads ? (int)cnt : nthreads;
#pragma omp parallel for schedule(static) num_threads(nthr)
            for (int64_t j = 0; j < cnt; j++)
                cblas_sgemm(CblasRowMajor, g->ta, g->tb, m, n, k, 1.0f, a + (size_t)j * sa, lda,
                            b + (size_t)j * sb, ldb, g->beta, c + (size_t)j * sc, n);
        } else {
            for (int64_t j = 0; j < cnt; j++)
                cblas_sgemm(CblasRowMajor, g->ta, g->tb, m, n, k, 1.0f, a + (size_t)j * sa, lda,
                            b + (size_t)j * sb, ldb, g->beta, c + (size_t)j * sc, n);
        }
    }
}

static size_t size_max(size_t a, size_t b) {
    return a > b ? a : b;
}

static float *filled(size_t n) {
    float *p = aligned_alloc(64, ((n * sizeof(float) + 63) / 64) * 64);
    for (size_t i = 0; p && i < n; i++)
        p[i] = 0.01f * (float)((int)(i % 97) - 48);
    return p;
}

/* The median seconds of one pass over the list, after one untimed pass. Buffers are allocated
 * once, as large as the largest call needs, and shared by all calls. */
static int time_gemms(const gemm_list *l, int runs, int nthreads, double *out) {
    size_t na = 1, nb = 1, nc = 1;
    for (int i = 0; i < l->n; i++) {
        const gemm_call *g = &l->v[i];
        size_t cnt = (size_t)g->count;
        na = size_max(na, (g->shared_a ? 1 : cnt) * (size_t)(g->m * g->k));
        nb = size_max(nb, cnt * (size_t)(g->k * g->n));
        nc = size_max(nc, cnt * (size_t)(g->m * g->n));
    }
    float *a = filled(na), *b = filled(nb), *c = filled(nc);
    double *v = malloc(sizeof(double) * (size_t)runs);
    int rc = a && b && c && v ? 0 : -1;
    if (rc == 0) {
        run_gemms(l, a, b, c, nthreads);
        for (int k = 0; k < runs; k++) {
            double t0 = now_s();
            run_gemms(l, a, b, c, nthreads);
            v[k] = now_s() - t0;
        }
        *out = median(v, runs);
    } else {
        fprintf(stderr, "aotgrad bench: out of memory for the GEMM floor's buffers\n");
    }
    free(a);
    free(b);
    free(c);
    free(v);
    return rc;
}

static bool same_call(const gemm_call *a, const gemm_call *b) {
    return !strcmp(a->op, b->op) && a->ta == b->ta && a->tb == b->tb && a->m == b->m &&
           a->n == b->n && a->k == b->k && a->count == b->count && a->beta == b->beta &&
           a->par == b->par && a->shared_a == b->shared_a;
}

/* --gemms: the list, identical calls merged, in order of first appearance. */
static void print_gemms(const char *model, const gemm_list *l) {
    printf("GEMM calls of one compiled %s step (%.3g GFLOP):\n", model, l->flops / 1e9);
    printf("  %-52s %2s %2s %7s %7s %7s %6s %5s %4s %5s\n", "op", "tA", "tB", "m", "n", "k",
           "count", "beta", "par", "calls");
    for (int i = 0; i < l->n; i++) {
        const gemm_call *g = &l->v[i];
        bool first = true;
        for (int j = 0; first && j < i; j++)
            first = !same_call(&l->v[j], g);
        if (!first)
            continue;
        int calls = 0;
        for (int j = i; j < l->n; j++)
            calls += same_call(&l->v[j], g);
        printf("  %-52s %2s %2s %7lld %7lld %7lld %6lld %5g %4s %5d\n", g->op,
               g->ta == CblasTrans ? "T" : "N", g->tb == CblasTrans ? "T" : "N", (long long)g->m,
               (long long)g->n, (long long)g->k, (long long)g->count, (double)g->beta,
               g->par ? "yes" : "no", calls);
    }
}

/* The list as JSON, one object per call in order (bench/bench_sgemm times it against other
 * BLAS libraries). */
static json_t *gemms_json(const gemm_list *l) {
    json_t *a = json_array();
    for (int i = 0; a && i < l->n; i++) {
        const gemm_call *g = &l->v[i];
        json_array_append_new(a, json_pack("{s:s, s:s, s:s, s:I, s:I, s:I, s:I, s:f, s:b, s:b}",
                                           "op", g->op, "ta", g->ta == CblasTrans ? "T" : "N", "tb",
                                           g->tb == CblasTrans ? "T" : "N", "m", (json_int_t)g->m,
                                           "n", (json_int_t)g->n, "k", (json_int_t)g->k, "count",
                                           (json_int_t)g->count, "beta", (double)g->beta, "par",
                                           g->par, "shared_a", g->shared_a));
    }
    return a;
}

/* ---- the per-kernel profile (--profile) ---- */

typedef struct prof_entry {
    const char *op;
    double s;
    long calls;
} prof_entry;

typedef struct prof {
    const char *cur; /* the kernel running since `last`, or NULL */
    double last;
    double sum; /* seconds of every kernel so far */
    prof_entry e[256];
    int n;
} prof;

/* The plan's step hook: called before each kernel and (NULL) after a run's last. */
static void prof_hook(const char *op, const char *node, void *ud) {
    prof *p = ud;
    double t = now_s();
    (void)node;
    if (p->cur) {
        int i = 0;
        while (i < p->n && strcmp(p->e[i].op, p->cur))
            i++;
        if (i == p->n && p->n < (int)(sizeof p->e / sizeof p->e[0]))
            p->e[p->n++] = (prof_entry){p->cur, 0, 0};
        p->sum += t - p->last;
        if (i < p->n) {
            p->e[i].s += t - p->last;
            p->e[i].calls++;
        }
    }
    p->cur = op;
    p->last = t;
}

static int cmp_prof(const void *a, const void *b) {
    double x = ((const prof_entry *)a)->s, y = ((const prof_entry *)b)->s;
    return x > y ? -1 : x < y;
}

/* Runs `runs` compiled steps with phase timers and the kernel hook; prints the breakdown and
 * returns it as JSON (NULL on failure). */
static json_t *profile_step(bench_case *bc, ag_compiled *c, int runs, double floor_s) {
    prof *p = calloc(1, sizeof *p);
    phases ph = {0};
    if (!p)
        return NULL;
    ph.kernel_clock = &p->sum;
    ag__plan_set_step_hook(prof_hook, p);
    int rc = 0;
    for (int k = 0; k < runs && rc == 0; k++)
        rc = one_step(bc, c, NULL, &ph);
    ag__plan_set_step_hook(NULL, NULL);
    if (rc) {
        bench_error(bc->name);
        free(p);
        return NULL;
    }
    qsort(p->e, (size_t)p->n, sizeof p->e[0], cmp_prof);
    double kernels = p->sum, per = 1.0 / runs, tot = ph.total * per;
    printf("\nwhere the time goes: compiled (min-cut) %s step, mean of %d steps: %.1f ms\n",
           bc->name, runs, 1e3 * tot);
    printf("  phases: forward call %.1f ms (kernels %.1f), backward %.1f ms (kernels %.1f), AdamW "
           "step %.1f ms, zero_grad and releasing the step's tensors %.1f ms\n",
           1e3 * ph.forward * per, 1e3 * ph.fw_kernels * per, 1e3 * ph.backward * per,
           1e3 * ph.bw_kernels * per, 1e3 * ph.optim * per,
           1e3 * (ph.total - ph.forward - ph.backward - ph.optim) * per);
    printf("  kernels of the two plans: %.1f ms (%.0f%% of the step); outside them (runtime "
           "wrappers, autograd engine, gradient accumulation, optimizer): %.1f ms\n",
           1e3 * kernels * per, 100 * kernels * per / tot, 1e3 * (tot - kernels * per));
    if (floor_s > 0)
        printf("  GEMM floor %.1f ms = %.0f%% of the step\n", 1e3 * floor_s, 100 * floor_s / tot);
    printf("  %-52s %9s %6s %6s\n", "kernel", "ms/step", "%step", "calls");
    json_t *ops = json_array();
    for (int i = 0; i < p->n; i++) {
        if (i < 15)
            printf("  %-52s %9.2f %5.1f%% %6ld\n", p->e[i].op, 1e3 * p->e[i].s * per,
                   100 * p->e[i].s * per / tot, (long)(p->e[i].calls / runs));
        json_array_append_new(ops,
                              json_pack("{s:s, s:f, s:I}", "op", p->e[i].op, "s", p->e[i].s * per,
                                        "calls", (json_int_t)(p->e[i].calls / runs)));
    }
    json_t *j =
        json_pack("{s:f, s:f, s:f, s:f, s:f, s:f, s:f, s:o}", "step_s", tot, "forward_s",
                  ph.forward * per, "forward_kernels_s", ph.fw_kernels * per, "backward_s",
                  ph.backward * per, "backward_kernels_s", ph.bw_kernels * per, "optimizer_s",
                  ph.optim * per, "kernels_s", kernels * per, "kernels", ops);
    free(p);
    return j;
}

/* ---- one model ---- */

typedef struct bench_opts {
    int runs, warmup, threads;
    uint64_t seed;
    bool profile, gemms;
} bench_opts;

typedef struct model_result {
    char name[32];
    double eager, dflt, mincut, floor_s, gemm_flops;
    int reps, gemm_calls;
    pipe_times pipe;
    peak_info peak[NPEAK];
} model_result;

static json_t *peak_json(const model_result *r, bool detail) {
    json_t *o = json_object();
    for (int i = 0; i < NPEAK; i++) {
        const peak_info *p = &r->peak[i];
        json_t *v =
            detail ? json_pack("{s:I, s:I, s:I, s:I, s:i, s:I, s:i, s:f}", "forward_arena",
                               (json_int_t)p->fw_arena, "backward_arena", (json_int_t)p->bw_arena,
                               "saved_activations", (json_int_t)p->saved_activations, "peak",
                               (json_int_t)p->peak, "saved_tensors", p->saved_tensors,
                               "partitioner_saved_bytes", (json_int_t)p->saved_bytes,
                               "recomputed_nodes", p->recomputed_nodes, "compile_s", p->compile_s)
                   : json_integer((json_int_t)p->peak);
        json_object_set_new(o, peak_cfgs[i].key, v);
    }
    return o;
}

static json_t *model_json(const model_result *r, const bench_case *bc, const gemm_list *gl,
                          json_t *profile) {
    const pipe_times *p = &r->pipe;
    json_t *j = json_pack("{s:s, s:s, s:i, s:f, s:{s:f, s:f}, s:f, s:o, s:f, s:i, s:o, s:i, "
                          "s:{s:f, s:f, s:f, s:f, s:f}, s:{s:i, s:i, s:i}}",
                          "model", r->name, "what", bc->what, "threads", omp_get_max_threads(),
                          "eager_step_s", r->eager, "compiled_step_s", "default", r->dflt, "mincut",
                          r->mincut, "gemm_floor_s", r->floor_s, "compiled_over_floor",
                          jratio(r->mincut, r->floor_s), "gemm_flops", r->gemm_flops, "gemm_calls",
                          r->gemm_calls, "eager_over_compiled", jratio(r->eager, r->mincut), "reps",
                          r->reps, "pipeline_s", "total", p->export_s + p->compile_s,
                          "trace_export", p->export_s, "partition_compile", p->compile_s,
                          "partition", p->partition_s, "plans", p->plan_s, "nodes", "joint",
                          p->nodes, "forward", p->fw_nodes, "backward", p->bw_nodes);
    json_object_set_new(j, "peak_bytes", peak_json(r, false));
    json_object_set_new(j, "peak_detail", peak_json(r, true));
    json_object_set_new(j, "gemms", gemms_json(gl));
    if (profile)
        json_object_set_new(j, "profile", profile);
    return j;
}

static int bench_model(int which, const bench_opts *o, model_result *r, json_t **out) {
    bench_case bc = {0};
    ag_joint *j = NULL;
    ag_compiled *cs[NPEAK] = {0};
    gemm_list gl = {0};
    json_t *profile = NULL;
    int status = -1;
    memset(r, 0, sizeof *r);
    snprintf(r->name, sizeof r->name, "%s", models[which].name);
    note("%s: building", r->name);
    if (models[which].build(&bc, o->seed)) {
        bench_error(r->name);
        goto done;
    }
    printf("%s: %s\n", bc.name, bc.what);
    note("%s: capture pipeline", r->name);
    if (time_pipeline(bc.step, bc.in, bc.nin, o->runs, &r->pipe)) {
        bench_error(r->name);
        goto done;
    }
    j = ag_export_joint(bc.step, bc.in, bc.nin, NULL, NULL, 0, NULL);
    if (!j) {
        bench_error(r->name);
        goto done;
    }
    for (int i = 0; i < NPEAK; i++) {
        ag_compile_opts co = {
            .partition = {.partitioner = peak_cfgs[i].partitioner,
                          .memory_budget = ag_memory_budget(peak_cfgs[i].budget)}};
        double t0 = now_s();
        cs[i] = ag_compile_joint(j, &co);
        r->peak[i].compile_s = now_s() - t0;
        if (!cs[i] || peak_of(j, cs[i], &r->peak[i])) {
            bench_error(r->name);
            goto done;
        }
    }
    /* Keep the two step-timed compilations; the others only had their memory read. */
    for (int i = 2; i < NPEAK; i++) {
        ag_compiled_free(cs[i]);
        cs[i] = NULL;
    }
    if (collect_gemms(ag_compiled_forward_graph(cs[1]), o->threads, &gl) ||
        collect_gemms(ag_compiled_backward_graph(cs[1]), o->threads, &gl)) {
        fprintf(stderr, "aotgrad bench: %s: out of memory listing GEMMs\n", r->name);
        goto done;
    }
    r->gemm_flops = gl.flops;
    r->gemm_calls = gl.n;
    if (o->gemms)
        print_gemms(r->name, &gl);
    note("%s: GEMM floor (%d calls, %.3g GFLOP)", r->name, gl.n, gl.flops / 1e9);
    if (time_gemms(&gl, o->runs, o->threads, &r->floor_s))
        goto done;
    note("%s: steps", r->name);
    ag_compiled *modes[3] = {NULL, cs[0], cs[1]};
    double med[3];
    if (time_steps(&bc, modes, 3, o->runs, o->warmup, med, &r->reps))
        goto done;
    r->eager = med[0];
    r->dflt = med[1];
    r->mincut = med[2];
    if (o->profile && !(profile = profile_step(&bc, cs[1], o->runs, r->floor_s)))
        goto done;
    *out = model_json(r, &bc, &gl, profile);
    status = 0;
done:
    free(gl.v);
    for (int i = 0; i < NPEAK; i++)
        ag_compiled_free(cs[i]);
    ag_joint_free(j);
    case_free(&bc);
    return status;
}

/* ---- the zoo: eager against compiled ---- */

typedef struct zoo_result {
    const char *name;
    double eager, dflt, mincut;
    int reps;
} zoo_result;

static int bench_zoo_model(int i, const bench_opts *o, zoo_result *r) {
    bench_case bc = {0};
    ag_module *model = NULL;
    ag_joint *j = NULL;
    ag_compiled *c[2] = {0};
    int status = -1;
    r->name = ag_zoo_name(i);
    if (ag_zoo_build(r->name, NULL, &model, bc.in, 8, &bc.nin)) {
        bench_error(r->name);
        return -1;
    }
    snprintf(bc.name, sizeof bc.name, "%s", r->name);
    if (case_finish(&bc, model, LOSS_SUM, 1e-4, 0.999, 0.01)) {
        bench_error(r->name);
        goto done;
    }
    j = ag_export_joint(bc.step, bc.in, bc.nin, NULL, NULL, 0, NULL);
    ag_compile_opts dflt = {.partition = {.partitioner = AG_PARTITION_DEFAULT, .memory_budget = 1}};
    c[0] = j ? ag_compile_joint(j, &dflt) : NULL;
    c[1] = c[0] ? ag_compile_joint(j, &mincut1) : NULL;
    if (!c[1]) {
        bench_error(r->name);
        goto done;
    }
    ag_compiled *modes[3] = {NULL, c[0], c[1]};
    double med[3];
    if (time_steps(&bc, modes, 3, o->runs, o->warmup, med, &r->reps))
        goto done;
    r->eager = med[0];
    r->dflt = med[1];
    r->mincut = med[2];
    status = 0;
done:
    ag_compiled_free(c[0]);
    ag_compiled_free(c[1]);
    ag_joint_free(j);
    case_free(&bc);
    return status;
}

static int bench_zoo(const bench_opts *o, json_t *arr) {
    int n = ag_zoo_count(), status = 0;
    zoo_result *rs = calloc((size_t)n, sizeof *rs);
    if (!rs)
        return -1;
    for (int i = 0; i < n; i++) {
        note("zoo: %s", ag_zoo_name(i));
        if (bench_zoo_model(i, o, &rs[i])) {
            status = -1;
            rs[i].name = NULL;
        }
    }
    printf("\nzoo: eager against compiled steps (loss = weighted sum of the outputs, AdamW), "
           "%d threads, median of %d runs\n",
           omp_get_max_threads(), o->runs);
    printf("  %-14s %12s %12s %12s %13s %5s\n", "model", "eager ms", "default ms", "mincut ms",
           "eager/mincut", "reps");
    for (int i = 0; i < n; i++) {
        const zoo_result *r = &rs[i];
        if (!r->name)
            continue;
        printf("  %-14s %12.4f %12.4f %12.4f %12.2fx %5d%s\n", r->name, 1e3 * r->eager,
               1e3 * r->dflt, 1e3 * r->mincut, r->eager / r->mincut, r->reps,
               r->dflt > r->eager && r->mincut > r->eager ? "  both compiled slower"
               : r->dflt > r->eager                       ? "  default slower"
               : r->mincut > r->eager                     ? "  mincut slower"
                                                          : "");
        json_array_append_new(arr, json_pack("{s:s, s:i, s:f, s:{s:f, s:f}, s:i}", "model", r->name,
                                             "threads", omp_get_max_threads(), "eager_step_s",
                                             r->eager, "compiled_step_s", "default", r->dflt,
                                             "mincut", r->mincut, "reps", r->reps));
    }
    free(rs);
    return status;
}

/* ---- pipeline scaling: data-less GPT-2 small variants ---- */

static int bench_scaling(const bench_opts *o, json_t *arr) {
    static const int layers[] = {12, 48, 96};
    const int nl = (int)(sizeof layers / sizeof layers[0]);
    pipe_times pt[3];
    int status = 0;
    for (int i = 0; i < nl && status == 0; i++) {
        note("pipeline scaling: %d layers", layers[i]);
        bool prev = ag_set_meta_mode(true);
        ag_gpt2_config cfg = ag_gpt2_config_small();
        cfg.n_layer = layers[i];
        ag_manual_seed(o->seed);
        ag_module *step = make_step(ag_nn_gpt2(&cfg), LOSS_GPT2);
        ag_tensor *in[2] = {ag_zeros(AG_I64, 2, (int64_t[]){4, 64}),
                            ag_zeros(AG_I64, 2, (int64_t[]){4, 64})};
        if (!step || !in[0] || !in[1] || time_pipeline(step, in, 2, o->runs, &pt[i])) {
            bench_error("pipeline scaling");
            status = -1;
        }
        ag_tensor_free(in[0]);
        ag_tensor_free(in[1]);
        ag_module_free(step);
        ag_set_meta_mode(prev);
    }
    if (status)
        return status;
    printf("\ncapture pipeline scaling: GPT-2 small with n_layer changed, built in meta mode (no "
           "weights), B=4, T=64, min-cut budget 1; median of %d passes\n",
           o->runs);
    printf("  %6s %8s %11s %11s %13s %9s %13s\n", "layers", "nodes", "export ms", "compile ms",
           "(partition ms", "plans ms)", "total ms");
    for (int i = 0; i < nl; i++) {
        printf("  %6d %8d %11.1f %11.1f %13.1f %9.1f %13.1f\n", layers[i], pt[i].nodes,
               1e3 * pt[i].export_s, 1e3 * pt[i].compile_s, 1e3 * pt[i].partition_s,
               1e3 * pt[i].plan_s, 1e3 * (pt[i].export_s + pt[i].compile_s));
        json_array_append_new(
            arr, json_pack("{s:i, s:f, s:f, s:f, s:f, s:i, s:i, s:i}", "layers", layers[i],
                           "export_s", pt[i].export_s, "compile_s", pt[i].compile_s, "partition_s",
                           pt[i].partition_s, "plans_s", pt[i].plan_s, "nodes", pt[i].nodes,
                           "forward_nodes", pt[i].fw_nodes, "backward_nodes", pt[i].bw_nodes));
    }
    /* Growth per layer over each interval, and the exponent e of time ~ nodes^e between the two
     * largest models (1 for linear growth). */
    for (int i = 1; i < nl; i++) {
        double dl = (double)(layers[i] - layers[i - 1]);
        printf("  %2d -> %2d layers: per layer export %.2f ms, compile %.2f ms, %.0f nodes\n",
               layers[i - 1], layers[i], 1e3 * (pt[i].export_s - pt[i - 1].export_s) / dl,
               1e3 * (pt[i].compile_s - pt[i - 1].compile_s) / dl,
               (double)(pt[i].nodes - pt[i - 1].nodes) / dl);
    }
    double dn = log((double)pt[nl - 1].nodes / pt[nl - 2].nodes);
    printf("  time ~ nodes^e from %d to %d layers: export e = %.2f, partition e = %.2f, plans "
           "e = %.2f, compile e = %.2f\n",
           layers[nl - 2], layers[nl - 1], log(pt[nl - 1].export_s / pt[nl - 2].export_s) / dn,
           log(pt[nl - 1].partition_s / pt[nl - 2].partition_s) / dn,
           log(pt[nl - 1].plan_s / pt[nl - 2].plan_s) / dn,
           log(pt[nl - 1].compile_s / pt[nl - 2].compile_s) / dn);
    return 0;
}

/* ---- the command ---- */

static void print_tables(const model_result *rs, int n, const bench_opts *o) {
    if (n == 0)
        return;
    printf("\ntraining steps (forward + backward + AdamW), %d threads, median of %d runs; "
           "compiled = ag_compiled_call_module with the default / min-cut (budget 1) partition\n",
           o->threads, o->runs);
    printf("  %-11s %3s %10s %12s %12s %12s %13s %13s\n", "model", "thr", "eager s", "default s",
           "mincut s", "GEMM floor s", "mincut/floor", "eager/mincut");
    for (int i = 0; i < n; i++) {
        const model_result *r = &rs[i];
        printf("  %-11s %3d %10.4f %12.4f %12.4f %12.4f %12.2fx %12.2fx\n", r->name, o->threads,
               r->eager, r->dflt, r->mincut, r->floor_s, r->mincut / r->floor_s,
               r->eager / r->mincut);
    }
    printf("\ncapture pipeline (median of %d passes; export = trace + joint export in one call; "
           "compile = partition (min-cut, budget 1) + plans) and planned memory\n",
           o->runs);
    printf("  %-11s %7s %10s %11s %10s %9s %9s | %-37s\n", "model", "nodes", "export ms",
           "compile ms", "partition", "plans", "total ms", "peak MB: default mincut_1 _0.5 _0");
    for (int i = 0; i < n; i++) {
        const model_result *r = &rs[i];
        const pipe_times *p = &r->pipe;
        printf("  %-11s %7d %10.1f %11.1f %10.1f %9.1f %9.1f | %9.1f %8.1f %6.1f %6.1f\n", r->name,
               p->nodes, 1e3 * p->export_s, 1e3 * p->compile_s, 1e3 * p->partition_s,
               1e3 * p->plan_s, 1e3 * (p->export_s + p->compile_s), r->peak[0].peak / 1e6,
               r->peak[1].peak / 1e6, r->peak[2].peak / 1e6, r->peak[3].peak / 1e6);
    }
}

static void usage(FILE *f) {
    fprintf(f, "usage: aotgrad bench [MODEL...] [--json FILE] [--runs N] [--warmup N] "
               "[--threads T] [--seed S] [--zoo] [--pipeline-scaling] [--profile] [--gemms]\n"
               "MODEL: mlp, cnn, gpt2-small (default: all three, the zoo and the pipeline "
               "scaling)\n"
               "       aotgrad bench --parallel ...   distributed steps (aotgrad bench "
               "--parallel --help)\n");
}

int cli_bench(int argc, char **argv) {
    for (int i = 1; i < argc; i++) /* distributed steps: bench_parallel.c */
        if (!strcmp(argv[i], "--parallel"))
            return cli_bench_parallel(argc, argv);
    bench_opts o = {.runs = 5, .warmup = 1, .threads = ag_get_num_threads(), .seed = 0};
    const char *json_path = NULL;
    bool want[NMODELS] = {0}, any_model = false, zoo = false, scaling = false;
    for (int i = 1; i < argc; i++) {
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        long long x = 0;
        int rc = 0, m = 0;
        while (m < NMODELS && strcmp(argv[i], models[m].name))
            m++;
        if (m < NMODELS) {
            want[m] = any_model = true;
        } else if (!strcmp(argv[i], "--json") && v && v[0]) {
            json_path = v, i++;
        } else if (!strcmp(argv[i], "--runs")) {
            rc = cli_int_opt("bench", "--runs", v, 1, 1000, &x), o.runs = (int)x, i++;
        } else if (!strcmp(argv[i], "--warmup")) {
            rc = cli_int_opt("bench", "--warmup", v, 1, 1000, &x), o.warmup = (int)x, i++;
        } else if (!strcmp(argv[i], "--threads")) {
            rc = cli_int_opt("bench", "--threads", v, 1, 1024, &x), o.threads = (int)x, i++;
        } else if (!strcmp(argv[i], "--seed")) {
            rc = cli_int_opt("bench", "--seed", v, 0, (long long)1 << 62, &x), o.seed = (uint64_t)x,
            i++;
        } else if (!strcmp(argv[i], "--zoo")) {
            zoo = true;
        } else if (!strcmp(argv[i], "--pipeline-scaling")) {
            scaling = true;
        } else if (!strcmp(argv[i], "--profile")) {
            o.profile = true;
        } else if (!strcmp(argv[i], "--gemms")) {
            o.gemms = true;
        } else if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            usage(stdout);
            return 0;
        } else {
            fprintf(stderr, "aotgrad bench: bad argument '%s'\n", argv[i]);
            usage(stderr);
            return 2;
        }
        if (rc)
            return 2;
    }
    if (!any_model && !zoo && !scaling) {
        for (int m = 0; m < NMODELS; m++)
            want[m] = true;
        zoo = scaling = true;
    }
    if (ag_set_num_threads(o.threads)) {
        bench_error("--threads");
        return 2;
    }
    o.threads = ag_get_num_threads();

    char load0[64], load1[64], cpu[256];
    bench_loadavg(load0, sizeof load0);
    bench_cpu_model(cpu, sizeof cpu);
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    double mem = (double)sysconf(_SC_PHYS_PAGES) * (double)sysconf(_SC_PAGESIZE);
    char cmd[1024] = "aotgrad";
    for (int i = 0; i < argc; i++) {
        size_t len = strlen(cmd);
        snprintf(cmd + len, sizeof cmd - len, " %s", argv[i]);
    }
    printf("aotgrad bench: %s; %ld cores, %.1f GiB; %d threads; median of %d runs after %d "
           "warm-up step(s); seed %llu\n",
           cpu, cores, mem / (1024.0 * 1024 * 1024), o.threads, o.runs, o.warmup,
           (unsigned long long)o.seed);
    printf("load average at start: %s\n", load0);
    json_t *env = bench_env_report(o.threads);

    json_t *root = json_pack("{s:s, s:{s:s, s:I, s:I}, s:i, s:i, s:i, s:I, s:s}", "command", cmd,
                             "machine", "cpu", cpu, "cores", (json_int_t)cores, "memory_bytes",
                             (json_int_t)mem, "threads", o.threads, "runs", o.runs, "warmup",
                             o.warmup, "seed", (json_int_t)o.seed, "loadavg_start", load0);
    json_object_set_new(root, "blas_and_threads", env);
    json_t *results = json_array(), *zoo_arr = json_array(), *scaling_arr = json_array();
    model_result rs[NMODELS];
    int nres = 0, status = 0;
    for (int m = 0; m < NMODELS; m++) {
        if (!want[m])
            continue;
        json_t *j = NULL;
        if (bench_model(m, &o, &rs[nres], &j)) {
            status = 1;
            continue;
        }
        json_array_append_new(results, j);
        nres++;
    }
    print_tables(rs, nres, &o);
    if (zoo && bench_zoo(&o, zoo_arr))
        status = 1;
    if (scaling && bench_scaling(&o, scaling_arr))
        status = 1;
    bench_loadavg(load1, sizeof load1);
    printf("\nload average at end: %s\n", load1);
    json_object_set_new(root, "loadavg_end", json_string(load1));
    json_object_set_new(root, "results", results);
    if (zoo)
        json_object_set_new(root, "zoo", zoo_arr);
    else
        json_decref(zoo_arr);
    if (scaling)
        json_object_set_new(root, "pipeline_scaling", scaling_arr);
    else
        json_decref(scaling_arr);
    if (json_path) {
        char *text = json_dumps(root, JSON_INDENT(2));
        cli_out out;
        if (!text) {
            fprintf(stderr, "aotgrad bench: writing %s: out of memory\n", json_path);
            status = 1;
        } else if (cli_out_open(&out, "bench", json_path)) {
            status = 1;
        } else {
            cli_out_puts(&out, text);
            cli_out_puts(&out, "\n");
            if (cli_out_close(&out))
                status = 1;
        }
        free(text);
    }
    json_decref(root);
    return status;
}
