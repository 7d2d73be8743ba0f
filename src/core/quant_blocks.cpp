// GGML block quantizers and row dequantizers on the host. The quantizers follow the gguf package's
// reference arithmetic step for step (see quant_blocks.h), so GGUF files and KV blocks we write are
// the bytes llama.cpp's tools would write.
#include "core/quant_blocks.h"

#include "core/check.h"

namespace memra {

namespace {

void check_row_length(const char *what, int64_t n) {
    MEMRA_CHECK(n >= 0 && n % kQuantBlock == 0, "{}: n must be a non-negative multiple of {}, got {}", what,
                kQuantBlock, n);
}

}  // namespace

void quantize_row_q8_0(const float *x, BlockQ8_0 *y, int64_t n) {
    check_row_length("quantize_row_q8_0", n);
    for (int64_t b = 0; b < n / kQuantBlock; ++b) {
        quantize_block_q8_0(x + b * kQuantBlock, y[b]);
    }
}

void dequantize_row_q8_0(const BlockQ8_0 *x, float *y, int64_t n) {
    check_row_length("dequantize_row_q8_0", n);
    for (int64_t b = 0; b < n / kQuantBlock; ++b) q8_0_dequant_block(x[b], y + b * kQuantBlock);
}

void quantize_row_q8_1(const float *x, BlockQ8_1 *y, int64_t n) {
    check_row_length("quantize_row_q8_1", n);
    for (int64_t b = 0; b < n / kQuantBlock; ++b) {
        const float d = detail::quantize_q8_codes(x + b * kQuantBlock, y[b].qs);
        int32_t sum = 0;
        for (int j = 0; j < kQuantBlock; ++j) sum += y[b].qs[j];
        y[b].d = f32_to_f16(d);
        y[b].s = f32_to_f16(static_cast<float>(sum) * d);
    }
}

void dequantize_row_q8_1(const BlockQ8_1 *x, float *y, int64_t n) {
    check_row_length("dequantize_row_q8_1", n);
    for (int64_t b = 0; b < n / kQuantBlock; ++b) q8_1_dequant_block(x[b], y + b * kQuantBlock);
}

void quantize_row_q5_1(const float *x, BlockQ5_1 *y, int64_t n) {
    check_row_length("quantize_row_q5_1", n);
    for (int64_t b = 0; b < n / kQuantBlock; ++b) quantize_block_q5_1(x + b * kQuantBlock, y[b]);
}

void dequantize_row_q5_1(const BlockQ5_1 *x, float *y, int64_t n) {
    check_row_length("dequantize_row_q5_1", n);
    for (int64_t b = 0; b < n / kQuantBlock; ++b) q5_1_dequant_block(x[b], y + b * kQuantBlock);
}

void quantize_row_q4_0(const float *x, BlockQ4_0 *y, int64_t n) {
    check_row_length("quantize_row_q4_0", n);
    for (int64_t b = 0; b < n / kQuantBlock; ++b) {
        const float *xb = x + b * kQuantBlock;  // [32]
        // The signed value of largest magnitude, first one on ties; a NaN wins (numpy's argmax).
        int imax = 0;
        for (int j = 1; j < kQuantBlock && !detail::quant_is_nan(detail::quant_abs(xb[imax])); ++j) {
            if (detail::quant_abs(xb[j]) > detail::quant_abs(xb[imax]) || detail::quant_is_nan(xb[j])) imax = j;
        }
        const float d = xb[imax] / -8.0f;
        const float id = d == 0.0f ? 0.0f : 1.0f / d;
        uint8_t q[32];
        for (int j = 0; j < kQuantBlock; ++j) {
            const uint8_t c = detail::quant_code_byte(xb[j] * id + 8.5f);
            q[j] = c > 15 ? 15 : c;
        }
        for (int j = 0; j < 16; ++j) y[b].qs[j] = static_cast<uint8_t>(q[j] | (q[j + 16] << 4));
        y[b].d = f32_to_f16(d);
    }
}

void dequantize_row_q4_0(const BlockQ4_0 *x, float *y, int64_t n) {
    check_row_length("dequantize_row_q4_0", n);
    for (int64_t b = 0; b < n / kQuantBlock; ++b) q4_0_dequant_block(x[b], y + b * kQuantBlock);
}

}  // namespace memra
