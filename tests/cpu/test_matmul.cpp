// CPU matmul: bits against a scalar reference of the canonical K loop written here from matmul.h's
// definition alone, accuracy against float64, exact widening of every bf16/f16/fp8 pattern, fp8 edge
// blocks and unaligned K ranges, invariance to threads (D5), token count (D2) and TP degree (D3), the row / K
// windows of weights a TP rank holds, and the expert ranges of banks (experts whole, never split by width).
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "backend/cpu/matmul.h"
#include "core/float_formats.h"
#include "core/fp8_block.h"
#include "cpu/ops_test_util.h"

// Counts every allocation in this test executable, so a test can show that the kernels allocate nothing
// (matmul.h: callers pass all workspaces).
#include "alloc_counter.h"

namespace memra::cpu {
namespace {

constexpr DType kAllWeightDTypes[] = {DType::kF32, DType::kBF16, DType::kF16, DType::kF8E4M3};

// A weight owned by the test: stored bytes plus the exact f32 value of every stored element (before any
// fp8 scale), decoded with core/float_formats.h, and the fp8 scale grid.
struct TestWeight {
    DType dtype = DType::kBF16;
    int64_t rows = 0;
    int64_t cols = 0;
    std::vector<uint8_t> bytes;   // [rows, cols] dtype
    std::vector<float> scale;     // [ceil(rows/128), ceil(cols/128)] f32 (fp8 only)
    std::vector<float> elem;      // [rows, cols] f32, exact stored values (unscaled)

    WeightRef ref() const { return test::weight_view(dtype, bytes.data(), rows, cols, scale.data()); }
    float scale_at(int64_t r, int64_t c) const {
        return scale[static_cast<size_t>((r / 128) * ((cols + 127) / 128) + c / 128)];
    }
};

std::vector<float> random_floats(size_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> dist(lo, hi);
    std::vector<float> v(n);
    for (float &f : v) f = dist(rng);
    return v;
}

TestWeight make_weight(DType dtype, int64_t rows, int64_t cols, uint32_t seed) {
    TestWeight w;
    w.dtype = dtype;
    w.rows = rows;
    w.cols = cols;
    const size_t n = static_cast<size_t>(rows * cols);
    // Weights spanning a few binades, as trained weights do.
    std::vector<float> f = random_floats(n, seed);
    std::mt19937 rng(seed + 1000);
    for (float &v : f) v = std::ldexp(v, -static_cast<int>(rng() % 6));
    w.elem.resize(n);
    switch (dtype) {
        case DType::kF32:
            w.bytes.assign(reinterpret_cast<const uint8_t *>(f.data()),
                           reinterpret_cast<const uint8_t *>(f.data() + n));
            w.elem = f;
            break;
        case DType::kBF16:
        case DType::kF16: {
            std::vector<uint16_t> h(n);
            for (size_t i = 0; i < n; ++i) {
                h[i] = dtype == DType::kBF16 ? f32_to_bf16(f[i]) : f32_to_f16(f[i]);
                w.elem[i] = dtype == DType::kBF16 ? bf16_to_f32(h[i]) : f16_to_f32(h[i]);
            }
            w.bytes.assign(reinterpret_cast<const uint8_t *>(h.data()),
                           reinterpret_cast<const uint8_t *>(h.data() + n));
            break;
        }
        default: {
            w.bytes.resize(n);
            w.scale.resize(static_cast<size_t>(fp8_scale_blocks(rows) * fp8_scale_blocks(cols)));
            quantize_fp8_block(f.data(), rows, cols, w.bytes.data(), w.scale.data());
            for (size_t i = 0; i < n; ++i) w.elem[i] = fp8_e4m3_to_f32(w.bytes[i]);
            break;
        }
    }
    return w;
}

// The 16-lane tree, written recursively: sum(l[a..b)) = sum(first half) + sum(second half).
float ref_tree(const float *l, int a, int b) {
    if (b - a == 1) return l[a];
    const int mid = (a + b) / 2;
    const float left = ref_tree(l, a, mid);
    const float right = ref_tree(l, mid, b);
    return left + right;
}

// The canonical K loop of matmul.h, one element at a time. x is indexed by absolute K position.
float ref_dot(const float *x, const TestWeight &w, int64_t n, int64_t k0, int64_t k1) {
    float sum = 0.0f;
    int64_t c0 = k0;
    while (c0 < k1) {
        int64_t c1 = (c0 / 128 + 1) * 128;
        if (c1 > k1) c1 = k1;
        float lane[16] = {};
        for (int64_t k = c0; k < c1; ++k) {
            const float product = x[k] * w.elem[static_cast<size_t>(n * w.cols + k)];
            lane[(k - c0) % 16] = lane[(k - c0) % 16] + product;
        }
        float chunk = ref_tree(lane, 0, 16);
        if (w.dtype == DType::kF8E4M3) chunk = chunk * w.scale_at(n, c0);
        sum = sum + chunk;
        c0 = c1;
    }
    return sum;
}

// y_ref: [n_tokens, rows] for the whole K.
std::vector<float> ref_matmul(const std::vector<float> &x, int64_t n_tokens, const TestWeight &w) {
    std::vector<float> y(static_cast<size_t>(n_tokens * w.rows));
    for (int64_t t = 0; t < n_tokens; ++t) {
        for (int64_t n = 0; n < w.rows; ++n) {
            y[static_cast<size_t>(t * w.rows + n)] = ref_dot(x.data() + t * w.cols, w, n, 0, w.cols);
        }
    }
    return y;
}

std::vector<float> run_matmul(int threads, const std::vector<float> &x, int64_t n_tokens, const WeightRef &w) {
    ThreadPool pool(threads);
    std::vector<float> y(static_cast<size_t>(n_tokens * w.rows), -7.0f);
    matmul(pool, x.data(), n_tokens, w, y.data());
    return y;
}

// Number of elements whose bits differ.
int64_t bit_mismatches(const std::vector<float> &a, const std::vector<float> &b) {
    EXPECT_EQ(a.size(), b.size());
    int64_t bad = 0;
    for (size_t i = 0; i < a.size() && i < b.size(); ++i) bad += f32_as_u32(a[i]) != f32_as_u32(b[i]);
    return bad;
}

struct Shape {
    int64_t n_tokens, rows, cols;
};

// Odd token counts (tile tails), odd row counts (row-pair tails), K with partial chunks and lane tails.
constexpr Shape kShapes[] = {{1, 1, 1}, {1, 33, 64}, {7, 45, 300}, {5, 96, 200}, {3, 300, 136}, {9, 19, 1280},
                             {70, 13, 144}};

TEST(CpuMatmul, BitsEqualScalarReferenceForEveryDtype) {
    for (DType dt : kAllWeightDTypes) {
        uint32_t seed = 10;
        for (const Shape &s : kShapes) {
            const TestWeight w = make_weight(dt, s.rows, s.cols, seed++);
            const std::vector<float> x = random_floats(static_cast<size_t>(s.n_tokens * s.cols), seed++);
            const std::vector<float> y = run_matmul(3, x, s.n_tokens, w.ref());
            EXPECT_EQ(bit_mismatches(y, ref_matmul(x, s.n_tokens, w)), 0)
                << dtype_name(dt) << " tokens " << s.n_tokens << " weight [" << s.rows << ", " << s.cols << "]";
        }
    }
}

TEST(CpuMatmul, ReferenceComparisonCanFail) {
    // The bit comparison above is sensitive to the order: the same products summed left to right
    // differ from the canonical K loop on many outputs.
    const TestWeight w = make_weight(DType::kBF16, 64, 1280, 3);
    const std::vector<float> x = random_floats(1280, 4);
    const std::vector<float> y = run_matmul(1, x, 1, w.ref());
    std::vector<float> sequential(64);
    for (int64_t n = 0; n < 64; ++n) {
        float s = 0.0f;
        for (int64_t k = 0; k < 1280; ++k) {
            s = s + x[static_cast<size_t>(k)] * w.elem[static_cast<size_t>(n * 1280 + k)];
        }
        sequential[static_cast<size_t>(n)] = s;
    }
    EXPECT_GT(bit_mismatches(y, sequential), 0);
}

TEST(CpuMatmul, AccuracyAgainstFloat64) {
    // |y - y64| / sum_k |x_k w_k| with y64 the float64 product of the same stored (dequantized) values.
    // Observed worst case 1.6e-8 (f32 1.2e-8, bf16 1.6e-8, f16 1.1e-8, fp8 1.5e-8; K = 4096, 1280 for fp8);
    // the bound is 1e-7, under one fp32 ulp (1.19e-7) of the magnitude sum.
    for (DType dt : kAllWeightDTypes) {
        const int64_t rows = 40;
        const int64_t cols = dt == DType::kF8E4M3 ? 1280 : 4096;
        const int64_t n_tokens = 3;
        const TestWeight w = make_weight(dt, rows, cols, 21);
        const std::vector<float> x = random_floats(static_cast<size_t>(n_tokens * cols), 22);
        const std::vector<float> y = run_matmul(2, x, n_tokens, w.ref());
        double worst = 0.0;
        for (int64_t t = 0; t < n_tokens; ++t) {
            for (int64_t n = 0; n < rows; ++n) {
                double exact = 0.0;
                double magnitude = 0.0;
                for (int64_t k = 0; k < cols; ++k) {
                    double wv = w.elem[static_cast<size_t>(n * cols + k)];
                    if (dt == DType::kF8E4M3) wv = static_cast<double>(fp8_block_dequant_one(
                                                       w.bytes[static_cast<size_t>(n * cols + k)], w.scale_at(n, k)));
                    const double p = static_cast<double>(x[static_cast<size_t>(t * cols + k)]) * wv;
                    exact += p;
                    magnitude += std::fabs(p);
                }
                const double err = std::fabs(static_cast<double>(y[static_cast<size_t>(t * rows + n)]) - exact);
                worst = std::max(worst, err / magnitude);
            }
        }
        EXPECT_LT(worst, 1e-7) << dtype_name(dt);
        EXPECT_GT(worst, 0.0) << dtype_name(dt);  // an fp32 result that is never rounded would be suspect
    }
}

// Widening inside the kernel equals core/float_formats.h for every stored pattern. Row p holds pattern p
// at column p % 16 of a full 16-wide group (so the vector path runs, in every lane position) and zeros
// elsewhere; with x = 1 the product is 1 * w exactly (a NaN comes back quieted, a zero as +0 since the
// sums start at +0).
void expect_widening_exact(DType dt, int64_t n_patterns) {
    const size_t elem = dtype_size(dt);
    std::vector<uint8_t> bytes(static_cast<size_t>(n_patterns) * 16 * elem, 0);
    std::vector<float> expected(static_cast<size_t>(n_patterns));
    for (int64_t p = 0; p < n_patterns; ++p) {
        uint8_t *at = bytes.data() + (p * 16 + p % 16) * static_cast<int64_t>(elem);
        if (dt == DType::kF8E4M3) {
            *at = static_cast<uint8_t>(p);
            expected[static_cast<size_t>(p)] = fp8_e4m3_to_f32(static_cast<uint8_t>(p));
        } else {
            const uint16_t h = static_cast<uint16_t>(p);
            std::memcpy(at, &h, 2);
            expected[static_cast<size_t>(p)] = dt == DType::kBF16 ? bf16_to_f32(h) : f16_to_f32(h);
        }
    }
    const std::vector<float> scale(static_cast<size_t>(fp8_scale_blocks(n_patterns)), 1.0f);
    WeightRef w;
    w.dtype = dt;
    w.data = bytes.data();
    w.rows = n_patterns;
    w.cols = 16;
    w.scale_inv = scale.data();
    const std::vector<float> y = run_matmul(2, std::vector<float>(16, 1.0f), 1, w);
    int64_t bad = 0;
    for (int64_t p = 0; p < n_patterns; ++p) {
        const float e = expected[static_cast<size_t>(p)];
        uint32_t want = f32_as_u32(e);
        if (std::isnan(e)) want |= 0x00400000u;
        if (e == 0.0f) want = 0;
        bad += f32_as_u32(y[static_cast<size_t>(p)]) != want;
    }
    EXPECT_EQ(bad, 0) << dtype_name(dt);
}

TEST(CpuMatmul, WideningIsExactForEveryPattern) {
    expect_widening_exact(DType::kBF16, 65536);
    expect_widening_exact(DType::kF16, 65536);
    expect_widening_exact(DType::kF8E4M3, 256);
}

TEST(CpuMatmul, Fp8ScalesFollowTheirBlocks) {
    // Edge blocks (rows, cols not multiples of 128) with a distinct power-of-two scale per block: every
    // output must equal the float64 sum of x * q * scale[r/128][c/128] to rounding, so a scale taken from a
    // neighbouring block (off by a factor >= 2) cannot pass. Also checked against the bit reference.
    for (const Shape &s : {Shape{2, 96, 200}, Shape{3, 300, 136}, Shape{1, 260, 390}}) {
        TestWeight w = make_weight(DType::kF8E4M3, s.rows, s.cols, 31);
        for (size_t i = 0; i < w.scale.size(); ++i) w.scale[i] = std::ldexp(1.0f, static_cast<int>(i % 7) - 3);
        const std::vector<float> x = random_floats(static_cast<size_t>(s.n_tokens * s.cols), 32, 0.5f, 1.0f);
        const std::vector<float> y = run_matmul(2, x, s.n_tokens, w.ref());
        EXPECT_EQ(bit_mismatches(y, ref_matmul(x, s.n_tokens, w)), 0);
        for (int64_t t = 0; t < s.n_tokens; ++t) {
            for (int64_t n = 0; n < s.rows; ++n) {
                double exact = 0.0;
                double magnitude = 0.0;
                for (int64_t k = 0; k < s.cols; ++k) {
                    const double p = static_cast<double>(x[static_cast<size_t>(t * s.cols + k)]) *
                                     w.elem[static_cast<size_t>(n * s.cols + k)] * w.scale_at(n, k);
                    exact += p;
                    magnitude += std::fabs(p);
                }
                ASSERT_LE(std::fabs(y[static_cast<size_t>(t * s.rows + n)] - exact), 1e-6 * magnitude)
                    << "weight [" << s.rows << ", " << s.cols << "] token " << t << " row " << n;
            }
        }
    }
}

TEST(CpuMatmul, ThreadCountNeverChangesBits) {
    // (tokens, rows) chosen so that both splits run: many rows -> rows split, few rows -> tokens split.
    for (DType dt : kAllWeightDTypes) {
        for (const Shape &s : {Shape{5, 300, 136}, Shape{64, 20, 200}, Shape{9, 64, 256}}) {
            const TestWeight w = make_weight(dt, s.rows, s.cols, 41);
            const std::vector<float> x = random_floats(static_cast<size_t>(s.n_tokens * s.cols), 42);
            const std::vector<float> y1 = run_matmul(1, x, s.n_tokens, w.ref());
            for (int threads : {2, 3, 8}) {
                EXPECT_EQ(bit_mismatches(y1, run_matmul(threads, x, s.n_tokens, w.ref())), 0)
                    << dtype_name(dt) << " threads " << threads << " tokens " << s.n_tokens << " rows " << s.rows;
            }
        }
    }
}

TEST(CpuMatmul, TokenCountNeverChangesBits) {
    // D2: a token's outputs do not depend on the other tokens, how many there are, or its slot in a tile.
    for (DType dt : kAllWeightDTypes) {
        const int64_t rows = 37;
        const int64_t cols = 264;
        const TestWeight w = make_weight(dt, rows, cols, 51);
        const std::vector<float> x = random_floats(static_cast<size_t>(13 * cols), 52);
        const std::vector<float> y13 = run_matmul(2, x, 13, w.ref());
        const std::vector<float> x7(x.begin() + 2 * cols, x.begin() + 9 * cols);  // tokens 2..8 in slots 0..6
        const std::vector<float> y7 = run_matmul(2, x7, 7, w.ref());
        for (int64_t t = 0; t < 7; ++t) {
            const std::vector<float> x1(x7.begin() + t * cols, x7.begin() + (t + 1) * cols);
            const std::vector<float> y1 = run_matmul(1, x1, 1, w.ref());
            const std::vector<float> row7(y7.begin() + t * rows, y7.begin() + (t + 1) * rows);
            const std::vector<float> row13(y13.begin() + (t + 2) * rows, y13.begin() + (t + 3) * rows);
            EXPECT_EQ(bit_mismatches(y1, row7), 0) << dtype_name(dt) << " token " << t;
            EXPECT_EQ(bit_mismatches(y1, row13), 0) << dtype_name(dt) << " token " << t;
        }
    }
}

TEST(CpuMatmul, EmptyProducts) {
    ThreadPool pool(2);
    const TestWeight w = make_weight(DType::kBF16, 5, 0, 1);
    std::vector<float> y(10, -1.0f);
    matmul(pool, nullptr, 2, w.ref(), y.data());
    for (float v : y) EXPECT_EQ(f32_as_u32(v), 0u);  // K = 0: the sum of nothing is +0
    const TestWeight w2 = make_weight(DType::kBF16, 5, 16, 1);
    matmul(pool, nullptr, 0, w2.ref(), nullptr);  // no tokens: nothing read or written
}

TEST(CpuMatmul, RowSliceAndRowRangeMatchTheFullProduct) {
    for (DType dt : kAllWeightDTypes) {
        const TestWeight w = make_weight(dt, 300, 136, 61);
        const int64_t n_tokens = 6;
        const std::vector<float> x = random_floats(static_cast<size_t>(n_tokens * 136), 62);
        const std::vector<float> full = run_matmul(2, x, n_tokens, w.ref());
        // Rows [37, 150) cross the fp8 scale-row boundary at 128 and start off it.
        const WeightRef slice = weight_row_slice(w.ref(), 37, 150);
        ASSERT_EQ(slice.rows, 113);
        const std::vector<float> ys = run_matmul(3, x, n_tokens, slice);
        const WeightRef nested = weight_row_slice(slice, 100, 113);  // rows [137, 150) of w
        const std::vector<float> yn = run_matmul(1, x, n_tokens, nested);
        // The same rows written into columns [5, 118) of a 130-wide output by matmul_rows.
        ThreadPool pool(2);
        std::vector<float> wide(static_cast<size_t>(n_tokens * 130), -3.0f);
        matmul_rows(pool, x.data(), n_tokens, w.ref(), 37, 150, wide.data() + 5, 130);
        int64_t bad = 0;
        for (int64_t t = 0; t < n_tokens; ++t) {
            for (int64_t i = 0; i < 130; ++i) {
                const float got = wide[static_cast<size_t>(t * 130 + i)];
                if (i < 5 || i >= 118) {
                    bad += got != -3.0f;
                } else {
                    bad += f32_as_u32(got) != f32_as_u32(full[static_cast<size_t>(t * 300 + 37 + i - 5)]);
                }
            }
            for (int64_t i = 0; i < 113; ++i) {
                bad += f32_as_u32(ys[static_cast<size_t>(t * 113 + i)]) !=
                       f32_as_u32(full[static_cast<size_t>(t * 300 + 37 + i)]);
            }
            for (int64_t i = 0; i < 13; ++i) {
                bad += f32_as_u32(yn[static_cast<size_t>(t * 13 + i)]) !=
                       f32_as_u32(full[static_cast<size_t>(t * 300 + 137 + i)]);
            }
        }
        EXPECT_EQ(bad, 0) << dtype_name(dt);
    }
}

TEST(CpuMatmul, ExpertOfABankEqualsTheStandaloneWeight) {
    for (DType dt : {DType::kBF16, DType::kF8E4M3}) {
        const int64_t n_experts = 3;
        std::vector<TestWeight> experts;
        for (int64_t e = 0; e < n_experts; ++e) {
            experts.push_back(make_weight(dt, 96, 200, 70 + static_cast<uint32_t>(e)));
        }
        std::vector<uint8_t> bank_bytes;
        std::vector<float> bank_scale;
        for (const TestWeight &e : experts) {
            bank_bytes.insert(bank_bytes.end(), e.bytes.begin(), e.bytes.end());
            bank_scale.insert(bank_scale.end(), e.scale.begin(), e.scale.end());
        }
        WeightBankRef bank;
        bank.dtype = dt;
        bank.data = bank_bytes.data();
        bank.n_experts = n_experts;
        bank.rows = 96;
        bank.cols = 200;
        bank.scale_inv = dt == DType::kF8E4M3 ? bank_scale.data() : nullptr;
        const std::vector<float> x = random_floats(4 * 200, 73);
        for (int64_t e = 0; e < n_experts; ++e) {
            const std::vector<float> y = run_matmul(2, x, 4, weight_bank_expert(bank, e));
            EXPECT_EQ(bit_mismatches(y, run_matmul(2, x, 4, experts[static_cast<size_t>(e)].ref())), 0)
                << dtype_name(dt) << " expert " << e;
            EXPECT_EQ(bit_mismatches(y, ref_matmul(x, 4, experts[static_cast<size_t>(e)])), 0);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Row-parallel products.

float ref_tree8(const float *p) { return ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7])); }

TEST(CpuMatmulCanonical, PartialsAndTreeMatchTheReference) {
    // K = 1280 with fp8 (the expert down_proj): blocks of 160, so block 1 is [160, 320) and starts
    // inside a 128 chunk. Also K = 2048 and 200 (blocks of 256 and 25) for every dtype.
    for (DType dt : kAllWeightDTypes) {
        for (const Shape &s : {Shape{3, 40, 1280}, Shape{5, 17, 2048}, Shape{2, 9, 200}}) {
            const TestWeight w = make_weight(dt, s.rows, s.cols, 81);
            const std::vector<float> x = random_floats(static_cast<size_t>(s.n_tokens * s.cols), 82);
            ThreadPool pool(3);
            const WeightRef wr = w.ref();
            const int64_t bs = canonical_block_size(wr);
            ASSERT_EQ(bs * 8, s.cols);
            std::vector<float> partials(static_cast<size_t>(8 * s.n_tokens * s.rows));
            matmul_block_partials(pool, x.data(), s.n_tokens, wr, 0, 8, partials.data());
            std::vector<float> ws(static_cast<size_t>(matmul_canonical_workspace_floats(s.n_tokens, wr)));
            std::vector<float> y(static_cast<size_t>(s.n_tokens * s.rows));
            matmul_canonical(pool, x.data(), s.n_tokens, wr, y.data(), ws.data());
            int64_t bad = 0;
            for (int64_t t = 0; t < s.n_tokens; ++t) {
                for (int64_t n = 0; n < s.rows; ++n) {
                    float p[8];
                    for (int64_t b = 0; b < 8; ++b) {
                        p[b] = ref_dot(x.data() + t * s.cols, w, n, b * bs, (b + 1) * bs);
                        bad += f32_as_u32(p[b]) !=
                               f32_as_u32(partials[static_cast<size_t>((b * s.n_tokens + t) * s.rows + n)]);
                    }
                    bad += f32_as_u32(ref_tree8(p)) != f32_as_u32(y[static_cast<size_t>(t * s.rows + n)]);
                }
            }
            EXPECT_EQ(bad, 0) << dtype_name(dt) << " K " << s.cols;
        }
    }
}

TEST(CpuMatmulCanonical, TensorParallelSubtreesEqualTp1Bits) {
    // Each of tp ranks holds its activation shard (its 8/tp blocks), computes its block partials, reduces
    // its aligned subtree; the subtree sums (as after an all-gather) finish the tree. Must equal TP = 1.
    for (DType dt : {DType::kBF16, DType::kF8E4M3, DType::kF32}) {
        const int64_t n_tokens = 5;
        const int64_t rows = 48;
        const int64_t cols = 1280;
        const TestWeight w = make_weight(dt, rows, cols, 91);
        const WeightRef wr = w.ref();
        const std::vector<float> x = random_floats(static_cast<size_t>(n_tokens * cols), 92);
        const int64_t m = n_tokens * rows;
        ThreadPool pool(2);
        std::vector<float> ws(static_cast<size_t>(matmul_canonical_workspace_floats(n_tokens, wr)));
        std::vector<float> y1(static_cast<size_t>(m));
        matmul_canonical(pool, x.data(), n_tokens, wr, y1.data(), ws.data());

        for (int64_t tp : {1, 2, 4, 8}) {
            const int64_t per_rank = 8 / tp;
            const int64_t k_local = per_rank * (cols / 8);
            std::vector<float> gathered(static_cast<size_t>(tp * m));  // [tp, n_tokens, rows]
            for (int64_t rank = 0; rank < tp; ++rank) {
                ThreadPool rank_pool(static_cast<int>(1 + rank % 3));  // ranks may differ in thread count
                std::vector<float> x_local(static_cast<size_t>(n_tokens * k_local));
                for (int64_t t = 0; t < n_tokens; ++t) {
                    std::memcpy(x_local.data() + t * k_local, x.data() + t * cols + rank * k_local,
                                static_cast<size_t>(k_local) * sizeof(float));
                }
                std::vector<float> partials(static_cast<size_t>(per_rank * m));
                const int64_t b0 = rank * per_rank;
                matmul_block_partials(rank_pool, x_local.data(), n_tokens, wr, b0, b0 + per_rank, partials.data());
                canonical_tree_reduce(partials.data(), b0, b0 + per_rank, m, gathered.data() + rank * m);
            }
            std::vector<float> y_tp(static_cast<size_t>(m));
            canonical_tree_combine(gathered.data(), tp, m, y_tp.data());
            EXPECT_EQ(bit_mismatches(y_tp, y1), 0) << dtype_name(dt) << " tp " << tp;
        }

        // The tree is what makes this exact: adding the same 8 partials left to right differs.
        std::vector<float> naive(static_cast<size_t>(m));
        matmul_block_partials(pool, x.data(), n_tokens, wr, 0, 8, ws.data());
        for (int64_t i = 0; i < m; ++i) {
            float s = 0.0f;
            for (int64_t b = 0; b < 8; ++b) s = s + ws[static_cast<size_t>(b * m + i)];
            naive[static_cast<size_t>(i)] = s;
        }
        EXPECT_GT(bit_mismatches(naive, y1), 0) << dtype_name(dt);
    }
}

TEST(CpuMatmulCanonical, CanonicalDiffersFromThePlainMatmul) {
    // The row-parallel order is its own definition (8 block partials, then the tree), not the plain
    // K loop: the two disagree on some outputs, so a caller mixing them would be caught by D3 gates.
    const TestWeight w = make_weight(DType::kBF16, 64, 1280, 95);
    const std::vector<float> x = random_floats(2 * 1280, 96);
    ThreadPool pool(2);
    std::vector<float> ws(static_cast<size_t>(matmul_canonical_workspace_floats(2, w.ref())));
    std::vector<float> yc(128);
    matmul_canonical(pool, x.data(), 2, w.ref(), yc.data(), ws.data());
    EXPECT_GT(bit_mismatches(yc, run_matmul(2, x, 2, w.ref())), 0);
}

// ---------------------------------------------------------------------------------------------
// Windows of a weight or bank: what a tensor-parallel rank holds (row stride, absolute K origin, full K;
// whole experts).

TEST(CpuMatmulWindow, KWindowsGiveTheRankSubtreesOfTheWholeProduct) {
    // K = 1280: blocks of 160 that start inside 128-wide chunks (and fp8 scale tiles). Each TP rank holds
    // a K window (and, for the row case, a row window too, so ld != cols and row_offset != 0 together).
    for (DType dt : kAllWeightDTypes) {
        const int64_t n_tokens = 3;
        const int64_t rows = 300;
        const int64_t cols = 1280;
        const TestWeight w = make_weight(dt, rows, cols, 101);
        const WeightRef wr = w.ref();
        const std::vector<float> x = random_floats(static_cast<size_t>(n_tokens * cols), 102);
        ThreadPool pool(2);
        std::vector<float> ws(static_cast<size_t>(matmul_canonical_workspace_floats(n_tokens, wr)));
        std::vector<float> whole(static_cast<size_t>(n_tokens * rows));
        matmul_canonical(pool, x.data(), n_tokens, wr, whole.data(), ws.data());
        std::vector<float> all_partials(static_cast<size_t>(8 * n_tokens * rows));
        matmul_block_partials(pool, x.data(), n_tokens, wr, 0, 8, all_partials.data());
        const int64_t bs = cols / 8;
        for (int64_t tp : {1, 2, 4, 8}) {
            const int64_t per = 8 / tp;
            const int64_t k_local = per * bs;
            const int64_t m = n_tokens * rows;
            std::vector<float> gathered(static_cast<size_t>(tp * m));
            int64_t partial_bad = 0;
            for (int64_t rank = 0; rank < tp; ++rank) {
                const WeightRef win = weight_k_window(wr, rank * k_local, (rank + 1) * k_local);
                ASSERT_EQ(win.cols, k_local);
                ASSERT_EQ(weight_ld(win), cols);
                ASSERT_EQ(weight_canonical_blocks(win).begin, rank * per);
                std::vector<float> x_local(static_cast<size_t>(n_tokens * k_local));
                for (int64_t t = 0; t < n_tokens; ++t) {
                    std::memcpy(x_local.data() + t * k_local, x.data() + t * cols + rank * k_local,
                                static_cast<size_t>(k_local) * sizeof(float));
                }
                std::vector<float> ws_local(static_cast<size_t>(matmul_canonical_workspace_floats(n_tokens, win)));
                ASSERT_EQ(static_cast<int64_t>(ws_local.size()), per * m);
                matmul_canonical(pool, x_local.data(), n_tokens, win, gathered.data() + rank * m, ws_local.data());
                // Its block partials are the whole matrix's partials of those blocks, bit for bit.
                for (int64_t i = 0; i < per * m; ++i) {
                    partial_bad += f32_as_u32(ws_local[static_cast<size_t>(i)]) !=
                                   f32_as_u32(all_partials[static_cast<size_t>(rank * per * m + i)]);
                }
            }
            std::vector<float> y(static_cast<size_t>(m));
            canonical_tree_combine(gathered.data(), tp, m, y.data());
            EXPECT_EQ(partial_bad, 0) << dtype_name(dt) << " tp " << tp;
            EXPECT_EQ(bit_mismatches(y, whole), 0) << dtype_name(dt) << " tp " << tp;

            // A row window of the K window (rows [37, 150): off the fp8 scale-row boundary) equals those rows.
            const WeightRef rk = weight_row_slice(weight_k_window(wr, 0, k_local), 37, 150);
            std::vector<float> x0(static_cast<size_t>(n_tokens * k_local));
            for (int64_t t = 0; t < n_tokens; ++t) {
                std::memcpy(x0.data() + t * k_local, x.data() + t * cols, static_cast<size_t>(k_local) * sizeof(float));
            }
            std::vector<float> ws_rk(static_cast<size_t>(matmul_canonical_workspace_floats(n_tokens, rk)));
            std::vector<float> y_rk(static_cast<size_t>(n_tokens * 113));
            matmul_canonical(pool, x0.data(), n_tokens, rk, y_rk.data(), ws_rk.data());
            int64_t bad = 0;
            for (int64_t t = 0; t < n_tokens; ++t) {
                for (int64_t n = 0; n < 113; ++n) {
                    bad += f32_as_u32(y_rk[static_cast<size_t>(t * 113 + n)]) !=
                           f32_as_u32(gathered[static_cast<size_t>(t * rows + 37 + n)]);
                }
            }
            EXPECT_EQ(bad, 0) << dtype_name(dt) << " row window of tp " << tp << " rank 0";
        }
    }
}

TEST(CpuMatmulWindow, ExpertWindowsEqualThoseExpertsOfTheWholeBank) {
    // A TP rank's routed experts: experts [e0, e1) of the bank, each whole (never split by width). Every held
    // expert's product equals the whole bank's product for that expert and the scalar reference, fp8 scale
    // grids following their experts; a window of a window keeps counting global expert indices.
    for (DType dt : {DType::kBF16, DType::kF8E4M3}) {
        const int64_t n_experts = 5;
        const int64_t rows = 160;  // crosses an fp8 scale row
        const int64_t cols = 264;  // a partial last chunk
        std::vector<TestWeight> experts;
        std::vector<uint8_t> bytes;
        std::vector<float> scale;
        for (int64_t e = 0; e < n_experts; ++e) {
            experts.push_back(make_weight(dt, rows, cols, 110 + static_cast<uint32_t>(e)));
            bytes.insert(bytes.end(), experts.back().bytes.begin(), experts.back().bytes.end());
            scale.insert(scale.end(), experts.back().scale.begin(), experts.back().scale.end());
        }
        WeightBankRef bank;
        bank.dtype = dt;
        bank.data = bytes.data();
        bank.n_experts = n_experts;
        bank.rows = rows;
        bank.cols = cols;
        bank.scale_inv = dt == DType::kF8E4M3 ? scale.data() : nullptr;
        const int64_t n_tokens = 5;
        const std::vector<float> x = random_floats(static_cast<size_t>(n_tokens * cols), 115);
        const WeightBankRef owned = weight_bank_window(bank, 1, 4);
        EXPECT_EQ(owned.first_expert, 1);
        EXPECT_EQ(owned.n_experts, 3);
        EXPECT_EQ(owned.rows, rows);
        EXPECT_EQ(owned.cols, cols);
        const WeightBankRef nested = weight_bank_window(owned, 1, 3);  // global experts [2, 4)
        EXPECT_EQ(nested.first_expert, 2);
        EXPECT_EQ(nested.n_experts, 2);
        for (int64_t e = 0; e < n_experts; ++e) {
            const std::vector<float> whole = run_matmul(2, x, n_tokens, weight_bank_expert(bank, e));
            EXPECT_EQ(bit_mismatches(whole, ref_matmul(x, n_tokens, experts[static_cast<size_t>(e)])), 0)
                << dtype_name(dt) << " expert " << e;
            if (e >= 1 && e < 4) {
                EXPECT_EQ(bit_mismatches(run_matmul(3, x, n_tokens, weight_bank_expert(owned, e - 1)), whole), 0)
                    << dtype_name(dt) << " owned expert " << e;
            }
            if (e >= 2 && e < 4) {
                EXPECT_EQ(bit_mismatches(run_matmul(1, x, n_tokens, weight_bank_expert(nested, e - 2)), whole), 0)
                    << dtype_name(dt) << " nested expert " << e;
            }
        }
        // The comparison can fail: a neighbouring expert's product differs.
        EXPECT_GT(bit_mismatches(run_matmul(2, x, n_tokens, weight_bank_expert(owned, 0)),
                                 run_matmul(2, x, n_tokens, weight_bank_expert(bank, 2))),
                  0);
    }
}

TEST(CpuMatmul, KernelsDoNotAllocate) {
    const int64_t before_probe = g_allocations.load();
    void *volatile probe = ::operator new(16);  // the counter sees allocations at all
    ::operator delete(probe);
    ASSERT_EQ(g_allocations.load(), before_probe + 1);

    ThreadPool pool(3);
    const TestWeight w = make_weight(DType::kF8E4M3, 70, 1280, 97);
    const WeightRef wr = w.ref();
    const int64_t n_tokens = 9;
    const std::vector<float> x = random_floats(static_cast<size_t>(n_tokens * 1280), 98);
    std::vector<float> y(static_cast<size_t>(n_tokens * 70));
    std::vector<float> ws(static_cast<size_t>(matmul_canonical_workspace_floats(n_tokens, wr)));
    std::vector<float> sums(static_cast<size_t>(2 * n_tokens * 70));
    const int64_t before = g_allocations.load();
    matmul(pool, x.data(), n_tokens, wr, y.data());
    matmul(pool, x.data(), 1, wr, y.data());
    matmul_rows(pool, x.data(), n_tokens, wr, 3, 60, y.data(), 70);
    matmul_block_partials(pool, x.data(), n_tokens, wr, 0, 8, ws.data());
    canonical_tree_reduce(ws.data(), 0, 4, n_tokens * 70, sums.data());
    canonical_tree_combine(sums.data(), 2, n_tokens * 70, y.data());
    matmul_canonical(pool, x.data(), n_tokens, wr, y.data(), ws.data());
    EXPECT_EQ(g_allocations.load() - before, 0);
}

// ---------------------------------------------------------------------------------------------
// Broken invariants abort with a message naming the problem.

TEST(CpuMatmulDeathTest, RefusesBrokenInvariants) {
    GTEST_FLAG_SET(death_test_style, "threadsafe");
    ThreadPool pool(1);
    const TestWeight w = make_weight(DType::kBF16, 4, 20, 1);  // K = 20: not a multiple of 8
    std::vector<float> buf(1024);
    EXPECT_DEATH(canonical_block_size(w.ref()), "K = 20 must be a positive multiple of the 8 canonical blocks");
    EXPECT_DEATH(matmul_block_partials(pool, buf.data(), 1, w.ref(), 0, 8, buf.data()), "K = 20");
    const TestWeight w8 = make_weight(DType::kBF16, 4, 64, 1);
    EXPECT_DEATH(matmul_block_partials(pool, buf.data(), 1, w8.ref(), 3, 3, buf.data()), "block range \\[3, 3\\)");
    EXPECT_DEATH(matmul_block_partials(pool, buf.data(), 1, w8.ref(), 2, 9, buf.data()), "block range \\[2, 9\\)");
    EXPECT_DEATH(canonical_tree_reduce(buf.data(), 1, 3, 4, buf.data()), "blocks \\[1, 3\\) are not an aligned");
    EXPECT_DEATH(canonical_tree_reduce(buf.data(), 0, 3, 4, buf.data()), "blocks \\[0, 3\\) are not an aligned");
    EXPECT_DEATH(canonical_tree_reduce(buf.data(), 8, 16, 4, buf.data()), "blocks \\[8, 16\\) are not an aligned");
    EXPECT_DEATH(canonical_tree_combine(buf.data(), 3, 4, buf.data()), "3 subtree sums, expected 1, 2, 4 or 8");

    WeightRef bad = w8.ref();
    bad.dtype = DType::kI8;
    EXPECT_DEATH(matmul(pool, buf.data(), 1, bad, buf.data()), "F32, BF16, F16 or F8_E4M3, got I8");
    WeightRef no_scale = make_weight(DType::kF8E4M3, 4, 64, 1).ref();
    no_scale.scale_inv = nullptr;
    EXPECT_DEATH(matmul(pool, buf.data(), 1, no_scale, buf.data()), "has no scale_inv");
    EXPECT_DEATH(matmul_rows(pool, buf.data(), 1, w8.ref(), 2, 5, buf.data(), 3), "output rows \\[2, 5\\)");
    EXPECT_DEATH(matmul_rows(pool, buf.data(), 1, w8.ref(), 0, 4, buf.data(), 3), "y_stride 3 is less than the 4");
    EXPECT_DEATH(weight_row_slice(w8.ref(), 3, 5), "row slice \\[3, 5\\) outside rows \\[0, 4\\)");
    WeightBankRef bank;
    bank.n_experts = 2;
    EXPECT_DEATH(weight_bank_expert(bank, 2), "expert 2 out of range \\[0, 2\\)");

    // Windows: column-parallel products need every K column; row-parallel ones whole aligned blocks.
    const TestWeight w16 = make_weight(DType::kBF16, 4, 128, 1);  // blocks of 16
    const WeightRef half = weight_k_window(w16.ref(), 64, 128);
    EXPECT_DEATH(matmul(pool, buf.data(), 1, half, buf.data()),
                 "a column-parallel product needs every K column, the weight holds K \\[64, 128\\) of 128");
    EXPECT_DEATH(matmul_block_partials(pool, buf.data(), 1, half, 0, 4, buf.data()),
                 "blocks \\[0, 4\\) are outside the held K \\[64, 128\\)");
    EXPECT_DEATH(matmul_canonical(pool, buf.data(), 1, weight_k_window(w16.ref(), 16, 64), buf.data(), buf.data()),
                 "holds blocks \\[1, 4\\), not an aligned subtree");
    EXPECT_DEATH(matmul_canonical(pool, buf.data(), 1, weight_k_window(w16.ref(), 8, 40), buf.data(), buf.data()),
                 "holds K \\[8, 40\\), not whole canonical blocks of 16");
    EXPECT_DEATH(weight_k_window(half, 32, 96), "K window \\[32, 96\\) outside the held K \\[64, 128\\)");
    WeightBankRef b2;
    b2.data = buf.data();
    b2.n_experts = 2;
    b2.rows = 4;
    b2.cols = 16;
    // Expert windows: non-empty and inside what the bank holds (a window of a window counts held experts).
    EXPECT_DEATH(weight_bank_window(b2, 1, 3), "weight bank window: experts \\[1, 3\\) outside \\[0, 2\\)");
    EXPECT_DEATH(weight_bank_window(b2, 1, 1), "experts \\[1, 1\\) outside \\[0, 2\\)");
    EXPECT_DEATH(weight_bank_window(b2, -1, 1), "experts \\[-1, 1\\) outside \\[0, 2\\)");
    EXPECT_DEATH(weight_bank_window(weight_bank_window(b2, 1, 2), 0, 2), "experts \\[0, 2\\) outside \\[0, 1\\)");
    EXPECT_DEATH(weight_bank_expert(weight_bank_window(b2, 1, 2), 1), "expert 1 out of range \\[0, 1\\)");
}

}  // namespace
}  // namespace memra::cpu
