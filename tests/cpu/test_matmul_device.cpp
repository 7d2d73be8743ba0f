// CPU device products (matmul.h, the device K loop): every instruction path this CPU has, forced one at a
// time, against a scalar reference written here from matmul.h's definition alone (FTZ/DAZ arithmetic
// emulated through long double, a different route from the portable path's double), including denormal
// inputs, products that underflow and sums that cross FLT_MIN; the activation rounding (bf16, e4m3 groups of
// 128) against a definition written here; invariance to threads, token count and TP K windows.
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "backend/cpu/matmul.h"
#include "core/float_formats.h"
#include "core/fp8_block.h"

#include "cpu/ops_test_util.h"

namespace memra::cpu {
namespace {

// Restores the best path when a test that forced another one ends.
using test::IsaGuard;
using test::supported_isas;

// ---- FTZ/DAZ arithmetic, emulated through long double (64-bit significand: the sum of two values of at
// most 24 significant bits, or of an exact 16-bit product, is rounded there at most once, harmlessly). ----
float daz(float v) { return std::fabs(v) < FLT_MIN ? std::copysign(0.0f, v) : v; }
float ftz(long double e) {
    if (std::isnan(e) || std::fabs(e) >= static_cast<long double>(FLT_MIN)) return static_cast<float>(e);
    const float scaled = static_cast<float>(e * 0x1p80L);  // rounding at unbounded exponent range
    return std::fabs(scaled) >= 0x1p-46f ? std::copysign(FLT_MIN, scaled) : std::copysign(0.0f, scaled);
}
float r_fma(float a, float b, float c) {
    return ftz(static_cast<long double>(daz(c)) + static_cast<long double>(daz(a)) * static_cast<long double>(daz(b)));
}
float r_add(float a, float b) { return ftz(static_cast<long double>(daz(a)) + static_cast<long double>(daz(b))); }
float r_mul(float a, float b) { return ftz(static_cast<long double>(daz(a)) * static_cast<long double>(daz(b))); }
float r_tree(const float *l, int a, int b) {
    if (b - a == 1) return l[a];
    const int mid = (a + b) / 2;
    return r_add(r_tree(l, a, mid), r_tree(l, mid, b));
}

// The rounded activations of the definition: values (bf16 or e4m3, as f32) and per-group scales.
struct Rounded {
    std::vector<float> val;    // [n, k]
    std::vector<float> scale;  // [n, ceil(k / 128)] (e4m3 only)
};

Rounded ref_round(const std::vector<float> &x, int64_t n, int64_t k, ActRounding act) {
    Rounded r;
    r.val.resize(x.size());
    const int64_t groups = (k + 127) / 128;
    r.scale.assign(static_cast<size_t>(n * groups), 1.0f);
    for (int64_t t = 0; t < n; ++t) {
        for (int64_t g = 0; g < groups; ++g) {
            const int64_t g0 = g * 128;
            const int64_t g1 = std::min(k, g0 + 128);
            float amax = 0.0f;
            for (int64_t i = g0; i < g1; ++i) {
                // Not std::fmax: glibc's returns NaN for a signaling NaN operand, and a NaN never wins here.
                const float a = std::fabs(x[static_cast<size_t>(t * k + i)]);
                if (!std::isnan(a)) amax = std::max(amax, a);
            }
            float scale = amax == 0.0f ? 1.0f : amax / 448.0f;
            if (scale == 0.0f) scale = std::ldexp(1.0f, -149);
            if (act == ActRounding::kE4m3x128) r.scale[static_cast<size_t>(t * groups + g)] = scale;
            for (int64_t i = g0; i < g1; ++i) {
                const float v = x[static_cast<size_t>(t * k + i)];
                r.val[static_cast<size_t>(t * k + i)] =
                    act == ActRounding::kBf16 ? bf16_to_f32(f32_to_bf16(v))
                                              : fp8_e4m3_to_f32(f32_to_fp8_e4m3(v / scale, Fp8Saturation::kSaturate));
            }
        }
    }
    return r;
}

struct Weight {
    DType dtype = DType::kBF16;
    int64_t rows = 0;
    int64_t cols = 0;
    std::vector<uint8_t> bytes;
    std::vector<float> elem;   // exact stored values (unscaled)
    std::vector<float> scale;  // fp8 only

    WeightRef ref(ActRounding act) const { return test::weight_view(dtype, bytes.data(), rows, cols, scale.data(), act); }
};

// A weight view with its 16-row panels (matmul.h WeightPanels), in storage the test owns; `panels` false: the
// plain view. The AVX512-BF16 path reads the panels where a view has them, every other path ignores them.
struct Viewed {
    std::vector<uint8_t> storage;
    WeightRef ref;
};
Viewed view(const WeightRef &w, bool panels) {
    Viewed v;
    v.ref = w;
    if (!panels) return v;
    v.storage.resize(static_cast<size_t>(device_panels_bytes(w)) + 64);
    uint8_t *at = v.storage.data() + (64 - reinterpret_cast<uintptr_t>(v.storage.data()) % 64) % 64;
    ThreadPool pool(2);
    v.ref = device_panels_fill(pool, w, at);
    return v;
}

// Weights over a few binades; `tiny` puts a share of them (bf16) at or below FLT_MIN.
Weight make_weight(DType dtype, int64_t rows, int64_t cols, uint32_t seed, bool tiny = false) {
    Weight w;
    w.dtype = dtype;
    w.rows = rows;
    w.cols = cols;
    const size_t n = static_cast<size_t>(rows * cols);
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    std::vector<float> f(n);
    for (float &v : f) {
        v = std::ldexp(dist(rng), -static_cast<int>(rng() % 6));
        if (tiny && rng() % 4 == 0) v = std::ldexp(v, -124 - static_cast<int>(rng() % 6));
    }
    w.elem.resize(n);
    if (dtype == DType::kBF16) {
        std::vector<uint16_t> h(n);
        for (size_t i = 0; i < n; ++i) {
            h[i] = f32_to_bf16(f[i]);
            w.elem[i] = bf16_to_f32(h[i]);
        }
        w.bytes.assign(reinterpret_cast<const uint8_t *>(h.data()), reinterpret_cast<const uint8_t *>(h.data() + n));
    } else {
        w.bytes.resize(n);
        w.scale.resize(static_cast<size_t>(fp8_scale_blocks(rows) * fp8_scale_blocks(cols)));
        quantize_fp8_block(f.data(), rows, cols, w.bytes.data(), w.scale.data());
        for (size_t i = 0; i < n; ++i) w.elem[i] = fp8_e4m3_to_f32(w.bytes[i]);
    }
    return w;
}

// The device K loop of matmul.h over [k0, k1) for every token and row.
std::vector<float> ref_device(const std::vector<float> &x, int64_t n, const Weight &w, ActRounding act, int64_t k0,
                              int64_t k1) {
    const Rounded xr = ref_round(x, n, w.cols, act);
    const bool e4m3 = act == ActRounding::kE4m3x128;
    const int64_t groups = (w.cols + 127) / 128;
    std::vector<float> y(static_cast<size_t>(n * w.rows));
    for (int64_t t = 0; t < n; ++t) {
        for (int64_t r = 0; r < w.rows; ++r) {
            float total = 0.0f;
            for (int64_t c0 = k0; c0 < k1;) {
                const int64_t c1 = e4m3 ? std::min(k1, (c0 / 128 + 1) * 128) : k1;
                float lanes[16] = {};
                for (int64_t g = c0; g < c1; g += 32) {
                    for (int j = 0; j < 16; ++j) {
                        for (int64_t k : {g + 2 * j + 1, g + 2 * j}) {
                            const float xv = k < c1 ? xr.val[static_cast<size_t>(t * w.cols + k)] : 0.0f;
                            const float wv = k < c1 ? w.elem[static_cast<size_t>(r * w.cols + k)] : 0.0f;
                            lanes[j] = r_fma(xv, wv, lanes[j]);
                        }
                    }
                }
                float chunk = r_tree(lanes, 0, 16);
                if (e4m3) {
                    const int64_t ci = c0 / 128;
                    const float sw = w.scale[static_cast<size_t>((r / 128) * groups + ci)];
                    chunk = r_mul(chunk, r_mul(xr.scale[static_cast<size_t>(t * groups + ci)], sw));
                }
                total = r_add(total, chunk);
                c0 = c1;
            }
            y[static_cast<size_t>(t * w.rows + r)] = total;
        }
    }
    return y;
}

std::vector<float> activations(int64_t n, int64_t k, uint32_t seed, bool tiny = false) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> dist(-2.0f, 2.0f);
    std::vector<float> x(static_cast<size_t>(n * k));
    for (float &v : x) {
        v = dist(rng);
        if (tiny && rng() % 3 == 0) v = std::ldexp(v, -120 - static_cast<int>(rng() % 12));
    }
    return x;
}

struct Scratch {
    std::vector<uint16_t> codes;
    std::vector<float> scales;
    ActScratch view;
    explicit Scratch(int64_t values) : codes(static_cast<size_t>(values)), scales(static_cast<size_t>(values)) {
        view = ActScratch{codes.data(), values, scales.data(), values};
    }
};

std::vector<float> run_device(int threads, const std::vector<float> &x, int64_t n, const WeightRef &w) {
    ThreadPool pool(threads);
    Scratch s(n * w.cols);
    std::vector<float> y(static_cast<size_t>(n * w.rows), -1.0f);
    matmul(pool, x.data(), n, w, y.data(), &s.view);
    return y;
}

int64_t bit_mismatches(const std::vector<float> &a, const std::vector<float> &b) {
    if (a.size() != b.size()) return -1;
    int64_t bad = 0;
    for (size_t i = 0; i < a.size(); ++i) bad += std::memcmp(&a[i], &b[i], sizeof(float)) != 0;
    return bad;
}

TEST(MatmulDevice, EveryPathEqualsTheDocumentedLoop) {
    const IsaGuard guard;
    struct Shape {
        int64_t n, rows, cols;
    };
    const Shape shapes[] = {{1, 37, 256}, {3, 9, 100}, {5, 16, 300}, {9, 6, 1280},  {2, 4, 32},
                            {4, 5, 129},  {2, 24, 300}, {7, 48, 130}, {4, 17, 258}};
    for (ProductIsa isa : supported_isas()) {
        ASSERT_TRUE(force_product_isa(isa));
        for (const Shape &s : shapes) {
            for (const bool tiny : {false, true}) {
                for (const DType dt : {DType::kBF16, DType::kF8E4M3}) {
                    const ActRounding act = dt == DType::kBF16 ? ActRounding::kBf16 : ActRounding::kE4m3x128;
                    const Weight w = make_weight(dt, s.rows, s.cols, static_cast<uint32_t>(s.cols + s.rows), tiny);
                    const std::vector<float> x = activations(s.n, s.cols, static_cast<uint32_t>(s.n * 7 + 1), tiny);
                    const std::vector<float> want = ref_device(x, s.n, w, act, 0, s.cols);
                    for (const bool panels : {false, true}) {
                        const Viewed v = view(w.ref(act), panels);
                        EXPECT_EQ(bit_mismatches(run_device(2, x, s.n, v.ref), want), 0)
                            << product_isa_name(isa) << " " << dtype_name(dt) << " [" << s.n << ", " << s.cols
                            << "] x [" << s.rows << "] tiny " << tiny << " panels " << v.ref.panels.rows;
                    }
                }
            }
        }
    }
}

// Prefill-sized products: many tokens per thread, so the AVX2 path packs panels of activations (fp8 rows
// converted per block of 16), with token tails, row-block tails, several panels (K = 8192 holds 6 tokens a
// panel), a K past what a panel holds (8320: the unpacked tiles) and the canonical blocks of K = 1280 (160
// wide: segments that end in a partial group). Every path must still equal the documented loop.
TEST(MatmulDevice, PrefillSizedProductsEqualTheDocumentedLoop) {
    const IsaGuard guard;
    struct Shape {
        int64_t n, rows, cols;
    };
    const Shape shapes[] = {{13, 20, 1280}, {40, 33, 300}, {19, 3, 8192}, {8, 2, 8320}};
    for (ProductIsa isa : supported_isas()) {
        ASSERT_TRUE(force_product_isa(isa));
        for (const DType dt : {DType::kBF16, DType::kF8E4M3}) {
            const ActRounding act = dt == DType::kBF16 ? ActRounding::kBf16 : ActRounding::kE4m3x128;
            for (const Shape &s : shapes) {
                const Weight w = make_weight(dt, s.rows, s.cols, static_cast<uint32_t>(s.cols + 3 * s.rows), true);
                const std::vector<float> x = activations(s.n, s.cols, static_cast<uint32_t>(s.n + 5), true);
                const std::vector<float> want = ref_device(x, s.n, w, act, 0, s.cols);
                for (const bool panels : {false, true}) {
                    const Viewed v = view(w.ref(act), panels);
                    EXPECT_EQ(bit_mismatches(run_device(1, x, s.n, v.ref), want), 0)
                        << product_isa_name(isa) << " " << dtype_name(dt) << " [" << s.n << ", " << s.cols << "] x ["
                        << s.rows << "] panels " << v.ref.panels.rows;
                }
            }
            if (dt != DType::kBF16) continue;  // row-parallel products are bf16 (e4m3 groups span whole K)
            const Shape &blocks = shapes[0];
            const Weight w = make_weight(dt, blocks.rows, blocks.cols, 21, true);
            const std::vector<float> x = activations(blocks.n, blocks.cols, 22, true);
            ThreadPool pool(1);
            Scratch scratch(blocks.n * blocks.cols);
            for (const bool panels : {false, true}) {
                const Viewed v = view(w.ref(act), panels);
                std::vector<float> part(static_cast<size_t>(8 * blocks.n * blocks.rows));
                matmul_block_partials(pool, x.data(), blocks.n, v.ref, 0, 8, part.data(), &scratch.view);
                for (int64_t b = 0; b < 8; ++b) {
                    const auto first = part.begin() + b * blocks.n * blocks.rows;
                    EXPECT_EQ(bit_mismatches(std::vector<float>(first, first + blocks.n * blocks.rows),
                                             ref_device(x, blocks.n, w, act, b * 160, (b + 1) * 160)),
                              0)
                        << product_isa_name(isa) << " " << dtype_name(dt) << " block " << b << " panels " << panels;
                }
            }
        }
    }
}

// Lanes built so that products underflow below FLT_MIN and running sums land on denormals: FTZ and DAZ
// decide the bits, and every path must decide them alike.
TEST(MatmulDevice, PathsAgreeWhereFlushingDecides) {
    const IsaGuard guard;
    const int64_t k = 64;
    const int64_t rows = 8;
    Weight w;
    w.dtype = DType::kBF16;
    w.rows = rows;
    w.cols = k;
    std::vector<uint16_t> h(static_cast<size_t>(rows * k));
    std::mt19937 rng(7);
    for (size_t i = 0; i < h.size(); ++i) {
        // Products near 2^-126: weights around 2^-63 times activations around 2^-63, some denormal weights.
        float v = std::ldexp(1.0f + static_cast<float>(rng() % 128) / 128.0f, -63 - static_cast<int>(rng() % 3));
        if (rng() % 2) v = -v;
        if (i % 11 == 0) v = std::ldexp(static_cast<float>(rng() % 100 + 1), -140);  // a bf16 denormal
        h[i] = f32_to_bf16(v);
    }
    w.elem.resize(h.size());
    for (size_t i = 0; i < h.size(); ++i) w.elem[i] = bf16_to_f32(h[i]);
    w.bytes.assign(reinterpret_cast<const uint8_t *>(h.data()), reinterpret_cast<const uint8_t *>(h.data() + h.size()));
    std::vector<float> x(static_cast<size_t>(3 * k));
    for (float &v : x) {
        v = std::ldexp(1.0f + static_cast<float>(rng() % 128) / 128.0f, -63 - static_cast<int>(rng() % 3));
        if (rng() % 2) v = -v;
    }
    const std::vector<float> ref = ref_device(x, 3, w, ActRounding::kBf16, 0, k);
    int64_t zeros = 0;
    for (float v : ref) zeros += v == 0.0f;
    for (ProductIsa isa : supported_isas()) {
        ASSERT_TRUE(force_product_isa(isa));
        EXPECT_EQ(bit_mismatches(run_device(1, x, 3, w.ref(ActRounding::kBf16)), ref), 0) << product_isa_name(isa);
    }
    // The flushing is what this test is about: some sums came out as zeros or denormal-range cuts.
    EXPECT_GT(zeros, 0);
}

TEST(MatmulDevice, RoundActivationsFollowsTheDefinition) {
    ThreadPool pool(2);
    const int64_t n = 3;
    const int64_t k = 300;  // groups of 128, 128 and a partial 44
    std::vector<float> x = activations(n, k, 11);
    for (int64_t i = 128; i < 256; ++i) x[static_cast<size_t>(i)] = 0.0f;     // token 0, group 1: amax 0
    x[static_cast<size_t>(k + 5)] = 1000.0f;                                   // token 1, group 0: saturates to 448
    x[static_cast<size_t>(2 * k + 260)] = std::nanf("");                       // token 2, partial group: NaN
    Scratch s(n * k);
    for (const ActRounding act : {ActRounding::kBf16, ActRounding::kE4m3x128}) {
        round_activations(pool, x.data(), n, k, act, s.view);
        const Rounded ref = ref_round(x, n, k, act);
        for (int64_t i = 0; i < n * k; ++i) {
            const float got = bf16_to_f32(s.codes[static_cast<size_t>(i)]);
            const float want = ref.val[static_cast<size_t>(i)];
            EXPECT_TRUE(std::memcmp(&got, &want, 4) == 0 || (std::isnan(got) && std::isnan(want))) << i;
        }
        if (act == ActRounding::kE4m3x128) {
            for (int64_t i = 0; i < n * 3; ++i) EXPECT_EQ(s.scales[static_cast<size_t>(i)], ref.scale[static_cast<size_t>(i)]) << i;
            EXPECT_EQ(s.scales[1], 1.0f);  // amax 0 -> scale 1 and zero codes
            EXPECT_EQ(s.codes[200], 0);
            EXPECT_EQ(bf16_to_f32(s.codes[static_cast<size_t>(k + 5)]), 448.0f);
            EXPECT_EQ(s.scales[3], 1000.0f / 448.0f);
        }
    }
}

// Every path rounds adversarial rows to the same codes and scales as the definition: random bit patterns (NaN,
// Inf, denormals), values on and next to the e4m3 rounding ties of their group's scale (normal and subnormal
// codes, the 464 saturation edge), signed zeros, and groups whose scale underflows.
TEST(MatmulDevice, RoundingPathsAgreeOnAdversarialRows) {
    const IsaGuard guard;
    ThreadPool pool(1);
    const int64_t k = 300;  // groups of 128, 128 and 44
    const int64_t n = 64;
    std::mt19937 rng(3);
    std::vector<float> x(static_cast<size_t>(n * k));
    for (int64_t t = 0; t < n; ++t) {
        for (int64_t g0 = 0; g0 < k; g0 += 128) {
            const int mode = static_cast<int>(rng() % 4);
            const float scale = std::ldexp(1.0f, static_cast<int>(rng() % 240) - 140);
            for (int64_t i = g0; i < std::min(k, g0 + 128); ++i) {
                float v = 0.0f;
                const uint32_t bits = static_cast<uint32_t>(rng());
                if (mode == 0) {
                    std::memcpy(&v, &bits, 4);
                } else if (mode == 1) {
                    // An e4m3 value or the midpoint to its neighbour, nudged by -1, 0 or +1 ulp, times the scale.
                    const uint8_t c = static_cast<uint8_t>(bits & 0x7e);
                    const float lo = fp8_e4m3_to_f32(c);
                    const float mid = (lo + fp8_e4m3_to_f32(static_cast<uint8_t>(c + 1))) / 2;
                    float q = bits & 0x100 ? mid : lo;
                    if (i == g0) q = (bits & 0x200) ? 448.0f : 464.0f;
                    q = std::nextafter(q, (bits & 0x400) ? 1e9f : -1e9f);
                    if (bits & 0x800) q = bits & 0x1000 ? std::nextafter(q, 1e9f) : q;
                    v = (bits & 0x2000 ? -q : q) * scale;
                } else if (mode == 2) {
                    v = bits & 1 ? -0.0f : 0.0f;
                } else {
                    v = std::ldexp(static_cast<float>(bits % 1000), -149);  // denormals: the scale underflows
                    if (bits & 0x10000) v = -v;
                }
                x[static_cast<size_t>(t * k + i)] = v;
            }
        }
    }
    for (const ActRounding act : {ActRounding::kBf16, ActRounding::kE4m3x128}) {
        const Rounded ref = ref_round(x, n, k, act);
        ASSERT_TRUE(force_product_isa(ProductIsa::kPortable));
        Scratch portable(n * k);
        round_activations(pool, x.data(), n, k, act, portable.view);
        for (ProductIsa isa : supported_isas()) {
            ASSERT_TRUE(force_product_isa(isa));
            Scratch s(n * k);
            round_activations(pool, x.data(), n, k, act, s.view);
            EXPECT_EQ(s.codes, portable.codes) << product_isa_name(isa);
            int64_t bad = 0;
            for (int64_t i = 0; i < n * k; ++i) {
                const float got = bf16_to_f32(s.codes[static_cast<size_t>(i)]);
                const float want = ref.val[static_cast<size_t>(i)];
                bad += !(std::memcmp(&got, &want, 4) == 0 || (std::isnan(got) && std::isnan(want)));
            }
            EXPECT_EQ(bad, 0) << product_isa_name(isa);
            if (act == ActRounding::kE4m3x128) {
                EXPECT_EQ(bit_mismatches(std::vector<float>(s.scales.begin(), s.scales.begin() + n * 3), ref.scale), 0)
                    << product_isa_name(isa);
            }
        }
    }
}

TEST(MatmulDevice, ThreadsTokensAndTilesDoNotChangeBits) {
    for (const DType dt : {DType::kBF16, DType::kF8E4M3}) {
        const ActRounding act = dt == DType::kBF16 ? ActRounding::kBf16 : ActRounding::kE4m3x128;
        const Weight w = make_weight(dt, 70, 384, 3);
        const int64_t n = 11;
        const std::vector<float> x = activations(n, 384, 5);
        const std::vector<float> all = run_device(1, x, n, w.ref(act));
        for (int threads : {2, 3, 5}) EXPECT_EQ(bit_mismatches(run_device(threads, x, n, w.ref(act)), all), 0);
        for (int64_t t = 0; t < n; ++t) {
            const std::vector<float> one(x.begin() + t * 384, x.begin() + (t + 1) * 384);
            const std::vector<float> y = run_device(2, one, 1, w.ref(act));
            EXPECT_EQ(bit_mismatches(y, std::vector<float>(all.begin() + t * 70, all.begin() + (t + 1) * 70)), 0);
        }
    }
}

// Row-parallel products over TP K windows of a weight, with or without its panels, finished by the tree.
void check_row_parallel(bool panels);

TEST(MatmulDevice, RowParallelRanksSumToTheWholeProduct) {
    for (const bool panels : {false, true}) check_row_parallel(panels);
}

TEST(MatmulDevice, PanelsFollowRowSlicesAndExperts) {
    // A row slice that starts on a panel keeps the panels from there; one that does not has none.
    const Weight w = make_weight(DType::kBF16, 48, 64, 3);
    const Viewed v = view(w.ref(ActRounding::kBf16), true);
    ASSERT_EQ(v.ref.panels.rows, 48);
    EXPECT_EQ(weight_row_slice(v.ref, 16, 48).panels.rows, 32);
    EXPECT_EQ(weight_row_slice(v.ref, 16, 40).panels.rows, 16);
    EXPECT_EQ(weight_row_slice(v.ref, 8, 48).panels.data, nullptr);
    EXPECT_EQ(weight_row_slice(v.ref, 32, 40).panels.data, nullptr);
    // Not a device product, or an odd K: no panels to make.
    EXPECT_EQ(device_panels_bytes(w.ref(ActRounding::kNone)), 0);
    EXPECT_EQ(device_panels_bytes(make_weight(DType::kBF16, 16, 65, 3).ref(ActRounding::kBf16)), 0);
    EXPECT_EQ(device_panels_bytes(make_weight(DType::kBF16, 15, 64, 3).ref(ActRounding::kBf16)), 0);
    // A bank of 3 fp8 experts: each expert's panels equal those of the expert made alone, also in a window.
    const Weight bank_w = make_weight(DType::kF8E4M3, 3 * 32, 256, 5);
    WeightBankRef bank;
    bank.dtype = DType::kF8E4M3;
    bank.data = bank_w.bytes.data();
    bank.n_experts = 3;
    bank.rows = 32;
    bank.cols = 256;
    bank.scale_inv = bank_w.scale.data();
    bank.act = ActRounding::kE4m3x128;
    const int64_t bytes = device_panels_bytes(weight_bank_expert(bank, 0));
    ASSERT_EQ(bytes, 32 * 256);
    std::vector<uint8_t> storage(static_cast<size_t>(3 * bytes) + 64);
    uint8_t *at = storage.data() + (64 - reinterpret_cast<uintptr_t>(storage.data()) % 64) % 64;
    ThreadPool pool(2);
    const WeightBankRef paneled = device_panels_fill(pool, bank, at);
    const WeightBankRef window = weight_bank_window(paneled, 1, 3);
    for (int64_t e = 0; e < 3; ++e) {
        const Viewed alone = view(weight_bank_expert(bank, e), true);
        const WeightRef from_bank = weight_bank_expert(paneled, e);
        ASSERT_EQ(from_bank.panels.rows, 32);
        EXPECT_EQ(std::memcmp(from_bank.panels.data, alone.ref.panels.data, static_cast<size_t>(bytes)), 0) << e;
        if (e > 0) {
            EXPECT_EQ(weight_bank_expert(window, e - 1).panels.data, from_bank.panels.data) << e;
        }
    }
}

void check_row_parallel(bool panels) {
    const Weight w = make_weight(DType::kBF16, 24, 1024, 9);
    const int64_t n = 5;
    const std::vector<float> x = activations(n, 1024, 13);
    ThreadPool pool(2);
    Scratch s(n * 1024);
    const Viewed viewed = view(w.ref(ActRounding::kBf16), panels);
    const WeightRef whole = viewed.ref;
    std::vector<float> ws(static_cast<size_t>(matmul_canonical_workspace_floats(n, whole)));
    std::vector<float> y(static_cast<size_t>(n * 24));
    matmul_canonical(pool, x.data(), n, whole, y.data(), ws.data(), &s.view);
    // Partials of each canonical block equal the documented loop over that block's K range.
    for (int64_t tp : {2, 4, 8}) {
        const int64_t cols = 1024 / tp;
        std::vector<float> sums(static_cast<size_t>(tp * n * 24));
        for (int64_t r = 0; r < tp; ++r) {
            const WeightRef win = weight_k_window(whole, r * cols, (r + 1) * cols);
            std::vector<float> xr(static_cast<size_t>(n * cols));
            for (int64_t t = 0; t < n; ++t) {
                std::memcpy(&xr[static_cast<size_t>(t * cols)], &x[static_cast<size_t>(t * 1024 + r * cols)],
                            static_cast<size_t>(cols) * 4);
            }
            std::vector<float> wr(static_cast<size_t>(matmul_canonical_workspace_floats(n, win)));
            matmul_canonical(pool, xr.data(), n, win, &sums[static_cast<size_t>(r * n * 24)], wr.data(), &s.view);
        }
        std::vector<float> combined(static_cast<size_t>(n * 24));
        canonical_tree_combine(sums.data(), tp, n * 24, combined.data());
        EXPECT_EQ(bit_mismatches(combined, y), 0) << "TP " << tp;
    }
    std::vector<float> part(static_cast<size_t>(8 * n * 24));
    matmul_block_partials(pool, x.data(), n, whole, 0, 8, part.data(), &s.view);
    const std::vector<float> ref3 = ref_device(x, n, w, ActRounding::kBf16, 3 * 128, 4 * 128);
    EXPECT_EQ(bit_mismatches(std::vector<float>(part.begin() + 3 * n * 24, part.begin() + 4 * n * 24), ref3), 0);
}

TEST(MatmulDevice, DeviceProductsDifferFromExactOnes) {
    const Weight w = make_weight(DType::kBF16, 16, 512, 21);
    const std::vector<float> x = activations(2, 512, 23);
    ThreadPool pool(1);
    std::vector<float> exact(32);
    matmul(pool, x.data(), 2, w.ref(ActRounding::kNone), exact.data());
    EXPECT_GT(bit_mismatches(run_device(1, x, 2, w.ref(ActRounding::kBf16)), exact), 16);
}

}  // namespace
}  // namespace memra::cpu
