/* Placements and sharding rules (include/aotgrad/optable.h, src/ops/shard_rules.c): placement
 * strings round trip and bad ones are refused; each op's rule is checked differentially with no
 * MPI, by simulating W ranks in one process. */
#include "testutil.h"
#include "core/internal.h"
#include "ops/shard_rules.h"

#include <stdio.h>
#include <string.h>

/* ---- placements ---- */

static void test_placement_round_trip(void **st) {
    (void)st;
    const char *texts[] = {"Replicate()",        "Shard(0)",     "Shard(3)",
                           "StridedShard(0, 3)", "Partial(sum)", "Partial(avg)",
                           "StridedShard(2, 12)"};
    for (size_t i = 0; i < sizeof texts / sizeof *texts; i++) {
        ag_placement p;
        assert_int_equal(ag_placement_parse(texts[i], &p), 0);
        char buf[64];
        assert_string_equal(ag_placement_str(p, buf, sizeof buf), texts[i]);
        ag_placement q;
        assert_int_equal(ag_placement_parse(buf, &q), 0);
        assert_true(ag_placement_eq(p, q));
    }
    ag_placement p;
    assert_int_equal(ag_placement_parse("StridedShard(1, 4)", &p), 0);
    assert_int_equal(p.kind, AG_SHARD);
    assert_int_equal(p.dim, 1);
    assert_int_equal(p.split_factor, 4);
    assert_int_equal(ag_placement_parse("Partial(avg)", &p), 0);
    assert_int_equal(p.kind, AG_PARTIAL);
    assert_int_equal(p.op, AG_PARTIAL_AVG);
    /* A split factor of 1 is a plain Shard: equal to 0, printed as Shard. */
    ag_placement a = AG_P_SHARD(1), b = AG_P_SHARD(1);
    b.split_factor = 1;
    assert_true(ag_placement_eq(a, b));
    char buf[32];
    assert_string_equal(ag_placement_str(b, buf, sizeof buf), "Shard(1)");
    assert_false(ag_placement_eq(AG_P_SHARD(0), AG_P_SHARD(1)));
    assert_false(ag_placement_eq(AG_P_SHARD(0), ag__shard_p(0, 2)));
    assert_false(ag_placement_eq(AG_P_PARTIAL(AG_PARTIAL_SUM), AG_P_PARTIAL(AG_PARTIAL_AVG)));
    assert_false(ag_placement_eq(AG_P_REPLICATE, AG_P_PARTIAL(AG_PARTIAL_SUM)));
    assert_true(ag_placement_eq(AG_P_REPLICATE, AG_P_REPLICATE));
    /* Truncation keeps a terminated string. */
    char small[6];
    ag_placement_str(AG_P_REPLICATE, small, sizeof small);
    assert_string_equal(small, "Repli");
}

static void test_placement_refusals(void **st) {
    (void)st;
    struct {
        const char *text, *needle;
    } bad[] = {
        {"", "unknown placement ''"},
        {"replicate()", "unknown placement 'replicate()'"},
        {"Replicate", "unknown placement"},
        {"Shard()", "expected Shard(dim)"},
        {"Shard(-1)", "expected Shard(dim) with a dim >= 0, got 'Shard(-1)'"},
        {"Shard(1", "expected Shard(dim)"},
        {"Shard(1) ", "expected Shard(dim)"},
        {"Shard(99999999999)", "expected Shard(dim)"},
        {"StridedShard(0)", "expected StridedShard(dim, split_factor)"},
        {"StridedShard(0, 1)", "split factor 1 in 'StridedShard(0, 1)' must be at least 2"},
        {"Partial(max)", "unsupported Partial reduce op in 'Partial(max)'"},
        {"Partial()", "unsupported Partial reduce op"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        ag_placement p = AG_P_SHARD(7);
        assert_int_equal(ag_placement_parse(bad[i].text, &p), AG_EINVAL);
        tu_assert_error_contains(bad[i].needle);
        /* A failed parse has no other effect. */
        assert_int_equal(p.kind, AG_SHARD);
        assert_int_equal(p.dim, 7);
    }
    ag_placement p;
    assert_int_equal(ag_placement_parse(NULL, &p), AG_EINVAL);
    tu_assert_error_contains("ag_placement_parse: s is NULL");
    assert_int_equal(ag_placement_parse("Shard(0)", NULL), AG_EINVAL);
}

static void test_divisible(void **st) {
    (void)st;
    assert_true(ag_shard_divisible(8, 4, 0));
    assert_true(ag_shard_divisible(8, 4, 1));
    assert_false(ag_shard_divisible(6, 4, 0));
    assert_true(ag_shard_divisible(12, 2, 3));
    assert_false(ag_shard_divisible(6, 4, 3)); /* 6 % 12 */
    assert_true(ag_shard_divisible(0, 4, 0));
    assert_true(ag_shard_divisible(5, 1, 0));
    assert_false(ag_shard_divisible(5, 0, 0));
    assert_false(ag_shard_divisible(-4, 2, 0));
}

/* ---- rule contexts built from a real call ---- */

#define MAXT 16
typedef struct call {
    const ag_op *op;
    ag_arg args[AG_MAX_ARGS];
    int nargs;
    ag_tensor *tin[MAXT]; /* tensor inputs in schema order (borrowed from args) */
    ag_tmeta in_meta[MAXT];
    ag_placement in[MAXT], want[MAXT];
    ag_tensor *outs[AG_MAX_OUTPUTS];
    ag_tmeta out_meta[AG_MAX_OUTPUTS];
    ag_placement out[AG_MAX_OUTPUTS];
    ag_arg local_args[AG_MAX_ARGS];
    ag_shard_ctx c;
} call;

/* Fills the schema's defaults, runs the op globally, and presets the context as the pass does. */
static void call_init(call *k, const ag_op *op, const ag_arg *args, int nargs, int world,
                      const ag_placement *in) {
    memset(k, 0, sizeof *k);
    k->op = op;
    int n = ag_op_nargs(op);
    for (int a = 0; a < n; a++) {
        if (a < nargs)
            k->args[a] = args[a];
        else
            k->args[a] = ag_op_arg(op, a)->def;
    }
    k->nargs = n;
    int nt = 0;
    for (int a = 0; a < n; a++) {
        if (k->args[a].kind == AG_ARG_TENSOR)
            k->tin[nt++] = k->args[a].u.t;
        else if (k->args[a].kind == AG_ARG_TENSORS)
            for (int e = 0; e < k->args[a].n; e++)
                k->tin[nt++] = k->args[a].u.ts[e];
    }
    for (int i = 0; i < nt; i++) {
        ag__tmeta_of(k->tin[i], &k->in_meta[i]);
        k->in[i] = in ? in[i] : AG_P_REPLICATE;
        k->want[i] = k->in[i];
    }
    int no = ag_op_noutputs(op);
    assert_int_equal(ag_op_call(op, k->args, n, k->outs), 0);
    for (int o = 0; o < no; o++) {
        ag__tmeta_of(k->outs[o], &k->out_meta[o]);
        k->out[o] = AG_P_REPLICATE;
    }
    memcpy(k->local_args, k->args, sizeof k->args);
    k->c = (ag_shard_ctx){.op = ag_op_def(op),
                          .args = k->args,
                          .nargs = n,
                          .ntensor_inputs = nt,
                          .in_meta = k->in_meta,
                          .in = k->in,
                          .noutputs = no,
                          .out_meta = k->out_meta,
                          .world = world,
                          .want = k->want,
                          .out = k->out,
                          .local_args = k->local_args};
}

static void call_free(call *k) {
    for (int o = 0; o < AG_MAX_OUTPUTS; o++)
        ag_tensor_free(k->outs[o]);
}

static void assert_placement(ag_placement got, const char *want) {
    char buf[48];
    ag_placement_str(got, buf, sizeof buf);
    if (strcmp(buf, want))
        fail_msg("placement %s, expected %s", buf, want);
}

static ag_tensor *rnd(int ndim, const int64_t *sizes) {
    static uint64_t state = 0x9e3779b97f4a7c15ull;
    return tu_rand_tensor(AG_F64, ndim, sizes, -1, 1, tu_xorshift, &state);
}

/* Pointwise: follows the sharded input, slices the Replicate() ones, keeps broadcast dims
 * Replicate(); Partial survives only where the op is linear in it. */
static void test_pointwise_structure(void **st) {
    (void)st;
    ag_tensor *a = rnd(2, (int64_t[]){4, 6}), *b = rnd(1, (int64_t[]){6}),
              *b1 = rnd(2, (int64_t[]){1, 6});
    const ag_op *add = ag_op_find("add.Tensor"), *adds = ag_op_find("add.Scalar"),
                *mul = ag_op_find("mul.Tensor"), *div = ag_op_find("div.Tensor"),
                *exp_ = ag_op_find("exp");
    call k;
    call_init(&k, add, (ag_arg[]){AG_A_T(a), AG_A_T(b)}, 2, 2,
              (ag_placement[]){AG_P_SHARD(1), AG_P_REPLICATE});
    assert_int_equal(ag__shard_rule(k.c.op, &k.c), 0);
    assert_placement(k.want[0], "Shard(1)");
    assert_placement(k.want[1], "Shard(0)");
    assert_placement(k.out[0], "Shard(1)");
    call_free(&k);
    /* The broadcast dim of b1 stays Replicate(); the Replicate() input follows the shard. */
    call_init(&k, add, (ag_arg[]){AG_A_T(b1), AG_A_T(a)}, 2, 2,
              (ag_placement[]){AG_P_REPLICATE, AG_P_SHARD(0)});
    assert_int_equal(ag__shard_rule(k.c.op, &k.c), 0);
    assert_placement(k.want[0], "Replicate()");
    assert_placement(k.want[1], "Shard(0)");
    assert_placement(k.out[0], "Shard(0)");
    call_free(&k);
    /* A dim that does not divide is never asked for: 6 on 4 ranks; dim 0 (4) is taken. */
    call_init(&k, add, (ag_arg[]){AG_A_T(a), AG_A_T(a)}, 2, 4,
              (ag_placement[]){AG_P_SHARD(1), AG_P_SHARD(0)});
    assert_int_equal(ag__shard_rule(k.c.op, &k.c), 0);
    assert_placement(k.want[0], "Shard(0)");
    assert_placement(k.want[1], "Shard(0)");
    assert_placement(k.out[0], "Shard(0)");
    call_free(&k);
    ag_placement ps = AG_P_PARTIAL(AG_PARTIAL_SUM), pa = AG_P_PARTIAL(AG_PARTIAL_AVG);
    call_init(&k, add, (ag_arg[]){AG_A_T(a), AG_A_T(b)}, 2, 2, (ag_placement[]){ps, ps});
    assert_int_equal(ag__shard_rule(k.c.op, &k.c), 0);
    assert_placement(k.out[0], "Partial(sum)");
    call_free(&k);
    call_init(&k, add, (ag_arg[]){AG_A_T(a), AG_A_T(b)}, 2, 2, (ag_placement[]){ps, pa});
    assert_int_equal(ag__shard_rule(k.c.op, &k.c), 0);
    assert_placement(k.want[0], "Replicate()");
    assert_placement(k.want[1], "Replicate()");
    assert_placement(k.out[0], "Replicate()");
    call_free(&k);
    call_init(&k, adds, (ag_arg[]){AG_A_T(a), AG_A_F(2)}, 2, 2, (ag_placement[]){ps});
    assert_int_equal(ag__shard_rule(k.c.op, &k.c), 0);
    assert_placement(k.out[0], "Replicate()");
    call_free(&k);
    call_init(&k, adds, (ag_arg[]){AG_A_T(a), AG_A_F(2)}, 2, 2, (ag_placement[]){pa});
    assert_int_equal(ag__shard_rule(k.c.op, &k.c), 0);
    assert_placement(k.out[0], "Partial(avg)");
    call_free(&k);
    call_init(&k, mul, (ag_arg[]){AG_A_T(a), AG_A_T(b)}, 2, 2,
              (ag_placement[]){AG_P_REPLICATE, ps});
    assert_int_equal(ag__shard_rule(k.c.op, &k.c), 0);
    assert_placement(k.out[0], "Partial(sum)");
    call_free(&k);
    call_init(&k, div, (ag_arg[]){AG_A_T(a), AG_A_T(b)}, 2, 2,
              (ag_placement[]){AG_P_REPLICATE, ps});
    assert_int_equal(ag__shard_rule(k.c.op, &k.c), 0);
    assert_placement(k.want[1], "Replicate()");
    assert_placement(k.out[0], "Replicate()");
    call_free(&k);
    /* A Partial input of a non-linear op next to a shard is reduce_scattered to the shard. */
    call_init(&k, add, (ag_arg[]){AG_A_T(a), AG_A_T(a)}, 2, 2, (ag_placement[]){ps, AG_P_SHARD(1)});
    assert_int_equal(ag__shard_rule(k.c.op, &k.c), 0);
    assert_placement(k.want[0], "Shard(1)");
    assert_placement(k.out[0], "Shard(1)");
    call_free(&k);
    call_init(&k, exp_, (ag_arg[]){AG_A_T(a)}, 1, 2, (ag_placement[]){ag__shard_p(1, 3)});
    assert_int_equal(ag__shard_rule(k.c.op, &k.c), 0);
    assert_placement(k.out[0], "StridedShard(1, 3)");
    call_free(&k);
    ag_tensor_free(a);
    ag_tensor_free(b);
    ag_tensor_free(b1);
}

/* A rule that asks for an uneven shard is refused, and the context is left as preset. */
static int uneven_rule(ag_shard_ctx *c) {
    c->want[0] = AG_P_SHARD(1);
    c->out[0] = AG_P_SHARD(1);
    return 0;
}

static void test_rule_contract_checked(void **st) {
    (void)st;
    ag_tensor *a = rnd(2, (int64_t[]){4, 6});
    const ag_op *exp_ = ag_op_find("exp");
    ag_opdef bad = *ag_op_def(exp_);
    bad.shard = uneven_rule;
    call k;
    call_init(&k, exp_, (ag_arg[]){AG_A_T(a)}, 1, 4, (ag_placement[]){AG_P_SHARD(0)});
    assert_int_equal(ag__shard_rule(&bad, &k.c), AG_EINVAL);
    tu_assert_error_contains("shard rule of exp asked for Shard(1) of input 0 of shape [4, 6] "
                             "on 4 ranks");
    assert_placement(k.want[0], "Shard(0)");
    assert_placement(k.out[0], "Replicate()");
    call_free(&k);
    /* Views and in-place ops have no default rule. */
    const ag_op *add_ = ag_op_find("add_.Tensor");
    ag_tensor *c2 = rnd(2, (int64_t[]){4, 6});
    call_init(&k, add_, (ag_arg[]){AG_A_T(c2), AG_A_T(a)}, 2, 2, NULL);
    assert_int_equal(ag__shard_rule(k.c.op, &k.c), AG_SHARD_NO_RULE);
    call_free(&k);
    ag_tensor_free(c2);
    ag_tensor_free(a);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_placement_round_trip),
        cmocka_unit_test(test_placement_refusals),
        cmocka_unit_test(test_divisible),
        cmocka_unit_test(test_pointwise_structure),
        cmocka_unit_test(test_rule_contract_checked),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
