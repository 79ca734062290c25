/* `aotgrad predict`: the table's structure, its numbers against values computed here from the
 * models' definitions and the ring formulas (not from the tool's code), the "n/a" rows and
 * their reasons, and the usage errors. The rates and the communication model are given on the
 * command line, so every number but the measured rates is deterministic. */
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* gpt2 tiny (2 layers, 64 wide, 4 heads, vocab 256, context 64): wte 256*64, wpe 64*64, per
 * block 2 LayerNorms 4*64, c_attn 64*192+192, attn c_proj 64*64+64, c_fc 64*256+256, mlp
 * c_proj 256*64+64; ln_f 2*64. lm_head is wte (tied). */
#define TINY_PARAMS                                                                                \
    (256 * 64 + 64 * 64 +                                                                          \
     2 * (4 * 64 + 64 * 192 + 192 + 64 * 64 + 64 + 64 * 256 + 256 + 256 * 64 + 64) + 2 * 64)
#define TINY_LM_HEAD (256 * 64)
/* mlp 784-256-128-10. */
#define MLP_PARAMS (784 * 256 + 256 + 256 * 128 + 128 + 128 * 10 + 10)

#define RATES "--gflops 10 --mem-gbps 20 --latency 1e-3 --bandwidth 1e9"

enum {
    C_WORLD,
    C_STRATEGY,
    C_BATCH,
    C_FLOPS,
    C_COMPUTE,
    C_OPTIM_S,
    C_COMM_BYTES,
    C_NCOLL,
    C_COMM_S,
    C_STEP_LO,
    C_STEP_HI,
    C_PARAM,
    C_GRAD,
    C_OPTIM,
    C_ACT,
    C_SAVED,
    C_TOTAL,
    C_FALLBACK,
    C_NOTE,
    NCOLS
};

typedef struct row {
    char cell[NCOLS][256];
} row;

/* Parses the tsv in the file "out": the comment line, the header, then up to max rows. */
static int read_rows(row *rows, int max) {
    char *s = tu_cli_read("out");
    char *save = NULL, *line = strtok_r(s, "\n", &save);
    assert_non_null(line);
    assert_true(line[0] == '#');
    line = strtok_r(NULL, "\n", &save);
    assert_non_null(line);
    assert_true(!strncmp(line, "world\tstrategy\tbatch\tflops\t", 27));
    int n = 0;
    while ((line = strtok_r(NULL, "\n", &save)) && n < max) {
        int c = 0;
        for (const char *p = line;; c++) {
            size_t k = strcspn(p, "\t");
            assert_true(c < NCOLS);
            snprintf(rows[n].cell[c], sizeof rows[n].cell[c], "%.*s", (int)k, p);
            if (!p[k])
                break;
            p += k + 1;
        }
        if (c != NCOLS - 1)
            fail_msg("row %d has %d columns, not %d: %s", n, c + 1, NCOLS, line);
        n++;
    }
    free(s);
    return n;
}

static const row *find(const row *rows, int n, int world, const char *strategy) {
    for (int i = 0; i < n; i++)
        if (atoi(rows[i].cell[C_WORLD]) == world && !strcmp(rows[i].cell[C_STRATEGY], strategy))
            return &rows[i];
    fail_msg("no row for %s on %d ranks", strategy, world);
    return NULL;
}

static double num(const row *r, int c) {
    char *end;
    double v = strtod(r->cell[c], &end);
    if (end == r->cell[c] || *end)
        fail_msg("column %d of %s on %s ranks is '%s', not a number", c, r->cell[C_STRATEGY],
                 r->cell[C_WORLD], r->cell[c]);
    return v;
}

static void assert_close(double got, double want, double rel) {
    if (!(fabs(got - want) <= rel * fabs(want)))
        fail_msg("got %.17g, want %.17g (relative tolerance %g)", got, want, rel);
}

/* The numbers every row must satisfy whatever the strategy: the step's two bounds, the
 * optimizer's bytes at the memory rate, the compute at least the FLOPs at the GEMM rate, the
 * communication time as the ring model's steps of 1 ms plus bytes at 1 GB/s, and the memory. */
static void check_row(const row *r, int world) {
    double compute = num(r, C_COMPUTE), comm = num(r, C_COMM_S), optim = num(r, C_OPTIM_S);
    assert_close(num(r, C_STEP_LO), fmax(compute, comm) + optim, 1e-5);
    assert_close(num(r, C_STEP_HI), compute + comm + optim, 1e-5);
    assert_close(optim, 7 * num(r, C_GRAD) / 20e9, 1e-5);
    assert_true(compute >= num(r, C_FLOPS) / 10e9 * (1 - 1e-5));
    assert_true(num(r, C_FLOPS) > 0);
    double ncoll = num(r, C_NCOLL), steps = (comm - num(r, C_COMM_BYTES) / 1e9) / 1e-3;
    assert_close(steps, round(steps), 1e-4); /* a whole number of ring steps */
    assert_true(steps >= ncoll - 1e-6 && steps <= ncoll * 2 * (world - 1) + 1e-6);
    assert_true(num(r, C_OPTIM) == 2 * num(r, C_GRAD));
    assert_true(num(r, C_ACT) > 0);
    assert_true(num(r, C_TOTAL) ==
                num(r, C_PARAM) + num(r, C_GRAD) + num(r, C_OPTIM) + num(r, C_ACT));
}

static void setup_cli(void) {
    if (!tu_cli_setup("/tmp/ag_test_predict_XXXXXX"))
        fail_msg("the aotgrad binary is missing next to the test (CMake builds it first)");
}

static void cleanup(void) {
    static const char *const names[] = {"out", "err"};
    tu_cli_cleanup(names, 2);
}

/* gpt2 tiny on 2 and 4 ranks, one sequence of 16 tokens per rank. */
static void test_gpt2_tiny_numbers(void **state) {
    (void)state;
    setup_cli();
    assert_int_equal(tu_cli_run("predict gpt2 --world 2,4 --seq 16 --format tsv " RATES), 0);
    row rows[8];
    assert_int_equal(read_rows(rows, 8), 6);
    for (int w = 2; w <= 4; w += 2) {
        const row *dp = find(rows, 6, w, "dp"), *fsdp = find(rows, 6, w, "fsdp"),
                  *tp = find(rows, 6, w, "tp");
        for (const row *r = rows; r < rows + 6; r++)
            if (atoi(r->cell[C_WORLD]) == w) {
                check_row(r, w);
                assert_int_equal(atoi(r->cell[C_BATCH]), w); /* 1 sequence per rank */
                assert_string_equal(r->cell[C_FALLBACK], "0");
            }
        /* dp: every parameter whole on every rank (the tied weight once). */
        assert_true(num(dp, C_PARAM) == 4.0 * TINY_PARAMS);
        assert_true(num(dp, C_GRAD) == 4.0 * TINY_PARAMS);
        /* dp's communication: ring all_reduce moves 2(N-1)/N of every gradient; the tied
         * weight's two gradients (wte and lm_head placeholders) may go separately; and while
         * the mean loss has no batch-sharded rule, the log-probabilities [N*16, 256] f32 and the
         * targets [N*16] i64 are gathered ((N-1)/N of each). */
        double ring = 2.0 * (w - 1) / w, gather = (double)(w - 1) / w;
        double lo = ring * 4 * TINY_PARAMS;
        double hi = ring * 4 * (TINY_PARAMS + TINY_LM_HEAD) + gather * (w * 16.0 * (256 * 4 + 8));
        double got = num(dp, C_COMM_BYTES);
        if (!(got >= lo && got <= hi))
            fail_msg("dp on %d ranks sends %.17g bytes, outside [%.17g, %.17g]", w, got, lo, hi);
        /* fsdp: every dim 0 of tiny divides by 2 and 4: params, grads and state are 1/N. */
        assert_true(num(fsdp, C_PARAM) == 4.0 * TINY_PARAMS / w);
        assert_true(num(fsdp, C_GRAD) == 4.0 * TINY_PARAMS / w);
        /* fsdp gathers each parameter in the forward and reduce_scatters each gradient, so it
         * sends at least 2(N-1)/N of the (distinct) parameter bytes. */
        assert_true(num(fsdp, C_COMM_BYTES) >= ring * 4 * TINY_PARAMS);
        /* tp: 4 heads split among 2 and 4 ranks; the per-rank parameters are fewer than all. */
        assert_true(num(tp, C_PARAM) < 4.0 * TINY_PARAMS);
        assert_true(num(tp, C_COMM_BYTES) > 0);
    }
    /* Nothing is sent on one rank, and every strategy is then the single-process step. */
    assert_int_equal(tu_cli_run("predict gpt2 --world 1 --seq 16 --format tsv " RATES), 0);
    assert_int_equal(read_rows(rows, 8), 3);
    for (int i = 0; i < 3; i++) {
        check_row(&rows[i], 1);
        assert_true(num(&rows[i], C_COMM_BYTES) == 0);
        assert_int_equal(atoi(rows[i].cell[C_NCOLL]), 0);
        assert_true(num(&rows[i], C_PARAM) == 4.0 * TINY_PARAMS);
        assert_true(num(&rows[i], C_FLOPS) == num(&rows[0], C_FLOPS));
    }
    /* With an unbounded GEMM rate the step is bound by memory: each node at least reads its
     * inputs, so the forward and backward read every weight, wte twice (embedding and
     * lm_head), at 20 GB/s. */
    assert_int_equal(tu_cli_run("predict gpt2 --world 1 --seq 16 --format tsv --gflops 1e12 "
                                "--mem-gbps 20"),
                     0);
    assert_int_equal(read_rows(rows, 8), 3);
    assert_true(num(&rows[0], C_COMPUTE) >= 4.0 * (TINY_PARAMS + TINY_LM_HEAD) / 20e9);
    cleanup();
}

/* mlp: the gradient all_reduce is almost all dp sends (the gathered logits [N, 10] and
 * targets are 48 bytes per rank). */
static void test_mlp_dp_bytes(void **state) {
    (void)state;
    setup_cli();
    assert_int_equal(
        tu_cli_run(
            "predict mlp --world 2,4,8 --parallel dp --batch-per-rank 4 --format tsv " RATES),
        0);
    row rows[4];
    assert_int_equal(read_rows(rows, 4), 3);
    for (int i = 0; i < 3; i++) {
        int w = atoi(rows[i].cell[C_WORLD]);
        assert_int_equal(w, 2 << i);
        assert_int_equal(atoi(rows[i].cell[C_BATCH]), 4 * w);
        check_row(&rows[i], w);
        double grad = 2.0 * (w - 1) / w * 4 * MLP_PARAMS;
        double got = num(&rows[i], C_COMM_BYTES);
        assert_true(num(&rows[i], C_PARAM) == 4.0 * MLP_PARAMS);
        if (!(got >= grad && got <= grad + (double)(w - 1) / w * 4 * w * (10 * 4 + 8)))
            fail_msg("mlp dp on %d ranks sends %.17g bytes; the gradients alone are %.17g", w, got,
                     grad);
    }
    cleanup();
}

/* GPT-2 XL exports and shards in meta mode. fsdp on 8 ranks shards every parameter but the
 * embedding (50257 rows do not split among 8 ranks: it stays whole). */
static void test_gpt2_xl_fsdp(void **state) {
    (void)state;
    setup_cli();
    assert_int_equal(tu_cli_run("predict gpt2 --config gpt2-xl --world 8 --parallel fsdp --seq 16 "
                                "--format tsv " RATES),
                     0);
    row rows[2];
    assert_int_equal(read_rows(rows, 2), 1);
    check_row(&rows[0], 8);
    const double total = 1557611200.0, wte = 50257.0 * 1600;
    assert_true(num(&rows[0], C_PARAM) == 4 * (wte + (total - wte) / 8));
    cleanup();
}

/* Strategies that do not apply print n/a and why, in both formats. */
static void test_not_applicable(void **state) {
    (void)state;
    setup_cli();
    /* tp splits gpt2's 4 heads: not among 3 ranks. */
    assert_int_equal(tu_cli_run("predict gpt2 --world 3 --seq 16 --format tsv " RATES), 0);
    row rows[4];
    assert_int_equal(read_rows(rows, 4), 3);
    const row *tp = find(rows, 3, 3, "tp");
    assert_string_equal(tp->cell[C_FLOPS], "n/a");
    assert_string_equal(tp->cell[C_TOTAL], "n/a");
    assert_string_equal(tp->cell[C_NOTE],
                        "n/a: tp splits heads: 4 heads do not split among 3 ranks");
    check_row(find(rows, 3, 3, "dp"), 3);
    check_row(find(rows, 3, 3, "fsdp"), 3);
    /* A global batch of 2 does not split among 4 ranks for dp and fsdp; tp keeps it whole. */
    assert_int_equal(tu_cli_run("predict gpt2 --world 4 --batch 2 --seq 16 --format tsv " RATES),
                     0);
    assert_int_equal(read_rows(rows, 4), 3);
    for (int i = 0; i < 2; i++) {
        const row *r = find(rows, 3, 4, i ? "fsdp" : "dp");
        assert_string_equal(r->cell[C_COMM_BYTES], "n/a");
        assert_string_equal(r->cell[C_NOTE],
                            "n/a: the global batch of 2 does not split among 4 ranks");
    }
    check_row(find(rows, 3, 4, "tp"), 4);
    /* The Markdown table says the same in its row. */
    assert_int_equal(tu_cli_run("predict gpt2 --world 3 --seq 16 " RATES), 0);
    tu_cli_has("out", "| 3 | tp | 3 | n/a: tp splits heads: 4 heads do not split among 3 ranks |");
    cleanup();
}

/* The Markdown table: the header lines name the rates and the model, one row per world and
 * strategy, each with as many cells as the header. */
static void test_markdown(void **state) {
    (void)state;
    setup_cli();
    assert_int_equal(tu_cli_run("predict gpt2 --world 2,4 --seq 16 " RATES), 0);
    tu_cli_has("out", "gpt2: 121 k parameters, 16 tokens per sequence, global batch 1 per rank x "
                      "world size\n");
    tu_cli_has("out", "compute: GEMM 10 GFLOP/s (given), memory 20 GB/s (given)");
    tu_cli_has("out", "communication: latency 0.001 s per ring step, bandwidth 1 GB/s per rank");
    tu_cli_has("out", "| world | strategy | global batch | FLOPs per rank |");
    tu_cli_has("out", "| 2 | dp | 2 | ");
    tu_cli_has("out", "| 4 | tp | 4 | ");
    tu_cli_lacks("out", "n/a");
    tu_cli_lacks("out", "replicated for want of a sharding rule");
    char *s = tu_cli_read("out");
    int rows = 0, header_cells = -1;
    for (char *line = strtok(s, "\n"); line; line = strtok(NULL, "\n")) {
        if (line[0] != '|')
            continue;
        int cells = 0;
        for (char *p = line; *p; p++)
            cells += *p == '|';
        if (header_cells < 0)
            header_cells = cells;
        assert_int_equal(cells, header_cells);
        rows++;
    }
    free(s);
    assert_int_equal(header_cells, 16);
    assert_int_equal(rows, 2 + 6); /* the header, the alignment row, 2 worlds x 3 strategies */
    /* The rates are measured when not given: the header says so. */
    assert_int_equal(tu_cli_run("predict mlp --world 2 --parallel dp"), 0);
    tu_cli_has("out", "(measured: f32 mm [1024, 768] @ [768, 3072], best of 5)");
    tu_cli_has("out", "(measured: add of two 64 MiB f32 tensors, best of 5)");
    tu_cli_has("out", "| 2 | dp | 2 | ");
    cleanup();
}

static void test_usage_errors(void **state) {
    (void)state;
    setup_cli();
    static const struct {
        const char *args, *msg;
    } cases[] = {
        {"predict gpt2", "--world N is required"},
        {"predict --world 2", "MODEL is required"},
        {"predict gpt2 --world 0", "--world: expected an integer in [1, 1048576], got '0'"},
        {"predict gpt2 --world 2,", "--world: expected an integer in [1, 1048576], got ''"},
        {"predict gpt2 --world 2,x", "got 'x'"},
        {"predict gpt2 --world", "--world needs N[,N...]"},
        {"predict gpt2 --world 2 --parallel pp",
         "--parallel: expected dp, fsdp, tp or all, got 'pp'"},
        {"predict gpt2 --world 2 --format csv", "--format needs md or tsv, got 'csv'"},
        {"predict linear --world 2", "MODEL must be mlp, cnn or gpt2"},
        {"predict mlp --world 2 --seq 4", "--seq applies to gpt2 only"},
        {"predict mlp --world 2 --batch 4 --batch-per-rank 2", "exclude each other"},
        {"predict mlp --world 2 --gflops 0", "--gflops: expected a finite number > 0, got '0'"},
        {"predict mlp --world 2 --bandwidth -1", "--bandwidth: expected a finite number > 0"},
        {"predict gpt2 --config gpt2-medium --world 2", "no configuration 'gpt2-medium'"},
        {"predict mlp --world 2,1048576 --batch-per-rank 1025",
         "--batch-per-rank 1025 on 1048576 ranks is a global batch of 1074790400, above the limit "
         "of 1073741824"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        if (tu_cli_run(cases[i].args) != 2)
            fail_msg("'%s' did not exit 2", cases[i].args);
        tu_cli_has("err", cases[i].msg);
    }
    char args[256];
    snprintf(args, sizeof args, "predict mlp --world %s",
             "1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17");
    assert_int_equal(tu_cli_run(args), 2);
    tu_cli_has("err", "--world: at most 16 sizes");
    cleanup();
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_gpt2_tiny_numbers), cmocka_unit_test(test_mlp_dp_bytes),
        cmocka_unit_test(test_gpt2_xl_fsdp),      cmocka_unit_test(test_not_applicable),
        cmocka_unit_test(test_markdown),          cmocka_unit_test(test_usage_errors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
