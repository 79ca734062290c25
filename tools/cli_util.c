/* Helpers shared by the subcommands: strict numeric options, the one output writer (checked
 * writes, temporary file and rename) and the bounded input reader. cli.h states the contracts. */
#define _GNU_SOURCE /* mkostemp */
#include "cli.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- numeric options ---- */

/* Whether val can start a number at all: strtod and strtoll skip leading blanks and accept an
 * empty string as 0, both of which we refuse. */
static bool number_start(const char *val) {
    return val && val[0] && !isspace((unsigned char)val[0]);
}

int cli_int_opt(const char *cmd, const char *flag, const char *val, long long min, long long max,
                long long *out) {
    char *end = NULL;
    long long v = 0;
    bool ok = number_start(val);
    if (ok) {
        errno = 0;
        v = strtoll(val, &end, 10);
        ok = !*end && errno == 0 && v >= min && v <= max;
    }
    if (!ok) {
        fprintf(stderr, "aotgrad %s: %s: expected an integer in [%lld, %lld], got %s%s%s\n", cmd,
                flag, min, max, val ? "'" : "", val ? val : "nothing", val ? "'" : "");
        return -1;
    }
    *out = v;
    return 0;
}

int cli_float_opt(const char *cmd, const char *flag, const char *val, double min, bool min_open,
                  double max, double *out) {
    char *end = NULL;
    double v = 0;
    bool ok = number_start(val);
    if (ok) {
        errno = 0;
        v = strtod(val, &end);
        ok = !*end && errno == 0 && isfinite(v) && (min_open ? v > min : v >= min) && v <= max;
    }
    if (!ok) {
        char range[96];
        if (isinf(max))
            snprintf(range, sizeof range, "a finite number %s %g", min_open ? ">" : ">=", min);
        else
            snprintf(range, sizeof range, "a number in %c%g, %g]", min_open ? '(' : '[', min, max);
        fprintf(stderr, "aotgrad %s: %s: expected %s, got %s%s%s\n", cmd, flag, range,
                val ? "'" : "", val ? val : "nothing", val ? "'" : "");
        return -1;
    }
    *out = v;
    return 0;
}

int cli_dropout_opt(const char *cmd, const char *val, ag_zoo_opts *o) {
    double p;
    if (cli_float_opt(cmd, "--dropout", val, 0, false, 1, &p))
        return -1;
    o->set_dropout = true;
    o->dropout = p;
    return 0;
}

/* ---- output ---- */

static bool stdout_reported; /* a failed write to stdout was reported already */

static void out_fail(cli_out *o, int err) {
    if (!o->err)
        o->err = err ? err : EIO;
}

static void out_report(const cli_out *o) {
    fprintf(stderr, "aotgrad %s: writing %s: %s\n", o->cmd, o->path ? o->path : "stdout",
            strerror(o->err));
    if (!o->path)
        stdout_reported = true;
}

static char *dup_str(const char *s) {
    char *d = malloc(strlen(s) + 1);
    return d ? strcpy(d, s) : NULL;
}

/* Decides where the data goes and creates the temporary file; by_name leaves it closed. */
static int out_open(cli_out *o, const char *cmd, const char *path, bool by_name) {
    *o = (cli_out){.cmd = cmd, .path = path};
    if (!path) {
        o->f = stdout;
        return 0;
    }
    struct stat st;
    bool exists = stat(path, &st) == 0;
    if (exists && !S_ISREG(st.st_mode)) {
        /* A device or a FIFO: nothing to replace; write in place (by name too). */
        o->target = dup_str(path);
        if (o->target && !by_name && !(o->f = fopen(path, "w")))
            out_fail(o, errno);
        if (!o->target)
            out_fail(o, ENOMEM);
        if (o->err) {
            out_report(o);
            free(o->target);
            return 1;
        }
        return 0;
    }
    /* A symbolic link: replace its target, keep the link. */
    char *real = exists ? realpath(path, NULL) : NULL;
    o->target = real ? real : dup_str(path);
    size_t n = o->target ? strlen(o->target) + sizeof ".tmp-XXXXXX" : 0;
    o->tmp = n ? malloc(n) : NULL;
    int fd = -1;
    if (o->tmp) {
        snprintf(o->tmp, n, "%s.tmp-XXXXXX", o->target);
        fd = mkostemp(o->tmp, O_CLOEXEC);
    }
    if (fd < 0) {
        out_fail(o, o->tmp ? errno : ENOMEM);
        out_report(o);
        free(o->tmp);
        free(o->target);
        *o = (cli_out){0};
        return 1;
    }
    /* mkstemp makes 0600; give the file the mode it replaces, or what fopen would. */
    mode_t mode;
    if (exists) {
        mode = st.st_mode & 07777;
    } else {
        mode_t mask = umask(0);
        umask(mask);
        mode = 0666 & ~mask;
    }
    if (fchmod(fd, mode))
        out_fail(o, errno);
    if (by_name) {
        close(fd);
    } else if (!o->err && !(o->f = fdopen(fd, "w"))) {
        out_fail(o, errno);
        close(fd);
    } else if (o->err) {
        close(fd);
    }
    if (o->err) {
        out_report(o);
        unlink(o->tmp);
        free(o->tmp);
        free(o->target);
        *o = (cli_out){0};
        return 1;
    }
    return 0;
}

int cli_out_open(cli_out *o, const char *cmd, const char *path) {
    return out_open(o, cmd, path, false);
}

int cli_out_open_name(cli_out *o, const char *cmd, const char *path) {
    return out_open(o, cmd, path, true);
}

const char *cli_out_name(const cli_out *o) {
    return o->tmp ? o->tmp : o->path;
}

int cli_out_write(cli_out *o, const void *s, size_t n) {
    if (o->err || !o->f)
        return -1;
    if (n && fwrite(s, 1, n, o->f) != n) {
        out_fail(o, errno);
        return -1;
    }
    return 0;
}

int cli_out_puts(cli_out *o, const char *s) {
    return cli_out_write(o, s, strlen(s));
}

int cli_out_printf(cli_out *o, const char *fmt, ...) {
    if (o->err || !o->f)
        return -1;
    va_list ap;
    va_start(ap, fmt);
    int r = vfprintf(o->f, fmt, ap);
    va_end(ap);
    if (r < 0) {
        out_fail(o, errno);
        return -1;
    }
    return 0;
}

static void out_release(cli_out *o) {
    free(o->tmp);
    free(o->target);
    *o = (cli_out){0};
}

int cli_out_close(cli_out *o) {
    if (!o->path) {
        /* stdout stays open; a failed flush now, or an earlier one, is the error. */
        if (fflush(stdout))
            out_fail(o, errno);
        else if (ferror(stdout))
            out_fail(o, EIO);
        int rc = 0;
        if (o->err) {
            if (!stdout_reported)
                out_report(o);
            rc = 1;
        }
        out_release(o);
        return rc;
    }
    if (o->f) {
        if (fflush(o->f))
            out_fail(o, errno);
        else if (ferror(o->f))
            out_fail(o, EIO);
        /* A regular file is synced before the rename, so a crash leaves the old or the new
         * file, never a short one; devices and FIFOs may not support it. */
        if (o->tmp && !o->err && fsync(fileno(o->f)))
            out_fail(o, errno);
        if (fclose(o->f))
            out_fail(o, errno);
    }
    if (o->tmp && !o->err && rename(o->tmp, o->target))
        out_fail(o, errno);
    int rc = 0;
    if (o->err) {
        out_report(o);
        if (o->tmp)
            unlink(o->tmp);
        rc = 1;
    }
    out_release(o);
    return rc;
}

void cli_out_discard(cli_out *o) {
    if (o->path && o->f)
        fclose(o->f);
    if (o->tmp)
        unlink(o->tmp);
    out_release(o);
}

int cli_stdout_finish(const char *cmd, int status) {
    cli_out o = {.cmd = cmd};
    o.f = stdout;
    int rc = cli_out_close(&o);
    return rc && !status ? 1 : status;
}

/* ---- input ---- */

char *cli_read_file(const char *cmd, const char *path, const char *what, size_t max, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "aotgrad %s: cannot open %s: %s\n", cmd, path, strerror(errno));
        return NULL;
    }
    /* A regular file says its size: refuse a large one before reading any of it. Devices and
     * pipes (/dev/zero, a FIFO) are read until the limit. */
    struct stat st;
    bool too_big =
        fstat(fileno(f), &st) == 0 && S_ISREG(st.st_mode) && (uintmax_t)st.st_size > (uintmax_t)max;
    size_t cap = 0, n = 0;
    char *buf = NULL;
    int err = 0;
    while (!too_big) {
        if (cap - n < 2) {
            size_t ncap = cap ? cap * 2 : (size_t)1 << 16;
            if (ncap > max + 2)
                ncap = max + 2; /* room for one byte past the limit, and the NUL */
            char *nb = realloc(buf, ncap);
            if (!nb) {
                err = ENOMEM;
                break;
            }
            buf = nb;
            cap = ncap;
        }
        size_t got = fread(buf + n, 1, cap - 1 - n, f);
        n += got;
        if (n > max) {
            too_big = true;
        } else if (got == 0 || n < cap - 1) {
            if (ferror(f))
                err = errno ? errno : EIO;
            if (feof(f) || err)
                break;
        }
    }
    fclose(f);
    if (too_big || err) {
        if (too_big)
            fprintf(stderr,
                    "aotgrad %s: %s: larger than %zu MiB, the limit for %s; stopped "
                    "reading\n",
                    cmd, path, max >> 20, what);
        else
            fprintf(stderr, "aotgrad %s: cannot read %s: %s\n", cmd, path, strerror(err));
        free(buf);
        return NULL;
    }
    if (!buf && !(buf = malloc(1))) {
        fprintf(stderr, "aotgrad %s: cannot read %s: %s\n", cmd, path, strerror(ENOMEM));
        return NULL;
    }
    buf[n] = 0;
    *len = n;
    return buf;
}

bool cli_is_joint_file(const char *arg) {
    size_t n = strlen(arg);
    return n > 6 && !strcmp(arg + n - 6, ".joint");
}

ag_joint *cli_load_joint(const char *cmd, const char *path) {
    ag_joint *j = ag_zoo_log_value_op() ? ag_joint_load_file(path) : NULL;
    if (!j)
        fprintf(stderr, "aotgrad %s: %s\n", cmd, ag_last_error());
    return j;
}
