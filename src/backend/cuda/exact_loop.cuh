// The exact K loop of the CPU's products (backend/cpu/matmul.h, ActRounding::kNone) on CUDA cores, shared by the
// products (ops_matmul.cu) and the fused MoE routing (ops_route.cu, whose router product must give the products'
// bits): one 16-thread group per output element, thread j as lane j, every operation an explicit IEEE _rn
// intrinsic with gradual underflow (these files are not built with -ftz=true), so nothing is contracted or
// flushed behind our back.
#pragma once

#include <cstdint>

#include "core/dtype.h"
#include "core/float_formats.h"
#include "core/math.h"

namespace memra::cuda {

inline constexpr int kExactLanes = kReduceLanes;  // lanes of the K loop (the CPU's) = threads of a group

// The lane tree (((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7))) + (((l8+l9)+(l10+l11))+((l12+l13)+(l14+l15))) over the 16
// threads of a group: a butterfly whose level d adds the partner d lanes away, which at every level pairs
// exactly the tree's neighbours (addition is commutative, so which side holds which operand does not show).
// Every thread of the group ends with the sum. mask: the group's half of the warp.
__device__ __forceinline__ float lane_tree_exact(float v, unsigned mask) {
    for (int d = 1; d < kExactLanes; d <<= 1) v = __fadd_rn(v, __shfl_xor_sync(mask, v, d, kExactLanes));
    return v;
}

// The sum of term(i) over i in [0, n), from +0 in increasing i (a serial chain of _rn adds: the same bits as the
// plain loop), with the terms of kLoads i read before their adds, so the chain waits on one load latency per
// kLoads terms instead of one per term (fewer where registers are short).
inline constexpr int kChainLoads = 16;
template <int kLoads = kChainLoads, class Term>
__device__ __forceinline__ float chain_sum(int n, Term term) {
    float acc = 0.0f;
    int i = 0;
    for (; i + kLoads <= n; i += kLoads) {
        float v[kLoads];
#pragma unroll
        for (int j = 0; j < kLoads; ++j) v[j] = term(i + j);
#pragma unroll
        for (int j = 0; j < kLoads; ++j) acc = __fadd_rn(acc, v[j]);
    }
    for (; i < n; ++i) acc = __fadd_rn(acc, term(i));
    return acc;
}

// Bytes per stored weight element.
template <DType kDt>
inline constexpr int64_t kElemBytes = kDt == DType::kF32 ? 4 : (kDt == DType::kF8E4M3 ? 1 : 2);

// Element i of a weight row, widened exactly (core/float_formats.h, as the CPU's widening).
template <DType kDt>
__device__ __forceinline__ float weight_at(const uint8_t *row, int64_t i) {
    if constexpr (kDt == DType::kF32) {
        return reinterpret_cast<const float *>(row)[i];
    } else if constexpr (kDt == DType::kBF16) {
        return bf16_to_f32(reinterpret_cast<const uint16_t *>(row)[i]);
    } else if constexpr (kDt == DType::kF16) {
        return f16_to_f32(reinterpret_cast<const uint16_t *>(row)[i]);
    } else {
        return fp8_e4m3_to_f32(row[i]);
    }
}

// One chunk [c0, c1) of absolute K of the exact loop, before any scale, by this thread as lane `lane`: lane j
// adds x[k] * w[k] (separately rounded) for the k of the chunk with (k - c0) % 16 == j in increasing k, from
// +0; then the lane tree. gx: the x row and gw: the weight row, both with element 0 at absolute K k_begin.
template <DType kDt>
__device__ __forceinline__ float exact_chunk_sum(const float *gx, const uint8_t *gw, int64_t k_begin, int64_t c0,
                                                 int64_t c1, int lane, unsigned mask) {
    float acc = 0.0f;
    int64_t k = c0 + lane;
    // Eight elements' loads issued before their adds (the chain itself is serial): the loads of a lane
    // otherwise wait one after another.
    for (; k + 7 * kExactLanes < c1; k += 8 * kExactLanes) {
        float xv[8];
        float wv[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int64_t i = k + j * kExactLanes - k_begin;
            xv[j] = gx[i];
            wv[j] = weight_at<kDt>(gw, i);
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) acc = __fadd_rn(acc, __fmul_rn(xv[j], wv[j]));
    }
    for (; k < c1; k += kExactLanes) {
        const int64_t i = k - k_begin;
        acc = __fadd_rn(acc, __fmul_rn(gx[i], weight_at<kDt>(gw, i)));
    }
    return lane_tree_exact(acc, mask);
}

}  // namespace memra::cuda
