/* The joint export with descriptors: the C counterpart of PyTorch's
 * aot_export_joint_with_descriptors, its JointWithDescriptors object, the pytree specs of the
 * calling convention, and the FX utilities that pair inputs with gradients and outputs with
 * tangents.
 *
 * ag_export_joint traces a module's forward and, through the eager autograd engine's backward
 * rules, its backward into ONE functional graph:
 *   inputs  = primals (params in params_spec order, buffers in buffers_spec order, then the
 *             flattened user args and kwargs values) followed by tangents (one per forward
 *             output that requires grad: mutated inputs that require grad first, then user
 *             outputs that alias nothing, then intermediate bases);
 *   outputs = [input mutations..., user outputs..., metadata mutations of merged inputs...,
 *             intermediate bases..., grads (one per primal, None where the primal needs
 *             none)].
 * Primals are the flat inputs after upstream's deduplication and synthetic-base merging (see
 * ag_joint_flat_input_primal).
 * Every placeholder carries its descriptor and the output node carries one per output. In-place
 * updates of inputs (BatchNorm's running stats) are recorded functionally and returned as
 * InputMutationAOTOutput outputs, placed first; the graph mutates nothing. An input that
 * requires grad and is mutated in place with grad mode on is cloned first (upstream's
 * maybe_to_fresh_input: primals_1 -> clone -> the mutation), its new value takes a tangent
 * (TangentAOTInput(output=InputMutationAOTOutput(mutated_input=...)), the first ones) and its
 * GradAOTOutput is the gradient of its value before the mutation; a mutation under grad mode
 * off takes no tangent; a mutation through a view of such an input is one of the whole input
 * (its base), as eager's CopySlices makes it. Forward nodes are
 * tagged is_forward and carry the seq_nr of the autograd node they created; backward nodes are
 * tagged is_backward, carry their forward op's seq_nr, annotations and stack trace; gradient
 * accumulations are add nodes with is_gradient_acc. When no input requires grad the result is a
 * forward-only graph without tangents, as upstream.
 *
 * Random ops (dropout, rand, randn, uniform_, normal_) are functionalized (upstream's
 * functionalize_rng_ops): they draw with philox_rand / philox_randn from placeholders fwd_seed
 * and fwd_base_offset (PhiloxForwardSeedAOTInput, PhiloxForwardBaseOffsetAOTInput), placed after
 * the tangents, each draw at add(fwd_base_offset, numbers drawn before it); the forward returns
 * add(fwd_base_offset, total) as PhiloxUpdatedForwardOffsetAOTOutput after the user outputs
 * (counted by ag_joint_num_fw_outputs). Draws in the backward use bwd_seed / bwd_base_offset
 * (after the forward's) and return PhiloxUpdatedBackwardOffsetAOTOutput after the grads. Feed
 * the generator's seed and offset (ag_rng_get_state) as 0-dim int64 tensors and set its offset
 * to the returned one to draw what eager draws; ag_compile_joint's callable does so. A model
 * without random ops gets none of these.
 *
 * Tensor subclass instances (include/aotgrad/subclass.h) among the inputs or outputs are
 * flattened into their plain inner tensors, as upstream's aot_dispatch_subclass: a primal per
 * inner tensor (SubclassGetAttrAOTInput(base=ParamAOTInput(target='w'), attr='a')), an output
 * per inner tensor of an output (SubclassGetAttrAOTOutput(base=PlainAOTOutput(idx=0), 'a')),
 * of its tangent (SubclassGetAttrAOTInput(base=TangentAOTInput(...), 'a')) and of each
 * gradient (SubclassGetAttrAOTOutput(base=GradAOTOutput(...), 'a')); an input without a
 * gradient has one None however many primals it has. The counts below (primals, tangents, user
 * and forward outputs, static inputs) are the graph's, flattened; params_spec, in_spec and
 * out_spec describe the user's (outer) tensors. Shapes are static: there are no
 * SubclassSize/SubclassStride descriptors. */
#ifndef AOTGRAD_EXPORT_H
#define AOTGRAD_EXPORT_H

#include "core.h"
#include "desc.h"
#include "graph.h"
#include "nn.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- pytree specs ---- */

typedef enum ag_tree_kind {
    AG_TREE_LEAF = 0, /* a tensor */
    AG_TREE_NONE,     /* None (no tensor) */
    AG_TREE_TUPLE,
    AG_TREE_LIST,
    AG_TREE_DICT, /* string keys, in insertion order */
} ag_tree_kind;

/* An immutable, refcounted description of a nested structure (PyTorch's TreeSpec). */
typedef struct ag_treespec ag_treespec;
AG_API ag_treespec *ag_treespec_leaf(void);
AG_API ag_treespec *ag_treespec_none(void);
/* The container takes its own references to the children. */
AG_API ag_treespec *ag_treespec_tuple(ag_treespec *const *children, int n);
AG_API ag_treespec *ag_treespec_list(ag_treespec *const *children, int n);
AG_API ag_treespec *ag_treespec_dict(const char *const *keys, ag_treespec *const *children, int n);
AG_API ag_treespec *ag_treespec_retain(const ag_treespec *s);
AG_API void ag_treespec_release(ag_treespec *s); /* NULL: no-op */
AG_API ag_tree_kind ag_treespec_kind(const ag_treespec *s);
AG_API int ag_treespec_num_children(const ag_treespec *s);
AG_API const ag_treespec *ag_treespec_child(const ag_treespec *s, int i);
AG_API const char *ag_treespec_key(const ag_treespec *s, int i); /* DICT only */
AG_API int ag_treespec_num_leaves(const ag_treespec *s);
AG_API bool ag_treespec_equal(const ag_treespec *a, const ag_treespec *b);
/* PyTorch's repr: TreeSpec(tuple, None, [TreeSpec(list, None, [*, *]), TreeSpec(dict, [], [])])
 * with leaves as `*`. Returns the full length, like snprintf. */
AG_API size_t ag_treespec_repr(const ag_treespec *s, char *buf, size_t n);

/* A nested value of tensors (for flatten/unflatten). Leaves hold references. */
typedef struct ag_tree ag_tree;
AG_API ag_tree *ag_tree_leaf(ag_tensor *t);
AG_API ag_tree *ag_tree_none(void);
/* Containers take ownership of the children. */
AG_API ag_tree *ag_tree_tuple(ag_tree *const *children, int n);
AG_API ag_tree *ag_tree_list(ag_tree *const *children, int n);
AG_API ag_tree *ag_tree_dict(const char *const *keys, ag_tree *const *children, int n);
AG_API void ag_tree_free(ag_tree *t);
AG_API ag_tree_kind ag_tree_kind_of(const ag_tree *t);
AG_API int ag_tree_num_children(const ag_tree *t);
AG_API ag_tree *ag_tree_child(const ag_tree *t, int i);
AG_API const char *ag_tree_key(const ag_tree *t, int i);
AG_API ag_tensor *ag_tree_tensor(const ag_tree *t); /* LEAF: borrowed */
/* Leaves in depth-first order (borrowed references in *leaves, an array to ag_free) and the
 * spec. Returns the leaf count or a negative status. */
AG_API int ag_tree_flatten(const ag_tree *t, ag_tensor ***leaves, ag_treespec **spec);
/* Rebuilds a tree of the spec's shape from n leaves; errors when n differs from the spec's
 * leaf count. */
AG_API ag_tree *ag_tree_unflatten(const ag_treespec *spec, ag_tensor *const *leaves, int n);

/* ---- the export ---- */

/* Zero-initialized, or NULL (the same): upstream's defaults (decompositions=None,
 * keep_inference_input_mutations=False), except random ops, which are functionalized unless
 * keep_random_ops (upstream's functionalize_rng_ops config is off by default: its random ops
 * stay as they are and the partitioner saves their outputs). */
typedef struct ag_export_opts {
    const ag_decomp_table *decompositions; /* NULL: none (composites still decompose) */
    /* On the inference path (no input requires grad), data mutations of inputs stay in the
     * graph as trailing copy_ nodes (tagged must_be_in_forward) instead of
     * InputMutationAOTOutput outputs; the compiled callable then has none to write back. */
    bool keep_inference_input_mutations;
    /* Record random ops as they are, drawing from the running thread's generator when the
     * graph runs, instead of functionalizing the generator (see ag_export_joint). */
    bool keep_random_ops;
} ag_export_opts;

typedef struct ag_joint ag_joint;

/* Exports module m called on args (positional) and kwargs (tensor keyword arguments, in the
 * given order; they follow the args as PlainAOTInput indices). Returns the joint (caller frees)
 * or NULL with a message. The module's tensors are not modified. Threads may export at once
 * (their own modules, or ones no other thread is using): the trace is the calling thread's. */
AG_API ag_joint *ag_export_joint(ag_module *m, ag_tensor *const *args, int nargs,
                                 const char *const *kwarg_names, ag_tensor *const *kwargs,
                                 int nkwargs, const ag_export_opts *opts);
AG_API void ag_joint_free(ag_joint *j);

AG_API ag_graph *ag_joint_graph(const ag_joint *j); /* borrowed */
/* Replaces the graph after the user processed it without changing the calling convention (the
 * joint takes ownership of g, also on failure). Checks that the placeholders carry exactly the
 * current graph's descriptors, in its order, that the output node carries one descriptor per
 * output, and that g verifies. A transform that adds, drops or reshapes inputs uses
 * ag_joint_update. */
AG_API int ag_joint_set_graph(ag_joint *j, ag_graph *g);
/* The open transform path (upstream's update_joint_with_descriptors): replaces the graph with g,
 * whose inputs and outputs may differ from the export's (added, dropped, reshaped), as long as
 * each placeholder carries a descriptor and the sections come in order (ag_graph_layout). The
 * joint takes ownership of g, also on failure (when it keeps its old graph and state). The
 * calling convention follows from the descriptors:
 *  - primals the export made keep their facts; a new ParamAOTInput, BufferAOTInput or
 *    PlainAOTInput primal requires grad when a GradAOTOutput of it is returned (not None) and
 *    is mutated when an InputMutationAOTOutput of it is; params_spec and buffers_spec list the
 *    Param and Buffer primals in graph order;
 *  - when primals were added or dropped, the compiled callable's flat inputs are the primals
 *    (tokens excluded) in graph order, so a sharded parameter is fed as the shard and a new
 *    buffer where its placeholder is; refused (AG_ENOTSUP) for a joint whose inputs were
 *    deduplicated, merged into bases or flattened from tensor subclasses;
 *  - tangents are matched to outputs by descriptor: an output whose tangent was dropped
 *    carries no gradient; the user outputs stay (the out_spec's count), effect tokens too.
 * Shapes are the placeholders' vals: set them, then ag_graph_reinfer_meta, before updating. */
AG_API int ag_joint_update(ag_joint *j, ag_graph *g);

/* ---- the calling convention as data ----
 * A graph's inputs and outputs fall into sections (ag_section in desc.h), told apart by their
 * descriptors and laid out in the enum's order: inputs are forward tokens, primals, (a backward
 * graph's saved values), tangents, backward tokens, the forward's and the backward's philox seed
 * and offset; outputs are forward tokens, input mutations, user outputs, metadata mutations,
 * intermediate bases, the updated forward philox offset, (a forward graph's saved values),
 * gradients (one per primal that is not a token, None where it has none), the updated backward
 * philox offset and backward tokens. Input sections index placeholders, output sections the
 * output node's arguments. */
typedef struct ag_range {
    int start, count;
} ag_range;
typedef struct ag_layout {
    ag_range sec[AG_SEC_COUNT];
    int ninputs, noutputs;
} ag_layout;

/* Reads g's layout from its descriptors into *out. The first nsaved placeholders are the saved
 * section whatever they carry (a partitioned backward's; 0 for a joint or a forward). Fails, with
 * *out untouched, naming the placeholder without a descriptor or the input or output that comes
 * after a later section's. */
AG_API int ag_graph_layout(const ag_graph *g, int nsaved, ag_layout *out);
AG_API int ag_layout_count(const ag_layout *L, ag_section s); /* 0 for NULL */
AG_API int ag_layout_start(const ag_layout *L, ag_section s); /* -1 for NULL */
/* Outputs before the saved values and the gradients (the partitioner's num_fwd_outputs). */
AG_API int ag_layout_num_fw_outputs(const ag_layout *L);
/* The joint's layout (borrowed, valid until the joint changes graph or is freed). */
AG_API const ag_layout *ag_joint_layout(const ag_joint *j);

AG_API int ag_joint_num_params(const ag_joint *j);
AG_API const char *ag_joint_param_fqn(const ag_joint *j, int i); /* params_spec[i] */
AG_API int ag_joint_num_buffers(const ag_joint *j);
AG_API const char *ag_joint_buffer_fqn(const ag_joint *j, int i); /* buffers_spec[i] */
/* in_spec describes ((params..., buffers..., args...), {kwargs}); out_spec the user outputs. */
AG_API const ag_treespec *ag_joint_in_spec(const ag_joint *j);
AG_API const ag_treespec *ag_joint_out_spec(const ag_joint *j);
/* Indices of primals whose storage is static (params and buffers). */
AG_API int ag_joint_num_static_inputs(const ag_joint *j);
AG_API int ag_joint_static_input(const ag_joint *j, int i);

/* mutates_data and requires_grad together: the input's mutation output takes a tangent when the
 * forward mutated it with grad mode on (see the top of this file). */
typedef struct ag_input_info {
    bool mutates_data;
    bool mutates_metadata;
    bool requires_grad;
} ag_input_info;

/* Upstream's OutputType. Outputs that alias an input or an intermediate get no tangent and
 * are regenerated at run time as views of their base (the caller's tensor, a returned
 * intermediate base or another output), so they share storage as in eager. */
typedef enum ag_output_alias {
    AG_OUT_NON_ALIAS = 0,
    AG_OUT_IS_INPUT,                                  /* base_index: the primal */
    AG_OUT_ALIAS_OF_INPUT,                            /* base_index: the primal */
    AG_OUT_ALIAS_OF_INTERMEDIATE,                     /* base_index: the intermediate base */
    AG_OUT_ALIAS_OF_INTERMEDIATE_SAVE_AS_OUTPUT,      /* the first alias of a new base */
    AG_OUT_ALIAS_OF_INTERMEDIATE_BASE_IS_USER_OUTPUT, /* base_index: that user output */
    AG_OUT_UNSAFE_VIEW_ALIAS, /* the only output viewing an intermediate: a plain output */
} ag_output_alias;

typedef struct ag_output_info {
    ag_output_alias alias;
    int base_index; /* what an aliasing output is regenerated from (see above), or -1 */
    bool requires_grad;
} ag_output_info;

AG_API int ag_joint_num_primals(const ag_joint *j); /* flat inputs before tangents */
AG_API int ag_joint_num_tangents(const ag_joint *j);
AG_API const ag_input_info *ag_joint_input_info(const ag_joint *j, int primal);
AG_API int ag_joint_num_user_outputs(const ag_joint *j);
AG_API const ag_output_info *ag_joint_output_info(const ag_joint *j, int user_output);
AG_API int ag_joint_num_mutated_inputs(const ag_joint *j);
/* Extra forward outputs after the user outputs: MetadataMutationAOTOutput(i) (aliased inputs
 * merged into a base whose metadata the forward changed), then IntermediateBaseAOTOutput. */
AG_API int ag_joint_num_metadata_mutations(const ag_joint *j);
AG_API int ag_joint_num_intermediate_bases(const ag_joint *j);
/* Forward outputs: forward effect tokens, input mutations, user outputs, metadata mutations,
 * intermediate bases, and the updated philox offset when the forward draws random numbers
 * (the partitioner's num_fwd_outputs). */
AG_API int ag_joint_num_fw_outputs(const ag_joint *j);
/* Effect tokens (effectful ops, see ag_op_with_effects in optable.h): forward tokens are the
 * first primals (ForwardTokenAOTInput(i), placeholders primals_1..) and the first outputs
 * (ForwardTokenAOTOutput(i)); backward tokens are placeholders tangents_token_1.. after the
 * tangents (BackwardTokenAOTInput(i), not counted by ag_joint_num_tangents) and the last
 * outputs, after the gradients (BackwardTokenAOTOutput(i)). Gradients are one per primal that
 * is not a token. Each count is 0 or 1 (all effectful ops share one token); a joint without
 * effects has none. Callers feed tokens as empty f32 tensors (f32[0]). */
AG_API int ag_joint_num_forward_tokens(const ag_joint *j);
AG_API int ag_joint_num_backward_tokens(const ag_joint *j);
AG_API bool ag_joint_needs_autograd(const ag_joint *j);

/* The flat inputs (params, buffers, args, kwargs: what the compiled callable takes) and the
 * primals they become. A duplicate input (the same tensor twice) that is mutated is removed
 * and maps to its first occurrence's primal; inputs sharing memory with a mutation among them
 * map to the primal of their base (ViewBaseAOTInput / SyntheticBaseAOTInput), from which the
 * graph regenerates them. Otherwise flat input i is its own primal. */
AG_API int ag_joint_num_flat_inputs(const ag_joint *j);
AG_API int ag_joint_flat_input_primal(const ag_joint *j, int flat); /* -1 out of range */
/* Flat input `flat`'s descriptor, the joint's record of its calling convention (upstream's
 * flat_args_descs after subclass flattening): ParamAOTInput(target=fqn) for each parameter,
 * BufferAOTInput(target=fqn) for each buffer, then PlainAOTInput(idx=k) for the user's args and
 * kwargs values; a tensor subclass instance is one flat input per plain inner tensor,
 * SubclassGetAttrAOTInput(base=<its descriptor>, attr=...), in its attrs' order. Borrowed: it
 * lives as long as the joint's calling convention (until ag_joint_update or ag_joint_free; take
 * a reference with ag_desc_retain to keep it). NULL for a NULL joint or flat out of range. */
AG_API const ag_desc *ag_joint_flat_input_desc(const ag_joint *j, int flat);
/* The graph's primal inputs for flat inputs, as the compiled callable derives them: stores
 * num_primals new references in primals (the caller frees them). Checks that removed
 * duplicates are the same tensor as their first occurrence and that merged inputs are views
 * of one base as at export; a negative status names the input otherwise. */
AG_API int ag_joint_primals_from_flat(const ag_joint *j, ag_tensor *const *flat, int nflat,
                                      ag_tensor **primals, int max);

/* ---- saved joints (docs/JOINT_FORMAT.md) ----
 * A joint saves as text: a header line "aotgrad-joint 1", the joint's facts that its graph does
 * not hold (params_spec, buffers_spec, in_spec, out_spec, needs_autograd, the input and output
 * facts above, and the aliasing facts: flat inputs -> primals with their geometries), then the
 * graph in its text format (docs/GRAPH_FORMAT.md) with seq_nr, stack traces, annotations and
 * every metadata item. A loaded joint behaves as the saved one: its accessors answer the same,
 * ag_compile_joint makes the same callable of it, and saving it again gives the same text. The
 * counts (primals, tangents, tokens, philox inputs, extra outputs) come from the graph's layout.
 * A joint with tensor subclasses (include/aotgrad/subclass.h) also writes the structure of each
 * outer input, its gradient and each outer output (subclass_inputs, subclass_grads,
 * subclass_outputs); the loader finds the types by name (ag_subclass_type_find: the library's
 * own and those registered with ag_subclass_type_register): save refuses with AG_ENOTSUP a joint
 * with a type not found by its name, and load refuses an unknown name ("line 31: no tensor
 * subclass type 'Foo' is registered"). */

/* The saved text in *text (NUL-terminated, from the allocator: free it with ag_free) and its
 * length in *len (len may be NULL). On failure *text is untouched. */
AG_API int ag_joint_save(const ag_joint *j, char **text, size_t *len);
/* Writes the saved text to path, through a temporary file next to it renamed onto path when
 * complete: on failure (AG_EIO naming the path) path is left as it was. */
AG_API int ag_joint_save_file(const ag_joint *j, const char *path);
/* A new joint (caller frees) from saved text (len bytes, no NUL inside), or NULL with a message
 * naming the line: "joint_load: line 12: input_info lists 5 primals; the graph has 4 (...)"; a
 * bad header or version, a line that does not parse, counts that disagree with the graph, an
 * index or alias kind out of range, and every error of ag_graph_parse (its lines renumbered to
 * the whole text) are refused. */
AG_API ag_joint *ag_joint_load(const char *text, size_t len);
/* ag_joint_load of a file's contents; messages name the path ("joint_load_file: PATH: line 3:
 * ..."; AG_EIO when it cannot be read). */
AG_API ag_joint *ag_joint_load_file(const char *path);
/* A stable 64-bit hash of what the joint computes, for caches of compiled results: 64-bit
 * FNV-1a over the saved text with two things left out: the graph's stack traces (the source
 * files, lines and functions that made each node change when code moves or is built elsewhere,
 * not what the graph computes), and the absolute values of seq_nr, replaced by their rank among
 * the graph's seq_nrs (the autograd counter runs on across exports, so the same model exported
 * twice numbers its nodes from different starts; which nodes share a seq_nr still counts).
 * Everything else counts: the specs (a renamed parameter changes the hash), shapes and dtypes,
 * every node, argument and other metadata item (annotations, tags, recompute) and the calling
 * convention. The same model exported twice with the same shapes hashes the same; a loaded
 * joint hashes as the joint it was saved from. Refuses what ag_joint_save refuses. */
AG_API int ag_joint_hash(const ag_joint *j, uint64_t *out);

/* ---- FX utilities (upstream's torch._functorch._aot_autograd.fx_utils) ----
 * Each returns pairs keyed by descriptor in graph order, or NULL with a message (a graph with
 * subclass descriptors is refused as upstream refuses it). */
typedef struct ag_fx_pairs ag_fx_pairs;
AG_API void ag_fx_pairs_free(ag_fx_pairs *p);
AG_API int ag_fx_pairs_count(const ag_fx_pairs *p);
AG_API const ag_desc *ag_fx_pairs_desc(const ag_fx_pairs *p, int i);
AG_API ag_node *ag_fx_pairs_first(const ag_fx_pairs *p, int i);      /* input / output node */
AG_API ag_node *ag_fx_pairs_second(const ag_fx_pairs *p, int i);     /* grad / tangent or NULL */
AG_API int ag_fx_pairs_find(const ag_fx_pairs *p, const ag_desc *d); /* index or -1 */

/* input desc -> (placeholder, grad node or NULL): every differentiable input, tangents too. */
AG_API ag_fx_pairs *ag_fx_all_input_and_grad_nodes(const ag_graph *g);
/* output desc -> (output node, tangent placeholder or NULL): every differentiable output. */
AG_API ag_fx_pairs *ag_fx_all_output_and_tangent_nodes(const ag_graph *g);
AG_API ag_fx_pairs *ag_fx_param_and_grad_nodes(const ag_graph *g);
AG_API ag_fx_pairs *ag_fx_plain_input_and_grad_nodes(const ag_graph *g);
AG_API ag_fx_pairs *ag_fx_plain_output_and_tangent_nodes(const ag_graph *g);

/* FQN -> placeholder, in graph order. */
typedef struct ag_fx_named ag_fx_named;
AG_API void ag_fx_named_free(ag_fx_named *n);
AG_API int ag_fx_named_count(const ag_fx_named *n);
AG_API const char *ag_fx_named_name(const ag_fx_named *n, int i);
AG_API ag_node *ag_fx_named_node(const ag_fx_named *n, int i);
AG_API ag_node *ag_fx_named_get(const ag_fx_named *n, const char *fqn);
AG_API ag_fx_named *ag_fx_named_param_nodes(const ag_graph *g);
AG_API ag_fx_named *ag_fx_named_buffer_nodes(const ag_graph *g);
/* The placeholders of params (buffers) in graph order, the order to feed them: stores up to
 * max into out and returns the total count, or a negative status. */
AG_API int ag_fx_param_nodes(const ag_graph *g, ag_node **out, int max);
AG_API int ag_fx_buffer_nodes(const ag_graph *g, ag_node **out, int max);

#ifdef __cplusplus
}
#endif
#endif
