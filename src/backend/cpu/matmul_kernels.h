// Internals the matmul kernels share (matmul.cpp: the exact K loop; matmul_device.cpp: the device K loop):
// the 16-lane vector type, the lane tree and one task of dot products. Not an interface.
#pragma once

#include <cstdint>
#include <cstring>

#include "backend/cpu/matmul.h"

// The 64-byte vector values below never cross a call boundary (all helpers are always_inline), so GCC's
// note that passing them by value changed ABI in 4.6 does not apply.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace memra::cpu::detail {

// -------------------------------------------------------------------------------------------------
// 16 lanes as one GCC vector value: each operation is the same IEEE fp32 operation on every lane, and
// the compiler maps a value onto one AVX-512, two AVX2 or four SSE registers. Nothing here reassociates.

using F32x16 = float __attribute__((vector_size(64)));
using U32x16 = uint32_t __attribute__((vector_size(64)));
using I32x16 = int32_t __attribute__((vector_size(64)));
using U16x16 = uint16_t __attribute__((vector_size(32)));
using U8x16 = uint8_t __attribute__((vector_size(16)));

// Bit reinterpretation between same-size vectors. Not std::bit_cast: g++ 12's UBSan instruments
// __builtin_bit_cast of vector types as a load through a null pointer (a false report).
template <class To, class From>
[[gnu::always_inline]] inline To vec_bits(From v) {
    static_assert(sizeof(To) == sizeof(From));
    To t;
    std::memcpy(&t, &v, sizeof(t));
    return t;
}

// One level of the lane tree for two vectors packed side by side: lane i of the result is the sum of
// lanes 2i and 2i+1 of the 32-lane concatenation [a | b]. A pair never straddles a and b.
[[gnu::always_inline]] inline F32x16 level(F32x16 a, F32x16 b) {
    constexpr I32x16 kEven = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    constexpr I32x16 kOdd = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    return __builtin_shuffle(a, b, kEven) + __builtin_shuffle(a, b, kOdd);
}

// The lane tree of matmul.h for 8 accumulators at once: out[g] = (((l0+l1)+(l2+l3))+...) of acc[g].
// After level 1 each vector holds two accumulators' pair sums side by side, and so on up the tree;
// every accumulator is reduced by exactly its own tree.
[[gnu::always_inline]] inline void lane_tree8(const F32x16 *acc, float *out) {
    // Level 1: pairs of lanes; 8 accumulators -> 4 vectors of [acc 2i: 8 sums | acc 2i+1: 8 sums].
    const F32x16 l1a = level(acc[0], acc[1]);
    const F32x16 l1b = level(acc[2], acc[3]);
    const F32x16 l1c = level(acc[4], acc[5]);
    const F32x16 l1d = level(acc[6], acc[7]);
    // Level 2: 4 sums per accumulator; level 3: 2 per accumulator; level 4: 1.
    const F32x16 l2a = level(l1a, l1b);
    const F32x16 l2b = level(l1c, l1d);
    const F32x16 l3 = level(l2a, l2b);
    const F32x16 l4 = level(l3, l3);
    for (int g = 0; g < 8; ++g) out[g] = l4[g];
}

// -------------------------------------------------------------------------------------------------
// One task: the dot products of tokens x rows over a list of K segments. A segment is one K range
// whose result goes to its own output (the whole K for matmul; one canonical block for partials).

struct Task {
    const WeightRef *w = nullptr;
    const float *x = nullptr;     // [n_tokens, x_stride] f32; column 0 is K position seg_k0 of segment 0
    int64_t x_stride = 0;
    int64_t n_tokens = 0;
    int64_t n0 = 0;               // first weight row
    int64_t n_rows = 0;           // rows [n0, n0 + n_rows)
    int64_t seg_k0 = 0;           // K start of segment 0
    int64_t seg_len = 0;          // each segment's K length; segment s covers [seg_k0 + s * seg_len, + seg_len)
    int64_t n_segs = 1;
    float *y = nullptr;           // y[s * seg_out_stride + t * y_stride + (n - n0)]
    int64_t y_stride = 0;
    int64_t seg_out_stride = 0;
    // Device products (w->act != kNone): the rounded activations replace x, same layout and stride.
    const uint16_t *xq = nullptr;  // bf16 bits [n_tokens, x_stride]
    const float *xs = nullptr;     // kE4m3x128: the scale of K group g of token t at xs[t * xs_stride + g]
    int64_t xs_stride = 0;
};

// One token's row of round_activations (matmul.h) on product_isa(): x [k] f32 to codes [k] and, for kE4m3x128,
// scales [ceil(k / 128)]. Every path gives the same bits.
void round_row(const float *x, int64_t k, ActRounding act, uint16_t *codes, float *scales);

// Rows [rb, re) x tokens [tb, te) of a device task (matmul_device.cpp), on product_isa().
void run_device_range(const Task &task, int64_t rb, int64_t re, int64_t tb, int64_t te);

}  // namespace memra::cpu::detail
