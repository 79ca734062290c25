/* Local pieces of full tensors and full tensors from local pieces (DTensor's distribute_tensor
 * and full_tensor), for the programs that run a sharded joint: every rank builds the same full
 * model, takes its piece of each parameter by the placement of the parameter's placeholder in
 * its sharded joint (ag_node_placement), trains the pieces, and gathers them back for a
 * checkpoint or an evaluation.
 *
 * Taking a piece reads no other rank. Gathering is a collective on the mesh's group: every
 * rank of the group calls it for the same tensors in the same order (the eager
 * _c10d_functional ops: all_gather_into_tensor for Shard, all_reduce for Partial, each through
 * wait_tensor). StridedShard(d, k) is put back in block order: the gather along d yields
 * (rank, block, chunk); the full tensor is (block, rank, chunk). */
#include "../core/internal.h"
#include "aotgrad/dist.h"
#include "aotgrad/ops.h"
#include "aotgrad/parallel.h"

#include <string.h>

static int check_mesh(const char *who, const ag_mesh *mesh) {
    if (!mesh)
        return ag__err(AG_EINVAL, "%s: mesh is NULL", who);
    if (mesh->size < 1 || mesh->rank < 0 || mesh->rank >= mesh->size)
        return ag__err(AG_EINVAL, "%s: rank %d of a mesh of %d ranks", who, mesh->rank, mesh->size);
    return 0;
}

/* The shard's geometry: dim d of size n in k blocks of `world` chunks of c elements. */
static int check_shard(const char *who, const ag_tensor *t, ag_placement pl, int world, int64_t n) {
    char buf[64];
    int k = pl.split_factor > 1 ? pl.split_factor : 1;
    if (pl.dim < 0 || pl.dim >= ag_tensor_ndim(t))
        return ag__err(AG_EINVAL, "%s: %s of a tensor with %d dims", who,
                       ag_placement_str(pl, buf, sizeof buf), ag_tensor_ndim(t));
    if (!ag_shard_divisible(n, world, k))
        return ag__err(AG_EINVAL,
                       "%s: %s: dim %d of size %lld does not split into %d x %d equal chunks", who,
                       ag_placement_str(pl, buf, sizeof buf), pl.dim, (long long)n, k, world);
    return 0;
}

ag_tensor *ag_shard_local(ag_tensor *full, ag_placement pl, const ag_mesh *mesh) {
    AG__CHECK_NULL_RET("shard_local", full, NULL);
    if (check_mesh("shard_local", mesh))
        return NULL;
    int N = mesh->size, r = mesh->rank;
    bool grad = ag_set_grad_enabled(false);
    ag_tensor *out = NULL;
    ag_scope_begin();
    if (pl.kind == AG_REPLICATE || (pl.kind == AG_PARTIAL && (pl.op == AG_PARTIAL_AVG || r == 0))) {
        out = ag_tensor_keep(ag_clone(full));
    } else if (pl.kind == AG_PARTIAL) {
        out = ag_tensor_keep(ag_zeros_like(full));
    } else if (!check_shard("shard_local", full, pl, N, ag_tensor_size(full, pl.dim))) {
        int k = pl.split_factor > 1 ? pl.split_factor : 1;
        int64_t bs = ag_tensor_size(full, pl.dim) / k, c = bs / N;
        ag_tensor *pieces[64];
        if (k > 64) {
            ag__err(AG_ENOTSUP, "shard_local: StridedShard with %d blocks (at most 64)", k);
        } else {
            bool ok = true;
            for (int b = 0; b < k; b++)
                ok &= (pieces[b] =
                           ag_slice(full, pl.dim, b * bs + r * c, b * bs + (r + 1) * c, 1)) != NULL;
            out = !ok ? NULL
                      : ag_tensor_keep(k == 1 ? ag_clone(pieces[0]) : ag_cat(pieces, k, pl.dim));
        }
    }
    ag_scope_end();
    ag_set_grad_enabled(grad);
    return out;
}

/* One eager collective through its wait_tensor (called inside a scope, which owns both). */
static ag_tensor *collective(const char *name, const ag_arg *args, int nargs) {
    const ag_op *op = ag_op_find(name), *wait = ag_op_find("_c10d_functional::wait_tensor");
    if (!op || !wait) {
        ag__err(AG_ENOTSUP, "shard_full: the op table has no %s", !op ? name : "wait_tensor");
        return NULL;
    }
    ag_tensor *started = ag_op_call1(op, args, nargs);
    return started ? ag_op_call1(wait, (ag_arg[]){AG_A_T(started)}, 1) : NULL;
}

ag_tensor *ag_shard_full(ag_tensor *local, ag_placement pl, const ag_mesh *mesh) {
    AG__CHECK_NULL_RET("shard_full", local, NULL);
    if (check_mesh("shard_full", mesh))
        return NULL;
    int N = mesh->size;
    const char *group = mesh->group ? mesh->group : "0";
    if (pl.kind == AG_REPLICATE || N == 1) {
        /* A reference of the caller's, as the gathers below: a clone made in the caller's open
         * scope would belong to that scope, and the caller's free would be a second one. */
        bool grad = ag_set_grad_enabled(false);
        ag_scope_begin();
        ag_tensor *out = ag_tensor_keep(ag_clone(local));
        ag_scope_end();
        ag_set_grad_enabled(grad);
        return out;
    }
    const ag_group *g = ag_group_find(group);
    if (!g || ag_group_size(g) != N) {
        ag__err(AG_EINVAL, "shard_full: the mesh has %d ranks of group \"%s\"; %s", N, group,
                g ? "the group has a different size" : "there is no such group (ag_dist_init?)");
        return NULL;
    }
    if (pl.kind == AG_SHARD &&
        check_shard("shard_full", local, pl, 1, ag_tensor_size(local, pl.dim)))
        return NULL;
    bool grad = ag_set_grad_enabled(false);
    ag_tensor *out = NULL;
    ag_scope_begin();
    if (pl.kind == AG_PARTIAL) {
        out = ag_tensor_keep(
            collective("_c10d_functional::all_reduce",
                       (ag_arg[]){AG_A_T(local), AG_A_S(pl.op == AG_PARTIAL_AVG ? "avg" : "sum"),
                                  AG_A_S(group)},
                       3));
    } else {
        /* Gather along dim 0 of the tensor with d moved to the front. */
        int d = pl.dim, nd = ag_tensor_ndim(local);
        int k = pl.split_factor > 1 ? pl.split_factor : 1;
        ag_tensor *x = d ? ag_contiguous(ag_transpose(local, 0, d)) : ag_contiguous(local);
        ag_tensor *gathered = x ? collective("_c10d_functional::all_gather_into_tensor",
                                             (ag_arg[]){AG_A_T(x), AG_A_I(N), AG_A_S(group)}, 3)
                                : NULL;
        if (gathered && k > 1) {
            /* (rank, block, chunk, rest...) -> (block, rank, chunk, rest...) */
            const int64_t *xs = ag_tensor_sizes(x);
            int64_t sz[AG_MAX_DIMS + 2];
            sz[0] = N;
            sz[1] = k;
            sz[2] = xs[0] / k;
            for (int i = 1; i < nd; i++)
                sz[i + 2] = xs[i];
            ag_tensor *v = ag_transpose(ag_reshape(gathered, nd + 2, sz), 0, 1);
            int64_t fs[AG_MAX_DIMS];
            fs[0] = xs[0] * N;
            for (int i = 1; i < nd; i++)
                fs[i] = xs[i];
            gathered = v ? ag_reshape(ag_contiguous(v), nd, fs) : NULL;
        }
        if (gathered)
            out = ag_tensor_keep(d ? ag_contiguous(ag_transpose(gathered, 0, d)) : gathered);
    }
    ag_scope_end();
    ag_set_grad_enabled(grad);
    return out;
}
