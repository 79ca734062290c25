/* Allocations of absurd size fail with AG_ENOMEM and a message, through the default allocator
 * (no injected failures, unlike test_alloc.c): a size near SIZE_MAX must not wrap around when
 * rounded up to the data alignment (it returned a 64-byte block), and a compiled plan whose
 * arena cannot exist fails its first run cleanly and stays usable for nothing else. */
#include "testutil.h"
#include "core/internal.h"

#include <stdint.h>
#include <string.h>

/* Under AddressSanitizer a huge malloc aborts the program unless told to return NULL, as the C
 * library does; the tests need the library's behaviour. Unused without ASan. */
const char *__asan_default_options(void);
const char *__asan_default_options(void) {
    return "allocator_may_return_null=1";
}

static void test_malloc_near_size_max(void **state) {
    (void)state;
    /* Sizes whose rounding up to 64 bytes overflows, and ones that merely cannot exist. */
    static const size_t sizes[] = {SIZE_MAX, SIZE_MAX - 8, SIZE_MAX - 63, SIZE_MAX / 2};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        void *p = ag__malloc_data(sizes[i]);
        if (p) {
            ag__free(p);
            fail_msg("ag__malloc_data(%zu) returned a block", sizes[i]);
        }
        assert_int_equal(ag_last_status(), AG_ENOMEM);
        tu_assert_error_contains("out of memory");
        p = ag__malloc(sizes[i]);
        if (p) {
            ag__free(p);
            fail_msg("ag__malloc(%zu) returned a block", sizes[i]);
        }
        assert_int_equal(ag_last_status(), AG_ENOMEM);
    }
}

/* x [1, 1] expanded to [2^24, 2^24] (a view) and squared: the product needs a 2^50-byte
 * (1 PiB) arena, more than any machine maps. */
static const char huge_graph[] = "graph():\n"
                                 "    %x : f32[1, 1]\n"
                                 "    %e = expand(%x, [16777216, 16777216])\n"
                                 "    %m = mul.Tensor(%e, %e)\n"
                                 "    %s = sum.dim_IntList(%m, [0, 1])\n"
                                 "    return (%s,)\n";

static void test_plan_arena_too_large(void **state) {
    (void)state;
    ag_graph *g = ag_graph_parse(huge_graph, strlen(huge_graph));
    if (!g)
        fail_msg("parse: %s", ag_last_error());
    ag_plan *p = ag_plan_new(g, NULL);
    if (!p)
        fail_msg("plan_new: %s", ag_last_error());
    assert_true(ag_plan_peak_bytes(p) >= (int64_t)1 << 50);
    ag_tensor *x = ag_ones(AG_F32, 2, (int64_t[]){1, 1});
    ag_tensor *out = NULL;
    for (int k = 0; k < 2; k++) { /* a second run fails the same way */
        int rc = ag_plan_run(p, &x, 1, &out, 1);
        assert_int_equal(rc, AG_ENOMEM);
        assert_null(out);
        tu_assert_error_contains("out of memory");
    }
    ag_tensor_free(x);
    ag_plan_free(p);
    ag_graph_free(g);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_malloc_near_size_max),
        cmocka_unit_test(test_plan_arena_too_large),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
