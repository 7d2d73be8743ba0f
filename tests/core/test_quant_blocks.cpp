// core/quant_blocks.h: GGML block layouts byte for byte on hand-built blocks, the gguf quantizer
// arithmetic on ties, zeros, subnormals and huge values, and dequantization error bounds on random data.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "core/float_formats.h"
#include "core/quant_blocks.h"

namespace memra {
namespace {

uint32_t bits(float f) { return f32_as_u32(f); }

std::vector<float> random_row(int64_t n_blocks, uint32_t seed, float lo_exp, float hi_exp) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::uniform_real_distribution<float> expo(lo_exp, hi_exp);
    std::vector<float> x(n_blocks * kQuantBlock);
    for (int64_t b = 0; b < n_blocks; ++b) {
        const float mag = std::pow(10.0f, expo(rng));
        for (int j = 0; j < kQuantBlock; ++j) x[b * kQuantBlock + j] = normal(rng) * mag;
    }
    return x;
}

TEST(QuantBlocks, LayoutsMatchGgml) {
    EXPECT_EQ(kQuantBlock, 32);
    EXPECT_EQ(sizeof(BlockQ8_0), 34u);
    EXPECT_EQ(sizeof(BlockQ5_1), 24u);
    EXPECT_EQ(sizeof(BlockQ4_0), 18u);
    EXPECT_EQ(sizeof(BlockQ8_1), 36u);
    // Arrays of blocks are contiguous with no padding, as in a GGUF tensor.
    EXPECT_EQ(sizeof(BlockQ8_0[3]), 3 * 34u);
    EXPECT_EQ(sizeof(BlockQ5_1[3]), 3 * 24u);
}

// ---------------------------------------------------------------------------------------------
// q8_0

TEST(QuantBlocks, Q8_0RoundsHalfAwayFromZero) {
    // amax 127 makes d = 1 and id = 1, so codes are round(x) exactly.
    const float x[32] = {127, -127, 2.5f, -2.5f, 0.5f, -0.5f, 1.5f, -1.5f, 0.49999997f, -0.49999997f, 3.0f, -0.0f,
                         100.5f, -100.5f, 126.5f, -126.5f};
    BlockQ8_0 b;
    quantize_row_q8_0(x, &b, 32);
    EXPECT_EQ(b.d, 0x3c00);  // fp16 1.0
    const int want[16] = {127, -127, 3, -3, 1, -1, 2, -2, 0, 0, 3, 0, 101, -101, 127, -127};
    for (int j = 0; j < 16; ++j) EXPECT_EQ(b.qs[j], want[j]) << "j=" << j;
    for (int j = 16; j < 32; ++j) EXPECT_EQ(b.qs[j], 0);
    float y[32];
    dequantize_row_q8_0(&b, y, 32);
    for (int j = 0; j < 16; ++j) EXPECT_EQ(y[j], static_cast<float>(want[j]));
}

TEST(QuantBlocks, Q8_0Zeros) {
    std::vector<float> x(64, 0.0f);
    x[3] = -0.0f;
    BlockQ8_0 b[2];
    quantize_row_q8_0(x.data(), b, 64);
    float y[64];
    dequantize_row_q8_0(b, y, 64);
    for (const BlockQ8_0 &blk : b) {
        EXPECT_EQ(blk.d, 0);
        for (int8_t q : blk.qs) EXPECT_EQ(q, 0);
    }
    for (float v : y) EXPECT_EQ(bits(v), 0u);
}

TEST(QuantBlocks, Q8_0ErrorBoundOnRandomData) {
    const std::vector<float> x = random_row(256, 1, -1.5f, 4.0f);  // d stays in fp16's normal range
    std::vector<BlockQ8_0> b(256);
    quantize_row_q8_0(x.data(), b.data(), static_cast<int64_t>(x.size()));
    std::vector<float> y(x.size());
    dequantize_row_q8_0(b.data(), y.data(), static_cast<int64_t>(y.size()));
    for (int64_t blk = 0; blk < 256; ++blk) {
        float amax = 0.0f;
        for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[blk * 32 + j]));
        const float d = amax / 127.0f;
        EXPECT_EQ(b[blk].d, f32_to_f16(d));
        bool hit_127 = false;
        for (int j = 0; j < 32; ++j) {
            hit_127 = hit_127 || std::abs(b[blk].qs[j]) == 127;
            // Half a step from rounding, plus up to 127 times d's fp16 rounding (2^-11 relative).
            const float bound = d * (0.5f + 127.0f * 0x1p-11f) * 1.001f;
            ASSERT_LE(std::fabs(y[blk * 32 + j] - x[blk * 32 + j]), bound) << "block " << blk << " j " << j;
            ASSERT_EQ(bits(y[blk * 32 + j]), bits(q8_0_dequant_one(b[blk], j)));
        }
        EXPECT_TRUE(hit_127) << "block " << blk;
    }
}

TEST(QuantBlocks, Q8_0SubnormalAndHugeBlocks) {
    std::vector<float> x(3 * 32);
    for (int j = 0; j < 32; ++j) {
        x[j] = (j % 2 ? -1.0f : 1.0f) * 1e-40f * static_cast<float>(j + 1);  // subnormal: 1 / d overflows
        x[32 + j] = (j % 3 ? 3e38f : -1e30f);                                 // fp16(d) overflows to Inf
        x[64 + j] = j == 17 ? -2.0f : 0.0f;                                   // a single nonzero
    }
    BlockQ8_0 b[3];
    quantize_row_q8_0(x.data(), b, 96);
    EXPECT_EQ(b[0].d, 0);  // d ~ 2.5e-41 underflows fp16
    for (int8_t q : b[0].qs) EXPECT_EQ(q, 0);  // x * Inf is +-Inf: not a code, so 0 (numpy's cast)
    EXPECT_EQ(b[1].d, 0x7c00);
    EXPECT_EQ(b[1].qs[1], 127);
    EXPECT_EQ(b[1].qs[0], 0);  // -1e30 * (127 / 3e38) rounds to -0
    EXPECT_EQ(b[2].d, f32_to_f16(2.0f / 127.0f));
    for (int j = 0; j < 32; ++j) EXPECT_EQ(b[2].qs[j], j == 17 ? -127 : 0);
    float y[96];
    dequantize_row_q8_0(b, y, 96);
    EXPECT_TRUE(std::isinf(y[32 + 1]));
    EXPECT_TRUE(std::isnan(y[32 + 0]));  // 0 * Inf
    EXPECT_NEAR(y[64 + 17], -2.0f, 2.0f * 0x1p-10f);
}

// ---------------------------------------------------------------------------------------------
// q5_1

TEST(QuantBlocks, Q5_1LayoutByteForByte) {
    // x = 0..31: lo 0, hi 31, d = 1, so q[j] = j; bit 4 is set exactly for j >= 16.
    float x[32];
    for (int j = 0; j < 32; ++j) x[j] = static_cast<float>(j);
    BlockQ5_1 b;
    quantize_row_q5_1(x, &b, 32);
    uint8_t raw[24];
    std::memcpy(raw, &b, sizeof(raw));
    const uint8_t want_head[8] = {0x00, 0x3c, 0x00, 0x00, 0x00, 0x00, 0xff, 0xff};  // d=1.0, m=0, qh
    for (int i = 0; i < 8; ++i) EXPECT_EQ(raw[i], want_head[i]) << "byte " << i;
    for (int j = 0; j < 16; ++j) EXPECT_EQ(raw[8 + j], static_cast<uint8_t>(j | (j << 4))) << "qs " << j;
    for (int j = 0; j < 32; ++j) EXPECT_EQ(q5_1_code(b, j), j);
    float y[32];
    dequantize_row_q5_1(&b, y, 32);
    for (int j = 0; j < 32; ++j) EXPECT_EQ(y[j], x[j]);
}

TEST(QuantBlocks, Q5_1TruncatesAfterAddingHalf) {
    // lo = -1, hi = 30 (d = 1): x - lo + 0.5 truncated. x.5 steps are ties that go up.
    float x[32] = {-1.0f, 30.0f, 0.5f, 0.49f, 2.4999998f, 29.6f};
    for (int j = 6; j < 32; ++j) x[j] = -1.0f;
    BlockQ5_1 b;
    quantize_row_q5_1(x, &b, 32);
    EXPECT_EQ(b.d, 0x3c00);
    EXPECT_EQ(b.m, 0xbc00);  // -1.0
    const int want[6] = {0, 31, 2, 1, 3, 31};
    for (int j = 0; j < 6; ++j) EXPECT_EQ(q5_1_code(b, j), want[j]) << "j=" << j;
}

TEST(QuantBlocks, Q5_1AllEqualAndZeroBlocks) {
    std::vector<float> x(64);
    for (int j = 0; j < 32; ++j) {
        x[j] = -3.25f;
        x[32 + j] = 0.0f;
    }
    BlockQ5_1 b[2];
    quantize_row_q5_1(x.data(), b, 64);
    EXPECT_EQ(b[0].d, 0);
    EXPECT_EQ(b[0].m, f32_to_f16(-3.25f));
    EXPECT_EQ(b[1].d, 0);
    EXPECT_EQ(b[1].m, 0);
    float y[64];
    dequantize_row_q5_1(b, y, 64);
    for (int j = 0; j < 32; ++j) {
        EXPECT_EQ(y[j], -3.25f);
        EXPECT_EQ(y[32 + j], 0.0f);
    }
}

TEST(QuantBlocks, Q5_1ErrorBoundOnMixedSigns) {
    const std::vector<float> x = random_row(256, 2, -3.0f, 3.0f);
    std::vector<BlockQ5_1> b(256);
    quantize_row_q5_1(x.data(), b.data(), static_cast<int64_t>(x.size()));
    std::vector<float> y(x.size());
    dequantize_row_q5_1(b.data(), y.data(), static_cast<int64_t>(y.size()));
    for (int64_t blk = 0; blk < 256; ++blk) {
        float lo = x[blk * 32];
        float hi = lo;
        for (int j = 0; j < 32; ++j) {
            lo = std::min(lo, x[blk * 32 + j]);
            hi = std::max(hi, x[blk * 32 + j]);
        }
        const float d = (hi - lo) / 31.0f;
        // Half a step, plus fp16 rounding of d (times up to 31) and of the minimum.
        const float bound = (d * (0.5f + 31.0f * 0x1p-11f) + std::fabs(lo) * 0x1p-11f) * 1.001f;
        for (int j = 0; j < 32; ++j) {
            ASSERT_LE(std::fabs(y[blk * 32 + j] - x[blk * 32 + j]), bound) << "block " << blk << " j " << j;
        }
    }
}

TEST(QuantBlocks, Q5_1HugeRangeGivesInfScale) {
    float x[32];
    for (int j = 0; j < 32; ++j) x[j] = j % 2 ? 3e38f : -3e38f;  // hi - lo overflows f32
    BlockQ5_1 b;
    quantize_row_q5_1(x, &b, 32);
    EXPECT_EQ(b.d, 0x7c00);
    EXPECT_EQ(b.m, 0xfc00);  // -3e38 is far beyond fp16
    for (int j = 0; j < 32; ++j) EXPECT_EQ(q5_1_code(b, j), 0);  // id = 1 / Inf = 0
}

// ---------------------------------------------------------------------------------------------
// q4_0

TEST(QuantBlocks, Q4_0LayoutByteForByte) {
    // The largest magnitude is -8 (first), so d = -8 / -8 = 1 and q = trunc(x + 8.5), clipped to 15.
    float x[32];
    for (int j = 0; j < 32; ++j) x[j] = -8.0f + 0.5f * static_cast<float>(j);  // -8 .. 7.5
    BlockQ4_0 b;
    quantize_row_q4_0(x, &b, 32);
    EXPECT_EQ(b.d, 0x3c00);
    for (int j = 0; j < 16; ++j) {
        const int lo = j / 2 + (j % 2);        // trunc(0.5 j + 0.5)
        const int hi = std::min(15, (j + 16) / 2 + ((j + 16) % 2));
        EXPECT_EQ(b.qs[j], static_cast<uint8_t>(lo | (hi << 4))) << "j=" << j;
    }
    float y[32];
    dequantize_row_q4_0(&b, y, 32);
    EXPECT_EQ(y[0], -8.0f);
    EXPECT_EQ(y[31], 7.0f);  // 7.5 clipped
    EXPECT_EQ(y[1], -7.0f);  // -7.5 + 8.5 = 1
}

TEST(QuantBlocks, Q4_0SignOfScaleFollowsLargestMagnitude) {
    float x[32] = {};
    x[4] = 8.0f;
    x[9] = -8.0f;  // same magnitude, later: the first one (positive) decides
    x[11] = 4.0f;
    BlockQ4_0 b;
    quantize_row_q4_0(x, &b, 32);
    EXPECT_EQ(b.d, 0xbc00);  // d = 8 / -8 = -1
    float y[32];
    dequantize_row_q4_0(&b, y, 32);
    EXPECT_EQ(y[4], 8.0f);   // q = trunc(-8 + 8.5) = 0 -> -1 * (0 - 8)
    EXPECT_EQ(y[9], -7.0f);  // q = trunc(8 + 8.5) = 16, clipped to 15 -> -1 * 7
    EXPECT_EQ(y[11], 4.0f);
    EXPECT_EQ(y[0], -0.0f);
}

TEST(QuantBlocks, Q4_0ErrorBoundAndZeros) {
    const std::vector<float> x = random_row(128, 3, -2.0f, 2.0f);
    std::vector<BlockQ4_0> b(128);
    quantize_row_q4_0(x.data(), b.data(), static_cast<int64_t>(x.size()));
    std::vector<float> y(x.size());
    dequantize_row_q4_0(b.data(), y.data(), static_cast<int64_t>(y.size()));
    for (int64_t blk = 0; blk < 128; ++blk) {
        float amax = 0.0f;
        for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[blk * 32 + j]));
        const float d = amax / 8.0f;
        // Half a step, but the far end of the range clips a whole step (q = 16 -> 15).
        for (int j = 0; j < 32; ++j) {
            ASSERT_LE(std::fabs(y[blk * 32 + j] - x[blk * 32 + j]), d * (1.0f + 8.0f * 0x1p-11f) * 1.001f);
        }
    }
    std::vector<float> zeros(32, 0.0f);
    BlockQ4_0 z;
    quantize_row_q4_0(zeros.data(), &z, 32);
    EXPECT_EQ(z.d, 0x8000);  // 0 / -8 = -0, as gguf writes it
    for (uint8_t q : z.qs) EXPECT_EQ(q, 0x88);  // trunc(0 + 8.5) = 8 in both nibbles
}

// ---------------------------------------------------------------------------------------------
// q8_1

TEST(QuantBlocks, Q8_1SharesQ8_0CodesAndAddsTheSum) {
    const std::vector<float> x = random_row(64, 4, -3.0f, 3.0f);
    std::vector<BlockQ8_0> a(64);
    std::vector<BlockQ8_1> b(64);
    quantize_row_q8_0(x.data(), a.data(), static_cast<int64_t>(x.size()));
    quantize_row_q8_1(x.data(), b.data(), static_cast<int64_t>(x.size()));
    std::vector<float> ya(x.size()), yb(x.size());
    dequantize_row_q8_0(a.data(), ya.data(), static_cast<int64_t>(x.size()));
    dequantize_row_q8_1(b.data(), yb.data(), static_cast<int64_t>(x.size()));
    for (int64_t blk = 0; blk < 64; ++blk) {
        EXPECT_EQ(a[blk].d, b[blk].d);
        EXPECT_EQ(std::memcmp(a[blk].qs, b[blk].qs, 32), 0);
        int sum = 0;
        float amax = 0.0f;
        for (int j = 0; j < 32; ++j) {
            sum += b[blk].qs[j];
            amax = std::max(amax, std::fabs(x[blk * 32 + j]));
        }
        EXPECT_EQ(b[blk].s, f32_to_f16(static_cast<float>(sum) * (amax / 127.0f))) << "block " << blk;
    }
    for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(bits(ya[i]), bits(yb[i]));
}

TEST(QuantBlocks, Q8_1KnownBlock) {
    std::vector<float> x(32, 1.0f);
    BlockQ8_1 b;
    quantize_row_q8_1(x.data(), &b, 32);
    for (int8_t q : b.qs) EXPECT_EQ(q, 127);
    EXPECT_EQ(b.d, f32_to_f16(1.0f / 127.0f));
    EXPECT_EQ(b.s, f32_to_f16(4064.0f * (1.0f / 127.0f)));  // 32 * 127 * d
    EXPECT_EQ(f16_to_f32(b.s), 32.0f);
}

// ---------------------------------------------------------------------------------------------
// Per-block device-shared helpers: the block forms (which widen the scales once) give exactly the
// per-element values, on random bytes (every code, any fp16 scale including Inf and NaN).

TEST(QuantBlocks, BlockFormsEqualPerElementForms) {
    std::mt19937 rng(9);
    std::vector<uint8_t> raw(64 * 36);
    for (auto &v : raw) v = static_cast<uint8_t>(rng());
    float blk[32];
    for (int b = 0; b < 64; ++b) {
        BlockQ8_0 q8;
        BlockQ5_1 q5;
        BlockQ4_0 q4;
        BlockQ8_1 q81;
        std::memcpy(&q8, raw.data() + b * 36, sizeof(q8));
        std::memcpy(&q5, raw.data() + b * 36, sizeof(q5));
        std::memcpy(&q4, raw.data() + b * 36, sizeof(q4));
        std::memcpy(&q81, raw.data() + b * 36, sizeof(q81));
        q8_0_dequant_block(q8, blk);
        for (int j = 0; j < 32; ++j) ASSERT_EQ(bits(blk[j]), bits(q8_0_dequant_one(q8, j))) << b << "," << j;
        q5_1_dequant_block(q5, blk);
        for (int j = 0; j < 32; ++j) ASSERT_EQ(bits(blk[j]), bits(q5_1_dequant_one(q5, j))) << b << "," << j;
        q4_0_dequant_block(q4, blk);
        for (int j = 0; j < 32; ++j) ASSERT_EQ(bits(blk[j]), bits(q4_0_dequant_one(q4, j))) << b << "," << j;
        q8_1_dequant_block(q81, blk);
        for (int j = 0; j < 32; ++j) ASSERT_EQ(bits(blk[j]), bits(q8_1_dequant_one(q81, j))) << b << "," << j;
    }
}

TEST(QuantBlocksDeathTest, RowLengthMustBeWholeBlocks) {
    float x[64] = {};
    BlockQ8_0 a[2];
    BlockQ5_1 b[2];
    BlockQ4_0 c[2];
    BlockQ8_1 d[2];
    EXPECT_DEATH(quantize_row_q8_0(x, a, 33), "quantize_row_q8_0: n must be a non-negative multiple of 32, got 33");
    EXPECT_DEATH(dequantize_row_q8_0(a, x, 31), "dequantize_row_q8_0: n must be .* got 31");
    EXPECT_DEATH(quantize_row_q5_1(x, b, 40), "quantize_row_q5_1: n must be .* got 40");
    EXPECT_DEATH(dequantize_row_q5_1(b, x, -32), "dequantize_row_q5_1: n must be .* got -32");
    EXPECT_DEATH(quantize_row_q4_0(x, c, 1), "quantize_row_q4_0: n must be .* got 1");
    EXPECT_DEATH(dequantize_row_q4_0(c, x, 63), "dequantize_row_q4_0: n must be .* got 63");
    EXPECT_DEATH(quantize_row_q8_1(x, d, 48), "quantize_row_q8_1: n must be .* got 48");
    EXPECT_DEATH(dequantize_row_q8_1(d, x, 16), "dequantize_row_q8_1: n must be .* got 16");
}

}  // namespace
}  // namespace memra
