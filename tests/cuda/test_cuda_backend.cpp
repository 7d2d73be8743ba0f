// CudaBackend's refusals: what it cannot compute (exact numerics), a GPU that does not exist, and memory it cannot
// get (the message names what was needed and what is free), each a clear error instead of a crash; its copy
// bandwidth; the side branch's fork and join, eagerly and in recorded steps.
#include <cstdint>
#include <cstdlib>
#include <functional>
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

// A side branch long enough (kAdds launches over 64 MiB) that an op after the join reading its result too early
// would see a partial sum: side: y = x added kAdds times; main, alongside it: z = x + x; after the join: out = y +
// z. Every value is exact (x = 1), so out must be kAdds + 2 everywhere. Checked eagerly, then in a recorded step
// (run eagerly, captured, replayed), with the side stream on and with MEMRA_CUDA_SIDE=0.
void check_side_branch(bool side_on) {
    constexpr int kAdds = 64;
    constexpr int64_t kElems = int64_t{16} << 20;
    if (side_on) {
        unsetenv("MEMRA_CUDA_SIDE");
    } else {
        setenv("MEMRA_CUDA_SIDE", "0", 1);
    }
    auto created = cuda::CudaBackend::create(0, Numerics::kDevice);
    unsetenv("MEMRA_CUDA_SIDE");
    ASSERT_TRUE(created.has_value()) << created.error().message;
    cuda::CudaBackend &be = **created;
    TensorView bufs[4];
    for (TensorView &b : bufs) {
        auto v = be.alloc(DType::kF32, {kElems / 1024, 1024});
        ASSERT_TRUE(v.has_value()) << v.error().message;
        b = *v;
    }
    const TensorView x = bufs[0], y = bufs[1], z = bufs[2], out = bufs[3];
    const std::vector<float> ones(static_cast<size_t>(kElems), 1.0f);
    be.copy_from_host(ones.data(), x);
    const auto issue = [&] {
        be.side_fork();
        EXPECT_EQ(be.op_stream(), be.stream());
        be.side_begin();
        EXPECT_EQ(be.op_stream() != be.stream(), side_on);  // the branch's ops go to the side stream
        be.residual_add(x, x, y);                           // y = 2, then + 1 per add
        for (int i = 1; i < kAdds; ++i) be.residual_add(y, x, y);
        be.side_end();
        EXPECT_EQ(be.op_stream(), be.stream());
        be.residual_add(x, x, z);
        be.side_join();
        be.residual_add(y, z, out);
    };
    std::vector<float> host(static_cast<size_t>(kElems));
    const auto expect_all = [&](TensorView v, float want, const char *what) {
        std::fill(host.begin(), host.end(), -1.0f);
        be.copy_to_host(v, host.data());
        int64_t wrong = 0;
        for (const float h : host) wrong += h != want ? 1 : 0;
        EXPECT_EQ(wrong, 0) << what << ": " << wrong << " values differ from " << want << " (first " << host[0] << ")";
    };
    issue();
    expect_all(out, kAdds + 3.0f, "eager");
    const int64_t key[] = {7};
    for (int run = 0; run < 3; ++run) {  // as it is, captured, replayed
        be.copy_from_host(std::vector<float>(static_cast<size_t>(kElems), 0.0f).data(), out);
        auto ok = be.run_recorded(key, [&]() -> Result<void> {
            issue();
            return {};
        });
        ASSERT_TRUE(ok.has_value()) << ok.error().message;
        expect_all(out, kAdds + 3.0f, run == 0 ? "recorded, first" : run == 1 ? "captured" : "replayed");
    }
    EXPECT_EQ(be.graph_captures(), 1);
    EXPECT_EQ(be.graph_replays(), 1);
    // A host copy joins an open branch: the side's result is whole without a side_join.
    be.side_fork();
    be.side_begin();
    for (int i = 0; i < kAdds; ++i) be.residual_add(y, x, y);
    expect_all(y, 2.0f * kAdds + 1.0f, "host copy inside the branch");
    be.side_end();
    be.side_join();
}

TEST(CudaBackend, SideBranchJoinsBeforeTheOpsAfterIt) {
    MEMRA_SKIP_WITHOUT_GPU();
    check_side_branch(true);
}

TEST(CudaBackend, SideBranchOffRunsTheSameOpsInOrder) {
    MEMRA_SKIP_WITHOUT_GPU();
    check_side_branch(false);
}

}  // namespace
}  // namespace memra
