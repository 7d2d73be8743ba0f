// Scalar math shared by the CPU backend and the CUDA kernels (DETERMINISM.md rule 7, D6): exp, sigmoid,
// silu, rsqrt and the canonical 16-lane row reduction. Every function is MEMRA_HD, calls no libm and no CUDA
// intrinsic, and uses no fused multiply-add (host builds with -ffp-contract=off, device with --fmad=false),
// so both sides perform the same IEEE operations in the same order and get the same bits.
#pragma once

#include <cstdint>

#include "core/float_formats.h"
#include "core/hd.h"

#if !defined(__CUDA_ARCH__) && defined(__SSE2__)
#include <xmmintrin.h>
#endif

namespace memra {

// Checked on an H200 (sm_90a, --fmad=false): exp/sigmoid/silu/rsqrt agree with the host over all 2^32 inputs,
// and dot_f32/sum_squares_f32 over 4096 random rows of 1000. Only a NaN result's sign and payload may differ
// (x86 makes 0xffc00000 where the GPU makes 0x7fffffff), so NaNs compare as NaNs, not by bits.

// ---------------------------------------------------------------------------------------------
// sqrt_f32: the IEEE square root, correctly rounded on both sides. On x86 hosts it is the sqrtss
// instruction itself: __builtin_sqrtf under the default -fmath-errno still branches to the libm sqrtf
// for negative inputs (to set errno), which this avoids. Device code gets sqrt.rn.f32 from sqrtf
// (nvcc's default -prec-sqrt=true; never build with --use_fast_math). sqrt(-x) = NaN, sqrt(-0) = -0.
MEMRA_HD float sqrt_f32(float x) {
#if defined(__CUDA_ARCH__)
    return sqrtf(x);
#elif defined(__SSE2__)
    return _mm_cvtss_f32(_mm_sqrt_ss(_mm_set_ss(x)));
#else
    return __builtin_sqrtf(x);
#endif
}

// rsqrt_f32(x) = 1.0f / sqrt_f32(x): two correctly rounded operations (not a hardware rsqrt
// approximation). rsqrt(0) = +Inf, rsqrt(+Inf) = 0, rsqrt(x < 0) = NaN.
MEMRA_HD float rsqrt_f32(float x) { return 1.0f / sqrt_f32(x); }

// ---------------------------------------------------------------------------------------------
// exp_f32: e^x for every float x, max error 0.77 ulp (measured over all 2^32 inputs against double-precision
// exp; subnormal results are measured in units of 2^-149; tests/cpu/test_ops_math.cpp re-checks a sample and
// a fine grid). Exact operation order:
//   1. NaN -> returned quieted (x + x); x > 89 -> +Inf; x < -104 -> +0 (e^89 > FLT_MAX and e^-104 < 2^-150,
//      half the smallest subnormal, so both limits round that way).
//   2. t = x * kLog2e; k = int(t + (t >= 0 ? 0.5f : -0.5f)) (float add, then truncation toward zero: round to
//      nearest, ties away; a k off by one next to a tie only makes |r| slightly larger than ln2 / 2).
//   3. kf = float(k); hi = x - kf * kLn2Hi; lo = kf * kLn2Lo; r = hi - lo. kLn2Hi has 15 significant bits, so
//      kf * kLn2Hi is exact for |k| <= 151 and hi is exact (Sterbenz); |r| <= ~0.35.
//   4. q = ((((c7 * r + c6) * r + c5) * r + c4) * r + c3) * r + c2 with c_n = float(1 / n!) (Taylor; the
//      truncation error r^8 / 8! is below 0.13 ulp on |r| <= 0.35).
//   5. p = e^r as a compensated 1 + hi - lo + r^2 q: a = 1 + hi; ea = (1 - a) + hi (the exact rounding error
//      of a, since |hi| < 1); c = ea - (lo - (r * r) * q); p = a + c. Only the last add rounds noticeably.
//   6. Scale by 2^k with exact power-of-two multiplies: k in [-126, 127]: p * 2^k (exact); k = 128:
//      (p * 2^127) * 2 (overflows to +Inf where e^x does); k < -126: (p * 2^(k+126)) * 2^-126, where the
//      first product is exact and the second rounds once into the subnormal range.
MEMRA_HD float exp_f32(float x) {
    if (x != x) return x + x;
    if (x > 89.0f) return u32_as_f32(0x7f800000u);
    if (x < -104.0f) return 0.0f;
    const float kLog2e = 1.44269504088896341f;
    const float kLn2Hi = u32_as_f32(0x3f317200u);  // 0.693145751953125
    const float kLn2Lo = u32_as_f32(0x35bfbe8eu);  // ln 2 - kLn2Hi = 1.42860677e-6
    const float t = x * kLog2e;
    const int k = static_cast<int>(t + (t >= 0.0f ? 0.5f : -0.5f));
    const float kf = static_cast<float>(k);
    const float hi = x - kf * kLn2Hi;
    const float lo = kf * kLn2Lo;
    const float r = hi - lo;
    float q = 1.0f / 5040.0f;
    q = q * r + 1.0f / 720.0f;
    q = q * r + 1.0f / 120.0f;
    q = q * r + 1.0f / 24.0f;
    q = q * r + 1.0f / 6.0f;
    q = q * r + 0.5f;
    const float a = 1.0f + hi;
    const float ea = (1.0f - a) + hi;
    const float c = ea - (lo - (r * r) * q);
    const float p = a + c;
    if (k > 127) return (p * u32_as_f32(254u << 23)) * 2.0f;
    if (k < -126) return (p * u32_as_f32(static_cast<uint32_t>(k + 126 + 127) << 23)) * u32_as_f32(1u << 23);
    return p * u32_as_f32(static_cast<uint32_t>(k + 127) << 23);
}

// sigmoid_f32(x) = 1 / (1 + e^-x), evaluated so that nothing overflows:
//   x >= 0: 1.0f / (1.0f + exp_f32(-x))
//   x <  0: e / (1.0f + e) with e = exp_f32(x)   (the same value; e^-x would overflow for x < -88.7)
// sigmoid(+Inf) = 1, sigmoid(-Inf) = 0, NaN -> NaN. Tiny negative results keep their subnormal bits.
// Max error measured over every 16th float: 2.40 ulp.
MEMRA_HD float sigmoid_f32(float x) {
    if (x >= 0.0f) return 1.0f / (1.0f + exp_f32(-x));
    const float e = exp_f32(x);
    return e / (1.0f + e);
}

// silu_f32(x) = x * sigmoid_f32(x) (one rounded multiply). silu(-Inf) = -Inf * 0 = NaN, as in torch.
// Max error 3.18 ulp for x >= -87 (measured over every 7th float); below, sigmoid(x) is subnormal and the
// product keeps only an absolute accuracy of about |x| * 2^-149.
MEMRA_HD float silu_f32(float x) { return x * sigmoid_f32(x); }

// One SwiGLU value with the Step clamp (limit 0 = off): min(silu(g), limit) * clamp(u, -limit, limit), each clamp a
// compare and select that keeps a NaN (a min/max instruction would turn it into the limit). cpu::swiglu,
// cuda::swiglu and the CUDA experts' fused activation all use it.
MEMRA_HD float swiglu_f32(float g, float u, float limit) {
    float act = silu_f32(g);
    if (limit > 0.0f) {
        act = act > limit ? limit : act;
        u = u < -limit ? -limit : (u > limit ? limit : u);
    }
    return act * u;
}

// ---------------------------------------------------------------------------------------------
// The canonical row reduction (DETERMINISM.md rule 1): a sum over n terms v_i (i = 0..n-1) is formed in
// 16 lanes and a fixed pairwise tree, whatever the thread count or kernel (the same lane assignment and
// tree as the CPU matmul's K loop within one chunk):
//   lane[l] = +0 for l = 0..15;  for i = 0..n-1 in increasing i: lane[i % 16] = lane[i % 16] + v_i
//   result = (((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7))) + (((l8+l9)+(l10+l11))+((l12+l13)+(l14+l15)))
// A warp gets the same bits with lane l striding by 16 and a shfl_xor butterfly over offsets 1, 2, 4, 8
// (IEEE addition is commutative). Each term v_i is rounded before it is added.

inline constexpr int kReduceLanes = 16;

// Folds the 16 lane partials with the fixed tree above (level w adds lane l + w into lane l for every l
// that is a multiple of 2w, for w = 1, 2, 4, 8); `lane` is overwritten.
MEMRA_HD float reduce_lanes_tree(float *lane) {
    for (int w = 1; w < kReduceLanes; w *= 2) {
        for (int l = 0; l < kReduceLanes; l += 2 * w) lane[l] = lane[l] + lane[l + w];
    }
    return lane[0];
}

// sum over i of (x_i * x_i) in the canonical order. (Written as whole groups of 16 and a tail so that
// compilers can vectorise the lanes; the order is exactly the one defined above.)
MEMRA_HD float sum_squares_f32(const float *x, int64_t n) {
    float lane[kReduceLanes] = {};
    const int64_t n_full = n - n % kReduceLanes;
    for (int64_t i = 0; i < n_full; i += kReduceLanes) {
        for (int l = 0; l < kReduceLanes; ++l) lane[l] = lane[l] + x[i + l] * x[i + l];
    }
    for (int64_t i = n_full; i < n; ++i) {
        const int l = static_cast<int>(i - n_full);
        lane[l] = lane[l] + x[i] * x[i];
    }
    return reduce_lanes_tree(lane);
}

// sum over i of (a_i * b_i) in the canonical order.
MEMRA_HD float dot_f32(const float *a, const float *b, int64_t n) {
    float lane[kReduceLanes] = {};
    const int64_t n_full = n - n % kReduceLanes;
    for (int64_t i = 0; i < n_full; i += kReduceLanes) {
        for (int l = 0; l < kReduceLanes; ++l) lane[l] = lane[l] + a[i + l] * b[i + l];
    }
    for (int64_t i = n_full; i < n; ++i) {
        const int l = static_cast<int>(i - n_full);
        lane[l] = lane[l] + a[i] * b[i];
    }
    return reduce_lanes_tree(lane);
}

}  // namespace memra
