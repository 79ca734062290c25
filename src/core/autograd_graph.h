/* The autograd graph's nodes (autograd_graph.c), shared with the engine that runs them
 * (src/autograd/engine.c). */
#ifndef AG_AUTOGRAD_GRAPH_H
#define AG_AUTOGRAD_GRAPH_H

#include "internal.h"

typedef struct ag_edge {
    struct ag_anode *fn; /* producing node, or NULL */
    int input_nr;        /* output slot of fn */
    ag_tensor *leaf;     /* leaf that requires grad, or NULL */
} ag_edge;

typedef struct ag_anode {
    int64_t refcount;
    int64_t seq_nr;
    const ag_op *op;
    int nargs;
    ag_arg args[AG_MAX_ARGS];
    void *argmem; /* copied int lists and tensor-list arrays */
    int ntin;
    ag_edge *edges;
    ag_tmeta *in_meta;
    int nout;
    ag_tensor *saved_out[AG_MAX_OUTPUTS];
    uint64_t saved_ver[32 + AG_MAX_OUTPUTS]; /* save_args has 32 bits */
    int nsaved_ver;
    bool released;
    bool has_saved;
    /* engine scratch */
    uint64_t epoch;
    int64_t idx;
    int64_t bufoff;             /* first slot of this node's output grads in engine.buf */
    struct ag_anode *free_next; /* release worklist */
    int cap_in;                 /* custom nodes: room in edges and in_meta (recycling) */
    /* A custom node (op == NULL): a compiled function's backward. */
    const char *custom_name;
    ag__custom_bw_fn custom_bw;
    void *custom_ud;
    void (*custom_free)(void *);
} ag_anode;

/* The node's name: its op's, or a custom node's. */
static inline const char *ag__anode_name(const ag_anode *n) {
    return n->op ? n->op->name : n->custom_name;
}
/* Drops the tensors n saved for its backward (a pass that does not retain the graph). */
void ag__anode_release_saved(ag_anode *n);
/* Frees the thread's spare custom node (a thread cache, see ag__thread_caches_register). */
void ag__anode_cache_release(void);

#endif
