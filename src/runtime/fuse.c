/* Fusion of elementwise chains for the executor: which chains of consecutive kernel calls run
 * as one fused kernel (src/ops/fused.h), and the glue from the members' bound arguments to
 * that kernel. See fuse.h for how plan.c uses it.
 *
 * The groups, each bit-identical to its members run one by one:
 *   addmm+gelu                     the MLP's bias + activation (one step; the product is not
 *                                  split to activate it while in cache, which measured slower);
 *   add+layer_norm                 the residual add and the next layer norm, one pass per row
 *   clone+add+layer_norm           (the clone is the p=0 dropout before the residual add; its
 *                                  copy is skipped when the add is its only reader);
 *   layer_norm_backward+add        the input gradient of a layer norm added to the residual
 *                                  gradient in the same row pass;
 *   nll_loss_backward+log_softmax_backward
 *                                  cross-entropy's backward without the dense one-hot
 *                                  gradient in between (written only when something else
 *                                  reads it);
 *   batch_norm+relu                a training batch norm
 *                                  (_native_batch_norm_legit_functional) writing relu of its
 *                                  output directly (the output itself only when something
 *                                  else reads it): the conv+bn+relu blocks of CNNs;
 *   threshold_backward+batch_norm_backward
 *                                  relu's backward computed inside the batch norm backward's
 *                                  passes, the thresholded gradient never written (fused only
 *                                  when the batch norm backward is its one reader).
 *
 * Matching looks at the graph (ops, which value feeds which, through views and getitems, and
 * who else reads an intermediate). What depends on a run (layouts, and where the memory plan
 * put each buffer) is checked by the glue each time, and a group declines (1) when its fused
 * kernel would read memory that an earlier member's output was placed over: the memory plan
 * lets a buffer that dies at one member be reused by a later member's output, which is right
 * for one-by-one execution but not for a row-by-row one. */
#include "fuse.h"

#include "../ops/fused.h"

#include <stdlib.h>

enum {
    FUSE_SKIP_FIRST = 1, /* the first member's output is read only inside the group: not written */
};

/* ---- matching on the graph ---- */

static bool is_op(const ag_node *n, const char *name) {
    return n && ag_node_kind_of(n) == AG_NODE_CALL && !strcmp(ag_op_name(ag_node_op(n)), name);
}

/* The value a node argument stands for: through view ops to their base, and through getitem
 * to (multi-output call, index). */
static ag_node *value_of(ag_node *n, int *k) {
    *k = 0;
    while (n) {
        if (ag_node_kind_of(n) == AG_NODE_GETITEM) {
            const ag_garg *i = ag_node_arg(n, 1);
            *k = i && i->kind == AG_GA_INT ? (int)i->u.i : 0;
            return ag_node_arg_node(n, 0);
        }
        if (ag_node_kind_of(n) == AG_NODE_CALL && (ag_op_def(ag_node_op(n))->flags & AG_OP_VIEW))
            n = ag_node_arg_node(n, 0);
        else
            return n;
    }
    return NULL;
}

/* Whether argument i of user reads output k of producer (through views and getitem). */
static bool reads(const ag_node *user, int i, const ag_node *producer, int k) {
    int kk;
    ag_node *a = ag_node_arg_node(user, i);
    return a && value_of(a, &kk) == producer && kk == k;
}

/* Whether n's value is read only by `only` (directly or through views that only it reads). */
static bool only_reader(const ag_node *n, const ag_node *only) {
    for (int u = 0; u < ag_node_num_users(n); u++) {
        ag_node *x = ag_node_user(n, u);
        if (x == only)
            continue;
        if (ag_node_kind_of(x) == AG_NODE_CALL && (ag_op_def(ag_node_op(x))->flags & AG_OP_VIEW) &&
            only_reader(x, only))
            continue;
        return false;
    }
    return true;
}

/* ---- run-time checks ---- */

/* The bytes a tensor's elements span: [lo, hi). */
static void span_of(const ag_tensor *t, uintptr_t *lo, uintptr_t *hi) {
    int64_t first = t->offset, last = t->offset;
    for (int d = 0; d < t->ndim; d++) {
        if (t->sizes[d] == 0) {
            *lo = *hi = 0;
            return;
        }
        int64_t e = (t->sizes[d] - 1) * t->strides[d];
        if (e < 0)
            first += e;
        else
            last += e;
    }
    size_t es = ag_dtype_size(t->dtype);
    uintptr_t base = (uintptr_t)t->storage->data;
    *lo = base + (uintptr_t)first * es;
    *hi = base + (uintptr_t)(last + 1) * es;
}

static bool overlap(const ag_tensor *a, const ag_tensor *b) {
    if (!a || !b)
        return false;
    uintptr_t al, ah, bl, bh;
    span_of(a, &al, &ah);
    span_of(b, &bl, &bh);
    return al < bh && bl < ah;
}

/* Whether any of the outs overlaps any of the ins (NULLs ignored). */
static bool any_overlap(ag_tensor *const *outs, int no, ag_tensor *const *ins, int ni) {
    for (int i = 0; i < no; i++)
        for (int j = 0; j < ni; j++)
            if (overlap(outs[i], ins[j]))
                return true;
    return false;
}

static bool contig(const ag_tensor *t) {
    return !t || ag_tensor_is_contiguous(t);
}

/* Same first element and element count, both contiguous: one is a reshape of the other. */
static bool same_data(const ag_tensor *a, const ag_tensor *b) {
    return a && b && ag__base(a) == ag__base(b) && ag_tensor_numel(a) == ag_tensor_numel(b) &&
           contig(a) && contig(b) && a->dtype == b->dtype;
}

static ag_tensor *opt_t(const ag_arg *a) {
    return a->kind == AG_ARG_TENSOR ? a->u.t : NULL;
}

/* ---- addmm + gelu ---- */

static int run_addmm_gelu(const ag__fuse_member *m, uint32_t flags) {
    (void)flags;
    const ag_arg *a = m[0].args, *g = m[1].args;
    ag_tensor *out = m[0].outs[0], *y = m[1].outs[0];
    if (!same_data(g[0].u.t, out) || !contig(y) || ag_tensor_numel(y) != ag_tensor_numel(out))
        return 1;
    /* The product reads its operands while earlier panels' activations are written. */
    ag_tensor *ins[3] = {a[0].u.t, a[1].u.t, a[2].u.t};
    if ((ag__base(y) != ag__base(out) && overlap(y, out)) || any_overlap(&y, 1, ins, 3))
        return 1;
    const char *approx = g[1].kind == AG_ARG_STR ? g[1].u.s : "none";
    ag_tensor y2 = *y; /* y as (n, m), like out */
    y2.ndim = 2;
    y2.sizes[0] = out->sizes[0];
    y2.sizes[1] = out->sizes[1];
    y2.strides[0] = out->sizes[1];
    y2.strides[1] = 1;
    return ag__fused_addmm_gelu(a[0].u.t, a[1].u.t, a[2].u.t, a[3].u.f, a[4].u.f, out, &y2,
                                !strcmp(approx, "tanh"));
}

static const ag__fusion addmm_gelu = {"addmm+gelu", "fused:addmm+gelu", 2, run_addmm_gelu, false};

/* ---- (clone +) add + native_layer_norm ---- */

/* Layer norm of x over its last dims (normalized_shape ns): rows M, row length N. */
static bool ln_rows(const ag_tensor *x, const ag_arg *ns, int64_t *M, int64_t *N) {
    int64_t n = 1;
    for (int i = 0; i < ns->n; i++)
        n *= ns->u.ints[i];
    if (n <= 0 || ag_tensor_numel(x) % n)
        return false;
    *N = n;
    *M = ag_tensor_numel(x) / n;
    return true;
}

/* The add's operands x + y into s, then the layer norm member ln. */
static int add_ln(ag_tensor *x, ag_tensor *y, ag_tensor *s, const ag__fuse_member *ln,
                  ag_tensor *const *extra_ins, int nextra) {
    const ag_arg *l = ln->args;
    ag_tensor *w = opt_t(&l[2]), *b = opt_t(&l[3]);
    int64_t M, N;
    if (!same_data(l[0].u.t, s) || !contig(x) || !contig(y) || x->dtype != s->dtype ||
        y->dtype != s->dtype || ag_tensor_numel(x) != ag_tensor_numel(s) ||
        ag_tensor_numel(y) != ag_tensor_numel(s) || !contig(w) || !contig(b) ||
        !ln_rows(s, &l[1], &M, &N))
        return 1;
    /* Rows of the sum are written while later rows of x and y are still to be read (exact
     * aliasing, the plan's in-place add, is fine); the layer norm's outputs come after. */
    ag_tensor *outs3[3] = {ln->outs[0], ln->outs[1], ln->outs[2]};
    ag_tensor *ins[4] = {x, y, w, b};
    if ((ag__base(s) != ag__base(x) && overlap(s, x)) ||
        (ag__base(s) != ag__base(y) && overlap(s, y)) || any_overlap(outs3, 3, ins, 4) ||
        any_overlap(outs3, 3, &s, 1) || any_overlap(outs3, 3, extra_ins, nextra))
        return 1;
    return ag__fused_add_layer_norm(s->dtype, ag__base(x), ag__base(y), ag__base(s),
                                    w ? ag__base(w) : NULL, b ? ag__base(b) : NULL,
                                    ag__base(ln->outs[0]), ag__base(ln->outs[1]),
                                    ag__base(ln->outs[2]), M, N, l[4].u.f);
}

static int run_add_ln(const ag__fuse_member *m, uint32_t flags) {
    (void)flags;
    const ag_arg *a = m[0].args;
    if (a[2].u.f != 1.0)
        return 1;
    return add_ln(a[0].u.t, a[1].u.t, m[0].outs[0], &m[1], NULL, 0);
}

static int run_clone_add_ln(const ag__fuse_member *m, uint32_t flags) {
    (void)flags;
    ag_tensor *src = m[0].args[0].u.t, *cl = m[0].outs[0];
    const ag_arg *a = m[1].args;
    if (a[2].u.f != 1.0 || !contig(src) || src->dtype != cl->dtype)
        return 1;
    /* The clone is not written: the add reads its source instead (the same values). */
    ag_tensor *x = a[0].u.t, *y = a[1].u.t;
    if (same_data(x, cl))
        x = src;
    else if (same_data(y, cl))
        y = src;
    else
        return 1;
    return add_ln(x, y, m[1].outs[0], &m[2], NULL, 0);
}

static const ag__fusion add_ln_f = {"add+layer_norm", "fused:add+layer_norm", 2, run_add_ln, false};
static const ag__fusion clone_add_ln_f = {"clone+add+layer_norm", "fused:clone+add+layer_norm", 3,
                                          run_clone_add_ln, false};

/* ---- native_layer_norm_backward + add ---- */

static int run_lnb_add(const ag__fuse_member *m, uint32_t flags) {
    (void)flags;
    const ag_arg *l = m[0].args, *a = m[1].args;
    ag_tensor *g = l[0].u.t, *x = l[1].u.t, *mean = l[3].u.t, *rstd = l[4].u.t;
    ag_tensor *w = opt_t(&l[5]), *b = opt_t(&l[6]);
    ag_tensor *gx = m[0].outs[0], *gw = m[0].outs[1], *gb = m[0].outs[2], *out = m[1].outs[0];
    const int64_t *mask = l[7].u.ints;
    int64_t M, N;
    if (a[2].u.f != 1.0 || !mask[0] || !contig(g) || !contig(x) || !contig(mean) || !contig(rstd) ||
        !contig(w) || !ln_rows(x, &l[2], &M, &N))
        return 1;
    ag_tensor *acc = same_data(a[0].u.t, gx) ? a[1].u.t : same_data(a[1].u.t, gx) ? a[0].u.t : NULL;
    if (!acc || !contig(acc) || !contig(out) || acc->dtype != gx->dtype ||
        ag_tensor_numel(acc) != ag_tensor_numel(gx) || ag_tensor_numel(out) != ag_tensor_numel(gx))
        return 1;
    /* out rows are written between gx rows and before the weight and bias gradients' pass,
     * which reads g, x, mean and rstd again. */
    ag_tensor *ins[5] = {g, x, mean, rstd, w};
    ag_tensor *outs3[3] = {out, mask[1] && w ? gw : NULL, mask[2] && b ? gb : NULL};
    if (any_overlap(outs3, 3, ins, 5) || (ag__base(out) != ag__base(gx) && overlap(out, gx)) ||
        (ag__base(out) != ag__base(acc) && overlap(out, acc)) || overlap(gx, acc))
        return 1;
    return ag__fused_layer_norm_backward_add(
        gx->dtype, ag__base(g), ag__base(x), ag__base(mean), ag__base(rstd), w ? ag__base(w) : NULL,
        ag__base(gx), mask[1] && w ? ag__base(gw) : NULL, mask[2] && b ? ag__base(gb) : NULL, M, N,
        ag__base(acc), ag__base(out));
}

static const ag__fusion lnb_add_f = {"layer_norm_backward+add", "fused:layer_norm_backward+add", 2,
                                     run_lnb_add, false};

/* ---- nll_loss_backward + _log_softmax_backward_data ---- */

static int run_nll_lsm(const ag__fuse_member *m, uint32_t flags) {
    const ag_arg *n = m[0].args, *s = m[1].args;
    ag_tensor *g = n[0].u.t, *x = n[1].u.t, *t = n[2].u.t, *tw = n[6].u.t;
    ag_tensor *d = m[0].outs[0], *y = s[1].u.t, *out = m[1].outs[0];
    const int64_t reduction = n[4].u.i;
    if (opt_t(&n[3]) || x->ndim != 2 || !same_data(s[0].u.t, d) || !contig(y) || !contig(out) ||
        !contig(t) || t->dtype != AG_I64 || y->dtype != d->dtype || out->dtype != d->dtype ||
        ag_tensor_numel(y) != ag_tensor_numel(d) || ag_tensor_numel(out) != ag_tensor_numel(d) ||
        (s[2].u.i != 1 && s[2].u.i != -1) || ag_tensor_numel(t) != x->sizes[0])
        return 1;
    bool write_d = !(flags & FUSE_SKIP_FIRST);
    /* Each row reads its target and loss gradient while out (and d) rows are written. */
    ag_tensor *ins[4] = {g, t, tw, y};
    ag_tensor *outs2[2] = {out, write_d ? d : NULL};
    if ((ag__base(out) != ag__base(y) && overlap(out, y)) || any_overlap(outs2, 2, ins, 3) ||
        (write_d && (overlap(d, y) || overlap(d, out))))
        return 1;
    return ag__fused_nll_log_softmax_backward(
        g, reduction == AG_REDUCTION_NONE, reduction == AG_REDUCTION_MEAN, ag__get_f64(tw, 0),
        (const int64_t *)ag__base(t), n[5].u.i, d->dtype, ag__base(y), ag__base(out),
        write_d ? ag__base(d) : NULL, x->sizes[0], x->sizes[1]);
}

static const ag__fusion nll_lsm_f = {"nll_loss_backward+log_softmax_backward",
                                     "fused:nll_loss_backward+log_softmax_backward", 2, run_nll_lsm,
                                     false};

/* ---- _native_batch_norm_legit_functional + relu ---- */

static int run_bn_relu(const ag__fuse_member *m, uint32_t flags) {
    const ag_arg *a = m[0].args;
    ag_tensor *x = a[0].u.t, *y = m[0].outs[0], *z = m[1].outs[0];
    if (!same_data(m[1].args[0].u.t, y) || !contig(z) || z->dtype != y->dtype ||
        ag_tensor_numel(z) != ag_tensor_numel(y) || x->ndim < 2)
        return 1;
    /* Each channel's relu values are written while later channels of x are still to be read;
     * z may take y's place (exactly) but no other operand's. */
    ag_tensor *ins[5] = {x, opt_t(&a[1]), opt_t(&a[2]), opt_t(&a[3]), opt_t(&a[4])};
    ag_tensor *small[4] = {m[0].outs[1], m[0].outs[2], m[0].outs[3], m[0].outs[4]};
    if (any_overlap(&z, 1, ins, 5) || any_overlap(&z, 1, small, 4) ||
        (ag__base(z) != ag__base(y) && overlap(z, y)))
        return 1;
    return ag__fused_batch_norm_relu(a, m[0].outs, z, !(flags & FUSE_SKIP_FIRST));
}

static const ag__fusion bn_relu_f = {"batch_norm+relu", "fused:batch_norm+relu", 2, run_bn_relu,
                                     false};

/* ---- threshold_backward + native_batch_norm_backward ---- */

static int run_thr_bnb(const ag__fuse_member *m, uint32_t flags) {
    const ag_arg *t = m[0].args, *b = m[1].args;
    ag_tensor *g = t[0].u.t, *r = t[1].u.t, *x = b[1].u.t;
    const int64_t *mask = b[9].u.ints;
    if (!(flags & FUSE_SKIP_FIRST) || !same_data(b[0].u.t, m[0].outs[0]) || !contig(g) ||
        !contig(r) || g->dtype != x->dtype || r->dtype != x->dtype ||
        ag_tensor_numel(g) != ag_tensor_numel(x) || ag_tensor_numel(r) != ag_tensor_numel(x) ||
        x->ndim < 2)
        return 1;
    /* grad_input is written channel by channel, after that channel's sums: it may take the
     * place of grad or self exactly (elementwise) but overlap nothing else; the weight and bias
     * gradients overlap no input. */
    ag_tensor *gx = mask[0] ? m[1].outs[0] : NULL;
    ag_tensor *gwb[2] = {mask[1] ? m[1].outs[1] : NULL, mask[2] ? m[1].outs[2] : NULL};
    ag_tensor *ins[7] = {g, r, x, opt_t(&b[2]), opt_t(&b[3]), opt_t(&b[4]), opt_t(&b[5])};
    if ((gx && ((ag__base(gx) != ag__base(g) && overlap(gx, g)) ||
                (ag__base(gx) != ag__base(r) && overlap(gx, r)) ||
                any_overlap(&gx, 1, ins + 2, 5) || !contig(gx))) ||
        any_overlap(gwb, 2, ins, 7) || overlap(gx, gwb[0]) || overlap(gx, gwb[1]) ||
        overlap(opt_t(&b[6]), gx) || any_overlap(gwb, 2, (ag_tensor *[]){opt_t(&b[6])}, 1))
        return 1;
    return ag__fused_threshold_batch_norm_backward(t, b, m[1].outs);
}

/* grad and self die at the threshold_backward as they would unfused (reads_end_early): the
 * batch norm backward's grad_input often takes one of their places, exactly, which the kernel
 * allows; any other overlap declines. Keeping them alive instead cost the cnn's backward plan
 * one more 12.8 MB activation. */
static const ag__fusion thr_bnb_f = {"threshold_backward+batch_norm_backward",
                                     "fused:threshold_backward+batch_norm_backward", 2, run_thr_bnb,
                                     true};

/* Whether output k of multi-output n is read only by `only` (through its getitem and views). */
static bool output_only_reader(const ag_node *n, int k, const ag_node *only) {
    for (int u = 0; u < ag_node_num_users(n); u++) {
        ag_node *x = ag_node_user(n, u);
        if (ag_node_kind_of(x) != AG_NODE_GETITEM)
            return false;
        const ag_garg *i = ag_node_arg(x, 1);
        if (i && i->kind == AG_GA_INT && i->u.i == k && !only_reader(x, only))
            return false;
    }
    return true;
}

/* ---- the matcher ---- */

int ag__fuse_match(ag_node *const *c, int n, ag__fuse_group *g) {
    memset(g, 0, sizeof *g);
    /* A group never holds a collective or a wait_tensor (which is flagged pointwise): the
     * fused kernel would run the members' computations around the communication's start or
     * completion, and a collective is ordered against the other ranks. The chain stops there. */
    for (int k = 0; k < n; k++)
        if (ag_node_kind_of(c[k]) == AG_NODE_CALL &&
            (ag_op_def(ag_node_op(c[k]))->flags & AG_OP_COLLECTIVE)) {
            n = k;
            break;
        }
    if (n >= 2 && is_op(c[0], "addmm") && is_op(c[1], "gelu") && reads(c[1], 0, c[0], 0)) {
        g->f = &addmm_gelu;
        return 2;
    }
    if (n >= 3 && is_op(c[0], "clone") && is_op(c[1], "add.Tensor") &&
        is_op(c[2], "native_layer_norm") && (reads(c[1], 0, c[0], 0) || reads(c[1], 1, c[0], 0)) &&
        !(reads(c[1], 0, c[0], 0) && reads(c[1], 1, c[0], 0)) && only_reader(c[0], c[1]) &&
        reads(c[2], 0, c[1], 0)) {
        g->f = &clone_add_ln_f;
        g->flags = FUSE_SKIP_FIRST;
        return 3;
    }
    if (n >= 2 && is_op(c[0], "add.Tensor") && is_op(c[1], "native_layer_norm") &&
        reads(c[1], 0, c[0], 0)) {
        g->f = &add_ln_f;
        return 2;
    }
    if (n >= 2 && is_op(c[0], "native_layer_norm_backward") && is_op(c[1], "add.Tensor") &&
        (reads(c[1], 0, c[0], 0) != reads(c[1], 1, c[0], 0))) {
        g->f = &lnb_add_f;
        return 2;
    }
    if (n >= 2 && is_op(c[0], "nll_loss_backward") && is_op(c[1], "_log_softmax_backward_data") &&
        reads(c[1], 0, c[0], 0)) {
        g->f = &nll_lsm_f;
        g->flags = only_reader(c[0], c[1]) ? FUSE_SKIP_FIRST : 0;
        return 2;
    }
    if (n >= 2 && is_op(c[0], "_native_batch_norm_legit_functional") && is_op(c[1], "relu") &&
        reads(c[1], 0, c[0], 0)) {
        g->f = &bn_relu_f;
        g->flags = output_only_reader(c[0], 0, c[1]) ? FUSE_SKIP_FIRST : 0;
        return 2;
    }
    if (n >= 2 && is_op(c[0], "threshold_backward") && is_op(c[1], "native_batch_norm_backward") &&
        reads(c[1], 0, c[0], 0) && !reads(c[1], 1, c[0], 0) && only_reader(c[0], c[1])) {
        g->f = &thr_bnb_f;
        g->flags = FUSE_SKIP_FIRST;
        return 2;
    }
    return 0;
}

bool ag__fuse_disabled_by_env(void) {
    const char *e = getenv("AG_NO_FUSION");
    return e && *e && strcmp(e, "0") != 0;
}
