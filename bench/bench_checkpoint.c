/* bench_checkpoint: what activation checkpointing saves and what it costs, on GPT-2.
 *
 * For GPT-2 tiny (B=16, T=64, as `aotgrad train --model gpt2`) and gpt2-small (B=4, T=64, as
 * `aotgrad bench`), with and without each block checkpointed (ag_gpt2_config.checkpoint_blocks),
 * the model's loss (loss_only) is exported as one joint and compiled with the default
 * partitioner (which hands a tagged joint to the min-cut). Reported per variant: the forward's
 * and the backward's planned arenas (ag_compiled_peak_bytes), the saved activations (distinct
 * storages of saved values the forward computes, views followed to their base; parameters and
 * inputs not counted), saved bytes as ag_partition_stats counts them (inputs included), their
 * sum as the planned step peak (forward arena + backward arena + saved activations, as `aotgrad
 * bench` counts it), the nodes the backward recomputes, and the median seconds of a compiled
 * step (forward + backward, no optimizer) and of an eager one, the variants timed interleaved
 * in the same run.
 *
 *   bench_checkpoint [--runs N] [--threads N] [--models tiny,gpt2-small]
 *
 * No timed assertion: numbers are for the reader (docs/PERFORMANCE.md records a run). */
#include "aotgrad.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static int64_t meta_bytes(const ag_tmeta *m) {
    int64_t n = 1;
    for (int d = 0; d < m->ndim; d++)
        n *= m->sizes[d];
    return n * (int64_t)ag_dtype_size(m->dtype);
}

/* The saved values' own storages: views followed to the node that computed their base. */
static int64_t saved_activations(const ag_compiled *c, int nfw) {
    const ag_garg *outs = ag_node_arg(ag_graph_output_node(ag_compiled_forward_graph(c)), 0);
    const ag_node **seen = calloc((size_t)(outs->n > 0 ? outs->n : 1), sizeof *seen);
    int nseen = 0;
    int64_t bytes = 0;
    for (int i = nfw; seen && i < outs->n; i++) {
        const ag_node *v = outs->u.nodes[i];
        while (v && ag_node_kind_of(v) == AG_NODE_CALL &&
               (ag_op_def(ag_node_op(v))->flags & AG_OP_VIEW))
            v = ag_node_arg_node(v, 0);
        if (!v || (ag_node_kind_of(v) != AG_NODE_CALL && ag_node_kind_of(v) != AG_NODE_GETITEM))
            continue;
        bool dup = false;
        for (int k = 0; k < nseen && !dup; k++)
            dup = seen[k] == v;
        if (dup)
            continue;
        seen[nseen++] = v;
        bytes += meta_bytes(ag_node_val(v, 0));
    }
    free(seen);
    return bytes;
}

typedef struct variant {
    ag_module *m;
    ag_joint *j;
    ag_compiled *c;
    double *compiled_s, *eager_s;
} variant;

static ag_tensor *tokens(int64_t B, int64_t T, int64_t V, uint64_t seed) {
    ag_manual_seed(seed);
    ag_tensor *u = ag_rand(AG_F32, 2, (int64_t[]){B, T});
    ag_tensor *s = ag_mul_scalar(u, (double)V - 0.5);
    ag_tensor *t = ag_to_dtype(s, AG_I64);
    ag_tensor_free(u);
    ag_tensor_free(s);
    return t;
}

/* One step: the loss, its backward into the parameters' .grad (zeroed after). */
static int step(variant *v, ag_tensor *const *in, bool compiled) {
    ag_scope_begin();
    ag_tensor *loss = NULL;
    int n = compiled ? ag_compiled_call_module(v->c, v->m, in, 2, &loss, 1)
                     : ag_module_call(v->m, in, 2, &loss, 1);
    int rc = n == 1 ? ag_backward(loss, NULL, false) : -1;
    ag_scope_end();
    ag_named_tensors nt;
    if (ag_module_named_parameters(v->m, true, &nt) == 0) {
        for (int i = 0; i < nt.n; i++)
            ag_tensor_set_grad(nt.tensors[i], NULL);
        ag_named_tensors_free(&nt);
    }
    return rc;
}

static int bench_model(const char *name, int runs) {
    ag_gpt2_config cfg = strcmp(name, "tiny") ? ag_gpt2_config_small() : ag_gpt2_config_tiny();
    int64_t B = strcmp(name, "tiny") ? 4 : 16, T = 64;
    cfg.loss_only = true;
    ag_tensor *in[2] = {tokens(B, T, cfg.vocab_size, 1), tokens(B, T, cfg.vocab_size, 2)};
    variant v[2] = {{0}};
    int rc = 0;
    for (int k = 0; k < 2 && rc == 0; k++) {
        cfg.checkpoint_blocks = k == 1;
        ag_manual_seed(1234);
        v[k].m = ag_nn_gpt2(&cfg);
        v[k].j = v[k].m ? ag_export_joint(v[k].m, in, 2, NULL, NULL, 0, NULL) : NULL;
        v[k].c = v[k].j ? ag_compile_joint(v[k].j, NULL) : NULL;
        v[k].compiled_s = calloc((size_t)runs, sizeof(double));
        v[k].eager_s = calloc((size_t)runs, sizeof(double));
        if (!v[k].c || !v[k].compiled_s || !v[k].eager_s) {
            fprintf(stderr, "bench_checkpoint: %s: %s\n", name, ag_last_error());
            rc = 1;
        }
    }
    /* one warm-up step of each, then the runs interleaved */
    for (int r = -1; r < runs && rc == 0; r++)
        for (int k = 0; k < 2 && rc == 0; k++)
            for (int compiled = 1; compiled >= 0 && rc == 0; compiled--) {
                double t0 = now_s();
                rc = step(&v[k], in, compiled);
                double dt = now_s() - t0;
                if (rc)
                    fprintf(stderr, "bench_checkpoint: %s step: %s\n", name, ag_last_error());
                else if (r >= 0)
                    (compiled ? v[k].compiled_s : v[k].eager_s)[r] = dt;
            }
    for (int k = 0; k < 2 && rc == 0; k++) {
        const ag_partition_stats *st = ag_compiled_stats(v[k].c);
        int64_t fw = ag_compiled_peak_bytes(v[k].c, false),
                bw = ag_compiled_peak_bytes(v[k].c, true);
        int64_t act = saved_activations(v[k].c, ag_joint_num_fw_outputs(v[k].j));
        qsort(v[k].compiled_s, (size_t)runs, sizeof(double), cmp_double);
        qsort(v[k].eager_s, (size_t)runs, sizeof(double), cmp_double);
        printf("| %s B=%lld T=%lld | %s | %.2f | %.2f | %.2f | %.2f | %.2f | %d | %.4f | %.4f |\n",
               name, (long long)B, (long long)T, k ? "checkpointed" : "plain", fw / 1048576.0,
               bw / 1048576.0, act / 1048576.0, st->saved_bytes / 1048576.0,
               (fw + bw + act) / 1048576.0, st->recomputed_nodes, v[k].compiled_s[runs / 2],
               v[k].eager_s[runs / 2]);
    }
    for (int k = 0; k < 2; k++) {
        ag_compiled_free(v[k].c);
        ag_joint_free(v[k].j);
        ag_module_free(v[k].m);
        free(v[k].compiled_s);
        free(v[k].eager_s);
    }
    ag_tensor_free(in[0]);
    ag_tensor_free(in[1]);
    return rc;
}

int main(int argc, char **argv) {
    int runs = 5;
    const char *models = "tiny,gpt2-small";
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--runs") && i + 1 < argc && atoi(argv[i + 1]) > 0)
            runs = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc && atoi(argv[i + 1]) > 0)
            ag_set_num_threads(atoi(argv[++i]));
        else if (!strcmp(argv[i], "--models") && i + 1 < argc)
            models = argv[++i];
        else {
            fprintf(stderr, "usage: bench_checkpoint [--runs N] [--threads N] "
                            "[--models tiny,gpt2-small]\n");
            return 2;
        }
    }
    printf("threads %d, median of %d runs (after one warm-up), plain and checkpointed "
           "interleaved; MiB\n\n",
           ag_get_num_threads(), runs);
    printf("| model | blocks | fw arena | bw arena | saved activations | saved bytes | planned "
           "peak | recomputed nodes | compiled step s | eager step s |\n");
    printf("|---|---|---|---|---|---|---|---|---|---|\n");
    char buf[256];
    snprintf(buf, sizeof buf, "%s", models);
    int rc = 0;
    for (char *tok = strtok(buf, ","); tok && rc == 0; tok = strtok(NULL, ","))
        if (strcmp(tok, "tiny") && strcmp(tok, "gpt2-small")) {
            fprintf(stderr, "bench_checkpoint: unknown model '%s' (tiny, gpt2-small)\n", tok);
            rc = 2;
        } else {
            rc = bench_model(tok, runs);
        }
    return rc;
}
