/* The public API's NULL policy (core.h), checked for every public function that takes a
 * pointer: each is called with NULL for all its pointer arguments (zero for the rest), in a
 * child process so that a crash fails one row instead of the program. Fallible calls (a status
 * or a new object) must fail with a negative status and a message that starts with the call's
 * name without ag_ ("plan_run: p is NULL"), or for an op entry point with the op's name
 * ("add.Scalar: argument 'self' is NULL"). Accessors,
 * predicates, void calls and destructors must not crash; accessors returning pointers return
 * NULL. The rows were listed from the headers' AG_API declarations. */
#define AG_NO_SITES
#include "testutil.h"

#include <ctype.h>
#include <math.h>
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

/* Kinds: F, a fallible call (error status or NULL, message set); A, an accessor or action
 * (no crash; a pointer accessor returns NULL); N, a call for which these NULLs are valid
 * arguments (zero sizes of a 0-dim tensor, an empty tuple, a default gelu): no crash. R: the call
 * returns a pointer (1 when NULL), I: an int status, O: anything else. */
typedef struct row {
    const char *name;
    char kind, ret;
    long (*call)(void);
    /* An op entry point whose errors name the ATen op it calls rather than the function
     * ("add.Scalar: argument 'self' is NULL" from ag_add_scalar); NULL: the message names the
     * function without its ag_ prefix. */
    const char *op;
} row;

static long c_ag_backward(void) {
    return (ag_backward)(NULL, NULL, false);
}
static long c_ag_grad(void) {
    return (ag_grad)(NULL, NULL, 0, NULL, 0, NULL, false, false);
}
static long c_ag_tensor_seq_nr(void) {
    return (long)(ag_tensor_seq_nr)(NULL);
}
static long c_ag_tensor_grad_fn_name(void) {
    return ag_tensor_grad_fn_name(NULL) == NULL;
}
static long c_ag_gradcheck(void) {
    return (ag_gradcheck)((ag_gradcheck_fn)0, NULL, NULL, 0, NULL);
}
static long c_ag_partition(void) {
    return (ag_partition)(NULL, 0, NULL, NULL, NULL, NULL);
}
static long c_ag_tag_region_recompute(void) {
    return (ag_tag_region_recompute)(NULL, NULL, NULL, (ag_recompute)0);
}
static long c_ag_plan_new(void) {
    return ag_plan_new(NULL, NULL) == NULL;
}
static long c_ag_plan_free(void) {
    (ag_plan_free)(NULL);
    return 0;
}
static long c_ag_plan_run(void) {
    return (ag_plan_run)(NULL, NULL, 0, NULL, 0);
}
static long c_ag_plan_peak_bytes(void) {
    return (long)(ag_plan_peak_bytes)(NULL);
}
static long c_ag_plan_output_bytes(void) {
    return (long)(ag_plan_output_bytes)(NULL);
}
static long c_ag_compile_joint(void) {
    return ag_compile_joint(NULL, NULL) == NULL;
}
static long c_ag_compiled_free(void) {
    (ag_compiled_free)(NULL);
    return 0;
}
static long c_ag_compiled_call(void) {
    return (ag_compiled_call)(NULL, NULL, 0, NULL, 0);
}
static long c_ag_compiled_call_module(void) {
    return (ag_compiled_call_module)(NULL, NULL, NULL, 0, NULL, 0);
}
static long c_ag_compiled_forward_graph(void) {
    return ag_compiled_forward_graph(NULL) == NULL;
}
static long c_ag_compiled_backward_graph(void) {
    return ag_compiled_backward_graph(NULL) == NULL;
}
static long c_ag_compiled_stats(void) {
    return ag_compiled_stats(NULL) == NULL;
}
static long c_ag_compiled_peak_bytes(void) {
    return (long)(ag_compiled_peak_bytes)(NULL, false);
}
static long c_ag_empty(void) {
    return ag_empty((ag_dtype)0, 0, NULL) == NULL;
}
static long c_ag_zeros(void) {
    return ag_zeros((ag_dtype)0, 0, NULL) == NULL;
}
static long c_ag_ones(void) {
    return ag_ones((ag_dtype)0, 0, NULL) == NULL;
}
static long c_ag_full(void) {
    return ag_full((ag_dtype)0, 0, NULL, 0) == NULL;
}
static long c_ag_from_data(void) {
    return ag_from_data((ag_dtype)0, 0, NULL, NULL) == NULL;
}
static long c_ag_tensor_free(void) {
    (ag_tensor_free)(NULL);
    return 0;
}
static long c_ag_tensor_keep(void) {
    return ag_tensor_keep(NULL) == NULL;
}
static long c_ag_tensor_dtype(void) {
    (void)(ag_tensor_dtype)(NULL);
    return 0;
}
static long c_ag_tensor_ndim(void) {
    return (ag_tensor_ndim)(NULL);
}
static long c_ag_tensor_sizes(void) {
    return ag_tensor_sizes(NULL) == NULL;
}
static long c_ag_tensor_strides(void) {
    return ag_tensor_strides(NULL) == NULL;
}
static long c_ag_tensor_size(void) {
    return (long)(ag_tensor_size)(NULL, 0);
}
static long c_ag_tensor_offset(void) {
    return (long)(ag_tensor_offset)(NULL);
}
static long c_ag_tensor_numel(void) {
    return (long)(ag_tensor_numel)(NULL);
}
static long c_ag_tensor_is_contiguous(void) {
    return (ag_tensor_is_contiguous)(NULL);
}
static long c_ag_tensor_data(void) {
    return ag_tensor_data(NULL) == NULL;
}
static long c_ag_tensor_same_storage(void) {
    return (ag_tensor_same_storage)(NULL, NULL);
}
static long c_ag_tensor_base(void) {
    return ag_tensor_base(NULL) == NULL;
}
static long c_ag_tensor_version(void) {
    return (long)(ag_tensor_version)(NULL);
}
static long c_ag_tensor_bump_version(void) {
    (ag_tensor_bump_version)(NULL);
    return 0;
}
static long c_ag_tensor_item_at(void) {
    return (long)(ag_tensor_item_at)(NULL, 0);
}
static long c_ag_tensor_item(void) {
    return (long)(ag_tensor_item)(NULL);
}
static long c_ag_tensor_to_doubles(void) {
    return (ag_tensor_to_doubles)(NULL, NULL);
}
static long c_ag_tensor_meta_str(void) {
    return ag_tensor_meta_str(NULL, NULL, 0) == NULL;
}
static long c_ag_tensor_print(void) {
    (ag_tensor_print)(NULL, NULL, 0);
    return 0;
}
static long c_ag_tensor_set_requires_grad(void) {
    return (ag_tensor_set_requires_grad)(NULL, false);
}
static long c_ag_tensor_requires_grad(void) {
    return (ag_tensor_requires_grad)(NULL);
}
static long c_ag_tensor_is_leaf(void) {
    return (ag_tensor_is_leaf)(NULL);
}
static long c_ag_tensor_grad(void) {
    return ag_tensor_grad(NULL) == NULL;
}
static long c_ag_tensor_set_grad(void) {
    return (ag_tensor_set_grad)(NULL, NULL);
}
static long c_ag_detach(void) {
    return ag_detach(NULL) == NULL;
}
static long c_ag_rng_get_state(void) {
    (ag_rng_get_state)(NULL, NULL);
    return 0;
}
static long c_ag_load_idx(void) {
    return ag_load_idx(NULL, false, 0) == NULL;
}
static long c_ag_fashion_mnist_load(void) {
    return (ag_fashion_mnist_load)(NULL, false, NULL, NULL);
}
static long c_ag_desc_param(void) {
    return ag_desc_param(NULL) == NULL;
}
static long c_ag_desc_buffer(void) {
    return ag_desc_buffer(NULL) == NULL;
}
static long c_ag_desc_tangent(void) {
    return ag_desc_tangent(NULL) == NULL;
}
static long c_ag_desc_view_base(void) {
    return ag_desc_view_base(NULL) == NULL;
}
static long c_ag_desc_synthetic_base(void) {
    return ag_desc_synthetic_base(NULL) == NULL;
}
static long c_ag_desc_subclass_getattr_input(void) {
    return ag_desc_subclass_getattr_input(NULL, NULL) == NULL;
}
static long c_ag_desc_subclass_size_input(void) {
    return ag_desc_subclass_size_input(NULL, 0) == NULL;
}
static long c_ag_desc_subclass_stride_input(void) {
    return ag_desc_subclass_stride_input(NULL, 0) == NULL;
}
static long c_ag_desc_input_mutation(void) {
    return ag_desc_input_mutation(NULL) == NULL;
}
static long c_ag_desc_intermediate_base(void) {
    return ag_desc_intermediate_base(NULL) == NULL;
}
static long c_ag_desc_grad(void) {
    return ag_desc_grad(NULL) == NULL;
}
static long c_ag_desc_subclass_getattr_output(void) {
    return ag_desc_subclass_getattr_output(NULL, NULL) == NULL;
}
static long c_ag_desc_subclass_size_output(void) {
    return ag_desc_subclass_size_output(NULL, 0) == NULL;
}
static long c_ag_desc_subclass_stride_output(void) {
    return ag_desc_subclass_stride_output(NULL, 0) == NULL;
}
static long c_ag_desc_new(void) {
    return ag_desc_new((ag_desc_kind)0, NULL, NULL, 0) == NULL;
}
static long c_ag_desc_retain(void) {
    return ag_desc_retain(NULL) == NULL;
}
static long c_ag_desc_release(void) {
    (ag_desc_release)(NULL);
    return 0;
}
static long c_ag_desc_kind_of(void) {
    (void)(ag_desc_kind_of)(NULL);
    return 0;
}
static long c_ag_desc_is_input(void) {
    return (ag_desc_is_input)(NULL);
}
static long c_ag_desc_is_output(void) {
    return (ag_desc_is_output)(NULL);
}
static long c_ag_desc_target(void) {
    return ag_desc_target(NULL) == NULL;
}
static long c_ag_desc_attr(void) {
    return ag_desc_attr(NULL) == NULL;
}
static long c_ag_desc_idx(void) {
    return (long)(ag_desc_idx)(NULL);
}
static long c_ag_desc_nested(void) {
    return ag_desc_nested(NULL) == NULL;
}
static long c_ag_desc_depth(void) {
    return (ag_desc_depth)(NULL);
}
static long c_ag_desc_is_param(void) {
    return (ag_desc_is_param)(NULL);
}
static long c_ag_desc_is_buffer(void) {
    return (ag_desc_is_buffer)(NULL);
}
static long c_ag_desc_is_tangent(void) {
    return (ag_desc_is_tangent)(NULL);
}
static long c_ag_desc_is_grad(void) {
    return (ag_desc_is_grad)(NULL);
}
static long c_ag_desc_is_differentiable(void) {
    return (ag_desc_is_differentiable)(NULL);
}
static long c_ag_desc_equal(void) {
    return (ag_desc_equal)(NULL, NULL);
}
static long c_ag_desc_hash(void) {
    return (long)(ag_desc_hash)(NULL);
}
static long c_ag_desc_repr(void) {
    return (long)(ag_desc_repr)(NULL, NULL, 0);
}
static long c_ag_desc_expr(void) {
    return (long)(ag_desc_expr)(NULL, NULL, 0);
}
static long c_ag_desc_parse(void) {
    return ag_desc_parse(NULL, NULL) == NULL;
}
static long c_ag_desc_map_free(void) {
    (ag_desc_map_free)(NULL);
    return 0;
}
static long c_ag_desc_map_put(void) {
    return (ag_desc_map_put)(NULL, NULL, NULL);
}
static long c_ag_desc_map_get(void) {
    return ag_desc_map_get(NULL, NULL) == NULL;
}
static long c_ag_desc_map_find(void) {
    return (long)(ag_desc_map_find)(NULL, NULL);
}
static long c_ag_desc_map_size(void) {
    return (long)(ag_desc_map_size)(NULL);
}
static long c_ag_desc_map_key(void) {
    return ag_desc_map_key(NULL, 0) == NULL;
}
static long c_ag_desc_map_value(void) {
    return ag_desc_map_value(NULL, 0) == NULL;
}
static long c_ag_desc_map_set_value(void) {
    return (ag_desc_map_set_value)(NULL, 0, NULL);
}
static long c_ag_treespec_tuple(void) {
    return ag_treespec_tuple(NULL, 0) == NULL;
}
static long c_ag_treespec_list(void) {
    return ag_treespec_list(NULL, 0) == NULL;
}
static long c_ag_treespec_dict(void) {
    return ag_treespec_dict(NULL, NULL, 0) == NULL;
}
static long c_ag_treespec_retain(void) {
    return ag_treespec_retain(NULL) == NULL;
}
static long c_ag_treespec_release(void) {
    (ag_treespec_release)(NULL);
    return 0;
}
static long c_ag_treespec_kind(void) {
    (void)(ag_treespec_kind)(NULL);
    return 0;
}
static long c_ag_treespec_num_children(void) {
    return (ag_treespec_num_children)(NULL);
}
static long c_ag_treespec_child(void) {
    return ag_treespec_child(NULL, 0) == NULL;
}
static long c_ag_treespec_key(void) {
    return ag_treespec_key(NULL, 0) == NULL;
}
static long c_ag_treespec_num_leaves(void) {
    return (ag_treespec_num_leaves)(NULL);
}
static long c_ag_treespec_equal(void) {
    return (ag_treespec_equal)(NULL, NULL);
}
static long c_ag_treespec_repr(void) {
    return (long)(ag_treespec_repr)(NULL, NULL, 0);
}
static long c_ag_tree_leaf(void) {
    return ag_tree_leaf(NULL) == NULL;
}
static long c_ag_tree_tuple(void) {
    return ag_tree_tuple(NULL, 0) == NULL;
}
static long c_ag_tree_list(void) {
    return ag_tree_list(NULL, 0) == NULL;
}
static long c_ag_tree_dict(void) {
    return ag_tree_dict(NULL, NULL, 0) == NULL;
}
static long c_ag_tree_free(void) {
    (ag_tree_free)(NULL);
    return 0;
}
static long c_ag_tree_kind_of(void) {
    (void)(ag_tree_kind_of)(NULL);
    return 0;
}
static long c_ag_tree_num_children(void) {
    return (ag_tree_num_children)(NULL);
}
static long c_ag_tree_child(void) {
    return ag_tree_child(NULL, 0) == NULL;
}
static long c_ag_tree_key(void) {
    return ag_tree_key(NULL, 0) == NULL;
}
static long c_ag_tree_tensor(void) {
    return ag_tree_tensor(NULL) == NULL;
}
static long c_ag_tree_flatten(void) {
    return (ag_tree_flatten)(NULL, NULL, NULL);
}
static long c_ag_tree_unflatten(void) {
    return ag_tree_unflatten(NULL, NULL, 0) == NULL;
}
static long c_ag_export_joint(void) {
    return ag_export_joint(NULL, NULL, 0, NULL, NULL, 0, NULL) == NULL;
}
static long c_ag_joint_free(void) {
    (ag_joint_free)(NULL);
    return 0;
}
static long c_ag_joint_graph(void) {
    return ag_joint_graph(NULL) == NULL;
}
static long c_ag_set_error(void) {
    return ag_set_error(AG_EINVAL, NULL) == AG_EINVAL ? 0 : 1;
}
static long c_ag_subclass_type_register(void) {
    return (ag_subclass_type_register)(NULL);
}
static long c_ag_subclass_type_find(void) {
    return ag_subclass_type_find(NULL) == NULL;
}
static long c_ag_set_allocator(void) {
    ag_set_allocator(NULL); /* the default again */
    return 0;
}
static long c_ag_free(void) {
    ag_free(NULL);
    return 0;
}
static long c_ag_joint_update(void) {
    return (ag_joint_update)(NULL, NULL);
}
static long c_ag_joint_layout(void) {
    return ag_joint_layout(NULL) == NULL;
}
static long c_ag_graph_layout(void) {
    return (ag_graph_layout)(NULL, 0, NULL);
}
static long c_ag_layout_count(void) {
    return ag_layout_count(NULL, AG_SEC_IN_PRIMALS);
}
static long c_ag_layout_start(void) {
    return ag_layout_start(NULL, AG_SEC_IN_PRIMALS);
}
static long c_ag_layout_num_fw_outputs(void) {
    return ag_layout_num_fw_outputs(NULL);
}
static long c_ag_desc_section(void) {
    return ag_desc_section(NULL);
}
static long c_ag_compiler_plan(void) {
    return (ag_compiler_plan)(NULL, NULL, NULL);
}
static long c_ag_compiler_interpreter(void) {
    return (ag_compiler_interpreter)(NULL, NULL, NULL);
}
static long c_ag_joint_set_graph(void) {
    return (ag_joint_set_graph)(NULL, NULL);
}
static long c_ag_joint_save(void) {
    return (ag_joint_save)(NULL, NULL, NULL);
}
static long c_ag_joint_save_file(void) {
    return (ag_joint_save_file)(NULL, NULL);
}
static long c_ag_joint_load(void) {
    return ag_joint_load(NULL, 0) == NULL;
}
static long c_ag_joint_load_file(void) {
    return ag_joint_load_file(NULL) == NULL;
}
static long c_ag_joint_hash(void) {
    return (ag_joint_hash)(NULL, NULL);
}
static long c_ag_joint_num_params(void) {
    return (ag_joint_num_params)(NULL);
}
static long c_ag_joint_param_fqn(void) {
    return ag_joint_param_fqn(NULL, 0) == NULL;
}
static long c_ag_joint_num_buffers(void) {
    return (ag_joint_num_buffers)(NULL);
}
static long c_ag_joint_buffer_fqn(void) {
    return ag_joint_buffer_fqn(NULL, 0) == NULL;
}
static long c_ag_joint_in_spec(void) {
    return ag_joint_in_spec(NULL) == NULL;
}
static long c_ag_joint_out_spec(void) {
    return ag_joint_out_spec(NULL) == NULL;
}
static long c_ag_joint_num_static_inputs(void) {
    return (ag_joint_num_static_inputs)(NULL);
}
static long c_ag_joint_static_input(void) {
    return (ag_joint_static_input)(NULL, 0);
}
static long c_ag_joint_num_primals(void) {
    return (ag_joint_num_primals)(NULL);
}
static long c_ag_joint_num_tangents(void) {
    return (ag_joint_num_tangents)(NULL);
}
static long c_ag_joint_input_info(void) {
    return ag_joint_input_info(NULL, 0) == NULL;
}
static long c_ag_joint_num_user_outputs(void) {
    return (ag_joint_num_user_outputs)(NULL);
}
static long c_ag_joint_output_info(void) {
    return ag_joint_output_info(NULL, 0) == NULL;
}
static long c_ag_joint_num_mutated_inputs(void) {
    return (ag_joint_num_mutated_inputs)(NULL);
}
static long c_ag_joint_num_metadata_mutations(void) {
    return (ag_joint_num_metadata_mutations)(NULL);
}
static long c_ag_joint_num_intermediate_bases(void) {
    return (ag_joint_num_intermediate_bases)(NULL);
}
static long c_ag_joint_num_fw_outputs(void) {
    return (ag_joint_num_fw_outputs)(NULL);
}
static long c_ag_joint_num_forward_tokens(void) {
    return (ag_joint_num_forward_tokens)(NULL);
}
static long c_ag_joint_num_backward_tokens(void) {
    return (ag_joint_num_backward_tokens)(NULL);
}
static long c_ag_joint_needs_autograd(void) {
    return (ag_joint_needs_autograd)(NULL);
}
static long c_ag_joint_num_flat_inputs(void) {
    return (ag_joint_num_flat_inputs)(NULL);
}
static long c_ag_joint_flat_input_primal(void) {
    return (ag_joint_flat_input_primal)(NULL, 0);
}
static long c_ag_joint_flat_input_desc(void) {
    return ag_joint_flat_input_desc(NULL, 0) == NULL;
}
static long c_ag_joint_primals_from_flat(void) {
    return (ag_joint_primals_from_flat)(NULL, NULL, 0, NULL, 0);
}
static long c_ag_fx_pairs_free(void) {
    (ag_fx_pairs_free)(NULL);
    return 0;
}
static long c_ag_fx_pairs_count(void) {
    return (ag_fx_pairs_count)(NULL);
}
static long c_ag_fx_pairs_desc(void) {
    return ag_fx_pairs_desc(NULL, 0) == NULL;
}
static long c_ag_fx_pairs_first(void) {
    return ag_fx_pairs_first(NULL, 0) == NULL;
}
static long c_ag_fx_pairs_second(void) {
    return ag_fx_pairs_second(NULL, 0) == NULL;
}
static long c_ag_fx_pairs_find(void) {
    return (ag_fx_pairs_find)(NULL, NULL);
}
static long c_ag_fx_all_input_and_grad_nodes(void) {
    return ag_fx_all_input_and_grad_nodes(NULL) == NULL;
}
static long c_ag_fx_all_output_and_tangent_nodes(void) {
    return ag_fx_all_output_and_tangent_nodes(NULL) == NULL;
}
static long c_ag_fx_param_and_grad_nodes(void) {
    return ag_fx_param_and_grad_nodes(NULL) == NULL;
}
static long c_ag_fx_plain_input_and_grad_nodes(void) {
    return ag_fx_plain_input_and_grad_nodes(NULL) == NULL;
}
static long c_ag_fx_plain_output_and_tangent_nodes(void) {
    return ag_fx_plain_output_and_tangent_nodes(NULL) == NULL;
}
static long c_ag_fx_named_free(void) {
    (ag_fx_named_free)(NULL);
    return 0;
}
static long c_ag_fx_named_count(void) {
    return (ag_fx_named_count)(NULL);
}
static long c_ag_fx_named_name(void) {
    return ag_fx_named_name(NULL, 0) == NULL;
}
static long c_ag_fx_named_node(void) {
    return ag_fx_named_node(NULL, 0) == NULL;
}
static long c_ag_fx_named_get(void) {
    return ag_fx_named_get(NULL, NULL) == NULL;
}
static long c_ag_fx_named_param_nodes(void) {
    return ag_fx_named_param_nodes(NULL) == NULL;
}
static long c_ag_fx_named_buffer_nodes(void) {
    return ag_fx_named_buffer_nodes(NULL) == NULL;
}
static long c_ag_fx_param_nodes(void) {
    return (ag_fx_param_nodes)(NULL, NULL, 0);
}
static long c_ag_fx_buffer_nodes(void) {
    return (ag_fx_buffer_nodes)(NULL, NULL, 0);
}
static long c_ag_graph_free(void) {
    (ag_graph_free)(NULL);
    return 0;
}
static long c_ag_graph_copy(void) {
    return ag_graph_copy(NULL) == NULL;
}
static long c_ag_graph_num_nodes(void) {
    return (ag_graph_num_nodes)(NULL);
}
static long c_ag_graph_first(void) {
    return ag_graph_first(NULL) == NULL;
}
static long c_ag_graph_last(void) {
    return ag_graph_last(NULL) == NULL;
}
static long c_ag_node_next(void) {
    return ag_node_next(NULL) == NULL;
}
static long c_ag_node_prev(void) {
    return ag_node_prev(NULL) == NULL;
}
static long c_ag_graph_output_node(void) {
    return ag_graph_output_node(NULL) == NULL;
}
static long c_ag_graph_find(void) {
    return ag_graph_find(NULL, NULL) == NULL;
}
static long c_ag_graph_placeholders(void) {
    return (ag_graph_placeholders)(NULL, NULL);
}
static long c_ag_graph_insert_before(void) {
    (ag_graph_insert_before)(NULL, NULL);
    return 0;
}
static long c_ag_graph_insert_after(void) {
    (ag_graph_insert_after)(NULL, NULL);
    return 0;
}
static long c_ag_graph_insert_at_end(void) {
    (ag_graph_insert_at_end)(NULL);
    return 0;
}
static long c_ag_graph_placeholder(void) {
    return ag_graph_placeholder(NULL, NULL, NULL) == NULL;
}
static long c_ag_graph_call(void) {
    return ag_graph_call(NULL, NULL, NULL, 0, NULL) == NULL;
}
static long c_ag_graph_getitem(void) {
    return ag_graph_getitem(NULL, NULL, 0, NULL) == NULL;
}
static long c_ag_graph_get_attr(void) {
    return ag_graph_get_attr(NULL, NULL, NULL) == NULL;
}
static long c_ag_graph_get_attr_subgraph(void) {
    return ag_graph_get_attr_subgraph(NULL, NULL, NULL) == NULL;
}
static long c_ag_node_subgraph(void) {
    return ag_node_subgraph(NULL) == NULL;
}
static long c_ag_graph_add_subgraph(void) {
    return (ag_graph_add_subgraph)(NULL, NULL, NULL);
}
static long c_ag_graph_subgraph(void) {
    return ag_graph_subgraph(NULL, NULL) == NULL;
}
static long c_ag_graph_num_subgraphs(void) {
    return (ag_graph_num_subgraphs)(NULL);
}
static long c_ag_graph_subgraph_at(void) {
    return ag_graph_subgraph_at(NULL, 0, NULL) == NULL;
}
static long c_ag_graph_invoke_subgraph(void) {
    return ag_graph_invoke_subgraph(NULL, NULL, NULL, NULL, 0, NULL) == NULL;
}
static long c_ag_graph_inline_subgraphs(void) {
    return ag_graph_inline_subgraphs(NULL) == NULL;
}
static long c_ag_graph_output(void) {
    return ag_graph_output(NULL, NULL, 0) == NULL;
}
static long c_ag_node_replace_all_uses(void) {
    return (ag_node_replace_all_uses)(NULL, NULL);
}
static long c_ag_node_set_arg(void) {
    return (ag_node_set_arg)(NULL, 0, (ag_garg){0});
}
static long c_ag_graph_erase(void) {
    return (ag_graph_erase)(NULL, NULL);
}
static long c_ag_graph_move_before(void) {
    return (ag_graph_move_before)(NULL, NULL, NULL);
}
static long c_ag_graph_move_after(void) {
    return (ag_graph_move_after)(NULL, NULL, NULL);
}
static long c_ag_node_rename(void) {
    return (ag_node_rename)(NULL, NULL, NULL);
}
static long c_ag_node_kind_of(void) {
    (void)(ag_node_kind_of)(NULL);
    return 0;
}
static long c_ag_node_name(void) {
    return ag_node_name(NULL) == NULL;
}
static long c_ag_node_op(void) {
    return ag_node_op(NULL) == NULL;
}
static long c_ag_node_nargs(void) {
    return (ag_node_nargs)(NULL);
}
static long c_ag_node_arg(void) {
    return ag_node_arg(NULL, 0) == NULL;
}
static long c_ag_node_arg_node(void) {
    return ag_node_arg_node(NULL, 0) == NULL;
}
static long c_ag_garg_num_refs(void) {
    return (ag_garg_num_refs)(NULL);
}
static long c_ag_garg_ref(void) {
    return ag_garg_ref(NULL, 0) == NULL;
}
static long c_ag_node_num_users(void) {
    return (ag_node_num_users)(NULL);
}
static long c_ag_node_user(void) {
    return ag_node_user(NULL, 0) == NULL;
}
static long c_ag_node_num_vals(void) {
    return (ag_node_num_vals)(NULL);
}
static long c_ag_node_val(void) {
    return ag_node_val(NULL, 0) == NULL;
}
static long c_ag_node_set_val(void) {
    return (ag_node_set_val)(NULL, 0, NULL);
}
static long c_ag_node_constant(void) {
    return ag_node_constant(NULL) == NULL;
}
static long c_ag_node_index(void) {
    return (ag_node_index)(NULL);
}
static long c_ag_node_meta_set(void) {
    return (ag_node_meta_set)(NULL, NULL, (ag_mval){0});
}
static long c_ag_node_meta_get(void) {
    (void)(ag_node_meta_get)(NULL, NULL);
    return 0;
}
static long c_ag_node_meta_del(void) {
    return (ag_node_meta_del)(NULL, NULL);
}
static long c_ag_node_meta_count(void) {
    return (ag_node_meta_count)(NULL);
}
static long c_ag_node_meta_key_at(void) {
    return ag_node_meta_key_at(NULL, 0, NULL) == NULL;
}
static long c_ag_node_seq_nr(void) {
    return (long)(ag_node_seq_nr)(NULL);
}
static long c_ag_node_set_seq_nr(void) {
    return (ag_node_set_seq_nr)(NULL, 0);
}
static long c_ag_node_stack_trace(void) {
    return ag_node_stack_trace(NULL) == NULL;
}
static long c_ag_node_set_stack_trace(void) {
    return (ag_node_set_stack_trace)(NULL, NULL);
}
static long c_ag_node_partitioner_tag(void) {
    return ag_node_partitioner_tag(NULL) == NULL;
}
static long c_ag_node_set_partitioner_tag(void) {
    return (ag_node_set_partitioner_tag)(NULL, NULL);
}
static long c_ag_node_is_gradient_acc(void) {
    return (ag_node_is_gradient_acc)(NULL);
}
static long c_ag_node_set_gradient_acc(void) {
    return (ag_node_set_gradient_acc)(NULL, false);
}
static long c_ag_node_recompute(void) {
    (void)(ag_node_recompute)(NULL);
    return 0;
}
static long c_ag_node_set_recompute(void) {
    return (ag_node_set_recompute)(NULL, (ag_recompute)0);
}
static long c_ag_node_custom_set(void) {
    return (ag_node_custom_set)(NULL, NULL, (ag_mval){0});
}
static long c_ag_node_custom_get(void) {
    (void)(ag_node_custom_get)(NULL, NULL);
    return 0;
}
static long c_ag_node_custom_count(void) {
    return (ag_node_custom_count)(NULL);
}
static long c_ag_node_custom_key_at(void) {
    return ag_node_custom_key_at(NULL, 0, NULL) == NULL;
}
static long c_ag_node_custom_clear(void) {
    (ag_node_custom_clear)(NULL);
    return 0;
}
static long c_ag_node_custom_copy(void) {
    return (ag_node_custom_copy)(NULL, NULL);
}
static long c_ag_node_nn_module_stack_len(void) {
    return (ag_node_nn_module_stack_len)(NULL);
}
static long c_ag_node_nn_module_stack(void) {
    return (ag_node_nn_module_stack)(NULL, 0, NULL, NULL, NULL);
}
static long c_ag_node_set_nn_module_stack(void) {
    return (ag_node_set_nn_module_stack)(NULL, NULL, 0);
}
static long c_ag_node_fwd_nn_module_stack_len(void) {
    return (ag_node_fwd_nn_module_stack_len)(NULL);
}
static long c_ag_node_fwd_nn_module_stack(void) {
    return (ag_node_fwd_nn_module_stack)(NULL, 0, NULL, NULL, NULL);
}
static long c_ag_node_set_fwd_nn_module_stack(void) {
    return (ag_node_set_fwd_nn_module_stack)(NULL, NULL, 0);
}
static long c_ag_node_set_desc(void) {
    return (ag_node_set_desc)(NULL, NULL);
}
static long c_ag_node_desc(void) {
    return ag_node_desc(NULL) == NULL;
}
static long c_ag_node_set_output_descs(void) {
    return (ag_node_set_output_descs)(NULL, NULL, 0);
}
static long c_ag_node_output_desc(void) {
    return ag_node_output_desc(NULL, 0) == NULL;
}
static long c_ag_node_has_output_descs(void) {
    return (ag_node_has_output_descs)(NULL);
}
static long c_ag_graph_verify(void) {
    return (ag_graph_verify)(NULL);
}
static long c_ag_graph_dce(void) {
    return (ag_graph_dce)(NULL);
}
static long c_ag_graph_cse(void) {
    return (ag_graph_cse)(NULL);
}
static long c_ag_graph_reinfer_meta(void) {
    return (ag_graph_reinfer_meta)(NULL);
}
static long c_ag_decomp_table_free(void) {
    (ag_decomp_table_free)(NULL);
    return 0;
}
static long c_ag_decomp_table_add(void) {
    return (ag_decomp_table_add)(NULL, NULL, (ag_decomp_fn)0);
}
static long c_ag_graph_decompose(void) {
    return (ag_graph_decompose)(NULL, NULL);
}
static long c_ag_graph_decompose_node(void) {
    return (ag_graph_decompose_node)(NULL, NULL, (ag_decomp_fn)0);
}
static long c_ag_graph_run(void) {
    return (ag_graph_run)(NULL, NULL, 0, NULL, 0);
}
static long c_ag_graph_to_string(void) {
    return ag_graph_to_string(NULL, NULL) == NULL;
}
static long c_ag_graph_print(void) {
    return (ag_graph_print)(NULL, NULL, NULL);
}
static long c_ag_graph_parse(void) {
    return ag_graph_parse(NULL, 0) == NULL;
}
static long c_ag_graph_to_dot(void) {
    return ag_graph_to_dot(NULL, NULL) == NULL;
}
static long c_ag_graph_write_svg(void) {
    return (ag_graph_write_svg)(NULL, NULL, NULL);
}
static long c_ag_module_new(void) {
    return ag_module_new(NULL, (ag_forward_fn)0, NULL, NULL) == NULL;
}
static long c_ag_module_free(void) {
    (ag_module_free)(NULL);
    return 0;
}
static long c_ag_module_register_parameter(void) {
    return (ag_module_register_parameter)(NULL, NULL, NULL);
}
static long c_ag_module_register_buffer(void) {
    return (ag_module_register_buffer)(NULL, NULL, NULL, false);
}
static long c_ag_module_add_child(void) {
    return (ag_module_add_child)(NULL, NULL, NULL);
}
static long c_ag_module_ud(void) {
    return ag_module_ud(NULL) == NULL;
}
static long c_ag_module_type(void) {
    return ag_module_type(NULL) == NULL;
}
static long c_ag_module_param(void) {
    return ag_module_param(NULL, NULL) == NULL;
}
static long c_ag_module_buffer(void) {
    return ag_module_buffer(NULL, NULL) == NULL;
}
static long c_ag_module_child(void) {
    return ag_module_child(NULL, NULL) == NULL;
}
static long c_ag_module_num_children(void) {
    return (ag_module_num_children)(NULL);
}
static long c_ag_module_child_at(void) {
    return ag_module_child_at(NULL, 0, NULL) == NULL;
}
static long c_ag_module_named_parameters(void) {
    return (ag_module_named_parameters)(NULL, false, NULL);
}
static long c_ag_module_named_buffers(void) {
    return (ag_module_named_buffers)(NULL, false, NULL);
}
static long c_ag_named_tensors_free(void) {
    (ag_named_tensors_free)(NULL);
    return 0;
}
static long c_ag_module_num_parameters(void) {
    return (long)(ag_module_num_parameters)(NULL);
}
static long c_ag_module_train(void) {
    (ag_module_train)(NULL, false);
    return 0;
}
static long c_ag_module_set_checkpoint(void) {
    return (ag_module_set_checkpoint)(NULL, false);
}
static long c_ag_module_is_checkpointed(void) {
    return (ag_module_is_checkpointed)(NULL);
}
static long c_ag_checkpoint(void) {
    return (ag_checkpoint)((ag_checkpoint_fn)0, NULL, NULL, 0, NULL, 0);
}
static long c_ag_module_set_compile_region(void) {
    return (ag_module_set_compile_region)(NULL, false);
}
static long c_ag_module_is_compile_region(void) {
    return (ag_module_is_compile_region)(NULL);
}
static long c_ag_nested_compile_region(void) {
    return (ag_nested_compile_region)((ag_region_fn)0, NULL, NULL, 0, NULL, 0);
}
static long c_ag_create_block_mask(void) {
    return ag_create_block_mask(NULL, 0, 0, 0, 0, 0, 0) == NULL;
}
static long c_ag_block_mask_free(void) {
    (ag_block_mask_free)(NULL);
    return 0;
}
static long c_ag_block_mask_tensor(void) {
    return ag_block_mask_tensor(NULL, (ag_block_mask_part)0) == NULL;
}
static long c_ag_block_mask_shape(void) {
    return (ag_block_mask_shape)(NULL, NULL);
}
static long c_ag_trace_score_mod(void) {
    return ag_trace_score_mod(NULL, AG_F32) == NULL;
}
static long c_ag_trace_score_mod_joint(void) {
    return ag_trace_score_mod_joint(NULL, AG_F32) == NULL;
}
static long c_ag_trace_mask_mod(void) {
    return ag_trace_mask_mod(NULL) == NULL;
}
static long c_ag_score_mod_graph(void) {
    return ag_score_mod_graph(NULL, NULL, NULL, NULL, NULL, NULL, NULL, 0) == NULL;
}
static long c_ag_mask_mod_graph(void) {
    return ag_mask_mod_graph(NULL, NULL, NULL, NULL, NULL, NULL, 0) == NULL;
}
static long c_ag_flex_attention(void) {
    return (ag_flex_attention)(NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL);
}
static long c_ag_module_is_training(void) {
    return (ag_module_is_training)(NULL);
}
static long c_ag_module_call(void) {
    return (ag_module_call)(NULL, NULL, 0, NULL, 0);
}
static long c_ag_module_forward(void) {
    return ag_module_forward(NULL, NULL) == NULL;
}
static long c_ag_module_save(void) {
    return (ag_module_save)(NULL, NULL);
}
static long c_ag_module_load(void) {
    return (ag_module_load)(NULL, NULL);
}
static long c_ag_module_add_tensor(void) {
    return (ag_module_add_tensor)(NULL, NULL, false, AG_F32, 0, NULL, AG_INIT_ZEROS, 0, 0);
}
static long c_ag_module_check_io(void) {
    return (ag_module_check_io)(NULL, 0, 0, 0, 0, 0);
}
static long c_ag_module_return1(void) {
    return (ag_module_return1)(NULL, NULL);
}
static long c_ag_module_forward_child(void) {
    return ag_module_forward_child(NULL, NULL, NULL) == NULL;
}
static long c_ag_module_to_dtype(void) {
    return (ag_module_to_dtype)(NULL, AG_F32);
}
static long c_ag_nn_cross_entropy_loss_ex(void) {
    return ag_nn_cross_entropy_loss_ex(NULL, 0, 0, 0) == NULL;
}
static long c_ag_nn_gelu(void) {
    return ag_nn_gelu(NULL) == NULL;
}
static long c_ag_nn_append(void) {
    return (ag_nn_append)(NULL, NULL);
}
static long c_ag_nn_causal_self_attention(void) {
    return ag_nn_causal_self_attention(NULL) == NULL;
}
static long c_ag_nn_gpt2_block(void) {
    return ag_nn_gpt2_block(NULL) == NULL;
}
static long c_ag_nn_gpt2(void) {
    return ag_nn_gpt2(NULL) == NULL;
}
static long c_ag_optim_sgd(void) {
    return ag_optim_sgd(NULL, 0, 0, 0, false) == NULL;
}
static long c_ag_optim_adamw(void) {
    return ag_optim_adamw(NULL, 0, 0, 0, 0, 0) == NULL;
}
static long c_ag_optim_adamw_tensors(void) {
    ag_optim *o = ag_optim_adamw_tensors(NULL, 0, 0, 0, 0, 0, 0); /* an empty list is valid */
    ag_optim_free(o);
    return o == NULL;
}
static long c_ag_shard_local(void) {
    return ag_shard_local(NULL, AG_P_REPLICATE, NULL) == NULL;
}
static long c_ag_shard_full(void) {
    return ag_shard_full(NULL, AG_P_REPLICATE, NULL) == NULL;
}
static long c_ag_tensor_dict_free(void) {
    (ag_tensor_dict_free)(NULL);
    return 0;
}
static long c_ag_tensor_dict_get(void) {
    return ag_tensor_dict_get(NULL, NULL) == NULL;
}
static long c_ag_tensor_dict_meta(void) {
    return ag_tensor_dict_meta(NULL, NULL) == NULL;
}
static long c_ag_safetensors_save(void) {
    return (ag_safetensors_save)(NULL, NULL, NULL, 0, NULL);
}
static long c_ag_safetensors_load(void) {
    return (ag_safetensors_load)(NULL, NULL);
}
static long c_ag_load_report_free(void) {
    (ag_load_report_free)(NULL);
    return 0;
}
static long c_ag_module_load_ex(void) {
    return (ag_module_load_ex)(NULL, NULL, NULL, NULL);
}
static long c_ag_module_load_dict(void) {
    return (ag_module_load_dict)(NULL, NULL, NULL, NULL);
}
static long c_ag_optim_sgd_groups(void) {
    ag_optim *o = ag_optim_sgd_groups(NULL, 0, 0, 0, 0, false); /* no groups is valid */
    ag_optim_free(o);
    return 0;
}
static long c_ag_optim_adamw_groups(void) {
    ag_optim *o = ag_optim_adamw_groups(NULL, 0, 0, 0, 0, 0, 0); /* no groups is valid */
    ag_optim_free(o);
    return 0;
}
static long c_ag_module_decay_split(void) {
    return (ag_module_decay_split)(NULL, NULL, NULL);
}
static long c_ag_optim_num_groups(void) {
    return (ag_optim_num_groups)(NULL);
}
static long c_ag_optim_group_lr(void) {
    return (long)(ag_optim_group_lr)(NULL, 0) != 0;
}
static long c_ag_optim_set_group_lr(void) {
    return (ag_optim_set_group_lr)(NULL, 0, 0);
}
static long c_ag_clip_grad_norm(void) {
    return (ag_clip_grad_norm)(NULL, 0, 0, NULL); /* an empty list is valid */
}
static long c_ag_optim_clip_grad_norm(void) {
    return (ag_optim_clip_grad_norm)(NULL, 0, NULL);
}
static long c_ag_lr_at(void) {
    return isnan((ag_lr_at)(NULL, 0)) ? 0 : 1;
}
static long c_ag_optim_save(void) {
    return (ag_optim_save)(NULL, NULL);
}
static long c_ag_optim_load(void) {
    return (ag_optim_load)(NULL, NULL);
}
static long c_ag_optim_step(void) {
    return (ag_optim_step)(NULL);
}
static long c_ag_optim_zero_grad(void) {
    (ag_optim_zero_grad)(NULL);
    return 0;
}
static long c_ag_optim_set_lr(void) {
    (ag_optim_set_lr)(NULL, 0);
    return 0;
}
static long c_ag_optim_free(void) {
    (ag_optim_free)(NULL);
    return 0;
}
static long c_ag_add(void) {
    return ag_add(NULL, NULL) == NULL;
}
static long c_ag_add_alpha(void) {
    return ag_add_alpha(NULL, NULL, 0) == NULL;
}
static long c_ag_sub(void) {
    return ag_sub(NULL, NULL) == NULL;
}
static long c_ag_mul(void) {
    return ag_mul(NULL, NULL) == NULL;
}
static long c_ag_div(void) {
    return ag_div(NULL, NULL) == NULL;
}
static long c_ag_add_scalar(void) {
    return ag_add_scalar(NULL, 0) == NULL;
}
static long c_ag_sub_scalar(void) {
    return ag_sub_scalar(NULL, 0) == NULL;
}
static long c_ag_mul_scalar(void) {
    return ag_mul_scalar(NULL, 0) == NULL;
}
static long c_ag_div_scalar(void) {
    return ag_div_scalar(NULL, 0) == NULL;
}
static long c_ag_pow_scalar(void) {
    return ag_pow_scalar(NULL, 0) == NULL;
}
static long c_ag_neg(void) {
    return ag_neg(NULL) == NULL;
}
static long c_ag_exp(void) {
    return ag_exp(NULL) == NULL;
}
static long c_ag_log(void) {
    return ag_log(NULL) == NULL;
}
static long c_ag_sqrt(void) {
    return ag_sqrt(NULL) == NULL;
}
static long c_ag_rsqrt(void) {
    return ag_rsqrt(NULL) == NULL;
}
static long c_ag_abs(void) {
    return ag_abs(NULL) == NULL;
}
static long c_ag_tanh(void) {
    return ag_tanh(NULL) == NULL;
}
static long c_ag_sigmoid(void) {
    return ag_sigmoid(NULL) == NULL;
}
static long c_ag_relu(void) {
    return ag_relu(NULL) == NULL;
}
static long c_ag_gelu(void) {
    return ag_gelu(NULL, NULL) == NULL;
}
static long c_ag_silu(void) {
    return ag_silu(NULL) == NULL;
}
static long c_ag_sin(void) {
    return ag_sin(NULL) == NULL;
}
static long c_ag_cos(void) {
    return ag_cos(NULL) == NULL;
}
static long c_ag_sign(void) {
    return ag_sign(NULL) == NULL;
}
static long c_ag_clamp(void) {
    return ag_clamp(NULL, 0, 0) == NULL;
}
static long c_ag_where(void) {
    return ag_where(NULL, NULL, NULL) == NULL;
}
static long c_ag_masked_fill(void) {
    return ag_masked_fill(NULL, NULL, 0) == NULL;
}
static long c_ag_eq(void) {
    return ag_eq(NULL, NULL) == NULL;
}
static long c_ag_ne(void) {
    return ag_ne(NULL, NULL) == NULL;
}
static long c_ag_lt(void) {
    return ag_lt(NULL, NULL) == NULL;
}
static long c_ag_le(void) {
    return ag_le(NULL, NULL) == NULL;
}
static long c_ag_gt(void) {
    return ag_gt(NULL, NULL) == NULL;
}
static long c_ag_ge(void) {
    return ag_ge(NULL, NULL) == NULL;
}
static long c_ag_eq_scalar(void) {
    return ag_eq_scalar(NULL, 0) == NULL;
}
static long c_ag_ne_scalar(void) {
    return ag_ne_scalar(NULL, 0) == NULL;
}
static long c_ag_lt_scalar(void) {
    return ag_lt_scalar(NULL, 0) == NULL;
}
static long c_ag_le_scalar(void) {
    return ag_le_scalar(NULL, 0) == NULL;
}
static long c_ag_gt_scalar(void) {
    return ag_gt_scalar(NULL, 0) == NULL;
}
static long c_ag_ge_scalar(void) {
    return ag_ge_scalar(NULL, 0) == NULL;
}
static long c_ag_threshold_backward(void) {
    return ag_threshold_backward(NULL, NULL, 0) == NULL;
}
static long c_ag_sigmoid_backward(void) {
    return ag_sigmoid_backward(NULL, NULL) == NULL;
}
static long c_ag_tanh_backward(void) {
    return ag_tanh_backward(NULL, NULL) == NULL;
}
static long c_ag_gelu_backward(void) {
    return ag_gelu_backward(NULL, NULL, NULL) == NULL;
}
static long c_ag_silu_backward(void) {
    return ag_silu_backward(NULL, NULL) == NULL;
}
static long c_ag_to_dtype(void) {
    return ag_to_dtype(NULL, (ag_dtype)0) == NULL;
}
static long c_ag_clone(void) {
    return ag_clone(NULL) == NULL;
}
static long c_ag_contiguous(void) {
    return ag_contiguous(NULL) == NULL;
}
static long c_ag_view(void) {
    return ag_view(NULL, 0, NULL) == NULL;
}
static long c_ag_reshape(void) {
    return ag_reshape(NULL, 0, NULL) == NULL;
}
static long c_ag_permute(void) {
    return ag_permute(NULL, 0, NULL) == NULL;
}
static long c_ag_transpose(void) {
    return ag_transpose(NULL, 0, 0) == NULL;
}
static long c_ag_t(void) {
    return ag_t(NULL) == NULL;
}
static long c_ag_expand(void) {
    return ag_expand(NULL, 0, NULL) == NULL;
}
static long c_ag_slice(void) {
    return ag_slice(NULL, 0, 0, 0, 0) == NULL;
}
static long c_ag_select(void) {
    return ag_select(NULL, 0, 0) == NULL;
}
static long c_ag_unsqueeze(void) {
    return ag_unsqueeze(NULL, 0) == NULL;
}
static long c_ag_squeeze(void) {
    return ag_squeeze(NULL, 0) == NULL;
}
static long c_ag_squeeze_all(void) {
    return ag_squeeze_all(NULL) == NULL;
}
static long c_ag_as_strided(void) {
    return ag_as_strided(NULL, 0, NULL, NULL, 0) == NULL;
}
static long c_ag_alias(void) {
    return ag_alias(NULL) == NULL;
}
static long c_ag_t_(void) {
    return ag_t_(NULL) == NULL;
}
static long c_ag_transpose_(void) {
    return ag_transpose_(NULL, 0, 0) == NULL;
}
static long c_ag_unsqueeze_(void) {
    return ag_unsqueeze_(NULL, 0) == NULL;
}
static long c_ag_as_strided_(void) {
    return ag_as_strided_(NULL, 0, NULL, NULL, 0) == NULL;
}
static long c_ag_slice_backward(void) {
    return ag_slice_backward(NULL, 0, NULL, 0, 0, 0, 0) == NULL;
}
static long c_ag_select_backward(void) {
    return ag_select_backward(NULL, 0, NULL, 0, 0) == NULL;
}
static long c_ag_sum(void) {
    return ag_sum(NULL, NULL, 0, false) == NULL;
}
static long c_ag_sum_all(void) {
    return ag_sum_all(NULL) == NULL;
}
static long c_ag_mean(void) {
    return ag_mean(NULL, NULL, 0, false) == NULL;
}
static long c_ag_mean_all(void) {
    return ag_mean_all(NULL) == NULL;
}
static long c_ag_amax(void) {
    return ag_amax(NULL, NULL, 0, false) == NULL;
}
static long c_ag_var(void) {
    return ag_var(NULL, NULL, 0, 0, false) == NULL;
}
static long c_ag_logsumexp(void) {
    return ag_logsumexp(NULL, NULL, 0, false) == NULL;
}
static long c_ag_argmax(void) {
    return ag_argmax(NULL, 0, false) == NULL;
}
static long c_ag_argmax_all(void) {
    return ag_argmax_all(NULL) == NULL;
}
static long c_ag_softmax(void) {
    return ag_softmax(NULL, 0) == NULL;
}
static long c_ag_log_softmax(void) {
    return ag_log_softmax(NULL, 0) == NULL;
}
static long c_ag_softmax_backward_data(void) {
    return ag_softmax_backward_data(NULL, NULL, 0, (ag_dtype)0) == NULL;
}
static long c_ag_log_softmax_backward_data(void) {
    return ag_log_softmax_backward_data(NULL, NULL, 0, (ag_dtype)0) == NULL;
}
static long c_ag_mm(void) {
    return ag_mm(NULL, NULL) == NULL;
}
static long c_ag_bmm(void) {
    return ag_bmm(NULL, NULL) == NULL;
}
static long c_ag_addmm(void) {
    return ag_addmm(NULL, NULL, NULL, 0, 0) == NULL;
}
static long c_ag_matmul(void) {
    return ag_matmul(NULL, NULL) == NULL;
}
static long c_ag_linear(void) {
    return ag_linear(NULL, NULL, NULL) == NULL;
}
static long c_ag_conv2d(void) {
    return ag_conv2d(NULL, NULL, NULL, 0, 0, 0, 0) == NULL;
}
static long c_ag_convolution_backward(void) {
    return (ag_convolution_backward)(NULL, NULL, NULL, NULL, 0, 0, 0, 0, 0, NULL);
}
static long c_ag_max_pool2d_with_indices(void) {
    return (ag_max_pool2d_with_indices)(NULL, 0, 0, 0, 0, false, NULL, NULL);
}
static long c_ag_max_pool2d(void) {
    return ag_max_pool2d(NULL, 0, 0, 0) == NULL;
}
static long c_ag_avg_pool2d(void) {
    return ag_avg_pool2d(NULL, 0, 0, 0, false, false) == NULL;
}
static long c_ag_avg_pool2d_ex(void) {
    return ag_avg_pool2d_ex(NULL, 0, 0, 0, false, false, 0) == NULL;
}
static long c_ag_adaptive_avg_pool2d(void) {
    return ag_adaptive_avg_pool2d(NULL, 0) == NULL;
}
static long c_ag_native_layer_norm(void) {
    return (ag_native_layer_norm)(NULL, 0, NULL, NULL, NULL, 0, NULL, NULL, NULL);
}
static long c_ag_layer_norm(void) {
    return ag_layer_norm(NULL, 0, NULL, NULL, NULL, 0) == NULL;
}
static long c_ag_native_batch_norm(void) {
    return (ag_native_batch_norm)(NULL, NULL, NULL, NULL, NULL, false, 0, 0, NULL, NULL, NULL);
}
static long c_ag_embedding(void) {
    return ag_embedding(NULL, NULL) == NULL;
}
static long c_ag_embedding_dense_backward(void) {
    return ag_embedding_dense_backward(NULL, NULL, 0, 0) == NULL;
}
static long c_ag_nll_loss(void) {
    return ag_nll_loss(NULL, NULL, 0, 0) == NULL;
}
static long c_ag_cross_entropy(void) {
    return ag_cross_entropy(NULL, NULL, 0, 0) == NULL;
}
static long c_ag_cross_entropy_loss(void) {
    return ag_cross_entropy_loss(NULL, NULL, NULL, 0, 0, 0) == NULL;
}
static long c_ag_native_dropout(void) {
    return (ag_native_dropout)(NULL, 0, false, NULL, NULL);
}
static long c_ag_dropout(void) {
    return ag_dropout(NULL, 0, false) == NULL;
}
static long c_ag_scaled_dot_product_attention(void) {
    return ag_scaled_dot_product_attention(NULL, NULL, NULL, false, 0) == NULL;
}
static long c_ag_cat(void) {
    return ag_cat(NULL, 0, 0) == NULL;
}
static long c_ag_stack(void) {
    return ag_stack(NULL, 0, 0) == NULL;
}
static long c_ag_split(void) {
    return (ag_split)(NULL, 0, 0, NULL, 0);
}
static long c_ag_index_select(void) {
    return ag_index_select(NULL, 0, NULL) == NULL;
}
static long c_ag_gather(void) {
    return ag_gather(NULL, 0, NULL) == NULL;
}
static long c_ag_index(void) {
    return ag_index(NULL, NULL, 0) == NULL;
}
static long c_ag_index_put(void) {
    return ag_index_put(NULL, NULL, 0, NULL, false) == NULL;
}
static long c_ag_new_empty(void) {
    return ag_new_empty(NULL, 0, NULL) == NULL;
}
static long c_ag_new_zeros(void) {
    return ag_new_zeros(NULL, 0, NULL) == NULL;
}
static long c_ag_index_add(void) {
    return ag_index_add(NULL, 0, NULL, NULL, 0) == NULL;
}
static long c_ag_scatter_add(void) {
    return ag_scatter_add(NULL, 0, NULL, NULL) == NULL;
}
static long c_ag_zeros_like(void) {
    return ag_zeros_like(NULL) == NULL;
}
static long c_ag_ones_like(void) {
    return ag_ones_like(NULL) == NULL;
}
static long c_ag_full_like(void) {
    return ag_full_like(NULL, 0) == NULL;
}
static long c_ag_rand(void) {
    return ag_rand((ag_dtype)0, 0, NULL) == NULL;
}
static long c_ag_randn(void) {
    return ag_randn((ag_dtype)0, 0, NULL) == NULL;
}
static long c_ag_philox_rand(void) {
    return ag_philox_rand(NULL, NULL, (ag_dtype)0, 0, NULL, 0, 0) == NULL;
}
static long c_ag_philox_randn(void) {
    return ag_philox_randn(NULL, NULL, (ag_dtype)0, 0, NULL, 0, 0) == NULL;
}
static long c_ag_add_(void) {
    return ag_add_(NULL, NULL, 0) == NULL;
}
static long c_ag_add_scalar_(void) {
    return ag_add_scalar_(NULL, 0) == NULL;
}
static long c_ag_mul_(void) {
    return ag_mul_(NULL, NULL) == NULL;
}
static long c_ag_mul_scalar_(void) {
    return ag_mul_scalar_(NULL, 0) == NULL;
}
static long c_ag_copy_(void) {
    return ag_copy_(NULL, NULL) == NULL;
}
static long c_ag_zero_(void) {
    return ag_zero_(NULL) == NULL;
}
static long c_ag_fill_(void) {
    return ag_fill_(NULL, 0) == NULL;
}
static long c_ag_index_put_(void) {
    return ag_index_put_(NULL, NULL, 0, NULL, false) == NULL;
}
static long c_ag_uniform_(void) {
    return ag_uniform_(NULL, 0, 0) == NULL;
}
static long c_ag_normal_(void) {
    return ag_normal_(NULL, 0, 0) == NULL;
}
static long c_ag_op_find(void) {
    return ag_op_find(NULL) == NULL;
}
static long c_ag_op_name(void) {
    return ag_op_name(NULL) == NULL;
}
static long c_ag_op_def(void) {
    return ag_op_def(NULL) == NULL;
}
static long c_ag_op_nargs(void) {
    return (ag_op_nargs)(NULL);
}
static long c_ag_op_arg(void) {
    return ag_op_arg(NULL, 0) == NULL;
}
static long c_ag_op_noutputs(void) {
    return (ag_op_noutputs)(NULL);
}
static long c_ag_op_register(void) {
    return ag_op_register(NULL) == NULL;
}
static long c_ag_op_flags_str(void) {
    return ag_op_flags_str(0, NULL, 0) == NULL;
}
static long c_ag_op_with_effects(void) {
    return ag_op_with_effects(NULL) == NULL;
}
static long c_ag_op_with_effects_target(void) {
    return ag_op_with_effects_target(NULL) == NULL;
}
static long c_ag_op_call(void) {
    return (ag_op_call)(NULL, NULL, 0, NULL);
}
static long c_ag_op_call1(void) {
    return ag_op_call1(NULL, NULL, 0) == NULL;
}
static long c_ag_op_cost(void) {
    return (ag_op_cost)(NULL, NULL, 0, NULL);
}
static long c_ag_samples_add(void) {
    (ag_samples_add)(NULL, NULL, NULL, 0);
    return 0;
}
static long c_ag_samples_rand(void) {
    return ag_samples_rand(NULL, 0, NULL, 0, 0) == NULL;
}
static long c_ag_samples_rand_nograd(void) {
    return ag_samples_rand_nograd(NULL, 0, NULL, 0, 0) == NULL;
}
static long c_ag_samples_rand_strided(void) {
    return ag_samples_rand_strided(NULL, 0, NULL, 0, 0) == NULL;
}
static long c_ag_subclass_new(void) {
    return ag_subclass_new(NULL, (ag_dtype)0, 0, NULL, NULL, NULL, NULL) == NULL;
}
static long c_ag_tensor_subclass(void) {
    return ag_tensor_subclass(NULL) == NULL;
}
static long c_ag_subclass_flatten(void) {
    return (ag_subclass_flatten)(NULL, NULL, NULL);
}
static long c_ag_subclass_inner(void) {
    return ag_subclass_inner(NULL, 0) == NULL;
}
static long c_ag_subclass_attr(void) {
    return ag_subclass_attr(NULL, NULL) == NULL;
}
static long c_ag_subclass_unflatten(void) {
    return ag_subclass_unflatten(NULL, NULL, NULL, 0, NULL) == NULL;
}
static long c_ag_subclass_flatten_tensors(void) {
    return (ag_subclass_flatten_tensors)(NULL, 0, NULL, 0);
}
static long c_ag_subclass_call_inner(void) {
    return (ag_subclass_call_inner)(NULL, NULL, 0, NULL, 0, NULL);
}
static long c_ag_two_tensor(void) {
    return ag_two_tensor(NULL, NULL) == NULL;
}
static long c_ag_scaled_int8_quantize(void) {
    return ag_scaled_int8_quantize(NULL) == NULL;
}
static long c_ag_scaled_int8_dequantize(void) {
    return ag_scaled_int8_dequantize(NULL) == NULL;
}
static long c_ag_is_meta(void) {
    return (ag_is_meta)(NULL);
}
static long c_ag_trace(void) {
    return ag_trace((ag_trace_fn)0, NULL, NULL, 0, NULL, NULL, NULL) == NULL;
}
static long c_ag_trace_module(void) {
    return ag_trace_module(NULL, NULL, 0, NULL) == NULL;
}
static long c_ag_annotate_begin(void) {
    (ag_annotate_begin)(NULL, (ag_mval){0});
    return 0;
}
static long c_ag_annotate_fn(void) {
    return (ag_annotate_fn)(NULL, (ag_mval){0}, NULL, NULL, NULL);
}
static long c_ag_site(void) {
    (ag_site)(NULL, 0, NULL);
    return 0;
}
static long c_ag_zoo_build(void) {
    return (ag_zoo_build)(NULL, NULL, NULL, NULL, 0, NULL);
}
static long c_ag_zoo_log_get(void) {
    return (ag_zoo_log_get)(0, NULL);
}
static long c_ag_zoo_build_opts(void) {
    return (ag_zoo_build_opts)(NULL, NULL, NULL, NULL, NULL, 0, NULL);
}

static long c_ag_all_reduce(void) {
    return ag_all_reduce(NULL, NULL, NULL) == NULL;
}
static long c_ag_all_gather_into_tensor(void) {
    return ag_all_gather_into_tensor(NULL, 0, NULL) == NULL;
}
static long c_ag_reduce_scatter_tensor(void) {
    return ag_reduce_scatter_tensor(NULL, NULL, 0, NULL) == NULL;
}
static long c_ag_all_to_all_single(void) {
    return ag_all_to_all_single(NULL, NULL, 0, NULL, 0, NULL) == NULL;
}
static long c_ag_broadcast(void) {
    return ag_broadcast(NULL, 0, NULL) == NULL;
}
static long c_ag_wait_tensor(void) {
    return ag_wait_tensor(NULL) == NULL;
}
static long c_ag_group_rank(void) {
    return ag_group_rank(NULL);
}
static long c_ag_group_size(void) {
    return ag_group_size(NULL);
}
static long c_ag_group_name(void) {
    return ag_group_name(NULL) == NULL;
}
static long c_ag_group_find(void) {
    return ag_group_find(NULL) == NULL;
}
static long c_ag_group_split(void) {
    return ag_group_split(NULL, 0, 0) == NULL;
}
static long c_ag_group_barrier(void) {
    return ag_group_barrier(NULL);
}
static long c_ag_dist_abort(void) {
    /* Ends the process with the code given (0 here), in this child. */
    ag_dist_abort(0, NULL);
}
static long c_ag_comm_stats_get(void) {
    ag_comm_stats_get(NULL);
    return 0;
}
static long c_ag_placement_str(void) {
    return ag_placement_str(AG_P_REPLICATE, NULL, 0) == NULL;
}
static long c_ag_placement_parse(void) {
    return ag_placement_parse(NULL, NULL);
}
static long c_ag_op_shard_rule(void) {
    return ag_op_shard_rule(NULL, NULL);
}
static long c_ag_shard_rule_pointwise(void) {
    return ag_shard_rule_pointwise(NULL);
}
static long c_ag_shard_rule_linear_pointwise(void) {
    return ag_shard_rule_linear_pointwise(NULL);
}
static long c_ag_mesh_world(void) {
    return ag_mesh_world(NULL);
}
static long c_ag_shard_plan_free(void) {
    ag_shard_plan_free(NULL);
    return 0;
}
static long c_ag_shard_plan_set(void) {
    return ag_shard_plan_set(NULL, NULL, AG_P_REPLICATE);
}
static long c_ag_shard_plan_set_param(void) {
    return ag_shard_plan_set_param(NULL, NULL, AG_P_REPLICATE);
}
static long c_ag_shard_plan_set_input(void) {
    return ag_shard_plan_set_input(NULL, 0, AG_P_REPLICATE);
}
static long c_ag_shard_plan_set_output(void) {
    return ag_shard_plan_set_output(NULL, 0, AG_P_REPLICATE);
}
static long c_ag_shard_plan_get(void) {
    return ag_shard_plan_get(NULL, NULL, NULL);
}
static long c_ag_shard_plan_set_bucket_bytes(void) {
    ag_shard_plan_set_bucket_bytes(NULL, 0);
    return 0;
}
static long c_ag_shard_plan_set_no_overlap(void) {
    ag_shard_plan_set_no_overlap(NULL, false);
    return 0;
}
static long c_ag_shard_plan_set_gather_params(void) {
    ag_shard_plan_set_gather_params(NULL, false);
    return 0;
}
static long c_ag_shard_plan_strategy(void) {
    return ag_shard_plan_strategy(NULL) == NULL;
}
static long c_ag_shard_plan_dp(void) {
    return ag_shard_plan_dp(NULL, NULL) == NULL;
}
static long c_ag_shard_plan_fsdp(void) {
    return ag_shard_plan_fsdp(NULL, NULL) == NULL;
}
static long c_ag_shard_plan_tp(void) {
    return ag_shard_plan_tp(NULL, NULL) == NULL;
}
static long c_ag_shard_plan_strategy_new(void) {
    return ag_shard_plan_strategy_new(NULL, NULL, NULL) == NULL;
}
static long c_ag_shard_joint(void) {
    return ag_shard_joint(NULL, NULL, NULL) == NULL;
}
static long c_ag_shard_summary_get(void) {
    return ag_shard_summary_get(NULL, NULL);
}
static long c_ag_node_placement(void) {
    return ag_node_placement(NULL).kind;
}
static long c_ag_comm_model_get(void) {
    ag_comm_model_get(NULL);
    return 0;
}
static long c_ag_comm_model_set(void) {
    return ag_comm_model_set(NULL);
}
static long c_ag_comm_bytes(void) {
    return (long)ag_comm_bytes(NULL, 0, 0);
}
static long c_ag_comm_time(void) {
    return (long)ag_comm_time(NULL, 0, 0);
}

static const row rows[] = {
    {"ag_backward", 'F', 'I', c_ag_backward, NULL},
    {"ag_grad", 'F', 'I', c_ag_grad, NULL},
    {"ag_tensor_seq_nr", 'A', 'O', c_ag_tensor_seq_nr, NULL},
    {"ag_tensor_grad_fn_name", 'A', 'R', c_ag_tensor_grad_fn_name, NULL},
    {"ag_gradcheck", 'F', 'I', c_ag_gradcheck, NULL},
    {"ag_partition", 'F', 'I', c_ag_partition, NULL},
    {"ag_tag_region_recompute", 'F', 'I', c_ag_tag_region_recompute, NULL},
    {"ag_plan_new", 'F', 'R', c_ag_plan_new, NULL},
    {"ag_plan_free", 'A', 'O', c_ag_plan_free, NULL},
    {"ag_plan_run", 'F', 'I', c_ag_plan_run, NULL},
    {"ag_plan_peak_bytes", 'A', 'O', c_ag_plan_peak_bytes, NULL},
    {"ag_plan_output_bytes", 'A', 'O', c_ag_plan_output_bytes, NULL},
    {"ag_compile_joint", 'F', 'R', c_ag_compile_joint, NULL},
    {"ag_compiled_free", 'A', 'O', c_ag_compiled_free, NULL},
    {"ag_compiled_call", 'F', 'I', c_ag_compiled_call, NULL},
    {"ag_compiled_call_module", 'F', 'I', c_ag_compiled_call_module, NULL},
    {"ag_compiled_forward_graph", 'A', 'R', c_ag_compiled_forward_graph, NULL},
    {"ag_compiled_backward_graph", 'A', 'R', c_ag_compiled_backward_graph, NULL},
    {"ag_compiled_stats", 'A', 'R', c_ag_compiled_stats, NULL},
    {"ag_compiled_peak_bytes", 'A', 'O', c_ag_compiled_peak_bytes, NULL},
    {"ag_empty", 'N', 'R', c_ag_empty, NULL},
    {"ag_zeros", 'N', 'R', c_ag_zeros, NULL},
    {"ag_ones", 'N', 'R', c_ag_ones, NULL},
    {"ag_full", 'N', 'R', c_ag_full, NULL},
    {"ag_from_data", 'F', 'R', c_ag_from_data, NULL},
    {"ag_tensor_free", 'A', 'O', c_ag_tensor_free, NULL},
    {"ag_tensor_keep", 'A', 'R', c_ag_tensor_keep, NULL},
    {"ag_tensor_dtype", 'A', 'O', c_ag_tensor_dtype, NULL},
    {"ag_tensor_ndim", 'A', 'I', c_ag_tensor_ndim, NULL},
    {"ag_tensor_sizes", 'A', 'R', c_ag_tensor_sizes, NULL},
    {"ag_tensor_strides", 'A', 'R', c_ag_tensor_strides, NULL},
    {"ag_tensor_size", 'A', 'O', c_ag_tensor_size, NULL},
    {"ag_tensor_offset", 'A', 'O', c_ag_tensor_offset, NULL},
    {"ag_tensor_numel", 'A', 'O', c_ag_tensor_numel, NULL},
    {"ag_tensor_is_contiguous", 'A', 'O', c_ag_tensor_is_contiguous, NULL},
    {"ag_tensor_data", 'A', 'R', c_ag_tensor_data, NULL},
    {"ag_tensor_same_storage", 'A', 'O', c_ag_tensor_same_storage, NULL},
    {"ag_tensor_base", 'A', 'R', c_ag_tensor_base, NULL},
    {"ag_tensor_version", 'A', 'O', c_ag_tensor_version, NULL},
    {"ag_tensor_bump_version", 'F', 'O', c_ag_tensor_bump_version, NULL},
    {"ag_tensor_item_at", 'F', 'O', c_ag_tensor_item_at, NULL},
    {"ag_tensor_item", 'F', 'O', c_ag_tensor_item, NULL},
    {"ag_tensor_to_doubles", 'F', 'I', c_ag_tensor_to_doubles, NULL},
    {"ag_tensor_meta_str", 'F', 'R', c_ag_tensor_meta_str, NULL},
    {"ag_tensor_print", 'A', 'O', c_ag_tensor_print, NULL},
    {"ag_tensor_set_requires_grad", 'F', 'I', c_ag_tensor_set_requires_grad, NULL},
    {"ag_tensor_requires_grad", 'A', 'O', c_ag_tensor_requires_grad, NULL},
    {"ag_tensor_is_leaf", 'A', 'O', c_ag_tensor_is_leaf, NULL},
    {"ag_tensor_grad", 'A', 'R', c_ag_tensor_grad, NULL},
    {"ag_tensor_set_grad", 'F', 'I', c_ag_tensor_set_grad, NULL},
    {"ag_detach", 'F', 'R', c_ag_detach, NULL},
    {"ag_rng_get_state", 'F', 'O', c_ag_rng_get_state, NULL},
    {"ag_load_idx", 'F', 'R', c_ag_load_idx, NULL},
    {"ag_fashion_mnist_load", 'F', 'I', c_ag_fashion_mnist_load, NULL},
    {"ag_desc_param", 'F', 'R', c_ag_desc_param, NULL},
    {"ag_desc_buffer", 'F', 'R', c_ag_desc_buffer, NULL},
    {"ag_desc_tangent", 'F', 'R', c_ag_desc_tangent, NULL},
    {"ag_desc_view_base", 'F', 'R', c_ag_desc_view_base, NULL},
    {"ag_desc_synthetic_base", 'F', 'R', c_ag_desc_synthetic_base, NULL},
    {"ag_desc_subclass_getattr_input", 'F', 'R', c_ag_desc_subclass_getattr_input, NULL},
    {"ag_desc_subclass_size_input", 'F', 'R', c_ag_desc_subclass_size_input, NULL},
    {"ag_desc_subclass_stride_input", 'F', 'R', c_ag_desc_subclass_stride_input, NULL},
    {"ag_desc_input_mutation", 'F', 'R', c_ag_desc_input_mutation, NULL},
    {"ag_desc_intermediate_base", 'F', 'R', c_ag_desc_intermediate_base, NULL},
    {"ag_desc_grad", 'F', 'R', c_ag_desc_grad, NULL},
    {"ag_desc_subclass_getattr_output", 'F', 'R', c_ag_desc_subclass_getattr_output, NULL},
    {"ag_desc_subclass_size_output", 'F', 'R', c_ag_desc_subclass_size_output, NULL},
    {"ag_desc_subclass_stride_output", 'F', 'R', c_ag_desc_subclass_stride_output, NULL},
    {"ag_desc_new", 'F', 'R', c_ag_desc_new, NULL},
    {"ag_desc_retain", 'A', 'R', c_ag_desc_retain, NULL},
    {"ag_desc_release", 'A', 'O', c_ag_desc_release, NULL},
    {"ag_desc_kind_of", 'A', 'O', c_ag_desc_kind_of, NULL},
    {"ag_desc_is_input", 'A', 'O', c_ag_desc_is_input, NULL},
    {"ag_desc_is_output", 'A', 'O', c_ag_desc_is_output, NULL},
    {"ag_desc_target", 'A', 'R', c_ag_desc_target, NULL},
    {"ag_desc_attr", 'A', 'R', c_ag_desc_attr, NULL},
    {"ag_desc_idx", 'A', 'O', c_ag_desc_idx, NULL},
    {"ag_desc_nested", 'A', 'R', c_ag_desc_nested, NULL},
    {"ag_desc_depth", 'A', 'I', c_ag_desc_depth, NULL},
    {"ag_desc_is_param", 'A', 'O', c_ag_desc_is_param, NULL},
    {"ag_desc_is_buffer", 'A', 'O', c_ag_desc_is_buffer, NULL},
    {"ag_desc_is_tangent", 'A', 'O', c_ag_desc_is_tangent, NULL},
    {"ag_desc_is_grad", 'A', 'O', c_ag_desc_is_grad, NULL},
    {"ag_desc_is_differentiable", 'A', 'O', c_ag_desc_is_differentiable, NULL},
    {"ag_desc_equal", 'A', 'O', c_ag_desc_equal, NULL},
    {"ag_desc_hash", 'A', 'O', c_ag_desc_hash, NULL},
    {"ag_desc_repr", 'A', 'O', c_ag_desc_repr, NULL},
    {"ag_desc_expr", 'A', 'O', c_ag_desc_expr, NULL},
    {"ag_desc_parse", 'F', 'R', c_ag_desc_parse, NULL},
    {"ag_desc_map_free", 'A', 'O', c_ag_desc_map_free, NULL},
    {"ag_desc_map_put", 'F', 'I', c_ag_desc_map_put, NULL},
    {"ag_desc_map_get", 'A', 'R', c_ag_desc_map_get, NULL},
    {"ag_desc_map_find", 'A', 'O', c_ag_desc_map_find, NULL},
    {"ag_desc_map_size", 'A', 'O', c_ag_desc_map_size, NULL},
    {"ag_desc_map_key", 'A', 'R', c_ag_desc_map_key, NULL},
    {"ag_desc_map_value", 'A', 'R', c_ag_desc_map_value, NULL},
    {"ag_desc_map_set_value", 'F', 'I', c_ag_desc_map_set_value, NULL},
    {"ag_treespec_tuple", 'N', 'R', c_ag_treespec_tuple, NULL},
    {"ag_treespec_list", 'N', 'R', c_ag_treespec_list, NULL},
    {"ag_treespec_dict", 'N', 'R', c_ag_treespec_dict, NULL},
    {"ag_treespec_retain", 'A', 'R', c_ag_treespec_retain, NULL},
    {"ag_treespec_release", 'A', 'O', c_ag_treespec_release, NULL},
    {"ag_treespec_kind", 'A', 'O', c_ag_treespec_kind, NULL},
    {"ag_treespec_num_children", 'A', 'I', c_ag_treespec_num_children, NULL},
    {"ag_treespec_child", 'A', 'R', c_ag_treespec_child, NULL},
    {"ag_treespec_key", 'A', 'R', c_ag_treespec_key, NULL},
    {"ag_treespec_num_leaves", 'A', 'I', c_ag_treespec_num_leaves, NULL},
    {"ag_treespec_equal", 'A', 'O', c_ag_treespec_equal, NULL},
    {"ag_treespec_repr", 'A', 'O', c_ag_treespec_repr, NULL},
    {"ag_tree_leaf", 'F', 'R', c_ag_tree_leaf, NULL},
    {"ag_tree_tuple", 'N', 'R', c_ag_tree_tuple, NULL},
    {"ag_tree_list", 'N', 'R', c_ag_tree_list, NULL},
    {"ag_tree_dict", 'N', 'R', c_ag_tree_dict, NULL},
    {"ag_tree_free", 'A', 'O', c_ag_tree_free, NULL},
    {"ag_tree_kind_of", 'A', 'O', c_ag_tree_kind_of, NULL},
    {"ag_tree_num_children", 'A', 'I', c_ag_tree_num_children, NULL},
    {"ag_tree_child", 'A', 'R', c_ag_tree_child, NULL},
    {"ag_tree_key", 'A', 'R', c_ag_tree_key, NULL},
    {"ag_tree_tensor", 'A', 'R', c_ag_tree_tensor, NULL},
    {"ag_tree_flatten", 'F', 'I', c_ag_tree_flatten, NULL},
    {"ag_tree_unflatten", 'F', 'R', c_ag_tree_unflatten, NULL},
    {"ag_export_joint", 'F', 'R', c_ag_export_joint, NULL},
    {"ag_joint_free", 'A', 'O', c_ag_joint_free, NULL},
    {"ag_joint_graph", 'A', 'R', c_ag_joint_graph, NULL},
    {"ag_set_allocator", 'N', 'O', c_ag_set_allocator, NULL},
    {"ag_subclass_type_register", 'F', 'I', c_ag_subclass_type_register, NULL},
    {"ag_subclass_type_find", 'A', 'R', c_ag_subclass_type_find, NULL},
    {"ag_set_error", 'N', 'O', c_ag_set_error, NULL},
    {"ag_free", 'N', 'O', c_ag_free, NULL},
    {"ag_joint_update", 'F', 'I', c_ag_joint_update, NULL},
    {"ag_joint_layout", 'A', 'R', c_ag_joint_layout, NULL},
    {"ag_graph_layout", 'F', 'I', c_ag_graph_layout, NULL},
    {"ag_layout_count", 'A', 'I', c_ag_layout_count, NULL},
    {"ag_layout_start", 'A', 'I', c_ag_layout_start, NULL},
    {"ag_layout_num_fw_outputs", 'A', 'I', c_ag_layout_num_fw_outputs, NULL},
    {"ag_desc_section", 'N', 'O', c_ag_desc_section, NULL},
    {"ag_compiler_plan", 'F', 'I', c_ag_compiler_plan, NULL},
    {"ag_compiler_interpreter", 'F', 'I', c_ag_compiler_interpreter, NULL},
    {"ag_joint_set_graph", 'F', 'I', c_ag_joint_set_graph, NULL},
    {"ag_joint_save", 'F', 'I', c_ag_joint_save, NULL},
    {"ag_joint_save_file", 'F', 'I', c_ag_joint_save_file, NULL},
    {"ag_joint_load", 'F', 'R', c_ag_joint_load, NULL},
    {"ag_joint_load_file", 'F', 'R', c_ag_joint_load_file, NULL},
    {"ag_joint_hash", 'F', 'I', c_ag_joint_hash, NULL},
    {"ag_joint_num_params", 'A', 'I', c_ag_joint_num_params, NULL},
    {"ag_joint_param_fqn", 'A', 'R', c_ag_joint_param_fqn, NULL},
    {"ag_joint_num_buffers", 'A', 'I', c_ag_joint_num_buffers, NULL},
    {"ag_joint_buffer_fqn", 'A', 'R', c_ag_joint_buffer_fqn, NULL},
    {"ag_joint_in_spec", 'A', 'R', c_ag_joint_in_spec, NULL},
    {"ag_joint_out_spec", 'A', 'R', c_ag_joint_out_spec, NULL},
    {"ag_joint_num_static_inputs", 'A', 'I', c_ag_joint_num_static_inputs, NULL},
    {"ag_joint_static_input", 'A', 'I', c_ag_joint_static_input, NULL},
    {"ag_joint_num_primals", 'A', 'I', c_ag_joint_num_primals, NULL},
    {"ag_joint_num_tangents", 'A', 'I', c_ag_joint_num_tangents, NULL},
    {"ag_joint_input_info", 'A', 'R', c_ag_joint_input_info, NULL},
    {"ag_joint_num_user_outputs", 'A', 'I', c_ag_joint_num_user_outputs, NULL},
    {"ag_joint_output_info", 'A', 'R', c_ag_joint_output_info, NULL},
    {"ag_joint_num_mutated_inputs", 'A', 'I', c_ag_joint_num_mutated_inputs, NULL},
    {"ag_joint_num_metadata_mutations", 'A', 'I', c_ag_joint_num_metadata_mutations, NULL},
    {"ag_joint_num_intermediate_bases", 'A', 'I', c_ag_joint_num_intermediate_bases, NULL},
    {"ag_joint_num_fw_outputs", 'A', 'I', c_ag_joint_num_fw_outputs, NULL},
    {"ag_joint_num_forward_tokens", 'A', 'I', c_ag_joint_num_forward_tokens, NULL},
    {"ag_joint_num_backward_tokens", 'A', 'I', c_ag_joint_num_backward_tokens, NULL},
    {"ag_joint_needs_autograd", 'A', 'O', c_ag_joint_needs_autograd, NULL},
    {"ag_joint_num_flat_inputs", 'A', 'I', c_ag_joint_num_flat_inputs, NULL},
    {"ag_joint_flat_input_primal", 'A', 'I', c_ag_joint_flat_input_primal, NULL},
    {"ag_joint_flat_input_desc", 'A', 'R', c_ag_joint_flat_input_desc, NULL},
    {"ag_joint_primals_from_flat", 'F', 'I', c_ag_joint_primals_from_flat, NULL},
    {"ag_fx_pairs_free", 'A', 'O', c_ag_fx_pairs_free, NULL},
    {"ag_fx_pairs_count", 'A', 'I', c_ag_fx_pairs_count, NULL},
    {"ag_fx_pairs_desc", 'A', 'R', c_ag_fx_pairs_desc, NULL},
    {"ag_fx_pairs_first", 'A', 'R', c_ag_fx_pairs_first, NULL},
    {"ag_fx_pairs_second", 'A', 'R', c_ag_fx_pairs_second, NULL},
    {"ag_fx_pairs_find", 'A', 'I', c_ag_fx_pairs_find, NULL},
    {"ag_fx_all_input_and_grad_nodes", 'F', 'R', c_ag_fx_all_input_and_grad_nodes, NULL},
    {"ag_fx_all_output_and_tangent_nodes", 'F', 'R', c_ag_fx_all_output_and_tangent_nodes, NULL},
    {"ag_fx_param_and_grad_nodes", 'F', 'R', c_ag_fx_param_and_grad_nodes, NULL},
    {"ag_fx_plain_input_and_grad_nodes", 'F', 'R', c_ag_fx_plain_input_and_grad_nodes, NULL},
    {"ag_fx_plain_output_and_tangent_nodes", 'F', 'R', c_ag_fx_plain_output_and_tangent_nodes,
     NULL},
    {"ag_fx_named_free", 'A', 'O', c_ag_fx_named_free, NULL},
    {"ag_fx_named_count", 'A', 'I', c_ag_fx_named_count, NULL},
    {"ag_fx_named_name", 'A', 'R', c_ag_fx_named_name, NULL},
    {"ag_fx_named_node", 'A', 'R', c_ag_fx_named_node, NULL},
    {"ag_fx_named_get", 'A', 'R', c_ag_fx_named_get, NULL},
    {"ag_fx_named_param_nodes", 'F', 'R', c_ag_fx_named_param_nodes, NULL},
    {"ag_fx_named_buffer_nodes", 'F', 'R', c_ag_fx_named_buffer_nodes, NULL},
    {"ag_fx_param_nodes", 'F', 'I', c_ag_fx_param_nodes, NULL},
    {"ag_fx_buffer_nodes", 'F', 'I', c_ag_fx_buffer_nodes, NULL},
    {"ag_graph_free", 'A', 'O', c_ag_graph_free, NULL},
    {"ag_graph_copy", 'F', 'R', c_ag_graph_copy, NULL},
    {"ag_graph_num_nodes", 'A', 'I', c_ag_graph_num_nodes, NULL},
    {"ag_graph_first", 'A', 'R', c_ag_graph_first, NULL},
    {"ag_graph_last", 'A', 'R', c_ag_graph_last, NULL},
    {"ag_node_next", 'A', 'R', c_ag_node_next, NULL},
    {"ag_node_prev", 'A', 'R', c_ag_node_prev, NULL},
    {"ag_graph_output_node", 'A', 'R', c_ag_graph_output_node, NULL},
    {"ag_graph_find", 'A', 'R', c_ag_graph_find, NULL},
    {"ag_graph_placeholders", 'F', 'I', c_ag_graph_placeholders, NULL},
    {"ag_graph_insert_before", 'F', 'O', c_ag_graph_insert_before, NULL},
    {"ag_graph_insert_after", 'F', 'O', c_ag_graph_insert_after, NULL},
    {"ag_graph_insert_at_end", 'F', 'O', c_ag_graph_insert_at_end, NULL},
    {"ag_graph_placeholder", 'F', 'R', c_ag_graph_placeholder, NULL},
    {"ag_graph_call", 'F', 'R', c_ag_graph_call, NULL},
    {"ag_graph_getitem", 'F', 'R', c_ag_graph_getitem, NULL},
    {"ag_graph_get_attr", 'F', 'R', c_ag_graph_get_attr, NULL},
    {"ag_graph_get_attr_subgraph", 'F', 'R', c_ag_graph_get_attr_subgraph, NULL},
    {"ag_node_subgraph", 'A', 'R', c_ag_node_subgraph, NULL},
    {"ag_graph_add_subgraph", 'F', 'I', c_ag_graph_add_subgraph, NULL},
    {"ag_graph_subgraph", 'A', 'R', c_ag_graph_subgraph, NULL},
    {"ag_graph_num_subgraphs", 'A', 'I', c_ag_graph_num_subgraphs, NULL},
    {"ag_graph_subgraph_at", 'A', 'R', c_ag_graph_subgraph_at, NULL},
    {"ag_graph_invoke_subgraph", 'F', 'R', c_ag_graph_invoke_subgraph, NULL},
    {"ag_graph_inline_subgraphs", 'F', 'R', c_ag_graph_inline_subgraphs, NULL},
    {"ag_graph_output", 'F', 'R', c_ag_graph_output, NULL},
    {"ag_node_replace_all_uses", 'F', 'I', c_ag_node_replace_all_uses, NULL},
    {"ag_node_set_arg", 'F', 'I', c_ag_node_set_arg, NULL},
    {"ag_graph_erase", 'F', 'I', c_ag_graph_erase, NULL},
    {"ag_graph_move_before", 'F', 'I', c_ag_graph_move_before, NULL},
    {"ag_graph_move_after", 'F', 'I', c_ag_graph_move_after, NULL},
    {"ag_node_rename", 'F', 'I', c_ag_node_rename, NULL},
    {"ag_node_kind_of", 'A', 'O', c_ag_node_kind_of, NULL},
    {"ag_node_name", 'A', 'R', c_ag_node_name, NULL},
    {"ag_node_op", 'A', 'R', c_ag_node_op, NULL},
    {"ag_node_nargs", 'A', 'I', c_ag_node_nargs, NULL},
    {"ag_node_arg", 'A', 'R', c_ag_node_arg, NULL},
    {"ag_node_arg_node", 'A', 'R', c_ag_node_arg_node, NULL},
    {"ag_garg_num_refs", 'A', 'I', c_ag_garg_num_refs, NULL},
    {"ag_garg_ref", 'A', 'R', c_ag_garg_ref, NULL},
    {"ag_node_num_users", 'A', 'I', c_ag_node_num_users, NULL},
    {"ag_node_user", 'A', 'R', c_ag_node_user, NULL},
    {"ag_node_num_vals", 'A', 'I', c_ag_node_num_vals, NULL},
    {"ag_node_val", 'A', 'R', c_ag_node_val, NULL},
    {"ag_node_set_val", 'F', 'I', c_ag_node_set_val, NULL},
    {"ag_node_constant", 'A', 'R', c_ag_node_constant, NULL},
    {"ag_node_index", 'A', 'I', c_ag_node_index, NULL},
    {"ag_node_meta_set", 'F', 'I', c_ag_node_meta_set, NULL},
    {"ag_node_meta_get", 'A', 'O', c_ag_node_meta_get, NULL},
    {"ag_node_meta_del", 'F', 'I', c_ag_node_meta_del, NULL},
    {"ag_node_meta_count", 'A', 'I', c_ag_node_meta_count, NULL},
    {"ag_node_meta_key_at", 'A', 'R', c_ag_node_meta_key_at, NULL},
    {"ag_node_seq_nr", 'A', 'O', c_ag_node_seq_nr, NULL},
    {"ag_node_set_seq_nr", 'F', 'I', c_ag_node_set_seq_nr, NULL},
    {"ag_node_stack_trace", 'A', 'R', c_ag_node_stack_trace, NULL},
    {"ag_node_set_stack_trace", 'F', 'I', c_ag_node_set_stack_trace, NULL},
    {"ag_node_partitioner_tag", 'A', 'R', c_ag_node_partitioner_tag, NULL},
    {"ag_node_set_partitioner_tag", 'F', 'I', c_ag_node_set_partitioner_tag, NULL},
    {"ag_node_is_gradient_acc", 'A', 'O', c_ag_node_is_gradient_acc, NULL},
    {"ag_node_set_gradient_acc", 'F', 'I', c_ag_node_set_gradient_acc, NULL},
    {"ag_node_recompute", 'A', 'O', c_ag_node_recompute, NULL},
    {"ag_node_set_recompute", 'F', 'I', c_ag_node_set_recompute, NULL},
    {"ag_node_custom_set", 'F', 'I', c_ag_node_custom_set, NULL},
    {"ag_node_custom_get", 'A', 'O', c_ag_node_custom_get, NULL},
    {"ag_node_custom_count", 'A', 'I', c_ag_node_custom_count, NULL},
    {"ag_node_custom_key_at", 'A', 'R', c_ag_node_custom_key_at, NULL},
    {"ag_node_custom_clear", 'F', 'O', c_ag_node_custom_clear, NULL},
    {"ag_node_custom_copy", 'F', 'I', c_ag_node_custom_copy, NULL},
    {"ag_node_nn_module_stack_len", 'A', 'I', c_ag_node_nn_module_stack_len, NULL},
    {"ag_node_nn_module_stack", 'F', 'I', c_ag_node_nn_module_stack, NULL},
    {"ag_node_set_nn_module_stack", 'F', 'I', c_ag_node_set_nn_module_stack, NULL},
    {"ag_node_fwd_nn_module_stack_len", 'A', 'I', c_ag_node_fwd_nn_module_stack_len, NULL},
    {"ag_node_fwd_nn_module_stack", 'F', 'I', c_ag_node_fwd_nn_module_stack, NULL},
    {"ag_node_set_fwd_nn_module_stack", 'F', 'I', c_ag_node_set_fwd_nn_module_stack, NULL},
    {"ag_node_set_desc", 'F', 'I', c_ag_node_set_desc, NULL},
    {"ag_node_desc", 'A', 'R', c_ag_node_desc, NULL},
    {"ag_node_set_output_descs", 'F', 'I', c_ag_node_set_output_descs, NULL},
    {"ag_node_output_desc", 'A', 'R', c_ag_node_output_desc, NULL},
    {"ag_node_has_output_descs", 'A', 'O', c_ag_node_has_output_descs, NULL},
    {"ag_graph_verify", 'F', 'I', c_ag_graph_verify, NULL},
    {"ag_graph_dce", 'F', 'I', c_ag_graph_dce, NULL},
    {"ag_graph_cse", 'F', 'I', c_ag_graph_cse, NULL},
    {"ag_graph_reinfer_meta", 'F', 'I', c_ag_graph_reinfer_meta, NULL},
    {"ag_decomp_table_free", 'A', 'O', c_ag_decomp_table_free, NULL},
    {"ag_decomp_table_add", 'F', 'I', c_ag_decomp_table_add, NULL},
    {"ag_graph_decompose", 'F', 'I', c_ag_graph_decompose, NULL},
    {"ag_graph_decompose_node", 'F', 'I', c_ag_graph_decompose_node, NULL},
    {"ag_graph_run", 'F', 'I', c_ag_graph_run, NULL},
    {"ag_graph_to_string", 'F', 'R', c_ag_graph_to_string, NULL},
    {"ag_graph_print", 'F', 'I', c_ag_graph_print, NULL},
    {"ag_graph_parse", 'F', 'R', c_ag_graph_parse, NULL},
    {"ag_graph_to_dot", 'F', 'R', c_ag_graph_to_dot, NULL},
    {"ag_graph_write_svg", 'F', 'I', c_ag_graph_write_svg, NULL},
    {"ag_module_new", 'F', 'R', c_ag_module_new, NULL},
    {"ag_module_free", 'A', 'O', c_ag_module_free, NULL},
    {"ag_module_register_parameter", 'F', 'I', c_ag_module_register_parameter, NULL},
    {"ag_module_register_buffer", 'F', 'I', c_ag_module_register_buffer, NULL},
    {"ag_module_add_child", 'F', 'I', c_ag_module_add_child, NULL},
    {"ag_module_ud", 'A', 'R', c_ag_module_ud, NULL},
    {"ag_module_type", 'A', 'R', c_ag_module_type, NULL},
    {"ag_module_param", 'A', 'R', c_ag_module_param, NULL},
    {"ag_module_buffer", 'A', 'R', c_ag_module_buffer, NULL},
    {"ag_module_child", 'A', 'R', c_ag_module_child, NULL},
    {"ag_module_num_children", 'A', 'I', c_ag_module_num_children, NULL},
    {"ag_module_child_at", 'A', 'R', c_ag_module_child_at, NULL},
    {"ag_module_named_parameters", 'F', 'I', c_ag_module_named_parameters, NULL},
    {"ag_module_named_buffers", 'F', 'I', c_ag_module_named_buffers, NULL},
    {"ag_named_tensors_free", 'A', 'O', c_ag_named_tensors_free, NULL},
    {"ag_module_num_parameters", 'F', 'O', c_ag_module_num_parameters, NULL},
    {"ag_module_train", 'A', 'O', c_ag_module_train, NULL},
    {"ag_module_is_training", 'A', 'O', c_ag_module_is_training, NULL},
    {"ag_module_set_checkpoint", 'F', 'I', c_ag_module_set_checkpoint, NULL},
    {"ag_module_is_checkpointed", 'A', 'O', c_ag_module_is_checkpointed, NULL},
    {"ag_checkpoint", 'F', 'I', c_ag_checkpoint, NULL},
    {"ag_module_set_compile_region", 'F', 'I', c_ag_module_set_compile_region, NULL},
    {"ag_module_is_compile_region", 'A', 'O', c_ag_module_is_compile_region, NULL},
    {"ag_nested_compile_region", 'F', 'I', c_ag_nested_compile_region, NULL},
    {"ag_create_block_mask", 'F', 'R', c_ag_create_block_mask, NULL},
    {"ag_block_mask_free", 'A', 'O', c_ag_block_mask_free, NULL},
    {"ag_block_mask_tensor", 'A', 'R', c_ag_block_mask_tensor, NULL},
    {"ag_block_mask_shape", 'F', 'I', c_ag_block_mask_shape, NULL},
    {"ag_flex_attention", 'F', 'I', c_ag_flex_attention, NULL},
    {"ag_trace_score_mod", 'F', 'R', c_ag_trace_score_mod, NULL},
    {"ag_trace_score_mod_joint", 'F', 'R', c_ag_trace_score_mod_joint, NULL},
    {"ag_trace_mask_mod", 'F', 'R', c_ag_trace_mask_mod, NULL},
    {"ag_score_mod_graph", 'F', 'R', c_ag_score_mod_graph, NULL},
    {"ag_mask_mod_graph", 'F', 'R', c_ag_mask_mod_graph, NULL},
    {"ag_module_call", 'F', 'I', c_ag_module_call, NULL},
    {"ag_module_forward", 'F', 'R', c_ag_module_forward, NULL},
    {"ag_module_save", 'F', 'I', c_ag_module_save, NULL},
    {"ag_module_load", 'F', 'I', c_ag_module_load, NULL},
    {"ag_module_add_tensor", 'F', 'I', c_ag_module_add_tensor, NULL},
    {"ag_module_check_io", 'F', 'I', c_ag_module_check_io, NULL},
    {"ag_module_return1", 'F', 'I', c_ag_module_return1, NULL},
    {"ag_module_forward_child", 'F', 'R', c_ag_module_forward_child, NULL},
    {"ag_module_to_dtype", 'F', 'I', c_ag_module_to_dtype, NULL},
    {"ag_nn_cross_entropy_loss_ex", 'N', 'R', c_ag_nn_cross_entropy_loss_ex, NULL},
    {"ag_nn_gelu", 'N', 'R', c_ag_nn_gelu, NULL},
    {"ag_nn_append", 'F', 'I', c_ag_nn_append, NULL},
    {"ag_nn_causal_self_attention", 'F', 'R', c_ag_nn_causal_self_attention, NULL},
    {"ag_nn_gpt2_block", 'F', 'R', c_ag_nn_gpt2_block, NULL},
    {"ag_nn_gpt2", 'F', 'R', c_ag_nn_gpt2, NULL},
    {"ag_optim_sgd", 'F', 'R', c_ag_optim_sgd, NULL},
    {"ag_optim_adamw", 'F', 'R', c_ag_optim_adamw, NULL},
    {"ag_optim_adamw_tensors", 'N', 'R', c_ag_optim_adamw_tensors, NULL},
    {"ag_tensor_dict_free", 'A', 'O', c_ag_tensor_dict_free, NULL},
    {"ag_tensor_dict_get", 'A', 'R', c_ag_tensor_dict_get, NULL},
    {"ag_tensor_dict_meta", 'A', 'R', c_ag_tensor_dict_meta, NULL},
    {"ag_safetensors_save", 'F', 'I', c_ag_safetensors_save, NULL},
    {"ag_safetensors_load", 'F', 'I', c_ag_safetensors_load, NULL},
    {"ag_load_report_free", 'A', 'O', c_ag_load_report_free, NULL},
    {"ag_module_load_ex", 'F', 'I', c_ag_module_load_ex, NULL},
    {"ag_module_load_dict", 'F', 'I', c_ag_module_load_dict, NULL},
    {"ag_optim_sgd_groups", 'N', 'O', c_ag_optim_sgd_groups, NULL},
    {"ag_optim_adamw_groups", 'N', 'O', c_ag_optim_adamw_groups, NULL},
    {"ag_module_decay_split", 'F', 'I', c_ag_module_decay_split, NULL},
    {"ag_optim_num_groups", 'A', 'O', c_ag_optim_num_groups, NULL},
    {"ag_optim_group_lr", 'A', 'O', c_ag_optim_group_lr, NULL},
    {"ag_optim_set_group_lr", 'F', 'I', c_ag_optim_set_group_lr, NULL},
    {"ag_clip_grad_norm", 'N', 'O', c_ag_clip_grad_norm, NULL},
    {"ag_optim_clip_grad_norm", 'F', 'I', c_ag_optim_clip_grad_norm, NULL},
    {"ag_lr_at", 'A', 'O', c_ag_lr_at, NULL},
    {"ag_optim_save", 'F', 'I', c_ag_optim_save, NULL},
    {"ag_optim_load", 'F', 'I', c_ag_optim_load, NULL},
    {"ag_optim_step", 'F', 'I', c_ag_optim_step, NULL},
    {"ag_shard_local", 'F', 'R', c_ag_shard_local, NULL},
    {"ag_shard_full", 'F', 'R', c_ag_shard_full, NULL},
    {"ag_optim_zero_grad", 'A', 'O', c_ag_optim_zero_grad, NULL},
    {"ag_optim_set_lr", 'A', 'O', c_ag_optim_set_lr, NULL},
    {"ag_optim_free", 'A', 'O', c_ag_optim_free, NULL},
    {"ag_add", 'F', 'R', c_ag_add, "add.Tensor"},
    {"ag_add_alpha", 'F', 'R', c_ag_add_alpha, "add.Tensor"},
    {"ag_sub", 'F', 'R', c_ag_sub, "sub.Tensor"},
    {"ag_mul", 'F', 'R', c_ag_mul, "mul.Tensor"},
    {"ag_div", 'F', 'R', c_ag_div, "div.Tensor"},
    {"ag_add_scalar", 'F', 'R', c_ag_add_scalar, "add.Scalar"},
    {"ag_sub_scalar", 'F', 'R', c_ag_sub_scalar, "sub.Scalar"},
    {"ag_mul_scalar", 'F', 'R', c_ag_mul_scalar, "mul.Scalar"},
    {"ag_div_scalar", 'F', 'R', c_ag_div_scalar, "div.Scalar"},
    {"ag_pow_scalar", 'F', 'R', c_ag_pow_scalar, "pow.Tensor_Scalar"},
    {"ag_neg", 'F', 'R', c_ag_neg, NULL},
    {"ag_exp", 'F', 'R', c_ag_exp, NULL},
    {"ag_log", 'F', 'R', c_ag_log, NULL},
    {"ag_sqrt", 'F', 'R', c_ag_sqrt, NULL},
    {"ag_rsqrt", 'F', 'R', c_ag_rsqrt, NULL},
    {"ag_abs", 'F', 'R', c_ag_abs, NULL},
    {"ag_tanh", 'F', 'R', c_ag_tanh, NULL},
    {"ag_sigmoid", 'F', 'R', c_ag_sigmoid, NULL},
    {"ag_relu", 'F', 'R', c_ag_relu, NULL},
    {"ag_gelu", 'F', 'R', c_ag_gelu, NULL},
    {"ag_silu", 'F', 'R', c_ag_silu, NULL},
    {"ag_sin", 'F', 'R', c_ag_sin, NULL},
    {"ag_cos", 'F', 'R', c_ag_cos, NULL},
    {"ag_sign", 'F', 'R', c_ag_sign, NULL},
    {"ag_clamp", 'F', 'R', c_ag_clamp, NULL},
    {"ag_where", 'F', 'R', c_ag_where, "where.self"},
    {"ag_masked_fill", 'F', 'R', c_ag_masked_fill, "masked_fill.Scalar"},
    {"ag_eq", 'F', 'R', c_ag_eq, "eq.Tensor"},
    {"ag_ne", 'F', 'R', c_ag_ne, "ne.Tensor"},
    {"ag_lt", 'F', 'R', c_ag_lt, "lt.Tensor"},
    {"ag_le", 'F', 'R', c_ag_le, "le.Tensor"},
    {"ag_gt", 'F', 'R', c_ag_gt, "gt.Tensor"},
    {"ag_ge", 'F', 'R', c_ag_ge, "ge.Tensor"},
    {"ag_eq_scalar", 'F', 'R', c_ag_eq_scalar, "eq.Scalar"},
    {"ag_ne_scalar", 'F', 'R', c_ag_ne_scalar, "ne.Scalar"},
    {"ag_lt_scalar", 'F', 'R', c_ag_lt_scalar, "lt.Scalar"},
    {"ag_le_scalar", 'F', 'R', c_ag_le_scalar, "le.Scalar"},
    {"ag_gt_scalar", 'F', 'R', c_ag_gt_scalar, "gt.Scalar"},
    {"ag_ge_scalar", 'F', 'R', c_ag_ge_scalar, "ge.Scalar"},
    {"ag_threshold_backward", 'F', 'R', c_ag_threshold_backward, NULL},
    {"ag_sigmoid_backward", 'F', 'R', c_ag_sigmoid_backward, NULL},
    {"ag_tanh_backward", 'F', 'R', c_ag_tanh_backward, NULL},
    {"ag_gelu_backward", 'F', 'R', c_ag_gelu_backward, NULL},
    {"ag_silu_backward", 'F', 'R', c_ag_silu_backward, NULL},
    {"ag_to_dtype", 'F', 'R', c_ag_to_dtype, "_to_copy"},
    {"ag_clone", 'F', 'R', c_ag_clone, NULL},
    {"ag_contiguous", 'F', 'R', c_ag_contiguous, NULL},
    {"ag_view", 'F', 'R', c_ag_view, NULL},
    {"ag_reshape", 'F', 'R', c_ag_reshape, NULL},
    {"ag_permute", 'F', 'R', c_ag_permute, NULL},
    {"ag_transpose", 'F', 'R', c_ag_transpose, "transpose.int"},
    {"ag_t", 'F', 'R', c_ag_t, NULL},
    {"ag_expand", 'F', 'R', c_ag_expand, NULL},
    {"ag_slice", 'F', 'R', c_ag_slice, "slice.Tensor"},
    {"ag_select", 'F', 'R', c_ag_select, "select.int"},
    {"ag_unsqueeze", 'F', 'R', c_ag_unsqueeze, NULL},
    {"ag_squeeze", 'F', 'R', c_ag_squeeze, "squeeze.dim"},
    {"ag_squeeze_all", 'F', 'R', c_ag_squeeze_all, "squeeze"},
    {"ag_as_strided", 'F', 'R', c_ag_as_strided, NULL},
    {"ag_alias", 'F', 'R', c_ag_alias, NULL},
    {"ag_t_", 'F', 'R', c_ag_t_, NULL},
    {"ag_transpose_", 'F', 'R', c_ag_transpose_, NULL},
    {"ag_unsqueeze_", 'F', 'R', c_ag_unsqueeze_, NULL},
    {"ag_as_strided_", 'F', 'R', c_ag_as_strided_, NULL},
    {"ag_slice_backward", 'F', 'R', c_ag_slice_backward, NULL},
    {"ag_select_backward", 'F', 'R', c_ag_select_backward, NULL},
    {"ag_sum", 'F', 'R', c_ag_sum, "sum.dim_IntList"},
    {"ag_sum_all", 'F', 'R', c_ag_sum_all, "sum.dim_IntList"},
    {"ag_mean", 'F', 'R', c_ag_mean, "mean.dim"},
    {"ag_mean_all", 'F', 'R', c_ag_mean_all, "mean.dim"},
    {"ag_amax", 'F', 'R', c_ag_amax, NULL},
    {"ag_var", 'F', 'R', c_ag_var, "var.correction"},
    {"ag_logsumexp", 'F', 'R', c_ag_logsumexp, NULL},
    {"ag_argmax", 'F', 'R', c_ag_argmax, NULL},
    {"ag_argmax_all", 'F', 'R', c_ag_argmax_all, "argmax"},
    {"ag_softmax", 'F', 'R', c_ag_softmax, "_softmax"},
    {"ag_log_softmax", 'F', 'R', c_ag_log_softmax, "_log_softmax"},
    {"ag_softmax_backward_data", 'F', 'R', c_ag_softmax_backward_data, "_softmax_backward_data"},
    {"ag_log_softmax_backward_data", 'F', 'R', c_ag_log_softmax_backward_data,
     "_log_softmax_backward_data"},
    {"ag_mm", 'F', 'R', c_ag_mm, NULL},
    {"ag_bmm", 'F', 'R', c_ag_bmm, NULL},
    {"ag_addmm", 'F', 'R', c_ag_addmm, NULL},
    {"ag_matmul", 'F', 'R', c_ag_matmul, NULL},
    {"ag_linear", 'F', 'R', c_ag_linear, NULL},
    {"ag_conv2d", 'F', 'R', c_ag_conv2d, "convolution"},
    {"ag_convolution_backward", 'F', 'I', c_ag_convolution_backward, NULL},
    {"ag_max_pool2d_with_indices", 'F', 'I', c_ag_max_pool2d_with_indices, NULL},
    {"ag_max_pool2d", 'F', 'R', c_ag_max_pool2d, "max_pool2d_with_indices"},
    {"ag_avg_pool2d", 'F', 'R', c_ag_avg_pool2d, NULL},
    {"ag_avg_pool2d_ex", 'F', 'R', c_ag_avg_pool2d_ex, "avg_pool2d"},
    {"ag_adaptive_avg_pool2d", 'F', 'R', c_ag_adaptive_avg_pool2d, "_adaptive_avg_pool2d"},
    {"ag_native_layer_norm", 'F', 'I', c_ag_native_layer_norm, NULL},
    {"ag_layer_norm", 'F', 'R', c_ag_layer_norm, NULL},
    {"ag_native_batch_norm", 'F', 'I', c_ag_native_batch_norm, NULL},
    {"ag_embedding", 'F', 'R', c_ag_embedding, NULL},
    {"ag_embedding_dense_backward", 'F', 'R', c_ag_embedding_dense_backward, NULL},
    {"ag_nll_loss", 'F', 'R', c_ag_nll_loss, "nll_loss_forward"},
    {"ag_cross_entropy", 'F', 'R', c_ag_cross_entropy, "cross_entropy_loss"},
    {"ag_cross_entropy_loss", 'F', 'R', c_ag_cross_entropy_loss, "cross_entropy_loss"},
    {"ag_native_dropout", 'F', 'I', c_ag_native_dropout, NULL},
    {"ag_dropout", 'F', 'R', c_ag_dropout, NULL},
    {"ag_scaled_dot_product_attention", 'F', 'R', c_ag_scaled_dot_product_attention, NULL},
    {"ag_cat", 'F', 'R', c_ag_cat, NULL},
    {"ag_stack", 'F', 'R', c_ag_stack, NULL},
    {"ag_split", 'F', 'I', c_ag_split, "split.Tensor"},
    {"ag_index_select", 'F', 'R', c_ag_index_select, NULL},
    {"ag_gather", 'F', 'R', c_ag_gather, NULL},
    {"ag_index", 'F', 'R', c_ag_index, "index.Tensor"},
    {"ag_index_put", 'F', 'R', c_ag_index_put, NULL},
    {"ag_new_empty", 'F', 'R', c_ag_new_empty, NULL},
    {"ag_new_zeros", 'F', 'R', c_ag_new_zeros, NULL},
    {"ag_index_add", 'F', 'R', c_ag_index_add, NULL},
    {"ag_scatter_add", 'F', 'R', c_ag_scatter_add, NULL},
    {"ag_zeros_like", 'F', 'R', c_ag_zeros_like, NULL},
    {"ag_ones_like", 'F', 'R', c_ag_ones_like, NULL},
    {"ag_full_like", 'F', 'R', c_ag_full_like, NULL},
    {"ag_rand", 'N', 'R', c_ag_rand, NULL},
    {"ag_randn", 'N', 'R', c_ag_randn, NULL},
    {"ag_philox_rand", 'F', 'R', c_ag_philox_rand, NULL},
    {"ag_philox_randn", 'F', 'R', c_ag_philox_randn, NULL},
    {"ag_all_reduce", 'F', 'R', c_ag_all_reduce, "_c10d_functional::all_reduce"},
    {"ag_all_gather_into_tensor", 'F', 'R', c_ag_all_gather_into_tensor,
     "_c10d_functional::all_gather_into_tensor"},
    {"ag_reduce_scatter_tensor", 'F', 'R', c_ag_reduce_scatter_tensor,
     "_c10d_functional::reduce_scatter_tensor"},
    {"ag_all_to_all_single", 'F', 'R', c_ag_all_to_all_single,
     "_c10d_functional::all_to_all_single"},
    {"ag_broadcast", 'F', 'R', c_ag_broadcast, "_c10d_functional::broadcast"},
    {"ag_wait_tensor", 'F', 'R', c_ag_wait_tensor, "_c10d_functional::wait_tensor"},
    {"ag_group_rank", 'A', 'I', c_ag_group_rank, NULL},
    {"ag_group_size", 'A', 'I', c_ag_group_size, NULL},
    {"ag_group_name", 'A', 'R', c_ag_group_name, NULL},
    {"ag_group_find", 'A', 'R', c_ag_group_find, NULL},
    {"ag_group_split", 'F', 'R', c_ag_group_split, NULL},
    {"ag_group_barrier", 'F', 'I', c_ag_group_barrier, NULL},
    {"ag_dist_abort", 'A', 'O', c_ag_dist_abort, NULL},
    {"ag_comm_stats_get", 'A', 'O', c_ag_comm_stats_get, NULL},
    {"ag_comm_model_get", 'A', 'O', c_ag_comm_model_get, NULL},
    {"ag_comm_model_set", 'F', 'I', c_ag_comm_model_set, NULL},
    {"ag_comm_bytes", 'A', 'O', c_ag_comm_bytes, NULL},
    {"ag_comm_time", 'A', 'O', c_ag_comm_time, NULL},
    {"ag_placement_str", 'A', 'R', c_ag_placement_str, NULL},
    {"ag_placement_parse", 'F', 'I', c_ag_placement_parse, NULL},
    {"ag_op_shard_rule", 'F', 'I', c_ag_op_shard_rule, NULL},
    {"ag_shard_rule_pointwise", 'F', 'I', c_ag_shard_rule_pointwise, NULL},
    {"ag_shard_rule_linear_pointwise", 'F', 'I', c_ag_shard_rule_linear_pointwise, NULL},
    {"ag_mesh_world", 'F', 'I', c_ag_mesh_world, NULL},
    {"ag_shard_plan_free", 'A', 'O', c_ag_shard_plan_free, NULL},
    {"ag_shard_plan_set", 'F', 'I', c_ag_shard_plan_set, NULL},
    {"ag_shard_plan_set_param", 'F', 'I', c_ag_shard_plan_set_param, NULL},
    {"ag_shard_plan_set_input", 'F', 'I', c_ag_shard_plan_set_input, NULL},
    {"ag_shard_plan_set_output", 'F', 'I', c_ag_shard_plan_set_output, NULL},
    {"ag_shard_plan_get", 'A', 'O', c_ag_shard_plan_get, NULL},
    {"ag_shard_plan_set_bucket_bytes", 'A', 'O', c_ag_shard_plan_set_bucket_bytes, NULL},
    {"ag_shard_plan_set_no_overlap", 'A', 'O', c_ag_shard_plan_set_no_overlap, NULL},
    {"ag_shard_plan_set_gather_params", 'A', 'O', c_ag_shard_plan_set_gather_params, NULL},
    {"ag_shard_plan_strategy", 'A', 'R', c_ag_shard_plan_strategy, NULL},
    {"ag_shard_plan_dp", 'F', 'R', c_ag_shard_plan_dp, NULL},
    {"ag_shard_plan_fsdp", 'F', 'R', c_ag_shard_plan_fsdp, NULL},
    {"ag_shard_plan_tp", 'F', 'R', c_ag_shard_plan_tp, NULL},
    {"ag_shard_plan_strategy_new", 'F', 'R', c_ag_shard_plan_strategy_new, NULL},
    {"ag_shard_joint", 'F', 'R', c_ag_shard_joint, NULL},
    {"ag_shard_summary_get", 'F', 'I', c_ag_shard_summary_get, NULL},
    {"ag_node_placement", 'A', 'O', c_ag_node_placement, NULL},
    {"ag_add_", 'F', 'R', c_ag_add_, "add_.Tensor"},
    {"ag_add_scalar_", 'F', 'R', c_ag_add_scalar_, "add_.Scalar"},
    {"ag_mul_", 'F', 'R', c_ag_mul_, "mul_.Tensor"},
    {"ag_mul_scalar_", 'F', 'R', c_ag_mul_scalar_, "mul_.Scalar"},
    {"ag_copy_", 'F', 'R', c_ag_copy_, NULL},
    {"ag_zero_", 'F', 'R', c_ag_zero_, NULL},
    {"ag_fill_", 'F', 'R', c_ag_fill_, "fill_.Scalar"},
    {"ag_index_put_", 'F', 'R', c_ag_index_put_, NULL},
    {"ag_uniform_", 'F', 'R', c_ag_uniform_, NULL},
    {"ag_normal_", 'F', 'R', c_ag_normal_, NULL},
    {"ag_op_find", 'F', 'R', c_ag_op_find, NULL},
    {"ag_op_name", 'A', 'R', c_ag_op_name, NULL},
    {"ag_op_def", 'A', 'R', c_ag_op_def, NULL},
    {"ag_op_nargs", 'A', 'I', c_ag_op_nargs, NULL},
    {"ag_op_arg", 'A', 'R', c_ag_op_arg, NULL},
    {"ag_op_noutputs", 'A', 'I', c_ag_op_noutputs, NULL},
    {"ag_op_register", 'F', 'R', c_ag_op_register, NULL},
    {"ag_op_flags_str", 'F', 'R', c_ag_op_flags_str, NULL},
    {"ag_op_with_effects", 'F', 'R', c_ag_op_with_effects, NULL},
    {"ag_op_with_effects_target", 'A', 'R', c_ag_op_with_effects_target, NULL},
    {"ag_op_call", 'F', 'I', c_ag_op_call, NULL},
    {"ag_op_call1", 'F', 'R', c_ag_op_call1, NULL},
    {"ag_op_cost", 'F', 'I', c_ag_op_cost, NULL},
    {"ag_samples_add", 'F', 'O', c_ag_samples_add, NULL},
    {"ag_samples_rand", 'F', 'R', c_ag_samples_rand, NULL},
    {"ag_samples_rand_nograd", 'F', 'R', c_ag_samples_rand_nograd, NULL},
    {"ag_samples_rand_strided", 'F', 'R', c_ag_samples_rand_strided, NULL},
    {"ag_subclass_new", 'F', 'R', c_ag_subclass_new, NULL},
    {"ag_tensor_subclass", 'A', 'R', c_ag_tensor_subclass, NULL},
    {"ag_subclass_flatten", 'F', 'I', c_ag_subclass_flatten, NULL},
    {"ag_subclass_inner", 'A', 'R', c_ag_subclass_inner, NULL},
    {"ag_subclass_attr", 'A', 'R', c_ag_subclass_attr, NULL},
    {"ag_subclass_unflatten", 'F', 'R', c_ag_subclass_unflatten, NULL},
    {"ag_subclass_flatten_tensors", 'A', 'I', c_ag_subclass_flatten_tensors, NULL},
    {"ag_subclass_call_inner", 'F', 'I', c_ag_subclass_call_inner, NULL},
    {"ag_two_tensor", 'F', 'R', c_ag_two_tensor, NULL},
    {"ag_scaled_int8_quantize", 'F', 'R', c_ag_scaled_int8_quantize, NULL},
    {"ag_scaled_int8_dequantize", 'F', 'R', c_ag_scaled_int8_dequantize, NULL},
    {"ag_is_meta", 'A', 'O', c_ag_is_meta, NULL},
    {"ag_trace", 'F', 'R', c_ag_trace, NULL},
    {"ag_trace_module", 'F', 'R', c_ag_trace_module, NULL},
    {"ag_annotate_begin", 'A', 'O', c_ag_annotate_begin, NULL},
    {"ag_annotate_fn", 'F', 'I', c_ag_annotate_fn, NULL},
    {"ag_site", 'A', 'O', c_ag_site, NULL},
    {"ag_zoo_build", 'F', 'I', c_ag_zoo_build, NULL},
    {"ag_zoo_log_get", 'F', 'I', c_ag_zoo_log_get, NULL},
    {"ag_zoo_build_opts", 'F', 'I', c_ag_zoo_build_opts, NULL},
};

/* Whether msg starts with "name:". */
static bool starts_with_name(const char *msg, const char *name) {
    size_t n = strlen(name);
    return strncmp(msg, name, n) == 0 && msg[n] == ':';
}

/* Runs one row in a child; returns its exit status (0 when the row held). */
static int run_row(const row *r) {
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid == 0) {
        ag_clear_error();
        long v = r->call();
        int bad = 0;
        if (r->kind == 'F') {
            if (ag_last_status() >= 0 || !ag_last_error()[0])
                bad = 2;
            else if (r->ret == 'R' && v != 1)
                bad = 3;
            else if (r->ret == 'I' && v >= 0)
                bad = 4;
            else if (!starts_with_name(ag_last_error(), r->op ? r->op : r->name + 3) &&
                     !(!r->op && starts_with_name(ag_last_error(), r->name)))
                bad = 5;
        } else if (r->kind == 'A' && r->ret == 'R' && v != 1) {
            bad = 6;
        }
        if (bad)
            fprintf(stderr, "%s: check %d failed (returned %ld, status %d, message '%s')\n",
                    r->name, bad, v, ag_last_status(), ag_last_error());
        _exit(bad);
    }
    int st = 0;
    if (waitpid(pid, &st, 0) != pid)
        return 100;
    if (!WIFEXITED(st)) {
        fprintf(stderr, "%s: crashed with signal %d\n", r->name, WTERMSIG(st));
        return 101;
    }
    return WEXITSTATUS(st);
}

static void test_null_arguments(void **st) {
    (void)st;
    int failures = 0, n = (int)(sizeof rows / sizeof rows[0]);
    for (int i = 0; i < n; i++)
        failures += run_row(&rows[i]) != 0;
    if (failures)
        fail_msg("%d of %d public functions broke the NULL policy", failures, n);
}

/* The macro-made messages read "name: p is NULL". */
static void test_null_message_form(void **st) {
    (void)st;
    ag_clear_error();
    assert_int_equal(ag_graph_erase(NULL, NULL), AG_EINVAL);
    tu_assert_error_contains("graph_erase: g is NULL");
    assert_int_equal(ag_tensor_set_grad(NULL, NULL), AG_EINVAL);
    tu_assert_error_contains("tensor_set_grad: t is NULL");
    assert_int_equal(ag_node_set_seq_nr(NULL, 3), AG_EINVAL);
    tu_assert_error_contains("node_set_seq_nr: n is NULL");
    /* Accessors return their neutral value and leave the error alone. */
    ag_clear_error();
    assert_int_equal(ag_tensor_ndim(NULL), 0);
    assert_null(ag_node_name(NULL));
    assert_int_equal(ag_node_index(NULL), -1);
    assert_int_equal(ag_joint_num_params(NULL), 0);
    assert_int_equal(ag_last_status(), 0);
}

/* Every public function that takes a pointer has a row: the AG_API declarations of
 * the headers in include/aotgrad, read here, against the table (a new function without a row
 * fails). */
static bool has_row(const char *name, size_t n) {
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++)
        if (strlen(rows[i].name) == n && !strncmp(rows[i].name, name, n))
            return true;
    return false;
}

static void test_every_pointer_function_has_a_row(void **st) {
    (void)st;
    DIR *d = opendir(AG_SOURCE_DIR "/include/aotgrad");
    assert_non_null(d);
    int missing = 0, seen = 0;
    for (struct dirent *e; (e = readdir(d));) {
        size_t len = strlen(e->d_name);
        if (len < 3 || strcmp(e->d_name + len - 2, ".h"))
            continue;
        char path[1024];
        snprintf(path, sizeof path, "%s/include/aotgrad/%s", AG_SOURCE_DIR, e->d_name);
        char *text = tu_read_file(path);
        assert_non_null(text);
        for (const char *p = text; (p = strstr(p, "AG_API "));) {
            p += 7;
            const char *open = strchr(p, '('), *semi = strchr(p, ';');
            if (!open || !semi || semi < open)
                continue;
            const char *end = open;
            while (end > p && (end[-1] == ' '))
                end--;
            const char *name = end;
            while (name > p && (isalnum((unsigned char)name[-1]) || name[-1] == '_'))
                name--;
            const char *close = strchr(open, ')');
            bool pointer = false;
            for (const char *q = open; close && q < close; q++)
                pointer |= *q == '*';
            if (strncmp(name, "ag_", 3) || !pointer)
                continue;
            seen++;
            if (!has_row(name, (size_t)(end - name))) {
                print_error("%s: %.*s has no row in test_api_contract.c\n", e->d_name,
                            (int)(end - name), name);
                missing++;
            }
        }
        free(text);
    }
    closedir(d);
    assert_true(seen > 400);
    assert_int_equal(missing, 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_null_arguments),
        cmocka_unit_test(test_null_message_form),
        cmocka_unit_test(test_every_pointer_function_has_a_row),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
