/* Tests of tracing on the model zoo (src/models/zoo.c, src/trace/trace.c): every zoo model's
 * traced graph, run by the interpreter, gives the eager outputs (and, for BatchNorm in
 * training, the same in-place updates of the running statistics); the structure of the
 * `linear`, `multi_output` and `convbn` graphs (placeholders, descriptors, ops, wiring) as
 * written by hand from PyTorch's conventions; stack traces pointing at zoo.c lines found by
 * their TRACE-MARK comments, with module internals as inner frames; nested annotations;
 * every op entry point having its call-site macro; GPT-2 small traced in meta mode without
 * allocating its weights; clear errors for data-dependent code under tracing; and the CLI
 * (`aotgrad models`, `trace`, `show`: output, round trip, exit statuses, FILE:LINE:COL). */
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- helpers ---- */

/* The source tree: this file is <root>/tests/test_trace.c (CMake passes absolute paths);
 * when __FILE__ is relative, CTest's working directory (the source dir) is the root. */
static const char *src_root(void) {
    static char root[4096];
    if (!root[0]) {
        snprintf(root, sizeof root, "%s", __FILE__);
        char *p = strstr(root, "tests/test_trace.c");
        if (p && (p == root || p[-1] == '/'))
            *p = 0;
        else
            root[0] = 0;
        if (!root[0])
            snprintf(root, sizeof root, "./");
    }
    return root;
}

/* The contents of <root>/rel, NUL-terminated (caller frees), or a failed test. */
static char *slurp(const char *rel) {
    char path[4200];
    snprintf(path, sizeof path, "%s%s", src_root(), rel);
    FILE *f = fopen(path, "rb");
    if (!f)
        fail_msg("cannot open %s", path);
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

/* The 1-based line of src/models/zoo.c that carries the comment "TRACE-MARK: <mark> ".
 * Exactly one line must. */
static int mark_line(const char *mark) {
    char *text = slurp("src/models/zoo.c");
    char needle[128];
    snprintf(needle, sizeof needle, "TRACE-MARK: %s ", mark);
    int line = 1, found = 0, count = 0;
    for (char *p = text; *p; p++) {
        if (*p == '\n')
            line++;
        else if (!strncmp(p, needle, strlen(needle)))
            found = line, count++;
    }
    free(text);
    if (count != 1)
        fail_msg("TRACE-MARK: %s appears %d times in zoo.c", mark, count);
    return found;
}

/* The op's name without its overload ("add" for add.Tensor). */
static bool op_is(const ag_node *n, const char *base) {
    if (ag_node_kind_of(n) != AG_NODE_CALL)
        return false;
    const char *name = ag_op_name(ag_node_op(n));
    size_t k = strlen(base);
    return !strncmp(name, base, k) && (name[k] == 0 || name[k] == '.');
}

static int count_op(const ag_graph *g, const char *base) {
    int c = 0;
    for (ag_node *n = ag_graph_first(g); n; n = ag_node_next(n))
        c += op_is(n, base);
    return c;
}

static ag_node *first_op(const ag_graph *g, const char *base) {
    for (ag_node *n = ag_graph_first(g); n; n = ag_node_next(n))
        if (op_is(n, base))
            return n;
    fail_msg("no %s node in the graph", base);
    return NULL;
}

static void assert_desc(const ag_desc *d, const char *want) {
    char buf[256];
    ag_desc_repr(d, buf, sizeof buf);
    assert_string_equal(buf, want);
}

static void assert_val(const ag_node *n, ag_dtype dt, int ndim, const int64_t *sizes) {
    const ag_tmeta *m = ag_node_val(n, 0);
    assert_non_null(m);
    assert_int_equal(m->dtype, dt);
    assert_int_equal(m->ndim, ndim);
    for (int i = 0; i < ndim; i++)
        assert_int_equal(m->sizes[i], sizes[i]);
}

static ag_graph *trace_or_fail(ag_module *m, ag_tensor **in, int nin) {
    ag_graph *g = ag_trace_module(m, in, nin, NULL);
    if (!g)
        fail_msg("trace failed: %s", ag_last_error());
    return g;
}

/* A zoo model and its inputs. */
typedef struct built {
    ag_module *m;
    ag_tensor *in[4];
    int nin;
} built;

static built build(const char *name, const char *config, bool meta) {
    built b = {0};
    bool prev = ag_set_meta_mode(meta);
    int rc = ag_zoo_build(name, config, &b.m, b.in, 4, &b.nin);
    ag_set_meta_mode(prev);
    if (rc)
        fail_msg("zoo build %s: %s", name, ag_last_error());
    return b;
}

static void built_free(built *b) {
    for (int i = 0; i < b->nin; i++)
        ag_tensor_free(b->in[i]);
    ag_module_free(b->m);
}

/* Asserts a and b have the same dtype and shape and values within rel * |b| (floats; exact
 * for integers and bools). */
static void assert_same(const char *what, const ag_tensor *a, const ag_tensor *b, double rel) {
    char s1[128], s2[128];
    ag_tensor_meta_str(a, s1, sizeof s1);
    ag_tensor_meta_str(b, s2, sizeof s2);
    if (strcmp(s1, s2))
        fail_msg("%s: %s vs %s", what, s1, s2);
    int64_t n = ag_tensor_numel(a);
    double *x = malloc(sizeof(double) * (size_t)(n + 1)),
           *y = malloc(sizeof(double) * (size_t)(n + 1));
    assert_int_equal(ag_tensor_to_doubles(a, x), 0);
    assert_int_equal(ag_tensor_to_doubles(b, y), 0);
    bool is_float = ag_dtype_is_float(ag_tensor_dtype(a));
    for (int64_t i = 0; i < n; i++) {
        double tol = is_float ? rel * fmax(fabs(y[i]), 1e-3) : 0;
        if (!(fabs(x[i] - y[i]) <= tol))
            fail_msg("%s: element %lld: graph %.9g, eager %.9g", what, (long long)i, x[i], y[i]);
    }
    free(x);
    free(y);
}

/* ---- the zoo itself ---- */

static void test_zoo_registry(void **state) {
    (void)state;
    static const char *const want[] = {"linear",   "multi_output", "kwargs",      "convbn",
                                       "grad_acc", "mlp",          "cnn",         "gpt2",
                                       "effects",  "alias_views",  "dropout_mlp", "two_tensor"};
    enum { NWANT = (int)(sizeof want / sizeof want[0]) };
    assert_int_equal(ag_zoo_count(), NWANT);
    for (int i = 0; i < NWANT; i++) {
        assert_string_equal(ag_zoo_name(i), want[i]);
        assert_true(strlen(ag_zoo_description(i)) > 10);
    }
    assert_null(ag_zoo_name(NWANT));
    assert_null(ag_zoo_description(-1));
    assert_string_equal(ag_zoo_configs(7), "tiny, gpt2-small, gpt2-xl");
    assert_string_equal(ag_zoo_configs(0), "default");

    ag_module *m = (ag_module *)1;
    ag_tensor *in[4];
    int n = -1;
    assert_int_equal(ag_zoo_build("resnet", NULL, &m, in, 4, &n), AG_EINVAL);
    assert_null(m);
    assert_int_equal(n, 0);
    tu_assert_error_contains("unknown model 'resnet'");
    char names[512];
    size_t len = 0;
    for (int i = 0; i < NWANT; i++)
        len += (size_t)snprintf(names + len, sizeof names - len, "%s%s", i ? ", " : "", want[i]);
    tu_assert_error_contains(names);
    assert_int_equal(ag_zoo_build("gpt2", "gpt2-medium", &m, in, 4, &n), AG_EINVAL);
    tu_assert_error_contains("no configuration 'gpt2-medium'");
    tu_assert_error_contains("tiny, gpt2-small, gpt2-xl");
    assert_int_equal(ag_zoo_build("mlp", "big", &m, in, 4, &n), AG_EINVAL);
    tu_assert_error_contains("'mlp' has no configuration 'big'");
    assert_int_equal(ag_zoo_build("kwargs", NULL, &m, in, 1, &n), AG_EINVAL);
    tu_assert_error_contains("'kwargs' takes 2 inputs, room for 1");
    assert_null(m);
    assert_int_equal(ag_zoo_build("linear", NULL, &m, in, 1, &n), 0);
    assert_int_equal(n, 1);
    ag_tensor_free(in[0]);
    ag_module_free(m);
}

/* Two builds give the same weights and inputs (the generator is reseeded), and the inputs
 * are the caller's even inside a scope. */
static void test_zoo_deterministic(void **state) {
    (void)state;
    built a = build("mlp", NULL, false);
    ag_scope_begin();
    built b = build("mlp", NULL, false);
    ag_scope_end(); /* must not release b's inputs */
    assert_int_equal(a.nin, 1);
    assert_same("input", b.in[0], a.in[0], 0);
    int64_t want_x[] = {32, 784};
    tu_assert_shape(a.in[0], 2, want_x);
    ag_named_tensors pa, pb;
    assert_int_equal(ag_module_named_parameters(a.m, false, &pa), 0);
    assert_int_equal(ag_module_named_parameters(b.m, false, &pb), 0);
    assert_int_equal(pa.n, 6);
    for (int i = 0; i < pa.n; i++) {
        assert_string_equal(pa.names[i], pb.names[i]);
        assert_same(pa.names[i], pb.tensors[i], pa.tensors[i], 0);
    }
    assert_string_equal(pa.names[0], "fc1.weight");
    /* 784*256+256 + 256*128+128 + 128*10+10 */
    assert_int_equal(ag_module_num_parameters(a.m), 235146);
    ag_named_tensors_free(&pa);
    ag_named_tensors_free(&pb);
    built_free(&a);
    built_free(&b);

    /* Tokens are in range and not all equal. */
    built g = build("gpt2", NULL, false);
    assert_int_equal(ag_tensor_dtype(g.in[0]), AG_I64);
    int64_t want_idx[] = {2, 16};
    tu_assert_shape(g.in[0], 2, want_idx);
    double v[32];
    assert_int_equal(ag_tensor_to_doubles(g.in[0], v), 0);
    int distinct = 0;
    for (int i = 0; i < 32; i++) {
        assert_true(v[i] >= 0 && v[i] < 256);
        distinct += v[i] != v[0];
    }
    assert_true(distinct > 0);
    built_free(&g);
}

/* Meta mode: parameters and inputs have shapes and no data. */
static void test_zoo_meta_build(void **state) {
    (void)state;
    built b = build("cnn", NULL, true);
    ag_tensor *w = ag_module_param(b.m, "conv1.weight");
    assert_non_null(w);
    assert_true(ag_is_meta(w));
    assert_null(ag_tensor_data(w));
    assert_true(ag_is_meta(ag_module_buffer(b.m, "bn2.running_var")));
    assert_true(ag_is_meta(b.in[0]));
    int64_t want_w[] = {32, 1, 3, 3}, want_x[] = {8, 1, 28, 28};
    tu_assert_shape(w, 4, want_w);
    tu_assert_shape(b.in[0], 4, want_x);
    built_free(&b);
    /* And meta mode is off again: a normal build has data. */
    built c = build("linear", NULL, false);
    assert_false(ag_is_meta(ag_module_param(c.m, "linear.weight")));
    built_free(&c);
}

/* ---- traced graph == eager, for every zoo model ---- */

/* Whether a model's parameters, buffers or inputs include tensor subclass instances, which
 * ag_trace refuses (they are exported flattened: tests/test_subclass.c). */
static bool uses_subclasses(const built *b) {
    ag_named_tensors ps, bs;
    assert_int_equal(ag_module_named_parameters(b->m, false, &ps), 0);
    assert_int_equal(ag_module_named_buffers(b->m, false, &bs), 0);
    bool any = false;
    for (int i = 0; i < ps.n; i++)
        any |= ag_tensor_subclass(ps.tensors[i]) != NULL;
    for (int i = 0; i < bs.n; i++)
        any |= ag_tensor_subclass(bs.tensors[i]) != NULL;
    for (int i = 0; i < b->nin; i++)
        any |= ag_tensor_subclass(b->in[i]) != NULL;
    ag_named_tensors_free(&ps);
    ag_named_tensors_free(&bs);
    return any;
}

static void check_against_eager(const char *name) {
    /* Eager. */
    built e = build(name, NULL, false);
    if (uses_subclasses(&e)) {
        built_free(&e);
        return;
    }
    ag_tensor *eo[8] = {0};
    int neo = ag_module_call(e.m, e.in, e.nin, eo, 8);
    if (neo <= 0)
        fail_msg("%s: eager call failed: %s", name, ag_last_error());

    /* Traced from an identical build; tracing leaves the module's tensors alone. */
    built t = build(name, NULL, false);
    ag_graph *g = trace_or_fail(t.m, t.in, t.nin);
    if (ag_graph_verify(g))
        fail_msg("%s: graph does not verify: %s", name, ag_last_error());
    ag_named_tensors ps, bs, ebs;
    assert_int_equal(ag_module_named_parameters(t.m, false, &ps), 0);
    assert_int_equal(ag_module_named_buffers(t.m, false, &bs), 0);
    assert_int_equal(ag_module_named_buffers(e.m, false, &ebs), 0);
    int total = ps.n + bs.n + t.nin;
    ag_node **ph;
    assert_int_equal(ag_graph_placeholders(g, &ph), total);
    ag_tensor **all = calloc((size_t)total, sizeof *all);
    for (int i = 0; i < ps.n; i++)
        all[i] = ps.tensors[i];
    for (int i = 0; i < bs.n; i++)
        all[ps.n + i] = bs.tensors[i];
    for (int i = 0; i < t.nin; i++)
        all[ps.n + bs.n + i] = t.in[i];
    ag_tensor *go[8] = {0};
    int ngo = ag_graph_run(g, all, total, go, 8);
    if (ngo < 0)
        fail_msg("%s: graph run failed: %s", name, ag_last_error());
    assert_int_equal(ngo, neo);
    for (int i = 0; i < neo; i++) {
        char what[64];
        snprintf(what, sizeof what, "%s output %d", name, i);
        assert_same(what, go[i], eo[i], 1e-5);
    }
    /* Buffers: running statistics updated in place by both runs, identically. */
    assert_int_equal(bs.n, ebs.n);
    for (int i = 0; i < bs.n; i++) {
        char what[160];
        snprintf(what, sizeof what, "%s buffer %s", name, bs.names[i]);
        assert_string_equal(bs.names[i], ebs.names[i]);
        assert_same(what, bs.tensors[i], ebs.tensors[i], 1e-5);
    }
    for (int i = 0; i < 8; i++) {
        ag_tensor_free(eo[i]);
        ag_tensor_free(go[i]);
    }
    free(all);
    ag_named_tensors_free(&ps);
    ag_named_tensors_free(&bs);
    ag_named_tensors_free(&ebs);
    ag_graph_free(g);
    built_free(&e);
    built_free(&t);
}

static void test_zoo_graph_equals_eager(void **state) {
    (void)state;
    for (int i = 0; i < ag_zoo_count(); i++)
        check_against_eager(ag_zoo_name(i));
}

/* convbn in training: the graph mutates the buffers it is given, as eager BatchNorm does. The
 * values are checked against the definition: num_batches_tracked 0 -> 1, running_mean
 * 0 -> 0.1 * batch mean per channel. */
static void test_convbn_buffers_mutated(void **state) {
    (void)state;
    built t = build("convbn", NULL, false);
    ag_graph *g = trace_or_fail(t.m, t.in, t.nin);
    /* The in-place ops, wired to the buffer placeholders. */
    ag_node **ph;
    assert_int_equal(ag_graph_placeholders(g, &ph), 8);
    assert_desc(ag_node_desc(ph[4]), "BufferAOTInput(target='bn.running_mean')");
    assert_desc(ag_node_desc(ph[5]), "BufferAOTInput(target='bn.running_var')");
    assert_desc(ag_node_desc(ph[6]), "BufferAOTInput(target='bn.num_batches_tracked')");
    assert_desc(ag_node_desc(ph[7]), "PlainAOTInput(idx=0)");
    ag_node *add_ = first_op(g, "add_");
    assert_ptr_equal(ag_node_arg_node(add_, 0), ph[6]);
    ag_node *bn = first_op(g, "native_batch_norm");
    assert_ptr_equal(ag_node_arg_node(bn, 3), ph[4]);
    assert_ptr_equal(ag_node_arg_node(bn, 4), ph[5]);
    assert_true(ag_node_arg(bn, 5)->kind == AG_GA_BOOL && ag_node_arg(bn, 5)->u.b); /* training */
    assert_ptr_equal(ag_node_arg_node(bn, 0), first_op(g, "convolution"));
    ag_node *relu = first_op(g, "relu");
    assert_int_equal(ag_node_kind_of(ag_node_arg_node(relu, 0)), AG_NODE_GETITEM);
    assert_ptr_equal(ag_node_arg_node(ag_node_arg_node(relu, 0), 0), bn);
    /* Tracing changed nothing. */
    ag_tensor *nbt = ag_module_buffer(t.m, "bn.num_batches_tracked");
    ag_tensor *rm = ag_module_buffer(t.m, "bn.running_mean");
    assert_int_equal((int)ag_tensor_item(nbt), 0);
    double v[3];
    assert_int_equal(ag_tensor_to_doubles(rm, v), 0);
    assert_true(v[0] == 0 && v[1] == 0 && v[2] == 0);

    ag_named_tensors ps, bs;
    assert_int_equal(ag_module_named_parameters(t.m, false, &ps), 0);
    assert_int_equal(ag_module_named_buffers(t.m, false, &bs), 0);
    ag_tensor *all[8] = {ps.tensors[0], ps.tensors[1], ps.tensors[2], ps.tensors[3],
                         bs.tensors[0], bs.tensors[1], bs.tensors[2], t.in[0]};
    ag_tensor *out[2] = {0};
    assert_int_equal(ag_graph_run(g, all, 8, out, 2), 1);
    assert_int_equal((int)ag_tensor_item(nbt), 1);
    /* The conv output's per-channel batch mean, computed here from the conv's definition. */
    double x[32], w[27], b[3];
    assert_int_equal(ag_tensor_to_doubles(t.in[0], x), 0);
    assert_int_equal(ag_tensor_to_doubles(ps.tensors[0], w), 0);
    assert_int_equal(ag_tensor_to_doubles(ps.tensors[1], b), 0);
    assert_int_equal(ag_tensor_to_doubles(rm, v), 0);
    for (int c = 0; c < 3; c++) {
        double sum = 0;
        for (int n = 0; n < 2; n++)
            for (int i = 0; i < 4; i++)
                for (int j = 0; j < 4; j++) {
                    double acc = b[c];
                    for (int di = 0; di < 3; di++)
                        for (int dj = 0; dj < 3; dj++) {
                            int ii = i + di - 1, jj = j + dj - 1;
                            if (ii >= 0 && ii < 4 && jj >= 0 && jj < 4)
                                acc += w[c * 9 + di * 3 + dj] * x[n * 16 + ii * 4 + jj];
                        }
                    sum += acc;
                }
        double want = 0.1 * sum / 32;
        assert_true(fabs(v[c] - want) <= 1e-5 * (1 + fabs(want)));
        assert_true(fabs(want) > 1e-6); /* a real update, not zeros left alone */
    }
    /* The output is relu'd: non-negative, and some zeros. */
    double y[96];
    assert_int_equal(ag_tensor_to_doubles(out[0], y), 0);
    int zeros = 0;
    for (int i = 0; i < 96; i++) {
        assert_true(y[i] >= 0);
        zeros += y[i] == 0;
    }
    assert_true(zeros > 0 && zeros < 96);
    ag_tensor_free(out[0]);
    ag_named_tensors_free(&ps);
    ag_named_tensors_free(&bs);
    ag_graph_free(g);
    built_free(&t);
}

/* ---- structure ---- */

static void test_linear_structure(void **state) {
    (void)state;
    built b = build("linear", NULL, true);
    ag_graph *g = trace_or_fail(b.m, b.in, b.nin);
    assert_int_equal(ag_graph_num_nodes(g), 6);
    ag_node **ph;
    assert_int_equal(ag_graph_placeholders(g, &ph), 3);
    const char *names[] = {"primals_1", "primals_2", "primals_3"};
    const char *descs[] = {"ParamAOTInput(target='linear.weight')",
                           "ParamAOTInput(target='linear.bias')", "PlainAOTInput(idx=0)"};
    for (int i = 0; i < 3; i++) {
        assert_int_equal(ag_node_kind_of(ph[i]), AG_NODE_PLACEHOLDER);
        assert_string_equal(ag_node_name(ph[i]), names[i]);
        assert_desc(ag_node_desc(ph[i]), descs[i]);
    }
    assert_val(ph[0], AG_F32, 2, (int64_t[]){2, 3});
    assert_val(ph[1], AG_F32, 1, (int64_t[]){2});
    assert_val(ph[2], AG_F32, 2, (int64_t[]){4, 3});
    /* linear on a 2-d input with bias: t(weight), then addmm(bias, x, t). */
    ag_node *t = ag_node_next(ph[2]);
    assert_true(op_is(t, "t"));
    assert_string_equal(ag_node_name(t), "t");
    assert_ptr_equal(ag_node_arg_node(t, 0), ph[0]);
    assert_val(t, AG_F32, 2, (int64_t[]){3, 2});
    ag_node *mm = ag_node_next(t);
    assert_true(op_is(mm, "addmm"));
    assert_string_equal(ag_node_name(mm), "addmm");
    assert_ptr_equal(ag_node_arg_node(mm, 0), ph[1]);
    assert_ptr_equal(ag_node_arg_node(mm, 1), ph[2]);
    assert_ptr_equal(ag_node_arg_node(mm, 2), t);
    assert_val(mm, AG_F32, 2, (int64_t[]){4, 2});
    ag_node *out = ag_node_next(mm);
    assert_ptr_equal(out, ag_graph_output_node(g));
    const ag_garg *oa = ag_node_arg(out, 0);
    assert_int_equal(oa->kind, AG_GA_NODES);
    assert_int_equal(oa->n, 1);
    assert_ptr_equal(oa->u.nodes[0], mm);
    assert_true(ag_node_has_output_descs(out));
    assert_desc(ag_node_output_desc(out, 0), "PlainAOTOutput(idx=0)");
    ag_graph_free(g);
    built_free(&b);
}

static void test_multi_output_and_kwargs_structure(void **state) {
    (void)state;
    built b = build("multi_output", NULL, true);
    ag_graph *g = trace_or_fail(b.m, b.in, b.nin);
    ag_node **ph;
    assert_int_equal(ag_graph_placeholders(g, &ph), 5);
    assert_desc(ag_node_desc(ph[0]), "ParamAOTInput(target='linear1.weight')");
    assert_desc(ag_node_desc(ph[3]), "ParamAOTInput(target='linear2.bias')");
    assert_desc(ag_node_desc(ph[4]), "PlainAOTInput(idx=0)");
    assert_int_equal(count_op(g, "addmm"), 2);
    ag_node *out = ag_graph_output_node(g);
    assert_int_equal(ag_node_arg(out, 0)->n, 2);
    assert_desc(ag_node_output_desc(out, 0), "PlainAOTOutput(idx=0)");
    assert_desc(ag_node_output_desc(out, 1), "PlainAOTOutput(idx=1)");
    assert_val(ag_node_arg(out, 0)->u.nodes[1], AG_F32, 2, (int64_t[]){4, 4});
    ag_graph_free(g);
    built_free(&b);

    /* kwargs: scale is the second plain input, and it multiplies the linear's output. */
    b = build("kwargs", NULL, true);
    g = trace_or_fail(b.m, b.in, b.nin);
    assert_int_equal(ag_graph_placeholders(g, &ph), 4);
    assert_desc(ag_node_desc(ph[2]), "PlainAOTInput(idx=0)");
    assert_desc(ag_node_desc(ph[3]), "PlainAOTInput(idx=1)");
    assert_val(ph[3], AG_F32, 0, NULL);
    ag_node *mul = first_op(g, "mul");
    assert_ptr_equal(ag_node_arg_node(mul, 0), first_op(g, "addmm"));
    assert_ptr_equal(ag_node_arg_node(mul, 1), ph[3]);
    ag_graph_free(g);
    built_free(&b);
}

/* ---- stack traces ---- */

/* The text of the last "  File ..." frame of a stack trace. */
static const char *last_frame(const char *st) {
    const char *last = NULL;
    for (const char *p = st; (p = strstr(p, "File \"")); p++)
        last = p;
    return last;
}

/* Asserts st has a frame for zoo.c at `line` in function `func`, followed by the source
 * line (indented by four spaces) containing `source`; returns where the frame's text starts. */
static const char *assert_zoo_frame(const char *st, int line, const char *func,
                                    const char *source) {
    if (!st)
        fail_msg("no stack trace (want zoo.c line %d)", line);
    char want[256];
    snprintf(want, sizeof want, "zoo.c\", line %d, in %s\n", line, func);
    const char *p = strstr(st, want);
    if (!p)
        fail_msg("no frame '%s' in stack trace:\n%s", want, st);
    const char *next = p + strlen(want);
    const char *eol = strchr(next, '\n');
    char src[512];
    snprintf(src, sizeof src, "%.*s", eol ? (int)(eol - next) : (int)strlen(next), next);
    if (strncmp(src, "    ", 4) || !strstr(src, source))
        fail_msg("frame '%s' is followed by '%s', not the source line '%s'", want, src, source);
    return p;
}

/* Asserts the outermost frame of st (its first line) contains `want`: the trace starts in the
 * traced forward, not at whatever ran before tracing. */
static void assert_first_frame_has(const char *st, const char *want) {
    const char *eol = st ? strchr(st, '\n') : NULL;
    const char *p = st ? strstr(st, want) : NULL;
    if (!p || (eol && p > eol))
        fail_msg("the outermost frame has no '%s':\n%s", want, st ? st : "(none)");
}

/* Asserts the innermost frame of st contains `want`. */
static void assert_last_frame_has(const char *st, const char *want) {
    const char *f = last_frame(st);
    if (!f || !strstr(f, want))
        fail_msg("the innermost frame has no '%s':\n%s", want, st);
}

static void test_stack_traces_point_at_zoo(void **state) {
    (void)state;
    int lin = mark_line("linear-forward");
    built b = build("linear", NULL, true);
    ag_graph *g = trace_or_fail(b.m, b.in, b.nin);
    ag_node *nodes[2] = {first_op(g, "t"), first_op(g, "addmm")};
    for (int i = 0; i < 2; i++) {
        const char *st = ag_node_stack_trace(nodes[i]);
        const char *z = assert_zoo_frame(st, lin, "linear_fwd", "child(m, \"linear\", in[0]);");
        char first[96];
        snprintf(first, sizeof first, "zoo.c\", line %d, in linear_fwd", lin);
        assert_first_frame_has(st, first);
        /* The Linear module's own code is the inner frame. */
        const char *l = strstr(st, "layers.c\", line ");
        if (!l || l < z)
            fail_msg("no layers.c frame inside the zoo.c frame:\n%s", st);
        assert_last_frame_has(st, "layers.c\"");
        assert_last_frame_has(st, "in linear_apply");
        assert_last_frame_has(st, "ag_linear(");
    }
    /* Placeholders have no stack trace. */
    ag_node **ph;
    ag_graph_placeholders(g, &ph);
    assert_null(ag_node_stack_trace(ph[0]));
    ag_graph_free(g);
    built_free(&b);

    /* convbn: the relu is called by zoo.c itself (innermost frame), the convolution inside
     * the Conv2d module called from the marked line. */
    int relu_line = mark_line("convbn-relu"), conv_line = mark_line("convbn-conv");
    b = build("convbn", NULL, true);
    g = trace_or_fail(b.m, b.in, b.nin);
    const char *st = ag_node_stack_trace(first_op(g, "relu"));
    const char *z = assert_zoo_frame(st, relu_line, "convbn_fwd", "y = ag_relu(y);");
    assert_true(z > last_frame(st)); /* the innermost frame */
    assert_null(strstr(st, "layers.c"));
    st = ag_node_stack_trace(first_op(g, "convolution"));
    z = assert_zoo_frame(st, conv_line, "convbn_fwd", "child(m, \"conv\", in[0]);");
    assert_true(strstr(st, "layers.c\"") > z);
    assert_last_frame_has(st, "in conv2d_apply");
    /* BatchNorm's nodes are not attributed to the conv line. */
    st = ag_node_stack_trace(first_op(g, "native_batch_norm"));
    char conv_frame[64];
    snprintf(conv_frame, sizeof conv_frame, "zoo.c\", line %d,", conv_line);
    assert_null(strstr(st, conv_frame));
    assert_last_frame_has(st, "in batchnorm2d_apply");
    ag_graph_free(g);
    built_free(&b);

    /* More models: (model, first node of op, marked zoo.c line, its function, whether the
     * op is the zoo line's own call (innermost frame) or inside a module (layers.c inner)). */
    static const struct {
        const char *model, *op, *mark, *func, *source;
        bool own;
    } cases[] = {
        {"kwargs", "mul", "kwargs-mul", "kwargs_fwd", "ag_mul(child(m, \"linear\"", true},
        {"kwargs", "addmm", "kwargs-mul", "kwargs_fwd", "ag_mul(child(m, \"linear\"", false},
        {"mlp", "relu", "mlp-fc1", "mlp_fwd", "ag_relu(child(m, \"fc1\", in[0]));", true},
        {"mlp", "addmm", "mlp-fc1", "mlp_fwd", "ag_relu(child(m, \"fc1\", in[0]));", false},
        {"cnn", "relu", "cnn-block1", "cnn_fwd", "child(m, \"conv1\", in[0])", true},
        {"cnn", "convolution", "cnn-block1", "cnn_fwd", "child(m, \"conv1\", in[0])", false},
        {"cnn", "native_batch_norm", "cnn-block1", "cnn_fwd", "child(m, \"bn1\"", false},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        b = build(cases[i].model, NULL, true);
        g = trace_or_fail(b.m, b.in, b.nin);
        st = ag_node_stack_trace(first_op(g, cases[i].op));
        z = assert_zoo_frame(st, mark_line(cases[i].mark), cases[i].func, cases[i].source);
        assert_first_frame_has(st, cases[i].func);
        if (cases[i].own) {
            assert_true(z > last_frame(st));
            assert_null(strstr(st, "layers.c"));
        } else {
            assert_true(strstr(st, "layers.c\"") > z);
            assert_last_frame_has(st, "layers.c\"");
        }
        ag_graph_free(g);
        built_free(&b);
    }

    /* Without stack traces asked for, none are recorded. */
    b = build("linear", NULL, true);
    ag_trace_opts o = {.no_stack_traces = true};
    g = ag_trace_module(b.m, b.in, b.nin, &o);
    assert_non_null(g);
    assert_null(ag_node_stack_trace(first_op(g, "addmm")));
    ag_graph_free(g);
    built_free(&b);
}

/* ---- annotations ---- */

static ag_mval mv_int(int64_t i) {
    return (ag_mval){.kind = AG_MV_INT, .u.i = i};
}
static ag_mval mv_str(const char *s) {
    return (ag_mval){.kind = AG_MV_STR, .u.s = s};
}

static int block_line; /* the line of the op inside annotated_block */

static int annotated_block(void *ud) {
    ag_tensor **x = ud;
    block_line = __LINE__ + 1;
    *x = ag_sigmoid(*x);
    return *x ? 0 : -1;
}

static int annotate_call_line;

static int annotated_fn(void *ud, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)ud, (void)nin, (void)max_out;
    ag_annotate_begin("pp_stage", mv_int(0));
    ag_tensor *a = ag_relu(in[0]); /* {pp_stage: 0} */
    ag_annotate_begin("name", mv_str("inner"));
    ag_tensor *b = ag_sin(a); /* {pp_stage: 0, name: inner} */
    ag_annotate_begin("pp_stage", mv_int(1));
    ag_tensor *c = ag_cos(b); /* {pp_stage: 1, name: inner} */
    ag_annotate_end();
    ag_tensor *d = ag_exp(c); /* {pp_stage: 0, name: inner} */
    ag_annotate_end();
    ag_tensor *e = ag_neg(d); /* {pp_stage: 0} */
    ag_annotate_end();
    ag_tensor *f = ag_tanh(e); /* {} */
    ag_tensor *x = f;
    ag_mval head = mv_str("head");
    annotate_call_line = __LINE__ + 1;
    int rc = ag_annotate_fn("stage", head, "annotated_block", annotated_block, &x);
    if (rc)
        return rc;
    out[0] = ag_abs(x); /* {} again */
    return 1;
}

static void assert_custom(const ag_node *n, int count, const char *k1, ag_mval v1, const char *k2,
                          ag_mval v2) {
    if (ag_node_custom_count(n) != count)
        fail_msg("%s: %d custom entries, want %d", ag_node_name(n), ag_node_custom_count(n), count);
    const char *keys[2] = {k1, k2};
    ag_mval vals[2] = {v1, v2};
    for (int i = 0; i < count; i++) {
        ag_mval got = ag_node_custom_get(n, keys[i]);
        assert_int_equal(got.kind, vals[i].kind);
        if (got.kind == AG_MV_INT)
            assert_int_equal(got.u.i, vals[i].u.i);
        else
            assert_string_equal(got.u.s, vals[i].u.s);
    }
}

static void test_annotations(void **state) {
    (void)state;
    ag_tensor *x = ag_randn(AG_F32, 1, (int64_t[]){5});
    ag_graph *g = ag_trace(annotated_fn, NULL, &x, 1, NULL, NULL, NULL);
    if (!g)
        fail_msg("trace: %s", ag_last_error());
    ag_mval none = {.kind = AG_MV_NONE};
    assert_custom(first_op(g, "relu"), 1, "pp_stage", mv_int(0), NULL, none);
    assert_custom(first_op(g, "sin"), 2, "pp_stage", mv_int(0), "name", mv_str("inner"));
    assert_custom(first_op(g, "cos"), 2, "pp_stage", mv_int(1), "name", mv_str("inner"));
    assert_custom(first_op(g, "exp"), 2, "pp_stage", mv_int(0), "name", mv_str("inner"));
    assert_custom(first_op(g, "neg"), 1, "pp_stage", mv_int(0), NULL, none);
    assert_custom(first_op(g, "tanh"), 0, NULL, none, NULL, none);
    assert_custom(first_op(g, "sigmoid"), 1, "stage", mv_str("head"), NULL, none);
    assert_custom(first_op(g, "abs"), 0, NULL, none, NULL, none);
    /* The merged map keeps the outer key first. */
    ag_mval v;
    assert_string_equal(ag_node_custom_key_at(first_op(g, "sin"), 0, &v), "pp_stage");
    assert_string_equal(ag_node_custom_key_at(first_op(g, "sin"), 1, &v), "name");

    /* annotate_fn: the call is an outer frame (in annotated_fn), the block an inner one. */
    const char *st = ag_node_stack_trace(first_op(g, "sigmoid"));
    assert_non_null(st);
    char outer[128], inner[128];
    snprintf(outer, sizeof outer, "test_trace.c\", line %d, in annotated_fn", annotate_call_line);
    snprintf(inner, sizeof inner, "test_trace.c\", line %d, in annotated_block", block_line);
    const char *po = strstr(st, outer), *pi = strstr(st, inner);
    if (!po || !pi || po > pi)
        fail_msg("want frames '%s' then '%s' in:\n%s", outer, inner, st);
    assert_last_frame_has(st, inner);
    /* The relu's stack trace is the annotated function's line, no block frame. */
    st = ag_node_stack_trace(first_op(g, "relu"));
    assert_last_frame_has(st, "in annotated_fn");
    assert_null(strstr(st, "annotated_block"));
    ag_graph_free(g);
    ag_tensor_free(x);
}

/* ---- call-site macros ---- */

/* Every function declared AG_API in ops.h has its `#define ag_xxx(` in sites.h (regenerate
 * with scripts/gen-sites.py). */
static void test_every_entry_point_has_a_site_macro(void **state) {
    (void)state;
    char *ops = slurp("include/aotgrad/ops.h");
    char *sites = slurp("include/aotgrad/sites.h");
    int checked = 0, missing = 0;
    for (char *p = ops; (p = strstr(p, "AG_API")); p += 6) {
        /* The declaration's name: the identifier just before its first '('. */
        char *paren = strchr(p, '(');
        assert_non_null(paren);
        char *end = paren;
        while (end > p && end[-1] == ' ')
            end--;
        char *start = end;
        while (start > p && (start[-1] == '_' || (start[-1] >= 'a' && start[-1] <= 'z') ||
                             (start[-1] >= '0' && start[-1] <= '9')))
            start--;
        char name[96], def[256];
        snprintf(name, sizeof name, "%.*s", (int)(end - start), start);
        assert_true(!strncmp(name, "ag_", 3));
        snprintf(def, sizeof def, "#define %s(...) AG__SITE(%s(__VA_ARGS__))", name, name);
        if (!strstr(sites, def)) {
            print_error("sites.h has no call-site macro for %s\n", name);
            missing++;
        }
        checked++;
    }
    free(ops);
    free(sites);
    assert_true(checked >= 100); /* the scan found the declarations */
    assert_int_equal(missing, 0);
}

/* ---- GPT-2 small in meta mode: no tensor data ---- */

typedef struct alloc_stats {
    ag_allocator prev;
    size_t largest, total;
    int64_t count;
} alloc_stats;

static void *count_alloc(void *ud, size_t size, size_t align) {
    alloc_stats *s = ud;
    if (size > s->largest)
        s->largest = size;
    s->total += size;
    s->count++;
    return s->prev.alloc(s->prev.ud, size, align);
}

static void count_free(void *ud, void *p) {
    alloc_stats *s = ud;
    s->prev.free(s->prev.ud, p);
}

static void test_gpt2_small_meta_trace(void **state) {
    (void)state;
    alloc_stats st = {.prev = ag_get_allocator()};
    ag_allocator hook = {count_alloc, count_free, &st};
    ag_set_allocator(&hook);
    built b = build("gpt2", "gpt2-small", true);
    ag_graph *g = ag_trace_module(b.m, b.in, b.nin, NULL);
    ag_set_allocator(&st.prev);
    if (!g)
        fail_msg("trace: %s", ag_last_error());
    print_message("gpt2-small build+trace: %lld allocations, %.1f MiB in all, largest %zu bytes, "
                  "%d nodes\n",
                  (long long)st.count, (double)st.total / (1 << 20), st.largest,
                  ag_graph_num_nodes(g));
    assert_true(st.largest <= (1u << 20));
    assert_true(st.total < (64u << 20)); /* the weights alone are 124M * 4 bytes */
    /* 124M parameters by the definition: wte 50257*768, wpe 1024*768, 12 blocks of
     * (2 LayerNorms 2*2*768, c_attn 768*2304+2304, attn c_proj 768*768+768,
     * c_fc 768*3072+3072, mlp c_proj 3072*768+768), ln_f 2*768; lm_head tied to wte. */
    assert_int_equal(ag_module_num_parameters(b.m), 124439808);
    assert_true(ag_is_meta(ag_module_param(b.m, "transformer.wte.weight")));
    /* Placeholders: wte, wpe, 12 per block, ln_f's 2 and the tied lm_head.weight again
     * (duplicates kept), then idx. */
    ag_node **ph;
    assert_int_equal(ag_graph_placeholders(g, &ph), 2 + 12 * 12 + 2 + 1 + 1);
    assert_desc(ag_node_desc(ph[0]), "ParamAOTInput(target='transformer.wte.weight')");
    assert_desc(ag_node_desc(ph[2]), "ParamAOTInput(target='transformer.h.0.ln_1.weight')");
    assert_desc(ag_node_desc(ph[148]), "ParamAOTInput(target='lm_head.weight')");
    assert_desc(ag_node_desc(ph[149]), "PlainAOTInput(idx=0)");
    /* A layer's worth of nodes per block. */
    assert_int_equal(count_op(g, "native_layer_norm"), 12 * 2 + 1);
    assert_int_equal(count_op(g, "gelu"), 12);
    assert_int_equal(count_op(g, "embedding"), 2);
    assert_int_equal(count_op(g, "addmm"), 12 * 4);
    ag_node *out = ag_graph_output_node(g);
    assert_val(ag_node_arg(out, 0)->u.nodes[0], AG_F32, 3, (int64_t[]){2, 16, 50257});
    ag_graph_free(g);
    built_free(&b);
}

/* GPT-2 XL (1.56B parameters, 6.2 GB of f32 weights) builds and exports its training joint in
 * meta mode within a few MiB: `aotgrad predict` shards its step without the weights. */
static void test_gpt2_xl_meta_export(void **state) {
    (void)state;
    alloc_stats st = {.prev = ag_get_allocator()};
    ag_allocator hook = {count_alloc, count_free, &st};
    ag_set_allocator(&hook);
    built b = build("gpt2", "gpt2-xl", true);
    bool prev = ag_set_meta_mode(true);
    ag_tensor *idx = ag_zeros(AG_I64, 2, (int64_t[]){1, 1024});
    ag_tensor *tgt = ag_zeros(AG_I64, 2, (int64_t[]){1, 1024});
    ag_joint *j = ag_export_joint(b.m, (ag_tensor *[]){idx, tgt}, 2, NULL, NULL, 0, NULL);
    ag_set_meta_mode(prev);
    ag_set_allocator(&st.prev);
    if (!j)
        fail_msg("export: %s", ag_last_error());
    print_message("gpt2-xl build+export: %.1f MiB in all, largest %zu bytes, %d nodes\n",
                  (double)st.total / (1 << 20), st.largest, ag_graph_num_nodes(ag_joint_graph(j)));
    assert_true(st.largest <= (4u << 20));
    assert_true(st.total < (256u << 20));
    /* By the definition: wte 50257*1600, wpe 1024*1600, 48 blocks of (2 LayerNorms 4*1600,
     * c_attn 1600*4800+4800, attn c_proj 1600*1600+1600, c_fc 1600*6400+6400, mlp c_proj
     * 6400*1600+1600), ln_f 2*1600; lm_head tied to wte. */
    assert_int_equal(ag_module_num_parameters(b.m), 1557611200);
    ag_gpt2_config c = ag_gpt2_config_xl();
    assert_int_equal(c.n_layer, 48);
    assert_int_equal(c.n_head, 25);
    assert_int_equal(c.n_embd, 1600);
    assert_int_equal(c.vocab_size, 50257);
    assert_int_equal(c.block_size, 1024);
    assert_true(ag_is_meta(ag_module_param(b.m, "transformer.h.47.mlp.c_fc.weight")));
    /* wte, wpe, 12 per block, ln_f's 2, the tied lm_head.weight again, idx and targets, and a
     * tangent for each forward output (logits and loss). */
    ag_node **ph;
    assert_int_equal(ag_graph_placeholders(ag_joint_graph(j), &ph), 2 + 48 * 12 + 2 + 1 + 2 + 2);
    assert_val(ph[0], AG_F32, 2, (int64_t[]){50257, 1600});
    assert_val(ph[583], AG_F32, 3, (int64_t[]){1, 1024, 50257});
    assert_int_equal(ag_joint_num_fw_outputs(j), 2);
    ag_joint_free(j);
    ag_tensor_free(idx);
    ag_tensor_free(tgt);
    built_free(&b);
}

/* ---- errors while tracing ---- */

static int item_fn(void *ud, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)ud, (void)nin, (void)max_out;
    double v = ag_tensor_item(ag_sum_all(in[0])); /* data-dependent: no data while tracing */
    if (isnan(v) && ag_last_status() < 0)
        return ag_last_status();
    out[0] = ag_mul_scalar(in[0], v);
    return 1;
}

static int mask_fn(void *ud, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)ud, (void)nin, (void)max_out;
    ag_tensor *mask = ag_gt_scalar(in[0], 0.0);
    out[0] = ag_index(in[0], &mask, 1); /* x[x > 0]: its size depends on the values */
    return out[0] ? 1 : ag_last_status();
}

static void test_trace_errors(void **state) {
    (void)state;
    ag_tensor *x = ag_randn(AG_F32, 2, (int64_t[]){3, 4});
    ag_clear_error();
    ag_graph *g = ag_trace(item_fn, NULL, &x, 1, NULL, NULL, NULL);
    assert_null(g);
    assert_true(ag_last_status() < 0);
    tu_assert_error_contains("item");
    tu_assert_error_contains("data");

    ag_clear_error();
    g = ag_trace(mask_fn, NULL, &x, 1, NULL, NULL, NULL);
    assert_null(g);
    assert_int_equal(ag_last_status(), AG_ENOTSUP);
    tu_assert_error_contains("data-dependent");
    tu_assert_error_contains("index");

    /* The failed traces left nothing behind: meta mode is off and eager works. */
    ag_tensor *y = ag_relu(x);
    assert_non_null(y);
    assert_false(ag_is_meta(y));
    assert_non_null(ag_tensor_data(y));
    ag_tensor_free(y);
    ag_tensor_free(x);

    /* A model whose forward rejects its input fails the trace with the module's message. */
    built b = build("linear", NULL, false);
    ag_tensor *bad = ag_randn(AG_F32, 2, (int64_t[]){4, 5});
    assert_null(ag_trace_module(b.m, &bad, 1, NULL));
    tu_assert_error_contains("linear");
    ag_tensor_free(bad);
    built_free(&b);
}

/* ---- allocation failures ---- */

/* Building a zoo model and tracing it (stack traces included: reading source files and
 * formatting traces allocate too), with the N-th allocation failing for every N: each failure
 * is reported as AG_ENOMEM and nothing leaks. */
static int build_and_trace(void *ud) {
    const char *model = ud;
    ag_module *m = NULL;
    ag_tensor *in[4] = {0};
    int nin = 0;
    bool prev = ag_set_meta_mode(true);
    int rc = ag_zoo_build(model, NULL, &m, in, 4, &nin);
    ag_set_meta_mode(prev);
    if (rc)
        return rc;
    ag_graph *g = ag_trace_module(m, in, nin, NULL);
    rc = g ? 0 : ag_last_status();
    tu_alloc_cleanup_begin();
    ag_graph_free(g);
    for (int i = 0; i < nin; i++)
        ag_tensor_free(in[i]);
    ag_module_free(m);
    tu_alloc_cleanup_end();
    return rc;
}

static void test_zoo_alloc_failures(void **state) {
    (void)state;
    const char *models[] = {"linear", "kwargs", "convbn", "multi_output"};
    for (int i = 0; i < 4; i++) {
        tu_sweep_opts o = {.what = models[i], .one_thread = true};
        int64_t points = tu_alloc_failure_sweep(build_and_trace, (void *)models[i], &o);
        assert_true(points > 20);
    }
}

/* ---- the CLI: aotgrad models / trace / show ---- */

static void test_cli(void **state) {
    (void)state;
    if (!tu_cli_setup("/tmp/ag_test_trace_XXXXXX"))
        skip();
    char args[512];

    assert_int_equal(tu_cli_run("models"), 0);
    for (int i = 0; i < ag_zoo_count(); i++)
        tu_cli_has("out", ag_zoo_name(i));

    /* trace, then show: the same text back. */
    snprintf(args, sizeof args, "trace convbn --seq-nr --stack-traces -o '%s/convbn.txt'",
             tu_cli_dir());
    assert_int_equal(tu_cli_run(args), 0);
    tu_cli_has("convbn.txt",
               "%primals_7 : i64[]  # BufferAOTInput(target='bn.num_batches_tracked')");
    tu_cli_has("convbn.txt", "seq_nr=0");
    tu_cli_has("convbn.txt", "zoo.c\", line ");
    snprintf(args, sizeof args, "show '%s/convbn.txt'", tu_cli_dir());
    assert_int_equal(tu_cli_run(args), 0);
    char *a = tu_cli_read("convbn.txt"), *b = tu_cli_read("out");
    assert_string_equal(b, a);
    free(a);
    free(b);
    assert_int_equal(tu_cli_run("trace linear --format dot"), 0);
    tu_cli_has("out", "digraph");

    /* gpt2-small traces without its weights. */
    assert_int_equal(tu_cli_run("trace gpt2 --config gpt2-small"), 0);
    tu_cli_has("out",
               "%primals_1 : f32[50257, 768]  # ParamAOTInput(target='transformer.wte.weight')");

    /* Usage errors: exit 2 with a message. */
    assert_int_equal(tu_cli_run("trace resnet"), 2);
    tu_cli_has("err", "unknown model 'resnet'");
    tu_cli_has("err", "gpt2");
    assert_int_equal(tu_cli_run("trace gpt2 --config gpt2-medium"), 2);
    tu_cli_has("err", "tiny, gpt2-small, gpt2-xl");
    assert_int_equal(tu_cli_run("trace linear --frobnicate"), 2);
    tu_cli_has("err", "unknown option '--frobnicate'");
    assert_int_equal(tu_cli_run("trace linear --format svg"), 2);
    tu_cli_has("err", "needs -o");
    assert_int_equal(tu_cli_run("trace linear --format png"), 2);
    assert_int_equal(tu_cli_run("trace"), 2);
    assert_int_equal(tu_cli_run("show"), 2);

    /* A bad file: FILE:LINE:COL: message, exit 1. 'reluu' starts at line 3, column 10. */
    tu_cli_write("bad.txt", "graph():\n"
                            "    %x : f32[2]  # None\n"
                            "    %y = reluu(%x)  # f32[2]\n"
                            "    return (%y,)\n");
    snprintf(args, sizeof args, "show '%s/bad.txt'", tu_cli_dir());
    assert_int_equal(tu_cli_run(args), 1);
    char want[160];
    snprintf(want, sizeof want, "%s/bad.txt:3:10: ", tu_cli_dir());
    tu_cli_has("err", want);
    tu_cli_has("err", "reluu");
    snprintf(args, sizeof args, "show '%s/missing.txt'", tu_cli_dir());
    assert_int_equal(tu_cli_run(args), 1);
    tu_cli_has("err", "missing.txt");

    const char *files[] = {"out", "err", "convbn.txt", "bad.txt"};
    tu_cli_cleanup(files, 4);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_zoo_registry),
        cmocka_unit_test(test_zoo_deterministic),
        cmocka_unit_test(test_zoo_meta_build),
        cmocka_unit_test(test_zoo_graph_equals_eager),
        cmocka_unit_test(test_convbn_buffers_mutated),
        cmocka_unit_test(test_linear_structure),
        cmocka_unit_test(test_multi_output_and_kwargs_structure),
        cmocka_unit_test(test_stack_traces_point_at_zoo),
        cmocka_unit_test(test_annotations),
        cmocka_unit_test(test_every_entry_point_has_a_site_macro),
        cmocka_unit_test(test_gpt2_small_meta_trace),
        cmocka_unit_test(test_gpt2_xl_meta_export),
        cmocka_unit_test(test_trace_errors),
        cmocka_unit_test(test_zoo_alloc_failures),
        cmocka_unit_test(test_cli),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
