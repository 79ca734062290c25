/* `aotgrad train`: the main job. For now a small eager training demo: an MLP classifies three
 * interleaved spirals (a classic non-linearly-separable toy problem), trained with AdamW and
 * cross-entropy, printing the loss as it falls and the held-out accuracy at the end. Later
 * milestones route the same loop through export -> partition -> compile. */
#include "cli.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { CLASSES = 3, HIDDEN = 64 };

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* n points per class on CLASSES spiral arms with Gaussian jitter: x (n*CLASSES, 2), y labels. */
static int make_spirals(int64_t n, ag_tensor **x, ag_tensor **y) {
    int64_t total = n * CLASSES;
    float *xs = malloc(sizeof(float) * (size_t)total * 2);
    int64_t *ys = malloc(sizeof(int64_t) * (size_t)total);
    ag_tensor *noise = ag_randn(AG_F32, 1, &total);
    if (!xs || !ys || !noise) {
        free(xs);
        free(ys);
        ag_tensor_free(noise);
        return -1;
    }
    const float *nz = ag_tensor_data(noise);
    for (int c = 0; c < CLASSES; c++)
        for (int64_t i = 0; i < n; i++) {
            int64_t k = c * n + i;
            double r = (double)(i + 1) / (double)n;
            double t = 2.0 * M_PI * c / CLASSES + 4.0 * r + 0.2 * nz[k];
            xs[2 * k] = (float)(r * sin(t));
            xs[2 * k + 1] = (float)(r * cos(t));
            ys[k] = c;
        }
    int64_t xsz[] = {total, 2};
    *x = ag_from_data(AG_F32, 2, xsz, xs);
    *y = ag_from_data(AG_I64, 1, &total, ys);
    free(xs);
    free(ys);
    ag_tensor_free(noise);
    return *x && *y ? 0 : -1;
}

static double accuracy(ag_module *model, ag_tensor *x, ag_tensor *y) {
    bool prev = ag_set_grad_enabled(false);
    ag_scope_begin();
    ag_tensor *pred = ag_argmax(ag_module_forward(model, x), 1, false);
    ag_tensor *hits = ag_sum_all(ag_eq(pred, y));
    double acc = hits ? ag_tensor_item(hits) / (double)ag_tensor_numel(y) : NAN;
    ag_scope_end();
    ag_set_grad_enabled(prev);
    return acc;
}

int cli_train(int argc, char **argv) {
    long long steps = 1500, seed = 0, batch = 256;
    double lr = 3e-3;
    for (int i = 1; i < argc; i++) {
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        int rc = 0;
        if (!strcmp(argv[i], "--steps"))
            rc = cli_int_opt("train", "--steps", v, 1, 100000000, &steps), i++;
        else if (!strcmp(argv[i], "--seed"))
            rc = cli_int_opt("train", "--seed", v, 0, (long long)1 << 62, &seed), i++;
        else if (!strcmp(argv[i], "--batch"))
            rc = cli_int_opt("train", "--batch", v, 1, 1 << 20, &batch), i++;
        else if (!strcmp(argv[i], "--lr"))
            rc = cli_float_opt("train", "--lr", v, &lr), i++;
        else {
            fprintf(stderr, "aotgrad train: unknown option '%s'\n"
                            "usage: aotgrad train [--steps N] [--seed S] [--batch B] [--lr F]\n",
                    argv[i]);
            return 2;
        }
        if (rc)
            return 2;
    }
    ag_manual_seed((uint64_t)seed);
    ag_tensor *xtr = NULL, *ytr = NULL, *xte = NULL, *yte = NULL;
    if (make_spirals(1000, &xtr, &ytr) || make_spirals(300, &xte, &yte)) {
        fprintf(stderr, "aotgrad train: %s\n", ag_last_error());
        return 1;
    }
    ag_module *model = ag_nn_sequential();
    ag_nn_append(model, ag_nn_linear(2, HIDDEN, true));
    ag_nn_append(model, ag_nn_relu());
    ag_nn_append(model, ag_nn_linear(HIDDEN, HIDDEN, true));
    ag_nn_append(model, ag_nn_relu());
    ag_nn_append(model, ag_nn_linear(HIDDEN, CLASSES, true));
    ag_optim *opt = ag_optim_adamw(model, lr, 0.9, 0.999, 1e-8, 0.01);
    if (!opt) {
        fprintf(stderr, "aotgrad train: %s\n", ag_last_error());
        ag_module_free(model);
        return 1;
    }
    int64_t ntr = ag_tensor_size(xtr, 0);
    printf("aotgrad train: MLP 2-%d-%d-%d (%lld parameters), 3-spiral classification, %lld "
           "training points, AdamW lr %g, batch %lld, %d threads\n",
           HIDDEN, HIDDEN, CLASSES, (long long)ag_module_num_parameters(model), (long long)ntr,
           lr, batch, ag_get_num_threads());
    double t0 = now_s(), first_loss = NAN, loss_v = NAN;
    int status = 0;
    for (long long step = 1; step <= steps; step++) {
        ag_scope_begin();
        /* A random batch of training indices. */
        ag_tensor *r = ag_rand(AG_F32, 1, (int64_t[]){batch});
        ag_tensor *idx = ag_to_dtype(ag_mul_scalar(r, (double)ntr), AG_I64);
        ag_tensor *xb = ag_index_select(xtr, 0, idx), *yb = ag_index_select(ytr, 0, idx);
        ag_tensor *loss = ag_cross_entropy(ag_module_forward(model, xb), yb, AG_REDUCTION_MEAN, -100);
        int rc = loss ? 0 : -1;
        if (!rc) {
            loss_v = ag_tensor_item(loss);
            ag_optim_zero_grad(opt);
            rc = ag_backward(loss, NULL, false);
        }
        if (!rc)
            rc = ag_optim_step(opt);
        ag_scope_end();
        if (rc) {
            fprintf(stderr, "aotgrad train: step %lld: %s\n", step, ag_last_error());
            status = 1;
            break;
        }
        if (step == 1)
            first_loss = loss_v;
        if (step == 1 || step % (steps >= 10 ? steps / 10 : 1) == 0 || step == steps) {
            double el = now_s() - t0;
            printf("  step %6lld/%lld  loss %.4f  %8.0f samples/s\n", step, steps, loss_v,
                   (double)step * (double)batch / (el > 0 ? el : 1e-9));
            fflush(stdout);
        }
    }
    if (!status) {
        double acc = accuracy(model, xte, yte);
        printf("loss %.4f -> %.4f; held-out accuracy %.1f%% (%lld points); %.2f s\n", first_loss,
               loss_v, 100.0 * acc, (long long)ag_tensor_numel(yte), now_s() - t0);
    }
    ag_optim_free(opt);
    ag_module_free(model);
    ag_tensor_free(xtr);
    ag_tensor_free(ytr);
    ag_tensor_free(xte);
    ag_tensor_free(yte);
    return status;
}
