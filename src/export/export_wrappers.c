/* The pass state's builders that the export's hooks share (export_wrappers.h): the primals'
 * arrays, the output list in the layout's section order, the tangent descriptors. */
#include "export_wrappers.h"

static int grow(void **arr, int *cap, int need, size_t elem) {
    if (need <= *cap)
        return 0;
    int n = *cap ? *cap * 2 : 16;
    n = n < need ? need : n;
    void *a = ag__calloc((size_t)n, elem);
    if (!a)
        return AG_ENOMEM;
    if (*arr)
        memcpy(a, *arr, elem * (size_t)*cap);
    ag__free(*arr);
    *arr = a;
    *cap = n;
    return 0;
}

int ag__export_primals(ag__export_pass *st, int n) {
    size_t c = (size_t)(n ? n : 1);
    st->prim = ag__calloc(c, sizeof *st->prim);
    st->primal_t = ag__calloc(c, sizeof *st->primal_t);
    st->primal_descs = ag__calloc(c, sizeof *st->primal_descs);
    st->in_info = ag__calloc(c, sizeof *st->in_info);
    if (!st->prim || !st->primal_t || !st->primal_descs || !st->in_info)
        return AG_ENOMEM;
    st->np = n;
    return 0;
}

int ag__export_out(ag__export_pass *st, ag_section sec, ag_node *node, ag_desc *desc,
                   ag_tensor *tangent) {
    if (st->nout > 0 && sec < st->out[st->nout - 1].sec) {
        ag_desc_release(desc);
        return ag__err(AG_ESTATE, "export: an output of the %s after the %s", ag_section_name(sec),
                       ag_section_name(st->out[st->nout - 1].sec));
    }
    if (grow((void **)&st->out, &st->cap_out, st->nout + 1, sizeof *st->out)) {
        ag_desc_release(desc);
        return AG_ENOMEM;
    }
    st->out[st->nout++] = (ag__export_output){sec, node, desc, tangent, -1};
    return 0;
}

int ag__export_tangent(ag__export_pass *st, ag_desc *desc) {
    if (grow((void **)&st->tangent_descs, &st->cap_tangent_descs, st->ntangent_descs + 1,
             sizeof *st->tangent_descs)) {
        ag_desc_release(desc);
        return AG_ENOMEM;
    }
    st->tangent_descs[st->ntangent_descs++] = desc;
    return 0;
}
