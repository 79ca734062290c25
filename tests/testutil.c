#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

ag_tensor *tu_tensor(ag_dtype dt, int ndim, const int64_t *sizes, const double *vals) {
    int64_t n = 1;
    for (int i = 0; i < ndim; i++)
        n *= sizes[i];
    ag_tensor *t = ag_empty(dt, ndim, sizes);
    assert_non_null(t);
    char *p = ag_tensor_data(t);
    for (int64_t i = 0; i < n; i++) {
        switch (dt) {
        case AG_F32: ((float *)p)[i] = (float)vals[i]; break;
        case AG_F64: ((double *)p)[i] = vals[i]; break;
        case AG_I64: ((int64_t *)p)[i] = (int64_t)vals[i]; break;
        case AG_BOOL: ((_Bool *)p)[i] = vals[i] != 0; break;
        default: fail();
        }
    }
    return t;
}

void tu_assert_values(const ag_tensor *t, int ndim, const int64_t *sizes, const double *vals,
                      double tol) {
    assert_non_null(t);
    assert_int_equal(ag_tensor_ndim(t), ndim);
    for (int i = 0; i < ndim; i++)
        assert_int_equal(ag_tensor_sizes(t)[i], sizes[i]);
    int64_t n = ag_tensor_numel(t);
    for (int64_t i = 0; i < n; i++) {
        double v = ag_tensor_item_at(t, i);
        if (!(fabs(v - vals[i]) <= tol * (1 + fabs(vals[i])))) {
            print_error("element %lld: got %.9g, expected %.9g\n", (long long)i, v, vals[i]);
            fail();
        }
    }
}

double tu_max_abs_diff(const ag_tensor *a, const ag_tensor *b) {
    assert_int_equal(ag_tensor_numel(a), ag_tensor_numel(b));
    double m = 0;
    for (int64_t i = 0; i < ag_tensor_numel(a); i++) {
        double d = fabs(ag_tensor_item_at(a, i) - ag_tensor_item_at(b, i));
        if (d > m || isnan(d))
            m = isnan(d) ? INFINITY : d;
    }
    return m;
}

void tu_assert_error_contains(const char *needle) {
    const char *msg = ag_last_error();
    if (!strstr(msg, needle)) {
        print_error("error message '%s' does not contain '%s'\n", msg, needle);
        fail();
    }
}
