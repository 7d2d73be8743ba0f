// backend/cuda/ops_rows: every row, element-wise and copy kernel against its CPU twin (the cpu:: function or
// CpuBackend in device numerics) on the same inputs — random rows with a wide exponent range, so any other
// summation order or a fused multiply-add changes bits, plus adversarial rows (zero, subnormal, huge, NaN,
// Inf, -0) — compared as raw bits; results that are NaN compare as NaN only (x86 propagates an operand's
// payload, the GPU returns 0x7fffffff). Copies and lookups compare every bit, NaN payloads included.
// OpsRowsData.* runs without a GPU and shows that the data can tell the canonical orders from others.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/matmul.h"
#include "backend/cpu/ops_elementwise.h"
#include "backend/cpu/ops_moe.h"
#include "backend/cpu/ops_norm.h"
#include "backend/cpu/ops_rope.h"
#include "backend/cuda/ops_rows.h"
#include "core/float_formats.h"
#include "core/math.h"
#include "core/sampling.h"
#include "core/thread_pool.h"
#include "cuda/cuda_test_util.h"

namespace memra {
namespace {

// scatter_ids reads the id as the first i32 of each record.
static_assert(offsetof(SampledToken, id) == 0 && sizeof(SampledToken) % 4 == 0);

using Floats = std::vector<float>;

uint32_t bits(float f) { return f32_as_u32(f); }

size_t sz(int64_t n) { return static_cast<size_t>(n); }

// got == want bit for bit; where want is NaN, got need only be NaN (nan_as_class). Stops at the first mismatch.
void expect_same_bits(const Floats &got, const Floats &want, bool nan_as_class, const std::string &what) {
    ASSERT_EQ(got.size(), want.size()) << what;
    for (size_t i = 0; i < got.size(); ++i) {
        if (nan_as_class && std::isnan(want[i])) {
            ASSERT_TRUE(std::isnan(got[i])) << what << ", index " << i << ": got bits " << bits(got[i]);
        } else {
            ASSERT_EQ(bits(got[i]), bits(want[i]))
                << what << ", index " << i << ": got " << got[i] << ", want " << want[i];
        }
    }
}

// A finite float with a random sign, a random mantissa and an exponent in [lo, hi], so sums of such values
// round at every step and their order shows in the bits.
float wide(std::mt19937 &rng, int lo, int hi) {
    std::uniform_int_distribution<int> e(lo, hi);
    const uint32_t mant = static_cast<uint32_t>(rng()) & 0x7fffffu;
    const uint32_t sign = (static_cast<uint32_t>(rng()) & 1u) << 31;
    return u32_as_f32(sign | (static_cast<uint32_t>(e(rng) + 127) << 23) | mant);
}

float subnormal(std::mt19937 &rng) {
    const uint32_t mant = (static_cast<uint32_t>(rng()) % 0x7fffffu) + 1u;
    return u32_as_f32(((static_cast<uint32_t>(rng()) & 1u) << 31) | mant);
}

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kFltMax = std::numeric_limits<float>::max();

// Rows for the norms: kind 0 (most rows) wide random values; the others are adversarial.
enum class RowKind { kWide, kZero, kSubnormal, kHuge, kOneNaN, kOneInf, kTiny, kMax, kCount };

void fill_row(RowKind kind, std::mt19937 &rng, float *row, int64_t d) {
    for (int64_t i = 0; i < d; ++i) {
        switch (kind) {
            case RowKind::kZero: row[i] = (i % 2 == 0) ? 0.0f : -0.0f; break;
            case RowKind::kSubnormal: row[i] = subnormal(rng); break;
            case RowKind::kHuge: row[i] = wide(rng, 60, 127); break;    // squares overflow to +Inf
            case RowKind::kTiny: row[i] = wide(rng, -80, -60); break;   // squares are subnormal or 0
            case RowKind::kMax: row[i] = (i % 3 == 0) ? -kFltMax : kFltMax; break;
            default: row[i] = wide(rng, -12, 12); break;
        }
    }
    if (kind == RowKind::kOneNaN) row[rng() % sz(d)] = kNaN;
    if (kind == RowKind::kOneInf) row[rng() % sz(d)] = (rng() & 1u) ? kInf : -kInf;
}

// [n_rows, d]: wide rows; when adversarial, every odd row is instead the next adversarial kind in turn.
Floats norm_rows(int64_t n_rows, int64_t d, uint32_t seed, bool adversarial) {
    std::mt19937 rng(seed);
    Floats x(sz(n_rows * d));
    const int64_t n_adversarial = static_cast<int64_t>(RowKind::kCount) - 1;
    for (int64_t r = 0; r < n_rows; ++r) {
        const RowKind kind = adversarial && r % 2 == 1 ? static_cast<RowKind>(1 + (r / 2) % n_adversarial)
                                                       : RowKind::kWide;
        fill_row(kind, rng, x.data() + r * d, d);
    }
    return x;
}

// n element-wise inputs: wide values with about one in eight adversarial (±0, subnormal, huge, ±max, ±Inf, NaN).
Floats mixed_values(size_t n, uint32_t seed, int lo = -12, int hi = 12) {
    std::mt19937 rng(seed);
    Floats v(n);
    for (float &x : v) {
        switch (rng() % 64) {
            case 0: x = 0.0f; break;
            case 1: x = -0.0f; break;
            case 2: x = subnormal(rng); break;
            case 3: x = wide(rng, 100, 127); break;
            case 4: x = (rng() & 1u) ? kFltMax : -kFltMax; break;
            case 5: x = (rng() & 1u) ? kInf : -kInf; break;
            case 6: x = kNaN; break;
            case 7: x = wide(rng, -126, -100); break;
            default: x = wide(rng, lo, hi); break;
        }
    }
    return v;
}

// A norm weight as the backend keeps it: bf16 codes, or f32 values; both hold values in about [-1, 1] with a
// few exact -1 (factor 0) and 0 entries.
struct NormW {
    std::vector<uint16_t> bf16;
    Floats f32;
};

NormW norm_weight(int64_t d, uint32_t seed) {
    std::mt19937 rng(seed);
    NormW w;
    for (int64_t i = 0; i < d; ++i) {
        float v = wide(rng, -8, -1);
        if (i % 97 == 5) v = -1.0f;
        if (i % 89 == 3) v = 0.0f;
        w.f32.push_back(v);
        w.bf16.push_back(f32_to_bf16(v));
    }
    return w;
}

// Device error flag helpers.
DeviceBuffer zero_flag() {
    DeviceBuffer f(sizeof(int32_t));
    const int32_t zero = 0;
    f.upload(&zero);
    return f;
}

int32_t read_flag(const DeviceBuffer &f) { return from_device<int32_t>(f, 1)[0]; }

// ---- OpsRowsData: the test data can fail a kernel with another order or a contraction (no GPU needed). ----

// Σ x² summed left to right: what a kernel ignoring the canonical lanes would compute.
float sequential_sum_squares(const float *x, int64_t n) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; ++i) s = s + x[i] * x[i];
    return s;
}

TEST(OpsRowsData, WideRowsTellReductionOrdersApart) {
    const int64_t d = 4096;
    const Floats x = norm_rows(8, d, 11, false);
    int differ = 0;
    for (int64_t r = 0; r < 8; ++r) {
        differ += bits(sequential_sum_squares(x.data() + r * d, d)) != bits(sum_squares_f32(x.data() + r * d, d));
    }
    EXPECT_GT(differ, 0);
}

TEST(OpsRowsData, MixedValuesTellTreeFromChainAndFmaFromMulAdd) {
    const Floats p = mixed_values(8 * 1000, 12);
    int tree_vs_chain = 0;
    int fma_vs_muladd = 0;
    for (size_t i = 0; i < 1000; ++i) {
        float v[8];
        for (size_t k = 0; k < 8; ++k) v[k] = p[k * 1000 + i];
        const float tree = ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
        float chain = v[0];
        for (int k = 1; k < 8; ++k) chain = chain + v[k];
        tree_vs_chain += !std::isnan(tree) && bits(tree) != bits(chain);
        const float mul_add = v[0] * v[1] + v[2];
        fma_vs_muladd += std::isfinite(mul_add) && bits(mul_add) != bits(std::fma(v[0], v[1], v[2]));
    }
    EXPECT_GT(tree_vs_chain, 0);
    EXPECT_GT(fma_vs_muladd, 0);
}

// ---- Embedding ----

TEST(CudaOpsRows, EmbeddingMatchesCpuForF32AndBf16Tables) {
    MEMRA_SKIP_WITHOUT_GPU();
    ThreadPool pool(2);
    for (int64_t d : {1, 7, 128, 1000}) {
        for (bool bf16 : {false, true}) {
            const int64_t vocab = 37;
            std::mt19937 rng(static_cast<uint32_t>(d) + (bf16 ? 100u : 0u));
            // Random bit patterns: every kind of value, NaN payloads included, must be copied exactly.
            std::vector<uint32_t> t32(sz(vocab * d));
            std::vector<uint16_t> t16(sz(vocab * d));
            for (auto &v : t32) v = static_cast<uint32_t>(rng());
            for (auto &v : t16) v = static_cast<uint16_t>(rng());
            const int64_t n = 45;
            std::vector<int32_t> ids(sz(n));
            for (int64_t t = 0; t < n; ++t) ids[sz(t)] = static_cast<int32_t>(rng() % vocab);
            ids[0] = 0;
            ids[1] = static_cast<int32_t>(vocab - 1);
            const void *host_table = bf16 ? static_cast<const void *>(t16.data()) : t32.data();
            const DType dt = bf16 ? DType::kBF16 : DType::kF32;
            Floats want(sz(n * d));
            ASSERT_TRUE(cpu::embedding_lookup(pool, host_table, dt, vocab, d, ids.data(), n, want.data()).has_value());

            DeviceBuffer d_table = bf16 ? to_device(t16) : to_device(t32);
            DeviceBuffer d_ids = to_device(ids);
            DeviceBuffer d_out(sz(n * d) * 4);
            DeviceBuffer flag = zero_flag();
            ASSERT_EQ(cuda::embedding(d_table.as<void>(), dt, vocab, d, d_ids.as<int32_t>(), n, d_out.as<float>(),
                                      flag.as<int32_t>(), nullptr),
                      cudaSuccess);
            expect_same_bits(from_device<float>(d_out, sz(n * d)), want, false,
                             "embedding d " + std::to_string(d) + (bf16 ? " bf16" : " f32"));
            EXPECT_EQ(read_flag(flag), 0);
        }
    }
}

TEST(CudaOpsRows, EmbeddingBadIdWritesZeroRowAndRaisesFlag) {
    MEMRA_SKIP_WITHOUT_GPU();
    ThreadPool pool(1);
    const int64_t vocab = 10;
    const int64_t d = 33;
    const Floats table = mixed_values(sz(vocab * d), 3);
    const std::vector<int32_t> ids = {3, -1, 9, 10, 0, 2147483647};
    const int64_t n = static_cast<int64_t>(ids.size());
    DeviceBuffer d_table = to_device(table);
    DeviceBuffer d_ids = to_device(ids);
    DeviceBuffer d_out(sz(n * d) * 4);
    DeviceBuffer flag = zero_flag();
    ASSERT_EQ(cuda::embedding(d_table.as<void>(), DType::kF32, vocab, d, d_ids.as<int32_t>(), n, d_out.as<float>(),
                              flag.as<int32_t>(), nullptr),
              cudaSuccess);
    const Floats got = from_device<float>(d_out, sz(n * d));
    EXPECT_EQ(read_flag(flag), 1);
    for (int64_t t = 0; t < n; ++t) {
        const bool bad = ids[sz(t)] < 0 || ids[sz(t)] >= vocab;
        Floats want(sz(d), 0.0f);
        if (!bad) {
            ASSERT_TRUE(cpu::embedding_lookup(pool, table.data(), DType::kF32, vocab, d, &ids[sz(t)], 1, want.data())
                            .has_value());
        }
        expect_same_bits(Floats(got.begin() + t * d, got.begin() + (t + 1) * d), want, false,
                         "embedding row " + std::to_string(t));
    }
    // A null flag is allowed: the bad rows are still zero.
    ASSERT_EQ(cuda::embedding(d_table.as<void>(), DType::kF32, vocab, d, d_ids.as<int32_t>(), n, d_out.as<float>(),
                              nullptr, nullptr),
              cudaSuccess);
    EXPECT_EQ(bits(from_device<float>(d_out, sz(n * d))[sz(d)]), 0u);
}

// ---- RMSNorm family ----

// 8193: past the block kernel's staged row (kBlockNormMax), so the warp-per-row kernel runs.
constexpr int64_t kNormWidths[] = {1, 2, 15, 16, 17, 31, 32, 33, 100, 127, 128, 1000, 4096, 4097, 8192, 8193};

TEST(CudaOpsRows, RmsNormMatchesCpuOutOfPlaceAndInPlace) {
    MEMRA_SKIP_WITHOUT_GPU();
    ThreadPool pool(2);
    for (int64_t d : kNormWidths) {
        const int64_t n = d >= 4096 ? 19 : 37;
        const Floats x = norm_rows(n, d, 1000 + static_cast<uint32_t>(d), true);
        const NormW w = norm_weight(d, 7 + static_cast<uint32_t>(d));
        DeviceBuffer d_w16 = to_device(w.bf16);
        DeviceBuffer d_w32 = to_device(w.f32);
        for (bool bf16 : {false, true}) {
            for (float eps : {1e-5f, 0.0f}) {
                const cpu::NormWeight nw{bf16 ? static_cast<const void *>(w.bf16.data()) : w.f32.data(),
                                         bf16 ? DType::kBF16 : DType::kF32, true};
                Floats want(x.size());
                cpu::rms_norm(pool, x.data(), n, d, nw, eps, want.data());
                const DType wt = bf16 ? DType::kBF16 : DType::kF32;
                const void *dw = bf16 ? d_w16.as<void>() : d_w32.as<void>();
                const std::string what = "rms_norm d " + std::to_string(d) + (bf16 ? " bf16" : " f32") + " eps " +
                                         std::to_string(eps);

                DeviceBuffer d_x = to_device(x);
                DeviceBuffer d_y(x.size() * 4);
                ASSERT_EQ(cuda::rms_norm(d_x.as<float>(), n, d, wt, dw, eps, d_y.as<float>(), nullptr), cudaSuccess);
                expect_same_bits(from_device<float>(d_y, x.size()), want, true, what);
                expect_same_bits(from_device<float>(d_x, x.size()), x, false, what + " (x untouched)");

                ASSERT_EQ(cuda::rms_norm(d_x.as<float>(), n, d, wt, dw, eps, d_x.as<float>(), nullptr), cudaSuccess);
                expect_same_bits(from_device<float>(d_x, x.size()), want, true, what + " in place");
            }
        }
    }
}

TEST(CudaOpsRows, RmsNormHeadsMatchesCpuInsideWiderRows) {
    MEMRA_SKIP_WITHOUT_GPU();
    ThreadPool pool(2);
    struct Case {
        int64_t n_tokens, n_heads, head_dim, extra;  // token_stride = n_heads * head_dim + extra
    };
    for (const Case c : {Case{1, 1, 128, 0}, Case{5, 8, 128, 0}, Case{3, 3, 64, 7}, Case{7, 4, 100, 33},
                         Case{2, 2, 1, 1}, Case{4, 12, 128, 256}}) {
        const int64_t stride = c.n_heads * c.head_dim + c.extra;
        // Each token row holds adversarial and wide heads; the extra columns must stay untouched.
        const Floats x = norm_rows(c.n_tokens * stride / c.head_dim + 1, c.head_dim,
                                   static_cast<uint32_t>(c.head_dim * 31 + c.n_heads), true);
        const Floats x_tok(x.begin(), x.begin() + c.n_tokens * stride);
        const NormW w = norm_weight(c.head_dim, 5);
        for (bool bf16 : {false, true}) {
            const cpu::NormWeight nw{bf16 ? static_cast<const void *>(w.bf16.data()) : w.f32.data(),
                                     bf16 ? DType::kBF16 : DType::kF32, true};
            Floats want = x_tok;
            cpu::rms_norm_heads(pool, want.data(), c.n_tokens, stride, c.n_heads, c.head_dim, nw, 1e-6f);
            DeviceBuffer d_x = to_device(x_tok);
            DeviceBuffer d_w = bf16 ? to_device(w.bf16) : to_device(w.f32);
            ASSERT_EQ(cuda::rms_norm_heads(d_x.as<float>(), c.n_tokens, stride, c.n_heads, c.head_dim,
                                           bf16 ? DType::kBF16 : DType::kF32, d_w.as<void>(), 1e-6f, nullptr),
                      cudaSuccess);
            expect_same_bits(from_device<float>(d_x, x_tok.size()), want, true,
                             "rms_norm_heads heads " + std::to_string(c.n_heads) + " head_dim " +
                                 std::to_string(c.head_dim) + " stride " + std::to_string(stride));
        }
    }
}

TEST(CudaOpsRows, AddRmsNormMatchesCpuWithEveryAllowedAliasing) {
    MEMRA_SKIP_WITHOUT_GPU();
    ThreadPool pool(2);
    enum class Alias { kNone, kHIsX, kHIsR, kYIsX, kYIsR };
    for (int64_t d : {1, 17, 128, 1000, 4096, 4097, 8192, 8193}) {
        const int64_t n = 23;
        const Floats x = norm_rows(n, d, 50 + static_cast<uint32_t>(d), true);
        // r: wide values, so h = x + r rounds; adversarial rows of x stay adversarial in h (or become NaN).
        const Floats r = norm_rows(n, d, 60 + static_cast<uint32_t>(d), false);
        const NormW w = norm_weight(d, 9);
        const cpu::NormWeight nw{w.bf16.data(), DType::kBF16, true};
        DeviceBuffer d_w = to_device(w.bf16);
        for (Alias a : {Alias::kNone, Alias::kHIsX, Alias::kHIsR, Alias::kYIsX, Alias::kYIsR}) {
            // Host: three arrays x, r, and a third one; h and y point into them as the aliasing says.
            Floats hx = x, hr = r, hz(x.size()), hy(x.size());
            float *h_h = a == Alias::kHIsX ? hx.data() : (a == Alias::kHIsR ? hr.data() : hz.data());
            float *h_y = a == Alias::kYIsX ? hx.data() : (a == Alias::kYIsR ? hr.data() : hy.data());
            cpu::add_rms_norm(pool, hx.data(), hr.data(), n, d, nw, 1e-5f, h_h, h_y);

            DeviceBuffer dx = to_device(x), dr = to_device(r), dz(x.size() * 4), dy(x.size() * 4);
            float *g_h = a == Alias::kHIsX ? dx.as<float>() : (a == Alias::kHIsR ? dr.as<float>() : dz.as<float>());
            float *g_y = a == Alias::kYIsX ? dx.as<float>() : (a == Alias::kYIsR ? dr.as<float>() : dy.as<float>());
            ASSERT_EQ(cuda::add_rms_norm(dx.as<float>(), dr.as<float>(), n, d, DType::kBF16, d_w.as<void>(), 1e-5f,
                                         g_h, g_y, nullptr),
                      cudaSuccess);
            const std::string what = "add_rms_norm d " + std::to_string(d) + " alias " +
                                     std::to_string(static_cast<int>(a));
            expect_same_bits(from_device<float>(dx, x.size()), hx, true, what + " x");
            expect_same_bits(from_device<float>(dr, x.size()), hr, true, what + " r");
            if (a != Alias::kHIsX && a != Alias::kHIsR) {
                expect_same_bits(from_device<float>(dz, x.size()), hz, true, what + " h");
            }
            if (a != Alias::kYIsX && a != Alias::kYIsR) {
                expect_same_bits(from_device<float>(dy, x.size()), hy, true, what + " y");
            }
        }
    }
}

// ---- Element-wise ----

TEST(CudaOpsRows, ResidualAddMatchesCpuIncludingAliasing) {
    MEMRA_SKIP_WITHOUT_GPU();
    ThreadPool pool(2);
    for (int64_t d : {1, 33, 4097}) {
        const int64_t n = 9;
        const Floats a = mixed_values(sz(n * d), 70 + static_cast<uint32_t>(d));
        const Floats b = mixed_values(sz(n * d), 80 + static_cast<uint32_t>(d));
        Floats want(a.size());
        cpu::residual_add(pool, a.data(), b.data(), n, d, want.data());
        for (int out_is : {0, 1, 2}) {  // separate, a, b
            DeviceBuffer da = to_device(a), db = to_device(b), dout(a.size() * 4);
            float *out = out_is == 1 ? da.as<float>() : (out_is == 2 ? db.as<float>() : dout.as<float>());
            ASSERT_EQ(cuda::residual_add(da.as<float>(), db.as<float>(), n, d, out, nullptr), cudaSuccess);
            const DeviceBuffer &res = out_is == 1 ? da : (out_is == 2 ? db : dout);
            expect_same_bits(from_device<float>(res, a.size()), want, true,
                             "residual_add d " + std::to_string(d) + " out " + std::to_string(out_is));
        }
    }
}

struct RopeCase {
    int64_t rot_dim, head_dim, n_heads, extra;
    double theta;
    bool llama3;
};

cpu::RopeTable make_rope_table(ThreadPool &pool, const RopeCase &c, int64_t n_positions) {
    const cpu::RopeLlama3 l3{8.0, 1.0, 4.0, 8192.0};
    auto inv = cpu::rope_inv_freq(c.rot_dim, c.theta, c.llama3 ? &l3 : nullptr);
    EXPECT_TRUE(inv.has_value());
    auto table = cpu::rope_table_build(pool, *inv, n_positions);
    EXPECT_TRUE(table.has_value());
    return std::move(*table);
}

TEST(CudaOpsRows, RopeMatchesCpuPartialFullAndLlama3) {
    MEMRA_SKIP_WITHOUT_GPU();
    ThreadPool pool(2);
    const int64_t n_positions = 9000;
    for (const RopeCase c : {RopeCase{64, 128, 4, 0, 10000.0, false}, RopeCase{128, 128, 8, 0, 500000.0, true},
                             RopeCase{64, 128, 3, 128, 5000000.0, true}, RopeCase{2, 3, 5, 1, 10000.0, false},
                             RopeCase{96, 128, 1, 0, 1000000.0, true}}) {
        const cpu::RopeTable table = make_rope_table(pool, c, n_positions);
        const int64_t n = 37;
        const int64_t stride = c.n_heads * c.head_dim + c.extra;
        std::mt19937 rng(static_cast<uint32_t>(c.rot_dim + c.n_heads));
        std::vector<int64_t> pos(sz(n));
        for (auto &p : pos) p = static_cast<int64_t>(rng() % n_positions);
        pos[0] = 0;
        pos[1] = n_positions - 1;
        const Floats x = mixed_values(sz(n * stride), static_cast<uint32_t>(c.head_dim * 7 + c.rot_dim), -8, 8);
        Floats want = x;
        ASSERT_TRUE(cpu::rope_apply(pool, table, want.data(), n, stride, c.n_heads, c.head_dim, pos.data()).has_value());

        DeviceBuffer d_cos = to_device(table.cos), d_sin = to_device(table.sin);
        DeviceBuffer d_x = to_device(x), d_pos = to_device(pos);
        DeviceBuffer flag = zero_flag();
        ASSERT_EQ(cuda::rope(d_cos.as<float>(), d_sin.as<float>(), table.n_positions, table.half, d_x.as<float>(), n,
                             stride, c.n_heads, c.head_dim, d_pos.as<int64_t>(), flag.as<int32_t>(), nullptr),
                  cudaSuccess);
        expect_same_bits(from_device<float>(d_x, x.size()), want, true,
                         "rope rot " + std::to_string(c.rot_dim) + " head_dim " + std::to_string(c.head_dim) +
                             (c.llama3 ? " llama3" : ""));
        EXPECT_EQ(read_flag(flag), 0);
    }
}

TEST(CudaOpsRows, RopeBadPositionLeavesTokenAndRaisesFlag) {
    MEMRA_SKIP_WITHOUT_GPU();
    ThreadPool pool(1);
    const RopeCase c{64, 128, 2, 0, 10000.0, false};
    const int64_t n_positions = 100;
    const cpu::RopeTable table = make_rope_table(pool, c, n_positions);
    const std::vector<int64_t> pos = {5, 100, -1, 99};
    const int64_t n = 4;
    const int64_t stride = c.n_heads * c.head_dim;
    const Floats x = mixed_values(sz(n * stride), 4);
    Floats want = x;
    for (int64_t t : {0, 3}) {
        ASSERT_TRUE(cpu::rope_apply(pool, table, want.data() + t * stride, 1, stride, c.n_heads, c.head_dim, &pos[sz(t)])
                        .has_value());
    }
    DeviceBuffer d_cos = to_device(table.cos), d_sin = to_device(table.sin);
    DeviceBuffer d_x = to_device(x), d_pos = to_device(pos);
    DeviceBuffer flag = zero_flag();
    ASSERT_EQ(cuda::rope(d_cos.as<float>(), d_sin.as<float>(), n_positions, table.half, d_x.as<float>(), n, stride,
                         c.n_heads, c.head_dim, d_pos.as<int64_t>(), flag.as<int32_t>(), nullptr),
              cudaSuccess);
    expect_same_bits(from_device<float>(d_x, x.size()), want, true, "rope with bad positions");
    EXPECT_EQ(read_flag(flag), 1);
}

// qk_norm_rope against the CPU's rms_norm_heads of q and k followed by rope_apply of both: q and k in wider rows
// (their extra columns untouched), f32 and bf16 norm weights, partial and full rotation, no table (the norms
// alone), and tokens at positions outside the table (normed, not rotated, flagged).
TEST(CudaOpsRows, QkNormRopeMatchesCpuNormsThenRope) {
    MEMRA_SKIP_WITHOUT_GPU();
    ThreadPool pool(2);
    const int64_t n_positions = 600;
    struct Case {
        RopeCase rope;  // rot_dim, head_dim, q heads, q extra columns, theta, llama3
        int64_t n_kv_heads, k_extra, n_tokens;
        bool table, bad_positions;
    };
    for (const Case &c : {Case{{64, 128, 12, 0, 10000.0, false}, 1, 0, 1, true, false},
                         Case{{128, 128, 8, 128, 500000.0, true}, 2, 7, 9, true, false},
                         Case{{64, 128, 3, 5, 5000000.0, true}, 3, 0, 37, false, false},
                         Case{{2, 3, 5, 1, 10000.0, false}, 2, 1, 6, true, false},
                         Case{{64, 128, 4, 0, 10000.0, false}, 2, 0, 4, true, true}}) {
        const int64_t hd = c.rope.head_dim, n = c.n_tokens;
        const int64_t q_stride = c.rope.n_heads * hd + c.rope.extra;
        const int64_t k_stride = c.n_kv_heads * hd + c.k_extra;
        const cpu::RopeTable table = make_rope_table(pool, c.rope, n_positions);
        std::mt19937 rng(static_cast<uint32_t>(hd * 3 + c.rope.n_heads));
        std::vector<int64_t> pos(sz(n));
        for (auto &p : pos) p = static_cast<int64_t>(rng() % n_positions);
        if (c.bad_positions) {
            pos[1] = n_positions;
            pos[2] = -1;
        }
        // Adversarial and wide heads, as for rms_norm_heads.
        const Floats q_rows = norm_rows(n * q_stride / hd + 1, hd, static_cast<uint32_t>(hd + 11), true);
        const Floats k_rows = norm_rows(n * k_stride / hd + 1, hd, static_cast<uint32_t>(hd + 12), true);
        const Floats q(q_rows.begin(), q_rows.begin() + n * q_stride);
        const Floats k(k_rows.begin(), k_rows.begin() + n * k_stride);
        const NormW wq = norm_weight(hd, 7), wk = norm_weight(hd, 8);
        for (bool bf16 : {false, true}) {
            const DType wt = bf16 ? DType::kBF16 : DType::kF32;
            const auto nw = [&](const NormW &w) {
                return cpu::NormWeight{bf16 ? static_cast<const void *>(w.bf16.data()) : w.f32.data(), wt, true};
            };
            Floats want_q = q, want_k = k;
            cpu::rms_norm_heads(pool, want_q.data(), n, q_stride, c.rope.n_heads, hd, nw(wq), 1e-6f);
            cpu::rms_norm_heads(pool, want_k.data(), n, k_stride, c.n_kv_heads, hd, nw(wk), 1e-6f);
            for (int64_t t = 0; c.table && t < n; ++t) {
                if (pos[sz(t)] < 0 || pos[sz(t)] >= n_positions) continue;
                ASSERT_TRUE(cpu::rope_apply(pool, table, want_q.data() + t * q_stride, 1, q_stride, c.rope.n_heads, hd,
                                            &pos[sz(t)])
                                .has_value());
                ASSERT_TRUE(cpu::rope_apply(pool, table, want_k.data() + t * k_stride, 1, k_stride, c.n_kv_heads, hd,
                                            &pos[sz(t)])
                                .has_value());
            }
            DeviceBuffer d_q = to_device(q), d_k = to_device(k);
            DeviceBuffer d_wq = bf16 ? to_device(wq.bf16) : to_device(wq.f32);
            DeviceBuffer d_wk = bf16 ? to_device(wk.bf16) : to_device(wk.f32);
            DeviceBuffer d_cos = to_device(table.cos), d_sin = to_device(table.sin), d_pos = to_device(pos);
            DeviceBuffer flag = zero_flag();
            const cuda::QkHeads hq{d_q.as<float>(), q_stride, c.rope.n_heads, wt, d_wq.as<void>()};
            const cuda::QkHeads hk{d_k.as<float>(), k_stride, c.n_kv_heads, wt, d_wk.as<void>()};
            const cuda::RopeRows rope{c.table ? d_cos.as<float>() : nullptr, d_sin.as<float>(), table.n_positions,
                                      table.half, d_pos.as<int64_t>()};
            ASSERT_EQ(cuda::qk_norm_rope(hq, hk, n, hd, 1e-6f, rope, flag.as<int32_t>(), nullptr), cudaSuccess);
            const std::string what = "qk_norm_rope head_dim " + std::to_string(hd) + " rot " +
                                     std::to_string(c.rope.rot_dim) + (c.table ? "" : " no table") +
                                     (bf16 ? " bf16 w" : " f32 w");
            expect_same_bits(from_device<float>(d_q, q.size()), want_q, true, what + ", q");
            expect_same_bits(from_device<float>(d_k, k.size()), want_k, true, what + ", k");
            EXPECT_EQ(read_flag(flag), c.table && c.bad_positions ? 1 : 0) << what;
        }
    }
    // Bad arguments launch nothing.
    const cuda::QkHeads none{nullptr, 128, 1, DType::kF32, nullptr};
    EXPECT_EQ(cuda::qk_norm_rope(none, none, 1, 128, 1e-6f, {}, nullptr, nullptr), cudaErrorInvalidValue);
    float *fake = reinterpret_cast<float *>(uintptr_t{256});
    const cuda::QkHeads narrow{fake, 100, 1, DType::kF32, fake};  // 100 < 1 x 128
    EXPECT_EQ(cuda::qk_norm_rope(narrow, narrow, 1, 128, 1e-6f, {}, nullptr, nullptr), cudaErrorInvalidValue);
    const cuda::QkHeads ok{fake, 128, 1, DType::kF32, fake};
    const auto *fake_pos = reinterpret_cast<const int64_t *>(uintptr_t{256});
    // A half of 65 rotates 130 dims of a 128-wide head.
    EXPECT_EQ(cuda::qk_norm_rope(ok, ok, 1, 128, 1e-6f, cuda::RopeRows{fake, fake, 10, 65, fake_pos}, nullptr, nullptr),
              cudaErrorInvalidValue);
    EXPECT_EQ(cuda::qk_norm_rope(ok, ok, 0, 128, 1e-6f, {}, nullptr, nullptr), cudaSuccess);
}

TEST(CudaOpsRows, SwigluMatchesCpuWithAndWithoutClamp) {
    MEMRA_SKIP_WITHOUT_GPU();
    ThreadPool pool(2);
    for (int64_t d_ff : {1, 31, 1280, 4097}) {
        const int64_t n = 7;
        for (bool fused : {false, true}) {
            const int64_t stride = fused ? 2 * d_ff : d_ff;
            // Inputs up to 2^8, so both sides of the clamp are hit; exact ±limit and NaN/Inf among them.
            Floats g = mixed_values(sz(n * stride), 90 + static_cast<uint32_t>(d_ff), -10, 8);
            Floats u = mixed_values(sz(n * stride), 91 + static_cast<uint32_t>(d_ff), -10, 8);
            for (size_t i = 0; i < g.size(); i += 13) g[i] = 7.0f;
            for (size_t i = 5; i < u.size(); i += 17) u[i] = (i % 2 == 0) ? 7.0f : -7.0f;
            const float *gate = g.data();
            const float *up = fused ? g.data() + d_ff : u.data();
            for (float limit : {0.0f, 7.0f, 1e-30f}) {
                Floats want(sz(n * d_ff));
                cpu::swiglu(pool, gate, up, stride, n, d_ff, limit, want.data());
                DeviceBuffer dg = to_device(g), du = to_device(u), dout(want.size() * 4);
                const float *g_up = fused ? dg.as<float>() + d_ff : du.as<float>();
                ASSERT_EQ(cuda::swiglu(dg.as<float>(), g_up, stride, n, d_ff, limit, dout.as<float>(), nullptr),
                          cudaSuccess);
                const std::string what = "swiglu d_ff " + std::to_string(d_ff) + (fused ? " fused" : "") +
                                         " limit " + std::to_string(limit);
                expect_same_bits(from_device<float>(dout, want.size()), want, true, what);
                if (!fused) {  // out == gate exactly
                    ASSERT_EQ(cuda::swiglu(dg.as<float>(), du.as<float>(), stride, n, d_ff, limit, dg.as<float>(),
                                           nullptr),
                              cudaSuccess);
                    expect_same_bits(from_device<float>(dg, want.size()), want, true, what + " in place");
                }
            }
        }
    }
}

TEST(CudaOpsRows, CanonicalCombineMatchesCpuTreeAtTp1248) {
    MEMRA_SKIP_WITHOUT_GPU();
    for (int64_t tp : {1, 2, 4, 8}) {
        for (int64_t n : {1, 1000, 4097}) {
            const Floats sums = mixed_values(sz(tp * n), static_cast<uint32_t>(tp * 10007 + n));
            Floats want(sz(n));
            cpu::canonical_tree_combine(sums.data(), tp, n, want.data());
            DeviceBuffer d_sums = to_device(sums), d_out(sz(n) * 4);
            ASSERT_EQ(cuda::canonical_combine(d_sums.as<float>(), tp, n, d_out.as<float>(), nullptr), cudaSuccess);
            expect_same_bits(from_device<float>(d_out, sz(n)), want, true,
                             "canonical_combine tp " + std::to_string(tp) + " n " + std::to_string(n));
        }
    }
}

// ---- MoE combine ----

TEST(CudaOpsRows, MoeCombineMatchesCpuWithAndWithoutSharedAndInPlace) {
    MEMRA_SKIP_WITHOUT_GPU();
    ThreadPool pool(2);
    struct Case {
        int64_t n_tokens, top_k, d;
    };
    for (const Case c : {Case{1, 1, 1}, Case{5, 8, 100}, Case{33, 8, 4096}, Case{3, 3, 17}}) {
        const int64_t pairs = c.n_tokens * c.top_k;
        const int64_t expert_rows = pairs + 5;  // gathered rows with some unused ones
        std::mt19937 rng(static_cast<uint32_t>(c.d + c.top_k));
        std::vector<int32_t> src(sz(pairs));
        for (auto &s : src) s = static_cast<int32_t>(rng() % expert_rows);
        const Floats h = mixed_values(sz(c.n_tokens * c.d), 1 + static_cast<uint32_t>(c.d));
        const Floats ex = mixed_values(sz(expert_rows * c.d), 2 + static_cast<uint32_t>(c.d));
        const Floats sh = mixed_values(sz(c.n_tokens * c.d), 3 + static_cast<uint32_t>(c.d));
        Floats w(sz(pairs));
        for (size_t i = 0; i < w.size(); ++i) w[i] = i % 11 == 4 ? 0.0f : wide(rng, -4, 1);
        for (bool shared : {false, true}) {
            Floats want(h.size());
            cpu::moe_combine(pool, h.data(), ex.data(), src.data(), w.data(), shared ? sh.data() : nullptr,
                             c.n_tokens, c.top_k, c.d, want.data());
            DeviceBuffer dh = to_device(h), dex = to_device(ex), dsrc = to_device(src), dw = to_device(w);
            DeviceBuffer dsh = to_device(sh), dout(h.size() * 4);
            DeviceBuffer flag = zero_flag();
            const float *g_sh = shared ? dsh.as<float>() : nullptr;
            const std::string what = "moe_combine tokens " + std::to_string(c.n_tokens) + " top_k " +
                                     std::to_string(c.top_k) + " d " + std::to_string(c.d) +
                                     (shared ? " shared" : "");
            ASSERT_EQ(cuda::moe_combine(dh.as<float>(), dex.as<float>(), expert_rows, dsrc.as<int32_t>(),
                                        dw.as<float>(), g_sh, c.n_tokens, c.top_k, c.d, dout.as<float>(),
                                        flag.as<int32_t>(), nullptr),
                      cudaSuccess);
            expect_same_bits(from_device<float>(dout, h.size()), want, true, what);
            ASSERT_EQ(cuda::moe_combine(dh.as<float>(), dex.as<float>(), expert_rows, dsrc.as<int32_t>(),
                                        dw.as<float>(), g_sh, c.n_tokens, c.top_k, c.d, dh.as<float>(),
                                        flag.as<int32_t>(), nullptr),
                      cudaSuccess);
            expect_same_bits(from_device<float>(dh, h.size()), want, true, what + " out == h");
            EXPECT_EQ(read_flag(flag), 0);
        }
    }
}

TEST(CudaOpsRows, MoeCombineSignedZerosAndBadSourceRow) {
    MEMRA_SKIP_WITHOUT_GPU();
    ThreadPool pool(1);
    // routed starts at +0: (+0) + (-0) = +0, then h = -0 gives -0 + +0 = +0. A kernel starting from the first
    // product would give -0 here.
    const int64_t n = 2, top_k = 2, d = 3;
    const Floats h(sz(n * d), -0.0f);
    const Floats ex = {-0.0f, -0.0f, -1.0f, -0.0f, 2.0f, -0.0f};
    const std::vector<int32_t> src = {0, 0, 1, 0};
    const Floats w = {1.0f, 0.5f, 0.0f, 3.0f};
    Floats want(h.size());
    cpu::moe_combine(pool, h.data(), ex.data(), src.data(), w.data(), nullptr, n, top_k, d, want.data());
    EXPECT_EQ(bits(want[0]), 0u);  // the case this test is for
    DeviceBuffer dh = to_device(h), dex = to_device(ex), dsrc = to_device(src), dw = to_device(w), dout(h.size() * 4);
    DeviceBuffer flag = zero_flag();
    ASSERT_EQ(cuda::moe_combine(dh.as<float>(), dex.as<float>(), 2, dsrc.as<int32_t>(), dw.as<float>(), nullptr, n,
                                top_k, d, dout.as<float>(), flag.as<int32_t>(), nullptr),
              cudaSuccess);
    expect_same_bits(from_device<float>(dout, h.size()), want, false, "moe_combine signed zeros");
    EXPECT_EQ(read_flag(flag), 0);

    // A source row past the gathered rows adds nothing and raises the flag.
    const std::vector<int32_t> bad = {0, 2, -1, 1};
    DeviceBuffer dbad = to_device(bad);
    ASSERT_EQ(cuda::moe_combine(dh.as<float>(), dex.as<float>(), 2, dbad.as<int32_t>(), dw.as<float>(), nullptr, n,
                                top_k, d, dout.as<float>(), flag.as<int32_t>(), nullptr),
              cudaSuccess);
    EXPECT_EQ(read_flag(flag), 1);
    const std::vector<int32_t> only_good = {0, 1};  // token 0 keeps slot 0, token 1 keeps slot 1
    const Floats w_good = {w[0], w[3]};
    Floats want_bad(h.size());
    cpu::moe_combine(pool, h.data(), ex.data(), only_good.data(), w_good.data(), nullptr, n, 1, d, want_bad.data());
    expect_same_bits(from_device<float>(dout, h.size()), want_bad, false, "moe_combine bad source rows");
}

// ---- Exact copies (against CpuBackend's copy ops) ----

TensorView host_view(void *data, DType dt, std::initializer_list<int64_t> shape) {
    TensorView v;
    v.data = data;
    v.dtype = dt;
    v.device = Device::kCpu;
    v.rank = static_cast<int>(shape.size());
    size_t i = 0;
    for (int64_t s : shape) v.shape[i++] = s;
    return v;
}

std::vector<uint8_t> random_bytes(size_t n, uint32_t seed) {
    std::mt19937 rng(seed);
    std::vector<uint8_t> v(n);
    for (auto &b : v) b = static_cast<uint8_t>(rng());
    return v;
}

// Element types of the copy tests: (dtype, bytes); the CPU ops copy dtype_size bytes per element.
struct ElemType {
    DType dtype;
    int64_t bytes;
};
constexpr ElemType kCopyTypes[] = {{DType::kF32, 4}, {DType::kI32, 4}, {DType::kBF16, 2}, {DType::kU8, 1},
                                   {DType::kI64, 8}};

// A device buffer of `bytes` plus slack, and a pointer `offset` bytes into it (to test unaligned rows).
struct OffsetBuffer {
    DeviceBuffer buf;
    int64_t offset;
    OffsetBuffer(const std::vector<uint8_t> &host, int64_t off) : buf(host.size() + 16), offset(off) {
        std::vector<uint8_t> padded(host.size() + 16, 0xab);
        std::memcpy(padded.data() + off, host.data(), host.size());
        buf.upload(padded.data());
    }
    void *ptr() const { return buf.as<uint8_t>() + offset; }
    std::vector<uint8_t> read(size_t n) const {
        const std::vector<uint8_t> all = from_device<uint8_t>(buf, n + 16);
        return std::vector<uint8_t>(all.begin() + offset, all.begin() + offset + static_cast<int64_t>(n));
    }
};

TEST(CudaOpsRows, GatherAndScatterRowsMatchCpuForEveryElementSizeAndAlignment) {
    MEMRA_SKIP_WITHOUT_GPU();
    cpu::CpuBackend cpu(1, Numerics::kDevice);
    for (const ElemType et : kCopyTypes) {
        for (int64_t d : {1, 3, 128, 4097}) {
            for (int64_t off : {0, 1, 4, 8}) {
                const int64_t src_rows = 21, n = 13;
                const size_t row_bytes = sz(d * et.bytes);
                std::mt19937 rng(static_cast<uint32_t>(d * 7 + et.bytes + off));
                const std::vector<uint8_t> src = random_bytes(sz(src_rows) * row_bytes, static_cast<uint32_t>(d));
                std::vector<int32_t> rows(sz(n));
                for (auto &r : rows) r = static_cast<int32_t>(rng() % src_rows);
                rows[0] = static_cast<int32_t>(src_rows - 1);
                const std::string what = "dtype bytes " + std::to_string(et.bytes) + " d " + std::to_string(d) +
                                         " offset " + std::to_string(off);

                // gather: dst[i] = src[rows[i]]
                std::vector<uint8_t> want(sz(n) * row_bytes);
                std::vector<uint8_t> src_copy = src;
                cpu.gather_rows(host_view(src_copy.data(), et.dtype, {src_rows, d}),
                                host_view(rows.data(), DType::kI32, {n}), host_view(want.data(), et.dtype, {n, d}));
                OffsetBuffer d_src(src, off), d_dst(std::vector<uint8_t>(want.size(), 0), off);
                DeviceBuffer d_rows = to_device(rows);
                DeviceBuffer flag = zero_flag();
                ASSERT_EQ(cuda::gather_rows(d_src.ptr(), src_rows, d_rows.as<int32_t>(), n, d, et.bytes, d_dst.ptr(),
                                            flag.as<int32_t>(), nullptr),
                          cudaSuccess);
                ASSERT_EQ(d_dst.read(want.size()), want) << "gather_rows " << what;

                // scatter: dst[rows[i]] = src[i] for rows[i] >= 0 (distinct), over a random destination.
                const int64_t dst_rows = 17;
                std::vector<int32_t> perm(sz(dst_rows));
                for (int64_t i = 0; i < dst_rows; ++i) perm[sz(i)] = static_cast<int32_t>(i);
                std::shuffle(perm.begin(), perm.end(), rng);
                std::vector<int32_t> srows(perm.begin(), perm.begin() + n);
                srows[2] = -1;
                srows[sz(n - 1)] = -5;
                const std::vector<uint8_t> dst0 = random_bytes(sz(dst_rows) * row_bytes, 99);
                std::vector<uint8_t> want_s = dst0;
                std::vector<uint8_t> src_n(src.begin(), src.begin() + static_cast<int64_t>(sz(n) * row_bytes));
                cpu.scatter_rows(host_view(src_n.data(), et.dtype, {n, d}), host_view(srows.data(), DType::kI32, {n}),
                                 host_view(want_s.data(), et.dtype, {dst_rows, d}));
                OffsetBuffer d_src_n(src_n, off), d_dst_s(dst0, off);
                DeviceBuffer d_srows = to_device(srows);
                ASSERT_EQ(cuda::scatter_rows(d_src_n.ptr(), d_srows.as<int32_t>(), n, d, et.bytes, d_dst_s.ptr(),
                                             dst_rows, flag.as<int32_t>(), nullptr),
                          cudaSuccess);
                ASSERT_EQ(d_dst_s.read(want_s.size()), want_s) << "scatter_rows " << what;
                EXPECT_EQ(read_flag(flag), 0) << what;
            }
        }
    }
}

TEST(CudaOpsRows, GatherAndScatterRowsBadIndicesRaiseFlag) {
    MEMRA_SKIP_WITHOUT_GPU();
    const int64_t d = 5;
    const std::vector<int32_t> src = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};  // [2, 5]
    DeviceBuffer d_src = to_device(src);
    // gather: row 2 and -1 are outside [0, 2): zero rows.
    const std::vector<int32_t> rows = {1, 2, -1, 0};
    DeviceBuffer d_rows = to_device(rows), d_dst(rows.size() * d * 4);
    DeviceBuffer flag = zero_flag();
    ASSERT_EQ(cuda::gather_rows(d_src.as<void>(), 2, d_rows.as<int32_t>(), 4, d, 4, d_dst.as<void>(),
                                flag.as<int32_t>(), nullptr),
              cudaSuccess);
    const std::vector<int32_t> want = {6, 7, 8, 9, 10, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5};
    EXPECT_EQ(from_device<int32_t>(d_dst, want.size()), want);
    EXPECT_EQ(read_flag(flag), 1);
    // scatter: row 3 is outside a 3-row destination: skipped; -1 skipped without a flag.
    DeviceBuffer flag2 = zero_flag();
    const std::vector<int32_t> srows = {3, 0};
    const std::vector<int32_t> dst0(15, -7);
    DeviceBuffer d_srows = to_device(srows), d_sdst = to_device(dst0);
    ASSERT_EQ(cuda::scatter_rows(d_src.as<void>(), d_srows.as<int32_t>(), 2, d, 4, d_sdst.as<void>(), 3,
                                 flag2.as<int32_t>(), nullptr),
              cudaSuccess);
    const std::vector<int32_t> want_s = {6, 7, 8, 9, 10, -7, -7, -7, -7, -7, -7, -7, -7, -7, -7};
    EXPECT_EQ(from_device<int32_t>(d_sdst, want_s.size()), want_s);
    EXPECT_EQ(read_flag(flag2), 1);
}

TEST(CudaOpsRows, ScatterIdsMatchesCpuLaterPairWins) {
    MEMRA_SKIP_WITHOUT_GPU();
    cpu::CpuBackend cpu(1, Numerics::kDevice);
    std::mt19937 rng(21);
    for (int64_t n_pairs : {1, 7, 300}) {
        const int64_t n_tokens = 40, n_dst = 25;
        std::vector<SampledToken> tokens(sz(n_tokens));
        for (auto &t : tokens) {
            t.id = static_cast<int32_t>(rng() % 200000);
            t.has_logprobs = static_cast<int32_t>(rng() % 2);
            t.logprobs.chosen = -1.5f;
        }
        std::vector<int32_t> pairs(sz(2 * n_pairs));
        for (int64_t i = 0; i < n_pairs; ++i) {
            pairs[sz(2 * i)] = static_cast<int32_t>(rng() % n_tokens);
            pairs[sz(2 * i + 1)] = static_cast<int32_t>(rng() % n_dst);  // duplicates: the later pair wins
        }
        std::vector<int32_t> dst0(sz(n_dst));
        for (auto &v : dst0) v = -static_cast<int32_t>(rng() % 100) - 1;
        std::vector<int32_t> want = dst0;
        cpu.scatter_ids(host_view(tokens.data(), DType::kU8, {n_tokens * static_cast<int64_t>(sizeof(SampledToken))}),
                        host_view(pairs.data(), DType::kI32, {n_pairs, 2}), host_view(want.data(), DType::kI32, {n_dst}));
        DeviceBuffer d_tok(tokens.size() * sizeof(SampledToken));
        d_tok.upload(tokens.data());
        DeviceBuffer d_pairs = to_device(pairs), d_dst = to_device(dst0);
        DeviceBuffer flag = zero_flag();
        ASSERT_EQ(cuda::scatter_ids(d_tok.as<void>(), n_tokens, sizeof(SampledToken), d_pairs.as<int32_t>(), n_pairs,
                                    d_dst.as<int32_t>(), n_dst, flag.as<int32_t>(), nullptr),
                  cudaSuccess);
        EXPECT_EQ(from_device<int32_t>(d_dst, want.size()), want) << "scatter_ids pairs " << n_pairs;
        EXPECT_EQ(read_flag(flag), 0);
    }
    // Bad pairs are skipped with the flag raised; a bad later pair does not hide a good earlier one.
    std::vector<SampledToken> tokens(3);
    tokens[0].id = 10;
    tokens[1].id = 11;
    tokens[2].id = 12;
    const std::vector<int32_t> pairs = {0, 0, 3, 1, 1, 2, 2, 0, 1, 0, 0, -1, 7, 1};  // (src, dst) x 7
    DeviceBuffer d_tok(tokens.size() * sizeof(SampledToken));
    d_tok.upload(tokens.data());
    const std::vector<int32_t> dst0 = {-1, -1, -1};
    DeviceBuffer d_pairs = to_device(pairs), d_dst = to_device(dst0);
    DeviceBuffer flag = zero_flag();
    ASSERT_EQ(cuda::scatter_ids(d_tok.as<void>(), 3, sizeof(SampledToken), d_pairs.as<int32_t>(), 7,
                                d_dst.as<int32_t>(), 3, flag.as<int32_t>(), nullptr),
              cudaSuccess);
    EXPECT_EQ(from_device<int32_t>(d_dst, 3), (std::vector<int32_t>{11, -1, 11}));
    EXPECT_EQ(read_flag(flag), 1);
}

TEST(CudaOpsRows, ConcatColsMatchesCpu) {
    MEMRA_SKIP_WITHOUT_GPU();
    cpu::CpuBackend cpu(1, Numerics::kDevice);
    for (auto [da, db] : {std::pair<int64_t, int64_t>{1, 1}, {128, 7}, {3, 4096}, {4096, 128}, {5, 0}}) {
        for (int64_t off : {0, 4}) {
            const int64_t n = 11;
            const std::vector<uint8_t> a = random_bytes(sz(n * da * 4), static_cast<uint32_t>(da));
            const std::vector<uint8_t> b = random_bytes(sz(n * db * 4), static_cast<uint32_t>(db) + 1u);
            std::vector<uint8_t> want(sz(n * (da + db) * 4));
            std::vector<uint8_t> ac = a, bc = b;
            cpu.concat_cols(host_view(ac.data(), DType::kF32, {n, da}), host_view(bc.data(), DType::kF32, {n, db}),
                            host_view(want.data(), DType::kF32, {n, da + db}));
            OffsetBuffer d_a(a, off), d_b(b, 0), d_out(std::vector<uint8_t>(want.size(), 0), off);
            ASSERT_EQ(cuda::concat_cols(d_a.ptr(), da, d_b.ptr(), db, n, 4, d_out.ptr(), nullptr), cudaSuccess);
            ASSERT_EQ(d_out.read(want.size()), want) << "concat_cols f32 " << da << " + " << db << " offset " << off;
        }
    }
    // Element sizes the CPU op does not take: against a plain host loop (the same definition).
    for (int64_t eb : {1, 2, 8, 12}) {
        const int64_t n = 5, da = 3, db = 9;
        const std::vector<uint8_t> a = random_bytes(sz(n * da * eb), 1), b = random_bytes(sz(n * db * eb), 2);
        std::vector<uint8_t> want;
        for (int64_t t = 0; t < n; ++t) {
            want.insert(want.end(), a.begin() + t * da * eb, a.begin() + (t + 1) * da * eb);
            want.insert(want.end(), b.begin() + t * db * eb, b.begin() + (t + 1) * db * eb);
        }
        DeviceBuffer d_a = to_device(a), d_b = to_device(b), d_out(want.size());
        ASSERT_EQ(cuda::concat_cols(d_a.as<void>(), da, d_b.as<void>(), db, n, eb, d_out.as<void>(), nullptr),
                  cudaSuccess);
        EXPECT_EQ(from_device<uint8_t>(d_out, want.size()), want) << "concat_cols element bytes " << eb;
    }
}

TEST(CudaOpsRows, JoinColShardsMatchesCpu) {
    MEMRA_SKIP_WITHOUT_GPU();
    cpu::CpuBackend cpu(1, Numerics::kDevice);
    for (const ElemType et : kCopyTypes) {
        for (int64_t n_shards : {1, 2, 4, 8}) {
            for (int64_t w : {1, 3, 1000}) {
                const int64_t n = 6;
                std::vector<uint8_t> shards = random_bytes(sz(n_shards * n * w * et.bytes),
                                                           static_cast<uint32_t>(n_shards * 100 + w));
                std::vector<uint8_t> want(shards.size());
                cpu.join_col_shards(host_view(shards.data(), et.dtype, {n_shards, n, w}),
                                    host_view(want.data(), et.dtype, {n, n_shards * w}));
                DeviceBuffer d_sh = to_device(shards), d_out(want.size());
                ASSERT_EQ(cuda::join_col_shards(d_sh.as<void>(), n_shards, n, w, et.bytes, d_out.as<void>(), nullptr),
                          cudaSuccess);
                ASSERT_EQ(from_device<uint8_t>(d_out, want.size()), want)
                    << "join_col_shards bytes " << et.bytes << " shards " << n_shards << " w " << w;
            }
        }
    }
}

// ---- Arguments ----

TEST(CudaOpsRows, LaunchersRejectBadArguments) {
    MEMRA_SKIP_WITHOUT_GPU();
    DeviceBuffer a(1024), b(1024), c(1024);
    float *fa = a.as<float>();
    float *fb = b.as<float>();
    float *fc = c.as<float>();
    int32_t *ia = a.as<int32_t>();
    EXPECT_EQ(cuda::embedding(fa, DType::kF16, 4, 4, ia, 1, fb, nullptr, nullptr), cudaErrorInvalidValue);
    EXPECT_EQ(cuda::embedding(fa, DType::kF32, 0, 4, ia, 1, fb, nullptr, nullptr), cudaErrorInvalidValue);
    EXPECT_EQ(cuda::rms_norm(fa, 2, 0, DType::kF32, fb, 1e-5f, fc, nullptr), cudaErrorInvalidValue);
    EXPECT_EQ(cuda::rms_norm(fa, 2, 4, DType::kF8E4M3, fb, 1e-5f, fc, nullptr), cudaErrorInvalidValue);
    EXPECT_EQ(cuda::rms_norm(fa, -1, 4, DType::kF32, fb, 1e-5f, fc, nullptr), cudaErrorInvalidValue);
    EXPECT_EQ(cuda::rms_norm_heads(fa, 2, 7, 2, 4, DType::kBF16, fb, 1e-5f, nullptr), cudaErrorInvalidValue);
    EXPECT_EQ(cuda::add_rms_norm(fa, fb, 2, 4, DType::kF32, fb, 1e-5f, fc, fc, nullptr), cudaErrorInvalidValue);
    EXPECT_EQ(cuda::rope(fa, fb, 10, 3, fc, 1, 8, 1, 5, a.as<int64_t>(), nullptr, nullptr), cudaErrorInvalidValue);
    EXPECT_EQ(cuda::swiglu(fa, fb, 4, 2, 4, -1.0f, fc, nullptr), cudaErrorInvalidValue);
    EXPECT_EQ(cuda::swiglu(fa, fb, 3, 2, 4, 0.0f, fc, nullptr), cudaErrorInvalidValue);
    EXPECT_EQ(cuda::canonical_combine(fa, 3, 4, fb, nullptr), cudaErrorInvalidValue);
    EXPECT_EQ(cuda::moe_combine(fa, fb, 4, ia, fb, nullptr, 2, 0, 4, fc, nullptr, nullptr), cudaErrorInvalidValue);
    EXPECT_EQ(cuda::gather_rows(fa, 4, ia, 2, 4, 0, fb, nullptr, nullptr), cudaErrorInvalidValue);
    EXPECT_EQ(cuda::scatter_rows(fa, nullptr, 2, 4, 4, fb, 4, nullptr, nullptr), cudaErrorInvalidValue);
    EXPECT_EQ(cuda::scatter_ids(fa, 4, 6, ia, 1, b.as<int32_t>(), 4, nullptr, nullptr), cudaErrorInvalidValue);
    EXPECT_EQ(cuda::concat_cols(fa, -1, fb, 2, 2, 4, fc, nullptr), cudaErrorInvalidValue);
    EXPECT_EQ(cuda::join_col_shards(fa, 2, 2, 4, 0, fb, nullptr), cudaErrorInvalidValue);
    // No work: nothing launched, even with null pointers.
    EXPECT_EQ(cuda::rms_norm(nullptr, 0, 4, DType::kF32, nullptr, 1e-5f, nullptr, nullptr), cudaSuccess);
    EXPECT_EQ(cuda::gather_rows(nullptr, 0, nullptr, 0, 4, 4, nullptr, nullptr, nullptr), cudaSuccess);
    EXPECT_EQ(cuda::moe_combine(nullptr, nullptr, 0, nullptr, nullptr, nullptr, 0, 8, 4, nullptr, nullptr, nullptr),
              cudaSuccess);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

}  // namespace
}  // namespace memra
