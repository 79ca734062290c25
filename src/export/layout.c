/* The calling convention as data (ag_layout, include/aotgrad/export.h).
 *
 * In: a graph whose placeholders and output carry descriptors. Out: the ranges of its inputs and
 * outputs that form each section (forward tokens, primals, tangents, ...), read from the
 * descriptors alone: each kind belongs to one section (the descriptor table in desc.c says
 * which), and sections come in the order of ag_section. Every stage that needs to know where the
 * tangents or the gradients are asks the layout; nothing counts offsets of its own. */
#include "../core/internal.h"
#include "aotgrad/export.h"

#include <stdio.h>

static int place(ag_layout *L, ag_section s, int i, ag_section *last, const char *what,
                 const char *name, const ag_desc *d) {
    if (s < *last) {
        char r[256];
        if (d)
            ag_desc_repr(d, r, sizeof r);
        else
            snprintf(r, sizeof r, "None");
        return ag__err(AG_EINVAL,
                       "layout: %s %d (%s, %s) belongs to the %s, which come before "
                       "the %s already seen",
                       what, i, name, r, ag_section_name(s), ag_section_name(*last));
    }
    if (L->sec[s].count == 0)
        L->sec[s].start = i;
    L->sec[s].count++;
    *last = s;
    return 0;
}

int ag_graph_layout(const ag_graph *g, int nsaved, ag_layout *out) {
    AG__CHECK_NULL("graph_layout", g);
    AG__CHECK_NULL("graph_layout", out);
    ag_layout L;
    memset(&L, 0, sizeof L);
    ag_node **ph;
    int nph = ag_graph_placeholders(g, &ph);
    if (nph < 0)
        return nph;
    if (nsaved < 0 || nsaved > nph)
        return ag__err(AG_EINVAL, "layout: %d saved inputs asked of a graph with %d placeholders",
                       nsaved, nph);
    ag_section last = AG_SEC_IN_FW_TOKENS;
    for (int i = 0; i < nph; i++) {
        const ag_desc *d = ag_node_desc(ph[i]);
        ag_section s = i < nsaved ? AG_SEC_IN_SAVED : d ? ag_desc_section(d) : AG_SEC_NONE;
        if (s == AG_SEC_NONE)
            return ag__err(AG_EINVAL, "layout: placeholder %d (%s) has no descriptor", i,
                           ag_node_name(ph[i]));
        if (!ag_section_is_input(s))
            return ag__err(AG_EINVAL, "layout: placeholder %d (%s) carries an output descriptor", i,
                           ag_node_name(ph[i]));
        int rc = place(&L, s, i, &last, "placeholder", ag_node_name(ph[i]), d);
        if (rc)
            return rc;
    }
    L.ninputs = nph;
    ag_node *o = ag_graph_output_node(g);
    if (!o)
        return ag__err(AG_EINVAL, "layout: the graph has no output node");
    int no = ag_node_arg(o, 0)->n;
    if (no > 0 && !ag_node_has_output_descs(o))
        return ag__err(AG_EINVAL, "layout: the output node carries no descriptors");
    last = AG_SEC_OUT_FW_TOKENS;
    for (int i = 0; i < no; i++) {
        const ag_desc *d = ag_node_output_desc(o, i);
        ag_section s = ag_desc_section(d);
        if (ag_section_is_input(s))
            return ag__err(AG_EINVAL, "layout: output %d carries an input descriptor", i);
        const ag_node *v = ag_node_arg(o, 0)->u.nodes[i];
        int rc = place(&L, s, i, &last, "output", v ? ag_node_name(v) : "None", d);
        if (rc)
            return rc;
    }
    L.noutputs = no;
    /* An empty section starts where it would be. */
    for (int s = 0, pos = 0; s < AG_SEC_COUNT; s++) {
        if (s == AG_SEC_OUT_FW_TOKENS)
            pos = 0;
        if (L.sec[s].count == 0)
            L.sec[s].start = pos;
        pos = L.sec[s].start + L.sec[s].count;
    }
    *out = L;
    return 0;
}

int ag_layout_count(const ag_layout *L, ag_section s) {
    return L && (unsigned)s < AG_SEC_COUNT ? L->sec[s].count : 0;
}

int ag_layout_start(const ag_layout *L, ag_section s) {
    return L && (unsigned)s < AG_SEC_COUNT ? L->sec[s].start : -1;
}

/* The outputs a forward produces (the partitioner's num_fwd_outputs): every output section
 * before the saved values and the gradients. */
int ag_layout_num_fw_outputs(const ag_layout *L) {
    int n = 0;
    for (int s = AG_SEC_OUT_FW_TOKENS; L && s < AG_SEC_OUT_SAVED; s++)
        n += L->sec[s].count;
    return n;
}
