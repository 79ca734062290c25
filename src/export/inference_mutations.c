/* keep_inference_input_mutations: input mutations as trailing copy_ nodes
 * (inference_mutations.h; spec sections 2.4, 6.3 and 6.4).
 *
 * In: an inference joint whose mutated inputs are InputMutationAOTOutput outputs, and the
 * placeholders' facts. Out: the same graph where each data-only mutation is a copy_ of the new
 * value into the input's placeholder just before the output node (tagged must_be_in_forward,
 * as upstream's in-graph mutations of the forward are), no longer an output. Upstream keeps
 * such mutations in the graph only on the inference path (no autograd), which is the only
 * graph this rewrites. */
#include "../graph/graph_internal.h"
#include "inference_mutations.h"

#include <stdio.h>

/* The placeholder carrying descriptor d, or NULL. */
static ag_node *placeholder_of(ag_node *const *ph, int nph, const ag_desc *d) {
    for (int i = 0; i < nph; i++)
        if (ag_desc_equal(ag_node_desc(ph[i]), d))
            return ph[i];
    return NULL;
}

static int index_of(ag_node *const *ph, int nph, const ag_node *p) {
    for (int i = 0; i < nph; i++)
        if (ph[i] == p)
            return i;
    return -1;
}

int ag__keep_input_mutations_in_graph(ag_graph *g, const ag_input_info *info, int n) {
    AG__CHECK_NULL("keep_input_mutations", g);
    ag_node *out = ag_graph_output_node(g);
    if (!out || !ag_node_has_output_descs(out))
        return ag__err(AG_EINVAL, "keep_input_mutations: the graph has no output node with "
                                  "descriptors");
    ag_node **ph = NULL;
    int nph = ag_graph_placeholders(g, &ph);
    if (n < 0 || n > nph)
        return ag__err(AG_EINVAL, "keep_input_mutations: %d input facts for %d placeholders", n,
                       nph);
    if (n > 0)
        AG__CHECK_NULL("keep_input_mutations", info);
    for (int i = 0; i < nph; i++)
        if (ag_desc_is_tangent(ag_node_desc(ph[i])))
            return ag__err(AG_EINVAL,
                           "keep_input_mutations: %%%s is a tangent: input mutations "
                           "stay in the graph only on the inference path (a joint "
                           "with a backward returns them)",
                           ag_node_name(ph[i]));
    const ag_garg *a = ag_node_arg(out, 0);
    int nout = a->n;
    for (int k = 0; k < nout; k++)
        if (ag_desc_is_grad(ag_node_output_desc(out, k)))
            return ag__err(AG_EINVAL,
                           "keep_input_mutations: output %d is a gradient: input "
                           "mutations stay in the graph only on the inference path",
                           k);

    /* Which outputs move: data-only mutations of inputs that need no grad. */
    ag_node **dst = ag__calloc((size_t)(nout ? nout : 1), sizeof *dst); /* per output, or NULL */
    ag_node **keep = ag__calloc((size_t)(nout ? nout : 1), sizeof *keep);
    ag_desc **keep_desc = ag__calloc((size_t)(nout ? nout : 1), sizeof *keep_desc);
    ag_node **made = ag__calloc((size_t)(nout ? nout : 1), sizeof *made);
    int nmove = 0, nkeep = 0, nmade = 0, rc = 0;
    if (!dst || !keep || !keep_desc || !made) {
        rc = AG_ENOMEM;
        goto done;
    }
    for (int k = 0; k < nout; k++) {
        const ag_desc *d = ag_node_output_desc(out, k);
        if (d && ag_desc_kind_of(d) == AG_DESC_INPUT_MUTATION) {
            ag_node *p = placeholder_of(ph, nph, ag_desc_nested(d));
            if (!p) {
                char b[256];
                ag_desc_repr(d, b, sizeof b);
                rc = ag__err(AG_EINVAL,
                             "keep_input_mutations: output %d (%s): no placeholder "
                             "carries its input",
                             k, b);
                goto done;
            }
            int pi = index_of(ph, nph, p);
            if (pi >= n) {
                rc = ag__err(AG_EINVAL,
                             "keep_input_mutations: output %d mutates %%%s, which "
                             "has no input facts (%d given)",
                             k, ag_node_name(p), n);
                goto done;
            }
            const ag_input_info *fi = &info[pi];
            if (!a->u.nodes[k]) {
                rc = ag__err(AG_EINVAL,
                             "keep_input_mutations: output %d mutates %%%s but is "
                             "None",
                             k, ag_node_name(p));
                goto done;
            }
            if (fi->mutates_data && !fi->mutates_metadata && !fi->requires_grad) {
                dst[k] = p;
                nmove++;
                continue;
            }
        }
        keep[nkeep] = a->u.nodes[k];
        keep_desc[nkeep++] = ag_desc_retain(d);
    }
    if (nmove == 0)
        goto done;

    /* copy_(input, new value) for each, in output order, just before the output node. */
    const ag_op *copy = ag_op_find("copy_");
    if (!copy) {
        rc = ag__err(AG_EINVAL, "keep_input_mutations: no copy_ op registered");
        goto done;
    }
    /* (the caller's insertion point is restored below) */
    ag_node *ins_before = g->insert_before, *ins_after = g->insert_after;
    int ins_explicit = g->explicit_insert;
    ag_graph_insert_before(g, out);
    for (int k = 0; k < nout && rc == 0; k++) {
        if (!dst[k])
            continue;
        ag_garg args[2] = {AG_GA_N(dst[k]), AG_GA_N(a->u.nodes[k])};
        ag_node *c = ag_graph_call(g, copy, args, 2, NULL);
        if (!c) {
            rc = ag_last_status() ? ag_last_status() : AG_EINVAL;
            break;
        }
        made[nmade++] = c;
        rc = ag_node_set_partitioner_tag(c, "must_be_in_forward");
    }
    g->insert_before = ins_before;
    g->insert_after = ins_after;
    g->explicit_insert = ins_explicit;
    /* The output list without them; its descriptor array is ready before the list changes,
     * so nothing fails after it has. */
    ag_desc **v = NULL;
    if (rc == 0 && !(v = ag__calloc((size_t)(nkeep ? nkeep : 1), sizeof *v)))
        rc = AG_ENOMEM;
    if (rc == 0 && (rc = ag_node_set_arg(out, 0, AG_GA_NODES(keep, nkeep))) != 0)
        ag__free(v);
    if (rc) {
        for (int i = nmade - 1; i >= 0; i--)
            ag_graph_erase(g, made[i]);
        goto done;
    }
    for (int i = 0; i < nkeep; i++) {
        v[i] = keep_desc[i]; /* the reference taken above moves to the node */
        keep_desc[i] = NULL;
    }
    for (int i = 0; i < out->nout_descs; i++)
        ag_desc_release(out->out_descs[i]);
    ag__free(out->out_descs);
    out->out_descs = v;
    out->nout_descs = nkeep;
    rc = nmove;

done:
    for (int i = 0; keep_desc && i < nkeep; i++)
        ag_desc_release(keep_desc[i]);
    ag__free(dst);
    ag__free(keep);
    ag__free(keep_desc);
    ag__free(made);
    return rc;
}
