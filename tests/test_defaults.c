/* Zero-initialized options are upstream's defaults: for each public options struct, a zeroed
 * struct, NULL and the defaults spelled out behave alike, checked by what a wrong default would
 * change (which nodes the min-cut recomputes, which gradients gradcheck accepts). Also the
 * compiled callable's input checks: an input that requires grad at call time but did not at
 * export is refused naming its descriptor; shape and dtype mismatches name it too. */
#include "testutil.h"

#include <math.h>
#include <string.h>

/* ---- the partitioner and ag_compile_joint ---- */

typedef struct model {
    ag_module *m;
    ag_tensor *in[8];
    int nin;
    ag_joint *j;
} model;

/* The zoo's GPT-2 (config NULL: tiny, 2 layers; "gpt2-small": 12 layers, 124M), exported;
 * meta: shapes only. */
static void gpt2_load(model *md, const char *config, bool meta) {
    bool prev = ag_set_meta_mode(meta);
    int rc = ag_zoo_build("gpt2", config, &md->m, md->in, 8, &md->nin);
    ag_set_meta_mode(prev);
    assert_int_equal(rc, 0);
    md->j = ag_export_joint(md->m, md->in, md->nin, NULL, NULL, 0, NULL);
    if (!md->j)
        print_error("export: %s\n", ag_last_error());
    assert_non_null(md->j);
}

static void model_free(model *md) {
    ag_joint_free(md->j);
    ag_module_free(md->m);
    for (int i = 0; i < md->nin; i++)
        ag_tensor_free(md->in[i]);
}

static ag_partition_stats part_stats(const model *md, const ag_partition_opts *o) {
    ag_graph *fw = NULL, *bw = NULL;
    ag_partition_stats st = {0};
    int rc = ag_partition(ag_joint_graph(md->j), ag_joint_num_fw_outputs(md->j), o, &fw, &bw, &st);
    if (rc)
        print_error("partition: %s\n", ag_last_error());
    assert_int_equal(rc, 0);
    ag_graph_free(fw);
    ag_graph_free(bw);
    return st;
}

static void assert_same_stats(const ag_partition_stats *a, const ag_partition_stats *b) {
    assert_int_equal(a->saved_tensors, b->saved_tensors);
    assert_int_equal(a->saved_bytes, b->saved_bytes);
    assert_int_equal(a->recomputed_nodes, b->recomputed_nodes);
}

static void test_partition_opts(void **st) {
    (void)st;
    model md;
    gpt2_load(&md, "gpt2-small", true);
    /* Budget 1 and budget 0 differ on GPT-2 (the test would prove nothing otherwise). */
    ag_partition_opts one = {.partitioner = AG_PARTITION_MINCUT, .memory_budget = 1.0};
    ag_partition_opts zero = {.partitioner = AG_PARTITION_MINCUT,
                              .memory_budget = AG_MEMORY_BUDGET_ZERO};
    ag_partition_stats s1 = part_stats(&md, &one), s0 = part_stats(&md, &zero);
    assert_true(s0.recomputed_nodes > s1.recomputed_nodes);
    assert_true(s0.saved_bytes < s1.saved_bytes);
    /* The min-cut with the budget left zero is budget 1.0, not 0. */
    ag_partition_opts mz = {.partitioner = AG_PARTITION_MINCUT};
    ag_partition_stats sz = part_stats(&md, &mz);
    assert_same_stats(&sz, &s1);
    /* ag_memory_budget(0) is budget 0; any other value itself. */
    ag_partition_opts m0 = {.partitioner = AG_PARTITION_MINCUT,
                            .memory_budget = ag_memory_budget(0)};
    ag_partition_stats sm0 = part_stats(&md, &m0);
    assert_same_stats(&sm0, &s0);
    assert_true(signbit(ag_memory_budget(0.0)) && ag_memory_budget(0.0) == 0);
    assert_true(ag_memory_budget(0.5) == 0.5);
    /* NULL == {0} == upstream's default_partition (save what the backward uses: nothing is
     * recomputed), which is not the min-cut's choice here. */
    ag_partition_opts z = {0}, dflt = {.partitioner = AG_PARTITION_DEFAULT, .memory_budget = 1.0};
    ag_partition_stats sn = part_stats(&md, NULL), s00 = part_stats(&md, &z),
                       sd = part_stats(&md, &dflt);
    assert_same_stats(&sn, &s00);
    assert_same_stats(&sn, &sd);
    assert_int_equal(sn.recomputed_nodes, 0);
    assert_true(s1.recomputed_nodes > 0); /* the min-cut recomputes, the default does not */
    /* Refused, naming the value: outside [0, 1], NaN; a nonzero setting is never replaced. */
    ag_graph *fw = NULL, *bw = NULL;
    const double bad[] = {-0.25, 1.5, -1.0, NAN, INFINITY};
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        ag_partition_opts o = {.partitioner = AG_PARTITION_MINCUT, .memory_budget = bad[k]};
        assert_int_equal(
            ag_partition(ag_joint_graph(md.j), ag_joint_num_fw_outputs(md.j), &o, &fw, &bw, NULL),
            AG_EINVAL);
        tu_assert_error_contains("memory budget");
        tu_assert_error_contains("outside [0, 1]");
        assert_null(fw);
        assert_null(bw);
    }
    model_free(&md);
}

/* The forward graph's text: which values a partition saves, in order. */
static char *fw_text(const model *md, const ag_partition_opts *o) {
    ag_graph *fw = NULL, *bw = NULL;
    assert_int_equal(
        ag_partition(ag_joint_graph(md->j), ag_joint_num_fw_outputs(md->j), o, &fw, &bw, NULL), 0);
    char *t = ag_graph_to_string(fw, &(ag_print_opts){.no_meta = true});
    assert_non_null(t);
    ag_graph_free(fw);
    ag_graph_free(bw);
    return t;
}

/* A zeroed solver is upstream's activation_memory_budget_solver default, "dp": at budget 0.1
 * on the tiny GPT-2 the dp knapsack saves other values than the greedy one (checked here, so
 * the comparison means something), and the zeroed field picks dp's. */
static void test_solver_default(void **st) {
    (void)st;
    model md;
    gpt2_load(&md, NULL, true);
    ag_partition_opts z = {.partitioner = AG_PARTITION_MINCUT, .memory_budget = 0.1},
                      d = {.partitioner = AG_PARTITION_MINCUT,
                           .memory_budget = 0.1,
                           .solver = AG_KNAPSACK_DP},
                      g = {.partitioner = AG_PARTITION_MINCUT,
                           .memory_budget = 0.1,
                           .solver = AG_KNAPSACK_GREEDY};
    char *tz = fw_text(&md, &z), *td = fw_text(&md, &d), *tg = fw_text(&md, &g);
    assert_string_not_equal(td, tg);
    assert_string_equal(tz, td);
    ag_free(tz);
    ag_free(td);
    ag_free(tg);
    model_free(&md);
}

static ag_partition_stats compiled_stats(const model *md, const ag_compile_opts *o) {
    ag_compiled *c = ag_compile_joint(md->j, o);
    if (!c)
        print_error("compile: %s\n", ag_last_error());
    assert_non_null(c);
    ag_partition_stats s = *ag_compiled_stats(c);
    ag_compiled_free(c);
    return s;
}

static void test_compile_opts(void **st) {
    (void)st;
    model md;
    gpt2_load(&md, "gpt2-small", true);
    ag_compile_opts one = {.partition = {.partitioner = AG_PARTITION_MINCUT, .memory_budget = 1}};
    ag_compile_opts zero = {
        .partition = {.partitioner = AG_PARTITION_MINCUT, .memory_budget = AG_MEMORY_BUDGET_ZERO}};
    ag_compile_opts mz = {.partition = {.partitioner = AG_PARTITION_MINCUT}};
    ag_partition_stats s1 = compiled_stats(&md, &one), s0 = compiled_stats(&md, &zero),
                       sz = compiled_stats(&md, &mz);
    assert_true(s0.recomputed_nodes > s1.recomputed_nodes);
    assert_same_stats(&sz, &s1);
    /* NULL == {0} == default_partition through the planned executor. */
    ag_compile_opts z = {0}, dflt = {.partition = {.partitioner = AG_PARTITION_DEFAULT,
                                                   .memory_budget = 1.0}};
    ag_partition_stats sn = compiled_stats(&md, NULL), s00 = compiled_stats(&md, &z),
                       sd = compiled_stats(&md, &dflt);
    assert_same_stats(&sn, &s00);
    assert_same_stats(&sn, &sd);
    assert_int_equal(sn.recomputed_nodes, 0);
    /* ... whose halves are plans (the interpreter reports no planned peak). */
    ag_compiled *c = ag_compile_joint(md.j, &z);
    assert_non_null(c);
    assert_true(ag_compiled_peak_bytes(c, false) > 0);
    assert_true(ag_compiled_peak_bytes(c, true) > 0);
    ag_compiled_free(c);
    /* A bad budget fails the compile, with the partitioner's message. */
    ag_compile_opts badb = {.partition = {.partitioner = AG_PARTITION_MINCUT, .memory_budget = 2}};
    assert_null(ag_compile_joint(md.j, &badb));
    tu_assert_error_contains("memory budget 2 is outside [0, 1]");
    model_free(&md);
}

/* ---- gradcheck ---- */

/* f(x) = c * (x^3 + k * x) + c * delta * detach(x): its analytical gradient is
 * c (3x^2 + k); the function's slope is
 * c (3x^2 + k + delta), so the two differ by c * delta, and the central difference with step h
 * adds c h^2 (exactly, for a cubic). */
typedef struct fcase {
    double c, k, delta;
} fcase;

static int fn(void *ud, ag_tensor *const *in, int n, ag_tensor **outs, int *nouts) {
    (void)n;
    const fcase *f = ud;
    ag_tensor *x = in[0];
    ag_tensor *y = ag_add(ag_pow_scalar(x, 3), ag_mul_scalar(x, f->k));
    y = ag_add(y, ag_mul_scalar(ag_detach(x), f->delta));
    outs[0] = ag_mul_scalar(y, f->c);
    *nouts = 1;
    return outs[0] ? 0 : ag_last_status();
}

/* gradcheck of case f at x = x0 (float64, one element) with opts. */
static int check(fcase f, double x0, const ag_gradcheck_opts *o) {
    ag_tensor *x = tu_leaf(AG_F64, 1, (int64_t[]){1}, (double[]){x0});
    ag_scope_begin();
    int rc = ag_gradcheck(fn, &f, &x, 1, o);
    ag_scope_end();
    ag_tensor_free(x);
    return rc;
}

/* Each case passes or fails alike with NULL, {0} and the defaults spelled out. */
static void expect(fcase f, double x0, bool pass) {
    const ag_gradcheck_opts zero = {0}, dflt = {.eps = 1e-6, .atol = 1e-5, .rtol = 1e-3};
    const ag_gradcheck_opts *all[] = {NULL, &zero, &dflt};
    for (int i = 0; i < 3; i++) {
        int rc = check(f, x0, all[i]);
        if ((rc == 0) != pass)
            fail_msg("c %g k %g delta %g at %g, opts %d: %s (%s)", f.c, f.k, f.delta, x0, i,
                     rc ? "failed" : "passed", rc ? ag_last_error() : "");
    }
}

static void test_gradcheck_opts(void **st) {
    (void)st;
    /* eps 1e-6: at x = 0 the analytical slope is 0 and the central difference c h^2, 5e-6 or
     * 2e-5 for c = 5e6 or 2e7: under and over atol 1e-5 (a step 10x larger fails both). */
    expect((fcase){5e6, 0, 0}, 0.0, true);
    expect((fcase){2e7, 0, 0}, 0.0, false);
    /* atol 1e-5: with c = 1e-4 (rtol's share 1e-7), an error c * delta of 9e-6 passes and one
     * of 1.1e-5 fails. */
    expect((fcase){1e-4, 1, 0.09}, 0.0, true);
    expect((fcase){1e-4, 1, 0.11}, 0.0, false);
    /* rtol 1e-3: with c = 1000 and slope ~1 (tolerance 1e-5 + 1e-3 * 1000), an error of 0.9
     * passes and one of 1.1 fails. */
    expect((fcase){1000, 1, 0.0009}, 0.0, true);
    expect((fcase){1000, 1, 0.0011}, 0.0, false);
    /* A tolerance of exactly 0 is AG_GRADCHECK_ZERO: the first case then fails on its 5e-6. */
    ag_gradcheck_opts exact = {.atol = AG_GRADCHECK_ZERO, .rtol = AG_GRADCHECK_ZERO};
    assert_int_equal(check((fcase){5e6, 0, 0}, 0.0, &exact), AG_EINVAL);
    tu_assert_error_contains("analytical 0 vs numerical");
    /* Only the fields left zero take their default: a larger eps (1e-3, error c h^2 = 5) fails
     * the case that passed. */
    ag_gradcheck_opts big = {.eps = 1e-3};
    assert_int_equal(check((fcase){5e6, 0, 0}, 0.0, &big), AG_EINVAL);
    /* Negative or non-finite values are refused, naming them. */
    ag_gradcheck_opts neg = {.atol = -1e-5};
    assert_int_equal(check((fcase){1, 0, 0}, 1.0, &neg), AG_EINVAL);
    tu_assert_error_contains("atol -1e-05");
    ag_gradcheck_opts inf = {.eps = INFINITY};
    assert_int_equal(check((fcase){1, 0, 0}, 1.0, &inf), AG_EINVAL);
    tu_assert_error_contains("must be finite");
}

/* ---- the other options structs: zero is the documented default ---- */

static void test_plan_print_trace_export_opts(void **st) {
    (void)st;
    /* A graph to run and print: y = relu(x @ w^T) traced. */
    ag_tensor *x = tu_tensor(AG_F32, 2, (int64_t[]){2, 3}, (double[]){1, -2, 3, -4, 5, -6});
    ag_module *lin = ag_nn_linear(3, 2, true);
    assert_non_null(lin);
    const ag_trace_opts tz = {0};
    ag_graph *g1 = ag_trace_module(lin, &x, 1, NULL), *g2 = ag_trace_module(lin, &x, 1, &tz);
    assert_non_null(g1);
    assert_non_null(g2);
    /* ag_print_opts and ag_trace_opts: {0} prints as NULL does, with the stack traces a
     * zeroed trace_opts records (no_stack_traces off) and print_opts leaves out. */
    const ag_print_opts pz = {0};
    char *a = ag_graph_to_string(g1, NULL), *b = ag_graph_to_string(g2, &pz);
    assert_non_null(a);
    assert_non_null(b);
    assert_string_equal(a, b);
    assert_null(strstr(b, "File \""));
    ag_free(a);
    ag_free(b);
    ag_print_opts ps = {.stack_trace = true};
    a = ag_graph_to_string(g2, &ps);
    assert_non_null(strstr(a, "File \""));
    ag_free(a);
    /* ag_dot_opts: {0} draws as NULL does. */
    const ag_dot_opts dz = {0};
    a = ag_graph_to_dot(g1, NULL);
    b = ag_graph_to_dot(g1, &dz);
    assert_string_equal(a, b);
    ag_free(a);
    ag_free(b);
    /* ag_plan_opts: {0} runs as NULL does (fusion and in-place reuse on): same outputs and the
     * same planned peak. */
    const ag_plan_opts oz = {0};
    ag_plan *p1 = ag_plan_new(g1, NULL), *p2 = ag_plan_new(g1, &oz);
    assert_non_null(p1);
    assert_non_null(p2);
    /* The traced module's placeholders: weight, bias, x. */
    ag_tensor *in[3] = {ag_module_param(lin, "weight"), ag_module_param(lin, "bias"), x};
    int nph = 3;
    ag_tensor *o1 = NULL, *o2 = NULL;
    assert_int_equal(ag_plan_run(p1, in, nph, &o1, 1), 1);
    assert_int_equal(ag_plan_run(p2, in, nph, &o2, 1), 1);
    assert_true(tu_max_abs_diff(o1, o2) == 0);
    assert_int_equal(ag_plan_peak_bytes(p1), ag_plan_peak_bytes(p2));
    ag_tensor_free(o1);
    ag_tensor_free(o2);
    ag_plan_free(p1);
    ag_plan_free(p2);
    ag_graph_free(g1);
    ag_graph_free(g2);
    /* ag_export_opts: {0} exports as NULL does (upstream's decompositions=None,
     * keep_inference_input_mutations=False). */
    const ag_export_opts ez = {0};
    ag_joint *j1 = ag_export_joint(lin, &x, 1, NULL, NULL, 0, NULL),
             *j2 = ag_export_joint(lin, &x, 1, NULL, NULL, 0, &ez);
    assert_non_null(j1);
    assert_non_null(j2);
    a = ag_graph_to_string(ag_joint_graph(j1), NULL);
    b = ag_graph_to_string(ag_joint_graph(j2), NULL);
    assert_string_equal(a, b);
    ag_free(a);
    ag_free(b);
    ag_joint_free(j1);
    ag_joint_free(j2);
    ag_module_free(lin);
    ag_tensor_free(x);
}

/* The joint of a zoo model built with opts, as text (ag_free it). */
static char *zoo_joint_text(const char *name, const ag_zoo_opts *o) {
    ag_module *m = NULL;
    ag_tensor *in[8];
    int nin = 0;
    bool prev = ag_set_meta_mode(true);
    int rc = ag_zoo_build_opts(name, NULL, o, &m, in, 8, &nin);
    ag_set_meta_mode(prev);
    assert_int_equal(rc, 0);
    ag_joint *j = ag_export_joint(m, in, nin, NULL, NULL, 0, NULL);
    assert_non_null(j);
    char *t = ag_graph_to_string(ag_joint_graph(j), NULL);
    assert_non_null(t);
    ag_joint_free(j);
    ag_module_free(m);
    for (int i = 0; i < nin; i++)
        ag_tensor_free(in[i]);
    return t;
}

static void test_zoo_opts(void **st) {
    (void)st;
    /* {0} builds the model's defaults, as NULL does; a dropout set changes the graph (its
     * probability is an argument of the dropout's nodes). */
    const ag_zoo_opts z = {0}, set = {.set_dropout = true, .dropout = 0.375};
    char *a = zoo_joint_text("dropout_mlp", NULL), *b = zoo_joint_text("dropout_mlp", &z),
         *c = zoo_joint_text("dropout_mlp", &set);
    assert_string_equal(a, b);
    assert_string_not_equal(a, c);
    ag_free(a);
    ag_free(b);
    ag_free(c);
}

/* ---- the compiled callable's inputs ---- */

typedef struct lin_fixture {
    ag_module *lin;
    ag_tensor *x;
} lin_fixture;

static void lin_setup(lin_fixture *f, bool x_rg, bool w_rg) {
    uint64_t s = 7;
    f->lin = ag_nn_linear(3, 2, true);
    assert_non_null(f->lin);
    f->x = tu_rand_tensor(AG_F32, 2, (int64_t[]){2, 3}, -1, 1, tu_xorshift, &s);
    assert_int_equal(ag_tensor_set_requires_grad(f->x, x_rg), 0);
    assert_int_equal(ag_tensor_set_requires_grad(ag_module_param(f->lin, "weight"), w_rg), 0);
}

static void lin_teardown(lin_fixture *f) {
    ag_module_free(f->lin);
    ag_tensor_free(f->x);
}

static ag_compiled *lin_compile(lin_fixture *f) {
    ag_joint *j = ag_export_joint(f->lin, &f->x, 1, NULL, NULL, 0, NULL);
    assert_non_null(j);
    ag_compiled *c = ag_compile_joint(j, NULL);
    ag_joint_free(j);
    assert_non_null(c);
    return c;
}

/* Calls c on (weight, bias, x), returns the call's status. */
static int call(ag_compiled *c, lin_fixture *f, ag_tensor *x, ag_tensor **y) {
    *y = NULL;
    return ag_compiled_call_module(c, f->lin, &x, 1, y, 1);
}

static void test_requires_grad_at_call(void **st) {
    (void)st;
    /* An input that did not require grad at export and does now: refused, by descriptor,
     * before anything runs (no output, no gradient). */
    lin_fixture f;
    lin_setup(&f, false, true);
    ag_compiled *c = lin_compile(&f);
    assert_int_equal(ag_tensor_set_requires_grad(f.x, true), 0);
    ag_tensor *y = NULL;
    assert_int_equal(call(c, &f, f.x, &y), AG_EINVAL);
    tu_assert_error_contains("PlainAOTInput(idx=0) (input 2) requires grad but did not when the "
                             "joint was exported");
    tu_assert_error_contains("export again with it requiring grad");
    assert_null(y);
    /* With grad mode off nothing is recorded, so nothing is missing: it runs. */
    bool prev = ag_set_grad_enabled(false);
    assert_int_equal(call(c, &f, f.x, &y), 1);
    ag_set_grad_enabled(prev);
    ag_tensor_free(y);
    ag_compiled_free(c);
    lin_teardown(&f);

    /* A parameter frozen at export and unfrozen later counts too. */
    lin_setup(&f, false, false);
    c = lin_compile(&f);
    assert_int_equal(ag_tensor_set_requires_grad(ag_module_param(f.lin, "weight"), true), 0);
    assert_int_equal(call(c, &f, f.x, &y), AG_EINVAL);
    tu_assert_error_contains("ParamAOTInput(target='weight') (input 0) requires grad but did not");
    assert_null(ag_tensor_grad(ag_module_param(f.lin, "weight")));
    ag_compiled_free(c);
    lin_teardown(&f);

    /* Required grad at export, not now: fine; the other gradients are eager's. */
    lin_setup(&f, true, true);
    c = lin_compile(&f);
    assert_int_equal(ag_tensor_set_requires_grad(f.x, false), 0);
    assert_int_equal(call(c, &f, f.x, &y), 1);
    ag_tensor *loss = ag_sum(y, NULL, 0, false);
    assert_int_equal(ag_backward(loss, NULL, false), 0);
    ag_tensor *w = ag_module_param(f.lin, "weight"), *bias = ag_module_param(f.lin, "bias");
    ag_tensor *gw = ag_tensor_grad(w), *gb = ag_tensor_grad(bias);
    assert_non_null(gw);
    assert_non_null(gb);
    assert_null(ag_tensor_grad(f.x));
    /* d sum(x w^T + b) / dw[o][i] = sum_n x[n][i]; / db[o] = 2 rows. */
    const float *xd = ag_tensor_data(f.x);
    double want_w[6], want_b[2] = {2, 2};
    for (int o = 0; o < 2; o++)
        for (int i = 0; i < 3; i++)
            want_w[o * 3 + i] = (double)xd[i] + (double)xd[3 + i];
    tu_assert_close(gw, want_w, 1e-6);
    tu_assert_close(gb, want_b, 1e-6);
    ag_tensor_free(loss);
    ag_tensor_free(y);
    /* Nothing requires grad now: it runs, and its output has no history. */
    assert_int_equal(ag_tensor_set_requires_grad(w, false), 0);
    assert_int_equal(ag_tensor_set_requires_grad(bias, false), 0);
    assert_int_equal(call(c, &f, f.x, &y), 1);
    assert_false(ag_tensor_requires_grad(y));
    ag_tensor_free(y);
    ag_compiled_free(c);
    lin_teardown(&f);
}

/* A tensor subclass instance is checked through its parts, named by their descriptors. */
static void test_requires_grad_subclass(void **st) {
    (void)st;
    lin_fixture f;
    lin_setup(&f, false, false); /* parameters frozen: their gradients would be TwoTensors */
    assert_int_equal(ag_tensor_set_requires_grad(ag_module_param(f.lin, "bias"), false), 0);
    ag_tensor *a = tu_tensor(AG_F32, 2, (int64_t[]){2, 3}, (double[]){1, -2, 3, -4, 5, -6});
    ag_tensor *b = tu_tensor(AG_F32, 2, (int64_t[]){2, 3}, (double[]){2, 1, 0, -1, -2, -3});
    ag_tensor *t = ag_two_tensor(a, b);
    assert_non_null(t);
    ag_joint *j = ag_export_joint(f.lin, &t, 1, NULL, NULL, 0, NULL);
    if (!j)
        print_error("export: %s\n", ag_last_error());
    assert_non_null(j);
    ag_compiled *c = ag_compile_joint(j, NULL);
    ag_joint_free(j);
    assert_non_null(c);
    ag_tensor *y = NULL;
    assert_int_equal(call(c, &f, t, &y), 1);
    ag_tensor_free(y);
    assert_int_equal(ag_tensor_set_requires_grad(t, true), 0);
    assert_int_equal(call(c, &f, t, &y), AG_EINVAL);
    tu_assert_error_contains("compiled: SubclassGetAttrAOTInput(base=PlainAOTInput(idx=0), "
                             "attr='a') (flat input 2) requires grad but did not");
    assert_null(y);
    ag_compiled_free(c);
    ag_tensor_free(t);
    ag_tensor_free(a);
    ag_tensor_free(b);
    lin_teardown(&f);
}

static void test_input_errors_name_descriptors(void **st) {
    (void)st;
    lin_fixture f;
    lin_setup(&f, false, true);
    ag_compiled *c = lin_compile(&f);
    ag_tensor *y = NULL;
    /* Shape. */
    ag_tensor *x43 = ag_zeros(AG_F32, 2, (int64_t[]){4, 3});
    assert_int_equal(call(c, &f, x43, &y), AG_EINVAL);
    tu_assert_error_contains("compiled: PlainAOTInput(idx=0) (input 2) is f32[4, 3]; the graph was "
                             "exported for f32[2, 3]");
    assert_null(y);
    /* Dtype. */
    ag_tensor *x64 = ag_zeros(AG_F64, 2, (int64_t[]){2, 3});
    assert_int_equal(call(c, &f, x64, &y), AG_EINVAL);
    tu_assert_error_contains("compiled: PlainAOTInput(idx=0) (input 2) is f64[2, 3]; the graph was "
                             "exported for f32[2, 3]");
    /* A parameter's, through ag_compiled_call. */
    ag_tensor *wbad = ag_zeros(AG_F32, 2, (int64_t[]){3, 3});
    ag_tensor *in[3] = {wbad, ag_module_param(f.lin, "bias"), f.x};
    assert_int_equal(ag_compiled_call(c, in, 3, &y, 1), AG_EINVAL);
    tu_assert_error_contains("compiled: ParamAOTInput(target='weight') (input 0) is f32[3, 3]");
    ag_tensor_free(x43);
    ag_tensor_free(x64);
    ag_tensor_free(wbad);
    ag_compiled_free(c);
    lin_teardown(&f);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_partition_opts),
        cmocka_unit_test(test_solver_default),
        cmocka_unit_test(test_compile_opts),
        cmocka_unit_test(test_gradcheck_opts),
        cmocka_unit_test(test_plan_print_trace_export_opts),
        cmocka_unit_test(test_zoo_opts),
        cmocka_unit_test(test_requires_grad_at_call),
        cmocka_unit_test(test_requires_grad_subclass),
        cmocka_unit_test(test_input_errors_name_descriptors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
