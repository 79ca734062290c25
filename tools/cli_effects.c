/* `aotgrad check`'s comparison of side effects: the records that effectful ops (the zoo's
 * aotgrad_demo::log_value) append to the zoo log during the eager run and during the compiled
 * run of one phase (forward or backward) must be the same records in the same order: same
 * tags, same grad flags, same element counts, and sums equal within the check's tolerance. */
#include "cli.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

int cli_effect_logs_compare(int e0, int e1, int c0, int c1, double tol, const char *phase,
                            char *why, size_t n) {
    if (e1 - e0 != c1 - c0) {
        snprintf(why, n, "%s: eager logged %d effect(s), compiled %d", phase, e1 - e0, c1 - c0);
        return 1;
    }
    for (int k = 0; k < e1 - e0; k++) {
        ag_zoo_log_record a, b;
        if (ag_zoo_log_get(e0 + k, &a) || ag_zoo_log_get(c0 + k, &b)) {
            snprintf(why, n, "%s: %s", phase, ag_last_error());
            return 1;
        }
        double scale = fmax(1.0, fabs(a.sum));
        if (strcmp(a.tag, b.tag) || a.grad != b.grad || a.numel != b.numel ||
            !(fabs(a.sum - b.sum) <= tol * scale)) {
            snprintf(why, n,
                     "%s effect %d: eager logged %s%s numel=%lld sum=%.9g, compiled %s%s "
                     "numel=%lld sum=%.9g",
                     phase, k, a.tag, a.grad ? " (grad)" : "", (long long)a.numel, a.sum, b.tag,
                     b.grad ? " (grad)" : "", (long long)b.numel, b.sum);
            return 1;
        }
    }
    return 0;
}
