/* The aotgrad command-line tool.
 *
 *   aotgrad ops [--json]            list the op table
 *   aotgrad train [--steps N] ...   the main job (a small training demo for now)
 *   aotgrad models                  list the model zoo
 *   aotgrad trace MODEL ...         print a zoo model's traced forward graph
 *   aotgrad show FILE ...           parse, verify and print a graph file
 *   aotgrad export MODEL ...        print a zoo model's joint graph with descriptors (or save it:
 *                                   -o FILE.joint)
 *   aotgrad descriptors MODEL ...   print its specs and input/grad, output/tangent pairs
 *   aotgrad partition MODEL ...     split its joint graph into forward and backward graphs (MODEL
 *                                   may be a saved FILE.joint, as for check)
 *   aotgrad shard MODEL ...         one rank's sharded joint and its per-rank summary
 *   aotgrad predict MODEL ...       predicted step time and memory per strategy on N ranks
 *   aotgrad bench [MODEL...] ...    the performance suite: step times, GEMM floor, pipeline
 *   aotgrad version                 (or --version) the library's version, ag_version()
 *   aotgrad CMD --help              CMD's usage (every option), exit 0
 *
 * Each subcommand lives in its own cmd_*.c file; this file only dispatches. Exit status: 0 on
 * success, 1 when the work fails (a failed write to a file or to stdout included), 2 for a
 * usage error. */
#include "cli.h"

#include <stdio.h>
#include <string.h>

/* Each command: its name, its function, its synopsis (every option it takes) and what it does.
 * `aotgrad CMD --help` (or -h, anywhere among CMD's arguments) prints "usage: aotgrad CMD
 * SYNOPSIS" and the description to stdout and exits 0, for every command; bench prints its own
 * (it also has `bench --parallel --help`). */
static int cli_version(int argc, char **argv);
static const struct {
    const char *name;
    int (*fn)(int argc, char **argv);
    const char *args, *help;
} commands[] = {
    {"ops", cli_ops, "[--json]",
     "list the op table (name, flags, dtypes, backward, gradcheck); --json as JSON"},
    {"train", cli_train,
     "[--model cnn|mlp|gpt2] [--data PATH] [--steps N] [--batch B] [--lr F] [--seed S] "
     "[--schedule cosine|constant] [--warmup N] [--decay-steps N] [--min-lr F] [--clip F] "
     "[--partitioner default|mincut] [--budget F] [--parallel dp|fsdp|tp] "
     "[--save DIR|FILE.safetensors] [--resume DIR] [--load FILE] [--checkpoint] [--nested-blocks] "
     "[--dropout P]",
     "the main job: export, partition, compile and train a zoo model (default the cnn on "
     "Fashion-MNIST); --parallel under mpirun"},
    {"check", cli_check,
     "MODEL|FILE.joint [--config NAME] [--dropout P] [--nested-blocks] "
     "[--partitioner default|mincut] [--budget F] [--steps N] [--interpret]",
     "eager vs compiled side by side for a few SGD steps; for FILE.joint (a saved joint) "
     "compiled vs interpreted and finite differences; exits 1 on a mismatch"},
    {"models", cli_models, "", "list the model zoo"},
    {"trace", cli_trace,
     "MODEL [--config NAME] [--dropout P] [--format text|dot|svg] [-o FILE] [--seq-nr] "
     "[--stack-traces] [--module-stacks]",
     "print a zoo model's traced forward graph"},
    {"show", cli_show, "FILE [--format text|dot|svg] [-o FILE]",
     "parse, verify and print a graph file (or a saved FILE.joint's graph)"},
    {"export", cli_export,
     "MODEL [--config NAME] [--dropout P] [--nested-blocks] [--decompose core] "
     "[--format text|dot|svg|joint] [-o FILE] [--seq-nr] [--stack-traces] [--module-stacks]",
     "print a zoo model's joint fw+bw graph with descriptors; -o FILE.joint (or --format "
     "joint) saves the joint for partition and check"},
    {"descriptors", cli_descriptors, "MODEL [--config NAME] [--dropout P] [--nested-blocks]",
     "print a zoo model's params/buffers/in/out specs and its input->grad and "
     "output->tangent pairs"},
    {"partition", cli_partition,
     "MODEL|FILE.joint [--config NAME] [--dropout P] [--partitioner default|mincut] "
     "[--budget F] [--solver dp|greedy|ilp] [--format text|dot|svg] [-o FILE]",
     "split a zoo model's (or a saved joint's) joint graph into forward and backward graphs"},
    {"shard", cli_shard,
     "MODEL --world N [--rank R] --parallel dp|fsdp|tp [--batch B] [--config NAME] "
     "[--format text|dot|svg] [-o FILE]",
     "print one rank's sharded joint (collectives inserted) and its per-rank memory and "
     "communication"},
    {"predict", cli_predict,
     "mlp|cnn|gpt2 --world N[,N...] [--parallel dp|fsdp|tp|all] [--config C] "
     "[--batch B | --batch-per-rank b] [--seq T] [--gflops F] [--mem-gbps M] [--latency S] "
     "[--bandwidth B] [--format md|tsv] [-o FILE]",
     "predicted step time and per-rank memory of a strategy on N ranks, from one rank's "
     "sharded graphs"},
    {"bench", cli_bench,
     "[mlp|cnn|gpt2-small...] [--zoo] [--pipeline-scaling] [--runs N] [--warmup N] "
     "[--threads T] [--seed S] [--json FILE] [--profile] [--gemms] | --parallel ...",
     "the performance suite: eager vs compiled steps, GEMM floor, capture pipeline, planned "
     "memory; --parallel: distributed steps"},
    {"version", cli_version, "", "print the version (also: aotgrad --version)"},
};
enum { NCOMMANDS = sizeof commands / sizeof commands[0] };

static int cli_version(int argc, char **argv) {
    if (argc > 1) {
        fprintf(stderr, "aotgrad version: unexpected argument '%s'\nusage: aotgrad version\n",
                argv[1]);
        return 2;
    }
    printf("aotgrad %s\n", ag_version());
    return 0;
}

static void usage(FILE *f) {
    fprintf(f, "usage: aotgrad <command> [options]   (aotgrad <command> --help: its options)\n"
               "       aotgrad --version\n\ncommands:\n");
    for (size_t i = 0; i < NCOMMANDS; i++)
        fprintf(f, "  %-12s %s\n", commands[i].name, commands[i].help);
}

/* "usage: aotgrad CMD SYNOPSIS" and the description, to stdout. */
static int command_help(size_t i) {
    printf("usage: aotgrad %s%s%s\n\n%s\n", commands[i].name, commands[i].args[0] ? " " : "",
           commands[i].args, commands[i].help);
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 2 || !strcmp(argv[1], "-h") || !strcmp(argv[1], "--help") ||
        !strcmp(argv[1], "help")) {
        usage(argc < 2 ? stderr : stdout);
        return cli_stdout_finish("help", argc < 2 ? 2 : 0);
    }
    const char *name = !strcmp(argv[1], "--version") ? "version" : argv[1];
    /* Every command's output to stdout is checked once here, at the end (a full disk must not
     * exit 0); commands that write a lot may stop early on a failed write. */
    for (size_t i = 0; i < NCOMMANDS; i++) {
        if (strcmp(name, commands[i].name))
            continue;
        bool own_help = !strcmp(name, "bench"); /* bench prints its own (and --parallel's) */
        for (int k = 2; k < argc && !own_help; k++)
            if (!strcmp(argv[k], "--help") || !strcmp(argv[k], "-h"))
                return cli_stdout_finish(name, command_help(i));
        return cli_stdout_finish(name, commands[i].fn(argc - 1, argv + 1));
    }
    fprintf(stderr, "aotgrad: unknown command '%s'\n\n", argv[1]);
    usage(stderr);
    return 2;
}
