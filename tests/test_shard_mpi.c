/* One compiled step of the sharded mlp under mpirun (CTest runs it on 2 ranks; run alone it is
 * a world of one) against the single-process step, for dp, fsdp and tp: each rank feeds its
 * local pieces of the parameters and the input, and its logits (Replicate(), so whole) and its
 * parameter gradients (local pieces) must equal the single-process logits and the matching
 * pieces of the single-process gradients, within float32 tolerance. */
#include "aotgrad.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

static int failures;
static int rank, world;

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "rank %d: %s:%d: ", rank, __FILE__, __LINE__);                         \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fprintf(stderr, "\n");                                                                 \
            failures++;                                                                            \
        }                                                                                          \
    } while (0)

/* This rank's piece of the whole tensor t under pl (a new reference). */
static ag_tensor *piece(ag_tensor *t, ag_placement pl) {
    if (pl.kind != AG_SHARD)
        return ag_tensor_keep(ag_contiguous(t));
    int64_t c = ag_tensor_sizes(t)[pl.dim] / world;
    return ag_tensor_keep(ag_contiguous(ag_slice(t, pl.dim, rank * c, (rank + 1) * c, 1)));
}

static double max_diff(ag_tensor *a, ag_tensor *b) {
    if (ag_tensor_numel(a) != ag_tensor_numel(b))
        return INFINITY;
    double m = 0;
    for (int64_t i = 0; i < ag_tensor_numel(a); i++) {
        double d = fabs(ag_tensor_item_at(a, i) - ag_tensor_item_at(b, i));
        m = d > m ? d : m;
    }
    return m;
}

static void one_strategy(const char *name, ag_module *m, ag_tensor *x, const ag_joint *j,
                         ag_tensor *y_ref, ag_tensor **g_ref, int np) {
    ag_mesh mesh;
    CHECK(ag_mesh_world(&mesh) == 0, "mesh_world: %s", ag_last_error());
    ag_shard_plan *p = ag_shard_plan_strategy_new(name, j, &mesh);
    CHECK(p, "%s: %s", name, ag_last_error());
    ag_joint *s = p ? ag_shard_joint(j, &mesh, p) : NULL;
    CHECK(s, "%s: shard_joint: %s", name, ag_last_error());
    ag_compiled *c = s ? ag_compile_joint(s, NULL) : NULL;
    CHECK(c, "%s: compile: %s", name, ag_last_error());
    if (!c) {
        ag_joint_free(s);
        ag_shard_plan_free(p);
        return;
    }
    ag_scope_begin();
    ag_tensor *in[16], *leaves[16];
    for (int i = 0; i < np; i++) {
        ag_desc *d = ag_desc_param(ag_joint_param_fqn(j, i));
        ag_placement pl;
        ag_shard_plan_get(p, d, &pl);
        ag_desc_release(d);
        leaves[i] = piece(ag_module_param(m, ag_joint_param_fqn(j, i)), pl);
        ag_tensor_set_requires_grad(leaves[i], true);
        in[i] = leaves[i];
    }
    ag_desc *dx = ag_desc_plain_input(0);
    ag_placement plx;
    ag_shard_plan_get(p, dx, &plx);
    ag_desc_release(dx);
    in[np] = piece(x, plx);
    ag_tensor *y = NULL, *grads[16];
    int rc = ag_compiled_call(c, in, np + 1, &y, 1);
    CHECK(rc == 1, "%s: call: %s", name, ag_last_error());
    if (rc == 1) {
        double d = max_diff(y, y_ref);
        CHECK(d < 1e-4, "%s: logits differ by %g", name, d);
        rc = ag_grad(&y, (ag_tensor *[]){ag_detach(y_ref)}, 1, leaves, np, grads, false, false);
        CHECK(rc == 0, "%s: grad: %s", name, ag_last_error());
        for (int i = 0; rc == 0 && i < np; i++) {
            ag_desc *d2 = ag_desc_param(ag_joint_param_fqn(j, i));
            ag_placement pl;
            ag_shard_plan_get(p, d2, &pl);
            ag_desc_release(d2);
            ag_tensor *want = piece(g_ref[i], pl);
            double gd = max_diff(grads[i], want);
            CHECK(gd < 1e-3, "%s: gradient of %s differs by %g", name, ag_joint_param_fqn(j, i),
                  gd);
            ag_tensor_free(want);
        }
    }
    ag_scope_end();
    for (int i = 0; i < np; i++)
        ag_tensor_free(leaves[i]);
    ag_tensor_free(in[np]);
    ag_compiled_free(c);
    ag_joint_free(s);
    ag_shard_plan_free(p);
}

int main(void) {
    if (ag_dist_init()) {
        fprintf(stderr, "ag_dist_init: %s\n", ag_last_error());
        return 1;
    }
    rank = ag_group_rank(ag_dist_world());
    world = ag_group_size(ag_dist_world());
    ag_module *m;
    ag_tensor *x[2];
    int nin;
    if (ag_zoo_build("mlp", NULL, &m, x, 2, &nin)) {
        fprintf(stderr, "zoo: %s\n", ag_last_error());
        return 1;
    }
    ag_joint *j = ag_export_joint(m, x, nin, NULL, NULL, 0, NULL);
    int np = ag_joint_num_params(j);
    /* The single-process step: logits y and the gradients for the tangent y itself (every row
     * different, so a rank that computes on another rank's rows gets other gradients). */
    ag_scope_begin();
    ag_tensor *y0;
    ag_module_call(m, x, 1, &y0, 1);
    ag_tensor *params[16], *g0[16];
    for (int i = 0; i < np; i++)
        params[i] = ag_module_param(m, ag_joint_param_fqn(j, i));
    int rc = ag_grad(&y0, (ag_tensor *[]){ag_detach(y0)}, 1, params, np, g0, false, false);
    CHECK(rc == 0, "reference grad: %s", ag_last_error());
    const char *strategies[] = {"dp", "fsdp", "tp"};
    for (int s = 0; s < 3 && rc == 0; s++)
        one_strategy(strategies[s], m, x[0], j, y0, g0, np);
    ag_scope_end(); /* y0 and g0 were the scope's */
    ag_joint_free(j);
    ag_module_free(m);
    ag_tensor_free(x[0]);
    int all = failures;
    ag_dist_finalize();
    if (rank == 0)
        printf("test_shard_mpi: %d ranks: %s\n", world, all ? "FAILED" : "ok");
    return all ? 1 : 0;
}
