/* Modules, losses, optimizers and state files.
 *
 * A module is a node of a tree: it owns named parameters (leaf tensors that require grad),
 * named buffers and named child modules, each in registration order, and a forward function.
 * Fully qualified names and their order are PyTorch's named_parameters()/named_buffers():
 * pre-order over the tree (a module's own entries, then each child's, recursively), names
 * joined with '.', and with remove_duplicate the second sighting of the same tensor skipped
 * (GPT-2's tied lm_head.weight).
 *
 * A module, its parameters and buffers, and an optimizer made for it are used by one thread at
 * a time (nothing here takes a lock); different modules may be built, called and trained in
 * different threads at once (include/aotgrad.h, "Threads"). */
#ifndef AOTGRAD_NN_H
#define AOTGRAD_NN_H

#include "core.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ag_module ag_module;

/* forward: `nin` borrowed inputs; stores up to `max_out` outputs (new references) and returns
 * their count, or a negative status. */
typedef int (*ag_forward_fn)(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out,
                             int max_out);

/* ---- building modules (for custom modules; the built-ins below use the same calls) ---- */
/* A new empty module with a type name ("Linear", required, as every nn.Module has a class
 * name) and forward (may be NULL for containers that are not called). `ud` is the module's
 * user data, freed with `ud_free` if given, also when this fails (a NULL type_name, no
 * memory). */
AG_API ag_module *ag_module_new(const char *type_name, ag_forward_fn forward, void *ud,
                                void (*ud_free)(void *));
/* Frees the module, its children, and its references to parameters and buffers. NULL is a
 * no-op. */
AG_API void ag_module_free(ag_module *m);
/* The module takes a reference to t (param: requires_grad is set). */
AG_API int ag_module_register_parameter(ag_module *m, const char *name, ag_tensor *t);
/* persistent=false keeps the buffer out of the state dict. */
AG_API int ag_module_register_buffer(ag_module *m, const char *name, ag_tensor *t, bool persistent);
/* The module takes ownership of child. */
AG_API int ag_module_add_child(ag_module *m, const char *name, ag_module *child);
AG_API void *ag_module_ud(const ag_module *m);
AG_API const char *ag_module_type(const ag_module *m);

/* ---- reading modules ---- */
/* Borrowed lookups by dotted path ("layers.0.weight", "bn"); NULL if absent. */
AG_API ag_tensor *ag_module_param(const ag_module *m, const char *fqn);
AG_API ag_tensor *ag_module_buffer(const ag_module *m, const char *fqn);
AG_API ag_module *ag_module_child(const ag_module *m, const char *path);
AG_API int ag_module_num_children(const ag_module *m);
AG_API ag_module *ag_module_child_at(const ag_module *m, int i, const char **name);

/* A list of (fqn, tensor) pairs; tensors borrowed from the module. */
typedef struct ag_named_tensors {
    int n;
    char **names;
    ag_tensor **tensors;
} ag_named_tensors;
AG_API int ag_module_named_parameters(const ag_module *m, bool remove_duplicate,
                                      ag_named_tensors *out);
AG_API int ag_module_named_buffers(const ag_module *m, bool remove_duplicate,
                                   ag_named_tensors *out);
AG_API void ag_named_tensors_free(ag_named_tensors *nt);
AG_API int64_t ag_module_num_parameters(const ag_module *m); /* elements, deduplicated */

AG_API void ag_module_train(ag_module *m, bool training); /* recursive */
AG_API bool ag_module_is_training(const ag_module *m);

/* ---- calling ---- */
AG_API int ag_module_call(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out,
                          int max_out);
/* One input, one output; NULL on failure. */
AG_API ag_tensor *ag_module_forward(ag_module *m, ag_tensor *x);

/* ---- state (safetensors: params and persistent buffers by FQN) ---- */
AG_API int ag_module_save(const ag_module *m, const char *path);
/* Every tensor of the module must be in the file with the same dtype and shape. The file must
 * be well formed (AG_EFORMAT otherwise): known dtype names, each entry's data_offsets spanning
 * exactly its shape's bytes, the entries' data tiling the data after the header with no
 * overlap, gap or trailing byte. On failure the module is unchanged. */
AG_API int ag_module_load(ag_module *m, const char *path);

/* ---- built-in modules (PyTorch's default initializations, drawn from the generator) ---- */
AG_API ag_module *ag_nn_linear(int64_t in_features, int64_t out_features, bool bias);
AG_API ag_module *ag_nn_conv2d(int64_t in_ch, int64_t out_ch, int64_t kernel, int64_t stride,
                               int64_t padding, int64_t dilation, int64_t groups, bool bias);
AG_API ag_module *ag_nn_batchnorm2d(int64_t num_features, double eps, double momentum);
AG_API ag_module *ag_nn_layernorm(int64_t dim, double eps, bool elementwise_affine);
AG_API ag_module *ag_nn_embedding(int64_t num, int64_t dim);
AG_API ag_module *ag_nn_dropout(double p);
AG_API ag_module *ag_nn_relu(void);
AG_API ag_module *ag_nn_gelu(const char *approximate);
AG_API ag_module *ag_nn_maxpool2d(int64_t kernel, int64_t stride, int64_t padding);
AG_API ag_module *ag_nn_flatten(int start_dim, int end_dim);
/* Sequential/ModuleList: children named "0", "1", ...; Sequential's forward chains them. */
AG_API ag_module *ag_nn_sequential(void);
AG_API ag_module *ag_nn_module_list(void);
AG_API int ag_nn_append(ag_module *seq, ag_module *child); /* takes ownership */

/* ---- losses ---- */
/* CrossEntropyLoss as a module: call with (logits, target). */
AG_API ag_module *ag_nn_cross_entropy_loss(int reduction, int64_t ignore_index);

/* ---- GPT-2 ---- */
typedef struct ag_gpt2_config {
    int64_t n_layer, n_head, n_embd, vocab_size, block_size;
    double dropout;
    bool bias;
} ag_gpt2_config;
AG_API ag_gpt2_config ag_gpt2_config_tiny(void);  /* 2 layers, 64 wide, 4 heads, vocab 256 */
AG_API ag_gpt2_config ag_gpt2_config_small(void); /* 124M: 12/768/12, vocab 50257, ctx 1024 */
AG_API ag_gpt2_config ag_gpt2_config_xl(void);    /* 1.56B: 48/1600/25, vocab 50257, ctx 1024 */
/* Causal self-attention (c_attn, c_proj; named as in nanoGPT/HF GPT-2). Input (B, T, C). */
AG_API ag_module *ag_nn_causal_self_attention(const ag_gpt2_config *cfg);
/* Pre-LN block: x + attn(ln_1(x)); x + mlp(ln_2(x)), mlp = c_fc, gelu(tanh), c_proj. */
AG_API ag_module *ag_nn_gpt2_block(const ag_gpt2_config *cfg);
/* transformer.{wte,wpe,h.N,ln_f}, lm_head tied to wte. forward(idx (B,T) i64) -> logits
 * (B,T,V); forward(idx, targets) -> (logits, loss). */
AG_API ag_module *ag_nn_gpt2(const ag_gpt2_config *cfg);

/* ---- optimizers ---- */
typedef struct ag_optim ag_optim;
/* The optimizer references the module's parameters (deduplicated, named_parameters order). */
AG_API ag_optim *ag_optim_sgd(ag_module *m, double lr, double momentum, double weight_decay,
                              bool nesterov);
AG_API ag_optim *ag_optim_adamw(ag_module *m, double lr, double beta1, double beta2, double eps,
                                double weight_decay);
/* AdamW over a list of tensors instead of a module's parameters: the optimizer takes a reference
 * to each (a tensor listed twice is updated once) and updates those that have a .grad at each
 * step; its state (two moments per element) is allocated at a tensor's first step with the
 * tensor's shape, so an optimizer over one rank's shards of the parameters holds only their
 * share of the state (parallel.h). Same checks and update as ag_optim_adamw. */
AG_API ag_optim *ag_optim_adamw_tensors(ag_tensor *const *params, int n, double lr, double beta1,
                                        double beta2, double eps, double weight_decay);
AG_API int ag_optim_step(ag_optim *o);
AG_API void ag_optim_zero_grad(ag_optim *o); /* sets grads to NULL, like set_to_none=True */
AG_API void ag_optim_set_lr(ag_optim *o, double lr);
AG_API void ag_optim_free(ag_optim *o);

#ifdef __cplusplus
}
#endif
#endif
