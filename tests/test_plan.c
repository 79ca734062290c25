/* The executor (ag_plan_*, src/runtime/plan.c) and its memory planner (memplan.c).
 *
 * Hand-built graphs whose lifetimes, arena sizes and in-place reuse are worked out by hand in
 * the comments; every zoo model's joint graph run by a plan (with and without in-place reuse,
 * with and without checking mode) against the interpreter (ag_graph_run, the same kernels: the
 * results must agree to 1e-6); allocation counts of later runs through a counting allocator
 * (none for pointwise and matmul graphs; kernels that allocate scratch are listed by name);
 * the output pools (outputs kept by the caller stay intact, released ones are reused);
 * checking mode catching an overlap and a read of a freed buffer planted through a test hook;
 * input errors; and the allocation-failure sweep. */
#include "testutil.h"
#include "runtime/plan_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- helpers ---- */

#define CALL(g, name, op, ...) tu_call(g, op, GARGS(__VA_ARGS__), name)

static ag_tensor *rnd(ag_dtype dt, int ndim, const int64_t *sizes, uint64_t seed) {
    uint64_t st = seed * 0x9e3779b97f4a7c15ull + 1;
    return tu_rand_tensor(dt, ndim, sizes, -1, 1, tu_xorshift, &st);
}

static ag_plan *plan_ok(const ag_graph *g, bool checking, bool no_inplace) {
    ag_plan_opts o = {.checking = checking, .no_inplace = no_inplace};
    ag_plan *p = ag_plan_new(g, &o);
    if (!p)
        fail_msg("plan_new: %s", ag_last_error());
    return p;
}

static void free_all(ag_tensor **t, int n) {
    for (int i = 0; i < n; i++) {
        ag_tensor_free(t[i]);
        t[i] = NULL;
    }
}

/* max |a - b| / max(1, max |a|): both NULL is equal. */
static double rel_diff(const ag_tensor *a, const ag_tensor *b) {
    if (!a || !b)
        return a == b ? 0 : INFINITY;
    double scale = 1;
    for (int64_t i = 0; i < ag_tensor_numel(a); i++)
        scale = fmax(scale, fabs(ag_tensor_item_at(a, i)));
    return tu_max_abs_diff(a, b) / scale;
}

static double worst_diff; /* the largest difference expect_same saw */

/* Runs g with the interpreter and with p on the same inputs; asserts outputs agree. */
static void expect_same(const char *what, const ag_graph *g, ag_plan *p, ag_tensor *const *in,
                        int nin) {
    ag_tensor *ref[128], *got[128];
    int nr = ag_graph_run(g, in, nin, ref, 128);
    if (nr < 0)
        fail_msg("%s: graph_run: %s", what, ag_last_error());
    int ng = ag_plan_run(p, in, nin, got, 128);
    if (ng < 0)
        fail_msg("%s: plan_run: %s", what, ag_last_error());
    assert_int_equal(nr, ng);
    for (int k = 0; k < nr; k++) {
        double d = rel_diff(ref[k], got[k]);
        worst_diff = fmax(worst_diff, d);
        if (!(d <= 1e-6))
            fail_msg("%s: output %d differs by %g", what, k, d);
    }
    free_all(ref, nr);
    free_all(got, ng);
}

/* ---- hand-built graphs with known plans ---- */

/* x [4, 16] f32 (256 bytes) -> a = neg(x) -> b = exp(a) -> c = neg(b) -> d = exp(c) = output.
 * Nodes: x 0, a 1, b 2, c 3, d 4, output 5. Lifetimes: a [1, 2], b [2, 3], c [3, 4]; d is an
 * output (its own storage, 256 bytes). Without in-place reuse a and b are both alive at node
 * 2 and b and c at 3, while a and c never meet: two buffers, 512 bytes, which is also the
 * ideal peak (sum of sizes 768). With it, b writes into a's buffer and c into that same one:
 * a single 256-byte buffer. */
static ag_graph *chain_graph(void) {
    ag_graph *g = ag_graph_new();
    ag_node *x = tu_ph(g, "x", TM(AG_F32, 4, 16));
    ag_node *a = CALL(g, "a", "neg", AG_GA_N(x));
    ag_node *b = CALL(g, "b", "exp", AG_GA_N(a));
    ag_node *c = CALL(g, "c", "neg", AG_GA_N(b));
    ag_node *d = CALL(g, "d", "exp", AG_GA_N(c));
    assert_non_null(ag_graph_output(g, (ag_node *[]){d}, 1));
    return g;
}

static void test_chain_arena(void **st) {
    (void)st;
    ag_graph *g = chain_graph();
    ag_tensor *x = rnd(AG_F32, 2, (int64_t[]){4, 16}, 1);
    ag__plan_stats s;

    ag_plan *p = plan_ok(g, true, true);
    ag__plan_get_stats(p, &s);
    assert_int_equal(ag_plan_peak_bytes(p), 512);
    assert_int_equal(s.ideal_bytes, 512);
    assert_int_equal(s.sum_bytes, 768);
    assert_int_equal(s.buffers, 3);
    assert_int_equal(s.inplace, 0);
    assert_int_equal(ag_plan_output_bytes(p), 256);
    expect_same("chain, no in-place", g, p, &x, 1);
    ag_plan_free(p);

    p = plan_ok(g, true, false);
    ag__plan_get_stats(p, &s);
    assert_int_equal(ag_plan_peak_bytes(p), 256);
    assert_int_equal(s.inplace, 2);
    assert_int_equal(s.buffers, 1);
    assert_int_equal(s.sum_bytes, 768);
    expect_same("chain, in-place", g, p, &x, 1);
    expect_same("chain, in-place, second run", g, p, &x, 1);
    ag_plan_free(p);
    ag_tensor_free(x);
    ag_graph_free(g);
}

/* x [16, 16] f32 (1024 bytes); a = exp(x); b = sum(a, [1], keepdim) [16, 1] (64 bytes);
 * c = mul(a, b) [16, 16]; d = sum(c) = output. Nodes x 0, a 1, b 2, c 3, d 4. Lifetimes: a
 * [1, 3], b [2, 3], c [3, 4]. At node 3 all three are alive: 1024 + 64 + 1024 = 2112 bytes
 * without reuse. mul may write into a (a dies at 3, same shape; b is broadcast but lives in
 * another buffer): then a/c share one buffer [1, 4] and the peak is 1024 + 64 = 1088. */
static ag_graph *mixed_graph(void) {
    ag_graph *g = ag_graph_new();
    ag_node *x = tu_ph(g, "x", TM(AG_F32, 16, 16));
    ag_node *a = CALL(g, "a", "exp", AG_GA_N(x));
    int64_t dim1[] = {1};
    ag_node *b = CALL(g, "b", "sum.dim_IntList", AG_GA_N(a), AG_GA_INTS(dim1, 1), AG_GA_B(true));
    ag_node *c = CALL(g, "c", "mul.Tensor", AG_GA_N(a), AG_GA_N(b));
    ag_node *d = CALL(g, "d", "sum.dim_IntList", AG_GA_N(c), AG_GA_NIL);
    assert_non_null(ag_graph_output(g, (ag_node *[]){d}, 1));
    return g;
}

static void test_mixed_sizes_arena(void **st) {
    (void)st;
    ag_graph *g = mixed_graph();
    ag_tensor *x = rnd(AG_F32, 2, (int64_t[]){16, 16}, 2);
    ag__plan_stats s;
    ag_plan *p = plan_ok(g, true, true);
    ag__plan_get_stats(p, &s);
    assert_int_equal(s.ideal_bytes, 2112);
    assert_int_equal(ag_plan_peak_bytes(p), 2112);
    assert_int_equal(s.inplace, 0);
    expect_same("mixed, no in-place", g, p, &x, 1);
    ag_plan_free(p);
    p = plan_ok(g, true, false);
    ag__plan_get_stats(p, &s);
    assert_int_equal(s.inplace, 1);
    assert_int_equal(ag_plan_peak_bytes(p), 1088);
    assert_int_equal(ag_plan_output_bytes(p), 4);
    expect_same("mixed, in-place", g, p, &x, 1);
    ag_plan_free(p);
    ag_tensor_free(x);
    ag_graph_free(g);
}

/* In-place reuse must not happen when the dying input is read again by the same node through
 * a view (add(a, t(a)) would overwrite elements it still reads), nor into a graph input. */
static void test_inplace_refusals(void **st) {
    (void)st;
    ag_graph *g = ag_graph_new();
    ag_node *x = tu_ph(g, "x", TM(AG_F32, 8, 8));
    ag_node *a = CALL(g, "a", "exp", AG_GA_N(x)); /* x is an input: no reuse */
    ag_node *at = CALL(g, "at", "t", AG_GA_N(a));
    ag_node *b = CALL(g, "b", "add.Tensor", AG_GA_N(a), AG_GA_N(at)); /* a read through at */
    ag_node *c = CALL(g, "c", "sum.dim_IntList", AG_GA_N(b), AG_GA_NIL);
    assert_non_null(ag_graph_output(g, (ag_node *[]){c}, 1));
    ag_plan *p = plan_ok(g, true, false);
    ag__plan_stats s;
    ag__plan_get_stats(p, &s);
    assert_int_equal(s.inplace, 0);
    assert_int_equal(ag_plan_peak_bytes(p), 512); /* a and b, 256 each */
    ag_tensor *xt = rnd(AG_F32, 2, (int64_t[]){8, 8}, 3);
    expect_same("refusals", g, p, &xt, 1);
    ag_plan_free(p);
    ag_tensor_free(xt);
    ag_graph_free(g);
}

/* Views of inputs, a multi-output op read through getitem, an output that is a view of an
 * intermediate, a placeholder returned as is, a duplicated output and a None; run with a
 * non-contiguous input, whose views must follow the input's strides. */
static ag_graph *views_graph(void) {
    ag_graph *g = ag_graph_new();
    ag_node *x = tu_ph(g, "x", TM(AG_F32, 6, 4));
    ag_node *w = tu_ph(g, "w", TM(AG_F32, 5, 4));
    ag_node *wt = CALL(g, "wt", "t", AG_GA_N(w));
    ag_node *y = CALL(g, "y", "mm", AG_GA_N(x), AG_GA_N(wt)); /* [6, 5] */
    int64_t norm[] = {5};
    ag_node *ln = CALL(g, "ln", "native_layer_norm", AG_GA_N(y), AG_GA_INTS(norm, 1), AG_GA_NIL,
                       AG_GA_NIL, AG_GA_F(1e-5));
    ag_node *l0 = ag_graph_getitem(g, ln, 0, NULL);
    ag_node *l2 = ag_graph_getitem(g, ln, 2, NULL);
    ag_node *r = CALL(g, "r", "relu", AG_GA_N(l0));
    int64_t shape[] = {30};
    ag_node *rv = CALL(g, "rv", "view", AG_GA_N(r), AG_GA_INTS(shape, 1));
    ag_node *xs = CALL(g, "xs", "slice.Tensor", AG_GA_N(x), AG_GA_I(1), AG_GA_I(1), AG_GA_I(3));
    ag_node *e = CALL(g, "e", "exp", AG_GA_N(xs));
    assert_non_null(ag_graph_output(g, (ag_node *[]){rv, w, l2, NULL, e, rv, r, wt}, 8));
    return g;
}

static void test_views_getitem_outputs(void **st) {
    (void)st;
    ag_graph *g = views_graph();
    ag_tensor *x = rnd(AG_F32, 2, (int64_t[]){6, 4}, 4);
    ag_tensor *w = rnd(AG_F32, 2, (int64_t[]){5, 4}, 5);
    /* w as the transpose of a contiguous [4, 5] */
    ag_tensor *w45 = rnd(AG_F32, 2, (int64_t[]){4, 5}, 6);
    ag_scope_begin();
    ag_tensor *wnc = ag_tensor_keep(ag_transpose(w45, 0, 1));
    ag_scope_end();
    for (int chk = 0; chk < 2; chk++) {
        ag_plan *p = plan_ok(g, chk, false);
        expect_same("views", g, p, (ag_tensor *[]){x, w}, 2);
        expect_same("views, strided w", g, p, (ag_tensor *[]){x, wnc}, 2);
        ag_tensor *o[8];
        assert_int_equal(ag_plan_run(p, (ag_tensor *[]){x, w}, 2, o, 8), 8);
        assert_ptr_equal(o[1], w);                       /* a placeholder comes back as itself */
        assert_null(o[3]);                               /* None */
        assert_ptr_equal(o[5], o[0]);                    /* the same value twice: the same tensor */
        assert_true(ag_tensor_same_storage(o[0], o[6])); /* rv is a view of r */
        assert_true(ag_tensor_same_storage(o[7], w));    /* wt is a view of the input */
        assert_int_equal(ag_tensor_strides(o[7])[0], 1);
        free_all(o, 8);
        ag_plan_free(p);
    }
    ag_tensor_free(x);
    ag_tensor_free(w);
    ag_tensor_free(w45);
    ag_tensor_free(wnc);
    ag_graph_free(g);
}

/* ---- the zoo's joint graphs ---- */

typedef struct zoo_case {
    ag_joint *j;
    ag_module *m;
    ag_tensor *in[256];
    int nin;
} zoo_case;

/* The joint of zoo model `name` and inputs for it: parameters, copies of buffers, the example
 * inputs and deterministic tangents. */
static void zoo_open(zoo_case *z, const char *name, bool core) {
    memset(z, 0, sizeof *z);
    ag_tensor *ex[8];
    int nex;
    assert_int_equal(ag_zoo_build(name, NULL, &z->m, ex, 8, &nex), 0);
    ag_decomp_table *t = core ? ag_decomp_table_core() : NULL;
    ag_export_opts o = {.decompositions = t};
    z->j = ag_export_joint(z->m, ex, nex, NULL, NULL, 0, &o);
    ag_decomp_table_free(t);
    if (!z->j)
        fail_msg("export %s: %s", name, ag_last_error());
    ag_named_tensors ps, bs;
    assert_int_equal(ag_module_named_parameters(z->m, false, &ps), 0);
    assert_int_equal(ag_module_named_buffers(z->m, false, &bs), 0);
    /* The flat inputs (tensor subclass instances, as two_tensor's parameters, flattened into
     * their inner tensors), then the primals the graph takes (view bases, deduplication). */
    ag_tensor *flat[256];
    int nf = 0;
    ag_scope_begin();
    for (int i = 0; i < ps.n + bs.n + nex; i++) {
        ag_tensor *v = i < ps.n          ? ps.tensors[i]
                       : i < ps.n + bs.n ? ag_clone(bs.tensors[i - ps.n])
                                         : ex[i - ps.n - bs.n];
        int n = ag_subclass_flatten_tensors(&v, 1, flat + nf, 256 - nf);
        for (int e = 0; e < n; e++)
            ag_tensor_keep(flat[nf + e]);
        nf += n;
    }
    ag_scope_end();
    for (int i = 0; i < nex; i++)
        ag_tensor_free(ex[i]);
    int k = ag_joint_primals_from_flat(z->j, flat, nf, z->in, 256);
    assert_int_equal(k, ag_joint_num_primals(z->j));
    free_all(flat, nf);
    ag_node **phs;
    int nph = ag_graph_placeholders(ag_joint_graph(z->j), &phs);
    for (; k < nph; k++) {
        const ag_tmeta *m = ag_node_val(phs[k], 0);
        z->in[k] = rnd(m->dtype, m->ndim, m->sizes, 100 + (uint64_t)k);
    }
    z->nin = k;
    ag_named_tensors_free(&ps);
    ag_named_tensors_free(&bs);
}

static void zoo_close(zoo_case *z) {
    free_all(z->in, z->nin);
    ag_joint_free(z->j);
    ag_module_free(z->m);
}

static void check_zoo_model(const char *name, bool core) {
    zoo_case z;
    zoo_open(&z, name, core);
    const ag_graph *g = ag_joint_graph(z.j);
    int64_t arena[2] = {0};
    for (int cfg = 0; cfg < 4; cfg++) {
        bool checking = cfg & 1, no_inplace = cfg & 2;
        char what[96];
        snprintf(what, sizeof what, "%s%s%s%s", name, core ? " (core)" : "",
                 checking ? " checking" : "", no_inplace ? " no-inplace" : "");
        ag_plan *p = plan_ok(g, checking, no_inplace);
        expect_same(what, g, p, z.in, z.nin);
        expect_same(what, g, p, z.in, z.nin); /* pools reused */
        ag__plan_stats s;
        ag__plan_get_stats(p, &s);
        assert_true(s.ideal_bytes <= s.arena_bytes);
        assert_true(s.arena_bytes <= s.sum_bytes);
        arena[no_inplace] = s.arena_bytes;
        if (cfg == 0)
            print_message("  %-14s nodes %4d kernels %4d inplace %3d | arena %8lld ideal %8lld "
                          "sum %9lld out %8lld\n",
                          what, s.nodes, s.kernel_steps, s.inplace, (long long)s.arena_bytes,
                          (long long)s.ideal_bytes, (long long)s.sum_bytes,
                          (long long)s.output_bytes);
        ag_plan_free(p);
    }
    assert_true(arena[0] <= arena[1]);
    zoo_close(&z);
}

static void test_zoo_joints(void **st) {
    (void)st;
    worst_diff = 0;
    for (int i = 0; i < ag_zoo_count(); i++) {
        check_zoo_model(ag_zoo_name(i), false);
        check_zoo_model(ag_zoo_name(i), true);
    }
    print_message("  largest relative difference from the interpreter: %g\n", worst_diff);
}

/* The forward and backward graphs of every zoo joint (default and min-cut partitions): the
 * forward plan against the interpreter, then the backward plan fed the forward plan's saved
 * outputs (held in the output pools across the two runs, as a training step does) against
 * the joint's own gradients from the interpreter. */
static void check_partitioned(const char *name, ag_partitioner part) {
    zoo_case z;
    zoo_open(&z, name, false);
    const ag_graph *jg = ag_joint_graph(z.j);
    int np = ag_joint_num_primals(z.j), nt = ag_joint_num_tangents(z.j);
    int nfo = ag_joint_num_fw_outputs(z.j);
    if (nt == 0) { /* forward-only joint: nothing to partition */
        zoo_close(&z);
        return;
    }
    ag_graph *fw = NULL, *bw = NULL;
    ag_partition_opts po = {.partitioner = part, .memory_budget = 1.0};
    if (ag_partition(jg, nfo, &po, &fw, &bw, NULL) != 0)
        fail_msg("%s: partition: %s", name, ag_last_error());
    ag_tensor *ref[256], *fo[256], *go[256], *bin[256], *fin[256];
    int nref = ag_graph_run(jg, z.in, z.nin, ref, 256);
    /* Gradients (one per primal that is not an effect token) and backward tokens. */
    int ntb = ag_joint_num_backward_tokens(z.j);
    int ngrad = np - ag_joint_num_forward_tokens(z.j) + ntb;
    assert_true(nref == nfo + ngrad);
    /* The forward's inputs: the primals, then the philox seed and offset of a model with
     * random ops (the joint's last placeholders, after the tangents and backward tokens). */
    int nrng = z.nin - np - nt - ntb;
    memcpy(fin, z.in, sizeof *fin * (size_t)np);
    memcpy(fin + np, z.in + np + nt + ntb, sizeof *fin * (size_t)nrng);
    for (int chk = 0; chk < 2; chk++) {
        char what[96];
        snprintf(what, sizeof what, "%s %s%s", name, part ? "mincut" : "default",
                 chk ? " checking" : "");
        ag_plan *pf = plan_ok(fw, chk, false), *pb = plan_ok(bw, chk, false);
        expect_same(what, fw, pf, fin, np + nrng);
        for (int step = 0; step < 2; step++) {
            int nf = ag_plan_run(pf, fin, np + nrng, fo, 256);
            if (nf < 0)
                fail_msg("%s: forward: %s", what, ag_last_error());
            for (int k = 0; k < nfo; k++)
                assert_true(rel_diff(ref[k], fo[k]) <= 1e-6);
            int nb = 0;
            for (int k = nfo; k < nf; k++)
                bin[nb++] = fo[k];
            for (int k = np; k < np + nt + ntb; k++) /* tangents, backward tokens */
                bin[nb++] = z.in[k];
            int ng = ag_plan_run(pb, bin, nb, go, 256);
            if (ng < 0)
                fail_msg("%s: backward: %s", what, ag_last_error());
            assert_int_equal(ng, ngrad);
            for (int k = 0; k < ng; k++)
                if (rel_diff(ref[nfo + k], go[k]) > 1e-6)
                    fail_msg("%s: grad %d differs by %g", what, k, rel_diff(ref[nfo + k], go[k]));
            free_all(fo, nf);
            free_all(go, ng);
        }
        if (chk == 0 && part == AG_PARTITION_MINCUT)
            print_message("  %-14s fw arena %8lld out %8lld | bw arena %8lld out %8lld\n", name,
                          (long long)ag_plan_peak_bytes(pf), (long long)ag_plan_output_bytes(pf),
                          (long long)ag_plan_peak_bytes(pb), (long long)ag_plan_output_bytes(pb));
        ag_plan_free(pf);
        ag_plan_free(pb);
    }
    free_all(ref, nref);
    ag_graph_free(fw);
    ag_graph_free(bw);
    zoo_close(&z);
}

static void test_partitioned_graphs(void **st) {
    (void)st;
    for (int i = 0; i < ag_zoo_count(); i++) {
        check_partitioned(ag_zoo_name(i), AG_PARTITION_DEFAULT);
        check_partitioned(ag_zoo_name(i), AG_PARTITION_MINCUT);
    }
}

/* ---- allocations ---- */

/* Counts allocations per kernel (the op running when they happen) through the step hook. */
typedef struct alloc_log {
    ag_allocator prev;
    const char *op;
    int64_t total;
    const char *ops[64];
    int64_t counts[64];
    int nops;
} alloc_log;

static void *log_alloc(void *ud, size_t size, size_t align) {
    alloc_log *l = ud;
    l->total++;
    const char *op = l->op ? l->op : "(plan)";
    int k = 0;
    while (k < l->nops && strcmp(l->ops[k], op) != 0)
        k++;
    if (k == l->nops && l->nops < 64)
        l->ops[l->nops++] = op;
    if (k < 64)
        l->counts[k]++;
    return l->prev.alloc(l->prev.ud, size, align);
}

static void log_free(void *ud, void *p) {
    alloc_log *l = ud;
    l->prev.free(l->prev.ud, p);
}

static void log_step(const char *op, const char *node, void *ud) {
    (void)node;
    ((alloc_log *)ud)->op = op;
}

static void log_begin(alloc_log *l) {
    memset(l, 0, sizeof *l);
    l->prev = ag_get_allocator();
    ag_set_allocator(&(ag_allocator){log_alloc, log_free, l});
    ag__plan_set_step_hook(log_step, l);
}

static void log_end(alloc_log *l) {
    ag__plan_set_step_hook(NULL, NULL);
    ag_set_allocator(&l->prev);
}

/* x [8, 16] @ w [32, 16]^T + bias, relu, * 0.5, tanh, and a second output exp(x): mm, views
 * and pointwise kernels only. The second run allocates nothing once the first run's outputs
 * are released; a run while the caller keeps the previous outputs takes new storage for them
 * and leaves the kept ones intact. */
static void test_no_allocation_after_first_run(void **st) {
    (void)st;
    ag_graph *g = ag_graph_new();
    ag_node *x = tu_ph(g, "x", TM(AG_F32, 8, 16));
    ag_node *w = tu_ph(g, "w", TM(AG_F32, 32, 16));
    ag_node *bias = tu_ph(g, "bias", TM(AG_F32, 32));
    ag_node *wt = CALL(g, "wt", "t", AG_GA_N(w));
    ag_node *y = CALL(g, "y", "addmm", AG_GA_N(bias), AG_GA_N(x), AG_GA_N(wt));
    ag_node *r = CALL(g, "r", "relu", AG_GA_N(y));
    ag_node *h = CALL(g, "h", "mul.Scalar", AG_GA_N(r), AG_GA_F(0.5));
    ag_node *m = CALL(g, "m", "mm", AG_GA_N(h), AG_GA_N(w));
    ag_node *o = CALL(g, "o", "tanh", AG_GA_N(m));
    ag_node *e = CALL(g, "e", "exp", AG_GA_N(x));
    assert_non_null(ag_graph_output(g, (ag_node *[]){o, e}, 2));
    ag_tensor *in[3] = {rnd(AG_F32, 2, (int64_t[]){8, 16}, 7),
                        rnd(AG_F32, 2, (int64_t[]){32, 16}, 8), rnd(AG_F32, 1, (int64_t[]){32}, 9)};
    for (int chk = 0; chk < 2; chk++) {
        ag_plan *p = plan_ok(g, chk, false);
        ag_tensor *out[2], *kept[2];
        assert_int_equal(ag_plan_run(p, in, 3, out, 2), 2);
        free_all(out, 2);
        alloc_log l;
        log_begin(&l);
        int rc = ag_plan_run(p, in, 3, out, 2);
        log_end(&l);
        assert_int_equal(rc, 2);
        if (l.total != 0)
            fail_msg("second run allocated %lld times (first: %s)", (long long)l.total, l.ops[0]);
        /* Keep these; the next run must not touch them. */
        kept[0] = out[0];
        kept[1] = out[1];
        double k0 = ag_tensor_item_at(kept[0], 5), k1 = ag_tensor_item_at(kept[1], 7);
        ag_tensor *x2 = rnd(AG_F32, 2, (int64_t[]){8, 16}, 10);
        log_begin(&l);
        rc = ag_plan_run(p, (ag_tensor *[]){x2, in[1], in[2]}, 3, out, 2);
        log_end(&l);
        assert_int_equal(rc, 2);
        assert_true(l.total > 0); /* two storages and two structs at least */
        assert_false(ag_tensor_same_storage(out[0], kept[0]));
        assert_true(ag_tensor_item_at(kept[0], 5) == k0);
        assert_true(ag_tensor_item_at(kept[1], 7) == k1);
        assert_true(ag_tensor_item_at(out[1], 7) != k1);
        free_all(kept, 2);
        free_all(out, 2);
        /* Outputs handed to a scope and released with it are reused too. */
        ag_scope_begin();
        assert_int_equal(ag_plan_run(p, in, 3, out, 2), 2);
        ag_scope_end();
        log_begin(&l);
        rc = ag_plan_run(p, in, 3, out, 2);
        log_end(&l);
        assert_int_equal(rc, 2);
        assert_int_equal(l.total, 0);
        ag__plan_stats s;
        ag__plan_get_stats(p, &s);
        assert_true(s.pooled_storages <= 2 * s.output_buffers); /* one spare at most */
        free_all(out, 2);
        ag_tensor_free(x2);
        ag_plan_free(p);
    }
    free_all(in, 3);
    ag_graph_free(g);
}

/* Allocations in a later run of every zoo joint, charged to the kernels that make them (the
 * plan itself must make none). Printed for the record. */
static void test_zoo_allocations_per_kernel(void **st) {
    (void)st;
    for (int i = 0; i < ag_zoo_count(); i++) {
        zoo_case z;
        zoo_open(&z, ag_zoo_name(i), false);
        ag_plan *p = plan_ok(ag_joint_graph(z.j), false, false);
        ag_tensor *out[256];
        int n = ag_plan_run(p, z.in, z.nin, out, 256);
        assert_true(n >= 0);
        free_all(out, n);
        alloc_log l;
        log_begin(&l);
        n = ag_plan_run(p, z.in, z.nin, out, 256);
        log_end(&l);
        assert_true(n >= 0);
        free_all(out, n);
        char list[1024] = "";
        size_t len = 0;
        for (int k = 0; k < l.nops; k++) {
            assert_string_not_equal(l.ops[k], "(plan)");
            len += (size_t)snprintf(list + len, len < sizeof list ? sizeof list - len : 0,
                                    "%s%s x%lld", k ? ", " : "", l.ops[k], (long long)l.counts[k]);
        }
        print_message("  %-14s %4lld allocations per step: %s\n", ag_zoo_name(i),
                      (long long)l.total, l.nops ? list : "none");
        ag_plan_free(p);
        zoo_close(&z);
    }
}

/* ---- checking mode catches planted errors ---- */

static void test_checking_catches_overlap_and_poison(void **st) {
    (void)st;
    ag_graph *g = chain_graph();
    ag_tensor *x = rnd(AG_F32, 2, (int64_t[]){4, 16}, 11), *out[1];
    /* b moved onto a while both are alive at node b. */
    ag_plan *p = plan_ok(g, true, true);
    ag__plan_stats s;
    ag__plan_get_stats(p, &s);
    assert_int_equal(s.arena_bytes, 512);
    assert_int_equal(ag__plan_debug_move(p, "a", 0, NULL), 0);
    assert_int_equal(ag__plan_debug_move(p, "b", 0, NULL), 0);
    assert_true(ag_plan_run(p, &x, 1, out, 1) < 0);
    tu_assert_error_contains("before %b: the buffers of %a");
    tu_assert_error_contains("and %b");
    ag_plan_free(p);
    /* Without checking the same plan runs (and computes garbage): the check is what caught it */
    p = plan_ok(g, false, true);
    assert_int_equal(ag__plan_debug_move(p, "a", 0, NULL), 0);
    assert_int_equal(ag__plan_debug_move(p, "b", 0, NULL), 0);
    assert_int_equal(ag_plan_run(p, &x, 1, out, 1), 1);
    ag_tensor_free(out[0]);
    ag_plan_free(p);
    /* a's life cut short at its own node: poisoned before b reads it. */
    p = plan_ok(g, true, true);
    assert_int_equal(ag__plan_debug_move(p, "a", -1, "a"), 0);
    assert_true(ag_plan_run(p, &x, 1, out, 1) < 0);
    tu_assert_error_contains("%b reads %a");
    tu_assert_error_contains("poisoned");
    ag_plan_free(p);
    /* The hook refuses what has no arena buffer. */
    p = plan_ok(g, true, true);
    assert_true(ag__plan_debug_move(p, "d", 0, NULL) < 0);
    assert_true(ag__plan_debug_move(p, "nope", 0, NULL) < 0);
    ag_plan_free(p);
    ag_tensor_free(x);
    ag_graph_free(g);
}

/* ---- errors ---- */

static void test_errors(void **st) {
    (void)st;
    ag_graph *g = views_graph();
    ag_plan *p = plan_ok(g, false, false);
    ag_tensor *x = rnd(AG_F32, 2, (int64_t[]){6, 4}, 12);
    ag_tensor *w = rnd(AG_F32, 2, (int64_t[]){5, 4}, 13);
    ag_tensor *bad = rnd(AG_F32, 2, (int64_t[]){4, 5}, 14);
    ag_tensor *dbl = rnd(AG_F64, 2, (int64_t[]){5, 4}, 15);
    ag_tensor *o[8];
    assert_int_equal(ag_plan_run(p, (ag_tensor *[]){x}, 1, o, 8), AG_EINVAL);
    tu_assert_error_contains("2 placeholders, 1 inputs given");
    assert_int_equal(ag_plan_run(p, (ag_tensor *[]){x, bad}, 2, o, 8), AG_EINVAL);
    tu_assert_error_contains("input 1 (%w) is f32[4, 5] but the placeholder expects f32[5, 4]");
    assert_int_equal(ag_plan_run(p, (ag_tensor *[]){x, dbl}, 2, o, 8), AG_EINVAL);
    tu_assert_error_contains("input 1 (%w) is f64[5, 4]");
    assert_int_equal(ag_plan_run(p, (ag_tensor *[]){NULL, w}, 2, o, 8), AG_EINVAL);
    tu_assert_error_contains("input 0 (%x) is NULL");
    assert_int_equal(ag_plan_run(p, (ag_tensor *[]){x, w}, 2, o, 7), AG_EINVAL);
    tu_assert_error_contains("8 outputs, room for 7");
    assert_int_equal(ag_plan_run(NULL, NULL, 0, NULL, 0), AG_EINVAL);
    /* a failed run leaves the plan usable */
    assert_int_equal(ag_plan_run(p, (ag_tensor *[]){x, w}, 2, o, 8), 8);
    free_all(o, 8);
    ag_plan_free(p);
    ag_plan_free(NULL);
    assert_null(ag_plan_new(NULL, NULL));
    tu_assert_error_contains("plan_new: g is NULL");
    assert_int_equal(ag_plan_peak_bytes(NULL), 0);

    /* A graph that does not verify (no output node). */
    ag_graph *h = ag_graph_new();
    tu_ph(h, "x", TM(AG_F32, 2));
    assert_null(ag_plan_new(h, NULL));
    tu_assert_error_contains("plan_new: the graph does not verify");
    ag_graph_free(h);

    /* A node with no kernel that is not a view: a composite op left in the graph. */
    h = ag_graph_new();
    ag_node *hx = tu_ph(h, "x", TM(AG_F32, 2, 3));
    ag_node *lin = ag_graph_call(h, tu_op("contiguous"), (ag_garg[]){AG_GA_N(hx)}, 1, "c");
    if (lin) {
        assert_non_null(ag_graph_output(h, (ag_node *[]){lin}, 1));
        assert_null(ag_plan_new(h, NULL));
        tu_assert_error_contains("%c: contiguous has no kernel");
    }
    ag_graph_free(h);
    free_all((ag_tensor *[]){x, w, bad, dbl}, 4);
    ag_graph_free(g);
}

/* ---- the memory planner alone ---- */

static void test_memplan_strategies(void **st) {
    (void)st;
    /* Three 100-byte items alive [0,1], [1,2], [2,3] and one 300-byte item at [4, 4]: the
     * ideal is 300 and every strategy finds it. */
    ag__mp_item it[] = {{100, 0, 1, 0}, {100, 1, 2, 0}, {100, 2, 3, 0}, {300, 4, 4, 0}};
    for (int s = AG__MP_BEST; s <= AG__MP_ORDER_BEST_FIT; s++) {
        int64_t arena;
        assert_int_equal(ag__memplan(it, 4, (ag__mp_strategy)s, &arena), 0);
        assert_int_equal(arena, 300);
        int a, b;
        assert_true(ag__memplan_valid(it, 4, &a, &b));
    }
    assert_int_equal(ag__memplan_ideal(it, 4), 300);
    /* A classic where execution order loses: small short item first grabs offset 0. */
    ag__mp_item jt[] = {{64, 0, 0, 0}, {128, 0, 2, 0}, {192, 1, 3, 0}, {64, 3, 4, 0}};
    int64_t arena;
    assert_int_equal(ag__memplan(jt, 4, AG__MP_BEST, &arena), 0);
    assert_int_equal(ag__memplan_ideal(jt, 4), 320);
    assert_true(arena >= 320 && arena <= 384);
    int a, b;
    assert_true(ag__memplan_valid(jt, 4, &a, &b));
    jt[2].offset = jt[1].offset; /* now two live items overlap */
    assert_false(ag__memplan_valid(jt, 4, &a, &b));
    assert_int_equal(a, 1);
    assert_int_equal(b, 2);
    /* Random items: always valid and never below the ideal. */
    uint64_t rs = 42;
    ag__mp_item r[200];
    for (int i = 0; i < 200; i++) {
        int s0 = (int)(tu_xorshift_next(&rs) % 100);
        r[i] = (ag__mp_item){(int64_t)(tu_xorshift_next(&rs) % 64 + 1) * 64, s0,
                             s0 + (int)(tu_xorshift_next(&rs) % 20), 0};
    }
    assert_int_equal(ag__memplan(r, 200, AG__MP_BEST, &arena), 0);
    assert_true(ag__memplan_valid(r, 200, &a, &b));
    assert_true(arena >= ag__memplan_ideal(r, 200));
    print_message("  random 200 items: arena %lld, ideal %lld\n", (long long)arena,
                  (long long)ag__memplan_ideal(r, 200));
}

/* The planner as it was first written, kept as the reference for the indexed one: each item
 * scans every placed item (O(n^2) per strategy). Same orders, same gap rules. */
typedef struct ref_key {
    int idx;
    int64_t k1, k2, k3;
} ref_key;

static int ref_cmp(const void *pa, const void *pb) {
    const ref_key *a = pa, *b = pb;
    if (a->k1 != b->k1)
        return a->k1 > b->k1 ? -1 : 1;
    if (a->k2 != b->k2)
        return a->k2 > b->k2 ? -1 : 1;
    if (a->k3 != b->k3)
        return a->k3 > b->k3 ? -1 : 1;
    return a->idx - b->idx;
}

static int64_t ref_pass(const ag__mp_item *items, int n, ag__mp_strategy s, int64_t *off) {
    int maxstep = 0;
    for (int i = 0; i < n; i++)
        maxstep = items[i].end > maxstep ? items[i].end : maxstep;
    int64_t *live = calloc((size_t)maxstep + 2, sizeof *live);
    ref_key *keys = malloc(sizeof *keys * (size_t)n);
    int *placed = malloc(sizeof *placed * (size_t)n);
    assert_non_null(live);
    assert_non_null(keys);
    assert_non_null(placed);
    for (int i = 0; i < n; i++) {
        live[items[i].start] += items[i].size;
        live[items[i].end + 1] -= items[i].size;
    }
    for (int t = 1; t <= maxstep + 1; t++)
        live[t] += live[t - 1];
    for (int i = 0; i < n; i++) {
        const ag__mp_item *it = &items[i];
        ref_key k = {.idx = i};
        int64_t len = (int64_t)it->end - it->start;
        if (s == AG__MP_BREADTH) {
            for (int t = it->start; t <= it->end; t++)
                k.k1 = live[t] > k.k1 ? live[t] : k.k1;
            k.k2 = it->size;
            k.k3 = len;
        } else if (s == AG__MP_ORDER_BEST_FIT) {
            k.k1 = -(int64_t)it->start;
            k.k2 = it->size;
            k.k3 = len;
        } else {
            k.k1 = it->size;
            k.k2 = len;
            k.k3 = -(int64_t)it->start;
        }
        keys[i] = k;
    }
    qsort(keys, (size_t)n, sizeof *keys, ref_cmp);
    bool best_fit = s == AG__MP_SIZE_BEST_FIT || s == AG__MP_ORDER_BEST_FIT;
    int np = 0;
    int64_t arena = 0;
    for (int r = 0; r < n; r++) {
        int i = keys[r].idx;
        const ag__mp_item *it = &items[i];
        if (it->size == 0) {
            off[i] = 0;
            continue;
        }
        int64_t cursor = 0, best = -1, best_gap = INT64_MAX;
        for (int q = 0; q < np; q++) {
            const ag__mp_item *o = &items[placed[q]];
            if (!(it->start <= o->end && o->start <= it->end))
                continue;
            int64_t o_off = off[placed[q]];
            if (o_off > cursor) {
                int64_t gap = o_off - cursor;
                if (gap >= it->size && (!best_fit || gap < best_gap)) {
                    best = cursor;
                    best_gap = gap;
                    if (!best_fit)
                        break;
                }
            }
            if (o_off + o->size > cursor)
                cursor = o_off + o->size;
        }
        if (best < 0)
            best = cursor;
        off[i] = best;
        if (best + it->size > arena)
            arena = best + it->size;
        int pos = np;
        while (pos > 0 && off[placed[pos - 1]] > best) {
            placed[pos] = placed[pos - 1];
            pos--;
        }
        placed[pos] = i;
        np++;
    }
    free(live);
    free(keys);
    free(placed);
    return arena;
}

/* The indexed planner gives exactly the reference's offsets, for every strategy, on random
 * item sets with short and long lifetimes, equal sizes and empty items. */
static void test_memplan_matches_reference(void **st) {
    (void)st;
    uint64_t rs = 7;
    for (int trial = 0; trial < 60; trial++) {
        int n = 1 + (int)(tu_xorshift_next(&rs) % (trial < 30 ? 40 : 600));
        int steps = 1 + (int)(tu_xorshift_next(&rs) % (2 * n));
        ag__mp_item *items = calloc((size_t)n, sizeof *items);
        int64_t *want = calloc((size_t)n, sizeof *want);
        assert_non_null(items);
        assert_non_null(want);
        for (int i = 0; i < n; i++) {
            int s0 = (int)(tu_xorshift_next(&rs) % (uint64_t)steps);
            uint64_t kind = tu_xorshift_next(&rs) % 10;
            int len = kind == 0  ? (int)(tu_xorshift_next(&rs) % (uint64_t)steps) /* long */
                      : kind < 3 ? 0
                                 : (int)(tu_xorshift_next(&rs) % 8);
            int64_t size = kind == 9 ? 0 : (int64_t)(tu_xorshift_next(&rs) % 6 + 1) * 64;
            items[i] = (ag__mp_item){size, s0, s0 + len, 0};
        }
        for (int s = AG__MP_SIZE_FIRST_FIT; s <= AG__MP_ORDER_BEST_FIT; s++) {
            int64_t want_arena = ref_pass(items, n, (ag__mp_strategy)s, want), arena;
            assert_int_equal(ag__memplan(items, n, (ag__mp_strategy)s, &arena), 0);
            assert_int_equal(arena, want_arena);
            for (int i = 0; i < n; i++)
                assert_int_equal(items[i].offset, want[i]);
            int a, b;
            assert_true(ag__memplan_valid(items, n, &a, &b));
        }
        free(items);
        free(want);
    }
}

/* ---- allocation failures ---- */

static int sweep_scenario(void *ud) {
    const ag_graph *g = ud;
    ag_tensor *x = NULL, *w = NULL, *o[8] = {0};
    int rc = 0;
    tu_alloc_pause();
    x = rnd(AG_F32, 2, (int64_t[]){6, 4}, 20);
    w = rnd(AG_F32, 2, (int64_t[]){5, 4}, 21);
    tu_alloc_resume();
    ag_plan *p = ag_plan_new(g, &(ag_plan_opts){.checking = true});
    if (!p) {
        rc = ag_last_status();
        goto done;
    }
    for (int k = 0; k < 2 && rc >= 0; k++) {
        rc = ag_plan_run(p, (ag_tensor *[]){x, w}, 2, o, 8);
        if (rc >= 0)
            free_all(o, 8);
    }
    /* keep one run's outputs while running again: the pools grow */
    if (rc >= 0)
        rc = ag_plan_run(p, (ag_tensor *[]){x, w}, 2, o, 8);
    if (rc >= 0) {
        ag_tensor *o2[8];
        rc = ag_plan_run(p, (ag_tensor *[]){x, w}, 2, o2, 8);
        if (rc >= 0)
            free_all(o2, 8);
        free_all(o, 8);
    }
    rc = rc < 0 ? rc : 0;
done:
    ag_plan_free(p);
    ag_tensor_free(x);
    ag_tensor_free(w);
    return rc;
}

static void test_alloc_failures(void **st) {
    (void)st;
    ag_graph *g = views_graph();
    int64_t n = tu_alloc_failure_sweep(sweep_scenario, g,
                                       &(tu_sweep_opts){.what = "plan", .one_thread = true});
    assert_true(n > 20);
    ag_graph_free(g);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_chain_arena),
        cmocka_unit_test(test_mixed_sizes_arena),
        cmocka_unit_test(test_inplace_refusals),
        cmocka_unit_test(test_views_getitem_outputs),
        cmocka_unit_test(test_memplan_strategies),
        cmocka_unit_test(test_memplan_matches_reference),
        cmocka_unit_test(test_zoo_joints),
        cmocka_unit_test(test_partitioned_graphs),
        cmocka_unit_test(test_no_allocation_after_first_run),
        cmocka_unit_test(test_zoo_allocations_per_kernel),
        cmocka_unit_test(test_checking_catches_overlap_and_poison),
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_alloc_failures),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
