// CPU attention for prefill, decode and verify alike (STEP35.md 4.3 item 5-6): causal, optional sliding
// window, GQA, then the optional per-head sigmoid gate. A query's result depends only on its own q row,
// its absolute position and the keys it can see, never on the other queries of the call or on how much
// of the key range was passed, so any split into calls gives the same bits (DETERMINISM.md rule 9, D2).
#pragma once

#include <cstdint>

#include "core/thread_pool.h"

namespace memra::cpu {

struct AttentionShape {
    int64_t n_heads = 0;     // query heads; a multiple of n_kv_heads
    int64_t n_kv_heads = 0;  // key/value heads
    int64_t head_dim = 0;
    int64_t window = 0;      // sliding window W including the current position; 0 = full causal
    float scale = 0.0f;      // score scale, normally attention_scale(head_dim)
};

// float(1 / sqrt(double(head_dim))): HF's `head_dim ** -0.5` rounded to float32, computed on the host.
float attention_scale(int64_t head_dim);

// attention: for query i (absolute position P = q_pos[i]) and query head h, with kv head g = h / (n_heads /
// n_kv_heads), the visible keys are the positions p with lo <= p <= P, lo = max(0, P - window + 1) for a
// sliding layer and 0 for a full one. In this order of fp32 operations:
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
// q: query i head h at q[i * q_stride + h * head_dim], q_stride >= n_heads * head_dim.
// q_pos: [n_q] absolute positions, any order. k, v: [kv_end - kv_begin, n_kv_heads, head_dim] f32, row r holding
// position kv_begin + r. Every query's visible keys must lie inside [kv_begin, kv_end) (MEMRA_CHECK); keys outside
// a query's window are simply not read. gate: raw head-gate logits [n_q, gate_stride] or nullptr.
// out: [n_q, n_heads, head_dim] f32; must not overlap q, k, v or gate.
void attention(ThreadPool &pool, const AttentionShape &shape, const float *q, int64_t q_stride, const int64_t *q_pos,
               int64_t n_q, const float *k, const float *v, int64_t kv_begin, int64_t kv_end, const float *gate,
               int64_t gate_stride, float *out);

}  // namespace memra::cpu
