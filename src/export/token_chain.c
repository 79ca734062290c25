/* Effect tokens in the joint export (upstream's handle_effect_tokens_fn and token discovery;
 * spec 6.3 item 5).
 *
 * In: the export's graph, its primal placeholders, and the tracer recording effectful ops as
 * with_effects (trace/trace_effects.c). Out: the token placeholders and the final tokens, in the
 * joint calling convention:
 *     placeholders  [ForwardTokenAOTInput(0) = primals_1] [params, buffers, args = primals_2..]
 *                   [tangents_1..] [BackwardTokenAOTInput(0) = tangents_token]
 *     outputs       [ForwardTokenAOTOutput(0)] [mutated inputs] [user outputs] [grads]
 *                   [BackwardTokenAOTOutput(0)]
 * A token exists only for a chain that has effects: a model without effectful ops keeps its
 * graph exactly as before. Upstream keys tokens by effect; every aotgrad effectful op shares
 * one key (upstream's ORDERED effect type), so each chain has at most one token, and all the
 * effects of a side run in one program order. The backward starts a chain of its own (upstream
 * swaps the token map before autograd.grad): its token is discovered when the backward's first
 * effect runs, as upstream's tangents_token placeholder. */
#include "../graph/graph_internal.h"
#include "export_wrappers.h"

#include <stddef.h>
#include <stdio.h>

typedef struct ag__export_tokens {
    ag__token_chain fw, bw; /* set on the tracer for the forward, then for the backward */
    ag_graph *g;
    int nprimals; /* placeholders before the forward token: its arrival renumbers them */
} ag__export_tokens;

/* Chains for the export into g, whose nprimals primal placeholders exist already. The forward
 * token, made on the forward's first effect, becomes the first placeholder primals_1
 * (ForwardTokenAOTInput(0)) and the other primals shift to primals_2..; the backward token,
 * made on the backward's first effect, is placeholder tangents_token
 * (BackwardTokenAOTInput(0), tagged is_backward) after the tangents. Every effectful op shares
 * one token per chain (one effect key, as upstream's ORDERED effect type). */
static void ag__export_tokens_init(ag__export_tokens *tk, ag_graph *g, int nprimals);
/* Stores the chain's final tokens and their output descriptors (ForwardTokenAOTOutput(i) /
 * BackwardTokenAOTOutput(i), new references) at nodes/descs; returns how many, or a negative
 * status. */
static int ag__export_tokens_outputs(const ag__export_tokens *tk, bool backward, ag_node **nodes,
                                     ag_desc **descs);

static const ag_tmeta *token_meta(ag_tmeta *m) {
    ag__tmeta_contiguous(m, AG_F32, 1, (const int64_t[]){0});
    return m;
}

/* The forward token: a placeholder moved in front of the primals, which are renamed
 * primals_2.. (last first, so each new name is free), the token taking primals_1. */
static ag_node *make_forward_token(ag__token_chain *c) {
    ag__export_tokens *tk =
        (ag__export_tokens *)(void *)((char *)c - offsetof(ag__export_tokens, fw));
    ag_graph *g = tk->g;
    ag_node **ph;
    int nph = ag_graph_placeholders(g, &ph);
    if (nph < 0)
        return NULL;
    /* The primals are the first placeholders; others (philox seeds) may follow already. */
    if (nph < tk->nprimals)
        return ag__err(AG_ESTATE,
                       "export: the graph has %d placeholders, fewer than its %d "
                       "primals",
                       nph, tk->nprimals),
               NULL;
    nph = tk->nprimals;
    /* The placeholder array is the graph's cache: copy it before changing the graph. */
    ag_node **prim = ag__malloc(sizeof *prim * (size_t)(nph ? nph : 1));
    if (!prim)
        return NULL;
    memcpy(prim, ph, sizeof *prim * (size_t)nph);
    ag_tmeta m;
    ag_node *t = ag_graph_placeholder(g, "__forward_token", token_meta(&m));
    ag_desc *d = ag_desc_forward_token_input(0);
    int rc = t && d ? ag_node_set_desc(t, d) : AG_ENOMEM;
    ag_desc_release(d);
    if (rc == 0 && nph)
        rc = ag_graph_move_before(g, t, prim[0]);
    for (int i = nph - 1; rc == 0 && i >= 0; i--) {
        char name[32];
        snprintf(name, sizeof name, "primals_%d", i + 2);
        rc = ag_node_rename(g, prim[i], name);
    }
    if (rc == 0)
        rc = ag_node_rename(g, t, "primals_1");
    ag__free(prim);
    return rc == 0 ? t : NULL;
}

/* The backward token: placeholder tangents_token after the tangents. */
static ag_node *make_backward_token(ag__token_chain *c) {
    ag__export_tokens *tk =
        (ag__export_tokens *)(void *)((char *)c - offsetof(ag__export_tokens, bw));
    ag_tmeta m;
    ag_node *t = ag_graph_placeholder(tk->g, "tangents_token", token_meta(&m));
    ag_desc *d = ag_desc_backward_token_input(0);
    int rc = t && d ? ag_node_set_desc(t, d) : AG_ENOMEM;
    ag_desc_release(d);
    if (rc == 0)
        rc = ag_node_set_partitioner_tag(t, "is_backward");
    return rc == 0 ? t : NULL;
}

static void ag__export_tokens_init(ag__export_tokens *tk, ag_graph *g, int nprimals) {
    memset(tk, 0, sizeof *tk);
    tk->g = g;
    tk->nprimals = nprimals;
    tk->fw.make = make_forward_token;
    tk->bw.make = make_backward_token;
}

static int ag__export_tokens_outputs(const ag__export_tokens *tk, bool backward, ag_node **nodes,
                                     ag_desc **descs) {
    ag_node *cur = backward ? tk->bw.cur : tk->fw.cur;
    if (!cur)
        return 0;
    nodes[0] = cur;
    descs[0] = backward ? ag_desc_backward_token_output(0) : ag_desc_forward_token_output(0);
    return descs[0] ? 1 : AG_ENOMEM;
}

/* ---- the export's wrapper (export_wrappers.h) ----
 * Effect tokens (upstream's handle_effect_tokens_fn): the forward's chain from the start, the
 * backward's from the backward's start; the final tokens are the first forward outputs and the
 * last backward outputs; the forward token is the first primal. Its slot holds the chains. */
static int tokens_begin(ag__export_pass *st, void **self) {
    ag__export_tokens *tk = ag__calloc(1, sizeof *tk);
    if (!tk)
        return AG_ENOMEM;
    *self = tk;
    ag__export_tokens_init(tk, st->g, st->np);
    ag__tracer_set_token_chain(st->T, &tk->fw);
    return 0;
}

static int tokens_outputs(ag__export_pass *st, void **self, ag_section sec) {
    bool backward = sec == AG_SEC_OUT_BW_TOKENS;
    if (!backward && sec != AG_SEC_OUT_FW_TOKENS)
        return 0;
    ag_node *node;
    ag_desc *desc;
    int n = ag__export_tokens_outputs(*self, backward, &node, &desc);
    if (n > 0 && (n = ag__export_out(st, sec, node, desc, NULL)) == 0)
        n = 1;
    if (n < 0)
        return n;
    if (!backward)
        st->nfw_tokens = n;
    else
        st->nbw_tokens = n;
    for (int k = 0; backward && k < n; k++) { /* tangents_token: the last tangent placeholder */
        ag_desc *d = ag_desc_backward_token_input(k);
        int rc = d ? ag__export_tangent(st, d) : AG_ENOMEM;
        if (rc)
            return rc;
    }
    return 0;
}

static int tokens_backward(ag__export_pass *st, void **self) {
    ag__tracer_set_token_chain(st->T, &((ag__export_tokens *)*self)->bw);
    return 0;
}

/* The forward tokens are the first primals: their descriptors and (empty) input facts go in
 * front of the flat inputs'. */
static int tokens_finish(ag__export_pass *st, void **self) {
    (void)self;
    int n = st->nfw_tokens, np = st->np;
    if (n == 0)
        return 0;
    ag_desc **d = ag__calloc((size_t)(np + n), sizeof *d);
    ag_input_info *info = ag__calloc((size_t)(np + n), sizeof *info);
    if (!d || !info) {
        ag__free(d);
        ag__free(info);
        return AG_ENOMEM;
    }
    memcpy(d + n, st->primal_descs, sizeof *d * (size_t)np);
    memcpy(info + n, st->in_info, sizeof *info * (size_t)np);
    ag__free(st->primal_descs);
    ag__free(st->in_info);
    st->primal_descs = d;
    st->in_info = info;
    st->np = np + n;
    for (int i = 0; i < n; i++)
        if (!(d[i] = ag_desc_forward_token_input(i)))
            return AG_ENOMEM;
    return 0;
}

static void tokens_end(ag__export_pass *st, void **self) {
    if (st->T)
        ag__tracer_set_token_chain(st->T, NULL);
    ag__free(*self);
    *self = NULL;
}

const ag__export_wrapper ag__effect_tokens_wrapper = {
    .name = "effect_tokens",
    .begin = tokens_begin,
    .outputs = tokens_outputs,
    .backward = tokens_backward,
    .finish = tokens_finish,
    .end = tokens_end,
};
