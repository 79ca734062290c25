/* The joint's record of its flat inputs' descriptors (ag_joint_flat_input_desc,
 * include/aotgrad/export.h): exactly upstream's calling convention (parameters, buffers, then
 * the user's args and kwargs values, a tensor subclass instance flattened into its inner
 * tensors) for a module that has all of them, the static inputs read from it, kept by
 * ag_joint_update, saved and loaded (format 2), and derived once when a version 1 file (the
 * format without them, made here by stripping the field from the saved text) is loaded. */
#define AG_NO_SITES
#include "testutil.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define F32 AG_F32
#define SZ(...) ((int64_t[]){__VA_ARGS__})

static const char *repr(const ag_desc *d) {
    static char buf[8][512];
    static int k;
    char *b = buf[k++ % 8];
    if (!d)
        return "(null)";
    ag_desc_repr(d, b, 512);
    return b;
}

/* (x * w, y * v + b * s): a TwoTensor parameter w, a plain parameter v, a plain buffer b, a
 * TwoTensor arg x, a plain arg y and a plain keyword argument s (two outputs, so that v's
 * gradient stays plain). */
static int mixed_fwd(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)nin, (void)max_out;
    ag_scope_begin();
    out[0] = ag_tensor_keep(ag_mul(in[0], ag_module_param(m, "w")));
    ag_tensor *yv = ag_mul(in[1], ag_module_param(m, "v"));
    out[1] = ag_tensor_keep(ag_add(yv, ag_mul(ag_module_buffer(m, "b"), in[2])));
    ag_scope_end();
    return out[0] && out[1] ? 2 : ag_last_status();
}

static ag_tensor *two(uint64_t *seed) {
    ag_tensor *a = tu_rand_tensor(F32, 2, SZ(2, 3), -1, 1, tu_xorshift, seed);
    ag_tensor *b = tu_rand_tensor(F32, 2, SZ(2, 3), -1, 1, tu_xorshift, seed);
    ag_tensor *t = ag_two_tensor(a, b);
    ag_tensor_free(a);
    ag_tensor_free(b);
    return t;
}

static ag_joint *export_mixed(void) {
    uint64_t seed = 7;
    ag_module *m = ag_module_new("Mixed", mixed_fwd, NULL, NULL);
    ag_tensor *w = two(&seed), *v = tu_rand_tensor(F32, 2, SZ(2, 3), -1, 1, tu_xorshift, &seed);
    ag_tensor *b = tu_rand_tensor(F32, 2, SZ(2, 3), -1, 1, tu_xorshift, &seed);
    assert_int_equal(ag_module_register_parameter(m, "w", w), 0);
    assert_int_equal(ag_module_register_parameter(m, "v", v), 0);
    assert_int_equal(ag_module_register_buffer(m, "b", b, true), 0);
    ag_tensor *x = two(&seed), *y = tu_rand_tensor(F32, 2, SZ(2, 3), -1, 1, tu_xorshift, &seed);
    ag_tensor *s = tu_rand_tensor(F32, 2, SZ(2, 3), -1, 1, tu_xorshift, &seed);
    ag_tensor_set_requires_grad(x, true);
    const char *kw[] = {"s"};
    ag_joint *j = ag_export_joint(m, (ag_tensor *[]){x, y}, 2, kw, &s, 1, NULL);
    if (!j)
        fail_msg("export: %s", ag_last_error());
    ag_tensor *all[] = {w, v, b, x, y, s};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        ag_tensor_free(all[i]);
    ag_module_free(m);
    return j;
}

static const char *const mixed_want[] = {
    "SubclassGetAttrAOTInput(base=ParamAOTInput(target='w'), attr='a')",
    "SubclassGetAttrAOTInput(base=ParamAOTInput(target='w'), attr='b')",
    "ParamAOTInput(target='v')",
    "BufferAOTInput(target='b')",
    "SubclassGetAttrAOTInput(base=PlainAOTInput(idx=0), attr='a')",
    "SubclassGetAttrAOTInput(base=PlainAOTInput(idx=0), attr='b')",
    "PlainAOTInput(idx=1)",
    "PlainAOTInput(idx=2)",
};
#define NMIXED ((int)(sizeof mixed_want / sizeof *mixed_want))

static void expect_flat_descs(const ag_joint *j, const char *const *want, int n) {
    if (ag_joint_num_flat_inputs(j) != n)
        fail_msg("%d flat inputs, expected %d", ag_joint_num_flat_inputs(j), n);
    for (int i = 0; i < n; i++)
        if (strcmp(repr(ag_joint_flat_input_desc(j, i)), want[i]))
            fail_msg("flat input %d: %s, expected %s", i, repr(ag_joint_flat_input_desc(j, i)),
                     want[i]);
}

/* The descriptors of a and b's flat inputs print the same. */
static void expect_same_flat_descs(const ag_joint *a, const ag_joint *b) {
    assert_int_equal(ag_joint_num_flat_inputs(a), ag_joint_num_flat_inputs(b));
    for (int i = 0; i < ag_joint_num_flat_inputs(a); i++) {
        assert_non_null(ag_joint_flat_input_desc(a, i));
        assert_string_equal(repr(ag_joint_flat_input_desc(a, i)),
                            repr(ag_joint_flat_input_desc(b, i)));
    }
}

/* ---- the record ---- */

static void test_mixed_structure(void **st) {
    (void)st;
    ag_joint *j = export_mixed();
    expect_flat_descs(j, mixed_want, NMIXED);
    assert_null(ag_joint_flat_input_desc(j, NMIXED));
    assert_null(ag_joint_flat_input_desc(j, -1));
    assert_null(ag_joint_flat_input_desc(NULL, 0));
    /* No input is deduplicated or merged: flat input i is primal i, and its placeholder
     * carries the same descriptor. */
    ag_node **ph;
    assert_true(ag_graph_placeholders(ag_joint_graph(j), &ph) >= NMIXED);
    for (int i = 0; i < NMIXED; i++) {
        assert_int_equal(ag_joint_flat_input_primal(j, i), i);
        assert_string_equal(repr(ag_node_desc(ph[i])), mixed_want[i]);
    }
    /* Static inputs: the parameters' and buffers' primals, inner tensors included. */
    assert_int_equal(ag_joint_num_static_inputs(j), 4);
    for (int i = 0; i < 4; i++)
        assert_int_equal(ag_joint_static_input(j, i), i);
    /* The compiled callable's input errors name the input by the record and its position:
     * outer input 3 is x, the TwoTensor; flat input 6 is y. */
    ag_compiled *c = ag_compile_joint(j, NULL);
    assert_non_null(c);
    uint64_t seed = 9;
    ag_tensor *w = two(&seed), *x = two(&seed), *p[4], *out[2];
    for (int i = 0; i < 4; i++)
        p[i] = ag_zeros(F32, 2, SZ(2, 3));
    ag_tensor *y64 = ag_zeros(AG_F64, 2, SZ(2, 3));
    ag_scope_begin(); /* (the outputs are the scope's) */
    assert_int_equal(
        ag_compiled_call(c, (ag_tensor *[]){w, p[0], p[1], p[2], p[3], p[0]}, 6, out, 2),
        AG_EINVAL);
    tu_assert_error_contains(
        "compiled: PlainAOTInput(idx=0) (input 3) is a plain tensor; expected a TwoTensor");
    assert_int_equal(ag_compiled_call(c, (ag_tensor *[]){w, p[0], p[1], x, y64, p[0]}, 6, out, 2),
                     AG_EINVAL);
    tu_assert_error_contains("compiled: PlainAOTInput(idx=1) (flat input 6) is f64[2, 3]; the "
                             "graph was exported for f32[2, 3]");
    assert_int_equal(ag_compiled_call(c, (ag_tensor *[]){w, p[0], p[1], x, p[2], p[3]}, 6, out, 2),
                     2);
    ag_scope_end();
    ag_tensor_free(w);
    ag_tensor_free(x);
    ag_tensor_free(y64);
    for (int i = 0; i < 4; i++)
        ag_tensor_free(p[i]);
    ag_compiled_free(c);
    /* An update with the same inputs keeps the record. */
    ag_joint *k = export_mixed();
    assert_int_equal(ag_joint_update(k, ag_graph_copy(ag_joint_graph(k))), 0);
    expect_flat_descs(k, mixed_want, NMIXED);
    ag_joint_free(k);
    ag_joint_free(j);
}

/* A plain module: params, buffers (convbn: BatchNorm's), then the user inputs. */
static void test_zoo_structure(void **st) {
    (void)st;
    ag_module *m;
    ag_tensor *in[8];
    int nin = 0;
    assert_int_equal(ag_zoo_build("convbn", NULL, &m, in, 8, &nin), 0);
    assert_int_equal(nin, 1);
    ag_joint *j = ag_export_joint(m, in, nin, NULL, NULL, 0, NULL);
    assert_non_null(j);
    expect_flat_descs(
        j,
        (const char *const[]){
            "ParamAOTInput(target='conv.weight')", "ParamAOTInput(target='conv.bias')",
            "ParamAOTInput(target='bn.weight')", "ParamAOTInput(target='bn.bias')",
            "BufferAOTInput(target='bn.running_mean')", "BufferAOTInput(target='bn.running_var')",
            "BufferAOTInput(target='bn.num_batches_tracked')", "PlainAOTInput(idx=0)"},
        8);
    assert_int_equal(ag_joint_num_static_inputs(j), 7);
    ag_joint_free(j);
    ag_tensor_free(in[0]);
    ag_module_free(m);
}

/* ---- saved joints ---- */

static char *save(const ag_joint *j) {
    char *s = NULL;
    if (ag_joint_save(j, &s, NULL))
        fail_msg("save: %s", ag_last_error());
    return s;
}

static ag_joint *load(const char *s) {
    ag_joint *j = ag_joint_load(s, strlen(s));
    if (!j)
        fail_msg("load: %s", ag_last_error());
    return j;
}

/* s with its first occurrence of `from` replaced by `to` (malloc'd). */
static char *replaced(const char *s, const char *from, const char *to) {
    const char *at = strstr(s, from);
    if (!at)
        fail_msg("'%s' is not in the text", from);
    size_t n = strlen(s) - strlen(from) + strlen(to);
    char *r = malloc(n + 1);
    assert_non_null(r);
    size_t k = (size_t)(at - s);
    memcpy(r, s, k);
    strcpy(r + k, to);
    strcat(r, at + strlen(from));
    return r;
}

/* The line number of "flat_inputs: N" in saved text s. */
static int flat_inputs_line(const char *s) {
    int line = 1;
    for (const char *p = s; p; line++) {
        if (!strncmp(p, "flat_inputs: ", 13))
            return line;
        p = strchr(p, '\n');
        p = p ? p + 1 : NULL;
    }
    fail_msg("no flat_inputs line");
    return -1;
}

/* The version 1 text of a saved joint: the header says 1 and every " desc=..." field (the end
 * of a flat_inputs line) is cut. */
static char *as_version1(const char *s) {
    char *r = replaced(s, "aotgrad-joint 2\n", "aotgrad-joint 1\n");
    int cut = 0;
    for (char *p; (p = strstr(r, " desc=")) != NULL; cut++) {
        char *eol = strchr(p, '\n');
        assert_non_null(eol);
        memmove(p, eol, strlen(eol) + 1);
    }
    assert_true(cut > 0);
    return r;
}

static void test_save_load(void **st) {
    (void)st;
    ag_joint *j = export_mixed();
    char *s = save(j);
    assert_true(!strncmp(s, "aotgrad-joint 2\n", 16));
    assert_non_null(strstr(s, "\nflat_inputs: 8\n  0 kind=primal primal=0 dup_of=-1 "));
    assert_non_null(strstr(s, " desc=SubclassGetAttrAOTInput(base=ParamAOTInput(target='w'), "
                              "attr='a')\n  1 kind=primal"));
    assert_non_null(strstr(s, " desc=PlainAOTInput(idx=2)\nprimal_sources: "));
    ag_joint *l = load(s);
    expect_flat_descs(l, mixed_want, NMIXED);
    assert_int_equal(ag_joint_num_static_inputs(l), 4);
    char *s2 = save(l);
    assert_string_equal(s, s2);
    ag_free(s2);
    ag_joint_free(l);
    ag_free(s);
    ag_joint_free(j);
}

/* Version 1 files load: the descriptors are derived from params_spec, buffers_spec and the
 * subclass lines, and the joint saves as the export's. */
static void test_version1_loads(void **st) {
    (void)st;
    ag_joint *joints[4] = {export_mixed()};
    const char *zoo[] = {"convbn", "kwargs", "alias_views"};
    ag_module *mods[3];
    for (int z = 0; z < 3; z++) {
        ag_tensor *in[8];
        int nin = 0, nkw = !strcmp(zoo[z], "kwargs");
        assert_int_equal(ag_zoo_build(zoo[z], NULL, &mods[z], in, 8, &nin), 0);
        const char *kw[] = {"scale"};
        joints[1 + z] =
            ag_export_joint(mods[z], in, nin - nkw, nkw ? kw : NULL, in + nin - nkw, nkw, NULL);
        assert_non_null(joints[1 + z]);
        for (int i = 0; i < nin; i++)
            ag_tensor_free(in[i]);
    }
    for (int k = 0; k < 4; k++) {
        char *s = save(joints[k]), *old = as_version1(s);
        assert_null(strstr(old, "desc="));
        ag_joint *l = load(old);
        expect_same_flat_descs(joints[k], l);
        assert_int_equal(ag_joint_num_static_inputs(l), ag_joint_num_static_inputs(joints[k]));
        for (int i = 0; i < ag_joint_num_static_inputs(l); i++)
            assert_int_equal(ag_joint_static_input(l, i), ag_joint_static_input(joints[k], i));
        char *s2 = save(l); /* saved again: version 2, the export's text */
        assert_string_equal(s, s2);
        ag_free(s2);
        ag_joint_free(l);
        free(old);
        ag_free(s);
    }
    /* A version 1 file whose params_spec does not name its placeholders' parameters is
     * refused, naming the flat_inputs line. */
    char *s = save(joints[1]), *old = as_version1(s);
    char *bad = replaced(old, "params_spec: ['conv.weight'", "params_spec: ['conv.weight2'");
    assert_null(ag_joint_load(bad, strlen(bad)));
    assert_int_equal(ag_last_status(), AG_EFORMAT);
    char want[512];
    snprintf(want, sizeof want,
             "joint_load: line %d: flat input 0 is ParamAOTInput(target='conv.weight2') (by "
             "params_spec and buffers_spec); its primal primals_1 is "
             "ParamAOTInput(target='conv.weight')",
             flat_inputs_line(old));
    tu_assert_error_contains(want);
    free(bad);
    free(old);
    ag_free(s);
    for (int k = 0; k < 4; k++)
        ag_joint_free(joints[k]);
    for (int z = 0; z < 3; z++)
        ag_module_free(mods[z]);
}

static void test_version2_errors(void **st) {
    (void)st;
    ag_joint *j = export_mixed();
    char *s = save(j);
    int line = flat_inputs_line(s);
    char want[512];
    /* A descriptor that is not its placeholder's. */
    char *bad = replaced(s, "desc=ParamAOTInput(target='v')", "desc=BufferAOTInput(target='v')");
    assert_null(ag_joint_load(bad, strlen(bad)));
    assert_int_equal(ag_last_status(), AG_EFORMAT);
    snprintf(want, sizeof want,
             "joint_load: line %d: flat input 2 is BufferAOTInput(target='v'); its primal "
             "primals_3 is ParamAOTInput(target='v')",
             line + 3);
    tu_assert_error_contains(want);
    free(bad);
    /* Not a descriptor. */
    bad = replaced(s, "desc=PlainAOTInput(idx=1)", "desc=PlainAOTInput(idx=one)");
    assert_null(ag_joint_load(bad, strlen(bad)));
    assert_int_equal(ag_last_status(), AG_EFORMAT);
    snprintf(want, sizeof want, "joint_load: line %d: bad descriptor: ", line + 7);
    tu_assert_error_contains(want);
    free(bad);
    /* Missing in a version 2 file. */
    bad = replaced(s, " desc=PlainAOTInput(idx=1)", "");
    assert_null(ag_joint_load(bad, strlen(bad)));
    snprintf(want, sizeof want,
             "joint_load: line %d: expected ' desc=' and the flat input's descriptor", line + 7);
    tu_assert_error_contains(want);
    free(bad);
    ag_free(s);
    ag_joint_free(j);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_mixed_structure), cmocka_unit_test(test_zoo_structure),
        cmocka_unit_test(test_save_load),       cmocka_unit_test(test_version1_loads),
        cmocka_unit_test(test_version2_errors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
