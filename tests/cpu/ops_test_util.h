// Shared helpers of the CPU op tests: seeded random data, raw-bit comparison, ulp distance against a
// double-precision value, and an independent spelling of the canonical 16-lane reduction order.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "backend/cpu/matmul.h"

namespace memra::cpu::test {

inline uint32_t bits(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof(u));
    return u;
}

inline float from_bits(uint32_t u) {
    float f;
    std::memcpy(&f, &u, sizeof(f));
    return f;
}

// A dense weight view of test-owned bytes [rows, cols] (fp8: with its scale grid).
inline WeightRef weight_view(DType dtype, const void *data, int64_t rows, int64_t cols, const float *scale_inv,
                             ActRounding act = ActRounding::kNone) {
    WeightRef w;
    w.dtype = dtype;
    w.data = data;
    w.rows = rows;
    w.cols = cols;
    w.scale_inv = dtype == DType::kF8E4M3 ? scale_inv : nullptr;
    w.act = act;
    return w;
}

// n floats uniform in [lo, hi), from a fixed seed.
inline std::vector<float> random_floats(size_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
    std::mt19937 gen(seed);
    std::uniform_real_distribution<float> dist(lo, hi);
    std::vector<float> v(n);
    for (float &x : v) x = dist(gen);
    return v;
}

// Number of elements whose bit patterns differ (NaNs compare by bits too).
inline int64_t bit_mismatches(const std::vector<float> &a, const std::vector<float> &b) {
    if (a.size() != b.size()) return -1;
    int64_t n = 0;
    for (size_t i = 0; i < a.size(); ++i) n += bits(a[i]) != bits(b[i]) ? 1 : 0;
    return n;
}

#define MEMRA_EXPECT_SAME_BITS(a, b) EXPECT_EQ(::memra::cpu::test::bit_mismatches((a), (b)), 0)

// |got - exact| in units of the float ulp at `exact` (2^-149 in the subnormal range). Infinite exact values
// (beyond the float range) must be matched exactly; returns 1e30 on any NaN/Inf disagreement.
inline double ulp_error(float got, double exact) {
    if (std::isnan(exact)) return std::isnan(got) ? 0.0 : 1e30;
    if (std::isnan(got)) return 1e30;
    const float exact_f = static_cast<float>(exact);
    if (std::isinf(exact_f) || std::isinf(got)) return got == exact_f ? 0.0 : 1e30;
    if (exact == 0.0) return std::fabs(static_cast<double>(got)) / std::ldexp(1.0, -149);
    int e = 0;
    std::frexp(std::fabs(exact), &e);  // |exact| = m * 2^e, m in [0.5, 1): float ulp is 2^(e - 24)
    const int ulp_exp = e - 24 < -149 ? -149 : e - 24;
    return std::fabs(static_cast<double>(got) - exact) / std::ldexp(1.0, ulp_exp);
}

// The canonical reduction of core/math.h, spelled out independently: lane i % 16, then the explicit tree
// (((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7))) + (((l8+l9)+(l10+l11))+((l12+l13)+(l14+l15))).
inline float canonical_sum(const std::vector<float> &terms) {
    float l[16] = {};
    for (size_t i = 0; i < terms.size(); ++i) l[i % 16] = l[i % 16] + terms[i];
    const float a = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
    const float b = ((l[8] + l[9]) + (l[10] + l[11])) + ((l[12] + l[13]) + (l[14] + l[15]));
    return a + b;
}

inline float canonical_dot(const float *a, const float *b, int64_t n) {
    std::vector<float> terms(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) terms[static_cast<size_t>(i)] = a[i] * b[i];
    return canonical_sum(terms);
}

inline uint16_t to_bf16_trunc(float f) { return static_cast<uint16_t>(bits(f) >> 16); }

inline float bf16_value(uint16_t h) { return from_bits(static_cast<uint32_t>(h) << 16); }

inline constexpr int kThreadCounts[] = {1, 2, 3, 8};

// Restores the instruction path the kernels run on (force_product_isa) when a test that switches it ends.
struct IsaGuard {
    ProductIsa saved = product_isa();
    ~IsaGuard() { force_product_isa(saved); }
};

// The instruction paths this CPU runs, kPortable (the reference) first.
inline std::vector<ProductIsa> supported_isas() {
    std::vector<ProductIsa> v;
    for (ProductIsa isa : {ProductIsa::kPortable, ProductIsa::kAvx2Fma, ProductIsa::kAvx512Bf16}) {
        if (product_isa_supported(isa)) v.push_back(isa);
    }
    return v;
}

}  // namespace memra::cpu::test
