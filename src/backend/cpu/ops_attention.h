// CPU attention over a paged KV pool, for prefill, decode and verify alike, and the KV write that fills the
// pool (STEP35.md 4.3 items 5-6, ENGINE.md section 2): causal, optional sliding window, GQA, then the
// optional per-head sigmoid gate. A query's result depends only on its own q row, its absolute position and
// the keys of its own sequence it can see, read back from the pool in their stored format — never on the
// other queries of the call, the other sequences, the page ids or how its keys were written — so any batch
// and any chunking give the same bits (DETERMINISM.md rule 9, D2).
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/kv_format.h"
#include "core/kv_page.h"
#include "core/thread_pool.h"

namespace memra::cpu {

struct AttentionShape {
    int64_t n_heads = 0;     // query heads; a multiple of n_kv_heads
    int64_t n_kv_heads = 0;  // key/value heads
    int64_t head_dim = 0;
    int64_t window = 0;      // sliding window W including the current position; 0 = full causal
    float scale = 0.0f;      // score scale, normally attention_scale(head_dim)
    bool blocked = false;    // device numerics (ENGINE.md section 4): the blocked online-softmax order below;
                             // false = the two-pass exact order
};

// float(1 / sqrt(double(head_dim))): HF's `head_dim ** -0.5` rounded to float32, computed on the host.
float attention_scale(int64_t head_dim);

// One layer of a paged pool as the kernels address it (core/kv_page.h): the row of slot s lies at
// base + (s / 64) * page_bytes + k_offset + (s % 64) * k_row_bytes (V likewise); the sequence's block table
// row gives the page of each logical block (position / 64), -1 where a page was released.
struct PagedLayer {
    std::byte *base = nullptr;
    int64_t n_pages = 0;  // pages of the pool: a block-table entry outside [0, n_pages) is a broken invariant
    int64_t page_bytes = 0;
    int64_t k_offset = 0;
    int64_t v_offset = 0;
    int64_t k_row_bytes = 0;
    int64_t v_row_bytes = 0;
    KvFormat k_format = KvFormat::kF32;
    KvFormat v_format = KvFormat::kF32;
};

// Layer `layer` of a pool whose bytes start at base (host or device memory; MEMRA_CHECK: the layer exists).
PagedLayer pool_layer(const KvPoolSpec &spec, const KvPageLayout &layout, std::byte *base, int layer);

// kv_write: for each row i, encodes k[i] and v[i] (row_elems f32 values each, kv_encode) into slot
// slots[i] of the layer. k, v: [n, row_elems]. Rows are independent and threads split them, so the slots
// must be distinct (the engine stages each position of a sequence once, in pages no other sequence holds);
// each must lie in [0, n_pages * 64) (MEMRA_CHECK).
void kv_write(ThreadPool &pool, const PagedLayer &layer, int64_t row_elems, const float *k, const float *v,
              const int32_t *slots, int64_t n);

// paged_attention: for query i (absolute position P = q_pos[i], sequence s = q_seq[i]) and query head h,
// with kv head g = h / (n_heads / n_kv_heads), the visible keys are the positions p with lo <= p <= P,
// lo = max(first_pos, P - window + 1) on a sliding layer and first_pos on a full one. Each key and value is
// decoded from the pool exactly as stored (kv_decode of its head's values), then, in this order of fp32
// operations:
//   s_p  = dot_f32(q[i, h], k[p, g], head_dim) * scale      (core/math.h canonical dot, then one multiply)
//   m    = max of s_p over visible p                          (pass 1, increasing p; a NaN score is skipped
//                                                              here and propagates through pass 2)
//   pass 2, p = lo..P in increasing order, o[d] and l starting at +0:
//        e_p  = exp_f32(s_p - m)                              (s_p of pass 1, kept or recomputed: same bits)
//        l    = l + e_p
//        o[d] = o[d] + e_p * v[p, g, d]                       (product rounded, then the add)
//   out[i, h, d] = o[d] / l
//   gate (when gate != nullptr): out[i, h, d] = out[i, h, d] * sigmoid_f32(gate[i * gate_stride + h])
// (the weights are normalised once at the end, by division, as flash attention does; no heap scratch.)
//
// shape.blocked (the `device` numerics of ENGINE.md section 4; the order of CUDA.md section 3.2, which a GPU
// flash-attention kernel reproduces) replaces the passes above by a blocked online softmax. Keys are decoded as
// stored and, for f32 and bf16 caches, each key value is then rounded to bf16 (f32_to_bf16, round to nearest
// even; bf16 keys are unchanged by it); q8_0 / q5_1 keys are used as decoded. Every value, of every format, is
// decoded and then rounded to bf16. The query is used as given (the caller has rounded it for the cache format).
//   s_p  = dot_f32(q[i, h], k[p, g], head_dim) * scale      (as above, over the rounded keys)
// Blocks of 128 positions and splits of 512, both aligned to absolute position 0: block b is
// [128 b, 128 b + 128) and split t is [512 t, 512 t + 512), each intersected with [lo, P], so a split holds up
// to 4 blocks and a windowed row may start with a partial split and a partial block.
//   Split t, from a fresh state m = -inf, l = +0, acc[d] = +0; its blocks in increasing order:
//     bm     = max of s_p over the block                    (increasing p; a NaN score is skipped, as in pass 1)
//     m_new  = max(m, bm)                                   (a block with m_new = -inf is skipped entirely)
//     alpha  = m == -inf ? 0 : exp_f32(m - m_new)
//     e_p    = exp_f32(s_p - m_new);  P_p = bf16_to_f32(f32_to_bf16(e_p))
//     l      = l * alpha + b_sum, b_sum = +0 + e_p + ...    (the unrounded e_p, p increasing over the block)
//     acc[d] = acc[d] * alpha, then for p increasing: acc[d] = acc[d] + P_p * v[p, g, d]
//                                                           (product rounded, then the add)
//     m      = m_new
//   The splits merge left to right into (M, L, ACC), which starts as the first split's (m, l, acc); split t:
//     M' = max(M, m_t);  a = exp_f32(M - M');  b = exp_f32(m_t - M')
//     L' = L * a + l_t * b;  ACC'[d] = ACC[d] * a + acc_t[d] * b   (each product rounded, then the add)
//   out[i, h, d] = ACC[d] / L, then the gate as above.
// (Each visible key is decoded once per work item and its scores kept for its split: at most 512 per head.)
// The blocked order runs on the instruction path of product_isa() (backend/cpu/matmul.h): kPortable is the scalar
// spelling; kAvx2Fma and kAvx512Bf16 run the dots, exps, bf16 roundings, block maxima and value updates in AVX2
// lanes that perform each value's operations above in the same order (multiply then add, never fused; no
// FTZ/DAZ), so every path gives the same bits.
//
// A work item is one (query, kv head): it decodes each visible key and value once for the query heads that
// share them, which changes no per-head order.
//
// q: query i head h at q[i * q_stride + h * head_dim], q_stride >= n_heads * head_dim. q_pos: [n_q] absolute
// positions; q_seq: [n_q] indices into block_tables ([n_seqs, bt_stride] i32). Every visible position must
// have a page (MEMRA_CHECK). gate: raw head-gate logits [n_q, gate_stride] or nullptr. out: [n_q, n_heads,
// head_dim] f32; must not overlap q or gate.
void paged_attention(ThreadPool &pool, const AttentionShape &shape, const float *q, int64_t q_stride,
                     const int64_t *q_pos, const int32_t *q_seq, int64_t n_q, const PagedLayer &layer,
                     const int32_t *block_tables, int64_t bt_stride, int64_t n_seqs, int64_t first_pos,
                     const float *gate, int64_t gate_stride, float *out);

// The blocked order's exp_f32 and bf16 rounding (bf16_to_f32(f32_to_bf16(x))) of x[0..n) into y (y may be x), on
// the instruction path the blocked order runs on: the AVX2 lanes when product_isa() (backend/cpu/matmul.h) is
// kAvx2Fma or kAvx512Bf16, the scalar functions on kPortable. Every path gives the scalar bits; the tests hold
// the lanes to them.
void blocked_exp_f32(const float *x, int64_t n, float *y);
void blocked_round_bf16(const float *x, int64_t n, float *y);

}  // namespace memra::cpu
