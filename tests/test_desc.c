/* Descriptors: every class's repr and expr against upstream's literal strings, the nesting
 * rules (checked exhaustively against an oracle written from the spec's lists), predicates and
 * accessors, value equality and hashing, the insertion-ordered map, parsing (round trips of
 * every kind and of odd strings, Python's call and string syntax, error messages), a fuzz pass
 * over truncated, mutated and random text, and allocation failure injection. Leaks are
 * checked with a live-allocation counter installed through ag_set_allocator (and by ASan in
 * the sanitizer build). */
#include "testutil.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- a live-allocation counter with optional failure injection ---- */

static int64_t live, count, fail_at;
static bool failed;

static void *counting_alloc(void *ud, size_t size, size_t align) {
    (void)ud;
    count++;
    if (fail_at && count == fail_at) {
        failed = true;
        return NULL;
    }
    size_t rounded = (size + align - 1) / align * align;
    void *p = aligned_alloc(align, rounded ? rounded : align);
    if (p)
        live++;
    return p;
}

static void counting_free(void *ud, void *p) {
    (void)ud;
    if (p)
        live--;
    free(p);
}

static void counting_begin(void) {
    live = count = fail_at = 0;
    failed = false;
    ag_set_allocator(&(ag_allocator){counting_alloc, counting_free, NULL});
}

static void counting_end_expect_no_leaks(void) {
    ag_set_allocator(NULL);
    if (live != 0) {
        print_error("%lld allocations leaked\n", (long long)live);
        fail();
    }
}

/* ---- helpers ---- */

/* A test-lifetime pool: pool(d) keeps d until pool_drain(), so nested constructor calls read as
 * one expression. A NULL d fails the test with the library's message. */
static ag_desc *pool_items[4096];
static int pool_n;

static ag_desc *pool(ag_desc *d) {
    if (!d) {
        print_error("constructor failed: %s\n", ag_last_error());
        fail();
    }
    assert_true(pool_n < (int)(sizeof pool_items / sizeof pool_items[0]));
    pool_items[pool_n++] = d;
    return d;
}

static void pool_drain(void) {
    while (pool_n > 0)
        ag_desc_release(pool_items[--pool_n]);
}

static const char *repr(const ag_desc *d) {
    static char bufs[4][2048];
    static int k;
    char *b = bufs[k++ & 3];
    size_t n = ag_desc_repr(d, b, sizeof bufs[0]);
    assert_true(n < sizeof bufs[0]);
    assert_int_equal(n, strlen(b));
    return b;
}

static const char *expr(const ag_desc *d) {
    static char bufs[4][2048];
    static int k;
    char *b = bufs[k++ & 3];
    size_t n = ag_desc_expr(d, b, sizeof bufs[0]);
    assert_true(n < sizeof bufs[0]);
    assert_int_equal(n, strlen(b));
    return b;
}

/* ---- the corpus: one descriptor (or more) of every kind, with upstream's strings ---- */

typedef struct dcase {
    ag_desc *d;
    const char *repr, *expr;
} dcase;

#define P pool
#define C(d, r, e)                                                                                 \
    cases[n++] = (dcase) {                                                                         \
        (d), (r), (e)                                                                              \
    }

/* Builds the corpus into cases[] (descriptors owned by the pool); returns the count. */
static int build_corpus(dcase *cases) {
    int n = 0;
    /* inputs */
    C(P(ag_desc_param("linear.weight")), "ParamAOTInput(target='linear.weight')",
      "self.get_parameter('linear.weight')");
    C(P(ag_desc_buffer("bn.running_mean")), "BufferAOTInput(target='bn.running_mean')",
      "self.get_buffer('bn.running_mean')");
    C(P(ag_desc_plain_input(0)), "PlainAOTInput(idx=0)", "args[0]");
    C(P(ag_desc_dummy_input(3)), "DummyAOTInput(idx=3)", "__dummy3");
    C(P(ag_desc_tangent(P(ag_desc_plain_output(0)))),
      "TangentAOTInput(output=PlainAOTOutput(idx=0))", "__output_tangent(output[0])");
    C(P(ag_desc_view_base(P(ag_desc_plain_input(1)))),
      "ViewBaseAOTInput(base_of=PlainAOTInput(idx=1))", "args[1]._base");
    C(P(ag_desc_synthetic_base(P(ag_desc_plain_input(2)))),
      "SyntheticBaseAOTInput(base_of=PlainAOTInput(idx=2))", "__make_synthetic_base(args[2])");
    C(P(ag_desc_philox_forward_seed()), "PhiloxForwardSeedAOTInput()", "__philox_forward_seed");
    C(P(ag_desc_philox_forward_base_offset()), "PhiloxForwardBaseOffsetAOTInput()",
      "__philox_forward_base_offset");
    C(P(ag_desc_philox_backward_seed()), "PhiloxBackwardSeedAOTInput()", "__philox_backward_seed");
    C(P(ag_desc_philox_backward_base_offset()), "PhiloxBackwardBaseOffsetAOTInput()",
      "__philox_backward_base_offset");
    C(P(ag_desc_forward_token_input(0)), "ForwardTokenAOTInput(idx=0)", "__forward_token0");
    C(P(ag_desc_backward_token_input(1)), "BackwardTokenAOTInput(idx=1)", "__backward_token1");
    C(P(ag_desc_subclass_getattr_input(P(ag_desc_plain_input(1)), "a")),
      "SubclassGetAttrAOTInput(base=PlainAOTInput(idx=1), attr='a')", "args[1].a");
    C(P(ag_desc_subclass_size_input(P(ag_desc_plain_input(0)), 1)),
      "SubclassSizeAOTInput(base=PlainAOTInput(idx=0), idx=1)", "args[0].size(1)");
    C(P(ag_desc_subclass_stride_input(P(ag_desc_param("w")), 1)),
      "SubclassStrideAOTInput(base=ParamAOTInput(target='w'), idx=1)",
      "self.get_parameter('w').stride(1)");
    /* outputs */
    C(P(ag_desc_plain_output(0)), "PlainAOTOutput(idx=0)", "output[0]");
    C(P(ag_desc_input_mutation(P(ag_desc_buffer("bn.running_mean")))),
      "InputMutationAOTOutput(mutated_input=BufferAOTInput(target='bn.running_mean'))",
      "__input_mutation(self.get_buffer('bn.running_mean'))");
    C(P(ag_desc_intermediate_base(P(ag_desc_plain_output(1)))),
      "IntermediateBaseAOTOutput(base_of=PlainAOTOutput(idx=1))", "__intermediate_base(output[1])");
    C(P(ag_desc_metadata_mutation(0)), "MetadataMutationAOTOutput(idx=0)",
      "__aliased_arg_with_metadata_mutation0");
    C(P(ag_desc_grad(P(ag_desc_param("fc.weight")))),
      "GradAOTOutput(grad_of=ParamAOTInput(target='fc.weight'))",
      "__grad(self.get_parameter('fc.weight'))");
    C(P(ag_desc_philox_updated_forward_offset()), "PhiloxUpdatedForwardOffsetAOTOutput()",
      "__philox_updated_forward_offset");
    C(P(ag_desc_philox_updated_backward_offset()), "PhiloxUpdatedBackwardOffsetAOTOutput()",
      "__philox_updated_backward_offset");
    C(P(ag_desc_forward_token_output(0)), "ForwardTokenAOTOutput(idx=0)", "__forward_token0");
    C(P(ag_desc_backward_token_output(2)), "BackwardTokenAOTOutput(idx=2)", "__backward_token2");
    C(P(ag_desc_subclass_getattr_output(P(ag_desc_plain_output(0)), "a")),
      "SubclassGetAttrAOTOutput(base=PlainAOTOutput(idx=0), attr='a')", "output[0].a");
    C(P(ag_desc_subclass_size_output(P(ag_desc_plain_output(0)), 0)),
      "SubclassSizeAOTOutput(base=PlainAOTOutput(idx=0), idx=0)", "output[0].size(0)");
    C(P(ag_desc_subclass_stride_output(P(ag_desc_grad(P(ag_desc_plain_input(1)))), 1)),
      "SubclassStrideAOTOutput(base=GradAOTOutput(grad_of=PlainAOTInput(idx=1)), idx=1)",
      "__grad(args[1]).stride(1)");
    C(P(ag_desc_dummy_output(4)), "DummyAOTOutput(idx=4)", "__dummy4");
    C(P(ag_desc_saved_for_backwards(0)), "SavedForBackwardsAOTOutput(idx=0)",
      "__saved_for_backwards_0");
    C(P(ag_desc_saved_for_backwards_no_vc_check(1)), "SavedForBackwardsNoVcCheckAOTOutput(idx=1)",
      "__saved_for_backwards_no_vc_check_1");
    /* deeper nesting, as the spec's examples and the TwoTensor test */
    C(P(ag_desc_subclass_getattr_input(P(ag_desc_tangent(P(ag_desc_plain_output(0)))), "a")),
      "SubclassGetAttrAOTInput(base=TangentAOTInput(output=PlainAOTOutput(idx=0)), attr='a')",
      "__output_tangent(output[0]).a");
    C(P(ag_desc_subclass_getattr_output(P(ag_desc_grad(P(ag_desc_plain_input(1)))), "b")),
      "SubclassGetAttrAOTOutput(base=GradAOTOutput(grad_of=PlainAOTInput(idx=1)), attr='b')",
      "__grad(args[1]).b");
    C(P(ag_desc_subclass_getattr_input(
          P(ag_desc_subclass_getattr_input(P(ag_desc_param("emb.weight")), "inner")), "a")),
      "SubclassGetAttrAOTInput(base=SubclassGetAttrAOTInput(base=ParamAOTInput("
      "target='emb.weight'), attr='inner'), attr='a')",
      "self.get_parameter('emb.weight').inner.a");
    C(P(ag_desc_tangent(P(ag_desc_input_mutation(P(ag_desc_plain_input(0)))))),
      "TangentAOTInput(output=InputMutationAOTOutput(mutated_input=PlainAOTInput(idx=0)))",
      "__output_tangent(__input_mutation(args[0]))");
    C(P(ag_desc_tangent(P(ag_desc_intermediate_base(P(ag_desc_plain_output(2)))))),
      "TangentAOTInput(output=IntermediateBaseAOTOutput(base_of=PlainAOTOutput(idx=2)))",
      "__output_tangent(__intermediate_base(output[2]))");
    C(P(ag_desc_tangent(P(ag_desc_metadata_mutation(1)))),
      "TangentAOTInput(output=MetadataMutationAOTOutput(idx=1))",
      "__output_tangent(__aliased_arg_with_metadata_mutation1)");
    C(P(ag_desc_tangent(P(ag_desc_grad(P(ag_desc_param("w")))))),
      "TangentAOTInput(output=GradAOTOutput(grad_of=ParamAOTInput(target='w')))",
      "__output_tangent(__grad(self.get_parameter('w')))");
    C(P(ag_desc_grad(P(ag_desc_view_base(P(ag_desc_plain_input(0)))))),
      "GradAOTOutput(grad_of=ViewBaseAOTInput(base_of=PlainAOTInput(idx=0)))",
      "__grad(args[0]._base)");
    C(P(ag_desc_grad(P(ag_desc_synthetic_base(P(ag_desc_buffer("b")))))),
      "GradAOTOutput(grad_of=SyntheticBaseAOTInput(base_of=BufferAOTInput(target='b')))",
      "__grad(__make_synthetic_base(self.get_buffer('b')))");
    C(P(ag_desc_grad(P(ag_desc_tangent(P(ag_desc_plain_output(0)))))),
      "GradAOTOutput(grad_of=TangentAOTInput(output=PlainAOTOutput(idx=0)))",
      "__grad(__output_tangent(output[0]))");
    C(P(ag_desc_subclass_size_input(P(ag_desc_tangent(P(ag_desc_plain_output(3)))), 0)),
      "SubclassSizeAOTInput(base=TangentAOTInput(output=PlainAOTOutput(idx=3)), idx=0)",
      "__output_tangent(output[3]).size(0)");
    C(P(ag_desc_view_base(P(ag_desc_subclass_getattr_input(P(ag_desc_plain_input(0)), "a")))),
      "ViewBaseAOTInput(base_of=SubclassGetAttrAOTInput(base=PlainAOTInput(idx=0), attr='a'))",
      "args[0].a._base");
    C(P(ag_desc_intermediate_base(
          P(ag_desc_subclass_stride_output(P(ag_desc_plain_output(0)), 2)))),
      "IntermediateBaseAOTOutput(base_of=SubclassStrideAOTOutput(base=PlainAOTOutput(idx=0), "
      "idx=2))",
      "__intermediate_base(output[0].stride(2))");
    /* integers: negative and extreme */
    C(P(ag_desc_plain_input(-1)), "PlainAOTInput(idx=-1)", "args[-1]");
    C(P(ag_desc_plain_output(INT64_MAX)), "PlainAOTOutput(idx=9223372036854775807)",
      "output[9223372036854775807]");
    C(P(ag_desc_dummy_output(INT64_MIN)), "DummyAOTOutput(idx=-9223372036854775808)",
      "__dummy-9223372036854775808");
    /* strings: Python's repr() rules (checked against CPython 3.11) */
    C(P(ag_desc_param("")), "ParamAOTInput(target='')", "self.get_parameter('')");
    C(P(ag_desc_param("it's")), "ParamAOTInput(target=\"it's\")", "self.get_parameter(\"it's\")");
    C(P(ag_desc_param("say \"hi\"")), "ParamAOTInput(target='say \"hi\"')",
      "self.get_parameter('say \"hi\"')");
    C(P(ag_desc_buffer("a'b\"c")), "BufferAOTInput(target='a\\'b\"c')",
      "self.get_buffer('a\\'b\"c')");
    C(P(ag_desc_param("back\\slash")), "ParamAOTInput(target='back\\\\slash')",
      "self.get_parameter('back\\\\slash')");
    C(P(ag_desc_param("nl\ntab\tcr\r")), "ParamAOTInput(target='nl\\ntab\\tcr\\r')",
      "self.get_parameter('nl\\ntab\\tcr\\r')");
    C(P(ag_desc_param("\x01\x1b\x7f")), "ParamAOTInput(target='\\x01\\x1b\\x7f')",
      "self.get_parameter('\\x01\\x1b\\x7f')");
    C(P(ag_desc_param("caf\xc3\xa9.\xf0\x9f\x98\x80")),
      "ParamAOTInput(target='caf\xc3\xa9.\xf0\x9f\x98\x80')",
      "self.get_parameter('caf\xc3\xa9.\xf0\x9f\x98\x80')");
    /* U+00A0 NBSP, U+00AD soft hyphen, U+200B, U+2028, U+E000 (private use), U+E0001 */
    C(P(ag_desc_param("\xc2\xa0\xc2\xad\xe2\x80\x8b\xe2\x80\xa8\xee\x80\x80\xf3\xa0\x80\x81")),
      "ParamAOTInput(target='\\xa0\\xad\\u200b\\u2028\\ue000\\U000e0001')",
      "self.get_parameter('\\xa0\\xad\\u200b\\u2028\\ue000\\U000e0001')");
    /* invalid UTF-8 prints as surrogateescape's lone surrogates: a stray byte, a truncated
     * sequence, an encoded surrogate, an overlong NUL, a code point past U+10FFFF */
    C(P(ag_desc_param("ok\xff|\xe2\x82|\xed\xa0\x80|\xc0\x80|\xf4\x90\x80\x80")),
      "ParamAOTInput(target='ok\\udcff|\\udce2\\udc82|\\udced\\udca0\\udc80|\\udcc0\\udc80|"
      "\\udcf4\\udc90\\udc80\\udc80')",
      "self.get_parameter('ok\\udcff|\\udce2\\udc82|\\udced\\udca0\\udc80|\\udcc0\\udc80|"
      "\\udcf4\\udc90\\udc80\\udc80')");
    /* attr prints through repr in the repr and raw in expr, as upstream's f-strings */
    C(P(ag_desc_subclass_getattr_input(P(ag_desc_plain_input(0)), "it's")),
      "SubclassGetAttrAOTInput(base=PlainAOTInput(idx=0), attr=\"it's\")", "args[0].it's");
    C(P(ag_desc_subclass_getattr_output(P(ag_desc_plain_output(0)), "x\\y\n")),
      "SubclassGetAttrAOTOutput(base=PlainAOTOutput(idx=0), attr='x\\\\y\\n')", "output[0].x\\y\n");
    return n;
}

static void test_repr_expr_every_kind(void **st) {
    (void)st;
    dcase cases[128];
    int n = build_corpus(cases);
    bool seen[AG_DESC_NKINDS] = {false};
    for (int i = 0; i < n; i++) {
        assert_string_equal(repr(cases[i].d), cases[i].repr);
        assert_string_equal(expr(cases[i].d), cases[i].expr);
        seen[ag_desc_kind_of(cases[i].d)] = true;
    }
    for (int k = 0; k < AG_DESC_NKINDS; k++) {
        if (!seen[k]) {
            print_error("kind %d (%s) has no case\n", k, ag_desc_kind_name(k));
            fail();
        }
    }
    pool_drain();
}

static void test_repr_buffer_semantics(void **st) {
    (void)st;
    ag_desc *d = P(ag_desc_grad(P(ag_desc_param("fc.weight"))));
    const char *full = "GradAOTOutput(grad_of=ParamAOTInput(target='fc.weight'))";
    /* snprintf semantics: the full length comes back whatever the buffer */
    assert_int_equal(ag_desc_repr(d, NULL, 0), strlen(full));
    char small[11];
    memset(small, 'X', sizeof small);
    assert_int_equal(ag_desc_repr(d, small, sizeof small), strlen(full));
    assert_string_equal(small, "GradAOTOut");
    char one[1] = {'X'};
    assert_int_equal(ag_desc_repr(d, one, 1), strlen(full));
    assert_int_equal(one[0], 0);
    assert_int_equal(ag_desc_expr(d, NULL, 0), strlen("__grad(self.get_parameter('fc.weight'))"));
    /* NULL (an output without a descriptor) prints as Python's None */
    assert_string_equal(repr(NULL), "None");
    assert_string_equal(expr(NULL), "None");
    pool_drain();
}

/* ---- nesting rules ---- */

static bool oracle_is_input(ag_desc_kind k) {
    return k < AG_DESC_PLAIN_OUTPUT;
}

static bool oracle_diff(ag_desc_kind k) {
    switch (k) {
    case AG_DESC_PARAM:
    case AG_DESC_BUFFER:
    case AG_DESC_PLAIN_INPUT:
    case AG_DESC_VIEW_BASE:
    case AG_DESC_SYNTHETIC_BASE:
    case AG_DESC_TANGENT:
    case AG_DESC_PLAIN_OUTPUT:
    case AG_DESC_INPUT_MUTATION:
    case AG_DESC_INTERMEDIATE_BASE:
    case AG_DESC_METADATA_MUTATION:
    case AG_DESC_GRAD:
        return true;
    default:
        return false;
    }
}

/* Whether the spec allows `inner` in the nested field of `outer`. */
static bool oracle_allows(ag_desc_kind outer, ag_desc_kind inner) {
    switch (outer) {
    case AG_DESC_TANGENT:
        return !oracle_is_input(inner) && oracle_diff(inner);
    case AG_DESC_GRAD:
        return oracle_is_input(inner) && oracle_diff(inner);
    case AG_DESC_VIEW_BASE:
    case AG_DESC_SYNTHETIC_BASE:
    case AG_DESC_SUBCLASS_GETATTR_INPUT:
    case AG_DESC_SUBCLASS_SIZE_INPUT:
    case AG_DESC_SUBCLASS_STRIDE_INPUT:
    case AG_DESC_INPUT_MUTATION:
        return oracle_is_input(inner);
    case AG_DESC_INTERMEDIATE_BASE:
    case AG_DESC_SUBCLASS_GETATTR_OUTPUT:
    case AG_DESC_SUBCLASS_SIZE_OUTPUT:
    case AG_DESC_SUBCLASS_STRIDE_OUTPUT:
        return !oracle_is_input(inner);
    default:
        return false;
    }
}

static void test_nesting_exhaustive(void **st) {
    (void)st;
    dcase cases[128];
    int n = build_corpus(cases), legal = 0, illegal = 0;
    for (int outer = 0; outer < AG_DESC_NKINDS; outer++) {
        unsigned f = ag_desc_kind_fields(outer);
        if (!(f & AG_DESC_HAS_NESTED))
            continue;
        for (int i = 0; i < n; i++) {
            const ag_desc *in = cases[i].d;
            bool want = oracle_allows(outer, ag_desc_kind_of(in));
            ag_clear_error();
            ag_desc *d = ag_desc_new(outer, in, (f & AG_DESC_HAS_STR) ? "a" : NULL,
                                     (f & AG_DESC_HAS_IDX) ? 1 : 0);
            if (want != (d != NULL)) {
                print_error("%s(%s): expected %s, got %s (%s)\n", ag_desc_kind_name(outer),
                            repr(in), want ? "success" : "failure", d ? "success" : "failure",
                            ag_last_error());
                fail();
            }
            if (d) {
                legal++;
                assert_ptr_equal(ag_desc_nested(d), in);
                assert_int_equal(ag_desc_depth(d), ag_desc_depth(in) + 1);
                ag_desc_release(d);
            } else {
                illegal++;
                assert_int_equal(ag_last_status(), AG_EINVAL);
                tu_assert_error_contains("ag_desc_new: ");
                tu_assert_error_contains(repr(in));
                /* the same verdict from the parser, at the nested value's column */
                char text[2048];
                snprintf(text, sizeof text, "%s(%s=%s%s%s)", ag_desc_kind_name(outer),
                         ag_desc_kind_nested_field(outer), repr(in),
                         (f & AG_DESC_HAS_STR) ? ", attr='a'" : "",
                         (f & AG_DESC_HAS_IDX) ? ", idx=1" : "");
                assert_null(ag_desc_parse(text, NULL));
                assert_int_equal(ag_last_status(), AG_EFORMAT);
                char col[64];
                snprintf(col, sizeof col, "desc: column %zu: %s.%s must be",
                         strlen(ag_desc_kind_name(outer)) + 2 +
                             strlen(ag_desc_kind_nested_field(outer)),
                         ag_desc_kind_name(outer), ag_desc_kind_nested_field(outer));
                tu_assert_error_contains(col);
            }
        }
    }
    assert_true(legal > 100);
    assert_true(illegal > 100);
    pool_drain();
}

static void expect_einval(ag_desc *d, const char *needle) {
    if (d) {
        print_error("expected failure with '%s', got %s\n", needle, repr(d));
        ag_desc_release(d);
        fail();
    }
    assert_int_equal(ag_last_status(), AG_EINVAL);
    tu_assert_error_contains(needle);
}

static void test_nesting_messages(void **st) {
    (void)st;
    ag_desc *po = P(ag_desc_plain_output(0)), *pi = P(ag_desc_plain_input(0));
    ag_desc *sub_out = P(ag_desc_subclass_getattr_output(po, "a"));
    ag_desc *sub_in = P(ag_desc_subclass_getattr_input(pi, "a"));
    /* the spec's illegal examples */
    expect_einval(ag_desc_tangent(sub_out),
                  "ag_desc_tangent: TangentAOTInput.output must be a differentiable AOTOutput "
                  "(PlainAOTOutput, InputMutationAOTOutput, IntermediateBaseAOTOutput, "
                  "MetadataMutationAOTOutput or GradAOTOutput), got "
                  "SubclassGetAttrAOTOutput(base=PlainAOTOutput(idx=0), attr='a'); subclass "
                  "descriptors wrap TangentAOTInput, never the reverse");
    expect_einval(ag_desc_grad(sub_in),
                  "ag_desc_grad: GradAOTOutput.grad_of must be a differentiable AOTInput "
                  "(ParamAOTInput, BufferAOTInput, PlainAOTInput, ViewBaseAOTInput, "
                  "SyntheticBaseAOTInput or TangentAOTInput), got "
                  "SubclassGetAttrAOTInput(base=PlainAOTInput(idx=0), attr='a'); subclass "
                  "descriptors wrap GradAOTOutput, never the reverse");
    /* and their legal counterparts */
    assert_string_equal(repr(P(ag_desc_subclass_getattr_input(P(ag_desc_tangent(po)), "a"))),
                        "SubclassGetAttrAOTInput(base=TangentAOTInput(output=PlainAOTOutput("
                        "idx=0)), attr='a')");
    assert_string_equal(
        repr(P(ag_desc_subclass_getattr_output(P(ag_desc_grad(P(ag_desc_plain_input(1)))), "a"))),
        "SubclassGetAttrAOTOutput(base=GradAOTOutput(grad_of=PlainAOTInput("
        "idx=1)), attr='a')");
    /* wrong side, non-differentiable */
    expect_einval(ag_desc_tangent(pi), "got PlainAOTInput(idx=0)");
    expect_einval(ag_desc_tangent(P(ag_desc_forward_token_output(0))),
                  "must be a differentiable AOTOutput");
    expect_einval(ag_desc_tangent(P(ag_desc_saved_for_backwards(0))),
                  "got SavedForBackwardsAOTOutput(idx=0)");
    expect_einval(ag_desc_grad(po), "GradAOTOutput.grad_of must be a differentiable AOTInput");
    expect_einval(ag_desc_grad(P(ag_desc_dummy_input(0))), "got DummyAOTInput(idx=0)");
    expect_einval(ag_desc_grad(P(ag_desc_philox_forward_seed())),
                  "got PhiloxForwardSeedAOTInput()");
    expect_einval(ag_desc_input_mutation(po),
                  "ag_desc_input_mutation: InputMutationAOTOutput.mutated_input must be an "
                  "AOTInput, got PlainAOTOutput(idx=0)");
    expect_einval(ag_desc_intermediate_base(pi),
                  "ag_desc_intermediate_base: IntermediateBaseAOTOutput.base_of must be an "
                  "AOTOutput, got PlainAOTInput(idx=0)");
    expect_einval(ag_desc_view_base(po), "ViewBaseAOTInput.base_of must be an AOTInput");
    expect_einval(ag_desc_synthetic_base(po), "SyntheticBaseAOTInput.base_of must be an AOTInput");
    expect_einval(ag_desc_subclass_getattr_input(po, "a"),
                  "SubclassGetAttrAOTInput.base must be an AOTInput");
    expect_einval(ag_desc_subclass_size_input(po, 0), "SubclassSizeAOTInput.base must be an");
    expect_einval(ag_desc_subclass_stride_input(po, 0), "SubclassStrideAOTInput.base must be an");
    expect_einval(ag_desc_subclass_getattr_output(pi, "a"),
                  "SubclassGetAttrAOTOutput.base must be an AOTOutput");
    expect_einval(ag_desc_subclass_size_output(pi, 0), "SubclassSizeAOTOutput.base must be an");
    expect_einval(ag_desc_subclass_stride_output(pi, 0), "SubclassStrideAOTOutput.base must be an");
    /* NULL arguments */
    expect_einval(ag_desc_tangent(NULL), "ag_desc_tangent: TangentAOTInput.output is NULL");
    expect_einval(ag_desc_grad(NULL), "ag_desc_grad: GradAOTOutput.grad_of is NULL");
    expect_einval(ag_desc_param(NULL), "ag_desc_param: ParamAOTInput.target is NULL");
    expect_einval(ag_desc_buffer(NULL), "ag_desc_buffer: BufferAOTInput.target is NULL");
    expect_einval(ag_desc_subclass_getattr_input(pi, NULL),
                  "ag_desc_subclass_getattr_input: SubclassGetAttrAOTInput.attr is NULL");
    expect_einval(ag_desc_subclass_getattr_output(NULL, "a"),
                  "SubclassGetAttrAOTOutput.base is NULL");
    /* the generic constructor's own checks */
    expect_einval(ag_desc_new(AG_DESC_NKINDS, NULL, NULL, 0),
                  "ag_desc_new: unknown descriptor kind");
    expect_einval(ag_desc_new((ag_desc_kind)-1, NULL, NULL, 0), "unknown descriptor kind -1");
    expect_einval(ag_desc_new(AG_DESC_PLAIN_INPUT, NULL, "x", 0),
                  "ag_desc_new: PlainAOTInput has no string field");
    expect_einval(ag_desc_new(AG_DESC_PARAM, pi, "x", 0),
                  "ag_desc_new: ParamAOTInput has no nested descriptor field");
    expect_einval(ag_desc_new(AG_DESC_PHILOX_FORWARD_SEED, NULL, NULL, 3),
                  "ag_desc_new: PhiloxForwardSeedAOTInput has no idx field (got 3)");
    expect_einval(ag_desc_new(AG_DESC_GRAD, po, NULL, 0), "ag_desc_new: GradAOTOutput.grad_of");
    ag_desc *ok = P(ag_desc_new(AG_DESC_SUBCLASS_SIZE_INPUT, pi, NULL, 2));
    assert_string_equal(repr(ok), "SubclassSizeAOTInput(base=PlainAOTInput(idx=0), idx=2)");
    pool_drain();
}

static void test_depth_limit(void **st) {
    (void)st;
    /* Tangent(Grad(Tangent(...))) is legal at every level: the only bound is the depth. */
    ag_desc *d = ag_desc_plain_output(0);
    for (int depth = 2; depth <= AG_DESC_MAX_DEPTH; depth++) {
        ag_desc *next = ag_desc_is_output(d) ? ag_desc_tangent(d) : ag_desc_grad(d);
        assert_non_null(next);
        ag_desc_release(d);
        d = next;
        assert_int_equal(ag_desc_depth(d), depth);
    }
    ag_desc *over = ag_desc_is_output(d) ? ag_desc_tangent(d) : ag_desc_grad(d);
    expect_einval(over, "descriptors nest at most 64 levels deep");
    /* the deepest legal descriptor round-trips through text */
    static char text[8192];
    assert_true(ag_desc_repr(d, text, sizeof text) < sizeof text);
    ag_desc *back = ag_desc_parse(text, NULL);
    assert_non_null(back);
    assert_true(ag_desc_equal(back, d));
    ag_desc_release(back);
    /* one more level of text is refused by the parser */
    static char deeper[8300];
    snprintf(deeper, sizeof deeper, "%s(%s=%s)",
             ag_desc_is_output(d) ? "TangentAOTInput" : "GradAOTOutput",
             ag_desc_is_output(d) ? "output" : "grad_of", text);
    assert_null(ag_desc_parse(deeper, NULL));
    assert_int_equal(ag_last_status(), AG_EFORMAT);
    tu_assert_error_contains("nest at most 64 levels deep");
    ag_desc_release(d);
}

/* ---- predicates and accessors ---- */

static void test_predicates_accessors(void **st) {
    (void)st;
    dcase cases[128];
    int n = build_corpus(cases);
    for (int i = 0; i < n; i++) {
        const ag_desc *d = cases[i].d;
        ag_desc_kind k = ag_desc_kind_of(d);
        assert_int_equal(ag_desc_is_input(d), oracle_is_input(k));
        assert_int_equal(ag_desc_is_output(d), !oracle_is_input(k));
        assert_int_equal(ag_desc_is_differentiable(d), oracle_diff(k));
        /* the class name is what the repr starts with */
        const char *name = ag_desc_kind_name(k);
        assert_memory_equal(cases[i].repr, name, strlen(name));
        assert_int_equal(cases[i].repr[strlen(name)], '(');
        unsigned f = ag_desc_kind_fields(k);
        assert_int_equal(ag_desc_nested(d) != NULL, (f & AG_DESC_HAS_NESTED) != 0);
        assert_int_equal(ag_desc_kind_nested_field(k) != NULL, (f & AG_DESC_HAS_NESTED) != 0);
        assert_int_equal(ag_desc_kind_str_field(k) != NULL, (f & AG_DESC_HAS_STR) != 0);
        assert_int_equal(ag_desc_target(d) != NULL, k == AG_DESC_PARAM || k == AG_DESC_BUFFER);
        assert_int_equal(ag_desc_attr(d) != NULL, k == AG_DESC_SUBCLASS_GETATTR_INPUT ||
                                                      k == AG_DESC_SUBCLASS_GETATTR_OUTPUT);
        if (!(f & AG_DESC_HAS_IDX))
            assert_int_equal(ag_desc_idx(d), 0);
        /* predicates hold only for their own kind, or through SubclassGetAttr */
        if (k != AG_DESC_SUBCLASS_GETATTR_INPUT) {
            assert_int_equal(ag_desc_is_param(d), k == AG_DESC_PARAM);
            assert_int_equal(ag_desc_is_buffer(d), k == AG_DESC_BUFFER);
            assert_int_equal(ag_desc_is_tangent(d), k == AG_DESC_TANGENT);
        }
        if (k != AG_DESC_SUBCLASS_GETATTR_OUTPUT)
            assert_int_equal(ag_desc_is_grad(d), k == AG_DESC_GRAD);
    }
    assert_null(ag_desc_kind_name(AG_DESC_NKINDS));
    assert_int_equal(ag_desc_kind_fields(AG_DESC_NKINDS), 0);
    assert_string_equal(ag_desc_kind_name(AG_DESC_SAVED_FOR_BACKWARDS_NO_VC_CHECK),
                        "SavedForBackwardsNoVcCheckAOTOutput");
    assert_string_equal(ag_desc_kind_nested_field(AG_DESC_INPUT_MUTATION), "mutated_input");
    assert_string_equal(ag_desc_kind_nested_field(AG_DESC_GRAD), "grad_of");
    assert_string_equal(ag_desc_kind_nested_field(AG_DESC_TANGENT), "output");
    assert_string_equal(ag_desc_kind_nested_field(AG_DESC_VIEW_BASE), "base_of");
    assert_string_equal(ag_desc_kind_nested_field(AG_DESC_SUBCLASS_SIZE_OUTPUT), "base");
    assert_string_equal(ag_desc_kind_str_field(AG_DESC_BUFFER), "target");
    assert_string_equal(ag_desc_kind_str_field(AG_DESC_SUBCLASS_GETATTR_INPUT), "attr");

    ag_desc *w = P(ag_desc_param("fc.weight")), *b = P(ag_desc_buffer("bn.running_var"));
    ag_desc *t = P(ag_desc_tangent(P(ag_desc_plain_output(2))));
    assert_string_equal(ag_desc_target(w), "fc.weight");
    assert_string_equal(ag_desc_target(b), "bn.running_var");
    assert_int_equal(ag_desc_idx(ag_desc_nested(t)), 2);
    assert_int_equal(ag_desc_depth(t), 2);
    /* SubclassGetAttrAOTInput delegates is_param/is_buffer/is_tangent, through nesting */
    ag_desc *sw = P(ag_desc_subclass_getattr_input(P(ag_desc_subclass_getattr_input(w, "a")), "b"));
    assert_true(ag_desc_is_param(sw));
    assert_false(ag_desc_is_buffer(sw));
    assert_false(ag_desc_is_differentiable(sw));
    assert_string_equal(ag_desc_attr(sw), "b");
    assert_null(ag_desc_target(sw));
    assert_true(ag_desc_is_buffer(P(ag_desc_subclass_getattr_input(b, "a"))));
    assert_true(ag_desc_is_tangent(P(ag_desc_subclass_getattr_input(t, "a"))));
    /* ... but SubclassSize/Stride do not (upstream defines no override there) */
    assert_false(ag_desc_is_param(P(ag_desc_subclass_size_input(w, 0))));
    assert_false(ag_desc_is_tangent(P(ag_desc_subclass_stride_input(t, 0))));
    /* SubclassGetAttrAOTOutput delegates is_grad */
    ag_desc *g = P(ag_desc_grad(w));
    assert_true(ag_desc_is_grad(g));
    assert_true(ag_desc_is_grad(P(ag_desc_subclass_getattr_output(g, "a"))));
    assert_false(ag_desc_is_grad(P(ag_desc_subclass_size_output(g, 0))));
    assert_false(
        ag_desc_is_grad(P(ag_desc_subclass_getattr_output(P(ag_desc_plain_output(0)), "a"))));
    /* a view base of a param is not a param (upstream's TODO says as much) */
    assert_false(ag_desc_is_param(P(ag_desc_view_base(w))));
    /* NULL answers false everywhere */
    assert_false(ag_desc_is_param(NULL) || ag_desc_is_buffer(NULL) || ag_desc_is_tangent(NULL) ||
                 ag_desc_is_grad(NULL) || ag_desc_is_differentiable(NULL) ||
                 ag_desc_is_input(NULL) || ag_desc_is_output(NULL));
    pool_drain();
}

static void test_refcounts(void **st) {
    (void)st;
    counting_begin();
    ag_desc *p = ag_desc_plain_output(0);
    ag_desc *t = ag_desc_tangent(p);
    ag_desc_release(p); /* t keeps its own reference */
    assert_string_equal(repr(t), "TangentAOTInput(output=PlainAOTOutput(idx=0))");
    assert_ptr_equal(ag_desc_retain(t), t);
    ag_desc_release(t);
    assert_int_equal(live, 2);
    ag_desc_release(t);
    assert_int_equal(live, 0);
    ag_desc_release(NULL);
    assert_null(ag_desc_retain(NULL));
    /* a failed constructor leaves its argument's refcount alone */
    ag_desc *pi = ag_desc_plain_input(0);
    assert_null(ag_desc_tangent(pi));
    ag_desc_release(pi);
    counting_end_expect_no_leaks();
}

/* Many threads retain and release one shared descriptor: the count must stay exact (ASan
 * reports the use-after-free or leak a racy count would cause). */
static ag_desc *shared_desc;

static void *hammer(void *arg) {
    (void)arg;
    for (int i = 0; i < 100000; i++) {
        ag_desc *r = ag_desc_retain(shared_desc);
        ag_desc_release(r);
    }
    return NULL;
}

static void test_refcount_threads(void **st) {
    (void)st;
    counting_begin();
    shared_desc = ag_desc_grad(P(ag_desc_param("w")));
    pool_drain();
    pthread_t th[4];
    for (int i = 0; i < 4; i++)
        assert_int_equal(pthread_create(&th[i], NULL, hammer, NULL), 0);
    for (int i = 0; i < 4; i++)
        pthread_join(th[i], NULL);
    assert_int_equal(live, 2);
    assert_string_equal(repr(shared_desc), "GradAOTOutput(grad_of=ParamAOTInput(target='w'))");
    ag_desc_release(shared_desc);
    counting_end_expect_no_leaks();
}

/* ---- equality and hashing ---- */

static void test_equal_hash(void **st) {
    (void)st;
    dcase a[128], b[128];
    int n = build_corpus(a);
    assert_int_equal(build_corpus(b), n);
    for (int i = 0; i < n; i++) {
        assert_ptr_not_equal(a[i].d, b[i].d);
        assert_true(ag_desc_equal(a[i].d, b[i].d));
        assert_int_equal(ag_desc_hash(a[i].d), ag_desc_hash(b[i].d));
        for (int j = 0; j < n; j++) {
            if (i == j || !strcmp(a[i].repr, a[j].repr))
                continue;
            if (ag_desc_equal(a[i].d, b[j].d) || ag_desc_hash(a[i].d) == ag_desc_hash(b[j].d)) {
                print_error("%s and %s compare or hash equal\n", a[i].repr, a[j].repr);
                fail();
            }
        }
    }
    /* near misses: the same fields under another class, one field changed */
    struct {
        ag_desc *x, *y;
    } pairs[] = {
        {P(ag_desc_dummy_input(0)), P(ag_desc_dummy_output(0))},
        {P(ag_desc_plain_input(0)), P(ag_desc_plain_output(0))},
        {P(ag_desc_forward_token_input(0)), P(ag_desc_forward_token_output(0))},
        {P(ag_desc_param("w")), P(ag_desc_buffer("w"))},
        {P(ag_desc_param("w")), P(ag_desc_param("w "))},
        {P(ag_desc_param("")), P(ag_desc_param("\xff"))},
        {P(ag_desc_plain_input(0)), P(ag_desc_plain_input(1))},
        {P(ag_desc_plain_input(-1)), P(ag_desc_plain_input(1))},
        {P(ag_desc_tangent(P(ag_desc_plain_output(0)))),
         P(ag_desc_tangent(P(ag_desc_plain_output(1))))},
        {P(ag_desc_subclass_size_input(P(ag_desc_plain_input(0)), 1)),
         P(ag_desc_subclass_stride_input(P(ag_desc_plain_input(0)), 1))},
        {P(ag_desc_subclass_getattr_input(P(ag_desc_plain_input(0)), "a")),
         P(ag_desc_subclass_getattr_input(P(ag_desc_plain_input(1)), "a"))},
        {P(ag_desc_view_base(P(ag_desc_plain_input(0)))),
         P(ag_desc_synthetic_base(P(ag_desc_plain_input(0))))},
        {P(ag_desc_philox_forward_seed()), P(ag_desc_philox_backward_seed())},
    };
    for (size_t i = 0; i < sizeof pairs / sizeof pairs[0]; i++) {
        assert_false(ag_desc_equal(pairs[i].x, pairs[i].y));
        assert_int_not_equal(ag_desc_hash(pairs[i].x), ag_desc_hash(pairs[i].y));
    }
    assert_true(ag_desc_equal(NULL, NULL));
    assert_false(ag_desc_equal(pairs[0].x, NULL));
    assert_false(ag_desc_equal(NULL, pairs[0].x));
    assert_int_equal(ag_desc_hash(NULL), ag_desc_hash(NULL));
    /* The hash is pinned: 64-bit FNV-1a over little-endian u64 fields (kind, then nested hash,
     * string length and bytes, idx), so it is the same in every run and on every platform.
     * Expected values computed independently (Python). */
    assert_int_equal(ag_desc_hash(P(ag_desc_plain_input(0))), 0x261c4b49872994e7ull);
    assert_int_equal(ag_desc_hash(P(ag_desc_param("w"))), 0xba8fe6a23d5c84a9ull);
    assert_int_equal(ag_desc_hash(P(ag_desc_tangent(P(ag_desc_plain_output(0))))),
                     0x67a644467adfe0edull);
    pool_drain();
}

/* ---- the map ---- */

static void test_map(void **st) {
    (void)st;
    counting_begin();
    ag_desc_map *m = ag_desc_map_new();
    assert_non_null(m);
    assert_int_equal(ag_desc_map_size(m), 0);
    enum { N = 300 };
    char name[64];
    /* keys in a deliberately non-sorted order: params, then interleaved grads and plain */
    for (int i = 0; i < N; i++) {
        ag_desc *k;
        if (i % 3 == 0) {
            snprintf(name, sizeof name, "layers.%d.weight", N - i);
            k = ag_desc_param(name);
        } else if (i % 3 == 1) {
            ag_desc *pi = ag_desc_plain_input(i);
            k = ag_desc_grad(pi);
            ag_desc_release(pi);
        } else
            k = ag_desc_plain_output(i);
        assert_non_null(k);
        assert_int_equal(ag_desc_map_put(m, k, (void *)(intptr_t)(i + 1)), 0);
        ag_desc_release(k); /* the map keeps its own reference */
    }
    assert_int_equal(ag_desc_map_size(m), N);
    /* lookup with freshly built, structurally equal keys; iteration in insertion order */
    for (int i = 0; i < N; i++) {
        ag_desc *k;
        if (i % 3 == 0) {
            snprintf(name, sizeof name, "layers.%d.weight", N - i);
            k = ag_desc_param(name);
        } else if (i % 3 == 1) {
            ag_desc *pi = ag_desc_plain_input(i);
            k = ag_desc_grad(pi);
            ag_desc_release(pi);
        } else
            k = ag_desc_plain_output(i);
        assert_int_equal(ag_desc_map_find(m, k), i);
        assert_int_equal((intptr_t)ag_desc_map_get(m, k), i + 1);
        assert_true(ag_desc_equal(ag_desc_map_key(m, i), k));
        assert_ptr_not_equal(ag_desc_map_key(m, i), k);
        assert_int_equal((intptr_t)ag_desc_map_value(m, i), i + 1);
        ag_desc_release(k);
    }
    /* absent keys, including near misses */
    ag_desc *absent[] = {ag_desc_param("layers.0.weight"), ag_desc_plain_input(1),
                         ag_desc_plain_output(1), ag_desc_buffer("layers.300.weight")};
    for (size_t i = 0; i < sizeof absent / sizeof absent[0]; i++) {
        assert_int_equal(ag_desc_map_find(m, absent[i]), -1);
        assert_null(ag_desc_map_get(m, absent[i]));
        ag_desc_release(absent[i]);
    }
    /* overwriting keeps the position, the size and the first key object */
    ag_desc *k5 = ag_desc_plain_output(5);
    const ag_desc *first = ag_desc_map_key(m, 5);
    assert_int_equal(ag_desc_map_put(m, k5, NULL), 0);
    assert_int_equal(ag_desc_map_size(m), N);
    assert_int_equal(ag_desc_map_find(m, k5), 5);
    assert_null(ag_desc_map_get(m, k5)); /* a NULL value, told apart by find */
    assert_ptr_equal(ag_desc_map_key(m, 5), first);
    assert_int_equal(ag_desc_map_set_value(m, 5, (void *)(intptr_t)77), 0);
    assert_int_equal((intptr_t)ag_desc_map_get(m, k5), 77);
    ag_desc_release(k5);
    /* bad arguments */
    assert_int_equal(ag_desc_map_put(m, NULL, NULL), AG_EINVAL);
    tu_assert_error_contains("ag_desc_map_put: key is NULL");
    assert_int_equal(ag_desc_map_put(NULL, first, NULL), AG_EINVAL);
    assert_int_equal(ag_desc_map_set_value(m, N, NULL), AG_EINVAL);
    tu_assert_error_contains("ag_desc_map_set_value: index 300 out of range [0, 300)");
    assert_int_equal(ag_desc_map_set_value(m, -1, NULL), AG_EINVAL);
    assert_null(ag_desc_map_key(m, N));
    assert_null(ag_desc_map_key(m, -1));
    assert_null(ag_desc_map_value(m, N));
    assert_int_equal(ag_desc_map_find(m, NULL), -1);
    assert_int_equal(ag_desc_map_size(NULL), 0);
    assert_int_equal(ag_desc_map_find(NULL, first), -1);
    assert_null(ag_desc_map_get(NULL, first));
    ag_desc_map_free(m);
    ag_desc_map_free(NULL);
    /* an empty map answers lookups */
    ag_desc_map *e = ag_desc_map_new();
    ag_desc *k = ag_desc_plain_input(0);
    assert_int_equal(ag_desc_map_find(e, k), -1);
    ag_desc_release(k);
    ag_desc_map_free(e);
    counting_end_expect_no_leaks();
}

/* ---- parsing ---- */

static void expect_parse(const char *text, const ag_desc *want) {
    ag_clear_error();
    ag_desc *d = ag_desc_parse(text, NULL);
    if (!d) {
        print_error("parsing %s failed: %s\n", text, ag_last_error());
        fail();
    }
    if (!ag_desc_equal(d, want)) {
        print_error("parsing %s gave %s, expected %s\n", text, repr(d), repr(want));
        fail();
    }
    ag_desc_release(d);
}

static void test_parse_roundtrip(void **st) {
    (void)st;
    dcase cases[128];
    int n = build_corpus(cases);
    for (int i = 0; i < n; i++) {
        expect_parse(cases[i].repr, cases[i].d);
        ag_desc *d = ag_desc_parse(cases[i].repr, NULL);
        assert_string_equal(repr(d), cases[i].repr); /* byte-identical reprint */
        assert_int_equal(ag_desc_hash(d), ag_desc_hash(cases[i].d));
        ag_desc_release(d);
        /* embedded in a line, as the graph text format does: consumed stops at ')' */
        char line[2048];
        snprintf(line, sizeof line, "  %s  # and more)", cases[i].repr);
        size_t used = 0;
        d = ag_desc_parse(line, &used);
        assert_non_null(d);
        assert_true(ag_desc_equal(d, cases[i].d));
        assert_int_equal(used, 2 + strlen(cases[i].repr));
        ag_desc_release(d);
    }
    /* every single byte 1..255 and many two-byte strings survive repr -> parse */
    for (int c = 1; c < 256; c++) {
        for (int c2 = 0; c2 < 256; c2 += (c % 16 == 0 ? 1 : 51)) {
            char s[3] = {(char)c, (char)c2, 0};
            ag_desc *po = ag_desc_plain_output(c);
            ag_desc *d = ag_desc_subclass_getattr_output(po, s);
            ag_desc_release(po);
            assert_non_null(d);
            expect_parse(repr(d), d);
            ag_desc_release(d);
        }
    }
    pool_drain();
}

static void test_parse_python_syntax(void **st) {
    (void)st;
    /* positional arguments, as the spec's prose writes them */
    expect_parse("PlainAOTOutput(0)", P(ag_desc_plain_output(0)));
    expect_parse(
        "SubclassGetAttrAOTInput(TangentAOTInput(PlainAOTOutput(0)), 'a')",
        P(ag_desc_subclass_getattr_input(P(ag_desc_tangent(P(ag_desc_plain_output(0)))), "a")));
    /* keywords in any order, positional then keyword, whitespace, trailing comma */
    ag_desc *sa = P(ag_desc_subclass_getattr_input(P(ag_desc_plain_input(1)), "a"));
    expect_parse("SubclassGetAttrAOTInput(attr='a', base=PlainAOTInput(idx=1))", sa);
    expect_parse("SubclassGetAttrAOTInput(PlainAOTInput(1), attr='a')", sa);
    expect_parse("\n\t SubclassGetAttrAOTInput (\n  base = PlainAOTInput( idx = 1 ) ,\n"
                 "  attr = \"a\" ,\n) \n",
                 sa);
    expect_parse("PhiloxForwardSeedAOTInput( )", P(ag_desc_philox_forward_seed()));
    /* Python's string escapes, in both quote styles */
    ag_desc *esc = P(ag_desc_param("aA\xc3\xa9\xf0\x9f\x98\x80"
                                   "A\n'\"\\\a\b\f\v\t\r"));
    expect_parse(
        "ParamAOTInput(target='a\\x41\\u00e9\\U0001F600\\101\\n\\'\"\\\\\\a\\b\\f\\v\\t\\r')", esc);
    expect_parse(
        "ParamAOTInput(target=\"a\\x41\\u00E9\\U0001f600\\101\\n'\\\"\\\\\\a\\b\\f\\v\\t\\r\")",
        esc);
    expect_parse("ParamAOTInput(target='\\377\\7\\18')", P(ag_desc_param("\xc3\xbf\x07\x01"
                                                                         "8")));
    expect_parse("ParamAOTInput(target='\\q\\d')", P(ag_desc_param("\\q\\d"))); /* kept */
    expect_parse("ParamAOTInput(target='ab\\\ncd')", P(ag_desc_param("abcd"))); /* continuation */
    expect_parse("ParamAOTInput(target='\\udcff\\udc80')", P(ag_desc_param("\xff\x80")));
    expect_parse("ParamAOTInput(target='\xc3\xa9\xff')",
                 P(ag_desc_param("\xc3\xa9\xff"))); /* raw */
    /* integers */
    expect_parse("PlainAOTInput(idx=-9223372036854775808)", P(ag_desc_plain_input(INT64_MIN)));
    expect_parse("PlainAOTInput(idx=9223372036854775807)", P(ag_desc_plain_input(INT64_MAX)));
    expect_parse("PlainAOTInput(idx=-0)", P(ag_desc_plain_input(0)));
    /* consumed: stops right after the outermost ')' */
    size_t used = 99;
    ag_desc *d = ag_desc_parse("PlainAOTInput(idx=0)]", &used);
    assert_non_null(d);
    assert_int_equal(used, 20);
    ag_desc_release(d);
    d = ag_desc_parse("GradAOTOutput(grad_of=PlainAOTInput(idx=0)), PlainAOTOutput(idx=1)", &used);
    assert_non_null(d);
    assert_int_equal(used, 43);
    ag_desc_release(d);
    pool_drain();
}

static void expect_parse_error(const char *text, const char *needle) {
    ag_clear_error();
    ag_desc *d = ag_desc_parse(text, NULL);
    if (d) {
        print_error("parsing %s should fail with '%s', gave %s\n", text, needle, repr(d));
        ag_desc_release(d);
        fail();
    }
    assert_int_equal(ag_last_status(), AG_EFORMAT);
    tu_assert_error_contains(needle);
}

static void test_parse_errors(void **st) {
    (void)st;
    expect_parse_error("ParamAOTInput(idx=0)",
                       "desc: column 14: expected 'target=': ParamAOTInput has no field 'idx'");
    expect_parse_error("ParamAOTInput()",
                       "desc: column 14: expected 'target=': ParamAOTInput is missing field "
                       "'target'");
    expect_parse_error("SubclassSizeAOTInput(base=PlainAOTInput(idx=0))",
                       "desc: column 46: expected 'idx=': SubclassSizeAOTInput is missing field "
                       "'idx'");
    expect_parse_error("PlainAOTInput(idx=0, target='a')",
                       "desc: column 21: expected ')': PlainAOTInput has no field 'target'");
    expect_parse_error("", "desc: column 0: expected a descriptor class name such as "
                           "'PlainAOTInput', got end of text");
    expect_parse_error("  42", "desc: column 2: expected a descriptor class name");
    expect_parse_error("None", "desc: column 0: expected a descriptor, got None");
    expect_parse_error("FooAOTInput(idx=0)",
                       "desc: column 0: unknown descriptor class 'FooAOTInput'");
    expect_parse_error("OpaqueRefAOTInput(idx=0)", "unknown descriptor class 'OpaqueRefAOTInput'");
    expect_parse_error("PlainAOTInput", "desc: column 13: expected '(' after PlainAOTInput, got "
                                        "end of text");
    expect_parse_error("PlainAOTInput[idx=0]", "desc: column 13: expected '(' after PlainAOTInput, "
                                               "got '[idx=0]'");
    expect_parse_error("PlainAOTInput(idx=)", "desc: column 18: expected an integer for 'idx', got "
                                              "')'");
    expect_parse_error("PlainAOTInput(idx='0')", "desc: column 18: expected an integer for 'idx'");
    expect_parse_error("PlainAOTInput(idx=0", "desc: column 19: expected ',' or ')' in "
                                              "PlainAOTInput(...), got end of text");
    expect_parse_error("PlainAOTInput(idx=0.5)", "desc: column 19: expected ',' or ')'");
    expect_parse_error("PlainAOTInput(idx=01)", "desc: column 18: leading zeros are not allowed");
    expect_parse_error("PlainAOTInput(idx=9223372036854775808)",
                       "desc: column 18: integer for 'idx' does not fit in 64 bits");
    expect_parse_error("PlainAOTInput(idx=-9223372036854775809)", "does not fit in 64 bits");
    expect_parse_error("PlainAOTInput(idx=0, idx=1)",
                       "desc: column 21: PlainAOTInput got field 'idx' twice");
    expect_parse_error("PlainAOTInput(0, idx=1)", "PlainAOTInput got field 'idx' twice");
    expect_parse_error("PlainAOTInput(0, 1)",
                       "desc: column 17: expected ')': PlainAOTInput takes 1 argument");
    expect_parse_error("SubclassSizeAOTInput(PlainAOTInput(0), 1, 2)", "takes 2 arguments");
    expect_parse_error("PhiloxForwardSeedAOTInput(0)",
                       "desc: column 26: expected ')': PhiloxForwardSeedAOTInput takes no "
                       "arguments");
    expect_parse_error("SubclassSizeAOTInput(base=PlainAOTInput(idx=0), 3)",
                       "desc: column 48: positional argument follows keyword argument");
    expect_parse_error("ParamAOTInput(target='abc)",
                       "desc: column 21: unterminated string literal for 'target'");
    expect_parse_error("ParamAOTInput(target='a\nb')", "column 21: unterminated string literal");
    expect_parse_error("ParamAOTInput(target='a\\", "unterminated string literal");
    expect_parse_error("ParamAOTInput(target=abc)",
                       "desc: column 21: expected a string literal for 'target', got 'abc)'");
    expect_parse_error("ParamAOTInput(target=r'abc')", "expected a string literal for 'target'");
    expect_parse_error("ParamAOTInput(target='a''b')", "desc: column 24: expected ',' or ')'");
    expect_parse_error("ParamAOTInput(target='a\\x4')",
                       "desc: column 23: truncated \\x escape: expected 2 hex digits");
    expect_parse_error("ParamAOTInput(target='\\u12')", "truncated \\u escape: expected 4");
    expect_parse_error("ParamAOTInput(target='\\U0001F60')", "truncated \\U escape: expected 8");
    expect_parse_error("ParamAOTInput(target='\\x00')",
                       "desc: column 22: a NUL character cannot appear in a descriptor string");
    expect_parse_error("ParamAOTInput(target='\\0')", "a NUL character cannot appear");
    expect_parse_error("ParamAOTInput(target='\\ud800')",
                       "desc: column 22: lone surrogate \\ud800 cannot be encoded");
    expect_parse_error("ParamAOTInput(target='\\udc7f')", "lone surrogate \\udc7f");
    expect_parse_error("ParamAOTInput(target='\\U00110000')",
                       "illegal Unicode character \\U00110000");
    expect_parse_error("ParamAOTInput(target='\\N{EM DASH}')",
                       "\\N{...} escapes are not supported");
    expect_parse_error(
        "TangentAOTInput(output=SubclassGetAttrAOTOutput(base=PlainAOTOutput(idx=0), "
        "attr='a'))",
        "desc: column 23: TangentAOTInput.output must be a differentiable "
        "AOTOutput");
    expect_parse_error("GradAOTOutput(grad_of=PlainAOTOutput(idx=0))",
                       "desc: column 22: GradAOTOutput.grad_of must be a differentiable AOTInput");
    expect_parse_error("InputMutationAOTOutput(mutated_input=PlainAOTOutput(idx=0))",
                       "desc: column 37: InputMutationAOTOutput.mutated_input must be an AOTInput, "
                       "got PlainAOTOutput(idx=0)");
    expect_parse_error("TangentAOTInput(output=PlainAOTOutput(idx=0)",
                       "desc: column 44: expected ',' or ')' in TangentAOTInput(...), got end of "
                       "text");
    expect_parse_error("TangentAOTInput(output=PlainAOTOutput(idx=x))",
                       "desc: column 42: expected an integer for 'idx', got 'x))'");
    expect_parse_error("TangentAOTInput(output=None)",
                       "desc: column 23: expected a descriptor, got None");
    expect_parse_error("PlainAOTInput(idx=0) x", "desc: column 21: expected end of text after the "
                                                 "descriptor, got 'x'");
    expect_parse_error("PlainAOTInput(idx=0)PlainAOTInput(idx=1)", "got 'PlainAOTInpu...'");
    expect_parse_error("PlainAOTInput(idx=0\x01)", "got '\\x01)'");
    ag_clear_error();
    assert_null(ag_desc_parse(NULL, NULL));
    assert_int_equal(ag_last_status(), AG_EINVAL);
    tu_assert_error_contains("ag_desc_parse: text is NULL");
    /* deep nesting in text stops at the limit instead of exhausting the stack */
    static char deep[100000];
    size_t k = 0;
    for (int i = 0; i < 2000; i++)
        k += (size_t)snprintf(deep + k, sizeof deep - k, "%s",
                              i % 2 ? "GradAOTOutput(grad_of=" : "TangentAOTInput(output=");
    snprintf(deep + k, sizeof deep - k, "PlainAOTOutput(idx=0)");
    expect_parse_error(deep, "descriptors nest at most 64 levels deep");
}

/* ---- fuzzing: parse never crashes, leaks or accepts what it cannot reprint ---- */

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static uint64_t rng(void) {
    uint64_t x = rng_state;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return rng_state = x;
}

static int fuzz_accepted;

/* Parses text both ways; whatever parses must reprint to text that parses back equal. */
static void fuzz_one(const char *text) {
    for (int mode = 0; mode < 2; mode++) {
        size_t used = 0;
        ag_desc *d = ag_desc_parse(text, mode ? &used : NULL);
        if (!d) {
            assert_true(ag_last_status() == AG_EFORMAT);
            assert_non_null(strstr(ag_last_error(), "desc: column "));
            continue;
        }
        fuzz_accepted++;
        if (mode)
            assert_true(used <= strlen(text));
        char buf[4096];
        if (ag_desc_repr(d, buf, sizeof buf) < sizeof buf) {
            ag_desc *again = ag_desc_parse(buf, NULL);
            assert_non_null(again);
            assert_true(ag_desc_equal(again, d));
            ag_desc_release(again);
        }
        ag_desc_release(d);
    }
}

static void test_parse_fuzz(void **st) {
    (void)st;
    dcase cases[128];
    int n = build_corpus(cases);
    /* the corpus stays alive in the pool; count only what parsing allocates */
    counting_begin();
    static const char subst[] = "()'\",=\\ x0-9_Aa\x80\xff\n";
    char text[4096];
    int64_t runs = 0;
    for (int i = 0; i < n; i++) {
        const char *r = cases[i].repr;
        size_t len = strlen(r);
        for (size_t cut = 0; cut <= len; cut++) { /* every truncation */
            memcpy(text, r, cut);
            text[cut] = 0;
            fuzz_one(text);
            runs++;
        }
        for (size_t pos = 0; pos < len; pos++) {
            for (size_t s = 0; s < sizeof subst - 1; s++) { /* single-byte substitutions */
                memcpy(text, r, len + 1);
                text[pos] = subst[s];
                fuzz_one(text);
                runs++;
            }
            memcpy(text, r, pos); /* deletion */
            memcpy(text + pos, r + pos + 1, len - pos);
            fuzz_one(text);
            memcpy(text, r, pos + 1); /* duplication */
            memcpy(text + pos + 1, r + pos, len - pos + 1);
            fuzz_one(text);
            runs += 2;
        }
    }
    /* random byte strings: raw bytes, and tokens of the grammar glued at random */
    static const char *tokens[] = {
        "PlainAOTInput",
        "TangentAOTInput",
        "GradAOTOutput",
        "SubclassGetAttrAOTInput",
        "ParamAOTInput",
        "PlainAOTOutput",
        "(",
        ")",
        ",",
        "=",
        "idx",
        "target",
        "output",
        "grad_of",
        "base",
        "attr",
        "'a'",
        "\"b\"",
        "'\\x41'",
        "'\\",
        "0",
        "-1",
        " ",
        "'",
        "99999999999999999999",
        "\\u",
        "None",
    };
    for (int i = 0; i < 20000; i++) {
        size_t len = 0, want = rng() % 80;
        if (i % 2) {
            while (len < want) {
                text[len++] = (char)(1 + rng() % 255);
            }
            text[len] = 0;
        } else {
            text[0] = 0;
            while (len < want) {
                const char *t = tokens[rng() % (sizeof tokens / sizeof tokens[0])];
                size_t tl = strlen(t);
                memcpy(text + len, t, tl + 1);
                len += tl;
            }
        }
        fuzz_one(text);
        runs++;
    }
    counting_end_expect_no_leaks();
    print_message("parse fuzz: %lld inputs, %d parsed\n", (long long)runs, fuzz_accepted);
    assert_true(fuzz_accepted > 100); /* mutations that stay valid (digits, string bytes) */
    pool_drain();
}

/* ---- allocation failure injection ---- */

/* Builds a nested descriptor, prints it, parses it back and keys a map with it; returns 0 or
 * the status of the first failure (-99 for a wrong result). Releases everything it made. */
static int scenario_desc(void) {
    int rc = 0;
    ag_desc *b = NULL, *mi = NULL, *t = NULL, *s = NULL, *back = NULL, *g = NULL;
    ag_desc_map *m = NULL;
    char text[1024], ex[1024];
    if (!(b = ag_desc_buffer("bn.running_mean")) || !(mi = ag_desc_input_mutation(b)) ||
        !(t = ag_desc_tangent(mi)) || !(s = ag_desc_subclass_getattr_input(t, "caf\xc3\xa9'\xff")))
        goto fail;
    ag_desc_repr(s, text, sizeof text);
    ag_desc_expr(s, ex, sizeof ex);
    if (strcmp(text, "SubclassGetAttrAOTInput(base=TangentAOTInput(output=InputMutationAOTOutput("
                     "mutated_input=BufferAOTInput(target='bn.running_mean'))), "
                     "attr=\"caf\xc3\xa9'\\udcff\")") ||
        strcmp(ex, "__output_tangent(__input_mutation(self.get_buffer('bn.running_mean'))).caf"
                   "\xc3\xa9'\xff")) {
        rc = -99;
        goto out;
    }
    if (!(back = ag_desc_parse(text, NULL)))
        goto fail;
    if (!ag_desc_equal(back, s)) {
        rc = -99;
        goto out;
    }
    if (!(g = ag_desc_grad(b)) || !(m = ag_desc_map_new()))
        goto fail;
    for (int i = 0; i < 40; i++) { /* enough keys to grow the map twice */
        ag_desc *k = ag_desc_plain_output(i);
        if (!k)
            goto fail;
        rc = ag_desc_map_put(m, k, k);
        ag_desc_release(k);
        if (rc)
            goto out;
    }
    if ((rc = ag_desc_map_put(m, g, NULL)) || (rc = ag_desc_map_put(m, back, NULL)))
        goto out;
    if (ag_desc_map_find(m, s) != 41 || ag_desc_map_size(m) != 42)
        rc = -99;
    goto out;
fail:
    rc = ag_last_status();
out:
    ag_desc_map_free(m);
    ag_desc_release(g);
    ag_desc_release(back);
    ag_desc_release(s);
    ag_desc_release(t);
    ag_desc_release(mi);
    ag_desc_release(b);
    return rc;
}

/* Runs the scenario with the N-th allocation failing for every N until a run reaches no
 * failure: every failing run must report AG_ENOMEM, and nothing may leak. */
static void test_alloc_failures(void **st) {
    (void)st;
    counting_begin();
    assert_int_equal(scenario_desc(), 0);
    assert_int_equal(live, 0);
    int64_t n;
    for (n = 1;; n++) {
        count = 0;
        fail_at = n;
        failed = false;
        ag_clear_error();
        int rc = scenario_desc();
        if (failed) {
            if (rc != AG_ENOMEM || ag_last_status() != AG_ENOMEM) {
                print_error("allocation %lld failed: returned %d (%s)\n", (long long)n, rc,
                            ag_last_error());
                fail();
            }
        } else
            assert_int_equal(rc, 0);
        if (live != 0) {
            print_error("allocation %lld failed: %lld allocations leaked\n", (long long)n,
                        (long long)live);
            fail();
        }
        if (!failed)
            break;
    }
    counting_end_expect_no_leaks();
    print_message("desc scenario: %lld allocation points exercised\n", (long long)n - 1);
    assert_true(n - 1 >= 14); /* 4 builds + parse (3 strings/descs...) + grad + map growth */
}

/* A failed parse at any depth releases what it had built: parse texts that fail after nested
 * descriptors and strings were read. */
static void test_parse_error_cleanup(void **st) {
    (void)st;
    counting_begin();
    const char *bad[] = {
        "SubclassGetAttrAOTInput(base=TangentAOTInput(output=PlainAOTOutput(idx=0)), attr='a', "
        "x=1)",
        "SubclassGetAttrAOTInput(attr='a', base=TangentAOTInput(output=PlainAOTOutput(idx=0)), 3)",
        "SubclassGetAttrAOTInput(attr='a', base=GradAOTOutput(grad_of=PlainAOTInput(idx=0)))",
        "SubclassGetAttrAOTInput(attr='a', attr='b')",
        "SubclassGetAttrAOTInput(attr='a', base=PlainAOTInput(idx=0)) trailing",
        "GradAOTOutput(grad_of=SubclassGetAttrAOTInput(attr='a', base=PlainAOTInput(idx=0)))",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        assert_null(ag_desc_parse(bad[i], NULL));
        assert_int_equal(ag_last_status(), AG_EFORMAT);
    }
    counting_end_expect_no_leaks();
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_repr_expr_every_kind),
        cmocka_unit_test(test_repr_buffer_semantics),
        cmocka_unit_test(test_nesting_exhaustive),
        cmocka_unit_test(test_nesting_messages),
        cmocka_unit_test(test_depth_limit),
        cmocka_unit_test(test_predicates_accessors),
        cmocka_unit_test(test_refcounts),
        cmocka_unit_test(test_refcount_threads),
        cmocka_unit_test(test_equal_hash),
        cmocka_unit_test(test_map),
        cmocka_unit_test(test_parse_roundtrip),
        cmocka_unit_test(test_parse_python_syntax),
        cmocka_unit_test(test_parse_errors),
        cmocka_unit_test(test_parse_error_cleanup),
        cmocka_unit_test(test_parse_fuzz),
        cmocka_unit_test(test_alloc_failures),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
