/* Nested compile regions (ag_nested_compile_region, ag_module_set_compile_region). */
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static ag_mval str(const char *s) {
    return (ag_mval){.kind = AG_MV_STR, .u.s = s};
}

/* ---- upstream test 23's model ---- */

static int bar_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)m;
    (void)nin;
    (void)max_out;
    ag_scope_begin();
    ag_annotate_begin("mod_name", str("bar"));
    ag_tensor *y = ag_sin(in[0]);
    out[0] = ag_tensor_keep(ag_mul_scalar(y, 1.0));
    ag_annotate_end();
    ag_scope_end();
    return out[0] ? 1 : ag_last_status();
}

static int mymod_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out,
                         int max_out) {
    (void)nin;
    (void)max_out;
    ag_module *bar = ag_module_child(m, "bar");
    ag_scope_begin();
    ag_annotate_begin("mod_name", str("my_mod"));
    ag_tensor *z = ag_module_forward(bar, in[0]);
    ag_annotate_end();
    out[0] = ag_tensor_keep(ag_sub_scalar(z, 1.0));
    ag_scope_end();
    return out[0] ? 1 : ag_last_status();
}

static ag_module *mymod_new(bool region) {
    ag_module *m = ag_module_new("MyMod", mymod_forward, NULL, NULL);
    ag_module *bar = ag_module_new("Bar", bar_forward, NULL, NULL);
    assert_int_equal(ag_module_add_child(m, "bar", bar), 0);
    assert_int_equal(ag_module_set_compile_region(bar, region), 0);
    return m;
}

static void test_upstream_23(void **st) {
    (void)st;
    ag_manual_seed(0);
    ag_module *m = mymod_new(true);
    ag_tensor *x = ag_randn(AG_F32, 2, (int64_t[]){4, 3});
    assert_int_equal(ag_tensor_set_requires_grad(x, true), 0);
    ag_joint *j = ag_export_joint(m, &x, 1, NULL, NULL, 0, NULL);
    if (!j)
        print_error("%s\n", ag_last_error());
    assert_non_null(j);
    char *s = ag_graph_to_string(ag_joint_graph(j), NULL);
    printf("%s\n", s);
    ag_free(s);
    assert_int_equal(ag_graph_verify(ag_joint_graph(j)), 0);
    ag_joint_free(j);
    ag_module_free(m);
    ag_tensor_free(x);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_upstream_23),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
