/* igraph_maxflow, the max-flow reference of the tests and bench_maxflow (maxflow_igraph.h). */
#include "maxflow_igraph.h"

#include <igraph/igraph.h>

int ag__maxflow_igraph(const ag__flow_net *net, double *value, double *flow) {
    igraph_error_handler_t *old = igraph_set_error_handler(igraph_error_handler_ignore);
    igraph_t g;
    igraph_vector_int_t edges;
    igraph_vector_t cap, fl;
    int rc = AG_ENOMEM;
    bool have_g = false, have_e = false, have_c = false, have_f = false;
    if (igraph_vector_int_init(&edges, 2 * (igraph_integer_t)net->nedges))
        goto done;
    have_e = true;
    for (int e = 0; e < net->nedges; e++) {
        VECTOR(edges)[2 * e] = net->from[e];
        VECTOR(edges)[2 * e + 1] = net->to[e];
    }
    if (igraph_vector_init(&cap, net->nedges))
        goto done;
    have_c = true;
    for (int e = 0; e < net->nedges; e++)
        VECTOR(cap)[e] = net->cap[e];
    if (igraph_vector_init(&fl, 0))
        goto done;
    have_f = true;
    if (igraph_create(&g, &edges, net->nverts, IGRAPH_DIRECTED))
        goto done;
    have_g = true;
    igraph_real_t v = 0;
    if (igraph_maxflow(&g, &v, &fl, NULL, NULL, NULL, net->source, net->sink, &cap, NULL)) {
        rc = ag__err(AG_ENOMEM, "partition: igraph_maxflow failed");
        goto done;
    }
    *value = v;
    for (int e = 0; e < net->nedges; e++)
        flow[e] = VECTOR(fl)[e];
    rc = 0;
done:
    if (have_g)
        igraph_destroy(&g);
    if (have_f)
        igraph_vector_destroy(&fl);
    if (have_c)
        igraph_vector_destroy(&cap);
    if (have_e)
        igraph_vector_int_destroy(&edges);
    igraph_set_error_handler(old);
    if (rc == AG_ENOMEM && !ag__has_error())
        ag__err(AG_ENOMEM, "partition: igraph ran out of memory");
    return rc;
}
