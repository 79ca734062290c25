/* The strided iterator behind pointwise kernels (see kernel_util.h). */
#include "kernel_util.h"

void ag__iter_build(ag__iter *it, ag_tensor *const *ops, int n) {
    const ag_tensor *out = ops[0];
    int nd = out->ndim;
    int64_t sizes[AG_MAX_DIMS];
    int64_t strides[AG__ITER_MAX][AG_MAX_DIMS];
    for (int d = 0; d < nd; d++)
        sizes[d] = out->sizes[d];
    for (int k = 0; k < n; k++) {
        const ag_tensor *t = ops[k];
        it->base[k] = t->storage->data ? ag__base(t) : NULL;
        /* Right-align t's dims with out's; missing or size-1 dims broadcast with stride 0. */
        for (int d = 0; d < nd; d++) {
            int td = d - (nd - t->ndim);
            strides[k][d] = (td < 0 || t->sizes[td] == 1) ? 0 : t->strides[td];
        }
    }
    /* Drop size-1 dims, then merge neighbours that are contiguous for every operand. */
    int m = 0;
    for (int d = 0; d < nd; d++) {
        if (sizes[d] == 1)
            continue;
        if (m > 0) {
            bool merge = true;
            for (int k = 0; k < n; k++)
                if (it->strides[k][m - 1] != strides[k][d] * sizes[d])
                    merge = false;
            if (merge) {
                it->sizes[m - 1] *= sizes[d];
                for (int k = 0; k < n; k++)
                    it->strides[k][m - 1] = strides[k][d];
                continue;
            }
        }
        it->sizes[m] = sizes[d];
        for (int k = 0; k < n; k++)
            it->strides[k][m] = strides[k][d];
        m++;
    }
    if (m == 0) {
        it->sizes[0] = 1;
        for (int k = 0; k < n; k++)
            it->strides[k][0] = 0;
        m = 1;
    }
    it->n = n;
    it->ndim = m;
    it->numel = ag__numel(nd, sizes);
    it->inner = it->sizes[m - 1];
    it->rows = it->inner ? it->numel / it->inner : 0;
    it->inner_contig = true;
    for (int k = 0; k < n; k++) {
        it->inner_stride[k] = it->strides[k][m - 1];
        if (it->inner_stride[k] != 1)
            it->inner_contig = false;
    }
}

void ag__iter_row_offsets(const ag__iter *it, int64_t r, int64_t *off) {
    for (int k = 0; k < it->n; k++)
        off[k] = 0;
    for (int d = it->ndim - 2; d >= 0; d--) {
        int64_t sz = it->sizes[d];
        int64_t i = r % sz;
        r /= sz;
        for (int k = 0; k < it->n; k++)
            off[k] += i * it->strides[k][d];
    }
}

int ag__check_fits(const char *op, double v, ag_dtype dt) {
    if (ag__fits_dtype(v, dt))
        return 0;
    return ag__err(AG_EINVAL, "%s: value %g cannot be converted to type %s without overflow", op, v,
                   ag_dtype_name(dt));
}
