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

int cli_dropout_opt(const char *cmd, const char *val, ag_zoo_opts *o) {
    double p;
    if (cli_float_opt(cmd, "--dropout", val, &p))
        return -1;
    if (!(p >= 0 && p <= 1)) {
        fprintf(stderr, "aotgrad %s: --dropout needs a probability in [0, 1], got '%s'\n", cmd,
                val);
        return -1;
    }
    o->set_dropout = true;
    o->dropout = p;
    return 0;
}
