// The warp-level RMSNorm of one row and the RoPE pair rotation, shared by ops_rows.cu's norm kernels and
// ops_attention.cu's attention prologue: the CPU's bits (core/math.h's sum_squares_f32 lanes and tree,
// cpu norm_row's scaling, cpu::rope_apply's rotation).
#pragma once

#include <cstdint>

#include "core/float_formats.h"
#include "core/math.h"

namespace memra::cuda::norm_rope {

constexpr int kWarp = 32;
constexpr unsigned kFullMask = 0xffffffffu;

// Exact f32 value of element i of a norm weight [d] f32 or bf16 (cpu::detail::load_f32_or_bf16).
__device__ __forceinline__ float load_weight(const void *gw, bool bf16, int64_t i) {
    return bf16 ? bf16_to_f32(static_cast<const uint16_t *>(gw)[i]) : static_cast<const float *>(gw)[i];
}

// sum_squares_f32(x, n) computed by one warp, bit for bit: thread t accumulates canonical lane t % 16
// (terms i = l, l + 16, ... in increasing i, from +0; both half-warps compute the same 16 partials), then the
// shfl_xor butterfly over offsets 1, 2, 4, 8 is core/math.h's fixed tree: at offset w, thread l (a multiple
// of 2w) forms lane[l] + lane[l + w] in that operand order, and every other thread of the aligned group of 2w
// gets the same value by commutativity. Every thread returns the result.
__device__ __forceinline__ float warp_sum_squares(const float *x, int64_t n) {
    const int l = static_cast<int>(threadIdx.x % kWarp) % kReduceLanes;
    float acc = 0.0f;
#pragma unroll 8
    for (int64_t i = l; i < n; i += kReduceLanes) acc = acc + x[i] * x[i];
    for (int w = 1; w < kReduceLanes; w *= 2) acc = acc + __shfl_xor_sync(kFullMask, acc, w);
    return acc;
}

// The factor cpu norm_row scales by: 1 / sqrt(ss / d + eps).
__device__ __forceinline__ float norm_inv(float ss, int64_t d, float eps) {
    const float mean = ss / static_cast<float>(d);
    return rsqrt_f32(mean + eps);
}

// cpu norm_row (ops_norm.cpp) by one warp: y[0..d) = rms_norm(x[0..d)); y may equal x (every thread has read
// its reduction terms before the shuffles complete, and __syncwarp orders them before the first write).
// The writes go kWarpBatch per lane at a time, their loads first (y may be x, so the compiler would not move a
// load above an earlier store by itself).
constexpr int kWarpBatch = 8;

__device__ __forceinline__ void warp_norm_row(const float *x, int64_t d, const void *gw, bool w_bf16, float eps,
                                              float *y) {
    const float inv = norm_inv(warp_sum_squares(x, d), d, eps);
    __syncwarp();
    for (int64_t i0 = threadIdx.x % kWarp; i0 < d; i0 += int64_t{kWarpBatch} * kWarp) {
        float xv[kWarpBatch], factor[kWarpBatch];
#pragma unroll
        for (int u = 0; u < kWarpBatch; ++u) {
            const int64_t i = i0 + int64_t{u} * kWarp;
            xv[u] = i < d ? x[i] : 0.0f;
            factor[u] = i < d ? 1.0f + load_weight(gw, w_bf16, i) : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < kWarpBatch; ++u) {
            const int64_t i = i0 + int64_t{u} * kWarp;
            if (i < d) y[i] = (xv[u] * inv) * factor[u];
        }
    }
}

// One tensor's heads: head h of token t at x + t * token_stride + h * head_dim, its norm weight w [head_dim].
struct HeadRows {
    float *x;
    int64_t token_stride;
    int64_t n_heads;
    const void *w;
    bool w_bf16;
};

// Rotates the pair (j, j + half) of a head's row by a position's rows cos_row, sin_row ([half] each) of the tables.
__device__ __forceinline__ void rope_pair(float *row, int64_t j, int64_t half, const float *cos_row,
                                          const float *sin_row) {
    const float c = cos_row[j];
    const float s = sin_row[j];
    const float a = row[j];
    const float b = row[j + half];
    row[j] = a * c - b * s;
    row[j + half] = b * c + a * s;
}

// One head's row x [head_dim] by the calling warp: normalised in place (warp_norm_row), then, with a table (cos
// != nullptr), rotated at position p (rope_pair). A p outside [0, n_positions) leaves the row unrotated and
// returns false (the caller raises its flag). Warp-uniform; __syncwarp orders the norm's writes before the rotation.
__device__ __forceinline__ bool warp_norm_rope(float *x, int64_t head_dim, const void *w, bool w_bf16, float eps,
                                               const float *cos, const float *sin, int64_t n_positions, int64_t half,
                                               int64_t p) {
    warp_norm_row(x, head_dim, w, w_bf16, eps, x);
    if (cos == nullptr) return true;
    if (p < 0 || p >= n_positions) return false;
    __syncwarp();
    for (int64_t j = threadIdx.x % kWarp; j < half; j += kWarp) rope_pair(x, j, half, cos + p * half, sin + p * half);
    return true;
}

}  // namespace memra::cuda::norm_rope
