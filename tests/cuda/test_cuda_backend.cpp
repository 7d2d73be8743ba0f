// CudaBackend's refusals: what it cannot compute (exact numerics), a GPU that does not exist, and memory it cannot
// get (the message names what was needed and what is free), each a clear error instead of a crash; its copy
// bandwidth.
#include <cstdint>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "backend/cuda/cuda_backend.h"
#include "cuda/cuda_test_util.h"

namespace memra {
namespace {

bool contains(const std::string &s, const std::string &part) { return s.find(part) != std::string::npos; }

TEST(CudaBackend, RefusesExactNumericsAndAMissingGpu) {
    auto exact = cuda::CudaBackend::create(0, Numerics::kExact);
    ASSERT_FALSE(exact.has_value());
    EXPECT_EQ(exact.error().message, "cuda backend: computes device numerics only (asked for exact)");
    auto missing = cuda::CudaBackend::create(99, Numerics::kDevice);
    ASSERT_FALSE(missing.has_value());
    EXPECT_TRUE(contains(missing.error().message, "cuda backend: ")) << missing.error().message;
    EXPECT_TRUE(contains(missing.error().message, "GPU 99 does not exist") ||
                contains(missing.error().message, "no CUDA device"))
        << missing.error().message;
}

TEST(CudaBackend, AnAllocationLargerThanTheGpuNamesNeededAndFreeMemory) {
    MEMRA_SKIP_WITHOUT_GPU();
    auto be = cuda::CudaBackend::create(0, Numerics::kDevice);
    ASSERT_TRUE(be.has_value()) << be.error().message;
    const int64_t held = (*be)->bytes_allocated();
    auto huge = (*be)->alloc(DType::kF32, {int64_t{1} << 40});  // 4 TiB
    ASSERT_FALSE(huge.has_value());
    const std::string &m = huge.error().message;
    EXPECT_TRUE(contains(m, "cuda: out of device memory for a [1099511627776] F32 buffer: needs 4194304.0 MiB")) << m;
    EXPECT_TRUE(contains(m, "MiB free of")) << m;
    EXPECT_EQ((*be)->bytes_allocated(), held);
    // The backend still works after the refusal.
    auto small = (*be)->alloc(DType::kF32, {16});
    ASSERT_TRUE(small.has_value()) << small.error().message;
    std::vector<float> out(16, 1.0f);
    (*be)->copy_to_host(*small, out.data());
    for (const float v : out) EXPECT_EQ(v, 0.0f);  // zero-filled
}

// The copy bandwidth bench's roofline divides by: within an H200's reach (4.8 TB/s of HBM3e, reads and writes
// counted: a copy reaches about 4.3), far above a host copy; refusals leave the backend working.
TEST(CudaBackend, CopyBandwidthIsTheDevicesAndRefusalsAreClear) {
    MEMRA_SKIP_WITHOUT_GPU();
    auto be = cuda::CudaBackend::create(0, Numerics::kDevice);
    ASSERT_TRUE(be.has_value()) << be.error().message;
    auto bw = (*be)->copy_bandwidth(int64_t{256} << 20);
    ASSERT_TRUE(bw.has_value()) << bw.error().message;
    EXPECT_GT(*bw, 1e12);
    EXPECT_LT(*bw, 10e12);
    auto none = (*be)->copy_bandwidth(0);
    ASSERT_FALSE(none.has_value());
    EXPECT_EQ(none.error().message, "cuda copy bandwidth: 0 bytes, expected >= 1");
    auto huge = (*be)->copy_bandwidth(int64_t{1} << 42);  // 4 TiB each
    ASSERT_FALSE(huge.has_value());
    EXPECT_TRUE(contains(huge.error().message, "cuda copy bandwidth of 2 x 4398046511104 bytes: "))
        << huge.error().message;
    auto small = (*be)->alloc(DType::kF32, {16});
    ASSERT_TRUE(small.has_value()) << small.error().message;
    std::vector<float> out(16, 1.0f);
    (*be)->copy_to_host(*small, out.data());  // no error left behind by the refused allocation
    for (const float v : out) EXPECT_EQ(v, 0.0f);
}

}  // namespace
}  // namespace memra
