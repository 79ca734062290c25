/* The executor's fusion of elementwise chains (fuse.c), used by plan.c.
 *
 * At ag_plan_new the plan offers each run of consecutive kernel steps to ag__fuse_match, which
 * recognizes chains of ops that a fused kernel computes in one pass (src/ops/fused.h). A match
 * makes the chain's first step run the whole group: the plan hands the fused function every
 * member's bound arguments and outputs. The graph is not changed (printing it shows the ops),
 * and results are bit-identical to running the members one by one. */
#ifndef AG_RUNTIME_FUSE_H
#define AG_RUNTIME_FUSE_H

#include "../core/internal.h"
#include "aotgrad/graph.h"

#define AG__FUSE_MAX 3 /* members of a group, at most */

/* One member of a group as the plan bound it: its op, arguments (defaults filled) and
 * outputs. */
typedef struct ag__fuse_member {
    const ag_op *op;
    const ag_arg *args;
    ag_tensor *const *outs;
} ag__fuse_member;

/* A fused group's kernel: 0, a negative status, or 1 when this run's operands are not a case
 * it handles (layouts, or buffers that the memory plan lets one member's outputs share with
 * an earlier member's inputs): the plan then runs the members one by one. */
typedef int (*ag__fused_fn)(const ag__fuse_member *m, uint32_t flags);

typedef struct ag__fusion {
    const char *name;  /* "addmm+gelu", ... */
    const char *label; /* the name the profile's step hook sees: "fused:addmm+gelu" */
    int n;             /* members */
    ag__fused_fn run;
    /* The plan keeps what every member reads alive until the group's last member, so that no
     * member's output is placed over memory the fused kernel still reads. A group whose kernel
     * tolerates a later member's output placed exactly over an earlier member's input (the
     * same elements, each read before it is written) and whose glue declines every other
     * overlap sets this: its members' reads end where they would one by one, and the plan
     * needs no more memory than unfused. */
    bool reads_end_early;
} ag__fusion;

/* A match: the rule and what the match found out about the chain (FUSE_* flags of fuse.c). */
typedef struct ag__fuse_group {
    const ag__fusion *f;
    uint32_t flags;
} ag__fuse_group;

/* Whether the kernel calls chain[0], chain[1], ... chain[n - 1] (consecutive kernel steps of a
 * plan, in order) start a fusable group; the group's length (2 or more, at most n) with *g set,
 * or 0. */
int ag__fuse_match(ag_node *const *chain, int n, ag__fuse_group *g);

/* Whether fusion is turned off for plans made from now on by the environment
 * (AG_NO_FUSION set to anything but "0" or ""). */
bool ag__fuse_disabled_by_env(void);

#endif
