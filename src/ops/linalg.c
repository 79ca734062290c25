/* Linear algebra: the GEMM ops mm, bmm and addmm, and the composites matmul and linear.
 *
 * The kernels call cblas_sgemm/cblas_dgemm on the operands' own memory whenever the layout
 * allows it: a matrix with strides (ld, 1) is read as it is, and one with strides (1, ld) (a
 * transposed view, such as linear's t(weight)) is passed with CblasTrans. Only layouts BLAS
 * cannot describe (expanded or sliced in both dims) are copied to a contiguous temporary.
 * bmm runs its batch as an OpenMP loop when the matrices are small (OpenBLAS's OpenMP build
 * then computes each product on one thread) and lets BLAS thread each product otherwise.
 *
 * Backward rules follow ATen's derivatives.yaml: mm_mat1_backward and mm_mat2_backward choose
 * the product order from the input's layout (a column-major input gets a column-major grad),
 * and matmul and linear decompose as ATen's CompositeImplicitAutograd kernels do, so traced
 * graphs read like PyTorch's: linear on 2-d input is t + addmm, and its backward is
 * t, mm, t (weight) then sum + view (bias). */
#include "../core/kernel_util.h"
#include "family.h"
#include "shard_rules.h"
#include "fastmath.h"
#include "fused.h"

#include <cblas.h>
#include <omp.h>

/* ---- GEMM on strided operands ---- */

/* Below this many multiply-adds per matrix, bmm spreads its batch over threads instead of
 * letting BLAS split each (small) product. */
#define BMM_SMALL_MACS (1 << 20)

/* How BLAS reads one operand: the (rows, cols) matrices of a 2-d or 3-d tensor. */
typedef struct blas_mat {
    const char *base; /* element [0, 0] of the first matrix */
    int64_t bstride;  /* elements between consecutive matrices of a batch */
    CBLAS_TRANSPOSE tr;
    int64_t ld;
    ag__scratch_tensor copy; /* contiguous temporary when the layout needed one */
} blas_mat;

/* Whether a (rows, cols) matrix with strides (s0, s1) is a BLAS matrix: row-major with
 * leading dimension ld (NoTrans), or column-major, i.e. the transpose of a row-major matrix
 * (Trans). Strides of size-1 dims do not matter, as in ATen's checks. */
static bool blas_layout(int64_t rows, int64_t cols, int64_t s0, int64_t s1, CBLAS_TRANSPOSE *tr,
                        int64_t *ld) {
    int64_t rmin = rows > 1 ? rows : 1, cmin = cols > 1 ? cols : 1;
    if ((s1 == 1 || cols <= 1) && (rows <= 1 || s0 >= cmin)) {
        *tr = CblasNoTrans;
        *ld = rows <= 1 ? cmin : s0;
        return true;
    }
    if ((s0 == 1 || rows <= 1) && (cols <= 1 || s1 >= rmin)) {
        *tr = CblasTrans;
        *ld = cols <= 1 ? rmin : s1;
        return true;
    }
    return false;
}

/* Describes t for BLAS; a layout BLAS cannot read is copied into per-thread scratch slot
 * `slot` (0 for the left operand, 1 for the right; nothing to free). */
static int blas_mat_prepare(const ag_tensor *t, blas_mat *m, int slot) {
    int nd = t->ndim;
    int64_t rows = t->sizes[nd - 2], cols = t->sizes[nd - 1];
    if (!blas_layout(rows, cols, t->strides[nd - 2], t->strides[nd - 1], &m->tr, &m->ld)) {
        ag_tensor *c = ag__scratch_tensor_new(&m->copy, slot, t->dtype, nd, t->sizes);
        if (!c)
            return AG_ENOMEM;
        int rc = ag__copy_into(c, t);
        if (rc)
            return rc;
        t = c;
        m->tr = CblasNoTrans;
        m->ld = cols > 1 ? cols : 1;
    }
    m->base = ag__base(t);
    m->bstride = nd == 3 ? t->strides[0] : 0;
    return 0;
}

/* c (n, m), row-major with leading dimension ldc = alpha * op(a) @ op(b) + beta * c. */
static void gemm(ag_dtype dt, CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int64_t n, int64_t m,
                 int64_t k, double alpha, const void *a, int64_t lda, const void *b, int64_t ldb,
                 double beta, void *c, int64_t ldc) {
    if (dt == AG_F32)
        cblas_sgemm(CblasRowMajor, ta, tb, (blasint)n, (blasint)m, (blasint)k, (float)alpha, a,
                    (blasint)lda, b, (blasint)ldb, (float)beta, c, (blasint)ldc);
    else
        cblas_dgemm(CblasRowMajor, ta, tb, (blasint)n, (blasint)m, (blasint)k, alpha, a,
                    (blasint)lda, b, (blasint)ldb, beta, c, (blasint)ldc);
}

/* out = alpha * x @ y + beta * out, for x (n, k) / (B, n, k), y (k, m) / (B, k, m) and a fresh
 * contiguous out (n, m) / (B, n, m). With beta == 0 out's contents are ignored. */
static int gemm_tensors(const ag_tensor *x, const ag_tensor *y, ag_tensor *out, double alpha,
                        double beta) {
    int nd = out->ndim;
    int64_t batch = nd == 3 ? out->sizes[0] : 1;
    int64_t n = out->sizes[nd - 2], m = out->sizes[nd - 1], k = x->sizes[nd - 1];
    ag_dtype dt = out->dtype;
    if (batch == 0 || n == 0 || m == 0)
        return 0;
    if (k == 0) {
        /* An empty sum: out = beta * out (BLAS implementations disagree on k == 0). */
        int64_t ne = batch * n * m;
        AG__FLOAT_SWITCH(dt, T, {
            T *o = (T *)ag__base(out);
            for (int64_t i = 0; i < ne; i++)
                o[i] = beta == 0 ? (T)0 : (T)(beta * o[i]);
        });
        return 0;
    }
    blas_mat a, b;
    int rc = blas_mat_prepare(x, &a, 0);
    if (rc)
        return rc;
    rc = blas_mat_prepare(y, &b, 1);
    if (rc)
        return rc;
    size_t es = ag_dtype_size(dt);
    char *c = ag__base(out);
    bool par = batch > 1 && n * m * k <= BMM_SMALL_MACS && omp_get_max_threads() > 1;
    AG__BLAS_FOR(par, "omp parallel for schedule(static)", i, batch,
                 gemm(dt, a.tr, b.tr, n, m, k, alpha, a.base + (size_t)(i * a.bstride) * es, a.ld,
                      b.base + (size_t)(i * b.bstride) * es, b.ld, beta,
                      c + (size_t)(i * n * m) * es, m););
    return 0;
}

/* ---- shared checks ---- */

static int same_dtype(const char *op, const ag_tensor *a, const ag_tensor *b) {
    if (a->dtype != b->dtype)
        return ag__err(AG_EINVAL,
                       "%s: expected both operands to have the same dtype, got %s and %s", op,
                       ag_dtype_short(a->dtype), ag_dtype_short(b->dtype));
    return 0;
}

static int size_mismatch(const char *op, const ag_tensor *a, const ag_tensor *b) {
    char x[128], y[128];
    return ag__err(AG_EINVAL, "%s: size mismatch: %s @ %s", op,
                   ag__fmt_sizes(x, sizeof x, a->ndim, a->sizes),
                   ag__fmt_sizes(y, sizeof y, b->ndim, b->sizes));
}

static int expect_ndim(const char *op, const char *what, const ag_tensor *t, int nd) {
    if (t->ndim == nd)
        return 0;
    char s[128];
    return ag__err(AG_EINVAL, "%s: %s must be a %d-d tensor, got %s", op, what, nd,
                   ag__fmt_sizes(s, sizeof s, t->ndim, t->sizes));
}

/* flops 2*B*n*k*m; bytes of both operands and the result. */
static void gemm_cost(const ag_tmeta *out, int64_t k, ag_cost *c) {
    int nd = out->ndim;
    double batch = nd == 3 ? (double)out->sizes[0] : 1.0;
    double n = (double)out->sizes[nd - 2], m = (double)out->sizes[nd - 1], kk = (double)k;
    double es = (double)ag_dtype_size(out->dtype);
    c->flops = 2.0 * batch * n * kk * m;
    c->bytes = batch * (n * kk + kk * m + n * m) * es;
}

/* ---- backward helpers (ATen's mm_mat1_backward / mm_mat2_backward) ---- */

static bool column_major(const ag_tensor *t) {
    return t->strides[0] == 1 && t->strides[1] == t->sizes[0];
}

static ag_tensor *maybe_multiply(ag_tensor *t, double s) {
    return s == 1.0 ? t : ag_mul_scalar(t, s);
}

/* grad of mat1 in mat1 @ mat2: grad @ mat2^T, or (mat2 @ grad^T)^T when mat1 was column-major
 * (the grad then comes out column-major too). */
static ag_tensor *mm_mat1_backward(ag_tensor *grad, ag_tensor *mat2, const ag_tensor *mat1,
                                   double alpha) {
    if (column_major(mat1))
        return maybe_multiply(ag_t(ag_mm(mat2, ag_t(grad))), alpha);
    return maybe_multiply(ag_mm(grad, ag_t(mat2)), alpha);
}

/* grad of mat2: mat1^T @ grad, or (grad^T @ mat1)^T when mat2 was column-major (as linear's
 * t(weight) is, which makes the weight's grad a plain mm of contiguous operands). */
static ag_tensor *mm_mat2_backward(ag_tensor *grad, ag_tensor *mat1, const ag_tensor *mat2,
                                   double alpha) {
    if (column_major(mat2))
        return maybe_multiply(ag_t(ag_mm(ag_t(grad), mat1)), alpha);
    return maybe_multiply(ag_mm(ag_t(mat1), grad), alpha);
}

/* ---- mm(Tensor self, Tensor mat2): self (n, k) @ mat2 (k, m) -> (n, m) ---- */

static int mm_meta(const ag_arg *a, ag_tmeta *o) {
    const ag_tensor *x = a[0].u.t, *y = a[1].u.t;
    int rc = expect_ndim("mm", "self", x, 2);
    if (!rc)
        rc = expect_ndim("mm", "mat2", y, 2);
    if (!rc)
        rc = same_dtype("mm", x, y);
    if (rc)
        return rc;
    if (x->sizes[1] != y->sizes[0])
        return size_mismatch("mm", x, y);
    ag__tmeta_contiguous(o, x->dtype, 2, (int64_t[]){x->sizes[0], y->sizes[1]});
    return 0;
}

static int mm_kernel(const ag_arg *a, ag_tensor **o) {
    return gemm_tensors(a[0].u.t, a[1].u.t, o[0], 1.0, 0.0);
}

static int mm_backward(ag_bwctx *c) {
    ag_tensor *g = c->grad_outputs[0], *self = c->args[0].u.t, *mat2 = c->args[1].u.t;
    if (c->needs_grad[0])
        c->grad_inputs[0] = mm_mat1_backward(g, mat2, self, 1.0);
    if (c->needs_grad[1])
        c->grad_inputs[1] = mm_mat2_backward(g, self, mat2, 1.0);
    return 0;
}

static void mm_cost(const ag_arg *a, const ag_tmeta *o, int n, ag_cost *c) {
    gemm_cost(&o[0], a[0].u.t->sizes[1], c);
}

static void mm_samples(ag_samples *s) {
    int64_t a[] = {3, 4}, b[] = {4, 5};
    ag_samples_add(s, "plain",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, a, -1, 1)),
                              AG_A_T(ag_samples_rand(s, 2, b, -1, 1))},
                   2);
    ag_samples_add(s, "transposed operands",
                   (ag_arg[]){AG_A_T(ag_samples_rand_strided(s, 2, a, -1, 1)),
                              AG_A_T(ag_samples_rand_strided(s, 2, b, -1, 1))},
                   2);
}

static const ag_opdef op_mm = {
    .schema = "mm(Tensor self, Tensor mat2) -> Tensor",
    .flags = AG_OP_COMPUTE_INTENSIVE,
    .meta = mm_meta,
    .kernel = mm_kernel,
    .dtypes = AG_DT_FLOAT,
    .backward = mm_backward,
    .save_args = 0x3,
    .cost = mm_cost,
    .samples = mm_samples,
    .shard = ag__shard_mm,
};

ag_tensor *ag_mm(ag_tensor *a, ag_tensor *b) {
    AG__OP(op, "mm");
    return ag__call1(op, (ag_arg[]){AG_A_T(a), AG_A_T(b)}, 2);
}

/* ---- bmm(Tensor self, Tensor mat2): (B, n, k) @ (B, k, m) -> (B, n, m) ---- */

static int bmm_meta(const ag_arg *a, ag_tmeta *o) {
    const ag_tensor *x = a[0].u.t, *y = a[1].u.t;
    int rc = expect_ndim("bmm", "self", x, 3);
    if (!rc)
        rc = expect_ndim("bmm", "mat2", y, 3);
    if (!rc)
        rc = same_dtype("bmm", x, y);
    if (rc)
        return rc;
    if (x->sizes[0] != y->sizes[0]) {
        char p[128], q[128];
        return ag__err(AG_EINVAL, "bmm: batch sizes differ: %s @ %s",
                       ag__fmt_sizes(p, sizeof p, x->ndim, x->sizes),
                       ag__fmt_sizes(q, sizeof q, y->ndim, y->sizes));
    }
    if (x->sizes[2] != y->sizes[1])
        return size_mismatch("bmm", x, y);
    ag__tmeta_contiguous(o, x->dtype, 3, (int64_t[]){x->sizes[0], x->sizes[1], y->sizes[2]});
    return 0;
}

static int bmm_kernel(const ag_arg *a, ag_tensor **o) {
    return gemm_tensors(a[0].u.t, a[1].u.t, o[0], 1.0, 0.0);
}

static int bmm_backward(ag_bwctx *c) {
    ag_tensor *g = c->grad_outputs[0], *self = c->args[0].u.t, *mat2 = c->args[1].u.t;
    if (c->needs_grad[0])
        c->grad_inputs[0] = ag_bmm(g, ag_transpose(mat2, 1, 2));
    if (c->needs_grad[1])
        c->grad_inputs[1] = ag_bmm(ag_transpose(self, 1, 2), g);
    return 0;
}

static void bmm_cost(const ag_arg *a, const ag_tmeta *o, int n, ag_cost *c) {
    gemm_cost(&o[0], a[0].u.t->sizes[2], c);
}

static void bmm_samples(ag_samples *s) {
    int64_t a[] = {2, 3, 4}, b[] = {2, 4, 5};
    ag_samples_add(s, "plain",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 3, a, -1, 1)),
                              AG_A_T(ag_samples_rand(s, 3, b, -1, 1))},
                   2);
    ag_samples_add(s, "transposed operands",
                   (ag_arg[]){AG_A_T(ag_samples_rand_strided(s, 3, a, -1, 1)),
                              AG_A_T(ag_samples_rand(s, 3, b, -1, 1))},
                   2);
}

static const ag_opdef op_bmm = {
    .schema = "bmm(Tensor self, Tensor mat2) -> Tensor",
    .flags = AG_OP_COMPUTE_INTENSIVE,
    .meta = bmm_meta,
    .kernel = bmm_kernel,
    .dtypes = AG_DT_FLOAT,
    .backward = bmm_backward,
    .save_args = 0x3,
    .cost = bmm_cost,
    .samples = bmm_samples,
    .shard = ag__shard_mm,
};

ag_tensor *ag_bmm(ag_tensor *a, ag_tensor *b) {
    AG__OP(op, "bmm");
    return ag__call1(op, (ag_arg[]){AG_A_T(a), AG_A_T(b)}, 2);
}

/* ---- addmm: beta * self + alpha * (mat1 (n, k) @ mat2 (k, m)); self broadcasts to (n, m) ---- */

static int addmm_meta(const ag_arg *a, ag_tmeta *o) {
    const ag_tensor *self = a[0].u.t, *x = a[1].u.t, *y = a[2].u.t;
    int rc = expect_ndim("addmm", "mat1", x, 2);
    if (!rc)
        rc = expect_ndim("addmm", "mat2", y, 2);
    if (!rc)
        rc = same_dtype("addmm", x, y);
    if (!rc)
        rc = same_dtype("addmm", self, x);
    if (rc)
        return rc;
    if (x->sizes[1] != y->sizes[0])
        return size_mismatch("addmm", x, y);
    int64_t nm[2] = {x->sizes[0], y->sizes[1]};
    bool ok = self->ndim <= 2;
    for (int d = 0; ok && d < self->ndim; d++) {
        int64_t sz = self->sizes[self->ndim - 1 - d];
        ok = sz == 1 || sz == nm[1 - d];
    }
    if (!ok) {
        char p[128], q[128];
        return ag__err(AG_EINVAL,
                       "addmm: self of shape %s cannot be broadcast to the product's "
                       "shape %s",
                       ag__fmt_sizes(p, sizeof p, self->ndim, self->sizes),
                       ag__fmt_sizes(q, sizeof q, 2, nm));
    }
    ag__tmeta_contiguous(o, x->dtype, 2, nm);
    return 0;
}

static int addmm_kernel(const ag_arg *a, ag_tensor **o) {
    double beta = a[3].u.f, alpha = a[4].u.f;
    /* As in ATen, beta == 0 ignores self entirely (NaN/inf in it do not propagate). */
    if (beta != 0) {
        int rc = ag__copy_into(o[0], a[0].u.t);
        if (rc)
            return rc;
    }
    return gemm_tensors(a[1].u.t, a[2].u.t, o[0], alpha, beta);
}

int ag__fused_addmm_gelu(ag_tensor *self, ag_tensor *mat1, ag_tensor *mat2, double beta,
                         double alpha, ag_tensor *out, ag_tensor *y, bool tanh) {
    if (out->dtype != AG_F32 || y->dtype != AG_F32 || out->ndim != 2 || y->ndim != 2 ||
        !ag_tensor_is_contiguous(out) || !ag_tensor_is_contiguous(y) ||
        y->sizes[0] != out->sizes[0] || y->sizes[1] != out->sizes[1])
        return 1;
    /* The addmm kernel's steps: self into out, then the product accumulated onto it. */
    int rc = beta != 0 ? ag__copy_into(out, self) : 0;
    if (rc == 0)
        rc = gemm_tensors(mat1, mat2, out, alpha, beta);
    if (rc)
        return rc;
    /* gelu, as its kernel computes it (lane by lane), over rows in parallel. The product is
     * not split into panels activated while in cache: measured on GPT-2's MLP (256 and 4096
     * rows), BLAS's repacking per panel cost more than the pass over the output saves. */
    const int64_t n = out->sizes[0], m = out->sizes[1];
    const float *c = (const float *)ag__base(out);
    float *yo = (float *)ag__base(y);
    const bool par = n > 1 && n * m >= AG__PAR_MIN;
#pragma omp parallel for schedule(static) if (par)
    for (int64_t r = 0; r < n; r++)
        for (int64_t i = 0; i < m; i += AG__VW) {
            const int64_t nv = m - i < AG__VW ? m - i : AG__VW;
            ag__vf v = ag__vload(c + r * m + i, 1, nv);
            ag__vstore(yo + r * m + i, 1, nv, tanh ? ag__vgelu_tanh(v) : ag__vgelu(v));
        }
    return 0;
}

static int addmm_backward(ag_bwctx *c) {
    ag_tensor *g = c->grad_outputs[0], *mat1 = c->args[1].u.t, *mat2 = c->args[2].u.t;
    double beta = c->args[3].u.f, alpha = c->args[4].u.f;
    /* self's grad keeps the product's shape; the engine reduces it to self's (sum_to). */
    if (c->needs_grad[0])
        c->grad_inputs[0] = maybe_multiply(g, beta);
    if (c->needs_grad[1])
        c->grad_inputs[1] = mm_mat1_backward(g, mat2, mat1, alpha);
    if (c->needs_grad[2])
        c->grad_inputs[2] = mm_mat2_backward(g, mat1, mat2, alpha);
    return 0;
}

static void addmm_cost(const ag_arg *a, const ag_tmeta *o, int n, ag_cost *c) {
    gemm_cost(&o[0], a[1].u.t->sizes[1], c);
    double nm = (double)(o[0].sizes[0] * o[0].sizes[1]);
    c->flops += 2.0 * nm;
    c->bytes += (double)ag_tensor_numel(a[0].u.t) * (double)ag_dtype_size(o[0].dtype);
}

static void addmm_samples(ag_samples *s) {
    int64_t b[] = {5}, b2[] = {3, 1}, x[] = {3, 4}, y[] = {4, 5};
    ag_samples_add(s, "bias row",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 1, b, -1, 1)),
                              AG_A_T(ag_samples_rand(s, 2, x, -1, 1)),
                              AG_A_T(ag_samples_rand(s, 2, y, -1, 1))},
                   3);
    ag_samples_add(s, "beta alpha, column self",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, b2, -1, 1)),
                              AG_A_T(ag_samples_rand(s, 2, x, -1, 1)),
                              AG_A_T(ag_samples_rand(s, 2, y, -1, 1)), AG_A_F(0.5), AG_A_F(2.0)},
                   5);
    ag_samples_add(s, "transposed operands",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 1, b, -1, 1)),
                              AG_A_T(ag_samples_rand_strided(s, 2, x, -1, 1)),
                              AG_A_T(ag_samples_rand_strided(s, 2, y, -1, 1)), AG_A_F(1.0),
                              AG_A_F(-1.5)},
                   5);
}

/* Core decomposition (torch._decomp's addmm): alpha * mm(mat1, mat2), plus beta * self unless
 * beta is 0 (then self is ignored, NaNs included). */
static int addmm_decomp(const ag_arg *a, ag_tensor **o) {
    ag_tensor *out = ag_mul_scalar(ag_mm(a[1].u.t, a[2].u.t), a[4].u.f);
    o[0] = a[3].u.f == 0.0 ? out : ag_add(ag_mul_scalar(a[0].u.t, a[3].u.f), out);
    return o[0] ? 0 : ag_last_status();
}

static const ag_opdef op_addmm = {
    .decomp = addmm_decomp,
    .schema = "addmm(Tensor self, Tensor mat1, Tensor mat2, *, Scalar beta=1, Scalar alpha=1) "
              "-> Tensor",
    .flags = AG_OP_COMPUTE_INTENSIVE,
    .meta = addmm_meta,
    .kernel = addmm_kernel,
    .dtypes = AG_DT_FLOAT,
    .backward = addmm_backward,
    .save_args = 0x6,
    .cost = addmm_cost,
    .samples = addmm_samples,
    .shard = ag__shard_addmm,
};

ag_tensor *ag_addmm(ag_tensor *self, ag_tensor *mat1, ag_tensor *mat2, double beta, double alpha) {
    AG__OP(op, "addmm");
    return ag__call1(
        op, (ag_arg[]){AG_A_T(self), AG_A_T(mat1), AG_A_T(mat2), AG_A_F(beta), AG_A_F(alpha)}, 5);
}

/* ---- matmul (composite): ATen's _matmul_impl ---- */

/* Result shape of t1 @ t2 with numpy semantics: 1-d operands get a dim added (then removed),
 * batch dims broadcast. */
static int matmul_shape(const ag_tensor *t1, const ag_tensor *t2, ag_tmeta *o) {
    int d1 = t1->ndim, d2 = t2->ndim;
    if (d1 == 0 || d2 == 0)
        return ag__err(AG_EINVAL,
                       "matmul: both arguments to matmul need to be at least 1D, but "
                       "they are %dD and %dD",
                       d1, d2);
    int rc = same_dtype("matmul", t1, t2);
    if (rc)
        return rc;
    int64_t k1 = t1->sizes[d1 - 1], k2 = d2 == 1 ? t2->sizes[0] : t2->sizes[d2 - 2];
    if (k1 != k2)
        return size_mismatch("matmul", t1, t2);
    int64_t sizes[AG_MAX_DIMS + 2];
    int nb;
    rc = ag__broadcast("matmul", d1 > 2 ? d1 - 2 : 0, t1->sizes, d2 > 2 ? d2 - 2 : 0, t2->sizes,
                       &nb, sizes);
    if (rc)
        return rc;
    if (d1 > 1)
        sizes[nb++] = t1->sizes[d1 - 2];
    if (d2 > 1)
        sizes[nb++] = t2->sizes[d2 - 1];
    ag__tmeta_contiguous(o, t1->dtype, nb, sizes);
    return 0;
}

static int matmul_meta(const ag_arg *a, ag_tmeta *o) {
    return matmul_shape(a[0].u.t, a[1].u.t, o);
}

/* ATen's should_fold: a >= 3-d operand times a 1-d/2-d one runs as one mm over the folded
 * batch when that needs no copy of the big operand, or when the small operand requires grad
 * (so its grad is one mm instead of a batch of products summed afterwards). */
static bool should_fold(const ag_tensor *t1, const ag_tensor *t2) {
    bool t1_larger = t1->ndim >= t2->ndim;
    const ag_tensor *big = t1_larger ? t1 : t2;
    int dim_big = big->ndim, dim_small = t1_larger ? t2->ndim : t1->ndim;
    if (!(dim_big >= 3 && dim_small <= 2))
        return false;
    if ((t1_larger ? t2 : t1)->requires_grad)
        return true;
    if (t1->ndim == 2)
        return false;
    if (ag__numel(big->ndim, big->sizes) == 0)
        return true;
    /* The big operand as ATen sees it: t1, or t2.mT (last two dims swapped). */
    int64_t sz[AG_MAX_DIMS], st[AG_MAX_DIMS];
    memcpy(sz, big->sizes, sizeof(int64_t) * (size_t)dim_big);
    memcpy(st, big->strides, sizeof(int64_t) * (size_t)dim_big);
    if (!t1_larger) {
        sz[dim_big - 1] = big->sizes[dim_big - 2];
        sz[dim_big - 2] = big->sizes[dim_big - 1];
        st[dim_big - 1] = big->strides[dim_big - 2];
        st[dim_big - 2] = big->strides[dim_big - 1];
    }
    for (int i = 0; i < dim_big - 2; i++)
        if (st[i] != st[i + 1] * sz[i + 1])
            return false;
    return true;
}

/* Folds the batch of the >= 3-d operand into mm's rows (ATen uses mv for a vector right-hand
 * side; here it is mm with an unsqueezed vector, then a view). */
static ag_tensor *matmul_folded(ag_tensor *t1, ag_tensor *t2) {
    bool transpose = t2->ndim > t1->ndim;
    ag_tensor *f1 = transpose ? ag_transpose(t2, -2, -1) : t1;
    ag_tensor *f2 = !transpose ? t2 : t1->ndim == 2 ? ag_t(t1) : t1;
    if (!f1 || !f2)
        return NULL;
    int n1 = f1->ndim;
    int64_t oshape[AG_MAX_DIMS];
    int no = n1 - 1;
    int64_t folded = 1;
    for (int d = 0; d < no; d++) {
        oshape[d] = f1->sizes[d];
        folded *= f1->sizes[d];
    }
    bool f2_matrix = f2->ndim == 2;
    if (f2_matrix)
        oshape[no++] = f2->sizes[1];
    ag_tensor *flat = ag_reshape(f1, 2, (int64_t[]){folded, f1->sizes[n1 - 1]});
    if (f2_matrix) {
        ag_tensor *out = ag_view(ag_mm(flat, f2), no, oshape);
        return transpose ? ag_contiguous(ag_transpose(out, -2, -1)) : out;
    }
    return ag_view(ag_mm(flat, ag_unsqueeze(f2, 1)), no, oshape);
}

/* Expands both operands to the broadcast batch, flattens it, and runs bmm. */
static ag_tensor *matmul_batched(ag_tensor *t1, ag_tensor *t2) {
    int d1 = t1->ndim, d2 = t2->ndim;
    int64_t n = d1 > 1 ? t1->sizes[d1 - 2] : 1, m1 = t1->sizes[d1 - 1];
    int64_t m2 = d2 > 1 ? t2->sizes[d2 - 2] : t2->sizes[0], p = d2 > 1 ? t2->sizes[d2 - 1] : 1;
    int64_t shape[AG_MAX_DIMS + 2];
    int nb;
    if (ag__broadcast("matmul", d1 > 2 ? d1 - 2 : 0, t1->sizes, d2 > 2 ? d2 - 2 : 0, t2->sizes, &nb,
                      shape))
        return NULL;
    int64_t batch = ag__numel(nb, shape);
    int64_t e1[AG_MAX_DIMS + 2], e2[AG_MAX_DIMS + 2];
    memcpy(e1, shape, sizeof(int64_t) * (size_t)nb);
    memcpy(e2, shape, sizeof(int64_t) * (size_t)nb);
    e1[nb] = n;
    e1[nb + 1] = m1;
    ag_tensor *x1 = ag_reshape(ag_expand(t1, nb + 2, e1), 3, (int64_t[]){batch, n, m1});
    bool vector_rhs = d2 == 1;
    ag_tensor *x2;
    if (vector_rhs) {
        e2[nb] = m2;
        x2 = ag_unsqueeze(ag_reshape(ag_expand(t2, nb + 1, e2), 2, (int64_t[]){batch, m2}), 2);
    } else {
        e2[nb] = m2;
        e2[nb + 1] = p;
        x2 = ag_reshape(ag_expand(t2, nb + 2, e2), 3, (int64_t[]){batch, m2, p});
    }
    int no = nb;
    if (d1 > 1)
        shape[no++] = n;
    if (d2 > 1)
        shape[no++] = p;
    ag_tensor *r = ag_bmm(x1, x2);
    if (vector_rhs)
        r = ag_squeeze(r, -1);
    return ag_view(r, no, shape);
}

/* ATen's _matmul_impl on validated operands. */
static ag_tensor *matmul_impl(ag_tensor *t1, ag_tensor *t2) {
    if (!t1 || !t2)
        return NULL;
    int d1 = t1->ndim, d2 = t2->ndim;
    /* ATen uses dot and mv for the first two cases; they run as mm here. */
    if (d1 == 1 && d2 == 1) {
        /* t1 is unsqueezed before t2 on every compiler */
        ag_tensor *row = ag_unsqueeze(t1, 0);
        return ag_squeeze_all(ag_mm(row, ag_unsqueeze(t2, 1)));
    }
    if (d1 == 2 && d2 == 1)
        return ag_squeeze(ag_mm(t1, ag_unsqueeze(t2, 1)), 1);
    if (d1 == 1 && d2 == 2)
        return ag_squeeze(ag_mm(ag_unsqueeze(t1, 0), t2), 0);
    if (d1 == 2 && d2 == 2)
        return ag_mm(t1, t2);
    if (should_fold(t1, t2))
        return matmul_folded(t1, t2);
    /* A 3-d operand broadcast along a batch of 1 that requires grad is squeezed, so it goes
     * through the folded path (its grad is then one mm, not a batch summed afterwards). */
    if (d1 == 3 && d2 == 3 && t1->sizes[0] != t2->sizes[0]) {
        if (t1->sizes[0] == 1 && t1->requires_grad)
            return matmul_impl(ag_squeeze(t1, 0), t2);
        if (t2->sizes[0] == 1 && t2->requires_grad)
            return matmul_impl(t1, ag_squeeze(t2, 0));
    }
    return matmul_batched(t1, t2);
}

static int matmul_decomp(const ag_arg *a, ag_tensor **outs) {
    ag_tmeta m;
    int rc = matmul_shape(a[0].u.t, a[1].u.t, &m);
    if (rc)
        return rc;
    ag_tensor *r = matmul_impl(a[0].u.t, a[1].u.t);
    if (!r)
        return ag__has_error() ? ag_last_status() : AG_EINVAL;
    outs[0] = r;
    return 0;
}

static void matmul_samples(ag_samples *s) {
    int64_t v4[] = {4}, m34[] = {3, 4}, m45[] = {4, 5}, b234[] = {2, 3, 4}, b245[] = {2, 4, 5};
    int64_t c2134[] = {2, 1, 3, 4}, c342[] = {3, 4, 2};
    ag_samples_add(s, "1-d @ 1-d",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 1, v4, -1, 1)),
                              AG_A_T(ag_samples_rand(s, 1, v4, -1, 1))},
                   2);
    ag_samples_add(s, "2-d @ 1-d",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, m34, -1, 1)),
                              AG_A_T(ag_samples_rand(s, 1, v4, -1, 1))},
                   2);
    ag_samples_add(s, "1-d @ 2-d",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 1, v4, -1, 1)),
                              AG_A_T(ag_samples_rand(s, 2, m45, -1, 1))},
                   2);
    ag_samples_add(s, "3-d @ 2-d (folded)",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 3, b234, -1, 1)),
                              AG_A_T(ag_samples_rand(s, 2, m45, -1, 1))},
                   2);
    ag_samples_add(s, "2-d @ 3-d (folded, transposed)",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, m34, -1, 1)),
                              AG_A_T(ag_samples_rand(s, 3, b245, -1, 1))},
                   2);
    ag_samples_add(s, "batch broadcast",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 4, c2134, -1, 1)),
                              AG_A_T(ag_samples_rand_strided(s, 3, c342, -1, 1))},
                   2);
    int64_t b134[] = {1, 3, 4};
    ag_samples_add(s, "3-d batch of 1 broadcast (squeezed)",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 3, b134, -1, 1)),
                              AG_A_T(ag_samples_rand(s, 3, b245, -1, 1))},
                   2);
    ag_samples_add(s, "3-d @ 1-d",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 3, b234, -1, 1)),
                              AG_A_T(ag_samples_rand_nograd(s, 1, v4, -1, 1))},
                   2);
}

static const ag_opdef op_matmul = {
    .schema = "matmul(Tensor self, Tensor other) -> Tensor",
    .flags = AG_OP_COMPOSITE,
    .meta = matmul_meta,
    .dtypes = AG_DT_FLOAT,
    .decomp = matmul_decomp,
    .samples = matmul_samples,
};

ag_tensor *ag_matmul(ag_tensor *a, ag_tensor *b) {
    AG__OP(op, "matmul");
    return ag__call1(op, (ag_arg[]){AG_A_T(a), AG_A_T(b)}, 2);
}

/* ---- linear (composite): x (*, in) @ weight (out, in)^T + bias (out) ---- */

static int linear_meta(const ag_arg *a, ag_tmeta *o) {
    const ag_tensor *x = a[0].u.t, *w = a[1].u.t;
    const ag_tensor *b = a[2].kind == AG_ARG_TENSOR ? a[2].u.t : NULL;
    if (x->ndim == 0 || w->ndim == 0)
        return ag__err(AG_EINVAL,
                       "linear: both arguments to linear need to be at least 1D, but "
                       "they are %dD and %dD",
                       x->ndim, w->ndim);
    int rc = same_dtype("linear", x, w);
    if (rc)
        return rc;
    char p[128], q[128];
    if (w->ndim > 2 || x->sizes[x->ndim - 1] != w->sizes[w->ndim - 1])
        return ag__err(AG_EINVAL,
                       "linear: input %s does not match weight %s (expected weight "
                       "(out_features, %lld))",
                       ag__fmt_sizes(p, sizeof p, x->ndim, x->sizes),
                       ag__fmt_sizes(q, sizeof q, w->ndim, w->sizes),
                       (long long)x->sizes[x->ndim - 1]);
    int64_t sizes[AG_MAX_DIMS];
    int n = x->ndim - 1;
    memcpy(sizes, x->sizes, sizeof(int64_t) * (size_t)n);
    if (w->ndim == 2)
        sizes[n++] = w->sizes[0];
    if (b) {
        int nb;
        int64_t bs[AG_MAX_DIMS];
        rc = ag__broadcast("linear", n, sizes, b->ndim, b->sizes, &nb, bs);
        if (rc)
            return rc;
        if (nb != n || memcmp(bs, sizes, sizeof(int64_t) * (size_t)n))
            return ag__err(AG_EINVAL, "linear: bias %s does not broadcast to the output %s",
                           ag__fmt_sizes(p, sizeof p, b->ndim, b->sizes),
                           ag__fmt_sizes(q, sizeof q, n, sizes));
        rc = same_dtype("linear", x, b);
        if (rc)
            return rc;
    }
    ag__tmeta_contiguous(o, x->dtype, n, sizes);
    return 0;
}

/* ATen's linear: 2-d input with bias is addmm(bias, x, t(w)); contiguous 3-d input (or any
 * contiguous input with a 1-d bias) is flattened to 2-d for the same addmm and viewed back
 * (_flatten_nd_linear); everything else is matmul(x, t(w)) + bias. */
static int linear_decomp(const ag_arg *a, ag_tensor **outs) {
    ag_tensor *x = a[0].u.t, *w = a[1].u.t;
    ag_tensor *b = a[2].kind == AG_ARG_TENSOR ? a[2].u.t : NULL;
    ag_tmeta m;
    int rc = linear_meta(a, &m);
    if (rc)
        return rc;
    ag_tensor *r;
    if (x->ndim == 2 && b) {
        r = ag_addmm(b, x, ag_t(w), 1.0, 1.0);
    } else if (b && ag_tensor_is_contiguous(x) && (x->ndim == 3 || b->ndim == 1)) {
        int n = x->ndim - 1;
        int64_t flat = ag__numel(n, x->sizes);
        ag_tensor *x2 = ag_reshape(x, 2, (int64_t[]){flat, x->sizes[n]});
        ag_tensor *y = ag_addmm(b, x2, ag_t(w), 1.0, 1.0);
        if (!y)
            return ag__has_error() ? ag_last_status() : AG_EINVAL;
        int64_t sizes[AG_MAX_DIMS];
        memcpy(sizes, x->sizes, sizeof(int64_t) * (size_t)n);
        sizes[n] = y->sizes[1];
        r = ag_view(y, n + 1, sizes);
    } else {
        r = ag_matmul(x, ag_t(w));
        if (b)
            r = ag_add(r, b);
    }
    if (!r)
        return ag__has_error() ? ag_last_status() : AG_EINVAL;
    outs[0] = r;
    return 0;
}

static void linear_samples(ag_samples *s) {
    int64_t x2[] = {4, 3}, x3[] = {2, 4, 3}, w[] = {5, 3}, b[] = {5}, x1[] = {3};
    ag_samples_add(s, "2-d with bias",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 2, x2, -1, 1)),
                              AG_A_T(ag_samples_rand(s, 2, w, -1, 1)),
                              AG_A_T(ag_samples_rand(s, 1, b, -1, 1))},
                   3);
    ag_samples_add(s, "3-d with bias",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 3, x3, -1, 1)),
                              AG_A_T(ag_samples_rand(s, 2, w, -1, 1)),
                              AG_A_T(ag_samples_rand(s, 1, b, -1, 1))},
                   3);
    ag_samples_add(s, "3-d strided, no bias",
                   (ag_arg[]){AG_A_T(ag_samples_rand_strided(s, 3, x3, -1, 1)),
                              AG_A_T(ag_samples_rand(s, 2, w, -1, 1)), AG_A_NONE},
                   3);
    ag_samples_add(s, "1-d, no bias",
                   (ag_arg[]){AG_A_T(ag_samples_rand(s, 1, x1, -1, 1)),
                              AG_A_T(ag_samples_rand(s, 2, w, -1, 1))},
                   2);
}

static const ag_opdef op_linear = {
    .schema = "linear(Tensor input, Tensor weight, Tensor? bias=None) -> Tensor",
    .flags = AG_OP_COMPOSITE,
    .meta = linear_meta,
    .dtypes = AG_DT_FLOAT,
    .decomp = linear_decomp,
    .samples = linear_samples,
};

ag_tensor *ag_linear(ag_tensor *x, ag_tensor *w, ag_tensor *b) {
    AG__OP(op, "linear");
    return ag__call1(op, (ag_arg[]){AG_A_T(x), AG_A_T(w), AG_A_T(b)}, 3);
}

const ag_opdef *const ag__ops_linalg[] = {
    &op_mm, &op_bmm, &op_addmm, &op_matmul, &op_linear, NULL,
};
