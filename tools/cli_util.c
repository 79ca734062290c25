/* Option parsing helpers shared by the subcommands. */
#include "cli.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>

int cli_int_opt(const char *cmd, const char *name, const char *val, long long min, long long max,
                long long *out) {
    char *end;
    errno = 0;
    long long v = val ? strtoll(val, &end, 10) : 0;
    if (!val || *end || errno || v < min || v > max) {
        fprintf(stderr, "aotgrad %s: %s needs an integer in [%lld, %lld], got '%s'\n", cmd, name,
                min, max, val ? val : "(nothing)");
        return -1;
    }
    *out = v;
    return 0;
}

int cli_float_opt(const char *cmd, const char *name, const char *val, double *out) {
    char *end;
    double v = val ? strtod(val, &end) : 0;
    if (!val || *end) {
        fprintf(stderr, "aotgrad %s: %s needs a number, got '%s'\n", cmd, name, val ? val : "(nothing)");
        return -1;
    }
    *out = v;
    return 0;
}
