/* igraph_maxflow on the min-cut partitioner's flow network: the reference our Dinic
 * (src/partition/mincut.c) is checked against by test_partition and timed against by
 * bench/bench_maxflow.c. igraph is GPL, so this file is compiled into those two programs only;
 * libaotgrad never links it. */
#ifndef AG_TESTS_MAXFLOW_IGRAPH_H
#define AG_TESTS_MAXFLOW_IGRAPH_H

#include "../src/partition/partition_internal.h"

/* The flow value and each edge's flow (net->nedges entries). 0, or a negative status with the
 * message. */
int ag__maxflow_igraph(const ag__flow_net *net, double *value, double *flow);

#endif
