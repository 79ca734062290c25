/* Wait sinking: each wait_tensor moves down to just before the first node that uses its result,
 * so the collective it completes runs while the nodes in between compute (the executor makes
 * progress on pending collectives between nodes, dist.h).
 *
 * In: the rank's graph, each collective followed by its wait. Out: the same nodes, waits moved
 * down; a wait never moves past another collective (wait_tensor included), so collectives keep
 * their order relative to each other (every rank issues them in the same order, as MPI
 * requires, and the partitioner never reorders them), nor past a node of the other pass (a
 * forward wait stays in the forward, a backward one in the backward). */
#include "shard_internal.h"

/* A node of the other pass (a forward wait never sinks into the backward). */
static bool other_side(const char *tag, const ag_node *n) {
    const char *t = ag_node_partitioner_tag(n);
    return tag && t && strcmp(tag, t);
}

int ag__sink_waits(ag_graph *g) {
    int moved = 0;
    ag_node *n = ag_graph_first(g);
    while (n) {
        ag_node *next = ag_node_next(n);
        if (ag__node_is_op(n, AG__C10D_WAIT)) {
            int first = -1;
            for (int u = 0; u < ag_node_num_users(n); u++) {
                int i = ag_node_index(ag_node_user(n, u));
                if (first < 0 || i < first)
                    first = i;
            }
            const char *tag = ag_node_partitioner_tag(n);
            ag_node *stop = next;
            while (stop && ag_node_index(stop) != first && !ag__node_is_collective(stop) &&
                   ag_node_kind_of(stop) != AG_NODE_OUTPUT && !other_side(tag, stop))
                stop = ag_node_next(stop);
            if (stop && stop != next) {
                int rc = ag_graph_move_before(g, n, stop);
                if (rc)
                    return rc;
                moved++;
            }
        }
        n = next;
    }
    return moved;
}
