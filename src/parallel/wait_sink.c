/* Wait sinking: each wait_tensor moves down to just before the first node that uses its result,
 * so the collective it completes runs while the nodes in between compute (the executor makes
 * progress on pending collectives between nodes, dist.h).
 *
 * In: the rank's graph, each collective followed by its wait. Out: the same nodes, waits moved
 * down; a wait never moves past another collective (wait_tensor included), so collectives keep
 * their order relative to each other (every rank issues them in the same order, as MPI
 * requires, and the partitioner never reorders them). */
#include "shard_internal.h"

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
            ag_node *stop = next;
            while (stop && ag_node_index(stop) != first && !ag__node_is_collective(stop) &&
                   ag_node_kind_of(stop) != AG_NODE_OUTPUT)
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
