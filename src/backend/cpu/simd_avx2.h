// AVX2 lanes that compute exactly what the scalar functions of core/float_formats.h and core/math.h compute,
// value by value (ENGINE.md section 4: results never depend on the instruction set). Each lane performs the
// scalar operations of its value in the scalar order: _mm256_mul_ps then _mm256_add_ps for every a * b + c (the
// host code is built with -ffp-contract=off, so the scalar code never fuses either), IEEE mode (no FTZ/DAZ), and
// only exact integer steps in the bit-level functions. Included by the CPU kernels that have AVX2 paths; callers
// run them only where product_isa() is not kPortable, and tests compare them with the scalar functions.
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>

#include <limits>

#include "core/float_formats.h"
#define MEMRA_X86 1

namespace memra::cpu::simd {

#pragma GCC push_options
#pragma GCC target("avx2")
#define MEMRA_AVX2 [[gnu::always_inline]] inline

// round_to_bf16 lane-wise (float_formats.h f32_to_bf16, then the widening): a NaN becomes the quiet NaN
// 0x7fc00000 with its sign; anything else adds 0x7fff plus the kept LSB and drops the low 16 bits.
MEMRA_AVX2 __m256 round_bf16_8(__m256 x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb),
                                       _mm256_set1_epi32(static_cast<int>(0xffff0000u)));
    const __m256i quiet = _mm256_or_si256(_mm256_and_si256(u, _mm256_set1_epi32(static_cast<int>(0x80000000u))),
                                          _mm256_set1_epi32(0x7fc00000));
    return _mm256_castsi256_ps(_mm256_blendv_epi8(r, quiet, nan));
}

// exp_f32 (core/math.h) lane-wise, step by step. Every lane runs steps 2-6 with the same operations (t >= 0
// picks +-0.5; the truncating conversion is static_cast<int>), and the lanes that step 1 decides (NaN, x > 89,
// x < -104) then take its result by a blend. Step 6 as one formula, y = (p * 2^k1) * f: k1 = 127, f = 2 for
// k > 127; k1 = k + 126, f = 2^-126 for k < -126; k1 = k, f = 1 otherwise (a multiply by 1 returns its operand
// exactly, so the only rounding there is p * 2^k, as in the scalar code).
MEMRA_AVX2 __m256 exp_8(__m256 x) {
    const __m256 one = _mm256_set1_ps(1.0f);
    const float kLog2e = 1.44269504088896341f;
    const float kLn2Hi = u32_as_f32(0x3f317200u);
    const float kLn2Lo = u32_as_f32(0x35bfbe8eu);
    const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(kLog2e));
    const __m256 half = _mm256_blendv_ps(_mm256_set1_ps(-0.5f), _mm256_set1_ps(0.5f),
                                         _mm256_cmp_ps(t, _mm256_setzero_ps(), _CMP_GE_OQ));
    const __m256i k = _mm256_cvttps_epi32(_mm256_add_ps(t, half));
    const __m256 kf = _mm256_cvtepi32_ps(k);
    const __m256 hi = _mm256_sub_ps(x, _mm256_mul_ps(kf, _mm256_set1_ps(kLn2Hi)));
    const __m256 lo = _mm256_mul_ps(kf, _mm256_set1_ps(kLn2Lo));
    const __m256 r = _mm256_sub_ps(hi, lo);
    __m256 q = _mm256_set1_ps(1.0f / 5040.0f);
    q = _mm256_add_ps(_mm256_mul_ps(q, r), _mm256_set1_ps(1.0f / 720.0f));
    q = _mm256_add_ps(_mm256_mul_ps(q, r), _mm256_set1_ps(1.0f / 120.0f));
    q = _mm256_add_ps(_mm256_mul_ps(q, r), _mm256_set1_ps(1.0f / 24.0f));
    q = _mm256_add_ps(_mm256_mul_ps(q, r), _mm256_set1_ps(1.0f / 6.0f));
    q = _mm256_add_ps(_mm256_mul_ps(q, r), _mm256_set1_ps(0.5f));
    const __m256 a = _mm256_add_ps(one, hi);
    const __m256 ea = _mm256_add_ps(_mm256_sub_ps(one, a), hi);
    const __m256 c = _mm256_sub_ps(ea, _mm256_sub_ps(lo, _mm256_mul_ps(_mm256_mul_ps(r, r), q)));
    const __m256 p = _mm256_add_ps(a, c);
    const __m256i big = _mm256_cmpgt_epi32(k, _mm256_set1_epi32(127));
    const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(-126), k);
    __m256i k1 = _mm256_blendv_epi8(k, _mm256_add_epi32(k, _mm256_set1_epi32(126)), small);
    k1 = _mm256_blendv_epi8(k1, _mm256_set1_epi32(127), big);
    __m256 f = _mm256_blendv_ps(one, _mm256_castsi256_ps(_mm256_set1_epi32(1 << 23)), _mm256_castsi256_ps(small));
    f = _mm256_blendv_ps(f, _mm256_set1_ps(2.0f), _mm256_castsi256_ps(big));
    const __m256 pow2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k1, _mm256_set1_epi32(127)), 23));
    __m256 y = _mm256_mul_ps(_mm256_mul_ps(p, pow2), f);
    y = _mm256_blendv_ps(y, _mm256_set1_ps(std::numeric_limits<float>::infinity()),
                         _mm256_cmp_ps(x, _mm256_set1_ps(89.0f), _CMP_GT_OQ));
    y = _mm256_blendv_ps(y, _mm256_setzero_ps(), _mm256_cmp_ps(x, _mm256_set1_ps(-104.0f), _CMP_LT_OQ));
    return _mm256_blendv_ps(y, _mm256_add_ps(x, x), _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

// sigmoid_f32 lane-wise: 1 / (1 + exp(-x)) for x >= 0, e / (1 + e) with e = exp(x) otherwise (a NaN takes the
// second branch, as in the scalar code, and stays NaN).
MEMRA_AVX2 __m256 sigmoid_8(__m256 x) {
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 nonneg = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ);
    const __m256 e = exp_8(_mm256_blendv_ps(x, _mm256_xor_ps(x, _mm256_set1_ps(-0.0f)), nonneg));
    const __m256 den = _mm256_add_ps(one, e);
    return _mm256_blendv_ps(_mm256_div_ps(e, den), _mm256_div_ps(one, den), nonneg);
}

#undef MEMRA_AVX2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,avx512f")
// Lane i of the result: lanes 2i and 2i+1 of a ++ b added (i < 8 from a, i >= 8 from b). The 16-lane tree of
// core/math.h is a balanced tree of adjacent pairs, so levels of pair_sums reduce several accumulators' trees at
// once (for the AVX-512 paths).
[[gnu::always_inline]] inline __m512 pair_sums(__m512 a, __m512 b) {
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    return _mm512_add_ps(_mm512_permutex2var_ps(a, even, b), _mm512_permutex2var_ps(a, odd, b));
}
#pragma GCC pop_options

}  // namespace memra::cpu::simd

#else
#define MEMRA_X86 0
#endif
