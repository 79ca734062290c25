/* The export as a core and a list of wrappers (src/export/export_wrappers.h): the outputs a
 * pass collects come in the layout's section order; a pass that fails after the wrappers began
 * undoes every wrapper's changes to the module; and an allocation failure anywhere in the
 * export of a model that uses each wrapper leaks nothing and reports AG_ENOMEM. */
#include "aotgrad/nn.h"
#include "aotgrad/zoo.h"
#include "export/export_wrappers.h"
#include "testutil.h"

#include <stdio.h>
#include <string.h>

/* ---- the output list ---- */

static void test_outputs_in_section_order(void **st) {
    (void)st;
    ag__export_pass s;
    memset(&s, 0, sizeof s);
    assert_int_equal(
        ag__export_out(&s, AG_SEC_OUT_FW_TOKENS, NULL, ag_desc_forward_token_output(0), NULL), 0);
    assert_int_equal(ag__export_out(&s, AG_SEC_OUT_USER, NULL, ag_desc_plain_output(0), NULL), 0);
    /* A section may repeat, and may be skipped. */
    assert_int_equal(ag__export_out(&s, AG_SEC_OUT_USER, NULL, ag_desc_plain_output(1), NULL), 0);
    assert_int_equal(ag__export_out(&s, AG_SEC_OUT_GRADS, NULL, NULL, NULL), 0);
    /* An output of an earlier section is refused, its descriptor released (the sanitizer
     * build checks the leak) and the list unchanged. */
    ag_desc *in0 = ag_desc_plain_input(0), *mut = ag_desc_input_mutation(in0);
    ag_desc_release(in0);
    assert_non_null(mut);
    assert_int_equal(ag__export_out(&s, AG_SEC_OUT_MUTATIONS, NULL, mut, NULL), AG_ESTATE);
    assert_non_null(strstr(ag_last_error(), ag_section_name(AG_SEC_OUT_MUTATIONS)));
    assert_non_null(strstr(ag_last_error(), ag_section_name(AG_SEC_OUT_GRADS)));
    assert_int_equal(s.nout, 4);
    assert_int_equal(s.out[0].sec, AG_SEC_OUT_FW_TOKENS);
    assert_int_equal(s.out[1].sec, AG_SEC_OUT_USER);
    assert_int_equal(s.out[1].primal, -1);
    assert_int_equal(s.out[3].sec, AG_SEC_OUT_GRADS);
    for (int e = 0; e < s.nout; e++)
        ag_desc_release(s.out[e].desc);
    ag__free(s.out);
    /* Tangent descriptors grow past any first capacity. */
    for (int t = 0; t < 100; t++) {
        ag_desc *o = ag_desc_plain_output(t);
        assert_int_equal(ag__export_tangent(&s, ag_desc_tangent(o)), 0);
        ag_desc_release(o);
    }
    assert_int_equal(s.ntangent_descs, 100);
    char r[128];
    ag_desc_repr(s.tangent_descs[99], r, sizeof r);
    assert_string_equal(r, "TangentAOTInput(output=PlainAOTOutput(idx=99))");
    for (int t = 0; t < s.ntangent_descs; t++)
        ag_desc_release(s.tangent_descs[t]);
    ag__free(s.tangent_descs);
}

/* ---- the zoo models that use each wrapper ---- */

typedef struct model_case {
    const char *name;
    ag_module *m;
    ag_tensor *in[8];
    int nin;
    char *ref; /* the joint's text from a failure-free export */
} model_case;

static const char *const wrapper_models[] = {
    "alias_views", /* dedupe/synthetic base, input mutations, aliasing outputs */
    "effects",     /* effect tokens */
    "two_tensor",  /* subclasses */
    "dropout_mlp", /* RNG functionalization */
    "convbn",      /* buffer mutations */
    "kwargs",      /* keyword arguments */
};
enum { NMODELS = (int)(sizeof wrapper_models / sizeof wrapper_models[0]) };

/* Without seq_nr: the sequence numbers go on counting from one export to the next (a second
 * export of alias_views numbers its as_strided nodes, the first does not). */
static char *joint_text(ag_joint *j) {
    ag_print_opts po = {.stack_trace = true, .module_stack = true};
    return ag_graph_to_string(ag_joint_graph(j), &po);
}

static void case_build(model_case *c, const char *name) {
    memset(c, 0, sizeof *c);
    c->name = name;
    assert_int_equal(ag_zoo_build(name, NULL, &c->m, c->in, 8, &c->nin), 0);
}

static ag_joint *case_export(model_case *c, ag_tensor *const *in) {
    /* kwargs: the last input is the keyword argument `scale` */
    bool kw = !strcmp(c->name, "kwargs");
    const char *names[] = {"scale"};
    return ag_export_joint(c->m, in, c->nin - kw, kw ? names : NULL, kw ? in + c->nin - 1 : NULL,
                           kw, NULL);
}

static void case_free(model_case *c) {
    ag_free(c->ref);
    ag_module_free(c->m);
    for (int i = 0; i < c->nin; i++)
        ag_tensor_free(c->in[i]);
}

/* The module's parameters and buffers: the tensors and their geometry. */
typedef struct snapshot {
    int n;
    ag_tensor *t[64];
    int ndim[64];
    int64_t sizes[64][8], strides[64][8], offset[64];
    bool rg[64];
} snapshot;

static void snap(const ag_module *m, snapshot *s) {
    ag_named_tensors ps = {0}, bs = {0};
    assert_int_equal(ag_module_named_parameters(m, false, &ps), 0);
    assert_int_equal(ag_module_named_buffers(m, false, &bs), 0);
    memset(s, 0, sizeof *s);
    for (int i = 0; i < ps.n + bs.n && i < 64; i++) {
        ag_tensor *t = i < ps.n ? ps.tensors[i] : bs.tensors[i - ps.n];
        s->t[i] = t;
        s->ndim[i] = ag_tensor_ndim(t);
        memcpy(s->sizes[i], ag_tensor_sizes(t), sizeof(int64_t) * (size_t)s->ndim[i]);
        memcpy(s->strides[i], ag_tensor_strides(t), sizeof(int64_t) * (size_t)s->ndim[i]);
        s->offset[i] = ag_tensor_offset(t);
        s->rg[i] = ag_tensor_requires_grad(t);
        s->n++;
    }
    ag_named_tensors_free(&ps);
    ag_named_tensors_free(&bs);
}

static void snap_equal(const snapshot *a, const snapshot *b, const char *what) {
    if (a->n != b->n)
        fail_msg("%s: %d module tensors, then %d", what, a->n, b->n);
    for (int i = 0; i < a->n; i++)
        if (a->t[i] != b->t[i] || a->ndim[i] != b->ndim[i] || a->offset[i] != b->offset[i] ||
            a->rg[i] != b->rg[i] ||
            memcmp(a->sizes[i], b->sizes[i], sizeof(int64_t) * (size_t)a->ndim[i]) ||
            memcmp(a->strides[i], b->strides[i], sizeof(int64_t) * (size_t)a->ndim[i]))
            fail_msg("%s: module tensor %d changed", what, i);
}

/* A forward that fails after every wrapper began (its first input wider in dim 1 than the
 * model takes): the export fails with the op's error, the module's tensors are the same ones
 * with the same geometry (the wrappers' `end` ran), and the next export prints the same joint
 * as before. */
static void test_failed_pass_undoes_the_wrappers(void **st) {
    (void)st;
    for (int k = 0; k < NMODELS; k++) {
        model_case c;
        case_build(&c, wrapper_models[k]);
        ag_joint *j = case_export(&c, c.in);
        assert_non_null(j);
        c.ref = joint_text(j);
        ag_joint_free(j);
        snapshot before, after;
        snap(c.m, &before);
        ag_tensor *bad[8];
        memcpy(bad, c.in, sizeof bad);
        int64_t sz[8];
        int nd = ag_tensor_ndim(c.in[0]);
        memcpy(sz, ag_tensor_sizes(c.in[0]), sizeof(int64_t) * (size_t)nd);
        sz[1] += 1; /* the features (channels) dimension */
        bad[0] = ag_zeros(ag_tensor_dtype(c.in[0]), nd, sz);
        assert_non_null(bad[0]);
        ag_tensor_set_requires_grad(bad[0], ag_tensor_requires_grad(c.in[0]));
        j = case_export(&c, bad);
        if (j)
            fail_msg("%s: an export with a wider input succeeded", c.name);
        assert_true(ag_last_status() < 0);
        assert_true(strlen(ag_last_error()) > 0);
        ag_tensor_free(bad[0]);
        snap(c.m, &after);
        snap_equal(&before, &after, c.name);
        j = case_export(&c, c.in);
        assert_non_null(j);
        char *again = joint_text(j);
        assert_string_equal(again, c.ref);
        ag_free(again);
        ag_joint_free(j);
        case_free(&c);
    }
}

static int scenario_export(void *ud) {
    model_case *c = ud;
    ag_joint *j = case_export(c, c->in);
    if (!j)
        return ag_last_status();
    char *text = joint_text(j);
    int rc = text ? 0 : ag_last_status();
    tu_alloc_pause();
    if (text && !c->ref)
        c->ref = ag__strdup(text);
    else if (text && strcmp(text, c->ref))
        fail_msg("%s: the joint differs from the failure-free export's", c->name);
    tu_alloc_resume();
    ag_free(text);
    ag_joint_free(j);
    return rc;
}

/* Every allocation of each export failing in turn (then from there on): AG_ENOMEM, nothing
 * leaked, and the module untouched, whichever wrapper's hook the failure lands in. */
static void test_alloc_failures_every_wrapper(void **st) {
    (void)st;
    for (int k = 0; k < NMODELS; k++) {
        model_case c;
        case_build(&c, wrapper_models[k]);
        snapshot before, after;
        snap(c.m, &before);
        char what[64];
        snprintf(what, sizeof what, "export %s", c.name);
        tu_sweep_opts o = {.what = what, .one_thread = true};
        int64_t n = tu_alloc_failure_sweep(scenario_export, &c, &o);
        print_message("%s: %lld allocation points\n", what, (long long)n);
        assert_true(n >= 100);
        o.persistent = true;
        assert_true(tu_alloc_failure_sweep(scenario_export, &c, &o) >= 100);
        snap(c.m, &after);
        snap_equal(&before, &after, what);
        ag__free(c.ref);
        c.ref = NULL;
        case_free(&c);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_outputs_in_section_order),
        cmocka_unit_test(test_failed_pass_undoes_the_wrappers),
        cmocka_unit_test(test_alloc_failures_every_wrapper),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
