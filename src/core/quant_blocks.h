// GGML block quantization formats, byte-compatible with GGML/GGUF: q8_0, q5_1 and q4_0 (KV cache
// and test formats) and q8_1 (GGML's activation format). Blocks of 32 consecutive values share an fp16
// scale (stored as raw binary16 bits). Quantizers reproduce the gguf package's reference quantizers bit
// for bit (tests/oracle/test_quants.py); the per-element dequant is MEMRA_HD so kernels share it.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/float_formats.h"
#include "core/hd.h"

namespace memra {

inline constexpr int64_t kQuantBlock = 32;

// The structs need no packing pragma: every field is 2-byte aligned or bytes, so the natural layout
// has no padding and matches GGML's; the asserts pin that.
struct BlockQ8_0 {
    uint16_t d;      // fp16 scale: value = d * qs[j]
    int8_t qs[32];   // [32] signed codes
};
static_assert(sizeof(BlockQ8_0) == 34 && offsetof(BlockQ8_0, qs) == 2, "BlockQ8_0 must match GGML's block_q8_0");

struct BlockQ5_1 {
    uint16_t d;      // fp16 scale
    uint16_t m;      // fp16 minimum: value = d * q + m, q in 0..31
    uint8_t qh[4];   // bit j (little-endian uint32) = bit 4 of q[j]
    uint8_t qs[16];  // low nibble = q[j] & 15, high nibble = q[j + 16] & 15
};
static_assert(sizeof(BlockQ5_1) == 24 && offsetof(BlockQ5_1, m) == 2 && offsetof(BlockQ5_1, qh) == 4 &&
                  offsetof(BlockQ5_1, qs) == 8,
              "BlockQ5_1 must match GGML's block_q5_1");

struct BlockQ4_0 {
    uint16_t d;      // fp16 scale: value = d * (q - 8), q in 0..15
    uint8_t qs[16];  // low nibble = q[j], high nibble = q[j + 16]
};
static_assert(sizeof(BlockQ4_0) == 18 && offsetof(BlockQ4_0, qs) == 2, "BlockQ4_0 must match GGML's block_q4_0");

struct BlockQ8_1 {
    uint16_t d;      // fp16 scale: value = d * qs[j]
    uint16_t s;      // fp16 of d * sum(qs) (d before its fp16 rounding), used by dot products
    int8_t qs[32];   // [32] signed codes
};
static_assert(sizeof(BlockQ8_1) == 36 && offsetof(BlockQ8_1, s) == 2 && offsetof(BlockQ8_1, qs) == 4,
              "BlockQ8_1 must match GGML's block_q8_1");

// ---------------------------------------------------------------------------------------------
// Dequantization of element j (0..31) of one block, and of a whole block into y[32]. Each is the
// gguf/GGML formula with every product and sum rounded separately (no fused multiply-add).

MEMRA_HD float q8_0_dequant_one(const BlockQ8_0 &b, int j) { return static_cast<float>(b.qs[j]) * f16_to_f32(b.d); }

MEMRA_HD int q5_1_code(const BlockQ5_1 &b, int j) {
    const int nibble = j < 16 ? (b.qs[j] & 0xf) : (b.qs[j - 16] >> 4);
    const int high = (b.qh[j >> 3] >> (j & 7)) & 1;
    return nibble | (high << 4);
}

MEMRA_HD float q5_1_dequant_one(const BlockQ5_1 &b, int j) {
    const float scaled = f16_to_f32(b.d) * static_cast<float>(q5_1_code(b, j));
    return scaled + f16_to_f32(b.m);
}

MEMRA_HD float q4_0_dequant_one(const BlockQ4_0 &b, int j) {
    const int code = j < 16 ? (b.qs[j] & 0xf) : (b.qs[j - 16] >> 4);
    return f16_to_f32(b.d) * static_cast<float>(code - 8);
}

MEMRA_HD float q8_1_dequant_one(const BlockQ8_1 &b, int j) { return static_cast<float>(b.qs[j]) * f16_to_f32(b.d); }

// The block forms widen the fp16 scales once; each element is still exactly the *_dequant_one value.
MEMRA_HD void q8_0_dequant_block(const BlockQ8_0 &b, float *y) {
    const float d = f16_to_f32(b.d);
    for (int j = 0; j < 32; ++j) y[j] = static_cast<float>(b.qs[j]) * d;
}

MEMRA_HD void q5_1_dequant_block(const BlockQ5_1 &b, float *y) {
    const float d = f16_to_f32(b.d);
    const float m = f16_to_f32(b.m);
    for (int j = 0; j < 32; ++j) {
        const float scaled = d * static_cast<float>(q5_1_code(b, j));
        y[j] = scaled + m;
    }
}

MEMRA_HD void q4_0_dequant_block(const BlockQ4_0 &b, float *y) {
    const float d = f16_to_f32(b.d);
    for (int j = 0; j < 16; ++j) {
        y[j] = d * static_cast<float>((b.qs[j] & 0xf) - 8);
        y[j + 16] = d * static_cast<float>((b.qs[j] >> 4) - 8);
    }
}

MEMRA_HD void q8_1_dequant_block(const BlockQ8_1 &b, float *y) {
    const float d = f16_to_f32(b.d);
    for (int j = 0; j < 32; ++j) y[j] = static_cast<float>(b.qs[j]) * d;
}

// ---------------------------------------------------------------------------------------------
// Quantization of one block of 32 values (the arithmetic of the row quantizers below, documented there),
// MEMRA_HD so kv_write and the query rounding on the GPU share the host's code.

namespace detail {

MEMRA_HD float quant_abs(float v) { return u32_as_f32(f32_as_u32(v) & 0x7fffffffu); }

MEMRA_HD bool quant_is_nan(float v) { return v != v; }

// max |x| over one block; a NaN anywhere makes the result NaN (numpy's max semantics).
MEMRA_HD float quant_block_amax(const float *x) {
    float amax = 0.0f;
    for (int j = 0; j < 32; ++j) {
        const float a = quant_abs(x[j]);
        if (a > amax || quant_is_nan(a)) amax = a;
    }
    return amax;
}

// A float code converted to a byte as numpy's float32 -> int8/uint8 cast does on x86: truncation
// toward zero, keeping the low 8 bits; NaN, +-Inf and anything beyond int32 give 0 (floats that large
// are multiples of 256, and x86's "integer indefinite" result has a zero low byte).
MEMRA_HD uint8_t quant_code_byte(float v) {
    if (!(quant_abs(v) < 2147483648.0f)) return 0;
    return static_cast<uint8_t>(static_cast<uint32_t>(static_cast<int32_t>(v)));
}

// Round half away from zero (C roundf, gguf's np_roundf); non-finite values pass through to quant_code_byte.
MEMRA_HD float quant_round_half_away(float v) {
    if (!(quant_abs(v) < 8388608.0f)) return v;  // NaN, Inf, or already an integer (>= 2^23)
    const int32_t t = static_cast<int32_t>(v);
    const float frac = quant_abs(v) - quant_abs(static_cast<float>(t));  // exact below 2^23
    if (frac >= 0.5f) return static_cast<float>(v < 0.0f ? t - 1 : t + 1);
    return static_cast<float>(t);
}

// Shared by q8_0 and q8_1: the scale d (unrounded) and the 32 codes.
MEMRA_HD float quantize_q8_codes(const float *x, int8_t *qs) {
    const float d = quant_block_amax(x) / 127.0f;
    const float id = d == 0.0f ? 0.0f : 1.0f / d;
    for (int j = 0; j < 32; ++j) {
        qs[j] = static_cast<int8_t>(quant_code_byte(quant_round_half_away(x[j] * id)));
    }
    return d;
}

}  // namespace detail

// x[32] -> one q8_0 block (quantize_row_q8_0 of one block).
MEMRA_HD void quantize_block_q8_0(const float *x, BlockQ8_0 &y) {
    y.d = f32_to_f16(detail::quantize_q8_codes(x, y.qs));
}

// x[32] -> one q5_1 block (quantize_row_q5_1 of one block).
MEMRA_HD void quantize_block_q5_1(const float *x, BlockQ5_1 &y) {
    // min and max, first one on ties; once a NaN is seen it sticks (numpy's min/max).
    float lo = x[0];
    float hi = x[0];
    for (int j = 1; j < 32; ++j) {
        if (!detail::quant_is_nan(lo) && !(x[j] >= lo)) lo = x[j];
        if (!detail::quant_is_nan(hi) && !(x[j] <= hi)) hi = x[j];
    }
    const float d = (hi - lo) / 31.0f;
    const float id = d == 0.0f ? 0.0f : 1.0f / d;
    uint8_t q[32];
    for (int j = 0; j < 32; ++j) {
        const uint8_t c = detail::quant_code_byte((x[j] - lo) * id + 0.5f);
        q[j] = c > 31 ? 31 : c;
    }
    uint32_t qh = 0;
    for (int j = 0; j < 16; ++j) {
        y.qs[j] = static_cast<uint8_t>((q[j] & 0xfu) | ((q[j + 16] & 0xfu) << 4));
    }
    for (int j = 0; j < 32; ++j) qh |= static_cast<uint32_t>((q[j] >> 4) & 1u) << j;
    for (int k = 0; k < 4; ++k) y.qh[k] = static_cast<uint8_t>(qh >> (8 * k));
    y.d = f32_to_f16(d);
    y.m = f32_to_f16(lo);
}

// ---------------------------------------------------------------------------------------------
// Rows: x / y hold n floats, n a multiple of 32 (MEMRA_CHECK), and n / 32 blocks.
//
// Quantizer arithmetic (all f32, each step rounded, fp16 by round-to-nearest-even):
//   q8_0: amax = max |x|; d = amax / 127; id = d ? 1 / d : 0; q = round-half-away(x * id).
//   q8_1: q8_0's d and q (GGML's quantize_row_q8_1_ref; gguf has no q8_1), plus s = fp16(sum(q) * d).
//   q5_1: lo = min x, hi = max x; d = (hi - lo) / 31; id = d ? 1 / d : 0;
//         q = min(trunc((x - lo) * id + 0.5), 31); stores fp16(d) and fp16(lo).
//   q4_0: mx = the x of largest |x| (first one on ties); d = mx / -8; id = d ? 1 / d : 0;
//         q = min(trunc(x * id + 8.5), 15).
// The scale is applied unrounded (as d) and stored rounded to fp16, as GGML does. A NaN anywhere in a
// block makes its amax/min/max NaN (numpy's max/min propagate it); a float that is NaN, Inf or beyond
// int32 when converted to a code becomes code 0 (the x86 conversion numpy's casts inherit). So
// denormal-only blocks (1 / d overflows) quantize to all-zero codes and huge blocks get d = fp16 Inf.

void quantize_row_q8_0(const float *x, BlockQ8_0 *y, int64_t n);
void dequantize_row_q8_0(const BlockQ8_0 *x, float *y, int64_t n);

void quantize_row_q5_1(const float *x, BlockQ5_1 *y, int64_t n);
void dequantize_row_q5_1(const BlockQ5_1 *x, float *y, int64_t n);

void quantize_row_q4_0(const float *x, BlockQ4_0 *y, int64_t n);
void dequantize_row_q4_0(const BlockQ4_0 *x, float *y, int64_t n);

// GGML itself has no q8_1 dequantizer; this one is the natural d * q (s is ignored).
void quantize_row_q8_1(const float *x, BlockQ8_1 *y, int64_t n);
void dequantize_row_q8_1(const BlockQ8_1 *x, float *y, int64_t n);

}  // namespace memra
