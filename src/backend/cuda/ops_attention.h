// Device twins of the CPU attention ops in `device` numerics (backend/cpu/ops_attention.h, ENGINE.md section 4,
// CUDA.md 3.2): the KV write into a paged pool, the query rounding for the cache format, and paged attention in
// the blocked order. The KV write, the rounding and attention over q8_0 / q5_1 keys perform the CPU kernel's fp32
// operations in the CPU's order and call the same MEMRA_HD scalar code (core/math.h, core/float_formats.h,
// core/quant_blocks.h), so the results are the CPU's bits (NaN results compare as NaN: x86 and NVIDIA GPUs make
// different NaN payloads). Attention over f32 and bf16 keys at head_dim 32, 64 and 128 (tensor_core_attention)
// runs its dot products on the tensor cores in the GPU's own order, the blocked order's blocks and splits with
// mma.sync sums inside them: not the CPU's bits, but the same bits for a row in any batch, tile or launch shape.
//
// Launchers take device pointers, sizes and a stream, issue one kernel and return the launch status
// (cudaErrorInvalidValue for bad arguments, checked on the host before anything is launched). Conditions the
// CPU checks by reading the data (slots, positions, block tables) cannot be checked on the host without a copy;
// the kernels skip such a row instead and set *error_flag = 1 (when error_flag is not null) for the caller to
// check later.
//
// This header uses the CPU's types (backend.h, cpu/ops_attention.h), which pull in fmt; a .cu file including it
// needs FMT_USE_CONSTEXPR=1 defined first (ops_attention.cu does so), since fmt's nvcc defaults do not compile.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "backend/backend.h"
#include "backend/cpu/ops_attention.h"
#include "backend/cuda/ops_rows.h"

namespace memra::cuda {

// cpu::kv_write: for each row i, k[i] and v[i] (row_elems f32 values each, kv_encode in the layer's formats)
// into slot slots[i] of the layer, bytes equal to the CPU's. layer.base: the device pool; k, v: [n, row_elems]
// f32; slots: [n] i32, distinct. A slot outside [0, layer.n_pages * 64) writes nothing for its row and sets
// *error_flag = 1. One CTA per row. Invalid: n < 0 or > 2^31 - 1, row_elems <= 0, K/V row sizes that are not
// row_elems values in the layer's formats (so no multiple of 32 for a block format), null pointers with work.
cudaError_t kv_write(const cpu::PagedLayer &layer, int64_t row_elems, const float *k, const float *v,
                     const int32_t *slots, int64_t n, int32_t *error_flag, cudaStream_t stream);

// The attention's inputs of a step in one launch (a warp per head): qk_norm_rope(q, k, rope) (ops_rows.h), then
// kv_write(layer, k, v, slots), then round_rows(q, q_round), those launches' bits. q, k as qk_norm_rope's
// (k: n_kv_heads heads); v [n_tokens, v_stride] f32 with its n_kv_heads heads first; the layer's K and V rows are
// n_kv_heads heads of head_dim values in its formats. A token whose position is outside the table is normalised,
// not rotated; one whose slot is outside the pool writes no K or V; either raises the flag. Invalid: what
// qk_norm_rope, kv_write or round_rows refuse, head_dim not a multiple of 32 with a block format or q8 rounding,
// null pointers with work to do.
cudaError_t attention_prologue(const QkHeads &q, const QkHeads &k, const float *v, int64_t v_stride, int64_t n_tokens,
                               int64_t head_dim, float eps, const RopeRows &rope, RowRounding q_round,
                               const cpu::PagedLayer &layer, const int32_t *slots, int32_t *error_flag,
                               cudaStream_t stream);

// cpu::round_rows: x [n_rows, d] f32 rounded in place. kNone: untouched (no launch); kBf16: each value to bf16
// (nearest even) and back; kQ8: each block of 32 along a row through quantize_block_q8_0 and back
// (q8_0_dequant_block). Invalid: n_rows < 0, d <= 0, d % 32 != 0 for kQ8, a null x with work to do.
cudaError_t round_rows(float *x, int64_t n_rows, int64_t d, RowRounding r, cudaStream_t stream);

// cpu::paged_attention with shape.blocked (the device order; the exact order is not implemented here and is
// refused): causal or sliding-window GQA attention over the paged pool for every query row of the step, then the
// optional sigmoid head gate. Arguments as the CPU's, all device pointers: q [n_q, q_stride] f32 (query i head h
// at q[i * q_stride + h * head_dim]), q_pos [n_q] i64, q_seq [n_q] i32, block_tables [n_seqs, bt_stride] i32,
// gate [n_q, gate_stride] f32 raw logits or nullptr, out [n_q, n_heads, head_dim] f32 (not overlapping q or gate).
// layer.base is the device pool, layer's offsets and row sizes those of kv_page_layout. A cluster of 4 CTAs per
// CPU work item (query, kv head, batch of up to 8 query heads) and split (needs sm_90: thread-block clusters and
// distributed shared memory). A query whose sequence index, position or visible pages
// the CPU would refuse (q_seq outside [0, n_seqs), q_pos < first_pos or past the block table, a visible block
// without a page or with a page outside [0, n_pages)) gets NaN outputs and sets *error_flag = 1.
// Invalid: the shape checks of the CPU (heads, head_dim in [1, 512], window and first_pos >= 0), q_stride,
// bt_stride, n_seqs and gate_stride too small, K/V row sizes that are not n_kv_heads heads of head_dim values in
// the layer's formats, null pointers with work to do, more than (2^31 - 1) / 4 work items, on the tensor cores a
// block table of 2^31 positions or more (bt_stride of 2^25 pages or more). A device other than
// compute capability 9.0 (which would run the compute_80 PTX, without the cluster kernel): cudaErrorNotSupported.
// Split-KV: with a workspace of split_ws_floats device floats, at least paged_attention_split_floats, the splits of
// 512 positions run in clusters (the tensor-core kernel: CTAs) of their own and a second launch merges them left to
// right: the same bits, with parallelism for long ranges and small batches. Otherwise (no workspace, too small, one
// split; on the tensor cores also a step of more than 128 queries) one launch, one cluster or CTA per item running
// its splits in turn. `ctas` picks how the tensor-core kernel spreads split-KV (the same bits either way): a CTA per
// split, a CTA per block of 128 positions (a workspace of paged_attention_split_floats(..., SplitCtas::kBlocks)
// floats; with less, a CTA per split), or kAuto: per block where per split would leave most SMs idle and the
// workspace holds the blocks' states (size it with kBlocks for that).
enum class SplitCtas { kAuto, kSplits, kBlocks };
cudaError_t paged_attention(const cpu::AttentionShape &shape, const float *q, int64_t q_stride, const int64_t *q_pos,
                            const int32_t *q_seq, int64_t n_q, const cpu::PagedLayer &layer,
                            const int32_t *block_tables, int64_t bt_stride, int64_t n_seqs, int64_t first_pos,
                            const float *gate, int64_t gate_stride, float *out, int32_t *error_flag,
                            cudaStream_t stream, float *split_ws = nullptr, int64_t split_ws_floats = 0,
                            SplitCtas ctas = SplitCtas::kAuto);

// Whether paged_attention takes the tensor-core kernel for these keys: f32 or bf16 keys (rounded to bf16) at
// head_dim 32, 64 or 128. Per query row and head, over the blocked order's blocks of 128 and splits of 512
// positions (aligned to 0): the scores are mma.sync m16n8k16 sums (head_dim / 16 chained k16 steps from zero over
// the query rounded to bf16) times scale; each block's own state: its max bm, p by the hardware's exp2 of s - bm
// (exactly 1 at the maximum), l the block's sum of p in one fixed tree, acc 8 chained k16 steps of bf16(p) by the
// values (decoded, rounded to bf16) in position order from zero; a split folds its blocks' states left to right
// (weights by the same exp2), and the splits merge left to right as the CPU's.
// The same bits come out for split-KV and one launch, in every batch and tile; against the CPU's blocked order a
// measured tolerance (tests/cuda).
bool tensor_core_attention(KvFormat k_format, int64_t head_dim);

// Whether paged_attention runs on the current device: its kernel is in the sm_90a code only (thread-block
// clusters), which compute capability 9.0 runs; any other device would run the compute_80 PTX without it. Asked
// of the driver once per device.
cudaError_t attention_supported(bool &ok);

// The workspace floats paged_attention needs to split n_q rows: a state (8 x (2 + head_dim) floats) per work item
// and split its range can span (within bt_stride pages of the block table, and the window), or with kBlocks per
// block of those splits. 0 when it would not split (one split at most, or arguments it refuses).
int64_t paged_attention_split_floats(const cpu::AttentionShape &shape, int64_t n_q, int64_t bt_stride,
                                     SplitCtas ctas = SplitCtas::kSplits);

}  // namespace memra::cuda
