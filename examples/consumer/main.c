/* A program built against an installed aotgrad (pkg-config or find_package), used by
 * scripts/test.sh to check that the install works: fits y = 3x - 1 with SGD. */
#include <aotgrad.h>
#include <stdio.h>

int main(void) {
    ag_manual_seed(0);
    ag_module *lin = ag_nn_linear(1, 1, true);
    ag_optim *opt = ag_optim_sgd(lin, 0.1, 0.0, 0.0, false);
    if (!lin || !opt) {
        fprintf(stderr, "%s\n", ag_last_error());
        return 1;
    }
    float xs[8], ys[8];
    for (int i = 0; i < 8; i++) {
        xs[i] = (float)i / 8.0f;
        ys[i] = 3.0f * xs[i] - 1.0f;
    }
    ag_tensor *x = ag_from_data(AG_F32, 2, (int64_t[]){8, 1}, xs);
    ag_tensor *y = ag_from_data(AG_F32, 2, (int64_t[]){8, 1}, ys);
    double loss_v = 0;
    for (int step = 0; step < 500; step++) {
        ag_scope_begin();
        ag_tensor *d = ag_sub(ag_module_forward(lin, x), y);
        ag_tensor *loss = ag_mean_all(ag_mul(d, d));
        ag_optim_zero_grad(opt);
        if (!loss || ag_backward(loss, NULL, false) || ag_optim_step(opt)) {
            fprintf(stderr, "%s\n", ag_last_error());
            return 1;
        }
        loss_v = ag_tensor_item(loss);
        ag_scope_end();
    }
    printf("consumer: final loss %.2e, w %.3f, b %.3f\n", loss_v,
           ag_tensor_item(ag_module_param(lin, "weight")),
           ag_tensor_item(ag_module_param(lin, "bias")));
    ag_tensor_free(x);
    ag_tensor_free(y);
    ag_optim_free(opt);
    ag_module_free(lin);
    return loss_v < 1e-3 ? 0 : 1;
}
