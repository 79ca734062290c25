/* The collectives: upstream's _c10d_functional ops, each one entry of the op table.
 *
 *   all_reduce(input, reduce_op, group_name)                   same shape, reduced over ranks
 *   all_gather_into_tensor(input, group_size, group_name)      dim 0 x group_size, rank order
 *   reduce_scatter_tensor(input, reduce_op, group_size, group)  dim 0 / group_size, this rank's
 *   all_to_all_single(input, output_split_sizes, input_split_sizes, group_name)  along dim 0
 *   broadcast(input, src, group_name)                           src's tensor on every rank
 *   wait_tensor(tensor)                                         completes the collective
 *
 * A collective's kernel starts the communication and returns; its output must go through
 * wait_tensor before anything reads it (the kernel of wait_tensor completes it). reduce_op is
 * "sum", "avg", "max" or "min"; group_name names a process group of dist.h ("0": the world).
 * The meta functions see no group (a rank's graph may be built in a process of another world
 * size), so they check only what the arguments themselves say; the kernels check them against
 * the group. Every collective is flagged AG_OP_COLLECTIVE: never removed, merged or recomputed
 * (see optable.h). wait_tensor is also pointwise, so the planned executor may give its output
 * its input's buffer. */
#include "../dist/pending.h"
#include "family.h"
#include "nn_util.h"

/* ---- argument checks shared by the meta functions and kernels ---- */

static int check_reduce_op(const char *op, const char *r) {
    if (r && (!strcmp(r, "sum") || !strcmp(r, "avg") || !strcmp(r, "max") || !strcmp(r, "min")))
        return 0;
    return ag__err(AG_EINVAL, "%s: unknown reduce_op '%s' (sum, avg, max or min)", op,
                   r ? r : "None");
}

static int check_group_name(const char *op, const char *g) {
    if (g && *g)
        return 0;
    return ag__err(AG_EINVAL, "%s: group_name must name a process group (\"0\": the world)", op);
}

/* Input dtype, and avg only on floating-point tensors (an integral mean is not a tensor of the
 * same dtype). */
static int check_input(const char *op, const ag_tensor *x, const char *reduce_op) {
    if (x->dtype != AG_F32 && x->dtype != AG_F64 && x->dtype != AG_I64 && x->dtype != AG_BOOL)
        return ag__err(AG_ENOTSUP, "%s: dtype %s is not supported", op, ag_dtype_short(x->dtype));
    if (reduce_op && x->dtype == AG_BOOL && strcmp(reduce_op, "max") && strcmp(reduce_op, "min"))
        return ag__err(AG_EINVAL,
                       "%s: reduce_op '%s' is not supported for bool tensors (max or min)", op,
                       reduce_op);
    if (reduce_op && !strcmp(reduce_op, "avg") && !ag_dtype_is_float(x->dtype))
        return ag__err(AG_EINVAL, "%s: reduce_op 'avg' needs a floating-point tensor, got %s", op,
                       ag_dtype_short(x->dtype));
    return 0;
}

static int check_dim0(const char *op, const ag_tensor *x) {
    if (x->ndim >= 1)
        return 0;
    return ag__err(AG_EINVAL,
                   "%s: input must have at least one dimension (it works along dim 0), "
                   "got a 0-dim tensor",
                   op);
}

static int check_group_size(const char *op, int64_t n) {
    if (n >= 1 && n <= (1 << 24))
        return 0;
    return ag__err(AG_EINVAL, "%s: group_size must be positive, got %lld", op, (long long)n);
}

static void same_shape(const ag_tensor *x, ag_tmeta *o) {
    ag__tmeta_contiguous(o, x->dtype, x->ndim, x->sizes);
}

/* ---- meta functions ---- */

static int all_reduce_meta(const ag_arg *a, ag_tmeta *o) {
    const char *op = "all_reduce";
    int rc = check_reduce_op(op, a[1].u.s);
    if (!rc)
        rc = check_group_name(op, a[2].u.s);
    if (!rc)
        rc = check_input(op, a[0].u.t, a[1].u.s);
    if (!rc)
        same_shape(a[0].u.t, o);
    return rc;
}

static int all_gather_meta(const ag_arg *a, ag_tmeta *o) {
    const char *op = "all_gather_into_tensor";
    const ag_tensor *x = a[0].u.t;
    int rc = check_group_size(op, a[1].u.i);
    if (!rc)
        rc = check_group_name(op, a[2].u.s);
    if (!rc)
        rc = check_input(op, x, NULL);
    if (!rc)
        rc = check_dim0(op, x);
    if (rc)
        return rc;
    int64_t sizes[AG_MAX_DIMS];
    memcpy(sizes, x->sizes, sizeof(int64_t) * (size_t)x->ndim);
    sizes[0] = ag__sat_mul(sizes[0], a[1].u.i);
    ag__tmeta_contiguous(o, x->dtype, x->ndim, sizes);
    return 0;
}

static int reduce_scatter_meta(const ag_arg *a, ag_tmeta *o) {
    const char *op = "reduce_scatter_tensor";
    const ag_tensor *x = a[0].u.t;
    int rc = check_reduce_op(op, a[1].u.s);
    if (!rc)
        rc = check_group_size(op, a[2].u.i);
    if (!rc)
        rc = check_group_name(op, a[3].u.s);
    if (!rc)
        rc = check_input(op, x, a[1].u.s);
    if (!rc)
        rc = check_dim0(op, x);
    if (rc)
        return rc;
    if (x->sizes[0] % a[2].u.i) {
        char b[128];
        return ag__err(AG_EINVAL,
                       "reduce_scatter_tensor: input %s: dim 0 (%lld) is not divisible by "
                       "group_size %lld",
                       ag_tensor_meta_str(x, b, sizeof b), (long long)x->sizes[0],
                       (long long)a[2].u.i);
    }
    int64_t sizes[AG_MAX_DIMS];
    memcpy(sizes, x->sizes, sizeof(int64_t) * (size_t)x->ndim);
    sizes[0] /= a[2].u.i;
    ag__tmeta_contiguous(o, x->dtype, x->ndim, sizes);
    return 0;
}

/* Split sizes are non-negative; the input's sum to its dim 0 (when given). */
static int check_splits(const char *op, const char *name, const ag_arg *s, int64_t *sum) {
    *sum = 0;
    for (int i = 0; i < s->n; i++) {
        if (s->u.ints[i] < 0)
            return ag__err(AG_EINVAL, "%s: %s[%d] is %lld, split sizes must be non-negative", op,
                           name, i, (long long)s->u.ints[i]);
        *sum = ag__sat_add(*sum, s->u.ints[i]);
    }
    return 0;
}

static int all_to_all_meta(const ag_arg *a, ag_tmeta *o) {
    const char *op = "all_to_all_single";
    const ag_tensor *x = a[0].u.t;
    int rc = check_group_name(op, a[3].u.s);
    if (!rc)
        rc = check_input(op, x, NULL);
    if (!rc)
        rc = check_dim0(op, x);
    int64_t out_sum = 0, in_sum = 0;
    if (!rc)
        rc = check_splits(op, "output_split_sizes", &a[1], &out_sum);
    if (!rc)
        rc = check_splits(op, "input_split_sizes", &a[2], &in_sum);
    if (rc)
        return rc;
    if (a[2].n > 0 && in_sum != x->sizes[0]) {
        char b[128];
        return ag__err(AG_EINVAL,
                       "all_to_all_single: input_split_sizes sum to %lld but input %s has %lld "
                       "rows in dim 0",
                       (long long)in_sum, ag_tensor_meta_str(x, b, sizeof b),
                       (long long)x->sizes[0]);
    }
    if (a[1].n > 0 && a[2].n > 0 && a[1].n != a[2].n)
        return ag__err(AG_EINVAL,
                       "all_to_all_single: %d output_split_sizes but %d input_split_sizes (one "
                       "per rank each)",
                       a[1].n, a[2].n);
    int64_t sizes[AG_MAX_DIMS];
    memcpy(sizes, x->sizes, sizeof(int64_t) * (size_t)x->ndim);
    if (a[1].n > 0)
        sizes[0] = out_sum;
    ag__tmeta_contiguous(o, x->dtype, x->ndim, sizes);
    return 0;
}

static int broadcast_meta(const ag_arg *a, ag_tmeta *o) {
    const char *op = "broadcast";
    int rc = check_group_name(op, a[2].u.s);
    if (!rc && a[1].u.i < 0)
        rc = ag__err(AG_EINVAL, "broadcast: src must be a rank (>= 0), got %lld",
                     (long long)a[1].u.i);
    if (!rc)
        rc = check_input(op, a[0].u.t, NULL);
    if (!rc)
        same_shape(a[0].u.t, o);
    return rc;
}

static int wait_meta(const ag_arg *a, ag_tmeta *o) {
    same_shape(a[0].u.t, o);
    return 0;
}

/* ---- kernels: start the collective (src/dist/pending.c), or complete it ---- */

static int group_of(const char *op, const char *name, ag_group **g) {
    return ag__dist_group(op, name, g);
}

static int check_size(const char *op, const ag_group *g, int64_t group_size) {
    if (group_size == ag_group_size(g))
        return 0;
    return ag__err(AG_EINVAL, "%s: group_size %lld but group '%s' has %d ranks", op,
                   (long long)group_size, ag_group_name(g), ag_group_size(g));
}

/* Copies x into a staging tensor the collective owns and starts it into out. */
static int start(ag__coll *c, const ag_tensor *x, ag_tensor *out) {
    ag_tensor *st = ag__tensor_new(x->dtype, x->ndim, x->sizes, false);
    if (!st)
        return ag_last_status() ? ag_last_status() : AG_ENOMEM;
    int rc = ag__copy_into(st, x);
    if (rc) {
        ag_tensor_free(st);
        return rc;
    }
    c->staging = st;
    c->out = out;
    return ag__coll_start(c);
}

static int all_reduce_kernel(const ag_arg *a, ag_tensor **o) {
    ag_group *g;
    int rc = group_of("all_reduce", a[2].u.s, &g);
    if (rc)
        return rc;
    ag__coll c = {
        .kind = AG__COLL_ALL_REDUCE, .op = "all_reduce", .group = g, .reduce_op = a[1].u.s};
    return start(&c, a[0].u.t, o[0]);
}

static int all_gather_kernel(const ag_arg *a, ag_tensor **o) {
    const char *op = "all_gather_into_tensor";
    ag_group *g;
    int rc = group_of(op, a[2].u.s, &g);
    if (!rc)
        rc = check_size(op, g, a[1].u.i);
    if (rc)
        return rc;
    ag__coll c = {.kind = AG__COLL_ALL_GATHER, .op = op, .group = g};
    return start(&c, a[0].u.t, o[0]);
}

static int reduce_scatter_kernel(const ag_arg *a, ag_tensor **o) {
    const char *op = "reduce_scatter_tensor";
    ag_group *g;
    int rc = group_of(op, a[3].u.s, &g);
    if (!rc)
        rc = check_size(op, g, a[2].u.i);
    if (rc)
        return rc;
    ag__coll c = {.kind = AG__COLL_REDUCE_SCATTER, .op = op, .group = g, .reduce_op = a[1].u.s};
    return start(&c, a[0].u.t, o[0]);
}

/* Rows per rank: the split sizes given, or `rows` cut into equal parts. */
static int splits_of(const ag_group *g, const ag_arg *s, const char *name, int64_t rows,
                     int64_t *out) {
    int n = ag_group_size(g);
    if (s->n > 0) {
        if (s->n != n)
            return ag__err(AG_EINVAL,
                           "all_to_all_single: %d %s but group '%s' has %d ranks (one each)", s->n,
                           name, ag_group_name(g), n);
        memcpy(out, s->u.ints, sizeof(int64_t) * (size_t)n);
        return 0;
    }
    if (rows % n)
        return ag__err(AG_EINVAL,
                       "all_to_all_single: no %s, and dim 0 (%lld) is not divisible by the %d "
                       "ranks of group '%s'",
                       name, (long long)rows, n, ag_group_name(g));
    for (int r = 0; r < n; r++)
        out[r] = rows / n;
    return 0;
}

static int all_to_all_kernel(const ag_arg *a, ag_tensor **o) {
    const char *op = "all_to_all_single";
    const ag_tensor *x = a[0].u.t;
    ag_group *g;
    int rc = group_of(op, a[3].u.s, &g);
    if (rc)
        return rc;
    int n = ag_group_size(g);
    int64_t *rows = ag__malloc(sizeof(int64_t) * 2 * (size_t)n);
    if (!rows)
        return AG_ENOMEM;
    rc = splits_of(g, &a[2], "input_split_sizes", x->sizes[0], rows);
    if (!rc)
        rc = splits_of(g, &a[1], "output_split_sizes", o[0]->sizes[0], rows + n);
    if (!rc) {
        int64_t row = 1; /* elements per row of dim 0 */
        for (int d = 1; d < x->ndim; d++)
            row *= x->sizes[d];
        ag__coll c = {.kind = AG__COLL_ALL_TO_ALL,
                      .op = op,
                      .group = g,
                      .send_rows = rows,
                      .recv_rows = rows + n,
                      .row_elems = row};
        if (n == 1 && o[0]->sizes[0] != x->sizes[0])
            rc = ag__err(AG_EINVAL,
                         "all_to_all_single: output_split_sizes [%lld] but the input has %lld "
                         "rows on a group of 1 rank",
                         (long long)o[0]->sizes[0], (long long)x->sizes[0]);
        else
            rc = start(&c, x, o[0]);
    }
    ag__free(rows);
    return rc;
}

static int broadcast_kernel(const ag_arg *a, ag_tensor **o) {
    ag_group *g;
    int rc = group_of("broadcast", a[2].u.s, &g);
    if (rc)
        return rc;
    if (a[1].u.i >= ag_group_size(g))
        return ag__err(AG_EINVAL, "broadcast: src %lld but group '%s' has %d ranks",
                       (long long)a[1].u.i, ag_group_name(g), ag_group_size(g));
    ag__coll c = {.kind = AG__COLL_BROADCAST, .op = "broadcast", .group = g, .root = (int)a[1].u.i};
    return start(&c, a[0].u.t, o[0]);
}

/* Completes the collective that writes the input's buffer (if any), then the output is the
 * input: nothing to do when the executor gave both one buffer. */
static int wait_kernel(const ag_arg *a, ag_tensor **o) {
    int rc = ag__coll_wait(ag__base(a[0].u.t));
    if (rc < 0)
        return rc;
    if (ag__base(o[0]) == ag__base(a[0].u.t))
        return 0;
    return ag__copy_into(o[0], a[0].u.t);
}

/* This process's rank in group `name` (-1, with the error set, when there is no such group). */
static int64_t ag__coll_group_rank(const char *name) {
    ag_group *g;
    return ag__dist_group("broadcast", name, &g) ? -1 : ag_group_rank(g);
}

/* ---- backward rules ----
 * The convention: the program's loss is the sum over ranks of each rank's loss, so the gradient
 * of a collective's input on rank r sums what every rank's output contributed to it. Each rule
 * emits collectives of its own (every rank runs the same backward, as SPMD needs) and waits on
 * them right away. */

static int bw_status(ag_bwctx *c) {
    if (c->grad_inputs[0] || !c->grad_outputs[0])
        return 0;
    return ag_last_status() ? ag_last_status() : AG_EINVAL;
}

static int not_differentiable(const char *op, const char *reduce_op) {
    return ag__err(AG_ENOTSUP,
                   "%s: the derivative for reduce_op '%s' is not implemented (only sum and avg "
                   "are differentiable)",
                   op, reduce_op);
}

/* all_reduce(sum): every rank's output is the sum of all inputs, so each input's gradient is
 * the sum of all output gradients: all_reduce(sum) of the grad. avg: the mean of the output
 * gradients, all_reduce(avg). max/min: not differentiable. */
static int all_reduce_backward(ag_bwctx *c) {
    const char *r = c->args[1].u.s;
    if (strcmp(r, "sum") && strcmp(r, "avg"))
        return not_differentiable("all_reduce", r);
    ag_tensor *g = c->grad_outputs[0];
    if (g)
        c->grad_inputs[0] = ag_wait_tensor(ag_all_reduce(g, r, c->args[2].u.s));
    return bw_status(c);
}

/* all_gather_into_tensor: rank r's input is block r of every rank's output, so its gradient is
 * the sum over ranks of block r of their output gradients: reduce_scatter_tensor(sum). */
static int all_gather_backward(ag_bwctx *c) {
    ag_tensor *g = c->grad_outputs[0];
    if (g)
        c->grad_inputs[0] =
            ag_wait_tensor(ag_reduce_scatter_tensor(g, "sum", c->args[1].u.i, c->args[2].u.s));
    return bw_status(c);
}

/* reduce_scatter_tensor(sum): block r of every rank's input feeds rank r's output only, so
 * each input's gradient is the output gradients of all ranks, gathered in rank order:
 * all_gather_into_tensor (avg: divided by the group size, the mean's factor). max/min: not
 * differentiable. */
static int reduce_scatter_backward(ag_bwctx *c) {
    const char *r = c->args[1].u.s;
    if (strcmp(r, "sum") && strcmp(r, "avg"))
        return not_differentiable("reduce_scatter_tensor", r);
    ag_tensor *g = c->grad_outputs[0];
    if (!g)
        return 0;
    int64_t n = c->args[2].u.i;
    g = ag_wait_tensor(ag_all_gather_into_tensor(g, n, c->args[3].u.s));
    c->grad_inputs[0] = strcmp(r, "avg") ? g : ag_div_scalar(g, (double)n);
    return bw_status(c);
}

/* all_to_all_single: the rows rank r sent to rank s come back from s's output gradient by the
 * reverse exchange: all_to_all_single with output and input split sizes swapped. */
static int all_to_all_backward(ag_bwctx *c) {
    ag_tensor *g = c->grad_outputs[0];
    const ag_arg *out = &c->args[1], *in = &c->args[2];
    if (g)
        c->grad_inputs[0] = ag_wait_tensor(
            ag_all_to_all_single(g, in->u.ints, in->n, out->u.ints, out->n, c->args[3].u.s));
    return bw_status(c);
}

/* broadcast(src): only src's input reaches the outputs, each rank's output being a copy of it,
 * so src's gradient is the sum of every rank's output gradient (all_reduce(sum)) and the
 * other ranks' inputs get zero. Every rank runs the all_reduce (it is a collective). */
static int broadcast_backward(ag_bwctx *c) {
    ag_tensor *g = c->grad_outputs[0];
    if (!g)
        return 0;
    int64_t rank = ag__coll_group_rank(c->args[2].u.s);
    if (rank < 0)
        return ag_last_status();
    g = ag_wait_tensor(ag_all_reduce(g, "sum", c->args[2].u.s));
    if (g && rank != c->args[1].u.i)
        g = ag_zeros_like(g);
    c->grad_inputs[0] = g;
    return bw_status(c);
}

/* wait_tensor: the identity on values, so the gradient passes through. */
static int wait_backward(ag_bwctx *c) {
    c->grad_inputs[0] = c->grad_outputs[0];
    return 0;
}

/* ---- gradcheck samples (a world of size 1, the process's own) ---- */

static ag_tensor *srand2(ag_samples *s, int64_t r, int64_t k) {
    return ag_samples_rand(s, 2, (int64_t[]){r, k}, -1, 1);
}

static void all_reduce_samples(ag_samples *s) {
    ag_samples_add(s, "sum", (ag_arg[]){AG_A_T(srand2(s, 3, 4)), AG_A_S("sum"), AG_A_S("0")}, 3);
    ag_samples_add(s, "avg, strided",
                   (ag_arg[]){AG_A_T(ag_samples_rand_strided(s, 2, (int64_t[]){3, 4}, -1, 1)),
                              AG_A_S("avg"), AG_A_S("0")},
                   3);
}
static void all_gather_samples(ag_samples *s) {
    ag_samples_add(s, "group_size 1", (ag_arg[]){AG_A_T(srand2(s, 2, 3)), AG_A_I(1), AG_A_S("0")},
                   3);
}
static void reduce_scatter_samples(ag_samples *s) {
    ag_samples_add(s, "sum",
                   (ag_arg[]){AG_A_T(srand2(s, 4, 3)), AG_A_S("sum"), AG_A_I(1), AG_A_S("0")}, 4);
    ag_samples_add(s, "avg",
                   (ag_arg[]){AG_A_T(srand2(s, 2, 3)), AG_A_S("avg"), AG_A_I(1), AG_A_S("0")}, 4);
}
static void all_to_all_samples(ag_samples *s) {
    static const int64_t four[] = {4};
    ag_samples_add(
        s, "splits [4]",
        (ag_arg[]){AG_A_T(srand2(s, 4, 2)), AG_A_INTS(four, 1), AG_A_INTS(four, 1), AG_A_S("0")},
        4);
    static const int64_t none[1] = {0}; /* an empty list, never a NULL array */
    ag_samples_add(
        s, "no splits",
        (ag_arg[]){AG_A_T(srand2(s, 3, 2)), AG_A_INTS(none, 0), AG_A_INTS(none, 0), AG_A_S("0")},
        4);
}
static void broadcast_samples(ag_samples *s) {
    ag_samples_add(s, "src 0", (ag_arg[]){AG_A_T(srand2(s, 3, 2)), AG_A_I(0), AG_A_S("0")}, 3);
}
static void wait_samples(ag_samples *s) {
    ag_samples_add(s, "plain", (ag_arg[]){AG_A_T(srand2(s, 3, 2))}, 1);
}

/* ---- cost: no flops; the bytes read and written (the payload) ---- */

static void coll_cost(const ag_arg *a, const ag_tmeta *o, int n, ag_cost *c) {
    c->flops = 0;
    c->bytes = io_bytes(a, 1, o, n);
}

#define COLL_DTYPES AG_DT_ALL

static const ag_opdef op_all_reduce = {
    .schema = "_c10d_functional::all_reduce(Tensor input, str reduce_op, str group_name) -> Tensor",
    .flags = AG_OP_COLLECTIVE,
    .meta = all_reduce_meta,
    .kernel = all_reduce_kernel,
    .dtypes = COLL_DTYPES,
    .backward = all_reduce_backward,
    .samples = all_reduce_samples,
    .cost = coll_cost,
};
static const ag_opdef op_all_gather = {
    .schema = "_c10d_functional::all_gather_into_tensor(Tensor input, int group_size, "
              "str group_name) -> Tensor",
    .flags = AG_OP_COLLECTIVE,
    .meta = all_gather_meta,
    .kernel = all_gather_kernel,
    .dtypes = COLL_DTYPES,
    .backward = all_gather_backward,
    .samples = all_gather_samples,
    .cost = coll_cost,
};
static const ag_opdef op_reduce_scatter = {
    .schema = "_c10d_functional::reduce_scatter_tensor(Tensor input, str reduce_op, "
              "int group_size, str group_name) -> Tensor",
    .flags = AG_OP_COLLECTIVE,
    .meta = reduce_scatter_meta,
    .kernel = reduce_scatter_kernel,
    .dtypes = COLL_DTYPES,
    .backward = reduce_scatter_backward,
    .samples = reduce_scatter_samples,
    .cost = coll_cost,
};
static const ag_opdef op_all_to_all = {
    .schema = "_c10d_functional::all_to_all_single(Tensor input, SymInt[] output_split_sizes, "
              "SymInt[] input_split_sizes, str group_name) -> Tensor",
    .flags = AG_OP_COLLECTIVE,
    .meta = all_to_all_meta,
    .kernel = all_to_all_kernel,
    .dtypes = COLL_DTYPES,
    .backward = all_to_all_backward,
    .samples = all_to_all_samples,
    .cost = coll_cost,
};
static const ag_opdef op_broadcast = {
    .schema = "_c10d_functional::broadcast(Tensor input, int src, str group_name) -> Tensor",
    .flags = AG_OP_COLLECTIVE,
    .meta = broadcast_meta,
    .kernel = broadcast_kernel,
    .dtypes = COLL_DTYPES,
    .backward = broadcast_backward,
    .samples = broadcast_samples,
    .cost = coll_cost,
};
static const ag_opdef op_wait_tensor = {
    .schema = "_c10d_functional::wait_tensor(Tensor tensor) -> Tensor",
    .flags = AG_OP_COLLECTIVE | AG_OP_POINTWISE,
    .meta = wait_meta,
    .kernel = wait_kernel,
    .dtypes = COLL_DTYPES,
    .backward = wait_backward,
    .samples = wait_samples,
    .cost = coll_cost,
};

/* ---- entry points ---- */

ag_tensor *ag_all_reduce(ag_tensor *x, const char *reduce_op, const char *group) {
    AG__OP(op, "_c10d_functional::all_reduce");
    return ag__call1(op, (ag_arg[]){AG_A_T(x), AG_A_S(reduce_op), AG_A_S(group)}, 3);
}

ag_tensor *ag_all_gather_into_tensor(ag_tensor *x, int64_t group_size, const char *group) {
    AG__OP(op, "_c10d_functional::all_gather_into_tensor");
    return ag__call1(op, (ag_arg[]){AG_A_T(x), AG_A_I(group_size), AG_A_S(group)}, 3);
}

ag_tensor *ag_reduce_scatter_tensor(ag_tensor *x, const char *reduce_op, int64_t group_size,
                                    const char *group) {
    AG__OP(op, "_c10d_functional::reduce_scatter_tensor");
    return ag__call1(
        op, (ag_arg[]){AG_A_T(x), AG_A_S(reduce_op), AG_A_I(group_size), AG_A_S(group)}, 4);
}

ag_tensor *ag_all_to_all_single(ag_tensor *x, const int64_t *out_splits, int nout,
                                const int64_t *in_splits, int nin, const char *group) {
    AG__OP(op, "_c10d_functional::all_to_all_single");
    if (nout < 0 || nin < 0 || (nout > 0 && !out_splits) || (nin > 0 && !in_splits))
        return ag__err(AG_EINVAL,
                       "all_to_all_single: split size lists of %d and %d entries at %p and %p",
                       nout, nin, (const void *)out_splits, (const void *)in_splits),
               NULL;
    static const int64_t none[1] = {0}; /* an empty list may come as NULL: never hand on NULL */
    if (nout == 0)
        out_splits = none;
    if (nin == 0)
        in_splits = none;
    return ag__call1(op,
                     (ag_arg[]){AG_A_T(x), AG_A_INTS(out_splits, nout), AG_A_INTS(in_splits, nin),
                                AG_A_S(group)},
                     4);
}

ag_tensor *ag_broadcast(ag_tensor *x, int64_t src, const char *group) {
    AG__OP(op, "_c10d_functional::broadcast");
    return ag__call1(op, (ag_arg[]){AG_A_T(x), AG_A_I(src), AG_A_S(group)}, 3);
}

ag_tensor *ag_wait_tensor(ag_tensor *x) {
    AG__OP(op, "_c10d_functional::wait_tensor");
    return ag__call1(op, (ag_arg[]){AG_A_T(x)}, 1);
}

const ag_opdef *const ag__ops_collectives[] = {
    &op_all_reduce,  &op_all_gather, &op_reduce_scatter, &op_all_to_all, &op_broadcast,
    &op_wait_tensor, NULL,
};
