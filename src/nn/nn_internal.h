/* Helpers shared by the files of src/nn (module.c, layers.c, gpt2.c, optim.c, safetensors.c).
 * Nothing here is exported; the public API is include/aotgrad/nn.h. */
#ifndef AG_NN_INTERNAL_H
#define AG_NN_INTERNAL_H

#include "../core/internal.h"

/* The tensors of the state file: named_parameters (deduplicated) then the persistent
 * named_buffers (deduplicated, also against the parameters). With remove_duplicate false,
 * every name under which a state tensor is reachable. */
int ag__nn_state_tensors(const ag_module *m, bool remove_duplicate, ag_named_tensors *out);

/* Points the parameter (param) or buffer registered under fqn at t, without checks or
 * reference counting, and returns the tensor it held (NULL when there is none). The joint
 * export uses it to show the forward another tensor for a slot (a tied weight's separate
 * leaf) and swaps the old one back afterwards. */
ag_tensor *ag__module_swap_tensor(ag_module *m, const char *fqn, bool param, ag_tensor *t);

/* The tensors a module's exported function takes before its arguments, without allocating:
 * named_parameters then named_buffers, both with remove_duplicate false, in that order. Stores
 * the first `cap` in out (may be NULL when cap is 0) and returns how many there are. */
int64_t ag__module_flat_tensors(const ag_module *m, ag_tensor **out, int64_t cap);

/* The same tensors with their names: fn(ud, fqn, t, param) for each parameter (param true) then
 * each buffer, in named_parameters / named_buffers order with remove_duplicate false (a tied
 * weight under each of its names). fqn is valid during the call only. Allocates nothing while
 * the names fit in 255 characters. Stops at the first nonzero return of fn and returns it;
 * AG_ENOMEM when a longer name cannot be built. */
typedef int (*ag__module_tensor_fn)(void *ud, const char *fqn, ag_tensor *t, bool param);
int ag__module_visit_tensors(const ag_module *m, ag__module_tensor_fn fn, void *ud);

/* A value that changes whenever m's subtree gains a parameter, buffer or child, one of its
 * tensors is swapped (ag__module_swap_tensor) or converted (ag_module_to_dtype), and that no
 * other module, live or freed, ever had: tensors looked up by name in m stay valid, and are
 * the ones a new lookup would find, while it is unchanged. 0 for NULL. */
uint64_t ag__module_stamp(const ag_module *m);

/* m's own forward, called directly (no module frame, no checkpoint or region handling): the
 * tracer's region hook (trace/region_trace.c) runs a region's forward with it. AG_EINVAL for a
 * module without a forward. */
int ag__module_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int max_out);

/* Module calls seen by a tracer (per thread): while an observer is set, ag_module_call calls
 * enter(ud, m) before m's forward runs (a negative status fails the call, which then runs
 * nothing) and exit(ud, m) after it returns, failed or not. The tracer uses it to record each
 * node's nn_module_stack. */
typedef struct ag__module_observer {
    int (*enter)(void *ud, const ag_module *m);
    void (*exit)(void *ud, const ag_module *m);
    void *ud;
} ag__module_observer;
/* Installs obs (NULL: none) for the calling thread; returns the one it replaces. */
const ag__module_observer *ag__module_set_observer(const ag__module_observer *obs);
/* m's fully qualified name below root ("h.0.attn"; "" for root itself) as a new string
 * (ag__free). NULL without an error when m is neither root nor inside it; NULL with one when
 * out of memory. */
char *ag__module_path(const ag_module *root, const ag_module *m);

/* The status of the last error, or a generic EINVAL when none is pending (a NULL result
 * always follows a set error, so the fallback only guards against misuse). */
int ag__nn_status(void);

/* Constructors with nanoGPT's initialization instead of PyTorch's defaults.
 * Linear: weight N(0, std^2), bias zeros; when `tied` is given it becomes the weight (shape
 * (out, in), the module takes a reference) and nothing is drawn. */
ag_module *ag__nn_linear_normal(int64_t in_features, int64_t out_features, bool bias, double std,
                                ag_tensor *tied);
/* Embedding: weight N(0, std^2). */
ag_module *ag__nn_embedding_normal(int64_t num, int64_t dim, double std);
/* LayerNorm with weight (ones) and optionally bias (zeros): nanoGPT's LayerNorm(ndim, bias). */
ag_module *ag__nn_layernorm_ex(int64_t dim, double eps, bool weight, bool bias);

#endif
