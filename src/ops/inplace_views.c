/* In-place view ops: t_, transpose_, unsqueeze_ and as_strided_ change a tensor's sizes,
 * strides and storage offset in place (a metadata mutation) and leave its data alone.
 *
 * In: a tensor and the view's arguments. Out: the same tensor, now with the geometry its view
 * op's meta function computes. The dispatcher applies that geometry (AG_OP_INPLACE_VIEW), in
 * eager and in meta mode alike, so a trace sees the new shape; functionalization records the
 * out-of-place view op named in `functional` (t_ -> t), exactly as for data mutations.
 *
 * Autograd follows eager PyTorch: an in-place op on a leaf that requires grad, or on a view of
 * a tensor that takes part in autograd, is refused by the dispatcher; on other tensors that
 * require grad t_, transpose_ and unsqueeze_ record a node whose backward undoes the view
 * (t, transpose, squeeze). as_strided_ has no backward here: calling it on a tensor that
 * requires grad with grad mode on is an error naming the op. */
#include "../core/internal.h"
#include "family.h"

/* The out-of-place view ops' meta functions compute the new geometry: same arguments. */
static const ag_opdef *view_def(const char *name) {
    return ag_op_def(ag__op(name));
}

static int t_meta_(const ag_arg *a, ag_tmeta *o) {
    return view_def("t")->meta(a, o);
}
static int transpose_meta_(const ag_arg *a, ag_tmeta *o) {
    return view_def("transpose.int")->meta(a, o);
}
static int unsqueeze_meta_(const ag_arg *a, ag_tmeta *o) {
    return view_def("unsqueeze")->meta(a, o);
}

static int as_strided_meta_(const ag_arg *a, ag_tmeta *o) {
    if (a[0].u.t->requires_grad && ag_is_grad_enabled())
        return ag__err(AG_ENOTSUP, "as_strided_: in-place as_strided of a tensor that requires "
                                   "grad is not supported (use as_strided, or no-grad mode)");
    return view_def("as_strided")->meta(a, o);
}

/* The backward of an in-place view op is the backward of its view op: the gradient arrives
 * with the new geometry and leaves with the old one. */
static int t_backward_(ag_bwctx *c) {
    c->grad_inputs[0] = ag_t(c->grad_outputs[0]);
    return 0;
}

static int transpose_backward_(ag_bwctx *c) {
    c->grad_inputs[0] = ag_transpose(c->grad_outputs[0], (int)c->args[1].u.i, (int)c->args[2].u.i);
    return 0;
}

static int unsqueeze_backward_(ag_bwctx *c) {
    c->grad_inputs[0] = ag_squeeze(c->grad_outputs[0], (int)c->args[1].u.i);
    return 0;
}

/* Gradcheck runs in-place ops on a clone of self, so self is a non-leaf that requires grad. */
static void t_samples_(ag_samples *s) {
    int64_t a[] = {3, 4};
    ag_samples_add(s, "2-d", (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, a, -1, 1))}, 1);
}

static void transpose_samples_(ag_samples *s) {
    int64_t a[] = {2, 3, 4};
    ag_samples_add(s, "dims 0,2",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 3, a, -1, 1)), AG_A_I(0), AG_A_I(-1)}, 3);
}

static void unsqueeze_samples_(ag_samples *s) {
    int64_t a[] = {3, 4};
    ag_samples_add(s, "middle", (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, a, -1, 1)), AG_A_I(1)}, 2);
}

static const ag_opdef op_t_ = {
    .schema = "t_(Tensor(a!) self) -> Tensor(a!)",
    .flags = AG_OP_INPLACE | AG_OP_INPLACE_VIEW,
    .meta = t_meta_,
    .dtypes = AG_DT_ALL,
    .backward = t_backward_,
    .samples = t_samples_,
    .functional = "t",
};

static const ag_opdef op_transpose_ = {
    .schema = "transpose_(Tensor(a!) self, int dim0, int dim1) -> Tensor(a!)",
    .flags = AG_OP_INPLACE | AG_OP_INPLACE_VIEW,
    .meta = transpose_meta_,
    .dtypes = AG_DT_ALL,
    .backward = transpose_backward_,
    .samples = transpose_samples_,
    .functional = "transpose.int",
};

static const ag_opdef op_unsqueeze_ = {
    .schema = "unsqueeze_(Tensor(a!) self, int dim) -> Tensor(a!)",
    .flags = AG_OP_INPLACE | AG_OP_INPLACE_VIEW,
    .meta = unsqueeze_meta_,
    .dtypes = AG_DT_ALL,
    .backward = unsqueeze_backward_,
    .samples = unsqueeze_samples_,
    .functional = "unsqueeze",
};

static const ag_opdef op_as_strided_ = {
    .schema = "as_strided_(Tensor(a!) self, SymInt[] size, SymInt[] stride, "
              "SymInt? storage_offset=None) -> Tensor(a!)",
    .flags = AG_OP_INPLACE | AG_OP_INPLACE_VIEW | AG_OP_NONDIFF,
    .meta = as_strided_meta_,
    .dtypes = AG_DT_ALL,
    .functional = "as_strided",
};

ag_tensor *ag_t_(ag_tensor *a) {
    AG__OP(op, "t_");
    return ag__call1(op, (ag_arg[]){AG_A_T(a)}, 1);
}

ag_tensor *ag_transpose_(ag_tensor *a, int d0, int d1) {
    AG__OP(op, "transpose_");
    return ag__call1(op, (ag_arg[]){AG_A_T(a), AG_A_I(d0), AG_A_I(d1)}, 3);
}

ag_tensor *ag_unsqueeze_(ag_tensor *a, int dim) {
    AG__OP(op, "unsqueeze_");
    return ag__call1(op, (ag_arg[]){AG_A_T(a), AG_A_I(dim)}, 2);
}

ag_tensor *ag_as_strided_(ag_tensor *a, int ndim, const int64_t *sizes, const int64_t *strides,
                          int64_t offset) {
    AG__OP(op, "as_strided_");
    return ag__call1(op,
                     (ag_arg[]){AG_A_T(a), AG_A_INTS(sizes, ndim), AG_A_INTS(strides, ndim),
                                offset < 0 ? AG_A_NONE : AG_A_I(offset)},
                     4);
}

const ag_opdef *const ag__ops_inplace_views[] = {
    &op_t_, &op_transpose_, &op_unsqueeze_, &op_as_strided_, NULL,
};
