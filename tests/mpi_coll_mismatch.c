/* Ranks whose compiled graphs issue different collectives: the executor's collective-order
 * check (src/runtime/coll_order.c) ends the job at the plan's first run, before any collective
 * starts, naming the first collective that differs. tests/mpi_failure.sh runs it under mpirun
 * on 2 ranks and checks the message and that the job ended quickly.
 *   mpi_coll_mismatch op     rank 1's second collective is an all_gather, rank 0's an
 *                            all_reduce
 *   mpi_coll_mismatch count  rank 1's graph ends one collective early
 * (Graphs that agree pass the check: tests/test_dist_mpi.c runs one in checking mode.)
 * Every graph: x [4] -> all_reduce(sum) -> wait -> (collective 1) -> wait -> (collective 2) ->
 * wait -> output. */
#include <stdio.h>
#include <string.h>

#include "aotgrad.h"

static ag_node *call(ag_graph *g, const char *op, const ag_garg *a, int n, const char *name) {
    ag_node *r = ag_graph_call(g, ag_op_find(op), a, n, name);
    if (!r)
        ag_dist_abort(2, "building the graph: %s: %s", op, ag_last_error());
    return r;
}

#define C10D "_c10d_functional::"
#define ARGS(...)                                                                                  \
    (ag_garg[]){__VA_ARGS__}, (int)(sizeof((ag_garg[]){__VA_ARGS__}) / sizeof(ag_garg))

static ag_node *all_reduce(ag_graph *g, ag_node *x, const char *name, const char *wname) {
    ag_node *c = call(g, C10D "all_reduce", ARGS(AG_GA_N(x), AG_GA_S("sum"), AG_GA_S("0")), name);
    return call(g, C10D "wait_tensor", ARGS(AG_GA_N(c)), wname);
}

int main(int argc, char **argv) {
    if (argc != 2 || ag_dist_init())
        return 2;
    const char *mode = argv[1];
    ag_dist_set_timeout(20);
    int rank = ag_group_rank(ag_dist_world());
    int size = ag_group_size(ag_dist_world());
    bool differ = rank == 1;
    ag_graph *g = ag_graph_new();
    ag_tmeta m = {.dtype = AG_F32, .ndim = 1, .sizes = {4}, .strides = {1}};
    ag_node *x = ag_graph_placeholder(g, "x", &m);
    ag_node *y = all_reduce(g, x, "ar1", "w1");
    if (differ && !strcmp(mode, "op")) {
        ag_node *c = call(g, C10D "all_gather_into_tensor",
                          ARGS(AG_GA_N(y), AG_GA_I(size), AG_GA_S("0")), "ag2");
        y = call(g, C10D "wait_tensor", ARGS(AG_GA_N(c)), "w2");
    } else {
        y = all_reduce(g, y, "ar2", "w2");
    }
    if (!(differ && !strcmp(mode, "count")))
        y = all_reduce(g, y, "ar3", "w3");
    if (!ag_graph_output(g, &y, 1) || ag_graph_verify(g))
        ag_dist_abort(2, "building the graph: %s", ag_last_error());
    ag_plan_opts o = {.checking = true};
    ag_plan *p = ag_plan_new(g, &o);
    if (!p)
        ag_dist_abort(2, "plan_new: %s", ag_last_error());
    ag_tensor *in = ag_ones(AG_F32, 1, (int64_t[]){4});
    ag_tensor *out = NULL;
    if (ag_plan_run(p, &in, 1, &out, 1) != 1)
        ag_dist_abort(2, "plan_run: %s", ag_last_error());
    printf("rank %d: the plan ran (%g): the difference went unnoticed\n", rank,
           ag_tensor_item_at(out, 0));
    ag_tensor_free(out);
    ag_tensor_free(in);
    ag_plan_free(p);
    ag_graph_free(g);
    ag_dist_finalize();
    return 0;
}
