/* The effect-token runtime wrapper (upstream's EffectTokensWrapper, spec section 8): a
 * compiled graph with effect tokens is called as if it had none.
 *
 * In: a partitioned forward or backward graph whose token placeholders and outputs carry
 * token descriptors (Forward/BackwardTokenAOTInput/Output), run by whatever its compiler made
 * of it (an ag_runnable).
 * Out: the graph's outputs without the token outputs. Each token fed is an empty f32 tensor
 * (upstream's torch.tensor([])): a token carries no data, only the order that the with_effects
 * nodes of the graph keep among themselves, so the effects run exactly once per run, in program
 * order. */
#include "../core/internal.h"
#include "effect_tokens.h"

static bool is_token(const ag_desc *d) {
    ag_desc_kind k = d ? ag_desc_kind_of(d) : (ag_desc_kind)-1;
    return k == AG_DESC_FORWARD_TOKEN_INPUT || k == AG_DESC_BACKWARD_TOKEN_INPUT ||
           k == AG_DESC_FORWARD_TOKEN_OUTPUT || k == AG_DESC_BACKWARD_TOKEN_OUTPUT;
}

void ag__effect_cache_clear(ag__effect_cache *e) {
    ag_tensor_free(e->tok);
    ag__free(e->xin);
    ag__free(e->xout);
    *e = (ag__effect_cache){0};
}

/* e's arrays with room for nin inputs and nout outputs; 0 or AG_ENOMEM. */
static int cache_reserve(ag__effect_cache *e, int nin, int nout) {
    if (!e->tok && !(e->tok = ag__tensor_new(AG_F32, 1, (const int64_t[]){0}, false)))
        return AG_ENOMEM;
    if (nin > e->cap_in) {
        ag_tensor **x = ag__malloc(sizeof *x * (size_t)nin);
        if (!x)
            return AG_ENOMEM;
        ag__free(e->xin);
        e->xin = x;
        e->cap_in = nin;
    }
    if (nout > e->cap_out) {
        ag_tensor **x = ag__malloc(sizeof *x * (size_t)nout);
        if (!x)
            return AG_ENOMEM;
        ag__free(e->xout);
        e->xout = x;
        e->cap_out = nout;
    }
    return 0;
}

int ag__effect_tokens_run(ag__effect_cache *e, const ag_graph *g, const ag_runnable *r, int ntok,
                          ag_tensor *const *in, int nin, ag_tensor **outs, int max_out) {
    ag_node **ph;
    int nph = ag_graph_placeholders(g, &ph);
    if (nph < 0)
        return nph;
    if (nph != nin + ntok)
        return ag__err(AG_EINVAL,
                       "compiled: the graph takes %d inputs, %d given and %d effect "
                       "tokens",
                       nph, nin, ntok);
    ag_node *on = ag_graph_output_node(g);
    int n = cache_reserve(e, nin + ntok, max_out + ntok);
    ag_tensor **xin = e->xin, **xout = e->xout, *tok = e->tok;
    if (n == 0) {
        memset(xout, 0, sizeof *xout * (size_t)(max_out + ntok));
        /* Tokens go where the graph's token placeholders are; the caller's inputs fill the
         * others in order. */
        for (int i = 0, k = 0; i < nph; i++)
            xin[i] = is_token(ag_node_desc(ph[i])) || k >= nin ? tok : in[k++];
        n = r->run(r->self, xin, nin + ntok, xout, max_out + ntok);
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
        int o = 0;
        for (int k = 0; k < n; k++) {
            if (on && is_token(ag_node_output_desc(on, k))) {
                if (!ag__in_scope()) /* else the open scope owns it */
                    ag_tensor_free(xout[k]);
            } else {
                outs[o++] = xout[k];
            }
        }
        n = o;
    }
    return n;
}

/* ---- the wrapper (compiled_internal.h): each graph's runnable called as if it had no tokens,
 * whatever compiler made it ---- */

#include "compiled_internal.h"

typedef struct token_runnable {
    const ag_graph *g; /* the compiled callable's, which outlives this */
    ag_runnable inner;
    ag__effect_cache cache;
    int ntok;
} token_runnable;

static int tok_run(void *self, ag_tensor *const *in, int nin, ag_tensor **outs, int max_out) {
    token_runnable *t = self;
    return ag__effect_tokens_run(&t->cache, t->g, &t->inner, t->ntok, in, nin, outs, max_out);
}

static void tok_destroy(void *self) {
    token_runnable *t = self;
    if (t->inner.destroy)
        t->inner.destroy(t->inner.self);
    ag__effect_cache_clear(&t->cache);
    ag__free(t);
}

static int64_t tok_peak(const void *self) {
    const token_runnable *t = self;
    return t->inner.peak_bytes ? t->inner.peak_bytes(t->inner.self) : -1;
}

static int tok_wrap(ag_runnable *r, const ag_graph *g, int ntok) {
    if (ntok == 0 || !r->run)
        return 0;
    token_runnable *t = ag__calloc(1, sizeof *t);
    if (!t)
        return AG_ENOMEM;
    *t = (token_runnable){g, *r, {0}, ntok};
    *r = (ag_runnable){tok_run, tok_destroy, tok_peak, t};
    return 0;
}

static int tokens_init(ag_compiled *c) {
    int rc = tok_wrap(&c->fw_run, c->fw, c->ntok_fw);
    return rc ? rc : tok_wrap(&c->bw_run, c->bw, c->ntok_bw);
}

const ag__rt_wrapper ag__rtw_tokens = {.name = "effect_tokens", .init = tokens_init};
