/* `aotgrad train --parallel` end to end, under mpirun: the same command on 1, 2 and 4 ranks
 * (one thread each, --oversubscribe) prints the same losses as one process for every strategy
 * on mlp, cnn and gpt2 (tiny); checkpoints saved by one world load into another and continue
 * with the same losses; a --save DIR checkpoint (with each rank's optimizer shard) resumes on
 * the same world to the uninterrupted run's losses; a batch that does not split is refused; a rank
 * that fails ends the job with its message instead of leaving its peers waiting.
 *
 * Tolerance: the losses are compared as printed (4 decimals) within 2e-3. A sharded step adds
 * the same float32 numbers in another order (the batch split across ranks, then all_reduce or
 * reduce_scatter; column/row blocks of a matmul under tp), which moves a loss by ~1e-7
 * relative per step; AdamW normalizes each update by the gradient's running RMS, so such
 * differences can grow over 20 steps, but they stay orders of magnitude below 2e-3 here (the
 * runs print identical losses today). A wrong shard (a missing all_reduce, a gradient averaged
 * twice, a wrong slice of the batch) moves the losses by 1e-2 or more from step 2. */
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAXL 64
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

/* The command: `aotgrad train ARGS` in one process (np 0) or under mpirun on np ranks. */
static int train(int np, const char *args, char *out) {
    char cmd[2048];
    if (np)
        snprintf(cmd, sizeof cmd, "timeout 300 %s --oversubscribe -np %d %s train %s", AG_MPIEXEC,
                 np, AG_CLI_PATH, args);
    else
        snprintf(cmd, sizeof cmd, "timeout 300 %s train %s", AG_CLI_PATH, args);
    return run(cmd, out);
}

/* The losses of the "  step K/N  loss X" lines. */
static int losses(const char *out, double *l) {
    int n = 0;
    for (const char *p = out; (p = strstr(p, "  step ")) && n < MAXL; p++) {
        long long k, total;
        double v;
        if (sscanf(p, "  step %lld/%lld  loss %lf", &k, &total, &v) == 3)
            l[n++] = v;
    }
    return n;
}

static void assert_same_losses(const char *what, const double *ref, int nref, const char *out) {
    double l[MAXL];
    int n = losses(out, l);
    if (n != nref || n == 0)
        fail_msg("%s: %d losses, the single process printed %d:\n%s", what, n, nref, out);
    for (int i = 0; i < n; i++)
        if (!(fabs(l[i] - ref[i]) <= 2e-3))
            fail_msg("%s: loss %d is %.4f, one process %.4f:\n%s", what, i, l[i], ref[i], out);
}

static void check_model(const char *model) {
    char *out = malloc(OUTSZ);
    char args[512];
    double ref[MAXL];
    snprintf(args, sizeof args, "--model %s --steps 20 --batch 8 --seed 3", model);
    assert_int_equal(train(0, args, out), 0);
    int nref = losses(out, ref);
    assert_int_equal(nref, 11); /* steps 1, 2, 4, ..., 20 */
    static const char *const strategies[] = {"dp", "fsdp", "tp"};
    for (int s = 0; s < 3; s++) {
        for (int np = 2; np <= 4; np += 2) {
            char what[128];
            snprintf(args, sizeof args, "--model %s --steps 20 --batch 8 --seed 3 --parallel %s",
                     model, strategies[s]);
            snprintf(what, sizeof what, "%s --parallel %s on %d ranks", model, strategies[s], np);
            int rc = train(np, args, out);
            if (rc)
                fail_msg("%s: exit status %d:\n%s", what, rc, out);
            assert_same_losses(what, ref, nref, out);
        }
    }
    free(out);
}

static void test_mlp_losses(void **st) {
    (void)st;
    check_model("mlp");
}
static void test_cnn_losses(void **st) {
    (void)st;
    check_model("cnn");
}
static void test_gpt2_losses(void **st) {
    (void)st;
    check_model("gpt2");
}

/* Every strategy on `ranks` ranks (0: --parallel without mpirun, a world of one) with the
 * extra flags prints the losses of one process without them; `needle` (may be NULL) must be
 * in the output. */
static void strategies_match_one_process(int ranks, const char *extra, const char *needle) {
    char *out = malloc(OUTSZ);
    double ref[MAXL];
    assert_int_equal(train(0, "--model gpt2 --steps 10 --batch 4", out), 0);
    int nref = losses(out, ref);
    static const char *const strategies[] = {"dp", "fsdp", "tp"};
    for (int s = 0; s < 3; s++) {
        char args[256];
        snprintf(args, sizeof args, "--model gpt2 --steps 10 --batch 4%s --parallel %s", extra,
                 strategies[s]);
        int rc = train(ranks, args, out);
        if (rc)
            fail_msg("%s: exit status %d:\n%s", args, rc, out);
        if (needle)
            assert_non_null(strstr(out, needle));
        assert_same_losses(args, ref, nref, out);
    }
    free(out);
}

/* --parallel without mpirun: a world of one runs the sharded path and prints what one process
 * prints. */
static void test_world_of_one(void **st) {
    (void)st;
    strategies_match_one_process(0, "", NULL);
}

/* --checkpoint (gpt2's blocks recomputed in the backward) on 2 ranks: the sharding pass keeps
 * the recompute tags; the losses are the single process's without it. */
static void test_activation_checkpointing(void **st) {
    (void)st;
    strategies_match_one_process(2, " --checkpoint", "blocks checkpointed");
}

/* A checkpoint saved by 2 ranks under tp (c_attn is StridedShard: the gather must put the q, k
 * and v blocks back in order) holds what one process saves after the same steps: both continue
 * with the same losses, in one process and on 4 ranks under fsdp. */
static void test_checkpoint_round_trip(void **st) {
    (void)st;
    char *out = malloc(OUTSZ);
    char args[512], ck1[128], ck2[128];
    snprintf(ck1, sizeof ck1, "%s/one.safetensors", tmpdir);
    snprintf(ck2, sizeof ck2, "%s/two.safetensors", tmpdir);
    double fresh[MAXL], a[MAXL];
    snprintf(args, sizeof args, "--model gpt2 --steps 5 --batch 4 --save %s", ck1);
    assert_int_equal(train(0, args, out), 0);
    assert_int_equal(losses(out, fresh), 5);
    snprintf(args, sizeof args, "--model gpt2 --steps 5 --batch 4 --parallel tp --save %s", ck2);
    int rc = train(2, args, out);
    if (rc)
        fail_msg("saving on 2 ranks: exit status %d:\n%s", rc, out);
    /* The two checkpoints hold the same parameters. AdamW moves an element by at most about lr
     * (3e-3) per step, but by an amount set by g / sqrt(v): where a gradient element is near
     * zero, float32 sums in another order change its update by much more than their own
     * rounding (1e-5 seen on a bias). 1e-4 is under 1% of 5 steps' movement; the q/k/v blocks
     * gathered out of order differ by 0.1. */
    ag_gpt2_config cfg = ag_gpt2_config_tiny();
    ag_module *m1 = ag_nn_gpt2(&cfg), *m2 = ag_nn_gpt2(&cfg);
    assert_int_equal(ag_module_load(m1, ck1), 0);
    assert_int_equal(ag_module_load(m2, ck2), 0);
    ag_named_tensors p1, p2;
    assert_int_equal(ag_module_named_parameters(m1, true, &p1), 0);
    assert_int_equal(ag_module_named_parameters(m2, true, &p2), 0);
    assert_int_equal(p1.n, p2.n);
    for (int i = 0; i < p1.n; i++) {
        int64_t n = ag_tensor_numel(p1.tensors[i]);
        double worst = 0;
        for (int64_t e = 0; e < n; e++) {
            double d =
                fabs(ag_tensor_item_at(p1.tensors[i], e) - ag_tensor_item_at(p2.tensors[i], e));
            worst = d > worst ? d : worst;
        }
        if (!(worst <= 1e-4))
            fail_msg("%s differs by %g between the 1-process and the 2-rank tp checkpoints",
                     p1.names[i], worst);
    }
    ag_named_tensors_free(&p1);
    ag_named_tensors_free(&p2);
    ag_module_free(m1);
    ag_module_free(m2);
    /* Continuing from one process's checkpoint. */
    snprintf(args, sizeof args, "--model gpt2 --steps 3 --batch 4 --seed 1 --load %s", ck1);
    assert_int_equal(train(0, args, out), 0);
    int na = losses(out, a);
    assert_int_equal(na, 3);
    /* The load took effect: the first loss is the trained model's, not the fresh one's. */
    assert_true(a[0] < fresh[0] - 0.1);
    snprintf(args, sizeof args, "--model gpt2 --steps 3 --batch 4 --seed 1 --load %s", ck2);
    assert_int_equal(train(0, args, out), 0);
    assert_same_losses("2-rank checkpoint loaded into 1 process", a, na, out);
    snprintf(args, sizeof args,
             "--model gpt2 --steps 3 --batch 4 --seed 1 --load %s --parallel fsdp", ck2);
    rc = train(4, args, out);
    if (rc)
        fail_msg("loading on 4 ranks: exit status %d:\n%s", rc, out);
    assert_same_losses("2-rank checkpoint loaded into 4 ranks", a, na, out);
    /* A checkpoint of another model is refused with the name that does not fit. */
    snprintf(args, sizeof args, "--model mlp --steps 1 --batch 4 --load %s --parallel dp", ck2);
    assert_int_not_equal(train(2, args, out), 0);
    assert_non_null(strstr(out, "--load"));
    assert_non_null(strstr(out, "transformer.wte.weight"));
    free(out);
}

/* --save DIR / --resume DIR under --parallel: each rank saves its shard of AdamW's state, rank 0
 * the gathered model and the run's position; 2 ranks resumed after 3 of 6 steps print the
 * uninterrupted 2-rank run's losses exactly (the same ranks run the same arithmetic in the
 * same order: no tolerance needed) and end with a byte-identical model file. Another world
 * size is refused with the reason. */
static void test_parallel_resume(void **st) {
    (void)st;
    char *out = malloc(OUTSZ), *full_out = malloc(OUTSZ);
    static const char *const strategies[] = {"fsdp", "tp"};
    for (int k = 0; k < 2; k++) {
        const char *sname = strategies[k];
        char args[512], full[160], half[160], res[160];
        snprintf(full, sizeof full, "%s/full_%s", tmpdir, sname);
        snprintf(half, sizeof half, "%s/half_%s", tmpdir, sname);
        snprintf(res, sizeof res, "%s/res_%s", tmpdir, sname);
        snprintf(args, sizeof args, "--model gpt2 --steps 6 --batch 4 --parallel %s --save %s",
                 sname, full);
        int rc = train(2, args, full_out);
        if (rc)
            fail_msg("%s: exit status %d:\n%s", args, rc, full_out);
        snprintf(args, sizeof args,
                 "--model gpt2 --steps 3 --decay-steps 6 --batch 4 --parallel %s --save %s", sname,
                 half);
        rc = train(2, args, out);
        if (rc)
            fail_msg("%s: exit status %d:\n%s", args, rc, out);
        snprintf(args, sizeof args,
                 "--model gpt2 --steps 6 --batch 4 --parallel %s --resume %s --save %s", sname,
                 half, res);
        rc = train(2, args, out);
        if (rc)
            fail_msg("%s: exit status %d:\n%s", args, rc, out);
        double a[MAXL], c[MAXL];
        assert_int_equal(losses(full_out, a), 6);
        assert_int_equal(losses(out, c), 3);
        for (int i = 0; i < 3; i++)
            if (a[3 + i] != c[i])
                fail_msg("%s: resumed step %d loss %.4f, uninterrupted %.4f", sname, 4 + i, c[i],
                         a[3 + i]);
        char cmd[512];
        snprintf(cmd, sizeof cmd, "cmp %s/model.safetensors %s/model.safetensors", full, res);
        if (run(cmd, out))
            fail_msg("%s: the resumed run's model differs: %s", sname, out);
        /* Another world size: each rank's optimizer shard is another. */
        snprintf(args, sizeof args, "--model gpt2 --steps 6 --batch 4 --parallel %s --resume %s",
                 sname, half);
        assert_int_not_equal(train(4, args, out), 0);
        assert_non_null(strstr(out, "resumes with the same strategy on the same number of ranks"));
    }
    free(out);
    free(full_out);
}

static void test_batch_must_split(void **st) {
    (void)st;
    char *out = malloc(OUTSZ);
    assert_int_equal(train(2, "--model mlp --steps 1 --batch 7 --parallel fsdp", out), 2);
    assert_non_null(strstr(out, "--batch 7 does not split among 2 ranks"));
    assert_int_equal(train(0, "--model mlp --parallel pp", out), 2);
    assert_non_null(strstr(out, "--parallel: expected dp, fsdp or tp, got 'pp'"));
    free(out);
}

/* Rank 1's --data file does not exist; rank 0 reads its own and goes on to the first
 * collective of step 1. The job must end (not hang in rank 0's all_reduce) with rank 1's
 * message. */
static void test_failing_rank_ends_the_job(void **st) {
    (void)st;
    char *out = malloc(OUTSZ), cmd[2048], text[128];
    snprintf(text, sizeof text, "%s/text0", tmpdir);
    FILE *f = fopen(text, "w");
    assert_non_null(f);
    for (int i = 0; i < 200; i++)
        fputs("the quick brown fox jumps over the lazy dog. ", f);
    fclose(f);
    snprintf(cmd, sizeof cmd,
             "timeout 60 %s --oversubscribe -np 2 sh -c 'exec %s train --model gpt2 --steps 3 "
             "--batch 4 --parallel dp --data %s/text$OMPI_COMM_WORLD_RANK'",
             AG_MPIEXEC, AG_CLI_PATH, tmpdir);
    int rc = run(cmd, out);
    if (rc == 0 || rc == 124)
        fail_msg("exit status %d (124: hung):\n%s", rc, out);
    if (!strstr(out, "aotgrad: rank 1 of 2: train:") || !strstr(out, "text1"))
        fail_msg("no message from rank 1 naming its file:\n%s", out);
    free(out);
}

/* `aotgrad shard`: no MPI; the summary line in its exact form with the bytes of the plan (the
 * mlp's 235146 float32 parameters whole under dp, halved under fsdp on 2 ranks, where every
 * dim 0 splits), the sharded graph with its collectives, and usage errors. */
static void test_shard_command(void **st) {
    (void)st;
    char *out = malloc(OUTSZ), cmd[1024];
    static const struct {
        const char *strategy;
        long long params;
        const char *collective;
    } cases[] = {{"dp", 940584, "all_reduce"}, {"fsdp", 470292, "all_gather_into_tensor"}};
    for (int i = 0; i < 2; i++) {
        snprintf(cmd, sizeof cmd, "%s shard mlp --world 2 --rank 1 --parallel %s", AG_CLI_PATH,
                 cases[i].strategy);
        assert_int_equal(run(cmd, out), 0);
        const char *line = strstr(out, "per rank: params ");
        assert_non_null(line);
        long long params, optim, saved, comm;
        int k;
        if (sscanf(line,
                   "per rank: params %lld bytes, optimizer state %lld bytes, saved activations "
                   "%lld bytes; communication: %lld bytes in %d collectives per step",
                   &params, &optim, &saved, &comm, &k) != 5)
            fail_msg("summary line: %s", line);
        assert_int_equal(params, cases[i].params);
        assert_int_equal(optim, 2 * cases[i].params);
        assert_true(saved > 0 && comm > 0 && k > 0);
        assert_non_null(strstr(out, cases[i].collective));
        assert_non_null(strstr(out, "wait_tensor"));
        assert_non_null(strstr(out, "replicated for want of a sharding rule: "));
    }
    snprintf(cmd, sizeof cmd, "%s shard mlp --world 2 --rank 2 --parallel dp", AG_CLI_PATH);
    assert_int_equal(run(cmd, out), 2);
    assert_non_null(strstr(out, "--rank 2 is not a rank of a world of 2"));
    snprintf(cmd, sizeof cmd, "%s shard mlp --parallel dp", AG_CLI_PATH);
    assert_int_equal(run(cmd, out), 2);
    assert_non_null(strstr(out, "--world N is required"));
    free(out);
}

static int setup(void **st) {
    (void)st;
    snprintf(tmpdir, sizeof tmpdir, "/tmp/ag_train_par_XXXXXX");
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
        cmocka_unit_test(test_shard_command),
        cmocka_unit_test(test_batch_must_split),
        cmocka_unit_test(test_failing_rank_ends_the_job),
        cmocka_unit_test(test_world_of_one),
        cmocka_unit_test(test_activation_checkpointing),
        cmocka_unit_test(test_checkpoint_round_trip),
        cmocka_unit_test(test_parallel_resume),
        cmocka_unit_test(test_mlp_losses),
        cmocka_unit_test(test_gpt2_losses),
        cmocka_unit_test(test_cnn_losses),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
