/* The input-mutation wrapper of the compiled callable (upstream's RuntimeWrapper epilogue for
 * MUTATED_OUT_GRAPH inputs): each InputMutationAOTOutput's new value is written back into the
 * primal its descriptor names, the caller's tensor, as eager mutated it (BatchNorm's running
 * statistics, a base's new value): metadata first (as_strided_), then data, bumping the
 * storage's version. It is a commit: the call's effect once nothing else can fail. Mutations
 * kept in the graph (keep_inference_input_mutations) have no output and are not written. */
#include "compiled_internal.h"

static int mutations_commit(ag_compiled *c, ag__call *s) {
    int rc = 0;
    for (int k = 0; rc == 0 && k < c->nmutated; k++) {
        int i = c->mut_primal[k];
        const ag_input_info *ii = &c->in_info[i];
        ag_tensor *x = s->prim[i];
        if (ii->mutates_metadata)
            ag__rt_set_geometry(x, &c->alias.prim[i].new_geom, x->offset);
        if (ii->mutates_data) {
            rc = ag__copy_into(x, s->fo[ag__fw_at(c, AG_SEC_OUT_MUTATIONS, k)]);
            x->storage->version++;
        }
    }
    return rc;
}

const ag__rt_wrapper ag__rtw_mutations = {.name = "input_mutations", .commit = mutations_commit};
