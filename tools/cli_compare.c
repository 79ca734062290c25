/* `aotgrad check`'s comparison of tensors: the eager run's value (the reference) against the
 * compiled run's, element by element, as one number, the largest difference relative to the
 * reference's largest finite magnitude (at least 1). Non-finite values compare as
 * torch.testing.assert_close(equal_nan=True) compares them: NaN equals NaN at the same place,
 * an infinity equals the same infinity, anything else against a non-finite value is a
 * mismatch (INFINITY). */
#include "cli.h"

#include <math.h>

double cli_rel_diff(const ag_tensor *ref, const ag_tensor *got) {
    if (!ref || !got)
        return ref == got ? 0 : INFINITY;
    if (ag_tensor_subclass(ref) || ag_tensor_subclass(got)) {
        ag_tensor *a[64], *b[64];
        int na = ag_subclass_flatten_tensors((ag_tensor *const *)&ref, 1, a, 64);
        int nb = ag_subclass_flatten_tensors((ag_tensor *const *)&got, 1, b, 64);
        if (ag_tensor_subclass(ref) != ag_tensor_subclass(got) || na != nb || na < 0 || na > 64)
            return INFINITY;
        double m = 0;
        for (int i = 0; i < na; i++)
            m = fmax(m, cli_rel_diff(a[i], b[i]));
        return m;
    }
    int64_t n = ag_tensor_numel(ref);
    if (n != ag_tensor_numel(got) || ag_tensor_ndim(ref) != ag_tensor_ndim(got))
        return INFINITY;
    for (int d = 0; d < ag_tensor_ndim(ref); d++)
        if (ag_tensor_size(ref, d) != ag_tensor_size(got, d))
            return INFINITY;
    /* The scale ignores infinities: one inf in the reference must not hide every difference. */
    double m = 0, scale = 1;
    for (int64_t i = 0; i < n; i++) {
        double a = ag_tensor_item_at(ref, i), b = ag_tensor_item_at(got, i);
        if (isnan(a) || isnan(b) || isinf(a) || isinf(b)) {
            bool same = (isnan(a) && isnan(b)) || a == b;
            if (!same)
                return INFINITY;
            continue;
        }
        scale = fmax(scale, fabs(a));
        m = fmax(m, fabs(a - b));
    }
    return m / scale;
}
