/* Tracing effectful ops with effect tokens (upstream's FunctionalTensorMode handle_effects).
 *
 * In: a call of an op flagged AG_OP_EFFECTFUL reaching the tracer's hook while the session has
 * a token chain (the joint export sets one for the forward and another for the backward). Out:
 *     %with_effects = with_effects(%token, 'ns::op', <args>)  # (f32[0], <outputs>)
 *     %getitem = getitem(%with_effects, 0)                   # the new token: now current
 *     %getitem_1 = getitem(%with_effects, 1)                 # the op's output 0, and so on
 * The op's output tensors are bound to the getitems after the token, so later ops read them
 * through the with_effects node, and the next effect of the chain takes %getitem as its token:
 * the chain fixes the order of the effects, and the final token is an output of the graph. */
#include "../graph/graph_internal.h"

int ag__trace_effect(ag__tracer *T, ag_graph *g, ag__token_chain *c, const ag_op *op,
                     const ag_garg *ga, int nargs, ag_tensor **outs, int nouts) {
    const ag_op *we = ag_op_with_effects(op);
    if (!we)
        return ag_last_status();
    if (nargs + 2 > AG_MAX_ARGS || nouts + 1 > AG_MAX_OUTPUTS)
        return ag__err(AG_ENOTSUP, "trace: %s: too many arguments or outputs for with_effects",
                       ag_op_name(op));
    if (!c->cur && !(c->cur = c->make(c)))
        return ag_last_status();
    ag_garg args[AG_MAX_ARGS];
    args[0] = AG_GA_N(c->cur);
    args[1] = AG_GA_S(ag_op_name(op));
    for (int i = 0; i < nargs; i++)
        args[2 + i] = ga[i];
    ag_tmeta vals[AG_MAX_OUTPUTS];
    ag__tmeta_contiguous(&vals[0], AG_F32, 1, (const int64_t[]){0});
    for (int k = 0; k < nouts; k++)
        ag__tmeta_of(outs[k], &vals[1 + k]);
    ag_node *n = ag__graph_call_vals(g, we, args, nargs + 2, vals, nouts + 1, NULL);
    if (!n || ag__tracer_node_meta(T, n))
        return ag_last_status();
    for (int k = 0; k <= nouts; k++) {
        ag_node *v = ag_graph_getitem(g, n, k, NULL);
        if (!v || ag__tracer_node_meta(T, v))
            return ag_last_status();
        if (k == 0)
            c->cur = v;
        else
            ag__tracer_bind(T, outs[k - 1], v);
    }
    return 0;
}
