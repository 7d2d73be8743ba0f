// The PTX wrappers the tensor-core kernels share (CUDA.md 6: one header holds them): the bf16 mma.sync step,
// ldmatrix, cp.async with zero fill and the L2 prefetch.
#pragma once

#include <cstdint>

#include "core/float_formats.h"

namespace memra::cuda {

// d += a * b, one m16n8k16 bf16 step with an fp32 accumulator.
__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                         uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Two values as bf16 (f32_to_bf16: nearest even), lo in the low half.
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    return static_cast<uint32_t>(f32_to_bf16(lo)) | (static_cast<uint32_t>(f32_to_bf16(hi)) << 16);
}

// Four (two) 8x8 b16 matrices from shared memory (lane l gives the address of row l % 8 of matrix l / 8; for two,
// lanes 16-31 repeat lanes 0-15's addresses); .trans transposes each.
__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], uint32_t smem_addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(smem_addr));
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t smem_addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t smem_addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr));
}

__device__ __forceinline__ uint32_t smem_address(const void *p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// cp.async of 16 bytes, of which the first src_bytes (0 or 16) come from gmem and the rest are zero.
__device__ __forceinline__ void cp_async16_zfill(void *smem, const void *gmem, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address(smem)), "l"(gmem),
                 "r"(src_bytes));
}
// Asks the L2 for the 128-byte line holding gmem (no register is written, nothing waits on it).
constexpr int64_t kLineBytes = 128;
__device__ __forceinline__ void prefetch_l2(const void *gmem) {
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(gmem));
}
// The lines of [p, p + bytes) asked of the L2 by a block's `threads` threads (this one is `tid`): for inputs no
// kernel writes (weights), before the wait on the kernel before.
__device__ __forceinline__ void prefetch_l2_span(const void *p, int64_t bytes, int64_t tid, int64_t threads) {
    for (int64_t b = tid * kLineBytes; b < bytes; b += threads * kLineBytes)
        prefetch_l2(static_cast<const char *>(p) + b);
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait_pending() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

}  // namespace memra::cuda
