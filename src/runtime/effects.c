/* The effect-token runtime wrapper (upstream's EffectTokensWrapper, spec section 8): a
 * compiled graph with effect tokens is called as if it had none.
 *
 * In: a partitioned forward graph (tokens are its first inputs and first outputs) or backward
 * graph (tokens are its last inputs and last outputs), run by its plan or by the interpreter.
 * Out: the graph's outputs without the token outputs. Each token fed is an empty f32 tensor
 * (upstream's torch.tensor([])): a token carries no data, only the order that the with_effects
 * nodes of the graph keep among themselves, so the effects run exactly once per run, in program
 * order. */
#include "../core/internal.h"
#include "effects_internal.h"

int ag__effect_tokens_run(const ag_graph *g, ag_plan *p, int ntok, bool backward,
                          ag_tensor *const *in, int nin, ag_tensor **outs, int max_out) {
    ag_tensor **xin = ag__malloc(sizeof *xin * (size_t)(nin + ntok));
    ag_tensor **xout = ag__calloc((size_t)(max_out + ntok), sizeof *xout);
    ag_tensor *tok = ag__tensor_new(AG_F32, 1, (const int64_t[]){0}, false);
    int n = xin && xout && tok ? 0 : AG_ENOMEM;
    if (n == 0) {
        int first = backward ? nin : 0; /* where the tokens go */
        for (int i = 0; i < nin; i++)
            xin[backward ? i : ntok + i] = in[i];
        for (int k = 0; k < ntok; k++)
            xin[first + k] = tok;
        n = p ? ag_plan_run(p, xin, nin + ntok, xout, max_out + ntok)
              : ag_graph_run(g, xin, nin + ntok, xout, max_out + ntok);
    }
    if (n >= 0 && n < ntok) {
        for (int k = 0; k < n && !ag__in_scope(); k++)
            ag_tensor_free(xout[k]);
        n = ag__err(AG_EINVAL,
                    "compiled: the graph returned %d outputs, fewer than its %d "
                    "effect tokens",
                    n, ntok);
    }
    if (n >= 0) {
        int drop = backward ? n - ntok : 0; /* the token outputs */
        for (int k = 0, o = 0; k < n; k++) {
            if (k >= drop && k < drop + ntok) {
                if (!ag__in_scope()) /* else the open scope owns it */
                    ag_tensor_free(xout[k]);
            } else {
                outs[o++] = xout[k];
            }
        }
        n -= ntok;
    }
    ag_tensor_free(tok);
    ag__free(xin);
    ag__free(xout);
    return n;
}
