/* `aotgrad check MODEL|FILE.joint [--config NAME] [--dropout P] [--nested-blocks]
 * [--partitioner default|mincut] [--budget F] [--steps N] [--interpret]`: for a saved joint (a name
 * ending in .joint) see cmd_check_saved.c; for a zoo model, runs a zoo model eagerly and through
 * export -> partition -> compile side by side for a few SGD steps, and prints the largest
 * differences of outputs, parameter gradients, buffers (BatchNorm running statistics) and the
 * inputs after the call (a model may mutate its inputs, through views too). Exits 1 when a
 * difference exceeds the tolerance: 1e-5 (float32) or 1e-12 (float64), relative to the reference's
 * largest magnitude, NaN matching NaN and infinities matching the same infinities (cli_compare.c),
 * or when the side effects of effectful ops (the zoo log, cli_effects.c) differ between the two
 * runs. Both runs share the one generator: each step saves its state before the eager step and
 * restores it before the compiled one, so both draw the same numbers; a model with random ops
 * (its joint has philox inputs) must then match bit for bit (tolerance 0). */
#include "cli.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

/* Whether the joint draws random numbers (RNG functionalization gave it philox inputs). */
static bool draws(const ag_joint *j) {
    ag_node **ph;
    int n = ag_graph_placeholders(ag_joint_graph(j), &ph);
    for (int i = 0; i < n; i++) {
        const ag_desc *d = ag_node_desc(ph[i]);
        ag_desc_kind k = d ? ag_desc_kind_of(d) : AG_DESC_PLAIN_INPUT;
        if (k == AG_DESC_PHILOX_FORWARD_SEED || k == AG_DESC_PHILOX_BACKWARD_SEED)
            return true;
    }
    return false;
}

int cli_check(int argc, char **argv) {
    const char *model = NULL, *config = NULL;
    ag_zoo_opts zo = {0};
    long long steps = 3;
    ag_compile_opts co = {.partition = {.partitioner = AG_PARTITION_MINCUT, .memory_budget = 1.0}};
    for (int i = 1; i < argc; i++) {
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(argv[i], "--config") && v)
            config = v, i++;
        else if (!strcmp(argv[i], "--dropout")) {
            if (cli_dropout_opt("check", v, &zo))
                return 2;
            i++;
        } else if (!strcmp(argv[i], "--partitioner") && v &&
                   (!strcmp(v, "default") || !strcmp(v, "mincut"))) {
            co.partition.partitioner =
                !strcmp(v, "default") ? AG_PARTITION_DEFAULT : AG_PARTITION_MINCUT;
            i++;
        } else if (!strcmp(argv[i], "--budget")) {
            if (cli_float_opt("check", "--budget", v, 0, false, 1, &co.partition.memory_budget))
                return 2;
            co.partition.memory_budget = ag_memory_budget(co.partition.memory_budget);
            i++;
        } else if (!strcmp(argv[i], "--steps")) {
            if (cli_int_opt("check", "--steps", v, 1, 1000, &steps))
                return 2;
            i++;
        } else if (!strcmp(argv[i], "--interpret")) {
            co.interpret = true;
        } else if (!strcmp(argv[i], "--nested-blocks")) {
            zo.nested_blocks = true;
        } else if (argv[i][0] != '-' && !model) {
            model = argv[i];
        } else {
            fprintf(stderr,
                    "aotgrad check: bad option '%s'\nusage: aotgrad check MODEL [--config NAME] "
                    "[--dropout P] [--nested-blocks] [--partitioner default|mincut] [--budget F] "
                    "[--steps N] [--interpret]\n",
                    argv[i]);
            return 2;
        }
    }
    if (!model) {
        fprintf(stderr, "aotgrad check: which model? (aotgrad models lists them)\n");
        return 2;
    }
    if (cli_is_joint_file(model)) {
        if (config || zo.set_dropout || zo.nested_blocks) {
            fprintf(stderr,
                    "aotgrad check: --config, --dropout and --nested-blocks choose a zoo model's "
                    "build; %s is a saved joint\n",
                    model);
            return 2;
        }
        return cli_check_saved(model, &co, steps);
    }
    ag_module *me = NULL, *mc = NULL;
    ag_tensor *ie[8], *ic[8];
    int ne = 0, nc = 0;
    if (ag_zoo_build_opts(model, config, &zo, &me, ie, 8, &ne) ||
        ag_zoo_build_opts(model, config, &zo, &mc, ic, 8, &nc)) {
        fprintf(stderr, "aotgrad check: %s\n", ag_last_error());
        return 2;
    }
    ag_joint *j = ag_export_joint(mc, ic, nc, NULL, NULL, 0, NULL);
    ag_compiled *c = j ? ag_compile_joint(j, &co) : NULL;
    ag_optim *oe = ag_optim_sgd(me, 1e-2, 0, 0, false), *oc = ag_optim_sgd(mc, 1e-2, 0, 0, false);
    int status = 0;
    if (!c || !oe || !oc) {
        fprintf(stderr, "aotgrad check: %s\n", ag_last_error());
        status = 2;
    }
    bool f64 = ne > 0 && ag_tensor_dtype(ie[0]) == AG_F64, random = j && draws(j);
    double tol = random ? 0 : f64 ? 1e-12 : 1e-5;
    double worst_out = 0, worst_grad = 0, worst_buf = 0, worst_in = 0;
    int neffects = 0; /* effect log records per step (the effects model); compared below */
    char effects_why[512] = "";
    for (long long s = 0; status == 0 && s < steps; s++) {
        ag_scope_begin();
        ag_tensor *oute[16], *outc[16];
        /* The generator as the eager step found it, again for the compiled step; each backward
         * runs right after its forward, so backward draws line up too. The effect log is read
         * between the phases: eager forward, eager backward, compiled forward, compiled
         * backward. */
        uint64_t seed, offset;
        ag_rng_get_state(&seed, &offset);
        int log0 = ag_zoo_log_count();
        int n1 = ag_module_call(me, ie, ne, oute, 16);
        int log1 = ag_zoo_log_count();
        ag_tensor *le = NULL, *lc = NULL;
        int rc = 0;
        for (int k = 0; n1 > 0 && k < n1; k++) {
            if (!ag_tensor_requires_grad(oute[k]))
                continue;
            ag_tensor *a = ag_sum_all(ag_mul_scalar(oute[k], 0.5 + 0.25 * k));
            le = le ? ag_add(le, a) : a;
        }
        if (le)
            rc = ag_backward(le, NULL, false);
        int log2 = ag_zoo_log_count();
        uint64_t eager_seed, eager_offset;
        ag_rng_get_state(&eager_seed, &eager_offset);
        ag_rng_set_state(seed, offset);
        int n2 = n1 > 0 && !rc ? ag_compiled_call_module(c, mc, ic, nc, outc, 16) : -1;
        int log3 = ag_zoo_log_count();
        if (n1 < 0 || n2 != n1) {
            fprintf(stderr, "aotgrad check: step %lld: %s\n", s + 1, ag_last_error());
            status = 2;
            ag_scope_end();
            break;
        }
        for (int i = 0; i < ne && i < nc; i++) /* the callers' tensors after the call */
            worst_in = fmax(worst_in, cli_rel_diff(ie[i], ic[i]));
        /* loss = sum_k sum(out_k * w_k) with fixed weights, for both. */
        for (int k = 0; k < n1; k++) {
            worst_out = fmax(worst_out, cli_rel_diff(oute[k], outc[k]));
            if (!ag_tensor_requires_grad(oute[k]))
                continue;
            ag_tensor *b = ag_sum_all(ag_mul_scalar(outc[k], 0.5 + 0.25 * k));
            lc = lc ? ag_add(lc, b) : b;
        }
        if (lc && !rc)
            rc = ag_backward(lc, NULL, false);
        int log4 = ag_zoo_log_count();
        neffects = log4 - log0;
        if (!effects_why[0] && rc == 0 &&
            (cli_effect_logs_compare(log0, log1, log2, log3, tol, "forward", effects_why,
                                     sizeof effects_why) ||
             cli_effect_logs_compare(log1, log2, log3, log4, tol, "backward", effects_why,
                                     sizeof effects_why)))
            status = 1;
        /* The compiled step leaves the generator where eager's did. */
        uint64_t cs, co_;
        ag_rng_get_state(&cs, &co_);
        if (!rc && (cs != eager_seed || co_ != eager_offset)) {
            fprintf(stderr,
                    "aotgrad check: step %lld: the generator's offset is %llu after the "
                    "compiled step, %llu after the eager one\n",
                    s + 1, (unsigned long long)co_, (unsigned long long)eager_offset);
            status = 1;
        }
        if (rc) {
            fprintf(stderr, "aotgrad check: step %lld backward: %s\n", s + 1, ag_last_error());
            status = 2;
        }
        ag_named_tensors pe, pc, be, bc;
        ag_module_named_parameters(me, true, &pe);
        ag_module_named_parameters(mc, true, &pc);
        for (int i = 0; status == 0 && i < pe.n; i++)
            worst_grad = fmax(worst_grad, cli_rel_diff(ag_tensor_grad(pe.tensors[i]),
                                                       ag_tensor_grad(pc.tensors[i])));
        ag_module_named_buffers(me, true, &be);
        ag_module_named_buffers(mc, true, &bc);
        for (int i = 0; status == 0 && i < be.n; i++)
            worst_buf = fmax(worst_buf, cli_rel_diff(be.tensors[i], bc.tensors[i]));
        ag_named_tensors_free(&pe);
        ag_named_tensors_free(&pc);
        ag_named_tensors_free(&be);
        ag_named_tensors_free(&bc);
        if (status == 0 && (ag_optim_step(oe) || ag_optim_step(oc)))
            status = 2;
        ag_optim_zero_grad(oe);
        ag_optim_zero_grad(oc);
        ag_scope_end();
    }
    if (status == 0) {
        bool ok = worst_out <= tol && worst_grad <= tol && worst_buf <= tol && worst_in <= tol;
        if (neffects)
            printf("%s: side effects: %d logged per step, eager and compiled alike\n", model,
                   neffects / 2);
        printf("%s (%s, budget %g%s, %lld steps): max relative difference: outputs %.3g, "
               "gradients %.3g, buffers %.3g, inputs %.3g (tolerance %g): %s\n",
               model, co.partition.partitioner == AG_PARTITION_DEFAULT ? "default" : "mincut",
               fabs(co.partition.memory_budget), co.interpret ? ", interpreted" : "", steps,
               worst_out, worst_grad, worst_buf, worst_in, tol, ok ? "OK" : "MISMATCH");
        status = ok ? 0 : 1;
    } else if (effects_why[0]) {
        printf("%s: side effects differ: %s: MISMATCH\n", model, effects_why);
    }
    for (int i = 0; i < ne; i++)
        ag_tensor_free(ie[i]);
    for (int i = 0; i < nc; i++)
        ag_tensor_free(ic[i]);
    ag_optim_free(oe);
    ag_optim_free(oc);
    ag_compiled_free(c);
    ag_joint_free(j);
    ag_module_free(me);
    ag_module_free(mc);
    return status;
}
