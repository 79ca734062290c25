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

/* A module's forward, the contract every forward (built-in or custom) keeps; ag_module_call is
 * the only caller.
 *  - in[0..nin): borrowed inputs, never NULL (ag_module_call checks). Check nin and the inputs'
 *    shapes and dtypes first (ag_module_check_io for the count).
 *  - out[0..max_out): on success store n <= max_out outputs, each a new reference the caller
 *    then owns (ag_module_call hands them to the caller's autorelease scope, if one is open),
 *    none NULL, and return n. The usual shape: check, ag_scope_begin(), call ops (their
 *    results belong to that scope), then `return ag_module_return1(y, out);`, which keeps y,
 *    ends the scope and returns 1, or the error status when y is NULL.
 *  - on error: store nothing (or only what you free again), release what you made (end the
 *    scope you began), and return a negative status with a message set: an op that failed has
 *    set it; for your own checks use ag_set_error (core.h), naming the module and the values:
 *    `return ag_set_error(AG_EINVAL, "MyModule: expected x of shape [N, 4], got [2, 3]");`.
 *    Exports and ag_module_call report that message.
 *  - it may run under tracing (ag_export_joint, meta mode): its inputs, parameters and buffers
 *    may then have no data, so a forward only calls ops, other modules and shape/dtype queries
 *    (ag_tensor_ndim, ag_tensor_sizes, ...), never reads tensor data; and it must compute the
 *    same thing every call for the same shapes and training mode (no side channel).
 *  - m's ud is the forward's own state (ag_module_ud); children are called with
 *    ag_module_call, ag_module_forward or ag_module_forward_child. */
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

/* How ag_module_add_tensor fills a new tensor (torch.nn.init). */
typedef enum ag_init {
    AG_INIT_ZEROS,   /* zeros_ */
    AG_INIT_ONES,    /* ones_ */
    AG_INIT_UNIFORM, /* uniform_(a, b): U(a, b) from the generator */
    AG_INIT_NORMAL,  /* normal_(mean a, std b) from the generator */
} ag_init;
/* Creates a contiguous tensor of dtype dt (ag_get_default_dtype() for what PyTorch's layers
 * create) and the given shape, fills it as `init` says (under no-grad; drawn from the calling
 * thread's generator) and registers it on m as a parameter (param: a float dtype, requires
 * grad) or a persistent buffer. In meta mode (trace.h) the tensor has no data and nothing is
 * drawn. The module holds the only reference (read it back with ag_module_param or
 * ag_module_buffer). On failure nothing is registered and nothing leaks. */
AG_API int ag_module_add_tensor(ag_module *m, const char *name, bool param, ag_dtype dt, int ndim,
                                const int64_t *sizes, ag_init init, double a, double b);

/* The dtype built-in modules create their floating-point parameters and buffers in, as
 * torch.set_default_dtype: AG_F32 (the default) or AG_F64; anything else is refused
 * (AG_EINVAL, the setting unchanged). Per thread (like the generator, so that threads building
 * models at once do not see each other's setting); it affects the nn constructors (and what a
 * custom module passes to ag_module_add_tensor), not the tensor factories of core.h, which
 * take a dtype. */
AG_API int ag_set_default_dtype(ag_dtype dt);
AG_API ag_dtype ag_get_default_dtype(void);

/* Checks a forward's arity: nin inputs within [min_in, max_in] and room for need_out outputs
 * (max_out >= need_out). Returns 0, or AG_EINVAL with a message naming m's type and the
 * counts. */
AG_API int ag_module_check_io(const ag_module *m, int nin, int min_in, int max_in, int max_out,
                              int need_out);
/* Ends the forward's autorelease scope (the ag_scope_begin() the forward made) and stores y
 * (owned by that scope, or NULL after a failed op) in out[0] as a new reference. Returns 1, or
 * the pending error's status (out[0] NULL) when y is NULL. */
AG_API int ag_module_return1(ag_tensor *y, ag_tensor **out);
/* Calls m's child `name` (a dotted path) on one input: ag_module_forward(child, x). The
 * result belongs to the caller's open scope; NULL on failure (a missing child is an error
 * naming it, a NULL x keeps the error that made it NULL). */
AG_API ag_tensor *ag_module_forward_child(ag_module *m, const char *name, ag_tensor *x);

/* Converts every floating-point parameter and buffer of m and its children to dt (AG_F32 or
 * AG_F64), as PyTorch's module.to(dtype), .double(), .float(): each tensor is converted in
 * place, keeping its identity, so parameters stay the module's parameters (and any
 * optimizer's), requires_grad is kept and tied weights stay tied (GPT-2's lm_head.weight and
 * transformer.wte.weight remain one tensor). A parameter's .grad is converted too. Integer
 * and bool buffers (num_batches_tracked) are left alone. Data-less (meta) tensors change
 * dtype only. Refused for a non-float dt, for a tensor that is a view, a tensor subclass
 * instance or has autograd history; on any failure (also out of memory) nothing has changed.
 * Views of a converted tensor made before keep the old values (as after PyTorch's
 * `param.data = ...`), and an autograd graph that saved one refuses to run backward (the
 * version check). Convert before making an optimizer, as in PyTorch: state an optimizer
 * already holds (momentum, Adam's moments) keeps the old dtype. */
AG_API int ag_module_to_dtype(ag_module *m, ag_dtype dt);

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

/* Activation checkpointing of m (not recursive): with on, ag_module_call runs m's forward
 * through ag_checkpoint (autograd.h; torch.utils.checkpoint, use_reentrant=False), so the
 * activations inside m are recomputed in the backward (eager) or tagged for the partitioner to
 * recompute (ag_export_joint). Names stay as they were: m's parameters keep their FQNs and the
 * state dict is unchanged (as nanoGPT-style `checkpoint(block, x)` in the parent's forward;
 * PyTorch's checkpoint_wrapper would insert a `_checkpoint_wrapped_module.` level that its
 * state-dict hooks strip again). m must outlive the backward of every output made meanwhile.
 * AG_EINVAL for NULL or a module without a forward (a container: checkpoint its children). */
AG_API int ag_module_set_checkpoint(ag_module *m, bool on);
AG_API bool ag_module_is_checkpointed(const ag_module *m); /* false for NULL */

/* m as a nested compile region (not recursive; as decorating its forward with
 * torch.compiler.nested_compile_region; see ag_nested_compile_region in autograd.h): eager,
 * ag_module_call runs m's forward as usual; under tracing the forward is traced once per key
 * (m's forward function and type name, whether m is training, and each operand's dtype,
 * sizes, strides and requires_grad) into a subgraph, later calls reusing it. The operands are
 * the call's inputs, then m's parameters (named_parameters order, deduplicated), then its
 * buffers (named_buffers order, deduplicated): the subgraph's arg0_1, arg1_1, ... in that
 * order (then philox_seed and philox_base_offset when the forward draws random numbers under
 * ag_export_joint, as ag_nested_compile_region says). Modules of one type share a subgraph when
 * their operands match: their forwards must not differ in anything else (configuration kept in ud).
 * A module both checkpointed and a region is the region around the checkpoint (upstream's
 * nested_compile_region around a checkpointed function): eager it is checkpointed; under tracing it
 * is traced once (whether it is checkpointed is part of the key), the forward nodes of both its
 * subgraphs tagged recompute=MUST_RECOMPUTE, ac_graph_id 1, so the region's partition (done once)
 * saves its operands only and its backward subgraph recomputes the rest. m must stay valid while a
 * trace that called it runs. AG_EINVAL for NULL or a module without a forward. */
AG_API int ag_module_set_compile_region(ag_module *m, bool on);
AG_API bool ag_module_is_compile_region(const ag_module *m); /* false for NULL */

/* ---- calling ---- */
AG_API int ag_module_call(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out,
                          int max_out);
/* One input, one output; NULL on failure. */
AG_API ag_tensor *ag_module_forward(ag_module *m, ag_tensor *x);

/* ---- state (safetensors: params and persistent buffers by FQN) ---- */
/* Saves named_parameters (deduplicated: a tied weight once, under its first name) then the
 * persistent buffers. */
AG_API int ag_module_save(const ag_module *m, const char *path);
/* Every tensor of the module must be in the file with the same dtype and shape. The file must
 * be well formed (AG_EFORMAT otherwise): known dtype names, each entry's data_offsets spanning
 * exactly its shape's bytes, the entries' data tiling the data after the header with no
 * overlap, gap or trailing byte. On failure the module is unchanged. Same as
 * ag_module_load_ex(m, path, NULL, NULL). */
AG_API int ag_module_load(ag_module *m, const char *path);

/* Named tensors that own what they hold: names (ag__malloc'd strings), one reference to each
 * tensor, and the file's __metadata__ as key/value strings. Free with ag_tensor_dict_free. */
typedef struct ag_tensor_dict {
    int n;
    char **names;
    ag_tensor **tensors;
    int nmeta;
    char **meta_keys, **meta_values;
} ag_tensor_dict;
/* Releases the names, the tensor references and the metadata, and zeroes *d; NULL is a no-op.
 * A tensor the caller kept (ag_tensor_keep) outlives the dict. */
AG_API void ag_tensor_dict_free(ag_tensor_dict *d);
/* The tensor named `name`, borrowed from d; NULL if absent. */
AG_API ag_tensor *ag_tensor_dict_get(const ag_tensor_dict *d, const char *name);
/* The metadata value for key, borrowed from d; NULL if absent. */
AG_API const char *ag_tensor_dict_meta(const ag_tensor_dict *d, const char *key);

/* Writes n named tensors (any dtype: F32, F64, I64, BOOL, I8 in the file) to a safetensors file,
 * in list order; names must be unique, non-empty and not "__metadata__"; tensors need data
 * (not meta). `metadata` is NULL ({"format": "pt"} is written) or key, value, key, value, ...,
 * NULL: the __metadata__ strings. Everything is borrowed. The file is written to a temporary
 * next to path and renamed over it, so a failed save leaves any old file intact. */
AG_API int ag_safetensors_save(const char *path, const char *const *names,
                               ag_tensor *const *tensors, int n, const char *const *metadata);
/* Reads every tensor of a safetensors file into *out (new tensors, owned by *out, in the order
 * of their data in the file; free with ag_tensor_dict_free). The file gets every check of
 * ag_module_load; a tensor of a dtype aotgrad does not have (F16, BF16, ...) is AG_ENOTSUP
 * naming it. On failure *out is zeroed. */
AG_API int ag_safetensors_load(const char *path, ag_tensor_dict *out);

/* How ag_module_load_ex matches a state dict against the module. Zero-initialized: PyTorch's
 * load_state_dict defaults (strict, no conversion). */
typedef struct ag_load_opts {
    /* PyTorch's strict=False: module tensors the state dict lacks keep their values and names
     * the module lacks are skipped; both are listed in the report. Shapes must still match. */
    bool non_strict;
    /* A tensor of another dtype is converted into the module tensor's dtype when that is a
     * floating dtype (f64 file into an f32 module, and back); otherwise a dtype mismatch is an
     * error naming the tensor and both dtypes. */
    bool convert_dtype;
} ag_load_opts;
/* What a load found: module keys absent from the state dict (missing) and state dict keys the
 * module lacks (unexpected), as load_state_dict's return value. The arrays and strings are
 * owned by the report: free with ag_load_report_free. */
typedef struct ag_load_report {
    int nmissing, nunexpected;
    char **missing, **unexpected;
} ag_load_report;
AG_API void ag_load_report_free(ag_load_report *r); /* zeroes *r; NULL is a no-op */
/* ag_module_load with options (NULL: strict). report may be NULL; when given it is filled on
 * success (empty lists after a strict load) and zeroed on failure. On failure the module is
 * unchanged. */
AG_API int ag_module_load_ex(ag_module *m, const char *path, const ag_load_opts *opts,
                             ag_load_report *report);
/* The same from named tensors in memory (sd borrowed; values are copied into the module's
 * tensors), e.g. a partial state dict with non_strict. */
AG_API int ag_module_load_dict(ag_module *m, const ag_tensor_dict *sd, const ag_load_opts *opts,
                               ag_load_report *report);

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
/* MaxPool2d(kernel_size, stride, padding): square kernel; stride <= 0 means the kernel size
 * (PyTorch's None); padding at most half the kernel. */
AG_API ag_module *ag_nn_maxpool2d(int64_t kernel, int64_t stride, int64_t padding);
/* AvgPool2d(kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
 * square kernel; stride <= 0 means the kernel size (PyTorch's None); divisor_override 0 means
 * None (divide by the window's element count). PyTorch's defaults: (k, 0, 0, false, true, 0). */
AG_API ag_module *ag_nn_avgpool2d(int64_t kernel, int64_t stride, int64_t padding, bool ceil_mode,
                                  bool count_include_pad, int64_t divisor_override);
/* AdaptiveAvgPool2d((out_h, out_w)); a negative size is PyTorch's None (the input's size). */
AG_API ag_module *ag_nn_adaptive_avgpool2d(int64_t out_h, int64_t out_w);
AG_API ag_module *ag_nn_flatten(int start_dim, int end_dim);
/* Sequential/ModuleList: children named "0", "1", ...; Sequential's forward chains them. */
AG_API ag_module *ag_nn_sequential(void);
AG_API ag_module *ag_nn_module_list(void);
AG_API int ag_nn_append(ag_module *seq, ag_module *child); /* takes ownership */

/* ---- losses ---- */
/* CrossEntropyLoss as a module: call with (logits, target). */
AG_API ag_module *ag_nn_cross_entropy_loss(int reduction, int64_t ignore_index);
/* CrossEntropyLoss(weight, ignore_index, reduction, label_smoothing) with all of PyTorch's
 * arguments (positional, as ATen's cross_entropy_loss; PyTorch's defaults are NULL,
 * AG_REDUCTION_MEAN, -100, 0.0). weight: class weights (C), or NULL; the module registers it
 * as the persistent buffer "weight" (a reference, as PyTorch's _WeightedLoss does). The
 * formula is ag_cross_entropy_loss's (ops.h). */
AG_API ag_module *ag_nn_cross_entropy_loss_ex(ag_tensor *weight, int reduction,
                                              int64_t ignore_index, double label_smoothing);

/* ---- GPT-2 ---- */
/* The MLP's activation (the child "mlp.gelu", named as nanoGPT's attribute whatever it is). */
typedef enum ag_gpt2_activation {
    AG_GPT2_GELU_TANH = 0, /* GELU(approximate='tanh'): GPT-2's gelu_new, the default */
    AG_GPT2_GELU = 1,      /* exact GELU (erf) */
    AG_GPT2_RELU = 2,
} ag_gpt2_activation;

/* Start from ag_gpt2_config_tiny/small/xl or set every field up to `bias`: the sizes have no
 * default, and bias is false when zeroed (nanoGPT's default is true, which the presets set).
 * Every field after bias means nanoGPT's default when zero. */
typedef struct ag_gpt2_config {
    int64_t n_layer, n_head, n_embd, vocab_size, block_size;
    double dropout;
    bool bias;
    double layer_norm_eps;         /* every LayerNorm's eps; 0: 1e-5 */
    ag_gpt2_activation activation; /* 0: gelu with the tanh approximation */
    /* The loss's ignore_index: targets equal to it are left out of the loss and of its mean.
     * 0 means the default, -1 (nanoGPT's; Hugging Face's GPT2LMHeadModel uses -100, which is
     * set explicitly). Class 0 itself cannot be ignored (a zero field is the default). */
    int64_t ignore_index;
    /* false (the default): lm_head.weight is transformer.wte.weight (one tensor, listed once
     * by named_parameters). true: lm_head has its own weight (N(0, 0.02), listed as
     * lm_head.weight after transformer.ln_f's), as an untied checkpoint has. */
    bool untied_lm_head;
    /* false (the default): forward(idx, targets) returns (logits, loss). true: it returns only
     * (loss), so a training step does not keep the (B, T, V) logits alive as an output.
     * forward(idx) returns logits either way. */
    bool loss_only;
    /* true: each block transformer.h.N is checkpointed (ag_module_set_checkpoint: its
     * activations recomputed in the backward, its names unchanged), as nanoGPT-style training
     * that wraps each block's call in torch.utils.checkpoint. false (the default): none. */
    bool checkpoint_blocks;
    /* true: each block transformer.h.N is a nested compile region (ag_module_set_compile_region:
     * under tracing the block is traced once into a subgraph that every block calls, and the
     * joint has one forward and one backward subgraph), as decorating nanoGPT's Block.forward
     * with torch.compiler.nested_compile_region. Eager nothing changes. With
     * checkpoint_blocks too, each region is checkpointed inside (its partition saves the
     * block's operands only). false (the default): flat graphs. */
    bool compile_region_blocks;
} ag_gpt2_config;
AG_API ag_gpt2_config ag_gpt2_config_tiny(void);  /* 2 layers, 64 wide, 4 heads, vocab 256 */
AG_API ag_gpt2_config ag_gpt2_config_small(void); /* 124M: 12/768/12, vocab 50257, ctx 1024 */
AG_API ag_gpt2_config ag_gpt2_config_xl(void);    /* 1.56B: 48/1600/25, vocab 50257, ctx 1024 */
/* Causal self-attention (c_attn, c_proj; named as in nanoGPT/HF GPT-2). Input (B, T, C). */
AG_API ag_module *ag_nn_causal_self_attention(const ag_gpt2_config *cfg);
/* Pre-LN block: x + attn(ln_1(x)); x + mlp(ln_2(x)), mlp = c_fc, activation (gelu tanh by
 * default), c_proj. */
AG_API ag_module *ag_nn_gpt2_block(const ag_gpt2_config *cfg);
/* transformer.{wte,wpe,h.N,ln_f}, lm_head (tied to wte unless cfg->untied_lm_head).
 * forward(idx (B,T) i64) -> logits (B,T,V); forward(idx, targets (B,T) i64) -> (logits, loss),
 * or (loss) with cfg->loss_only; loss = cross entropy, mean over the targets that are not
 * cfg->ignore_index. */
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
/* Parameter groups (torch.optim's param_groups): each group has its own tensors and may set
 * its own options; an option whose bit is not in `set` takes the optimizer's value given to the
 * constructor (PyTorch: a group's missing keys take the defaults), so a zero-initialized group
 * has every default. `params` (and `names`, when given: FQNs used to name the state in
 * ag_optim_save; NULL: "<i>") are borrowed; the optimizer takes a reference to each tensor. A
 * tensor listed twice (in one group or two) is updated once, by its first group. */
enum {
    AG_GROUP_LR = 1 << 0,
    AG_GROUP_WEIGHT_DECAY = 1 << 1,
    AG_GROUP_MOMENTUM = 1 << 2, /* SGD */
    AG_GROUP_BETAS = 1 << 3,    /* AdamW: beta1 and beta2 */
    AG_GROUP_EPS = 1 << 4,      /* AdamW */
};
typedef struct ag_param_group {
    ag_tensor *const *params;
    const char *const *names;
    int n;
    unsigned set; /* AG_GROUP_* bits of the fields below that apply */
    double lr, weight_decay, momentum, beta1, beta2, eps;
} ag_param_group;
/* An optimizer over the groups, with the same update and checks as ag_optim_sgd/adamw (the
 * values given are the defaults of every group). NULL with a message on a bad value. */
AG_API ag_optim *ag_optim_sgd_groups(const ag_param_group *groups, int ngroups, double lr,
                                     double momentum, double weight_decay, bool nesterov);
AG_API ag_optim *ag_optim_adamw_groups(const ag_param_group *groups, int ngroups, double lr,
                                       double beta1, double beta2, double eps, double weight_decay);
/* nanoGPT's split for weight decay: m's parameters (deduplicated, named_parameters order) with
 * 2 or more dims (matmul and embedding weights) into decay, the others (biases, norm weights)
 * into no_decay. Tensors borrowed from m; free both with ag_named_tensors_free. */
AG_API int ag_module_decay_split(const ag_module *m, ag_named_tensors *decay,
                                 ag_named_tensors *no_decay);
AG_API int ag_optim_num_groups(const ag_optim *o);
/* Group g's learning rate (NAN for a NULL optimizer or a bad g). */
AG_API double ag_optim_group_lr(const ag_optim *o, int g);
AG_API int ag_optim_set_group_lr(ag_optim *o, int g, double lr);

AG_API int ag_optim_step(ag_optim *o);
AG_API void ag_optim_zero_grad(ag_optim *o);         /* sets grads to NULL, like set_to_none=True */
AG_API void ag_optim_set_lr(ag_optim *o, double lr); /* every group's */
AG_API void ag_optim_free(ag_optim *o);

/* torch.nn.utils.clip_grad_norm_ (norm_type 2, error_if_nonfinite=False): the total 2-norm of
 * the gradients of the n tensors (those without a .grad skipped), and when it exceeds max_norm
 * every gradient scaled in place by max_norm / (total + 1e-6). A non-finite total is returned
 * as is and the gradients are scaled by the same rule (to NaN), as upstream. *total_norm
 * (may be NULL) gets the norm before clipping. Tensors borrowed. */
AG_API int ag_clip_grad_norm(ag_tensor *const *params, int n, double max_norm, double *total_norm);
/* The same over the optimizer's parameters. */
AG_API int ag_optim_clip_grad_norm(ag_optim *o, double max_norm, double *total_norm);

/* Learning-rate schedules, a pure function of the iteration (counted from 0) that the training
 * loop applies before each step: ag_optim_set_lr(o, ag_lr_at(&s, it)). A zero-initialized
 * schedule is constant (PyTorch without a scheduler keeps the lr) at lr 0: set .lr. */
typedef enum ag_lr_kind {
    AG_LR_CONSTANT = 0,      /* lr */
    AG_LR_WARMUP_COSINE = 1, /* nanoGPT's get_lr */
} ag_lr_kind;
typedef struct ag_lr_schedule {
    ag_lr_kind kind;
    double lr;     /* the constant, or the peak (max_lr) */
    double min_lr; /* after decay_iters */
    int64_t warmup_iters, decay_iters;
} ag_lr_schedule;
/* Warmup + cosine (nanoGPT): lr * (it + 1) / warmup_iters for it < warmup_iters; min_lr for
 * it > decay_iters; between, min_lr + 0.5 (1 + cos(pi r)) (lr - min_lr) with
 * r = (it - warmup_iters) / (decay_iters - warmup_iters). NAN for a NULL or bad schedule
 * (negative iterations, decay_iters < warmup_iters). */
AG_API double ag_lr_at(const ag_lr_schedule *s, int64_t it);

/* Optimizer state for resuming, as a safetensors file: per parameter that has stepped,
 * "g<group>.<name>.step" (i64 scalar), AdamW's ".exp_avg" and ".exp_avg_sq", SGD's
 * ".momentum_buffer" (with momentum); "g<group>.lr" (f64 scalar) per group; __metadata__
 * {"optimizer": "AdamW" or "SGD"}. <name> is the parameter's FQN for ag_optim_sgd/adamw, the
 * group's name or its index in the group ("3") otherwise, with ".<k>" for the k-th plain inner
 * tensor of a tensor subclass parameter. */
AG_API int ag_optim_save(const ag_optim *o, const char *path);
/* Restores what ag_optim_save wrote (state, step counts and each group's lr) into an optimizer
 * made the same way (same kind, groups, names, shapes and dtypes): anything else is refused with
 * a message naming the difference, and on failure the optimizer is unchanged. */
AG_API int ag_optim_load(ag_optim *o, const char *path);

#ifdef __cplusplus
}
#endif
#endif
