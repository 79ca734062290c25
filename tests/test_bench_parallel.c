/* `aotgrad bench --parallel` (tools/bench_parallel.c): the smoke run's structure, not its
 * timings. One command without mpirun times the 1-rank reference and launches the 2-rank half
 * itself; its JSON holds a reference per model and a row per model and strategy (dp twice:
 * overlap on, then off), each with its step time, the bytes sent against the strategy's
 * minimum, and the hidden share of communication. The minima are checked against numbers
 * worked out by hand from the models' shapes (below), and every row must have trained as the
 * reference did (the same final loss), so a row that timed something else fails. Under a
 * user's mpirun the bench times that world only; a launcher that cannot run and bad flags end
 * with a message. */
#include "testutil.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define OUTSZ (1 << 20)

static char tmpdir[64];

/* Runs a shell command line; its stdout and stderr in out. Returns the exit status (or 128 +
 * the signal). */
static int run(const char *cmd, char *out) {
    char full[4096];
    snprintf(full, sizeof full, "%s 2>&1", cmd);
    FILE *p = popen(full, "r");
    assert_non_null(p);
    size_t n = fread(out, 1, OUTSZ - 1, p);
    out[n] = 0;
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

static double num(const json_t *o, const char *key) {
    const json_t *v = json_object_get(o, key);
    if (!json_is_number(v))
        fail_msg("field '%s' is not a number", key);
    return json_number_value(v);
}

static json_t *load(const char *path) {
    json_error_t err;
    json_t *root = json_load_file(path, 0, &err);
    if (!root)
        fail_msg("%s: %s", path, err.text);
    return root;
}

/* The minimum bytes per rank and step on 2 ranks ((N-1)/N = 1/2), by hand:
 * mlp, 784-256-128-10: P = 4 x (784*256+256 + 256*128+128 + 128*10+10) = 4 x 235146 = 940584.
 *   dp: 2 x 1/2 x P = 940584.
 *   fsdp: 1/2 x (2P + Pb); the backward reads fc2.weight and fc3.weight (fc1's input is the
 *   data: no input gradient, so fc1.weight is not read; biases never are):
 *   Pb = 4 x (32768 + 1280) = 136192, so 1/2 x (1881168 + 136192) = 1008680.
 *   tp: fc1 column-parallel reading the data (nothing to send), fc2 row-parallel with output
 *   [128, 128]: 2 x 1/2 x 4 x 128 x 128 = 65536.
 * gpt2 tiny (2 layers, C 64, vocab 256, block 64, lm_head tied to wte): per layer ln_1 128,
 *   c_attn 64*192+192, attn.c_proj 64*64+64, ln_2 128, c_fc 64*256+256, mlp.c_proj 256*64+64
 *   = 49984; P = 4 x (256*64 + 64*64 + 2*49984 + 128) = 4 x 120576 = 482304.
 *   dp: 482304.
 *   fsdp: the backward reads everything but the Linear biases and wpe (the embedding's
 *   backward needs only the indices; wte is read as lm_head): per layer 128 + 12288 + 4096 +
 *   128 + 16384 + 16384 = 49408, Pb = 4 x (2*49408 + 128 + 16384) = 461312, so
 *   1/2 x (964608 + 461312) = 712960.
 *   tp: B x T = 16 x 64 = 1024 rows; per layer two row-parallel outputs and two
 *   column-parallel inputs of 1024 x 64 floats: 2 layers x 4 x 262144 = 2097152. */
static const struct {
    const char *model, *strategy;
    bool overlap;
    double min;
} rows[] = {
    {"mlp", "dp", true, 940584},    {"mlp", "dp", false, 940584},  {"mlp", "fsdp", true, 1008680},
    {"mlp", "tp", true, 65536},     {"gpt2", "dp", true, 482304},  {"gpt2", "dp", false, 482304},
    {"gpt2", "fsdp", true, 712960}, {"gpt2", "tp", true, 2097152},
};

static void test_one_command_both_halves(void **st) {
    (void)st;
    char *out = malloc(OUTSZ), cmd[2048], json[128];
    snprintf(json, sizeof json, "%s/both.json", tmpdir);
    snprintf(cmd, sizeof cmd,
             "timeout 300 %s bench --parallel mlp gpt2 --runs 2 --warmup 1 --json %s --mpirun %s",
             AG_CLI_PATH, json, AG_MPIEXEC);
    int rc = run(cmd, out);
    if (rc)
        fail_msg("exit status %d:\n%s", rc, out);
    /* The table: its header, one line per row, the formulas and the definition of hidden. */
    assert_non_null(strstr(out, "2 ranks x 1 thread against 1 rank x 2 threads"));
    assert_non_null(strstr(out, "KB/step"));
    assert_non_null(strstr(out, "  dp    2(N-1)/N x P"));
    assert_non_null(strstr(out, "  fsdp  (N-1)/N x (2P + Pb)"));
    assert_non_null(strstr(out, "  tp    2(N-1)/N x A"));
    assert_non_null(strstr(out, "hidden: 1 - sum(wait_s) / sum(busy_s)"));
    assert_non_null(strstr(out, "\n  gpt2  dp    off "));

    json_t *root = load(json);
    assert_non_null(json_object_get(json_object_get(root, "formulas"), "tp"));
    const json_t *ref = json_object_get(root, "reference"), *res = json_object_get(root, "results");
    assert_int_equal(json_array_size(ref), 2);
    double ref_loss[2];
    for (int i = 0; i < 2; i++) {
        const json_t *r = json_array_get(ref, i);
        assert_string_equal(json_string_value(json_object_get(r, "model")), i ? "gpt2" : "mlp");
        assert_int_equal((int)num(r, "ranks"), 1);
        assert_int_equal((int)num(r, "threads_per_rank"), 2);
        assert_true(num(r, "step_s") > 0);
        ref_loss[i] = num(r, "final_loss");
        assert_true(isfinite(ref_loss[i]));
    }
    size_t n = sizeof rows / sizeof rows[0];
    assert_int_equal(json_array_size(res), n);
    for (size_t i = 0; i < n; i++) {
        const json_t *r = json_array_get(res, i);
        const char *what = rows[i].model;
        assert_string_equal(json_string_value(json_object_get(r, "model")), rows[i].model);
        assert_string_equal(json_string_value(json_object_get(r, "strategy")), rows[i].strategy);
        assert_true(json_is_true(json_object_get(r, "overlap")) == rows[i].overlap);
        assert_int_equal((int)num(r, "ranks"), 2);
        assert_int_equal((int)num(r, "threads_per_rank"), 1);
        double step = num(r, "step_s"), bytes = num(r, "bytes_per_step");
        assert_true(step > 0);
        assert_true(fabs(num(r, "step_over_reference") -
                         step / num(json_array_get(ref, i < 4 ? 0 : 1), "step_s")) < 1e-9);
        if (num(r, "min_bytes_per_step") != rows[i].min)
            fail_msg("%s %s: minimum %.0f bytes, by hand %.0f", what, rows[i].strategy,
                     num(r, "min_bytes_per_step"), rows[i].min);
        assert_true(fabs(num(r, "bytes_over_min") - bytes / rows[i].min) < 1e-9);
        /* Every strategy communicates on 2 ranks, each collective at least 4 bytes. */
        assert_true(num(r, "collectives_per_step") >= 1 && bytes >= 4);
        double wait = num(r, "wait_s_per_step"), busy = num(r, "busy_s_per_step");
        double hidden = num(r, "hidden_fraction");
        assert_true(busy > 0 && wait >= 0);
        assert_true(fabs(hidden - (1 - wait / busy)) < 1e-9 && hidden <= 1);
        /* The same training as the reference: the same model, batch and steps. */
        double loss = num(r, "final_loss");
        if (!(fabs(loss - ref_loss[i < 4 ? 0 : 1]) < 2e-3))
            fail_msg("%s %s: final loss %.5f, the reference's %.5f", what, rows[i].strategy, loss,
                     ref_loss[i < 4 ? 0 : 1]);
    }
    json_decref(root);
    free(out);
}

/* Under the user's mpirun: that world's rows, no reference. */
static void test_under_mpirun(void **st) {
    (void)st;
    char *out = malloc(OUTSZ), cmd[2048], json[128];
    snprintf(json, sizeof json, "%s/ranks.json", tmpdir);
    snprintf(cmd, sizeof cmd,
             "timeout 300 %s --oversubscribe -np 2 %s bench --parallel mlp dp --runs 2 --warmup 1 "
             "--json %s",
             AG_MPIEXEC, AG_CLI_PATH, json);
    int rc = run(cmd, out);
    if (rc)
        fail_msg("exit status %d:\n%s", rc, out);
    assert_non_null(strstr(out, "no 1-rank reference"));
    json_t *root = load(json);
    assert_int_equal(json_array_size(json_object_get(root, "reference")), 0);
    const json_t *res = json_object_get(root, "results");
    assert_int_equal(json_array_size(res), 2);
    for (int i = 0; i < 2; i++) {
        const json_t *r = json_array_get(res, i);
        assert_int_equal((int)num(r, "ranks"), 2);
        assert_true(json_is_null(json_object_get(r, "step_over_reference")));
        assert_true(num(r, "min_bytes_per_step") == 940584);
    }
    json_decref(root);
    free(out);
}

static void test_launcher_and_flags(void **st) {
    (void)st;
    char *out = malloc(OUTSZ), cmd[2048];
    /* A launcher that does not exist: the reference still prints, then the message, exit 1. */
    snprintf(cmd, sizeof cmd,
             "timeout 120 %s bench --parallel mlp tp --runs 1 --warmup 0 --mpirun "
             "/nonexistent/mpirun",
             AG_CLI_PATH);
    assert_int_equal(run(cmd, out), 1);
    assert_non_null(strstr(out, "cannot run /nonexistent/mpirun"));
    assert_non_null(strstr(out, "the 2-rank run failed (exit status 127)"));
    static const struct {
        const char *args, *msg;
        int rc;
    } bad[] = {
        {"--np 1", "--np: expected an integer in [2, 1024], got '1'", 2},
        {"--runs 0", "--runs: expected an integer in [1, 100000], got '0'", 2},
        {"--threads 2", "set N with --np", 2},
        {"mlp rnn", "bad argument 'rnn'", 2},
        {"--ranks-out /tmp/x", "--ranks-out is internal", 2},
        {"--help", "usage: aotgrad bench --parallel", 0},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        snprintf(cmd, sizeof cmd, "timeout 60 %s bench --parallel %s", AG_CLI_PATH, bad[i].args);
        int rc = run(cmd, out);
        if (rc != bad[i].rc || !strstr(out, bad[i].msg))
            fail_msg("%s: exit status %d, want %d with '%s':\n%s", bad[i].args, rc, bad[i].rc,
                     bad[i].msg, out);
    }
    /* The plain bench's usage points to the mode. */
    snprintf(cmd, sizeof cmd, "%s bench --help", AG_CLI_PATH);
    assert_int_equal(run(cmd, out), 0);
    assert_non_null(strstr(out, "aotgrad bench --parallel"));
    free(out);
}

static int setup(void **st) {
    (void)st;
    snprintf(tmpdir, sizeof tmpdir, "/tmp/ag_bench_par_XXXXXX");
    return mkdtemp(tmpdir) ? 0 : -1;
}

static int teardown(void **st) {
    (void)st;
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", tmpdir);
    return system(cmd) == 0 ? 0 : -1;
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_one_command_both_halves),
        cmocka_unit_test(test_under_mpirun),
        cmocka_unit_test(test_launcher_and_flags),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
