/* Allocation failure injection (Lua's EMERGENCYGCTESTS / SQLite's OOM tests): every scenario is
 * run again and again with the N-th allocation failing, for N = 1, 2, ... until a run completes
 * without reaching N (tu_alloc_failure_sweep). Each failing run must report AG_ENOMEM (no
 * crash), and once everything is released the number of live allocations must be back where it
 * started: nothing leaked. Scenarios: eager ops, the main job's pipeline (cnn and a small GPT-2
 * through export, min-cut compile and AdamW steps, with the objects reused after a failure), a
 * compiled call that draws random numbers, the IDX reader and safetensors save/load; most also
 * with memory staying exhausted from the N-th allocation on. */
#include "testutil.h"

#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <zlib.h>

/* Forward and backward of a small two-layer network with views, broadcasting, in-place ops
 * and a reduction, all inside a scope. */
static int scenario_mlp(void *ud) {
    (void)ud;
    int rc = 0;
    ag_scope_begin();
    int64_t xs[] = {4, 3}, ws[] = {5, 3}, bs[] = {5}, w2s[] = {2, 5};
    ag_tensor *x = ag_ones(AG_F32, 2, xs);
    ag_tensor *w = ag_full(AG_F32, 2, ws, 0.1);
    ag_tensor *b = ag_zeros(AG_F32, 1, bs);
    ag_tensor *w2 = ag_full(AG_F32, 2, w2s, -0.2);
    if (!x || !w || !b || !w2) {
        rc = ag_last_status();
        goto out;
    }
    ag_tensor_set_requires_grad(w, true);
    ag_tensor_set_requires_grad(b, true);
    ag_tensor_set_requires_grad(w2, true);
    ag_tensor *h = ag_relu(ag_add(ag_mm(x, ag_t(w)), b));
    ag_tensor *o = ag_mm(h, ag_transpose(w2, 0, 1));
    ag_tensor *loss = ag_mean_all(ag_mul(o, o));
    if (!loss) {
        rc = ag_last_status();
        goto out;
    }
    rc = ag_backward(loss, NULL, false);
    if (rc == 0 && (!ag_tensor_grad(w) || !ag_tensor_grad(w2)))
        rc = -99;
out:
    ag_scope_end();
    return rc;
}

static void test_alloc_failures_mlp(void **st) {
    (void)st;
    tu_sweep_opts o = {.what = "mlp"};
    int64_t points = tu_alloc_failure_sweep(scenario_mlp, NULL, &o);
    print_message("mlp scenario: %lld allocation points exercised\n", (long long)points);
    assert_true(points >= 50);
    o.persistent = true;
    assert_true(tu_alloc_failure_sweep(scenario_mlp, NULL, &o) >= 50);
}

/* Tensors outside scopes are owned by the caller: explicit frees, views, a composite op
 * (reshape of a transposed view copies through its own internal scope). */
static int scenario_owned(void *ud) {
    (void)ud;
    int64_t s[] = {3, 4};
    ag_tensor *a = ag_rand(AG_F64, 2, s);
    if (!a)
        return ag_last_status();
    ag_tensor *t = ag_t(a);
    ag_tensor *c = t ? ag_reshape(t, 1, (int64_t[]){12}) : NULL;
    int rc = c ? 0 : ag_last_status();
    ag_tensor_free(c);
    ag_tensor_free(t);
    ag_tensor_free(a);
    return rc;
}

static void test_alloc_failures_owned(void **st) {
    (void)st;
    tu_sweep_opts o = {.what = "owned"};
    assert_true(tu_alloc_failure_sweep(scenario_owned, NULL, &o) >= 5);
    o.persistent = true;
    assert_true(tu_alloc_failure_sweep(scenario_owned, NULL, &o) >= 5);
}

/* ---- the main job's pipeline, as `aotgrad train` runs it (tools/cmd_train.c) ----
 *
 * The zoo's cnn (batch 2) and a small GPT-2 (2 layers, width 32, vocab 64, block 16, batch 2),
 * each wrapped in a step module whose loss is cross-entropy, go through every stage, one sweep
 * per stage so that each allocation of the pipeline fails once without the sweep repeating the
 * stages before it: building model, step module and AdamW; ag_export_joint; ag_compile_joint
 * with the min-cut partitioner at budgets 1 and 0.5; three training steps (compiled call,
 * ag_backward, ag_optim_step, ag_optim_zero_grad) on a freshly built model, optimizer and
 * compiled callable (made with failures paused). Every N is swept, except for the slowest
 * stages in sanitizer builds (see job_sweep).
 *
 * A training step whose call fails must leave the parameters, buffers and gradients as they
 * were before that call (the call had no other effect), and the step is then retried on the
 * same batch with the same objects: every step's loss and the final parameters must be
 * bit-identical to those of a run that never failed. */

enum { JOB_STEPS = 3, JOB_CNN_BATCH = 2, JOB_GPT2_BATCH = 2 };

typedef struct job_step_ud {
    ag_module *model;
    bool gpt2; /* the model takes (idx, targets) and returns (logits, loss) itself */
} job_step_ud;

/* loss = cross_entropy(model(x), y), or GPT-2's own loss of (idx, targets). */
static int job_step_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out,
                            int max_out) {
    job_step_ud *u = ag_module_ud(m);
    ag_tensor *o[2] = {0};
    (void)max_out;
    ag_scope_begin();
    if (u->gpt2) {
        int n = ag_module_call(u->model, in, nin, o, 2);
        out[0] = n == 2 ? ag_tensor_keep(o[1]) : NULL;
    } else {
        ag_tensor *logits = ag_module_forward(u->model, in[0]);
        out[0] = ag_tensor_keep(ag_cross_entropy(logits, in[1], AG_REDUCTION_MEAN, -100));
    }
    ag_scope_end();
    return out[0] ? 1 : ag_last_status();
}

static void job_ud_free(void *p) {
    free(p);
}

typedef struct job {
    bool gpt2;
    ag_module *step; /* owns the model as child "model" */
    ag_optim *opt;
    ag_compiled *c;
} job;

static ag_gpt2_config job_gpt2_config(void) {
    return (ag_gpt2_config){.n_layer = 2,
                            .n_head = 2,
                            .n_embd = 32,
                            .vocab_size = 64,
                            .block_size = 16,
                            .dropout = 0,
                            .bias = true};
}

static void job_free(job *jb) {
    ag_compiled_free(jb->c);
    ag_optim_free(jb->opt);
    ag_module_free(jb->step);
    jb->c = NULL;
    jb->opt = NULL;
    jb->step = NULL;
}

/* Model (weights drawn after ag_manual_seed(0)), step module and AdamW with cmd_train's
 * hyperparameters. On failure nothing is left and the status is returned. */
static int job_build(job *jb, bool gpt2) {
    *jb = (job){.gpt2 = gpt2};
    ag_module *model = NULL;
    if (gpt2) {
        ag_gpt2_config cfg = job_gpt2_config();
        ag_manual_seed(0);
        model = ag_nn_gpt2(&cfg);
    } else {
        ag_tensor *zin[8];
        int nzin = 0;
        if (ag_zoo_build("cnn", NULL, &model, zin, 8, &nzin) == 0)
            for (int i = 0; i < nzin; i++)
                ag_tensor_free(zin[i]);
    }
    if (!model)
        return ag_last_status();
    job_step_ud *u = malloc(sizeof *u); /* the test's own memory: not a point of the sweep */
    assert_non_null(u);
    *u = (job_step_ud){model, gpt2};
    jb->step =
        ag_module_new("TrainStep", job_step_forward, u, job_ud_free); /* frees u on failure */
    if (!jb->step) {
        ag_module_free(model);
        return ag_last_status();
    }
    if (ag_module_add_child(jb->step, "model", model)) { /* frees model on failure */
        int rc = ag_last_status();
        job_free(jb);
        return rc;
    }
    jb->opt = gpt2 ? ag_optim_adamw(jb->step, 3e-3, 0.9, 0.95, 1e-8, 0.1)
                   : ag_optim_adamw(jb->step, 2e-3, 0.9, 0.999, 1e-8, 0.01);
    if (!jb->opt) {
        int rc = ag_last_status();
        job_free(jb);
        return rc;
    }
    return 0;
}

static ag_compile_opts job_compile_opts(double budget) {
    return (ag_compile_opts){.partition = {.partitioner = AG_PARTITION_MINCUT,
                                           .memory_budget = ag_memory_budget(budget)}};
}

/* ---- snapshots of a module's state (the test's own memory, taken with failures paused) ----
 * Each parameter and buffer is kept as a 64-bit hash of its bytes and of its gradient's (the
 * checks run before every call of every step), and, for the initial state the runs restart
 * from, as a copy of its bytes. */

typedef struct snap {
    int n, nparams;
    char **names;
    uint64_t *hash, *grad_hash; /* grad_hash 0: no gradient */
    size_t *len;
    void **bytes; /* NULL unless taken with bytes */
} snap;

static uint64_t hash_bytes(const void *p, size_t n) {
    uint64_t h = 0xcbf29ce484222325ull, w;
    const unsigned char *b = p;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        memcpy(&w, b + i, 8);
        h = (h ^ w) * 0x100000001b3ull;
        h ^= h >> 29;
    }
    for (; i < n; i++)
        h = (h ^ b[i]) * 0x100000001b3ull;
    return h | 1; /* never 0 */
}

static void snap_take(snap *s, ag_module *m, bool with_bytes) {
    tu_alloc_pause();
    ag_named_tensors p, b;
    assert_int_equal(ag_module_named_parameters(m, true, &p), 0);
    assert_int_equal(ag_module_named_buffers(m, true, &b), 0);
    s->n = p.n + b.n;
    s->nparams = p.n;
    s->names = calloc((size_t)s->n, sizeof *s->names);
    s->hash = calloc((size_t)s->n, sizeof *s->hash);
    s->grad_hash = calloc((size_t)s->n, sizeof *s->grad_hash);
    s->len = calloc((size_t)s->n, sizeof *s->len);
    s->bytes = with_bytes ? calloc((size_t)s->n, sizeof *s->bytes) : NULL;
    assert_true(s->names && s->hash && s->grad_hash && s->len && (s->bytes || !with_bytes));
    for (int i = 0; i < s->n; i++) {
        ag_tensor *t = i < p.n ? p.tensors[i] : b.tensors[i - p.n], *g = ag_tensor_grad(t);
        /* Strided tensors through a contiguous copy, owned by a scope of its own. */
        ag_scope_begin();
        t = ag_contiguous(t);
        g = g ? ag_contiguous(g) : NULL;
        assert_non_null(t);
        s->names[i] = strdup(i < p.n ? p.names[i] : b.names[i - p.n]);
        assert_non_null(s->names[i]);
        s->len[i] = (size_t)ag_tensor_numel(t) * ag_dtype_size(ag_tensor_dtype(t));
        s->hash[i] = hash_bytes(ag_tensor_data(t), s->len[i]);
        if (g)
            s->grad_hash[i] = hash_bytes(ag_tensor_data(g), s->len[i]);
        if (with_bytes) {
            s->bytes[i] = malloc(s->len[i] + 1);
            assert_non_null(s->bytes[i]);
            memcpy(s->bytes[i], ag_tensor_data(t), s->len[i]);
        }
        ag_scope_end();
    }
    ag_named_tensors_free(&p);
    ag_named_tensors_free(&b);
    tu_alloc_resume();
}

static void snap_free(snap *s) {
    for (int i = 0; i < s->n; i++) {
        free(s->names[i]);
        if (s->bytes)
            free(s->bytes[i]);
    }
    free(s->names);
    free(s->hash);
    free(s->grad_hash);
    free(s->len);
    free(s->bytes);
    *s = (snap){0};
}

/* Puts s's values (taken with bytes) back into m's parameters and buffers and drops their
 * gradients. */
static void snap_restore(const snap *s, ag_module *m) {
    tu_alloc_pause();
    ag_named_tensors p, b;
    assert_int_equal(ag_module_named_parameters(m, true, &p), 0);
    assert_int_equal(ag_module_named_buffers(m, true, &b), 0);
    assert_int_equal(p.n + b.n, s->n);
    bool prev = ag_set_grad_enabled(false);
    for (int i = 0; i < s->n; i++) {
        ag_tensor *t = i < p.n ? p.tensors[i] : b.tensors[i - p.n];
        if (ag_tensor_is_contiguous(t)) {
            memcpy(ag_tensor_data(t), s->bytes[i], s->len[i]);
            ag_tensor_bump_version(t);
        } else {
            ag_tensor *v = ag_from_data(ag_tensor_dtype(t), ag_tensor_ndim(t), ag_tensor_sizes(t),
                                        s->bytes[i]);
            ag_scope_begin();
            assert_non_null(v ? ag_copy_(t, v) : NULL);
            ag_scope_end();
            ag_tensor_free(v);
        }
        if (i < p.n)
            assert_int_equal(ag_tensor_set_grad(t, NULL), 0);
    }
    ag_set_grad_enabled(prev);
    ag_named_tensors_free(&p);
    ag_named_tensors_free(&b);
    tu_alloc_resume();
}

/* Fails the test, naming `what`, if m's parameters, gradients or (with_buffers) buffers
 * differ from s. */
static void snap_check(const snap *s, ag_module *m, bool with_buffers, const char *what) {
    snap now;
    snap_take(&now, m, false);
    assert_int_equal(now.n, s->n);
    for (int i = 0; i < (with_buffers ? s->n : s->nparams); i++) {
        const char *bad = NULL;
        if (now.hash[i] != s->hash[i])
            bad = "its values changed";
        else if (!now.grad_hash[i] != !s->grad_hash[i])
            bad = s->grad_hash[i] ? "its gradient was dropped" : "it got a gradient";
        else if (now.grad_hash[i] != s->grad_hash[i])
            bad = "its gradient changed";
        if (bad) {
            print_error("%s: %s: %s\n", what, s->names[i], bad);
            snap_free(&now);
            fail();
        }
    }
    snap_free(&now);
}

/* One training step on the batch `in` as cmd_train makes it. A call that fails must fail
 * with AG_ENOMEM and a message and have changed nothing in the module (checked against a
 * snapshot taken before it); the step then stops there. Returns 0 or the failing call's
 * status; *loss gets the loss. */
static int job_step(job *jb, ag_tensor *const *in, double *loss) {
    snap before;
    snap_take(&before, jb->step, false);
    ag_scope_begin();
    ag_tensor *out = NULL;
    const char *what = "compiled call";
    int rc = ag_compiled_call_module(jb->c, jb->step, in, 2, &out, 1);
    if (rc == 1) {
        tu_alloc_pause();
        *loss = ag_tensor_item(out);
        tu_alloc_resume();
        snap_free(&before);
        /* The forward updated BatchNorm's running statistics. */
        snap_take(&before, jb->step, false);
        what = "backward";
        rc = ag_backward(out, NULL, false);
    } else if (rc >= 0) {
        print_error("compiled call returned %d outputs\n", rc);
        fail();
    }
    if (rc == 0) {
        snap_free(&before);
        snap_take(&before, jb->step, false);
        what = "AdamW step";
        rc = ag_optim_step(jb->opt);
    }
    if (rc) {
        if (rc != AG_ENOMEM || ag_last_status() != AG_ENOMEM || !ag_last_error()[0]) {
            print_error("%s failed with %d, status %d: '%s'\n", what, rc, ag_last_status(),
                        ag_last_error());
            fail();
        }
        char msg[256];
        snprintf(msg, sizeof msg, "failed %s (%s)", what, ag_last_error());
        snap_check(&before, jb->step, true, msg);
    }
    ag_optim_zero_grad(jb->opt);
    tu_alloc_cleanup_begin();
    ag_scope_end();
    tu_alloc_cleanup_end();
    snap_free(&before);
    return rc;
}

/* The batches of every step: cnn images [2, 1, 28, 28] and labels [2], or GPT-2 tokens and
 * targets [2, 16], from a fixed xorshift stream. */
typedef struct job_data {
    ag_tensor *in[JOB_STEPS][2];
} job_data;

static void job_data_make(job_data *d, bool gpt2) {
    uint64_t st = gpt2 ? 0x9e3779b97f4a7c15ull : 0x2545f4914f6cdd1dull;
    for (int s = 0; s < JOB_STEPS; s++) {
        if (gpt2) {
            int64_t sz[] = {JOB_GPT2_BATCH, 16};
            d->in[s][0] = tu_rand_tensor(AG_I64, 2, sz, 0, 64, tu_xorshift, &st);
            d->in[s][1] = tu_rand_tensor(AG_I64, 2, sz, 0, 64, tu_xorshift, &st);
        } else {
            int64_t xs[] = {JOB_CNN_BATCH, 1, 28, 28}, ys[] = {JOB_CNN_BATCH};
            d->in[s][0] = tu_rand_tensor(AG_F32, 4, xs, -1, 2, tu_xorshift, &st);
            d->in[s][1] = tu_rand_tensor(AG_I64, 1, ys, 0, 10, tu_xorshift, &st);
        }
        assert_true(d->in[s][0] && d->in[s][1]);
    }
}

static void job_data_free(job_data *d) {
    for (int s = 0; s < JOB_STEPS; s++) {
        ag_tensor_free(d->in[s][0]);
        ag_tensor_free(d->in[s][1]);
    }
}

typedef struct job_case {
    bool gpt2;
    const job_data *data;
    job proto; /* the model whose joint the export sweep makes and the others use */
    const ag_joint *j;
    double budget;
    snap init;     /* proto's initial state */
    bool have_ref; /* the clean run's losses and final state, for the runs that fail */
    double ref_loss[JOB_STEPS];
    snap ref;
    int64_t retried; /* steps retried after a failed call */
    bool persistent; /* memory stays exhausted after the failure: no retry, only cleanup */
} job_case;

static int scenario_job_build(void *ud) {
    job_case *jc = ud;
    job jb;
    int rc = job_build(&jb, jc->gpt2);
    job_free(&jb);
    return rc;
}

static int scenario_job_export(void *ud) {
    job_case *jc = ud;
    ag_joint *j = ag_export_joint(jc->proto.step, jc->data->in[0], 2, NULL, NULL, 0, NULL);
    int rc = j ? 0 : ag_last_status();
    tu_alloc_cleanup_begin();
    ag_joint_free(j);
    tu_alloc_cleanup_end();
    return rc;
}

static int scenario_job_compile(void *ud) {
    job_case *jc = ud;
    ag_compile_opts co = job_compile_opts(jc->budget);
    ag_compiled *c = ag_compile_joint(jc->j, &co);
    int rc = c ? 0 : ag_last_status();
    tu_alloc_cleanup_begin();
    ag_compiled_free(c);
    tu_alloc_cleanup_end();
    return rc;
}

/* Three steps with a fresh optimizer and callable (made with failures paused) on the
 * prototype model put back in its initial state; a failed step is retried once. BatchNorm's
 * running statistics are left out of the final comparison: a step whose backward or AdamW
 * step failed had a forward that succeeded and updated them, as eager's would. */
static int scenario_job_train(void *ud) {
    job_case *jc = ud;
    job jb = jc->proto;
    tu_alloc_pause();
    snap_restore(&jc->init, jb.step);
    jb.opt = jb.gpt2 ? ag_optim_adamw(jb.step, 3e-3, 0.9, 0.95, 1e-8, 0.1)
                     : ag_optim_adamw(jb.step, 2e-3, 0.9, 0.999, 1e-8, 0.01);
    ag_compile_opts co = job_compile_opts(jc->budget);
    jb.c = ag_compile_joint(jc->j, &co);
    assert_true(jb.opt && jb.c);
    tu_alloc_resume();
    int first = 0;
    for (int s = 0; s < JOB_STEPS; s++) {
        double loss = NAN;
        int rc = job_step(&jb, jc->data->in[s], &loss);
        if (rc && jc->persistent) {
            first = rc;
            break;
        }
        if (rc) {
            first = first ? first : rc;
            jc->retried++;
            rc = job_step(&jb, jc->data->in[s], &loss);
            if (rc) {
                print_error("step %d failed again after a failed call: %s\n", s + 1,
                            ag_last_error());
                fail();
            }
        }
        if (!jc->have_ref) {
            jc->ref_loss[s] = loss;
        } else if (memcmp(&loss, &jc->ref_loss[s], sizeof loss)) {
            print_error("step %d: loss %.17g, %.17g in the run without failures\n", s + 1, loss,
                        jc->ref_loss[s]);
            fail();
        }
    }
    if (first && jc->persistent) {
        /* Only the leak check: the objects must be destroyable. */
    } else if (!jc->have_ref) {
        snap_take(&jc->ref, jb.step, false);
        jc->have_ref = true;
    } else {
        snap_check(&jc->ref, jb.step, false, "the parameters after the last step");
    }
    tu_alloc_pause();
    ag_compiled_free(jb.c);
    ag_optim_free(jb.opt);
    tu_alloc_resume();
    return first;
}

static double lap(void) {
    static struct timespec last;
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    double d = (double)(now.tv_sec - last.tv_sec) + 1e-9 * (double)(now.tv_nsec - last.tv_nsec);
    last = now;
    return d;
}

/* One sweep of a stage. Every N is failed, except in sanitizer builds, where the pipeline runs
 * about ten times slower: there the slow stages (each run of a training sweep compiles and
 * runs three steps; min-cut at budget 0.5 searches over many partitions) fail every N up to
 * every_up_to and then every stride-th N (a prime, so that a stride does not keep landing on
 * the same allocation of a repeating pattern), unless AG_TEST_FULL_SWEEP=1 is set. Prints how
 * many of the stage's allocations were failed; returns that number. */
static int64_t job_sweep(int (*scenario)(void *), job_case *jc, const char *what,
                         int64_t every_up_to, int64_t stride) {
#if defined(__SANITIZE_ADDRESS__)
    const char *full = getenv("AG_TEST_FULL_SWEEP");
    if (full && !strcmp(full, "1"))
        every_up_to = stride = 0;
#else
    every_up_to = stride = 0;
#endif
    int64_t total = 0;
    tu_sweep_opts o = {.what = what,
                       .one_thread = true,
                       .every_up_to = every_up_to,
                       .stride = stride,
                       .persistent = jc->persistent,
                       .allocations = &total};
    int64_t points = tu_alloc_failure_sweep(scenario, jc, &o);
    print_message("%s: failed %lld of %lld allocations (%.1f s)\n", what, (long long)points,
                  (long long)total, lap());
    return points;
}

static void sweep_job(bool gpt2) {
    lap();
    const char *name = gpt2 ? "gpt2" : "cnn";
    char what[64];
    job_data data;
    job_data_make(&data, gpt2);
    job_case jc = {.gpt2 = gpt2, .data = &data};

    snprintf(what, sizeof what, "%s: build", name);
    assert_true(job_sweep(scenario_job_build, &jc, what, 30, 7) >= 10);

    assert_int_equal(job_build(&jc.proto, gpt2), 0);
    snap_take(&jc.init, jc.proto.step, true);
    snprintf(what, sizeof what, "%s: export", name);
    assert_true(job_sweep(scenario_job_export, &jc, what, 0, 0) >= 100);
    jc.persistent = true;
    snprintf(what, sizeof what, "%s: export, memory exhausted", name);
    assert_true(job_sweep(scenario_job_export, &jc, what, 0, 0) >= 100);
    jc.persistent = false;
    snap_check(&jc.init, jc.proto.step, true, "the module after the export sweep");
    ag_joint *j = ag_export_joint(jc.proto.step, data.in[0], 2, NULL, NULL, 0, NULL);
    assert_non_null(j);
    jc.j = j;

    const double budgets[] = {1.0, 0.5};
    for (int b = 0; b < 2; b++) {
        jc.budget = budgets[b];
        snprintf(what, sizeof what, "%s: compile (min-cut, budget %g)", name, jc.budget);
        assert_true(job_sweep(scenario_job_compile, &jc, what, b == 0 ? 0 : 150, 13) >= 100);

        jc.have_ref = false;
        jc.retried = 0;
        snprintf(what, sizeof what, "%s: %d AdamW steps (budget %g)", name, JOB_STEPS, jc.budget);
        int64_t points = b == 0 ? job_sweep(scenario_job_train, &jc, what, gpt2 ? 60 : 30, 11)
                                : job_sweep(scenario_job_train, &jc, what, 20, gpt2 ? 11 : 17);
        assert_true(points >= 30);
        assert_int_equal(jc.retried, points); /* every failure was a call's, none cleanup's */
        if (b == 0) {
            jc.persistent = true;
            snprintf(what, sizeof what, "%s: compile (budget 1), memory exhausted", name);
            assert_true(job_sweep(scenario_job_compile, &jc, what, 0, 0) >= 100);
            snprintf(what, sizeof what, "%s: AdamW steps (budget 1), memory exhausted", name);
            assert_true(job_sweep(scenario_job_train, &jc, what, gpt2 ? 60 : 30, 11) >= 30);
            jc.persistent = false;
        }
        snap_free(&jc.ref);
    }
    snap_free(&jc.init);
    ag_joint_free(j);
    job_free(&jc.proto);
    job_data_free(&data);
}

static void test_alloc_failures_train_cnn(void **st) {
    (void)st;
    sweep_job(false);
}

static void test_alloc_failures_train_gpt2(void **st) {
    (void)st;
    sweep_job(true);
}

/* ---- a compiled call that draws random numbers ----
 * dropout_mlp's compiled forward reads the generator's state and moves its offset past its
 * draws. A failed call must leave the offset where it was (so the retried call draws the same
 * mask as a call that never failed), and a call that succeeds must move it as the clean run
 * did. */

typedef struct rng_case {
    ag_module *model;
    ag_tensor *in[8];
    int nin;
    ag_joint *j;
    uint64_t offset_after; /* the clean run's */
    bool have_ref;
} rng_case;

static int scenario_rng_call(void *ud) {
    rng_case *rc_ = ud;
    /* A callable of its own, cold: its first call allocates its buffers. */
    tu_alloc_pause();
    ag_compile_opts co = job_compile_opts(1.0);
    ag_compiled *c = ag_compile_joint(rc_->j, &co);
    assert_non_null(c);
    tu_alloc_resume();
    ag_manual_seed(7);
    uint64_t seed0, off0, seed1, off1;
    ag_rng_get_state(&seed0, &off0);
    ag_scope_begin();
    ag_tensor *out[2] = {0};
    int n = ag_compiled_call_module(c, rc_->model, rc_->in, rc_->nin, out, 2);
    tu_alloc_cleanup_begin();
    ag_scope_end();
    ag_compiled_free(c);
    tu_alloc_cleanup_end();
    ag_rng_get_state(&seed1, &off1);
    assert_int_equal(seed1, seed0);
    if (n < 0) {
        if (off1 != off0)
            fail_msg("a failed compiled call moved the generator's offset from %llu to %llu (%s)",
                     (unsigned long long)off0, (unsigned long long)off1, ag_last_error());
        return n;
    }
    if (!rc_->have_ref) {
        rc_->offset_after = off1;
        rc_->have_ref = true;
    }
    assert_true(off1 != off0);
    assert_int_equal(off1, rc_->offset_after);
    return 0;
}

static void test_alloc_failures_compiled_rng(void **st) {
    (void)st;
    rng_case c = {0};
    assert_int_equal(ag_zoo_build("dropout_mlp", NULL, &c.model, c.in, 8, &c.nin), 0);
    c.j = ag_export_joint(c.model, c.in, c.nin, NULL, NULL, 0, NULL);
    assert_non_null(c.j);
    tu_sweep_opts o = {.what = "dropout_mlp compiled call", .one_thread = true};
    int64_t points = tu_alloc_failure_sweep(scenario_rng_call, &c, &o);
    print_message("dropout_mlp compiled call: %lld allocation points\n", (long long)points);
    assert_true(points >= 5);
    ag_joint_free(c.j);
    ag_module_free(c.model);
    for (int i = 0; i < c.nin; i++)
        ag_tensor_free(c.in[i]);
}

/* ---- the IDX reader (src/data/idx.c) ----
 * A directory with Fashion-MNIST's four file names holding tiny IDX pairs: the training pair
 * gzip-compressed, the test pair plain (gzread reads both). The scenario loads both pairs
 * outside a scope and inside one (the reader frees its partial results differently) and one
 * file through ag_load_idx, and checks the values it read. zlib's own buffers do not go
 * through the allocator hook; every allocation of the reader does. */

enum { IDX_N = 3, IDX_H = 4, IDX_W = 5 };

static unsigned char idx_pixel(int64_t i) {
    return (unsigned char)(i * 37 % 256);
}

/* The bytes of an IDX file of unsigned bytes: header, then data[i] = f(i). */
static size_t idx_bytes(unsigned char *buf, int nd, const uint32_t *sizes, bool labels) {
    size_t k = 0, n = 1;
    buf[k++] = 0, buf[k++] = 0, buf[k++] = 0x08, buf[k++] = (unsigned char)nd;
    for (int d = 0; d < nd; d++) {
        for (int s = 3; s >= 0; s--)
            buf[k++] = (unsigned char)(sizes[d] >> (8 * s));
        n *= sizes[d];
    }
    for (size_t i = 0; i < n; i++)
        buf[k++] = labels ? (unsigned char)(i % 10) : idx_pixel((int64_t)i);
    return k;
}

static void idx_write(const char *dir, const char *name, bool gzip, bool labels) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    unsigned char buf[256];
    uint32_t img[] = {IDX_N, IDX_H, IDX_W}, lab[] = {IDX_N};
    size_t n = labels ? idx_bytes(buf, 1, lab, true) : idx_bytes(buf, 3, img, false);
    if (gzip) {
        gzFile f = gzopen(path, "wb");
        assert_non_null(f);
        assert_int_equal(gzwrite(f, buf, (unsigned)n), (int)n);
        assert_int_equal(gzclose(f), Z_OK);
    } else {
        FILE *f = fopen(path, "wb");
        assert_non_null(f);
        assert_int_equal(fwrite(buf, 1, n, f), n);
        assert_int_equal(fclose(f), 0);
    }
}

static char idx_dir[64];

static void idx_check(ag_tensor *img, ag_tensor *lab) {
    tu_alloc_pause();
    int64_t is[] = {IDX_N, 1, IDX_H, IDX_W}, ls[] = {IDX_N};
    tu_assert_shape(img, 4, is);
    tu_assert_shape(lab, 1, ls);
    for (int64_t i = 0; i < IDX_N * IDX_H * IDX_W; i++)
        tu_assert_near(ag_tensor_item_at(img, i), (idx_pixel(i) / 255.0 - 0.2860) / 0.3530, 1e-5,
                       "pixel", i);
    for (int64_t i = 0; i < IDX_N; i++)
        tu_assert_near(ag_tensor_item_at(lab, i), (double)(i % 10), 0, "label", i);
    tu_alloc_resume();
}

static int scenario_idx(void *ud) {
    (void)ud;
    ag_tensor *img, *lab;
    int rc = 0;
    for (int train = 0; train < 2 && rc == 0; train++) {
        rc = ag_fashion_mnist_load(idx_dir, train, &img, &lab);
        if (rc == 0) {
            idx_check(img, lab);
            ag_tensor_free(img);
            ag_tensor_free(lab);
        } else if (img || lab) {
            fail_msg("fashion_mnist_load failed (%d) but returned tensors", rc);
        }
    }
    if (rc == 0) {
        ag_scope_begin();
        rc = ag_fashion_mnist_load(idx_dir, true, &img, &lab);
        if (rc == 0)
            idx_check(img, lab);
        tu_alloc_cleanup_begin();
        ag_scope_end();
        tu_alloc_cleanup_end();
    }
    if (rc == 0) {
        char path[512];
        snprintf(path, sizeof path, "%s/t10k-labels-idx1-ubyte.gz", idx_dir);
        ag_tensor *t = ag_load_idx(path, false, 1.0);
        rc = t ? 0 : ag_last_status();
        ag_tensor_free(t);
    }
    return rc;
}

static void test_alloc_failures_idx(void **st) {
    (void)st;
    snprintf(idx_dir, sizeof idx_dir, "/tmp/ag_test_alloc_XXXXXX");
    assert_non_null(mkdtemp(idx_dir));
    const char *names[] = {"train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
                           "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"};
    for (int i = 0; i < 4; i++)
        idx_write(idx_dir, names[i], i < 2, i % 2 == 1);
    tu_sweep_opts o = {.what = "idx"};
    int64_t points = tu_alloc_failure_sweep(scenario_idx, NULL, &o);
    o.persistent = true;
    assert_int_equal(tu_alloc_failure_sweep(scenario_idx, NULL, &o), points);
    for (int i = 0; i < 4; i++) {
        char path[512];
        snprintf(path, sizeof path, "%s/%s", idx_dir, names[i]);
        unlink(path);
    }
    rmdir(idx_dir);
    print_message("idx: %lld allocation points\n", (long long)points);
    assert_true(points >= 10);
}

/* ---- safetensors (src/nn/safetensors.c) ----
 * A small module (Linear, BatchNorm2d with an int64 buffer, and a parameter that is a
 * transposed view, which save writes through a contiguous copy and load reads through a
 * staging tensor) is saved over an existing file and loaded into a second module holding
 * other values. A failed save leaves the old file as it was and no temporary file behind; a
 * failed load leaves the module as it was; a load that succeeds gives the saved values. */

typedef struct st_case {
    ag_module *src, *dst;
    char dir[64], path[128];
    snap src_state, dst_state;
    uint64_t old_file_hash;
} st_case;

static ag_module *st_module(double fill) {
    ag_module *m = ag_nn_sequential();
    assert_non_null(m);
    assert_int_equal(ag_nn_append(m, ag_nn_linear(3, 4, true)), 0);
    assert_int_equal(ag_nn_append(m, ag_nn_batchnorm2d(4, 1e-5, 0.1)), 0);
    int64_t sz[] = {3, 5};
    ag_tensor *w = ag_full(AG_F32, 2, sz, fill), *wt = ag_t(w);
    assert_non_null(wt);
    assert_false(ag_tensor_is_contiguous(wt));
    assert_int_equal(ag_module_register_parameter(m, "wt", wt), 0);
    ag_tensor_free(wt);
    ag_tensor_free(w);
    return m;
}

static uint64_t file_hash(const char *path) {
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    unsigned char buf[4096];
    size_t n = fread(buf, 1, sizeof buf, f);
    assert_true(n < sizeof buf);
    fclose(f);
    return hash_bytes(buf, n);
}

/* The number of files in dir other than the target. */
static int st_stray_files(const st_case *c) {
    DIR *d = opendir(c->dir);
    assert_non_null(d);
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)))
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..") &&
            strcmp(e->d_name, c->path + strlen(c->dir) + 1))
            n++;
    closedir(d);
    return n;
}

static int scenario_st_save(void *ud) {
    st_case *c = ud;
    int rc = ag_module_save(c->src, c->path);
    tu_alloc_pause();
    if (st_stray_files(c))
        fail_msg("save (status %d) left a temporary file in %s", rc, c->dir);
    uint64_t h = file_hash(c->path);
    if (rc && h != c->old_file_hash)
        fail_msg("a failed save changed the file (%s)", ag_last_error());
    if (rc == 0) {
        /* Put the old contents back for the next run. */
        assert_int_equal(ag_module_save(c->dst, c->path), 0);
        assert_int_equal(file_hash(c->path), c->old_file_hash);
    }
    tu_alloc_resume();
    return rc;
}

static int scenario_st_load(void *ud) {
    st_case *c = ud;
    int rc = ag_module_load(c->dst, c->path);
    if (rc) {
        snap_check(&c->dst_state, c->dst, true, "a failed load");
    } else {
        snap_check(&c->src_state, c->dst, true, "a load");
        snap_restore(&c->dst_state, c->dst); /* back to its own values for the next run */
    }
    return rc;
}

static void test_alloc_failures_safetensors(void **st) {
    (void)st;
    st_case c = {0};
    snprintf(c.dir, sizeof c.dir, "/tmp/ag_test_alloc_XXXXXX");
    assert_non_null(mkdtemp(c.dir));
    snprintf(c.path, sizeof c.path, "%s/state.safetensors", c.dir);
    ag_manual_seed(1);
    c.src = st_module(0.25);
    c.dst = st_module(-1.5);
    /* Other running statistics and batch count in the source. */
    ag_named_tensors b;
    assert_int_equal(ag_module_named_buffers(c.src, true, &b), 0);
    for (int i = 0; i < b.n; i++) {
        if (ag_tensor_dtype(b.tensors[i]) == AG_I64)
            ((int64_t *)ag_tensor_data(b.tensors[i]))[0] = 41;
        else
            ((float *)ag_tensor_data(b.tensors[i]))[1] = 0.125f;
    }
    ag_named_tensors_free(&b);
    snap_take(&c.src_state, c.src, true);
    snap_take(&c.dst_state, c.dst, true);
    assert_int_equal(ag_module_save(c.dst, c.path), 0);
    c.old_file_hash = file_hash(c.path);

    tu_sweep_opts o = {.what = "safetensors save"};
    int64_t save_points = tu_alloc_failure_sweep(scenario_st_save, &c, &o);
    assert_int_equal(ag_module_save(c.src, c.path), 0);
    o.what = "safetensors load";
    int64_t load_points = tu_alloc_failure_sweep(scenario_st_load, &c, &o);
    o.persistent = true;
    assert_int_equal(tu_alloc_failure_sweep(scenario_st_load, &c, &o), load_points);
    assert_int_equal(ag_module_save(c.dst, c.path), 0);
    o.what = "safetensors save, memory exhausted";
    assert_int_equal(tu_alloc_failure_sweep(scenario_st_save, &c, &o), save_points);
    assert_int_equal(ag_module_save(c.src, c.path), 0);
    print_message("safetensors: %lld allocation points saving, %lld loading\n",
                  (long long)save_points, (long long)load_points);
    unlink(c.path);
    rmdir(c.dir);
    snap_free(&c.src_state);
    snap_free(&c.dst_state);
    ag_module_free(c.src);
    ag_module_free(c.dst);
    assert_true(save_points >= 10);
    assert_true(load_points >= 10);
}

/* ---- saved joints: the mlp joint saved, loaded and hashed, in memory and through a file ---- */

typedef struct jio_case {
    ag_joint *j;
    uint64_t hash;
    char *text;
    char path[64];
} jio_case;

static int scenario_joint_io(void *ud) {
    jio_case *c = ud;
    char *s = NULL;
    size_t n = 0;
    uint64_t h = 0;
    int rc = ag_joint_save(c->j, &s, &n);
    ag_joint *l = rc ? NULL : ag_joint_load(s, n);
    if (rc == 0 && !l)
        rc = ag_last_status();
    if (rc == 0)
        rc = ag_joint_hash(l, &h);
    if (rc == 0) {
        tu_alloc_pause();
        assert_true(h == c->hash);
        assert_string_equal(s, c->text);
        tu_alloc_resume();
    }
    ag_joint_free(l);
    ag_free(s);
    return rc;
}

static int scenario_joint_file(void *ud) {
    jio_case *c = ud;
    int rc = ag_joint_save_file(c->j, c->path);
    ag_joint *l = rc ? NULL : ag_joint_load_file(c->path);
    if (rc == 0 && !l)
        rc = ag_last_status();
    ag_joint_free(l);
    return rc;
}

/* The sweeps over the zoo model `name`'s joint; the allocation points counted. */
static void joint_io_sweeps(const char *name, int64_t *points_out, int64_t *fpoints_out) {
    ag_module *m;
    ag_tensor *in[8];
    int nin = 0;
    assert_int_equal(ag_zoo_build(name, NULL, &m, in, 8, &nin), 0);
    jio_case c = {0};
    c.j = ag_export_joint(m, in, nin, NULL, NULL, 0, NULL);
    assert_non_null(c.j);
    assert_int_equal(ag_joint_hash(c.j, &c.hash), 0);
    assert_int_equal(ag_joint_save(c.j, &c.text, NULL), 0);
    snprintf(c.path, sizeof c.path, "/tmp/ag_test_alloc_%d.joint", (int)getpid());
    tu_sweep_opts o = {.what = "joint save, load, hash"};
    int64_t points = tu_alloc_failure_sweep(scenario_joint_io, &c, &o);
    o.what = "joint save_file, load_file";
    int64_t fpoints = tu_alloc_failure_sweep(scenario_joint_file, &c, &o);
    o.persistent = true;
    o.what = "joint save, load, hash, memory exhausted";
    assert_int_equal(tu_alloc_failure_sweep(scenario_joint_io, &c, &o), points);
    print_message("joint io (%s): %lld allocation points in memory, %lld through a file\n", name,
                  (long long)points, (long long)fpoints);
    remove(c.path);
    ag_free(c.text);
    ag_joint_free(c.j);
    for (int i = 0; i < nin; i++)
        ag_tensor_free(in[i]);
    ag_module_free(m);
    *points_out = points;
    *fpoints_out = fpoints;
}

static void test_alloc_failures_joint_io(void **st) {
    (void)st;
    int64_t points, fpoints;
    joint_io_sweeps("mlp", &points, &fpoints);
    assert_true(points >= 100);
    assert_true(fpoints >= 50);
    /* TwoTensor parameters and output: the subclass lines written, read and checked. */
    int64_t tpoints, tfpoints;
    joint_io_sweeps("two_tensor", &tpoints, &tfpoints);
    assert_true(tpoints >= 100);
    assert_true(tfpoints >= 50);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_alloc_failures_mlp),
        cmocka_unit_test(test_alloc_failures_owned),
        cmocka_unit_test(test_alloc_failures_train_cnn),
        cmocka_unit_test(test_alloc_failures_train_gpt2),
        cmocka_unit_test(test_alloc_failures_compiled_rng),
        cmocka_unit_test(test_alloc_failures_idx),
        cmocka_unit_test(test_alloc_failures_safetensors),
        cmocka_unit_test(test_alloc_failures_joint_io),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
