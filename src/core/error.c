/* Thread-local error state: the status and message of the last failed call on this thread,
 * read by ag_last_error()/ag_last_status(). Failing calls set it with ag__err(). */
#include "internal.h"

#include <stdio.h>

static _Thread_local char err_msg[1024];
static _Thread_local int err_code;
static _Thread_local uint64_t err_count;

int ag__err(int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err_msg, sizeof err_msg, fmt, ap);
    va_end(ap);
    err_code = code;
    err_count++;
    return code;
}

int ag_set_error(int status, const char *fmt, ...) {
    if (status >= 0)
        status = AG_EINVAL; /* a failure is negative */
    va_list ap;
    va_start(ap, fmt);
    if (fmt)
        vsnprintf(err_msg, sizeof err_msg, fmt, ap);
    else
        err_msg[0] = 0;
    va_end(ap);
    err_code = status;
    err_count++;
    return status;
}

uint64_t ag__err_count(void) {
    return err_count;
}

bool ag__has_error(void) {
    return err_code != 0;
}

const char *ag_last_error(void) {
    return err_msg;
}
int ag_last_status(void) {
    return err_code;
}

void ag_clear_error(void) {
    err_msg[0] = 0;
    err_code = 0;
}

char *ag__fmt_sizes(char *buf, size_t n, int ndim, const int64_t *sizes) {
    size_t k = 0;
    k += (size_t)snprintf(buf + k, n - k, "[");
    for (int i = 0; i < ndim && k < n; i++)
        k += (size_t)snprintf(buf + k, n - k, i ? ", %lld" : "%lld", (long long)sizes[i]);
    if (k < n)
        snprintf(buf + k, n - k, "]");
    return buf;
}
