/* Descriptors (AOTInput / AOTOutput): construction with upstream's nesting rules, value
 * equality and hashing, the Python dataclass repr, upstream's expr(), and a parser for reprs.
 *
 * In: fields from the exporter (FQNs, indices, nested descriptors) or repr text from a printed
 * graph. Out: immutable refcounted `ag_desc` values that graph nodes carry and that key the
 * FX-utility maps (desc_map.c).
 *
 * Everything about a kind lives in one row of `kinds[]`: class name, input or output,
 * differentiable or not, its fields, what its nested field accepts, and its expr() template.
 * Constructors, repr, expr, parse, equality and hashing read that row; no function switches on
 * the kind. Field order in a repr is upstream's declaration order, which for every class is
 * nested descriptor, then string, then idx. */
#include "internal.h"
#include "pystr.h"

#include <stdatomic.h>
#include <stdio.h>

struct ag_desc {
    atomic_int_fast64_t refcount;
    uint64_t hash;   /* computed once: values are immutable */
    ag_desc *nested; /* owned reference, or NULL */
    int64_t idx;
    ag_desc_kind kind;
    int depth;  /* 1 + nested's depth */
    size_t len; /* strlen(str); the string exists only for kinds with AG_DESC_HAS_STR */
    char str[];
};

/* What a nested field accepts. */
typedef enum nest_rule {
    NEST_NONE = 0,
    NEST_INPUT,      /* any AOTInput */
    NEST_OUTPUT,     /* any AOTOutput */
    NEST_DIFF_INPUT, /* a DifferentiableAOTInput (GradAOTOutput.grad_of) */
    NEST_DIFF_OUTPUT /* a DifferentiableAOTOutput (TangentAOTInput.output) */
} nest_rule;

typedef struct kind_info {
    const char *name; /* upstream class name */
    bool output;      /* AOTOutput (else AOTInput) */
    bool diff;        /* Differentiable* */
    unsigned fields;  /* AG_DESC_HAS_* */
    const char *nested_field, *str_field;
    nest_rule nest;
    /* expr() template: %n the nested expr, %r the string's Python repr, %s the raw string,
     * %d idx; other characters are copied. */
    const char *expr;
    /* Where in a joint's calling convention it goes; AG_SEC_NONE: where its base goes
     * (subclass inner tensors). */
    ag_section section;
} kind_info;

#define S AG_DESC_HAS_STR
#define I AG_DESC_HAS_IDX
#define N AG_DESC_HAS_NESTED

static const kind_info kinds[AG_DESC_NKINDS] = {
    [AG_DESC_PARAM] = {"ParamAOTInput", false, true, S, NULL, "target", NEST_NONE,
                       "self.get_parameter(%r)", AG_SEC_IN_PRIMALS},
    [AG_DESC_BUFFER] = {"BufferAOTInput", false, true, S, NULL, "target", NEST_NONE,
                        "self.get_buffer(%r)", AG_SEC_IN_PRIMALS},
    [AG_DESC_PLAIN_INPUT] = {"PlainAOTInput", false, true, I, NULL, NULL, NEST_NONE, "args[%d]",
                             AG_SEC_IN_PRIMALS},
    [AG_DESC_DUMMY_INPUT] = {"DummyAOTInput", false, false, I, NULL, NULL, NEST_NONE, "__dummy%d",
                             AG_SEC_IN_PRIMALS},
    [AG_DESC_TANGENT] = {"TangentAOTInput", false, true, N, "output", NULL, NEST_DIFF_OUTPUT,
                         "__output_tangent(%n)", AG_SEC_IN_TANGENTS},
    [AG_DESC_VIEW_BASE] = {"ViewBaseAOTInput", false, true, N, "base_of", NULL, NEST_INPUT,
                           "%n._base", AG_SEC_IN_PRIMALS},
    [AG_DESC_SYNTHETIC_BASE] = {"SyntheticBaseAOTInput", false, true, N, "base_of", NULL,
                                NEST_INPUT, "__make_synthetic_base(%n)", AG_SEC_IN_PRIMALS},
    [AG_DESC_PHILOX_FORWARD_SEED] = {"PhiloxForwardSeedAOTInput", false, false, 0, NULL, NULL,
                                     NEST_NONE, "__philox_forward_seed", AG_SEC_IN_FW_RNG},
    [AG_DESC_PHILOX_FORWARD_BASE_OFFSET] = {"PhiloxForwardBaseOffsetAOTInput", false, false, 0,
                                            NULL, NULL, NEST_NONE, "__philox_forward_base_offset",
                                            AG_SEC_IN_FW_RNG},
    [AG_DESC_PHILOX_BACKWARD_SEED] = {"PhiloxBackwardSeedAOTInput", false, false, 0, NULL, NULL,
                                      NEST_NONE, "__philox_backward_seed", AG_SEC_IN_BW_RNG},
    [AG_DESC_PHILOX_BACKWARD_BASE_OFFSET] = {"PhiloxBackwardBaseOffsetAOTInput", false, false, 0,
                                             NULL, NULL, NEST_NONE, "__philox_backward_base_offset",
                                             AG_SEC_IN_BW_RNG},
    [AG_DESC_FORWARD_TOKEN_INPUT] = {"ForwardTokenAOTInput", false, false, I, NULL, NULL, NEST_NONE,
                                     "__forward_token%d", AG_SEC_IN_FW_TOKENS},
    [AG_DESC_BACKWARD_TOKEN_INPUT] = {"BackwardTokenAOTInput", false, false, I, NULL, NULL,
                                      NEST_NONE, "__backward_token%d", AG_SEC_IN_BW_TOKENS},
    [AG_DESC_SUBCLASS_GETATTR_INPUT] = {"SubclassGetAttrAOTInput", false, false, N | S, "base",
                                        "attr", NEST_INPUT, "%n.%s", AG_SEC_NONE},
    [AG_DESC_SUBCLASS_SIZE_INPUT] = {"SubclassSizeAOTInput", false, false, N | I, "base", NULL,
                                     NEST_INPUT, "%n.size(%d)", AG_SEC_NONE},
    [AG_DESC_SUBCLASS_STRIDE_INPUT] = {"SubclassStrideAOTInput", false, false, N | I, "base", NULL,
                                       NEST_INPUT, "%n.stride(%d)", AG_SEC_NONE},
    [AG_DESC_PLAIN_OUTPUT] = {"PlainAOTOutput", true, true, I, NULL, NULL, NEST_NONE, "output[%d]",
                              AG_SEC_OUT_USER},
    [AG_DESC_INPUT_MUTATION] = {"InputMutationAOTOutput", true, true, N, "mutated_input", NULL,
                                NEST_INPUT, "__input_mutation(%n)", AG_SEC_OUT_MUTATIONS},
    [AG_DESC_INTERMEDIATE_BASE] = {"IntermediateBaseAOTOutput", true, true, N, "base_of", NULL,
                                   NEST_OUTPUT, "__intermediate_base(%n)",
                                   AG_SEC_OUT_INTERMEDIATE_BASES},
    [AG_DESC_METADATA_MUTATION] = {"MetadataMutationAOTOutput", true, true, I, NULL, NULL,
                                   NEST_NONE, "__aliased_arg_with_metadata_mutation%d",
                                   AG_SEC_OUT_METADATA_MUTATIONS},
    [AG_DESC_GRAD] = {"GradAOTOutput", true, true, N, "grad_of", NULL, NEST_DIFF_INPUT,
                      "__grad(%n)", AG_SEC_OUT_GRADS},
    [AG_DESC_PHILOX_UPDATED_FORWARD_OFFSET] = {"PhiloxUpdatedForwardOffsetAOTOutput", true, false,
                                               0, NULL, NULL, NEST_NONE,
                                               "__philox_updated_forward_offset",
                                               AG_SEC_OUT_FW_RNG_OFFSET},
    [AG_DESC_PHILOX_UPDATED_BACKWARD_OFFSET] = {"PhiloxUpdatedBackwardOffsetAOTOutput", true, false,
                                                0, NULL, NULL, NEST_NONE,
                                                "__philox_updated_backward_offset",
                                                AG_SEC_OUT_BW_RNG_OFFSET},
    [AG_DESC_FORWARD_TOKEN_OUTPUT] = {"ForwardTokenAOTOutput", true, false, I, NULL, NULL,
                                      NEST_NONE, "__forward_token%d", AG_SEC_OUT_FW_TOKENS},
    [AG_DESC_BACKWARD_TOKEN_OUTPUT] = {"BackwardTokenAOTOutput", true, false, I, NULL, NULL,
                                       NEST_NONE, "__backward_token%d", AG_SEC_OUT_BW_TOKENS},
    [AG_DESC_SUBCLASS_GETATTR_OUTPUT] = {"SubclassGetAttrAOTOutput", true, false, N | S, "base",
                                         "attr", NEST_OUTPUT, "%n.%s", AG_SEC_NONE},
    [AG_DESC_SUBCLASS_SIZE_OUTPUT] = {"SubclassSizeAOTOutput", true, false, N | I, "base", NULL,
                                      NEST_OUTPUT, "%n.size(%d)", AG_SEC_NONE},
    [AG_DESC_SUBCLASS_STRIDE_OUTPUT] = {"SubclassStrideAOTOutput", true, false, N | I, "base", NULL,
                                        NEST_OUTPUT, "%n.stride(%d)", AG_SEC_NONE},
    [AG_DESC_DUMMY_OUTPUT] = {"DummyAOTOutput", true, false, I, NULL, NULL, NEST_NONE, "__dummy%d",
                              AG_SEC_OUT_USER},
    [AG_DESC_SAVED_FOR_BACKWARDS] = {"SavedForBackwardsAOTOutput", true, false, I, NULL, NULL,
                                     NEST_NONE, "__saved_for_backwards_%d", AG_SEC_OUT_SAVED},
    [AG_DESC_SAVED_FOR_BACKWARDS_NO_VC_CHECK] = {"SavedForBackwardsNoVcCheckAOTOutput", true, false,
                                                 I, NULL, NULL, NEST_NONE,
                                                 "__saved_for_backwards_no_vc_check_%d",
                                                 AG_SEC_OUT_SAVED},
};

#undef S
#undef I
#undef N

static bool kind_ok(ag_desc_kind k) {
    return (unsigned)k < AG_DESC_NKINDS;
}

/* ---- output buffer with snprintf semantics ---- */

typedef struct sbuf {
    char *buf;
    size_t n;   /* capacity including the NUL */
    size_t len; /* bytes the full text needs */
} sbuf;

static void sb_putc(sbuf *b, char c) {
    if (b->len + 1 < b->n)
        b->buf[b->len] = c;
    b->len++;
}

static void sb_puts(sbuf *b, const char *s) {
    while (*s)
        sb_putc(b, *s++);
}

static void sb_printf(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_printf(sbuf *b, const char *fmt, ...) {
    char tmp[32];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    sb_puts(b, tmp);
}

static size_t sb_finish(sbuf *b) {
    if (b->n)
        b->buf[b->len < b->n ? b->len : b->n - 1] = 0;
    return b->len;
}

/* Python's repr() of a str (src/core/pystr.c), appended to b. */
static void py_repr_str(sbuf *b, const char *str, size_t n) {
    size_t room = b->len < b->n ? b->n - b->len : 0;
    b->len += ag__pystr_repr(str, n, room ? b->buf + b->len : NULL, room);
}

/* ---- repr and expr ---- */

static void repr_into(sbuf *b, const ag_desc *d) {
    if (!d) {
        sb_puts(b, "None");
        return;
    }
    const kind_info *ki = &kinds[d->kind];
    sb_puts(b, ki->name);
    sb_putc(b, '(');
    const char *sep = "";
    if (ki->fields & AG_DESC_HAS_NESTED) {
        sb_puts(b, ki->nested_field);
        sb_putc(b, '=');
        repr_into(b, d->nested);
        sep = ", ";
    }
    if (ki->fields & AG_DESC_HAS_STR) {
        sb_puts(b, sep);
        sb_puts(b, ki->str_field);
        sb_putc(b, '=');
        py_repr_str(b, d->str, d->len);
        sep = ", ";
    }
    if (ki->fields & AG_DESC_HAS_IDX) {
        sb_puts(b, sep);
        sb_printf(b, "idx=%lld", (long long)d->idx);
    }
    sb_putc(b, ')');
}

static void expr_into(sbuf *b, const ag_desc *d) {
    if (!d) {
        sb_puts(b, "None");
        return;
    }
    for (const char *t = kinds[d->kind].expr; *t; t++) {
        if (t[0] != '%') {
            sb_putc(b, *t);
            continue;
        }
        switch (*++t) {
        case 'n':
            expr_into(b, d->nested);
            break;
        case 'r':
            py_repr_str(b, d->str, d->len);
            break;
        case 's':
            for (size_t i = 0; i < d->len; i++)
                sb_putc(b, d->str[i]);
            break;
        case 'd':
            sb_printf(b, "%lld", (long long)d->idx);
            break;
        }
    }
}

size_t ag_desc_repr(const ag_desc *d, char *buf, size_t n) {
    sbuf b = {buf, buf ? n : 0, 0};
    repr_into(&b, d);
    return sb_finish(&b);
}

size_t ag_desc_expr(const ag_desc *d, char *buf, size_t n) {
    sbuf b = {buf, buf ? n : 0, 0};
    expr_into(&b, d);
    return sb_finish(&b);
}

/* A repr for error messages, shortened with "..." past the buffer. */
static const char *short_repr(const ag_desc *d, char *buf, size_t n) {
    if (ag_desc_repr(d, buf, n) >= n && n > 4)
        memcpy(buf + n - 4, "...", 4);
    return buf;
}

/* ---- hashing: 64-bit FNV-1a over explicit little-endian bytes, so it is the same on every
 * run and platform ---- */

#define FNV_OFFSET 0xcbf29ce484222325ull
#define FNV_PRIME 0x100000001b3ull

static uint64_t fnv_bytes(uint64_t h, const void *p, size_t n) {
    const unsigned char *s = p;
    for (size_t i = 0; i < n; i++)
        h = (h ^ s[i]) * FNV_PRIME;
    return h;
}

static uint64_t fnv_u64(uint64_t h, uint64_t v) {
    for (int i = 0; i < 8; i++)
        h = (h ^ ((v >> (8 * i)) & 0xff)) * FNV_PRIME;
    return h;
}

static uint64_t compute_hash(const ag_desc *d) {
    unsigned f = kinds[d->kind].fields;
    uint64_t h = fnv_u64(FNV_OFFSET, (uint64_t)d->kind);
    if (f & AG_DESC_HAS_NESTED)
        h = fnv_u64(h, d->nested->hash);
    if (f & AG_DESC_HAS_STR)
        h = fnv_bytes(fnv_u64(h, d->len), d->str, d->len);
    if (f & AG_DESC_HAS_IDX)
        h = fnv_u64(h, (uint64_t)d->idx);
    return h;
}

uint64_t ag_desc_hash(const ag_desc *d) {
    return d ? d->hash : fnv_u64(FNV_OFFSET, UINT64_MAX);
}

bool ag_desc_equal(const ag_desc *a, const ag_desc *b) {
    /* Every descriptor nests at most one other, so the comparison walks one chain. */
    for (;;) {
        if (a == b)
            return true;
        if (!a || !b || a->kind != b->kind || a->hash != b->hash || a->idx != b->idx ||
            a->len != b->len || memcmp(a->str, b->str, a->len) != 0)
            return false;
        a = a->nested;
        b = b->nested;
    }
}

/* ---- construction ---- */

/* Why `nested` may not fill kind's nested field, written into msg; false when it may. */
static bool nest_problem(ag_desc_kind kind, const ag_desc *nested, char *msg, size_t n) {
    const kind_info *ki = &kinds[kind];
    char r[160];
    if (!nested) {
        snprintf(msg, n, "%s.%s is NULL", ki->name, ki->nested_field);
        return true;
    }
    const kind_info *ni = &kinds[nested->kind];
    bool is_sub = nested->kind == AG_DESC_SUBCLASS_GETATTR_INPUT ||
                  nested->kind == AG_DESC_SUBCLASS_SIZE_INPUT ||
                  nested->kind == AG_DESC_SUBCLASS_STRIDE_INPUT ||
                  nested->kind == AG_DESC_SUBCLASS_GETATTR_OUTPUT ||
                  nested->kind == AG_DESC_SUBCLASS_SIZE_OUTPUT ||
                  nested->kind == AG_DESC_SUBCLASS_STRIDE_OUTPUT;
    const char *want = NULL, *note = "";
    switch (ki->nest) {
    case NEST_INPUT:
        if (ni->output)
            want = "an AOTInput";
        break;
    case NEST_OUTPUT:
        if (!ni->output)
            want = "an AOTOutput";
        break;
    case NEST_DIFF_INPUT:
        if (ni->output || !ni->diff)
            want = "a differentiable AOTInput (ParamAOTInput, BufferAOTInput, PlainAOTInput, "
                   "ViewBaseAOTInput, SyntheticBaseAOTInput or TangentAOTInput)";
        if (is_sub && !ni->output)
            note = "; subclass descriptors wrap GradAOTOutput, never the reverse";
        break;
    case NEST_DIFF_OUTPUT:
        if (!ni->output || !ni->diff)
            want = "a differentiable AOTOutput (PlainAOTOutput, InputMutationAOTOutput, "
                   "IntermediateBaseAOTOutput, MetadataMutationAOTOutput or GradAOTOutput)";
        if (is_sub && ni->output)
            note = "; subclass descriptors wrap TangentAOTInput, never the reverse";
        break;
    case NEST_NONE:
        break;
    }
    if (want) {
        snprintf(msg, n, "%s.%s must be %s, got %s%s", ki->name, ki->nested_field, want,
                 short_repr(nested, r, sizeof r), note);
        return true;
    }
    if (nested->depth >= AG_DESC_MAX_DEPTH) {
        snprintf(msg, n, "%s.%s: descriptors nest at most %d levels deep", ki->name,
                 ki->nested_field, AG_DESC_MAX_DEPTH);
        return true;
    }
    return false;
}

/* Allocates and fills a descriptor whose fields were already checked. */
static ag_desc *desc_alloc(ag_desc_kind kind, const ag_desc *nested, const char *str, size_t len,
                           int64_t idx) {
    unsigned f = kinds[kind].fields;
    if (!(f & AG_DESC_HAS_STR))
        len = 0;
    ag_desc *d = ag__malloc(sizeof *d + len + 1);
    if (!d)
        return NULL;
    atomic_init(&d->refcount, 1);
    d->kind = kind;
    d->nested = (f & AG_DESC_HAS_NESTED) ? ag_desc_retain(nested) : NULL;
    d->depth = d->nested ? d->nested->depth + 1 : 1;
    d->idx = (f & AG_DESC_HAS_IDX) ? idx : 0;
    d->len = len;
    if (len)
        memcpy(d->str, str, len);
    d->str[len] = 0;
    d->hash = compute_hash(d);
    return d;
}

static ag_desc *make(const char *who, ag_desc_kind kind, const ag_desc *nested, const char *str,
                     int64_t idx) {
    const kind_info *ki = &kinds[kind];
    char msg[512];
    if ((ki->fields & AG_DESC_HAS_NESTED) && nest_problem(kind, nested, msg, sizeof msg)) {
        ag__err(AG_EINVAL, "%s: %s", who, msg);
        return NULL;
    }
    if ((ki->fields & AG_DESC_HAS_STR) && !str) {
        ag__err(AG_EINVAL, "%s: %s.%s is NULL", who, ki->name, ki->str_field);
        return NULL;
    }
    return desc_alloc(kind, nested, str, str ? strlen(str) : 0, idx);
}

ag_desc *ag_desc_new(ag_desc_kind kind, const ag_desc *nested, const char *str, int64_t idx) {
    if (!kind_ok(kind)) {
        ag__err(AG_EINVAL, "ag_desc_new: unknown descriptor kind %d", (int)kind);
        return NULL;
    }
    const kind_info *ki = &kinds[kind];
    if (!(ki->fields & AG_DESC_HAS_NESTED) && nested) {
        ag__err(AG_EINVAL, "ag_desc_new: %s has no nested descriptor field", ki->name);
        return NULL;
    }
    if (!(ki->fields & AG_DESC_HAS_STR) && str) {
        ag__err(AG_EINVAL, "ag_desc_new: %s has no string field", ki->name);
        return NULL;
    }
    if (!(ki->fields & AG_DESC_HAS_IDX) && idx) {
        ag__err(AG_EINVAL, "ag_desc_new: %s has no idx field (got %lld)", ki->name, (long long)idx);
        return NULL;
    }
    return make("ag_desc_new", kind, nested, str, idx);
}

#define CTOR_NONE(fn, K)                                                                           \
    ag_desc *fn(void) {                                                                            \
        return make(#fn, K, NULL, NULL, 0);                                                        \
    }
#define CTOR_STR(fn, K)                                                                            \
    ag_desc *fn(const char *s) {                                                                   \
        return make(#fn, K, NULL, s, 0);                                                           \
    }
#define CTOR_IDX(fn, K)                                                                            \
    ag_desc *fn(int64_t idx) {                                                                     \
        return make(#fn, K, NULL, NULL, idx);                                                      \
    }
#define CTOR_NEST(fn, K)                                                                           \
    ag_desc *fn(const ag_desc *d) {                                                                \
        return make(#fn, K, d, NULL, 0);                                                           \
    }
#define CTOR_NEST_STR(fn, K)                                                                       \
    ag_desc *fn(const ag_desc *d, const char *s) {                                                 \
        return make(#fn, K, d, s, 0);                                                              \
    }
#define CTOR_NEST_IDX(fn, K)                                                                       \
    ag_desc *fn(const ag_desc *d, int64_t idx) {                                                   \
        return make(#fn, K, d, NULL, idx);                                                         \
    }

CTOR_STR(ag_desc_param, AG_DESC_PARAM)
CTOR_STR(ag_desc_buffer, AG_DESC_BUFFER)
CTOR_IDX(ag_desc_plain_input, AG_DESC_PLAIN_INPUT)
CTOR_IDX(ag_desc_dummy_input, AG_DESC_DUMMY_INPUT)
CTOR_NEST(ag_desc_tangent, AG_DESC_TANGENT)
CTOR_NEST(ag_desc_view_base, AG_DESC_VIEW_BASE)
CTOR_NEST(ag_desc_synthetic_base, AG_DESC_SYNTHETIC_BASE)
CTOR_NONE(ag_desc_philox_forward_seed, AG_DESC_PHILOX_FORWARD_SEED)
CTOR_NONE(ag_desc_philox_forward_base_offset, AG_DESC_PHILOX_FORWARD_BASE_OFFSET)
CTOR_NONE(ag_desc_philox_backward_seed, AG_DESC_PHILOX_BACKWARD_SEED)
CTOR_NONE(ag_desc_philox_backward_base_offset, AG_DESC_PHILOX_BACKWARD_BASE_OFFSET)
CTOR_IDX(ag_desc_forward_token_input, AG_DESC_FORWARD_TOKEN_INPUT)
CTOR_IDX(ag_desc_backward_token_input, AG_DESC_BACKWARD_TOKEN_INPUT)
CTOR_NEST_STR(ag_desc_subclass_getattr_input, AG_DESC_SUBCLASS_GETATTR_INPUT)
CTOR_NEST_IDX(ag_desc_subclass_size_input, AG_DESC_SUBCLASS_SIZE_INPUT)
CTOR_NEST_IDX(ag_desc_subclass_stride_input, AG_DESC_SUBCLASS_STRIDE_INPUT)
CTOR_IDX(ag_desc_plain_output, AG_DESC_PLAIN_OUTPUT)
CTOR_NEST(ag_desc_input_mutation, AG_DESC_INPUT_MUTATION)
CTOR_NEST(ag_desc_intermediate_base, AG_DESC_INTERMEDIATE_BASE)
CTOR_IDX(ag_desc_metadata_mutation, AG_DESC_METADATA_MUTATION)
CTOR_NEST(ag_desc_grad, AG_DESC_GRAD)
CTOR_NONE(ag_desc_philox_updated_forward_offset, AG_DESC_PHILOX_UPDATED_FORWARD_OFFSET)
CTOR_NONE(ag_desc_philox_updated_backward_offset, AG_DESC_PHILOX_UPDATED_BACKWARD_OFFSET)
CTOR_IDX(ag_desc_forward_token_output, AG_DESC_FORWARD_TOKEN_OUTPUT)
CTOR_IDX(ag_desc_backward_token_output, AG_DESC_BACKWARD_TOKEN_OUTPUT)
CTOR_NEST_STR(ag_desc_subclass_getattr_output, AG_DESC_SUBCLASS_GETATTR_OUTPUT)
CTOR_NEST_IDX(ag_desc_subclass_size_output, AG_DESC_SUBCLASS_SIZE_OUTPUT)
CTOR_NEST_IDX(ag_desc_subclass_stride_output, AG_DESC_SUBCLASS_STRIDE_OUTPUT)
CTOR_IDX(ag_desc_dummy_output, AG_DESC_DUMMY_OUTPUT)
CTOR_IDX(ag_desc_saved_for_backwards, AG_DESC_SAVED_FOR_BACKWARDS)
CTOR_IDX(ag_desc_saved_for_backwards_no_vc_check, AG_DESC_SAVED_FOR_BACKWARDS_NO_VC_CHECK)

/* The calling convention of a module's flat inputs, made in this one place: parameters, then
 * buffers, then the user's inputs (upstream's prepare_aot_module_simplified). */
int ag__desc_module_inputs(char *const *params, int nparams, char *const *buffers, int nbuffers,
                           int nuser, ag_desc **descs) {
    int n = nparams + nbuffers + nuser;
    for (int i = 0; i < n; i++) {
        if (i < nparams)
            descs[i] = ag_desc_param(params[i]);
        else if (i < nparams + nbuffers)
            descs[i] = ag_desc_buffer(buffers[i - nparams]);
        else
            descs[i] = ag_desc_plain_input(i - nparams - nbuffers);
        if (!descs[i]) {
            for (int k = 0; k < i; k++) {
                ag_desc_release(descs[k]);
                descs[k] = NULL;
            }
            return ag_last_status() < 0 ? ag_last_status() : AG_ENOMEM;
        }
    }
    return 0;
}

ag_desc *ag_desc_retain(const ag_desc *d) {
    ag_desc *m = (ag_desc *)d; /* the refcount is mutable bookkeeping on an immutable value */
    if (m)
        atomic_fetch_add_explicit(&m->refcount, 1, memory_order_relaxed);
    return m;
}

void ag_desc_release(ag_desc *d) {
    /* Iterative: a descriptor owns at most one nested one, so freeing walks a chain. */
    while (d && atomic_fetch_sub_explicit(&d->refcount, 1, memory_order_acq_rel) == 1) {
        ag_desc *next = d->nested;
        ag__free(d);
        d = next;
    }
}

/* ---- kinds and accessors ---- */

const char *ag_desc_kind_name(ag_desc_kind kind) {
    return kind_ok(kind) ? kinds[kind].name : NULL;
}

unsigned ag_desc_kind_fields(ag_desc_kind kind) {
    return kind_ok(kind) ? kinds[kind].fields : 0;
}

const char *ag_desc_kind_str_field(ag_desc_kind kind) {
    return kind_ok(kind) ? kinds[kind].str_field : NULL;
}

const char *ag_desc_kind_nested_field(ag_desc_kind kind) {
    return kind_ok(kind) ? kinds[kind].nested_field : NULL;
}

ag_desc_kind ag_desc_kind_of(const ag_desc *d) {
    return d ? d->kind : (ag_desc_kind)0;
}
bool ag_desc_is_input(const ag_desc *d) {
    return d && !kinds[d->kind].output;
}
bool ag_desc_is_output(const ag_desc *d) {
    return d && kinds[d->kind].output;
}

const char *ag_desc_target(const ag_desc *d) {
    if (!d)
        return NULL;
    return d->kind == AG_DESC_PARAM || d->kind == AG_DESC_BUFFER ? d->str : NULL;
}

const char *ag_desc_attr(const ag_desc *d) {
    if (!d)
        return NULL;
    return d->kind == AG_DESC_SUBCLASS_GETATTR_INPUT || d->kind == AG_DESC_SUBCLASS_GETATTR_OUTPUT
               ? d->str
               : NULL;
}

int64_t ag_desc_idx(const ag_desc *d) {
    return d ? d->idx : -1;
}
const ag_desc *ag_desc_nested(const ag_desc *d) {
    return d ? d->nested : NULL;
}
int ag_desc_depth(const ag_desc *d) {
    return d ? d->depth : 0;
}

/* Follows SubclassGetAttr descriptors of kind `via` down to what they wrap. */
static const ag_desc *through_getattr(const ag_desc *d, ag_desc_kind via) {
    while (d && d->kind == via)
        d = d->nested;
    return d;
}

ag_section ag_desc_section(const ag_desc *d) {
    while (d && kinds[d->kind].section == AG_SEC_NONE)
        d = d->nested;
    return d ? kinds[d->kind].section : AG_SEC_OUT_GRADS;
}

static const char *const section_names[AG_SEC_COUNT] = {
    [AG_SEC_IN_FW_TOKENS] = "forward_tokens",
    [AG_SEC_IN_PRIMALS] = "primals",
    [AG_SEC_IN_SAVED] = "saved",
    [AG_SEC_IN_TANGENTS] = "tangents",
    [AG_SEC_IN_BW_TOKENS] = "backward_tokens",
    [AG_SEC_IN_FW_RNG] = "forward_philox",
    [AG_SEC_IN_BW_RNG] = "backward_philox",
    [AG_SEC_OUT_FW_TOKENS] = "forward_token_outputs",
    [AG_SEC_OUT_MUTATIONS] = "input_mutations",
    [AG_SEC_OUT_USER] = "user_outputs",
    [AG_SEC_OUT_METADATA_MUTATIONS] = "metadata_mutations",
    [AG_SEC_OUT_INTERMEDIATE_BASES] = "intermediate_bases",
    [AG_SEC_OUT_FW_RNG_OFFSET] = "forward_philox_offset",
    [AG_SEC_OUT_SAVED] = "saved_for_backwards",
    [AG_SEC_OUT_GRADS] = "grads",
    [AG_SEC_OUT_BW_RNG_OFFSET] = "backward_philox_offset",
    [AG_SEC_OUT_BW_TOKENS] = "backward_token_outputs",
};

const char *ag_section_name(ag_section s) {
    return (unsigned)s < AG_SEC_COUNT ? section_names[s] : NULL;
}
bool ag_section_is_input(ag_section s) {
    return s >= 0 && s < AG_SEC_OUT_FW_TOKENS;
}

bool ag_desc_is_param(const ag_desc *d) {
    d = through_getattr(d, AG_DESC_SUBCLASS_GETATTR_INPUT);
    return d && d->kind == AG_DESC_PARAM;
}

bool ag_desc_is_buffer(const ag_desc *d) {
    d = through_getattr(d, AG_DESC_SUBCLASS_GETATTR_INPUT);
    return d && d->kind == AG_DESC_BUFFER;
}

bool ag_desc_is_tangent(const ag_desc *d) {
    d = through_getattr(d, AG_DESC_SUBCLASS_GETATTR_INPUT);
    return d && d->kind == AG_DESC_TANGENT;
}

bool ag_desc_is_grad(const ag_desc *d) {
    d = through_getattr(d, AG_DESC_SUBCLASS_GETATTR_OUTPUT);
    return d && d->kind == AG_DESC_GRAD;
}

bool ag_desc_is_differentiable(const ag_desc *d) {
    return d && kinds[d->kind].diff;
}

/* ---- parsing ----
 *
 * A recursive-descent reader of the Python call syntax the reprs use. Each descriptor's fields
 * are collected (positionally or by keyword) and the descriptor is built at its ')', so a
 * failure anywhere releases what was read so far and nothing else. Recursion is bounded by
 * AG_DESC_MAX_DEPTH. */

typedef struct parser {
    const char *s;
    size_t pos;
} parser;

static bool is_ident_start(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
}

static bool is_ident_char(char c) {
    return is_ident_start(c) || (c >= '0' && c <= '9');
}

static void skip_ws(parser *p) {
    while (p->s[p->pos] == ' ' || p->s[p->pos] == '\t' || p->s[p->pos] == '\n' ||
           p->s[p->pos] == '\r')
        p->pos++;
}

/* A short quoted excerpt of the text at s, for "got ..." in messages. */
static const char *excerpt(const char *s, char *buf, size_t n) {
    if (!*s) {
        snprintf(buf, n, "end of text");
        return buf;
    }
    sbuf b = {buf, n, 0};
    sb_putc(&b, '\'');
    int i;
    for (i = 0; i < 12 && s[i]; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c >= 0x20 && c < 0x7f && c != '\\')
            sb_putc(&b, (char)c);
        else
            sb_printf(&b, "\\x%02x", c);
    }
    if (s[i])
        sb_puts(&b, "...");
    sb_putc(&b, '\'');
    sb_finish(&b);
    return buf;
}

static void perr(size_t col, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void perr(size_t col, const char *fmt, ...) {
    char msg[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    ag__err(AG_EFORMAT, "desc: column %zu: %s", col, msg);
}

/* Reads a Python string literal into a new ag__malloc'd C string (*out); 0 or an error code. */
static int parse_string(parser *p, const char *field, char **out) {
    const char *s = p->s;
    size_t start = p->pos;
    char q = s[start], g[48];
    if (q != '\'' && q != '"') {
        perr(start, "expected a string literal for '%s', got %s", field,
             excerpt(s + start, g, sizeof g));
        return AG_EFORMAT;
    }
    size_t used;
    ag__pystr_err e;
    int rc = ag__pystr_parse(s + start, strlen(s + start),
                             AG__PYSTR_NO_NEWLINE | AG__PYSTR_CONTINUATION | AG__PYSTR_NO_NAMED,
                             NULL, NULL, &used, out, NULL, &e);
    if (rc != AG_EFORMAT) {
        if (!rc)
            p->pos = start + used;
        return rc;
    }
    size_t at = start + e.at;
    switch (e.code) {
    case AG__PYSTR_NOT_STRING:
    case AG__PYSTR_UNTERMINATED:
        perr(at, "unterminated string literal for '%s'", field);
        break;
    case AG__PYSTR_NAMED:
        perr(at, "\\N{...} escapes are not supported in descriptor strings");
        break;
    case AG__PYSTR_TRUNCATED:
        perr(at, "truncated \\%c escape: expected %d hex digits", e.esc, e.digits);
        break;
    case AG__PYSTR_NUL:
        perr(at, "a NUL character cannot appear in a descriptor string");
        break;
    case AG__PYSTR_RANGE:
        perr(at, "illegal Unicode character \\U%08llx", (long long)e.cp);
        break;
    case AG__PYSTR_SURROGATE:
        perr(at,
             "lone surrogate \\u%04llx cannot be encoded as UTF-8 (only \\udc80-\\udcff, "
             "which stand for raw bytes)",
             (long long)e.cp);
        break;
    }
    return AG_EFORMAT;
}

static int parse_int(parser *p, const char *field, int64_t *out) {
    const char *s = p->s;
    size_t start = p->pos, i = start;
    char g[48];
    bool neg = s[i] == '-';
    if (neg)
        i++;
    if (s[i] < '0' || s[i] > '9') {
        perr(start, "expected an integer for '%s', got %s", field, excerpt(s + start, g, sizeof g));
        return AG_EFORMAT;
    }
    if (s[i] == '0' && s[i + 1] >= '0' && s[i + 1] <= '9') {
        perr(start, "leading zeros are not allowed in an integer ('%s')", field);
        return AG_EFORMAT;
    }
    uint64_t v = 0, limit = neg ? (uint64_t)INT64_MAX + 1 : (uint64_t)INT64_MAX;
    for (; s[i] >= '0' && s[i] <= '9'; i++) {
        unsigned dgt = (unsigned)(s[i] - '0');
        if (v > (limit - dgt) / 10) {
            perr(start, "integer for '%s' does not fit in 64 bits", field);
            return AG_EFORMAT;
        }
        v = v * 10 + dgt;
    }
    *out = neg ? (int64_t)(0 - v) : (int64_t)v;
    p->pos = i;
    return 0;
}

/* The field slots of a kind in declaration order: nested, string, idx. */
enum { SLOT_NESTED, SLOT_STR, SLOT_IDX };

static int kind_slots(const kind_info *ki, int *slots) {
    int n = 0;
    if (ki->fields & AG_DESC_HAS_NESTED)
        slots[n++] = SLOT_NESTED;
    if (ki->fields & AG_DESC_HAS_STR)
        slots[n++] = SLOT_STR;
    if (ki->fields & AG_DESC_HAS_IDX)
        slots[n++] = SLOT_IDX;
    return n;
}

static const char *slot_name(const kind_info *ki, int slot) {
    return slot == SLOT_NESTED ? ki->nested_field : slot == SLOT_STR ? ki->str_field : "idx";
}

static ag_desc *parse_desc(parser *p, int depth) {
    const char *s = p->s;
    char g[48];
    skip_ws(p);
    size_t start = p->pos;
    if (depth > AG_DESC_MAX_DEPTH) {
        perr(start, "descriptors nest at most %d levels deep", AG_DESC_MAX_DEPTH);
        return NULL;
    }
    if (!is_ident_start(s[start])) {
        perr(start, "expected a descriptor class name such as 'PlainAOTInput', got %s",
             excerpt(s + start, g, sizeof g));
        return NULL;
    }
    size_t end = start;
    while (is_ident_char(s[end]))
        end++;
    size_t nlen = end - start;
    int kind = -1;
    for (int k = 0; k < AG_DESC_NKINDS; k++)
        if (strlen(kinds[k].name) == nlen && memcmp(kinds[k].name, s + start, nlen) == 0)
            kind = k;
    if (kind < 0) {
        if (nlen == 4 && memcmp(s + start, "None", 4) == 0)
            perr(start, "expected a descriptor, got None");
        else
            perr(start, "unknown descriptor class '%.*s'", nlen > 64 ? 64 : (int)nlen, s + start);
        return NULL;
    }
    const kind_info *ki = &kinds[kind];
    p->pos = end;
    skip_ws(p);
    if (s[p->pos] != '(') {
        perr(p->pos, "expected '(' after %s, got %s", ki->name, excerpt(s + p->pos, g, sizeof g));
        return NULL;
    }
    p->pos++;

    int slots[3], nslots = kind_slots(ki, slots), npositional = 0;
    bool have[3] = {false, false, false}, keywords = false;
    ag_desc *nested = NULL, *d = NULL;
    char *str = NULL;
    int64_t idx = 0;
    for (;;) {
        skip_ws(p);
        if (s[p->pos] == ')')
            break;
        size_t arg_col = p->pos;
        int slot = -1;
        /* A keyword is an identifier followed by '=' (not '=='); an identifier followed by
         * anything else starts a positional nested descriptor. */
        if (is_ident_start(s[p->pos])) {
            size_t e = p->pos;
            while (is_ident_char(s[e]))
                e++;
            size_t q = e;
            while (s[q] == ' ' || s[q] == '\t' || s[q] == '\n' || s[q] == '\r')
                q++;
            if (s[q] == '=' && s[q + 1] != '=') {
                for (int k = 0; k < nslots; k++) {
                    const char *fname = slot_name(ki, slots[k]);
                    if (strlen(fname) == e - p->pos && memcmp(fname, s + p->pos, e - p->pos) == 0)
                        slot = slots[k];
                }
                if (slot < 0) {
                    int missing = -1;
                    for (int k = nslots - 1; k >= 0; k--)
                        if (!have[slots[k]])
                            missing = slots[k];
                    int klen = e - p->pos > 64 ? 64 : (int)(e - p->pos);
                    if (missing >= 0)
                        perr(arg_col, "expected '%s=': %s has no field '%.*s'",
                             slot_name(ki, missing), ki->name, klen, s + p->pos);
                    else
                        perr(arg_col, "expected ')': %s has no field '%.*s'", ki->name, klen,
                             s + p->pos);
                    goto fail;
                }
                if (have[slot]) {
                    perr(arg_col, "%s got field '%s' twice", ki->name, slot_name(ki, slot));
                    goto fail;
                }
                keywords = true;
                p->pos = q + 1;
                skip_ws(p);
            }
        }
        if (slot < 0) {
            if (keywords) {
                perr(arg_col, "positional argument follows keyword argument in %s", ki->name);
                goto fail;
            }
            if (npositional >= nslots) {
                if (nslots == 0)
                    perr(arg_col, "expected ')': %s takes no arguments", ki->name);
                else
                    perr(arg_col, "expected ')': %s takes %d argument%s", ki->name, nslots,
                         nslots > 1 ? "s" : "");
                goto fail;
            }
            slot = slots[npositional++];
        }
        size_t val_col = p->pos;
        if (slot == SLOT_NESTED) {
            nested = parse_desc(p, depth + 1);
            if (!nested)
                goto fail;
            char msg[512];
            if (nest_problem((ag_desc_kind)kind, nested, msg, sizeof msg)) {
                perr(val_col, "%s", msg);
                goto fail;
            }
        } else if (slot == SLOT_STR) {
            if (parse_string(p, ki->str_field, &str))
                goto fail;
        } else if (parse_int(p, "idx", &idx))
            goto fail;
        have[slot] = true;
        skip_ws(p);
        if (s[p->pos] == ',') {
            p->pos++;
            continue;
        }
        if (s[p->pos] != ')') {
            perr(p->pos, "expected ',' or ')' in %s(...), got %s", ki->name,
                 excerpt(s + p->pos, g, sizeof g));
            goto fail;
        }
    }
    for (int k = 0; k < nslots; k++)
        if (!have[slots[k]]) {
            perr(p->pos, "expected '%s=': %s is missing field '%s'", slot_name(ki, slots[k]),
                 ki->name, slot_name(ki, slots[k]));
            goto fail;
        }
    p->pos++; /* ')' */
    d = desc_alloc((ag_desc_kind)kind, nested, str, str ? strlen(str) : 0, idx);
fail:
    ag_desc_release(nested);
    ag__free(str);
    return d;
}

ag_desc *ag_desc_parse(const char *text, size_t *consumed) {
    if (!text) {
        ag__err(AG_EINVAL, "ag_desc_parse: text is NULL");
        return NULL;
    }
    parser p = {text, 0};
    ag_desc *d = parse_desc(&p, 1);
    if (!d)
        return NULL;
    if (consumed) {
        *consumed = p.pos;
        return d;
    }
    skip_ws(&p);
    if (text[p.pos]) {
        char g[48];
        perr(p.pos, "expected end of text after the descriptor, got %s",
             excerpt(text + p.pos, g, sizeof g));
        ag_desc_release(d);
        return NULL;
    }
    return d;
}
