/* Shape and dtype rules shared by meta functions: broadcasting, type promotion, reductions. */
#include "../core/internal.h"

#include <math.h>

int ag__broadcast(const char *op, int na, const int64_t *a, int nb, const int64_t *b, int *nout,
                  int64_t *out) {
    int n = na > nb ? na : nb;
    for (int i = 0; i < n; i++) {
        int ia = i - (n - na), ib = i - (n - nb);
        int64_t sa = ia >= 0 ? a[ia] : 1, sb = ib >= 0 ? b[ib] : 1;
        if (sa != sb && sa != 1 && sb != 1) {
            char x[128], y[128];
            return ag__err(AG_EINVAL,
                           "%s: shapes %s and %s cannot be broadcast (size %lld vs %lld in "
                           "dim %d)",
                           op, ag__fmt_sizes(x, sizeof x, na, a), ag__fmt_sizes(y, sizeof y, nb, b),
                           (long long)sa, (long long)sb, i);
        }
        out[i] = sa == 1 ? sb : sa;
    }
    *nout = n;
    return 0;
}

ag_dtype ag__promote(ag_dtype a, ag_dtype b) {
    /* Ranks: bool 0, i8 1, i64 2, f32 3, f64 4 (indexed by dtype: f32, f64, i64, bool, i8). */
    static const int rank[] = {3, 4, 2, 0, 1};
    static const ag_dtype of_rank[] = {AG_BOOL, AG_I8, AG_I64, AG_F32, AG_F64};
    int r = rank[a] > rank[b] ? rank[a] : rank[b];
    return of_rank[r];
}

ag_dtype ag__promote_scalar(ag_dtype a, double s) {
    if (ag_dtype_is_float(a))
        return a;
    if (s != floor(s) || !isfinite(s))
        return AG_F32;
    return a == AG_BOOL ? AG_I64 : a;
}

int ag__reduce_dims(const char *op, int ndim, const int64_t *dims, int ndims, bool *reduce) {
    for (int d = 0; d < ndim; d++)
        reduce[d] = ndims == 0;
    for (int i = 0; i < ndims; i++) {
        int d = ag__wrap_dim(op, dims[i], ndim);
        if (d < 0)
            return AG_EINVAL;
        if (ndim == 0)
            continue;
        if (reduce[d])
            return ag__err(AG_EINVAL, "%s: dim %d appears multiple times in the list of dims", op,
                           d);
        reduce[d] = true;
    }
    return 0;
}

void ag__reduce_meta(const ag_tmeta *in, const bool *reduce, bool keepdim, ag_dtype dt,
                     ag_tmeta *out) {
    int64_t sizes[AG_MAX_DIMS];
    int n = 0;
    for (int d = 0; d < in->ndim; d++) {
        if (reduce[d]) {
            if (keepdim)
                sizes[n++] = 1;
        } else {
            sizes[n++] = in->sizes[d];
        }
    }
    ag__tmeta_contiguous(out, dt, n, sizes);
}
