/* Subcommands of the aotgrad tool; each returns the process exit status. */
#ifndef AG_CLI_H
#define AG_CLI_H

#include "aotgrad.h"

#include <stdio.h>

int cli_ops(int argc, char **argv);
int cli_train(int argc, char **argv);
int cli_models(int argc, char **argv);
int cli_trace(int argc, char **argv);
int cli_show(int argc, char **argv);
int cli_export(int argc, char **argv);
int cli_descriptors(int argc, char **argv);
int cli_partition(int argc, char **argv);
int cli_check(int argc, char **argv);
/* cmd_check_saved.c: `aotgrad check FILE.joint` (a saved joint, no eager module). */
int cli_check_saved(const char *path, const ag_compile_opts *co, long long steps);
/* Whether a MODEL argument names a saved joint (ends in ".joint") rather than a zoo model. */
bool cli_is_joint_file(const char *arg);
/* ag_joint_load_file, with the zoo's custom ops registered first (a saved `effects` joint calls
 * aotgrad_demo::log_value). NULL after "aotgrad CMD: <the loader's message>" on stderr. */
ag_joint *cli_load_joint(const char *cmd, const char *path);
int cli_bench(int argc, char **argv);
/* bench_parallel.c: `aotgrad bench --parallel` (cli_bench hands it every argument). */
int cli_bench_parallel(int argc, char **argv);
int cli_shard(int argc, char **argv);
int cli_predict(int argc, char **argv);

/* ---- numeric options (cli_util.c) ----
 * Every numeric flag of every command goes through these two. A value is accepted only when
 * all of it is a number (no empty string, no leading blanks, no trailing characters), it is
 * representable (no overflow) and finite, and it lies in the range; otherwise they print
 * "aotgrad CMD: FLAG: expected an integer in [MIN, MAX], got 'VAL'" (or "a number in ...")
 * on stderr and return -1, leaving *out alone. val NULL means the flag came last, without one. */
int cli_int_opt(const char *cmd, const char *flag, const char *val, long long min, long long max,
                long long *out);
/* min_open excludes min itself (a learning rate > 0); max may be HUGE_VAL (no upper bound; the
 * value must still be finite). */
int cli_float_opt(const char *cmd, const char *flag, const char *val, double min, bool min_open,
                  double max, double *out);
/* `--dropout P` of the commands that build zoo models (export, descriptors, trace, partition,
 * check): the dropout probability of the models that have dropout layers (ag_zoo_build_opts). */
int cli_dropout_opt(const char *cmd, const char *val, ag_zoo_opts *o);

/* ---- output (cli_util.c) ----
 * One writer for everything a command writes to a file or to stdout. Writing to a file goes to
 * a temporary file "FILE.tmp-XXXXXX" in FILE's directory, renamed onto FILE only when every
 * write, the flush, the sync and the close succeeded; on failure the temporary file is removed
 * and FILE is left as it was. (A FILE that exists and is not a regular file, /dev/null or a
 * FIFO, is written in place; a symbolic link's target is replaced, not the link.) Failures
 * print "aotgrad CMD: writing FILE: REASON" once, on stderr. */
typedef struct cli_out {
    const char *cmd, *path; /* path NULL: stdout */
    char *target;           /* where the rename goes (path, or a symlink's target) */
    char *tmp;              /* the temporary file; NULL when writing in place or to stdout */
    FILE *f;                /* NULL for cli_out_open_name */
    int err;                /* errno of the first failed write; 0 while all went well */
} cli_out;

/* Opens path (NULL: stdout) for writing. 0, or 1 after the message (and *o holds nothing). */
int cli_out_open(cli_out *o, const char *cmd, const char *path);
/* For writers that take a file name (ag_graph_write_svg): creates the temporary file and opens
 * no stream; cli_out_name says the name to hand them. 0, or 1 after the message. */
int cli_out_open_name(cli_out *o, const char *cmd, const char *path);
const char *cli_out_name(const cli_out *o);
/* Writes; after the first failure the next calls do nothing. 0 or -1 (reported at close). */
int cli_out_write(cli_out *o, const void *s, size_t n);
int cli_out_puts(cli_out *o, const char *s);
int cli_out_printf(cli_out *o, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Finishes: flush, sync, close, rename. 0, or 1 after the message with the temporary file
 * removed. Releases *o either way. */
int cli_out_close(cli_out *o);
/* Gives up (another step failed): removes the temporary file, leaves path as it was. */
void cli_out_discard(cli_out *o);
/* Run by main after every command: flushes stdout and reports a failed write to it that no
 * cli_out_close reported yet. Returns status, or 1 when stdout failed and status was 0. */
int cli_stdout_finish(const char *cmd, int status);

/* ---- input (cli_util.c) ----
 * Reads a whole file (or /dev/stdin, a FIFO, a device), NUL-terminated, up to max bytes;
 * larger input stops the reading with "aotgrad CMD: PATH: larger than N MiB, the limit for
 * WHAT". Returns a malloc'd buffer, or NULL after the message. */
#define CLI_MAX_INPUT ((size_t)256 << 20)
char *cli_read_file(const char *cmd, const char *path, const char *what, size_t max, size_t *len);

/* ---- check's comparisons (cli_compare.c) ----
 * Largest |ref-got| over the elements relative to max(1, largest finite |ref|); 0 for equal
 * tensors; INFINITY when the shapes differ or a value is NaN on one side only, or an infinity
 * is matched by a different value. NaN against NaN and an infinity against the same infinity
 * are equal (torch.testing.assert_close with equal_nan=True). Tensor subclass instances
 * compare by their inner tensors. */
double cli_rel_diff(const ag_tensor *ref, const ag_tensor *got);

/* cli_effects.c: compares the zoo log records [e0, e1) of an eager phase with [c0, c1) of the
 * compiled one; 0 when they match, else 1 with the first difference in why. */
int cli_effect_logs_compare(int e0, int e1, int c0, int c1, double tol, const char *phase,
                            char *why, size_t n);

#endif
