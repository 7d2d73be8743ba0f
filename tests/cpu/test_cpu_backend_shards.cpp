// CpuBackend with a tensor-parallel rank's weights: window uploads (row slices, K windows of whole
// canonical blocks, expert ranges) and their refusals, row-parallel products finished by canonical_combine,
// grouped products over an owner's experts, and join_col_shards, all against the whole weights' bits.
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "backend/cpu/cpu_backend.h"
#include "core/float_formats.h"
#include "ops_test_util.h"

namespace memra::cpu {
namespace {

using test::bit_mismatches;
using test::random_floats;

std::vector<uint16_t> bf16_weights(size_t n, uint32_t seed) {
    const std::vector<float> f = random_floats(n, seed);
    std::vector<uint16_t> h(n);
    for (size_t i = 0; i < n; ++i) h[i] = f32_to_bf16(f[i]);
    return h;
}

TensorView upload(CpuBackend &be, const std::vector<float> &host, int64_t rows, int64_t cols) {
    auto v = be.alloc(DType::kF32, {rows, cols});
    EXPECT_TRUE(v.has_value());
    be.copy_from_host(host.data(), *v);
    return *v;
}

std::vector<float> download(CpuBackend &be, TensorView v) {
    std::vector<float> out(static_cast<size_t>(v.numel()));
    be.copy_to_host(v, out.data());
    return out;
}

TEST(CpuBackendShards, WindowUploadsAreValidated) {
    CpuBackend be(1);
    const std::vector<uint16_t> w = bf16_weights(8 * 64, 1);
    HostMatrix m{DType::kBF16, w.data(), 8, 64};
    auto expect_error = [](const auto &r, const std::string &fragment) {
        ASSERT_FALSE(r.has_value()) << fragment;
        EXPECT_NE(r.error().message.find(fragment), std::string::npos) << r.error().message;
    };
    expect_error(be.upload_matrix_window(m, MatrixWindow{0, 0, 0, 64}),
                 "cpu upload: window rows [0, 0) must be non-empty inside [0, 8)");
    expect_error(be.upload_matrix_window(m, MatrixWindow{0, 8, 0, 72}),
                 "cpu upload: window columns [0, 72) must be non-empty inside [0, 64)");
    expect_error(be.upload_matrix_window(m, MatrixWindow{0, 8, 8, 24}),
                 "cpu upload: K window [8, 24) is not an aligned subtree of the 8 canonical blocks of 8 columns "
                 "(K = 64)");
    expect_error(be.upload_matrix_window(m, MatrixWindow{0, 8, 0, 24}), "K window [0, 24) is not an aligned subtree");
    expect_error(be.upload_matrix_window(m, MatrixWindow{0, 8, 4, 12}), "K window [4, 12) is not an aligned subtree");
    const std::vector<uint16_t> w60 = bf16_weights(8 * 60, 2);
    expect_error(be.upload_matrix_window(HostMatrix{DType::kBF16, w60.data(), 8, 60}, MatrixWindow{0, 8, 0, 30}),
                 "cpu upload: K window [0, 30) of a matrix with K = 60, which has no 8 canonical blocks");
    EXPECT_TRUE(be.upload_matrix_window(m, MatrixWindow{3, 5, 32, 64}).has_value());  // rows and K blocks [4, 8)
    EXPECT_TRUE(be.upload_matrix_window(HostMatrix{DType::kBF16, w60.data(), 8, 60}, MatrixWindow{2, 7, 0, 60}));

    const std::vector<uint16_t> wb = bf16_weights(4 * 8 * 64, 3);
    HostBank b{DType::kBF16, wb.data(), 4, 8, 64};
    expect_error(be.upload_bank_window(b, BankWindow{2, 5, 0, 8, 0, 64}),
                 "cpu upload: window experts [2, 5) must be non-empty inside [0, 4)");
    expect_error(be.upload_bank_window(b, BankWindow{0, 4, 6, 9, 0, 64}),
                 "cpu upload: window rows [6, 9) must be non-empty inside [0, 8)");
    expect_error(be.upload_bank_window(b, BankWindow{0, 4, 0, 8, 16, 48}),
                 "K window [16, 48) is not an aligned subtree");
    EXPECT_TRUE(be.upload_bank_window(b, BankWindow{1, 3, 0, 8, 32, 64}).has_value());
    // The whole-tensor checks come first, as for upload_matrix.
    expect_error(be.upload_matrix_window(HostMatrix{DType::kI32, w.data(), 8, 64}, MatrixWindow{0, 8, 0, 64}),
                 "matrix dtype I32 is not supported");
}

TEST(CpuBackendShards, RowParallelShardsCombineToTheWholeProduct) {
    const int64_t n = 3;
    const int64_t rows = 40;
    const int64_t cols = 256;  // blocks of 32
    const std::vector<uint16_t> w = bf16_weights(static_cast<size_t>(rows * cols), 4);
    const HostMatrix m{DType::kBF16, w.data(), rows, cols};
    const std::vector<float> x = random_floats(static_cast<size_t>(n * cols), 5);

    CpuBackend whole_be(2);
    const MatrixId whole = *whole_be.upload_matrix(m);
    auto ws = whole_be.alloc(DType::kF32, {whole_be.canonical_workspace_floats(n, whole)});
    auto y = whole_be.alloc(DType::kF32, {n, rows});
    whole_be.matmul_canonical(upload(whole_be, x, n, cols), whole, *y, *ws);
    const std::vector<float> want = download(whole_be, *y);

    for (int64_t tp : {1, 2, 4, 8}) {
        const int64_t k_local = cols / tp;
        std::vector<float> gathered(static_cast<size_t>(tp * n * rows));
        for (int64_t r = 0; r < tp; ++r) {
            CpuBackend be(1);
            const MatrixId shard = *be.upload_matrix_window(m, MatrixWindow{0, rows, r * k_local, (r + 1) * k_local});
            EXPECT_EQ(be.canonical_workspace_floats(n, shard), (8 / tp) * n * rows);
            std::vector<float> x_local(static_cast<size_t>(n * k_local));
            for (int64_t t = 0; t < n; ++t) {
                std::memcpy(x_local.data() + t * k_local, x.data() + t * cols + r * k_local,
                            static_cast<size_t>(k_local) * sizeof(float));
            }
            auto ws_r = be.alloc(DType::kF32, {be.canonical_workspace_floats(n, shard)});
            auto y_r = be.alloc(DType::kF32, {n, rows});
            be.matmul_canonical(upload(be, x_local, n, k_local), shard, *y_r, *ws_r);
            const std::vector<float> part = download(be, *y_r);
            std::copy(part.begin(), part.end(), gathered.begin() + r * n * rows);
        }
        CpuBackend be(1);
        auto all = upload(be, gathered, tp, n * rows);
        auto out = be.alloc(DType::kF32, {n, rows});
        be.reset_counters();
        be.canonical_combine(all, *out);
        EXPECT_EQ(be.counters().launches, 1);
        EXPECT_EQ(bit_mismatches(download(be, *out), want), 0) << "tp " << tp;
    }
}

TEST(CpuBackendShards, GroupedProductsOverAnOwnersExperts) {
    const int64_t n_experts = 4;
    const int64_t rows = 24;
    const int64_t cols = 64;
    const std::vector<uint16_t> w = bf16_weights(static_cast<size_t>(n_experts * rows * cols), 6);
    const HostBank bank{DType::kBF16, w.data(), n_experts, rows, cols};
    // 10 sorted pairs: experts 0, 1, 2, 3 get 3, 0, 4, 3 of them.
    const std::vector<int32_t> off{0, 3, 3, 7, 10};
    const int64_t n_pairs = 10;
    const std::vector<float> x = random_floats(static_cast<size_t>(n_pairs * cols), 7);

    CpuBackend be(2);
    auto offsets = be.alloc(DType::kI32, {n_experts + 1});
    be.copy_from_host(off.data(), *offsets);
    const TensorView xv = upload(be, x, n_pairs, cols);
    const BankId whole = *be.upload_bank(bank);
    auto y_whole = be.alloc(DType::kF32, {n_pairs, rows});
    be.matmul_grouped(xv, whole, *offsets, *y_whole);
    const std::vector<float> want = download(be, *y_whole);
    auto ws = be.alloc(DType::kF32, {be.grouped_canonical_workspace_floats(n_pairs, whole)});
    auto yc_whole = be.alloc(DType::kF32, {n_pairs, rows});
    be.matmul_grouped_canonical(xv, whole, *offsets, *yc_whole, *ws);
    const std::vector<float> want_c = download(be, *yc_whole);

    // The owner of experts [2, 4) writes rows 3 .. 10 only, with the whole bank's bits.
    const BankId owned = *be.upload_bank_window(bank, BankWindow{2, 4, 0, rows, 0, cols});
    const std::vector<float> sentinel(static_cast<size_t>(n_pairs * rows), -5.0f);
    const TensorView y = upload(be, sentinel, n_pairs, rows);
    be.matmul_grouped(xv, owned, *offsets, y);
    const TensorView yc = upload(be, sentinel, n_pairs, rows);
    be.matmul_grouped_canonical(xv, owned, *offsets, yc, *ws);
    const std::vector<float> got = download(be, y);
    const std::vector<float> got_c = download(be, yc);
    int64_t bad = 0;
    for (int64_t p = 0; p < n_pairs; ++p) {
        for (int64_t j = 0; j < rows; ++j) {
            const size_t i = static_cast<size_t>(p * rows + j);
            if (p < 3) {
                bad += got[i] != -5.0f;
                bad += got_c[i] != -5.0f;
            } else {
                bad += test::bits(got[i]) != test::bits(want[i]);
                bad += test::bits(got_c[i]) != test::bits(want_c[i]);
            }
        }
    }
    EXPECT_EQ(bad, 0);

    // Every expert's row slice [8, 16) (gate/up without EP) gives those columns of the whole output.
    const BankId sliced = *be.upload_bank_window(bank, BankWindow{0, n_experts, 8, 16, 0, cols});
    auto ys = be.alloc(DType::kF32, {n_pairs, 8});
    be.matmul_grouped(xv, sliced, *offsets, *ys);
    const std::vector<float> got_s = download(be, *ys);
    bad = 0;
    for (int64_t p = 0; p < n_pairs; ++p) {
        for (int64_t j = 0; j < 8; ++j) {
            bad += test::bits(got_s[static_cast<size_t>(p * 8 + j)]) !=
                   test::bits(want[static_cast<size_t>(p * rows + 8 + j)]);
        }
    }
    EXPECT_EQ(bad, 0);
}

TEST(CpuBackendShards, JoinColShardsInterleavesRankSlices) {
    CpuBackend be(1);
    // 3 shards of [2, 4]: shard s, row t, column j holds 100 s + 10 t + j.
    std::vector<float> host(24);
    for (int s = 0; s < 3; ++s) {
        for (int t = 0; t < 2; ++t) {
            for (int j = 0; j < 4; ++j) host[static_cast<size_t>((s * 2 + t) * 4 + j)] = float(100 * s + 10 * t + j);
        }
    }
    const TensorView shards = upload(be, host, 3, 8).reshaped({3, 2, 4});
    auto out = be.alloc(DType::kF32, {2, 12});
    be.reset_counters();
    be.join_col_shards(shards, *out);
    EXPECT_EQ(be.counters().launches, 1);
    const std::vector<float> got = download(be, *out);
    for (int t = 0; t < 2; ++t) {
        for (int c = 0; c < 12; ++c) {
            EXPECT_EQ(got[static_cast<size_t>(t * 12 + c)], float(100 * (c / 4) + 10 * t + c % 4)) << t << " " << c;
        }
    }
}

}  // namespace
}  // namespace memra::cpu
