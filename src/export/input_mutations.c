/* The input mutations wrapper of the joint export (export_wrappers.h; upstream's
 * fn_prepped_for_autograd / fn_input_mutations_to_outputs, spec 6.3 item 1 and 6.4).
 *
 * In: the primals' facts after the forward (which ones the forward mutated, in data or in
 * metadata). Out: one InputMutationAOTOutput(<the primal's descriptor>) output per mutated
 * primal, in primal order, before the user outputs; with keep_inference_input_mutations on an
 * inference joint, the data-only ones kept in the graph instead (inference_mutations.c).
 *
 * A primal that requires grad and that the forward mutates in place with grad mode on is
 * cloned before the forward runs, as upstream's maybe_to_fresh_input does: a new leaf bound to
 * the primal's placeholder stands for the input, and the forward's tensor is clone(<that
 * leaf>), which the forward reads and mutates. Which primals those are shows at the first
 * in-place op on one (the dispatcher asks this wrapper's hook before refusing an in-place op on
 * a leaf that requires grad): the primal is cloned there and then, and the export runs a second
 * pass that clones it from the start (reads before the mutation must see the clone too). The
 * mutation's output carries the new value with its history: it takes a tangent
 * (TangentAOTInput(output=InputMutationAOTOutput(...)), the first of the tangents) and the
 * primal's gradient is the leaf's. A mutation hidden from autograd (grad mode off) takes none. */
#include "export_wrappers.h"
#include "inference_mutations.h"

static bool mutated(const ag_input_info *info) {
    return info->mutates_data || info->mutates_metadata;
}

/* The wrapper's slot: kept across the export's passes. */
typedef struct fresh_inputs {
    /* The descriptors of the primals to clone before the forward runs (owned): those a pass
     * found mutated with grad mode on. */
    ag_desc **want;
    int nwant, cap_want;
    bool late; /* this pass cloned a primal only at its first in-place op */
    /* this pass */
    ag__export_pass *st;
    ag_tensor **leaf;  /* per primal: the leaf standing for it once it was cloned (owned) */
    ag_tensor **fresh; /* per primal: the forward's tensor given the clone's history (borrowed) */
    int np;            /* the primals when the pass began (the token wrapper adds more later) */
    int (*prev)(void *, ag_tensor *);
    void *prev_ud;
    bool hooked;
} fresh_inputs;

/* Primal p's tensor becomes clone(<a new leaf bound to p's placeholder>): its history and its
 * value in the graph are the clone's; the leaf is the one p's gradient is taken for. */
static int clone_primal(fresh_inputs *F, int p) {
    ag__export_pass *st = F->st;
    ag_tensor *self = st->primal_t[p];
    ag_node *ph = ag__tracer_node_of(st->T, self);
    ag_tmeta m;
    ag__tmeta_of(self, &m);
    ag_tensor *leaf = ph ? ag__tensor_alias(self, &m) : NULL;
    if (!leaf)
        return ag_last_status() < 0 ? ag_last_status() : AG_ENOMEM;
    leaf->requires_grad = true;
    leaf->is_view = self->is_view;
    ag__tracer_bind(st->T, leaf, ph);
    ag_scope_begin();
    ag_tensor *c = ag_clone(leaf);
    ag_node *cn = c ? ag__tracer_node_of(st->T, c) : NULL;
    if (cn) {
        ag__tensor_set_history(self, c);
        ag__tracer_bind(st->T, self, cn);
    }
    ag_scope_end();
    if (!cn) {
        ag_tensor_free(leaf);
        return ag_last_status() < 0 ? ag_last_status() : AG_ENOMEM;
    }
    F->leaf[p] = leaf;
    F->fresh[p] = self;
    return 0;
}

/* The dispatcher's leaf_inplace hook: self is about to be mutated in place. A primal not
 * cloned before the forward is cloned now, and the export runs another pass that clones it
 * from the start (the forward may have read it before: those reads must see the clone). */
static int late_clone(void *ud, ag_tensor *self) {
    fresh_inputs *F = ud;
    ag__export_pass *st = F->st;
    int p = 0;
    while (p < F->np && st->primal_t[p] != self)
        p++;
    if (p == F->np || F->leaf[p])
        return F->prev ? F->prev(F->prev_ud, self) : 0;
    if (F->nwant == F->cap_want) {
        int cap = F->cap_want ? 2 * F->cap_want : 4;
        ag_desc **w = ag__calloc((size_t)cap, sizeof *w);
        if (!w)
            return AG_ENOMEM;
        if (F->nwant)
            memcpy(w, F->want, sizeof *w * (size_t)F->nwant);
        ag__free(F->want);
        F->want = w;
        F->cap_want = cap;
    }
    int rc = clone_primal(F, p);
    if (rc)
        return rc;
    F->want[F->nwant++] = ag_desc_retain(st->primal_descs[p]);
    F->late = true;
    return 1;
}

static int mut_begin(ag__export_pass *st, void **self) {
    fresh_inputs *F = *self ? *self : ag__calloc(1, sizeof *F);
    if (!F)
        return AG_ENOMEM;
    *self = F;
    size_t n = (size_t)(st->np ? st->np : 1);
    F->st = st;
    F->np = st->np;
    F->late = false;
    F->leaf = ag__calloc(n, sizeof *F->leaf);
    F->fresh = ag__calloc(n, sizeof *F->fresh);
    if (!F->leaf || !F->fresh)
        return AG_ENOMEM;
    ag__tls_state *ts = ag__tls();
    F->prev = ts->leaf_inplace;
    F->prev_ud = ts->leaf_inplace_ud;
    ts->leaf_inplace = late_clone;
    ts->leaf_inplace_ud = F;
    F->hooked = true;
    st->grad_leaf = F->leaf;
    for (int p = 0; p < F->np; p++)
        for (int k = 0; k < F->nwant; k++)
            if (ag_desc_equal(F->want[k], st->primal_descs[p])) {
                int rc = clone_primal(F, p);
                if (rc)
                    return rc;
                break;
            }
    return 0;
}

static int mut_facts(ag__export_pass *st, void **self) {
    (void)self;
    for (int p = 0; p < st->np; p++)
        st->nmutated += mutated(&st->in_info[p]);
    return 0;
}

static int mut_outputs(ag__export_pass *st, void **self, ag_section sec) {
    fresh_inputs *F = *self;
    for (int p = 0; sec == AG_SEC_OUT_MUTATIONS && p < st->np; p++) {
        if (!mutated(&st->in_info[p]))
            continue;
        ag_tensor *t = st->primal_t[p];
        ag_node *n = ag__tracer_node_of(st->T, t);
        ag_desc *d = n ? ag_desc_input_mutation(st->primal_descs[p]) : NULL;
        /* The new value takes a tangent when autograd saw the mutation. */
        bool tangent =
            F && F->leaf[p] && st->in_info[p].mutates_data && st->in_info[p].requires_grad;
        if (!d || ag__export_out(st, sec, n, d, tangent ? t : NULL))
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

/* The hook removed; the forward's tensors (the module's own parameters among them) leaves
 * again, as they were. */
static void mut_end(ag__export_pass *st, void **self) {
    fresh_inputs *F = *self;
    if (!F)
        return;
    if (F->hooked) {
        ag__tls_state *ts = ag__tls();
        ts->leaf_inplace = F->prev;
        ts->leaf_inplace_ud = F->prev_ud;
        F->hooked = false;
    }
    for (int p = 0; F->leaf && F->fresh && p < F->np; p++) {
        if (F->fresh[p])
            ag__tensor_set_history(F->fresh[p], NULL);
        ag_tensor_free(F->leaf[p]);
    }
    st->grad_leaf = NULL;
    ag__free(F->leaf);
    ag__free(F->fresh);
    F->leaf = F->fresh = NULL;
    F->st = NULL;
}

/* Another pass when this one cloned a primal late. */
static int mut_settle(ag__export_pass *st, void **self, const ag__export_settled *f) {
    (void)st, (void)f;
    fresh_inputs *F = *self;
    return F && F->late ? 1 : 0;
}

static void mut_release(ag__export_pass *st, void **self) {
    (void)st;
    fresh_inputs *F = *self;
    for (int k = 0; F && k < F->nwant; k++)
        ag_desc_release(F->want[k]);
    if (F)
        ag__free(F->want);
    ag__free(F);
    *self = NULL;
}

const ag__export_wrapper ag__input_mutations_wrapper = {
    .name = "input_mutations",
    .begin = mut_begin,
    .facts = mut_facts,
    .outputs = mut_outputs,
    .finish = mut_finish,
    .end = mut_end,
    .settle = mut_settle,
    .release = mut_release,
};
