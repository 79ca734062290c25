/* `aotgrad check MODEL [--config NAME] [--partitioner default|mincut] [--budget F] [--steps N]
 * [--interpret]`: runs a zoo model eagerly and through export -> partition -> compile side by
 * side for a few SGD steps, and prints the largest differences of outputs, parameter gradients
 * and buffers (BatchNorm running statistics). Exits 1 when a difference exceeds the tolerance:
 * 1e-5 (float32) or 1e-12 (float64), relative to the reference's largest magnitude. */
#include "cli.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

static double max_abs(const ag_tensor *t) {
    double m = 0;
    for (int64_t i = 0; i < ag_tensor_numel(t); i++)
        m = fmax(m, fabs(ag_tensor_item_at(t, i)));
    return m;
}

/* Largest |a-b| relative to max(1, max|a|); inf when shapes differ or a value is NaN. Tensor
 * subclass instances (two_tensor's TwoTensors) compare by their plain inner tensors. */
static double rel_diff(const ag_tensor *ref, const ag_tensor *got) {
    if (!ref || !got)
        return ref == got ? 0 : INFINITY;
    if (ag_tensor_subclass(ref) || ag_tensor_subclass(got)) {
        ag_tensor *a[64], *b[64];
        int na = ag_subclass_flatten_tensors((ag_tensor *const *)&ref, 1, a, 64);
        int nb = ag_subclass_flatten_tensors((ag_tensor *const *)&got, 1, b, 64);
        if (ag_tensor_subclass(ref) != ag_tensor_subclass(got) || na != nb || na > 64)
            return INFINITY;
        double m = 0;
        for (int i = 0; i < na; i++)
            m = fmax(m, rel_diff(a[i], b[i]));
        return m;
    }
    if (ag_tensor_numel(ref) != ag_tensor_numel(got))
        return INFINITY;
    double m = 0;
    for (int64_t i = 0; i < ag_tensor_numel(ref); i++) {
        double d = fabs(ag_tensor_item_at(ref, i) - ag_tensor_item_at(got, i));
        if (isnan(d))
            return INFINITY;
        m = fmax(m, d);
    }
    return m / fmax(1.0, max_abs(ref));
}

int cli_check(int argc, char **argv) {
    const char *model = NULL, *config = NULL;
    long long steps = 3;
    ag_compile_opts co = {.partition = {.partitioner = AG_PARTITION_MINCUT, .memory_budget = 1.0}};
    for (int i = 1; i < argc; i++) {
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(argv[i], "--config") && v)
            config = v, i++;
        else if (!strcmp(argv[i], "--partitioner") && v && (!strcmp(v, "default") || !strcmp(v, "mincut"))) {
            co.partition.partitioner = !strcmp(v, "default") ? AG_PARTITION_DEFAULT : AG_PARTITION_MINCUT;
            i++;
        } else if (!strcmp(argv[i], "--budget") && v) {
            if (cli_float_opt("check", "--budget", v, &co.partition.memory_budget))
                return 2;
            i++;
        } else if (!strcmp(argv[i], "--steps") && v) {
            if (cli_int_opt("check", "--steps", v, 1, 1000, &steps))
                return 2;
            i++;
        } else if (!strcmp(argv[i], "--interpret")) {
            co.interpret = true;
        } else if (argv[i][0] != '-' && !model) {
            model = argv[i];
        } else {
            fprintf(stderr, "aotgrad check: bad option '%s'\nusage: aotgrad check MODEL [--config NAME] "
                            "[--partitioner default|mincut] [--budget F] [--steps N] [--interpret]\n",
                    argv[i]);
            return 2;
        }
    }
    if (!model) {
        fprintf(stderr, "aotgrad check: which model? (aotgrad models lists them)\n");
        return 2;
    }
    ag_module *me = NULL, *mc = NULL;
    ag_tensor *ie[8], *ic[8];
    int ne = 0, nc = 0;
    if (ag_zoo_build(model, config, &me, ie, 8, &ne) || ag_zoo_build(model, config, &mc, ic, 8, &nc)) {
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
    bool f64 = ne > 0 && ag_tensor_dtype(ie[0]) == AG_F64;
    double tol = f64 ? 1e-12 : 1e-5, worst_out = 0, worst_grad = 0, worst_buf = 0;
    for (long long s = 0; status == 0 && s < steps; s++) {
        ag_scope_begin();
        ag_tensor *oute[16], *outc[16];
        int n1 = ag_module_call(me, ie, ne, oute, 16);
        int n2 = n1 > 0 ? ag_compiled_call_module(c, mc, ic, nc, outc, 16) : -1;
        if (n1 < 0 || n2 != n1) {
            fprintf(stderr, "aotgrad check: step %lld: %s\n", s + 1, ag_last_error());
            status = 2;
            ag_scope_end();
            break;
        }
        /* loss = sum_k sum(out_k * w_k) with fixed weights, for both. */
        ag_tensor *le = NULL, *lc = NULL;
        for (int k = 0; k < n1; k++) {
            worst_out = fmax(worst_out, rel_diff(oute[k], outc[k]));
            if (!ag_tensor_requires_grad(oute[k]))
                continue;
            double w = 0.5 + 0.25 * k;
            ag_tensor *a = ag_sum_all(ag_mul_scalar(oute[k], w));
            ag_tensor *b = ag_sum_all(ag_mul_scalar(outc[k], w));
            le = le ? ag_add(le, a) : a;
            lc = lc ? ag_add(lc, b) : b;
        }
        int rc = 0;
        if (le)
            rc = ag_backward(le, NULL, false) || ag_backward(lc, NULL, false);
        if (rc) {
            fprintf(stderr, "aotgrad check: step %lld backward: %s\n", s + 1, ag_last_error());
            status = 2;
        }
        ag_named_tensors pe, pc, be, bc;
        ag_module_named_parameters(me, true, &pe);
        ag_module_named_parameters(mc, true, &pc);
        for (int i = 0; status == 0 && i < pe.n; i++)
            worst_grad = fmax(worst_grad, rel_diff(ag_tensor_grad(pe.tensors[i]), ag_tensor_grad(pc.tensors[i])));
        ag_module_named_buffers(me, true, &be);
        ag_module_named_buffers(mc, true, &bc);
        for (int i = 0; status == 0 && i < be.n; i++)
            worst_buf = fmax(worst_buf, rel_diff(be.tensors[i], bc.tensors[i]));
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
        bool ok = worst_out <= tol && worst_grad <= tol && worst_buf <= tol;
        printf("%s (%s, budget %g%s, %lld steps): max relative difference: outputs %.3g, "
               "gradients %.3g, buffers %.3g (tolerance %g): %s\n",
               model, co.partition.partitioner == AG_PARTITION_DEFAULT ? "default" : "mincut",
               co.partition.memory_budget, co.interpret ? ", interpreted" : "", steps, worst_out,
               worst_grad, worst_buf, tol, ok ? "OK" : "MISMATCH");
        status = ok ? 0 : 1;
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
