/* Training a model that is not in the zoo, from weights PyTorch made, with the public API only,
 * checked against PyTorch's own run (README.md, "Training your own model").
 *
 * SmallResNet: stem = Sequential(Conv2d(3, 8, 3, padding=1), BatchNorm2d(8), ReLU()),
 * block = ResidualBlock(8) (a custom module written here: relu(x + bn2(conv2(relu(bn1(conv1(x))))))
 * with bias-free convolutions), pool = MaxPool2d(2), flatten, norm = LayerNorm(128),
 * fc1 = Linear(128, 32), act = GELU(), fc2 = Linear(32, 10); mean cross-entropy on the logits.
 * Parameter and buffer names are PyTorch's (make_reference.py builds the same model), so the
 * state_dict PyTorch wrote loads as it is.
 *
 * From DIR (default examples/small_resnet) it reads weights.safetensors (the initial state),
 * data.safetensors (x [64, 3, 8, 8], y [64]), reference.txt (PyTorch's losses) and
 * final.safetensors (PyTorch's state after training). It trains three copies of the model from
 * the same weights for 20 steps, in training mode (BatchNorm uses the batch's statistics and
 * updates its running ones), with SGD(lr 0.05, momentum 0.9, weight_decay 5e-4), step s on
 * samples [16 (s mod 4), +16):
 *   eager     ag_module_call, ag_backward, ag_optim_step;
 *   compiled  the training step exported once as a joint graph (ag_export_joint), compiled
 *             (ag_compile_joint: partitioned forward and backward on the planned executor) and
 *             called each step (ag_compiled_call_module); ag_backward runs the compiled backward;
 *   min-cut   the same, partitioned by the min-cut partitioner under a memory budget of 0.5,
 *             which recomputes some activations in the backward instead of saving them.
 * It prints each step's losses and exits 1 if a loss is further than LOSS_TOL from PyTorch's
 * float32 loss, or a final parameter or buffer further than STATE_TOL from PyTorch's.
 *
 * The tolerances. Both programs compute in float32 but round differently (the order of the
 * sums in convolutions, matrix products and reductions), so they cannot agree bit for bit; how
 * far float32 rounding alone moves this training run is measured by make_reference.py, which
 * runs it a second time in float64: reference.txt's two columns differ by at most 3.4e-7 over
 * the 20 steps (the program prints the figure), and the final states by at most 3.6e-7. Two
 * correct float32 runs are each about that far from the float64 run, so they are expected a
 * few times 3.4e-7 apart; LOSS_TOL and STATE_TOL allow 1e-5, about 30 times that, and still
 * below what small semantic differences cost this run (measured with PyTorch: GELU's tanh
 * approximation instead of the exact GELU moves the losses by up to 6e-3, LayerNorm's eps 1e-4
 * instead of 1e-5 by 1.1e-4, one BatchNorm's eps 1e-4 by 1.6e-2). */
#include <aotgrad.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define STEPS 20
#define BATCH 16
#define NSAMPLES 64
#define LR 0.05
#define MOMENTUM 0.9
#define WEIGHT_DECAY 5e-4
#define LOSS_TOL 1e-5
#define STATE_TOL 1e-5

/* ---- the custom module: ResidualBlock(c) ---- */

static int residual_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out,
                            int max_out) {
    (void)max_out; /* ag_module_call guarantees room for one */
    if (nin != 1)
        return ag_set_error(AG_EINVAL, "ResidualBlock: expected 1 input, got %d", nin);
    ag_scope_begin(); /* every tensor made here is released at the end, except the output */
    ag_tensor *x = in[0];
    ag_tensor *h = ag_module_forward(ag_module_child(m, "conv1"), x);
    h = ag_relu(ag_module_forward(ag_module_child(m, "bn1"), h));
    h = ag_module_forward(ag_module_child(m, "bn2"),
                          ag_module_forward(ag_module_child(m, "conv2"), h));
    out[0] = ag_tensor_keep(ag_relu(ag_add(x, h))); /* a NULL anywhere above gives NULL here */
    ag_scope_end();
    return out[0] ? 1 : ag_last_status();
}

static ag_module *residual_block(int64_t c) {
    ag_module *m = ag_module_new("ResidualBlock", residual_forward, NULL, NULL);
    if (!m || ag_module_add_child(m, "conv1", ag_nn_conv2d(c, c, 3, 1, 1, 1, 1, false)) ||
        ag_module_add_child(m, "bn1", ag_nn_batchnorm2d(c, 1e-5, 0.1)) ||
        ag_module_add_child(m, "conv2", ag_nn_conv2d(c, c, 3, 1, 1, 1, 1, false)) ||
        ag_module_add_child(m, "bn2", ag_nn_batchnorm2d(c, 1e-5, 0.1))) {
        ag_module_free(m);
        return NULL;
    }
    return m;
}

/* ---- the model ---- */

static const char *const resnet_children[] = {"stem", "block", "pool", "flatten",
                                              "norm", "fc1",   "act",  "fc2"};

static int resnet_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out,
                          int max_out) {
    (void)max_out;
    if (nin != 1)
        return ag_set_error(AG_EINVAL, "SmallResNet: expected 1 input, got %d", nin);
    ag_scope_begin();
    ag_tensor *h = in[0];
    for (size_t i = 0; i < sizeof resnet_children / sizeof *resnet_children; i++)
        h = ag_module_forward(ag_module_child(m, resnet_children[i]), h);
    out[0] = ag_tensor_keep(h);
    ag_scope_end();
    return out[0] ? 1 : ag_last_status();
}

static ag_module *small_resnet(void) {
    ag_module *m = ag_module_new("SmallResNet", resnet_forward, NULL, NULL);
    if (!m)
        return NULL;
    /* add_child takes the child (freeing it on failure) and, given NULL, keeps the error of the
     * call that made it; once added, stem is freed with m */
    ag_module *stem = ag_nn_sequential();
    if (ag_module_add_child(m, "stem", stem) ||
        ag_nn_append(stem, ag_nn_conv2d(3, 8, 3, 1, 1, 1, 1, true)) ||
        ag_nn_append(stem, ag_nn_batchnorm2d(8, 1e-5, 0.1)) || ag_nn_append(stem, ag_nn_relu())) {
        ag_module_free(m);
        return NULL;
    }
    if (ag_module_add_child(m, "block", residual_block(8)) ||
        ag_module_add_child(m, "pool", ag_nn_maxpool2d(2, 2, 0)) ||
        ag_module_add_child(m, "flatten", ag_nn_flatten(1, -1)) ||
        ag_module_add_child(m, "norm", ag_nn_layernorm(8 * 4 * 4, 1e-5, true)) ||
        ag_module_add_child(m, "fc1", ag_nn_linear(8 * 4 * 4, 32, true)) ||
        ag_module_add_child(m, "act", ag_nn_gelu("none")) ||
        ag_module_add_child(m, "fc2", ag_nn_linear(32, 10, true))) {
        ag_module_free(m);
        return NULL;
    }
    return m;
}

/* ---- the training step: (x, y) -> mean cross-entropy of model(x) ---- */

static int step_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)max_out;
    if (nin != 2)
        return ag_set_error(AG_EINVAL, "TrainStep: expected (x, y), got %d inputs", nin);
    ag_scope_begin();
    ag_tensor *logits = ag_module_forward(ag_module_child(m, "model"), in[0]);
    out[0] = ag_tensor_keep(ag_cross_entropy(logits, in[1], AG_REDUCTION_MEAN, -100));
    ag_scope_end();
    return out[0] ? 1 : ag_last_status();
}

/* A SmallResNet with the state in `weights`, inside a TrainStep (its parameters are the model's,
 * named "model.stem.0.weight", ...). *model: the SmallResNet, borrowed from the step. */
static ag_module *train_step(const char *weights, ag_module **model) {
    ag_module *net = small_resnet();
    if (!net || ag_module_load(net, weights)) {
        ag_module_free(net);
        return NULL;
    }
    ag_module *step = ag_module_new("TrainStep", step_forward, NULL, NULL);
    if (!step) {
        ag_module_free(net);
        return NULL;
    }
    if (ag_module_add_child(step, "model", net)) {
        ag_module_free(step);
        return NULL;
    }
    ag_module_train(step, true);
    *model = net;
    return step;
}

/* The data set: x [64, 3, 8, 8] f32 and y [64] i64 from a file of named tensors. 0, or -1 with
 * a message on stderr. */
static int load_data(const char *path, ag_tensor_dict *d) {
    if (ag_safetensors_load(path, d)) {
        fprintf(stderr, "small_resnet: %s\n", ag_last_error());
        return -1;
    }
    const ag_tensor *x = ag_tensor_dict_get(d, "x"), *y = ag_tensor_dict_get(d, "y");
    if (!x || !y || ag_tensor_dtype(x) != AG_F32 || ag_tensor_ndim(x) != 4 ||
        ag_tensor_size(x, 0) != NSAMPLES || ag_tensor_dtype(y) != AG_I64 ||
        ag_tensor_ndim(y) != 1 || ag_tensor_size(y, 0) != NSAMPLES) {
        fprintf(stderr, "small_resnet: %s must hold x f32[%d, 3, 8, 8] and y i64[%d]\n", path,
                NSAMPLES, NSAMPLES);
        ag_tensor_dict_free(d);
        return -1;
    }
    return 0;
}

/* PyTorch's float32 and float64 losses from reference.txt ("step loss32 loss64" lines after a
 * '#' comment). 0, or -1 with a message on stderr. */
static int read_reference(const char *path, double *loss32, double *loss64) {
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "small_resnet: cannot open %s\n", path);
        return -1;
    }
    char line[256];
    int n = 0;
    while (fgets(line, sizeof line, f)) {
        int s;
        double a, b;
        if (line[0] == '#')
            continue;
        if (sscanf(line, "%d %lf %lf", &s, &a, &b) != 3 || s != n + 1 || n >= STEPS) {
            fprintf(stderr, "small_resnet: %s: bad line %d: %s", path, n + 1, line);
            fclose(f);
            return -1;
        }
        loss32[n] = a;
        loss64[n] = b;
        n++;
    }
    fclose(f);
    if (n != STEPS) {
        fprintf(stderr, "small_resnet: %s has %d steps, expected %d\n", path, n, STEPS);
        return -1;
    }
    return 0;
}

/* The largest difference between model's parameters and buffers and those of the same name in
 * ref; *worst names it. -1 with a message when a name or shape does not match. */
static double state_distance(const ag_module *model, const ag_module *ref, char *worst,
                             size_t nworst) {
    double dmax = 0;
    for (int pass = 0; pass < 2; pass++) {
        ag_named_tensors nt;
        int rc = pass == 0 ? ag_module_named_parameters(model, true, &nt)
                           : ag_module_named_buffers(model, true, &nt);
        if (rc)
            return -1;
        for (int i = 0; i < nt.n && dmax >= 0; i++) {
            ag_tensor *a = nt.tensors[i];
            ag_tensor *b =
                pass == 0 ? ag_module_param(ref, nt.names[i]) : ag_module_buffer(ref, nt.names[i]);
            int64_t n = ag_tensor_numel(a);
            double *va = malloc((size_t)n * sizeof *va), *vb = malloc((size_t)n * sizeof *vb);
            if (!b || ag_tensor_numel(b) != n || !va || !vb || ag_tensor_to_doubles(a, va) ||
                ag_tensor_to_doubles(b, vb)) {
                fprintf(stderr, "small_resnet: cannot compare %s\n", nt.names[i]);
                dmax = -1;
            }
            for (int64_t k = 0; k < n && dmax >= 0; k++)
                if (fabs(va[k] - vb[k]) > dmax) {
                    dmax = fabs(va[k] - vb[k]);
                    snprintf(worst, nworst, "%s", nt.names[i]);
                }
            free(va);
            free(vb);
        }
        ag_named_tensors_free(&nt);
    }
    return dmax;
}

/* One step: the loss (eager, or through the compiled callable when c is given), its backward,
 * the optimizer's update. The loss's value in *loss; 0 or -1. */
static int train_one(ag_module *step, ag_compiled *c, ag_optim *opt, ag_tensor *x, ag_tensor *y,
                     double *loss) {
    ag_scope_begin();
    ag_tensor *in[2] = {x, y}, *out = NULL;
    int n =
        c ? ag_compiled_call_module(c, step, in, 2, &out, 1) : ag_module_call(step, in, 2, &out, 1);
    int rc = n == 1 ? 0 : -1;
    if (!rc) {
        *loss = ag_tensor_item(out);
        rc = ag_backward(out, NULL, false) || ag_optim_step(opt) ? -1 : 0;
    }
    ag_optim_zero_grad(opt);
    ag_scope_end();
    return rc;
}

/* One training run: a copy of the model with its optimizer, trained eagerly (c NULL) or through a
 * compiled step. */
typedef struct run {
    const char *name;
    ag_module *step, *net; /* net: the SmallResNet inside step */
    ag_optim *opt;
    ag_compiled *c;
} run;

enum { NRUNS = 3 };

/* Builds the runs from `weights`; the data's first batch (x0, y0) gives the export its shapes.
 * 0, or -1 with the message in ag_last_error. */
static int runs_new(run *r, const char *weights, ag_tensor *x0, ag_tensor *y0) {
    /* The default partitioner saves what the backward uses; the min-cut one with a memory
     * budget of 0.5 recomputes cheap activations in the backward instead. */
    const ag_compile_opts mincut = {
        .partition = {.partitioner = AG_PARTITION_MINCUT, .memory_budget = 0.5}};
    const ag_compile_opts *opts[NRUNS] = {NULL, NULL, &mincut};
    const char *names[NRUNS] = {"eager", "compiled", "min-cut"};
    for (int k = 0; k < NRUNS; k++) {
        r[k].name = names[k];
        r[k].step = train_step(weights, &r[k].net);
        r[k].opt = r[k].step ? ag_optim_sgd(r[k].step, LR, MOMENTUM, WEIGHT_DECAY, false) : NULL;
        if (!r[k].opt)
            return -1;
        if (k == 0) {
            printf("SmallResNet: %lld parameters, loaded from %s\n",
                   (long long)ag_module_num_parameters(r[0].net), weights);
            continue;
        }
        /* Export the training step once, on the first batch's shapes (the module's tensors
         * are not changed by the export), and compile it. */
        ag_joint *j = ag_export_joint(r[k].step, (ag_tensor *[]){x0, y0}, 2, NULL, NULL, 0, NULL);
        r[k].c = j ? ag_compile_joint(j, opts[k]) : NULL;
        if (r[k].c && k == 1)
            printf("joint graph: %d primals (%d parameters, %d buffers), %d mutated inputs "
                   "(BatchNorm's running statistics)\n",
                   ag_joint_num_primals(j), ag_joint_num_params(j), ag_joint_num_buffers(j),
                   ag_joint_num_mutated_inputs(j));
        if (r[k].c)
            printf("%s: %d saved tensors, %d nodes recomputed in the backward\n", r[k].name,
                   ag_compiled_stats(r[k].c)->saved_tensors,
                   ag_compiled_stats(r[k].c)->recomputed_nodes);
        ag_joint_free(j);
        if (!r[k].c)
            return -1;
    }
    return 0;
}

static void runs_free(run *r) {
    for (int k = 0; k < NRUNS; k++) {
        ag_compiled_free(r[k].c);
        ag_optim_free(r[k].opt);
        ag_module_free(r[k].step);
    }
}

/* Trains every run STEPS steps and compares each loss with PyTorch's. 0, or 1 after a message. */
static int train_all(run *r, ag_tensor *xs, ag_tensor *ys, const double *ref32,
                     const double *ref64) {
    double dev64 = 0, worst = 0;
    printf("%4s %12s", "step", "pytorch");
    for (int k = 0; k < NRUNS; k++)
        printf(" %12s", r[k].name);
    printf(" %10s\n", "max |-pt|");
    for (int s = 0; s < STEPS; s++) {
        int64_t i = (int64_t)(s % (NSAMPLES / BATCH)) * BATCH;
        ag_tensor *x = ag_slice(xs, 0, i, i + BATCH, 1), *y = ag_slice(ys, 0, i, i + BATCH, 1);
        double loss[NRUNS], d = 0;
        int rc = x && y ? 0 : -1;
        for (int k = 0; k < NRUNS && !rc; k++)
            rc = train_one(r[k].step, r[k].c, r[k].opt, x, y, &loss[k]);
        ag_tensor_free(x);
        ag_tensor_free(y);
        if (rc) {
            fprintf(stderr, "small_resnet: step %d: %s\n", s + 1, ag_last_error());
            return 1;
        }
        printf("%4d %12.8f", s + 1, ref32[s]);
        for (int k = 0; k < NRUNS; k++) {
            printf(" %12.8f", loss[k]);
            d = isnan(loss[k]) ? NAN : fmax(d, fabs(loss[k] - ref32[s]));
        }
        printf(" %10.2e\n", d);
        dev64 = fmax(dev64, fabs(ref32[s] - ref64[s]));
        worst = fmax(worst, d);
        if (!(d <= LOSS_TOL)) { /* NaN fails too */
            fprintf(stderr,
                    "small_resnet: step %d: a loss differs from PyTorch's by more than %g\n", s + 1,
                    LOSS_TOL);
            return 1;
        }
    }
    printf("losses within %.2e of PyTorch's (tolerance %g; PyTorch float32 vs float64: %.2e)\n",
           worst, LOSS_TOL, dev64);
    return 0;
}

/* The trained states (parameters, running statistics, num_batches_tracked) against PyTorch's
 * in final_path. 0, or 1 after a message. */
static int check_state(const run *r, const char *final_path) {
    ag_module *ref = small_resnet();
    if (!ref || ag_module_load(ref, final_path)) {
        fprintf(stderr, "small_resnet: %s\n", ag_last_error());
        ag_module_free(ref);
        return 1;
    }
    int bad = 0;
    printf("after %d steps, largest difference from PyTorch's state:", STEPS);
    for (int k = 0; k < NRUNS; k++) {
        char worst[256] = "";
        double d = state_distance(r[k].net, ref, worst, sizeof worst);
        printf("%s %s %.2e (%s)", k ? "," : "", r[k].name, d, worst);
        bad |= !(d >= 0 && d <= STATE_TOL);
    }
    printf("\n");
    if (bad)
        fprintf(stderr, "small_resnet: a trained state differs from PyTorch's by more than %g\n",
                STATE_TOL);
    ag_module_free(ref);
    return bad;
}

int main(int argc, char **argv) {
    const char *dir = argc > 1 ? argv[1] : "examples/small_resnet";
    char weights[1024], data_path[1024], ref_path[1024], final_path[1024];
    snprintf(weights, sizeof weights, "%s/weights.safetensors", dir);
    snprintf(data_path, sizeof data_path, "%s/data.safetensors", dir);
    snprintf(ref_path, sizeof ref_path, "%s/reference.txt", dir);
    snprintf(final_path, sizeof final_path, "%s/final.safetensors", dir);
    double ref32[STEPS], ref64[STEPS];
    if (read_reference(ref_path, ref32, ref64))
        return 1;

    ag_tensor_dict data;
    if (load_data(data_path, &data))
        return 1;
    ag_tensor *xs = ag_tensor_dict_get(&data, "x"), *ys = ag_tensor_dict_get(&data, "y");
    ag_tensor *x0 = ag_slice(xs, 0, 0, BATCH, 1), *y0 = ag_slice(ys, 0, 0, BATCH, 1);
    run r[NRUNS] = {0};
    int bad = !x0 || !y0 || runs_new(r, weights, x0, y0);
    ag_tensor_free(x0);
    ag_tensor_free(y0);
    if (bad)
        fprintf(stderr, "small_resnet: %s\n", ag_last_error());
    bad = bad || train_all(r, xs, ys, ref32, ref64) || check_state(r, final_path);
    runs_free(r);
    ag_tensor_dict_free(&data);
    return bad;
}
