/* Internal structures of the graph IR, shared by graph.c, the printer/parser, passes and the
 * interpreter. */
#ifndef AG_GRAPH_INTERNAL_H
#define AG_GRAPH_INTERNAL_H

#include "../core/internal.h"
#include "../core/strmap.h"
#include "aotgrad/graph.h"

typedef struct ag__use {
    ag_node *node;
    int count; /* how many arguments of `node` reference the definition */
} ag__use;

/* A metadata entry. Well-known keys (seq_nr, partitioner_tag, ...) and string values
 * (is_forward, MUST_SAVE, ...) point at one interned copy in graph.c; other keys are the
 * entry's own heap copies; other string values live in a string pool (graph.c) that copies of the
 * entry share, so copying a node's stack trace to another node or graph copies no text. */
typedef struct ag__strpool ag__strpool;

typedef struct ag__mentry {
    const char *key;
    ag_mval v;
    ag__strpool *pool; /* the pool holding v.u.s; NULL when interned or not a string */
} ag__mentry;

enum {
    AG__META_INLINE = 4,  /* metadata entries held in the node before the list moves to the heap */
    AG__NAME_INLINE = 40, /* names shorter than this live in the node */
    AG__USERS_INLINE = 2, /* users listed in the node before the list moves to the heap */
    AG__ARGS_INLINE = 6,  /* arguments held in the node (more: AG_MAX_ARGS on the heap) */
};

struct ag_node {
    /* The fields walks read first (kind, next, index, op, arguments, users, vals, sub) lead,
     * so a walk over a large graph touches one or two cache lines per node. */
    ag_graph *graph;
    ag_node *prev, *next;
    ag_node_kind kind;
    int index;
    char *name;
    const ag_op *op;
    int nargs;
    uint32_t stamp; /* scratch mark for a pass's sweep (DCE) */
    ag_garg *args;  /* args_inline, or AG_MAX_ARGS on the heap for calls with more */
    ag__use *users;
    int nusers, users_cap;
    ag_tmeta *vals; /* val1, or a heap array for several outputs */
    int nvals;
    int nmeta;
    ag_graph *sub;             /* GET_ATTR of a subgraph: the subgraph, owned by the node's graph */
    ag__mentry *meta, *custom; /* meta is meta_inline until it outgrows it */
    ag_desc *desc;
    int meta_cap, ncustom, custom_cap;
    int nout_descs;
    ag_tensor *constant;
    ag_desc **out_descs;
    bool has_out_descs;
    /* Not zeroed by node_alloc: read only below their counts (nargs, nusers, nmeta, the
     * name's terminator, nvals). New fields go above. */
    ag_garg args_inline[AG__ARGS_INLINE];
    ag__use users_inline[AG__USERS_INLINE];
    ag__mentry meta_inline[AG__META_INLINE];
    char name_inline[AG__NAME_INLINE];
    ag_tmeta val1; /* storage for the common single-output case */
};

/* Nodes are carved from blocks owned by the graph (consecutive nodes sit together in memory,
 * which keeps walks over a large graph cache-friendly); erased nodes go to a free list. */
typedef struct ag__node_block {
    struct ag__node_block *next;
    int cap, used;
    ag_node nodes[];
} ag__node_block;

typedef struct ag__base_count {
    char *base;
    int64_t count;
} ag__base_count;

/* A subgraph attribute (subgraph.c): its name and the graph, owned by the parent graph. */
typedef struct ag__subgraph {
    char *name;
    ag_graph *g;
} ag__subgraph;

struct ag_graph {
    ag_node *first, *last, *output;
    int64_t count;
    ag__strmap names; /* name -> node (keys are the nodes' own name strings) */
    ag__base_count *bases;
    int64_t nbases, bases_cap;
    int64_t nconst;
    ag_node *insert_before, *insert_after;
    int explicit_insert; /* 0 default, 1 before insert_before, 2 after insert_after */
    bool order_dirty;
    ag_node **ph_cache;
    int64_t ph_cap;
    ag_node *last_ph;    /* the last placeholder, or NULL when unknown (recomputed on demand) */
    int64_t nph;         /* placeholders in the list */
    ag__strmap base_idx; /* name base -> its index in bases, plus one */
    ag__node_block *blocks;
    ag_node *free_nodes;    /* erased nodes, linked through next */
    ag__strpool *strings;   /* this graph's metadata strings (NULL until the first) */
    ag__strpool **shared;   /* other graphs' pools its entries point into */
    ag__strmap shared_strs; /* strings set on many nodes (module stacks) -> their copy in strings */
    int nshared;
    int64_t shared_cap;
    uint32_t stamp;
    ag__subgraph *subs; /* the graph's subgraph attributes, in the order they were added */
    int nsubs;
    int64_t subs_cap;
    ag_graph *parent; /* the graph owning this one as a subgraph, or NULL */
};

/* ag_node_kind_of, ag_node_next and ag_node_index inlined, for the walks of later stages over
 * graphs they hold (the plans, the partitioner): n is not NULL. */
static inline ag_node_kind ag__node_kind(const ag_node *n) {
    return n->kind;
}
static inline ag_node *ag__node_next(const ag_node *n) {
    return n->next;
}
static inline int ag__node_index(const ag_node *n) {
    return n->graph->order_dirty ? ag_node_index(n) : n->index;
}
/* The public readers of a node's fields inlined for the same walks, with their answers for
 * NULL and out-of-range indexes. */
static inline const char *ag__node_name(const ag_node *n) {
    return n ? n->name : NULL;
}
static inline const ag_op *ag__node_op(const ag_node *n) {
    return n ? n->op : NULL;
}
static inline int ag__node_nargs(const ag_node *n) {
    return n ? n->nargs : 0;
}
static inline const ag_garg *ag__node_arg(const ag_node *n, int i) {
    return n && i >= 0 && i < n->nargs ? &n->args[i] : NULL;
}
static inline ag_node *ag__node_arg_node(const ag_node *n, int i) {
    return n && i >= 0 && i < n->nargs && n->args[i].kind == AG_GA_NODE ? n->args[i].u.node : NULL;
}
static inline int ag__node_num_users(const ag_node *n) {
    return n ? n->nusers : 0;
}
static inline ag_node *ag__node_user(const ag_node *n, int i) {
    return n && i >= 0 && i < n->nusers ? n->users[i].node : NULL;
}
static inline int ag__node_num_vals(const ag_node *n) {
    return n ? n->nvals : 0;
}
static inline const ag_tmeta *ag__node_val(const ag_node *n, int i) {
    return n && i >= 0 && i < n->nvals ? &n->vals[i] : NULL;
}
static inline ag_graph *ag__node_subgraph(const ag_node *n) {
    return n && n->kind == AG_NODE_GET_ATTR ? n->sub : NULL;
}

/* subgraph.c: frees g's subgraphs (ag_graph_free). */
void ag__subgraphs_free(ag_graph *g);
/* subgraph.c: gives dst a copy of each of src's subgraphs (same names, same order); 0 or
 * AG_ENOMEM (dst keeps the ones copied so far: the caller frees dst). */
int ag__subgraphs_copy(ag_graph *dst, const ag_graph *src);
/* subgraph.c: frees subgraph k of g and removes it from the list (no get_attr may read it). */
void ag__subgraph_remove(ag_graph *g, int k);
/* Subgraphs nest at most this many levels below the outermost graph. */
enum { AG_SUBGRAPH_MAX_DEPTH = 16 };
/* subgraph.c: the index in g's list of subgraph sub, or -1. */
int ag__subgraph_index(const ag_graph *g, const ag_graph *sub);
/* subgraph.c: the meta inference of a call of an AG_OP_SUBGRAPH op (invoke_subgraph): checks
 * the subgraph argument and the operands against the subgraph's placeholders and gives the
 * subgraph's output vals (a None output, e.g. the grad of an operand that needs none: a
 * contiguous f32[0], which no getitem may read). ag__infer_meta calls it instead of the op's
 * meta function. */
int ag__subgraph_infer(const ag_op *op, const ag_garg *args, int nargs, ag_tmeta *vals, int *nvals);
/* flex_hop.c: the flex_attention higher-order ops (made on first use, kept for the process;
 * not in the registry): the forward's or the backward's; by name (the parser); a test; their
 * meta inference (ag__subgraph_infer hands their calls here). */
const ag_op *ag__op_flex_attention(bool backward);
const ag_op *ag__op_flex_find(const char *name);
bool ag__op_is_flex(const ag_op *op);
int ag__flex_infer(const ag_op *op, const ag_garg *args, int nargs, ag_tmeta *vals, int *nvals);
/* flex_hop.c: a flex_attention / flex_attention_backward call's arguments (upstream's schema,
 * flex_hop.c), read and checked: 0, or AG_EINVAL naming the op, the argument and the tuple
 * element that is wrong ("flex_attention: block_mask (argument 4) element 3 (kv_indices) is an
 * int; a tensor expected"). Pointers borrowed from args. */
typedef struct ag__flex_args {
    bool bwd;
    const ag_node *q, *k, *v;
    const ag_node *out, *lse, *go, *gl;  /* backward; go, gl NULL for None */
    const ag_node *score, *joint, *mask; /* get_attrs of subgraphs (joint: backward; mask NULL:
                                          * no mask_mod) */
    const ag_node *parts[8];             /* the block mask's tensors (NULL: None) */
    int64_t sizes[4]; /* (KV_LEN, Q_LEN, Q_BLOCK_SIZE, KV_BLOCK_SIZE): ag__flex_call's order */
    double scale;
    const ag_garg *sb, *mb; /* the buffers tuples' elements (each a tensor node) */
    int nsb, nmb;
} ag__flex_args;
int ag__flex_args_read(const ag_op *op, const ag_garg *args, int nargs, ag__flex_args *fa);
/* flex_hop.c: kernel_options as upstream's _apply_kernel_options records them for a CPU call
 * (OUTPUT_LOGSUMEXP: return_lse); a dict argument of static storage. */
ag_garg ag__flex_kernel_options(bool return_lse);
/* flex_hop.c: a call's arguments in the text form before tuples (block_mask a list of 8 tensors
 * and the mask graph, block_mask_sizes [KV_LEN, Q_LEN, Q_BLOCK_SIZE, KV_BLOCK_SIZE], the buffers
 * lists, no kernel_options) rewritten in place into upstream's schema, the new tuples in mem (the
 * default kernel_options). 1 when rewritten, 0 when not in that form, AG_EINVAL (more than 64
 * buffers). */
typedef struct ag__flex_legacy {
    ag_garg bm[13], sb[64], mb[64];
} ag__flex_legacy;
int ag__flex_legacy_args(const ag_op *op, ag_garg *args, int *nargs, ag__flex_legacy *mem);
/* flex_hop.c: runs a flex_attention / flex_attention_backward call node for the interpreter:
 * val(ud, n, x) gives the value of argument node x; outs get the outputs (the open scope's);
 * returns their count or a negative status. */
typedef ag_tensor *(*ag__flex_value_fn)(void *ud, const ag_node *user, const ag_node *x);
int ag__flex_run(const ag_node *n, ag__flex_value_fn val, void *ud, ag_tensor **outs);
/* flex_hop.c: one call of flex_attention (bwd false: outs = out, logsumexp) or
 * flex_attention_backward (outs = grad q, k, v, one per score_mod buffer) on tensors already
 * bound, the score and mask graphs run per tile as score_mod / mask_mod (what ag__flex_run
 * does for the interpreter; the planned executor calls it directly). parts: the block mask's 8
 * tensors; sizes: block_mask_sizes. Returns the output count (new references, or the open
 * scope's) or a negative status. */
typedef struct ag__flex_call {
    bool bwd;
    ag_tensor *q, *k, *v;
    ag_tensor *out, *lse, *go, *gl; /* backward only; go, gl may be NULL */
    const ag_graph *score, *mask;   /* mask NULL: no mask_mod */
    const ag_graph *joint;          /* backward: the joint graph (NULL: differentiate score) */
    ag_tensor *const *parts;
    const int64_t *sizes;
    double scale;
    ag_tensor *const *sb, *const *mb;
    int nsb, nmb;
} ag__flex_call;
int ag__flex_call_run(const ag__flex_call *c, ag_tensor **outs);
/* flex_hop.c: a copy of score_mod / mask_mod / joint graph g (a function of 0-d scalars and its
 * buffers) to run on one [bq, bk] tile: its placeholders take the inputs' metadata m (nin, all
 * of them), each index_put accumulating one element (a buffer's gradient in a joint graph)
 * expanded to the tile so that it adds every tile position's value (upstream's vmap), its
 * calls' vals inferred again. NULL with the error set (an op that does not broadcast over the
 * tile). */
ag_graph *ag__flex_tile_graph(const ag_graph *g, const ag_tmeta *m, int nin, int64_t bq,
                              int64_t bk);
/* subgraph.c: refuses (AG_EINVAL) an argument node of g's parent, of one of g's subgraphs or
 * of a sibling subgraph: a graph and its subgraphs share no nodes. */
int ag__subgraph_check_args(const ag_graph *g, const ag_op *op, const ag_garg *args, int nargs);
/* subgraph.c: the subgraph a call of an AG_OP_SUBGRAPH op invokes (NULL for other nodes). */
const ag_graph *ag__call_subgraph(const ag_node *n);
/* subgraph.c: for each output k of subgraph sub (the first max): the position among its
 * placeholders of the placeholder it returns there (a call's operand passed through), or -1
 * (a computed value, None), into ph_of; returns their count. One walk of the placeholders, for
 * all of a call's outputs. */
int ag__subgraph_passthrough(const ag_graph *sub, int *ph_of, int max);
/* subgraph.c: whether output i of call n (an AG_OP_SUBGRAPH call) is None in its subgraph. */
bool ag__call_output_is_none(const ag_node *n, int i);

/* Deep copy / free of an argument value (lists, strings, tuples, dicts). */
int ag__garg_copy(ag_garg *dst, const ag_garg *src);
/* garg.c: the aggregate kinds (AG_GA_TUPLE, AG_GA_DICT). ag__garg_check: 0 for any other kind
 * or a well-formed aggregate, else AG_EINVAL with "FN: tuple element 3 is a node list" (elements
 * None/node/int/float/bool, no NULL node; dict keys non-empty and distinct, scalar values).
 * agg_copy / agg_free: the deep copy (dst already holds src's fields) and free of a tuple or
 * dict; equal / hash: for CSE (nodes by identity, floats bitwise). */
int ag__garg_check(const char *fn, const ag_garg *a);
/* The most elements of a tuple argument and items of a dict argument (whose keys are compared
 * pairwise: kernel options, a handful). */
#define AG__TUPLE_MAX 65536
#define AG__DICT_MAX 1024
int ag__garg_agg_copy(ag_garg *dst, const ag_garg *src);
void ag__garg_agg_free(ag_garg *a);
bool ag__garg_agg_equal(const ag_garg *a, const ag_garg *b);
/* Argument equality (CSE's): nodes by identity, values by value (floats bitwise, so 0.0 and
 * -0.0 differ and a NaN equals the same NaN), tuples and dicts element by element. */
bool ag__garg_equal(const ag_garg *a, const ag_garg *b);
uint64_t ag__garg_agg_hash(const ag_garg *a);
/* ag_garg_num_refs / ag_garg_ref for the walks over every argument of every node (the
 * public functions call these): the node references of a (NULL elements are None or, in a
 * tuple, elements that are not nodes); k in [0, ag__garg_nrefs(a)). */
static inline int ag__garg_nrefs(const ag_garg *a) {
    return a->kind == AG_GA_NODE                                              ? 1
           : (a->kind == AG_GA_NODES || a->kind == AG_GA_TUPLE) && a->u.nodes ? a->n
                                                                              : 0;
}
static inline ag_node *ag__garg_ref(const ag_garg *a, int k) {
    return a->kind == AG_GA_NODE              ? a->u.node
           : a->kind == AG_GA_NODES           ? a->u.nodes[k]
           : a->u.elems[k].kind == AG_GA_NODE ? a->u.elems[k].u.node
                                              : NULL;
}
/* garg.c: the slot of reference k of a (ag_garg_ref's), to rewrite it; NULL for a tuple element
 * that is not a node. */
ag_node **ag__garg_slot(ag_garg *a, int k);
/* garg.c: a copy of tuple a's elements (ag__malloc'd, the caller frees it) with each node
 * element x replaced by fn(ctx, x) (a rewrite copying a node into another graph); NULL when out
 * of memory or when fn returns NULL (fn's error kept). */
ag_garg *ag__garg_tuple_map(const ag_garg *a, ag_node *(*fn)(void *ctx, const ag_node *x),
                            void *ctx);
/* garg.c: "a tuple", "an int", ... for messages. */
const char *ag__garg_kind_name(ag_garg_kind k);
/* passes.c: whether ag_graph_dce would remove anything. */
bool ag__graph_has_dead_code(const ag_graph *g);
/* Sizes the graph's tables for nnodes nodes (a copy or an extraction knows its size). */
int ag__graph_reserve(ag_graph *g, int64_t nnodes);
/* The name a new node asking for `candidate` gets (FX's rules, g's per-base counters, which it
 * advances) into out (160 bytes), a name being free when taken(ctx, name) is false: the
 * graph's own name table for every node the API makes; a rewrite that builds its graph in
 * another order than its names were given passes the table it would have had. */
int ag__graph_make_name(ag_graph *g, const char *candidate, bool (*taken)(void *, const char *),
                        void *ctx, char *out);
/* ag__graph_make_name for many nodes named from one candidate without a _<digits> counter (a
 * rewrite's getitems): init works the candidate out once (0; 1 when it has a counter: use
 * ag__graph_make_name; AG_ENOMEM), next gives the name ag__graph_make_name would give (in
 * ng->text, until the next call) and its ag__strhash, taken(ctx, name, hash) saying whether
 * a name is in use. */
typedef struct ag__name_gen {
    int64_t base;  /* the base's counter in g->bases */
    size_t len;    /* the base's length */
    bool illegal;  /* the base is a Python builtin's name */
    uint64_t hash; /* the base's ag__strhash */
    char text[160];
} ag__name_gen;
int ag__graph_name_gen_init(ag_graph *g, const char *candidate, ag__name_gen *ng);
const char *ag__graph_name_gen_next(ag_graph *g, ag__name_gen *ng,
                                    bool (*taken)(void *, const char *, uint64_t), void *ctx,
                                    uint64_t *hash);
/* The name candidate of a call of op (96 bytes): its name without namespace and overload. */
void ag__call_name_base(const ag_op *op, char *base);

/* ag_graph_copy in two steps, for a rewrite that copies most of a graph: the shell (src's
 * subgraphs, name counters and constant count, no nodes), then src's nodes in order, each
 * offered first to hook: 0 copies it (its arguments mapped to their copies), 1 skips it (the
 * hook may have added nodes to g and told the map which node stands for a skipped one), a
 * negative status ends the copy with it. */
typedef struct ag__copy_map {
    ag_node **from, **to; /* by the source's positions */
    int64_t cnt;
} ag__copy_map;
typedef int (*ag__copy_hook)(void *ctx, ag_graph *g, const ag_node *n, ag__copy_map *map);
ag_graph *ag__graph_copy_shell(const ag_graph *src);
int ag__graph_copy_nodes(ag_graph *g, const ag_graph *src, ag__copy_hook hook, void *ctx);
/* What stands for source node x in the copy so far (NULL: nothing yet, or not src's). */
ag_node *ag__copy_map_get(const ag__copy_map *map, const ag_node *x);
void ag__copy_map_set(ag__copy_map *map, const ag_node *x, ag_node *to);
/* node_meta.c: frees the n entries of e (the list itself unless it is inline_buf). */
void ag__meta_entries_free(ag__mentry *e, int n, const ag__mentry *inline_buf);
/* node_meta.c: sets x's key and value on a list of g's, sharing x's string (ag_graph_copy). */
int ag__entry_copy(ag_graph *g, ag__mentry **e, int *n, int *cap, ag__mentry *inline_buf,
                   const ag__mentry *x);
/* node_meta.c: the interned copy of a well-known metadata key or value (NULL for another
 * string); ag_node_meta_get given it finds the entry by pointer, without comparing text. */
const char *ag__meta_interned(const char *s);
/* node_meta.c: drops one graph's hold on a string pool (NULL does nothing). */
void ag__strpool_release(ag__strpool *p);
/* Copies every metadata entry of src onto dst (same keys replaced), sharing string values. */
int ag__node_meta_copy(ag_node *dst, const ag_node *src);
/* Gives dst src's entry for key, sharing its string (removes dst's when src has none). */
int ag__node_meta_copy_key(ag_node *dst, const ag_node *src, const char *key);
/* Gives dst's dst_key src's entry for src_key, sharing its string (removes dst's when src has
 * none): backward nodes take their forward node's nn_module_stack as fwd_nn_module_stack. */
int ag__node_meta_copy_key_as(ag_node *dst, const char *dst_key, const ag_node *src,
                              const char *src_key);
/* The one copy of s in g's own string pool, the same pointer for every call with equal text
 * (NULL when out of memory). For strings set on many nodes: module stacks. */
const char *ag__graph_shared_str(ag_graph *g, const char *s);
/* Sets key to s, a string from ag__graph_shared_str on n's graph, without copying it. */
int ag__node_meta_set_shared(ag_node *n, const char *key, const char *s);
/* modstack_text.c: 0 when v is what ag_node_meta_set may store under key (nn_module_stack or
 * fwd_nn_module_stack): a string spelling a module stack as the printer does; else AG_EINVAL
 * with a message saying why (or AG_ENOMEM). */
int ag__modstack_check(const char *key, ag_mval v);
/* modstack_text.c: the text of the stack `parent` (NULL: the empty stack) with the frame (key,
 * path, type) added innermost, as a new string (ag__free), or NULL when out of memory. */
char *ag__modstack_push(const char *parent, const char *key, const char *path, const char *type);
/* modstack_text.c: reads text s as a stack: o->count frames, frame `want` (>= 0) decoded into
 * o->f (ag__malloc'd strings the caller owns). 0, 1 when s is not a stack's text (o->why says
 * why; nothing decoded is kept), or AG_ENOMEM. */
typedef struct ag__modstack_scan_out {
    int count;
    const char *why;  /* when the text is not a stack: what is wrong */
    int dup_a, dup_b; /* frames with the same key, for the message */
    char *f[3];       /* the wanted frame's key, path and type */
} ag__modstack_scan_out;
int ag__modstack_scan(const char *s, int want, ag__modstack_scan_out *o);
/* infer.c: the op argument of a constant graph argument (int, float, bool, ints, dtype, str;
 * borrowed, as the garg's); None for any other kind. */
ag_arg ag__garg_const_arg(const ag_garg *a);
void ag__garg_free(ag_garg *a);
const char *ag__recompute_name(ag_recompute r);

/* A call node with the given vals (no meta inference: the tracer already has them). */
ag_node *ag__graph_call_vals(ag_graph *g, const ag_op *op, const ag_garg *args, int nargs,
                             const ag_tmeta *vals, int nvals, const char *name);
/* trace.c: replaces call node n by the nodes fn emits when run on stand-ins for n's
 * arguments; AG_ENOTSUP from fn leaves the graph unchanged. */
int ag__trace_replace_node(ag_graph *g, ag_node *n, ag_decomp_fn fn);
/* trace.c: a tracing session over an existing graph (used by the joint export). begin makes
 * the thread trace into g (meta mode, the dispatcher hook) until end; functionalize records
 * mutating ops as their functional variants. */
typedef struct ag__tracer ag__tracer;
ag__tracer *ag__tracer_begin(ag_graph *g, bool functionalize);
void ag__tracer_end(ag__tracer *T);
void ag__tracer_set_tag(ag__tracer *T, const char *tag); /* partitioner_tag of new nodes */
void ag__tracer_set_stack_traces(ag__tracer *T, bool on);
void ag__tracer_bind(ag__tracer *T, ag_tensor *t, ag_node *n);
bool ag__tracer_bound(ag__tracer *T, const ag_tensor *t);
/* t's node in this session (a get_attr constant for a tensor with data made outside). */
ag_node *ag__tracer_node_of(ag__tracer *T, ag_tensor *t);
/* Effect tokens of a tracing session (the joint export): while a chain is set, the tracer
 * records each call of an effectful op as with_effects on the chain's current token and makes
 * the call's new token current (trace/trace_effects.c). `make` creates the chain's first token (a
 * placeholder) when the first effect needs it. */
typedef struct ag__token_chain ag__token_chain;
struct ag__token_chain {
    ag_node *(*make)(ag__token_chain *c);
    ag_node *cur; /* the current token, NULL before the chain's first effect */
};
void ag__tracer_set_token_chain(ag__tracer *T, ag__token_chain *c); /* NULL: none */
/* trace.c: gives n the session's metadata (seq_nr, tag, annotations, stack trace). */
int ag__tracer_node_meta(ag__tracer *T, ag_node *n);
/* trace/trace_effects.c: records op's call (graph args ga, outputs outs) as with_effects on c. */
int ag__trace_effect(ag__tracer *T, ag_graph *g, ag__token_chain *c, const ag_op *op,
                     const ag_garg *ga, int nargs, ag_tensor **outs, int nouts);
/* RNG functionalization (src/export/rng_functionalize.c): while set, a call of a random op
 * (AG_OP_RANDOM) reaches fn instead of being recorded. fn records a functional form and binds outs
 * (returns 0), asks for the call to be recorded as it is (returns 1), or fails (a negative status).
 */
typedef int (*ag__trace_random_fn)(void *ud, const ag_op *op, const ag_arg *args, int nargs,
                                   ag_tensor **outs, int nouts);
void ag__tracer_set_random(ag__tracer *T, ag__trace_random_fn fn, void *ud);
/* The RNG state a nested compile region's call draws from (region_trace.c): set with the random
 * hook by RNG functionalization, fn reserves the next n numbers of the session's current side and
 * gives 0-dim int64 tensors bound to its seed and to add(base_offset, numbers drawn before) (new
 * references). ag__tracer_rng_reserve calls it; without one it fails with AG_ENOTSUP. */
typedef int (*ag__trace_rng_reserve_fn)(void *ud, int64_t n, ag_tensor **seed, ag_tensor **offset);
void ag__tracer_set_rng_reserve(ag__tracer *T, ag__trace_rng_reserve_fn fn, void *ud);
bool ag__tracer_has_rng_reserve(const ag__tracer *T);
int ag__tracer_rng_reserve(ag__tracer *T, int64_t n, ag_tensor **seed, ag_tensor **offset);
/* trace/rng_draws.c: a random op's call as Philox draws from explicit state.
 * ag__rng_call_draws: whether the call of random op `op` draws (1) or is recorded as it is (0:
 * an evaluation-mode native_dropout); a negative status when it has no functional form.
 * ag__rng_record: records the call's functional form on T drawing from seed at
 * add(base, *drawn), binds outs to its nodes and advances *drawn by the numbers drawn. */
int ag__rng_call_draws(const ag_op *op, const ag_arg *args);
int ag__rng_record(ag__tracer *T, ag_tensor *seed, ag_tensor *base, int64_t *drawn, const ag_op *op,
                   const ag_arg *args, ag_tensor **outs);
/* Nested compile regions (trace/region_trace.c). The tracer's region hook traces a region into a
 * subgraph in a nested session (ag__tracer_begin_nested, ended by ag__tracer_end) and keeps
 * the regions it traced in the outermost session's cache (freed with the session). */
typedef struct ag__region_cache ag__region_cache;
void ag__region_cache_free(ag__region_cache *c); /* NULL: no-op */
int ag__trace_region(const ag__region *r, ag_tensor **outs, int max_out);
ag__tracer *ag__tracer_begin_nested(ag__tracer *parent, ag_graph *sub, const char *region);
ag__tracer *ag__tracer_active(void); /* the thread's active session, or NULL */
ag__tracer *ag__tracer_parent(const ag__tracer *T);
const char *ag__tracer_region(const ag__tracer *T); /* NULL unless nested */
ag_graph *ag__tracer_graph(const ag__tracer *T);
uint64_t ag__tracer_id(const ag__tracer *T);
ag__region_cache **ag__tracer_regions(ag__tracer *T);
/* Whether the session builds a joint (the export sets it): a region's first call then also
 * traces the region's joint. */
bool ag__tracer_joint(const ag__tracer *T);
void ag__tracer_set_joint(ag__tracer *T, bool on);
bool ag__tracer_in_backward(const ag__tracer *T);
int ag__tracer_outer_anns(const ag__tracer *T, ag_node *n);
int ag__tracer_attr_meta(ag__tracer *T, ag_node *n);
/* infer.c: runs the op's meta function on argument nodes' vals. */
int ag__infer_meta(const ag_op *op, const ag_garg *args, int nargs, ag_tmeta *vals, int *nvals);
/* infer.c: the op table's cost estimate (ag_op_cost) of a call node from its arguments' vals;
 * zero for other nodes. Used by the partitioner's runtime model. */
int ag__node_cost(const ag_node *n, ag_cost *c);
/* True when args[i] equals the schema default of the op's argument i. */
bool ag__garg_is_default(const ag_op *op, int i, const ag_garg *a);

#endif
