/* Shared helpers for the cmocka tests (see testutil.h): literal and pseudo-random tensors,
 * assertions, the counting/failing allocator with its OOM sweep, and gradcheck of an op's
 * samples with the table-wide test's semantics. */
#include "testutil.h"

#include "ops/samples.h"
#include "core/internal.h"

#include <limits.h>
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

/* ---- tensors ---- */

ag_tensor *tu_tensor(ag_dtype dt, int ndim, const int64_t *sizes, const double *vals) {
    int64_t n = 1;
    for (int i = 0; i < ndim; i++)
        n *= sizes[i];
    ag_tensor *t = ag_empty(dt, ndim, sizes);
    assert_non_null(t);
    char *p = ag_tensor_data(t);
    for (int64_t i = 0; i < n; i++) {
        switch (dt) {
        case AG_F32:
            ((float *)p)[i] = (float)vals[i];
            break;
        case AG_F64:
            ((double *)p)[i] = vals[i];
            break;
        case AG_I64:
            ((int64_t *)p)[i] = (int64_t)vals[i];
            break;
        case AG_BOOL:
            ((_Bool *)p)[i] = vals[i] != 0;
            break;
        default:
            fail();
        }
    }
    return t;
}

ag_tensor *tu_leaf(ag_dtype dt, int ndim, const int64_t *sizes, const double *vals) {
    ag_tensor *t = tu_tensor(dt, ndim, sizes, vals);
    assert_int_equal(ag_tensor_set_requires_grad(t, true), 0);
    return t;
}

uint64_t tu_xorshift_next(uint64_t *state) {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    return *state;
}

double tu_xorshift(uint64_t *state, double lo, double hi) {
    return lo + (hi - lo) * (double)(tu_xorshift_next(state) >> 11) * 0x1.0p-53;
}

double tu_lcg(uint64_t *state, double lo, double hi) {
    *state = *state * 6364136223846793005ull + 1442695040888963407ull;
    return lo + (hi - lo) * (double)(*state >> 11) * 0x1.0p-53;
}

ag_tensor *tu_rand_tensor(ag_dtype dt, int ndim, const int64_t *sizes, double lo, double hi,
                          tu_gen gen, uint64_t *state) {
    int64_t n = 1;
    for (int i = 0; i < ndim; i++)
        n *= sizes[i];
    double *v = malloc(sizeof(double) * (size_t)(n ? n : 1));
    assert_non_null(v);
    for (int64_t i = 0; i < n; i++)
        v[i] = gen(state, lo, hi);
    ag_tensor *t = tu_tensor(dt, ndim, sizes, v);
    free(v);
    return t;
}

/* ---- assertions ---- */

void tu_assert_shape(const ag_tensor *t, int ndim, const int64_t *sizes) {
    assert_non_null(t);
    assert_int_equal(ag_tensor_ndim(t), ndim);
    for (int i = 0; i < ndim; i++)
        assert_int_equal(ag_tensor_sizes(t)[i], sizes[i]);
}

void tu_assert_near(double got, double want, double tol, const char *what, int64_t i) {
    if (!(fabs(got - want) <= tol * (1 + fabs(want)))) {
        print_error("%s[%lld]: got %.12g, expected %.12g\n", what, (long long)i, got, want);
        fail();
    }
}

void tu_assert_close_named(const ag_tensor *t, const double *want, double tol, const char *what) {
    assert_non_null(t);
    int64_t n = ag_tensor_numel(t);
    for (int64_t i = 0; i < n; i++)
        tu_assert_near(ag_tensor_item_at(t, i), want[i], tol, what, i);
}

void tu_assert_close(const ag_tensor *t, const double *want, double tol) {
    tu_assert_close_named(t, want, tol, "element");
}

void tu_assert_values(const ag_tensor *t, int ndim, const int64_t *sizes, const double *vals,
                      double tol) {
    tu_assert_shape(t, ndim, sizes);
    tu_assert_close(t, vals, tol);
}

double tu_max_abs_diff(const ag_tensor *a, const ag_tensor *b) {
    assert_int_equal(ag_tensor_numel(a), ag_tensor_numel(b));
    double m = 0;
    for (int64_t i = 0; i < ag_tensor_numel(a); i++) {
        double d = fabs(ag_tensor_item_at(a, i) - ag_tensor_item_at(b, i));
        if (d > m || isnan(d))
            m = isnan(d) ? INFINITY : d;
    }
    return m;
}

void tu_assert_error_contains(const char *needle) {
    const char *msg = ag_last_error();
    if (!strstr(msg, needle)) {
        print_error("error message '%s' does not contain '%s'\n", msg, needle);
        fail();
    }
}

/* ---- allocation counting and failure injection ---- */

/* The counting allocator's state. count and live are atomic because kernels allocate scratch
 * on their worker threads; the flags are written by the test's thread between parallel
 * regions. */
static struct {
    ag_allocator prev; /* the allocator wrapped while installed */
    bool installed;
    _Atomic int64_t count; /* allocations counted since the last reset */
    _Atomic int64_t live;  /* allocations made through the wrapper and not freed */
    int64_t fail_at;       /* the counted allocation that fails (1-based); 0: none */
    bool persistent;       /* every counted allocation after fail_at fails too */
    _Atomic bool failed, failed_in_cleanup;
    int paused, cleanup;
} ca;

static void *counting_alloc(void *ud, size_t size, size_t align) {
    (void)ud;
    if (!ca.paused) {
        int64_t k = atomic_fetch_add(&ca.count, 1) + 1;
        if (ca.fail_at && (k == ca.fail_at || (ca.persistent && k > ca.fail_at))) {
            atomic_store(&ca.failed, true);
            if (ca.cleanup && k == ca.fail_at)
                atomic_store(&ca.failed_in_cleanup, true);
            return NULL;
        }
    }
    void *p = ca.prev.alloc(ca.prev.ud, size, align);
    if (p)
        atomic_fetch_add(&ca.live, 1);
    return p;
}

static void counting_free(void *ud, void *p) {
    (void)ud;
    if (p)
        atomic_fetch_sub(&ca.live, 1);
    ca.prev.free(ca.prev.ud, p);
}

static void counting_uninstall(void);

static void counting_install(void) {
    counting_uninstall(); /* left installed by a test that failed mid-sweep */
    ca.prev = ag_get_allocator();
    atomic_store(&ca.count, 0);
    atomic_store(&ca.live, 0);
    ca.fail_at = 0;
    ca.persistent = false;
    ca.paused = ca.cleanup = 0;
    ca.installed = true;
    ag_set_allocator(&(ag_allocator){counting_alloc, counting_free, NULL});
}

static void counting_uninstall(void) {
    if (!ca.installed)
        return;
    ag_set_allocator(&ca.prev);
    ca.installed = false;
    ca.fail_at = 0;
}

void tu_alloc_cleanup_begin(void) {
    ca.cleanup++;
}

void tu_alloc_cleanup_end(void) {
    ca.cleanup--;
}

void tu_alloc_pause(void) {
    ca.paused++;
}

void tu_alloc_resume(void) {
    ca.paused--;
}

void tu_alloc_count_begin(void) {
    counting_install();
}

int64_t tu_alloc_count_end(void) {
    counting_uninstall();
    return atomic_load(&ca.count);
}

typedef struct sweep {
    const char *what;
    int threads; /* to restore; 0: unchanged */
} sweep;

static void sweep_end(const sweep *s) {
    counting_uninstall();
    if (s->threads)
        ag_set_num_threads(s->threads);
}

/* Stops the sweep (allocator and thread count restored) and fails the test. */
#define SWEEP_FAIL(s, ...)                                                                         \
    do {                                                                                           \
        sweep_end(s);                                                                              \
        print_error("%s: ", (s)->what);                                                            \
        print_error(__VA_ARGS__);                                                                  \
        print_error("\n");                                                                         \
        fail();                                                                                    \
    } while (0)

int64_t tu_alloc_failure_sweep(int (*scenario)(void *ud), void *ud, const tu_sweep_opts *opts) {
    tu_sweep_opts o = opts ? *opts : (tu_sweep_opts){0};
    sweep s = {o.what ? o.what : "allocation failure sweep", 0};
    int64_t max_points = o.max_points > 0 ? o.max_points : 100000;
    if (o.one_thread) {
        s.threads = ag_get_num_threads();
        ag_set_num_threads(1);
    }
    counting_install();
    ag_clear_error();
    int rc = scenario(ud);
    if (rc != 0)
        SWEEP_FAIL(&s, "the clean run failed: status %d (%s)", rc, ag_last_error());
    if (o.clean_run_frees_all && atomic_load(&ca.live) != 0)
        SWEEP_FAIL(&s, "the clean run leaked %lld allocations", (long long)atomic_load(&ca.live));
    int64_t base = atomic_load(&ca.live), n, points = 0;
    for (n = 1;; n += o.every_up_to > 0 && n >= o.every_up_to && o.stride > 1 ? o.stride : 1) {
        if (n > max_points)
            SWEEP_FAIL(&s, "more than %lld allocation points", (long long)max_points);
        atomic_store(&ca.count, 0);
        atomic_store(&ca.failed, false);
        atomic_store(&ca.failed_in_cleanup, false);
        ca.fail_at = n;
        ca.persistent = o.persistent;
        ag_clear_error();
        rc = scenario(ud);
        int status = ag_last_status();
        bool failed = atomic_load(&ca.failed), in_cleanup = atomic_load(&ca.failed_in_cleanup);
        ca.fail_at = 0;
        ca.persistent = false;
        if (failed && !in_cleanup) {
            if (rc == 0)
                SWEEP_FAIL(&s, "allocation %lld failed but the scenario reported success",
                           (long long)n);
            if (rc != AG_ENOMEM || status != AG_ENOMEM || !ag_last_error()[0])
                SWEEP_FAIL(&s, "allocation %lld failed: returned %d, status %d (message '%s')",
                           (long long)n, rc, status, ag_last_error());
        } else if (!failed && rc != 0) {
            SWEEP_FAIL(&s, "run %lld reached no failure but returned %d (%s)", (long long)n, rc,
                       ag_last_error());
        }
        int64_t live = atomic_load(&ca.live);
        if (live != base)
            SWEEP_FAIL(&s, "%s allocation %lld: %lld allocations leaked (status %d: %s)",
                       failed ? "failing" : "run that reached no", (long long)n,
                       (long long)(live - base), rc, ag_last_error());
        if (!failed)
            break;
        points++;
    }
    sweep_end(&s);
    if (o.allocations)
        *o.allocations = n - 1;
    return points;
}

/* ---- gradcheck of an op's declared samples ---- */

typedef struct sample_call {
    const ag_op *op;
    const ag__sample *s;
} sample_call;

/* Calls the op on the sample's arguments; the gradcheck inputs are the sample's own tensors
 * (perturbed in place by gradcheck), so the arguments can be passed as they are. */
static int call_sample(void *ud, ag_tensor *const *in, int n, ag_tensor **outs, int *nouts) {
    (void)in;
    (void)n;
    const sample_call *c = ud;
    const ag_opdef *def = ag_op_def(c->op);
    ag_tensor *tmp[AG_MAX_OUTPUTS] = {0};
    ag_arg args[AG_MAX_ARGS];
    memcpy(args, c->s->args, sizeof(ag_arg) * (size_t)c->s->nargs);
    if (def->flags & AG_OP_INPLACE)
        args[0].u.t = ag_clone(args[0].u.t);
    int rc = ag_op_call(c->op, args, c->s->nargs, tmp);
    if (rc < 0)
        return rc;
    int cnt = ag_op_noutputs(c->op) < 0 ? rc : ag_op_noutputs(c->op);
    *nouts = 0;
    for (int k = 0; k < cnt && k < AG_GRADCHECK_MAX_OUT; k++)
        outs[(*nouts)++] = ((def->nondiff_outputs >> k) & 1) ? NULL : tmp[k];
    return 0;
}

int tu_gradcheck_samples(const ag_op *op, int *ncases) {
    ag__sample *items;
    int n, failures = 0;
    assert_int_equal(ag__samples_collect(op, &items, &n), 0);
    for (int c = 0; c < n; c++) {
        ag_tensor *inputs[64];
        int ni = 0;
        for (int a = 0; a < items[c].nargs; a++) {
            const ag_arg *arg = &items[c].args[a];
            if (arg->kind == AG_ARG_TENSOR && arg->u.t) {
                assert_true(ni < 64);
                inputs[ni++] = arg->u.t;
            } else if (arg->kind == AG_ARG_TENSORS) {
                for (int k = 0; k < arg->n; k++)
                    if (arg->u.ts[k]) {
                        assert_true(ni < 64);
                        inputs[ni++] = arg->u.ts[k];
                    }
            }
        }
        sample_call call = {op, &items[c]};
        ag_manual_seed(42);
        ag_clear_error();
        if (ag_gradcheck(call_sample, &call, inputs, ni, NULL)) {
            print_error("%s [%s]: %s\n", ag_op_name(op), items[c].note, ag_last_error());
            failures++;
        }
    }
    ag__samples_free(items, n);
    if (ncases)
        *ncases = n;
    return failures;
}

int tu_gradcheck_op(const char *name) {
    const ag_op *op = ag_op_find(name);
    if (!op) {
        print_error("%s: no such op\n", name);
        fail();
    }
    int n;
    int failures = tu_gradcheck_samples(op, &n);
    if (n == 0)
        print_error("%s: no gradcheck sample\n", name);
    assert_true(n > 0);
    assert_int_equal(failures, 0);
    return n;
}

int tu_gradcheck_ops(const char *const *names, size_t n) {
    int fewest = INT_MAX;
    for (size_t i = 0; i < n; i++) {
        int k = tu_gradcheck_op(names[i]);
        fewest = k < fewest ? k : fewest;
    }
    return fewest;
}

/* ---- building graphs by hand ---- */

ag_tmeta tu_tmeta(ag_dtype dt, int ndim, const int64_t *sizes) {
    ag_tmeta m;
    memset(&m, 0, sizeof m);
    m.dtype = dt;
    m.ndim = ndim;
    int64_t st = 1;
    for (int d = ndim - 1; d >= 0; d--) {
        m.sizes[d] = sizes[d];
        m.strides[d] = st;
        st *= sizes[d];
    }
    return m;
}

ag_node *tu_ph(ag_graph *g, const char *name, ag_tmeta m) {
    ag_node *n = ag_graph_placeholder(g, name, &m);
    assert_non_null(n);
    return n;
}

const ag_op *tu_op(const char *name) {
    const ag_op *o = ag_op_find(name);
    if (!o)
        fail_msg("no op %s", name);
    return o;
}

ag_node *tu_call(ag_graph *g, const char *op, const ag_garg *a, int n, const char *name) {
    ag_node *r = ag_graph_call(g, tu_op(op), a, n, name);
    if (!r)
        fail_msg("%s: %s", op, ag_last_error());
    return r;
}

/* ---- running the aotgrad CLI ---- */

static char cli_path[4200], cli_dir[64];

bool tu_cli_setup(const char *tmp_template) {
    char self[4096];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0)
        return false;
    self[n] = 0;
    *strrchr(self, '/') = 0;
    snprintf(cli_path, sizeof cli_path, "%s/aotgrad", self);
    if (access(cli_path, X_OK)) {
        print_message("no %s: CLI checks skipped\n", cli_path);
        return false;
    }
    snprintf(cli_dir, sizeof cli_dir, "%s", tmp_template);
    assert_non_null(mkdtemp(cli_dir));
    return true;
}

const char *tu_cli_dir(void) {
    return cli_dir;
}

int tu_cli_run(const char *args) {
    char cmd[8192];
    snprintf(cmd, sizeof cmd, "'%s' %s >'%s/out' 2>'%s/err'", cli_path, args, cli_dir, cli_dir);
    int rc = system(cmd);
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

char *tu_cli_read(const char *name) {
    char path[128];
    snprintf(path, sizeof path, "%s/%s", cli_dir, name);
    return tu_read_file(path);
}

char *tu_read_file(const char *path) {
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *s = malloc((size_t)n + 1);
    assert_non_null(s);
    assert_int_equal(fread(s, 1, (size_t)n, f), (size_t)n);
    s[n] = 0;
    fclose(f);
    return s;
}

static void cli_contains(const char *name, const char *needle, bool want) {
    char *s = tu_cli_read(name);
    if (!strstr(s, needle) == want)
        fail_msg("%s %s '%s':\n%s", name, want ? "has no" : "has", needle, s);
    free(s);
}

void tu_cli_has(const char *name, const char *needle) {
    cli_contains(name, needle, true);
}

void tu_cli_lacks(const char *name, const char *needle) {
    cli_contains(name, needle, false);
}

void tu_cli_write(const char *name, const char *text) {
    char path[128];
    snprintf(path, sizeof path, "%s/%s", cli_dir, name);
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

void tu_cli_cleanup(const char *const *names, int n) {
    for (int i = 0; i < n; i++) {
        char path[128];
        snprintf(path, sizeof path, "%s/%s", cli_dir, names[i]);
        remove(path);
    }
    rmdir(cli_dir);
}

/* ---- RNG functionalization ---- */

ag_tensor *tu_philox_input(const ag_node *placeholder, uint64_t seed, uint64_t offset) {
    const ag_desc *d = ag_node_desc(placeholder);
    ag_desc_kind k = d ? ag_desc_kind_of(d) : AG_DESC_PLAIN_INPUT;
    int64_t v;
    if (k == AG_DESC_PHILOX_FORWARD_SEED || k == AG_DESC_PHILOX_BACKWARD_SEED)
        v = (int64_t)seed;
    else if (k == AG_DESC_PHILOX_FORWARD_BASE_OFFSET || k == AG_DESC_PHILOX_BACKWARD_BASE_OFFSET)
        v = (int64_t)offset;
    else
        return NULL;
    ag_scope_begin();
    ag_tensor *t = ag_tensor_keep(ag_from_data(AG_I64, 0, NULL, &v));
    ag_scope_end();
    return t;
}

bool tu_same_bits(ag_tensor *a, ag_tensor *b) {
    if (!a || !b)
        return a == b;
    ag_tensor *fa[16], *fb[16];
    int na = ag_subclass_flatten_tensors(&a, 1, fa, 16);
    int nb = ag_subclass_flatten_tensors(&b, 1, fb, 16);
    if (na != nb || na <= 0 || na > 16)
        return false;
    for (int k = 0; k < na; k++) {
        const ag_tensor *x = fa[k], *y = fb[k];
        int nd = ag_tensor_ndim(x);
        if (ag_tensor_dtype(x) != ag_tensor_dtype(y) || nd != ag_tensor_ndim(y) ||
            memcmp(ag_tensor_sizes(x), ag_tensor_sizes(y), sizeof(int64_t) * (size_t)nd))
            return false;
        for (int64_t i = 0; i < ag_tensor_numel(x); i++) {
            double u = ag_tensor_item_at(x, i), v = ag_tensor_item_at(y, i);
            if (memcmp(&u, &v, sizeof u) && !(isnan(u) && isnan(v)))
                return false;
        }
    }
    return true;
}

/* ---- descriptor lists ---- */

static const char *desc_or_none(const ag_desc *d, char *b, size_t n) {
    if (!d)
        snprintf(b, n, "None");
    else
        ag_desc_repr(d, b, n);
    return b;
}

const char *tu_placeholders_str(const ag_graph *g) {
    static char out[8192];
    size_t k = 0;
    ag_node **ph;
    int n = ag_graph_placeholders(g, &ph);
    out[0] = 0;
    for (int i = 0; i < n && k < sizeof out; i++) {
        char b[256];
        k += (size_t)snprintf(out + k, sizeof out - k, "%s: %s\n", ag_node_name(ph[i]),
                              desc_or_none(ag_node_desc(ph[i]), b, sizeof b));
    }
    return out;
}

const char *tu_outputs_str(const ag_graph *g) {
    static char out[8192];
    size_t k = 0;
    const ag_node *o = ag_graph_output_node(g);
    int n = o ? ag_node_arg(o, 0)->n : 0;
    out[0] = 0;
    for (int i = 0; i < n && k < sizeof out; i++) {
        char b[256];
        k += (size_t)snprintf(out + k, sizeof out - k, "%s%s", i ? ", " : "",
                              desc_or_none(ag_node_output_desc(o, i), b, sizeof b));
    }
    return out;
}

/* ---- an op whose backward draws random numbers ---- */

static int noisy_meta(const ag_arg *a, ag_tmeta *o) {
    const ag_tensor *x = a[0].u.t;
    *o = tu_tmeta(ag_tensor_dtype(x), ag_tensor_ndim(x), ag_tensor_sizes(x));
    return 0;
}

static int noisy_kernel(const ag_arg *a, ag_tensor **o) {
    float *d = ag_tensor_data(o[0]);
    for (int64_t i = 0; i < ag_tensor_numel(o[0]); i++)
        d[i] = (float)(2.0 * ag_tensor_item_at(a[0].u.t, i));
    return 0;
}

static int noisy_backward(ag_bwctx *c) {
    const ag_tmeta *m = &c->input_meta[0];
    ag_tensor *u = ag_rand(m->dtype, m->ndim, m->sizes);
    c->grad_inputs[0] = ag_mul(c->grad_outputs[0], ag_mul_scalar(ag_add_scalar(u, 1.0), 2.0));
    return c->grad_inputs[0] ? 0 : ag_last_status();
}

static const ag_opdef noisy_def = {
    .schema = "testutil::noisy(Tensor x) -> Tensor",
    .meta = noisy_meta,
    .kernel = noisy_kernel,
    .dtypes = 1u << AG_F32,
    .backward = noisy_backward,
};

const ag_op *tu_noisy_op(void) {
    const ag_op *op = ag_op_find("testutil::noisy");
    return op ? op : ag_op_register(&noisy_def);
}

/* ---- tu_sum_loss_step ---- */

static int sum_loss_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out,
                            int max_out) {
    ag_module *model = ag_module_ud(m);
    ag_tensor *o[16] = {0}, *loss = NULL;
    (void)max_out;
    ag_scope_begin();
    int n = ag_module_call(model, in, nin, o, 16);
    for (int k = 0; k < n; k++) {
        if (!o[k] || !ag_dtype_is_float(ag_tensor_dtype(o[k])))
            continue;
        ag_tensor *s = ag_sum_all(ag_mul_scalar(o[k], 0.5 + 0.25 * k));
        loss = loss ? ag_add(loss, s) : s;
    }
    out[0] = ag_tensor_keep(loss);
    ag_scope_end();
    return out[0] ? 1 : ag_last_status();
}

ag_module *tu_sum_loss_step(ag_module *model) {
    ag_module *step = ag_module_new("TrainStep", sum_loss_forward, model, NULL);
    if (!step) {
        ag_module_free(model);
        return NULL;
    }
    if (ag_module_add_child(step, "model", model)) { /* frees model on failure */
        ag_module_free(step);
        return NULL;
    }
    return step;
}

/* ---- descriptor lists ---- */

const char *tu_desc_repr(const ag_desc *d) {
    static char buf[8][512];
    static int k;
    k = (k + 1) % 8;
    ag_desc_repr(d, buf[k], sizeof buf[k]);
    return buf[k];
}

void tu_expect_placeholder_descs(const ag_graph *g, const char *const *descs, int n) {
    ag_node **ph;
    int cnt = ag_graph_placeholders(g, &ph);
    for (int i = 0; i < n && i < cnt; i++)
        if (strcmp(tu_desc_repr(ag_node_desc(ph[i])), descs[i]))
            fail_msg("placeholder %d (%s): %s, expected %s", i, ag_node_name(ph[i]),
                     tu_desc_repr(ag_node_desc(ph[i])), descs[i]);
    assert_int_equal(cnt, n);
}

void tu_expect_output_descs(const ag_graph *g, const char *const *descs, int n) {
    ag_node *out = ag_graph_output_node(g);
    assert_non_null(out);
    const ag_garg *a = ag_node_arg(out, 0);
    for (int i = 0; i < n && i < a->n; i++)
        if (strcmp(tu_desc_repr(ag_node_output_desc(out, i)), descs[i]))
            fail_msg("output %d: %s, expected %s", i, tu_desc_repr(ag_node_output_desc(out, i)),
                     descs[i]);
    assert_int_equal(a->n, n);
}
