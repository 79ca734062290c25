/* Random ops inside nested compile regions (upstream's invoke_subgraph with graph-safe RNG
 * state threaded into the subgraphs as operands): a region whose body draws is traced once and
 * takes a Philox seed and base offset after its operands; each call site passes its own offset,
 * so every call draws fresh numbers, the ones eager's call draws. Checked: the joint's structure
 * (one forward and one joint subgraph; the calls' last operands the seed and add(base, k) with k
 * the numbers drawn before), compiled training bit-identical to eager with the masks of the
 * three calls different, a checkpointed region recomputing its masks in its backward from the
 * seed and offset, GPT-2 with dropout and its blocks as regions equal to the flat model after
 * compiled steps, the refusals (a trace without RNG functionalization; a region whose
 * backward draws), and allocation-failure sweeps of the export and the partition. */
#include "testutil.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define P_DROP 0.5
#define NCALL 3

static ag_tensor *rnd(int ndim, const int64_t *sizes, uint64_t seed) {
    uint64_t state = seed * 0x9E3779B97F4A7C15ull + 1;
    return tu_rand_tensor(AG_F32, ndim, sizes, -1, 1, tu_xorshift, &state);
}

/* ---- the model: y_i = dropout(tanh(x * w_i), 0.5), i = 0..2, each call a region (or not) ---- */

typedef enum { FLAT, REGION, REGION_CKPT, REGION_NOISY } mode;

static int drop_body(void *ud, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)ud;
    (void)nin;
    (void)max_out;
    ag_scope_begin();
    out[0] = ag_tensor_keep(ag_dropout(ag_tanh(ag_mul(in[0], in[1])), P_DROP, true));
    ag_scope_end();
    return out[0] ? 1 : ag_last_status();
}

/* the body checkpointed inside the region (upstream's nested_compile_region(checkpoint(f))) */
static int ckpt_body(void *ud, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    return ag_checkpoint(drop_body, ud, in, nin, out, max_out);
}

/* a body whose backward draws: noisy(dropout(x * w)) */
static int noisy_body(void *ud, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)ud;
    (void)nin;
    (void)max_out;
    ag_scope_begin();
    ag_tensor *h = ag_dropout(ag_mul(in[0], in[1]), P_DROP, true);
    out[0] = ag_tensor_keep(ag_op_call1(tu_noisy_op(), (ag_arg[]){AG_A_T(h)}, 1));
    ag_scope_end();
    return out[0] ? 1 : ag_last_status();
}

static int stack_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out,
                         int max_out) {
    (void)nin;
    (void)max_out;
    mode md = *(const mode *)ag_module_ud(m);
    ag_region_fn fn = md == REGION_CKPT ? ckpt_body : md == REGION_NOISY ? noisy_body : drop_body;
    for (int i = 0; i < NCALL; i++) {
        char name[8];
        snprintf(name, sizeof name, "w%d", i);
        ag_tensor *ops[2] = {in[0], ag_module_param(m, name)};
        int rc = md == FLAT ? fn(NULL, ops, 2, &out[i], 1)
                            : ag_nested_compile_region(fn, NULL, ops, 2, &out[i], 1);
        if (rc != 1) {
            for (int k = 0; k < i; k++)
                ag_tensor_free(out[k]);
            return rc < 0 ? rc : AG_EINVAL;
        }
    }
    return NCALL;
}

static ag_module *stack_new(mode md) {
    mode *ud = malloc(sizeof *ud);
    *ud = md;
    ag_module *m = ag_module_new("DropStack", stack_forward, ud, free);
    for (int i = 0; i < NCALL; i++) {
        char name[8];
        snprintf(name, sizeof name, "w%d", i);
        ag_tensor *w = rnd(2, (int64_t[]){4, 6}, 10 + (uint64_t)i);
        assert_int_equal(ag_module_register_parameter(m, name, w), 0);
        ag_tensor_free(w);
    }
    return m;
}

static int count_calls(const ag_graph *g, const char *ident) {
    int n = 0;
    for (ag_node *x = ag_graph_first(g); x; x = ag_node_next(x))
        n += ag_node_kind_of(x) == AG_NODE_CALL && ag_node_op(x) == ag_op_invoke_subgraph() &&
             !strcmp(ag_node_arg(x, 1)->u.s, ident);
    return n;
}

static int count_op(const ag_graph *g, const char *name) {
    int n = 0;
    for (ag_node *x = ag_graph_first(g); x; x = ag_node_next(x))
        n += ag_node_kind_of(x) == AG_NODE_CALL && !strcmp(ag_op_name(ag_node_op(x)), name);
    return n;
}

static ag_joint *export_or_fail(ag_module *m, ag_tensor *x) {
    ag_joint *j = ag_export_joint(m, &x, 1, NULL, NULL, 0, NULL);
    if (!j)
        fail_msg("export: %s", ag_last_error());
    return j;
}

/* ---- the joint's structure ---- */

/* x, w [4, 6]: each call draws 24 numbers. The forward subgraph is (arg0_1, arg1_1,
 * philox_seed, philox_base_offset) -> dropout of tanh(arg0_1 * arg1_1) drawn at
 * add(philox_base_offset, 0); the outer forward calls it three times with fwd_seed and
 * add(fwd_base_offset, 0 / 24 / 48), the backward calls the joint subgraph with the same seed
 * and offset nodes as the forward call it differentiates, and the updated offset is base + 72. */
static void test_joint_structure(void **st) {
    (void)st;
    ag_module *m = stack_new(REGION);
    ag_tensor *x = rnd(2, (int64_t[]){4, 6}, 1);
    ag_joint *j = export_or_fail(m, x);
    const ag_graph *g = ag_joint_graph(j);
    assert_int_equal(ag_graph_verify(g), 0);
    assert_int_equal(ag_graph_num_subgraphs(g), 2); /* traced once: forward and joint */
    assert_int_equal(count_calls(g, "fw_subgraph_0"), NCALL);
    assert_int_equal(count_calls(g, "bw_subgraph_0_0"), NCALL);
    assert_int_equal(count_op(g, "philox_rand"), 0); /* every draw is inside the region */
    ag_node *seed = ag_graph_find(g, "fwd_seed"), *base = ag_graph_find(g, "fwd_base_offset");
    assert_non_null(seed);
    assert_non_null(base);
    assert_null(ag_graph_find(g, "bwd_seed"));
    ag_node *fw_calls[NCALL] = {0};
    int nf = 0;
    for (ag_node *n = ag_graph_first(g); n; n = ag_node_next(n)) {
        if (ag_node_kind_of(n) != AG_NODE_CALL || ag_node_op(n) != ag_op_invoke_subgraph())
            continue;
        const ag_garg *ops = ag_node_arg(n, 2);
        bool fw = !strcmp(ag_node_arg(n, 1)->u.s, "fw_subgraph_0");
        /* forward: x, w, seed, offset; backward: the same, then the tangent */
        assert_int_equal(ops->n, fw ? 4 : 5);
        assert_ptr_equal(ops->u.nodes[2], seed);
        ag_node *off = ops->u.nodes[3];
        assert_string_equal(ag_op_name(ag_node_op(off)), "add.Scalar");
        assert_ptr_equal(ag_node_arg_node(off, 0), base);
        if (fw) {
            assert_true(nf < NCALL);
            assert_true(ag_node_arg(off, 1)->u.f == 24.0 * nf);
            fw_calls[nf++] = n;
        } else { /* its forward call: the one with the same x operand's weight */
            int k = 0;
            while (k < nf && ag_node_arg(fw_calls[k], 2)->u.nodes[1] != ops->u.nodes[1])
                k++;
            assert_true(k < nf);
            assert_ptr_equal(ag_node_arg(fw_calls[k], 2)->u.nodes[3], off);
        }
    }
    assert_int_equal(nf, NCALL);
    /* the updated forward offset: after the three outputs */
    ag_node *upd = ag_node_arg(ag_graph_output_node(g), 0)->u.nodes[NCALL];
    assert_string_equal(tu_desc_repr(ag_node_output_desc(ag_graph_output_node(g), NCALL)),
                        "PhiloxUpdatedForwardOffsetAOTOutput()");
    assert_true(ag_node_arg_node(upd, 0) == base && ag_node_arg(upd, 1)->u.f == 72.0);
    /* the forward subgraph, printed */
    char *txt = ag_graph_to_string(ag_graph_subgraph(g, "repeated_subgraph0"), NULL);
    assert_non_null(txt);
    static const char *const want[] = {
        "%arg0_1 : f32[4, 6]",
        "%arg1_1 : f32[4, 6]",
        "%philox_seed : i64[]",
        "%philox_base_offset : i64[]",
        "%mul = mul.Tensor(%arg0_1, %arg1_1)",
        "%tanh = tanh(%mul)",
        "%add = add.Scalar(%philox_base_offset, 0.0)",
        "%philox_rand = philox_rand([4, 6], %philox_seed, %add, 0.0, 1.0, dtype=torch.float32)",
        "%ge = ge.Scalar(%philox_rand, 0.5)",
    };
    const char *at = txt;
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        const char *p = strstr(at, want[i]);
        if (!p)
            fail_msg("forward subgraph lacks (in order) '%s':\n%s", want[i], txt);
        at = p + strlen(want[i]);
    }
    ag_free(txt);
    /* the joint subgraph: the same four operands, then the tangent; no gradient for the RNG
     * state; its draw reads its own seed and offset */
    const ag_graph *jsub = ag_graph_subgraph(g, "repeated_subgraph1");
    ag_node **ph = NULL;
    assert_int_equal(ag_graph_placeholders(jsub, &ph), 5);
    assert_string_equal(ag_node_name(ph[2]), "philox_seed");
    assert_string_equal(ag_node_name(ph[3]), "philox_base_offset");
    const ag_garg *jo = ag_node_arg(ag_graph_output_node(jsub), 0);
    assert_int_equal(jo->n, 4 + 1);
    assert_null(jo->u.nodes[2]);
    assert_null(jo->u.nodes[3]);
    assert_int_equal(count_op(jsub, "philox_rand"), 1);
    ag_joint_free(j);
    ag_tensor_free(x);
    ag_module_free(m);
}

/* ---- compiled against eager ---- */

/* Model `md` trained eagerly and compiled (options co) for 2 SGD steps from the same generator
 * state: outputs, gradients, parameters and the generator's offset after each step agree bit
 * for bit; the three calls' dropout masks differ (a mask reused by every call fails here and
 * against eager). */
static void eager_vs_compiled(mode md, const ag_compile_opts *co) {
    ag_module *me = stack_new(md), *mc = stack_new(md);
    ag_tensor *x = rnd(2, (int64_t[]){4, 6}, 1);
    ag_joint *j = export_or_fail(mc, x);
    ag_compiled *c = ag_compile_joint(j, co);
    if (!c)
        fail_msg("compile: %s", ag_last_error());
    ag_optim *oe = ag_optim_sgd(me, 0.1, 0, 0, false), *oc = ag_optim_sgd(mc, 0.1, 0, 0, false);
    ag_rng_set_state(77, 4000);
    for (int step = 0; step < 2; step++) {
        ag_scope_begin();
        uint64_t seed, off, es, eo, cs, coff;
        ag_rng_get_state(&seed, &off);
        ag_tensor *a[NCALL], *b[NCALL];
        assert_int_equal(ag_module_call(me, &x, 1, a, NCALL), NCALL);
        ag_tensor *le = NULL;
        for (int i = 0; i < NCALL; i++) {
            ag_tensor *t = ag_mul_scalar(ag_sum_all(a[i]), 0.5 + 0.25 * i);
            le = le ? ag_add(le, t) : t;
        }
        assert_int_equal(ag_backward(le, NULL, false), 0);
        ag_rng_get_state(&es, &eo);
        assert_true(es == seed && eo == off + NCALL * 24);
        ag_rng_set_state(seed, off);
        int n = ag_compiled_call_module(c, mc, &x, 1, b, NCALL);
        if (n != NCALL)
            fail_msg("compiled call: %s", ag_last_error());
        ag_tensor *lc = NULL;
        for (int i = 0; i < NCALL; i++) {
            assert_true(tu_same_bits(a[i], b[i]));
            ag_tensor *t = ag_mul_scalar(ag_sum_all(b[i]), 0.5 + 0.25 * i);
            lc = lc ? ag_add(lc, t) : t;
        }
        /* the calls' masks (the zeros of their outputs) differ */
        for (int i = 0; i + 1 < NCALL; i++) {
            ag_tensor *z0 = ag_eq_scalar(b[i], 0.0), *z1 = ag_eq_scalar(b[i + 1], 0.0);
            assert_false(tu_same_bits(z0, z1));
        }
        assert_int_equal(ag_backward(lc, NULL, false), 0);
        ag_rng_get_state(&cs, &coff);
        assert_true(cs == es && coff == eo);
        ag_named_tensors pe, pc;
        assert_int_equal(ag_module_named_parameters(me, true, &pe), 0);
        assert_int_equal(ag_module_named_parameters(mc, true, &pc), 0);
        for (int i = 0; i < pe.n; i++) {
            assert_non_null(ag_tensor_grad(pc.tensors[i]));
            if (!tu_same_bits(ag_tensor_grad(pe.tensors[i]), ag_tensor_grad(pc.tensors[i])))
                fail_msg("gradient of %s differs", pe.names[i]);
        }
        assert_int_equal(ag_optim_step(oe), 0);
        assert_int_equal(ag_optim_step(oc), 0);
        for (int i = 0; i < pe.n; i++)
            assert_true(tu_same_bits(pe.tensors[i], pc.tensors[i]));
        ag_named_tensors_free(&pe);
        ag_named_tensors_free(&pc);
        ag_optim_zero_grad(oe);
        ag_optim_zero_grad(oc);
        ag_scope_end();
    }
    ag_optim_free(oe);
    ag_optim_free(oc);
    ag_compiled_free(c);
    ag_joint_free(j);
    ag_tensor_free(x);
    ag_module_free(me);
    ag_module_free(mc);
}

static void test_eager_vs_compiled(void **st) {
    (void)st;
    for (int md = FLAT; md <= REGION_CKPT; md++)
        for (int p = 0; p < 2; p++)
            for (int interp = 0; interp < 2; interp++) {
                ag_compile_opts co = {
                    .partition = {.partitioner = p ? AG_PARTITION_MINCUT : AG_PARTITION_DEFAULT,
                                  .memory_budget = 1.0},
                    .interpret = interp};
                eager_vs_compiled((mode)md, &co);
            }
}

/* ---- checkpointed: the region's backward recomputes its masks ---- */

/* The region's partition (default options): the checkpointed body's forward subgraph saves no
 * mask (no bool value), its backward subgraph draws again from the saved seed and offset (one
 * philox_rand reading its placeholders); unchecked, the forward saves the mask and the backward
 * draws nothing. Compiled training equals eager bit for bit either way (test_eager_vs_compiled);
 * here the recomputed mask equals the forward's: the backward's gradient of w_i is zero exactly
 * where the forward's output is. */
static void test_checkpoint_recomputes_masks(void **st) {
    (void)st;
    for (int ck = 0; ck < 2; ck++) {
        ag_module *m = stack_new(ck ? REGION_CKPT : REGION);
        ag_tensor *x = rnd(2, (int64_t[]){4, 6}, 1);
        ag_joint *j = export_or_fail(m, x);
        ag_graph *pfw = NULL, *pbw = NULL;
        assert_int_equal(
            ag_partition(ag_joint_graph(j), ag_joint_num_fw_outputs(j), NULL, &pfw, &pbw, NULL), 0);
        const ag_graph *rfw = ag_graph_subgraph(pfw, "partitioned_fw_subgraph_0_0");
        const ag_graph *rbw = ag_graph_subgraph(pbw, "partitioned_bw_subgraph_0_0");
        assert_non_null(rfw);
        assert_non_null(rbw);
        const ag_garg *ro = ag_node_arg(ag_graph_output_node(rfw), 0);
        int saved_bool = 0;
        for (int i = 1; i < ro->n; i++)
            saved_bool += ag_node_val(ro->u.nodes[i], 0)->dtype == AG_BOOL;
        assert_int_equal(saved_bool, ck ? 0 : 1);
        assert_int_equal(count_op(rbw, "philox_rand"), ck ? 1 : 0);
        assert_int_equal(count_op(rfw, "philox_rand"), 1);
        ag_graph_free(pfw);
        ag_graph_free(pbw);
        /* compiled: grad w_i = x * tanh'(x w_i) * mask_i * 2 * c_i is zero where y_i is */
        ag_compiled *c = ag_compile_joint(j, NULL);
        assert_non_null(c);
        ag_tensor *y[NCALL];
        assert_int_equal(ag_compiled_call_module(c, m, &x, 1, y, NCALL), NCALL);
        ag_scope_begin();
        ag_tensor *l = NULL;
        for (int i = 0; i < NCALL; i++) {
            ag_tensor *t = ag_sum_all(y[i]);
            l = l ? ag_add(l, t) : t;
        }
        assert_int_equal(ag_backward(l, NULL, false), 0);
        for (int i = 0; i < NCALL; i++) {
            char name[8];
            snprintf(name, sizeof name, "w%d", i);
            ag_tensor *gw = ag_tensor_grad(ag_module_param(m, name));
            assert_true(tu_same_bits(ag_eq_scalar(gw, 0.0), ag_eq_scalar(y[i], 0.0)));
        }
        ag_scope_end();
        for (int i = 0; i < NCALL; i++)
            ag_tensor_free(y[i]);
        ag_compiled_free(c);
        ag_joint_free(j);
        ag_tensor_free(x);
        ag_module_free(m);
    }
}

/* ---- GPT-2 ---- */

/* The zoo's tiny GPT-2 with dropout 0.1, its blocks as regions and flat: one forward and one
 * joint subgraph for the two blocks, and two compiled training steps from the same generator
 * state give the flat model's losses (the same bits) and gradients (within 1e-5), the generator
 * advanced alike. */
static void test_gpt2_dropout_blocks(void **st) {
    (void)st;
    ag_module *mf = NULL, *mr = NULL;
    ag_tensor *in_f[2], *in_r[2];
    int nf = 0, nr = 0;
    ag_zoo_opts of = {.set_dropout = true, .dropout = 0.1};
    ag_zoo_opts orr = {.set_dropout = true, .dropout = 0.1, .nested_blocks = true};
    assert_int_equal(ag_zoo_build_opts("gpt2", NULL, &of, &mf, in_f, 2, &nf), 0);
    assert_int_equal(ag_zoo_build_opts("gpt2", NULL, &orr, &mr, in_r, 2, &nr), 0);
    ag_module *sf = tu_sum_loss_step(mf), *sr = tu_sum_loss_step(mr);
    assert_non_null(sf);
    assert_non_null(sr);
    ag_joint *jf = export_or_fail(sf, in_f[0]);
    ag_joint *jr = export_or_fail(sr, in_r[0]);
    const ag_graph *g = ag_joint_graph(jr);
    assert_int_equal(ag_graph_num_subgraphs(g), 2);
    assert_int_equal(count_calls(g, "fw_subgraph_0"), 2);
    assert_int_equal(count_op(g, "philox_rand"), 1); /* the embedding's; the blocks' inside */
    assert_int_equal(count_op(ag_graph_subgraph(g, "repeated_subgraph0"), "philox_rand"), 3);
    ag_compile_opts co = {.partition = {.partitioner = AG_PARTITION_MINCUT, .memory_budget = 1.0}};
    ag_compiled *cf = ag_compile_joint(jf, &co), *cr = ag_compile_joint(jr, &co);
    assert_non_null(cf);
    assert_non_null(cr);
    ag_named_tensors pf = {0}, pr = {0};
    assert_int_equal(ag_module_named_parameters(sf, true, &pf), 0);
    assert_int_equal(ag_module_named_parameters(sr, true, &pr), 0);
    assert_int_equal(pf.n, pr.n);
    ag_rng_set_state(1234, 99);
    for (int step = 0; step < 2; step++) {
        uint64_t s0, o0, s1, o1, s2, o2;
        ag_rng_get_state(&s0, &o0);
        ag_tensor *lf = NULL, *lr = NULL;
        assert_int_equal(ag_compiled_call_module(cf, sf, in_f, 1, &lf, 1), 1);
        assert_int_equal(ag_backward(lf, NULL, false), 0);
        ag_rng_get_state(&s1, &o1);
        ag_rng_set_state(s0, o0);
        assert_int_equal(ag_compiled_call_module(cr, sr, in_r, 1, &lr, 1), 1);
        assert_int_equal(ag_backward(lr, NULL, false), 0);
        ag_rng_get_state(&s2, &o2);
        assert_true(o1 > o0 && o2 == o1);
        if (tu_max_abs_diff(lf, lr) > 1e-5)
            fail_msg("step %d: loss %g flat, %g with regions", step, ag_tensor_item_at(lf, 0),
                     ag_tensor_item_at(lr, 0));
        for (int i = 0; i < pf.n; i++) {
            assert_string_equal(pf.names[i], pr.names[i]);
            ag_tensor *gf = ag_tensor_grad(pf.tensors[i]), *gr = ag_tensor_grad(pr.tensors[i]);
            assert_non_null(gr);
            if (tu_max_abs_diff(gf, gr) > 1e-5)
                fail_msg("step %d: gradient of %s differs by %g", step, pf.names[i],
                         tu_max_abs_diff(gf, gr));
            assert_int_equal(ag_tensor_set_grad(pf.tensors[i], NULL), 0);
            assert_int_equal(ag_tensor_set_grad(pr.tensors[i], NULL), 0);
        }
        ag_tensor_free(lf);
        ag_tensor_free(lr);
        ag_rng_set_state(s1, o1);
    }
    ag_named_tensors_free(&pf);
    ag_named_tensors_free(&pr);
    ag_compiled_free(cf);
    ag_compiled_free(cr);
    ag_joint_free(jf);
    ag_joint_free(jr);
    ag_tensor_free(in_f[0]);
    ag_tensor_free(in_r[0]);
    ag_module_free(sf);
    ag_module_free(sr);
}

/* ---- refusals ---- */

/* A trace that records random ops as they are (ag_trace_module, or the export with
 * keep_random_ops) cannot give each call its own draws: refused, naming the region and the op;
 * a region whose backward draws is refused too. Eagerly each runs. */
static void test_refusals(void **st) {
    (void)st;
    ag_module *m = stack_new(REGION);
    ag_tensor *x = rnd(2, (int64_t[]){4, 6}, 1);
    assert_null(ag_trace_module(m, &x, 1, NULL));
    tu_assert_error_contains("nested_compile_region function");
    tu_assert_error_contains("is a random op");
    tu_assert_error_contains("RNG functionalization");
    ag_export_opts eo = {.keep_random_ops = true};
    assert_null(ag_export_joint(m, &x, 1, NULL, NULL, 0, &eo));
    tu_assert_error_contains("is a random op");
    ag_module_free(m);
    m = stack_new(REGION_NOISY);
    ag_tensor *y[NCALL];
    assert_int_equal(ag_module_call(m, &x, 1, y, NCALL), NCALL);
    for (int i = 0; i < NCALL; i++)
        ag_tensor_free(y[i]);
    assert_null(ag_export_joint(m, &x, 1, NULL, NULL, 0, NULL));
    tu_assert_error_contains("backward draws random numbers");
    ag_module_free(m);
    ag_tensor_free(x);
}

/* ---- allocation failures ---- */

typedef struct oom_case {
    ag_module *m;
    ag_tensor *x;
} oom_case;

static int oom_export(void *ud) {
    const oom_case *c = ud;
    ag_joint *j = ag_export_joint(c->m, (ag_tensor *[]){c->x}, 1, NULL, NULL, 0, NULL);
    int rc = j ? 0 : ag_last_status();
    ag_joint_free(j);
    return rc;
}

static int oom_partition(void *ud) {
    const ag_joint *j = ud;
    ag_graph *fw = NULL, *bw = NULL;
    int rc = ag_partition(ag_joint_graph(j), ag_joint_num_fw_outputs(j), NULL, &fw, &bw, NULL);
    ag_graph_free(fw);
    ag_graph_free(bw);
    return rc;
}

/* Exporting (the region's draws, the calls' reserved offsets) and partitioning the dropout
 * regions, plain and checkpointed, under every allocation failure: a clear status, no leak. */
static void test_out_of_memory(void **st) {
    (void)st;
    for (int ck = 0; ck < 2; ck++) {
        ag_module *m = stack_new(ck ? REGION_CKPT : REGION);
        ag_tensor *x = rnd(2, (int64_t[]){4, 6}, 1);
        oom_case c = {m, x};
        tu_sweep_opts o = {.what = "dropout region export", .one_thread = true};
        assert_true(tu_alloc_failure_sweep(oom_export, &c, &o) > 10);
        ag_joint *j = export_or_fail(m, x);
        o = (tu_sweep_opts){.what = "partition of dropout regions", .one_thread = true};
        assert_true(tu_alloc_failure_sweep(oom_partition, j, &o) > 10);
        ag_joint_free(j);
        ag_tensor_free(x);
        ag_module_free(m);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_joint_structure),
        cmocka_unit_test(test_eager_vs_compiled),
        cmocka_unit_test(test_checkpoint_recomputes_masks),
        cmocka_unit_test(test_gpt2_dropout_blocks),
        cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_out_of_memory),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
