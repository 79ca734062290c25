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
 *   aotgrad version
 *
 * Each subcommand lives in its own cmd_*.c file; this file only dispatches. Exit status: 0 on
 * success, 1 when the work fails (a failed write to a file or to stdout included), 2 for a
 * usage error. */
#include "cli.h"

#include <stdio.h>
#include <string.h>

static const struct {
    const char *name;
    int (*fn)(int argc, char **argv);
    const char *help;
} commands[] = {
    {"ops", cli_ops, "list the op table (name, flags, dtypes, backward, gradcheck) [--json]"},
    {"train", cli_train,
     "the main job: export, partition, compile and train the cnn on Fashion-MNIST "
     "[--steps N] [--model cnn|mlp|gpt2] [--data PATH] [--parallel dp|fsdp|tp (under mpirun)] "
     "[--save FILE] [--load FILE]"},
    {"check", cli_check,
     "eager vs compiled side by side: MODEL [--dropout P] [--partitioner default|mincut] "
     "[--budget F]; for FILE.joint (a saved joint) compiled vs interpreted and finite "
     "differences"},
    {"models", cli_models, "list the model zoo"},
    {"trace", cli_trace,
     "print a zoo model's traced forward graph: MODEL [--config NAME] [--dropout P] "
     "[--format text|dot|svg] [-o FILE] [--seq-nr] [--stack-traces] [--module-stacks]"},
    {"show", cli_show,
     "parse, verify and print a graph file (or a saved FILE.joint's graph): FILE "
     "[--format text|dot|svg] [-o FILE]"},
    {"export", cli_export,
     "print a zoo model's joint fw+bw graph with descriptors: MODEL [--config NAME] "
     "[--dropout P] [--decompose core] [--format text|dot|svg|joint] [-o FILE] [--seq-nr] "
     "[--stack-traces] [--module-stacks]; -o FILE.joint (or --format joint) saves the joint "
     "for partition and check"},
    {"descriptors", cli_descriptors,
     "print a zoo model's params/buffers/in/out specs and its input->grad and "
     "output->tangent pairs: MODEL [--config NAME] [--dropout P]"},
    {"partition", cli_partition,
     "split a zoo model's joint graph into forward and backward graphs: MODEL|FILE.joint "
     "[--config NAME] "
     "[--dropout P] [--partitioner default|mincut] [--budget F] [--solver greedy|dp|ilp] "
     "[--format text|dot|svg] [-o FILE]"},
    {"shard", cli_shard,
     "print one rank's sharded joint (collectives inserted) and its per-rank memory and "
     "communication: MODEL --world N [--rank R] --parallel dp|fsdp|tp [--batch B] "
     "[--format text|dot|svg] [-o FILE]"},
    {"predict", cli_predict,
     "predicted step time and per-rank memory of a strategy on N ranks, from one rank's "
     "sharded graphs: MODEL --world N[,N...] [--parallel dp|fsdp|tp|all] [--config C] "
     "[--batch B | --batch-per-rank b] [--seq T] [--gflops F] [--mem-gbps M] [--format md|tsv]"},
    {"bench", cli_bench,
     "the performance suite: eager vs compiled steps, GEMM floor, capture pipeline, planned "
     "memory: [mlp|cnn|gpt2-small...] [--zoo] [--pipeline-scaling] [--runs N] [--threads T] "
     "[--json FILE] [--profile] [--gemms]"},
};

static void usage(FILE *f) {
    fprintf(f, "usage: aotgrad <command> [options]\n\ncommands:\n");
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        fprintf(f, "  %-12s %s\n", commands[i].name, commands[i].help);
    fprintf(f, "  %-12s %s\n", "version", "print the version");
}

int main(int argc, char **argv) {
    if (argc < 2 || !strcmp(argv[1], "-h") || !strcmp(argv[1], "--help") ||
        !strcmp(argv[1], "help")) {
        usage(argc < 2 ? stderr : stdout);
        return cli_stdout_finish("help", argc < 2 ? 2 : 0);
    }
    if (!strcmp(argv[1], "version") || !strcmp(argv[1], "--version")) {
        printf("aotgrad %s\n", AG_VERSION_STRING);
        return cli_stdout_finish("version", 0);
    }
    /* Every command's output to stdout is checked once here, at the end (a full disk must not
     * exit 0); commands that write a lot may stop early on a failed write. */
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        if (!strcmp(argv[1], commands[i].name))
            return cli_stdout_finish(commands[i].name, commands[i].fn(argc - 1, argv + 1));
    fprintf(stderr, "aotgrad: unknown command '%s'\n\n", argv[1]);
    usage(stderr);
    return 2;
}
