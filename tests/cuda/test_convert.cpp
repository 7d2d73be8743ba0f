// backend/cuda/convert: every conversion kernel against the host function it shares, over all codes
// and ~1M random float32 bit patterns; the result must be bit-identical. Products whose result is NaN
// are compared as NaN only: x86 propagates an operand's payload, NVIDIA GPUs return 0x7fffffff.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "backend/cuda/convert.h"
#include "cuda/cuda_test_util.h"
#include "core/float_formats.h"
#include "core/fp8_block.h"
#include "core/quant_blocks.h"

namespace memra {
namespace {

uint32_t bits(float f) { return f32_as_u32(f); }

// Every 16-bit code.
std::vector<uint16_t> all_u16() {
    std::vector<uint16_t> v(1 << 16);
    for (uint32_t i = 0; i < v.size(); ++i) v[i] = static_cast<uint16_t>(i);
    return v;
}

// ~1M random bit patterns plus every bf16, f16 and fp8 value widened to f32 (ties and thresholds
// are covered by the host tests; here they only need to go through the kernel).
std::vector<float> probe_floats() {
    std::mt19937 rng(77);
    std::vector<float> v;
    v.reserve((1 << 20) + 2 * (1 << 16) + 256);
    for (int i = 0; i < (1 << 20); ++i) v.push_back(u32_as_f32(static_cast<uint32_t>(rng())));
    for (uint32_t c = 0; c < (1u << 16); ++c) {
        v.push_back(bf16_to_f32(static_cast<uint16_t>(c)));
        v.push_back(f16_to_f32(static_cast<uint16_t>(c)));
    }
    for (uint32_t c = 0; c < 256; ++c) v.push_back(fp8_e4m3_to_f32(static_cast<uint8_t>(c)));
    return v;
}

void expect_same_bits(const std::vector<float> &got, const std::vector<float> &want, bool nan_as_nan) {
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) {
        if (nan_as_nan && std::isnan(want[i])) {
            ASSERT_TRUE(std::isnan(got[i])) << "index " << i;
        } else {
            ASSERT_EQ(bits(got[i]), bits(want[i])) << "index " << i;
        }
    }
}

TEST(CudaConvert, Bf16ToF32AllCodes) {
    MEMRA_SKIP_WITHOUT_GPU();
    const std::vector<uint16_t> in = all_u16();
    DeviceBuffer d_in(in.size() * 2), d_out(in.size() * 4);
    d_in.upload(in.data());
    ASSERT_EQ(cuda_bf16_to_f32(d_in.as<uint16_t>(), d_out.as<float>(), static_cast<int64_t>(in.size()), nullptr),
              cudaSuccess);
    std::vector<float> got(in.size()), want(in.size());
    d_out.download(got.data());
    for (size_t i = 0; i < in.size(); ++i) want[i] = bf16_to_f32(in[i]);
    expect_same_bits(got, want, false);
}

TEST(CudaConvert, F16ToF32AllCodes) {
    MEMRA_SKIP_WITHOUT_GPU();
    const std::vector<uint16_t> in = all_u16();
    DeviceBuffer d_in(in.size() * 2), d_out(in.size() * 4);
    d_in.upload(in.data());
    ASSERT_EQ(cuda_f16_to_f32(d_in.as<uint16_t>(), d_out.as<float>(), static_cast<int64_t>(in.size()), nullptr),
              cudaSuccess);
    std::vector<float> got(in.size()), want(in.size());
    d_out.download(got.data());
    for (size_t i = 0; i < in.size(); ++i) want[i] = f16_to_f32(in[i]);
    expect_same_bits(got, want, false);
}

TEST(CudaConvert, Fp8ToF32AllCodes) {
    MEMRA_SKIP_WITHOUT_GPU();
    std::vector<uint8_t> in(256);
    for (uint32_t c = 0; c < 256; ++c) in[c] = static_cast<uint8_t>(c);
    DeviceBuffer d_in(in.size()), d_out(in.size() * 4);
    d_in.upload(in.data());
    ASSERT_EQ(cuda_fp8_e4m3_to_f32(d_in.as<uint8_t>(), d_out.as<float>(), 256, nullptr), cudaSuccess);
    std::vector<float> got(256), want(256);
    d_out.download(got.data());
    for (uint32_t c = 0; c < 256; ++c) want[c] = fp8_e4m3_to_f32(static_cast<uint8_t>(c));
    expect_same_bits(got, want, false);
}

TEST(CudaConvert, F32ToBf16AndF16) {
    MEMRA_SKIP_WITHOUT_GPU();
    const std::vector<float> in = probe_floats();
    const auto n = static_cast<int64_t>(in.size());
    DeviceBuffer d_in(in.size() * 4), d_out(in.size() * 2);
    d_in.upload(in.data());
    std::vector<uint16_t> got(in.size());

    ASSERT_EQ(cuda_f32_to_bf16(d_in.as<float>(), d_out.as<uint16_t>(), n, nullptr), cudaSuccess);
    d_out.download(got.data());
    for (size_t i = 0; i < in.size(); ++i) ASSERT_EQ(got[i], f32_to_bf16(in[i])) << "bf16, x bits " << bits(in[i]);

    ASSERT_EQ(cuda_f32_to_f16(d_in.as<float>(), d_out.as<uint16_t>(), n, nullptr), cudaSuccess);
    d_out.download(got.data());
    for (size_t i = 0; i < in.size(); ++i) ASSERT_EQ(got[i], f32_to_f16(in[i])) << "f16, x bits " << bits(in[i]);
}

TEST(CudaConvert, F32ToFp8BothModes) {
    MEMRA_SKIP_WITHOUT_GPU();
    const std::vector<float> in = probe_floats();
    const auto n = static_cast<int64_t>(in.size());
    DeviceBuffer d_in(in.size() * 4), d_out(in.size());
    d_in.upload(in.data());
    std::vector<uint8_t> got(in.size());
    for (Fp8Saturation mode : {Fp8Saturation::kSaturate, Fp8Saturation::kNonSaturating}) {
        ASSERT_EQ(cuda_f32_to_fp8_e4m3(d_in.as<float>(), d_out.as<uint8_t>(), n, mode, nullptr), cudaSuccess);
        d_out.download(got.data());
        for (size_t i = 0; i < in.size(); ++i) {
            ASSERT_EQ(got[i], f32_to_fp8_e4m3(in[i], mode)) << "x bits " << bits(in[i]);
        }
    }
}

TEST(CudaConvert, Fp8BlockDequantWithPartialBlocks) {
    MEMRA_SKIP_WITHOUT_GPU();
    for (auto [rows, cols] : {std::pair<int64_t, int64_t>{200, 300}, {1, 1}, {129, 4097}, {256, 128}}) {
        std::mt19937 rng(static_cast<uint32_t>(rows * 7 + cols));
        std::vector<uint8_t> q(rows * cols);
        for (auto &v : q) v = static_cast<uint8_t>(rng());
        std::vector<float> scale(fp8_scale_blocks(rows) * fp8_scale_blocks(cols));
        std::uniform_real_distribution<float> expo(-30.0f, 30.0f);
        for (auto &s : scale) s = std::exp2(expo(rng)) * 1.37f;
        if (scale.size() > 1) scale[1] = u32_as_f32(1u);  // subnormal scale: products must not flush
        DeviceBuffer d_q(q.size()), d_s(scale.size() * 4), d_out(q.size() * 4);
        d_q.upload(q.data());
        d_s.upload(scale.data());
        ASSERT_EQ(cuda_dequantize_fp8_block(d_q.as<uint8_t>(), rows, cols, d_s.as<float>(), d_out.as<float>(),
                                            nullptr),
                  cudaSuccess);
        std::vector<float> got(q.size()), want(q.size());
        d_out.download(got.data());
        dequantize_fp8_block(q.data(), rows, cols, scale.data(), want.data());
        expect_same_bits(got, want, true);
    }
}

TEST(CudaConvert, Q8_0AndQ5_1DequantOverRandomBlocks) {
    MEMRA_SKIP_WITHOUT_GPU();
    constexpr int64_t kBlocks = 1 << 15;  // random bytes: every code, and every kind of fp16 scale
    constexpr int64_t kN = kBlocks * kQuantBlock;
    std::mt19937 rng(5);
    std::vector<uint8_t> raw(kBlocks * sizeof(BlockQ5_1) > kBlocks * sizeof(BlockQ8_0) ? kBlocks * sizeof(BlockQ5_1)
                                                                                      : kBlocks * sizeof(BlockQ8_0));
    for (auto &v : raw) v = static_cast<uint8_t>(rng());
    std::vector<float> got(kN), want(kN);

    std::vector<BlockQ8_0> q8(kBlocks);
    std::memcpy(q8.data(), raw.data(), q8.size() * sizeof(BlockQ8_0));
    DeviceBuffer d_q8(q8.size() * sizeof(BlockQ8_0)), d_out(kN * 4);
    d_q8.upload(q8.data());
    ASSERT_EQ(cuda_dequantize_q8_0(d_q8.as<BlockQ8_0>(), d_out.as<float>(), kN, nullptr), cudaSuccess);
    d_out.download(got.data());
    dequantize_row_q8_0(q8.data(), want.data(), kN);
    expect_same_bits(got, want, true);

    std::vector<BlockQ5_1> q5(kBlocks);
    std::memcpy(q5.data(), raw.data(), q5.size() * sizeof(BlockQ5_1));
    DeviceBuffer d_q5(q5.size() * sizeof(BlockQ5_1));
    d_q5.upload(q5.data());
    ASSERT_EQ(cuda_dequantize_q5_1(d_q5.as<BlockQ5_1>(), d_out.as<float>(), kN, nullptr), cudaSuccess);
    d_out.download(got.data());
    dequantize_row_q5_1(q5.data(), want.data(), kN);
    expect_same_bits(got, want, true);
}

TEST(CudaConvert, LaunchersRejectBadArguments) {
    MEMRA_SKIP_WITHOUT_GPU();
    DeviceBuffer d_a(64 * 4), d_b(64 * 4);
    EXPECT_EQ(cuda_bf16_to_f32(d_a.as<uint16_t>(), d_b.as<float>(), -1, nullptr), cudaErrorInvalidValue);
    EXPECT_EQ(cuda_f32_to_f16(nullptr, d_b.as<uint16_t>(), 4, nullptr), cudaErrorInvalidValue);
    EXPECT_EQ(cuda_f32_to_fp8_e4m3(d_a.as<float>(), nullptr, 4, Fp8Saturation::kSaturate, nullptr),
              cudaErrorInvalidValue);
    EXPECT_EQ(cuda_dequantize_q8_0(d_a.as<BlockQ8_0>(), d_b.as<float>(), 33, nullptr), cudaErrorInvalidValue);
    EXPECT_EQ(cuda_dequantize_q5_1(d_a.as<BlockQ5_1>(), d_b.as<float>(), -32, nullptr), cudaErrorInvalidValue);
    EXPECT_EQ(cuda_dequantize_fp8_block(d_a.as<uint8_t>(), -1, 4, d_b.as<float>(), d_b.as<float>(), nullptr),
              cudaErrorInvalidValue);
    EXPECT_EQ(cuda_dequantize_fp8_block(d_a.as<uint8_t>(), 2, 4, nullptr, d_b.as<float>(), nullptr),
              cudaErrorInvalidValue);
    // Zero elements: nothing to launch, even with null pointers.
    EXPECT_EQ(cuda_fp8_e4m3_to_f32(nullptr, nullptr, 0, nullptr), cudaSuccess);
    EXPECT_EQ(cuda_dequantize_fp8_block(nullptr, 0, 7, nullptr, nullptr, nullptr), cudaSuccess);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

}  // namespace
}  // namespace memra
