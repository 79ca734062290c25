/* The model zoo: small named models with example inputs, for the CLI (`aotgrad models`,
 * `aotgrad trace MODEL`), the tests and the benchmarks.
 *
 * Each entry builds a module tree from the nn API and a list of example inputs, both drawn from
 * the generator reseeded with ag_manual_seed(0), so two builds give identical weights and
 * inputs and eager runs are reproducible. In meta mode (ag_set_meta_mode(true), trace.h) a
 * build allocates no tensor data: GPT-2 small (124M parameters) can be built and traced with
 * its weights' shapes only. Threads may build models at once: each build reseeds the calling
 * thread's generator only (generators are per thread, core.h), so it gives the weights and
 * inputs a build on a quiet process gives.
 *
 * The models (see ag_zoo_description for each):
 *   linear        attribute `linear` = Linear(3, 2); input x [4, 3]
 *   multi_output  linear1 = Linear(3, 2), linear2 = Linear(3, 4); returns both; x [4, 3]
 *   kwargs        linear(x) * scale, linear = Linear(3, 2); inputs x [4, 3] and scale (a 0-dim
 *                 f32 tensor, 2.0). C has no keyword arguments: scale is the second positional
 *                 input here, and the export stage will describe it as the keyword argument
 *                 `scale` in its in_spec.
 *   convbn        conv = Conv2d(1, 3, 3, padding=1), bn = BatchNorm2d(3), relu; x [2, 1, 4, 4];
 *                 training mode (running statistics are updated in place)
 *   grad_acc      linear(x) - linear2(x), both Linear(3, 2); x [4, 3] requires grad
 *   mlp           784-256-128-10 with ReLU; x [32, 784]
 *   cnn           Fashion-MNIST classifier: Conv2d(1, 32, 3, padding=1)-BN-ReLU-MaxPool2 -
 *                 Conv2d(32, 64, 3, padding=1)-BN-ReLU-MaxPool2 - Flatten - Linear(3136, 128)-
 *                 ReLU-Linear(128, 10); x [8, 1, 28, 28]; training mode
 *   gpt2          GPT-2; configs "tiny" (the default, ag_gpt2_config_tiny), "gpt2-small"
 *                 (ag_gpt2_config_small: 124M) and "gpt2-xl" (ag_gpt2_config_xl: 1.56B, for
 *                 meta-mode builds: its f32 weights take 6.2 GB); idx [2, 16] i64 random
 *                 tokens; dropout 0 unless the build options set one (attention-probability,
 *                 residual, MLP and embedding dropout, as nanoGPT)
 *   dropout_mlp   fc1 = Linear(16, 32), ReLU, drop = Dropout(0.5), fc2 = Linear(32, 4);
 *                 x [8, 16]; training mode: every call draws a new mask from the generator
 *   effects       h = log_value(linear1(x), 'h'), y = log_value(linear2(relu(h)), 'y'),
 *                 linear1 = Linear(3, 4), linear2 = Linear(4, 2); x [4, 3]. log_value is the
 *                 effectful custom op below: the model's joint threads it by effect tokens.
 *                 (ag_gpt2_config_small: 124M); idx [2, 16] i64 random tokens
 *   two_tensor    linear(x, weight, bias) where weight [2, 3] and bias [2] are TwoTensor
 *                 parameters (include/aotgrad/subclass.h); x [4, 3] plain; the output is a
 *                 TwoTensor [4, 2]
 */
#ifndef AOTGRAD_ZOO_H
#define AOTGRAD_ZOO_H

#include "core.h"
#include "nn.h"
#include "optable.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The number of models, and model i's name and one-line description (static strings; NULL
 * when i is out of range). */
AG_API int ag_zoo_count(void);
AG_API const char *ag_zoo_name(int i);
AG_API const char *ag_zoo_description(int i);
/* Model i's configurations, comma-separated, the default first ("tiny, gpt2-small, gpt2-xl"), or
 * "default" for a model without variants. */
AG_API const char *ag_zoo_configs(int i);

/* Builds model `name` in configuration `config` (NULL or "default": the model's default)
 * after reseeding the generator with ag_manual_seed(0). On success *model is a new module
 * (free with ag_module_free), inputs[0..*ninputs) are new references owned by the caller (even
 * inside an autorelease scope; free each with ag_tensor_free) and 0 is returned. On failure a
 * negative status, nothing is returned or leaked, and the message names the valid models or
 * configurations. max_inputs must leave room for the model's inputs (at most 2). */
AG_API int ag_zoo_build(const char *name, const char *config, ag_module **model, ag_tensor **inputs,
                        int max_inputs, int *ninputs);

/* ---- the effects model's custom op and its log ----
 * aotgrad_demo::log_value(Tensor x, str tag, bool grad=False) -> Tensor is a user op flagged
 * AG_OP_EFFECTFUL (registered on first use): its kernel returns a copy of x and appends a
 * record of x to a process-wide log; its backward logs the incoming gradient with the same op
 * (grad=True) and passes it on. Eager, interpreted and compiled runs of the `effects` model
 * append the same records in the same order. Thread-safe: the op is registered once however
 * many threads build the model at once, and the log is locked (records of threads logging at
 * once interleave). */
typedef struct ag_zoo_log_record {
    char tag[32];  /* the tag argument (truncated) */
    bool grad;     /* logged by the backward */
    int64_t numel; /* elements of x */
    double sum;    /* their sum, in double, in row-major order */
} ag_zoo_log_record;
/* The op (registered on the first call; NULL with a message if registration fails). */
AG_API const ag_op *ag_zoo_log_value_op(void);
AG_API int ag_zoo_log_count(void);
/* Record i (0 = oldest) into *out; AG_EINVAL when there is none. */
AG_API int ag_zoo_log_get(int i, ag_zoo_log_record *out);
AG_API void ag_zoo_log_clear(void);
/* When on, each record is also printed to stderr as it is appended. Off by default. */
AG_API void ag_zoo_log_echo(bool on);
/* Build options; all zero means the model's defaults. */
typedef struct ag_zoo_opts {
    bool set_dropout; /* use `dropout` as the dropout probability (dropout_mlp, gpt2 only) */
    double dropout;   /* in [0, 1] */
    /* gpt2 only: each block a nested compile region (ag_gpt2_config.compile_region_blocks) */
    bool nested_blocks;
} ag_zoo_opts;
/* ag_zoo_build with options (NULL: defaults). Setting a dropout for a model without dropout
 * layers, or one outside [0, 1], or nested_blocks for a model other than gpt2, is an error
 * (AG_EINVAL). */
AG_API int ag_zoo_build_opts(const char *name, const char *config, const ag_zoo_opts *opts,
                             ag_module **model, ag_tensor **inputs, int max_inputs, int *ninputs);

#ifdef __cplusplus
}
#endif
#endif
