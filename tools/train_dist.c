/* `aotgrad train --parallel dp|fsdp|tp`: one rank's share of the training step.
 *
 * Every rank exports the same step joint for the global batch and builds the same full model
 * from the seed; here it makes the strategy's plan (parallel.h), shards the joint for its rank,
 * compiles the result, and takes its piece of each parameter and buffer by the placement of
 * its placeholder (ag_shard_local). Each step it takes its piece of the global batch the same
 * way (Shard(0) of the user inputs for dp and fsdp, the whole batch for tp) and calls the
 * compiled step on the flat inputs (the primals in graph order); the caller runs the backward
 * and steps an optimizer over the local parameter pieces (so FSDP's AdamW state is 1/N per
 * rank). dist_train_gather puts the full tensors back into the module (a collective: every rank
 * calls it), for a checkpoint or an evaluation. */
#include "train_dist.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- the training step module: loss = criterion(model(inputs...)) ---- */

typedef struct step_ud {
    ag_module *model;
    bool gpt2; /* the model takes (idx, targets) and returns (logits, loss) itself */
} step_ud;

static int step_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    step_ud *u = ag_module_ud(m);
    ag_tensor *o[2] = {0};
    ag_scope_begin();
    int rc;
    if (u->gpt2) {
        rc = ag_module_call(u->model, in, nin, o, 2);
        out[0] = rc == 2 ? ag_tensor_keep(o[1]) : NULL;
    } else {
        ag_tensor *logits = ag_module_forward(u->model, in[0]);
        out[0] = ag_tensor_keep(ag_cross_entropy(logits, in[1], AG_REDUCTION_MEAN, -100));
    }
    ag_scope_end();
    (void)max_out;
    return out[0] ? 1 : ag_last_status();
}

ag_module *cli_train_step_new(ag_module *model, bool gpt2) {
    step_ud *u = calloc(1, sizeof *u);
    if (!u) {
        ag_module_free(model);
        return NULL;
    }
    u->model = model;
    u->gpt2 = gpt2;
    ag_module *s = ag_module_new("TrainStep", step_forward, u, free); /* frees u on failure */
    if (!s) {
        ag_module_free(model);
        return NULL;
    }
    if (ag_module_add_child(s, "model", model)) { /* frees model on failure */
        ag_module_free(s);
        return NULL;
    }
    return s;
}

/* ---- one rank's share of the step ---- */

struct dist_train {
    ag_mesh mesh;
    ag_joint *sharded;
    ag_compiled *c;
    int nflat;
    ag_tensor **local;  /* [nflat]: this rank's pieces of params and buffers; NULL for inputs */
    ag_tensor **full;   /* [nflat]: the module's tensor for a param or buffer (borrowed) */
    ag_placement *pl;   /* [nflat]: the placeholder's placement */
    int *user;          /* [nflat]: the user input a PlainAOTInput reads, or -1 */
    ag_tensor **params; /* the local parameter pieces, for the optimizer */
    char **names;       /* [nparams]: their FQNs in the step module (owned) */
    int nparams;
};

static int shape_str(const int64_t *s, int nd, char *buf, size_t n) {
    size_t k = (size_t)snprintf(buf, n, "[");
    for (int i = 0; i < nd && k < n; i++)
        k += (size_t)snprintf(buf + k, n - k, "%s%lld", i ? ", " : "", (long long)s[i]);
    if (k < n)
        snprintf(buf + k, n - k, "]");
    return 0;
}

void dist_train_free(dist_train *d) {
    if (!d)
        return;
    for (int i = 0; i < d->nflat; i++)
        ag_tensor_free(d->local ? d->local[i] : NULL);
    free(d->local);
    free(d->full);
    free(d->pl);
    free(d->user);
    free(d->params);
    for (int i = 0; d->names && i < d->nparams; i++)
        free(d->names[i]);
    free(d->names);
    ag_compiled_free(d->c);
    ag_joint_free(d->sharded);
    free(d);
}

/* Reads the sharded joint's flat inputs: what each is and its placement; makes the pieces. */
static int bind_inputs(dist_train *d, ag_module *step) {
    const ag_joint *j = d->sharded;
    ag_node **ph;
    int nph = ag_graph_placeholders(ag_joint_graph(j), &ph);
    d->nflat = ag_joint_num_flat_inputs(j);
    d->local = calloc((size_t)d->nflat + 1, sizeof *d->local);
    d->full = calloc((size_t)d->nflat + 1, sizeof *d->full);
    d->pl = calloc((size_t)d->nflat + 1, sizeof *d->pl);
    d->user = calloc((size_t)d->nflat + 1, sizeof *d->user);
    d->params = calloc((size_t)d->nflat + 1, sizeof *d->params);
    d->names = calloc((size_t)d->nflat + 1, sizeof *d->names);
    if (!d->local || !d->full || !d->pl || !d->user || !d->params || !d->names)
        return ag_set_error(AG_ENOMEM, "train: out of memory");
    for (int i = 0; i < d->nflat; i++) {
        int p = ag_joint_flat_input_primal(j, i);
        const ag_desc *desc = p >= 0 && p < nph ? ag_node_desc(ph[p]) : NULL;
        ag_desc_kind k = desc ? ag_desc_kind_of(desc) : AG_DESC_NKINDS;
        if (p != i || (k != AG_DESC_PARAM && k != AG_DESC_BUFFER && k != AG_DESC_PLAIN_INPUT))
            return ag_set_error(AG_ENOTSUP,
                                "train --parallel: flat input %d is primal %d (%s); only "
                                "parameters, buffers and plain inputs, one primal each, are "
                                "supported",
                                i, p, desc ? ag_desc_kind_name(k) : "no descriptor");
        d->pl[i] = ag_node_placement(ph[p]);
        d->user[i] = -1;
        if (k == AG_DESC_PLAIN_INPUT) {
            d->user[i] = (int)ag_desc_idx(desc);
            continue;
        }
        const char *fqn = ag_desc_target(desc);
        d->full[i] = k == AG_DESC_PARAM ? ag_module_param(step, fqn) : ag_module_buffer(step, fqn);
        if (!d->full[i])
            return ag_set_error(AG_EINVAL, "train --parallel: the module has no %s '%s'",
                                k == AG_DESC_PARAM ? "parameter" : "buffer", fqn);
        /* A tied parameter (GPT-2's lm_head.weight is transformer.wte.weight) is one piece
         * passed twice, as the module passes one tensor twice: both gradients accumulate into
         * it and the optimizer updates it once. */
        int tied = -1;
        for (int t = 0; t < i && tied < 0; t++)
            if (d->full[t] == d->full[i])
                tied = t;
        if (tied >= 0 && !ag_placement_eq(d->pl[tied], d->pl[i])) {
            char pa[64], pb[64];
            return ag_set_error(
                AG_EINVAL, "train --parallel: %s is tied to %s but placed %s, not %s", fqn,
                ag_desc_target(ag_node_desc(ph[ag_joint_flat_input_primal(j, tied)])),
                ag_placement_str(d->pl[i], pa, sizeof pa),
                ag_placement_str(d->pl[tied], pb, sizeof pb));
        }
        d->local[i] = tied >= 0 ? ag_tensor_keep(d->local[tied])
                                : ag_shard_local(d->full[i], d->pl[i], &d->mesh);
        if (!d->local[i])
            return ag_last_status();
        if (tied >= 0)
            continue;
        const ag_tmeta *want = ag_node_val(ph[p], 0);
        const ag_tensor *got = d->local[i];
        if (!want || want->ndim != ag_tensor_ndim(got) ||
            memcmp(want->sizes, ag_tensor_sizes(got), sizeof(int64_t) * (size_t)want->ndim)) {
            char a[128] = "?", b[128], pb[64];
            if (want)
                shape_str(want->sizes, want->ndim, a, sizeof a);
            shape_str(ag_tensor_sizes(got), ag_tensor_ndim(got), b, sizeof b);
            return ag_set_error(AG_EINVAL,
                                "train --parallel: %s under %s is %s on rank %d; the sharded "
                                "joint's placeholder %s is %s",
                                fqn, ag_placement_str(d->pl[i], pb, sizeof pb), b, d->mesh.rank,
                                ag_node_name(ph[p]), a);
        }
        if (k == AG_DESC_PARAM) {
            if (ag_tensor_set_requires_grad(d->local[i], true))
                return ag_last_status();
            if (!(d->names[d->nparams] = strdup(fqn)))
                return ag_set_error(AG_ENOMEM, "train: out of memory");
            d->params[d->nparams++] = d->local[i];
        }
    }
    return 0;
}

dist_train *dist_train_new(const ag_joint *j, ag_module *step, const char *strategy,
                           const ag_compile_opts *co) {
    ag_mesh mesh;
    ag_shard_plan *plan = NULL;
    if (ag_mesh_world(&mesh) || !(plan = ag_shard_plan_strategy_new(strategy, j, &mesh)))
        return NULL;
    dist_train *d = dist_train_new_plan(j, step, plan, co);
    ag_shard_plan_free(plan);
    return d;
}

dist_train *dist_train_new_plan(const ag_joint *j, ag_module *step, const ag_shard_plan *plan,
                                const ag_compile_opts *co) {
    dist_train *d = calloc(1, sizeof *d);
    if (!d) {
        ag_set_error(AG_ENOMEM, "train: out of memory");
        return NULL;
    }
    int rc = ag_mesh_world(&d->mesh);
    if (!rc && !(d->sharded = ag_shard_joint(j, &d->mesh, plan)))
        rc = ag_last_status();
    if (!rc && !(d->c = ag_compile_joint(d->sharded, co)))
        rc = ag_last_status();
    if (!rc)
        rc = bind_inputs(d, step);
    if (rc) {
        dist_train_free(d);
        return NULL;
    }
    return d;
}

const ag_joint *dist_train_joint(const dist_train *d) {
    return d->sharded;
}
const ag_compiled *dist_train_compiled(const dist_train *d) {
    return d->c;
}
const ag_mesh *dist_train_mesh(const dist_train *d) {
    return &d->mesh;
}
int dist_train_params(const dist_train *d, ag_tensor *const **params) {
    *params = d->params;
    return d->nparams;
}
const char *const *dist_train_param_names(const dist_train *d) {
    return (const char *const *)d->names;
}

int dist_train_call(dist_train *d, ag_tensor *const *inputs, int nin, ag_tensor **loss) {
    ag_tensor **flat = calloc((size_t)d->nflat + 1, sizeof *flat);
    if (!flat)
        return ag_set_error(AG_ENOMEM, "train: out of memory");
    int rc = 0;
    for (int i = 0; i < d->nflat && !rc; i++) {
        if (d->user[i] < 0) {
            flat[i] = ag_tensor_keep(d->local[i]);
        } else if (d->user[i] >= nin) {
            rc = ag_set_error(AG_EINVAL, "train --parallel: the joint reads input %d of %d",
                              d->user[i], nin);
        } else if (!(flat[i] = ag_shard_local(inputs[d->user[i]], d->pl[i], &d->mesh))) {
            rc = ag_last_status();
        }
    }
    if (!rc)
        rc = ag_compiled_call(d->c, flat, d->nflat, loss, 1);
    for (int i = 0; i < d->nflat; i++)
        ag_tensor_free(flat[i]);
    free(flat);
    return rc;
}

int dist_train_gather(dist_train *d) {
    bool grad = ag_set_grad_enabled(false);
    int rc = 0;
    for (int i = 0; i < d->nflat && !rc; i++) {
        bool tied = false;
        for (int t = 0; t < i && !tied; t++)
            tied = d->full[t] == d->full[i];
        if (!d->local[i] || tied)
            continue;
        ag_tensor *whole = ag_shard_full(d->local[i], d->pl[i], &d->mesh);
        ag_tensor *done = whole ? ag_copy_(d->full[i], whole) : NULL;
        if (!done)
            rc = ag_last_status() ? ag_last_status() : AG_EINVAL;
        ag_tensor_free(done);
        ag_tensor_free(whole);
    }
    ag_set_grad_enabled(grad);
    return rc;
}

/* Sum of squares of g's elements, in double. */
static double sumsq(const ag_tensor *g) {
    int64_t n = ag_tensor_numel(g);
    double s = 0;
    if (ag_tensor_is_contiguous(g) && ag_tensor_dtype(g) == AG_F32) {
        const float *p = ag_tensor_data(g);
        for (int64_t i = 0; i < n; i++)
            s += (double)p[i] * (double)p[i];
    } else {
        for (int64_t i = 0; i < n; i++) {
            double v = ag_tensor_item_at(g, i);
            s += v * v;
        }
    }
    return s;
}

int dist_train_clip_grad_norm(dist_train *d, double max_norm, double *total_norm) {
    double s_shard = 0, s_rep = 0;
    for (int i = 0; i < d->nflat; i++) {
        bool tied = false;
        for (int t = 0; t < i && !tied; t++)
            tied = d->local[t] == d->local[i];
        ag_tensor *g = d->local[i] && !tied ? ag_tensor_grad(d->local[i]) : NULL;
        if (!g)
            continue;
        if (d->pl[i].kind == AG_PARTIAL)
            return ag_set_error(AG_ENOTSUP, "train --clip: a parameter placed Partial");
        if (d->pl[i].kind == AG_REPLICATE)
            s_rep += sumsq(g);
        else
            s_shard += sumsq(g);
    }
    /* The sharded pieces' sums from every rank: a Shard(0) gather of one value each. `mine`
     * belongs to the scope opened here; ag_shard_full's result is ours to free (parallel.h). */
    ag_scope_begin();
    ag_tensor *mine = ag_from_data(AG_F64, 1, (int64_t[]){1}, &s_shard);
    ag_tensor *all = mine ? ag_shard_full(mine, AG_P_SHARD(0), &d->mesh) : NULL;
    double total = s_rep;
    for (int64_t r = 0; all && r < ag_tensor_numel(all); r++)
        total += ag_tensor_item_at(all, r);
    bool ok = all != NULL;
    ag_tensor_free(all);
    ag_scope_end();
    if (!ok)
        return ag_last_status() ? ag_last_status() : AG_ENOMEM;
    total = sqrt(total);
    *total_norm = total;
    double coef = max_norm / (total + 1e-6); /* clip_grad_norm_'s rule (nn.h) */
    if (coef >= 1)
        return 0;
    /* In place on the gradients' data (ag_tensor_data waits for a collective that produced
     * one), in their precision, as ag_clip_grad_norm scales. */
    int rc = 0;
    ag_scope_begin();
    for (int i = 0; i < d->nparams && !rc; i++) {
        ag_tensor *g = ag_tensor_grad(d->params[i]);
        if (!g)
            continue;
        int64_t n = ag_tensor_numel(g);
        void *data = ag_tensor_data(g);
        if (data && ag_tensor_is_contiguous(g) && ag_tensor_dtype(g) == AG_F32) {
            float *x = data, c = (float)coef;
            for (int64_t k = 0; k < n; k++)
                x[k] *= c;
            ag_tensor_bump_version(g);
        } else if (data && ag_tensor_is_contiguous(g) && ag_tensor_dtype(g) == AG_F64) {
            double *x = data;
            for (int64_t k = 0; k < n; k++)
                x[k] *= coef;
            ag_tensor_bump_version(g);
        } else if (!ag_mul_scalar_(g, coef)) {
            rc = ag_last_status() ? ag_last_status() : AG_EINVAL;
        }
    }
    ag_scope_end();
    return rc;
}
