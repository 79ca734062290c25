/* Joining and indexing ops: cat, stack, split.Tensor, index_select/index_add, gather/
 * scatter_add, advanced indexing (index.Tensor, index_put, index_put_) and the new_empty/
 * new_zeros factories that their backward rules use.
 *
 * Index tensors are int64 (index.Tensor and index_put also take bool masks). A negative index
 * counts from the end, once, as in PyTorch; an index outside [-size, size) makes the KERNEL fail
 * with "<op>: index 7 is out of bounds for dimension 0 with size 3". Range checks cannot live in
 * meta functions, which see no data: under tracing no kernel runs and nothing is checked.
 *
 * Backward rules mirror derivatives.yaml, with aotgrad ops only, so traced backward graphs read
 * like PyTorch's: cat -> slice per input, stack -> select per input, split -> cat (new_zeros for
 * outputs that got no gradient), index_select -> new_zeros + index_add, gather -> new_zeros +
 * scatter_add, index -> new_zeros + index_put(accumulate=True), index_put -> index_put of zeros
 * for self and index for values.
 *
 * Rules that need only an input's SHAPE (self's sizes, the sizes of cat's inputs) read it from
 * ctx->input_meta instead of saving the input, as ATen saves only sym_sizes.
 *
 * Kernels allocate nothing but their outputs: slices for cat/stack/split are views in structs
 * on the stack, and index arrays, offsets and contiguous copies are per-thread scratch
 * (ag__scratch; the slots are listed in src/core/scratch.c). */
#include "../core/kernel_util.h"
#include "family.h"
#include "shard_rules.h"

/* ---- shared helpers ---- */

static int out_of_bounds(const char *op, int64_t v, int dim, int64_t size) {
    return ag__err(AG_EINVAL, "%s: index %lld is out of bounds for dimension %d with size %lld", op,
                   (long long)v, dim, (long long)size);
}

/* Wraps negative indices in place and checks each against `size` (self's size in `dim`). */
static int wrap_indices(const char *op, int64_t *ix, int64_t n, int dim, int64_t size) {
    for (int64_t i = 0; i < n; i++) {
        int64_t v = ix[i];
        if (v < -size || v >= size)
            return out_of_bounds(op, v, dim, size);
        if (v < 0)
            ix[i] = v + size;
    }
    return 0;
}

/* Storage offset (in elements, relative to t's base) of flat row-major element i of t. */
static int64_t strided_offset(const ag_tensor *t, int64_t i) {
    int64_t off = 0;
    for (int d = t->ndim - 1; d >= 0; d--) {
        off += (i % t->sizes[d]) * t->strides[d];
        i /= t->sizes[d];
    }
    return off;
}

/* The values of an int64 tensor (any strides) as a row-major array in scratch slot 0, negative
 * values wrapped and checked against `size`. NULL with the error set on failure. */
static int64_t *read_index(const char *op, const ag_tensor *index, int dim, int64_t size) {
    int64_t n = ag_tensor_numel(index);
    int64_t *ix = ag__scratch(0, (size_t)n * sizeof *ix);
    if (!ix)
        return NULL;
    const int64_t *src = (const int64_t *)ag__base(index);
    if (ag_tensor_is_contiguous(index))
        memcpy(ix, src, (size_t)n * sizeof *ix);
    else
        for (int64_t i = 0; i < n; i++)
            ix[i] = src[strided_offset(index, i)];
    if (wrap_indices(op, ix, n, dim, size))
        return NULL;
    return ix;
}

/* t narrowed to [start, start + len) in dim: a view in the caller's struct *v, for kernels (no
 * reference, no autograd; see ag__tensor_view_tmp). */
static ag_tensor *narrow_view(ag_tensor *v, const ag_tensor *t, int dim, int64_t start,
                              int64_t len) {
    ag_tmeta m;
    ag__tmeta_of(t, &m);
    m.sizes[dim] = len;
    m.offset += start * m.strides[dim];
    return ag__tensor_view_tmp(v, t, &m);
}

/* t with dim removed at position i, in *v (as narrow_view). */
static ag_tensor *select_view(ag_tensor *v, const ag_tensor *t, int dim, int64_t i) {
    ag_tmeta m;
    ag__tmeta_of(t, &m);
    m.offset += i * t->strides[dim];
    for (int d = dim; d < t->ndim - 1; d++) {
        m.sizes[d] = t->sizes[d + 1];
        m.strides[d] = t->strides[d + 1];
    }
    m.ndim = t->ndim - 1;
    return ag__tensor_view_tmp(v, t, &m);
}

/* Product of sizes[lo..hi). */
static int64_t prod(const int64_t *sizes, int lo, int hi) {
    int64_t p = 1;
    for (int d = lo; d < hi; d++)
        p *= sizes[d];
    return p;
}

static int check_index_tensor(const char *op, const ag_tensor *index, int max_ndim) {
    char b[128];
    if (index->dtype != AG_I64)
        return ag__err(AG_EINVAL, "%s: index must be an int64 tensor, got %s", op,
                       ag_dtype_short(index->dtype));
    if (max_ndim >= 0 && index->ndim > max_ndim)
        return ag__err(AG_EINVAL, "%s: index must be a 0-d or 1-d tensor, got shape %s", op,
                       ag__fmt_sizes(b, sizeof b, index->ndim, index->sizes));
    return 0;
}

/* An int64 tensor from literal values, for gradcheck samples (caller owns it). */
static ag_tensor *sample_index(int ndim, const int64_t *sizes, const int64_t *vals) {
    ag_tensor *t = ag__tensor_new(AG_I64, ndim, sizes, false);
    if (t)
        memcpy(t->storage->data, vals, (size_t)ag__numel(ndim, sizes) * sizeof *vals);
    return t;
}

/* Stores a backward rule's result for input j. A NULL result means an op in the rule failed
 * (a NULL argument makes every later op return NULL and keep the first message): its status
 * is returned so that the engine does not take the missing gradient for "no gradient". */
static int set_grad(ag_bwctx *c, int j, ag_tensor *g) {
    c->grad_inputs[j] = g;
    if (g)
        return 0;
    return ag_last_status() < 0 ? ag_last_status() : AG_EINVAL;
}

/* ---- cat(Tensor[] tensors, int dim=0) ---- */

/* Like PyTorch, cat still skips 1-d empty tensors whatever the other inputs' shapes (legacy). */
static bool cat_skipped(const ag_tensor *t) {
    return t->ndim == 1 && t->sizes[0] == 0;
}

static int cat_meta(const ag_arg *a, ag_tmeta *o) {
    ag_tensor *const *ts = a[0].u.ts;
    int n = a[0].n;
    char b1[128], b2[128];
    if (n == 0)
        return ag__err(AG_EINVAL, "cat: expected a non-empty list of tensors");
    ag_dtype dt = ts[0]->dtype;
    const ag_tensor *ref = NULL;
    for (int i = 0; i < n; i++) {
        dt = ag__promote(dt, ts[i]->dtype);
        if (ts[i]->ndim == 0)
            return ag__err(AG_EINVAL,
                           "cat: zero-dimensional tensor (at position %d) cannot be concatenated",
                           i);
        if (!ref && !cat_skipped(ts[i]))
            ref = ts[i];
    }
    if (!ref) { /* only legacy empty tensors: the result is one too */
        ag__tmeta_contiguous(o, dt, 1, (int64_t[]){0});
        return 0;
    }
    int dim = ag__wrap_dim("cat", a[1].u.i, ref->ndim);
    if (dim < 0)
        return AG_EINVAL;
    int64_t sizes[AG_MAX_DIMS];
    memcpy(sizes, ref->sizes, sizeof sizes);
    sizes[dim] = 0;
    for (int i = 0; i < n; i++) {
        const ag_tensor *t = ts[i];
        if (cat_skipped(t))
            continue;
        if (t->ndim != ref->ndim)
            return ag__err(AG_EINVAL,
                           "cat: tensors must have the same number of dimensions: got %s and %s "
                           "(tensor number %d in the list)",
                           ag__fmt_sizes(b1, sizeof b1, ref->ndim, ref->sizes),
                           ag__fmt_sizes(b2, sizeof b2, t->ndim, t->sizes), i);
        for (int d = 0; d < t->ndim; d++)
            if (d != dim && t->sizes[d] != ref->sizes[d])
                return ag__err(AG_EINVAL,
                               "cat: sizes of tensors must match except in dimension %d: expected "
                               "size %lld but got size %lld in dimension %d for tensor number %d "
                               "in the list (shapes %s and %s)",
                               dim, (long long)ref->sizes[d], (long long)t->sizes[d], d, i,
                               ag__fmt_sizes(b1, sizeof b1, ref->ndim, ref->sizes),
                               ag__fmt_sizes(b2, sizeof b2, t->ndim, t->sizes));
        sizes[dim] += t->sizes[dim];
    }
    ag__tmeta_contiguous(o, dt, ref->ndim, sizes);
    return 0;
}

/* Each input is copied (converting its dtype) into its slice of the output. */
static int cat_kernel(const ag_arg *a, ag_tensor **o) {
    ag_tensor *out = o[0];
    int64_t off = 0;
    int dim = -1;
    for (int i = 0; i < a[0].n; i++) {
        ag_tensor *t = a[0].u.ts[i];
        if (cat_skipped(t))
            continue;
        if (dim < 0)
            dim = ag__wrap_dim("cat", a[1].u.i, out->ndim);
        ag_tensor dst;
        int rc = ag__copy_into(narrow_view(&dst, out, dim, off, t->sizes[dim]), t);
        if (rc)
            return rc;
        off += t->sizes[dim];
    }
    return 0;
}

/* derivatives.yaml: tensors: cat_tensors_backward = grad.narrow(dim, offset, size) per input
 * (skipped legacy empty inputs get none). */
static int cat_backward(ag_bwctx *c) {
    ag_tensor *g = c->grad_outputs[0];
    int64_t off = 0;
    int dim = -1;
    for (int j = 0; j < c->args[0].n; j++) {
        const ag_tmeta *m = &c->input_meta[j];
        if (m->ndim == 1 && m->sizes[0] == 0)
            continue;
        if (dim < 0 && (dim = ag__wrap_dim("cat", c->args[1].u.i, g->ndim)) < 0)
            return AG_EINVAL;
        int64_t len = m->sizes[dim];
        int rc = c->needs_grad[j] ? set_grad(c, j, ag_slice(g, dim, off, off + len, 1)) : 0;
        if (rc)
            return rc;
        off += len;
    }
    return 0;
}

static void cat_samples(ag_samples *s) {
    int64_t a[] = {2, 3}, b[] = {2, 1}, c[] = {2, 4}, d[] = {1, 3}, e[] = {0};
    ag_tensor *l1[] = {ag_samples_rand(s, 2, a, -1, 1), ag_samples_rand(s, 2, b, -1, 1),
                       ag_samples_rand_strided(s, 2, c, -1, 1)};
    ag_samples_add(s, "dim 1, strided", (ag_arg[]){AG_A_TS(l1, 3), AG_A_I(1)}, 2);
    ag_tensor *l2[] = {ag_samples_rand(s, 2, d, -1, 1), ag_samples_rand(s, 1, e, -1, 1),
                       ag_samples_rand_strided(s, 2, a, -1, 1)};
    ag_samples_add(s, "dim -2, legacy empty", (ag_arg[]){AG_A_TS(l2, 3), AG_A_I(-2)}, 2);
}

static const ag_opdef op_cat = {
    .schema = "cat(Tensor[] tensors, int dim=0) -> Tensor",
    .meta = cat_meta,
    .kernel = cat_kernel,
    .dtypes = AG_DT_ALL,
    .backward = cat_backward,
    .samples = cat_samples,
    .shard = ag__shard_cat,
};

ag_tensor *ag_cat(ag_tensor *const *ts, int n, int dim) {
    AG__OP(op, "cat");
    return ag__call1(op, (ag_arg[]){AG_A_TS((ag_tensor **)ts, n), AG_A_I(dim)}, 2);
}

/* ---- stack(Tensor[] tensors, int dim=0) ---- */

static int stack_meta(const ag_arg *a, ag_tmeta *o) {
    ag_tensor *const *ts = a[0].u.ts;
    int n = a[0].n;
    char b1[128], b2[128];
    if (n == 0)
        return ag__err(AG_EINVAL, "stack: expected a non-empty list of tensors");
    const ag_tensor *ref = ts[0];
    ag_dtype dt = ref->dtype;
    for (int i = 1; i < n; i++) {
        const ag_tensor *t = ts[i];
        dt = ag__promote(dt, t->dtype);
        if (t->ndim != ref->ndim || memcmp(t->sizes, ref->sizes, sizeof(int64_t) * (size_t)t->ndim))
            return ag__err(AG_EINVAL,
                           "stack: expects each tensor to be equal size, but got %s at entry 0 "
                           "and %s at entry %d",
                           ag__fmt_sizes(b1, sizeof b1, ref->ndim, ref->sizes),
                           ag__fmt_sizes(b2, sizeof b2, t->ndim, t->sizes), i);
    }
    if (ref->ndim + 1 > AG_MAX_DIMS)
        return ag__err(AG_EINVAL, "stack: the result would have %d dims (at most %d)",
                       ref->ndim + 1, AG_MAX_DIMS);
    int dim = ag__wrap_dim("stack", a[1].u.i, ref->ndim + 1);
    if (dim < 0)
        return AG_EINVAL;
    int64_t sizes[AG_MAX_DIMS];
    for (int d = 0, k = 0; d <= ref->ndim; d++)
        sizes[d] = d == dim ? n : ref->sizes[k++];
    ag__tmeta_contiguous(o, dt, ref->ndim + 1, sizes);
    return 0;
}

static int stack_kernel(const ag_arg *a, ag_tensor **o) {
    ag_tensor *out = o[0];
    int dim = ag__wrap_dim("stack", a[1].u.i, out->ndim);
    for (int i = 0; i < a[0].n; i++) {
        ag_tensor dst;
        int rc = ag__copy_into(select_view(&dst, out, dim, i), a[0].u.ts[i]);
        if (rc)
            return rc;
    }
    return 0;
}

/* derivatives.yaml: tensors: stack_tensors_backward = grad.select(dim, i) per input. */
static int stack_backward(ag_bwctx *c) {
    ag_tensor *g = c->grad_outputs[0];
    int dim = ag__wrap_dim("stack", c->args[1].u.i, g->ndim);
    if (dim < 0)
        return AG_EINVAL;
    for (int j = 0; j < c->args[0].n; j++) {
        int rc = c->needs_grad[j] ? set_grad(c, j, ag_select(g, dim, j)) : 0;
        if (rc)
            return rc;
    }
    return 0;
}

static void stack_samples(ag_samples *s) {
    int64_t a[] = {2, 3};
    ag_tensor *l1[] = {ag_samples_rand(s, 2, a, -1, 1), ag_samples_rand_strided(s, 2, a, -1, 1)};
    ag_samples_add(s, "dim 1, strided", (ag_arg[]){AG_A_TS(l1, 2), AG_A_I(1)}, 2);
    ag_tensor *l2[] = {ag_samples_rand(s, 2, a, -1, 1), ag_samples_rand(s, 2, a, -1, 1),
                       ag_samples_rand(s, 2, a, -1, 1)};
    ag_samples_add(s, "dim -1", (ag_arg[]){AG_A_TS(l2, 3), AG_A_I(-1)}, 2);
}

static const ag_opdef op_stack = {
    .schema = "stack(Tensor[] tensors, int dim=0) -> Tensor",
    .meta = stack_meta,
    .kernel = stack_kernel,
    .dtypes = AG_DT_ALL,
    .backward = stack_backward,
    .samples = stack_samples,
};

ag_tensor *ag_stack(ag_tensor *const *ts, int n, int dim) {
    AG__OP(op, "stack");
    return ag__call1(op, (ag_arg[]){AG_A_TS((ag_tensor **)ts, n), AG_A_I(dim)}, 2);
}

/* ---- split.Tensor(Tensor self, SymInt split_size, int dim=0) -> Tensor[] ----
 *
 * In PyTorch the chunks are views of self (Tensor(a -> *)). The dispatcher aliases only output
 * 0 of a view op, so here every chunk is a COPY made by the kernel: writing into a chunk does
 * not change self. The chunk count is capped by AG_MAX_OUTPUTS (the dispatcher's and autograd
 * engine's per-node output arrays). */

static int split_meta(const ag_arg *a, ag_tmeta *o) {
    const ag_tensor *x = a[0].u.t;
    int64_t ss = a[1].u.i;
    char b[128];
    if (x->ndim == 0)
        return ag__err(AG_EINVAL, "split: expected at least a 1-dimensional tensor");
    int dim = ag__wrap_dim("split", a[2].u.i, x->ndim);
    if (dim < 0)
        return AG_EINVAL;
    int64_t len = x->sizes[dim];
    if (ss < 0 || (ss == 0 && len != 0))
        return ag__err(AG_EINVAL,
                       "split: split_size must be positive (0 only for an empty dimension), got "
                       "%lld for dimension %d of size %lld",
                       (long long)ss, dim, (long long)len);
    int64_t cnt = ss == 0 ? 1 : len / ss + (len % ss != 0); /* no overflow for huge ss */
    if (cnt < 1)
        cnt = 1;
    if (cnt > AG_MAX_OUTPUTS)
        return ag__err(AG_ENOTSUP,
                       "split: splitting %s into chunks of %lld along dimension %d gives %lld "
                       "outputs; at most %d are supported (AG_MAX_OUTPUTS)",
                       ag__fmt_sizes(b, sizeof b, x->ndim, x->sizes), (long long)ss, dim,
                       (long long)cnt, AG_MAX_OUTPUTS);
    for (int64_t k = 0; k < cnt; k++) {
        int64_t sizes[AG_MAX_DIMS];
        memcpy(sizes, x->sizes, sizeof sizes);
        int64_t rest = len - k * ss;
        sizes[dim] = rest < ss ? rest : ss;
        ag__tmeta_contiguous(&o[k], x->dtype, x->ndim, sizes);
    }
    return (int)cnt;
}

static int split_kernel(const ag_arg *a, ag_tensor **o) {
    ag_tensor *x = a[0].u.t;
    int64_t ss = a[1].u.i;
    int dim = ag__wrap_dim("split", a[2].u.i, x->ndim);
    int64_t len = x->sizes[dim];
    int64_t cnt = ss == 0 ? 1 : len / ss + (len % ss != 0); /* no overflow for huge ss */
    for (int64_t k = 0; k < cnt; k++) {
        ag_tensor src;
        int rc = ag__copy_into(o[k], narrow_view(&src, x, dim, k * ss, o[k]->sizes[dim]));
        if (rc)
            return rc;
    }
    return 0;
}

/* derivatives.yaml: self: split_backward = cat of the output grads along dim, with zeros
 * (new_zeros of the chunk's shape) for chunks that received no gradient. */
static int split_backward(ag_bwctx *c) {
    if (!c->needs_grad[0])
        return 0;
    const ag_tmeta *x = &c->input_meta[0];
    int64_t ss = c->args[1].u.i;
    int dim = ag__wrap_dim("split", c->args[2].u.i, x->ndim);
    if (dim < 0)
        return AG_EINVAL;
    ag_tensor *like = NULL;
    for (int k = 0; k < c->noutputs && !like; k++)
        like = c->grad_outputs[k];
    if (!like)
        return 0;
    ag_tensor *parts[AG_MAX_OUTPUTS];
    for (int k = 0; k < c->noutputs; k++) {
        parts[k] = c->grad_outputs[k];
        if (!parts[k]) {
            int64_t sizes[AG_MAX_DIMS];
            memcpy(sizes, x->sizes, sizeof sizes);
            int64_t rest = x->sizes[dim] - k * ss;
            sizes[dim] = rest < ss ? rest : ss;
            parts[k] = ag_new_zeros(like, x->ndim, sizes);
            if (!parts[k])
                return ag_last_status();
        }
    }
    return set_grad(c, 0, ag_cat(parts, c->noutputs, dim));
}

static void split_samples(ag_samples *s) {
    int64_t a[] = {5, 3}, b[] = {3, 5};
    ag_samples_add(s, "uneven, dim 0",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, a, -1, 1)), AG_A_I(2), AG_A_I(0)}, 3);
    ag_samples_add(
        s, "strided, dim -1",
        (ag_arg[]){AG_A_T(ag_samples_rand_strided(s, 2, b, -1, 1)), AG_A_I(2), AG_A_I(-1)}, 3);
}

static const ag_opdef op_split = {
    .schema = "split.Tensor(Tensor self, SymInt split_size, int dim=0) -> Tensor[]",
    .meta = split_meta,
    .kernel = split_kernel,
    .dtypes = AG_DT_ALL,
    .backward = split_backward,
    .samples = split_samples,
    .shard = ag__shard_split,
};

int ag_split(ag_tensor *a, int64_t split_size, int dim, ag_tensor **outs, int max_out) {
    AG__OP(op, "split.Tensor");
    return ag__calln(op, (ag_arg[]){AG_A_T(a), AG_A_I(split_size), AG_A_I(dim)}, 3, outs, max_out);
}

/* ---- index_select(Tensor self, int dim, Tensor index) ---- */

static int index_select_meta(const ag_arg *a, ag_tmeta *o) {
    const ag_tensor *x = a[0].u.t, *index = a[2].u.t;
    int rc = check_index_tensor("index_select", index, 1);
    if (rc)
        return rc;
    int dim = ag__wrap_dim("index_select", a[1].u.i, x->ndim);
    if (dim < 0)
        return AG_EINVAL;
    int64_t k = ag_tensor_numel(index);
    if (x->ndim == 0) { /* a scalar self: the one index must be 0 (checked by the kernel) */
        if (k != 1)
            return ag__err(AG_EINVAL,
                           "index_select: index to a 0-d tensor must have exactly one value, "
                           "got %lld",
                           (long long)k);
        ag__tmeta_contiguous(o, x->dtype, 0, NULL);
        return 0;
    }
    int64_t sizes[AG_MAX_DIMS];
    memcpy(sizes, x->sizes, sizeof sizes);
    sizes[dim] = k;
    ag__tmeta_contiguous(o, x->dtype, x->ndim, sizes);
    return 0;
}

/* x viewed as (outer, size, inner) around dim; out is (outer, k, inner). */
static int index_select_kernel(const ag_arg *a, ag_tensor **o) {
    ag_tensor *x = a[0].u.t, *index = a[2].u.t, *out = o[0];
    int dim = x->ndim ? ag__wrap_dim("index_select", a[1].u.i, x->ndim) : 0;
    int64_t size = x->ndim ? x->sizes[dim] : 1;
    int64_t k = ag_tensor_numel(index);
    int64_t outer = prod(x->sizes, 0, dim), inner = x->ndim ? prod(x->sizes, dim + 1, x->ndim) : 1;
    int64_t *ix = read_index("index_select", index, dim, size);
    if (!ix)
        return ag_last_status();
    ag__scratch_tensor tmp;
    const ag_tensor *src;
    int rc = ag__scratch_contiguous(&tmp, 1, x, &src);
    if (rc)
        return rc;
    size_t row = (size_t)inner * ag_dtype_size(x->dtype);
    const char *sp = ag__base(src);
    char *op = ag__base(out);
    int64_t rows = outer * k;
#pragma omp parallel for schedule(static) if (rows * inner >= AG__PAR_MIN && rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        int64_t oi = r / k, i = r % k;
        memcpy(op + (size_t)r * row, sp + (size_t)(oi * size + ix[i]) * row, row);
    }
    return 0;
}

/* derivatives.yaml: self: index_select_backward(grad, self.sizes(), dim, index), which ATen
 * implements as grad.new_zeros(self_sizes).index_add_(dim, index, grad). */
static int index_select_backward(ag_bwctx *c) {
    if (!c->needs_grad[0])
        return 0;
    const ag_tmeta *x = &c->input_meta[0];
    ag_tensor *g = c->grad_outputs[0];
    ag_tensor *z = ag_new_zeros(g, x->ndim, x->sizes);
    return set_grad(c, 0, ag_index_add(z, (int)c->args[1].u.i, c->args[2].u.t, g, 1.0));
}

static void index_select_samples(ag_samples *s) {
    int64_t a[] = {4, 3}, n3[] = {3}, n4[] = {4};
    ag_samples_add(s, "dim 0, duplicates, strided",
                   (ag_arg[]){AG_A_T(ag_samples_rand_strided(s, 2, a, -1, 1)), AG_A_I(0),
                              AG_A_T(sample_index(1, n3, (int64_t[]){3, 0, 3}))},
                   3);
    ag_samples_add(s, "dim -1, negative index",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, a, -1, 1)), AG_A_I(-1),
                              AG_A_T(sample_index(1, n4, (int64_t[]){2, -3, 1, 1}))},
                   3);
}

static const ag_opdef op_index_select = {
    .schema = "index_select(Tensor self, int dim, Tensor index) -> Tensor",
    .meta = index_select_meta,
    .kernel = index_select_kernel,
    .dtypes = AG_DT_ALL,
    .backward = index_select_backward,
    .save_args = 1u << 1, /* index */
    .samples = index_select_samples,
    .shard = ag__shard_index_select,
};

ag_tensor *ag_index_select(ag_tensor *a, int dim, ag_tensor *index) {
    AG__OP(op, "index_select");
    return ag__call1(op, (ag_arg[]){AG_A_T(a), AG_A_I(dim), AG_A_T(index)}, 3);
}

/* ---- index_add(Tensor self, int dim, Tensor index, Tensor source, *, Scalar alpha=1) ----
 * out = self.clone(); out.select(dim, index[i]) += alpha * source.select(dim, i). */

static int index_add_meta(const ag_arg *a, ag_tmeta *o) {
    const ag_tensor *x = a[0].u.t, *index = a[2].u.t, *src = a[3].u.t;
    char b1[128], b2[128];
    int rc = check_index_tensor("index_add", index, 1);
    if (rc)
        return rc;
    if (src->dtype != x->dtype)
        return ag__err(AG_EINVAL, "index_add: self (%s) and source (%s) must have the same dtype",
                       ag_dtype_short(x->dtype), ag_dtype_short(src->dtype));
    int dim = ag__wrap_dim("index_add", a[1].u.i, x->ndim);
    if (dim < 0)
        return AG_EINVAL;
    int64_t k = ag_tensor_numel(index);
    bool ok = src->ndim == x->ndim;
    for (int d = 0; ok && d < x->ndim; d++)
        ok = src->sizes[d] == (d == dim ? k : x->sizes[d]);
    if (x->ndim == 0)
        ok = ok && k == 1;
    if (!ok)
        return ag__err(AG_EINVAL,
                       "index_add: source %s must have self's shape %s except in dimension %d, "
                       "where its size must be the number of indices (%lld)",
                       ag__fmt_sizes(b1, sizeof b1, src->ndim, src->sizes),
                       ag__fmt_sizes(b2, sizeof b2, x->ndim, x->sizes), dim, (long long)k);
    ag__tmeta_contiguous(o, x->dtype, x->ndim, x->sizes);
    return 0;
}

/* out (outer, size, inner) += alpha * src (outer, k, inner) at rows ix. Threads own disjoint
 * (outer, column block) tiles and walk the indices in order, so duplicates never race. */
static int index_add_loop(ag_dtype dt, char *outp, const char *srcp, const int64_t *ix,
                          int64_t outer, int64_t size, int64_t k, int64_t inner, double alpha) {
    const int64_t blk = 64, nblk = (inner + blk - 1) / blk, tiles = outer * nblk;
    const int par = outer * k * inner >= AG__PAR_MIN && tiles > 1;
    AG__ALL_SWITCH(dt, T, {
        T *po = (T *)(void *)outp;
        const T *ps = (const T *)(const void *)srcp;
        const T al = (T)alpha;
        _Pragma("omp parallel for schedule(static) if (par)") for (int64_t t = 0; t < tiles; t++) {
            int64_t oi = t / nblk, c0 = (t % nblk) * blk;
            int64_t c1 = c0 + blk < inner ? c0 + blk : inner;
            for (int64_t i = 0; i < k; i++) {
                T *dst = po + (oi * size + ix[i]) * inner;
                const T *sr = ps + (oi * k + i) * inner;
                for (int64_t e = c0; e < c1; e++)
                    dst[e] = (T)(dst[e] + al * sr[e]);
            }
        }
    });
    return 0;
}

static int index_add_kernel(const ag_arg *a, ag_tensor **o) {
    ag_tensor *x = a[0].u.t, *index = a[2].u.t, *src = a[3].u.t, *out = o[0];
    int dim = x->ndim ? ag__wrap_dim("index_add", a[1].u.i, x->ndim) : 0;
    int64_t size = x->ndim ? x->sizes[dim] : 1;
    int64_t outer = prod(x->sizes, 0, dim), inner = x->ndim ? prod(x->sizes, dim + 1, x->ndim) : 1;
    int rc = ag__copy_into(out, x);
    if (rc)
        return rc;
    int64_t *ix = read_index("index_add", index, dim, size);
    if (!ix)
        return ag_last_status();
    ag__scratch_tensor tmp;
    const ag_tensor *s;
    rc = ag__scratch_contiguous(&tmp, 1, src, &s);
    if (!rc)
        rc = index_add_loop(x->dtype, ag__base(out), ag__base(s), ix, outer, size,
                            ag_tensor_numel(index), inner, a[4].u.f);
    return rc;
}

/* derivatives.yaml: self: grad; source: grad.index_select(dim, index) * alpha. */
static int index_add_backward(ag_bwctx *c) {
    ag_tensor *g = c->grad_outputs[0];
    double alpha = c->args[4].u.f;
    if (c->needs_grad[0])
        c->grad_inputs[0] = g;
    if (c->needs_grad[2]) {
        ag_tensor *r = ag_index_select(g, (int)c->args[1].u.i, c->args[2].u.t);
        return set_grad(c, 2, alpha == 1.0 ? r : ag_mul_scalar(r, alpha));
    }
    return 0;
}

static void index_add_samples(ag_samples *s) {
    int64_t a[] = {4, 3}, b[] = {2, 3}, c[] = {4, 2}, n2[] = {2};
    ag_samples_add(s, "dim 0, duplicates, alpha",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, a, -1, 1)), AG_A_I(0),
                              AG_A_T(sample_index(1, n2, (int64_t[]){1, 1})),
                              AG_A_T(ag_samples_rand_strided(s, 2, b, -1, 1)), AG_A_F(2.0)},
                   5);
    ag_samples_add(s, "dim 1",
                   (ag_arg[]){AG_A_T(ag_samples_rand_strided(s, 2, a, -1, 1)), AG_A_I(1),
                              AG_A_T(sample_index(1, n2, (int64_t[]){2, -3})),
                              AG_A_T(ag_samples_rand(s, 2, c, -1, 1))},
                   4);
}

static const ag_opdef op_index_add = {
    .schema = "index_add(Tensor self, int dim, Tensor index, Tensor source, *, Scalar alpha=1) "
              "-> Tensor",
    .meta = index_add_meta,
    .kernel = index_add_kernel,
    .dtypes = AG_DT_FLOAT | (1u << AG_I64),
    .backward = index_add_backward,
    .save_args = 1u << 1, /* index */
    .samples = index_add_samples,
};

ag_tensor *ag_index_add(ag_tensor *self, int dim, ag_tensor *index, ag_tensor *source,
                        double alpha) {
    AG__OP(op, "index_add");
    return ag__call1(
        op, (ag_arg[]){AG_A_T(self), AG_A_I(dim), AG_A_T(index), AG_A_T(source), AG_A_F(alpha)}, 5);
}

/* ---- gather(Tensor self, int dim, Tensor index, *, bool sparse_grad=False) ----
 * out[i][j][k] = self[i][index[i][j][k]][k] for dim 1; out has index's shape. sparse_grad is
 * accepted for schema compatibility; the gradient is always dense. */

static int gather_meta(const ag_arg *a, ag_tmeta *o) {
    const ag_tensor *x = a[0].u.t, *index = a[2].u.t;
    char b1[128], b2[128];
    int rc = check_index_tensor("gather", index, -1);
    if (rc)
        return rc;
    int dim = ag__wrap_dim("gather", a[1].u.i, x->ndim);
    if (dim < 0)
        return AG_EINVAL;
    bool ok = index->ndim == x->ndim;
    for (int d = 0; ok && d < x->ndim; d++)
        ok = d == dim || index->sizes[d] <= x->sizes[d];
    if (!ok)
        return ag__err(AG_EINVAL,
                       "gather: index %s must have as many dims as self %s and be no larger "
                       "apart from dimension %d",
                       ag__fmt_sizes(b1, sizeof b1, index->ndim, index->sizes),
                       ag__fmt_sizes(b2, sizeof b2, x->ndim, x->sizes), dim);
    ag__tmeta_contiguous(o, x->dtype, index->ndim, index->sizes);
    return 0;
}

/* out is contiguous with index's shape; ix holds the (wrapped) index values row-major. Rows
 * are the output's leading dims, the innermost dim is walked per row. */
static int gather_loop(const ag_tensor *x, int dim, const int64_t *ix, ag_tensor *out) {
    const int nd = out->ndim;
    const int64_t inner = nd ? out->sizes[nd - 1] : 1;
    const int64_t rows = inner ? ag_tensor_numel(out) / inner : 0;
    const int64_t sdim = nd ? x->strides[dim] : 0;
    const int64_t slast = nd && dim != nd - 1 ? x->strides[nd - 1] : 0;
    const int par = rows * inner >= AG__PAR_MIN && rows > 1;
    AG__ALL_SWITCH(x->dtype, T, {
        const T *src = (const T *)(const void *)ag__base(x);
        T *dst = (T *)(void *)ag__base(out);
        _Pragma("omp parallel for schedule(static) if (par)") for (int64_t r = 0; r < rows; r++) {
            int64_t base = 0, rr = r;
            for (int d = nd - 2; d >= 0; d--) {
                int64_t c = rr % out->sizes[d];
                rr /= out->sizes[d];
                if (d != dim)
                    base += c * x->strides[d];
            }
            for (int64_t e = 0; e < inner; e++) {
                int64_t p = r * inner + e;
                dst[p] = src[base + e * slast + ix[p] * sdim];
            }
        }
    });
    return 0;
}

static int gather_kernel(const ag_arg *a, ag_tensor **o) {
    ag_tensor *x = a[0].u.t, *index = a[2].u.t;
    int dim = x->ndim ? ag__wrap_dim("gather", a[1].u.i, x->ndim) : 0;
    int64_t *ix = read_index("gather", index, dim, x->ndim ? x->sizes[dim] : 1);
    if (!ix)
        return ag_last_status();
    return gather_loop(x, dim, ix, o[0]);
}

/* derivatives.yaml: self: gather_backward = grad.new_zeros(self.sizes()).scatter_add_(dim,
 * index, grad) (functional scatter_add here). */
static int gather_backward(ag_bwctx *c) {
    if (!c->needs_grad[0])
        return 0;
    const ag_tmeta *x = &c->input_meta[0];
    ag_tensor *g = c->grad_outputs[0];
    ag_tensor *z = ag_new_zeros(g, x->ndim, x->sizes);
    return set_grad(c, 0, ag_scatter_add(z, (int)c->args[1].u.i, c->args[2].u.t, g));
}

static void gather_samples(ag_samples *s) {
    int64_t a[] = {3, 4}, i1[] = {3, 2}, i2[] = {2, 4};
    ag_samples_add(s, "dim 1, strided",
                   (ag_arg[]){AG_A_T(ag_samples_rand_strided(s, 2, a, -1, 1)), AG_A_I(1),
                              AG_A_T(sample_index(2, i1, (int64_t[]){0, 3, 2, 2, -1, 1}))},
                   3);
    ag_samples_add(s, "dim 0, smaller index",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, a, -1, 1)), AG_A_I(0),
                              AG_A_T(sample_index(2, i2, (int64_t[]){2, 0, 1, 2, 2, 2, 0, 1}))},
                   3);
}

static const ag_opdef op_gather = {
    .schema = "gather(Tensor self, int dim, Tensor index, *, bool sparse_grad=False) -> Tensor",
    .meta = gather_meta,
    .kernel = gather_kernel,
    .dtypes = AG_DT_ALL,
    .backward = gather_backward,
    .save_args = 1u << 1, /* index */
    .samples = gather_samples,
    .shard = ag__shard_gather,
};

ag_tensor *ag_gather(ag_tensor *a, int dim, ag_tensor *index) {
    AG__OP(op, "gather");
    return ag__call1(op, (ag_arg[]){AG_A_T(a), AG_A_I(dim), AG_A_T(index)}, 3);
}

/* ---- scatter_add(Tensor self, int dim, Tensor index, Tensor src) ----
 * out = self.clone(); out[i][index[i][j][k]][k] += src[i][j][k] for dim 1, over index's shape
 * (index may be smaller than src in every dim and than self apart from dim). */

static int scatter_add_meta(const ag_arg *a, ag_tmeta *o) {
    const ag_tensor *x = a[0].u.t, *index = a[2].u.t, *src = a[3].u.t;
    char b1[128], b2[128], b3[128];
    int rc = check_index_tensor("scatter_add", index, -1);
    if (rc)
        return rc;
    if (src->dtype != x->dtype)
        return ag__err(AG_EINVAL, "scatter_add: self (%s) and src (%s) must have the same dtype",
                       ag_dtype_short(x->dtype), ag_dtype_short(src->dtype));
    int dim = ag__wrap_dim("scatter_add", a[1].u.i, x->ndim);
    if (dim < 0)
        return AG_EINVAL;
    bool ok = index->ndim == x->ndim && src->ndim == x->ndim;
    for (int d = 0; ok && d < x->ndim; d++)
        ok = index->sizes[d] <= src->sizes[d] && (d == dim || index->sizes[d] <= x->sizes[d]);
    if (!ok)
        return ag__err(AG_EINVAL,
                       "scatter_add: index %s must have as many dims as self %s and src %s, be "
                       "no larger than src, and no larger than self apart from dimension %d",
                       ag__fmt_sizes(b1, sizeof b1, index->ndim, index->sizes),
                       ag__fmt_sizes(b2, sizeof b2, x->ndim, x->sizes),
                       ag__fmt_sizes(b3, sizeof b3, src->ndim, src->sizes), dim);
    ag__tmeta_contiguous(o, x->dtype, x->ndim, x->sizes);
    return 0;
}

/* Fibers of index along dim (all coordinates but dim fixed) are independent: different fibers
 * write different output elements, so threads split fibers and walk each fiber in order. */
static int scatter_add_loop(const ag_tensor *index, int dim, const int64_t *ix,
                            const ag_tensor *src, ag_tensor *out) {
    const int nd = index->ndim;
    if (nd == 0) {
        AG__ALL_SWITCH(out->dtype, T, {
            T *po = (T *)(void *)ag__base(out);
            po[0] = (T)(po[0] + *(const T *)(const void *)ag__base(src));
        });
        return 0;
    }
    int64_t istr[AG_MAX_DIMS];
    int64_t st = 1;
    for (int d = nd - 1; d >= 0; d--) {
        istr[d] = st;
        st *= index->sizes[d];
    }
    const int64_t k = index->sizes[dim];
    const int64_t fibers = k ? ag_tensor_numel(index) / k : 0;
    const int par = fibers * k >= AG__PAR_MIN && fibers > 1;
    AG__ALL_SWITCH(out->dtype, T, {
        T *po = (T *)(void *)ag__base(out);
        const T *ps = (const T *)(const void *)ag__base(src);
        _Pragma("omp parallel for schedule(static) if (par)") for (int64_t f = 0; f < fibers; f++) {
            int64_t ob = 0, sb = 0, ib = 0, ff = f;
            for (int d = nd - 1; d >= 0; d--) {
                if (d == dim)
                    continue;
                int64_t c = ff % index->sizes[d];
                ff /= index->sizes[d];
                ob += c * out->strides[d];
                sb += c * src->strides[d];
                ib += c * istr[d];
            }
            for (int64_t j = 0; j < k; j++) {
                T *dst = po + ob + ix[ib + j * istr[dim]] * out->strides[dim];
                *dst = (T)(*dst + ps[sb + j * src->strides[dim]]);
            }
        }
    });
    return 0;
}

static int scatter_add_kernel(const ag_arg *a, ag_tensor **o) {
    ag_tensor *x = a[0].u.t, *index = a[2].u.t, *src = a[3].u.t, *out = o[0];
    int dim = x->ndim ? ag__wrap_dim("scatter_add", a[1].u.i, x->ndim) : 0;
    int rc = ag__copy_into(out, x);
    if (rc)
        return rc;
    int64_t *ix = read_index("scatter_add", index, dim, x->ndim ? x->sizes[dim] : 1);
    if (!ix)
        return ag_last_status();
    return scatter_add_loop(index, dim, ix, src, out);
}

/* derivatives.yaml: self: grad; src: grad.gather(dim, index). When index is smaller than src,
 * the src positions it does not cover get zeros (slice_backward pads each short dim); ATen
 * would reject that gradient's shape. */
static int scatter_add_backward(ag_bwctx *c) {
    ag_tensor *g = c->grad_outputs[0], *index = c->args[2].u.t;
    const ag_tmeta *src = &c->input_meta[2];
    int dim = (int)c->args[1].u.i;
    if (c->needs_grad[0])
        c->grad_inputs[0] = g;
    if (c->needs_grad[2]) {
        ag_tensor *r = ag_gather(g, dim, index);
        int64_t sizes[AG_MAX_DIMS];
        memcpy(sizes, index->sizes, sizeof sizes);
        for (int d = 0; r && d < src->ndim; d++)
            if (sizes[d] != src->sizes[d]) {
                int64_t len = sizes[d];
                sizes[d] = src->sizes[d];
                r = ag_slice_backward(r, src->ndim, sizes, d, 0, len, 1);
            }
        return set_grad(c, 2, r);
    }
    return 0;
}

static void scatter_add_samples(ag_samples *s) {
    int64_t a[] = {3, 4}, i1[] = {2, 3}, i2[] = {3, 4};
    ag_samples_add(s, "dim 0, duplicates, index smaller than src",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, a, -1, 1)), AG_A_I(0),
                              AG_A_T(sample_index(2, i1, (int64_t[]){2, 0, 2, 2, 1, -1})),
                              AG_A_T(ag_samples_rand_strided(s, 2, a, -1, 1))},
                   4);
    ag_samples_add(
        s, "dim -1, same shape",
        (ag_arg[]){AG_A_T(ag_samples_rand_strided(s, 2, a, -1, 1)), AG_A_I(-1),
                   AG_A_T(sample_index(2, i2, (int64_t[]){0, 0, 3, 1, 2, 1, 0, 3, 3, 3, 3, 3})),
                   AG_A_T(ag_samples_rand(s, 2, a, -1, 1))},
        4);
}

static const ag_opdef op_scatter_add = {
    .schema = "scatter_add(Tensor self, int dim, Tensor index, Tensor src) -> Tensor",
    .meta = scatter_add_meta,
    .kernel = scatter_add_kernel,
    .dtypes = AG_DT_FLOAT | (1u << AG_I64),
    .backward = scatter_add_backward,
    .save_args = 1u << 1, /* index */
    .samples = scatter_add_samples,
};

ag_tensor *ag_scatter_add(ag_tensor *self, int dim, ag_tensor *index, ag_tensor *src) {
    AG__OP(op, "scatter_add");
    return ag__call1(op, (ag_arg[]){AG_A_T(self), AG_A_I(dim), AG_A_T(index), AG_A_T(src)}, 4);
}

/* ---- advanced indexing: index.Tensor, index_put, index_put_ ----
 *
 * indices holds one entry per leading dim of self: NULL (':'), an int64 tensor, or a bool mask
 * that covers as many dims as it has (a mask becomes the int64 positions of its true elements,
 * one position tensor per covered dim, as ATen's nonzero). The int64 tensors broadcast together
 * to shape B. The result is self's non-indexed dims with B in place of the indexed ones when
 * those are adjacent, and B followed by the non-indexed dims when a ':' separates them (NumPy's
 * rule). We write the result as (pre, B, post): pre = non-indexed dims before the indexed block
 * (empty in the separated case), post = the other non-indexed dims.
 *
 * A mask's result size depends on its DATA: the meta functions count its true elements, the one
 * place where a meta function reads data. With a meta (data-less) mask, as under tracing, the
 * output shape cannot be known and the call fails with an error saying so. */

typedef struct ix_plan {
    int ndim;                          /* self's */
    const ag_tensor *src[AG_MAX_DIMS]; /* per self dim: the index covering it, or NULL */
    int sub[AG_MAX_DIMS];              /* per indexed dim: -1 (int64) or which mask dim */
    int nb;                            /* B: the broadcast index shape */
    int64_t b[AG_MAX_DIMS];
    int npre, npost;
    int pre[AG_MAX_DIMS], post[AG_MAX_DIMS]; /* self dims of the pre and post parts */
    int out_ndim;
    int64_t out_sizes[AG_MAX_DIMS];
} ix_plan;

static int64_t mask_count(const ag_tensor *m) {
    const bool *p = (const bool *)(const void *)ag__base(m);
    int64_t n = ag_tensor_numel(m), cnt = 0;
    for (int64_t i = 0; i < n; i++)
        cnt += p[strided_offset(m, i)];
    return cnt;
}

static int ix_plan_build(const char *op, const ag_tensor *x, ag_tensor *const *ix, int n,
                         ix_plan *p) {
    char b1[128], b2[128];
    memset(p, 0, sizeof *p);
    p->ndim = x->ndim;
    int d = 0;
    bool have_b = false;
    for (int i = 0; i < n; i++) {
        const ag_tensor *t = ix[i];
        int covers = !t ? 1 : t->dtype == AG_BOOL ? t->ndim : 1;
        if (t && t->dtype != AG_BOOL && t->dtype != AG_I64)
            return ag__err(AG_EINVAL,
                           "%s: tensors used as indices must be int64 or bool tensors, got %s at "
                           "position %d",
                           op, ag_dtype_short(t->dtype), i);
        if (t && t->dtype == AG_BOOL && t->ndim == 0)
            return ag__err(AG_ENOTSUP,
                           "%s: 0-dimensional bool indices are not supported "
                           "(position %d)",
                           op, i);
        if (d + covers > x->ndim)
            return ag__err(AG_EINVAL, "%s: too many indices for a tensor of dimension %d", op,
                           x->ndim);
        if (!t) {
            d++;
            continue;
        }
        int64_t shape[AG_MAX_DIMS];
        int nshape;
        if (t->dtype == AG_BOOL) {
            for (int j = 0; j < t->ndim; j++)
                if (t->sizes[j] != x->sizes[d + j])
                    return ag__err(AG_EINVAL,
                                   "%s: the shape of the mask %s at index %d does not match the "
                                   "shape of the indexed tensor %s at index %d",
                                   op, ag__fmt_sizes(b1, sizeof b1, t->ndim, t->sizes), j,
                                   ag__fmt_sizes(b2, sizeof b2, x->ndim, x->sizes), d + j);
            if (ag__is_meta(t))
                return ag__err(AG_ENOTSUP,
                               "%s: a bool mask index gives a data-dependent output shape, which "
                               "cannot be computed for a meta tensor (tracing); use int64 "
                               "indices",
                               op);
            shape[0] = mask_count(t);
            nshape = 1;
            for (int j = 0; j < t->ndim; j++) {
                p->src[d + j] = t;
                p->sub[d + j] = j;
            }
        } else {
            memcpy(shape, t->sizes, sizeof shape);
            nshape = t->ndim;
            p->src[d] = t;
            p->sub[d] = -1;
        }
        d += covers;
        if (!have_b) {
            memcpy(p->b, shape, sizeof shape);
            p->nb = nshape;
            have_b = true;
        } else {
            int64_t nbs[AG_MAX_DIMS];
            int nn;
            int rc = ag__broadcast(op, p->nb, p->b, nshape, shape, &nn, nbs);
            if (rc)
                return rc;
            memcpy(p->b, nbs, sizeof nbs);
            p->nb = nn;
        }
    }
    if (!have_b)
        return ag__err(AG_EINVAL, "%s: at least one index must be a tensor (all were None)", op);
    int first = -1, last = -1;
    for (int k = 0; k < x->ndim; k++)
        if (p->src[k]) {
            if (first < 0)
                first = k;
            last = k;
        }
    bool adjacent = true;
    for (int k = first; k <= last; k++)
        adjacent &= p->src[k] != NULL;
    for (int k = 0; k < x->ndim; k++) {
        if (p->src[k])
            continue;
        if (adjacent && k < first)
            p->pre[p->npre++] = k;
        else
            p->post[p->npost++] = k;
    }
    p->out_ndim = p->npre + p->nb + p->npost;
    if (p->out_ndim > AG_MAX_DIMS)
        return ag__err(AG_EINVAL, "%s: the result would have %d dims (at most %d)", op, p->out_ndim,
                       AG_MAX_DIMS);
    int o = 0;
    for (int k = 0; k < p->npre; k++)
        p->out_sizes[o++] = x->sizes[p->pre[k]];
    for (int k = 0; k < p->nb; k++)
        p->out_sizes[o++] = p->b[k];
    for (int k = 0; k < p->npost; k++)
        p->out_sizes[o++] = x->sizes[p->post[k]];
    return 0;
}

/* Offsets (with `strides`, those of the tensor addressed) of every row-major position of a
 * list of self dims, in scratch slot `slot`. */
static int64_t *dims_offsets(const int64_t *sizes, const int64_t *strides, const int *dims, int nd,
                             int slot, int64_t *count) {
    int64_t n = 1;
    for (int k = 0; k < nd; k++)
        n *= sizes[dims[k]];
    int64_t *off = ag__scratch(slot, (size_t)n * sizeof *off);
    if (!off)
        return NULL;
    for (int64_t i = 0; i < n; i++) {
        int64_t r = i, o = 0;
        for (int k = nd - 1; k >= 0; k--) {
            o += (r % sizes[dims[k]]) * strides[dims[k]];
            r /= sizes[dims[k]];
        }
        off[i] = o;
    }
    *count = n;
    return off;
}

/* The raw index values for self dim d, broadcast to B, as a contiguous int64 tensor in *vt
 * over scratch slot 3 (a mask's coordinates go through slot 4). */
static ag_tensor *ix_values_for_dim(const ix_plan *p, int d, ag__scratch_tensor *vt) {
    const ag_tensor *t = p->src[d];
    ag_tensor *vb = ag__scratch_tensor_new(vt, 3, AG_I64, p->nb, p->b);
    if (!vb)
        return NULL;
    ag_tensor *v = (ag_tensor *)t;
    ag__scratch_tensor pt;
    if (p->sub[d] >= 0) {
        /* Mask: the coordinates in mask dim `sub` of its true elements, row-major. */
        int64_t cnt = mask_count(t), k = 0;
        ag_tensor *pos = ag__scratch_tensor_new(&pt, 4, AG_I64, 1, &cnt);
        if (!pos)
            return NULL;
        int64_t *pp = (int64_t *)pos->storage->data, n = ag_tensor_numel(t);
        int64_t inner = prod(t->sizes, p->sub[d] + 1, t->ndim);
        const bool *mp = (const bool *)(const void *)ag__base(t);
        for (int64_t i = 0; i < n; i++)
            if (mp[strided_offset(t, i)])
                pp[k++] = (i / inner) % t->sizes[p->sub[d]];
        v = pos;
    }
    if (ag__copy_into(vb, v))
        return NULL;
    return vb;
}

/* Offsets of the pre, B and post parts for addressing a tensor of self's shape with `strides`;
 * checks every index against its dim. The three arrays are scratch slots 0, 2 and 1 (valid
 * until those slots are taken again). */
static int ix_offsets(const char *op, const ix_plan *p, const int64_t *sizes,
                      const int64_t *strides, int64_t **poff, int64_t *np, int64_t **boff,
                      int64_t *nbo, int64_t **qoff, int64_t *nq) {
    *poff = dims_offsets(sizes, strides, p->pre, p->npre, 0, np);
    *qoff = *poff ? dims_offsets(sizes, strides, p->post, p->npost, 1, nq) : NULL;
    *nbo = ag__numel(p->nb, p->b);
    *boff = *qoff ? ag__scratch(2, (size_t)(*nbo ? *nbo : 1) * sizeof **boff) : NULL;
    if (*boff)
        memset(*boff, 0, (size_t)(*nbo ? *nbo : 1) * sizeof **boff);
    int rc = *boff ? 0 : AG_ENOMEM;
    for (int d = 0; d < p->ndim && rc == 0 && *nbo > 0; d++) {
        if (!p->src[d])
            continue;
        ag__scratch_tensor vt;
        ag_tensor *vb = ix_values_for_dim(p, d, &vt);
        if (!vb) {
            rc = ag_last_status();
            break;
        }
        int64_t *v = (int64_t *)vb->storage->data;
        rc = wrap_indices(op, v, *nbo, d, sizes[d]);
        for (int64_t i = 0; i < *nbo && rc == 0; i++)
            (*boff)[i] += v[i] * strides[d];
    }
    if (rc)
        *poff = *qoff = *boff = NULL;
    return rc;
}

/* index.Tensor(Tensor self, Tensor?[] indices) */

static int index_meta(const ag_arg *a, ag_tmeta *o) {
    const ag_tensor *x = a[0].u.t;
    ix_plan p;
    int rc = ix_plan_build("index", x, a[1].u.ts, a[1].n, &p);
    if (rc)
        return rc;
    ag__tmeta_contiguous(o, x->dtype, p.out_ndim, p.out_sizes);
    return 0;
}

/* out[(pi, b, q)] = self[poff[pi] + boff[b] + qoff[q]], rows (pi, b) split across threads. */
static int index_loop(ag_dtype dt, const char *srcp, char *dstp, const int64_t *poff,
                      const int64_t *boff, int64_t nb, const int64_t *qoff, int64_t nq,
                      int64_t rows) {
    const int par = rows * nq >= AG__PAR_MIN && rows > 1;
    AG__ALL_SWITCH(dt, T, {
        const T *src = (const T *)(const void *)srcp;
        T *dst = (T *)(void *)dstp;
        _Pragma("omp parallel for schedule(static) if (par)") for (int64_t r = 0; r < rows; r++) {
            const T *s = src + poff[r / nb] + boff[r % nb];
            T *d = dst + r * nq;
            for (int64_t q = 0; q < nq; q++)
                d[q] = s[qoff[q]];
        }
    });
    return 0;
}

static int index_kernel(const ag_arg *a, ag_tensor **o) {
    ag_tensor *x = a[0].u.t;
    ix_plan p;
    int64_t *poff, *boff, *qoff, np, nbo, nq;
    int rc = ix_plan_build("index", x, a[1].u.ts, a[1].n, &p);
    if (!rc)
        rc = ix_offsets("index", &p, x->sizes, x->strides, &poff, &np, &boff, &nbo, &qoff, &nq);
    if (rc)
        return rc;
    return index_loop(x->dtype, ag__base(x), ag__base(o[0]), poff, boff, nbo, qoff, nq, np * nbo);
}

/* derivatives.yaml: self: index_backward(grad.new_zeros(self.sizes()), indices, grad), i.e.
 * index_put(new_zeros, indices, grad, accumulate=True). */
static int index_backward(ag_bwctx *c) {
    if (!c->needs_grad[0])
        return 0;
    const ag_tmeta *x = &c->input_meta[0];
    ag_tensor *g = c->grad_outputs[0];
    ag_tensor *z = ag_new_zeros(g, x->ndim, x->sizes);
    return set_grad(c, 0, ag_index_put(z, c->args[1].u.ts, c->args[1].n, g, true));
}

static void index_samples(ag_samples *s) {
    int64_t a[] = {4, 3}, c3[] = {3, 4, 5}, n3[] = {3}, n21[] = {2, 1}, n2[] = {2};
    ag_tensor *l1[] = {sample_index(1, n3, (int64_t[]){2, 0, -2})};
    ag_samples_add(s, "one index, duplicates, strided",
                   (ag_arg[]){AG_A_T(ag_samples_rand_strided(s, 2, a, -1, 1)), AG_A_TS(l1, 1)}, 2);
    ag_tensor *l2[] = {NULL, sample_index(2, n21, (int64_t[]){3, 0}),
                       sample_index(1, n3, (int64_t[]){4, 1, 4})};
    ag_samples_add(s, "':' then two broadcast indices",
                   (ag_arg[]){AG_A_T(ag_samples_rand_strided(s, 3, c3, -1, 1)), AG_A_TS(l2, 3)}, 2);
    ag_tensor *l3[] = {sample_index(1, n2, (int64_t[]){2, 0}), NULL,
                       sample_index(1, n2, (int64_t[]){1, 1})};
    ag_samples_add(s, "indices separated by ':'",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 3, c3, -1, 1)), AG_A_TS(l3, 3)}, 2);
    ag_tensor *m = ag__tensor_new(AG_BOOL, 2, a, false);
    if (m) {
        bool *mp = (bool *)m->storage->data;
        for (int i = 0; i < 12; i++)
            mp[i] = (i * 7) % 3 == 1;
    }
    ag_tensor *l4[] = {m};
    ag_samples_add(s, "bool mask",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, a, -1, 1)), AG_A_TS(l4, 1)}, 2);
}

static const ag_opdef op_index = {
    .schema = "index.Tensor(Tensor self, Tensor?[] indices) -> Tensor",
    .meta = index_meta,
    .kernel = index_kernel,
    .dtypes = AG_DT_ALL,
    .backward = index_backward,
    .save_args = ~1u, /* the indices */
    .samples = index_samples,
};

ag_tensor *ag_index(ag_tensor *a, ag_tensor *const *indices, int n) {
    AG__OP(op, "index.Tensor");
    return ag__call1(op, (ag_arg[]){AG_A_T(a), AG_A_TS((ag_tensor **)indices, n)}, 2);
}

/* index_put(Tensor self, Tensor?[] indices, Tensor values, bool accumulate=False) and
 * index_put_. values broadcast to the indexing result's shape. With accumulate=False and
 * duplicate positions the LAST write (in B's row-major order) wins, deterministically; with
 * accumulate=True they all add up. */

/* An expanded self of index_put_ is refused by the dispatcher, as for every op that writes
 * into an argument (optable.c, check_mutated_overlap). */
static int index_put_check(const char *op, const ag_arg *a, ix_plan *p) {
    const ag_tensor *x = a[0].u.t, *v = a[2].u.t;
    char b1[128], b2[128];
    if (v->dtype != x->dtype)
        return ag__err(AG_EINVAL,
                       "%s: index put requires the source and destination dtypes to match, got "
                       "%s for the destination and %s for the source",
                       op, ag_dtype_short(x->dtype), ag_dtype_short(v->dtype));
    int rc = ix_plan_build(op, x, a[1].u.ts, a[1].n, p);
    if (rc)
        return rc;
    bool ok = v->ndim <= p->out_ndim;
    for (int k = 1; ok && k <= v->ndim; k++) {
        int64_t vs = v->sizes[v->ndim - k], os = p->out_sizes[p->out_ndim - k];
        ok = vs == 1 || vs == os;
    }
    if (!ok)
        return ag__err(AG_EINVAL,
                       "%s: shape mismatch: value tensor of shape %s cannot be broadcast to "
                       "indexing result of shape %s",
                       op, ag__fmt_sizes(b1, sizeof b1, v->ndim, v->sizes),
                       ag__fmt_sizes(b2, sizeof b2, p->out_ndim, p->out_sizes));
    return 0;
}

static int index_put_meta(const ag_arg *a, ag_tmeta *o) {
    ix_plan p;
    int rc = index_put_check("index_put", a, &p);
    if (rc)
        return rc;
    ag__tmeta_contiguous(o, a[0].u.t->dtype, a[0].u.t->ndim, a[0].u.t->sizes);
    return 0;
}

static int index_put__meta(const ag_arg *a, ag_tmeta *o) {
    ix_plan p;
    int rc = index_put_check("index_put_", a, &p);
    if (rc)
        return rc;
    ag__tmeta_of(a[0].u.t, o);
    return 0;
}

/* dst[poff[pi] + boff[b] + qoff[q]] (+)= vals[(pi, b, q)]. Threads own (pi, column block)
 * tiles and walk B in order: no races, and the last duplicate wins deterministically. */
static int index_put_loop(ag_dtype dt, char *dstp, const char *valp, const int64_t *poff,
                          int64_t np, const int64_t *boff, int64_t nb, const int64_t *qoff,
                          int64_t nq, bool acc) {
    const int64_t blk = 64, nblk = (nq + blk - 1) / blk, tiles = np * nblk;
    const int par = np * nb * nq >= AG__PAR_MIN && tiles > 1;
    AG__ALL_SWITCH(dt, T, {
        T *dst = (T *)(void *)dstp;
        const T *val = (const T *)(const void *)valp;
        _Pragma("omp parallel for schedule(static) if (par)") for (int64_t t = 0; t < tiles; t++) {
            int64_t pi = t / nblk, q0 = (t % nblk) * blk;
            int64_t q1 = q0 + blk < nq ? q0 + blk : nq;
            for (int64_t b = 0; b < nb; b++) {
                T *d = dst + poff[pi] + boff[b];
                const T *v = val + (pi * nb + b) * nq;
                if (acc)
                    for (int64_t q = q0; q < q1; q++)
                        d[qoff[q]] = (T)(d[qoff[q]] + v[q]);
                else
                    for (int64_t q = q0; q < q1; q++)
                        d[qoff[q]] = v[q];
            }
        }
    });
    return 0;
}

/* Writes values into dst (self's shape; self itself for index_put_, a copy for index_put). */
static int index_put_into(const char *op, const ag_arg *a, ag_tensor *dst) {
    ag_tensor *x = a[0].u.t, *values = a[2].u.t;
    ix_plan p;
    int64_t *poff, *boff, *qoff, np, nbo, nq;
    int rc = ix_plan_build(op, x, a[1].u.ts, a[1].n, &p);
    if (!rc)
        rc = ix_offsets(op, &p, dst->sizes, dst->strides, &poff, &np, &boff, &nbo, &qoff, &nq);
    if (rc)
        return rc;
    /* values broadcast to the result shape, copied first so that values aliasing dst reads
     * the old data. */
    ag__scratch_tensor vt;
    ag_tensor *vals = ag__scratch_tensor_new(&vt, 5, dst->dtype, p.out_ndim, p.out_sizes);
    rc = vals ? ag__copy_into(vals, values) : ag_last_status();
    if (!rc)
        rc = index_put_loop(dst->dtype, ag__base(dst), (const char *)vals->storage->data, poff, np,
                            boff, nbo, qoff, nq, a[3].u.b);
    return rc;
}

static int index_put_kernel(const ag_arg *a, ag_tensor **o) {
    int rc = ag__copy_into(o[0], a[0].u.t);
    return rc ? rc : index_put_into("index_put", a, o[0]);
}

static int index_put__kernel(const ag_arg *a, ag_tensor **o) {
    return index_put_into("index_put_", a, o[0]);
}

/* derivatives.yaml (index_put and _index_put_impl_):
 *   self: accumulate ? grad : grad.index_put(indices, zeros_like(values), false)
 *   values: grad.index(indices)   (the engine sums it down to values' broadcast shape)
 * Tensor inputs: self 0, indices 1..n, values n+1. With duplicate positions and
 * accumulate=False every duplicate's value receives the gradient, as in PyTorch. */
static int index_put_backward(ag_bwctx *c) {
    ag_tensor *g = c->grad_outputs[0], *values = c->args[2].u.t;
    ag_tensor **ts = c->args[1].u.ts;
    int n = c->args[1].n;
    bool acc = c->args[3].u.b;
    int rc = 0;
    if (c->needs_grad[0])
        rc = set_grad(c, 0, acc ? g : ag_index_put(g, ts, n, ag_zeros_like(values), false));
    if (!rc && c->needs_grad[n + 1])
        rc = set_grad(c, n + 1, ag_index(g, ts, n));
    return rc;
}

static void index_put_samples(ag_samples *s) {
    int64_t a[] = {4, 3}, n2[] = {2}, n3[] = {3}, v3[] = {3}, v22[] = {2, 2};
    ag_tensor *l1[] = {sample_index(1, n2, (int64_t[]){3, 0})};
    ag_samples_add(s, "accumulate=False, broadcast values",
                   (ag_arg[]){AG_A_T(ag_samples_rand_strided(s, 2, a, -1, 1)), AG_A_TS(l1, 1),
                              AG_A_T(ag_samples_rand(s, 1, v3, -1, 1))},
                   3);
    ag_tensor *l2[] = {sample_index(1, n3, (int64_t[]){1, -3, 2}), NULL};
    ag_samples_add(s, "accumulate=True, duplicates",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, a, -1, 1)), AG_A_TS(l2, 2),
                              AG_A_T(ag_samples_rand(s, 1, v3, -1, 1)), AG_A_B(true)},
                   4);
    ag_tensor *l3[] = {sample_index(1, n2, (int64_t[]){0, 2}),
                       sample_index(2, (int64_t[]){2, 1}, (int64_t[]){2, 1})};
    ag_samples_add(s, "two broadcast indices, full values",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, a, -1, 1)), AG_A_TS(l3, 2),
                              AG_A_T(ag_samples_rand(s, 2, v22, -1, 1))},
                   3);
}

/* The in-place variant's self must not require grad as a leaf; its samples write into a
 * plain tensor, with accumulate=False so that repeated evaluations give the same result. */
static void index_put__samples(ag_samples *s) {
    int64_t a[] = {4, 3}, n2[] = {2}, v3[] = {3};
    ag_tensor *l1[] = {sample_index(1, n2, (int64_t[]){3, 0})};
    ag_samples_add(s, "accumulate=False, broadcast values",
                   (ag_arg[]){AG_A_T(ag_samples_rand_nograd(s, 2, a, -1, 1)), AG_A_TS(l1, 1),
                              AG_A_T(ag_samples_rand(s, 1, v3, -1, 1))},
                   3);
}

static const ag_opdef op_index_put = {
    .schema = "index_put(Tensor self, Tensor?[] indices, Tensor values, bool accumulate=False) "
              "-> Tensor",
    .meta = index_put_meta,
    .kernel = index_put_kernel,
    .dtypes = AG_DT_ALL,
    .backward = index_put_backward,
    .save_args = ~1u, /* indices, and values for zeros_like(values); not self */
    .samples = index_put_samples,
};

static const ag_opdef op_index_put_ = {
    .schema = "index_put_(Tensor(a!) self, Tensor?[] indices, Tensor values, "
              "bool accumulate=False) -> Tensor(a!)",
    .flags = AG_OP_INPLACE,
    .functional = "index_put",
    .meta = index_put__meta,
    .kernel = index_put__kernel,
    .dtypes = AG_DT_ALL,
    .backward = index_put_backward,
    .save_args = ~1u, /* not self: no copy of the original self is needed */
    .samples = index_put__samples,
};

ag_tensor *ag_index_put(ag_tensor *a, ag_tensor *const *indices, int n, ag_tensor *values,
                        bool accumulate) {
    AG__OP(op, "index_put");
    return ag__call1(op,
                     (ag_arg[]){AG_A_T(a), AG_A_TS((ag_tensor **)indices, n), AG_A_T(values),
                                AG_A_B(accumulate)},
                     4);
}

ag_tensor *ag_index_put_(ag_tensor *a, ag_tensor *const *indices, int n, ag_tensor *values,
                         bool accumulate) {
    AG__OP(op, "index_put_");
    return ag__call1(op,
                     (ag_arg[]){AG_A_T(a), AG_A_TS((ag_tensor **)indices, n), AG_A_T(values),
                                AG_A_B(accumulate)},
                     4);
}

/* ---- new_empty / new_zeros(Tensor self, SymInt[] size, *, ScalarType? dtype=None) ----
 * A fresh tensor of the given size with self's dtype (or `dtype`); self gives only its dtype
 * and is not differentiated. new_empty's memory is zeroed too, for reproducibility. */

static int new_meta(const char *op, const ag_arg *a, ag_tmeta *o) {
    const ag_tensor *x = a[0].u.t;
    int n = a[1].n;
    const int64_t *sizes = a[1].u.ints;
    if (n > AG_MAX_DIMS)
        return ag__err(AG_EINVAL, "%s: %d dimensions (at most %d)", op, n, AG_MAX_DIMS);
    for (int d = 0; d < n; d++)
        if (sizes[d] < 0)
            return ag__err(AG_EINVAL, "%s: negative size %lld in dimension %d", op,
                           (long long)sizes[d], d);
    ag_dtype dt = a[2].kind == AG_ARG_DTYPE ? a[2].u.dt : x->dtype;
    if ((unsigned)dt >= AG_NDTYPES)
        return ag__err(AG_EINVAL, "%s: bad dtype %d", op, (int)dt);
    ag__tmeta_contiguous(o, dt, n, sizes);
    return 0;
}

static int new_empty_meta(const ag_arg *a, ag_tmeta *o) {
    return new_meta("new_empty", a, o);
}
static int new_zeros_meta(const ag_arg *a, ag_tmeta *o) {
    return new_meta("new_zeros", a, o);
}

static int zero_fill_kernel(const ag_arg *a, ag_tensor **o) {
    (void)a;
    memset(ag__base(o[0]), 0, (size_t)ag_tensor_numel(o[0]) * ag_dtype_size(o[0]->dtype));
    return 0;
}

static const ag_opdef op_new_empty = {
    .schema = "new_empty(Tensor self, SymInt[] size, *, ScalarType? dtype=None) -> Tensor",
    .flags = AG_OP_NONDIFF | AG_OP_FACTORY,
    .meta = new_empty_meta,
    .kernel = zero_fill_kernel,
    .dtypes = AG_DT_ALL,
};

static const ag_opdef op_new_zeros = {
    .schema = "new_zeros(Tensor self, SymInt[] size, *, ScalarType? dtype=None) -> Tensor",
    .flags = AG_OP_NONDIFF | AG_OP_FACTORY,
    .meta = new_zeros_meta,
    .kernel = zero_fill_kernel,
    .dtypes = AG_DT_ALL,
};

ag_tensor *ag_new_empty(ag_tensor *like, int ndim, const int64_t *sizes) {
    AG__OP(op, "new_empty");
    return ag__call1(op, (ag_arg[]){AG_A_T(like), AG_A_INTS(sizes, ndim)}, 2);
}

ag_tensor *ag_new_zeros(ag_tensor *like, int ndim, const int64_t *sizes) {
    AG__OP(op, "new_zeros");
    return ag__call1(op, (ag_arg[]){AG_A_T(like), AG_A_INTS(sizes, ndim)}, 2);
}

const ag_opdef *const ag__ops_index[] = {
    &op_cat,       &op_stack,       &op_split, &op_index_select, &op_index_add,
    &op_gather,    &op_scatter_add, &op_index, &op_index_put,    &op_index_put_,
    &op_new_empty, &op_new_zeros,   NULL,
};
