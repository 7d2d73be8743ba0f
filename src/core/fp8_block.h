// FP8 weights with 128x128 block scales, the convention of the official FP8 checkpoints: a weight
// [rows, cols] stored as float8_e4m3fn plus `weight_scale_inv` [ceil(rows/128), ceil(cols/128)] f32,
// where element (r, c) means float(q[r][c]) * scale_inv[r/128][c/128] (one f32 multiply; edge blocks
// are simply partial). The scalar step is MEMRA_HD so CPU and CUDA dequantize to the same bits.
#pragma once

#include <cstdint>

#include "core/float_formats.h"
#include "core/hd.h"

namespace memra {

inline constexpr int64_t kFp8Block = 128;

// Number of 128-wide scale blocks covering n rows or columns: ceil(n / 128), for n >= 0.
MEMRA_HD constexpr int64_t fp8_scale_blocks(int64_t n) { return (n + kFp8Block - 1) / kFp8Block; }

// The one multiply that defines a dequantized element; every backend calls this.
MEMRA_HD float fp8_block_dequant_one(uint8_t q, float scale_inv) { return fp8_e4m3_to_f32(q) * scale_inv; }

// q: [rows, cols] e4m3fn, row-major; scale_inv: [ceil(rows/128), ceil(cols/128)] f32;
// out: [rows, cols] f32.
void dequantize_fp8_block(const uint8_t *q, int64_t rows, int64_t cols, const float *scale_inv, float *out);

// One row: q_row and out are [cols]; `row` (the row's index in the full matrix) picks scale row row/128
// of the same scale_inv tensor as above.
void dequantize_fp8_block_row(const uint8_t *q_row, int64_t row, int64_t cols, const float *scale_inv,
                              float *out);

// Quantizes w [rows, cols] f32 into q [rows, cols] e4m3fn and scale_inv [ceil(rows/128), ceil(cols/128)].
// Per block (edge blocks partial): amax = max |w| (any NaN in the block makes it NaN);
// scale_inv = amax / 448 in f32, except 1 for an all-zero block and the smallest positive subnormal
// (2^-149) when amax / 448 underflows to 0, so that 0 / scale_inv never produces NaN;
// q = f32_to_fp8_e4m3(w / scale_inv, kSaturate) (a true f32 division, not a multiply by an inverse).
// The block's amax element therefore lands on +-448 and nothing overflows. A NaN or Inf weight makes
// its block's scale NaN or Inf, so the whole block dequantizes to NaN: loud, never silently finite.
// Deterministic: a pure function of w, independent of threading.
void quantize_fp8_block(const float *w, int64_t rows, int64_t cols, uint8_t *q, float *scale_inv);

}  // namespace memra
