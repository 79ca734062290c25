/* GPT-2 as in nanoGPT (Karpathy's model.py): causal self-attention, the pre-LN block and the
 * full model with the language-model head tied to the token embedding (by default; the config
 * also sets LayerNorm eps, the MLP's activation, the loss's ignore_index, an untied head and
 * a loss-only forward, each zero field meaning nanoGPT's choice).
 *
 * Module tree and names (match nanoGPT and Hugging Face checkpoints):
 *   transformer.wte, transformer.wpe, transformer.drop,
 *   transformer.h.{i}.{ln_1, attn.{c_attn, c_proj, attn_dropout, resid_dropout}, ln_2,
 *                      mlp.{c_fc, gelu, c_proj, dropout}},
 *   transformer.ln_f, lm_head (weight = transformer.wte.weight, so named_parameters with
 *   remove_duplicate lists it once, as transformer.wte.weight; untied: its own
 *   lm_head.weight, listed last).
 * Initialization as nanoGPT's _init_weights: N(0, 0.02) for Linear and Embedding weights,
 * zero biases, N(0, 0.02/sqrt(2 n_layer)) for both c_proj weights of every block. */
/* Module code records its call sites like user code, as torch/nn frames appear in PyTorch
 * stack traces. */
#define AG_RECORD_SITES
#include "nn_internal.h"

#include <math.h>

ag_gpt2_config ag_gpt2_config_tiny(void) {
    return (ag_gpt2_config){.n_layer = 2,
                            .n_head = 4,
                            .n_embd = 64,
                            .vocab_size = 256,
                            .block_size = 64,
                            .dropout = 0.0,
                            .bias = true};
}

ag_gpt2_config ag_gpt2_config_small(void) {
    return (ag_gpt2_config){.n_layer = 12,
                            .n_head = 12,
                            .n_embd = 768,
                            .vocab_size = 50257,
                            .block_size = 1024,
                            .dropout = 0.0,
                            .bias = true};
}

ag_gpt2_config ag_gpt2_config_xl(void) {
    return (ag_gpt2_config){.n_layer = 48,
                            .n_head = 25,
                            .n_embd = 1600,
                            .vocab_size = 50257,
                            .block_size = 1024,
                            .dropout = 0.0,
                            .bias = true};
}

static int check_config(const char *who, const ag_gpt2_config *c) {
    if (!c)
        return ag__err(AG_EINVAL, "%s: NULL config", who);
    if (c->n_layer <= 0 || c->n_head <= 0 || c->n_embd <= 0 || c->vocab_size <= 0 ||
        c->block_size <= 0)
        return ag__err(AG_EINVAL,
                       "%s: n_layer (%lld), n_head (%lld), n_embd (%lld), vocab_size "
                       "(%lld) and block_size (%lld) must be positive",
                       who, (long long)c->n_layer, (long long)c->n_head, (long long)c->n_embd,
                       (long long)c->vocab_size, (long long)c->block_size);
    if (c->n_embd % c->n_head)
        return ag__err(AG_EINVAL, "%s: n_embd (%lld) must be divisible by n_head (%lld)", who,
                       (long long)c->n_embd, (long long)c->n_head);
    if (!(c->dropout >= 0 && c->dropout <= 1))
        return ag__err(AG_EINVAL, "%s: dropout %g is not in [0, 1]", who, c->dropout);
    if (!(c->layer_norm_eps >= 0) || isinf(c->layer_norm_eps))
        return ag__err(AG_EINVAL, "%s: layer_norm_eps %g must be finite and positive (0: 1e-5)",
                       who, c->layer_norm_eps);
    if ((int)c->activation < AG_GPT2_GELU_TANH || c->activation > AG_GPT2_RELU)
        return ag__err(AG_EINVAL, "%s: activation %d is not gelu tanh (0), gelu (1) or relu (2)",
                       who, (int)c->activation);
    return 0;
}

static double ln_eps(const ag_gpt2_config *c) {
    return c->layer_norm_eps > 0 ? c->layer_norm_eps : 1e-5;
}

static int64_t ignore_index(const ag_gpt2_config *c) {
    return c->ignore_index ? c->ignore_index : -1;
}

static ag_module *activation_new(const ag_gpt2_config *c) {
    switch (c->activation) {
    case AG_GPT2_GELU:
        return ag_nn_gelu("none");
    case AG_GPT2_RELU:
        return ag_nn_relu();
    default:
        return ag_nn_gelu("tanh");
    }
}

/* Adds child under name (a NULL child from a failed constructor keeps its error). */
static int add(ag_module *m, const char *name, ag_module *child) {
    return ag_module_add_child(m, name, child);
}

static ag_module *done(ag_module *m, int rc) {
    if (rc) {
        ag_module_free(m);
        return NULL;
    }
    return m;
}

/* Calls a child by name inside the caller's scope (the result is scope-owned). */
static ag_tensor *sub(ag_module *m, const char *name, ag_tensor *x) {
    return ag_module_forward_child(m, name, x);
}

static int check_bct(const ag_module *m, const ag_tensor *x, int64_t C) {
    if (x->ndim != 3 || x->sizes[2] != C || !ag_dtype_is_float(x->dtype)) {
        char b[160];
        return ag__err(AG_EINVAL, "%s: expected a float input of shape (B, T, %lld), got %s",
                       ag_module_type(m), (long long)C, ag_tensor_meta_str(x, b, sizeof b));
    }
    return 0;
}

/* ---- CausalSelfAttention ---- */

typedef struct attn_ud {
    int64_t n_head, n_embd;
    double dropout;
} attn_ud;

/* x is (B, T, C); q, k, v are (B, nh, T, hs) with hs = C / nh. */
static int attn_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    int rc = ag_module_check_io(m, nin, 1, 1, max_out, 1);
    const attn_ud *u = ag_module_ud(m);
    if (!rc)
        rc = check_bct(m, in[0], u->n_embd);
    if (rc)
        return rc;
    ag_tensor *x = in[0];
    int64_t B = x->sizes[0], T = x->sizes[1], C = u->n_embd, nh = u->n_head;
    int64_t heads[4] = {B, T, nh, C / nh};
    ag_scope_begin();
    ag_tensor *qkv[3] = {NULL, NULL, NULL};
    ag_split(sub(m, "c_attn", x), C, 2, qkv, 3); /* (B, T, 3C) -> 3 x (B, T, C) */
    /* nanoGPT's order: k, then q, then v. */
    ag_tensor *k = ag_transpose(ag_view(qkv[1], 4, heads), 1, 2);
    ag_tensor *q = ag_transpose(ag_view(qkv[0], 4, heads), 1, 2);
    ag_tensor *v = ag_transpose(ag_view(qkv[2], 4, heads), 1, 2);
    ag_tensor *y;
    if (u->dropout > 0 && ag_module_is_training(m)) {
        /* Attention-probability dropout: the attention op has none, so this is nanoGPT's
         * explicit path, softmax(causal(q k^T / sqrt(hs))) through attn_dropout, then @ v. */
        ag_tensor *att = ag_mul_scalar(ag_matmul(q, ag_transpose(k, 2, 3)),
                                       1.0 / sqrt((double)(C / nh))); /* (B, nh, T, T) */
        ag_tensor *pos = ag_arange(AG_I64, 0, (double)T, 1);
        ag_tensor *cols = ag_view(pos, 2, (int64_t[]){1, T}); /* traced before rows */
        ag_tensor *rows = ag_view(pos, 2, (int64_t[]){T, 1});
        ag_tensor *future = ag_gt(cols, rows); /* (T, T): j > i */
        att = ag_softmax(ag_masked_fill(att, future, -INFINITY), -1);
        y = ag_matmul(sub(m, "attn_dropout", att), v);
    } else {
        y = ag_scaled_dot_product_attention(q, k, v, true, 0.0); /* (B, nh, T, hs) */
    }
    y = ag_view(ag_contiguous(ag_transpose(y, 1, 2)), 3, (int64_t[]){B, T, C});
    y = sub(m, "resid_dropout", sub(m, "c_proj", y));
    return ag_module_return1(y, out);
}

ag_module *ag_nn_causal_self_attention(const ag_gpt2_config *cfg) {
    AG__CHECK_NULL_RET("nn_causal_self_attention", cfg, NULL);
    if (check_config("CausalSelfAttention", cfg))
        return NULL;
    attn_ud *u = ag__malloc(sizeof *u);
    if (!u)
        return NULL;
    *u = (attn_ud){cfg->n_head, cfg->n_embd, cfg->dropout};
    ag_module *m = ag_module_new("CausalSelfAttention", attn_forward, u, ag__free);
    if (!m)
        return NULL;
    int64_t C = cfg->n_embd;
    double proj_std = 0.02 / sqrt(2.0 * (double)cfg->n_layer);
    int rc = add(m, "c_attn", ag__nn_linear_normal(C, 3 * C, cfg->bias, 0.02, NULL));
    if (!rc)
        rc = add(m, "c_proj", ag__nn_linear_normal(C, C, cfg->bias, proj_std, NULL));
    if (!rc)
        rc = add(m, "attn_dropout", ag_nn_dropout(cfg->dropout));
    if (!rc)
        rc = add(m, "resid_dropout", ag_nn_dropout(cfg->dropout));
    return done(m, rc);
}

/* ---- MLP: c_fc (C -> 4C), gelu(tanh), c_proj (4C -> C), dropout ---- */

static int mlp_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    int rc = ag_module_check_io(m, nin, 1, 1, max_out, 1);
    if (rc)
        return rc;
    ag_scope_begin();
    ag_tensor *h = sub(m, "gelu", sub(m, "c_fc", in[0])); /* (B, T, 4C) */
    return ag_module_return1(sub(m, "dropout", sub(m, "c_proj", h)), out);
}

static ag_module *mlp_new(const ag_gpt2_config *cfg) {
    ag_module *m = ag_module_new("MLP", mlp_forward, NULL, NULL);
    if (!m)
        return NULL;
    int64_t C = cfg->n_embd;
    double proj_std = 0.02 / sqrt(2.0 * (double)cfg->n_layer);
    int rc = add(m, "c_fc", ag__nn_linear_normal(C, 4 * C, cfg->bias, 0.02, NULL));
    if (!rc)
        rc = add(m, "gelu", activation_new(cfg));
    if (!rc)
        rc = add(m, "c_proj", ag__nn_linear_normal(4 * C, C, cfg->bias, proj_std, NULL));
    if (!rc)
        rc = add(m, "dropout", ag_nn_dropout(cfg->dropout));
    return done(m, rc);
}

/* ---- Block: x + attn(ln_1(x)), then x + mlp(ln_2(x)) ---- */

static int block_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out,
                         int max_out) {
    int rc = ag_module_check_io(m, nin, 1, 1, max_out, 1);
    if (rc)
        return rc;
    ag_scope_begin();
    ag_tensor *x = in[0];
    x = ag_add(x, sub(m, "attn", sub(m, "ln_1", x)));
    x = ag_add(x, sub(m, "mlp", sub(m, "ln_2", x)));
    return ag_module_return1(x, out);
}

ag_module *ag_nn_gpt2_block(const ag_gpt2_config *cfg) {
    AG__CHECK_NULL_RET("nn_gpt2_block", cfg, NULL);
    if (check_config("Block", cfg))
        return NULL;
    ag_module *m = ag_module_new("Block", block_forward, NULL, NULL);
    if (!m)
        return NULL;
    int64_t C = cfg->n_embd;
    int rc = add(m, "ln_1", ag__nn_layernorm_ex(C, ln_eps(cfg), true, cfg->bias));
    if (!rc)
        rc = add(m, "attn", ag_nn_causal_self_attention(cfg));
    if (!rc)
        rc = add(m, "ln_2", ag__nn_layernorm_ex(C, ln_eps(cfg), true, cfg->bias));
    if (!rc)
        rc = add(m, "mlp", mlp_new(cfg));
    return done(m, rc);
}

/* ---- GPT ---- */

typedef struct gpt_ud {
    ag_gpt2_config cfg;
} gpt_ud;

/* idx is (B, T) i64; targets (B, T) i64. logits (B, T, V); loss a scalar (mean over the
 * targets that are not the config's ignore_index, -1 by default as nanoGPT). */
static int gpt_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    const ag_gpt2_config *c = &((const gpt_ud *)ag_module_ud(m))->cfg;
    const bool loss_only = nin == 2 && c->loss_only;
    int rc = ag_module_check_io(m, nin, 1, 2, max_out, loss_only ? 1 : nin);
    if (rc)
        return rc;
    ag_tensor *idx = in[0];
    char b[160], b2[160];
    if (idx->ndim != 2 || idx->dtype != AG_I64)
        return ag__err(AG_EINVAL, "GPT: idx must be an int64 tensor of shape (B, T), got %s",
                       ag_tensor_meta_str(idx, b, sizeof b));
    int64_t T = idx->sizes[1], V = c->vocab_size;
    if (T > c->block_size)
        return ag__err(AG_EINVAL,
                       "GPT: cannot forward a sequence of length %lld, block size is "
                       "only %lld",
                       (long long)T, (long long)c->block_size);
    if (nin == 2 && (in[1]->dtype != AG_I64 || ag_tensor_numel(in[1]) != ag_tensor_numel(idx)))
        return ag__err(AG_EINVAL,
                       "GPT: targets must be an int64 tensor shaped like idx %s, "
                       "got %s",
                       ag__fmt_sizes(b, sizeof b, 2, idx->sizes),
                       ag_tensor_meta_str(in[1], b2, sizeof b2));
    ag_module *tr = ag_module_child(m, "transformer");
    ag_module *h = ag_module_child(tr, "h");
    ag_scope_begin();
    ag_tensor *pos = ag_arange(AG_I64, 0, (double)T, 1); /* (T) */
    ag_tensor *tok_emb = sub(tr, "wte", idx);            /* (B, T, C) */
    ag_tensor *pos_emb = sub(tr, "wpe", pos);            /* (T, C) */
    ag_tensor *x = sub(tr, "drop", ag_add(tok_emb, pos_emb));
    for (int i = 0; i < ag_module_num_children(h); i++)
        x = ag_module_forward(ag_module_child_at(h, i, NULL), x);
    x = sub(tr, "ln_f", x);
    ag_tensor *logits = sub(m, "lm_head", x); /* (B, T, V) */
    ag_tensor *loss = NULL;
    if (nin == 2) { /* one statement per traced call: C leaves argument order unspecified */
        ag_tensor *flat_logits = ag_view(logits, 2, (int64_t[]){-1, V});
        ag_tensor *flat_targets = ag_reshape(in[1], 1, (int64_t[]){-1});
        loss = ag_cross_entropy(flat_logits, flat_targets, AG_REDUCTION_MEAN, ignore_index(c));
    }
    if (!logits || (nin == 2 && !loss)) {
        ag_scope_end();
        return ag__nn_status();
    }
    if (loss_only)
        return ag_module_return1(loss, out);
    out[0] = ag_tensor_keep(logits);
    if (nin == 2)
        out[1] = ag_tensor_keep(loss);
    ag_scope_end();
    return nin;
}

ag_module *ag_nn_gpt2(const ag_gpt2_config *cfg) {
    AG__CHECK_NULL_RET("nn_gpt2", cfg, NULL);
    if (check_config("GPT", cfg))
        return NULL;
    gpt_ud *u = ag__malloc(sizeof *u);
    if (!u)
        return NULL;
    u->cfg = *cfg;
    ag_module *m = ag_module_new("GPT", gpt_forward, u, ag__free);
    ag_module *tr = m ? ag_module_new("ModuleDict", NULL, NULL, NULL) : NULL;
    if (!tr)
        return done(m, AG_ENOMEM);
    int rc = add(m, "transformer", tr);
    int64_t C = cfg->n_embd;
    if (!rc)
        rc = add(tr, "wte", ag__nn_embedding_normal(cfg->vocab_size, C, 0.02));
    if (!rc)
        rc = add(tr, "wpe", ag__nn_embedding_normal(cfg->block_size, C, 0.02));
    if (!rc)
        rc = add(tr, "drop", ag_nn_dropout(cfg->dropout));
    ag_module *h = NULL;
    if (!rc) {
        h = ag_nn_module_list();
        rc = add(tr, "h", h);
    }
    for (int64_t i = 0; i < cfg->n_layer && !rc; i++) {
        ag_module *b = ag_nn_gpt2_block(cfg);
        if (b && cfg->checkpoint_blocks) /* a block has a forward: this cannot fail */
            ag_module_set_checkpoint(b, true);
        if (b && cfg->compile_region_blocks) /* likewise */
            ag_module_set_compile_region(b, true);
        rc = ag_nn_append(h, b);
    }
    if (!rc)
        rc = add(tr, "ln_f", ag__nn_layernorm_ex(C, ln_eps(cfg), true, cfg->bias));
    if (!rc)
        rc = add(
            m, "lm_head",
            ag__nn_linear_normal(C, cfg->vocab_size, false, 0.02,
                                 cfg->untied_lm_head ? NULL : ag_module_param(tr, "wte.weight")));
    return done(m, rc);
}
