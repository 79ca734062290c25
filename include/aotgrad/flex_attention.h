/* flex_attention: torch.nn.attention.flex_attention in C.
 *
 * Attention whose scores a score_mod function changes (a bias such as ALiBi, softcapping) and
 * whose pattern a mask_mod function decides (causal, sliding window, document masking), the
 * mask given as a block mask (ag_create_block_mask) so that blocks masked everywhere are
 * skipped and blocks kept everywhere ("full" blocks) skip the mask function. The CPU kernel
 * streams over key blocks with an online softmax: it never holds a whole L x S score matrix,
 * only one q-block x kv-block tile per thread.
 *
 *   out[b, h, i]    = sum_j softmax_j(s'[i, j]) v[b, hk, j]
 *   s[i, j]         = scale * q[b, h, i] . k[b, hk, j]
 *   s'[i, j]        = score_mod(s[i, j], b, h, i, j)   where mask_mod(b, h, i, j), else -inf
 *   logsumexp[b,h,i] = log sum_j exp(s'[i, j])    (natural log)
 * with hk = h / (Hq / Hkv) (grouped-query attention when enable_gqa). A row masked everywhere
 * gives output 0 and logsumexp -inf, and no gradient.
 *
 * The functions are C functions over aotgrad tensors, evaluated per tile: score is the tile's
 * scores [bq, bk], b and h are 0-d int64 tensors, q_idx is an int64 [bq, 1] tensor and kv_idx
 * an int64 [1, bk] tensor (absolute positions), so ordinary broadcasting ops written for one
 * score work on the tile. Tensors a function closes over that need gradients (ALiBi slopes, a
 * learned bias) are passed explicitly as `buffers` (upstream's score_mod_other_buffers after
 * lifting): the function receives them (detached aliases) and flex_attention differentiates
 * through them. A function runs inside an autorelease scope of the caller's: it returns an op
 * result (owned by that scope; not ag_tensor_keep'd) or one of its arguments, or NULL with an
 * error set. Its result must broadcast to [bq, bk]: a float tensor for score_mod, a bool one
 * for mask_mod. The functions must be pure (the backward evaluates them again).
 *
 * How often score_mod runs. Eagerly, flex_attention first traces score_mod once on data-less
 * 0-d stand-ins (score, b, h, q_idx, kv_idx and each buffer a fresh tensor without data; grad
 * mode on for the backward's joint graph) into a graph, as ag_trace_score_mod does, plans that
 * graph per tile shape and runs it on the tiles on every thread (the backward runs the traced
 * joint graph, score_mod's forward and backward, per tile). So score_mod is called once per
 * forward call and twice per backward (score and joint graphs), never per tile, and its side
 * effects (counters, prints) happen that many times. Nothing is cached between calls: every
 * call traces anew. A score_mod that cannot be traced (it returns NULL on the stand-ins, e.g.
 * because it reads ag_tensor_data, which is NULL there, or calls an op without a meta function)
 * or whose graph does not run on a tile is instead called per tile on the calling thread as
 * before (the trace's error is cleared; an out-of-memory error fails the call). Both paths give
 * the same output and logsumexp bit for bit; gradients agree to rounding (the buffers'
 * gradients are summed per thread). A score_mod must therefore not dereference data without
 * checking it (return NULL with an error instead). mask_mod is still called per partial tile,
 * on the calling thread, by ag_create_block_mask and by each call.
 *
 * Supported: float32 and float64 (q, k, v of one dtype); CPU; eager with autograd (first
 * order). Under a trace (ag_trace, ag_export_joint) the call is recorded as upstream records
 * it: score_mod and mask_mod traced into subgraphs (sdpa_score0, sdpa_mask0; an identity
 * score_mod when none is given, a block mask of full 128 x 128 blocks when none is given), the
 * block mask's tensors as constants, a flex_attention node, and in the backward fw_graph0,
 * joint_graph0, mask_graph0 and a flex_attention_backward node (docs/GRAPH_FORMAT.md); under
 * tracing, score_mod's buffers must be float tensors. Such graphs print, parse, verify and run in
 * the interpreter (ag_graph_run: the subgraphs as score_mod and mask_mod); their joints partition
 * (ag_partition, both partitioners: out and logsumexp saved, flex_attention never recomputed)
 * and compile (ag_compile_joint: the planned executor, its flex steps allocation-free when
 * warm, or the interpreter); their backward runs joint_graph0 per tile. Not yet: double
 * backward, nesting flex_attention inside a score_mod or mask_mod. */
#ifndef AOTGRAD_FLEX_ATTENTION_H
#define AOTGRAD_FLEX_ATTENTION_H

#include "core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* score_mod(score, b, h, q_idx, kv_idx) -> new score; see above. All arguments borrowed. */
typedef ag_tensor *(*ag_score_mod_fn)(void *ud, ag_tensor *score, ag_tensor *b, ag_tensor *h,
                                      ag_tensor *q_idx, ag_tensor *kv_idx,
                                      ag_tensor *const *buffers, int nbuffers);
/* mask_mod(b, h, q_idx, kv_idx) -> bool (true: attend). All arguments borrowed. */
typedef ag_tensor *(*ag_mask_mod_fn)(void *ud, ag_tensor *b, ag_tensor *h, ag_tensor *q_idx,
                                     ag_tensor *kv_idx, ag_tensor *const *buffers, int nbuffers);

/* A score_mod with its user data and buffers (borrowed; read during the call and, for the
 * backward, kept by flex_attention's autograd node). */
typedef struct ag_score_mod {
    ag_score_mod_fn fn;
    void *ud;
    ag_tensor *const *buffers;
    int nbuffers;
} ag_score_mod;

typedef struct ag_mask_mod {
    ag_mask_mod_fn fn;
    void *ud;
    ag_tensor *const *buffers;
    int nbuffers;
} ag_mask_mod;

/* ---- block masks (torch.nn.attention.flex_attention.BlockMask) ---- */
typedef struct ag_block_mask ag_block_mask;

/* The parts of a block mask, as upstream names them. For each (b, h, row block) of the
 * q-side: kv_num_blocks counts the partial blocks (mask_mod true somewhere and false
 * somewhere: mask_mod is evaluated there), full_kv_num_blocks the full ones (true everywhere:
 * mask_mod not evaluated); the *_indices list those blocks' column numbers first, ascending,
 * followed by the remaining block numbers ascending (padding). Blocks in neither list are
 * empty and skipped. The q_* parts are the same for the transposed mask (for each kv block,
 * the q blocks), as the backward reads them. All are int64: num_blocks [B, H, nrows],
 * indices [B, H, nrows, ncols]. */
typedef enum ag_block_mask_part {
    AG_BM_KV_NUM_BLOCKS = 0,
    AG_BM_KV_INDICES,
    AG_BM_FULL_KV_NUM_BLOCKS,
    AG_BM_FULL_KV_INDICES,
    AG_BM_Q_NUM_BLOCKS,
    AG_BM_Q_INDICES,
    AG_BM_FULL_Q_NUM_BLOCKS,
    AG_BM_FULL_Q_INDICES,
} ag_block_mask_part;

/* create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, BLOCK_SIZE): evaluates mask_mod tile by
 * tile (never the whole Q_LEN x KV_LEN grid at once) and classifies every block. B and H may
 * be 1 to broadcast over the batch and heads of the attention. q_block_size and
 * kv_block_size 0 mean 128 (upstream's BLOCK_SIZE). mask_mod NULL (or its fn NULL) keeps every
 * position (every block full). mask_mod's ud and buffers must stay valid while the block mask
 * is used (the block mask keeps a reference to each buffer). Returns an owned block mask (free
 * with ag_block_mask_free), or NULL with AG_EINVAL (sizes < 1, a NULL buffer, mask_mod's
 * failure or a result that is not bool or does not broadcast to the tile) or AG_ENOMEM. */
AG_API ag_block_mask *ag_create_block_mask(const ag_mask_mod *mask_mod, int64_t B, int64_t H,
                                           int64_t q_len, int64_t kv_len, int64_t q_block_size,
                                           int64_t kv_block_size);
AG_API void ag_block_mask_free(ag_block_mask *m); /* NULL: no-op */
/* A part of m (borrowed, owned by m); NULL for a NULL m or an unknown part. */
AG_API ag_tensor *ag_block_mask_tensor(const ag_block_mask *m, ag_block_mask_part part);
/* m's (B, H, Q_LEN, KV_LEN, Q_BLOCK_SIZE, KV_BLOCK_SIZE) into out[6]; AG_EINVAL for NULLs. */
AG_API int ag_block_mask_shape(const ag_block_mask *m, int64_t out[6]);

/* ---- flex_attention ---- */

/* Zero-initialized (or NULL): upstream's defaults. */
typedef struct ag_flex_opts {
    double scale;    /* 0: 1 / sqrt(E) (upstream's scale=None) */
    bool enable_gqa; /* allow Hq a multiple of Hkv */
    /* Tile sizes of the kernel when there is no block mask (0: 128); with a block mask its
     * block sizes are used. */
    int64_t q_block_size, kv_block_size;
} ag_flex_opts;

/* flex_attention(query [B, Hq, L, E], key [B, Hkv, S, E], value [B, Hkv, S, Ev],
 * score_mod, block_mask, scale, enable_gqa, return_lse). score_mod and block_mask may be NULL
 * (plain softmax attention over every position). Stores the output [B, Hq, L, Ev] in *out and,
 * when lse is not NULL, the logsumexp [B, Hq, L] (float32 or float64 as q) in *lse: new
 * references owned by the caller, or by the innermost open scope (as op results). With grad
 * mode on and q, k, v or a score_mod buffer requiring grad, the outputs lead to one autograd
 * node ("FlexAttentionBackward0") that computes their gradients with the same tiling (the
 * logsumexp's incoming gradient included). Returns 0, or AG_EINVAL with a message naming the
 * argument and values (NULL tensors, not 4-d, mixed or non-float dtypes, mismatched sizes,
 * Hq != Hkv without enable_gqa or Hq not a multiple of Hkv, a block mask of another Q_LEN or
 * KV_LEN or whose B or H is neither 1 nor the query's, a NULL buffer, a failing score_mod or
 * mask_mod) with *out and *lse NULL and nothing else changed. */
AG_API int ag_flex_attention(ag_tensor *q, ag_tensor *k, ag_tensor *v,
                             const ag_score_mod *score_mod, const ag_block_mask *block_mask,
                             const ag_flex_opts *opts, ag_tensor **out, ag_tensor **lse);

#ifdef __cplusplus
}
#endif
#endif
