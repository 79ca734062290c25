/* Placements and sharding rules (include/aotgrad/optable.h, src/ops/shard_rules.c): placement
 * strings round trip and bad ones are refused; each op's rule is checked differentially with no
 * MPI, by simulating W ranks in one process. */
#include "testutil.h"
#include "core/internal.h"
#include "ops/shard_rules.h"
#include "aotgrad/export.h"
#include "aotgrad/graph.h"
#include "aotgrad/zoo.h"

#include <stdio.h>
#include <stdlib.h>
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
        else if (k->args[a].kind == AG_ARG_NONE && ag_op_arg(op, a)->type == AG_TY_OPT_TENSOR)
            k->tin[nt++] = NULL; /* an omitted Tensor? takes its number */
    }
    for (int i = 0; i < nt; i++) {
        if (k->tin[i])
            ag__tmeta_of(k->tin[i], &k->in_meta[i]);
        k->in[i] = in ? in[i] : AG_P_REPLICATE;
        k->want[i] = k->in[i];
    }
    int no = ag_op_noutputs(op);
    if (ag_op_call(op, k->args, n, k->outs) < 0)
        fail_msg("%s: %s", ag_op_name(op), ag_last_error());
    if (no < 0) /* a Tensor[] result */
        for (no = 0; no < AG_MAX_OUTPUTS && k->outs[no]; no++)
            ;
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
    assert_int_equal(ag_op_shard_rule(k.c.op, &k.c), 0);
    assert_placement(k.want[0], "Shard(1)");
    assert_placement(k.want[1], "Shard(0)");
    assert_placement(k.out[0], "Shard(1)");
    call_free(&k);
    /* The broadcast dim of b1 stays Replicate(); the Replicate() input follows the shard. */
    call_init(&k, add, (ag_arg[]){AG_A_T(b1), AG_A_T(a)}, 2, 2,
              (ag_placement[]){AG_P_REPLICATE, AG_P_SHARD(0)});
    assert_int_equal(ag_op_shard_rule(k.c.op, &k.c), 0);
    assert_placement(k.want[0], "Replicate()");
    assert_placement(k.want[1], "Shard(0)");
    assert_placement(k.out[0], "Shard(0)");
    call_free(&k);
    /* A dim that does not divide is never asked for: 6 on 4 ranks; dim 0 (4) is taken. */
    call_init(&k, add, (ag_arg[]){AG_A_T(a), AG_A_T(a)}, 2, 4,
              (ag_placement[]){AG_P_SHARD(1), AG_P_SHARD(0)});
    assert_int_equal(ag_op_shard_rule(k.c.op, &k.c), 0);
    assert_placement(k.want[0], "Shard(0)");
    assert_placement(k.want[1], "Shard(0)");
    assert_placement(k.out[0], "Shard(0)");
    call_free(&k);
    ag_placement ps = AG_P_PARTIAL(AG_PARTIAL_SUM), pa = AG_P_PARTIAL(AG_PARTIAL_AVG);
    call_init(&k, add, (ag_arg[]){AG_A_T(a), AG_A_T(b)}, 2, 2, (ag_placement[]){ps, ps});
    assert_int_equal(ag_op_shard_rule(k.c.op, &k.c), 0);
    assert_placement(k.out[0], "Partial(sum)");
    call_free(&k);
    call_init(&k, add, (ag_arg[]){AG_A_T(a), AG_A_T(b)}, 2, 2, (ag_placement[]){ps, pa});
    assert_int_equal(ag_op_shard_rule(k.c.op, &k.c), 0);
    assert_placement(k.want[0], "Replicate()");
    assert_placement(k.want[1], "Replicate()");
    assert_placement(k.out[0], "Replicate()");
    call_free(&k);
    call_init(&k, adds, (ag_arg[]){AG_A_T(a), AG_A_F(2)}, 2, 2, (ag_placement[]){ps});
    assert_int_equal(ag_op_shard_rule(k.c.op, &k.c), 0);
    assert_placement(k.out[0], "Replicate()");
    call_free(&k);
    call_init(&k, adds, (ag_arg[]){AG_A_T(a), AG_A_F(2)}, 2, 2, (ag_placement[]){pa});
    assert_int_equal(ag_op_shard_rule(k.c.op, &k.c), 0);
    assert_placement(k.out[0], "Partial(avg)");
    call_free(&k);
    call_init(&k, mul, (ag_arg[]){AG_A_T(a), AG_A_T(b)}, 2, 2,
              (ag_placement[]){AG_P_REPLICATE, ps});
    assert_int_equal(ag_op_shard_rule(k.c.op, &k.c), 0);
    assert_placement(k.out[0], "Partial(sum)");
    call_free(&k);
    call_init(&k, div, (ag_arg[]){AG_A_T(a), AG_A_T(b)}, 2, 2,
              (ag_placement[]){AG_P_REPLICATE, ps});
    assert_int_equal(ag_op_shard_rule(k.c.op, &k.c), 0);
    assert_placement(k.want[1], "Replicate()");
    assert_placement(k.out[0], "Replicate()");
    call_free(&k);
    /* A Partial input of a non-linear op next to a shard is reduce_scattered to the shard. */
    call_init(&k, add, (ag_arg[]){AG_A_T(a), AG_A_T(a)}, 2, 2, (ag_placement[]){ps, AG_P_SHARD(1)});
    assert_int_equal(ag_op_shard_rule(k.c.op, &k.c), 0);
    assert_placement(k.want[0], "Shard(1)");
    assert_placement(k.out[0], "Shard(1)");
    call_free(&k);
    call_init(&k, exp_, (ag_arg[]){AG_A_T(a)}, 1, 2, (ag_placement[]){ag__shard_p(1, 3)});
    assert_int_equal(ag_op_shard_rule(k.c.op, &k.c), 0);
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
    assert_int_equal(ag_op_shard_rule(&bad, &k.c), AG_EINVAL);
    tu_assert_error_contains("shard rule of exp asked for Shard(1) of input 0 of shape [4, 6] "
                             "on 4 ranks");
    assert_placement(k.want[0], "Shard(0)");
    assert_placement(k.out[0], "Replicate()");
    call_free(&k);
    /* Views and in-place ops have no default rule. */
    const ag_op *add_ = ag_op_find("add_.Tensor");
    ag_tensor *c2 = rnd(2, (int64_t[]){4, 6});
    call_init(&k, add_, (ag_arg[]){AG_A_T(c2), AG_A_T(a)}, 2, 2, NULL);
    assert_int_equal(ag_op_shard_rule(k.c.op, &k.c), AG_SHARD_NO_RULE);
    call_free(&k);
    ag_tensor_free(c2);
    ag_tensor_free(a);
}

/* ---- the differential check: W ranks simulated in one process ---- */

static uint64_t rng_state = 12345;

/* Rank r's chunk of t for Shard(d, k): dim d cut into k blocks, chunk r of each, in order. */
static ag_tensor *chunk_of(ag_tensor *t, ag_placement p, int W, int r) {
    int k = ag__shard_sf(p), d = p.dim;
    int64_t bs = ag_tensor_size(t, d) / k, cs = bs / W;
    ag_tensor *parts[64];
    for (int b = 0; b < k; b++)
        parts[b] = ag_slice(t, d, b * bs + r * cs, b * bs + (r + 1) * cs, 1);
    return k == 1 ? ag_clone(parts[0]) : ag_cat(parts, k, d);
}

/* The global tensor from the ranks' chunks (the inverse of chunk_of). */
static ag_tensor *unchunk(ag_tensor *const *loc, ag_placement p, int W) {
    int k = ag__shard_sf(p), d = p.dim;
    int64_t cs = ag_tensor_size(loc[0], d) / k;
    ag_tensor *parts[256];
    int n = 0;
    for (int b = 0; b < k; b++)
        for (int r = 0; r < W; r++)
            parts[n++] = ag_slice(loc[r], d, b * cs, (b + 1) * cs, 1);
    return ag_cat(parts, n, d);
}

static bool same_shape(const ag_tensor *a, const ag_tensor *b) {
    if (ag_tensor_ndim(a) != ag_tensor_ndim(b))
        return false;
    for (int d = 0; d < ag_tensor_ndim(a); d++)
        if (ag_tensor_size(a, d) != ag_tensor_size(b, d))
            return false;
    return true;
}

typedef struct diff_stats {
    int applied, no_rule, failures;
} diff_stats;

static bool is_float(const ag_tensor *t) {
    return t && (ag_tensor_dtype(t) == AG_F64 || ag_tensor_dtype(t) == AG_F32);
}

/* Runs the rule for input placements `in` on W ranks; where it applies, checks the ranks'
 * outputs combine per `out` into the global outputs. Returns false on a mismatch (printed). */
static bool diff_one(const ag_op *op, const ag_opdef *def, const ag_arg *args, int nargs, int W,
                     const ag_placement *in, diff_stats *st, const char *note) {
    ag_scope_begin();
    call *k = calloc(1, sizeof *k);
    call_init(k, op, args, nargs, W, in);
    int rc = ag_op_shard_rule(def, &k->c);
    bool ok = true;
    char pb[64], pw[64];
    if (rc == AG_SHARD_NO_RULE) {
        st->no_rule++;
        goto done;
    }
    if (rc != 0) {
        print_error("%s (%s): rule failed: %s\n", ag_op_name(op), note, ag_last_error());
        ok = false;
        goto done;
    }
    st->applied++;
    int nt = k->c.ntensor_inputs, no = k->c.noutputs;
    /* Each input's per-rank pieces. */
    ag_tensor *loc_in[MAXT][8] = {{0}};
    for (int i = 0; i < nt; i++) {
        ag_tensor *t = k->tin[i];
        ag_placement w = k->want[i];
        for (int r = 0; r < W; r++) {
            if (!t || w.kind == AG_REPLICATE)
                loc_in[i][r] = t;
            else if (w.kind == AG_SHARD)
                loc_in[i][r] = chunk_of(t, w, W, r);
        }
        if (t && w.kind == AG_PARTIAL) {
            /* Random pieces summing to t (sum) or to W t (avg), the last one closing the gap. */
            ag_tensor *acc = ag_zeros_like(t);
            for (int r = 0; r < W - 1; r++) {
                loc_in[i][r] = tu_rand_tensor(ag_tensor_dtype(t), ag_tensor_ndim(t),
                                              k->in_meta[i].sizes, -1, 1, tu_xorshift, &rng_state);
                acc = ag_add(acc, loc_in[i][r]);
            }
            ag_tensor *whole = w.op == AG_PARTIAL_AVG ? ag_mul_scalar(t, W) : t;
            loc_in[i][W - 1] = ag_sub(whole, acc);
        }
    }
    ag_tensor *loc_out[AG_MAX_OUTPUTS][8] = {{0}};
    for (int r = 0; r < W; r++) {
        ag_arg la[AG_MAX_ARGS];
        ag_tensor *lists[AG_MAX_ARGS][MAXT];
        int ti = 0;
        for (int a = 0; a < k->nargs; a++) {
            la[a] = k->local_args[a];
            if (k->args[a].kind == AG_ARG_TENSOR) {
                la[a] = AG_A_T(loc_in[ti++][r]);
            } else if (k->args[a].kind == AG_ARG_TENSORS) {
                for (int e = 0; e < k->args[a].n; e++)
                    lists[a][e] = loc_in[ti++][r];
                la[a] = AG_A_TS(lists[a], k->args[a].n);
            } else if (k->args[a].kind == AG_ARG_NONE && ti < nt && !k->tin[ti] &&
                       (ag_op_arg(op, a)->type == AG_TY_OPT_TENSOR)) {
                ti++;
            }
        }
        ag_tensor *outs[AG_MAX_OUTPUTS] = {0};
        if (ag_op_call(op, la, k->nargs, outs) < 0) {
            print_error("%s (%s): local call on rank %d failed: %s\n", ag_op_name(op), note, r,
                        ag_last_error());
            ok = false;
            goto done;
        }
        for (int o = 0; o < no; o++)
            loc_out[o][r] = outs[o];
    }
    for (int o = 0; o < no; o++) {
        ag_tensor *g = k->outs[o];
        if (!g || !loc_out[o][0])
            continue;
        ag_placement p = k->out[o];
        ag_tensor *comb = NULL;
        if (p.kind == AG_SHARD) {
            for (int r = 0; r < W; r++)
                for (int d = 0; d < ag_tensor_ndim(g); d++) {
                    int64_t want = ag_tensor_size(g, d) / (d == p.dim ? W : 1);
                    if (ag_tensor_size(loc_out[o][r], d) != want) {
                        print_error("%s (%s): output %d on rank %d has size %lld on dim %d, "
                                    "expected %lld\n",
                                    ag_op_name(op), note, o, r,
                                    (long long)ag_tensor_size(loc_out[o][r], d), d,
                                    (long long)want);
                        ok = false;
                        goto done;
                    }
                }
            comb = unchunk(loc_out[o], p, W);
        } else if (p.kind == AG_PARTIAL) {
            comb = loc_out[o][0];
            for (int r = 1; r < W; r++)
                comb = ag_add(comb, loc_out[o][r]);
            if (p.op == AG_PARTIAL_AVG)
                comb = ag_div_scalar(comb, W);
        } else {
            for (int r = 1; r < W; r++)
                if (!same_shape(loc_out[o][r], g) ||
                    tu_max_abs_diff(loc_out[o][r], loc_out[o][0]) > 1e-10) {
                    print_error("%s (%s): Replicate() output %d differs between ranks\n",
                                ag_op_name(op), note, o);
                    ok = false;
                }
            comb = loc_out[o][0];
        }
        if (!comb || !same_shape(comb, g)) {
            ok = false;
        } else {
            double scale = 1;
            double diff = tu_max_abs_diff(comb, g);
            if (diff > 1e-10 * scale)
                ok = false;
        }
        if (!ok) {
            print_error("%s (%s): W=%d output %d as %s does not match the global op\n",
                        ag_op_name(op), note, W, o, ag_placement_str(p, pb, sizeof pb));
            for (int i = 0; i < nt; i++)
                print_error("  input %d: %s -> %s\n", i, ag_placement_str(k->in[i], pw, sizeof pw),
                            ag_placement_str(k->want[i], pb, sizeof pb));
            goto done;
        }
    }
done:
    free(k);
    ag_scope_end();
    if (!ok)
        st->failures++;
    return ok;
}

/* The placements worth trying for tensor input t on W ranks. */
static int placements_for(const ag_tensor *t, int W, ag_placement *out, int max) {
    int n = 0;
    out[n++] = AG_P_REPLICATE;
    if (!t)
        return n;
    for (int d = 0; d < ag_tensor_ndim(t) && n < max; d++) {
        if (ag_shard_divisible(ag_tensor_size(t, d), W, 0))
            out[n++] = AG_P_SHARD(d);
        for (int kf = 2; kf <= 3 && n < max; kf++)
            if (ag_shard_divisible(ag_tensor_size(t, d), W, kf))
                out[n++] = ag__shard_p(d, kf);
    }
    if (is_float(t) && n + 2 <= max) {
        out[n++] = AG_P_PARTIAL(AG_PARTIAL_SUM);
        out[n++] = AG_P_PARTIAL(AG_PARTIAL_AVG);
    }
    return n;
}

/* Every combination of input placements (or, past 400 of them, each input's placements with
 * the others Replicate() plus all inputs alike) for one call on W ranks. */
static void diff_call(const ag_op *op, const ag_opdef *def, const ag_arg *args, int nargs, int W,
                      diff_stats *st, const char *note) {
    ag_tensor *tin[MAXT];
    int nt = 0;
    int n = ag_op_nargs(op);
    for (int a = 0; a < n; a++) {
        ag_arg v = a < nargs ? args[a] : ag_op_arg(op, a)->def;
        if (v.kind == AG_ARG_TENSOR)
            tin[nt++] = v.u.t;
        else if (v.kind == AG_ARG_TENSORS)
            for (int e = 0; e < v.n; e++)
                tin[nt++] = v.u.ts[e];
        else if (v.kind == AG_ARG_NONE && ag_op_arg(op, a)->type == AG_TY_OPT_TENSOR)
            tin[nt++] = NULL;
    }
    ag_placement opts[MAXT][32];
    int nopt[MAXT];
    double combos = 1;
    for (int i = 0; i < nt; i++) {
        nopt[i] = placements_for(tin[i], W, opts[i], 32);
        combos *= nopt[i];
    }
    ag_placement in[MAXT];
    if (combos <= 400) {
        int idx[MAXT] = {0};
        for (;;) {
            for (int i = 0; i < nt; i++)
                in[i] = opts[i][idx[i]];
            diff_one(op, def, args, nargs, W, in, st, note);
            int i = 0;
            while (i < nt && ++idx[i] == nopt[i])
                idx[i++] = 0;
            if (i == nt)
                break;
        }
        return;
    }
    for (int i = 0; i < nt; i++)
        for (int j = 1; j < nopt[i]; j++) {
            for (int q = 0; q < nt; q++)
                in[q] = AG_P_REPLICATE;
            in[i] = opts[i][j];
            diff_one(op, def, args, nargs, W, in, st, note);
        }
    for (int j = 1; j < nopt[0]; j++) {
        for (int q = 0; q < nt; q++)
            in[q] = tin[q] && nopt[q] > j && ag_placement_eq(opts[q][j], opts[0][j])
                        ? opts[0][j]
                        : AG_P_REPLICATE;
        diff_one(op, def, args, nargs, W, in, st, note);
    }
}

/* ---- the ops' rules, differentially ---- */

static diff_stats stats;

/* Checks op `name` on 2 and 4 ranks for every combination of input placements. */
static void check(const char *name, const ag_arg *args, int nargs, const char *note) {
    const ag_op *op = ag_op_find(name);
    if (!op)
        fail_msg("no op %s", name);
    diff_stats before = stats;
    for (int W = 2; W <= 4; W += 2)
        diff_call(op, ag_op_def(op), args, nargs, W, &stats, note);
    if (stats.failures != before.failures)
        fail_msg("%s (%s): %d placement combinations disagree with the global op", name, note,
                 stats.failures - before.failures);
    if (stats.applied == before.applied)
        fail_msg("%s (%s): the rule never applied", name, note);
}

static ag_tensor *R2(int64_t a, int64_t b) {
    return rnd(2, (int64_t[]){a, b});
}
static ag_tensor *R3(int64_t a, int64_t b, int64_t c) {
    return rnd(3, (int64_t[]){a, b, c});
}
static ag_tensor *R4(int64_t a, int64_t b, int64_t c, int64_t d) {
    return rnd(4, (int64_t[]){a, b, c, d});
}
static ag_tensor *idx_tensor(int ndim, const int64_t *sizes, int64_t hi) {
    int64_t n = 1;
    for (int d = 0; d < ndim; d++)
        n *= sizes[d];
    int64_t v[256];
    for (int64_t i = 0; i < n; i++)
        v[i] = (int64_t)(tu_xorshift(&rng_state, 0, (double)hi));
    return ag_from_data(AG_I64, ndim, sizes, v);
}

static void test_rules_pointwise(void **st) {
    (void)st;
    ag_scope_begin();
    ag_tensor *a = R2(4, 8), *b = rnd(1, (int64_t[]){8}), *c = R2(1, 8);
    check("add.Tensor", (ag_arg[]){AG_A_T(a), AG_A_T(b), AG_A_F(0.5)}, 3, "broadcast, alpha");
    check("sub.Tensor", (ag_arg[]){AG_A_T(c), AG_A_T(a)}, 2, "broadcast size 1");
    check("mul.Tensor", (ag_arg[]){AG_A_T(a), AG_A_T(b)}, 2, "broadcast");
    check("div.Tensor", (ag_arg[]){AG_A_T(a), AG_A_T(ag_add_scalar(ag_mul(b, b), 1))}, 2, "");
    check("add.Scalar", (ag_arg[]){AG_A_T(a), AG_A_F(2)}, 2, "");
    check("sub.Scalar", (ag_arg[]){AG_A_T(a), AG_A_F(2)}, 2, "");
    check("mul.Scalar", (ag_arg[]){AG_A_T(a), AG_A_F(3)}, 2, "");
    check("div.Scalar", (ag_arg[]){AG_A_T(a), AG_A_F(3)}, 2, "");
    check("neg", (ag_arg[]){AG_A_T(a)}, 1, "");
    check("relu", (ag_arg[]){AG_A_T(a)}, 1, "");
    check("gelu", (ag_arg[]){AG_A_T(a), AG_A_S("tanh")}, 2, "");
    check("threshold_backward", (ag_arg[]){AG_A_T(a), AG_A_T(R2(4, 8)), AG_A_F(0)}, 3, "");
    check("gelu_backward", (ag_arg[]){AG_A_T(a), AG_A_T(R2(4, 8))}, 2, "");
    ag_scope_end();
}

static void test_rules_views(void **st) {
    (void)st;
    ag_scope_begin();
    ag_tensor *a = R2(4, 8), *b = R3(4, 8, 4);
    check("t", (ag_arg[]){AG_A_T(a)}, 1, "");
    check("transpose.int", (ag_arg[]){AG_A_T(b), AG_A_I(0), AG_A_I(-1)}, 3, "");
    check("permute", (ag_arg[]){AG_A_T(b), AG_A_INTS(((int64_t[]){2, 0, 1}), 3)}, 2, "");
    check("view", (ag_arg[]){AG_A_T(R3(4, 8, 12)), AG_A_INTS(((int64_t[]){32, 12}), 2)}, 2,
          "flatten [B, T, 3C]");
    check("view", (ag_arg[]){AG_A_T(R2(32, 12)), AG_A_INTS(((int64_t[]){4, 8, 12}), 3)}, 2,
          "unflatten [B*T, 3C]");
    check("view", (ag_arg[]){AG_A_T(R3(4, 4, 16)), AG_A_INTS(((int64_t[]){4, 4, 4, 4}), 4)}, 2,
          "head split [B, T, C] -> [B, T, H, D]");
    check("view", (ag_arg[]){AG_A_T(R4(4, 4, 4, 4)), AG_A_INTS(((int64_t[]){4, 4, 16}), 3)}, 2,
          "head merge");
    check("view", (ag_arg[]){AG_A_T(R2(4, 12)), AG_A_INTS(((int64_t[]){48}), 1)}, 2, "flatten all");
    check("view", (ag_arg[]){AG_A_T(R3(4, 1, 8)), AG_A_INTS(((int64_t[]){4, 8, 1}), 3)}, 2,
          "size-1 dims");
    check("expand", (ag_arg[]){AG_A_T(R2(1, 8)), AG_A_INTS(((int64_t[]){4, 8}), 2)}, 2, "");
    check("expand", (ag_arg[]){AG_A_T(rnd(1, (int64_t[]){8})), AG_A_INTS(((int64_t[]){4, 8}), 2)},
          2, "new dim");
    check("clone", (ag_arg[]){AG_A_T(a)}, 1, "");
    check("alias", (ag_arg[]){AG_A_T(a)}, 1, "");
    check("unsqueeze", (ag_arg[]){AG_A_T(a), AG_A_I(1)}, 2, "");
    check("squeeze.dim", (ag_arg[]){AG_A_T(R3(4, 1, 8)), AG_A_I(1)}, 2, "");
    check("squeeze", (ag_arg[]){AG_A_T(R3(4, 1, 8))}, 1, "");
    check("slice.Tensor", (ag_arg[]){AG_A_T(R2(8, 8)), AG_A_I(1), AG_A_I(2), AG_A_I(6), AG_A_I(1)},
          5, "");
    check("select.int", (ag_arg[]){AG_A_T(b), AG_A_I(1), AG_A_I(3)}, 3, "");
    ag_scope_end();
}

static void test_rules_reductions(void **st) {
    (void)st;
    ag_scope_begin();
    ag_tensor *a = R3(4, 8, 4);
    check("sum.dim_IntList", (ag_arg[]){AG_A_T(a), AG_A_INTS(((int64_t[]){0}), 1)}, 2, "dim 0");
    check("sum.dim_IntList",
          (ag_arg[]){AG_A_T(a), AG_A_INTS(((int64_t[]){-1, 1}), 2), AG_A_B(true)}, 3, "keepdim");
    check("sum.dim_IntList", (ag_arg[]){AG_A_T(a), AG_A_NONE}, 2, "all");
    check("mean.dim", (ag_arg[]){AG_A_T(a), AG_A_INTS(((int64_t[]){1}), 1)}, 2, "");
    check("_log_softmax", (ag_arg[]){AG_A_T(a), AG_A_I(1), AG_A_B(false)}, 3, "");
    check("_softmax", (ag_arg[]){AG_A_T(a), AG_A_I(-1), AG_A_B(false)}, 3, "");
    ag_tensor *ls = ag_log_softmax(a, 1), *sm = ag_softmax(a, 2);
    check("_log_softmax_backward_data",
          (ag_arg[]){AG_A_T(R3(4, 8, 4)), AG_A_T(ls), AG_A_I(1), AG_A_DT(AG_F64)}, 4, "");
    check("_softmax_backward_data",
          (ag_arg[]){AG_A_T(R3(4, 8, 4)), AG_A_T(sm), AG_A_I(2), AG_A_DT(AG_F64)}, 4, "");
    ag_scope_end();
}

static void test_rules_linalg(void **st) {
    (void)st;
    ag_scope_begin();
    check("mm", (ag_arg[]){AG_A_T(R2(8, 4)), AG_A_T(R2(4, 12))}, 2, "");
    check("bmm", (ag_arg[]){AG_A_T(R3(4, 8, 4)), AG_A_T(R3(4, 4, 8))}, 2, "");
    check("addmm",
          (ag_arg[]){AG_A_T(rnd(1, (int64_t[]){12})), AG_A_T(R2(8, 4)), AG_A_T(R2(4, 12)),
                     AG_A_F(0.5), AG_A_F(2)},
          5, "bias");
    check("addmm", (ag_arg[]){AG_A_T(R2(8, 12)), AG_A_T(R2(8, 4)), AG_A_T(R2(4, 12))}, 3,
          "full self");
    ag_scope_end();
}

static void test_rules_nn(void **st) {
    (void)st;
    ag_scope_begin();
    /* layer norm over the last dim of [B, T, C] */
    ag_tensor *x = R3(4, 4, 8), *w = rnd(1, (int64_t[]){8}), *bb = rnd(1, (int64_t[]){8});
    ag_arg ln[] = {AG_A_T(x), AG_A_INTS(((int64_t[]){8}), 1), AG_A_T(w), AG_A_T(bb), AG_A_F(1e-5)};
    check("native_layer_norm", ln, 5, "");
    ag_tensor *lo[3];
    assert_int_equal(ag_op_call(ag_op_find("native_layer_norm"), ln, 5, lo), 0);
    check("native_layer_norm_backward",
          (ag_arg[]){AG_A_T(R3(4, 4, 8)), AG_A_T(x), AG_A_INTS(((int64_t[]){8}), 1), AG_A_T(lo[1]),
                     AG_A_T(lo[2]), AG_A_T(w), AG_A_T(bb), AG_A_INTS(((int64_t[]){1, 1, 1}), 3)},
          8, "");
    /* embedding [V, D] with indices [B, T] */
    ag_tensor *emb = R2(12, 8), *ix = idx_tensor(2, (int64_t[]){4, 8}, 12);
    check("embedding", (ag_arg[]){AG_A_T(emb), AG_A_T(ix)}, 2, "");
    check("embedding_dense_backward",
          (ag_arg[]){AG_A_T(R3(4, 8, 8)), AG_A_T(ix), AG_A_I(12), AG_A_I(-1), AG_A_B(false)}, 5,
          "");
    /* gather along dim 1 (the decomposed nll_loss's pick of each row's target) and along dim
     * 0; index_select of rows (the class weights of the targets) and of columns */
    check("gather",
          (ag_arg[]){AG_A_T(R2(8, 4)), AG_A_I(1), AG_A_T(idx_tensor(2, (int64_t[]){8, 1}, 4))}, 3,
          "dim 1");
    check("gather",
          (ag_arg[]){AG_A_T(R2(8, 4)), AG_A_I(0), AG_A_T(idx_tensor(2, (int64_t[]){4, 4}, 8))}, 3,
          "dim 0, fewer rows");
    check("index_select",
          (ag_arg[]){AG_A_T(R2(6, 4)), AG_A_I(0), AG_A_T(idx_tensor(1, (int64_t[]){8}, 6))}, 3,
          "rows");
    check("index_select",
          (ag_arg[]){AG_A_T(R2(8, 6)), AG_A_I(-1), AG_A_T(idx_tensor(1, (int64_t[]){4}, 6))}, 3,
          "columns");
    /* nll loss: log-probs [N, C], targets [N] (one ignored) */
    ag_tensor *lp = ag_log_softmax(R2(8, 4), 1);
    int64_t tv[] = {0, 3, 1, -100, 2, 2, 1, 0};
    ag_tensor *tg = ag_from_data(AG_I64, 1, (int64_t[]){8}, tv);
    for (int red = 0; red <= 2; red++) {
        ag_arg a[] = {AG_A_T(lp), AG_A_T(tg), AG_A_NONE, AG_A_I(red), AG_A_I(-100)};
        ag_tensor *o[2];
        assert_int_equal(ag_op_call(ag_op_find("nll_loss_forward"), a, 5, o), 0);
        if (red != 1)
            check("nll_loss_forward", a, 5, red ? "sum" : "none");
        ag_tensor *go = red == 0 ? rnd(1, (int64_t[]){8}) : rnd(0, NULL);
        check("nll_loss_backward",
              (ag_arg[]){AG_A_T(go), AG_A_T(lp), AG_A_T(tg), AG_A_NONE, AG_A_I(red), AG_A_I(-100),
                         AG_A_T(o[1])},
              7,
              red == 0   ? "none"
              : red == 1 ? "mean"
                         : "sum");
    }
    ag_scope_end();
}

static void test_rules_attention_conv(void **st) {
    (void)st;
    ag_scope_begin();
    ag_tensor *q = R4(4, 4, 8, 4), *k = R4(4, 4, 8, 4), *v = R4(4, 4, 8, 4);
    const ag_op *sd = ag_op_find("_scaled_dot_product_flash_attention_for_cpu");
    for (int causal = 0; causal <= 1; causal++) {
        ag_arg a[] = {AG_A_T(q), AG_A_T(k), AG_A_T(v), AG_A_F(0), AG_A_B(causal)};
        check(ag_op_name(sd), a, 5, causal ? "causal" : "");
        ag_tensor *o[2];
        assert_int_equal(ag_op_call(sd, a, 5, o), 0);
        check("_scaled_dot_product_flash_attention_for_cpu_backward",
              (ag_arg[]){AG_A_T(R4(4, 4, 8, 4)), AG_A_T(q), AG_A_T(k), AG_A_T(v), AG_A_T(o[0]),
                         AG_A_T(o[1]), AG_A_F(0), AG_A_B(causal)},
              8, causal ? "causal" : "");
    }
    ag_tensor *x = R4(4, 4, 6, 6), *w = R4(8, 4, 3, 3), *b = rnd(1, (int64_t[]){8});
    int64_t one[] = {1, 1}, zero[] = {0, 0};
    ag_arg cv[] = {AG_A_T(x),         AG_A_T(w),          AG_A_T(b),
                   AG_A_INTS(one, 2), AG_A_INTS(one, 2),  AG_A_INTS(one, 2),
                   AG_A_B(false),     AG_A_INTS(zero, 2), AG_A_I(1)};
    check("convolution", cv, 9, "");
    int64_t bsz[] = {8};
    ag_arg cb[] = {AG_A_T(R4(4, 8, 6, 6)),
                   AG_A_T(x),
                   AG_A_T(w),
                   AG_A_INTS(bsz, 1),
                   AG_A_INTS(one, 2),
                   AG_A_INTS(one, 2),
                   AG_A_INTS(one, 2),
                   AG_A_B(false),
                   AG_A_INTS(zero, 2),
                   AG_A_I(1),
                   AG_A_INTS(((int64_t[]){1, 1, 1}), 3)};
    check("convolution_backward", cb, 11, "");
    ag_tensor *px = R4(4, 4, 8, 8);
    int64_t two[] = {2, 2};
    ag_arg mp[] = {AG_A_T(px), AG_A_INTS(two, 2), AG_A_INTS(two, 2)};
    check("max_pool2d_with_indices", mp, 3, "");
    ag_tensor *po[2];
    assert_int_equal(ag_op_call(ag_op_find("max_pool2d_with_indices"), mp, 3, po), 0);
    check("max_pool2d_with_indices_backward",
          (ag_arg[]){AG_A_T(R4(4, 4, 4, 4)), AG_A_T(px), AG_A_INTS(two, 2), AG_A_INTS(two, 2),
                     AG_A_INTS(zero, 2), AG_A_INTS(one, 2), AG_A_B(false), AG_A_T(po[1])},
          8, "");
    ag_scope_end();
}

static void test_rules_split_cat_factories(void **st) {
    (void)st;
    ag_scope_begin();
    ag_tensor *qkv = R2(4, 24);
    check("split.Tensor", (ag_arg[]){AG_A_T(qkv), AG_A_I(8), AG_A_I(1)}, 3, "q/k/v");
    check("split.Tensor", (ag_arg[]){AG_A_T(qkv), AG_A_I(2), AG_A_I(0)}, 3, "other dim");
    ag_tensor *parts[] = {R2(4, 8), R2(4, 8), R2(4, 8)};
    check("cat", (ag_arg[]){AG_A_TS(parts, 3), AG_A_I(1)}, 2, "dim 1");
    check("cat", (ag_arg[]){AG_A_TS(parts, 3), AG_A_I(0)}, 2, "dim 0");
    check("arange.start_step", (ag_arg[]){AG_A_F(0), AG_A_F(8), AG_A_F(1), AG_A_DT(AG_I64)}, 4, "");
    check("zeros", (ag_arg[]){AG_A_INTS(((int64_t[]){4, 8}), 2)}, 1, "");
    check("zeros_like", (ag_arg[]){AG_A_T(R2(4, 8))}, 1, "");
    ag_scope_end();
}

/* A deliberately wrong rule (a sum over the sharded dim claimed to stay Shard) must fail the
 * differential check. */
static int wrong_sum_rule(ag_shard_ctx *c) {
    c->out[0] = c->in[0].kind == AG_SHARD ? AG_P_SHARD(0) : c->in[0];
    return 0;
}

static int replicate_sum_rule(ag_shard_ctx *c) {
    c->out[0] = AG_P_REPLICATE;
    return 0;
}

static void test_wrong_rule_caught(void **st) {
    (void)st;
    ag_scope_begin();
    const ag_op *op = ag_op_find("sum.dim_IntList");
    ag_opdef bad = *ag_op_def(op);
    bad.shard = wrong_sum_rule;
    ag_arg a[] = {AG_A_T(R2(4, 8)), AG_A_INTS(((int64_t[]){1}), 1)};
    diff_stats ws = {0};
    diff_one(op, &bad, a, 2, 2, (ag_placement[]){AG_P_SHARD(1)}, &ws, "wrong rule, expected");
    assert_int_equal(ws.failures, 1);
    /* Right shapes, wrong values: the ranks' partial sums claimed Replicate(). */
    bad.shard = replicate_sum_rule;
    diff_one(op, &bad, a, 2, 2, (ag_placement[]){AG_P_SHARD(1)}, &ws, "wrong rule, expected");
    assert_int_equal(ws.failures, 2);
    diff_stats ok = {0};
    diff_one(op, ag_op_def(op), a, 2, 2, (ag_placement[]){AG_P_SHARD(1)}, &ok, "right rule");
    assert_int_equal(ok.failures, 0);
    assert_int_equal(ok.applied, 1);
    ag_scope_end();
}

/* ---- coverage: every op of the zoo's training-step joints has a rule ---- */

typedef struct step_ud {
    ag_module *model;
    bool gpt2;
} step_ud;

static int step_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    step_ud *u = ag_module_ud(m);
    ag_tensor *o[2] = {0};
    (void)max_out;
    ag_scope_begin();
    if (u->gpt2) {
        int rc = ag_module_call(u->model, in, nin, o, 2);
        out[0] = rc == 2 ? ag_tensor_keep(o[1]) : NULL;
    } else {
        ag_tensor *logits = ag_module_forward(u->model, in[0]);
        out[0] = ag_tensor_keep(ag_cross_entropy(logits, in[1], AG_REDUCTION_MEAN, -100));
    }
    ag_scope_end();
    return out[0] ? 1 : ag_last_status();
}

/* Ops of the training steps deliberately without a rule, with the reason. */
static const char *const no_rule[][2] = {
    {"", ""}, /* none today: every op of the three joints has one */
};

static bool has_rule(const ag_opdef *d) {
    return d->shard || ((d->flags & AG_OP_POINTWISE) &&
                        !(d->flags & (AG_OP_INPLACE | AG_OP_RANDOM | AG_OP_EFFECTFUL)));
}

static void test_training_step_coverage(void **st) {
    (void)st;
    const char *models[][2] = {{"mlp", NULL}, {"cnn", NULL}, {"gpt2", "tiny"}};
    int missing = 0, seen = 0;
    for (int mi = 0; mi < 3; mi++) {
        ag_module *model;
        ag_tensor *in[4];
        int nin;
        assert_int_equal(ag_zoo_build(models[mi][0], models[mi][1], &model, in, 3, &nin), 0);
        step_ud *u = calloc(1, sizeof *u);
        u->model = model;
        u->gpt2 = !strcmp(models[mi][0], "gpt2");
        /* Targets: [N] class indices, or gpt2's [B, T] next tokens. */
        in[nin] = u->gpt2
                      ? ag_zeros(AG_I64, 2,
                                 (int64_t[]){ag_tensor_size(in[0], 0), ag_tensor_size(in[0], 1)})
                      : ag_zeros(AG_I64, 1, (int64_t[]){ag_tensor_size(in[0], 0)});
        nin++;
        ag_module *step = ag_module_new("TrainStep", step_forward, u, free);
        assert_non_null(step);
        assert_int_equal(ag_module_add_child(step, "model", model), 0);
        ag_joint *j = ag_export_joint(step, in, nin, NULL, NULL, 0, NULL);
        if (!j)
            fail_msg("export %s: %s", models[mi][0], ag_last_error());
        for (ag_node *n = ag_graph_first(ag_joint_graph(j)); n; n = ag_node_next(n)) {
            if (ag_node_kind_of(n) != AG_NODE_CALL)
                continue;
            const ag_op *op = ag_node_op(n);
            seen++;
            bool listed = false;
            for (size_t i = 0; i < sizeof no_rule / sizeof *no_rule; i++)
                listed |= !strcmp(no_rule[i][0], ag_op_name(op));
            if (!has_rule(ag_op_def(op)) && !listed) {
                print_error("%s: %s has no sharding rule\n", models[mi][0], ag_op_name(op));
                missing++;
            }
        }
        ag_joint_free(j);
        ag_module_free(step);
        for (int i = 0; i < nin; i++)
            ag_tensor_free(in[i]);
    }
    assert_true(seen > 100);
    assert_int_equal(missing, 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_placement_round_trip),
        cmocka_unit_test(test_placement_refusals),
        cmocka_unit_test(test_divisible),
        cmocka_unit_test(test_pointwise_structure),
        cmocka_unit_test(test_rule_contract_checked),
        cmocka_unit_test(test_rules_pointwise),
        cmocka_unit_test(test_rules_views),
        cmocka_unit_test(test_rules_reductions),
        cmocka_unit_test(test_rules_linalg),
        cmocka_unit_test(test_rules_nn),
        cmocka_unit_test(test_rules_attention_conv),
        cmocka_unit_test(test_rules_split_cat_factories),
        cmocka_unit_test(test_wrong_rule_caught),
        cmocka_unit_test(test_training_step_coverage),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
