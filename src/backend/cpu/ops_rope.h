// Rotary position embedding (STEP35.md 4.3 items 3-4): NeoX rotate-half layout, partial rotary, per-layer
// theta, optional llama3 frequency scaling. The frequencies and the cos/sin table are built once on the
// host and shared by both backends (a GPU uploads the same table), so only the rotation itself runs per
// token, and it is plain fp32 multiplies and adds in the order below.
#pragma once

#include <cstdint>
#include <vector>

#include "core/result.h"
#include "core/thread_pool.h"

namespace memra::cpu {

// llama3 frequency scaling parameters ("rope_scaling" with rope_type "llama3").
struct RopeLlama3 {
    double factor = 1.0;                             // low frequencies are divided by it
    double low_freq_factor = 1.0;                    // wavelengths > L0 / low_freq_factor get f / factor
    double high_freq_factor = 1.0;                   // wavelengths < L0 / high_freq_factor are kept
    double original_max_position_embeddings = 0.0;   // L0
};

// rope_inv_freq: the rot_dim / 2 inverse frequencies of one layer, reproducing transformers'
// _compute_default_rope_parameters and _compute_llama3_parameters, which run in float32 torch tensors
// with Python scalars cast to float32 (F(v) below: v rounded to float32; every listed operation rounds
// to float32):
//   e_j      = F(2j) / F(rot_dim)                          (arange(0, dim, 2).float() / dim)
//   inv_j    = 1.0f / F(pow(F(theta), e_j))                (base ** e, then 1.0 / that)
// The pow is computed in double and rounded once (correctly rounded but for astronomically rare
// cases); torch's vectorised float32 pow is within 1 ulp of that, so HF's inv_freq can differ from
// ours by 1 ulp in rare entries. With llama3 scaling (S = factor, lo = low_freq_factor,
// hi = high_freq_factor, L = original_max_position_embeddings):
//   wavelen  = (1.0f / inv_j) * F(2 pi)                    (torch's scalar / tensor is reciprocal * scalar)
//   base_j   = wavelen > F(L / lo) ? inv_j / F(S) : inv_j
//   sf       = ((1.0f / wavelen) * F(L) - F(lo)) / F(hi - lo)
//   smooth   = ((1.0f - sf) * base_j) / F(S) + sf * base_j
//   result   = (!(wavelen < F(L / hi)) && !(wavelen > F(L / lo))) ? smooth : base_j
// Errors: rot_dim not positive and even; theta not finite or <= 0; llama3: factor or L not finite or <= 0,
// not 0 < lo < hi.
Result<std::vector<float>> rope_inv_freq(int64_t rot_dim, double theta, const RopeLlama3 *llama3);

// The cos/sin table for absolute positions [0, n_positions), [n_positions, rot_dim / 2] f32 each.
// HF builds freqs = inv_freq (x) positions as a float32 outer product (one rounded multiply per entry)
// and takes float32 cos/sin of it. Here, for position p and frequency j:
//   angle = float(p) * inv_freq[j]                         (one fp32 multiply, as HF)
//   cos_table[p, j] = F(std::cos(double(angle))), sin_table[p, j] = F(std::sin(double(angle)))
// i.e. the float angle's cos/sin evaluated in double on the host and rounded to float. torch's float32
// cos/sin (SLEEF, <= 1 ulp) can differ from these by 1 ulp; the transformers oracle tolerance absorbs it.
struct RopeTable {
    int64_t n_positions = 0;
    int64_t half = 0;             // rot_dim / 2
    std::vector<float> cos;       // [n_positions, half] f32
    std::vector<float> sin;       // [n_positions, half] f32
};

// Errors: empty inv_freq, n_positions outside [1, 2^24] (positions must be exact as floats).
Result<RopeTable> rope_table_build(ThreadPool &pool, const std::vector<float> &inv_freq, int64_t n_positions);

// rope_apply: rotates, in place, dims [0, rot_dim) of every head of every token, rot_dim = 2 * table.half;
// dims [rot_dim, head_dim) pass through. Head h of token t starts at x[t * token_stride + h * head_dim].
// With a = x[j], b = x[j + half], c = cos_table[positions[t], j], s = sin_table[positions[t], j], for
// j = 0..half-1 (each product rounded, then the sum or difference rounded):
//   x[j]        = a * c - b * s
//   x[j + half] = b * c + a * s
// which is HF's (x * cos) + (rotate_half(x) * sin) bit for bit ((-b) * s = -(b * s) exactly).
// Errors (nothing is written): a position outside [0, table.n_positions).
Result<void> rope_apply(ThreadPool &pool, const RopeTable &table, float *x, int64_t n_tokens, int64_t token_stride,
                        int64_t n_heads, int64_t head_dim, const int64_t *positions);

}  // namespace memra::cpu
