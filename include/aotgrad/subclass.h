/* Wrapper tensor subclasses: tensors made of inner tensors plus metadata, like PyTorch's
 * traceable wrapper subclasses (__tensor_flatten__ / __tensor_unflatten__ /
 * __torch_dispatch__).
 *
 * An instance is an ordinary ag_tensor handle with an outer dtype, sizes and strides, a pointer
 * to its type and its inner tensors; it has no data of its own. Every op called with an
 * instance among its arguments goes through the dispatcher as usual, with one change: autograd
 * stays ABOVE the subclass. Composite ops decompose first; then the op's meta function gives
 * the outer results' metadata, the op is recorded on the OUTER tensors by autograd (so
 * gradients of a subclass parameter are subclass tensors accumulated into its .grad), and
 * instead of the kernel (or the tracer) the type's dispatch callback runs, with grad mode off.
 * Dispatch calls ops on the inner tensors (ordinary calls: traced as usual while tracing) and
 * wraps the results, or returns plain tensors. In-place ops keep their outer self as result.
 *
 * Export and compile flatten instances: each inner tensor is one graph input or output,
 * described by SubclassGetAttrAOTInput(base=<the outer descriptor>, attr='a') or
 * SubclassGetAttrAOTOutput(base=..., attr='a') (recursively for nested subclasses); the
 * compiled callable unwraps subclass inputs, runs the dense graphs and rewraps outputs and
 * gradients (see include/aotgrad/export.h and compile.h). Shapes are static, so there are no
 * SubclassSizeAOTInput / SubclassStrideAOTInput inputs. A gradient must have its input's
 * structure (a TwoTensor parameter's gradient is a TwoTensor, a plain input's is plain; the
 * export refuses others), and a compiled instance output needs an instance gradient (no
 * coercion of a plain gradient). The optimizers update an instance parameter through its
 * plain inner tensors with the matching parts of its gradient. ag_trace refuses instances.
 *
 * Every aotgrad op returns tensors, so a dispatch wraps or returns tensors only (TwoTensor
 * comparisons give TwoTensors of bools). An instance has no values of its own: reading them
 * (ag_tensor_item, ag_tensor_data) is an error or NULL; read the inner tensors.
 *
 * Two types ship with the library:
 *   TwoTensor        attrs ("a", "b"): every op runs on a and on b and the results are wrapped
 *                    in TwoTensors (upstream's torch.testing._internal.two_tensor.TwoTensor).
 *                    Outer dtype, sizes and strides are a's.
 *   ScaledInt8Tensor attrs ("qdata", "scale"): qdata int8 of the outer shape, scale a 0-dim
 *                    f32 tensor (one scale per tensor, max|x| / 127), and the outer dtype as
 *                    metadata. Ops dequantize (qdata.to(dtype) * scale) and run densely,
 *                    returning plain tensors. It is meant for frozen weights (buffers): ops
 *                    that would write into it fail.
 *
 * Users define their own types by filling an ag_subclass_type (a static that outlives every
 * instance) and building instances with ag_subclass_new. __tensor_flatten__ is not a callback:
 * an instance stores its inner tensors and metadata, and ag_subclass_flatten returns them. */
#ifndef AOTGRAD_SUBCLASS_H
#define AOTGRAD_SUBCLASS_H

#include "core.h"
#include "optable.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Inner tensors a type may have. */
#define AG_SUBCLASS_MAX_INNER 8

typedef struct ag_subclass_type ag_subclass_type;

/* __tensor_unflatten__: builds an instance from its inner tensors (borrowed, in attrs order),
 * the metadata (meta_size bytes, or NULL) and the outer sizes. Returns what ag_subclass_new
 * returns, or NULL with a message naming the type and what is wrong. */
typedef ag_tensor *(*ag_subclass_unflatten_fn)(const ag_subclass_type *type,
                                               ag_tensor *const *inner, const void *meta, int ndim,
                                               const int64_t *outer_sizes);
/* __torch_dispatch__: runs `op` on `args` (all op->nargs arguments in schema order, defaults
 * filled; at least one tensor is an instance of `type`). Stores the op's outputs in outs and
 * returns their count, or a negative status. It runs inside an autorelease scope of the
 * dispatcher's, with grad mode off: results may be scope-owned (ops' results, ag_subclass_new)
 * and the dispatcher keeps what it needs. Each output must have the dtype and sizes the op's
 * meta function gives for the outer arguments. */
typedef int (*ag_subclass_dispatch_fn)(const ag_subclass_type *type, const ag_op *op,
                                       const ag_arg *args, int nargs, ag_tensor **outs);

struct ag_subclass_type {
    const char *name;         /* "TwoTensor": in messages */
    int ninner;               /* 1 .. AG_SUBCLASS_MAX_INNER */
    const char *const *attrs; /* the inner tensors' attribute names, as __tensor_flatten__ */
    size_t meta_size;         /* bytes of plain-data metadata copied into each instance (0: none) */
    ag_subclass_unflatten_fn unflatten;
    ag_subclass_dispatch_fn dispatch;
    void *ud; /* for the callbacks */
};

/* ---- instances ---- */

/* A new instance of `type` with outer dtype, sizes and strides (NULL: contiguous) over the
 * inner tensors (the instance takes a reference to each; none may be NULL) and a copy of
 * meta_size bytes at `meta` (NULL when the type has none). Returns a new reference (inside a
 * scope, a scope-owned one) or NULL. The instance does not require grad. */
AG_API ag_tensor *ag_subclass_new(const ag_subclass_type *type, ag_dtype dtype, int ndim,
                                  const int64_t *sizes, const int64_t *strides,
                                  ag_tensor *const *inner, const void *meta);
/* The type of t, or NULL for a plain tensor (and for NULL). */
AG_API const ag_subclass_type *ag_tensor_subclass(const ag_tensor *t);
/* __tensor_flatten__: stores t's inner tensors (borrowed, valid while t lives) in inner (room
 * for AG_SUBCLASS_MAX_INNER) and its metadata in *meta (may be NULL); returns their count, or
 * AG_EINVAL for a plain tensor. */
AG_API int ag_subclass_flatten(const ag_tensor *t, ag_tensor **inner, const void **meta);
/* Inner tensor i, or the one named attr; borrowed; NULL when absent or t is plain. */
AG_API ag_tensor *ag_subclass_inner(const ag_tensor *t, int i);
AG_API ag_tensor *ag_subclass_attr(const ag_tensor *t, const char *attr);
/* Calls type->unflatten. */
AG_API ag_tensor *ag_subclass_unflatten(const ag_subclass_type *type, ag_tensor *const *inner,
                                        const void *meta, int ndim, const int64_t *outer_sizes);
/* Flattens n tensors recursively into plain tensors (borrowed): a plain tensor is itself, an
 * instance its inner tensors, flattened in turn. This is the order in which an exported joint
 * takes its primals. Stores up to max and returns the total count, or AG_EINVAL for a negative
 * count or a NULL array that must hold elements. */
AG_API int ag_subclass_flatten_tensors(ag_tensor *const *ts, int n, ag_tensor **out, int max);

/* For dispatch callbacks: calls op with every instance of `type` among args (also inside
 * tensor lists) replaced by its inner tensor k. Outputs as ag_op_call gives them (owned by the
 * open scope); returns their count or a negative status. */
AG_API int ag_subclass_call_inner(const ag_op *op, const ag_arg *args, int nargs,
                                  const ag_subclass_type *type, int k, ag_tensor **outs);

/* ---- TwoTensor ---- */
/* ---- finding types by name (a saved joint names its types: ag_joint_load) ---- */

/* Registers a user type under its name so ag_subclass_type_find (and so ag_joint_load) finds
 * it. The type must outlive the process's use of the library (a static). Registering the same
 * type again is a no-op; another type under a registered name (TwoTensor and ScaledInt8Tensor
 * are built in) is an error. Thread-safe. */
AG_API int ag_subclass_type_register(const ag_subclass_type *type);
/* The built-in or registered type with this name, or NULL. Thread-safe. */
AG_API const ag_subclass_type *ag_subclass_type_find(const char *name);

AG_API const ag_subclass_type *ag_two_tensor_type(void); /* static: never freed */
/* TwoTensor(a, b): a and b must have the same dtype, sizes and strides. The instance takes a
 * reference to each; returns a new reference (inside a scope, a scope-owned one) or NULL. */
AG_API ag_tensor *ag_two_tensor(ag_tensor *a, ag_tensor *b);

/* ---- ScaledInt8Tensor ---- */
AG_API const ag_subclass_type *ag_scaled_int8_type(void); /* static: never freed */
/* Quantizes a plain float tensor x (borrowed): scale = max(max|x|, 1e-12) / 127 (a 0-dim f32
 * tensor), qdata = x / scale rounded half away from zero, clamped to [-127, 127], as int8; the
 * outer dtype (what ops see) is x's. Made of ops (run without grad), so it works on data-less
 * tensors too. Returns a new reference (inside a scope, a scope-owned one) or NULL. */
AG_API ag_tensor *ag_scaled_int8_quantize(ag_tensor *x);
/* qdata.to(dtype) * scale: a plain tensor, returned as ops return theirs. */
AG_API ag_tensor *ag_scaled_int8_dequantize(ag_tensor *t);

#ifdef __cplusplus
}
#endif
#endif
