// CUDA MoE routing ops in `device` numerics: the sigmoid top-k router, the stable counting sort of the
// (token, slot) pairs by expert, the permute of an owner's input rows and the owners' source rows. Each
// launcher reproduces the CPU function named beside it (backend/cpu/ops_moe.h) bit for bit: the router calls
// the same MEMRA_HD sigmoid and performs the same fp32 operations in the same order; the sort's result is a
// pure function of the expert ids (integer counting, the placement in pair order by one warp). Launchers take
// raw device pointers, sizes and a stream; they return cudaErrorInvalidValue for bad arguments (nothing is
// launched), otherwise the launch status. None allocates, synchronises or reads device memory on the host
// (counts and offsets stay on the device); each is one kernel launch (none when there is no work). moe_route fuses
// the router product with the first, second and fourth.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "backend/cuda/ops_matmul.h"

namespace memra::cuda {

// Error flags, as in backend/cuda/ops_rows.h: `error_flag` is a device i32 set to 1 when an input index is out
// of range (never cleared here); nullptr: not reported. The bad entries still get the deterministic bits each
// launcher states, and nothing is written out of bounds.

// cpu::router_topk: per token t, p_e = sigmoid_f32(logits[t, e]), s_e = p_e + bias[e] (s_e = p_e without a
// bias), a NaN s_e counting as -Inf; slot k takes the not yet chosen expert with the largest s_e, ties to the
// lower index; w_k = p of that expert; renormalize: sum = +0, sum = sum + w_k in slot order, w_k = w_k / sum;
// then w_k = w_k * scaling_factor. logits: [n_tokens, n_experts] f32; bias: [n_experts] f32 or nullptr;
// expert_ids: [n_tokens, top_k] i32; weights: [n_tokens, top_k] f32. Requires 1 <= top_k <= n_experts and
// n_experts <= kRouterMaxExperts (one warp per token keeps its scores in shared memory).
inline constexpr int64_t kRouterMaxExperts = 12288;
cudaError_t router_topk(const float *logits, const float *bias, int64_t n_tokens, int64_t n_experts, int64_t top_k,
                        bool renormalize, float scaling_factor, int32_t *expert_ids, float *weights,
                        cudaStream_t stream);

// cpu::moe_sort_pairs: stable counting sort of the n_pairs = n_tokens * top_k pairs q = t * top_k + k by
// expert_ids[q]. offsets: [n_experts + 1] i32 (offsets[e] .. offsets[e + 1] are expert e's sorted rows);
// sorted_pair: [n_pairs] i32 (within an expert, increasing q); row_of_pair: [n_pairs] i32 (the inverse). One
// block: a shared-memory histogram, a scan, then one warp places the pairs in increasing q. A pair whose
// expert is outside [0, n_experts) is left out (row_of_pair = -1, not counted in offsets, so offsets[n_experts]
// falls short of n_pairs and the last rows of sorted_pair are left untouched) and raises the flag (the CPU
// aborts). Requires n_pairs <= INT32_MAX and n_experts <= kSortMaxExperts (shared-memory counters).
inline constexpr int64_t kSortMaxExperts = 8192;
cudaError_t moe_sort_pairs(const int32_t *expert_ids, int64_t n_tokens, int64_t top_k, int64_t n_experts,
                           int32_t *offsets, int32_t *sorted_pair, int32_t *row_of_pair, int32_t *error_flag,
                           cudaStream_t stream);

// CpuBackend::moe_permute (cpu::moe_permute over an owner's experts [expert_begin, expert_end)): with
// r0 = offsets[expert_begin] and r1 = offsets[expert_end] read on the device, x_own[j, :] =
// x[sorted_pair[r0 + j] / top_k, :] (exact copies) for j < r1 - r0; rows of x_own past r1 - r0 are untouched.
// x: [n_tokens, d] f32; sorted_pair: [n_tokens * top_k] i32; offsets: [n_experts + 1] i32 with
// 0 <= expert_begin <= expert_end <= n_experts; x_own: [x_own_rows, d] f32 (must not overlap x). Offsets with
// r0 < 0, r1 < r0, r1 > n_tokens * top_k or r1 - r0 > x_own_rows copy nothing and raise the flag; a
// sorted_pair entry naming no token leaves its row untouched and raises the flag (the CPU aborts on both).
cudaError_t moe_permute(const float *x, int64_t n_tokens, int64_t d, const int32_t *sorted_pair,
                        const int32_t *offsets, int64_t n_experts, int64_t expert_begin, int64_t expert_end,
                        int64_t top_k, float *x_own, int64_t x_own_rows, int32_t *error_flag, cudaStream_t stream);

// cpu::moe_source_rows: for each pair q < n_pairs with expert e = expert_ids[q], owner o = e / (n_experts /
// n_owners): src_row[q] = o * capacity + row_of_pair[q] - offsets[o * (n_experts / n_owners)].
// expert_ids, row_of_pair, src_row: [n_pairs] i32; offsets: [n_experts + 1] i32. Requires n_owners >= 1,
// n_experts % n_owners == 0, capacity >= 0. A pair whose expert is out of range, whose row falls outside
// [0, capacity) of its owner, or whose source row passes INT32_MAX gets src_row = -1 and raises the flag (the
// CPU aborts).
cudaError_t moe_source_rows(const int32_t *expert_ids, const int32_t *row_of_pair, int64_t n_pairs,
                            const int32_t *offsets, int64_t n_experts, int64_t n_owners, int64_t capacity,
                            int32_t *src_row, int32_t *error_flag, cudaStream_t stream);

// The routing of one MoE layer before its permute, for 1 .. kRouteMaxTokens tokens, in one launch: logits =
// cuda_matmul(router, x) (the exact loop of a router with f32 activations: the same bits), then router_topk,
// moe_sort_pairs and moe_source_rows on those buffers, bit for bit, as the four launchers in that order. A block
// per router row and tile of 16 tokens computes its logits; the last block of a tile to finish (an integer
// ticket) selects the tile's experts, a warp per token, and the last tile to finish sorts the pairs and writes
// their source rows. Which block comes last changes no bit. tickets: kRouteTickets i32 of device memory, zero
// before the first launch and zero again after each (the last blocks reset them), used by one stream at a time.
// moe_route_covers says which shapes this kernel takes (a router that is a whole F32 or BF16 matrix with f32
// activations, at most 512 experts, 1 .. kRouteMaxTokens tokens); for others the caller runs the four launchers
// (moe_route refuses them with cudaErrorInvalidValue). logits: [n_tokens, n_experts] f32; bias: [n_experts] f32
// or nullptr; the rest as the four launchers state, with n_experts = router.rows.
inline constexpr int64_t kRouteMaxTokens = 65536;
inline constexpr int64_t kRouteTickets = kRouteMaxTokens / 16 + 1;  // one per tile, and the tiles' own
struct MoeRouteBuffers {
    float *logits = nullptr;
    int32_t *expert_ids = nullptr;
    float *weights = nullptr;
    int32_t *offsets = nullptr;
    int32_t *sorted_pair = nullptr;
    int32_t *row_of_pair = nullptr;
    int32_t *src_row = nullptr;
};
bool moe_route_covers(const CudaMatrix &router, int64_t n_tokens, int64_t top_k);
cudaError_t moe_route(const CudaMatrix &router, const float *x, int64_t n_tokens, const float *bias, int64_t top_k,
                      bool renormalize, float scaling_factor, int64_t n_owners, int64_t capacity,
                      const MoeRouteBuffers &out, int32_t *tickets, int32_t *error_flag, cudaStream_t stream);

}  // namespace memra::cuda
