/* A sharding strategy of one's own, written with the public API only (docs/DISTRIBUTED.md,
 * "Adding a strategy"): FSDP for the large parameters, data parallelism for the rest. Every
 * parameter of at least `min_bytes` whose dim 0 divides by the world size is Shard(0) and
 * gathered just before its use (and gathered again in the backward instead of being saved);
 * smaller ones stay Replicate() and their gradients are all_reduced in buckets; the batch is
 * split across the ranks.
 *
 * The program shards the zoo's mlp for rank 0 of a mesh of 2 ranks (no MPI needed: the mesh
 * only says what a rank would run), prints each parameter's placement and the summary, and
 * exits 1 if a placement is not what the strategy asked for. CTest runs it (example_custom_plan).
 */
#include <aotgrad.h>

#include <stdio.h>
#include <string.h>

static ag_shard_plan *plan_fsdp_large(const ag_joint *j, const ag_mesh *mesh, int64_t min_bytes) {
    ag_shard_plan *p = ag_shard_plan_new();
    if (!p)
        return NULL;
    ag_shard_plan_set_gather_params(p, true);
    for (ag_node *n = ag_graph_first(ag_joint_graph(j)); n; n = ag_node_next(n)) {
        const ag_desc *d = ag_node_desc(n);
        const ag_tmeta *m = ag_node_num_vals(n) > 0 ? ag_node_val(n, 0) : NULL;
        if (ag_node_kind_of(n) != AG_NODE_PLACEHOLDER || !d || !m || m->ndim == 0)
            continue;
        int64_t bytes = ag_dtype_size(m->dtype);
        for (int k = 0; k < m->ndim; k++)
            bytes *= m->sizes[k];
        int rc = 0;
        if (ag_desc_kind_of(d) == AG_DESC_PLAIN_INPUT) /* the batch */
            rc = ag_shard_plan_set(p, d, AG_P_SHARD(0));
        else if (ag_desc_is_param(d) && bytes >= min_bytes &&
                 ag_shard_divisible(m->sizes[0], mesh->size, 0))
            rc = ag_shard_plan_set(p, d, AG_P_SHARD(0));
        if (rc) {
            ag_shard_plan_free(p);
            return NULL;
        }
    }
    return p;
}

int main(void) {
    ag_module *m = NULL;
    ag_tensor *in[4] = {0};
    int nin = 0;
    bool prev = ag_set_meta_mode(true); /* shapes only: no weights are allocated */
    ag_joint *j = ag_zoo_build("mlp", NULL, &m, in, 4, &nin)
                      ? NULL
                      : ag_export_joint(m, in, nin, NULL, NULL, 0, NULL);
    ag_set_meta_mode(prev);
    ag_mesh mesh = {.size = 2, .rank = 0, .group = "0"};
    ag_shard_plan *plan = j ? plan_fsdp_large(j, &mesh, 64 << 10) : NULL;
    ag_joint *local = plan ? ag_shard_joint(j, &mesh, plan) : NULL;
    ag_shard_summary sum;
    if (!local || ag_shard_summary_get(local, &sum)) {
        fprintf(stderr, "custom_plan: %s\n", ag_last_error());
        return 1;
    }
    /* fc1.weight [256, 784] (784 KiB) and fc2.weight [128, 256] (128 KiB) are sharded; the
     * biases and the last layer's [10, 128] weight (5 KiB) stay whole. */
    int bad = 0;
    for (ag_node *n = ag_graph_first(ag_joint_graph(local)); n; n = ag_node_next(n)) {
        const ag_desc *d = ag_node_desc(n);
        if (ag_node_kind_of(n) != AG_NODE_PLACEHOLDER || !ag_desc_is_param(d))
            continue;
        const char *fqn = ag_desc_target(d);
        bool want_shard = !strcmp(fqn, "fc1.weight") || !strcmp(fqn, "fc2.weight");
        char pl[48];
        ag_placement_str(ag_node_placement(n), pl, sizeof pl);
        printf("%-10s %s\n", fqn, pl);
        bad += want_shard != (ag_node_placement(n).kind == AG_SHARD);
    }
    printf("per rank: params %lld bytes, optimizer state %lld bytes; communication: %lld bytes in "
           "%d collectives per step\n",
           (long long)sum.param_bytes, (long long)sum.optim_bytes, (long long)sum.comm_bytes,
           sum.ncollectives);
    ag_joint_free(local);
    ag_shard_plan_free(plan);
    ag_joint_free(j);
    for (int i = 0; i < nin; i++)
        ag_tensor_free(in[i]);
    ag_module_free(m);
    return bad ? 1 : 0;
}
