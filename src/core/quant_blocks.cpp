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

float abs_f32(float v) { return u32_as_f32(f32_as_u32(v) & 0x7fffffffu); }

bool is_nan(float v) { return v != v; }

// max |x| over one block; a NaN anywhere makes the result NaN (numpy's max semantics).
float block_amax(const float *x) {
    float amax = 0.0f;
    for (int j = 0; j < kQuantBlock; ++j) {
        const float a = abs_f32(x[j]);
        if (a > amax || is_nan(a)) amax = a;
    }
    return amax;
}

// A float code converted to a byte as numpy's float32 -> int8/uint8 cast does on x86: truncation
// toward zero, keeping the low 8 bits; NaN, +-Inf and anything beyond int32 give 0 (floats that large
// are multiples of 256, and x86's "integer indefinite" result has a zero low byte).
uint8_t code_byte(float v) {
    if (!(abs_f32(v) < 2147483648.0f)) return 0;
    return static_cast<uint8_t>(static_cast<uint32_t>(static_cast<int32_t>(v)));
}

// Round half away from zero (C roundf, gguf's np_roundf); non-finite values pass through to code_byte.
float round_half_away(float v) {
    if (!(abs_f32(v) < 8388608.0f)) return v;  // NaN, Inf, or already an integer (>= 2^23)
    const int32_t t = static_cast<int32_t>(v);
    const float frac = abs_f32(v) - abs_f32(static_cast<float>(t));  // exact below 2^23
    if (frac >= 0.5f) return static_cast<float>(v < 0.0f ? t - 1 : t + 1);
    return static_cast<float>(t);
}

// Shared by q8_0 and q8_1: the scale d (unrounded) and the 32 codes.
float quantize_q8_codes(const float *x, int8_t *qs) {
    const float d = block_amax(x) / 127.0f;
    const float id = d == 0.0f ? 0.0f : 1.0f / d;
    for (int j = 0; j < kQuantBlock; ++j) {
        qs[j] = static_cast<int8_t>(code_byte(round_half_away(x[j] * id)));
    }
    return d;
}

}  // namespace

void quantize_row_q8_0(const float *x, BlockQ8_0 *y, int64_t n) {
    check_row_length("quantize_row_q8_0", n);
    for (int64_t b = 0; b < n / kQuantBlock; ++b) {
        y[b].d = f32_to_f16(quantize_q8_codes(x + b * kQuantBlock, y[b].qs));
    }
}

void dequantize_row_q8_0(const BlockQ8_0 *x, float *y, int64_t n) {
    check_row_length("dequantize_row_q8_0", n);
    for (int64_t b = 0; b < n / kQuantBlock; ++b) q8_0_dequant_block(x[b], y + b * kQuantBlock);
}

void quantize_row_q8_1(const float *x, BlockQ8_1 *y, int64_t n) {
    check_row_length("quantize_row_q8_1", n);
    for (int64_t b = 0; b < n / kQuantBlock; ++b) {
        const float d = quantize_q8_codes(x + b * kQuantBlock, y[b].qs);
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
    for (int64_t b = 0; b < n / kQuantBlock; ++b) {
        const float *xb = x + b * kQuantBlock;  // [32]
        // min and max, first one on ties; once a NaN is seen it sticks (numpy's min/max).
        float lo = xb[0];
        float hi = xb[0];
        for (int j = 1; j < kQuantBlock; ++j) {
            if (!is_nan(lo) && !(xb[j] >= lo)) lo = xb[j];
            if (!is_nan(hi) && !(xb[j] <= hi)) hi = xb[j];
        }
        const float d = (hi - lo) / 31.0f;
        const float id = d == 0.0f ? 0.0f : 1.0f / d;
        uint8_t q[32];
        for (int j = 0; j < kQuantBlock; ++j) {
            const uint8_t c = code_byte((xb[j] - lo) * id + 0.5f);
            q[j] = c > 31 ? 31 : c;
        }
        uint32_t qh = 0;
        for (int j = 0; j < 16; ++j) {
            y[b].qs[j] = static_cast<uint8_t>((q[j] & 0xfu) | ((q[j + 16] & 0xfu) << 4));
        }
        for (int j = 0; j < kQuantBlock; ++j) qh |= static_cast<uint32_t>((q[j] >> 4) & 1u) << j;
        for (int k = 0; k < 4; ++k) y[b].qh[k] = static_cast<uint8_t>(qh >> (8 * k));
        y[b].d = f32_to_f16(d);
        y[b].m = f32_to_f16(lo);
    }
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
        for (int j = 1; j < kQuantBlock && !is_nan(abs_f32(xb[imax])); ++j) {
            if (abs_f32(xb[j]) > abs_f32(xb[imax]) || is_nan(xb[j])) imax = j;
        }
        const float d = xb[imax] / -8.0f;
        const float id = d == 0.0f ? 0.0f : 1.0f / d;
        uint8_t q[32];
        for (int j = 0; j < kQuantBlock; ++j) {
            const uint8_t c = code_byte(xb[j] * id + 8.5f);
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
