/* Allocation failure injection (Lua's EMERGENCYGCTESTS / SQLite's OOM tests): every scenario is
 * run again and again with the N-th allocation failing, for N = 1, 2, ... until a run completes
 * without reaching N (tu_alloc_failure_sweep). Each failing run must report AG_ENOMEM (no
 * crash), and once everything is released the number of live allocations must be back where it
 * started: nothing leaked. */
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

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
}

/* ---- the main job's pipeline, as `aotgrad train` runs it (tools/cmd_train.c) ----
 *
 * The zoo's cnn (batch 4) and a small GPT-2 (2 layers, width 32, vocab 64, block 16, batch 2),
 * each wrapped in a step module whose loss is cross-entropy, go through every stage, one sweep
 * per stage so that each allocation of the pipeline fails once without the sweep repeating the
 * stages before it: building model, step module and AdamW; ag_export_joint; ag_compile_joint
 * with the min-cut partitioner at budgets 1 and 0.5; three training steps (compiled call,
 * ag_backward, ag_optim_step, ag_optim_zero_grad) on a freshly built model, optimizer and
 * compiled callable (made with failures paused). Every N is swept: the sweeps are complete.
 *
 * A training step whose call fails must leave the parameters, buffers and gradients as they
 * were before that call (the call had no other effect), and the step is then retried on the
 * same batch with the same objects: every step's loss and the final parameters must be
 * bit-identical to those of a run that never failed. */

enum { JOB_STEPS = 3, JOB_CNN_BATCH = 4, JOB_GPT2_BATCH = 2 };

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
    return (ag_gpt2_config){.n_layer = 2, .n_head = 2, .n_embd = 32, .vocab_size = 64,
                            .block_size = 16, .dropout = 0, .bias = true};
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
    jb->step = ag_module_new("TrainStep", job_step_forward, u, job_ud_free); /* frees u on failure */
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
    return (ag_compile_opts){
        .partition = {.partitioner = AG_PARTITION_MINCUT, .memory_budget = budget}};
}

/* ---- snapshots of a module's state (the test's own memory, taken with failures paused) ---- */

typedef struct snap {
    int n, nparams;
    char **names;
    void **bytes; /* each tensor's data, then its gradient's (NULL when it has none) */
    size_t *len;
    void **grad;
} snap;

static void snap_take(snap *s, ag_module *m) {
    tu_alloc_pause();
    ag_named_tensors p, b;
    assert_int_equal(ag_module_named_parameters(m, true, &p), 0);
    assert_int_equal(ag_module_named_buffers(m, true, &b), 0);
    s->n = p.n + b.n;
    s->nparams = p.n;
    s->names = calloc((size_t)s->n, sizeof *s->names);
    s->bytes = calloc((size_t)s->n, sizeof *s->bytes);
    s->grad = calloc((size_t)s->n, sizeof *s->grad);
    s->len = calloc((size_t)s->n, sizeof *s->len);
    assert_true(s->names && s->bytes && s->grad && s->len);
    for (int i = 0; i < s->n; i++) {
        const char *name = i < p.n ? p.names[i] : b.names[i - p.n];
        ag_tensor *t = i < p.n ? p.tensors[i] : b.tensors[i - p.n], *g = ag_tensor_grad(t);
        assert_true(ag_tensor_is_contiguous(t));
        s->names[i] = strdup(name);
        s->len[i] = (size_t)ag_tensor_numel(t) * ag_dtype_size(ag_tensor_dtype(t));
        s->bytes[i] = malloc(s->len[i] + 1);
        assert_true(s->names[i] && s->bytes[i]);
        memcpy(s->bytes[i], ag_tensor_data(t), s->len[i]);
        if (g) {
            assert_true(ag_tensor_is_contiguous(g));
            s->grad[i] = malloc(s->len[i] + 1);
            assert_non_null(s->grad[i]);
            memcpy(s->grad[i], ag_tensor_data(g), s->len[i]);
        }
    }
    ag_named_tensors_free(&p);
    ag_named_tensors_free(&b);
    tu_alloc_resume();
}

static void snap_free(snap *s) {
    for (int i = 0; i < s->n; i++) {
        free(s->names[i]);
        free(s->bytes[i]);
        free(s->grad[i]);
    }
    free(s->names);
    free(s->bytes);
    free(s->grad);
    free(s->len);
    *s = (snap){0};
}

/* Puts s's values back into m's parameters and buffers and drops their gradients. */
static void snap_restore(const snap *s, ag_module *m) {
    tu_alloc_pause();
    ag_named_tensors p, b;
    assert_int_equal(ag_module_named_parameters(m, true, &p), 0);
    assert_int_equal(ag_module_named_buffers(m, true, &b), 0);
    assert_int_equal(p.n + b.n, s->n);
    for (int i = 0; i < s->n; i++) {
        ag_tensor *t = i < p.n ? p.tensors[i] : b.tensors[i - p.n];
        memcpy(ag_tensor_data(t), s->bytes[i], s->len[i]);
        ag_tensor_bump_version(t);
        if (i < p.n)
            assert_int_equal(ag_tensor_set_grad(t, NULL), 0);
    }
    ag_named_tensors_free(&p);
    ag_named_tensors_free(&b);
    tu_alloc_resume();
}

/* Fails the test, naming `what`, if m's parameters, gradients or (with_buffers) buffers
 * differ from s. */
static void snap_check(const snap *s, ag_module *m, bool with_buffers, const char *what) {
    snap now;
    snap_take(&now, m);
    assert_int_equal(now.n, s->n);
    for (int i = 0; i < (with_buffers ? s->n : s->nparams); i++) {
        const char *bad = NULL;
        if (memcmp(now.bytes[i], s->bytes[i], s->len[i]))
            bad = "its values changed";
        else if (!now.grad[i] != !s->grad[i])
            bad = s->grad[i] ? "its gradient was dropped" : "it got a gradient";
        else if (s->grad[i] && memcmp(now.grad[i], s->grad[i], s->len[i]))
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
    snap_take(&before, jb->step);
    ag_scope_begin();
    ag_tensor *out = NULL;
    const char *what = "compiled call";
    int rc = ag_compiled_call_module(jb->c, jb->step, in, 2, &out, 1);
    if (rc == 1) {
        tu_alloc_pause();
        *loss = ag_tensor_item(out);
        tu_alloc_resume();
        snap_free(&before);
        snap_take(&before, jb->step); /* the forward updated BatchNorm's running statistics */
        what = "backward";
        rc = ag_backward(out, NULL, false);
    } else if (rc >= 0) {
        print_error("compiled call returned %d outputs\n", rc);
        fail();
    }
    if (rc == 0) {
        snap_free(&before);
        snap_take(&before, jb->step);
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

/* The batches of every step: cnn images [4, 1, 28, 28] and labels [4], or GPT-2 tokens and
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
    job proto;           /* the model whose joint the export sweep makes and the others use */
    const ag_joint *j;
    double budget;
    snap init;           /* proto's initial state */
    bool have_ref;       /* the clean run's losses and final state, for the runs that fail */
    double ref_loss[JOB_STEPS];
    snap ref;
    int64_t retried;     /* steps retried after a failed call */
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
    if (!jc->have_ref) {
        snap_take(&jc->ref, jb.step);
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

/* One sweep of a stage: every N up to every_up_to, then every stride-th (0: every N). Prints
 * how many of the stage's allocations were failed; returns that number. */
static int64_t job_sweep(int (*scenario)(void *), job_case *jc, const char *what,
                         int64_t every_up_to, int64_t stride) {
    int64_t total = 0;
    tu_sweep_opts o = {.what = what, .one_thread = true, .every_up_to = every_up_to,
                       .stride = stride, .allocations = &total};
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
    assert_true(job_sweep(scenario_job_build, &jc, what, 0, 0) >= 10);

    assert_int_equal(job_build(&jc.proto, gpt2), 0);
    snap_take(&jc.init, jc.proto.step);
    snprintf(what, sizeof what, "%s: export", name);
    assert_true(job_sweep(scenario_job_export, &jc, what, 0, 0) >= 100);
    snap_check(&jc.init, jc.proto.step, true, "the module after the export sweep");
    ag_joint *j = ag_export_joint(jc.proto.step, data.in[0], 2, NULL, NULL, 0, NULL);
    assert_non_null(j);
    jc.j = j;

    const double budgets[] = {1.0, 0.5};
    for (int b = 0; b < 2; b++) {
        jc.budget = budgets[b];
        snprintf(what, sizeof what, "%s: compile (min-cut, budget %g)", name, jc.budget);
        assert_true(job_sweep(scenario_job_compile, &jc, what, 0, 0) >= 100);

        jc.have_ref = false;
        jc.retried = 0;
        snprintf(what, sizeof what, "%s: %d AdamW steps (budget %g)", name, JOB_STEPS, jc.budget);
        int64_t points = job_sweep(scenario_job_train, &jc, what, 0, 0);
        assert_true(points >= 50);
        assert_int_equal(jc.retried, points); /* every failure was a call's, none cleanup's */
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

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_alloc_failures_mlp),
        cmocka_unit_test(test_alloc_failures_owned),
        cmocka_unit_test(test_alloc_failures_train_cnn),
        cmocka_unit_test(test_alloc_failures_train_gpt2),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
