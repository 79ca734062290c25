/* The threading contract (include/aotgrad.h, "Threads"), checked with pthreads:
 *   1. Cold start: in a fresh process (a forked child per trial, before this process has made
 *      any library call), four threads released together make their first library calls at
 *      once: registry lookups, eager ops, the effects model's op registration, a zoo build and
 *      forward. Each thread's results must equal those of a sequential run. Repeated, since the
 *      lazily built op registry raced only sometimes.
 *   2. Exports, compiles and training steps at once: four threads each build zoo models
 *      (mlp twice, cnn, gpt2 tiny with dropout, dropout_mlp, effects, convbn), export the
 *      joint, print it, compile it and run three AdamW steps. The joint text, every loss and
 *      the final parameters must be bit-identical to the same jobs run one after another, and
 *      the effects model's log must hold the same records.
 *   3. What else is process-wide: user ops registered from several threads while others look
 *      ops up (each name registered once, every op found), one with_effects wrapper per op
 *      when threads ask for it at once, the random generator (one per thread: a thread's draws
 *      do not depend on other threads' seeds and draws), and ag_set_num_threads (refuses
 *      counts below 1 or absurdly large, sets the calling thread's count only), and the
 *      executor's step hook (a thread's hook sees only the plans that thread runs).
 * Workers never call cmocka's assertions (they longjmp); they return messages that the main
 * thread checks. */
#include "testutil.h"
#include "runtime/plan_internal.h" /* ag__plan_set_step_hook */

#include <omp.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define NTHREADS 4

/* FNV-1a over bytes, chained through h. */
static uint64_t fnv(uint64_t h, const void *p, size_t n) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}
#define FNV0 0xcbf29ce484222325ull

/* The bits of t's elements (as doubles, exact for f32 and i64 values in range), in order. */
static int hash_tensor(uint64_t *h, const ag_tensor *t) {
    int64_t n = ag_tensor_numel(t);
    double *v = malloc(sizeof(double) * (size_t)(n ? n : 1));
    if (!v)
        return -1;
    int rc = ag_tensor_to_doubles(t, v);
    if (rc == 0)
        *h = fnv(*h, v, sizeof(double) * (size_t)n);
    free(v);
    return rc;
}

static uint64_t hash_params(ag_module *m, char *err, size_t errn) {
    ag_named_tensors nt;
    if (ag_module_named_parameters(m, true, &nt)) {
        snprintf(err, errn, "named_parameters: %s", ag_last_error());
        return 0;
    }
    uint64_t h = FNV0;
    for (int i = 0; i < nt.n; i++) {
        h = fnv(h, nt.names[i], strlen(nt.names[i]));
        if (hash_tensor(&h, nt.tensors[i]))
            snprintf(err, errn, "to_doubles %s: %s", nt.names[i], ag_last_error());
    }
    ag_named_tensors_free(&nt);
    return h;
}

/* ---- 1. cold start ---- */

/* What one thread of a cold-start trial saw. */
typedef struct cold_out {
    char err[256];
    int nops;
    uint64_t registry; /* the registered ops' names, in registry order */
    uint64_t eager;    /* bits of a few eager results */
    uint64_t mlp;      /* the zoo mlp's forward output */
    bool log_op;       /* ag_zoo_log_value_op() returned an op */
} cold_out;

/* The built-in ops (names without a namespace; another thread may have registered the
 * effects model's op already or not). */
static void cold_registry(cold_out *o) {
    int n = ag_op_count();
    uint64_t h = FNV0;
    for (int i = 0; i < n; i++) {
        const ag_op *op = ag_op_at(i);
        if (!op || ag_op_find(ag_op_name(op)) != op) {
            snprintf(o->err, sizeof o->err, "op %d: %s not found by name", i,
                     op ? ag_op_name(op) : "(NULL)");
            return;
        }
        if (strstr(ag_op_name(op), "::"))
            continue;
        h = fnv(h, ag_op_name(op), strlen(ag_op_name(op)) + 1);
        o->nops++;
    }
    o->registry = h;
}

static void cold_eager(cold_out *o) {
    ag_scope_begin();
    ag_tensor *a = ag_arange(AG_F32, 0, 12, 1);
    ag_tensor *x = ag_reshape(a, 2, (int64_t[]){3, 4});
    ag_tensor *y = ag_add(ag_mul_scalar(ag_exp(x), 0.5), ag_relu(ag_neg(x)));
    ag_tensor *s = ag_sum_all(ag_mm(y, ag_t(y)));
    uint64_t h = FNV0;
    if (!s || hash_tensor(&h, y) || hash_tensor(&h, s))
        snprintf(o->err, sizeof o->err, "eager: %s", ag_last_error());
    o->eager = h;
    ag_scope_end();
}

static void cold_mlp(cold_out *o) {
    ag_module *m;
    ag_tensor *in[2];
    int nin;
    if (ag_zoo_build("mlp", NULL, &m, in, 2, &nin)) {
        snprintf(o->err, sizeof o->err, "zoo mlp: %s", ag_last_error());
        return;
    }
    ag_scope_begin();
    ag_tensor *out = NULL;
    uint64_t h = FNV0;
    if (ag_module_call(m, in, nin, &out, 1) != 1 || hash_tensor(&h, out))
        snprintf(o->err, sizeof o->err, "mlp forward: %s", ag_last_error());
    o->mlp = h;
    ag_scope_end();
    for (int i = 0; i < nin; i++)
        ag_tensor_free(in[i]);
    ag_module_free(m);
}

typedef struct cold_arg {
    pthread_barrier_t *bar;
    int k;
    cold_out out;
} cold_arg;

/* The four steps in an order that depends on the thread, so that every kind of first call
 * meets the others. */
static void cold_steps(int k, cold_out *o) {
    for (int i = 0; i < 4 && !o->err[0]; i++) {
        switch ((k + i) % 4) {
        case 0:
            cold_registry(o);
            break;
        case 1:
            cold_eager(o);
            break;
        case 2:
            o->log_op = ag_zoo_log_value_op() != NULL;
            break;
        case 3:
            cold_mlp(o);
            break;
        }
        if ((k + i) % 4 == 2 && !o->log_op)
            snprintf(o->err, sizeof o->err, "log_value op: %s", ag_last_error());
    }
}

static void *cold_worker(void *p) {
    cold_arg *a = p;
    pthread_barrier_wait(a->bar);
    cold_steps(a->k, &a->out);
    return NULL;
}

/* One trial in a forked child: writes NTHREADS cold_out to fd and exits. */
static void cold_child(int fd) {
    alarm(60); /* a deadlock fails the trial instead of hanging the test */
    pthread_barrier_t bar;
    pthread_barrier_init(&bar, NULL, NTHREADS);
    cold_arg args[NTHREADS] = {0};
    pthread_t th[NTHREADS];
    for (int k = 0; k < NTHREADS; k++) {
        args[k].bar = &bar;
        args[k].k = k;
        pthread_create(&th[k], NULL, cold_worker, &args[k]);
    }
    for (int k = 0; k < NTHREADS; k++) {
        pthread_join(th[k], NULL);
        if (write(fd, &args[k].out, sizeof args[k].out) != (ssize_t)sizeof args[k].out)
            _exit(3);
    }
    close(fd);
    exit(0);
}

static bool cold_same(const cold_out *a, const cold_out *b) {
    return a->nops == b->nops && a->registry == b->registry && a->eager == b->eager &&
           a->mlp == b->mlp && a->log_op == b->log_op;
}

/* Must run first: the children are only cold while this process has not called the library. */
static void test_cold_start(void **st) {
    (void)st;
    enum { TRIALS = 24 };
    cold_out got[TRIALS][NTHREADS];
    int status[TRIALS];
    for (int t = 0; t < TRIALS; t++) {
        int fds[2];
        assert_int_equal(pipe(fds), 0);
        fflush(NULL);
        pid_t pid = fork();
        assert_true(pid >= 0);
        if (pid == 0) {
            close(fds[0]);
            cold_child(fds[1]);
        }
        close(fds[1]);
        size_t need = sizeof got[t], have = 0;
        memset(got[t], 0, need);
        ssize_t r;
        while (have < need && (r = read(fds[0], (char *)got[t] + have, need - have)) > 0)
            have += (size_t)r;
        close(fds[0]);
        assert_int_equal(waitpid(pid, &status[t], 0), pid);
        if (!WIFEXITED(status[t]) || WEXITSTATUS(status[t]) != 0)
            print_error("cold start trial %d: child %s %d\n", t,
                        WIFSIGNALED(status[t]) ? "killed by signal" : "exited with",
                        WIFSIGNALED(status[t]) ? WTERMSIG(status[t]) : WEXITSTATUS(status[t]));
        assert_true(WIFEXITED(status[t]) && WEXITSTATUS(status[t]) == 0);
        assert_int_equal(have, need);
    }
    /* The reference: the same steps, one thread, now that this process is warm. */
    cold_out want = {0};
    cold_steps(0, &want);
    assert_string_equal(want.err, "");
    assert_true(want.nops > 100 && want.log_op);
    for (int t = 0; t < TRIALS; t++)
        for (int k = 0; k < NTHREADS; k++) {
            if (got[t][k].err[0])
                print_error("cold start trial %d, thread %d: %s\n", t, k, got[t][k].err);
            assert_string_equal(got[t][k].err, "");
            if (!cold_same(&got[t][k], &want))
                print_error("cold start trial %d, thread %d: ops %d/%d, registry %d, eager %d, "
                            "mlp %d, log_op %d\n",
                            t, k, got[t][k].nops, want.nops, got[t][k].registry == want.registry,
                            got[t][k].eager == want.eager, got[t][k].mlp == want.mlp,
                            got[t][k].log_op == want.log_op);
            assert_true(cold_same(&got[t][k], &want));
        }
}

/* ---- 2. exports, compiles and steps at once ---- */

#define STEPS 3

typedef struct job {
    const char *model;
    const char *config;
    double dropout; /* > 0: set as the build option */
    bool mincut;
    int omp; /* OpenMP threads of the job's thread */
} job;

typedef struct job_out {
    char err[512];
    char *joint; /* ag_graph_to_string of the joint (release with ag_free) */
    uint64_t loss[STEPS];
    uint64_t params;
    uint64_t log; /* the effects log records the job appended */
    int nlog;
} job_out;

static const job jobs[] = {
    {"mlp", NULL, 0, false, 1},     {"cnn", NULL, 0, true, 2},
    {"gpt2", "tiny", 0.1, true, 1}, {"dropout_mlp", NULL, 0, false, 1},
    {"effects", NULL, 0, true, 1},  {"convbn", NULL, 0, false, 2},
    {"mlp", NULL, 0, true, 2},      {"gpt2", "tiny", 0, false, 1},
};
#define NJOBS ((int)(sizeof jobs / sizeof jobs[0]))

static uint64_t hash_log(int from, int to) {
    uint64_t h = FNV0;
    for (int i = from; i < to; i++) {
        ag_zoo_log_record r;
        memset(&r, 0, sizeof r);
        if (ag_zoo_log_get(i, &r) == 0)
            h = fnv(fnv(fnv(fnv(h, r.tag, sizeof r.tag), &r.grad, 1), &r.numel, 8), &r.sum, 8);
    }
    return h;
}

static void run_job(const job *jb, job_out *o) {
    memset(o, 0, sizeof *o);
    /* Never more OpenMP threads than the environment gives (OMP_NUM_THREADS=1 under TSan,
     * which cannot see libgomp's synchronization). */
    int prev_omp = ag_get_num_threads();
    if (ag_set_num_threads(jb->omp < prev_omp ? jb->omp : prev_omp)) {
        snprintf(o->err, sizeof o->err, "set_num_threads: %s", ag_last_error());
        return;
    }
    int log0 = ag_zoo_log_count();
    ag_module *model = NULL, *step = NULL;
    ag_tensor *in[4] = {0};
    int nin = 0;
    ag_joint *j = NULL;
    ag_compiled *c = NULL;
    ag_optim *opt = NULL;
    ag_zoo_opts zo = {.set_dropout = jb->dropout > 0, .dropout = jb->dropout};
    if (ag_zoo_build_opts(jb->model, jb->config, &zo, &model, in, 4, &nin)) {
        snprintf(o->err, sizeof o->err, "build: %s", ag_last_error());
        goto done;
    }
    if (!(step = tu_sum_loss_step(model))) {
        snprintf(o->err, sizeof o->err, "step module: %s", ag_last_error());
        goto done;
    }
    if (!(j = ag_export_joint(step, in, nin, NULL, NULL, 0, NULL))) {
        snprintf(o->err, sizeof o->err, "export: %s", ag_last_error());
        goto done;
    }
    /* seq_nr is left out: like torch's autograd sequence numbers it counts the thread's
     * earlier recorded calls, which differ between a job's sequential and threaded runs. */
    if (!(o->joint =
              ag_graph_to_string(ag_joint_graph(j), &(ag_print_opts){.stack_trace = true}))) {
        snprintf(o->err, sizeof o->err, "print: %s", ag_last_error());
        goto done;
    }
    ag_compile_opts co = {0};
    if (jb->mincut)
        co.partition.partitioner = AG_PARTITION_MINCUT;
    if (!(c = ag_compile_joint(j, &co)) ||
        !(opt = ag_optim_adamw(step, 1e-2, 0.9, 0.999, 1e-8, 0.01))) {
        snprintf(o->err, sizeof o->err, "compile: %s", ag_last_error());
        goto done;
    }
    for (int s = 0; s < STEPS; s++) {
        ag_scope_begin();
        ag_tensor *loss = NULL;
        int rc = ag_compiled_call_module(c, step, in, nin, &loss, 1) == 1 ? 0 : -1;
        if (rc == 0) {
            double v = ag_tensor_item(loss);
            memcpy(&o->loss[s], &v, sizeof v);
            rc = ag_backward(loss, NULL, false);
        }
        if (rc == 0)
            rc = ag_optim_step(opt);
        ag_optim_zero_grad(opt);
        ag_scope_end();
        if (rc) {
            snprintf(o->err, sizeof o->err, "step %d: %s", s, ag_last_error());
            goto done;
        }
    }
    o->params = hash_params(step, o->err, sizeof o->err);
    if (!strcmp(jb->model, "effects")) {
        int log1 = ag_zoo_log_count();
        o->nlog = log1 - log0;
        o->log = hash_log(log0, log1);
    }
done:
    ag_optim_free(opt);
    ag_compiled_free(c);
    ag_joint_free(j);
    ag_module_free(step);
    for (int i = 0; i < nin; i++)
        ag_tensor_free(in[i]);
    ag_set_num_threads(prev_omp);
}

typedef struct jobs_arg {
    pthread_barrier_t *bar;
    int k;
    job_out *outs;
} jobs_arg;

static void *jobs_worker(void *p) {
    jobs_arg *a = p;
    pthread_barrier_wait(a->bar);
    for (int i = a->k; i < NJOBS; i += NTHREADS)
        run_job(&jobs[i], &a->outs[i]);
    return NULL;
}

static void check_job(int i, const job_out *got, const job_out *want) {
    if (got->err[0])
        print_error("job %d (%s), threaded: %s\n", i, jobs[i].model, got->err);
    assert_string_equal(got->err, "");
    assert_non_null(got->joint);
    if (strcmp(got->joint, want->joint)) {
        size_t at = 0, line = 1;
        while (got->joint[at] && got->joint[at] == want->joint[at])
            line += got->joint[at++] == '\n';
        print_error("job %d (%s): the joints differ from line %zu: '%.80s' vs '%.80s'\n", i,
                    jobs[i].model, line, got->joint + at, want->joint + at);
    }
    assert_string_equal(got->joint, want->joint);
    for (int s = 0; s < STEPS; s++)
        if (got->loss[s] != want->loss[s])
            print_error("job %d (%s): loss of step %d differs\n", i, jobs[i].model, s);
    assert_memory_equal(got->loss, want->loss, sizeof got->loss);
    assert_true(got->params == want->params);
    assert_int_equal(got->nlog, want->nlog);
    assert_true(got->log == want->log);
}

static void test_jobs_at_once(void **st) {
    (void)st;
    job_out seq[NJOBS], par[NJOBS];
    for (int i = 0; i < NJOBS; i++) {
        run_job(&jobs[i], &seq[i]);
        if (seq[i].err[0])
            print_error("job %d (%s), sequential: %s\n", i, jobs[i].model, seq[i].err);
        assert_string_equal(seq[i].err, "");
    }
    assert_int_equal(seq[4].nlog, 12); /* effects: 2 forward records + 2 backward, 3 steps */
    for (int round = 0; round < 2; round++) {
        pthread_barrier_t bar;
        pthread_barrier_init(&bar, NULL, NTHREADS);
        jobs_arg args[NTHREADS];
        pthread_t th[NTHREADS];
        for (int k = 0; k < NTHREADS; k++) {
            args[k] = (jobs_arg){&bar, k, par};
            assert_int_equal(pthread_create(&th[k], NULL, jobs_worker, &args[k]), 0);
        }
        for (int k = 0; k < NTHREADS; k++)
            pthread_join(th[k], NULL);
        pthread_barrier_destroy(&bar);
        for (int i = 0; i < NJOBS; i++) {
            check_job(i, &par[i], &seq[i]);
            ag_free(par[i].joint);
        }
    }
    for (int i = 0; i < NJOBS; i++)
        ag_free(seq[i].joint);
}

/* ---- 3. registries, with_effects wrappers, the generator, the thread count ---- */

static int thr_meta(const ag_arg *a, ag_tmeta *o) {
    const ag_tensor *x = a[0].u.t;
    o[0] = (ag_tmeta){0};
    o[0].dtype = ag_tensor_dtype(x);
    o[0].ndim = ag_tensor_ndim(x);
    for (int d = 0; d < o[0].ndim; d++)
        o[0].sizes[d] = ag_tensor_size(x, d);
    int64_t st = 1;
    for (int d = o[0].ndim - 1; d >= 0; d--) {
        o[0].strides[d] = st;
        st *= o[0].sizes[d];
    }
    return 0;
}

static int thr_kernel(const ag_arg *a, ag_tensor **o) {
    (void)a;
    (void)o;
    return 0;
}

#define NREG 40
/* Schemas "thr::op<k>_<i>(Tensor x) -> Tensor" for each thread k, and one name that every
 * thread tries to register. */
static char schemas[NTHREADS][NREG][48];
static ag_opdef defs[NTHREADS][NREG];
static ag_opdef same_def[NTHREADS];

typedef struct reg_arg {
    pthread_barrier_t *bar;
    int k;
    const ag_op *same;
    char err[256];
} reg_arg;

static void *reg_worker(void *p) {
    reg_arg *a = p;
    pthread_barrier_wait(a->bar);
    a->same = ag_op_register(&same_def[a->k]);
    if (!a->same && !strstr(ag_last_error(), "already exists"))
        snprintf(a->err, sizeof a->err, "thr::same: %s", ag_last_error());
    for (int i = 0; i < NREG && !a->err[0]; i++) {
        const ag_op *op = ag_op_register(&defs[a->k][i]);
        if (!op) {
            snprintf(a->err, sizeof a->err, "register %s: %s", schemas[a->k][i], ag_last_error());
            break;
        }
        /* Lookups of built-in ops and of the other threads' ops while they register. */
        if (ag_op_find("addmm") == NULL || ag_op_find(ag_op_name(op)) != op ||
            ag_op_at(ag_op_count() - 1) == NULL)
            snprintf(a->err, sizeof a->err, "lookup after registering %s failed", ag_op_name(op));
        for (int k = 0; k < NTHREADS; k++) {
            const ag_op *f = ag_op_find(schemas[k][i] + 0);
            (void)f; /* a schema is not a name: only the lookup's safety matters here */
        }
    }
    return NULL;
}

static void test_register_from_threads(void **st) {
    (void)st;
    int before = ag_op_count();
    for (int k = 0; k < NTHREADS; k++) {
        for (int i = 0; i < NREG; i++) {
            snprintf(schemas[k][i], sizeof schemas[k][i], "thr::op%d_%d(Tensor x) -> Tensor", k, i);
            defs[k][i] = (ag_opdef){.schema = schemas[k][i],
                                    .meta = thr_meta,
                                    .kernel = thr_kernel,
                                    .dtypes = AG_DT_FLOAT};
        }
        same_def[k] = (ag_opdef){.schema = "thr::same(Tensor x) -> Tensor",
                                 .meta = thr_meta,
                                 .kernel = thr_kernel,
                                 .dtypes = AG_DT_FLOAT};
    }
    pthread_barrier_t bar;
    pthread_barrier_init(&bar, NULL, NTHREADS);
    reg_arg args[NTHREADS] = {0};
    pthread_t th[NTHREADS];
    for (int k = 0; k < NTHREADS; k++) {
        args[k].bar = &bar;
        args[k].k = k;
        assert_int_equal(pthread_create(&th[k], NULL, reg_worker, &args[k]), 0);
    }
    for (int k = 0; k < NTHREADS; k++)
        pthread_join(th[k], NULL);
    pthread_barrier_destroy(&bar);
    int nsame = 0;
    for (int k = 0; k < NTHREADS; k++) {
        if (args[k].err[0])
            print_error("thread %d: %s\n", k, args[k].err);
        assert_string_equal(args[k].err, "");
        nsame += args[k].same != NULL;
    }
    assert_int_equal(nsame, 1); /* one thread registered thr::same; the others were refused */
    assert_int_equal(ag_op_count(), before + 1 + NTHREADS * NREG);
    for (int k = 0; k < NTHREADS; k++)
        for (int i = 0; i < NREG; i++) {
            char name[32];
            snprintf(name, sizeof name, "thr::op%d_%d", k, i);
            const ag_op *op = ag_op_find(name);
            assert_non_null(op);
            assert_ptr_equal(ag_op_def(op), &defs[k][i]);
        }
}

typedef struct wrap_arg {
    pthread_barrier_t *bar;
    const ag_op *target;
    const ag_op *got[8];
} wrap_arg;

static void *wrap_worker(void *p) {
    wrap_arg *a = p;
    pthread_barrier_wait(a->bar);
    for (int i = 0; i < 8; i++)
        a->got[i] = ag_op_with_effects(a->target);
    return NULL;
}

/* Effectful ops of this test, so that their wrappers are made here, from threads. */
static ag_opdef eff_defs[6];
static char eff_schemas[6][64];

static void test_with_effects_from_threads(void **st) {
    (void)st;
    const ag_op *targets[6];
    for (int i = 0; i < 6; i++) {
        snprintf(eff_schemas[i], sizeof eff_schemas[i], "thr::effect%d(Tensor x) -> Tensor", i);
        eff_defs[i] = (ag_opdef){.schema = eff_schemas[i],
                                 .flags = AG_OP_EFFECTFUL,
                                 .meta = thr_meta,
                                 .kernel = thr_kernel,
                                 .dtypes = AG_DT_FLOAT};
        targets[i] = ag_op_register(&eff_defs[i]);
        assert_non_null(targets[i]);
    }
    pthread_barrier_t bar;
    pthread_barrier_init(&bar, NULL, NTHREADS);
    wrap_arg args[NTHREADS];
    pthread_t th[NTHREADS];
    for (int i = 0; i < 6; i++) {
        for (int k = 0; k < NTHREADS; k++) {
            args[k] = (wrap_arg){.bar = &bar, .target = targets[i]};
            assert_int_equal(pthread_create(&th[k], NULL, wrap_worker, &args[k]), 0);
        }
        for (int k = 0; k < NTHREADS; k++)
            pthread_join(th[k], NULL);
        const ag_op *w = ag_op_with_effects(targets[i]);
        assert_non_null(w);
        assert_ptr_equal(ag_op_with_effects_target(w), targets[i]);
        for (int k = 0; k < NTHREADS; k++)
            for (int r = 0; r < 8; r++)
                assert_ptr_equal(args[k].got[r], w); /* one wrapper per op */
    }
    pthread_barrier_destroy(&bar);
}

typedef struct rng_arg {
    pthread_barrier_t *bar;
    uint64_t seed;
    uint64_t bits;
    uint64_t state0_seed, state0_offset;
} rng_arg;

static uint64_t draw_some(uint64_t seed) {
    uint64_t h = FNV0;
    ag_manual_seed(seed);
    for (int i = 0; i < 50; i++) {
        ag_tensor *t = ag_randn(AG_F32, 1, (int64_t[]){17});
        if (!t || hash_tensor(&h, t))
            return 0;
        ag_tensor_free(t);
    }
    return h;
}

static void *rng_worker(void *p) {
    rng_arg *a = p;
    ag_rng_get_state(&a->state0_seed, &a->state0_offset);
    pthread_barrier_wait(a->bar);
    a->bits = draw_some(a->seed);
    return NULL;
}

static void test_rng_per_thread(void **st) {
    (void)st;
    ag_manual_seed(77);
    ag_tensor *t = ag_rand(AG_F32, 1, (int64_t[]){5});
    ag_tensor_free(t);
    uint64_t seed, offset;
    ag_rng_get_state(&seed, &offset);
    uint64_t want[NTHREADS];
    for (int k = 0; k < NTHREADS; k++)
        want[k] = draw_some(1000 + (uint64_t)k);
    ag_rng_set_state(seed, offset);
    pthread_barrier_t bar;
    pthread_barrier_init(&bar, NULL, NTHREADS);
    rng_arg args[NTHREADS];
    pthread_t th[NTHREADS];
    for (int k = 0; k < NTHREADS; k++) {
        args[k] = (rng_arg){.bar = &bar, .seed = 1000 + (uint64_t)k};
        assert_int_equal(pthread_create(&th[k], NULL, rng_worker, &args[k]), 0);
    }
    for (int k = 0; k < NTHREADS; k++)
        pthread_join(th[k], NULL);
    pthread_barrier_destroy(&bar);
    for (int k = 0; k < NTHREADS; k++) {
        assert_true(want[k] != 0);
        assert_true(args[k].bits == want[k]);
        /* A new thread's generator starts where every thread's does. */
        assert_true(args[k].state0_seed == 0x5eed && args[k].state0_offset == 0);
    }
    /* This thread's generator did not move. */
    uint64_t s2, o2;
    ag_rng_get_state(&s2, &o2);
    assert_true(s2 == seed && o2 == offset);
}

static void *num_threads_worker(void *p) {
    int *got = p;
    got[0] = ag_set_num_threads(1);
    got[1] = ag_get_num_threads();
    return NULL;
}

static void test_num_threads(void **st) {
    (void)st;
    int prev = ag_get_num_threads();
    assert_int_equal(ag_set_num_threads(0), AG_EINVAL);
    tu_assert_error_contains("set_num_threads: expected a positive number of threads, got 0");
    assert_int_equal(ag_set_num_threads(-3), AG_EINVAL);
    tu_assert_error_contains("got -3");
    assert_int_equal(ag_get_num_threads(), prev); /* a refused call changes nothing */
    int limit = 8 * omp_get_num_procs();
    if (omp_get_thread_limit() < limit)
        limit = omp_get_thread_limit();
    assert_int_equal(ag_set_num_threads(limit + 1), AG_EINVAL);
    tu_assert_error_contains("set_num_threads: ");
    tu_assert_error_contains("threads is more than");
    assert_int_equal(ag_set_num_threads(1 << 30), AG_EINVAL);
    assert_int_equal(ag_get_num_threads(), prev);
    assert_int_equal(ag_set_num_threads(limit), 0);
    assert_int_equal(ag_get_num_threads(), limit);
    assert_int_equal(ag_set_num_threads(2), 0);
    /* Another thread's count is its own. */
    int got[2];
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, num_threads_worker, got), 0);
    pthread_join(th, NULL);
    assert_int_equal(got[0], 0);
    assert_int_equal(got[1], 1);
    assert_int_equal(ag_get_num_threads(), 2);
    assert_int_equal(ag_set_num_threads(prev), 0);
}

/* ---- the plan step hook ---- */

typedef struct hook_arg {
    pthread_barrier_t *bar;
    bool install;
    _Atomic int calls; /* hook calls made on this worker's hook */
    int runs_ok;
    pthread_t self;
    _Atomic int foreign; /* calls of this worker's hook from another thread */
} hook_arg;

static void count_step(const char *op, const char *node, void *ud) {
    (void)op;
    (void)node;
    hook_arg *a = ud;
    atomic_fetch_add(&a->calls, 1);
    if (!pthread_equal(pthread_self(), a->self))
        atomic_fetch_add(&a->foreign, 1);
}

static int mlp_fn(void *ud, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)ud;
    (void)nin;
    (void)max_out;
    out[0] = ag_tanh(ag_mul_scalar(ag_relu(ag_mm(in[0], ag_t(in[1]))), 0.5)); /* scope's */
    return out[0] ? 1 : ag_last_status();
}

static void *hook_worker(void *p) {
    hook_arg *a = p;
    a->self = pthread_self();
    uint64_t st = 7;
    ag_tensor *in[2] = {tu_rand_tensor(AG_F32, 2, (int64_t[]){8, 16}, -1, 1, tu_xorshift, &st),
                        tu_rand_tensor(AG_F32, 2, (int64_t[]){4, 16}, -1, 1, tu_xorshift, &st)};
    ag_graph *g = ag_trace(mlp_fn, NULL, in, 2, NULL, NULL, NULL);
    ag_plan *plan = g ? ag_plan_new(g, NULL) : NULL;
    if (a->install)
        ag__plan_set_step_hook(count_step, a);
    pthread_barrier_wait(a->bar);
    for (int r = 0; r < 50 && plan; r++) {
        ag_tensor *out = NULL;
        if (ag_plan_run(plan, in, 2, &out, 1) == 1)
            a->runs_ok++;
        ag_tensor_free(out);
    }
    if (a->install)
        ag__plan_set_step_hook(NULL, NULL);
    ag_plan_free(plan);
    ag_graph_free(g);
    ag_tensor_free(in[0]);
    ag_tensor_free(in[1]);
    return NULL;
}

static void test_step_hook_per_thread(void **st) {
    (void)st;
    pthread_barrier_t bar;
    pthread_barrier_init(&bar, NULL, 2);
    hook_arg a = {.bar = &bar, .install = true}, b = {.bar = &bar, .install = false};
    pthread_t ta, tb;
    assert_int_equal(pthread_create(&ta, NULL, hook_worker, &a), 0);
    assert_int_equal(pthread_create(&tb, NULL, hook_worker, &b), 0);
    pthread_join(ta, NULL);
    pthread_join(tb, NULL);
    pthread_barrier_destroy(&bar);
    assert_int_equal(a.runs_ok, 50);
    assert_int_equal(b.runs_ok, 50);
    assert_int_equal(atomic_load(&a.foreign), 0); /* the other thread's plan never called it */
    /* Each run calls the hook before each kernel and once after the last. */
    assert_true(atomic_load(&a.calls) > 0 && atomic_load(&a.calls) % 50 == 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cold_start), /* first: the children must start cold */
        cmocka_unit_test(test_jobs_at_once),
        cmocka_unit_test(test_register_from_threads),
        cmocka_unit_test(test_with_effects_from_threads),
        cmocka_unit_test(test_rng_per_thread),
        cmocka_unit_test(test_num_threads),
        cmocka_unit_test(test_step_hook_per_thread),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
