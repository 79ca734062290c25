/* Saved joints (ag_joint_save / ag_joint_load, include/aotgrad/export.h): every zoo model saves,
 * loads and saves again to the same text with the same calling convention; a loaded joint
 * compiles to a callable whose outputs, gradients and buffer updates equal the original's bit
 * for bit; the hash is stable across builds and changes with shapes, ops and names; bad text is
 * refused with a message naming the line. */
#define AG_NO_SITES
#include "testutil.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* The zoo models whose last inputs are keyword arguments (as the CLI's table). */
static int zoo_nkw(const char *name) {
    return !strcmp(name, "kwargs") ? 1 : 0;
}
static const char *const kw_names[] = {"scale"};

static ag_joint *export_model(ag_module *m, ag_tensor **in, int nin, const char *name) {
    int nkw = zoo_nkw(name);
    ag_joint *j =
        ag_export_joint(m, in, nin - nkw, nkw ? kw_names : NULL, in + nin - nkw, nkw, NULL);
    if (!j)
        print_error("export %s: %s\n", name, ag_last_error());
    assert_non_null(j);
    return j;
}

static ag_joint *export_zoo(const char *name) {
    ag_module *m;
    ag_tensor *in[8];
    int nin = 0;
    assert_int_equal(ag_zoo_build(name, NULL, &m, in, 8, &nin), 0);
    ag_joint *j = export_model(m, in, nin, name);
    for (int i = 0; i < nin; i++)
        ag_tensor_free(in[i]);
    ag_module_free(m);
    return j;
}

static char *save(const ag_joint *j, size_t *len) {
    char *s = NULL;
    size_t n = 0;
    if (ag_joint_save(j, &s, &n))
        print_error("save: %s\n", ag_last_error());
    assert_non_null(s);
    assert_int_equal(strlen(s), n);
    if (len)
        *len = n;
    return s;
}

static ag_joint *load(const char *s) {
    ag_joint *j = ag_joint_load(s, strlen(s));
    if (!j)
        print_error("load: %s\n", ag_last_error());
    assert_non_null(j);
    return j;
}

static uint64_t hash(const ag_joint *j) {
    uint64_t h = 0;
    assert_int_equal(ag_joint_hash(j, &h), 0);
    return h;
}

static void assert_spec_equal(const ag_treespec *a, const ag_treespec *b) {
    char x[4096], y[4096];
    ag_treespec_repr(a, x, sizeof x);
    ag_treespec_repr(b, y, sizeof y);
    assert_string_equal(x, y);
    assert_true(ag_treespec_equal(a, b));
}

/* Every accessor of the calling convention answers the same. */
static void assert_same_convention(const ag_joint *a, const ag_joint *b) {
    assert_int_equal(ag_joint_num_params(a), ag_joint_num_params(b));
    for (int i = 0; i < ag_joint_num_params(a); i++)
        assert_string_equal(ag_joint_param_fqn(a, i), ag_joint_param_fqn(b, i));
    assert_int_equal(ag_joint_num_buffers(a), ag_joint_num_buffers(b));
    for (int i = 0; i < ag_joint_num_buffers(a); i++)
        assert_string_equal(ag_joint_buffer_fqn(a, i), ag_joint_buffer_fqn(b, i));
    assert_spec_equal(ag_joint_in_spec(a), ag_joint_in_spec(b));
    assert_spec_equal(ag_joint_out_spec(a), ag_joint_out_spec(b));
    assert_memory_equal(ag_joint_layout(a), ag_joint_layout(b), sizeof(ag_layout));
    assert_int_equal(ag_joint_num_primals(a), ag_joint_num_primals(b));
    assert_int_equal(ag_joint_num_tangents(a), ag_joint_num_tangents(b));
    assert_int_equal(ag_joint_num_user_outputs(a), ag_joint_num_user_outputs(b));
    assert_int_equal(ag_joint_num_mutated_inputs(a), ag_joint_num_mutated_inputs(b));
    assert_int_equal(ag_joint_num_metadata_mutations(a), ag_joint_num_metadata_mutations(b));
    assert_int_equal(ag_joint_num_intermediate_bases(a), ag_joint_num_intermediate_bases(b));
    assert_int_equal(ag_joint_num_fw_outputs(a), ag_joint_num_fw_outputs(b));
    assert_int_equal(ag_joint_num_forward_tokens(a), ag_joint_num_forward_tokens(b));
    assert_int_equal(ag_joint_num_backward_tokens(a), ag_joint_num_backward_tokens(b));
    assert_int_equal(ag_joint_needs_autograd(a), ag_joint_needs_autograd(b));
    assert_int_equal(ag_joint_num_static_inputs(a), ag_joint_num_static_inputs(b));
    for (int i = 0; i < ag_joint_num_static_inputs(a); i++)
        assert_int_equal(ag_joint_static_input(a, i), ag_joint_static_input(b, i));
    for (int p = 0; p < ag_joint_num_primals(a); p++)
        assert_memory_equal(ag_joint_input_info(a, p), ag_joint_input_info(b, p),
                            sizeof(ag_input_info));
    for (int k = 0; k < ag_joint_num_user_outputs(a); k++)
        assert_memory_equal(ag_joint_output_info(a, k), ag_joint_output_info(b, k),
                            sizeof(ag_output_info));
    assert_int_equal(ag_joint_num_flat_inputs(a), ag_joint_num_flat_inputs(b));
    for (int i = 0; i < ag_joint_num_flat_inputs(a); i++)
        assert_int_equal(ag_joint_flat_input_primal(a, i), ag_joint_flat_input_primal(b, i));
}

/* ---- every zoo model: save -> load -> save gives the same text ---- */

static void test_zoo_round_trip(void **st) {
    (void)st;
    int n = 0;
    for (int i = 0; i < ag_zoo_count(); i++) {
        const char *name = ag_zoo_name(i);
        ag_joint *j = export_zoo(name);
        size_t n1, n2;
        char *s1 = save(j, &n1);
        assert_true(!strncmp(s1, "aotgrad-joint 2\n", 16));
        ag_joint *l = load(s1);
        char *s2 = save(l, &n2);
        if (strcmp(s1, s2))
            print_error("%s: the loaded joint saves differently\n", name);
        assert_string_equal(s1, s2);
        assert_same_convention(j, l);
        assert_true(hash(j) == hash(l));
        /* The graph itself, printed in full, is the same. */
        ag_print_opts po = {.seq_nr = true, .stack_trace = true};
        char *g1 = ag_graph_to_string(ag_joint_graph(j), &po);
        char *g2 = ag_graph_to_string(ag_joint_graph(l), &po);
        assert_string_equal(g1, g2);
        ag_free(g1);
        ag_free(g2);
        ag_free(s1);
        ag_free(s2);
        ag_joint_free(l);
        ag_joint_free(j);
        n++;
    }
    assert_true(n >= 10);
}

/* ---- a loaded joint compiles to the same callable ---- */

/* Two builds of a model (identical weights and inputs): the original joint compiled on one, the
 * loaded joint on the other, stepped twice; outputs, gradients, buffers and the callers' inputs
 * must be equal bit for bit, and the generator must end where the original's left it. */
static void check_compiled_same(const char *name) {
    ag_module *ma, *mb;
    ag_tensor *ia[8], *ib[8];
    int na = 0, nb = 0;
    assert_int_equal(ag_zoo_build(name, NULL, &ma, ia, 8, &na), 0);
    assert_int_equal(ag_zoo_build(name, NULL, &mb, ib, 8, &nb), 0);
    ag_joint *ja = export_model(ma, ia, na, name);
    char *s = save(ja, NULL);
    ag_joint *jb = load(s);
    ag_free(s);
    ag_compiled *ca = ag_compile_joint(ja, NULL), *cb = ag_compile_joint(jb, NULL);
    if (!ca || !cb)
        print_error("%s: compile: %s\n", name, ag_last_error());
    assert_non_null(ca);
    assert_non_null(cb);
    for (int step = 0; step < 2; step++) {
        ag_scope_begin();
        ag_tensor *oa[16], *ob[16];
        uint64_t seed, off, sa, offa, sb, offb;
        ag_rng_get_state(&seed, &off);
        int ka = ag_compiled_call_module(ca, ma, ia, na, oa, 16);
        ag_rng_get_state(&sa, &offa);
        ag_rng_set_state(seed, off);
        int kb = ag_compiled_call_module(cb, mb, ib, nb, ob, 16);
        ag_rng_get_state(&sb, &offb);
        if (ka < 0 || kb < 0)
            print_error("%s: call: %s\n", name, ag_last_error());
        assert_true(ka > 0);
        assert_int_equal(ka, kb);
        assert_true(sa == sb && offa == offb);
        ag_tensor *la = NULL, *lb = NULL;
        for (int k = 0; k < ka; k++) {
            assert_true(tu_same_bits(oa[k], ob[k]));
            if (!ag_tensor_requires_grad(oa[k]))
                continue;
            ag_tensor *x = ag_sum_all(ag_mul_scalar(oa[k], 0.5 + 0.25 * k));
            ag_tensor *y = ag_sum_all(ag_mul_scalar(ob[k], 0.5 + 0.25 * k));
            la = la ? ag_add(la, x) : x;
            lb = lb ? ag_add(lb, y) : y;
        }
        if (la) {
            assert_int_equal(ag_backward(la, NULL, false), 0);
            assert_int_equal(ag_backward(lb, NULL, false), 0);
        }
        ag_named_tensors pa, pb, ba, bb;
        assert_int_equal(ag_module_named_parameters(ma, true, &pa), 0);
        assert_int_equal(ag_module_named_parameters(mb, true, &pb), 0);
        assert_int_equal(pa.n, pb.n);
        int ngrads = 0;
        for (int i = 0; i < pa.n; i++) {
            const ag_tensor *ga = ag_tensor_grad(pa.tensors[i]),
                            *gb = ag_tensor_grad(pb.tensors[i]);
            assert_true((ga == NULL) == (gb == NULL));
            if (ga) {
                assert_true(tu_same_bits((ag_tensor *)ga, (ag_tensor *)gb));
                ngrads++;
            }
        }
        assert_true(!la || ngrads > 0);
        assert_int_equal(ag_module_named_buffers(ma, true, &ba), 0);
        assert_int_equal(ag_module_named_buffers(mb, true, &bb), 0);
        for (int i = 0; i < ba.n; i++)
            assert_true(tu_max_abs_diff(ba.tensors[i], bb.tensors[i]) == 0);
        for (int i = 0; i < na; i++)
            assert_true(tu_max_abs_diff(ia[i], ib[i]) == 0);
        for (int i = 0; i < pa.n; i++) {
            assert_int_equal(ag_tensor_set_grad(pa.tensors[i], NULL), 0);
            assert_int_equal(ag_tensor_set_grad(pb.tensors[i], NULL), 0);
        }
        ag_named_tensors_free(&pa);
        ag_named_tensors_free(&pb);
        ag_named_tensors_free(&ba);
        ag_named_tensors_free(&bb);
        ag_scope_end();
    }
    ag_compiled_free(ca);
    ag_compiled_free(cb);
    ag_joint_free(ja);
    ag_joint_free(jb);
    for (int i = 0; i < na; i++)
        ag_tensor_free(ia[i]);
    for (int i = 0; i < nb; i++)
        ag_tensor_free(ib[i]);
    ag_module_free(ma);
    ag_module_free(mb);
}

static void test_compiled_two_tensor(void **st) { /* TwoTensor params, outputs, gradients */
    (void)st;
    check_compiled_same("two_tensor");
}

static void test_compiled_mlp(void **st) {
    (void)st;
    check_compiled_same("mlp");
}
static void test_compiled_cnn(void **st) { /* BatchNorm: mutated buffers */
    (void)st;
    check_compiled_same("cnn");
}
static void test_compiled_convbn(void **st) {
    (void)st;
    check_compiled_same("convbn");
}
static void test_compiled_alias_views(void **st) { /* outputs aliasing inputs, merged inputs */
    (void)st;
    check_compiled_same("alias_views");
}
static void test_compiled_dropout(void **st) { /* philox inputs */
    (void)st;
    check_compiled_same("dropout_mlp");
}
static void test_compiled_effects(void **st) { /* effect tokens */
    (void)st;
    check_compiled_same("effects");
}

/* A joint rewritten through ag_joint_update (linear's weight and bias sharded to their first
 * row) saves and loads like an exported one: the same text again, the same convention, another
 * hash than the unsharded joint's, and the same outputs from its compiled callable. */
static void test_updated_joint(void **st) {
    (void)st;
    ag_joint *j = export_zoo("linear");
    uint64_t h0 = hash(j);
    ag_graph *g = ag_graph_copy(ag_joint_graph(j));
    static const struct {
        const char *name;
        int ndim;
        int64_t sizes[2];
    } shapes[] = {{"primals_1", 2, {1, 3}}, {"primals_2", 1, {1}}, {"tangents_1", 2, {4, 1}}};
    for (int i = 0; i < 3; i++) {
        ag_tmeta m = tu_tmeta(AG_F32, shapes[i].ndim, shapes[i].sizes);
        assert_int_equal(ag_node_set_val(ag_graph_find(g, shapes[i].name), 0, &m), 0);
    }
    ag_node *view = ag_graph_find(g, "view");
    assert_non_null(view);
    assert_int_equal(ag_node_set_arg(view, 1, AG_GA_INTS((int64_t[]){1}, 1)), 0);
    assert_int_equal(ag_graph_reinfer_meta(g), 0);
    assert_int_equal(ag_joint_update(j, g), 0);
    char *s1 = save(j, NULL);
    assert_non_null(strstr(s1, "%primals_1 : f32[1, 3]"));
    ag_joint *l = load(s1);
    char *s2 = save(l, NULL);
    assert_string_equal(s1, s2);
    assert_same_convention(j, l);
    assert_true(hash(l) == hash(j));
    assert_true(hash(l) != h0);
    ag_compiled *ca = ag_compile_joint(j, NULL), *cb = ag_compile_joint(l, NULL);
    assert_non_null(ca);
    assert_non_null(cb);
    ag_scope_begin();
    ag_tensor *in[3] = {ag_ones(AG_F32, 2, (int64_t[]){1, 3}), ag_ones(AG_F32, 1, (int64_t[]){1}),
                        ag_randn(AG_F32, 2, (int64_t[]){4, 3})};
    ag_tensor *ya, *yb;
    assert_int_equal(ag_compiled_call(ca, in, 3, &ya, 1), 1);
    assert_int_equal(ag_compiled_call(cb, in, 3, &yb, 1), 1);
    assert_int_equal(ag_tensor_sizes(yb)[1], 1);
    assert_true(tu_max_abs_diff(ya, yb) == 0);
    ag_scope_end();
    ag_compiled_free(ca);
    ag_compiled_free(cb);
    ag_free(s1);
    ag_free(s2);
    ag_joint_free(l);
    ag_joint_free(j);
}

/* ---- the hash ---- */

static ag_joint *export_mlp_batch(int64_t batch) {
    ag_module *m;
    ag_tensor *in[8];
    int nin = 0;
    assert_int_equal(ag_zoo_build("mlp", NULL, &m, in, 8, &nin), 0);
    ag_tensor *x = ag_zeros(AG_F32, 2, (int64_t[]){batch, 784});
    ag_joint *j = export_model(m, &x, 1, "mlp");
    ag_tensor_free(x);
    for (int i = 0; i < nin; i++)
        ag_tensor_free(in[i]);
    ag_module_free(m);
    return j;
}

static void test_hash(void **st) {
    (void)st;
    /* The same model built twice, the same shapes: the same hash. */
    ag_joint *a = export_zoo("mlp"), *b = export_zoo("mlp");
    uint64_t ha = hash(a);
    assert_true(ha == hash(b));
    assert_true(ha == hash(a)); /* and hashing changes nothing */
    /* Another batch size: another hash. */
    ag_joint *c = export_mlp_batch(32), *d = export_mlp_batch(16);
    assert_true(hash(c) == ha); /* the zoo's batch is 32 */
    assert_true(hash(d) != ha);
    /* One relu rewritten into a gelu through the graph API. */
    ag_graph *g = ag_graph_copy(ag_joint_graph(b));
    assert_non_null(g);
    ag_node *relu = NULL;
    for (ag_node *n = ag_graph_first(g); n && !relu; n = ag_node_next(n))
        if (ag_node_kind_of(n) == AG_NODE_CALL && !strcmp(ag_op_name(ag_node_op(n)), "relu"))
            relu = n;
    assert_non_null(relu);
    ag_graph_insert_before(g, relu);
    ag_garg arg = AG_GA_N(ag_node_arg_node(relu, 0));
    ag_node *gelu = ag_graph_call(g, ag_op_find("gelu"), &arg, 1, "gelu");
    assert_non_null(gelu);
    ag_graph_insert_at_end(g);
    assert_true(ag_node_replace_all_uses(relu, gelu) > 0);
    assert_int_equal(ag_graph_erase(g, relu), 0);
    assert_int_equal(ag_joint_set_graph(b, g), 0);
    uint64_t hb = hash(b);
    assert_true(hb != ha);
    /* ... and the loaded copy of the rewritten joint hashes as it. */
    char *s = save(b, NULL);
    assert_non_null(strstr(s, "= gelu("));
    ag_joint *l = load(s);
    assert_true(hash(l) == hb);
    ag_joint_free(l);
    ag_free(s);
    /* Another parameter name (in params_spec and the descriptors): another hash. */
    s = save(a, NULL);
    for (char *p = s; (p = strstr(p, "'fc1.weight'")) != NULL;)
        memcpy(p, "'fc1.weigh2'", 12);
    ag_joint *r = load(s);
    assert_string_equal(ag_joint_param_fqn(r, 0), "fc1.weigh2");
    assert_true(hash(r) != ha);
    /* Stack traces do not count: the same joint with its traces removed hashes the same. */
    ag_graph *nt = ag_graph_copy(ag_joint_graph(a));
    int ntraces = 0;
    for (ag_node *n = ag_graph_first(nt); n; n = ag_node_next(n))
        if (ag_node_stack_trace(n)) {
            ntraces++;
            assert_true(ag_node_meta_del(n, "stack_trace") >= 0);
        }
    assert_true(ntraces > 0);
    assert_int_equal(ag_joint_set_graph(r, NULL), AG_EINVAL); /* (r keeps its graph) */
    ag_joint *e = export_zoo("mlp");
    assert_int_equal(ag_joint_set_graph(e, nt), 0);
    assert_true(hash(e) == ha);
    char *se = save(e, NULL), *sa = save(a, NULL);
    assert_string_not_equal(se, sa); /* (the saved texts differ by the traces) */
    ag_free(se);
    ag_free(sa);
    ag_free(s);
    ag_joint_free(e);
    ag_joint_free(r);
    ag_joint_free(a);
    ag_joint_free(b);
    ag_joint_free(c);
    ag_joint_free(d);
}

/* ---- files ---- */

static void test_files(void **st) {
    (void)st;
    char path[64], dir[64];
    snprintf(path, sizeof path, "/tmp/ag_joint_io_%d.joint", (int)getpid());
    snprintf(dir, sizeof dir, "/tmp/ag_joint_io_%d_missing/x.joint", (int)getpid());
    ag_joint *j = export_zoo("convbn");
    assert_int_equal(ag_joint_save_file(j, path), 0);
    ag_joint *l = ag_joint_load_file(path);
    assert_non_null(l);
    char *a = save(j, NULL), *b = save(l, NULL);
    assert_string_equal(a, b);
    /* Writing where no directory is: AG_EIO naming the path. */
    assert_int_equal(ag_joint_save_file(j, dir), AG_EIO);
    tu_assert_error_contains("joint_save_file: cannot create /tmp/ag_joint_io_");
    /* A missing file names its path. */
    assert_null(ag_joint_load_file(dir));
    assert_int_equal(ag_last_status(), AG_EIO);
    tu_assert_error_contains("joint_load_file: cannot open /tmp/ag_joint_io_");
    tu_assert_error_contains("_missing/x.joint: No such file or directory");
    /* A truncated file names the file and the line. */
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    fwrite(a, 1, 200, f);
    fclose(f);
    assert_null(ag_joint_load_file(path));
    char want[128];
    snprintf(want, sizeof want, "joint_load_file: %s: line ", path);
    tu_assert_error_contains(want);
    remove(path);
    ag_free(a);
    ag_free(b);
    ag_joint_free(l);
    ag_joint_free(j);
}

/* ---- errors name the line ---- */

/* text with `from` replaced by `to` (once), malloc'd. */
static char *replaced(const char *text, const char *from, const char *to) {
    const char *at = strstr(text, from);
    if (!at)
        print_error("'%s' not in the text\n", from);
    assert_non_null(at);
    size_t n = strlen(text) - strlen(from) + strlen(to);
    char *s = malloc(n + 1);
    assert_non_null(s);
    size_t k = (size_t)(at - text);
    memcpy(s, text, k);
    memcpy(s + k, to, strlen(to));
    strcpy(s + k + strlen(to), at + strlen(from));
    return s;
}

/* The saved text of linear with `from` replaced by `to` (once): load must fail with AG_EFORMAT
 * and a message containing want. */
static void expect_refused(const char *text, const char *from, const char *to, const char *want) {
    char *s = replaced(text, from, to);
    ag_clear_error();
    ag_joint *j = ag_joint_load(s, strlen(s));
    if (j)
        print_error("loaded with '%s' -> '%s'\n", from, to);
    assert_null(j);
    assert_int_equal(ag_last_status(), AG_EFORMAT);
    if (!strstr(ag_last_error(), want))
        print_error("message '%s' lacks '%s'\n", ag_last_error(), want);
    tu_assert_error_contains(want);
    free(s);
}

/* The two_tensor joint's subclass lines, as docs/JOINT_FORMAT.md shows them; the hash covers
 * them; edited lines are refused naming the line. */
static void test_subclass_text(void **st) {
    (void)st;
    ag_joint *j = export_zoo("two_tensor");
    char *s = save(j, NULL);
    const char *want =
        "metadata_mutations: 0\n"
        "intermediate_bases: 0\n"
        "subclass_inputs: 3\n"
        "  0 TwoTensor(f32[2, 3]{3, 1}+0; a=f32[2, 3]{3, 1}+0, b=f32[2, 3]{3, 1}+0)\n"
        "  1 TwoTensor(f32[2]{1}+0; a=f32[2]{1}+0, b=f32[2]{1}+0)\n"
        "  2 plain f32[4, 3]{3, 1}+0\n"
        "subclass_grads: 3\n"
        "  0 TwoTensor(f32[2, 3]{3, 1}+0; a=f32[2, 3]{3, 1}+0, b=f32[2, 3]{3, 1}+0)\n"
        "  1 TwoTensor(f32[2]{1}+0; a=f32[2]{1}+0, b=f32[2]{1}+0)\n"
        "  2 plain f32[]{}+0\n"
        "subclass_outputs: 1\n"
        "  0 TwoTensor(f32[4, 2]{2, 1}+0; a=f32[4, 2]{2, 1}+0, b=f32[4, 2]{2, 1}+0)\n"
        "graph():\n";
    if (!strstr(s, want))
        print_error("got:\n%s\n", s);
    assert_non_null(strstr(s, want));
    ag_joint *l = load(s);
    assert_true(hash(l) == hash(j));
    /* Another structure (a gradient's geometry) that still loads: another hash. */
    char *t = replaced(s, "  2 plain f32[]{}+0\n", "  2 plain f32[4, 3]{3, 1}+0\n");
    ag_joint *m = load(t);
    assert_true(hash(m) != hash(j));
    ag_joint_free(m);
    free(t);
    /* subclass_inputs is line 30. */
    expect_refused(s, "  0 TwoTensor(f32[2, 3]", "  0 FooTensor(f32[2, 3]",
                   "joint_load: line 31: no tensor subclass type 'FooTensor' is registered");
    expect_refused(s, "; a=f32[2, 3]{3, 1}+0, b=", "; x=f32[2, 3]{3, 1}+0, b=",
                   "joint_load: line 31: expected '; a=' (inner tensor 0 of TwoTensor)");
    expect_refused(s, "  2 plain f32[4, 3]{3, 1}+0\nsubclass_grads",
                   "  2 TwoTensor(f32[4, 3]{3, 1}+0; a=f32[4, 3]{3, 1}+0, b=f32[4, 3]{3, 1}+0)"
                   "\nsubclass_grads",
                   "joint_load: line 30: the subclass inputs flatten into 6 tensors; "
                   "flat_inputs lists 5");
    expect_refused(s, "  0 TwoTensor(f32[2, 3]{3, 1}+0; a=f32[2, 3]{3, 1}+0",
                   "  0 TwoTensor(f32[2, 3]{3, 1}+0; a=f32[3, 2]{2, 1}+0",
                   "joint_load: line 31: input 0's plain tensor 0 (flat input 0) has another "
                   "dtype or sizes than the graph's primal");
    expect_refused(s, "  0 TwoTensor(f32[4, 2]{2, 1}+0; a=f32[4, 2]{2, 1}+0, b=f32[4, 2]{2, 1}+0)",
                   "  0 TwoTensor(f32[4, 2]{2, 1}+0; a=f32[4, 2]{2, 1}+0, b=i64[4, 2]{2, 1}+0)",
                   "joint_load: line 39: output 0's plain tensor 1 (user output 1) has another "
                   "dtype or sizes than the graph's output");
    expect_refused(s, "  2 plain f32[]{}+0\n",
                   "  2 TwoTensor(f32[]{}+0; a=f32[]{}+0, b=f32[]{}+0)\n",
                   "joint_load: line 37: gradient 2 is a TwoTensor; its input is a plain tensor");
    expect_refused(s, "subclass_grads: 3\n", "subclass_grads: 2\n",
                   "joint_load: line 34: subclass_grads lists 2 gradients; subclass_inputs "
                   "lists 3 inputs");
    expect_refused(s, "subclass_outputs: 1\n", "subclass_outputs: 2\n",
                   "joint_load: line 40: expected subclass output 1 ('  1 ...'), got 'graph():'");
    expect_refused(s,
                   "subclass_outputs: 1\n  0 TwoTensor(f32[4, 2]{2, 1}+0; a=f32[4, 2]{2, 1}+0, "
                   "b=f32[4, 2]{2, 1}+0)\n",
                   "subclass_outputs: 0\n",
                   "joint_load: line 5: out_spec has 1 leaves; subclass_outputs lists 0");
    expect_refused(s, "  2 plain f32[4, 3]{3, 1}+0\n", "  2 f32[4, 3]{3, 1}+0\n",
                   "joint_load: line 33: expected 'plain GEOM' or a tensor subclass");
    expect_refused(s, "b=f32[2]{1}+0)\n  2 plain f32[4", "b=f32[2]{1}+0\n  2 plain f32[4",
                   "joint_load: line 32: expected ')'");
    ag_joint_free(l);
    ag_free(s);
    ag_joint_free(j);
}

static void test_load_errors(void **st) {
    (void)st;
    ag_joint *j = export_zoo("linear");
    char *s = save(j, NULL);
    expect_refused(
        s, "aotgrad-joint 2", "aotgrad-graph 2",
        "joint_load: line 1: expected the header 'aotgrad-joint 2', got 'aotgrad-graph 2'");
    expect_refused(s, "aotgrad-joint 2", "aotgrad-joint 3",
                   "joint_load: line 1: format version 3; this aotgrad reads versions 1 to 2");
    expect_refused(s, "aotgrad-joint 2", "aotgrad-joint 0",
                   "joint_load: line 1: format version 0; this aotgrad reads versions 1 to 2");
    expect_refused(s, "params_spec: [", "params_spec: (",
                   "joint_load: line 2: expected a list of names '['");
    expect_refused(s, "'linear.bias']", "'linear.bias]",
                   "joint_load: line 2: expected a Python string literal");
    expect_refused(s, "in_spec: TreeSpec(tuple", "in_spec: TreeSpec(set",
                   "joint_load: line 4: expected a treespec type");
    expect_refused(s, "out_spec: *", "out_spec: TreeSpec(tuple, None, [*, *])",
                   "joint_load: line 5: out_spec has 2 leaves; output_info lists 1");
    expect_refused(s, "needs_autograd: True", "needs_autograd: yes",
                   "joint_load: line 6: expected True or False");
    /* input info for 4 primals when the graph has 3 */
    char *four = replaced(s, "input_info: 3\n", "input_info: 4\n");
    expect_refused(four, "  2 mutates_data=False mutates_metadata=False requires_grad=False\n",
                   "  2 mutates_data=False mutates_metadata=False requires_grad=False\n"
                   "  3 mutates_data=False mutates_metadata=False requires_grad=False\n",
                   "joint_load: line 7: input_info lists 4 primals; the graph has 3 (0 forward "
                   "tokens and 3 primals)");
    /* an entry missing */
    expect_refused(four, "output_info: 1", "output_info: 1",
                   "joint_load: line 11: expected input 3 ('  3 ...'), got 'output_info: 1'");
    free(four);
    expect_refused(s, "  2 mutates_data=False mutates_metadata=False requires_grad=False\n",
                   "  2 mutates_data=False mutates_metadata=False requires_grad=False\n"
                   "  3 mutates_data=False mutates_metadata=False requires_grad=False\n",
                   "expected 'output_info: '");
    char *two = replaced(s, "input_info: 3\n", "input_info: 2\n");
    expect_refused(two, "  2 mutates_data=False mutates_metadata=False requires_grad=False\n", "",
                   "joint_load: line 7: input_info lists 2 primals; the graph has 3 (0 forward "
                   "tokens and 3 primals)");
    free(two);
    expect_refused(s, "  0 mutates_data=False", "  0 mutates_data=True",
                   "joint_load: line 7: input_info says 1 primals are mutated; the graph has 0");
    expect_refused(s, "alias=non_alias", "alias=aliased",
                   "joint_load: line 12: expected 'alias=' and an output alias kind");
    expect_refused(s, "alias=non_alias base_index=-1", "alias=is_input base_index=3",
                   "joint_load: line 12: output 0 (is_input): base_index 3 out of range [0, 3)");
    expect_refused(s, "  0 kind=primal primal=0", "  0 kind=primal primal=9",
                   "joint_load: line 14: flat input 0: primal 9 out of range [0, 3)");
    expect_refused(s, "  1 kind=primal primal=1 dup_of=-1", "  1 kind=dup primal=1 dup_of=1",
                   "joint_load: line 15: flat input 1: dup_of 1 is not an earlier flat input");
    expect_refused(s, "  0 base=none flat=0 new_geom=f32[]{}+0",
                   "  0 base=none flat=0 new_geom=f33[]{}+0",
                   "joint_load: line 18: expected ' new_geom=VALUE'");
    expect_refused(s, "  0 base=none flat=0", "  0 base=none flat=7",
                   "joint_load: line 18: primal 0: flat input 7 out of range [0, 3)");
    expect_refused(s, "metadata_mutations: 0", "metadata_mutations: 1",
                   "joint_load: line 21: 1 metadata mutations; the graph has 0");
    /* The graph's own errors, renumbered to the whole text. */
    expect_refused(s, "= t(%primals_1)", "= tt(%primals_1)", "joint_load: line 28:");
    expect_refused(s, "= t(%primals_1)", "= tt(%primals_1)", "unknown op 'tt'");
    /* The graph's layout (read from its descriptors) must hold. */
    expect_refused(s, "  # TangentAOTInput(output=PlainAOTOutput(idx=0))  is_backward",
                   "  # None  is_backward",
                   "joint_load: the graph (from line 23): layout: placeholder 3 (tangents_1) has "
                   "no descriptor");
    /* Truncated: the graph stops short. */
    size_t n = strlen(s);
    for (size_t cut = 0; cut < n; cut += n / 37 + 1) {
        ag_clear_error();
        ag_joint *l = ag_joint_load(s, cut);
        assert_null(l);
        assert_int_equal(ag_last_status(), AG_EFORMAT);
        tu_assert_error_contains("joint_load: ");
        tu_assert_error_contains("line ");
    }
    assert_null(ag_joint_load("", 0));
    tu_assert_error_contains("joint_load: line 1: expected the header 'aotgrad-joint 2', got "
                             "end of input");
    ag_free(s);
    ag_joint_free(j);
}

/* The saved form of the linear model, as the format's documentation shows it. */
static void test_text_of_linear(void **st) {
    (void)st;
    ag_joint *j = export_zoo("linear");
    char *s = save(j, NULL);
    const char *head = "aotgrad-joint 2\n"
                       "params_spec: ['linear.weight', 'linear.bias']\n"
                       "buffers_spec: []\n"
                       "in_spec: TreeSpec(tuple, None, [TreeSpec(list, None, [*, *, *]), "
                       "TreeSpec(dict, [], [])])\n"
                       "out_spec: *\n"
                       "needs_autograd: True\n"
                       "input_info: 3\n"
                       "  0 mutates_data=False mutates_metadata=False requires_grad=True\n"
                       "  1 mutates_data=False mutates_metadata=False requires_grad=True\n"
                       "  2 mutates_data=False mutates_metadata=False requires_grad=False\n"
                       "output_info: 1\n"
                       "  0 alias=non_alias base_index=-1 requires_grad=True geom=f32[]{}+0\n"
                       "flat_inputs: 3\n";
    if (strncmp(s, head, strlen(head)))
        print_error("%s\n", s);
    assert_true(!strncmp(s, head, strlen(head)));
    assert_non_null(strstr(s, "intermediate_bases: 0\ngraph():\n    %primals_1 : f32[2, 3]  # "
                              "ParamAOTInput(target='linear.weight')"));
    ag_free(s);
    ag_joint_free(j);
}

/* Compiles l and calls it on alias_views' module and inputs: it may fail, never crash. */
static void try_alias_views(const ag_joint *l) {
    ag_module *m;
    ag_tensor *in[8], *out[16];
    int nin = 0;
    assert_int_equal(ag_zoo_build("alias_views", NULL, &m, in, 8, &nin), 0);
    ag_compiled *c = ag_compile_joint(l, NULL);
    ag_scope_begin();
    if (c)
        ag_compiled_call_module(c, m, in, nin, out, 16);
    ag_scope_end();
    ag_compiled_free(c);
    for (int i = 0; i < nin; i++)
        ag_tensor_free(in[i]);
    ag_module_free(m);
}

/* Hostile text: every byte of the header (and a sample of the graph's) replaced by a few
 * others; each text loads or is refused with AG_EFORMAT, never crashes or leaks; a joint that
 * loads saves again to text that loads, and compiles and runs or fails cleanly. */
static void test_load_mutations(void **st) {
    (void)st;
    ag_joint *j = export_zoo("alias_views");
    char *s = NULL;
    size_t n = 0;
    assert_int_equal(ag_joint_save(j, &s, &n), 0);
    const char *graph = strstr(s, "graph():");
    assert_non_null(graph);
    size_t head = n - strlen(graph);
    static const char subst[] = {'0', '9', '-', ' ', '\n', 'x', '[', '\''};
    int loaded = 0, refused = 0;
    for (size_t i = 0; i < n; i += i < head ? 1 : 7) {
        for (size_t k = 0; k < sizeof subst; k++) {
            if (s[i] == subst[k])
                continue;
            char c = s[i];
            s[i] = subst[k];
            ag_clear_error();
            ag_joint *l = ag_joint_load(s, n);
            if (l) {
                loaded++;
                try_alias_views(l);
                char *t = save(l, NULL);
                ag_joint *l2 = load(t);
                ag_joint_free(l2);
                ag_free(t);
                ag_joint_free(l);
            } else {
                refused++;
                if (ag_last_status() != AG_EFORMAT)
                    print_error("byte %zu -> '%c': status %d: %s\n", i, subst[k], ag_last_status(),
                                ag_last_error());
                assert_int_equal(ag_last_status(), AG_EFORMAT);
            }
            s[i] = c;
        }
    }
    assert_true(refused > 1000);
    assert_true(loaded > 0);
    ag_free(s);
    ag_joint_free(j);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_text_of_linear),
        cmocka_unit_test(test_zoo_round_trip),
        cmocka_unit_test(test_compiled_mlp),
        cmocka_unit_test(test_compiled_two_tensor),
        cmocka_unit_test(test_subclass_text),
        cmocka_unit_test(test_compiled_cnn),
        cmocka_unit_test(test_compiled_convbn),
        cmocka_unit_test(test_compiled_alias_views),
        cmocka_unit_test(test_compiled_dropout),
        cmocka_unit_test(test_compiled_effects),
        cmocka_unit_test(test_updated_joint),
        cmocka_unit_test(test_hash),
        cmocka_unit_test(test_files),
        cmocka_unit_test(test_load_errors),
        cmocka_unit_test(test_load_mutations),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
