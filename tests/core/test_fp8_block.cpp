// core/fp8_block.h: the 128x128 block-scale convention (dequantization with partial edge blocks,
// the single-row form) and the deterministic quantizer's scale rule, saturation and error bounds.
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "core/float_formats.h"
#include "core/fp8_block.h"

namespace memra {
namespace {

uint32_t bits(float f) { return f32_as_u32(f); }

TEST(Fp8Block, ScaleBlocksIsCeilOf128) {
    EXPECT_EQ(kFp8Block, 128);
    EXPECT_EQ(fp8_scale_blocks(0), 0);
    EXPECT_EQ(fp8_scale_blocks(1), 1);
    EXPECT_EQ(fp8_scale_blocks(127), 1);
    EXPECT_EQ(fp8_scale_blocks(128), 1);
    EXPECT_EQ(fp8_scale_blocks(129), 2);
    EXPECT_EQ(fp8_scale_blocks(300), 3);
    EXPECT_EQ(fp8_scale_blocks(4096), 32);
}

TEST(Fp8Block, DequantOneIsASingleMultiply) {
    EXPECT_EQ(fp8_block_dequant_one(0x38, 0.5f), 0.5f);     // 1.0 * 0.5
    EXPECT_EQ(fp8_block_dequant_one(0x7e, 2.0f), 896.0f);   // 448 * 2
    EXPECT_EQ(fp8_block_dequant_one(0xfe, 0.25f), -112.0f);
    EXPECT_EQ(bits(fp8_block_dequant_one(0x80, 3.0f)), 0x80000000u);
    EXPECT_TRUE(std::isnan(fp8_block_dequant_one(0x7f, 1.0f)));
    // Exactly one rounding: 1.125 * 0.1f rounded once, not (1.125 rounded) * ...
    EXPECT_EQ(bits(fp8_block_dequant_one(0x39, 0.1f)), bits(1.125f * 0.1f));
}

// A [200, 300] matrix: scales [2, 3], the last block row 72 rows tall and the last block column 44 wide.
TEST(Fp8Block, DequantizesPartialEdgeBlocks) {
    constexpr int64_t kRows = 200;
    constexpr int64_t kCols = 300;
    ASSERT_EQ(fp8_scale_blocks(kRows), 2);
    ASSERT_EQ(fp8_scale_blocks(kCols), 3);
    std::vector<uint8_t> q(kRows * kCols);  // [200, 300] e4m3, cycling through every code
    for (int64_t r = 0; r < kRows; ++r) {
        for (int64_t c = 0; c < kCols; ++c) q[r * kCols + c] = static_cast<uint8_t>((r * 7 + c * 13) & 0xff);
    }
    const std::vector<float> scale = {0.5f, 3.0f, 0.037f, 1e-3f, 7.25f, 1e20f};  // [2, 3]
    std::vector<float> out(kRows * kCols);
    dequantize_fp8_block(q.data(), kRows, kCols, scale.data(), out.data());
    for (int64_t r = 0; r < kRows; ++r) {
        for (int64_t c = 0; c < kCols; ++c) {
            const float want = fp8_e4m3_to_f32(q[r * kCols + c]) * scale[(r / 128) * 3 + c / 128];
            ASSERT_EQ(bits(out[r * kCols + c]), bits(want)) << "r=" << r << " c=" << c;
        }
    }
    // Block boundaries pick the neighbouring scale.
    auto at = [&](int64_t r, int64_t c) { return out[r * kCols + c] / fp8_e4m3_to_f32(q[r * kCols + c]); };
    q[127 * kCols + 127] = q[128 * kCols + 128] = q[199 * kCols + 299] = q[0 * kCols + 256] = 0x38;  // 1.0
    q[127 * kCols + 128] = 0x38;
    dequantize_fp8_block(q.data(), kRows, kCols, scale.data(), out.data());
    EXPECT_EQ(at(127, 127), 0.5f);
    EXPECT_EQ(at(127, 128), 3.0f);
    EXPECT_EQ(at(0, 256), 0.037f);
    EXPECT_EQ(at(128, 128), 7.25f);
    EXPECT_EQ(at(199, 299), 1e20f);
}

TEST(Fp8Block, RowFormMatchesTheMatrix) {
    constexpr int64_t kRows = 260;
    constexpr int64_t kCols = 131;
    std::mt19937 rng(3);
    std::vector<uint8_t> q(kRows * kCols);
    for (auto &v : q) v = static_cast<uint8_t>(rng());
    std::vector<float> scale(fp8_scale_blocks(kRows) * fp8_scale_blocks(kCols));  // [3, 2]
    for (size_t i = 0; i < scale.size(); ++i) scale[i] = 0.25f + static_cast<float>(i);
    std::vector<float> full(kRows * kCols);
    dequantize_fp8_block(q.data(), kRows, kCols, scale.data(), full.data());
    std::vector<float> row(kCols);
    for (int64_t r : {0, 127, 128, 255, 256, 259}) {
        dequantize_fp8_block_row(q.data() + r * kCols, r, kCols, scale.data(), row.data());
        for (int64_t c = 0; c < kCols; ++c) {
            ASSERT_EQ(bits(row[c]), bits(full[r * kCols + c])) << "r=" << r << " c=" << c;
        }
    }
}

// Random weights with a different magnitude per block.
std::vector<float> block_weights(int64_t rows, int64_t cols, uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::uniform_real_distribution<float> expo(-8.0f, 4.0f);
    std::vector<float> mags(fp8_scale_blocks(rows) * fp8_scale_blocks(cols));
    for (auto &m : mags) m = std::pow(10.0f, expo(rng));
    std::vector<float> w(rows * cols);
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < cols; ++c) {
            w[r * cols + c] = normal(rng) * mags[(r / 128) * fp8_scale_blocks(cols) + c / 128];
        }
    }
    return w;
}

TEST(Fp8Block, QuantizeScaleRuleAndErrorBound) {
    constexpr int64_t kRows = 200;
    constexpr int64_t kCols = 300;
    const std::vector<float> w = block_weights(kRows, kCols, 11);
    std::vector<uint8_t> q(kRows * kCols);
    std::vector<float> scale(2 * 3);
    quantize_fp8_block(w.data(), kRows, kCols, q.data(), scale.data());
    std::vector<float> deq(kRows * kCols);
    dequantize_fp8_block(q.data(), kRows, kCols, scale.data(), deq.data());
    for (int64_t br = 0; br < 2; ++br) {
        for (int64_t bc = 0; bc < 3; ++bc) {
            float amax = 0.0f;
            bool amax_code_seen = false;
            for (int64_t r = br * 128; r < std::min<int64_t>(kRows, br * 128 + 128); ++r) {
                for (int64_t c = bc * 128; c < std::min<int64_t>(kCols, bc * 128 + 128); ++c) {
                    amax = std::max(amax, std::fabs(w[r * kCols + c]));
                }
            }
            const float s = scale[br * 3 + bc];
            ASSERT_EQ(bits(s), bits(amax / 448.0f)) << "block " << br << "," << bc;
            for (int64_t r = br * 128; r < std::min<int64_t>(kRows, br * 128 + 128); ++r) {
                for (int64_t c = bc * 128; c < std::min<int64_t>(kCols, bc * 128 + 128); ++c) {
                    const uint8_t code = q[r * kCols + c];
                    ASSERT_NE(code & 0x7f, 0x7f) << "NaN code at " << r << "," << c;
                    amax_code_seen = amax_code_seen || (code & 0x7f) == 0x7e;
                    ASSERT_EQ(bits(deq[r * kCols + c]), bits(fp8_block_dequant_one(code, s)));
                    // Half an fp8 ulp: 2^-4 relative in the normal range, 2^-10 * s absolute below it;
                    // the f32 division and multiply add a few 2^-24.
                    const float x = w[r * kCols + c];
                    const float err = std::fabs(deq[r * kCols + c] - x);
                    const float bound = std::max(std::fabs(x) * 0x1p-4f, s * 0x1p-10f) * 1.0001f;
                    ASSERT_LE(err, bound) << "r=" << r << " c=" << c << " x=" << x;
                }
            }
            EXPECT_TRUE(amax_code_seen) << "block " << br << "," << bc << " never reaches +-448";
        }
    }
}

TEST(Fp8Block, QuantizeIsDeterministic) {
    const std::vector<float> w = block_weights(130, 257, 5);
    std::vector<uint8_t> q1(w.size()), q2(w.size());
    std::vector<float> s1(2 * 3), s2(2 * 3);
    quantize_fp8_block(w.data(), 130, 257, q1.data(), s1.data());
    quantize_fp8_block(w.data(), 130, 257, q2.data(), s2.data());
    EXPECT_EQ(q1, q2);
    for (size_t i = 0; i < s1.size(); ++i) EXPECT_EQ(bits(s1[i]), bits(s2[i]));
}

TEST(Fp8Block, SpecialBlocks) {
    // [128, 640]: five blocks side by side.
    constexpr int64_t kCols = 5 * 128;
    std::vector<float> w(128 * kCols, 0.0f);
    auto set_block = [&](int64_t bc, auto value_at) {
        for (int64_t r = 0; r < 128; ++r) {
            for (int64_t c = 0; c < 128; ++c) w[r * kCols + bc * 128 + c] = value_at(r, c);
        }
    };
    // Block 0 stays all zero (negative zeros included).
    w[5] = -0.0f;
    // Block 1: subnormal weights k * 2^-149, so amax / 448 underflows to 0.
    set_block(1, [](int64_t r, int64_t c) {
        return u32_as_f32(static_cast<uint32_t>((r + c) % 21)) * ((c & 1) ? -1.0f : 1.0f);
    });
    // Block 2: huge values near FLT_MAX.
    set_block(2, [](int64_t r, int64_t c) {
        return ((r + c) % 2 ? 3e38f : -1e38f) * (1.0f + static_cast<float>(c) * 1e-3f);
    });
    // Block 3: mixed signs with one Inf; block 4: normal values with one NaN.
    set_block(3, [](int64_t r, int64_t c) { return static_cast<float>(r - c); });
    w[7 * kCols + 3 * 128 + 9] = INFINITY;
    set_block(4, [](int64_t r, int64_t c) { return static_cast<float>(r + c) * 0.01f; });
    w[3 * kCols + 4 * 128 + 1] = NAN;
    std::vector<uint8_t> q(w.size());
    std::vector<float> scale(5);
    quantize_fp8_block(w.data(), 128, kCols, q.data(), scale.data());
    std::vector<float> deq(w.size());
    dequantize_fp8_block(q.data(), 128, kCols, scale.data(), deq.data());

    EXPECT_EQ(scale[0], 1.0f);
    for (int64_t r = 0; r < 128; ++r) {
        for (int64_t c = 0; c < 128; ++c) ASSERT_EQ(q[r * kCols + c] & 0x7f, 0);
    }
    EXPECT_EQ(bits(scale[1]), 1u);  // 2^-149
    for (int64_t r = 0; r < 128; ++r) {
        for (int64_t c = 128; c < 256; ++c) {
            const float x = w[r * kCols + c];
            ASSERT_FALSE(std::isnan(deq[r * kCols + c]));
            ASSERT_LE(std::fabs(deq[r * kCols + c] - x), std::fabs(x) * 0x1p-4f);  // k <= 20 fits fp8 well
        }
    }
    EXPECT_TRUE(std::isfinite(scale[2]));
    for (int64_t r = 0; r < 128; ++r) {
        for (int64_t c = 256; c < 384; ++c) {
            ASSERT_NE(q[r * kCols + c] & 0x7f, 0x7f);
            ASSERT_TRUE(std::isfinite(deq[r * kCols + c]));
        }
    }
    EXPECT_TRUE(std::isinf(scale[3]));  // documented: a non-finite weight poisons its block loudly
    EXPECT_TRUE(std::isnan(scale[4]));
    EXPECT_TRUE(std::isnan(deq[0 * kCols + 3 * 128 + 0]));
    EXPECT_TRUE(std::isnan(deq[0 * kCols + 4 * 128 + 0]));
}

TEST(Fp8Block, EmptyShapesAreFine) {
    quantize_fp8_block(nullptr, 0, 5, nullptr, nullptr);
    dequantize_fp8_block(nullptr, 7, 0, nullptr, nullptr);
    SUCCEED();
}

TEST(Fp8BlockDeathTest, NegativeShapesAbort) {
    float w = 0.0f;
    uint8_t q = 0;
    float s = 0.0f;
    EXPECT_DEATH(quantize_fp8_block(&w, -1, 1, &q, &s), "quantize_fp8_block: rows and cols must be >= 0");
    EXPECT_DEATH(dequantize_fp8_block(&q, 1, -2, &s, &w), "dequantize_fp8_block: rows and cols must be >= 0");
    EXPECT_DEATH(dequantize_fp8_block_row(&q, -1, 1, &s, &w), "row and cols must be >= 0");
}

}  // namespace
}  // namespace memra
