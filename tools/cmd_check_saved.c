/* `aotgrad check FILE.joint`: a saved joint (ag_joint_load_file) has no eager module to compare
 * with, so check compares what it can without one:
 *
 *   1. the compiled callable (partitioned, memory-planned executor) against the same joint
 *      compiled with the graph interpreter (--interpret's path), on the same inputs, for N
 *      steps: outputs, the inputs' gradients and the inputs after the call (mutated buffers), to
 *      1e-5 (float32) or 1e-12 (float64) relative to the reference's largest magnitude; both
 *      calls start from the same generator state, so a joint that draws random numbers draws
 *      the same ones;
 *   2. the compiled callable's gradients against central finite differences of its loss along
 *      one random direction of the inputs that require grad, in the joint's own precision
 *      (float32 graphs cannot be evaluated in float64 without their module), with steps 1e-3,
 *      1e-4 and 1e-5 (the best one counts: the larger cross more kinks of relu and max pooling
 *      and feel more curvature (GPT-2 with N(0, 1) weights and dropout's 1/(1-p) needs 1e-5),
 *      the smaller loses more to rounding) and tolerance 1e-2 relative to max(1, |derivative|).
 *
 * The inputs are made from the graph's placeholders: float tensors from N(0, 1) (seed 0),
 * integer ones zero (valid indices for any embedding), requiring grad as the saved input facts
 * say. The loss is the weighted sum of the outputs, as `aotgrad check MODEL`. Joints whose flat
 * inputs share memory (a deduplicated or merged input) need the caller's aliasing, which the
 * file does not give: they are refused with a message, as are joints with tensor subclass
 * inputs or outputs (this check makes plain inputs only). */
#include "cli.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAXIO 64

typedef struct side {
    ag_compiled *c;
    ag_tensor *in[MAXIO];
} side;

static void side_free(side *s, int n) {
    for (int i = 0; i < n; i++)
        ag_tensor_free(s->in[i]);
    ag_compiled_free(s->c);
}

/* The loss of one call: sum_k (0.5 + 0.25 k) sum(out_k) over the outputs that require grad
 * (float outputs when grad is off). Stores the outputs in outs; NULL with a message on
 * failure. */
static ag_tensor *call_loss(side *s, int nin, ag_tensor **outs, int *nout) {
    int n = ag_compiled_call(s->c, s->in, nin, outs, 16);
    if (n < 0)
        return NULL;
    *nout = n;
    ag_tensor *loss = NULL;
    for (int k = 0; k < n; k++) {
        if (!outs[k] || !ag_dtype_is_float(ag_tensor_dtype(outs[k])))
            continue;
        ag_tensor *a = ag_sum_all(ag_mul_scalar(outs[k], 0.5 + 0.25 * k));
        loss = loss ? ag_add(loss, a) : a;
    }
    if (!loss)
        loss = ag_zeros(AG_F32, 0, NULL);
    return loss;
}

/* Inputs from the joint's placeholders. 0, or 1 after a message. */
static int make_inputs(const char *path, const ag_joint *j, side *a, side *b, int nin) {
    ag_node **ph;
    ag_graph_placeholders(ag_joint_graph(j), &ph);
    int ntok = ag_joint_num_forward_tokens(j);
    ag_manual_seed(0);
    for (int i = 0; i < nin; i++) {
        int p = ag_joint_flat_input_primal(j, i);
        const ag_desc *d = ag_node_desc(ph[p]);
        ag_desc_kind k = d ? ag_desc_kind_of(d) : AG_DESC_PLAIN_INPUT;
        bool own = p == ntok + i &&
                   (k == AG_DESC_PARAM || k == AG_DESC_BUFFER || k == AG_DESC_PLAIN_INPUT);
        if (!own) {
            fprintf(stderr,
                    "aotgrad check: %s: flat input %d shares memory with another input "
                    "(it is graph input %d, %s); a saved joint does not say how, check "
                    "the model by name instead\n",
                    path, i, p, ag_node_name(ph[p]));
            return 1;
        }
        const ag_tmeta *m = ag_node_val(ph[p], 0);
        ag_scope_begin();
        ag_tensor *t = ag_dtype_is_float(m->dtype) ? ag_randn(m->dtype, m->ndim, m->sizes)
                                                   : ag_zeros(m->dtype, m->ndim, m->sizes);
        a->in[i] = ag_tensor_keep(t);
        b->in[i] = ag_tensor_keep(t ? ag_clone(t) : NULL);
        ag_scope_end();
        if (!a->in[i] || !b->in[i]) {
            fprintf(stderr, "aotgrad check: %s: %s\n", path, ag_last_error());
            return 1;
        }
        bool rg = ag_joint_input_info(j, p)->requires_grad && ag_dtype_is_float(m->dtype);
        ag_tensor_set_requires_grad(a->in[i], rg);
        ag_tensor_set_requires_grad(b->in[i], rg);
    }
    return 0;
}

/* Step 2: the directional derivative of the loss along v against central differences. */
static int finite_differences(const char *path, side *s, int nin, double *err, double *fd_out,
                              double *an_out) {
    ag_tensor *v[MAXIO] = {0}, *saved[MAXIO] = {0}, *outs[16];
    int n, rc = 0;
    uint64_t seed, off;
    ag_rng_get_state(&seed, &off);
    ag_scope_begin();
    /* The analytic derivative: grad . v at the inputs. */
    ag_tensor *loss = call_loss(s, nin, outs, &n);
    if (!loss || ag_backward(loss, NULL, false))
        rc = 1;
    double an = 0, h = 1e-3;
    ag_manual_seed(1);
    for (int i = 0; rc == 0 && i < nin; i++) {
        if (!ag_tensor_requires_grad(s->in[i]))
            continue;
        ag_tensor *t = s->in[i];
        v[i] = ag_randn(ag_tensor_dtype(t), ag_tensor_ndim(t), ag_tensor_sizes(t));
        saved[i] = ag_clone(ag_detach(t));
        ag_tensor *g = ag_tensor_grad(t);
        if (g)
            an += ag_tensor_item(ag_sum_all(ag_mul(g, v[i])));
        ag_tensor_set_grad(t, NULL);
    }
    /* The loss at inputs + h v and - h v, each from the generator state of the first call
     * and with the inputs restored first (the call may mutate buffers), for NSTEPS steps h. */
    enum { NSTEPS = 3 };
    double lp[NSTEPS][2] = {{0, 0}, {0, 0}, {0, 0}};
    bool prev = ag_set_grad_enabled(false);
    for (int k = 0; rc == 0 && k < 2 * NSTEPS; k++) {
        double step = h / pow(10, k / 2);
        for (int i = 0; i < nin; i++)
            if (v[i])
                ag_copy_(s->in[i], ag_add(saved[i], ag_mul_scalar(v[i], k % 2 ? -step : step)));
        ag_rng_set_state(seed, off);
        ag_tensor *l = call_loss(s, nin, outs, &n);
        if (!l)
            rc = 1;
        else
            lp[k / 2][k % 2] = ag_tensor_item(l);
    }
    for (int i = 0; i < nin; i++)
        if (v[i])
            ag_copy_(s->in[i], saved[i]);
    ag_set_grad_enabled(prev);
    ag_scope_end();
    if (rc) {
        fprintf(stderr, "aotgrad check: %s: finite differences: %s\n", path, ag_last_error());
        return 2;
    }
    /* The best of the steps: the larger cross more kinks, the smaller lose more to
     * rounding. */
    *err = INFINITY;
    for (int k = 0; k < NSTEPS; k++) {
        double step = h / pow(10, k), fd = (lp[k][0] - lp[k][1]) / (2 * step);
        double e = fabs(fd - an) / fmax(1, fabs(an));
        if (e < *err) {
            *err = e;
            *fd_out = fd;
        }
    }
    *an_out = an;
    return 0;
}

/* 1 with a message when the joint takes or returns tensor subclasses: the inputs this check
 * makes are plain tensors, and it does not build instances. */
static int refuse_subclasses(const char *path, const ag_joint *j) {
    ag_node **ph;
    int nph = ag_graph_placeholders(ag_joint_graph(j), &ph);
    ag_node *out = ag_graph_output_node(ag_joint_graph(j));
    int nout = ag_joint_num_user_outputs(j) + ag_joint_num_mutated_inputs(j);
    const char *what = NULL;
    for (int i = 0; i < nph && !what; i++)
        if (ag_node_desc(ph[i]) &&
            ag_desc_kind_of(ag_node_desc(ph[i])) == AG_DESC_SUBCLASS_GETATTR_INPUT)
            what = "takes";
    for (int k = 0; out && k < nout && !what; k++)
        if (ag_node_output_desc(out, k) &&
            ag_desc_kind_of(ag_node_output_desc(out, k)) == AG_DESC_SUBCLASS_GETATTR_OUTPUT)
            what = "returns";
    if (!what)
        return 0;
    fprintf(stderr,
            "aotgrad check: %s: the joint %s tensor subclass instances; checking a saved joint "
            "makes plain random inputs only, check the model by name instead\n",
            path, what);
    return 1;
}

int cli_check_saved(const char *path, const ag_compile_opts *co, long long steps) {
    ag_joint *j = cli_load_joint("check", path);
    if (!j)
        return 1;
    if (refuse_subclasses(path, j)) {
        ag_joint_free(j);
        return 1;
    }
    int nin = ag_joint_num_flat_inputs(j), status = 0;
    side a = {0}, b = {0};
    if (nin > MAXIO) {
        fprintf(stderr, "aotgrad check: %s: %d inputs, more than the %d this check feeds\n", path,
                nin, MAXIO);
        ag_joint_free(j);
        return 1;
    }
    ag_compile_opts ci = *co;
    ci.interpret = true;
    a.c = ag_compile_joint(j, co);
    b.c = a.c ? ag_compile_joint(j, &ci) : NULL;
    if (!a.c || !b.c) {
        fprintf(stderr, "aotgrad check: %s: %s\n", path, ag_last_error());
        status = 1;
    }
    if (status == 0)
        status = make_inputs(path, j, &a, &b, nin);
    bool f64 = false;
    for (int i = 0; i < nin && status == 0; i++)
        f64 |= ag_tensor_dtype(a.in[i]) == AG_F64;
    double tol = f64 ? 1e-12 : 1e-5, worst_out = 0, worst_grad = 0, worst_in = 0;
    for (long long s = 0; status == 0 && s < steps; s++) {
        ag_scope_begin();
        ag_tensor *oa[16], *ob[16];
        int na = 0, nb = 0;
        uint64_t seed, off;
        ag_rng_get_state(&seed, &off);
        ag_tensor *la = call_loss(&a, nin, oa, &na);
        ag_rng_set_state(seed, off);
        ag_tensor *lb = la ? call_loss(&b, nin, ob, &nb) : NULL;
        if (!la || !lb || na != nb ||
            (ag_tensor_requires_grad(la) && ag_backward(la, NULL, false)) ||
            (ag_tensor_requires_grad(lb) && ag_backward(lb, NULL, false))) {
            fprintf(stderr, "aotgrad check: %s: step %lld: %s\n", path, s + 1, ag_last_error());
            status = 2;
        }
        for (int k = 0; status == 0 && k < na; k++)
            if (oa[k] || ob[k])
                worst_out = fmax(worst_out, oa[k] && ob[k] ? cli_rel_diff(ob[k], oa[k]) : INFINITY);
        for (int i = 0; status == 0 && i < nin; i++) {
            worst_in = fmax(worst_in, cli_rel_diff(b.in[i], a.in[i]));
            const ag_tensor *ga = ag_tensor_grad(a.in[i]), *gb = ag_tensor_grad(b.in[i]);
            if (ga || gb)
                worst_grad = fmax(worst_grad, ga && gb ? cli_rel_diff(gb, ga) : INFINITY);
            ag_tensor_set_grad(a.in[i], NULL);
            ag_tensor_set_grad(b.in[i], NULL);
        }
        ag_scope_end();
    }
    double fd_err = 0, fd = 0, an = 0, fd_tol = 1e-2;
    bool any_rg = false;
    for (int i = 0; i < nin && status == 0; i++)
        any_rg |= ag_tensor_requires_grad(a.in[i]);
    if (status == 0 && any_rg && ag_joint_needs_autograd(j))
        status = finite_differences(path, &a, nin, &fd_err, &fd, &an);
    if (status == 0) {
        bool ok = worst_out <= tol && worst_grad <= tol && worst_in <= tol && fd_err <= fd_tol;
        printf("%s (%s, budget %g, %lld steps): compiled vs interpreted: max relative "
               "difference: outputs %.3g, gradients %.3g, inputs %.3g (tolerance %g)\n",
               path, co->partition.partitioner == AG_PARTITION_DEFAULT ? "default" : "mincut",
               fabs(co->partition.memory_budget), steps, worst_out, worst_grad, worst_in, tol);
        if (any_rg && ag_joint_needs_autograd(j))
            printf("%s: gradient vs central finite differences along a random direction: %.6g "
                   "vs %.6g, relative error %.3g (tolerance %g)\n",
                   path, an, fd, fd_err, fd_tol);
        else
            printf("%s: no input requires grad: no finite differences\n", path);
        printf("%s: %s\n", path, ok ? "OK" : "MISMATCH");
        status = ok ? 0 : 1;
    }
    side_free(&a, nin);
    side_free(&b, nin);
    ag_joint_free(j);
    return status;
}
