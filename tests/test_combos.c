/* Issue 6's parts together: effect tokens with RNG functionalization (forward and backward
 * draws), effect tokens with aliased mutated inputs, and tensor subclasses with effect tokens,
 * random ops and duplicated plain inputs. Each part has its own test file; this one checks that
 * their slots share the joint's calling convention (spec 6.3: forward tokens, primals,
 * tangents, backward tokens, philox inputs; outputs: forward tokens, mutations, user outputs,
 * forward offset, grads, backward offset, backward tokens) and that the compiled callable
 * serves all of them at once: compiled training equals eager bit for bit, with the same side
 * effects in the same order and the generator advanced alike. */
#include "testutil.h"
#include "runtime/effect_tokens.h"
#include "runtime/rng_wrap.h"

#include <stdio.h>
#include <string.h>

/* ---- helpers ---- */

/* The log from record `from` on, as "tag[.grad]:sum" words (values included: the compiled
 * run must log the same numbers, not just the same tags). */
static const char *log_str(int from, char *out, size_t cap) {
    size_t k = 0;
    out[0] = 0;
    for (int i = from; i < ag_zoo_log_count(); i++) {
        ag_zoo_log_record r;
        assert_int_equal(ag_zoo_log_get(i, &r), 0);
        k += (size_t)snprintf(out + k, cap - k, "%s%s%s:%.9g", k ? " " : "", r.tag,
                              r.grad ? ".grad" : "", r.sum);
    }
    return out;
}

static ag_tensor *log_value(ag_tensor *x, const char *tag) {
    return ag_op_call1(ag_zoo_log_value_op(), (ag_arg[]){AG_A_T(x), AG_A_S(tag)}, 2);
}

/* ---- the models ---- */

static ag_module *with_param(const char *type, ag_forward_fn fwd, const char *name, ag_tensor *p) {
    ag_module *m = ag_module_new(type, fwd, NULL, NULL);
    assert_non_null(m);
    assert_int_equal(ag_module_register_parameter(m, name, p), 0);
    ag_tensor_free(p);
    return m;
}

/* x [6, 4], w [4]: y = noisy(log_value(dropout(x * w, 0.5), 'h')): a forward draw, a
 * forward and a backward effect, and a backward draw. */
static int drop_log_fwd(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)nin;
    (void)max_out;
    ag_scope_begin();
    ag_tensor *h = ag_dropout(ag_mul(in[0], ag_module_param(m, "w")), 0.5, true);
    ag_tensor *y = ag_op_call1(tu_noisy_op(), (ag_arg[]){AG_A_T(log_value(h, "h"))}, 1);
    out[0] = ag_tensor_keep(y);
    ag_scope_end();
    return out[0] ? 1 : ag_last_status();
}
static ag_module *drop_log_module(void) {
    return with_param("DropLog", drop_log_fwd, "w", ag_randn(AG_F32, 1, (int64_t[]){4}));
}

/* a [3, 4] and b = a[1] (a view of a, passed as a second input): b.mul_(2), then
 * y = log_value((a + 1) * w, 'y'), w [4]. The mutated aliased inputs become one base. */
static int alias_log_fwd(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out,
                         int max_out) {
    (void)nin;
    (void)max_out;
    ag_scope_begin();
    ag_tensor *r = ag_mul_scalar_(in[1], 2.0);
    ag_tensor *y = log_value(ag_mul(ag_add_scalar(in[0], 1.0), ag_module_param(m, "w")), "y");
    out[0] = r ? ag_tensor_keep(y) : NULL;
    ag_scope_end();
    return out[0] ? 1 : ag_last_status();
}
static ag_module *alias_log_module(void) {
    return with_param("AliasLog", alias_log_fwd, "w", ag_randn(AG_F32, 1, (int64_t[]){4}));
}

/* w a TwoTensor [4] parameter, x [5, 4] plain: y = log_value(x, 'x') is logged (the token
 * flows past the subclass), out = dropout(x * w, 0.5) is a TwoTensor whose halves each draw. */
static int two_drop_fwd(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)nin;
    (void)max_out;
    ag_scope_begin();
    ag_tensor *x = log_value(in[0], "x");
    ag_tensor *y = ag_dropout(ag_mul(x, ag_module_param(m, "w")), 0.5, true);
    out[0] = ag_tensor_keep(y);
    ag_scope_end();
    return out[0] ? 1 : ag_last_status();
}
static ag_module *two_drop_module(void) {
    ag_scope_begin();
    ag_tensor *w =
        ag_two_tensor(ag_randn(AG_F32, 1, (int64_t[]){4}), ag_randn(AG_F32, 1, (int64_t[]){4}));
    ag_tensor_keep(w);
    ag_scope_end();
    assert_non_null(w);
    assert_int_equal(ag_tensor_set_requires_grad(w, true), 0);
    return with_param("TwoDrop", two_drop_fwd, "w", w);
}

/* ---- compiled training against eager ---- */

/* `steps` SGD steps of the same model in eager mode and compiled, from the same generator
 * state each step: outputs, gradients and parameters bit-identical, the same log records
 * (tags and values) and the same generator state afterwards. */
static void train_side_by_side(ag_module *(*make)(void), ag_tensor *const *in, int nin,
                               const ag_compile_opts *co, int steps) {
    ag_manual_seed(21);
    ag_module *me = make();
    ag_manual_seed(21);
    ag_module *mc = make();
    ag_joint *j = ag_export_joint(mc, in, nin, NULL, NULL, 0, NULL);
    if (!j)
        fail_msg("export: %s", ag_last_error());
    ag_compiled *c = ag_compile_joint(j, co);
    if (!c)
        fail_msg("compile: %s", ag_last_error());
    ag_joint_free(j);
    ag_optim *oe = ag_optim_sgd(me, 0.1, 0, 0, false), *oc = ag_optim_sgd(mc, 0.1, 0, 0, false);
    ag_named_tensors pe, pc;
    assert_int_equal(ag_module_named_parameters(me, false, &pe), 0);
    assert_int_equal(ag_module_named_parameters(mc, false, &pc), 0);
    ag_rng_set_state(99, 12345);
    static char le[4096], lc[4096];
    for (int step = 0; step < steps; step++) {
        ag_scope_begin();
        uint64_t seed, off, es, eo, cs, coff;
        ag_rng_get_state(&seed, &off);
        int l0 = ag_zoo_log_count();
        ag_tensor *a, *b;
        assert_int_equal(ag_module_call(me, in, nin, &a, 1), 1);
        assert_int_equal(ag_backward(ag_sum_all(ag_mul(a, a)), NULL, false), 0);
        ag_rng_get_state(&es, &eo);
        log_str(l0, le, sizeof le);
        assert_true(eo > off); /* the model draws */
        ag_rng_set_state(seed, off);
        int l1 = ag_zoo_log_count();
        if (ag_compiled_call_module(c, mc, in, nin, &b, 1) != 1)
            fail_msg("compiled call: %s", ag_last_error());
        assert_int_equal(ag_backward(ag_sum_all(ag_mul(b, b)), NULL, false), 0);
        ag_rng_get_state(&cs, &coff);
        log_str(l1, lc, sizeof lc);
        assert_string_equal(le, lc);
        assert_true(strlen(le) > 0);
        assert_true(cs == es && coff == eo);
        assert_ptr_equal(ag_tensor_subclass(a), ag_tensor_subclass(b));
        assert_true(tu_same_bits(a, b));
        for (int i = 0; i < pe.n; i++) {
            assert_non_null(ag_tensor_grad(pc.tensors[i]));
            if (!tu_same_bits(ag_tensor_grad(pe.tensors[i]), ag_tensor_grad(pc.tensors[i])))
                fail_msg("step %d: the gradient of %s differs", step, pe.names[i]);
        }
        assert_int_equal(ag_optim_step(oe), 0);
        assert_int_equal(ag_optim_step(oc), 0);
        ag_optim_zero_grad(oe);
        ag_optim_zero_grad(oc);
        ag_scope_end();
    }
    for (int i = 0; i < pe.n; i++)
        assert_true(tu_same_bits(pe.tensors[i], pc.tensors[i]));
    ag_named_tensors_free(&pe);
    ag_named_tensors_free(&pc);
    ag_optim_free(oe);
    ag_optim_free(oc);
    ag_compiled_free(c);
    ag_module_free(me);
    ag_module_free(mc);
}

static void train_all_partitioners(ag_module *(*make)(void), ag_tensor *const *in, int nin) {
    for (int p = 0; p < 3; p++)
        for (int interp = 0; interp < 2; interp++) {
            ag_compile_opts co = {
                .partition = {.partitioner = p ? AG_PARTITION_MINCUT : AG_PARTITION_DEFAULT,
                              .memory_budget = p == 2 ? AG_MEMORY_BUDGET_ZERO : 1.0},
                .interpret = interp};
            train_side_by_side(make, in, nin, &co, 3);
        }
}

/* ---- tests ---- */

/* Forward and backward draws with forward and backward effects: tokens first and last among
 * the primals' and outputs' slots, philox inputs after the backward token, offsets around the
 * grads. */
static void test_dropout_with_effects(void **st) {
    (void)st;
    assert_non_null(tu_noisy_op());
    ag_manual_seed(3);
    ag_module *m = drop_log_module();
    ag_tensor *x = ag_randn(AG_F32, 2, (int64_t[]){6, 4});
    ag_joint *j = ag_export_joint(m, &x, 1, NULL, NULL, 0, NULL);
    if (!j)
        fail_msg("export: %s", ag_last_error());
    const ag_graph *g = ag_joint_graph(j);
    assert_string_equal(tu_placeholders_str(g),
                        "primals_1: ForwardTokenAOTInput(idx=0)\n"
                        "primals_2: ParamAOTInput(target='w')\n"
                        "primals_3: PlainAOTInput(idx=0)\n"
                        "tangents_1: TangentAOTInput(output=PlainAOTOutput(idx=0))\n"
                        "tangents_token: BackwardTokenAOTInput(idx=0)\n"
                        "fwd_seed: PhiloxForwardSeedAOTInput()\n"
                        "fwd_base_offset: PhiloxForwardBaseOffsetAOTInput()\n"
                        "bwd_seed: PhiloxBackwardSeedAOTInput()\n"
                        "bwd_base_offset: PhiloxBackwardBaseOffsetAOTInput()\n");
    assert_string_equal(tu_outputs_str(g),
                        "ForwardTokenAOTOutput(idx=0), PlainAOTOutput(idx=0), "
                        "PhiloxUpdatedForwardOffsetAOTOutput(), "
                        "GradAOTOutput(grad_of=ParamAOTInput(target='w')), None, "
                        "PhiloxUpdatedBackwardOffsetAOTOutput(), BackwardTokenAOTOutput(idx=0)");
    assert_int_equal(ag_joint_num_fw_outputs(j), 3);
    assert_int_equal(ag_joint_num_forward_tokens(j), 1);
    assert_int_equal(ag_joint_num_backward_tokens(j), 1);
    /* The partitioned backward: saved values, tangent, token, then its own seed and offset. */
    ag_partition_opts po = {.partitioner = AG_PARTITION_MINCUT, .memory_budget = 1.0};
    ag_graph *fw, *bw;
    if (ag_partition(g, ag_joint_num_fw_outputs(j), &po, &fw, &bw, NULL))
        fail_msg("partition: %s", ag_last_error());
    ag_node **ph;
    int nph = ag_graph_placeholders(bw, &ph);
    assert_true(nph >= 4);
    assert_string_equal(ag_node_name(ph[nph - 4]), "tangents_1");
    assert_string_equal(ag_node_name(ph[nph - 3]), "tangents_token");
    assert_string_equal(ag_node_name(ph[nph - 2]), "bwd_seed");
    assert_string_equal(ag_node_name(ph[nph - 1]), "bwd_base_offset");
    /* (the min-cut may replay the forward's draw from fwd_seed, saved for the backward) */
    assert_string_equal(ag_node_name(ag_graph_placeholders(fw, &ph) > 0 ? ph[0] : NULL),
                        "primals_1");
    ag_graph_free(fw);
    ag_graph_free(bw);
    ag_joint_free(j);
    ag_module_free(m);
    train_all_partitioners(drop_log_module, &x, 1);
    ag_tensor_free(x);
}

/* Aliased inputs with a mutation merged into one base, next to the forward token. */
static void test_aliasing_with_effects(void **st) {
    (void)st;
    ag_manual_seed(4);
    ag_module *m = alias_log_module();
    ag_scope_begin();
    ag_tensor *a = ag_tensor_keep(ag_randn(AG_F32, 2, (int64_t[]){3, 4}));
    ag_tensor *b = ag_tensor_keep(ag_select(a, 0, 1));
    ag_scope_end();
    ag_tensor *in[2] = {a, b};
    ag_joint *j = ag_export_joint(m, in, 2, NULL, NULL, 0, NULL);
    if (!j)
        fail_msg("export: %s", ag_last_error());
    const ag_graph *g = ag_joint_graph(j);
    /* The merged base comes first among the primals (upstream's merge_view_inputs puts the
     * bases before the other inputs), named after the input whose ._base it is (b). */
    assert_string_equal(tu_placeholders_str(g),
                        "primals_1: ForwardTokenAOTInput(idx=0)\n"
                        "primals_2: ViewBaseAOTInput(base_of=PlainAOTInput(idx=1))\n"
                        "primals_3: ParamAOTInput(target='w')\n"
                        "tangents_1: TangentAOTInput(output=PlainAOTOutput(idx=0))\n"
                        "tangents_token: BackwardTokenAOTInput(idx=0)\n");
    assert_string_equal(tu_outputs_str(g),
                        "ForwardTokenAOTOutput(idx=0), "
                        "InputMutationAOTOutput(mutated_input=ViewBaseAOTInput(base_of="
                        "PlainAOTInput(idx=1))), PlainAOTOutput(idx=0), None, "
                        "GradAOTOutput(grad_of=ParamAOTInput(target='w')), "
                        "BackwardTokenAOTOutput(idx=0)");
    assert_int_equal(ag_joint_num_flat_inputs(j), 3);
    assert_int_equal(ag_joint_flat_input_primal(j, 0), 2);
    assert_int_equal(ag_joint_flat_input_primal(j, 1), 1);
    assert_int_equal(ag_joint_flat_input_primal(j, 2), 1);
    ag_joint_free(j);
    ag_module_free(m);

    /* Compiled and eager from equal inputs: the same outputs, logs and mutation of a. */
    for (int p = 0; p < 2; p++) {
        ag_manual_seed(4);
        ag_module *me = alias_log_module();
        ag_manual_seed(4);
        ag_module *mc = alias_log_module();
        ag_scope_begin();
        ag_tensor *ae = ag_clone(a), *ac = ag_clone(a);
        ag_tensor *ine[2] = {ae, ag_select(ae, 0, 1)}, *inc[2] = {ac, ag_select(ac, 0, 1)};
        ag_joint *jc = ag_export_joint(mc, inc, 2, NULL, NULL, 0, NULL);
        assert_non_null(jc);
        ag_compile_opts co = {
            .partition = {.partitioner = p ? AG_PARTITION_MINCUT : AG_PARTITION_DEFAULT,
                          .memory_budget = 1.0}};
        ag_compiled *c = ag_compile_joint(jc, &co);
        assert_non_null(c);
        static char le[1024], lc[1024];
        int l0 = ag_zoo_log_count();
        ag_tensor *ye, *yc;
        assert_int_equal(ag_module_call(me, ine, 2, &ye, 1), 1);
        assert_int_equal(ag_backward(ag_sum_all(ag_mul(ye, ye)), NULL, false), 0);
        log_str(l0, le, sizeof le);
        int l1 = ag_zoo_log_count();
        assert_int_equal(ag_compiled_call_module(c, mc, inc, 2, &yc, 1), 1);
        assert_int_equal(ag_backward(ag_sum_all(ag_mul(yc, yc)), NULL, false), 0);
        log_str(l1, lc, sizeof lc);
        assert_string_equal(le, lc);
        assert_non_null(strstr(le, "y.grad"));
        assert_true(tu_same_bits(ye, yc));
        assert_true(tu_same_bits(ae, ac)); /* row 1 doubled in both */
        assert_false(tu_same_bits(ae, a));
        assert_true(tu_same_bits(ag_tensor_grad(ag_module_param(me, "w")),
                                 ag_tensor_grad(ag_module_param(mc, "w"))));
        ag_scope_end();
        ag_compiled_free(c);
        ag_joint_free(jc);
        ag_module_free(me);
        ag_module_free(mc);
    }
    ag_tensor_free(a);
    ag_tensor_free(b);
}

/* A TwoTensor parameter with an effect and random ops: the token before the flattened
 * primals, the philox inputs after the flattened tangents, the offset after the flattened
 * output, the grads flattened. */
static void test_subclass_with_effects_and_dropout(void **st) {
    (void)st;
    ag_manual_seed(5);
    ag_module *m = two_drop_module();
    ag_tensor *x = ag_randn(AG_F32, 2, (int64_t[]){5, 4});
    ag_joint *j = ag_export_joint(m, &x, 1, NULL, NULL, 0, NULL);
    if (!j)
        fail_msg("export: %s", ag_last_error());
    const ag_graph *g = ag_joint_graph(j);
    assert_string_equal(
        tu_placeholders_str(g),
        "primals_1: ForwardTokenAOTInput(idx=0)\n"
        "primals_2: SubclassGetAttrAOTInput(base=ParamAOTInput(target='w'), attr='a')\n"
        "primals_3: SubclassGetAttrAOTInput(base=ParamAOTInput(target='w'), attr='b')\n"
        "primals_4: PlainAOTInput(idx=0)\n"
        "tangents_1: SubclassGetAttrAOTInput(base=TangentAOTInput(output=PlainAOTOutput(idx=0)), "
        "attr='a')\n"
        "tangents_2: SubclassGetAttrAOTInput(base=TangentAOTInput(output=PlainAOTOutput(idx=0)), "
        "attr='b')\n"
        "fwd_seed: PhiloxForwardSeedAOTInput()\n"
        "fwd_base_offset: PhiloxForwardBaseOffsetAOTInput()\n");
    assert_string_equal(
        tu_outputs_str(g),
        "ForwardTokenAOTOutput(idx=0), "
        "SubclassGetAttrAOTOutput(base=PlainAOTOutput(idx=0), attr='a'), "
        "SubclassGetAttrAOTOutput(base=PlainAOTOutput(idx=0), attr='b'), "
        "PhiloxUpdatedForwardOffsetAOTOutput(), "
        "SubclassGetAttrAOTOutput(base=GradAOTOutput(grad_of=ParamAOTInput(target='w')), "
        "attr='a'), "
        "SubclassGetAttrAOTOutput(base=GradAOTOutput(grad_of=ParamAOTInput(target='w')), "
        "attr='b'), None");
    assert_int_equal(ag_joint_num_static_inputs(j), 2);
    assert_int_equal(ag_joint_static_input(j, 0), 1);
    assert_int_equal(ag_joint_static_input(j, 1), 2);
    assert_int_equal(ag_joint_num_flat_inputs(j), 3);
    ag_joint_free(j);
    ag_module_free(m);
    train_all_partitioners(two_drop_module, &x, 1);
    ag_tensor_free(x);
}

/* A plain input passed twice next to a TwoTensor parameter: the duplicate keeps its own leaf
 * (not mutated), so both slots get a primal and a gradient. Outputs: 3 w (a TwoTensor) and
 * x sin(x) (plain). */
static int two_dup_fwd(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)nin;
    (void)max_out;
    ag_scope_begin();
    out[0] = ag_tensor_keep(ag_mul_scalar(ag_module_param(m, "w"), 3.0));
    out[1] = ag_tensor_keep(ag_mul(in[0], ag_sin(in[1])));
    ag_scope_end();
    return out[0] && out[1] ? 2 : ag_last_status();
}

static void test_subclass_with_duplicate_input(void **st) {
    (void)st;
    ag_manual_seed(6);
    ag_scope_begin();
    ag_tensor *w = ag_tensor_keep(
        ag_two_tensor(ag_randn(AG_F32, 1, (int64_t[]){4}), ag_randn(AG_F32, 1, (int64_t[]){4})));
    ag_scope_end();
    ag_module *m = with_param("TwoDup", two_dup_fwd, "w", w);
    ag_tensor *x = ag_randn(AG_F32, 1, (int64_t[]){4});
    assert_int_equal(ag_tensor_set_requires_grad(x, true), 0);
    ag_tensor *in[2] = {x, x};
    ag_joint *j = ag_export_joint(m, in, 2, NULL, NULL, 0, NULL);
    if (!j)
        fail_msg("export: %s", ag_last_error());
    const ag_graph *g = ag_joint_graph(j);
    assert_string_equal(
        tu_placeholders_str(g),
        "primals_1: SubclassGetAttrAOTInput(base=ParamAOTInput(target='w'), attr='a')\n"
        "primals_2: SubclassGetAttrAOTInput(base=ParamAOTInput(target='w'), attr='b')\n"
        "primals_3: PlainAOTInput(idx=0)\n"
        "primals_4: PlainAOTInput(idx=1)\n"
        "tangents_1: SubclassGetAttrAOTInput(base=TangentAOTInput(output=PlainAOTOutput(idx=0)), "
        "attr='a')\n"
        "tangents_2: SubclassGetAttrAOTInput(base=TangentAOTInput(output=PlainAOTOutput(idx=0)), "
        "attr='b')\n"
        "tangents_3: TangentAOTInput(output=PlainAOTOutput(idx=1))\n");
    assert_string_equal(
        tu_outputs_str(g),
        "SubclassGetAttrAOTOutput(base=PlainAOTOutput(idx=0), attr='a'), "
        "SubclassGetAttrAOTOutput(base=PlainAOTOutput(idx=0), attr='b'), PlainAOTOutput(idx=1), "
        "SubclassGetAttrAOTOutput(base=GradAOTOutput(grad_of=ParamAOTInput(target='w')), "
        "attr='a'), "
        "SubclassGetAttrAOTOutput(base=GradAOTOutput(grad_of=ParamAOTInput(target='w')), "
        "attr='b'), "
        "GradAOTOutput(grad_of=PlainAOTInput(idx=0)), GradAOTOutput(grad_of=PlainAOTInput(idx=1))");
    /* Compiled: x's gradient is the sum of both slots', as eager's; each output's loss is
     * backpropagated on its own (the other output's gradient is missing: zeros). */
    ag_compiled *c = ag_compile_joint(j, NULL);
    assert_non_null(c);
    ag_scope_begin();
    ag_tensor *ye[2], *yc[2];
    assert_int_equal(ag_module_call(m, in, 2, ye, 2), 2);
    assert_int_equal(ag_backward(ag_sum_all(ag_mul(ye[0], ye[0])), NULL, true), 0);
    assert_int_equal(ag_backward(ag_sum_all(ag_mul(ye[1], ye[1])), NULL, false), 0);
    ag_tensor *ge = ag_clone(ag_tensor_grad(x)), *gwe = ag_clone(ag_tensor_grad(w));
    ag_tensor_set_grad(x, NULL);
    ag_tensor_set_grad(w, NULL);
    assert_int_equal(ag_compiled_call_module(c, m, in, 2, yc, 2), 2);
    assert_ptr_equal(ag_tensor_subclass(yc[0]), ag_two_tensor_type());
    assert_null(ag_tensor_subclass(yc[1]));
    assert_int_equal(ag_backward(ag_sum_all(ag_mul(yc[0], yc[0])), NULL, true), 0);
    assert_int_equal(ag_backward(ag_sum_all(ag_mul(yc[1], yc[1])), NULL, false), 0);
    assert_true(tu_same_bits(ye[0], yc[0]));
    assert_true(tu_same_bits(ye[1], yc[1]));
    assert_true(tu_max_abs_diff(ge, ag_tensor_grad(x)) <= 1e-6);
    ag_tensor *gw = ag_tensor_grad(w);
    assert_ptr_equal(ag_tensor_subclass(gw), ag_two_tensor_type());
    assert_true(tu_same_bits(gwe, gw));
    ag_scope_end();
    ag_compiled_free(c);
    ag_joint_free(j);
    ag_module_free(m);
    ag_tensor_free(x);
}

/* A TwoTensor input aliasing a mutated plain input: upstream's refusal. */
static int two_alias_fwd(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out,
                         int max_out) {
    (void)m;
    (void)nin;
    (void)max_out;
    ag_scope_begin();
    ag_tensor *r = ag_add_scalar_(in[0], 1.0);
    ag_tensor *y = r ? ag_mul_scalar(in[1], 3.0) : NULL;
    out[0] = ag_tensor_keep(y);
    ag_scope_end();
    return out[0] ? 1 : ag_last_status();
}

static void test_subclass_aliasing_refused(void **st) {
    (void)st;
    ag_module *m = ag_module_new("TwoAlias", two_alias_fwd, NULL, NULL);
    ag_scope_begin();
    ag_tensor *a = ag_randn(AG_F32, 1, (int64_t[]){8});
    ag_tensor *t = ag_two_tensor(ag_slice(a, 0, 0, 4, 1), ag_slice(a, 0, 4, 8, 1));
    ag_tensor *in[2] = {a, t};
    assert_null(ag_export_joint(m, in, 2, NULL, NULL, 0, NULL));
    tu_assert_error_contains("Encountered aliased inputs that are mutated in the graph, but at "
                             "least one input/output to the graph is a tensor subclass.");
    ag_scope_end();
    ag_module_free(m);
}

/* The compiled callable's token and RNG wrappers keep what they feed between runs: a warm run
 * allocates nothing, and a seed tensor still held (saved for a pending backward) is not
 * overwritten but replaced. */
static void test_wrappers_allocate_nothing_warm(void **st) {
    (void)st;
    ag_module *m;
    ag_tensor *ex[4];
    int nex;
    assert_int_equal(ag_zoo_build("effects", NULL, &m, ex, 4, &nex), 0);
    ag_joint *j = ag_export_joint(m, ex, nex, NULL, NULL, 0, NULL);
    assert_non_null(j);
    ag_compiled *c = ag_compile_joint(j, NULL);
    assert_non_null(c);
    const ag_graph *fw = ag_compiled_forward_graph(c);
    ag_runnable r;
    assert_int_equal(ag_compiler_plan(fw, NULL, &r), 0);
    ag_named_tensors ps;
    assert_int_equal(ag_module_named_parameters(m, false, &ps), 0);
    ag_tensor *flat[8], *prim[8], *outs[16];
    int nf = 0;
    for (int i = 0; i < ps.n; i++)
        flat[nf++] = ps.tensors[i];
    flat[nf++] = ex[0];
    int np = ag_joint_primals_from_flat(j, flat, nf, prim, 8);
    assert_int_equal(np, nf + 1); /* the token first */
    ag__effect_cache e = {0};
    int64_t calls[2];
    for (int run = 0; run < 2; run++) {
        tu_alloc_count_begin();
        int n = ag__effect_tokens_run(&e, fw, &r, 1, prim + 1, np - 1, outs, 16);
        calls[run] = tu_alloc_count_end();
        assert_true(n > 0);
        for (int k = 0; k < n; k++)
            ag_tensor_free(outs[k]);
    }
    assert_true(calls[0] > 0);
    assert_int_equal(calls[1], 0);
    ag__effect_cache_clear(&e);
    for (int i = 0; i < np; i++)
        ag_tensor_free(prim[i]);
    ag_named_tensors_free(&ps);
    r.destroy(r.self);
    ag_compiled_free(c);
    ag_joint_free(j);
    ag_module_free(m);
    ag_tensor_free(ex[0]);

    /* RNG: the forward of dropout_mlp takes the generator's state. */
    assert_int_equal(ag_zoo_build("dropout_mlp", NULL, &m, ex, 4, &nex), 0);
    j = ag_export_joint(m, ex, nex, NULL, NULL, 0, NULL);
    c = j ? ag_compile_joint(j, NULL) : NULL;
    assert_non_null(c);
    ag__rng_wrap w;
    assert_int_equal(ag__rng_wrap_init(&w, ag_compiled_forward_graph(c), false), 0);
    assert_true(w.seed_in >= 0 && w.offset_in >= 0);
    ag_tensor *in[64] = {0};
    ag_rng_set_state(5, 100);
    assert_int_equal(ag__rng_wrap_feed(&w, in), 0);
    ag_rng_set_state(5, 200);
    tu_alloc_count_begin();
    assert_int_equal(ag__rng_wrap_feed(&w, in), 0);
    assert_int_equal(tu_alloc_count_end(), 0);
    assert_true(ag_tensor_item_at(in[w.offset_in], 0) == 200);
    ag_tensor *held = ag_tensor_keep(in[w.offset_in]); /* as a pending backward would */
    ag_rng_set_state(5, 300);
    tu_alloc_count_begin();
    assert_int_equal(ag__rng_wrap_feed(&w, in), 0);
    assert_true(tu_alloc_count_end() > 0);
    assert_true(ag_tensor_item_at(held, 0) == 200);
    assert_true(ag_tensor_item_at(in[w.offset_in], 0) == 300);
    assert_true(ag_tensor_item_at(in[w.seed_in], 0) == 5);
    ag_tensor_free(held);
    ag__rng_wrap_clear(&w);
    ag_compiled_free(c);
    ag_joint_free(j);
    ag_module_free(m);
    ag_tensor_free(ex[0]);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_dropout_with_effects),
        cmocka_unit_test(test_aliasing_with_effects),
        cmocka_unit_test(test_subclass_with_effects_and_dropout),
        cmocka_unit_test(test_subclass_with_duplicate_input),
        cmocka_unit_test(test_subclass_aliasing_refused),
        cmocka_unit_test(test_wrappers_allocate_nothing_warm),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
