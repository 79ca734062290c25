/* The FX utilities for joint graphs with descriptors, as upstream's
 * torch._functorch._aot_autograd.fx_utils: they pair each differentiable input with the node
 * computing its gradient, each differentiable output with its tangent placeholder, and name
 * the parameter and buffer placeholders by FQN.
 *
 * In: a joint graph whose placeholders carry input descriptors and whose output node carries
 * one descriptor (or None) per output (what ag_export_joint makes, or any graph a user
 * rewrote, e.g. sharded, keeping the descriptors). Out: insertion-ordered maps keyed by
 * descriptor (ag_fx_pairs) or FQN (ag_fx_named), in graph order. The graph is only read.
 *
 * Semantics follow upstream exactly, with two deliberate differences: a placeholder whose
 * descriptor is SubclassGetAttrAOTInput is refused by ag_fx_all_input_and_grad_nodes before
 * the differentiability filter (upstream's check sits after the filter, which always skips
 * it, so subclass inputs would be dropped silently), and an output node whose descriptor
 * list is not as long as its output list is an error (upstream zips the two and drops the
 * excess). Upstream's KeyErrors and assertions are errors with messages naming the node and
 * the descriptor. */
#include "../core/internal.h"
#include "../core/strmap.h"
#include "../graph/graph_internal.h"

#include <stdint.h>

/* ---- pairs ----
 * The descriptor map keeps the keys and their order; first[i] / second[i] belong to the map's
 * entry i. Overwriting a key keeps its position, as a Python dict does. */
struct ag_fx_pairs {
    ag_desc_map *map;
    ag_node **first, **second;
    int64_t cap;
};

void ag_fx_pairs_free(ag_fx_pairs *p) {
    if (!p)
        return;
    ag_desc_map_free(p->map);
    ag__free(p->first);
    ag__free(p->second);
    ag__free(p);
}

static ag_fx_pairs *pairs_new(void) {
    ag_fx_pairs *p = ag__calloc(1, sizeof *p);
    if (p && !(p->map = ag_desc_map_new())) {
        ag__free(p);
        p = NULL;
    }
    return p;
}

/* Inserts or overwrites key -> (a, b); returns the entry's index or AG_ENOMEM (p unchanged). */
static int64_t pairs_put(ag_fx_pairs *p, const ag_desc *key, ag_node *a, ag_node *b) {
    int64_t i = ag_desc_map_find(p->map, key);
    if (i < 0) {
        int64_t n = ag_desc_map_size(p->map), c1 = p->cap, c2 = p->cap;
        /* Both arrays keep the same capacity: grow each from the same starting value. */
        if (ag__grow((void **)&p->first, &c1, n + 1, sizeof *p->first) ||
            ag__grow((void **)&p->second, &c2, n + 1, sizeof *p->second))
            return AG_ENOMEM;
        p->cap = c1 < c2 ? c1 : c2;
        if (ag_desc_map_put(p->map, key, NULL))
            return AG_ENOMEM;
        i = n;
    }
    p->first[i] = a;
    p->second[i] = b;
    return i;
}

int ag_fx_pairs_count(const ag_fx_pairs *p) {
    return p ? (int)ag_desc_map_size(p->map) : 0;
}

const ag_desc *ag_fx_pairs_desc(const ag_fx_pairs *p, int i) {
    return p ? ag_desc_map_key(p->map, i) : NULL;
}

ag_node *ag_fx_pairs_first(const ag_fx_pairs *p, int i) {
    return p && i >= 0 && i < ag_fx_pairs_count(p) ? p->first[i] : NULL;
}

ag_node *ag_fx_pairs_second(const ag_fx_pairs *p, int i) {
    return p && i >= 0 && i < ag_fx_pairs_count(p) ? p->second[i] : NULL;
}

int ag_fx_pairs_find(const ag_fx_pairs *p, const ag_desc *d) {
    return p && d ? (int)ag_desc_map_find(p->map, d) : -1;
}

/* ---- helpers ---- */

/* A descriptor's repr for a message, cut at the buffer's size. */
static const char *drepr(const ag_desc *d, char *buf, size_t n) {
    size_t len = ag_desc_repr(d, buf, n);
    if (len >= n && n > 4)
        memcpy(buf + n - 4, "...", 4);
    return buf;
}

static const char *nname(const ag_node *n) {
    return n ? ag_node_name(n) : "None";
}

/* The output node's outputs: their count (and the array in *outs), or a negative status. */
static int output_list(const char *who, const ag_node *out, ag_node *const **outs) {
    const ag_garg *a = ag_node_nargs(out) > 0 ? ag_node_arg(out, 0) : NULL;
    if (!a || a->kind != AG_GA_NODES)
        return ag__err(AG_EINVAL, "%s: the output node %s does not hold a list of outputs", who,
                       ag_node_name(out));
    if (!ag_node_has_output_descs(out))
        return ag__err(AG_EINVAL,
                       "%s: the output node %s has no descriptors (is this a joint graph from "
                       "ag_export_joint?)",
                       who, ag_node_name(out));
    /* ag_node_set_output_descs sets exactly one per output, but a later edit of the output
     * list (ag_node_set_arg) can break the alignment; pairing by position would then be wrong.
     * The public API has no descriptor count (ag_node_output_desc answers NULL, None, past the
     * end), hence the internal header. */
    if (out->nout_descs != a->n)
        return ag__err(AG_EINVAL, "%s: the output node %s has %d outputs but %d descriptors", who,
                       ag_node_name(out), a->n, out->nout_descs);
    *outs = a->u.nodes;
    return a->n;
}

/* A placeholder's descriptor, or an error naming it. */
static const ag_desc *ph_desc(const char *who, const ag_node *n) {
    const ag_desc *d = ag_node_desc(n);
    if (!d)
        ag__err(AG_EINVAL,
                "%s: placeholder %s has no descriptor (is this a joint graph from "
                "ag_export_joint?)",
                who, ag_node_name(n));
    return d;
}

/* Upstream's _raise_autograd_subclass_not_implemented, word for word after the function's
 * name (it says "input" for outputs too). */
static int subclass_error(const char *who, const char *node, const ag_desc *d) {
    char b[256];
    return ag__err(AG_ENOTSUP,
                   "%s: Subclasses are currently not supported by this function, but a desugared "
                   "subclass input was found at %s (%s).  The problem is that there may not "
                   "necessarily be a 1-1 correspondence between primals/tangents/outputs/grads "
                   "when subclasses are involved: for example, the primal might be a plain tensor "
                   "but the tangent a tensor subclass that desugared into multiple plain tensors. "
                   "It is not clear what exactly you would like this function to do in this case "
                   "(Collect all nodes for the subclass together?  Match up the inner nodes if "
                   "subclasses match exactly?)  If you have a concrete use case, please file an "
                   "issue so we can understand it and design an API that works for your case.",
                   who, node, drepr(d, b, sizeof b));
}

static int subclass_input_error(const char *who, const ag_node *n, const ag_desc *d) {
    return subclass_error(who, ag_node_name(n), d);
}

static int subclass_output_error(const char *who, const ag_node *n, const ag_desc *d) {
    return subclass_error(who, nname(n), d);
}

/* ---- input -> grad ---- */

static ag_fx_pairs *input_and_grad(const char *who, const ag_graph *g) {
    if (!g)
        return ag__err(AG_EINVAL, "%s: g is NULL", who), NULL;
    ag_fx_pairs *p = pairs_new();
    if (!p)
        return NULL;
    char b1[256], b2[256];
    for (ag_node *n = ag_graph_first(g); n; n = ag_node_next(n)) {
        ag_node_kind k = ag_node_kind_of(n);
        if (k == AG_NODE_PLACEHOLDER) {
            const ag_desc *d = ph_desc(who, n);
            if (!d)
                goto fail;
            if (ag_desc_kind_of(d) == AG_DESC_SUBCLASS_GETATTR_INPUT) {
                subclass_input_error(who, n, d);
                goto fail;
            }
            /* tokens, philox seeds, subclass sizes, dummies: nothing to differentiate */
            if (!ag_desc_is_differentiable(d))
                continue;
            if (pairs_put(p, d, n, NULL) < 0)
                goto fail;
        } else if (k == AG_NODE_OUTPUT) {
            ag_node *const *outs;
            int cnt = output_list(who, n, &outs);
            if (cnt < 0)
                goto fail;
            for (int i = 0; i < cnt; i++) {
                const ag_desc *d = ag_node_output_desc(n, i);
                if (!d)
                    continue;
                if (ag_desc_kind_of(d) == AG_DESC_SUBCLASS_GETATTR_OUTPUT) {
                    subclass_output_error(who, outs[i], d);
                    goto fail;
                }
                if (ag_desc_kind_of(d) != AG_DESC_GRAD)
                    continue;
                const ag_desc *of = ag_desc_nested(d);
                int j = ag_fx_pairs_find(p, of);
                if (j < 0) {
                    ag__err(AG_EINVAL,
                            "%s: output %d (%s) is %s, but no differentiable placeholder has "
                            "the descriptor %s",
                            who, i, nname(outs[i]), drepr(d, b1, sizeof b1),
                            drepr(of, b2, sizeof b2));
                    goto fail;
                }
                if (p->second[j]) {
                    ag__err(AG_EINVAL,
                            "%s: %s has two gradients: %s and output %d (%s); a joint graph has "
                            "one GradAOTOutput per input",
                            who, drepr(of, b1, sizeof b1), nname(p->second[j]), i, nname(outs[i]));
                    goto fail;
                }
                p->second[j] = outs[i];
            }
        }
    }
    return p;
fail:
    ag_fx_pairs_free(p);
    return NULL;
}

ag_fx_pairs *ag_fx_all_input_and_grad_nodes(const ag_graph *g) {
    return input_and_grad("ag_fx_all_input_and_grad_nodes", g);
}

/* ---- output -> tangent ---- */

static ag_fx_pairs *output_and_tangent(const char *who, const ag_graph *g) {
    if (!g)
        return ag__err(AG_EINVAL, "%s: g is NULL", who), NULL;
    ag_fx_pairs *p = pairs_new();
    if (!p)
        return NULL;
    char b1[256];
    /* First the outputs, so a tangent placeholder (which comes before the output node) can
     * find its output. */
    for (ag_node *n = ag_graph_first(g); n; n = ag_node_next(n)) {
        if (ag_node_kind_of(n) != AG_NODE_OUTPUT)
            continue;
        ag_node *const *outs;
        int cnt = output_list(who, n, &outs);
        if (cnt < 0)
            goto fail;
        for (int i = 0; i < cnt; i++) {
            const ag_desc *d = ag_node_output_desc(n, i);
            if (!d)
                continue;
            if (ag_desc_kind_of(d) == AG_DESC_SUBCLASS_GETATTR_OUTPUT) {
                subclass_output_error(who, outs[i], d);
                goto fail;
            }
            if (ag_desc_is_differentiable(d) && pairs_put(p, d, outs[i], NULL) < 0)
                goto fail;
        }
    }
    for (ag_node *n = ag_graph_first(g); n; n = ag_node_next(n)) {
        if (ag_node_kind_of(n) != AG_NODE_PLACEHOLDER)
            continue;
        const ag_desc *d = ph_desc(who, n);
        if (!d)
            goto fail;
        if (ag_desc_kind_of(d) == AG_DESC_SUBCLASS_GETATTR_INPUT) {
            subclass_input_error(who, n, d);
            goto fail;
        }
        if (ag_desc_kind_of(d) != AG_DESC_TANGENT)
            continue;
        const ag_desc *of = ag_desc_nested(d);
        int j = ag_fx_pairs_find(p, of);
        if (j < 0) {
            ag__err(AG_EINVAL,
                    "%s: placeholder %s is the tangent of %s, but no output has that "
                    "descriptor",
                    who, ag_node_name(n), drepr(of, b1, sizeof b1));
            goto fail;
        }
        if (p->second[j]) {
            ag__err(AG_EINVAL, "%s: %s has two tangents: placeholders %s and %s", who,
                    drepr(of, b1, sizeof b1), ag_node_name(p->second[j]), ag_node_name(n));
            goto fail;
        }
        p->second[j] = n;
    }
    return p;
fail:
    ag_fx_pairs_free(p);
    return NULL;
}

ag_fx_pairs *ag_fx_all_output_and_tangent_nodes(const ag_graph *g) {
    return output_and_tangent("ag_fx_all_output_and_tangent_nodes", g);
}

/* ---- filtered views ---- */

static ag_fx_pairs *filter(ag_fx_pairs *all, ag_desc_kind kind) {
    if (!all)
        return NULL;
    ag_fx_pairs *p = pairs_new();
    for (int i = 0; p && i < ag_fx_pairs_count(all); i++) {
        const ag_desc *d = ag_fx_pairs_desc(all, i);
        if (ag_desc_kind_of(d) == kind && pairs_put(p, d, all->first[i], all->second[i]) < 0) {
            ag_fx_pairs_free(p);
            p = NULL;
        }
    }
    ag_fx_pairs_free(all);
    return p;
}

ag_fx_pairs *ag_fx_param_and_grad_nodes(const ag_graph *g) {
    return filter(input_and_grad("ag_fx_param_and_grad_nodes", g), AG_DESC_PARAM);
}

ag_fx_pairs *ag_fx_plain_input_and_grad_nodes(const ag_graph *g) {
    return filter(input_and_grad("ag_fx_plain_input_and_grad_nodes", g), AG_DESC_PLAIN_INPUT);
}

ag_fx_pairs *ag_fx_plain_output_and_tangent_nodes(const ag_graph *g) {
    return filter(output_and_tangent("ag_fx_plain_output_and_tangent_nodes", g),
                  AG_DESC_PLAIN_OUTPUT);
}

/* ---- FQN -> placeholder ----
 * names[i] are the map's keys (owned here); the string map gives each name's index + 1. */
struct ag_fx_named {
    char **names;
    ag_node **nodes;
    int64_t n, cap;
    ag__strmap index;
};

void ag_fx_named_free(ag_fx_named *m) {
    if (!m)
        return;
    ag__strmap_free(&m->index);
    for (int64_t i = 0; i < m->n; i++)
        ag__free(m->names[i]);
    ag__free(m->names);
    ag__free(m->nodes);
    ag__free(m);
}

/* Inserts or overwrites (later duplicates win, keeping the first position, as upstream's dict
 * assignment does). */
static int named_put(ag_fx_named *m, const char *name, ag_node *node) {
    intptr_t at = (intptr_t)ag__strmap_get(&m->index, name);
    if (at) {
        m->nodes[at - 1] = node;
        return 0;
    }
    int64_t c1 = m->cap, c2 = m->cap;
    if (ag__grow((void **)&m->names, &c1, m->n + 1, sizeof *m->names) ||
        ag__grow((void **)&m->nodes, &c2, m->n + 1, sizeof *m->nodes))
        return AG_ENOMEM;
    m->cap = c1 < c2 ? c1 : c2;
    char *s = ag__strdup(name);
    if (!s)
        return AG_ENOMEM;
    if (ag__strmap_put(&m->index, s, (void *)(intptr_t)(m->n + 1))) {
        ag__free(s);
        return AG_ENOMEM;
    }
    m->names[m->n] = s;
    m->nodes[m->n] = node;
    m->n++;
    return 0;
}

static ag_fx_named *named_nodes(const char *who, const ag_graph *g, ag_desc_kind kind) {
    if (!g)
        return ag__err(AG_EINVAL, "%s: g is NULL", who), NULL;
    ag_fx_named *m = ag__calloc(1, sizeof *m);
    if (!m)
        return NULL;
    char b[256];
    for (ag_node *n = ag_graph_first(g); n; n = ag_node_next(n)) {
        if (ag_node_kind_of(n) != AG_NODE_PLACEHOLDER)
            continue;
        const ag_desc *d = ph_desc(who, n);
        if (!d)
            goto fail;
        if (ag_desc_kind_of(d) == AG_DESC_SUBCLASS_GETATTR_INPUT) {
            /* upstream's _raise_fqn_subclass_not_implemented */
            ag__err(AG_ENOTSUP,
                    "%s: Subclasses are currently not supported by this function, but a "
                    "desugared subclass input was found at %s (%s).  The problem is that there "
                    "may not necessarily be a 1-1 correspondence between a FQN and a plain tensor "
                    "when subclasses are involved: for example, a parameter that is a subclass "
                    "would desugar into multiple plain tensors, which we can't uniquely assign the "
                    "FQN to.  It's not clear what you want the API to do in this case: do you want "
                    "to instead return a struct of nodes showing how to assemble the subclass?  "
                    "But you don't (directly) have the metadata for the subclass?  If you have a "
                    "concrete use case, please file an issue so we can understand it and design an "
                    "API that works for your case.",
                    who, ag_node_name(n), drepr(d, b, sizeof b));
            goto fail;
        }
        if (ag_desc_kind_of(d) == kind && named_put(m, ag_desc_target(d), n))
            goto fail;
    }
    return m;
fail:
    ag_fx_named_free(m);
    return NULL;
}

ag_fx_named *ag_fx_named_param_nodes(const ag_graph *g) {
    return named_nodes("ag_fx_named_param_nodes", g, AG_DESC_PARAM);
}

ag_fx_named *ag_fx_named_buffer_nodes(const ag_graph *g) {
    return named_nodes("ag_fx_named_buffer_nodes", g, AG_DESC_BUFFER);
}

int ag_fx_named_count(const ag_fx_named *m) {
    return m ? (int)m->n : 0;
}

const char *ag_fx_named_name(const ag_fx_named *m, int i) {
    return m && i >= 0 && i < m->n ? m->names[i] : NULL;
}

ag_node *ag_fx_named_node(const ag_fx_named *m, int i) {
    return m && i >= 0 && i < m->n ? m->nodes[i] : NULL;
}

ag_node *ag_fx_named_get(const ag_fx_named *m, const char *fqn) {
    if (!m || !fqn)
        return NULL;
    intptr_t at = (intptr_t)ag__strmap_get(&m->index, fqn);
    return at ? m->nodes[at - 1] : NULL;
}

static int nodes_of(const char *who, const ag_graph *g, ag_desc_kind kind, ag_node **out, int max) {
    if (max < 0 || (max > 0 && !out))
        return ag__err(AG_EINVAL, "%s: bad output array (max %d%s)", who, max,
                       out ? "" : ", out NULL");
    ag_fx_named *m = named_nodes(who, g, kind);
    if (!m)
        return ag_last_status();
    int cnt = (int)m->n;
    for (int i = 0; i < cnt && i < max; i++)
        out[i] = m->nodes[i];
    ag_fx_named_free(m);
    return cnt;
}

int ag_fx_param_nodes(const ag_graph *g, ag_node **out, int max) {
    return nodes_of("ag_fx_param_nodes", g, AG_DESC_PARAM, out, max);
}

int ag_fx_buffer_nodes(const ag_graph *g, ag_node **out, int max) {
    return nodes_of("ag_fx_buffer_nodes", g, AG_DESC_BUFFER, out, max);
}
