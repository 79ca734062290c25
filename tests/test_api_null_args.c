/* The NULL policy (core.h) one argument at a time: for the main families (tensors and op entry
 * points, modules, optimizers, export and joints, compile and compiled calls, partition, the
 * graph API, plans, safetensors, data loaders, pytrees, tracing) each call is made with valid
 * arguments except one pointer set to NULL, once per pointer argument, in a child process so
 * that a crash fails one case instead of the program. A required pointer must be refused with
 * AG_EINVAL and a message that starts with the call's name (or the op's, for op entry points)
 * and says what is NULL; a pointer the header documents as optional must be accepted. test_api_
 * contract.c covers every public function with all its pointers NULL at once. */
#define AG_NO_SITES
#include "testutil.h"

#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

/* The objects a case's valid arguments come from, built in the child before the call:
 * a Linear(3, 2) module m, x (4, 3), its joint j, compiled c, traced graph g (placeholders
 * weight, bias, x) with plan p, and a saved state dict at path. */
typedef struct fixture {
    ag_module *m;
    ag_tensor *x, *y, *w, *b, *target, *idx;
    ag_joint *j;
    ag_compiled *c;
    ag_graph *g;
    ag_plan *p;
    ag_node *ph0, *ph1, *last;
    ag_tensor *gin[3]; /* the traced graph's inputs: weight, bias, x */
    ag_tensor *outs[16];
    ag_named_tensors nt;
    ag_optim *o;
    char path[64], dir[64];
} fixture;

static fixture F;

static void build(void) {
    F.m = ag_nn_linear(3, 2, true);
    F.x = ag_ones(AG_F32, 2, (int64_t[]){4, 3});
    F.y = ag_ones(AG_F32, 2, (int64_t[]){4, 3});
    F.w = ag_ones(AG_F32, 2, (int64_t[]){2, 3});
    F.b = ag_ones(AG_F32, 1, (int64_t[]){2});
    F.target = ag_zeros(AG_I64, 1, (int64_t[]){4});
    F.idx = ag_zeros(AG_I64, 1, (int64_t[]){2});
    F.j = ag_export_joint(F.m, &F.x, 1, NULL, NULL, 0, NULL);
    F.c = F.j ? ag_compile_joint(F.j, NULL) : NULL;
    F.g = ag_trace_module(F.m, &F.x, 1, NULL);
    F.p = F.g ? ag_plan_new(F.g, NULL) : NULL;
    F.ph0 = F.g ? ag_graph_first(F.g) : NULL;
    F.ph1 = F.ph0 ? ag_node_next(F.ph0) : NULL;
    F.last = F.g ? ag_node_prev(ag_graph_output_node(F.g)) : NULL;
    F.gin[0] = ag_module_param(F.m, "weight");
    F.gin[1] = ag_module_param(F.m, "bias");
    F.gin[2] = F.x;
    F.o = ag_optim_sgd(F.m, 0.1, 0, 0, false);
    snprintf(F.path, sizeof F.path, "/tmp/ag_null_args_%d.safetensors", (int)getpid());
    snprintf(F.dir, sizeof F.dir, "/tmp/ag_null_args_%d", (int)getpid());
    /* No cmocka assertion here: it would unwind into the runner inside the child. */
    if (!(F.m && F.x && F.j && F.c && F.g && F.p && F.ph1 && F.last && F.o) ||
        ag_module_save(F.m, F.path)) {
        fprintf(stderr, "fixture: %s\n", ag_last_error());
        _exit(90);
    }
}

/* V(i, v): argument i of the call, NULL in the run where k == i. */
#define V(i, v) (k == (i) ? NULL : (v))
#define ST(e) ((long)(e))               /* a status */
#define OBJ(e) ((e) != NULL ? 0L : -1L) /* a new object: 0, or -1 when NULL came back */

static int dummy_forward(ag_module *m, ag_tensor *const *in, int nin, ag_tensor **out,
                         int max_out) {
    (void)m, (void)nin, (void)max_out;
    out[0] = ag_tensor_keep(in[0]);
    return 1;
}

static int trace_fn(void *ud, ag_tensor *const *in, int nin, ag_tensor **out, int max_out) {
    (void)ud, (void)nin, (void)max_out;
    out[0] = ag_relu(in[0]);
    return out[0] ? 1 : ag_last_status();
}

/* ---- the cases: each returns 0 / a count on success, a negative value on failure ---- */

static long c_add(int k) {
    return OBJ(ag_add(V(0, F.x), V(1, F.y)));
}
static long c_mm(int k) {
    return OBJ(ag_mm(V(0, F.x), V(1, ag_t(F.w))));
}
static long c_linear(int k) {
    return OBJ(ag_linear(V(0, F.x), V(1, F.w), V(2, F.b)));
}
static long c_where(int k) {
    ag_tensor *cond = ag_gt(F.x, F.y);
    return OBJ(ag_where(V(0, cond), V(1, F.x), V(2, F.y)));
}
static long c_cross_entropy(int k) {
    return OBJ(ag_cross_entropy(V(0, F.x), V(1, F.target), 1, -100));
}
static long c_layer_norm(int k) {
    ag_tensor *w3 = ag_ones(AG_F32, 1, (int64_t[]){3});
    return OBJ(ag_layer_norm(V(0, F.x), 1, V(1, (int64_t[]){3}), V(2, w3), V(3, w3), 1e-5));
}
static long c_embedding(int k) {
    return OBJ(ag_embedding(V(0, F.w), V(1, F.idx)));
}
static long c_cat(int k) {
    ag_tensor *ts[2] = {V(1, F.x), F.y};
    return OBJ(ag_cat(V(0, ts), 2, 0));
}
static long c_tensor_set_grad(int k) {
    return ST(ag_tensor_set_grad(V(0, F.x), V(1, F.y)));
}
static long c_tensor_to_doubles(int k) {
    double out[12];
    return ST(ag_tensor_to_doubles(V(0, F.x), V(1, out)));
}
static long c_from_data(int k) {
    float d[2] = {1, 2};
    return OBJ(ag_from_data(AG_F32, 1, V(0, (int64_t[]){2}), V(1, d)));
}
static long c_zeros(int k) {
    const int64_t sizes[2] = {2, 3};
    return OBJ(ag_zeros(AG_F32, 2, V(0, sizes)));
}
static long c_backward(int k) {
    ag_tensor *l = ag_sum_all(ag_module_forward(F.m, F.x));
    return ST(ag_backward(V(0, l), V(1, ag_ones(AG_F32, 0, NULL)), false));
}
static long c_grad(int k) {
    ag_tensor *l = ag_sum_all(ag_module_forward(F.m, F.x));
    ag_tensor *go = ag_ones(AG_F32, 0, NULL), *gr[1] = {NULL};
    return ST(ag_grad(V(0, &l), V(1, &go), 1, V(2, &F.gin[0]), 1, V(3, gr), false, false));
}

static long c_module_new(int k) {
    return OBJ(ag_module_new(V(0, "Custom"), V(1, dummy_forward), V(2, F.x), NULL));
}
static long c_module_register_parameter(int k) {
    return ST(ag_module_register_parameter(V(0, F.m), V(1, "extra"), V(2, F.w)));
}
static long c_module_register_buffer(int k) {
    return ST(ag_module_register_buffer(V(0, F.m), V(1, "extra"), V(2, F.w), true));
}
static long c_module_add_child(int k) {
    return ST(ag_module_add_child(V(0, F.m), V(1, "sub"), V(2, ag_nn_relu())));
}
static long c_module_named_parameters(int k) {
    return ST(ag_module_named_parameters(V(0, F.m), true, V(1, &F.nt)));
}
static long c_module_call(int k) {
    return ST(ag_module_call(V(0, F.m), V(1, &F.x), 1, V(2, F.outs), 1));
}
static long c_module_forward(int k) {
    return OBJ(ag_module_forward(V(0, F.m), V(1, F.x)));
}
static long c_nn_append(int k) {
    return ST(ag_nn_append(V(0, ag_nn_sequential()), V(1, ag_nn_relu())));
}
static long c_module_save(int k) {
    return ST(ag_module_save(V(0, F.m), V(1, F.path)));
}
static long c_module_load(int k) {
    return ST(ag_module_load(V(0, F.m), V(1, F.path)));
}
static long c_optim_sgd(int k) {
    return OBJ(ag_optim_sgd(V(0, F.m), 0.1, 0.9, 0, false));
}
static long c_optim_adamw(int k) {
    return OBJ(ag_optim_adamw(V(0, F.m), 1e-3, 0.9, 0.999, 1e-8, 0));
}
static long c_optim_step(int k) {
    return ST(ag_optim_step(V(0, F.o)));
}

static long c_export_joint(int k) {
    return OBJ(ag_export_joint(V(0, F.m), V(1, &F.x), 1, NULL, NULL, 0, NULL));
}
static long c_export_joint_kw(int k) {
    const char *names[1] = {"input"};
    return OBJ(ag_export_joint(F.m, NULL, 0, V(0, names), V(1, &F.x), 1, NULL));
}
static long c_joint_set_graph(int k) {
    return ST(ag_joint_set_graph(V(0, F.j), V(1, ag_graph_copy(ag_joint_graph(F.j)))));
}
static long c_joint_primals_from_flat(int k) {
    ag_tensor *pr[8];
    return ST(ag_joint_primals_from_flat(V(0, F.j), V(1, F.gin), 3, V(2, pr), 8));
}
static long c_joint_save(int k) {
    char *t = NULL;
    size_t n = 0;
    long r = ST(ag_joint_save(V(0, F.j), V(1, &t), V(2, &n)));
    ag_free(t);
    return r;
}
static void joint_path(char *buf, size_t n) {
    snprintf(buf, n, "/tmp/ag_null_args_%d.joint", (int)getpid());
}
static long c_joint_save_file(int k) {
    char path[64];
    joint_path(path, sizeof path);
    long r = ST(ag_joint_save_file(V(0, F.j), V(1, path)));
    remove(path);
    return r;
}
static long c_joint_load(int k) {
    char *t = NULL;
    size_t n = 0;
    if (ag_joint_save(F.j, &t, &n))
        return -100;
    ag_joint *j = ag_joint_load(V(0, t), n);
    long r = OBJ(j);
    ag_joint_free(j);
    ag_free(t);
    return r;
}
static long c_joint_load_file(int k) {
    char path[64];
    joint_path(path, sizeof path);
    if (ag_joint_save_file(F.j, path))
        return -100;
    ag_joint *j = ag_joint_load_file(V(0, path));
    long r = OBJ(j);
    ag_joint_free(j);
    remove(path);
    return r;
}
static long c_joint_hash(int k) {
    uint64_t h;
    return ST(ag_joint_hash(V(0, F.j), V(1, &h)));
}
static long c_compile_joint(int k) {
    return OBJ(ag_compile_joint(V(0, F.j), NULL));
}
static long c_compiled_call(int k) {
    return ST(ag_compiled_call(V(0, F.c), V(1, F.gin), 3, V(2, F.outs), 16));
}
static long c_compiled_call_module(int k) {
    return ST(ag_compiled_call_module(V(0, F.c), V(1, F.m), V(2, &F.x), 1, V(3, F.outs), 16));
}
static long c_partition(int k) {
    ag_graph *fw = NULL, *bw = NULL;
    ag_partition_stats st;
    int nfw = ag_joint_num_fw_outputs(F.j);
    return ST(ag_partition(V(0, ag_joint_graph(F.j)), nfw, NULL, V(1, &fw), V(2, &bw), &st));
}

static long c_graph_placeholder(int k) {
    ag_tmeta m = {.dtype = AG_F32, .ndim = 1, .sizes = {2}, .strides = {1}};
    return OBJ(ag_graph_placeholder(V(0, F.g), "extra", V(1, &m)));
}
static long c_graph_call(int k) {
    ag_garg a[2] = {AG_GA_N(F.ph0), AG_GA_N(F.ph0)};
    return OBJ(ag_graph_call(V(0, F.g), V(1, ag_op_find("add.Tensor")), V(2, a), 2, NULL));
}
static long c_graph_get_attr(int k) {
    return OBJ(ag_graph_get_attr(V(0, F.g), V(1, F.w), NULL));
}
static long c_graph_output(int k) {
    ag_graph *g = ag_graph_new();
    ag_tmeta m = {.dtype = AG_F32, .ndim = 1, .sizes = {2}, .strides = {1}};
    ag_node *x = ag_graph_placeholder(g, "x", &m);
    return OBJ(ag_graph_output(V(0, g), V(1, &x), 1));
}
static long c_node_replace_all_uses(int k) {
    return ST(ag_node_replace_all_uses(V(0, F.ph0), V(1, F.ph0)));
}
static long c_graph_erase(int k) {
    ag_tmeta m = {.dtype = AG_F32, .ndim = 1, .sizes = {2}, .strides = {1}};
    ag_node *n = ag_graph_placeholder(F.g, "unused", &m);
    return ST(ag_graph_erase(V(0, F.g), V(1, n)));
}
static long c_graph_move_before(int k) {
    return ST(ag_graph_move_before(V(0, F.g), V(1, F.ph1), V(2, F.ph0)));
}
static long c_graph_move_after(int k) {
    return ST(ag_graph_move_after(V(0, F.g), V(1, F.ph0), V(2, F.ph1)));
}
static long c_node_rename(int k) {
    return ST(ag_node_rename(V(0, F.g), V(1, F.ph0), V(2, "w")));
}
static long c_node_set_val(int k) {
    return ST(ag_node_set_val(V(0, F.ph0), 0, V(1, ag_node_val(F.ph0, 0))));
}
static long c_node_meta_set(int k) {
    return ST(ag_node_meta_set(V(0, F.ph0), V(1, "note"), (ag_mval){.kind = AG_MV_INT, .u.i = 1}));
}
static long c_node_custom_set(int k) {
    return ST(
        ag_node_custom_set(V(0, F.ph0), V(1, "note"), (ag_mval){.kind = AG_MV_INT, .u.i = 1}));
}
static long c_node_set_desc(int k) {
    return ST(ag_node_set_desc(V(0, F.ph0), V(1, ag_desc_param("weight"))));
}
static long c_graph_run(int k) {
    return ST(ag_graph_run(V(0, F.g), V(1, F.gin), 3, V(2, F.outs), 16));
}
static long c_graph_to_string(int k) {
    char *s = ag_graph_to_string(V(0, F.g), NULL);
    ag_free(s);
    return s ? 0 : -1;
}
static long c_graph_print(int k) {
    FILE *f = fopen("/dev/null", "w");
    long rc = ST(ag_graph_print(V(0, F.g), V(1, f), NULL));
    if (f)
        fclose(f);
    return rc;
}
static long c_graph_parse(int k) {
    char *s = ag_graph_to_string(F.g, NULL);
    return OBJ(ag_graph_parse(V(0, s), strlen(s)));
}
static long c_graph_decompose(int k) {
    return ST(ag_graph_decompose(V(0, F.g), V(1, ag_decomp_table_core())));
}
static long c_graph_decompose_node(int k) {
    ag_decomp_fn fn = ag_op_def(ag_node_op(F.last))->decomp; /* addmm -> mm + add */
    return ST(ag_graph_decompose_node(V(0, F.g), V(1, F.last), k == 2 ? (ag_decomp_fn)0 : fn));
}
static long c_graph_write_svg(int k) {
    /* Only the NULL runs: a successful one would need graphviz. */
    if (k < 0)
        return 0;
    return ST(ag_graph_write_svg(V(0, F.g), V(1, F.path), NULL));
}
static long c_plan_new(int k) {
    return OBJ(ag_plan_new(V(0, F.g), NULL));
}
static long c_plan_run(int k) {
    return ST(ag_plan_run(V(0, F.p), V(1, F.gin), 3, V(2, F.outs), 16));
}
static long c_trace(int k) {
    return OBJ(ag_trace(V(0, trace_fn), NULL, V(1, &F.x), 1, NULL, NULL, NULL));
}
static long c_trace_module(int k) {
    return OBJ(ag_trace_module(V(0, F.m), V(1, &F.x), 1, NULL));
}

static long c_tree_flatten(int k) {
    ag_tensor **leaves = NULL;
    ag_treespec *spec = NULL;
    return ST(ag_tree_flatten(V(0, ag_tree_leaf(F.x)), V(1, &leaves), V(2, &spec)));
}
static long c_tree_unflatten(int k) {
    return OBJ(ag_tree_unflatten(V(0, ag_treespec_leaf()), V(1, &F.x), 1));
}
static long c_load_idx(int k) {
    return OBJ(ag_load_idx(V(0, F.path), true, 1.0));
}
static long c_fashion_mnist_load(int k) {
    ag_tensor *im = NULL, *lb = NULL;
    return ST(ag_fashion_mnist_load(V(0, F.dir), true, V(1, &im), V(2, &lb)));
}
static long c_zoo_build(int k) {
    ag_module *model = NULL;
    ag_tensor *in[8];
    int n = 0;
    return ST(ag_zoo_build(V(0, "mlp"), NULL, V(1, &model), V(2, in), 8, V(3, &n)));
}

/* name: what the message must start with (the ag_ prefix optional); nptr: the pointer
 * arguments V() numbers; optional: a bit per argument that may be NULL (the call succeeds);
 * valid_ok: the call with no NULL succeeds (false where the valid call needs something this
 * machine may lack: a dataset, graphviz). */
typedef struct tcase {
    const char *name;
    int nptr;
    unsigned optional;
    bool valid_ok;
    long (*call)(int k);
} tcase;

static const tcase cases[] = {
    /* tensors and op entry points */
    {"add.Tensor", 2, 0, true, c_add},
    {"mm", 2, 0, true, c_mm},
    {"linear", 3, 1u << 2, true, c_linear},
    {"where.self", 3, 0, true, c_where},
    {"cross_entropy_loss", 2, 0, true, c_cross_entropy},
    {"layer_norm", 4, 1u << 2 | 1u << 3, true, c_layer_norm},
    {"embedding", 2, 0, true, c_embedding},
    {"cat", 2, 0, true, c_cat},
    {"tensor_set_grad", 2, 1u << 1, true, c_tensor_set_grad},
    {"tensor_to_doubles", 2, 0, true, c_tensor_to_doubles},
    {"from_data", 2, 0, true, c_from_data},
    {"zeros", 1, 0, true, c_zeros},
    {"backward", 2, 1u << 1, true, c_backward},
    {"grad", 4, 1u << 1, true, c_grad},
    /* modules and optimizers */
    {"module_new", 3, 1u << 1 | 1u << 2, true, c_module_new},
    {"module_register_parameter", 3, 0, true, c_module_register_parameter},
    {"module_register_buffer", 3, 0, true, c_module_register_buffer},
    {"module_add_child", 3, 0, true, c_module_add_child},
    {"module_named_parameters", 2, 0, true, c_module_named_parameters},
    {"module_call", 3, 0, true, c_module_call},
    {"module_forward", 2, 0, true, c_module_forward},
    {"nn_append", 2, 0, true, c_nn_append},
    {"optim_sgd", 1, 0, true, c_optim_sgd},
    {"optim_adamw", 1, 0, true, c_optim_adamw},
    {"optim_step", 1, 0, true, c_optim_step},
    /* safetensors, data loaders, the zoo */
    {"module_save", 2, 0, true, c_module_save},
    {"module_load", 2, 0, true, c_module_load},
    {"load_idx", 1, 0, false, c_load_idx},
    {"fashion_mnist_load", 3, 0, false, c_fashion_mnist_load},
    {"zoo_build", 4, 0, true, c_zoo_build},
    /* export and joints, compile and compiled calls, partition */
    {"export_joint", 2, 0, true, c_export_joint},
    {"export_joint", 2, 0, false, c_export_joint_kw},
    {"joint_set_graph", 2, 0, true, c_joint_set_graph},
    {"joint_primals_from_flat", 3, 0, true, c_joint_primals_from_flat},
    {"joint_save", 3, 1u << 2, true, c_joint_save},
    {"joint_save_file", 2, 0, true, c_joint_save_file},
    {"joint_load", 1, 0, true, c_joint_load},
    {"joint_load_file", 1, 0, true, c_joint_load_file},
    {"joint_hash", 2, 0, true, c_joint_hash},
    {"compile_joint", 1, 0, true, c_compile_joint},
    {"compiled_call", 3, 0, true, c_compiled_call},
    {"compiled_call_module", 4, 0, true, c_compiled_call_module},
    {"partition", 3, 0, true, c_partition},
    /* the graph API, tracing and plans */
    {"graph_placeholder", 2, 1u << 1, true, c_graph_placeholder},
    {"graph_call", 3, 0, true, c_graph_call},
    {"graph_get_attr", 2, 0, true, c_graph_get_attr},
    {"graph_output", 2, 0, true, c_graph_output},
    {"node_replace_all_uses", 2, 1u << 1, true, c_node_replace_all_uses},
    {"graph_erase", 2, 0, true, c_graph_erase},
    {"graph_move_before", 3, 0, true, c_graph_move_before},
    {"graph_move_after", 3, 0, true, c_graph_move_after},
    {"node_rename", 3, 0, true, c_node_rename},
    {"node_set_val", 2, 0, true, c_node_set_val},
    {"node_meta_set", 2, 0, true, c_node_meta_set},
    {"node_custom_set", 2, 0, true, c_node_custom_set},
    {"node_set_desc", 2, 1u << 1, true, c_node_set_desc},
    {"graph_run", 3, 0, true, c_graph_run},
    {"graph_to_string", 1, 0, true, c_graph_to_string},
    {"graph_print", 2, 0, true, c_graph_print},
    {"graph_parse", 1, 0, true, c_graph_parse},
    {"graph_decompose", 2, 0, true, c_graph_decompose},
    {"graph_decompose_node", 3, 0, true, c_graph_decompose_node},
    {"graph_write_svg", 2, 0, false, c_graph_write_svg},
    {"plan_new", 1, 0, true, c_plan_new},
    {"plan_run", 3, 0, true, c_plan_run},
    {"trace", 2, 0, true, c_trace},
    {"trace_module", 2, 0, true, c_trace_module},
    /* pytrees */
    {"tree_flatten", 3, 0, true, c_tree_flatten},
    {"tree_unflatten", 2, 0, true, c_tree_unflatten},
};

static bool starts_with_name(const char *msg, const char *name) {
    size_t n = strlen(name);
    return strncmp(msg, name, n) == 0 && msg[n] == ':';
}

/* Runs case c with argument k NULL (k == -1: none) in a child; 0 when the policy held. */
static int run_case(const tcase *c, int k) {
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid == 0) {
        /* cmocka's handlers would turn a crash into a longjmp into its runner, in the child. */
        int sigs[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT};
        for (size_t i = 0; i < sizeof sigs / sizeof sigs[0]; i++)
            signal(sigs[i], SIG_DFL);
        build();
        ag_clear_error();
        long v = c->call(k);
        int bad = 0;
        char pre[96];
        snprintf(pre, sizeof pre, "ag_%s", c->name);
        const char *msg = ag_last_error();
        bool optional = k >= 0 && (c->optional >> k & 1u);
        if (k < 0 || optional) {
            if (v < 0 && (c->valid_ok || optional))
                bad = 1;
        } else if (v >= 0 || ag_last_status() != AG_EINVAL) {
            bad = 2;
        } else if (!starts_with_name(msg, c->name) && !starts_with_name(msg, pre)) {
            bad = 3;
        } else if (!strstr(msg, "NULL")) {
            bad = 4;
        }
        if (bad)
            fprintf(stderr,
                    "%s, argument %d NULL: check %d failed (returned %ld, status %d, "
                    "message '%s')\n",
                    c->name, k, bad, v, ag_last_status(), msg);
        remove(F.path);
        _exit(bad);
    }
    int st = 0;
    if (waitpid(pid, &st, 0) != pid)
        return 100;
    if (!WIFEXITED(st)) {
        fprintf(stderr, "%s, argument %d NULL: crashed with signal %d\n", c->name, k, WTERMSIG(st));
        return 101;
    }
    return WEXITSTATUS(st);
}

static void test_one_null_argument(void **st) {
    (void)st;
    int failures = 0, runs = 0, n = (int)(sizeof cases / sizeof cases[0]);
    for (int i = 0; i < n; i++)
        for (int k = -1; k < cases[i].nptr; k++, runs++)
            failures += run_case(&cases[i], k) != 0;
    if (failures)
        fail_msg("%d of %d calls broke the NULL policy", failures, runs);
}

/* A refused call has no other effect: the module keeps its parameters and children. */
static void test_refusal_has_no_effect(void **st) {
    (void)st;
    ag_module *m = ag_nn_linear(3, 2, true);
    assert_int_equal(ag_module_register_parameter(m, "extra", NULL), AG_EINVAL);
    tu_assert_error_contains("module_register_parameter: parameter 'extra' is NULL");
    assert_int_equal(ag_module_add_child(m, NULL, ag_nn_relu()), AG_EINVAL);
    assert_int_equal(ag_module_num_parameters(m), 8);
    assert_int_equal(ag_module_num_children(m), 0);
    assert_null(ag_module_param(m, "extra"));
    ag_module_free(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_one_null_argument),
        cmocka_unit_test(test_refusal_has_no_effect),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
