/* Subcommands of the aotgrad tool; each returns the process exit status. */
#ifndef AG_CLI_H
#define AG_CLI_H

#include "aotgrad.h"

int cli_ops(int argc, char **argv);
int cli_train(int argc, char **argv);
int cli_models(int argc, char **argv);
int cli_trace(int argc, char **argv);
int cli_show(int argc, char **argv);
int cli_export(int argc, char **argv);
int cli_descriptors(int argc, char **argv);
int cli_partition(int argc, char **argv);
int cli_check(int argc, char **argv);
int cli_bench(int argc, char **argv);

/* Small option helpers: `--name VALUE` parsing with a clear message on bad values. */
int cli_int_opt(const char *cmd, const char *name, const char *val, long long min, long long max,
                long long *out);
int cli_float_opt(const char *cmd, const char *name, const char *val, double *out);
/* `--dropout P` of the commands that build zoo models (export, descriptors, trace, partition,
 * check): the dropout probability of the models that have dropout layers (ag_zoo_build_opts). */
int cli_dropout_opt(const char *cmd, const char *val, ag_zoo_opts *o);

/* cli_effects.c: compares the zoo log records [e0, e1) of an eager phase with [c0, c1) of the
 * compiled one; 0 when they match, else 1 with the first difference in why. */
int cli_effect_logs_compare(int e0, int e1, int c0, int c1, double tol, const char *phase,
                            char *why, size_t n);

#endif
