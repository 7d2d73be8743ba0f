// core/kv_format.h: format names, row byte sizes (SERVING.md 1.5's figures), refusals, and row encoding
// compared as raw bytes with core's independent conversions (f32 bits, f32_to_bf16, quantize_row_*),
// decoding with core's dequantizers.
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/float_formats.h"
#include "core/quant_blocks.h"
#include "core/kv_format.h"

namespace memra {
namespace {

std::vector<float> random_values(int64_t n, uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.5f);
    std::vector<float> x(n);
    for (auto &v : x) v = normal(rng);
    return x;
}

std::vector<std::byte> encode(KvFormat format, const std::vector<float> &x) {
    auto bytes = kv_row_bytes(format, 1, static_cast<int>(x.size()));
    EXPECT_TRUE(bytes.has_value());
    std::vector<std::byte> out(bytes.value_or(0));
    kv_encode(format, x.data(), static_cast<int64_t>(x.size()), out.data());
    return out;
}

template <class T>
std::vector<std::byte> as_bytes(const std::vector<T> &v) {
    std::vector<std::byte> out(v.size() * sizeof(T));
    std::memcpy(out.data(), v.data(), out.size());
    return out;
}

TEST(KvFormat, ParsesEveryNameAndRoundTrips) {
    const KvFormat all[] = {KvFormat::kF32, KvFormat::kBf16, KvFormat::kQ8_0, KvFormat::kQ5_1};
    const char *names[] = {"f32", "bf16", "q8_0", "q5_1"};
    for (int i = 0; i < 4; ++i) {
        auto parsed = parse_kv_format(names[i]);
        ASSERT_TRUE(parsed.has_value()) << names[i];
        EXPECT_EQ(*parsed, all[i]);
        EXPECT_STREQ(kv_format_name(all[i]), names[i]);
    }
    EXPECT_FALSE(kv_format_is_block(KvFormat::kF32));
    EXPECT_FALSE(kv_format_is_block(KvFormat::kBf16));
    EXPECT_TRUE(kv_format_is_block(KvFormat::kQ8_0));
    EXPECT_TRUE(kv_format_is_block(KvFormat::kQ5_1));
}

TEST(KvFormat, RefusesUnknownNamesListingTheValidOnes) {
    for (const char *bad : {"q4_0", "F32", "", "fp8", "bf16 "}) {
        auto parsed = parse_kv_format(bad);
        ASSERT_FALSE(parsed.has_value()) << bad;
        EXPECT_NE(parsed.error().message.find(std::string("'") + bad + "'"), std::string::npos)
            << parsed.error().message;
        EXPECT_NE(parsed.error().message.find("expected one of f32, bf16, q8_0, q5_1"), std::string::npos);
    }
}

TEST(KvFormat, RowBytesMatchTheServingFigures) {
    // One token, one layer, 8 KV heads x 128 (SERVING.md 1.5).
    EXPECT_EQ(kv_row_bytes(KvFormat::kQ8_0, 8, 128).value(), 1088);
    EXPECT_EQ(kv_row_bytes(KvFormat::kQ5_1, 8, 128).value(), 768);
    EXPECT_EQ(kv_row_bytes(KvFormat::kBf16, 8, 128).value(), 2048);
    EXPECT_EQ(kv_row_bytes(KvFormat::kF32, 8, 128).value(), 4096);
    // Per head-row: 136 B q8_0, 96 B q5_1.
    EXPECT_EQ(kv_row_bytes(KvFormat::kQ8_0, 1, 128).value(), 136);
    EXPECT_EQ(kv_row_bytes(KvFormat::kQ5_1, 1, 128).value(), 96);
    // Unquantized formats take any head_dim.
    EXPECT_EQ(kv_row_bytes(KvFormat::kF32, 3, 7).value(), 84);
    EXPECT_EQ(kv_row_bytes(KvFormat::kBf16, 3, 7).value(), 42);
}

TEST(KvFormat, RowBytesRefusals) {
    auto q = kv_row_bytes(KvFormat::kQ8_0, 2, 48);
    ASSERT_FALSE(q.has_value());
    EXPECT_NE(q.error().message.find("q8_0"), std::string::npos) << q.error().message;
    EXPECT_NE(q.error().message.find("head_dim must be a multiple of 32"), std::string::npos);
    EXPECT_NE(q.error().message.find("found 48"), std::string::npos);
    auto q5 = kv_row_bytes(KvFormat::kQ5_1, 1, 16);
    ASSERT_FALSE(q5.has_value());
    EXPECT_NE(q5.error().message.find("q5_1"), std::string::npos);
    auto zero = kv_row_bytes(KvFormat::kF32, 0, 64);
    ASSERT_FALSE(zero.has_value());
    EXPECT_NE(zero.error().message.find("n_kv_heads 0"), std::string::npos) << zero.error().message;
    auto neg = kv_row_bytes(KvFormat::kBf16, 4, -32);
    ASSERT_FALSE(neg.has_value());
    EXPECT_NE(neg.error().message.find("head_dim -32"), std::string::npos);
    auto huge = kv_row_bytes(KvFormat::kF32, 2147483647, 2147483647);
    ASSERT_FALSE(huge.has_value());
    EXPECT_NE(huge.error().message.find("overflow"), std::string::npos) << huge.error().message;
}

TEST(KvFormat, F32IsTheInputBits) {
    auto x = random_values(96, 1);
    x[3] = -0.0f;
    x[5] = u32_as_f32(0x7fc01234u);  // a NaN payload survives
    x[7] = u32_as_f32(0x00000001u);  // a subnormal survives
    EXPECT_EQ(encode(KvFormat::kF32, x), as_bytes(x));
    std::vector<float> y(x.size());
    const auto bytes = encode(KvFormat::kF32, x);
    kv_decode(KvFormat::kF32, bytes.data(), static_cast<int64_t>(x.size()), y.data());
    EXPECT_EQ(as_bytes(y), as_bytes(x));
}

TEST(KvFormat, Bf16IsF32ToBf16) {
    auto x = random_values(70, 2);  // not a multiple of 32: bf16 has no blocks
    x[0] = u32_as_f32(0x3f808000u);  // a tie, rounds to even
    x[1] = u32_as_f32(0x3f818000u);  // a tie, rounds up
    std::vector<uint16_t> want(x.size());
    for (size_t i = 0; i < x.size(); ++i) want[i] = f32_to_bf16(x[i]);
    const auto bytes = encode(KvFormat::kBf16, x);
    EXPECT_EQ(bytes, as_bytes(want));
    std::vector<float> y(x.size());
    kv_decode(KvFormat::kBf16, bytes.data(), static_cast<int64_t>(x.size()), y.data());
    for (size_t i = 0; i < x.size(); ++i) EXPECT_EQ(f32_as_u32(y[i]), f32_as_u32(bf16_to_f32(want[i]))) << i;
}

TEST(KvFormat, Q8_0IsQuantizeRowQ8_0) {
    auto x = random_values(4 * 32, 3);
    for (int j = 32; j < 64; ++j) x[j] = 0.0f;  // an all-zero block
    std::vector<BlockQ8_0> want(4);
    quantize_row_q8_0(x.data(), want.data(), 128);
    const auto bytes = encode(KvFormat::kQ8_0, x);
    EXPECT_EQ(bytes, as_bytes(want));
    std::vector<float> y(x.size()), y_ref(x.size());
    kv_decode(KvFormat::kQ8_0, bytes.data(), 128, y.data());
    dequantize_row_q8_0(want.data(), y_ref.data(), 128);
    EXPECT_EQ(as_bytes(y), as_bytes(y_ref));
}

TEST(KvFormat, Q5_1IsQuantizeRowQ5_1) {
    auto x = random_values(4 * 32, 4);
    for (int j = 64; j < 96; ++j) x[j] = 2.5f;  // a constant block (d = 0)
    std::vector<BlockQ5_1> want(4);
    quantize_row_q5_1(x.data(), want.data(), 128);
    const auto bytes = encode(KvFormat::kQ5_1, x);
    EXPECT_EQ(bytes, as_bytes(want));
    std::vector<float> y(x.size()), y_ref(x.size());
    kv_decode(KvFormat::kQ5_1, bytes.data(), 128, y.data());
    dequantize_row_q5_1(want.data(), y_ref.data(), 128);
    EXPECT_EQ(as_bytes(y), as_bytes(y_ref));
}

}  // namespace
}  // namespace memra
