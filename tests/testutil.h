/* Shared helpers for the cmocka tests. */
#ifndef AG_TESTUTIL_H
#define AG_TESTUTIL_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "aotgrad.h"

/* A tensor from literal values: T(AG_F32, 2, ((int64_t[]){2, 3}), ((double[]){1,2,3,4,5,6})). */
ag_tensor *tu_tensor(ag_dtype dt, int ndim, const int64_t *sizes, const double *vals);
/* Asserts t has the given shape and values within tol (absolute + relative). */
void tu_assert_values(const ag_tensor *t, int ndim, const int64_t *sizes, const double *vals,
                      double tol);
/* Max |a-b| over elements; shapes must match. */
double tu_max_abs_diff(const ag_tensor *a, const ag_tensor *b);
/* Asserts the last error contains `needle`. */
void tu_assert_error_contains(const char *needle);

#endif
