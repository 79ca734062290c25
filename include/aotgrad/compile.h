/* Compiling a joint graph back into a differentiable callable: partitioners (default and
 * min-cut rematerialization under a memory budget), the memory-planned executor, and
 * ag_compile_joint (the counterpart of aot_compile_joint_with_descriptors).
 *
 * Partitioning splits the joint graph (primals, tangents) -> (fw outputs..., grads...) into
 *   forward:  (primals...) -> (fw outputs..., saved...)   saved outputs carry
 *             SavedForBackwardsAOTOutput(i); the other outputs keep the joint's descriptors;
 *   backward: (saved..., tangents...) -> (grads...)        tangent and grad descriptors kept,
 *             nodes in the order the autograd engine would run them.
 * Both graphs verify. A joint with functionalized random ops (ag_export_joint) adds the philox
 * placeholders: fwd_seed and fwd_base_offset are forward inputs after the primals (the updated
 * forward offset is a forward output, counted in num_fwd_outputs), bwd_seed and
 * bwd_base_offset backward inputs after the tangents (the updated backward offset follows the
 * grads). The min-cut may recompute philox draws in the backward from the saved seed and
 * offset, e.g. a dropout mask rather than saving it.
 *
 * Regions (invoke_subgraph, upstream test 23's form). A joint may call a region's forward
 * subgraph, invoke_subgraph(fw_subgraph, 'fw_subgraph_I', operands...), and in its backward the
 * region's joint subgraph, invoke_subgraph(bw_subgraph, 'bw_subgraph_I_0', the same operands...,
 * one tangent per forward output) -> (one grad per operand..., the forward outputs...), at any
 * number of call sites; the grad of an operand that needs none (a mask, an integer index) is
 * None, and the partitioned backward subgraph returns None there too. ag_partition partitions each
 * distinct joint subgraph once, with the same partitioner, options and budget as the outer joint,
 * into the attributes partitioned_fw_subgraph_I_0 (operands -> forward outputs, saved...) and
 * partitioned_bw_subgraph_I_0 (saved..., tangents -> grads), rewrites every call pair to call
 * them (the forward call returns the saved values too, the backward call takes them), then
 * partitions the outer joint with the calls as opaque ops, never recomputed in the backward: the
 * forward graph holds the one forward attribute and its calls, the backward graph the backward
 * one. A call reached from a tangent is a backward call; one whose first operands are not
 * those of a forward call, or whose counts do not fit, is an error naming it. A forward call
 * without a backward call is left as it is. The peak-memory model of the memory budget counts at
 * each call its outputs and, while it runs, its partitioned subgraph's intermediates (their peak)
 * on top of what is live there. The user's joint is never changed. A partition_fn hook gets the
 * joint as it is (subgraphs unpartitioned); a pre-partitioned pair may call subgraphs. The planned
 * executor makes one plan per subgraph and runs it at each call (an operand the subgraph
 * passes through is read where it is, not copied); the interpreter runs subgraphs as
 * well. */
#ifndef AOTGRAD_COMPILE_H
#define AOTGRAD_COMPILE_H

#include "core.h"
#include "export.h"
#include "graph.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- partitioners ---- */

typedef enum ag_partitioner {
    AG_PARTITION_DEFAULT = 0, /* upstream's default_partition: save what the backward uses */
    AG_PARTITION_MINCUT,      /* min_cut_rematerialization_partition */
} ag_partitioner;

/* The knapsack solver of the memory budget (upstream's activation_memory_budget_solver). Zero
 * is upstream's default, "dp"; the values were renumbered in 0.1.0 so that it is (GREEDY was
 * 0): name them, never spell the numbers. */
typedef enum ag_knapsack {
    AG_KNAPSACK_DP = 0,     /* upstream's "dp": exact on memory quantized to 1/10000 */
    AG_KNAPSACK_GREEDY = 1, /* upstream's "greedy": by runtime per byte */
    AG_KNAPSACK_ILP = 2,    /* an exact binary program, solved by COIN-OR CBC */
} ag_knapsack;

/* Zero-initialized, or NULL: upstream's defaults (default_partition; activation_memory_budget
 * 1.0, which only the min-cut reads). */
typedef struct ag_partition_opts {
    ag_partitioner partitioner;
    /* upstream's activation_memory_budget, read by the min-cut (and by the default partitioner
     * when recompute tags make it delegate to the min-cut). The budget is a ratio over the
     * step's planned peak activation memory (the peak model of src/partition/side_plan.c:
     * forward and backward simulated with each value freed after its last use and recomputed
     * values alive from their recomputation), not over saved bytes: budget b allows a planned
     * peak of minP + b * (maxP - minP), where maxP is the peak of the runtime-optimized min-cut
     * and minP the lowest peak among the candidate cuts (inputs only, the more aggressive
     * cuts, the knapsack's cuts); among the cuts within it, the one that recomputes the fewest
     * FLOPs is taken. So 1 is the runtime-optimized cut (upstream's default) and 0 the lowest
     * planned peak (saving only the inputs when that reaches it, as upstream's 0 does).
     *
     * 0 (a zeroed struct) means the default, 1.0; any value in (0, 1] means itself; budget 0
     * is asked for with AG_MEMORY_BUDGET_ZERO (ag_memory_budget(x) turns any x in [0, 1],
     * e.g. a command line's, into the field's value). Other values are refused (AG_EINVAL). A
     * node's float meta "memory_budget" overrides the field, 0.0 there meaning 0. */
    double memory_budget;
    ag_knapsack solver; /* zero: dp, upstream's default */
} ag_partition_opts;

/* Budget 0 in ag_partition_opts.memory_budget, where plain 0 means the default 1.0: negative
 * zero, which is 0 to any arithmetic and is told apart by its sign bit. */
#define AG_MEMORY_BUDGET_ZERO (-0.0)
/* A budget b in [0, 1] as the field takes it: 0 becomes AG_MEMORY_BUDGET_ZERO, anything else
 * stays (and is checked by the partitioner). */
static inline double ag_memory_budget(double b) {
    return b == 0 ? AG_MEMORY_BUDGET_ZERO : b;
}

/* What a partition saves and recomputes. With regions (invoke_subgraph), the saved values are
 * the outer graph's (a region's saved values are among them, one getitem each); the recomputed
 * nodes and FLOPs add what each region's backward recomputes, at every backward call. */
typedef struct ag_partition_stats {
    int saved_tensors;
    int64_t saved_bytes;
    int recomputed_nodes;
    double recomputed_flops;
} ag_partition_stats;

/* Partitions a joint graph whose first num_fwd_outputs outputs are forward outputs. On success
 * *fw and *bw are new graphs (caller frees). opts NULL: the default partitioner. */
AG_API int ag_partition(const ag_graph *joint, int num_fwd_outputs, const ag_partition_opts *opts,
                        ag_graph **fw, ag_graph **bw, ag_partition_stats *stats);

/* Tags every call node between `first` and `last` (inclusive, graph order) with a recompute
 * policy, like activation checkpointing a region (e.g. one GPT-2 block). */
AG_API int ag_tag_region_recompute(ag_graph *g, ag_node *first, ag_node *last, ag_recompute policy);

/* ---- the executor ---- */

/* A graph compiled for repeated execution on CPU kernels: values laid out by a static memory
 * plan (one arena, an offset allocator that reuses memory as values die, in-place reuse for
 * pointwise ops where safe). The first run allocates the arena; later runs allocate nothing
 * for intermediates. */
typedef struct ag_plan ag_plan;

/* Zero-initialized, or NULL: the defaults (checks as the build and AG_CHECK_COLLECTIVES say,
 * in-place reuse and fusion on). */
typedef struct ag_plan_opts {
    bool checking;   /* poison freed regions and check that live buffers never overlap; and
                      * at the first run of a plan with collectives, check that every rank of
                      * their groups issues the same ones in the same order (the job ends
                      * naming the first that differs; also on in builds without NDEBUG, and
                      * whenever AG_CHECK_COLLECTIVES is set: "0" turns it off) */
    bool no_inplace; /* disable in-place reuse */
    bool no_fusion;  /* run every node's kernel on its own (no fused groups, see
                      * src/runtime/fuse.c; also turned off by AG_NO_FUSION=1) */
    /* outputs whose memory must stay valid after the run (saved tensors, user outputs) are
     * always given their own storage */
} ag_plan_opts;

AG_API ag_plan *ag_plan_new(const ag_graph *g, const ag_plan_opts *opts);
AG_API void ag_plan_free(ag_plan *p);
/* Runs the plan: inputs bind the placeholders in order; outputs (new references, NULL for
 * None) are stored in outs. Returns the output count or a negative status naming the node. */
AG_API int ag_plan_run(ag_plan *p, ag_tensor *const *inputs, int ninputs, ag_tensor **outs,
                       int max_out);
/* Bytes of the arena (planned peak of intermediates; with the arenas of the plans its steps
 * run inside them: each invoke_subgraph's subgraph plan and flex_attention's tile plans, which
 * live as long as the plan) and of outputs. */
AG_API int64_t ag_plan_peak_bytes(const ag_plan *p);
AG_API int64_t ag_plan_output_bytes(const ag_plan *p);

/* ---- compilers: a graph in, a runnable out (upstream's fw_compiler / bw_compiler) ---- */

/* Something that runs one graph: run() binds in[i] to the graph's placeholder i and stores the
 * outputs (new references, NULL for None) in outs, returning their count or a negative status
 * with a message; destroy() (may be NULL) frees self. The compiled callable calls run() from one
 * thread at a time, with grad mode off, inside an autorelease scope (outputs may be owned by
 * it, as ag_plan_run's are). */
typedef struct ag_runnable {
    int (*run)(void *self, ag_tensor *const *in, int nin, ag_tensor **outs, int max_out);
    void (*destroy)(void *self);
    /* Bytes of intermediates it holds between runs, or -1 when unknown; may be NULL. */
    int64_t (*peak_bytes)(const void *self);
    void *self;
} ag_runnable;

/* A compiler: fills *out with a runnable for g, or returns a negative status (with a message:
 * ag_set_error). g is borrowed and outlives the runnable (the compiled callable keeps it); the
 * compiler may rewrite nothing in it (copy it to transform it). user is the pointer given with
 * the compiler in ag_compile_opts. */
typedef int (*ag_compiler_fn)(const ag_graph *g, void *user, ag_runnable *out);

/* The two built-in compilers. The planned executor: user is a const ag_plan_opts * or NULL
 * (defaults). The interpreter (ag_graph_run): user is ignored. */
AG_API int ag_compiler_plan(const ag_graph *g, void *user, ag_runnable *out);
AG_API int ag_compiler_interpreter(const ag_graph *g, void *user, ag_runnable *out);

/* A partitioner: splits joint, whose first num_fwd_outputs outputs are the forward's, into new
 * graphs *fw and *bw (the caller takes them) following ag_partition's contract (see the top of
 * this header): forward (primals...) -> (fw outputs..., saved...) with the saved outputs
 * described SavedForBackwardsAOTOutput(i), backward (saved..., tangents...) -> (grads...). */
typedef int (*ag_partition_fn)(const ag_graph *joint, int num_fwd_outputs, void *user,
                               ag_graph **fw, ag_graph **bw);

/* ---- compiling a joint ---- */

/* Zero-initialized, or NULL (the two are the same): as upstream's
 * aot_compile_joint_with_descriptors(jd) with its defaults, partition_fn=default_partition
 * (save what the backward uses; the min-cut only where recompute tags ask for it, under
 * activation_memory_budget 1.0), except that both halves are run by the planned executor where
 * upstream's default compilers (boxed_nop_preserve_node_meta) interpret them: set `interpret`
 * for that. */
typedef struct ag_compile_opts {
    ag_partition_opts partition;
    ag_plan_opts plan; /* zero: ag_plan_new's defaults */
    bool interpret;    /* run the partitioned graphs with the interpreter instead of plans */
    /* Hooks. A compiler left NULL is the planned executor with `plan` (the interpreter when
     * `interpret`); a partition_fn left NULL is ag_partition with `partition`. */
    ag_compiler_fn fw_compiler, bw_compiler;
    void *fw_compiler_user, *bw_compiler_user;
    ag_partition_fn partition_fn;
    void *partition_user;
    /* A pair partitioned elsewhere (both or neither; borrowed, copied): used as the forward and
     * backward instead of partitioning. They must follow ag_partition's contract for this joint:
     * the forward returns the joint's forward outputs then the saved values, the backward takes
     * the saved values then the joint's tangents (and tokens, philox inputs) and returns the
     * gradients. */
    const ag_graph *fw_graph, *bw_graph;
} ag_compile_opts;

/* A differentiable callable made from a joint. It keeps per-call state (arrays, buffers of its
 * plans, the backward's saved values), so it is called by one thread at a time, with the
 * module it was exported from; compiled callables of different modules run in different
 * threads at once. Functionalized random ops draw from the calling thread's generator. */
typedef struct ag_compiled ag_compiled;

AG_API ag_compiled *ag_compile_joint(const ag_joint *j, const ag_compile_opts *opts);
AG_API void ag_compiled_free(ag_compiled *c);
/* Calls it on the flat inputs (params, buffers, user args and kwargs, as in the joint's
 * in_spec). Outputs are eager tensors attached to the autograd graph through one node:
 * ag_backward on a loss computed from them runs the compiled backward and accumulates into
 * each parameter's .grad as the eager model would. Input mutations (BatchNorm running stats)
 * are written back into the given tensors. The new value of an input that requires grad
 * (one the joint gives a tangent) is an output of that node and is written back with
 * ag_copy_, recorded by autograd: afterwards the tensor's history is the copy, as the eager
 * in-place op leaves it, and a loss computed from it reaches the compiled backward. With grad
 * mode on, such an input that is a leaf requiring grad is refused before anything runs (eager
 * refuses the in-place op: "a leaf tensor that requires grad is being used in an in-place
 * operation"), as is one that is a view. With grad mode on, an input that requires grad but
 * did not when the joint was exported (a parameter unfrozen since, an input made to require
 * grad) is refused before anything runs, the message naming it by descriptor: the joint has no
 * gradient for it (upstream's guards would recompile; export again). One that required grad
 * then but not now is fine: its gradient is computed and dropped. Errors about an input name
 * its descriptor and position ("PlainAOTInput(idx=0) (input 2)"). Returns the number of user
 * outputs.
 * Tensor subclass instances are passed and returned as such (upstream's
 * AOTDispatchSubclassWrapper): inputs must have the structure the export saw (a TwoTensor
 * where it saw one) and are taken apart for the plain graphs; outputs are rebuilt; an
 * instance input's gradient is rebuilt from its parts' gradients; an instance output needs an
 * instance gradient (a plain one is an error naming the output). */
AG_API int ag_compiled_call(ag_compiled *c, ag_tensor *const *inputs, int ninputs, ag_tensor **outs,
                            int max_out);
/* Calls it on module m (borrowed; args borrowed, outs as ag_compiled_call's). Each parameter
 * and buffer input of the joint, ParamAOTInput(target=fqn) or BufferAOTInput(target=fqn) (a
 * tensor subclass instance by its own descriptor, its parts' bases), is the tensor m holds
 * under that fully qualified name: found by name, not by position, so a module whose
 * parameters were registered in another order gets each one where the joint takes it, and a
 * tied weight (GPT-2's lm_head.weight and transformer.wte.weight) is found under each of its
 * names, as the export listed it (named_parameters with remove_duplicate=False). The args fill
 * the other inputs in order (the user's args and kwargs values, after the parameters and
 * buffers). Then it is ag_compiled_call on those inputs: mutated buffers (BatchNorm's running
 * statistics) are written back into m's tensors, gradients accumulate into its parameters'
 * .grad. Returns the number of user outputs.
 * Refused before anything runs (AG_EINVAL, the message naming the FQN): a name the joint takes
 * that m lacks; one that m holds as the other kind (a buffer where the joint takes a
 * parameter); one whose dtype or shape differ from the joint's (both given); a parameter or
 * buffer of m that the joint does not take; a count of args other than the joint's. An extra
 * parameter is refused rather than ignored: the joint was exported from a module without it,
 * and where upstream's guards would recompile for the changed module this callable cannot
 * (as load_state_dict, strict by default, and functional_call(strict=True) refuse unexpected
 * keys); export again, or give the tensors to ag_compiled_call, which is also the way to call
 * a joint that ag_joint_update gave other parameters or fewer.
 * The tensors found are kept (borrowed) with m until m's tree changes (a parameter, buffer or
 * child added anywhere in it, ag_module_to_dtype) or another module is given, so a call on the
 * unchanged module looks nothing up and allocates nothing; the other checks of
 * ag_compiled_call still run at every call. Like ag_compiled_call, one thread at a time, and m
 * is not used by another thread during the call. */
AG_API int ag_compiled_call_module(ag_compiled *c, ag_module *m, ag_tensor *const *args, int nargs,
                                   ag_tensor **outs, int max_out);
AG_API const ag_graph *ag_compiled_forward_graph(const ag_compiled *c);
AG_API const ag_graph *ag_compiled_backward_graph(const ag_compiled *c);
AG_API const ag_partition_stats *ag_compiled_stats(const ag_compiled *c);
AG_API int64_t ag_compiled_peak_bytes(const ag_compiled *c, bool backward);

#ifdef __cplusplus
}
#endif
#endif
