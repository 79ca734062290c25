/* Module stacks on nodes: the typed accessors of include/aotgrad/graph.h ("module stacks"),
 * reading and writing the stack text that modstack_text.c builds and checks. */
#include "graph_internal.h"

#include <stdio.h>

static int stack_len(const ag_node *n, const char *key) {
    ag_mval v = ag_node_meta_get(n, key);
    if (v.kind != AG_MV_STR)
        return 0;
    ag__modstack_scan_out o;
    int rc = ag__modstack_scan(v.u.s, -1, &o);
    return rc < 0 ? rc : rc ? 0 : o.count;
}

static int stack_frame(const char *what, const ag_node *n, const char *key, int i, char **k,
                       char **path, char **type) {
    char **outs[3] = {k, path, type};
    for (int j = 0; j < 3; j++)
        if (outs[j])
            *outs[j] = NULL;
    AG__CHECK_NULL(what, n);
    ag_mval v = ag_node_meta_get(n, key);
    ag__modstack_scan_out o = {0};
    int rc = i >= 0 && v.kind == AG_MV_STR ? ag__modstack_scan(v.u.s, i, &o) : 1;
    if (rc < 0)
        return rc;
    if (rc)
        return ag__err(AG_EINVAL, "%s: %s has no frame %d (its %s has %d)", what, ag_node_name(n),
                       i, key, stack_len(n, key));
    for (int j = 0; j < 3; j++) {
        if (outs[j])
            *outs[j] = o.f[j];
        else
            ag__free(o.f[j]);
    }
    return 0;
}

static int set_stack(const char *what, ag_node *n, const char *key, const ag_module_frame *frames,
                     int count) {
    AG__CHECK_NULL(what, n);
    if (count < 0 || count > AG_MODULE_STACK_MAX)
        return ag__err(AG_EINVAL, "%s: %d frames (a stack has 0 to %d)", what, count,
                       AG_MODULE_STACK_MAX);
    if (count == 0)
        return ag_node_meta_del(n, key), 0;
    AG__CHECK_NULL(what, frames);
    const ag_module_frame *f = frames;
    for (int i = 0; i < count; i++) {
        if (!f[i].key || !f[i].path || !f[i].type)
            return ag__err(AG_EINVAL, "%s: frame %d has a NULL %s", what, i,
                           !f[i].key    ? "key"
                           : !f[i].path ? "path"
                                        : "type");
        for (int j = 0; j < i; j++)
            if (!strcmp(f[j].key, f[i].key))
                return ag__err(AG_EINVAL, "%s: frames %d and %d have the same key '%s'", what, j, i,
                               f[i].key);
    }
    char *text = NULL;
    for (int i = 0; i < count; i++) {
        char *next = ag__modstack_push(text, f[i].key, f[i].path, f[i].type);
        ag__free(text);
        if (!(text = next))
            return AG_ENOMEM;
    }
    const char *shared = ag__graph_shared_str(n->graph, text);
    ag__free(text);
    return shared ? ag__node_meta_set_shared(n, key, shared) : AG_ENOMEM;
}

int ag_node_nn_module_stack_len(const ag_node *n) {
    return n ? stack_len(n, "nn_module_stack") : 0;
}
int ag_node_fwd_nn_module_stack_len(const ag_node *n) {
    return n ? stack_len(n, "fwd_nn_module_stack") : 0;
}
int ag_node_nn_module_stack(const ag_node *n, int i, char **key, char **path, char **type) {
    return stack_frame("node_nn_module_stack", n, "nn_module_stack", i, key, path, type);
}
int ag_node_fwd_nn_module_stack(const ag_node *n, int i, char **key, char **path, char **type) {
    return stack_frame("node_fwd_nn_module_stack", n, "fwd_nn_module_stack", i, key, path, type);
}
int ag_node_set_nn_module_stack(ag_node *n, const ag_module_frame *frames, int count) {
    return set_stack("node_set_nn_module_stack", n, "nn_module_stack", frames, count);
}
int ag_node_set_fwd_nn_module_stack(ag_node *n, const ag_module_frame *frames, int count) {
    return set_stack("node_set_fwd_nn_module_stack", n, "fwd_nn_module_stack", frames, count);
}
