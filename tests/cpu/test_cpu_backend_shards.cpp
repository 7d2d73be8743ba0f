// CpuBackend with a tensor-parallel rank's weights: window uploads (row slices, K windows of whole
// canonical blocks, expert ranges) and their refusals, row-parallel products finished by canonical_combine,
// grouped products over an owner's experts in its compact row order, and join_col_shards, all against the
// whole weights' bits.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "backend/cpu/cpu_backend.h"
#include "core/float_formats.h"
#include "core/fp8_block.h"
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

// The copy bandwidth bench's roofline divides by: a positive rate on any thread count; no bytes refused.
TEST(CpuBackendShards, CopyBandwidthIsPositiveAndRefusesNoBytes) {
    for (const int threads : {1, 2}) {
        cpu::CpuBackend be(threads, Numerics::kDevice);
        auto bw = be.copy_bandwidth(int64_t{8} << 20);
        ASSERT_TRUE(bw.has_value()) << bw.error().message;
        EXPECT_GT(*bw, 1e8) << threads << " threads";
    }
    cpu::CpuBackend be(1, Numerics::kDevice);
    auto none = be.copy_bandwidth(0);
    ASSERT_FALSE(none.has_value());
    EXPECT_EQ(none.error().message, "cpu copy bandwidth: 0 bytes, expected >= 1");
}

TEST(CpuBackendShards, WindowUploadsAreValidated) {
    CpuBackend be(1, Numerics::kExact);
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

    // A bank window is an expert range only (routed experts are never split by width).
    const std::vector<uint16_t> wb = bf16_weights(4 * 8 * 64, 3);
    HostBank b{DType::kBF16, wb.data(), 4, 8, 64};
    expect_error(be.upload_bank_window(b, BankWindow{2, 5}),
                 "cpu upload: window experts [2, 5) must be non-empty inside [0, 4)");
    expect_error(be.upload_bank_window(b, BankWindow{3, 3}),
                 "cpu upload: window experts [3, 3) must be non-empty inside [0, 4)");
    expect_error(be.upload_bank_window(b, BankWindow{-1, 2}),
                 "cpu upload: window experts [-1, 2) must be non-empty inside [0, 4)");
    EXPECT_TRUE(be.upload_bank_window(b, BankWindow{1, 3}).has_value());
    EXPECT_TRUE(be.upload_bank_window(b, BankWindow{3, 4}).has_value());
    expect_error(be.upload_bank_window(HostBank{DType::kF8E4M3, wb.data(), 4, 8, 64}, BankWindow{0, 2}),
                 "F8_E4M3 expert bank [4, 8, 64] needs scale_inv");
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

    CpuBackend whole_be(2, Numerics::kExact);
    const MatrixId whole = *whole_be.upload_matrix(m);
    auto ws = whole_be.alloc(DType::kF32, {whole_be.canonical_workspace_floats(n, whole)});
    auto y = whole_be.alloc(DType::kF32, {n, rows});
    whole_be.matmul_canonical(upload(whole_be, x, n, cols), whole, *y, *ws);
    const std::vector<float> want = download(whole_be, *y);

    for (int64_t tp : {1, 2, 4, 8}) {
        const int64_t k_local = cols / tp;
        std::vector<float> gathered(static_cast<size_t>(tp * n * rows));
        for (int64_t r = 0; r < tp; ++r) {
            CpuBackend be(1, Numerics::kExact);
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
        CpuBackend be(1, Numerics::kExact);
        auto all = upload(be, gathered, tp, n * rows);
        auto out = be.alloc(DType::kF32, {n, rows});
        be.reset_counters();
        be.canonical_combine(all, *out);
        EXPECT_EQ(be.counters().launches, 1);
        EXPECT_EQ(bit_mismatches(download(be, *out), want), 0) << "tp " << tp;
    }
}

// An expert bank of bf16 or fp8 (a distinct power-of-two scale per expert, so a grid read from the wrong
// expert cannot pass) as the host memory uploads read.
struct TestBank {
    DType dtype = DType::kBF16;
    int64_t n_experts = 0, rows = 0, cols = 0;
    std::vector<uint8_t> bytes;  // [n_experts, rows, cols] dtype
    std::vector<float> scale;    // fp8: [n_experts, ceil(rows / 128), ceil(cols / 128)]

    bool fp8() const { return dtype == DType::kF8E4M3; }
    HostBank host() const {
        return HostBank{dtype, bytes.data(), n_experts, rows, cols, fp8() ? scale.data() : nullptr};
    }
    HostMatrix expert(int64_t e) const {
        const int64_t grid = fp8_scale_blocks(rows) * fp8_scale_blocks(cols);
        return HostMatrix{dtype, bytes.data() + e * rows * cols * (fp8() ? 1 : 2), rows, cols,
                          fp8() ? scale.data() + e * grid : nullptr};
    }
};

TestBank make_bank(DType dt, int64_t n_experts, int64_t rows, int64_t cols, uint32_t seed) {
    TestBank b{dt, n_experts, rows, cols, {}, {}};
    const size_t n = static_cast<size_t>(n_experts * rows * cols);
    if (dt == DType::kBF16) {
        const std::vector<uint16_t> h = bf16_weights(n, seed);
        b.bytes.resize(2 * n);
        std::memcpy(b.bytes.data(), h.data(), 2 * n);
    } else {
        const int64_t grid = fp8_scale_blocks(rows) * fp8_scale_blocks(cols);
        const std::vector<float> f = random_floats(n, seed);
        b.bytes.resize(n);
        b.scale.resize(static_cast<size_t>(n_experts * grid));
        for (int64_t e = 0; e < n_experts; ++e) {
            quantize_fp8_block(f.data() + e * rows * cols, rows, cols, b.bytes.data() + e * rows * cols,
                               b.scale.data() + e * grid);
            for (int64_t i = 0; i < grid; ++i) {
                b.scale[static_cast<size_t>(e * grid + i)] = std::ldexp(1.0f, -static_cast<int>(e));
            }
        }
    }
    return b;
}

TEST(CpuBackendShards, GroupedProductsOverAnOwnersExperts) {
    // matmul_grouped over an owned expert window reads and writes the owner's compact rows: expert e's rows are
    // offsets[e] - offsets[e0] .. offsets[e + 1] - offsets[e0]. They equal the whole bank's rows of those
    // experts (D4), which equal each expert's standalone product (the per-expert oracle); rows past the
    // window's are left untouched. The down projection is this same product (one K order, whole experts).
    const int64_t n_experts = 4;
    const int64_t rows = 24;
    const int64_t cols = 136;  // a partial last K chunk
    // 10 sorted pairs: experts 0, 1, 2, 3 get 3, 0, 4, 3 of them.
    const std::vector<int32_t> off{0, 3, 3, 7, 10};
    const int64_t n_pairs = 10;
    const std::vector<float> x = random_floats(static_cast<size_t>(n_pairs * cols), 7);
    for (DType dt : {DType::kBF16, DType::kF8E4M3}) {
        const TestBank bank = make_bank(dt, n_experts, rows, cols, 6);
        CpuBackend be(2, Numerics::kExact);
        auto offsets = be.alloc(DType::kI32, {n_experts + 1});
        be.copy_from_host(off.data(), *offsets);
        const TensorView xv = upload(be, x, n_pairs, cols);
        const BankId whole = *be.upload_bank(bank.host());
        auto y_whole = be.alloc(DType::kF32, {n_pairs, rows});
        be.reset_counters();
        be.matmul_grouped(xv, whole, *offsets, *y_whole);
        EXPECT_EQ(be.counters().launches, 1);
        const std::vector<float> want = download(be, *y_whole);

        // The per-expert oracle: each expert uploaded as a standalone matrix, applied to its rows.
        for (int64_t e = 0; e < n_experts; ++e) {
            const int64_t r0 = off[static_cast<size_t>(e)];
            const int64_t r1 = off[static_cast<size_t>(e + 1)];
            if (r0 == r1) continue;
            const MatrixId m = *be.upload_matrix(bank.expert(e));
            auto ye = be.alloc(DType::kF32, {r1 - r0, rows});
            be.matmul(xv.row_slice(r0, r1), m, *ye);
            EXPECT_EQ(bit_mismatches(download(be, *ye), std::vector<float>(want.begin() + r0 * rows,
                                                                             want.begin() + r1 * rows)),
                      0)
                << dtype_name(dt) << " expert " << e;
        }

        // Owners of [e0, e1): compact rows, two spare rows past them that must keep their sentinel.
        for (const BankWindow win : {BankWindow{0, 2}, BankWindow{2, 4}, BankWindow{1, 3}, BankWindow{3, 4},
                                     BankWindow{1, 2}, BankWindow{0, 4}}) {
            const int64_t r0 = off[static_cast<size_t>(win.expert_begin)];
            const int64_t r1 = off[static_cast<size_t>(win.expert_end)];
            const int64_t n_own = r1 - r0;
            const BankId owned = *be.upload_bank_window(bank.host(), win);
            const std::vector<float> x_own(x.begin() + r0 * cols, x.begin() + r1 * cols);
            std::vector<float> x_padded = x_own;
            x_padded.resize(static_cast<size_t>((n_own + 2) * cols), 3.0f);
            const std::vector<float> sentinel(static_cast<size_t>((n_own + 2) * rows), -5.0f);
            const TensorView y = upload(be, sentinel, n_own + 2, rows);
            be.matmul_grouped(upload(be, x_padded, n_own + 2, cols), owned, *offsets, y);
            const std::vector<float> got = download(be, y);
            const std::vector<float> got_rows(got.begin(), got.begin() + n_own * rows);
            const std::vector<float> spare(got.begin() + n_own * rows, got.end());
            EXPECT_EQ(bit_mismatches(got_rows, std::vector<float>(want.begin() + r0 * rows, want.begin() + r1 * rows)),
                      0)
                << dtype_name(dt) << " experts [" << win.expert_begin << ", " << win.expert_end << ")";
            EXPECT_EQ(bit_mismatches(spare, std::vector<float>(spare.size(), -5.0f)), 0)
                << dtype_name(dt) << " experts [" << win.expert_begin << ", " << win.expert_end << ")";
        }
        // The comparison can fail: the owner of [2, 4) fed the whole-bank row order (rows 0 .. 7 instead of
        // its compact rows 3 .. 10) gives other bits.
        const BankId owned = *be.upload_bank_window(bank.host(), BankWindow{2, 4});
        auto y_wrong = be.alloc(DType::kF32, {n_pairs, rows});
        be.matmul_grouped(xv, owned, *offsets, *y_wrong);
        const std::vector<float> wrong = download(be, *y_wrong);
        EXPECT_GT(bit_mismatches(std::vector<float>(wrong.begin(), wrong.begin() + 7 * rows),
                                 std::vector<float>(want.begin() + 3 * rows, want.end())),
                  0)
            << dtype_name(dt);
    }
}

TEST(CpuBackendShards, JoinColShardsInterleavesRankSlices) {
    CpuBackend be(1, Numerics::kExact);
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
