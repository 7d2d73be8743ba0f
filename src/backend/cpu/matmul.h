// CPU matrix products y = x · Wᵀ: fp32 accumulation, weights read in their checkpoint dtype (f32, bf16,
// f16, fp8 e4m3 with block scales) and converted inside the kernel. What the activations are is the
// weight's ActRounding (ENGINE.md section 4): f32 as computed (the `exact` numerics), or rounded to bf16 /
// quantized to e4m3 per 128 K values first (the `device` numerics, the device K loop below). Every kernel
// forms each output element with one canonical K loop, so its bits depend only on its row of x, its row of
// W and the K range: never on the token count, the thread count, the tiling or the instruction set
// (DETERMINISM.md rules 1-3, 10, D2, D3, D5). Row-parallel products add their 8 canonical K-block partials as
// a fixed tree.
#pragma once

#include <cstdint>

#include "core/dtype.h"
#include "core/fp8_block.h"
#include "core/thread_pool.h"

namespace memra::cpu {

// ---------------------------------------------------------------------------------------------
// The canonical K loop. The dot product of one activation row x with one weight row W[n] over a K
// range [k0, k1) is, in this exact order of fp32 operations:
//
//   1. Split [k0, k1) at every multiple of the chunk edge E = w.block_cols (128 by default, the fp8
//      scale block; the same cut for every dtype) and at its ends: chunks [c0, c1) in increasing K.
//   2. In a chunk, 16 lane accumulators start at +0; element k goes to lane (k - c0) % 16, which
//      adds the separately rounded product x[k] * w[k] (no fused multiply-add: host code is built
//      with -ffp-contract=off), elements of a lane in increasing k. w[k] is the exact f32 value of
//      the stored element (bf16/f16/e4m3 widening is exact).
//   3. The 16 lanes are reduced by the fixed pairwise tree
//        (((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7))) + (((l8+l9)+(l10+l11))+((l12+l13)+(l14+l15))).
//   4. fp8 only: the chunk sum is multiplied by the chunk's scale,
//        scale_inv[(row_offset + n) / block_rows][c0 / block_cols].
//   5. The running sum starts at +0 and each chunk result is added to it in increasing K order.
//
// Chunks are cut at absolute K positions, so a range that starts inside a chunk (a canonical block
// of 160 inside K = 1280) begins with a partial chunk.
inline constexpr int64_t kLanes = 16;

// ---------------------------------------------------------------------------------------------
// The device K loop (ActRounding kBf16 and kE4m3x128; bf16 and fp8 weights only). x is first rounded
// (round_activations): each value to bf16 (kBf16), or each group of 128 K values from K = 0 (the last may be
// partial) to e4m3 codes with one scale (kE4m3x128: core/device_numerics.h e4m3_quantize_group). The
// dot product of a rounded row with W[n] over [k0, k1) is then, with every operation below in FTZ/DAZ
// mode (a denormal input counts as zero, a result that is tiny after rounding becomes a zero of its sign;
// round to nearest even), which is how the AVX512-BF16 instruction vdpbf16ps computes:
//
//   1. Chunks: kE4m3x128 cuts [k0, k1) at every multiple of 128 (the scale blocks of both operands);
//      kBf16 takes [k0, k1) as one chunk.
//   2. In a chunk [c0, c1), 16 lane accumulators start at +0. The chunk is read in groups of 32 elements
//      from c0 (the last group zero-padded); in each group, in increasing group order, lane j adds
//      element c0 + 32g + 2j + 1 and then element c0 + 32g + 2j, each as one fused multiply-add
//      acc = acc + x[k] * w[k] (x[k] the bf16 value or e4m3 code, w[k] the stored weight element: the
//      product of two such values is exact, so the add is the only rounding).
//   3. The 16 lanes are reduced by the lane tree of the exact loop (step 3 above).
//   4. kE4m3x128 only: the chunk sum is multiplied by (x_scale[t][c0 / 128] * scale_inv[row block][c0 / 128]).
//   5. The running sum starts at +0 and each chunk result is added to it in increasing K order.
//
// Three instruction paths compute it (product_isa): AVX512-BF16 (vdpbf16ps; from 16-row WeightPanels where the
// weight has them), AVX2 + FMA (vfmadd231ps with MXCSR FTZ/DAZ) and a portable scalar path that emulates both
// modes; all give the same bits.
inline constexpr int64_t kDeviceGroup = 32;
inline constexpr int64_t kE4m3Group = 128;

// What a product's activations are rounded to before the product (ENGINE.md section 4).
enum class ActRounding : uint8_t {
    kNone,      // f32 activations, the exact K loop (exact numerics; f32/f16 weights; the router)
    kBf16,      // bf16 (RNE), the device K loop (device numerics, bf16 weights)
    kE4m3x128,  // e4m3 codes per 128 K values with one f32 scale each, the device K loop (device, fp8 experts)
};

// The instruction path of the device K loop.
enum class ProductIsa : uint8_t { kPortable, kAvx2Fma, kAvx512Bf16 };

// "portable", "avx2-fma", "avx512-bf16".
const char *product_isa_name(ProductIsa isa);
// The path device products run on: the best this CPU supports, unless force_product_isa chose another.
ProductIsa product_isa();
// Makes device products run on `isa` (tests and benchmarks). Refused (false, nothing changes) when the CPU
// lacks it.
bool force_product_isa(ProductIsa isa);
// Whether this CPU can run `isa`.
bool product_isa_supported(ProductIsa isa);

// Where a device product keeps its rounded activations: codes[n_tokens * K] bf16 bits (kE4m3x128: the e4m3
// code's value as bf16, exact) and, for kE4m3x128, scales[n_tokens * ceil(K / 128)]. A caller that owns no
// device product may pass nullptr.
struct ActScratch {
    uint16_t *codes = nullptr;
    int64_t codes_capacity = 0;
    float *scales = nullptr;
    int64_t scales_capacity = 0;
};

// Row-parallel products cut K into this many equal canonical blocks (DETERMINISM.md rule 2).
inline constexpr int64_t kCanonicalBlocks = 8;

// A copy of a device product's weight in 16-row panels, the layout the AVX512-BF16 path reads fastest (lanes are
// rows): panel b holds rows [16 b, 16 b + 16) of the view it was made from; in it, K pair p (elements k0 + 2p and
// k0 + 2p + 1) of all 16 rows lies at element 32 p as [row 0: even, odd | row 1: even, odd | ...], in the
// weight's dtype (bf16 bits or e4m3 codes). Only the fast path reads it; it never changes what a product
// computes (device_panels_bytes, device_panels_fill).
struct WeightPanels {
    const void *data = nullptr;  // nullptr: no panels
    int64_t rows = 0;            // rows covered, a multiple of 16 (the weight's rows past them have none)
    int64_t k0 = 0;              // absolute K position of pair 0 (even)
    int64_t pairs = 0;           // K pairs per panel
};

// A non-owning view of a PyTorch linear weight [out, in] (row-major: one row per output feature), or of a
// window of one: what a tensor-parallel rank holds (parallel/plan). A row window (column-parallel shard:
// heads, d_ff, vocab rows) moves data and row_offset; a K window (row-parallel shard: whole canonical
// blocks) keeps absolute K positions (k_begin), so chunk cuts, fp8 scale columns and canonical block
// numbers are those of the whole matrix and a rank's partials equal the TP = 1 partials bit for bit.
struct WeightRef {
    DType dtype = DType::kBF16;        // kF32, kBF16, kF16 or kF8E4M3
    const void *data = nullptr;        // [rows, cols] dtype, row stride ld: element (n, k) of the window
    int64_t rows = 0;                  // out features held
    int64_t cols = 0;                  // in features (K) held: absolute K positions [k_begin, k_begin + cols)
    const float *scale_inv = nullptr;  // kF8E4M3 only: [ceil(R / block_rows), ceil(k_full / block_cols)] f32,
                                       // row-major, R = rows of the matrix the grid was made for
    int64_t block_rows = kFp8Block;    // scale block height (fp8 only)
    int64_t block_cols = kFp8Block;    // scale block width; also the chunk edge E of the K loop (all dtypes)
    int64_t row_offset = 0;            // index of row 0 in the matrix scale_inv describes (set by row slices)
    int64_t ld = 0;                    // elements between consecutive rows; 0 means cols (a dense matrix)
    int64_t k_begin = 0;               // absolute K position of column 0 (set by K windows)
    int64_t k_full = 0;                // K of the whole matrix; 0 means cols (no K window)
    ActRounding act = ActRounding::kNone;  // kBf16 needs bf16 weights; kE4m3x128 fp8 weights with 128-wide
                                           // scale blocks and every K column
    WeightPanels panels;                   // device products only: an optional copy in 16-row panels
};

// The row stride and whole-matrix K of w, resolving the 0 defaults.
inline int64_t weight_ld(const WeightRef &w) { return w.ld > 0 ? w.ld : w.cols; }
inline int64_t weight_k_full(const WeightRef &w) { return w.k_full > 0 ? w.k_full : w.cols; }
// True when w holds every K column of its matrix (what column-parallel products need).
inline bool weight_has_full_k(const WeightRef &w) { return w.k_begin == 0 && w.cols == weight_k_full(w); }

// A stacked expert bank [n_experts, rows, cols] with, for fp8, scale_inv
// [n_experts, ceil(rows / block_rows), ceil(cols / block_cols)] f32; or the experts [e0, e1) of one (a TP
// rank's own experts). Routed experts are never split by width (ENGINE.md section 3): every held expert is
// whole, its products the canonical K loop over the full K.
struct WeightBankRef {
    DType dtype = DType::kBF16;
    const void *data = nullptr;  // [n_experts, rows, cols] dtype, dense: held expert 0 first
    int64_t n_experts = 0;       // experts held
    int64_t rows = 0;
    int64_t cols = 0;
    const float *scale_inv = nullptr;  // kF8E4M3 only: the grids of the held experts, dense
    int64_t block_rows = kFp8Block;
    int64_t block_cols = kFp8Block;
    int64_t first_expert = 0;  // global index of held expert 0: the grouped ops read offsets[first_expert + e]
    ActRounding act = ActRounding::kNone;  // passed on to each expert's WeightRef
    const void *panels = nullptr;  // optional: each held expert's WeightPanels, device_panels_bytes apart
};

// Expert `expert` of a bank as a WeightRef (0 <= expert < n_experts: MEMRA_CHECK).
WeightRef weight_bank_expert(const WeightBankRef &bank, int64_t expert);

// The experts [e0, e1) of a bank (inside what it holds, non-empty: MEMRA_CHECK). Held expert 0 becomes global
// expert bank.first_expert + e0.
WeightBankRef weight_bank_window(const WeightBankRef &bank, int64_t e0, int64_t e1);

// Rows [r0, r1) of w (0 <= r0 <= r1 <= rows: MEMRA_CHECK), for column-parallel sharding: same columns,
// fp8 scales keep following their rows (row_offset), so the slice's outputs equal rows r0..r1 of w's.
WeightRef weight_row_slice(const WeightRef &w, int64_t r0, int64_t r1);

// Absolute K columns [k0, k1) of w (inside the columns w holds, k0 < k1: MEMRA_CHECK), for row-parallel
// sharding. Row-parallel products over the window give the partials / subtree sum of the canonical blocks
// it covers; column-parallel products refuse it.
WeightRef weight_k_window(const WeightRef &w, int64_t k0, int64_t k1);

// Bytes of w's 16-row panels (WeightPanels): 0 when w has none to make (not a device product, fewer than 16 rows,
// an odd K start or width).
int64_t device_panels_bytes(const WeightRef &w);
// Writes w's panels into dst (device_panels_bytes(w) bytes, 64-byte aligned) and returns w reading them.
WeightRef device_panels_fill(ThreadPool &pool, const WeightRef &w, void *dst);
// The panels w has at `data` (made by device_panels_fill from a view of the same shape), without writing them.
WeightPanels device_panels_at(const WeightRef &w, const void *data);
// Each held expert's panels into dst (n_experts * device_panels_bytes(expert 0) bytes, 64-byte aligned); returns
// the bank reading them. A bank whose experts have no panels comes back unchanged.
WeightBankRef device_panels_fill(ThreadPool &pool, const WeightBankRef &bank, void *dst);

// Rounds x [n_tokens, K] for a device product into scratch (MEMRA_CHECK capacity): kBf16 codes, or
// kE4m3x128 codes and scales with groups from column 0. kNone is refused.
void round_activations(ThreadPool &pool, const float *x, int64_t n_tokens, int64_t k, ActRounding act,
                       const ActScratch &scratch);

// ---------------------------------------------------------------------------------------------
// Column-parallel products (q/k/v/gate, expert gate/up, router, lm_head): the canonical K loop over
// the whole K = w.cols (w must hold every K column: MEMRA_CHECK). None of these allocates; threads split
// output rows (or tokens when there are few rows), and every output element is computed by exactly one
// thread.

// x: [n_tokens, K] f32; y: [n_tokens, w.rows] f32. y[t, n] = dot(x[t, 0:K], W[n, 0:K]). A device product
// (w.act != kNone) rounds x into `scratch` first (MEMRA_CHECK that it is given and large enough).
void matmul(ThreadPool &pool, const float *x, int64_t n_tokens, const WeightRef &w, float *y,
            const ActScratch *scratch = nullptr);

// Output rows [n0, n1) of W only: y[t * y_stride + (n - n0)] = dot(x[t], W[n]), so a caller can fill a
// column range of a wider output. x: [n_tokens, K] f32; y: [n_tokens, y_stride] f32, y_stride >= n1 - n0.
void matmul_rows(ThreadPool &pool, const float *x, int64_t n_tokens, const WeightRef &w, int64_t n0, int64_t n1,
                 float *y, int64_t y_stride, const ActScratch *scratch = nullptr);

// The grouped product of a bank's experts over their sorted rows: held expert e multiplies x rows
// [rows[e] - rows[0], rows[e + 1] - rows[0]) (rows: [bank.n_experts + 1] non-decreasing) and writes the same rows
// of y. x: [rows[n] - rows[0], bank.cols] f32; y: [.., bank.rows] f32. Each expert's product is matmul's (the
// same bits); the activations are rounded once for all rows and every (expert, row block) is one work item of a
// single parallel region, so a decode step hands off to the pool once per grouped product, not once per expert.
void matmul_grouped(ThreadPool &pool, const float *x, const WeightBankRef &bank, const int32_t *rows, float *y,
                    const ActScratch *scratch = nullptr);

// ---------------------------------------------------------------------------------------------
// Row-parallel products (attention o_proj, dense and expert down_proj): K is cut into kCanonicalBlocks
// blocks of B = K / 8 columns (K = weight_k_full(w), K % 8 == 0: MEMRA_CHECK); block b covers K range
// [b * B, (b + 1) * B). Each block's partial is the canonical K loop over that range; the 8 partials are
// added as
//   ((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7)).
// With TP = N each rank owns the aligned subtree of 8 / N blocks, reduces it with canonical_tree_reduce,
// and the N subtree sums are finished with canonical_tree_combine: bit-identical to TP = 1.

// B = weight_k_full(w) / kCanonicalBlocks (MEMRA_CHECK that it divides).
int64_t canonical_block_size(const WeightRef &w);

// Partials of blocks [block_begin, block_end) (0 <= begin < end <= 8, inside the K columns w holds).
// x_blocks: [n_tokens, (block_end - block_begin) * B] f32 — the activation columns of those blocks only
//           (for all 8 blocks, the full x row; for a TP rank, its local shard).
// partials: [block_end - block_begin, n_tokens, w.rows] f32.
void matmul_block_partials(ThreadPool &pool, const float *x_blocks, int64_t n_tokens, const WeightRef &w,
                           int64_t block_begin, int64_t block_end, float *partials,
                           const ActScratch *scratch = nullptr);

// Reduces the partials of an aligned subtree of the canonical tree: blocks [block_begin, block_end) with
// size 1, 2, 4 or 8 and block_begin a multiple of the size (MEMRA_CHECK), by the tree's own levels.
// partials: [block_end - block_begin, n] f32; out: [n] f32.
void canonical_tree_reduce(const float *partials, int64_t block_begin, int64_t block_end, int64_t n, float *out);

// Finishes the tree from n_subtrees (1, 2, 4 or 8) equal aligned subtree sums in block order, as the ranks
// of TP = n_subtrees hold them after an all-gather. subtree_sums: [n_subtrees, n] f32; out: [n] f32.
void canonical_tree_combine(const float *subtree_sums, int64_t n_subtrees, int64_t n, float *out);

// The canonical blocks w holds: [k_begin / B, (k_begin + cols) / B) — all 8 for a whole weight, a TP rank's
// aligned subtree for a K window. MEMRA_CHECK that the window is whole blocks forming an aligned subtree.
struct BlockRange {
    int64_t begin = 0;
    int64_t end = 0;
};
BlockRange weight_canonical_blocks(const WeightRef &w);

// Floats of workspace matmul_canonical needs: (blocks held) * n_tokens * w.rows.
int64_t matmul_canonical_workspace_floats(int64_t n_tokens, const WeightRef &w);

// The row-parallel product over the blocks w holds: their partials, then their subtree of the tree. For a
// whole weight that is the TP = 1 product; for a TP rank's K window it is the rank's subtree sum.
// x: [n_tokens, w.cols] f32 (the held K columns); y: [n_tokens, w.rows] f32;
// workspace: matmul_canonical_workspace_floats() floats.
void matmul_canonical(ThreadPool &pool, const float *x, int64_t n_tokens, const WeightRef &w, float *y,
                      float *workspace, const ActScratch *scratch = nullptr);

}  // namespace memra::cpu
