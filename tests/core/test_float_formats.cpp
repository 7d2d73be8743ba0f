// core/float_formats.h: every bf16/f16/fp8 code decoded against a value formula, round trips over all
// codes, hand-picked edge cases (zeros, Inf, NaN, max finite, subnormals, ties both ways, overflow
// thresholds), and encoding checked against an independent nearest-value search on random floats.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "core/float_formats.h"

namespace memra {
namespace {

constexpr uint32_t kF32Nan = 0x7fc00000u;

float f32(uint32_t bits) { return u32_as_f32(bits); }
uint32_t bits(float f) { return f32_as_u32(f); }

// An IEEE-like binary format described by its field widths, with an independent (slow, double
// precision) value formula and nearest-value encoder to check the bit-twiddling against.
struct FormatSpec {
    int exp_bits;
    int man_bits;
    int bias;
    bool has_inf;  // false: float8_e4m3fn (only S.1111.111 is special, and it is NaN)

    uint32_t sign_bit() const { return 1u << (exp_bits + man_bits); }
    uint32_t n_codes() const { return sign_bit() << 1; }
    uint32_t exp_field(uint32_t c) const { return (c >> man_bits) & ((1u << exp_bits) - 1u); }
    uint32_t man_field(uint32_t c) const { return c & ((1u << man_bits) - 1u); }
    bool is_nan(uint32_t c) const {
        const uint32_t mag = c & (sign_bit() - 1u);
        if (!has_inf) return mag == sign_bit() - 1u;
        return exp_field(c) == (1u << exp_bits) - 1u && man_field(c) != 0;
    }
    bool is_inf(uint32_t c) const {
        return has_inf && exp_field(c) == (1u << exp_bits) - 1u && man_field(c) == 0;
    }
    // The value of a non-NaN code.
    double value(uint32_t c) const {
        const double sign = (c & sign_bit()) ? -1.0 : 1.0;
        if (is_inf(c)) return sign * INFINITY;
        const uint32_t e = exp_field(c);
        const uint32_t m = man_field(c);
        if (e == 0) return sign * std::ldexp(static_cast<double>(m), 1 - bias - man_bits);
        return sign * std::ldexp(static_cast<double>((1u << man_bits) + m), static_cast<int>(e) - bias - man_bits);
    }
};

constexpr FormatSpec kBf16{8, 7, 127, true};
constexpr FormatSpec kF16{5, 10, 15, true};
constexpr FormatSpec kFp8{4, 3, 7, false};

// Positive finite values in code order, plus one pseudo entry past the maximum (max + one ulp),
// whose code is the one after max (Inf for bf16/f16, the NaN pattern for fp8).
struct NearestTable {
    std::vector<double> values;
    std::vector<uint32_t> codes;
};

NearestTable make_table(const FormatSpec &spec) {
    NearestTable t;
    for (uint32_t c = 0; c < spec.sign_bit(); ++c) {
        if (spec.is_nan(c) || spec.is_inf(c)) break;
        t.values.push_back(spec.value(c));
        t.codes.push_back(c);
    }
    const size_t n = t.values.size();
    t.values.push_back(t.values[n - 1] + (t.values[n - 1] - t.values[n - 2]));
    t.codes.push_back(t.codes[n - 1] + 1);
    return t;
}

// Round-to-nearest-even by search: returns the code, or the pseudo "past max" code on overflow.
uint32_t nearest_code(const FormatSpec &spec, const NearestTable &t, float x) {
    const double a = std::fabs(static_cast<double>(x));
    const uint32_t sign = std::signbit(x) ? spec.sign_bit() : 0u;
    const size_t last = t.values.size() - 1;
    if (a >= t.values[last]) return sign | t.codes[last];
    const size_t hi = static_cast<size_t>(std::lower_bound(t.values.begin(), t.values.end(), a) - t.values.begin());
    if (t.values[hi] == a || hi == 0) return sign | t.codes[hi];
    const double below = a - t.values[hi - 1];
    const double above = t.values[hi] - a;
    if (below < above) return sign | t.codes[hi - 1];
    if (above < below) return sign | t.codes[hi];
    return sign | ((t.codes[hi] & 1u) == 0 ? t.codes[hi] : t.codes[hi - 1]);
}

// Random finite floats over all exponents, plus each table midpoint and one ulp either side, both signs.
std::vector<float> probe_floats(const NearestTable &t) {
    std::vector<float> out;
    std::mt19937 rng(42);
    for (int i = 0; i < (1 << 18); ++i) {
        const float f = f32(static_cast<uint32_t>(rng()));
        if (std::isfinite(f)) out.push_back(f);
    }
    for (size_t i = 0; i + 1 < t.values.size(); ++i) {
        const float mid = static_cast<float>((t.values[i] + t.values[i + 1]) / 2);
        for (float f : {mid, f32(bits(mid) - 1), f32(bits(mid) + 1)}) {
            out.push_back(f);
            out.push_back(-f);
        }
    }
    return out;
}

// ---------------------------------------------------------------------------------------------
// bfloat16

TEST(FloatFormats, Bf16DecodesEveryCodeAsTheTopHalf) {
    for (uint32_t c = 0; c < 0x10000u; ++c) {
        ASSERT_EQ(bits(bf16_to_f32(static_cast<uint16_t>(c))), c << 16) << "code " << c;
        if (!kBf16.is_nan(c)) {
            ASSERT_EQ(static_cast<double>(bf16_to_f32(static_cast<uint16_t>(c))), kBf16.value(c)) << "code " << c;
        }
    }
}

TEST(FloatFormats, Bf16RoundTripsEveryCode) {
    for (uint32_t c = 0; c < 0x10000u; ++c) {
        const uint16_t back = f32_to_bf16(bf16_to_f32(static_cast<uint16_t>(c)));
        const uint32_t want = kBf16.is_nan(c) ? (c & 0x8000u) | 0x7fc0u : c;  // NaN: quiet, sign kept
        ASSERT_EQ(back, want) << "code " << c;
    }
}

TEST(FloatFormats, Bf16EdgeCases) {
    EXPECT_EQ(f32_to_bf16(0.0f), 0x0000);
    EXPECT_EQ(f32_to_bf16(-0.0f), 0x8000);
    EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
    EXPECT_EQ(f32_to_bf16(INFINITY), 0x7f80);
    EXPECT_EQ(f32_to_bf16(-INFINITY), 0xff80);
    EXPECT_EQ(f32_to_bf16(f32(0x7f800001u)), 0x7fc0);  // signaling NaN: made quiet, payload dropped
    EXPECT_EQ(f32_to_bf16(f32(0xffa12345u)), 0xffc0);  // sign kept
    EXPECT_EQ(f32_to_bf16(f32(0x7fffffffu)), 0x7fc0);
    // Ties: to even in both directions.
    EXPECT_EQ(f32_to_bf16(f32(0x3f808000u)), 0x3f80);  // tie, even below -> down
    EXPECT_EQ(f32_to_bf16(f32(0x3f818000u)), 0x3f82);  // tie, odd below -> up
    EXPECT_EQ(f32_to_bf16(f32(0x3f807fffu)), 0x3f80);
    EXPECT_EQ(f32_to_bf16(f32(0x3f808001u)), 0x3f81);
    EXPECT_EQ(f32_to_bf16(f32(0xbf818000u)), 0xbf82);  // negative ties mirror positive ones
    // Max finite and the overflow threshold (the max's mantissa is odd, so its upper tie goes to Inf).
    EXPECT_EQ(f32_to_bf16(f32(0x7f7f0000u)), 0x7f7f);
    EXPECT_EQ(f32_to_bf16(f32(0x7f7f7fffu)), 0x7f7f);
    EXPECT_EQ(f32_to_bf16(f32(0x7f7f8000u)), 0x7f80);
    EXPECT_EQ(f32_to_bf16(f32(0xff7f8000u)), 0xff80);
    EXPECT_EQ(f32_to_bf16(f32(0x7f7fffffu)), 0x7f80);  // FLT_MAX
    // Subnormals: exact when representable, rounded otherwise.
    EXPECT_EQ(f32_to_bf16(f32(0x00010000u)), 0x0001);  // smallest bf16 subnormal
    EXPECT_EQ(f32_to_bf16(f32(0x00000001u)), 0x0000);  // smallest f32 subnormal rounds to 0
    EXPECT_EQ(f32_to_bf16(f32(0x00008000u)), 0x0000);  // tie to even 0
    EXPECT_EQ(f32_to_bf16(f32(0x00018000u)), 0x0002);  // tie, odd below -> up
    EXPECT_EQ(f32_to_bf16(f32(0x007fffffu)), 0x0080);  // largest f32 subnormal rounds to the smallest normal
    EXPECT_EQ(bits(bf16_to_f32(0x0001)), 0x00010000u);
}

TEST(FloatFormats, Bf16MatchesNearestValueSearch) {
    const NearestTable table = make_table(kBf16);
    for (float x : probe_floats(table)) {
        ASSERT_EQ(f32_to_bf16(x), nearest_code(kBf16, table, x)) << "x bits 0x" << std::hex << bits(x);
    }
}

// ---------------------------------------------------------------------------------------------
// binary16

TEST(FloatFormats, F16DecodesEveryCode) {
    for (uint32_t c = 0; c < 0x10000u; ++c) {
        const float f = f16_to_f32(static_cast<uint16_t>(c));
        if (kF16.is_nan(c)) {
            // NaN: exponent all ones, payload shifted up unchanged (numpy does the same).
            ASSERT_EQ(bits(f), ((c & 0x8000u) << 16) | 0x7f800000u | ((c & 0x3ffu) << 13)) << "code " << c;
        } else {
            ASSERT_EQ(static_cast<double>(f), kF16.value(c)) << "code " << c;
            ASSERT_EQ(std::signbit(f), (c & 0x8000u) != 0) << "code " << c;
        }
    }
}

TEST(FloatFormats, F16RoundTripsEveryCodeIncludingNanPayloads) {
    for (uint32_t c = 0; c < 0x10000u; ++c) {
        ASSERT_EQ(f32_to_f16(f16_to_f32(static_cast<uint16_t>(c))), c) << "code " << c;
    }
}

TEST(FloatFormats, F16EdgeCases) {
    EXPECT_EQ(f32_to_f16(0.0f), 0x0000);
    EXPECT_EQ(f32_to_f16(-0.0f), 0x8000);
    EXPECT_EQ(f32_to_f16(1.0f), 0x3c00);
    EXPECT_EQ(f32_to_f16(-2.0f), 0xc000);
    EXPECT_EQ(f32_to_f16(INFINITY), 0x7c00);
    EXPECT_EQ(f32_to_f16(-INFINITY), 0xfc00);
    EXPECT_EQ(f32_to_f16(f32(kF32Nan)), 0x7e00);           // quiet NaN stays quiet
    EXPECT_EQ(f32_to_f16(f32(0xffc00000u)), 0xfe00);       // sign kept
    EXPECT_EQ(f32_to_f16(f32(0x7fc02000u)), 0x7e01);       // top payload bits kept
    EXPECT_EQ(f32_to_f16(f32(0x7f800001u)), 0x7c01);       // low-only payload: forced to 1, never Inf
    // Max finite 65504 and the overflow threshold 65520 (odd mantissa: the tie goes to Inf).
    EXPECT_EQ(f32_to_f16(65504.0f), 0x7bff);
    EXPECT_EQ(f32_to_f16(f32(0x477fefffu)), 0x7bff);       // just below 65520
    EXPECT_EQ(f32_to_f16(65520.0f), 0x7c00);
    EXPECT_EQ(f32_to_f16(-65520.0f), 0xfc00);
    EXPECT_EQ(f32_to_f16(1e10f), 0x7c00);
    // Ties in the normal range.
    EXPECT_EQ(f32_to_f16(1.0f + 0x1p-11f), 0x3c00);        // tie, even below -> down
    EXPECT_EQ(f32_to_f16(1.0f + 3 * 0x1p-11f), 0x3c02);    // tie, odd below -> up
    EXPECT_EQ(f32_to_f16(f32(bits(1.0f + 0x1p-11f) + 1)), 0x3c01);
    EXPECT_EQ(f32_to_f16(-(1.0f + 3 * 0x1p-11f)), 0xbc02);
    // Subnormals (units of 2^-24) and the underflow threshold 2^-25.
    EXPECT_EQ(f32_to_f16(0x1p-24f), 0x0001);
    EXPECT_EQ(f32_to_f16(0x1p-25f), 0x0000);               // tie to even 0
    EXPECT_EQ(f32_to_f16(f32(bits(0x1p-25f) + 1)), 0x0001);
    EXPECT_EQ(f32_to_f16(-0x1p-26f), 0x8000);
    EXPECT_EQ(f32_to_f16(1.5f * 0x1p-24f), 0x0002);        // tie, odd below -> up
    EXPECT_EQ(f32_to_f16(2.5f * 0x1p-24f), 0x0002);        // tie, even below -> down
    EXPECT_EQ(f32_to_f16(1023.5f * 0x1p-24f), 0x0400);     // largest subnormal's tie -> smallest normal
    EXPECT_EQ(f32_to_f16(0x1p-14f), 0x0400);
    EXPECT_EQ(f32_to_f16(f32(0x00000001u)), 0x0000);       // f32 subnormals are far below
    EXPECT_EQ(bits(f16_to_f32(0x0001)), bits(0x1p-24f));
    EXPECT_EQ(bits(f16_to_f32(0x03ff)), bits(1023.0f * 0x1p-24f));
}

TEST(FloatFormats, F16MatchesNearestValueSearch) {
    const NearestTable table = make_table(kF16);
    for (float x : probe_floats(table)) {
        ASSERT_EQ(f32_to_f16(x), nearest_code(kF16, table, x)) << "x bits 0x" << std::hex << bits(x);
    }
}

// ---------------------------------------------------------------------------------------------
// float8_e4m3fn

TEST(FloatFormats, Fp8DecodesEveryCode) {
    for (uint32_t c = 0; c < 256; ++c) {
        const float f = fp8_e4m3_to_f32(static_cast<uint8_t>(c));
        if (kFp8.is_nan(c)) {
            ASSERT_EQ(bits(f), ((c & 0x80u) << 24) | kF32Nan) << "code " << c;
        } else {
            ASSERT_EQ(static_cast<double>(f), kFp8.value(c)) << "code " << c;
            ASSERT_EQ(std::signbit(f), (c & 0x80u) != 0) << "code " << c;
        }
    }
    EXPECT_EQ(fp8_e4m3_to_f32(0x38), 1.0f);
    EXPECT_EQ(fp8_e4m3_to_f32(0x7e), 448.0f);
    EXPECT_EQ(fp8_e4m3_to_f32(0xfe), -448.0f);
    EXPECT_EQ(fp8_e4m3_to_f32(0x01), 0x1p-9f);
    EXPECT_EQ(fp8_e4m3_to_f32(0x07), 7 * 0x1p-9f);
    EXPECT_EQ(fp8_e4m3_to_f32(0x08), 0x1p-6f);
    EXPECT_EQ(bits(fp8_e4m3_to_f32(0x80)), 0x80000000u);
}

TEST(FloatFormats, Fp8RoundTripsEveryCodeInBothModes) {
    for (uint32_t c = 0; c < 256; ++c) {
        const float f = fp8_e4m3_to_f32(static_cast<uint8_t>(c));
        const uint32_t want = kFp8.is_nan(c) ? (c & 0x80u) | 0x7fu : c;
        ASSERT_EQ(f32_to_fp8_e4m3(f, Fp8Saturation::kSaturate), want) << "code " << c;
        ASSERT_EQ(f32_to_fp8_e4m3(f, Fp8Saturation::kNonSaturating), want) << "code " << c;
    }
}

TEST(FloatFormats, Fp8EdgeCases) {
    constexpr auto kSat = Fp8Saturation::kSaturate;
    constexpr auto kNon = Fp8Saturation::kNonSaturating;
    for (auto mode : {kSat, kNon}) {
        EXPECT_EQ(f32_to_fp8_e4m3(0.0f, mode), 0x00);
        EXPECT_EQ(f32_to_fp8_e4m3(-0.0f, mode), 0x80);
        EXPECT_EQ(f32_to_fp8_e4m3(f32(kF32Nan), mode), 0x7f);
        EXPECT_EQ(f32_to_fp8_e4m3(f32(0xff800001u), mode), 0xff);  // any NaN: sign kept, payload dropped
        EXPECT_EQ(f32_to_fp8_e4m3(448.0f, mode), 0x7e);
        EXPECT_EQ(f32_to_fp8_e4m3(464.0f, mode), 0x7e);              // tie with the missing 480: to even 448
        EXPECT_EQ(f32_to_fp8_e4m3(-464.0f, mode), 0xfe);
        EXPECT_EQ(f32_to_fp8_e4m3(f32(bits(464.0f) - 1), mode), 0x7e);
        EXPECT_EQ(f32_to_fp8_e4m3(1.0f + 0x1p-4f, mode), 0x38);      // tie, even below -> down
        EXPECT_EQ(f32_to_fp8_e4m3(1.0f + 3 * 0x1p-4f, mode), 0x3a);  // tie, odd below -> up
        EXPECT_EQ(f32_to_fp8_e4m3(f32(bits(1.0f + 0x1p-4f) + 1), mode), 0x39);
        EXPECT_EQ(f32_to_fp8_e4m3(0x1p-9f, mode), 0x01);             // smallest subnormal
        EXPECT_EQ(f32_to_fp8_e4m3(0x1p-10f, mode), 0x00);            // its half: tie to even 0
        EXPECT_EQ(f32_to_fp8_e4m3(-0x1p-10f, mode), 0x80);
        EXPECT_EQ(f32_to_fp8_e4m3(f32(bits(0x1p-10f) + 1), mode), 0x01);
        EXPECT_EQ(f32_to_fp8_e4m3(3 * 0x1p-10f, mode), 0x02);        // tie, odd below -> up
        EXPECT_EQ(f32_to_fp8_e4m3(5 * 0x1p-10f, mode), 0x02);        // tie, even below -> down
        EXPECT_EQ(f32_to_fp8_e4m3(15 * 0x1p-10f, mode), 0x08);       // largest subnormal's tie -> smallest normal
        EXPECT_EQ(f32_to_fp8_e4m3(1e-30f, mode), 0x00);
        EXPECT_EQ(f32_to_fp8_e4m3(f32(0x80000001u), mode), 0x80);    // f32 subnormal
    }
    // Only overflow differs: NaN without saturation (ml_dtypes), +-448 with it.
    const float just_over = f32(bits(464.0f) + 1);
    EXPECT_EQ(f32_to_fp8_e4m3(just_over, kNon), 0x7f);
    EXPECT_EQ(f32_to_fp8_e4m3(just_over, kSat), 0x7e);
    EXPECT_EQ(f32_to_fp8_e4m3(-480.0f, kNon), 0xff);
    EXPECT_EQ(f32_to_fp8_e4m3(-480.0f, kSat), 0xfe);
    EXPECT_EQ(f32_to_fp8_e4m3(3e38f, kNon), 0x7f);
    EXPECT_EQ(f32_to_fp8_e4m3(3e38f, kSat), 0x7e);
    EXPECT_EQ(f32_to_fp8_e4m3(INFINITY, kNon), 0x7f);
    EXPECT_EQ(f32_to_fp8_e4m3(INFINITY, kSat), 0x7e);
    EXPECT_EQ(f32_to_fp8_e4m3(-INFINITY, kNon), 0xff);
    EXPECT_EQ(f32_to_fp8_e4m3(-INFINITY, kSat), 0xfe);
}

TEST(FloatFormats, Fp8MatchesNearestValueSearch) {
    const NearestTable table = make_table(kFp8);
    for (float x : probe_floats(table)) {
        const uint32_t want = nearest_code(kFp8, table, x);  // overflow gives the NaN code S.1111.111
        const bool overflow = (want & 0x7fu) == 0x7fu;
        ASSERT_EQ(f32_to_fp8_e4m3(x, Fp8Saturation::kNonSaturating), want) << "x bits 0x" << std::hex << bits(x);
        ASSERT_EQ(f32_to_fp8_e4m3(x, Fp8Saturation::kSaturate), overflow ? (want & 0x80u) | 0x7eu : want)
            << "x bits 0x" << std::hex << bits(x);
    }
}

TEST(FloatFormats, BitCastsRoundTrip) {
    for (uint32_t u : {0u, 0x80000000u, 0x3f800000u, 0x7f800001u, 0xffffffffu, 0x00000001u}) {
        EXPECT_EQ(f32_as_u32(u32_as_f32(u)), u);
    }
    EXPECT_EQ(u32_as_f32(0x3f800000u), 1.0f);
}

}  // namespace
}  // namespace memra
