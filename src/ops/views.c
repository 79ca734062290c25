/* View ops and copies: view, reshape, permute, transpose, t, expand, slice, select, unsqueeze,
 * squeeze, as_strided, alias (outputs share the input's storage: the meta function computes the
 * view's sizes, strides and storage offset and the dispatcher aliases the storage), plus the
 * copying ops clone, contiguous and _to_copy, and the view backward helpers slice_backward,
 * select_backward and as_strided_scatter. */
#include "../core/kernel_util.h"
#include "family.h"
#include "shard_rules.h"

#include <stdio.h>

static void meta_from(const ag_tensor *t, ag_tmeta *m) {
    ag__tmeta_of(t, m);
}

/* ---- view ---- */

/* Infers a -1 entry and checks the element count. */
static int infer_size(const char *op, const ag_tensor *t, int n, const int64_t *in, int64_t *out) {
    int infer = -1;
    int64_t known = 1;
    if (n > AG_MAX_DIMS)
        return ag__err(AG_EINVAL, "%s: %d dimensions (at most %d)", op, n, AG_MAX_DIMS);
    for (int i = 0; i < n; i++) {
        if (in[i] == -1) {
            if (infer >= 0)
                return ag__err(AG_EINVAL, "%s: only one dimension can be inferred", op);
            infer = i;
        } else if (in[i] < 0) {
            return ag__err(AG_EINVAL, "%s: invalid shape dimension %lld", op, (long long)in[i]);
        } else {
            known = ag__sat_mul(known, in[i]);
        }
        out[i] = in[i];
    }
    int64_t numel = ag_tensor_numel(t);
    if (infer >= 0) {
        if (known == 0 || numel % known)
            goto bad;
        out[infer] = numel / known;
    } else if (known != numel) {
        goto bad;
    }
    return 0;
bad:;
    char a[128], b[128];
    return ag__err(AG_EINVAL, "%s: shape %s is invalid for input of size %lld (shape %s)", op,
                   ag__fmt_sizes(a, sizeof a, n, in), (long long)numel,
                   ag__fmt_sizes(b, sizeof b, t->ndim, t->sizes));
}

/* Strides for viewing t as `sizes` without copying (ATen's computeStride); false when the
 * requested shape splits or merges dims across non-contiguous boundaries. */
static bool view_strides(const ag_tensor *t, int n, const int64_t *sizes, int64_t *strides) {
    int64_t numel = ag_tensor_numel(t);
    if (numel == 0 || t->ndim == 0) {
        int64_t st = 1;
        for (int i = n - 1; i >= 0; i--) {
            strides[i] = st;
            st *= sizes[i] > 1 ? sizes[i] : 1;
        }
        return true;
    }
    int view_d = n - 1;
    int64_t chunk_base_stride = t->strides[t->ndim - 1];
    int64_t tensor_numel = 1, view_numel = 1;
    for (int d = t->ndim - 1; d >= 0; d--) {
        tensor_numel *= t->sizes[d];
        if (d == 0 ||
            (t->sizes[d - 1] != 1 && t->strides[d - 1] != tensor_numel * chunk_base_stride)) {
            while (view_d >= 0 && (view_numel < tensor_numel || sizes[view_d] == 1)) {
                strides[view_d] = view_numel * chunk_base_stride;
                view_numel *= sizes[view_d];
                view_d--;
            }
            if (view_numel != tensor_numel)
                return false;
            if (d > 0) {
                chunk_base_stride = t->strides[d - 1];
                tensor_numel = 1;
                view_numel = 1;
            }
        }
    }
    return view_d == -1;
}

static int view_meta(const ag_arg *a, ag_tmeta *o) {
    const ag_tensor *t = a[0].u.t;
    int64_t sizes[AG_MAX_DIMS];
    int rc = infer_size("view", t, a[1].n, a[1].u.ints, sizes);
    if (rc)
        return rc;
    meta_from(t, o);
    o->ndim = a[1].n;
    memcpy(o->sizes, sizes, sizeof(int64_t) * (size_t)a[1].n);
    if (!view_strides(t, a[1].n, sizes, o->strides)) {
        char x[128], y[128];
        return ag__err(AG_EINVAL,
                       "view: size %s is not compatible with the input's size %s and strides "
                       "(at least one dimension spans across two contiguous subspaces); use "
                       "reshape instead",
                       ag__fmt_sizes(x, sizeof x, o->ndim, sizes),
                       ag__fmt_sizes(y, sizeof y, t->ndim, t->sizes));
    }
    return 0;
}

static void view_samples(ag_samples *s) {
    int64_t a[] = {3, 4}, to[] = {2, -1, 2};
    ag_samples_add(s, "split dims",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, a, -1, 1)), AG_A_INTS(to, 3)}, 2);
}

/* ATen: grad.reshape(self.sizes()). */
static int view_backward_real(ag_bwctx *c) {
    const ag_tmeta *self = &c->input_meta[0];
    c->grad_inputs[0] = ag_reshape(c->grad_outputs[0], self->ndim, self->sizes);
    return 0;
}

static const ag_opdef op_view = {
    .schema = "view(Tensor(a) self, SymInt[] size) -> Tensor(a)",
    .flags = AG_OP_VIEW,
    .meta = view_meta,
    .dtypes = AG_DT_ALL,
    .backward = view_backward_real,
    .samples = view_samples,
    .shard = ag__shard_view,
};

ag_tensor *ag_view(ag_tensor *a, int ndim, const int64_t *sizes) {
    AG__OP(op, "view");
    return ag__call1(op, (ag_arg[]){AG_A_T(a), AG_A_INTS(sizes, ndim)}, 2);
}

/* ---- reshape (composite: a view when strides allow, else clone + view) ---- */

static int reshape_decomp(const ag_arg *a, ag_tensor **outs) {
    ag_tensor *t = a[0].u.t;
    int64_t sizes[AG_MAX_DIMS], strides[AG_MAX_DIMS];
    int rc = infer_size("reshape", t, a[1].n, a[1].u.ints, sizes);
    if (rc)
        return rc;
    /* Asked without setting (and then clearing) an error, so that an error pending from an
     * earlier failed op of the caller's chain survives. */
    if (view_strides(t, a[1].n, sizes, strides)) {
        outs[0] = ag_view(t, a[1].n, a[1].u.ints);
        return outs[0] ? 0 : ag_last_status();
    }
    outs[0] = ag_view(ag_clone(t), a[1].n, a[1].u.ints);
    return outs[0] ? 0 : ag_last_status();
}

static int reshape_meta(const ag_arg *a, ag_tmeta *o) {
    int64_t sizes[AG_MAX_DIMS];
    int rc = infer_size("reshape", a[0].u.t, a[1].n, a[1].u.ints, sizes);
    if (rc)
        return rc;
    ag__tmeta_contiguous(o, a[0].u.t->dtype, a[1].n, sizes);
    return 0;
}

static void reshape_samples(ag_samples *s) {
    int64_t a[] = {3, 4}, to[] = {12};
    ag_samples_add(s, "non-contiguous",
                   (ag_arg[]){AG_A_T(ag_samples_rand_strided(s, 2, a, -1, 1)), AG_A_INTS(to, 1)},
                   2);
}

static const ag_opdef op_reshape = {
    .schema = "reshape(Tensor(a) self, SymInt[] shape) -> Tensor(a)",
    .flags = AG_OP_COMPOSITE,
    .meta = reshape_meta,
    .dtypes = AG_DT_ALL,
    .decomp = reshape_decomp,
    .samples = reshape_samples,
};

ag_tensor *ag_reshape(ag_tensor *a, int ndim, const int64_t *sizes) {
    AG__OP(op, "reshape");
    return ag__call1(op, (ag_arg[]){AG_A_T(a), AG_A_INTS(sizes, ndim)}, 2);
}

/* ---- permute / transpose / t ---- */

static int permute_meta(const ag_arg *a, ag_tmeta *o) {
    const ag_tensor *t = a[0].u.t;
    if (a[1].n != t->ndim)
        return ag__err(AG_EINVAL, "permute: %d dims given for a %d-d tensor", a[1].n, t->ndim);
    bool seen[AG_MAX_DIMS] = {0};
    meta_from(t, o);
    for (int i = 0; i < t->ndim; i++) {
        int d = ag__wrap_dim("permute", a[1].u.ints[i], t->ndim);
        if (d < 0)
            return AG_EINVAL;
        if (seen[d])
            return ag__err(AG_EINVAL, "permute: dim %d repeated", d);
        seen[d] = true;
        o->sizes[i] = t->sizes[d];
        o->strides[i] = t->strides[d];
    }
    return 0;
}

static int permute_backward(ag_bwctx *c) {
    int64_t inv[AG_MAX_DIMS];
    int n = c->args[1].n;
    for (int i = 0; i < n; i++) {
        int64_t d = c->args[1].u.ints[i];
        inv[d < 0 ? d + n : d] = i;
    }
    c->grad_inputs[0] = ag_permute(c->grad_outputs[0], n, inv);
    return 0;
}

static void permute_samples(ag_samples *s) {
    int64_t a[] = {2, 3, 4}, p[] = {2, 0, 1};
    ag_samples_add(s, "3-d", (ag_arg[]){AG_A_T(ag_samples_rand(s, 3, a, -1, 1)), AG_A_INTS(p, 3)},
                   2);
}

static const ag_opdef op_permute = {
    .schema = "permute(Tensor(a) self, int[] dims) -> Tensor(a)",
    .flags = AG_OP_VIEW,
    .meta = permute_meta,
    .dtypes = AG_DT_ALL,
    .backward = permute_backward,
    .samples = permute_samples,
    .shard = ag__shard_permute,
};

ag_tensor *ag_permute(ag_tensor *a, int ndim, const int64_t *dims) {
    AG__OP(op, "permute");
    return ag__call1(op, (ag_arg[]){AG_A_T(a), AG_A_INTS(dims, ndim)}, 2);
}

static int transpose_meta(const ag_arg *a, ag_tmeta *o) {
    const ag_tensor *t = a[0].u.t;
    int d0 = ag__wrap_dim("transpose", a[1].u.i, t->ndim);
    int d1 = d0 < 0 ? -1 : ag__wrap_dim("transpose", a[2].u.i, t->ndim);
    if (d1 < 0)
        return AG_EINVAL;
    meta_from(t, o);
    if (t->ndim == 0)
        return 0;
    o->sizes[d0] = t->sizes[d1];
    o->sizes[d1] = t->sizes[d0];
    o->strides[d0] = t->strides[d1];
    o->strides[d1] = t->strides[d0];
    return 0;
}

static int transpose_backward(ag_bwctx *c) {
    c->grad_inputs[0] = ag_transpose(c->grad_outputs[0], (int)c->args[1].u.i, (int)c->args[2].u.i);
    return 0;
}

static void transpose_samples(ag_samples *s) {
    int64_t a[] = {2, 3, 4};
    ag_samples_add(s, "dims 0,2",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 3, a, -1, 1)), AG_A_I(0), AG_A_I(-1)}, 3);
}

static const ag_opdef op_transpose = {
    .schema = "transpose.int(Tensor(a) self, int dim0, int dim1) -> Tensor(a)",
    .flags = AG_OP_VIEW,
    .meta = transpose_meta,
    .dtypes = AG_DT_ALL,
    .backward = transpose_backward,
    .samples = transpose_samples,
    .shard = ag__shard_transpose,
};

ag_tensor *ag_transpose(ag_tensor *a, int d0, int d1) {
    AG__OP(op, "transpose.int");
    return ag__call1(op, (ag_arg[]){AG_A_T(a), AG_A_I(d0), AG_A_I(d1)}, 3);
}

static int t_meta(const ag_arg *a, ag_tmeta *o) {
    const ag_tensor *t = a[0].u.t;
    if (t->ndim > 2)
        return ag__err(AG_EINVAL, "t: expects a tensor with <= 2 dimensions, but self is %d-d",
                       t->ndim);
    meta_from(t, o);
    if (t->ndim == 2) {
        o->sizes[0] = t->sizes[1];
        o->sizes[1] = t->sizes[0];
        o->strides[0] = t->strides[1];
        o->strides[1] = t->strides[0];
    }
    return 0;
}

static int t_backward(ag_bwctx *c) {
    c->grad_inputs[0] = ag_t(c->grad_outputs[0]);
    return 0;
}

static void t_samples(ag_samples *s) {
    int64_t a[] = {3, 4};
    ag_samples_add(s, "2-d", (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, a, -1, 1))}, 1);
}

/* Core decomposition: t is transpose(0, 1) (a no-op transpose(0, 0) below 2-d). */
static int t_decomp(const ag_arg *a, ag_tensor **o) {
    o[0] = ag_transpose(a[0].u.t, 0, a[0].u.t->ndim < 2 ? 0 : 1);
    return o[0] ? 0 : ag_last_status();
}

static const ag_opdef op_t = {
    .schema = "t(Tensor(a) self) -> Tensor(a)",
    .flags = AG_OP_VIEW,
    .decomp = t_decomp,
    .meta = t_meta,
    .dtypes = AG_DT_ALL,
    .backward = t_backward,
    .samples = t_samples,
    .shard = ag__shard_transpose,
};

ag_tensor *ag_t(ag_tensor *a) {
    AG__OP(op, "t");
    return ag__call1(op, (ag_arg[]){AG_A_T(a)}, 1);
}

/* ---- expand ---- */

static int expand_meta(const ag_arg *a, ag_tmeta *o) {
    const ag_tensor *t = a[0].u.t;
    int n = a[1].n;
    const int64_t *sz = a[1].u.ints;
    char x[128], y[128];
    if (n < t->ndim || n > AG_MAX_DIMS)
        return ag__err(AG_EINVAL,
                       "expand: the number of sizes provided (%d) must be greater or "
                       "equal to the number of dimensions in the tensor (%d)",
                       n, t->ndim);
    o->dtype = t->dtype;
    o->ndim = n;
    o->offset = t->offset;
    for (int i = n - 1; i >= 0; i--) {
        int ti = i - (n - t->ndim);
        int64_t want = sz[i];
        if (ti < 0) {
            if (want < 0)
                return ag__err(AG_EINVAL,
                               "expand: -1 not allowed in leading, non-existing dimension %d", i);
            o->sizes[i] = want;
            o->strides[i] = 0;
            continue;
        }
        if (want == -1)
            want = t->sizes[ti];
        if (want < 0)
            return ag__err(AG_EINVAL,
                           "expand: Trying to create tensor with negative dimension "
                           "%lld: %s",
                           (long long)want, ag__fmt_sizes(x, sizeof x, n, sz));
        if (t->sizes[ti] == want) {
            o->sizes[i] = want;
            o->strides[i] = t->strides[ti];
        } else if (t->sizes[ti] == 1) {
            o->sizes[i] = want;
            o->strides[i] = 0;
        } else {
            return ag__err(AG_EINVAL,
                           "expand: the expanded size of the tensor (%lld) must match "
                           "the existing size (%lld) at non-singleton dimension %d; "
                           "target sizes %s, tensor sizes %s",
                           (long long)want, (long long)t->sizes[ti], i,
                           ag__fmt_sizes(x, sizeof x, n, sz),
                           ag__fmt_sizes(y, sizeof y, t->ndim, t->sizes));
        }
    }
    return 0;
}

static int expand_backward(ag_bwctx *c) {
    /* ATen: sum_to(grad, self.sizes()); the engine performs exactly that reduction. */
    c->grad_inputs[0] = c->grad_outputs[0];
    return 0;
}

static void expand_samples(ag_samples *s) {
    int64_t a[] = {3, 1}, to[] = {2, 3, 4};
    ag_samples_add(s, "broadcast",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, a, -1, 1)), AG_A_INTS(to, 3)}, 2);
}

static const ag_opdef op_expand = {
    .schema = "expand(Tensor(a) self, SymInt[] size, *, bool implicit=False) -> Tensor(a)",
    .flags = AG_OP_VIEW,
    .meta = expand_meta,
    .dtypes = AG_DT_ALL,
    .backward = expand_backward,
    .samples = expand_samples,
    .shard = ag__shard_expand,
};

ag_tensor *ag_expand(ag_tensor *a, int ndim, const int64_t *sizes) {
    AG__OP(op, "expand");
    return ag__call1(op, (ag_arg[]){AG_A_T(a), AG_A_INTS(sizes, ndim)}, 2);
}

/* ---- slice / select and their backward helpers ---- */

/* Clamps start/end into [0, size] as Python slicing does. */
static void slice_bounds(int64_t size, int64_t *start, int64_t *end) {
    if (*start < 0)
        *start = ag__sat_add(*start, size);
    if (*end < 0)
        *end = ag__sat_add(*end, size);
    if (*start < 0)
        *start = 0;
    if (*start > size)
        *start = size;
    if (*end < *start)
        *end = *start;
    if (*end > size)
        *end = size;
}

/* The view t[dim, start:end:step] of the geometry t (a = dim, start, end, step; start and end
 * may be None). Shared by slice and slice_backward, whose messages name `op`. */
static int slice_geom(const char *op, const ag_tmeta *t, const ag_arg *a, ag_tmeta *o) {
    int d = ag__wrap_dim(op, a[0].u.i, t->ndim);
    if (d < 0)
        return AG_EINVAL;
    if (t->ndim == 0)
        return ag__err(AG_EINVAL, "%s: cannot slice a 0-d tensor", op);
    int64_t step = a[3].u.i;
    if (step <= 0)
        return ag__err(AG_EINVAL, "%s: slice step must be positive, got %lld", op, (long long)step);
    int64_t start = a[1].kind == AG_ARG_NONE ? 0 : a[1].u.i;
    int64_t end = a[2].kind == AG_ARG_NONE ? INT64_MAX : a[2].u.i;
    slice_bounds(t->sizes[d], &start, &end);
    *o = *t;
    /* end - start <= size here; step may be huge: count without overflowing. */
    int64_t span = end - start;
    o->offset = ag__sat_add(t->offset, ag__sat_mul(start, t->strides[d]));
    o->sizes[d] = span / step + (span % step != 0);
    o->strides[d] = o->sizes[d] > 1 ? ag__sat_mul(t->strides[d], step) : t->strides[d];
    if (o->strides[d] == INT64_MAX || o->strides[d] == INT64_MIN || o->offset == INT64_MAX)
        return ag__err(AG_EINVAL, "%s: step %lld overflows the view's strides", op,
                       (long long)step);
    return 0;
}

static int slice_meta(const ag_arg *a, ag_tmeta *o) {
    ag_tmeta t;
    meta_from(a[0].u.t, &t);
    return slice_geom("slice", &t, &a[1], o);
}

static int slice_backward_rule(ag_bwctx *c) {
    const ag_tmeta *self = &c->input_meta[0];
    int64_t start = c->args[2].kind == AG_ARG_NONE ? 0 : c->args[2].u.i;
    int64_t end = c->args[3].kind == AG_ARG_NONE ? INT64_MAX : c->args[3].u.i;
    c->grad_inputs[0] = ag_slice_backward(c->grad_outputs[0], self->ndim, self->sizes,
                                          (int)c->args[1].u.i, start, end, c->args[4].u.i);
    return 0;
}

static void slice_samples(ag_samples *s) {
    int64_t a[] = {5, 4};
    ag_samples_add(s, "step 2",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, a, -1, 1)), AG_A_I(0), AG_A_I(1),
                              AG_A_I(5), AG_A_I(2)},
                   5);
    ag_samples_add(s, "negative end",
                   (ag_arg[]){AG_A_T(ag_samples_rand_strided(s, 2, a, -1, 1)), AG_A_I(1), AG_A_I(0),
                              AG_A_I(-1), AG_A_I(1)},
                   5);
}

static const ag_opdef op_slice = {
    .schema = "slice.Tensor(Tensor(a) self, int dim=0, SymInt? start=None, SymInt? end=None, "
              "SymInt step=1) -> Tensor(a)",
    .flags = AG_OP_VIEW,
    .meta = slice_meta,
    .dtypes = AG_DT_ALL,
    .backward = slice_backward_rule,
    .samples = slice_samples,
    .shard = ag__shard_slice,
};

ag_tensor *ag_slice(ag_tensor *a, int dim, int64_t start, int64_t end, int64_t step) {
    AG__OP(op, "slice.Tensor");
    return ag__call1(
        op, (ag_arg[]){AG_A_T(a), AG_A_I(dim), AG_A_I(start), AG_A_I(end), AG_A_I(step)}, 5);
}

/* The result is zeros(input_sizes) with grad_output written into one view of it, so
 * grad_output must have exactly that view's shape: the kernel copies it element by element. */
static int bw_check_grad(const char *op, const ag_tensor *g, const ag_tmeta *view) {
    if (g->ndim == view->ndim && !memcmp(g->sizes, view->sizes, sizeof(int64_t) * (size_t)g->ndim))
        return 0;
    char x[128], y[128];
    return ag__err(AG_EINVAL,
                   "%s: grad_output of shape %s does not match the shape %s of the "
                   "view of input_sizes it is the gradient of",
                   op, ag__fmt_sizes(x, sizeof x, g->ndim, g->sizes),
                   ag__fmt_sizes(y, sizeof y, view->ndim, view->sizes));
}

/* input_sizes as a contiguous geometry (sizes >= 0, at most AG__MAX_NUMEL elements). */
static int bw_input_sizes(const char *op, const ag_tensor *g, const ag_arg *in, ag_tmeta *o) {
    char x[128];
    if (in->n < 1 || in->n > AG_MAX_DIMS)
        return ag__err(AG_EINVAL, "%s: input_sizes %s must have 1 to %d dimensions", op,
                       ag__fmt_sizes(x, sizeof x, in->n > 0 ? in->n : 0, in->u.ints), AG_MAX_DIMS);
    ag__tmeta_contiguous(o, g->dtype, in->n, in->u.ints);
    return ag__check_out_metas(op, o, 1);
}

static int slice_bw_meta(const ag_arg *a, ag_tmeta *o) {
    const char *op = "slice_backward";
    ag_tmeta view;
    int rc = bw_input_sizes(op, a[0].u.t, &a[1], o);
    if (!rc)
        rc = slice_geom(op, o, &a[2], &view);
    if (!rc)
        rc = bw_check_grad(op, a[0].u.t, &view);
    return rc;
}

/* grad_input = zeros(input_sizes); grad_input[dim, start:end:step] = grad */
static int slice_bw_kernel(const ag_arg *a, ag_tensor **o) {
    ag_tensor *out = o[0];
    memset(out->storage->data, 0, out->storage->nbytes);
    ag_tmeta t, m;
    meta_from(out, &t);
    int rc = slice_geom("slice_backward", &t, &a[2], &m);
    if (rc)
        return rc;
    ag_tensor dst; /* a view on the stack: nothing allocated per call */
    return ag__copy_into(ag__tensor_view_tmp(&dst, out, &m), a[0].u.t);
}

static int slice_bw_backward(ag_bwctx *c) {
    c->grad_inputs[0] = ag_slice(c->grad_outputs[0], (int)c->args[2].u.i, c->args[3].u.i,
                                 c->args[4].u.i, c->args[5].u.i);
    return 0;
}

static void slice_bw_samples(ag_samples *s) {
    int64_t g[] = {2, 4}, in[] = {5, 4};
    ag_samples_add(s, "step 2",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, g, -1, 1)), AG_A_INTS(in, 2), AG_A_I(0),
                              AG_A_I(1), AG_A_I(5), AG_A_I(2)},
                   6);
}

static const ag_opdef op_slice_backward = {
    .schema = "slice_backward(Tensor grad_output, SymInt[] input_sizes, int dim, SymInt start, "
              "SymInt end, SymInt step) -> Tensor",
    .flags = AG_OP_BACKWARD_HELPER,
    .meta = slice_bw_meta,
    .kernel = slice_bw_kernel,
    .dtypes = AG_DT_ALL,
    .backward = slice_bw_backward,
    .samples = slice_bw_samples,
};

ag_tensor *ag_slice_backward(ag_tensor *grad, int ndim, const int64_t *input_sizes, int dim,
                             int64_t start, int64_t end, int64_t step) {
    AG__OP(op, "slice_backward");
    return ag__call1(op,
                     (ag_arg[]){AG_A_T(grad), AG_A_INTS(input_sizes, ndim), AG_A_I(dim),
                                AG_A_I(start), AG_A_I(end), AG_A_I(step)},
                     6);
}

/* The view t.select(dim, index) of the geometry t (a = dim, index); shared by select and
 * select_backward, whose messages name `op`. */
static int select_geom(const char *op, const ag_tmeta *t, const ag_arg *a, ag_tmeta *o) {
    if (t->ndim == 0)
        return ag__err(AG_EINVAL, "%s: select() cannot be applied to a 0-dim tensor.", op);
    int d = ag__wrap_dim(op, a[0].u.i, t->ndim);
    if (d < 0)
        return AG_EINVAL;
    int64_t idx = a[1].u.i, size = t->sizes[d];
    if (idx < -size || idx >= size)
        return ag__err(AG_EINVAL,
                       "%s: index %lld out of range for tensor of size %lld at "
                       "dimension %d",
                       op, (long long)idx, (long long)size, d);
    if (idx < 0)
        idx += size;
    o->dtype = t->dtype;
    o->ndim = t->ndim - 1;
    o->offset = ag__sat_add(t->offset, ag__sat_mul(idx, t->strides[d]));
    for (int i = 0, k = 0; i < t->ndim; i++)
        if (i != d) {
            o->sizes[k] = t->sizes[i];
            o->strides[k++] = t->strides[i];
        }
    return 0;
}

static int select_meta(const ag_arg *a, ag_tmeta *o) {
    ag_tmeta t;
    meta_from(a[0].u.t, &t);
    return select_geom("select", &t, &a[1], o);
}

static int select_backward_rule(ag_bwctx *c) {
    const ag_tmeta *self = &c->input_meta[0];
    c->grad_inputs[0] = ag_select_backward(c->grad_outputs[0], self->ndim, self->sizes,
                                           (int)c->args[1].u.i, c->args[2].u.i);
    return 0;
}

static void select_samples(ag_samples *s) {
    int64_t a[] = {3, 4};
    ag_samples_add(s, "dim 1",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, a, -1, 1)), AG_A_I(1), AG_A_I(-2)}, 3);
}

static const ag_opdef op_select = {
    .schema = "select.int(Tensor(a) self, int dim, SymInt index) -> Tensor(a)",
    .flags = AG_OP_VIEW,
    .meta = select_meta,
    .dtypes = AG_DT_ALL,
    .backward = select_backward_rule,
    .samples = select_samples,
    .shard = ag__shard_slice,
};

ag_tensor *ag_select(ag_tensor *a, int dim, int64_t index) {
    AG__OP(op, "select.int");
    return ag__call1(op, (ag_arg[]){AG_A_T(a), AG_A_I(dim), AG_A_I(index)}, 3);
}

static int select_bw_meta(const ag_arg *a, ag_tmeta *o) {
    const char *op = "select_backward";
    ag_tmeta view;
    int rc = bw_input_sizes(op, a[0].u.t, &a[1], o);
    if (!rc)
        rc = select_geom(op, o, &a[2], &view);
    if (!rc)
        rc = bw_check_grad(op, a[0].u.t, &view);
    return rc;
}

static int select_bw_kernel(const ag_arg *a, ag_tensor **o) {
    ag_tensor *out = o[0];
    memset(out->storage->data, 0, out->storage->nbytes);
    ag_tmeta t, m;
    meta_from(out, &t);
    int rc = select_geom("select_backward", &t, &a[2], &m);
    if (rc)
        return rc;
    ag_tensor dst; /* a view on the stack: nothing allocated per call */
    return ag__copy_into(ag__tensor_view_tmp(&dst, out, &m), a[0].u.t);
}

static int select_bw_backward(ag_bwctx *c) {
    c->grad_inputs[0] = ag_select(c->grad_outputs[0], (int)c->args[2].u.i, c->args[3].u.i);
    return 0;
}

static void select_bw_samples(ag_samples *s) {
    int64_t g[] = {4}, in[] = {3, 4};
    ag_samples_add(
        s, "dim 0",
        (ag_arg[]){AG_A_T(ag_samples_rand(s, 1, g, -1, 1)), AG_A_INTS(in, 2), AG_A_I(0), AG_A_I(1)},
        4);
}

static const ag_opdef op_select_backward = {
    .schema = "select_backward(Tensor grad_output, SymInt[] input_sizes, int dim, SymInt index) -> "
              "Tensor",
    .flags = AG_OP_BACKWARD_HELPER,
    .meta = select_bw_meta,
    .kernel = select_bw_kernel,
    .dtypes = AG_DT_ALL,
    .backward = select_bw_backward,
    .samples = select_bw_samples,
};

ag_tensor *ag_select_backward(ag_tensor *grad, int ndim, const int64_t *input_sizes, int dim,
                              int64_t index) {
    AG__OP(op, "select_backward");
    return ag__call1(
        op, (ag_arg[]){AG_A_T(grad), AG_A_INTS(input_sizes, ndim), AG_A_I(dim), AG_A_I(index)}, 4);
}

/* ---- unsqueeze / squeeze ---- */

static int unsqueeze_meta(const ag_arg *a, ag_tmeta *o) {
    const ag_tensor *t = a[0].u.t;
    if (t->ndim >= AG_MAX_DIMS)
        return ag__err(AG_EINVAL, "unsqueeze: a %d-d tensor cannot grow", t->ndim);
    int d = ag__wrap_dim("unsqueeze", a[1].u.i, t->ndim + 1);
    if (d < 0)
        return AG_EINVAL;
    o->dtype = t->dtype;
    o->ndim = t->ndim + 1;
    o->offset = t->offset;
    for (int i = 0, k = 0; i < o->ndim; i++) {
        if (i == d) {
            o->sizes[i] = 1;
            o->strides[i] = d < t->ndim ? ag__sat_mul(t->sizes[d], t->strides[d]) : 1;
        } else {
            o->sizes[i] = t->sizes[k];
            o->strides[i] = t->strides[k++];
        }
    }
    return 0;
}

static int unsqueeze_backward(ag_bwctx *c) {
    c->grad_inputs[0] = ag_squeeze(c->grad_outputs[0], (int)c->args[1].u.i);
    return 0;
}

static void unsqueeze_samples(ag_samples *s) {
    int64_t a[] = {3, 4};
    ag_samples_add(s, "middle", (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, a, -1, 1)), AG_A_I(1)}, 2);
}

static const ag_opdef op_unsqueeze = {
    .schema = "unsqueeze(Tensor(a) self, int dim) -> Tensor(a)",
    .flags = AG_OP_VIEW,
    .meta = unsqueeze_meta,
    .dtypes = AG_DT_ALL,
    .backward = unsqueeze_backward,
    .samples = unsqueeze_samples,
    .shard = ag__shard_unsqueeze,
};

ag_tensor *ag_unsqueeze(ag_tensor *a, int dim) {
    AG__OP(op, "unsqueeze");
    return ag__call1(op, (ag_arg[]){AG_A_T(a), AG_A_I(dim)}, 2);
}

static int squeeze_dim_meta(const ag_arg *a, ag_tmeta *o) {
    const ag_tensor *t = a[0].u.t;
    meta_from(t, o);
    if (t->ndim == 0)
        return 0;
    int d = ag__wrap_dim("squeeze", a[1].u.i, t->ndim);
    if (d < 0)
        return AG_EINVAL;
    if (t->sizes[d] != 1)
        return 0;
    o->ndim = t->ndim - 1;
    for (int i = 0, k = 0; i < t->ndim; i++)
        if (i != d) {
            o->sizes[k] = t->sizes[i];
            o->strides[k++] = t->strides[i];
        }
    return 0;
}

static int squeeze_dim_backward(ag_bwctx *c) {
    const ag_tmeta *self = &c->input_meta[0];
    c->grad_inputs[0] = ag_reshape(c->grad_outputs[0], self->ndim, self->sizes);
    return 0;
}

static void squeeze_samples(ag_samples *s) {
    int64_t a[] = {3, 1, 4};
    ag_samples_add(s, "size-1 dim", (ag_arg[]){AG_A_T(ag_samples_rand(s, 3, a, -1, 1)), AG_A_I(1)},
                   2);
}

static const ag_opdef op_squeeze_dim = {
    .schema = "squeeze.dim(Tensor(a) self, int dim) -> Tensor(a)",
    .flags = AG_OP_VIEW,
    .meta = squeeze_dim_meta,
    .dtypes = AG_DT_ALL,
    .backward = squeeze_dim_backward,
    .samples = squeeze_samples,
    .shard = ag__shard_squeeze,
};

ag_tensor *ag_squeeze(ag_tensor *a, int dim) {
    AG__OP(op, "squeeze.dim");
    return ag__call1(op, (ag_arg[]){AG_A_T(a), AG_A_I(dim)}, 2);
}

static int squeeze_meta(const ag_arg *a, ag_tmeta *o) {
    const ag_tensor *t = a[0].u.t;
    meta_from(t, o);
    int k = 0;
    for (int i = 0; i < t->ndim; i++)
        if (t->sizes[i] != 1) {
            o->sizes[k] = t->sizes[i];
            o->strides[k++] = t->strides[i];
        }
    o->ndim = k;
    return 0;
}

static void squeeze_all_samples(ag_samples *s) {
    int64_t a[] = {1, 3, 1, 2};
    ag_samples_add(s, "all", (ag_arg[]){AG_A_T(ag_samples_rand(s, 4, a, -1, 1))}, 1);
}

static const ag_opdef op_squeeze = {
    .schema = "squeeze(Tensor(a) self) -> Tensor(a)",
    .flags = AG_OP_VIEW,
    .meta = squeeze_meta,
    .dtypes = AG_DT_ALL,
    .backward = squeeze_dim_backward,
    .samples = squeeze_all_samples,
    .shard = ag__shard_squeeze,
};

ag_tensor *ag_squeeze_all(ag_tensor *a) {
    AG__OP(op, "squeeze");
    return ag__call1(op, (ag_arg[]){AG_A_T(a)}, 1);
}

/* ---- as_strided / as_strided_scatter / alias ---- */

/* The view (a = size, stride, storage_offset or None for def_off) of a storage of `elems`
 * elements. Its extent, storage_offset + sum (size - 1) * stride over the non-empty dims, is
 * computed without overflow and must stay below AG__MAX_NUMEL even for an empty view (so
 * later offset arithmetic on it, such as select's, cannot overflow); a non-empty view must fit
 * in the storage. */
static int as_strided_geom(const char *op, ag_dtype dt, int64_t elems, int64_t def_off,
                           const ag_arg *a, ag_tmeta *o) {
    char x[128], y[128];
    if (a[0].n != a[1].n || a[0].n > AG_MAX_DIMS)
        return ag__err(AG_EINVAL,
                       "%s: mismatch in length of strides and shape (%d sizes, %d "
                       "strides; at most %d dims)",
                       op, a[0].n, a[1].n, AG_MAX_DIMS);
    const int n = a[0].n;
    const int64_t *sz = a[0].u.ints, *st = a[1].u.ints;
    int64_t off = a[2].kind == AG_ARG_NONE ? def_off : a[2].u.i;
    if (off < 0)
        return ag__err(AG_EINVAL, "%s: Tensor: invalid storage offset %lld", op, (long long)off);
    int64_t ext = off;
    bool empty = false;
    for (int i = 0; i < n; i++) {
        if (sz[i] < 0)
            return ag__err(AG_EINVAL,
                           "%s: Trying to create tensor with negative dimension %lld: "
                           "%s",
                           op, (long long)sz[i], ag__fmt_sizes(x, sizeof x, n, sz));
        if (st[i] < 0)
            return ag__err(AG_EINVAL,
                           "%s: Negative strides are not supported at the moment, got "
                           "strides: %s",
                           op, ag__fmt_sizes(x, sizeof x, n, st));
        if (sz[i] == 0)
            empty = true;
        else
            ext = ag__sat_add(ext, ag__sat_mul(sz[i] - 1, st[i]));
    }
    if (ext >= AG__MAX_NUMEL || (!empty && ext >= elems))
        return ag__err(AG_EINVAL,
                       "%s: sizes %s, strides %s and storage offset %lld reach "
                       "element %lld, out of bounds for a storage of %lld elements",
                       op, ag__fmt_sizes(x, sizeof x, n, sz), ag__fmt_sizes(y, sizeof y, n, st),
                       (long long)off, (long long)ext, (long long)elems);
    o->dtype = dt;
    o->ndim = n;
    o->offset = off;
    memcpy(o->sizes, sz, sizeof(int64_t) * (size_t)n);
    memcpy(o->strides, st, sizeof(int64_t) * (size_t)n);
    return 0;
}

static int as_strided_meta(const ag_arg *a, ag_tmeta *o) {
    const ag_tensor *t = a[0].u.t;
    int64_t elems = (int64_t)(t->storage->nbytes / ag_dtype_size(t->dtype));
    return as_strided_geom("as_strided", t->dtype, elems, t->offset, &a[1], o);
}

static int as_strided_backward(ag_bwctx *c) {
    const ag_tmeta *self = &c->input_meta[0];
    /* The view's geometry is relative to the storage; express it relative to a contiguous
     * gradient of self's shape (valid when self is contiguous, the common case). */
    if (!ag__tmeta_is_contiguous(self))
        return ag__err(AG_ENOTSUP, "as_strided: backward through an as_strided view of a "
                                   "non-contiguous tensor is not supported");
    int64_t off = (c->args[3].kind == AG_ARG_NONE ? self->offset : c->args[3].u.i) - self->offset;
    ag_tensor *z = ag_zeros(self->dtype, self->ndim, self->sizes);
    c->grad_inputs[0] = ag__call1(
        ag__op("as_strided_scatter"),
        (ag_arg[]){AG_A_T(z), AG_A_T(c->grad_outputs[0]), c->args[1], c->args[2], AG_A_I(off)}, 5);
    return 0;
}

static void as_strided_samples(ag_samples *s) {
    int64_t a[] = {3, 4}, sz[] = {2, 2}, st[] = {4, 1};
    ag_samples_add(s, "window",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, a, -1, 1)), AG_A_INTS(sz, 2),
                              AG_A_INTS(st, 2), AG_A_I(1)},
                   4);
}

static const ag_opdef op_as_strided = {
    .schema = "as_strided(Tensor(a) self, SymInt[] size, SymInt[] stride, SymInt? "
              "storage_offset=None) -> Tensor(a)",
    .flags = AG_OP_VIEW,
    .meta = as_strided_meta,
    .dtypes = AG_DT_ALL,
    .backward = as_strided_backward,
    .samples = as_strided_samples,
};

ag_tensor *ag_as_strided(ag_tensor *a, int ndim, const int64_t *sizes, const int64_t *strides,
                         int64_t offset) {
    AG__OP(op, "as_strided");
    return ag__call1(op,
                     (ag_arg[]){AG_A_T(a), AG_A_INTS(sizes, ndim), AG_A_INTS(strides, ndim),
                                offset < 0 ? AG_A_NONE : AG_A_I(offset)},
                     4);
}

/* The result is a contiguous copy of self, so the view (relative to it, default offset 0) must
 * fit in self's elements, and src must have the view's shape. */
static int ass_meta(const ag_arg *a, ag_tmeta *o) {
    const ag_tensor *t = a[0].u.t;
    ag__tmeta_contiguous(o, t->dtype, t->ndim, t->sizes);
    const ag_tensor *src = a[1].u.t;
    ag_tmeta view;
    int rc = as_strided_geom("as_strided_scatter", t->dtype, ag_tensor_numel(t), 0, &a[2], &view);
    if (rc)
        return rc;
    bool ok = a[2].n == src->ndim;
    for (int i = 0; ok && i < src->ndim; i++)
        ok = src->sizes[i] == a[2].u.ints[i];
    if (!ok) {
        char x[128], y[128];
        return ag__err(AG_EINVAL,
                       "as_strided_scatter: src of shape %s does not match the view "
                       "size %s",
                       ag__fmt_sizes(x, sizeof x, src->ndim, src->sizes),
                       ag__fmt_sizes(y, sizeof y, a[2].n, a[2].u.ints));
    }
    return 0;
}

/* out = copy of self, then out.as_strided(size, stride, offset) = src */
static int ass_kernel(const ag_arg *a, ag_tensor **o) {
    ag_tensor *out = o[0];
    int rc = ag__copy_into(out, a[0].u.t);
    if (rc)
        return rc;
    ag_tmeta m;
    if ((rc =
             as_strided_geom("as_strided_scatter", out->dtype, ag_tensor_numel(out), 0, &a[2], &m)))
        return rc;
    ag_tensor dst; /* a view on the stack: nothing allocated per call */
    return ag__copy_into(ag__tensor_view_tmp(&dst, out, &m), a[1].u.t);
}

static int ass_backward(ag_bwctx *c) {
    if (c->needs_grad[1])
        c->grad_inputs[1] =
            ag_as_strided(c->grad_outputs[0], c->args[2].n, c->args[2].u.ints, c->args[3].u.ints,
                          c->args[4].kind == AG_ARG_NONE ? 0 : c->args[4].u.i);
    if (c->needs_grad[0]) {
        ag_tensor *z = ag_zeros_like(c->grad_outputs[0]);
        ag_tensor *zs = ag_as_strided(z, c->args[2].n, c->args[2].u.ints, c->args[3].u.ints,
                                      c->args[4].kind == AG_ARG_NONE ? 0 : c->args[4].u.i);
        c->grad_inputs[0] = ag__call1(ag__op("as_strided_scatter"),
                                      (ag_arg[]){AG_A_T(c->grad_outputs[0]), AG_A_T(ag_clone(zs)),
                                                 c->args[2], c->args[3], c->args[4]},
                                      5);
    }
    return 0;
}

static void ass_samples(ag_samples *s) {
    int64_t a[] = {3, 4}, sz[] = {2, 2}, st[] = {4, 1};
    ag_samples_add(s, "window",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, a, -1, 1)),
                              AG_A_T(ag_samples_rand(s, 2, sz, -1, 1)), AG_A_INTS(sz, 2),
                              AG_A_INTS(st, 2), AG_A_I(1)},
                   5);
}

static const ag_opdef op_as_strided_scatter = {
    .schema = "as_strided_scatter(Tensor self, Tensor src, SymInt[] size, SymInt[] stride, "
              "SymInt? storage_offset=None) -> Tensor",
    .flags = AG_OP_BACKWARD_HELPER,
    .meta = ass_meta,
    .kernel = ass_kernel,
    .dtypes = AG_DT_ALL,
    .backward = ass_backward,
    .samples = ass_samples,
};

static int alias_meta(const ag_arg *a, ag_tmeta *o) {
    meta_from(a[0].u.t, o);
    return 0;
}

static int identity_backward(ag_bwctx *c) {
    c->grad_inputs[0] = c->grad_outputs[0];
    return 0;
}

static void unary_samples(ag_samples *s) {
    int64_t a[] = {3, 4};
    ag_samples_add(s, "2-d", (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, a, -1, 1))}, 1);
    ag_samples_add(s, "strided", (ag_arg[]){AG_A_T(ag_samples_rand_strided(s, 2, a, -1, 1))}, 1);
}

static const ag_opdef op_alias = {
    .schema = "alias(Tensor(a) self) -> Tensor(a)",
    .flags = AG_OP_VIEW,
    .meta = alias_meta,
    .dtypes = AG_DT_ALL,
    .backward = identity_backward,
    .samples = unary_samples,
    .shard = ag__shard_identity,
};

ag_tensor *ag_alias(ag_tensor *a) {
    AG__OP(op, "alias");
    return ag__call1(op, (ag_arg[]){AG_A_T(a)}, 1);
}

/* ---- copies: clone, contiguous, _to_copy ---- */

static int clone_meta(const ag_arg *a, ag_tmeta *o) {
    ag__tmeta_contiguous(o, a[0].u.t->dtype, a[0].u.t->ndim, a[0].u.t->sizes);
    return 0;
}

/* clone and _to_copy: a float -> integral conversion refuses NaN, inf and out-of-range
 * values (C leaves their cast undefined). */
static int copy_kernel(const ag_arg *a, ag_tensor **o) {
    return ag__copy_convert("_to_copy", o[0], a[0].u.t);
}

static const ag_opdef op_clone = {
    .schema = "clone(Tensor self) -> Tensor",
    .flags = 0,
    .meta = clone_meta,
    .kernel = copy_kernel,
    .dtypes = AG_DT_ALL | (1u << AG_I8), /* int8: copies and conversions */
    .backward = identity_backward,
    .samples = unary_samples,
    .shard = ag__shard_identity,
};

ag_tensor *ag_clone(ag_tensor *a) {
    AG__OP(op, "clone");
    return ag__call1(op, (ag_arg[]){AG_A_T(a)}, 1);
}

static int contiguous_decomp(const ag_arg *a, ag_tensor **outs) {
    ag_tensor *t = a[0].u.t;
    outs[0] = ag_tensor_is_contiguous(t) ? t : ag_clone(t);
    return outs[0] ? 0 : ag_last_status();
}

static const ag_opdef op_contiguous = {
    .schema = "contiguous(Tensor(a) self) -> Tensor(a)",
    .flags = AG_OP_COMPOSITE,
    .meta = clone_meta,
    .dtypes = AG_DT_ALL,
    .decomp = contiguous_decomp,
    .samples = unary_samples,
    .shard = ag__shard_identity,
};

ag_tensor *ag_contiguous(ag_tensor *a) {
    AG__OP(op, "contiguous");
    return ag__call1(op, (ag_arg[]){AG_A_T(a)}, 1);
}

static int to_copy_meta(const ag_arg *a, ag_tmeta *o) {
    const ag_tensor *t = a[0].u.t;
    ag__tmeta_contiguous(o, a[1].kind == AG_ARG_NONE ? t->dtype : a[1].u.dt, t->ndim, t->sizes);
    return 0;
}

static int to_copy_backward(ag_bwctx *c) {
    c->grad_inputs[0] = ag_to_dtype(c->grad_outputs[0], c->input_meta[0].dtype);
    return 0;
}

static void to_copy_samples(ag_samples *s) {
    int64_t a[] = {3, 4};
    ag_samples_add(s, "f64->f64",
                   (ag_arg[]){AG_A_T(ag_samples_rand_strided(s, 2, a, -1, 1)), AG_A_DT(AG_F64)}, 2);
}

static const ag_opdef op_to_copy = {
    .schema = "_to_copy(Tensor self, *, ScalarType? dtype=None) -> Tensor",
    .flags = 0,
    .meta = to_copy_meta,
    .kernel = copy_kernel,
    .dtypes = AG_DT_ALL | (1u << AG_I8), /* int8: copies and conversions */
    .backward = to_copy_backward,
    .samples = to_copy_samples,
    .shard = ag__shard_identity,
};

ag_tensor *ag_to_dtype(ag_tensor *a, ag_dtype dt) {
    AG__OP(op, "_to_copy");
    return ag__call1(op, (ag_arg[]){AG_A_T(a), AG_A_DT(dt)}, 2);
}

const ag_opdef *const ag__ops_views[] = {
    &op_view,      &op_reshape,     &op_permute,        &op_transpose,  &op_t,
    &op_expand,    &op_slice,       &op_slice_backward, &op_select,     &op_select_backward,
    &op_unsqueeze, &op_squeeze_dim, &op_squeeze,        &op_as_strided, &op_as_strided_scatter,
    &op_alias,     &op_clone,       &op_contiguous,     &op_to_copy,    NULL,
};
