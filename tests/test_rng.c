/* RNG functionalization (issue 6, part 1): the functional random ops, the export's philox
 * placeholders and outputs, the offsets each draw reads, the partitioners (the min-cut
 * recomputes a dropout mask from the saved seed and offset), the compiled callable feeding and
 * advancing the generator (training bit-identical to eager), draws in the backward, the FX
 * utilities, the text format, interpreter against executor, errors and the CLI. */
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- helpers ---- */

static ag_tensor *i64_scalar(uint64_t v) {
    int64_t x = (int64_t)v;
    return ag_from_data(AG_I64, 0, NULL, &x);
}

static char *repr(const ag_desc *d) {
    static char buf[8][256];
    static int k;
    char *b = buf[k++ % 8];
    ag_desc_repr(d, b, 256);
    return b;
}

/* Asserts the graph's placeholders are exactly names[i] described by descs[i]. */
static void expect_placeholders(const ag_graph *g, const char *const *names,
                                const char *const *descs, int n) {
    ag_node **ph;
    int nph = ag_graph_placeholders(g, &ph);
    if (nph != n)
        fail_msg("%d placeholders, want %d", nph, n);
    for (int i = 0; i < n; i++) {
        assert_string_equal(ag_node_name(ph[i]), names[i]);
        assert_string_equal(repr(ag_node_desc(ph[i])), descs[i]);
    }
}

/* Asserts the output node's descriptors are exactly descs[i] ("None" for None). */
static void expect_outputs(const ag_graph *g, const char *const *descs, int n) {
    const ag_node *out = ag_graph_output_node(g);
    assert_int_equal(ag_node_arg(out, 0)->n, n);
    for (int i = 0; i < n; i++)
        assert_string_equal(repr(ag_node_output_desc(out, i)), descs[i]);
}

static int count_calls(const ag_graph *g, const char *op) {
    int n = 0;
    for (ag_node *m = ag_graph_first(g); m; m = ag_node_next(m))
        n += ag_node_kind_of(m) == AG_NODE_CALL && !strcmp(ag_op_name(ag_node_op(m)), op);
    return n;
}

/* The zoo model `name` (with dropout p when p >= 0) and its example inputs. */
typedef struct zoo {
    ag_module *m;
    ag_tensor *in[8];
    int nin;
} zoo;

static void zoo_open(zoo *z, const char *name, double p) {
    ag_zoo_opts o = {.set_dropout = p >= 0, .dropout = p};
    if (ag_zoo_build_opts(name, NULL, &o, &z->m, z->in, 8, &z->nin))
        fail_msg("build %s: %s", name, ag_last_error());
}

static void zoo_close(zoo *z) {
    for (int i = 0; i < z->nin; i++)
        ag_tensor_free(z->in[i]);
    ag_module_free(z->m);
}

static ag_joint *export_or_fail(ag_module *m, ag_tensor *const *in, int nin,
                                const ag_export_opts *o) {
    ag_joint *j = ag_export_joint(m, in, nin, NULL, NULL, 0, o);
    if (!j)
        fail_msg("export: %s", ag_last_error());
    return j;
}

/* Inputs for every placeholder of joint graph g of module m: parameters, buffers, the given
 * args, tangents of 0.5 + 0.25 k, and the philox seed and offset (seed, offset). The array
 * and the tensors it made are freed by inputs_free. */
typedef struct inputs {
    ag_tensor *t[64];
    bool owned[64];
    int n;
} inputs;

static void inputs_make(inputs *in, const ag_graph *g, ag_module *m, ag_tensor *const *args,
                        int nargs, uint64_t seed, uint64_t offset) {
    memset(in, 0, sizeof *in);
    ag_named_tensors ps, bs;
    assert_int_equal(ag_module_named_parameters(m, false, &ps), 0);
    assert_int_equal(ag_module_named_buffers(m, false, &bs), 0);
    for (int i = 0; i < ps.n; i++)
        in->t[in->n++] = ps.tensors[i];
    for (int i = 0; i < bs.n; i++)
        in->t[in->n++] = bs.tensors[i];
    for (int i = 0; i < nargs; i++)
        in->t[in->n++] = args[i];
    ag_named_tensors_free(&ps);
    ag_named_tensors_free(&bs);
    ag_node **ph;
    int nph = ag_graph_placeholders(g, &ph);
    for (int k = 0; in->n < nph; k++, in->n++) {
        ag_tensor *t = tu_philox_input(ph[in->n], seed, offset);
        if (!t) { /* a tangent */
            const ag_tmeta *v = ag_node_val(ph[in->n], 0);
            ag_scope_begin();
            t = ag_tensor_keep(ag_full(v->dtype, v->ndim, v->sizes, 0.5 + 0.25 * k));
            ag_scope_end();
        }
        in->t[in->n] = t;
        in->owned[in->n] = true;
    }
}

static void inputs_free(inputs *in) {
    for (int i = 0; i < in->n; i++)
        if (in->owned[i])
            ag_tensor_free(in->t[i]);
}

static void free_all(ag_tensor **t, int n) {
    for (int i = 0; i < n; i++)
        ag_tensor_free(t[i]);
}

/* ---- the functional ops against eager ---- */

static void test_philox_ops_equal_eager_draws(void **st) {
    (void)st;
    const int64_t sz[] = {3, 70000}; /* large enough for the kernels' OpenMP split */
    for (int d = 0; d < 2; d++) {
        ag_dtype dt = d ? AG_F64 : AG_F32;
        ag_scope_begin();
        ag_manual_seed(1234);
        ag_rng_set_state(0x9e3779b97f4a7c15ull, 77); /* a seed beyond 2^63 */
        uint64_t seed, off;
        ag_rng_get_state(&seed, &off);
        ag_tensor *r = ag_rand(dt, 2, sz), *n = ag_randn(dt, 2, sz);
        ag_tensor *u = ag_uniform_(ag_empty(dt, 2, sz), -2.0, 3.0);
        ag_tensor *v = ag_normal_(ag_empty(dt, 2, sz), 1.5, 0.25);
        /* strided self: drawn in logical order */
        ag_tensor *ws = ag_transpose(ag_empty(dt, 2, (int64_t[]){sz[1], sz[0]}), 0, 1);
        ag_uniform_(ws, 0.0, 1.0);
        uint64_t s2, end;
        ag_rng_get_state(&s2, &end);
        const int64_t k = sz[0] * sz[1];
        assert_true(s2 == seed && end == off + 5 * (uint64_t)k);
        ag_tensor *S = i64_scalar(seed);
        /* philox ops neither read nor advance the generator */
        ag_rng_set_state(1, 2);
        assert_true(tu_same_bits(ag_philox_rand(S, i64_scalar(off), dt, 2, sz, 0, 1), r));
        assert_true(tu_same_bits(ag_philox_randn(S, i64_scalar(off + k), dt, 2, sz, 0, 1), n));
        assert_true(tu_same_bits(ag_philox_rand(S, i64_scalar(off + 2 * k), dt, 2, sz, -2, 3), u));
        assert_true(
            tu_same_bits(ag_philox_randn(S, i64_scalar(off + 3 * k), dt, 2, sz, 1.5, 0.25), v));
        assert_true(tu_same_bits(ag_philox_rand(S, i64_scalar(off + 4 * k), dt, 2, sz, 0, 1), ws));
        /* another offset draws other numbers */
        assert_false(tu_same_bits(ag_philox_rand(S, i64_scalar(off + 1), dt, 2, sz, 0, 1), r));
        ag_rng_get_state(&s2, &end);
        assert_true(s2 == 1 && end == 2);
        ag_scope_end();
    }
}

/* Eager native_dropout equals its functional form bit for bit: mask = ge(philox_rand, p),
 * out = (mask * x) * scale, dropped negative elements included (their -0.0). */
static void test_native_dropout_equals_functional_form(void **st) {
    (void)st;
    const double ps[] = {0.3, 0.5, 1.0};
    for (int d = 0; d < 2; d++)
        for (int pi = 0; pi < 3; pi++) {
            ag_dtype dt = d ? AG_F64 : AG_F32;
            double p = ps[pi], scale = p < 1 ? 1.0 / (1.0 - p) : 0.0;
            ag_scope_begin();
            ag_manual_seed(7);
            ag_tensor *x = ag_mul_scalar(ag_randn(dt, 2, (int64_t[]){33, 65}), 3.0);
            uint64_t seed, off;
            ag_rng_get_state(&seed, &off);
            ag_tensor *out, *mask;
            assert_int_equal(ag_native_dropout(x, p, true, &out, &mask), 0);
            ag_tensor *u =
                ag_philox_rand(i64_scalar(seed), i64_scalar(off), dt, 2, ag_tensor_sizes(x), 0, 1);
            ag_tensor *m2 = ag_ge_scalar(u, p);
            ag_tensor *o2 = ag_mul_scalar(ag_mul(m2, x), scale);
            assert_true(tu_same_bits(mask, m2));
            assert_true(tu_same_bits(out, o2));
            if (p < 1) { /* kept elements are x / (1 - p), dropped ones zero */
                bool some_dropped = false;
                for (int64_t i = 0; i < ag_tensor_numel(x); i++) {
                    double xv = ag_tensor_item_at(x, i), ov = ag_tensor_item_at(out, i);
                    if (ag_tensor_item_at(mask, i) != 0)
                        assert_true(fabs(ov - xv * scale) <= 1e-6 * (1 + fabs(xv * scale)));
                    else
                        assert_true(ov == 0), some_dropped = true;
                }
                assert_true(some_dropped);
            }
            ag_scope_end();
        }
}

static void test_philox_op_errors(void **st) {
    (void)st;
    ag_scope_begin();
    ag_tensor *s = i64_scalar(1), *o = i64_scalar(0);
    ag_tensor *bad = ag_zeros(AG_F32, 1, (int64_t[]){2});
    assert_null(ag_philox_rand(bad, o, AG_F32, 1, (int64_t[]){4}, 0, 1));
    tu_assert_error_contains("philox_rand: seed must be a 0-dim int64 tensor, got f32[2]");
    assert_null(
        ag_philox_randn(s, ag_zeros(AG_I64, 1, (int64_t[]){1}), AG_F32, 1, (int64_t[]){4}, 0, 1));
    tu_assert_error_contains("philox_randn: offset must be a 0-dim int64 tensor");
    assert_null(ag_philox_rand(s, o, AG_I64, 1, (int64_t[]){4}, 0, 1));
    tu_assert_error_contains("philox_rand: dtype i64 is not supported (float32 or float64)");
    assert_null(ag_philox_rand(s, o, AG_F32, 1, (int64_t[]){-4}, 0, 1));
    tu_assert_error_contains("philox_rand: negative size -4");
    /* not random, not differentiable: a pure function of its inputs */
    uint32_t f = ag_op_def(ag_op_find("philox_rand"))->flags;
    assert_false(f & AG_OP_RANDOM);
    assert_true(f & AG_OP_NONDIFF);
    ag_scope_end();
}

/* ---- the export: dropout_mlp ---- */

static const char *const mlp_names[] = {"primals_1", "primals_2",  "primals_3", "primals_4",
                                        "primals_5", "tangents_1", "fwd_seed",  "fwd_base_offset"};
static const char *const mlp_in_descs[] = {
    "ParamAOTInput(target='fc1.weight')",
    "ParamAOTInput(target='fc1.bias')",
    "ParamAOTInput(target='fc2.weight')",
    "ParamAOTInput(target='fc2.bias')",
    "PlainAOTInput(idx=0)",
    "TangentAOTInput(output=PlainAOTOutput(idx=0))",
    "PhiloxForwardSeedAOTInput()",
    "PhiloxForwardBaseOffsetAOTInput()",
};
static const char *const mlp_out_descs[] = {
    "PlainAOTOutput(idx=0)",
    "PhiloxUpdatedForwardOffsetAOTOutput()",
    "GradAOTOutput(grad_of=ParamAOTInput(target='fc1.weight'))",
    "GradAOTOutput(grad_of=ParamAOTInput(target='fc1.bias'))",
    "GradAOTOutput(grad_of=ParamAOTInput(target='fc2.weight'))",
    "GradAOTOutput(grad_of=ParamAOTInput(target='fc2.bias'))",
    "None",
};

static void test_dropout_mlp_joint(void **st) {
    (void)st;
    zoo z;
    zoo_open(&z, "dropout_mlp", -1);
    ag_joint *j = export_or_fail(z.m, z.in, z.nin, NULL);
    const ag_graph *g = ag_joint_graph(j);
    expect_placeholders(g, mlp_names, mlp_in_descs, 8);
    expect_outputs(g, mlp_out_descs, 7);
    assert_int_equal(ag_joint_num_primals(j), 5);
    assert_int_equal(ag_joint_num_tangents(j), 1);
    assert_int_equal(ag_joint_num_fw_outputs(j), 2); /* the user output and the offset */
    /* dropout: add(fwd_base_offset, 0) -> philox_rand -> ge(., 0.5) -> mul(mask, x) -> * 2 */
    ag_node *seed = ag_graph_find(g, "fwd_seed"), *base = ag_graph_find(g, "fwd_base_offset");
    ag_node *pr = ag_graph_find(g, "philox_rand");
    assert_non_null(pr);
    assert_int_equal(count_calls(g, "philox_rand"), 1);
    assert_int_equal(count_calls(g, "native_dropout"), 0);
    assert_ptr_equal(ag_node_arg_node(pr, 1), seed);
    ag_node *off = ag_node_arg_node(pr, 2);
    assert_string_equal(ag_op_name(ag_node_op(off)), "add.Scalar");
    assert_ptr_equal(ag_node_arg_node(off, 0), base);
    assert_true(ag_node_arg(off, 1)->u.f == 0);
    const ag_tmeta *v = ag_node_val(pr, 0);
    assert_int_equal(v->dtype, AG_F32);
    assert_true(v->ndim == 2 && v->sizes[0] == 8 && v->sizes[1] == 32);
    ag_node *ge = ag_node_user(pr, 0);
    assert_string_equal(ag_op_name(ag_node_op(ge)), "ge.Scalar");
    assert_true(ag_node_arg(ge, 1)->u.f == 0.5);
    /* the backward reads the mask node through native_dropout_backward(grad, mask, 2) */
    ag_node *ndb = ag_graph_find(g, "native_dropout_backward");
    assert_ptr_equal(ag_node_arg_node(ndb, 1), ge);
    assert_true(ag_node_arg(ndb, 2)->u.f == 2.0);
    /* the updated offset: add(fwd_base_offset, 8 * 32), a forward node */
    ag_node *upd = ag_node_arg(ag_graph_output_node(g), 0)->u.nodes[1];
    assert_ptr_equal(ag_node_arg_node(upd, 0), base);
    assert_true(ag_node_arg(upd, 1)->u.f == 256);
    assert_string_equal(ag_node_partitioner_tag(upd), "is_forward");
    assert_string_equal(ag_node_partitioner_tag(seed), "is_forward");
    /* the dropout's nodes carry its seq_nr, as its backward does */
    assert_int_equal(ag_node_seq_nr(off), ag_node_seq_nr(ndb));
    assert_int_equal(ag_node_seq_nr(pr), ag_node_seq_nr(ndb));
    assert_int_equal(ag_node_seq_nr(ge), ag_node_seq_nr(ndb));
    assert_int_equal(ag_graph_verify(g), 0);
    /* set_graph accepts the graph back and checks the philox placeholders too */
    assert_int_equal(ag_joint_set_graph(j, ag_graph_copy(g)), 0);
    ag_graph *g2 = ag_graph_copy(ag_joint_graph(j));
    assert_int_equal(ag_node_rename(g2, ag_graph_find(g2, "fwd_seed"), "s"), 0);
    ag_desc *bs = ag_desc_philox_backward_seed();
    assert_int_equal(ag_node_set_desc(ag_graph_find(g2, "s"), bs), 0);
    ag_desc_release(bs);
    assert_int_equal(ag_joint_set_graph(j, g2), AG_EINVAL);
    tu_assert_error_contains("placeholder 6 (s) is PhiloxBackwardSeedAOTInput(); the calling "
                             "convention expects PhiloxForwardSeedAOTInput() there");
    ag_joint_free(j);
    zoo_close(&z);
}

/* Models without random ops are exported as before: no philox inputs or outputs. */
static void test_no_random_ops_no_philox(void **st) {
    (void)st;
    const char *models[] = {"linear", "convbn", "gpt2", "mlp"};
    for (int i = 0; i < 4; i++) {
        zoo z;
        zoo_open(&z, models[i], -1);
        ag_joint *j = export_or_fail(z.m, z.in, z.nin, NULL);
        const ag_graph *g = ag_joint_graph(j);
        ag_node **ph;
        int nph = ag_graph_placeholders(g, &ph);
        assert_int_equal(nph, ag_joint_num_primals(j) + ag_joint_num_tangents(j));
        assert_null(ag_graph_find(g, "fwd_seed"));
        assert_int_equal(ag_joint_num_fw_outputs(j),
                         ag_joint_num_mutated_inputs(j) + ag_joint_num_user_outputs(j));
        assert_int_equal(count_calls(g, "philox_rand"), 0);
        ag_joint_free(j);
        zoo_close(&z);
    }
    /* gpt2 with dropout 0 but --dropout 0 asked explicitly: no draw either */
    zoo z;
    zoo_open(&z, "gpt2", 0.0);
    ag_joint *j = export_or_fail(z.m, z.in, z.nin, NULL);
    assert_null(ag_graph_find(ag_joint_graph(j), "fwd_seed"));
    ag_joint_free(j);
    zoo_close(&z);
}

/* keep_random_ops: the export records native_dropout as it is (no philox inputs). */
static void test_keep_random_ops(void **st) {
    (void)st;
    zoo z;
    zoo_open(&z, "dropout_mlp", -1);
    ag_joint *j = export_or_fail(z.m, z.in, z.nin, &(ag_export_opts){.keep_random_ops = true});
    const ag_graph *g = ag_joint_graph(j);
    assert_int_equal(count_calls(g, "native_dropout"), 1);
    assert_int_equal(count_calls(g, "philox_rand"), 0);
    assert_null(ag_graph_find(g, "fwd_seed"));
    assert_int_equal(ag_joint_num_fw_outputs(j), 1);
    ag_joint_free(j);
    zoo_close(&z);
}

/* ---- the offsets each draw reads ---- */

/* x [4, 5], w [4, 5]: rand (20 numbers, offset 0), dropout (20, at 20), randn [7] (at 40),
 * uniform_(-2, 3) of a fresh [3] (at 47), normal_(1, 0.5) of a fresh [2] (at 50): 52 drawn. */
static int draws_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out,
                         int max_out) {
    (void)nin;
    (void)max_out;
    ag_scope_begin();
    ag_tensor *a = ag_rand(AG_F32, 2, (int64_t[]){4, 5});
    ag_tensor *h = ag_dropout(ag_mul(in[0], ag_module_param(m, "w")), 0.25, true);
    /* One draw per statement: the order of an initializer list's evaluations is unspecified,
     * and it decides the offsets. */
    ag_tensor *r[4];
    r[0] = ag_mul(a, h);
    r[1] = ag_randn(AG_F32, 1, (int64_t[]){7});
    r[2] = ag_uniform_(ag_empty(AG_F32, 1, (int64_t[]){3}), -2.0, 3.0);
    r[3] = ag_normal_(ag_empty(AG_F32, 1, (int64_t[]){2}), 1.0, 0.5);
    int n = 4;
    for (int i = 0; i < 4; i++) {
        out[i] = ag_tensor_keep(r[i]);
        if (!out[i])
            n = ag_last_status();
    }
    ag_scope_end();
    return n;
}

static ag_module *draws_module(void) {
    ag_module *m = ag_module_new("Draws", draws_forward, NULL, NULL);
    ag_tensor *w = ag_randn(AG_F32, 2, (int64_t[]){4, 5});
    assert_int_equal(ag_module_register_parameter(m, "w", w), 0);
    ag_tensor_free(w);
    return m;
}

static void test_offsets_per_draw(void **st) {
    (void)st;
    ag_manual_seed(5);
    ag_module *m = draws_module();
    ag_tensor *x = ag_randn(AG_F32, 2, (int64_t[]){4, 5});
    ag_joint *j = export_or_fail(m, &x, 1, NULL);
    const ag_graph *g = ag_joint_graph(j);
    expect_placeholders(g,
                        (const char *const[]){"primals_1", "primals_2", "tangents_1", "fwd_seed",
                                              "fwd_base_offset"},
                        (const char *const[]){"ParamAOTInput(target='w')", "PlainAOTInput(idx=0)",
                                              "TangentAOTInput(output=PlainAOTOutput(idx=0))",
                                              "PhiloxForwardSeedAOTInput()",
                                              "PhiloxForwardBaseOffsetAOTInput()"},
                        5);
    expect_outputs(g,
                   (const char *const[]){
                       "PlainAOTOutput(idx=0)", "PlainAOTOutput(idx=1)", "PlainAOTOutput(idx=2)",
                       "PlainAOTOutput(idx=3)", "PhiloxUpdatedForwardOffsetAOTOutput()",
                       "GradAOTOutput(grad_of=ParamAOTInput(target='w'))", "None"},
                   7);
    /* The draws in order: op, offset k, affine parameters. */
    static const struct {
        const char *op;
        double k, a, b;
    } want[] = {{"philox_rand", 0, 0, 1},
                {"philox_rand", 20, 0, 1},
                {"philox_randn", 40, 0, 1},
                {"philox_rand", 47, -2, 3},
                {"philox_randn", 50, 1, 0.5}};
    ag_node *base = ag_graph_find(g, "fwd_base_offset");
    int d = 0;
    for (ag_node *n = ag_graph_first(g); n; n = ag_node_next(n)) {
        if (ag_node_kind_of(n) != AG_NODE_CALL || strncmp(ag_op_name(ag_node_op(n)), "philox_", 7))
            continue;
        assert_true(d < 5);
        assert_string_equal(ag_op_name(ag_node_op(n)), want[d].op);
        ag_node *off = ag_node_arg_node(n, 2);
        assert_ptr_equal(ag_node_arg_node(off, 0), base);
        if (ag_node_arg(off, 1)->u.f != want[d].k)
            fail_msg("draw %d reads offset %g, want %g", d, ag_node_arg(off, 1)->u.f, want[d].k);
        assert_true(ag_node_arg(n, 3)->u.f == want[d].a && ag_node_arg(n, 4)->u.f == want[d].b);
        d++;
    }
    assert_int_equal(d, 5);
    ag_node *upd = ag_node_arg(ag_graph_output_node(g), 0)->u.nodes[4];
    assert_true(ag_node_arg(upd, 1)->u.f == 52);
    assert_int_equal(count_calls(g, "empty.memory_format"), 0); /* uniform_'s self is dead */

    /* The joint interpreted with the generator's state equals eager's draws, bit for bit, and
     * does not touch the generator; its updated offset is where eager leaves it. */
    ag_rng_set_state(0xfeedbeefcafeull, 1000);
    inputs in;
    inputs_make(&in, g, m, &x, 1, 0xfeedbeefcafeull, 1000);
    ag_tensor *go[16] = {0}, *eo[4] = {0};
    int ngo = ag_graph_run(g, in.t, in.n, go, 16);
    assert_int_equal(ngo, 7);
    uint64_t s, o;
    ag_rng_get_state(&s, &o);
    assert_true(s == 0xfeedbeefcafeull && o == 1000);
    assert_int_equal(ag_module_call(m, &x, 1, eo, 4), 4);
    ag_rng_get_state(&s, &o);
    assert_true(o == 1052);
    for (int i = 0; i < 4; i++)
        assert_true(tu_same_bits(go[i], eo[i]));
    assert_int_equal((int64_t)ag_tensor_item_at(go[4], 0), 1052);
    free_all(go, ngo);
    free_all(eo, 4);
    inputs_free(&in);
    ag_joint_free(j);
    ag_tensor_free(x);
    ag_module_free(m);
}

/* ---- partitioning ---- */

/* Runs fw then bw (interpreter) on joint inputs and checks them against the joint itself,
 * bit for bit. */
static void check_partition_numerics(const ag_graph *jg, const ag_graph *fw, const ag_graph *bw,
                                     const inputs *in, int np, int nt, int nfo) {
    ag_tensor *ref[32] = {0}, *fo[64] = {0}, *bo[32] = {0}, *fin[64], *bin[64];
    int nref = ag_graph_run(jg, in->t, in->n, ref, 32);
    assert_true(nref > nfo);
    int nrng = in->n - np - nt, nfin = 0, nbin = 0;
    for (int i = 0; i < np; i++)
        fin[nfin++] = in->t[i];
    for (int i = 0; i < nrng; i++)
        fin[nfin++] = in->t[np + nt + i];
    int nf = ag_graph_run(fw, fin, nfin, fo, 64);
    if (nf < 0)
        fail_msg("forward: %s", ag_last_error());
    for (int k = nfo; k < nf; k++)
        bin[nbin++] = fo[k];
    for (int k = 0; k < nt; k++)
        bin[nbin++] = in->t[np + k];
    int nb = ag_graph_run(bw, bin, nbin, bo, 32);
    if (nb < 0)
        fail_msg("backward: %s", ag_last_error());
    assert_int_equal(nfo + nb, nref);
    for (int k = 0; k < nfo; k++)
        assert_true(tu_same_bits(ref[k], fo[k]));
    for (int k = 0; k < nb; k++)
        assert_true(tu_same_bits(ref[nfo + k], bo[k]));
    free_all(ref, nref);
    free_all(fo, nf);
    free_all(bo, nb);
}

/* The saved values of a partition: the forward outputs described SavedForBackwards. */
static int saved_of(const ag_graph *fw, ag_node **saved) {
    const ag_node *out = ag_graph_output_node(fw);
    int n = 0;
    for (int i = 0; i < ag_node_arg(out, 0)->n; i++) {
        const ag_desc *d = ag_node_output_desc(out, i);
        if (d && ag_desc_kind_of(d) == AG_DESC_SAVED_FOR_BACKWARDS)
            saved[n++] = ag_node_arg(out, 0)->u.nodes[i];
    }
    return n;
}

static void test_partition_recomputes_mask(void **st) {
    (void)st;
    zoo z;
    zoo_open(&z, "dropout_mlp", -1);
    ag_joint *j = export_or_fail(z.m, z.in, z.nin, NULL);
    const ag_graph *jg = ag_joint_graph(j);
    inputs in;
    inputs_make(&in, jg, z.m, z.in, z.nin, 42, 4096);
    const double budgets[] = {1.0, 0.5, 0.0};
    for (int p = 0; p < 2; p++)
        for (int b = 0; b < (p ? 3 : 1); b++) {
            ag_partition_opts po = {.partitioner = p ? AG_PARTITION_MINCUT : AG_PARTITION_DEFAULT,
                                    .memory_budget = ag_memory_budget(budgets[b])};
            ag_graph *fw, *bw;
            if (ag_partition(jg, ag_joint_num_fw_outputs(j), &po, &fw, &bw, NULL))
                fail_msg("partition: %s", ag_last_error());
            /* forward: primals then the forward's seed and offset */
            const char *const fw_names[] = {mlp_names[0], mlp_names[1], mlp_names[2], mlp_names[3],
                                            mlp_names[4], mlp_names[6], mlp_names[7]};
            const char *const fw_descs[] = {mlp_in_descs[0], mlp_in_descs[1], mlp_in_descs[2],
                                            mlp_in_descs[3], mlp_in_descs[4], mlp_in_descs[6],
                                            mlp_in_descs[7]};
            expect_placeholders(fw, fw_names, fw_descs, 7);
            const ag_node *fo = ag_graph_output_node(fw);
            assert_string_equal(repr(ag_node_output_desc(fo, 1)),
                                "PhiloxUpdatedForwardOffsetAOTOutput()");
            ag_node *saved[32];
            int ns = saved_of(fw, saved);
            bool saves_bool = false, saves_seed = false, saves_offset = false;
            for (int i = 0; i < ns; i++) {
                saves_bool |= ag_node_val(saved[i], 0)->dtype == AG_BOOL;
                saves_seed |= !strcmp(ag_node_name(saved[i]), "fwd_seed");
                saves_offset |= !strcmp(ag_node_name(saved[i]), "fwd_base_offset");
            }
            if (p) {
                /* min-cut: the mask is recomputed from the saved seed and offset */
                assert_false(saves_bool);
                assert_true(saves_seed && saves_offset);
                assert_int_equal(count_calls(bw, "philox_rand"), 1);
                assert_int_equal(count_calls(bw, "ge.Scalar"), 1);
            } else {
                /* default: every forward value the backward reads is saved, the mask too */
                assert_true(saves_bool);
                assert_false(saves_seed);
                assert_int_equal(count_calls(bw, "philox_rand"), 0);
            }
            check_partition_numerics(jg, fw, bw, &in, 5, 1, 2);
            ag_graph_free(fw);
            ag_graph_free(bw);
        }
    inputs_free(&in);
    ag_joint_free(j);
    zoo_close(&z);
}

/* ---- compiled training ---- */

/* Params of two modules equal bit for bit. */
static void expect_same_params(ag_module *a, ag_module *b, bool grads) {
    ag_named_tensors pa, pb;
    assert_int_equal(ag_module_named_parameters(a, true, &pa), 0);
    assert_int_equal(ag_module_named_parameters(b, true, &pb), 0);
    assert_int_equal(pa.n, pb.n);
    for (int i = 0; i < pa.n; i++) {
        if (!tu_same_bits(pa.tensors[i], pb.tensors[i]))
            fail_msg("parameter %s differs", pa.names[i]);
        if (grads && !tu_same_bits(ag_tensor_grad(pa.tensors[i]), ag_tensor_grad(pb.tensors[i])))
            fail_msg("gradient of %s differs", pa.names[i]);
    }
    ag_named_tensors_free(&pa);
    ag_named_tensors_free(&pb);
}

/* Trains model `name` (dropout p) eagerly and compiled for `steps` SGD steps from the same
 * generator state each step; outputs, gradients, parameters and the generator's offset after
 * each step must agree bit for bit. Returns the offset advance of one step. */
static uint64_t train_side_by_side(const char *name, double p, const ag_compile_opts *co, int steps,
                                   ag_module *(*make)(void), ag_tensor *make_x) {
    ag_module *me, *mc;
    ag_tensor *ie[8], *ic[8];
    int ne, nc;
    zoo ze = {0}, zc = {0};
    if (make) {
        ag_manual_seed(21);
        me = make();
        ag_manual_seed(21);
        mc = make();
        ie[0] = ic[0] = make_x;
        ne = nc = 1;
    } else {
        zoo_open(&ze, name, p);
        zoo_open(&zc, name, p);
        me = ze.m, mc = zc.m;
        memcpy(ie, ze.in, sizeof ie);
        memcpy(ic, zc.in, sizeof ic);
        ne = ze.nin, nc = zc.nin;
    }
    ag_joint *j = export_or_fail(mc, ic, nc, NULL);
    ag_compiled *c = ag_compile_joint(j, co);
    if (!c)
        fail_msg("compile: %s", ag_last_error());
    ag_optim *oe = ag_optim_sgd(me, 0.1, 0, 0, false), *oc = ag_optim_sgd(mc, 0.1, 0, 0, false);
    uint64_t advance = 0;
    ag_rng_set_state(99, 12345);
    for (int step = 0; step < steps; step++) {
        ag_scope_begin();
        uint64_t seed, off, es, eo, cs, coff;
        ag_rng_get_state(&seed, &off);
        ag_tensor *a[8], *b[8];
        int n = ag_module_call(me, ie, ne, a, 8);
        assert_true(n > 0);
        ag_tensor *le = ag_sum_all(ag_mul_scalar(a[0], 0.75));
        assert_int_equal(ag_backward(le, NULL, false), 0);
        ag_rng_get_state(&es, &eo);
        /* A compiled call from another state draws other numbers (the test can fail). */
        if (step == 0) {
            ag_rng_set_state(seed, off + 1);
            ag_tensor *x[8];
            assert_int_equal(ag_compiled_call_module(c, mc, ic, nc, x, 8), n);
            assert_false(tu_same_bits(a[0], x[0]));
        }
        ag_rng_set_state(seed, off);
        int m = ag_compiled_call_module(c, mc, ic, nc, b, 8);
        if (m != n)
            fail_msg("compiled call: %s", ag_last_error());
        for (int k = 0; k < n; k++)
            assert_true(tu_same_bits(a[k], b[k]));
        ag_tensor *lc = ag_sum_all(ag_mul_scalar(b[0], 0.75));
        assert_int_equal(ag_backward(lc, NULL, false), 0);
        ag_rng_get_state(&cs, &coff);
        assert_true(cs == es && coff == eo);
        advance = eo - off;
        expect_same_params(me, mc, true);
        assert_int_equal(ag_optim_step(oe), 0);
        assert_int_equal(ag_optim_step(oc), 0);
        ag_optim_zero_grad(oe);
        ag_optim_zero_grad(oc);
        expect_same_params(me, mc, false);
        ag_scope_end();
    }
    ag_optim_free(oe);
    ag_optim_free(oc);
    ag_compiled_free(c);
    ag_joint_free(j);
    if (make) {
        ag_module_free(me);
        ag_module_free(mc);
    } else {
        zoo_close(&ze);
        zoo_close(&zc);
    }
    return advance;
}

static void test_compiled_training_bit_identical(void **st) {
    (void)st;
    for (int p = 0; p < 2; p++)
        for (int interp = 0; interp < 2; interp++) {
            ag_compile_opts co = {
                .partition = {.partitioner = p ? AG_PARTITION_MINCUT : AG_PARTITION_DEFAULT,
                              .memory_budget = 1.0},
                .interpret = interp};
            assert_true(train_side_by_side("dropout_mlp", -1, &co, 4, NULL, NULL) == 256);
            /* another dropout probability through the build options */
            assert_true(train_side_by_side("dropout_mlp", 0.2, &co, 2, NULL, NULL) == 256);
        }
}

/* GPT-2 tiny with dropout 0.1: embedding, attention-probability, residual and MLP dropout. */
static void test_gpt2_dropout(void **st) {
    (void)st;
    zoo z;
    zoo_open(&z, "gpt2", 0.1);
    ag_joint *j = export_or_fail(z.m, z.in, z.nin, NULL);
    const ag_graph *g = ag_joint_graph(j);
    assert_int_equal(count_calls(g, "philox_rand"), 1 + 3 * 2);
    assert_non_null(ag_graph_find(g, "fwd_seed"));
    ag_joint_free(j);
    zoo_close(&z);
    ag_compile_opts co = {.partition = {.partitioner = AG_PARTITION_MINCUT, .memory_budget = 1.0}};
    /* 2 x 16 tokens: B T C = 2048 numbers per dropout but the attention's B nh T T = 2048 */
    uint64_t adv = train_side_by_side("gpt2", 0.1, &co, 2, NULL, NULL);
    assert_true(adv == 2048 + 2 * (2048 + 2048 + 2048));
}

/* ---- a backward that draws ---- */

/* x [6]: h = dropout(x * w, 0.5) (a forward draw of 6), out = noisy(h) (a backward draw of 6) */
static int noisy_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out,
                         int max_out) {
    (void)nin;
    (void)max_out;
    ag_scope_begin();
    ag_tensor *h = ag_dropout(ag_mul(in[0], ag_module_param(m, "w")), 0.5, true);
    out[0] = ag_tensor_keep(ag_op_call1(tu_noisy_op(), (ag_arg[]){AG_A_T(h)}, 1));
    ag_scope_end();
    return out[0] ? 1 : ag_last_status();
}

static ag_module *noisy_module(void) {
    ag_module *m = ag_module_new("NoisyGrad", noisy_forward, NULL, NULL);
    ag_tensor *w = ag_randn(AG_F32, 1, (int64_t[]){6});
    assert_int_equal(ag_module_register_parameter(m, "w", w), 0);
    ag_tensor_free(w);
    return m;
}

static void test_backward_draws(void **st) {
    (void)st;
    assert_non_null(tu_noisy_op());
    ag_manual_seed(8);
    ag_module *m = noisy_module();
    ag_tensor *x = ag_randn(AG_F32, 1, (int64_t[]){6});
    ag_joint *j = export_or_fail(m, &x, 1, NULL);
    const ag_graph *g = ag_joint_graph(j);
    expect_placeholders(
        g,
        (const char *const[]){"primals_1", "primals_2", "tangents_1", "fwd_seed", "fwd_base_offset",
                              "bwd_seed", "bwd_base_offset"},
        (const char *const[]){"ParamAOTInput(target='w')", "PlainAOTInput(idx=0)",
                              "TangentAOTInput(output=PlainAOTOutput(idx=0))",
                              "PhiloxForwardSeedAOTInput()", "PhiloxForwardBaseOffsetAOTInput()",
                              "PhiloxBackwardSeedAOTInput()", "PhiloxBackwardBaseOffsetAOTInput()"},
        7);
    expect_outputs(g,
                   (const char *const[]){"PlainAOTOutput(idx=0)",
                                         "PhiloxUpdatedForwardOffsetAOTOutput()",
                                         "GradAOTOutput(grad_of=ParamAOTInput(target='w'))", "None",
                                         "PhiloxUpdatedBackwardOffsetAOTOutput()"},
                   5);
    assert_int_equal(ag_joint_num_fw_outputs(j), 2);
    /* the backward's draw reads add(bwd_base_offset, 0) and is a backward node */
    ag_node *bseed = ag_graph_find(g, "bwd_seed");
    assert_string_equal(ag_node_partitioner_tag(bseed), "is_backward");
    ag_node *draw = ag_node_user(bseed, 0);
    assert_string_equal(ag_op_name(ag_node_op(draw)), "philox_rand");
    assert_string_equal(ag_node_partitioner_tag(draw), "is_backward");
    ag_node *boff = ag_node_arg_node(draw, 2);
    assert_ptr_equal(ag_node_arg_node(boff, 0), ag_graph_find(g, "bwd_base_offset"));
    assert_true(ag_node_arg(boff, 1)->u.f == 0);
    ag_node *bupd = ag_node_arg(ag_graph_output_node(g), 0)->u.nodes[4];
    assert_true(ag_node_arg(bupd, 1)->u.f == 6);

    /* partitioned: the backward takes the backward's seed and offset after the tangents and
     * returns its updated offset after the grads */
    for (int p = 0; p < 2; p++) {
        ag_partition_opts po = {.partitioner = p ? AG_PARTITION_MINCUT : AG_PARTITION_DEFAULT,
                                .memory_budget = 1.0};
        ag_graph *fw, *bw;
        if (ag_partition(g, 2, &po, &fw, &bw, NULL))
            fail_msg("partition: %s", ag_last_error());
        ag_node **ph;
        int nph = ag_graph_placeholders(bw, &ph);
        assert_string_equal(ag_node_name(ph[nph - 3]), "tangents_1");
        assert_string_equal(ag_node_name(ph[nph - 2]), "bwd_seed");
        assert_string_equal(ag_node_name(ph[nph - 1]), "bwd_base_offset");
        assert_null(ag_graph_find(fw, "bwd_seed"));
        expect_outputs(bw,
                       (const char *const[]){"GradAOTOutput(grad_of=ParamAOTInput(target='w'))",
                                             "None", "PhiloxUpdatedBackwardOffsetAOTOutput()"},
                       3);
        ag_graph_free(fw);
        ag_graph_free(bw);
    }
    ag_joint_free(j);
    ag_tensor_free(x);
    ag_module_free(m);

    /* compiled training: the backward draws at backward time, like eager */
    ag_manual_seed(8);
    x = ag_randn(AG_F32, 1, (int64_t[]){6});
    for (int p = 0; p < 2; p++)
        for (int interp = 0; interp < 2; interp++) {
            ag_compile_opts co = {
                .partition = {.partitioner = p ? AG_PARTITION_MINCUT : AG_PARTITION_DEFAULT,
                              .memory_budget = 1.0},
                .interpret = interp};
            assert_true(train_side_by_side(NULL, -1, &co, 3, noisy_module, x) == 12);
        }
    ag_tensor_free(x);
}

/* ---- FX utilities, text format, interpreter against executor ---- */

static void test_fx_utils_skip_philox(void **st) {
    (void)st;
    zoo z;
    zoo_open(&z, "dropout_mlp", -1);
    ag_joint *j = export_or_fail(z.m, z.in, z.nin, NULL);
    const ag_graph *g = ag_joint_graph(j);
    ag_fx_pairs *ig = ag_fx_all_input_and_grad_nodes(g);
    ag_fx_pairs *ot = ag_fx_all_output_and_tangent_nodes(g);
    assert_non_null(ig);
    assert_non_null(ot);
    assert_int_equal(ag_fx_pairs_count(ig), 6); /* 4 params, x, the tangent */
    assert_int_equal(ag_fx_pairs_count(ot), 5); /* the output, 4 grads */
    for (int i = 0; i < ag_fx_pairs_count(ig); i++)
        assert_null(strstr(repr(ag_fx_pairs_desc(ig, i)), "Philox"));
    for (int i = 0; i < ag_fx_pairs_count(ot); i++)
        assert_null(strstr(repr(ag_fx_pairs_desc(ot, i)), "Philox"));
    ag_desc *sd = ag_desc_philox_forward_seed();
    assert_int_equal(ag_fx_pairs_find(ig, sd), -1);
    ag_desc_release(sd);
    ag_fx_pairs *pg = ag_fx_param_and_grad_nodes(g);
    assert_int_equal(ag_fx_pairs_count(pg), 4);
    for (int i = 0; i < 4; i++)
        assert_non_null(ag_fx_pairs_second(pg, i));
    ag_fx_pairs_free(pg);
    ag_fx_pairs_free(ig);
    ag_fx_pairs_free(ot);
    ag_joint_free(j);
    zoo_close(&z);
}

static void expect_round_trip(const ag_graph *g) {
    ag_print_opts po = {.seq_nr = true};
    char *a = ag_graph_to_string(g, &po);
    assert_non_null(a);
    ag_graph *p = ag_graph_parse(a, strlen(a));
    if (!p)
        fail_msg("parse: %s", ag_last_error());
    char *b = ag_graph_to_string(p, &po);
    assert_string_equal(a, b);
    /* the descriptors came back as descriptors */
    ag_node *s = ag_graph_find(p, "fwd_seed");
    if (s)
        assert_string_equal(repr(ag_node_desc(s)), "PhiloxForwardSeedAOTInput()");
    ag_free(a);
    ag_free(b);
    ag_graph_free(p);
}

static void test_text_round_trip(void **st) {
    (void)st;
    zoo z;
    zoo_open(&z, "dropout_mlp", -1);
    ag_joint *j = export_or_fail(z.m, z.in, z.nin, NULL);
    expect_round_trip(ag_joint_graph(j));
    ag_graph *fw, *bw;
    ag_partition_opts po = {.partitioner = AG_PARTITION_MINCUT, .memory_budget = 1.0};
    assert_int_equal(ag_partition(ag_joint_graph(j), 2, &po, &fw, &bw, NULL), 0);
    expect_round_trip(fw);
    expect_round_trip(bw);
    ag_graph_free(fw);
    ag_graph_free(bw);
    ag_joint_free(j);
    zoo_close(&z);
    ag_manual_seed(8);
    assert_non_null(tu_noisy_op());
    ag_module *m = noisy_module();
    ag_tensor *x = ag_randn(AG_F32, 1, (int64_t[]){6});
    j = export_or_fail(m, &x, 1, NULL);
    expect_round_trip(ag_joint_graph(j));
    ag_joint_free(j);
    ag_tensor_free(x);
    ag_module_free(m);
}

static void test_interpreter_equals_executor(void **st) {
    (void)st;
    const char *models[] = {"dropout_mlp", "gpt2"};
    for (int i = 0; i < 2; i++) {
        zoo z;
        zoo_open(&z, models[i], 0.1);
        ag_joint *j = export_or_fail(z.m, z.in, z.nin, NULL);
        const ag_graph *g = ag_joint_graph(j);
        inputs in;
        inputs_make(&in, g, z.m, z.in, z.nin, 0xabcdef12345ull, 77);
        ag_tensor *a[256] = {0}, *b[256] = {0};
        int na = ag_graph_run(g, in.t, in.n, a, 256);
        assert_true(na > 0);
        for (int chk = 0; chk < 2; chk++) {
            ag_plan *p = ag_plan_new(g, &(ag_plan_opts){.checking = chk});
            assert_non_null(p);
            int nb = ag_plan_run(p, in.t, in.n, b, 256);
            assert_int_equal(nb, na);
            for (int k = 0; k < na; k++)
                if (!tu_same_bits(a[k], b[k]))
                    fail_msg("%s: output %d differs between interpreter and executor", models[i],
                             k);
            free_all(b, nb);
            ag_plan_free(p);
        }
        free_all(a, na);
        inputs_free(&in);
        ag_joint_free(j);
        zoo_close(&z);
    }
}

/* ---- errors ---- */

/* A user op that draws but has no functional form is refused by the export, by name. */
static int coin_meta(const ag_arg *a, ag_tmeta *o) {
    const ag_tensor *x = a[0].u.t;
    *o = tu_tmeta(ag_tensor_dtype(x), ag_tensor_ndim(x), ag_tensor_sizes(x));
    return 0;
}
static int coin_kernel(const ag_arg *a, ag_tensor **o) {
    (void)a;
    memset(ag_tensor_data(o[0]), 0, sizeof(float) * (size_t)ag_tensor_numel(o[0]));
    return 0;
}
static const ag_opdef coin_def = {
    .schema = "rng_test::coin(Tensor x) -> Tensor",
    .flags = AG_OP_RANDOM | AG_OP_NONDIFF,
    .meta = coin_meta,
    .kernel = coin_kernel,
    .dtypes = 1u << AG_F32,
};

static int coin_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)nin;
    (void)max_out;
    const ag_op *op = ag_op_find("rng_test::coin");
    ag_scope_begin();
    out[0] = ag_tensor_keep(
        ag_mul(ag_op_call1(op, (ag_arg[]){AG_A_T(in[0])}, 1), ag_module_param(m, "w")));
    ag_scope_end();
    return out[0] ? 1 : ag_last_status();
}

static void test_errors(void **st) {
    (void)st;
    if (!ag_op_find("rng_test::coin"))
        assert_non_null(ag_op_register(&coin_def));
    ag_module *m = ag_module_new("Coin", coin_forward, NULL, NULL);
    ag_tensor *w = ag_randn(AG_F32, 1, (int64_t[]){3}), *x = ag_randn(AG_F32, 1, (int64_t[]){3});
    assert_int_equal(ag_module_register_parameter(m, "w", w), 0);
    assert_null(ag_export_joint(m, &x, 1, NULL, NULL, 0, NULL));
    tu_assert_error_contains("export: rng_test::coin draws random numbers and has no functional "
                             "form for RNG functionalization");
    /* kept as it is, it exports */
    ag_joint *j =
        ag_export_joint(m, &x, 1, NULL, NULL, 0, &(ag_export_opts){.keep_random_ops = true});
    assert_non_null(j);
    ag_joint_free(j);
    ag_tensor_free(w);
    ag_tensor_free(x);
    ag_module_free(m);
    /* the zoo's dropout option */
    ag_module *zm;
    ag_tensor *in[8];
    int nin;
    ag_zoo_opts o = {.set_dropout = true, .dropout = 0.1};
    assert_int_equal(ag_zoo_build_opts("linear", NULL, &o, &zm, in, 8, &nin), AG_EINVAL);
    tu_assert_error_contains("zoo: model 'linear' has no dropout (models with dropout: "
                             "dropout_mlp, gpt2)");
    o.dropout = 1.5;
    assert_int_equal(ag_zoo_build_opts("gpt2", NULL, &o, &zm, in, 8, &nin), AG_EINVAL);
    tu_assert_error_contains("zoo: dropout probability 1.5 is not in [0, 1]");
}

/* ---- allocation failures ---- */

typedef struct oom_case {
    ag_module *m;
    ag_tensor *x;
} oom_case;

/* Export (forward and backward draws), compile, one training step; every allocation failure
 * must surface as AG_ENOMEM with nothing leaked. */
static int oom_scenario(void *ud) {
    oom_case *c = ud;
    ag_joint *j = ag_export_joint(c->m, &c->x, 1, NULL, NULL, 0, NULL);
    ag_compile_opts co = {.partition = {.partitioner = AG_PARTITION_MINCUT, .memory_budget = 1.0}};
    ag_compiled *f = j ? ag_compile_joint(j, &co) : NULL;
    int rc = f ? 0 : ag_last_status();
    if (f) {
        ag_scope_begin();
        ag_tensor *out[2];
        int n = ag_compiled_call_module(f, c->m, &c->x, 1, out, 2);
        rc = n < 0 ? n : ag_backward(ag_sum_all(out[0]), NULL, false);
        tu_alloc_cleanup_begin();
        ag_scope_end();
        ag_tensor_set_grad(ag_module_param(c->m, "w"), NULL);
        tu_alloc_cleanup_end();
    }
    ag_compiled_free(f);
    ag_joint_free(j);
    return rc;
}

static void test_alloc_failures(void **st) {
    (void)st;
    assert_non_null(tu_noisy_op());
    ag_manual_seed(8);
    oom_case c = {noisy_module(), ag_randn(AG_F32, 1, (int64_t[]){6})};
    assert_int_equal(oom_scenario(&c), 0); /* warm-up: registries, scratch, scopes */
    tu_sweep_opts o = {.what = "rng export + compile + step", .one_thread = true};
    assert_true(tu_alloc_failure_sweep(oom_scenario, &c, &o) > 100);
    ag_tensor_free(c.x);
    ag_module_free(c.m);
}

/* ---- the CLI ---- */

#define HAS(file, s) tu_cli_has(file, s)

static void test_cli(void **st) {
    (void)st;
    if (!tu_cli_setup("/tmp/ag_test_rng_XXXXXX"))
        skip();
    assert_int_equal(tu_cli_run("export dropout_mlp"), 0);
    HAS("out", "%fwd_seed : i64[]  # PhiloxForwardSeedAOTInput()");
    HAS("out", "%fwd_base_offset : i64[]  # PhiloxForwardBaseOffsetAOTInput()");
    HAS("out", "philox_rand([8, 32], %fwd_seed, %add, ");
    HAS("out", "[PlainAOTOutput(idx=0), PhiloxUpdatedForwardOffsetAOTOutput(), GradAOTOutput(");
    assert_int_equal(tu_cli_run("descriptors dropout_mlp"), 0);
    HAS("out", "non-differentiable inputs and outputs (3):\n"
               "  descriptor                             node\n"
               "  PhiloxForwardSeedAOTInput()            fwd_seed\n"
               "  PhiloxForwardBaseOffsetAOTInput()      fwd_base_offset\n"
               "  PhiloxUpdatedForwardOffsetAOTOutput()  add_1\n");
    assert_int_equal(tu_cli_run("descriptors linear"), 0);
    tu_cli_lacks("out", "non-differentiable");
    assert_int_equal(tu_cli_run("check dropout_mlp"), 0);
    HAS("out", "outputs 0, gradients 0, buffers 0, inputs 0 (tolerance 0): OK");
    assert_int_equal(tu_cli_run("check dropout_mlp --partitioner default --budget 1"), 0);
    HAS("out", "(tolerance 0): OK");
    assert_int_equal(tu_cli_run("check gpt2 --dropout 0.1 --steps 2"), 0);
    HAS("out", "gpt2 (mincut, budget 1, 2 steps): max relative difference: outputs 0, "
               "gradients 0, buffers 0, inputs 0 (tolerance 0): OK");
    assert_int_equal(tu_cli_run("export gpt2 --dropout 0.1"), 0);
    HAS("out", "PhiloxUpdatedForwardOffsetAOTOutput()");
    assert_int_equal(tu_cli_run("trace dropout_mlp --dropout 0.25"), 0);
    HAS("out", "native_dropout(%relu, 0.25, True)");
    assert_int_equal(tu_cli_run("partition dropout_mlp --partitioner mincut"), 0);
    HAS("out", "philox_rand(");
    /* usage errors */
    assert_int_equal(tu_cli_run("check linear --dropout 0.1"), 2);
    HAS("err", "model 'linear' has no dropout");
    assert_int_equal(tu_cli_run("export gpt2 --dropout 2"), 2);
    HAS("err", "aotgrad export: --dropout: expected a number in [0, 1], got '2'");
    assert_int_equal(tu_cli_run("descriptors gpt2 --dropout x"), 2);
    HAS("err", "aotgrad descriptors: --dropout: expected a number in [0, 1], got 'x'");
    const char *files[] = {"out", "err"};
    tu_cli_cleanup(files, 2);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_philox_ops_equal_eager_draws),
        cmocka_unit_test(test_native_dropout_equals_functional_form),
        cmocka_unit_test(test_philox_op_errors),
        cmocka_unit_test(test_dropout_mlp_joint),
        cmocka_unit_test(test_no_random_ops_no_philox),
        cmocka_unit_test(test_keep_random_ops),
        cmocka_unit_test(test_offsets_per_draw),
        cmocka_unit_test(test_partition_recomputes_mask),
        cmocka_unit_test(test_compiled_training_bit_identical),
        cmocka_unit_test(test_gpt2_dropout),
        cmocka_unit_test(test_backward_draws),
        cmocka_unit_test(test_fx_utils_skip_philox),
        cmocka_unit_test(test_text_round_trip),
        cmocka_unit_test(test_interpreter_equals_executor),
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_alloc_failures),
        cmocka_unit_test(test_cli),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
