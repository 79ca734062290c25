/* Descriptors: what each input and output of an exported joint graph means, as PyTorch's
 * AOTAutograd descriptors (torch/_functorch/_aot_autograd/descriptors.py).
 *
 * An input descriptor says how to obtain graph input i from the outer, flat inputs
 * (`ParamAOTInput(target='linear.weight')`, `TangentAOTInput(output=PlainAOTOutput(idx=0))`);
 * an output descriptor says where graph output j goes in the outer outputs
 * (`GradAOTOutput(grad_of=ParamAOTInput(target='linear.weight'))`).
 *
 * One value type, `ag_desc`, covers every upstream class: a kind (the class) and at most one of
 * each field: a string (`target` or `attr`), an integer (`idx`) and one nested descriptor
 * (`output`, `base_of`, `mutated_input`, `grad_of` or `base`). Values are immutable and
 * refcounted; compare them with ag_desc_equal and hash them with ag_desc_hash (structural and
 * the same in every run), so they can key ag_desc_map, the insertion-ordered map the FX
 * utilities return.
 *
 * Nesting follows upstream's pipeline layering and is checked by every constructor and by the
 * parser: TangentAOTInput wraps only a differentiable output (Plain, InputMutation,
 * IntermediateBase, MetadataMutation, Grad), GradAOTOutput only a differentiable input (Param,
 * Buffer, Plain, ViewBase, SyntheticBase, Tangent); fields typed AOTInput take only inputs and
 * fields typed AOTOutput only outputs. Subclass descriptors therefore wrap autograd ones and
 * never the reverse: SubclassGetAttrAOTInput(base=TangentAOTInput(...), attr='a') is legal,
 * TangentAOTInput(output=SubclassGetAttrAOTOutput(...)) is not. Nesting depth is limited to
 * AG_DESC_MAX_DEPTH (real descriptors nest at most a handful of levels).
 *
 * Text. ag_desc_repr prints exactly the Python dataclass repr (strings as Python's repr()
 * quotes them), ag_desc_expr upstream's expr(), and ag_desc_parse reads a repr back.
 *
 * Ownership: constructors and ag_desc_parse return a new reference (caller releases it with
 * ag_desc_release); a constructor given a nested descriptor takes its own reference to it, so
 * the caller keeps (and still releases) its own. Accessors return borrowed pointers valid while
 * the descriptor lives. Strings passed in are copied. Refcounts are atomic: a descriptor may be
 * shared, retained and released across threads. */
#ifndef AOTGRAD_DESC_H
#define AOTGRAD_DESC_H

#include "core.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ag_desc ag_desc;

/* The descriptor classes. Append-only: values are stable once published (AG_DESC_NKINDS grows). */
typedef enum ag_desc_kind {
    /* AOTInput */
    AG_DESC_PARAM = 0,                   /* ParamAOTInput(target)                 diff */
    AG_DESC_BUFFER,                      /* BufferAOTInput(target)                diff */
    AG_DESC_PLAIN_INPUT,                 /* PlainAOTInput(idx)                    diff */
    AG_DESC_DUMMY_INPUT,                 /* DummyAOTInput(idx) */
    AG_DESC_TANGENT,                     /* TangentAOTInput(output)               diff */
    AG_DESC_VIEW_BASE,                   /* ViewBaseAOTInput(base_of: input)      diff */
    AG_DESC_SYNTHETIC_BASE,              /* SyntheticBaseAOTInput(base_of: input) diff */
    AG_DESC_PHILOX_FORWARD_SEED,         /* PhiloxForwardSeedAOTInput() */
    AG_DESC_PHILOX_FORWARD_BASE_OFFSET,  /* PhiloxForwardBaseOffsetAOTInput() */
    AG_DESC_PHILOX_BACKWARD_SEED,        /* PhiloxBackwardSeedAOTInput() */
    AG_DESC_PHILOX_BACKWARD_BASE_OFFSET, /* PhiloxBackwardBaseOffsetAOTInput() */
    AG_DESC_FORWARD_TOKEN_INPUT,         /* ForwardTokenAOTInput(idx) */
    AG_DESC_BACKWARD_TOKEN_INPUT,        /* BackwardTokenAOTInput(idx) */
    AG_DESC_SUBCLASS_GETATTR_INPUT,      /* SubclassGetAttrAOTInput(base: input, attr) */
    AG_DESC_SUBCLASS_SIZE_INPUT,         /* SubclassSizeAOTInput(base: input, idx) */
    AG_DESC_SUBCLASS_STRIDE_INPUT,       /* SubclassStrideAOTInput(base: input, idx) */
    /* AOTOutput */
    AG_DESC_PLAIN_OUTPUT,                    /* PlainAOTOutput(idx)                   diff */
    AG_DESC_INPUT_MUTATION,                  /* InputMutationAOTOutput(mutated_input) diff */
    AG_DESC_INTERMEDIATE_BASE,               /* IntermediateBaseAOTOutput(base_of: output) diff */
    AG_DESC_METADATA_MUTATION,               /* MetadataMutationAOTOutput(idx)        diff */
    AG_DESC_GRAD,                            /* GradAOTOutput(grad_of)                diff */
    AG_DESC_PHILOX_UPDATED_FORWARD_OFFSET,   /* PhiloxUpdatedForwardOffsetAOTOutput() */
    AG_DESC_PHILOX_UPDATED_BACKWARD_OFFSET,  /* PhiloxUpdatedBackwardOffsetAOTOutput() */
    AG_DESC_FORWARD_TOKEN_OUTPUT,            /* ForwardTokenAOTOutput(idx) */
    AG_DESC_BACKWARD_TOKEN_OUTPUT,           /* BackwardTokenAOTOutput(idx) */
    AG_DESC_SUBCLASS_GETATTR_OUTPUT,         /* SubclassGetAttrAOTOutput(base: output, attr) */
    AG_DESC_SUBCLASS_SIZE_OUTPUT,            /* SubclassSizeAOTOutput(base: output, idx) */
    AG_DESC_SUBCLASS_STRIDE_OUTPUT,          /* SubclassStrideAOTOutput(base: output, idx) */
    AG_DESC_DUMMY_OUTPUT,                    /* DummyAOTOutput(idx) */
    AG_DESC_SAVED_FOR_BACKWARDS,             /* SavedForBackwardsAOTOutput(idx) */
    AG_DESC_SAVED_FOR_BACKWARDS_NO_VC_CHECK, /* SavedForBackwardsNoVcCheckAOTOutput(idx) */
    AG_DESC_NKINDS
} ag_desc_kind;

/* The sections of a joint's calling convention (ag_joint_layout in export.h), in the order they
 * come. Every descriptor kind belongs to one; a joint's inputs are its input sections one after
 * the other, its outputs likewise. Append-only. */
typedef enum ag_section {
    AG_SEC_NONE = -1,
    /* inputs */
    AG_SEC_IN_FW_TOKENS = 0, /* ForwardTokenAOTInput */
    AG_SEC_IN_PRIMALS,       /* Param, Buffer, Plain, ViewBase, SyntheticBase, Dummy inputs */
    AG_SEC_IN_SAVED,         /* a backward graph's saved values (told by position, not kind) */
    AG_SEC_IN_TANGENTS,      /* TangentAOTInput */
    AG_SEC_IN_BW_TOKENS,     /* BackwardTokenAOTInput */
    AG_SEC_IN_FW_RNG,        /* PhiloxForwardSeedAOTInput, PhiloxForwardBaseOffsetAOTInput */
    AG_SEC_IN_BW_RNG,        /* PhiloxBackwardSeedAOTInput, PhiloxBackwardBaseOffsetAOTInput */
    /* outputs */
    AG_SEC_OUT_FW_TOKENS,          /* ForwardTokenAOTOutput */
    AG_SEC_OUT_MUTATIONS,          /* InputMutationAOTOutput */
    AG_SEC_OUT_USER,               /* PlainAOTOutput, DummyAOTOutput */
    AG_SEC_OUT_METADATA_MUTATIONS, /* MetadataMutationAOTOutput */
    AG_SEC_OUT_INTERMEDIATE_BASES, /* IntermediateBaseAOTOutput */
    AG_SEC_OUT_FW_RNG_OFFSET,      /* PhiloxUpdatedForwardOffsetAOTOutput */
    AG_SEC_OUT_SAVED,              /* SavedForBackwards(NoVcCheck)AOTOutput: a forward graph's */
    AG_SEC_OUT_GRADS,              /* GradAOTOutput, or None (an input without a gradient) */
    AG_SEC_OUT_BW_RNG_OFFSET,      /* PhiloxUpdatedBackwardOffsetAOTOutput */
    AG_SEC_OUT_BW_TOKENS,          /* BackwardTokenAOTOutput */
    AG_SEC_COUNT
} ag_section;

/* Deepest nesting a descriptor may have (a descriptor with no nested one has depth 1). */
#define AG_DESC_MAX_DEPTH 64

/* Which fields a kind has (ag_desc_kind_fields). */
#define AG_DESC_HAS_STR 1u    /* target (Param, Buffer) or attr (SubclassGetAttr*) */
#define AG_DESC_HAS_IDX 2u    /* idx */
#define AG_DESC_HAS_NESTED 4u /* output, base_of, mutated_input, grad_of or base */

/* ---- constructors: a new reference, or NULL + ag_last_error() (AG_EINVAL for a NULL or
 * wrongly nested argument, AG_ENOMEM). Nested descriptors are retained, not stolen. ---- */

AG_API ag_desc *ag_desc_param(const char *target);
AG_API ag_desc *ag_desc_buffer(const char *target);
AG_API ag_desc *ag_desc_plain_input(int64_t idx);
AG_API ag_desc *ag_desc_dummy_input(int64_t idx);
AG_API ag_desc *ag_desc_tangent(const ag_desc *output);
AG_API ag_desc *ag_desc_view_base(const ag_desc *base_of);
AG_API ag_desc *ag_desc_synthetic_base(const ag_desc *base_of);
AG_API ag_desc *ag_desc_philox_forward_seed(void);
AG_API ag_desc *ag_desc_philox_forward_base_offset(void);
AG_API ag_desc *ag_desc_philox_backward_seed(void);
AG_API ag_desc *ag_desc_philox_backward_base_offset(void);
AG_API ag_desc *ag_desc_forward_token_input(int64_t idx);
AG_API ag_desc *ag_desc_backward_token_input(int64_t idx);
AG_API ag_desc *ag_desc_subclass_getattr_input(const ag_desc *base, const char *attr);
AG_API ag_desc *ag_desc_subclass_size_input(const ag_desc *base, int64_t idx);
AG_API ag_desc *ag_desc_subclass_stride_input(const ag_desc *base, int64_t idx);

AG_API ag_desc *ag_desc_plain_output(int64_t idx);
AG_API ag_desc *ag_desc_input_mutation(const ag_desc *mutated_input);
AG_API ag_desc *ag_desc_intermediate_base(const ag_desc *base_of);
AG_API ag_desc *ag_desc_metadata_mutation(int64_t idx);
AG_API ag_desc *ag_desc_grad(const ag_desc *grad_of);
AG_API ag_desc *ag_desc_philox_updated_forward_offset(void);
AG_API ag_desc *ag_desc_philox_updated_backward_offset(void);
AG_API ag_desc *ag_desc_forward_token_output(int64_t idx);
AG_API ag_desc *ag_desc_backward_token_output(int64_t idx);
AG_API ag_desc *ag_desc_subclass_getattr_output(const ag_desc *base, const char *attr);
AG_API ag_desc *ag_desc_subclass_size_output(const ag_desc *base, int64_t idx);
AG_API ag_desc *ag_desc_subclass_stride_output(const ag_desc *base, int64_t idx);
AG_API ag_desc *ag_desc_dummy_output(int64_t idx);
AG_API ag_desc *ag_desc_saved_for_backwards(int64_t idx);
AG_API ag_desc *ag_desc_saved_for_backwards_no_vc_check(int64_t idx);

/* Any kind from its fields, for table-driven code. Fields the kind lacks must be NULL / 0;
 * fields it has must be non-NULL (see ag_desc_kind_fields). */
AG_API ag_desc *ag_desc_new(ag_desc_kind kind, const ag_desc *nested, const char *str, int64_t idx);

/* Takes a new reference (the refcount is bookkeeping, not part of the value, hence const);
 * returns d. NULL gives NULL. */
AG_API ag_desc *ag_desc_retain(const ag_desc *d);
/* Drops one reference; the last one frees d and releases its nested descriptor. NULL: no-op. */
AG_API void ag_desc_release(ag_desc *d);

/* ---- kinds ---- */

/* The upstream class name ("ParamAOTInput"); NULL for a value outside the enum. */
AG_API const char *ag_desc_kind_name(ag_desc_kind kind);
/* AG_DESC_HAS_* bits of the kind's fields; 0 for a value outside the enum. */
AG_API unsigned ag_desc_kind_fields(ag_desc_kind kind);
/* The kind's field names as upstream spells them ("target", "attr", "idx", "output",
 * "base_of", "mutated_input", "grad_of", "base"); NULL when the kind lacks that field. */
AG_API const char *ag_desc_kind_str_field(ag_desc_kind kind);
AG_API const char *ag_desc_kind_nested_field(ag_desc_kind kind);

/* ---- accessors (d must not be NULL unless stated) ---- */

AG_API ag_desc_kind ag_desc_kind_of(const ag_desc *d);
AG_API bool ag_desc_is_input(const ag_desc *d);  /* an AOTInput; false for NULL */
AG_API bool ag_desc_is_output(const ag_desc *d); /* an AOTOutput; false for NULL */
/* ParamAOTInput/BufferAOTInput's target; NULL for other kinds. Borrowed. */
AG_API const char *ag_desc_target(const ag_desc *d);
/* SubclassGetAttr*'s attr; NULL for other kinds. Borrowed. */
AG_API const char *ag_desc_attr(const ag_desc *d);
/* The idx field; 0 for kinds without one. */
AG_API int64_t ag_desc_idx(const ag_desc *d);
/* The nested descriptor (output, base_of, mutated_input, grad_of or base); NULL for kinds
 * without one. Borrowed: ag_desc_retain it to keep it beyond d. */
AG_API const ag_desc *ag_desc_nested(const ag_desc *d);
/* 1 + the nested descriptor's depth. */
AG_API int ag_desc_depth(const ag_desc *d);

/* ---- predicates, as upstream's (all false for NULL) ---- */

/* The section of a joint's calling convention a descriptor belongs to; subclass descriptors
 * (SubclassGetAttr/Size/Stride) belong to their base's. NULL: AG_SEC_OUT_GRADS (a None output
 * is an input's missing gradient). */
AG_API ag_section ag_desc_section(const ag_desc *d);
/* "primals", "tangents", "user_outputs", ...; NULL outside the enum. */
AG_API const char *ag_section_name(ag_section s);
AG_API bool ag_section_is_input(ag_section s);
AG_API bool ag_desc_is_param(const ag_desc *d);  /* Param; SubclassGetAttrAOTInput asks its base */
AG_API bool ag_desc_is_buffer(const ag_desc *d); /* Buffer; SubclassGetAttrAOTInput asks its base */
AG_API bool
ag_desc_is_tangent(const ag_desc *d);          /* Tangent; SubclassGetAttrAOTInput asks its base */
AG_API bool ag_desc_is_grad(const ag_desc *d); /* Grad; SubclassGetAttrAOTOutput asks its base */
/* A DifferentiableAOTInput / DifferentiableAOTOutput (marked "diff" in the enum above). */
AG_API bool ag_desc_is_differentiable(const ag_desc *d);

/* ---- value semantics ---- */

/* Structural equality (kind and every field, recursively); two NULLs are equal. */
AG_API bool ag_desc_equal(const ag_desc *a, const ag_desc *b);
/* 64-bit FNV-1a over the kind and fields, recursively; equal values hash equal, and the value
 * is the same on every run and platform. */
AG_API uint64_t ag_desc_hash(const ag_desc *d);

/* ---- text ---- */

/* Writes the Python dataclass repr of d ("None" for NULL) into buf as snprintf does: at most
 * n bytes including the terminating NUL (buf may be NULL when n is 0). Returns the full length
 * (excluding the NUL), so a result >= n means the text was truncated. Allocates nothing. */
AG_API size_t ag_desc_repr(const ag_desc *d, char *buf, size_t n);
/* The same for upstream's expr() (`self.get_parameter('linear.weight')`, `args[0]`,
 * `__grad(self.get_parameter('fc.weight'))`, ...); "None" for NULL. */
AG_API size_t ag_desc_expr(const ag_desc *d, char *buf, size_t n);

/* Parses one repr at the start of `text` (leading whitespace skipped). Accepts the part of
 * Python's call syntax that these classes need: keyword or positional arguments (keywords in any
 * order), whitespace between tokens, a trailing comma, decimal integers, single- or
 * double-quoted strings (no prefixes, no implicit concatenation) with Python's
 * escapes (\\ \' \" \n \t \r \a \b \f \v \ooo \xhh \uhhhh \Uhhhhhhhh; \udc80..\udcff stand for
 * the raw bytes 0x80..0xff, as Python's surrogateescape). With `consumed` NULL the whole text
 * must be the descriptor (trailing whitespace allowed); otherwise *consumed receives the number
 * of bytes read, up to and including the closing parenthesis. Returns a new reference, or NULL
 * with AG_EFORMAT and a message naming the 0-based column (byte offset into text) and what was
 * expected ("desc: column 14: expected 'target=' ...") or AG_ENOMEM. "None" is not a
 * descriptor: callers reading optional descriptors check for it themselves. */
AG_API ag_desc *ag_desc_parse(const char *text, size_t *consumed);

/* ---- an insertion-ordered hash map keyed by descriptor value (Python's dict) ----
 *
 * Keys compare with ag_desc_equal, so a structurally equal descriptor built elsewhere finds the
 * entry. The map holds a reference to each key; values are opaque pointers it never touches.
 * Entries keep their insertion order (indices 0..size-1); overwriting a key keeps its position
 * and its first key object. There is no removal: filter by building a new map. */
typedef struct ag_desc_map ag_desc_map;

AG_API ag_desc_map *ag_desc_map_new(void);    /* NULL + AG_ENOMEM */
AG_API void ag_desc_map_free(ag_desc_map *m); /* releases the keys; NULL: no-op */
/* Inserts or overwrites. 0, or AG_EINVAL (NULL map or key) / AG_ENOMEM with the map unchanged. */
AG_API int ag_desc_map_put(ag_desc_map *m, const ag_desc *key, void *value);
/* The value stored for key, NULL when absent (use ag_desc_map_find to tell a NULL value). */
AG_API void *ag_desc_map_get(const ag_desc_map *m, const ag_desc *key);
/* The key's index in insertion order, or -1 when absent. */
AG_API int64_t ag_desc_map_find(const ag_desc_map *m, const ag_desc *key);
AG_API int64_t ag_desc_map_size(const ag_desc_map *m); /* 0 for NULL */
/* Entry i (0 <= i < size) in insertion order: the key (borrowed) and value; NULL out of range. */
AG_API const ag_desc *ag_desc_map_key(const ag_desc_map *m, int64_t i);
AG_API void *ag_desc_map_value(const ag_desc_map *m, int64_t i);
/* Replaces entry i's value; AG_EINVAL when i is out of range. */
AG_API int ag_desc_map_set_value(ag_desc_map *m, int64_t i, void *value);

#ifdef __cplusplus
}
#endif
#endif
