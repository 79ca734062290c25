/* The input mutations wrapper of the joint export (export_wrappers.h; upstream's
 * fn_prepped_for_autograd / fn_input_mutations_to_outputs, spec 6.3 item 1 and 6.4).
 *
 * In: the primals' facts after the forward (which ones the forward mutated, in data or in
 * metadata). Out: one InputMutationAOTOutput(<the primal's descriptor>) output per mutated
 * primal, in primal order, before the user outputs; with keep_inference_input_mutations on an
 * inference joint, the data-only ones kept in the graph instead (inference_mutations.c). A
 * mutated primal that requires grad is refused. */
#include "export_wrappers.h"
#include "inference_mutations.h"

static bool mutated(const ag_input_info *info) {
    return info->mutates_data || info->mutates_metadata;
}

static int mut_facts(ag__export_pass *st, void **self) {
    (void)self;
    for (int p = 0; p < st->np; p++) {
        st->nmutated += mutated(&st->in_info[p]);
        if (st->in_info[p].mutates_data && st->in_info[p].requires_grad)
            return ag__err(AG_ENOTSUP,
                           "export: input %d (%s) requires grad and is mutated in "
                           "place; mutating a parameter or input that requires "
                           "grad is not supported",
                           p, ag_node_name(st->prim[p]));
    }
    return 0;
}

static int mut_outputs(ag__export_pass *st, void **self, ag_section sec) {
    (void)self;
    for (int p = 0; sec == AG_SEC_OUT_MUTATIONS && p < st->np; p++) {
        if (!mutated(&st->in_info[p]))
            continue;
        ag_node *n = ag__tracer_node_of(st->T, st->primal_t[p]);
        ag_desc *d = n ? ag_desc_input_mutation(st->primal_descs[p]) : NULL;
        if (!d || ag__export_out(st, sec, n, d, NULL))
            return ag_last_status() < 0 ? ag_last_status() : AG_ENOMEM;
        st->out[st->nout - 1].primal = p;
    }
    return 0;
}

static int mut_finish(ag__export_pass *st, void **self) {
    (void)self;
    if (st->needs_autograd || !st->o->keep_inference_input_mutations)
        return 0;
    int n = ag__keep_input_mutations_in_graph(st->g, st->in_info, st->np);
    return n < 0 ? n : 0;
}

const ag__export_wrapper ag__input_mutations_wrapper = {
    .name = "input_mutations",
    .facts = mut_facts,
    .outputs = mut_outputs,
    .finish = mut_finish,
};
