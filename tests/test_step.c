/* The compiled training step as a whole (compiled call + ag_backward + AdamW + zero_grad):
 *   1. No bookkeeping allocations once warm: after warm-up, a step of the zoo's mlp, cnn and
 *      gpt2 (tiny, tied weights) makes exactly one allocation, the struct of the loss handle
 *      the callable returns. Per-call arrays, the backward node and its state, the engine's
 *      arrays and seed, scope entries and gradients (handed over uncopied, also when they
 *      are views such as t(t(mm)) or two gradients of one tied weight) allocate nothing.
 *   2. Donated gradients behave as eager's: gradients accumulated over two backward passes,
 *      with every .grad changed in place in between, match eager, and no two parameters
 *      share gradient memory.
 *   3. The engine's kept memory: a backward run from inside another backward (which finds
 *      the memory taken) gives the right gradient; memory kept by a thread is freed when it
 *      exits, and by ag__thread_caches_release.
 *   4. AdamW's single pass over all parameters (one OpenMP region, the elements of all
 *      parameters split evenly over threads): parameters of assorted sizes (below and above
 *      the parallel threshold, odd, one without a gradient) follow a float64 reference for
 *      three steps with weight decay, and the result is bit-identical with 1 and 2 threads
 *      (the split moves; the arithmetic may not).
 *   5. No threads started per step: a warm eager or compiled step of mlp, cnn and gpt2 starts
 *      no thread (counted by interposing pthread_create, which libgomp calls for every thread
 *      it starts). A kernel that opened an OpenMP team of one around a BLAS call made OpenBLAS's
 *      own region nested, and libgomp then started and ended a thread per GEMM while its pool
 *      thread spun on the other core (the mlp step ran 2x slower with nothing set). */
#define _GNU_SOURCE /* RTLD_NEXT */
#include "testutil.h"
#include "core/internal.h"

#include <dlfcn.h>

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- a counting allocator (atomic: OpenMP workers allocate too) ---- */

static struct {
    ag_allocator prev;
    _Atomic int64_t allocs, frees;
} cnt;

static void *cnt_alloc(void *ud, size_t size, size_t align) {
    (void)ud;
    atomic_fetch_add(&cnt.allocs, 1);
    return cnt.prev.alloc(cnt.prev.ud, size, align);
}

static void cnt_free(void *ud, void *p) {
    (void)ud;
    if (p)
        atomic_fetch_add(&cnt.frees, 1);
    cnt.prev.free(cnt.prev.ud, p);
}

static void cnt_begin(void) {
    cnt.prev = ag_get_allocator();
    atomic_store(&cnt.allocs, 0);
    atomic_store(&cnt.frees, 0);
    ag_set_allocator(&(ag_allocator){cnt_alloc, cnt_free, NULL});
}

static void cnt_end(void) {
    ag_set_allocator(&cnt.prev);
}

/* ---- counting the threads started: this definition interposes libc's for the whole process
 * (libgomp's calls included) and forwards to the next one (libc's, or a sanitizer's) ---- */

static _Atomic int64_t threads_started;

int pthread_create(pthread_t *t, const pthread_attr_t *attr, void *(*fn)(void *), void *arg) {
    typedef int (*create_fn)(pthread_t *, const pthread_attr_t *, void *(*)(void *), void *);
    static create_fn real;
    if (!real)
        *(void **)&real = dlsym(RTLD_NEXT, "pthread_create");
    atomic_fetch_add(&threads_started, 1);
    return real(t, attr, fn, arg);
}

/* ---- the step: loss = sum_k (0.5 + 0.25 k) sum(out_k) (tu_sum_loss_step) ---- */

typedef struct step_case {
    ag_module *step;
    ag_tensor *in[8];
    int nin;
    ag_joint *j;
    ag_compiled *c;
    ag_optim *opt;
} step_case;

/* The zoo model `name` in a step module; compiled (min-cut, budget 1) when `compile`. */
static void case_open(step_case *sc, const char *name, bool compile) {
    memset(sc, 0, sizeof *sc);
    ag_module *model;
    assert_int_equal(ag_zoo_build(name, NULL, &model, sc->in, 8, &sc->nin), 0);
    sc->step = tu_sum_loss_step(model);
    assert_non_null(sc->step);
    if (compile) {
        sc->j = ag_export_joint(sc->step, sc->in, sc->nin, NULL, NULL, 0, NULL);
        assert_non_null(sc->j);
        ag_compile_opts co = {
            .partition = {.partitioner = AG_PARTITION_MINCUT, .memory_budget = 1}};
        sc->c = ag_compile_joint(sc->j, &co);
        if (!sc->c)
            print_error("%s: %s\n", name, ag_last_error());
        assert_non_null(sc->c);
    }
    sc->opt = ag_optim_adamw(sc->step, 1e-3, 0.9, 0.999, 1e-8, 0.01);
    assert_non_null(sc->opt);
}

static void case_close(step_case *sc) {
    ag_optim_free(sc->opt);
    ag_compiled_free(sc->c);
    ag_joint_free(sc->j);
    ag_module_free(sc->step);
    for (int i = 0; i < sc->nin; i++)
        ag_tensor_free(sc->in[i]);
}

/* Forward (compiled or eager) and backward, in the caller's scope. */
static void forward_backward(step_case *sc) {
    ag_tensor *loss = NULL;
    int n = sc->c ? ag_compiled_call_module(sc->c, sc->step, sc->in, sc->nin, &loss, 1)
                  : ag_module_call(sc->step, sc->in, sc->nin, &loss, 1);
    if (n != 1)
        print_error("step: %s\n", ag_last_error());
    assert_int_equal(n, 1);
    assert_true(isfinite(ag_tensor_item(loss)));
    assert_int_equal(ag_backward(loss, NULL, false), 0);
}

static void train_step(step_case *sc) {
    ag_scope_begin();
    forward_backward(sc);
    assert_int_equal(ag_optim_step(sc->opt), 0);
    ag_optim_zero_grad(sc->opt);
    ag_scope_end();
}

/* ---- 1. allocations of a warm step ---- */

static void test_warm_step_allocations(void **st) {
    (void)st;
    const char *models[] = {"mlp", "cnn", "gpt2"};
    for (size_t i = 0; i < sizeof models / sizeof *models; i++) {
        step_case sc;
        case_open(&sc, models[i], true);
        for (int k = 0; k < 3; k++)
            train_step(&sc);
        cnt_begin();
        for (int k = 0; k < 2; k++)
            train_step(&sc);
        cnt_end();
        int64_t per_step = atomic_load(&cnt.allocs) / 2;
        print_message("  %-5s %lld allocations per warm step (%lld in 2 steps)\n", models[i],
                      (long long)per_step, (long long)atomic_load(&cnt.allocs));
        /* The loss handle's struct (ag_detach of the forward plan's output), nothing else. */
        assert_int_equal(atomic_load(&cnt.allocs), 2);
        assert_int_equal(atomic_load(&cnt.frees), 2);
        case_close(&sc);
    }
}

/* ---- 5. threads started by a warm step ---- */

static void test_warm_step_threads(void **st) {
    (void)st;
    const char *models[] = {"mlp", "cnn", "gpt2"};
    for (size_t i = 0; i < sizeof models / sizeof *models; i++)
        for (int compiled = 0; compiled < 2; compiled++) {
            step_case sc;
            case_open(&sc, models[i], compiled);
            for (int k = 0; k < 2; k++)
                train_step(&sc);
            int64_t before = atomic_load(&threads_started);
            for (int k = 0; k < 3; k++)
                train_step(&sc);
            int64_t started = atomic_load(&threads_started) - before;
            print_message("  %-5s %-8s %lld threads started in 3 warm steps\n", models[i],
                          compiled ? "compiled" : "eager", (long long)started);
            assert_int_equal(started, 0);
            case_close(&sc);
        }
    /* The counter sees libgomp's threads at all: a first team of a new size starts some. */
    int64_t before = atomic_load(&threads_started);
    int nt = ag_get_num_threads();
    _Atomic int ran = 0;
#pragma omp parallel num_threads(nt + 2)
    atomic_fetch_add(&ran, 1);
    assert_int_equal(atomic_load(&ran), nt + 2);
    assert_true(atomic_load(&threads_started) > before);
}

/* ---- 2. donated gradients against eager ---- */

static void scale_grads(ag_module *m, double s) {
    ag_named_tensors nt;
    assert_int_equal(ag_module_named_parameters(m, true, &nt), 0);
    bool prev = ag_set_grad_enabled(false);
    for (int i = 0; i < nt.n; i++)
        if (ag_tensor_grad(nt.tensors[i]))
            assert_non_null(ag_mul_scalar_(ag_tensor_grad(nt.tensors[i]), s));
    ag_set_grad_enabled(prev);
    ag_named_tensors_free(&nt);
}

static double rel_diff(const ag_tensor *a, const ag_tensor *b) {
    if (!a || !b)
        return a == b ? 0 : INFINITY;
    double m = 1;
    for (int64_t i = 0; i < ag_tensor_numel(a); i++)
        m = fmax(m, fabs(ag_tensor_item_at(a, i)));
    return tu_max_abs_diff(a, b) / m;
}

static void test_donated_grads_match_eager(void **st) {
    (void)st;
    const char *models[] = {"gpt2", "mlp", "cnn"};
    for (size_t mi = 0; mi < sizeof models / sizeof *models; mi++) {
        step_case e, c;
        case_open(&e, models[mi], false);
        case_open(&c, models[mi], true);
        for (int round = 0; round < 2; round++) {
            ag_scope_begin();
            /* Two backward passes accumulate; every .grad is halved in place in between. */
            forward_backward(&e);
            forward_backward(&c);
            scale_grads(e.step, 0.5);
            scale_grads(c.step, 0.5);
            forward_backward(&e);
            forward_backward(&c);
            ag_named_tensors pe, pc;
            assert_int_equal(ag_module_named_parameters(e.step, true, &pe), 0);
            assert_int_equal(ag_module_named_parameters(c.step, true, &pc), 0);
            assert_int_equal(pe.n, pc.n);
            for (int i = 0; i < pc.n; i++) {
                ag_tensor *ge = ag_tensor_grad(pe.tensors[i]), *gc = ag_tensor_grad(pc.tensors[i]);
                double d = rel_diff(ge, gc);
                if (!(d <= 1e-5))
                    print_error("%s: grad of %s differs by %g\n", models[mi], pc.names[i], d);
                assert_true(d <= 1e-5);
                for (int k = 0; gc && k < i; k++) {
                    ag_tensor *o = ag_tensor_grad(pc.tensors[k]);
                    assert_false(o && ag_tensor_same_storage(o, gc));
                }
            }
            ag_named_tensors_free(&pe);
            ag_named_tensors_free(&pc);
            assert_int_equal(ag_optim_step(e.opt), 0);
            assert_int_equal(ag_optim_step(c.opt), 0);
            ag_optim_zero_grad(e.opt);
            ag_optim_zero_grad(c.opt);
            ag_scope_end();
        }
        case_close(&e);
        case_close(&c);
    }
}

/* ---- 3. the engine's kept memory ---- */

/* A custom node whose backward runs a whole backward pass of its own: d/dx sum(x * x) = 2x,
 * times the incoming gradient. */
static int nested_bw(void *ud, ag_tensor *const *gout, int nout, ag_tensor **gin, int nin,
                     const bool *needs) {
    ag_tensor *x = ud;
    (void)nout;
    (void)nin;
    if (!needs[0])
        return 0;
    bool prev = ag_set_grad_enabled(true);
    ag_tensor *xl = ag_detach(x);
    ag_tensor_set_requires_grad(xl, true);
    ag_tensor *y = ag_sum_all(ag_mul(xl, xl)), *g[1] = {NULL};
    int rc = y ? ag_grad(&y, NULL, 1, &xl, 1, g, false, false) : ag_last_status();
    ag_set_grad_enabled(prev);
    if (rc)
        return rc;
    gin[0] = ag_mul(g[0], gout[0]);
    return gin[0] ? 0 : ag_last_status();
}

static void test_nested_backward(void **st) {
    (void)st;
    ag_scope_begin();
    ag_tensor *x = ag_from_data(AG_F32, 1, (int64_t[]){3}, (float[]){1, -2, 3});
    ag_tensor_set_requires_grad(x, true);
    ag_tensor *h = ag_mul_scalar(x, 1.0); /* a node before the custom one */
    ag_tensor *out = ag_detach(h);
    out = ag_tensor_keep(out);
    ag_tensor *ins[1] = {h};
    assert_int_equal(ag__autograd_custom("Nested", ins, 1, &out, 1, NULL, nested_bw, h, NULL), 0);
    ag_tensor *loss = ag_sum_all(ag_mul_scalar(out, 3.0));
    assert_int_equal(ag_backward(loss, NULL, false), 0);
    /* d loss / dx = 3 * 2x. */
    tu_assert_values(ag_tensor_grad(x), 1, (int64_t[]){3}, (double[]){6, -12, 18}, 1e-6);
    ag_tensor_free(out);
    ag_scope_end();
}

static void *backward_on_thread(void *arg) {
    (void)arg;
    ag_scope_begin();
    ag_tensor *x = ag_from_data(AG_F32, 1, (int64_t[]){2}, (float[]){1, 2});
    ag_tensor_set_requires_grad(x, true);
    ag_tensor *loss = ag_sum_all(ag_mul(x, x));
    int rc = ag_backward(loss, NULL, false);
    ag_scope_end();
    return rc == 0 ? arg : NULL;
}

static void test_kept_memory_released(void **st) {
    (void)st;
    /* A thread that ran a backward frees what it kept when it exits. */
    cnt_begin();
    pthread_t t;
    void *res = NULL;
    int token;
    assert_int_equal(pthread_create(&t, NULL, backward_on_thread, &token), 0);
    assert_int_equal(pthread_join(t, &res), 0);
    cnt_end();
    assert_ptr_equal(res, &token);
    assert_true(atomic_load(&cnt.allocs) > 0);
    assert_int_equal(atomic_load(&cnt.frees), atomic_load(&cnt.allocs));
    /* On this thread: kept after a backward, freed by ag__thread_caches_release. */
    ag__thread_caches_release();
    cnt_begin();
    assert_ptr_equal(backward_on_thread(&token), &token);
    int64_t kept = atomic_load(&cnt.allocs) - atomic_load(&cnt.frees);
    assert_true(kept > 0); /* the engine's arrays and the ones seed */
    ag__thread_caches_release();
    cnt_end();
    assert_int_equal(atomic_load(&cnt.frees), atomic_load(&cnt.allocs));
}

/* ---- 4. AdamW in one pass ---- */

enum { NPARAM = 6 };
static const int64_t psizes[NPARAM] = {3, 1000, 40001, 7, 65537, 129};

static double unit(uint64_t *s) {
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return (double)(*s >> 11) / 9007199254740992.0;
}

/* A module with the six parameters above plus one that never gets a gradient. */
static ag_module *many_params(void) {
    ag_module *m = ag_module_new("Many", NULL, NULL, NULL);
    uint64_t s = 7;
    for (int i = 0; i < NPARAM; i++) {
        ag_tensor *t = ag_zeros(AG_F32, 1, &psizes[i]);
        float *d = ag_tensor_data(t);
        for (int64_t k = 0; k < psizes[i]; k++)
            d[k] = (float)(2 * unit(&s) - 1);
        char name[16];
        snprintf(name, sizeof name, "p%d", i);
        assert_int_equal(ag_module_register_parameter(m, name, t), 0);
        ag_tensor_free(t);
    }
    ag_tensor *idle = ag_ones(AG_F32, 1, (int64_t[]){5});
    assert_int_equal(ag_module_register_parameter(m, "idle", idle), 0);
    ag_tensor_free(idle);
    return m;
}

static int64_t ptotal(void) {
    int64_t n = 0;
    for (int i = 0; i < NPARAM; i++)
        n += psizes[i];
    return n;
}

/* Every step's gradients, the parameters' concatenated. */
static float *make_grads(void) {
    int64_t n = ptotal();
    float *g = malloc(sizeof(float) * (size_t)(3 * n));
    uint64_t s = 11;
    for (int64_t k = 0; k < 3 * n; k++)
        g[k] = (float)(unit(&s) - 0.5);
    return g;
}

static void put_grads(ag_module *m, const float *g) {
    for (int i = 0; i < NPARAM; i++) {
        char name[16];
        snprintf(name, sizeof name, "p%d", i);
        ag_tensor *t = ag_from_data(AG_F32, 1, &psizes[i], g);
        assert_int_equal(ag_tensor_set_grad(ag_module_param(m, name), t), 0);
        ag_tensor_free(t);
        g += psizes[i];
    }
}

/* The parameters' values, concatenated (malloc'd). */
static float *get_params(ag_module *m) {
    float *out = malloc(sizeof(float) * (size_t)ptotal()), *w = out;
    for (int i = 0; i < NPARAM; i++) {
        char name[16];
        snprintf(name, sizeof name, "p%d", i);
        memcpy(w, ag_tensor_data(ag_module_param(m, name)), sizeof(float) * (size_t)psizes[i]);
        w += psizes[i];
    }
    return out;
}

/* Runs 3 AdamW steps on `threads` threads; returns the parameters' values. */
static float *run_adamw(int threads, const float *grads) {
    int prev = ag_get_num_threads();
    ag_set_num_threads(threads);
    ag_module *m = many_params();
    ag_optim *o = ag_optim_adamw(m, 1e-2, 0.9, 0.95, 1e-8, 0.1);
    for (int step = 0; step < 3; step++) {
        put_grads(m, grads + step * ptotal());
        assert_int_equal(ag_optim_step(o), 0);
    }
    float *out = get_params(m);
    tu_assert_values(ag_module_param(m, "idle"), 1, (int64_t[]){5}, (double[]){1, 1, 1, 1, 1}, 0);
    ag_optim_free(o);
    ag_module_free(m);
    ag_set_num_threads(prev);
    return out;
}

static void test_adamw_one_pass(void **st) {
    (void)st;
    int64_t n = ptotal();
    float *grads = make_grads();
    float *one = run_adamw(1, grads), *two = run_adamw(2, grads);
    assert_memory_equal(one, two, sizeof(float) * (size_t)n);
    /* The float64 reference: torch.optim.AdamW's formulas on the same f32 inputs. */
    ag_module *m = many_params();
    float *p0 = get_params(m);
    const double lr = 1e-2, b1 = 0.9, b2 = 0.95, eps = 1e-8, wd = 0.1;
    double worst = 0;
    for (int64_t k = 0; k < n; k++) {
        double p = p0[k], mm = 0, vv = 0;
        for (int t = 1; t <= 3; t++) {
            double g = grads[(t - 1) * n + k];
            p -= lr * wd * p;
            mm = b1 * mm + (1 - b1) * g;
            vv = b2 * vv + (1 - b2) * g * g;
            p -= lr * (mm / (1 - pow(b1, t))) / (sqrt(vv / (1 - pow(b2, t))) + eps);
        }
        worst = fmax(worst, fabs(one[k] - p) / (1 + fabs(p)));
    }
    if (!(worst < 1e-6))
        print_error("AdamW vs the float64 reference: %g\n", worst);
    assert_true(worst < 1e-6);
    ag_module_free(m);
    free(p0);
    free(grads);
    free(one);
    free(two);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_warm_step_allocations),
        cmocka_unit_test(test_donated_grads_match_eager),
        cmocka_unit_test(test_nested_backward),
        cmocka_unit_test(test_kept_memory_released),
        cmocka_unit_test(test_adamw_one_pass),
        cmocka_unit_test(test_warm_step_threads),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
