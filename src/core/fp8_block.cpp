// FP8 128x128 block-scaled weights on the host: dequantization (the reference the CUDA kernel must
// match bit for bit) and the deterministic quantizer used to build test and tiny checkpoints.
#include "core/fp8_block.h"

#include "core/check.h"

namespace memra {

namespace {

void check_shape(const char *what, int64_t rows, int64_t cols) {
    MEMRA_CHECK(rows >= 0 && cols >= 0, "{}: rows and cols must be >= 0, got rows={} cols={}", what, rows, cols);
}

// The 256 decoded codes, so the hot loop is a load and fp8_block_dequant_one's single multiply:
// decoded[q] * s is bit for bit fp8_block_dequant_one(q, s).
struct Fp8DecodeTable {
    float decoded[256];
};

Fp8DecodeTable make_decode_table() {
    Fp8DecodeTable t;
    for (int c = 0; c < 256; ++c) t.decoded[c] = fp8_e4m3_to_f32(static_cast<uint8_t>(c));
    return t;
}

void dequantize_row(const Fp8DecodeTable &table, const uint8_t *q_row, int64_t row, int64_t cols,
                    const float *scale_inv, float *out) {
    const float *scale_row = scale_inv + (row / kFp8Block) * fp8_scale_blocks(cols);  // [ceil(cols/128)]
    for (int64_t c0 = 0; c0 < cols; c0 += kFp8Block) {
        const float s = scale_row[c0 / kFp8Block];
        const int64_t c1 = c0 + kFp8Block < cols ? c0 + kFp8Block : cols;
        for (int64_t c = c0; c < c1; ++c) out[c] = table.decoded[q_row[c]] * s;
    }
}

}  // namespace

void dequantize_fp8_block_row(const uint8_t *q_row, int64_t row, int64_t cols, const float *scale_inv,
                              float *out) {
    MEMRA_CHECK(row >= 0 && cols >= 0, "dequantize_fp8_block_row: row and cols must be >= 0, got row={} cols={}",
                row, cols);
    dequantize_row(make_decode_table(), q_row, row, cols, scale_inv, out);
}

void dequantize_fp8_block(const uint8_t *q, int64_t rows, int64_t cols, const float *scale_inv, float *out) {
    check_shape("dequantize_fp8_block", rows, cols);
    const Fp8DecodeTable table = make_decode_table();
    for (int64_t r = 0; r < rows; ++r) dequantize_row(table, q + r * cols, r, cols, scale_inv, out + r * cols);
}

void quantize_fp8_block(const float *w, int64_t rows, int64_t cols, uint8_t *q, float *scale_inv) {
    check_shape("quantize_fp8_block", rows, cols);
    const int64_t scale_cols = fp8_scale_blocks(cols);
    for (int64_t br = 0; br < fp8_scale_blocks(rows); ++br) {
        const int64_t r0 = br * kFp8Block;
        const int64_t r1 = r0 + kFp8Block < rows ? r0 + kFp8Block : rows;
        for (int64_t bc = 0; bc < scale_cols; ++bc) {
            const int64_t c0 = bc * kFp8Block;
            const int64_t c1 = c0 + kFp8Block < cols ? c0 + kFp8Block : cols;
            // amax = max |w|. Magnitudes order like their bit patterns, so an integer maximum (which vectorizes)
            // is amax unless a pattern is above +Inf's: then a NaN propagates, the last one as `a > amax` plus
            // the NaN test would keep it.
            uint32_t amax_bits = 0;
            for (int64_t r = r0; r < r1; ++r) {
                for (int64_t c = c0; c < c1; ++c) {
                    const uint32_t a = f32_as_u32(w[r * cols + c]) & 0x7fffffffu;
                    amax_bits = a > amax_bits ? a : amax_bits;
                }
            }
            float amax = u32_as_f32(amax_bits);
            if (amax_bits > 0x7f800000u) {
                for (int64_t r = r0; r < r1; ++r) {
                    for (int64_t c = c0; c < c1; ++c) {
                        const float a = u32_as_f32(f32_as_u32(w[r * cols + c]) & 0x7fffffffu);
                        if (a != a) amax = a;
                    }
                }
            }
            float s = amax / 448.0f;
            if (amax == 0.0f) {
                s = 1.0f;
            } else if (s == 0.0f) {
                s = u32_as_f32(1u);  // 2^-149: amax / 448 underflowed
            }
            scale_inv[br * scale_cols + bc] = s;
            // The divisions first (they vectorize), then the conversions.
            float scaled[kFp8Block];
            for (int64_t r = r0; r < r1; ++r) {
                for (int64_t c = c0; c < c1; ++c) scaled[c - c0] = w[r * cols + c] / s;
                for (int64_t c = c0; c < c1; ++c) {
                    q[r * cols + c] = f32_to_fp8_e4m3(scaled[c - c0], Fp8Saturation::kSaturate);
                }
            }
        }
    }
}

}  // namespace memra
