/* The aotgrad command-line tool against a hostile user: the built binary (AG_CLI_PATH, set by
 * CMakeLists.txt) is run in a child process with its stdout sent to /dev/full or to a file,
 * under a file size limit (a disk that fills up half way), with empty and non-numeric flag
 * values, with a learning rate that makes the loss NaN, a batch larger than its data set or
 * than memory, and an endless input file; each run must end quickly with the right exit status
 * and message, and never leave a truncated file where a good one was. check's comparison of
 * NaN and infinities (tools/cli_compare.c, linked in) is tested directly. */
#include "testutil.h"
#include "cli.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zlib.h>

#ifndef AG_CLI_PATH
#error "AG_CLI_PATH must name the built aotgrad binary"
#endif

static char dir[64];     /* this run's scratch directory */
static char errfile[96]; /* the child's stderr */

typedef struct result {
    int status; /* exit status, or 128 + the signal that ended it */
    double secs;
    char err[8192]; /* its stderr */
} result;

/* Runs aotgrad with args (NULL-terminated) and stdout to out (NULL: /dev/null). fsize > 0
 * limits the size of every file it writes (SIGXFSZ ignored: writes fail with EFBIG). The child
 * is killed after 120 s, so a hang fails the test instead of stalling it. */
static void run(result *r, const char *out, long fsize, const char *const *args) {
    const char *argv[40] = {AG_CLI_PATH};
    int n = 1;
    for (; args[n - 1]; n++)
        argv[n] = args[n - 1];
    argv[n] = NULL;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        int o = open(out ? out : "/dev/null", O_WRONLY | O_CREAT | O_TRUNC, 0644);
        int e = open(errfile, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (o < 0 || e < 0 || dup2(o, 1) < 0 || dup2(e, 2) < 0)
            _exit(126);
        if (fsize > 0) {
            struct rlimit rl = {(rlim_t)fsize, (rlim_t)fsize};
            signal(SIGXFSZ, SIG_IGN);
            if (setrlimit(RLIMIT_FSIZE, &rl))
                _exit(126);
        }
        alarm(120);
        execv(AG_CLI_PATH, (char *const *)argv);
        _exit(127);
    }
    int ws = 0;
    while (waitpid(pid, &ws, 0) < 0)
        assert_int_equal(errno, EINTR);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    r->secs = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    r->status = WIFEXITED(ws) ? WEXITSTATUS(ws) : 128 + WTERMSIG(ws);
    FILE *f = fopen(errfile, "r");
    assert_non_null(f);
    size_t k = fread(r->err, 1, sizeof r->err - 1, f);
    r->err[k] = 0;
    fclose(f);
}

static void expect(const result *r, int status, const char *needle, const char *what) {
    if (r->status != status || (needle && !strstr(r->err, needle)))
        fail_msg("%s: exit status %d (want %d), stderr:\n%s\n(want it to contain: %s)", what,
                 r->status, status, r->err, needle ? needle : "-");
}

static char *slurp(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    static char buf[1 << 20];
    size_t k = fread(buf, 1, sizeof buf - 1, f);
    buf[k] = 0;
    fclose(f);
    return buf;
}

static void spit(const char *path, const char *s) {
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(s, 1, strlen(s), f), strlen(s));
    assert_int_equal(fclose(f), 0);
}

static void path_in(char *buf, size_t n, const char *name) {
    snprintf(buf, n, "%s/%s", dir, name);
}

/* Names in the scratch directory other than `keep...`: temporary files left behind. */
static int count_other_files(const char *keep1, const char *keep2) {
    DIR *d = opendir(dir);
    assert_non_null(d);
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)))
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..") && strcmp(e->d_name, "stderr") &&
            (!keep1 || strcmp(e->d_name, keep1)) && (!keep2 || strcmp(e->d_name, keep2)))
            n++;
    closedir(d);
    return n;
}

static int setup(void **state) {
    (void)state;
    snprintf(dir, sizeof dir, "/tmp/aotgrad-test-cli-XXXXXX");
    if (!mkdtemp(dir))
        return -1;
    snprintf(errfile, sizeof errfile, "%s/stderr", dir);
    return 0;
}

static int teardown(void **state) {
    (void)state;
    DIR *d = opendir(dir);
    struct dirent *e;
    while (d && (e = readdir(d))) {
        char p[512];
        snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, ".."))
            unlink(p);
    }
    if (d)
        closedir(d);
    rmdir(dir);
    return 0;
}

/* A small graph file for `show`. */
static const char graph_text[] = "graph():\n"
                                 "    %x : f32[4, 3]\n"
                                 "    %r = relu(%x)\n"
                                 "    return (%r,)\n";

/* ---- output: stdout ---- */

static void test_stdout_full(void **state) {
    (void)state;
    char g[256];
    path_in(g, sizeof g, "g.txt");
    spit(g, graph_text);
    const char *const cmds[][6] = {
        {"models", NULL},           {"version", NULL},       {"ops", NULL},
        {"trace", "mlp", NULL},     {"export", "mlp", NULL}, {"descriptors", "mlp", NULL},
        {"partition", "mlp", NULL}, {"show", g, NULL},
    };
    char out[256];
    path_in(out, sizeof out, "out.txt");
    for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++) {
        result r;
        char want[128];
        snprintf(want, sizeof want, "aotgrad %s: writing stdout: No space left on device\n",
                 cmds[i][0]);
        run(&r, "/dev/full", 0, cmds[i]);
        expect(&r, 1, want, cmds[i][0]);
        /* Reported once. */
        assert_null(strstr(strstr(r.err, want) + strlen(want), "writing stdout"));
        /* The same command to a file works. */
        run(&r, out, 0, cmds[i]);
        expect(&r, 0, NULL, cmds[i][0]);
        assert_true(strlen(slurp(out)) > 0);
    }
}

/* ---- output: -o FILE ---- */

static void test_o_dev_full(void **state) {
    (void)state;
    const char *const cmds[][6] = {
        {"trace", "mlp", "-o", "/dev/full", NULL},
        {"export", "mlp", "-o", "/dev/full", NULL},
        {"partition", "mlp", "-o", "/dev/full", NULL},
    };
    for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++) {
        result r;
        char want[128];
        snprintf(want, sizeof want, "aotgrad %s: writing /dev/full: No space left on device\n",
                 cmds[i][0]);
        run(&r, NULL, 0, cmds[i]);
        expect(&r, 1, want, cmds[i][0]);
    }
}

/* A disk that fills up half way through -o FILE: FILE keeps its old contents and no temporary
 * file is left; without the limit FILE is replaced. */
static void test_o_keeps_old_file(void **state) {
    (void)state;
    char out[256], g[256], g_name[] = "g.txt";
    path_in(out, sizeof out, "out.txt");
    path_in(g, sizeof g, g_name);
    /* A graph file long enough to pass the limit when `show` prints it back. */
    char big[16384];
    size_t len = (size_t)snprintf(big, sizeof big, "graph():\n    %%r0 : f32[4, 3]\n");
    for (int k = 1; k < 100; k++)
        len += (size_t)snprintf(big + len, sizeof big - len, "    %%r%d = relu(%%r%d)\n", k, k - 1);
    snprintf(big + len, sizeof big - len, "    return (%%r99,)\n");
    spit(g, big);
    const char *const cmds[][8] = {
        {"trace", "gpt2", "-o", out, NULL},
        {"export", "mlp", "-o", out, NULL},
        {"partition", "mlp", "-o", out, NULL},
        {"show", g, "-o", out, NULL},
        {"export", "mlp", "--format", "dot", "-o", out, NULL},
    };
    for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++) {
        result r;
        spit(out, "old contents\n");
        run(&r, NULL, 1024, cmds[i]);
        char want[512];
        snprintf(want, sizeof want, "aotgrad %s: writing %s: File too large\n", cmds[i][0], out);
        expect(&r, 1, want, cmds[i][0]);
        assert_string_equal(slurp(out), "old contents\n");
        assert_int_equal(count_other_files("out.txt", g_name), 0);
        run(&r, NULL, 0, cmds[i]);
        expect(&r, 0, NULL, cmds[i][0]);
        const char *s = slurp(out);
        assert_true(strlen(s) > 1024);
        assert_true(!strncmp(s, "graph():", 8) || !strncmp(s, "# forward", 9) ||
                    !strncmp(s, "digraph", 7));
        assert_int_equal(count_other_files("out.txt", g_name), 0);
    }
}

/* -o through a symbolic link replaces the link's target and keeps the link; a new file gets
 * the permissions fopen would give it, an existing one keeps its own. */
static void test_o_link_and_mode(void **state) {
    (void)state;
    char target[256], link_path[256];
    path_in(target, sizeof target, "target.txt");
    path_in(link_path, sizeof link_path, "link.txt");
    spit(target, "old\n");
    assert_int_equal(chmod(target, 0640), 0);
    assert_int_equal(symlink(target, link_path), 0);
    result r;
    run(&r, NULL, 0, (const char *const[]){"trace", "mlp", "-o", link_path, NULL});
    expect(&r, 0, NULL, "trace -o link");
    struct stat st;
    assert_int_equal(lstat(link_path, &st), 0);
    assert_true(S_ISLNK(st.st_mode));
    assert_int_equal(stat(target, &st), 0);
    assert_int_equal(st.st_mode & 0777, 0640);
    assert_int_equal(strncmp(slurp(target), "graph():", 8), 0);
    unlink(link_path);
    unlink(target);
    mode_t mask = umask(0);
    umask(mask);
    run(&r, NULL, 0, (const char *const[]){"trace", "mlp", "-o", target, NULL});
    expect(&r, 0, NULL, "trace -o new");
    assert_int_equal(stat(target, &st), 0);
    assert_int_equal(st.st_mode & 0777, 0666 & ~mask);
    unlink(target);
    /* A directory that does not exist. */
    char missing[300];
    snprintf(missing, sizeof missing, "%s/no/such/dir.txt", dir);
    run(&r, NULL, 0, (const char *const[]){"trace", "mlp", "-o", missing, NULL});
    expect(&r, 1, "writing", "trace -o missing dir");
    assert_non_null(strstr(r.err, "No such file or directory"));
}

/* ---- numeric flags ---- */

static void test_numeric_flags(void **state) {
    (void)state;
    static const struct {
        const char *args[8];
        const char *want;
    } cases[] = {
        {{"partition", "mlp", "--budget", "", NULL},
         "aotgrad partition: --budget: expected a number in [0, 1], got ''\n"},
        {{"partition", "mlp", "--budget", "0.5x", NULL},
         "--budget: expected a number in [0, 1], got '0.5x'"},
        {{"partition", "mlp", "--budget", "nan", NULL}, "got 'nan'"},
        {{"partition", "mlp", "--budget", "1.5", NULL}, "got '1.5'"},
        {{"partition", "mlp", "--budget", " 0.5", NULL}, "got ' 0.5'"},
        {{"partition", "mlp", "--budget", NULL},
         "--budget: expected a number in [0, 1], got nothing"},
        {{"partition", "mlp", "--dropout", "", NULL}, "aotgrad partition: --dropout: expected"},
        {{"check", "mlp", "--budget", "", NULL},
         "aotgrad check: --budget: expected a number in [0, 1], got ''"},
        {{"check", "mlp", "--steps", "", NULL},
         "aotgrad check: --steps: expected an integer in [1, 1000], got ''"},
        {{"check", "mlp", "--steps", "0", NULL},
         "--steps: expected an integer in [1, 1000], got '0'"},
        {{"check", "dropout_mlp", "--dropout", "", NULL},
         "aotgrad check: --dropout: expected a number in [0, 1], got ''"},
        {{"trace", "mlp", "--dropout", "", NULL}, "aotgrad trace: --dropout: expected"},
        {{"export", "mlp", "--dropout", "1.5", NULL},
         "aotgrad export: --dropout: expected a number in [0, 1], got '1.5'"},
        {{"descriptors", "mlp", "--dropout", "-0.1", NULL},
         "aotgrad descriptors: --dropout: expected"},
        {{"train", "--steps", "", NULL}, "aotgrad train: --steps: expected an integer in [1, "},
        {{"train", "--steps", "0", NULL}, "--steps: expected an integer in [1, "},
        {{"train", "--steps", "-3", NULL}, "got '-3'"},
        {{"train", "--steps", "1e3", NULL}, "got '1e3'"},
        {{"train", "--steps", "99999999999999999999", NULL}, "got '99999999999999999999'"},
        {{"train", "--batch", "", NULL}, "aotgrad train: --batch: expected an integer in [1, "},
        {{"train", "--batch", "0", NULL}, "--batch: expected an integer in [1, "},
        {{"train", "--batch", "-1", NULL}, "got '-1'"},
        {{"train", "--lr", "inf", NULL},
         "aotgrad train: --lr: expected a finite number > 0, got 'inf'"},
        {{"train", "--lr", "nan", NULL}, "--lr: expected a finite number > 0, got 'nan'"},
        {{"train", "--lr", "0", NULL}, "got '0'"},
        {{"train", "--lr", "-1e-3", NULL}, "got '-1e-3'"},
        {{"train", "--lr", "1e999", NULL}, "got '1e999'"},
        {{"train", "--lr", "", NULL}, "--lr: expected a finite number > 0, got ''"},
        {{"train", "--budget", "", NULL},
         "aotgrad train: --budget: expected a number in [0, 1], got ''"},
        {{"train", "--seed", "", NULL}, "aotgrad train: --seed: expected an integer"},
        {{"train", "--seed", "-1", NULL}, "aotgrad train: --seed: expected an integer"},
        {{"bench", "--runs", "", NULL},
         "aotgrad bench: --runs: expected an integer in [1, 1000], got ''"},
        {{"bench", "--threads", "0", NULL}, "aotgrad bench: --threads: expected an integer"},
        {{"bench", "--warmup", "x", NULL}, "aotgrad bench: --warmup: expected an integer"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        result r;
        run(&r, NULL, 0, cases[i].args);
        char what[160];
        snprintf(what, sizeof what, "%s %s %s '%s'", cases[i].args[0], cases[i].args[1],
                 cases[i].args[2] ? cases[i].args[2] : "",
                 cases[i].args[2] && cases[i].args[3] ? cases[i].args[3] : "");
        expect(&r, 2, cases[i].want, what);
        /* Refused before any work: no model is built, no data is read. */
        assert_true(r.secs < 30);
    }
}

/* ---- train ---- */

/* A text for the character-level GPT-2: a few kilobytes. */
static void write_text(const char *path) {
    char s[8192] = "";
    size_t len = 0;
    for (int k = 0; len + 80 < sizeof s; k++)
        len += (size_t)snprintf(s + len, sizeof s - len,
                                "line %d: the quick brown fox jumps over the lazy dog.\n", k);
    spit(path, s);
}

static void test_train_nonfinite_loss(void **state) {
    (void)state;
    char text[256];
    path_in(text, sizeof text, "text.txt");
    write_text(text);
    result r;
    run(&r, NULL, 0,
        (const char *const[]){"train", "--model", "gpt2", "--data", text, "--batch", "2", "--steps",
                              "30", "--lr", "1e30", NULL});
    expect(&r, 1, "; stopping (lower --lr?)\n", "train --lr 1e30");
    assert_non_null(strstr(r.err, "aotgrad train: step "));
    assert_true(strstr(r.err, ": loss is nan;") || strstr(r.err, ": loss is inf;") ||
                strstr(r.err, ": loss is -inf;"));
}

/* The losses printed by a train run ("loss X" in order), joined by spaces. */
static void losses_of(const char *out, char *buf, size_t n) {
    buf[0] = 0;
    for (const char *p = strstr(out, "loss "); p; p = strstr(p + 5, "loss ")) {
        size_t len = strlen(buf);
        const char *e = p + 5;
        while (*e && *e != ' ' && *e != '\n' && *e != ';')
            e++;
        snprintf(buf + len, n - len, "%.*s ", (int)(e - p - 5), p + 5);
    }
}

/* export --nested-blocks: gpt2's two blocks call one forward and one joint subgraph. */
static void test_export_nested_blocks(void **state) {
    (void)state;
    char o1[256];
    path_in(o1, sizeof o1, "nested.out");
    result r;
    run(&r, o1, 0, (const char *const[]){"export", "gpt2", "--nested-blocks", NULL});
    expect(&r, 0, NULL, "export gpt2 --nested-blocks");
    const char *out = slurp(o1);
    const char *want[] = {"invoke_subgraph(%repeated_subgraph0, 'fw_subgraph_0', %clone, ",
                          "invoke_subgraph(%repeated_subgraph0_1, 'fw_subgraph_0', %getitem, ",
                          "invoke_subgraph(%repeated_subgraph1, 'bw_subgraph_0_0', %getitem, ",
                          "invoke_subgraph(%repeated_subgraph1_1, 'bw_subgraph_0_0', %clone, ",
                          "\nsubgraph repeated_subgraph0():\n",
                          "\nsubgraph repeated_subgraph1():\n"};
    for (size_t k = 0; k < sizeof want / sizeof want[0]; k++)
        assert_non_null(strstr(out, want[k]));
    assert_null(strstr(out, "repeated_subgraph2"));
    run(&r, NULL, 0, (const char *const[]){"export", "mlp", "--nested-blocks", NULL});
    expect(&r, 2, "only gpt2 has", "export mlp --nested-blocks");
}

/* --checkpoint: gpt2's blocks recomputed in the backward, the same losses as without it (also
 * under --parallel); refused for a model without blocks. */
static void test_train_checkpoint(void **state) {
    (void)state;
    char text[256], o1[256], o2[256];
    path_in(text, sizeof text, "text.txt");
    path_in(o1, sizeof o1, "plain.out");
    path_in(o2, sizeof o2, "ckpt.out");
    write_text(text);
    result r;
    run(&r, o1, 0,
        (const char *const[]){"train", "--model", "gpt2", "--data", text, "--batch", "2", "--steps",
                              "4", NULL});
    expect(&r, 0, NULL, "train gpt2");
    static char a[4096], b[4096];
    losses_of(slurp(o1), a, sizeof a);
    run(&r, o2, 0,
        (const char *const[]){"train", "--model", "gpt2", "--data", text, "--batch", "2", "--steps",
                              "4", "--checkpoint", NULL});
    expect(&r, 0, NULL, "train gpt2 --checkpoint");
    const char *out = slurp(o2);
    assert_non_null(strstr(out, ", blocks checkpointed)"));
    losses_of(out, b, sizeof b);
    assert_true(strlen(a) > 20);
    assert_string_equal(a, b);
    run(&r, NULL, 0, (const char *const[]){"train", "--model", "mlp", "--checkpoint", NULL});
    expect(&r, 2, "--checkpoint checkpoints gpt2's blocks; --model mlp has none", "mlp");
    /* --parallel (a world of one without mpirun): the sharding pass keeps the tags; the
     * same losses as the sharded step without them, and less saved */
    const char *plain_args[] = {"train",   "--model", "gpt2",       "--data", text, "--batch", "2",
                                "--steps", "3",       "--parallel", "fsdp",   NULL, NULL};
    run(&r, o1, 0, plain_args);
    expect(&r, 0, NULL, "train gpt2 --parallel fsdp");
    losses_of(slurp(o1), a, sizeof a);
    plain_args[11] = "--checkpoint";
    run(&r, o2, 0, plain_args);
    expect(&r, 0, NULL, "train gpt2 --parallel fsdp --checkpoint");
    out = slurp(o2);
    assert_non_null(strstr(out, ", blocks checkpointed)"));
    losses_of(out, b, sizeof b);
    assert_true(strlen(a) > 15);
    assert_string_equal(a, b);
}

/* --nested-blocks: gpt2's blocks as nested compile regions train to the same losses as the flat
 * model, in one process and under --parallel (the sharding pass inlines the regions); check
 * agrees eager and compiled; refused for a model without blocks; with --checkpoint too (each
 * region checkpointed inside) the same losses as the plain model; with --dropout the flat
 * model's dropout losses. */
/* The saved part of train's partition line ("saved 60 tensors, 11.04 MB") into buf. */
static void saved_of(const char *out, char *buf, size_t n) {
    const char *p = strstr(out, "partition (");
    p = p ? strstr(p, "saved ") : NULL;
    assert_non_null(p);
    const char *e = strchr(p, ';');
    assert_non_null(e);
    snprintf(buf, n, "%.*s", (int)(e - p), p);
}

static void test_train_nested_blocks(void **state) {
    (void)state;
    char text[256], o1[256], o2[256];
    path_in(text, sizeof text, "text.txt");
    path_in(o1, sizeof o1, "plain.out");
    path_in(o2, sizeof o2, "nested.out");
    write_text(text);
    static char a[4096], b[4096];
    result r;
    for (int parallel = 0; parallel < 2; parallel++) {
        const char *args[] = {"train",   "--model", "gpt2", "--data", text, "--batch", "2",
                              "--steps", "4",       NULL,   NULL,     NULL, NULL};
        if (parallel) {
            args[9] = "--parallel";
            args[10] = "fsdp";
        }
        char sa[128], sb[128];
        run(&r, o1, 0, args);
        expect(&r, 0, NULL, "train gpt2");
        losses_of(slurp(o1), a, sizeof a);
        saved_of(slurp(o1), sa, sizeof sa);
        args[parallel ? 11 : 9] = "--nested-blocks";
        run(&r, o2, 0, args);
        expect(&r, 0, NULL, "train gpt2 --nested-blocks");
        const char *out = slurp(o2);
        assert_non_null(strstr(out, ", blocks as nested compile regions)"));
        losses_of(out, b, sizeof b);
        assert_true(strlen(a) > 15);
        assert_string_equal(a, b);
        /* the regions save what the flat step saves; under --parallel (inlined, the joint
         * subgraphs' copies of the forward merged into the forward) and without it, and
         * nothing the backward recomputes costs FLOPs */
        saved_of(out, sb, sizeof sb);
        assert_string_equal(sa, sb);
        assert_non_null(strstr(out, " nodes, 0 FLOPs"));
    }
    run(&r, o1, 0,
        (const char *const[]){"check", "gpt2", "--nested-blocks", "--budget", "0", NULL});
    expect(&r, 0, NULL, "check gpt2 --nested-blocks");
    assert_non_null(strstr(slurp(o1), "): OK"));
    run(&r, NULL, 0, (const char *const[]){"train", "--model", "mlp", "--nested-blocks", NULL});
    expect(&r, 2, "--model mlp has none (use --model gpt2)", "mlp");
    /* both: each block a region checkpointed inside, the same losses as the plain model */
    run(&r, o1, 0,
        (const char *const[]){"train", "--model", "gpt2", "--data", text, "--batch", "2", "--steps",
                              "4", NULL});
    expect(&r, 0, NULL, "train gpt2");
    losses_of(slurp(o1), a, sizeof a);
    run(&r, o2, 0,
        (const char *const[]){"train", "--model", "gpt2", "--data", text, "--batch", "2", "--steps",
                              "4", "--nested-blocks", "--checkpoint", NULL});
    expect(&r, 0, NULL, "train gpt2 --nested-blocks --checkpoint");
    const char *out = slurp(o2);
    assert_non_null(strstr(out, ", blocks as checkpointed nested compile regions)"));
    losses_of(out, b, sizeof b);
    assert_true(strlen(a) > 20);
    assert_string_equal(a, b);
    /* and less saved than the plain model (the saved values the regions' calls return) */
    const char *sc = strstr(out, "saved ");
    assert_non_null(sc);
    int saved_ck = atoi(sc + 6);
    const char *sp = strstr(slurp(o1), "saved "); /* slurp's buffer: out is gone */
    assert_non_null(sp);
    assert_true(saved_ck > 0);
    assert_true(saved_ck < atoi(sp + 6));
    /* --dropout: the regions' calls draw their own masks, the flat model's (the same losses,
     * flat, as regions and as checkpointed regions), which dropout changes; check agrees
     * eager and compiled bit for bit; a model without dropout layers refuses the flag */
    static char c[4096], d[4096];
    const char *dargs[] = {"train",   "--model", "gpt2",      "--data", text, "--batch", "2",
                           "--steps", "4",       "--dropout", "0.1",    NULL, NULL,      NULL};
    run(&r, o1, 0, dargs);
    expect(&r, 0, NULL, "train gpt2 --dropout 0.1");
    out = slurp(o1);
    assert_non_null(strstr(out, ", dropout 0.1)"));
    losses_of(out, c, sizeof c);
    assert_true(strlen(c) > 15);
    assert_string_not_equal(a, c);
    dargs[11] = "--nested-blocks";
    run(&r, o2, 0, dargs);
    expect(&r, 0, NULL, "train gpt2 --dropout 0.1 --nested-blocks");
    out = slurp(o2);
    assert_non_null(strstr(out, ", dropout 0.1, blocks as nested compile regions)"));
    losses_of(out, d, sizeof d);
    assert_string_equal(c, d);
    dargs[12] = "--checkpoint";
    run(&r, o2, 0, dargs);
    expect(&r, 0, NULL, "train gpt2 --dropout 0.1 --nested-blocks --checkpoint");
    losses_of(slurp(o2), d, sizeof d);
    assert_string_equal(c, d);
    run(&r, o1, 0,
        (const char *const[]){"check", "gpt2", "--dropout", "0.1", "--nested-blocks", NULL});
    expect(&r, 0, NULL, "check gpt2 --dropout 0.1 --nested-blocks");
    assert_non_null(strstr(slurp(o1), "(tolerance 0): OK"));
    run(&r, NULL, 0, (const char *const[]){"train", "--model", "mlp", "--dropout", "0.1", NULL});
    expect(&r, 2, "--model mlp has no dropout layers", "train mlp --dropout");
}

/* An IDX file (the MNIST format), gzip-compressed: n items of the given item shape. */
static void write_idx(const char *path, int ndim, const uint32_t *sizes, unsigned char fill) {
    gzFile f = gzopen(path, "wb");
    assert_non_null(f);
    unsigned char hdr[4] = {0, 0, 0x08, (unsigned char)ndim};
    assert_int_equal(gzwrite(f, hdr, 4), 4);
    size_t n = 1;
    for (int d = 0; d < ndim; d++) {
        unsigned char b[4] = {(unsigned char)(sizes[d] >> 24), (unsigned char)(sizes[d] >> 16),
                              (unsigned char)(sizes[d] >> 8), (unsigned char)sizes[d]};
        assert_int_equal(gzwrite(f, b, 4), 4);
        n *= sizes[d];
    }
    for (size_t i = 0; i < n; i++) {
        unsigned char v = (unsigned char)(ndim == 1 ? i % 10 : (i * 37 + fill) & 0xff);
        assert_int_equal(gzwrite(f, &v, 1), 1);
    }
    assert_int_equal(gzclose(f), Z_OK);
}

/* A Fashion-MNIST-shaped data set with 10 training and 4 test images. */
static void write_fake_mnist(void) {
    char p[300];
    static const char *const names[4] = {"train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
                                         "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"};
    for (int k = 0; k < 4; k++) {
        uint32_t n = k < 2 ? 10 : 4;
        path_in(p, sizeof p, names[k]);
        if (k % 2 == 0)
            write_idx(p, 3, (uint32_t[]){n, 28, 28}, (unsigned char)k);
        else
            write_idx(p, 1, (uint32_t[]){n}, 0);
    }
}

static void test_train_batch_vs_data(void **state) {
    (void)state;
    write_fake_mnist();
    result r;
    /* Larger than the training set: refused (it divided by zero). */
    run(&r, NULL, 0, (const char *const[]){"train", "--data", dir, "--batch", "11", NULL});
    expect(&r, 2, "aotgrad train: --batch 11 is larger than the training set (10 images)\n",
           "train --batch 11");
    run(&r, NULL, 0,
        (const char *const[]){"train", "--data", dir, "--batch", "11", "--steps", "2", NULL});
    expect(&r, 2, "aotgrad train: --batch 11 is larger than the training set (10 images)\n",
           "train --batch 11 --steps 2");
    /* As large as it, and smaller (3 steps of 3, wrapping around the epoch), train. */
    run(&r, NULL, 0,
        (const char *const[]){"train", "--data", dir, "--batch", "10", "--steps", "2", NULL});
    expect(&r, 0, NULL, "train --batch 10");
    run(&r, NULL, 0,
        (const char *const[]){"train", "--data", dir, "--batch", "3", "--steps", "5", NULL});
    expect(&r, 0, NULL, "train --batch 3");
}

/* A batch that cannot fit in memory is refused before anything large is allocated. */
/* The loss lines ("  step K/N  loss X") of a train run's stdout, joined, for steps > from. */
static void loss_lines(const char *out, long long from, char *buf, size_t n) {
    buf[0] = 0;
    size_t len = 0;
    for (const char *p = out; (p = strstr(p, "  step ")); p++) {
        long long k, total;
        double v;
        if (sscanf(p, "  step %lld/%lld  loss %lf", &k, &total, &v) == 3 && k > from)
            len += (size_t)snprintf(buf + len, n - len, "%lld/%lld %.4f\n", k, total, v);
    }
}

static bool same_file(const char *a, const char *b) {
    char *x = slurp(a) ? strdup(slurp(a)) : NULL, *y = slurp(b);
    bool same = x && y && !strcmp(x, y);
    /* slurp reads text: the bytes are compared in full below */
    FILE *fa = fopen(a, "rb"), *fb = fopen(b, "rb");
    int ca = 0, cb = 0;
    while (same && fa && fb && (ca = fgetc(fa)) == (cb = fgetc(fb)) && ca != EOF)
        ;
    same = same && fa && fb && ca == cb;
    if (fa)
        fclose(fa);
    if (fb)
        fclose(fb);
    free(x);
    return same;
}

/* A run of 2N steps and a run of N steps saved (--save DIR) then resumed (--resume DIR) for N
 * more print the same losses for steps N+1..2N and end with byte-identical model and optimizer
 * files: the resumed run restores everything the step reads (parameters, AdamW's moments and
 * step counts, the lr schedule's position, the batch sampler's and the generator's state, the
 * epoch's order), and the same kernels on the same thread count add in the same order, so the
 * comparison is exact (no tolerance). On gpt2 (warmup + cosine, clipping, two groups) and on
 * mlp over a fake Fashion-MNIST whose 3-step epochs put the split mid-epoch. */
static void test_train_resume(void **state) {
    (void)state;
    char text[256], full[256], half[256], res[256], oa[256], oc[256], d[256];
    path_in(text, sizeof text, "text.txt");
    write_text(text);
    write_fake_mnist();
    path_in(d, sizeof d, "");
    path_in(oa, sizeof oa, "a.out");
    path_in(oc, sizeof oc, "c.out");
    for (int model = 0; model < 2; model++) {
        const char *m = model ? "mlp" : "gpt2", *data = model ? d : text;
        const char *batch = model ? "3" : "2";
        path_in(full, sizeof full, model ? "ck_full_mlp" : "ck_full");
        path_in(half, sizeof half, model ? "ck_half_mlp" : "ck_half");
        path_in(res, sizeof res, model ? "ck_res_mlp" : "ck_res");
        result r;
        run(&r, oa, 0,
            (const char *const[]){"train", "--model", m, "--data", data, "--batch", batch,
                                  "--steps", "8", "--warmup", "2", "--clip", "0.5", "--schedule",
                                  "cosine", "--save", full, NULL});
        expect(&r, 0, NULL, "train 8 steps");
        run(&r, NULL, 0,
            (const char *const[]){"train",      "--model",  m,         "--data", data,
                                  "--batch",    batch,      "--steps", "4",      "--decay-steps",
                                  "8",          "--warmup", "2",       "--clip", "0.5",
                                  "--schedule", "cosine",   "--save",  half,     NULL});
        expect(&r, 0, NULL, "train 4 steps");
        run(&r, oc, 0,
            (const char *const[]){"train",    "--model", m,         "--data",     data,
                                  "--batch",  batch,     "--steps", "8",          "--warmup",
                                  "2",        "--clip",  "0.5",     "--schedule", "cosine",
                                  "--resume", half,      "--save",  res,          NULL});
        expect(&r, 0, NULL, "train --resume");
        static char la[4096], lc[4096];
        char *a = strdup(slurp(oa)), *c = strdup(slurp(oc));
        loss_lines(a, 4, la, sizeof la);
        loss_lines(c, 4, lc, sizeof lc);
        if (!la[0] || strcmp(la, lc))
            fail_msg("%s: the resumed run's losses differ:\n%s---\n%s", m, la, lc);
        assert_non_null(strstr(c, "resumed from "));
        assert_non_null(strstr(c, "at step 4\n"));
        free(a);
        free(c);
        char f1[300], f2[300];
        const char *files[] = {"model.safetensors", "optim.safetensors", "train.safetensors"};
        for (int k = 0; k < 3; k++) {
            snprintf(f1, sizeof f1, "%s/%s", full, files[k]);
            snprintf(f2, sizeof f2, "%s/%s", res, files[k]);
            if (!same_file(f1, f2))
                fail_msg("%s: %s differs between the full and the resumed run", m, files[k]);
        }
        /* Nothing left to do, another model: refused (exit 2) with the reason. */
        run(&r, NULL, 0,
            (const char *const[]){"train", "--model", m, "--data", data, "--batch", batch,
                                  "--steps", "4", "--resume", half, NULL});
        expect(&r, 2, "the checkpoint is at step 4; --steps 4 leaves nothing to do", "resume");
    }
    result r;
    run(&r, NULL, 0,
        (const char *const[]){"train", "--model", "gpt2", "--data", text, "--batch", "2", "--steps",
                              "5", "--resume", half, NULL});
    expect(&r, 1, "--resume", "resume gpt2 from mlp");
    assert_non_null(strstr(r.err, "which the module does not have"));
    run(&r, NULL, 0, (const char *const[]){"train", "--clip", "-1", NULL});
    expect(&r, 2, "--clip: expected a finite number >= 0, got '-1'", "--clip -1");
    run(&r, NULL, 0,
        (const char *const[]){"train", "--model", "gpt2", "--data", text, "--steps", "4",
                              "--warmup", "5", "--decay-steps", "3", NULL});
    expect(&r, 2, "--decay-steps 3 is less than --warmup 5", "--decay-steps < --warmup");
}

static void test_train_batch_too_large_for_memory(void **state) {
    (void)state;
    char text[256];
    path_in(text, sizeof text, "text.txt");
    write_text(text);
    result r;
    run(&r, NULL, 0,
        (const char *const[]){"train", "--model", "gpt2", "--data", text, "--batch", "1000000000",
                              NULL});
    expect(&r, 1, "aotgrad train: --batch 1000000000 needs about ", "train --batch 1e9");
    assert_non_null(strstr(r.err, " GB; this machine has "));
    assert_non_null(strstr(r.err, " GB available\n"));
    assert_true(r.secs < 60);
}

/* ---- input ---- */

static void test_show_endless_input(void **state) {
    (void)state;
    result r;
    run(&r, NULL, 0, (const char *const[]){"show", "/dev/zero", NULL});
    expect(&r, 1, "aotgrad show: /dev/zero: larger than 256 MiB, the limit for graph files",
           "show /dev/zero");
    assert_true(r.secs < 60);
    /* A regular file over the limit is refused by its size, before reading (sparse file). */
    char big[256];
    path_in(big, sizeof big, "big.txt");
    int fd = open(big, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    assert_true(fd >= 0);
    assert_int_equal(ftruncate(fd, (off_t)1 << 32), 0);
    close(fd);
    run(&r, NULL, 0, (const char *const[]){"show", big, NULL});
    expect(&r, 1, "larger than 256 MiB", "show big.txt");
    unlink(big);
    /* An empty device is read to its end: the parser's own error, no crash. */
    run(&r, NULL, 0, (const char *const[]){"show", "/dev/null", NULL});
    assert_int_equal(r.status, 1);
}

/* ---- saved joints: export -o FILE.joint, then partition and check read it ---- */

/* text with `from` replaced by `to` (once), in a static buffer. */
static const char *replace_once(const char *text, const char *from, const char *to) {
    static char buf[1 << 20];
    const char *at = strstr(text, from);
    assert_non_null(at);
    size_t k = (size_t)(at - text);
    assert_true(strlen(text) - strlen(from) + strlen(to) < sizeof buf);
    memcpy(buf, text, k);
    strcpy(buf + k, to);
    strcat(buf + k, at + strlen(from));
    return buf;
}

static void test_saved_joint_round_trip(void **state) {
    (void)state;
    result r;
    char jf[256], out[256], txt[256];
    path_in(jf, sizeof jf, "convbn.joint");
    path_in(out, sizeof out, "out.txt");
    path_in(txt, sizeof txt, "convbn.txt");
    /* -o FILE.joint picks the saved format; --format text still writes the graph. */
    run(&r, NULL, 0, (const char *const[]){"export", "convbn", "-o", jf, NULL});
    expect(&r, 0, NULL, "export convbn -o convbn.joint");
    char *s = slurp(jf);
    assert_non_null(s);
    assert_true(!strncmp(s,
                         "aotgrad-joint 2\nparams_spec: ['conv.weight', 'conv.bias', "
                         "'bn.weight', 'bn.bias']\nbuffers_spec: ['bn.running_mean', "
                         "'bn.running_var', 'bn.num_batches_tracked']\n",
                         150));
    run(&r, NULL, 0,
        (const char *const[]){"export", "convbn", "--format", "text", "-o", txt, NULL});
    expect(&r, 0, NULL, "export convbn --format text -o");
    assert_true(!strncmp(slurp(txt), "graph():\n", 9));
    run(&r, NULL, 0,
        (const char *const[]){"export", "convbn", "--format", "joint", "-o", txt, NULL});
    expect(&r, 0, NULL, "export convbn --format joint -o convbn.txt");
    assert_true(!strncmp(slurp(txt), "aotgrad-joint 2\n", 16));
    /* partition FILE.joint prints what partition MODEL prints. */
    char want[256];
    path_in(want, sizeof want, "want.txt");
    run(&r, want, 0, (const char *const[]){"partition", "convbn", "--partitioner", "mincut", NULL});
    expect(&r, 0, NULL, "partition convbn");
    char *w = strdup(slurp(want));
    run(&r, out, 0, (const char *const[]){"partition", jf, "--partitioner", "mincut", NULL});
    expect(&r, 0, NULL, "partition convbn.joint");
    assert_string_equal(slurp(out), w);
    free(w);
    /* check FILE.joint: compiled vs interpreted, and finite differences. */
    run(&r, out, 0, (const char *const[]){"check", jf, "--steps", "2", NULL});
    expect(&r, 0, NULL, "check convbn.joint");
    const char *o = slurp(out);
    assert_non_null(strstr(o, "compiled vs interpreted: max relative difference: outputs 0"));
    assert_non_null(strstr(o, "gradient vs central finite differences"));
    assert_non_null(strstr(o, ": OK\n"));
    /* A saved GPT-2 with dropout: the masks are drawn alike in every call, and its loss with
     * N(0, 1) weights is curved enough that only the 1e-5 step agrees to 1e-2 (at 1e-3 and
     * 1e-4 the difference was 10%). */
    char gj[256];
    path_in(gj, sizeof gj, "gpt2_dropout.joint");
    run(&r, out, 0, (const char *const[]){"export", "gpt2", "--dropout", "0.1", "-o", gj, NULL});
    expect(&r, 0, NULL, "export gpt2 --dropout 0.1 -o gpt2_dropout.joint");
    run(&r, out, 0, (const char *const[]){"check", gj, NULL});
    expect(&r, 0, NULL, "check gpt2_dropout.joint");
    assert_non_null(strstr(slurp(out), "gpt2_dropout.joint: OK\n"));
    /* show FILE.joint prints its graph as export prints it. */
    run(&r, out, 0, (const char *const[]){"show", jf, NULL});
    expect(&r, 0, NULL, "show convbn.joint");
    assert_true(!strncmp(slurp(out),
                         "graph():\n    %primals_1 : f32[3, 1, 3, 3]  # "
                         "ParamAOTInput(target='conv.weight')",
                         70));
    /* A joint with TwoTensor parameters and output: partition reads it as it partitions the
     * model; check refuses it (it makes plain inputs only). */
    path_in(jf, sizeof jf, "two_tensor.joint");
    run(&r, NULL, 0, (const char *const[]){"export", "two_tensor", "-o", jf, NULL});
    expect(&r, 0, NULL, "export two_tensor -o two_tensor.joint");
    assert_non_null(strstr(slurp(jf), "\nsubclass_inputs: 3\n  0 TwoTensor(f32[2, 3]{3, 1}+0; "));
    run(&r, want, 0, (const char *const[]){"partition", "two_tensor", NULL});
    expect(&r, 0, NULL, "partition two_tensor");
    w = strdup(slurp(want));
    run(&r, out, 0, (const char *const[]){"partition", jf, NULL});
    expect(&r, 0, NULL, "partition two_tensor.joint");
    assert_string_equal(slurp(out), w);
    free(w);
    run(&r, out, 0, (const char *const[]){"check", jf, NULL});
    expect(&r, 1,
           "two_tensor.joint: the joint takes tensor subclass instances; checking a saved "
           "joint makes plain random inputs only",
           "check two_tensor.joint");
    unlink(jf);
    /* The effects model's joint calls a custom op, registered by the CLI before loading. */
    path_in(jf, sizeof jf, "effects.joint");
    run(&r, NULL, 0, (const char *const[]){"export", "effects", "-o", jf, NULL});
    expect(&r, 0, NULL, "export effects -o effects.joint");
    run(&r, out, 0, (const char *const[]){"check", jf, NULL});
    expect(&r, 0, NULL, "check effects.joint");
    unlink(jf);
}

static void test_saved_joint_errors(void **state) {
    (void)state;
    result r;
    char jf[256], bad[256], msg[512];
    path_in(jf, sizeof jf, "linear.joint");
    path_in(bad, sizeof bad, "bad.joint");
    run(&r, NULL, 0, (const char *const[]){"export", "linear", "-o", jf, NULL});
    expect(&r, 0, NULL, "export linear -o linear.joint");
    char *s = strdup(slurp(jf));
    /* A truncated file: the loader names the file and the line. */
    char *cut = strdup(s);
    cut[strlen(s) * 2 / 3] = 0;
    spit(bad, cut);
    free(cut);
    run(&r, NULL, 0, (const char *const[]){"partition", bad, NULL});
    snprintf(msg, sizeof msg, "aotgrad partition: joint_load_file: %s: line ", bad);
    expect(&r, 1, msg, "partition of a truncated joint");
    run(&r, NULL, 0, (const char *const[]){"check", bad, NULL});
    snprintf(msg, sizeof msg, "aotgrad check: joint_load_file: %s: line ", bad);
    expect(&r, 1, msg, "check of a truncated joint");
    run(&r, NULL, 0, (const char *const[]){"show", bad, NULL});
    snprintf(msg, sizeof msg, "aotgrad show: %s: joint_load: line ", bad);
    expect(&r, 1, msg, "show of a truncated joint");
    spit(bad, "aotgrad-joint 1\nparams_spec: []\n");
    run(&r, NULL, 0, (const char *const[]){"check", bad, NULL});
    snprintf(msg, sizeof msg,
             "aotgrad check: joint_load_file: %s: line 3: expected 'buffers_spec: ', "
             "got end of input\n",
             bad);
    expect(&r, 1, msg, "check of a two-line joint");
    /* A missing file names the path. */
    path_in(bad, sizeof bad, "missing.joint");
    run(&r, NULL, 0, (const char *const[]){"partition", bad, NULL});
    snprintf(msg, sizeof msg, "aotgrad partition: joint_load_file: cannot open %s: No such file",
             bad);
    expect(&r, 1, msg, "partition of a missing joint");
    run(&r, NULL, 0, (const char *const[]){"check", bad, NULL});
    expect(&r, 1, "cannot open", "check of a missing joint");
    /* Zoo build options do not apply to a saved joint. */
    run(&r, NULL, 0, (const char *const[]){"check", jf, "--dropout", "0.5", NULL});
    expect(&r, 2, "is a saved joint", "check FILE.joint --dropout");
    /* A wrong gradient (the bias's mean instead of its sum) fails the finite differences. */
    path_in(bad, sizeof bad, "wrong.joint");
    spit(bad, replace_once(s, "sum.dim_IntList(%tangents_1, [0], True)",
                           "mean.dim(%tangents_1, [0], True)"));
    char out[256];
    path_in(out, sizeof out, "out.txt");
    run(&r, out, 0, (const char *const[]){"check", bad, NULL});
    expect(&r, 1, NULL, "check of a joint with a wrong gradient");
    assert_non_null(strstr(slurp(out), ": MISMATCH\n"));
    /* Inputs that share memory are refused with a message. */
    path_in(bad, sizeof bad, "alias.joint");
    run(&r, NULL, 0, (const char *const[]){"export", "alias_views", "-o", bad, NULL});
    expect(&r, 0, NULL, "export alias_views -o alias.joint");
    run(&r, NULL, 0, (const char *const[]){"check", bad, NULL});
    expect(&r, 1, "shares memory with another input", "check alias.joint");
    free(s);
    unlink(jf);
}

/* ---- check's comparison ---- */

static ag_tensor *vec(int n, const double *v) {
    return tu_tensor(AG_F32, 1, (int64_t[]){n}, v);
}

static void test_check_compare_nonfinite(void **state) {
    (void)state;
    const double nan = NAN, inf = INFINITY;
    ag_tensor *a = vec(4, (double[]){1, nan, inf, -inf});
    ag_tensor *b = vec(4, (double[]){1, nan, inf, -inf});
    assert_true(cli_rel_diff(a, b) == 0); /* NaN == NaN, inf == inf at the same places */
    ag_tensor *c = vec(4, (double[]){1, 2, inf, -inf});
    assert_true(isinf(cli_rel_diff(a, c))); /* NaN on one side only */
    assert_true(isinf(cli_rel_diff(c, a)));
    ag_tensor *d = vec(4, (double[]){1, nan, -inf, -inf});
    assert_true(isinf(cli_rel_diff(a, d))); /* inf against -inf */
    ag_tensor *e = vec(4, (double[]){1, nan, 3e38, -inf});
    assert_true(isinf(cli_rel_diff(a, e))); /* inf against a finite value */
    /* An infinity in the reference does not scale the other differences away. */
    ag_tensor *f = vec(3, (double[]){inf, 3, 5});
    ag_tensor *g = vec(3, (double[]){inf, 3, 5.5});
    assert_float_equal(cli_rel_diff(f, g), 0.1, 1e-6);
    /* Finite values: largest difference over max(1, largest |ref|). */
    ag_tensor *h = vec(2, (double[]){0.25, -0.5});
    ag_tensor *k = vec(2, (double[]){0.5, -0.5});
    assert_float_equal(cli_rel_diff(h, k), 0.25, 1e-7);
    /* Shapes must agree. */
    ag_tensor *m = tu_tensor(AG_F32, 2, (int64_t[]){2, 1}, (double[]){0.25, -0.5});
    assert_true(isinf(cli_rel_diff(h, m)));
    ag_tensor *all[] = {a, b, c, d, e, f, g, h, k, m};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        ag_tensor_free(all[i]);
}

/* ---- --help and --version ---- */

/* Every command, and the file whose option parsing it runs (its flags must all be in its
 * usage; trace's and export's include show's and descriptors', which share their files). */
static const struct {
    const char *cmd, *src;
} cli_commands[] = {
    {"ops", "tools/cmd_ops.c"},
    {"train", "tools/cmd_train.c"},
    {"check", "tools/cmd_check.c"},
    {"models", NULL},
    {"trace", "tools/cmd_trace.c"},
    {"show", NULL},
    {"export", "tools/cmd_export.c"},
    {"descriptors", NULL},
    {"partition", "tools/cmd_partition.c"},
    {"shard", "tools/cmd_shard.c"},
    {"predict", "tools/cmd_predict.c"},
    {"bench", "tools/cmd_bench.c"},
    {"version", NULL},
};

/* `aotgrad CMD --help` and `-h` (also after other arguments) print CMD's usage on stdout and
 * exit 0, with nothing on stderr; the usage names every "--flag" string the command's source
 * compares its arguments with. A command missing from the list fails `aotgrad help`'s check. */
static void test_command_help(void **st) {
    (void)st;
    char out[128];
    path_in(out, sizeof out, "help.txt");
    result r;
    run(&r, out, 0, (const char *[]){"--help", NULL});
    expect(&r, 0, NULL, "aotgrad --help");
    char *top = strdup(slurp(out));
    for (size_t i = 0; i < sizeof cli_commands / sizeof cli_commands[0]; i++) {
        const char *cmd = cli_commands[i].cmd;
        char line[64];
        snprintf(line, sizeof line, "\n  %s ", cmd);
        if (!strstr(top, line))
            fail_msg("aotgrad --help does not list %s:\n%s", cmd, top);
        const char *forms[][3] = {{cmd, "--help", NULL}, {cmd, "-h", NULL}, {cmd, "mlp", "-h"}};
        for (int f = 0; f < 3; f++) {
            run(&r, out, 0, (const char *[]){forms[f][0], forms[f][1], forms[f][2], NULL});
            expect(&r, 0, NULL, cmd);
            if (r.err[0])
                fail_msg("aotgrad %s %s: stderr not empty: %s", cmd, forms[f][1], r.err);
            const char *u = slurp(out);
            char want[64];
            snprintf(want, sizeof want, "usage: aotgrad %s", cmd);
            if (!strstr(u, want))
                fail_msg("aotgrad %s %s printed no usage:\n%s", cmd, forms[f][1], u);
        }
        if (!cli_commands[i].src)
            continue;
        run(&r, out, 0, (const char *[]){cmd, "--help", NULL});
        char *usage = strdup(slurp(out));
        char src[512];
        snprintf(src, sizeof src, "%s/%s", AG_SOURCE_DIR, cli_commands[i].src);
        const char *code = slurp(src);
        assert_non_null(code);
        int nflags = 0;
        for (const char *p = strstr(code, "\"--"); p; p = strstr(p + 1, "\"--")) {
            size_t n = strspn(p + 1, "-abcdefghijklmnopqrstuvwxyz0123456789");
            if (p[1 + n] != '"' || n < 3 || !strncmp(p + 1, "--help", n))
                continue;
            char flag[64];
            snprintf(flag, sizeof flag, "%.*s", (int)n, p + 1);
            nflags++;
            if (!strstr(usage, flag))
                fail_msg("aotgrad %s --help does not mention %s (%s parses it):\n%s", cmd, flag,
                         cli_commands[i].src, usage);
        }
        assert_true(nflags > 0);
        free(usage);
    }
    free(top);
}

/* `aotgrad --version` and `aotgrad version` print "aotgrad " and ag_version(), which agrees
 * with the header's macros. */
static void test_version(void **st) {
    (void)st;
    char want[64], made[64];
    snprintf(want, sizeof want, "aotgrad %s\n", ag_version());
    snprintf(made, sizeof made, "%d.%d.%d", AG_VERSION_MAJOR, AG_VERSION_MINOR, AG_VERSION_PATCH);
    assert_string_equal(ag_version(), made);
    assert_string_equal(ag_version(), AG_VERSION_STRING);
    char out[128];
    path_in(out, sizeof out, "version.txt");
    const char *forms[] = {"--version", "version"};
    for (int f = 0; f < 2; f++) {
        result r;
        run(&r, out, 0, (const char *[]){forms[f], NULL});
        expect(&r, 0, NULL, forms[f]);
        assert_string_equal(slurp(out), want);
    }
    result r;
    run(&r, out, 0, (const char *[]){"version", "extra", NULL});
    expect(&r, 2, "aotgrad version: unexpected argument 'extra'", "version extra");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_stdout_full),
        cmocka_unit_test(test_o_dev_full),
        cmocka_unit_test(test_o_keeps_old_file),
        cmocka_unit_test(test_o_link_and_mode),
        cmocka_unit_test(test_numeric_flags),
        cmocka_unit_test(test_train_nonfinite_loss),
        cmocka_unit_test(test_export_nested_blocks),
        cmocka_unit_test(test_train_checkpoint),
        cmocka_unit_test(test_train_nested_blocks),
        cmocka_unit_test(test_train_batch_vs_data),
        cmocka_unit_test(test_train_resume),
        cmocka_unit_test(test_train_batch_too_large_for_memory),
        cmocka_unit_test(test_show_endless_input),
        cmocka_unit_test(test_check_compare_nonfinite),
        cmocka_unit_test(test_saved_joint_round_trip),
        cmocka_unit_test(test_saved_joint_errors),
        cmocka_unit_test(test_command_help),
        cmocka_unit_test(test_version),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
